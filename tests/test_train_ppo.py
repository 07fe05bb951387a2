"""The PPO step: shaped rewards / GAE against a NumPy reference, the adaptive KL controller,
micro-batch accumulation, critic warm-up, early stop, skipped non-finite updates, sharded
equals single-device, and a learning-sanity run with the real sampler."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from multidevice import run_with_devices

from grpojax.models import Decoder, forward_logits, make_mesh, tiny_config
from grpojax.ops.masks import mask_from_lengths
from grpojax.train.common import ForwardConfig
from grpojax.train.config import PPOConfig
from grpojax.train.ppo import (
    PPOBatch,
    create_ppo_state,
    init_critic,
    make_ppo_step,
    make_ppo_update,
    ppo_targets,
    reference_kl,
    shard_ppo_state,
)
from grpojax.train.state import OptimizerConfig, make_optimizer

N, P, T = 8, 4, 6
MODEL = dict(
    num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16
)
# The base configuration: several tests reuse its compiled program (persistent cache).
BASE = PPOConfig(
    critic="separate",
    gamma=0.9,
    lam=0.8,
    kl_coef=0.1,
    kl_target=0.5,
    kl_horizon=50.0,
    num_epochs=2,
    num_minibatches=2,
    value_clip=0.2,
    vf_coef=0.5,
    entropy_coef=0.01,
)


def _batch(seed: int, n: int = N) -> PPOBatch:
    """Random ragged rows: left-padded prompts, right-padded completions, masks from lengths."""
    rng = np.random.default_rng(seed)
    plen = jnp.asarray(rng.integers(1, P + 1, n))
    clen = jnp.asarray(rng.integers(1, T + 1, n))
    pmask = mask_from_lengths(plen, P, offset_n=P - plen)
    cmask = mask_from_lengths(clen, T)
    tokens = jnp.asarray(rng.integers(3, 100, (n, P + T)), jnp.int32)
    return PPOBatch(
        tokens_ns=jnp.where(jnp.concatenate([pmask, cmask], 1), tokens, 0),
        mask_ns=jnp.concatenate([pmask, cmask], 1),
        completion_mask_nt=cmask,
        scores_n=jnp.asarray(rng.normal(size=n), jnp.float32),
        ref_logp_nt=jnp.asarray(-rng.uniform(2.0, 7.0, (n, T)), jnp.float32),
    )


def _models(config: PPOConfig, seed: int = 0):
    actor = Decoder(tiny_config(**MODEL), rngs=nnx.Rngs(seed))
    critic = init_critic(actor, mode=config.critic, rngs=nnx.Rngs(seed + 1))
    return actor, critic


def _setup(config: PPOConfig, batch: PPOBatch, *, lr: float = 1e-3, tx=None):
    actor, critic = _models(config)
    tx = make_optimizer(OptimizerConfig(learning_rate=lr)) if tx is None else tx
    graphs, state = create_ppo_state(actor, critic, tx, tx, config=config, rng=jax.random.key(3))
    mesh = make_mesh(fsdp=1, devices=jax.devices()[:1])
    state, _ = shard_ppo_state(state, tx, tx, mesh)
    step = make_ppo_step(config, graphs, tx, tx, mesh=mesh, state=state, batch=batch)
    return step, state


def _host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


def _trees_equal(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


# ---------------------------------------------------------------------------- NumPy reference


def _np_log_softmax(z):
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def _np_gae(rewards, values, mask, gamma, lam):
    """Right-padded rows: the recursion runs backwards over each row's real tokens."""
    adv = np.zeros_like(rewards)
    for n in range(rewards.shape[0]):
        idx = np.flatnonzero(mask[n])
        next_v, next_a = 0.0, 0.0
        for t in idx[::-1]:
            delta = rewards[n, t] + gamma * next_v - values[n, t]
            next_a = delta + gamma * lam * next_a
            next_v = values[n, t]
            adv[n, t] = next_a
    return adv, np.where(mask, adv + values, 0.0)


def _np_targets(batch, old_logp, old_values, *, beta, gamma, lam):
    mask = np.asarray(batch.completion_mask_nt)
    kl = np.where(mask, old_logp - np.asarray(batch.ref_logp_nt), 0.0)  # k1
    rewards = -beta * kl
    last = mask.sum(1) - 1
    rewards[np.arange(len(last)), last] += np.asarray(batch.scores_n)
    rewards = np.where(mask, rewards, 0.0)
    adv, returns = _np_gae(rewards, old_values, mask, gamma, lam)
    mean = adv[mask].mean()
    var = ((adv[mask] - mean) ** 2).mean()
    white = np.where(mask, (adv - mean) / np.sqrt(var + 1e-8), 0.0)
    return kl, rewards, white, returns


def _old_logp_values_np(actor, critic, batch):
    """Old logprobs from full logits and values from the critic's own call, independently."""
    logits = np.asarray(forward_logits(actor, batch.tokens_ns, batch.mask_ns), np.float64)
    logp_all = _np_log_softmax(logits)[:, P - 1 : P + T - 1]
    targets = np.asarray(batch.tokens_ns)[:, P:]
    logp = np.take_along_axis(logp_all, targets[..., None], -1)[..., 0]
    values = np.asarray(critic(batch.tokens_ns, mask_nt=batch.mask_ns))[:, P - 1 : P + T - 1]
    mask = np.asarray(batch.completion_mask_nt)
    return np.where(mask, logp, 0.0), np.where(mask, values, 0.0)


# ---------------------------------------------------------------------------- tests


def test_config_validation_names_field_and_allowed_values():
    with pytest.raises(ValueError, match=r"critic must be one of .*separate.*shared"):
        PPOConfig(critic="twin")
    with pytest.raises(ValueError, match="kl_estimator must be one of"):
        PPOConfig(kl_estimator="k9")
    with pytest.raises(ValueError, match="aggregation must be one of"):
        PPOConfig(aggregation="mean")
    with pytest.raises(ValueError, match="lam must be a finite number >= 0 and <= 1"):
        PPOConfig(lam=1.5)
    with pytest.raises(ValueError, match="num_minibatches must be an int >= 1"):
        PPOConfig(num_minibatches=0)
    with pytest.raises(ValueError, match="target_kl must be None or a finite number > 0"):
        PPOConfig(target_kl=0.0)
    with pytest.raises(ValueError, match="norm_constant"):
        PPOConfig(aggregation="seq-mean-token-sum-norm", norm_constant=-1.0)
    with pytest.raises(ValueError, match="critic_warmup_steps"):
        PPOConfig(critic_warmup_steps=-1)
    with pytest.raises(ValueError, match=r"kl_target .*needs kl_coef > 0"):
        PPOConfig(kl_coef=0.0, kl_target=0.5)
    actor, _ = _models(PPOConfig())
    with pytest.raises(ValueError, match="mode must be one of"):
        init_critic(actor, mode="both", rngs=nnx.Rngs(0))
    head = init_critic(actor, mode="shared", rngs=nnx.Rngs(0))
    tx = make_optimizer(OptimizerConfig())
    with pytest.raises(ValueError, match="needs a ValueModel critic"):
        create_ppo_state(actor, head, tx, tx, config=PPOConfig(), rng=jax.random.key(0))


def test_ppo_targets_match_numpy_reference():
    """Shaped rewards (k1 penalty + score on the last token), GAE and whitening by hand."""
    batch = _batch(0)
    rng = np.random.default_rng(1)
    old_logp = np.where(batch.completion_mask_nt, -rng.uniform(0.5, 6.0, (N, T)), 0.0)
    old_values = np.where(batch.completion_mask_nt, rng.normal(size=(N, T)), 0.0)
    got = jax.jit(lambda lp, v: ppo_targets(BASE, batch, lp, v, beta=0.1))(
        jnp.asarray(old_logp, jnp.float32), jnp.asarray(old_values, jnp.float32)
    )
    want = _np_targets(batch, old_logp, old_values, beta=0.1, gamma=0.9, lam=0.8)
    for name, g, w in zip(("kl", "rewards", "adv", "returns"), got, want):
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-5, atol=1e-5, err_msg=name)


# kl_coef = 0: no reference anywhere (a fixed beta of 0; kl_target is refused there).
NO_REF = dataclasses.replace(BASE, kl_coef=0.0, kl_target=None)


def test_ppo_targets_without_reference_match_numpy_reference():
    """kl_coef = 0: the reward is the score on the last real token, as the NumPy reference
    gives it at beta = 0 whatever the reference logprobs; the batch carries none, no KL is
    returned, and a KL passed in is refused."""
    batch = _batch(0)
    rng = np.random.default_rng(1)
    old_logp = np.where(batch.completion_mask_nt, -rng.uniform(0.5, 6.0, (N, T)), 0.0)
    old_values = np.where(batch.completion_mask_nt, rng.normal(size=(N, T)), 0.0)
    lp, v = jnp.asarray(old_logp, jnp.float32), jnp.asarray(old_values, jnp.float32)
    no_ref = batch._replace(ref_logp_nt=None)
    got = jax.jit(lambda lp, v: ppo_targets(NO_REF, no_ref, lp, v, beta=0.0))(lp, v)
    assert got.kl_nt is None
    _, *want = _np_targets(batch, old_logp, old_values, beta=0.0, gamma=0.9, lam=0.8)
    for name, g, w in zip(("rewards", "adv", "returns"), got[1:], want):
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-5, atol=1e-5, err_msg=name)
    with pytest.raises(ValueError, match="kl_coef=0 has no reference"):
        ppo_targets(NO_REF, no_ref, lp, v, beta=0.0, kl_nt=jnp.zeros((N, T)))


def test_ppo_targets_add_per_token_rewards_over_a_mask_with_holes():
    """A multi-turn episode's rows: the loss mask has holes (environment ids) and rewards
    sit at given tokens (each turn's end) besides the score on the last real token. By hand:
    r = score on the last real token + token rewards on real tokens (ignored on masked
    ones), then GAE over the real tokens only (`_np_gae` skips the holes) and whitening."""
    batch = _batch(0)
    rng = np.random.default_rng(2)
    mask = np.asarray(batch.completion_mask_nt).copy()
    mask[:, 1:3] = False  # an environment answer after the first policy id
    token_rewards = np.where(rng.uniform(size=(N, T)) < 0.3, rng.normal(size=(N, T)), 0.0)
    old_logp = np.where(mask, -rng.uniform(0.5, 6.0, (N, T)), 0.0)
    old_values = np.where(mask, rng.normal(size=(N, T)), 0.0)
    b = batch._replace(
        completion_mask_nt=jnp.asarray(mask),
        ref_logp_nt=None,
        token_rewards_nt=jnp.asarray(token_rewards, jnp.float32),
    )
    got = jax.jit(lambda lp, v: ppo_targets(NO_REF, b, lp, v, beta=0.0))(
        jnp.asarray(old_logp, jnp.float32), jnp.asarray(old_values, jnp.float32)
    )
    rewards = np.where(mask, token_rewards, 0.0)
    for n in range(N):
        rewards[n, np.flatnonzero(mask[n])[-1]] += float(batch.scores_n[n])
    adv, returns = _np_gae(rewards, old_values, mask, NO_REF.gamma, NO_REF.lam)
    assert NO_REF.whiten_advantages
    mean = adv[mask].mean()
    white = np.where(mask, (adv - mean) / np.sqrt(((adv[mask] - mean) ** 2).mean() + 1e-8), 0.0)
    for name, g, w in zip(("rewards", "adv", "returns"), got[1:], (rewards, white, returns)):
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-5, atol=1e-5, err_msg=name)


def test_step_without_reference_equals_the_reference_step_at_beta_0():
    """kl_coef = 0 (k1, and "full"): the state keeps no reference and the batch carries no
    reference logprobs, and one step gives what the reference path gives with its beta set
    to 0 (kl_coef 0.1, the controller's beta overwritten; the KL computed, then weighted by
    0): every metric but kl_ref / kl_ref_token, which it does not report, within 1e-6, and
    the same actor and critic parameters within 1e-6."""
    batch = _batch(4)
    tx = make_optimizer(OptimizerConfig(learning_rate=1e-3))
    with_ref = dataclasses.replace(NO_REF, kl_coef=0.1)
    step, state = _setup(with_ref, batch, tx=tx)
    state = state.replace(
        actor=state.actor.replace(
            kl_state=state.actor.kl_state._replace(beta=jnp.zeros_like(state.actor.kl_state.beta))
        )
    )
    want_state, want = step(state, batch)
    want = _host(want)
    assert want["kl_ref"] != 0 and want["beta"] == 0.0  # a KL (k1) is there, weighted by 0
    for config in (NO_REF, dataclasses.replace(NO_REF, kl_estimator="full")):
        no_ref = batch._replace(ref_logp_nt=None)
        step, state = _setup(config, no_ref, tx=tx)
        assert state.actor.ref_params is None, config.kl_estimator
        got_state, got = step(state, no_ref)
        got = _host(got)
        assert set(got) == set(want) - {"kl_ref", "kl_ref_token"}, config.kl_estimator
        for k in got:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-6, err_msg=k)
        np.testing.assert_allclose(got["reward_mean"], np.mean(batch.scores_n), rtol=1e-6)
        worst = 0.0
        for part in ("actor", "critic"):
            for x, y in zip(
                jax.tree.leaves(_host(getattr(got_state, part).params)),
                jax.tree.leaves(_host(getattr(want_state, part).params)),
                strict=True,
            ):
                # Adam steps of lr 1e-3 from two programs (with and without a reference):
                # 1e-6 is 0.1% of a step (2.5e-7 seen).
                np.testing.assert_allclose(x, y, rtol=0, atol=1e-6, err_msg=part)
                worst = max(worst, float(np.abs(x - y).max()))
        print(config.kl_estimator, "max parameter difference", worst)


def _grouped_batch(seed: int, b: int = 2, g: int = 4) -> PPOBatch:
    """b prompts x g samples in contiguous groups: each group's rows share the prompt
    columns (left-padded), with their own ragged completions (as the sampler lays them out)."""
    rng = np.random.default_rng(seed)
    plen = np.repeat(rng.integers(1, P + 1, b), g)
    clen = jnp.asarray(rng.integers(1, T + 1, b * g))
    pmask = mask_from_lengths(jnp.asarray(plen), P, offset_n=jnp.asarray(P - plen))
    cmask = mask_from_lengths(clen, T)
    prompts = np.repeat(rng.integers(3, 100, (b, P)), g, axis=0)
    tokens = jnp.asarray(np.concatenate([prompts, rng.integers(3, 100, (b * g, T))], 1))
    mask = jnp.concatenate([pmask, cmask], 1)
    return PPOBatch(
        tokens_ns=jnp.where(mask, tokens, 0).astype(jnp.int32),
        mask_ns=mask,
        completion_mask_nt=cmask,
        scores_n=jnp.asarray(rng.normal(size=b * g), jnp.float32),
        ref_logp_nt=None,
    )


def test_share_prompt_step_equals_the_unshared_step():
    """share_prompt=True (each prompt run once per forward: actor, separate critic, the
    "full" KL's reference; groups kept whole in the shuffles and splits) == False on a
    batch of groups: 2 epochs, K = 2 accumulation. Metrics <= 1e-5 relative (1e-6
    absolute) and the SGD updates of actor and critic <= 1e-5 relative (float32 rounding:
    a prompt's cache attended by G rows vs G full forwards). Whole groups per micro-batch
    are required (N = 8 rows, G 4, K 4: an error naming the product)."""
    g = 4
    batch = _grouped_batch(8, g=g)
    base = dataclasses.replace(
        FULL, critic="separate", num_epochs=2, num_minibatches=1, num_microbatches=2, group_size=g
    )
    tx = optax.sgd(0.1)
    other = nnx.split(Decoder(tiny_config(**MODEL), rngs=nnx.Rngs(5)), nnx.Param)[1]
    out = {}
    for share in (False, True):
        config = dataclasses.replace(base, share_prompt=share)
        step, state = _setup(config, batch, tx=tx)
        ref = jax.tree.map(jnp.copy, other)  # a KL that is not 0 (a copy: the step donates)
        state = state.replace(actor=state.actor.replace(ref_params=ref))
        start = _host((state.actor.params, state.critic.params))
        new, m = step(state, batch)
        end = _host((new.actor.params, new.critic.params))
        out[share] = (_host(m), jax.tree.map(lambda a, b: a - b, end, start))
    (m0, d0), (m1, d1) = out[False], out[True]
    assert set(m0) == set(m1), set(m0) ^ set(m1)
    assert m0["kl_ref"] > 0.1, m0["kl_ref"]
    for k in m0:
        np.testing.assert_allclose(m1[k], m0[k], rtol=1e-5, atol=1e-6, err_msg=k)
    for part, a, b in zip(("actor", "critic"), d0, d1):
        a = np.concatenate([np.ravel(x) for x in jax.tree.leaves(a)]).astype(np.float64)
        b = np.concatenate([np.ravel(x) for x in jax.tree.leaves(b)]).astype(np.float64)
        rel = np.linalg.norm(b - a) / np.linalg.norm(a)
        print(f"share_prompt: {part} update relative difference {rel:.2e}")
        assert np.linalg.norm(a) > 0 and rel <= 1e-5, (part, rel)

    config = dataclasses.replace(base, share_prompt=True, num_microbatches=4)
    with pytest.raises(ValueError, match=r"N=8 rows must divide into group_size x"):
        step, state = _setup(config, batch, tx=tx)
        step(state, batch)
    with pytest.raises(ValueError, match="share_prompt must be True or False"):
        PPOConfig(share_prompt=1)


def test_step_rewards_gae_and_adaptive_kl_match_hand_computation():
    """Inside the step: old logprobs/values, shaped rewards, GAE and the controller update."""
    batch = _batch(0)
    actor, critic = _models(BASE)
    old_logp, old_values = _old_logp_values_np(actor, critic, batch)
    step, state = _setup(BASE, batch)
    mask = np.asarray(batch.completion_mask_nt)
    beta = BASE.kl_coef
    for call in range(2):
        state, m = step(state, batch)
        m = _host(m)
        assert m["beta"] == pytest.approx(beta, rel=1e-6)
        if call == 0:  # step 0 sees the initial parameters the reference was computed at
            kl, rewards, _, returns = _np_targets(
                batch, old_logp, old_values, beta=beta, gamma=0.9, lam=0.8
            )
            np.testing.assert_allclose(m["kl_ref"], kl.sum(1).mean(), rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(m["reward_mean"], rewards.sum(1).mean(), atol=1e-4)
            np.testing.assert_allclose(m["returns_mean"], returns[mask].mean(), atol=1e-4)
            np.testing.assert_allclose(m["values_mean"], old_values[mask].mean(), atol=1e-5)
            ev = 1 - np.var((returns - old_values)[mask]) / np.var(returns[mask])
            np.testing.assert_allclose(m["explained_variance"], ev, atol=1e-4)
            assert m["updates"] == BASE.num_epochs * BASE.num_minibatches
            assert m["early_stop_epoch"] == BASE.num_epochs
        # Ziegler et al.: beta <- beta * (1 + clip(KL / target - 1, -0.2, 0.2) * N / horizon)
        err = np.clip(m["kl_ref"] / BASE.kl_target - 1.0, -0.2, 0.2)
        beta = beta * (1.0 + err * N / BASE.kl_horizon)
        assert m["beta_next"] == pytest.approx(beta, rel=1e-6)
        assert float(state.actor.kl_state.beta) == pytest.approx(beta, rel=1e-6)
    assert beta != BASE.kl_coef


@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_rollout_correction_weighs_the_policy_loss_as_numpy(mode):
    """`rollout_correction_mode`: the per-token policy loss times the importance weights of
    the step's pi_old against the sampler's logprobs (TIS: min(w, 2); MIS: w inside [1/2, 2],
    else 0). At the first update the ratio is 1, so the policy loss is the token mean of
    -A_t w_t, A from the NumPy GAE above and w from the independent old logprobs."""
    config = dataclasses.replace(
        BASE, num_epochs=1, num_minibatches=1, kl_target=None, rollout_correction_mode=mode
    )
    batch = _batch(0)
    actor, critic = _models(config)
    old_logp, old_values = _old_logp_values_np(actor, critic, batch)
    mask = np.asarray(batch.completion_mask_nt)
    log_w = np.random.default_rng(1).uniform(-1.0, 1.0, old_logp.shape)  # old - sampler
    sampler = np.where(mask, old_logp - log_w, 0.0)
    batch = batch._replace(sampler_logp_nt=jnp.asarray(sampler, jnp.float32))
    _, _, white, _ = _np_targets(batch, old_logp, old_values, beta=0.1, gamma=0.9, lam=0.8)
    if mode == "truncate":
        w = np.minimum(np.exp(log_w), 2.0)
    else:
        w = np.where(np.abs(log_w) <= np.log(2.0), np.exp(log_w), 0.0)
    assert 0 < (w == 0).sum() or mode == "truncate"  # MIS drops some tokens here
    step, state = _setup(config, batch)
    _, m = step(state, batch)
    m = _host(m)
    np.testing.assert_allclose(m["policy_loss"], (-white * w)[mask].mean(), atol=1e-4)
    np.testing.assert_allclose(m["rollout_weight_mean"], w[mask].mean(), atol=1e-4)
    with pytest.raises(ValueError, match=r"rollout_correction_mode='.*' needs batch.sampler"):
        step(state, batch._replace(sampler_logp_nt=None))


def test_a_user_policy_loss_replaces_the_surrogate():
    """`ppo.policy_loss="package.module:function"` (GRPO's contract, this `PPOConfig`):
    the clipped surrogate written as a user loss gives the built-in's update and metrics to
    float32 rounding (the step also reduces the loss's own metrics, which XLA fuses
    differently: a few ulps; measured 3.4e-7 on parameters of size 1), and logs the loss's
    other metrics; CISPO
    written by hand gives, at the first update (ratio 1), the NumPy token mean of
    -A_t log pi_old(o_t) as its policy loss, and its own metrics are logged."""
    config = dataclasses.replace(BASE, num_epochs=1, num_minibatches=1, kl_target=None)
    batch = _batch(0)
    step, state = _setup(config, batch)
    want_state, want = step(state, batch)
    again = dataclasses.replace(config, policy_loss="custom_objectives:ppo_clip_again")
    step, state = _setup(again, batch)
    got_state, got = step(state, batch)
    for part in ("actor", "critic"):
        got_part, want_part = getattr(got_state, part), getattr(want_state, part)
        for tree in ("params", "opt_state"):  # the update is 1e-3: 1e-6 is its 0.1%
            for x, y in zip(
                jax.tree.leaves(_host(getattr(got_part, tree))),
                jax.tree.leaves(_host(getattr(want_part, tree))),
                strict=True,
            ):
                np.testing.assert_allclose(x, y, rtol=0, atol=1e-6, err_msg=f"{part} {tree}")
    got, want = _host(got), _host(want)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-7, err_msg=k)
    assert {"dual_clip_frac", "ratio_max", "ratio_min"} <= set(got)  # the loss's own

    cispo = dataclasses.replace(config, policy_loss="custom_objectives:cispo_with_its_weight")
    actor, critic = _models(cispo)
    old_logp, old_values = _old_logp_values_np(actor, critic, batch)
    _, _, white, _ = _np_targets(batch, old_logp, old_values, beta=0.1, gamma=0.9, lam=0.8)
    mask = np.asarray(batch.completion_mask_nt)
    step, state = _setup(cispo, batch)
    _, m = step(state, batch)
    np.testing.assert_allclose(
        _host(m)["policy_loss"], (-white * old_logp)[mask].mean(), rtol=1e-4, atol=1e-4
    )
    np.testing.assert_allclose(_host(m)["cispo_weight_mean"], 1.0, rtol=1e-6)  # its own
    for bad, match in [
        ("cispo", r"^policy_loss must be 'ppo_clip' or 'package.module:function'"),
        ("custom_objectives:missing_config", r"^policy_loss"),
    ]:
        with pytest.raises(ValueError, match=match):
            dataclasses.replace(config, policy_loss=bad)


def test_microbatch_accumulation_equals_full_minibatch():
    """Two micro-batches with the mini-batch's global denominator == one micro-batch.

    Plain SGD, so parameters move linearly in the gradients (Adam's g / sqrt(v) would turn
    rounding-level gradient differences at g ~ 0 into lr-sized ones)."""
    batch = _batch(1)
    results = []
    for k in (1, 2):
        config = PPOConfig(**{**BASE.__dict__, "num_microbatches": k})
        step, state = _setup(config, batch, tx=optax.sgd(0.05))
        state, m = step(state, batch)
        results.append((_host(state.actor.params), _host(state.critic.params), _host(m)))
    (a1, c1, m1), (a2, c2, m2) = results
    for key in ("loss", "policy_loss", "value_loss", "entropy", "approx_kl", "grad_norm"):
        np.testing.assert_allclose(m2[key], m1[key], rtol=1e-5, atol=1e-7, err_msg=key)
    for x, y in zip(jax.tree.leaves((a1, c1)), jax.tree.leaves((a2, c2))):
        np.testing.assert_allclose(y, x, rtol=1e-6, atol=1e-7)


def test_nonfinite_updates_are_skipped_and_counted():
    batch = _batch(2)
    scores = np.asarray(batch.scores_n).copy()
    scores[3] = np.nan  # whitening spreads it to every advantage: every update is non-finite
    batch = batch._replace(scores_n=jnp.asarray(scores))
    step, state = _setup(BASE, batch)
    before = _host((state.actor.params, state.actor.opt_state, state.critic.params))
    state, m = step(state, batch)
    after = _host((state.actor.params, state.actor.opt_state, state.critic.params))
    assert _trees_equal(before, after)
    n_updates = BASE.num_epochs * BASE.num_minibatches
    assert float(m["skipped"]) == n_updates and float(m["updates"]) == 0.0
    assert int(state.critic.skipped) == n_updates and int(state.actor.skipped) == n_updates
    assert int(state.actor.num_updates) == 0


@pytest.mark.parametrize("mode", ["separate", "shared"])
def test_critic_warmup_leaves_actor_unchanged(mode):
    config = PPOConfig(
        critic=mode, num_epochs=1, num_minibatches=2, critic_warmup_steps=1, kl_coef=0.05
    )
    batch = _batch(3)
    step, state = _setup(config, batch)
    actor0 = _host((state.actor.params, state.actor.opt_state))
    critic0 = _host(state.critic.params)
    state, m = step(state, batch)
    assert float(m["critic_warmup"]) == 1.0
    assert _trees_equal(actor0, _host((state.actor.params, state.actor.opt_state)))
    assert not _trees_equal(critic0, _host(state.critic.params))
    assert int(state.critic.num_updates) == 2 and int(state.actor.num_updates) == 0
    state, m = step(state, batch)  # warm-up over: the actor moves
    assert float(m["critic_warmup"]) == 0.0
    assert not _trees_equal(actor0[0], _host(state.actor.params))
    assert int(state.actor.num_updates) == 2


def test_early_stop_masks_later_updates():
    """A tiny target: the first update (ratio exactly 1, approx KL 0) is applied; the next
    mini-batch already sees approx KL > target, so it and every later update are dropped."""
    config = PPOConfig(num_epochs=3, num_minibatches=2, target_kl=1e-9, kl_coef=0.05)
    batch = _batch(4)
    step, state = _setup(config, batch)
    state, m = step(state, batch)
    assert float(m["updates"]) == 1.0
    assert float(m["early_stop_epoch"]) == 0.0
    assert int(state.actor.num_updates) == 1 and int(state.critic.num_updates) == 1
    assert float(m["approx_kl"]) == 0.0  # the one applied update is the first: ratio == 1


# ------------------------------------------------------------- full-vocabulary KL penalty

# Small tiles: several token chunks and a ragged last vocabulary tile (V = 100 = 2 x 48 + 4).
FULL_FORWARD = ForwardConfig(chunk_size=16, vocab_chunk_size=48, temperature=0.8)
FULL = PPOConfig(
    kl_estimator="full",
    kl_coef=0.3,
    gamma=0.9,
    lam=0.8,
    num_epochs=1,
    num_microbatches=2,  # the old pass (and the reference beside it) runs in 2 micro-batches
    forward=FULL_FORWARD,
)


def _np_full_kl(policy, ref, batch, temperature):
    """KL_t = sum_v p_v (log p_v - log q_v) `[N, T]` in float64 from both models' full
    logits at the completion positions (0 at padding)."""

    def log_probs(model):
        logits = np.asarray(forward_logits(model, batch.tokens_ns, batch.mask_ns), np.float64)
        return _np_log_softmax(logits / temperature)[:, P - 1 : P + T - 1]

    lp, lq = log_probs(policy), log_probs(ref)
    kl = (np.exp(lp) * (lp - lq)).sum(-1)
    return np.where(np.asarray(batch.completion_mask_nt), kl, 0.0)


def test_full_vocabulary_kl_penalty_matches_numpy():
    """kl_estimator="full": the reward penalty is the exact KL over the vocabulary, from the
    policy's and the reference's hidden states in vocabulary tiles. Per token (reference_kl,
    which the step's old pass calls) and through the step's metrics (kl_ref = mean over
    rows of sum_t KL_t, reward_mean = mean of score - beta sum_t KL_t) against float64 NumPy
    from full logits; the batch carries no reference logprobs. Also with a LoRA actor, whose
    reference is its base (adapters off)."""
    batch = _batch(6)._replace(ref_logp_nt=None)
    mask = np.asarray(batch.completion_mask_nt)
    actor, critic = _models(FULL)
    ref_model = Decoder(tiny_config(**MODEL), rngs=nnx.Rngs(5))
    want = _np_full_kl(actor, ref_model, batch, FULL_FORWARD.temperature)
    assert (want[mask] > 0).all()

    tx = optax.sgd(0.0)
    graphs, state = create_ppo_state(actor, critic, tx, tx, config=FULL, rng=jax.random.key(3))
    ref_params = nnx.split(ref_model, nnx.Param)[1]
    args = (batch.tokens_ns, batch.mask_ns, batch.completion_mask_nt)
    kl_fn = jax.jit(lambda a, r, *xs: reference_kl(graphs.actor, a, r, *xs, forward=FULL_FORWARD))
    got = np.asarray(kl_fn(state.actor.params, ref_params, *args))
    err = np.abs(got - want).max()
    print("per-token max abs error vs NumPy float64", err, "max KL", want.max())
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

    # The step: the actor's state holds the reference (here swapped for another model).
    state = state.replace(actor=state.actor.replace(ref_params=ref_params))
    mesh = make_mesh(fsdp=1, devices=jax.devices()[:1])
    state, _ = shard_ppo_state(state, tx, tx, mesh)
    step = make_ppo_step(FULL, graphs, tx, tx, mesh=mesh, state=state, batch=batch)
    _, m = step(state, batch)
    m = _host(m)
    np.testing.assert_allclose(m["kl_ref"], want.sum(1).mean(), rtol=1e-5)
    np.testing.assert_allclose(m["kl_ref_token"], want[mask].mean(), rtol=1e-5)
    scores = np.asarray(batch.scores_n, np.float64)
    reward = (scores - FULL.kl_coef * want.sum(1)).mean()
    np.testing.assert_allclose(m["reward_mean"], reward, rtol=1e-5, atol=1e-6)

    # LoRA: the reference is the actor's base with adapters off (no copy in the state).
    from grpojax.models import LoRAConfig, adapters_off, add_lora

    lora_actor = Decoder(tiny_config(**MODEL), rngs=nnx.Rngs(0))
    add_lora(lora_actor, LoRAConfig(rank=4, alpha=8.0), rngs=nnx.Rngs(1))
    rng = np.random.default_rng(2)
    for name in lora_actor.lora.names():  # nonzero B: the adapters act
        var = getattr(lora_actor.lora, name)
        var.set_value(0.2 * rng.standard_normal(var.shape).astype(np.float32))
    with adapters_off(lora_actor):
        base_logits_model = nnx.merge(*nnx.split(lora_actor))
    want = _np_full_kl(lora_actor, base_logits_model, batch, FULL_FORWARD.temperature)
    assert (want[mask] > 0).all()
    lora_gd, lora_params = nnx.split(lora_actor, nnx.Param)
    got = jax.jit(lambda a, *xs: reference_kl(lora_gd, a, None, *xs, forward=FULL_FORWARD))(
        lora_params, *args
    )
    print("LoRA per-token max abs error", np.abs(np.asarray(got) - want).max())
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


def test_full_kl_is_nonnegative_zero_at_the_reference_and_needs_one():
    """The exact KL is >= 0 per token, and 0 where the policy is its reference: the step's
    first call on a state from create_ppo_state (reference = the initial actor) and a LoRA
    actor whose adapters start at B = 0. Without a reference, or with a k-estimator and no
    reference logprobs, the step says what is missing."""
    batch = _batch(7)._replace(ref_logp_nt=None)
    mask = np.asarray(batch.completion_mask_nt)
    actor, critic = _models(FULL, seed=1)
    tx = optax.sgd(0.0)
    graphs, state = create_ppo_state(actor, critic, tx, tx, config=FULL, rng=jax.random.key(3))
    assert state.actor.ref_params is not None
    args = (batch.tokens_ns, batch.mask_ns, batch.completion_mask_nt)
    kl_fn = jax.jit(lambda a, r, *xs: reference_kl(graphs.actor, a, r, *xs, forward=FULL_FORWARD))
    other = nnx.split(Decoder(tiny_config(**MODEL), rngs=nnx.Rngs(8)), nnx.Param)[1]
    apart = np.asarray(kl_fn(state.actor.params, other, *args))
    assert (apart >= 0).all() and (apart[mask] > 0).all() and (apart[~mask] == 0).all()
    same = np.asarray(kl_fn(state.actor.params, state.actor.ref_params, *args))
    assert np.abs(same).max() <= 1e-6, np.abs(same).max()

    mesh = make_mesh(fsdp=1, devices=jax.devices()[:1])
    state, _ = shard_ppo_state(state, tx, tx, mesh)
    step = make_ppo_step(FULL, graphs, tx, tx, mesh=mesh, state=state, batch=batch)
    _, m = step(state, batch)
    assert abs(float(m["kl_ref"])) <= 1e-6 and abs(float(m["kl_ref_token"])) <= 1e-6
    np.testing.assert_allclose(float(m["reward_mean"]), np.mean(batch.scores_n), atol=1e-6)

    from grpojax.models import LoRAConfig, add_lora

    lora_actor = Decoder(tiny_config(**MODEL), rngs=nnx.Rngs(0))
    add_lora(lora_actor, LoRAConfig(rank=4, alpha=8.0), rngs=nnx.Rngs(1))
    lora_gd, lora_params = nnx.split(lora_actor, nnx.Param)
    fresh = jax.jit(lambda a, *xs: reference_kl(lora_gd, a, None, *xs, forward=FULL_FORWARD))
    assert np.abs(np.asarray(fresh(lora_params, *args))).max() <= 1e-6

    _, bare = create_ppo_state(*_models(BASE), tx, tx, config=BASE, rng=jax.random.key(3))
    assert bare.actor.ref_params is None  # the k-estimators keep no reference copy
    update = make_ppo_update(FULL, graphs, tx, tx)
    with pytest.raises(ValueError, match="kl_estimator='full' runs the reference inside"):
        jax.eval_shape(update, bare, batch)
    with pytest.raises(ValueError, match=r"kl_estimator=.k1. needs batch\.ref_logp_nt"):
        jax.eval_shape(make_ppo_update(BASE, graphs, tx, tx), bare, batch)
    with pytest.raises(ValueError, match=r"^kl_estimator must be one of .*'full'"):
        PPOConfig(kl_estimator="exact")


SHARDED_CODE = r"""
import jax, jax.numpy as jnp, numpy as np, optax
from flax import nnx
from test_train_ppo import BASE, MODEL, _batch
from grpojax.models import Decoder, make_mesh, tiny_config
from grpojax.train.ppo import create_ppo_state, init_critic, make_ppo_step, shard_ppo_state

batch = _batch(5, n=16)
out = {}
meshes = [
    ("one", dict(devices=jax.devices()[:1])),
    ("fsdp4_tensor2", dict(fsdp=4, tensor=2)),
    ("data8", dict(data=8, fsdp=1)),
]
for name, kw in meshes:
    mesh = make_mesh(**kw)
    actor = Decoder(tiny_config(**MODEL), rngs=nnx.Rngs(0))
    critic = init_critic(actor, mode="separate", rngs=nnx.Rngs(1))
    tx = optax.sgd(0.05)
    graphs, state = create_ppo_state(actor, critic, tx, tx, config=BASE, rng=jax.random.key(3))
    state, _ = shard_ppo_state(state, tx, tx, mesh)
    if name == "fsdp4_tensor2":
        spec = state.actor.params["layers"]["wq"][...].sharding.spec
        assert "fsdp" in str(spec) and "tensor" in str(spec), spec
    step = make_ppo_step(BASE, graphs, tx, tx, mesh=mesh, state=state, batch=batch)
    state, m = step(state, batch)
    out[name] = (jax.device_get(m), jax.device_get((state.actor.params, state.critic.params)))
ref_m, ref_p = out["one"]
for name in ("fsdp4_tensor2", "data8"):
    m, p = out[name]
    for k in ("loss", "policy_loss", "value_loss", "kl_ref", "explained_variance"):
        assert abs(float(m[k]) - float(ref_m[k])) <= 1e-5, (name, k, m[k], ref_m[k])
    diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
               for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(ref_p)))
    assert diff <= 1e-5, (name, diff)
    print(name, "max param diff", diff)
"""


@pytest.mark.slow
def test_sharded_step_matches_single_device():
    """fsdp=4 x tensor=2 and data=8 give the single-device loss and parameters (<= 1e-5)
    after 2 epochs x 2 shuffled mini-batches. Plain SGD, so the parameters measure the
    gradients themselves (Adam's g / sqrt(v) blows rounding at g ~ 0 up to lr size)."""
    out = run_with_devices(SHARDED_CODE, n_devices=8)
    assert "fsdp4_tensor2 max param diff" in out and "data8 max param diff" in out


@pytest.mark.slow
def test_ppo_learns_to_emit_the_chosen_token():
    """Toy task with the real sampler: score 1 when the completion contains token 42.

    The tiny random policy emits it in ~6% of completions; PPO (separate critic, KL penalty
    against the initial policy) should push that clearly up within 30 steps."""
    from grpojax.sampling import generate
    from grpojax.train.common import policy_logprobs
    from grpojax.train.ppo import batch_from_rollout
    from grpojax.train.state import merge

    target, b, g, width = 42, 8, 4, 5
    config = PPOConfig(
        critic="separate",
        kl_coef=0.01,
        gamma=1.0,
        lam=0.95,
        vf_coef=0.5,
        num_epochs=2,
        num_minibatches=2,
    )
    actor, critic = _models(config)
    ref_graph, ref_params = nnx.split(actor)
    ref_params = jax.tree.map(jnp.copy, ref_params)
    tx = make_optimizer(OptimizerConfig(learning_rate=3e-3))
    graphs, state = create_ppo_state(actor, critic, tx, tx, config=config, rng=jax.random.key(0))
    mesh = make_mesh(fsdp=1, devices=jax.devices()[:1])
    state, _ = shard_ppo_state(state, tx, tx, mesh)

    @jax.jit
    def ref_logp(tokens_ns, mask_ns, completion_mask_nt):
        ref = nnx.merge(ref_graph, ref_params)
        return policy_logprobs(ref, tokens_ns, mask_ns, completion_mask_nt)[0]

    rng = np.random.default_rng(0)
    key = jax.random.key(1)
    step, hit_rate = None, []
    for _ in range(30):
        plen = rng.integers(2, width + 1, b)
        prompts = np.zeros((b, width), np.int32)
        for i in range(b):
            prompts[i, width - plen[i] :] = rng.integers(3, 100, plen[i])
        rollout = generate(
            merge(graphs.actor, state.actor.params),
            prompts,
            plen,
            key=key,
            max_new_tokens=6,
            group_size=g,
            eos_ids=(2,),
            pad_id=0,
        )
        key = rollout.key
        hits = (np.asarray(rollout.tokens_nt) == target) & np.asarray(rollout.mask_nt)
        scores = hits.any(1).astype(np.float32)
        tokens_ns, mask_ns, _ = rollout.sequences()
        batch = batch_from_rollout(rollout, scores, ref_logp(tokens_ns, mask_ns, rollout.mask_nt))
        if step is None:
            step = make_ppo_step(config, graphs, tx, tx, mesh=mesh, state=state, batch=batch)
        state, m = step(state, batch)
        assert float(m["skipped"]) == 0.0
        hit_rate.append(scores.mean())
    first, last = np.mean(hit_rate[:5]), np.mean(hit_rate[-5:])
    assert first < 0.2 and last > 0.6, (first, last, hit_rate)
