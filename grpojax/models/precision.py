"""Mixed precision: float32 masters, compute-dtype copies.

The policy (see docs/how-to/precision.md): trained parameters and their optimizer
moments are float32 (`ModelConfig.param_dtype`, default "float32"); the forward, the
backward and the sampler compute in `ModelConfig.dtype` (bf16 on accelerators), each
parameter cast where it is used (`Decoder` casts per layer); frozen copies (the reference
policy, a LoRA run's frozen base) are stored in the compute dtype, since they are never
updated; log-softmax, losses and advantages are float32 always.

Casting a decoder's parameters to its compute dtype ahead of time (`cast_floating`) gives
bit-for-bit the forward of the float32 masters: the decoder would apply the same
round-to-nearest cast to each parameter before using it.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

# XLA may evaluate a fused chain of bf16 elementwise operations (RMSNorm's scale, RoPE,
# SwiGLU, the residual adds) in float32 and round once at the end ("excess precision").
# Which chains fuse depends on the program: one-token decode steps in the sampler fuse
# differently from the trainer's full-sequence forward, so with excess precision the two
# round differently on most elements and their bf16 logprobs disagree on every token.
# Without it each op rounds to its dtype exactly as written, the same in every program.
# The sampler, the trainer's logprob pass and the train steps compile with these options.
# (No effect on float32 programs.)
COMPILER_OPTIONS = {"xla_allow_excess_precision": False}


def compute_dtype_of(model) -> jnp.dtype | None:
    """The compute dtype of a `Decoder` or of a head model over one (`backbone`), else None."""
    for m in (model, getattr(model, "backbone", None)):
        config = getattr(m, "config", None)
        if config is not None and hasattr(config, "compute_dtype"):
            return config.compute_dtype
    return None


def cast_floating(tree: Any, dtype) -> Any:
    """`tree` with every floating-point leaf cast to `dtype` (integer and key leaves kept).

    `dtype` None returns `tree` unchanged.
    """
    if dtype is None:
        return tree
    dtype = jnp.dtype(dtype)

    def cast(x):
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype:
            return x.astype(dtype)
        return x

    return jax.tree.map(cast, tree)


__all__ = ["COMPILER_OPTIONS", "cast_floating", "compute_dtype_of"]
