"""Decoder behaviour without transformers: KV-cache decoding, heads, remat, config, tokenizer.

Equivalences: prefill + one-token decode steps == full forward (<= 1e-5 f32) on
left-padded prompts, also after repeating a prefilled cache along the batch (the
sampler's prompt sharing); remat policies change memory, not values; reward read at
the last real token is padding-invariant. RoPE and RMSNorm against NumPy references.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from model_fixtures import cached_decode_logits, dot_generals, model_config, scrambled

import grpojax.models as gm
from grpojax.models import decoder as dec
from grpojax.models import lora

CACHE_TOL = 1e-5  # float32, as the issue specifies


def _left_padded(seed, n, t, lengths, vocab):
    rng = np.random.default_rng(seed)
    mask = np.arange(t)[None, :] >= (t - np.asarray(lengths))[:, None]
    tokens = np.where(mask, rng.integers(0, vocab, size=(n, t)), 0)
    return jnp.asarray(tokens), jnp.asarray(mask)


# ----------------------------------------------------------------------------- references


def test_rope_and_rmsnorm_match_numpy():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 4, 8)).astype(np.float32)
    pos = np.array([[0, 1, 5], [2, 3, 4]])
    inv = 1.0 / (10000.0 ** (np.arange(0, 8, 2) / 8))
    # Reference: rotate each (x_i, x_{i+H/2}) pair by angle pos * inv_freq_i.
    ang = pos[..., None, None] * inv  # [N, T, 1, H/2]
    a, b = x[..., :4], x[..., 4:]
    ref = np.concatenate([a * np.cos(ang) - b * np.sin(ang), b * np.cos(ang) + a * np.sin(ang)], -1)
    cos, sin = dec.rope_angles(jnp.asarray(pos), jnp.asarray(inv, jnp.float32))
    np.testing.assert_allclose(dec.rope(jnp.asarray(x), cos, sin), ref, atol=1e-5)

    w = rng.standard_normal(8).astype(np.float32)
    ref_norm = w * x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(
        dec.rms_norm(jnp.asarray(x), jnp.asarray(w), 1e-6), ref_norm, rtol=1e-5
    )


def test_llama3_inv_freq_matches_hand_formula():
    rs = gm.RopeScaling(8.0, 1.0, 4.0, 64)
    cfg = model_config(rope_theta=500000.0, rope_scaling=rs)
    base = 1.0 / 500000.0 ** (np.arange(0, 16, 2) / 16)
    wavelen = 2 * np.pi / base
    expected = []
    for f, w in zip(base, wavelen):
        if w < 64 / 4:
            expected.append(f)
        elif w > 64 / 1:
            expected.append(f / 8)
        else:
            s = (64 / w - 1) / (4 - 1)
            expected.append((1 - s) * f / 8 + s * f)
    np.testing.assert_allclose(cfg.inv_freq(), expected, rtol=1e-5)


def test_positions_and_last_index():
    mask = jnp.array([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [0, 0, 0, 0, 0]], bool)
    np.testing.assert_array_equal(
        gm.positions_from_mask(mask), [[0, 0, 0, 1, 2], [0, 1, 2, 2, 2], [0, 0, 0, 0, 0]]
    )
    np.testing.assert_array_equal(gm.last_token_index(mask), [4, 2, 0])


# ----------------------------------------------------------------------------- KV cache


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_prefill_then_decode_equals_full_forward(kv_heads):
    config = model_config(num_kv_heads=kv_heads)
    model = scrambled(config, seed=kv_heads)
    n, prompt, steps = 3, 7, 5
    t = prompt + steps
    # Left-padded prompts of different lengths, then `steps` real decoded tokens each.
    tokens, prompt_mask = _left_padded(1, n, prompt, [7, 4, 1], config.vocab_size)
    rng = np.random.default_rng(2)
    tokens = jnp.concatenate([tokens, jnp.asarray(rng.integers(0, 64, (n, steps)))], axis=1)
    mask = jnp.concatenate([prompt_mask, jnp.ones((n, steps), bool)], axis=1)
    full = gm.forward_logits(model, tokens, mask)
    inc, cache = cached_decode_logits(model, tokens, mask, prompt=prompt, cache_len=t + 3)
    assert int(cache.index) == t
    np.testing.assert_array_equal(np.asarray(cache.mask_ns[:, :t]), np.asarray(mask))
    assert not bool(cache.mask_ns[:, t:].any())
    err = np.abs(np.asarray(inc - full))[np.asarray(mask)]
    assert err.max() <= CACHE_TOL


def test_prefix_cache_shared_by_group_equals_full_forward():
    """The sampler's layout: B prompts prefilled once into a prefix cache that groups of G
    rows read, and each row's completion in a cache of its own. Decoding 3 tokens one at a
    time, and the 3 tokens in one call without a row cache, give the full N-row forward's
    logits (<= CACHE_TOL); prefilling them into a row cache writes the decoded keys."""
    config = model_config()
    model = scrambled(config, seed=3)
    b, g, prompt, steps = 2, 3, 5, 3
    n = b * g
    prompts, pmask = _left_padded(4, b, prompt, [5, 2], config.vocab_size)
    ppos = gm.positions_from_mask(pmask)
    prefix = gm.init_cache(config, b, prompt)
    _, prefix = model(prompts, positions_nt=ppos, mask_nt=pmask, cache=prefix, prefill=True)
    comp = jnp.asarray(np.random.default_rng(5).integers(0, config.vocab_size, (n, steps)))
    comp_pos = jnp.repeat(ppos[:, -1:], g, axis=0) + 1 + jnp.arange(steps)[None, :]
    one = jnp.ones((n, 1), bool)

    full_tokens = jnp.concatenate([jnp.repeat(prompts, g, axis=0), comp], axis=1)
    full_mask = jnp.concatenate([jnp.repeat(pmask, g, axis=0), jnp.ones((n, steps), bool)], 1)
    want = gm.forward_logits(model, full_tokens, full_mask)[:, prompt:]

    cache = gm.init_cache(config, n, steps)
    for t in range(steps):
        hidden, cache = model(
            comp[:, t : t + 1],
            positions_nt=comp_pos[:, t : t + 1],
            mask_nt=one,
            cache=cache,
            prefix=prefix,
        )
        assert np.abs(np.asarray(model.logits(hidden)[:, 0] - want[:, t])).max() <= CACHE_TOL
    assert int(cache.index) == steps and bool(cache.mask_ns.all())

    hidden, none = model(comp, positions_nt=comp_pos, prefix=prefix)
    assert none is None
    assert np.abs(np.asarray(model.logits(hidden) - want)).max() <= CACHE_TOL
    # The same 3 tokens prefilled into a fresh row cache: the keys the decode loop wrote.
    fresh = gm.init_cache(config, n, steps)
    h_pre, filled = model(comp, positions_nt=comp_pos, prefix=prefix, cache=fresh, prefill=True)
    assert np.abs(np.asarray(h_pre - hidden)).max() <= CACHE_TOL
    for a, c in ((filled.k, cache.k), (filled.v, cache.v)):
        assert np.abs(np.asarray(a - c)).max() <= CACHE_TOL

    with pytest.raises(ValueError, match=r"prefix rows \(2\) must divide the 5 rows"):
        model(comp[:5], positions_nt=comp_pos[:5], prefix=prefix)
    with pytest.raises(ValueError, match="positions_nt is required with a cache or a prefix"):
        model(comp, prefix=prefix)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(),  # qwen3: q/k norms
        dict(model_type="qwen2", qk_norm=False, qkv_bias=True),
        dict(model_type="llama", qk_norm=False, num_kv_heads=1),
    ],
    ids=["qwen3", "qwen2_bias", "llama_mqa"],
)
def test_fused_layer_params_give_the_same_forward_and_cache(overrides):
    """`layer_params(fuse=True)` (q|k|v and gate|up as one matmul each, the sampler's
    weights) gives the separate projections' hidden states, and the same cache and logits
    through a prefill and two decode steps (<= CACHE_TOL); with LoRA adapters active the
    projections stay apart and the adapters still act."""
    config = model_config(**overrides)
    model = scrambled(config, seed=11)
    fused = model.layer_params(fuse=True)
    L, D, F = config.num_layers, config.hidden_size, config.intermediate_size
    qkv_width = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    assert fused["wqkv"].shape == (L, D, qkv_width)
    assert fused["w_gate_up"].shape == (L, D, 2 * F)
    assert not {"wq", "wk", "wv", "w_gate", "w_up"} & set(fused)
    apart = model.layer_params()
    for name in ("wo", "w_down", "attn_norm"):
        np.testing.assert_array_equal(np.asarray(fused[name]), np.asarray(apart[name]))

    n, prompt, steps = 3, 6, 2
    tokens, pmask = _left_padded(12, n, prompt, [6, 3, 1], config.vocab_size)
    h_apart, _ = model(tokens, mask_nt=pmask)
    h_fused, _ = model(tokens, mask_nt=pmask, layer_params=fused)
    assert np.abs(np.asarray(h_fused - h_apart))[np.asarray(pmask)].max() <= CACHE_TOL

    comp = jnp.asarray(np.random.default_rng(13).integers(0, config.vocab_size, (n, steps)))
    full = jnp.concatenate([tokens, comp], axis=1)
    full_mask = jnp.concatenate([pmask, jnp.ones((n, steps), bool)], axis=1)
    decode = lambda params: cached_decode_logits(
        model,
        full,
        full_mask,
        prompt=prompt,
        cache_len=prompt + steps,
        prefill=True,
        layer_params=params,
    )
    (l_a, c_a), (l_f, c_f) = decode(None), decode(fused)
    assert np.abs(np.asarray(l_f - l_a))[np.asarray(full_mask)].max() <= CACHE_TOL
    for a, f in ((c_a.k, c_f.k), (c_a.v, c_f.v)):
        assert np.abs(np.asarray(f - a)).max() <= CACHE_TOL

    lora.add_lora(model, lora.LoRAConfig(rank=2, alpha=4.0), rngs=nnx.Rngs(14))
    for name in model.lora.names():
        var = getattr(model.lora, name)
        var.set_value(0.1 * jax.random.normal(jax.random.key(15), var.shape, var[...].dtype))
    with_adapters = model.layer_params(fuse=True)
    assert "wq" in with_adapters and "wqkv" not in with_adapters
    assert any(name.startswith("lora_") for name in with_adapters)
    h_lora, _ = model(tokens, mask_nt=pmask, layer_params=with_adapters)
    h_lora_default, _ = model(tokens, mask_nt=pmask)
    np.testing.assert_array_equal(np.asarray(h_lora), np.asarray(h_lora_default))
    assert np.abs(np.asarray(h_lora - h_apart))[np.asarray(pmask)].max() > 1e-3


def test_prefill_flag_skips_the_empty_cache():
    """`prefill=True` into a fresh cache: the same hidden states, cache and next decode step as
    attending to the (empty) cache, with the cache attention's two matmuls gone."""
    config = model_config()
    model = scrambled(config, seed=5)
    graphdef, state = nnx.split(model)
    prompts, pmask = _left_padded(6, 3, 6, [6, 3, 1], config.vocab_size)
    ppos = gm.positions_from_mask(pmask)
    real = np.asarray(pmask)

    def prefill(state, flag):
        m = nnx.merge(graphdef, state)
        cache = gm.init_cache(config, 3, 8)
        return m(prompts, positions_nt=ppos, mask_nt=pmask, cache=cache, prefill=flag)

    (h_read, c_read), (h_pre, c_pre) = prefill(state, False), prefill(state, True)
    assert np.abs(np.asarray(h_read - h_pre))[real].max() <= CACHE_TOL
    np.testing.assert_array_equal(np.asarray(c_pre.mask_ns), np.asarray(c_read.mask_ns))
    assert int(c_pre.index) == int(c_read.index) == 6
    # Keys `[L, N, K, H, S]`, values `[L, N, K, S, H]`: compare the real slots.
    for a, b in ((jnp.swapaxes(c_read.k, 3, 4), jnp.swapaxes(c_pre.k, 3, 4)), (c_read.v, c_pre.v)):
        diff = np.abs(np.asarray(a - b))[:, :, :, :6].transpose(1, 3, 0, 2, 4)
        assert diff[real].max() <= CACHE_TOL
    nxt = jnp.asarray([[1], [2], [3]], jnp.int32)
    pos = ppos[:, -1:] + 1
    one = jnp.ones((3, 1), bool)
    h1 = model(nxt, positions_nt=pos, mask_nt=one, cache=c_read)[0]
    h2 = model(nxt, positions_nt=pos, mask_nt=one, cache=c_pre)[0]
    assert np.abs(np.asarray(model.logits(h1) - model.logits(h2))).max() <= CACHE_TOL
    n_pre = len(dot_generals(lambda s: prefill(s, True), state))
    assert n_pre == len(dot_generals(lambda s: prefill(s, False), state)) - 2
    with pytest.raises(ValueError, match="prefill=True needs the"):
        model(prompts, positions_nt=ppos, mask_nt=pmask, prefill=True)


def test_cache_extent_reads_only_the_leading_slots():
    """`cache_extent` e: a step reads only the cache's first e slots. With 6 prefilled slots
    (the new token is written at slot 6 and attends to itself apart), e = 6 gives the same
    step as reading all 8 slots (logits and written cache within CACHE_TOL), and the program
    copies e slots of each layer's keys and values (its dynamic slices are e wide); e = 5
    misses a filled slot and changes the step; e outside [1, S] is an error."""
    config = model_config()
    model = scrambled(config, seed=6)
    prompts, pmask = _left_padded(7, 3, 6, [6, 4, 2], config.vocab_size)
    ppos = gm.positions_from_mask(pmask)
    cache = gm.init_cache(config, 3, 8)
    _, cache = model(prompts, positions_nt=ppos, mask_nt=pmask, cache=cache, prefill=True)
    nxt = jnp.asarray([[1], [2], [3]], jnp.int32)
    pos = ppos[:, -1:] + 1

    def step(extent):
        hidden, out = model(nxt, positions_nt=pos, cache=cache, cache_extent=extent)
        return model.logits(hidden), out

    (l_all, c_all), (l_6, c_6) = step(None), step(6)
    assert np.abs(np.asarray(l_6 - l_all)).max() <= CACHE_TOL
    for a, b in ((c_all.k, c_6.k), (c_all.v, c_6.v)):
        assert np.abs(np.asarray(a - b)).max() <= CACHE_TOL
    assert np.abs(np.asarray(step(5)[0] - l_all)).max() > 1e-3
    text = jax.jit(step, static_argnums=0).lower(6).as_text()
    k, h = config.num_kv_heads, config.head_dim
    assert f"sizes = [1, 3, {k}, {h}, 6]" in text and f"sizes = [1, 3, {k}, 6, {h}]" in text
    assert f"sizes = [1, 3, {k}, {h}, 8]" not in text
    for bad in (0, 9):
        with pytest.raises(ValueError, match=r"cache_extent must be in \[1, 8\], got"):
            step(bad)


def _grouped_batch(config, b, g, prompt, completion, prompt_lengths, seed):
    """B left-padded prompts, each repeated G times, then G different ragged completions."""
    prompts, pmask = _left_padded(seed, b, prompt, prompt_lengths, config.vocab_size)
    rng = np.random.default_rng(seed + 1)
    comp = jnp.asarray(rng.integers(0, config.vocab_size, (b * g, completion)))
    cmask = (
        jnp.arange(completion)[None, :]
        < jnp.asarray(rng.integers(1, completion + 1, b * g))[:, None]
    )
    tokens = jnp.concatenate([jnp.repeat(prompts, g, axis=0), comp], axis=1)
    mask = jnp.concatenate([jnp.repeat(pmask, g, axis=0), cmask], axis=1)
    return tokens, mask


def test_shared_prefix_forward_equals_full_forward_values_and_gradients():
    """Each prompt run once (B rows) + suffixes reading its cache as their prefix == the
    full N-row forward: hidden states <= 1e-5, and the gradient of a loss on the suffix hidden
    states (which reaches the prompt only through the prefix cache) <= 1e-5 relative."""
    config = model_config()
    model = scrambled(config, seed=5)
    b, g, prompt, completion = 3, 4, 6, 5
    tokens, mask = _grouped_batch(config, b, g, prompt, completion, [6, 3, 1], seed=6)
    positions = gm.positions_from_mask(mask)
    graphdef, params = nnx.split(model)
    weights = jnp.asarray(np.random.default_rng(7).standard_normal((b * g, completion, 32)))

    def full(params):
        hidden, _ = nnx.merge(graphdef, params)(tokens, positions_nt=positions, mask_nt=mask)
        return hidden[::g, :prompt], hidden[:, prompt:]

    def shared(params):
        return gm.shared_prefix_forward(
            nnx.merge(graphdef, params),
            tokens,
            mask,
            positions,
            prefix_width=prompt,
            group_size=g,
        )

    (fp, fs), (sp, ss) = full(params), shared(params)
    assert sp.shape == (b, prompt, 32) and ss.shape == (b * g, completion, 32)
    pm, cm = np.asarray(mask[::g, :prompt]), np.asarray(mask[:, prompt:])
    assert np.abs(np.asarray(sp - fp))[pm].max() <= CACHE_TOL
    assert np.abs(np.asarray(ss - fs))[cm].max() <= CACHE_TOL

    def loss(fn):
        return lambda params: jnp.sum(jnp.where(cm[..., None], fn(params)[1] * weights, 0.0))

    g_full = jax.grad(loss(full))(params)
    g_shared = jax.grad(loss(shared))(params)
    nonzero = 0
    for a, c in zip(jax.tree.leaves(g_full), jax.tree.leaves(g_shared), strict=True):
        scale = float(jnp.abs(a).max())  # 0 only for the unused LM head
        nonzero += scale > 0
        assert float(jnp.abs(a - c).max()) <= CACHE_TOL * scale
    assert nonzero >= len(jax.tree.leaves(g_full)) - 1


def test_shared_prefix_forward_bad_arguments():
    config = model_config()
    model = gm.Decoder(config, rngs=nnx.Rngs(0))
    tokens, mask = _grouped_batch(config, 2, 3, 4, 3, [4, 2], seed=1)
    pos = gm.positions_from_mask(mask)
    with pytest.raises(ValueError, match="group_size G=4 must be >= 1 and divide the 6 rows"):
        gm.shared_prefix_forward(model, tokens, mask, pos, prefix_width=4, group_size=4)
    with pytest.raises(ValueError, match=r"prefix_width P=7 must be in \[1, S\) with S=7"):
        gm.shared_prefix_forward(model, tokens, mask, pos, prefix_width=7, group_size=3)


def test_cache_requires_positions():
    config = model_config()
    model = gm.Decoder(config, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="positions_nt"):
        model(jnp.zeros((1, 2), jnp.int32), cache=gm.init_cache(config, 1, 4))


# ----------------------------------------------------------------------------- remat, grad, dtype


@pytest.mark.parametrize("policy", ["full", "dots", "dots_no_batch"])
def test_remat_changes_nothing_numerically(policy):
    config = model_config()
    tokens, mask = _left_padded(5, 2, 6, [6, 3], config.vocab_size)

    def loss(model):
        return jnp.sum(gm.forward_logits(model, tokens, mask) ** 2 * mask[..., None])

    plain = scrambled(config, seed=7)
    remat = scrambled(dataclasses.replace(config, remat=policy), seed=7)
    g_plain = nnx.grad(loss)(plain)
    g_remat = nnx.grad(loss)(remat)
    np.testing.assert_allclose(loss(remat), loss(plain), rtol=1e-6)
    # Recomputation reorders float32 sums, so compare each gradient relative to its own
    # scale: max |g_remat - g| <= 1e-5 * max |g| (a wrong residual would be O(max |g|)).
    for a, b in zip(jax.tree.leaves(g_plain), jax.tree.leaves(g_remat)):
        a, b = np.asarray(a), np.asarray(b)
        assert np.abs(b - a).max() <= 1e-5 * np.abs(a).max()


def test_auto_remat_keeps_projections_while_they_fit_half_the_device():
    """`model.remat=auto`'s rule, by hand: Qwen2.5-7B's projections (Q H 3,584, K H 512,
    D 3,584, F 18,944, 28 layers, bf16) are 2 x 28 x (3,584 + 1,024 + 37,888 + 7,168) x 2 =
    5.56 MB a token; an 80 GB device's half holds 7,191 tokens of them: a 4k+1k row
    keeps them, a 16k+1k row recomputes them; tensor 2 halves all but the D-wide ones; no
    reported memory (a CPU) keeps them."""
    config = gm.ModelConfig(
        model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
        num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128, dtype="bfloat16",
    )  # fmt: skip
    per_token = 2 * 28 * (3584 + 1024 + 37888 + 7168) * 2
    assert gm.config.kept_projection_bytes(config, 1000) == 1000 * per_token
    tp2 = 2 * 28 * ((3584 + 1024 + 37888) / 2 + 7168) * 2
    assert gm.config.kept_projection_bytes(config, 1000, tensor=2) == int(1000 * tp2)
    gpu = 80 * 10**9
    assert gm.config.auto_remat(config, 5120, gpu)[0] == "dots_no_batch"
    assert gm.config.auto_remat(config, 7191, gpu)[0] == "dots_no_batch"
    assert gm.config.auto_remat(config, 7192, gpu)[0] == "full"
    policy, why = gm.config.auto_remat(config, 17408, gpu)
    assert policy == "full" and "96.8 GB" in why and "over 40.0 GB" in why, why
    assert gm.config.auto_remat(config, 10**6, None)[0] == "dots_no_batch"


def test_padding_does_not_leak_into_real_positions():
    config = model_config()
    model = scrambled(config, seed=8)
    tokens, mask = _left_padded(6, 2, 6, [4, 4], config.vocab_size)
    other_pad = jnp.where(mask, tokens, 17)  # different values at padded slots only
    a = gm.forward_logits(model, tokens, mask)
    b = gm.forward_logits(model, other_pad, mask)
    np.testing.assert_array_equal(np.asarray(a)[np.asarray(mask)], np.asarray(b)[np.asarray(mask)])
    unpadded = gm.forward_logits(model, tokens[:, 2:], mask[:, 2:])
    np.testing.assert_allclose(a[:, 2:], unpadded, atol=1e-5)


def test_bfloat16_policy_dtypes():
    config = model_config(dtype="bfloat16", param_dtype="bfloat16")
    model = gm.Decoder(config, rngs=nnx.Rngs(0))
    tokens, mask = _left_padded(7, 2, 5, [5, 2], config.vocab_size)
    hidden, _ = model(tokens, mask_nt=mask)
    assert hidden.dtype == jnp.bfloat16
    logits = model.logits(hidden)
    assert logits.dtype == jnp.float32 and logits.shape == (2, 5, 64)
    assert model.lm_head_dv().shape == (32, 64)
    assert bool(jnp.isfinite(logits).all())


def test_tied_lm_head_is_embedding_transposed():
    model = gm.Decoder(model_config(tie_word_embeddings=True), rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(model.lm_head_dv(), model.embed[...].T)
    assert "lm_head" not in model.named_params()


# ----------------------------------------------------------------------------- heads


def test_value_model_shapes():
    config = model_config()
    critic = gm.ValueModel(scrambled(config), rngs=nnx.Rngs(1))
    tokens, mask = _left_padded(8, 3, 6, [6, 2, 4], config.vocab_size)
    values = critic(tokens, mask_nt=mask)
    assert values.shape == (3, 6) and values.dtype == jnp.float32
    hidden, _ = critic.backbone(tokens, mask_nt=mask)
    w, b = np.asarray(critic.head.w[...]), float(critic.head.b[...])
    np.testing.assert_allclose(values, np.asarray(hidden) @ w + b, rtol=1e-5, atol=1e-6)


def test_reward_read_at_last_real_token_padding_invariant():
    config = model_config()
    rm = gm.RewardModel(scrambled(config, seed=9), rngs=nnx.Rngs(2))
    rm.head.b.set_value(jnp.asarray(0.3))
    rng = np.random.default_rng(10)
    lengths = [5, 2, 7]
    t = 8
    seqs = [rng.integers(0, config.vocab_size, size=k) for k in lengths]
    left = np.zeros((3, t), np.int64)
    right = np.zeros((3, t), np.int64)
    for i, s in enumerate(seqs):
        left[i, t - len(s) :] = s
        right[i, : len(s)] = s
    lmask = np.arange(t)[None] >= (t - np.array(lengths))[:, None]
    rmask = np.arange(t)[None] < np.array(lengths)[:, None]
    r_left = rm(jnp.asarray(left), mask_nt=jnp.asarray(lmask))
    r_right = rm(jnp.asarray(right), mask_nt=jnp.asarray(rmask))
    assert r_left.shape == (3,) and r_left.dtype == jnp.float32
    np.testing.assert_allclose(r_left, r_right, atol=1e-5)
    # Independent: each sequence alone, unpadded, head on its final hidden state.
    w = np.asarray(rm.head.w[...])
    for i, s in enumerate(seqs):
        hidden, _ = rm.backbone(jnp.asarray(s)[None])
        np.testing.assert_allclose(r_left[i], np.asarray(hidden)[0, -1] @ w + 0.3, atol=1e-5)


# ----------------------------------------------------------------------------- config, tokenizer


def test_config_validation_messages():
    with pytest.raises(
        ValueError, match=r"^num_heads must be a multiple of num_kv_heads \(3\), got 4$"
    ):
        model_config(num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match=r"remat must be one of \('none', 'full'"):
        model_config(remat="sometimes")
    with pytest.raises(ValueError, match=r"dtype must be one of \('float32', 'bfloat16'\)"):
        model_config(dtype="float16")
    with pytest.raises(
        ValueError,
        match=r"^model_type must be one of \('llama', 'mistral', 'mixtral', 'qwen2', 'qwen3', "
        r"'qwen3_moe', 'gemma2', 'gemma3_text'\), got 'gemma'$",
    ):
        model_config(model_type="gemma")
    with pytest.raises(
        ValueError, match=r"^layer_types must name all 2 layers \(num_layers\), got 1$"
    ):
        model_config(sliding_window=4, layer_types=("sliding_attention",))
    with pytest.raises(ValueError, match=r"^layer_types must be one of \('full_attention', "):
        model_config(sliding_window=4, layer_types=("local", "full_attention"))
    with pytest.raises(ValueError, match=r"^layer_types has sliding_attention layers but sliding"):
        model_config(layer_types=("sliding_attention", "full_attention"))
    with pytest.raises(
        ValueError, match=r"^hidden_act must be one of \('silu', 'gelu_pytorch_tanh'"
    ):
        model_config(hidden_act="relu")
    with pytest.raises(ValueError, match=r"^query_pre_attn_scalar must be None or an int >= 1"):
        model_config(query_pre_attn_scalar=0.5)
    with pytest.raises(
        ValueError,
        match=r"^num_experts must be >= 1 exactly when model_type is one of \('mixtral', "
        r"'qwen3_moe'\), got num_experts=4 with model_type 'qwen3'$",
    ):
        model_config(num_experts=4)
    with pytest.raises(
        ValueError, match=r"^num_experts_per_tok must be in \[1, num_experts=4\], got 5$"
    ):
        model_config(
            model_type="qwen3_moe", num_experts=4, num_experts_per_tok=5, moe_intermediate_size=8
        )
    with pytest.raises(ValueError, match=r"^moe_intermediate_size must be an int >= 1, got 0$"):
        model_config(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2)
    with pytest.raises(ValueError, match="head_dim must be even"):
        model_config(head_dim=15)
    with pytest.raises(
        ValueError,
        match=r"^pad_token_id must be None or an int in \[0, 64\) \(the vocabulary\), got 99$",
    ):
        model_config(pad_token_id=99)
    with pytest.raises(ValueError, match=r"^num_layers must be an int >= 1, got 0$"):
        model_config(num_layers=0)
    with pytest.raises(ValueError, match=r"^rms_norm_eps must be a finite number > 0, got 0\.0$"):
        model_config(rms_norm_eps=0.0)
    with pytest.raises(ValueError, match=r"^high_freq_factor must be > low_freq_factor \(4\.0\)"):
        gm.RopeScaling(8.0, 4.0, 1.0, 64)


def test_hf_config_roundtrip():
    rs = gm.RopeScaling(8.0, 1.0, 4.0, 64)
    for cfg in (
        model_config(),
        model_config(model_type="llama", qk_norm=False, rope_scaling=rs, tie_word_embeddings=True),
        model_config(model_type="qwen2", qk_norm=False, qkv_bias=True, eos_token_id=2),
        model_config(model_type="llama", qk_norm=False, eos_token_id=5, extra_eos_token_ids=(7, 9)),
    ):
        assert gm.ModelConfig.from_hf(cfg.to_hf()) == cfg
        hash(cfg)  # usable as a static jit argument
    hf = model_config(model_type="llama", qk_norm=False).to_hf()
    listed = gm.ModelConfig.from_hf({**hf, "eos_token_id": [5, 7, 9]})
    assert listed.eos_token_id == 5 and listed.eos_token_ids == (5, 7, 9)


def test_builtin_tokenizer_and_tiny_config(tmp_path):
    tok = gm.builtin_tokenizer()
    cfg = gm.tiny_config()
    assert len(tok) == cfg.vocab_size == len(gm.builtin_vocab())
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (
        cfg.pad_token_id,
        cfg.bos_token_id,
        cfg.eos_token_id,
    )
    text = "Q: 17*3 - (4/2) = ?\n\nA: 49.0, yes!\n"  # a blank line: one id per newline
    ids = tok.encode(text)
    assert len(ids) == len(text) and tok.unk_token_id not in ids
    assert tok.decode(ids) == text
    tok.save_pretrained(tmp_path)
    from transformers import AutoTokenizer

    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again.encode(text) == ids and again.decode(ids) == text
    # Beside a Qwen2 config (as the benchmarks' tiny Qwen2 checkpoints save it),
    # transformers 5's AutoTokenizer makes it a Qwen2Tokenizer that drops the spaces;
    # grpojax's loader keeps the tokenizer as saved.
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    loaded = gm.load_tokenizer(tmp_path)
    assert loaded.encode(text) == ids and loaded.decode(ids) == text
    assert 1_000_000 < cfg.num_params() < 10_000_000
    model = gm.Decoder(cfg, rngs=nnx.Rngs(0))
    n_params = sum(int(np.prod(v[...].shape)) for v in model.named_params().values())
    assert n_params == cfg.num_params()
