"""The sampler on a tiny random Qwen2 built with transformers (torch CPU), saved and loaded
through grpojax.models.from_pretrained: greedy decode vs full forwards (grpojax and torch)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from grpojax.models import from_pretrained
from grpojax.sampling import SamplingConfig, generate

T_NEW = 6


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        rope_theta=10000.0,
    )
    hf = transformers.Qwen2ForCausalLM(cfg).to(torch.float32).eval()
    # Larger weights than the default 0.02 init give decisive argmaxes (no near-ties).
    with torch.no_grad():
        for p in hf.parameters():
            if p.ndim > 1:
                p.mul_(10.0)
    path = tmp_path_factory.mktemp("qwen2")
    hf.save_pretrained(path, safe_serialization=True)
    return path, hf


def test_greedy_on_loaded_qwen2_equals_full_forward_argmax(qwen2_dir):
    path, hf = qwen2_dir
    model = from_pretrained(path, dtype="float32")
    rng = np.random.default_rng(0)
    lengths = np.array([5, 9, 3], np.int32)
    prompts = np.zeros((3, 9), np.int32)
    for b, n in enumerate(lengths):
        prompts[b, 9 - n :] = rng.integers(1, 128, size=n)
    r = generate(
        model,
        prompts,
        lengths,
        key=jax.random.key(0),
        max_new_tokens=T_NEW,
        group_size=2,
        sampling=SamplingConfig(temperature=0.0),
    )
    out = np.asarray(r.tokens_nt)
    graphdef, state = nnx.split(model)

    @jax.jit
    def full_logits(state, tokens):
        m = nnx.merge(graphdef, state)
        hidden, _ = m(tokens)
        return m.logits(hidden)[0]

    # Causal attention makes one full forward over prompt + completion equal to T_NEW
    # forwards over the growing prefix: position len - 1 + t sees exactly prompt + x_<t.
    for n in range(out.shape[0]):
        b = n // 2
        prompt = prompts[b, 9 - lengths[b] :]
        seq = np.concatenate([prompt, out[n]])[None].astype(np.int32)
        z = np.asarray(full_logits(state, jnp.asarray(seq)))[lengths[b] - 1 : -1]
        np.testing.assert_array_equal(out[n], z.argmax(-1))  # grpojax, no cache, no padding
        with torch.no_grad():
            zt = hf(torch.tensor(seq, dtype=torch.long)).logits[0].numpy()[lengths[b] - 1 : -1]
        np.testing.assert_array_equal(out[n], zt.argmax(-1))  # transformers (torch)
