"""Policy, value and entropy losses against NumPy references, seed numbers and gradients.

Tolerances: float32 JAX against float64 NumPy, rtol 1e-5 / atol 1e-6 unless stated.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpojax.ops.losses import entropy_bonus, policy_loss, value_loss, value_loss_with_metrics

RTOL, ATOL = 1e-5, 1e-6


# ----------------------------------------------------------------------------- references


def np_policy_loss(
    logp, old, adv, mask, *, clip_low, clip_high, dual_clip, ratio_level, clamp=20.0
):
    """Independent float64 reference: returns (loss_nt, metrics, ratio_nt)."""
    logp = np.asarray(logp, np.float64)
    old = np.asarray(old, np.float64)
    mask = np.asarray(mask, bool)
    adv = np.asarray(adv, np.float64)
    a = np.broadcast_to(adv[:, None] if adv.ndim == 1 else adv, logp.shape)
    n_rows, n_cols = logp.shape
    tok_lr = np.zeros_like(logp)
    ratio = np.ones_like(logp)
    for i in range(n_rows):
        for t in range(n_cols):
            if mask[i, t]:
                tok_lr[i, t] = min(max(logp[i, t] - old[i, t], -clamp), clamp)
        if ratio_level == "token":
            ratio[i] = np.exp(tok_lr[i])
        else:
            n = mask[i].sum()
            diffs = [logp[i, t] - old[i, t] for t in range(n_cols) if mask[i, t]]
            mean = sum(diffs) / n if n else 0.0
            ratio[i] = np.exp(min(max(mean, -clamp), clamp))
    lo, hi = 1 - clip_low, 1 + clip_high
    obj = np.minimum(ratio * a, np.clip(ratio, lo, hi) * a)
    dual = np.zeros_like(mask)
    if dual_clip is not None:
        dual = (a < 0) & (ratio > dual_clip)
        obj = np.where(a < 0, np.maximum(obj, dual_clip * a), obj)
    loss = np.where(mask, -obj, 0.0)
    cnt = max(mask.sum(), 1)

    def mmean(x):
        return np.where(mask, x, 0.0).sum() / cnt

    metrics = {
        "clip_frac_high": mmean((a > 0) & (ratio > hi)),
        "clip_frac_low": mmean((a < 0) & (ratio < lo)),
        "dual_clip_frac": mmean(dual),
        "approx_kl_k1": mmean(-tok_lr),
        "approx_kl_k3": mmean(np.exp(tok_lr) - 1 - tok_lr),
        "ratio_mean": mmean(ratio),
        "ratio_min": ratio[mask].min(),
        "ratio_max": ratio[mask].max(),
    }
    return loss, metrics, ratio


def random_batch(seed, n=6, t=7, noise=0.35):
    rng = np.random.default_rng(seed)
    logp = -np.abs(rng.normal(1.0, 0.6, (n, t))).astype(np.float32)
    old = (logp + rng.normal(0.0, noise, (n, t))).astype(np.float32)
    lengths = rng.integers(1, t + 1, n)
    lengths[0], lengths[-1] = t, 0  # a full row and an empty row
    mask = np.arange(t)[None, :] < lengths[:, None]
    return logp, old, mask, rng


# ----------------------------------------------------------------------------- seed numbers


def test_seed_002_worked_example():
    # Seed 002: log pi_old = -2.1, log pi_theta = -1.8 -> r = e^0.3 ~ 1.35;
    # r = 1.35, eps = 0.2, A = 0.2 -> min(0.27, 0.24) = 0.24, so the loss is -0.24.
    logp, old, mask = jnp.array([[-1.8]]), jnp.array([[-2.1]]), jnp.array([[True]])
    loss, m = policy_loss(logp, old, jnp.array([0.2]), mask, clip_low=0.2, clip_high=0.2)
    assert abs(float(m["ratio_mean"]) - 1.35) < 5e-3
    np.testing.assert_allclose(float(m["ratio_mean"]), np.exp(0.3), rtol=1e-6)
    np.testing.assert_allclose(float(loss[0, 0]), -0.24, atol=1e-6)
    assert float(m["clip_frac_high"]) == 1.0 and float(m["clip_frac_low"]) == 0.0
    # The unclipped branch of the same example, 0.27 (rounded in the seed).
    wide, _ = policy_loss(logp, old, jnp.array([0.2]), mask, clip_low=0.2, clip_high=1.0)
    assert abs(float(wide[0, 0]) + 0.27) < 1e-3
    np.testing.assert_allclose(float(wide[0, 0]), -0.2 * np.exp(0.3), rtol=1e-6)


def test_seed_negative_advantage_floor():
    # Seed 004: for A < 0 the objective is max(r, 1 - eps) A. r = e^{log 0.7} = 0.7, A = -0.2.
    logp = jnp.array([[np.log(0.7)]], jnp.float32)
    loss, m = policy_loss(logp, jnp.zeros((1, 1)), jnp.array([-0.2]), jnp.ones((1, 1), bool))
    np.testing.assert_allclose(float(loss[0, 0]), 0.8 * 0.2, rtol=1e-6)
    assert float(m["clip_frac_low"]) == 1.0


# ----------------------------------------------------------------------------- vs NumPy

CASES = [
    dict(clip_low=0.2, clip_high=0.2, dual_clip=None, ratio_level="token", adv="n"),
    dict(clip_low=0.2, clip_high=0.28, dual_clip=None, ratio_level="token", adv="n"),
    dict(clip_low=0.1, clip_high=0.3, dual_clip=1.3, ratio_level="token", adv="n"),
    dict(clip_low=0.2, clip_high=0.28, dual_clip=1.3, ratio_level="token", adv="nt"),
    dict(clip_low=0.05, clip_high=0.1, dual_clip=None, ratio_level="sequence", adv="n"),
    dict(clip_low=0.05, clip_high=0.1, dual_clip=1.1, ratio_level="sequence", adv="nt"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_policy_loss_matches_numpy(case):
    case = dict(case)
    adv_kind = case.pop("adv")
    coverage = {"clip_frac_low": 0.0, "clip_frac_high": 0.0, "dual_clip_frac": 0.0}
    for seed in range(3):
        logp, old, mask, rng = random_batch(seed)
        shape = logp.shape[:1] if adv_kind == "n" else logp.shape
        adv = rng.normal(0.0, 1.0, shape).astype(np.float32)
        loss, m = policy_loss(logp, old, adv, mask, **case)
        ref_loss, ref_m, _ = np_policy_loss(logp, old, adv, mask, **case)
        assert loss.dtype == jnp.float32 and loss.shape == logp.shape
        np.testing.assert_allclose(np.asarray(loss), ref_loss, rtol=RTOL, atol=ATOL)
        assert np.all(np.asarray(loss)[~mask] == 0.0)
        assert set(m) == set(ref_m)
        for k, v in ref_m.items():
            np.testing.assert_allclose(float(m[k]), v, rtol=RTOL, atol=ATOL, err_msg=k)
        for k in coverage:
            coverage[k] += ref_m[k]
    # Guard against passing vacuously: the random batches clip on both sides (and trigger
    # the dual clip when it is on).
    assert coverage["clip_frac_low"] > 0 and coverage["clip_frac_high"] > 0, coverage
    assert (coverage["dual_clip_frac"] > 0) == (case["dual_clip"] is not None), coverage


def test_bfloat16_inputs_compute_in_float32():
    logp, old, mask, rng = random_batch(0)
    adv = rng.normal(size=logp.shape[:1]).astype(np.float32)
    lp16, old16 = jnp.asarray(logp, jnp.bfloat16), jnp.asarray(old, jnp.bfloat16)
    loss, m = policy_loss(lp16, old16, adv, mask)
    assert loss.dtype == jnp.float32 and m["ratio_mean"].dtype == jnp.float32
    # Same values as the f32 reference on the bf16-rounded inputs.
    ref, _, _ = np_policy_loss(
        np.asarray(lp16, np.float32),
        np.asarray(old16, np.float32),
        adv,
        mask,
        clip_low=0.2,
        clip_high=0.2,
        dual_clip=None,
        ratio_level="token",
    )
    np.testing.assert_allclose(np.asarray(loss), ref, rtol=RTOL, atol=ATOL)


# ----------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("dual_clip", [None, 1.3])
def test_token_gradient_inside_and_outside_band(dual_clip):
    cl, ch = 0.1, 0.3
    logp, old, mask, rng = random_batch(1, n=8, t=9, noise=0.4)
    adv = rng.normal(0.0, 1.0, logp.shape).astype(np.float32)

    def total(lp):
        loss, _ = policy_loss(lp, old, adv, mask, clip_low=cl, clip_high=ch, dual_clip=dual_clip)
        return loss.sum()

    grad = jax.grad(total)(jnp.asarray(logp))
    r = np.exp(logp.astype(np.float64) - old)
    clip_binds = ((adv > 0) & (r > 1 + ch)) | ((adv < 0) & (r < 1 - cl))
    dual_binds = (adv < 0) & (r > dual_clip) if dual_clip else np.zeros_like(mask)
    live = mask & ~clip_binds & ~dual_binds
    # d(-r A)/d logp = -r A where the unclipped branch is active, 0 where a clip binds.
    expected = np.where(live, -r * adv, 0.0)
    np.testing.assert_allclose(np.asarray(grad), expected, rtol=RTOL, atol=ATOL)
    assert live.any() and (mask & clip_binds).any()
    if dual_clip:
        assert (mask & dual_binds).any()


def test_gradient_at_ratio_one_is_full_reinforce_even_with_zero_clip():
    # First epoch: logp == old_logp, r = 1 exactly. The gradient must be -A (all of it),
    # including the degenerate band clip_low = clip_high = 0.
    logp = jnp.full((2, 3), -1.0)
    adv = jnp.array([0.5, -2.0])
    mask = jnp.ones((2, 3), bool)
    for cl, ch in [(0.2, 0.2), (0.0, 0.0)]:

        def total(lp, cl=cl, ch=ch):
            return policy_loss(lp, logp, adv, mask, clip_low=cl, clip_high=ch)[0].sum()

        g = jax.grad(total)(logp)
        np.testing.assert_allclose(np.asarray(g), -np.broadcast_to(adv[:, None], (2, 3)))


def _seq_token_mean_sum(loss_nt, mask):
    # sum_i (1/|y_i|) sum_t loss_it, written out here independently of aggregation.py.
    n = jnp.maximum(mask.sum(-1), 1)
    return jnp.sum(jnp.where(mask, loss_nt, 0.0).sum(-1) / n)


def test_gspo_gradient_carries_sequence_ratio():
    cl, ch = 0.05, 0.1
    logp, old, mask, rng = random_batch(2, n=8, t=6, noise=0.25)
    adv = rng.normal(0.0, 1.0, logp.shape[:1]).astype(np.float32)

    def f(lp):
        loss, _ = policy_loss(lp, old, adv, mask, clip_low=cl, clip_high=ch, ratio_level="sequence")
        return _seq_token_mean_sum(loss, mask)

    grad = np.asarray(jax.grad(f)(jnp.asarray(logp)))
    n = mask.sum(-1)
    diffs = np.where(mask, logp.astype(np.float64) - old, 0.0)
    s = np.exp(diffs.sum(-1) / np.maximum(n, 1))
    binds = ((adv > 0) & (s > 1 + ch)) | ((adv < 0) & (s < 1 - cl))
    per_seq = np.where(binds, 0.0, -(s * adv) / np.maximum(n, 1))
    expected = np.where(mask, per_seq[:, None], 0.0)
    np.testing.assert_allclose(grad, expected, rtol=RTOL, atol=ATOL)
    assert binds[n > 0].any() and (~binds[n > 0]).any()

    # Equivalence with GSPO's sequence objective differentiated directly:
    # J = sum_i -min(s_i A_i, clip(s_i) A_i), s_i = exp(mean_t(logp - old)).
    def seq_objective(lp):
        d = jnp.where(mask, lp - old, 0.0).sum(-1) / jnp.maximum(mask.sum(-1), 1)
        s_i = jnp.exp(d)
        return -jnp.sum(jnp.minimum(s_i * adv, jnp.clip(s_i, 1 - cl, 1 + ch) * adv))

    np.testing.assert_allclose(
        grad, np.asarray(jax.grad(seq_objective)(jnp.asarray(logp))), rtol=RTOL, atol=ATOL
    )


def test_huge_log_ratio_gives_finite_loss_and_gradient():
    logp = jnp.array([[0.0, -1.0], [0.0, -1.0]])
    old = jnp.array([[-1000.0, -1.0], [-1000.0, -1.0]])
    adv = jnp.array([1.0, -1.0])
    mask = jnp.ones((2, 2), bool)
    for level in ("token", "sequence"):
        loss, m = policy_loss(logp, old, adv, mask, ratio_level=level, log_ratio_clamp=20.0)
        g = jax.grad(lambda lp, lv=level: policy_loss(lp, old, adv, mask, ratio_level=lv)[0].sum())(
            logp
        )
        assert np.all(np.isfinite(np.asarray(loss))) and np.all(np.isfinite(np.asarray(g)))
        assert all(np.isfinite(float(v)) for v in m.values())
    loss, m = policy_loss(logp, old, adv, mask)
    # A > 0: clipped at 1 + 0.2; A < 0: unclipped r = e^20 (the clamp), a large finite loss.
    np.testing.assert_allclose(float(loss[0, 0]), -1.2, rtol=1e-6)
    np.testing.assert_allclose(float(loss[1, 0]), np.exp(20.0), rtol=1e-5)
    np.testing.assert_allclose(float(m["ratio_max"]), np.exp(20.0), rtol=1e-5)


# ----------------------------------------------------------------------------- invariances


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_appending_padding_changes_nothing(level):
    logp, old, mask, rng = random_batch(3)
    adv = rng.normal(size=logp.shape[:1]).astype(np.float32)
    n, t = logp.shape
    garbage = rng.normal(0, 50, (n, 3)).astype(np.float32)
    garbage[0, 0], garbage[1, 1] = np.nan, -np.inf
    logp_p = np.concatenate([logp, garbage], 1)
    old_p = np.concatenate([old, -garbage[:, ::-1]], 1)
    mask_p = np.concatenate([mask, np.zeros((n, 3), bool)], 1)
    kw = dict(clip_low=0.1, clip_high=0.2, dual_clip=2.0, ratio_level=level)
    loss, m = policy_loss(logp, old, adv, mask, **kw)
    loss_p, m_p = policy_loss(logp_p, old_p, adv, mask_p, **kw)
    np.testing.assert_allclose(np.asarray(loss_p[:, :t]), np.asarray(loss), rtol=1e-6, atol=0)
    assert np.all(np.asarray(loss_p[:, t:]) == 0.0)
    for k in m:
        np.testing.assert_allclose(float(m_p[k]), float(m[k]), rtol=1e-6, err_msg=k)

    def total(lp, o, mk):
        return policy_loss(lp, o, adv, mk, **kw)[0].sum()

    g = np.asarray(jax.grad(total)(jnp.asarray(logp), old, mask))
    g_p = np.asarray(jax.grad(total)(jnp.asarray(logp_p), old_p, mask_p))
    np.testing.assert_allclose(g_p[:, :t], g, rtol=1e-6, atol=1e-7)
    assert np.all(g_p[:, t:] == 0.0)


# ----------------------------------------------------------------------------- transforms


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_jit_and_vmap_match_eager(level):
    logp, old, mask, rng = random_batch(4)
    adv = rng.normal(size=logp.shape[:1]).astype(np.float32)
    fn = functools.partial(policy_loss, clip_low=0.1, clip_high=0.25, ratio_level=level)
    loss, m = fn(logp, old, adv, mask)
    loss_j, m_j = jax.jit(fn)(logp, old, adv, mask)
    np.testing.assert_allclose(np.asarray(loss_j), np.asarray(loss), rtol=1e-6, atol=1e-7)
    for k in m:
        np.testing.assert_allclose(float(m_j[k]), float(m[k]), rtol=1e-6, atol=1e-7)
    # vmap over sequences: each row alone, with a scalar advantage, gives the same loss.
    loss_v = jax.vmap(lambda a, b, c, d: fn(a, b, c, d)[0])(logp, old, adv, mask)
    np.testing.assert_allclose(np.asarray(loss_v), np.asarray(loss), rtol=1e-6, atol=1e-7)


def test_hyperparameters_may_be_traced_or_numpy_scalars():
    # A scheduled clip range enters the jitted step as a traced 0-d array.
    logp, old, mask, rng = random_batch(5)
    adv = rng.normal(size=logp.shape[:1]).astype(np.float32)
    kw = dict(clip_low=0.1, clip_high=0.25, dual_clip=1.5)
    ref, _ = policy_loss(logp, old, adv, mask, **kw)

    @jax.jit
    def traced(cl, ch, dc):
        return policy_loss(logp, old, adv, mask, clip_low=cl, clip_high=ch, dual_clip=dc)[0]

    out = traced(jnp.float32(0.1), jnp.float32(0.25), jnp.float32(1.5))
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-6, atol=1e-7)
    np_kw = {k: np.float32(v) for k, v in kw.items()}
    out_np, _ = policy_loss(logp, old, adv, mask, **np_kw)
    np.testing.assert_allclose(np.asarray(out_np), np.asarray(ref), rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(clip_low=-0.1), "clip_low"),
        (dict(clip_high=-1.0), "clip_high"),
        (dict(dual_clip=1.0), "dual_clip"),
        (dict(dual_clip=0.5), "dual_clip"),
        (dict(ratio_level="seq"), r"ratio_level must be one of \('token', 'sequence'\)"),
        (dict(log_ratio_clamp=0.0), "log_ratio_clamp"),
    ],
)
def test_policy_loss_rejects_bad_hyperparameters(kwargs, match):
    x = jnp.zeros((2, 3))
    with pytest.raises(ValueError, match=match):
        policy_loss(x, x, jnp.zeros(2), jnp.ones((2, 3), bool), **kwargs)


def test_policy_loss_rejects_bad_shapes():
    x = jnp.zeros((2, 3))
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(x, x, jnp.zeros((2, 3, 1)), jnp.ones((2, 3), bool))
    with pytest.raises(ValueError, match="old_logp"):
        policy_loss(x, jnp.zeros((2, 4)), jnp.zeros(2), jnp.ones((2, 3), bool))


# ----------------------------------------------------------------------------- value/entropy


def np_value_loss(v, v_old, ret, mask, clip):
    v, v_old, ret = (np.asarray(a, np.float64) for a in (v, v_old, ret))
    unclipped = (v - ret) ** 2
    if clip is None:
        out, frac = 0.5 * unclipped, 0.0
    else:
        vc = np.minimum(np.maximum(v, v_old - clip), v_old + clip)
        clipped = (vc - ret) ** 2
        out = 0.5 * np.maximum(unclipped, clipped)
        frac = ((clipped > unclipped) & mask).sum() / max(mask.sum(), 1)
    return np.where(mask, out, 0.0), frac


@pytest.mark.parametrize("clip", [None, 0.2, 0.0])
def test_value_loss_matches_numpy(clip):
    rng = np.random.default_rng(10)
    v = rng.normal(size=(5, 6)).astype(np.float32)
    v_old = (v + rng.normal(0, 0.4, v.shape)).astype(np.float32)
    ret = rng.normal(size=v.shape).astype(np.float32)
    mask = np.arange(6)[None, :] < np.array([6, 3, 1, 0, 5])[:, None]
    ref, ref_frac = np_value_loss(v, v_old, ret, mask, clip)
    out = value_loss(v, v_old, ret, mask, clip=clip)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=RTOL, atol=ATOL)
    out2, m = value_loss_with_metrics(v, v_old, ret, mask, clip=clip)
    np.testing.assert_allclose(np.asarray(out2), ref, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(float(m["value_clip_frac"]), ref_frac, rtol=RTOL, atol=ATOL)
    if clip == 0.2:
        assert 0 < ref_frac < 1
    # Gradient: (V - R) where the unclipped term is the max, 0 where clipping binds.
    g = np.asarray(jax.grad(lambda x: value_loss(x, v_old, ret, mask, clip=clip).sum())(v))
    if clip is None:
        binds = np.zeros_like(mask)
    else:
        vc = np.clip(v.astype(np.float64), v_old - clip, v_old + clip)
        binds = (vc - ret) ** 2 > (v.astype(np.float64) - ret) ** 2
    np.testing.assert_allclose(g, np.where(mask & ~binds, v - ret, 0.0), rtol=RTOL, atol=ATOL)


def test_value_loss_rejects_negative_clip():
    x = jnp.zeros((1, 2))
    with pytest.raises(ValueError, match="clip"):
        value_loss(x, x, x, jnp.ones((1, 2), bool), clip=-0.1)


def test_entropy_bonus():
    ent = np.array([[1.0, 2.0, 3.0], [0.5, 0.25, 9.0]], np.float32)
    mask = np.array([[True, True, False], [True, False, False]])
    out = entropy_bonus(ent, mask, coef=0.01)
    np.testing.assert_allclose(
        np.asarray(out), [[-0.01, -0.02, 0.0], [-0.005, 0.0, 0.0]], rtol=1e-6, atol=0
    )
    g = jax.grad(lambda e: entropy_bonus(e, mask, coef=0.01).sum())(jnp.asarray(ent))
    np.testing.assert_allclose(np.asarray(g), np.where(mask, -0.01, 0.0))
    with pytest.raises(ValueError, match="coef"):
        entropy_bonus(ent, mask, coef=float("nan"))
