"""Multi-turn rollouts for the driver (`env.name` set): B rows -> G episodes each -> B groups.

`EpisodeSampler` is `grpojax.rollouts.sampler.Sampler`'s counterpart for agentic runs, with the
same `round` contract, so `collect` (dynamic sampling included), `assemble_batch`, the
trainer and the checkpoints are shared. A round draws B rows from the prompt source (the
environment renders each prompt), plays N = B*G episodes with `grpojax.envs.rollout_episodes`
(one KV cache per row across turns, token in and token out; with `rollout.engine=vllm`,
`rollout_episodes_external`: each turn's context sent to vLLM as ids), and lays them out as
`[N, T]` completion rows, T = `rollout.max_new_tokens` (the episode's token budget):

    tokens_nt         the episode's ids after the prompt: policy turns and environment answers
    logp_nt           the sampler's logprob of each policy id (0 at environment ids)
    policy_mask_nt    True at the policy's ids: the loss, the KL and the logprob metrics
                      (`RowArrays.policy_mask_nt`; environment ids are context only)
    token_rewards_nt  the rewards at their ids (`Episode.token_rewards`): PPO's per-token
                      rewards, so GAE credits each turn's reward to the turns before it

Each row's reward (GRPO's sequence reward, and the logged one) is its episode's return
(final reward plus the per-turn rewards); an episode that ended in an environment error (a
step that raised or timed out) is an invalid sample (no advantage, no loss), counted like a
failed reward call. The runner's counters (turns, tool calls, parse errors, timeouts,
truncations, end reasons) are summed over the step's rounds in its `times` under
"env/<name>"; `env_step_metrics` adds the step's shares (turns_mean, tool_use_frac).

Everything an episode does is a function of the round's key and the rows, so a resumed run
samples the same episodes (the environments must be deterministic given their row; the
built-ins are). Across processes every process runs the same host loop on the same rows:
the sampler's calls are SPMD over the mesh, their outputs read on every process, and the
environments live on process 0, whose results every process records
(`grpojax.distributed.on_primary`, over one device of each process in the sampler's mesh:
with split placement its rollout devices, which the thread playing the episodes alone
uses), so an environment steps once and every process keeps the same episodes: a run's
episodes do not depend on its process count or placement.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from grpojax.config import RunConfig
from grpojax.data import PromptSource, pad_id_of, stop_ids_of
from grpojax.distributed import on_primary, process_devices
from grpojax.envs import (
    Environment,
    Episode,
    EpisodeRunner,
    episode_batch,
    make_environments,
    rollout_episodes,
    rollout_episodes_external,
)
from grpojax.errors import UserError
from grpojax.models.sharding import batch_sharding, put_global, replicated
from grpojax.rollouts.sampler import host_key
from grpojax.sampling.continuous import auto_episode_engine, auto_slots
from grpojax.sampling.vllm_engine import VLLMEngine
from grpojax.train.rows import Group, RowArrays

__all__ = [
    "EpisodeSampler",
    "build_episode_runner",
    "env_step_metrics",
    "episode_metrics",
    "episode_return",
]


def build_episode_runner(
    cfg: RunConfig, rows, tokenizer, *, group_size: int, mesh: Mesh | None = None
) -> EpisodeRunner:
    """An `EpisodeRunner` over `cfg.env`'s environments, G = `group_size` episodes per row
    (rows n = b*G + g), the episode's token budget `rollout.max_new_tokens`, its prompts
    rendered (`prompt_ids`) and held to `data.max_prompt_tokens`. Across processes the
    environments step on process 0 (`on_primary` over one device of each process in `mesh`,
    the sampler's; None: each process's first device). A row the environment refuses, or a
    prompt over the budget, is a UserError naming the field."""
    e = cfg.env
    env_cls = e.environment_class
    kwargs = dict(e.kwargs) if e.max_turns is None else {**e.kwargs, "max_turns": e.max_turns}
    try:
        envs: list[Environment] = make_environments(env_cls, rows, group_size=group_size, **kwargs)
    except UserError as err:
        raise UserError(f"env.name={e.name!r}: {err}") from None
    except TypeError as err:  # an argument the constructor does not take
        raise UserError(f"env.kwargs {dict(e.kwargs)} for env.name={e.name!r}: {err}") from None
    runner = EpisodeRunner(
        envs,
        tokenizer,
        max_episode_tokens=cfg.rollout.max_new_tokens,
        max_observation_chars=e.max_observation_chars,
        max_observation_tokens=e.max_observation_tokens,
        step_timeout_s=e.step_timeout_s,
        share=(
            functools.partial(on_primary, devices=process_devices(mesh))
            if jax.process_count() > 1
            else None
        ),
    )
    longest = max(len(ids) for ids in runner.prompt_ids())
    if longest > cfg.data.max_prompt_tokens:
        raise UserError(
            f"env.name={e.name!r}: a prompt the environment made is {longest} tokens, over "
            f"data.max_prompt_tokens={cfg.data.max_prompt_tokens}; raise it (episodes are "
            "not skipped: an environment's prompt is part of its task)"
        )
    return runner


def episode_metrics(runner: EpisodeRunner) -> dict[str, float]:
    """The runner's counters (`EpisodeRunner.metrics`) plus episodes and tool_use_episodes
    (episodes with at least one tool call), as floats: counts, which add over rounds."""
    eps = runner.episodes
    m = {k: float(v) for k, v in runner.metrics().items()}
    m["episodes"] = float(len(eps))
    m["tool_use_episodes"] = float(sum(e.counters.get("tool_calls", 0) > 0 for e in eps))
    return m


def env_step_metrics(times: dict) -> dict[str, float]:
    """A step's "env/" metrics from the counts its rounds summed into `times`, plus
    env/turns_mean (policy turns per episode) and env/tool_use_frac (the share of episodes
    that called a tool); {} for a single-turn step."""
    m = {k: float(v) for k, v in times.items() if k.startswith("env/")}
    episodes = m.get("env/episodes", 0.0)
    if episodes:
        m["env/turns_mean"] = m.get("env/turns", 0.0) / episodes
        m["env/tool_use_frac"] = m.get("env/tool_use_episodes", 0.0) / episodes
    return m


def episode_return(ep: Episode) -> float:
    """The episode's return: its final reward plus its per-turn rewards (None counts 0)."""
    return float(ep.final_reward or 0.0) + float(sum(r for r in ep.turn_rewards if r is not None))


class EpisodeSampler:
    """One round of episodes: B rows -> G episodes each -> B groups (`Sampler.round`'s
    contract; module docstring). `source` may be None for `play` alone (evaluation)."""

    def __init__(
        self,
        cfg: RunConfig,
        tokenizer,
        source: PromptSource | None,
        mesh: Mesh,
        engine: VLLMEngine | None = None,
    ):
        self.cfg, self.tokenizer, self.source, self.mesh = cfg, tokenizer, source, mesh
        self.engine = engine  # the run's external engine (vLLM), or None: the built-in ones
        self.stop_ids = stop_ids_of(tokenizer)
        self.pad_id = pad_id_of(tokenizer)
        self.batch_inputs: tuple[str, ...] = ()

    def play(
        self, model, rows, *, key, group_size: int, sampling=None, stats: dict | None = None
    ) -> tuple[EpisodeRunner, list[Episode]]:
        """Play G episodes of each of `rows` with `model` (the runner and its episodes); the
        engine is `rollout.engine`'s ("continuous": `rollout.slots` decode slots refilled as
        episodes end, `auto_slots` of the N episodes when None; "static": lock step;
        "compact": lock step, the ended episodes' rows dropped from the batch; "auto":
        `auto_episode_engine`), the same episodes either way; with an external engine
        (`self.engine`, holding `model`'s weights) `rollout_episodes_external`. `stats` gets
        the sampler's row-steps."""
        cfg = self.cfg
        runner = build_episode_runner(
            cfg, rows, self.tokenizer, group_size=group_size, mesh=self.mesh
        )
        common: dict[str, Any] = dict(
            key=key,
            max_turn_tokens=min(cfg.env.max_turn_tokens, cfg.rollout.max_new_tokens),
            sampling=cfg.sampling if sampling is None else sampling,
            stop_ids=self.stop_ids,
            stats=stats,
        )
        if self.engine is not None:
            return runner, rollout_episodes_external(self.engine, runner, **common)
        kind = cfg.rollout_engine
        if kind == "vllm":  # without the run's engine (an evaluation job): auto's choice
            kind = auto_episode_engine(cfg.rollout.max_new_tokens)
        if runner.seated and kind == "continuous":  # auto's choice; a slot cannot wait
            kind = "compact"
        slots = None
        if kind == "continuous":
            slots = cfg.rollout.slots or auto_slots(len(runner.envs))
        episodes = rollout_episodes(
            model, runner, pad_id=self.pad_id, slots=slots, compact=kind == "compact", **common
        )
        return runner, episodes

    def close(self) -> None:
        """Stop the external engine, if any."""
        if self.engine is not None:
            self.engine.close()

    def round(
        self, model, key, times: dict, version: int = 0
    ) -> tuple[list[Group], RowArrays, Any, dict]:
        """(B groups, their N rows on the devices, the advanced key, {}); adds the round's
        seconds to times["generate"] (sampling and environment steps; times["reward"] gets
        0: the environments' rewards are part of the episodes), its policy tokens and the
        sampler's row-steps to times["decode_tokens"] / ["decode_row_steps"], and the
        runner's counters to times["env/<name>"]."""
        key, episode_key = jax.random.split(host_key(key))
        groups, placed = self.sample_round(model, episode_key, times, version)
        # The next key on the mesh (replicated), as the built-in samplers return theirs: a
        # checkpoint across processes saves global arrays only.
        return groups, placed, put_global(key, replicated(self.mesh)), {}

    def sample_round(
        self, model, episode_key, times: dict, version: int = 0
    ) -> tuple[list[Group], RowArrays]:
        """`round`'s work with the episodes' own key (`round` splits it from the sampler's
        key chain): (B groups, their N rows on the devices); adds to `times` as `round`.
        `version`: the RL steps `model`'s weights have taken; an external engine is given
        them once per version (its seconds to times["weight_sync"])."""
        cfg = self.cfg
        b, g = cfg.rollout.prompts_per_step, cfg.group_size
        if self.source is None:
            raise ValueError("EpisodeSampler.round needs a prompt source")
        seats = cfg.env.environment_class.seats  # a row's games: one group per seat
        rows = self.source.next_rows(b // seats)
        if self.engine is not None:
            synced = self.engine.sync(model, version)
            if synced is not None:
                times["weight_sync"] = times.get("weight_sync", 0.0) + synced
        t0 = time.perf_counter()
        stats: dict = {}
        runner, episodes = self.play(model, rows, key=episode_key, group_size=g, stats=stats)
        times["generate"] += time.perf_counter() - t0
        for k, v in episode_metrics(runner).items():
            times[f"env/{k}"] = times.get(f"env/{k}", 0.0) + v
        times["decode_tokens"] = times.get("decode_tokens", 0.0) + float(
            sum(e.num_policy_tokens for e in episodes)
        )
        times["decode_row_steps"] = times.get("decode_row_steps", 0.0) + float(
            stats.get("decode_row_steps", 0)
        )
        t = cfg.rollout.max_new_tokens
        laid = episode_batch(episodes, width=t, pad_id=self.pad_id)
        groups = []
        for i in range(b):
            eps = episodes[i * g : (i + 1) * g]
            if any(e.prompt_ids != eps[0].prompt_ids for e in eps):
                raise UserError(
                    f"env.name={cfg.env.name!r}: the {g} episodes of one row got different "
                    "prompts; reset() must be a function of the row (seed any randomness "
                    "from it)"
                )
            valid = np.array([e.done_reason != "error" for e in eps])
            total = np.array([episode_return(e) for e in eps], np.float32)
            groups.append(
                Group(
                    prompt_ids=list(eps[0].prompt_ids),
                    lengths_g=laid.lengths_n[i * g : (i + 1) * g].astype(np.int32),
                    eos_g=np.array([e.done_reason != "token_budget" for e in eps]),
                    total_g=np.where(valid, total, 0.0).astype(np.float32),
                    valid_g=valid,
                    per_fn={"env": np.where(valid, total, np.nan).astype(np.float32)},
                    row=i * g,
                )
            )
        host = RowArrays(
            tokens_nt=laid.tokens_ns[:, -t:].astype(np.int32),
            logp_nt=laid.sampler_logp_nt.astype(np.float32),
            keep_count_nt=np.zeros((cfg.samples_per_step, t), np.int32),
            policy_mask_nt=laid.completion_mask_nt.astype(bool),
            token_rewards_nt=laid.token_rewards_nt.astype(np.float32),
        )
        placed = put_global(
            host, jax.tree.map(lambda x: batch_sharding(self.mesh, 2, x.shape), host)
        )
        return groups, placed
