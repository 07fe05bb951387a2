"""The blockwise attention path against the einsum reference, on every mask the project uses.

Cases: left-padded rows (causal), packed rows (segment ids), packed groups (completions that
also read their group's prompt segment), new tokens over a shared prompt prefix read by
groups of rows, new tokens over a row cache, and queries that may read nothing. Values and
the gradients of q, k, v (and of the prefix's and cache's keys and values) are compared in
float32 within 1e-5 of the reference's own scale, and in bf16 within 2^-7 of max |v|: both
paths round each normalised probability to bf16 once (relative 2^-9), from float32 values
that differ in their last bits (a different order of the softmax's sums), so a rounding
may flip: the weighted sums differ by at most about 2 x 2^-9 max |v|, plus the output's own
bf16 rounding. Then a decoder whose layers use the blockwise path equals the
einsum decoder (hidden states and parameter gradients), packed rows equal the same
sequences one per row, and the compiled backward's scratch memory grows about linearly with
the length, not quadratically.
"""

from __future__ import annotations

import dataclasses

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
    """(q, k, v, mask, extras): N=4 rows, T=21 new tokens, 4 query / 2 kv heads, H=8."""
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
        if kind == "packed_shared":  # segments 2 and 3: completions reading prompt 1
            parent = np.where(seg >= 2, 1, 0).astype(np.int32)
            parent = jnp.asarray(parent)
        mask = attn.SelfMask.packed(jnp.asarray(seg), parent)
        real = seg > 0
    else:
        # left padding (a prompt) for "causal"; right padding (a completion) otherwise
        lengths = np.array([21, 14, 5, 1])
        cols = np.arange(t)[None, :]
        if kind == "causal":
            real = cols >= (t - lengths)[:, None]
        else:
            real = cols < lengths[:, None]
        mask = attn.SelfMask.from_mask(jnp.asarray(real))
    if kind == "prefix":
        b, p = 2, 13
        pk = _rand(rng, (b, kv_heads, h, p), dtype)
        pv = _rand(rng, (b, kv_heads, p, h), dtype)
        p_real = np.arange(p)[None, :] >= np.array([0, 6])[:, None]  # left-padded prompts
        extras["prefix"] = (pk, pv, jnp.asarray(p_real))
    if kind == "cache":
        s = 11
        ck = _rand(rng, (n, kv_heads, h, s), dtype)
        cv = _rand(rng, (n, kv_heads, s, h), dtype)
        c_real = np.arange(s)[None, :] < np.array([11, 4, 0, 7])[:, None]  # row 2: empty
        extras["cache"] = (ck, cv, jnp.asarray(c_real))
    return q, k, v, mask, extras, jnp.asarray(real)


def _run(impl, q, k, v, mask, extras, prefix_kv=None, cache_kv=None):
    kw = {}
    if "prefix" in extras:
        kw["prefix"] = (*prefix_kv, extras["prefix"][2])
    if "cache" in extras:
        kw["cache"] = (*cache_kv, extras["cache"][2])
    return attn.attention_with_cache(q, k, v, mask, implementation=impl, block=BLOCK, **kw)


@pytest.mark.parametrize("kind", ["causal", "packed", "packed_shared", "prefix", "cache"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_blockwise_equals_einsum_values_and_gradients(kind, dtype):
    q, k, v, mask, extras, real = _case(kind, dtype)
    pkv = extras.get("prefix", (None, None))[:2]
    ckv = extras.get("cache", (None, None))[:2]
    w = jnp.asarray(np.random.default_rng(9).standard_normal(q.shape), jnp.float32)
    w = jnp.where(real[:, :, None, None], w, 0.0)  # padded queries' outputs are not compared

    def loss(impl):
        def f(q, k, v, pkv, ckv):
            out = _run(impl, q, k, v, mask, extras, pkv, ckv)
            return jnp.sum(out.astype(jnp.float32) * w)

        return f

    args = (q, k, v, pkv, ckv)
    ref, got = _run("einsum", *args[:3], mask, extras, pkv, ckv), None
    got = _run("blockwise", *args[:3], mask, extras, pkv, ckv)
    assert got.dtype == dtype and got.shape == q.shape
    sel = np.asarray(real)
    ref32, got32 = np.asarray(ref, np.float32)[sel], np.asarray(got, np.float32)[sel]
    vmax = max(
        float(jnp.abs(x.astype(jnp.float32)).max()) for x in (v, *pkv, *ckv) if x is not None
    )
    bound = F32_TOL * np.abs(ref32).max() if dtype == jnp.float32 else BF16_TOL * vmax
    assert np.abs(got32 - ref32).max() <= bound
    if dtype != jnp.float32:
        return
    g_ref = jax.grad(loss("einsum"), argnums=(0, 1, 2, 3, 4))(*args)
    g_got = jax.grad(loss("blockwise"), argnums=(0, 1, 2, 3, 4))(*args)
    leaves = 0
    for a, b in zip(jax.tree.leaves(g_ref), jax.tree.leaves(g_got), strict=True):
        leaves += 1
        a, b = np.asarray(a), np.asarray(b)
        assert np.abs(a).max() > 0
        assert np.abs(a - b).max() <= F32_TOL * np.abs(a).max()
    assert leaves == 3 + 2 * (kind in ("prefix", "cache"))


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
        ValueError, match=r"attention must be one of \('auto', 'einsum', 'blockwise'\), got 'flash'"
    ):
        attn.resolve("flash", 1, 1)
    with pytest.raises(ValueError, match="attention must be one of"):
        model_config(attention="flash")


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
