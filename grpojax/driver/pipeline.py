"""Pipelined rollouts (`rollout.max_staleness = k >= 1`): rounds sampled ahead of the
updates, their rewards computed on a host thread while the loop goes on.

Schedule (the same whatever the timings, so a run is reproducible and resumes exactly):
before RL step s the queue of sampled rounds is topped up to k + 1 rounds with the current
weights, version s (the RL steps they have taken); step s trains the queue's head. A round
sampled at step s' joins the queue at position k, so step s' + k trains it: every trained
sample's version lag is exactly min(s, k) (the first k rounds are drawn by the initial
weights), checked on every group (`lags`). Staleness is bounded by this pacing, not by
discarding rounds: no prompt is skipped or repeated.

What overlaps (one device set, "interleaved" placement): the sampler and the trainer run
on the same devices in turn, the sampler reading the trainer's live weights (the handover
is in place: no copy; a round's decode has finished before the update that follows it
replaces the weights). A round's rewards (decoding its rows to text, the reward functions)
run on a host thread from the moment its tokens are on the host, overlapping the next
rounds' decoding and the updates. Multi-turn rounds (`EpisodeSampler`) cannot be split
so: their environment steps (tools, rewards) come between decode calls; a round's episodes
are played whole on the host thread, with a copy of the weights taken at `top_up` (the
update that follows donates the live ones), so decoding and tools overlap the updates.
Each round's result depends on its weights, key and prompts alone, never on the timing.

Checkpoints hold the queued rounds: their rows (`RunArrays.pending`, k slots of N rows)
and groups (`DriverState.pending`); the rewards in flight are waited for first (`drain`),
so a resumed run trains the very rounds the uninterrupted one would.

Off-policy correction: the behaviour logprobs are the sampler's (`TrainBatch.sampler_logp_nt`);
`rollout.staleness_correction` turns on `grpo.rollout_correction_mode` (truncated
importance weights by default) when it is unset.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpojax.driver.episodes import EpisodeSampler
from grpojax.driver.rollout import (
    Group,
    RowArrays,
    SampledRound,
    Sampler,
    host_key,
    pending_rows,
)

__all__ = ["RolloutPipeline", "lags"]


@dataclasses.dataclass
class _Queued:
    """A sampled round in the queue: scoring (`future`) or scored (`done`)."""

    sampled: SampledRound | None
    future: concurrent.futures.Future | None = None
    done: tuple[list[Group], RowArrays, dict] | None = None
    busy: float = 0.0  # the scoring's (or the episodes') own seconds
    wait: float = 0.0  # seconds the loop waited for it
    times: dict = dataclasses.field(default_factory=dict)  # an episode round's counters


def lags(groups: list[Group], step: int, max_staleness: int) -> np.ndarray:
    """`[B]` version lag (step - version) of each group trained at `step`; a lag outside
    [0, max_staleness] is a broken schedule (RuntimeError)."""
    lag = np.array([step - gr.version for gr in groups], np.int64)
    if lag.size and (lag.min() < 0 or lag.max() > max_staleness):
        raise RuntimeError(
            f"pipelined rollouts: step {step} would train samples of versions "
            f"{sorted({gr.version for gr in groups})} (lag outside [0, {max_staleness}])"
        )
    return lag


class RolloutPipeline:
    """Rounds of `sampler` sampled up to `max_staleness` steps ahead of the updates (module
    docstring). `round` has `Sampler.round`'s signature, so `collect` takes it in place of
    the sampler; the loop calls `top_up` before each step."""

    def __init__(self, sampler: Sampler | EpisodeSampler, max_staleness: int):
        if max_staleness < 1:
            raise ValueError(f"max_staleness must be >= 1, got {max_staleness}")
        self.sampler, self.k = sampler, max_staleness
        self.episodes = isinstance(sampler, EpisodeSampler)
        self.cfg, self.mesh = sampler.cfg, sampler.mesh  # what `collect` reads
        self.queue: collections.deque[_Queued] = collections.deque()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grpojax-score")

    def top_up(self, model, key, version: int, times: dict):
        """Sample rounds with `model` (weights of `version`) until k + 1 are queued;
        returns the advanced key. Single-turn rounds decode here and are handed to the
        worker thread for their rewards; episodes are played whole on the worker thread,
        with a copy of the weights (the update that follows donates the live ones)."""
        while len(self.queue) < self.k + 1:
            if self.episodes:
                key, episode_key = jax.random.split(host_key(key))
                graphdef, state = nnx.split(model)
                copy = jax.block_until_ready(jax.tree.map(jnp.copy, state))
                future = self._pool.submit(
                    self._play, nnx.merge(graphdef, copy), episode_key, version
                )
                self.queue.append(_Queued(None, future))
                continue
            sampled = self.sampler.sample(model, key, times)
            sampled.version = version
            key = sampled.rollout.key
            future = self._pool.submit(self.sampler.score, sampled)
            self.queue.append(_Queued(sampled, future))
        return key

    def _play(self, model, episode_key, version: int):
        """A round of episodes (on the worker thread): ((groups, rows, {}), its own times)."""
        t0 = time.perf_counter()
        times: dict = {"generate": 0.0, "reward": 0.0}
        groups, rows = self.sampler.sample_round(model, episode_key, times)
        for gr in groups:
            gr.version = version
        counters = {k: v for k, v in times.items() if k not in ("generate", "reward")}
        return (groups, rows, {}), {**counters, "busy": time.perf_counter() - t0}

    def _finish(self, q: _Queued) -> tuple[list[Group], RowArrays, dict]:
        if q.done is None:
            t0 = time.perf_counter()
            result, other = q.future.result()
            q.wait = time.perf_counter() - t0  # what was not overlapped
            if self.episodes:
                q.done, q.busy = result, other.pop("busy")
                q.times = other
            else:
                q.busy = other
                q.done = self.sampler.finish(q.sampled, result)
            q.sampled = q.future = None
        return q.done

    def round(self, model, key, times: dict):
        """The queue's head, finished: (groups, rows, `key` unchanged, reward stats). The
        seconds the loop waited for it go to times["reward"] (single-turn: its rewards) or
        times["generate"] (episodes: the whole round), and its own seconds to
        times["reward_busy"] or times["generate_busy"]. The round was sampled by `top_up`;
        `model` is not used."""
        if not self.queue:
            raise RuntimeError("pipelined rollouts: no round queued (top_up first)")
        q = self.queue.popleft()
        groups, rows, stats = self._finish(q)
        phase = "generate" if self.episodes else "reward"
        times[phase] += q.wait
        times[f"{phase}_busy"] = times.get(f"{phase}_busy", 0.0) + q.busy
        for name, v in q.times.items():  # an episode round's counters (env/*, decode_*)
            times[name] = times.get(name, 0.0) + v
        return groups, rows, key, stats

    def drain(self) -> None:
        """Wait for every queued round's rewards (before a checkpoint, an evaluation that
        uses the reward functions, or the end)."""
        for q in self.queue:
            self._finish(q)

    # -- checkpoints ---------------------------------------------------------------------

    def state(self) -> tuple[tuple[RowArrays, ...], list[dict]]:
        """(rows, JSON) of the queued rounds, scored first: k row slots (unused ones empty)
        and one {"groups", "stats"} per queued round."""
        self.drain()
        if len(self.queue) > self.k:
            raise RuntimeError(f"pipelined rollouts: {len(self.queue)} rounds queued between steps")
        rows = list(pending_rows(self.cfg, self.mesh))
        meta = []
        for i, q in enumerate(self.queue):
            groups, r, stats = q.done
            rows[i] = r
            # JSON has no NaN: a statistic without a value (e.g. no valid sample) is null.
            finite = {k: float(v) if np.isfinite(v) else None for k, v in stats.items()}
            entry = {"groups": [g.to_json() for g in groups], "stats": finite}
            if q.times:  # an episode round's counters, logged when it is trained
                entry["counters"] = {k: float(v) for k, v in q.times.items()}
            meta.append(entry)
        return tuple(rows), meta

    def restore(self, rows: tuple[RowArrays, ...], meta: list[dict]) -> None:
        """Queue the rounds of a checkpoint (`state`)."""
        self.queue.clear()
        for r, m in zip(rows, meta):
            groups = [Group.from_json(g) for g in m["groups"]]
            stats = {k: float("nan") if v is None else v for k, v in m["stats"].items()}
            counters = dict(m.get("counters", {}))
            self.queue.append(_Queued(None, done=(groups, r, stats), times=counters))

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
