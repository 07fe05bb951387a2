"""Attention test cases shared by the attention paths' tests (test_attention.py: blockwise
against einsum; test_attention_fused.py: the fused op against einsum).

`make_case(kind, dtype)`: q, k, v and the mask of one call of each kind the library makes
(left-padded rows, packed rows, packed groups, new tokens over a shared prefix, over a row
cache); `path_equals_einsum`: a path's values and float32 gradients against the einsum
path's on one case; `fused_case`: rows of one sequence padded every way; `grads_of` and
`assert_grads_close` for decoders; `shared_prompt_rows`: the trainer's rows of groups that
share a prompt, with their full and shared-prompt forwards. Tolerances: float32 within 1e-5
of the reference's own scale; bf16 within 2^-7 of max |v| (both paths round each normalised
probability to bf16 once, relative 2^-9, from float32 values that differ in their last bits,
so a rounding may flip: the weighted sums differ by at most about 2 x 2^-9 max |v|, plus the
output's own bf16 rounding).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import grpojax.models as gm
from grpojax.models import attention as attn

F32_TOL = 1e-5
BF16_TOL = 2.0**-7
BLOCK = 8  # tiles far smaller than T, so every case runs several tiles, some of them empty


def rand(rng, shape, dtype):
    return jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dtype)


def make_case(kind, dtype, seed=0):
    """(q, k, v, mask, extras, real): N=4 rows, T=21 new tokens, 4 query / 2 kv heads, H=8;
    the mask's positions as the library gives them (each sequence's own; a packed
    completion's after its parent prompt's; new tokens after the prefix's or cache's)."""
    rng = np.random.default_rng(seed)
    n, t, q_heads, kv_heads, h = 4, 21, 4, 2, 8
    q = rand(rng, (n, t, q_heads, h), dtype)
    k = rand(rng, (n, t, kv_heads, h), dtype)
    v = rand(rng, (n, t, kv_heads, h), dtype)
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
            pk = rand(rng, (b, kv_heads, h, p), dtype)
            pv = rand(rng, (b, kv_heads, p, h), dtype)
            p_real = np.arange(p)[None, :] >= np.array([0, 6])[:, None]  # left-padded prompts
            extras["prefix"] = (pk, pv, jnp.asarray(p_real))
            before = np.repeat(p_real.sum(1, keepdims=True), n // b, axis=0)
        if kind == "cache":
            s = 11
            ck = rand(rng, (n, kv_heads, h, s), dtype)
            cv = rand(rng, (n, kv_heads, s, h), dtype)
            c_real = np.arange(s)[None, :] < np.array([11, 4, 0, 7])[:, None]  # row 2: empty
            extras["cache"] = (ck, cv, jnp.asarray(c_real))
            before = c_real.sum(1, keepdims=True)
        pos = before + np.maximum(np.cumsum(real, axis=1) - 1, 0)
        mask = attn.SelfMask.from_mask(jnp.asarray(real), positions=jnp.asarray(pos))
    return q, k, v, mask, extras, jnp.asarray(real)


def run_path(impl, q, k, v, mask, extras, prefix_kv=None, cache_kv=None, **how):
    """`attention_with_cache` by `impl`; `how`: window, scale, softcap."""
    kw = {}
    if "prefix" in extras:
        kw["prefix"] = (*prefix_kv, extras["prefix"][2])
    if "cache" in extras:
        kw["cache"] = (*cache_kv, extras["cache"][2])
    return attn.attention_with_cache(q, k, v, mask, implementation=impl, block=BLOCK, **kw, **how)


def path_equals_einsum(kind, dtype, impl, **how):
    """The `impl` path against the einsum path on `make_case(kind, dtype)` with `how`
    (window, scale, softcap): values at real queries and, in float32, the gradients of q, k,
    v and the prefix's / cache's keys and values. Returns the case and (einsum, blockwise)."""
    q, k, v, mask, extras, real = case = make_case(kind, dtype)
    pkv = extras.get("prefix", (None, None))[:2]
    ckv = extras.get("cache", (None, None))[:2]
    w = jnp.asarray(np.random.default_rng(9).standard_normal(q.shape), jnp.float32)
    w = jnp.where(real[:, :, None, None], w, 0.0)  # padded queries' outputs are not compared

    def loss(impl):
        def f(q, k, v, pkv, ckv):
            out = run_path(impl, q, k, v, mask, extras, pkv, ckv, **how)
            return jnp.sum(out.astype(jnp.float32) * w)

        return f

    args = (q, k, v, pkv, ckv)
    ref = run_path("einsum", *args[:3], mask, extras, pkv, ckv, **how)
    got = run_path(impl, *args[:3], mask, extras, pkv, ckv, **how)
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
    g_got = jax.grad(loss(impl), argnums=(0, 1, 2, 3, 4))(*args)
    leaves = 0
    for a, b in zip(jax.tree.leaves(g_ref), jax.tree.leaves(g_got), strict=True):
        leaves += 1
        a, b = np.asarray(a), np.asarray(b)
        assert np.abs(a).max() > 0
        assert np.abs(a - b).max() <= F32_TOL * np.abs(a).max()
    assert leaves == 3 + 2 * (kind in ("prefix", "cache"))
    return case, (ref, got)


# ----------------------------------------------------------------- window, scale, softcap


def fused_case(dtype, seed=0):
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
    q = rand(rng, (n, t, q_heads, h), dtype)
    k = rand(rng, (n, t, kv_heads, h), dtype)
    v = rand(rng, (n, t, kv_heads, h), dtype)
    return q, k, v, mask, jnp.asarray(real)


def grads_of(model, loss):
    graphdef, params = nnx.split(model)
    return jax.grad(lambda p: loss(nnx.merge(graphdef, p)))(params)


def assert_grads_close(ga, gb, tol):
    for a, b in zip(jax.tree.leaves(ga), jax.tree.leaves(gb), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert np.abs(a - b).max() <= tol * max(np.abs(a).max(), 1e-30)


class SharedPromptRows(NamedTuple):
    """B = 2 ragged left-padded prompts of P = 9 columns (the second padded by 5), each
    repeated for its G = 3 ragged completions of 14 columns: tokens, mask and positions
    `[6, 23]`, loss weights `[6, 14, D]` and the completions' mask `[6, 14, 1]`."""

    tokens: jax.Array
    mask: jax.Array
    positions: jax.Array
    weights: jax.Array
    completion_mask: jax.Array
    prompt: int
    group: int

    def full(self, model) -> jax.Array:
        """The hidden states of the whole rows `[6, 23, D]`."""
        return model(self.tokens, positions_nt=self.positions, mask_nt=self.mask)[0]

    def shared(self, model) -> jax.Array:
        """The completions' hidden states `[6, 14, D]` of the trainer's shared-prompt
        forward (`shared_prefix_forward`: each prompt run once)."""
        return gm.shared_prefix_forward(
            model,
            self.tokens,
            self.mask,
            self.positions,
            prefix_width=self.prompt,
            group_size=self.group,
        )[1]


def shared_prompt_rows(config: gm.ModelConfig) -> SharedPromptRows:
    """`SharedPromptRows` of random tokens of `config`'s vocabulary (seed 3)."""
    b, g, prompt, completion = 2, 3, 9, 14
    rng = np.random.default_rng(3)
    pmask = np.arange(prompt)[None, :] >= np.array([0, 5])[:, None]
    cmask = np.arange(completion)[None, :] < rng.integers(1, completion + 1, b * g)[:, None]
    mask = jnp.asarray(np.concatenate([np.repeat(pmask, g, 0), cmask], 1))
    tokens = jnp.where(mask, jnp.asarray(rng.integers(0, config.vocab_size, mask.shape)), 0)
    weights = jnp.asarray(rng.standard_normal((b * g, completion, config.hidden_size)))
    return SharedPromptRows(
        tokens, mask, gm.positions_from_mask(mask), weights, mask[:, prompt:, None], prompt, g
    )
