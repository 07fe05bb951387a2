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
from grpojax.ops.sharding import in_auto_mode, leading_spec

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

    # zeros_like keeps the batch axes' sharding: on an Explicit mesh a replicated carry
    # next to a sharded one would make the scan body's selects disagree on sharding.
    zero = jnp.zeros_like(rewards[..., 0])
    init = (zero, zero)
    xs = tuple(jnp.moveaxis(a, -1, 0) for a in (rewards, values, mask))
    _, adv_tn = jax.lax.scan(step, init, xs, reverse=True)
    return jnp.moveaxis(adv_tn, 0, -1)


def last_token_mask(mask_nt: Array) -> Array:
    """Boolean `[N, T]`, true only at the last real (masked-in) token of each row.

    Found from the mask, so it is right for right padding and for left offsets alike. A row
    with no real token has no true entry.

    Args:
      mask_nt: `[N, T]` bool or {0, 1} mask of real tokens.

    Examples:
      >>> import jax.numpy as jnp
      >>> import grpojax as gj
      >>> print(gj.last_token_mask(jnp.array([[1, 1, 0], [0, 1, 1]])))
      [[False  True False]
       [False False  True]]
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

    Examples:
      >>> import jax.numpy as jnp
      >>> import grpojax as gj
      >>> rewards, values = jnp.array([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]]), jnp.full((2, 3), 0.5)
      >>> mask = jnp.array([[1, 1, 1], [1, 1, 0]])
      >>> adv, returns = gj.gae(rewards, values, mask, gamma=1.0, lam=0.5)
      >>> print(adv)  # last real token: delta = 1 - 0.5; before it delta = 0, A_t = 0.5 A_{t'}
      [[0.125 0.25  0.5  ]
       [0.25  0.5   0.   ]]
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

    Examples:
      >>> import jax.numpy as jnp
      >>> import grpojax as gj
      >>> rewards = jnp.array([[0.0, 0.0, 1.0], [1.0, 0.0, 2.0]])
      >>> mask = jnp.array([[1, 1, 1], [1, 1, 0]])  # the 2.0 is padding: ignored
      >>> print(gj.reinforce_pp_returns(rewards, mask, gamma=0.5))
      [[0.25 0.5  1.  ]
       [1.   0.   0.  ]]
    """
    check_number("gamma", gamma, minimum=0.0, maximum=1.0)
    rewards = jnp.asarray(token_rewards_nt, jnp.float32)
    if rewards.ndim < 1:
        raise ValueError("token_rewards_nt must have a token axis, got a scalar")
    mask = _as_mask(mask_nt, rewards.shape)
    rewards = jnp.where(mask, rewards, 0.0)
    return _reverse_masked_gae(rewards, jnp.zeros_like(rewards), mask, gamma=gamma, lam=1.0)


def _check_group_size(group_size, why: str) -> int:
    try:
        group_size = operator.index(group_size)  # static: it fixes the [B, G] shape
    except TypeError:
        raise ValueError(f"group_size must be a static integer, got {group_size!r}") from None
    if group_size < 2:
        raise ValueError(
            f"group_size must be >= 2, got {group_size}: {why} (for a batch-level baseline "
            "use whiten or reinforce_pp_returns)"
        )
    return group_size


def _per_group(fn, rewards_n, mask_n, *, group_size, why: str, extra_n=(), columns=False):
    """Apply `fn(r_bg, m_bg, *extra_bg) -> [B, G]` to contiguous groups and return `[N]` f32.

    `rewards_n` is `[N]` (with `columns`, `[N, R]`: one column per reward function, giving
    `r_bg` of shape `[B, G, R]`); `mask_n` is None or `[N]` bool (valid samples); each
    `extra_n` array is `[N, ...]` and arrives reshaped to `[B, G, ...]`. Row `n` is sample
    `n % G` of prompt `n // G`. The regrouping crosses shard boundaries when `B` does not
    divide by the number of shards, so on an Explicit mesh the body runs in auto mode; the
    result keeps the sharding of `rewards_n`'s first axis.
    """
    rewards = jnp.asarray(rewards_n, jnp.float32)
    if rewards.ndim != 1 + columns:
        expected = "rewards_nr must be 2-D [N, R]" if columns else "rewards_n must be 1-D [N]"
        raise ValueError(f"{expected}, got shape {rewards.shape}")
    group_size = _check_group_size(group_size, why)
    n = rewards.shape[0]
    if n % group_size:
        raise ValueError(
            f"number of rows N={n} is not divisible by group_size={group_size} "
            "(rows must be grouped contiguously, N = B*G)"
        )
    if mask_n is None:
        mask = jnp.ones((n,), jnp.bool_)
    else:
        mask = jnp.asarray(mask_n, jnp.bool_)
        if mask.shape != (n,):
            raise ValueError(f"mask_n must have shape {(n,)}, got {mask.shape}")
    extra = tuple(jnp.asarray(e) for e in extra_n)
    for e in extra:
        if e.ndim < 1 or e.shape[0] != n:
            raise ValueError(f"every per-sample input must have N={n} rows, got {e.shape}")
    groups = (n // group_size, group_size)

    def run(r, m, *ex):
        out_bg = fn(
            r.reshape(groups + r.shape[1:]),
            m.reshape(groups),
            *(e.reshape(groups + e.shape[1:]) for e in ex),
        )
        return out_bg.reshape(n)

    return in_auto_mode(run, leading_spec(rewards, 1), rewards, mask, *extra)


def _all_equal(r_bg: Array, m_bg: Array) -> Array:
    """`[B, 1]` true where every valid reward of the group (last axis) is the same value."""
    hi = jnp.max(jnp.where(m_bg, r_bg, -jnp.inf), axis=-1, keepdims=True)
    lo = jnp.min(jnp.where(m_bg, r_bg, jnp.inf), axis=-1, keepdims=True)
    return hi == lo


def _centered(r_bg: Array, m_bg: Array) -> tuple[Array, Array, Array]:
    """(r - group mean, group mean `[B, 1]`, `zero`): `zero` marks samples whose advantage is
    exactly 0 in every group estimator (invalid, or in a group whose valid rewards are all
    equal, where float32 `r - mean` need not be exactly 0). Groups are the last axis."""
    mean_b1 = masked_mean(r_bg, m_bg, axis=-1)[..., None]
    zero = _all_equal(r_bg, m_bg) | ~m_bg
    return jnp.where(zero, 0.0, r_bg - mean_b1), mean_b1, zero


def _divide(x: Array, denom: Array) -> Array:
    """x / denom, and 0 where denom is 0 (there x is 0 in every caller: an all-equal group)."""
    ok = denom != 0
    return jnp.where(ok, x / jnp.where(ok, denom, 1.0), 0.0)


def _group_normalized(r_bg, m_bg, *, scale, eps, unbiased) -> Array:
    """GRPO's (r - mean_g) / (std + eps) over the last axis (see `group_advantages`)."""
    centered, _, _ = _centered(r_bg, m_bg)
    if scale == "none":
        return centered
    if scale == "group":
        var = masked_var(r_bg, m_bg, axis=-1, unbiased=unbiased)[..., None]
    else:
        var = masked_var(r_bg, m_bg, unbiased=unbiased)
    return _divide(centered, _safe_sqrt(var) + eps)


def _check_eps(eps) -> None:
    check_number("eps", eps, minimum=0.0)


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

    For example, rewards [1.0, 0.8, 0.4, 0.2], one group, population std 0.316, give
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

    Examples:
      >>> import jax.numpy as jnp
      >>> import numpy as np
      >>> import grpojax as gj
      >>> rewards = jnp.array([1.0, 0.0, 0.5, 0.5])  # two prompts, G = 2 samples each
      >>> adv = gj.group_advantages(rewards, group_size=2)
      >>> print(np.round(np.asarray(adv), 4))  # (r - 0.5) / 0.5, and 0 for equal rewards
      [ 1. -1.  0.  0.]
    """
    check_choice("scale", scale, _SCALES)
    check_choice("std", std, _STDS)
    _check_eps(eps)
    unbiased = std == "unbiased"

    def fn(r_bg, m_bg):
        return _group_normalized(r_bg, m_bg, scale=scale, eps=eps, unbiased=unbiased)

    why = "a lone sample is its own group mean, so A would be 0"
    return _per_group(fn, rewards_n, mask_n, group_size=group_size, why=why)


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

    Examples:
      >>> import jax.numpy as jnp
      >>> import grpojax as gj
      >>> rewards = jnp.array([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])  # two prompts, G = 3
      >>> print(gj.rloo_advantages(rewards, group_size=3))  # r_n - mean of the other two
      [ 1.  -0.5 -0.5  0.   0.   0. ]
    """

    def fn(r_bg, m_bg):
        count_b1 = masked_sum(jnp.ones_like(r_bg), m_bg, axis=1)[:, None]
        total_b1 = masked_sum(r_bg, m_bg, axis=1)[:, None]
        others = jnp.where(count_b1 > 1, count_b1 - 1.0, 1.0)
        adv = r_bg - (total_b1 - r_bg) / others
        zero = _all_equal(r_bg, m_bg) | ~m_bg | (count_b1 < 2)
        return jnp.where(zero, 0.0, adv)

    why = "a leave-one-out baseline needs another sample"
    return _per_group(fn, rewards_n, mask_n, group_size=group_size, why=why)


def _falling_ratio(a: Array, b: Array, j: int) -> Array:
    """prod_{i < j} (a - i) / (b - i) = C(a, j) / C(b, j) for integers 0 <= j, j <= b (float).

    Exactly 0 when 0 <= a < j (one factor is 0); 1 when j = 0. Denominators below 1 (only
    where the caller discards the result) are replaced by 1.
    """
    out = jnp.ones_like(a)
    for i in range(j):
        out = out * (a - i) / jnp.maximum(b - i, 1.0)
    return out


def pass_at_k_advantages(
    rewards_n: Array,
    *,
    group_size: int,
    k: int,
    eps: float = 1e-6,
    mask_n: Array | None = None,
) -> Array:
    """Pass@k advantages for binary rewards, in closed form (Pass@k Training, arXiv 2508.10751).

    The objective is the pass@k of the group: draw every k-subset of the group's `n` samples,
    score a subset 1 if it holds a correct sample, normalise the subset scores GRPO-style and
    give each sample the mean advantage of the subsets containing it. With `n_neg` incorrect
    samples in the group, counted with binomials C(., .):

        mean_R = 1 - C(n_neg, k) / C(n, k)          (the group's pass@k)
        std_R  = sqrt(mean_R (1 - mean_R))           (subset scores are 0/1)
        A_pos  = (1 - mean_R) / (std_R + eps)                                  correct sample
        A_neg  = (1 - mean_R - C(n_neg - 1, k - 1) / C(n - 1, k - 1)) / (std_R + eps)   incorrect

    (every subset holding a correct sample scores 1; a given incorrect sample lies in
    C(n - 1, k - 1) subsets, C(n_neg - 1, k - 1) of them all incorrect). With `k = 1` this
    is GRPO with the population std. Groups whose pass@k is 0 or 1 (all incorrect, or fewer
    than `k` incorrect samples) carry no signal and get exactly 0.

    Rewards are binary: a sample counts as correct when its reward is > 0.5 (so 0/1 and -1/1
    rewards both work). Rows are grouped contiguously (row `n` belongs to prompt `n // G`).
    Not differentiable in the rewards (the counts are step functions).

    Args:
      rewards_n: `[N]` binary rewards, `N = B*G`.
      group_size: `G` (static), >= 2.
      k: static integer, 1 <= k <= G.
      eps: >= 0, added to std_R.
      mask_n: optional `[N]` bool of valid samples: invalid ones are left out of the counts
        (`n` is the number of valid samples of the group) and get 0; a group with fewer than
        `k` valid samples gets 0.

    Returns:
      `[N]` float32 advantages.

    Examples:
      >>> import jax.numpy as jnp
      >>> import numpy as np
      >>> import grpojax as gj
      >>> rewards = jnp.array([1.0, 0.0, 0.0, 0.0])  # n = 4, n_neg = 3: mean_R = 1 - 3/6, std_R 0.5
      >>> print(np.round(np.asarray(gj.pass_at_k_advantages(rewards, group_size=4, k=2)), 4))
      [ 1.     -0.3333 -0.3333 -0.3333]
    """
    _check_eps(eps)
    try:
        k = operator.index(k)
    except TypeError:
        raise ValueError(f"k must be a static integer, got {k!r}") from None
    if not 1 <= k <= _check_group_size(group_size, "pass@k needs a group"):
        raise ValueError(f"k must be in [1, group_size={group_size}], got {k}")

    def fn(r_bg, m_bg):
        correct = m_bg & (r_bg > 0.5)
        n = jnp.sum(m_bg, axis=-1, keepdims=True, dtype=jnp.float32)
        n_neg = jnp.sum(m_bg & ~correct, axis=-1, keepdims=True, dtype=jnp.float32)
        mean_r = 1.0 - _falling_ratio(n_neg, n, k)
        std_r = _safe_sqrt(mean_r * (1.0 - mean_r))
        all_neg_given_neg = _falling_ratio(n_neg - 1.0, n - 1.0, k - 1)
        adv = jnp.where(correct, 1.0 - mean_r, 1.0 - mean_r - all_neg_given_neg)
        zero = ~m_bg | (n < k) | (std_r == 0)
        return jnp.where(zero, 0.0, _divide(adv, std_r + eps))

    why = "pass@k needs a group"
    return _per_group(fn, rewards_n, mask_n, group_size=group_size, why=why)


def opo_advantages(
    rewards_n: Array, lengths_n: Array, *, group_size: int, mask_n: Array | None = None
) -> Array:
    """OPO advantages: the reward minus the length-weighted group mean (On-Policy RL with
    Optimal reward baseline, Hao et al. 2025, arXiv 2505.23585).

        b_g = sum_{j in g} l_j r_j / sum_{j in g} l_j,      A_n = r_n - b_g

    With a sequence-level reward and a gradient summed over tokens, this baseline minimises
    the gradient variance (the optimal baseline when the per-token score norms are about
    equal). Groups whose valid rewards are all equal, or whose valid lengths sum to 0, get
    exactly 0. Rows are grouped contiguously (row `n` belongs to prompt `n // G`).

    Args:
      rewards_n: `[N]` sequence rewards, `N = B*G`.
      lengths_n: `[N]` completion lengths in tokens (>= 0).
      group_size: `G` (static), >= 2.
      mask_n: optional `[N]` bool of valid samples; invalid ones are left out of the
        baseline and get 0.

    Returns:
      `[N]` float32 advantages.

    Examples:
      >>> import jax.numpy as jnp
      >>> import grpojax as gj
      >>> rewards, lengths = jnp.array([1.0, 0.0, 1.0, 1.0]), jnp.array([1, 3, 2, 2])
      >>> print(gj.opo_advantages(rewards, lengths, group_size=2))  # b = (1 * 1 + 3 * 0) / 4
      [ 0.75 -0.25  0.    0.  ]
    """

    def fn(r_bg, m_bg, l_bg):
        length = jnp.where(m_bg, l_bg.astype(jnp.float32), 0.0)
        total_b1 = jnp.sum(length, axis=-1, keepdims=True)
        baseline = _divide(masked_sum(length * r_bg, m_bg, axis=-1)[..., None], total_b1)
        zero = _all_equal(r_bg, m_bg) | ~m_bg | (total_b1 <= 0)
        return jnp.where(zero, 0.0, r_bg - baseline)

    why = "a lone sample is its own baseline"
    return _per_group(fn, rewards_n, mask_n, group_size=group_size, why=why, extra_n=(lengths_n,))


def gpg_advantages(
    rewards_n: Array, *, group_size: int, f_norm: float = 1.0, mask_n: Array | None = None
) -> Array:
    """GPG advantages (Group Policy Gradient, Chu et al. 2025, arXiv 2504.02546).

        A_n = alpha * (r_n - mean_g) / F_norm,        alpha = B / (B - M)

    where B is the number of (valid) samples in the batch and M the number of them in groups
    whose valid rewards are all equal (their advantage is 0, so they carry no gradient);
    alpha rescales the batch's gradient as if only the informative samples were in it.
    `F_norm = 1` is the paper's default (it also allows the group std). If no group is
    informative every advantage is 0. Rows are grouped contiguously (row `n` belongs to
    prompt `n // G`). GPG pairs these advantages with the plain policy gradient
    `-A log pi`, i.e. `policy_loss` / CISPO at ratio 1.

    Args:
      rewards_n: `[N]` sequence rewards, `N = B*G`.
      group_size: `G` (static), >= 2.
      f_norm: F_norm > 0 (a number or a 0-d array).
      mask_n: optional `[N]` bool of valid samples; invalid ones are left out of the group
        means and of B and M, and get 0.

    Returns:
      `[N]` float32 advantages.

    Examples:
      >>> import jax.numpy as jnp
      >>> import grpojax as gj
      >>> rewards = jnp.array([1.0, 0.0, 1.0, 1.0])  # 2 of 4 samples informative: alpha = 2
      >>> print(gj.gpg_advantages(rewards, group_size=2))
      [ 1. -1.  0.  0.]
    """
    check_number("f_norm", f_norm, minimum=0.0, strict=True)

    def fn(r_bg, m_bg):
        centered, _, _ = _centered(r_bg, m_bg)
        informative = m_bg & ~_all_equal(r_bg, m_bg)
        n_valid = jnp.sum(m_bg, dtype=jnp.float32)
        alpha = _divide(n_valid, jnp.sum(informative, dtype=jnp.float32))
        return alpha * centered / jnp.asarray(f_norm, jnp.float32)

    why = "a lone sample is its own group mean, so A would be 0"
    return _per_group(fn, rewards_n, mask_n, group_size=group_size, why=why)


def maxrl_advantages(
    rewards_n: Array, *, group_size: int, eps: float = 1e-6, mask_n: Array | None = None
) -> Array:
    """MaxRL advantages (Maximum Likelihood RL, Tajwar et al. 2026, arXiv 2602.02710).

        A_n = (r_n - mean_g) / (mean_g + eps)

    For binary rewards `mean_g` estimates the success probability p of the prompt, and
    dividing by it turns the policy gradient of p into that of log p (maximum likelihood of
    a correct answer), which up-weights hard prompts. Meant for rewards in {0, 1} (the
    paper's setting); groups whose valid rewards are all equal (including all failures,
    mean 0) get exactly 0. Rows are grouped contiguously (row `n` belongs to prompt
    `n // G`).

    Args:
      rewards_n: `[N]` rewards in [0, 1], `N = B*G`.
      group_size: `G` (static), >= 2.
      eps: >= 0, added to the group mean.
      mask_n: optional `[N]` bool of valid samples; invalid ones are left out of the group
        means and get 0.

    Returns:
      `[N]` float32 advantages.

    Examples:
      >>> import jax.numpy as jnp
      >>> import numpy as np
      >>> import grpojax as gj
      >>> rewards = jnp.array([1.0, 0.0, 0.0, 0.0])  # mean_g = 0.25
      >>> print(np.round(np.asarray(gj.maxrl_advantages(rewards, group_size=4)), 4))
      [ 3. -1. -1. -1.]
    """
    _check_eps(eps)

    def fn(r_bg, m_bg):
        centered, mean_b1, _ = _centered(r_bg, m_bg)
        return _divide(centered, mean_b1 + eps)

    why = "a lone sample is its own group mean, so A would be 0"
    return _per_group(fn, rewards_n, mask_n, group_size=group_size, why=why)


def gdpo_advantages(
    rewards_nr: Array,
    *,
    group_size: int,
    eps: float = 1e-6,
    weights: Array | None = None,
    std: str = "population",
    mask_n: Array | None = None,
) -> Array:
    """GDPO advantages for several reward functions (Group reward-Decoupled Normalization
    Policy Optimization, Liu et al. 2026, arXiv 2601.05242).

    Each reward function is normalised within the group on its own, then they are summed
    with weights w and the sum is normalised over the batch:

        A_{n,k} = (r_{n,k} - mean_g(r_k)) / (std_g(r_k) + eps)     per reward k, per group
        S_n     = sum_k w_k A_{n,k}
        A_n     = (S_n - mean_batch(S)) / (std_batch(S) + eps)

    Summing the rewards first and normalising once (GRPO) maps different reward combinations
    to the same advantage; normalising each first keeps them apart. A reward that is equal
    across a group contributes exactly 0 for that group. `std` is the population std
    (divide by the count) or the unbiased one (count - 1), in both normalisations. Rows are
    grouped contiguously (row `n` belongs to prompt `n // G`).

    Args:
      rewards_nr: `[N, R]` rewards, one column per reward function, `N = B*G`.
      group_size: `G` (static), >= 2.
      eps: >= 0, added to both stds.
      weights: optional `[R]` weights w (default all 1).
      std: "population" or "unbiased".
      mask_n: optional `[N]` bool of valid samples; invalid ones are left out of every
        statistic (group and batch) and get 0.

    Returns:
      `[N]` float32 advantages.

    Examples:
      >>> import jax.numpy as jnp
      >>> import numpy as np
      >>> import grpojax as gj
      >>> rewards = jnp.array([[1.0, 1.0], [0.0, 0.0], [1.0, 0.0], [0.0, 1.0]])  # [N=4, R=2]
      >>> # per reward and group: +-1 or 0, so S = [2, -2, 0, 0], batch std sqrt(2)
      >>> print(np.round(np.asarray(gj.gdpo_advantages(rewards, group_size=2)), 4))
      [ 1.4142 -1.4142  0.      0.    ]
    """
    check_choice("std", std, _STDS)
    _check_eps(eps)
    rewards = jnp.asarray(rewards_nr, jnp.float32)
    if rewards.ndim != 2:
        raise ValueError(f"rewards_nr must be 2-D [N, R], got shape {rewards.shape}")
    w = jnp.ones(rewards.shape[1:], jnp.float32) if weights is None else weights
    w = jnp.asarray(w, jnp.float32)
    if w.shape != rewards.shape[1:]:
        raise ValueError(f"weights must have shape {rewards.shape[1:]} ([R]), got {w.shape}")
    unbiased = std == "unbiased"

    def fn(r_bgr, m_bg):
        r_rbg = jnp.moveaxis(r_bgr, -1, 0)
        m_rbg = jnp.broadcast_to(m_bg, r_rbg.shape)
        a_rbg = _group_normalized(r_rbg, m_rbg, scale="group", eps=eps, unbiased=unbiased)
        s_bg = jnp.einsum("r,rbg->bg", w, a_rbg)
        mean = masked_mean(s_bg, m_bg)
        var = masked_var(s_bg, m_bg, unbiased=unbiased)
        return jnp.where(m_bg, _divide(s_bg - mean, _safe_sqrt(var) + eps), 0.0)

    why = "a lone sample is its own group mean, so A would be 0"
    return _per_group(fn, rewards, mask_n, group_size=group_size, why=why, columns=True)


def remax_advantages(
    rewards_n: Array, greedy_rewards: Array, *, mask_n: Array | None = None
) -> Array:
    """ReMax advantages: the reward minus the reward of the greedy completion of the same
    prompt (Li et al. 2024, arXiv 2310.10505).

        A_n = r_n - r_greedy(prompt of n)

    Args:
      rewards_n: `[N]` rewards of sampled completions, `N = B*G`, grouped contiguously
        (row `n` belongs to prompt `n // G`).
      greedy_rewards: `[B]` one greedy reward per prompt, broadcast to the prompt's G
        samples (G = N / B), or `[N]` already one per sample.
      mask_n: optional `[N]` bool of valid samples; invalid ones get 0.

    Returns:
      `[N]` float32 advantages.

    Examples:
      >>> import jax.numpy as jnp
      >>> import grpojax as gj
      >>> rewards, greedy = jnp.array([1.0, 0.0, 0.5, 1.0]), jnp.array([0.5, 1.0])  # B=2, G=2
      >>> print(gj.remax_advantages(rewards, greedy))
      [ 0.5 -0.5 -0.5  0. ]
    """
    rewards = jnp.asarray(rewards_n, jnp.float32)
    greedy = jnp.asarray(greedy_rewards, jnp.float32)
    if rewards.ndim != 1 or greedy.ndim != 1:
        raise ValueError(
            f"rewards_n must be [N] and greedy_rewards [B] or [N], got {rewards.shape} and "
            f"{greedy.shape}"
        )
    n, b = rewards.shape[0], greedy.shape[0]
    if b != n:
        if b == 0 or n % b:
            raise ValueError(
                f"greedy_rewards must be [B] with N={n} divisible by B, or [N], got B={b}"
            )
        greedy = jnp.broadcast_to(greedy[:, None], (b, n // b)).reshape(n)
    adv = rewards - greedy
    if mask_n is not None:
        adv = jnp.where(_as_mask(mask_n, adv.shape), adv, 0.0)
    return adv


def whiten(
    x: Array, mask: Array, *, shift_mean: bool = True, eps: float = 1e-8, unbiased: bool = False
) -> Array:
    """Masked whitening over all masked-in entries (global batch statistics).

        y = (x - mean) / sqrt(var + eps)            shift_mean=True
        y = (x - mean) / sqrt(var + eps) + mean     shift_mean=False (TRL/verl masked_whiten)

    `mean` and `var` are over the entries where `mask` is true; entries where it is false
    come out as 0, and whatever they hold (NaN, inf) reaches no value or gradient.
    `unbiased=False` is the population variance (OpenRLHF's advantage normalisation); TRL's
    and verl's `masked_whiten` use `unbiased=True`. Under `jit` with a sharded input the
    statistics are over the whole global array.

    Args:
      x: any shape, e.g. `[N, T]` advantages.
      mask: bool or {0, 1}, broadcastable to `x`.
      shift_mean: keep the result centred (True) or add the mean back (False).
      eps: > 0, added to the variance.
      unbiased: divide the variance by count - 1 instead of count.

    Returns:
      float32 array shaped like `x`.

    Examples:
      >>> import jax.numpy as jnp
      >>> import numpy as np
      >>> import grpojax as gj
      >>> x = jnp.array([[1.0, 3.0, 100.0], [3.0, 1.0, 100.0]])
      >>> mask = jnp.array([[1, 1, 0], [1, 1, 0]])  # mean 2, variance 1 over the real entries
      >>> print(np.round(np.asarray(gj.whiten(x, mask)), 4))
      [[-1.  1.  0.]
       [ 1. -1.  0.]]
    """
    check_number("eps", eps, minimum=0, strict=True)
    x = jnp.asarray(x, jnp.float32)
    m = _as_mask(mask, x.shape)
    x = jnp.where(m, x, 0.0)  # before the arithmetic: garbage at masked entries stays out
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

    Examples:
      >>> import jax.numpy as jnp
      >>> import numpy as np
      >>> import grpojax as gj
      >>> rewards, mask = jnp.array([1.0, 0.0]), jnp.array([[1, 1, 1], [1, 1, 0]])
      >>> adv = gj.reinforce_pp_baseline_advantages(rewards, mask, group_size=2)
      >>> print(np.round(np.asarray(adv), 4))  # G_t = +-0.5, whitened: (G_t - 0.1) / sqrt(0.24)
      [[ 0.8165  0.8165  0.8165]
       [-1.2247 -1.2247  0.    ]]
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
