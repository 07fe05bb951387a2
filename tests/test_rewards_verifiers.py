"""Built-in verifiers against hand-made cases: format regex, exact numbers, math-verify
equivalences (also inside worker processes and threads), reasoning-gym's own scorer."""

import functools

import numpy as np
import pytest

from grpojax.rewards import (
    DEFAULT_FORMAT_PATTERN,
    RewardManager,
    extract_answer_tag,
    final_number_reward,
    format_reward,
    math_answer_reward,
    numeric_answer_reward,
    reasoning_gym_reward,
)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<think>a+b</think><answer>3</answer>", 1.0),
        ("<think>\nmulti\nline\n</think>\n<answer>\n3\n</answer>\n", 1.0),
        ("  <think></think> <answer>x</answer>", 1.0),
        ("<answer>3</answer>", 0.0),  # no think block
        ("<think>a</think>", 0.0),  # no answer
        ("<think>a</think><answer>3</answer> trailing", 0.0),  # full match only
        ("preamble <think>a</think><answer>3</answer>", 0.0),
        ("<answer>3</answer><think>a</think>", 0.0),  # wrong order
        ("<think>a</think><answer>1</answer><answer>2</answer>", 0.0),  # two answers
        ("<think>a<think>b</think><answer>3</answer>", 0.0),  # nested think tag
    ],
)
def test_format_reward_default_pattern(text, expected):
    assert format_reward([""], [text]) == [expected]


def test_format_reward_custom_pattern_via_partial():
    boxed = functools.partial(format_reward, pattern=r".*\\boxed\{[^{}]+\}\s*")
    assert boxed(["", ""], ["so \\boxed{4}", "so 4"]) == [1.0, 0.0]
    assert DEFAULT_FORMAT_PATTERN  # public constant, used as the default


def test_numeric_answer_reward_first_number():
    completions = ["46", " 46", "46<eos>", "46 apples", "046", "4 6", "46.0", "", "x-12", "-12"]
    answers = ["46"] * 8 + [-12, "-12"]
    expected = [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    assert numeric_answer_reward([""] * 10, completions, answer=answers) == expected


def test_final_number_reward_reads_the_last_number():
    completions = [
        "17 + 25 = 42.",  # the answer last
        "The answer is 42",
        "42",
        "17 + 25",  # the question restated: its last number is 25
        "17 + 25 = 42, and 42 - 2 = 40",  # a later number wins
        "no number",
        "42.0",
        "x = -7",
    ]
    answers = ["42"] * 7 + ["-7"]
    expected = [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert final_number_reward([""] * 8, completions, answer=answers) == expected
    assert numeric_answer_reward([""] * 8, completions, answer=answers, mode="last_number") == (
        expected
    )
    # math-verify's symbolic equivalence takes the restated question for the answer
    assert math_answer_reward([""], ["17 + 25"], answer=["42"]) == [1.0]


def test_numeric_answer_reward_strip_mode():
    completions = [" 46 <eos>pad", "46", "46 apples", "<eos>46"]
    got = numeric_answer_reward(
        [""] * 4, completions, answer=[46] * 4, mode="strip", eos_text="<eos>"
    )
    assert got == [1.0, 1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="mode must be one of"):
        numeric_answer_reward([""], ["1"], answer=["1"], mode="last")
    with pytest.raises(ValueError, match="'answer' has 2 values for 1"):
        numeric_answer_reward([""], ["1"], answer=["1", "2"])


MATH_CASES = [
    # (gold, completion, expected)
    ("0.5", r"The answer is $\boxed{\frac{1}{2}}$.", 1.0),
    (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
    (r"$\frac{1}{2}$", "so it is 1/2", 1.0),
    ("42", "I think it is 42.", 1.0),
    ("42", "41", 0.0),
    ("$x^2+1$", r"$\boxed{1+x^2}$", 1.0),
    ("$x^2+1$", r"$\boxed{x^2-1}$", 0.0),
    (r"$\sqrt{2}$", r"\boxed{\sqrt{2}}", 1.0),
    ("3", "no idea", 0.0),
    # The answer tag's text is judged (math-verify alone reads nothing inside the tags),
    # the last tag when there are several; text outside the tag does not count.
    ("72", "<think>9 * 8</think> <answer>72</answer>", 1.0),
    ("0.5", r"<answer>\frac{1}{2}</answer>", 1.0),
    ("72", "<answer>70</answer> <answer>72</answer>", 1.0),
    ("72", "<answer>71</answer> so 72", 0.0),
]


def test_math_answer_reward_equivalences():
    gold, completions, expected = zip(*MATH_CASES)
    assert math_answer_reward([""] * len(gold), list(completions), answer=list(gold)) == list(
        expected
    )


def test_math_answer_unparseable_gold_is_none():
    assert math_answer_reward([""], ["1"], answer=["not math at all"]) == [None]


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_math_answer_reward_in_workers(mode):
    # In a worker process math-verify's signal.alarm timeouts run in the main thread;
    # in a thread they are switched off. Both must give the same answers.
    gold, completions, expected = zip(*MATH_CASES)
    n = len(gold)
    with RewardManager([math_answer_reward], mode=mode, num_workers=2, timeout_s=60) as mgr:
        res = mgr.compute([""] * n, list(completions), answer=list(gold))
    assert res.valid_n.all(), res.errors
    np.testing.assert_array_equal(res.total_n, np.array(expected, np.float32))


def test_extract_answer_tag():
    assert extract_answer_tag("<answer> 1 </answer> then <answer>\n2\n</answer>") == "2"
    assert extract_answer_tag("no tags") is None


def _basic_arithmetic_entries(n):
    import reasoning_gym

    return list(reasoning_gym.create_dataset("basic_arithmetic", size=n, seed=3))


def test_reasoning_gym_reward_uses_its_scorer():
    entries = _basic_arithmetic_entries(4)
    for e in entries:
        # independent check that the entry's answer is the value of its expression
        expr = e["metadata"]["expression"]
        assert float(eval(expr)) == pytest.approx(float(e["answer"]))
    wrong = [str(int(float(e["answer"])) + 1) for e in entries]
    completions = [
        f"<think>easy</think><answer>{entries[0]['answer']}</answer>",
        f"<answer>{wrong[1]}</answer>",
        f"{entries[2]['answer']}",  # no tag: nothing extracted
        f"<answer> {entries[3]['answer']} </answer>",
    ]
    got = reasoning_gym_reward([""] * 4, completions, entry=entries)
    assert got == [1.0, 0.0, 0.0, 1.0]
    # with the whole completion as the answer and an explicit task column
    full = reasoning_gym_reward(
        [""] * 2,
        [entries[0]["answer"], wrong[1]],
        entry=entries[:2],
        task=["basic_arithmetic"] * 2,
        extract="full",
    )
    assert full == [1.0, 0.0]


def test_reasoning_gym_reward_errors():
    with pytest.raises(ValueError, match="extract must be one of"):
        reasoning_gym_reward([""], ["x"], entry=[{}], extract="last_line")
    with pytest.raises(ValueError, match="task name"):
        reasoning_gym_reward([""], ["x"], entry=[{"answer": "1", "metadata": {}}])
