"""Attention: softmax(scale q k^T) v over one or more key sets, masks as data.

A mask is never a `[T, S]` array built by a caller: each key set carries small per-token
arrays, and whether query i may read key j is decided from them, block by block:

    allowed[i, j] = key_seg[j] > 0                                 (a real key)
                    and (query_seg is None                         (one sequence a row)
                         or key_seg[j] in (query_seg[i], query_parent[i]))  (packed rows)
                    and (not causal or j <= i)                     (column order)
                    and (window is None or pos[i] - pos[j] < window)  (sliding window)

    s[i, j] = scale * q_i . k_j                    (scale None: 1 / sqrt(H))
    s[i, j] = softcap * tanh(s[i, j] / softcap)    (softcap given; before the mask)

`key_seg` 0 marks padding (left-padded prompts, right-padded completions, the tail of a
packed row); `query_seg` is given for packed rows (several sequences in one row, each with
its own segment id) and None for rows that hold one sequence, where every query reads
every real key before it (padding queries included, which keeps their outputs finite).
`query_parent` (packed rows only, 0: none) is a second segment a query may read: a
completion reads the prompt its group shares, packed once before the group's completions.
A sliding `window` (Mistral, Gemma 2/3's local layers; an int, or a traced int32 scalar
such as one per layer of a scan) lets a token read itself and the window - 1 tokens before
it (Hugging Face's `kv_idx > q_idx - sliding_window`); it compares positions, not columns,
which in a packed row are not positions. The new tokens' positions are `SelfMask.positions`;
those of a prefix's and a cache's keys are derived (`attention_with_cache`). `scale` (Gemma:
`query_pre_attn_scalar ** -0.5`) and `softcap` (Gemma 2's `attn_logit_softcapping`) are
Python floats. Left None, none of the three changes the compiled program.

Backends (`ModelConfig.attention`, chosen per call by `resolve`):

- `einsum`: the reference. Builds the whole float32 score array `[N, K, G, T, S]`; fastest
  for short sequences, memory quadratic in length.
- `blockwise`: online softmax over `[block, block]` tiles (`flash_attention`), with a
  custom VJP that recomputes the tiles in the backward pass (FlashAttention-2), so memory
  is linear in length in the forward and the backward. Tiles that the mask empties (the
  causal upper triangle, other segments of a packed row) are not visited. A shared prompt
  prefix or a cache is read as keys laid before each row's own (`_blockwise_key_sets`).
- `fused`: `jax.nn.dot_product_attention`, cuDNN's fused flash attention on a GPU (its
  XLA implementation elsewhere, the same layout: the path the CPU tests check), for every
  call its arguments can express (`fused_refusal_for`): rows of one sequence, padded
  anywhere, alone or after a shared prompt prefix and/or a row cache (the trainer's
  completion rows, a later prefill), grouped-query heads, `scale`, and one sliding window
  for every layer. Each row's real keys are laid out first, in sequence order, and its new
  tokens' queries over the same columns, so that the op's causal mask with per-row
  lengths is the mask (`fused_attention`). Not packed rows, a soft cap, a window that
  differs by layer, a decode step, or earlier keys so many that the op's causal square
  would compute over `FUSED_MAX_EXTRA_WORK` times the scores needed: those calls take
  `auto`'s choice below, logged once per reason. Where `PROBE_COMPILE` names the op's
  implementation (cuDNN), each call signature is first compiled on its own, forward and
  backward, so that a compile-time refusal falls back too. Padding queries give zeros.
- `auto`: on a GPU, `fused` where it applies (bfloat16 or float16 inputs); else `einsum`
  while the score array of one row and head stays within `AUTO_EINSUM_MAX_SCORES`,
  `blockwise` beyond. `call_path` gives a call's choice from its static facts
  (`grpojax train --dry-run` reports it per call site). Each path's ops carry its name
  (`fused_attention`, `einsum_attention`, `blockwise_attention`) in the compiled
  program's metadata.

Kernel libraries were evaluated for this role (docs/how-to/long-sequences.md): tokamax 0.0.12's
CPU path (`xla_chunked`) builds the `[T, S]` boolean mask and repeats keys per query head,
and its GPU kernels (Mosaic, Triton) fail on JAX 0.11; cuDNN's flash attention (through
`jax.nn.dot_product_attention`) ran 8.3x this module's blockwise path (tiles of 1,024) at
16k tokens on an H200 (causal rows without padding, experiments/results/gpu_h200_attention).

Numerics: scores, the softmax statistics and the weighted sum of values accumulate in
float32; the normalised probabilities are cast to the values' dtype before their product,
as in the einsum path (below float32 the blockwise forward takes two passes for that).
Shapes: `N` rows, `T` queries, `S` keys, `Q` query heads, `K` key/value heads (`G = Q / K`
per key head), `H` head width.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

NEG_INF = -1e30  # finite so fully-masked (padding) query rows give a uniform softmax, not NaN
IMPLEMENTATIONS = ("auto", "einsum", "blockwise", "fused")
DEFAULT_BLOCK = 256
# On a GPU the tile is larger: one layer's attention forward+backward (one row, causal, 28
# query / 4 kv heads of 128, bf16) on an H200 took 0.38-0.41x the einsum path's speed with
# tiles of 256 and 0.92x / 1.06x at T = 4,096 / 16,384 with tiles of 1,024, its scratch
# still linear in T (1.0 vs 1.5 GB at 32,768; experiments/results/gpu_h200_attention).
GPU_BLOCK = 1024
# `auto` keeps the einsum while one row's scores for one head, T x S float32, stay within
# this (1 MiB: T = S = 512). On this project's 2-core CPU, one layer's attention gradient
# (8 query / 2 kv heads of 32) took 0.023 s einsum vs 0.028 s blockwise at T = 512, and
# 0.17 vs 0.06 s at 1,024, 3.0 vs 0.8 s at 4,096 (tiles of 256).
AUTO_EINSUM_MAX_SCORES = 512 * 512


def default_block() -> int:
    """The blockwise path's tile size where none is given: `GPU_BLOCK` when JAX's default
    backend is a GPU, `DEFAULT_BLOCK` elsewhere."""
    return GPU_BLOCK if jax.default_backend() == "gpu" else DEFAULT_BLOCK


def resolve(implementation: str, t: int, s: int) -> str:
    """The unfused backend `implementation` means for T queries over S keys: `auto` (and
    `fused`, for a call it cannot take) -> `einsum` while T x S <= `AUTO_EINSUM_MAX_SCORES`,
    else `blockwise`."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"attention must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    if implementation in ("auto", "fused"):
        return "einsum" if t * s <= AUTO_EINSUM_MAX_SCORES else "blockwise"
    return implementation


class SelfMask(NamedTuple):
    """Which of the T new tokens each new token may read (causal in column order).

    key_seg: `[N, T]` int32, 0 at padding, else the token's sequence id in its row.
    query_seg: `[N, T]` int32 or None (rows of one sequence: any real key before it).
    query_parent: `[N, T]` int32 or None: a segment the token may read besides its own
      (0: none); packed rows only.
    positions: `[N, T]` int32 or None: the tokens' positions in their sequences (of a
      packed row's completion: after its parent prompt's), as queries and as keys; a
      sliding window needs them.
    """

    key_seg: Array
    query_seg: Array | None = None
    query_parent: Array | None = None
    positions: Array | None = None

    @classmethod
    def from_mask(cls, mask_nt: Array, positions: Array | None = None) -> SelfMask:
        """Rows of one (left- or right-padded) sequence each; `positions` `[N, T]` or None."""
        return cls(jnp.asarray(mask_nt, jnp.int32), positions=_int32(positions))

    @classmethod
    def packed(
        cls,
        segment_ids_nt: Array,
        parent_ids_nt: Array | None = None,
        positions: Array | None = None,
    ) -> SelfMask:
        """Packed rows: segment ids `[N, T]` (0 padding); a token reads its own segment and,
        given `parent_ids_nt`, the segment named there (0: none). `positions` `[N, T]`
        (each segment's own) or None."""
        seg = jnp.asarray(segment_ids_nt, jnp.int32)
        return cls(seg, seg, _int32(parent_ids_nt), _int32(positions))

    def allowed(self, window: int | Array | None = None) -> Array:
        """`[N, T, T]` bool, the whole mask (the einsum path's; quadratic in T), within
        `window` when given."""
        t = self.key_seg.shape[1]
        cols = jnp.arange(t, dtype=jnp.int32)
        pos = _window_positions(self, window)
        return _tile_mask(
            self.key_seg, self.query_seg, self.query_parent, cols, cols, pos, pos, window
        )


def _int32(x: Array | None) -> Array | None:
    return None if x is None else jnp.asarray(x, jnp.int32)


def _window_positions(mask: SelfMask, window: int | Array | None) -> Array | None:
    """`mask.positions` where a sliding window is given (None without one)."""
    if window is None:
        return None
    if mask.positions is None:
        raise ValueError(
            "a sliding window compares positions: give the SelfMask the tokens' positions "
            "(SelfMask.from_mask(..., positions=) or SelfMask.packed(..., positions=))"
        )
    return mask.positions


def einsum_f32(spec: str, a: Array, b: Array) -> Array:
    """`einsum(spec, a, b)` accumulated and returned in float32 (inputs in the compute dtype).

    Accelerators take bf16 x bf16 -> f32 dots as they are. XLA:CPU cannot execute some of
    them (`DotThunk`: "Unsupported element type BF16 x BF16 = F32"), so there the operands
    are upcast first: bf16 products are exact in float32, so the result is the same.
    """
    if jax.default_backend() == "cpu":
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def group_queries(q_ntqh: Array, kv_heads: int) -> Array:
    """`[N, T, Q, H]` -> `[N, K, G, T, H]` (G = Q / K queries per kv head).

    Both attention products then have the (N, K) batch axes first and their contracted axis
    last or second to last, the layout XLA:CPU's dot kernels take as they are: with the T
    axis between the batch and head axes (`ntkgh`), XLA:CPU transposed operands or fell back
    to a naive dot, which made a decode step's attention over the cache about 3x slower
    (`experiments/bench/bench_roofline.py`, docs "Where a decode step's time goes")."""
    n, t, q_heads, h = q_ntqh.shape
    q = q_ntqh.reshape(n, t, kv_heads, q_heads // kv_heads, h)
    return jnp.transpose(q, (0, 2, 3, 1, 4))


def ungroup_heads(out_nkgth: Array, dtype) -> Array:
    """`[N, K, G, T, H]` (float32) -> `[N, T, Q, H]` in `dtype`."""
    n, k, g, t, h = out_nkgth.shape
    return jnp.transpose(out_nkgth, (0, 3, 1, 2, 4)).reshape(n, t, k * g, h).astype(dtype)


def _to_groups(x_n: Array, b: int) -> Array:
    """`[N, K, G, T, X]` -> `[B, K, J, G, T, X]` (N = B*J rows in contiguous groups of J)."""
    n, k, g, t, x = x_n.shape
    return jnp.transpose(x_n.reshape(b, n // b, k, g, t, x), (0, 2, 1, 3, 4, 5))


def _to_rows(x_b: Array) -> Array:
    """`[B, K, J, G, T, X]` -> `[N, K, G, T, X]`, the inverse of `_to_groups`."""
    b, k, j, g, t, x = x_b.shape
    return jnp.transpose(x_b, (0, 2, 1, 3, 4, 5)).reshape(b * j, k, g, t, x)


def _scores(z: Array, h: int, scale: float | None, softcap: float | None) -> Array:
    """q . k products (float32) -> scores: times `scale` (None: H ** -0.5), soft-capped."""
    z = z * (h**-0.5 if scale is None else scale)
    return z if softcap is None else softcap * jnp.tanh(z / softcap)


# ----------------------------------------------------------------------------- fused path

_log = logging.getLogger(__name__)
_TOLD: set[str] = set()  # the fallbacks logged so far (each reason once a process)
# The fused op computes a causal square over the earlier keys and the new tokens (see
# `fused_attention`): E earlier slots before T new tokens cost (E + T)^2 / 2 scores against
# the E T + T^2 / 2 the mask needs. Beyond this ratio (E = 2.4 T), once the square exceeds
# what `auto` leaves to the einsum anyway (`AUTO_EINSUM_MAX_SCORES`), the call takes the
# unfused path: cuDNN ran 8.3x the blockwise path at 16k tokens on an H200, so twice the
# scores still gains; a long cache before a few new tokens (a later turn's prefill) would not.
FUSED_MAX_EXTRA_WORK = 2.0
# Where a compile of the fused call is tried on its own before the step uses it (a cuDNN
# refusal of a shape, a head width, a GPU generation surfaces when XLA compiles, not when
# JAX traces); the decision is kept per call signature (`_compile_failure`).
PROBE_COMPILE: set[str] = {"cudnn"}
_PROBED: dict[tuple, str | None] = {}


def on_gpu() -> bool:
    """Whether JAX's default backend is a GPU (where `fused` means cuDNN)."""
    return jax.default_backend() == "gpu"


def fused_implementation() -> Literal["cudnn", "xla"]:
    """`jax.nn.dot_product_attention`'s implementation for `fused`: "cudnn" on a GPU, "xla"
    elsewhere."""
    return "cudnn" if on_gpu() else "xla"


def takes_fused(implementation: str) -> bool:
    """Whether `implementation` asks for the fused op: `fused`, or `auto` on a GPU."""
    return implementation == "fused" or (implementation == "auto" and on_gpu())


def fused_refusal_for(
    *,
    t: int,
    earlier: int = 0,
    dtype=jnp.float32,
    packed: bool = False,
    decoding: bool = False,
    window: Literal["none", "static", "per-layer"] = "none",
    softcap: bool = False,
) -> str | None:
    """Why the fused op cannot take a call of T new tokens after `earlier` slots of a prefix
    and/or a cache (None: it can), from its static facts: the one rule `attention`,
    `attention_with_cache` and `grpojax train --dry-run` (`call_path`) apply."""
    if decoding:
        return (
            "one new token over the cache (decoding): the einsum reads the cache in place, "
            "the fused op would copy it every step"
        )
    if packed:
        return (
            "packed rows (segment ids): jax.nn.dot_product_attention takes one sequence a row "
            "(lengths), not segments, nor a completion reading its prompt's segment"
        )
    if softcap:
        return "soft-capped scores (jax.nn.dot_product_attention has no soft cap)"
    if window == "per-layer":
        return "a sliding window that differs by layer (the fused op takes a static window)"
    if on_gpu() and jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
        return f"{jnp.dtype(dtype)} inputs (cuDNN takes bfloat16 and float16)"
    if earlier and (earlier + t) ** 2 > AUTO_EINSUM_MAX_SCORES:
        extra = (earlier + t) ** 2 / (2 * earlier * t + t * t)
        if extra > FUSED_MAX_EXTRA_WORK:
            return (
                f"{earlier} earlier slots before {t} new tokens: the fused call would compute "
                f"{extra:.1f}x the scores needed (limit {FUSED_MAX_EXTRA_WORK})"
            )
    return None


def fused_refusal(
    q_ntqh: Array,
    mask: SelfMask,
    window: int | Array | None,
    softcap: float | None,
    earlier: int = 0,
    decoding: bool = False,
) -> str | None:
    """`fused_refusal_for` of a call's arrays (None: the fused op can take it)."""
    if window is None:
        kind: Literal["none", "static", "per-layer"] = "none"
    else:
        kind = "static" if isinstance(window, int | np.integer) else "per-layer"
    return fused_refusal_for(
        t=q_ntqh.shape[1],
        earlier=earlier,
        dtype=q_ntqh.dtype,
        packed=mask.query_seg is not None,
        decoding=decoding,
        window=kind,
        softcap=softcap is not None,
    )


def call_path(
    implementation: str,
    *,
    t: int,
    earlier: int = 0,
    dtype=jnp.float32,
    packed: bool = False,
    decoding: bool = False,
    window: Literal["none", "static", "per-layer"] = "none",
    softcap: bool = False,
) -> tuple[str, str | None]:
    """The path a call takes on this backend, from its static facts (`fused_refusal_for`'s):
    ("fused", None), or ("einsum" | "blockwise", why the fused op does not take it, None
    where it was not asked for: `auto` off a GPU, `einsum`, `blockwise`)."""
    why = None
    if takes_fused(implementation):
        why = fused_refusal_for(
            t=t, earlier=earlier, dtype=dtype, packed=packed, decoding=decoding,
            window=window, softcap=softcap,
        )  # fmt: skip
        if why is None:
            return "fused", None
    if decoding or t == 1:
        return "einsum", why
    return resolve(implementation, t, t + earlier), why


def _tell_once(message: str) -> None:
    if message not in _TOLD:
        _TOLD.add(message)
        _log.info(message)


def _rows_of(prefix, cache, n: int):
    """The earlier key sets read per row, in sequence order (prefix, then cache): keys and
    values `[N, E, K, H]` and real `[N, E]` bool each (a prefix repeated over its group)."""
    sets = []
    if prefix is not None:
        pk, pv, p_allowed = prefix
        j = n // pk.shape[0]
        rows = lambda x: jnp.repeat(x, j, axis=0)
        sets.append(
            (rows(jnp.transpose(pk, (0, 3, 1, 2))), rows(jnp.swapaxes(pv, 1, 2)), rows(p_allowed))
        )
    if cache is not None:
        ck, cv, c_allowed = cache
        sets.append((jnp.transpose(ck, (0, 3, 1, 2)), jnp.swapaxes(cv, 1, 2), c_allowed))
    return sets


def fused_attention(
    q_ntqh: Array,
    k_ntkh: Array,
    v_ntkh: Array,
    mask: SelfMask,
    *,
    prefix: tuple[Array, Array, Array] | None = None,
    cache: tuple[Array, Array, Array] | None = None,
    window: int | None = None,
    scale: float | None = None,
    implementation: Literal["cudnn", "xla"] | None = None,
) -> Array:
    """`attention_with_cache` of rows of one sequence each through one
    `jax.nn.dot_product_attention` call.

    Each row's keys are laid out as the op's masks can read them: its real keys in sequence
    order (the group's prefix, the row's cache, then its new tokens; E of them before the
    new ones, L in all) in the first L of E_w + T columns (E_w: the earlier sets' width), and
    its i-th real new token's query at column E + i, so that "causal in columns" is the
    rule: a new token reads every real earlier key and the real new keys up to itself.
    Columns before E hold zero queries whose outputs are dropped. The op then takes
    `is_causal`, `query_seq_lengths = key_value_seq_lengths = max(L, 1)` and, for `window`
    W (a Python int), `local_window_size = (W - 1, 0)`: W - 1 real keys back, the position
    difference when a row's real tokens have consecutive positions (`positions_from_mask`
    and `attention_with_cache`'s rule for the earlier keys). Without earlier sets this is
    the new tokens' self-attention, real tokens moved first. Outputs are moved back, 0 at
    padding queries. `implementation`: "cudnn" or "xla" (None: `fused_implementation()`).
    Shapes as `attention_with_cache`'s; returns `[N, T, Q, H]` in v's dtype.
    """
    n, t = q_ntqh.shape[:2]
    sets = _rows_of(prefix, cache, n)
    real_nt = mask.key_seg > 0
    dtype = v_ntkh.dtype
    keys = jnp.concatenate([*(s[0].astype(k_ntkh.dtype) for s in sets), k_ntkh], axis=1)
    values = jnp.concatenate([*(s[1].astype(dtype) for s in sets), v_ntkh], axis=1)
    real = jnp.concatenate([*(jnp.asarray(s[2], bool) for s in sets), real_nt], axis=1)
    width = real.shape[1]
    order = jnp.argsort(~real, axis=1, stable=True)  # real columns first, in order
    length = jnp.maximum(jnp.sum(real, axis=1, dtype=jnp.int32), 1)
    before = length - jnp.maximum(jnp.sum(real_nt, axis=1, dtype=jnp.int32), 0)  # E a row
    before = jnp.where(jnp.any(real, axis=1), before, 0)[:, None]
    move = lambda x, idx: jnp.take_along_axis(x, idx[:, :, None, None], axis=1)
    # Column c holds new token own[c - E] (the new tokens' real ones first, in order).
    own = jnp.argsort(~real_nt, axis=1, stable=True)
    at = jnp.arange(width, dtype=jnp.int32)[None, :] - before
    live = (at >= 0) & (at < jnp.sum(real_nt, axis=1, keepdims=True))
    src = jnp.take_along_axis(own, jnp.clip(at, 0, t - 1), axis=1)
    queries = jnp.where(live[:, :, None, None], move(q_ntqh, src), jnp.zeros((), q_ntqh.dtype))
    with jax.named_scope("fused_attention"):
        out = jax.nn.dot_product_attention(
            queries,
            move(keys, order),
            move(values, order),
            scale=scale,
            is_causal=True,
            query_seq_lengths=length,
            key_value_seq_lengths=length,
            local_window_size=None if window is None else (int(window) - 1, 0),
            implementation=implementation or fused_implementation(),
        )
    col = before + jnp.cumsum(real_nt, axis=1, dtype=jnp.int32) - 1  # new token -> column
    out = move(out, jnp.clip(col, 0, width - 1)).astype(dtype)
    return jnp.where(real_nt[:, :, None, None], out, jnp.zeros((), dtype))


def _compile_failure(call: Callable, args: tuple, key: tuple) -> str | None:
    """Whether `call(*args)` and its gradient compile on their own (None), else the error's
    first line; decided once per `key` (the call's static settings) and the arguments'
    shapes and dtypes. A compile-time refusal then falls back as a trace-time one does,
    instead of failing the compile of the whole step. The probe takes one row of each
    argument (every argument's leading axis is rows or groups of rows): what a kernel
    supports depends on lengths, heads and dtypes, not on the batch, and one row keeps the
    probe small and off the step's mesh."""
    key = (key, *((x.shape[1:], jnp.dtype(x.dtype)) for x in args))
    if key not in _PROBED:
        shapes = [jax.ShapeDtypeStruct((1, *x.shape[1:]), x.dtype) for x in args]
        floats = [i for i, x in enumerate(args) if jnp.issubdtype(x.dtype, jnp.floating)]

        def forward_and_back(*xs):
            def of_floats(*fs):
                ys = list(xs)
                for i, f in zip(floats, fs):
                    ys[i] = f
                return call(*ys)

            out, back = jax.vjp(of_floats, *(xs[i] for i in floats))
            return out, back(out)

        try:
            jax.jit(forward_and_back).lower(*shapes).compile()
            _PROBED[key] = None
        except Exception as e:  # any failure to build it: the call takes the unfused path
            _PROBED[key] = f"{type(e).__name__} at compile: {e}".splitlines()[0]
    return _PROBED[key]


def _try_fused(
    q, k, v, mask, implementation, window, scale, softcap, prefix=None, cache=None, self_keys=True
) -> Array | None:
    """`fused_attention` where `implementation` asks for it (`takes_fused`) and the call
    is one it takes (`fused_refusal`) and, where `PROBE_COMPILE` names the op's
    implementation, compiles; else None, the reason logged once."""
    if not takes_fused(implementation):
        return None
    earlier = sum(x[0].shape[-1] for x in (prefix, cache) if x is not None)
    why = fused_refusal(q, mask, window, softcap, earlier, decoding=not self_keys)
    impl = fused_implementation()
    if why is None:
        has = (prefix is not None, cache is not None)
        sets = [x for s in (prefix, cache) if s is not None for x in s]

        def call(q, k, v, key_seg, *sets):
            p, c = (tuple(sets[:3]) if has[0] else None), (tuple(sets[-3:]) if has[1] else None)
            return fused_attention(
                q, k, v, SelfMask(key_seg), prefix=p, cache=c,
                window=window, scale=scale, implementation=impl,
            )  # fmt: skip

        args = (q, k, v, mask.key_seg, *sets)
        try:
            if impl in PROBE_COMPILE:
                why = _compile_failure(call, args, (has, window, scale, impl))
            if why is None:
                return call(*args)
        except (ValueError, NotImplementedError, TypeError, RuntimeError) as e:
            why = f"{type(e).__name__}: {e}".splitlines()[0]
    _tell_once(f"attention: {implementation} falls back to einsum/blockwise for {why}")
    return None


# ----------------------------------------------------------------------------- einsum path


def attention(
    q_ntqh: Array,
    k_ntkh: Array,
    v_ntkh: Array,
    mask: SelfMask,
    *,
    implementation: str = "einsum",
    block: int | None = None,
    window: int | Array | None = None,
    scale: float | None = None,
    softcap: float | None = None,
) -> Array:
    """Grouped-query causal softmax(scale q k^T) v of T tokens among themselves.

    Args:
      q_ntqh: `[N, T, Q, H]` queries (Q = K * groups).
      k_ntkh: `[N, T, K, H]` keys.
      v_ntkh: `[N, T, K, H]` values.
      mask: `SelfMask` among the tokens.
      implementation: see the module docstring.
      block: the blockwise path's tile size (None: `default_block()`).
      window: sliding window (int or int32 scalar; needs `mask.positions`), or None.
      scale: the scores' scale; None: H ** -0.5.
      softcap: scores -> softcap * tanh(scores / softcap) before the mask, or None.

    Returns:
      `[N, T, Q, H]` in v's dtype.
    """
    t = q_ntqh.shape[1]
    fused = _try_fused(
        q_ntqh, k_ntkh, v_ntkh, mask, implementation, window, scale, softcap
    )  # fmt: skip
    if fused is not None:
        return fused
    if resolve(implementation, t, t) == "blockwise":
        return attention_with_cache(
            q_ntqh,
            k_ntkh,
            v_ntkh,
            mask,
            implementation="blockwise",
            block=block,
            window=window,
            scale=scale,
            softcap=softcap,
        )
    with jax.named_scope("einsum_attention"):
        h = q_ntqh.shape[-1]
        q = group_queries(q_ntqh, k_ntkh.shape[2])
        scores = jnp.einsum("nkgth,nskh->nkgts", q, k_ntkh, preferred_element_type=jnp.float32)
        scores = _scores(scores, h, scale, softcap)
        scores = jnp.where(mask.allowed(window)[:, None, None, :, :], scores, NEG_INF)
        probs = jax.nn.softmax(scores, axis=-1).astype(v_ntkh.dtype)
        return ungroup_heads(einsum_f32("nkgts,nskh->nkgth", probs, v_ntkh), v_ntkh.dtype)


class _KeySet(NamedTuple):
    """One set of keys in the einsum path of `attention_with_cache`: queries in its layout,
    keys and values, the slots each row's tokens may attend to (`[N, T or 1, S]`), the
    einsum specs of the scores and of the values' product, and the maps of its score layout
    to the rows' `[N, K, G, T, .]` and back."""

    q: Array
    k: Array
    v: Array
    allowed: Array
    scores: str
    values: str
    to_rows: Callable[[Array], Array] = lambda x: x
    from_rows: Callable[[Array], Array] = lambda x: x


def attention_with_cache(
    q_ntqh: Array,
    k_ntkh: Array,
    v_ntkh: Array,
    mask: SelfMask,
    *,
    cache: tuple[Array, Array, Array] | None = None,
    prefix: tuple[Array, Array, Array] | None = None,
    implementation: str = "einsum",
    block: int | None = None,
    window: int | Array | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    self_keys: bool = True,
) -> Array:
    """`attention` over the T new keys and those of a cache and/or a shared prefix, without
    concatenating them.

    One float32 softmax over all the key sets, so the result equals `attention` on the
    concatenated keys; the cache and the prefix are only read (decoding does not copy them).
    The prefix belongs to groups of J = N / B contiguous rows (the G samples of one prompt),
    so it is stored and read once per group, not once per row; its scores are one
    `[J*G*T, H] x [H, P]` product per (prompt, kv head).

    A sliding window needs the keys' positions; those of the prefix and the cache are not
    stored but derived: a row's prefix slots, then its cache slots, hold its sequence's
    earlier tokens in order, so a key's position is the number of allowed keys before it
    there, `cumsum(prefix allowed[b]) - 1` for the prefix and `count + cumsum(cache
    allowed[n]) - 1` for the cache (count: row n's group's allowed prefix keys, 0 without
    a prefix). The new tokens' `mask.positions` are to continue from there.

    Args:
      q_ntqh: `[N, T, Q, H]` queries of the new tokens.
      k_ntkh: `[N, T, K, H]` keys of the new tokens.
      v_ntkh: `[N, T, K, H]` values of the new tokens.
      mask: `SelfMask` among the new tokens.
      cache: (keys `[N, K, H, S]`, values `[N, K, S, H]`, allowed `[N, S]` bool): one layer
        of each row's own cache and the slots every new token may attend to.
      prefix: (keys `[B, K, H, P]`, values `[B, K, P, H]`, allowed `[B, P]` bool): one layer
        of the prefix cache row b's group shares (rows b*J .. b*J + J - 1).
      implementation: see the module docstring; `auto` decides on T and the total keys.
        A single new token (decoding) always takes the einsum path, whose memory is linear.
      block: the blockwise path's tile size (None: `default_block()`).
      window: sliding window (int or int32 scalar; needs `mask.positions`), or None.
      scale: the scores' scale; None: H ** -0.5.
      softcap: scores -> softcap * tanh(scores / softcap) before the mask, or None.
      self_keys: False when the new keys are in the cache already (written before the
        attention, their slots allowed): the new tokens attend to the cache (and prefix)
        only. Decoding one token (T = 1) only.

    Returns:
      `[N, T, Q, H]`.
    """
    t = q_ntqh.shape[1]
    if not self_keys and (t != 1 or cache is None):
        raise ValueError("self_keys=False needs one new token (T = 1) and a cache holding it")
    fused = _try_fused(
        q_ntqh, k_ntkh, v_ntkh, mask, implementation, window, scale, softcap, prefix, cache,
        self_keys,
    )  # fmt: skip
    if fused is not None:
        return fused
    s_total = t + sum(x[0].shape[-1] for x in (cache, prefix) if x is not None)
    if t > 1 and resolve(implementation, t, s_total) == "blockwise":
        with jax.named_scope("blockwise_attention"):
            return _blockwise_key_sets(
                q_ntqh, k_ntkh, v_ntkh, mask, cache, prefix, block, window, scale, softcap
            )
    with jax.named_scope("einsum_attention"):
        return _einsum_key_sets(
            q_ntqh, k_ntkh, v_ntkh, mask, cache, prefix, window, scale, softcap, self_keys
        )


def _einsum_key_sets(
    q_ntqh, k_ntkh, v_ntkh, mask, cache, prefix, window, scale, softcap, self_keys
):
    """`attention_with_cache` by one float32 softmax over the key sets' einsum scores."""
    t = q_ntqh.shape[1]
    h = q_ntqh.shape[-1]
    q = group_queries(q_ntqh, k_ntkh.shape[2])  # [N, K, G, T, H]
    n = q.shape[0]
    decoding = t == 1
    qpos = _window_positions(mask, window)
    p_pos, c_pos = (None, None) if window is None else _key_positions(cache, prefix, n)
    sets = []  # in the keys' sequence order: prefix, cache, new tokens
    if prefix is not None:
        pk, pv, p_allowed = prefix
        b = pk.shape[0]
        from_rows, to_rows = functools.partial(_to_groups, b=b), _to_rows
        specs = ("bkjgth,bkhs->bkjgts", "bkjgts,bksh->bkjgth")
        allowed = jnp.repeat(p_allowed, n // b, axis=0)[:, None, :]
        if window is not None:
            allowed = allowed & _within(p_pos, qpos, window)
        sets.append(_KeySet(from_rows(q), pk, pv, allowed, *specs, to_rows, from_rows))
    if cache is not None:
        ck, cv, c_allowed = cache
        specs = ("nkgth,nkhs->nkgts", "nkgts,nksh->nkgth")
        allowed = c_allowed[:, None, :]
        if window is not None:
            allowed = allowed & _within(c_pos, qpos, window)
        sets.append(_KeySet(q, ck, cv, allowed, *specs))
    if self_keys:
        specs = ("nkgth,nskh->nkgts", "nkgts,nskh->nkgth")
        sets.append(_KeySet(q, k_ntkh, v_ntkh, mask.allowed(window), *specs))

    zs = [jnp.einsum(x.scores, x.q, x.k, preferred_element_type=jnp.float32) for x in sets]
    score = lambda z: _scores(z, h, scale, softcap)
    if decoding:
        # One softmax over the sets side by side: XLA:CPU runs each reduction as a kernel of
        # its own, and a max and a sum per set cost more than concatenating these few scores
        # (a decode step at the TRL workload's shape: 7-10% slower with the sets reduced apart).
        z = jnp.concatenate([x.to_rows(z) for x, z in zip(sets, zs)], -1)
        masks = [jnp.broadcast_to(x.allowed, (n, t, x.allowed.shape[-1])) for x in sets]
        z = jnp.where(jnp.concatenate(masks, -1)[:, None, None], score(z), NEG_INF)
        cuts = np.cumsum([z.shape[-1] for z in zs[:-1]])
        probs = jnp.split(jax.nn.softmax(z, axis=-1), cuts, axis=-1)
        probs = [x.from_rows(p) for x, p in zip(sets, probs)]
    else:
        zs = [
            jnp.where(x.from_rows(x.allowed[:, None, None]), score(z), NEG_INF)
            for x, z in zip(sets, zs)
        ]
        m = functools.reduce(
            jnp.maximum, [x.to_rows(jnp.max(z, -1, keepdims=True)) for x, z in zip(sets, zs)]
        )
        es = [jnp.exp(z - x.from_rows(m)) for x, z in zip(sets, zs)]
        denom = functools.reduce(
            jnp.add, [x.to_rows(jnp.sum(e, -1, keepdims=True)) for x, e in zip(sets, es)]
        )
        probs = [e / x.from_rows(denom) for x, e in zip(sets, es)]
    # The partial sums accumulate in float32 and are rounded once: the sampler (prefix =
    # prompt, cache = completion so far, one new token) and the trainer (prefix = prompt, all
    # completion tokens new) split the same sum differently, and rounding each part to the
    # compute dtype would make the two paths disagree by an ulp of bf16 on every token.
    outs = [x.to_rows(einsum_f32(x.values, p.astype(x.v.dtype), x.v)) for x, p in zip(sets, probs)]
    out = functools.reduce(jnp.add, outs)
    return ungroup_heads(out, v_ntkh.dtype)


def _key_positions(cache, prefix, n):
    """The positions of the prefix's keys, `[N, P]` (per row), and of the cache's, `[N, S]`
    (None where there is none): `attention_with_cache`'s rule."""
    p_pos = c_pos = None
    count = 0
    if prefix is not None:
        p_allowed = jnp.asarray(prefix[2], jnp.int32)
        p_allowed = jnp.repeat(p_allowed, n // p_allowed.shape[0], axis=0)
        p_pos = jnp.cumsum(p_allowed, axis=-1) - 1
        count = jnp.sum(p_allowed, axis=-1, keepdims=True)
    if cache is not None:
        c_pos = count + jnp.cumsum(jnp.asarray(cache[2], jnp.int32), axis=-1) - 1
    return p_pos, c_pos


def _within(kpos, qpos, window):
    """`[N, T, S]` bool: the sliding window's rule, pos_q - pos_k < window, written as
    pos_k > pos_q - window (no overflow for a padded query's large position)."""
    return kpos[:, None, :] > qpos[:, :, None] - window


# ----------------------------------------------------------------------------- blockwise path


def _blockwise_key_sets(q_ntqh, k_ntkh, v_ntkh, mask, cache, prefix, block, window, scale, softcap):
    """`attention_with_cache` by one `flash_attention` over the key sets side by side.

    The prefix and cache keys of one layer are laid before each row's own keys (a copy of
    one layer's keys and values, `[N, P + S + T, K, H]`, linear in length), not attended
    apart and merged by their log-sum-exp: in bf16 each set's probabilities would then be
    rounded against its own normaliser rather than the whole softmax's, as the einsum path
    and the sampler round them, which left the shared-prompt trainer's bf16 logprobs twice
    as far from the sampler's (experiments/studies/bf16_logprob_agreement.py). The FLOPs are the
    same: every query meets every prefix key either way. With a window, the keys' positions
    are laid side by side too (`_key_positions`, then the new tokens')."""
    kv_heads = k_ntkh.shape[2]
    q = group_queries(q_ntqh, kv_heads)  # [N, K, G, T, H]
    n, t = q.shape[0], q.shape[3]
    keys, values, segs = [], [], []
    if prefix is not None:
        pk, pv, p_allowed = prefix
        j = n // pk.shape[0]
        keys.append(jnp.repeat(jnp.swapaxes(pk, 2, 3), j, axis=0))
        values.append(jnp.repeat(pv, j, axis=0))
        segs.append(jnp.repeat(jnp.asarray(p_allowed, jnp.int32), j, axis=0))
    if cache is not None:
        ck, cv, c_allowed = cache
        keys.append(jnp.swapaxes(ck, 2, 3))
        values.append(cv)
        segs.append(jnp.asarray(c_allowed, jnp.int32))
    if segs and mask.query_seg is not None:
        raise ValueError("packed rows (segment ids) take no prefix or cache")
    before = sum(x.shape[1] for x in segs)
    keys.append(jnp.swapaxes(k_ntkh, 1, 2))
    values.append(jnp.swapaxes(v_ntkh, 1, 2))
    segs.append(mask.key_seg)
    qpos = _window_positions(mask, window)
    kpos = None
    if qpos is not None:
        kpos = [x for x in (*_key_positions(cache, prefix, n), qpos) if x is not None]
        kpos = jnp.concatenate(kpos, axis=1)
    # Columns: the earlier sets' keys come before every new token (all readable by it).
    out, _ = flash_attention(
        q,
        jnp.concatenate(keys, axis=2),
        jnp.concatenate(values, axis=2),
        jnp.concatenate(segs, axis=1),
        mask.query_seg,
        before + jnp.arange(t, dtype=jnp.int32),
        jnp.arange(before + t, dtype=jnp.int32),
        query_parent=mask.query_parent,
        block=block,
        query_pos=qpos,
        key_pos=kpos,
        window=window,
        scale=scale,
        softcap=softcap,
    )
    return ungroup_heads(out, v_ntkh.dtype)


def _pad_to(x: Array, axis: int, size: int, value) -> Array:
    pad = size - x.shape[axis]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


def _tile_mask(kseg, qseg, qparent, kcol, qcol, kpos=None, qpos=None, window=None):
    """`[b, bq, bk]` bool: the module's rule on one tile (`qseg`, `qparent`, `qcol`,
    `window` None: not used)."""
    ok = (kseg > 0)[:, None, :]
    if qseg is not None:
        same = qseg[:, :, None] == kseg[:, None, :]
        if qparent is not None:
            same = same | (qparent[:, :, None] == kseg[:, None, :])
        ok = ok & same
    if qcol is not None:
        ok = ok & (kcol[None, None, :] <= qcol[None, :, None])
    if window is not None:
        ok = ok & _within(kpos, qpos, window)
    return ok


def flash_attention(
    q: Array,
    k: Array,
    v: Array,
    key_seg: Array,
    query_seg: Array | None = None,
    query_col: Array | None = None,
    key_col: Array | None = None,
    *,
    query_parent: Array | None = None,
    block: int | None = None,
    query_pos: Array | None = None,
    key_pos: Array | None = None,
    window: int | Array | None = None,
    scale: float | None = None,
    softcap: float | None = None,
) -> tuple[Array, Array]:
    """Memory-efficient attention of one key set: (out, log-sum-exp), both float32.

        s_ij = (capped) scale * q_i . k_j  where allowed(i, j) (module docstring), else excluded
        lse_i = log sum_j exp(s_ij),   out_i = sum_j exp(s_ij - lse_i) v_j

    computed over `[block, block]` tiles with a running max and sum (online softmax), so
    no `[T, S]` array exists; the custom VJP recomputes each tile in the backward pass and
    accepts a cotangent on `lse` too. Tiles the mask (the window included) leaves empty
    are skipped. A query that may read no key gets out = 0, lse = NEG_INF.

    Args:
      q: `[B, K, G, T, H]` queries (G query heads per key head).
      k: `[B, K, S, H]` keys.
      v: `[B, K, S, H]` values.
      key_seg: `[B, S]` int, 0 at keys nobody reads.
      query_seg: `[B, T]` int or None (see the module's rule).
      query_col: `[T]` int column indices for the causal rule (key_col <= query_col), or
        None (not causal; with key_col).
      key_col: `[S]` int column indices, or None (with query_col).
      query_parent: `[B, T]` int or None, with `query_seg` only (the module's rule).
      block: tile size along T and S (both are padded up to a multiple); None:
        `default_block()`.
      query_pos: `[B, T]` int positions of the queries, for the window only.
      key_pos: `[B, S]` int positions of the keys, for the window only.
      window: sliding window (int or int32 scalar; with both positions), or None.
      scale: the scores' scale; None: H ** -0.5.
      softcap: scores -> softcap * tanh(scores / softcap) before the mask, or None.

    Returns:
      (out `[B, K, G, T, H]` float32, lse `[B, K, G, T]` float32).
    """
    if (query_col is None) != (key_col is None):
        raise ValueError("query_col and key_col come together (causal) or not at all")
    t, s = q.shape[3], k.shape[2]
    block = default_block() if block is None else block
    bq, bk = min(block, t), min(block, s)
    tp, sp = -(-t // bq) * bq, -(-s // bk) * bk
    q = _pad_to(q, 3, tp, 0)
    k, v = _pad_to(k, 2, sp, 0), _pad_to(v, 2, sp, 0)
    key_seg = _pad_to(jnp.asarray(key_seg, jnp.int32), 1, sp, 0)
    if query_parent is not None and query_seg is None:
        raise ValueError("query_parent needs query_seg (packed rows)")
    if query_seg is not None:
        query_seg = _pad_to(jnp.asarray(query_seg, jnp.int32), 1, tp, -1)
    if query_parent is not None:
        query_parent = _pad_to(jnp.asarray(query_parent, jnp.int32), 1, tp, -1)
    if query_col is not None:
        # Padded queries sit after every key; padded keys are excluded by key_seg.
        query_col = _pad_to(jnp.asarray(query_col, jnp.int32), 0, tp, np.iinfo(np.int32).max)
        key_col = _pad_to(jnp.asarray(key_col, jnp.int32), 0, sp, 0)
    if window is None:
        query_pos = key_pos = None
    else:
        if query_pos is None or key_pos is None:
            raise ValueError("a window needs query_pos and key_pos")
        # Padded queries sit far after every key (outside the window: they read none).
        big = np.iinfo(np.int32).max
        query_pos = _pad_to(jnp.asarray(query_pos, jnp.int32), 1, tp, big)
        key_pos = _pad_to(jnp.asarray(key_pos, jnp.int32), 1, sp, 0)
        window = jnp.asarray(window, jnp.int32)
    segs = (key_seg, query_seg, query_parent, key_pos, query_pos, window)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out, lse = _flash(q, k, v, segs, query_col, key_col, (bq, bk), scale, softcap)
    return out[:, :, :, :t], lse[:, :, :, :t]


def _q_tiles(x, bq, axis):
    """Split `axis` into tiles of bq and move the tile index to the front."""
    shape = x.shape
    x = x.reshape(*shape[:axis], shape[axis] // bq, bq, *shape[axis + 1 :])
    return jnp.moveaxis(x, axis, 0)


def _from_q_tiles(x, axis):
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(*x.shape[:axis], x.shape[axis] * x.shape[axis + 1], *x.shape[axis + 2 :])


class _Tiles(NamedTuple):
    """The operands split into tiles, tile index first."""

    q: Array  # [nq, B, K, G, bq, H]
    k: Array  # [nk, B, K, bk, H]
    v: Array  # [nk, B, K, bk, H]
    kseg: Array  # [nk, B, bk]
    qseg: Array | None  # [nq, B, bq]
    qparent: Array | None  # [nq, B, bq]
    qcol: Array | None  # [nq, bq]
    kcol: Array | None  # [nk, bk]
    kpos: Array | None  # [nk, B, bk]
    qpos: Array | None  # [nq, B, bq]
    window: Array | None  # [] (not tiled)


def _tiles(q, k, v, segs, qcol, kcol, bq, bk) -> _Tiles:
    kseg, qseg, qparent, kpos, qpos, window = segs
    maybe = lambda x, b, axis: None if x is None else _q_tiles(x, b, axis)
    return _Tiles(
        _q_tiles(q, bq, 3),
        _q_tiles(k, bk, 2),
        _q_tiles(v, bk, 2),
        _q_tiles(kseg, bk, 1),
        maybe(qseg, bq, 1),
        maybe(qparent, bq, 1),
        maybe(qcol, bq, 0),
        maybe(kcol, bk, 0),
        maybe(kpos, bk, 1),
        maybe(qpos, bq, 1),
        window,
    )


def _tile_mask_at(tiles: _Tiles, i, j):
    """Tile (i, j)'s mask `[B, 1, 1, bq, bk]`."""
    pick = lambda x, idx: None if x is None else x[idx]
    ok = _tile_mask(
        tiles.kseg[j],
        pick(tiles.qseg, i),
        pick(tiles.qparent, i),
        pick(tiles.kcol, j),
        pick(tiles.qcol, i),
        pick(tiles.kpos, j),
        pick(tiles.qpos, i),
        tiles.window,
    )
    return ok[:, None, None]


def _span(x, axis, real):
    """(min, max) of `x` over `axis` where `real`, as int32 (empty: (big, -big))."""
    big = np.iinfo(np.int32).max
    return jnp.min(jnp.where(real, x, big), axis), jnp.max(jnp.where(real, x, -big), axis)


def _live_pairs(tiles: _Tiles, *, key_major: bool):
    """The tiles (i, j) the mask may allow something in, as (i, j, count): `[nq * nk]`
    int32 index arrays whose first `count` entries are those tiles, q tile by q tile (or
    k tile by k tile with `key_major`). From per-tile summaries, a superset of the exact
    set: a tile passes when its key segments' range meets its queries' own (or parent)
    segments' range, its first key column is not after its last query column, and (with
    a window) its last real key's position is within the window of its first query's, in
    some row; segment ids run in order along a packed row, so ranges meet wherever ids
    match. Empty tiles (the causal upper triangle, other sequences of a packed row,
    padding, keys out of every query's window) are not visited at all."""
    nq, nk = tiles.q.shape[0], tiles.k.shape[0]
    kmin, kmax = _span(tiles.kseg, -1, tiles.kseg > 0)  # [nk, B]
    ok = jnp.broadcast_to((kmax > 0)[None], (nq, *kmax.shape))  # [nq, nk, B]
    if tiles.qseg is not None:
        qmin, qmax = _span(tiles.qseg, -1, tiles.qseg > 0)  # [nq, B]
        meets = (kmin[None] <= qmax[:, None]) & (kmax[None] >= qmin[:, None])
        if tiles.qparent is not None:
            pmin, pmax = _span(tiles.qparent, -1, tiles.qparent > 0)
            meets = meets | (kmin[None] <= pmax[:, None]) & (kmax[None] >= pmin[:, None])
        ok = ok & meets
    if tiles.window is not None:
        assert tiles.kpos is not None and tiles.qpos is not None  # given with the window
        _, kpos_max = _span(tiles.kpos, -1, tiles.kseg > 0)  # [nk, B]
        ok = ok & (kpos_max[None] > jnp.min(tiles.qpos, -1)[:, None] - tiles.window)
    ok = jnp.any(ok, axis=-1)  # [nq, nk]
    if tiles.qcol is not None:
        assert tiles.kcol is not None  # flash_attention takes both column sets or neither
        ok = ok & (jnp.min(tiles.kcol, -1)[None, :] <= jnp.max(tiles.qcol, -1)[:, None])
    flat = (ok.T if key_major else ok).reshape(-1)
    (idx,) = jnp.nonzero(flat, size=flat.shape[0], fill_value=0)
    outer, inner = idx // (nq if key_major else nk), idx % (nq if key_major else nk)
    i, j = (inner, outer) if key_major else (outer, inner)
    return i.astype(jnp.int32), j.astype(jnp.int32), jnp.sum(flat, dtype=jnp.int32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _flash(q, k, v, segs, qcol, kcol, blocks, scale, softcap):
    return _flash_fwd(q, k, v, segs, qcol, kcol, blocks, scale, softcap)[0]


def _flash_fwd(q, k, v, segs, qcol, kcol, blocks, scale, softcap):
    bq, bk = blocks
    tiles = _tiles(q, k, v, segs, qcol, kcol, bq, bk)
    stats = tiles.q.shape[:-1]  # [nq, B, K, G, bq]
    pair_i, pair_j, count = _live_pairs(tiles, key_major=False)
    # Values below float32 (bf16): the probabilities are rounded to their dtype for the
    # product with v. Rounded unnormalised against a running maximum they round differently
    # from the einsum path's (and the sampler's) normalised softmax, which put the trainer's
    # bf16 logprobs 4x further from the sampler's (experiments/studies/bf16_logprob_agreement.py).
    # So a first pass finds each query's log-sum-exp and the second rounds exp(s - lse),
    # the normalised probabilities, as the einsum path does: one more q k^T per tile.
    two_pass = v.dtype != jnp.float32

    def scores(c):
        i, j = pair_i[c], pair_j[c]
        ok = _tile_mask_at(tiles, i, j)
        s = einsum_f32("bkgqh,bksh->bkgqs", tiles.q[i], tiles.k[j])
        s = _scores(s, q.shape[-1], scale, softcap)
        return i, j, ok, jnp.where(ok, s, NEG_INF)

    def online(c, carry):
        m, total, acc = carry
        i, j, ok, s = scores(c)
        m_i = m[i]
        m_new = jnp.maximum(m_i, jnp.max(s, axis=-1))
        p = jnp.where(ok, jnp.exp(s - m_new[..., None]), 0.0)
        corr = jnp.exp(m_i - m_new)
        m, total = m.at[i].set(m_new), total.at[i].set(total[i] * corr + jnp.sum(p, axis=-1))
        if acc is None:
            return m, total, None
        pv = einsum_f32("bkgqs,bksh->bkgqh", p.astype(v.dtype), tiles.v[j])
        return m, total, acc.at[i].set(acc[i] * corr[..., None] + pv)

    zeros = jnp.zeros((*stats, v.shape[-1]), jnp.float32)
    init = (jnp.full(stats, NEG_INF, jnp.float32), jnp.zeros(stats, jnp.float32))
    m, total, acc = _loop(count, online, (*init, None if two_pass else zeros))
    safe = total > 0
    total = jnp.where(safe, total, 1.0)
    lse = jnp.where(safe, m + jnp.log(total), NEG_INF)
    if two_pass:

        def normalised(c, acc):
            i, j, ok, s = scores(c)
            p = jnp.where(ok, jnp.exp(s - lse[i][..., None]), 0.0)
            return acc.at[i].add(einsum_f32("bkgqs,bksh->bkgqh", p.astype(v.dtype), tiles.v[j]))

        out = _loop(count, normalised, zeros)
    else:
        out = jnp.where(safe[..., None], acc / total[..., None], 0.0)
    out, lse = _from_q_tiles(out, 3), _from_q_tiles(lse, 3)
    return (out, lse), (q, k, v, segs, qcol, kcol, out, lse)


def _loop(n, body, init):
    """`body(c, carry)` for c in 0..n-1 (n may be traced) as a `while_loop`, not a scan:
    with the forward's tile loop as a scan, differentiating the decoder's layer scan kept
    every tile's scores, `[nq, nk, ..., bq, bk]` float32, in the compiled program (jax 0.10:
    21 GB of scratch for one layer at T = 16,384, against 89 MB for the same attention
    outside a scan). A while loop has no reverse-mode rule, so nothing of it can be kept;
    the custom VJP is the way back."""

    def step(carry):
        c, x = carry
        return c + 1, body(c, x)

    return jax.lax.while_loop(lambda carry: carry[0] < n, step, (jnp.int32(0), init))[1]


def _flash_bwd(blocks, scale, softcap, res, cotangents):
    q, k, v, segs, qcol, kcol, out, lse = res
    d_out, d_lse = cotangents
    bq, bk = blocks
    tiles = _tiles(q, k, v, segs, qcol, kcol, bq, bk)
    d_out = d_out.astype(jnp.float32)
    # delta_i = sum_h dO_ih O_ih: the softmax Jacobian's row term. A cotangent on lse adds
    # d_lse_i p_ij to ds_ij (d lse_i / d s_ij = p_ij).
    delta = jnp.sum(d_out * out, axis=-1) - d_lse.astype(jnp.float32)
    do_t, lse_t, delta_t = _q_tiles(d_out, bq, 3), _q_tiles(lse, bq, 3), _q_tiles(delta, bq, 3)
    pair_i, pair_j, count = _live_pairs(tiles, key_major=True)

    def visit(c, carry):
        dq, dk, dv = carry
        i, j = pair_i[c], pair_j[c]
        ok = _tile_mask_at(tiles, i, j)
        qi, kj, vj = tiles.q[i], tiles.k[j], tiles.v[j]
        s = einsum_f32("bkgqh,bksh->bkgqs", qi, kj) * scale
        if softcap is not None:
            cap = jnp.tanh(s / softcap)
            s = softcap * cap
        p = jnp.where(ok, jnp.exp(s - lse_t[i][..., None]), 0.0)
        dp = einsum_f32("bkgqh,bksh->bkgqs", do_t[i], vj)
        ds = p * (dp - delta_t[i][..., None]) * scale
        if softcap is not None:  # d/ds of softcap tanh(s / softcap)
            ds = ds * (1.0 - cap * cap)
        return (
            dq.at[i].add(einsum_f32("bkgqs,bksh->bkgqh", ds, kj)),
            dk.at[j].add(einsum_f32("bkgqs,bkgqh->bksh", ds, qi)),
            dv.at[j].add(einsum_f32("bkgqs,bkgqh->bksh", p.astype(v.dtype), do_t[i])),
        )

    zeros = lambda x: jnp.zeros(x.shape, jnp.float32)
    dq, dk, dv = _loop(count, visit, (zeros(tiles.q), zeros(tiles.k), zeros(tiles.v)))
    dq = _from_q_tiles(dq, 3).astype(q.dtype)
    dk = _from_q_tiles(dk, 2).astype(k.dtype)
    dv = _from_q_tiles(dv, 2).astype(v.dtype)
    return dq, dk, dv, jax.tree.map(lambda _: None, segs), None, None


def _flash_fwd_rule(q, k, v, segs, qcol, kcol, blocks, scale, softcap):
    return _flash_fwd(q, k, v, segs, qcol, kcol, blocks, scale, softcap)


_flash.defvjp(_flash_fwd_rule, _flash_bwd)
