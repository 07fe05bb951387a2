"""Off-policy and length corrections applied around the policy loss.

Masks and weights that decide which samples train and how much: DeepSeek-V3.2's
off-policy sequence masking, importance weights between the sampler and the trainer
(truncated, masked, IcePop; token or sequence level), and DAPO's overlong filtering and
soft overlong punishment. None of them carries gradient: they are constants multiplied
into the per-token loss (or, for the penalty, added to the reward).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import Array

from grpojax.ops.checks import check_choice, check_number, check_shape
from grpojax.ops.masks import masked_mean


def off_policy_sequence_mask(
    logp_nt: Array, old_logp_nt: Array, advantages_n: Array, mask_nt: Array, *, delta: float
) -> Array:
    """DeepSeek-V3.2 off-policy sequence masking: which sequences to keep.

    A sequence i is dropped when it is both harmful to learn from and too far off-policy:

        keep_i = not (A_i < 0  and  (1/|o_i|) sum_t (old_logp_{i,t} - logp_{i,t}) > delta)

    The mean over the sequence's real tokens of log pi_old - log pi_theta is the k1
    estimate of KL(pi_old || pi_theta) on samples from pi_old. In V3.2, pi_old is the
    policy the samples were *drawn* from (the inference engine's log-probs), so the
    divergence measured includes both policy staleness and sampler/trainer mismatch.
    Negative-advantage samples far off-policy are the ones whose gradient destabilises
    training; positive-advantage ones are always kept. A sequence with no real tokens has
    mean 0 and is kept.

    Multiply the keep mask into the per-token loss (`loss_nt * keep_n[:, None]`) to keep
    the recipe's normalisation; folding it into the aggregation mask would also drop the
    sequence from the denominators.

    Args:
      logp_nt: `[N, T]` log pi_theta of the sampled tokens.
      old_logp_nt: `[N, T]` log pi_old (sampling policy) of the same tokens.
      advantages_n: `[N]` sequence advantages A_i.
      mask_nt: `[N, T]` real tokens.
      delta: >= 0, the KL threshold.

    Returns:
      `[N]` bool, True = keep. No gradient flows through it.

    Examples:
      >>> import jax.numpy as jnp
      >>> import grpojax as gj
      >>> logp, old_logp = jnp.array([[-2.0] * 3, [-1.0] * 3]), jnp.full((2, 3), -1.0)
      >>> adv = jnp.array([-1.0, -1.0])  # row 0: mean(old_logp - logp) = 1 > delta
      >>> print(gj.off_policy_sequence_mask(logp, old_logp, adv, jnp.ones((2, 3)), delta=0.5))
      [False  True]
    """
    check_number("delta", delta, minimum=0.0, strict=False)
    logp = jax.lax.stop_gradient(jnp.asarray(logp_nt, jnp.float32))
    old_logp = jax.lax.stop_gradient(jnp.asarray(old_logp_nt, jnp.float32))
    mask = jnp.broadcast_to(jnp.asarray(mask_nt, jnp.bool_), logp.shape)
    adv = jnp.asarray(advantages_n, jnp.float32)
    lead = logp.shape[:-1]
    check_shape("advantages_n", adv.shape, [lead], f"[N] = {lead}, one per sequence")
    kl_n = masked_mean(jnp.where(mask, old_logp - logp, 0.0), mask, axis=-1)
    return ~((adv < 0) & (kl_n > delta))


ROLLOUT_LEVELS = ("token", "sequence")
ROLLOUT_MODES = ("truncate", "mask", "icepop")


def _rollout_band(level, mode, low, high):
    """The (low, high) band for `mode`, defaults filled in, validated (low None: no floor)."""
    check_choice("level", level, ROLLOUT_LEVELS)
    check_choice("mode", mode, ROLLOUT_MODES)
    if mode == "icepop" and level != "token":
        raise ValueError(
            "mode='icepop' is token level (IcePop masks tokens); for whole sequences use "
            "level='sequence', mode='mask'"
        )
    if mode == "truncate" and low is not None:
        raise ValueError("mode='truncate' caps weights from above only; low must be None")
    if high is None:
        high = 5.0 if mode == "icepop" else 2.0
    check_number("high", high, minimum=0.0, strict=True)
    if low is None and mode != "truncate":
        low = 0.5 if mode == "icepop" else 1.0 / high
    check_number("low", low, minimum=0.0, none_ok=True)
    if isinstance(low, int | float) and isinstance(high, int | float) and low > high:
        raise ValueError(f"low must be <= high, got low={low} > high={high}")
    return low, high


def rollout_correction(
    trainer_logp_nt: Array,
    sampler_logp_nt: Array,
    mask_nt: Array,
    *,
    level: str,
    mode: str,
    low: float | None = None,
    high: float | None = None,
) -> tuple[Array, dict[str, Array]]:
    """Importance weights correcting for sampler/trainer mismatch (rollout correction).

    The inference engine samples from pi_sampler, which differs numerically from the
    trainer's pi_old (kernels, precision, MoE routing). Multiplying the per-token policy
    loss by these weights (constants, no gradient) corrects or filters the mismatch. With
    the per-token log-ratio log w_t = trainer_logp_t - sampler_logp_t:

        level="token":     w_t = pi_trainer(y_t) / pi_sampler(y_t)
        level="sequence":  w_t = w_i = prod_{t' real} w_{t'} for every token of sequence i
                           (the sum of log-ratios, exponentiated; never a product of floats)

        mode="truncate"  (TIS, Yao et al. 2025):   weight = min(w, high)
        mode="mask"      (MIS, masked IS):         weight = w if low <= w <= high else 0
        mode="icepop"    (IcePop, Ling Team 2025): weight = w if low <= w <= high else 0,
                                                   token level, band [0.5, 5] by default

    Defaults: truncate high = 2; mask high = 2, low = 1 / high; icepop [0.5, 5]. Bounds are
    compared in log space and the weight is exp(min(log w, log high)), so no ratio can
    overflow. Weights are exactly 0 at padding.

    Args:
      trainer_logp_nt: `[N, T]` log-probs of the sampled tokens under the trainer's pi_old.
      sampler_logp_nt: `[N, T]` log-probs reported by the sampler for the same tokens.
      mask_nt: `[N, T]` real tokens.
      level: "token" or "sequence" (no default: it picks the method).
      mode: "truncate", "mask" or "icepop" (token level only; no default).
      low: lower bound of the band for "mask"/"icepop" (>= 0; must be None for "truncate").
      high: upper bound (> 0): the cap for "truncate", the band's top otherwise.

    Returns:
      weights_nt: `[N, T]` float32, stop-gradient constants, 0 at padding.
      metrics: float32 scalars over real tokens (empty mask: 0):
        weight_mean: mean weight;
        masked_frac: fraction whose weight the band set to 0 (mask/icepop; 0 for truncate);
        truncated_frac: fraction whose weight was capped at high (truncate; 0 otherwise);
        kl_k1 = mean(sampler_logp - trainer_logp) and
        kl_k3 = mean(w_t - 1 - log w_t) (token w_t at both levels): estimates of
          KL(pi_sampler || pi_trainer) from the sampler's tokens (k1 unbiased, k3 unbiased
          and >= 0 per token).

    Examples:
      >>> import jax.numpy as jnp
      >>> import numpy as np
      >>> import grpojax as gj
      >>> sampler, trainer = jnp.log(jnp.full((1, 3), 0.5)), jnp.log(jnp.array([[0.5, 0.75, 0.1]]))
      >>> w, metrics = gj.rollout_correction(trainer, sampler, jnp.ones((1, 3)), level="token",
      ...                                    mode="mask")  # ratios 1, 1.5, 0.2
      >>> print(np.round(np.asarray(w), 4))  # kept inside the band [1/2, 2], 0 outside
      [[1.  1.5 0. ]]
    """
    low, high = _rollout_band(level, mode, low, high)
    trainer = jax.lax.stop_gradient(jnp.asarray(trainer_logp_nt, jnp.float32))
    sampler = jax.lax.stop_gradient(jnp.asarray(sampler_logp_nt, jnp.float32))
    if trainer.shape != sampler.shape:
        raise ValueError(
            f"trainer_logp_nt {trainer.shape} and sampler_logp_nt {sampler.shape} must match"
        )
    mask = jnp.broadcast_to(jnp.asarray(mask_nt, jnp.bool_), trainer.shape)
    token_log_w = jnp.where(mask, trainer - sampler, 0.0)
    if level == "token":
        log_w = token_log_w
    else:
        log_w = jnp.broadcast_to(jnp.sum(token_log_w, axis=-1, keepdims=True), mask.shape)
    log_high = jnp.log(jnp.asarray(high, jnp.float32))
    weights = jnp.exp(jnp.minimum(log_w, log_high))
    if mode == "truncate":
        out_of_band = jnp.zeros_like(mask)
        truncated = mask & (log_w > log_high)
    else:
        log_low = jnp.log(jnp.asarray(low, jnp.float32))
        out_of_band = mask & ((log_w < log_low) | (log_w > log_high))
        truncated = jnp.zeros_like(mask)
        weights = jnp.where(out_of_band, 0.0, weights)
    weights = jnp.where(mask, weights, 0.0)
    metrics = {
        "weight_mean": masked_mean(weights, mask),
        "masked_frac": masked_mean(out_of_band, mask),
        "truncated_frac": masked_mean(truncated, mask),
        "kl_k1": masked_mean(-token_log_w, mask),
        "kl_k3": masked_mean(jnp.expm1(token_log_w) - token_log_w, mask),
    }
    return weights, metrics


def truncated_is_weights(
    trainer_logp_nt: Array, sampler_logp_nt: Array, mask_nt: Array, *, cap: float = 2.0
) -> Array:
    """Truncated importance-sampling weights for sampler/trainer mismatch (TIS).

        w_t = sg(min(pi_trainer(y_t) / pi_sampler(y_t), C)) = sg(exp(min(lp_tr - lp_s, log C)))

    (Yao et al., "Your Efficient RL Framework Secretly Brings You Off-Policy RL
    Training"): the inference engine samples from pi_sampler, which differs numerically
    from the trainer's pi_old; multiplying the per-token policy loss by w corrects the
    gradient, and the cap C bounds its variance. The token-level truncate case of
    `rollout_correction` (which also gives metrics and the masked and sequence variants).

    Args:
      trainer_logp_nt: `[N, T]` log-probs of the sampled tokens under the trainer's
        pi_old (the training engine's forward pass).
      sampler_logp_nt: `[N, T]` log-probs reported by the sampler for the same tokens.
      mask_nt: `[N, T]` real tokens.
      cap: C > 0.

    Returns:
      `[N, T]` float32 weights in [0, C], 0 at masked positions; a stop-gradient constant.

    Examples:
      >>> import jax.numpy as jnp
      >>> import numpy as np
      >>> import grpojax as gj
      >>> t_logp = jnp.log(jnp.array([[0.5, 0.75, 0.9]]))  # the trainer's log-probs
      >>> s_logp = jnp.log(jnp.array([[0.5, 0.5, 0.3]]))  # the sampler's: ratios 1, 1.5, 3
      >>> print(np.round(np.asarray(gj.truncated_is_weights(t_logp, s_logp, jnp.ones((1, 3)))), 4))
      [[1.  1.5 2. ]]
    """
    check_number("cap", cap, minimum=0.0, strict=True)
    weights, _ = rollout_correction(
        trainer_logp_nt, sampler_logp_nt, mask_nt, level="token", mode="truncate", high=cap
    )
    return weights


def truncated_completion_mask(lengths_n: Array, eos_found_n: Array) -> Array:
    """DAPO overlong filtering: keep only completions that ended with their own EOS.

        keep_i = eos_found_i and L_i > 0

    A completion cut at the generation limit without EOS was not judged on a finished
    answer, so its reward is noise; DAPO masks its loss. `eos_found_n` is the authority
    (a completion whose EOS is exactly the last allowed token has L_i = max length and is
    kept); lengths only exclude empty rows (batch padding).

    Args:
      lengths_n: `[N]` integer completion lengths (EOS included when present).
      eos_found_n: `[N]` bool, whether the completion ended with EOS.

    Returns:
      `[N]` bool keep mask; `loss_nt * keep_n[:, None]` drops the truncated ones.

    Examples:
      >>> import jax.numpy as jnp
      >>> import grpojax as gj
      >>> lengths, eos_found = jnp.array([3, 5, 0]), jnp.array([True, False, True])
      >>> print(gj.truncated_completion_mask(lengths, eos_found))
      [ True False False]
    """
    lengths = jnp.asarray(lengths_n)
    eos_found = jnp.asarray(eos_found_n, jnp.bool_)
    if lengths.shape != eos_found.shape:
        raise ValueError(
            f"lengths_n {lengths.shape} and eos_found_n {eos_found.shape} must both be [N]"
        )
    return eos_found & (lengths > 0)


def overlong_penalty(
    lengths_n: Array, *, max_len: int, buffer_len: int, penalty: float = 1.0
) -> Array:
    """DAPO soft overlong punishment, a reward term measured in tokens.

    With L_max = max_len, L_cache = buffer_len, p = penalty and L the length:

        R(L) = 0                                   if L <= L_max - L_cache
             = (L_max - L_cache - L) / L_cache * p  if L_max - L_cache < L <= L_max
             = -p                                   if L > L_max

    The penalty ramps linearly from 0 to -p across the last L_cache tokens (continuous at
    both ends). With buffer_len = 0 it is a hard -p beyond max_len.

    Args:
      lengths_n: `[N]` completion lengths in tokens.
      max_len: L_max > 0.
      buffer_len: 0 <= L_cache <= L_max.
      penalty: p >= 0.

    Returns:
      `[N]` float32 reward to add to the task reward (values in [-p, 0]).

    Examples:
      >>> import jax.numpy as jnp
      >>> import grpojax as gj
      >>> lengths = jnp.array([10, 18, 20, 25])  # the ramp spans 16 < L <= 20
      >>> print(gj.overlong_penalty(lengths, max_len=20, buffer_len=4))
      [ 0.  -0.5 -1.  -1. ]
    """
    # Static: they pick the branches below.
    check_number("max_len", max_len, minimum=0, strict=True, array_ok=False)
    check_number("buffer_len", buffer_len, minimum=0, strict=False, array_ok=False)
    check_number("penalty", penalty, minimum=0.0, strict=False)
    if buffer_len > max_len:
        raise ValueError(f"buffer_len must be <= max_len ({max_len}), got {buffer_len}")
    length = jnp.asarray(lengths_n, jnp.float32)
    start = float(max_len - buffer_len)
    if buffer_len > 0:
        ramp = (start - length) / float(buffer_len) * penalty
    else:
        ramp = jnp.zeros_like(length)
    return jnp.where(
        length <= start, 0.0, jnp.where(length <= max_len, ramp, -jnp.asarray(penalty, jnp.float32))
    ).astype(jnp.float32)


__all__ = [
    "ROLLOUT_LEVELS",
    "ROLLOUT_MODES",
    "off_policy_sequence_mask",
    "overlong_penalty",
    "rollout_correction",
    "truncated_completion_mask",
    "truncated_is_weights",
]
