"""Scripted demonstrations (`Environment.demonstration`, `demonstration_episodes`): the
built-in environments' experts solve their rows through the runner, the episodes lay out
as trainer rows with the loss on the expert's ids only, and a missing demonstration is a
one-line error. No model: the character tokenizer (one id per character) and a chat
tokenizer built from it; two sandboxed Python runs."""

import json

import numpy as np
import pytest
from env_fixtures import QWEN_STYLE_TEMPLATE

from grpojax.data import stop_ids_of
from grpojax.envs import (
    CalculatorEnv,
    Environment,
    EpisodeRunner,
    GuessNumberEnv,
    PythonToolEnv,
    Step,
    demonstration_episodes,
    episode_batch,
    expert_uses_tool,
    make_environments,
    multiplication_rows,
)
from grpojax.errors import UserError
from grpojax.models.tokenizer import EOS_ID, builtin_tokenizer
from grpojax.rewards import SandboxLimits, sandbox_capabilities

EOS = "<eos>"


@pytest.fixture(scope="module")
def tok():
    return builtin_tokenizer()


def tool_call(name, **arguments):
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def response(text):
    """An observation as the runner renders it without a chat template."""
    return f"\n<tool_response>\n{text}\n</tool_response>\n"


def decode(tok, ids):
    return tok.decode([int(i) for i in ids], skip_special_tokens=False)


def check_rows(tok, episodes, completions):
    """`episode_batch` of `episodes` against the expected completions, given per episode as
    [(kind, text)] (one id per character, EOS as "<eos>")."""
    rows = episode_batch(episodes, pad_id=0)
    p = rows.tokens_ns.shape[1] - rows.completion_mask_nt.shape[1]
    for i, (ep, parts) in enumerate(zip(episodes, completions)):
        text = "".join(t for _, t in parts)
        mask = [k == "policy" for k, t in parts for _ in range(len(t.replace(EOS, "#")))]
        c = len(mask)
        assert rows.lengths_n[i] == c
        np.testing.assert_array_equal(rows.completion_mask_nt[i, :c], mask)
        assert not rows.completion_mask_nt[i, c:].any()
        assert not rows.sampler_logp_nt[i].any()
        assert rows.rewards_n[i] == 1.0
        assert decode(tok, rows.tokens_ns[i, p : p + c]) == text
        assert decode(tok, rows.tokens_ns[i, p - len(ep.prompt_ids) : p]) == decode(
            tok, ep.prompt_ids
        )
        assert rows.mask_ns[i].sum() == len(ep.prompt_ids) + c
        assert decode(tok, ep.tokens()) == decode(tok, ep.prompt_ids) + text


# -- calculator ----------------------------------------------------------------------------


def test_calculator_demonstrations_solve_every_row(tok):
    rows = multiplication_rows(3, seed=7)
    runner = EpisodeRunner(make_environments(CalculatorEnv, rows), tok, max_episode_tokens=500)
    episodes = demonstration_episodes(runner, stop_ids=stop_ids_of(tok))
    assert episodes is runner.episodes
    expected = []
    for row, ep in zip(rows, episodes):
        product = row["a"] * row["b"]
        assert ep.done_reason == "done" and ep.final_reward == 1.0 and ep.num_turns == 2
        assert ep.counters["tool_calls"] == 1 and ep.counters["final_answers"] == 1
        assert [s.kind for s in ep.segments] == ["policy", "env", "policy"]
        assert all(lp == 0.0 for s in ep.segments if s.kind == "policy" for lp in s.logprobs)
        # The call ends at its stop string (no EOS); the final answer at EOS.
        call = tool_call("calculator", expression=f"{row['a']} * {row['b']}")
        expected.append(
            [("policy", call), ("env", response(product)), ("policy", f"Answer: {product}{EOS}")]
        )
        assert ep.segments[0].ids[-1] != EOS_ID and ep.segments[-1].ids[-1] == EOS_ID
    assert runner.metrics()["tool_calls"] == 3 and runner.metrics()["episodes_done"] == 3
    check_rows(tok, episodes, expected)


def test_calculator_demonstration_on_the_chat_template_is_the_whole_conversation():
    chat = builtin_tokenizer()
    chat.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    chat.add_tokens(["<tool_call>", "</tool_call>"])
    chat.eos_token = "<|im_end|>"
    chat.chat_template = QWEN_STYLE_TEMPLATE
    env = CalculatorEnv({"a": 321, "b": 654})
    runner = EpisodeRunner([env], chat, max_episode_tokens=2000)
    (ep,) = demonstration_episodes(runner, stop_ids=stop_ids_of(chat))
    assert ep.done_reason == "done" and ep.final_reward == 1.0
    conversation = [
        {"role": "user", "content": env.question},
        {"role": "assistant", "content": tool_call("calculator", expression="321 * 654")},
        {"role": "tool", "content": str(321 * 654)},
        {"role": "assistant", "content": f"Answer: {321 * 654}"},
    ]
    full = chat.apply_chat_template(conversation, tools=env.tool_schemas(), tokenize=False)
    assert ep.tokens() == chat(full.removesuffix("\n"), add_special_tokens=False)["input_ids"]
    # The policy ids are the two assistant contents, the final one with its <|im_end|>.
    policy = [decode(chat, s.ids) for s in ep.segments if s.kind == "policy"]
    assert policy == [conversation[1]["content"], conversation[3]["content"] + "<|im_end|>"]


def test_a_hurried_expert_estimates_on_the_rows_it_skips_the_tool(tok):
    """`expert_tool_share=s`: the demonstrations call the calculator on a fixed subset of
    the rows (crc32 of "a*b" / 2^32 < s: 44.7% of 2,000 rows at s 0.45) and answer the
    rest at once with the factors rounded to tens, halves up, multiplied (reward 0 unless
    that is the product)."""
    rows = multiplication_rows(2000, seed=0)
    uses = [expert_uses_tool(r["a"], r["b"], 0.45) for r in rows]
    assert abs(np.mean(uses) - 0.45) < 0.02, np.mean(uses)
    assert all(expert_uses_tool(r["a"], r["b"], 1.0) for r in rows)
    assert not any(expert_uses_tool(r["a"], r["b"], 0.0) for r in rows)
    # Hand-picked rows: 865 * 673 is skipped at 0.45, so its estimate is 870 * 670.
    some = rows[:12]
    envs = make_environments(CalculatorEnv, some, expert_tool_share=0.45)
    runner = EpisodeRunner(envs, tok, max_episode_tokens=500)
    episodes = demonstration_episodes(runner, stop_ids=stop_ids_of(tok))
    assert some[0]["a"] == 865 and some[0]["b"] == 673 and not uses[0]
    assert decode(tok, episodes[0].segments[0].ids) == f"Answer: {870 * 670}{EOS}"
    for row, used, ep in zip(some, uses, episodes):
        assert ep.done_reason == "done" and ep.counters["tool_calls"] == int(used)
        if used:
            assert ep.final_reward == 1.0 and ep.num_turns == 2
        else:
            a, b = (-(-(x - 4) // 10) * 10 for x in (row["a"], row["b"]))  # nearest ten
            assert ep.num_turns == 1
            assert decode(tok, ep.segments[0].ids) == f"Answer: {a * b}{EOS}"
            assert ep.final_reward == float(a * b == row["a"] * row["b"])
    assert 0 < sum(uses[:12]) < 12, uses[:12]  # both kinds among the rows checked
    for bad in (1.5, -0.1, "half", True):
        with pytest.raises(UserError, match=r"^expert_tool_share must be a number in \[0, 1\]"):
            CalculatorEnv(rows[0], expert_tool_share=bad)


def test_calculator_without_factors_has_no_demonstration(tok):
    envs = [CalculatorEnv({"a": 100, "b": 200}), CalculatorEnv({"question": "7*8?", "answer": 56})]
    runner = EpisodeRunner(envs, tok, max_episode_tokens=500)
    with pytest.raises(
        ValueError,
        match=r"^row 1: CalculatorEnv\.demonstration returned None before the episode ended "
        r"\(turn 1\)$",
    ):
        demonstration_episodes(runner, stop_ids=stop_ids_of(tok))


def test_a_demonstration_over_the_turn_budget_is_cut(tok):
    runner = EpisodeRunner([CalculatorEnv({"a": 100, "b": 200})], tok, max_episode_tokens=20)
    (ep,) = demonstration_episodes(runner, stop_ids=[EOS_ID])
    assert ep.done_reason == "token_budget" and ep.final_reward == 0.0
    assert ep.num_turns == 1 and ep.num_completion_tokens == 20
    assert decode(tok, ep.completion_ids()) == tool_call("calculator", expression="100 * 200")[:20]
    assert ep.counters["truncated_turns"] == 1 and "tool_calls" not in ep.counters


# -- python --------------------------------------------------------------------------------


def test_python_tool_demonstrations_run_the_product_in_the_sandbox(tok):
    limits = SandboxLimits(
        cpu_s=2,
        wall_s=10.0,
        memory_mb=256,
        accept_weak_isolation=not sandbox_capabilities().filesystem_isolation,
    )
    rows = multiplication_rows(2, seed=3)
    envs = make_environments(PythonToolEnv, rows, limits=limits)
    runner = EpisodeRunner(envs, tok, max_episode_tokens=1000)
    episodes = demonstration_episodes(runner, stop_ids=stop_ids_of(tok))
    expected = []
    for row, ep in zip(rows, episodes):
        product = row["a"] * row["b"]
        assert ep.done_reason == "done" and ep.final_reward == 1.0
        assert ep.counters["tool_calls"] == 1 and "tool_errors" not in ep.counters
        code = f"print({row['a']} * {row['b']})"
        expected.append(
            [
                ("policy", tool_call("python", code=code)),
                ("env", response(product)),
                ("policy", f"Answer: {product}{EOS}"),
            ]
        )
    check_rows(tok, episodes, expected)
    assert PythonToolEnv({"question": "q", "answer": 1}, limits=limits).demonstration(None) is None


# -- guess the number ----------------------------------------------------------------------


def bisection(secret, lo, hi):
    guesses = []
    while True:
        guess = (lo + hi) // 2
        guesses.append(guess)
        if guess == secret:
            return guesses
        lo, hi = (guess + 1, hi) if secret > guess else (lo, guess - 1)


@pytest.mark.parametrize("lo,hi", [(1, 100), (3, 9)])
def test_guess_number_demonstrations_bisect_to_the_secret(tok, lo, hi):
    secrets = sorted({lo, hi, lo + 1, hi - 1, (lo + hi) // 2, (2 * lo + hi) // 3})
    rows = [{"secret": s, "lo": lo, "hi": hi} for s in secrets]
    runner = EpisodeRunner(make_environments(GuessNumberEnv, rows), tok, max_episode_tokens=500)
    episodes = demonstration_episodes(runner, stop_ids=stop_ids_of(tok))
    expected = []
    for s, env, ep in zip(secrets, runner.envs, episodes):
        guesses = bisection(s, lo, hi)
        assert env.guesses == guesses and len(guesses) <= env.max_turns
        assert ep.done_reason == "done" and ep.final_reward == 1.0
        assert ep.num_turns == len(guesses) and ep.counters["guesses"] == len(guesses)
        parts = []
        for g in guesses:
            parts.append(("policy", f"{g}{EOS}"))
            if g != s:
                parts.append(("env", f"\n{'higher' if s > g else 'lower'}\n"))
        expected.append(parts)
    assert max(len(bisection(s, 1, 100)) for s in range(1, 101)) == 7
    check_rows(tok, episodes, expected)


# -- errors and the observation handed over -----------------------------------------------


class Echo(Environment):
    """Never done; its observation is ids ("ok"); its expert writes "hi" once, then None."""

    max_turns = 3

    def __init__(self, row, **kwargs):
        super().__init__(row, **kwargs)
        self.seen = []

    def reset(self):
        return "Say hi."

    def step(self, completion):
        return Step(observation=builtin_tokenizer()("ok", add_special_tokens=False)["input_ids"])

    def reward(self):
        return 0.0

    def demonstration(self, observation):
        self.seen.append(observation)
        return "hi" if observation is None else None


class NoDemo(Echo):
    demonstration = Environment.demonstration


def test_missing_demonstrations_are_errors_naming_row_and_class(tok):
    runner = EpisodeRunner([Echo({}), Echo({})], tok, max_episode_tokens=100)
    with pytest.raises(
        ValueError,
        match=r"^row 0: Echo\.demonstration returned None before the episode ended \(turn 2\)$",
    ):
        demonstration_episodes(runner, stop_ids=[EOS_ID])
    assert runner.envs[0].seen == [None, "ok"]  # ids observations are decoded
    assert runner.last_observations[1] == list(tok("ok", add_special_tokens=False)["input_ids"])

    runner = EpisodeRunner([Echo({}), NoDemo({})], tok, max_episode_tokens=100)
    with pytest.raises(
        ValueError,
        match=r"^row 1: NoDemo has no demonstrations \(it does not implement "
        r"Environment\.demonstration\)$",
    ):
        demonstration_episodes(runner, stop_ids=[EOS_ID])
    assert not any(e.segments for e in runner.episodes)  # checked before any turn
    with pytest.raises(ValueError, match="needs stop_ids"):
        demonstration_episodes(EpisodeRunner([Echo({})], tok, max_episode_tokens=9), stop_ids=[])
    runner = EpisodeRunner([GuessNumberEnv({"secret": 5})], tok, max_episode_tokens=100)
    runner.advance([0], [[EOS_ID]], [[0.0]])
    with pytest.raises(ValueError, match="needs a fresh EpisodeRunner"):
        demonstration_episodes(runner, stop_ids=[EOS_ID])
    assert GuessNumberEnv({"secret": 5}).demonstration("correct") is None
