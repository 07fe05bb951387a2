"""Tiny decoder configs and fully random decoders shared by the model tests (no transformers).

`model_config(**overrides)`: a 2-layer, width-32 Qwen3-style `ModelConfig` (GQA 4/2 heads,
qk-norm, vocab 64); `scrambled(config, seed)`: a `Decoder` whose every parameter, norms and
biases included, is random, so every weight matters to the outputs.
"""

from __future__ import annotations

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
