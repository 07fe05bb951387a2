"""LoRA export parity with peft + transformers (PyTorch).

A tiny random Llama / Qwen2 / Qwen3 checkpoint is built with transformers, loaded in grpojax,
given random nonzero adapters on every layer target (and, on the untied models, on the LM
head too), and exported two ways:
`save_lora_adapter` (PEFT format), loaded with `peft.PeftModel.from_pretrained(base, dir)`,
and `save_pretrained` (merged W + (alpha/r) A B), loaded with transformers. Both must give
grpojax's LoRA logits within 1e-4 (float32, max abs over real tokens of a left-padded batch).
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from flax import nnx
from safetensors.numpy import load_file
from test_models_hf import _batch, _hf_logits, _hf_model

import grpojax.models as gm
from grpojax.errors import UserError
from grpojax.models import lora

peft = pytest.importorskip("peft")

TOL = 1e-4  # max abs logit difference, float32, as the issue specifies

CASES = {
    "llama_untied_gqa": dict(kind="llama"),
    "qwen2_bias_tied": dict(kind="qwen2", tie=True),
    "qwen2_bias_untied": dict(kind="qwen2"),
    "qwen3_head_dim_ne": dict(kind="qwen3", head_dim=16),
}
LAYER_MODULES = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def _randomize_adapters(model, seed, scale=0.1):
    rng = np.random.default_rng(seed)
    for name in model.lora.names():
        var = getattr(model.lora, name)
        var.set_value(jnp.asarray(scale * rng.standard_normal(var.shape), jnp.float32))


def _gj_logits(model, tokens, mask):
    return np.asarray(gm.forward_logits(model, jnp.asarray(tokens), jnp.asarray(mask)))


@pytest.mark.parametrize("case", sorted(CASES))
def test_peft_adapter_and_merged_export_match_grpojax(case, tmp_path):
    hf = _hf_model(**CASES[case], seed=len(case))
    src = tmp_path / "base"
    hf.save_pretrained(src, safe_serialization=True)
    tokens, mask = _batch(seed=2)

    model = gm.from_pretrained(src)
    head = not CASES[case].get("tie", False)  # lm_head is refused on a tied model
    targets = lora.TARGET_NAMES if head else lora.ALL_TARGETS
    lora.add_lora(model, lora.LoRAConfig(rank=4, alpha=12.0, targets=targets), rngs=nnx.Rngs(0))
    _randomize_adapters(model, seed=1)
    got = _gj_logits(model, tokens, mask)
    with lora.adapters_off(model):
        base_gj = _gj_logits(model, tokens, mask)
    assert np.abs(got - base_gj)[mask].max() > 0.1  # the adapters matter at this scale

    adapter_dir = tmp_path / "adapter"
    gm.save_lora_adapter(model, adapter_dir, base_model_name_or_path=str(src))
    cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4 and cfg["lora_alpha"] == 12.0
    assert set(cfg["target_modules"]) == LAYER_MODULES | ({"lm_head"} if head else set())
    tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
    d, f = hf.config.hidden_size, hf.config.intermediate_size
    q_out = hf.config.num_attention_heads * (CASES[case].get("head_dim") or d // 4)
    stem = "base_model.model.model.layers.1"
    assert tensors[f"{stem}.self_attn.q_proj.lora_A.weight"].shape == (4, d)
    assert tensors[f"{stem}.self_attn.q_proj.lora_B.weight"].shape == (q_out, 4)
    assert tensors[f"{stem}.self_attn.o_proj.lora_A.weight"].shape == (4, q_out)
    assert tensors[f"{stem}.mlp.down_proj.lora_A.weight"].shape == (4, f)
    assert len(tensors) == 2 * 7 * hf.config.num_hidden_layers + (2 if head else 0)
    if head:
        v = hf.config.vocab_size
        assert tensors["base_model.model.lm_head.lora_A.weight"].shape == (4, d)
        assert tensors["base_model.model.lm_head.lora_B.weight"].shape == (v, 4)

    base_hf = _hf_model(**CASES[case], seed=len(case))  # a fresh copy (PEFT wraps in place)
    peft_model = peft.PeftModel.from_pretrained(base_hf, str(adapter_dir)).eval()
    # Every adapter tensor was loaded (none left at PEFT's init): compare state dicts.
    # (save_embedding_layers=False: with lm_head targeted PEFT would add the base head's own
    # weight, which the adapter file leaves to the base checkpoint.)
    loaded = peft.get_peft_model_state_dict(peft_model, save_embedding_layers=False)
    assert set(loaded) == set(tensors)
    for name, value in tensors.items():
        np.testing.assert_array_equal(loaded[name].numpy(), value)
    peft_err = np.abs(_hf_logits(peft_model, tokens, mask) - got)[mask].max()

    merged_dir = tmp_path / "merged"
    gm.save_pretrained(model, merged_dir)
    merged_hf = transformers.AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    merged_err = np.abs(_hf_logits(merged_hf, tokens, mask) - got)[mask].max()
    print(f"{case}: peft {peft_err:.2e}, merged {merged_err:.2e}")
    assert peft_err <= TOL
    assert merged_err <= TOL

    # Under adapters_off, save_pretrained writes the base weights unchanged.
    base_dir = tmp_path / "base_again"
    with lora.adapters_off(model):
        gm.save_pretrained(model, base_dir)
    again = gm.from_pretrained(base_dir)
    np.testing.assert_array_equal(_gj_logits(again, tokens, mask), base_gj)


def test_save_adapter_needs_adapters(tmp_path):
    model = gm.Decoder(gm.tiny_config(num_layers=1), rngs=nnx.Rngs(0))
    with pytest.raises(UserError, match="no LoRA adapters"):
        gm.save_lora_adapter(model, tmp_path / "x")
