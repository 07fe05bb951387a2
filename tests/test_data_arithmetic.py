"""The built-in arithmetic task: answers checked by an independent evaluator, split disjoint
and seed-independent, draws deterministic per seed, knobs validated."""

from __future__ import annotations

import re

import pytest

from grpojax.data import ARITHMETIC_PRESETS, ArithmeticTask, arithmetic_task

_TERM = re.compile(r"^(\d+)((?:[+-]\d+)+)=$")


def _evaluate(prompt: str) -> tuple[list[int], list[str], int]:
    """Independent reference: parse "a+b-c=" by regex, evaluate with Python's own parser
    (left to right for + and -, as the task defines)."""
    m = _TERM.match(prompt)
    assert m, f"malformed prompt {prompt!r}"
    operands = [int(x) for x in re.findall(r"\d+", prompt)]
    operators = re.findall(r"[+-]", prompt)
    value = eval(prompt[:-1], {"__builtins__": {}})  # digits and +/- only, checked by regex
    return operands, operators, value


@pytest.mark.parametrize("preset", sorted(ARITHMETIC_PRESETS))
def test_answers_are_correct_and_within_the_knobs(preset):
    task = arithmetic_task(preset)
    lo, hi = task.bounds
    rows = task.rows("train", 300, seed=3) + task.rows("heldout", 20, seed=3, unique=False)
    for row in rows:
        assert set(row) == {"prompt", "completion", "answer", "question"}
        operands, operators, value = _evaluate(row["prompt"])
        assert row["answer"] == row["completion"] == str(value)
        # the same problem spaced for a chat prompt: "12+34=" -> "12 + 34"
        words = [str(operands[0])]
        for op, x in zip(operators, operands[1:]):
            words += [op, str(x)]
        assert row["question"] == " ".join(words)
        assert len(operands) == task.num_terms
        assert all(lo <= x <= hi for x in operands)
        assert set(operators) <= set(task.ops)
        assert value >= 0  # allow_negative=False in every preset


def test_allow_negative_keeps_negative_answers():
    task = ArithmeticTask(digits=1, ops="-", allow_negative=True)
    rows = task.rows("train", 200, seed=0)
    values = [_evaluate(r["prompt"])[2] for r in rows]
    assert min(values) < 0
    assert all(r["answer"] == str(v) for r, v in zip(rows, values))


def test_operand_range_overrides_digits():
    task = ArithmeticTask(digits=3, operand_range=(5, 9), num_terms=3)
    for row in task.rows("train", 100, seed=1):
        assert all(5 <= x <= 9 for x in _evaluate(row["prompt"])[0])


def test_split_partitions_the_whole_space():
    task = arithmetic_task("add1")  # 100 problems: check the partition exhaustively
    train = {r["prompt"] for r in task.enumerate("train")}
    heldout = {r["prompt"] for r in task.enumerate("heldout")}
    every = {f"{a}+{b}=" for a in range(10) for b in range(10)}
    assert train.isdisjoint(heldout)
    assert train | heldout == every
    assert heldout  # a 10% share of 100 problems is not empty with this salt


def test_heldout_never_in_training_for_any_seed():
    task = arithmetic_task("add2")
    heldout = {r["prompt"] for r in task.enumerate("heldout")}
    # Binomial(10000, 0.1): mean 1000, sd 30; 5 sd either side.
    assert 850 <= len(heldout) <= 1150
    for seed in range(4):
        train = task.rows("train", 2000, seed=seed)
        assert not heldout & {r["prompt"] for r in train}
        assert {r["prompt"] for r in task.rows("heldout", 100, seed=seed)} <= heldout


def test_large_space_uses_the_same_split_rule():
    task = ArithmeticTask(digits=4)  # 10^8 problems: rejection sampling, not enumeration
    train = task.rows("train", 500, seed=0)
    held = task.rows("heldout", 200, seed=0)
    assert not any(task.is_heldout(r["prompt"]) for r in train)
    assert all(task.is_heldout(r["prompt"]) for r in held)
    assert len({r["prompt"] for r in held}) == 200  # held-out draws are unique by default
    for row in held:
        assert row["answer"] == str(_evaluate(row["prompt"])[2])


def test_salt_changes_the_split():
    a = {r["prompt"] for r in arithmetic_task("add2").enumerate("heldout")}
    b = {r["prompt"] for r in arithmetic_task("add2", split_salt="other").enumerate("heldout")}
    assert a != b


def test_deterministic_per_seed():
    task = arithmetic_task("addsub2")
    assert task.rows("train", 50, seed=7) == task.rows("train", 50, seed=7)
    assert task.rows("train", 50, seed=7) != task.rows("train", 50, seed=8)
    assert task.rows("heldout", 50, seed=7) == task.rows("heldout", 50, seed=7)
    # A fresh, equal task object gives the same rows (no hidden state).
    assert arithmetic_task("addsub2").rows("train", 50, seed=7) == task.rows("train", 50, seed=7)


def test_unique_and_too_many_unique():
    task = arithmetic_task("add1")
    n_held = len(task.enumerate("heldout"))
    rows = task.rows("heldout", n_held, seed=0)
    assert len({r["prompt"] for r in rows}) == n_held
    with pytest.raises(ValueError, match=f"split has {n_held}"):
        task.rows("heldout", n_held + 1, seed=0)
    # Non-unique training draws may repeat and may exceed the split's size.
    assert len(task.rows("train", 500, seed=0)) == 500


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(ops="*"), "ops must be"),
        (dict(ops=""), "ops must be"),
        (dict(num_terms=1), r"^num_terms must be an int >= 2, got 1$"),
        (dict(digits=0), r"^digits must be an int >= 1, got 0$"),
        (dict(operand_range=(5, 2)), "operand_range"),
        (dict(operand_range=(-1, 2)), "operand_range"),
        (dict(heldout_fraction=1.0), r"^heldout_fraction must be a finite number > 0 and < 1, got"),
        (dict(heldout_fraction=0), r"^heldout_fraction must be a finite number > 0 and < 1, got"),
    ],
)
def test_bad_knobs_are_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ArithmeticTask(**kwargs)


def test_bad_preset_split_and_n():
    with pytest.raises(ValueError, match=r"allowed: .*add2"):
        arithmetic_task("nope")
    with pytest.raises(ValueError, match="split must be one of"):
        arithmetic_task().rows("test", 3, seed=0)
    with pytest.raises(ValueError, match=r"^n must be an int >= 0, got -1$"):
        arithmetic_task().rows("train", -1, seed=0)


def test_answer_column_fits_the_numeric_reward():
    import grpojax.rewards.verifiers as rewards

    rows = arithmetic_task("addsub2").rows("train", 20, seed=0)
    prompts, answers = [r["prompt"] for r in rows], [r["answer"] for r in rows]
    right = [r["completion"] + "<eos>" for r in rows]
    wrong = [str(int(a) + 1) for a in answers]
    assert rewards.numeric_answer_reward(prompts, right, answer=answers) == [1.0] * 20
    assert rewards.numeric_answer_reward(prompts, wrong, answer=answers) == [0.0] * 20
