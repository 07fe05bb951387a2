"""The names DESIGN.md promises research code exist at top level, with their documented contract."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import grpojax as gj

# (name, keyword-only hyperparameters the design fixes)
PROMISED = [
    ("token_logprobs", ["temperature"]),
    ("token_logprobs_from_hidden", ["chunk_size", "temperature"]),
    ("entropy", []),
    ("entropy_from_hidden", ["chunk_size"]),
    ("gae", ["gamma", "lam"]),
    ("group_advantages", ["group_size", "scale", "eps"]),
    ("rloo_advantages", ["group_size"]),
    ("reinforce_pp_returns", ["gamma"]),
    ("whiten", ["shift_mean"]),
    ("policy_loss", ["clip_low", "clip_high", "dual_clip", "ratio_level"]),
    ("value_loss", ["clip"]),
    ("kl", ["estimator"]),
    ("aggregate", ["mode", "norm_constant"]),
    # The loss, correction and advantage family of issue 14.
    ("cispo_loss", ["clip_low", "clip_high"]),
    ("sapo_loss", ["tau_pos", "tau_neg"]),
    ("gmpo_loss", ["clip_low", "clip_high"]),
    ("dppo_loss", ["divergence", "delta"]),
    (
        "clip_cov_loss",
        ["clip_low", "clip_high", "clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "key"],
    ),
    ("kl_cov_loss", ["kl_cov_ratio", "ppo_kl_coef"]),
    ("rollout_correction", ["level", "mode", "low", "high"]),
    ("pass_at_k_advantages", ["group_size", "k", "eps", "mask_n"]),
    ("opo_advantages", ["group_size", "mask_n"]),
    ("gpg_advantages", ["group_size", "f_norm", "mask_n"]),
    ("maxrl_advantages", ["group_size", "eps", "mask_n"]),
    ("gdpo_advantages", ["group_size", "eps", "weights", "mask_n"]),
    ("remax_advantages", ["mask_n"]),
]

# Positional array arguments, in order, where the design fixes them.
POSITIONAL = {
    "cispo_loss": 4,
    "sapo_loss": 4,
    "gmpo_loss": 4,
    "dppo_loss": 4,
    "clip_cov_loss": 4,
    "kl_cov_loss": 4,
    "rollout_correction": 3,
    "pass_at_k_advantages": 1,
    "opo_advantages": 2,
    "gpg_advantages": 1,
    "maxrl_advantages": 1,
    "gdpo_advantages": 1,
    "remax_advantages": 2,
}


@pytest.mark.parametrize("name,kwonly", PROMISED)
def test_promised_name_is_documented_and_keyword_only(name, kwonly):
    fn = getattr(gj, name)
    params = inspect.signature(fn).parameters
    for k in kwonly:
        assert k in params, f"{name} lacks {k}"
        assert params[k].kind is inspect.Parameter.KEYWORD_ONLY, f"{name}.{k} must be keyword-only"
    doc = inspect.getdoc(fn) or ""
    assert len(doc) > 80 and ("[N" in doc or "`N" in doc), f"{name} needs a docstring with shapes"


@pytest.mark.parametrize("name,n_arrays", POSITIONAL.items())
def test_array_arguments_are_positional_and_the_rest_keyword_only(name, n_arrays):
    params = list(inspect.signature(getattr(gj, name)).parameters.values())
    kinds = [p.kind for p in params]
    assert kinds[:n_arrays] == [inspect.Parameter.POSITIONAL_OR_KEYWORD] * n_arrays, name
    assert all(k is inspect.Parameter.KEYWORD_ONLY for k in kinds[n_arrays:]), name


def test_all_exports_resolve():
    for name in gj.__all__:
        assert getattr(gj, name) is not None


def test_one_grpo_loss_end_to_end_under_jit_and_grad():
    """The research-code path of the README quick start: logprobs -> advantages -> loss."""
    n, t, v, g = 4, 5, 11, 2
    logits = jax.random.normal(jax.random.key(0), (n, t, v))
    tokens = jax.random.randint(jax.random.key(1), (n, t), 0, v)
    mask = gj.mask_from_lengths(jnp.array([5, 3, 1, 4]), t)
    rewards = jnp.array([1.0, 0.0, 0.5, 0.5])

    def loss_fn(logits):
        logp = gj.token_logprobs(logits, tokens)
        adv = gj.group_advantages(rewards, group_size=g)
        loss_nt, _ = gj.policy_loss(
            logp, jax.lax.stop_gradient(logp), adv, mask, clip_low=0.2, clip_high=0.28
        )
        return gj.aggregate(loss_nt, mask, mode="token-mean")

    loss, grad = jax.jit(jax.value_and_grad(loss_fn))(logits)
    # ratio == 1 everywhere, so the loss is -mean(A) over real tokens.
    adv = np.array([1.0, -1.0, 0.0, 0.0])  # groups (1, 0) and (0.5, 0.5)
    lengths = np.array([5, 3, 1, 4])
    expected = -(adv * lengths).sum() / lengths.sum()
    np.testing.assert_allclose(float(loss), expected, atol=1e-5)
    assert np.isfinite(np.asarray(grad)).all()
    np.testing.assert_array_equal(np.asarray(grad)[1, 3:], 0.0)  # padding gets no gradient


# The train layer's names for research code (issue 36): the GRPO loss without the update,
# its batch from token-id lists, the TRL port.
TRAIN_NAMES = [
    ("grpo_loss", ["ref_params", "with_grads"]),
    ("grpo_loss_from_logprobs", ["config", "ref_logp_nt", "sampler_logp_nt", "entropy_nt"]),
    ("grpo_batch_from_ids", ["group_size", "pad_id", "prompt_width", "completion_width"]),
    ("from_trl", []),
]


@pytest.mark.parametrize("name,kwonly", TRAIN_NAMES)
def test_train_research_names_are_documented_and_keyword_only(name, kwonly):
    import grpojax.train

    fn = getattr(grpojax.train, name)
    assert name in grpojax.train.__all__
    params = inspect.signature(fn).parameters
    for k in kwonly:
        assert params[k].kind is inspect.Parameter.KEYWORD_ONLY, f"{name}.{k} must be keyword-only"
    doc = inspect.getdoc(fn) or ""
    assert len(doc) > 80, f"{name} needs a docstring"
    if name != "from_trl":
        assert "[N" in doc, f"{name} needs a docstring with shapes"
