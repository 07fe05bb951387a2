"""Reward-model step: Bradley-Terry pairwise loss on (chosen, rejected) completions.

    loss = mean_i -log sigmoid(r(x_i, y_i^chosen) - r(x_i, y_i^rejected))
           + center_coef * mean_i (r_chosen_i + r_rejected_i)^2

(InstructGPT's reward-model objective, seed 002; the optional centring term only fixes the
reward's free offset). r is `grpojax.models.RewardModel`, read at each row's last real
token. Accuracy = fraction of pairs with r_chosen > r_rejected.
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

from grpojax.train.common import (
    accumulate_gradients,
    make_update_step,
    positions_from_mask,
    split_micro,
)
from grpojax.train.config import RewardModelConfig
from grpojax.train.state import TrainState, apply_gradients


@flax.struct.dataclass
class PreferenceBatch:
    """N preference pairs; both sides padded to S tokens (masks from lengths).

    chosen_tokens_ns, rejected_tokens_ns: `[N, S]` int32 prompt + response.
    chosen_mask_ns, rejected_mask_ns: `[N, S]` bool real tokens.
    """

    chosen_tokens_ns: Array
    chosen_mask_ns: Array
    rejected_tokens_ns: Array
    rejected_mask_ns: Array


def pair_rewards(model, batch: PreferenceBatch) -> tuple[Array, Array]:
    """(r_chosen `[N]`, r_rejected `[N]`) float32, both sides in one forward of 2N rows."""
    n = batch.chosen_tokens_ns.shape[0]
    tokens = jnp.concatenate([batch.chosen_tokens_ns, batch.rejected_tokens_ns], axis=0)
    mask = jnp.concatenate([batch.chosen_mask_ns, batch.rejected_mask_ns], axis=0).astype(bool)
    r = model(tokens, mask_nt=mask, positions_nt=positions_from_mask(mask))
    return r[:n], r[n:]


def bradley_terry_loss(r_chosen_n: Array, r_rejected_n: Array) -> Array:
    """`[N]` per-pair loss -log sigmoid(r_chosen - r_rejected) = softplus(r_rej - r_cho)."""
    margin = jnp.asarray(r_chosen_n, jnp.float32) - jnp.asarray(r_rejected_n, jnp.float32)
    return jax.nn.softplus(-margin)


def reward_model_update(
    state: TrainState,
    batch: PreferenceBatch,
    *,
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    config: RewardModelConfig,
    schedule: optax.Schedule | None = None,
) -> tuple[TrainState, dict[str, Array]]:
    """One reward-model update (pure). Metrics (at the input parameters): loss,
    bt_loss, accuracy, margin (mean r_c - r_r), reward_mean, grad_norm, lr, skipped,
    skipped_total."""
    k = config.num_microbatches
    n = batch.chosen_tokens_ns.shape[0]
    if n % k:
        raise ValueError(f"N={n} pairs must divide into num_microbatches={k}")

    def loss_fn(params, mb):
        rc, rr = pair_rewards(nnx.merge(graphdef, params), mb)
        bt = jnp.sum(bradley_terry_loss(rc, rr)) / n
        center = jnp.sum(jnp.square(rc + rr)) / n
        sg_c, sg_r = jax.lax.stop_gradient(rc), jax.lax.stop_gradient(rr)
        aux = {
            "bt_loss": jax.lax.stop_gradient(bt),
            "accuracy": jnp.sum(sg_c > sg_r, dtype=jnp.float32) / n,
            "margin": jnp.sum(sg_c - sg_r) / n,
            "reward_mean": jnp.sum(sg_c + sg_r) / (2 * n),
        }
        return bt + config.center_coef * center, aux

    loss, grads, aux = accumulate_gradients(loss_fn, state.params, split_micro(batch, k), k)
    state, upd = apply_gradients(state, tx, grads, loss=loss, schedule=schedule)
    state = dataclasses.replace(state, step=state.step + 1)
    metrics = {"loss": loss, **aux, **upd, "skipped_total": state.skipped.astype(jnp.float32)}
    return state, metrics


def make_reward_model_step(
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    config: RewardModelConfig,
    *,
    mesh: Mesh,
    state_shardings: Any,
    batch: PreferenceBatch,
    schedule: optax.Schedule | None = None,
    donate: bool = True,
):
    """The jitted reward-model step `step(state, batch) -> (state, metrics)`."""

    return make_update_step(
        reward_model_update,
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
    "PreferenceBatch",
    "bradley_terry_loss",
    "make_reward_model_step",
    "pair_rewards",
    "reward_model_update",
]
