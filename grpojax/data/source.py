"""Prompt sources for the driver: a checkpointable position over a dataset, and tokenization.

`PromptSource` walks a dataset (any sequence of row dicts: a list, a `FormattedRows`, a
Hugging Face `datasets.Dataset`) in a seeded order that is reshuffled every epoch, hands
out batches of B prompts tokenized and left-padded to a bucketed width P, and skips (with a
counted `PromptTooLongWarning`) prompts longer than the token budget. Its position is a
small dict of ints (`state()` / `restore()`), saved in the driver's Orbax checkpoint, so a
resumed run reads exactly the prompts an uninterrupted run would have read.

`encode_sft` tokenizes (prompt, completion) demonstrations in the same layout as a rollout
(left-padded prompt `[N, P]` then right-padded completion `[N, T]`), so the SFT warm start
and the RL steps share one forward contract; `pad_token_ids` lays out token-id lists the
same way. Both return a `PromptCompletionBatch`. Masks are always built from lengths.

All arrays here are host NumPy arrays (int32); the driver moves them to devices.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from grpojax.errors import UserError
from grpojax.ops.checks import check_int
from grpojax.ops.masks import MIN_PROMPT_WIDTH, PROMPT_BUCKET, padded_width, prompt_width

__all__ = [
    "MIN_PROMPT_WIDTH",
    "PROMPT_BUCKET",
    "PromptBatch",
    "PromptCompletionBatch",
    "PromptSource",
    "PromptTooLongWarning",
    "encode_prompts",
    "encode_sft",
    "pad_id_of",
    "pad_token_ids",
    "padded_width",
    "prompt_width",
    "stop_ids_of",
]

_STATE_KEYS = ("seed", "epoch", "index", "skipped", "num_rows")


class PromptTooLongWarning(UserWarning):
    """A prompt longer than the token budget was skipped (the run goes on)."""


def _token_ids(
    tokenizer, texts: Sequence[str], *, add_special_tokens: bool, prepend_bos: bool
) -> list[list[int]]:
    """Token ids of each text; one shared rule for prompts in SFT and in RL."""
    texts = list(texts)
    if not texts:
        return []
    ids = tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]
    ids = [list(map(int, row)) for row in ids]
    if prepend_bos:
        bos = tokenizer.bos_token_id
        if bos is None:
            raise ValueError("prepend_bos=True but the tokenizer has no bos_token_id")
        ids = [row if row[:1] == [bos] else [bos, *row] for row in ids]
    return ids


def pad_id_of(tokenizer, pad_id: int | None = None) -> int:
    """The pad id every component uses: `pad_id` if given, else the tokenizer's pad id, else
    its (first) EOS id, else 0. Padding is always masked by length, so pad may equal EOS."""
    if pad_id is not None:
        return int(pad_id)
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if isinstance(candidate, list | tuple):
            candidate = candidate[0] if candidate else None
        if candidate is not None:
            return int(candidate)
    return 0


# `grpojax.models.tokenizer.MODEL_EOS_ATTR` (data/ does not import the model layer).
_MODEL_EOS_ATTR = "grpojax_model_eos_ids"


def stop_ids_of(tokenizer) -> tuple[int, ...]:
    """The token ids that end a completion, sorted: the tokenizer's EOS id(s) and, for a
    tokenizer from `grpojax.models.load_tokenizer`, every `eos_token_id` of its model
    directory's config.json and generation_config.json (empty if there are none)."""
    eos = tokenizer.eos_token_id
    ids = set() if eos is None else set(eos) if isinstance(eos, list | tuple) else {eos}
    ids.update(getattr(tokenizer, _MODEL_EOS_ATTR, ()))
    return tuple(sorted(int(i) for i in ids))


def _left_pad(ids: list[list[int]], width: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.full((len(ids), width), pad_id, np.int32)
    lengths = np.array([len(row) for row in ids], np.int32)
    for i, row in enumerate(ids):
        if row:
            tokens[i, width - len(row) :] = row
    return tokens, lengths


def _right_pad(ids: list[list[int]], width: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.full((len(ids), width), pad_id, np.int32)
    lengths = np.array([len(row) for row in ids], np.int32)
    for i, row in enumerate(ids):
        tokens[i, : len(row)] = row
    return tokens, lengths


def _left_mask(lengths: np.ndarray, width: int) -> np.ndarray:
    return np.arange(width)[None, :] >= (width - lengths)[:, None]


def _right_mask(lengths: np.ndarray, width: int) -> np.ndarray:
    return np.arange(width)[None, :] < lengths[:, None]


@dataclasses.dataclass(frozen=True)
class PromptBatch:
    """B prompts ready for the sampler, with the dataset columns the rewards read.

    prompts: the B prompt strings (after any template).
    columns: every other column of the rows, name -> list of B values (row order), passed
      to reward functions as keyword arguments (e.g. `answer`, `task`, `entry`).
    tokens_bp: `[B, P]` int32 prompt tokens left-padded with the pad id to the bucket width P.
    lengths_b: `[B]` int32 real prompt lengths (tokens_bp[b, P - lengths_b[b]:] is the prompt).
    indices_b: `[B]` int64 row index of each prompt in the dataset.
    """

    prompts: list[str]
    columns: dict[str, list]
    tokens_bp: np.ndarray
    lengths_b: np.ndarray
    indices_b: np.ndarray

    def mask_bp(self) -> np.ndarray:
        """`[B, P]` bool, true at the real (right-aligned) prompt tokens; built from lengths."""
        return _left_mask(self.lengths_b, self.tokens_bp.shape[1])

    def __len__(self) -> int:
        return len(self.prompts)


def encode_prompts(
    tokenizer,
    prompts: Sequence[str],
    *,
    add_special_tokens: bool = True,
    prepend_bos: bool = False,
    bucket: int | str = PROMPT_BUCKET,
    min_width: int = MIN_PROMPT_WIDTH,
    pad_id: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Tokenize B prompts, left-padded: returns (tokens_bp `[B, P]`, lengths_b `[B]`), int32.

    P = `padded_width(max length, bucket=, min_width=)`. `add_special_tokens` is the
    tokenizer's own rule (a Llama tokenizer adds BOS; set it False for text that already went
    through a chat template); `prepend_bos` forces a BOS when the tokenizer adds none.
    Pad id: `pad_id`, else the tokenizer's pad id, else its EOS id, else 0.
    """
    ids = _token_ids(
        tokenizer, prompts, add_special_tokens=add_special_tokens, prepend_bos=prepend_bos
    )
    if not ids:
        raise ValueError("encode_prompts needs at least one prompt")
    if min(len(row) for row in ids) == 0:
        raise ValueError("a prompt encodes to zero tokens; every prompt needs at least one")
    width = padded_width(max(len(row) for row in ids), bucket=bucket, min_width=min_width)
    return _left_pad(ids, width, pad_id_of(tokenizer, pad_id))


@dataclasses.dataclass(frozen=True)
class PromptCompletionBatch:
    """N demonstrations in the rollout layout: left-padded prompt, then right-padded completion.

    prompt_tokens_np: `[N, P]` int32, prompt right-aligned (left padding).
    prompt_lengths_n: `[N]` int32.
    completion_tokens_nt: `[N, T]` int32, completion (plus EOS when added) from column 0.
    completion_lengths_n: `[N]` int32 (the EOS, when added, counts and is trained).
    """

    prompt_tokens_np: np.ndarray
    prompt_lengths_n: np.ndarray
    completion_tokens_nt: np.ndarray
    completion_lengths_n: np.ndarray

    def completion_mask_nt(self) -> np.ndarray:
        """`[N, T]` bool loss mask: true at t < completion_lengths_n."""
        return _right_mask(self.completion_lengths_n, self.completion_tokens_nt.shape[1])

    def sequences(self) -> tuple[np.ndarray, np.ndarray]:
        """(tokens_ns, mask_ns), each `[N, P + T]`: prompt then completion, mask from lengths.

        Completion token t of row n sits at column P + t, as in `Rollout.sequences()`.
        """
        p = self.prompt_tokens_np.shape[1]
        tokens = np.concatenate([self.prompt_tokens_np, self.completion_tokens_nt], axis=1)
        mask = np.concatenate(
            [_left_mask(self.prompt_lengths_n, p), self.completion_mask_nt()], axis=1
        )
        return tokens, mask


def encode_sft(
    tokenizer,
    prompts: Sequence[str],
    completions: Sequence[str],
    *,
    add_eos: bool = True,
    add_special_tokens: bool = True,
    prepend_bos: bool = False,
    bucket: int | str = PROMPT_BUCKET,
    min_width: int = MIN_PROMPT_WIDTH,
    completion_width: int | None = None,
    pad_id: int | None = None,
) -> PromptCompletionBatch:
    """Tokenize (prompt, completion) pairs into a `PromptCompletionBatch`.

    The prompt is encoded exactly as `encode_prompts` / `PromptSource` encode it (same
    `add_special_tokens` / `prepend_bos`), and the completion separately without special
    tokens, then EOS appended (`add_eos`): the token boundary is the one the sampler sees.
    P is bucketed from the longest prompt (`bucket`, `min_width`); T is `completion_width`
    when given (a longer completion is a ValueError) else the next power of two of the
    longest completion.
    """
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    tokens_np, plen_n = encode_prompts(
        tokenizer,
        prompts,
        add_special_tokens=add_special_tokens,
        prepend_bos=prepend_bos,
        bucket=bucket,
        min_width=min_width,
        pad_id=pad_id,
    )
    comp = _token_ids(tokenizer, completions, add_special_tokens=False, prepend_bos=False)
    if add_eos:
        eos = tokenizer.eos_token_id
        if eos is None:
            raise ValueError("add_eos=True but the tokenizer has no eos_token_id")
        comp = [[*row, int(eos)] for row in comp]
    longest = max(len(row) for row in comp)
    if longest == 0:
        raise ValueError("every completion is empty (and add_eos=False): nothing to train")
    if completion_width is None:  # completions are right-padded: powers of two
        width = padded_width(longest, bucket="pow2")
    else:
        width = int(completion_width)
        if longest > width:
            raise ValueError(
                f"a completion has {longest} tokens, more than completion_width={width}"
            )
    comp_nt, clen_n = _right_pad(comp, width, pad_id_of(tokenizer, pad_id))
    return PromptCompletionBatch(tokens_np, plen_n, comp_nt, clen_n)


def pad_token_ids(
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    *,
    prompt_width: int,
    completion_width: int,
    pad_id: int = 0,
) -> PromptCompletionBatch:
    """N (prompt, completion) token-id lists in the rollout layout, as a `PromptCompletionBatch`.

    Prompt n is left-padded to `prompt_width` P (its last token in column P - 1, which
    predicts completion token 0), completion n right-padded to `completion_width` T, both
    with `pad_id`; the lengths are kept, so every mask comes from them
    (`PromptCompletionBatch.sequences()`, `PromptCompletionBatch.completion_mask_nt()`).

    Raises ValueError naming the argument for: N prompts but M != N completions, an empty
    prompt, a row longer than its width, a non-integer id.
    """
    check_int("prompt_width", prompt_width)
    check_int("completion_width", completion_width)
    if len(prompt_ids) != len(completion_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(completion_ids)} completions")
    rows = {}
    for name, ids, width in (
        ("prompt_ids", prompt_ids, prompt_width),
        ("completion_ids", completion_ids, completion_width),
    ):
        try:
            rows[name] = [[int(i) for i in row] for row in ids]
        except (TypeError, ValueError):
            raise ValueError(f"{name} must be lists of integer token ids") from None
        longest = max((len(row) for row in rows[name]), default=0)
        if longest > width:
            kind = name.split("_")[0]
            raise ValueError(f"a {kind} has {longest} tokens, more than {kind}_width={width}")
    if any(not row for row in rows["prompt_ids"]):
        raise ValueError("prompt_ids: every prompt needs at least one token")
    prompt_np, plen_n = _left_pad(rows["prompt_ids"], prompt_width, pad_id)
    comp_nt, clen_n = _right_pad(rows["completion_ids"], completion_width, pad_id)
    return PromptCompletionBatch(prompt_np, plen_n, comp_nt, clen_n)


def encode_texts(
    tokenizer,
    texts: Sequence[str],
    *,
    width: int,
    add_special_tokens: bool = True,
    pad_id: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Tokenize N plain texts (e.g. pretraining text for PPO-ptx), cut to `width` tokens and
    right-padded to it: (tokens_ns `[N, width]`, lengths_n `[N]`), int32. One shape for
    every batch; a text of zero tokens is a ValueError."""
    check_int("width", width)
    ids = _token_ids(tokenizer, texts, add_special_tokens=add_special_tokens, prepend_bos=False)
    if not ids:
        raise ValueError("encode_texts needs at least one text")
    if min(len(row) for row in ids) == 0:
        raise ValueError("a text encodes to zero tokens; every text needs at least one")
    return _right_pad([row[:width] for row in ids], width, pad_id_of(tokenizer, pad_id))


class PromptSource:
    """A seeded, epoch-reshuffled, checkpointable stream of prompt batches over a dataset.

    Order: epoch e visits the rows in `permutation(num_rows)` drawn from
    `np.random.default_rng([seed, e])` (or in file order with `shuffle=False`); the position
    is (epoch, index into that order). A batch may straddle an epoch boundary.

    Args:
      rows: a sequence of row mappings with a string `prompt_column` (list of dicts,
        `FormattedRows`, `datasets.Dataset`).
      tokenizer: a Hugging Face tokenizer (the built-in one included).
      seed: the shuffling seed (an int >= 0); part of `state()`.
      max_prompt_tokens: token budget per prompt; longer prompts are skipped and counted in
        `skipped` (every visit), with a `PromptTooLongWarning` the first time each row is
        found too long (None: no budget).
      shuffle: reshuffle every epoch (True) or keep file order.
      name: names the source in errors and warnings (defaults to `rows.name` if present).
      prompt_column: the column holding the prompt text; None: a stream of rows only
        (`next_rows`; no tokenizing, no budget), e.g. an environment's rows, whose prompt
        the environment makes.
      add_special_tokens: the tokenizer's own special tokens (None: `rows.add_special_tokens`
        when the rows carry it, i.e. False for chat-templated text; else True).
      prepend_bos, bucket, min_width, pad_id: as in `encode_prompts`.

    Raises `grpojax.errors.UserError` (a ValueError) on an empty dataset, and from
    `next_batch` when every prompt is over the budget or a row has no usable prompt; each
    names the source.

    Multi-host: every process builds the same source with the same seed and so draws the
    same global batch; each then takes its own slice of it.
    """

    def __init__(
        self,
        rows: Sequence[Mapping[str, Any]],
        tokenizer,
        *,
        seed: int = 0,
        max_prompt_tokens: int | None = None,
        shuffle: bool = True,
        name: str | None = None,
        prompt_column: str | None = "prompt",
        add_special_tokens: bool | None = None,
        prepend_bos: bool = False,
        bucket: int | str = PROMPT_BUCKET,
        min_width: int = MIN_PROMPT_WIDTH,
        pad_id: int | None = None,
    ):
        self.name = name if name is not None else str(getattr(rows, "name", "prompts"))
        check_int("seed", seed, minimum=0)
        check_int("max_prompt_tokens", max_prompt_tokens, none_ok=True)
        padded_width(1, bucket=bucket, min_width=min_width)  # validates bucket and min_width
        self._rows = rows
        self._n = len(rows)
        if self._n == 0:
            raise UserError(f"prompt source {self.name!r} is empty: the dataset has no rows")
        self._tokenizer = tokenizer
        self._max_tokens = None if max_prompt_tokens is None else int(max_prompt_tokens)
        self._shuffle = bool(shuffle)
        self._prompt_column = prompt_column
        if add_special_tokens is None:
            add_special_tokens = bool(getattr(rows, "add_special_tokens", True))
        self._add_special = add_special_tokens
        self._prepend_bos = prepend_bos
        self._bucket = bucket
        self._min_width = min_width
        self._pad_id = pad_id_of(tokenizer, pad_id)
        self._seed = int(seed)
        self._epoch = 0
        self._index = 0
        self._skipped = 0
        self._order_cache: tuple[int, np.ndarray] | None = None
        # Rows known to be over budget: derived data (not checkpointed), only used to tell
        # "every prompt is too long" apart from an unlucky run of long ones.
        self._over_budget: set[int] = set()

    def __len__(self) -> int:
        return self._n

    @property
    def skipped(self) -> int:
        """How many prompts have been skipped for the token budget (each visit counts)."""
        return self._skipped

    @property
    def epoch(self) -> int:
        return self._epoch

    def state(self) -> dict[str, int]:
        """The position as plain ints: {seed, epoch, index, skipped, num_rows}.

        JSON-serialisable; save it with the checkpoint (e.g. Orbax `args.JsonSave`).
        """
        return {
            "seed": self._seed,
            "epoch": self._epoch,
            "index": self._index,
            "skipped": self._skipped,
            "num_rows": self._n,
        }

    def restore(self, state: Mapping[str, Any]) -> None:
        """Continue from a `state()`: the next batches equal those of the uninterrupted source.

        The saved seed wins over the constructor's. A state saved over a dataset of another
        size is refused (its order would not be the same).
        """
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise ValueError(
                f"data position for {self.name!r} lacks keys {missing}; has {sorted(state)}"
            )
        values = {k: int(np.asarray(state[k])) for k in _STATE_KEYS}
        if values["num_rows"] != self._n:
            raise UserError(
                f"data position for {self.name!r} was saved over {values['num_rows']} rows; "
                f"this dataset has {self._n}"
            )
        if not (values["seed"] >= 0 and values["epoch"] >= 0 and 0 <= values["index"] <= self._n):
            raise ValueError(f"data position for {self.name!r} is out of range: {values}")
        self._seed, self._epoch, self._index = values["seed"], values["epoch"], values["index"]
        self._skipped = values["skipped"]
        self._order_cache = None

    def _order(self, epoch: int) -> np.ndarray:
        if self._order_cache is None or self._order_cache[0] != epoch:
            if self._shuffle:
                order = np.random.default_rng([self._seed, epoch]).permutation(self._n)
            else:
                order = np.arange(self._n)
            self._order_cache = (epoch, order)
        return self._order_cache[1]

    def _advance(self) -> int:
        if self._index >= self._n:
            self._epoch += 1
            self._index = 0
        row = int(self._order(self._epoch)[self._index])
        self._index += 1
        return row

    def _prompt(self, row: Mapping[str, Any], i: int) -> str:
        try:
            text = row[self._prompt_column]
        except KeyError:
            raise UserError(
                f"prompt source {self.name!r}: row {i} has no column {self._prompt_column!r}; "
                f"columns are {sorted(row)}"
            ) from None
        if not isinstance(text, str):
            raise UserError(
                f"prompt source {self.name!r}: column {self._prompt_column!r} of row {i} must be "
                f"a string, got {type(text).__name__}"
            )
        return text

    def _take(self, b: int) -> list[tuple[int, dict, str, list[int]]]:
        check_int("batch_size", b)
        taken = []
        while len(taken) < b:
            i = self._advance()
            row = dict(self._rows[i])
            if self._prompt_column is None:  # rows only: nothing to tokenize or budget
                taken.append((i, row, "", []))
                continue
            text = self._prompt(row, i)
            (ids,) = _token_ids(
                self._tokenizer,
                [text],
                add_special_tokens=self._add_special,
                prepend_bos=self._prepend_bos,
            )
            if not ids:
                raise UserError(f"prompt source {self.name!r}: row {i} has an empty prompt")
            if self._max_tokens is not None and len(ids) > self._max_tokens:
                self._skipped += 1
                if i not in self._over_budget:
                    # Once per row and process: later epochs skip it silently (still counted).
                    self._over_budget.add(i)
                    warnings.warn(
                        f"prompt source {self.name!r}: skipped row {i} ({len(ids)} tokens > "
                        f"max_prompt_tokens={self._max_tokens}); {self._skipped} skipped so far",
                        PromptTooLongWarning,
                        stacklevel=3,
                    )
                if len(self._over_budget) == self._n:
                    raise UserError(
                        f"prompt source {self.name!r}: every one of its {self._n} prompts is "
                        f"longer than max_prompt_tokens={self._max_tokens}"
                    )
                continue
            taken.append((i, row, text, ids))
        return taken

    def next_rows(self, b: int) -> list[dict]:
        """The next B rows (dicts, all columns), skipping over-budget prompts."""
        return [row for _, row, _, _ in self._take(b)]

    def next_batch(self, b: int) -> PromptBatch:
        """The next B prompts, tokenized and left-padded, with their other columns."""
        if self._prompt_column is None:
            raise ValueError(f"prompt source {self.name!r} has no prompt column: use next_rows")
        taken = self._take(b)
        ids = [t[3] for t in taken]
        width = padded_width(
            max(len(row) for row in ids), bucket=self._bucket, min_width=self._min_width
        )
        tokens, lengths = _left_pad(ids, width, self._pad_id)
        names: list[str] = []
        for _, row, _, _ in taken:
            names += [k for k in row if k != self._prompt_column and k not in names]
        columns = {k: [row.get(k) for _, row, _, _ in taken] for k in names}
        return PromptBatch(
            prompts=[t[2] for t in taken],
            columns=columns,
            tokens_bp=tokens,
            lengths_b=lengths,
            indices_b=np.array([t[0] for t in taken], np.int64),
        )
