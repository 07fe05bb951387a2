"""The exception type of expected user errors: bad input, not a bug.

A `UserError` says what the user gave that cannot work (a config value, a model directory,
a tokenizer, a dataset file or row, a run directory, a mesh size, a reward, a checkpoint):
its message names the field or file (and the line, for a malformed JSONL row) and what is
allowed. The `grpojax` command prints it as one line on stderr and exits 2; any other
exception is a bug and keeps its traceback.

`UserError` subclasses `ValueError`, and `MissingPathError` also `FileNotFoundError`, so
code that catches those keeps working. This module imports nothing from grpojax: every
layer (data, models, driver) can raise it.
"""

from __future__ import annotations

__all__ = ["MissingPathError", "UserError", "one_line"]


class UserError(ValueError):
    """Expected bad input; the message names the culprit and what is allowed."""


class MissingPathError(UserError, FileNotFoundError):
    """A file or directory the user named does not exist (or is not the kind expected)."""


def one_line(message: object) -> str:
    """`message` as one line: its non-blank lines joined with "; "."""
    lines = [line.strip() for line in str(message).splitlines() if line.strip()]
    return "; ".join(lines)
