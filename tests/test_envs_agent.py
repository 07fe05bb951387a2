"""Agents that only know the OpenAI client (`openai`, the real package), played through the
endpoint (`grpojax.envs.agent`) by the multi-turn sampler on the built-in tiny model (random
init, float32) with a ChatML tokenizer.

Exactness: each episode is the ids sampled and the agent's messages rendered once: the
trainer's logprobs on its rows equal the sampler's within 1e-5 (float32, as every multi-turn
rollout: the cache's attention sums over its slots, the trainer's over columns); what each
agent was served is the decoded text of exactly the sampled ids; its prompt and its added
messages are the chat template's rendering of its requests. The same through
`/v1/completions`: the prompt and each continuation encoded as written, no template. Many
agents at once, an agent that edits its history (counted, the recorded ids kept), and every
bad input: a malformed request, an unknown episode, an agent that never calls or raises, a
conversation past the budget, a request past the turn cap, a chat request in a text
episode."""

from __future__ import annotations

import contextlib
import json
import urllib.error
import urllib.request

import openai
import pytest
from env_fixtures import assert_trainer_matches_sampler, chatml_tokenizer, random_episodes
from flax import nnx

from grpojax.envs import (
    AgentEndpoint,
    EpisodeRunner,
    agent_environment,
    demonstration_episodes,
    make_environments,
    render_observation,
    render_prompt,
    resolve_environment,
)
from grpojax.errors import UserError
from grpojax.models import Decoder, tiny_config

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                "required": ["a", "b"],
            },
        },
    }
]
SERVED: dict[str, list] = {}  # episode -> what each call returned (the agents record it)


def tool_agent(client, row):
    """Asks, answers every reply with a tool result and asks again, `row["calls"]` times;
    records what it was served; reward: the number of calls that ended with "stop"."""
    messages = [
        {"role": "system", "content": "Use the add tool."},
        {"role": "user", "content": row["q"]},
    ]
    served = SERVED.setdefault(row["q"] + client.default_headers["X-Episode-Id"], [])
    stops = 0
    for k in range(row["calls"]):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        choice = reply.choices[0]
        served.append((choice.message.content, choice.finish_reason))
        stops += choice.finish_reason == "stop"
        messages.append({"role": "assistant", "content": choice.message.content})
        messages.append({"role": "tool", "tool_call_id": f"c{k}", "content": str(k + 40)})
        if row.get("edit"):
            messages[-2]["content"] = "(edited)"
    if row.get("close"):
        client.close()  # as `with client:` would at its end
    return float(stops)


@pytest.fixture(scope="module")
def tok():
    return chatml_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return Decoder(tiny_config(num_layers=2, vocab_size=len(tok)), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def server():
    s = AgentEndpoint()
    yield s
    s.shutdown()


def _play(model, tok, env_cls, rows, *, server, group=2, budget=256, key=0, **env_kw):
    envs = make_environments(env_cls, rows, group_size=group, endpoint=server, **env_kw)
    runner = EpisodeRunner(envs, tok, max_episode_tokens=budget, step_timeout_s=30)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    episodes = random_episodes(model, runner, stop_ids=(eos, *range(40, 90)), key=key)
    return runner, envs, episodes


def test_agents_play_through_the_endpoint_exactly_many_at_once(model, tok, server):
    """Six agents at once (3 rows x 2): each episode's prompt is its first request rendered
    with its tools, each answer the template's rendering of the messages it added, each
    reply the decoded sampled ids; the trainer's logprobs equal the sampler's on every
    policy id, the agents' ids get no loss."""
    rows = [{"q": "1+2", "calls": 3}, {"q": "3+4", "calls": 2}, {"q": "5+6", "calls": 3}]
    runner, envs, episodes = _play(model, tok, agent_environment(tool_agent), rows, server=server)
    assert {e.done_reason for e in episodes} == {"done"}, [e.done_reason for e in episodes]
    assert [e.num_turns for e in episodes] == [3, 3, 2, 2, 3, 3]
    for env, ep in zip(envs, episodes, strict=True):
        first = env.transcript[0]
        assert list(ep.prompt_ids) == render_prompt(tok, first, tools=TOOLS)
        served = SERVED[env.row["q"] + env.episode]
        policy = [s for s in ep.segments if s.kind == "policy"]
        answers = [s for s in ep.segments if s.kind == "env"]
        for seg, (content, finish) in zip(policy, served, strict=True):
            assert content == tok.decode(seg.ids, skip_special_tokens=True)
            assert finish == "stop"
        for k, seg in enumerate(answers):  # the assistant turn, then the tool result
            added = env.transcript[k + 1][len(env.transcript[k]) + 1 :]
            assert [m["role"] for m in added] == ["tool"]
            want = render_observation(tok, [dict(added[0])], policy_ids=policy[k].ids)
            assert list(seg.ids) == want
        assert env.history_mismatches == 0 and ep.final_reward == len(served)
    assert_trainer_matches_sampler(model, episodes)
    assert runner.metrics()["agent_requests"] == sum(e.num_turns - 1 for e in episodes)


def test_a_tool_call_reaches_the_agent_as_one_and_is_counted(tok, server):
    """A turn that writes a <tool_call> block (scripted ids) is served as an OpenAI tool call
    (no content, finish_reason "tool_calls") and counted in the episode's `tool_calls`,
    which `env/tool_use_frac` and the evaluation's `tool_use` read; a plain turn is not."""
    envs = make_environments(
        agent_environment(tool_agent), [{"q": "9+1", "calls": 2}], group_size=1, endpoint=server
    )
    runner = EpisodeRunner(envs, tok, max_episode_tokens=256, step_timeout_s=30)
    runner.prompt_ids()
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 9, "b": 1}}\n</tool_call>'
    for text in (call, "10"):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        runner.advance([0], [ids], [[0.0] * len(ids)])
    (episode,) = runner.episodes
    assert episode.done_reason == "done" and episode.counters["tool_calls"] == 1
    assert SERVED["9+1" + envs[0].episode] == [(None, "tool_calls"), ("10", "stop")]


def sum_agent(client, row):
    """Asks for a + b with the add tool offered, runs the calls of each reply and asks again
    (at most 3 requests); reward 1 when the last reply is the sum."""
    messages = [{"role": "user", "content": f"{row['a']}+{row['b']}"}]
    for _ in range(3):
        message = (
            client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
            .choices[0]
            .message
        )
        if not message.tool_calls:
            break
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            args = json.loads(call.function.arguments)
            content = str(args["a"] + args["b"])
            messages.append({"role": "tool", "tool_call_id": call.id, "content": content})
    return float(message.content == str(row["a"] + row["b"]))


def sum_expert(request, row):
    """Calls add(a, b), then replies with what the tool answered."""
    last = request["messages"][-1]
    if last["role"] == "tool":
        return last["content"]
    call = {"name": "add", "arguments": {"a": row["a"], "b": row["b"]}}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


def test_an_expert_demonstrates_through_the_endpoint(tok, server):
    """`env.kwargs.expert` writes the SFT warm start's turns: each is the expert's reply to
    the request the agent sent, served as a sampled turn would be (its <tool_call> block as
    an OpenAI tool call the agent runs), so the episode is the agent's own conversation
    with the expert's ids as the policy's (EOS after each) and the agent's reward. The agent
    sends the tool-call message back as the SDK gives it (`model_dump(exclude_none=True)`:
    no content), which OpenAI's API accepts and so does the endpoint."""
    rows = [{"a": 3, "b": 4}, {"a": 12, "b": 30}]
    envs = make_environments(
        agent_environment(sum_agent), rows, endpoint=server, expert="test_envs_agent:sum_expert"
    )
    runner = EpisodeRunner(envs, tok, max_episode_tokens=256, step_timeout_s=30)
    episodes = demonstration_episodes(runner, stop_ids=[tok.convert_tokens_to_ids("<|im_end|>")])
    for row, env, ep in zip(rows, envs, episodes):
        call = sum_expert({"messages": [{"role": "user"}]}, row)
        total = str(row["a"] + row["b"])
        assert ep.done_reason == "done" and ep.final_reward == 1.0
        assert ep.counters["tool_calls"] == 1 and env.history_mismatches == 0
        policy = [tok.decode(s.ids) for s in ep.segments if s.kind == "policy"]
        assert policy == [call + "<|im_end|>", total + "<|im_end|>"]
        served = env.transcript[1][1]["tool_calls"][0]["function"]
        assert json.loads(served["arguments"]) == row and served["name"] == "add"
        assert env.transcript[1][2]["content"] == total


def broken_expert(request, row):
    return request["no such key"]


@pytest.mark.parametrize(
    ("expert", "error", "match"),
    [
        (None, ValueError, r"has no expert: set env\.kwargs\.expert="),
        (broken_expert, ValueError, r"env\.kwargs\.expert raised KeyError: 'no such key'"),
        ("test_envs_agent:nothing", UserError, r"env\.kwargs\.expert: .*has no attribute"),
        ("no_colon", UserError, r"env\.kwargs\.expert: .*'package\.module:function'"),
        (3, UserError, r"env\.kwargs\.expert: must be a function"),
    ],
)
def test_a_missing_or_failing_expert_is_one_line(tok, server, expert, error, match):
    with pytest.raises(error, match=match):
        envs = make_environments(
            agent_environment(sum_agent), [{"a": 1, "b": 2}], endpoint=server, expert=expert
        )
        runner = EpisodeRunner(envs, tok, max_episode_tokens=256, step_timeout_s=30)
        try:
            demonstration_episodes(runner, stop_ids=[tok.convert_tokens_to_ids("<|im_end|>")])
        finally:
            with contextlib.suppress(RuntimeError):  # the waiting request refused: it ends
                envs[0].reward()


def test_an_agent_that_closes_its_client_leaves_the_others_connected(model, tok, server):
    """The agents' OpenAI clients share one HTTP client (`AgentEndpoint.http_client`): one
    agent closing its client after its one call does not cut the other agents' later calls;
    `shutdown` closes it."""
    rows = [{"q": "2+2", "calls": 1, "close": True}, {"q": "3+3", "calls": 3}]
    _, _, episodes = _play(model, tok, agent_environment(tool_agent), rows, server=server, group=1)
    assert [(e.done_reason, e.num_turns) for e in episodes] == [("done", 1), ("done", 3)]
    assert not server.http_client().is_closed
    other = AgentEndpoint()
    shared = other.http_client()
    other.shutdown()
    assert shared.is_closed


def test_an_agent_that_edits_its_history_is_counted_and_the_served_ids_kept(model, tok, server):
    """An agent that rewrites the assistant's text before asking again: each such request is
    a history mismatch (counted per episode and by the runner); the episode holds the ids
    that were sampled, so the trainer's logprobs still equal the sampler's."""
    rows = [{"q": "7+8", "calls": 3, "edit": True}]
    runner, envs, episodes = _play(model, tok, agent_environment(tool_agent), rows, server=server)
    assert [env.history_mismatches for env in envs] == [2, 2]
    assert runner.metrics()["history_mismatches"] == 4
    assert_trainer_matches_sampler(model, episodes)


def text_agent(client, row):
    """Asks by `/v1/completions`, then continues the text it was served (prompt and replies)
    with "\nTry k:" and asks again, `row["calls"]` times (with `row["edit"]`, the reply is
    replaced by "(edited)" in the text it sends); reward: the number of replies."""
    prompt = row["q"]
    served = SERVED.setdefault(row["q"] + client.default_headers["X-Episode-Id"], [])
    for k in range(row["calls"]):
        reply = client.completions.create(model="policy", prompt=prompt, max_tokens=8)
        choice = reply.choices[0]
        served.append((choice.text, choice.finish_reason))
        prompt += ("(edited)" if row.get("edit") else choice.text) + f"\nTry {k}:"
    return float(len(served))


def test_text_completions_are_episodes_encoded_as_written(model, tok, server):
    """`/v1/completions` agents (two rows x 2, one of them editing): the prompt ids are the
    tokenizer's encoding of the first prompt as written (no template), each reply the
    decoded sampled ids, each answer the encoding of exactly the text the agent appended;
    the editing agent's requests are mismatches and the served ids are kept; the trainer's
    logprobs equal the sampler's."""
    rows = [{"q": "1+2=", "calls": 3}, {"q": "Sum 3 4:", "calls": 2, "edit": True}]
    runner, envs, episodes = _play(model, tok, agent_environment(text_agent), rows, server=server)
    assert [e.num_turns for e in episodes] == [3, 3, 2, 2]
    assert [env.history_mismatches for env in envs] == [0, 0, 1, 1]
    assert runner.metrics()["history_mismatches"] == 2
    for env, ep in zip(envs, episodes, strict=True):
        assert env.kind == "text" and env.transcript[0] == env.row["q"]
        assert list(ep.prompt_ids) == tok(env.row["q"])["input_ids"]
        served = SERVED[env.row["q"] + env.episode]
        policy = [s for s in ep.segments if s.kind == "policy"]
        answers = [s for s in ep.segments if s.kind == "env"]
        for seg, (text, finish) in zip(policy, served, strict=True):
            assert text == tok.decode(seg.ids, skip_special_tokens=True) and finish == "stop"
        for k, seg in enumerate(answers):
            if not env.row.get("edit"):
                want = tok(f"\nTry {k}:", add_special_tokens=False)["input_ids"]
                assert list(seg.ids) == want
        assert ep.final_reward == len(served)
    assert_trainer_matches_sampler(model, episodes)


def switching_agent(client, row):
    """Asks by `/v1/completions`, then by chat: returns the chat request's status."""
    client.completions.create(model="policy", prompt=row["q"])
    try:
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "?"}])
    except openai.APIStatusError as e:
        SERVED["switch"] = e.message
        return float(e.status_code)
    return 0.0


def _post(url, body, headers=None, path="/chat/completions"):
    request = urllib.request.Request(
        url + path,
        data=body if isinstance(body, bytes) else json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_malformed_requests_get_one_line_each(server):
    """Bad JSON, no messages, a message without content, n=2, stream, an unknown or closed
    episode: HTTP 400 / 404 / 409 with one line naming the field."""
    ok = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}
    cases = [
        (b"{not json", {}, 400, "not JSON"),
        ({"model": "policy"}, {}, 400, "messages: a non-empty list"),
        ({"messages": [{"role": "user"}]}, {}, 400, "messages[0]: an object with a role"),
        ({**ok, "n": 2}, {}, 400, "n: 1 only"),
        ({**ok, "stream": True}, {}, 400, "stream: not served"),
        (ok, {"X-Episode-Id": "nobody"}, 404, "no open episode 'nobody'"),
    ]
    for body, headers, status, message in cases:
        got, reply = _post(server.url, body, headers)
        text = reply["error"]["message"]
        assert got == status and message in text and "\n" not in text, (got, text)
    server.open("gone")
    server.close("gone")
    got, reply = _post(server.url, ok, {"X-Episode-Id": "gone"})
    assert got == 409 and "no more requests" in reply["error"]["message"]
    with pytest.raises(openai.NotFoundError, match="no open episode"):
        openai.OpenAI(base_url=server.url, api_key="x", max_retries=0).chat.completions.create(
            model="policy", messages=ok["messages"]
        )
    text = {"model": "policy", "prompt": "hi"}
    cases = [
        ({"model": "policy"}, 400, "prompt: one non-empty string"),
        ({**text, "prompt": ["a", "b"]}, 400, "prompt: one non-empty string"),
        ({**text, "prompt": [1, 2]}, 400, "prompt: one non-empty string"),
        ({**text, "echo": True}, 400, "echo: not served"),
        ({**text, "suffix": "x"}, 400, "suffix: not served"),
        ({**text, "n": 3}, 400, "n: 1 only"),
        ({**text, "prompt": ["hi"]}, 404, "no open episode"),  # a one-string list is served
    ]
    for body, status, message in cases:
        got, reply = _post(server.url, body, path="/completions")
        text_ = reply["error"]["message"]
        assert got == status and message in text_ and "\n" not in text_, (got, text_)
    got, reply = _post(server.url, ok, path="/embeddings")
    assert got == 404 and "/v1/completions" in reply["error"]["message"]


def test_two_hundred_agents_connect_at_once(server):
    """Every episode's agent may send its first request at the same moment (a round's
    rows): 200 concurrent connections are all queued to their episodes and answered."""
    import threading

    episodes = [f"burst{k}" for k in range(200)]
    calls = {e: server.open(e) for e in episodes}
    results = {}
    body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}

    def ask(e):
        results[e] = _post(server.url, body, {"X-Episode-Id": e})

    threads = [threading.Thread(target=ask, args=(e,)) for e in episodes]
    for t in threads:
        t.start()
    for e in episodes:
        calls[e].get(timeout=30).answer(200, {"episode": e})
    for t in threads:
        t.join(timeout=30)
    assert results == {e: (200, {"episode": e}) for e in episodes}
    for e in episodes:
        server.close(e)


def silent_agent(client, row):
    return 1.0  # never calls


def failing_agent(client, row):
    messages = [{"role": "user", "content": "hi"}]
    client.chat.completions.create(model="policy", messages=messages)
    raise ValueError("the agent's own bug")


def endless_agent(client, row):
    """Asks again and again; returns what ended it (the last finish reason or the error)."""
    messages = [{"role": "user", "content": row["q"]}]
    try:
        while True:
            reply = client.chat.completions.create(model="policy", messages=messages)
            SERVED.setdefault("endless", []).append(reply.choices[0].finish_reason)
            messages += [
                {"role": "assistant", "content": reply.choices[0].message.content},
                {"role": "user", "content": "again " * row["long"]},
            ]
    except openai.APIStatusError as e:
        SERVED.setdefault("endless", []).append(e.status_code)
        return 0.5


def test_agents_that_fail_or_overrun_end_their_episodes_in_one_line(model, tok, server):
    """An agent that never calls stops the round at its reset, naming the row; one that
    raises after a call scores 0 (a reward error) while the others go on; a request past the
    turn cap is refused (409) and the episode ends "max_turns"; a conversation past the
    token budget is answered with finish_reason "length" (or, once the agent's message no
    longer fits, the episode ends "token_budget" and its waiting request gets 409)."""
    env = agent_environment(silent_agent)
    with pytest.raises(UserError, match=r"row 0: .*reset\(\) raised .*returned before its first"):
        _play(model, tok, env, [{"q": "x"}], server=server, group=1, request_wait_s=5)
    runner, _, eps = _play(
        model, tok, agent_environment(failing_agent), [{"q": "x"}], server=server, group=1
    )
    assert eps[0].final_reward == 0.0 and runner.metrics()["reward_errors"] == 1
    assert "the agent's own bug" in runner.errors[0]
    SERVED.pop("endless", None)
    capped = agent_environment(endless_agent)
    runner, _, eps = _play(
        model, tok, capped, [{"q": "go", "long": 1}], server=server, group=1, max_turns=2
    )
    assert eps[0].done_reason == "max_turns" and eps[0].final_reward == 0.5
    assert SERVED["endless"] == ["stop", "stop", 409]
    SERVED.pop("endless", None)
    runner, _, eps = _play(
        model, tok, capped, [{"q": "go", "long": 30}], server=server, group=1, budget=60
    )
    assert eps[0].done_reason == "token_budget" and eps[0].final_reward == 0.5
    assert SERVED["endless"][-1] in (409, "length"), SERVED["endless"]
    runner, _, eps = _play(
        model, tok, agent_environment(switching_agent), [{"q": "go"}], server=server, group=1
    )
    assert eps[0].final_reward == 400 and eps[0].num_turns == 1
    assert "is a text episode: /v1/completions only" in SERVED["switch"]
    assert runner.metrics()["refused_requests"] == 1


def patient_agent(client, row):
    """One request; records how it ended (a status code or the client's own timeout) and the
    client's timeout."""
    try:
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "?"}])
    except openai.APIStatusError as e:
        SERVED["patient"] = (e.status_code, client.timeout)
    except openai.APITimeoutError:
        SERVED["patient"] = ("client timeout", client.timeout)
    return 0.0


def test_a_reply_waits_for_the_round_and_the_endpoint_bounds_it(tok):
    """A reply waits as long as the engine's round takes (the client's own timeout is longer
    than the endpoint's): a request left unanswered past the endpoint's `reply_timeout_s`
    gets the endpoint's one-line HTTP 504, never a client-side timeout (an eval round of
    128 SmolLM2 episodes once outlasted a fixed client timeout and scored every one 0)."""
    server = AgentEndpoint(reply_timeout_s=1)
    try:
        envs = make_environments(agent_environment(patient_agent), [{}], endpoint=server)
        EpisodeRunner(envs, tok, max_episode_tokens=64).prompt_ids()  # the request is waiting
        assert envs[0]._done.wait(10)
    finally:
        server.shutdown()
    status, timeout = SERVED["patient"]
    assert status == 504 and timeout == server.reply_timeout_s + 30


def test_the_config_names_an_agent_by_its_import_path(tmp_path, monkeypatch):
    """`env.name=agent:module:function` resolves to an AgentEnvironment playing it; a
    missing function is one line naming the field."""
    (tmp_path / "my_agents.py").write_text("def solve(client, row):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cls = resolve_environment("agent:my_agents:solve")
    assert cls.agent(None, {}) == 1.0
    with pytest.raises(UserError, match=r"env\.name"):
        resolve_environment("agent:my_agents:nothing")
