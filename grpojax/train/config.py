"""Step configurations: the GRPO family as one frozen dataclass, plus SFT and reward model.

GRPO, Dr.GRPO, DAPO, GSPO and REINFORCE++ are the same step with different fields
(`GRPO_PRESETS`, `grpo_preset(name, **overrides)`); every field is validated in
`__post_init__` and an error names the field and its allowed values. The policy loss and
the advantage estimator are pluggable (`policy_loss`, `advantage_estimator`: a built-in name
or "package.module:function", see `grpojax.train.objectives`). `compute_advantages(rewards_n,
config)` turns rewards into advantages; the GRPO step calls it itself when its batch
carries rewards instead of advantages.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
from jax import Array

from grpojax.ops.aggregation import AGGREGATION_MODES
from grpojax.ops.checks import check_choice, check_int, check_number
from grpojax.ops.corrections import (
    ROLLOUT_LEVELS,
    ROLLOUT_MODES,
    _rollout_band,
    overlong_penalty,
)
from grpojax.ops.kl import (
    ESTIMATORS,
    KLController,
    adaptive_kl_controller,
    fixed_kl_controller,
)
from grpojax.ops.logprobs import DIVERGENCES
from grpojax.ops.losses import RATIO_LEVELS
from grpojax.ops.surrogates import DPPO_DIVERGENCES
from grpojax.train.common import ForwardConfig
from grpojax.train.objectives import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    SEQUENCE_LOSSES,
    TOKEN_ESTIMATORS,
    check_advantages,
    estimator_batch_inputs,
    estimator_inputs,
    resolve_advantage_estimator,
    resolve_policy_loss,
)

# The GRPO KL term: a per-token estimator, or the exact KL over the vocabulary.
KL_ESTIMATORS = (*ESTIMATORS, "full")
# The GRPO entropy bonus: aggregated with the loss, or the token mean (TRL's).
ENTROPY_AGGREGATIONS = ("loss", "token-mean")


# A config's user functions, resolved once per name (not stored on the frozen configs, whose
# fields stay their whole state: `Config(**other.__dict__)` and `dataclasses.replace` work).
@functools.cache
def _resolved_loss(spec: str) -> Callable:
    return resolve_policy_loss(spec)


@functools.cache
def _resolved_estimator(spec: str) -> Callable:
    return resolve_advantage_estimator(spec)


def rollout_correction_args(config) -> dict[str, Any]:
    """A GRPOConfig's or PPOConfig's rollout correction as `grpojax.ops.rollout_correction`
    takes it: mode, level, low, high (from `rollout_correction_mode`, `_level`, `_low`,
    `_high`)."""
    return dict(
        mode=config.rollout_correction_mode,
        level=config.rollout_correction_level,
        low=config.rollout_correction_low,
        high=config.rollout_correction_high,
    )


def check_rollout_correction(config) -> None:
    """A GRPOConfig's or PPOConfig's rollout correction fields (`rollout_correction_args`):
    a ValueError naming the field."""
    mode, level, low, high = rollout_correction_args(config).values()
    if mode is not None:
        check_choice("rollout_correction_mode", mode, ROLLOUT_MODES)
    check_choice("rollout_correction_level", level, ROLLOUT_LEVELS)
    check_number("rollout_correction_low", low, minimum=0.0, none_ok=True)
    check_number("rollout_correction_high", high, minimum=0.0, strict=True, none_ok=True)
    if mode == "icepop" and level != "token":
        raise ValueError(
            "rollout_correction_level must be 'token' with rollout_correction_mode="
            "'icepop' (IcePop masks tokens; for whole sequences use 'mask'), got "
            f"{level!r}"
        )
    if mode == "truncate" and low is not None:
        raise ValueError(
            "rollout_correction_low must be None with rollout_correction_mode='truncate' "
            f"(it caps weights from above only), got {low!r}"
        )
    if mode is not None:
        try:  # the op's defaults for the unset bound, then low <= high
            _rollout_band(level, mode, low, high)
        except ValueError as e:
            raise ValueError(
                f"rollout_correction_low must be <= rollout_correction_high (an unset one "
                f"takes gj.rollout_correction's default for mode {mode!r}: {e})"
            ) from None


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    """One GRPO-family update. Defaults are DeepSeekMath's GRPO.

    Loss (per token, then aggregated once with `aggregation`):

        loss_t = w_t * keep_i * pg_t  +  beta * kl_t  -  entropy_coef * H_t

    with pg_t the policy loss (`policy_loss`, default PPO's clipped surrogate
    `grpojax.ops.policy_loss`), w_t the rollout-correction weight against the sampler
    (`grpojax.ops.rollout_correction`; 1 when `rollout_correction_mode` is None) and keep_i
    DeepSeek-V3.2's off-policy sequence mask (1 when `off_policy_delta` is None). A policy
    loss with one value per sequence (GMPO) is averaged over the mini-batch's non-empty
    sequences instead, and the KL and entropy terms are aggregated with `aggregation`.
    With `ptx_coef` > 0 the update adds InstructGPT's PPO-ptx term, ptx_coef * (mean
    next-token NLL over the real target tokens of a separate batch of text, `GRPOBatch.ptx`).

    Attributes:
      aggregation: one of `AGGREGATION_MODES`.
      norm_constant: > 0, the constant of "seq-mean-token-sum-norm" (Dr.GRPO: the maximum
        completion length), or None (the default): the batch's completion width T, which
        in `grpojax train` is `rollout.max_new_tokens`. Read by that mode only.
      policy_loss: a key of `POLICY_LOSSES` ("ppo_clip", "cispo", "sapo", "gmpo", "dppo",
        "clip_cov", "kl_cov") or "package.module:function", a function
        `fn(logp_nt, old_logp_nt, advantages, mask_nt, *, config) -> (loss, metrics)`
        (`grpojax.train.objectives`), imported and checked here.
      clip_low, clip_high: >= 0, the ratio band [1 - clip_low, 1 + clip_high] (DAPO's
        clip-higher: clip_high > clip_low) of "ppo_clip" and "clip_cov"; CISPO's weight
        band; GMPO's log-ratio band [-clip_low, clip_high] (the paper: 0.4 and 0.4).
      dual_clip: None or c > 1, the dual-clip bound for negative advantages ("ppo_clip").
      ratio_level: "token" (PPO/GRPO) or "sequence" (GSPO) ("ppo_clip").
      sapo_tau_pos, sapo_tau_neg: > 0, SAPO's gate temperatures for A > 0 and A <= 0.
      dppo_divergence: DPPO's trust region, "tv" (Binary-TV) or "kl" (Binary-KL).
      dppo_delta: None (the paper's 0.15 for "tv", 0.05 for "kl") or >= 0, its radius.
      clip_cov_ratio: in [0, 1], the fraction of the mini-batch's real tokens Clip-Cov
        detaches.
      clip_cov_lb, clip_cov_ub: lb <= ub, the covariance band of Clip-Cov's candidates.
      kl_cov_ratio: in [0, 1], the fraction of the real tokens KL-Cov penalises.
      kl_cov_coef: >= 0, the weight of KL-Cov's penalty.
      beta: >= 0, the KL-to-reference coefficient; 0 skips the reference forward entirely.
      kl_estimator: one of `KL_ESTIMATORS`: a per-token estimator of `grpojax.ops.kl`
        from the sampled tokens' logprobs ("k1", "k2", "k3" (default, DeepSeekMath),
        "abs"), or "full", the exact KL(pi || pi_ref) over the vocabulary
        (`grpojax.ops.kl_from_hidden`): the reference's forward then runs inside every
        update for its hidden states (the state must hold `ref_params`).
      kl_divergence: with `kl_estimator="full"`, which exact divergence from the reference
        the beta term is (`grpojax.ops.divergence_from_hidden`): "reverse_kl" (default,
        KL(pi || pi_ref)), "forward_kl" (KL(pi_ref || pi)) or "jsd" (the generalised JSD
        with `kl_jsd_beta`); the other estimators are reverse-KL estimates only.
      kl_jsd_beta: in (0, 1), the JSD's mixture weight of the reference (0.5: symmetric).
      kl_is_corrected: use DeepSeek-V3.2's importance-weighted k3 (needs estimator "k3").
      reward_kl_coef: >= 0, REINFORCE++'s KL penalty in the reward instead of the loss:
        the estimator gets per-token rewards `-reward_kl_coef * KL_t`, KL_t =
        kl(old_logp_t, ref_logp_t) with `kl_estimator` (pi_old against the reference, a
        constant), added to the score on the last token before the reward-to-go. Needs an
        estimator that takes them ("reinforce_pp", "reinforce_pp_plain": `token_rewards_nt`
        in `batch_inputs`) and a per-token `kl_estimator` (not "full"); 0 (default): none.
        Independent of `beta` (the loss's KL; the "reinforce_pp_plain" preset sets beta 0).
      entropy_coef: entropy bonus coefficient (0 disables the entropy computation).
      pg_coef: >= 0, weight of the policy-gradient term pg_t in loss_t (1, the default: every
        RL algorithm; on-policy distillation's `distill.rl_coef`, 0 for distillation alone,
        where the beta term against a `Teacher` reference is the loss).
      router_aux_coef: >= 0, weight of a mixture of experts' load-balancing loss L_aux
        (`grpojax.models.moe`) in each update: coef * L_aux of every micro-batch's policy
        forward over its real tokens, averaged over the micro-batches, logged as
        `router_aux_loss`. 0 (the default, as in RL recipes): none. Unpacked rows only; with
        `share_prompt` a group's prompt tokens count once.
      entropy_aggregation: how the entropy bonus is reduced: "loss" (default: inside
        loss_t, aggregated with `aggregation` like the policy and KL terms, as verl does)
        or "token-mean" (the mean entropy over the update's real tokens whatever
        `aggregation` is, as TRL does; `grpojax.train.from_trl` sets it).
      ptx_coef: >= 0, weight of the pretraining (next-token) loss on the batch's `ptx` rows
        (PPO-ptx); 0 (default) leaves the step as it is, with no forward over ptx rows.
      off_policy_delta: None or >= 0, threshold of off-policy sequence masking.
      rollout_correction_mode: None (off), or "truncate" (TIS), "mask" (MIS) or "icepop":
        importance weights between the trainer's pi_old and the sampler's logprobs
        (`grpojax.ops.rollout_correction`; the batch must carry `sampler_logp_nt`).
      rollout_correction_level: "token" or "sequence" (a per-sequence loss needs "sequence").
      rollout_correction_low, rollout_correction_high: the band (None: the op's defaults;
        "truncate" caps at high, default 2, and takes no low).
      use_keep_mask: renormalise the policy over the sampler's kept set (the batch must
        carry `keep_count_nt`).
      num_epochs: mu, passes over the batch per step, >= 1.
      num_minibatches: optimizer updates per epoch, >= 1 (must divide N).
      num_microbatches: gradient-accumulation chunks per mini-batch, >= 1.
      shuffle: reshuffle rows every epoch (from the state's key).
      ref_refresh_every: None, or K >= 1: copy the policy into the reference every K steps
        (iterative GRPO, DeepSeekMath sec. 4.1.3).
      forward: chunking and temperature of the logprob computation.
      share_prompt: the batch's rows come in contiguous groups of `group_size` that share
        their prompt columns (the G samples of one prompt, as `Rollout.sequences()` and the
        driver lay them out): each prompt is run once per forward
        (`grpojax.models.shared_prefix_forward`), and rows are shuffled and split into
        mini/micro-batches by whole groups (N must divide into G x M x K). Same results up
        to float rounding; fewer FLOPs by about (G-1)/G of the prompt's share. Off for
        batches of unrelated rows.
      advantage_estimator: how `compute_advantages` turns rewards into advantages (inside
        the step when the batch carries rewards): a key of `ADVANTAGE_ESTIMATORS` ("grpo",
        "grpo_batch_std", "dr_grpo", "rloo", "reinforce_pp" (REINFORCE++-baseline),
        "reinforce_pp_plain" (REINFORCE++: no baseline), "pass_at_k", "opo", "gpg", "maxrl",
        "remax", "gdpo") or "package.module:function", a function
        `fn(rewards_n, *, group_size, mask_nt, lengths_n, valid_n, config) -> [N] or [N, T]`.
        "remax" needs the batch's `greedy_rewards_n`, "gdpo" its `rewards_nr`
        (`grpojax.train.objectives`).
      group_size, adv_eps, adv_std: G >= 2; eps >= 0 of the estimators that divide; the
        std "population" or "unbiased".
      pass_at_k: k of "pass_at_k", 1 <= k <= group_size.
      gpg_f_norm: > 0, GPG's F_norm.
      gdpo_weights: "gdpo"'s weight of each reward function (column of `rewards_nr`), a
        tuple of R finite numbers; None: all 1. `grpojax train` fills None with the reward
        manager's weights (`rewards.weights`).
      overlong_max_len, overlong_buffer, overlong_penalty: DAPO soft overlong punishment
        added to rewards in `compute_advantages` (disabled when overlong_max_len is None);
        `grpo_preset("dapo", max_new_tokens=T)` sets them from the completion budget.
      overlong_filter: DAPO's overlong filtering: completions that reached the budget
        without their own EOS (or stop string) are left out of the loss
        (`grpojax.ops.truncated_completion_mask`), after the group statistics that include
        their rewards; the batch must carry `eos_found_n`.
    """

    aggregation: str = "seq-mean-token-mean"
    norm_constant: float | None = None
    policy_loss: str = "ppo_clip"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    ratio_level: str = "token"
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    dppo_divergence: str = "tv"
    dppo_delta: float | None = None
    clip_cov_ratio: float = 2e-4
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 2e-3
    kl_cov_coef: float = 1.0
    beta: float = 0.04
    kl_estimator: str = "k3"
    kl_divergence: str = "reverse_kl"
    kl_jsd_beta: float = 0.5
    kl_is_corrected: bool = False
    reward_kl_coef: float = 0.0
    entropy_coef: float = 0.0
    pg_coef: float = 1.0
    router_aux_coef: float = 0.0
    entropy_aggregation: str = "loss"
    ptx_coef: float = 0.0
    off_policy_delta: float | None = None
    rollout_correction_mode: str | None = None
    rollout_correction_level: str = "token"
    rollout_correction_low: float | None = None
    rollout_correction_high: float | None = None
    use_keep_mask: bool = False
    num_epochs: int = 1
    num_minibatches: int = 1
    num_microbatches: int = 1
    shuffle: bool = True
    ref_refresh_every: int | None = None
    forward: ForwardConfig = dataclasses.field(default_factory=ForwardConfig)
    share_prompt: bool = False
    advantage_estimator: str = "grpo"
    group_size: int = 8
    adv_eps: float = 1e-6
    adv_std: str = "population"
    pass_at_k: int = 1
    gpg_f_norm: float = 1.0
    gdpo_weights: tuple[float, ...] | None = None
    overlong_max_len: int | None = None
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    overlong_filter: bool = False

    def __post_init__(self):
        check_choice("aggregation", self.aggregation, AGGREGATION_MODES)
        check_number("norm_constant", self.norm_constant, minimum=0.0, strict=True, none_ok=True)
        _ = self.policy_loss_fn  # resolved (and checked) once, kept
        check_number("clip_low", self.clip_low, minimum=0.0)
        check_number("clip_high", self.clip_high, minimum=0.0)
        check_number("dual_clip", self.dual_clip, minimum=1.0, strict=True, none_ok=True)
        check_choice("ratio_level", self.ratio_level, RATIO_LEVELS)
        check_number("sapo_tau_pos", self.sapo_tau_pos, minimum=0.0, strict=True)
        check_number("sapo_tau_neg", self.sapo_tau_neg, minimum=0.0, strict=True)
        check_choice("dppo_divergence", self.dppo_divergence, DPPO_DIVERGENCES)
        check_number("dppo_delta", self.dppo_delta, minimum=0.0, none_ok=True)
        check_number("clip_cov_ratio", self.clip_cov_ratio, minimum=0.0, maximum=1.0)
        check_number("clip_cov_lb", self.clip_cov_lb)
        check_number("clip_cov_ub", self.clip_cov_ub)
        if self.clip_cov_lb > self.clip_cov_ub:
            raise ValueError(
                f"clip_cov_ub must be >= clip_cov_lb ({self.clip_cov_lb}), got {self.clip_cov_ub}"
            )
        check_number("kl_cov_ratio", self.kl_cov_ratio, minimum=0.0, maximum=1.0)
        check_number("kl_cov_coef", self.kl_cov_coef, minimum=0.0)
        check_number("beta", self.beta, minimum=0.0)
        check_choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        check_choice("kl_divergence", self.kl_divergence, DIVERGENCES)
        if self.kl_divergence != "reverse_kl" and self.kl_estimator != "full":
            raise ValueError(
                f"kl_divergence={self.kl_divergence!r} is computed exactly over the vocabulary: "
                f"kl_estimator must be 'full', got {self.kl_estimator!r}"
            )
        check_number(
            "kl_jsd_beta", self.kl_jsd_beta, minimum=0.0, maximum=1.0, strict=True,
            strict_max=True,
        )  # fmt: skip
        if self.kl_is_corrected and self.kl_estimator != "k3":
            raise ValueError(
                f"kl_is_corrected=True is the importance-weighted k3; kl_estimator must be "
                f"'k3', got {self.kl_estimator!r}"
            )
        check_number("reward_kl_coef", self.reward_kl_coef, minimum=0.0, array_ok=False)
        check_number("entropy_coef", self.entropy_coef)
        check_number("router_aux_coef", self.router_aux_coef, minimum=0.0, array_ok=False)
        check_number("pg_coef", self.pg_coef, minimum=0.0, array_ok=False)
        check_choice("entropy_aggregation", self.entropy_aggregation, ENTROPY_AGGREGATIONS)
        check_number("ptx_coef", self.ptx_coef, minimum=0.0, array_ok=False)
        check_number("off_policy_delta", self.off_policy_delta, minimum=0.0, none_ok=True)
        check_rollout_correction(self)
        check_int("num_epochs", self.num_epochs)
        check_int("num_minibatches", self.num_minibatches)
        check_int("num_microbatches", self.num_microbatches)
        if self.ref_refresh_every is not None:
            check_int("ref_refresh_every", self.ref_refresh_every)
        if not isinstance(self.forward, ForwardConfig):
            raise ValueError(f"forward must be a ForwardConfig, got {type(self.forward).__name__}")
        if not isinstance(self.share_prompt, bool):
            raise ValueError(f"share_prompt must be True or False, got {self.share_prompt!r}")
        estimator = self.advantage_estimator_fn
        if self.reward_kl_coef > 0:
            if "token_rewards_nt" not in estimator_batch_inputs(estimator):
                raise ValueError(
                    f"reward_kl_coef > 0 puts the KL in per-token rewards: advantage_estimator "
                    f"must take them (token_rewards_nt in its batch_inputs: 'reinforce_pp', "
                    f"'reinforce_pp_plain'), got {self.advantage_estimator!r}"
                )
            if self.kl_estimator == "full":
                raise ValueError(
                    "kl_estimator must be a per-token estimator ('k1', 'k2', 'k3', 'abs') with "
                    "reward_kl_coef > 0 (the reward's KL is of pi_old's sampled tokens), got "
                    "'full'"
                )
        check_int("group_size", self.group_size, minimum=2)
        check_number("adv_eps", self.adv_eps, minimum=0.0)
        check_choice("adv_std", self.adv_std, ("population", "unbiased"))
        check_int("pass_at_k", self.pass_at_k, minimum=1)
        if self.advantage_estimator == "pass_at_k" and self.pass_at_k > self.group_size:
            raise ValueError(
                f"pass_at_k must be <= group_size ({self.group_size}), got {self.pass_at_k}"
            )
        check_number("gpg_f_norm", self.gpg_f_norm, minimum=0.0, strict=True)
        if self.gdpo_weights is not None:
            try:
                weights = tuple(float(w) for w in self.gdpo_weights)
            except (TypeError, ValueError):
                weights = None
            if not weights or not all(math.isfinite(w) for w in weights):
                raise ValueError(
                    f"gdpo_weights must be None or a non-empty tuple of finite numbers, got "
                    f"{self.gdpo_weights!r}"
                )
            object.__setattr__(self, "gdpo_weights", weights)
        if self.advantage_estimator == "gdpo" and self.overlong_max_len is not None:
            # GDPO reads the per-function rewards only; the penalty would be dropped silently.
            raise ValueError(
                "advantage_estimator='gdpo' normalises the per-function rewards (rewards_nr) "
                "and ignores rewards_n, so DAPO's overlong penalty would not reach it: set "
                "overlong_max_len=None"
            )
        if self.overlong_max_len is not None:
            check_int("overlong_max_len", self.overlong_max_len)
            check_int("overlong_buffer", self.overlong_buffer, minimum=0)
            if self.overlong_buffer > self.overlong_max_len:
                raise ValueError(
                    f"overlong_buffer must be <= overlong_max_len ({self.overlong_max_len}), "
                    f"got {self.overlong_buffer}"
                )
            check_number("overlong_penalty", self.overlong_penalty, minimum=0.0)
        if not isinstance(self.overlong_filter, bool):
            raise ValueError(f"overlong_filter must be True or False, got {self.overlong_filter!r}")
        if self.policy_loss in SEQUENCE_LOSSES:
            if self.advantage_estimator in TOKEN_ESTIMATORS:
                raise ValueError(
                    f"advantage_estimator={self.advantage_estimator!r} gives token advantages "
                    f"[N, T]; policy_loss={self.policy_loss!r} needs one advantage per "
                    "sequence [N]"
                )
            weighs_tokens = self.rollout_correction_level == "token"
            if self.rollout_correction_mode is not None and weighs_tokens:
                raise ValueError(
                    f"rollout_correction_level must be 'sequence' with "
                    f"policy_loss={self.policy_loss!r} (one loss per sequence), got 'token'"
                )

    @property
    def policy_loss_fn(self) -> Callable:
        """The function `policy_loss` names (`grpojax.train.objectives.resolve_policy_loss`),
        resolved when the config is built and kept by name."""
        return _resolved_loss(self.policy_loss)

    @property
    def advantage_estimator_fn(self) -> Callable:
        """The function `advantage_estimator` names
        (`grpojax.train.objectives.resolve_advantage_estimator`), resolved when the config
        is built and kept by name."""
        return _resolved_estimator(self.advantage_estimator)

    @property
    def uses_reference(self) -> bool:
        """Whether the step computes a KL to the reference (beta > 0 in the loss, or
        reward_kl_coef > 0 in the rewards)."""
        return self.beta > 0 or self.reward_kl_coef > 0

    @property
    def uses_sampler_logp(self) -> bool:
        """Whether the step needs the sampler's logprobs (`GRPOBatch.sampler_logp_nt`)."""
        return self.rollout_correction_mode is not None or self.off_policy_delta is not None


# The family as data. Sources: DeepSeekMath (GRPO), Liu et al. 2025 (Dr.GRPO), Yu et al.
# 2025 (DAPO), Zheng et al. 2025 (GSPO).
GRPO_PRESETS: dict[str, GRPOConfig] = {
    "grpo": GRPOConfig(),
    # norm_constant None: the batch's completion width T, its maximum completion length.
    "dr_grpo": GRPOConfig(
        aggregation="seq-mean-token-sum-norm",
        advantage_estimator="dr_grpo",
        beta=0.0,
    ),
    # The overlong punishment's lengths come from the completion budget (`grpo_preset`).
    "dapo": GRPOConfig(
        aggregation="token-mean",
        clip_low=0.2,
        clip_high=0.28,
        beta=0.0,
    ),
    "gspo": GRPOConfig(
        ratio_level="sequence",
        clip_low=3e-4,
        clip_high=4e-4,
        aggregation="seq-mean-token-mean",
        beta=0.0,
    ),
    # REINFORCE++ (Hu et al. 2025): no group baseline; the KL to the reference is a per-token
    # penalty in the reward (k1 = log pi_old / pi_ref, the paper's), not a loss term.
    "reinforce_pp_plain": GRPOConfig(
        advantage_estimator="reinforce_pp_plain",
        beta=0.0,
        reward_kl_coef=0.01,
        kl_estimator="k1",
    ),
    # On-policy distillation (the driver's `algo: distill`): the loss is the exact divergence
    # from a `Teacher` reference over the whole vocabulary, the policy-gradient term weighed
    # by `distill.rl_coef` (0: none).
    "distill": GRPOConfig(beta=1.0, kl_estimator="full", pg_coef=0.0),
}


def budget_fields(name: str, max_new_tokens: int) -> dict[str, Any]:
    """The fields of preset `name` that follow the completion budget T = `max_new_tokens`:
    DAPO's soft overlong punishment over its last fifth, L_max = T and L_cache = T // 5
    (the paper: 20,480 and 4,096). Dr.GRPO's norm_constant needs none: None is T."""
    check_int("max_new_tokens", max_new_tokens)
    if name == "dapo":
        return {"overlong_max_len": max_new_tokens, "overlong_buffer": max_new_tokens // 5}
    return {}


def grpo_preset(name: str, *, max_new_tokens: int | None = None, **overrides) -> GRPOConfig:
    """A named preset of `GRPO_PRESETS`, with fields replaced by `overrides`.

    `max_new_tokens` (T, the completion budget) fills the fields that follow it
    (`budget_fields`); "dapo" needs it unless `overrides` set `overlong_max_len` (None: no
    overlong punishment)."""
    if name not in GRPO_PRESETS:
        raise ValueError(f"unknown GRPO preset {name!r}; allowed: {tuple(GRPO_PRESETS)}")
    fields = {}
    if max_new_tokens is not None:
        fields = budget_fields(name, max_new_tokens)
    elif name == "dapo" and "overlong_max_len" not in overrides:
        raise ValueError(
            "grpo_preset('dapo') needs max_new_tokens (the completion budget T: the overlong "
            "punishment runs over its last fifth), or overlong_max_len=None to leave it out"
        )
    return dataclasses.replace(GRPO_PRESETS[name], **{**fields, **overrides})


def norm_constant_for(config, completion_width: int) -> float:
    """`config.norm_constant`, or the completion width T when it is None."""
    return float(completion_width) if config.norm_constant is None else config.norm_constant


def compute_advantages(
    rewards_n: Array,
    config: GRPOConfig,
    *,
    mask_nt: Array | None = None,
    lengths_n: Array | None = None,
    valid_n: Array | None = None,
    greedy_rewards_n: Array | None = None,
    rewards_nr: Array | None = None,
    token_rewards_nt: Array | None = None,
) -> Array:
    """Advantages from rewards for the configured estimator, one call for the driver.

    Rows are grouped contiguously (`N = B*G`, G = `config.group_size`). The built-ins
    (`ADVANTAGE_ESTIMATORS`):

        grpo:           (r - mean_g) / (std_g + eps)                 `[N]`
        grpo_batch_std: (r - mean_g) / (std_batch + eps)             `[N]`
        dr_grpo:         r - mean_g                                  `[N]`
        rloo:            r - mean of the other G-1                   `[N]`
        reinforce_pp:   group-mean baseline, reward-to-go, global whitening   `[N, T]`
        reinforce_pp_plain: reward-to-go of the score (and token_rewards_nt),
                        global whitening; no baseline (REINFORCE++)  `[N, T]`
        pass_at_k:      Pass@k Training's closed form, k = config.pass_at_k   `[N]`
        opo:             r - length-weighted group mean              `[N]`
        gpg:            alpha (r - mean_g) / config.gpg_f_norm       `[N]`
        maxrl:          (r - mean_g) / (mean_g + eps)                `[N]`
        remax:           r - r_greedy (greedy_rewards_n)             `[N]`
        gdpo:           per-function group normalisation of rewards_nr, weighted sum
                        (gdpo_weights), batch normalisation          `[N]`

    or the function "package.module:function" names (`grpojax.train.objectives`). With
    `config.overlong_max_len` set, DAPO's soft overlong penalty of `lengths_n` is added to
    the rewards first.

    Args:
      rewards_n: `[N]` sequence rewards.
      config: the step's `GRPOConfig`.
      mask_nt: `[N, T]` completion mask, required by "reinforce_pp".
      lengths_n: `[N]` completion lengths, required by the overlong penalty ("opo" takes
        the mask's row sums without them).
      valid_n: optional `[N]` bool, samples to leave out of the statistics (advantage 0).
      greedy_rewards_n: `[N]` reward of each row's prompt's greedy completion, required by
        "remax" (and estimators declaring it in `fn.batch_inputs`).
      rewards_nr: `[N, R]` rewards before weighting, one column per reward function,
        required by "gdpo" (idem).
      token_rewards_nt: `[N, T]` per-token rewards added to the score, for the estimators
        taking them ("reinforce_pp", "reinforce_pp_plain"; optional): REINFORCE++'s KL
        penalty `-reward_kl_coef * KL_t`, which the GRPO step computes when
        `config.reward_kl_coef` > 0.

    Returns:
      `[N]` or `[N, T]` float32 advantages.

    Raises:
      ValueError: naming the field, when the estimator declares an input that is None.
    """
    rewards = jnp.asarray(rewards_n, jnp.float32)
    if config.overlong_max_len is not None:
        if lengths_n is None:
            raise ValueError("overlong_max_len is set: compute_advantages needs lengths_n")
        rewards = rewards + overlong_penalty(
            lengths_n,
            max_len=config.overlong_max_len,
            buffer_len=config.overlong_buffer,
            penalty=config.overlong_penalty,
        )
    estimator = config.advantage_estimator_fn
    extra = estimator_inputs(
        estimator,
        config.advantage_estimator,
        {
            "greedy_rewards_n": greedy_rewards_n,
            "rewards_nr": rewards_nr,
            "token_rewards_nt": token_rewards_nt,
        },
    )
    adv = estimator(
        rewards,
        group_size=config.group_size,
        mask_nt=mask_nt,
        lengths_n=lengths_n,
        valid_n=valid_n,
        config=config,
        **extra,
    )
    t = None if mask_nt is None else jnp.shape(mask_nt)[-1]
    return check_advantages(adv, rewards.shape[0], t, config.advantage_estimator)


CRITIC_MODES = ("separate", "shared")


@dataclasses.dataclass(frozen=True)
class PPOConfig:
    """Static hyperparameters of the PPO step.

    Attributes:
      critic: "separate" (a `ValueModel` with its own backbone and optimizer) or "shared"
        (a value head on the actor's backbone).
      gamma, lam: GAE discount and lambda, in [0, 1].
      kl_coef: initial KL coefficient beta of the reward penalty, >= 0. 0: no reference
        (`uses_reference`): the step reads no `ref_logp_nt` and reports no `kl_ref`, and
        the driver keeps no reference copy and runs no reference forward.
      kl_target: None for a fixed beta; else the target per-sequence KL of Ziegler et al.'s
        adaptive controller (> 0; needs kl_coef > 0, as the controller scales beta
        multiplicatively).
      kl_horizon: > 0, the adaptive controller's horizon in samples (read with kl_target).
      kl_estimator: per-token KL in the reward penalty, one of `KL_ESTIMATORS`: "k1"
        (default), "k2", "k3", "abs" (`grpojax.ops.kl`, from the sampled tokens' logprobs
        under the old policy and the reference, `PPOBatch.ref_logp_nt`), or "full", the exact
        KL(pi_old || pi_ref) summed over the vocabulary (`grpojax.ops.kl_from_hidden`): the
        reference then runs inside the step for its hidden states (the actor's state holds
        `ref_params`, or its LoRA base is the reference) and the batch needs no ref_logp_nt.
      whiten_advantages: whiten the GAE advantages over the batch's real tokens.
      clip_low, clip_high: policy ratio band [1 - clip_low, 1 + clip_high], >= 0.
      value_clip: clip range of the value loss around the old values (>= 0), or None.
      vf_coef: weight of the value loss, >= 0.
      entropy_coef: weight of the entropy bonus (0 disables it; the entropy is still reported).
      ptx_coef: >= 0, weight of the pretraining (next-token) loss on the batch's `ptx` rows
        (InstructGPT's PPO-ptx gamma); 0 (default) leaves the step as it is.
      num_epochs: passes over the batch per step, >= 1.
      num_minibatches: mini-batches per epoch (an optimizer update each); divides N.
      num_microbatches: gradient-accumulation micro-batches per mini-batch; divides N /
        num_minibatches. The recomputation of old logprobs/values uses the same row count.
      target_kl: early stop when a mini-batch's approximate KL(pi_old || pi) (k3 estimate)
        exceeds it (> 0), or None.
      critic_warmup_steps: the first this many step calls update only the critic, >= 0.
      aggregation: one of `AGGREGATION_MODES`, for all three loss terms.
      norm_constant: for "seq-mean-token-sum-norm", > 0, or None (the default): the batch's
        completion width T (as `GRPOConfig.norm_constant`).
      forward: chunk sizes and temperature of the log-probability computation.
      share_prompt, group_size: as `GRPOConfig.share_prompt`: the rows come in contiguous
        groups of `group_size` (>= 1) sharing their prompt columns, and every forward of
        the step (actor, separate critic, the "full" KL's reference) runs each prompt
        once; rows are shuffled and split by whole groups (N must divide into
        group_size x M x K). Same results up to float rounding; mini-batches then hold
        whole groups.
      rollout_correction_mode: as `GRPOConfig`'s: importance weights between the step's
        pi_old (its own recompute) and the sampler's logprobs (`PPOBatch.sampler_logp_nt`,
        required when the mode is set), multiplied into the per-token policy loss; for an
        engine whose logprobs are not the trainer's (vLLM). None: off.
      rollout_correction_level: "token" or "sequence", as `GRPOConfig`'s.
      rollout_correction_low, rollout_correction_high: the band, as `GRPOConfig`'s.
      policy_loss: "ppo_clip" (the clipped surrogate, `grpojax.ops.policy_loss` with
        `clip_low` / `clip_high`), or your own "package.module:function" with the GRPO
        step's contract (`grpojax.train.objectives`): `fn(logp_nt, old_logp_nt, adv_nt,
        mask_nt, *, config) -> (loss_nt [N, T], metrics)`, given GAE's per-token
        advantages and this `PPOConfig`. A per-sequence loss `[N]` is refused. Its own
        metrics are not logged; the step's clip fractions and KL estimates stay those of
        the clipped surrogate's band on the same ratios.
    """

    critic: str = "separate"
    gamma: float = 1.0
    lam: float = 0.95
    kl_coef: float = 0.05
    kl_target: float | None = None
    kl_horizon: float = 10000.0
    kl_estimator: str = "k1"
    whiten_advantages: bool = True
    clip_low: float = 0.2
    clip_high: float = 0.2
    value_clip: float | None = 0.2
    vf_coef: float = 0.1
    entropy_coef: float = 0.0
    ptx_coef: float = 0.0
    num_epochs: int = 4
    num_minibatches: int = 1
    num_microbatches: int = 1
    target_kl: float | None = None
    critic_warmup_steps: int = 0
    aggregation: str = "token-mean"
    norm_constant: float | None = None
    forward: ForwardConfig = dataclasses.field(default_factory=ForwardConfig)
    share_prompt: bool = False
    group_size: int = 1
    rollout_correction_mode: str | None = None
    rollout_correction_level: str = "token"
    rollout_correction_low: float | None = None
    rollout_correction_high: float | None = None
    policy_loss: str = "ppo_clip"

    def __post_init__(self):
        check_choice("critic", self.critic, CRITIC_MODES)
        for name in ("gamma", "lam"):
            check_number(name, getattr(self, name), minimum=0.0, maximum=1.0)
        for name in ("kl_coef", "clip_low", "clip_high", "vf_coef"):
            check_number(name, getattr(self, name), minimum=0.0)
        for name in ("kl_target", "target_kl"):
            check_number(name, getattr(self, name), minimum=0.0, strict=True, none_ok=True)
        check_number("kl_horizon", self.kl_horizon, minimum=0.0, strict=True)
        if self.kl_target is not None and float(self.kl_coef) == 0:
            raise ValueError(
                "kl_target (adaptive KL controller) needs kl_coef > 0: the controller scales "
                "beta multiplicatively, so from kl_coef=0 it stays 0"
            )
        check_choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        check_number("value_clip", self.value_clip, minimum=0.0, none_ok=True)
        check_number("entropy_coef", self.entropy_coef)
        check_number("ptx_coef", self.ptx_coef, minimum=0.0, array_ok=False)
        for name in ("num_epochs", "num_minibatches", "num_microbatches"):
            check_int(name, getattr(self, name))
        check_int("critic_warmup_steps", self.critic_warmup_steps, minimum=0)
        if not isinstance(self.share_prompt, bool):
            raise ValueError(f"share_prompt must be True or False, got {self.share_prompt!r}")
        check_int("group_size", self.group_size)
        check_choice("aggregation", self.aggregation, AGGREGATION_MODES)
        check_number("norm_constant", self.norm_constant, minimum=0.0, strict=True, none_ok=True)
        if not isinstance(self.forward, ForwardConfig):
            raise ValueError(f"forward must be a ForwardConfig, got {type(self.forward).__name__}")
        check_rollout_correction(self)
        if self.policy_loss != "ppo_clip" and ":" not in str(self.policy_loss):
            raise ValueError(
                f"policy_loss must be 'ppo_clip' or 'package.module:function' (the GRPO "
                f"family's other built-ins read GRPOConfig's fields), got {self.policy_loss!r}"
            )
        _ = self.policy_loss_fn  # resolved (and checked) once, kept

    @property
    def policy_loss_fn(self) -> Callable | None:
        """Your policy loss (`policy_loss`'s path, resolved when the config is built; kept
        by path, so the config's fields stay its whole state), or None for the built-in
        clipped surrogate."""
        return None if self.policy_loss == "ppo_clip" else _resolved_loss(self.policy_loss)

    @property
    def uses_reference(self) -> bool:
        """Whether the rewards carry a KL penalty to the reference: kl_coef > 0 (at 0 the
        fixed beta is 0 for good, and `kl_target` is refused)."""
        return float(self.kl_coef) > 0

    def kl_controller(self) -> KLController:
        """The fixed (`kl_target=None`) or adaptive KL coefficient controller."""
        if self.kl_target is None:
            return fixed_kl_controller(self.kl_coef)
        return adaptive_kl_controller(self.kl_coef, target=self.kl_target, horizon=self.kl_horizon)


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """Supervised fine-tuning on demonstrations (next-token cross-entropy, token-mean).

    Attributes:
      num_microbatches: gradient-accumulation chunks, >= 1.
      forward: chunking of the log-softmax (temperature must stay 1 for SFT).
    """

    num_microbatches: int = 1
    forward: ForwardConfig = dataclasses.field(default_factory=ForwardConfig)

    def __post_init__(self):
        check_int("num_microbatches", self.num_microbatches)
        if not isinstance(self.forward, ForwardConfig):
            raise ValueError(f"forward must be a ForwardConfig, got {type(self.forward).__name__}")
        if self.forward.temperature != 1.0:
            raise ValueError(
                f"SFT trains the model's own distribution: forward.temperature must be 1.0, "
                f"got {self.forward.temperature}"
            )


@dataclasses.dataclass(frozen=True)
class RewardModelConfig:
    """Bradley-Terry reward-model training on (chosen, rejected) pairs.

    Attributes:
      num_microbatches: gradient-accumulation chunks, >= 1.
      center_coef: >= 0, optional centring penalty coef * mean((r_c + r_r)^2) that keeps
        rewards near 0 (0 disables).
    """

    num_microbatches: int = 1
    center_coef: float = 0.0

    def __post_init__(self):
        check_int("num_microbatches", self.num_microbatches)
        check_number("center_coef", self.center_coef, minimum=0.0)


__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "CRITIC_MODES",
    "ENTROPY_AGGREGATIONS",
    "GRPO_PRESETS",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "GRPOConfig",
    "PPOConfig",
    "RewardModelConfig",
    "SFTConfig",
    "budget_fields",
    "compute_advantages",
    "grpo_preset",
    "norm_constant_for",
]
