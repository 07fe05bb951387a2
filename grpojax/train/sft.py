"""Supervised fine-tuning step: next-token cross-entropy on demonstrations (warm starts).

    loss = - sum_{n, s} m_{n,s} log pi(x_{n,s} | x_{n,<s}) / sum_{n, s} m_{n,s}

token-mean over the loss mask m (completion tokens only; prompt tokens are context, not
targets), with log pi computed chunked from hidden states. Micro-batches divide by the
whole batch's token count, so accumulation is exact. Same `TrainState` / jit call site as
the RL steps.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax import Array
from jax.sharding import Mesh

from grpojax.ops.logprobs import token_logprobs_from_hidden
from grpojax.ops.masks import mask_from_lengths, masked_sum
from grpojax.train.common import (
    ForwardConfig,
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


def next_token_logprobs(model, batch: SFTBatch, *, forward: ForwardConfig) -> tuple[Array, Array]:
    """(logp `[N, S-1]` of tokens 1..S-1 given their prefixes, target mask `[N, S-1]`).

    The model's own distribution (temperature 1 whatever `forward.temperature` says; only its
    chunk sizes are used), log-softmax chunked from the hidden states.
    """
    mask = jnp.asarray(batch.mask_ns, jnp.bool_)
    hidden, _ = model(batch.tokens_ns, positions_nt=positions_from_mask(mask), mask_nt=mask)
    logp = token_logprobs_from_hidden(
        hidden[:, :-1],
        model.lm_head_dv(),
        batch.tokens_ns[:, 1:],
        chunk_size=forward.chunk_size,
        vocab_chunk_size=forward.vocab_chunk_size,
        softcap=model.config.final_logit_softcapping,
    )
    return logp, jnp.asarray(batch.loss_mask_ns, jnp.bool_)[:, 1:]


def sft_token_logprobs(model, batch: SFTBatch, *, config: SFTConfig) -> tuple[Array, Array]:
    """`next_token_logprobs` with `config.forward`."""
    return next_token_logprobs(model, batch, forward=config.forward)


def num_targets(batch: SFTBatch) -> Array:
    """`[]` float32 count of the tokens the batch predicts (its loss mask past column 0)."""
    return jnp.sum(jnp.asarray(batch.loss_mask_ns, jnp.bool_)[..., 1:], dtype=jnp.float32)


def next_token_nll(model, batch: SFTBatch, *, forward: ForwardConfig) -> Array:
    """`[]` float32 summed next-token NLL over the target tokens:
    -sum_{n, s} m_{n,s} log pi(x_{n,s} | x_{n,<s}). Divide by a *global* `num_targets` for
    the token mean, so micro-batch sums accumulate exactly (the SFT step, PPO-ptx)."""
    logp, target = next_token_logprobs(model, batch, forward=forward)
    return -masked_sum(logp, target)


def ptx_micro_loss(
    params, ptx: SFTBatch, *, graphdef: nnx.GraphDef, config, num_tokens: Array
) -> tuple[Array, Array]:
    """The PPO-ptx term of one micro-batch (InstructGPT eq. 2's gamma E_pretrain[log pi(x)]).

        nll     = -sum_{n, s} m_{n,s} log pi(x_{n,s} | x_{n,<s})   (this micro-batch's rows)
        term    = ptx_coef * nll / num_tokens,   ptx_loss = nll / num_tokens

    with `num_tokens` the target count of all micro-batches of the update, so the terms and
    their gradients sum over the micro-batches to ptx_coef x the mini-batch's token-mean NLL.

    Args:
      params: the policy's `nnx.State` (differentiated).
      ptx: the micro-batch's pretraining rows (`SFTBatch` `[n, S']`).
      graphdef: the policy's graph definition (static).
      config: a `GRPOConfig` / `PPOConfig` (static): `ptx_coef` and the forward's chunk sizes.
      num_tokens: `[]` target tokens of the update's whole ptx mini-batch.

    Returns:
      (term `[]` to add to the loss, `ptx_loss` `[]` without gradient, already divided).
    """
    nll = next_token_nll(nnx.merge(graphdef, params), ptx, forward=config.forward)
    mean = nll / jnp.maximum(num_tokens, 1.0)
    return config.ptx_coef * mean, jax.lax.stop_gradient(mean)


def ptx_minibatches(ptx: SFTBatch | None, config, *, num_rows: int | None = None):
    """The ptx rows as `[M, K, n', S']` (mini-batch, micro-batch; the same interleaved split
    as the RL rows), or None when `config.ptx_coef` is 0 (the batch's ptx rows are then
    ignored: no forward over them is compiled).

    Raises ValueError when ptx_coef > 0 and `ptx` is None, or its rows do not divide into
    num_minibatches x num_microbatches.
    """
    if not config.ptx_coef:
        return None
    if ptx is None:
        raise ValueError(
            f"ptx_coef={config.ptx_coef} needs a pretraining batch: the batch's ptx field "
            "must hold an SFTBatch (e.g. sft_batch_from_lengths(tokens, 1, lengths))"
        )
    n = ptx.tokens_ns.shape[0]
    shapes = {x.shape for x in (ptx.tokens_ns, ptx.mask_ns, ptx.loss_mask_ns)}
    if len(shapes) != 1 or len(ptx.tokens_ns.shape) != 2 or ptx.tokens_ns.shape[1] < 2:
        raise ValueError(
            "ptx tokens_ns, mask_ns and loss_mask_ns must all be [N', S'] with S' >= 2, got "
            f"{sorted(shapes)}"
        )
    m, k = config.num_minibatches, config.num_microbatches
    if n % (m * k):
        raise ValueError(
            f"ptx rows N'={n} must divide into num_minibatches x num_microbatches = {m * k}"
        )
    return jax.tree.map(lambda x: jax.vmap(lambda y: split_micro(y, k))(split_micro(x, m)), ptx)


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
    num_tokens = num_targets(batch)
    den = jnp.maximum(num_tokens, 1.0)

    def loss_fn(params, mb):
        nll = next_token_nll(nnx.merge(graphdef, params), mb, forward=config.forward)
        return nll / den, {}

    loss, grads, _ = accumulate_gradients(loss_fn, state.params, split_micro(batch, k), k)
    state, upd = apply_gradients(state, tx, grads, loss=loss, schedule=schedule)
    state = dataclasses.replace(state, step=state.step + 1)
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
    "next_token_logprobs",
    "next_token_nll",
    "num_targets",
    "ptx_micro_loss",
    "ptx_minibatches",
    "sft_batch_from_lengths",
    "sft_token_logprobs",
    "sft_update",
]
