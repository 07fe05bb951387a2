"""The functional core: pure, mask-aware, float32 array math for PPO/GRPO.

Nothing here is jitted where it is defined and nothing imports the rest of grpojax;
every function works under `jax.jit`, `jax.vmap` and `jax.grad`.
"""

from grpojax.ops.advantages import (
    gae,
    group_advantages,
    last_token_mask,
    reinforce_pp_baseline_advantages,
    reinforce_pp_returns,
    rloo_advantages,
    whiten,
)
from grpojax.ops.aggregation import AGGREGATION_MODES, aggregate, aggregate_parts
from grpojax.ops.corrections import (
    off_policy_sequence_mask,
    overlong_penalty,
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

__all__ = [
    "AGGREGATION_MODES",
    "ESTIMATORS",
    "RATIO_LEVELS",
    "KLController",
    "KLControllerState",
    "adaptive_kl_controller",
    "aggregate",
    "aggregate_parts",
    "entropy",
    "entropy_bonus",
    "entropy_from_hidden",
    "fixed_kl_controller",
    "full_kl",
    "gae",
    "group_advantages",
    "kl",
    "kl_from_hidden",
    "kl_is_corrected",
    "kl_penalty_rewards",
    "last_token_mask",
    "mask_from_lengths",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "off_policy_sequence_mask",
    "overlong_penalty",
    "policy_loss",
    "reinforce_pp_baseline_advantages",
    "reinforce_pp_returns",
    "rloo_advantages",
    "token_logprobs",
    "token_logprobs_from_hidden",
    "truncated_completion_mask",
    "truncated_is_weights",
    "value_loss",
    "value_loss_with_metrics",
    "whiten",
]
