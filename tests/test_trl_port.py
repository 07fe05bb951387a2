"""A TRL GRPO config ported with `grpojax.train.from_trl` reproduces TRL's update.

The reference is TRL's GRPO loss written in NumPy (float64) from TRL v1.9.0: the "Loss
Types" and "Entropy regularization" sections of its GRPO Trainer page
(https://huggingface.co/docs/trl/v1.9.0/grpo_trainer, source docs/source/grpo_trainer.md)
and, for what the page leaves implicit (the clip, `delta`, CISPO's cap, the KL, the
advantages' 1e-4 and Bessel-corrected std, the per-type denominators),
`GRPOTrainer._compute_loss` and `_generate_and_score_completions` in
trl/trainer/grpo_trainer.py at the same tag. No TRL install is needed. One process, one
micro-batch per optimizer step (gradient_accumulation_steps = 1), so TRL's
`num_items_in_batch` is the batch's real tokens.

Both sides get the same float32 logprobs, old and reference logprobs, rewards, masks and
entropies; the test compares the loss and its per-token gradient with respect to the
logprobs (the reference's by central differences in float64). The case table of
docs/how-to/coming-from-trl.md lists the fields covered.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from train_helpers import FORWARD, full_logits_logp, grouped_grpo_batch, small_model

from grpojax.train import (
    TRL_DEFAULTS,
    compute_advantages,
    from_trl,
    grpo_loss,
    grpo_loss_from_logprobs,
)

jax.config.update("jax_default_matmul_precision", "highest")

N, T, G = 8, 6, 4


# ----------------------------------------------------------------------------------------
# TRL v1.9.0's GRPO loss in NumPy
# ----------------------------------------------------------------------------------------


def np_trl_advantages(rewards, f):
    """`_generate_and_score_completions`, multi_objective_aggregation="sum_then_normalize"."""
    g = f["num_generations"]
    r = rewards.reshape(-1, g)
    mean = np.repeat(r.mean(1), g)
    scale = f["scale_rewards"]
    if scale in (True, "group", False, "none"):
        std = np.repeat(r.std(1, ddof=1), g)  # trl.trainer.utils.nanstd: Bessel-corrected
    else:  # "batch"
        std = np.full(rewards.shape, rewards.std(ddof=1))
    adv = rewards - mean
    if scale not in (False, "none"):
        adv = adv / (std + 1e-4)
    return adv


def np_trl_loss(logp, *, logp_detached, old, ref, adv, mask, entropy, f):
    """`GRPOTrainer._compute_loss` for one micro-batch (gradient_accumulation_steps = 1).

    `logp_detached` is where TRL calls `.detach()` on the policy's logprobs (CISPO's weight,
    the off-policy mask): the finite differences move `logp` only."""
    mask = mask.astype(np.float64)
    a = adv[:, None]
    low = f["epsilon"]
    high = low if f["epsilon_high"] is None else f["epsilon_high"]
    log_ratio = logp - old
    if f["importance_sampling_level"] == "token":
        log_w = log_ratio
    else:
        log_w = (log_ratio * mask).sum(-1, keepdims=True) / np.maximum(
            mask.sum(-1, keepdims=True), 1.0
        )
    coef_1 = np.exp(log_w)
    if f["beta"]:
        per_token_kl = np.exp(ref - logp) - (ref - logp) - 1
        if f["use_bias_correction_kl"]:
            per_token_kl = per_token_kl * coef_1
    loss_type = f["loss_type"]
    if loss_type == "cispo":
        ratio_sg = np.exp(logp_detached - old)
        per_token_loss = -np.minimum(ratio_sg, high) * a * logp
    elif loss_type == "sapo":
        tau = np.where(a > 0, f["sapo_temperature_pos"], f["sapo_temperature_neg"])
        per_token_loss = -(1 / (1 + np.exp(-tau * (coef_1 - 1)))) * 4 / tau * a
    else:
        coef_2 = np.clip(coef_1, 1 - low, 1 + high)
        if f["delta"] is not None:
            coef_1 = np.minimum(coef_1, f["delta"])
        per_token_loss = -np.minimum(coef_1 * a, coef_2 * a)
    if f["off_policy_mask_threshold"] is not None:
        kl_div = old - logp_detached  # sampling logprobs = old ones without vLLM
        avg = (kl_div * mask).sum(1, keepdims=True) / np.maximum(mask.sum(1, keepdims=True), 1)
        per_token_loss = per_token_loss * ((a >= 0) | (avg <= f["off_policy_mask_threshold"]))
    if f["beta"]:
        per_token_loss = per_token_loss + f["beta"] * per_token_kl
    per_token_loss = np.broadcast_to(per_token_loss, mask.shape)
    if loss_type in ("grpo", "sapo"):
        loss = ((per_token_loss * mask).sum(-1) / np.maximum(mask.sum(-1), 1.0)).mean()
    elif loss_type == "bnpo":
        loss = (per_token_loss * mask).sum() / max(mask.sum(), 1.0)
    elif loss_type == "dr_grpo":
        loss = (per_token_loss * mask).sum() / (mask.shape[0] * f["max_completion_length"])
    elif loss_type in ("cispo", "dapo"):
        loss = (per_token_loss * mask).sum() / max(mask.sum(), 1.0)
    else:  # luspo: one loss per sequence (beta = 0), times its length, mean over rows
        loss = (per_token_loss[:, :1] * mask.sum(1, keepdims=True)).mean()
    if f["entropy_coef"]:
        # "always the mean per-token entropy regardless of loss_type"
        loss = loss - f["entropy_coef"] * (entropy * mask).sum() / max(mask.sum(), 1.0)
    return loss


def np_trl_grad(f, logp, **kw):
    """d loss / d logp by central differences, float64 (h = 1e-6: truncation ~1e-12,
    rounding ~1e-10, far below the float32 side's error)."""
    h = 1e-6
    out = np.zeros_like(logp)
    for idx in np.ndindex(logp.shape):
        up, down = logp.copy(), logp.copy()
        up[idx] += h
        down[idx] -= h
        out[idx] = (np_trl_loss(up, **kw, f=f) - np_trl_loss(down, **kw, f=f)) / (2 * h)
    return out


# ----------------------------------------------------------------------------------------
# The cases: TRL fields (others at TRL_DEFAULTS) and how far old is from the policy
# ----------------------------------------------------------------------------------------

CASES = {
    "defaults_on_policy": ({}, 0.0),
    "grpo_beta_0.04": ({"loss_type": "grpo", "beta": 0.04}, 0.3),
    "dapo_clip_higher_beta": ({"epsilon_high": 0.28, "beta": 0.01}, 0.3),
    "bnpo": ({"loss_type": "bnpo", "beta": 0.02}, 0.3),
    "dr_grpo_no_scale_entropy": (
        {
            "loss_type": "dr_grpo",
            "scale_rewards": False,
            "max_completion_length": 16,
            "beta": 0.04,
            "entropy_coef": 0.01,
        },
        0.3,
    ),
    "grpo_delta": ({"loss_type": "grpo", "delta": 1.25}, 0.8),
    "cispo": ({"loss_type": "cispo", "epsilon_high": 5.0}, 0.8),
    "sapo": ({"loss_type": "sapo", "beta": 0.01}, 0.3),
    "luspo": ({"loss_type": "luspo", "importance_sampling_level": "sequence"}, 0.3),
    "gspo": (
        {
            "loss_type": "grpo",
            "importance_sampling_level": "sequence",
            "epsilon": 3e-4,
            "epsilon_high": 4e-4,
        },
        0.05,
    ),
    "dapo_batch_scale": ({"scale_rewards": "batch"}, 0.3),
    "opsm_bias_corrected_kl": (
        {
            "loss_type": "grpo",
            "off_policy_mask_threshold": 0.0,
            "use_bias_correction_kl": True,
            "beta": 0.05,
        },
        0.3,
    ),
    "grpo_entropy": ({"loss_type": "grpo", "entropy_coef": 0.02}, 0.3),
}


def _inputs(seed: int, off_policy: float):
    rng = np.random.default_rng(seed)
    lengths = np.array([6, 3, 1, 5, 4, 6, 2, 5])
    mask = np.arange(T)[None, :] < lengths[:, None]
    f32 = lambda x: np.asarray(x, np.float32)
    logp = f32(rng.normal(-2.0, 0.7, (N, T)))
    old = f32(logp + rng.normal(0.0, off_policy, (N, T))) if off_policy else logp.copy()
    ref = f32(logp + rng.normal(0.0, 0.3, (N, T)))
    rewards = f32([1.0, 0.0, 0.5, 1.0, 0.0, 0.0, 1.0, 0.5])
    entropy = f32(rng.uniform(0.5, 3.0, (N, T)))
    return logp, old, ref, rewards, mask, entropy


@pytest.mark.parametrize("name", sorted(CASES))
def test_ported_config_reproduces_trl_loss_and_gradient(name):
    fields, off_policy = CASES[name]
    fields = {**fields, "num_generations": G}
    f = {**TRL_DEFAULTS, **fields}
    config = from_trl(**fields)
    logp, old, ref, rewards, mask, entropy = _inputs(7, off_policy)

    adv = compute_advantages(jnp.asarray(rewards), config, mask_nt=jnp.asarray(mask))
    adv_trl = np_trl_advantages(rewards.astype(np.float64), f)
    # float32 group statistics vs float64: 1e-5 relative on advantages of order 1.
    np.testing.assert_allclose(np.asarray(adv), adv_trl, rtol=1e-5, atol=1e-6)

    def ours(lp, ent):
        loss, _ = grpo_loss_from_logprobs(
            lp,
            jnp.asarray(old),
            adv,
            jnp.asarray(mask),
            config=config,
            ref_logp_nt=jnp.asarray(ref) if config.beta else None,
            entropy_nt=ent if config.entropy_coef else None,
        )
        return loss

    loss, (g_logp, g_ent) = jax.jit(jax.value_and_grad(ours, argnums=(0, 1)))(
        jnp.asarray(logp), jnp.asarray(entropy)
    )
    kw = dict(
        logp_detached=logp.astype(np.float64),
        old=old.astype(np.float64),
        ref=ref.astype(np.float64),
        adv=adv_trl,
        mask=mask,
        entropy=entropy.astype(np.float64),
    )
    expected = np_trl_loss(logp.astype(np.float64), **kw, f=f)
    grad = np_trl_grad(f, logp.astype(np.float64), **kw)
    # float32 loss of ~50 O(1) terms vs float64 on the same float32 inputs: 1e-5 relative
    # (1e-6 absolute for losses near 0); per-token gradients of size ~1e-2: 1e-5 relative,
    # 1e-7 absolute.
    np.testing.assert_allclose(float(loss), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(g_logp), grad, rtol=1e-5, atol=1e-7)
    assert np.abs(grad).max() > 1e-3  # the comparison is not of zeros
    if f["entropy_coef"]:
        # TRL's bonus is the token mean whatever the loss type: d loss / d H_t = -c / tokens.
        want = np.where(mask, -f["entropy_coef"] / mask.sum(), 0.0)
        np.testing.assert_allclose(np.asarray(g_ent), want, rtol=1e-6, atol=1e-9)


def test_delta_binds_and_is_dual_clip():
    """The "grpo_delta" case exercises the bound: negative-advantage tokens with a ratio
    above delta (TRL's clamp and grpojax's dual clip both zero their gradient), and
    positive-advantage ones above it (TRL clamps them too, which changes nothing when
    delta >= 1 + epsilon_high: the clipped branch already binds)."""
    fields, off_policy = CASES["grpo_delta"]
    logp, old, _, rewards, mask, _ = _inputs(7, off_policy)
    adv = np_trl_advantages(rewards.astype(np.float64), {**TRL_DEFAULTS, "num_generations": G})
    above = (np.exp(logp.astype(np.float64) - old) > fields["delta"]) & mask
    assert (above & (adv[:, None] < 0)).sum() >= 2 and (above & (adv[:, None] > 0)).sum() >= 2
    assert from_trl(**fields).dual_clip == fields["delta"]


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_truncated_completions_through_the_step(loss_type):
    """From a batch with rewards and truncated rows, `grpo_loss` with the ported config
    (advantages and the overlong filter inside the step) against TRL's loss on the model's
    full-logit logprobs. Token-level "dapo": equal. Per-sequence "grpo": TRL divides by
    all N rows and grpojax by the kept ones (the documented difference), so
    TRL = grpojax x kept / N exactly."""
    fields = dict(loss_type=loss_type, num_generations=G, mask_truncated_completions=True)
    config = dataclasses.replace(from_trl(**fields), forward=FORWARD)
    assert config.overlong_filter
    model = small_model(21)
    batch = grouped_grpo_batch(22, g=G)
    n = batch.tokens_ns.shape[0]
    rng = np.random.default_rng(23)
    rewards = rng.integers(0, 3, n).astype(np.float32)
    eos = np.ones(n, bool)
    eos[[1, 6, 7, 12]] = False
    batch = batch.replace(
        advantages=None, rewards_n=jnp.asarray(rewards), eos_found_n=jnp.asarray(eos)
    )
    loss, _ = grpo_loss(model, batch, config)

    logp, _ = full_logits_logp(model, batch)
    mask = np.asarray(batch.completion_mask_nt) & eos[:, None]  # TRL zeroes truncated rows
    f = {**TRL_DEFAULTS, **fields}
    adv = np_trl_advantages(rewards.astype(np.float64), f)  # over every row's reward
    expected = np_trl_loss(
        logp, logp_detached=logp, old=logp, ref=None, adv=adv, mask=mask, entropy=None, f=f
    )
    kept = eos.sum()
    scale = 1.0 if loss_type == "dapo" else kept / n
    # Full-logit float64 logprobs vs the chunked float32 forward: 1e-5 relative.
    np.testing.assert_allclose(float(loss) * scale, expected, rtol=1e-5, atol=1e-6)
    assert abs(expected) > 1e-3


@pytest.mark.parametrize(
    "fields,match",
    [
        ({"learning_rate": 1e-6, "top_p": 0.9}, r"^from_trl cannot map TRL fields \['learning"),
        ({"loss_type": "vespo"}, r"^loss_type='vespo' has no grpojax equivalent"),
        ({"loss_type": "grpo", "delta": 1.1}, r"^delta=1.1 must be >= 1 \+ epsilon_high"),
        ({"loss_type": "cispo"}, r"^epsilon_high=0.2: with loss_type='cispo'"),
        ({"loss_type": "sapo", "delta": 2.0}, r"^delta: TRL ignores it"),
        ({"top_entropy_quantile": 0.2}, r"^top_entropy_quantile=0.2"),
        ({"loss_type": "luspo"}, r"^loss_type='luspo' needs importance_sampling_level"),
        ({"reward_weights": [1.0, 0.5]}, r"^reward_weights with multi_objective_aggregation"),
        ({"steps_per_generation": 3, "gradient_accumulation_steps": 2}, r"^steps_per_gen"),
    ],
)
def test_from_trl_refuses_what_it_cannot_map(fields, match):
    with pytest.raises(ValueError, match=match) as err:
        from_trl(**fields)
    assert "\n" not in str(err.value)


def test_from_trl_maps_the_trap_fields():
    """The traps of docs/how-to/coming-from-trl.md, field by field."""
    c = from_trl()
    assert (c.beta, c.aggregation, c.adv_eps, c.adv_std) == (0.0, "token-mean", 1e-4, "unbiased")
    assert c.advantage_estimator == "grpo" and c.entropy_aggregation == "token-mean"
    # TRL's loss_type="dr_grpo" alone keeps std scaling; the paper's Dr.GRPO also needs
    # scale_rewards=False (grpojax's "dr_grpo" preset sets both).
    d = from_trl(loss_type="dr_grpo", max_completion_length=1024)
    assert (d.aggregation, d.norm_constant, d.advantage_estimator) == (
        "seq-mean-token-sum-norm",
        1024.0,
        "grpo",
    )
    assert from_trl(loss_type="dr_grpo", scale_rewards=False).advantage_estimator == "dr_grpo"
    cispo = from_trl(loss_type="cispo", epsilon_high=5.0)
    assert (cispo.clip_low, cispo.clip_high) == (1.0, 4.0)
    m = from_trl(num_iterations=2, steps_per_generation=4, gradient_accumulation_steps=2)
    assert (m.num_epochs, m.num_minibatches, m.num_microbatches) == (2, 2, 1)
    gd = from_trl(multi_objective_aggregation="normalize_then_sum", reward_weights=[1.0, 0.5])
    assert (gd.advantage_estimator, gd.gdpo_weights) == ("gdpo", (1.0, 0.5))


def test_normalize_then_sum_advantages():
    """multi_objective_aggregation="normalize_then_sum" (GDPO) with reward_weights: each
    function normalised in its group, the weighted sum normalised over the batch, both with
    TRL's Bessel std and 1e-4 (`_generate_and_score_completions`)."""
    fields = dict(
        num_generations=G,
        multi_objective_aggregation="normalize_then_sum",
        reward_weights=[1.0, 0.5],
    )
    config = from_trl(**fields)
    rng = np.random.default_rng(3)
    per_fn = rng.integers(0, 3, (N, 2)).astype(np.float32)
    grouped = per_fn.astype(np.float64).reshape(-1, G, 2)
    k = (grouped - grouped.mean(1, keepdims=True)) / (grouped.std(1, ddof=1, keepdims=True) + 1e-4)
    summed = (k.reshape(-1, 2) * np.array([1.0, 0.5])).sum(1)
    want = (summed - summed.mean()) / (summed.std(ddof=1) + 1e-4)
    weighted = jnp.asarray(per_fn @ np.array([1.0, 0.5], np.float32))
    got = compute_advantages(weighted, config, rewards_nr=jnp.asarray(per_fn))
    # float32 statistics vs float64: 1e-5 relative on advantages of order 1.
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
