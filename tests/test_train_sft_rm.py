"""SFT and reward-model steps: losses against NumPy references, exact accumulation, and
learning (SFT loss falls; Bradley-Terry reaches > 90% pairwise accuracy)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from train_helpers import FORWARD, small_model

from grpojax.models import RewardModel
from grpojax.train import (
    OptimizerConfig,
    PreferenceBatch,
    RewardModelConfig,
    SFTConfig,
    create_train_state,
    make_optimizer,
    reward_model_update,
    sft_batch_from_lengths,
    sft_update,
)
from grpojax.train.reward_model import bradley_terry_loss

jax.config.update("jax_default_matmul_precision", "highest")


def _sft_batch(seed, n=8, s=10):
    rng = np.random.default_rng(seed)
    plen = rng.integers(1, 4, n)
    total = plen + rng.integers(1, s - 3, n)
    tokens = rng.integers(3, 100, (n, s))
    batch = sft_batch_from_lengths(jnp.asarray(tokens), jnp.asarray(plen), jnp.asarray(total))
    # Targets are exactly the demonstration columns [P, L); attention covers [0, L).
    cols = np.arange(s)[None]
    np.testing.assert_array_equal(
        batch.loss_mask_ns, (cols >= plen[:, None]) & (cols < total[:, None])
    )
    np.testing.assert_array_equal(batch.mask_ns, cols < total[:, None])
    return batch


def test_sft_loss_matches_numpy_cross_entropy_and_accumulates():
    model = small_model(0)
    batch = _sft_batch(1)
    # NumPy reference: -mean over demonstration tokens of log softmax(logits)[next token].
    mask = np.asarray(batch.mask_ns)
    positions = np.maximum(np.cumsum(mask, 1) - 1, 0)
    hidden, _ = model(batch.tokens_ns, positions_nt=jnp.asarray(positions), mask_nt=batch.mask_ns)
    z = np.asarray(model.logits(hidden), np.float64)[:, :-1]
    z = z - z.max(-1, keepdims=True)
    logsm = z - np.log(np.exp(z).sum(-1, keepdims=True))
    tok = np.asarray(batch.tokens_ns)[:, 1:]
    nll = -np.take_along_axis(logsm, tok[..., None], -1)[..., 0]
    target = np.asarray(batch.loss_mask_ns)[:, 1:]
    expected = (nll * target).sum() / target.sum()
    tx = optax.sgd(1.0)
    graphdef, state = create_train_state(model, tx, rng=jax.random.key(0))
    out = {}
    for k in (1, 4):
        cfg = SFTConfig(num_microbatches=k, forward=FORWARD)
        out[k] = jax.jit(functools.partial(sft_update, graphdef=graphdef, tx=tx, config=cfg))(
            state, batch
        )
    np.testing.assert_allclose(float(out[1][1]["loss"]), expected, rtol=1e-5)
    np.testing.assert_allclose(float(out[4][1]["loss"]), float(out[1][1]["loss"]), rtol=1e-6)
    np.testing.assert_allclose(
        float(out[4][1]["grad_norm"]), float(out[1][1]["grad_norm"]), rtol=1e-6
    )


def test_sft_loss_falls():
    model = small_model(2)
    batch = _sft_batch(3)
    tx = make_optimizer(OptimizerConfig(learning_rate=3e-3))
    graphdef, state = create_train_state(model, tx, rng=jax.random.key(0))
    update = jax.jit(
        functools.partial(sft_update, graphdef=graphdef, tx=tx, config=SFTConfig(forward=FORWARD))
    )
    losses = []
    for _ in range(25):
        state, m = update(state, batch)
        losses.append(float(m["loss"]))
    assert losses[0] > 4.0  # ~ log(100) at initialisation
    assert losses[-1] < 0.5 * losses[0], losses


def _preference_set(seed, n, s=8, good=7, bad=8):
    """Chosen responses contain token `good` more often, rejected ones token `bad`."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(3, s + 1, (2, n))
    chosen = rng.integers(10, 100, (n, s))
    rejected = rng.integers(10, 100, (n, s))
    chosen[rng.random((n, s)) < 0.4] = good
    rejected[rng.random((n, s)) < 0.4] = bad
    cm = np.arange(s)[None] < lengths[0][:, None]
    rm = np.arange(s)[None] < lengths[1][:, None]
    return PreferenceBatch(
        chosen_tokens_ns=jnp.asarray(chosen, jnp.int32),
        chosen_mask_ns=jnp.asarray(cm),
        rejected_tokens_ns=jnp.asarray(rejected, jnp.int32),
        rejected_mask_ns=jnp.asarray(rm),
    )


def test_bradley_terry_loss_values():
    # -log sigmoid(d): d = 0 -> log 2; d = 2 -> log(1 + e^-2); d = -3 -> log(1 + e^3).
    got = bradley_terry_loss(jnp.array([0.5, 2.0, -1.0]), jnp.array([0.5, 0.0, 2.0]))
    np.testing.assert_allclose(got, np.log1p(np.exp(-np.array([0.0, 2.0, -3.0]))), rtol=1e-6)


def test_reward_model_loss_reference_accumulation_and_accuracy():
    rm = RewardModel(small_model(4), rngs=nnx.Rngs(5))
    train = _preference_set(6, 32)
    held_out = _preference_set(7, 32)
    tx = make_optimizer(OptimizerConfig(learning_rate=3e-3))
    graphdef, state = create_train_state(rm, tx, rng=jax.random.key(0))

    # Loss at the initial parameters against a NumPy Bradley-Terry on the model's rewards.
    rc = np.asarray(rm(train.chosen_tokens_ns, mask_nt=train.chosen_mask_ns), np.float64)
    rr = np.asarray(rm(train.rejected_tokens_ns, mask_nt=train.rejected_mask_ns), np.float64)
    expected = np.mean(np.log1p(np.exp(-(rc - rr))))
    cfg1 = RewardModelConfig()
    update = jax.jit(functools.partial(reward_model_update, graphdef=graphdef, tx=tx, config=cfg1))
    update4 = jax.jit(
        functools.partial(
            reward_model_update,
            graphdef=graphdef,
            tx=tx,
            config=dataclasses.replace(cfg1, num_microbatches=4),
        )
    )
    _, m1 = update(state, train)
    _, m4 = update4(state, train)
    np.testing.assert_allclose(float(m1["loss"]), expected, rtol=1e-5)
    np.testing.assert_allclose(float(m1["accuracy"]), np.mean(rc > rr), atol=1e-7)
    np.testing.assert_allclose(float(m4["loss"]), float(m1["loss"]), rtol=1e-6)
    np.testing.assert_allclose(float(m4["grad_norm"]), float(m1["grad_norm"]), rtol=1e-6)

    for _ in range(40):
        state, m = update(state, train)
    # Held-out accuracy: the metric is taken at the input parameters, with a zero-lr copy.
    frozen = optax.sgd(0.0)
    _, st_eval = create_train_state(
        nnx.merge(graphdef, state.params), frozen, rng=jax.random.key(0)
    )
    _, m_eval = jax.jit(
        functools.partial(reward_model_update, graphdef=graphdef, tx=frozen, config=cfg1)
    )(st_eval, held_out)
    assert float(m["accuracy"]) > 0.9, float(m["accuracy"])
    assert float(m_eval["accuracy"]) > 0.9, float(m_eval["accuracy"])
