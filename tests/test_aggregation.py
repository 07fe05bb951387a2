"""Loss aggregation modes against NumPy, micro-batch exactness and gradient accumulation.

Tolerances: float32 against float64 NumPy rtol 1e-5 / atol 1e-6; micro-batch sums against
the full batch rtol 1e-6 (values) and 1e-5 (gradients, several float32 reductions deep).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpojax.ops.aggregation import AGGREGATION_MODES, aggregate, aggregate_parts
from grpojax.ops.losses import policy_loss

NORM = 11.0  # e.g. the maximum completion length for Dr.GRPO


def np_aggregate(loss, mask, mode, norm_constant=None):
    """Independent float64 reference, written per sequence with Python loops."""
    loss = np.asarray(loss, np.float64)
    mask = np.asarray(mask, bool)
    seqs = [[loss[i, t] for t in range(loss.shape[1]) if mask[i, t]] for i in range(len(loss))]
    seqs = [s for s in seqs if s]  # rows without tokens are padding, not sequences
    if not seqs:
        return 0.0
    if mode == "token-mean":
        return sum(sum(s) for s in seqs) / sum(len(s) for s in seqs)
    if mode == "seq-mean-token-mean":
        return sum(sum(s) / len(s) for s in seqs) / len(seqs)
    if mode == "seq-mean-token-sum":
        return sum(sum(s) for s in seqs) / len(seqs)
    if mode == "seq-mean-token-sum-norm":
        return sum(sum(s) for s in seqs) / (len(seqs) * norm_constant)
    raise AssertionError(mode)


def batch(seed, n=8, t=9):
    rng = np.random.default_rng(seed)
    loss = rng.normal(size=(n, t)).astype(np.float32)
    lengths = rng.integers(1, t + 1, n)
    lengths[2] = 0
    lengths[5] = t
    mask = np.arange(t)[None, :] < lengths[:, None]
    return loss, mask, rng


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_aggregate_matches_numpy(mode):
    for seed in range(3):
        loss, mask, _ = batch(seed)
        out = aggregate(loss, mask, mode=mode, norm_constant=NORM)
        assert out.dtype == jnp.float32 and out.shape == ()
        ref = np_aggregate(loss, mask, mode, NORM)
        np.testing.assert_allclose(float(out), ref, rtol=1e-5, atol=1e-6)
        num, den = aggregate_parts(loss, mask, mode=mode, norm_constant=NORM)
        np.testing.assert_allclose(float(num / den), float(out), rtol=1e-6)


def test_modes_weight_differently():
    # One long sequence of loss 1 and one short of loss 3: the modes must disagree as
    # the recipes say (token-mean favours the long one, seq-mean-token-mean does not).
    loss = np.array([[1.0, 1.0, 1.0, 1.0], [3.0, 0.0, 0.0, 0.0]], np.float32)
    mask = np.array([[1, 1, 1, 1], [1, 0, 0, 0]], bool)
    got = {m: float(aggregate(loss, mask, mode=m, norm_constant=4)) for m in AGGREGATION_MODES}
    np.testing.assert_allclose(got["token-mean"], 7 / 5, rtol=1e-6)
    np.testing.assert_allclose(got["seq-mean-token-mean"], (1 + 3) / 2, rtol=1e-6)
    np.testing.assert_allclose(got["seq-mean-token-sum"], (4 + 3) / 2, rtol=1e-6)
    np.testing.assert_allclose(got["seq-mean-token-sum-norm"], 7 / (2 * 4), rtol=1e-6)


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_micro_batches_sum_to_full_batch(mode):
    loss, mask, _ = batch(1, n=8)
    full = float(aggregate(loss, mask, mode=mode, norm_constant=NORM))
    parts = [
        aggregate_parts(loss[i : i + 2], mask[i : i + 2], mode=mode, norm_constant=NORM)
        for i in range(0, 8, 2)
    ]
    num = sum(float(p[0]) for p in parts)
    den = sum(float(p[1]) for p in parts)
    np.testing.assert_allclose(num / den, full, rtol=1e-6)
    # The naive alternative (mean of micro-batch means) is *not* exact here, which is
    # why the parts exist; checked so the equality above is not vacuous.
    naive = np.mean([float(p[0] / p[1]) if float(p[1]) > 0 else 0.0 for p in parts])
    assert abs(naive - full) > 1e-4


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_gradient_accumulation_with_global_denominator(mode):
    rng = np.random.default_rng(7)
    n, t = 8, 6
    feats = rng.normal(size=(n, t, 3)).astype(np.float32)
    w0 = jnp.asarray(rng.normal(size=(3,)), jnp.float32)
    old = -jax.nn.softplus(feats @ np.asarray(w0)) + rng.normal(0, 0.1, (n, t)).astype(np.float32)
    adv = rng.normal(size=(n,)).astype(np.float32)
    lengths = np.array([6, 3, 0, 1, 5, 6, 2, 4])
    mask = np.arange(t)[None, :] < lengths[:, None]

    def loss_nt(w, sl):
        logp = -jax.nn.softplus(feats[sl] @ w)
        return policy_loss(logp, old[sl], adv[sl], mask[sl], clip_low=0.2, clip_high=0.28)[0]

    full_val, full_grad = jax.value_and_grad(
        lambda w: aggregate(loss_nt(w, slice(None)), mask, mode=mode, norm_constant=NORM)
    )(w0)
    slices = [slice(i, i + 2) for i in range(0, n, 2)]
    global_den = sum(
        aggregate_parts(jnp.zeros((2, t)), mask[s], mode=mode, norm_constant=NORM)[1]
        for s in slices
    )
    acc_val, acc_grad = 0.0, jnp.zeros(3)
    for s in slices:
        v, g = jax.value_and_grad(
            lambda w, s=s: aggregate(
                loss_nt(w, s), mask[s], mode=mode, norm_constant=NORM, denominator=global_den
            )
        )(w0)
        acc_val, acc_grad = acc_val + v, acc_grad + g
    np.testing.assert_allclose(float(acc_val), float(full_val), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(acc_grad), np.asarray(full_grad), rtol=1e-5, atol=1e-7)
    assert np.abs(np.asarray(full_grad)).max() > 1e-3


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_padding_columns_and_empty_rows_change_nothing(mode):
    loss, mask, rng = batch(2)
    n, t = loss.shape
    pad_cols = rng.normal(0, 100, (n, 4)).astype(np.float32)
    pad_cols[0, 0] = np.nan
    loss_p = np.concatenate([loss, pad_cols], 1)
    mask_p = np.concatenate([mask, np.zeros((n, 4), bool)], 1)
    # Two extra rows of pure padding (sharding filler).
    loss_p = np.concatenate([loss_p, np.full((2, t + 4), 5.0, np.float32)], 0)
    mask_p = np.concatenate([mask_p, np.zeros((2, t + 4), bool)], 0)
    a = aggregate(loss, mask, mode=mode, norm_constant=NORM)
    b = aggregate(loss_p, mask_p, mode=mode, norm_constant=NORM)
    np.testing.assert_allclose(float(b), float(a), rtol=1e-6)
    g = jax.grad(lambda x: aggregate(x, mask_p, mode=mode, norm_constant=NORM))(jnp.asarray(loss_p))
    assert np.all(np.isfinite(np.asarray(g))) and np.all(np.asarray(g)[~mask_p] == 0.0)


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_empty_batch_gives_zero(mode):
    out, g = jax.value_and_grad(
        lambda x: aggregate(x, jnp.zeros((2, 3), bool), mode=mode, norm_constant=NORM)
    )(jnp.ones((2, 3)))
    assert float(out) == 0.0 and np.all(np.asarray(g) == 0.0)


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_jit_vmap_grad(mode):
    loss, mask, _ = batch(3)
    eager = aggregate(loss, mask, mode=mode, norm_constant=NORM)
    jitted = jax.jit(lambda x, m: aggregate(x, m, mode=mode, norm_constant=NORM))(loss, mask)
    np.testing.assert_allclose(float(jitted), float(eager), rtol=1e-6)
    stacked = np.stack([loss, loss[::-1]]), np.stack([mask, mask[::-1]])
    vm = jax.vmap(lambda x, m: aggregate(x, m, mode=mode, norm_constant=NORM))(*stacked)
    np.testing.assert_allclose(np.asarray(vm), [float(eager)] * 2, rtol=1e-6)
    # d aggregate / d loss_it is the weight each mode gives token (i, t).
    g = np.asarray(jax.grad(lambda x: aggregate(x, mask, mode=mode, norm_constant=NORM))(loss))
    n_i = mask.sum(1, keepdims=True)
    k = (mask.sum(1) > 0).sum()
    weight = {
        "token-mean": np.ones_like(loss) / mask.sum(),
        "seq-mean-token-mean": 1.0 / (np.maximum(n_i, 1) * k) * np.ones_like(loss),
        "seq-mean-token-sum": np.ones_like(loss) / k,
        "seq-mean-token-sum-norm": np.ones_like(loss) / (k * NORM),
    }[mode]
    np.testing.assert_allclose(g, np.where(mask, weight, 0.0), rtol=1e-6, atol=1e-8)


def test_bad_mode_and_missing_norm_constant():
    x, m = jnp.zeros((2, 3)), jnp.ones((2, 3), bool)
    with pytest.raises(ValueError, match=r"mode must be one of .*token-mean.*seq-mean-token-sum"):
        aggregate(x, m, mode="mean")
    with pytest.raises(ValueError, match="norm_constant"):
        aggregate_parts(x, m, mode="seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="norm_constant"):
        aggregate(x, m, mode="seq-mean-token-sum-norm", norm_constant=0)
    # Other modes ignore norm_constant.
    assert float(aggregate(x, m, mode="token-mean", norm_constant=5)) == 0.0
