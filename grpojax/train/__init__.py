"""Train steps: `TrainState`, the optimizer, and the jitted GRPO / SFT / reward-model updates.

Each step is a pure `*_update(state, batch, ...)` plus a `make_*_step(...)` that jits it once
with shardings and donation (`grpojax.train.common.jit_step`). The GRPO step lives in
`grpojax.train.grpo` (its batch, loss and update modules), the PPO step in
`grpojax.train.ppo`; every step's config (GRPO, PPO, SFT, reward model) in
`grpojax.train.config`; the GRPO step's pluggable policy losses and advantage estimators in
`grpojax.train.objectives`. `grpo_loss` / `grpo_loss_from_logprobs` give the GRPO step's loss
without an update, `grpo_batch_from_ids` builds its batch from token-id lists, and
`from_trl` ports a TRL `GRPOConfig` (docs/how-to/coming-from-trl.md).
"""

from grpojax.train.common import (
    ForwardConfig,
    accumulate_gradients,
    batch_shardings,
    jit_step,
    policy_logprobs,
    split_micro,
)
from grpojax.train.config import (
    ADVANTAGE_ESTIMATORS,
    CRITIC_MODES,
    GRPO_PRESETS,
    POLICY_LOSSES,
    GRPOConfig,
    PPOConfig,
    RewardModelConfig,
    SFTConfig,
    compute_advantages,
    grpo_preset,
)
from grpojax.train.grpo import (
    GRPOBatch,
    grpo_batch_from_ids,
    grpo_batch_from_rollout,
    grpo_batch_from_rows,
    grpo_loss,
    grpo_loss_from_logprobs,
    grpo_update,
    make_grpo_step,
)
from grpojax.train.objectives import resolve_advantage_estimator, resolve_policy_loss
from grpojax.train.reward_model import (
    PreferenceBatch,
    make_reward_model_step,
    reward_model_update,
)
from grpojax.train.sft import SFTBatch, make_sft_step, sft_batch_from_lengths, sft_update
from grpojax.train.state import (
    DECAY_MASKS,
    OptimizerConfig,
    Teacher,
    TrainState,
    apply_gradients,
    create_train_state,
    decay_mask_except_bias_norm,
    make_optimizer,
    make_schedule,
    put_global,
    shard_train_state,
    train_state_shardings,
)
from grpojax.train.trl import TRL_DEFAULTS, from_trl

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "CRITIC_MODES",
    "DECAY_MASKS",
    "GRPO_PRESETS",
    "POLICY_LOSSES",
    "TRL_DEFAULTS",
    "ForwardConfig",
    "GRPOBatch",
    "GRPOConfig",
    "OptimizerConfig",
    "PPOConfig",
    "PreferenceBatch",
    "RewardModelConfig",
    "SFTBatch",
    "SFTConfig",
    "Teacher",
    "TrainState",
    "accumulate_gradients",
    "apply_gradients",
    "batch_shardings",
    "compute_advantages",
    "create_train_state",
    "decay_mask_except_bias_norm",
    "from_trl",
    "grpo_batch_from_ids",
    "grpo_batch_from_rollout",
    "grpo_batch_from_rows",
    "grpo_loss",
    "grpo_loss_from_logprobs",
    "grpo_preset",
    "grpo_update",
    "jit_step",
    "make_grpo_step",
    "make_optimizer",
    "make_reward_model_step",
    "make_schedule",
    "make_sft_step",
    "policy_logprobs",
    "put_global",
    "resolve_advantage_estimator",
    "resolve_policy_loss",
    "reward_model_update",
    "sft_batch_from_lengths",
    "sft_update",
    "shard_train_state",
    "split_micro",
    "train_state_shardings",
]
