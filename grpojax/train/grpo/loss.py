"""The GRPO step's loss: the forwards over a micro-batch and the loss of their logprobs.

`grpo_micro_loss` is one micro-batch's loss inside the step, divided by its mini-batch's
global denominator (`_update_counts`); `grpo_loss` is a whole batch's loss at a model's
parameters without an optimizer update (the step's first update, and its gradient on
request); `grpo_loss_from_logprobs` is the same loss from per-token logprobs, for research
code with its own model. The forwards (`_hidden`, `_forward_logp`, `_full_kl`,
`_precompute_logp`, `_reward_kl`) score the completion tokens from the model's hidden
states with the step's `ForwardConfig` (`grpojax.train.common.logprobs_from_hidden`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, cast

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax import Array

from grpojax.models.moe import load_balancing_loss
from grpojax.ops.aggregation import aggregate, aggregate_parts
from grpojax.ops.corrections import off_policy_sequence_mask, rollout_correction
from grpojax.ops.kl import kl, kl_is_corrected
from grpojax.ops.logprobs import divergence_from_hidden
from grpojax.ops.masks import masked_mean
from grpojax.train.common import (
    Scored,
    logprobs_from_hidden,
    loss_metrics,
    merge_units,
    scored_hidden,
    split_units,
)
from grpojax.train.config import GRPOConfig, norm_constant_for, rollout_correction_args
from grpojax.train.grpo.batch import GRPOBatch, _check_rows, _prepare_rows
from grpojax.train.sft import num_targets, ptx_micro_loss, ptx_minibatches
from grpojax.train.state import Teacher, is_lora, join_trainable, split_params, trainable_split


def _module(graphdef, params, adapters: bool = True):
    """The module of `params`; `adapters=False`: its LoRA adapters switched off (the
    reference policy of a LoRA run: the same base weights)."""
    model = nnx.merge(graphdef, params)
    if not adapters:
        model.lora_enabled = False  # a fresh module of this trace: nothing to restore
    return model


def _hidden(
    graphdef,
    params,
    mb: GRPOBatch,
    config: GRPOConfig,
    adapters: bool = True,
    dropout_key=None,
    replay: bool = True,
    with_load: bool = False,
) -> tuple[Scored, Array, float | None]:
    """(the forward's `Scored` hidden states and targets, lm_head `[D, V]`, the model's
    final-logit soft-cap or None); `replay`: the batch's `routing_nslk` replayed (the
    policy's forwards; a reference routes anew); `with_load`: the `Scored` carries the
    experts' load (`router_aux_coef`)."""
    model = _module(graphdef, params, adapters)
    scored = scored_hidden(
        model,
        mb.tokens_ns,
        mb.mask_ns,
        mb.completion_mask_nt.shape[1],
        group_size=config.group_size if config.share_prompt else 1,
        lora_dropout_key=dropout_key,
        packing=mb.packing,
        routing_nslk=mb.routing_nslk if replay else None,
        with_load=with_load,
    )
    return scored, model.lm_head_dv(), model.config.final_logit_softcapping


def _full_kl(graphdef, params, ref_params, mb: GRPOBatch, config: GRPOConfig, dropout_key=None):
    """(logp `[n, T]`, entropy or None, the exact `config.kl_divergence` of pi from pi_ref
    `[n, T]`, the policy forward's `moe.ExpertLoad` or None) from the policy's and the
    reference's hidden states, in vocabulary tiles (no `[n, T, V]` array)."""
    with_load = config.router_aux_coef > 0
    scored, w, cap = _hidden(
        graphdef, params, mb, config, dropout_key=dropout_key, with_load=with_load
    )
    mask = scored.from_rows(jnp.asarray(mb.completion_mask_nt, jnp.bool_))
    keep = mb.keep_count_nt if config.use_keep_mask else None
    logp, ent = logprobs_from_hidden(
        scored.hidden,
        w,
        scored.targets,
        mask,
        forward=config.forward,
        with_entropy=config.entropy_coef != 0,
        keep_count_nt=None if keep is None else scored.from_rows(keep),
        softcap=cap,
    )
    if isinstance(ref_params, Teacher):  # another model: its own graph
        ref, ref_w, ref_cap = _hidden(
            ref_params.graphdef, ref_params.params, mb, config, replay=False
        )
    elif ref_params is None and is_lora(params):  # the reference: base weights, adapters off
        ref, ref_w, ref_cap = _hidden(graphdef, params, mb, config, adapters=False, replay=False)
    else:
        ref, ref_w, ref_cap = _hidden(graphdef, ref_params, mb, config, replay=False)
    kl_nt = divergence_from_hidden(
        scored.hidden,
        w,
        jax.lax.stop_gradient(ref.hidden),
        jax.lax.stop_gradient(ref_w),
        mask,
        divergence=config.kl_divergence,
        beta=config.kl_jsd_beta,
        chunk_size=config.forward.chunk_size,
        vocab_chunk_size=config.forward.vocab_chunk_size,
        temperature=config.forward.temperature,
        softcap=cap,
        ref_softcap=ref_cap,
    )
    ent = None if ent is None else scored.to_rows(ent)
    return scored.to_rows(logp), ent, scored.to_rows(kl_nt), scored.load


def _forward_logp(
    graphdef,
    params,
    mb: GRPOBatch,
    config: GRPOConfig,
    *,
    with_entropy: bool,
    adapters=True,
    dropout_key=None,
    replay: bool = True,
    with_load: bool = False,
):
    """(logp `[n, T]`, entropy or None, the experts' load or None): `policy_logprobs` of the
    batch's rows with the step's forward settings."""
    scored, w, cap = _hidden(
        graphdef,
        params,
        mb,
        config,
        adapters=adapters,
        dropout_key=dropout_key,
        replay=replay,
        with_load=with_load,
    )
    keep = mb.keep_count_nt if config.use_keep_mask else None
    logp, ent = logprobs_from_hidden(
        scored.hidden,
        w,
        scored.targets,
        scored.from_rows(jnp.asarray(mb.completion_mask_nt, jnp.bool_)),
        forward=config.forward,
        with_entropy=with_entropy,
        keep_count_nt=None if keep is None else scored.from_rows(keep),
        softcap=cap,
    )
    return scored.to_rows(logp), None if ent is None else scored.to_rows(ent), scored.load


def _precompute_logp(
    graphdef,
    params,
    blocks: GRPOBatch,
    config: GRPOConfig,
    adapters: bool = True,
    replay: bool = True,
) -> Array:
    """Logprobs of every block `[M, K, n, T]` with the update's forward (no gradient)."""
    m, k = blocks.tokens_ns.shape[:2]
    flat = jax.tree.map(lambda x: x.reshape(m * k, *x.shape[2:]), blocks)

    def one(mb):
        return _forward_logp(
            graphdef, params, mb, config, with_entropy=False, adapters=adapters, replay=replay
        )[0]

    out = jax.lax.map(one, flat)
    return jax.lax.stop_gradient(out.reshape(m, k, *out.shape[1:]))


def _reward_kl(
    graphdef, params, ref_params, batch: GRPOBatch, config: GRPOConfig, blocks: int = 1
) -> tuple[Array, Array, Array]:
    """(old_logp_nt, ref_logp_nt, token rewards), each `[N, T]`: REINFORCE++'s KL penalty
    in the reward (`config.reward_kl_coef` > 0),

        token_reward_t = -reward_kl_coef * kl(old_logp_t, ref_logp_t)    (kl_estimator)

    at real tokens, 0 elsewhere. pi_old's and pi_ref's logprobs come from the batch or, where
    it has none, from forwards without gradient at `params` (pi_old: the step's input
    parameters) and `ref_params` (None: a LoRA policy's base, adapters off), on the batch's
    rows unpacked, in `blocks` contiguous chunks (groups kept whole)."""
    rows = dataclasses.replace(batch, packing=None, ptx=None)
    n = rows.tokens_ns.shape[0]
    unit = config.group_size if config.share_prompt else 1
    if n % (blocks * unit):
        blocks = 1

    def logp_of(p, adapters=True, replay=True):
        chunks = jax.tree.map(lambda x: x.reshape(1, blocks, n // blocks, *x.shape[1:]), rows)
        out = _precompute_logp(graphdef, p, chunks, config, adapters=adapters, replay=replay)
        return out.reshape(n, *out.shape[3:])

    old = rows.old_logp_nt
    if old is None:
        old = logp_of(params)
    ref = rows.ref_logp_nt
    if ref is None:
        ref = (
            logp_of(params, adapters=False, replay=False)
            if ref_params is None
            else logp_of(ref_params, replay=False)
        )
    mask = jnp.asarray(rows.completion_mask_nt, jnp.bool_)
    kl_nt = kl(old, ref, estimator=config.kl_estimator)
    rewards = jnp.where(mask, -config.reward_kl_coef * kl_nt, 0.0)
    return old, ref, jax.lax.stop_gradient(rewards)


@flax.struct.dataclass
class MiniBatchRows:
    """The rows of a whole mini-batch, for a policy loss with mini-batch statistics
    (`grpojax.train.objectives`: Clip-Cov, KL-Cov), as K micro-batches of n rows.

    logp_knt: `[K, n, T]` log-probabilities at the update's parameters (no gradient).
    old_logp_knt: `[K, n, T]` the old log-probabilities the loss compares them with.
    advantages: `[K, n]` or `[K, n, T]`.
    mask_knt: `[K, n, T]` real completion tokens.
    unit: rows per unit of the split (static): G with share_prompt (whole groups), else 1.
    """

    logp_knt: Array
    old_logp_knt: Array
    advantages: Array
    mask_knt: Array
    unit: int = flax.struct.field(pytree_node=False, default=1)


def _call_policy_loss(fn, config: GRPOConfig, logp, old_logp, adv, mask):
    """`fn(...)` checked: (`[N, T]` or `[N]` float32 loss, dict of float32 scalars)."""
    spec = config.policy_loss
    out = fn(logp, old_logp, adv, mask, config=config)
    if not (isinstance(out, tuple | list) and len(out) == 2 and isinstance(out[1], dict)):
        raise ValueError(
            f"policy_loss {spec!r} must return a pair (loss, metrics dict), got "
            f"{type(out).__name__}"
        )
    loss, metrics = jnp.asarray(out[0], jnp.float32), out[1]
    shape = tuple(mask.shape)
    if loss.shape not in (shape, shape[:1]):
        raise ValueError(
            f"policy_loss {spec!r} returned a loss of shape {loss.shape}; expected "
            f"[N, T]={shape} or [N]={shape[:1]}"
        )
    metrics = {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}
    for k, v in metrics.items():
        if v.shape != ():
            raise ValueError(f"policy_loss {spec!r}: metric {k!r} must be a scalar, got {v.shape}")
    return loss, metrics


def _policy_term(config, logp, old_logp, adv, mask, rows, micro_index):
    """The policy loss of this micro-batch's rows: computed on them alone, or (with `rows`,
    for a loss with mini-batch statistics) on the whole mini-batch, this micro-batch's rows
    carrying the gradient, then sliced back to them."""
    fn = config.policy_loss_fn
    if rows is None:
        return _call_policy_loss(fn, config, logp, old_logp, adv, mask)
    k, g = rows.logp_knt.shape[0], rows.unit

    def whole(x_knt, own):
        return merge_units(x_knt.at[micro_index].set(own), g)

    loss, metrics = _call_policy_loss(
        fn,
        config,
        whole(rows.logp_knt, logp),
        whole(rows.old_logp_knt, old_logp),
        merge_units(rows.advantages, g),
        merge_units(rows.mask_knt, g),
    )
    return split_units(loss, k, g)[micro_index], metrics


def grpo_micro_loss(
    params,
    mb: GRPOBatch,
    *,
    graphdef: nnx.GraphDef,
    config: GRPOConfig,
    denominator: Array,
    num_tokens: Array,
    old_from_current: bool | Array = False,
    num_sequences: Array | None = None,
    minibatch_rows: MiniBatchRows | None = None,
    micro_index: Array | int = 0,
    ref_params=None,
    lora_dropout_key: Array | None = None,
) -> tuple[Array, dict[str, Array]]:
    """The GRPO loss of one micro-batch, divided by the mini-batch's global denominator.

        loss_t = pg_coef w_t keep_i pg_t + beta kl_t - entropy_coef H_t
        loss   = aggregate(loss_nt, mask, mode=config.aggregation, denominator=denominator)

    With `config.entropy_aggregation="token-mean"` the entropy term leaves loss_t and is
    subtracted as entropy_coef * sum_t H_t / num_tokens (the update's token mean, TRL's).
    pg is `config.policy_loss` (`grpojax.train.objectives`). A policy loss with one value per
    sequence, pg_i (GMPO), enters as sum_i w_i keep_i pg_i / num_sequences (the mini-batch's
    non-empty sequences) plus the aggregated KL and entropy terms.

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
      num_sequences: `[]` non-empty sequences of the mini-batch, the denominator of a
        per-sequence policy loss (None: this micro-batch's).
      minibatch_rows: for a policy loss with mini-batch statistics, the whole mini-batch
        (`MiniBatchRows`), of which this micro-batch is number `micro_index`; None: the
        loss sees this micro-batch only.
      micro_index: `[]` int, this micro-batch's index in `minibatch_rows`.
      ref_params: the reference's `nnx.State`, for `kl_estimator="full"` (its forward runs
        here, without gradient); unused otherwise. None with LoRA params: the reference is
        `params` with the adapters off.
      lora_dropout_key: the key of this micro-batch's LoRA adapter dropout (the policy's
        forward only; the reference has its adapters off), for params whose adapters have
        dropout > 0; None: no dropout.

    Returns:
      (loss `[]`, metrics): metrics already weighted so that summing over the micro-batches
      of a mini-batch (`combine_metrics`) gives mini-batch values.
    """
    loss, metrics, _ = _micro_loss(
        params,
        mb,
        graphdef=graphdef,
        config=config,
        denominator=denominator,
        num_tokens=num_tokens,
        old_from_current=old_from_current,
        num_sequences=num_sequences,
        minibatch_rows=minibatch_rows,
        micro_index=micro_index,
        ref_params=ref_params,
        lora_dropout_key=lora_dropout_key,
    )
    return loss, metrics


def _micro_loss(
    params,
    mb: GRPOBatch,
    *,
    graphdef,
    config: GRPOConfig,
    denominator,
    num_tokens,
    old_from_current,
    num_sequences,
    minibatch_rows,
    micro_index,
    ref_params,
    lora_dropout_key,
):
    """`grpo_micro_loss` and the forward's per-token arrays: (loss, metrics, (logp_nt,
    old_logp_nt, entropy_nt or None)), each `[n, T]`. With `config.router_aux_coef` > 0 the
    loss adds coef * L_aux / num_microbatches (the micro-batches' mean of the mixture of
    experts' load-balancing loss over a mini-batch; `grpojax.models.moe`)."""
    mask = jnp.asarray(mb.completion_mask_nt, jnp.bool_)
    full_kl_nt = None
    with_load = config.router_aux_coef > 0
    if config.uses_reference and config.kl_estimator == "full":
        logp, ent, full_kl_nt, load = _full_kl(
            graphdef, params, ref_params, mb, config, dropout_key=lora_dropout_key
        )
    else:
        with_entropy = config.entropy_coef != 0
        logp, ent, load = _forward_logp(
            graphdef,
            params,
            mb,
            config,
            with_entropy=with_entropy,
            dropout_key=lora_dropout_key,
            with_load=with_load,
        )
    if old_from_current is True:
        old_logp = jax.lax.stop_gradient(logp)
    elif old_from_current is False:
        old_logp = mb.old_logp_nt
    else:
        # Array-valued old_from_current: the caller filled old_logp_nt in (see grpo_micro_loss).
        old = cast(Array, mb.old_logp_nt)
        old_logp = jnp.where(old_from_current, jax.lax.stop_gradient(logp), old)
    loss, metrics = _loss_terms(
        logp,
        old_logp,
        mb.advantages,
        mask,
        config=config,
        ref_logp_nt=mb.ref_logp_nt,
        sampler_logp_nt=mb.sampler_logp_nt,
        entropy_nt=ent,
        full_kl_nt=full_kl_nt,
        denominator=denominator,
        num_tokens=num_tokens,
        num_sequences=num_sequences,
        minibatch_rows=minibatch_rows,
        micro_index=micro_index,
    )
    if with_load:
        if load is None:
            raise ValueError("router_aux_coef > 0 needs a mixture-of-experts model")
        aux = load_balancing_loss(load)
        loss = loss + config.router_aux_coef * aux / config.num_microbatches
        metrics = {**metrics, "router_aux_loss": aux}
    return loss, metrics, (logp, old_logp, ent)


def _loss_terms(
    logp,
    old_logp,
    advantages,
    mask,
    *,
    config: GRPOConfig,
    ref_logp_nt,
    sampler_logp_nt,
    entropy_nt,
    full_kl_nt,
    denominator,
    num_tokens,
    num_sequences,
    minibatch_rows,
    micro_index,
):
    """The loss of `grpo_micro_loss` from its per-token arrays (everything after the
    forward): (loss, metrics)."""
    ent = entropy_nt
    pg, pm = _policy_term(config, logp, old_logp, advantages, mask, minibatch_rows, micro_index)
    per_sequence = pg.ndim == 1
    keep_n = jnp.ones(mask.shape[:1], jnp.bool_)
    if config.off_policy_delta is not None:
        behaviour = old_logp if sampler_logp_nt is None else sampler_logp_nt
        keep_n = off_policy_sequence_mask(
            logp, behaviour, advantages, mask, delta=config.off_policy_delta
        )
    rc_metrics = None
    if config.rollout_correction_mode is not None:
        weight_nt, rc_metrics = rollout_correction(
            old_logp, sampler_logp_nt, mask, **rollout_correction_args(config)
        )
        if per_sequence:
            if config.rollout_correction_level != "sequence":
                raise ValueError(
                    f"policy_loss {config.policy_loss!r} returns one loss per sequence [N]: "
                    "rollout_correction_level must be 'sequence'"
                )
            # Sequence-level weights are one value on every real token of the row.
            pg = pg * jnp.max(weight_nt, axis=-1)
        else:
            pg = pg * weight_nt
    agg: dict[str, Any] = dict(
        mode=config.aggregation, norm_constant=norm_constant_for(config, mask.shape[1])
    )
    if per_sequence:
        nonempty_n = jnp.any(mask, axis=-1)
        pg_n = jnp.where(nonempty_n, pg * keep_n.astype(jnp.float32), 0.0)
        if num_sequences is None:
            num_sequences = jnp.sum(nonempty_n, dtype=jnp.float32)
        pg_loss = jnp.where(num_sequences > 0, jnp.sum(pg_n) / jnp.maximum(num_sequences, 1), 0.0)
        total_nt = jnp.zeros(mask.shape, jnp.float32)
    else:
        pg_nt = pg * keep_n[:, None].astype(jnp.float32)
        # pg_coef (on-policy distillation's rl_coef) weighs the term; 1 is the RL algorithms'.
        total_nt = pg_nt if config.pg_coef == 1.0 else config.pg_coef * pg_nt

    n_tok = jnp.sum(mask, dtype=jnp.float32)
    share = n_tok / jnp.maximum(num_tokens, 1.0)

    def token_mean(x):
        return masked_mean(x, mask) * share

    # The loss's own diagnostics first: the step's names below take precedence.
    metrics: dict[str, Array] = loss_metrics(pm, share)
    if config.uses_reference:
        if full_kl_nt is not None:
            kl_nt = full_kl_nt
        elif config.kl_is_corrected:
            kl_nt = kl_is_corrected(logp, old_logp, ref_logp_nt)
        else:
            kl_nt = kl(logp, ref_logp_nt, estimator=config.kl_estimator)
        kl_nt = jnp.where(mask, kl_nt, 0.0)
        total_nt = total_nt + config.beta * kl_nt
        metrics["kl_loss"] = aggregate(kl_nt, mask, **agg, denominator=denominator)
        metrics["kl_ref"] = token_mean(jax.lax.stop_gradient(kl_nt))
    bonus: float | Array = 0.0  # the entropy term when it is not aggregated with the loss
    if ent is not None:
        ent = jnp.where(mask, ent, 0.0)
        if config.entropy_aggregation == "token-mean":
            # TRL's bonus: the token mean of the update (this micro-batch's share of it).
            bonus = config.entropy_coef * jnp.sum(ent) / jnp.maximum(num_tokens, 1.0)
        else:
            total_nt = total_nt - config.entropy_coef * ent
        metrics["entropy"] = token_mean(jax.lax.stop_gradient(ent))
    if per_sequence:
        weighted = pg_loss if config.pg_coef == 1.0 else config.pg_coef * pg_loss
        loss = weighted + aggregate(total_nt, mask, **agg, denominator=denominator) - bonus
        metrics["pg_loss"] = jax.lax.stop_gradient(pg_loss)
    else:
        loss = aggregate(total_nt, mask, **agg, denominator=denominator) - bonus
        metrics["pg_loss"] = jax.lax.stop_gradient(
            aggregate(pg_nt, mask, **agg, denominator=denominator)
        )
    metrics["kept_seq_frac"] = jnp.sum(keep_n & jnp.any(mask, axis=-1), dtype=jnp.float32)
    if rc_metrics is not None:
        for name, v in rc_metrics.items():
            metrics[f"rollout_{name}"] = v * share
    metrics = {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}
    return loss, metrics


def _update_counts(mask: Array, config: GRPOConfig) -> tuple[Array, Array, Array]:
    """(aggregation denominator, real tokens, non-empty sequences) of one update's rows,
    mask `[..., T]` (every leading axis is rows): the global counts its micro losses
    divide by."""
    flat_mask = mask.reshape(-1, mask.shape[-1])
    _, den = aggregate_parts(
        jnp.zeros(flat_mask.shape, jnp.float32),
        flat_mask,
        mode=config.aggregation,
        norm_constant=norm_constant_for(config, flat_mask.shape[1]),
    )
    num_tokens = jnp.sum(flat_mask, dtype=jnp.float32)
    num_sequences = jnp.sum(jnp.any(flat_mask, axis=-1), dtype=jnp.float32)
    return den, num_tokens, num_sequences


def grpo_loss_from_logprobs(
    logp_nt: Array,
    old_logp_nt: Array,
    advantages: Array,
    mask_nt: Array,
    *,
    config: GRPOConfig,
    ref_logp_nt: Array | None = None,
    sampler_logp_nt: Array | None = None,
    entropy_nt: Array | None = None,
) -> tuple[Array, dict[str, Array]]:
    """The GRPO step's loss from per-token log-probabilities, the N rows as one update.

        loss_t = pg_coef w_t keep_i pg_t + beta kl_t - entropy_coef H_t
        loss   = aggregate(loss_nt, mask_nt, mode=config.aggregation)

    The same code as the step after its forward (`grpo_micro_loss`), for research code with
    its own model: differentiate through `logp_nt`. pg is `config.policy_loss`, kl the
    per-token `config.kl_estimator`, and the entropy term follows
    `config.entropy_aggregation` (see `GRPOConfig`).

    Args:
      logp_nt: `[N, T]` float32 log pi_theta of the sampled tokens (the gradient flows
        through it); padding may hold finite garbage.
      old_logp_nt: `[N, T]` log pi_old; `stop_gradient(logp_nt)` for the first update of a
        batch (ratio 1).
      advantages: `[N]` or `[N, T]` (e.g. `compute_advantages(rewards_n, config)`).
      mask_nt: `[N, T]` bool real completion tokens (from lengths).
      config: the `GRPOConfig` (static).
      ref_logp_nt: `[N, T]` log pi_ref; required when `config.beta` > 0 (a per-token
        estimator: "full" needs hidden states, use `grpo_loss`).
      sampler_logp_nt: `[N, T]` the sampler's logprobs; required by rollout correction,
        read by off-policy masking when given.
      entropy_nt: `[N, T]` per-token entropy H_t of the policy; required when
        `config.entropy_coef` != 0.

    Returns:
      (loss `[]`, metrics): the step's per-update metrics (`pg_loss`, `kl_loss`, `kl_ref`,
      `entropy`, `kept_seq_frac`, the policy loss's own), float32 scalars.
    """
    logp = jnp.asarray(logp_nt, jnp.float32)
    mask = jnp.asarray(mask_nt, jnp.bool_)
    if logp.ndim != 2 or mask.shape != logp.shape:
        raise ValueError(
            f"logp_nt and mask_nt must both be [N, T], got {logp.shape} and {mask.shape}"
        )
    arrays = {
        "old_logp_nt": old_logp_nt,
        "ref_logp_nt": ref_logp_nt,
        "sampler_logp_nt": sampler_logp_nt,
        "entropy_nt": entropy_nt,
    }
    for name, x in arrays.items():
        if x is not None and jnp.shape(x) != logp.shape:
            raise ValueError(f"{name} must be [N, T]={logp.shape}, got {jnp.shape(x)}")
    if jnp.shape(advantages) not in (logp.shape[:1], logp.shape):
        raise ValueError(
            f"advantages must be [N]={logp.shape[:1]} or [N, T]={logp.shape}, got "
            f"{jnp.shape(advantages)}"
        )
    needs = {
        "ref_logp_nt": config.uses_reference,
        "sampler_logp_nt": config.rollout_correction_mode is not None,
        "entropy_nt": config.entropy_coef != 0,
    }
    for name, needed in needs.items():
        if needed and arrays[name] is None:
            raise ValueError(f"{name} is required by this config ({_why(name)})")
    if config.uses_reference and config.kl_estimator == "full":
        raise ValueError(
            "kl_estimator='full' needs the models' hidden states: use grpo_loss, or a "
            "per-token kl_estimator here"
        )
    if config.off_policy_delta is not None and jnp.ndim(advantages) != 1:
        raise ValueError("off-policy sequence masking needs sequence advantages [N]")
    den, num_tokens, num_sequences = _update_counts(mask, config)
    f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
    loss, metrics = _loss_terms(
        logp,
        f32(old_logp_nt),
        f32(advantages),
        mask,
        config=config,
        ref_logp_nt=None if ref_logp_nt is None else f32(ref_logp_nt),
        sampler_logp_nt=None if sampler_logp_nt is None else f32(sampler_logp_nt),
        entropy_nt=None if entropy_nt is None or config.entropy_coef == 0 else f32(entropy_nt),
        full_kl_nt=None,
        denominator=den,
        num_tokens=num_tokens,
        num_sequences=num_sequences,
        minibatch_rows=None,
        micro_index=0,
    )
    metrics["kept_seq_frac"] = metrics["kept_seq_frac"] / jnp.maximum(num_sequences, 1.0)
    return loss, metrics


def _why(name: str) -> str:
    return {
        "ref_logp_nt": "beta > 0",
        "sampler_logp_nt": "rollout_correction_mode is set",
        "entropy_nt": "entropy_coef != 0",
    }[name]


def grpo_loss(
    model,
    batch: GRPOBatch,
    config: GRPOConfig,
    *,
    ref_params=None,
    with_grads: bool = False,
) -> tuple[Array, dict[str, Any]]:
    """The GRPO loss of a batch at the model's parameters, without an optimizer update.

        loss = aggregate(w_t keep_i pg_t + beta kl_t - entropy_coef H_t)   (`GRPOConfig`)

    Exactly the first update of `grpo_update` on the same batch, with the whole batch as one
    update (no mini- or micro-batches, no shuffle): the step's own functions prepare the
    batch (advantages from `rewards_n` when it has none, DAPO's overlong filter), run the
    forward and compute the loss, and `with_grads=True` differentiates what the step
    differentiates (a LoRA model: its adapters). Pure and traceable: call it inside your
    own `jax.jit` (closing over the model's graph and the config).

    Args:
      model: an `nnx.Module` whose state is only `nnx.Param`s, or a `(graphdef, params)`
        pair (e.g. `create_train_state`'s graph and `state.params`).
      batch: a `GRPOBatch` of N rows (`grpo_batch_from_ids` builds one from token-id
        lists), unpacked. Without `old_logp_nt` the old policy is the model itself
        (`stop_gradient(logp)`: every ratio is 1, the step's first update).
      config: the `GRPOConfig` (static); its num_epochs / num_minibatches /
        num_microbatches / shuffle are not used.
      ref_params: the reference policy's params, for beta > 0 when the batch has no
        `ref_logp_nt` (and for `kl_estimator="full"`); None with a LoRA model: its base
        weights with the adapters off, as in the step.
      with_grads: also return the gradient of the loss.

    LoRA adapter dropout is not applied (the loss is deterministic).

    Returns:
      (loss `[]`, aux) with aux: "logp_nt" `[N, T]` log pi_theta of the completion tokens,
      "old_logp_nt" `[N, T]`, "ref_logp_nt" `[N, T]` or None, "advantages" `[N]` or
      `[N, T]` (as the loss used them), "completion_mask_nt" `[N, T]` (after the overlong
      filter), "entropy_nt" `[N, T]` or None (entropy_coef = 0), "metrics" (the step's
      per-update metrics, with "loss", and "grad_norm" when `with_grads`), and "grads"
      (like the params, or a LoRA model's adapters) when `with_grads`.
    """
    if isinstance(model, tuple | list) and len(model) == 2:
        graphdef, params = model
    elif isinstance(model, nnx.Module):
        graphdef, params = split_params(model)
    else:
        raise ValueError(
            f"model must be an nnx.Module or a (graphdef, params) pair, got {type(model).__name__}"
        )
    _check_rows(batch, config)
    n = batch.tokens_ns.shape[0]
    if batch.packing is not None:
        raise ValueError("grpo_loss takes unpacked rows: batch.packing must be None")
    if config.share_prompt and n % config.group_size:
        raise ValueError(
            f"share_prompt=True reads contiguous groups: N={n} rows must divide into "
            f"group_size={config.group_size}"
        )
    full_kl = config.uses_reference and config.kl_estimator == "full"
    if config.uses_reference and ref_params is None and not is_lora(params):
        if full_kl or batch.ref_logp_nt is None:
            raise ValueError(
                "beta > 0 needs the reference: pass ref_params"
                + ("" if full_kl else " or batch.ref_logp_nt")
            )
    one = dataclasses.replace(config, num_minibatches=1, num_microbatches=1)
    ptx = ptx_minibatches(batch.ptx, one)
    token_rewards = None
    if config.reward_kl_coef > 0 and batch.advantages is None:
        _, ref, token_rewards = _reward_kl(graphdef, params, ref_params, batch, config)
        batch = dataclasses.replace(batch, ref_logp_nt=ref)
    batch = _prepare_rows(dataclasses.replace(batch, ptx=None), config, token_rewards)
    if full_kl:
        batch = dataclasses.replace(batch, ref_logp_nt=None)
    elif config.uses_reference and batch.ref_logp_nt is None:
        block = jax.tree.map(lambda x: x[None, None], batch)  # the step's [M, K, n] layout
        if ref_params is None:  # LoRA: the base weights, adapters off
            ref = _precompute_logp(graphdef, params, block, config, adapters=False, replay=False)
        else:
            ref = _precompute_logp(graphdef, ref_params, block, config, replay=False)
        batch = dataclasses.replace(batch, ref_logp_nt=ref[0, 0])
    den, num_tokens, num_sequences = _update_counts(
        jnp.asarray(batch.completion_mask_nt, jnp.bool_), config
    )
    trainable, frozen = trainable_split(params)

    def loss_fn(p):
        full = join_trainable(p, frozen)
        loss, metrics, arrays = _micro_loss(
            full,
            batch,
            graphdef=graphdef,
            config=config,
            denominator=den,
            num_tokens=num_tokens,
            old_from_current=batch.old_logp_nt is None,
            num_sequences=num_sequences,
            minibatch_rows=None,
            micro_index=0,
            ref_params=ref_params if full_kl else None,
            lora_dropout_key=None,
        )
        if ptx is not None:
            ptx_mb = jax.tree.map(lambda x: x[0, 0], ptx)
            term, metrics["ptx_loss"] = ptx_micro_loss(
                full, ptx_mb, graphdef=graphdef, config=config, num_tokens=num_targets(ptx_mb)
            )
            loss = loss + term
        return loss, (metrics, arrays)

    if with_grads:
        (loss, (metrics, arrays)), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable)
        metrics["grad_norm"] = optax.tree.norm(grads).astype(jnp.float32)
    else:
        loss, (metrics, arrays) = loss_fn(trainable)
    metrics["kept_seq_frac"] = metrics["kept_seq_frac"] / jnp.maximum(num_sequences, 1.0)
    metrics["loss"] = loss
    logp, old_logp, ent = arrays
    aux = {
        "logp_nt": jax.lax.stop_gradient(logp),
        "old_logp_nt": old_logp,
        "ref_logp_nt": batch.ref_logp_nt,
        "advantages": batch.advantages,
        "completion_mask_nt": batch.completion_mask_nt,
        "entropy_nt": None if ent is None else jax.lax.stop_gradient(ent),
        "metrics": metrics,
    }
    if with_grads:
        aux["grads"] = grads
    return loss, aux


__all__ = ["MiniBatchRows", "grpo_loss", "grpo_loss_from_logprobs", "grpo_micro_loss"]
