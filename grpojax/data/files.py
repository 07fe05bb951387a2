"""User datasets: local JSONL / JSON / Parquet files through Hugging Face `datasets`.

`load_prompt_dataset` reads the files (no hub access), checks that the prompt template's
columns exist, and returns a `FormattedRows` view: each row gets its `prompt` (template and/or
chat template applied) and keeps every other column, which the driver passes to the reward
functions as keyword arguments (e.g. an `answer` column for the math reward).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from grpojax.data.templates import FormattedRows, PromptFormatter

__all__ = ["FILE_FORMATS", "load_prompt_dataset", "load_rows"]

# File suffix -> the `datasets` packaged builder that reads it.
FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def _as_list(data_files: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    if isinstance(data_files, str | os.PathLike):
        return [os.fspath(data_files)]
    files = [os.fspath(f) for f in data_files]
    if not files:
        raise ValueError("data_files is empty: give at least one .jsonl/.json/.parquet path")
    return files


def _infer_format(files: list[str]) -> str:
    builders = set()
    for f in files:
        suffix = os.path.splitext(f)[1].lower()
        if suffix not in FILE_FORMATS:
            raise ValueError(
                f"cannot tell the format of {f!r} from its suffix; allowed suffixes "
                f"{sorted(FILE_FORMATS)}, or pass format='json'|'parquet'"
            )
        builders.add(FILE_FORMATS[suffix])
    if len(builders) > 1:
        raise ValueError(f"data_files mix formats {sorted(builders)}; load them separately")
    return builders.pop()


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
            raise FileNotFoundError(f"dataset file not found: {f!r}")
    builder = _infer_format(files) if format is None else format
    if builder not in ("json", "parquet"):
        raise ValueError(f"format must be 'json' or 'parquet'; got {format!r}")
    if all(os.path.getsize(f) == 0 for f in files):
        raise ValueError(f"dataset {files} is empty: no rows")
    ds = datasets.load_dataset(
        builder,
        data_files=files,
        split="train",
        cache_dir=None if cache_dir is None else os.fspath(cache_dir),
    )
    if len(ds) == 0:
        raise ValueError(f"dataset {files} is empty: no rows")
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

    Raises ValueError for an empty dataset or a template naming a missing column.
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
    _ = view[0]  # fail now, not mid-run, if the first row cannot be formatted
    return view
