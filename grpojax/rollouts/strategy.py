"""The rollout side of the loop as one object: how a run's samples are produced.

`Rollouts` is built once from the config. It owns the engine (`Sampler`: single-turn rows,
static or continuous decode; `EpisodeSampler`: multi-turn episodes), the sampler's key, the
dynamic-sampling buffer, the rounds sampled ahead (`RolloutPipeline`) and the strategy
that orders sampling, rewards and the trainer's logprob pass. The loop asks it for each
step's batch and for its checkpoint state:

    got    = rollouts.next(policy, ds, logprobs, times)   # StepRollout: the batch, its
                                                          # groups and its logprob pass
    arrays = rollouts.arrays(ds)                          # sample_key, buffer, pending
    rollouts.restore(arrays, ds)                          # after a checkpoint's restore
    rollouts.drain()                                      # before an evaluation's rewards

The strategy (`Rollouts.strategy`), chosen once:

  "sequential"  `collect` (dynamic sampling's rounds and buffer included), then the batch
                (`assemble_batch`, packed when that pays), then the logprob pass
  "overlapped"  `rollout.overlap_rewards`: the logprob pass runs on the batch laid out
                before the rewards while they are computed on a host thread
                (`Rollouts._overlapped`); single-turn rows without dynamic sampling or stop
                strings
  "pipelined"   `rollout.max_staleness = k >= 1`: rounds sampled up to k steps ahead
                (`grpojax.rollouts.pipeline`), every group's version lag checked; with
                `rollout.partial` k rounds in flight in persistent decode slots
                (`grpojax.rollouts.partial`), every token's version recorded

Every strategy trains the same rows for the same seed when nothing is stale (tested), and
its arrays and JSON are the checkpoint's `RunArrays.{sample_key, buffer, pending}` and
`DriverState.{buffer, pending}`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from grpojax.config import RunConfig
from grpojax.models.sharding import put_global, replicated
from grpojax.rng import run_key
from grpojax.rollouts.episodes import EpisodeSampler
from grpojax.rollouts.partial import PartialPipeline, partial_decoder
from grpojax.rollouts.pipeline import RolloutPipeline, lags
from grpojax.rollouts.sampler import DriverState, Sampler, collect, external_engine
from grpojax.sampling.partial import Window
from grpojax.train.rows import Group, RowArrays, TrainBatch, assemble_batch, empty_rows

__all__ = ["Rollouts", "StepRollout", "rollout_arrays"]

# The trainer's logprob pass: batch -> (policy logp or None, entropy or None, ref logp or None).
LogprobFn = Callable[[TrainBatch], tuple]


@dataclasses.dataclass
class StepRollout:
    """One step's samples, as the update takes them.

    batch: the step's `TrainBatch` (placed on the training mesh, packed when that pays).
    groups: the B groups it holds; fresh: the groups sampled this step (dynamic sampling:
      kept and dropped; the others: `groups`), for the reward and length metrics.
    layout: the batch layout's metrics (`packed`, `padded_frac`).
    logprobs: the trainer's pass on `batch` (policy logp, entropy, reference logp), and
      logprob_s its seconds.
    rounds: sampling rounds this step drew; stats: the last round's reward statistics.
    lag: `[B]` each group's version lag (pipelined), else None.
    """

    batch: TrainBatch
    groups: list[Group]
    fresh: list[Group]
    layout: dict[str, float]
    logprobs: tuple
    logprob_s: float
    rounds: int
    stats: dict
    lag: np.ndarray | None = None


def rollout_arrays(
    cfg: RunConfig, mesh: Mesh
) -> tuple[RowArrays, tuple[RowArrays, ...] | tuple[Window]]:
    """(the empty dynamic-sampling buffer, `rollout.max_staleness` empty slots for the
    rounds sampled ahead, N rows each; with `rollout.partial` one empty window of the
    rounds in flight instead, replicated), on `mesh`: the rollout arrays of an RL
    checkpoint before any round, and its restore target's structure."""

    def empty():
        n, t = cfg.samples_per_step, cfg.rollout.max_new_tokens
        return empty_rows(n, t, mesh, policy_mask=cfg.env.enabled)

    if cfg.rollout.partial:
        window = partial_decoder(cfg, (), 0, mesh).window()
        return empty(), (jax.device_put(window, NamedSharding(mesh, PartitionSpec())),)
    return empty(), tuple(empty() for _ in range(cfg.rollout.max_staleness))


class Rollouts:
    """How a run's samples are produced (module docstring).

    Args:
      cfg: the run's config.
      tokenizer, source: the policy's tokenizer and the prompt source (`PromptSource`).
      manager: the reward manager (single-turn), or None for a multi-turn run (its rewards
        are the environment's).
      train_mesh: where the batch and the trainer live; sample_mesh: the sampler's devices
        (`mesh.rollout_devices`; None: the training mesh).
      packer: the step's `grpojax.driver.packing.Packer`.
    """

    def __init__(
        self,
        cfg: RunConfig,
        tokenizer,
        source,
        manager,
        *,
        train_mesh: Mesh,
        sample_mesh: Mesh | None,
        packer,
    ):
        self.mesh, self.packer = train_mesh, packer
        sample_mesh = sample_mesh or train_mesh
        self.sampler: Sampler | EpisodeSampler
        engine = external_engine(cfg)  # vLLM, or None: the built-in engines
        if manager is None:
            self.sampler = EpisodeSampler(cfg, tokenizer, source, sample_mesh, engine)
        else:
            self.sampler = Sampler(cfg, tokenizer, source, manager, sample_mesh, engine)
        self.pipe: RolloutPipeline | PartialPipeline | None = None
        self._partial_overlap = False
        self._scorer: concurrent.futures.ThreadPoolExecutor | None = None
        if k := cfg.rollout.max_staleness:  # rounds sampled ahead
            self.strategy = "pipelined"
            if cfg.rollout.partial:  # single-turn, one device set (RunConfig checks)
                assert isinstance(self.sampler, Sampler)
                self.pipe = PartialPipeline(self.sampler, k)
                # A round's rewards beside the logprob pass, as on policy (no dynamic
                # sampling here); stop strings cut completions when scored: waited for.
                self._partial_overlap = cfg.rollout.overlap_rewards and not cfg.rollout.stop_strings
            else:
                self.pipe = RolloutPipeline(self.sampler, k, train_mesh=train_mesh)
        elif (
            cfg.rollout.overlap_rewards
            and isinstance(self.sampler, Sampler)
            and not cfg.use_dynamic_sampling
            and not cfg.rollout.stop_strings
        ):
            self.strategy = "overlapped"
            self._scorer = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="grpojax-rwd"
            )
        else:
            self.strategy = "sequential"
        self.key = put_global(run_key(cfg.seed, "sample"), replicated(train_mesh))
        self.buffer, self._slots = rollout_arrays(cfg, train_mesh)

    # -- the step ------------------------------------------------------------------------

    def next(self, policy, ds: DriverState, logprobs: LogprobFn, times: dict) -> StepRollout:
        """The batch RL step `ds.step` trains, sampled with `policy` (its weights' version is
        `ds.step`), and `logprobs` run on it. Adds seconds and counters to `times`
        (generate, reward, decode_*, env/*, *_busy, weight_transfer); updates `ds.buffer`
        and `ds.counters` (dynamic sampling's)."""
        if self.strategy == "overlapped":
            return self._overlapped(policy, logprobs, times, ds.step)
        if isinstance(self.pipe, PartialPipeline) and self._partial_overlap:
            pipe = self.pipe
            self.key = pipe.top_up(policy, self.key, ds.step, times)
            sampled, scoring = pipe.take()
            finish = lambda sampled, local: pipe.finish(sampled, local, times)
            got = self._beside_rewards(sampled, scoring, finish, logprobs, times)
            got.lag = lags(got.groups, ds.step, pipe.k)
            return got
        lag = None
        source: Sampler | EpisodeSampler | RolloutPipeline = self.sampler
        if self.pipe is not None:
            self.key = self.pipe.top_up(policy, self.key, ds.step, times)
            source = self.pipe
        groups, rows, self.buffer, fresh, self.key, rounds, stats = collect(
            source,
            policy,
            ds,
            self.buffer,
            self.key,
            times,
            max_lag=None if self.pipe is None else self.pipe.k,
        )
        if self.pipe is not None:
            lag = lags(groups, ds.step, self.pipe.k)
        batch, layout = self._batch(groups, rows)
        t0 = time.perf_counter()
        out = logprobs(batch)
        jax.block_until_ready(out)
        return StepRollout(
            batch, groups, fresh, layout, out, time.perf_counter() - t0, rounds, stats, lag
        )

    def _batch(self, groups, rows) -> tuple[TrainBatch, dict[str, float]]:
        """The step's batch of `groups` and their rows, packed when that pays."""
        batch = assemble_batch(
            groups,
            rows,
            pad_id=self.sampler.pad_id,
            mesh=self.mesh,
            inputs=self.sampler.batch_inputs,
        )
        return self.packer(batch)

    def _overlapped(self, policy, logprobs: LogprobFn, times: dict, version: int) -> StepRollout:
        """One on-policy round, its rewards beside the logprob pass (`_beside_rewards`)."""
        sampler = self.sampler
        assert isinstance(sampler, Sampler) and self._scorer is not None
        sampled = sampler.sample(policy, self.key, times, version)
        scoring = self._scorer.submit(sampler.score, sampled)
        self.key = sampled.rollout.key
        return self._beside_rewards(sampled, scoring, sampler.finish, logprobs, times)

    def _beside_rewards(self, sampled, scoring, finish, logprobs: LogprobFn, times: dict):
        """The StepRollout of a decoded round whose rewards (`scoring`, a future of
        `Sampler.score`) are computed on a host thread while the logprob pass runs on the
        batch laid out before them (`Sampler.unscored_groups`: every sample valid, lengths
        as decoded). The scored batch's token layout is the same unless a reward call
        failed (its sample invalid: masked out, and packed without it), in which case the
        pass runs again on the scored batch, so the step is the one the sequential
        strategy runs. `finish(sampled, local)`: the round's (groups, rows, stats) from its
        scores. times["reward"] gets the wait for the rewards after the pass."""
        sampler = self.sampler
        assert isinstance(sampler, Sampler)
        t0 = time.perf_counter()
        unscored, rows = sampler.unscored_groups(sampled)
        early, _ = self.packer(
            assemble_batch(unscored, rows, pad_id=sampler.pad_id, mesh=sampler.mesh)
        )
        out = logprobs(early)
        jax.block_until_ready(out)
        logprob_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        local, busy = scoring.result()
        times["reward"] += time.perf_counter() - t1
        times["reward_busy"] = times.get("reward_busy", 0.0) + busy
        groups, rows, stats = finish(sampled, local)
        batch, layout = self._batch(groups, rows)
        same = all(np.array_equal(batch.host[k], early.host[k]) for k in ("lengths_n", "valid_n"))
        if not same:  # a failed reward call: its sample leaves the masks and the packing
            t0 = time.perf_counter()
            out = logprobs(batch)
            jax.block_until_ready(out)
            logprob_s += time.perf_counter() - t0
        return StepRollout(batch, groups, groups, layout, out, logprob_s, 1, stats)

    def drain(self) -> None:
        """Wait for the rounds in flight (the reward functions serve one caller at a time:
        before an evaluation that uses them)."""
        if self.pipe is not None:
            self.pipe.drain()

    # -- checkpoints ---------------------------------------------------------------------

    def arrays(self, ds: DriverState) -> dict:
        """The rollout arrays of an RL checkpoint, {sample_key, buffer, pending}; sets
        `ds.pending` (the queued rounds' groups, their rewards waited for first; with
        partial rollouts the source's position before each round in flight, whose window
        is `pending`'s one entry)."""
        pending = self._slots  # k slots, unused ones empty (partial rollouts: a window)
        if isinstance(self.pipe, PartialPipeline):
            window, ds.pending = self.pipe.state()
            pending = (window,)
        elif self.pipe is not None:
            rows, ds.pending = self.pipe.state()
            pending = (*rows, *pending[len(rows) :])
        return {"sample_key": self.key, "buffer": self.buffer, "pending": pending}

    def restore(self, arrays, ds: DriverState) -> None:
        """Continue from a checkpoint's `RunArrays` (its key, buffer and queued rounds) and
        `DriverState`."""
        self.key, self.buffer = arrays.sample_key, arrays.buffer
        if isinstance(self.pipe, PartialPipeline):
            self.pipe.restore(arrays.pending[0], ds.pending)
        elif self.pipe is not None:
            self.pipe.restore(arrays.pending, ds.pending)

    @property
    def external_engine(self):
        """The external engine the rounds sample with (`rollout.engine=vllm`), or None."""
        return self.sampler.engine

    def close(self) -> None:
        if self.pipe is not None:
            self.pipe.close()
        self.sampler.close()
        if self._scorer is not None:
            self._scorer.shutdown(wait=True, cancel_futures=True)
