"""Porting a TRL `GRPOConfig` to grpojax: `from_trl(**trl_fields) -> GRPOConfig`.

TRL (`trl.GRPOConfig`, read at v1.9.0: trl/trainer/grpo_config.py and the loss in
`GRPOTrainer._compute_loss`) names its GRPO loss with one `loss_type` and a few numbers;
grpojax spells the same loss with orthogonal fields (aggregation, policy loss, clip band,
advantage estimator). `from_trl` takes TRL's field names and values, assumes TRL 1.x's
defaults for the ones left out (`TRL_DEFAULTS`), and returns the `GRPOConfig` whose loss
and per-token gradient equal TRL's on the same inputs (tests/test_trl_port.py). A field it
cannot map is refused with one `ValueError` naming it. The mapping table and the traps are
in docs/how-to/coming-from-trl.md.

    loss_type   aggregation                policy_loss   other fields
    grpo        seq-mean-token-mean        ppo_clip
    sapo        seq-mean-token-mean        sapo          sapo_tau_pos / sapo_tau_neg
    bnpo        token-mean                 ppo_clip      (TRL: per micro-batch)
    dapo        token-mean                 ppo_clip
    cispo       token-mean                 cispo         clip_low 1, clip_high eps_high - 1
    dr_grpo     seq-mean-token-sum-norm    ppo_clip      norm_constant max_completion_length
    luspo       seq-mean-token-sum         ppo_clip      ratio_level "sequence"

and always adv_eps 1e-4, adv_std "unbiased" (TRL: torch std with Bessel's correction),
kl_estimator "k3", entropy_aggregation "token-mean".
"""

from __future__ import annotations

from typing import Any

from grpojax.train.common import ForwardConfig
from grpojax.train.config import GRPOConfig

# TRL 1.x defaults (v1.9.0, trl/trainer/grpo_config.py) of the fields `from_trl` maps.
TRL_DEFAULTS: dict[str, Any] = {
    "loss_type": "dapo",
    "beta": 0.0,
    "epsilon": 0.2,
    "epsilon_high": None,
    "delta": None,
    "scale_rewards": "group",
    "multi_objective_aggregation": "sum_then_normalize",
    "reward_weights": None,
    "num_generations": 8,
    "max_completion_length": 256,
    "mask_truncated_completions": False,
    "importance_sampling_level": "token",
    "entropy_coef": 0.0,
    "sapo_temperature_pos": 1.0,
    "sapo_temperature_neg": 1.05,
    "off_policy_mask_threshold": None,
    "use_bias_correction_kl": False,
    "top_entropy_quantile": 1.0,
    "temperature": 1.0,
    "num_iterations": 1,
    "steps_per_generation": None,
    "gradient_accumulation_steps": 1,
}

# loss_type -> (aggregation, policy_loss).
_LOSS_TYPES = {
    "grpo": ("seq-mean-token-mean", "ppo_clip"),
    "sapo": ("seq-mean-token-mean", "sapo"),
    "bnpo": ("token-mean", "ppo_clip"),
    "dapo": ("token-mean", "ppo_clip"),
    "cispo": ("token-mean", "cispo"),
    "dr_grpo": ("seq-mean-token-sum-norm", "ppo_clip"),
    "luspo": ("seq-mean-token-sum", "ppo_clip"),
}
# scale_rewards -> advantage_estimator (sum_then_normalize).
_SCALE_REWARDS = {"group": "grpo", "batch": "grpo_batch_std", "none": "dr_grpo"}


def _scale_rewards(value) -> str:
    if value is True:
        value = "group"
    elif value is False:
        value = "none"
    if value not in _SCALE_REWARDS:
        raise ValueError(
            f"scale_rewards must be one of {(*_SCALE_REWARDS, True, False)}, got {value!r}"
        )
    return _SCALE_REWARDS[value]


def from_trl(**trl_fields) -> GRPOConfig:
    """The `GRPOConfig` of a TRL `GRPOConfig`'s loss fields (TRL 1.x semantics).

    Pass the TRL fields you set, by TRL's names (`TRL_DEFAULTS` lists the ones mapped and
    the defaults assumed for the others: TRL >= 0.22's beta 0.0, loss_type "dapo",
    scale_rewards "group"; a script written for TRL 0.17-0.18 relied on beta 0.04 and
    loss_type "bnpo": pass them). The result's other fields are grpojax's defaults; derive
    from it with `dataclasses.replace` (e.g. num_microbatches, share_prompt).

    Mapping: loss_type -> aggregation + policy_loss (module docstring); epsilon /
    epsilon_high -> clip_low / clip_high (cispo: clip_low 1.0, clip_high epsilon_high - 1:
    TRL's CISPO caps the weight at epsilon_high itself and has no floor); delta -> dual_clip
    (equal when delta >= 1 + epsilon_high); dr_grpo -> norm_constant = max_completion_length;
    scale_rewards "group" / "batch" / "none" -> advantage_estimator "grpo" /
    "grpo_batch_std" / "dr_grpo" (multi_objective_aggregation "normalize_then_sum" ->
    "gdpo" with gdpo_weights = reward_weights); num_generations -> group_size;
    mask_truncated_completions -> overlong_filter; importance_sampling_level ->
    ratio_level; entropy_coef -> entropy_coef with entropy_aggregation "token-mean";
    sapo_temperature_pos / _neg -> sapo_tau_pos / _neg; off_policy_mask_threshold ->
    off_policy_delta; use_bias_correction_kl -> kl_is_corrected; temperature ->
    forward.temperature; num_iterations -> num_epochs; steps_per_generation /
    gradient_accumulation_steps -> num_minibatches (optimizer updates per batch).

    One difference stays, by design: with mask_truncated_completions and a per-sequence
    loss type (grpo, sapo, dr_grpo, luspo), TRL divides by all rows and grpojax by the kept
    ones, so grpojax's loss is TRL's times N / kept rows (docs/how-to/coming-from-trl.md).

    Raises:
      ValueError: one line naming the field, for a field it does not map, a loss_type
        without an equivalent ("vespo"), or a value whose TRL meaning grpojax cannot
        express (delta < 1 + epsilon_high, CISPO's epsilon_high < 1, top_entropy_quantile
        < 1, a token-level loss with importance_sampling_level "sequence", luspo with
        beta > 0, reward_weights with sum_then_normalize).
    """
    unknown = sorted(set(trl_fields) - set(TRL_DEFAULTS))
    if unknown:
        raise ValueError(
            f"from_trl cannot map TRL fields {unknown}: it maps the loss fields "
            f"{tuple(TRL_DEFAULTS)}; see docs/how-to/coming-from-trl.md for the others"
        )
    f = {**TRL_DEFAULTS, **trl_fields}
    loss_type = f["loss_type"]
    if loss_type not in _LOSS_TYPES:
        raise ValueError(
            f"loss_type={loss_type!r} has no grpojax equivalent; from_trl maps {tuple(_LOSS_TYPES)}"
        )
    aggregation, policy = _LOSS_TYPES[loss_type]
    level = f["importance_sampling_level"]
    if level not in ("token", "sequence"):
        raise ValueError(f"importance_sampling_level must be 'token' or 'sequence', got {level!r}")
    if loss_type == "luspo" and level != "sequence":
        raise ValueError("loss_type='luspo' needs importance_sampling_level='sequence' (as in TRL)")
    if policy != "ppo_clip" and level != "token":
        raise ValueError(
            f"importance_sampling_level='sequence' with loss_type={loss_type!r}: grpojax's "
            f"{policy} weights tokens; only the clipped loss types take sequence ratios"
        )
    if loss_type == "luspo" and f["beta"]:
        raise ValueError(
            "beta > 0 with loss_type='luspo': TRL then averages the per-token KL over padded "
            "positions too, which has no grpojax equivalent"
        )
    if f["top_entropy_quantile"] != 1.0:
        raise ValueError(
            f"top_entropy_quantile={f['top_entropy_quantile']}: grpojax has no high-entropy "
            "token mask; only 1.0 (all tokens) maps"
        )
    if f["use_bias_correction_kl"] and level != "token":
        raise ValueError(
            "use_bias_correction_kl with importance_sampling_level='sequence': grpojax's "
            "kl_is_corrected weights each token by its own ratio"
        )

    low = f["epsilon"]
    high = low if f["epsilon_high"] is None else f["epsilon_high"]
    out: dict[str, Any] = {
        "aggregation": aggregation,
        "policy_loss": policy,
        "ratio_level": level,
        "beta": f["beta"],
        "kl_estimator": "k3",
        "kl_is_corrected": bool(f["use_bias_correction_kl"]),
        "adv_eps": 1e-4,
        "adv_std": "unbiased",
        "group_size": f["num_generations"],
        "overlong_filter": f["mask_truncated_completions"],
        "entropy_coef": f["entropy_coef"],
        "entropy_aggregation": "token-mean",
        "sapo_tau_pos": f["sapo_temperature_pos"],
        "sapo_tau_neg": f["sapo_temperature_neg"],
        "off_policy_delta": f["off_policy_mask_threshold"],
        "num_epochs": f["num_iterations"],
        "forward": ForwardConfig(temperature=f["temperature"]),
    }
    if policy == "cispo":
        if high < 1.0:
            raise ValueError(
                f"epsilon_high={high}: with loss_type='cispo' TRL caps the IS weight at "
                "epsilon_high itself (ScaleRL: 5.0), and a cap below 1 has no grpojax "
                "equivalent (set epsilon_high >= 1)"
            )
        out.update(clip_low=1.0, clip_high=high - 1.0)
    else:
        out.update(clip_low=low, clip_high=high)
    if f["delta"] is not None:
        if policy != "ppo_clip":
            raise ValueError(f"delta: TRL ignores it with loss_type={loss_type!r}; leave it None")
        if f["delta"] < 1.0 + high:
            raise ValueError(
                f"delta={f['delta']} must be >= 1 + epsilon_high = {1.0 + high} to map to "
                "dual_clip (below it TRL's clamp also caps positive-advantage ratios)"
            )
        out["dual_clip"] = f["delta"]
    if loss_type == "dr_grpo":
        out["norm_constant"] = float(f["max_completion_length"])
    if f["multi_objective_aggregation"] == "normalize_then_sum":
        out["advantage_estimator"] = "gdpo"
        if f["reward_weights"] is not None:
            out["gdpo_weights"] = tuple(f["reward_weights"])
    elif f["multi_objective_aggregation"] == "sum_then_normalize":
        out["advantage_estimator"] = _scale_rewards(f["scale_rewards"])
        if f["reward_weights"] is not None:
            raise ValueError(
                "reward_weights with multi_objective_aggregation='sum_then_normalize': the "
                "weighted sum is the reward manager's (each reward's weight in the run YAML)"
            )
    else:
        raise ValueError(
            "multi_objective_aggregation must be 'sum_then_normalize' or "
            f"'normalize_then_sum', got {f['multi_objective_aggregation']!r}"
        )
    gas = f["gradient_accumulation_steps"]
    spg = gas if f["steps_per_generation"] is None else f["steps_per_generation"]
    if not isinstance(gas, int) or not isinstance(spg, int) or gas < 1 or spg % gas:
        raise ValueError(
            f"steps_per_generation ({spg}) must be a multiple of gradient_accumulation_steps "
            f"({gas}), both integers >= 1: their ratio is the optimizer updates per batch"
        )
    out["num_minibatches"] = spg // gas
    return GRPOConfig(**out)


__all__ = ["TRL_DEFAULTS", "from_trl"]
