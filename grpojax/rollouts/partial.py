"""Partial rollouts in the pipelined loop (`rollout.partial=true`, `rollout.max_staleness=k`).

`PartialPipeline` stands where `RolloutPipeline` does and keeps its schedule: before RL
step s it appends round s + k (B prompts drawn now, its key the next of the sampler's key
chain) to the k rounds in flight and has the decoder (`grpojax.sampling.partial`) continue
them with the step's weights, version s, until round s has ended; step s trains round s.
The prompts, the keys and the step that trains each round are the pipelined run's; what
changes is which weights decode each token: any version in [s - k, s] for round s, recorded
per token, where the pipelined run's round s is decoded whole by version s - k. A group's
`version` is its oldest token's, so the pipeline's lag check (`lags`) bounds every token;
the step's metrics add each token's lag (`staleness/token_mean`, `staleness/token_max`).
The correction of the stale tokens is the pipelined run's: the trainer's importance weight
per token against the logprob the sampler recorded, which is the decoding version's.

A round's rewards are computed when it has ended, inside the step that trains it, on a host
thread: with `rollout.overlap_rewards` (the default; not with `rollout.stop_strings`) beside
the trainer's logprob pass on the batch laid out before them, as on-policy steps do
(`grpojax.rollouts.strategy`), else waited for. Checkpoints hold the window
(`RunArrays.pending`'s one entry: the rounds in flight, their tokens, logprobs and versions
so far, and which slot decodes which sample; no KV cache, which each call recomputes) and,
per round in flight, the prompt source's position before it was drawn
(`DriverState.pending`); a resumed run draws those rounds' prompts again from there, checks
them against the window's, and continues bit-exactly.
"""

from __future__ import annotations

import collections
import concurrent.futures
import time

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from grpojax.errors import UserError
from grpojax.models.sharding import put_global
from grpojax.rollouts.sampler import SampledRound, Sampler, host_key
from grpojax.sampling.partial import PartialDecoder, Window

__all__ = ["PartialPipeline", "partial_decoder"]


def partial_decoder(sampler_cfg, stop_ids, pad_id, mesh) -> PartialDecoder:
    """The run's decoder (`RunConfig`): k = `rollout.max_staleness` rounds in flight, the
    prompt width `data.max_prompt_tokens`, the continuous engine's slots."""
    cfg = sampler_cfg
    return PartialDecoder(
        rounds_ahead=cfg.rollout.max_staleness,
        n_prompts=cfg.rollout.prompts_per_step,
        group_size=cfg.group_size,
        prompt_width=cfg.data.max_prompt_tokens,
        max_new_tokens=cfg.rollout.max_new_tokens,
        sampling=cfg.sampling,
        stop_ids=stop_ids,
        pad_id=pad_id,
        slots=cfg.rollout.slots,
        decode_loops=cfg.rollout.decode_loops,
        mesh=mesh,
    )


class PartialPipeline:
    """Rounds decoded by partial rollouts (module docstring), with `RolloutPipeline`'s
    interface: the loop calls `top_up` before each step and `collect` takes `round`."""

    def __init__(self, sampler: Sampler, max_staleness: int):
        if jax.process_count() > 1:
            raise UserError(
                f"rollout.partial=true runs in one process; this run has {jax.process_count()} "
                "(set rollout.partial=false across processes)"
            )
        self.sampler, self.k = sampler, max_staleness
        self.cfg, self.mesh = sampler.cfg, sampler.mesh
        self.decoder = partial_decoder(sampler.cfg, sampler.stop_ids, sampler.pad_id, sampler.mesh)
        self.window: Window | None = None
        # Per round in flight: (the source's position before it was drawn, its prompts).
        self.rounds: collections.deque = collections.deque()
        # Round s, decoded: (sampled, its [N, T] versions, its scoring in flight).
        self._ready: tuple | None = None
        self._versions: np.ndarray | None = None  # those of the round `take` gave
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grpojax-score")

    def _draw(self, key):
        """The next round's prompts and key: (advanced chain key, the round's key)."""
        mark = self.sampler.source.state()
        self.rounds.append(
            (mark, self.sampler.source.next_batch(self.cfg.rollout.prompts_per_step))
        )
        key, round_key = jax.random.split(host_key(key))  # `generate`'s split
        return key, round_key

    def top_up(self, model, key, version: int, times: dict):
        """Append round `version` + k and decode with `model` (the weights of `version`)
        until round `version` has ended; its rewards start on the worker thread (`take`,
        `round`). Returns the advanced key. Seconds to times["generate"], decode counters
        to times."""
        if self._ready is not None:
            raise RuntimeError("partial rollouts: a round was decoded but not trained")
        if self.window is None:  # the first step: rounds 0 .. k - 1 join first
            keys = []
            for _ in range(self.k):
                key, round_key = self._draw(key)
                keys.append(round_key)
            prompts = [(pb.tokens_bp, pb.lengths_b) for _, pb in self.rounds]
            self.window = self.decoder.window(prompts, keys)
        key, round_key = self._draw(key)
        new = self.rounds[-1][1]
        t0 = time.perf_counter()
        rollout, versions, self.window, decoded = self.decoder.advance(
            model, self.window, new.tokens_bp, new.lengths_b, round_key, version
        )
        jax.block_until_ready(rollout.tokens_nt)
        times["generate"] += time.perf_counter() - t0
        times["decode_tokens"] = times.get("decode_tokens", 0.0) + float(decoded)
        times["decode_row_steps"] = times.get("decode_row_steps", 0.0) + float(rollout.row_steps)
        _, pb = self.rounds.popleft()
        sampled = SampledRound(pb=pb, rollout=rollout, version=version)
        scoring = self._pool.submit(self.sampler.score, sampled)
        self._ready = (sampled, np.asarray(versions), scoring)
        # The next key on the training mesh (replicated), as the built-in samplers return it.
        return put_global(key, NamedSharding(self.mesh, PartitionSpec()))

    def take(self) -> tuple[SampledRound, concurrent.futures.Future]:
        """Round s, decoded by `top_up`, and its scoring in flight (`Sampler.score`), for a
        caller that overlaps them (`grpojax.rollouts.strategy.Rollouts`); `finish` it."""
        if self._ready is None:
            raise RuntimeError("partial rollouts: no round decoded for this step (top_up first)")
        sampled, versions, scoring = self._ready
        self._versions, self._ready = versions, None
        return sampled, scoring

    def finish(self, sampled: SampledRound, local: tuple, times: dict):
        """(groups, rows, stats) of the round `take` gave, from its scores: a group's
        version is its oldest token's; every token's lag (the step's version less its
        token's) to times["token_lag_*"]."""
        groups, rows, stats = self.sampler.finish(sampled, local)
        versions, version = self._versions, sampled.version
        mask = np.asarray(sampled.rollout.mask_nt)
        g = self.cfg.group_size
        oldest = np.where(mask, versions, np.iinfo(np.int32).max).min(axis=1)
        for gr in groups:
            gr.version = int(oldest[gr.row : gr.row + g].min())
        lag = (version - versions)[mask]
        times["token_lag_sum"] = times.get("token_lag_sum", 0.0) + float(lag.sum())
        times["token_lag_tokens"] = times.get("token_lag_tokens", 0.0) + float(lag.size)
        times["token_lag_max"] = max(times.get("token_lag_max", 0.0), float(lag.max(initial=0)))
        return groups, rows, stats

    def round(self, model, key, times: dict, version: int = 0):
        """Round s, decoded by `top_up`, its rewards waited for (seconds to
        times["reward"]): (groups, rows, `key` unchanged, stats)."""
        sampled, scoring = self.take()
        t0 = time.perf_counter()
        local, busy = scoring.result()
        times["reward"] += time.perf_counter() - t0
        times["reward_busy"] = times.get("reward_busy", 0.0) + busy
        groups, rows, stats = self.finish(sampled, local, times)
        return groups, rows, key, stats

    def drain(self) -> None:
        """Nothing to wait for between steps: a round's scoring ends in the step that
        trains it."""

    # -- checkpoints ---------------------------------------------------------------------

    def state(self) -> tuple[Window, list[dict]]:
        """(the window, one {"data": the source's position before it} per round in flight);
        before the first step an empty window and no rounds."""
        window = self.decoder.window() if self.window is None else self.window
        return window, [{"data": mark} for mark, _ in self.rounds]

    def restore(self, window: Window, meta: list[dict]) -> None:
        """Continue from a checkpoint's window and rounds (`state`): their prompts drawn
        again from the source's saved position, checked against the window's (the loop
        restores the source's own position afterwards)."""
        self.rounds.clear()
        self._ready = None
        if not meta:  # saved before the first step: nothing in flight
            self.window = None
            return
        if len(meta) != self.k:
            raise RuntimeError(
                f"partial rollouts: a checkpoint with {len(meta)} rounds, not {self.k}"
            )
        source = self.sampler.source
        source.restore(meta[0]["data"])
        for m in meta:
            mark = source.state()
            if mark != m["data"]:
                raise RuntimeError(
                    f"partial rollouts: the prompt source is at {mark} where the checkpoint's "
                    f"round in flight was drawn at {m['data']}"
                )
            self.rounds.append((mark, source.next_batch(self.cfg.rollout.prompts_per_step)))
        redrawn = [self.decoder.pad_prompts(pb.tokens_bp, pb.lengths_b) for _, pb in self.rounds]
        saved_p, saved_l = np.asarray(window.prompts_qbp), np.asarray(window.lengths_qb)
        for i, (tokens, lengths) in enumerate(redrawn):
            if not (np.array_equal(tokens, saved_p[i]) and np.array_equal(lengths, saved_l[i])):
                raise RuntimeError(
                    "partial rollouts: the prompt source does not give the checkpoint's rounds "
                    "in flight again (was the dataset changed?)"
                )
        self.window = window

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
