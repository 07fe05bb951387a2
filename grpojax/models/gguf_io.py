"""GGUF checkpoints (llama.cpp's one-file format) as a model source.

A `.gguf` file holds a model's hyperparameters, its tokenizer (vocabulary, merges, special
ids, chat template) and its tensors, each stored as float32, float16, bfloat16 or one of
llama.cpp's block quantisations (Q4_0, Q4_1, Q8_0, the K-quants, ...). grpojax reads it as
it reads a Hugging Face directory:

- `find_gguf(source)`: the file `source` names (itself, or the one `*.gguf` in a directory
  without a config.json), or None for anything else.
- `open_gguf(file)`: the file parsed once (cached by path, size and modification time):
  `hf_config` is the `config.json` dict transformers would build from its metadata, and
  `handles()` maps each Hugging Face tensor name to a reader that dequantizes the GGUF
  tensor (`gguf.quants.dequantize`, float32) into Hugging Face's layout on demand, one
  tensor at a time, so `grpojax.models.from_pretrained` loads it layer by layer.
- `eos_ids(file)`: the ids that end a turn (the tokenizer's eos, and eot / eom where the
  file names them).

Layout. GGUF lists a tensor's dimensions fastest first, so a `[ne0, ne1]` tensor is numpy's
`[ne1, ne0]`, Hugging Face's `[out, in]`. llama.cpp's converter reorders the rows of a Llama
query and key projection within each head from the half-split rotary layout to interleaved
pairs; `_unpermute` undoes it (row `h*H + 2j + s` of the file is row `h*H + s*H/2 + j` of
Hugging Face's, for head `h`, pair `j < H/2`, half `s`); Qwen2/Qwen3 files keep Hugging
Face's order. The tokenizer is transformers' conversion of the file's
(`AutoTokenizer.from_pretrained(dir, gguf_file=name)`, `grpojax.models.load_tokenizer`).

Supported: architectures `SUPPORTED_ARCHITECTURES`, tensor types `supported_types()`. A
file that is not GGUF, is truncated, holds another architecture, an unsupported tensor type,
rope scaling, or no tokenizer is a `grpojax.errors.UserError` naming the file and what is
supported; nothing is written.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
from collections.abc import Callable
from typing import Any

import numpy as np

from grpojax.errors import MissingPathError, UserError, one_line

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "GGUFCheckpoint",
    "eos_ids",
    "find_gguf",
    "open_gguf",
    "supported_types",
]

SUFFIX = ".gguf"
# GGUF `general.architecture` -> transformers' model_type.
SUPPORTED_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_ARCH_CLASS = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# Architectures whose query/key rows llama.cpp's converter permutes (`_unpermute`).
_PERMUTED = ("llama",)

# GGUF tensor name -> Hugging Face's ("{i}": the layer).
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def supported_types() -> tuple[str, ...]:
    """The GGUF tensor types grpojax dequantizes: those `gguf.quants.dequantize` knows."""
    from gguf import GGMLQuantizationType, quants

    return ("F32", "F16", *(t.name for t in quants._type_traits if t != GGMLQuantizationType.F32))


def find_gguf(source: str | os.PathLike) -> pathlib.Path | None:
    """The GGUF file `source` names: `source` itself when it is a `*.gguf` file, the one
    `*.gguf` file of a directory without a config.json; None otherwise (a Hugging Face
    directory, a Hub id, a missing path).

    Raises:
      MissingPathError: `source` ends in .gguf but is not a file.
      UserError: a directory without config.json holds several `*.gguf` files.
    """
    path = pathlib.Path(source).expanduser()
    if path.suffix.lower() == SUFFIX:
        if not path.is_file():
            raise MissingPathError(f"GGUF file not found: {path}")
        return path
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(p for p in path.iterdir() if p.suffix.lower() == SUFFIX and p.is_file())
    if len(files) > 1:
        names = ", ".join(p.name for p in files)
        raise UserError(f"{path} holds {len(files)} GGUF files ({names}): name one of them")
    return files[0] if files else None


@dataclasses.dataclass(frozen=True)
class _Reader:
    """One GGUF tensor read as a Hugging Face tensor (the `safe_open` handle's methods
    `grpojax.models.hf_io` uses): dequantized to float32, in HF's layout."""

    tensor: Any  # gguf.ReaderTensor
    shape: tuple[int, ...]  # Hugging Face's
    fix: Callable[[np.ndarray], np.ndarray]

    def get_tensor(self, _name=None) -> np.ndarray:
        from gguf import quants

        array = quants.dequantize(self.tensor.data, self.tensor.tensor_type)
        return self.fix(np.asarray(array, np.float32).reshape(self.shape))

    def get_slice(self, _name=None):
        return self

    def get_shape(self) -> list[int]:
        return list(self.shape)


def _unpermute(heads: int) -> Callable[[np.ndarray], np.ndarray]:
    """llama.cpp's interleaved-pair rows of a `[heads*H, D]` projection back to Hugging
    Face's half-split rotary rows (module docstring)."""

    def fix(w: np.ndarray) -> np.ndarray:
        rows, rest = w.shape[0], w.shape[1:]
        half = rows // heads // 2
        return w.reshape(heads, half, 2, *rest).swapaxes(1, 2).reshape(rows, *rest)

    return fix


def _identity(w: np.ndarray) -> np.ndarray:
    return w


@dataclasses.dataclass(frozen=True)
class GGUFCheckpoint:
    """A parsed GGUF file (`open_gguf`).

    Attributes:
      path: the file.
      architecture: `general.architecture` (one of `SUPPORTED_ARCHITECTURES`).
      hf_config: the Hugging Face `config.json` dict of its metadata.
      metadata: every key-value field but the tokenizer's vocabulary arrays.
    """

    path: pathlib.Path
    architecture: str
    hf_config: dict[str, Any]
    metadata: dict[str, Any]
    _tensors: dict[str, Any]  # GGUF name -> gguf.ReaderTensor

    def handles(self) -> dict[str, _Reader]:
        """Hugging Face tensor name -> its reader, for every tensor of the file."""
        cfg = self.hf_config
        permuted = self.architecture in _PERMUTED
        fixes = {
            "self_attn.q_proj.weight": _unpermute(cfg["num_attention_heads"]),
            "self_attn.k_proj.weight": _unpermute(cfg["num_key_value_heads"]),
        }
        out = {}
        for name, tensor in self._tensors.items():
            hf = _hf_name(name)
            assert hf is not None  # checked by open_gguf
            fix = fixes.get(hf.split(".", 3)[-1], _identity) if permuted else _identity
            shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
            out[hf] = _Reader(tensor, shape, fix)
        return out


def _hf_name(name: str) -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    return None


# Tokenizer fields too large to keep as Python values (the vocabulary and merges).
_BULKY = (
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.scores",
)


def _metadata(reader) -> dict[str, Any]:
    out = {}
    for key, field in reader.fields.items():
        if key in _BULKY or key.startswith("GGUF."):
            continue
        out[key] = field.contents()
    return out


def open_gguf(path: str | os.PathLike) -> GGUFCheckpoint:
    """Parse the GGUF file at `path` (the header, metadata and tensor index; tensor data is
    memory-mapped and read on demand), checked: a supported architecture, a tokenizer, every
    tensor a known name and a supported type. Cached by path, size and modification time.

    Raises:
      MissingPathError: no such file.
      UserError: not a GGUF file, truncated, or unsupported (module docstring), naming it.
    """
    path = pathlib.Path(path).expanduser().resolve()
    if not path.is_file():
        raise MissingPathError(f"GGUF file not found: {path}")
    stat = path.stat()
    return _open(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _open(path_str: str, _size: int, _mtime: int) -> GGUFCheckpoint:
    path = pathlib.Path(path_str)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise UserError(f"{path} is not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path, "r")
    except Exception as e:  # gguf raises ValueError, IndexError, ... on a bad or short file
        raise UserError(
            f"cannot read the GGUF file {path} (corrupt or truncated?): "
            f"{type(e).__name__}: {one_line(e)}"
        ) from None
    meta = _metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UserError(
            f"{path}: unsupported GGUF architecture {arch!r}; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if "tokenizer.ggml.tokens" not in reader.fields or "tokenizer.ggml.model" not in meta:
        raise UserError(
            f"{path} holds no tokenizer (no tokenizer.ggml.model / tokenizer.ggml.tokens): "
            "grpojax reads the tokenizer and chat template from the GGUF file itself; use a "
            "GGUF written with its tokenizer (llama.cpp's convert_hf_to_gguf.py writes it)"
        )
    tensors = {}
    known = set(supported_types())
    for t in reader.tensors:
        if _hf_name(t.name) is None and t.name != "rope_freqs.weight":
            raise UserError(f"{path}: unexpected tensor {t.name!r} for architecture {arch!r}")
        if t.tensor_type.name not in known:
            raise UserError(
                f"{path}: tensor {t.name} has type {t.tensor_type.name}, which grpojax cannot "
                f"dequantize; supported: {', '.join(sorted(known))}"
            )
        tensors[t.name] = t
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    hf_config = _hf_config(path, arch, meta, vocab, tensors)
    return GGUFCheckpoint(path, arch, hf_config, meta, tensors)


def _hf_config(path, arch: str, meta: dict, vocab: int, tensors: dict) -> dict[str, Any]:
    """The Hugging Face config.json dict of a GGUF file's metadata (llama.cpp's keys)."""

    def get(key, default=None, *, required=False):
        value = meta.get(f"{arch}.{key}", default)
        if required and value is None:
            raise UserError(f"{path}: the GGUF metadata lacks {arch}.{key}")
        return value

    scaling = get("rope.scaling.type")
    if "rope_freqs.weight" in tensors or scaling not in (None, "none"):
        what = (
            f"rope.scaling.type={scaling!r}"
            if scaling not in (None, "none")
            else ("rope_freqs.weight (Llama 3.1's rope scaling)")
        )
        raise UserError(
            f"{path}: rope scaling ({what}) is not supported from GGUF files; "
            "load the Hugging Face checkpoint instead"
        )
    heads = int(get("attention.head_count", required=True))
    hidden = int(get("embedding_length", required=True))
    cfg: dict[str, Any] = {
        "architectures": [_ARCH_CLASS[arch]],
        "model_type": SUPPORTED_ARCHITECTURES[arch],
        "vocab_size": int(get("vocab_size", vocab)),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length", required=True)),
        "num_hidden_layers": int(get("block_count", required=True)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "dtype": "float32",
    }
    for key, hf in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("padding", "pad_token_id")):
        value = meta.get(f"tokenizer.ggml.{key}_token_id")
        if value is not None:
            cfg[hf] = int(value)
    return cfg


# The ids that end a turn: the eos, and the end-of-turn / end-of-message ids llama.cpp writes
# for chat models (Llama 3's <|eot_id|> and <|eom_id|>).
_EOS_KEYS = (
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id",
)


def eos_ids(path: str | os.PathLike) -> tuple[int, ...]:
    """Every id the GGUF file at `path` declares as ending a turn, sorted, no repeats."""
    meta = open_gguf(path).metadata
    return tuple(sorted({int(meta[k]) for k in _EOS_KEYS if meta.get(k) is not None}))
