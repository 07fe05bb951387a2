"""Advantages and returns against independent NumPy references and the seeds' worked numbers.

Tolerances: float32 results vs float64 NumPy references use rtol=1e-5, atol=1e-6 unless
stated otherwise; quantities the seeds print with two decimals are checked to 0.01.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpojax.ops.advantages import (
    gae,
    group_advantages,
    last_token_mask,
    reinforce_pp_baseline_advantages,
    reinforce_pp_returns,
    rloo_advantages,
    whiten,
)

RTOL, ATOL = 1e-5, 1e-6


# ---------------------------------------------------------------- NumPy references


def np_gae_compressed(r, v, m, gamma, lam):
    """GAE as the explicit sum A_i = sum_j (gamma lam)^(j-i) delta_j over each row's real tokens."""
    r, v, m = np.float64(r), np.float64(v), np.asarray(m, bool)
    adv = np.zeros_like(r)
    for n in range(r.shape[0]):
        idx = np.nonzero(m[n])[0]
        rc, vc = r[n, idx], v[n, idx]
        v_next = np.append(vc[1:], 0.0)
        delta = rc + gamma * v_next - vc
        L = len(idx)
        for i in range(L):
            adv[n, idx[i]] = sum((gamma * lam) ** (j - i) * delta[j] for j in range(i, L))
    returns = np.where(m, adv + v, 0.0)
    return adv, returns


def np_gae_contiguous(r, v, m, gamma, lam):
    """The masked recursion as written in the brief, valid for contiguous masks."""
    r, v = np.float64(r), np.float64(v)
    m = np.asarray(m, np.float64)
    n_rows, t_len = r.shape
    adv = np.zeros_like(r)
    for n in range(n_rows):
        a_next = 0.0
        for t in reversed(range(t_len)):
            v_next = v[n, t + 1] if t + 1 < t_len else 0.0
            m_next = m[n, t + 1] if t + 1 < t_len else 0.0
            delta = r[n, t] + gamma * v_next * m_next - v[n, t]
            a = delta + gamma * lam * m_next * a_next
            adv[n, t] = a * m[n, t]
            a_next = a
    return adv, np.where(m > 0, adv + v, 0.0)


def np_reward_to_go(r, m, gamma):
    r, m = np.float64(r), np.asarray(m, bool)
    out = np.zeros_like(r)
    for n in range(r.shape[0]):
        idx = list(np.nonzero(m[n])[0])
        for i, t in enumerate(idx):
            out[n, t] = sum(gamma**k * r[n, idx[i + k]] for k in range(len(idx) - i))
    return out


def np_group_adv(r, G, scale, eps, std, valid=None):
    r = np.float64(r)
    valid = np.ones(r.shape, bool) if valid is None else np.asarray(valid, bool)
    ddof = 1 if std == "unbiased" else 0
    out = np.zeros_like(r)
    batch_std = np.std(r[valid], ddof=ddof)
    for b in range(len(r) // G):
        sl = slice(b * G, (b + 1) * G)
        rg, vg = r[sl], valid[sl]
        vals = rg[vg]
        if len(vals) == 0 or np.all(vals == vals[0]):
            continue
        centered = np.where(vg, rg - vals.mean(), 0.0)
        if scale == "group":
            centered = centered / (np.std(vals, ddof=ddof) + eps)
        elif scale == "batch":
            centered = centered / (batch_std + eps)
        out[sl] = centered
    return out


def np_rloo(r, G):
    r = np.float64(r)
    out = np.zeros_like(r)
    for i in range(len(r)):
        g = i // G
        others = [r[j] for j in range(g * G, (g + 1) * G) if j != i]
        out[i] = r[i] - np.mean(others)
    return out


def np_whiten(x, m, shift_mean, eps, ddof):
    x, m = np.float64(x), np.asarray(m, bool)
    vals = x[m]
    mean, var = vals.mean(), vals.var(ddof=ddof)
    y = (x - mean) / np.sqrt(var + eps)
    if not shift_mean:
        y = y + mean
    return np.where(m, y, 0.0)


def ragged_masks(rng, n, t, *, left=False, holes=False):
    """Random masks with lengths >= 1; optionally a left offset and interior holes."""
    lengths = rng.integers(1, t + 1, size=n)
    offsets = np.array([rng.integers(0, t - L + 1) for L in lengths]) if left else np.zeros(n, int)
    ts = np.arange(t)[None, :]
    m = (ts >= offsets[:, None]) & (ts < (offsets + lengths)[:, None])
    if holes:
        hole = rng.random((n, t)) < 0.25
        keep_first = ts == offsets[:, None]  # never empty a row
        m = m & (~hole | keep_first)
    return m


# ---------------------------------------------------------------- GAE


def test_gae_seed_example():
    # Seed 002: reward only on the final token r_T = 0.5, V(s_T) = 0.3, V(s_{T-1}) = 0.25,
    # gamma = 0.99, lam = 0.95 (its table). Hand computation:
    #   delta_T = 0.5 - 0.3 = 0.2;  A_T = 0.2
    #   delta_{T-1} = 0 + 0.99 * 0.3 - 0.25 = 0.047;  A_{T-1} = 0.047 + 0.99 * 0.95 * 0.2 = 0.2351
    adv, ret = gae(
        jnp.array([[0.0, 0.5]]), jnp.array([[0.25, 0.3]]), jnp.ones((1, 2)), gamma=0.99, lam=0.95
    )
    np.testing.assert_allclose(adv, [[0.2351, 0.2]], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(ret, [[0.2351 + 0.25, 0.5]], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize(
    "gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (0.5, 0.7), (0.0, 1.0)]
)
@pytest.mark.parametrize("layout", ["right", "left", "holes"])
def test_gae_matches_numpy(gamma, lam, layout):
    rng = np.random.default_rng(0)
    n, t = 6, 9
    m = ragged_masks(rng, n, t, left=layout != "right", holes=layout == "holes")
    r = rng.normal(size=(n, t)).astype(np.float32)
    v = rng.normal(size=(n, t)).astype(np.float32)
    adv, ret = gae(r, v, m, gamma=gamma, lam=lam)
    ref_adv, ref_ret = np_gae_compressed(r, v, m, gamma, lam)
    np.testing.assert_allclose(adv, ref_adv, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(ret, ref_ret, rtol=RTOL, atol=ATOL)
    if layout != "holes":  # the brief's m_{t+1} recursion holds for contiguous masks
        ref_adv2, ref_ret2 = np_gae_contiguous(r, v, m, gamma, lam)
        np.testing.assert_allclose(adv, ref_adv2, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(ret, ref_ret2, rtol=RTOL, atol=ATOL)
    assert adv.dtype == jnp.float32 and ret.dtype == jnp.float32
    assert np.all(np.asarray(adv)[~m] == 0) and np.all(np.asarray(ret)[~m] == 0)


def test_gae_lambda_one_gamma_one_returns_are_reward_to_go():
    rng = np.random.default_rng(1)
    m = ragged_masks(rng, 5, 8, left=True)
    r = rng.normal(size=(5, 8)).astype(np.float32)
    v = rng.normal(size=(5, 8)).astype(np.float32)
    _, ret = gae(r, v, m, gamma=1.0, lam=1.0)
    np.testing.assert_allclose(ret, np_reward_to_go(r, m, 1.0), rtol=RTOL, atol=ATOL)


def test_gae_padding_invariance_and_garbage_in_padding():
    rng = np.random.default_rng(2)
    n, t, extra = 4, 7, 5
    m = ragged_masks(rng, n, t, left=True)
    r = rng.normal(size=(n, t)).astype(np.float32)
    v = rng.normal(size=(n, t)).astype(np.float32)
    adv, ret = gae(r, v, m, gamma=0.97, lam=0.9)
    # Appending padding (holding NaN and huge values) and filling masked slots with garbage
    # must change nothing.
    pad_r = np.concatenate([np.where(m, r, np.nan), np.full((n, extra), 1e30)], 1)
    pad_v = np.concatenate([np.where(m, v, -1e30), np.full((n, extra), np.nan)], 1)
    pad_m = np.concatenate([m, np.zeros((n, extra), bool)], 1)
    adv2, ret2 = gae(pad_r, pad_v, pad_m, gamma=0.97, lam=0.9)
    np.testing.assert_array_equal(adv2[:, :t], adv)
    np.testing.assert_array_equal(ret2[:, :t], ret)
    assert np.all(np.asarray(adv2)[:, t:] == 0) and np.all(np.isfinite(adv2))


def test_gae_left_offset_equals_shifted_right_padding():
    rng = np.random.default_rng(3)
    r = rng.normal(size=(1, 4)).astype(np.float32)
    v = rng.normal(size=(1, 4)).astype(np.float32)
    right = gae(
        np.pad(r, ((0, 0), (0, 3))),
        np.pad(v, ((0, 0), (0, 3))),
        np.arange(7)[None] < 4,
        gamma=0.9,
        lam=0.8,
    )[0]
    left = gae(
        np.pad(r, ((0, 0), (3, 0))),
        np.pad(v, ((0, 0), (3, 0))),
        np.arange(7)[None] >= 3,
        gamma=0.9,
        lam=0.8,
    )[0]
    np.testing.assert_allclose(np.asarray(right)[:, :4], np.asarray(left)[:, 3:], rtol=RTOL)


def test_gae_jit_vmap_grad():
    rng = np.random.default_rng(4)
    n, t = 3, 6
    m = ragged_masks(rng, n, t, left=True)
    r = rng.normal(size=(n, t)).astype(np.float32)
    v = rng.normal(size=(n, t)).astype(np.float32)
    f = lambda r, v, m: gae(r, v, m, gamma=0.99, lam=0.95)
    eager = f(r, v, m)
    jitted = jax.jit(f)(r, v, m)
    np.testing.assert_allclose(jitted[0], eager[0], rtol=RTOL, atol=ATOL)
    # vmap over an extra leading axis equals a Python loop.
    rs, vs = np.stack([r, 2 * r]), np.stack([v, -v])
    batched = jax.vmap(f, in_axes=(0, 0, None))(rs, vs, m)[0]
    for k in range(2):
        np.testing.assert_allclose(batched[k], f(rs[k], vs[k], m)[0], rtol=RTOL, atol=ATOL)
    # d/dv of a weighted sum of advantages vs central finite differences of the NumPy reference.
    w = rng.normal(size=(n, t))
    g = jax.grad(lambda v: jnp.sum(f(r, v, m)[0] * w))(jnp.asarray(v))
    h = 1e-6
    num = np.zeros((n, t))
    for i in range(n):
        for j in range(t):
            vp, vm = np.float64(v), np.float64(v)
            vp[i, j] += h
            vm[i, j] -= h
            num[i, j] = (
                np.sum(np_gae_compressed(r, vp, m, 0.99, 0.95)[0] * w)
                - np.sum(np_gae_compressed(r, vm, m, 0.99, 0.95)[0] * w)
            ) / (2 * h)
    np.testing.assert_allclose(g, num, rtol=1e-4, atol=1e-5)


def test_gae_bad_input():
    with pytest.raises(ValueError, match="gamma"):
        gae(jnp.ones((1, 2)), jnp.ones((1, 2)), jnp.ones((1, 2)), gamma=1.5, lam=0.9)
    with pytest.raises(ValueError, match="same shape"):
        gae(jnp.ones((1, 2)), jnp.ones((1, 3)), jnp.ones((1, 2)), gamma=1.0, lam=0.9)


# ---------------------------------------------------------------- group advantages


def test_group_advantages_seed_example():
    # Seed 002: rewards [1.0, 0.8, 0.4, 0.2], mean 0.6, std 0.32 -> about [+1.26, +0.63, -0.63,
    # -1.26] (the seed rounds to 1.25 after rounding the std). Population std = sqrt(0.1).
    r = jnp.array([1.0, 0.8, 0.4, 0.2])
    adv = group_advantages(r, group_size=4, std="population")
    np.testing.assert_allclose(adv, [1.26, 0.63, -0.63, -1.26], atol=0.01)
    exact = (np.array([1.0, 0.8, 0.4, 0.2]) - 0.6) / (np.sqrt(0.1) + 1e-6)
    np.testing.assert_allclose(adv, exact, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("std", ["population", "unbiased"])
@pytest.mark.parametrize("with_mask", [False, True])
def test_group_advantages_match_numpy(scale, std, with_mask):
    rng = np.random.default_rng(5)
    B, G = 5, 4
    r = rng.normal(size=B * G).astype(np.float32)
    r[4:8] = 0.3  # an all-equal group
    valid = rng.random(B * G) > 0.3 if with_mask else None
    adv = group_advantages(r, group_size=G, scale=scale, std=std, eps=1e-6, mask_n=valid)
    ref = np_group_adv(r, G, scale, 1e-6, std, valid)
    np.testing.assert_allclose(adv, ref, rtol=RTOL, atol=ATOL)
    if with_mask:
        assert np.all(np.asarray(adv)[~valid] == 0)


def test_group_advantages_mask_equals_dropping_samples():
    # Invalid samples are out of the statistics: same as computing on the valid ones alone.
    r = np.array([1.0, 0.0, 5.0, 0.5, 2.0, 3.0, -1.0, 7.0], np.float32)
    valid = np.array([1, 1, 0, 1, 1, 1, 1, 0], bool)
    adv = np.asarray(group_advantages(r, group_size=4, mask_n=valid, eps=0.0))
    for g in range(2):
        sl = slice(4 * g, 4 * g + 4)
        sub = r[sl][valid[sl]]
        expected = group_advantages(sub, group_size=len(sub), eps=0.0)
        np.testing.assert_allclose(adv[sl][valid[sl]], expected, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("std", ["population", "unbiased"])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("eps", [1e-6, 0.0])
def test_all_equal_group_is_exactly_zero(std, scale, eps):
    # 0.1 is not representable: float32 (r - mean) over such a group is not exactly 0.
    r = jnp.array([0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.7, 0.7, 0.7])
    adv = group_advantages(r, group_size=3, scale=scale, std=std, eps=eps)
    np.testing.assert_array_equal(adv, np.zeros(9))
    g = jax.grad(
        lambda r: jnp.sum(
            group_advantages(r, group_size=3, scale=scale, std=std, eps=eps) * jnp.arange(9.0)
        )
    )(r)
    assert np.all(np.isfinite(g))


def test_unbiased_vs_population_factor():
    rng = np.random.default_rng(6)
    G = 5
    r = rng.normal(size=4 * G).astype(np.float32)
    pop = group_advantages(r, group_size=G, std="population", eps=0.0)
    unb = group_advantages(r, group_size=G, std="unbiased", eps=0.0)
    np.testing.assert_allclose(np.asarray(pop), np.asarray(unb) * np.sqrt(G / (G - 1)), rtol=RTOL)


def test_group_advantages_permutation_and_padding_free():
    rng = np.random.default_rng(7)
    B, G = 3, 6
    r = rng.normal(size=B * G).astype(np.float32)
    perm = np.concatenate([g * G + rng.permutation(G) for g in range(B)])
    for scale in ["group", "batch", "none"]:
        a = np.asarray(group_advantages(r, group_size=G, scale=scale))
        b = np.asarray(group_advantages(r[perm], group_size=G, scale=scale))
        np.testing.assert_allclose(b, a[perm], rtol=RTOL, atol=ATOL)
        # Group-level statistics: each group's advantages sum to 0.
        np.testing.assert_allclose(a.reshape(B, G).sum(1), 0.0, atol=1e-5)


def test_group_advantages_bad_input():
    r = jnp.arange(6.0)
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        group_advantages(r, group_size=1)
    with pytest.raises(ValueError, match="not divisible"):
        group_advantages(r, group_size=4)
    with pytest.raises(ValueError, match="group, batch, none"):
        group_advantages(r, group_size=3, scale="std")
    with pytest.raises(ValueError, match="population, unbiased"):
        group_advantages(r, group_size=3, std="sample")
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(r.reshape(2, 3), group_size=3)


def test_group_advantages_jit_vmap():
    rng = np.random.default_rng(8)
    r = rng.normal(size=(3, 8)).astype(np.float32)
    f = lambda r: group_advantages(r, group_size=4, scale="group", std="unbiased")
    np.testing.assert_allclose(jax.jit(f)(r[0]), f(r[0]), rtol=RTOL, atol=ATOL)
    batched = jax.vmap(f)(r)
    for k in range(3):
        np.testing.assert_allclose(batched[k], f(r[k]), rtol=RTOL, atol=ATOL)


# ---------------------------------------------------------------- RLOO


def test_rloo_matches_numpy_and_identity():
    rng = np.random.default_rng(9)
    G = 4
    r = rng.normal(size=3 * G).astype(np.float32)
    adv = rloo_advantages(r, group_size=G)
    np.testing.assert_allclose(adv, np_rloo(r, G), rtol=RTOL, atol=ATOL)
    # RLOO = G/(G-1) times the Dr.GRPO (mean-only) advantage.
    drgrpo = group_advantages(r, group_size=G, scale="none")
    np.testing.assert_allclose(adv, G / (G - 1) * np.asarray(drgrpo), rtol=1e-5, atol=1e-5)


def test_rloo_hand_example_and_mask():
    # Hand: rewards [0, 1, 0, 1]; A_0 = 0 - 2/3, A_1 = 1 - 1/3.
    adv = rloo_advantages(jnp.array([0.0, 1.0, 0.0, 1.0]), group_size=4)
    np.testing.assert_allclose(adv, [-2 / 3, 2 / 3, -2 / 3, 2 / 3], rtol=RTOL)
    # Sample 2 is invalid: baselines use the other valid ones, A_0 = 0 - (1 + 1)/2, A_1 = 1 - 1/2.
    adv = rloo_advantages(
        jnp.array([0.0, 1.0, 9.0, 1.0]), group_size=4, mask_n=jnp.array([True, True, False, True])
    )
    np.testing.assert_allclose(adv, [-1.0, 0.5, 0.0, 0.5], rtol=RTOL)
    # One valid sample: no leave-one-out baseline, advantage 0. All equal: exactly 0.
    adv = rloo_advantages(
        jnp.array([3.0, 1.0, 0.1, 0.1]), group_size=2, mask_n=jnp.array([True, False, True, True])
    )
    np.testing.assert_array_equal(adv, [0.0, 0.0, 0.0, 0.0])


def test_rloo_bad_input():
    with pytest.raises(ValueError, match="leave-one-out"):
        rloo_advantages(jnp.ones(4), group_size=1)
    with pytest.raises(ValueError, match="not divisible"):
        rloo_advantages(jnp.ones(5), group_size=2)


# ---------------------------------------------------------------- REINFORCE++ and whitening


@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.0])
@pytest.mark.parametrize("layout", ["right", "left", "holes"])
def test_reinforce_pp_returns_match_numpy(gamma, layout):
    rng = np.random.default_rng(10)
    m = ragged_masks(rng, 5, 7, left=layout != "right", holes=layout == "holes")
    r = rng.normal(size=(5, 7)).astype(np.float32)
    out = reinforce_pp_returns(r, m, gamma=gamma)
    np.testing.assert_allclose(out, np_reward_to_go(r, m, gamma), rtol=RTOL, atol=ATOL)
    assert np.all(np.asarray(out)[~m] == 0)


def test_reinforce_pp_returns_hand():
    # rewards [1, 2, 3] then padding, gamma 0.5: G = [1 + 0.5*2 + 0.25*3, 2 + 0.5*3, 3].
    out = reinforce_pp_returns(
        jnp.array([[1.0, 2.0, 3.0, 4.0]]), jnp.array([[1, 1, 1, 0]]), gamma=0.5
    )
    np.testing.assert_allclose(out, [[2.75, 3.5, 3.0, 0.0]], rtol=RTOL)


@pytest.mark.parametrize("shift_mean", [True, False])
@pytest.mark.parametrize("unbiased", [False, True])
def test_whiten_matches_numpy(shift_mean, unbiased):
    rng = np.random.default_rng(11)
    x = rng.normal(2.0, 3.0, size=(6, 9)).astype(np.float32)
    m = ragged_masks(rng, 6, 9, left=True)
    y = whiten(x, m, shift_mean=shift_mean, unbiased=unbiased)
    ref = np_whiten(x, m, shift_mean, 1e-8, int(unbiased))
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)
    if shift_mean and not unbiased:
        vals = np.asarray(y, np.float64)[m]
        np.testing.assert_allclose([vals.mean(), vals.var()], [0.0, 1.0], atol=1e-5)


def test_whiten_padding_invariance_and_bad_eps():
    rng = np.random.default_rng(12)
    x = rng.normal(size=(3, 5)).astype(np.float32)
    m = ragged_masks(rng, 3, 5)
    y = whiten(x, m)
    y2 = whiten(
        np.concatenate([np.where(m, x, 1e6), np.full((3, 4), np.nan)], 1),
        np.concatenate([m, np.zeros((3, 4), bool)], 1),
    )
    np.testing.assert_allclose(np.asarray(y2)[:, :5], y, rtol=RTOL, atol=ATOL)
    with pytest.raises(ValueError, match="eps"):
        whiten(x, m, eps=0.0)


def np_reinforce_pp_baseline(r, m, G, token_r, eps):
    """OpenRLHF REINFORCE++-baseline: group mean, last-token score, reward-to-go, whiten."""
    r = np.float64(r)
    centered = r - np.repeat(r.reshape(-1, G).mean(1), G)
    tok = np.zeros(m.shape) if token_r is None else np.float64(token_r).copy()
    for n in range(len(r)):
        last = np.nonzero(m[n])[0][-1]
        tok[n, last] += centered[n]
    ret = np_reward_to_go(tok, m, 1.0)
    return np_whiten(ret, m, True, eps, 0)


@pytest.mark.parametrize("with_token_rewards", [False, True])
def test_reinforce_pp_baseline_matches_numpy(with_token_rewards):
    rng = np.random.default_rng(13)
    G, N, T = 3, 6, 8
    r = rng.normal(size=N).astype(np.float32)
    m = ragged_masks(rng, N, T, left=True)
    tok = (-0.1 * rng.random((N, T))).astype(np.float32) if with_token_rewards else None
    adv = reinforce_pp_baseline_advantages(r, m, group_size=G, token_rewards_nt=tok)
    ref = np_reinforce_pp_baseline(r, m, G, tok, 1e-8)
    np.testing.assert_allclose(adv, ref, rtol=1e-5, atol=1e-5)
    if not with_token_rewards:
        # Without token rewards every real token of a row carries the same advantage.
        a = np.asarray(adv)
        for n in range(N):
            np.testing.assert_allclose(a[n][m[n]], a[n][m[n]][0], rtol=1e-6)


def test_reinforce_pp_baseline_invalid_samples():
    rng = np.random.default_rng(14)
    r = rng.normal(size=4).astype(np.float32)
    m = ragged_masks(rng, 4, 5)
    valid = np.array([True, True, False, True])
    adv = np.asarray(reinforce_pp_baseline_advantages(r, m, group_size=2, mask_n=valid))
    assert np.all(adv[2] == 0) and np.all(adv[~m] == 0)
    # Sample 3 is alone in its group after masking, so its centred reward is exactly 0; the
    # whitening then only sees group 0's tokens plus sample 3's zeros.
    keep = [0, 1, 3]
    centered = np.array([r[0] - r[:2].mean(), r[1] - r[:2].mean(), 0.0])
    ret = np.where(m[keep], centered[:, None], 0.0)
    np.testing.assert_allclose(
        adv[keep], np_whiten(ret, m[keep], True, 1e-8, 0), rtol=1e-5, atol=1e-5
    )


def test_last_token_mask():
    m = jnp.array([[1, 1, 0, 0], [0, 1, 1, 1], [0, 0, 0, 0], [0, 1, 0, 0]])
    expected = np.array([[0, 1, 0, 0], [0, 0, 0, 1], [0, 0, 0, 0], [0, 1, 0, 0]], bool)
    np.testing.assert_array_equal(last_token_mask(m), expected)
