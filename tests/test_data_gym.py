"""reasoning-gym rows: the task's own scorer accepts the reference answer, the documented
columns are present, the train/held-out split is disjoint, errors name the allowed values."""

from __future__ import annotations

import pytest
import reasoning_gym as rg

from grpojax.data import PromptSource, reasoning_gym_rows, reasoning_gym_split
from grpojax.models.tokenizer import builtin_tokenizer

ARITH = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}


def _score(row, text):
    return rg.get_score_answer_fn(row["task"])(text, row["entry"])


def test_basic_arithmetic_rows_score_correct_with_true_answer():
    rows = reasoning_gym_rows("basic_arithmetic", size=20, seed=4, config=ARITH)
    assert len(rows) == 20
    for i in range(len(rows)):
        row = rows[i]
        assert set(row) == {"prompt", "question", "answer", "task", "entry"}
        assert row["task"] == "basic_arithmetic"
        assert row["prompt"] == row["question"] == row["entry"]["question"]
        assert row["answer"] == row["entry"]["answer"]
        assert _score(row, row["answer"]) == 1.0
        assert _score(row, str(int(row["answer"]) + 1)) < 1.0
        # Independent check of the reference answer: Python evaluates the expression.
        expr = row["entry"]["metadata"]["expression"]
        if "/" not in expr:
            assert int(row["answer"]) == eval(expr.replace("×", "*"), {"__builtins__": {}})


def test_countdown_rows_score_correct_with_true_answer():
    rows = reasoning_gym_rows("countdown", size=2, seed=0)
    for i in range(2):
        row = rows[i]
        assert _score(row, row["answer"]) == 1.0
        assert _score(row, "1+1") < 1.0
        # The reference expression uses the given numbers and reaches the target.
        meta = row["entry"]["metadata"]
        assert eval(row["answer"], {"__builtins__": {}}) == meta["target"]


def test_rows_are_deterministic_and_templated():
    a = reasoning_gym_rows("basic_arithmetic", size=5, seed=1, config=ARITH)
    b = reasoning_gym_rows(
        "basic_arithmetic", size=5, seed=1, template="Task: {question}\nAnswer:", config=ARITH
    )
    for i in range(5):
        assert b[i]["prompt"] == f"Task: {a[i]['question']}\nAnswer:"
        assert a[i]["entry"] == b[i]["entry"]


def test_split_is_disjoint_and_sized():
    # Tiny problem space (1-digit, 2 terms, +/-) so that collisions really happen.
    config = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1,
              "operators": ("+", "-"), "allow_negation": False}  # fmt: skip
    train, held = reasoning_gym_split(
        "basic_arithmetic", train_size=150, heldout_size=40, seed=0, config=config
    )
    assert len(train) == 150 and len(held) == 40
    held_q = {held[i]["question"] for i in range(len(held))}
    train_q = [train[i]["question"] for i in range(len(train))]
    assert not held_q & set(train_q)
    # Replacements happened (the space has at most 200 questions) and still score right.
    plain = reasoning_gym_rows("basic_arithmetic", size=190, seed=0, config=config)
    assert any(plain[40 + i]["question"] != train_q[i] for i in range(150))
    for i in range(0, 150, 10):
        assert _score(train[i], train[i]["answer"]) == 1.0


def test_source_passes_task_and_entry_to_rewards():
    rows = reasoning_gym_rows("basic_arithmetic", size=6, seed=2, config=ARITH)
    batch = PromptSource(rows, builtin_tokenizer(), seed=0).next_batch(4)
    assert set(batch.columns) == {"question", "answer", "task", "entry"}
    for i in range(4):
        assert batch.columns["task"][i] == "basic_arithmetic"
        row = {"task": "basic_arithmetic", "entry": batch.columns["entry"][i]}
        assert _score(row, batch.columns["answer"][i]) == 1.0


def test_errors_name_the_allowed_values():
    with pytest.raises(
        ValueError, match=r"unknown reasoning-gym task 'nope'; allowed: .*countdown"
    ):
        reasoning_gym_rows("nope", size=2, seed=0)
    with pytest.raises(ValueError, match="bad config for reasoning-gym task 'countdown'"):
        reasoning_gym_rows("countdown", size=2, seed=0, config={"bogus": 1})
    with pytest.raises(ValueError, match="size must be an int >= 1"):
        reasoning_gym_rows("countdown", size=0, seed=0)
    with pytest.raises(ValueError, match=r"refers to column\(s\) \['query'\]"):
        reasoning_gym_rows("countdown", size=2, seed=0, template="{query}")


def test_columns_fit_the_reasoning_gym_reward():
    import grpojax.rewards.verifiers as rewards

    rows = reasoning_gym_rows("basic_arithmetic", size=4, seed=3, config=ARITH)
    batch = PromptSource(rows, builtin_tokenizer(), seed=0).next_batch(4)
    right = [f"<answer>{a}</answer>" for a in batch.columns["answer"]]
    wrong = [f"<answer>{int(a) + 1}</answer>" for a in batch.columns["answer"]]
    kwargs = {k: batch.columns[k] for k in ("entry", "task")}
    assert rewards.reasoning_gym_reward(batch.prompts, right, **kwargs) == [1.0] * 4
    assert max(rewards.reasoning_gym_reward(batch.prompts, wrong, **kwargs)) < 1.0
