"""Environments, host side (no JAX, no model): tool-call parsing, tool schemas, the safe
calculator, tool failures counted, the runner's turn / token / character budgets, concurrent
stepping, episodes as token segments, observation rendering through a Qwen-style chat
template (token-exact against rendering the whole conversation), the built-in environments
played by scripted policies, and `load_environment`'s errors.

A scripted policy stands in for the sampler: it writes a turn's text, the character
tokenizer (or a chat tokenizer built here from it) gives its ids, plus EOS where the turn
ends at EOS rather than at a stop string."""

import ast
import math
import pathlib
import pickle
import time

import numpy as np
import pytest
from env_fixtures import chatml_tokenizer

from grpojax.envs import (
    CalculatorEnv,
    Environment,
    Episode,
    EpisodeRunner,
    GuessNumberEnv,
    ParseError,
    RawText,
    Segment,
    Step,
    ToolCall,
    ToolEnvironment,
    calculator,
    evaluate_arithmetic,
    final_number,
    guess_number_rows,
    load_environment,
    make_environments,
    multiplication_rows,
    pad_episodes,
    parse_tool_calls,
    render_observation,
    render_prompt,
    tool_schema,
    tools_prompt,
)
from grpojax.errors import UserError
from grpojax.models.tokenizer import EOS_ID, builtin_tokenizer


@pytest.fixture(scope="module")
def char_tok():
    return builtin_tokenizer()


@pytest.fixture(scope="module")
def chat_tok():
    return chatml_tokenizer()


def encode(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def turn_ids(tok, text):
    """A scripted turn as the sampler would hand it back: its ids, then EOS unless it ends at
    the stop string </tool_call>."""
    ids = encode(tok, text)
    return ids if text.endswith("</tool_call>") else [*ids, tok.eos_token_id]


def play(runner, tok, policy, *, max_rounds=20):
    """Drive `runner` with `policy(row, episode) -> text` until every episode ends; returns
    per row the list of (kind, ids) appended, in order, to check against `Episode.tokens`."""
    appended = {r: [] for r in range(len(runner.envs))}
    for _ in range(max_rounds):
        rows = runner.active_rows()
        if not rows:
            return appended
        turns = [turn_ids(tok, policy(r, runner.episodes[r])) for r in rows]
        logps = [[-0.25 - 0.01 * i for i in range(len(t))] for t in turns]
        answers = runner.advance(rows, turns, logps)
        for r, t, a in zip(rows, turns, answers):
            appended[r].append(("policy", t))
            if a:
                appended[r].append(("env", a))
    raise AssertionError("episodes did not end")


def last_observation(tok, episode):
    env = [s for s in episode.segments if s.kind == "env"]
    return tok.decode(list(env[-1].ids), skip_special_tokens=True) if env else ""


# -- tool-call parsing ---------------------------------------------------------------------


def test_parse_tool_calls_good_nested_and_none():
    text = (
        "Let me compute.\n<tool_call>\n"
        '{"name": "calculator", "arguments": {"expression": "12 * 34"}}\n</tool_call> and '
        '<tool_call>{"name": "search", "arguments": {"q": {"deep": [1, {"x": "</tool_call>"}]}}}'
        "</tool_call>"
    )
    assert parse_tool_calls(text) == [
        ToolCall("calculator", {"expression": "12 * 34"}),
        ToolCall("search", {"q": {"deep": [1, {"x": "</tool_call>"}]}}),
    ]
    assert parse_tool_calls("The answer is 408.") == []
    assert parse_tool_calls('<tool_call>{"name": "now"}</tool_call>') == [ToolCall("now", {})]


@pytest.mark.parametrize(
    "body, kind, words",
    [
        ('{"name": "calculator", "arguments": {"expression": "1+"', "json", "not valid JSON"),
        ("{'name': 'calculator'}", "json", "not valid JSON"),
        ('["calculator"]', "not_object", "must be a JSON object"),
        ('{"arguments": {"expression": "1"}}', "name", '"name" string'),
        ('{"name": "", "arguments": {}}', "name", '"name" string'),
        ('{"name": "calculator", "arguments": "1+2"}', "arguments", "must be a JSON object"),
    ],
)
def test_parse_tool_calls_malformed(body, kind, words):
    got = parse_tool_calls(f"ok <tool_call>\n{body}\n</tool_call>")
    assert isinstance(got, ParseError) and got.kind == kind
    assert words in got.message and "\n" not in got.message


def test_parse_tool_calls_unclosed_and_one_bad_call_fails_the_turn():
    got = parse_tool_calls('<tool_call>{"name": "a", "arguments": {}} and more')
    assert isinstance(got, ParseError) and got.kind == "unclosed"
    two = '<tool_call>{"name": "a"}</tool_call><tool_call>{"name": 3}</tool_call>'
    got = parse_tool_calls(two)
    assert isinstance(got, ParseError) and got.kind == "name" and "tool call 2" in got.message


# -- schemas and the calculator ------------------------------------------------------------


def test_tool_schema_from_signature_and_docstring():
    schema = tool_schema(calculator)
    fn = schema["function"]
    assert schema["type"] == "function" and fn["name"] == "calculator"
    assert fn["parameters"]["required"] == ["expression"]
    assert fn["parameters"]["properties"]["expression"]["type"] == "string"
    assert "arithmetic expression" in fn["description"]
    assert tool_schema(calculator, name="calc")["function"]["name"] == "calc"

    def undocumented(x: int) -> int:
        return x

    with pytest.raises(UserError, match=r"tool 'undocumented': cannot make its JSON schema"):
        tool_schema(undocumented)


def test_calculator_is_exact_and_evaluates_only_arithmetic():
    assert calculator("(12 + 3) * 45 / 9") == "75"
    assert calculator("-2 * -3 - +1") == "5"
    assert calculator("1/3") == "0.333333333333"
    assert evaluate_arithmetic("1/3*3") == 1
    for bad, what in [
        ("__import__('os').system('echo hi')", "Call"),
        ("(1).real", "Attribute"),
        ("x + 1", "Name"),
        ("2 ** 10", "Pow"),
        ("'a' * 3", "Constant"),
        ("True + 1", "Constant"),
        ("[1][0]", "Subscript"),
        ("1 < 2", "Compare"),
        ("lambda: 0", "Lambda"),
    ]:
        with pytest.raises(ValueError, match=f"{what} is not allowed"):
            calculator(bad)
    with pytest.raises(ZeroDivisionError):
        calculator("1 / (2 - 2)")
    with pytest.raises(ValueError, match="longer than"):
        calculator("1+" * 200 + "1")
    with pytest.raises(ValueError, match="not an arithmetic expression"):
        calculator("1 +")


def test_final_number_prefers_boxed_tag_and_answer_line():
    assert final_number("so 3 then \\boxed{56,088} ok 7") == 56088
    assert final_number("x 5 <answer>41</answer> 9") == 41
    assert final_number("I think 12 * 3 ... Answer: 36. Checked 4 times") == 36
    assert final_number("first 10 then 20") == 20
    assert final_number("no numbers") is None and final_number(None) is None


# -- tools in an environment: failures are counted, never raised ---------------------------


def flaky(kind: str) -> str:
    """A tool that misbehaves on request.

    Args:
        kind: "raise", "sleep", "big" or anything else to echo it.
    """
    if kind == "raise":
        raise RuntimeError("tool broke\nsecond line")
    if kind == "sleep":
        time.sleep(0.6)
    if kind == "big":
        return "z" * 500
    return kind


class FlakyEnv(ToolEnvironment):
    tools = {"flaky": flaky}  # noqa: RUF012
    max_output_chars = 100
    tool_timeout_s = 0.1

    def reset(self):
        return "Use the tool."

    def reward(self):
        return 1.0 if self.final_answer == "done" else 0.0


def call(name, **arguments):
    import json

    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_tool_failures_are_counted_in_info_and_answered():
    env = FlakyEnv({})
    turn = "".join(
        [
            call("flaky", kind="echo"),
            call("flaky", kind="raise"),
            call("flaky", kind="sleep"),
            call("flaky", kind="big"),
            call("nope"),
            call("flaky", wrong=1),
        ]
    )
    step = env.step(turn)
    assert not step.done
    assert dict(step.info) == {
        "tool_calls": 6,
        "tool_errors": 1,
        "tool_timeouts": 1,
        "output_truncations": 1,
        "unknown_tools": 1,
        "bad_arguments": 1,
    }
    blocks = step.observation.split("\n<tool_response>\n")
    assert len(blocks) == 6 and blocks[0] == "<tool_response>\necho\n</tool_response>"
    assert "Error: RuntimeError: second line" in blocks[1]
    assert "timed out after 0.1 s" in blocks[2]
    assert "z" * 100 + "... (400 more characters cut)" in blocks[3]
    assert "unknown tool 'nope'; available: flaky" in blocks[4]
    assert "bad arguments for 'flaky'" in blocks[5]
    bad = env.step("<tool_call>{oops}</tool_call>")
    assert dict(bad.info) == {"parse_errors": 1} and "Error: tool call 1 is not valid" in (
        bad.observation
    )
    final = env.step("done")
    assert final.done and final.observation is None and env.final_answer == "done"
    assert env.reward() == 1.0


def test_runner_sums_tool_failures_and_keeps_going(char_tok):
    envs = [FlakyEnv({}) for _ in range(2)]
    runner = EpisodeRunner(envs, char_tok, max_episode_tokens=4000)
    script = {
        0: [call("flaky", kind="raise") + call("flaky", kind="sleep"), "done"],
        1: [call("nope"), "<tool_call>[1]</tool_call>", "wrong"],
    }
    play(runner, char_tok, lambda r, ep: script[r][ep.num_turns])
    m = runner.metrics()
    assert m["tool_calls"] == 3 and m["tool_errors"] == 1 and m["tool_timeouts"] == 1
    assert m["unknown_tools"] == 1 and m["parse_errors"] == 1 and m["final_answers"] == 2
    assert m["turns"] == 5 and m["episodes_done"] == 2
    assert [e.final_reward for e in runner.episodes] == [1.0, 0.0]
    assert runner.episodes[1].counters["parse_errors"] == 1


# -- the runner: errors, budgets, concurrency ----------------------------------------------


class ScriptedEnv(Environment):
    """Answers each turn with row["obs"] (text or ids); raises / sleeps / misbehaves on
    request; done when the turn says "stop"."""

    max_turns = 3

    def reset(self):
        return "Go."

    def step(self, completion):
        mode = self.row.get("mode")
        if mode == "raise":
            raise KeyError("boom")
        if mode == "sleep":
            time.sleep(0.6)
        if mode == "not_a_step":
            return "higher"
        if completion.strip() == "stop":
            return Step(done=True, reward=0.5, info={"stops": 1})
        return Step(observation=self.row.get("obs", "ok"), reward=self.row.get("turn_reward"))

    def reward(self):
        if self.row.get("bad_reward"):
            return float("nan")
        return 1.0


def test_step_errors_end_only_their_episode(char_tok):
    modes = ["raise", "sleep", "not_a_step", None]
    envs = [ScriptedEnv({"mode": m}) for m in modes]
    runner = EpisodeRunner(envs, char_tok, max_episode_tokens=100, step_timeout_s=0.2)
    answers = runner.advance(range(4), [turn_ids(char_tok, "go")] * 4, [[-1.0] * 3] * 4)
    assert answers[:3] == [None, None, None]
    assert answers[3] == encode(char_tok, "\nok\n")
    assert [e.done_reason for e in runner.episodes] == ["error"] * 3 + [None]
    assert [e.final_reward for e in runner.episodes[:3]] == [0.0, 0.0, 0.0]
    m = runner.metrics()
    assert m["step_errors"] == 2 and m["step_timeouts"] == 1 and m["episodes_error"] == 3
    assert any("KeyError" in e for e in runner.errors)
    assert runner.active_rows() == [3]
    assert runner.turn_budgets().tolist() == [0, 0, 0, 100 - 3 - 4]
    with pytest.raises(ValueError, match="row 0 is not a ready row"):
        runner.advance([0], [[5]], [[0.0]])
    with pytest.raises(ValueError, match="it must have 1 to 93"):
        runner.advance([3], [[5] * 94], [[0.0] * 94])
    with pytest.raises(ValueError, match="one each per row"):
        runner.advance([3], [[5]], [])


class UnpicklableError(Exception):
    def __reduce__(self):
        raise TypeError("cannot pickle this error")


class SharedEnv(ScriptedEnv):
    """ScriptedEnv that counts its calls (class-wide) and can raise an error that does not
    pickle."""

    calls = 0

    def step(self, completion):
        SharedEnv.calls += 1
        if self.row.get("mode") == "unpicklable":
            raise UnpicklableError("no transport")
        return super().step(completion)


def test_shared_environment_calls_cross_a_pickle_and_run_where_share_says(char_tok):
    """With `share` (what a run across processes passes: one process computes, every
    process records), each environment call's results cross a pickle round trip (a Step's
    read-only info, an error that does not pickle) and give the episodes a runner without
    `share` gives; the calls run only inside `share`'s compute (once), and a process whose
    `share` returns another's results steps no environment of its own."""
    rows = [{"mode": "unpicklable"}, {"mode": "raise"}, {}, {"turn_reward": 0.25}]
    transport = lambda compute: pickle.loads(pickle.dumps(compute()))
    runs = {}
    for name, share in (("plain", None), ("shared", transport)):
        SharedEnv.calls = 0
        runner = EpisodeRunner(
            [SharedEnv(r) for r in rows], char_tok, max_episode_tokens=100, share=share
        )
        runner.advance(range(4), [turn_ids(char_tok, "go")] * 4, [[-1.0] * 3] * 4)
        runner.advance([2, 3], [turn_ids(char_tok, "stop")] * 2, [[-1.0] * 5] * 2)
        runs[name] = (runner.episodes, runner.metrics(), SharedEnv.calls, runner.errors)
    (eps, m, calls, errors), (eps_s, m_s, calls_s, errors_s) = runs["plain"], runs["shared"]
    assert eps_s == eps and m_s == m and calls_s == calls == 6 and len(errors) == 2
    assert [e.done_reason for e in eps] == ["error", "error", "done", "done"]
    assert "UnpicklableError: no transport" in errors_s[0] and "KeyError" in errors_s[1]
    # a process that only receives: its own environments never step
    recorded = {}
    runner = EpisodeRunner(
        [SharedEnv(r) for r in rows], char_tok, max_episode_tokens=100,
        share=lambda compute: recorded.setdefault("results", compute()),
    )  # fmt: skip
    runner.prompt_ids()
    SharedEnv.calls = 0
    receiver = EpisodeRunner(
        [SharedEnv(r) for r in rows], char_tok, max_episode_tokens=100,
        share=lambda compute: recorded["results"],
    )  # fmt: skip
    assert receiver.prompt_ids() == runner.prompt_ids() and SharedEnv.calls == 0


def test_turn_rewards_final_rewards_and_bad_values(char_tok):
    envs = [ScriptedEnv({"turn_reward": 0.25}), ScriptedEnv({"turn_reward": "x"})]
    envs.append(ScriptedEnv({"bad_reward": True}))
    runner = EpisodeRunner(envs, char_tok, max_episode_tokens=100)
    play(runner, char_tok, lambda r, ep: "stop" if ep.num_turns else "go")
    e0, e1, e2 = runner.episodes
    assert e0.turn_rewards == [0.25, 0.5] and e0.final_reward == 1.0
    assert e1.turn_rewards == [None, 0.5] and e1.counters["bad_turn_rewards"] == 1
    assert e2.final_reward == 0.0 and e2.counters["reward_errors"] == 1
    assert runner.metrics()["stops"] == 3


def test_max_turns_and_end_ids(char_tok):
    runner = EpisodeRunner([ScriptedEnv({}), ScriptedEnv({})], char_tok, max_episode_tokens=500)
    play(runner, char_tok, lambda r, ep: "go")
    assert [e.done_reason for e in runner.episodes] == ["max_turns", "max_turns"]
    assert [e.num_turns for e in runner.episodes] == [3, 3]
    assert [e.final_reward for e in runner.episodes] == [1.0, 1.0]

    runner = EpisodeRunner([ScriptedEnv({})], char_tok, max_episode_tokens=500, end_ids=[EOS_ID])
    assert runner.advance([0], [turn_ids(char_tok, "go")], [[0.0] * 3]) == [None]
    assert runner.episodes[0].done_reason == "eos" and runner.episodes[0].final_reward == 1.0
    runner = EpisodeRunner([ScriptedEnv({})], char_tok, max_episode_tokens=500, end_ids=[EOS_ID])
    assert runner.advance([0], [turn_ids(char_tok, "stop")], [[0.0] * 5]) == [None]
    assert runner.episodes[0].done_reason == "done"


def test_no_observation_continues_at_once(char_tok):
    runner = EpisodeRunner([ScriptedEnv({"obs": None})], char_tok, max_episode_tokens=50)
    assert runner.advance([0], [turn_ids(char_tok, "go")], [[0.0] * 3]) == [[]]
    assert runner.turn_budgets().tolist() == [47] and runner.episodes[0].num_env_tokens == 0
    assert runner.advance([0], [turn_ids(char_tok, "stop")], [[0.0] * 5]) == [None]
    assert [s.kind for s in runner.episodes[0].segments] == ["policy", "policy"]


def test_truncated_turn_ends_without_step(char_tok):
    env = GuessNumberEnv({"secret": 7})
    runner = EpisodeRunner([env], char_tok, max_episode_tokens=50)
    assert runner.advance([0], [encode(char_tok, "4")], [[0.0]], truncated=[True]) == [None]
    ep = runner.episodes[0]
    assert ep.done_reason == "token_budget" and env.guesses == [] and ep.final_reward == 0.0
    assert runner.metrics()["truncated_turns"] == 1 and ep.turn_rewards == [None]


def test_observations_cut_to_the_token_budget_and_the_character_cap(char_tok):
    note = " ...(cut)"
    # 3 policy ids, budget 40: 36 ids of room for the answer, one left for the next turn.
    envs = [ScriptedEnv({"obs": "x" * 100}), ScriptedEnv({"obs": list(range(10, 110))})]
    runner = EpisodeRunner(envs, char_tok, max_episode_tokens=40)
    a, b = runner.advance([0, 1], [turn_ids(char_tok, "go")] * 2, [[0.0] * 3] * 2)
    assert a == encode(char_tok, "\n" + "x" * 25 + note + "\n") and len(a) == 36
    assert b == list(range(10, 46))
    assert runner.metrics()["observation_token_truncations"] == 2
    assert "observation_char_truncations" not in runner.metrics()
    assert runner.turn_budgets().tolist() == [1, 1]
    # The next turn fills the budget: no room for another answer, the episode ends.
    assert runner.advance([0], [[EOS_ID]], [[0.0]]) == [None]
    assert runner.episodes[0].done_reason == "token_budget"
    assert runner.episodes[0].num_completion_tokens == 40

    runner = EpisodeRunner(
        [ScriptedEnv({"obs": "y" * 30})], char_tok, max_episode_tokens=40, max_observation_chars=20
    )
    (c,) = runner.advance([0], [turn_ids(char_tok, "go")], [[0.0] * 3])
    assert c == encode(char_tok, "\n" + "y" * 20 + note + "\n")
    assert runner.metrics()["observation_char_truncations"] == 1
    assert "observation_token_truncations" not in runner.metrics()
    assert runner.turn_budgets().tolist() == [40 - 3 - 31]

    # RawText: encoded as written, no plain framing, and cut the same way.
    envs = [ScriptedEnv({"obs": RawText("z" * 100)}), ScriptedEnv({"obs": RawText("ab")})]
    runner = EpisodeRunner(envs, char_tok, max_episode_tokens=40)
    a, b = runner.advance([0, 1], [turn_ids(char_tok, "go")] * 2, [[0.0] * 3] * 2)
    assert a == encode(char_tok, "z" * 27 + note) and len(a) == 36
    assert b == encode(char_tok, "ab")


def test_no_room_even_for_the_note_ends_the_episode(char_tok):
    runner = EpisodeRunner([ScriptedEnv({"obs": "long answer"})], char_tok, max_episode_tokens=8)
    assert runner.advance([0], [turn_ids(char_tok, "go")], [[0.0] * 3]) == [None]
    assert runner.episodes[0].done_reason == "token_budget"
    assert runner.episodes[0].final_reward == 1.0


def naps(seconds: float) -> str:
    """Sleep, then say so.

    Args:
        seconds: how long.
    """
    time.sleep(seconds)
    return "rested"


class NapEnv(ToolEnvironment):
    tools = {"naps": naps}  # noqa: RUF012

    def reset(self):
        return "Rest."

    def reward(self):
        return 1.0


def test_steps_run_concurrently(char_tok):
    n = 8
    runner = EpisodeRunner([NapEnv({}) for _ in range(n)], char_tok, max_episode_tokens=4000)
    turn = turn_ids(char_tok, call("naps", seconds=0.3))
    runner.prompt_ids()
    t0 = time.monotonic()
    answers = runner.advance(range(n), [turn] * n, [[0.0] * len(turn)] * n)
    elapsed = time.monotonic() - t0
    assert all("rested" in char_tok.decode(a) for a in answers)
    assert elapsed < n * 0.3 / 2, elapsed


# -- episodes as token segments ------------------------------------------------------------


def test_episode_alignment_by_hand():
    ep = Episode(prompt_ids=(1, 2, 3))
    ep.segments += [
        Segment((10, 11), (-0.1, -0.2), "policy"),
        Segment((20, 21, 22), None, "env"),
        Segment((12,), (-0.3,), "policy"),
    ]
    ep.turn_rewards += [0.5, None]
    ep.final_reward = 1.0
    assert ep.tokens() == [1, 2, 3, 10, 11, 20, 21, 22, 12]
    assert ep.loss_mask().tolist() == [0, 0, 0, 1, 1, 0, 0, 0, 1]
    assert ep.completion_mask().tolist() == [1, 1, 0, 0, 0, 1]
    np.testing.assert_array_equal(
        ep.sampler_logprobs(), np.array([-0.1, -0.2, 0, 0, 0, -0.3], np.float32)
    )
    assert ep.turn_ends() == [1, 5]
    assert ep.token_rewards().tolist() == [0, 0.5, 0, 0, 0, 1.0]
    assert (ep.num_turns, ep.num_policy_tokens, ep.num_env_tokens) == (2, 3, 3)

    batch = pad_episodes([ep, Episode(prompt_ids=(1,))], width=8, pad_id=-1)
    assert batch.tokens_nt.tolist() == [
        [10, 11, 20, 21, 22, 12, -1, -1],
        [-1] * 8,
    ]
    assert batch.lengths_n.tolist() == [6, 0] and batch.num_turns_n.tolist() == [2, 0]
    assert batch.mask_nt[0].tolist() == [1, 1, 0, 0, 0, 1, 0, 0]
    assert batch.logp_nt[0, :2].tolist() == pytest.approx([-0.1, -0.2])
    assert batch.rewards_n.tolist() == [1.0, 0.0]
    with pytest.raises(ValueError, match="width 4"):
        pad_episodes([ep], width=4)


def test_segment_checks():
    with pytest.raises(ValueError, match="one logprob per id"):
        Segment((1, 2), (0.0,), "policy")
    with pytest.raises(ValueError, match="one logprob per id"):
        Segment((1,), None, "policy")
    with pytest.raises(ValueError, match="no logprobs"):
        Segment((1,), (0.0,), "env")


def test_runner_episode_is_exactly_the_ids_it_saw(char_tok):
    envs = make_environments(CalculatorEnv, [{"a": 123, "b": 456}], group_size=2)
    runner = EpisodeRunner(envs, char_tok, max_episode_tokens=2000)
    prompts = runner.prompt_ids()
    script = [call("calculator", expression="123 * 456"), "Answer: 56088"]
    appended = play(runner, char_tok, lambda r, ep: script[ep.num_turns])
    for r, ep in enumerate(runner.episodes):
        expected = list(prompts[r])
        mask = [0] * len(prompts[r])
        logps = []
        for kind, ids in appended[r]:
            expected += ids
            mask += [int(kind == "policy")] * len(ids)
            logps += (
                [-0.25 - 0.01 * i for i in range(len(ids))] if kind == "policy" else [0] * len(ids)
            )
        assert ep.tokens() == expected
        assert ep.loss_mask().tolist() == mask
        np.testing.assert_allclose(ep.sampler_logprobs(), logps, rtol=1e-6)
        assert ep.final_reward == 1.0 and ep.done_reason == "done" and ep.num_turns == 2
        assert char_tok.unk_token_id not in ep.tokens()
    # The char tokenizer has no chat template: plain prompt with the tool listing, plain
    # "\n{observation}\n" answers.
    prompt = char_tok.decode(prompts[0])
    assert prompt.startswith("You may call these tools.") and '"name": "calculator"' in prompt
    assert prompt.endswith("\n" + envs[0].reset())
    env_ids = [ids for kind, ids in appended[0] if kind == "env"]
    assert env_ids == [encode(char_tok, "\n<tool_response>\n56088\n</tool_response>\n")]


def test_advance_turn_on_sampler_arrays(char_tok):
    envs = [ScriptedEnv({}), ScriptedEnv({}), ScriptedEnv({"obs": "a longer answer here"})]
    runner = EpisodeRunner(envs, char_tok, max_episode_tokens=100)
    runner.prompt_ids()
    go, stop = turn_ids(char_tok, "go"), turn_ids(char_tok, "stop")
    tokens = np.zeros((3, 6), np.int32)
    tokens[0, :3], tokens[1, :5], tokens[2, :3] = go, stop, go
    lengths = np.array([3, 5, 3])
    logp = np.full((3, 6), -0.5, np.float32)
    obs, obs_len = runner.advance_turn(
        tokens, lengths, logp, stopped_n=np.array([True, True, True]), pad_id=-7
    )
    assert obs.shape == (3, 32) and obs_len.tolist() == [4, 0, 22]
    assert obs[0, :4].tolist() == encode(char_tok, "\nok\n") and (obs[0, 4:] == -7).all()
    assert (obs[1] == -7).all()
    assert runner.episodes[1].done_reason == "done"
    assert runner.episodes[0].segments[0].logprobs == (-0.5, -0.5, -0.5)
    with pytest.raises(ValueError, match="exactly on the ready rows"):
        runner.advance_turn(tokens, lengths, logp, stopped_n=[True] * 3)
    lengths[1] = 0
    obs, obs_len = runner.advance_turn(tokens, lengths, logp, stopped_n=[True, True, False])
    assert obs_len.tolist() == [4, 0, 0] and runner.episodes[2].done_reason == "token_budget"


def test_stop_sequences(char_tok, chat_tok):
    env = CalculatorEnv({"a": 100, "b": 200})
    assert EpisodeRunner([env], char_tok, max_episode_tokens=9).stop_sequences() == (
        tuple(encode(char_tok, "</tool_call>")),
    )
    (seq,) = EpisodeRunner([env], chat_tok, max_episode_tokens=9).stop_sequences()
    assert len(seq) == 1 and chat_tok.convert_ids_to_tokens(list(seq)) == ["</tool_call>"]
    assert (
        EpisodeRunner(
            [GuessNumberEnv({"secret": 3})], char_tok, max_episode_tokens=9
        ).stop_sequences()
        == ()
    )


# -- rendering through a chat template -----------------------------------------------------


def test_observation_suffix_after_eos_and_after_a_stop_string(chat_tok):
    im_end = chat_tok.convert_tokens_to_ids("<|im_end|>")
    after_eos = render_observation(chat_tok, "higher", policy_ids=turn_ids(chat_tok, "I guess 50"))
    assert after_eos == encode(
        chat_tok, "\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n"
    )
    tool_turn = turn_ids(chat_tok, call("calculator", expression="2*3"))
    assert tool_turn[-1] != im_end
    expected = encode(
        chat_tok,
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n6\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n",
    )
    as_user = render_observation(
        chat_tok, "<tool_response>\n6\n</tool_response>", policy_ids=tool_turn
    )
    as_tool = render_observation(chat_tok, "6", role="tool", policy_ids=tool_turn)
    assert as_user == as_tool == expected
    # Ids are used as given; without a chat template (or chat=False) the plain format.
    assert render_observation(chat_tok, [5, 6, 7], policy_ids=tool_turn) == [5, 6, 7]
    assert render_observation(chat_tok, "hi", chat=False) == encode(chat_tok, "\nhi\n")


def test_observation_suffix_where_the_template_rewrites_the_last_assistant_turn():
    """A Qwen3-like template writes an empty think block only into the last assistant turn,
    so the conversation before the observation is not a prefix of the one after it; the
    suffix after the assistant's content is the same either way."""
    tok = builtin_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = (
        "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' }}"
        "{%- if m.role == 'assistant' and loop.last %}{{- '<think>\\n</think>\\n' }}{%- endif %}"
        "{{- m.content + '<|im_end|>\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    ids = render_observation(tok, "lower", policy_ids=[*encode(tok, "70"), eos])
    assert ids == encode(tok, "\n<|im_start|>user\nlower<|im_end|>\n<|im_start|>assistant\n")


def test_unknown_observation_role_is_a_user_error():
    strict = builtin_tokenizer()
    strict.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    strict.chat_template = (
        "{%- for m in messages %}{%- if m.role not in ['user', 'assistant'] %}"
        "{{ raise_exception('Unknown role ' + m.role) }}{%- endif %}"
        "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    with pytest.raises(UserError, match=r"observation_role 'tool'.*use a role it knows"):
        render_observation(strict, "6", role="tool")


def test_whole_chat_episode_equals_the_template_rendering(chat_tok):
    """A calculator episode on the chat tokenizer: its ids are exactly the tokenisation of
    the chat template's rendering of the whole conversation, the end-of-turn marker after a
    stop-string turn being an env id and after an EOS turn the policy's."""
    env = CalculatorEnv({"a": 123, "b": 456})
    runner = EpisodeRunner([env], chat_tok, max_episode_tokens=2000)
    question = env.reset()
    script = [call("calculator", expression="123 * 456"), "Answer: 56088"]
    play(runner, chat_tok, lambda r, ep: script[ep.num_turns])
    (ep,) = runner.episodes
    assert ep.final_reward == 1.0 and ep.done_reason == "done"
    conversation = [
        {"role": "user", "content": question},
        {"role": "assistant", "content": script[0]},
        {"role": "tool", "content": "56088"},
        {"role": "assistant", "content": script[1]},
    ]
    schemas = env.tool_schemas()
    full = chat_tok.apply_chat_template(conversation, tools=schemas, tokenize=False)
    assert full.endswith("<|im_end|>\n")
    assert ep.tokens() == encode(chat_tok, full[: -len("\n")])
    im_end = chat_tok.convert_tokens_to_ids("<|im_end|>")
    c = ep.completion_ids()
    mask = ep.completion_mask()
    ends = [i for i, t in enumerate(c) if t == im_end]
    # After </tool_call>: the env writes <|im_end|>; the final answer's <|im_end|> is sampled.
    assert not mask[ends[0]] and mask[ends[-1]] and ends[-1] == len(c) - 1
    prompt = chat_tok.decode(list(ep.prompt_ids), skip_special_tokens=False)
    assert '"name": "calculator"' in prompt and prompt.endswith("<|im_start|>assistant\n")


def test_prompts_with_and_without_tool_support(chat_tok, char_tok):
    plain_chat = builtin_tokenizer()
    plain_chat.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    plain_chat.chat_template = (
        "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + "
        "'<|im_end|>\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    tools = {"calculator": calculator}
    text = tools_prompt(
        plain_chat,
        tools,
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q"}],
    )
    assert text.startswith("<|im_start|>system\nYou may call these tools.")
    assert "Be brief.<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n" in text
    with_tools = tools_prompt(chat_tok, tools, "Q")
    assert with_tools.startswith("<|im_start|>system\n# Tools\n<tools>\n{")
    plain = tools_prompt(None, tools, "Q")
    assert plain.startswith("You may call these tools.") and plain.endswith("}\nQ")
    assert (
        tools_prompt(
            char_tok, {}, [{"role": "user", "content": "A"}, {"role": "user", "content": "B"}]
        )
        == "A\nB"
    )
    # Plain prompts are all in the character tokenizer's alphabet (no <unk>).
    ids = render_prompt(char_tok, "What is 2*3?", tools=[tool_schema(calculator)])
    assert char_tok.unk_token_id not in ids
    # RawText: the text as written, never the template, with the tokenizer's special tokens.
    assert render_prompt(chat_tok, RawText("Q: 1+1=")) == chat_tok("Q: 1+1=")["input_ids"]
    with pytest.raises(UserError, match="RawText takes no tools"):
        render_prompt(chat_tok, RawText("Q"), tools=[tool_schema(calculator)])
    with pytest.raises(UserError, match="reset\\(\\) must return text or a list"):
        tools_prompt(None, {}, [{"content": "no role"}])
    with pytest.raises(UserError, match="reset\\(\\) must return text or a list"):
        tools_prompt(None, {}, [])


def test_list_tools_false_leaves_the_listing_out_and_the_tools_working(char_tok):
    row = {"a": 123, "b": 456}
    listed, unlisted = CalculatorEnv(row), CalculatorEnv(row, list_tools=False)
    question = unlisted.reset()
    assert unlisted.tool_schemas() == [] and listed.tool_schemas() == [tool_schema(calculator)]
    ids = EpisodeRunner([unlisted], char_tok, max_episode_tokens=64).prompt_ids()[0]
    assert char_tok.decode(ids, skip_special_tokens=True) == question
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "123 * 456"}}\n'
    step = unlisted.step(call + "</tool_call>")
    assert step.observation == "<tool_response>\n56088\n</tool_response>"
    assert step.info == {"tool_calls": 1}
    with pytest.raises(UserError, match="env list_tools must be true or false, got 'no'"):
        CalculatorEnv(row, list_tools="no")


# -- built-in environments with scripted policies ------------------------------------------


def binary_search(tok, ep_state):
    """A policy halving [lo, hi] after each "higher" / "lower" (read from the decoded answer)."""

    def policy(r, ep):
        lo, hi, last = ep_state[r]
        obs = last_observation(tok, ep)
        if "higher" in obs:
            lo = last + 1
        elif "lower" in obs:
            hi = last - 1
        guess = (lo + hi) // 2
        ep_state[r] = (lo, hi, guess)
        return f"My guess: {guess}"

    return policy


@pytest.mark.parametrize("which", ["char", "chat"])
def test_guess_number_binary_search_finds_the_secret(which, char_tok, chat_tok):
    tok = char_tok if which == "char" else chat_tok
    rows = [*guess_number_rows(6, seed=3), {"secret": 1}, {"secret": 100}]
    runner = EpisodeRunner(make_environments(GuessNumberEnv, rows), tok, max_episode_tokens=1000)
    state = {r: (1, 100, 0) for r in range(len(rows))}
    play(runner, tok, binary_search(tok, state))
    bound = math.ceil(math.log2(100)) + 1
    for env, ep in zip(runner.envs, runner.episodes):
        assert ep.done_reason == "done" and ep.final_reward == 1.0
        assert ep.num_turns <= bound and env.guesses[-1] == env.secret
        assert tok.unk_token_id not in ep.tokens()
    assert runner.metrics()["episodes_done"] == len(rows)


def test_guess_number_wrong_policy_and_no_integer(char_tok):
    envs = [GuessNumberEnv({"secret": 77}), GuessNumberEnv({"secret": 5}, step_penalty=0.1)]
    runner = EpisodeRunner(envs, char_tok, max_episode_tokens=1000)
    play(runner, char_tok, lambda r, ep: "1" if r == 0 else "no idea")
    e0, e1 = runner.episodes
    assert e0.done_reason == e1.done_reason == "max_turns"
    assert e0.num_turns == 8 and e0.final_reward == 0.0 and e0.turn_rewards == [None] * 8
    assert e1.turn_rewards == [-0.1] * 8 and e1.counters["no_guess"] == 8
    assert "No integer found" in last_observation(char_tok, e1)
    assert "higher" in last_observation(char_tok, e0)


def test_row_generators_are_deterministic_and_valid():
    rows = multiplication_rows(5, seed=11)
    assert rows == multiplication_rows(5, seed=11) and rows != multiplication_rows(5, seed=12)
    for row in rows:
        assert 100 <= row["a"] <= 999 and 100 <= row["b"] <= 999
        assert row["answer"] == row["a"] * row["b"] and str(row["a"]) in row["question"]
    guesses = guess_number_rows(50, seed=0, lo=3, hi=9)
    assert guesses == guess_number_rows(50, seed=0, lo=3, hi=9)
    assert {g["secret"] for g in guesses} <= set(range(3, 10)) and len(
        {g["secret"] for g in guesses}
    ) > 3
    with pytest.raises(UserError, match="lo <= hi"):
        guess_number_rows(2, seed=0, lo=5, hi=4)
    with pytest.raises(UserError, match="n must be an int >= 0"):
        multiplication_rows(-1, seed=0)


@pytest.mark.parametrize("which", ["char", "chat"])
def test_calculator_env_right_and_wrong_answers(which, char_tok, chat_tok):
    tok = char_tok if which == "char" else chat_tok
    rows = [*multiplication_rows(2, seed=5), {"question": "What is 7 * 8?", "answer": "56"}]
    envs = make_environments(CalculatorEnv, rows, group_size=2)
    runner = EpisodeRunner(envs, tok, max_episode_tokens=3000)

    def policy(r, ep):
        env = runner.envs[r]
        if ep.num_turns == 0:
            expression = f"{env.row['a']} * {env.row['b']}" if "a" in env.row else "7 * 8"
            return f"I will compute it. {call('calculator', expression=expression)}"
        result = int(last_observation(tok, ep).split("<tool_response>")[1].split()[0])
        return f"Answer: {result if r % 2 == 0 else result + 1}"

    play(runner, tok, policy)
    assert [e.final_reward for e in runner.episodes] == [1.0, 0.0] * 3
    m = runner.metrics()
    assert m["tool_calls"] == 6 and m["final_answers"] == 6 and m["episodes_done"] == 6


def test_calculator_env_tool_errors_and_no_final_answer(char_tok):
    runner = EpisodeRunner([CalculatorEnv({"a": 111, "b": 222})], char_tok, max_episode_tokens=3000)
    play(runner, char_tok, lambda r, ep: call("calculator", expression="__import__('os')"))
    (ep,) = runner.episodes
    assert ep.done_reason == "max_turns" and ep.num_turns == CalculatorEnv.max_turns
    assert ep.final_reward == 0.0 and ep.counters["tool_errors"] == CalculatorEnv.max_turns
    assert "Call is not allowed" in last_observation(char_tok, ep)


def test_env_and_runner_argument_errors(char_tok):
    with pytest.raises(UserError, match="env max_turns must be an int >= 1"):
        GuessNumberEnv({"secret": 3}, max_turns=0)
    with pytest.raises(UserError, match="env stop_strings must be a sequence"):
        GuessNumberEnv({"secret": 3}, stop_strings="</x>")
    with pytest.raises(UserError, match="secret 300 is not in"):
        GuessNumberEnv({"secret": 300})
    with pytest.raises(UserError, match="column 'secret' must be an int"):
        GuessNumberEnv({"secret": "7"})
    with pytest.raises(UserError, match="need columns 'question' and 'answer'"):
        CalculatorEnv({"a": 3})
    with pytest.raises(UserError, match="env tools must be a mapping"):
        CalculatorEnv({"a": 3, "b": 4}, tools={"calculator": 3})
    with pytest.raises(UserError, match="max_episode_tokens must be an int > 0"):
        EpisodeRunner([GuessNumberEnv({"secret": 3})], char_tok, max_episode_tokens=0)
    with pytest.raises(UserError, match="one or more Environment"):
        EpisodeRunner([], char_tok, max_episode_tokens=10)
    with pytest.raises(UserError, match="chat=True but the tokenizer has no chat_template"):
        EpisodeRunner([GuessNumberEnv({"secret": 3})], char_tok, max_episode_tokens=9, chat=True)
    assert GuessNumberEnv({"secret": 3}, max_turns=2, max_turn_tokens=5).max_turn_tokens == 5


# -- load_environment ------------------------------------------------------------------------


def test_load_environment(tmp_path, monkeypatch):
    (tmp_path / "my_envs.py").write_text(
        "from grpojax.envs import Environment, GuessNumberEnv\n"
        "class Sub(GuessNumberEnv):\n    pass\n"
        "class Half(Environment):\n    def reset(self):\n        return ''\n"
        "class NotEnv:\n    pass\n"
        "def fn():\n    pass\n"
        "NS = type('NS', (), {'Inner': Sub})\n"
    )
    (tmp_path / "broken_envs.py").write_text("raise RuntimeError('no luck')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_environment("my_envs:Sub").__name__ == "Sub"
    assert load_environment("my_envs:NS.Inner").__name__ == "Sub"
    assert load_environment("grpojax.envs:GuessNumberEnv") is GuessNumberEnv
    for path, message in [
        ("my_envs.Sub", "must be an Environment subclass, named as 'package.module:Class'"),
        ("my_envs:", "must be an Environment subclass"),
        ("a:b:c", "must be an Environment subclass"),
        ("nowhere_mod:Env", "cannot import module 'nowhere_mod'"),
        ("broken_envs:Env", "RuntimeError: no luck"),
        ("my_envs:Missing", "has no attribute 'Missing'"),
        ("my_envs:NotEnv", "is the class NotEnv, not an Environment subclass"),
        ("my_envs:fn", "is a function, not an Environment subclass"),
        ("my_envs:Half", "does not implement reward, step"),
    ]:
        with pytest.raises(UserError, match=message) as info:
            load_environment(path)
        assert str(info.value).startswith("env: ") and "\n" not in str(info.value)


def test_envs_host_modules_import_no_sampler_trainer_driver_or_jax():
    """Only `rollout` (the loop that drives the sampler) reaches JAX; the environments, tools
    and episode bookkeeping are plain Python (tests/test_layers.py checks the direction)."""
    forbidden = ("jax", "flax", "grpojax.sampling", "grpojax.train", "grpojax.driver")
    root = pathlib.Path(__file__).resolve().parents[1] / "grpojax" / "envs"
    files = sorted(f for f in root.glob("*.py") if f.name != "rollout.py")
    assert {f.name for f in files} >= {"base.py", "episode.py", "tools.py", "builtin.py"}
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                assert not any(name == x or name.startswith(x + ".") for x in forbidden), (
                    f"{f.name} imports {name}"
                )
