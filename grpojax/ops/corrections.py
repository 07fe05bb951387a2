"""Off-policy and length corrections applied around the policy loss.

Masks and weights that decide which samples train and how much: DeepSeek-V3.2's
off-policy sequence masking, truncated importance sampling between the sampler and the
trainer (Yao et al.), and DAPO's overlong filtering and soft overlong punishment. None of
them carries gradient: they are constants multiplied into the per-token loss (or, for
the penalty, added to the reward).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import Array

from grpojax.ops.checks import check_number
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
    """
    check_number("delta", delta, minimum=0.0, strict=False)
    logp = jax.lax.stop_gradient(jnp.asarray(logp_nt, jnp.float32))
    old_logp = jax.lax.stop_gradient(jnp.asarray(old_logp_nt, jnp.float32))
    mask = jnp.broadcast_to(jnp.asarray(mask_nt, jnp.bool_), logp.shape)
    adv = jnp.asarray(advantages_n, jnp.float32)
    if adv.shape != logp.shape[:-1]:
        raise ValueError(f"advantages_n must have shape {logp.shape[:-1]} ([N]), got {adv.shape}")
    kl_n = masked_mean(jnp.where(mask, old_logp - logp, 0.0), mask, axis=-1)
    return ~((adv < 0) & (kl_n > delta))


def truncated_is_weights(
    trainer_logp_nt: Array, sampler_logp_nt: Array, mask_nt: Array, *, cap: float = 2.0
) -> Array:
    """Truncated importance-sampling weights for sampler/trainer mismatch (TIS).

        w_t = sg(min(pi_trainer(y_t) / pi_sampler(y_t), C)) = sg(exp(min(lp_tr - lp_s, log C)))

    (Yao et al., "Your Efficient RL Framework Secretly Brings You Off-Policy RL
    Training"): the inference engine samples from pi_sampler, which differs numerically
    from the trainer's pi_old; multiplying the per-token policy loss by w corrects the
    gradient, and the cap C bounds its variance. Computed as exp of a capped log-ratio so
    huge mismatches cannot overflow.

    Args:
      trainer_logp_nt: `[N, T]` log-probs of the sampled tokens under the trainer's
        pi_old (the training engine's forward pass).
      sampler_logp_nt: `[N, T]` log-probs reported by the sampler for the same tokens.
      mask_nt: `[N, T]` real tokens.
      cap: C > 0.

    Returns:
      `[N, T]` float32 weights in [0, C], 0 at masked positions; a stop-gradient constant.
    """
    check_number("cap", cap, minimum=0.0, strict=True)
    trainer = jnp.asarray(trainer_logp_nt, jnp.float32)
    sampler = jnp.asarray(sampler_logp_nt, jnp.float32)
    mask = jnp.broadcast_to(jnp.asarray(mask_nt, jnp.bool_), trainer.shape)
    log_ratio = jnp.where(mask, trainer - sampler, 0.0)
    weights = jnp.exp(jnp.minimum(log_ratio, jnp.log(jnp.asarray(cap, jnp.float32))))
    return jax.lax.stop_gradient(jnp.where(mask, weights, 0.0))


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
    "off_policy_sequence_mask",
    "overlong_penalty",
    "truncated_completion_mask",
    "truncated_is_weights",
]
