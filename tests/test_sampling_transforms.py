"""Sampling transforms against an independent NumPy reference (loops, float64)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpojax.sampling.transforms import (
    SamplingConfig,
    categorical,
    first_argmax,
    keep_mask_from_count,
    keep_mask_from_threshold,
    kept_logprobs,
    sample_tokens,
)


def _softmax(z):
    z = np.asarray(z, np.float64)
    e = np.exp(z - z[np.isfinite(z)].max())
    e[~np.isfinite(z)] = 0.0
    return e / e.sum()


def ref_keep_set(logits_v, *, temperature, top_k=0, top_p=1.0, min_p=0.0):
    """Kept set of one row in Hugging Face order: temperature, top-k, top-p, min-p.

    Written with explicit loops over the descending order; ties at a boundary are kept.
    """
    z = np.asarray(logits_v, np.float64) / temperature
    keep = np.ones(z.shape, bool)
    order = sorted(range(len(z)), key=lambda i: -z[i])
    if top_k:
        kth = z[order[min(top_k, len(z)) - 1]]
        keep &= z >= kth
    if top_p < 1.0:
        probs = _softmax(np.where(keep, z, -np.inf))
        cum, last = 0.0, None
        for i in order:
            if not keep[i]:
                continue
            last = i
            cum += probs[i]
            if cum >= top_p:
                break
        keep &= z >= z[last]
    if min_p > 0.0:
        probs = _softmax(np.where(keep, z, -np.inf))
        keep &= probs >= min_p * probs.max() * (1 - 1e-12)
    return keep


CONFIGS = [
    dict(temperature=1.0),
    dict(temperature=0.7),
    dict(temperature=1.3, top_k=5),
    dict(temperature=1.0, top_p=0.8),
    dict(temperature=0.9, min_p=0.1),
    dict(temperature=1.1, top_k=12, top_p=0.7, min_p=0.05),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_logprob_count_threshold_and_masks_match_reference(cfg):
    rng = np.random.default_rng(0)
    n, v = 64, 40
    logits = (rng.normal(size=(n, v)) * 2.5).astype(np.float32)
    config = SamplingConfig(**cfg)
    out = jax.jit(lambda x, k: sample_tokens(x, k, config=config))(
        jnp.asarray(logits), jax.random.key(1)
    )
    tok = np.asarray(out.token_n)
    ref_masks = np.stack([ref_keep_set(row, **cfg) for row in logits])
    for i in range(n):
        z = logits[i].astype(np.float64) / cfg["temperature"]
        probs = _softmax(np.where(ref_masks[i], z, -np.inf))
        assert ref_masks[i, tok[i]], "sampled a token outside the kept set"
        # f32 log-softmax vs float64 reference: 1e-5 absolute.
        np.testing.assert_allclose(out.logp_n[i], np.log(probs[tok[i]]), atol=1e-5)
        assert int(out.keep_count_n[i]) == ref_masks[i].sum()
    if config.truncates:
        assert (np.asarray(out.keep_count_n) < v).any()
    else:
        assert np.all(np.asarray(out.keep_threshold_n) == -np.inf)
    # The recorded info rebuilds the same mask, and the kept-set logprobs are the sampler's.
    from_thr = keep_mask_from_threshold(
        logits, out.keep_threshold_n, temperature=cfg["temperature"]
    )
    from_count = keep_mask_from_count(logits, out.keep_count_n)
    np.testing.assert_array_equal(np.asarray(from_thr), ref_masks)
    np.testing.assert_array_equal(np.asarray(from_count), ref_masks)
    lp = kept_logprobs(logits, out.token_n, from_count, temperature=cfg["temperature"])
    # Two float32 log-softmaxes over V = 40 (the sampler's, the trainer's kept_logprobs),
    # reduced in other orders: logp = z / t - logsumexp with |z / t| up to ~12 (ulp 9.5e-7),
    # 9.5e-7 seen. 1e-5 as the float64 check above; a temperature 1% off moves it by > 1e-2
    # (the kept set itself is compared exactly above).
    np.testing.assert_allclose(np.asarray(lp), np.asarray(out.logp_n), atol=1e-5)


@pytest.mark.parametrize(
    "cfg",
    [dict(temperature=0.8), dict(temperature=1.0, top_k=3, top_p=0.9, min_p=0.02)],
    ids=["plain", "truncated"],
)
def test_empirical_frequencies_match_reference_distribution(cfg):
    rng = np.random.default_rng(3)
    v, draws = 8, 40000
    row = (rng.normal(size=(v,)) * 1.5).astype(np.float32)
    logits = jnp.broadcast_to(jnp.asarray(row), (draws, v))
    out = sample_tokens(logits, jax.random.key(7), config=SamplingConfig(**cfg))
    freq = np.bincount(np.asarray(out.token_n), minlength=v) / draws
    keep = ref_keep_set(row, **cfg)
    probs = _softmax(np.where(keep, row.astype(np.float64) / cfg["temperature"], -np.inf))
    # 5 binomial standard deviations (plus a floor for p ~ 0): a deterministic seed, no flakes.
    tol = 5 * np.sqrt(probs * (1 - probs) / draws) + 1e-4
    assert np.all(np.abs(freq - probs) <= tol), (freq, probs)
    assert np.all(freq[~keep] == 0)


def test_greedy_is_argmax_point_mass():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(16, 30)).astype(np.float32)
    out = sample_tokens(logits, jax.random.key(0), config=SamplingConfig(temperature=0.0))
    np.testing.assert_array_equal(np.asarray(out.token_n), logits.argmax(-1))
    np.testing.assert_array_equal(np.asarray(out.logp_n), 0.0)
    np.testing.assert_array_equal(np.asarray(out.keep_count_n), 1)
    np.testing.assert_array_equal(np.asarray(out.keep_threshold_n), logits.max(-1))


def test_first_argmax_is_numpy_argmax_with_ties_infs_and_nans():
    rng = np.random.default_rng(3)
    x = rng.integers(-3, 3, size=(64, 40)).astype(np.float32)  # many tied maxima per row
    x[0] = -np.inf  # all -inf: index 0
    x[1, [5, 9]] = np.inf  # first +inf
    x[2, [7, 30]] = np.nan  # first NaN, as numpy and jnp.argmax
    x[3, 39] = np.nan
    got = np.asarray(jax.jit(first_argmax)(x))
    np.testing.assert_array_equal(got, x.argmax(-1))
    np.testing.assert_array_equal(got, np.asarray(jnp.argmax(x, axis=-1)))
    assert got.dtype == np.int32


def test_categorical_draws_the_same_tokens_as_jax_random_categorical():
    rng = np.random.default_rng(4)
    z = (2.0 * rng.normal(size=(256, 512))).astype(np.float32)
    z[:, 100:] = -np.inf  # a truncated tail is never drawn
    for seed in range(3):
        key = jax.random.key(seed)
        ours = np.asarray(jax.jit(categorical)(key, z))
        ref = np.asarray(jax.random.categorical(key, z, axis=-1))
        np.testing.assert_array_equal(ours, ref)
        assert ours.max() < 100


def test_top_k_keeps_boundary_ties():
    logits = jnp.asarray([[3.0, 1.0, 1.0, 0.0, -1.0]])
    out = sample_tokens(logits, jax.random.key(0), config=SamplingConfig(top_k=2))
    assert int(out.keep_count_n[0]) == 3
    assert float(out.keep_threshold_n[0]) == 1.0
    mask = keep_mask_from_count(logits, out.keep_count_n)
    np.testing.assert_array_equal(np.asarray(mask[0]), [True, True, True, False, False])


def test_bf16_logits_are_upcast():
    rng = np.random.default_rng(2)
    logits = jnp.asarray(rng.normal(size=(4, 10)), jnp.bfloat16)
    out = sample_tokens(logits, jax.random.key(0), config=SamplingConfig(top_p=0.9))
    assert out.logp_n.dtype == jnp.float32 and out.keep_threshold_n.dtype == jnp.float32
    ref = jax.nn.log_softmax(
        jnp.where(
            keep_mask_from_count(logits, out.keep_count_n), logits.astype(jnp.float32), -jnp.inf
        )
    )
    np.testing.assert_allclose(
        np.asarray(out.logp_n),
        np.asarray(jnp.take_along_axis(ref, out.token_n[:, None], -1)[:, 0]),
        atol=1e-5,  # two float32 log-softmaxes over V = 10, other orders; bf16 math: ~1e-2
    )


def test_vmap_over_rows_of_groups():
    rng = np.random.default_rng(4)
    logits = jnp.asarray(rng.normal(size=(3, 5, 12)), jnp.float32)
    keys = jax.random.split(jax.random.key(0), 3)
    cfg = SamplingConfig(top_k=4)
    out = jax.vmap(lambda x, k: sample_tokens(x, k, config=cfg))(logits, keys)
    for i in range(3):
        one = sample_tokens(logits[i], keys[i], config=cfg)
        np.testing.assert_array_equal(np.asarray(out.token_n[i]), np.asarray(one.token_n))
        # The same row program, batched: bit-equal here; 1e-6 is 4 ulps of |logp| <= ~3.
        np.testing.assert_allclose(np.asarray(out.logp_n[i]), np.asarray(one.logp_n), atol=1e-6)


@pytest.mark.parametrize(
    "kwargs, word",
    [
        (dict(temperature=-1.0), r"^temperature must be a finite number >= 0, got -1\.0$"),
        (dict(top_k=-2), r"^top_k must be an int >= 0, got -2$"),
        (dict(top_p=0.0), r"^top_p must be a finite number > 0 and <= 1, got 0\.0$"),
        (dict(top_p=1.5), r"^top_p must be a finite number > 0 and <= 1, got 1\.5$"),
        (dict(min_p=1.0), r"^min_p must be a finite number >= 0 and < 1, got 1\.0$"),
    ],
)
def test_bad_config_names_the_field(kwargs, word):
    with pytest.raises(ValueError, match=word):
        SamplingConfig(**kwargs)


def test_rebuild_rejects_zero_temperature():
    with pytest.raises(ValueError, match=r"^temperature must be a finite number > 0, got 0\.0$"):
        keep_mask_from_threshold(jnp.zeros((1, 3)), jnp.zeros((1,)), temperature=0.0)
