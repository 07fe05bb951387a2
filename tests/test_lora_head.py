"""The LoRA adapter on the LM head (`lora` target `lm_head`), without transformers.

logits = h W + (alpha/r) (h A) B, A `[D, r]`, B `[r, V]`. Exact: a fresh adapter (B = 0) and
adapters switched off give the base model's logits bit for bit, and `lm_head_dv()` is then
the base matrix itself. Against a float64 NumPy product: the sampler's unmerged logits and
the train steps' merged head W + (alpha/r) A B. Equivalences: the chunked logprobs from the
merged head equal `token_logprobs` of the unmerged full logits, values and gradients (also in
bf16 compute); cached prefill + decode equals the full forward; merged export equals the
unmerged forward. Tied models and dropout are refused.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from model_fixtures import cached_decode_logits, left_padded_batch, model_config, scrambled

import grpojax.models as gm
from grpojax.models import lora
from grpojax.ops.logprobs import token_logprobs, token_logprobs_from_hidden

# float32 against float64 NumPy on logits of O(5) (D = 32, r = 3): rounding ~1e-6.
REF_TOL = 1e-5
# merged x (W + s A B) vs unmerged x W + s (x A) B, float32 (tests/test_lora.py's MERGE_TOL).
MERGE_TOL = 2e-5
CACHE_TOL = 1e-5  # float32, the base decoder's cached-decode bound (tests/test_models.py)
# Chunked (merged head, online log-sum-exp over ragged tiles) vs full-logits log-softmax
# (unmerged head), float32, logprobs of O(5): reassociated float32 sums.
LOGP_TOL = 2e-5
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-5  # the same for their gradients (sums over N*T tokens)
# bf16 compute: both paths multiply the same bf16 h and W with float32 accumulation, so they
# agree to float32 rounding, not bf16's (a bf16-rounded merged head would be ~1e-2 off).
BF16_LOGP_TOL = 1e-4

HEAD_ONLY = ("lm_head",)
WITH_HEAD = ("q", "down", "lm_head")


def _randomize(model, seed, scale=0.1):
    rng = np.random.default_rng(seed)
    for name in model.lora.names():
        var = getattr(model.lora, name)
        var.set_value(jnp.asarray(scale * rng.standard_normal(var.shape), var[...].dtype))


def _model(targets, seed=1, rank=3, alpha=6.0, **config_kw):
    config = model_config(**config_kw)
    model = scrambled(config, seed=seed)
    lora.add_lora(model, lora.LoRAConfig(rank=rank, alpha=alpha, targets=targets), rngs=nnx.Rngs(2))
    return config, model


def test_head_adapter_exact_switches_and_numpy_reference():
    config = model_config()
    model = scrambled(config, seed=1)
    tokens, mask = left_padded_batch(config)
    base = np.asarray(gm.forward_logits(model, tokens, mask))
    w = np.asarray(model.lm_head[...], np.float64)

    lora.add_lora(model, lora.LoRAConfig(rank=3, alpha=6.0, targets=HEAD_ONLY), rngs=nnx.Rngs(2))
    assert {n: getattr(model.lora, n).shape for n in model.lora.names()} == {
        "lm_head_a": (32, 3),
        "lm_head_b": (3, 64),
    }
    np.testing.assert_array_equal(gm.forward_logits(model, tokens, mask), base)  # B = 0

    _randomize(model, seed=3)
    on = np.asarray(gm.forward_logits(model, tokens, mask))
    with lora.adapters_off(model):
        np.testing.assert_array_equal(gm.forward_logits(model, tokens, mask), base)
        np.testing.assert_array_equal(model.lm_head_dv(), model.lm_head[...])
    np.testing.assert_array_equal(model.lm_head[...], w.astype(np.float32))  # W untouched

    # NumPy: h W + (alpha/r) (h A) B on the model's own hidden states (head-only adapter).
    hidden = np.asarray(model(tokens, mask_nt=mask)[0], np.float64)
    a = np.asarray(model.lora.lm_head_a[...], np.float64)
    b = np.asarray(model.lora.lm_head_b[...], np.float64)
    ref = hidden @ w + 2.0 * (hidden @ a) @ b
    m = np.asarray(mask)
    err = np.abs(on - ref)[m].max()
    assert np.abs(on - base)[m].max() > 1e-2  # the adapter acts
    assert err <= REF_TOL, err
    head_err = np.abs(np.asarray(model.lm_head_dv()) - (w + 2.0 * a @ b)).max()
    assert model.lm_head_dv().dtype == jnp.float32 and head_err <= 1e-6, head_err

    merged = lora.merge_adapters(model)  # W + s A B written into lm_head
    merge_err = np.abs(np.asarray(gm.forward_logits(merged, tokens, mask)) - on)[m].max()
    print(f"head adapter: |logits - numpy| {err:.1e}, |merged - unmerged| {merge_err:.1e}")
    assert merge_err <= MERGE_TOL


def _grad_of(grads, name):
    g = dict(nnx.to_flat_state(grads))[("lora", name)]
    return np.asarray(g[...] if hasattr(g, "get_value") else g)


def _loss_fns(graphdef, tokens, mask, weights):
    """sum(weights * logp) over real tokens: chunked (merged head) and full logits."""

    def hidden_of(adapters, rest):
        model = nnx.merge(graphdef, adapters, rest)
        return model, model(tokens, mask_nt=mask)[0]

    def chunked(adapters, rest):
        model, h = hidden_of(adapters, rest)
        lp = token_logprobs_from_hidden(
            h, model.lm_head_dv(), tokens, chunk_size=5, vocab_chunk_size=24
        )
        return jnp.sum(jnp.where(mask, weights * lp, 0.0)), lp

    def full(adapters, rest):
        model, h = hidden_of(adapters, rest)
        lp = token_logprobs(model.logits(h), tokens)
        return jnp.sum(jnp.where(mask, weights * lp, 0.0)), lp

    return chunked, full


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_chunked_logprobs_and_gradients_with_head_adapter_equal_full_logits(dtype):
    """Ragged tiles (5 tokens x 24 of V = 64) on the merged head vs full unmerged logits."""
    config, model = _model(WITH_HEAD, seed=4, dtype=dtype)
    tokens, mask = left_padded_batch(config, seed=1)
    weights = jnp.asarray(np.random.default_rng(0).standard_normal(tokens.shape), jnp.float32)
    graphdef, adapters, rest = nnx.split(model, lora.LoRAParam, ...)
    chunked, full = _loss_fns(graphdef, tokens, mask, weights)
    grad = lambda f: jax.jit(jax.grad(f, has_aux=True))
    if dtype == "bfloat16":  # values only: the float32 case checks the gradients
        _randomize(model, seed=5)
        graphdef, adapters, rest = nnx.split(model, lora.LoRAParam, ...)
        chunked, full = _loss_fns(graphdef, tokens, mask, weights)
        lp_c, lp_f = (jax.jit(f)(adapters, rest)[1] for f in (chunked, full))
        logp_err = np.abs(np.asarray(lp_c) - np.asarray(lp_f))[np.asarray(mask)].max()
        print(f"bfloat16: chunked (merged head) vs full logits: max |dlogp| {logp_err:.1e}")
        assert logp_err <= BF16_LOGP_TOL
        return

    # Fresh adapter (B = 0): the gradient already reaches the head's B (not A: dA = s dW B^T).
    g0, _ = grad(chunked)(adapters, rest)
    assert np.abs(_grad_of(g0, "lm_head_b")).max() > 1e-3
    np.testing.assert_array_equal(_grad_of(g0, "lm_head_a"), 0.0)

    _randomize(model, seed=5)
    graphdef, adapters, rest = nnx.split(model, lora.LoRAParam, ...)
    gc, lp_c = grad(chunked)(adapters, rest)
    gf, lp_f = grad(full)(adapters, rest)
    m = np.asarray(mask)
    logp_err = np.abs(np.asarray(lp_c) - np.asarray(lp_f))[m].max()
    print(f"float32: chunked (merged head) vs full logits: max |dlogp| {logp_err:.1e}")
    assert logp_err <= LOGP_TOL
    for name in model.lora.names():
        a, b = _grad_of(gc, name), _grad_of(gf, name)
        assert np.abs(a).max() > 1e-4, name  # the gradient reaches every adapter
        np.testing.assert_allclose(a, b, rtol=GRAD_RTOL, atol=GRAD_ATOL, err_msg=name)


def test_prefill_then_decode_equals_full_forward_with_head_adapter():
    config, model = _model(WITH_HEAD, seed=12, rank=4, alpha=4.0)
    _randomize(model, seed=14)
    n, prompt, steps = 3, 6, 4
    t = prompt + steps
    tokens, prompt_mask = left_padded_batch(config, seed=4, n=n, t=prompt)
    rng = np.random.default_rng(5)
    tokens = jnp.concatenate([tokens, jnp.asarray(rng.integers(0, 64, (n, steps)))], axis=1)
    mask = jnp.concatenate([prompt_mask, jnp.ones((n, steps), bool)], axis=1)
    full = gm.forward_logits(model, tokens, mask)
    logits, _ = cached_decode_logits(model, tokens, mask, prompt=prompt, cache_len=t)
    err = np.abs(np.asarray(logits - full))[np.asarray(mask)]
    print(f"cached decode with a head adapter: max err {err.max():.2e}")
    assert err.max() <= CACHE_TOL


def test_head_adapter_refused_on_tied_models_and_with_dropout():
    from grpojax.config import ConfigError, load_config

    model = gm.Decoder(model_config(tie_word_embeddings=True), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"lora\.targets includes lm_head.*tie_word_embeddings"):
        lora.add_lora(model, lora.LoRAConfig(targets=HEAD_ONLY), rngs=nnx.Rngs(1))
    assert model.lora is None
    with pytest.raises(ValueError, match=r"^dropout must be 0 when targets include lm_head"):
        lora.LoRAConfig(targets=WITH_HEAD, dropout=0.1)
    with pytest.raises(ConfigError, match=r"lora\.dropout must be 0 when targets include lm_head"):
        load_config(None, ["lora.rank=4", "lora.targets=[q,lm_head]", "lora.dropout=0.1"])
    cfg = load_config(None, ["lora.rank=4", "lora.targets=[lm_head,q]"]).lora.lora_config()
    assert cfg.targets == ("q", "lm_head") and cfg.layer_targets == ("q",)
