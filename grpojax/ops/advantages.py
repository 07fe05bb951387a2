"""Advantages and returns: GAE with a critic, group baselines without one, and whitening.

Every function here is pure float32 array math that works under `jit`, `vmap` and `grad`.
Token-level functions (`gae`, `reinforce_pp_returns`) follow the mask rather than the
padding layout: a row may be right padded, left offset (prompt masked out) or have holes
(e.g. tool outputs in a multi-turn rollout); masked positions are skipped by the recursion
and get exactly 0. Sequence-level functions (`group_advantages`, `rloo_advantages`) take
rows grouped contiguously: with `N = B*G`, row `n` belongs to prompt `n // G`.
"""

from __future__ import annotations

import operator

import jax
import jax.numpy as jnp
from jax import Array

from grpojax.ops.checks import check_choice, check_number
from grpojax.ops.masks import masked_mean, masked_sum, masked_var

_SCALES = ("group", "batch", "none")
_STDS = ("population", "unbiased")


def _as_mask(mask, shape) -> Array:
    return jnp.broadcast_to(jnp.asarray(mask, jnp.bool_), shape)


def _safe_sqrt(x: Array) -> Array:
    # sqrt has an infinite derivative at 0; all-equal groups would give NaN gradients.
    positive = x > 0
    return jnp.where(positive, jnp.sqrt(jnp.where(positive, x, 1.0)), 0.0)


def _reverse_masked_gae(rewards, values, mask, *, gamma, lam) -> Array:
    """Masked GAE along the last axis; masked steps are skipped, not treated as terminal."""

    def step(carry, x):
        next_value, next_adv = carry
        r_t, v_t, m_t = x
        delta = r_t + gamma * next_value - v_t
        adv = delta + gamma * lam * next_adv
        carry = (jnp.where(m_t, v_t, next_value), jnp.where(m_t, adv, next_adv))
        return carry, jnp.where(m_t, adv, 0.0)

    batch_shape = rewards.shape[:-1]
    init = (jnp.zeros(batch_shape, jnp.float32), jnp.zeros(batch_shape, jnp.float32))
    xs = tuple(jnp.moveaxis(a, -1, 0) for a in (rewards, values, mask))
    _, adv_tn = jax.lax.scan(step, init, xs, reverse=True)
    return jnp.moveaxis(adv_tn, 0, -1)


def last_token_mask(mask_nt: Array) -> Array:
    """Boolean `[N, T]`, true only at the last real (masked-in) token of each row.

    Found from the mask, so it is right for right padding and for left offsets alike. A row
    with no real token has no true entry.

    Args:
      mask_nt: `[N, T]` bool or {0, 1} mask of real tokens.
    """
    m = jnp.asarray(mask_nt, jnp.bool_)
    t = m.shape[-1]
    last = t - 1 - jnp.argmax(m[..., ::-1], axis=-1)
    return (jnp.arange(t) == last[..., None]) & jnp.any(m, axis=-1, keepdims=True)


def gae(
    rewards_nt: Array, values_nt: Array, mask_nt: Array, *, gamma: float, lam: float
) -> tuple[Array, Array]:
    """Generalized advantage estimation (Schulman et al. 2016) over masked token rows.

    Time-index convention: position `t` is the token `a_t` emitted in state `s_t` (prompt
    plus the tokens before `t`). `values_nt[n, t] = V(s_t)` is the critic's value before
    emitting token `t`; `rewards_nt[n, t] = r_t` is the reward received for emitting it
    (with outcome rewards, the score sits on the last real token). For each row, with `t'`
    the next real token after `t` (the next `t' > t` with `mask[t'] = 1`):

        delta_t = r_t + gamma * V_{t'} - V_t
        A_t     = delta_t + gamma * lam * A_{t'}
        R_t     = A_t + V_t                      (the critic's regression target)

    After the last real token the episode has ended: `V_{t'} = A_{t'} = 0`. For a contiguous
    mask this is `delta_t = r_t + gamma * V_{t+1} * m_{t+1} - V_t` and
    `A_t = delta_t + gamma * lam * m_{t+1} * A_{t+1}`; a hole in the mask is skipped (the
    discount is applied once per real token). Rewards and values at masked positions are
    ignored and both outputs are 0 there. Computed with a reverse `lax.scan`.

    Args:
      rewards_nt: `[N, T]` per-token rewards.
      values_nt: `[N, T]` critic values `V(s_t)`.
      mask_nt: `[N, T]` bool or {0, 1} mask of real (trained) tokens.
      gamma: discount in [0, 1].
      lam: GAE lambda in [0, 1]; `lam = 1` gives Monte Carlo returns minus values,
        `lam = 0` the one-step TD error.

    Returns:
      `(adv_nt, returns_nt)`, both `[N, T]` float32.
    """
    check_number("gamma", gamma, minimum=0.0, maximum=1.0)
    check_number("lam", lam, minimum=0.0, maximum=1.0)
    rewards = jnp.asarray(rewards_nt, jnp.float32)
    values = jnp.asarray(values_nt, jnp.float32)
    if rewards.shape != values.shape:
        raise ValueError(
            f"rewards_nt and values_nt must have the same shape, got {rewards.shape} and "
            f"{values.shape}"
        )
    if rewards.ndim < 1:
        raise ValueError("rewards_nt must have a token axis, got a scalar")
    mask = _as_mask(mask_nt, rewards.shape)
    rewards = jnp.where(mask, rewards, 0.0)
    values = jnp.where(mask, values, 0.0)
    adv = _reverse_masked_gae(rewards, values, mask, gamma=gamma, lam=lam)
    returns = jnp.where(mask, adv + values, 0.0)
    return adv, returns


def reinforce_pp_returns(token_rewards_nt: Array, mask_nt: Array, *, gamma: float) -> Array:
    """Discounted reward-to-go over real tokens (REINFORCE / REINFORCE++ returns).

        G_t = r_t + gamma * G_{t'}        (t' the next real token; 0 after the last one)

    i.e. `G_t = sum_{k >= t, real} gamma^(number of real tokens in [t, k) ) * r_k`. This is
    `gae` with zero values and `lam = 1`. Rewards at masked positions are ignored; the
    output is 0 there.

    Args:
      token_rewards_nt: `[N, T]` per-token rewards (e.g. the score on the last token plus
        `-beta * KL_t` on every token, see `grpojax.ops.kl.kl_penalty_rewards`).
      mask_nt: `[N, T]` mask of real tokens.
      gamma: discount in [0, 1].

    Returns:
      `[N, T]` float32 returns.
    """
    check_number("gamma", gamma, minimum=0.0, maximum=1.0)
    rewards = jnp.asarray(token_rewards_nt, jnp.float32)
    if rewards.ndim < 1:
        raise ValueError("token_rewards_nt must have a token axis, got a scalar")
    mask = _as_mask(mask_nt, rewards.shape)
    rewards = jnp.where(mask, rewards, 0.0)
    return _reverse_masked_gae(rewards, jnp.zeros_like(rewards), mask, gamma=gamma, lam=1.0)


def _grouped(rewards_n, mask_n, group_size, why: str) -> tuple[Array, Array]:
    """Reshape `[N]` rewards and mask to `[B, G]`, validating the grouping."""
    rewards = jnp.asarray(rewards_n, jnp.float32)
    if rewards.ndim != 1:
        raise ValueError(f"rewards_n must be 1-D [N], got shape {rewards.shape}")
    try:
        group_size = operator.index(group_size)  # static: it fixes the [B, G] shape
    except TypeError:
        raise ValueError(f"group_size must be a static integer, got {group_size!r}") from None
    if group_size < 2:
        raise ValueError(
            f"group_size must be >= 2, got {group_size}: {why} (for a batch-level baseline "
            "use whiten or reinforce_pp_returns)"
        )
    n = rewards.shape[0]
    if n % group_size:
        raise ValueError(
            f"number of rows N={n} is not divisible by group_size={group_size} "
            "(rows must be grouped contiguously, N = B*G)"
        )
    if mask_n is None:
        mask = jnp.ones(rewards.shape, jnp.bool_)
    else:
        mask = jnp.asarray(mask_n, jnp.bool_)
        if mask.shape != rewards.shape:
            raise ValueError(f"mask_n must have shape {rewards.shape}, got {mask.shape}")
    shape = (n // group_size, group_size)
    return rewards.reshape(shape), mask.reshape(shape)


def _all_equal(r_bg: Array, m_bg: Array) -> Array:
    """`[B, 1]` true where every valid reward of the group is the same value."""
    hi = jnp.max(jnp.where(m_bg, r_bg, -jnp.inf), axis=1, keepdims=True)
    lo = jnp.min(jnp.where(m_bg, r_bg, jnp.inf), axis=1, keepdims=True)
    return hi == lo


def group_advantages(
    rewards_n: Array,
    *,
    group_size: int,
    scale: str = "group",
    eps: float = 1e-6,
    std: str = "population",
    mask_n: Array | None = None,
) -> Array:
    """Group-relative advantages (GRPO and its variants), one per sequence.

    Rows are grouped contiguously: row `n` is sample `n % G` of prompt `n // G`. With
    `mean_g` the mean reward of the row's group:

        scale="group":  A_n = (r_n - mean_g) / (std_g + eps)      GRPO (DeepSeekMath)
        scale="batch":  A_n = (r_n - mean_g) / (std_batch + eps)  group mean, batch std
        scale="none":   A_n =  r_n - mean_g                       Dr.GRPO (no division)

    `std_g` is the std of the group's rewards; `std_batch` the std of all (valid) rewards in
    the batch, as in TRL's `scale_rewards="batch"`. `std="population"` divides the variance
    by the count, `std="unbiased"` by count - 1 (the unbiased one is larger by
    `sqrt(G / (G - 1))`). A group whose valid rewards are all equal gets exactly 0, never
    NaN, even though float32 `r - mean` need not be exactly 0 there.

    Example: rewards [1.0, 0.8, 0.4, 0.2], one group, population std 0.316, give
    approximately [1.26, 0.63, -0.63, -1.26].

    Args:
      rewards_n: `[N]` sequence rewards, `N = B*G`.
      group_size: `G` (static), >= 2. `G = 1` raises: every advantage would be 0.
      scale: "group", "batch" or "none".
      eps: added to the std before dividing, >= 0.
      std: "population" or "unbiased".
      mask_n: optional `[N]` bool, false for samples to drop (e.g. a failed reward call);
        they are left out of every statistic and get advantage 0.

    Returns:
      `[N]` float32 advantages.
    """
    check_choice("scale", scale, _SCALES)
    check_choice("std", std, _STDS)
    if isinstance(eps, int | float) and eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    r_bg, m_bg = _grouped(
        rewards_n, mask_n, group_size, "a lone sample is its own group mean, so A would be 0"
    )
    unbiased = std == "unbiased"
    mean_b1 = masked_mean(r_bg, m_bg, axis=1)[:, None]
    zero = _all_equal(r_bg, m_bg) | ~m_bg
    centered = jnp.where(zero, 0.0, r_bg - mean_b1)
    if scale == "none":
        adv = centered
    else:
        if scale == "group":
            var = masked_var(r_bg, m_bg, axis=1, unbiased=unbiased)[:, None]
        else:
            var = masked_var(r_bg, m_bg, unbiased=unbiased)
        denom = _safe_sqrt(var) + eps
        # denom is 0 only when eps = 0 and the rewards are all equal, where centered is 0.
        adv = centered / jnp.where(denom > 0, denom, 1.0)
    return adv.reshape(-1)


def rloo_advantages(rewards_n: Array, *, group_size: int, mask_n: Array | None = None) -> Array:
    """REINFORCE leave-one-out advantages (Kool et al. 2019; Ahmadian et al. 2024).

        A_n = r_n - 1/(G-1) * sum_{m in group(n), m != n} r_m  =  G/(G-1) * (r_n - mean_g)

    Rows are grouped contiguously (row `n` belongs to prompt `n // G`). With `mask_n`, the
    baseline is the mean of the other *valid* samples of the group; invalid samples, and
    groups with fewer than 2 valid samples, get 0. All-equal groups get exactly 0.

    Args:
      rewards_n: `[N]` sequence rewards, `N = B*G`.
      group_size: `G` (static), >= 2 (a leave-one-out baseline needs another sample).
      mask_n: optional `[N]` bool of valid samples.

    Returns:
      `[N]` float32 advantages.
    """
    r_bg, m_bg = _grouped(
        rewards_n, mask_n, group_size, "a leave-one-out baseline needs another sample"
    )
    count_b1 = masked_sum(jnp.ones_like(r_bg), m_bg, axis=1)[:, None]
    total_b1 = masked_sum(r_bg, m_bg, axis=1)[:, None]
    others = jnp.where(count_b1 > 1, count_b1 - 1.0, 1.0)
    adv = r_bg - (total_b1 - r_bg) / others
    zero = _all_equal(r_bg, m_bg) | ~m_bg | (count_b1 < 2)
    return jnp.where(zero, 0.0, adv).reshape(-1)


def whiten(
    x: Array, mask: Array, *, shift_mean: bool = True, eps: float = 1e-8, unbiased: bool = False
) -> Array:
    """Masked whitening over all masked-in entries (global batch statistics).

        y = (x - mean) / sqrt(var + eps)            shift_mean=True
        y = (x - mean) / sqrt(var + eps) + mean     shift_mean=False (TRL/verl masked_whiten)

    `mean` and `var` are over the entries where `mask` is true; entries where it is false
    come out as 0. `unbiased=False` is the population variance (OpenRLHF's advantage
    normalisation); TRL's and verl's `masked_whiten` use `unbiased=True`. Under `jit` with a
    sharded input the statistics are over the whole global array.

    Args:
      x: any shape, e.g. `[N, T]` advantages.
      mask: bool or {0, 1}, broadcastable to `x`.
      shift_mean: keep the result centred (True) or add the mean back (False).
      eps: > 0, added to the variance.
      unbiased: divide the variance by count - 1 instead of count.

    Returns:
      float32 array shaped like `x`.
    """
    if isinstance(eps, int | float) and eps <= 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    x = jnp.asarray(x, jnp.float32)
    m = _as_mask(mask, x.shape)
    mean = masked_mean(x, m)
    var = masked_var(x, m, unbiased=unbiased)
    y = (x - mean) * jax.lax.rsqrt(var + eps)
    if not shift_mean:
        y = y + mean
    return jnp.where(m, y, 0.0)


def reinforce_pp_baseline_advantages(
    rewards_n: Array,
    mask_nt: Array,
    *,
    group_size: int,
    token_rewards_nt: Array | None = None,
    mask_n: Array | None = None,
    eps: float = 1e-8,
) -> Array:
    """REINFORCE++-baseline token advantages, as OpenRLHF's `reinforce_baseline` estimator.

    1. Subtract the group mean (no std division):  s_n = r_n - mean_g   (as Dr.GRPO)
    2. Per-token rewards: `s_n` on the last real token of row `n`, plus `token_rewards_nt`
       (e.g. `-beta * KL_t` from `kl_penalty_rewards` with zero scores) on every real token.
    3. Undiscounted reward-to-go (OpenRLHF forces gamma = 1 for this estimator):
       `G_t = sum_{k >= t, real} token_reward_k`; without token rewards `G_t = s_n` on
       every real token, i.e. the sequence advantage broadcast to its tokens.
    4. Whiten globally over all real tokens of the batch (population variance):
       `A_t = (G_t - mean) / sqrt(var + eps)`. Longer sequences therefore weigh more in
       the statistics, as in OpenRLHF.

    Differences from OpenRLHF: padded positions and invalid samples are 0 (OpenRLHF leaves
    `(0 - mean) * rstd` there, ignored later by the loss mask); the variance gets `+ eps`
    rather than being clamped below at `eps` (identical unless var < eps).

    Args:
      rewards_n: `[N]` sequence rewards, `N = B*G`, grouped contiguously.
      mask_nt: `[N, T]` mask of real completion tokens (may have a left offset).
      group_size: `G` (static), >= 2.
      token_rewards_nt: optional `[N, T]` extra per-token rewards.
      mask_n: optional `[N]` valid samples; invalid ones are excluded from the group means
        and the whitening statistics and get 0.
      eps: > 0, added to the variance when whitening.

    Returns:
      `[N, T]` float32 advantages.
    """
    centered_n = group_advantages(rewards_n, group_size=group_size, scale="none", mask_n=mask_n)
    mask = jnp.asarray(mask_nt, jnp.bool_)
    if mask.ndim != 2 or mask.shape[0] != centered_n.shape[0]:
        raise ValueError(f"mask_nt must be [N, T] with N={centered_n.shape[0]}, got {mask.shape}")
    if mask_n is not None:
        mask = mask & jnp.asarray(mask_n, jnp.bool_)[:, None]
    token_rewards = jnp.where(last_token_mask(mask), centered_n[:, None], 0.0)
    if token_rewards_nt is not None:
        extra = jnp.asarray(token_rewards_nt, jnp.float32)
        if extra.shape != mask.shape:
            raise ValueError(f"token_rewards_nt must have shape {mask.shape}, got {extra.shape}")
        token_rewards = token_rewards + extra
    returns = reinforce_pp_returns(token_rewards, mask, gamma=1.0)
    return whiten(returns, mask, eps=eps)
