"""verifiers environments (the real `verifiers` package, 0.4.0, `verifiers.v1`) as
environments (`env.name=verifiers:<taskset id>`, `grpojax.envs.verifiers_env`), on a taskset
built from the package's own classes (`verifiers_envs`: 2-digit additions, rewards
`correct` + 0.5 * `brief`), nothing mocked: each episode is verifiers' own rollout through
grpojax's endpoint.

Against independent constructions: each prompt is the chat template's rendering of the
task's system prompt and question; each episode's reward is the taskset's score functions
applied to the decoded sampled reply (what verifiers scores); scripted right and wrong
answers score 1 and 0 on `correct`; the trainer's logprobs equal the sampler's within 1e-5
(float32) on every policy id. Rows split train / held-out by content; bad names, a
multi-seat env and a task whose scoring raises are each one line."""

from __future__ import annotations

import pytest
from env_fixtures import assert_trainer_matches_sampler, chatml_tokenizer, random_episodes
from flax import nnx
from verifiers_envs import PAIRS, SYSTEM, brief_score, correct_score

from grpojax.envs import (
    AgentEndpoint,
    AgentEnvironment,
    EpisodeRunner,
    environment_rows,
    is_heldout,
    make_environments,
    render_prompt,
    resolve_environment,
)
from grpojax.envs.registry import row_generator
from grpojax.errors import UserError
from grpojax.models import Decoder, tiny_config

NAME = "verifiers:verifiers_envs"


@pytest.fixture(scope="module")
def tok():
    return chatml_tokenizer()


@pytest.fixture(scope="module")
def server():
    s = AgentEndpoint()
    yield s
    s.shutdown()


def _expected_reward(reply: str, task: dict) -> float:
    return correct_score(reply.strip(), task["a"], task["b"]) + 0.5 * brief_score(reply)


def test_the_tiny_model_plays_verifiers_rollouts_scored_by_the_taskset(tok, server):
    """Six episodes (3 tasks x 2) of the tiny model (random init): the prompt is the
    template's rendering of the task's messages, the reward the taskset's for the decoded
    reply, the trainer's logprobs the sampler's on every policy id."""
    model = Decoder(tiny_config(num_layers=2, vocab_size=len(tok)), rngs=nnx.Rngs(0))
    rows = environment_rows(NAME, "train", 3, seed=0)
    envs = make_environments(resolve_environment(NAME), rows, group_size=2, endpoint=server)
    runner = EpisodeRunner(envs, tok, max_episode_tokens=256, step_timeout_s=30)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    episodes = random_episodes(model, runner, stop_ids=(eos, *range(40, 90)))
    assert {e.done_reason for e in episodes} == {"done"}, [e.done_reason for e in episodes]
    rewards = []
    for env, ep in zip(envs, episodes, strict=True):
        task = env.row["task"]
        question = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"What is {task['a']} + {task['b']}?"},
        ]
        assert list(ep.prompt_ids) == render_prompt(tok, question)
        (turn,) = [s for s in ep.segments if s.kind == "policy"]
        reply = tok.decode(turn.ids, skip_special_tokens=True)
        assert ep.final_reward == pytest.approx(_expected_reward(reply, task), abs=1e-9)
        rewards.append(ep.final_reward)
    assert len(set(rewards)) > 1, rewards  # replies of different lengths score differently
    assert_trainer_matches_sampler(model, episodes)


def test_scripted_answers_score_the_tasksets_rewards(tok, server):
    """A scripted policy answers two tasks right and one wrong: `correct` scores 1, 1, 0
    (plus 0.5 * `brief` of each answer), one turn each."""
    rows = environment_rows(NAME, "train", 3, seed=1)
    envs = make_environments(resolve_environment(NAME), rows, endpoint=server)
    runner = EpisodeRunner(envs, tok, max_episode_tokens=256, step_timeout_s=30)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    answers = [str(r["task"]["a"] + r["task"]["b"]) for r in rows]
    answers[1] = str(int(answers[1]) + 1)
    runner.prompt_ids()
    while rows_left := runner.active_rows():
        moves = [tok(answers[r], add_special_tokens=False)["input_ids"] + [eos] for r in rows_left]
        runner.advance(rows_left, moves, [[0.0] * len(m) for m in moves])
    got = [(e.done_reason, e.num_turns, e.final_reward) for e in runner.episodes]
    want = [("done", 1, float(k != 1) + 0.5 * brief_score(a)) for k, a in enumerate(answers)]
    assert got == want


def test_the_name_resolves_and_the_tasks_split_by_content():
    cls = resolve_environment(NAME)
    assert issubclass(cls, AgentEnvironment) and cls.spec == "verifiers_envs"
    train = environment_rows(NAME, "train", 40, seed=0)
    held = environment_rows(NAME, "heldout", 2, seed=0)
    assert len(train) == 40 and len(held) == 2
    assert not any(is_heldout(r) for r in train) and all(is_heldout(r) for r in held)
    everything = {(r["task"]["a"], r["task"]["b"]) for r in train + held}
    assert everything <= set(PAIRS)
    assert not {r["key"] for r in train} & {r["key"] for r in held}
    assert environment_rows(NAME, "train", 40, seed=0) == train


MULTI_SEAT = """
import verifiers.v1 as vf
from verifiers_envs import AdditionTaskset

__all__ = ["AdditionTaskset", "DuelEnv"]


class DuelConfig(vf.EnvConfig):
    first: vf.AgentConfig = vf.AgentConfig()
    second: vf.AgentConfig = vf.AgentConfig()


class DuelEnv(vf.Env[DuelConfig]):
    async def run(self, task, agents):
        await agents.first.run(task)
"""

RAISING = """
import verifiers.v1 as vf

__all__ = ["BrokenTaskset"]


class BrokenTask(vf.Task[vf.TaskData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def broken(self, trace: vf.Trace) -> float:
        raise ValueError("the reward's own bug")


class BrokenTaskset(vf.Taskset[BrokenTask, vf.TasksetConfig]):
    def load(self):
        yield BrokenTask(vf.TaskData(prompt="hi"), self.config.task)
"""


def test_bad_names_and_failing_tasks_are_one_line(tok, server, tmp_path, monkeypatch):
    """An unknown id, a module that exports no taskset, an env with two seats: one line
    naming env.name; a task whose scoring raises ends its episode with reward 0, counted as
    a reward error naming the task and the error."""
    with pytest.raises(UserError, match=r"^env\.name verifiers:no_such_tasks: not a verifiers"):
        resolve_environment("verifiers:no_such_tasks")
    with pytest.raises(UserError, match=r"exports no Taskset subclass") as e:
        resolve_environment("verifiers:json")
    assert "\n" not in str(e.value)
    (tmp_path / "vf_duel.py").write_text(MULTI_SEAT)
    (tmp_path / "vf_broken.py").write_text(RAISING)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UserError, match=r"DuelEnv has agent seats \['first', 'second'\]"):
        resolve_environment("verifiers:vf_duel")
    rows = row_generator("verifiers:vf_broken")(1, 0)  # its one task, whichever split
    envs = make_environments(resolve_environment("verifiers:vf_broken"), rows, endpoint=server)
    runner = EpisodeRunner(envs, tok, max_episode_tokens=64, step_timeout_s=30)
    runner.prompt_ids()
    runner.advance([0], [tok("1", add_special_tokens=False)["input_ids"]], [[0.0]])
    (episode,) = runner.episodes
    assert episode.final_reward == 0.0 and runner.metrics()["reward_errors"] == 1
    assert "env.name verifiers:vf_broken: task 0 failed (" in runner.errors[0]
    assert "the reward's own bug" in runner.errors[0] and "\n" not in runner.errors[0]
