"""Policy-gradient surrogates beyond PPO's clip: CISPO, SAPO, GMPO, DPPO, Clip-Cov, KL-Cov.

Each is a negated objective to minimise. Like `policy_loss`, the token-level ones return an
unreduced `[N, T]` float32 loss, exactly 0 at padding, plus a dict of float32 scalar
metrics (means over real tokens), and leave the reduction to
`grpojax.ops.aggregation.aggregate`; GMPO's objective is a geometric mean over each
sequence's tokens, so it returns one loss per sequence, `[N]`. Notation: r = exp(logp -
old_logp) the token ratio (log r clamped to [-log_ratio_clamp, log_ratio_clamp]), A the
advantage, sg the stop-gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import Array

from grpojax.ops.checks import check_choice, check_number, check_shape
from grpojax.ops.losses import _ppo_objective, _ratio_metrics, _token_inputs
from grpojax.ops.masks import masked_mean
from grpojax.ops.sharding import in_auto_mode, leading_spec

DPPO_DIVERGENCES = ("tv", "kl")
_DPPO_DEFAULT_DELTA = {"tv": 0.15, "kl": 0.05}


def _check_clips(clip_low, clip_high, log_ratio_clamp) -> None:
    check_number("clip_low", clip_low, minimum=0.0)
    check_number("clip_high", clip_high, minimum=0.0)
    check_number("log_ratio_clamp", log_ratio_clamp, minimum=0.0, strict=True)


def cispo_loss(
    logp_nt: Array,
    old_logp_nt: Array,
    advantages: Array,
    mask_nt: Array,
    *,
    clip_low: float = 1.0,
    clip_high: float,
    log_ratio_clamp: float = 20.0,
) -> tuple[Array, dict[str, Array]]:
    """CISPO: clipped importance-sampling weight policy optimisation (MiniMax-M1, arXiv 2506.13585).

        loss_t = -sg(clip(r_t, 1 - clip_low, 1 + clip_high)) * A_t * logp_t

    The clip acts on the importance weight, not on the update: the weight is a constant, so
    every token keeps a REINFORCE gradient, d loss_t / d logp_t = -clip(r_t) A_t, including
    tokens PPO would clip to zero gradient. Aggregate it like `policy_loss` (MiniMax-M1 uses
    the token mean, `aggregate(..., mode="token-mean")`, where each token's gradient is
    -clip(r_t) A_t / (number of real tokens)).

    Defaults: MiniMax-M1 imposes no lower bound on the weight ("setting eps_low^IS to a
    large value") and tunes only the upper one, so `clip_low` defaults to 1.0 (the floor
    1 - 1.0 = 0 is below every ratio: no lower bound, exactly as any larger value) and
    `clip_high` is required: the paper states no value for it.

    Args:
      logp_nt: `[N, T]` log pi_theta of the sampled tokens (any float dtype; math in f32).
      old_logp_nt: `[N, T]` log pi_old of the same tokens.
      advantages: `[N]` (broadcast over tokens) or `[N, T]`.
      mask_nt: `[N, T]` real tokens (from lengths).
      clip_low: >= 0, default 1.0 (no lower bound, the paper's).
      clip_high: >= 0 (required); the weight is clipped to [1 - clip_low, 1 + clip_high].
      log_ratio_clamp: > 0, bound on |log r| before exponentiating.

    Returns:
      loss_nt: `[N, T]` float32, 0 at padding.
      metrics: clip_frac_low / clip_frac_high (fraction of real tokens whose weight was
        clipped at the lower / upper bound, whatever the sign of A), and the ratio
        diagnostics of `policy_loss` (approx_kl_k1, approx_kl_k3, ratio_mean/min/max).

    Examples:
      >>> import jax.numpy as jnp
      >>> import numpy as np
      >>> import grpojax as gj
      >>> p, p_old = jnp.array([[0.5, 0.8, 0.1]]), jnp.array([[0.5, 0.4, 0.4]])  # ratios 1, 2, 1/4
      >>> loss, metrics = gj.cispo_loss(jnp.log(p), jnp.log(p_old), jnp.array([1.0]),
      ...                                jnp.ones((1, 3)), clip_high=0.2)
      >>> print(np.round(np.asarray(loss), 4))  # -clip(r, 0, 1.2) * A * logp
      [[0.6931 0.2678 0.5756]]
    """
    _check_clips(clip_low, clip_high, log_ratio_clamp)
    logp, _, adv, mask, log_ratio = _token_inputs(
        logp_nt, old_logp_nt, advantages, mask_nt, log_ratio_clamp
    )
    ratio = jnp.exp(log_ratio)
    lower, upper = 1.0 - clip_low, 1.0 + clip_high
    weight = jax.lax.stop_gradient(jnp.clip(ratio, lower, upper))
    safe_logp = jnp.where(mask, logp, 0.0)
    loss = jnp.where(mask, -weight * jnp.where(mask, adv, 0.0) * safe_logp, 0.0)
    sg_ratio = jax.lax.stop_gradient(ratio)
    metrics = {
        "clip_frac_low": masked_mean(sg_ratio < lower, mask),
        "clip_frac_high": masked_mean(sg_ratio > upper, mask),
        **_ratio_metrics(log_ratio, ratio, mask),
    }
    return loss, metrics


def sapo_loss(
    logp_nt: Array,
    old_logp_nt: Array,
    advantages: Array,
    mask_nt: Array,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    log_ratio_clamp: float = 20.0,
) -> tuple[Array, dict[str, Array]]:
    """SAPO: soft adaptive policy optimisation, a sigmoid gate instead of a hard clip
    (Gao et al. 2025, arXiv 2511.20347).

        tau_t  = tau_pos if A_t > 0 else tau_neg
        loss_t = -(4 / tau_t) * sigmoid(tau_t (r_t - 1)) * A_t

    Gradient: d loss_t / d logp_t = -w_t r_t A_t with the gate weight
    w_t = 4 sigmoid(tau_t (r_t - 1)) (1 - sigmoid(tau_t (r_t - 1))), which is 1 at r = 1
    (the on-policy gradient is unchanged) and decays smoothly as r leaves 1, faster for
    larger tau. The paper's defaults tau_pos = 1.0 < tau_neg = 1.05 damp negative-advantage
    tokens more. The paper aggregates per sequence (`mode="seq-mean-token-mean"`).

    Args:
      logp_nt: `[N, T]` log pi_theta of the sampled tokens, as in `policy_loss`.
      old_logp_nt: `[N, T]` log pi_old of the same tokens.
      advantages: `[N]` (broadcast over tokens) or `[N, T]`.
      mask_nt: `[N, T]` real completion tokens.
      tau_pos: > 0, the gate temperature for A > 0.
      tau_neg: > 0, the gate temperature for A <= 0.
      log_ratio_clamp: > 0, bound on |log r| before exponentiating.

    Returns:
      loss_nt: `[N, T]` float32, 0 at padding.
      metrics: gate_weight_mean (mean of w_t over real tokens) and the ratio diagnostics of
        `policy_loss`.

    Examples:
      >>> import jax.numpy as jnp
      >>> import numpy as np
      >>> import grpojax as gj
      >>> logp = jnp.log(jnp.full((2, 3), 0.5))
      >>> loss, metrics = gj.sapo_loss(logp, logp, jnp.array([1.0, -1.0]), jnp.ones((2, 3)))
      >>> print(np.round(np.asarray(loss), 4))  # r = 1: -(4 / tau) * sigmoid(0) * A = -2 A / tau
      [[-2.     -2.     -2.    ]
       [ 1.9048  1.9048  1.9048]]
    """
    check_number("tau_pos", tau_pos, minimum=0.0, strict=True)
    check_number("tau_neg", tau_neg, minimum=0.0, strict=True)
    check_number("log_ratio_clamp", log_ratio_clamp, minimum=0.0, strict=True)
    _, _, adv, mask, log_ratio = _token_inputs(
        logp_nt, old_logp_nt, advantages, mask_nt, log_ratio_clamp
    )
    adv = jnp.where(mask, adv, 0.0)
    ratio = jnp.exp(log_ratio)
    tau = jnp.where(adv > 0, jnp.float32(tau_pos), jnp.float32(tau_neg))
    gate = jax.nn.sigmoid(tau * (ratio - 1.0))
    loss = jnp.where(mask, -(4.0 / tau) * gate * adv, 0.0)
    sg_gate = jax.lax.stop_gradient(gate)
    metrics = {
        "gate_weight_mean": masked_mean(4.0 * sg_gate * (1.0 - sg_gate), mask),
        **_ratio_metrics(log_ratio, ratio, mask),
    }
    return loss, metrics


def gmpo_loss(
    logp_nt: Array,
    old_logp_nt: Array,
    advantages_n: Array,
    mask_nt: Array,
    *,
    clip_low: float = 0.4,
    clip_high: float = 0.4,
    log_ratio_clamp: float = 20.0,
) -> tuple[Array, dict[str, Array]]:
    """GMPO: geometric-mean policy optimisation, one loss per sequence
    (Zhao et al. 2025, arXiv 2507.20673).

    GRPO averages token ratios arithmetically; GMPO takes their geometric mean over the
    sequence's |o_i| real tokens, which an outlier token moves far less. With the token
    log-ratio d_t = logp_t - old_logp_t clipped in log space on the side that binds for the
    sign of the sequence's advantage A_i (the geometric-mean form of PPO's min):

        c_t = min(d_t, clip_high)    if A_i > 0
        c_t = max(d_t, -clip_low)    if A_i < 0        (c_t = d_t if A_i = 0)
        R_i = exp((1/|o_i|) sum_t c_t)
        loss_i = -A_i R_i

    i.e. the ratio band is [exp(-clip_low), exp(clip_high)], the paper's (e^-0.4, e^0.4) by
    default. Gradient: d loss_i / d logp_t = -A_i R_i / |o_i| for tokens inside the clip and
    0 for tokens the clip binds (d_t > clip_high with A_i > 0, d_t < -clip_low with A_i < 0).
    The paper's objective is the mean over sequences, e.g.
    `loss_n.sum() / jnp.maximum(jnp.sum(mask_nt.any(-1)), 1)`; a sequence with no real token
    has loss 0.

    Args:
      logp_nt: `[N, T]` log pi_theta of the sampled tokens.
      old_logp_nt: `[N, T]` log pi_old.
      advantages_n: `[N]`, one advantage per sequence.
      mask_nt: `[N, T]` real tokens.
      clip_low: >= 0, the log-ratio's lower bound is -clip_low.
      clip_high: >= 0, the log-ratio's upper bound is clip_high.
      log_ratio_clamp: > 0, bound on |d_t| (and so on log R_i) before exponentiating.

    Returns:
      loss_n: `[N]` float32.
      metrics: clip_frac_low / clip_frac_high (fraction of real tokens where the clip binds
        at -clip_low / clip_high), seq_ratio_mean / seq_ratio_min / seq_ratio_max of R_i over
        non-empty sequences (1 if none), and the token ratio diagnostics of `policy_loss`.

    Examples:
      >>> import jax.numpy as jnp
      >>> import numpy as np
      >>> import grpojax as gj
      >>> old_logp, d = jnp.full((2, 3), -1.0), jnp.array([[0.3, -0.3, 0.0], [-0.6, 0.0, 0.0]])
      >>> loss, metrics = gj.gmpo_loss(old_logp + d, old_logp, jnp.array([1.0, -1.0]),
      ...                               jnp.ones((2, 3)))  # log-ratios d; A < 0 clips -0.6 to -0.4
      >>> print(np.round(np.asarray(loss), 4))  # -A_i exp(mean_t c_t): exp(0), exp(-0.4 / 3)
      [-1.      0.8752]
    """
    _check_clips(clip_low, clip_high, log_ratio_clamp)
    adv_n = jnp.asarray(advantages_n, jnp.float32)
    lead = tuple(jnp.shape(logp_nt)[:-1])
    check_shape("advantages_n", adv_n.shape, [lead], f"[N] = {lead}, one per sequence")
    _, _, adv, mask, d = _token_inputs(logp_nt, old_logp_nt, adv_n, mask_nt, log_ratio_clamp)
    # Selects, not min/max: at d == bound the token is inside the clip and keeps its gradient.
    high_binds = (adv > 0) & (d > clip_high)
    low_binds = (adv < 0) & (d < -clip_low)
    c = jnp.where(high_binds, clip_high, jnp.where(low_binds, -clip_low, d))
    nonempty = jnp.any(mask, axis=-1)
    seq_ratio = jnp.exp(masked_mean(c, mask, axis=-1))
    loss = jnp.where(nonempty, -jnp.where(nonempty, adv_n, 0.0) * seq_ratio, 0.0)
    sg_seq = jax.lax.stop_gradient(seq_ratio)
    any_seq = jnp.any(nonempty)
    metrics = {
        "clip_frac_low": masked_mean(low_binds, mask),
        "clip_frac_high": masked_mean(high_binds, mask),
        "seq_ratio_mean": jnp.where(any_seq, masked_mean(sg_seq, nonempty), 1.0),
        "seq_ratio_min": jnp.where(any_seq, jnp.min(jnp.where(nonempty, sg_seq, jnp.inf)), 1.0),
        "seq_ratio_max": jnp.where(any_seq, jnp.max(jnp.where(nonempty, sg_seq, -jnp.inf)), 1.0),
        **_ratio_metrics(d, jnp.exp(d), mask),
    }
    return loss, metrics


def _log1mexp(x: Array) -> Array:
    """log(1 - exp(x)) for x <= 0, accurate at both ends (Maechler 2012); -inf at x = 0."""
    return jnp.where(x < -jnp.log(2.0), jnp.log1p(-jnp.exp(x)), jnp.log(-jnp.expm1(x)))


def _bernoulli_kl(log_p: Array, log_q: Array) -> Array:
    """KL(Bern(p) || Bern(q)) from log p, log q <= 0, with 0 log 0 = 0 (inf if q hits 0 or 1
    where p does not)."""
    p = jnp.exp(log_p)
    one_minus_p = -jnp.expm1(log_p)
    hit = p * (log_p - log_q)
    miss = jnp.where(one_minus_p > 0, one_minus_p * (_log1mexp(log_p) - _log1mexp(log_q)), 0.0)
    return hit + miss


def dppo_loss(
    logp_nt: Array,
    old_logp_nt: Array,
    advantages: Array,
    mask_nt: Array,
    *,
    divergence: str,
    delta: float | None = None,
    log_ratio_clamp: float = 20.0,
) -> tuple[Array, dict[str, Array]]:
    """DPPO: divergence proximal policy optimisation, Binary-TV / Binary-KL trust region
    (Qi et al. 2026, "Rethinking the Trust Region in LLM Reinforcement Learning",
    arXiv 2602.04879).

    Instead of clipping the ratio, DPPO drops tokens whose update has left a trust region
    measured by a divergence between the sampling policy mu and pi_theta, restricted to the
    sampled token's Bernoulli "this token vs the rest" (the Binary approximation). With
    mu_t = exp(old_logp_t) and pi_t = exp(logp_t):

        Binary-TV:  D_t = |pi_t - mu_t|
        Binary-KL:  D_t = mu_t log(mu_t / pi_t) + (1 - mu_t) log((1 - mu_t) / (1 - pi_t))
                    (KL(Bern(mu_t) || Bern(pi_t)))
        M_t = 0  if D_t > delta and (A_t > 0 and r_t > 1  or  A_t < 0 and r_t < 1)
        M_t = 1  otherwise
        loss_t = -sg(M_t) r_t A_t

    A token is masked only when it has moved past delta *in the direction its advantage
    pushes* (further updates would move it further); moving back toward mu is always
    allowed. Gradient: -r_t A_t where M_t = 1, exactly 0 where M_t = 0. `old_logp_nt`
    should be the sampling policy's log-probabilities (the paper's mu: DPPO anchors both
    the ratio and the trust region on it). Log-probabilities above 0 (rounding) are
    treated as 0 in D_t.

    Args:
      logp_nt: `[N, T]` log pi_theta of the sampled tokens, as in `policy_loss`.
      old_logp_nt: `[N, T]` log pi_old of the same tokens.
      advantages: `[N]` (broadcast over tokens) or `[N, T]`.
      mask_nt: `[N, T]` real completion tokens.
      divergence: "tv" (Binary-TV) or "kl" (Binary-KL); no default, the paper has both.
      delta: >= 0, the trust-region radius; None takes the paper's default for the
        divergence (0.15 for "tv", 0.05 for "kl").
      log_ratio_clamp: > 0, bound on |log r| before exponentiating.

    Returns:
      loss_nt: `[N, T]` float32, 0 at padding and at masked tokens.
      metrics: masked_frac (fraction of real tokens with M_t = 0), divergence_mean (mean D_t
        over real tokens), and the ratio diagnostics of `policy_loss`.

    Examples:
      >>> import jax.numpy as jnp
      >>> import numpy as np
      >>> import grpojax as gj
      >>> mu, pi = jnp.full((2, 3), 0.5), jnp.array([[0.5, 0.6, 0.8], [0.2, 0.8, 0.5]])
      >>> loss, metrics = gj.dppo_loss(jnp.log(pi), jnp.log(mu), jnp.array([1.0, -1.0]),
      ...                               jnp.ones((2, 3)), divergence="tv")
      >>> print(np.round(np.asarray(loss), 4))  # -r A; 0 where |pi - mu| > 0.15, moving with A
      [[-1.  -1.2  0. ]
       [ 0.   1.6  1. ]]
    """
    check_choice("divergence", divergence, DPPO_DIVERGENCES)
    if delta is None:
        delta = _DPPO_DEFAULT_DELTA[divergence]
    check_number("delta", delta, minimum=0.0)
    check_number("log_ratio_clamp", log_ratio_clamp, minimum=0.0, strict=True)
    logp, old_logp, adv, mask, log_ratio = _token_inputs(
        logp_nt, old_logp_nt, advantages, mask_nt, log_ratio_clamp
    )
    adv = jnp.where(mask, adv, 0.0)
    ratio = jnp.exp(log_ratio)
    log_pi = jax.lax.stop_gradient(jnp.minimum(jnp.where(mask, logp, 0.0), 0.0))
    log_mu = jax.lax.stop_gradient(jnp.minimum(jnp.where(mask, old_logp, 0.0), 0.0))
    if divergence == "tv":
        div = jnp.abs(jnp.exp(log_pi) - jnp.exp(log_mu))
    else:
        div = _bernoulli_kl(log_mu, log_pi)
    moving_away = ((adv > 0) & (log_ratio > 0)) | ((adv < 0) & (log_ratio < 0))
    masked_out = mask & moving_away & (div > delta)
    loss = jnp.where(mask & ~masked_out, -ratio * adv, 0.0)
    metrics = {
        "masked_frac": masked_mean(masked_out, mask),
        "divergence_mean": masked_mean(div, mask),
        **_ratio_metrics(log_ratio, ratio, mask),
    }
    return loss, metrics


# ----------------------------------------------------------------------------------------
# The entropy-mechanism losses (Cui et al. 2025, arXiv 2505.22617)
# ----------------------------------------------------------------------------------------


def _token_covariance(adv: Array, logp: Array, mask: Array) -> Array:
    """cov_t = (A_t - mean A)(logp_t - mean logp), means over the batch's real tokens; 0 at
    padding; no gradient (it only selects tokens)."""
    a = jax.lax.stop_gradient(jnp.where(mask, adv, 0.0))
    lp = jax.lax.stop_gradient(jnp.where(mask, logp, 0.0))
    cov = (a - masked_mean(a, mask)) * (lp - masked_mean(lp, mask))
    return jnp.where(mask, cov, 0.0)


def _select_top(score_nt: Array, candidate_nt: Array, mask_nt: Array, ratio, key) -> Array:
    """`[N, T]` bool: k of the candidates, k = max(1, floor(ratio * n)) (0 when ratio = 0),
    n the number of real tokens in the batch (a traced count, so no fixed-size top-k).

    key None: the k candidates with the largest score (ties: lower flat index first).
    key given: k candidates drawn uniformly without replacement (a uniform random priority).
    Fewer than k candidates: all of them. The flat sort spans the whole sharded batch, so on
    an Explicit mesh it runs in auto mode.
    """

    def run(score, candidate, mask, key):
        n_real = jnp.sum(mask, dtype=jnp.float32)
        ratio32 = jnp.asarray(ratio, jnp.float32)
        k = jnp.where(ratio32 > 0, jnp.maximum(jnp.floor(ratio32 * n_real), 1.0), 0.0)
        if key is not None:
            score = jax.random.uniform(key, score.shape)
        flat = jnp.where(candidate, score, -jnp.inf).reshape(-1)
        order = jnp.argsort(-flat, stable=True)
        rank = jnp.argsort(order, stable=True)
        return (candidate.reshape(-1) & (rank < k)).reshape(candidate.shape)

    return in_auto_mode(
        run, leading_spec(candidate_nt, candidate_nt.ndim), score_nt, candidate_nt, mask_nt, key
    )


def _check_fraction(name, value) -> None:
    check_number(name, value, minimum=0.0, maximum=1.0)


def clip_cov_loss(
    logp_nt: Array,
    old_logp_nt: Array,
    advantages: Array,
    mask_nt: Array,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_cov_ratio: float = 2e-4,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    key: Array | None = None,
    log_ratio_clamp: float = 20.0,
) -> tuple[Array, dict[str, Array]]:
    """Clip-Cov: PPO's clipped loss with the gradient of a few high-covariance tokens detached
    (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning
    Language Models", arXiv 2505.22617).

    The paper shows policy entropy falls in proportion to the covariance between a token's
    log-probability and its advantage; Clip-Cov removes the gradient of a small fraction
    of tokens whose covariance is high. Implemented exactly as:

        cov_t  = (A_t - mean A)(logp_t - mean logp)     means over the batch's real tokens
        l_t    = -min(r_t A_t, clip(r_t, 1 - clip_low, 1 + clip_high) A_t)   (PPO)
        C      = {real t : clip_cov_lb <= cov_t <= clip_cov_ub, and PPO's clip not binding}
        k      = max(1, floor(clip_cov_ratio * n))  (0 if clip_cov_ratio = 0), n = #real tokens
        S      = the k tokens of C with the largest cov_t (key=None), or k tokens of C drawn
                 uniformly at random (key given: the paper's random pick); all of C if |C| < k
        loss_t = sg(l_t) for t in S,  l_t otherwise

    Tokens in S keep their loss value but have zero gradient ("detached"). Tokens already
    clipped by PPO have zero gradient and are left out of C, as in the authors' code (which
    also multiplies the selected tokens' loss by 0 instead of detaching it: the same
    gradient, a different reported value). `k` is computed from the mask at run time, so the
    function works under `jit` with a traced mask. The paper's defaults: clip_cov_ratio
    2e-4, bounds [1, 5].

    Args:
      logp_nt: `[N, T]` log pi_theta of the sampled tokens, as in `policy_loss`.
      old_logp_nt: `[N, T]` log pi_old of the same tokens.
      advantages: `[N]` (broadcast over tokens) or `[N, T]`.
      mask_nt: `[N, T]` real completion tokens.
      clip_low: >= 0, the lower side of PPO's band [1 - clip_low, 1 + clip_high].
      clip_high: >= 0, its upper side.
      clip_cov_ratio: fraction of the batch's real tokens to detach, in [0, 1].
      clip_cov_lb: the lower bound of the candidates' covariance band.
      clip_cov_ub: its upper bound.
      key: optional `jax.random` key for the random pick.
      log_ratio_clamp: > 0, bound on |log r| before exponentiating.

    Returns:
      loss_nt: `[N, T]` float32, 0 at padding.
      metrics: clip_cov_frac (fraction of real tokens detached), cov_mean (mean cov_t over
        real tokens), PPO's clip_frac_low / clip_frac_high, and the ratio diagnostics of
        `policy_loss`.

    Examples:
      >>> import jax.numpy as jnp
      >>> import grpojax as gj
      >>> logp, adv = jnp.array([[-0.5, -2.0, -2.0], [-2.0, -2.0, -2.0]]), jnp.array([2.0, -2.0])
      >>> loss, metrics = gj.clip_cov_loss(logp, logp, adv, jnp.ones((2, 3)))  # ratio 1
      >>> print(loss)  # -A: a detached token keeps its value and loses only its gradient
      [[-2. -2. -2.]
       [ 2.  2.  2.]]
      >>> round(float(metrics["clip_cov_frac"]), 4)  # 1 of 6 detached: [0, 0], cov_t = 2 * 1.25
      0.1667
    """
    _check_clips(clip_low, clip_high, log_ratio_clamp)
    _check_fraction("clip_cov_ratio", clip_cov_ratio)
    check_number("clip_cov_lb", clip_cov_lb)
    check_number("clip_cov_ub", clip_cov_ub)
    if isinstance(clip_cov_lb, int | float) and isinstance(clip_cov_ub, int | float):
        if clip_cov_lb > clip_cov_ub:
            raise ValueError(
                f"clip_cov_lb must be <= clip_cov_ub, got {clip_cov_lb} > {clip_cov_ub}"
            )
    logp, _, adv, mask, log_ratio = _token_inputs(
        logp_nt, old_logp_nt, advantages, mask_nt, log_ratio_clamp
    )
    adv = jnp.where(mask, adv, 0.0)
    ratio = jnp.exp(log_ratio)
    lower, upper = 1.0 - clip_low, 1.0 + clip_high
    objective, clipped = _ppo_objective(ratio, adv, lower, upper)
    cov = _token_covariance(adv, logp, mask)
    candidate = mask & ~clipped & (cov >= clip_cov_lb) & (cov <= clip_cov_ub)
    detached = _select_top(cov, candidate, mask, clip_cov_ratio, key)
    loss = jnp.where(detached, jax.lax.stop_gradient(-objective), -objective)
    loss = jnp.where(mask, loss, 0.0)
    sg_ratio = jax.lax.stop_gradient(ratio)
    metrics = {
        "clip_cov_frac": masked_mean(detached, mask),
        "cov_mean": masked_mean(cov, mask),
        "clip_frac_low": masked_mean(clipped & (sg_ratio < lower), mask),
        "clip_frac_high": masked_mean(clipped & (sg_ratio > upper), mask),
        **_ratio_metrics(log_ratio, ratio, mask),
    }
    return loss, metrics


def kl_cov_loss(
    logp_nt: Array,
    old_logp_nt: Array,
    advantages: Array,
    mask_nt: Array,
    *,
    kl_cov_ratio: float = 2e-3,
    ppo_kl_coef: float = 1.0,
    log_ratio_clamp: float = 20.0,
) -> tuple[Array, dict[str, Array]]:
    """KL-Cov: the unclipped surrogate with a KL penalty on the highest-covariance tokens
    (Cui et al. 2025, arXiv 2505.22617).

        cov_t  = (A_t - mean A)(logp_t - mean logp)     means over the batch's real tokens
        k      = max(1, floor(kl_cov_ratio * n))  (0 if kl_cov_ratio = 0), n = #real tokens
        S      = the k real tokens with the largest cov_t (ties: lower flat index first)
        loss_t = -r_t A_t + ppo_kl_coef * |logp_t - old_logp_t|    for t in S
        loss_t = -r_t A_t                                          otherwise

    |logp - old_logp| is the paper's per-token KL(pi_old || pi_theta) term; it carries
    gradient (ppo_kl_coef * sign(logp_t - old_logp_t)), cov_t does not. There is no ratio
    clip. `k` is computed from the mask at run time, so the function works under `jit` with
    a traced mask. The paper's defaults: kl_cov_ratio 2e-3 (2e-4 for its 32B model),
    ppo_kl_coef 1.

    Args:
      logp_nt: `[N, T]` log pi_theta of the sampled tokens, as in `policy_loss`.
      old_logp_nt: `[N, T]` log pi_old of the same tokens.
      advantages: `[N]` (broadcast over tokens) or `[N, T]`.
      mask_nt: `[N, T]` real completion tokens.
      kl_cov_ratio: fraction of the batch's real tokens to penalise, in [0, 1].
      ppo_kl_coef: >= 0, the penalty's weight.
      log_ratio_clamp: > 0, bound on |log r| (and on the penalised |logp - old_logp|).

    Returns:
      loss_nt: `[N, T]` float32, 0 at padding.
      metrics: kl_cov_frac (fraction of real tokens penalised), cov_mean, abs_kl_mean (mean
        |logp - old_logp| over real tokens), and the ratio diagnostics of `policy_loss`.

    Examples:
      >>> import jax.numpy as jnp
      >>> import numpy as np
      >>> import grpojax as gj
      >>> logp, adv = jnp.array([[-0.5, -2.0, -2.0], [-2.0, -2.0, -2.0]]), jnp.array([2.0, -2.0])
      >>> loss, metrics = gj.kl_cov_loss(logp, logp.at[0, 0].set(-1.0), adv, jnp.ones((2, 3)))
      >>> print(np.round(np.asarray(loss), 4))  # -r A, + |logp - old_logp| at the max cov_t [0, 0]
      [[-2.7974 -2.     -2.    ]
       [ 2.      2.      2.    ]]
    """
    _check_fraction("kl_cov_ratio", kl_cov_ratio)
    check_number("ppo_kl_coef", ppo_kl_coef, minimum=0.0)
    check_number("log_ratio_clamp", log_ratio_clamp, minimum=0.0, strict=True)
    logp, _, adv, mask, log_ratio = _token_inputs(
        logp_nt, old_logp_nt, advantages, mask_nt, log_ratio_clamp
    )
    adv = jnp.where(mask, adv, 0.0)
    ratio = jnp.exp(log_ratio)
    cov = _token_covariance(adv, logp, mask)
    penalised = _select_top(cov, mask, mask, kl_cov_ratio, None)
    abs_kl = jnp.abs(log_ratio)
    loss = -ratio * adv + jnp.where(penalised, ppo_kl_coef * abs_kl, 0.0)
    loss = jnp.where(mask, loss, 0.0)
    metrics = {
        "kl_cov_frac": masked_mean(penalised, mask),
        "cov_mean": masked_mean(cov, mask),
        "abs_kl_mean": masked_mean(jax.lax.stop_gradient(abs_kl), mask),
        **_ratio_metrics(log_ratio, ratio, mask),
    }
    return loss, metrics


__all__ = [
    "DPPO_DIVERGENCES",
    "cispo_loss",
    "clip_cov_loss",
    "dppo_loss",
    "gmpo_loss",
    "kl_cov_loss",
    "sapo_loss",
]
