"""User datasets: local JSONL / JSON / Parquet files through Hugging Face `datasets`.

`load_prompt_dataset` reads the files (no hub access), checks that the prompt template's
columns exist, and returns a `FormattedRows` view: each row gets its `prompt` (template and/or
chat template applied) and keeps every other column, which the driver passes to the reward
functions as keyword arguments (e.g. an `answer` column for the math reward).

A file that cannot be used is a `grpojax.errors.UserError` naming it: missing, empty, not
valid JSON Lines (with the line number, found by reading the file line by line once
`datasets` has failed, since its own error names neither file nor line), not Parquet, or
lacking the prompt template's columns. `datasets`' progress bars and log lines are off
while it reads the files.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Sequence

from grpojax.data.templates import FormattedRows, PromptFormatter
from grpojax.errors import MissingPathError, UserError

__all__ = ["FILE_FORMATS", "load_prompt_dataset", "load_rows"]

# File suffix -> the `datasets` packaged builder that reads it.
FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def _as_list(data_files: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    if isinstance(data_files, str | os.PathLike):
        return [os.fspath(data_files)]
    files = [os.fspath(f) for f in data_files]
    if not files:
        raise UserError("data_files is empty: give at least one .jsonl/.json/.parquet path")
    return files


def _infer_format(files: list[str]) -> str:
    builders = set()
    for f in files:
        suffix = os.path.splitext(f)[1].lower()
        if suffix not in FILE_FORMATS:
            raise UserError(
                f"cannot tell the format of {f!r} from its suffix; allowed suffixes "
                f"{sorted(FILE_FORMATS)}, or pass format='json'|'parquet'"
            )
        builders.add(FILE_FORMATS[suffix])
    if len(builders) > 1:
        raise UserError(f"data_files mix formats {sorted(builders)}; load them separately")
    return builders.pop()


@contextlib.contextmanager
def _quiet_datasets():
    """`datasets` without its progress bars and log lines (a failed read logs the error
    before raising it), restored afterwards."""
    import datasets

    bars = not datasets.are_progress_bars_disabled()
    logger = logging.getLogger("datasets")
    level = logger.level
    datasets.disable_progress_bars()
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)
        if bars:
            datasets.enable_progress_bars()


def _json_problem(path: str) -> str | None:
    """Where a JSON / JSON Lines file is malformed ("<file>, line <n>: ..."), or None."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except UnicodeDecodeError as e:
        return f"{path} is not UTF-8 text (byte {e.start})"
    if text.lstrip().startswith("["):  # one JSON array of objects
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            return f"{path}, line {e.lineno}: not valid JSON ({e.msg}, column {e.colno})"
        bad = [i for i, r in enumerate(rows) if not isinstance(r, dict)]
        if bad:
            return f"{path}: element {bad[0]} of the JSON array is not an object ({{...}})"
        return None
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            return f"{path}, line {lineno}: not valid JSON ({e.msg}, column {e.colno})"
        if not isinstance(row, dict):
            return (
                f"{path}, line {lineno}: each line must be one JSON object ({{...}}), got "
                f"{type(row).__name__}"
            )
    return None


def _parquet_problem(path: str) -> str | None:
    import pyarrow.parquet as pq

    try:
        pq.read_metadata(path)
    except Exception as e:  # ArrowInvalid, OSError, ...
        return f"{path} is not a readable Parquet file ({e})"
    return None


def _unreadable(files: list[str], builder: str, error: Exception) -> UserError:
    """The UserError for files `datasets` failed to read: the file (and line) at fault."""
    check = _json_problem if builder == "json" else _parquet_problem
    for f in files:
        problem = check(f)
        if problem is not None:
            return UserError(problem)
    cause = error.__cause__ or error
    return UserError(f"cannot read dataset {files} as {builder}: {type(cause).__name__}: {cause}")


def load_rows(
    data_files: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    format: str | None = None,
    cache_dir: str | os.PathLike | None = None,
):
    """The rows of local JSONL/JSON/Parquet files as a `datasets.Dataset` (one split).

    format: "json" (JSON Lines or a JSON array) or "parquet"; None infers it from the
    suffix. An empty file set is a ValueError naming the files.
    """
    import datasets

    files = _as_list(data_files)
    for f in files:
        if not os.path.isfile(f):
            raise MissingPathError(f"dataset file not found: {f!r}")
    builder = _infer_format(files) if format is None else format
    if builder not in ("json", "parquet"):
        raise UserError(f"format must be 'json' or 'parquet', got {format!r}")
    if all(os.path.getsize(f) == 0 for f in files):
        raise UserError(f"dataset {', '.join(files)} is empty: no rows")
    try:
        with _quiet_datasets():
            ds = datasets.load_dataset(
                builder,
                data_files=files,
                split="train",
                cache_dir=None if cache_dir is None else os.fspath(cache_dir),
            )
    except Exception as e:  # DatasetGenerationError, ArrowInvalid, ...: find the culprit
        raise _unreadable(files, builder, e) from None
    if len(ds) == 0:
        raise UserError(f"dataset {', '.join(files)} is empty: no rows")
    return ds


def load_prompt_dataset(
    data_files: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    template: str | None = None,
    tokenizer=None,
    chat: bool = False,
    system_prompt: str | None = None,
    prompt_column: str = "prompt",
    format: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    name: str | None = None,
) -> FormattedRows:
    """Local files -> rows with a formatted `prompt` column, ready for `PromptSource`.

    Args:
      data_files: one path or a list (.jsonl / .json / .parquet).
      template: `str.format` string over the columns, e.g. "Q: {question}\\nA:"; None uses
        the `prompt_column` as is.
      tokenizer, chat, system_prompt: `chat=True` applies the tokenizer's chat template to
        the templated text (or to a column of chat messages); see `PromptFormatter`.
      format, cache_dir: as in `load_rows`.
      name: the source name in errors and warnings (default: the file path(s)).

    Raises `grpojax.errors.UserError` (a ValueError) for an unreadable or empty dataset or a
    template naming a missing column.
    """
    files = _as_list(data_files)
    label = name if name is not None else (files[0] if len(files) == 1 else ",".join(files))
    rows = load_rows(files, format=format, cache_dir=cache_dir)
    formatter = PromptFormatter(
        template,
        tokenizer=tokenizer,
        chat=chat,
        system_prompt=system_prompt,
        prompt_column=prompt_column,
    )
    formatter.check_columns(rows.column_names, source=f"dataset {label!r}")
    view = FormattedRows(rows, formatter, name=label)
    try:
        _ = view[0]  # fail now, not mid-run, if the first row cannot be formatted
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise UserError(f"dataset {label!r}: cannot make a prompt of its first row: {e}") from None
    return view
