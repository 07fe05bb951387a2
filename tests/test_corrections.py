"""Off-policy sequence masking, TIS weights, overlong filtering and the overlong penalty.

Handmade cases use values exact in float32 (so comparisons at thresholds are exact);
random cases compare against float64 NumPy at rtol 1e-6.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpojax.ops.corrections import (
    off_policy_sequence_mask,
    overlong_penalty,
    truncated_completion_mask,
    truncated_is_weights,
)

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
