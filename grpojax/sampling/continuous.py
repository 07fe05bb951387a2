"""The continuous-batching engine: a fixed pool of decode slots, refilled as samples end.

The static engine (`grpojax.sampling.generate`) decodes all N = B*G rows in lock step until
the longest ends, so with long-tailed completion lengths most of its row-steps compute tokens
that are thrown away. This engine decodes S <= N slots instead, inside one compiled
`lax.while_loop`; each iteration

  1. refills every free slot with the next pending sample of its queue: the slot's cache gets
     its prompt's keys and values, copied from a prompt cache prefilled once per prompt before
     the loop (B rows: the G samples of a prompt share one prefill), its mask that prompt's,
     and its write index, position and next input token the prompt's last token (a copy,
     skipped in iterations where no slot is free and no sample pending);
  2. decodes one token for every slot: the slot feeds its last token at its own position and
     cache slot (`KVCache.index` is `[S]`), and the step reads only the first `extent` cache
     slots, the smallest of a few static extents that holds every live slot's keys
     (`lax.switch` between one compiled step per extent, as the static engine's decode loops);
  3. records the token, its logprob and its keep-set size into the sample's row of the `[N, T]`
     outputs, and frees the slot when the token is a stop id or the sample's budget is spent.

The loop ends when no sample is pending or live; nothing returns to the host in between (no
per-refill host round trip, no recompilation: the shapes are fixed). Token t of sample n is
drawn with key(n, t) (`grpojax.sampling.rollout`), so the rollout does not depend on which
slot decoded a sample or when: it equals the static engine's, token for token.

Slot k of the prompt's step t (t = 0 feeds the prompt's last token) writes cache slot
P - 1 + t and reads the P - 1 + t before it, so a slot's cache holds P - 1 + T slots. Every
sample costs one slot-step more than in the static engine, whose prefill samples each prompt's
first token. Under a mesh the slots and the samples are split into one queue per data shard
(`Spec.queues`): a queue's samples are decoded by its own slots, so a refill copies and
writes only rows of its own shard, and the outputs come back as the static engine's global
arrays, in the same row order.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from grpojax.models.decoder import init_cache
from grpojax.models.precision import COMPILER_OPTIONS, cast_floating, compute_dtype_of
from grpojax.ops.masks import mask_from_lengths
from grpojax.sampling.rollout import (
    Rollout,
    Spec,
    batch_constraint,
    cache_constraint,
    count_trace,
    empty_outputs,
    token_keys,
)
from grpojax.sampling.transforms import sample_tokens

__all__ = [
    "AUTO_MIN_NEW_TOKENS",
    "AUTO_SLOTS_PER_ROW",
    "auto_engine",
    "auto_episode_engine",
    "auto_slots",
    "cache_extents",
    "plan_slots",
]


AUTO_SLOTS_PER_ROW = 8  # auto_slots on a CPU: one slot per this many rows
AUTO_MIN_NEW_TOKENS = 256  # auto_engine: static below this completion budget


def auto_engine(max_new_tokens: int, backend: str | None = None) -> str:
    """The driver's `rollout.engine=auto` for single-turn rows: "static" below a completion
    budget of AUTO_MIN_NEW_TOKENS, and from it on the compacting engine on a CPU, the
    continuous one on an accelerator (where the compacting engine is not yet measured).
    Measured on a 2-core CPU (experiments/results/compact_cpu): at T 1,024 with
    long-tailed lengths the compacting engine gave 2.2-3.1x the continuous engine's
    tokens/s (16 slots), at T 256 with uniform lengths 1.3x the static engine's; at the
    main job's T 4 and at T 32, where a random model's lengths are nearly uniform and a short budget
    bounds what the static engine can waste, the static engine's one program is kept.
    `backend`: `jax.default_backend()` when None."""
    if max_new_tokens < AUTO_MIN_NEW_TOKENS:
        return "static"
    backend = jax.default_backend() if backend is None else backend
    return "compact" if backend == "cpu" else "continuous"


def auto_episode_engine(max_new_tokens: int, backend: str | None = None) -> str:
    """`rollout.engine=auto` for multi-turn episodes: on a CPU "continuous" for completion
    budgets of AUTO_MIN_NEW_TOKENS or more (slots refilled as episodes end gave 3.2x the
    lock-step loop, 64 episodes, 8 slots), "static" below; the lock-step loop ("static") on
    an accelerator, where a slot loop's extra host round trips (one per turn end rather than
    per turn) outweigh the rows it saves (one H200, the same benchmark: 8 slots 0.46x,
    64 slots 0.68x the lock-step loop's speed; experiments/results/gpu_h200_engines).
    `backend`: `jax.default_backend()` when None."""
    backend = jax.default_backend() if backend is None else backend
    if backend != "cpu" or max_new_tokens < AUTO_MIN_NEW_TOKENS:
        return "static"
    return "continuous"


def auto_slots(n_rows: int, backend: str | None = None) -> int:
    """The default slot count for N rows. On a CPU, where a decode step's time grows with
    its rows, ceil(N / AUTO_SLOTS_PER_ROW): few slots kept busy (long-tailed lengths, T 512,
    N 128: 8 slots decode 95% real tokens, 3.3x the static engine's tokens/s; 16 slots 87%,
    2.8x; experiments/bench/bench_sampler_longtail.py). On an accelerator, where a step's time
    grows far less with its rows, ceil(N / 2) (one H200, the 0.5B shape in bf16, N 128,
    long-tailed lengths: 64 slots 1.13x the static engine at T 1024 and 1.20x at T 2048,
    32 slots 1.07x; experiments/results/gpu_h200_engines). `backend`:
    `jax.default_backend()` when None."""
    backend = jax.default_backend() if backend is None else backend
    per_slot = AUTO_SLOTS_PER_ROW if backend == "cpu" else 2
    return max(1, -(-n_rows // per_slot))


def plan_slots(n_rows: int, n_prompts: int, slots: int | None, mesh) -> tuple[int, int]:
    """(slot count, queue count) for N rows of B prompts. One queue per data shard of `mesh`
    when the shards divide B (each shard decodes its own rows), else one; the slot count
    (`slots`, or `auto_slots(N)`) capped at N and rounded up to a multiple of the queues."""
    if slots is not None:
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots must be a positive int or None, got {slots!r}")
    shards = 1
    if mesh is not None:
        shape = dict(mesh.shape)
        shards = shape.get("data", 1) * shape.get("fsdp", 1)
    queues = shards if n_prompts % shards == 0 else 1
    wanted = auto_slots(n_rows) if slots is None else min(slots, n_rows)
    return -(-wanted // queues) * queues, queues


def cache_extents(
    prompt_width: int, max_new_tokens: int, plan: tuple[tuple[int, int], ...]
) -> tuple[int, ...]:
    """The cache extents a decode step chooses from: P + e for each static-engine loop's
    extent e of `plan` (`generate.decode_plan`), capped at the slot cache's P - 1 + T slots,
    and that width itself. A slot at its step t reads P - 1 + t slots, as the static
    engine's row at its step t reads the P-slot prompt cache and t - 1 completion slots."""
    width = prompt_width - 1 + max_new_tokens
    return tuple(sorted({min(width, prompt_width + e) for e, _ in plan} | {width}))


def _rows_of_queues(x, rows_qs, axis: int, queues: int):
    """`x` with B rows at `axis`, split into `queues` equal blocks; `rows_qs` `[Q, S/Q]`
    indexes rows within each queue's block. Returns the gathered `[.., S, ..]` (S at `axis`)."""
    shape = x.shape
    xq = x.reshape(*shape[:axis], queues, shape[axis] // queues, *shape[axis + 1 :])
    take = lambda xb, idx: jnp.take(xb, idx, axis=axis)
    out = jax.vmap(take, in_axes=(axis, 0), out_axes=axis)(xq, rows_qs)
    return out.reshape(*shape[:axis], -1, *shape[axis + 1 :])


def _continuous_impl(graphdef, state, prompt_bp, lengths_b, budget_n, key, spec: Spec):
    count_trace()
    state = cast_floating(state, compute_dtype_of(nnx.merge(graphdef, state)))
    model = nnx.merge(graphdef, state)
    b, p = prompt_bp.shape
    g, t_new, mesh = spec.group_size, spec.max_new_tokens, spec.mesh
    n, s, q = b * g, spec.slots, spec.queues
    n_q, s_q, b_q = n // q, s // q, b // q
    width = p - 1 + t_new
    extents = cache_extents(p, t_new, spec.decode_plan)
    i32 = jnp.int32
    layers = model.layer_params(fuse=mesh is None or dict(mesh.shape).get("tensor", 1) == 1)

    # The prompts, prefilled once: slots copy their prompt's keys and values from here.
    prompt_bp = batch_constraint(prompt_bp, mesh)
    mask_bp = mask_from_lengths(lengths_b, p, offset_n=p - lengths_b)
    pos_bp = jnp.maximum(jnp.cumsum(mask_bp, axis=1, dtype=i32) - 1, 0)
    prompts = init_cache(model.config, b, p, spec.cache_dtype)
    _, prompts = model(
        prompt_bp, positions_nt=pos_bp, mask_nt=mask_bp, cache=prompts, prefill=True,
        layer_params=layers,
    )  # fmt: skip
    prompts = cache_constraint(prompts, mesh)
    # A slot's first step feeds the prompt's last token (column P - 1) again: not yet readable.
    slot_mask_bw = jnp.concatenate(
        [mask_bp & (jnp.arange(p) < p - 1)[None, :], jnp.zeros((b, t_new - 1), jnp.bool_)], 1
    )

    next_key, gen_key = jax.random.split(key)
    stop_ids = jnp.asarray(spec.stop_ids, i32)
    queue_q1 = jnp.arange(q, dtype=i32)[:, None]
    base_s = (jnp.arange(s, dtype=i32) // s_q) * n_q  # each slot's queue's first sample
    slots = lambda x: batch_constraint(x, mesh)

    def refill(carry):
        """Give each free slot the next pending sample of its queue (module docstring, 1)."""
        cache, sample_s, t_s, tok_s, pos_s, next_q = carry
        free_qs = (sample_s < 0).reshape(q, s_q)
        local_qs = next_q[:, None] + jnp.cumsum(free_qs, axis=1, dtype=i32) - 1
        take_qs = free_qs & (local_qs < n_q)
        next_q = next_q + jnp.sum(take_qs, axis=1, dtype=i32)
        local_qs = jnp.where(take_qs, local_qs, 0)
        take_s = take_qs.reshape(s)
        prompt_qs = local_qs // g  # the prompt, within the queue's block of B / Q
        b_s = (queue_q1 * b_q + prompt_qs).reshape(s)
        sample_s = jnp.where(take_s, (queue_q1 * n_q + local_qs).reshape(s), sample_s)
        t_s = jnp.where(take_s, 0, t_s)
        tok_s = jnp.where(take_s, prompt_bp[b_s, p - 1], tok_s)
        pos_s = jnp.where(take_s, lengths_b[b_s] - 1, pos_s)

        def copy_prompts(cache):
            at = lambda x, axis: _rows_of_queues(x, prompt_qs, axis, q)
            keep = lambda new, old, dims: jnp.where(take_s.reshape(dims), new, old)
            k_new = keep(at(prompts.k, 1), cache.k[..., :p], (1, s, 1, 1, 1))
            v_new = keep(at(prompts.v, 1), cache.v[:, :, :, :p], (1, s, 1, 1, 1))
            return cache.replace(
                k=cache.k.at[..., :p].set(k_new),
                v=cache.v.at[:, :, :, :p].set(v_new),
                mask_ns=keep(at(slot_mask_bw, 0), cache.mask_ns, (s, 1)),
                index=jnp.where(take_s, p - 1, cache.index),
            )

        cache = jax.lax.cond(jnp.any(take_s), copy_prompts, lambda c: c, cache)
        return cache, sample_s, t_s, tok_s, pos_s, next_q

    def put(buf_qn, rows_qs, val_s, cols_qs=None):
        """Write val_s at each queue's rows (row n_q: dropped), column cols_qs when given."""
        val_qs = val_s.reshape(q, s_q).astype(buf_qn.dtype)
        if cols_qs is None:
            return jax.vmap(lambda x, i, v: x.at[i].set(v, mode="drop"))(buf_qn, rows_qs, val_qs)
        write = lambda x, i, j, v: x.at[i, j].set(v, mode="drop")
        return jax.vmap(write)(buf_qn, rows_qs, cols_qs, val_qs)

    def step(carry, extent):
        """Refill, then decode one token per slot reading `extent` cache slots."""
        it, slot_carry, bufs, len_qn, eos_qn = carry
        cache, sample_s, t_s, tok_s, pos_s, next_q = refill(slot_carry)
        # An idle slot keeps stepping (its output unread): hold its write slot inside the
        # cache, as the decoder's in-place scatter requires of every row.
        cache = cache.replace(index=jnp.minimum(cache.index, width - 1))
        hidden, cache = nnx.merge(graphdef, state)(
            tok_s[:, None],
            positions_nt=pos_s[:, None],
            mask_nt=jnp.ones((s, 1), jnp.bool_),  # idle slots too: finite, never read
            cache=cache,
            layer_params=layers,
            cache_extent=extent,
        )
        cache = cache_constraint(cache, mesh)
        logits_s = slots(model.logits(hidden)[:, 0])
        live_s = sample_s >= 0
        sample_safe = jnp.maximum(sample_s, 0)
        out = sample_tokens(logits_s, token_keys(gen_key, sample_safe, t_s), config=spec.sampling)
        t_next = t_s + 1
        stop_s = live_s & jnp.isin(out.token_n, stop_ids) if spec.stop_ids else live_s & False
        ended_s = live_s & (stop_s | (t_next >= budget_n[sample_safe]))
        rows_qs = jnp.where(live_s, sample_s - base_s, n_q).reshape(q, s_q)  # n_q: dropped
        t_qs = t_s.reshape(q, s_q)
        vals = (out.token_n, out.logp_n, out.keep_count_n, out.keep_threshold_n)
        bufs = tuple(put(buf, rows_qs, val, t_qs) for buf, val in zip(bufs, vals))
        ended_rows = jnp.where(ended_s.reshape(q, s_q), rows_qs, n_q)
        len_qn = put(len_qn, ended_rows, t_next)
        eos_qn = put(eos_qn, ended_rows, stop_s)
        slot_carry = (
            cache,
            slots(jnp.where(ended_s, -1, sample_s)),
            slots(t_next),
            slots(out.token_n),
            slots(pos_s + 1),
            next_q,
        )
        return it + 1, slot_carry, bufs, len_qn, eos_qn

    def work_left(carry):
        _, (_, sample_s, _, _, _, next_q), _, _, _ = carry
        return jnp.any(sample_s >= 0) | jnp.any(next_q < n_q)

    def need(carry):
        """Cache slots the next step reads: the deepest live slot's index (a refilled slot's,
        P - 1, is below every extent)."""
        _, (cache, sample_s, *_), _, _, _ = carry
        return jnp.max(jnp.where(sample_s >= 0, cache.index, 0))

    def run_at(i):
        """Steps at extent i while the work lasts and needs more than extent i - 1 and at
        most extent i: the choice is made per phase, so no conditional runs per step."""
        lo, hi = (extents[i - 1] if i else -1), extents[i]
        in_range = lambda c: work_left(c) & (need(c) > lo) & (need(c) <= hi)
        return lambda carry: jax.lax.while_loop(in_range, lambda c: step(c, hi), carry)

    phases = [run_at(i) for i in range(len(extents))]

    def phase(carry):
        branch = jnp.searchsorted(jnp.asarray(extents, i32), need(carry)).astype(i32)
        return jax.lax.switch(branch, phases, carry)

    cache = init_cache(model.config, s, width, spec.cache_dtype)
    cache = cache_constraint(dataclasses.replace(cache, index=jnp.zeros((s,), i32)), mesh)
    idle = slots(jnp.full((s,), -1, i32))
    zeros = slots(jnp.zeros((s,), i32))
    slot_carry = (cache, idle, zeros, zeros, zeros, jnp.zeros((q,), i32))
    bufs = empty_outputs((q, n_q, t_new), spec.pad_id)
    carry = (i32(0), slot_carry, bufs, jnp.zeros((q, n_q), i32), jnp.zeros((q, n_q), jnp.bool_))
    if len(phases) == 1:
        carry = jax.lax.while_loop(work_left, lambda c: step(c, extents[0]), carry)
    else:
        carry = jax.lax.while_loop(work_left, phase, carry)
    it, _, bufs, len_qn, eos_qn = carry
    rows = lambda x: batch_constraint(x.reshape(n, *x.shape[2:]), mesh)
    outputs = tuple(rows(x) for x in bufs)
    return Rollout.from_outputs(
        prompt_bp, lengths_b, outputs, rows(len_qn), rows(eos_qn), next_key, it, s
    )


continuous_jit = jax.jit(_continuous_impl, static_argnums=(0, 6), compiler_options=COMPILER_OPTIONS)
