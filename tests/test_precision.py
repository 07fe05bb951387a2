"""Mixed precision: float32 masters and moments, compute-dtype reference and sampler."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from grpojax.config import load_config
from grpojax.driver.setup import build_mesh, build_model
from grpojax.driver.trainer import make_trainer
from grpojax.models import Decoder, cast_floating, tiny_config
from grpojax.sampling import SamplingConfig, generate
from grpojax.train import OptimizerConfig, apply_gradients, create_train_state, make_optimizer

SMALL = dict(
    hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16
)


def _float_leaves(tree):
    return [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]


def _loss(graphdef, params, tokens):
    model = nnx.merge(graphdef, params)
    hidden, _ = model(tokens)
    return jnp.mean(model.logits(hidden)[..., 0])


def test_small_adam_step_moves_float32_master_exactly_as_optax():
    lr = 1e-6
    model = Decoder(tiny_config(dtype="bfloat16", **SMALL), rngs=nnx.Rngs(0))
    tx = make_optimizer(OptimizerConfig(learning_rate=lr, max_grad_norm=None))
    graphdef, state = create_train_state(model, tx, rng=jax.random.key(0))
    assert all(x.dtype == jnp.float32 for x in _float_leaves(state.params))
    tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, 64)
    loss, grads = jax.value_and_grad(_loss, argnums=1)(graphdef, state.params, tokens)
    new_state, _ = apply_gradients(state, tx, grads, loss=loss)

    # optax directly, on a float32 copy of the masters.
    ref_tx = optax.adamw(lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0)
    p32 = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), state.params)
    updates, _ = ref_tx.update(grads, ref_tx.init(p32), p32)
    expected = optax.apply_updates(p32, updates)
    for got, want in zip(jax.tree.leaves(new_state.params), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

    # The step is real (Adam's first step is ~lr per weight) and far below a bf16 ulp:
    # stored in bf16 the same update rounds away on the large weights.
    w0 = np.asarray(state.params["layers"]["wq"][...])
    w1 = np.asarray(new_state.params["layers"]["wq"][...])
    moved = np.abs(w1 - w0)
    big = np.abs(w0) > 0.01  # a bf16 ulp there is >= 2^-14 ~ 6e-5, 60x the step
    assert big.mean() > 0.3
    assert np.all(moved[big] > 0.5 * lr) and np.all(moved < 2 * lr)
    w0_bf16 = jnp.asarray(w0, jnp.bfloat16)
    w1_bf16 = optax.apply_updates(w0_bf16, jnp.asarray(w1 - w0, jnp.bfloat16))
    assert w1_bf16.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(w1_bf16)[big], np.asarray(w0_bf16)[big])


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_driver_state_float32_masters_bf16_reference(small_model_dir, tmp_path, algo):
    overrides = [
        f"algo={algo}",
        f"model.source={small_model_dir}",
        "model.dtype=bfloat16",
        f"log.run_dir={tmp_path}",
        "ppo.kl_coef=0.05" if algo == "ppo" else "grpo.beta=0.04",
    ]
    cfg = load_config(None, overrides)
    mesh = build_mesh(cfg)
    model, _ = build_model(cfg, mesh=mesh)
    trainer = make_trainer(cfg, model, mesh)
    params = trainer.policy_params()
    opt_state = trainer.state.ppo.actor.opt_state if algo == "ppo" else trainer.state.opt_state
    assert {x.dtype for x in _float_leaves(params)} == {jnp.dtype(jnp.float32)}
    moments = [x for x in _float_leaves(opt_state) if x.ndim > 0]
    assert moments and {x.dtype for x in moments} == {jnp.dtype(jnp.float32)}
    ref = trainer.ref_params()
    assert {x.dtype for x in _float_leaves(ref)} == {jnp.dtype(jnp.bfloat16)}
    # The reference is the masters rounded once, not a different set of weights.
    for r, p in zip(jax.tree.leaves(ref), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(r), np.asarray(p.astype(jnp.bfloat16)))


def test_sampler_cast_once_is_bit_identical_to_casting_per_use():
    """`generate` casts float32 masters to the compute dtype once per call; a model whose
    parameters are already those bf16 values samples exactly the same rollout."""
    config = tiny_config(dtype="bfloat16", **SMALL)
    masters = Decoder(config, rngs=nnx.Rngs(3))
    graphdef, params = nnx.split(masters)
    stored = nnx.merge(graphdef, cast_floating(params, jnp.bfloat16))
    prompts = np.array([[5, 6, 7, 8], [0, 0, 9, 10]], np.int32)
    lengths = np.array([4, 2], np.int32)
    kw = dict(key=jax.random.key(0), max_new_tokens=6, group_size=2, sampling=SamplingConfig())
    a = generate(masters, prompts, lengths, **kw)
    b = generate(stored, prompts, lengths, **kw)
    np.testing.assert_array_equal(np.asarray(a.tokens_nt), np.asarray(b.tokens_nt))
    np.testing.assert_array_equal(np.asarray(a.logp_nt), np.asarray(b.logp_nt))


def test_reference_refresh_casts_the_masters_into_the_compute_dtype():
    from train_helpers import random_grpo_batch, small_model

    from grpojax.train import GRPOConfig, grpo_update

    model = small_model(13, dtype="bfloat16")
    tx = optax.sgd(0.1)
    graphdef, state = create_train_state(model, tx, rng=jax.random.key(0), with_ref=True)
    cfg = GRPOConfig(ref_refresh_every=1)
    step = jax.jit(lambda s, b: grpo_update(s, b, graphdef=graphdef, tx=tx, config=cfg))
    state, m = step(state, random_grpo_batch(14))
    assert float(m["ref_refreshed"]) == 1.0
    for p, r in zip(jax.tree.leaves(state.params), jax.tree.leaves(state.ref_params), strict=True):
        assert p.dtype == jnp.float32 and r.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(r), np.asarray(p.astype(jnp.bfloat16)))
