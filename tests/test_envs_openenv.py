"""OpenEnv environments (the real `openenv-core` package, 0.2.1) as environments
(`env.name=openenv:...`, `grpojax.envs.openenv_env`).

The echo environment `openenv init` writes, and a countdown environment written on OpenEnv's
base classes (`openenv_fixtures`), played by scripted players through the runner: each
answer is the env's own observation (got by stepping an instance of the env directly)
rendered once after the turn's ids, the prompt its reset observation, the reward the sum of
its step rewards; the row's seed reaches `reset`. The same envs served by OpenEnv's own
server on loopback, played through `openenv:http://...`, give the same episodes. The tiny
model (random init) plays the echo env with the multi-turn sampler: the trainer's logprobs
equal the sampler's within 1e-5. Bad names are refused in one line."""

from __future__ import annotations

import sys

import pytest
from env_fixtures import assert_trainer_matches_sampler, random_episodes
from flax import nnx
from multidevice import free_port
from openenv_fixtures import (
    COUNTDOWN,
    ECHO,
    CountAction,
    CountdownEnvironment,
    CountObservation,
    echo_scaffold,
    serve,
)

from grpojax.envs import (
    EpisodeRunner,
    environment_rows,
    make_environments,
    resolve_environment,
)
from grpojax.errors import UserError
from grpojax.models import Decoder, tiny_config
from grpojax.models.tokenizer import EOS_ID, builtin_tokenizer


@pytest.fixture(scope="module")
def echo_dir(tmp_path_factory):
    with echo_scaffold(tmp_path_factory.mktemp("openenv")) as env_dir:
        yield env_dir


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def _play(name, rows, moves, *, max_turns):
    """Rows' episodes of env `name`, row r's turn k the text moves(r, k): (prompts, answers,
    episodes), prompts and answers as the runner's ids."""
    tok = builtin_tokenizer()
    envs = make_environments(resolve_environment(name), rows, max_turns=max_turns)
    runner = EpisodeRunner(envs, tok, max_episode_tokens=600, chat=False)
    prompts = runner.prompt_ids()
    answers: list[list[list[int]]] = [[] for _ in rows]
    while active := runner.active_rows():
        turns = [_ids(tok, moves(r, runner.episodes[r].num_turns)) for r in active]
        for r, ids in zip(active, runner.advance(active, turns, [[0.0] * len(t) for t in turns])):
            if ids is not None:
                answers[r].append(ids)
    return prompts, answers, runner.episodes


def _echo_moves(r, k):
    return f"row {r} says {'hi' * (k + 1)}"


def _count_moves(rows):
    """Count down right from each row's start, except odd rows: wrong at their second turn."""

    def moves(r, k):
        start = 2 + rows[r]["seed"] % 3
        return str(start - k) if r % 2 == 0 or k == 0 else "17"

    return moves


def test_the_scaffold_echo_env_answers_each_turn_with_its_own_observation(echo_dir):
    """Three turns of `openenv init`'s echo env on each of two rows: the prompt is its reset
    observation and each answer the observation it returns for that message (from stepping
    the env's own class directly), both as `name: value` lines rendered once; the reward is
    the sum of its step rewards (0.1 a character)."""
    from server.echo_env_environment import EchoEnvironment

    from models import EchoAction

    tok = builtin_tokenizer()
    rows = environment_rows(ECHO, "train", 2, seed=0)
    prompts, answers, episodes = _play(ECHO, rows, _echo_moves, max_turns=3)
    first = EchoEnvironment().reset()
    shown = f"echoed_message: {first.echoed_message}\nmessage_length: {first.message_length}"
    assert all(p == _ids(tok, shown) for p in prompts)
    for r, e in enumerate(episodes):
        direct = EchoEnvironment()
        direct.reset()
        observations = [direct.step(EchoAction(message=_echo_moves(r, k))) for k in range(3)]
        expected = [
            _ids(tok, f"\nechoed_message: {o.echoed_message}\nmessage_length: {o.message_length}\n")
            for o in observations[:2]
        ]
        assert answers[r] == expected  # the third turn hit max_turns: no answer
        assert e.done_reason == "max_turns" and e.num_turns == 3
        assert e.final_reward == pytest.approx(sum(o.reward for o in observations), abs=1e-9)
        assert e.final_reward > 0


def test_a_countdown_env_is_reset_with_the_rows_seed_and_ends_when_done():
    """An env that takes `seed` starts each row's count from it (2 + seed % 3); its single
    string field is the text as it is; `done` ends the episode (its observation dropped); a
    wrong number's reward None counts 0."""
    tok = builtin_tokenizer()
    rows = environment_rows(COUNTDOWN, "train", 4, seed=3)
    prompts, answers, episodes = _play(COUNTDOWN, rows, _count_moves(rows), max_turns=6)
    for r, (row, e) in enumerate(zip(rows, episodes)):
        start = 2 + row["seed"] % 3
        assert prompts[r] == _ids(tok, f"Count down from {start}.")
        assert e.done_reason == "done"
        if r % 2 == 0:
            assert e.num_turns == start and e.final_reward == start
            assert answers[r] == [_ids(tok, "\nRight. Next?\n")] * (start - 1)
        else:
            assert e.num_turns == 2 and e.final_reward == 1.0
            assert answers[r] == [_ids(tok, "\nRight. Next?\n")]
    assert len({2 + row["seed"] % 3 for row in rows}) > 1, "the seeds should differ in start"


def test_the_same_envs_served_by_openenv_on_loopback_play_the_same_episodes(echo_dir):
    """Both envs behind OpenEnv's own server (create_app under uvicorn on 127.0.0.1), played
    through `openenv:http://...` and openenv's GenericEnvClient: the same prompts, answers,
    rewards and endings as in process."""
    from server.echo_env_environment import EchoEnvironment

    from models import EchoAction, EchoObservation

    echo_rows = environment_rows(ECHO, "train", 2, seed=0)
    count_rows = environment_rows(COUNTDOWN, "train", 4, seed=3)
    cases = [
        (ECHO, (EchoEnvironment, EchoAction, EchoObservation), echo_rows, _echo_moves, 3),
        (
            COUNTDOWN,
            (CountdownEnvironment, CountAction, CountObservation),
            count_rows,
            _count_moves(count_rows),
            6,
        ),
    ]
    for name, classes, rows, moves, turns in cases:
        local = _play(name, rows, moves, max_turns=turns)
        with serve(*classes) as url:
            remote = _play(f"openenv:{url}", rows, moves, max_turns=turns)
        assert remote[0] == local[0] and remote[1] == local[1], name
        assert [(e.final_reward, e.done_reason, e.tokens()) for e in remote[2]] == [
            (e.final_reward, e.done_reason, e.tokens()) for e in local[2]
        ], name


def test_the_tiny_model_plays_the_echo_env_with_logprobs_the_trainer_reproduces(echo_dir):
    """Random turns of the tiny model (ended at any of half the vocabulary): the episodes run
    several turns, each reward is 0.1 per character of the decoded turns (the echo env's
    rule), and the trainer's logprobs equal the sampler's within 1e-5 (float32)."""
    tok = builtin_tokenizer()
    model = Decoder(tiny_config(num_layers=2), rngs=nnx.Rngs(0))
    rows = environment_rows(ECHO, "train", 2, seed=1)
    envs = make_environments(resolve_environment(ECHO), rows, group_size=2, max_turns=3)
    runner = EpisodeRunner(envs, tok, max_episode_tokens=200, chat=False)
    episodes = random_episodes(model, runner, stop_ids=(EOS_ID, *range(40, 90)))
    assert max(e.num_turns for e in episodes) >= 2
    for e in episodes:
        turns = [
            tok.decode(s.ids, skip_special_tokens=True) for s in e.segments if s.kind == "policy"
        ]
        assert e.final_reward == pytest.approx(0.1 * sum(len(t) for t in turns), abs=1e-9)
    assert_trainer_matches_sampler(model, episodes)


def test_bad_names_are_refused_in_one_line(monkeypatch):
    def refused(name, match):
        with pytest.raises(UserError, match=match) as info:
            resolve_environment(name)
        assert "\n" not in str(info.value) and "env.name" in str(info.value)

    allowed = r"env.name must be 'openenv:package.module:EnvClass'"
    refused("openenv:", allowed)
    refused("openenv:no_colon", allowed)
    refused("openenv:http://", allowed)
    refused("openenv:json:dumps", r"a function is not an OpenEnv Environment subclass")
    refused("openenv:grpojax.envs.builtin:CalculatorEnv", r"the class CalculatorEnv is not an")
    refused("openenv:no_such_module_x:Env", r"cannot import module 'no_such_module_x'")
    refused(
        "openenv:openenv_fixtures:NoteEnvironment",
        r"the action NoteAction must have one required field, a string.*its fields: message: "
        r"string, note: string$",
    )
    port = free_port()  # nothing listens on it
    refused(f"openenv:http://127.0.0.1:{port}", r"no server answers at http://127.0.0.1:\d+")
    train = {r["seed"] for r in environment_rows(COUNTDOWN, "train", 50, seed=0)}
    held = {r["seed"] for r in environment_rows(COUNTDOWN, "heldout", 10, seed=0)}
    assert len(train) == 50 and len(held) == 10 and not train & held
    monkeypatch.setitem(sys.modules, "openenv.core", None)  # the package not installed
    refused(COUNTDOWN, r'openenv-core is not installed; pip install "grpojax\[openenv\]"')
