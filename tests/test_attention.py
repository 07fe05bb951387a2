"""The blockwise attention path against the einsum reference, on every mask the project uses.

Cases: left-padded rows (causal), packed rows (segment ids), packed groups (completions that
also read their group's prompt segment), new tokens over a shared prompt prefix read by
groups of rows, new tokens over a row cache, and queries that may read nothing. Values and
the gradients of q, k, v (and of the prefix's and cache's keys and values) are compared in
float32 within 1e-5 of the reference's own scale, and in bf16 within 2^-7 of max |v|: both
paths round each normalised probability to bf16 once (relative 2^-9), from float32 values
that differ in their last bits (a different order of the softmax's sums), so a rounding
may flip: the weighted sums differ by at most about 2 x 2^-9 max |v|, plus the output's own
bf16 rounding. The optional sliding window (on positions), score scale and logit
soft-capping are checked on the same cases, and both paths against a float64 NumPy
attention written from the rule; then a decode step, a traced window and the tiles a window
skips. Then a decoder whose layers use the blockwise path equals the einsum decoder (hidden
states and parameter gradients), packed rows equal the same sequences one per row, and the
compiled backward's scratch memory grows about linearly with the length, not
quadratically.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from model_fixtures import model_config, scrambled

import grpojax.models as gm
from grpojax.models import attention as attn

F32_TOL = 1e-5
BF16_TOL = 2.0**-7
BLOCK = 8  # tiles far smaller than T, so every case runs several tiles, some of them empty


def _rand(rng, shape, dtype):
    return jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dtype)


def _case(kind, dtype, seed=0):
    """(q, k, v, mask, extras, real): N=4 rows, T=21 new tokens, 4 query / 2 kv heads, H=8;
    the mask's positions as the library gives them (each sequence's own; a packed
    completion's after its parent prompt's; new tokens after the prefix's or cache's)."""
    rng = np.random.default_rng(seed)
    n, t, q_heads, kv_heads, h = 4, 21, 4, 2, 8
    q = _rand(rng, (n, t, q_heads, h), dtype)
    k = _rand(rng, (n, t, kv_heads, h), dtype)
    v = _rand(rng, (n, t, kv_heads, h), dtype)
    extras = {}
    if kind in ("packed", "packed_shared"):
        seg = np.zeros((n, t), np.int32)
        seg[:, :7], seg[:, 7:16], seg[:, 16:19] = 1, 2, 3  # the last 2 columns padding
        seg[1, :] = 1
        parent = None
        pos = np.zeros((n, t), np.int32)
        for r in range(n):
            for i in range(t):
                pos[r, i] = np.sum(seg[r, :i] == seg[r, i]) if seg[r, i] else 0
        if kind == "packed_shared":  # segments 2 and 3: completions reading prompt 1
            parent = np.where(seg >= 2, 1, 0).astype(np.int32)
            pos += np.where(parent == 1, np.sum(seg == 1, axis=1, keepdims=True), 0)
            parent = jnp.asarray(parent)
        mask = attn.SelfMask.packed(jnp.asarray(seg), parent, positions=jnp.asarray(pos))
        real = seg > 0
    else:
        # left padding (a prompt) for "causal"; right padding (a completion) otherwise
        lengths = np.array([21, 14, 5, 1])
        cols = np.arange(t)[None, :]
        if kind == "causal":
            real = cols >= (t - lengths)[:, None]
        else:
            real = cols < lengths[:, None]
        before = np.zeros((n, 1), np.int32)  # the real prefix or cache keys before the row
        if kind == "prefix":
            b, p = 2, 13
            pk = _rand(rng, (b, kv_heads, h, p), dtype)
            pv = _rand(rng, (b, kv_heads, p, h), dtype)
            p_real = np.arange(p)[None, :] >= np.array([0, 6])[:, None]  # left-padded prompts
            extras["prefix"] = (pk, pv, jnp.asarray(p_real))
            before = np.repeat(p_real.sum(1, keepdims=True), n // b, axis=0)
        if kind == "cache":
            s = 11
            ck = _rand(rng, (n, kv_heads, h, s), dtype)
            cv = _rand(rng, (n, kv_heads, s, h), dtype)
            c_real = np.arange(s)[None, :] < np.array([11, 4, 0, 7])[:, None]  # row 2: empty
            extras["cache"] = (ck, cv, jnp.asarray(c_real))
            before = c_real.sum(1, keepdims=True)
        pos = before + np.maximum(np.cumsum(real, axis=1) - 1, 0)
        mask = attn.SelfMask.from_mask(jnp.asarray(real), positions=jnp.asarray(pos))
    return q, k, v, mask, extras, jnp.asarray(real)


def _run(impl, q, k, v, mask, extras, prefix_kv=None, cache_kv=None, **how):
    """`attention_with_cache` by `impl`; `how`: window, scale, softcap."""
    kw = {}
    if "prefix" in extras:
        kw["prefix"] = (*prefix_kv, extras["prefix"][2])
    if "cache" in extras:
        kw["cache"] = (*cache_kv, extras["cache"][2])
    return attn.attention_with_cache(q, k, v, mask, implementation=impl, block=BLOCK, **kw, **how)


@pytest.mark.parametrize("kind", ["causal", "packed", "packed_shared", "prefix", "cache"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_blockwise_equals_einsum_values_and_gradients(kind, dtype):
    _blockwise_equals_einsum(kind, dtype)


def _blockwise_equals_einsum(kind, dtype, **how):
    """The blockwise path against the einsum path on `_case(kind, dtype)` with `how`
    (window, scale, softcap): values at real queries and, in float32, the gradients of q, k,
    v and the prefix's / cache's keys and values. Returns the case and (einsum, blockwise)."""
    q, k, v, mask, extras, real = case = _case(kind, dtype)
    pkv = extras.get("prefix", (None, None))[:2]
    ckv = extras.get("cache", (None, None))[:2]
    w = jnp.asarray(np.random.default_rng(9).standard_normal(q.shape), jnp.float32)
    w = jnp.where(real[:, :, None, None], w, 0.0)  # padded queries' outputs are not compared

    def loss(impl):
        def f(q, k, v, pkv, ckv):
            out = _run(impl, q, k, v, mask, extras, pkv, ckv, **how)
            return jnp.sum(out.astype(jnp.float32) * w)

        return f

    args = (q, k, v, pkv, ckv)
    ref = _run("einsum", *args[:3], mask, extras, pkv, ckv, **how)
    got = _run("blockwise", *args[:3], mask, extras, pkv, ckv, **how)
    assert got.dtype == dtype and got.shape == q.shape
    sel = np.asarray(real)
    ref32, got32 = np.asarray(ref, np.float32)[sel], np.asarray(got, np.float32)[sel]
    vmax = max(
        float(jnp.abs(x.astype(jnp.float32)).max()) for x in (v, *pkv, *ckv) if x is not None
    )
    bound = F32_TOL * np.abs(ref32).max() if dtype == jnp.float32 else BF16_TOL * vmax
    assert np.abs(got32 - ref32).max() <= bound
    if dtype != jnp.float32:
        return case, (ref, got)
    g_ref = jax.grad(loss("einsum"), argnums=(0, 1, 2, 3, 4))(*args)
    g_got = jax.grad(loss("blockwise"), argnums=(0, 1, 2, 3, 4))(*args)
    leaves = 0
    for a, b in zip(jax.tree.leaves(g_ref), jax.tree.leaves(g_got), strict=True):
        leaves += 1
        a, b = np.asarray(a), np.asarray(b)
        assert np.abs(a).max() > 0
        assert np.abs(a - b).max() <= F32_TOL * np.abs(a).max()
    assert leaves == 3 + 2 * (kind in ("prefix", "cache"))
    return case, (ref, got)


# ----------------------------------------------------------------- window, scale, softcap

WINDOW = 5  # over T = 21 in tiles of 8: some tiles out of every query's reach, some cut


def _f64(x):
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def _np_attention(q, k, v, allowed, scale=None, softcap=None):
    """float64 attention from the definition: q `[N, T, Q, H]`, k, v `[N, S, K, H]`, allowed
    `[N, T, S]`: scores scale * q.k (None: H ** -0.5), soft-capped, masked, softmax, sum of v."""
    q, k, v = _f64(q), _f64(k), _f64(v)
    g = q.shape[2] // k.shape[2]  # query head i reads kv head i // g
    k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    s = np.einsum("ntqh,nsqh->nqts", q, k) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    s = np.where(allowed[:, None], s, -np.inf)
    with np.errstate(invalid="ignore"):  # a query that reads nothing (padding): NaN, unused
        p = np.exp(s - s.max(-1, keepdims=True))
        return np.einsum("nqts,nsqh->ntqh", p / p.sum(-1, keepdims=True), v)


def _np_reference(case, window=None, scale=None, softcap=None):
    """`_np_attention` of a `_case`'s new tokens over all their keys (the group's prefix, the
    row's cache, then the new tokens), allowed by the module's rule: a real key, of the
    query's own or parent segment in packed rows, not after it, and with a window, its
    position (an earlier key's: the real keys before it in the row) within the window."""
    q, k, v, mask, extras, _ = case
    n, t = q.shape[:2]
    keys, values, earlier = [], [], [np.zeros((n, 0), bool)]
    for name in ("prefix", "cache"):
        if name in extras:
            ek, ev, e_real = extras[name]
            j = n // ek.shape[0]  # rows per prefix (1: the cache)
            keys.append(np.repeat(np.moveaxis(_f64(ek), 3, 1), j, axis=0))
            values.append(np.repeat(np.swapaxes(_f64(ev), 1, 2), j, axis=0))
            earlier.append(np.repeat(np.asarray(e_real), j, axis=0))
    real_e = np.concatenate(earlier, axis=1)
    e = real_e.shape[1]
    kseg = np.concatenate([real_e.astype(np.int32), np.asarray(mask.key_seg)], axis=1)
    qpos = np.asarray(mask.positions)
    kpos = np.concatenate([np.cumsum(real_e, axis=1) - 1, qpos], axis=1)
    ok = (kseg > 0)[:, None, :] & (np.arange(e + t)[None, None] <= e + np.arange(t)[:, None])
    if mask.query_seg is not None:
        qseg = np.asarray(mask.query_seg)[:, :, None]
        parent = 0 if mask.query_parent is None else np.asarray(mask.query_parent)[:, :, None]
        ok &= (kseg[:, None, :] == qseg) | (kseg[:, None, :] == parent)
    if window is not None:
        ok &= qpos[:, :, None] - kpos[:, None, :] < window
    k_all = np.concatenate([*keys, _f64(k)], axis=1)
    v_all = np.concatenate([*values, _f64(v)], axis=1)
    return _np_attention(q, k_all, v_all, ok, scale, softcap)


@pytest.mark.parametrize(
    "kind, dtype, how",
    [
        pytest.param("causal", jnp.float32, dict(window=WINDOW), id="causal-window"),
        pytest.param("packed", jnp.float32, dict(window=WINDOW), id="packed-window"),
        pytest.param(
            "packed_shared",
            jnp.float32,
            dict(window=WINDOW, softcap=2.0),
            id="packed_shared-window-softcap",
        ),
        pytest.param(
            "prefix", jnp.float32, dict(window=WINDOW, scale=0.5), id="prefix-window-scale"
        ),
        pytest.param(
            "cache", jnp.float32, dict(window=WINDOW, scale=0.5, softcap=2.0), id="cache-all"
        ),
        pytest.param(
            "causal", jnp.float32, dict(scale=0.5, softcap=2.0), id="causal-scale-softcap"
        ),
        pytest.param("packed_shared", jnp.bfloat16, dict(window=WINDOW), id="packed_shared-bf16"),
    ],
)
def test_window_scale_softcap_match_reference(kind, dtype, how):
    """Blockwise against einsum, values and float32 gradients as above (bf16: BF16_TOL), and
    in float32 both against the NumPy reference within 1e-5 of its scale; each option given
    changes that reference by far more (a completion's first tokens read their parent
    prompt's last keys: positions continue from the prompt's)."""
    case, outs = _blockwise_equals_einsum(kind, dtype, **how)
    if dtype != jnp.float32:
        return
    sel = np.asarray(case[-1])
    ref = _np_reference(case, **how)[sel]
    bound = F32_TOL * np.abs(ref).max()
    for out in outs:
        assert np.abs(np.asarray(out)[sel] - ref).max() <= bound
    for name in how:
        assert np.abs(_np_reference(case, **{**how, name: None})[sel] - ref).max() > 1e3 * bound


def test_windowed_decode_step_equals_the_full_sequence_last_row():
    """One new token (T = 1, the einsum path's decoding branch) over a shared prefix and a
    row cache, with a window of 4 (and with a scale and a softcap), equals the NumPy
    reference's last row over each row's whole sequence: its real prefix keys, cache keys
    and new token at positions 0..L-1."""
    rng = np.random.default_rng(5)
    b, j, q_heads, kv_heads, h, p, s = 2, 2, 4, 2, 8, 7, 6
    n = b * j
    rand = lambda *shape: _rand(rng, shape, jnp.float32)
    pk, pv = rand(b, kv_heads, h, p), rand(b, kv_heads, p, h)
    ck, cv = rand(n, kv_heads, h, s), rand(n, kv_heads, s, h)
    q, k, v = rand(n, 1, q_heads, h), rand(n, 1, kv_heads, h), rand(n, 1, kv_heads, h)
    p_real = np.arange(p)[None] >= np.array([0, 3])[:, None]  # 7 and 4 real prompt tokens
    c_real = np.arange(s)[None] < np.array([6, 2, 0, 4])[:, None]
    lengths = np.repeat(p_real.sum(1), j) + c_real.sum(1) + 1
    mask = attn.SelfMask.from_mask(jnp.ones((n, 1)), positions=jnp.asarray(lengths[:, None] - 1))
    prefix, cache = (pk, pv, jnp.asarray(p_real)), (ck, cv, jnp.asarray(c_real))
    # `[., P or S, K, H]`, the layout of the reference's keys and values
    pk, ck = np.moveaxis(_f64(pk), 3, 1), np.moveaxis(_f64(ck), 3, 1)
    pv, cv = np.swapaxes(_f64(pv), 1, 2), np.swapaxes(_f64(cv), 1, 2)
    for scale, softcap in ((None, None), (0.5, 2.0)):
        got = attn.attention_with_cache(
            q, k, v, mask, cache=cache, prefix=prefix, window=4, scale=scale, softcap=softcap
        )
        for r in range(n):
            g, length = r // j, lengths[r]
            keys = np.concatenate([pk[g][p_real[g]], ck[r][c_real[r]], _f64(k[r])])
            values = np.concatenate([pv[g][p_real[g]], cv[r][c_real[r]], _f64(v[r])])
            allowed = (length - 1 - np.arange(length) < 4)[None, None]
            ref = _np_attention(q[r : r + 1], keys[None], values[None], allowed, scale, softcap)
            assert np.abs(np.asarray(got[r]) - ref[0]).max() <= F32_TOL * np.abs(ref).max()


def test_traced_window_equals_the_static_one():
    """The window as a traced int32 (an argument of a jitted function; a scan over windows 5
    and 2^30, as over layers, the latter global) gives what the static window (or none)
    gives, on both paths, over a prefix."""
    q, k, v, mask, extras, real = _case("prefix", jnp.float32)
    pkv, sel = extras["prefix"][:2], np.asarray(real)

    def both(window):
        outs = [
            _run(impl, q, k, v, mask, extras, pkv, window=window)
            for impl in ("einsum", "blockwise")
        ]
        return jnp.stack(outs)

    def close(a, b):
        a, b = np.asarray(a)[:, sel], np.asarray(b)[:, sel]
        assert np.abs(a - b).max() <= F32_TOL * np.abs(b).max()

    static = both(WINDOW)
    close(jax.jit(both)(WINDOW), static)
    _, scanned = jax.lax.scan(lambda c, w: (c, both(w)), None, jnp.asarray([WINDOW, 2**30]))
    close(scanned[0], static)
    close(scanned[1], both(None))


def test_window_skips_tiles_out_of_reach_and_needs_positions():
    """A tile whose keys are out of every query's window is not visited: with keys 0..7's
    values NaN, queries 16..23 (window 5, tiles of 8) stay finite, their outputs and their
    gradient, which they do not without the window. A window without positions is an error."""
    rng = np.random.default_rng(2)
    q = _rand(rng, (1, 1, 1, 24, 4), jnp.float32)
    k = _rand(rng, (1, 1, 24, 4), jnp.float32)
    v = _rand(rng, (1, 1, 24, 4), jnp.float32).at[:, :, :8].set(jnp.nan)
    seg, cols = jnp.ones((1, 24), jnp.int32), jnp.arange(24)
    at = dict(block=8, query_pos=cols[None], key_pos=cols[None])

    def late(q, window):  # the outputs of queries 16..23
        out, _ = attn.flash_attention(q, k, v, seg, None, cols, cols, window=window, **at)
        return out[..., 16:, :]

    assert np.all(np.isfinite(late(q, WINDOW))) and np.all(np.isnan(late(q, None)))
    dq = jax.grad(lambda q: jnp.sum(late(q, WINDOW)))(q)
    assert np.all(np.isfinite(dq[..., 16:, :]))
    with pytest.raises(ValueError, match="a window needs query_pos and key_pos"):
        attn.flash_attention(q, k, v, seg, None, cols, cols, window=WINDOW)
    q, k, v, mask, _, _ = _case("causal", jnp.float32)
    for impl in ("einsum", "blockwise"):
        with pytest.raises(ValueError, match="a sliding window compares positions"):
            attn.attention(q, k, v, mask._replace(positions=None), implementation=impl, window=2)


def test_queries_that_read_nothing_stay_finite_with_zero_gradient():
    """A packed row's padding tail reads no key: output 0, log-sum-exp NEG_INF, and the
    gradient it passes back is 0 (a NaN there would poison the real tokens' gradients)."""
    rng = np.random.default_rng(1)
    q = _rand(rng, (1, 2, 1, 10, 4), jnp.float32)
    k = _rand(rng, (1, 2, 10, 4), jnp.float32)
    v = _rand(rng, (1, 2, 10, 4), jnp.float32)
    seg = jnp.asarray([[1, 1, 1, 2, 2, 2, 2, 0, 0, 0]])
    cols = jnp.arange(10)
    out, lse = attn.flash_attention(q, k, v, seg, seg, cols, cols, block=4)
    assert np.all(np.asarray(out[..., 7:, :]) == 0) and np.all(
        np.asarray(lse[..., 7:]) == attn.NEG_INF
    )

    def loss(q, k, v):
        o, lse = attn.flash_attention(q, k, v, seg, seg, cols, cols, block=4)
        return jnp.sum(o) + jnp.sum(jnp.where(seg[0] > 0, lse, 0.0))

    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    for g in grads:
        assert np.all(np.isfinite(np.asarray(g)))
    assert np.all(np.asarray(grads[0][..., 7:, :]) == 0)
    assert np.all(np.asarray(grads[1][:, :, 7:]) == 0) and np.all(
        np.asarray(grads[2][:, :, 7:]) == 0
    )


def test_auto_picks_the_einsum_for_short_and_blockwise_for_long():
    assert attn.resolve("auto", 512, 512) == "einsum"
    assert attn.resolve("auto", 513, 512) == "blockwise"
    assert attn.resolve("einsum", 10**6, 10**6) == "einsum"
    with pytest.raises(
        ValueError,
        match=r"attention must be one of \('auto', 'einsum', 'blockwise', 'fused'\), got 'flash'",
    ):
        attn.resolve("flash", 1, 1)
    with pytest.raises(ValueError, match="attention must be one of"):
        model_config(attention="flash")


# ----------------------------------------------------------------------------- the fused path


def _fused_case(dtype, seed=0):
    """(q, k, v, mask, real): N=5 rows of T=13, 4 query / 2 kv heads, H=8, padded as the
    library pads them and beyond: a whole row; a left-padded prompt and a right-padded
    completion; left padding only; a row with a hole (real tokens on both sides of padding);
    a row of padding only. Positions count real tokens (`positions_from_mask`)."""
    rng = np.random.default_rng(seed)
    n, t, q_heads, kv_heads, h = 5, 13, 4, 2, 8
    real = np.ones((n, t), bool)
    real[1, :3], real[1, 10:] = False, False
    real[2, :8] = False
    real[3, 4:7] = False
    real[4, :] = False
    mask = attn.SelfMask.from_mask(jnp.asarray(real), positions=gm.positions_from_mask(real))
    q = _rand(rng, (n, t, q_heads, h), dtype)
    k = _rand(rng, (n, t, kv_heads, h), dtype)
    v = _rand(rng, (n, t, kv_heads, h), dtype)
    return q, k, v, mask, jnp.asarray(real)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    "how", [{}, dict(window=4), dict(scale=0.5, window=3)], ids=["plain", "window", "scale"]
)
def test_fused_equals_einsum_values_and_gradients(dtype, how):
    """`jax.nn.dot_product_attention` (its XLA implementation here, cuDNN's on a GPU) after
    the mask conversion (real tokens moved first, lengths, window in moved columns) equals
    the einsum path at every real query, and the gradients of q, k, v of a loss on the real
    queries' outputs match: float32 within 1e-5 of the reference's scale, bf16 within
    2^-7 (as blockwise against einsum); padding queries give 0. A window changes the
    outputs by far more than the bound."""
    q, k, v, mask, real = _fused_case(dtype)
    sel = np.asarray(real)
    tol = F32_TOL if dtype == jnp.float32 else BF16_TOL
    w_out = _rand(np.random.default_rng(9), q.shape, jnp.float32)

    def run(impl, q, k, v, **kw):
        return attn.attention(q, k, v, mask, implementation=impl, **kw)

    ref, got = run("einsum", q, k, v, **how), run("fused", q, k, v, **how)
    ref32, got32 = np.asarray(ref, np.float32), np.asarray(got, np.float32)
    bound = tol * np.abs(ref32[sel]).max()
    assert np.abs(got32[sel] - ref32[sel]).max() <= bound
    if attn.fused_refusal(q, mask, None, None) is None:  # on a GPU: bf16 only (cuDNN)
        assert np.all(got32[~sel] == 0)
    if "window" in how:
        unwindowed = np.asarray(run("einsum", q, k, v, **{**how, "window": None}), np.float32)
        assert np.abs(unwindowed[sel] - ref32[sel]).max() > 10 * bound

    def loss(impl, q, k, v):
        out = run(impl, q, k, v, **how).astype(jnp.float32)
        return jnp.sum(jnp.where(real[:, :, None, None], out * w_out, 0.0))

    args = (q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32))
    if dtype != jnp.float32:
        return  # bf16 gradients: the values' bound above is the contract
    g_ref = jax.grad(functools.partial(loss, "einsum"), argnums=(0, 1, 2))(*args)
    g_got = jax.grad(functools.partial(loss, "fused"), argnums=(0, 1, 2))(*args)
    for a, b in zip(g_ref, g_got):
        a, b = np.asarray(a), np.asarray(b)
        assert np.all(np.isfinite(b))
        assert np.abs(a - b).max() <= F32_TOL * np.abs(a).max()


def test_fused_falls_back_for_what_it_cannot_express_and_says_so_once(caplog):
    """Packed rows, soft-capped scores and a traced (per-layer) window are not expressible:
    `fused` then gives exactly the unfused choice's output (einsum at this size), and logs
    each reason once."""
    q, k, v, mask = _case("packed", jnp.float32)[:4]
    caplog.set_level("INFO", logger=attn.__name__)
    attn._TOLD.clear()
    cases = [
        (mask, dict(), "packed rows"),
        (_fused_case(jnp.float32)[3], dict(softcap=2.0), "soft-capped scores"),
        (_fused_case(jnp.float32)[3], dict(window=jnp.int32(4)), "differs by layer"),
    ]
    for m, how, why in cases:
        qq, kk, vv = (q, k, v) if m is mask else _fused_case(jnp.float32)[:3]
        for _ in range(2):
            got = attn.attention(qq, kk, vv, m, implementation="fused", **how)
            ref = attn.attention(qq, kk, vv, m, implementation="einsum", **how)
            np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
        told = [r.getMessage() for r in caplog.records if why in r.getMessage()]
        assert len(told) == 1 and "fused falls back" in told[0], told


def test_auto_takes_the_fused_op_on_a_gpu_for_bf16_masks_it_expresses(monkeypatch):
    """Where JAX's backend is a GPU (simulated: the op's XLA implementation stands in for
    cuDNN), `auto` calls the fused op for bfloat16 rows of one sequence, and not for float32
    inputs (cuDNN's dtypes) or packed rows; elsewhere `auto` never does."""
    calls = []
    real_fused = attn.fused_attention

    def spy(*args, **kw):
        calls.append(args[0].dtype)
        return real_fused(*args, **{**kw, "implementation": "xla"})

    monkeypatch.setattr(attn, "fused_attention", spy)
    q, k, v, mask, _ = _fused_case(jnp.bfloat16)
    monkeypatch.setattr(attn, "on_gpu", lambda: False)
    attn.attention(q, k, v, mask, implementation="auto")
    assert calls == []  # not a GPU: auto keeps the einsum / blockwise choice
    monkeypatch.setattr(attn, "on_gpu", lambda: True)
    attn.attention(q, k, v, mask, implementation="auto")
    assert calls == [jnp.bfloat16]
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    assert "float32 inputs" in attn.fused_refusal(f32[0], mask, None, None)
    attn.attention(*f32, mask, implementation="auto")
    packed = _case("packed", jnp.bfloat16)
    attn.attention(*packed[:4], implementation="auto")
    assert calls == [jnp.bfloat16]


# ----------------------------------------------------------------------------- in the decoder


def _grads(model, loss):
    graphdef, params = nnx.split(model)
    return jax.grad(lambda p: loss(nnx.merge(graphdef, p)))(params)


def _assert_grads_close(ga, gb, tol):
    for a, b in zip(jax.tree.leaves(ga), jax.tree.leaves(gb), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert np.abs(a - b).max() <= tol * max(np.abs(a).max(), 1e-30)


def test_decoder_blockwise_equals_einsum_full_and_shared_prefix_forward():
    """The whole decoder with `attention="blockwise"` (tiles of 8 over 23 columns) against
    `attention="einsum"`: the full forward on left-padded rows and the trainer's shared-prompt
    forward, hidden states at real positions and every parameter's gradient within 1e-5."""
    base = model_config()
    models = {
        impl: scrambled(dataclasses.replace(base, attention=impl, attention_block=BLOCK), seed=4)
        for impl in ("einsum", "blockwise")
    }
    b, g, prompt, completion = 2, 3, 9, 14
    rng = np.random.default_rng(3)
    pmask = np.arange(prompt)[None, :] >= np.array([0, 5])[:, None]
    cmask = np.arange(completion)[None, :] < rng.integers(1, completion + 1, b * g)[:, None]
    mask = jnp.asarray(np.concatenate([np.repeat(pmask, g, 0), cmask], 1))
    tokens = jnp.where(mask, jnp.asarray(rng.integers(0, base.vocab_size, mask.shape)), 0)
    positions = gm.positions_from_mask(mask)
    weights = jnp.asarray(rng.standard_normal((b * g, completion, base.hidden_size)))
    cm = mask[:, prompt:, None]

    def full(model):
        return model(tokens, positions_nt=positions, mask_nt=mask)[0]

    def shared(model):
        _, suffix = gm.shared_prefix_forward(
            model, tokens, mask, positions, prefix_width=prompt, group_size=g
        )
        return suffix

    for fwd, cut in ((full, slice(prompt, None)), (shared, slice(None))):
        ref, got = fwd(models["einsum"]), fwd(models["blockwise"])
        diff = jnp.where(cm, ref[:, cut] - got[:, cut], 0.0)
        assert float(jnp.abs(diff).max()) <= F32_TOL * float(jnp.abs(ref).max())

        def loss(model, fwd=fwd, cut=cut):
            return jnp.sum(jnp.where(cm, fwd(model)[:, cut] * weights, 0.0))

        _assert_grads_close(
            _grads(models["einsum"], loss), _grads(models["blockwise"], loss), F32_TOL
        )


@pytest.mark.parametrize("window", [None, 5], ids=["full", "sliding"])
def test_decoder_fused_equals_einsum_on_prompt_and_completion_rows(window, caplog):
    """The whole decoder with `attention="fused"` against `"einsum"` on the trainer's rows
    (a left-padded prompt, a right-padded completion), with and without one sliding window
    for every layer (a Python int through the layer scan): hidden states at real positions
    and every parameter's gradient within 1e-5 (float32); no call fell back."""
    caplog.set_level("INFO", logger=attn.__name__)
    attn._TOLD.clear()
    base = model_config(sliding_window=window)
    models = {
        impl: scrambled(dataclasses.replace(base, attention=impl), seed=5)
        for impl in ("einsum", "fused")
    }
    rng = np.random.default_rng(6)
    prompt, completion, n = 7, 9, 4
    pmask = np.arange(prompt)[None, :] >= np.array([0, 3, 6, 2])[:, None]
    cmask = np.arange(completion)[None, :] < np.array([9, 4, 1, 6])[:, None]
    mask = jnp.asarray(np.concatenate([pmask, cmask], 1))
    tokens = jnp.where(mask, jnp.asarray(rng.integers(0, base.vocab_size, mask.shape)), 0)
    positions = gm.positions_from_mask(mask)
    weights = jnp.asarray(rng.standard_normal((n, prompt + completion, base.hidden_size)))
    real = mask[:, :, None]

    def fwd(model):
        return model(tokens, positions_nt=positions, mask_nt=mask)[0]

    ref, got = fwd(models["einsum"]), fwd(models["fused"])
    assert float(jnp.abs(jnp.where(real, ref - got, 0.0)).max()) <= F32_TOL * float(
        jnp.abs(ref).max()
    )

    def loss(model):
        return jnp.sum(jnp.where(real, fwd(model) * weights, 0.0))

    _assert_grads_close(_grads(models["einsum"], loss), _grads(models["fused"], loss), F32_TOL)
    assert not [r for r in caplog.records if "falls back" in r.getMessage()]


@pytest.mark.parametrize("impl", ["einsum", "blockwise"])
def test_packed_rows_equal_one_sequence_per_row(impl):
    """Three sequences packed into one row (segment ids, each with its own positions) give
    the hidden states, and the parameter gradients, of the same sequences one per row."""
    config = dataclasses.replace(model_config(), attention=impl, attention_block=BLOCK)
    model = scrambled(config, seed=6)
    rng = np.random.default_rng(7)
    lengths = [9, 5, 7]
    seqs = [rng.integers(0, config.vocab_size, n) for n in lengths]
    width = 24  # 21 tokens and 3 of padding
    packed = np.zeros((1, width), np.int32)
    seg = np.zeros((1, width), np.int32)
    pos = np.zeros((1, width), np.int32)
    at = 0
    for i, s in enumerate(seqs):
        packed[0, at : at + len(s)], seg[0, at : at + len(s)] = s, i + 1
        pos[0, at : at + len(s)] = np.arange(len(s))
        at += len(s)
    rows = np.zeros((3, 9), np.int32)
    row_mask = np.zeros((3, 9), bool)
    for i, s in enumerate(seqs):  # right-padded, one sequence a row
        rows[i, : len(s)], row_mask[i, : len(s)] = s, True
    weights = rng.standard_normal((3, 9, config.hidden_size))
    packed_w = np.zeros((1, width, config.hidden_size))
    at = 0
    for i, n in enumerate(lengths):
        packed_w[0, at : at + n] = weights[i, :n]
        at += n

    def packed_fwd(model):
        h, _ = model(
            jnp.asarray(packed), positions_nt=jnp.asarray(pos), segment_ids_nt=jnp.asarray(seg)
        )
        return h

    def rows_fwd(model):
        return model(jnp.asarray(rows), mask_nt=jnp.asarray(row_mask))[0]

    hp, hr = np.asarray(packed_fwd(model)), np.asarray(rows_fwd(model))
    at = 0
    for i, n in enumerate(lengths):
        np.testing.assert_allclose(hp[0, at : at + n], hr[i, :n], atol=F32_TOL * np.abs(hr).max())
        at += n
    gp = _grads(model, lambda m: jnp.sum(packed_fwd(m) * packed_w))
    gr = _grads(
        model, lambda m: jnp.sum(jnp.where(row_mask[..., None], rows_fwd(m) * weights, 0.0))
    )
    _assert_grads_close(gr, gp, F32_TOL)


def test_blockwise_backward_memory_grows_linearly():
    """Compiled scratch bytes of a 2-layer decoder's gradient at T = 512 and 2,048: the
    blockwise path grows about 4x (linear), the einsum path about 16x (its score arrays).
    Through the decoder's layer scan, as the steps run it: a tile loop written as a scan kept
    every tile's scores there, 12x from 4k to 16k tokens (`attention._loop`)."""

    def temp_bytes(impl, t):
        config = model_config(attention=impl, attention_block=128)
        graphdef, params = nnx.split(gm.Decoder(config, rngs=nnx.Rngs(0)))
        tokens = jnp.zeros((1, t), jnp.int32)

        def loss(p):
            return jnp.sum(nnx.merge(graphdef, p)(tokens)[0] ** 2)

        compiled = jax.jit(jax.grad(loss)).lower(params).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    blockwise = temp_bytes("blockwise", 2048) / temp_bytes("blockwise", 512)
    einsum = temp_bytes("einsum", 2048) / temp_bytes("einsum", 512)
    assert blockwise <= 5.0, blockwise
    assert einsum >= 12.0, einsum
