"""CISPO, SAPO, GMPO, DPPO, Clip-Cov and KL-Cov against float64 NumPy references.

Each reference is written from the paper's equation (quoted above it), token by token, not
from the JAX code. Batches are ragged (lengths 0..T, a full and an empty row) and their
padding holds large junk values. Tolerances: float32 JAX vs float64 NumPy, rtol 1e-5 /
atol 1e-6 for values and gradients unless a test states otherwise.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import grpojax as gj

RTOL, ATOL = 1e-5, 1e-6


def ragged_batch(seed, n=8, t=7, noise=0.35, adv_shape="n"):
    """Log-probs in (-3, 0), a ratio noise of `noise`, lengths 0..t (row 0 full, row -1 empty),
    advantages [N] or [N, T], and junk (|x| up to 1e4, finite) in every padded slot."""
    rng = np.random.default_rng(seed)
    logp = -np.abs(rng.normal(1.0, 0.6, (n, t)))
    old = logp + rng.normal(0.0, noise, (n, t))
    old = np.minimum(old, -1e-3)  # log-probabilities of sampled tokens are < 0
    lengths = rng.integers(1, t + 1, n)
    lengths[0], lengths[-1] = t, 0
    mask = np.arange(t)[None, :] < lengths[:, None]
    adv = rng.normal(0.0, 1.0, (n,) if adv_shape == "n" else (n, t))
    junk = rng.uniform(-1e4, 1e4, (n, t))
    logp = np.where(mask, logp, junk).astype(np.float32)
    old = np.where(mask, old, -junk[:, ::-1]).astype(np.float32)
    if adv_shape == "nt":
        adv = np.where(mask, adv, rng.uniform(-1e4, 1e4, (n, t)))
    return logp, old, adv.astype(np.float32), mask


def tokens_adv(adv, shape):
    adv = np.asarray(adv, np.float64)
    return np.broadcast_to(adv[:, None] if adv.ndim == 1 else adv, shape)


def f64(*xs):
    return tuple(np.asarray(x, np.float64) for x in xs)


def grad_of_sum(fn, logp, *args, **kw):
    """d/d logp of the sum of the per-token (or per-sequence) loss."""
    return np.asarray(jax.grad(lambda lp: fn(lp, *args, **kw)[0].sum())(jnp.asarray(logp)))


# ------------------------------------------------------------------------------------ CISPO
# MiniMax-M1: J = E[ 1/sum|o_i| sum_i sum_t sg(clip(r_it, 1 - eps_low, 1 + eps_high)) A_it
#                    log pi(o_it) ]


def np_cispo(logp, old, adv, mask, clip_low, clip_high):
    logp, old = f64(logp, old)
    a = tokens_adv(adv, logp.shape)
    loss, grad = np.zeros_like(logp), np.zeros_like(logp)
    for i, t in zip(*np.nonzero(mask)):
        w = min(max(math.exp(logp[i, t] - old[i, t]), 1 - clip_low), 1 + clip_high)
        loss[i, t] = -w * a[i, t] * logp[i, t]
        grad[i, t] = -w * a[i, t]
    return loss, grad


@pytest.mark.parametrize("adv_shape", ["n", "nt"])
def test_cispo_values_and_stop_gradient(adv_shape):
    cl, ch = 0.1, 0.15
    logp, old, adv, mask = ragged_batch(0, adv_shape=adv_shape)
    loss, m = gj.cispo_loss(logp, old, adv, mask, clip_low=cl, clip_high=ch)
    ref_loss, ref_grad = np_cispo(logp, old, adv, mask, cl, ch)
    assert loss.dtype == jnp.float32 and loss.shape == logp.shape
    np.testing.assert_allclose(np.asarray(loss), ref_loss, rtol=RTOL, atol=ATOL)

    # The token-mean gradient of every token is -clip(r) A / (number of real tokens): the
    # weight is a constant, and tokens outside the band keep their gradient.
    def token_mean(lp):
        loss_nt, _ = gj.cispo_loss(lp, old, adv, mask, clip_low=cl, clip_high=ch)
        return gj.aggregate(loss_nt, mask, mode="token-mean")

    grad = np.asarray(jax.grad(token_mean)(jnp.asarray(logp)))
    np.testing.assert_allclose(grad, ref_grad / mask.sum(), rtol=RTOL, atol=ATOL)
    r = np.exp(np.where(mask, logp.astype(np.float64) - old, 0.0))
    outside = mask & ((r < 1 - cl) | (r > 1 + ch))
    assert outside.any() and np.all(grad[outside] != 0)  # PPO would give these 0
    np.testing.assert_allclose(float(m["clip_frac_high"]), (mask & (r > 1 + ch)).sum() / mask.sum())
    np.testing.assert_allclose(float(m["clip_frac_low"]), (mask & (r < 1 - cl)).sum() / mask.sum())
    assert np.all(grad[~mask] == 0)


def test_cispo_default_has_no_lower_bound_as_in_minimax_m1():
    """MiniMax-M1 imposes no floor on the weight: the default clip_low leaves every ratio
    below 1 as it is (r = e^-3 keeps weight e^-3), and only clip_high caps from above."""
    logp = np.array([[-4.0, -1.0, -0.5]], np.float32)
    old = np.array([[-1.0, -1.0, -1.0]], np.float32)  # ratios e^-3, 1, e^0.5
    adv, mask = np.ones(1, np.float32), np.ones((1, 3), bool)
    loss, _ = gj.cispo_loss(logp, old, adv, mask, clip_high=0.28)
    ref_loss, _ = np_cispo(logp, old, adv, mask, 1.0, 0.28)
    np.testing.assert_allclose(np.asarray(loss), ref_loss, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(float(loss[0, 0]), -math.exp(-3.0) * -4.0, rtol=RTOL)


# ------------------------------------------------------------------------------------- SAPO
# SAPO: J = E[ 1/G sum_i 1/|y_i| sum_t f_it(r_it) A_it ],  f(x) = sigmoid(tau (x - 1)) 4 / tau,
# tau = tau_pos if A > 0 else tau_neg.


def np_sapo(logp, old, adv, mask, tau_pos, tau_neg):
    logp, old = f64(logp, old)
    a = tokens_adv(adv, logp.shape)
    loss, grad = np.zeros_like(logp), np.zeros_like(logp)
    for i, t in zip(*np.nonzero(mask)):
        r = math.exp(logp[i, t] - old[i, t])
        tau = tau_pos if a[i, t] > 0 else tau_neg
        s = 1.0 / (1.0 + math.exp(-tau * (r - 1.0)))
        loss[i, t] = -(4.0 / tau) * s * a[i, t]
        # d/dlogp of -(4/tau) s(tau (r - 1)) A = -(4/tau) s (1 - s) tau r A
        grad[i, t] = -4.0 * s * (1.0 - s) * r * a[i, t]
    return loss, grad


@pytest.mark.parametrize("taus", [(1.0, 1.05), (2.0, 0.5)])
@pytest.mark.parametrize("adv_shape", ["n", "nt"])
def test_sapo_values_and_gradient(taus, adv_shape):
    tp, tn = taus
    logp, old, adv, mask = ragged_batch(1, noise=0.5, adv_shape=adv_shape)
    loss, m = gj.sapo_loss(logp, old, adv, mask, tau_pos=tp, tau_neg=tn)
    ref_loss, ref_grad = np_sapo(logp, old, adv, mask, tp, tn)
    np.testing.assert_allclose(np.asarray(loss), ref_loss, rtol=RTOL, atol=ATOL)
    grad = grad_of_sum(gj.sapo_loss, logp, old, adv, mask, tau_pos=tp, tau_neg=tn)
    np.testing.assert_allclose(grad, ref_grad, rtol=RTOL, atol=ATOL)
    r = np.exp(np.where(mask, logp.astype(np.float64) - old, 0.0))
    s = 1 / (1 + np.exp(-np.where(tokens_adv(adv, r.shape) > 0, tp, tn) * (r - 1)))
    np.testing.assert_allclose(
        float(m["gate_weight_mean"]), (4 * s * (1 - s))[mask].mean(), rtol=RTOL, atol=ATOL
    )


def test_sapo_on_policy_gradient_is_reinforce():
    # At r = 1 the gate's weight is 4 sigmoid(0)(1 - sigmoid(0)) = 1: gradient -A per token.
    logp = jnp.full((2, 3), -1.0)
    adv = jnp.array([0.5, -2.0])
    g = jax.grad(lambda lp: gj.sapo_loss(lp, logp, adv, jnp.ones((2, 3), bool))[0].sum())(logp)
    np.testing.assert_allclose(np.asarray(g), -np.broadcast_to(adv[:, None], (2, 3)), rtol=1e-6)


# ------------------------------------------------------------------------------------- GMPO
# GMPO: J = E[ 1/G sum_i ( prod_t |min(rho_it A_i, clip(rho_it, e^-lo, e^hi) A_i)| )^(1/|o_i|)
#                        * sgn(A_i) ], written here in ratio space (a product of ratios).


def np_gmpo(logp, old, adv, mask, clip_low, clip_high):
    logp, old = f64(logp, old)
    adv = np.asarray(adv, np.float64)
    lo, hi = math.exp(-clip_low), math.exp(clip_high)
    loss, grad = np.zeros(len(adv)), np.zeros_like(logp)
    for i in range(len(adv)):
        idx = np.nonzero(mask[i])[0]
        if len(idx) == 0:
            continue
        rhos = [math.exp(logp[i, t] - old[i, t]) for t in idx]
        terms = [abs(min(rho * adv[i], min(max(rho, lo), hi) * adv[i])) for rho in rhos]
        geo = math.prod(terms) ** (1.0 / len(idx))
        loss[i] = -geo * np.sign(adv[i])
        # d/dlogp_t of -sgn(A) (prod_t |A| rho_t)^(1/|o|) where rho_t is the live branch
        # (the clip does not bind for this sign of A): -A R / |o| with R = geo / |A|.
        for t, rho in zip(idx, rhos):
            binds = (adv[i] > 0 and rho > hi) or (adv[i] < 0 and rho < lo)
            if not binds and adv[i] != 0:
                grad[i, t] = -adv[i] * (geo / abs(adv[i])) / len(idx)
    return loss, grad


def test_gmpo_values_and_per_token_gradient():
    cl, ch = 0.1, 0.15
    logp, old, adv, mask = ragged_batch(2, n=10, t=6, noise=0.25)
    adv[3] = 0.0
    loss, m = gj.gmpo_loss(logp, old, adv, mask, clip_low=cl, clip_high=ch)
    ref_loss, ref_grad = np_gmpo(logp, old, adv, mask, cl, ch)
    assert loss.shape == (10,) and loss.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(loss), ref_loss, rtol=RTOL, atol=ATOL)
    assert float(loss[-1]) == 0.0  # empty sequence
    # d loss_i / d logp_t = -A_i R_i / |o_i| inside the clip, 0 where the clip binds.
    grad = grad_of_sum(gj.gmpo_loss, logp, old, adv, mask, clip_low=cl, clip_high=ch)
    np.testing.assert_allclose(grad, ref_grad, rtol=RTOL, atol=ATOL)
    d = np.where(mask, logp.astype(np.float64) - old, 0.0)
    a = tokens_adv(adv, d.shape)
    binds = mask & (((a > 0) & (d > ch)) | ((a < 0) & (d < -cl)))
    assert binds.any() and (mask & ~binds & (a != 0)).any()
    assert np.all(grad[binds] == 0) and np.all(grad[~mask] == 0)
    np.testing.assert_allclose(
        float(m["clip_frac_high"]), (mask & (a > 0) & (d > ch)).sum() / mask.sum(), rtol=RTOL
    )
    np.testing.assert_allclose(
        float(m["clip_frac_low"]), (mask & (a < 0) & (d < -cl)).sum() / mask.sum(), rtol=RTOL
    )


def test_gmpo_clips_only_the_side_that_matters():
    # One token far above the band: clipped for A > 0, not for A < 0 (it only hurts there).
    logp = jnp.array([[0.0, -1.0], [0.0, -1.0]])
    old = jnp.array([[-1.0, -1.0], [-1.0, -1.0]])  # d = [1, 0]
    mask = jnp.ones((2, 2), bool)
    adv = jnp.array([2.0, -2.0])
    loss, _ = gj.gmpo_loss(logp, old, adv, mask, clip_low=0.4, clip_high=0.4)
    np.testing.assert_allclose(
        np.asarray(loss), [-2.0 * math.exp(0.2), 2.0 * math.exp(0.5)], rtol=1e-6
    )
    g = np.asarray(jax.grad(lambda lp: gj.gmpo_loss(lp, old, adv, mask)[0].sum())(logp))
    np.testing.assert_allclose(g[0], [0.0, -2.0 * math.exp(0.2) / 2], rtol=1e-6)
    np.testing.assert_allclose(g[1], [2.0 * math.exp(0.5) / 2] * 2, rtol=1e-6)


def test_gmpo_rejects_token_advantages():
    x = jnp.zeros((2, 3))
    with pytest.raises(ValueError, match="one per sequence"):
        gj.gmpo_loss(x, x, jnp.zeros((2, 3)), jnp.ones((2, 3), bool))


# ------------------------------------------------------------------------------------- DPPO
# DPPO (Eqs. 11-14): L = E[ sum_t M_t r_t A_t ], M_t = 0 if the token moved past delta in the
# direction of its advantage, Binary-TV |pi - mu|, Binary-KL KL(Bern(mu) || Bern(pi)).


def np_dppo(logp, old, adv, mask, divergence, delta):
    logp, old = f64(logp, old)
    a = tokens_adv(adv, logp.shape)
    loss, grad, masked = np.zeros_like(logp), np.zeros_like(logp), np.zeros(logp.shape, bool)
    divs = np.zeros_like(logp)
    for i, t in zip(*np.nonzero(mask)):
        pi, mu = math.exp(logp[i, t]), math.exp(old[i, t])
        if divergence == "tv":
            div = abs(pi - mu)
        else:
            div = mu * math.log(mu / pi) + (1 - mu) * math.log((1 - mu) / (1 - pi))
        divs[i, t] = div
        r = pi / mu
        away = (a[i, t] > 0 and r > 1) or (a[i, t] < 0 and r < 1)
        if away and div > delta:
            masked[i, t] = True
            continue
        loss[i, t] = -r * a[i, t]
        grad[i, t] = -r * a[i, t]
    return loss, grad, masked, divs


@pytest.mark.parametrize("divergence,delta", [("tv", None), ("tv", 0.05), ("kl", None)])
def test_dppo_values_mask_and_gradient(divergence, delta):
    logp, old, adv, mask = ragged_batch(3, n=16, t=10, noise=0.6)
    # Sampled-token probabilities spread over (0.05, 0.95), so |pi - mu| crosses delta often.
    rng = np.random.default_rng(33)
    old = np.where(mask, np.log(rng.uniform(0.05, 0.95, mask.shape)), old).astype(np.float32)
    logp = np.where(mask, np.minimum(old + rng.normal(0, 0.5, mask.shape), -1e-3), logp)
    logp = logp.astype(np.float32)
    adv = (np.abs(adv) * np.where(np.arange(16) % 2, -1, 1)).astype(np.float32)
    loss, m = gj.dppo_loss(logp, old, adv, mask, divergence=divergence, delta=delta)
    used = {"tv": 0.15, "kl": 0.05}[divergence] if delta is None else delta
    ref_loss, ref_grad, masked, div = np_dppo(logp, old, adv, mask, divergence, used)
    np.testing.assert_allclose(np.asarray(loss), ref_loss, rtol=RTOL, atol=ATOL)
    grad = grad_of_sum(gj.dppo_loss, logp, old, adv, mask, divergence=divergence, delta=delta)
    np.testing.assert_allclose(grad, ref_grad, rtol=RTOL, atol=ATOL)
    assert np.all(grad[masked] == 0.0) and np.all(grad[~mask] == 0.0)
    # Not vacuous: tokens masked on both sides, and kept tokens that moved past delta toward mu.
    a = tokens_adv(adv, logp.shape)
    assert (masked & (a > 0)).any() and (masked & (a < 0)).any()
    assert (mask & ~masked & (div > used)).any()
    np.testing.assert_allclose(float(m["masked_frac"]), masked.sum() / mask.sum(), rtol=RTOL)
    np.testing.assert_allclose(float(m["divergence_mean"]), div[mask].mean(), rtol=RTOL, atol=ATOL)


def test_dppo_binary_kl_edge_values_are_finite():
    # mu = 1 (old_logp = 0): the (1 - mu) term is 0 log 0 = 0; pi = 1 with mu < 1: infinite KL.
    logp = jnp.array([[-0.1, 0.0, -2.0]])
    old = jnp.array([[0.0, -0.5, -2.0]])
    adv = jnp.array([[-1.0, 1.0, 1.0]])
    loss, m = gj.dppo_loss(logp, old, adv, jnp.ones((1, 3), bool), divergence="kl", delta=0.05)
    # token 0: KL = log(1/exp(-0.1)) = 0.1 > delta, r < 1 with A < 0 -> masked
    # token 1: KL = inf, r > 1 with A > 0 -> masked; token 2: r = 1 -> kept, loss -1
    np.testing.assert_array_equal(np.asarray(loss), [[0.0, 0.0, -1.0]])
    assert float(m["masked_frac"]) == pytest.approx(2 / 3)


# ---------------------------------------------------------------------------- Clip-Cov/KL-Cov
# Cui et al. 2025: Cov(y_i) = (log pi(y_i) - mean_j log pi(y_j)) (A(y_i) - mean_j A(y_j)).
# Clip-Cov: detach the gradient of r*N tokens with Cov in [w_low, w_high] (PPO loss elsewhere).
# KL-Cov: add beta |log pi - log pi_old| to the k*N tokens with the largest Cov.


def np_covariance(logp, adv, mask):
    lp = np.asarray(logp, np.float64)[mask]
    a = tokens_adv(adv, mask.shape)[mask]
    cov = np.zeros(mask.shape)
    cov[mask] = (lp - lp.mean()) * (a - a.mean())
    return cov


def np_top(score, candidate, k):
    """The k candidates with the largest score; ties by lower flat index."""
    flat_idx = np.nonzero(candidate.reshape(-1))[0]
    order = sorted(flat_idx, key=lambda j: (-score.reshape(-1)[j], j))
    out = np.zeros(candidate.size, bool)
    out[order[:k]] = True
    return out.reshape(candidate.shape)


def np_ppo(logp, old, adv, mask, cl, ch):
    logp, old = f64(logp, old)
    a = tokens_adv(adv, logp.shape)
    r = np.exp(np.where(mask, logp - old, 0.0))
    loss = np.where(mask, -np.minimum(r * a, np.clip(r, 1 - cl, 1 + ch) * a), 0.0)
    clipped = mask & (((a > 0) & (r > 1 + ch)) | ((a < 0) & (r < 1 - cl)))
    grad = np.where(mask & ~clipped, -r * a, 0.0)
    return loss, grad, clipped


def k_of(ratio, n_real):
    return 0 if ratio == 0 else max(1, math.floor(ratio * n_real))


CLIP_COV_KW = dict(clip_low=0.2, clip_high=0.2, clip_cov_lb=-0.05, clip_cov_ub=0.5)


@pytest.mark.parametrize("ratio", [0.25, 0.0625, 0.0])
def test_clip_cov_detaches_the_top_covariance_band(ratio):
    logp, old, adv, mask = ragged_batch(4, n=8, t=8, noise=0.3)
    kw = dict(CLIP_COV_KW, clip_cov_ratio=ratio)
    loss, m = gj.clip_cov_loss(logp, old, adv, mask, **kw)
    ppo_loss, ppo_grad, clipped = np_ppo(logp, old, adv, mask, 0.2, 0.2)
    cov = np_covariance(logp, adv, mask)
    candidate = mask & ~clipped & (cov >= kw["clip_cov_lb"]) & (cov <= kw["clip_cov_ub"])
    k = k_of(ratio, mask.sum())
    detached = np_top(cov, candidate, k)
    assert detached.sum() == min(k, candidate.sum())
    if ratio:
        assert 0 < detached.sum() < candidate.sum()  # the band and the count both matter
        # Guard against a float32/float64 near-tie at the k-th place deciding the test.
        kth = np.sort(cov[candidate])[::-1]
        assert kth[k - 1] - kth[k] > 1e-4
    # Values: the PPO loss everywhere (detached tokens keep their value).
    np.testing.assert_allclose(np.asarray(loss), ppo_loss, rtol=RTOL, atol=ATOL)
    grad = grad_of_sum(gj.clip_cov_loss, logp, old, adv, mask, **kw)
    np.testing.assert_allclose(grad, np.where(detached, 0.0, ppo_grad), rtol=RTOL, atol=ATOL)
    assert np.all(ppo_grad[detached] != 0)  # they had a gradient before
    np.testing.assert_allclose(float(m["clip_cov_frac"]), detached.sum() / mask.sum())
    np.testing.assert_allclose(float(m["cov_mean"]), cov[mask].mean(), rtol=RTOL, atol=ATOL)


def test_clip_cov_count_follows_a_traced_mask():
    # One compiled function; masks with 24, 40 and 56 real tokens give k = 3, 5 and 7.
    rng = np.random.default_rng(5)
    logp = -np.abs(rng.normal(1.0, 0.6, (8, 8))).astype(np.float32)
    old = (logp + rng.normal(0.0, 0.3, (8, 8))).astype(np.float32)
    adv = rng.normal(size=8).astype(np.float32)
    # No PPO clip binds and every real token is a candidate: exactly the top-k are detached.
    kw = dict(clip_low=10.0, clip_high=10.0, clip_cov_lb=-1e9, clip_cov_ub=1e9)
    fn = jax.jit(lambda lp, mk: gj.clip_cov_loss(lp, old, adv, mk, clip_cov_ratio=0.125, **kw))
    for real_per_row in (3, 5, 7):
        mask = np.arange(8)[None, :] < np.full((8, 1), real_per_row)
        logp_m = np.where(mask, logp, 1e3).astype(np.float32)  # junk in the padding
        _, m = fn(logp_m, mask)
        cov = np_covariance(logp_m, adv, mask)
        detached = np_top(cov, mask, real_per_row)  # floor(0.125 * 8 * real_per_row)
        np.testing.assert_allclose(float(m["clip_cov_frac"]), real_per_row / mask.sum())
        g = np.asarray(jax.grad(lambda lp, mk=mask: fn(lp, mk)[0].sum())(jnp.asarray(logp_m)))
        np.testing.assert_array_equal(g == 0, detached | ~mask)
    assert fn._cache_size() == 1


def test_clip_cov_random_pick_is_uniform_over_the_band():
    logp, old, adv, mask = ragged_batch(6, n=6, t=6, noise=0.3)
    kw = dict(CLIP_COV_KW, clip_cov_ratio=0.125)
    _, ppo_grad, clipped = np_ppo(logp, old, adv, mask, 0.2, 0.2)
    cov = np_covariance(logp, adv, mask)
    candidate = mask & ~clipped & (cov >= kw["clip_cov_lb"]) & (cov <= kw["clip_cov_ub"])
    k = k_of(0.125, mask.sum())
    c = candidate.sum()
    assert 1 < k < c

    def detached(key):
        g = jax.grad(lambda lp: gj.clip_cov_loss(lp, old, adv, mask, key=key, **kw)[0].sum())
        return g(jnp.asarray(logp)) == 0

    draws = 400
    picks = np.asarray(jax.jit(jax.vmap(detached))(jax.random.split(jax.random.key(0), draws)))
    picks = picks & (ppo_grad != 0)  # zero gradient that PPO's own clip did not cause
    counts = picks.sum(axis=(1, 2))
    np.testing.assert_array_equal(counts, k)
    assert not (picks & ~candidate).any()
    # Each candidate is picked with probability k / c: within 5 binomial sigmas.
    freq = picks.sum(0)[candidate] / draws
    p = k / c
    assert np.all(np.abs(freq - p) < 5 * math.sqrt(p * (1 - p) / draws)), (freq, p)
    # The same key picks the same tokens.
    key = jax.random.key(7)
    np.testing.assert_array_equal(np.asarray(detached(key)), np.asarray(detached(key)))


@pytest.mark.parametrize("ratio,coef", [(0.25, 1.0), (0.0625, 0.3), (0.0, 1.0)])
def test_kl_cov_penalises_the_top_covariance_tokens(ratio, coef):
    logp, old, adv, mask = ragged_batch(7, n=8, t=8, noise=0.3, adv_shape="nt")
    loss, m = gj.kl_cov_loss(logp, old, adv, mask, kl_cov_ratio=ratio, ppo_kl_coef=coef)
    lp64, old64 = f64(logp, old)
    a = tokens_adv(adv, logp.shape)
    r = np.exp(np.where(mask, lp64 - old64, 0.0))
    cov = np_covariance(logp, adv, mask)
    k = k_of(ratio, mask.sum())
    top = np_top(cov, mask, k)
    if ratio:
        kth = np.sort(cov[mask])[::-1]
        assert kth[k - 1] - kth[k] > 1e-4
    d = np.where(mask, lp64 - old64, 0.0)
    ref = np.where(mask, -r * a + np.where(top, coef * np.abs(d), 0.0), 0.0)
    np.testing.assert_allclose(np.asarray(loss), ref, rtol=RTOL, atol=ATOL)
    grad = grad_of_sum(gj.kl_cov_loss, logp, old, adv, mask, kl_cov_ratio=ratio, ppo_kl_coef=coef)
    ref_grad = np.where(mask, -r * a + np.where(top, coef * np.sign(d), 0.0), 0.0)
    np.testing.assert_allclose(grad, ref_grad, rtol=RTOL, atol=ATOL)
    assert top.sum() == k
    np.testing.assert_allclose(float(m["kl_cov_frac"]), k / mask.sum())
    np.testing.assert_allclose(float(m["abs_kl_mean"]), np.abs(d)[mask].mean(), rtol=1e-5)


# ------------------------------------------------------------------------ shared invariances

LOSSES = {
    "cispo": functools.partial(gj.cispo_loss, clip_low=0.2, clip_high=0.28),
    "sapo": gj.sapo_loss,
    "gmpo": gj.gmpo_loss,
    "dppo_tv": functools.partial(gj.dppo_loss, divergence="tv"),
    "dppo_kl": functools.partial(gj.dppo_loss, divergence="kl"),
    "clip_cov": functools.partial(gj.clip_cov_loss, clip_cov_ratio=0.125, **CLIP_COV_KW),
    "kl_cov": functools.partial(gj.kl_cov_loss, kl_cov_ratio=0.125),
}


@pytest.mark.parametrize("name", LOSSES)
def test_padding_is_inert_even_when_nan(name):
    fn = LOSSES[name]
    logp, old, adv, mask = ragged_batch(8, n=6, t=5)
    n, t = logp.shape
    pad = np.full((n, 3), np.nan, np.float32)
    pad[:, 1] = np.inf
    logp_p = np.concatenate([logp, pad], 1)
    old_p = np.concatenate([old, -pad], 1)
    mask_p = np.concatenate([mask, np.zeros((n, 3), bool)], 1)
    loss, m = fn(logp, old, adv, mask)
    loss_p, m_p = fn(logp_p, old_p, adv, mask_p)
    cut = (slice(None), slice(0, t)) if loss.ndim == 2 else (slice(None),)
    np.testing.assert_allclose(np.asarray(loss_p[cut]), np.asarray(loss), rtol=1e-6, atol=0)
    for k in m:
        np.testing.assert_allclose(float(m_p[k]), float(m[k]), rtol=1e-6, atol=1e-7, err_msg=k)
    g = grad_of_sum(fn, logp, old, adv, mask)
    g_p = grad_of_sum(fn, logp_p, old_p, adv, mask_p)
    np.testing.assert_allclose(g_p[:, :t], g, rtol=1e-6, atol=1e-7)
    assert np.all(g_p[:, t:] == 0.0)


@pytest.mark.parametrize("name", LOSSES)
def test_jit_and_vmap_match_eager(name):
    fn = LOSSES[name]
    batches = [ragged_batch(s, n=6, t=5) for s in (9, 10)]
    stacked = [np.stack(x) for x in zip(*batches)]
    vmapped = jax.vmap(fn)(*stacked)  # two independent batches at once
    for k, batch in enumerate(batches):
        loss, m = fn(*batch)
        outs = [jax.tree.map(lambda x, k=k: x[k], vmapped)]
        if k == 0:
            outs.append(jax.jit(fn)(*batch))
        for loss_o, m_o in outs:
            np.testing.assert_allclose(np.asarray(loss_o), np.asarray(loss), rtol=1e-6, atol=1e-6)
            for key in m:
                np.testing.assert_allclose(float(m_o[key]), float(m[key]), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", LOSSES)
def test_float32_math_for_bfloat16_inputs(name):
    fn = LOSSES[name]
    logp, old, adv, mask = ragged_batch(11, n=6, t=5)
    loss, m = fn(jnp.asarray(logp, jnp.bfloat16), jnp.asarray(old, jnp.bfloat16), adv, mask)
    assert loss.dtype == jnp.float32 and all(v.dtype == jnp.float32 for v in m.values())


def test_hyperparameters_may_be_traced():
    logp, old, adv, mask = ragged_batch(12, n=6, t=5)
    ref = gj.sapo_loss(logp, old, adv, mask, tau_pos=1.5, tau_neg=2.0)[0]
    out = jax.jit(lambda a, b: gj.sapo_loss(logp, old, adv, mask, tau_pos=a, tau_neg=b)[0])(
        jnp.float32(1.5), jnp.float32(2.0)
    )
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-6)
    ref = gj.kl_cov_loss(logp, old, adv, mask, kl_cov_ratio=0.25, ppo_kl_coef=0.5)[0]
    out = jax.jit(
        lambda a, b: gj.kl_cov_loss(logp, old, adv, mask, kl_cov_ratio=a, ppo_kl_coef=b)[0]
    )(jnp.float32(0.25), jnp.float32(0.5))
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-6)


@pytest.mark.parametrize(
    "fn, kwargs, match",
    [
        (gj.cispo_loss, dict(clip_low=-0.1, clip_high=0.2), "clip_low"),
        (gj.cispo_loss, dict(clip_low=0.1, clip_high=float("nan")), "clip_high"),
        (gj.sapo_loss, dict(tau_pos=0.0), "tau_pos"),
        (gj.sapo_loss, dict(tau_neg=-1.0), "tau_neg"),
        (gj.gmpo_loss, dict(clip_high=-0.4), "clip_high"),
        (gj.dppo_loss, dict(divergence="js"), r"divergence must be one of \('tv', 'kl'\)"),
        (gj.dppo_loss, dict(divergence="tv", delta=-0.1), "delta"),
        (gj.clip_cov_loss, dict(clip_cov_ratio=1.5), "clip_cov_ratio"),
        (gj.clip_cov_loss, dict(clip_cov_lb=5.0, clip_cov_ub=1.0), "clip_cov_lb must be <="),
        (gj.kl_cov_loss, dict(kl_cov_ratio=-0.1), "kl_cov_ratio"),
        (gj.kl_cov_loss, dict(ppo_kl_coef=-1.0), "ppo_kl_coef"),
        (gj.kl_cov_loss, dict(log_ratio_clamp=0.0), "log_ratio_clamp"),
    ],
)
def test_bad_hyperparameters_are_named(fn, kwargs, match):
    x = jnp.zeros((2, 3))
    with pytest.raises(ValueError, match=match):
        fn(x, x, jnp.zeros(2), jnp.ones((2, 3), bool), **kwargs)


def test_every_loss_has_a_reference_test():
    # The module's public losses are exactly the ones tested above.
    tested = {"cispo_loss", "sapo_loss", "gmpo_loss", "dppo_loss", "clip_cov_loss", "kl_cov_loss"}
    from grpojax.ops import surrogates

    assert {n for n in surrogates.__all__ if n.endswith("_loss")} == tested
    assert all(n in gj.__all__ for n in tested)
