"""Supervised fine-tuning step: next-token cross-entropy on demonstrations (warm starts).

    loss = - sum_{n, s} m_{n,s} log pi(x_{n,s} | x_{n,<s}) / sum_{n, s} m_{n,s}

token-mean over the loss mask m (completion tokens only; prompt tokens are context, not
targets), with log pi computed chunked from hidden states. Micro-batches divide by the
whole batch's token count, so accumulation is exact. Same `TrainState` / jit call site as
the RL steps.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax.numpy as jnp
import optax
from flax import nnx
from jax import Array
from jax.sharding import Mesh

from grpojax.ops.logprobs import token_logprobs_from_hidden
from grpojax.ops.masks import mask_from_lengths, masked_sum
from grpojax.train.common import (
    accumulate_gradients,
    make_update_step,
    positions_from_mask,
    split_micro,
)
from grpojax.train.config import SFTConfig
from grpojax.train.state import TrainState, apply_gradients


@flax.struct.dataclass
class SFTBatch:
    """Demonstrations, N rows of S tokens.

    tokens_ns: `[N, S]` int32 prompt + demonstration (any padding, masks say which is real).
    mask_ns: `[N, S]` bool real tokens (attention).
    loss_mask_ns: `[N, S]` bool tokens to predict (the demonstration, EOS included); column
      0 is never a target (nothing predicts it).
    """

    tokens_ns: Array
    mask_ns: Array
    loss_mask_ns: Array


def sft_batch_from_lengths(tokens_ns: Array, prompt_lengths_n: Array, lengths_n: Array) -> SFTBatch:
    """An `SFTBatch` of right-padded rows: real tokens `[0, L)`, targets `[P, L)`.

    Args:
      tokens_ns: `[N, S]` int rows, prompt then demonstration, right-padded.
      prompt_lengths_n: `[N]` prompt lengths P (>= 1).
      lengths_n: `[N]` total lengths L (prompt + demonstration).
    """
    tokens = jnp.asarray(tokens_ns, jnp.int32)
    s = tokens.shape[1]
    prompt = jnp.asarray(prompt_lengths_n, jnp.int32)
    total = jnp.asarray(lengths_n, jnp.int32)
    mask = mask_from_lengths(total, s)
    loss_mask = mask_from_lengths(total - prompt, s, offset_n=prompt)
    return SFTBatch(tokens_ns=tokens, mask_ns=mask, loss_mask_ns=loss_mask)


def sft_token_logprobs(model, batch: SFTBatch, *, config: SFTConfig) -> tuple[Array, Array]:
    """(logp `[N, S-1]` of tokens 1..S-1 given their prefixes, target mask `[N, S-1]`)."""
    mask = jnp.asarray(batch.mask_ns, jnp.bool_)
    hidden, _ = model(batch.tokens_ns, positions_nt=positions_from_mask(mask), mask_nt=mask)
    logp = token_logprobs_from_hidden(
        hidden[:, :-1],
        model.lm_head_dv(),
        batch.tokens_ns[:, 1:],
        chunk_size=config.forward.chunk_size,
        vocab_chunk_size=config.forward.vocab_chunk_size,
    )
    return logp, jnp.asarray(batch.loss_mask_ns, jnp.bool_)[:, 1:]


def sft_update(
    state: TrainState,
    batch: SFTBatch,
    *,
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    config: SFTConfig,
    schedule: optax.Schedule | None = None,
) -> tuple[TrainState, dict[str, Array]]:
    """One SFT optimizer update (pure). Metrics: loss (mean NLL per target token),
    num_tokens, grad_norm, lr, skipped, skipped_total."""
    k = config.num_microbatches
    n = batch.tokens_ns.shape[0]
    if n % k:
        raise ValueError(f"N={n} rows must divide into num_microbatches={k}")
    num_tokens = jnp.sum(jnp.asarray(batch.loss_mask_ns, jnp.bool_)[:, 1:], dtype=jnp.float32)
    den = jnp.maximum(num_tokens, 1.0)

    def loss_fn(params, mb):
        logp, target = sft_token_logprobs(nnx.merge(graphdef, params), mb, config=config)
        return -masked_sum(logp, target) / den, {}

    loss, grads, _ = accumulate_gradients(loss_fn, state.params, split_micro(batch, k), k)
    state, upd = apply_gradients(state, tx, grads, loss=loss, schedule=schedule)
    state = state.replace(step=state.step + 1)
    metrics = {"loss": loss, "num_tokens": num_tokens, **upd}
    metrics["skipped_total"] = state.skipped.astype(jnp.float32)
    return state, metrics


def make_sft_step(
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    config: SFTConfig,
    *,
    mesh: Mesh,
    state_shardings: Any,
    batch: SFTBatch,
    schedule: optax.Schedule | None = None,
    donate: bool = True,
):
    """The jitted SFT step `step(state, batch) -> (state, metrics)` (see `jit_step`)."""

    return make_update_step(
        sft_update,
        graphdef=graphdef,
        tx=tx,
        config=config,
        mesh=mesh,
        state_shardings=state_shardings,
        batch=batch,
        schedule=schedule,
        donate=donate,
    )


__all__ = [
    "SFTBatch",
    "make_sft_step",
    "sft_batch_from_lengths",
    "sft_token_logprobs",
    "sft_update",
]
