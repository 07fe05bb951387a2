"""The PPO update (InstructGPT recipe): actor and critic, KL-shaped rewards, GAE, one program.

One call of the step does, inside one compiled program:

1. recompute the old log-probabilities and values of the rollout with the current
   parameters (the same forward the update uses, so the first ratio is exactly 1);
2. shape per-token rewards with the KL penalty against the reference policy
   (`kl_penalty_rewards`, coefficient `beta` from the KL controller in the state), run GAE
   against the old values, optionally whiten the advantages. With `kl_estimator="full"` the
   penalty is the exact KL over the vocabulary,
   KL_t = sum_v pi_old(v|s_t) log(pi_old(v|s_t) / pi_ref(v|s_t)), from the old policy's and
   the reference's hidden states in vocabulary tiles (`reference_kl`, through
   `grpojax.ops.kl_from_hidden`): the reference (`state.actor.ref_params`, or a LoRA
   actor's base with adapters off) runs in step 1's pass beside the policy, micro-batch by
   micro-batch, and the batch needs no reference logprobs. With kl_coef = 0
   (`PPOConfig.uses_reference` False) there is no penalty and no reference at all: the
   reward is the score on the last real token, and the batch needs no reference logprobs;
3. `num_epochs` passes over shuffled mini-batches (`lax.scan` over epochs and mini-batches),
   each an exact micro-batch-accumulated gradient of

       loss = agg(pg_t - entropy_coef * H_t) + vf_coef * agg(0.5 * max((V - R)^2, (V_clip - R)^2))
              [+ ptx_coef * NLL_ptx]

   applied with `grpojax.train.state.apply_gradients` (non-finite updates are skipped);
   with `target_kl`, a mini-batch whose approximate KL(pi_old || pi) exceeds it is not
   applied and every later update of the call is masked out (early stop);
   for the first `critic_warmup_steps` calls only the critic is updated;
4. update the KL controller from the measured KL to the reference (when there is one).

PPO-ptx (InstructGPT eq. 2, `config.ptx_coef` > 0): the batch's `ptx` rows (an `SFTBatch` of
N' rows, N' divisible by M x K) are split without shuffling into M mini-batches of K
micro-batches; mini-batch m's rows join update m of every epoch, micro-batch j adding
ptx_coef * NLL_j / tokens(ptx mini-batch m) to the actor's loss
(`grpojax.train.sft.ptx_micro_loss`). The K gradients thus sum exactly to ptx_coef x the
gradient of the mini-batch's token-mean next-token NLL, in the same optimizer update as
the PPO terms. With ptx_coef = 0 the ptx rows are ignored (no forward over them).

Actor and critic: `critic="separate"` trains a `ValueModel` on its own backbone with its own
optimizer; `critic="shared"` puts a `ScalarHead` on the actor's final hidden states (the
value loss then also trains the actor's backbone) and the critic state holds only the head.

Shared prompts (`config.share_prompt`, the driver's default): with the rows in contiguous
groups of `config.group_size` samples of one prompt, every forward of the step (old pass,
update, separate critic, the "full" KL's reference) runs each prompt once
(`grpojax.train.common.completion_hidden`), and the shuffles and mini/micro-batch splits
move whole groups (`split_units`, `unit_permutation`).

Usage (the driver's view; `mesh` from `grpojax.models.make_mesh`):

    critic = init_critic(actor, mode=config.critic, rngs=nnx.Rngs(1))
    tx = make_optimizer(OptimizerConfig(learning_rate=1e-6))
    graphs, state = create_ppo_state(actor, critic, tx, tx, config=config, rng=key)
    state, _ = shard_ppo_state(state, tx, tx, mesh)
    batch = batch_from_rollout(rollout, scores_n, ref_logp_nt)
    step = make_ppo_step(config, graphs, tx, tx, mesh=mesh, state=state, batch=batch)
    state, metrics = step(state, batch)

Batch layout is `grpojax.train.common`'s: `tokens_ns` `[N, S]` with S = P + T, the prompt
left-padded to P columns and completion token t at column P + t; the value `V(s_t)` of the
state before completion token t is read at column P + t - 1, where its logit is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax import Array
from jax.sharding import Mesh

from grpojax.models.decoder import Decoder, ScalarHead, ValueModel
from grpojax.models.lora import dropout_rate as lora_dropout_rate
from grpojax.ops.advantages import gae, last_token_mask, whiten
from grpojax.ops.aggregation import aggregate, aggregate_parts
from grpojax.ops.checks import check_choice
from grpojax.ops.corrections import rollout_correction
from grpojax.ops.kl import (
    kl,
    kl_penalty_rewards,
)
from grpojax.ops.logprobs import kl_from_hidden
from grpojax.ops.losses import entropy_bonus, policy_loss, value_loss_with_metrics
from grpojax.ops.masks import masked_mean, masked_sum, masked_var
from grpojax.train.common import (
    accumulate_gradients,
    batch_shardings,
    jit_step,
    logprobs_from_hidden,
    loss_metric_name,
    loss_metrics,
    merge_units,
    scored_hidden,
    split_units,
    unit_permutation,
)
from grpojax.train.config import (
    CRITIC_MODES,
    PPOConfig,
    norm_constant_for,
    rollout_correction_args,
)
from grpojax.train.packing import Packing, check_packing
from grpojax.train.rows import TrainBatch
from grpojax.train.sft import SFTBatch, num_targets, ptx_micro_loss, ptx_minibatches
from grpojax.train.state import (
    TrainState,
    apply_gradients,
    create_train_state,
    is_lora,
    join_trainable,
    merge,
    put_global,
    train_state_shardings,
    trainable_split,
    tree_all_finite,
)


class PPOBatch(NamedTuple):
    """A rollout batch for the PPO step (N = B*G rows, S = P + T columns).

    tokens_ns: `[N, S]` int32 prompt (left-padded to P) + completion tokens.
    mask_ns: `[N, S]` bool real prompt and completion tokens (from lengths).
    completion_mask_nt: `[N, T]` bool real completion tokens (= `mask_ns[:, P:]`); fixes T.
    scores_n: `[N]` float32 sequence scores (reward model or verifier).
    ref_logp_nt: `[N, T]` float32 reference-policy logprobs of the completion tokens, or None
      with `kl_estimator="full"` (the step runs the reference itself) or kl_coef = 0 (no
      reference); given ones are then unused.
    ptx: optional `SFTBatch` of N' rows of pretraining text `[N', S']`, the PPO-ptx term's
      data; required when `config.ptx_coef` > 0, ignored when it is 0.
    packing: optional `grpojax.train.packing.Packing` of the N rows: the actor's and the
      critic's forwards run on its packed rows, and its bins are what the step shuffles and
      splits (they must divide into num_minibatches x num_microbatches); the other fields
      stay `[N, ...]` in batch order (as `GRPOBatch.packing`).
    token_rewards_nt: optional `[N, T]` float32 rewards at given tokens, added to r_t before
      GAE (e.g. a multi-turn episode's per-turn rewards at each turn's last policy token);
      ignored where the completion mask is False. None: the score alone.
    sampler_logp_nt: optional `[N, T]` float32 the sampler's logprobs of the completion
      tokens: the rollout correction's behaviour policy (`rollout_correction_mode`);
      required when it is set, unused otherwise.
    """

    tokens_ns: Array
    mask_ns: Array
    completion_mask_nt: Array
    scores_n: Array
    ref_logp_nt: Array | None
    ptx: SFTBatch | None = None
    packing: Packing | None = None
    token_rewards_nt: Array | None = None
    sampler_logp_nt: Array | None = None


def ppo_batch_from_rows(
    batch: TrainBatch,
    config: PPOConfig,
    *,
    ref_logp_nt: Array | None = None,
    ptx: SFTBatch | None = None,
) -> PPOBatch:
    """The `PPOBatch` of a step's sampled rows: each valid row's reward as its score (0 for
    a failed reward call); rows with per-token rewards (multi-turn episodes: each reward at
    its token) score 0, their rewards all in `token_rewards_nt`; the ptx rows when
    ptx_coef > 0."""
    scores = np.where(batch.host["valid_n"], batch.host["rewards_n"], 0.0)
    if batch.token_rewards_nt is not None:
        scores = np.zeros_like(scores)
    return PPOBatch(
        batch.tokens_ns,
        batch.mask_ns,
        batch.completion_mask_nt,
        put_global(scores.astype(np.float32), batch.rewards_n.sharding),
        ref_logp_nt,
        ptx=ptx if config.ptx_coef else None,
        packing=batch.packing,
        token_rewards_nt=batch.token_rewards_nt,
        sampler_logp_nt=batch.sampler_logp_nt if config.rollout_correction_mode else None,
    )


def batch_from_rollout(rollout, scores_n: Array, ref_logp_nt: Array | None) -> PPOBatch:
    """A `PPOBatch` from a `grpojax.sampling.Rollout`, its scores and reference logprobs
    (None with `kl_estimator="full"` or kl_coef = 0)."""
    tokens_ns, mask_ns, _ = rollout.sequences()
    return PPOBatch(
        tokens_ns=tokens_ns,
        mask_ns=mask_ns,
        completion_mask_nt=rollout.mask_nt,
        scores_n=jnp.asarray(scores_n, jnp.float32),
        ref_logp_nt=None if ref_logp_nt is None else jnp.asarray(ref_logp_nt, jnp.float32),
    )


@flax.struct.dataclass
class PPOState:
    """Actor and critic train states.

    actor: `TrainState` of the policy (`Decoder`); its `step` counts step calls, its `rng`
      seeds the mini-batch shuffles and its `kl_state` holds the reward-penalty beta; its
      `ref_params` hold the reference policy when `kl_estimator="full"` and kl_coef > 0
      (LoRA: None, the reference is the base with adapters off), else None (reference
      logprobs come with the batch, or there is no reference).
    critic: `TrainState` of the critic (`ValueModel` when separate, `ScalarHead` when
      shared); its own optimizer state and update/skip counts (its rng and kl_state unused).
    """

    actor: TrainState
    critic: TrainState


class PPOGraphs(NamedTuple):
    """The static halves of the actor and critic modules (`nnx.GraphDef`s)."""

    actor: Any
    critic: Any


def init_critic(actor: Decoder, *, mode: str, rngs: nnx.Rngs, backbone: Decoder | None = None):
    """The critic module for `mode`.

    "shared": a `ScalarHead` of the actor's width (applied to the actor's hidden states).
    "separate": a `ValueModel` on `backbone`, by default a copy of the actor (InstructGPT
    initialises the critic from a pretrained network; the copy is the one at hand).
    """
    check_choice("mode", mode, CRITIC_MODES)
    if mode == "shared":
        return ScalarHead(actor.config.hidden_size, rngs=rngs)
    if backbone is None:
        # Copy the arrays too: a shared buffer would be donated twice by the step.
        graphdef, state = nnx.split(actor)
        backbone = nnx.merge(graphdef, jax.tree.map(jnp.copy, state))
    return ValueModel(backbone, rngs=rngs)


def create_ppo_state(
    actor: Decoder,
    critic,
    actor_tx: optax.GradientTransformation,
    critic_tx: optax.GradientTransformation,
    *,
    config: PPOConfig,
    rng: Array,
) -> tuple[PPOGraphs, PPOState]:
    """Split actor and critic (from `init_critic`) into graphdefs and the initial `PPOState`.

    With `config.kl_estimator="full"` and kl_coef > 0 the actor's state keeps a copy of its
    initial parameters, in the compute dtype, as the reference policy
    (`TrainState.ref_params`; a LoRA actor keeps none: its reference is the base with
    adapters off).
    """
    expected = ScalarHead if config.critic == "shared" else ValueModel
    if not isinstance(critic, expected):
        raise ValueError(
            f"critic={config.critic!r} needs a {expected.__name__} critic, got "
            f"{type(critic).__name__} (build it with init_critic)"
        )
    actor_gd, actor_state = create_train_state(
        actor,
        actor_tx,
        rng=rng,
        kl_controller=config.kl_controller(),
        with_ref=config.kl_estimator == "full" and config.uses_reference,
    )
    critic_gd, critic_state = create_train_state(critic, critic_tx, rng=jax.random.key(0))
    return PPOGraphs(actor_gd, critic_gd), PPOState(actor=actor_state, critic=critic_state)


def ppo_state_shardings(state: PPOState, actor_tx, critic_tx, mesh: Mesh) -> PPOState:
    """A `PPOState` of `NamedSharding`s (parameters by the decoder's logical-axis table)."""
    return PPOState(
        actor=train_state_shardings(state.actor, actor_tx, mesh),
        critic=train_state_shardings(state.critic, critic_tx, mesh),
    )


def shard_ppo_state(state: PPOState, actor_tx, critic_tx, mesh: Mesh):
    """`state` placed on `mesh`; returns (state, shardings)."""
    shardings = ppo_state_shardings(state, actor_tx, critic_tx, mesh)
    return put_global(state, shardings), shardings


class _Rows(NamedTuple):
    """Per-row data the update scans over (everything is `[N, ...]`), and the packing of
    those rows (`[R, ...]` bins of `unit` rows each) or None."""

    tokens_ns: Array
    mask_ns: Array
    completion_mask_nt: Array
    old_logp_nt: Array | None  # these four: None in the old pass (not computed yet)
    old_values_nt: Array | None
    adv_nt: Array | None
    returns_nt: Array | None
    packing: Packing | None = None
    weight_nt: Array | None = None  # the rollout correction's weights, or None (off)

    def permuted(self, perm_n: Array) -> _Rows:
        """The rows in `perm_n` order; a packing's bins follow their slot rows."""
        rows = jax.tree.map(lambda x: jnp.take(x, perm_n, axis=0), self._replace(packing=None))
        if self.packing is None:
            return rows
        return rows._replace(packing=self.packing.permuted(perm_n))

    def split(self, k: int, unit: int):
        """`split_units` into k parts, the packing's bins with their rows."""
        parts = split_units(self._replace(packing=None), k, unit)
        if self.packing is None:
            return parts
        return parts._replace(packing=split_units(self.packing, k, 1))


# Metrics of one mini-batch update that are averaged over the applied updates.
_UPDATE_METRICS = (
    "loss",
    "policy_loss",
    "value_loss",
    "entropy",
    "clip_frac_low",
    "clip_frac_high",
    "approx_kl",
    "approx_kl_k1",
    "ratio_mean",
    "value_clip_frac",
    "grad_norm",
    "critic_grad_norm",
    "lr",
    "critic_lr",
)
_APPLY_METRICS = ("grad_norm", "critic_grad_norm", "lr", "critic_lr", "skipped")


def _user_metric_names(c) -> tuple[str, ...]:
    """The names `c.policy_loss_fn`'s metrics are logged under (`loss_metric_name`; the
    loss traced once on `[1, 1]` shapes)."""
    f32 = jax.ShapeDtypeStruct((1, 1), jnp.float32)
    mask = jax.ShapeDtypeStruct((1, 1), jnp.bool_)
    _, metrics = jax.eval_shape(
        lambda lp, old, adv, m: c.policy_loss_fn(lp, old, adv, m, config=c), f32, f32, f32, mask
    )
    return tuple(loss_metric_name(k) for k in metrics)


class _Carry(NamedTuple):
    """The PPO update's scan carry over epochs and mini-batches.

    state: the `PPOState` being updated.
    done: `[]` bool, early stop reached (the remaining mini-batches are skipped).
    stop_epoch: `[]` int32 epoch of the early stop (num_epochs when none).
    epoch: `[]` int32 the current epoch.
    sums: metric name -> `[]` f32 sum over the applied updates.
    applied: `[]` f32 updates applied; skipped: `[]` f32 updates skipped as non-finite.
    """

    state: Any
    done: Array
    stop_epoch: Array
    epoch: Array
    sums: dict[str, Array]
    applied: Array  # not `count`, which would shadow tuple.count
    skipped: Array


def explained_variance(values_nt: Array, returns_nt: Array, mask_nt: Array) -> Array:
    """`1 - Var[R - V] / Var[R]` over real tokens (0 when the returns have no variance).

    1 means the critic predicts the returns exactly, 0 no better than their mean, < 0 worse.
    Shapes: values_nt, returns_nt, mask_nt `[N, T]`; returns `[]` float32.
    """
    var_r = masked_var(returns_nt, mask_nt)
    var_err = masked_var(jnp.asarray(returns_nt, jnp.float32) - values_nt, mask_nt)
    return jnp.where(var_r > 0, 1.0 - var_err / jnp.where(var_r > 0, var_r, 1.0), 0.0)


class PPOTargets(NamedTuple):
    """What the update regresses and reinforces, all `[N, T]` float32 (0 where masked)."""

    kl_nt: Array | None  # per-token KL of the old policy to the reference (None: kl_coef 0)
    rewards_nt: Array  # KL-shaped per-token rewards
    adv_nt: Array  # GAE advantages (whitened when configured)
    returns_nt: Array  # GAE returns, the critic's targets


def reference_kl(
    graphdef,
    actor_params,
    ref_params,
    tokens_ns: Array,
    mask_ns: Array,
    completion_mask_nt: Array,
    *,
    forward,
    hidden_ntd: Array | None = None,
    group_size: int = 1,
    packing: Packing | None = None,
) -> Array:
    """Exact per-token KL of the actor to the reference over the whole vocabulary.

        KL_t = sum_v pi(v|s_t) (log pi(v|s_t) - log pi_ref(v|s_t)),   pi = softmax(z / temp)

    from both models' completion hidden states, in `[C, Vc]` vocabulary tiles
    (`grpojax.ops.kl_from_hidden`; no `[N, T, V]` array), under stop-gradient: in PPO it is
    part of the reward, not of the loss.

    Args:
      graphdef: the actor's `nnx.GraphDef`.
      actor_params: the actor's `nnx.State`.
      ref_params: the reference's `nnx.State` (same architecture); None for a LoRA actor,
        whose reference is its base weights with the adapters switched off.
      tokens_ns, mask_ns: `[N, S]` prompt + completion tokens and mask (`PPOBatch`).
      completion_mask_nt: `[N, T]` real completion tokens (masked positions give 0).
      forward: a `ForwardConfig` (chunk sizes and temperature).
      hidden_ntd: the actor's hidden states at the forward's scored positions when the
        caller has them (the step's old pass: `[N, T, D]`, or packed `[R, W + J, D]`), else
        computed here.
      group_size: G (static) > 1: rows in contiguous groups sharing their prompt, each
        prompt run once per forward (`completion_hidden`).
      packing: the rows' `Packing` (they are in its slot order), or None.

    Returns:
      `[N, T]` float32, >= 0.
    """
    t = completion_mask_nt.shape[1]
    actor = merge(graphdef, actor_params)
    forward_kw: dict[str, Any] = dict(group_size=group_size, packing=packing)
    if hidden_ntd is None:
        hidden_ntd = scored_hidden(actor, tokens_ns, mask_ns, t, **forward_kw).hidden
    if ref_params is None:
        if not is_lora(actor_params):
            raise ValueError(
                "kl_estimator='full' runs the reference inside the step: the actor's state "
                "must hold ref_params (create_ppo_state keeps them for kl_estimator='full'), "
                "or the actor must be LoRA (its base is the reference)"
            )
        ref = merge(graphdef, actor_params)
        ref.lora_enabled = False  # a fresh module of this trace: nothing to restore
    else:
        ref = merge(graphdef, ref_params)
    ref_scored = scored_hidden(ref, tokens_ns, mask_ns, t, **forward_kw)
    kl_nt = kl_from_hidden(
        hidden_ntd,
        actor.lm_head_dv(),
        ref_scored.hidden,
        ref.lm_head_dv(),
        ref_scored.from_rows(jnp.asarray(completion_mask_nt, jnp.bool_)),
        chunk_size=forward.chunk_size,
        vocab_chunk_size=forward.vocab_chunk_size,
        temperature=forward.temperature,
        softcap=actor.config.final_logit_softcapping,
        ref_softcap=ref.config.final_logit_softcapping,
    )
    return jax.lax.stop_gradient(ref_scored.to_rows(kl_nt))


def ppo_targets(
    config: PPOConfig,
    batch: PPOBatch,
    old_logp_nt: Array,
    old_values_nt: Array,
    *,
    beta: Array | float,
    kl_nt: Array | None = None,
) -> PPOTargets:
    """Shaped rewards, advantages and returns from the old policy's logprobs and values.

        KL_t = kl(old_logp_t, ref_logp_t)         (config.kl_estimator k1 / k2 / k3 / abs)
             = sum_v pi_old(v|s_t) log(pi_old(v|s_t) / pi_ref(v|s_t))            ("full")
        r_t  = -beta * KL_t  (+ score_n on the last real token)  (kl_penalty_rewards)
               (+ token_rewards_t, where the batch has them)
        A, R = gae(r, V_old, mask, gamma, lam);  A <- whiten(A) if whiten_advantages

    With kl_coef = 0 (`config.uses_reference` False) there is no KL: r_t is score_n on the
    last real token and 0 elsewhere, `batch.ref_logp_nt` is not read and `kl_nt` is None.

    Args:
      config: the `PPOConfig`.
      batch: the `PPOBatch` (scores `[N]`, reference logprobs and completion mask `[N, T]`).
      old_logp_nt: `[N, T]` logprobs of the completion tokens under the policy that sampled.
      old_values_nt: `[N, T]` the critic's values `V(s_t)` at sampling time.
      beta: the KL coefficient (e.g. `state.actor.kl_state.beta`).
      kl_nt: `[N, T]` the exact per-token KL (`reference_kl`); required with "full" and
        kl_coef > 0 (then `batch.ref_logp_nt` is not read), not accepted otherwise.
    """
    mask = jnp.asarray(batch.completion_mask_nt, jnp.bool_)
    scores = jnp.asarray(batch.scores_n, jnp.float32)

    def with_scores(rewards_nt):  # + score_n on the last real token, 0 where masked
        rewards_nt = jnp.where(last_token_mask(mask), rewards_nt + scores[:, None], rewards_nt)
        return jnp.where(mask, rewards_nt, 0.0)

    if not config.uses_reference:
        if kl_nt is not None:
            raise ValueError("kl_nt is the KL to the reference; kl_coef=0 has no reference")
        rewards_nt = with_scores(jnp.zeros(mask.shape, jnp.float32))
    elif config.kl_estimator == "full":
        if kl_nt is None:
            raise ValueError(
                "kl_estimator='full' needs kl_nt, the exact per-token KL (reference_kl)"
            )
        kl_nt = jnp.where(mask, jnp.asarray(kl_nt, jnp.float32), 0.0)
        rewards_nt = with_scores(-jnp.asarray(beta, jnp.float32) * kl_nt)
    else:
        if kl_nt is not None:
            raise ValueError(
                f"kl_nt is the exact KL of kl_estimator='full'; kl_estimator="
                f"{config.kl_estimator!r} estimates it from batch.ref_logp_nt"
            )
        if batch.ref_logp_nt is None:
            raise ValueError(
                f"kl_estimator={config.kl_estimator!r} needs batch.ref_logp_nt (the "
                f"reference's logprobs of the completion tokens)"
            )
        est = config.kl_estimator
        kl_nt = jnp.where(mask, kl(old_logp_nt, batch.ref_logp_nt, estimator=est), 0.0)
        rewards_nt = kl_penalty_rewards(
            batch.scores_n, old_logp_nt, batch.ref_logp_nt, mask, beta=beta, estimator=est
        )
    if batch.token_rewards_nt is not None:
        rewards_nt = rewards_nt + jnp.where(
            mask, jnp.asarray(batch.token_rewards_nt, jnp.float32), 0.0
        )
    adv_nt, returns_nt = gae(rewards_nt, old_values_nt, mask, gamma=config.gamma, lam=config.lam)
    if config.whiten_advantages:
        adv_nt = whiten(adv_nt, mask)
    return PPOTargets(kl_nt, rewards_nt, adv_nt, returns_nt)


def make_ppo_update(
    config: PPOConfig,
    graphs: PPOGraphs,
    actor_tx: optax.GradientTransformation,
    critic_tx: optax.GradientTransformation,
    *,
    actor_schedule: optax.Schedule | None = None,
    critic_schedule: optax.Schedule | None = None,
) -> Callable[[PPOState, PPOBatch], tuple[PPOState, dict[str, Array]]]:
    """The pure PPO step `update(state, batch) -> (state, metrics)` (not jitted here).

    See the module docstring for the algorithm; `make_ppo_step` is its jit call site.
    Shapes: N rows, T completion tokens (`PPOBatch`). All metrics are float32 scalars:

      loss, policy_loss, value_loss (the aggregated terms), entropy (token mean),
      clip_frac_low / clip_frac_high, approx_kl (k3) / approx_kl_k1 of KL(pi_old || pi),
      ratio_mean, value_clip_frac, grad_norm / critic_grad_norm (before clipping), lr /
      critic_lr: means over the applied mini-batch updates (with your `policy_loss`, its
      own metrics in place of the clip fractions, as the GRPO step logs them);
      kl_ref (mean per-sequence KL of the old policy to the reference, the controller's
      input) and kl_ref_token (its token mean), when kl_coef > 0; beta (used for the
      rewards), beta_next,
      score_mean, reward_mean (mean per-sequence sum of shaped rewards), values_mean,
      returns_mean, explained_variance (old values vs returns), early_stop_epoch (epoch of
      the early stop, `num_epochs` if none), updates (applied updates, non-finite ones
      excluded), skipped (non-finite updates in this call), skipped_total (running count),
      critic_warmup (1 if only the critic was updated); with `ptx_coef` > 0 also ptx_loss
      (mean next-token NLL per target token of the ptx rows; `loss` includes ptx_coef times
      it).
    """
    c = config
    update_metrics: tuple[str, ...] = (
        (*_UPDATE_METRICS, "ptx_loss") if c.ptx_coef else _UPDATE_METRICS
    )
    if c.policy_loss_fn is not None:  # your loss's metrics in place of the surrogate's clipping
        surrogate = ("clip_frac_low", "clip_frac_high")
        kept = tuple(k for k in update_metrics if k not in surrogate)
        update_metrics = kept + tuple(k for k in _user_metric_names(c) if k not in kept)
    fwd = c.forward
    shared = c.critic == "shared"
    controller = c.kl_controller()

    full_kl = c.kl_estimator == "full" and c.uses_reference
    g = c.group_size if c.share_prompt else 1  # rows per unit of the shuffles and splits

    def evaluate(actor_params, critic_params, tokens_ns, mask_ns, completion_mask_nt, packing):
        """(logp_nt, entropy_nt, values_nt) of the completion tokens, `[N, T]` each, and the
        actor's hidden states at the forward's scored positions (`Scored`)."""
        actor = merge(graphs.actor, actor_params)
        critic = merge(graphs.critic, critic_params)
        t = completion_mask_nt.shape[1]
        forward_kw = dict(group_size=g, packing=packing)
        scored = scored_hidden(actor, tokens_ns, mask_ns, t, **forward_kw)
        logp, ent = logprobs_from_hidden(
            scored.hidden,
            actor.lm_head_dv(),
            scored.targets,
            scored.from_rows(completion_mask_nt),
            forward=fwd,
            with_entropy=True,
            softcap=actor.config.final_logit_softcapping,
        )
        if shared:
            values = critic(scored.hidden)
        else:
            critic_hidden = scored_hidden(critic.backbone, tokens_ns, mask_ns, t, **forward_kw)
            values = critic.head(critic_hidden.hidden)
        rows = scored.to_rows
        return rows(logp), rows(ent), rows(values), scored.hidden

    def old_pass(state: PPOState, batch: PPOBatch):
        """(old logp, old values, exact KL to the reference or None), `[N, T]` each.

        Same forward as the update, over the same micro-batch row count, no gradient; with
        "full" the reference's forward runs beside it, one micro-batch at a time.
        """
        k = c.num_minibatches * c.num_microbatches
        unit = g if batch.packing is None else batch.packing.num_slots
        rows = _Rows(
            batch.tokens_ns,
            batch.mask_ns,
            batch.completion_mask_nt,
            None,
            None,
            None,
            None,
            batch.packing,
        )
        rows = rows.split(k, unit)
        actor_params = state.actor.params

        def one(xs):
            tokens, mask, cmask, packing = xs
            logp, _, values, hidden = evaluate(
                actor_params, state.critic.params, tokens, mask, cmask, packing
            )
            if not full_kl:
                return logp, values, None
            kl_nt = reference_kl(
                graphs.actor,
                actor_params,
                state.actor.ref_params,
                tokens,
                mask,
                cmask,
                forward=fwd,
                hidden_ntd=hidden,
                group_size=g,
                packing=packing,
            )
            return logp, values, kl_nt

        xs = (rows.tokens_ns, rows.mask_ns, rows.completion_mask_nt, rows.packing)
        logp, values, kl_nt = jax.lax.map(one, xs)
        return jax.lax.stop_gradient(merge_units((logp, values, kl_nt), unit))

    def loss_fn(params, xs, den, n_tokens, ptx_tokens):
        micro, ptx_micro = xs
        actor_params, critic_params = params
        logp, ent, values, _ = evaluate(
            actor_params,
            critic_params,
            micro.tokens_ns,
            micro.mask_ns,
            micro.completion_mask_nt,
            micro.packing,
        )
        mask = micro.completion_mask_nt
        user_m = None
        if c.policy_loss_fn is None:
            pg_nt, pg_m = policy_loss(
                logp, micro.old_logp_nt, micro.adv_nt, mask, clip_low=c.clip_low,
                clip_high=c.clip_high,
            )  # fmt: skip
        else:  # your loss, and its own diagnostics; the ratio's statistics where it has none
            pg_nt, user_m = c.policy_loss_fn(logp, micro.old_logp_nt, micro.adv_nt, mask, config=c)
            pg_m = dict(user_m)
            if not {"approx_kl_k3", "approx_kl_k1", "ratio_mean"} <= set(user_m):
                _, stats = policy_loss(logp, micro.old_logp_nt, micro.adv_nt, mask)
                pg_m = {**stats, **user_m}
            if pg_nt.ndim != 2:
                raise ValueError(
                    f"policy_loss {c.policy_loss!r} returned shape {pg_nt.shape}; the PPO step "
                    "takes one loss per token [N, T]"
                )
        if micro.weight_nt is not None:  # the rollout correction: constants, no gradient
            pg_nt = pg_nt * micro.weight_nt
        vf_nt, vf_m = value_loss_with_metrics(
            values, micro.old_values_nt, micro.returns_nt, mask, clip=c.value_clip
        )
        norm = norm_constant_for(c, mask.shape[1])
        agg = dict(mode=c.aggregation, norm_constant=norm, denominator=den)
        pg = aggregate(pg_nt, mask, **agg)
        vf = aggregate(vf_nt, mask, **agg)
        if c.entropy_coef:
            ent_term = aggregate(entropy_bonus(ent, mask, coef=c.entropy_coef), mask, **agg)
        else:
            ent_term = jnp.zeros((), jnp.float32)
        loss = pg + ent_term + c.vf_coef * vf
        # Token-mean metrics of this micro-batch, re-weighted to the mini-batch's token count
        # so that summing over micro-batches (combine_metrics) gives mini-batch means.
        share = jnp.sum(mask, dtype=jnp.float32) / jnp.maximum(n_tokens, 1.0)
        aux = {
            "loss": loss,
            "policy_loss": pg,
            "value_loss": vf,
            "entropy": masked_sum(jax.lax.stop_gradient(ent), mask) / jnp.maximum(n_tokens, 1.0),
            # the ratio's statistics, whatever the loss
            "approx_kl": pg_m["approx_kl_k3"] * share,
            "approx_kl_k1": pg_m["approx_kl_k1"] * share,
            "ratio_mean": pg_m["ratio_mean"] * share,
            "value_clip_frac": vf_m["value_clip_frac"] * share,
        }
        if user_m is None:  # the surrogate's clipping
            aux["clip_frac_low"] = pg_m["clip_frac_low"] * share
            aux["clip_frac_high"] = pg_m["clip_frac_high"] * share
        else:  # your loss's metrics (scalars over this micro-batch), as the GRPO step logs them
            user_f32 = {k: jnp.asarray(v, jnp.float32) for k, v in user_m.items()}
            aux.update(loss_metrics(user_f32, share))
        if ptx_micro is not None:
            term, aux["ptx_loss"] = ptx_micro_loss(
                actor_params, ptx_micro, graphdef=graphs.actor, config=c, num_tokens=ptx_tokens
            )
            loss = loss + term
            aux["loss"] = loss
        return loss, aux

    def apply(state: PPOState, grads, loss, warm):
        actor_g, critic_g = grads
        # One verdict for both models: a NaN anywhere skips the actor and the critic alike.
        finite = jnp.isfinite(loss) & tree_all_finite(grads)
        verdict = jnp.where(finite, loss, jnp.nan)
        critic, critic_m = apply_gradients(
            state.critic, critic_tx, critic_g, loss=verdict, schedule=critic_schedule
        )

        def keep_actor(_):
            return state.actor, jnp.zeros((), jnp.float32)

        def update_actor(_):
            new, m = apply_gradients(
                state.actor, actor_tx, actor_g, loss=verdict, schedule=actor_schedule
            )
            return new, m["lr"]

        if c.critic_warmup_steps:
            actor, lr = jax.lax.cond(warm, keep_actor, update_actor, None)
        else:  # static: no branch over the whole actor state when there is no warm-up
            actor, lr = update_actor(None)
        metrics = {
            "grad_norm": optax.tree.norm(actor_g).astype(jnp.float32),
            "critic_grad_norm": critic_m["grad_norm"],
            "lr": lr,
            "critic_lr": critic_m["lr"],
            "skipped": critic_m["skipped"],
        }
        return PPOState(actor=actor, critic=critic), metrics

    def update(state: PPOState, batch: PPOBatch) -> tuple[PPOState, dict[str, Array]]:
        if lora_dropout_rate(nnx.merge(graphs.actor, state.actor.params)) > 0:
            raise ValueError(
                "LoRA dropout > 0 is not supported by the PPO step (its actor's forwards take no "
                "dropout key); build the actor's adapters with dropout=0"
            )
        n = batch.completion_mask_nt.shape[0]
        ptx_minis = ptx_minibatches(batch.ptx, c)  # [M, K, n', S'] or None
        per_update = c.num_minibatches * c.num_microbatches
        packing = batch.packing
        if packing is not None:
            check_packing(packing, n, batch.completion_mask_nt.shape[1], per_update)
        elif n % c.num_minibatches or (n // c.num_minibatches) % c.num_microbatches:
            raise ValueError(
                f"N={n} rows must split into num_minibatches={c.num_minibatches} mini-batches "
                f"of num_microbatches={c.num_microbatches} equal micro-batches"
            )
        elif n % (g * per_update):
            raise ValueError(
                f"share_prompt=True splits whole groups: N={n} rows must divide into "
                f"group_size x num_minibatches x num_microbatches = {g * per_update}"
            )
        if full_kl and state.actor.ref_params is None and not is_lora(state.actor.params):
            raise ValueError(
                "kl_estimator='full' runs the reference inside the step: the actor's state "
                "must hold ref_params (create_ppo_state keeps them for kl_estimator='full')"
            )
        if c.rollout_correction_mode is not None and batch.sampler_logp_nt is None:
            raise ValueError(
                f"rollout_correction_mode={c.rollout_correction_mode!r} needs "
                "batch.sampler_logp_nt (the sampler's logprobs of the completion tokens)"
            )
        if c.uses_reference and not full_kl and batch.ref_logp_nt is None:
            raise ValueError(
                f"kl_estimator={c.kl_estimator!r} needs batch.ref_logp_nt (the reference's "
                f"logprobs of the completion tokens)"
            )
        # Per-row means are over the batch's N rows (with packing, not its empty slots).
        real_n = jnp.ones((n,), jnp.bool_)
        unit = g
        if packing is not None:
            # Every row field into slot order, bin by bin; empty slots are rows with no tokens.
            real_n = packing.to_slots(real_n)
            batch = jax.tree.map(packing.to_slots, batch._replace(ptx=None, packing=None))
            batch = batch._replace(packing=packing)
            unit = packing.num_slots

        def row_mean(x_n):
            return jnp.sum(jnp.where(real_n, x_n, 0.0)) / n

        mask = jnp.asarray(batch.completion_mask_nt, jnp.bool_)
        beta = state.actor.kl_state.beta

        old_logp, old_values, full_kl_nt = old_pass(state, batch)
        tg = ppo_targets(c, batch, old_logp, old_values, beta=beta, kl_nt=full_kl_nt)
        kl_nt, rewards_nt, adv_nt, returns_nt = tg.kl_nt, tg.rewards_nt, tg.adv_nt, tg.returns_nt
        if c.uses_reference:
            assert kl_nt is not None  # ppo_targets sets it whenever c.uses_reference
            kl_ref = row_mean(masked_sum(kl_nt, mask, axis=1))
            kl_state = controller.update(state.actor.kl_state, current_kl=kl_ref, n_steps=n)
        else:  # beta is 0 for good: no KL to measure or to control
            kl_state = state.actor.kl_state

        weight_nt: Array | None = None
        rc_metrics: dict[str, Array] = {}
        if c.rollout_correction_mode is not None:
            assert batch.sampler_logp_nt is not None  # checked above
            # The sampler's behaviour policy against this step's pi_old (`rollout_correction`).
            weight_nt, rc_metrics = rollout_correction(
                old_logp, batch.sampler_logp_nt, mask, **rollout_correction_args(c)
            )
        rows = _Rows(
            batch.tokens_ns,
            jnp.asarray(batch.mask_ns, jnp.bool_),
            mask,
            old_logp,
            old_values,
            adv_nt,
            returns_nt,
            batch.packing,
            weight_nt,
        )
        rng, shuffle_key = jax.random.split(state.actor.rng)
        warm = state.actor.step < c.critic_warmup_steps
        zero = jnp.zeros((), jnp.float32)

        def minibatch(carry: _Carry, xs):
            mb, ptx_micro = xs
            st, done = carry.state, carry.done
            ptx_tokens = None if ptx_micro is None else num_targets(ptx_micro)
            n_tokens = jnp.sum(mb.completion_mask_nt, dtype=jnp.float32)
            den = aggregate_parts(
                jnp.zeros(mb.completion_mask_nt.shape, jnp.float32),
                mb.completion_mask_nt,
                mode=c.aggregation,
                norm_constant=norm_constant_for(c, mb.completion_mask_nt.shape[1]),
            )[1]
            micro = mb.split(c.num_microbatches, unit)

            def run(_):
                # LoRA actor: differentiate its adapters only (the base is joined back frozen).
                actor_trainable, actor_frozen = trainable_split(st.actor.params)

                def micro_loss(p, m):
                    actor_params = join_trainable(p[0], actor_frozen)
                    return loss_fn((actor_params, p[1]), m, den, n_tokens, ptx_tokens)

                loss, grads, aux = accumulate_gradients(
                    micro_loss,
                    (actor_trainable, st.critic.params),
                    (micro, ptx_micro),
                    c.num_microbatches,
                )
                if c.target_kl is None:
                    stop = jnp.asarray(False)
                    new_st, upd = apply(st, grads, loss, warm)
                else:
                    # Checked before applying, as the update would move pi further away.
                    stop = aux["approx_kl"] > c.target_kl
                    new_st, upd = jax.lax.cond(
                        stop,
                        lambda _: (st, {k: zero for k in _APPLY_METRICS}),
                        lambda _: apply(st, grads, loss, warm),
                        None,
                    )
                metrics = {**{k: aux[k] for k in aux}, **upd}
                return new_st, stop, metrics

            def skip(_):
                metrics = {k: zero for k in (*update_metrics, "skipped")}
                return st, jnp.asarray(True), metrics

            if c.target_kl is None:  # static: nothing can stop, no branch needed
                new_st, stop, m = run(None)
            else:
                new_st, stop, m = jax.lax.cond(done, skip, run, None)
            w = (~done & ~stop).astype(jnp.float32)  # 1 where this update was applied
            carry = _Carry(
                state=new_st,
                done=done | stop,
                stop_epoch=jnp.where(~done & stop, carry.epoch, carry.stop_epoch),
                epoch=carry.epoch,
                sums={k: carry.sums[k] + w * m[k] for k in update_metrics},
                applied=carry.applied + w,
                skipped=carry.skipped + m["skipped"],
            )
            return carry, None

        def run_epoch(carry: _Carry, epoch):
            num_rows = rows.tokens_ns.shape[0]
            perm = unit_permutation(jax.random.fold_in(shuffle_key, epoch), num_rows, unit)
            minibatches = rows.permuted(perm).split(c.num_minibatches, unit)
            xs = (minibatches, ptx_minis)
            carry, _ = jax.lax.scan(minibatch, carry._replace(epoch=epoch), xs)
            return carry, None

        init = _Carry(
            state=state,
            done=jnp.asarray(False),
            stop_epoch=jnp.asarray(c.num_epochs, jnp.int32),
            epoch=jnp.zeros((), jnp.int32),
            sums={k: zero for k in update_metrics},
            applied=zero,
            skipped=zero,
        )
        carry, _ = jax.lax.scan(run_epoch, init, jnp.arange(c.num_epochs, dtype=jnp.int32))
        new_state, stop_epoch, sums = carry.state, carry.stop_epoch, carry.sums
        count, skipped = carry.applied, carry.skipped

        actor = dataclasses.replace(
            new_state.actor, step=state.actor.step + 1, rng=rng, kl_state=kl_state
        )
        critic = dataclasses.replace(new_state.critic, step=state.critic.step + 1)
        metrics = {k: sums[k] / jnp.maximum(count, 1.0) for k in update_metrics}
        if c.uses_reference:
            assert kl_nt is not None  # as above
            metrics.update(kl_ref=kl_ref, kl_ref_token=masked_mean(kl_nt, mask))
        metrics.update(
            beta=beta,
            beta_next=kl_state.beta,
            score_mean=row_mean(jnp.asarray(batch.scores_n, jnp.float32)),
            reward_mean=row_mean(masked_sum(rewards_nt, mask, axis=1)),
            values_mean=masked_mean(old_values, mask),
            returns_mean=masked_mean(returns_nt, mask),
            explained_variance=explained_variance(old_values, returns_nt, mask),
            early_stop_epoch=stop_epoch.astype(jnp.float32),
            updates=count - skipped,
            skipped=skipped,
            skipped_total=critic.skipped.astype(jnp.float32),
            critic_warmup=warm.astype(jnp.float32),
            **{f"rollout_{k}": v for k, v in rc_metrics.items()},
        )
        return PPOState(actor=actor, critic=critic), metrics

    return update


def make_ppo_step(
    config: PPOConfig,
    graphs: PPOGraphs,
    actor_tx: optax.GradientTransformation,
    critic_tx: optax.GradientTransformation,
    *,
    mesh: Mesh,
    state: PPOState,
    batch: PPOBatch,
    actor_schedule: optax.Schedule | None = None,
    critic_schedule: optax.Schedule | None = None,
    donate: bool = True,
):
    """The jit call site: `step(state, batch) -> (state, metrics)` on `mesh`.

    `state` and `batch` are examples fixing the shardings (the state by the decoder's
    logical-axis table, the batch's rows over data x fsdp); the state is donated.
    """
    fn = make_ppo_update(
        config,
        graphs,
        actor_tx,
        critic_tx,
        actor_schedule=actor_schedule,
        critic_schedule=critic_schedule,
    )
    return jit_step(
        fn,
        mesh=mesh,
        state_shardings=ppo_state_shardings(state, actor_tx, critic_tx, mesh),
        batch_shardings=batch_shardings(batch, mesh),
        donate=donate,
    )


__all__ = [
    "PPOBatch",
    "PPOGraphs",
    "PPOState",
    "PPOTargets",
    "batch_from_rollout",
    "create_ppo_state",
    "explained_variance",
    "init_critic",
    "make_ppo_step",
    "make_ppo_update",
    "ppo_batch_from_rows",
    "ppo_state_shardings",
    "ppo_targets",
    "reference_kl",
    "shard_ppo_state",
]
