"""The GRPO step's scanned update: mu epochs x mini-batches x micro-batches in one program.

`grpo_update(state, batch, graphdef=, tx=, config=)` is the pure step (usable inside a user's
own `jax.jit`); `make_grpo_step` jits it once, with shardings and donation. Inside one call
of the step, PureJaxRL-style:

1. rows are permuted per epoch (from the state's key) and laid out as
   `[M mini-batches, K micro-batches, N/(M K) rows]`;
2. when the batch carries no old logprobs, the first update (at the step's input
   parameters) uses `stop_gradient(logp)` of its own forward, so its ratios are exactly 1;
   when the policy is updated more than once (mu > 1 or M > 1), a forward pass over the
   epoch-0 layout with the same function and shapes computes them for the later updates;
3. reference logprobs, when beta > 0 and the batch has none, come from `state.ref_params`
   the same way (beta = 0: no reference forward at all — a static decision); with
   `kl_estimator="full"` the reference runs inside each micro-batch's loss instead, for its
   hidden states (the exact KL over the vocabulary, `grpojax.ops.kl_from_hidden`);
4. `lax.scan` over epochs and over mini-batches; each mini-batch sums K micro-batch
   gradients, every micro loss divided by the mini-batch's *global* denominator, so
   accumulation equals the un-accumulated update; then `apply_gradients` (non-finite ->
   skipped).

PPO-ptx (`config.ptx_coef` > 0): the batch carries a separate batch of text, `ptx` (an
`SFTBatch` of N' rows, N' divisible by M x K). Its rows are split like the RL rows, without
shuffling, into M mini-batches of K micro-batches (`ptx_minibatches`); mini-batch m's ptx
rows join update m of every epoch, and micro-batch j's loss adds

    ptx_coef * NLL_j / tokens(ptx mini-batch m),   NLL_j = -sum m_{n,s} log pi(x_{n,s} | x_{n,<s})

(`grpojax.train.sft.ptx_micro_loss`), so the K micro-batch gradients sum to
grad(RL loss of the mini-batch) + ptx_coef * grad(token-mean NLL of its ptx rows) exactly,
and that sum is the one optimizer update. With ptx_coef = 0 the ptx rows are ignored and
nothing about the compiled program changes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax import Array
from jax.sharding import Mesh

from grpojax.models.lora import dropout_rate as lora_dropout_rate
from grpojax.train.common import (
    accumulate_gradients,
    make_update_step,
    merge_units,
    split_units,
    unit_permutation,
)
from grpojax.train.config import GRPOConfig
from grpojax.train.grpo.batch import GRPOBatch, _check_rows, _prepare_rows
from grpojax.train.grpo.loss import (
    MiniBatchRows,
    _module,
    _precompute_logp,
    _reward_kl,
    _update_counts,
    grpo_micro_loss,
)
from grpojax.train.objectives import uses_minibatch_statistics
from grpojax.train.packing import check_packing
from grpojax.train.sft import num_targets, ptx_micro_loss, ptx_minibatches
from grpojax.train.state import (
    Teacher,
    TrainState,
    apply_gradients,
    has_reference,
    is_lora,
    join_trainable,
    trainable_split,
)


def _check_batch(batch: GRPOBatch, config: GRPOConfig, state: TrainState) -> None:
    _check_rows(batch, config)
    n, nt = batch.tokens_ns.shape[0], batch.completion_mask_nt.shape
    per_update = config.num_minibatches * config.num_microbatches
    if batch.packing is not None:
        check_packing(batch.packing, n, nt[1], per_update)
    elif n % per_update:
        raise ValueError(
            f"N={n} rows must divide into num_minibatches x num_microbatches = {per_update}"
        )
    if config.share_prompt and batch.packing is None and n % (per_update * config.group_size):
        raise ValueError(
            f"share_prompt=True splits whole groups: N={n} rows must divide into "
            f"group_size x num_minibatches x num_microbatches = {per_update * config.group_size}"
        )
    if config.uses_reference and config.kl_estimator == "full" and not has_reference(state):
        raise ValueError(
            "kl_estimator='full' runs the reference inside the step: keep a reference in the "
            "state (create_train_state(..., with_ref=True))"
        )
    if config.uses_reference and batch.ref_logp_nt is None and not has_reference(state):
        raise ValueError(
            "beta > 0 needs reference logprobs: pass batch.ref_logp_nt or keep a reference "
            "in the state (create_train_state(..., with_ref=True))"
        )
    if config.ref_refresh_every is not None and is_lora(state.params):
        raise ValueError(
            "ref_refresh_every is not supported with LoRA: the reference is the base model "
            "(adapters off), of which there is one copy"
        )
    if config.ref_refresh_every is not None and state.ref_params is None:
        raise ValueError("ref_refresh_every is set but the state holds no ref_params")
    exact_only = config.kl_estimator == "full" and not config.reward_kl_coef
    if isinstance(state.ref_params, Teacher) and not (exact_only and config.beta > 0):
        raise ValueError(
            "a Teacher reference (another model) is read by the exact divergence only: "
            f"beta > 0, kl_estimator='full' and reward_kl_coef=0, got beta={config.beta}, "
            f"kl_estimator={config.kl_estimator!r}, reward_kl_coef={config.reward_kl_coef}"
        )
    if isinstance(state.ref_params, Teacher) and config.ref_refresh_every is not None:
        raise ValueError("ref_refresh_every copies the policy into its reference, not a Teacher")


def _blocks(x: Array, perm_n: Array, m: int, k: int, g: int) -> Array:
    """`[N, ...]` -> `[M, K, N/(M K), ...]` rows in `perm_n` order, split interleaved by
    units of g contiguous rows (g = G keeps groups whole, g = 1 splits rows)."""
    return _split_blocks(jnp.take(x, perm_n, axis=0), m, k, g)


def _split_blocks(x: Array, m: int, k: int, g: int) -> Array:
    """`[N, ...]` -> `[M, K, N/(M K), ...]` in units of g contiguous rows."""
    return jax.vmap(lambda y: split_units(y, k, g))(split_units(x, m, g))


def _block_batch(batch: GRPOBatch, perm_n: Array, m: int, k: int, g: int) -> GRPOBatch:
    """`_blocks` of every row field; a packing's bins (units of g = J slot rows) follow
    their slots (`Packing.permuted`)."""
    packing = batch.packing
    blocks = jax.tree.map(
        lambda x: _blocks(x, perm_n, m, k, g), dataclasses.replace(batch, packing=None)
    )
    if packing is None:
        return blocks
    bins = jax.tree.map(lambda x: _split_blocks(x, m, k, 1), packing.permuted(perm_n))
    return dataclasses.replace(blocks, packing=bins)


def _unblocks(x: Array, perm_n: Array, g: int) -> Array:
    """Inverse of `_blocks`."""
    flat = merge_units(jax.vmap(lambda y: merge_units(y, g))(x), g)
    return jnp.zeros_like(flat).at[perm_n].set(flat)


def _summarise(per_update: dict[str, Array]) -> dict[str, Array]:
    out = {}
    for name, v in per_update.items():
        if name.endswith("_min"):
            out[name] = jnp.min(v)
        elif name.endswith("_max"):
            out[name] = jnp.max(v)
        elif name == "skipped":
            out["skipped"] = jnp.sum(v)
        else:
            out[name] = jnp.mean(v)
    for name in ("loss", "ratio_min", "ratio_max", "grad_norm"):
        if name in per_update:
            out[f"first_{name}"] = per_update[name][0]
    out["lr"] = per_update["lr"][-1]
    return out


def grpo_update(
    state: TrainState,
    batch: GRPOBatch,
    *,
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    config: GRPOConfig,
    schedule: optax.Schedule | None = None,
) -> tuple[TrainState, dict[str, Array]]:
    """One GRPO step: mu epochs x M mini-batches of updates, as a pure function.

    Args:
      state: the `TrainState` (policy params, optimizer, key, optional reference).
      batch: a `GRPOBatch` of N rows; N divisible by M x K. Its advantages, or (when they
        are None) its rewards, from which the step computes them (`compute_advantages`).
      graphdef: the policy's graph definition (static).
      tx: the optimizer (`make_optimizer`).
      config: a `GRPOConfig` (static).
      schedule: optional learning-rate schedule for the `lr` metric.

    Returns:
      (new_state, metrics): scalars averaged over the mu x M updates (`*_min` / `*_max`
      over all of them, `skipped` summed), `first_loss` / `first_ratio_min` /
      `first_ratio_max` / `first_grad_norm` of the first update (taken at the step's input
      parameters; the ratio ones when the policy loss reports `ratio_min` / `ratio_max`, as
      every built-in does), `skipped_total` (running count), `lr`. Besides the step's own
      (`loss`, `pg_loss`, `kl_loss`, `kl_ref`, `entropy`, `kept_seq_frac`, `grad_norm`), the
      policy loss's metrics under their names (`approx_kl_k3` as `approx_kl`) and, with
      rollout correction, `rollout_weight_mean`, `rollout_masked_frac`,
      `rollout_truncated_frac`, `rollout_kl_k1`, `rollout_kl_k3` (KL(pi_sampler || pi_old)),
      and with `ptx_coef` > 0 `ptx_loss`, the mean next-token NLL per target token of the
      ptx rows (`loss` includes ptx_coef times it).
    """
    _check_batch(batch, config, state)
    m, k, mu = config.num_minibatches, config.num_microbatches, config.num_epochs
    # `[M, K, n', S']` or None (ptx_coef = 0); out of the batch before its rows are permuted.
    ptx_blocks = ptx_minibatches(batch.ptx, config)
    batch = dataclasses.replace(batch, ptx=None)
    packing = batch.packing
    if packing is None:
        n = batch.tokens_ns.shape[0]
        unit = config.group_size if config.share_prompt else 1
    else:  # the bins are the units: J slot rows each, R*J rows in slot order (below)
        unit = packing.num_slots
        n = packing.rows_rj.shape[0] * unit
    # LoRA dropout (p > 0): the gradient forwards drop the adapters' input with keys from a
    # third split of the state's key (so p = 0 runs draw exactly the keys they always did);
    # pi_old's logprobs are then computed without dropout, never taken from a dropped forward.
    dropout = lora_dropout_rate(_module(graphdef, state.params))
    if dropout > 0:
        rng, shuffle_key, dropout_key = jax.random.split(state.rng, 3)
    else:
        rng, shuffle_key = jax.random.split(state.rng)
        dropout_key = None
    if config.shuffle:
        keys = jax.random.split(shuffle_key, mu)
        perms = jnp.stack([unit_permutation(key, n, unit) for key in keys])
    else:
        perms = jnp.broadcast_to(jnp.arange(n), (mu, n))
    token_rewards = None
    if config.reward_kl_coef > 0 and batch.advantages is None:
        # REINFORCE++'s KL in the reward: pi_old's and pi_ref's logprobs before the
        # advantages (kept for the loss; pi_old only where the loss would precompute it).
        old, ref, token_rewards = _reward_kl(
            graphdef, state.params, state.ref_params, batch, config, blocks=m * k
        )
        batch = dataclasses.replace(batch, ref_logp_nt=ref)
        if not (mu == 1 and m == 1 and dropout == 0):
            batch = dataclasses.replace(batch, old_logp_nt=old)
    batch = _prepare_rows(batch, config, token_rewards)
    if packing is not None:
        # Every row field into slot order, bin by bin; empty slots are rows with no tokens.
        slots = jax.tree.map(packing.to_slots, dataclasses.replace(batch, packing=None))
        batch = dataclasses.replace(slots, packing=packing)
    with_rows = uses_minibatch_statistics(config.policy_loss_fn) and k > 1

    single_update = mu == 1 and m == 1 and dropout == 0
    old_from_current = batch.old_logp_nt is None and single_update
    need_old = batch.old_logp_nt is None and not single_update
    full_kl = config.uses_reference and config.kl_estimator == "full"
    if full_kl:  # the exact KL needs the reference's hidden states, not its logprobs
        batch = dataclasses.replace(batch, ref_logp_nt=None)
    need_ref = config.uses_reference and not full_kl and batch.ref_logp_nt is None
    if need_old or need_ref:
        blocks0 = _block_batch(batch, perms[0], m, k, unit)
        if need_old:
            old = _precompute_logp(graphdef, state.params, blocks0, config)
            batch = dataclasses.replace(batch, old_logp_nt=_unblocks(old, perms[0], unit))
        if need_ref and state.ref_params is None:  # LoRA: the base weights, adapters off
            ref = _precompute_logp(
                graphdef, state.params, blocks0, config, adapters=False, replay=False
            )
            batch = dataclasses.replace(batch, ref_logp_nt=_unblocks(ref, perms[0], unit))
        elif need_ref:
            ref = _precompute_logp(graphdef, state.ref_params, blocks0, config, replay=False)
            batch = dataclasses.replace(batch, ref_logp_nt=_unblocks(ref, perms[0], unit))

    def minibatch_step(st: TrainState, xs):
        mini, first_update, ptx_mini, update_index = xs
        mask = jnp.asarray(mini.completion_mask_nt, jnp.bool_)
        den, num_tokens, num_sequences = _update_counts(mask, config)
        old_now = True if old_from_current else (first_update & need_old)
        if dropout > 0:  # the old logprobs stay the undropped forward's (precomputed)
            old_now = False
        rows = None
        if with_rows:
            # The loss's statistics span the mini-batch: the other micro-batches' logprobs at
            # these parameters, one forward without gradient.
            now = _precompute_logp(
                graphdef, st.params, jax.tree.map(lambda x: x[None], mini), config
            )
            now = now[0]
            if old_now is True:
                old = now
            elif need_old:
                old = jnp.where(first_update, now, mini.old_logp_nt)
            else:
                old = mini.old_logp_nt
            rows = MiniBatchRows(
                logp_knt=now,
                old_logp_knt=old,
                advantages=mini.advantages,
                mask_knt=mask,
                unit=unit,
            )

        def loss_fn(params, xs):
            mb, j, ptx_mb = xs
            key = None
            if dropout_key is not None:
                key = jax.random.fold_in(jax.random.fold_in(dropout_key, update_index), j)
            loss, metrics = grpo_micro_loss(
                params,
                mb,
                graphdef=graphdef,
                config=config,
                denominator=den,
                num_tokens=num_tokens,
                old_from_current=old_now,
                num_sequences=num_sequences,
                minibatch_rows=rows,
                micro_index=j,
                ref_params=st.ref_params if full_kl else None,
                lora_dropout_key=key,
            )
            if ptx_mb is not None:
                term, metrics["ptx_loss"] = ptx_micro_loss(
                    params, ptx_mb, graphdef=graphdef, config=config, num_tokens=ptx_tokens
                )
                loss = loss + term
            return loss, metrics

        ptx_tokens = None if ptx_mini is None else num_targets(ptx_mini)
        micro = (mini, jnp.arange(k), ptx_mini)
        # LoRA: differentiate the adapters only (no base-weight gradients are computed).
        trainable, frozen = trainable_split(st.params)
        loss, grads, aux = accumulate_gradients(
            lambda p, xs: loss_fn(join_trainable(p, frozen), xs), trainable, micro, k
        )
        st, upd = apply_gradients(st, tx, grads, loss=loss, schedule=schedule)
        # Kept among the mini-batch's sequences (not its empty rows, e.g. packing's slots).
        aux["kept_seq_frac"] = aux["kept_seq_frac"] / jnp.maximum(num_sequences, 1.0)
        return st, {"loss": loss, **aux, **upd}

    def epoch_step(st: TrainState, xs):
        perm_n, epoch = xs
        blocks = _block_batch(batch, perm_n, m, k, unit)
        first = (epoch == 0) & (jnp.arange(m) == 0)
        update_index = epoch * m + jnp.arange(m)
        return jax.lax.scan(minibatch_step, st, (blocks, first, ptx_blocks, update_index))

    state, per_update = jax.lax.scan(epoch_step, state, (perms, jnp.arange(mu)))
    per_update = jax.tree.map(lambda v: v.reshape(mu * m), per_update)
    metrics = _summarise(per_update)

    new_step = state.step + 1
    ref_params = state.ref_params
    if config.ref_refresh_every is not None:
        refresh = (new_step % config.ref_refresh_every) == 0
        ref_params = jax.tree.map(
            # The reference keeps its own (compute) dtype: the masters are cast into it.
            lambda p, r: jnp.where(refresh, p.astype(r.dtype), r),
            state.params,
            state.ref_params,
        )
        metrics["ref_refreshed"] = refresh.astype(jnp.float32)
    state = dataclasses.replace(state, step=new_step, rng=rng, ref_params=ref_params)
    metrics["skipped_total"] = state.skipped.astype(jnp.float32)
    return state, metrics


def make_grpo_step(
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    config: GRPOConfig,
    *,
    mesh: Mesh,
    state_shardings: Any,
    batch: GRPOBatch,
    schedule: optax.Schedule | None = None,
    donate: bool = True,
):
    """The jitted GRPO step, `step(state, batch) -> (state, metrics)`: the one call site.

    Args:
      graphdef: as `grpo_update` (closed over, static).
      tx: as `grpo_update` (closed over, static).
      config: as `grpo_update` (closed over, static).
      schedule: as `grpo_update` (closed over, static).
      mesh: the (data, fsdp, tensor) mesh (a mesh of one device works the same).
      state_shardings: from `grpojax.train.state.shard_train_state` /
        `train_state_shardings`.
      batch: an example batch (shapes and which optional fields are present fix the
        shardings; a batch with other shapes recompiles).
      donate: donate the input state's buffers.
    """

    return make_update_step(
        grpo_update,
        graphdef=graphdef,
        tx=tx,
        config=config,
        mesh=mesh,
        state_shardings=state_shardings,
        batch=batch,
        schedule=schedule,
        donate=donate,
    )


__all__ = ["grpo_update", "make_grpo_step"]
