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

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import (
    BLOCK,
    F32_TOL,
    assert_grads_close,
    grads_of,
    make_case,
    path_equals_einsum,
    rand,
    run_path,
    shared_prompt_rows,
)
from flax import nnx
from model_fixtures import model_config, scrambled

import grpojax.models as gm
from grpojax.models import attention as attn


@pytest.mark.parametrize("kind", ["causal", "packed", "packed_shared", "prefix", "cache"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_blockwise_equals_einsum_values_and_gradients(kind, dtype):
    path_equals_einsum(kind, dtype, "blockwise")


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
    case, outs = path_equals_einsum(kind, dtype, "blockwise", **how)
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
    draw = lambda *shape: rand(rng, shape, jnp.float32)
    pk, pv = draw(b, kv_heads, h, p), draw(b, kv_heads, p, h)
    ck, cv = draw(n, kv_heads, h, s), draw(n, kv_heads, s, h)
    q, k, v = draw(n, 1, q_heads, h), draw(n, 1, kv_heads, h), draw(n, 1, kv_heads, h)
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
    q, k, v, mask, extras, real = make_case("prefix", jnp.float32)
    pkv, sel = extras["prefix"][:2], np.asarray(real)

    def both(window):
        outs = [
            run_path(impl, q, k, v, mask, extras, pkv, window=window)
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
    q = rand(rng, (1, 1, 1, 24, 4), jnp.float32)
    k = rand(rng, (1, 1, 24, 4), jnp.float32)
    v = rand(rng, (1, 1, 24, 4), jnp.float32).at[:, :, :8].set(jnp.nan)
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
    q, k, v, mask, _, _ = make_case("causal", jnp.float32)
    for impl in ("einsum", "blockwise"):
        with pytest.raises(ValueError, match="a sliding window compares positions"):
            attn.attention(q, k, v, mask._replace(positions=None), implementation=impl, window=2)


def test_queries_that_read_nothing_stay_finite_with_zero_gradient():
    """A packed row's padding tail reads no key: output 0, log-sum-exp NEG_INF, and the
    gradient it passes back is 0 (a NaN there would poison the real tokens' gradients)."""
    rng = np.random.default_rng(1)
    q = rand(rng, (1, 2, 1, 10, 4), jnp.float32)
    k = rand(rng, (1, 2, 10, 4), jnp.float32)
    v = rand(rng, (1, 2, 10, 4), jnp.float32)
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


def test_decoder_blockwise_equals_einsum_full_and_shared_prefix_forward():
    """The whole decoder with `attention="blockwise"` (tiles of 8 over 23 columns) against
    `attention="einsum"`: the full forward on left-padded rows and the trainer's shared-prompt
    forward, hidden states at real positions and every parameter's gradient within 1e-5."""
    base = model_config()
    models = {
        impl: scrambled(dataclasses.replace(base, attention=impl, attention_block=BLOCK), seed=4)
        for impl in ("einsum", "blockwise")
    }
    rows = shared_prompt_rows(base)
    cm = rows.completion_mask
    for fwd, cut in ((rows.full, slice(rows.prompt, None)), (rows.shared, slice(None))):
        ref, got = fwd(models["einsum"]), fwd(models["blockwise"])
        diff = jnp.where(cm, ref[:, cut] - got[:, cut], 0.0)
        assert float(jnp.abs(diff).max()) <= F32_TOL * float(jnp.abs(ref).max())

        def loss(model, fwd=fwd, cut=cut):
            return jnp.sum(jnp.where(cm, fwd(model)[:, cut] * rows.weights, 0.0))

        assert_grads_close(
            grads_of(models["einsum"], loss), grads_of(models["blockwise"], loss), F32_TOL
        )


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
    gp = grads_of(model, lambda m: jnp.sum(packed_fwd(m) * packed_w))
    gr = grads_of(
        model, lambda m: jnp.sum(jnp.where(row_mask[..., None], rows_fwd(m) * weights, 0.0))
    )
    assert_grads_close(gr, gp, F32_TOL)


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
