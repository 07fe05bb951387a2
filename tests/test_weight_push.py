"""The shared-memory weight push (`grpojax.sampling.weight_push.SharedWeights`) against
`save_pretrained`'s own tensors (the checkpoint file the push replaces): every HF tensor
read through the buffer's strided views equals, bit for bit, the array the file route
writes, for a tied and an untied head, q/k/v biases, q/k norms, Gemma's extra norms,
Mixture-of-Experts layers (a tensor per expert), merged LoRA adapters, bfloat16, and one or
many buckets; buckets split between decoder layers, put the embedding, the final norm and
an untied head together last, and stay within their size unless one unit is larger."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from model_fixtures import scrambled

import grpojax.models as gm
from grpojax.models.hf_io import _decoder_tensors
from grpojax.sampling.weight_push import SharedWeights

SMALL = dict(hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4, num_kv_heads=2,
             head_dim=8, vocab_size=96)  # fmt: skip
CONFIGS = {
    "qwen3_untied": gm.tiny_config(**SMALL),
    "qwen2_tied_bias": gm.tiny_config(
        **SMALL, model_type="qwen2", qkv_bias=True, qk_norm=False, tie_word_embeddings=True
    ),
    "qwen3_moe": gm.tiny_config(
        **SMALL,
        model_type="qwen3_moe",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
    ),
    "gemma3": gm.tiny_config(**SMALL, model_type="gemma3_text", tie_word_embeddings=True),
}


def _read(w: SharedWeights, tensors) -> dict[str, np.ndarray]:
    """What the reader builds (`torch.as_strided(flat, shape, strides, offset)`), in NumPy."""
    flat = w.buffer.view(w.dtype)
    item = w.dtype.itemsize
    return {
        name: np.lib.stride_tricks.as_strided(
            flat[offset:], shape, [s * item for s in strides]
        ).copy()
        for name, shape, strides, offset in tensors
    }


def _push(model, path, **kw) -> tuple[SharedWeights, dict[str, np.ndarray]]:
    w = SharedWeights(path, model, **kw)
    got = {}
    for k in range(len(w.buckets)):
        got |= _read(w, w.fill(model, k))
    return w, got


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("bucket_bytes", [2**30, 1])
def test_the_buffers_views_are_the_checkpoints_tensors(name, bucket_bytes, tmp_path):
    model = scrambled(CONFIGS[name], 3)
    w, got = _push(model, tmp_path / "w.bin", dtype="float32", bucket_bytes=bucket_bytes)
    want = dict(_decoder_tensors(model, np.float32, with_lm_head=True))
    assert sorted(got) == sorted(want)
    for n in want:
        np.testing.assert_array_equal(got[n], want[n], err_msg=n)
    layers = model.config.num_layers
    assert len(w.buckets) == (1 if bucket_bytes == 2**30 else layers + 1)
    w.close()
    assert not (tmp_path / "w.bin").exists()


def test_buckets_split_between_layers_and_end_with_the_global_tensors(tmp_path):
    model = scrambled(CONFIGS["qwen3_untied"], 0)
    per_layer = sum(
        int(np.prod(v[...].shape[1:])) * 4
        for k, v in model.named_params().items()
        if k.startswith("layers.")
    )
    w = SharedWeights(tmp_path / "w.bin", model, dtype="float32", bucket_bytes=2 * per_layer)
    layer_of = [
        sorted({int(n.split(".")[2]) for n in b.names if n.startswith("model.layers.")})
        for b in w.buckets
    ]
    assert layer_of == [[0, 1], [2]]  # two layers fit a bucket, a layer is never split
    assert w.buckets[-1].names[-3:] == ("model.embed_tokens.weight", "model.norm.weight",
                                        "lm_head.weight")  # fmt: skip
    assert all(b.nbytes <= 2 * per_layer for b in w.buckets)
    assert w.nbytes == max(b.nbytes for b in w.buckets)
    small = SharedWeights(tmp_path / "s.bin", model, dtype="float32", bucket_bytes=1)
    assert [len(b.names) for b in small.buckets] == [11, 11, 11, 3]  # one unit each
    small.close()
    w.close()


def test_merged_lora_and_bfloat16_are_what_the_file_holds(tmp_path):
    model = scrambled(CONFIGS["qwen3_untied"], 1)
    targets = ("q", "k", "v", "o", "gate", "up", "down", "lm_head")
    gm.add_lora(model, gm.LoRAConfig(rank=4, alpha=8.0, targets=targets), rngs=nnx.Rngs(2))
    rng = np.random.default_rng(0)
    for n, v in model.named_params().items():
        if n.startswith("lora.") and n.endswith("_b"):  # B != 0: the delta counts
            v.set_value(jnp.asarray(0.05 * rng.standard_normal(v[...].shape), jnp.float32))
    for dtype, np_dtype in (("float32", np.float32), ("bfloat16", ml_dtypes.bfloat16)):
        w, got = _push(model, tmp_path / f"{dtype}.bin", dtype=dtype, bucket_bytes=1)
        want = dict(_decoder_tensors(model, np_dtype, with_lm_head=True))
        assert sorted(got) == sorted(want)
        for n in want:
            assert got[n].dtype == np_dtype
            np.testing.assert_array_equal(got[n], want[n], err_msg=n)
        w.close()
    with gm.adapters_off(model):  # the base weights alone, as save_pretrained writes them
        w, got = _push(model, tmp_path / "base.bin", dtype="float32", bucket_bytes=2**30)
        want = dict(_decoder_tensors(model, np.float32, with_lm_head=True))
        for n in want:
            np.testing.assert_array_equal(got[n], want[n], err_msg=n)
        w.close()
