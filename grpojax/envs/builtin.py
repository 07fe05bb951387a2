"""Built-in environments: a calculator tool task, a sandboxed-Python tool task and a
number-guessing game, with deterministic row generators.

Each works with the built-in character tokenizer (no chat template: prompts, tool listings
and observations are plain ASCII) and with chat tokenizers (the runner renders them through
the template). Rows are plain dicts, so a dataset file with the same columns works too.

  CalculatorEnv   row {a, b} (3-digit factors) or {question, answer}; tool `calculator`;
                  reward 1 iff the final answer equals a*b (the gold answer).
  PythonToolEnv   row {question, answer}; tool `python`, run in the code reward's sandbox.
  GuessNumberEnv  row {secret, lo, hi}; "higher" / "lower" after each guess; reward 1 iff
                  the secret is guessed within max_turns.

Each has a scripted expert (`Environment.demonstration`): the tool tasks call their tool on
a*b (rows with a and b) and answer "Answer: <the tool's result>"; guess-number bisects.
"""

from __future__ import annotations

import ast
import fractions
import json
import operator
import re
import zlib
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from grpojax.envs.base import Environment, Step
from grpojax.envs.tools import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    TOOL_RESPONSE_CLOSE,
    TOOL_RESPONSE_OPEN,
    ToolEnvironment,
)
from grpojax.errors import UserError
from grpojax.rewards.sandbox import SandboxLimits, check_sandbox_isolation, run_python_sandboxed
from grpojax.rewards.verifiers import extract_answer_tag

__all__ = [
    "CalculatorEnv",
    "GuessNumberEnv",
    "PythonToolEnv",
    "calculator",
    "evaluate_arithmetic",
    "expert_uses_tool",
    "final_number",
    "guess_number_rows",
    "multiplication_rows",
]

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION_CHARS = 200


def evaluate_arithmetic(expression: str) -> fractions.Fraction:
    """The exact value of `expression`: numbers, + - * /, unary +/- and parentheses only.

    The text is parsed with `ast.parse(mode="eval")` and the tree walked; any other node (a
    name, a call, an attribute, `**`, a comparison, a string) is a ValueError, so nothing but
    arithmetic is ever evaluated. Exact (fractions), so 1/3*3 == 1. At most
    MAX_EXPRESSION_CHARS characters (bounds the size of the numbers, there being no power).
    """
    if not isinstance(expression, str):
        raise ValueError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {e.msg}") from None

    def value(node: ast.AST) -> fractions.Fraction:
        if isinstance(node, ast.Expression):
            return value(node.body)
        number = node.value if isinstance(node, ast.Constant) else None
        if isinstance(number, int | float) and not isinstance(number, bool):
            try:
                return fractions.Fraction(number)
            except (OverflowError, ValueError):
                raise ValueError(f"number {number!r} is out of range") from None
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise ZeroDivisionError("division by zero")
            return _BINARY[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](value(node.operand))
        what = type(getattr(node, "op", node)).__name__
        raise ValueError(f"{what} is not allowed: only numbers, + - * / and parentheses")

    return value(tree)


def _format_number(x: fractions.Fraction) -> str:
    return str(x.numerator) if x.denominator == 1 else f"{float(x):.12g}"


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with numbers, + - * / and parentheses.

    Args:
        expression: the expression, e.g. "(12 + 3) * 45 / 9".
    """
    return _format_number(evaluate_arithmetic(expression))


_NUMBER = re.compile(r"[-+]?\d+(?:,\d{3})*(?:\.\d+)?")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_ANSWER_IS = re.compile(r"answer\s*(?:is)?\s*[:=]?\s*([-+]?\d+(?:,\d{3})*(?:\.\d+)?)", re.I)


def _last_number(text: str) -> fractions.Fraction | None:
    found = _NUMBER.findall(text)
    return fractions.Fraction(found[-1].replace(",", "")) if found else None


def final_number(text: str | None) -> fractions.Fraction | None:
    """The number a final answer gives, by the first of these that `text` holds: the last
    `\\boxed{...}`, the last `<answer>...</answer>` (`grpojax.rewards.verifiers`), the last
    "Answer: N" / "answer is N", else the last number anywhere (each: its last number;
    thousands commas allowed). None where there is none."""
    if not text:
        return None
    boxed = _BOXED.findall(text)
    if boxed:
        return _last_number(boxed[-1])
    tagged = extract_answer_tag(text)
    if tagged is not None:
        return _last_number(tagged)
    stated = _ANSWER_IS.findall(text)
    if stated:
        return fractions.Fraction(stated[-1].replace(",", ""))
    return _last_number(text)


def _gold_number(value: Any, column: str) -> fractions.Fraction:
    try:
        return fractions.Fraction(str(value).strip().replace(",", ""))
    except (ValueError, ZeroDivisionError):
        raise UserError(f"env row column {column!r} must be a number, got {value!r}") from None


def _int_column(row: Mapping[str, Any], column: str, default: Any = None) -> int:
    value = row.get(column, default)
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise UserError(f"env row column {column!r} must be an int, got {value!r}")
    return int(value)


def _check_count(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
        raise UserError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def multiplication_rows(n: int, seed: int) -> list[dict[str, Any]]:
    """`n` rows of 3-digit multiplication for `CalculatorEnv`: {a, b, answer = a*b, question,
    prompt}; the same (n, seed) give the same rows (`np.random.default_rng(seed)`)."""
    n, seed = _check_count("n", n, 0), _check_count("seed", seed, 0)
    rng = np.random.default_rng(seed)
    pairs = rng.integers(100, 1000, size=(n, 2))
    rows = []
    for a, b in pairs.tolist():
        question = _multiplication_question(a, b)
        rows.append({"a": a, "b": b, "answer": a * b, "question": question, "prompt": question})
    return rows


def _multiplication_question(a: int, b: int) -> str:
    return f"What is {a} * {b}? Use the calculator if it helps. End with 'Answer: <number>'."


_TOOL_RESULT = re.compile(
    rf"{re.escape(TOOL_RESPONSE_OPEN)}\s*([-+]?\d+(?:\.\d+)?)\s*{re.escape(TOOL_RESPONSE_CLOSE)}"
)


class _NumericAnswerTask(ToolEnvironment):
    """A tool task with a question and a numeric gold answer: reward 1.0 iff the final answer
    (`final_number` of the turn without a tool call) equals it, else 0.0 (also when the
    episode ended without a final answer)."""

    def __init__(self, row: Mapping[str, Any], **kwargs: Any):
        super().__init__(row, **kwargs)
        if "question" not in row or "answer" not in row:
            raise UserError(
                f"{type(self).__name__} rows need columns 'question' and 'answer', got "
                f"{sorted(row)}"
            )
        self.question = str(row["question"])
        self.gold = _gold_number(row["answer"], "answer")

    def reset(self) -> str:
        return self.question

    def reward(self) -> float:
        return 1.0 if final_number(self.final_answer) == self.gold else 0.0

    def demonstration_call(self) -> tuple[str, dict[str, Any]] | None:
        """The expert's one tool call (tool name, arguments), or None: no demonstration."""
        return None

    def demonstration(self, observation: str | None) -> str | None:
        """First turn: `demonstration_call` as a tool call (ending at `</tool_call>`); then
        "Answer: N", N the number the tool answered (None where the answer is not one
        `<tool_response>` block holding just a number, e.g. an error)."""
        call = self.demonstration_call()
        if call is None:
            return None
        if observation is None:
            name, arguments = call
            body = json.dumps({"name": name, "arguments": arguments})
            return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"
        match = _TOOL_RESULT.fullmatch(observation)
        return f"Answer: {match.group(1)}" if match else None


class CalculatorEnv(_NumericAnswerTask):
    """3-digit multiplication with a `calculator` tool (safe arithmetic, `evaluate_arithmetic`).

    Row: {a, b} (the question is made from them, the answer is a*b) or {question, answer}.
    Reward: 1.0 iff the final turn's answer (`final_number`) equals the gold answer.
    Demonstration: calculator("a * b"), then "Answer: <its result>"; None (no demonstration)
    for rows without a and b (the question is not parsed).
    expert_tool_share: the share of rows whose demonstration calls the tool (default 1);
      on the others the expert is hurried and answers at once with an estimate, the
      product of the factors each rounded to the nearest ten, halves up (right only where
      both end in 0), so a warm start on them leaves RL the tool to learn. Which rows:
      `expert_uses_tool`, a function of (a, b).
    """

    max_turns = 4

    def __init__(self, row: Mapping[str, Any], *, expert_tool_share: float = 1.0, **kwargs: Any):
        share = expert_tool_share
        if isinstance(share, bool) or not isinstance(share, int | float) or not 0 <= share <= 1:
            raise UserError(f"expert_tool_share must be a number in [0, 1], got {share!r}")
        self.expert_tool_share = float(share)
        if "a" in row and "b" in row and "question" not in row:
            a, b = _int_column(row, "a"), _int_column(row, "b")
            row = {**row, "question": _multiplication_question(a, b), "answer": a * b}
        kwargs.setdefault("tools", {"calculator": calculator})
        super().__init__(row, **kwargs)

    def demonstration_call(self) -> tuple[str, dict[str, Any]] | None:
        if "a" not in self.row or "b" not in self.row:
            return None
        a, b = _int_column(self.row, "a"), _int_column(self.row, "b")
        return "calculator", {"expression": f"{a} * {b}"}

    def demonstration(self, observation: str | None) -> str | None:
        call = self.demonstration_call()
        if (
            call is None
            or observation is not None
            or expert_uses_tool(int(self.row["a"]), int(self.row["b"]), self.expert_tool_share)
        ):
            return super().demonstration(observation)
        a, b = int(self.row["a"]), int(self.row["b"])
        return f"Answer: {_round_to_ten(a) * _round_to_ten(b)}"


def expert_uses_tool(a: int, b: int, share: float) -> bool:
    """Whether `CalculatorEnv`'s expert calls the tool on (a, b) at `expert_tool_share` =
    `share`: crc32 of "a*b" / 2^32 < share (a fixed pseudo-random subset of that size)."""
    return zlib.crc32(f"{a}*{b}".encode()) / 2**32 < share


def _round_to_ten(x: int) -> int:
    """x rounded to the nearest multiple of 10, halves up (85 -> 90)."""
    return (x + 5) // 10 * 10


class PythonToolEnv(_NumericAnswerTask):
    """A question with a numeric answer and a `python` tool that runs code in the sandbox of
    the code-execution reward (`grpojax.rewards.sandbox`: writes confined to a temp dir, no
    network, CPU / memory / output / wall-clock limits).

    Row: {question, answer}. Reward: as `CalculatorEnv`'s.
    Demonstration (rows that also have a and b, as `multiplication_rows`'): python
      "print(a * b)", then "Answer: <its output>"; None for other rows.
    limits: the sandbox's `SandboxLimits`. Where the sandbox cannot confine writes here,
      construction raises `SandboxIsolationError` unless `limits.accept_weak_isolation`
      (`check_sandbox_isolation`, the code reward's own check).
    The per-call timeout defaults to the sandbox's wall-clock limit plus 10 s of start-up.
    """

    def __init__(self, row: Mapping[str, Any], *, limits: SandboxLimits | None = None, **kwargs):
        self.limits = limits if limits is not None else SandboxLimits()
        check_sandbox_isolation(self.limits)
        if "tools" in kwargs:
            raise UserError("PythonToolEnv's tool is fixed (python); do not pass tools")
        kwargs.setdefault("tool_timeout_s", self.limits.wall_s + 10.0)
        super().__init__(row, tools={"python": self.python}, **kwargs)

    def python(self, code: str) -> str:
        """Run a Python program in a sandbox and return what it prints (stdout, then stderr).

        Args:
            code: the program; only the standard library is available, print the results.
        """
        res = run_python_sandboxed(code, limits=self.limits)
        parts = [res.stdout.rstrip("\n")]
        if res.stderr:
            parts.append("stderr:\n" + res.stderr.rstrip("\n"))
        if res.timed_out:
            parts.append("(killed: time limit)")
        elif res.output_limit_exceeded:
            parts.append("(killed: output limit)")
        elif res.returncode:
            parts.append(f"(exit code {res.returncode})")
        return "\n".join(p for p in parts if p) or "(no output)"

    def demonstration_call(self) -> tuple[str, dict[str, Any]] | None:
        if "a" not in self.row or "b" not in self.row:
            return None
        a, b = _int_column(self.row, "a"), _int_column(self.row, "b")
        return "python", {"code": f"print({a} * {b})"}


_INTEGER = re.compile(r"[-+]?\d+")


def guess_number_rows(n: int, seed: int, lo: int = 1, hi: int = 100) -> list[dict[str, Any]]:
    """`n` rows for `GuessNumberEnv`: {secret, lo, hi}, secret uniform in [lo, hi]; the same
    arguments give the same rows (`np.random.default_rng(seed)`)."""
    n, seed = _check_count("n", n, 0), _check_count("seed", seed, 0)
    if any(isinstance(v, bool) or not isinstance(v, int) for v in (lo, hi)) or lo > hi:
        raise UserError(f"lo and hi must be ints with lo <= hi, got lo={lo!r}, hi={hi!r}")
    secrets = np.random.default_rng(seed).integers(lo, hi + 1, size=n)
    return [{"secret": int(s), "lo": lo, "hi": hi} for s in secrets.tolist()]


class GuessNumberEnv(Environment):
    """Find a secret integer in [lo, hi] from "higher" / "lower" answers.

    Row: {secret, lo (default 1), hi (default 100)}. Each policy turn's guess is the last
    integer in it; the answer is "higher" (the secret is greater than the guess), "lower", or
    the episode ends (done) on the secret. A turn without an integer gets a one-line
    reminder (counted: no_guess). Binary search needs at most ceil(log2(hi - lo + 1)) + 1
    turns (8 for [1, 100], the default max_turns).
    Reward: 1.0 iff the secret was guessed within max_turns, else 0.0. Per-turn shaping (off
    by default): each turn that does not find it gets reward -step_penalty.
    Demonstration: binary search, each turn the integer (lo + hi) // 2 of the range left,
    narrowed by "higher" / "lower" (None after any other observation).
    """

    max_turns = 8

    def __init__(self, row: Mapping[str, Any], *, step_penalty: float = 0.0, **kwargs: Any):
        super().__init__(row, **kwargs)
        if "secret" not in row:
            raise UserError(f"GuessNumberEnv rows need a column 'secret', got {sorted(row)}")
        self.lo, self.hi = _int_column(row, "lo", 1), _int_column(row, "hi", 100)
        self.secret = _int_column(row, "secret")
        if not self.lo <= self.secret <= self.hi:
            raise UserError(f"env row: secret {self.secret} is not in [{self.lo}, {self.hi}]")
        if isinstance(step_penalty, bool) or not isinstance(step_penalty, int | float):
            raise UserError(f"env step_penalty must be a number, got {step_penalty!r}")
        self.step_penalty = float(step_penalty)
        self.guesses: list[int] = []
        self.found = False
        self._demo_range = (self.lo, self.hi)  # the expert's range left, and its last guess
        self._demo_guess: int | None = None

    def reset(self) -> str:
        return (
            f"I am thinking of an integer from {self.lo} to {self.hi}. Guess it: reply with one "
            "integer per turn and I will answer higher or lower."
        )

    def step(self, completion: str) -> Step:
        penalty = -self.step_penalty if self.step_penalty else None
        found = _INTEGER.findall(completion)
        if not found:
            return Step(
                observation=f"No integer found: reply with one integer from {self.lo} to "
                f"{self.hi}.",
                reward=penalty,
                info={"no_guess": 1},
            )
        guess = int(found[-1])
        self.guesses.append(guess)
        if guess == self.secret:
            self.found = True
            return Step(observation="correct", done=True, info={"guesses": 1})
        hint = "higher" if self.secret > guess else "lower"
        return Step(observation=hint, reward=penalty, info={"guesses": 1})

    def reward(self) -> float:
        return 1.0 if self.found else 0.0

    def demonstration(self, observation: str | None) -> str | None:
        lo, hi = self._demo_range
        last = self._demo_guess
        if observation is not None:
            if last is None or observation not in ("higher", "lower"):
                return None
            lo, hi = (last + 1, hi) if observation == "higher" else (lo, last - 1)
        if lo > hi:
            return None
        self._demo_range, self._demo_guess = (lo, hi), (lo + hi) // 2
        return str(self._demo_guess)
