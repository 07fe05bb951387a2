"""Single-turn rounds for the driver: prompts -> sampler -> rewards -> groups.

`Sampler.round` samples B prompts (one `generate` call, or with `rollout.engine=vllm` one
call of a `grpojax.sampling.vllm_engine.VLLMEngine` given the round's weights first) and
scores the rows this process owns, as B `grpojax.train.rows.Group`s and their
`RowArrays`; `collect` gathers the B groups a step trains on (dynamic sampling's rounds and
buffer); `DriverState` is the loop's host-side state. (`grpojax.train.rows.assemble_batch`
lays them out as the step's `TrainBatch`; `grpojax.rollouts.strategy.Rollouts` puts the
pieces together.)

Many hosts: every process draws the same prompts and makes the same decisions (which
groups to keep, which to buffer) from the same gathered per-row rewards; each turns only
its own rows into text and rewards; rows move between devices only through jitted gathers.

DAPO dynamic sampling (`RunConfig.use_dynamic_sampling`): each step needs B groups of G
completions. Groups whose (valid) rewards all agree carry no GRPO signal and are dropped;
further rounds of B prompts are sampled until B groups are collected, at most
`rollout.max_resample_rounds` extra rounds. Surplus groups wait in the buffer for the next
step (fewer than B of them: a round adds at most B to fewer than B); if the rounds run
out, dropped groups fill the batch (their advantages are 0) so the jitted step always sees
the same shape, and the shortfall is counted. The buffer's rows live in a `RowArrays` of
fixed capacity N, checkpointed with the train state.

Failed reward calls (timeouts, exceptions, NaN) never stop the run: those samples get
`valid = False`, no advantage, an empty completion mask (no loss, no KL), and are counted.

Estimators with extra batch inputs (`grpojax.train.objectives.BATCH_INPUTS`, declared in
the estimator's `batch_inputs`; the built-in "remax" and "gdpo"):

  greedy_rewards_n  each round also decodes one greedy (temperature 0) completion per
                    prompt with the same sampler program family and scores it with the same
                    reward manager (each process its own rows, then gathered, as the
                    samples); every sample of the prompt's group carries that reward
                    (`Group.greedy_reward`). A greedy completion whose reward failed makes
                    its group's samples invalid (no baseline, no advantage).
  rewards_nr        the reward manager's per-function rewards before weighting
                    (`Group.per_fn`), one column per function in `RewardManager.names`
                    order; a function's "no opinion" (None) is 0, as in the weighted total.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from grpojax.config import RunConfig, config_to_dict
from grpojax.data import PromptSource, pad_id_of, stop_ids_of
from grpojax.distributed import gather_rows, owned_rows, rows_to_host
from grpojax.errors import UserError
from grpojax.rewards import RewardManager
from grpojax.sampling import SamplingConfig, generate, stopped_completions
from grpojax.sampling.vllm_engine import VLLMEngine, gpu_memory_shares
from grpojax.train.rows import Group, RowArrays, fit_routing, make_groups, take_rows

__all__ = [
    "COUNTERS",
    "DriverState",
    "Sampler",
    "collect",
    "external_engine",
    "host_key",
]


# Running totals kept in `DriverState.counters` (and logged as `total/<name>`).
COUNTERS = (
    "samples",
    "failed_reward_samples",
    "resample_rounds",
    "dropped_groups",
    "zero_var_fill_groups",
    "stale_dropped_groups",
)


@dataclasses.dataclass
class DriverState:
    """The host-side state of the loop (JSON in the checkpoint; arrays live in the trainer
    and, for the buffer's rows, in `RunArrays.buffer`).

    step: RL steps completed.
    data: the prompt source's position (`PromptSource.state()`), taken at every save.
    buffer: dynamic-sampling groups sampled but not yet trained on (rows 0, G, 2G, ... of
      the buffer's `RowArrays`).
    counters: running totals (`COUNTERS`).
    eval_before: held-out evaluation before RL (kept so a resumed run can report it).
    pending: the rounds sampled ahead (`grpojax.rollouts.pipeline`), {"groups", "stats"} each;
      their rows are `RunArrays.pending`. With partial rollouts (`grpojax.rollouts.partial`)
      the rounds in flight, {"data": the prompt source's position before it} each; their
      tokens so far are `RunArrays.pending`.
    """

    step: int = 0
    data: dict = dataclasses.field(default_factory=dict)
    buffer: list[Group] = dataclasses.field(default_factory=list)
    counters: dict[str, float] = dataclasses.field(
        default_factory=lambda: dict.fromkeys(COUNTERS, 0.0)
    )
    eval_before: dict | None = None
    pending: list[dict] = dataclasses.field(default_factory=list)

    def to_json(self, cfg: RunConfig) -> dict:
        """A snapshot (deep copy): an asynchronous checkpoint write serialises it later,
        while the loop goes on updating the counters."""
        return copy.deepcopy(
            {
                "step": self.step,
                "data": self.data,
                "buffer": [g.to_json() for g in self.buffer],
                "counters": self.counters,
                "eval_before": self.eval_before,
                **({"pending": self.pending} if self.pending else {}),
                "config": config_to_dict(cfg),
            }
        )

    @classmethod
    def from_json(cls, d: dict) -> DriverState:
        return cls(
            step=int(d["step"]),
            data=dict(d["data"]),
            buffer=[Group.from_json(g) for g in d.get("buffer", [])],
            counters={**dict.fromkeys(COUNTERS, 0.0), **d.get("counters", {})},
            eval_before=d.get("eval_before"),
            pending=list(d.get("pending", [])),
        )


def host_key(key):
    """A fresh host copy of a sampler key: a key returned by the previous program carries
    that program's placement, which would be a new jit cache entry (a recompile)."""
    return jax.random.wrap_key_data(
        np.asarray(jax.random.key_data(key).addressable_data(0)),
        impl=jax.random.key_impl(key),
    )


@dataclasses.dataclass
class SampledRound:
    """A round's prompts and completions, decoded but not yet scored (`Sampler.sample`).

    pb: the B prompts (`PromptBatch`); rollout: their N = B*G completions (`Rollout`, on
    the devices); greedy: ReMax's greedy completions (`Rollout`, B rows) or None; version:
    the RL steps the sampling policy had taken (`grpojax.rollouts.pipeline`).
    """

    pb: Any
    rollout: Any
    greedy: Any = None
    version: int = 0


def external_engine(cfg: RunConfig) -> VLLMEngine | None:
    """The run's external engine (`rollout.engine=vllm`: a `VLLMEngine`, started at its
    first sync), or None for the built-in engines."""
    if cfg.rollout_engine != "vllm":
        return None
    if jax.process_count() > 1:
        raise UserError(
            f"rollout.engine=vllm runs in one process; this run has "
            f"{jax.process_count()} (use the built-in engines across processes)"
        )
    v = cfg.rollout.vllm
    assert v.python is not None  # RolloutSpec: required with the engine
    gpu_share = 0.0  # not used on a CPU
    if jax.default_backend() == "gpu":  # JAX and vLLM on the same GPUs: both shares fit
        _, gpu_share = gpu_memory_shares(v.gpu_memory_utilization)
    return VLLMEngine(
        python=v.python,
        max_model_len=cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens,
        dtype=v.dtype,
        max_num_seqs=v.max_num_seqs,
        kv_cache_mb=v.kv_cache_mb,
        prefix_caching=v.prefix_caching,
        enforce_eager=v.enforce_eager,
        tensor_parallel_size=v.tensor_parallel_size,
        gpu_memory_utilization=gpu_share,
        weight_transfer=v.weight_transfer,
        bucket_mb=v.bucket_mb,
        start_timeout_s=v.start_timeout_s,
        timeout_s=v.timeout_s,
        probe_tol=cfg.vllm_probe_tol,
    )


class Sampler:
    """One round of sampling: B prompts -> G completions each -> rewards -> B groups.
    `engine`: the run's external engine (`external_engine`), or None: the built-in ones."""

    def __init__(
        self,
        cfg: RunConfig,
        tokenizer,
        source: PromptSource,
        manager: RewardManager,
        mesh,
        engine: VLLMEngine | None = None,
    ):
        self.cfg, self.tokenizer, self.source, self.manager, self.mesh = (
            cfg,
            tokenizer,
            source,
            manager,
            mesh,
        )
        self.stop_ids = stop_ids_of(tokenizer)
        self.pad_id = pad_id_of(tokenizer)
        # The estimator's extra batch inputs (module docstring) decide what a round adds.
        self.batch_inputs = cfg.batch_inputs
        self.engine = engine

    def _local_scores(self, rollout, pb, g: int) -> tuple[np.ndarray, dict, dict]:
        """(rows, their per-row values, reward stats): this process decodes and scores the
        rows of `rollout` it owns (G rows per prompt of `pb`). Host work only (no collective),
        so it may run on another thread while the loop goes on. Values: {total, valid,
        lengths, eos, fn/<name>}, lengths and eos after the `rollout.stop_strings` cut."""
        mine = owned_rows(rollout.tokens_nt)
        tokens, lengths, eos = (
            rows_to_host(x, mine)
            for x in (rollout.tokens_nt, rollout.lengths_n, rollout.eos_found_n)
        )
        texts, lengths, eos = stopped_completions(
            self.tokenizer, tokens, lengths, eos, self.cfg.rollout.stop_strings
        )
        prompts = [pb.prompts[r // g] for r in mine]
        columns = {k: [vals[r // g] for r in mine] for k, vals in pb.columns.items()}
        names = list(self.manager.names)
        if len(mine):
            reward = self.manager.compute(prompts, texts, **columns)
            total, valid, per_fn, stats = (
                reward.total_n,
                reward.valid_n,
                reward.per_fn,
                reward.stats,
            )
        else:
            total, valid, stats = np.zeros(0, np.float32), np.zeros(0, bool), {}
            per_fn = {k: np.zeros(0, np.float32) for k in names}
        values = {
            "total": np.asarray(total, np.float32),
            "valid": np.asarray(valid, bool),
            "lengths": np.asarray(lengths, np.int32),
            "eos": np.asarray(eos, bool),
            **{f"fn/{k}": np.asarray(per_fn[k], np.float32) for k in names},
        }
        return mine, values, stats

    def sample(self, model, key, times: dict, version: int = 0) -> SampledRound:
        """Draw B prompts and decode G completions of each with `model` (and, for ReMax, one
        greedy completion per prompt); adds seconds to times["generate"] and the sampled
        tokens and decoded row-steps to times["decode_tokens"] / times["decode_row_steps"].
        Nothing is scored yet (`score`, `finish`). `version`: the RL steps `model`'s weights
        have taken; an external engine is given them once per version (its seconds to
        times["weight_sync"])."""
        cfg = self.cfg
        pb = self.source.next_batch(cfg.rollout.prompts_per_step)
        key = host_key(key)
        common = dict(
            key=key,
            max_new_tokens=cfg.rollout.max_new_tokens,
            eos_ids=self.stop_ids,
            pad_id=self.pad_id,
            mesh=self.mesh,
        )
        no_routing = {}
        if self.engine is not None:  # vLLM: its own process, this version's weights
            synced = self.engine.sync(model, version)
            if synced is not None:
                times["weight_sync"] = times.get("weight_sync", 0.0) + synced
            vocab = model.config.vocab_size
            decode = functools.partial(
                self.engine.generate, pb.tokens_bp, pb.lengths_b, vocab_size=vocab, **common
            )
        else:
            engine = cfg.rollout.engine_kwargs()  # vllm's stand-in: "auto"'s choice
            if cfg.rollout_engine != "vllm":  # routing replay's static engine included
                engine["engine"] = cfg.rollout_engine
            decode = functools.partial(
                generate, model, pb.tokens_bp, pb.lengths_b, **common, **engine
            )
            if cfg.model.routing_replay == "rollout":  # the static engine records the experts
                decode = functools.partial(decode, record_routing=True)
                no_routing = {"record_routing": False}
        t0 = time.perf_counter()
        rollout = decode(group_size=cfg.group_size, sampling=cfg.sampling)
        jax.block_until_ready(rollout.tokens_nt)
        # The decode's real tokens and the row-steps it ran (its utilisation, logged).
        times["decode_tokens"] = times.get("decode_tokens", 0.0) + float(jnp.sum(rollout.lengths_n))
        times["decode_row_steps"] = times.get("decode_row_steps", 0.0) + float(rollout.row_steps)
        greedy = None
        if "greedy_rewards_n" in self.batch_inputs:
            # ReMax's baseline: one greedy (temperature 0) completion per prompt. Greedy
            # decoding draws nothing from `key`; the key chain is the sampled round's.
            greedy = decode(group_size=1, sampling=SamplingConfig(temperature=0.0), **no_routing)
            jax.block_until_ready(greedy.tokens_nt)
        times["generate"] += time.perf_counter() - t0
        return SampledRound(pb=pb, rollout=rollout, greedy=greedy)

    def score(self, sampled: SampledRound) -> tuple[tuple, float]:
        """This process's rewards of a sampled round (and of its greedy completions): host
        work only (`_local_scores`), for `finish`; with the seconds it took."""
        t0 = time.perf_counter()
        g = self.cfg.group_size
        local = (self._local_scores(sampled.rollout, sampled.pb, g),)
        if sampled.greedy is not None:
            local += (self._local_scores(sampled.greedy, sampled.pb, 1),)
        return local, time.perf_counter() - t0

    def finish(self, sampled: SampledRound, local: tuple) -> tuple[list[Group], RowArrays, dict]:
        """(B groups, their N rows on the devices, reward stats) of a sampled round from its
        `score`: every process gets every row's values (a collective: on the loop's thread)."""
        pb, rollout = sampled.pb, sampled.rollout
        mine, values, stats = local[0]
        small = gather_rows(values, mine, rollout.tokens_nt.shape[0])
        greedy = None
        if sampled.greedy is not None:
            g_mine, g_values, _ = local[1]
            greedy = gather_rows(g_values, g_mine, sampled.greedy.tokens_nt.shape[0])
        width = pb.tokens_bp.shape[1]
        groups = make_groups(
            [pb.tokens_bp[b, width - int(m) :] for b, m in enumerate(pb.lengths_b)],
            small,
            per_fn={k: small[f"fn/{k}"] for k in self.manager.names},
            greedy_b=greedy,
            version=sampled.version,
        )
        routing = rollout.routing_nslk
        if routing is not None:  # the prompt's columns at the run's fixed width
            routing = fit_routing(
                routing, rollout.prompt_tokens_bp.shape[1], self.cfg.data.max_prompt_tokens
            )
        rows = RowArrays(
            rollout.tokens_nt, rollout.logp_nt, rollout.keep_count_nt, routing_nslk=routing
        )
        return groups, rows, stats

    def unscored_groups(self, sampled: SampledRound) -> tuple[list[Group], RowArrays] | None:
        """(the B groups of a sampled round before its rewards: rewards 0, every sample valid,
        lengths as decoded; their N rows), for the trainer's logprob pass to run while
        `score` computes them; None where the rewards' scoring changes the batch's layout
        (with `rollout.stop_strings` it cuts completions). A collective: on the loop's
        thread."""
        if self.cfg.rollout.stop_strings:
            return None
        rollout = sampled.rollout
        mine = owned_rows(rollout.tokens_nt)
        own = {
            "lengths": rows_to_host(rollout.lengths_n, mine).astype(np.int32),
            "eos": rows_to_host(rollout.eos_found_n, mine).astype(bool),
        }
        small = gather_rows(own, mine, rollout.tokens_nt.shape[0])
        local = {
            "total": np.zeros(len(mine), np.float32),
            "valid": np.ones(len(mine), bool),
            **{f"fn/{k}": np.zeros(len(mine), np.float32) for k in self.manager.names},
        }
        local.update({k: v[mine] for k, v in small.items()})
        groups, rows, _ = self.finish(
            dataclasses.replace(sampled, greedy=None), ((mine, local, {}),)
        )
        return groups, rows

    def round(
        self, model, key, times: dict, version: int = 0
    ) -> tuple[list[Group], RowArrays, Any, dict]:
        """(B groups, their N rows on the devices, the advanced key, reward stats): `sample`,
        `score` and `finish` in turn; adds the scoring's seconds to times["reward"]."""
        sampled = self.sample(model, key, times, version)
        local, seconds = self.score(sampled)
        times["reward"] += seconds
        groups, rows, stats = self.finish(sampled, local)
        return groups, rows, sampled.rollout.key, stats

    def close(self) -> None:
        """Stop the external engine, if any."""
        if self.engine is not None:
            self.engine.close()


def collect(
    sampler: Sampler,
    model,
    ds: DriverState,
    buffer: RowArrays,
    key,
    times: dict,
    *,
    max_lag: int | None = None,
):
    """The B groups of this step (with dynamic sampling: from the buffer and fresh rounds).

    Args:
      buffer: the dynamic-sampling buffer's rows (`ds.buffer[i]` starts at row `i*G`),
        capacity N rows.
      max_lag: pipelined rollouts' staleness bound k: a buffered group drawn more than k
        steps before this one is not trained (counted as `stale_dropped_groups`); None:
        every buffered group is (on-policy rounds are never more than one step old).

    Returns `(groups, their rows [N, T], the new buffer's rows [N, T], fresh groups sampled
    this step, advanced key, rounds, reward stats)`; updates `ds.buffer` and `ds.counters`.
    """
    cfg = sampler.cfg
    b, g, n = cfg.rollout.prompts_per_step, cfg.group_size, cfg.samples_per_step
    dynamic = cfg.use_dynamic_sampling
    groups: list[Group] = list(ds.buffer) if dynamic else []
    if max_lag is not None:
        fresh_enough = [gr for gr in groups if ds.step - gr.version <= max_lag]
        ds.counters["stale_dropped_groups"] += len(groups) - len(fresh_enough)
        groups = fresh_enough
    dropped: list[Group] = []
    stats: dict[str, float] = {}
    fresh: list[Group] = []
    segments = [buffer]  # the row pool: the buffer, then each round's N rows
    rounds = 0
    while len(groups) < b:
        if dynamic and rounds > cfg.rollout.max_resample_rounds:
            # Out of attempts: keep the shape static with zero-signal groups.
            need = b - len(groups)
            ds.counters["zero_var_fill_groups"] += min(need, len(dropped))
            groups += dropped[:need]
            break
        new, rows, key, stats = sampler.round(model, key, times, version=ds.step)
        for gr in new:
            gr.row += n * len(segments)
        segments.append(rows)
        rounds += 1
        fresh += new
        if dynamic:
            for gr in new:
                (groups if gr.reward_std() > 0 else dropped).append(gr)
        else:
            groups += new
    ds.counters["resample_rounds"] += max(0, rounds - 1)
    ds.counters["dropped_groups"] += len(dropped)
    chosen, left = groups[:b], groups[b:] if dynamic else []

    def index(gs):
        return np.concatenate([np.arange(gr.row, gr.row + g) for gr in gs]).astype(np.int32)

    if not dynamic and rounds == 1:
        batch_rows = segments[1]  # the round itself, in order: no gather needed
    else:
        batch_rows = take_rows(segments, index(chosen), sampler.mesh)
    if left:
        pad = np.zeros(n - len(left) * g, np.int32)  # row 0, never read back
        buffer = take_rows(segments, np.concatenate([index(left), pad]), sampler.mesh)
    for i, gr in enumerate(left):
        gr.row = i * g
    ds.buffer = left
    return chosen, batch_rows, buffer, fresh, key, rounds, stats
