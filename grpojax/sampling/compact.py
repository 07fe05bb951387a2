"""The compacting engine: rows decode in lock step, the live ones compacted into fewer rows
as samples end, the cache widened as the step grows.

The static engine (`grpojax.sampling.generate`) decodes all N = B*G rows until the longest
ends and slices each layer's weights and cache out of stacked `[L, ...]` arrays on every
step; the continuous engine (`grpojax.sampling.continuous`) keeps a pool of slots busy but
reads every slot's cache up to the deepest slot's extent. This engine starts every sample at
once, as vLLM does, and keeps the work a step does close to the live work:

- **rows follow the live samples**: the decode runs in phases, each one compiled program of
  R rows (R in `row_sizes(N)`: N, then each 3/4 of the one before); when no more than the
  next smaller size are live, the live rows are gathered into a batch of that size. At
  least ~3/4 of a phase's rows are live, and a row that ended waits until the next size;
- **the cache follows the live tokens**: every row is at the same step t, so the cache holds
  P + e slots for the phase's extent e of `generate.decode_plan` with WIDTH_PHASES loops
  (the steps t < end it covers, chunks of 128 steps or more): it is widened when t passes
  the extent, and attention reads exactly the cache there is (no slice of a larger cache).
  Its memory is R x (P + e) slots, not N x (P + T);
- **no per-layer copies**: `Decoder.decode_step` unrolls the layers over weights split once
  per call (`split_layers`) and a `LayerCache` of one array per layer, written in place.

A phase ends when t reaches its extent's end or the live rows fit the next size; the host
reads the step and the live count (two scalars) between phases and picks the next
(rows, extent) program: at most len(row_sizes(N)) + WIDTH_PHASES round trips a call, none
per step.
Programs are compiled per (rows, extent) as a call first needs them and kept.

Token t of sample n is drawn with key(n, t) (`grpojax.sampling.rollout`) and token 0 from
the prompt's prefill, as the static engine does, so the rollout is the static engine's,
token for token (the attention sums the same key sets in another grouping: float rounding).
Under a mesh the rows are split over the data axes as the static engine's; compaction
gathers live rows across shards. Sliding windows, Gemma, mixtures of experts and LoRA
adapters work as in the forward (tested against the static engine); routing records need the
static engine.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import Array
from jax.sharding import NamedSharding

from grpojax.models import sharding
from grpojax.models.decoder import LayerCache, init_cache, split_layers
from grpojax.models.precision import COMPILER_OPTIONS, cast_floating, compute_dtype_of
from grpojax.ops.masks import mask_from_lengths
from grpojax.sampling.rollout import (
    Rollout,
    Spec,
    batch_constraint,
    count_trace,
    empty_outputs,
    record_step,
    token_keys,
)
from grpojax.sampling.transforms import sample_tokens

__all__ = ["cache_slots", "generate_compact", "phase_widths", "row_sizes"]


ROW_SHRINK = 0.75  # each batch size this fraction of the one before (rounded up)
WIDTH_PHASES = 16  # the cache is widened in up to this many steps (`decode_plan`'s loops)


def row_sizes(n_rows: int, multiple: int = 1) -> tuple[int, ...]:
    """The batch sizes a call's phases decode at: N, then each ROW_SHRINK of the one
    before, a multiple of `multiple` (the mesh's data shards), down to `multiple`.
    N 128: 128, 96, 72, 54, 40, 30, 22, 16, 12, 9, 6, 4, 3, 2, 1."""
    sizes, r = [n_rows], n_rows
    while r > multiple:
        smaller = max(multiple, -(-int(r * ROW_SHRINK) // multiple) * multiple)
        r = smaller if smaller < r else r - multiple
        sizes.append(r)
    return tuple(sizes)


def cache_slots(
    lengths_n,
    prompt_width: int,
    max_new_tokens: int,
    plan: tuple[tuple[int, int], ...],
    *,
    num_layers: int,
    multiple: int = 1,
) -> tuple[float, int]:
    """(the most cache slots the compacting engine holds at once, rows x slots; the static
    engine's N x (P + T)) for completions of `lengths_n` tokens, simulated on the host as the
    engine runs: rows `row_sizes`, slots P + the extent of the `plan` phase holding step t.
    A resize goes layer by layer, so it holds the larger of the old and the new cache and
    1/L of the other at most; counted."""
    lengths_n = np.asarray(lengths_n)
    n = lengths_n.shape[0]
    sizes = row_sizes(n, multiple)
    t_max = int(lengths_n.max())
    phases = phase_widths(prompt_width, int(max_new_tokens), plan)
    peak, prev = 0.0, None
    for t in range(1, t_max):
        live = int(np.sum(lengths_n > t))
        rows = min(r for r in sizes if r >= live)
        held = rows * next(w for w, end in phases if t < end)
        if prev is not None and prev != held:
            peak = max(peak, max(prev, held) + min(prev, held) / num_layers)
        peak, prev = max(peak, held), held
    full = n * (prompt_width + max_new_tokens)
    return peak, full


def phase_widths(
    prompt_width: int, max_new_tokens: int, plan: tuple[tuple[int, int], ...]
) -> tuple[tuple[int, int], ...]:
    """(cache slots, end) of each phase of `plan` (`generate.decode_plan`): steps t < end
    write slot P + t - 1, so a phase holds P + max(extent, end - 1) slots, at most
    P + T - 1 (the last token is never fed). T = 1: one phase of P + 1 slots, no step."""
    if not plan:
        return ((prompt_width + 1, 1),)
    cap = max_new_tokens - 1
    return tuple((prompt_width + min(cap, max(e, end - 1)), end) for e, end in plan)


class _Rows(NamedTuple):
    """A phase's state: R rows in lock step at step t (the token t is drawn next)."""

    cache: LayerCache  # R rows, P + extent slots
    sample_r: Array  # [R] the sample each row decodes (an ended one's until a resize)
    token_r: Array  # [R] the last token, fed at this step
    position_r: Array  # [R] its RoPE position
    live_r: Array  # [R] the row's sample has not ended
    t: Array  # [] the step
    outputs: tuple  # `empty_outputs` [N, T] by sample
    length_n: Array  # [N]
    eos_n: Array  # [N]
    row_steps: Array  # [] rows decoded so far, summed over steps


def _layer_shardings(cache: LayerCache, mesh) -> Any:
    """A `LayerCache`-shaped pytree of NamedShardings: rows over the data axes, kv heads
    over `tensor` (one layer of `sharding.cache_shardings`' layout each)."""
    axes = sharding.ACTIVATION_AXES
    mesh_shape = dict(mesh.shape)
    spec = lambda role, x: NamedSharding(
        mesh, sharding.logical_to_spec(axes[role][1:], tuple(x.shape), mesh_shape)
    )
    shaped: Any = type(cache)  # the same pytree, shardings in its leaves' places
    return shaped(
        k=tuple(spec("cache_k", x) for x in cache.k),
        v=tuple(spec("cache_v", x) for x in cache.v),
        mask_ns=NamedSharding(
            mesh,
            sharding.logical_to_spec(axes["cache_mask_ns"], cache.mask_ns.shape, mesh_shape),
        ),
        index=NamedSharding(mesh, jax.sharding.PartitionSpec()),
    )


def _constrain(rows: _Rows, mesh) -> _Rows:
    if mesh is None:
        return rows
    cache = jax.lax.with_sharding_constraint(rows.cache, _layer_shardings(rows.cache, mesh))
    sample, token, position, live = (
        batch_constraint(x, mesh) for x in (rows.sample_r, rows.token_r, rows.position_r,
                                            rows.live_r)
    )  # fmt: skip
    return rows._replace(
        cache=cache, sample_r=sample, token_r=token, position_r=position, live_r=live
    )


def _start_impl(graphdef, state, prompt_bp, lengths_b, budget_n, key, spec: Spec, width: int):
    """Prefill the B prompts, draw every sample's token 0 from its prompt's last logits, and
    lay the N rows' caches out at `width` slots (the prompt's P, then the completion's)."""
    count_trace()
    state = cast_floating(state, compute_dtype_of(nnx.merge(graphdef, state)))
    model = nnx.merge(graphdef, state)
    b, p = prompt_bp.shape
    g, mesh = spec.group_size, spec.mesh
    n = b * g
    layers = model.layer_params(fuse=mesh is None or dict(mesh.shape).get("tensor", 1) == 1)
    prompt_bp = batch_constraint(prompt_bp, mesh)
    mask_bp = mask_from_lengths(lengths_b, p, offset_n=p - lengths_b)
    pos_bp = jnp.maximum(jnp.cumsum(mask_bp, axis=1, dtype=jnp.int32) - 1, 0)
    prompts = init_cache(model.config, b, p, spec.cache_dtype)
    hidden, prompts = model(
        prompt_bp, positions_nt=pos_bp, mask_nt=mask_bp, cache=prompts, prefill=True,
        layer_params=layers,
    )  # fmt: skip
    logits_n = batch_constraint(jnp.repeat(model.logits(hidden[:, -1:])[:, 0], g, axis=0), mesh)
    next_key, gen_key = jax.random.split(key)
    sample_n = jnp.arange(n, dtype=jnp.int32)
    out = sample_tokens(
        logits_n, token_keys(gen_key, sample_n, jnp.zeros((n,), jnp.int32)), config=spec.sampling
    )
    outputs = empty_outputs((n, spec.max_new_tokens), spec.pad_id)
    outputs, _ = record_step(outputs, out, 0, jnp.ones((n,), jnp.bool_), spec.pad_id)
    stop_n = jnp.isin(out.token_n, jnp.asarray(spec.stop_ids, jnp.int32)) & bool(spec.stop_ids)
    ended_n = stop_n | (budget_n <= 1)
    grow = width - p
    rep = lambda x, axis: jnp.repeat(x, g, axis=axis)
    cache = LayerCache(
        k=tuple(jnp.pad(rep(k, 0), ((0, 0),) * 3 + ((0, grow),)) for k in prompts.k),
        v=tuple(jnp.pad(rep(v, 0), ((0, 0), (0, 0), (0, grow), (0, 0))) for v in prompts.v),
        mask_ns=jnp.pad(rep(mask_bp, 0), ((0, 0), (0, grow))),
        index=jnp.asarray(p, jnp.int32),
    )
    rows = _Rows(
        cache=cache,
        sample_r=sample_n,
        token_r=out.token_n,
        position_r=rep(lengths_b, 0),  # token 0 sits at the prompt's length
        live_r=~ended_n,
        t=jnp.asarray(1, jnp.int32),
        outputs=tuple(batch_constraint(x, mesh) for x in outputs),
        length_n=jnp.ones((n,), jnp.int32),
        eos_n=stop_n,
        row_steps=jnp.asarray(n, jnp.int32),
    )
    return _constrain(rows, mesh), split_layers(layers, model.config.num_layers), gen_key, next_key


_start = jax.jit(_start_impl, static_argnums=(0, 6, 7), compiler_options=COMPILER_OPTIONS)


def _order_impl(live_r, size: int):
    """The rows to keep: the live ones first, in their order, then ended ones, `size` in all."""
    return jnp.argsort(~live_r, stable=True)[:size]


_order = jax.jit(_order_impl, static_argnums=1)


def _resize_impl(x, order, slot_axis: int, width: int):
    """`x` (rows first) with the rows of `order` (None: all) and its slot axis padded to
    `width`."""
    if order is not None:
        x = jnp.take(x, order, axis=0)
    pad = [(0, 0)] * x.ndim
    pad[slot_axis] = (0, width - x.shape[slot_axis])
    return jnp.pad(x, pad)


_resize_array = jax.jit(_resize_impl, static_argnums=(2, 3))


def _resize(rows: _Rows, size: int, width: int) -> _Rows:
    """The live rows first, `size` of them kept (every live one: the caller's guarantee),
    and the cache padded to `width` slots: one small program per array, each layer's old
    keys and values dropped as soon as their new ones are made, so a resize holds the old
    cache and one layer of the new one (or the reverse), not two caches."""
    if size == rows.sample_r.shape[0] and width == rows.cache.mask_ns.shape[1]:
        return rows
    order = _order(rows.live_r, size) if size < rows.sample_r.shape[0] else None
    cache = rows.cache
    ks, vs, mask, index = list(cache.k), list(cache.v), cache.mask_ns, cache.index
    # Nothing else may hold the old layers: each is freed once its new one is made.
    rows = rows._replace(cache=LayerCache(k=(), v=(), mask_ns=mask, index=index))
    del cache
    for layer in range(len(ks)):
        ks[layer] = _resize_array(ks[layer], order, 3, width)
        vs[layer] = _resize_array(vs[layer], order, 2, width)
    cache = LayerCache(
        k=tuple(ks), v=tuple(vs), mask_ns=_resize_array(mask, order, 1, width), index=index
    )
    rows = rows._replace(cache=cache)
    if order is None:
        return rows
    take = lambda x: _resize_array(x, order, 0, size)  # per-row vectors: no slot axis to pad
    return rows._replace(
        sample_r=take(rows.sample_r),
        token_r=take(rows.token_r),
        position_r=take(rows.position_r),
        live_r=take(rows.live_r),
    )


def _phase_impl(graphdef, state, layers, rows: _Rows, gen_key, budget_n, spec: Spec, end, floor):
    """Decode steps t < `end` while more than `floor` rows are live (one phase: its rows
    and cache slots are `rows`')."""
    count_trace()
    state = cast_floating(state, compute_dtype_of(nnx.merge(graphdef, state)))
    mesh, n, size = spec.mesh, budget_n.shape[0], rows.sample_r.shape[0]
    rows = _constrain(rows, spec.mesh)
    stop_ids = jnp.asarray(spec.stop_ids, jnp.int32)

    def live(rows):
        return jnp.sum(rows.live_r, dtype=jnp.int32)

    def cond(rows):
        return (rows.t < end) & (live(rows) > floor)

    def step(rows: _Rows) -> _Rows:
        model = nnx.merge(graphdef, state)
        hidden, cache = model.decode_step(rows.token_r, rows.position_r, rows.cache, layers)
        logits_r = batch_constraint(model.logits(hidden)[:, 0], mesh)
        t_r = jnp.full_like(rows.sample_r, rows.t)
        keys = token_keys(gen_key, rows.sample_r, t_r)
        out = sample_tokens(logits_r, keys, config=spec.sampling)
        live_r = rows.live_r
        at_r = jnp.where(live_r, rows.sample_r, n)  # n: not written
        vals = (out.token_n, out.logp_n, out.keep_count_n, out.keep_threshold_n)
        outputs = tuple(
            buf.at[at_r, rows.t].set(val.astype(buf.dtype), mode="drop")
            for buf, val in zip(rows.outputs, vals)
        )
        stop_r = live_r & jnp.isin(out.token_n, stop_ids) & bool(spec.stop_ids)
        ended_r = live_r & (stop_r | (rows.t + 1 >= budget_n[rows.sample_r]))
        end_at = jnp.where(ended_r, rows.sample_r, n)
        rows = rows._replace(
            cache=cache,
            token_r=out.token_n,
            position_r=rows.position_r + 1,
            live_r=live_r & ~ended_r,
            t=rows.t + 1,
            outputs=outputs,
            length_n=rows.length_n.at[at_r].set(rows.t + 1, mode="drop"),
            eos_n=rows.eos_n.at[end_at].set(stop_r, mode="drop"),
            row_steps=rows.row_steps + size,
        )
        return _constrain(rows, mesh)

    rows = jax.lax.while_loop(cond, step, rows)
    return rows, rows.t, live(rows)


_phase = jax.jit(_phase_impl, static_argnums=(0, 6, 7, 8), compiler_options=COMPILER_OPTIONS)


def _scalar(x) -> int:
    """A replicated scalar's value on this process (every process holds a copy)."""
    return int(np.asarray(x.addressable_data(0)))


def generate_compact(graphdef, state, prompt_bp, lengths_b, budget_n, key, spec: Spec):
    """`generate(engine="compact")`'s rollout (the module docstring); the arguments are
    `generate`'s program arguments."""
    p, t_new, n = prompt_bp.shape[1], spec.max_new_tokens, budget_n.shape[0]
    widths = phase_widths(p, t_new, spec.decode_plan)
    sizes = row_sizes(n, spec.queues)
    rows, layers, gen_key, next_key = _start(
        graphdef, state, prompt_bp, lengths_b, budget_n, key, spec, widths[0][0]
    )
    t, live = 1, _scalar(jnp.sum(rows.live_r, dtype=jnp.int32))
    while live and t < t_new:
        i = max(k for k, r in enumerate(sizes) if r >= live)
        width, end = next((w, end) for w, end in widths if t < end)
        floor = sizes[i + 1] if i + 1 < len(sizes) else 0
        rows = _resize(rows, sizes[i], width)
        rows, t, live = _phase(graphdef, state, layers, rows, gen_key, budget_n, spec, end, floor)
        t, live = _scalar(t), _scalar(live)
    return Rollout.from_outputs(
        prompt_bp, lengths_b, rows.outputs, rows.length_n, rows.eos_n, next_key, rows.t, 1
    )._replace(row_steps=rows.row_steps)
