"""Checkpoints by Hugging Face Hub id: `Qwen/Qwen2.5-0.5B-Instruct` -> a local directory.

`resolve_checkpoint(source, revision=None)` returns `source` itself when it is an existing
local directory or a `.gguf` file (`grpojax.models.gguf_io`); otherwise it reads `source` as
a Hub repository id and returns the directory of its snapshot in the Hub's cache
(`huggingface_hub.snapshot_download`), which downloads the files a checkpoint needs (config,
`*.safetensors`, tokenizer and generation files; never `*.bin`, `*.pt`, GGUF or ONNX) when
they are not cached yet. The Hub's own settings apply: `HF_HUB_CACHE` / `HF_HOME` (where the
cache is), `HF_HUB_OFFLINE=1` (cache only, no network), `HF_TOKEN` (private or gated
repositories). `revision` pins a branch, a tag or a commit. Every failure is one `UserError`
naming the id, the revision and why.
"""

from __future__ import annotations

import pathlib
import re

from grpojax.errors import MissingPathError, UserError, one_line

__all__ = ["CHECKPOINT_FILES", "is_hub_id", "resolve_checkpoint"]

# What a checkpoint directory needs (`from_pretrained`, `load_tokenizer`): configs and
# tokenizer files (*.json, *.txt, *.model, *.jinja) and the safetensors weights.
CHECKPOINT_FILES = ("*.json", "*.safetensors", "*.txt", "*.model", "*.jinja")

# The Hub's repository ids: "name" or "owner/name"; letters, digits, "-", "_", "." (no
# leading or trailing "-" / ".", no "--" or ".."), at most 96 characters a part.
_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
_HUB_ID = re.compile(rf"^(?:{_PART}/)?{_PART}$")


def is_hub_id(source: str) -> bool:
    """Whether `source` has the form of a Hub repository id ("owner/name" or "name")."""
    return bool(_HUB_ID.match(source)) and "--" not in source and ".." not in source


def resolve_checkpoint(
    source: str, revision: str | None = None, *, field: str = "model.source"
) -> pathlib.Path:
    """The local directory (or GGUF file) of checkpoint `source`: itself where it is a
    directory or a `.gguf` file, else the cached snapshot of the Hub repository `source` at
    `revision` (None: the default branch), downloaded first where needed (module docstring).

    Raises:
      MissingPathError: `source` is neither a directory nor shaped like a Hub id, or a
        `.gguf` file that does not exist.
      UserError: the Hub could not provide it (no such repository or revision, gated, not
        cached while offline, ...), naming `field`, the id, the revision and the cause.
    """
    path = pathlib.Path(source).expanduser()
    gguf = path.suffix.lower() == ".gguf"
    if gguf and not path.is_file():
        raise MissingPathError(f"{field}: GGUF file not found: {source}")
    if path.is_dir() or gguf:
        if revision is not None:
            raise UserError(
                f"{field}: {source} is a local {'file' if gguf else 'directory'}; a revision "
                f"({revision!r}) only applies to a Hub id"
            )
        return path
    if not is_hub_id(source):
        raise MissingPathError(
            f"{field}: checkpoint directory not found: {source} (nor is it a Hugging Face "
            "Hub id, owner/name)"
        )
    import huggingface_hub
    from huggingface_hub import errors

    at = f" at revision {revision!r}" if revision is not None else ""
    what = f"{field}: {source!r}{at} is not a local directory, so it was read as a Hub id"
    try:
        local = huggingface_hub.snapshot_download(
            source, revision=revision, allow_patterns=list(CHECKPOINT_FILES)
        )
    except errors.GatedRepoError:
        why = "the repository is gated: accept its terms on the Hub and set HF_TOKEN"
    except errors.RevisionNotFoundError:
        why = "the repository has no such revision (a branch, tag or commit)"
    except errors.RepositoryNotFoundError:
        why = "no such repository on the Hub (or it is private and HF_TOKEN is not set)"
    except errors.LocalEntryNotFoundError:
        why = (
            "it is not in the Hub cache, and the Hub cannot be reached (offline, or "
            f"HF_HUB_OFFLINE is set); cache: {huggingface_hub.constants.HF_HUB_CACHE}"
        )
    except (errors.HfHubHTTPError, OSError, ValueError) as e:
        why = f"{type(e).__name__}: {one_line(e)}"
    else:
        return pathlib.Path(local)
    raise UserError(f"{what}: {why}")
