"""Export to transformers: a policy as `*ForCausalLM`, a reward model or critic as
`*ForSequenceClassification`, both loaded by transformers (PyTorch) with outputs equal to
grpojax's (float32, max abs <= 1e-4), and read back by grpojax exactly.

Tiny random Llama / Mistral / Qwen2 / Qwen3 checkpoints are built with transformers (the fixtures of
test_models_hf), loaded into grpojax, given a random scalar head, and exported.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from test_models_hf import CASES as HF_CASES
from test_models_hf import _hf_logits, _hf_model

import grpojax.models as gm
from grpojax.errors import UserError

TOL = 1e-4
V = 96
PAD = 0  # the fixtures' pad_token_id; batches below never end a row with it


def _right_padded(seed=0, n=4, t=10):
    """Right-padded batch (tokens [N, T], mask [N, T]): transformers' sequence classifier
    reads each row at its last non-pad token, which is then the mask's last real token."""
    rng = np.random.default_rng(seed)
    lengths = np.array([t, t - 4, 1, t - 1])[:n]
    mask = np.arange(t)[None, :] < lengths[:, None]
    tokens = np.where(mask, rng.integers(3, V, size=(n, t)), PAD)
    return tokens, mask


def _with_head(cls, backbone, seed, bias=0.0):
    model = cls(backbone, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    model.head.w.set_value(jnp.asarray(rng.normal(size=model.head.w.shape), jnp.float32))
    model.head.b.set_value(jnp.asarray(bias, jnp.float32))
    return model


def _hf_seq(path):
    return transformers.AutoModelForSequenceClassification.from_pretrained(
        path, attn_implementation="eager"
    ).eval()


def _hf_scores(model, tokens, mask):
    """(pooled scores [N], per-token scores [N, T]) of a HF sequence classifier."""
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask.astype(np.int64))
        )
        hidden = model.model(
            input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask.astype(np.int64))
        ).last_hidden_state
        per_token = model.score(hidden)[..., 0]
    return out.logits[:, 0].float().numpy(), per_token.float().numpy()


def _backbone_params_equal(a, b):
    pa, pb = a.named_params(), b.named_params()
    for name, var in pa.items():
        if name == "lm_head":  # a sequence classifier has no output matrix
            continue
        np.testing.assert_array_equal(np.asarray(pb[name][...]), np.asarray(var[...]))


CASES = {
    "llama": dict(kind="llama"),
    "mistral": dict(kind="mistral", head_dim=16, sliding_window=None),
    "qwen2": dict(kind="qwen2", tie=True, kv_heads=1),
    "qwen3": dict(kind="qwen3", head_dim=16),
    # The mixtures of experts of the causal-LM parity cases.
    "mixtral": HF_CASES["mixtral_top2"],
    "qwen3_moe": HF_CASES["qwen3_moe_norm_topk"],
    # Sliding windows: Gemma 3's layers (and its other parts), Mistral v0.1's.
    "gemma3": HF_CASES["gemma3_sliding_full"],
    "gemma2": HF_CASES["gemma2_softcaps"],
    "mistral_window": HF_CASES["mistral_sliding_window"],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_export_policy_reward_and_critic_load_in_transformers(case, tmp_path):
    hf = _hf_model(**CASES[case], seed=10 + len(case))
    hf.save_pretrained(tmp_path / "src", safe_serialization=True)
    policy = gm.from_pretrained(tmp_path / "src")
    tokens, mask = _right_padded(seed=3)
    diffs = {}

    # Policy -> AutoModelForCausalLM.
    gm.save_pretrained(policy, tmp_path / "policy")
    gen = json.loads((tmp_path / "policy" / "generation_config.json").read_text())
    assert gen == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    hf_policy = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "policy", attn_implementation="eager"
    ).eval()
    got = np.asarray(gm.forward_logits(policy, jnp.asarray(tokens), jnp.asarray(mask)))
    diffs["policy"] = float(np.max(np.abs(_hf_logits(hf_policy, tokens, mask) - got)[mask]))

    # Reward model -> AutoModelForSequenceClassification (score at the last real token).
    rm = _with_head(gm.RewardModel, policy, seed=1)
    assert gm.save_sequence_classifier(rm, tmp_path / "rm") == 0.0
    cfg = json.loads((tmp_path / "rm" / "config.json").read_text())
    assert cfg["architectures"] == [type(hf).__name__.replace("CausalLM", "SequenceClassification")]
    hf_rm = _hf_seq(tmp_path / "rm")
    assert hf_rm.num_labels == 1 and hf_rm.score.bias is None
    pooled, _ = _hf_scores(hf_rm, tokens, mask)
    rewards = np.asarray(rm(jnp.asarray(tokens), mask_nt=jnp.asarray(mask)))
    diffs["reward"] = float(np.max(np.abs(pooled - rewards)))

    # Critic -> the same format, per-token values (its bias kept beside transformers').
    critic = _with_head(gm.ValueModel, policy, seed=2, bias=0.25)
    assert gm.save_sequence_classifier(critic, tmp_path / "critic") == 0.25
    hf_critic = _hf_seq(tmp_path / "critic")
    _, per_token = _hf_scores(hf_critic, tokens, mask)
    values = np.asarray(critic(jnp.asarray(tokens), mask_nt=jnp.asarray(mask)))
    diffs["critic"] = float(np.max(np.abs(per_token + 0.25 - values)[mask]))
    print(case, diffs)
    assert max(diffs.values()) <= TOL, diffs

    # grpojax -> HF -> grpojax: identical parameters and outputs.
    rm2 = gm.load_reward_model(tmp_path / "rm")
    _backbone_params_equal(rm.backbone, rm2.backbone)
    np.testing.assert_array_equal(rm2.head.w[...], rm.head.w[...])
    np.testing.assert_array_equal(
        np.asarray(rm2(jnp.asarray(tokens), mask_nt=jnp.asarray(mask))), rewards
    )
    critic2 = gm.load_value_model(tmp_path / "critic")
    assert float(critic2.head.b[...]) == 0.25
    np.testing.assert_array_equal(
        np.asarray(critic2(jnp.asarray(tokens), mask_nt=jnp.asarray(mask))), values
    )
    policy2 = gm.from_pretrained(tmp_path / "policy")
    assert policy2.config == policy.config
    _backbone_params_equal(policy, policy2)


def test_sequence_classifier_sharded_and_bfloat16(tmp_path):
    policy = gm.Decoder(gm.tiny_config(num_layers=2), rngs=nnx.Rngs(0))
    rm = _with_head(gm.RewardModel, policy, seed=4)
    gm.save_sequence_classifier(rm, tmp_path / "sharded", max_shard_size=200_000)
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    assert not (tmp_path / "sharded" / "model.safetensors").exists()
    tokens = np.random.default_rng(0).integers(4, 40, size=(2, 6))
    mask = np.ones_like(tokens, bool)
    want = np.asarray(rm(jnp.asarray(tokens), mask_nt=jnp.asarray(mask)))
    got = gm.load_reward_model(tmp_path / "sharded")(jnp.asarray(tokens), mask_nt=jnp.asarray(mask))
    np.testing.assert_array_equal(np.asarray(got), want)
    # A whole model under the shard size is one model.safetensors, as transformers writes.
    gm.save_pretrained(policy, tmp_path / "one", max_shard_size=10**9)
    assert (tmp_path / "one" / "model.safetensors").exists()
    assert not (tmp_path / "one" / "model.safetensors.index.json").exists()

    gm.save_sequence_classifier(rm, tmp_path / "bf16", dtype="bfloat16")
    cfg = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert cfg["dtype"] == "bfloat16"
    rm16 = gm.load_reward_model(tmp_path / "bf16")
    assert rm16.backbone.named_params()["embed"][...].dtype == jnp.bfloat16
    got16 = np.asarray(rm16(jnp.asarray(tokens), mask_nt=jnp.asarray(mask)))
    assert np.max(np.abs(got16 - want)) < 0.05 * max(1.0, float(np.max(np.abs(want))))
    with pytest.raises(UserError, match="dtype must be one of"):
        gm.save_pretrained(policy, tmp_path / "x", dtype="float16")


def test_loading_the_wrong_kind_is_named(tmp_path):
    policy = gm.Decoder(gm.tiny_config(num_layers=1), rngs=nnx.Rngs(0))
    gm.save_pretrained(policy, tmp_path / "lm")
    with pytest.raises(UserError, match="not a sequence-classification checkpoint"):
        gm.load_reward_model(tmp_path / "lm")
    gm.save_sequence_classifier(gm.RewardModel(policy, rngs=nnx.Rngs(1)), tmp_path / "rm")
    with pytest.raises(UserError, match="is a sequence-classification checkpoint"):
        gm.from_pretrained(tmp_path / "rm")
    with pytest.raises(UserError, match="not found"):
        gm.load_reward_model(tmp_path / "nowhere")
    cfg = json.loads((tmp_path / "rm" / "config.json").read_text())
    cfg["id2label"] = {"0": "A", "1": "B"}
    (tmp_path / "rm" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="num_labels=1"):
        gm.load_reward_model(tmp_path / "rm")


def test_exported_tokenizer_round_trips_a_chat_templated_conversation(tmp_path):
    """The tokenizer `save_pretrained` writes beside the weights, loaded by transformers'
    `AutoTokenizer`, renders a conversation with the same chat template text and token ids
    as grpojax's tokenizer, and decodes the ids back to that text."""
    from grpojax.models.tokenizer import builtin_tokenizer

    tok = builtin_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    model = gm.Decoder(gm.tiny_config(num_layers=1), rngs=nnx.Rngs(0))
    gm.save_pretrained(model, tmp_path, tokenizer=tok)
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path)
    conversation = [
        {"role": "system", "content": "Give the answer in <answer></answer>."},
        {"role": "user", "content": "Ava has 12 coins and finds 30 more. How many?"},
        {"role": "assistant", "content": "<answer>42</answer>"},
    ]
    text = tok.apply_chat_template(conversation, tokenize=False)
    assert loaded.apply_chat_template(conversation, tokenize=False) == text
    assert "<|assistant|><answer>42</answer><|end|>" in text
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert loaded(text, add_special_tokens=False)["input_ids"] == ids
    assert loaded.decode(ids) == text
