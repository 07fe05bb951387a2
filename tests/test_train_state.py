"""TrainState, optimizer and schedule, skipped updates, configs and advantages for the driver."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpojax.train import (
    GRPO_PRESETS,
    GRPOConfig,
    OptimizerConfig,
    SFTConfig,
    TrainState,
    apply_gradients,
    compute_advantages,
    grpo_preset,
    make_optimizer,
    make_schedule,
)
from grpojax.train.common import (
    ForwardConfig,
    merge_micro,
    merge_units,
    split_micro,
    split_units,
    unit_permutation,
)


def _state(params, tx):
    return TrainState(
        params=params,
        opt_state=tx.init(params),
        step=jnp.zeros((), jnp.int32),
        num_updates=jnp.zeros((), jnp.int32),
        skipped=jnp.zeros((), jnp.int32),
        rng=jax.random.key(0),
        kl_state=None,
    )


def test_warmup_cosine_schedule_matches_formula():
    cfg = OptimizerConfig(
        learning_rate=1e-3,
        schedule="cosine",
        warmup_steps=10,
        total_steps=110,
        final_lr_fraction=0.1,
    )
    sched = make_schedule(cfg)
    for s in (0, 5, 10, 35, 60, 109, 110, 200):
        if s < 10:
            want = 1e-3 * s / 10
        else:
            frac = min(s - 10, 100) / 100
            want = 1e-4 + (1e-3 - 1e-4) * 0.5 * (1 + math.cos(math.pi * frac))
        np.testing.assert_allclose(float(sched(s)), want, rtol=1e-5, atol=1e-12)


def test_warmup_constant_schedule():
    sched = make_schedule(OptimizerConfig(learning_rate=2e-4, warmup_steps=4))
    got = [float(sched(s)) for s in range(7)]
    np.testing.assert_allclose(got, [0, 5e-5, 1e-4, 1.5e-4, 2e-4, 2e-4, 2e-4], rtol=1e-6)
    assert float(make_schedule(OptimizerConfig(learning_rate=3e-4))(0)) == pytest.approx(3e-4)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(schedule="linear"), "schedule"),
        (dict(learning_rate=0.0), "learning_rate"),
        (dict(warmup_steps=-1), "warmup_steps"),
        (dict(schedule="cosine", warmup_steps=5, total_steps=5), "total_steps"),
        (dict(b2=1.0), "b2"),
        (dict(max_grad_norm=0.0), "max_grad_norm"),
        (dict(weight_decay=-0.1), "weight_decay"),
    ],
)
def test_optimizer_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        OptimizerConfig(**kwargs)


def test_apply_gradients_matches_optax_and_clips():
    params = {"w": jnp.array([1.0, -2.0, 3.0]), "b": jnp.array(0.5)}
    grads = {"w": jnp.array([3.0, 0.0, -4.0]), "b": jnp.array(0.0)}  # global norm 5
    cfg = OptimizerConfig(learning_rate=0.1, max_grad_norm=1.0, weight_decay=0.01)
    tx = make_optimizer(cfg)
    state = _state(params, tx)
    new, m = apply_gradients(state, tx, grads, loss=jnp.float32(1.0), schedule=make_schedule(cfg))
    # Independent: AdamW's first step moves each coordinate by -lr * sign(g) (bias-corrected
    # m / sqrt(v) = g / |g|, clipping only rescales g) minus lr * wd * p.
    for k in params:
        p, g = np.asarray(params[k]), np.asarray(grads[k])
        g_c = g / 5.0
        step = np.where(g_c != 0, g_c / (np.abs(g_c) + 1e-8), 0.0)
        want = p - 0.1 * (step + 0.01 * p)
        np.testing.assert_allclose(np.asarray(new.params[k]), want, rtol=1e-6)
    assert float(m["grad_norm"]) == pytest.approx(5.0)
    assert float(m["lr"]) == pytest.approx(0.1)
    assert float(m["skipped"]) == 0.0 and int(new.num_updates) == 1 and int(new.skipped) == 0


@pytest.mark.parametrize("bad", ["nan_loss", "inf_loss", "nan_grad", "inf_grad"])
def test_non_finite_update_is_skipped_and_counted(bad):
    params = {"w": jnp.array([1.0, -2.0, 3.0])}
    grads = {"w": jnp.array([0.1, 0.2, 0.3])}
    loss = jnp.float32(1.0)
    if bad == "nan_loss":
        loss = jnp.float32(jnp.nan)
    elif bad == "inf_loss":
        loss = jnp.float32(-jnp.inf)
    elif bad == "nan_grad":
        grads = {"w": grads["w"].at[1].set(jnp.nan)}
    else:
        grads = {"w": grads["w"].at[0].set(jnp.inf)}
    tx = make_optimizer(OptimizerConfig(learning_rate=0.1))
    state = _state(params, tx)
    # One good update first, so the moments are non-trivial.
    state, _ = apply_gradients(state, tx, {"w": jnp.ones(3)}, loss=jnp.float32(0.0))
    new, m = jax.jit(lambda s, g, lo: apply_gradients(s, tx, g, loss=lo))(state, grads, loss)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(new), strict=False):
        if a.dtype == new.skipped.dtype and a.shape == ():
            continue
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            continue
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(new.params["w"]), np.asarray(state.params["w"]))
    assert int(new.skipped) == 1 and int(new.num_updates) == 1
    assert float(m["skipped"]) == 1.0


def test_split_micro_roundtrip_and_interleaving():
    x = jnp.arange(12 * 2).reshape(12, 2)
    parts = split_micro(x, 4)
    assert parts.shape == (4, 3, 2)
    np.testing.assert_array_equal(parts[1][:, 0], [2, 10, 18])  # rows 1, 5, 9
    np.testing.assert_array_equal(merge_micro(parts), x)
    with pytest.raises(ValueError, match="not divisible"):
        split_micro(x, 5)


def test_split_units_keep_groups_whole():
    """Units of g contiguous rows (a prompt's G samples) split interleaved like rows, each
    micro-batch holding whole units in order; g = 1 is split_micro; merge_units inverts it;
    unit_permutation moves whole units (g = 1: jax.random.permutation)."""
    g, k, n = 3, 2, 12
    x = {"a": jnp.arange(n), "b": jnp.arange(n * 2).reshape(n, 2)}
    parts = split_units(x, k, g)
    assert parts["a"].shape == (k, n // k) and parts["b"].shape == (k, n // k, 2)
    np.testing.assert_array_equal(parts["a"][1], [3, 4, 5, 9, 10, 11])  # units 1 and 3
    np.testing.assert_array_equal(parts["b"][1][:, 0], 2 * np.asarray([3, 4, 5, 9, 10, 11]))
    for name, y in merge_units(parts, g).items():
        np.testing.assert_array_equal(y, x[name])
    for name, y in split_units(x, k).items():
        np.testing.assert_array_equal(y, split_micro(x[name], k))
    perm = np.asarray(unit_permutation(jax.random.key(2), n, g))
    assert sorted(perm.tolist()) == list(range(n)) and perm.tolist() != list(range(n))
    units = perm.reshape(-1, g)
    np.testing.assert_array_equal(units - units[:, :1], np.broadcast_to(np.arange(g), units.shape))
    assert (units[:, 0] % g == 0).all()
    key = jax.random.key(5)
    np.testing.assert_array_equal(unit_permutation(key, n), jax.random.permutation(key, n))


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(aggregation="mean"), "aggregation"),
        (dict(aggregation="seq-mean-token-sum-norm", norm_constant=0.0), "norm_constant"),
        (dict(ratio_level="seq"), "ratio_level"),
        (dict(kl_estimator="k4"), "kl_estimator"),
        (dict(kl_is_corrected=True, kl_estimator="k1"), "kl_estimator"),
        (dict(beta=-1.0), "beta"),
        (dict(dual_clip=1.0), "dual_clip"),
        (dict(num_epochs=0), "num_epochs"),
        (dict(num_microbatches=1.5), "num_microbatches"),
        (dict(advantage_estimator="ppo"), "advantage_estimator"),
        (dict(group_size=1), "group_size"),
        (dict(rollout_correction_mode="truncate", rollout_correction_high=0.0), "correction_high"),
        (dict(rollout_correction_mode="tis"), "rollout_correction_mode"),
        (dict(policy_loss="ppo"), "policy_loss"),
        (dict(ref_refresh_every=0), "ref_refresh_every"),
        (dict(overlong_max_len=10, overlong_buffer=20), "overlong_buffer"),
    ],
)
def test_grpo_config_errors_name_field_and_allowed_values(kwargs, field):
    with pytest.raises(ValueError, match=field):
        GRPOConfig(**kwargs)


def test_error_lists_allowed_values():
    with pytest.raises(ValueError, match="token-mean"):
        GRPOConfig(aggregation="mean")
    with pytest.raises(ValueError, match="gspo"):
        grpo_preset("ppo")
    with pytest.raises(ValueError, match="temperature"):
        SFTConfig(forward=ForwardConfig(temperature=0.7))


def test_presets_are_replacements_of_one_config():
    assert GRPO_PRESETS["grpo"] == GRPOConfig()
    dapo = grpo_preset("dapo", max_new_tokens=1024, beta=0.01)
    assert (dapo.overlong_max_len, dapo.overlong_buffer) == (1024, 204)
    assert (dapo.clip_low, dapo.clip_high, dapo.aggregation) == (0.2, 0.28, "token-mean")
    assert dapo.beta == 0.01
    assert grpo_preset("gspo").ratio_level == "sequence"
    dr = grpo_preset("dr_grpo", norm_constant=512.0)
    assert (dr.aggregation, dr.advantage_estimator, dr.norm_constant) == (
        "seq-mean-token-sum-norm",
        "dr_grpo",
        512.0,
    )


def test_compute_advantages_against_numpy():
    r = np.array([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5, 3.0, 1.0, 2.0, 0.0], np.float32)
    g = 4
    rg = r.reshape(-1, g).astype(np.float64)
    mean = rg.mean(1, keepdims=True)
    std = rg.std(1, keepdims=True)
    grpo = np.where(std > 0, (rg - mean) / (std + 1e-6), 0.0).ravel()
    np.testing.assert_allclose(
        compute_advantages(r, GRPOConfig(group_size=g)), grpo, rtol=1e-5, atol=1e-6
    )
    dr = (rg - mean).ravel()
    cfg = GRPOConfig(group_size=g, advantage_estimator="dr_grpo")
    np.testing.assert_allclose(compute_advantages(r, cfg), dr, atol=1e-6)
    rloo = (rg - (rg.sum(1, keepdims=True) - rg) / (g - 1)).ravel()
    cfg = GRPOConfig(group_size=g, advantage_estimator="rloo")
    np.testing.assert_allclose(compute_advantages(r, cfg), rloo, atol=1e-6)
    # DAPO overlong penalty: lengths past max_len - buffer are punished before grouping.
    lengths = np.array([4, 9, 10, 12] * 3)
    cfg = GRPOConfig(
        group_size=g, advantage_estimator="dr_grpo", overlong_max_len=10, overlong_buffer=2
    )
    pen = np.array([0.0, -0.5, -1.0, -1.0] * 3)
    rp = (r + pen).reshape(-1, g)
    want = (rp - rp.mean(1, keepdims=True)).ravel()
    got = compute_advantages(r, cfg, lengths_n=jnp.asarray(lengths))
    np.testing.assert_allclose(got, want, atol=1e-6)
    with pytest.raises(ValueError, match="lengths_n"):
        compute_advantages(r, cfg)
    with pytest.raises(ValueError, match="mask_nt"):
        compute_advantages(r, GRPOConfig(group_size=g, advantage_estimator="reinforce_pp"))
    mask = jnp.ones((12, 3), bool)
    tok = compute_advantages(
        r, GRPOConfig(group_size=g, advantage_estimator="reinforce_pp"), mask_nt=mask
    )
    assert tok.shape == (12, 3)
    d = dr.reshape(12, 1) * np.ones((12, 3))
    np.testing.assert_allclose(tok, (d - d.mean()) / np.sqrt(d.var() + 1e-8), atol=1e-5)


def test_cosine_without_length_is_an_error_when_the_schedule_is_built():
    cfg = OptimizerConfig(schedule="cosine")  # the driver fills total_steps in
    with pytest.raises(ValueError, match="schedule='cosine' needs total_steps"):
        make_schedule(cfg)
