"""Per-token log-probabilities, entropy and exact full-vocabulary KL, from logits or hidden states.

Each quantity comes in two forms (the forward KL and generalised JSD of
`divergence_from_hidden`, for distillation, in the second only):

* from logits `[..., V]` (`token_logprobs`, `entropy`, `full_kl`): plain `jnp`, for small
  vocabularies, for callers that already hold logits, and as the reference the chunked forms
  are tested against;
* from the last hidden state `[..., D]` and the LM-head matrix `[D, V]` (`*_from_hidden`):
  logits are produced one tile of `chunk_size` tokens x `vocab_chunk_size` vocabulary entries
  at a time, reduced with an online log-sum-exp, and differentiated by a `jax.custom_vjp`
  whose backward recomputes each tile. No `[N, T, V]` array exists in the forward or the
  backward pass: besides arrays the size of the inputs, the working set is a few tiles.

All math is float32 whatever the input dtype; cotangents come back in the input dtypes. On
an accelerator, a tile's logits multiply bfloat16 (or float16) hidden states and LM head as
they are, accumulating in float32: a product of two 16-bit floats is exact in float32, so this
is the float32 product of the upcast operands up to summation order, at the matrix units'
16-bit rate. XLA:CPU has no faster 16-bit matmul, so there the operands are upcast first.
A final-logit soft-cap c (Gemma 2's, `softcap=`) maps each tile's logits to c tanh(logits / c)
before the temperature, in every form and its backward. Ragged sizes are handled without
padding: the last chunk along each axis is shifted back to stay in bounds and the
rows/columns it shares with the previous chunk are masked out, so the `[D, V]` LM head is
never copied.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax

from grpojax.ops.checks import check_int, check_number
from grpojax.ops.sharding import in_auto_mode, leading_spec

# From experiments/bench/bench_logprobs.py on a 2-core CPU (V=151,936, N*T=8,192, D=896): tiles
# from 512 x 4096 to 1024 x 8192 cost the same CPU time (smaller or thinner tiles are up to
# 10% slower); the larger one suits accelerators better, and its 32 MiB float32 tile is
# still small next to the LM head itself.
DEFAULT_CHUNK_SIZE = 1024
DEFAULT_VOCAB_CHUNK_SIZE = 8192

_F32 = jnp.float32


# ----------------------------------------------------------------------------------------
# From logits
# ----------------------------------------------------------------------------------------


def _check_temperature(temperature) -> None:
    check_number("temperature", temperature, minimum=0, strict=True)


def _check_mask(mask, shape, name="mask_nt") -> None:
    if mask is not None and tuple(jnp.shape(mask)) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(jnp.shape(mask))}")


def _apply_mask(x, mask):
    return x if mask is None else jnp.where(jnp.asarray(mask, jnp.bool_), x, 0.0)


def _select_rows(logits_ntv, mask):
    """Float32 logits with masked rows set to 0 *before* any arithmetic: a NaN or inf there
    would otherwise reach the gradient through `log_softmax` even though its output is
    masked (the `jnp.where` gradient trap)."""
    z = logits_ntv.astype(_F32)
    if mask is None:
        return z
    return jnp.where(jnp.asarray(mask, jnp.bool_)[..., None], z, 0.0)


def token_logprobs(logits_ntv: Array, tokens_nt: Array, *, temperature: float = 1.0) -> Array:
    """Log-probability of each chosen token under softmax(logits / temperature), in float32.

        z = logits / temperature
        logp[n, t] = z[n, t, tokens[n, t]] - logsumexp_v z[n, t, v]

    No shift inside: `logits_ntv[:, t]` must be the logits that predict `tokens_nt[:, t]`
    (a causal model's output at the position before it: `logits[:, :-1]`, `ids[:, 1:]`).

    Args:
      logits_ntv: `[N, T, V]` logits, any float dtype (any leading dims `[..., V]`).
      tokens_nt: `[N, T]` integer token ids in `[0, V)` (same leading dims as the logits).
      temperature: sampling temperature, > 0.

    Returns:
      `[N, T]` float32 log-probabilities.

    Examples:
      >>> import jax.numpy as jnp
      >>> import numpy as np
      >>> import grpojax as gj
      >>> logits = jnp.log(jnp.array([[[1.0, 1.0, 2.0], [1.0, 2.0, 1.0]]]))  # [N=1, T=2, V=3]
      >>> tokens = jnp.array([[2, 0]])  # probabilities 2/4 and 1/4
      >>> print(np.round(np.asarray(gj.token_logprobs(logits, tokens)), 4))
      [[-0.6931 -1.3863]]
    """
    _check_temperature(temperature)
    if tuple(tokens_nt.shape) != tuple(logits_ntv.shape[:-1]):
        raise ValueError(
            f"tokens_nt shape {tuple(tokens_nt.shape)} must equal logits_ntv shape without "
            f"the vocabulary axis, {tuple(logits_ntv.shape[:-1])}"
        )
    z = logits_ntv.astype(_F32) / temperature
    lse = jax.nn.logsumexp(z, axis=-1)
    target = jnp.take_along_axis(z, tokens_nt[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return target - lse


def _safe_plogp(logp):
    # Double `where` so that vocabulary entries with p = 0 (logit -inf) give 0 and a zero
    # gradient, instead of 0 * -inf = NaN.
    finite = jnp.isfinite(logp)
    safe = jnp.where(finite, logp, 0.0)
    return finite, safe


def entropy(logits_ntv: Array, mask_nt: Array | None = None, *, temperature: float = 1.0) -> Array:
    """Per-token entropy of softmax(logits / temperature), in float32.

        p = softmax(logits / temperature)
        H[n, t] = -sum_v p[n, t, v] log p[n, t, v]        (0 where mask is false)

    Args:
      logits_ntv: `[N, T, V]` logits, any float dtype (any leading dims).
      mask_nt: optional `[N, T]` bool/{0,1} mask; masked positions give 0 and no gradient,
        whatever the logits hold there (NaN and inf included).
      temperature: > 0.

    Returns:
      `[N, T]` float32 entropies (nats).

    Examples:
      >>> import jax.numpy as jnp
      >>> import numpy as np
      >>> import grpojax as gj
      >>> logits = jnp.log(jnp.array([[[1.0, 1.0, 1.0], [1.0, 1.0, 2.0]]]))  # [N=1, T=2, V=3]
      >>> print(np.round(np.asarray(gj.entropy(logits)), 4))  # log 3, and 1.5 log 2
      [[1.0986 1.0397]]
    """
    _check_temperature(temperature)
    _check_mask(mask_nt, logits_ntv.shape[:-1])
    logp = jax.nn.log_softmax(_select_rows(logits_ntv, mask_nt) / temperature, axis=-1)
    finite, safe = _safe_plogp(logp)
    h = -jnp.sum(jnp.where(finite, jnp.exp(safe) * safe, 0.0), axis=-1)
    return _apply_mask(h, mask_nt)


def full_kl(
    logits_ntv: Array,
    ref_logits_ntv: Array,
    mask_nt: Array | None = None,
    *,
    temperature: float = 1.0,
) -> Array:
    """Exact per-token KL(pi || pi_ref) over the whole vocabulary, in float32.

        p = softmax(logits / temperature),  q = softmax(ref_logits / temperature)
        KL[n, t] = sum_v p[n, t, v] (log p[n, t, v] - log q[n, t, v])   (0 where masked)

    Differentiable w.r.t. both arguments (wrap the reference in `jax.lax.stop_gradient` to
    treat it as a constant). Rounding can make the sum a hair below zero; it is clamped at 0.

    Args:
      logits_ntv: `[N, T, V]` policy logits.
      ref_logits_ntv: `[N, T, V]` reference logits.
      mask_nt: optional `[N, T]` mask; masked positions give 0 and no gradient, whatever
        the logits hold there.
      temperature: > 0, applied to both.

    Returns:
      `[N, T]` float32, >= 0.

    Examples:
      >>> import jax.numpy as jnp
      >>> import numpy as np
      >>> import grpojax as gj
      >>> logits = jnp.log(jnp.array([[[1.0, 1.0, 2.0], [1.0, 1.0, 1.0]]]))
      >>> ref_logits = jnp.zeros((1, 2, 3))  # uniform: KL = log 3 - entropy
      >>> print(np.round(np.asarray(gj.full_kl(logits, ref_logits)), 4))
      [[0.0589 0.    ]]
    """
    _check_temperature(temperature)
    if logits_ntv.shape != ref_logits_ntv.shape:
        raise ValueError(
            f"logits_ntv {tuple(logits_ntv.shape)} and ref_logits_ntv "
            f"{tuple(ref_logits_ntv.shape)} must have the same shape"
        )
    _check_mask(mask_nt, logits_ntv.shape[:-1])
    logp = jax.nn.log_softmax(_select_rows(logits_ntv, mask_nt) / temperature, axis=-1)
    logq = jax.nn.log_softmax(_select_rows(ref_logits_ntv, mask_nt) / temperature, axis=-1)
    finite, safe = _safe_plogp(logp)
    terms = jnp.where(finite, jnp.exp(safe) * (safe - jnp.where(finite, logq, 0.0)), 0.0)
    kl = jnp.maximum(jnp.sum(terms, axis=-1), 0.0)
    return _apply_mask(kl, mask_nt)


# ----------------------------------------------------------------------------------------
# Tiled engine: online row statistics (forward) and tile-by-tile backprop (backward)
# ----------------------------------------------------------------------------------------


class _Cfg(NamedTuple):
    """Static description of the tiling; hashable, passed as a nondiff custom_vjp argument."""

    m: int  # rows (tokens) after folding the leading dims
    v: int  # vocabulary
    c: int  # token chunk, <= m
    vc: int  # vocabulary chunk, <= v
    temperature: float | None  # a static temperature; None: a traced one, passed as `tau`
    precision: Any
    narrow_logits: bool  # 16-bit operands of the logits matmuls stay 16-bit (accelerators)
    # Each pair's final-logit soft-cap c (Gemma 2): logits -> c tanh(logits / c); None: none.
    softcaps: tuple[float | None, ...] = (None, None)

    @property
    def k(self) -> int:
        return -(-self.m // self.c)

    @property
    def j(self) -> int:
        return -(-self.v // self.vc)


def _chunk(i, size: int, total: int):
    """Start of chunk `i` and which of its `size` entries are new (not in chunk `i - 1`)."""
    nominal = i * size
    start = jnp.minimum(nominal, total - size)
    return start, start + jnp.arange(size) >= nominal


def _narrow_logit_operands() -> bool:
    """Whether 16-bit logits operands stay 16-bit: on an accelerator, not on XLA:CPU (where a
    bfloat16 matmul is slower than the float32 one of the upcast operands)."""
    return jax.default_backend() != "cpu"


def _logit_dtype(cfg: _Cfg, h, w):
    """Operand dtype of one (hidden, head) pair's logits matmuls: their own 16-bit float type
    when `cfg.narrow_logits` and both share it (exact products, float32 accumulation), else
    float32."""
    if cfg.narrow_logits and h.dtype == w.dtype and jnp.finfo(h.dtype).bits == 16:
        return h.dtype
    return _F32


def _scale(cfg: _Cfg, x: Array, tau) -> Array:
    """`x / temperature`: the static one (skipped at 1.0), else the traced `tau` (0-d f32)."""
    if tau is not None:
        return x / tau
    assert cfg.temperature is not None, "a traced temperature comes as tau"
    return x if cfg.temperature == 1.0 else x / cfg.temperature


def _softcap(x: Array, cap: float | None) -> Array:
    """Final-logit soft-capping, cap * tanh(x / cap) (None: x)."""
    return x if cap is None else cap * jnp.tanh(x / cap)


def _uncap(dl: Array, z: Array, cfg: _Cfg, tau, cap: float | None) -> Array:
    """The cotangent `dl` of soft-capped logits as the raw logits': times d softcap(x) / dx
    = 1 - tanh(x / cap)^2, at the logits whose capped value over the temperature is `z`
    (`dl` itself without a cap)."""
    if cap is None:
        return dl
    temperature = tau if tau is not None else cfg.temperature
    assert temperature is not None  # a static one, or the traced tau
    capped = z * temperature
    return dl * (1.0 - jnp.square(capped / cap))


def _tile_logits(cfg: _Cfg, h_cd: Array, w_dv: Array, tau, pair: int = 0) -> Array:
    """`[C, Vc]` float32 logits (soft-capped when pair `pair` has a cap, then over the
    temperature) of one tile, accumulated in float32."""
    z = jnp.matmul(h_cd, w_dv, precision=cfg.precision, preferred_element_type=_F32)
    return _scale(cfg, _softcap(z, cfg.softcaps[pair]), tau)


def _slice_rows(x, start, size):
    return lax.dynamic_slice_in_dim(x, start, size, axis=0)


def _row_stats(cfg: _Cfg, pairs, init, update, tau):
    """Fold `update` over every tile; the state is a tuple of `[M]` float32 row statistics.

    Vocabulary chunks form the outer loop: each `[D, Vc]` slice of the LM head is read once
    and the (usually smaller) hidden states are re-read, which is the cheaper order when
    V > N*T, and lets the backward write each `[D, Vc]` block of d lm_head once.

    `pairs` is `((hidden_md, lm_head_dv), ...)`: one tile of logits is made per pair (the
    policy, and for KL the reference). `update(state_c, z_tiles, col_ok_v)` returns the new
    per-row state of the chunk; rows shared with the previous token chunk keep their state.
    """

    dts = [_logit_dtype(cfg, h, w) for h, w in pairs]

    def outer(j, state):
        c0, col_ok = _chunk(j, cfg.vc, cfg.v)
        ws = [
            lax.dynamic_slice_in_dim(w, c0, cfg.vc, axis=1).astype(dt)
            for (_, w), dt in zip(pairs, dts)
        ]

        def inner(k, state):
            r0, row_ok = _chunk(k, cfg.c, cfg.m)
            zs = [
                _tile_logits(cfg, _slice_rows(h, r0, cfg.c).astype(dt), w, tau, i)
                for i, ((h, _), w, dt) in enumerate(zip(pairs, ws, dts))
            ]
            old = [_slice_rows(x, r0, cfg.c) for x in state]
            new = update(old, zs, col_ok)
            return tuple(
                lax.dynamic_update_slice_in_dim(x, jnp.where(row_ok, n, o), r0, axis=0)
                for x, n, o in zip(state, new, old)
            )

        return lax.fori_loop(0, cfg.k, inner, state)

    return lax.fori_loop(0, cfg.j, outer, tuple(init))


def _backprop(cfg: _Cfg, pairs, row_vals, row_mask_m, dz_fn, tau):
    """Cotangents of the first pair's hidden `[M, D]` and LM head `[D, V]` (float32), and
    `sum(dz * z)` over every tile of every pair, dz the cotangent of z (the temperature's
    cotangent is `-sum(dz * z) / tau`, as d(logits / tau) / d tau = -z / tau; summed only
    for a traced `tau`, else 0).

    `dz_fn(z_tiles, vals_c)` gives the cotangents `[C, Vc]` of the pairs' scaled logits
    z = logits / temperature for one tile (a list; the first pair's first, the others only
    where a traced temperature needs them), from the tile(s) of z and the chunk's slice of
    each `[M]` array in `row_vals`. Each tile is recomputed here, never stored.
    """
    h0, w0 = pairs[0]
    d_model, vocab = w0.shape
    dts = [_logit_dtype(cfg, h, w) for h, w in pairs]

    def outer(j, carry):
        d_h, d_w, zdz = carry
        c0, col_ok = _chunk(j, cfg.vc, cfg.v)
        ws = [lax.dynamic_slice_in_dim(w, c0, cfg.vc, axis=1) for _, w in pairs]
        w0_c = ws[0].astype(_F32)  # the cotangent matmuls are float32: dl is float32
        ws = [w.astype(dt) for w, dt in zip(ws, dts)]

        def inner(k, carry):
            d_h, d_wj, zdz = carry
            r0, row_ok = _chunk(k, cfg.c, cfg.m)
            if row_mask_m is not None:
                row_ok = row_ok & _slice_rows(row_mask_m, r0, cfg.c)
            hs = [_slice_rows(h, r0, cfg.c) for h, _ in pairs]
            zs = [
                _tile_logits(cfg, h.astype(dt), w, tau, i)
                for i, (h, w, dt) in enumerate(zip(hs, ws, dts))
            ]
            # A masked row may hold non-finite values (0 * nan = nan in the matmul).
            h0_c = hs[0].astype(_F32)
            if row_mask_m is not None:
                h0_c = jnp.where(row_ok[:, None], h0_c, 0.0)
            ok = row_ok[:, None] & col_ok[None, :]
            dzs = dz_fn(zs, [_slice_rows(v, r0, cfg.c) for v in row_vals])
            dz = jnp.where(ok, dzs[0], 0.0)
            if tau is not None:
                zdz = zdz + sum(jnp.sum(jnp.where(ok, d * z, 0.0)) for d, z in zip(dzs, zs))
            dl = _uncap(_scale(cfg, dz, tau), zs[0], cfg, tau, cfg.softcaps[0])
            d_hc = _slice_rows(d_h, r0, cfg.c) + jnp.matmul(dl, w0_c.T, precision=cfg.precision)
            d_h = lax.dynamic_update_slice_in_dim(d_h, d_hc, r0, axis=0)
            d_wj = d_wj + jnp.matmul(h0_c.T, dl, precision=cfg.precision)
            return d_h, d_wj, zdz

        init = (d_h, jnp.zeros((d_model, cfg.vc), _F32), zdz)
        d_h, d_wj, zdz = lax.fori_loop(0, cfg.k, inner, init)
        d_w_old = lax.dynamic_slice_in_dim(d_w, c0, cfg.vc, axis=1)
        d_w = lax.dynamic_update_slice_in_dim(d_w, d_w_old + d_wj, c0, axis=1)
        return d_h, d_w, zdz

    init = (
        jnp.zeros((cfg.m, h0.shape[-1]), _F32),
        jnp.zeros((d_model, vocab), _F32),
        jnp.zeros((), _F32),
    )
    return lax.fori_loop(0, cfg.j, outer, init)


def _tau_cotangent(zdz: Array, tau):
    """d/dtau of a function of z = logits / tau, from `sum(dz * z)` (None: static tau)."""
    return None if tau is None else -zdz / tau


def _lse_init(m: int):
    return (jnp.full((m,), -jnp.inf, _F32), jnp.zeros((m,), _F32))


def _lse_update(state, zs, col_ok):
    """Online log-sum-exp: running max `mx` and sum of exp(z - mx)."""
    mx, s = state
    z = jnp.where(col_ok, zs[0], -jnp.inf)
    mx_new = jnp.maximum(mx, jnp.max(z, axis=-1))
    s_new = s * jnp.exp(mx - mx_new) + jnp.sum(jnp.exp(z - mx_new[:, None]), axis=-1)
    return mx_new, s_new


def _gather_columns(w_dv: Array, tokens_m: Array) -> Array:
    """`[M, D]` float32 rows of the LM head for each token (the size of the hidden state)."""
    return jnp.take(w_dv, tokens_m, axis=1).T.astype(_F32)


# ----------------------------------------------------------------------------------------
# Chunked log-probabilities
# ----------------------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _logprobs_md(cfg: _Cfg, h_md, w_dv, tokens_m, tau):
    return _logprobs_fwd(cfg, h_md, w_dv, tokens_m, tau)[0]


def _logprobs_fwd(cfg, h_md, w_dv, tokens_m, tau):
    mx, s = _row_stats(cfg, [(h_md, w_dv)], _lse_init(cfg.m), _lse_update, tau)
    lse = mx + jnp.log(s)
    # Target logit straight from its LM-head column: an [M, D] gather, no [M, V] one-hot.
    target = jnp.sum(h_md.astype(_F32) * _gather_columns(w_dv, tokens_m), axis=-1)
    target = _scale(cfg, _softcap(target, cfg.softcaps[0]), tau)
    return target - lse, (h_md, w_dv, tokens_m, lse, target, tau)


def _logprobs_bwd(cfg, res, g_m):
    h_md, w_dv, tokens_m, lse, target, tau = res
    g_m = g_m.astype(_F32)

    # d logp / d z_v = onehot(token)_v - p_v: the softmax part tile by tile ...
    def dz_fn(zs, vals):
        lse_c, g_c = vals
        return [-g_c[:, None] * jnp.exp(zs[0] - lse_c[:, None])]

    d_h, d_w, zdz = _backprop(cfg, [(h_md, w_dv)], (lse, g_m), None, dz_fn, tau)
    # ... and the one-hot part as a gather / scatter-add of M columns.
    a_m = _uncap(_scale(cfg, g_m, tau), target, cfg, tau, cfg.softcaps[0])
    d_h = d_h + a_m[:, None] * _gather_columns(w_dv, tokens_m)
    d_w = d_w.at[:, tokens_m].add((a_m[:, None] * h_md.astype(_F32)).T)
    d_tau = _tau_cotangent(zdz + jnp.sum(g_m * target), tau)
    return d_h.astype(h_md.dtype), d_w.astype(w_dv.dtype), None, d_tau


_logprobs_md.defvjp(_logprobs_fwd, _logprobs_bwd)


def _check_chunks(chunk_size, vocab_chunk_size) -> None:
    for name, value in (("chunk_size", chunk_size), ("vocab_chunk_size", vocab_chunk_size)):
        check_int(name, value)


def _check_hidden(hidden, lm_head, name="hidden_ntd", head_name="lm_head_dv") -> None:
    if lm_head.ndim != 2:
        raise ValueError(f"{head_name} must be [D, V] (rank 2), got shape {tuple(lm_head.shape)}")
    if hidden.ndim < 1 or hidden.shape[-1] != lm_head.shape[0]:
        raise ValueError(
            f"{name} last axis (D) must equal {head_name}.shape[0]: got {tuple(hidden.shape)} "
            f"and {tuple(lm_head.shape)} (for tied embeddings pass embedding_vd.T)"
        )


def _make_cfg(
    hidden, lm_head, chunk_size, vocab_chunk_size, temperature, precision, softcaps=(None, None)
):
    """(`_Cfg`, tau): a Python or NumPy number is a static temperature (tau None); a JAX
    array (a traced or scheduled value under `jit` / `grad`) is passed to the tiles as a
    0-d float32 operand `tau` (the config's temperature None), and differentiated.
    `softcaps`: the (policy's, reference's) final-logit soft-caps, each > 0 or None."""
    _check_chunks(chunk_size, vocab_chunk_size)
    for name, cap in zip(("softcap", "ref_softcap"), softcaps):
        check_number(name, cap, minimum=0, strict=True, none_ok=True, array_ok=False)
    softcaps = tuple(None if c is None else float(c) for c in softcaps)
    if isinstance(temperature, jax.Array):
        if temperature.ndim != 0:
            raise ValueError(
                f"temperature must be a number > 0 or a 0-d array, got shape {temperature.shape}"
            )
        static, tau = None, temperature.astype(_F32)
    else:
        if isinstance(temperature, np.ndarray | np.generic) and np.ndim(temperature) == 0:
            temperature = temperature.item()
        check_number("temperature", temperature, minimum=0, strict=True, array_ok=False)
        static, tau = float(temperature), None
    m = 1
    for d in hidden.shape[:-1]:
        m *= d
    v = lm_head.shape[1]
    c, vc = min(chunk_size, m), min(vocab_chunk_size, v)
    return _Cfg(m, v, c, vc, static, precision, _narrow_logit_operands(), softcaps), tau


def _rows_in_auto_mode(run, hidden, *args):
    """`run(hidden, *args)`: `[..., D]` -> `[...]`. The tiles slice the flattened rows with
    dynamic offsets, which an Explicit mesh cannot type when the rows are sharded, so the body
    runs in auto mode (as on an Auto mesh) and the output keeps `hidden`'s leading sharding."""
    return in_auto_mode(run, leading_spec(hidden, hidden.ndim - 1), hidden, *args)


def token_logprobs_from_hidden(
    hidden_ntd: Array,
    lm_head_dv: Array,
    tokens_nt: Array,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    vocab_chunk_size: int = DEFAULT_VOCAB_CHUNK_SIZE,
    temperature: float = 1.0,
    precision=None,
    softcap: float | None = None,
) -> Array:
    """`token_logprobs(hidden @ lm_head, tokens)` without ever forming the `[N, T, V]` logits.

        z = (hidden @ lm_head) / temperature              (one [C, Vc] tile at a time)
        logp[n, t] = z[n, t, tokens[n, t]] - logsumexp_v z[n, t, v]

    The log-sum-exp is accumulated online across vocabulary chunks. The custom backward
    recomputes each tile and accumulates, with p = softmax(z) and g the cotangent of logp,

        d hidden  = (g / temperature) * (lm_head[:, token] - p @ lm_head.T)
        d lm_head = hidden.T @ ((g / temperature) * (onehot(token) - p)),

    so memory is O(C * Vc) beyond the inputs and their cotangents. The backward costs one
    extra logits matmul compared to autodiff through full logits.

    Shift convention: the op does not shift. `hidden_ntd[:, t]` must be the state that
    predicts `tokens_nt[:, t]`, i.e. the model's output at the position *before* that
    token: for a sequence `ids_ns` with states `h_nsd`, pass `h_nsd[:, :-1]` and
    `ids_ns[:, 1:]` (completions starting at P: `h_nsd[:, P-1:-1]`, `ids_ns[:, P:]`).
    Unshifted states give wrong log-probabilities without any error.

    Args:
      hidden_ntd: `[N, T, D]` final hidden states (any leading dims `[..., D]`), any float
        dtype; `hidden_ntd[:, t]` scores `tokens_nt[:, t]` (already shifted, see above).
      lm_head_dv: `[D, V]` output projection; for tied embeddings pass `embedding_vd.T`.
      tokens_nt: `[N, T]` integer ids in `[0, V)`, the leading dims of `hidden_ntd`.
      chunk_size: `C`, tokens per tile (static); need not divide N*T.
      vocab_chunk_size: `Vc`, vocabulary entries per tile (static); need not divide V.
      temperature: > 0: a Python or NumPy number (static), or a 0-d JAX array (traced under
        `jit`, e.g. a schedule; differentiated too: d logp / d temperature =
        -(z_token - E_p[z]) / temperature).
      precision: `jax.lax.Precision` for the matmuls (None: the backend default).
      softcap: c > 0, the model's final-logit soft-cap (Gemma 2's
        `final_logit_softcapping`): logits -> c tanh(logits / c) before the temperature,
        differentiated through; None (the default): none.

    Returns:
      `[N, T]` float32 log-probabilities. Gradients flow to `hidden_ntd` and `lm_head_dv` in
      their own dtypes (and to an array `temperature`).

    Examples:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> import grpojax as gj
      >>> h = jax.random.normal(jax.random.key(0), (2, 3, 4))  # [N, T, D] hidden states
      >>> w, t = jax.random.normal(jax.random.key(1), (4, 5)), jnp.array([[0, 1, 2], [3, 4, 0]])
      >>> bool(jnp.allclose(gj.token_logprobs(h @ w, t), gj.token_logprobs_from_hidden(
      ...     h, w, t, chunk_size=4, vocab_chunk_size=2), atol=1e-5))  # tiles of 4 x 2
      True
    """
    _check_hidden(hidden_ntd, lm_head_dv)
    if tuple(tokens_nt.shape) != tuple(hidden_ntd.shape[:-1]):
        raise ValueError(
            f"tokens_nt shape {tuple(tokens_nt.shape)} must equal hidden_ntd shape without D, "
            f"{tuple(hidden_ntd.shape[:-1])}"
        )
    if not jnp.issubdtype(tokens_nt.dtype, jnp.integer):
        raise ValueError(f"tokens_nt must be an integer array, got dtype {tokens_nt.dtype}")
    cfg, tau = _make_cfg(
        hidden_ntd, lm_head_dv, chunk_size, vocab_chunk_size, temperature, precision,
        (softcap, None),
    )  # fmt: skip
    lead = hidden_ntd.shape[:-1]
    if cfg.m == 0:
        return jnp.zeros(lead, _F32)

    def run(hidden, lm_head, tokens, tau):
        h_md = hidden.reshape(cfg.m, hidden.shape[-1])
        tokens_m = tokens.reshape(cfg.m).astype(jnp.int32)
        return _logprobs_md(cfg, h_md, lm_head, tokens_m, tau).reshape(lead)

    return _rows_in_auto_mode(run, hidden_ntd, lm_head_dv, tokens_nt, tau)


# ----------------------------------------------------------------------------------------
# Chunked entropy
# ----------------------------------------------------------------------------------------


def _entropy_update(state, zs, col_ok):
    """Online (max mx, s = sum e, u = sum e (z - mx)) with e = exp(z - mx).

    Keeping u relative to the running max avoids the cancellation of lse - E[z] when the
    distribution is peaked: H = log s - u / s.
    """
    mx, s, u = state
    z = zs[0]
    z_in = jnp.where(col_ok, z, -jnp.inf)
    mx_new = jnp.maximum(mx, jnp.max(z_in, axis=-1))
    scale = jnp.exp(mx - mx_new)
    shift = jnp.where(jnp.isfinite(mx), mx - mx_new, 0.0)  # first tile: s = u = 0
    e = jnp.exp(z_in - mx_new[:, None])
    ez = jnp.where(col_ok, e * (z - mx_new[:, None]), 0.0)
    s_new = s * scale + jnp.sum(e, axis=-1)
    u_new = (u + s * shift) * scale + jnp.sum(ez, axis=-1)
    return mx_new, s_new, u_new


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _entropy_md(cfg: _Cfg, h_md, w_dv, mask_m, tau):
    return _entropy_fwd(cfg, h_md, w_dv, mask_m, tau)[0]


def _entropy_fwd(cfg, h_md, w_dv, mask_m, tau):
    init = (*_lse_init(cfg.m), jnp.zeros((cfg.m,), _F32))
    mx, s, u = _row_stats(cfg, [(h_md, w_dv)], init, _entropy_update, tau)
    h_m = jnp.log(s) - u / s
    return jnp.where(mask_m, h_m, 0.0), (h_md, w_dv, mask_m, mx + jnp.log(s), h_m, tau)


def _entropy_bwd(cfg, res, g_m):
    h_md, w_dv, mask_m, lse, h_m, tau = res

    # dH/dz_v = -p_v (log p_v + H)
    def dz_fn(zs, vals):
        lse_c, h_c, g_c = vals
        logp = zs[0] - lse_c[:, None]
        return [-g_c[:, None] * jnp.exp(logp) * (logp + h_c[:, None])]

    vals = (lse, h_m, g_m.astype(_F32))
    d_h, d_w, zdz = _backprop(cfg, [(h_md, w_dv)], vals, mask_m, dz_fn, tau)
    d_tau = _tau_cotangent(zdz, tau)
    return d_h.astype(h_md.dtype), d_w.astype(w_dv.dtype), None, d_tau


_entropy_md.defvjp(_entropy_fwd, _entropy_bwd)


def _mask_lead(mask_nt, lead):
    _check_mask(mask_nt, lead)
    if mask_nt is None:
        return jnp.ones(lead, jnp.bool_)
    return jnp.asarray(mask_nt, jnp.bool_)


def entropy_from_hidden(
    hidden_ntd: Array,
    lm_head_dv: Array,
    mask_nt: Array | None = None,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    vocab_chunk_size: int = DEFAULT_VOCAB_CHUNK_SIZE,
    temperature: float = 1.0,
    precision=None,
    softcap: float | None = None,
) -> Array:
    """`entropy(hidden @ lm_head, mask)` without forming the `[N, T, V]` logits.

        z = (hidden @ lm_head) / temperature,  p = softmax(z)
        H[n, t] = -sum_v p_v log p_v = log s - u / s,
        s = sum_v exp(z_v - mx),  u = sum_v exp(z_v - mx) (z_v - mx)   (online over Vc tiles)

    Backward (custom VJP, tiles recomputed): dH/dz_v = -p_v (log p_v + H).

    Shift convention: as `token_logprobs_from_hidden` (no shift inside): `H[:, t]` is the
    entropy of the distribution computed from `hidden_ntd[:, t]`, which predicts the token
    after that position; pass the same shifted states, `h_nsd[:, :-1]`, to align `H[:, t]`
    with `logp[:, t]` of `tokens_nt[:, t]`.

    Args:
      hidden_ntd: `[N, T, D]` hidden states (any leading dims), any float dtype, already
        shifted (`hidden_ntd[:, t]` is the state before token t).
      lm_head_dv: `[D, V]` output projection.
      mask_nt: optional `[N, T]` mask; masked positions give 0 and no gradient.
      chunk_size: as `token_logprobs_from_hidden`.
      vocab_chunk_size: as `token_logprobs_from_hidden`.
      temperature: as `token_logprobs_from_hidden`.
      precision: as `token_logprobs_from_hidden`.
      softcap: as `token_logprobs_from_hidden`.

    Returns:
      `[N, T]` float32 entropies.

    Examples:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> import grpojax as gj
      >>> h = jax.random.normal(jax.random.key(0), (2, 3, 4))  # [N, T, D] hidden states
      >>> w = jax.random.normal(jax.random.key(1), (4, 5))  # [D, V] LM head
      >>> bool(jnp.allclose(gj.entropy(h @ w), gj.entropy_from_hidden(
      ...     h, w, chunk_size=4, vocab_chunk_size=2), atol=1e-5))  # tiles of 4 x 2
      True
    """
    _check_hidden(hidden_ntd, lm_head_dv)
    cfg, tau = _make_cfg(
        hidden_ntd, lm_head_dv, chunk_size, vocab_chunk_size, temperature, precision,
        (softcap, None),
    )  # fmt: skip
    lead = hidden_ntd.shape[:-1]
    mask = _mask_lead(mask_nt, lead)
    if cfg.m == 0:
        return jnp.zeros(lead, _F32)

    def run(hidden, lm_head, mask, tau):
        h_md = hidden.reshape(cfg.m, hidden.shape[-1])
        return _entropy_md(cfg, h_md, lm_head, mask.reshape(cfg.m), tau).reshape(lead)

    return _rows_in_auto_mode(run, hidden_ntd, lm_head_dv, mask, tau)


# ----------------------------------------------------------------------------------------
# Chunked exact KL
# ----------------------------------------------------------------------------------------


def _kl_update(state, zs, col_ok):
    """Online statistics of p = softmax(z), q = softmax(y) with separate running maxima.

    State: (mx_p, s_p, mx_q, s_q, u) with s_p = sum exp(z - mx_p), s_q = sum exp(y - mx_q),
    u = sum exp(z - mx_p) (z - y). Separate maxima keep each sum from underflowing when the
    two models' logit scales differ.
    """
    mx_p, s_p, mx_q, s_q, u = state
    z, y = zs
    mx_p_new, s_p_new = _lse_update((mx_p, s_p), [z], col_ok)
    mx_q_new, s_q_new = _lse_update((mx_q, s_q), [y], col_ok)
    e = jnp.exp(jnp.where(col_ok, z, -jnp.inf) - mx_p_new[:, None])
    ed = jnp.where(col_ok, e * (z - y), 0.0)
    u_new = u * jnp.exp(mx_p - mx_p_new) + jnp.sum(ed, axis=-1)
    return mx_p_new, s_p_new, mx_q_new, s_q_new, u_new


def _pair_cotangents(cfg: _Cfg, res, vals, dz_fn):
    """The custom VJPs' common end for a divergence of the (policy, reference) pair: the
    policy's hidden and LM-head cotangents from `dz_fn` (`_backprop`), none for the reference
    and the mask, the temperature's where traced. `res` = (h_md, w_dv, ref_h_md, ref_w_dv,
    mask_m, tau)."""
    h_md, w_dv, ref_h_md, ref_w_dv, mask_m, tau = res
    pairs = [(h_md, w_dv), (ref_h_md, ref_w_dv)]
    d_h, d_w, zdz = _backprop(cfg, pairs, vals, mask_m, dz_fn, tau)
    d_tau = _tau_cotangent(zdz, tau)
    return d_h.astype(h_md.dtype), d_w.astype(w_dv.dtype), None, None, None, d_tau


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _kl_md(cfg: _Cfg, forward: bool, h_md, w_dv, ref_h_md, ref_w_dv, mask_m, tau):
    return _kl_fwd(cfg, forward, h_md, w_dv, ref_h_md, ref_w_dv, mask_m, tau)[0]


def _kl_fwd(cfg, forward, h_md, w_dv, ref_h_md, ref_w_dv, mask_m, tau):
    """KL(a || b): (a, b) = (p, q) for the reverse KL, (q, p) for the forward one
    (`forward`), p the policy's distribution and q the reference's."""
    init = (*_lse_init(cfg.m), *_lse_init(cfg.m), jnp.zeros((cfg.m,), _F32))
    pairs = [(h_md, w_dv), (ref_h_md, ref_w_dv)]

    def update(state, zs, col_ok):  # a's statistics first
        return _kl_update(state, zs[::-1] if forward else zs, col_ok)

    mx_a, s_a, mx_b, s_b, u = _row_stats(cfg, pairs, init, update, tau)
    # KL(a || b) = E_a[log a - log b] - lse_a + lse_b, with the max difference taken first
    # (exact when close).
    kl_m = u / s_a + (mx_b - mx_a) + (jnp.log(s_b) - jnp.log(s_a))
    lse_a = mx_a + jnp.log(s_a)
    lse_b = mx_b + jnp.log(s_b)
    lse_p, lse_q = (lse_b, lse_a) if forward else (lse_a, lse_b)
    out = jnp.where(mask_m, jnp.maximum(kl_m, 0.0), 0.0)
    return out, ((h_md, w_dv, ref_h_md, ref_w_dv, mask_m, tau), lse_p, lse_q, kl_m)


def _kl_bwd(cfg, forward, res, g_m):
    pair, lse_p, lse_q, kl_m = res
    tau = pair[-1]

    # Reverse: dKL(p || q)/dz_v = p_v (log p_v - log q_v - KL); a traced temperature also
    # scales the reference's logits y: dKL/dy_v = q_v - p_v. Forward: dKL(q || p)/dz_v =
    # p_v - q_v and dKL/dy_v = q_v (log q_v - log p_v - KL). The clamp at 0 is treated as
    # the identity.
    def dz_fn(zs, vals):
        lse_p_c, lse_q_c, kl_c, g_c = vals
        logp = zs[0] - lse_p_c[:, None]
        logq = zs[1] - lse_q_c[:, None]
        p = jnp.exp(logp)
        if forward:
            q = jnp.exp(logq)
            dz = g_c[:, None] * (p - q)
            dy = q * (logq - logp - kl_c[:, None])
        else:
            dz = g_c[:, None] * p * (logp - logq - kl_c[:, None])
            dy = jnp.exp(logq) - p
        return [dz] if tau is None else [dz, g_c[:, None] * dy]

    return _pair_cotangents(cfg, pair, (lse_p, lse_q, kl_m, g_m.astype(_F32)), dz_fn)


_kl_md.defvjp(_kl_fwd, _kl_bwd)


def _log_mixture(logp, logq, beta: float):
    """log m, m = beta q + (1 - beta) p."""
    return jnp.logaddexp(logp + np.log1p(-beta), logq + np.log(beta))


def _jsd_fwd(cfg, beta, h_md, w_dv, ref_h_md, ref_w_dv, mask_m, tau):
    pairs = [(h_md, w_dv), (ref_h_md, ref_w_dv)]

    def lse_update(state, zs, col_ok):
        return (
            *_lse_update(state[:2], zs[:1], col_ok),
            *_lse_update(state[2:], zs[1:], col_ok),
        )

    mx_p, s_p, mx_q, s_q = _row_stats(
        cfg, pairs, (*_lse_init(cfg.m), *_lse_init(cfg.m)), lse_update, tau
    )
    lse_p = mx_p + jnp.log(s_p)
    lse_q = mx_q + jnp.log(s_q)

    # Second pass: a = KL(p || m), b = KL(q || m), each term 0 where its probability is.
    def kl_update(state, zs, col_ok):
        lp, lq, a, b = state
        logp = zs[0] - lp[:, None]
        logq = zs[1] - lq[:, None]
        logm = _log_mixture(logp, logq, beta)
        p, q = jnp.exp(logp), jnp.exp(logq)
        ta = jnp.where(col_ok & (p > 0), p * (logp - logm), 0.0)
        tb = jnp.where(col_ok & (q > 0), q * (logq - logm), 0.0)
        return lp, lq, a + jnp.sum(ta, axis=-1), b + jnp.sum(tb, axis=-1)

    zeros = jnp.zeros((cfg.m,), _F32)
    _, _, a, b = _row_stats(cfg, pairs, (lse_p, lse_q, zeros, zeros), kl_update, tau)
    jsd = beta * b + (1.0 - beta) * a
    out = jnp.where(mask_m, jnp.maximum(jsd, 0.0), 0.0)
    return out, ((h_md, w_dv, ref_h_md, ref_w_dv, mask_m, tau), lse_p, lse_q, a, b)


def _jsd_bwd(cfg, beta, res, g_m):
    pair, lse_p, lse_q, a, b = res
    tau = pair[-1]

    # dJSD/dz_v = (1 - beta) p_v (log p_v - log m_v - KL(p || m)); a traced temperature
    # also scales y: dJSD/dy_v = beta q_v (log q_v - log m_v - KL(q || m)).
    def dz_fn(zs, vals):
        lse_p_c, lse_q_c, a_c, b_c, g_c = vals
        logp = zs[0] - lse_p_c[:, None]
        logq = zs[1] - lse_q_c[:, None]
        logm = _log_mixture(logp, logq, beta)
        p, q = jnp.exp(logp), jnp.exp(logq)
        dz = jnp.where(p > 0, p * (logp - logm - a_c[:, None]), 0.0)
        dz = g_c[:, None] * (1.0 - beta) * dz
        if tau is None:
            return [dz]
        dy = jnp.where(q > 0, q * (logq - logm - b_c[:, None]), 0.0)
        return [dz, g_c[:, None] * beta * dy]

    return _pair_cotangents(cfg, pair, (lse_p, lse_q, a, b, g_m.astype(_F32)), dz_fn)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _jsd_md(cfg: _Cfg, beta: float, h_md, w_dv, ref_h_md, ref_w_dv, mask_m, tau):
    return _jsd_fwd(cfg, beta, h_md, w_dv, ref_h_md, ref_w_dv, mask_m, tau)[0]


_jsd_md.defvjp(_jsd_fwd, _jsd_bwd)

DIVERGENCES = ("reverse_kl", "forward_kl", "jsd")


def divergence_from_hidden(
    hidden_ntd: Array,
    lm_head_dv: Array,
    ref_hidden_ntd: Array,
    ref_lm_head_dv: Array,
    mask_nt: Array | None = None,
    *,
    divergence: str,
    beta: float | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    vocab_chunk_size: int = DEFAULT_VOCAB_CHUNK_SIZE,
    temperature: float = 1.0,
    precision=None,
    softcap: float | None = None,
    ref_softcap: float | None = None,
) -> Array:
    """Exact per-token divergence of pi from pi_ref (e.g. a teacher) over the whole
    vocabulary, without `[N, T, V]` logits.

        p = softmax(hidden @ lm_head / temperature),  q = softmax(ref_hidden @ ref_lm_head / ..)
        "reverse_kl":  KL(p || q) = sum_v p_v (log p_v - log q_v)        (on-policy distillation)
        "forward_kl":  KL(q || p) = sum_v q_v (log q_v - log p_v)        (mode covering)
        "jsd":         beta KL(q || m) + (1 - beta) KL(p || m),  m = beta q + (1 - beta) p
                       (the generalised Jensen-Shannon divergence of GKD, Agarwal et al.
                       2024, with TRL's beta: 0.5 the symmetric JSD, bounded by log 2)

    accumulated online over `[C, Vc]` tiles of both models (the JSD in two passes: the
    log-sum-exps, then the two KLs to the mixture), each clamped at 0 against rounding.
    Differentiable w.r.t. `hidden_ntd` and `lm_head_dv` through a custom VJP that recomputes
    the tiles: dKL(p || q)/dz_v = p_v (log p_v - log q_v - KL), dKL(q || p)/dz_v = p_v - q_v,
    dJSD/dz_v = (1 - beta) p_v (log p_v - log m_v - KL(p || m)). The reference side is a
    constant (`stop_gradient`): a frozen teacher or reference model.

    Shift convention: as `token_logprobs_from_hidden` (no shift inside): `D[:, t]` compares
    the distributions computed from `hidden_ntd[:, t]` and `ref_hidden_ntd[:, t]`.

    Args:
      hidden_ntd: `[N, T, D]` policy (student) hidden states (any leading dims), shifted.
      lm_head_dv: `[D, V]` policy output projection.
      ref_hidden_ntd: `[N, T, D']` reference (teacher) hidden states (same leading dims).
      ref_lm_head_dv: `[D', V]` reference output projection (same V; D' may differ: a
        larger teacher).
      mask_nt: optional `[N, T]` mask; masked positions give 0 and no gradient.
      divergence: one of `DIVERGENCES` (no default: the caller names it).
      beta: the JSD's mixture weight of the reference, in (0, 1); required by "jsd" (GKD
        tries several; TRL's default is 0.5), unused by the KLs.
      chunk_size: as `token_logprobs_from_hidden`.
      vocab_chunk_size: as `token_logprobs_from_hidden`.
      temperature: as `token_logprobs_from_hidden` (it divides both models' logits).
      precision: as `token_logprobs_from_hidden`.
      softcap: the policy's final-logit soft-cap, as `token_logprobs_from_hidden`.
      ref_softcap: the reference's (a teacher's own; None: none).

    Returns:
      `[N, T]` float32, >= 0.

    Examples:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> import grpojax as gj
      >>> h, ref_h = jax.random.normal(jax.random.key(0), (2, 2, 3, 4))  # two [N, T, D] states
      >>> w, ref_w = jax.random.normal(jax.random.key(1), (2, 4, 5))  # two [D, V] LM heads
      >>> fwd = gj.divergence_from_hidden(h, w, ref_h, ref_w, divergence="forward_kl")
      >>> bool(jnp.allclose(fwd, gj.full_kl(ref_h @ ref_w, h @ w), atol=1e-5))
      True
      >>> jsd = gj.divergence_from_hidden(h, w, ref_h, ref_w, divergence="jsd", beta=0.5)
      >>> bool(jnp.all(jsd <= jnp.log(2.0) + 1e-6))
      True
    """
    if divergence not in DIVERGENCES:
        raise ValueError(f"divergence must be one of {list(DIVERGENCES)}, got {divergence!r}")
    if divergence == "jsd":
        if beta is None:
            raise ValueError("divergence='jsd' needs beta in (0, 1) (0.5: the symmetric JSD)")
        check_number("beta", beta, minimum=0, maximum=1, strict=True, strict_max=True)
    _check_hidden(hidden_ntd, lm_head_dv)
    _check_hidden(ref_hidden_ntd, ref_lm_head_dv, "ref_hidden_ntd", "ref_lm_head_dv")
    if ref_hidden_ntd.shape[:-1] != hidden_ntd.shape[:-1]:
        raise ValueError(
            f"ref_hidden_ntd leading shape {tuple(ref_hidden_ntd.shape[:-1])} must equal "
            f"hidden_ntd's {tuple(hidden_ntd.shape[:-1])}"
        )
    if ref_lm_head_dv.shape[1] != lm_head_dv.shape[1]:
        raise ValueError(
            f"policy and reference vocabularies differ: lm_head_dv V={lm_head_dv.shape[1]}, "
            f"ref_lm_head_dv V={ref_lm_head_dv.shape[1]}"
        )
    cfg, tau = _make_cfg(
        hidden_ntd, lm_head_dv, chunk_size, vocab_chunk_size, temperature, precision,
        (softcap, ref_softcap),
    )  # fmt: skip
    lead = hidden_ntd.shape[:-1]
    mask = _mask_lead(mask_nt, lead)
    if cfg.m == 0:
        return jnp.zeros(lead, _F32)
    if divergence == "jsd":
        assert beta is not None
        md = functools.partial(_jsd_md, cfg, float(beta))
    else:
        md = functools.partial(_kl_md, cfg, divergence == "forward_kl")

    def run(hidden, lm_head, ref_hidden, ref_lm_head, mask, tau):
        h_md = hidden.reshape(cfg.m, hidden.shape[-1])
        ref_h_md = lax.stop_gradient(ref_hidden.reshape(cfg.m, ref_hidden.shape[-1]))
        ref_w_dv = lax.stop_gradient(ref_lm_head)
        out_m = md(h_md, lm_head, ref_h_md, ref_w_dv, mask.reshape(cfg.m), tau)
        return out_m.reshape(lead)

    args = (hidden_ntd, lm_head_dv, ref_hidden_ntd, ref_lm_head_dv, mask, tau)
    return _rows_in_auto_mode(run, *args)


def kl_from_hidden(
    hidden_ntd: Array,
    lm_head_dv: Array,
    ref_hidden_ntd: Array,
    ref_lm_head_dv: Array,
    mask_nt: Array | None = None,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    vocab_chunk_size: int = DEFAULT_VOCAB_CHUNK_SIZE,
    temperature: float = 1.0,
    precision=None,
    softcap: float | None = None,
    ref_softcap: float | None = None,
) -> Array:
    """Exact per-token KL(pi || pi_ref) over the whole vocabulary, without `[N, T, V]` logits:
    `divergence_from_hidden(..., divergence="reverse_kl")`.

        z = (hidden @ lm_head) / temperature,  y = (ref_hidden @ ref_lm_head) / temperature
        KL[n, t] = sum_v p_v (log p_v - log q_v) = E_p[z - y] - logsumexp z + logsumexp y

    accumulated online over `[C, Vc]` tiles of both models; clamped at 0 against rounding.
    Differentiable w.r.t. `hidden_ntd` and `lm_head_dv` (custom VJP, tiles recomputed,
    dKL/dz_v = p_v (log p_v - log q_v - KL)); the reference side is a constant
    (`stop_gradient`), as it is in RL fine-tuning.

    Shift convention: as `token_logprobs_from_hidden` (no shift inside): `KL[:, t]` compares
    the distributions computed from `hidden_ntd[:, t]` and `ref_hidden_ntd[:, t]`; pass both
    models' states shifted alike (`h_nsd[:, :-1]`) to align it with `logp[:, t]`.

    Args:
      hidden_ntd: `[N, T, D]` policy hidden states (any leading dims), already shifted.
      lm_head_dv: `[D, V]` policy output projection.
      ref_hidden_ntd: `[N, T, D']` reference hidden states (same leading dims).
      ref_lm_head_dv: `[D', V]` reference output projection (same V).
      mask_nt: optional `[N, T]` mask; masked positions give 0 and no gradient.
      chunk_size: as `token_logprobs_from_hidden`.
      vocab_chunk_size: as `token_logprobs_from_hidden`.
      temperature: as `token_logprobs_from_hidden`.
      precision: as `token_logprobs_from_hidden`.
      softcap: the policy's final-logit soft-cap, as `token_logprobs_from_hidden`.
      ref_softcap: the reference's (None: none).

    Returns:
      `[N, T]` float32, >= 0.

    Examples:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> import grpojax as gj
      >>> h, ref_h = jax.random.normal(jax.random.key(0), (2, 2, 3, 4))  # two [N, T, D] states
      >>> w, ref_w = jax.random.normal(jax.random.key(1), (2, 4, 5))  # two [D, V] LM heads
      >>> bool(jnp.allclose(gj.full_kl(h @ w, ref_h @ ref_w), gj.kl_from_hidden(
      ...     h, w, ref_h, ref_w, chunk_size=4, vocab_chunk_size=2), atol=1e-5))
      True
    """
    return divergence_from_hidden(
        hidden_ntd,
        lm_head_dv,
        ref_hidden_ntd,
        ref_lm_head_dv,
        mask_nt,
        divergence="reverse_kl",
        chunk_size=chunk_size,
        vocab_chunk_size=vocab_chunk_size,
        temperature=temperature,
        precision=precision,
        softcap=softcap,
        ref_softcap=ref_softcap,
    )


def keep_mask_from_count(logits_ntv: Array, keep_count_nt: Array) -> Array:
    """Kept-set mask `[..., V]` bool: the `keep_count` highest logits (and ties with the last).

    keep_v <=> z_v >= z_(c), the c-th largest logit, c = keep_count. Temperature does not
    change ranks, so it is not needed. Costs a sort over V per token.

    Args:
      logits_ntv: `[..., V]` logits.
      keep_count_nt: `[...]` int kept-set sizes (`Rollout.keep_count_nt`), in [1, V].
    """
    z = jnp.asarray(logits_ntv, jnp.float32)
    sorted_desc = -jnp.sort(-z, axis=-1)
    c = jnp.clip(jnp.asarray(keep_count_nt, jnp.int32), 1, z.shape[-1])
    tau = jnp.take_along_axis(sorted_desc, (c - 1)[..., None], axis=-1)
    return z >= tau


def kept_logprobs(
    logits_ntv: Array, tokens_nt: Array, keep_mask_ntv: Array, *, temperature: float = 1.0
) -> Array:
    """log pi(token) renormalised over the kept set, f32 `[...]`.

    logp = z_tok - logsumexp_{v: keep_v} z_v,  z = logits / temperature.

    This is how a trainer applies the keep-sampling mask to the current policy pi_theta:
    build `keep_mask_ntv` from the rollout (`keep_mask_from_count` / `_from_threshold`) and
    use these logprobs in the importance ratio, so pi_theta and pi_old share one action space.
    A token outside the mask gets -inf.

    Args:
      logits_ntv: `[..., V]` logits of the policy being evaluated.
      tokens_nt: `[...]` int tokens.
      keep_mask_ntv: `[..., V]` bool kept set.
      temperature: sampling temperature (> 0).
    """
    check_number("temperature", temperature, minimum=0, strict=True)
    z = jnp.asarray(logits_ntv, jnp.float32) / jnp.float32(temperature)
    z = jnp.where(keep_mask_ntv, z, -jnp.inf)
    z_tok = jnp.take_along_axis(z, jnp.asarray(tokens_nt, jnp.int32)[..., None], axis=-1)[..., 0]
    return z_tok - jax.nn.logsumexp(z, axis=-1)
