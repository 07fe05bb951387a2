"""reasoning-gym tasks as prompt rows: its generators for the data, its scorers for rewards.

Row columns (the contract with `grpojax.rewards.reasoning_gym_reward`):

    prompt    str   the question, through the prompt template (default "{question}")
    question  str   the task's question text, unformatted
    answer    str   the reference answer (entry["answer"])
    task      str   the reasoning-gym dataset name, e.g. "basic_arithmetic", "countdown"
    entry     dict  the reasoning-gym entry {"question", "answer", "metadata"}; score a
                    completion with `reasoning_gym.get_score_answer_fn(task)(answer_text, entry)`

Rows are generated lazily on access (a countdown entry costs about 30 ms) and cached.
reasoning-gym derives entry i of a dataset with seed s from `Random(s + i)`, so two seeds
overlap; `reasoning_gym_split` therefore takes held-out and train rows from disjoint index
ranges of one seed and also replaces any train entry whose question equals a held-out one.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

from grpojax.data.templates import FormattedRows, PromptFormatter
from grpojax.errors import UserError
from grpojax.ops.checks import check_int

__all__ = ["ReasoningGymRows", "reasoning_gym_rows", "reasoning_gym_split"]

_CACHE_SIZE = 8192
_MAX_REPLACEMENTS = 64


def _create(name: str, size: int, seed: int, config: dict[str, Any]):
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        raise UserError(
            f"unknown reasoning-gym task {name!r}; allowed: {', '.join(sorted(DATASETS))}"
        )
    try:
        return reasoning_gym.create_dataset(name, size=size, seed=seed, **config)
    except TypeError as e:
        raise UserError(f"bad config for reasoning-gym task {name!r}: {e}") from None


class ReasoningGymRows(Sequence):
    """Entries `start .. start + size - 1` of one reasoning-gym task, as unformatted rows.

    Each row is {"question", "answer", "task", "entry"} (see the module docstring). An entry
    whose question is in `exclude_questions` is replaced by one from beyond the range
    (index start + size + i + k * size, k = 0, 1, ...), deterministically.
    """

    def __init__(
        self,
        name: str,
        *,
        size: int,
        seed: int,
        start: int = 0,
        exclude_questions: frozenset[str] | set[str] = frozenset(),
        config: dict[str, Any] | None = None,
    ):
        check_int("size", size)
        check_int("seed", seed, minimum=0)
        check_int("start", start, minimum=0)
        self.name = name
        self.size = size
        self.start = start
        self.exclude = frozenset(exclude_questions)
        # `size` only bounds reasoning-gym's own iteration; indexing beyond it is well defined.
        self._dataset = _create(name, start + size, seed, dict(config or {}))
        self._cache: collections.OrderedDict[int, dict] = collections.OrderedDict()

    def __len__(self) -> int:
        return self.size

    def _entry(self, i: int) -> dict:
        candidates = [self.start + i] + [
            self.start + self.size + i + k * self.size for k in range(_MAX_REPLACEMENTS)
        ]
        for j in candidates:
            entry = self._dataset[j]
            if entry["question"] not in self.exclude:
                return entry
        raise ValueError(
            f"reasoning-gym task {self.name!r}: row {i} collides with the excluded questions "
            f"{_MAX_REPLACEMENTS + 1} times; the task's space is too small for this split"
        )

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = int(i)
        if i < 0:
            i += self.size
        if not 0 <= i < self.size:
            raise IndexError(f"row {i} out of range for {self.size} rows")
        if i in self._cache:
            self._cache.move_to_end(i)
            entry = self._cache[i]
        else:
            entry = self._entry(i)
            self._cache[i] = entry
            if len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return {
            "question": entry["question"],
            "answer": entry["answer"],
            "task": self.name,
            "entry": entry,
        }


def _formatter(template, tokenizer, chat, system_prompt) -> PromptFormatter:
    return PromptFormatter(
        "{question}" if template is None else template,
        tokenizer=tokenizer,
        chat=chat,
        system_prompt=system_prompt,
    )


def reasoning_gym_rows(
    name: str,
    *,
    size: int,
    seed: int,
    template: str | None = None,
    tokenizer=None,
    chat: bool = False,
    system_prompt: str | None = None,
    config: dict[str, Any] | None = None,
) -> FormattedRows:
    """`size` rows of reasoning-gym task `name` (seed `seed`), prompts formatted lazily.

    template: over the columns question/answer/task/entry, default "{question}" (the
    question already states the answer format). `tokenizer`/`chat`/`system_prompt`: the chat
    template, as in `PromptFormatter`. config: the task's own options, e.g.
    `{"min_terms": 2, "max_terms": 3}` for basic_arithmetic.
    """
    fmt = _formatter(template, tokenizer, chat, system_prompt)
    fmt.check_columns(["question", "answer", "task", "entry"], source=f"reasoning-gym {name!r}")
    rows = ReasoningGymRows(name, size=size, seed=seed, config=config)
    return FormattedRows(rows, fmt, name=f"reasoning_gym:{name}")


def reasoning_gym_split(
    name: str,
    *,
    train_size: int,
    heldout_size: int,
    seed: int,
    template: str | None = None,
    tokenizer=None,
    chat: bool = False,
    system_prompt: str | None = None,
    config: dict[str, Any] | None = None,
) -> tuple[FormattedRows, FormattedRows]:
    """(train, heldout) rows of one task, no held-out question among the train rows.

    Held-out rows are entries 0 .. heldout_size - 1 (generated now, to know their questions);
    train rows are the next `train_size` entries, generated lazily, with any entry whose
    question is a held-out one replaced (see `ReasoningGymRows`).
    """
    fmt = _formatter(template, tokenizer, chat, system_prompt)
    fmt.check_columns(["question", "answer", "task", "entry"], source=f"reasoning-gym {name!r}")
    heldout = ReasoningGymRows(name, size=heldout_size, seed=seed, config=config)
    questions = frozenset(heldout[i]["question"] for i in range(len(heldout)))
    train = ReasoningGymRows(
        name,
        size=train_size,
        seed=seed,
        start=heldout_size,
        exclude_questions=questions,
        config=config,
    )
    return (
        FormattedRows(train, fmt, name=f"reasoning_gym:{name}:train"),
        FormattedRows(heldout, fmt, name=f"reasoning_gym:{name}:heldout"),
    )
