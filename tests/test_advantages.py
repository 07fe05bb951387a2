"""Advantages and returns against independent NumPy references and the seeds' worked numbers.

Tolerances: float32 results vs float64 NumPy references use rtol=1e-5, atol=1e-6 unless
stated otherwise; quantities the seeds print with two decimals are checked to 0.01.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpojax.ops.advantages import (
    gae,
    gdpo_advantages,
    gpg_advantages,
    group_advantages,
    last_token_mask,
    maxrl_advantages,
    opo_advantages,
    pass_at_k_advantages,
    reinforce_pp_baseline_advantages,
    reinforce_pp_returns,
    remax_advantages,
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
    with pytest.raises(ValueError, match=r"scale must be one of \('group', 'batch', 'none'\)"):
        group_advantages(r, group_size=3, scale="std")
    with pytest.raises(ValueError, match=r"std must be one of \('population', 'unbiased'\)"):
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


# ---------------------------------------------------------------- Pass@k, OPO, GPG, MaxRL, GDPO,
# ReMax. References follow each paper's definition; invalid samples (mask_n false) are simply
# absent from every statistic and get 0, as in group_advantages.


def np_pass_at_k_bruteforce(r, G, k, eps, valid=None):
    """Pass@k Training's bootstrap, enumerated: every k-subset of a group's valid samples
    scores max(correct); subset scores are normalised over all subsets (population std);
    a sample's advantage is the mean normalised score of the subsets that contain it."""
    r = np.asarray(r, np.float64)
    valid = np.ones(len(r), bool) if valid is None else np.asarray(valid, bool)
    out = np.zeros(len(r))
    for b in range(len(r) // G):
        idx = [j for j in range(b * G, (b + 1) * G) if valid[j]]
        if len(idx) < k:
            continue
        subsets = list(itertools.combinations(idx, k))
        scores = np.array([max(float(r[j] > 0.5) for j in s) for s in subsets])
        mean, std = scores.mean(), scores.std()
        if std == 0:
            continue
        norm = (scores - mean) / (std + eps)
        for j in idx:
            out[j] = np.mean([a for a, s in zip(norm, subsets) if j in s])
    return out


@pytest.mark.parametrize("G", [4, 5, 6])
@pytest.mark.parametrize("with_mask", [False, True])
def test_pass_at_k_matches_enumeration_of_all_k_subsets(G, with_mask):
    rng = np.random.default_rng(20 + G)
    B = 6
    r = (rng.random(B * G) < 0.4).astype(np.float32)
    r[:G] = 1.0  # an all-correct group
    r[G : 2 * G] = 0.0  # an all-incorrect group
    r[2 * G : 3 * G] = 0.0
    r[2 * G] = 1.0  # exactly one correct
    valid = rng.random(B * G) > 0.25 if with_mask else None
    for k in range(1, G + 1):
        adv = pass_at_k_advantages(r, group_size=G, k=k, mask_n=valid)
        ref = np_pass_at_k_bruteforce(r, G, k, 1e-6, valid)
        np.testing.assert_allclose(adv, ref, rtol=RTOL, atol=ATOL, err_msg=f"k={k}")
        assert adv.dtype == jnp.float32
    if with_mask:
        assert np.all(np.asarray(adv)[~valid] == 0)
    # Not vacuous: some k gives nonzero advantages of both signs.
    ref2 = np_pass_at_k_bruteforce(r, G, 2, 1e-6, valid)
    assert (ref2 > 0).any() and (ref2 < 0).any()


def test_pass_at_k_closed_form_hand_example_and_k1_is_grpo():
    # G = 4, one correct: pass@2 = 1 - C(3,2)/C(4,2) = 1/2, std 1/2; correct: (1 - 1/2)/(1/2) = 1;
    # incorrect: (1 - 1/2 - C(2,1)/C(3,1)) / (1/2) = -1/3.
    adv = pass_at_k_advantages(jnp.array([1.0, 0.0, 0.0, 0.0]), group_size=4, k=2, eps=0.0)
    np.testing.assert_allclose(adv, [1.0, -1 / 3, -1 / 3, -1 / 3], rtol=1e-6)
    rng = np.random.default_rng(30)
    r = (rng.random(24) < 0.5).astype(np.float32)
    np.testing.assert_allclose(
        pass_at_k_advantages(r, group_size=6, k=1),
        group_advantages(r, group_size=6, std="population"),
        rtol=RTOL,
        atol=ATOL,
    )


def np_opo(r, lengths, G, valid=None):
    r, lengths = np.float64(r), np.float64(lengths)
    valid = np.ones(len(r), bool) if valid is None else np.asarray(valid, bool)
    out = np.zeros(len(r))
    for b in range(len(r) // G):
        idx = [j for j in range(b * G, (b + 1) * G) if valid[j]]
        vals = r[idx]
        total = lengths[idx].sum()
        if len(idx) == 0 or total == 0 or np.all(vals == vals[0]):
            continue
        baseline = sum(lengths[j] * r[j] for j in idx) / total
        for j in idx:
            out[j] = r[j] - baseline
    return out


@pytest.mark.parametrize("with_mask", [False, True])
def test_opo_length_weighted_baseline(with_mask):
    rng = np.random.default_rng(31)
    G, B = 4, 5
    r = rng.normal(size=B * G).astype(np.float32)
    r[4:8] = 0.25
    lengths = rng.integers(1, 50, B * G)
    lengths[16:20] = 0  # a group with no tokens
    valid = rng.random(B * G) > 0.3 if with_mask else None
    adv = opo_advantages(r, lengths, group_size=G, mask_n=valid)
    np.testing.assert_allclose(adv, np_opo(r, lengths, G, valid), rtol=RTOL, atol=ATOL)
    # Equal lengths: the plain group mean (Dr.GRPO).
    same = opo_advantages(r, np.full(B * G, 7), group_size=G)
    np.testing.assert_allclose(same, group_advantages(r, group_size=G, scale="none"), atol=1e-6)


def np_gpg(r, G, f_norm, valid=None):
    r = np.float64(r)
    valid = np.ones(len(r), bool) if valid is None else np.asarray(valid, bool)
    centered = np.zeros(len(r))
    informative = 0
    for b in range(len(r) // G):
        idx = [j for j in range(b * G, (b + 1) * G) if valid[j]]
        vals = r[idx]
        if len(idx) == 0 or np.all(vals == vals[0]):
            continue
        informative += len(idx)
        for j in idx:
            centered[j] = r[j] - vals.mean()
    total = valid.sum()  # B in the paper: the batch's samples; M = total - informative
    alpha = total / (total - (total - informative)) if informative else 0.0
    return alpha * centered / f_norm


@pytest.mark.parametrize("with_mask", [False, True])
@pytest.mark.parametrize("f_norm", [1.0, 0.5])
def test_gpg_rescales_by_the_informative_fraction(with_mask, f_norm):
    rng = np.random.default_rng(32)
    G, B = 4, 6
    r = (rng.random(B * G) < 0.5).astype(np.float32)
    r[:4], r[4:8] = 1.0, 0.0  # two groups without signal
    valid = rng.random(B * G) > 0.2 if with_mask else None
    adv = gpg_advantages(r, group_size=G, f_norm=f_norm, mask_n=valid)
    np.testing.assert_allclose(adv, np_gpg(r, G, f_norm, valid), rtol=RTOL, atol=ATOL)
    # Hand check: 16 samples, 8 of them in the two groups without signal, alpha = 16 / 8.
    hand = gpg_advantages(
        jnp.array([1.0, 1, 1, 1, 0, 0, 0, 0, 1, 0, 0, 0, 1, 1, 0, 0]), group_size=4, f_norm=f_norm
    )
    expected = 2.0 / f_norm * np.array([0] * 8 + [0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5])
    np.testing.assert_allclose(hand, expected, rtol=1e-6)
    zero = gpg_advantages(jnp.ones(8), group_size=4)
    np.testing.assert_array_equal(zero, np.zeros(8))


def np_maxrl(r, G, eps, valid=None):
    r = np.float64(r)
    valid = np.ones(len(r), bool) if valid is None else np.asarray(valid, bool)
    out = np.zeros(len(r))
    for b in range(len(r) // G):
        idx = [j for j in range(b * G, (b + 1) * G) if valid[j]]
        vals = r[idx]
        if len(idx) == 0 or np.all(vals == vals[0]):
            continue
        for j in idx:
            out[j] = (r[j] - vals.mean()) / (vals.mean() + eps)
    return out


@pytest.mark.parametrize("with_mask", [False, True])
def test_maxrl_divides_by_the_group_mean(with_mask):
    rng = np.random.default_rng(33)
    G, B = 8, 5
    r = (rng.random(B * G) < 0.3).astype(np.float32)
    r[:G] = 0.0
    valid = rng.random(B * G) > 0.2 if with_mask else None
    adv = maxrl_advantages(r, group_size=G, eps=1e-6, mask_n=valid)
    np.testing.assert_allclose(adv, np_maxrl(r, G, 1e-6, valid), rtol=RTOL, atol=ATOL)
    # One success in G = 4: mean 1/4, the success gets (3/4)/(1/4) = 3, failures -1.
    adv = maxrl_advantages(jnp.array([0.0, 1.0, 0.0, 0.0]), group_size=4, eps=0.0)
    np.testing.assert_allclose(adv, [-1.0, 3.0, -1.0, -1.0], rtol=1e-6)


def np_gdpo(r_nr, G, eps, weights, unbiased, valid=None):
    r_nr = np.float64(r_nr)
    n, R = r_nr.shape
    valid = np.ones(n, bool) if valid is None else np.asarray(valid, bool)
    w = np.ones(R) if weights is None else np.float64(weights)
    ddof = int(unbiased)
    total = np.zeros(n)
    for k in range(R):
        total += w[k] * np_group_adv(
            r_nr[:, k], G, "group", eps, ["population", "unbiased"][ddof], valid
        )
    vals = total[valid]
    return np.where(valid, (total - vals.mean()) / (vals.std(ddof=ddof) + eps), 0.0)


@pytest.mark.parametrize("with_mask", [False, True])
@pytest.mark.parametrize("weights", [None, (1.0, 0.5, 2.0)])
@pytest.mark.parametrize("std", ["population", "unbiased"])
def test_gdpo_decoupled_group_then_batch_normalisation(with_mask, weights, std):
    rng = np.random.default_rng(34)
    G, B = 4, 5
    r = np.stack(
        [
            (rng.random(B * G) < 0.5).astype(np.float32),  # correctness
            rng.integers(0, 3, B * G).astype(np.float32),  # a 0/1/2 format score
            rng.normal(size=B * G).astype(np.float32),
        ],
        axis=1,
    )
    r[:G, 0] = 1.0  # one reward constant in a group
    valid = rng.random(B * G) > 0.2 if with_mask else None
    adv = gdpo_advantages(r, group_size=G, eps=1e-6, weights=weights, std=std, mask_n=valid)
    ref = np_gdpo(r, G, 1e-6, weights, std == "unbiased", valid)
    np.testing.assert_allclose(adv, ref, rtol=RTOL, atol=ATOL)


def test_gdpo_keeps_reward_combinations_apart():
    # Two groups of 2 with two binary rewards: (0,0) vs (1,1), and (0,0) vs (0,1) scaled as
    # (0,2) by a single reward. GRPO's sum-then-normalise maps both groups to (-1, +1); GDPO
    # normalises each reward first, so improving both rewards beats improving one.
    r = jnp.array([[0.0, 0.0], [1.0, 1.0], [0.0, 0.0], [0.0, 2.0]])
    grpo = np.asarray(group_advantages(r.sum(1), group_size=2))
    np.testing.assert_allclose(grpo[:2], grpo[2:], atol=1e-6)
    gdpo = np.asarray(gdpo_advantages(r, group_size=2))
    # Per-group sums of normalised rewards: (-2, +2) and (-1, +1); batch mean 0, population
    # std sqrt(2.5).
    np.testing.assert_allclose(gdpo, np.array([-2.0, 2.0, -1.0, 1.0]) / np.sqrt(2.5), rtol=1e-5)


def test_remax_subtracts_the_greedy_reward():
    r = jnp.array([1.0, 0.0, 0.5, 0.2, 0.9, 0.4])
    per_prompt = remax_advantages(r, jnp.array([0.5, 0.0, 1.0]))  # B = 3, G = 2
    np.testing.assert_allclose(per_prompt, [0.5, -0.5, 0.5, 0.2, -0.1, -0.6], rtol=1e-6)
    per_sample = remax_advantages(r, jnp.repeat(jnp.array([0.5, 0.0, 1.0]), 2))
    np.testing.assert_allclose(per_sample, per_prompt, rtol=1e-6)
    masked = remax_advantages(r, jnp.array([0.5, 0.0, 1.0]), mask_n=jnp.array([1, 1, 0, 1, 1, 1]))
    assert float(masked[2]) == 0.0
    with pytest.raises(ValueError, match="divisible"):
        remax_advantages(r, jnp.zeros(4))


NEW_GROUP_FNS = {
    "pass_at_k": lambda r, m: pass_at_k_advantages(r, group_size=4, k=2, mask_n=m),
    "opo": lambda r, m: opo_advantages(r, jnp.arange(r.shape[0]) % 7 + 1, group_size=4, mask_n=m),
    "gpg": lambda r, m: gpg_advantages(r, group_size=4, mask_n=m),
    "maxrl": lambda r, m: maxrl_advantages(r, group_size=4, mask_n=m),
    "gdpo": lambda r, m: gdpo_advantages(jnp.stack([r, r * r], 1), group_size=4, mask_n=m),
    "remax": lambda r, m: remax_advantages(r, jnp.full(r.shape[0] // 4, 0.5), mask_n=m),
}


@pytest.mark.parametrize("name", NEW_GROUP_FNS)
def test_new_advantages_jit_vmap_and_invalid_samples(name):
    fn = NEW_GROUP_FNS[name]
    rng = np.random.default_rng(35)
    r = (rng.random((3, 16)) < 0.5).astype(np.float32)
    valid = rng.random((3, 16)) > 0.2
    eager = [np.asarray(fn(r[i], valid[i])) for i in range(3)]
    np.testing.assert_allclose(jax.jit(fn)(r[0], valid[0]), eager[0], rtol=1e-6, atol=1e-7)
    batched = jax.vmap(fn)(r, valid)
    for i in range(3):
        np.testing.assert_allclose(batched[i], eager[i], rtol=1e-6, atol=1e-7)
        assert np.all(eager[i][~valid[i]] == 0)
    # An invalid sample's reward (here NaN) is never read.
    poisoned = np.where(valid[0], r[0], np.nan).astype(np.float32)
    np.testing.assert_allclose(fn(poisoned, valid[0]), eager[0], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "call, match",
    [
        (
            lambda: pass_at_k_advantages(jnp.ones(8), group_size=4, k=5),
            r"k must be in \[1, group_size=4\]",
        ),
        (lambda: pass_at_k_advantages(jnp.ones(8), group_size=4, k=0), "k must be in"),
        (lambda: pass_at_k_advantages(jnp.ones(8), group_size=4, k=2.5), "static integer"),
        (lambda: opo_advantages(jnp.ones(8), jnp.ones(6), group_size=4), "N=8 rows"),
        (lambda: gpg_advantages(jnp.ones(8), group_size=4, f_norm=0.0), "f_norm"),
        (lambda: maxrl_advantages(jnp.ones(8), group_size=4, eps=-1.0), "eps"),
        (lambda: maxrl_advantages(jnp.ones(6), group_size=4), "not divisible"),
        (lambda: gdpo_advantages(jnp.ones(8), group_size=4), r"2-D \[N, R\]"),
        (lambda: gdpo_advantages(jnp.ones((8, 2)), group_size=4, weights=[1.0]), "weights"),
        (lambda: gdpo_advantages(jnp.ones((8, 2)), group_size=1), "group_size must be >= 2"),
    ],
)
def test_new_advantages_validation(call, match):
    with pytest.raises(ValueError, match=match):
        call()
