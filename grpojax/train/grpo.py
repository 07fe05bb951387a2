"""The GRPO-family update: mu epochs x mini-batches x micro-batches in one compiled program.

    step = make_grpo_step(graphdef, tx, config, mesh=mesh, state_shardings=sh, batch=batch)
    state, metrics = step(state, batch)

`grpo_update(state, batch, graphdef=, tx=, config=)` is the pure function it jits (usable
inside a user's own `jax.jit`). Inside one call, PureJaxRL-style:

1. rows are permuted per epoch (from the state's key) and laid out as
   `[M mini-batches, K micro-batches, N/(M K) rows]`;
2. when the batch carries no old logprobs, the first update (at the step's input
   parameters) uses `stop_gradient(logp)` of its own forward, so its ratios are exactly 1;
   when the policy is updated more than once (mu > 1 or M > 1), a forward pass over the
   epoch-0 layout with the same function and shapes computes them for the later updates;
3. reference logprobs, when beta > 0 and the batch has none, come from `state.ref_params`
   the same way (beta = 0: no reference forward at all — a static decision);
4. `lax.scan` over epochs and over mini-batches; each mini-batch sums K micro-batch
   gradients, every micro loss divided by the mini-batch's *global* denominator, so
   accumulation equals the un-accumulated update; then `apply_gradients` (non-finite ->
   skipped).

The GRPO variants (Dr.GRPO, DAPO, GSPO, dual clip, off-policy masking, TIS, keep mask) are
fields of `GRPOConfig`; there is one step.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax import Array
from jax.sharding import Mesh

from grpojax.ops.aggregation import aggregate, aggregate_parts
from grpojax.ops.corrections import off_policy_sequence_mask, truncated_is_weights
from grpojax.ops.kl import kl, kl_is_corrected
from grpojax.ops.losses import policy_loss
from grpojax.ops.masks import masked_mean
from grpojax.train.common import (
    accumulate_gradients,
    make_update_step,
    merge_micro,
    policy_logprobs,
    split_micro,
)
from grpojax.train.config import GRPOConfig
from grpojax.train.state import TrainState, apply_gradients


@flax.struct.dataclass
class GRPOBatch:
    """One GRPO step's data, N = B*G rows, S = P + T columns (see `grpojax.train.common`).

    tokens_ns: `[N, S]` int32 prompt (left-padded, width P) + completion (width T).
    mask_ns: `[N, S]` bool real prompt and completion tokens (from lengths).
    completion_mask_nt: `[N, T]` bool real completion tokens (from lengths; EOS included).
    advantages: `[N]` or `[N, T]` float32 (from `compute_advantages`).
    old_logp_nt: optional `[N, T]` log pi_old; None: recomputed inside the step.
    ref_logp_nt: optional `[N, T]` log pi_ref; None with beta > 0: computed from
      `state.ref_params` inside the step.
    sampler_logp_nt: optional `[N, T]` the sampler's logprobs (TIS, off-policy masking).
    keep_threshold_nt: optional `[N, T]` the sampler's kept-set thresholds (keep mask).
    """

    tokens_ns: Array
    mask_ns: Array
    completion_mask_nt: Array
    advantages: Array
    old_logp_nt: Array | None = None
    ref_logp_nt: Array | None = None
    sampler_logp_nt: Array | None = None
    keep_threshold_nt: Array | None = None


def grpo_batch_from_rollout(
    rollout,
    advantages: Array,
    *,
    config: GRPOConfig | None = None,
    old_logp_nt: Array | None = None,
    ref_logp_nt: Array | None = None,
) -> GRPOBatch:
    """A `GRPOBatch` from a `grpojax.sampling.Rollout` and its advantages.

    Sampler logprobs are attached when `config` asks for TIS or off-policy masking, the
    kept-set thresholds when it asks for the keep mask.
    """
    tokens, mask, _ = rollout.sequences()
    need_sampler = config is not None and (
        config.tis_cap is not None or config.off_policy_delta is not None
    )
    need_keep = config is not None and config.use_keep_mask
    return GRPOBatch(
        tokens_ns=tokens,
        mask_ns=mask,
        completion_mask_nt=rollout.mask_nt,
        advantages=jnp.asarray(advantages, jnp.float32),
        old_logp_nt=old_logp_nt,
        ref_logp_nt=ref_logp_nt,
        sampler_logp_nt=rollout.logp_nt if need_sampler else None,
        keep_threshold_nt=rollout.keep_threshold_nt if need_keep else None,
    )


def _check_batch(batch: GRPOBatch, config: GRPOConfig, state: TrainState) -> None:
    n, s = batch.tokens_ns.shape
    nt = batch.completion_mask_nt.shape
    if batch.mask_ns.shape != (n, s) or nt[0] != n or not 1 <= nt[1] < s:
        raise ValueError(
            f"expected tokens_ns/mask_ns [N, S] and completion_mask_nt [N, T] with T < S; got "
            f"{batch.tokens_ns.shape}, {batch.mask_ns.shape}, {nt}"
        )
    if batch.advantages.shape not in ((n,), nt):
        raise ValueError(f"advantages must be [N]={n} or [N, T]={nt}, got {batch.advantages.shape}")
    per_update = config.num_minibatches * config.num_microbatches
    if n % per_update:
        raise ValueError(
            f"N={n} rows must divide into num_minibatches x num_microbatches = {per_update}"
        )
    if config.share_prompt and n % (per_update * config.group_size):
        raise ValueError(
            f"share_prompt=True splits whole groups: N={n} rows must divide into "
            f"group_size x num_minibatches x num_microbatches = {per_update * config.group_size}"
        )
    if config.tis_cap is not None and batch.sampler_logp_nt is None:
        raise ValueError("tis_cap is set: the batch must carry sampler_logp_nt")
    if config.use_keep_mask and batch.keep_threshold_nt is None:
        raise ValueError("use_keep_mask is set: the batch must carry keep_threshold_nt")
    if config.off_policy_delta is not None and batch.advantages.ndim != 1:
        raise ValueError("off-policy sequence masking needs sequence advantages [N]")
    if config.uses_reference and batch.ref_logp_nt is None and state.ref_params is None:
        raise ValueError(
            "beta > 0 needs reference logprobs: pass batch.ref_logp_nt or keep a reference "
            "in the state (create_train_state(..., with_ref=True))"
        )
    if config.ref_refresh_every is not None and state.ref_params is None:
        raise ValueError("ref_refresh_every is set but the state holds no ref_params")


def _blocks(x: Array, perm_n: Array, m: int, k: int, g: int) -> Array:
    """`[N, ...]` -> `[M, K, N/(M K), ...]` rows in `perm_n` order, split interleaved by
    units of g contiguous rows (g = G keeps groups whole, g = 1 splits rows)."""
    x = jnp.take(x, perm_n, axis=0)
    x = x.reshape(x.shape[0] // g, g, *x.shape[1:])
    out = jax.vmap(lambda y: split_micro(y, k))(split_micro(x, m))
    return out.reshape(m, k, -1, *out.shape[4:])


def _unblocks(x: Array, perm_n: Array, g: int) -> Array:
    """Inverse of `_blocks`."""
    x = x.reshape(*x.shape[:2], x.shape[2] // g, g, *x.shape[3:])
    flat = merge_micro(jax.vmap(merge_micro)(x))
    flat = flat.reshape(-1, *flat.shape[2:])
    return jnp.zeros_like(flat).at[perm_n].set(flat)


def _permutation(key: Array, n: int, g: int) -> Array:
    """`[N]` a random order of the rows that keeps each contiguous unit of g rows together."""
    units = jax.random.permutation(key, n // g)
    return (units[:, None] * g + jnp.arange(g)).reshape(n)


def _forward_logp(graphdef, params, mb: GRPOBatch, config: GRPOConfig, *, with_entropy: bool):
    model = nnx.merge(graphdef, params)
    return policy_logprobs(
        model,
        mb.tokens_ns,
        mb.mask_ns,
        mb.completion_mask_nt,
        forward=config.forward,
        with_entropy=with_entropy,
        keep_threshold_nt=mb.keep_threshold_nt if config.use_keep_mask else None,
        group_size=config.group_size if config.share_prompt else 1,
    )


def _precompute_logp(graphdef, params, blocks: GRPOBatch, config: GRPOConfig) -> Array:
    """Logprobs of every block `[M, K, n, T]` with the update's forward (no gradient)."""
    m, k = blocks.tokens_ns.shape[:2]
    flat = jax.tree.map(lambda x: x.reshape(m * k, *x.shape[2:]), blocks)

    def one(mb):
        return _forward_logp(graphdef, params, mb, config, with_entropy=False)[0]

    out = jax.lax.map(one, flat)
    return jax.lax.stop_gradient(out.reshape(m, k, *out.shape[1:]))


def grpo_micro_loss(
    params,
    mb: GRPOBatch,
    *,
    graphdef: nnx.GraphDef,
    config: GRPOConfig,
    denominator: Array,
    num_tokens: Array,
    old_from_current: bool | Array = False,
) -> tuple[Array, dict[str, Array]]:
    """The GRPO loss of one micro-batch, divided by the mini-batch's global denominator.

        loss_t = w_t keep_i pg_t + beta kl_t - entropy_coef H_t
        loss   = aggregate(loss_nt, mask, mode=config.aggregation, denominator=denominator)

    Args:
      params: the policy's `nnx.State` (differentiated).
      mb: a micro-batch (`GRPOBatch` of n rows; `old_logp_nt` and, when beta > 0,
        `ref_logp_nt` filled in unless `old_from_current`).
      graphdef: the policy's graph definition (static).
      config: the step's configuration (static).
      denominator: `[]` the mini-batch's aggregation denominator (all its micro-batches).
      num_tokens: `[]` real tokens of the mini-batch, to weight the metrics.
      old_from_current: use `stop_gradient(logp)` as the old logprobs: True (static; the
        batch has none and there is one update), False, or a traced `[]` bool (true on the
        first update of a step, whose parameters are the ones the old logprobs describe:
        the ratio is then exactly 1 by construction, not up to the rounding of a
        differently fused forward).

    Returns:
      (loss `[]`, metrics): metrics already weighted so that summing over the micro-batches
      of a mini-batch (`combine_metrics`) gives mini-batch values.
    """
    mask = jnp.asarray(mb.completion_mask_nt, jnp.bool_)
    logp, ent = _forward_logp(graphdef, params, mb, config, with_entropy=config.entropy_coef != 0)
    if old_from_current is True:
        old_logp = jax.lax.stop_gradient(logp)
    elif old_from_current is False:
        old_logp = mb.old_logp_nt
    else:
        old_logp = jnp.where(old_from_current, jax.lax.stop_gradient(logp), mb.old_logp_nt)
    pg_nt, pm = policy_loss(
        logp,
        old_logp,
        mb.advantages,
        mask,
        clip_low=config.clip_low,
        clip_high=config.clip_high,
        dual_clip=config.dual_clip,
        ratio_level=config.ratio_level,
    )
    weight_nt = jnp.ones_like(pg_nt)
    if config.tis_cap is not None:
        weight_nt = truncated_is_weights(old_logp, mb.sampler_logp_nt, mask, cap=config.tis_cap)
    keep_n = jnp.ones(mask.shape[:1], jnp.bool_)
    if config.off_policy_delta is not None:
        behaviour = old_logp if mb.sampler_logp_nt is None else mb.sampler_logp_nt
        keep_n = off_policy_sequence_mask(
            logp, behaviour, mb.advantages, mask, delta=config.off_policy_delta
        )
    pg_nt = pg_nt * weight_nt * keep_n[:, None].astype(jnp.float32)
    total_nt = pg_nt

    agg = dict(mode=config.aggregation, norm_constant=config.norm_constant)
    metrics: dict[str, Array] = {}
    n_tok = jnp.sum(mask, dtype=jnp.float32)
    share = n_tok / jnp.maximum(num_tokens, 1.0)

    def token_mean(x):
        return masked_mean(x, mask) * share

    if config.uses_reference:
        if config.kl_is_corrected:
            kl_nt = kl_is_corrected(logp, old_logp, mb.ref_logp_nt)
        else:
            kl_nt = kl(logp, mb.ref_logp_nt, estimator=config.kl_estimator)
        kl_nt = jnp.where(mask, kl_nt, 0.0)
        total_nt = total_nt + config.beta * kl_nt
        metrics["kl_loss"] = aggregate(kl_nt, mask, **agg, denominator=denominator)
        metrics["kl_ref"] = token_mean(jax.lax.stop_gradient(kl_nt))
    if ent is not None:
        total_nt = total_nt - config.entropy_coef * ent
        metrics["entropy"] = token_mean(jax.lax.stop_gradient(ent))
    loss = aggregate(total_nt, mask, **agg, denominator=denominator)
    metrics["pg_loss"] = jax.lax.stop_gradient(
        aggregate(pg_nt, mask, **agg, denominator=denominator)
    )
    for name in ("clip_frac_low", "clip_frac_high", "dual_clip_frac", "approx_kl_k1"):
        metrics[name] = pm[name] * share
    metrics["approx_kl"] = pm["approx_kl_k3"] * share
    metrics["ratio_mean"] = pm["ratio_mean"] * share
    metrics["ratio_min"] = pm["ratio_min"]
    metrics["ratio_max"] = pm["ratio_max"]
    metrics["kept_seq_frac"] = jnp.sum(keep_n, dtype=jnp.float32)
    metrics["tis_weight"] = token_mean(weight_nt)
    metrics = {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}
    return loss, metrics


def _summarise(per_update: dict[str, Array], n_rows: Array) -> dict[str, Array]:
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
    out["kept_seq_frac"] = out["kept_seq_frac"] / n_rows
    for name in ("loss", "ratio_min", "ratio_max", "grad_norm"):
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
      batch: a `GRPOBatch` of N rows; N divisible by M x K.
      graphdef: the policy's graph definition (static).
      tx: the optimizer (`make_optimizer`).
      config: a `GRPOConfig` (static).
      schedule: optional learning-rate schedule for the `lr` metric.

    Returns:
      (new_state, metrics): scalars averaged over the mu x M updates (`*_min` / `*_max`
      over all of them, `skipped` summed), `first_loss` / `first_ratio_min` /
      `first_ratio_max` / `first_grad_norm` of the first update (taken at the step's input
      parameters), `skipped_total` (running count), `lr`.
    """
    _check_batch(batch, config, state)
    m, k, mu = config.num_minibatches, config.num_microbatches, config.num_epochs
    n = batch.tokens_ns.shape[0]
    unit = config.group_size if config.share_prompt else 1
    rng, shuffle_key = jax.random.split(state.rng)
    if config.shuffle:
        perms = jnp.stack([_permutation(key, n, unit) for key in jax.random.split(shuffle_key, mu)])
    else:
        perms = jnp.broadcast_to(jnp.arange(n), (mu, n))
    batch = batch.replace(advantages=jnp.asarray(batch.advantages, jnp.float32))

    single_update = mu == 1 and m == 1
    old_from_current = batch.old_logp_nt is None and single_update
    need_old = batch.old_logp_nt is None and not single_update
    need_ref = config.uses_reference and batch.ref_logp_nt is None
    if need_old or need_ref:
        blocks0 = jax.tree.map(lambda x: _blocks(x, perms[0], m, k, unit), batch)
        if need_old:
            old = _precompute_logp(graphdef, state.params, blocks0, config)
            batch = batch.replace(old_logp_nt=_unblocks(old, perms[0], unit))
        if need_ref:
            ref = _precompute_logp(graphdef, state.ref_params, blocks0, config)
            batch = batch.replace(ref_logp_nt=_unblocks(ref, perms[0], unit))

    def minibatch_step(st: TrainState, xs):
        mini, first_update = xs
        mask = jnp.asarray(mini.completion_mask_nt, jnp.bool_)
        flat_mask = mask.reshape(-1, mask.shape[-1])
        _, den = aggregate_parts(
            jnp.zeros(flat_mask.shape, jnp.float32),
            flat_mask,
            mode=config.aggregation,
            norm_constant=config.norm_constant,
        )
        num_tokens = jnp.sum(flat_mask, dtype=jnp.float32)

        def loss_fn(params, mb):
            return grpo_micro_loss(
                params,
                mb,
                graphdef=graphdef,
                config=config,
                denominator=den,
                num_tokens=num_tokens,
                old_from_current=True if old_from_current else (first_update & need_old),
            )

        loss, grads, aux = accumulate_gradients(loss_fn, st.params, mini, k)
        st, upd = apply_gradients(st, tx, grads, loss=loss, schedule=schedule)
        return st, {"loss": loss, **aux, **upd}

    def epoch_step(st: TrainState, xs):
        perm_n, epoch = xs
        blocks = jax.tree.map(lambda x: _blocks(x, perm_n, m, k, unit), batch)
        first = (epoch == 0) & (jnp.arange(m) == 0)
        return jax.lax.scan(minibatch_step, st, (blocks, first))

    state, per_update = jax.lax.scan(epoch_step, state, (perms, jnp.arange(mu)))
    per_update = jax.tree.map(lambda v: v.reshape(mu * m), per_update)
    metrics = _summarise(per_update, jnp.asarray(n / m, jnp.float32))

    new_step = state.step + 1
    ref_params = state.ref_params
    if config.ref_refresh_every is not None:
        refresh = (new_step % config.ref_refresh_every) == 0
        ref_params = jax.tree.map(
            lambda p, r: jnp.where(refresh, p, r), state.params, state.ref_params
        )
        metrics["ref_refreshed"] = refresh.astype(jnp.float32)
    state = state.replace(step=new_step, rng=rng, ref_params=ref_params)
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
      graphdef, tx, config, schedule: as `grpo_update` (closed over, static).
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


__all__ = [
    "GRPOBatch",
    "grpo_batch_from_rollout",
    "grpo_micro_loss",
    "grpo_update",
    "make_grpo_step",
]
