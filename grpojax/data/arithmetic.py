"""The built-in procedural task: integer arithmetic sized for the tiny character-level model.

A problem is a chain of `num_terms` non-negative integers joined by `+`/`-`, evaluated left
to right, written compactly: prompt `"12+34="`, answer `"46"`. The completion a model should
produce is the answer followed by EOS (`encode_sft` appends the EOS). Every row is a dict

    {"prompt": "12+34=", "completion": "46", "answer": "46", "question": "12 + 34"}

so the same rows serve as SFT demonstrations (prompt, completion) and as RL prompts whose
`answer` column the numeric-answer reward reads; `question` is the problem written for a
chat model's prompt template (`data.template="What is {question}?"`).

Held-out split: a problem belongs to the held-out set iff a keyed BLAKE2 hash of its text
falls below `heldout_fraction`. Membership depends only on the problem (and `split_salt`),
never on a seed, so no held-out problem can appear in training rows drawn with any seed.

Difficulty knobs (the driver picks one where a short SFT leaves a moderate success rate
that GRPO can raise):
  - `digits` (or `operand_range`): operand size. 1-digit addition is nearly memorised by
    SFT; 2-digit addition (the default, 10,000 problems, answers up to 198) needs the carry
    to be learnt and is the suggested starting point for the tiny model; 3 digits is hard.
  - `ops`: "+" or "+-" (subtraction; `allow_negative=False` keeps answers >= 0).
  - `num_terms`: chain length (2 = "a+b="; 3 = "a+b-c=" is markedly harder per digit).
`ARITHMETIC_PRESETS` names a ladder of such settings; `arithmetic_task(name, **overrides)`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import re

import numpy as np

from grpojax.ops.checks import check_choice, check_int, check_number

__all__ = ["ARITHMETIC_PRESETS", "ArithmeticTask", "arithmetic_task"]

SPLITS = ("train", "heldout")
# Above this many problems, unique draws use rejection sampling instead of enumeration.
_ENUMERATE_LIMIT = 100_000


@dataclasses.dataclass(frozen=True)
class ArithmeticTask:
    """Procedural `a op b op ... =` problems with a hash-based train / held-out split.

    Attributes:
      digits: operands are drawn uniformly from [0, 10**digits - 1] (ignored when
        `operand_range` is given). >= 1.
      operand_range: optional inclusive (low, high) for every operand, 0 <= low <= high.
      ops: the operators to draw from, a non-empty string over "+-" (e.g. "+", "+-").
      num_terms: operands per problem, >= 2.
      allow_negative: keep problems whose (left-to-right) value is negative; False rejects
        them, so with subtraction every answer is >= 0.
      heldout_fraction: the share of the problem space reserved for evaluation, in (0, 1).
      split_salt: keys the split hash; change it to draw a different held-out set.
    """

    digits: int = 2
    operand_range: tuple[int, int] | None = None
    ops: str = "+"
    num_terms: int = 2
    allow_negative: bool = False
    heldout_fraction: float = 0.1
    split_salt: str = "grpojax-arithmetic-v1"

    def __post_init__(self):
        check_int("digits", self.digits)
        if self.operand_range is not None:
            rng = tuple(self.operand_range)
            if not (
                len(rng) == 2
                and all(isinstance(v, int) and not isinstance(v, bool) for v in rng)
                and 0 <= rng[0] <= rng[1]
            ):
                raise ValueError(
                    f"operand_range must be (low, high) ints with 0 <= low <= high, "
                    f"got {self.operand_range!r}"
                )
            object.__setattr__(self, "operand_range", rng)
        if not (isinstance(self.ops, str) and self.ops and set(self.ops) <= set("+-")):
            raise ValueError(
                f"ops must be a non-empty string over '+-' (e.g. '+', '+-'), got {self.ops!r}"
            )
        object.__setattr__(self, "ops", "".join(sorted(set(self.ops))))
        check_int("num_terms", self.num_terms, minimum=2)
        check_number(
            "heldout_fraction",
            self.heldout_fraction,
            minimum=0,
            maximum=1,
            strict=True,
            strict_max=True,
            array_ok=False,
        )

    @property
    def bounds(self) -> tuple[int, int]:
        """Inclusive operand range (low, high)."""
        if self.operand_range is not None:
            return self.operand_range
        return (0, 10**self.digits - 1)

    def space_size(self) -> int:
        """Number of distinct operand/operator sequences (before the non-negative filter)."""
        lo, hi = self.bounds
        return (hi - lo + 1) ** self.num_terms * len(self.ops) ** (self.num_terms - 1)

    def is_heldout(self, prompt: str) -> bool:
        """True iff the problem text `prompt` (e.g. "12+34=") is in the held-out split."""
        digest = hashlib.blake2b(prompt.encode(), key=self.split_salt.encode()[:64], digest_size=8)
        return int.from_bytes(digest.digest(), "big") < self.heldout_fraction * 2**64

    @staticmethod
    def _render(operands, operators) -> tuple[str, int]:
        value = int(operands[0])
        text = [str(int(operands[0]))]
        for op, x in zip(operators, operands[1:]):
            value = value + int(x) if op == "+" else value - int(x)
            text += [op, str(int(x))]
        return "".join(text) + "=", value

    def _keep(self, prompt: str, value: int, split: str) -> bool:
        if value < 0 and not self.allow_negative:
            return False
        return self.is_heldout(prompt) == (split == "heldout")

    @staticmethod
    def _row(prompt: str, value: int) -> dict[str, str]:
        question = " ".join(re.split(r"([+-])", prompt.removesuffix("=")))
        return {
            "prompt": prompt,
            "completion": str(value),
            "answer": str(value),
            "question": question,
        }

    def enumerate(self, split: str) -> list[dict[str, str]]:
        """Every problem of `split` in a fixed order (only for spaces up to 100,000 problems)."""
        _check_split(split)
        if self.space_size() > _ENUMERATE_LIMIT:
            raise ValueError(
                f"the problem space has {self.space_size()} problems; enumerate() is limited to "
                f"{_ENUMERATE_LIMIT} (use rows(...))"
            )
        lo, hi = self.bounds
        out = []
        for operands in itertools.product(range(lo, hi + 1), repeat=self.num_terms):
            for operators in itertools.product(self.ops, repeat=self.num_terms - 1):
                prompt, value = self._render(operands, operators)
                if self._keep(prompt, value, split):
                    out.append(self._row(prompt, value))
        return out

    def rows(
        self, split: str, n: int, *, seed: int, unique: bool | None = None
    ) -> list[dict[str, str]]:
        """`n` problems of `split` ("train" or "heldout"), deterministic in `seed`.

        unique: distinct problems (default True for "heldout", so an evaluation counts each
        problem once; False for "train", i.e. i.i.d. draws). Asking for more unique problems
        than the split holds is a ValueError stating how many there are.
        """
        _check_split(split)
        check_int("n", n, minimum=0)
        unique = split == "heldout" if unique is None else bool(unique)
        rng = np.random.default_rng([int(seed), SPLITS.index(split)])
        if unique and self.space_size() <= _ENUMERATE_LIMIT:
            pool = self.enumerate(split)
            if n > len(pool):
                raise ValueError(
                    f"asked for {n} unique {split} problems; this task's {split} split has "
                    f"{len(pool)}"
                )
            return [pool[i] for i in rng.choice(len(pool), size=n, replace=False)]
        lo, hi = self.bounds
        out: list[dict[str, str]] = []
        seen: set[str] = set()
        # Each split holds a fixed share of a large space, so this budget is never the limit
        # unless the split (or the non-negative part of it) is tiny.
        budget = 1000 + 200 * n
        chunk = 256
        while len(out) < n:
            if budget <= 0:
                raise ValueError(
                    f"could not draw {n} {'unique ' if unique else ''}{split} problems "
                    f"(found {len(out)}); widen the task or lower n"
                )
            operands = rng.integers(lo, hi + 1, size=(chunk, self.num_terms))
            operators = rng.integers(0, len(self.ops), size=(chunk, self.num_terms - 1))
            budget -= chunk
            for xs, os_ in zip(operands, operators):
                prompt, value = self._render(xs, [self.ops[k] for k in os_])
                if not self._keep(prompt, value, split) or (unique and prompt in seen):
                    continue
                seen.add(prompt)
                out.append(self._row(prompt, value))
                if len(out) == n:
                    break
        return out


def _check_split(split: str) -> None:
    check_choice("split", split, SPLITS)


ARITHMETIC_PRESETS: dict[str, dict] = {
    "add1": dict(digits=1, ops="+", num_terms=2),
    "add2": dict(digits=2, ops="+", num_terms=2),
    "addsub2": dict(digits=2, ops="+-", num_terms=2),
    "chain3": dict(digits=1, ops="+-", num_terms=3),
    "add3": dict(digits=3, ops="+", num_terms=2),
}


def arithmetic_task(name: str = "add2", **overrides) -> ArithmeticTask:
    """An `ArithmeticTask` from a preset of `ARITHMETIC_PRESETS`, with field overrides.

    Presets from easy to hard: add1 (1-digit a+b), chain3 (1-digit a±b±c), add2 (2-digit
    a+b, the default), addsub2 (2-digit a±b, answers >= 0), add3 (3-digit a+b).
    """
    if name not in ARITHMETIC_PRESETS:
        raise ValueError(
            f"unknown arithmetic preset {name!r}; allowed: {sorted(ARITHMETIC_PRESETS)}"
        )
    return ArithmeticTask(**{**ARITHMETIC_PRESETS[name], **overrides})
