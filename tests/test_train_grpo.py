"""GRPO step: loss against a NumPy reference, exact accumulation, first ratio 1, skipping,
reference handling, and learning on a toy task with the real sampler."""

from __future__ import annotations

import dataclasses
import functools
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from train_helpers import (
    FORWARD,
    full_logits_logp,
    grad_recorder,
    grouped_grpo_batch,
    random_grpo_batch,
    small_model,
)

import grpojax.train.grpo.loss as grpo_loss_mod
from grpojax.ops.aggregation import AGGREGATION_MODES
from grpojax.train import (
    GRPOConfig,
    OptimizerConfig,
    create_train_state,
    grpo_loss,
    grpo_preset,
    grpo_update,
    make_optimizer,
)
from grpojax.train.common import policy_logprobs, unit_permutation
from grpojax.train.grpo.update import _blocks, _unblocks
from grpojax.train.state import split_params as nnx_split

jax.config.update("jax_default_matmul_precision", "highest")


def _update_fn(graphdef, tx, config):
    return jax.jit(
        functools.partial(grpo_update, graphdef=graphdef, tx=tx, config=config),
    )


# ----------------------------------------------------------------------------------------
# NumPy reference of the GRPO-family loss (written from the equations, float64)
# ----------------------------------------------------------------------------------------


def np_aggregate(loss, mask, mode, norm):
    mask = mask.astype(np.float64)
    seq_sum = (loss * mask).sum(1)
    seq_len = mask.sum(1)
    k = (seq_len > 0).sum()
    if mode == "token-mean":
        return seq_sum.sum() / seq_len.sum()
    if mode == "seq-mean-token-mean":
        return (seq_sum[seq_len > 0] / seq_len[seq_len > 0]).sum() / k
    if mode == "seq-mean-token-sum":
        return seq_sum.sum() / k
    return seq_sum.sum() / (k * norm)


def np_grpo_loss(logp, logsm, old, ref, sampler, adv, mask, c: GRPOConfig, keep=None):
    mask_b = mask.astype(bool)
    adv = adv[:, None] * np.ones_like(logp) if adv.ndim == 1 else adv
    d = np.where(mask_b, logp - old, 0.0)
    if c.ratio_level == "token":
        r = np.exp(d)
    else:
        s = d.sum(1) / np.maximum(mask.sum(1), 1)
        r = np.exp(s)[:, None] * np.ones_like(logp)
    lo, hi = 1 - c.clip_low, 1 + c.clip_high
    obj = np.minimum(r * adv, np.clip(r, lo, hi) * adv)
    if c.dual_clip is not None:
        obj = np.where(adv < 0, np.maximum(obj, c.dual_clip * adv), obj)
    pg = -obj
    if c.rollout_correction_mode is not None:
        # The token/truncate case (TIS), the one the family below uses.
        assert (c.rollout_correction_mode, c.rollout_correction_level) == ("truncate", "token")
        pg = pg * np.minimum(np.exp(old - sampler), c.rollout_correction_high)
    if keep is not None:  # off-policy sequence masking: dropped rows' policy term is 0
        pg = pg * keep[:, None]
    total = pg
    if c.beta > 0:
        x = ref - logp
        k3 = np.exp(x) - x - 1
        # DeepSeek-V3.2's IS-corrected k3: weighted by pi_theta / pi_old.
        total = total + c.beta * (np.exp(logp - old) * k3 if c.kl_is_corrected else k3)
    if c.entropy_coef:
        ent = -(np.exp(logsm) * logsm).sum(-1)
        total = total - c.entropy_coef * ent
    return np_aggregate(np.where(mask_b, total, 0.0), mask, c.aggregation, c.norm_constant)


FAMILY = {
    "grpo": grpo_preset("grpo", forward=FORWARD),
    "dr_grpo": grpo_preset("dr_grpo", norm_constant=6.0, forward=FORWARD, beta=0.1),
    "dapo_tis_entropy": grpo_preset(
        "dapo",
        overlong_max_len=None,  # advantages come with the batch: no reward to punish
        forward=FORWARD,
        rollout_correction_mode="truncate",
        rollout_correction_high=1.5,
        entropy_coef=0.01,
        dual_clip=3.0,
    ),
    "gspo": grpo_preset("gspo", forward=FORWARD, clip_low=0.05, clip_high=0.08),
}


@pytest.mark.parametrize("name", sorted(FAMILY))
def test_first_loss_matches_numpy_reference(name):
    """The step's loss at its input parameters == the NumPy loss on full-logit logprobs."""
    config = dataclasses.replace(FAMILY[name], shuffle=False)
    model = small_model(0)
    batch = random_grpo_batch(1, extras=True)
    logp, logsm = full_logits_logp(model, batch)
    rng = np.random.default_rng(2)
    # Old / reference policies away from the current one, so clipping and KL are active.
    old = logp + rng.normal(0, 0.3, logp.shape)
    ref = logp + rng.normal(0, 0.3, logp.shape)
    batch = batch.replace(
        old_logp_nt=jnp.asarray(old, jnp.float32), ref_logp_nt=jnp.asarray(ref, jnp.float32)
    )
    tx = optax.sgd(0.0)
    graphdef, state = create_train_state(model, tx, rng=jax.random.key(0))
    _, metrics = _update_fn(graphdef, tx, config)(state, batch)
    expected = np_grpo_loss(
        logp,
        logsm,
        old,
        ref,
        np.asarray(batch.sampler_logp_nt, np.float64),
        np.asarray(batch.advantages, np.float64),
        np.asarray(batch.completion_mask_nt),
        config,
    )
    # float32 forward vs float64 reference on the same logits: 1e-5 relative.
    np.testing.assert_allclose(float(metrics["first_loss"]), expected, rtol=1e-5, atol=1e-6)
    assert float(metrics["skipped"]) == 0.0


# ----------------------------------------------------------------------------------------
# DeepSeek-V3.2's IS-corrected KL and off-policy sequence masking, inside the step
# ----------------------------------------------------------------------------------------


def test_is_corrected_kl_in_the_step_matches_numpy_and_reweights_k3():
    """kl_is_corrected=True: the step's first loss == the NumPy loss with the KL term
    beta * (pi_theta / pi_old) * k3; with pi_theta / pi_old = e^0.25 on every token, the
    logged KL (`kl_ref`, a token mean) is e^0.25 times the plain k3's."""
    model = small_model(0)
    batch = random_grpo_batch(1)
    logp, logsm = full_logits_logp(model, batch)
    ref = logp + np.random.default_rng(3).normal(0, 0.3, logp.shape)
    old = logp - 0.25
    batch = batch.replace(
        old_logp_nt=jnp.asarray(old, jnp.float32), ref_logp_nt=jnp.asarray(ref, jnp.float32)
    )
    tx = optax.sgd(0.0)
    graphdef, state = create_train_state(model, tx, rng=jax.random.key(0))
    on = GRPOConfig(beta=0.1, kl_is_corrected=True, shuffle=False, forward=FORWARD)
    off = dataclasses.replace(on, kl_is_corrected=False)
    _, m_on = _update_fn(graphdef, tx, on)(state, batch)
    _, m_off = _update_fn(graphdef, tx, off)(state, batch)
    adv, mask = np.asarray(batch.advantages, np.float64), np.asarray(batch.completion_mask_nt)
    for cfg, m in ((on, m_on), (off, m_off)):
        expected = np_grpo_loss(logp, logsm, old, ref, None, adv, mask, cfg)
        # float32 forward vs float64 reference on the same logits: 1e-5 relative.
        np.testing.assert_allclose(float(m["first_loss"]), expected, rtol=1e-5, atol=1e-6)
    # The same float32 logprobs in both programs, one factor apart: 1e-5 relative.
    np.testing.assert_allclose(
        float(m_on["kl_ref"]), np.exp(0.25) * float(m_off["kl_ref"]), rtol=1e-5
    )
    assert float(m_on["kl_ref"]) > float(m_off["kl_ref"]) > 0


def test_off_policy_masking_in_the_step_drops_the_gradient_of_masked_sequences():
    """off_policy_delta: a sequence with A < 0 whose mean sampler-minus-trainer log-ratio
    exceeds delta leaves the policy term. Its rows give no gradient: the step's gradient
    equals the unmasked step's on the batch with those rows' advantages set to 0 (which
    keeps them in the aggregation's denominators, as the mask does). The first loss ==
    NumPy; the dropped rows (pg = -A > 0 at ratio 1) lower it; `kept_seq_frac` counts the
    kept rows."""
    model = small_model(4)
    batch = random_grpo_batch(5, n=8)
    logp, logsm = full_logits_logp(model, batch)
    adv = np.array([-1.0, 0.8, -0.5, 1.2, -0.7, 0.3, -1.1, 0.9])
    # The sampler's logprobs: rows 0-3 one nat above the trainer's (far off policy), 4-7 equal.
    far = np.arange(8) < 4
    sampler = logp + np.where(far, 1.0, 0.0)[:, None]
    dropped = far & (adv < 0)  # rows 0 and 2; rows 4 and 6 (A < 0, on policy) stay
    batch = batch.replace(
        advantages=jnp.asarray(adv, jnp.float32), sampler_logp_nt=jnp.asarray(sampler, jnp.float32)
    )
    on = GRPOConfig(beta=0.0, off_policy_delta=0.5, shuffle=False, forward=FORWARD)
    off = dataclasses.replace(on, off_policy_delta=None)
    tx = grad_recorder()
    graphdef, state = create_train_state(model, tx, rng=jax.random.key(0))
    s_on, m_on = _update_fn(graphdef, tx, on)(state, batch)
    zeroed = batch.replace(advantages=jnp.asarray(np.where(dropped, 0.0, adv), jnp.float32))
    s_zero, m_zero = _update_fn(graphdef, tx, off)(state, zeroed)
    s_off, m_off = _update_fn(graphdef, tx, off)(state, batch)
    assert float(m_on["kept_seq_frac"]) == 6 / 8 and float(m_off["kept_seq_frac"]) == 1.0
    mask = np.asarray(batch.completion_mask_nt)
    # One update, no old logprobs: pi_old is the step's own forward (ratio exactly 1).
    expected = np_grpo_loss(logp, logsm, logp, None, None, adv, mask, on, keep=~dropped)
    np.testing.assert_allclose(float(m_on["first_loss"]), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(m_on["first_loss"]), float(m_zero["first_loss"]), rtol=1e-6)
    assert float(m_on["first_loss"]) < float(m_off["first_loss"])
    # The gradients: same rows, same arithmetic but for the factor 0 / the zero advantage;
    # float32 summation order only, <= 1e-6 relative (as the micro-batch test).
    g_on, g_zero, g_off = (
        np.concatenate([np.ravel(x) for x in jax.tree.leaves(s.opt_state)]).astype(np.float64)
        for s in (s_on, s_zero, s_off)
    )
    assert np.linalg.norm(g_on - g_zero) <= 1e-6 * np.linalg.norm(g_zero)
    assert np.linalg.norm(g_off - g_on) > 1e-2 * np.linalg.norm(g_on)  # the rows mattered


def test_policy_logprobs_match_full_logits_and_keep_mask():
    from grpojax.sampling import kept_logprobs

    model = small_model(3)
    batch = random_grpo_batch(4)
    logp_ref, logsm = full_logits_logp(model, batch)
    mask = np.asarray(batch.completion_mask_nt)
    logp, ent = jax.jit(
        lambda b: policy_logprobs(
            model, b.tokens_ns, b.mask_ns, b.completion_mask_nt, forward=FORWARD, with_entropy=True
        )
    )(batch)
    # Tiled jitted forward against the eager full one: |logp| ~ log V ~ 5 (an ulp 4.8e-7),
    # about one ulp seen here and with XLA at other ISA levels; 2e-6 (DELTA below) is 4.
    np.testing.assert_allclose(np.where(mask, logp, 0), np.where(mask, logp_ref, 0), atol=2e-6)
    ent_ref = -(np.exp(logsm) * logsm).sum(-1)
    np.testing.assert_allclose(ent, np.where(mask, ent_ref, 0), atol=2e-5)
    # Keep-sampling mask of 10 tokens per position, rebuilt by rank on the same logits: the
    # 10 largest, plus the target token (random here, so mostly outside them).
    s = batch.tokens_ns.shape[1]
    t = mask.shape[1]
    mask_ns = np.asarray(batch.mask_ns)
    hidden, _ = model(
        batch.tokens_ns,
        positions_nt=jnp.asarray(np.maximum(np.cumsum(mask_ns, 1) - 1, 0)),
        mask_nt=batch.mask_ns,
    )
    logits = np.asarray(model.logits(hidden))[:, s - t - 1 : s - 1]
    targets = np.asarray(batch.tokens_ns[:, s - t :])
    top10 = logits >= np.sort(logits, -1)[..., -10:-9]
    is_target = np.arange(logits.shape[-1]) == targets[..., None]
    assert (top10.sum(-1) == 10).all() and (is_target & ~top10).any()
    expected = np.asarray(
        kept_logprobs(jnp.asarray(logits), targets, jnp.asarray(top10 | is_target))
    )
    count = jnp.full(targets.shape, 10, jnp.int32)
    got, _ = jax.jit(
        lambda b, c: policy_logprobs(
            model,
            b.tokens_ns,
            b.mask_ns,
            b.completion_mask_nt,
            forward=FORWARD,
            keep_count_nt=c,
        )
    )(batch, count)
    assert np.isfinite(expected).all()
    np.testing.assert_allclose(np.asarray(got)[mask], expected[mask], atol=2e-6)


# ----------------------------------------------------------------------------------------
# Exact accumulation, first ratio, skipping
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_four_micro_batches_equal_one_batch(mode):
    """Loss, metrics and the gradient handed to the optimizer: K=4 == K=1 (<= 1e-6 rel)."""
    model = small_model(5)
    batch = random_grpo_batch(6, n=8)
    # One empty completion, to exercise the sequence counts of the seq-mean modes.
    cm = batch.completion_mask_nt.at[3].set(False)
    batch = batch.replace(completion_mask_nt=cm, mask_ns=batch.mask_ns.at[3, -6:].set(False))
    base = GRPOConfig(
        aggregation=mode,
        norm_constant=6.0,
        beta=0.05,
        entropy_coef=0.01,
        shuffle=False,
        forward=FORWARD,
    )
    tx = grad_recorder()
    graphdef, state0 = create_train_state(model, tx, rng=jax.random.key(0), with_ref=True)
    # Move the reference away from the policy so the KL term has a gradient.
    state0 = state0.replace(ref_params=jax.tree.map(lambda p: p * 1.01, state0.ref_params))
    out = {}
    for k in (1, 4):
        cfg = dataclasses.replace(base, num_microbatches=k)
        out[k] = _update_fn(graphdef, tx, cfg)(state0, batch)
    (s1, m1), (s4, m4) = out[1], out[4]
    np.testing.assert_allclose(float(m4["loss"]), float(m1["loss"]), rtol=1e-6)
    for name in ("pg_loss", "entropy", "grad_norm"):
        np.testing.assert_allclose(float(m4[name]), float(m1[name]), rtol=1e-6, atol=1e-9)
    # The KL metrics are small here (k3(d) = d^2/2 + O(d^3) for d = ref - logp ~ 1e-2), so
    # float32 rounding in a token's logprob, which the two programs compute on 8 and on 2
    # rows (up to DELTA = 2e-6, this file's logprob tolerance), moves a term by |d| DELTA:
    # relatively 2 DELTA / |d|, above 1e-6 (4e-5 seen on one CPU). Bound: an aggregate
    # A = sum_i w_i k3(d_i) with weights summing to W <= T (every mode) moves by at most
    # DELTA sum_i w_i |d_i| <= DELTA sqrt(W sum_i w_i d_i^2) = DELTA sqrt(2 W A) (Cauchy-
    # Schwarz). A micro-batch miscounted in the aggregation would miss by >= A / 8, far more.
    t = batch.completion_mask_nt.shape[1]
    for name in ("kl_loss", "kl_ref"):
        kl = float(m1[name])
        np.testing.assert_allclose(float(m4[name]), kl, rtol=0, atol=2e-6 * np.sqrt(2 * t * kl))
    # Relative error of the whole gradient vector, ||g4 - g1|| / ||g1|| <= 1e-6: the two
    # differ only in float32 summation order (per-micro-batch partial sums, then added).
    g1 = np.concatenate([np.ravel(x) for x in jax.tree.leaves(s1.opt_state)]).astype(np.float64)
    g4 = np.concatenate([np.ravel(x) for x in jax.tree.leaves(s4.opt_state)]).astype(np.float64)
    assert np.linalg.norm(g1) > 0
    rel = np.linalg.norm(g4 - g1) / np.linalg.norm(g1)
    print(f"{mode}: relative gradient difference {rel:.2e}")
    assert rel <= 1e-6, rel


@pytest.mark.parametrize("epochs,minibatches", [(1, 1), (2, 2)], ids=["mu1", "mu2_two_minibatches"])
def test_first_ratio_is_exactly_one(epochs, minibatches):
    model = small_model(7)
    batch = random_grpo_batch(8)
    cfg = GRPOConfig(
        num_epochs=epochs, num_minibatches=minibatches, num_microbatches=2, forward=FORWARD
    )
    tx = make_optimizer(OptimizerConfig(learning_rate=1e-2))
    graphdef, state = create_train_state(model, tx, rng=jax.random.key(1), with_ref=True)
    _, metrics = _update_fn(graphdef, tx, cfg)(state, batch)
    assert float(metrics["first_ratio_min"]) == 1.0
    assert float(metrics["first_ratio_max"]) == 1.0
    if epochs > 1:
        # Later updates see moved parameters: their ratios are not all 1.
        assert float(metrics["ratio_max"]) > 1.0 or float(metrics["ratio_min"]) < 1.0


def test_nan_advantage_skips_update_and_counts_it():
    model = small_model(9)
    batch = random_grpo_batch(10)
    batch = batch.replace(advantages=batch.advantages.at[2].set(jnp.nan))
    tx = make_optimizer(OptimizerConfig(learning_rate=1e-2))
    graphdef, state = create_train_state(model, tx, rng=jax.random.key(2), with_ref=True)
    cfg = GRPOConfig(forward=FORWARD, num_epochs=2)  # two updates, both non-finite
    new, metrics = _update_fn(graphdef, tx, cfg)(state, batch)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(new.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(state.opt_state), jax.tree.leaves(new.opt_state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(new.skipped) == 2 and int(new.num_updates) == 0
    assert float(metrics["skipped"]) == 2.0 and float(metrics["skipped_total"]) == 2.0
    # A finite batch afterwards is applied and the running count stays.
    good = batch.replace(advantages=jnp.nan_to_num(batch.advantages))
    newer, m2 = _update_fn(graphdef, tx, cfg)(new, good)
    assert int(newer.skipped) == 2 and int(newer.num_updates) == 2
    assert float(m2["skipped"]) == 0.0


def test_share_prompt_step_equals_the_unshared_step():
    """share_prompt=True (each prompt run once per forward, groups kept whole) == False on
    a batch of groups: old and reference logprobs precomputed (mu = 2), K = 2 accumulation,
    shuffled rows. Loss and metrics <= 1e-5 relative, the gradient <= 1e-5 relative (the
    two differ in float32 rounding only: attention over a prompt cache vs a full forward)."""
    model = small_model(21)
    g = 4
    batch = grouped_grpo_batch(22, g=g)
    base = GRPOConfig(
        group_size=g,
        beta=0.05,
        num_epochs=2,
        num_microbatches=2,
        entropy_coef=0.01,
        forward=FORWARD,
    )
    tx = grad_recorder()
    graphdef, state0 = create_train_state(model, tx, rng=jax.random.key(3), with_ref=True)
    state0 = state0.replace(ref_params=jax.tree.map(lambda p: p * 1.01, state0.ref_params))
    out = {
        share: _update_fn(graphdef, tx, dataclasses.replace(base, share_prompt=share))(
            state0, batch
        )
        for share in (False, True)
    }
    (s0, m0), (s1, m1) = out[False], out[True]
    for name in ("loss", "pg_loss", "kl_loss", "kl_ref", "entropy", "approx_kl", "grad_norm"):
        np.testing.assert_allclose(float(m1[name]), float(m0[name]), rtol=1e-5, atol=1e-9)
    g0 = np.concatenate([np.ravel(x) for x in jax.tree.leaves(s0.opt_state)]).astype(np.float64)
    g1 = np.concatenate([np.ravel(x) for x in jax.tree.leaves(s1.opt_state)]).astype(np.float64)
    rel = np.linalg.norm(g1 - g0) / np.linalg.norm(g0)
    print(f"share_prompt: relative gradient difference {rel:.2e}")
    assert np.linalg.norm(g0) > 0 and rel <= 1e-5, rel


def test_share_prompt_blocks_hold_whole_groups():
    g, m, k = 4, 2, 2
    n = 4 * g
    perm = unit_permutation(jax.random.key(0), n, g)
    assert sorted(np.asarray(perm).tolist()) == list(range(n))
    rows = jnp.arange(n)
    blocks = np.asarray(_blocks(rows, perm, m, k, g))
    assert blocks.shape == (m, k, n // (m * k))
    for row_ids in blocks.reshape(m * k, -1):
        # Each micro-batch is whole groups, each group's rows contiguous and in order.
        chunks = row_ids.reshape(-1, g)
        np.testing.assert_array_equal(chunks % g, np.broadcast_to(np.arange(g), chunks.shape))
        assert (chunks // g == chunks[:, :1] // g).all()
    back = _unblocks(jnp.asarray(blocks), perm, g)
    np.testing.assert_array_equal(np.asarray(back), np.arange(n))
    # g = 1 is the plain row permutation (unchanged behaviour without share_prompt).
    key = jax.random.key(5)
    np.testing.assert_array_equal(
        np.asarray(unit_permutation(key, n, 1)), np.asarray(jax.random.permutation(key, n))
    )


def test_share_prompt_needs_whole_groups_per_micro_batch():
    model = small_model(0)
    batch = grouped_grpo_batch(1, b=2, g=4)
    cfg = GRPOConfig(group_size=4, share_prompt=True, num_microbatches=4, forward=FORWARD)
    tx = make_optimizer(OptimizerConfig(learning_rate=1e-2))
    graphdef, state = create_train_state(model, tx, rng=jax.random.key(0), with_ref=True)
    with pytest.raises(ValueError, match="N=8 rows must divide into group_size x num_minibatches"):
        grpo_update(state, batch, graphdef=graphdef, tx=tx, config=cfg)
    with pytest.raises(ValueError, match="share_prompt must be True or False"):
        GRPOConfig(share_prompt=1)


def test_beta_zero_skips_reference_forward():
    """Trace-time count of policy forwards: beta = 0 -> the loss's only; beta > 0 -> + ref."""
    model = small_model(11)
    batch = random_grpo_batch(12)
    tx = optax.sgd(0.1)
    graphdef, state = create_train_state(model, tx, rng=jax.random.key(0), with_ref=True)
    real = grpo_loss_mod.scored_hidden  # every forward of the step (`_hidden`)
    for beta, expected in ((0.0, 1), (0.04, 2)):
        calls = []

        def counting(*a, _calls=calls, **kw):
            _calls.append(1)
            return real(*a, **kw)

        cfg = GRPOConfig(beta=beta, forward=FORWARD)
        with mock.patch.object(grpo_loss_mod, "scored_hidden", counting):
            jax.eval_shape(
                functools.partial(grpo_update, graphdef=graphdef, tx=tx, config=cfg), state, batch
            )
        assert len(calls) == expected, (beta, len(calls))
    # No reference anywhere and beta > 0: a clear error.
    _, bare = create_train_state(model, tx, rng=jax.random.key(0))
    with pytest.raises(ValueError, match="beta > 0 needs reference"):
        grpo_update(bare, batch, graphdef=graphdef, tx=tx, config=GRPOConfig(forward=FORWARD))


def test_reference_refresh_every_k_steps():
    model = small_model(13)
    batch = random_grpo_batch(14)
    tx = optax.sgd(0.1)
    graphdef, state = create_train_state(model, tx, rng=jax.random.key(0), with_ref=True)
    ref0 = jax.tree.map(np.asarray, state.ref_params)
    cfg = GRPOConfig(forward=FORWARD, ref_refresh_every=2)
    update = _update_fn(graphdef, tx, cfg)
    state, m = update(state, batch)  # step 1: no refresh
    assert float(m["ref_refreshed"]) == 0.0
    for a, b in zip(jax.tree.leaves(ref0), jax.tree.leaves(state.ref_params), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))
    state, m = update(state, batch)  # step 2: ref <- params
    assert float(m["ref_refreshed"]) == 1.0
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(state.ref_params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ----------------------------------------------------------------------------------------
# Learning sanity: GRPO with the real sampler raises the reward of a toy task
# ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_grpo_learns_to_emit_target_token():
    from grpojax.models import make_mesh
    from grpojax.sampling import SamplingConfig, generate
    from grpojax.train import compute_advantages, grpo_batch_from_rollout, make_grpo_step
    from grpojax.train.state import shard_train_state

    target = 42
    model = small_model(21)
    eos = model.config.eos_token_id
    b, g, t = 4, 8, 4
    config = GRPOConfig(
        group_size=g,
        beta=0.0,
        aggregation="token-mean",
        num_minibatches=2,
        num_epochs=1,
        forward=FORWARD,
    )
    opt = OptimizerConfig(learning_rate=3e-3, warmup_steps=2)
    tx = make_optimizer(opt)
    graphdef, state = create_train_state(model, tx, rng=jax.random.key(3))
    mesh = make_mesh(fsdp=1)
    state, shardings = shard_train_state(state, tx, mesh)
    prompts = jnp.asarray(np.random.default_rng(0).integers(3, 90, (b, 6)), jnp.int32)
    lengths = jnp.full((b,), 6, jnp.int32)
    key = jax.random.key(4)
    step = None
    rewards_hist = []
    for _ in range(30):
        policy = nnx_merge(graphdef, state.params)
        rollout = generate(
            policy,
            prompts,
            lengths,
            key=key,
            max_new_tokens=t,
            group_size=g,
            sampling=SamplingConfig(temperature=1.0),
            eos_ids=(eos,),
        )
        key = rollout.key
        # Reward: the fraction of real completion tokens equal to the target token.
        hits = (rollout.tokens_nt == target) & rollout.mask_nt
        rewards = jnp.sum(hits, 1) / jnp.maximum(rollout.lengths_n, 1)
        rewards_hist.append(float(jnp.mean(rewards)))
        adv = compute_advantages(rewards, config)
        batch = grpo_batch_from_rollout(rollout, advantages=adv, config=config, mesh=mesh)
        if step is None:
            step = make_grpo_step(
                graphdef,
                tx,
                config,
                mesh=mesh,
                state_shardings=shardings,
                batch=batch,
                schedule=None,
            )
        state, metrics = step(state, batch)
        assert float(metrics["skipped"]) == 0.0
    start = np.mean(rewards_hist[:3])
    end = np.mean(rewards_hist[-3:])
    assert start < 0.1, rewards_hist
    assert end > start + 0.3, rewards_hist


def nnx_merge(graphdef, params):
    from flax import nnx

    return nnx.merge(graphdef, params)


def _np_group_advantages(r, valid, g, estimator, eps):
    """Group advantages from the seeds' formulas, float64 (invalid samples left out, 0)."""
    r, valid = np.asarray(r, np.float64).reshape(-1, g), np.asarray(valid).reshape(-1, g)
    out = np.zeros_like(r)
    for b in range(r.shape[0]):
        v = r[b][valid[b]]
        if estimator == "rloo":
            k = v.size
            base = (v.sum() - v) / max(k - 1, 1) if k > 1 else v
            out[b][valid[b]] = v - base if k > 1 else 0.0
            continue
        a = v - v.mean()
        if estimator == "grpo":
            a = a / (v.std() + eps)
        out[b][valid[b]] = a
    return out.reshape(-1)


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_advantages_inside_the_step_equal_precomputed_ones(estimator):
    """A batch carrying rewards (and a failed sample) trains exactly as the same batch
    carrying the NumPy-reference advantages: loss, metrics and new parameters."""
    g = 4
    model = small_model(31)
    batch = grouped_grpo_batch(32, g=g)
    rng = np.random.default_rng(33)
    rewards = rng.integers(0, 3, batch.tokens_ns.shape[0]).astype(np.float32)
    valid = np.ones_like(rewards, bool)
    valid[5] = False
    cmask = batch.completion_mask_nt & jnp.asarray(valid)[:, None]
    cfg = GRPOConfig(group_size=g, advantage_estimator=estimator, beta=0.0, forward=FORWARD)
    # SGD: Adam's first step would turn rounding-level gradient differences near zero into
    # steps of the learning rate's size and compare the optimizer, not the advantages.
    tx = optax.sgd(1e-2)
    graphdef, state = create_train_state(model, tx, rng=jax.random.key(4))
    step = _update_fn(graphdef, tx, cfg)
    with_rewards = batch.replace(
        completion_mask_nt=cmask,
        advantages=None,
        rewards_n=jnp.asarray(rewards),
        valid_n=jnp.asarray(valid),
    )
    adv = _np_group_advantages(rewards, valid, g, estimator, cfg.adv_eps)
    with_adv = batch.replace(completion_mask_nt=cmask, advantages=jnp.asarray(adv, jnp.float32))
    s_r, m_r = step(state, with_rewards)
    s_a, m_a = _update_fn(graphdef, tx, cfg)(state, with_adv)
    # float32 group statistics inside the program vs float64 here: 1e-5 relative.
    for name in ("loss", "pg_loss", "grad_norm"):
        np.testing.assert_allclose(float(m_r[name]), float(m_a[name]), rtol=1e-5, atol=1e-7)
    for a, b in zip(jax.tree.leaves(s_r.params), jax.tree.leaves(s_a.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def _np_reinforce_pp(rewards, valid, old, ref, mask, beta):
    """REINFORCE++ (Hu et al. 2025) in float64, from the paper: per token of a row,
    A_t = r - beta sum_{i >= t} KL_i over its real tokens, KL_i = log pi_old - log pi_ref
    (k1), then normalised over every real token of the batch's valid rows,
    (A - mean) / sqrt(var + 1e-8) (population variance); 0 elsewhere."""
    m = np.asarray(mask, bool) & np.asarray(valid, bool)[:, None]
    kl = np.where(m, np.asarray(old, np.float64) - np.asarray(ref, np.float64), 0.0)
    tail = np.cumsum(kl[:, ::-1], axis=1)[:, ::-1]
    a = np.where(m, np.asarray(rewards, np.float64)[:, None] - beta * tail, 0.0)
    return np.where(m, (a - a[m].mean()) / np.sqrt(a[m].var() + 1e-8), 0.0)


def _as_f32(x) -> np.ndarray:
    """x rounded to float32 (what the step reads), back in float64."""
    return np.asarray(np.asarray(x, np.float32), np.float64)


@pytest.mark.parametrize("logprobs", ["in_batch", "from_state"])
def test_plain_reinforce_pp_advantages_match_the_paper(logprobs):
    """advantage_estimator "reinforce_pp_plain" (the "reinforce_pp_plain" preset, KL in the
    reward): the step's advantages equal `_np_reinforce_pp`, written from the paper. Seen
    through the first loss (the NumPy loss with those advantages) and, for the public loss
    function, directly. pi_old's / pi_ref's logprobs come with the batch ("in_batch"), or
    the step computes them from its parameters and the state's reference ("from_state")."""
    g, beta = 4, 0.1
    model = small_model(35)
    batch = grouped_grpo_batch(36, g=g)
    n = batch.tokens_ns.shape[0]
    logp, logsm = full_logits_logp(model, batch)
    rng = np.random.default_rng(37)
    rewards = rng.integers(0, 3, n).astype(np.float32)
    valid = np.ones(n, bool)
    valid[3] = False
    cmask = np.asarray(batch.completion_mask_nt) & valid[:, None]
    cfg = grpo_preset(
        "reinforce_pp_plain", group_size=g, reward_kl_coef=beta, shuffle=False, forward=FORWARD
    )
    assert (cfg.beta, cfg.kl_estimator) == (0.0, "k1")
    tx = optax.sgd(0.0)
    graphdef, state = create_train_state(model, tx, rng=jax.random.key(5), with_ref=True)
    batch = batch.replace(
        completion_mask_nt=jnp.asarray(cmask),
        advantages=None,
        rewards_n=jnp.asarray(rewards),
        valid_n=jnp.asarray(valid),
    )
    if logprobs == "in_batch":
        old = _as_f32(logp + rng.normal(0, 0.05, logp.shape))
        ref = _as_f32(logp + rng.normal(0, 0.3, logp.shape))
        batch = batch.replace(
            old_logp_nt=jnp.asarray(old, jnp.float32), ref_logp_nt=jnp.asarray(ref, jnp.float32)
        )
    else:  # pi_old: the step's own parameters; pi_ref: another model in the state
        ref_model = small_model(38)
        state = state.replace(ref_params=nnx_split(ref_model)[1])
        old, ref = logp, full_logits_logp(ref_model, batch)[0]
    adv = _np_reinforce_pp(rewards, valid, old, ref, cmask, beta)
    assert np.abs(adv).max() > 0.5 and len(np.unique(np.round(adv[cmask], 6))) > n
    _, m = _update_fn(graphdef, tx, cfg)(state, batch)
    expected = np_grpo_loss(logp, logsm, old, ref, None, adv, cmask, cfg)
    # float32 program vs float64 reference (forward, reward-to-go, whitening): 1e-5 relative.
    np.testing.assert_allclose(float(m["first_loss"]), expected, rtol=1e-5, atol=1e-6)
    if logprobs == "in_batch":
        _, aux = grpo_loss((graphdef, state.params), batch, cfg)
        # Unit-variance advantages in float32 against float64: 1e-5 absolute.
        np.testing.assert_allclose(np.asarray(aux["advantages"]), adv, rtol=0, atol=1e-5)


def test_a_batch_without_advantages_needs_rewards():
    batch = random_grpo_batch(40).replace(advantages=None)
    model = small_model(41)
    tx = make_optimizer(OptimizerConfig(learning_rate=1e-2))
    graphdef, state = create_train_state(model, tx, rng=jax.random.key(5))
    with pytest.raises(ValueError, match="needs rewards_n"):
        _update_fn(graphdef, tx, GRPOConfig(group_size=4, forward=FORWARD))(state, batch)


def test_overlong_filter_and_budget_norm_constant():
    """DAPO's overlong filtering (`overlong_filter`) leaves the completions that ended
    without their own EOS out of the loss: the step equals the unfiltered step on the batch
    with those rows' completion masks cleared (same advantages). And Dr.GRPO's
    norm_constant=None divides by the batch's completion width T, as norm_constant=T does."""
    model = small_model(23)
    batch = random_grpo_batch(24, n=8)
    eos = jnp.asarray([True, False, True, True, False, True, True, True])
    tx = grad_recorder()
    graphdef, state0 = create_train_state(model, tx, rng=jax.random.key(5))
    base = GRPOConfig(
        aggregation="seq-mean-token-sum-norm", beta=0.0, num_microbatches=2, forward=FORWARD
    )
    t = batch.completion_mask_nt.shape[1]
    filtered = dataclasses.replace(base, overlong_filter=True)
    (s1, m1) = _update_fn(graphdef, tx, filtered)(state0, batch.replace(eos_found_n=eos))
    cleared = batch.replace(completion_mask_nt=batch.completion_mask_nt & eos[:, None])
    (s0, m0) = _update_fn(graphdef, tx, dataclasses.replace(base, norm_constant=float(t)))(
        state0, cleared
    )
    assert float(m1["loss"]) == pytest.approx(float(m0["loss"]), rel=1e-6)
    g0 = np.concatenate([np.ravel(x) for x in jax.tree.leaves(s0.opt_state)])
    g1 = np.concatenate([np.ravel(x) for x in jax.tree.leaves(s1.opt_state)])
    assert np.linalg.norm(g0) > 0 and np.linalg.norm(g1 - g0) <= 1e-6 * np.linalg.norm(g0)
    with pytest.raises(
        ValueError, match=r"overlong_filter is set: the batch must carry eos_found_n"
    ):
        _update_fn(graphdef, tx, filtered)(state0, batch)
