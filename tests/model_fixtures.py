"""Tiny decoder configs and fully random decoders shared by the model tests (no transformers).

`model_config(**overrides)`: a 2-layer, width-32 Qwen3-style `ModelConfig` (GQA 4/2 heads,
qk-norm, vocab 64); `scrambled(config, seed)`: a `Decoder` whose every parameter, norms and
biases included, is random, so every weight matters to the outputs; `left_padded_batch`:
random left-padded rows; `cached_decode_logits`: a prefill then one cached decode call per
token, the logits every path of the sampler computes; `dot_generals`: the matmuls of a traced
program.
"""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from flax import nnx

import grpojax.models as gm


def model_config(**overrides) -> gm.ModelConfig:
    base = dict(
        model_type="qwen3",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        qk_norm=True,
    )
    base.update(overrides)
    return gm.ModelConfig(**base)


def scrambled(config: gm.ModelConfig, seed: int = 0) -> gm.Decoder:
    """Every base parameter random: N(0, 0.15^2) weights, norms N(1, 0.2^2), biases
    N(0, 0.2^2)."""
    model = gm.Decoder(config, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    for name, var in model.named_params().items():
        shape = var[...].shape
        scale = 0.2 if ("norm" in name or name.startswith("layers.b")) else 0.15
        center = 1.0 if "norm" in name else 0.0
        var.set_value(jnp.asarray(center + scale * rng.standard_normal(shape), jnp.float32))
    return model


def left_padded_batch(config: gm.ModelConfig, seed=0, n=3, t=9):
    """(tokens `[n, t]`, mask `[n, t]`): random left-padded rows of lengths t, t - 3, 1."""
    rng = np.random.default_rng(seed)
    lengths = np.array([t, t - 3, 1])[:n]
    mask = np.arange(t)[None, :] >= (t - lengths)[:, None]
    tokens = np.where(mask, rng.integers(0, config.vocab_size, (n, t)), 0)
    return jnp.asarray(tokens), jnp.asarray(mask)


def cached_decode_logits(
    model, tokens_nt, mask_nt, *, prompt: int, cache_len: int, prefill=False, layer_params=None
):
    """Logits `[N, T, V]` of `model` with the first `prompt` tokens prefilled into a KV cache
    of `cache_len` slots (with `prefill=True` when asked: the empty cache not read) and every
    later token decoded one call at a time, each call on `layer_params` when given; returns
    (logits, the final cache)."""
    positions = gm.positions_from_mask(mask_nt)

    @nnx.jit(static_argnames="first")
    def step(model, tok, pos, m, cache, layer_params, first):
        hidden, cache = model(
            tok,
            positions_nt=pos,
            mask_nt=m,
            cache=cache,
            prefill=first and prefill,
            layer_params=layer_params,
        )
        return model.logits(hidden), cache

    n, t = tokens_nt.shape
    cache = gm.init_cache(model.config, n, cache_len)
    pieces = []
    for sl in [slice(0, prompt)] + [slice(i, i + 1) for i in range(prompt, t)]:
        logits, cache = step(
            model,
            tokens_nt[:, sl],
            positions[:, sl],
            mask_nt[:, sl],
            cache,
            layer_params,
            first=sl.start == 0,
        )
        pieces.append(logits)
    return jnp.concatenate(pieces, axis=1), cache


def dot_generals(fn, *args) -> list:
    """The `dot_general` equations of `fn`'s jaxpr for `args`, nested jaxprs entered (a scan
    or loop body counted once)."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                found.append(eqn)
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found
