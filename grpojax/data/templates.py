"""Prompt templates: turn a dataset row into the prompt string the model sees.

`PromptFormatter` applies a `str.format` template over the row's columns (e.g.
`"Question: {question}\\nAnswer:"`) and, with `chat=True`, wraps the result as the user
message of the tokenizer's chat template (`apply_chat_template(..., add_generation_prompt=True,
tokenize=False)`). A row whose prompt column already holds a list of chat messages
(`[{"role": ..., "content": ...}, ...]`, the conversational format) goes straight to the chat
template. `FormattedRows` is a lazy view of a dataset with the formatted text in the `prompt`
column; every other column is passed through untouched (the rewards read them).
"""

from __future__ import annotations

import string
from collections.abc import Mapping, Sequence
from typing import Any

from grpojax.errors import UserError

__all__ = ["FormattedRows", "PromptFormatter"]


def _template_fields(template: str) -> list[str]:
    """The column names a format string refers to ("{a.b}" and "{a[0]}" refer to "a")."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:
        raise UserError(f"invalid prompt template {template!r}: {e}") from None
    fields = []
    for _, field, _, _ in parsed:
        if field is None:
            continue
        base = field.split(".", 1)[0].split("[", 1)[0]
        if base == "" or base.isdigit():
            raise UserError(
                f"prompt template {template!r} must name its fields after columns, e.g. "
                f"'{{question}}', got a positional field"
            )
        if base not in fields:
            fields.append(base)
    return fields


def _is_messages(value: Any) -> bool:
    return (
        isinstance(value, list)
        and len(value) > 0
        and all(isinstance(m, Mapping) and "role" in m and "content" in m for m in value)
    )


class PromptFormatter:
    """row -> prompt text, by a format template and/or the tokenizer's chat template.

    Args:
      template: a `str.format` string over the row's columns, e.g. "{question}\\n". None: the
        row's `prompt_column` value as is (a string, or chat messages when `chat=True`).
      tokenizer: needed for `chat=True` (its `chat_template` is used).
      chat: wrap the text as the user message of the chat template, generation prompt added.
      system_prompt: with `chat=True`, a system message put first (unless the row's
        messages already start with one).
      prompt_column: where the prompt lives when `template` is None.

    Every problem with the template, the rows or the chat template is a
    `grpojax.errors.UserError` (a ValueError).
    """

    def __init__(
        self,
        template: str | None = None,
        *,
        tokenizer=None,
        chat: bool = False,
        system_prompt: str | None = None,
        prompt_column: str = "prompt",
    ):
        if template is not None and not isinstance(template, str):
            raise UserError(f"template must be a str.format string or None, got {template!r}")
        self.template = template
        self.fields = _template_fields(template) if template is not None else [prompt_column]
        self.chat = bool(chat)
        self.system_prompt = system_prompt
        self.prompt_column = prompt_column
        self.tokenizer = tokenizer
        if system_prompt is not None and not self.chat:
            raise UserError("system_prompt needs chat=True (it is a chat-template message)")
        if self.chat:
            if tokenizer is None:
                raise UserError(
                    "chat=True needs a tokenizer (its chat template formats the prompt)"
                )
            if not getattr(tokenizer, "chat_template", None):
                raise UserError(
                    "chat=True but the tokenizer has no chat_template; set "
                    "tokenizer.chat_template or use a plain template (chat=False)"
                )

    def check_columns(self, columns: Sequence[str], *, source: str = "dataset") -> None:
        """Raise a ValueError naming any template field that is not one of `columns`."""
        missing = [f for f in self.fields if f not in columns]
        if missing:
            what = f"template {self.template!r}" if self.template is not None else "prompt_column"
            raise UserError(
                f"{what} refers to column(s) {missing} that {source} lacks; its columns are "
                f"{sorted(columns)}"
            )

    def __call__(self, row: Mapping[str, Any]) -> str:
        self.check_columns(list(row), source="the row")
        if self.template is not None:
            content: Any = self.template.format(**row)
        else:
            content = row[self.prompt_column]
        if not self.chat:
            if not isinstance(content, str):
                raise UserError(
                    f"column {self.prompt_column!r} holds {type(content).__name__}, not text; "
                    "use chat=True for chat messages, or a template"
                )
            return content
        if _is_messages(content):
            messages = [dict(m) for m in content]
        elif isinstance(content, str):
            messages = [{"role": "user", "content": content}]
        else:
            raise UserError(
                f"cannot make a chat prompt from {type(content).__name__}; expected text or a "
                "list of {'role', 'content'} messages"
            )
        if self.system_prompt is not None and messages[0].get("role") != "system":
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )


class FormattedRows(Sequence):
    """A lazy view of `rows` whose `prompt` column is `formatter(row)`.

    Indexing returns a new dict (the underlying rows are not modified). `name` identifies the
    source in errors; `add_special_tokens` is False for chat-templated text (the template
    already wrote BOS and the like), which `PromptSource` follows by default.
    """

    def __init__(self, rows: Sequence[Mapping[str, Any]], formatter: PromptFormatter, *, name: str):
        self.rows = rows
        self.formatter = formatter
        self.name = name
        self.add_special_tokens = not formatter.chat

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        row = dict(self.rows[int(i)])
        row["prompt"] = self.formatter(row)
        return row

    def first(self, n: int) -> FormattedRows:
        """A view of the first `n` rows (all of them when there are fewer), in file order."""
        n = min(int(n), len(self.rows))
        rows = self.rows.select(range(n)) if hasattr(self.rows, "select") else self.rows[:n]
        view = FormattedRows(rows, self.formatter, name=self.name)
        view.add_special_tokens = self.add_special_tokens
        return view
