"""Off-policy sequence masking, TIS weights, overlong filtering and the overlong penalty.

Handmade cases use values exact in float32 (so comparisons at thresholds are exact);
random cases compare against float64 NumPy at rtol 1e-6 (rollout correction: rtol 1e-5 /
atol 1e-6, since its sequence weights exponentiate float32 sums of several log-ratios).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpojax.ops.corrections import (
    off_policy_sequence_mask,
    overlong_penalty,
    rollout_correction,
    truncated_completion_mask,
    truncated_is_weights,
)

RTOL, ATOL = 1e-5, 1e-6

# ----------------------------------------------------------------------------- off-policy mask


def test_off_policy_sequence_mask_handmade():
    # Per-token d = old_logp - logp (the k1 KL(pi_old || pi_theta) terms), delta = 0.5.
    d = np.array(
        [
            [1.0, 1.0, 1.0, 0.0],  # A<0, mean 1.0 > 0.5            -> drop
            [0.25, 0.25, 0.25, 0.0],  # A<0, mean 0.25 (sum 0.75!)  -> keep: a mean, not a sum
            [1.0, 1.0, 1.0, 0.0],  # A>0, far off-policy           -> keep
            [0.5, 0.5, 0.5, 0.0],  # A<0, mean exactly delta       -> keep (strictly exceeds)
            [0.25, 100.0, 100.0, 100.0],  # A<0, padding huge, real mean 0.25 -> keep
            [9.0, 9.0, 9.0, 9.0],  # A<0, no real tokens           -> keep
            [1.0, 1.0, 1.0, 0.0],  # A == 0                        -> keep
            [1.3, 0.5, 0.0, 0.0],  # A<0, mean 0.6 > 0.5           -> drop
            [1.5, -0.5, 0.5, 0.0],  # A<0, mean 0.5, max 1.5 > delta -> keep: a mean, not a max
        ],
        np.float32,
    )
    lengths = np.array([3, 3, 3, 3, 1, 0, 3, 3, 3])
    adv = np.array([-1.0, -1.0, 1.0, -1.0, -2.0, -0.5, 0.0, -0.1, -1.0], np.float32)
    old = np.full(d.shape, -1.0, np.float32)
    logp = old - d
    mask = np.arange(4)[None, :] < lengths[:, None]
    keep = off_policy_sequence_mask(logp, old, adv, mask, delta=0.5)
    assert keep.dtype == jnp.bool_ and keep.shape == (9,)
    expected = [False, True, True, True, True, True, True, False, True]
    assert np.asarray(keep).tolist() == expected


def test_off_policy_sequence_mask_random_vs_numpy_and_transforms():
    rng = np.random.default_rng(0)
    n, t = 16, 7
    logp = -np.abs(rng.normal(1, 0.5, (n, t))).astype(np.float32)
    old = (logp + rng.normal(0.1, 0.4, (n, t))).astype(np.float32)
    adv = rng.normal(size=n).astype(np.float32)
    lengths = rng.integers(0, t + 1, n)
    mask = np.arange(t)[None, :] < lengths[:, None]
    kl = np.array(
        [np.mean((old - logp).astype(np.float64)[i, : lengths[i]]) if lengths[i] else 0.0
         for i in range(n)]
    )  # fmt: skip
    delta = 0.15
    expected = ~((adv < 0) & (kl > delta))
    assert (~expected).any() and expected.any()
    keep = off_policy_sequence_mask(logp, old, adv, mask, delta=delta)
    np.testing.assert_array_equal(np.asarray(keep), expected)
    jitted = jax.jit(lambda a, b, c, m: off_policy_sequence_mask(a, b, c, m, delta=delta))
    np.testing.assert_array_equal(np.asarray(jitted(logp, old, adv, mask)), expected)
    vm = jax.vmap(lambda a, b, c, m: off_policy_sequence_mask(a, b, c, m, delta=delta))
    np.testing.assert_array_equal(np.asarray(vm(logp, old, adv, mask)), expected)

    # As a loss weight it carries no gradient of its own.
    def weighted(lp):
        k = off_policy_sequence_mask(lp, old, adv, mask, delta=delta)
        return jnp.sum(k[:, None] * lp)

    g = jax.grad(weighted)(jnp.asarray(logp))
    np.testing.assert_array_equal(
        np.asarray(g), np.broadcast_to(expected[:, None], (n, t)).astype(np.float32)
    )


def test_off_policy_sequence_mask_validation():
    x, m = jnp.zeros((2, 3)), jnp.ones((2, 3), bool)
    with pytest.raises(ValueError, match="delta"):
        off_policy_sequence_mask(x, x, jnp.zeros(2), m, delta=-0.1)
    with pytest.raises(ValueError, match="advantages_n"):
        off_policy_sequence_mask(x, x, jnp.zeros((2, 3)), m, delta=0.1)


# ----------------------------------------------------------------------------- TIS


def test_truncated_is_weights_values_cap_and_mask():
    rng = np.random.default_rng(1)
    trainer = -np.abs(rng.normal(1, 0.5, (4, 6))).astype(np.float32)
    sampler = (trainer + rng.normal(0, 0.6, trainer.shape)).astype(np.float32)
    trainer[0, 0], sampler[0, 0] = 0.0, -500.0  # ratio e^500: must cap, not overflow
    trainer[1, 0], sampler[1, 0] = -500.0, 0.0  # ratio e^-500: underflows to 0
    sampler[3, 5] = np.nan  # padding garbage
    mask = np.arange(6)[None, :] < np.array([6, 2, 4, 5])[:, None]
    cap = 2.0
    w = truncated_is_weights(trainer, sampler, mask, cap=cap)
    ref = np.where(
        mask, np.minimum(np.exp((trainer - sampler).astype(np.float64).clip(-700, 700)), cap), 0.0
    )
    assert w.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(w), ref, rtol=1e-6, atol=1e-7)
    assert float(w[0, 0]) == cap and np.all(np.asarray(w) <= cap)
    assert ((ref > 0) & (ref < cap)).any() and (ref == cap).sum() > 1


def test_truncated_is_weights_are_stop_gradient():
    rng = np.random.default_rng(2)
    trainer = rng.normal(size=(3, 4)).astype(np.float32)
    sampler = (trainer + rng.normal(0, 0.5, (3, 4))).astype(np.float32)
    mask = np.ones((3, 4), bool)

    def f(tr, sa):
        return jnp.sum(truncated_is_weights(tr, sa, mask, cap=1.5) * tr)

    g_tr, g_sa = jax.jit(jax.grad(f, argnums=(0, 1)))(trainer, sampler)
    # Only the explicit factor differentiates: d/dtr = w, d/dsa = 0.
    np.testing.assert_allclose(
        np.asarray(g_tr), np.asarray(truncated_is_weights(trainer, sampler, mask, cap=1.5))
    )
    assert np.all(np.asarray(g_sa) == 0.0)


def test_truncated_is_weights_validation():
    x = jnp.zeros((1, 2))
    with pytest.raises(ValueError, match="cap"):
        truncated_is_weights(x, x, jnp.ones((1, 2), bool), cap=0.0)


# ----------------------------------------------------------------------------- rollout correction
# TIS: w = min(pi_train / pi_sampler, C); MIS: w if low <= w <= high else 0; IcePop: the same
# band, token level, [0.5, 5] by default; sequence level: w_i = prod_t w_t over real tokens.


def np_rollout(trainer, sampler, mask, level, mode, low, high):
    trainer, sampler = np.float64(trainer), np.float64(sampler)
    n, t = trainer.shape
    w = np.zeros((n, t))
    masked = np.zeros((n, t), bool)
    truncated = np.zeros((n, t), bool)
    for i in range(n):
        idx = np.nonzero(mask[i])[0]
        seq_w = math.prod(math.exp(trainer[i, j] - sampler[i, j]) for j in idx)
        for j in idx:
            raw = math.exp(trainer[i, j] - sampler[i, j]) if level == "token" else seq_w
            if mode == "truncate":
                w[i, j] = min(raw, high)
                truncated[i, j] = raw > high
            elif low <= raw <= high:
                w[i, j] = raw
            else:
                masked[i, j] = True
    d = (trainer - sampler)[mask]
    metrics = {
        "weight_mean": w[mask].mean(),
        "masked_frac": masked.sum() / mask.sum(),
        "truncated_frac": truncated.sum() / mask.sum(),
        "kl_k1": np.mean(-d),
        "kl_k3": np.mean(np.exp(d) - 1 - d),
    }
    return w, metrics


def rollout_batch(seed, n=8, t=6, noise=0.5):
    rng = np.random.default_rng(seed)
    trainer = -np.abs(rng.normal(1, 0.5, (n, t)))
    sampler = trainer + rng.normal(0, noise, (n, t))
    lengths = rng.integers(1, t + 1, n)
    lengths[0], lengths[-1] = t, 0
    mask = np.arange(t)[None, :] < lengths[:, None]
    junk = rng.uniform(-1e4, 1e4, (n, t))
    trainer = np.where(mask, trainer, junk).astype(np.float32)
    sampler = np.where(mask, sampler, -junk).astype(np.float32)
    return trainer, sampler, mask


@pytest.mark.parametrize(
    "level,mode,low,high,defaults",
    [
        ("token", "truncate", None, None, (None, 2.0)),
        ("token", "truncate", None, 1.2, (None, 1.2)),
        ("sequence", "truncate", None, 1.5, (None, 1.5)),
        ("token", "mask", None, None, (0.5, 2.0)),
        ("token", "mask", 0.8, 1.25, (0.8, 1.25)),
        ("sequence", "mask", None, 3.0, (1 / 3, 3.0)),
        ("token", "icepop", None, None, (0.5, 5.0)),
        ("token", "icepop", 0.7, 1.4, (0.7, 1.4)),
    ],
)
def test_rollout_correction_matches_numpy(level, mode, low, high, defaults):
    trainer, sampler, mask = rollout_batch(3, noise=0.6 if level == "token" else 0.3)
    w, m = rollout_correction(trainer, sampler, mask, level=level, mode=mode, low=low, high=high)
    ref_w, ref_m = np_rollout(trainer, sampler, mask, level, mode, *defaults)
    assert w.dtype == jnp.float32 and w.shape == trainer.shape
    np.testing.assert_allclose(np.asarray(w), ref_w, rtol=RTOL, atol=ATOL)
    assert np.all(np.asarray(w)[~mask] == 0.0)
    assert set(m) == set(ref_m)
    for k, v in ref_m.items():
        np.testing.assert_allclose(float(m[k]), v, rtol=RTOL, atol=ATOL, err_msg=k)
    # Not vacuous: the band or the cap binds somewhere, and somewhere it does not.
    acted = ref_m["masked_frac"] if mode != "truncate" else ref_m["truncated_frac"]
    assert 0 < acted < 1, ref_m
    if level == "sequence":  # every real token of a sequence shares its weight
        for i in range(len(mask)):
            assert len(set(np.asarray(w)[i][mask[i]].tolist())) <= 1


def test_sequence_weights_are_computed_in_log_space():
    # 5 tokens each with ratio e^100: the product e^500 overflows float32 (and float64
    # products of the cap would not help); the weight is the cap, or 0 outside the band.
    trainer = jnp.zeros((2, 5))
    sampler = jnp.full((2, 5), -100.0).at[1].set(100.0)  # row 1: ratio e^-500
    mask = jnp.ones((2, 5), bool)
    w, m = rollout_correction(trainer, sampler, mask, level="sequence", mode="truncate", high=2.0)
    np.testing.assert_array_equal(np.asarray(w), [[2.0] * 5, [0.0] * 5])
    assert all(np.isfinite(float(v)) or k.startswith("kl") for k, v in m.items())
    w, _ = rollout_correction(trainer, sampler, mask, level="sequence", mode="mask")
    np.testing.assert_array_equal(np.asarray(w), np.zeros((2, 5)))


def test_truncated_is_weights_is_the_token_truncate_case():
    trainer, sampler, mask = rollout_batch(4)
    for cap in (1.1, 2.0):
        w, _ = rollout_correction(trainer, sampler, mask, level="token", mode="truncate", high=cap)
        np.testing.assert_array_equal(
            np.asarray(truncated_is_weights(trainer, sampler, mask, cap=cap)), np.asarray(w)
        )


def test_rollout_correction_is_constant_and_jittable():
    trainer, sampler, mask = rollout_batch(5)

    def f(tr, sa):
        w, _ = rollout_correction(tr, sa, mask, level="token", mode="icepop")
        return jnp.sum(w * tr)

    g_tr, g_sa = jax.jit(jax.grad(f, argnums=(0, 1)))(trainer, sampler)
    w, _ = rollout_correction(trainer, sampler, mask, level="token", mode="icepop")
    np.testing.assert_allclose(np.asarray(g_tr), np.asarray(w), rtol=1e-6)
    assert np.all(np.asarray(g_sa) == 0.0)
    # vmap over two batches equals a loop.
    tr2, sa2, m2 = rollout_batch(6)
    stacked = jax.vmap(lambda a, b, c: rollout_correction(a, b, c, level="sequence", mode="mask"))(
        np.stack([trainer, tr2]), np.stack([sampler, sa2]), np.stack([mask, m2])
    )
    for k, (a, b, c) in enumerate([(trainer, sampler, mask), (tr2, sa2, m2)]):
        w_k, m_k = rollout_correction(a, b, c, level="sequence", mode="mask")
        np.testing.assert_allclose(np.asarray(stacked[0][k]), np.asarray(w_k), rtol=1e-6)
        for key in m_k:
            np.testing.assert_allclose(float(stacked[1][key][k]), float(m_k[key]), rtol=1e-6)


PICK = dict(level="token", mode="truncate")  # no defaults: the caller names the method


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(level="seq"), r"level must be one of \('token', 'sequence'\)"),
        (dict(mode="clip"), r"mode must be one of \('truncate', 'mask', 'icepop'\)"),
        (dict(mode="icepop", level="sequence"), "token level"),
        (dict(mode="truncate", low=0.5), "low must be None"),
        (dict(mode="mask", low=2.0, high=1.0), "low must be <= high"),
        (dict(mode="mask", high=0.0), "high"),
        (dict(mode="mask", low=-1.0), "low"),
    ],
)
def test_rollout_correction_validation(kwargs, match):
    x = jnp.zeros((1, 2))
    with pytest.raises(ValueError, match=match):
        rollout_correction(x, x, jnp.ones((1, 2), bool), **{**PICK, **kwargs})


# ----------------------------------------------------------------------------- DAPO


def test_truncated_completion_mask():
    lengths = jnp.array([5, 8, 8, 0, 3])
    eos = jnp.array([True, True, False, False, False])
    keep = truncated_completion_mask(lengths, eos)
    assert np.asarray(keep).tolist() == [True, True, False, False, False]
    with pytest.raises(ValueError, match="eos_found_n"):
        truncated_completion_mask(lengths, eos[:3])


def np_overlong(lengths, max_len, buffer_len, penalty):
    out = []
    for length in lengths:
        if length <= max_len - buffer_len:
            out.append(0.0)
        elif length <= max_len:
            out.append((max_len - buffer_len - length) / buffer_len * penalty)
        else:
            out.append(-penalty)
    return np.array(out)


def test_overlong_penalty_zone_boundaries():
    # max_len 20, buffer 4: free up to 16 tokens, linear ramp over 17..20, -p beyond.
    lengths = jnp.array([0, 15, 16, 17, 18, 19, 20, 21, 100])
    out = overlong_penalty(lengths, max_len=20, buffer_len=4)
    np.testing.assert_allclose(
        np.asarray(out), [0, 0, 0, -0.25, -0.5, -0.75, -1.0, -1.0, -1.0], rtol=1e-6, atol=0
    )
    half = overlong_penalty(lengths, max_len=20, buffer_len=4, penalty=0.5)
    np.testing.assert_allclose(np.asarray(half), 0.5 * np.asarray(out), rtol=1e-6)
    ls = np.arange(0, 40)
    for max_len, buf, p in [(30, 7, 1.0), (30, 30, 2.0), (12, 0, 1.0)]:
        got = jax.jit(
            lambda x, m=max_len, b=buf, p=p: overlong_penalty(x, max_len=m, buffer_len=b, penalty=p)
        )(ls)
        assert got.dtype == jnp.float32
        np.testing.assert_allclose(
            np.asarray(got), np_overlong(ls, max_len, buf, p), rtol=1e-6, atol=1e-7
        )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_len=10, buffer_len=11), "buffer_len must be <= max_len"),
        (dict(max_len=10, buffer_len=-1), "buffer_len"),
        (dict(max_len=0, buffer_len=0), "max_len"),
        (dict(max_len=10, buffer_len=2, penalty=-1.0), "penalty"),
    ],
)
def test_overlong_penalty_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        overlong_penalty(jnp.array([1, 2]), **kwargs)
