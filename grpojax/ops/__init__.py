"""The functional core: pure, mask-aware, float32 array math for PPO/GRPO.

Nothing here is jitted where it is defined and nothing imports the rest of grpojax;
every function works under `jax.jit`, `jax.vmap` and `jax.grad`. Every masked op is safe
at padding: whatever a masked position holds (NaN, inf) reaches neither its outputs nor
their gradients.

Keyword defaults follow one rule. A keyword that selects the algorithm among alternatives
of equal standing (a KL estimator, an aggregation mode, a DPPO divergence, a rollout
correction's level and mode) has no default: the caller names it. A keyword that turns on
a variant of the method an op is named for defaults to that method (`policy_loss` is PPO's
token ratio until `ratio_level="sequence"`, `group_advantages` GRPO's group scaling until
`scale="batch"` or `"none"`). A numeric hyperparameter of a method defaults to its source
paper's value where the paper gives one, and is required where it gives none. Numerical
guards and engineering knobs that belong to no method (`clamp`, `log_ratio_clamp`, the
`eps` of a division, tile sizes) and options that are off by default (`dual_clip=None`,
`key=None`, `temperature=1.0`) keep neutral defaults.
"""

from grpojax.ops.advantages import (
    gae,
    gdpo_advantages,
    gpg_advantages,
    group_advantages,
    last_token_mask,
    maxrl_advantages,
    opo_advantages,
    pass_at_k_advantages,
    reinforce_pp_baseline_advantages,
    reinforce_pp_returns,
    remax_advantages,
    rloo_advantages,
    whiten,
)
from grpojax.ops.aggregation import AGGREGATION_MODES, aggregate, aggregate_parts
from grpojax.ops.corrections import (
    ROLLOUT_LEVELS,
    ROLLOUT_MODES,
    off_policy_sequence_mask,
    overlong_penalty,
    rollout_correction,
    truncated_completion_mask,
    truncated_is_weights,
)
from grpojax.ops.kl import (
    ESTIMATORS,
    KLController,
    KLControllerState,
    adaptive_kl_controller,
    fixed_kl_controller,
    kl,
    kl_is_corrected,
    kl_penalty_rewards,
)
from grpojax.ops.logprobs import (
    divergence_from_hidden,
    entropy,
    entropy_from_hidden,
    full_kl,
    kl_from_hidden,
    token_logprobs,
    token_logprobs_from_hidden,
)
from grpojax.ops.losses import (
    RATIO_LEVELS,
    entropy_bonus,
    policy_loss,
    value_loss,
    value_loss_with_metrics,
)
from grpojax.ops.masks import mask_from_lengths, masked_mean, masked_sum, masked_var
from grpojax.ops.surrogates import (
    DPPO_DIVERGENCES,
    cispo_loss,
    clip_cov_loss,
    dppo_loss,
    gmpo_loss,
    kl_cov_loss,
    sapo_loss,
)

__all__ = [
    "AGGREGATION_MODES",
    "DPPO_DIVERGENCES",
    "ESTIMATORS",
    "RATIO_LEVELS",
    "ROLLOUT_LEVELS",
    "ROLLOUT_MODES",
    "KLController",
    "KLControllerState",
    "adaptive_kl_controller",
    "aggregate",
    "aggregate_parts",
    "cispo_loss",
    "clip_cov_loss",
    "divergence_from_hidden",
    "dppo_loss",
    "entropy",
    "entropy_bonus",
    "entropy_from_hidden",
    "fixed_kl_controller",
    "full_kl",
    "gae",
    "gdpo_advantages",
    "gmpo_loss",
    "gpg_advantages",
    "group_advantages",
    "kl",
    "kl_cov_loss",
    "kl_from_hidden",
    "kl_is_corrected",
    "kl_penalty_rewards",
    "last_token_mask",
    "mask_from_lengths",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "maxrl_advantages",
    "off_policy_sequence_mask",
    "opo_advantages",
    "overlong_penalty",
    "pass_at_k_advantages",
    "policy_loss",
    "reinforce_pp_baseline_advantages",
    "reinforce_pp_returns",
    "remax_advantages",
    "rloo_advantages",
    "rollout_correction",
    "sapo_loss",
    "token_logprobs",
    "token_logprobs_from_hidden",
    "truncated_completion_mask",
    "truncated_is_weights",
    "value_loss",
    "value_loss_with_metrics",
    "whiten",
]
