"""Gemma 3 and sliding-window attention through every path that runs a model.

A sliding window (`ModelConfig.sliding_window`, per layer by `layer_types`) compares the
positions of a query and a key, so each path must give every key its sequence position: the
full forward (left-padded rows), the shared-prompt forward (a prefix cache), packed rows (a
completion reading its group's prompt segment packed earlier in the row, where columns are not
positions), the cached decode, both sampling engines, and the driver. Each is checked against
the full forward of the same sequences, float32: within 1e-5 (sums of O(1) terms over widths
<= 48, rounded in another order), the bound the MoE and attention tests use. Parity with
transformers' Gemma3ForCausalLM and MistralForCausalLM is in tests/test_models_hf.py.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from model_fixtures import cached_decode_logits, left_padded_batch, model_config, scrambled

import grpojax.models as gm
from grpojax.models import attention
from grpojax.models.config import RopeScaling
from grpojax.train import ForwardConfig, policy_logprobs

# Two programs' float32 orders (cached decode, tiles, packing, sampler against trainer) on
# a scrambled Gemma whose hidden states, logits and logprobs reach ~7 (an ulp 4.8e-7): up to
# 6.1e-6 apart (13 ulps) with XLA at another ISA level, so 3e-5. A window slip moves the
# logits by > 1e-2 (test_window_changes_the_output).
ATOL = 3e-5


# A 3-layer Gemma 3: sliding (window 3), full, sliding; the sliding layers' RoPE base 10,000,
# the full layer's 1e6 scaled linearly by 2; q.k over sqrt(24), not sqrt(head_dim 16).
GEMMA = dict(
    model_type="gemma3_text",
    hidden_act="gelu_pytorch_tanh",
    num_layers=3,
    sliding_window=3,
    layer_types=("sliding_attention", "full_attention", "sliding_attention"),
    rope_theta=1e6,
    rope_local_theta=1e4,
    rope_scaling=RopeScaling(2.0, rope_type="linear"),
    query_pre_attn_scalar=24,
    tie_word_embeddings=True,
)


# Gemma 2: windows on alternate layers, attention and final logit soft-capping (caps small
# enough to bend a scrambled model's scores and logits), no q/k norms.
GEMMA2 = dict(
    model_type="gemma2",
    hidden_act="gelu_pytorch_tanh",
    qk_norm=False,
    sliding_window=3,
    layer_types=("sliding_attention", "full_attention"),
    query_pre_attn_scalar=24,
    attn_logit_softcapping=2.0,
    final_logit_softcapping=3.0,
    tie_word_embeddings=True,
)

CONFIGS = {
    "gemma3": model_config(**GEMMA),
    "gemma2": model_config(**GEMMA2),
    "mistral_window": model_config(model_type="mistral", qk_norm=False, sliding_window=3),
}


@pytest.fixture(params=sorted(CONFIGS))
def windowed(request) -> gm.Decoder:
    return scrambled(CONFIGS[request.param], seed=1)


def test_window_changes_the_output(windowed):
    """The window matters at these lengths (else every test below would pass vacuously)."""
    tokens, mask = left_padded_batch(windowed.config, n=3, t=11)
    full = dataclasses.replace(
        windowed.config,
        sliding_window=None,
        layer_types=(),
        attn_logit_softcapping=None,
        final_logit_softcapping=None,
    )
    other = scrambled(full, seed=1)
    m = np.asarray(mask)
    a = np.asarray(gm.forward_logits(windowed, tokens, mask))[m]
    b = np.asarray(gm.forward_logits(other, tokens, mask))[m]
    assert np.max(np.abs(a - b)) > 1e-2


@pytest.mark.parametrize("prefill", [False, True])
def test_cached_decode_equals_full_forward(windowed, prefill):
    tokens, mask = left_padded_batch(windowed.config, n=3, t=11)
    full = np.asarray(gm.forward_logits(windowed, tokens, mask))
    m = np.asarray(mask)
    cached, _ = cached_decode_logits(
        windowed, tokens, mask, prompt=5, cache_len=12, prefill=prefill
    )
    np.testing.assert_allclose(np.asarray(cached)[m], full[m], atol=ATOL, rtol=0)
    fused = windowed.layer_params(fuse=True)
    again, _ = cached_decode_logits(
        windowed, tokens, mask, prompt=5, cache_len=12, prefill=prefill, layer_params=fused
    )
    np.testing.assert_allclose(np.asarray(again)[m], full[m], atol=ATOL, rtol=0)


@pytest.mark.parametrize("impl", ["blockwise", "fused"])
def test_blockwise_and_fused_backends_equal_einsum(windowed, impl, caplog):
    """Logits and gradients of the blockwise path (tiles of 4 over rows of 11: the window
    leaves some tiles empty and cuts others) and of the fused op (its XLA implementation:
    Gemma 3's windows, which differ by layer, each layer a switch between static windows;
    Gemma 2's soft cap falls back, logged) against the einsum path, within 1e-5."""
    caplog.set_level("INFO", logger="grpojax.models.attention")
    attention._TOLD.clear()
    tokens, mask = left_padded_batch(windowed.config, n=3, t=11)
    tiled = dataclasses.replace(windowed.config, attention=impl, attention_block=4)
    blockwise = nnx.merge(nnx.graphdef(scrambled(tiled, seed=1)), nnx.state(windowed))
    m = np.asarray(mask)

    def loss(model):
        return jnp.sum(jnp.where(mask[..., None], gm.forward_logits(model, tokens, mask), 0) ** 2)

    ref, got = (np.asarray(gm.forward_logits(x, tokens, mask)) for x in (windowed, blockwise))
    np.testing.assert_allclose(got[m], ref[m], atol=ATOL, rtol=0)
    g_ref, g_got = (nnx.grad(loss)(x) for x in (windowed, blockwise))
    for a, b in zip(jax.tree.leaves(g_ref), jax.tree.leaves(g_got)):
        scale = max(1.0, float(jnp.max(jnp.abs(a))))
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5 * scale, rtol=0)
    fell_back = [r.getMessage() for r in caplog.records if "falls back" in r.getMessage()]
    if impl == "fused":
        capped = windowed.config.attn_logit_softcapping is not None
        assert fell_back == (["attention: fused falls back to einsum/blockwise for "
                              "soft-capped scores (jax.nn.dot_product_attention has no soft cap)"]
                             if capped else []), fell_back  # fmt: skip


@pytest.mark.parametrize("impl", ["auto", "fused"])
def test_shared_prompt_forward_equals_full_forward(windowed, impl):
    """Two prompts (5 columns, one left-padded) of two samples each, 6 completion tokens;
    `auto` (the einsum here) and the fused op (completions over their prompt as a prefix,
    Gemma 3's windows by layer through the switch)."""
    config = dataclasses.replace(windowed.config, attention=impl)
    windowed = nnx.merge(nnx.graphdef(scrambled(config, seed=1)), nnx.state(windowed))
    rng = np.random.default_rng(2)
    prompt_mask = np.arange(5)[None] >= np.array([[0], [0], [2], [2]])
    comp_mask = np.arange(6)[None] < np.array([[6], [4], [6], [1]])
    mask = jnp.asarray(np.concatenate([prompt_mask, comp_mask], axis=1))
    tokens = rng.integers(1, 64, (4, 11))
    tokens[1, :5], tokens[3, :5] = tokens[0, :5], tokens[2, :5]
    tokens = jnp.asarray(np.where(mask, tokens, 0))
    positions = gm.positions_from_mask(mask)
    hidden, _ = windowed(tokens, positions_nt=positions, mask_nt=mask)
    h_prefix, h_suffix = gm.shared_prefix_forward(
        windowed, tokens, mask, positions, prefix_width=5, group_size=2
    )
    m = np.asarray(mask)
    np.testing.assert_allclose(
        np.asarray(h_suffix)[m[:, 5:]], np.asarray(hidden[:, 5:])[m[:, 5:]], atol=ATOL, rtol=0
    )
    np.testing.assert_allclose(
        np.asarray(h_prefix)[m[::2, :5]], np.asarray(hidden[::2, :5])[m[::2, :5]], atol=ATOL
    )


def test_packed_group_equals_rows(windowed):
    """One packed row: a 4-token prompt (segment 1) then two completions (segments 2 and 3,
    each reading segment 1 as its parent) of 5 and 3 tokens, then padding. Completion 2's
    first token sits 5 columns after the prompt's end but its position follows the prompt's:
    the window must count positions. Each equals its own row prompt + completion."""
    rng = np.random.default_rng(3)
    prompt, c1, c2 = (rng.integers(1, 64, n) for n in (4, 5, 3))
    row = np.concatenate([prompt, c1, c2, [0, 0]])
    seg = np.array([1] * 4 + [2] * 5 + [3] * 3 + [0] * 2)
    parent = np.where(seg >= 2, 1, 0)
    pos = np.concatenate([np.arange(4), 4 + np.arange(5), 4 + np.arange(3), [0, 0]])
    packed, _ = windowed(
        jnp.asarray(row[None]),
        positions_nt=jnp.asarray(pos[None]),
        segment_ids_nt=jnp.asarray(seg[None]),
        parent_ids_nt=jnp.asarray(parent[None]),
    )
    for comp, cols in ((c1, slice(4, 9)), (c2, slice(9, 12))):
        tokens = jnp.asarray(np.concatenate([prompt, comp])[None])
        alone, _ = windowed(tokens)
        np.testing.assert_allclose(
            np.asarray(packed[0, cols]), np.asarray(alone[0, 4:]), atol=ATOL, rtol=0
        )
        np.testing.assert_allclose(
            np.asarray(packed[0, :4]), np.asarray(alone[0, :4]), atol=ATOL, rtol=0
        )


@pytest.mark.parametrize("engine", ["static", "continuous", "compact"])
def test_sampler_logprobs_equal_the_trainers(windowed, engine):
    """Prompts longer than the window; 8 new tokens; the trainer's full forward of prompt +
    completion gives the logprobs the sampler drew with (temperature 1, no truncation)."""
    from grpojax.sampling import generate

    rng = np.random.default_rng(4)
    prompts = jnp.asarray(rng.integers(3, 64, (2, 6)))
    r = generate(
        windowed,
        prompts,
        np.array([6, 4]),
        key=jax.random.key(0),
        max_new_tokens=8,
        group_size=2,
        engine=engine,
    )
    tokens, mask, positions = r.sequences()
    hidden, _ = windowed(tokens, positions_nt=positions, mask_nt=mask)
    logp = jax.nn.log_softmax(windowed.logits(hidden), axis=-1)
    p = r.prompt_tokens_bp.shape[1]
    logp = jnp.take_along_axis(logp[:, p - 1 : -1], r.tokens_nt[..., None], -1)[..., 0]
    m = np.asarray(r.mask_nt)
    assert m.sum() > 8
    np.testing.assert_allclose(np.asarray(logp)[m], np.asarray(r.logp_nt)[m], atol=ATOL, rtol=0)
    # and the train steps' chunked logprobs (vocabulary tiles, the soft-cap inside them)
    chunked, _ = policy_logprobs(
        windowed, tokens, mask, r.mask_nt, forward=ForwardConfig(chunk_size=8, vocab_chunk_size=24)
    )
    np.testing.assert_allclose(np.asarray(chunked)[m], np.asarray(r.logp_nt)[m], atol=ATOL, rtol=0)


@pytest.fixture(scope="module")
def gemma_model_dir(tmp_path_factory):
    """A 3-layer Gemma 3 (window 3) with the built-in tokenizer, as a local HF directory."""
    path = tmp_path_factory.mktemp("gemma_model")
    cfg = gm.tiny_config(**GEMMA, hidden_size=64, intermediate_size=128, num_heads=4, head_dim=16)
    gm.save_pretrained(gm.Decoder(cfg, rngs=nnx.Rngs(0)), path, tokenizer=gm.builtin_tokenizer())
    return path


@pytest.mark.parametrize("packing", ["never", "always"])
def test_grpojax_train_on_a_tiny_gemma(gemma_model_dir, tmp_path, packing):
    """A reduced `grpojax train` (2 GRPO steps, a reference) on the tiny Gemma 3, its rows
    unpacked and packed (completions reading their prompt's segment): the sampler's and the
    trainer's logprobs agree as on the dense models, the updates are finite."""
    from test_driver_loop import _overrides

    from grpojax.config import load_config
    from grpojax.driver.loop import train

    run_dir = tmp_path / packing
    extra = {"grpo.beta": 0.04, "packing.mode": packing, "rollout.max_new_tokens": 6}
    cfg = load_config(None, _overrides(gemma_model_dir, run_dir, total_steps=2, **extra))
    assert cfg.model.source == str(gemma_model_dir)
    train(cfg, show_progress=False, print_fn=lambda s: None)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "reward_mean" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert max(r["logprob_diff_max"] for r in rows) < 1e-4
    assert all(np.isfinite(r["grad_norm"]) and r["grad_norm"] > 0 for r in rows)
