"""Sequence packing: the plan's layout checked by hand, and the packed GRPO step against the
unpacked one.

The packed step must give the unpacked step's loss, metrics, gradients and updated
parameters: with one mini-batch both see the same rows in each update, so the two differ
only in float32 rounding (attention over a packed row vs a padded one, gradients summed in
another order). Bound: 1e-5 relative for the loss, the metrics and the whole gradient
vector, the bound the shared-prompt step already meets against the unshared one
(test_train_grpo); and the SGD-updated parameters within 1e-5 of the update's size.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from train_helpers import FORWARD, grad_recorder, grouped_grpo_batch, small_model

from grpojax.models import LoRAConfig, add_lora
from grpojax.train import GRPOConfig, create_train_state, grpo_update
from grpojax.train.config import PPOConfig
from grpojax.train.packing import bucket, pack_plan, padded_fraction
from grpojax.train.ppo import PPOBatch, create_ppo_state, init_critic, make_ppo_update

REL = 1e-5


# ----------------------------------------------------------------------------- the plan


def _layout(prompt_lengths, completion_lengths, p, t):
    cols_p, cols_t = np.arange(p)[None, :], np.arange(t)[None, :]
    pl, cl = np.asarray(prompt_lengths), np.asarray(completion_lengths)
    cmask = cols_t < cl[:, None]
    return np.concatenate([cols_p >= (p - pl)[:, None], cmask], 1), cmask


def test_plan_places_whole_sequences_first_fit_decreasing():
    """Rows of 2+5, 3+1, 1+2 and 2+0 tokens in bins of 8: 7, then 4 + 3 (first fit,
    longest first); the row without a completion packs nothing but takes a slot (the first
    bin's). Positions restart per sequence; the scored position of completion token t >= 1
    is the packed token before it, of token 0 the slot's extra column W + j (its prompt's
    last token)."""
    mask, cmask = _layout([2, 3, 1, 2], [5, 1, 2, 0], p=3, t=5)
    plan = pack_plan(mask, cmask, width=8)
    r, j = plan.rows_rj.shape
    assert (r, j) == (2, 2)
    np.testing.assert_array_equal(plan.rows_rj, [[0, 3], [1, 2]])
    np.testing.assert_array_equal(plan.segment_rw[1], [1, 1, 1, 1, 2, 2, 2, 0])
    np.testing.assert_array_equal(plan.position_rw[0], [0, 1, 2, 3, 4, 5, 6, 0])
    np.testing.assert_array_equal(plan.position_rw[1], [0, 1, 2, 3, 0, 1, 2, 0])
    s = 8  # columns of a batch row: P + T
    # Row 2 in slot 1 of bin 1: its prompt token is column 2, its completion columns 3, 4.
    np.testing.assert_array_equal(plan.src_rw[1, 4:7], [s + 2, s + 3, s + 4])
    np.testing.assert_array_equal(plan.first_rj[1], [2, 4])
    out = 8 + 2  # W + J: not a real token
    np.testing.assert_array_equal(plan.score_rjt[0, 0], [8, 2, 3, 4, 5])
    np.testing.assert_array_equal(plan.score_rjt[1, 1], [9, 5, out, out, out])
    assert (plan.score_rjt[0, 1] == out).all() and plan.parent_rw is None
    assert padded_fraction(plan) == pytest.approx(1 - 14 / 16)


def test_plan_shares_a_groups_prompt_and_buckets_its_shapes():
    """Groups of 2 rows sharing a 2-token prompt: the prompt once, then each completion a
    segment whose parent is the prompt's, positions continuing from the prompt."""
    mask, cmask = _layout([2, 2, 1, 1], [3, 1, 2, 2], p=2, t=3)
    plan = pack_plan(mask, cmask, width=7, group_size=2, rows_multiple=2)
    np.testing.assert_array_equal(plan.rows_rj, [[0, 1], [2, 3]])
    np.testing.assert_array_equal(plan.segment_rw[0], [1, 1, 2, 2, 2, 3, 0])
    np.testing.assert_array_equal(plan.parent_rw[0], [0, 0, 1, 1, 1, 1, 0])
    np.testing.assert_array_equal(plan.position_rw[0], [0, 1, 2, 3, 4, 2, 0])
    np.testing.assert_array_equal(plan.first_rj[0], [1, 1])  # both read the prompt's end
    np.testing.assert_array_equal(plan.score_rjt[0, 1], [8, 9, 9])  # W + J = 9: out
    assert [bucket(x) for x in (7, 16, 17, 19, 33, 100)] == [7, 16, 18, 20, 36, 104]
    assert bucket(5, 4) == 8 and bucket(1, 3) == 3


def test_plan_errors_name_what_is_wrong():
    mask, cmask = _layout([2, 3], [5, 1], p=3, t=5)
    with pytest.raises(
        ValueError, match=r"width must be >= the longest sequence \(7 tokens\), got 6"
    ):
        pack_plan(mask, cmask, width=6)
    right_padded_prompt = mask.copy()
    right_padded_prompt[0, :3] = [True, True, False]
    with pytest.raises(ValueError, match="left-padded prompts"):
        pack_plan(right_padded_prompt, cmask, width=8)
    with pytest.raises(ValueError, match="share a prompt"):
        pack_plan(mask, cmask, width=16, group_size=2)


# ----------------------------------------------------------------------------- the step


def _ragged_groups(seed, g=4):
    """grouped_grpo_batch with long-tail completions (some empty, one at the limit)."""
    batch = grouped_grpo_batch(seed, g=g, t=10)
    rng = np.random.default_rng(seed + 100)
    n, t = batch.completion_mask_nt.shape
    lengths = np.minimum(rng.geometric(0.3, n), t)
    lengths[0], lengths[5] = t, 0
    cmask = jnp.asarray(np.arange(t)[None, :] < lengths[:, None])
    p = batch.tokens_ns.shape[1] - t
    return batch.replace(
        completion_mask_nt=cmask, mask_ns=batch.mask_ns.at[:, p:].set(cmask)
    ).replace(rewards_n=jnp.asarray(rng.normal(size=n), jnp.float32), advantages=None)


def _flat(tree):
    return np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)]).astype(np.float64)


def _compare(config, batch, plan, *, lora=False, tx=None):
    model = small_model(31)
    if lora:
        add_lora(model, LoRAConfig(rank=4, alpha=8.0), rngs=nnx.Rngs(2))
    tx = tx or grad_recorder()
    graphdef, state0 = create_train_state(
        model, tx, rng=jax.random.key(4), with_ref=config.uses_reference and not lora
    )
    if state0.ref_params is not None:
        state0 = state0.replace(ref_params=jax.tree.map(lambda x: x * 1.01, state0.ref_params))
    step = jax.jit(functools.partial(grpo_update, graphdef=graphdef, tx=tx, config=config))
    packed = batch.replace(packing=jax.tree.map(jnp.asarray, plan))
    return state0, step(state0, batch), step(state0, packed)


CASES = {
    # aggregation, layout (1: whole sequences, G: the group's prompt once), epochs, micro
    "token-mean": ("token-mean", 1, 1, 2),
    "seq-mean-token-mean": ("seq-mean-token-mean", 4, 2, 2),
    "seq-mean-token-sum": ("seq-mean-token-sum", 1, 2, 1),
    "seq-mean-token-sum-norm": ("seq-mean-token-sum-norm", 4, 1, 2),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_packed_grpo_step_equals_unpacked(name):
    """Advantages from rewards inside the step (group statistics before packing), beta > 0
    (reference logprobs precomputed), entropy bonus, K micro-batches, mu epochs (old
    logprobs precomputed when mu = 2), shuffled bins; one mini-batch."""
    mode, layout, epochs, micro = CASES[name]
    g = 4
    batch = _ragged_groups(40 + len(name), g=g)
    config = GRPOConfig(
        group_size=g,
        aggregation=mode,
        norm_constant=10.0 if mode.endswith("norm") else None,
        beta=0.05,
        entropy_coef=0.01,
        num_epochs=epochs,
        num_microbatches=micro,
        share_prompt=layout > 1,
        forward=FORWARD,
    )
    p_plus_t = batch.tokens_ns.shape[1]
    width = p_plus_t if layout == 1 else 5 + g * 10
    plan = functools.partial(
        pack_plan, batch.mask_ns, batch.completion_mask_nt, width=width, group_size=layout
    )
    # More bins than the rows need, so some are empty: R rounded up to a multiple of K
    # past the plan's own.
    plan = plan(rows_multiple=micro * (plan().rows_rj.shape[0] // micro + 1))
    assert plan.rows_rj.size > batch.tokens_ns.shape[0]
    _, (s0, m0), (s1, m1) = _compare(config, batch, plan)
    assert set(m0) == set(m1)
    for key in sorted(m0):
        a, b = float(m0[key]), float(m1[key])
        assert b == pytest.approx(a, rel=REL, abs=1e-9), key
    g0, g1 = _flat(s0.opt_state), _flat(s1.opt_state)
    assert np.linalg.norm(g0) > 0
    assert np.linalg.norm(g1 - g0) <= REL * np.linalg.norm(g0)


def test_packed_lora_step_updates_the_adapters_as_unpacked():
    """LoRA adapters (the reference: the base with adapters off), SGD: the adapters after
    the packed step equal those after the unpacked step within 1e-5 of the update."""
    g = 4
    batch = _ragged_groups(50, g=g)
    config = GRPOConfig(group_size=g, beta=0.05, num_microbatches=2, forward=FORWARD)
    plan = pack_plan(
        batch.mask_ns, batch.completion_mask_nt, width=batch.tokens_ns.shape[1], rows_multiple=2
    )
    state0, (s0, m0), (s1, m1) = _compare(config, batch, plan, lora=True, tx=optax.sgd(0.5))
    assert float(m1["loss"]) == pytest.approx(float(m0["loss"]), rel=REL)
    before, after0, after1 = (_flat(s.params) for s in (state0, s0, s1))
    step = np.linalg.norm(after0 - before)
    assert step > 0
    assert np.linalg.norm(after1 - after0) <= REL * step


def test_packing_needs_bins_that_divide_into_micro_batches():
    batch = _ragged_groups(60)
    plan = pack_plan(batch.mask_ns, batch.completion_mask_nt, width=15, rows_multiple=1)
    config = GRPOConfig(group_size=4, num_microbatches=plan.rows_rj.shape[0] + 1, forward=FORWARD)
    model = small_model(1)
    tx = grad_recorder()
    graphdef, state = create_train_state(model, tx, rng=jax.random.key(0))
    with pytest.raises(
        ValueError, match="bins must divide into num_minibatches x num_microbatches"
    ):
        grpo_update(
            state,
            batch.replace(packing=jax.tree.map(jnp.asarray, plan)),
            graphdef=graphdef,
            tx=tx,
            config=dataclasses.replace(config),
        )


# ----------------------------------------------------------------------------- PPO


PPO_CASES = {
    # critic, KL estimator, layout (1: whole sequences, G: the group's prompt once)
    "shared_critic_k1_whole_sequences": ("shared", "k1", 1),
    "separate_critic_full_kl_shared_prompt": ("separate", "full", 4),
}


@pytest.mark.parametrize("name", sorted(PPO_CASES))
def test_packed_ppo_step_equals_unpacked(name):
    """PPO with packing == without: 2 epochs, K = 2 micro-batches, one mini-batch; the
    critic's values, GAE, the KL reward term (k1 from the batch's reference logprobs, or the
    exact KL with the reference run in the step) and the per-row metrics over the batch's
    rows, not the empty slots. Metrics 1e-5 relative (1e-6 absolute) and the SGD updates of
    actor and critic 1e-5 relative to their size."""
    critic_mode, estimator, layout = PPO_CASES[name]
    g = 4
    grouped = _ragged_groups(70, g=g)
    n, t = grouped.completion_mask_nt.shape
    rng = np.random.default_rng(71)
    batch = PPOBatch(
        tokens_ns=grouped.tokens_ns,
        mask_ns=grouped.mask_ns,
        completion_mask_nt=grouped.completion_mask_nt,
        scores_n=jnp.asarray(rng.normal(size=n), jnp.float32),
        ref_logp_nt=None if estimator == "full" else jnp.asarray(-rng.uniform(2, 7, (n, t))),
    )
    config = PPOConfig(
        critic=critic_mode,
        kl_estimator=estimator,
        kl_coef=0.3,
        gamma=0.9,
        lam=0.8,
        num_epochs=2,
        num_microbatches=2,
        entropy_coef=0.01,
        group_size=g,
        share_prompt=layout > 1,
        forward=FORWARD,
    )
    width = grouped.tokens_ns.shape[1] if layout == 1 else 5 + g * 10
    plan = pack_plan(
        batch.mask_ns, batch.completion_mask_nt, width=width, group_size=layout, rows_multiple=2
    )
    actor = small_model(72)
    critic = init_critic(actor, mode=critic_mode, rngs=nnx.Rngs(73))
    tx = optax.sgd(0.1)
    graphs, state0 = create_ppo_state(actor, critic, tx, tx, config=config, rng=jax.random.key(3))
    if estimator == "full":  # a reference that differs from the actor: a KL that is not 0
        ref = nnx.split(small_model(74), nnx.Param)[1]
        state0 = state0.replace(actor=state0.actor.replace(ref_params=ref))
    step = jax.jit(make_ppo_update(config, graphs, tx, tx))
    out = {}
    for packed in (False, True):
        b = batch._replace(packing=jax.tree.map(jnp.asarray, plan)) if packed else batch
        new, metrics = step(state0, b)
        delta = [
            _flat(getattr(new, part).params) - _flat(getattr(state0, part).params)
            for part in ("actor", "critic")
        ]
        out[packed] = (jax.device_get(metrics), delta)
    (m0, d0), (m1, d1) = out[False], out[True]
    assert set(m0) == set(m1) and abs(m0["kl_ref"]) > 0.01
    for key in sorted(m0):
        assert float(m1[key]) == pytest.approx(float(m0[key]), rel=REL, abs=1e-6), key
    for a, b in zip(d0, d1):
        assert np.linalg.norm(a) > 0
        assert np.linalg.norm(b - a) <= REL * np.linalg.norm(a)
