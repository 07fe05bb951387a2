"""RewardModelScorer: one scalar per (prompt, completion) at the last real token, equal to
the reward model run on each unpadded sequence alone; fixed shapes compile once."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from grpojax.models import Decoder, RewardModel, builtin_tokenizer, tiny_config
from grpojax.rewards import RewardManager, RewardSpec
from grpojax.rewards import reward_model as rm_module
from grpojax.rewards.reward_model import RewardModelScorer


@pytest.fixture(scope="module")
def model_and_tokenizer():
    cfg = tiny_config(
        hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16
    )
    model = RewardModel(Decoder(cfg, rngs=nnx.Rngs(0)), rngs=nnx.Rngs(1))
    # a non-trivial head so different sequences get clearly different rewards
    model.head.w[...] = jnp.linspace(-1.0, 1.0, cfg.hidden_size)
    return model, builtin_tokenizer()


@nnx.jit
def _unpadded(model, ids_1t):
    return model(ids_1t, mask_nt=jnp.ones(ids_1t.shape, bool))


def direct_reward(model, tok, text):
    """Independent path: the model on the single unpadded sequence, head at its last token."""
    ids = jnp.asarray([tok(text, add_special_tokens=False)["input_ids"]], jnp.int32)
    return float(_unpadded(model, ids)[0])


def test_scores_match_unpadded_single_sequences(model_and_tokenizer, monkeypatch):
    model, tok = model_and_tokenizer
    traces = []
    real = rm_module.mask_from_lengths
    monkeypatch.setattr(
        rm_module, "mask_from_lengths", lambda *a, **k: traces.append(1) or real(*a, **k)
    )
    scorer = RewardModelScorer(model, tok, max_length=24, batch_size=3)
    # ragged lengths (8, 6, 8, 6) and a last batch of one real row plus two dummies
    prompts = ["12+34=", "7+8=", "99+1=", "5+5="]
    completions = ["46", "15", "100", "10"]
    got = scorer(prompts, completions)
    want = [direct_reward(model, tok, p + c) for p, c in zip(prompts, completions)]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    assert len(set(np.round(got, 4))) == 4  # not a constant
    # different N and lengths reuse the one compiled shape
    got2 = scorer(["1+1=", "2+3="], ["22", "5"])
    want2 = [direct_reward(model, tok, t) for t in ("1+1=22", "2+3=5")]
    np.testing.assert_allclose(got2, want2, rtol=0, atol=1e-5)
    assert len(traces) == 1


def test_truncation_keeps_the_last_tokens(model_and_tokenizer):
    model, tok = model_and_tokenizer
    scorer = RewardModelScorer(model, tok, max_length=8, batch_size=2)
    long_prompt = "0123456789+0123456789="
    got = scorer([long_prompt], ["42"])
    kept = (long_prompt + "42")[-8:]
    np.testing.assert_allclose(got, [direct_reward(model, tok, kept)], rtol=0, atol=1e-5)


def test_inline_in_a_manager(model_and_tokenizer):
    model, tok = model_and_tokenizer
    scorer = RewardModelScorer(model, tok, max_length=16, batch_size=4)
    spec = RewardSpec(scorer, name="rm", mode="inline", weight=2.0)
    with RewardManager([spec]) as mgr:
        res = mgr.compute(["1+1=", "2+2="], ["2", "4"], answer=["2", "4"])
    assert res.valid_n.all()
    want = [2.0 * direct_reward(model, tok, t) for t in ("1+1=2", "2+2=4")]
    np.testing.assert_allclose(res.total_n, want, rtol=0, atol=1e-5)


def test_bad_arguments(model_and_tokenizer):
    model, tok = model_and_tokenizer
    with pytest.raises(ValueError, match="RewardModel"):
        RewardModelScorer(model.backbone, tok)
    with pytest.raises(ValueError, match="max_length must be an int >= 1"):
        RewardModelScorer(model, tok, max_length=0)
