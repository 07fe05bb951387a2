"""Tiny GGUF files written at test time, as llama.cpp's converter writes them.

`bpe_vocab()`: a byte-level BPE trained on a few sentences (tokens in id order, merges, the
ChatML special tokens first). `write_gguf(path, hf_model, ...)`: a transformers causal LM's
weights under llama.cpp's tensor names (a Llama's query and key rows permuted to interleaved
rotary pairs, as its converter does), each 2-D weight stored as `qtype` (float32, or a block
quantisation made by `gguf.quants.quantize`), with the hyperparameters, the tokenizer and
a chat template in the metadata.
"""

from __future__ import annotations

import functools
import json

import numpy as np

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
    "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2
VOCAB = 320  # bpe_vocab()'s size
TEXT = [
    "What is 12 + 34? Reply with only the number.",
    "The quick brown fox jumps over the lazy dog.",
    "Name three colors: red, green and blue.",
    "Write a haiku about the sea and the sky at night.",
] * 4

_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


@functools.cache
def bpe_vocab(vocab_size: int = VOCAB) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(tokens in id order, merges as "a b"): a byte-level BPE over `TEXT`, `SPECIALS`
    first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TEXT, trainer)
    model = json.loads(tok.to_str())["model"]
    vocab = model["vocab"]
    tokens = tuple(sorted(vocab, key=vocab.get))
    merges = tuple(m if isinstance(m, str) else " ".join(m) for m in model["merges"])
    return tokens, merges


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """Hugging Face's half-split rotary rows -> llama.cpp's interleaved pairs."""
    rows, rest = w.shape[0], w.shape[1:]
    return w.reshape(heads, 2, rows // heads // 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


def gguf_tensors(hf_model, arch: str) -> dict[str, np.ndarray]:
    """llama.cpp's name -> float32 array of every weight of `hf_model` (GGUF's row order)."""
    cfg = hf_model.config
    out = {}
    for name, value in hf_model.state_dict().items():
        w = value.detach().float().numpy()
        if name in _GLOBAL:
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            out[_GLOBAL[name]] = w
            continue
        i, suffix = name.removeprefix("model.layers.").split(".", 1)
        if arch == "llama" and suffix == "self_attn.q_proj.weight":
            w = _permute(w, cfg.num_attention_heads)
        if arch == "llama" and suffix == "self_attn.k_proj.weight":
            w = _permute(w, cfg.num_key_value_heads)
        out[f"blk.{i}.{_LAYER[suffix]}"] = w
    return out


def write_gguf(
    path,
    hf_model,
    arch: str,
    *,
    qtype: str = "F32",
    tokenizer: bool = True,
    chat_template: str = CHATML,
    tensors: dict[str, np.ndarray] | None = None,
    raw_types: dict[str, str] | None = None,
    metadata=None,
):
    """Write `hf_model` (a transformers Llama, Qwen2 or Qwen3 causal LM) to GGUF `path`.

    qtype: the type of every 2-D weight ("F32", "F16", "Q8_0", "Q4_1", ...); norms and
    biases stay float32. tokenizer: write `bpe_vocab()` (its size must be the model's
    vocabulary) and `chat_template`. tensors / raw_types: write these arrays instead, stored
    as the named types (for malformed files). metadata: a callable given the writer, to add
    or change fields.
    """
    import gguf
    from gguf import GGMLQuantizationType as Q

    cfg = hf_model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    if tokenizer:
        tokens, merges = bpe_vocab()
        assert len(tokens) == cfg.vocab_size, (len(tokens), cfg.vocab_size)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(list(tokens))
        w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
        w.add_token_merges(list(merges))
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_pad_token_id(2)
        w.add_unk_token_id(0)
        w.add_add_bos_token(False)
        w.add_chat_template(chat_template)
    if metadata is not None:
        metadata(w)
    arrays = gguf_tensors(hf_model, arch) if tensors is None else tensors
    for name, a in arrays.items():
        kind = (raw_types or {}).get(name) or (qtype if a.ndim == 2 else "F32")
        t = Q[kind]
        if kind == "F32":
            w.add_tensor(name, np.ascontiguousarray(a, np.float32))
        elif kind in ("F16", "F64"):  # stored as numpy's own type
            w.add_tensor(
                name, np.ascontiguousarray(a, {"F16": np.float16, "F64": np.float64}[kind])
            )
        else:
            w.add_tensor(name, gguf.quants.quantize(a.astype(np.float32), t), raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def hf_model(arch: str, *, tie: bool = False, seed: int = 0):
    """A random 2-layer transformers causal LM over `bpe_vocab()`, weights large enough that
    every one shows in the logits."""
    import torch
    import transformers

    torch.manual_seed(seed)
    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
        tie_word_embeddings=tie, rope_theta=10000.0, rms_norm_eps=1e-5,
    )  # fmt: skip
    config = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }[arch](**common)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    with torch.no_grad():  # larger than the 0.02 init: every weight shows in the logits
        for name, p in model.named_parameters():
            if p.ndim > 1:
                p.mul_(10.0)
            elif "bias" in name:
                p.normal_(0.0, 0.5)
            else:  # norms
                p.normal_(1.0, 0.2)
    return model


def bad_gguf_files(tmp_path):
    """Malformed GGUF files in `tmp_path`: name -> (path, substrings of the error)."""
    import gguf

    hf = hf_model("llama")
    good = write_gguf(tmp_path / "good.gguf", hf, "llama", qtype="Q8_0")
    data = good.read_bytes()
    out = {}
    (tmp_path / "notgguf.gguf").write_bytes(b"PK\x03\x04" + data[4:200])
    out["not_gguf"] = (tmp_path / "notgguf.gguf", ["not a GGUF file"])
    (tmp_path / "truncated.gguf").write_bytes(data[: len(data) // 2])
    out["truncated"] = (tmp_path / "truncated.gguf", ["truncated"])
    (tmp_path / "header.gguf").write_bytes(data[:40])
    out["header_only"] = (tmp_path / "header.gguf", ["truncated"])
    tensors = gguf_tensors(hf, "llama")
    tensors["blk.0.ffn_up.weight"] = tensors["blk.0.ffn_up.weight"].astype(np.float64)
    out["quant_type"] = (
        write_gguf(tmp_path / "f64.gguf", hf, "llama", tensors=tensors,
                   raw_types={"blk.0.ffn_up.weight": "F64"}),
        ["blk.0.ffn_up.weight", "F64", "supported: ", "Q4_1"],
    )  # fmt: skip
    out["no_tokenizer"] = (
        write_gguf(tmp_path / "notok.gguf", hf, "llama", tokenizer=False),
        ["no tokenizer"],
    )
    out["architecture"] = (
        write_gguf(tmp_path / "phi3.gguf", hf, "phi3"),
        ["unsupported GGUF architecture 'phi3'", "llama, qwen2, qwen3"],
    )
    out["rope_scaling"] = (
        write_gguf(
            tmp_path / "yarn.gguf", hf, "llama",
            metadata=lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.YARN),
        ),
        ["rope scaling", "yarn"],
    )  # fmt: skip
    return out
