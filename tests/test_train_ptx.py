"""PPO-ptx in the GRPO and PPO steps: the gradient handed to the optimizer is the RL
gradient plus ptx_coef x the SFT step's own next-token gradient, micro-batching stays exact,
ptx_coef = 0 changes nothing, and the errors name the field."""

from __future__ import annotations

import dataclasses
import functools
from unittest import mock

import jax
import numpy as np
import pytest
from test_train_ppo import BASE as PPO_BASE
from test_train_ppo import _batch as ppo_batch
from test_train_ppo import _models as ppo_models
from train_helpers import FORWARD, grad_recorder, random_grpo_batch, random_text_batch, small_model

import grpojax.train.sft as sft_mod
from grpojax.train import GRPOConfig, SFTConfig, create_train_state, grpo_update, sft_update
from grpojax.train.config import PPOConfig
from grpojax.train.ppo import create_ppo_state, make_ppo_update

jax.config.update("jax_default_matmul_precision", "highest")

COEF = 0.7
GRPO = GRPOConfig(beta=0.05, shuffle=False, forward=FORWARD, ptx_coef=COEF)
PPO = dataclasses.replace(
    PPO_BASE, critic="shared", num_epochs=1, num_minibatches=1, kl_target=None, forward=FORWARD
)


def _leaves(tree) -> list[np.ndarray]:
    def host(x):
        return jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x

    return [np.asarray(host(x)) for x in jax.tree.leaves(tree)]


def _flat(tree) -> np.ndarray:
    return np.concatenate([np.ravel(x) for x in _leaves(tree)]).astype(np.float64)


def _rel(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _grpo(config, state, batch, graphdef, tx):
    fn = functools.partial(grpo_update, graphdef=graphdef, tx=tx, config=config)
    return jax.jit(fn)(state, batch)


def _sft_gradient(graphdef, state, ptx):
    """The SFT step's gradient of the token-mean NLL alone (recorded by the optimizer)."""
    tx = grad_recorder()
    fn = functools.partial(sft_update, graphdef=graphdef, tx=tx, config=SFTConfig(forward=FORWARD))
    st, m = jax.jit(fn)(state.replace(opt_state=tx.init(state.params)), ptx)
    return _flat(st.opt_state), float(m["loss"])


def test_grpo_ptx_gradient_is_rl_plus_coef_times_sft_and_accumulates_exactly():
    """(float32, tolerances on the whole gradient vector) g(ptx_coef=c) == g(0) + c g_SFT
    within 1e-5 relative; K=2 micro-batches == K=1 within 1e-6; ptx_loss == the SFT loss."""
    tx = grad_recorder()
    graphdef, state = create_train_state(small_model(1), tx, rng=jax.random.key(0), with_ref=True)
    state = state.replace(ref_params=jax.tree.map(lambda p: p * 1.01, state.ref_params))
    batch = random_grpo_batch(2).replace(ptx=random_text_batch(3))

    s_rl, m_rl = _grpo(dataclasses.replace(GRPO, ptx_coef=0.0), state, batch, graphdef, tx)
    s1, m1 = _grpo(GRPO, state, batch, graphdef, tx)
    g_sft, sft_loss = _sft_gradient(graphdef, state, batch.ptx)
    g_rl, g1 = _flat(s_rl.opt_state), _flat(s1.opt_state)
    assert np.linalg.norm(g_sft) > 0 and np.linalg.norm(g_rl) > 0
    rel = _rel(g1, g_rl + COEF * g_sft)
    print(f"GRPO: |g - (g_rl + c g_sft)| / |.| = {rel:.2e}")
    assert rel <= 1e-5, rel
    np.testing.assert_allclose(float(m1["ptx_loss"]), sft_loss, rtol=1e-6)
    np.testing.assert_allclose(float(m1["loss"]), float(m_rl["loss"]) + COEF * sft_loss, rtol=1e-6)
    assert "ptx_loss" not in m_rl

    s2, m2 = _grpo(dataclasses.replace(GRPO, num_microbatches=2), state, batch, graphdef, tx)
    rel2 = _rel(_flat(s2.opt_state), g1)
    print(f"GRPO: K=2 vs K=1 relative gradient difference {rel2:.2e}")
    assert rel2 <= 1e-6, rel2
    for name in ("loss", "ptx_loss", "pg_loss"):
        np.testing.assert_allclose(float(m2[name]), float(m1[name]), rtol=1e-6, atol=1e-9)
    # kl_loss is ~1e-5 (k3(d) ~ d^2 / 2, d ~ 1e-2): a logprob's float32 rounding on 4 rows
    # against 8 (DELTA = 2e-6) moves it by ~2 DELTA / |d| relatively (6.6e-5 seen), so the
    # Cauchy-Schwarz bound DELTA sqrt(2 T kl) of test_train_grpo's micro-batch test (2e-8
    # here); a micro-batch miscounted misses by ~kl / 2.
    kl, t = float(m1["kl_loss"]), batch.completion_mask_nt.shape[1]
    np.testing.assert_allclose(float(m2["kl_loss"]), kl, rtol=0, atol=2e-6 * np.sqrt(2 * t * kl))


def test_grpo_ptx_zero_ignores_the_rows_and_runs_no_forward():
    """ptx_coef = 0: bit-identical state and metrics with or without ptx rows, the same
    program (equation count) and the next-token loss never traced."""
    tx = grad_recorder()
    graphdef, state = create_train_state(small_model(4), tx, rng=jax.random.key(0), with_ref=True)
    batch = random_grpo_batch(5)
    cfg = dataclasses.replace(GRPO, ptx_coef=0.0)
    calls = []
    real = sft_mod.next_token_nll

    def counting(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    with mock.patch.object(sft_mod, "next_token_nll", counting):
        s0, m0 = _grpo(cfg, state, batch, graphdef, tx)
        s1, m1 = _grpo(cfg, state, batch.replace(ptx=random_text_batch(6)), graphdef, tx)
        fn = functools.partial(grpo_update, graphdef=graphdef, tx=tx, config=cfg)
        eqns = [
            len(jax.make_jaxpr(fn)(state, b).jaxpr.eqns)
            for b in (batch, batch.replace(ptx=random_text_batch(6)))
        ]
    assert not calls
    assert eqns[0] == eqns[1], eqns
    assert all(np.array_equal(x, y) for x, y in zip(_leaves(s0), _leaves(s1), strict=True))
    assert {k: float(v) for k, v in m0.items()} == {k: float(v) for k, v in m1.items()}


def test_ppo_ptx_gradient_is_rl_plus_coef_times_sft_and_accumulates_exactly():
    """PPO (shared critic), actor gradient with ptx_coef = c and K=2 micro-batches ==
    the K=1 gradient without ptx + c g_SFT, within 1e-5 relative (float32); the critic
    head's gradient is untouched by the ptx term (to float32 rounding of the K split)."""
    batch = ppo_batch(7)._replace(ptx=random_text_batch(8))
    tx = grad_recorder()
    out = {}
    for name, cfg in (
        ("rl", PPO),
        ("ptx_k2", dataclasses.replace(PPO, ptx_coef=COEF, num_microbatches=2)),
    ):
        actor, critic = ppo_models(cfg)
        graphs, state = create_ppo_state(actor, critic, tx, tx, config=cfg, rng=jax.random.key(3))
        out[name] = jax.jit(make_ppo_update(cfg, graphs, tx, tx))(state, batch)
    g_sft, sft_loss = _sft_gradient(graphs.actor, state.actor, batch.ptx)
    (s_rl, m_rl), (s2, m2) = out["rl"], out["ptx_k2"]
    g_rl, g2 = _flat(s_rl.actor.opt_state), _flat(s2.actor.opt_state)
    assert np.linalg.norm(g_sft) > 0 and np.linalg.norm(g_rl) > 0
    rel = _rel(g2, g_rl + COEF * g_sft)
    print(f"PPO: |g - (g_rl + c g_sft)| / |.| = {rel:.2e}")
    assert rel <= 1e-5, rel
    assert _rel(_flat(s2.critic.opt_state), _flat(s_rl.critic.opt_state)) <= 1e-6
    np.testing.assert_allclose(float(m2["ptx_loss"]), sft_loss, rtol=1e-6)
    np.testing.assert_allclose(float(m2["loss"]), float(m_rl["loss"]) + COEF * sft_loss, rtol=1e-6)
    assert "ptx_loss" not in m_rl


def test_ptx_errors_name_the_field():
    for cls in (GRPOConfig, PPOConfig):
        with pytest.raises(ValueError, match="ptx_coef must be a finite number >= 0"):
            cls(ptx_coef=-0.1)
    tx = grad_recorder()
    graphdef, state = create_train_state(small_model(9), tx, rng=jax.random.key(0), with_ref=True)
    cfg = dataclasses.replace(GRPO, num_microbatches=2)
    fn = functools.partial(grpo_update, graphdef=graphdef, tx=tx, config=cfg)
    with pytest.raises(ValueError, match=r"ptx_coef=0\.7 needs a pretraining batch: the batch"):
        jax.eval_shape(fn, state, random_grpo_batch(10))
    with pytest.raises(ValueError, match="ptx rows N'=3 must divide"):
        jax.eval_shape(fn, state, random_grpo_batch(10).replace(ptx=random_text_batch(11, n=3)))
    cfg = dataclasses.replace(PPO, ptx_coef=0.5)
    actor, critic = ppo_models(cfg)
    graphs, ppo_state = create_ppo_state(actor, critic, tx, tx, config=cfg, rng=jax.random.key(3))
    with pytest.raises(ValueError, match=r"ptx_coef=0\.5 needs a pretraining batch"):
        jax.eval_shape(make_ppo_update(cfg, graphs, tx, tx), ppo_state, ppo_batch(12))
