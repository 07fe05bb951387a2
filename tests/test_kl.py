"""KL estimators, reward shaping and controllers against NumPy references and exact enumeration.

Tolerances: float32 results vs float64 references rtol=1e-5, atol=1e-6 unless stated;
expectations by exact enumeration over a small categorical 1e-5; Monte Carlo means (200k
samples, fixed seed) 0.01 absolute, about 5 standard errors for these distributions.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpojax.ops.kl import (
    KLControllerState,
    adaptive_kl_controller,
    fixed_kl_controller,
    kl,
    kl_is_corrected,
    kl_penalty_rewards,
)

RTOL, ATOL = 1e-5, 1e-6


def np_estimator(logp, ref_logp, name):
    lr = np.float64(ref_logp) - np.float64(logp)  # log(pi_ref / pi_theta)
    return {
        "k1": -lr,
        "abs": np.abs(lr),
        "k2": 0.5 * lr**2,
        "k3": np.exp(lr) - lr - 1.0,
    }[name]


def np_log_softmax(z):
    z = np.float64(z)
    z = z - z.max()
    return z - np.log(np.exp(z).sum())


def small_categorical(seed, scale=1.0):
    """log pi_theta, log pi_ref, log pi_old over a vocabulary of 6, and the logits of pi_theta."""
    rng = np.random.default_rng(seed)
    theta = rng.normal(scale=scale, size=6)
    ref = rng.normal(scale=scale, size=6)
    old = theta + rng.normal(scale=0.3, size=6)
    return np_log_softmax(theta), np_log_softmax(ref), np_log_softmax(old), theta


def true_kl(logp, ref_logp):
    return float(np.sum(np.exp(logp) * (logp - ref_logp)))


@pytest.mark.parametrize("name", ["k1", "k2", "k3", "abs"])
def test_estimators_match_numpy(name):
    rng = np.random.default_rng(0)
    logp = rng.normal(-2.0, 1.0, size=(4, 7)).astype(np.float32)
    ref = rng.normal(-2.0, 1.0, size=(4, 7)).astype(np.float32)
    out = kl(logp, ref, estimator=name)
    assert out.shape == (4, 7) and out.dtype == jnp.float32
    np.testing.assert_allclose(out, np_estimator(logp, ref, name), rtol=RTOL, atol=ATOL)
    # bf16 inputs are computed in float32.
    out16 = kl(jnp.asarray(logp, jnp.bfloat16), jnp.asarray(ref, jnp.bfloat16), estimator=name)
    assert out16.dtype == jnp.float32


def test_k3_nonnegative_zero_at_equal_and_clamped():
    rng = np.random.default_rng(1)
    logp = rng.normal(-3.0, 4.0, size=2000).astype(np.float32)
    ref = logp + rng.normal(0.0, 1.0, size=2000).astype(np.float32) * rng.random(2000) ** 4
    out = np.asarray(kl(logp, ref, estimator="k3"))
    assert np.all(out >= 0)
    np.testing.assert_array_equal(kl(logp, logp, estimator="k3"), np.zeros(2000))
    # Tiny differences (k3 ~ d^2 / 2 = 5e-7): expm1(d) - d is off by a few ulp(d) at most,
    # where the naive exp(d) - 1 - d in float32 would be off by ~ulp(1) = 1.2e-7 (25%).
    d = np.float32(1e-3)
    exact = np.expm1(np.float64(d)) - np.float64(d)
    got = np.asarray(kl(jnp.zeros(1), jnp.full(1, d), estimator="k3"), np.float64)
    np.testing.assert_allclose(got, [exact], rtol=0, atol=4 * np.spacing(d))
    # A huge log-ratio stays finite: clamped to 20 -> exp(20) - 20 - 1.
    big = kl(jnp.array([-200.0]), jnp.array([0.0]), estimator="k3")
    np.testing.assert_allclose(big, [np.exp(20.0) - 21.0], rtol=1e-5)
    unclamped = kl(jnp.array([-200.0]), jnp.array([0.0]), estimator="k3", clamp=None)
    assert np.isinf(unclamped[0])


def test_k3_gradient():
    rng = np.random.default_rng(2)
    logp = jnp.asarray(rng.normal(-2.0, 1.0, size=(3, 5)), jnp.float32)
    ref = jnp.asarray(rng.normal(-2.0, 1.0, size=(3, 5)), jnp.float32)
    g = jax.grad(lambda lp: jnp.sum(kl(lp, ref, estimator="k3")))(logp)
    np.testing.assert_allclose(
        g, 1.0 - np.exp(np.float64(ref) - np.float64(logp)), rtol=1e-5, atol=1e-6
    )
    g0 = jax.grad(lambda lp: jnp.sum(kl(lp, lp * 1.0, estimator="k3")))(logp)
    assert np.all(np.isfinite(g0))


def test_unknown_estimator_lists_allowed():
    with pytest.raises(ValueError, match=r"estimator must be one of \('k1', 'k2', 'k3', 'abs'\)"):
        kl(jnp.zeros(2), jnp.zeros(2), estimator="low_var_kl")
    with pytest.raises(ValueError, match=r"^clamp must be None or a finite number > 0, got 0\.0$"):
        kl(jnp.zeros(2), jnp.zeros(2), estimator="k3", clamp=0.0)


@pytest.mark.parametrize("seed", [3, 4])
def test_k1_k3_unbiased_exact_and_monte_carlo(seed):
    logp, ref, _, _ = small_categorical(seed)
    p = np.exp(logp)
    target = true_kl(logp, ref)
    lp32, ref32 = logp.astype(np.float32), ref.astype(np.float32)
    for name in ["k1", "k3"]:
        # Exact expectation under pi_theta.
        exact = float(np.sum(p * np.asarray(kl(lp32, ref32, estimator=name), np.float64)))
        np.testing.assert_allclose(exact, target, rtol=1e-5, atol=1e-5)
        # Monte Carlo with sampled tokens.
        x = np.random.default_rng(seed).choice(6, size=200_000, p=p)
        mc = float(jnp.mean(kl(lp32[x], ref32[x], estimator=name)))
        assert abs(mc - target) < 0.01, (name, mc, target)
    # k2 is biased: its exact expectation is not the KL for these distributions.
    k2 = float(np.sum(p * np.asarray(kl(lp32, ref32, estimator="k2"))))
    assert abs(k2 - target) > 1e-3


@pytest.mark.parametrize("seed", [5, 6])
def test_is_corrected_value_and_gradient_unbiased(seed):
    logp, ref, old, theta = small_categorical(seed)
    p, p_old = np.exp(logp), np.exp(old)
    ref32, old32 = jnp.asarray(ref, jnp.float32), jnp.asarray(old, jnp.float32)

    def expected_under_old(th, corrected=True):
        lp = jax.nn.log_softmax(th)
        f = kl_is_corrected(lp, old32, ref32) if corrected else kl(lp, ref32, estimator="k3")
        return jnp.sum(jnp.asarray(p_old, jnp.float32) * f)

    th32 = jnp.asarray(theta, jnp.float32)
    # E_{x ~ pi_old}[ratio * k3] = KL(pi_theta || pi_ref), by exact enumeration.
    np.testing.assert_allclose(
        float(expected_under_old(th32)), true_kl(logp, ref), rtol=1e-5, atol=1e-5
    )
    # Its gradient equals the true KL gradient: dKL/dtheta_j = p_j (log(p_j/q_j) - KL).
    true_grad = p * (logp - ref - true_kl(logp, ref))
    g = jax.grad(expected_under_old)(th32)
    np.testing.assert_allclose(g, true_grad, rtol=1e-4, atol=1e-5)
    # Without the ratio (and pi_old != pi_theta) the gradient is biased.
    g_plain = jax.grad(lambda t: expected_under_old(t, corrected=False))(th32)
    assert np.max(np.abs(np.asarray(g_plain) - true_grad)) > 1e-2
    # Monte Carlo under pi_old samples.
    x = np.random.default_rng(seed).choice(6, size=200_000, p=p_old)
    lp32 = jnp.asarray(logp, jnp.float32)
    mc = float(jnp.mean(kl_is_corrected(lp32[x], old32[x], ref32[x])))
    assert abs(mc - true_kl(logp, ref)) < 0.01


def test_plain_k3_gradient_is_reverse_kl_gradient_on_policy():
    # At pi_old = pi_theta: E[grad k3] = p - q, the gradient of KL(pi_ref || pi_theta), not of
    # KL(pi_theta || pi_ref); the IS-corrected form gives the latter (tested above).
    logp, ref, _, theta = small_categorical(7)
    p, q = np.exp(logp), np.exp(ref)
    ref32 = jnp.asarray(ref, jnp.float32)
    g = jax.grad(
        lambda th: jnp.sum(
            jnp.asarray(p, jnp.float32) * kl(jax.nn.log_softmax(th), ref32, estimator="k3")
        )
    )(jnp.asarray(theta, jnp.float32))
    np.testing.assert_allclose(g, p - q, rtol=1e-4, atol=1e-5)


def test_is_corrected_matches_numpy_and_reduces_to_k3_on_policy():
    rng = np.random.default_rng(8)
    logp = rng.normal(-2.0, 1.0, size=(3, 6)).astype(np.float32)
    old = (logp + rng.normal(0.0, 0.2, size=(3, 6))).astype(np.float32)
    ref = rng.normal(-2.0, 1.0, size=(3, 6)).astype(np.float32)
    ref_np = np.exp(np.float64(logp) - np.float64(old)) * np_estimator(logp, ref, "k3")
    np.testing.assert_allclose(kl_is_corrected(logp, old, ref), ref_np, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        kl_is_corrected(logp, logp, ref), kl(logp, ref, estimator="k3"), rtol=1e-6, atol=1e-7
    )
    # Gradient w.r.t. logp: d/dlogp [e^(logp-old) * k3] = ratio * (k3 + 1 - exp(ref - logp)).
    g = jax.grad(lambda lp: jnp.sum(kl_is_corrected(lp, old, ref)))(jnp.asarray(logp))
    ratio = np.exp(np.float64(logp) - np.float64(old))
    expected = ratio * (np_estimator(logp, ref, "k3") + 1 - np.exp(np.float64(ref) - logp))
    np.testing.assert_allclose(g, expected, rtol=1e-4, atol=1e-6)
    assert np.all(np.asarray(kl_is_corrected(logp, old, ref)) >= 0)


@pytest.mark.parametrize("name", ["k1", "abs", "k2", "k3", "is_corrected"])
def test_mask_gives_zero_and_no_gradient_at_padding_even_with_nan_there(name):
    """The researcher's case: the reference's logprobs are NaN at padding. With `mask_nt` the
    values match NumPy at real tokens and are 0 at padding, and the gradient w.r.t. logp is
    finite and bitwise the one of a clean batch (zeros at padding)."""
    rng = np.random.default_rng(9)
    logp = rng.normal(-2.0, 1.0, size=(3, 5)).astype(np.float32)
    old = (logp + rng.normal(0.0, 0.2, size=(3, 5))).astype(np.float32)
    ref = rng.normal(-2.0, 1.0, size=(3, 5)).astype(np.float32)
    mask = np.arange(5)[None, :] < np.array([5, 2, 0])[:, None]
    if name == "is_corrected":
        fn = lambda lp, r, m: kl_is_corrected(lp, old, r, m)
        expected = np.exp(np.float64(logp) - old) * np_estimator(logp, ref, "k3")
    else:
        fn = lambda lp, r, m: kl(lp, r, m, estimator=name)
        expected = np_estimator(logp, ref, name)
    out = fn(logp, np.where(mask, ref, np.nan), mask)
    np.testing.assert_allclose(out, np.where(mask, expected, 0.0), rtol=RTOL, atol=ATOL)
    grad = jax.grad(lambda lp, r: jnp.sum(fn(lp, r, mask)))
    g_nan = np.asarray(grad(jnp.asarray(logp), jnp.asarray(np.where(mask, ref, np.nan))))
    g_clean = np.asarray(grad(jnp.asarray(logp), jnp.asarray(np.where(mask, ref, 0.0))))
    assert np.isfinite(g_nan).all()
    np.testing.assert_array_equal(g_nan, g_clean)
    np.testing.assert_array_equal(g_nan[~mask], 0.0)


def test_kl_penalty_rewards_seed_example():
    # Seed 002: R_RM = 0.8, KL = 0.05, beta = 6 -> R_total = 0.8 - 6 * 0.05 = 0.5.
    out = kl_penalty_rewards(
        jnp.array([0.8]),
        jnp.array([[-1.0]]),
        jnp.array([[-1.05]]),
        jnp.ones((1, 1)),
        beta=6.0,
        estimator="k1",
    )
    np.testing.assert_allclose(out, [[0.5]], rtol=1e-5)


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_kl_penalty_rewards_ragged(estimator):
    rng = np.random.default_rng(9)
    n, t = 4, 6
    lengths, offsets = np.array([6, 3, 1, 4]), np.array([0, 2, 5, 1])
    ts = np.arange(t)[None]
    m = (ts >= offsets[:, None]) & (ts < (offsets + lengths)[:, None])
    logp = rng.normal(-2, 1, size=(n, t)).astype(np.float32)
    ref = rng.normal(-2, 1, size=(n, t)).astype(np.float32)
    scores = rng.normal(size=n).astype(np.float32)
    out = kl_penalty_rewards(scores, logp, ref, m, beta=0.1, estimator=estimator)
    expected = np.zeros((n, t))
    for i in range(n):
        for j in range(offsets[i], offsets[i] + lengths[i]):
            expected[i, j] = -0.1 * np_estimator(logp[i, j], ref[i, j], estimator)
        expected[i, offsets[i] + lengths[i] - 1] += scores[i]
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
    jitted = jax.jit(lambda *a: kl_penalty_rewards(*a, beta=0.1, estimator=estimator))
    np.testing.assert_allclose(jitted(scores, logp, ref, m), out, rtol=1e-6, atol=1e-7)


def test_adaptive_controller_hand_computation_and_clipping():
    ctl = adaptive_kl_controller(0.2, target=6.0, horizon=10_000)
    s0 = ctl.init()
    assert isinstance(s0, KLControllerState) and s0.beta.dtype == jnp.float32
    s1 = ctl.update(s0, current_kl=6.6, n_steps=500)  # error 6.6/6 - 1 = 0.1, in the band
    np.testing.assert_allclose(s1.beta, 0.2 * (1 + 0.1 * 500 / 10_000), rtol=1e-6)
    s2 = ctl.update(s1, current_kl=3.0, n_steps=1000)  # error -0.5 clipped to -0.2
    np.testing.assert_allclose(s2.beta, 0.2 * 1.005 * (1 - 0.2 * 1000 / 10_000), rtol=1e-6)
    s3 = ctl.update(s0, current_kl=60.0, n_steps=10_000)  # error 9 clipped to +0.2
    np.testing.assert_allclose(s3.beta, 0.2 * 1.2, rtol=1e-6)
    s4 = ctl.update(s0, current_kl=6.0, n_steps=10_000)  # on target: unchanged
    np.testing.assert_allclose(s4.beta, 0.2, rtol=1e-6)
    # Jittable, with the controller closed over and traced KL / step counts.
    upd = jax.jit(lambda s, kl_, n: ctl.update(s, current_kl=kl_, n_steps=n))
    np.testing.assert_allclose(upd(s1, jnp.float32(3.0), jnp.int32(1000)).beta, s2.beta, rtol=1e-6)
    # Hashable: usable as a static argument.
    upd2 = jax.jit(lambda c, s: c.update(s, current_kl=6.6, n_steps=500), static_argnums=0)
    np.testing.assert_allclose(upd2(ctl, s0).beta, s1.beta, rtol=1e-6)


def test_fixed_controller_and_validation():
    ctl = fixed_kl_controller(0.05)
    s = ctl.init()
    s2 = jax.jit(lambda s: ctl.update(s, current_kl=100.0, n_steps=10))(s)
    np.testing.assert_allclose(s2.beta, 0.05, rtol=1e-7)
    with pytest.raises(ValueError, match=r"^target must be None or a finite number > 0, got 0\.0$"):
        adaptive_kl_controller(0.1, target=0.0, horizon=10)
    with pytest.raises(ValueError, match=r"^horizon must be None or a finite number > 0, got -1"):
        adaptive_kl_controller(0.1, target=1.0, horizon=-1)
    with pytest.raises(ValueError, match=r"^init_beta must be a finite number >= 0, got -0\.1$"):
        fixed_kl_controller(-0.1)


def test_kl_jit_vmap_grad():
    rng = np.random.default_rng(10)
    logp = rng.normal(-2, 1, size=(2, 3, 4)).astype(np.float32)
    ref = rng.normal(-2, 1, size=(2, 3, 4)).astype(np.float32)
    for name in ["k1", "k2", "k3", "abs"]:
        f = lambda a, b, name=name: kl(a, b, estimator=name)
        np.testing.assert_allclose(jax.jit(f)(logp[0], ref[0]), f(logp[0], ref[0]), rtol=1e-6)
        np.testing.assert_allclose(jax.vmap(f)(logp, ref), f(logp, ref), rtol=1e-6)
        g = jax.grad(lambda a, f=f: jnp.sum(f(a, ref[0])))(jnp.asarray(logp[0]))
        assert np.all(np.isfinite(g))
    # k1 and k2 gradients by hand: 1 and (logp - ref).
    g1 = jax.grad(lambda a: jnp.sum(kl(a, ref, estimator="k1")))(jnp.asarray(logp))
    np.testing.assert_allclose(g1, np.ones_like(logp))
    g2 = jax.grad(lambda a: jnp.sum(kl(a, ref, estimator="k2")))(jnp.asarray(logp))
    np.testing.assert_allclose(g2, logp - ref, rtol=1e-6, atol=1e-6)
