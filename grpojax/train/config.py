"""Step configurations: the GRPO family as one frozen dataclass, plus SFT and reward model.

GRPO, Dr.GRPO, DAPO and GSPO are the same step with different fields (`GRPO_PRESETS`,
`grpo_preset(name, **overrides)`); every field is validated in `__post_init__` and an
error names the field and its allowed values. Advantages are computed outside the step,
from rewards, by `compute_advantages(rewards_n, config)`.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
from jax import Array

from grpojax.ops.advantages import (
    group_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)
from grpojax.ops.aggregation import AGGREGATION_MODES
from grpojax.ops.corrections import overlong_penalty
from grpojax.ops.kl import ESTIMATORS
from grpojax.ops.losses import RATIO_LEVELS
from grpojax.train.common import ForwardConfig

ADVANTAGE_ESTIMATORS = ("grpo", "grpo_batch_std", "dr_grpo", "rloo", "reinforce_pp")


def _positive_int(name: str, value, *, minimum: int = 1) -> None:
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= minimum):
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _number(name: str, value, *, minimum: float, strict: bool, none_ok: bool = False) -> None:
    if value is None and none_ok:
        return
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    ok = ok and math.isfinite(value) and (value > minimum if strict else value >= minimum)
    if not ok:
        rel = ">" if strict else ">="
        prefix = "None or " if none_ok else ""
        raise ValueError(f"{name} must be {prefix}a finite number {rel} {minimum:g}, got {value!r}")


def _choice(name: str, value, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    """One GRPO-family update. Defaults are DeepSeekMath's GRPO.

    Loss (per token, then aggregated once with `aggregation`):

        loss_t = w_t * keep_i * pg_t  +  beta * kl_t  -  entropy_coef * H_t

    with pg_t the clipped surrogate (`grpojax.ops.losses.policy_loss`), w_t the truncated
    IS weight against the sampler (1 when `tis_cap` is None) and keep_i DeepSeek-V3.2's
    off-policy sequence mask (1 when `off_policy_delta` is None).

    Attributes:
      aggregation: one of `AGGREGATION_MODES`.
      norm_constant: > 0, the constant of "seq-mean-token-sum-norm" (Dr.GRPO: the maximum
        completion length); required by that mode only.
      clip_low, clip_high: >= 0, the ratio band [1 - clip_low, 1 + clip_high] (DAPO's
        clip-higher: clip_high > clip_low).
      dual_clip: None or c > 1, the dual-clip bound for negative advantages.
      ratio_level: "token" (PPO/GRPO) or "sequence" (GSPO).
      beta: >= 0, the KL-to-reference coefficient; 0 skips the reference forward entirely.
      kl_estimator: one of `grpojax.ops.kl.ESTIMATORS` (default "k3", DeepSeekMath).
      kl_is_corrected: use DeepSeek-V3.2's importance-weighted k3 (needs estimator "k3").
      entropy_coef: entropy bonus coefficient (0 disables the entropy computation).
      off_policy_delta: None or >= 0, threshold of off-policy sequence masking.
      tis_cap: None or > 0, truncated importance sampling cap against the sampler's
        logprobs (the batch must carry `sampler_logp_nt`).
      use_keep_mask: renormalise the policy over the sampler's kept set (the batch must
        carry `keep_threshold_nt`).
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
      advantage_estimator, group_size, adv_eps, adv_std: how `compute_advantages` turns
        rewards into advantages (outside the step). One of `ADVANTAGE_ESTIMATORS`;
        group_size G >= 2; adv_std "population" or "unbiased".
      overlong_max_len, overlong_buffer, overlong_penalty: DAPO soft overlong punishment
        added to rewards in `compute_advantages` (disabled when overlong_max_len is None).
    """

    aggregation: str = "seq-mean-token-mean"
    norm_constant: float | None = None
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    ratio_level: str = "token"
    beta: float = 0.04
    kl_estimator: str = "k3"
    kl_is_corrected: bool = False
    entropy_coef: float = 0.0
    off_policy_delta: float | None = None
    tis_cap: float | None = None
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
    overlong_max_len: int | None = None
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0

    def __post_init__(self):
        _choice("aggregation", self.aggregation, AGGREGATION_MODES)
        if self.aggregation == "seq-mean-token-sum-norm":
            _number("norm_constant", self.norm_constant, minimum=0.0, strict=True)
        _number("clip_low", self.clip_low, minimum=0.0, strict=False)
        _number("clip_high", self.clip_high, minimum=0.0, strict=False)
        _number("dual_clip", self.dual_clip, minimum=1.0, strict=True, none_ok=True)
        _choice("ratio_level", self.ratio_level, RATIO_LEVELS)
        _number("beta", self.beta, minimum=0.0, strict=False)
        _choice("kl_estimator", self.kl_estimator, ESTIMATORS)
        if self.kl_is_corrected and self.kl_estimator != "k3":
            raise ValueError(
                f"kl_is_corrected=True is the importance-weighted k3; kl_estimator must be "
                f"'k3', got {self.kl_estimator!r}"
            )
        _number("entropy_coef", self.entropy_coef, minimum=-math.inf, strict=True)
        _number("off_policy_delta", self.off_policy_delta, minimum=0.0, strict=False, none_ok=True)
        _number("tis_cap", self.tis_cap, minimum=0.0, strict=True, none_ok=True)
        _positive_int("num_epochs", self.num_epochs)
        _positive_int("num_minibatches", self.num_minibatches)
        _positive_int("num_microbatches", self.num_microbatches)
        if self.ref_refresh_every is not None:
            _positive_int("ref_refresh_every", self.ref_refresh_every)
        if not isinstance(self.forward, ForwardConfig):
            raise ValueError(f"forward must be a ForwardConfig, got {type(self.forward).__name__}")
        if not isinstance(self.share_prompt, bool):
            raise ValueError(f"share_prompt must be True or False, got {self.share_prompt!r}")
        _choice("advantage_estimator", self.advantage_estimator, ADVANTAGE_ESTIMATORS)
        _positive_int("group_size", self.group_size, minimum=2)
        _number("adv_eps", self.adv_eps, minimum=0.0, strict=False)
        _choice("adv_std", self.adv_std, ("population", "unbiased"))
        if self.overlong_max_len is not None:
            _positive_int("overlong_max_len", self.overlong_max_len)
            _positive_int("overlong_buffer", self.overlong_buffer, minimum=0)
            if self.overlong_buffer > self.overlong_max_len:
                raise ValueError(
                    f"overlong_buffer must be <= overlong_max_len ({self.overlong_max_len}), "
                    f"got {self.overlong_buffer}"
                )
            _number("overlong_penalty", self.overlong_penalty, minimum=0.0, strict=False)

    @property
    def uses_reference(self) -> bool:
        """Whether the step computes a KL to the reference (beta > 0)."""
        return self.beta > 0


# The family as data. Sources: DeepSeekMath (GRPO), Liu et al. 2025 (Dr.GRPO), Yu et al.
# 2025 (DAPO), Zheng et al. 2025 (GSPO).
GRPO_PRESETS: dict[str, GRPOConfig] = {
    "grpo": GRPOConfig(),
    "dr_grpo": GRPOConfig(
        aggregation="seq-mean-token-sum-norm",
        norm_constant=1024.0,  # set to the run's maximum completion length
        advantage_estimator="dr_grpo",
        beta=0.0,
    ),
    "dapo": GRPOConfig(
        aggregation="token-mean",
        clip_low=0.2,
        clip_high=0.28,
        beta=0.0,
        overlong_max_len=1024,
        overlong_buffer=256,
    ),
    "gspo": GRPOConfig(
        ratio_level="sequence",
        clip_low=3e-4,
        clip_high=4e-4,
        aggregation="seq-mean-token-mean",
        beta=0.0,
    ),
}


def grpo_preset(name: str, **overrides) -> GRPOConfig:
    """A named preset of `GRPO_PRESETS`, with fields replaced by `overrides`."""
    if name not in GRPO_PRESETS:
        raise ValueError(f"unknown GRPO preset {name!r}; allowed: {tuple(GRPO_PRESETS)}")
    return dataclasses.replace(GRPO_PRESETS[name], **overrides)


def compute_advantages(
    rewards_n: Array,
    config: GRPOConfig,
    *,
    mask_nt: Array | None = None,
    lengths_n: Array | None = None,
    valid_n: Array | None = None,
) -> Array:
    """Advantages from rewards for the configured estimator, one call for the driver.

    Rows are grouped contiguously (`N = B*G`, G = `config.group_size`).

        grpo:           (r - mean_g) / (std_g + eps)                 `[N]`
        grpo_batch_std: (r - mean_g) / (std_batch + eps)             `[N]`
        dr_grpo:         r - mean_g                                  `[N]`
        rloo:            r - mean of the other G-1                   `[N]`
        reinforce_pp:   group-mean baseline, reward-to-go, global whitening   `[N, T]`

    With `config.overlong_max_len` set, DAPO's soft overlong penalty of `lengths_n` is
    added to the rewards first.

    Args:
      rewards_n: `[N]` sequence rewards.
      config: the step's `GRPOConfig`.
      mask_nt: `[N, T]` completion mask, required by "reinforce_pp".
      lengths_n: `[N]` completion lengths, required by the overlong penalty.
      valid_n: optional `[N]` bool, samples to leave out of the statistics (advantage 0).

    Returns:
      `[N]` or `[N, T]` float32 advantages.
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
    g = config.group_size
    est = config.advantage_estimator
    if est in ("grpo", "grpo_batch_std", "dr_grpo"):
        scale = {"grpo": "group", "grpo_batch_std": "batch", "dr_grpo": "none"}[est]
        return group_advantages(
            rewards,
            group_size=g,
            scale=scale,
            eps=config.adv_eps,
            std=config.adv_std,
            mask_n=valid_n,
        )
    if est == "rloo":
        return rloo_advantages(rewards, group_size=g, mask_n=valid_n)
    if mask_nt is None:
        raise ValueError(
            "advantage_estimator='reinforce_pp' needs mask_nt ([N, T] token advantages)"
        )
    return reinforce_pp_baseline_advantages(rewards, mask_nt, group_size=g, mask_n=valid_n)


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
        _positive_int("num_microbatches", self.num_microbatches)
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
        _positive_int("num_microbatches", self.num_microbatches)
        _number("center_coef", self.center_coef, minimum=0.0, strict=False)


__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "GRPO_PRESETS",
    "GRPOConfig",
    "RewardModelConfig",
    "SFTConfig",
    "compute_advantages",
    "grpo_preset",
]
