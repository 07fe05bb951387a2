"""Pipelined rollouts (`rollout.max_staleness = k >= 1`): rounds sampled ahead of the
updates, their rewards computed on a host thread while the loop goes on.

Schedule (the same whatever the timings, so a run is reproducible and resumes exactly):
before RL step s the queue of sampled rounds is topped up to k + 1 rounds with the current
weights, version s (the RL steps they have taken); step s trains the queue's head. A round
sampled at step s' joins the queue at position k, so step s' + k trains it: every trained
sample's version lag is exactly min(s, k) (the first k rounds are drawn by the initial
weights), checked on every group (`lags`). Staleness is bounded by this pacing, not by
discarding rounds: no prompt is skipped or repeated. With dynamic sampling a step may take
more than the head: the queued rounds first, then (`round` with the queue empty) top-up
rounds sampled then with the step's own weights (lag 0); the next step refills the queue.
Every trained group's lag is then in [0, k], and a group the dynamic-sampling buffer keeps
for a later step is dropped (and counted) once it is more than k steps old (`collect`).

What overlaps (one device set, "interleaved" placement): the sampler and the trainer run
on the same devices in turn, the sampler reading the trainer's live weights (the handover
is in place: no copy; a round's decode has finished before the update that follows it
replaces the weights). A round's rewards (decoding its rows to text, the reward functions)
run on a host thread from the moment its tokens are on the host, overlapping the next
rounds' decoding and the updates. Multi-turn rounds (`EpisodeSampler`) cannot be split
so: their environment steps (tools, rewards) come between decode calls; a round's episodes
are played whole on the host thread, with a copy of the weights taken at `top_up` (the
update that follows donates the live ones), so decoding and tools overlap the updates.
Across processes, interleaved, they are played on the loop's thread when queued (their
programs and the environments' results, `on_primary`, are collectives on the training
devices, which must come in the same order on every process): pipelined, but nothing
overlaps. Each round's result depends on its weights, key and prompts alone, never on the
timing.

Split placement (`mesh.rollout_devices`): the sampler has devices of its own (its mesh,
`grpojax.driver.setup.build_rollout_mesh`; each process lends its last ones). `top_up`
copies the live weights once per version to the rollout devices, resharded to the rollout
layout (`move_to_mesh`, device to device: across processes gathered over the training
devices, then copied within each process); a round decodes on a decode thread (and is scored
on the worker thread) while the loop's thread runs the updates on the training devices, and
its rows are copied to the training mesh when the step that trains it takes it (across
processes through the hosts). Across processes each thread keeps to its devices: the decode
thread (for episodes the worker thread, whose environments' results go over one rollout
device per process) runs every program of the rollout devices, the loop's thread every one
of the training devices (host gathers go over one training device per process), so each
device's collectives come in the same order on every process; a process lost mid-transfer
stops the others through JAX's coordination service (its heartbeat timeout,
`grpojax.distributed`). The weights a round decodes with carry their version, and the
round records that version: it never runs on older weights than it reports. The key chain is
the one the interleaved loop follows (a round's next key, `jax.random.split(key)[0]`, is
taken on the host and checked against the decode's), so the same seed gives the same run in
either placement.

An external engine (`rollout.engine=vllm`) is placed as a split sampler is: it decodes in
a process of its own, so its rounds run on the decode thread beside the updates. `top_up`
copies the live weights once per version on the same devices (the update that follows
donates them), and the decode thread pushes the copy to the engine (`VLLMEngine.sync`: a
load checked on a probe) before it samples the round, in round order, so the engine never
changes weights mid-round and every round runs on the version it records. Its rows are
placed on the training mesh by the engine.

Checkpoints hold the queued rounds: their rows (`RunArrays.pending`, k slots of N rows)
and groups (`DriverState.pending`); the rewards in flight are waited for first (`drain`),
so a resumed run trains the very rounds the uninterrupted one would.

Off-policy correction: the behaviour logprobs are the sampler's (`TrainBatch.sampler_logp_nt`);
`rollout.staleness_correction` turns on the step's `grpo.rollout_correction_mode` (truncated
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
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from grpojax.distributed import gather_rows, kill_point, owned_rows, rows_to_host
from grpojax.models.sharding import batch_sharding, move_to_mesh, put_global
from grpojax.rollouts.episodes import EpisodeSampler
from grpojax.rollouts.sampler import SampledRound, Sampler, host_key
from grpojax.train.rows import Group, RowArrays

__all__ = ["RolloutPipeline", "lags"]


@dataclasses.dataclass
class _Queued:
    """A sampled round in the queue: scoring (`future`) or scored (`done`)."""

    sampled: SampledRound | None
    future: concurrent.futures.Future | None = None
    done: tuple[list[Group], RowArrays, dict] | None = None
    busy: dict = dataclasses.field(default_factory=dict)  # {phase_busy: its own seconds}
    wait: float = 0.0  # seconds the loop waited for it
    times: dict = dataclasses.field(default_factory=dict)  # counters (env/*, decode_*)


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
    the sampler; the loop calls `top_up` before each step. With `train_mesh` other than the
    sampler's mesh, the placement is split: rounds decode on the sampler's devices while
    the updates run on `train_mesh`'s, and their rows are moved to `train_mesh`."""

    def __init__(
        self,
        sampler: Sampler | EpisodeSampler,
        max_staleness: int,
        *,
        train_mesh: Mesh | None = None,
    ):
        if max_staleness < 1:
            raise ValueError(f"max_staleness must be >= 1, got {max_staleness}")
        self.sampler, self.k = sampler, max_staleness
        self.episodes = isinstance(sampler, EpisodeSampler)
        self.split = train_mesh is not None and train_mesh != sampler.mesh
        # An external engine (vLLM) decodes in its own process: its rounds run on the
        # decode thread as split placement's do, each pushing its version's weights first.
        self.external = isinstance(sampler, Sampler) and sampler.engine is not None
        # What `collect` reads: the rows it gathers live on the training mesh.
        self.cfg, self.mesh = sampler.cfg, sampler.mesh if train_mesh is None else train_mesh
        self.queue: collections.deque[_Queued] = collections.deque()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grpojax-score")
        self._decode = (
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grpojax-decode")
            if (self.split or self.external) and not self.episodes
            else None
        )
        self._weights: tuple[int, object] | None = None  # (version, model on the rollout devices)

    def rollout_weights(self, model, version: int, times: dict | None = None):
        """`model` (weights of `version`) on the sampler's devices: with split placement a
        copy, made once per version and resharded to the rollout layout (each leaf's
        partition spec on the rollout mesh, which has no fsdp: weights replicated but for
        tensor; across processes gathered on the training devices, then copied within each
        process: `move_to_mesh`), its seconds (until the copy is on the rollout devices)
        added to times["weight_transfer"]; with an external engine a copy on the same
        devices (the decode thread pushes it to the engine in round order, after the update
        that follows has donated the live weights); interleaved, `model` itself."""
        if not (self.split or self.external):
            return model
        if self._weights is None or self._weights[0] != version:
            t0 = time.perf_counter()
            graphdef, state = nnx.split(model)
            if self.external:
                moved = jax.block_until_ready(jax.tree.map(jnp.copy, state))
            else:
                kill_point("weight_transfer", version)
                moved = jax.block_until_ready(move_to_mesh(state, self.sampler.mesh))
            self._weights = (version, nnx.merge(graphdef, moved))
            if times is not None:
                times["weight_transfer"] = (
                    times.get("weight_transfer", 0.0) + time.perf_counter() - t0
                )
        return self._weights[1]

    def top_up(self, model, key, version: int, times: dict):
        """Sample rounds with `model` (weights of `version`) until k + 1 are queued;
        returns the advanced key. Interleaved, single-turn rounds decode here and are
        handed to the worker thread for their rewards; episodes are played whole on the
        worker thread, with a copy of the weights (the update that follows donates the live
        ones). Split, rounds decode on the decode thread (episodes: the worker thread) with
        the weights copied to the rollout devices (`rollout_weights`)."""
        while len(self.queue) < self.k + 1:
            key = self._enqueue(model, key, version, times)
        return key

    def _enqueue(self, model, key, version: int, times: dict):
        """One round sampled with `model` (weights of `version`) at the queue's end, as
        `top_up` describes; returns the advanced key."""
        if self.episodes:
            key, episode_key = jax.random.split(host_key(key))
            # The next key on the training mesh (replicated), as the built-in samplers
            # return theirs: a checkpoint across processes saves global arrays only.
            key = put_global(key, NamedSharding(self.mesh, PartitionSpec()))
            if self.split:
                weights = self.rollout_weights(model, version, times)
            elif jax.process_count() > 1:  # the training devices' collectives: this thread
                t0 = time.perf_counter()
                future: concurrent.futures.Future = concurrent.futures.Future()
                future.set_result(self._play(model, episode_key, version))
                times["generate"] += time.perf_counter() - t0
                self.queue.append(_Queued(None, future))
                return key
            else:
                graphdef, state = nnx.split(model)
                copy = jax.block_until_ready(jax.tree.map(jnp.copy, state))
                weights = nnx.merge(graphdef, copy)
            future = self._pool.submit(self._play, weights, episode_key, version)
            self.queue.append(_Queued(None, future))
            return key
        if self._decode is not None:
            key = host_key(key)
            # The key the decode will return (`generate`: next_key, gen_key = split(key)),
            # taken here so the next round need not wait; checked in `_decode_round`.
            after = put_global(jax.random.split(key)[0], NamedSharding(self.mesh, PartitionSpec()))
            weights = self.rollout_weights(model, version, times)
            future = self._decode.submit(self._decode_round, weights, key, after, version)
            self.queue.append(_Queued(None, future))
            return after
        own: dict = {"generate": 0.0, "reward": 0.0}
        sampled = self.sampler.sample(model, key, own)
        times["generate"] += own.pop("generate") + own.pop("reward")
        sampled.version = version
        key = sampled.rollout.key
        future = self._pool.submit(self.sampler.score, sampled)
        # The decode's counters are logged with the round, by the step that trains it.
        self.queue.append(_Queued(sampled, future, times=own))
        return key

    def _decode_round(self, model, key, after, version: int):
        """A single-turn round decoded on the rollout devices or by the external engine
        (on the decode thread), its scoring handed to the worker thread: (sampled, scoring
        future, its own times)."""
        times: dict = {"generate": 0.0, "reward": 0.0}
        sampled = self.sampler.sample(model, key, times, version)
        got = np.asarray(jax.random.key_data(sampled.rollout.key).addressable_data(0))
        if not np.array_equal(got, np.asarray(jax.random.key_data(after).addressable_data(0))):
            raise RuntimeError("pipelined rollouts: the decode advanced its key unexpectedly")
        sampled.version = version
        return sampled, self._pool.submit(self.sampler.score, sampled), times

    def _play(self, model, episode_key, version: int):
        """A round of episodes (on the worker thread): ((groups, rows, {}), its own times)."""
        t0 = time.perf_counter()
        times: dict = {"generate": 0.0, "reward": 0.0}
        groups, rows = self.sampler.sample_round(model, episode_key, times, version)
        for gr in groups:
            gr.version = version
        counters = {k: v for k, v in times.items() if k not in ("generate", "reward")}
        return (groups, rows, {}), {**counters, "busy": time.perf_counter() - t0}

    def _finish(self, q: _Queued) -> tuple[list[Group], RowArrays, dict]:
        if q.done is None:
            t0 = time.perf_counter()
            if self.episodes:
                result, other = q.future.result()
                q.busy = {"generate_busy": other.pop("busy")}
                q.done, q.times = result, other
            elif self._decode is not None:
                sampled, scoring, times = q.future.result()
                local, reward_s = scoring.result()
                q.busy = {"generate_busy": times.pop("generate"), "reward_busy": reward_s}
                q.times = {k: v for k, v in times.items() if k != "reward"}
                q.done = self.sampler.finish(sampled, local)
            else:
                local, reward_s = q.future.result()
                q.busy = {"reward_busy": reward_s}
                q.done = self.sampler.finish(q.sampled, local)
            q.wait = time.perf_counter() - t0  # what was not overlapped
            if self.split:  # the rows, to the training mesh
                groups, rows, stats = q.done
                q.done = (groups, self._to_training_mesh(rows), stats)
            q.sampled = q.future = None
        return q.done

    def _to_training_mesh(self, rows: RowArrays) -> RowArrays:
        """A split round's rows, from the rollout devices to the training mesh's batch
        layout: device to device in one process; across processes (where JAX copies only
        between the same devices) through the hosts: each process's own rows, gathered over
        one training device per process (`gather_rows`), then each process puts the rows
        its training devices hold."""
        leaves, tree = jax.tree.flatten(rows)
        layouts = [batch_sharding(self.mesh, x.ndim, x.shape) for x in leaves]
        if all(x.is_fully_addressable for x in leaves):
            return jax.tree.unflatten(tree, [jax.device_put(x, s) for x, s in zip(leaves, layouts)])
        owners = [owned_rows(x) for x in leaves]
        mine = owners[0]
        if any(not np.array_equal(rows, mine) for rows in owners):
            raise RuntimeError("pipelined rollouts: a round's row arrays are laid out differently")
        local = {str(i): rows_to_host(x, mine) for i, x in enumerate(leaves)}
        full = gather_rows(local, mine, leaves[0].shape[0])
        return jax.tree.unflatten(
            tree, put_global([full[str(i)] for i in range(len(leaves))], layouts)
        )

    def round(self, model, key, times: dict, version: int = 0):
        """The queue's head, finished: (groups, rows, `key` unchanged, reward stats). The
        seconds the loop waited for it go to times["reward"] (interleaved single-turn: its
        rewards) or times["generate"] (episodes, split placement: the whole round), and
        its own seconds to times["generate_busy"] / times["reward_busy"]. The round was
        sampled by `top_up`; with none queued (dynamic sampling's top-up rounds beyond the
        queue) one is sampled now with `model`, the weights of `version` (lag 0), and the
        key advances."""
        if not self.queue:
            key = self._enqueue(model, key, version, times)
        q = self.queue.popleft()
        groups, rows, stats = self._finish(q)
        times["generate" if self.episodes or self._decode is not None else "reward"] += q.wait
        for name, v in {**q.busy, **q.times}.items():  # own seconds, counters (env/*, decode_*)
            times[name] = times.get(name, 0.0) + v
        return groups, rows, key, stats

    def drain(self) -> None:
        """Wait for every queued round (its decode with split placement, its rewards)
        before a checkpoint, an evaluation that uses the reward functions, or the end."""
        for q in self.queue:
            self._finish(q)

    # -- checkpoints ---------------------------------------------------------------------

    def state(self) -> tuple[list[RowArrays], list[dict]]:
        """(rows, JSON) of the queued rounds, scored first: at most k of them (the
        checkpoint's k slots are `grpojax.rollouts.strategy.Rollouts.arrays`'), one
        {"groups", "stats"} each."""
        self.drain()
        if len(self.queue) > self.k:
            raise RuntimeError(f"pipelined rollouts: {len(self.queue)} rounds queued between steps")
        rows = []
        meta = []
        for q in self.queue:
            groups, r, stats = q.done
            rows.append(r)
            # JSON has no NaN: a statistic without a value (e.g. no valid sample) is null.
            finite = {k: float(v) if np.isfinite(v) else None for k, v in stats.items()}
            entry = {"groups": [g.to_json() for g in groups], "stats": finite}
            if q.times:  # the round's counters (decode_*, env/*), logged when it is trained
                entry["counters"] = {k: float(v) for k, v in q.times.items()}
            meta.append(entry)
        return rows, meta

    def restore(self, rows: tuple[RowArrays, ...], meta: list[dict]) -> None:
        """Queue the rounds of a checkpoint (`state`)."""
        self.queue.clear()
        for r, m in zip(rows, meta):
            groups = [Group.from_json(g) for g in m["groups"]]
            stats = {k: float("nan") if v is None else v for k, v in m["stats"].items()}
            counters = dict(m.get("counters", {}))
            self.queue.append(_Queued(None, done=(groups, r, stats), times=counters))

    def close(self) -> None:
        if self._decode is not None:
            self._decode.shutdown(wait=True, cancel_futures=True)
        self._pool.shutdown(wait=True, cancel_futures=True)
