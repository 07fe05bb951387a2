"""The GRPO loss without the update (`grpo_loss`, `grpo_loss_from_logprobs`) against what
`grpo_update` computes and hands to the optimizer, and `grpo_batch_from_ids` against a batch
built by hand."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from train_helpers import FORWARD, full_logits_logp, grad_recorder, grouped_grpo_batch, small_model

from grpojax.train import (
    GRPOConfig,
    compute_advantages,
    create_train_state,
    grpo_batch_from_ids,
    grpo_loss,
    grpo_loss_from_logprobs,
    grpo_preset,
    grpo_update,
)

jax.config.update("jax_default_matmul_precision", "highest")

G = 4


def _flat(tree) -> np.ndarray:
    return np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)]).astype(np.float64)


def _batch(seed: int, *, with_old: bool):
    """Groups of G sharing a prompt, rewards instead of advantages, two truncated rows."""
    batch = grouped_grpo_batch(seed, g=G)
    n, t = batch.completion_mask_nt.shape
    rng = np.random.default_rng(seed)
    eos = np.ones(n, bool)
    eos[[2, 9]] = False
    batch = batch.replace(
        advantages=None,
        rewards_n=jnp.asarray(rng.integers(0, 3, n), jnp.float32),
        lengths_n=jnp.sum(batch.completion_mask_nt, axis=1, dtype=jnp.int32),
        eos_found_n=jnp.asarray(eos),
    )
    if with_old:
        old = rng.normal(-4.6, 0.3, (n, t))
        batch = batch.replace(old_logp_nt=jnp.asarray(old, jnp.float32))
    return batch


CASES = {
    # Advantages from rewards inside the step, KL to a reference state, entropy with the loss.
    "grpo_ref_entropy": (
        GRPOConfig(group_size=G, beta=0.05, entropy_coef=0.01, shuffle=False, forward=FORWARD),
        False,
    ),
    # Given old logprobs (clipping active), overlong filter, TRL's token-mean entropy, and
    # two micro-batches in the step (grpo_loss takes the batch whole: the same gradient).
    "dapo_old_filter_k2": (
        grpo_preset(
            "dapo",
            overlong_max_len=None,
            num_microbatches=2,
            group_size=G,
            overlong_filter=True,
            entropy_coef=0.01,
            entropy_aggregation="token-mean",
            shuffle=False,
            forward=FORWARD,
        ),
        True,
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_grpo_loss_equals_the_steps_first_update(name):
    """`grpo_loss(..., with_grads=True)` == the loss, metrics and gradient `grpo_update`
    computes and hands to the optimizer on the same batch (one update), and its aux holds
    the logprobs and advantages the loss used."""
    config, with_old = CASES[name]
    model = small_model(11)
    batch = _batch(12, with_old=with_old)
    tx = grad_recorder()
    graphdef, state = create_train_state(model, tx, rng=jax.random.key(0), with_ref=True)
    # The reference away from the policy, so the KL term has a gradient.
    state = state.replace(ref_params=jax.tree.map(lambda p: p * 1.01, state.ref_params))
    step = jax.jit(functools.partial(grpo_update, graphdef=graphdef, tx=tx, config=config))
    new_state, metrics = step(state, batch)

    loss_fn = jax.jit(
        lambda params, ref, b: grpo_loss(
            (graphdef, params), b, config, ref_params=ref, with_grads=True
        )
    )
    loss, aux = loss_fn(state.params, state.ref_params, batch)
    # Same functions, both float32 and jitted; they differ at most in fusion and summation
    # order: 1e-6 relative for scalars and for the whole gradient vector.
    np.testing.assert_allclose(float(loss), float(metrics["first_loss"]), rtol=1e-6)
    ours = aux["metrics"]
    np.testing.assert_allclose(float(ours["grad_norm"]), float(metrics["grad_norm"]), rtol=1e-6)
    for key in ("pg_loss", "kl_loss", "entropy", "kept_seq_frac"):
        if key in metrics:
            np.testing.assert_allclose(float(ours[key]), float(metrics[key]), rtol=1e-6, atol=1e-9)
    g_step, g_ours = _flat(new_state.opt_state), _flat(aux["grads"])
    assert np.linalg.norm(g_step) > 0
    assert np.linalg.norm(g_ours - g_step) <= 1e-6 * np.linalg.norm(g_step)

    # The aux arrays: logprobs against full logits (2e-6, this suite's logprob tolerance),
    # the advantages the step computes from the rewards, the filtered mask.
    mask = np.asarray(aux["completion_mask_nt"])
    logp_ref, _ = full_logits_logp(model, batch)
    np.testing.assert_allclose(
        np.where(mask, aux["logp_nt"], 0), np.where(mask, logp_ref, 0), atol=2e-6
    )
    adv = compute_advantages(batch.rewards_n, config, mask_nt=batch.completion_mask_nt)
    np.testing.assert_array_equal(np.asarray(aux["advantages"]), np.asarray(adv))
    cmask = np.asarray(batch.completion_mask_nt)
    if config.overlong_filter:
        cmask = cmask & np.asarray(batch.eos_found_n)[:, None]
    np.testing.assert_array_equal(mask, cmask)

    # The array-level loss on those arrays is the same loss (same code after the forward).
    again, _ = grpo_loss_from_logprobs(
        aux["logp_nt"],
        aux["old_logp_nt"],
        aux["advantages"],
        aux["completion_mask_nt"],
        config=config,
        ref_logp_nt=aux["ref_logp_nt"],
        entropy_nt=aux["entropy_nt"],
    )
    np.testing.assert_allclose(float(again), float(loss), rtol=1e-6)


def test_grpo_loss_without_grads_and_its_errors():
    model = small_model(13)
    batch = _batch(14, with_old=False)
    config = GRPOConfig(group_size=G, beta=0.0, forward=FORWARD)
    loss, aux = grpo_loss(model, batch, config)
    assert "grads" not in aux and np.isfinite(float(loss))
    # The first update's ratios are exactly 1: old = stop_gradient(logp).
    np.testing.assert_array_equal(np.asarray(aux["old_logp_nt"]), np.asarray(aux["logp_nt"]))
    with pytest.raises(ValueError, match=r"^beta > 0 needs the reference: pass ref_params"):
        grpo_loss(model, batch, dataclasses.replace(config, beta=0.1))
    with pytest.raises(ValueError, match=r"^model must be an nnx.Module or a \(graphdef, params"):
        grpo_loss("model", batch, config)


# ----------------------------------------------------------------------------------------
# grpo_batch_from_ids
# ----------------------------------------------------------------------------------------


def _lists(batch, p):
    """Per-sample prompt and completion id lists read back from a hand-built batch."""
    tokens, mask = np.asarray(batch.tokens_ns), np.asarray(batch.mask_ns)
    cmask = np.asarray(batch.completion_mask_nt)
    prompts = [tokens[i, :p][mask[i, :p]].tolist() for i in range(tokens.shape[0])]
    completions = [tokens[i, p:][cmask[i]].tolist() for i in range(tokens.shape[0])]
    return prompts, completions


def test_batch_from_ids_equals_the_hand_built_batch():
    """From per-sample (or per-prompt) lists: the masks, the real tokens, lengths, rewards
    and padded old logprobs of the fixture's batch, and the same loss."""
    p, t = 5, 6
    hand = grouped_grpo_batch(32, g=G, p=p, t=t)
    n = hand.tokens_ns.shape[0]
    rewards = np.random.default_rng(33).integers(0, 3, n).astype(np.float32)
    prompts, completions = _lists(hand, p)
    cmask = np.asarray(hand.completion_mask_nt)
    old = np.random.default_rng(34).normal(-3.0, 0.5, cmask.shape).astype(np.float32)
    old_lists = [old[i, cmask[i]].tolist() for i in range(n)]
    built = grpo_batch_from_ids(
        prompts,
        completions,
        rewards.tolist(),
        group_size=G,
        prompt_width=p,
        completion_width=t,
        old_logp=old_lists,
    )
    mask = np.asarray(hand.mask_ns)
    np.testing.assert_array_equal(np.asarray(built.mask_ns), mask)
    np.testing.assert_array_equal(np.asarray(built.completion_mask_nt), cmask)
    np.testing.assert_array_equal(
        np.where(mask, built.tokens_ns, 0), np.where(mask, hand.tokens_ns, 0)
    )
    np.testing.assert_array_equal(np.asarray(built.lengths_n), cmask.sum(1))
    np.testing.assert_array_equal(np.asarray(built.rewards_n), rewards)
    np.testing.assert_array_equal(np.asarray(built.old_logp_nt), np.where(cmask, old, 0.0))
    assert built.advantages is None and built.ref_logp_nt is None

    # One prompt per group instead of one per sample: the same batch.
    per_prompt = grpo_batch_from_ids(
        prompts[::G],
        completions,
        rewards.tolist(),
        group_size=G,
        prompt_width=p,
        completion_width=t,
        old_logp=old_lists,
    )
    for a, b in zip(jax.tree.leaves(per_prompt), jax.tree.leaves(built), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    # Padding content is never read: the same loss as the hand-built batch.
    config = GRPOConfig(group_size=G, beta=0.0, forward=FORWARD)
    model = small_model(35)
    by_hand = hand.replace(
        advantages=None,
        rewards_n=jnp.asarray(rewards),
        old_logp_nt=jnp.asarray(old),
    )
    loss_built, _ = grpo_loss(model, built, config)
    loss_hand, _ = grpo_loss(model, by_hand, config)
    assert float(loss_built) == float(loss_hand)

    # Default widths: the driver's prompt-width rule (multiples of 8) and the longest
    # completion.
    default = grpo_batch_from_ids(prompts, completions, rewards.tolist(), group_size=G)
    assert default.tokens_ns.shape == (n, 8 + int(cmask.sum(1).max()))


def test_batch_from_rollout_is_the_driver_path_and_the_lists_batch():
    """`grpo_batch_from_rollout` (rollout_groups -> assemble_batch -> grpo_batch_from_rows)
    against `grpo_batch_from_ids` on the same samples read back as Python lists: the same
    masks, real tokens, lengths and rewards, and the same loss; advantages given instead of
    rewards give the loss of the advantages the step computes; an invalid sample trains on
    nothing."""
    from grpojax.sampling import SamplingConfig, generate
    from grpojax.train import compute_advantages, grpo_batch_from_rollout

    model = small_model(37)
    b, t = 2, 5
    prompts = jnp.asarray(np.random.default_rng(38).integers(3, 90, (b, 7)), jnp.int32)
    plen = jnp.asarray([7, 4], jnp.int32)  # left-padded: row 1's prompt is its last 4 ids
    rollout = generate(
        model,
        prompts,
        plen,
        key=jax.random.key(39),
        max_new_tokens=t,
        group_size=G,
        sampling=SamplingConfig(temperature=1.0),
        eos_ids=(model.config.eos_token_id,),
    )
    n = b * G
    rewards = np.random.default_rng(40).normal(size=n).astype(np.float32)
    config = GRPOConfig(group_size=G, beta=0.0, forward=FORWARD)
    built = grpo_batch_from_rollout(rollout, rewards=rewards, config=config)

    tokens, lengths = np.asarray(rollout.tokens_nt), np.asarray(rollout.lengths_n)
    prompt_lists = [np.asarray(prompts)[i, 7 - int(plen[i]) :].tolist() for i in range(b)]
    completions = [tokens[i, : lengths[i]].tolist() for i in range(n)]
    ids = grpo_batch_from_ids(
        prompt_lists, completions, rewards.tolist(), group_size=G, completion_width=t
    )
    mask = np.asarray(ids.mask_ns)
    np.testing.assert_array_equal(np.asarray(built.mask_ns), mask)
    np.testing.assert_array_equal(
        np.where(mask, built.tokens_ns, 0), np.where(mask, ids.tokens_ns, 0)
    )
    np.testing.assert_array_equal(np.asarray(built.completion_mask_nt), ids.completion_mask_nt)
    np.testing.assert_array_equal(np.asarray(built.lengths_n), lengths)
    np.testing.assert_array_equal(np.asarray(built.rewards_n), rewards)
    loss_ids, _ = grpo_loss(model, ids, config)
    loss_built, _ = grpo_loss(model, built, config)
    assert float(loss_built) == float(loss_ids)

    adv = compute_advantages(jnp.asarray(rewards), config)
    given = grpo_batch_from_rollout(rollout, advantages=adv, config=config)
    assert given.rewards_n is None
    np.testing.assert_array_equal(np.asarray(given.advantages), np.asarray(adv))
    loss_given, _ = grpo_loss(model, given, config)
    assert float(loss_given) == float(loss_built)

    valid = np.ones(n, bool)
    valid[3] = False
    masked = grpo_batch_from_rollout(rollout, rewards=rewards, valid=valid, config=config)
    cmask = np.asarray(masked.completion_mask_nt)
    assert not cmask[3].any() and (cmask[:3] == np.asarray(built.completion_mask_nt)[:3]).all()
    np.testing.assert_array_equal(np.asarray(masked.valid_n), valid)

    for kw in ({}, {"rewards": rewards, "advantages": adv}):
        with pytest.raises(ValueError, match="exactly one of rewards= or advantages="):
            grpo_batch_from_rollout(rollout, config=config, **kw)


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(completion_ids=lambda c: c[:7]), r"^completion_ids: N=7 samples must be"),
        (dict(prompt_ids=lambda p: [*p[:4], [9], *p[5:]]), r"^prompt_ids: rows 4\.\.7 form one"),
        (dict(prompt_ids=lambda p: p[:3]), r"^prompt_ids: expected N=16 .* or B=4 "),
        (dict(rewards=lambda r: r[:15]), r"^rewards: expected N=16 numbers"),
        (dict(old_logp=lambda o: [o[0] + [0.0], *o[1:]]), r"^old_logp: row 0 has"),
        (dict(prompt_width=2), r"^a prompt has \d+ tokens, more than prompt_width=2"),
    ],
    ids=["ragged_group", "group_prompts_differ", "prompt_count", "rewards", "old_logp", "width"],
)
def test_batch_from_ids_errors_name_the_argument(change, match):
    hand = grouped_grpo_batch(36, g=G, p=5, t=6)
    prompts, completions = _lists(hand, 5)
    cmask = np.asarray(hand.completion_mask_nt)
    kw = dict(
        prompt_ids=prompts,
        completion_ids=completions,
        rewards=[1.0] * len(prompts),
        old_logp=[[-1.0] * int(k) for k in cmask.sum(1)],
        prompt_width=5,
    )
    for key, value in change.items():
        kw[key] = value(kw[key]) if callable(value) else value
    with pytest.raises(ValueError, match=match) as err:
        grpo_batch_from_ids(**kw, group_size=G)
    assert "\n" not in str(err.value)
