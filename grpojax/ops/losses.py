"""Per-token policy, value and entropy losses for PPO / GRPO and their relatives.

Every function here returns an *unreduced* `[N, T]` float32 loss with masked positions
exactly 0; reducing over tokens and sequences is `grpojax.ops.aggregation.aggregate`'s job,
so one loss serves token-mean GRPO, Dr.GRPO, DAPO and GSPO alike and micro-batches
accumulate exactly. Losses are to be minimised (they are negated objectives).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import Array

from grpojax.ops.checks import broadcast_mask, check_choice, check_number, check_shape
from grpojax.ops.masks import masked_mean

RATIO_LEVELS = ("token", "sequence")


def _check_policy_hparams(clip_low, clip_high, dual_clip, ratio_level, log_ratio_clamp) -> None:
    check_number("clip_low", clip_low, minimum=0.0, strict=False)
    check_number("clip_high", clip_high, minimum=0.0, strict=False)
    check_number("dual_clip", dual_clip, minimum=1.0, strict=True, none_ok=True)
    check_choice("ratio_level", ratio_level, RATIO_LEVELS)
    check_number("log_ratio_clamp", log_ratio_clamp, minimum=0.0, strict=True)


def _broadcast_advantages(advantages: Array, shape: tuple[int, ...]) -> Array:
    """`[N]` or `[N, T]` advantages as `[N, T]` float32 (sizes of 1 broadcast)."""
    adv = jnp.asarray(advantages, jnp.float32)
    want = f"[N] or [N, T] matching logp_nt [N, T] = {tuple(shape)}"
    check_shape("advantages", adv.shape, (shape[:-1], shape), want, broadcast=True)
    if adv.ndim == len(shape) - 1:
        adv = adv[..., None]
    return jnp.broadcast_to(adv, shape)


def _token_inputs(logp_nt, old_logp_nt, advantages, mask_nt, log_ratio_clamp):
    """Float32 `(logp, old_logp, adv, mask, log_ratio)`, all `[N, T]`, shared by the losses.

    Padding may hold anything (-inf, NaN): `logp`, `old_logp` and `adv` are 0 there, selected
    before any arithmetic so that nothing non-finite reaches a value or a gradient (the
    `jnp.where` gradient trap: `where(mask, f(x), 0)` still differentiates `f` at the
    masked `x`). `log_ratio = clip(logp - old_logp, -clamp, clamp)`, exactly 0 at padding.
    """
    logp = jnp.asarray(logp_nt, jnp.float32)
    old_logp = jnp.asarray(old_logp_nt, jnp.float32)
    if logp.shape != old_logp.shape:
        raise ValueError(
            f"old_logp_nt must have the shape of logp_nt {logp.shape}, got {old_logp.shape}"
        )
    mask = broadcast_mask("mask_nt", mask_nt, logp.shape)
    adv = jnp.where(mask, _broadcast_advantages(advantages, logp.shape), 0.0)
    logp = jnp.where(mask, logp, 0.0)
    old_logp = jnp.where(mask, old_logp, 0.0)
    log_ratio = jnp.clip(logp - old_logp, -log_ratio_clamp, log_ratio_clamp)
    return logp, old_logp, adv, mask, log_ratio


def _ratio_metrics(token_log_ratio: Array, ratio: Array, mask: Array) -> dict[str, Array]:
    """Means over real tokens (empty mask: 0; min/max: 1) of the ratio's diagnostics.

    approx_kl_k1 = mean(-log rho) and approx_kl_k3 = mean(rho - 1 - log rho), with
    rho = exp(logp - old_logp) per token, both estimate KL(pi_old || pi_theta) from samples
    of pi_old; ratio_mean / ratio_min / ratio_max describe `ratio`, the ratio the loss uses.
    """
    sg_ratio = jax.lax.stop_gradient(ratio)
    sg_log_ratio = jax.lax.stop_gradient(token_log_ratio)
    any_real = jnp.any(mask)
    return {
        "approx_kl_k1": masked_mean(-sg_log_ratio, mask),
        "approx_kl_k3": masked_mean(jnp.expm1(sg_log_ratio) - sg_log_ratio, mask),
        "ratio_mean": masked_mean(sg_ratio, mask),
        "ratio_min": jnp.where(any_real, jnp.min(jnp.where(mask, sg_ratio, jnp.inf)), 1.0),
        "ratio_max": jnp.where(any_real, jnp.max(jnp.where(mask, sg_ratio, -jnp.inf)), 1.0),
    }


def _ppo_objective(ratio: Array, adv: Array, lower, upper) -> tuple[Array, Array]:
    """(min(r A, clip(r, lower, upper) A), where the clipped branch is strictly smaller).

    A select instead of jnp.minimum: at ties (r inside the band, e.g. r == 1 on the first
    epoch) the gradient must be the full -r A, not a split between equal branches.
    """
    surr = ratio * adv
    surr_clipped = jnp.clip(ratio, lower, upper) * adv
    clipped_active = surr_clipped < surr
    return jnp.where(clipped_active, surr_clipped, surr), clipped_active


def policy_loss(
    logp_nt: Array,
    old_logp_nt: Array,
    advantages: Array,
    mask_nt: Array,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    ratio_level: str = "token",
    log_ratio_clamp: float = 20.0,
) -> tuple[Array, dict[str, Array]]:
    """PPO clipped surrogate per token, with clip-higher, dual clip and GSPO sequence ratios.

    With ratio r and advantage A (both per token):

        loss_t = -min(r_t A_t, clip(r_t, 1 - clip_low, 1 + clip_high) A_t)

    Separate `clip_low` / `clip_high` give DAPO's clip-higher. `dual_clip = c > 1`
    (Ye et al. 2020) also bounds the loss of negative-advantage tokens whose ratio has
    blown up: where A_t < 0, loss_t = min(loss_t, -c A_t).

    The ratio, with log r clamped to [-log_ratio_clamp, log_ratio_clamp] so that exp never
    overflows (the loss and gradient stay finite; beyond the clamp the gradient is 0):

    - ratio_level="token" (PPO / GRPO): r_t = exp(logp_t - old_logp_t).
    - ratio_level="sequence" (GSPO, "GSPO-token" form): the length-normalised sequence
      ratio s_i = exp((1/|y_i|) sum_t (logp_t - old_logp_t)) over the sequence's real
      tokens, carried to every token as s_{i,t} = sg(s_i) * exp(logp_t - sg(logp_t)).
      Its value is s_i, so clipping acts on the sequence ratio, and d s_{i,t} / d logp_t =
      s_i: inside the band each token's gradient is -s_i A_{i,t}, and with a per-sequence
      token mean it is -s_i A_i / |y_i|, exactly the gradient of GSPO's sequence objective
      when A_{i,t} = A_i.

    Gradient, token level: inside the band (and on the side where clipping does not bind
    for the sign of A) d loss_t / d logp_t = -r_t A_t; where the clipped branch is strictly
    smaller (A > 0 and r > 1 + clip_high, or A < 0 and r < 1 - clip_low) it is 0; where
    the dual clip binds it is 0.

    Args:
      logp_nt: `[N, T]` log pi_theta of the sampled tokens (any float dtype; math in f32).
      old_logp_nt: `[N, T]` log pi_old of the same tokens (the sampling-time policy).
      advantages: `[N]` (broadcast over tokens) or `[N, T]`.
      mask_nt: `[N, T]` bool or {0, 1}: real completion tokens (from lengths).
      clip_low: >= 0, the lower side of the band [1 - clip_low, 1 + clip_high].
      clip_high: >= 0, its upper side.
      dual_clip: None or c > 1.
      ratio_level: "token" or "sequence".
      log_ratio_clamp: > 0, bound on |log r| before exponentiating.

    The numeric hyperparameters are Python/NumPy numbers (validated) or 0-d arrays, e.g. a
    scheduled clip range passed into a jitted step (not validated).

    Returns:
      loss_nt: `[N, T]` float32, 0 at masked positions.
      metrics: dict of float32 scalars, each a mean over real tokens (empty mask: 0; ratio
        min/max: 1):
        clip_frac_low / clip_frac_high: fraction where the clipped branch is strictly
          active at the lower / upper bound; dual_clip_frac: fraction where the dual clip
          binds (always present, 0 when disabled); approx_kl_k1 = mean(old_logp - logp) and
          approx_kl_k3 = mean(rho - 1 - log rho), rho = exp(logp - old_logp) per token, both
          estimates of KL(pi_old || pi_theta) from samples of pi_old; ratio_mean /
          ratio_min / ratio_max of the ratio used in the loss (s_i in sequence mode).

    Examples:
      >>> import jax.numpy as jnp
      >>> import grpojax as gj
      >>> old_logp = jnp.log(jnp.full((2, 3), 0.5))
      >>> logp = jnp.log(jnp.array([[0.5, 0.5, 0.75], [0.5, 0.5, 0.5]]))  # ratio 1.5 at [0, 2]
      >>> loss, metrics = gj.policy_loss(logp, old_logp, jnp.array([1.0, -2.0]), jnp.ones((2, 3)))
      >>> print(loss)  # -A at ratio 1; -(1 + 0.2) * A where the ratio is clipped
      [[-1.  -1.  -1.2]
       [ 2.   2.   2. ]]
    """
    _check_policy_hparams(clip_low, clip_high, dual_clip, ratio_level, log_ratio_clamp)
    logp, old_logp, adv, mask, token_log_ratio = _token_inputs(
        logp_nt, old_logp_nt, advantages, mask_nt, log_ratio_clamp
    )
    safe_logp = jnp.where(mask, logp, 0.0)

    if ratio_level == "token":
        ratio = jnp.exp(token_log_ratio)
    else:
        seq_log_ratio = masked_mean(jnp.where(mask, logp - old_logp, 0.0), mask, axis=-1)
        seq_ratio = jnp.exp(jnp.clip(seq_log_ratio, -log_ratio_clamp, log_ratio_clamp))
        ratio = jax.lax.stop_gradient(seq_ratio)[..., None] * jnp.exp(
            safe_logp - jax.lax.stop_gradient(safe_logp)
        )

    lower, upper = 1.0 - clip_low, 1.0 + clip_high
    objective, clipped_active = _ppo_objective(ratio, adv, lower, upper)
    if dual_clip is not None:
        dual_active = (adv < 0) & (dual_clip * adv > objective)
        objective = jnp.where(dual_active, dual_clip * adv, objective)
    else:
        dual_active = jnp.zeros_like(mask)
    loss = jnp.where(mask, -objective, 0.0)

    sg_ratio = jax.lax.stop_gradient(ratio)
    metrics = {
        "clip_frac_low": masked_mean(clipped_active & (sg_ratio < lower), mask),
        "clip_frac_high": masked_mean(clipped_active & (sg_ratio > upper), mask),
        "dual_clip_frac": masked_mean(dual_active, mask),
        **_ratio_metrics(token_log_ratio, ratio, mask),
    }
    return loss, metrics


def _value_loss_and_clip(values_nt, old_values_nt, returns_nt, mask_nt, clip):
    check_number("clip", clip, minimum=0.0, strict=False, none_ok=True)
    values = jnp.asarray(values_nt, jnp.float32)
    mask = broadcast_mask("mask_nt", mask_nt, values.shape)
    # Selected before the arithmetic: garbage at padding reaches no value or gradient.
    values = jnp.where(mask, values, 0.0)
    old_values = jnp.where(mask, jnp.asarray(old_values_nt, jnp.float32), 0.0)
    returns = jnp.where(mask, jnp.asarray(returns_nt, jnp.float32), 0.0)
    err = jnp.square(values - returns)
    if clip is None:
        return jnp.where(mask, 0.5 * err, 0.0), jnp.zeros_like(mask)
    clipped_values = jnp.clip(values, old_values - clip, old_values + clip)
    err_clipped = jnp.square(clipped_values - returns)
    # Select instead of jnp.maximum so ties give the unclipped gradient, not half of it.
    clipped_active = err_clipped > err
    loss = 0.5 * jnp.where(clipped_active, err_clipped, err)
    return jnp.where(mask, loss, 0.0), clipped_active & mask


def value_loss(
    values_nt: Array,
    old_values_nt: Array,
    returns_nt: Array,
    mask_nt: Array,
    *,
    clip: float | None = 0.2,
) -> Array:
    """Clipped value loss per token (PPO critic):

        loss_t = 0.5 * max((V_t - R_t)^2, (clip(V_t, V_old_t - c, V_old_t + c) - R_t)^2)

    and with `clip=None` simply 0.5 * (V_t - R_t)^2. The default c = 0.2 is PPO's: the
    seeds use value clipping "like PPO's value head clipping" with PPO's clip range
    epsilon = 0.2 (seed 002, "From Fundamentals to PPO & GRPO in LLMs (II)", whose worked
    example clips r = 1.35 to 1.2), and the PPO implementations clip the value by the same
    0.2 (OpenAI baselines' ppo2 shares `cliprange` between policy and value; TRL's
    `cliprange_value=0.2`). Garbage (NaN, inf) at masked positions reaches neither the loss
    nor its gradients.

    Args:
      values_nt: `[N, T]` current value predictions V.
      old_values_nt: `[N, T]` values at sampling time V_old.
      returns_nt: `[N, T]` regression targets R (e.g. GAE returns).
      mask_nt: `[N, T]` real tokens.
      clip: c >= 0 (default 0.2), or None to disable clipping.

    Returns:
      `[N, T]` float32 loss, 0 at masked positions.

    Examples:
      >>> import jax.numpy as jnp
      >>> import numpy as np
      >>> import grpojax as gj
      >>> v, v_old = jnp.array([[1.0, 1.5, 0.5]]), jnp.ones((1, 3))
      >>> ret = jnp.array([[0.0, 2.0, 1.0]])  # at [0, 1] the clipped V = 1.2 is farther from 2
      >>> print(np.round(np.asarray(gj.value_loss(v, v_old, ret, jnp.ones((1, 3)))), 4))
      [[0.5   0.32  0.125]]
    """
    return _value_loss_and_clip(values_nt, old_values_nt, returns_nt, mask_nt, clip)[0]


def value_loss_with_metrics(
    values_nt: Array,
    old_values_nt: Array,
    returns_nt: Array,
    mask_nt: Array,
    *,
    clip: float | None = 0.2,
) -> tuple[Array, dict[str, Array]]:
    """`value_loss` plus {"value_clip_frac": fraction of real tokens where the clipped
    term is strictly larger, i.e. where clipping changed the loss}. Shapes as `value_loss`.

    Examples:
      >>> import jax.numpy as jnp
      >>> import grpojax as gj
      >>> v, v_old = jnp.array([[1.0, 2.0, 0.0]]), jnp.ones((1, 3))
      >>> loss, metrics = gj.value_loss_with_metrics(v, v_old, jnp.array([[0.0, 3.0, 1.0]]),
      ...                                            jnp.ones((1, 3)), clip=0.5)
      >>> print(loss)  # at [0, 1] the clipped V = 1.5 is farther from 3: 0.5 * 1.5^2
      [[0.5   1.125 0.5  ]]
      >>> round(float(metrics["value_clip_frac"]), 4)
      0.3333
    """
    loss, clipped = _value_loss_and_clip(values_nt, old_values_nt, returns_nt, mask_nt, clip)
    return loss, {"value_clip_frac": masked_mean(clipped, mask_nt)}


def entropy_bonus(entropy_nt: Array, mask_nt: Array, *, coef: float) -> Array:
    """Entropy bonus as a loss term: loss_t = -coef * H_t (minimising it raises entropy).

    Args:
      entropy_nt: `[N, T]` per-token entropy of pi_theta (e.g. from `grpojax.entropy`).
      mask_nt: `[N, T]` real tokens.
      coef: the bonus weight (a Python number).

    Returns:
      `[N, T]` float32, 0 at masked positions; aggregate it like the policy loss.

    Examples:
      >>> import jax.numpy as jnp
      >>> import grpojax as gj
      >>> entropy, mask = jnp.array([[1.0, 2.0, 3.0]]), jnp.array([[1, 1, 0]])
      >>> print(gj.entropy_bonus(entropy, mask, coef=0.01))
      [[-0.01 -0.02  0.  ]]
    """
    check_number("coef", coef, minimum=-math.inf, strict=True)
    entropy = jnp.asarray(entropy_nt, jnp.float32)
    mask = jnp.broadcast_to(jnp.asarray(mask_nt, jnp.bool_), entropy.shape)
    return jnp.where(mask, -coef * entropy, 0.0)


__all__ = [
    "RATIO_LEVELS",
    "entropy_bonus",
    "policy_loss",
    "value_loss",
    "value_loss_with_metrics",
]
