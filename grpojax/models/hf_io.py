"""Hugging Face checkpoint IO: config.json + safetensors in, and back out.

`from_pretrained` reads a local directory (one `model.safetensors`, or sharded
`*.safetensors` with `model.safetensors.index.json`), checks every tensor's name and
shape against the config before reading any data, then builds each parameter with
`jax.make_array_from_callback`: every device shard is read from the memory-mapped
files one layer tensor at a time and placed straight onto its device, so the host
never holds the whole model. HF Linear weights `[out, in]` become our `[in, ...]`
layouts (per-head axes split out) and per-layer tensors stack along `L`.
`save_pretrained` writes the same format back (load -> save -> load is exact), with a
generation_config.json (bos/eos/pad ids) beside config.json.

Value and reward models (`ValueModel`, `RewardModel`: a Decoder under a `ScalarHead`) go
out and back in as `*ForSequenceClassification` checkpoints (`save_sequence_classifier`,
`load_reward_model`, `load_value_model`): the backbone's tensors under `model.` exactly as
in the causal-LM file, no `lm_head`, and the head as `score.weight` `[1, D]`, with
`num_labels` 1. transformers' score layer has no bias; a nonzero head bias (a PPO critic's;
a Bradley-Terry reward model's bias gets no gradient and stays 0) is kept in config.json as
`grpojax_score_bias`, which grpojax reads back and transformers ignores, so transformers'
scores are then grpojax's minus that constant. transformers reads a sequence's score at
its last token that is not `pad_token_id`; grpojax's `RewardModel` reads it at the last
token of the mask: the two agree on right-padded rows whose last real token is not the pad
id (left-padded rows also need `position_ids` = cumsum(mask) - 1 in transformers).
Tokenizers and chat templates come from the same directory through
`transformers.AutoTokenizer.from_pretrained(path)` (`grpojax.models.load_tokenizer`).

A GGUF file (`gguf_io`) loads through the same path: its metadata gives the config.json
dict, its tensors are dequantized one at a time into Hugging Face's layout.

What a directory can get wrong (missing, no config.json, a malformed or unsupported
config, missing or unreadable weight files, missing or mis-shaped tensors) is a
`grpojax.errors.UserError` naming the directory or file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import re
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, cast

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, Sharding, SingleDeviceSharding

from grpojax.errors import MissingPathError, UserError
from grpojax.models import gguf_io, lora
from grpojax.models.config import ModelConfig
from grpojax.models.decoder import Decoder, RewardModel, ScalarHead, ValueModel
from grpojax.models.sharding import param_shardings
from grpojax.ops.checks import check_int

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
GENERATION_CONFIG_FILE = "generation_config.json"
SCORE_TENSOR = "score.weight"
SCORE_BIAS_KEY = "grpojax_score_bias"  # config.json: the head bias transformers has no slot for
HEAD_KIND_KEY = "grpojax_head"  # config.json: "reward" or "value"
_SEQ_CLS = "ForSequenceClassification"
# Buffers some older checkpoints carry that are recomputed from the config.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclasses.dataclass(frozen=True)
class _Tensor:
    """How one HF tensor maps onto (a layer slice of) one of our parameters."""

    param: str  # our parameter name (Decoder.named_params)
    hf_shape: tuple[int, ...]
    to_ours: Callable[[np.ndarray], np.ndarray]  # HF layout -> our per-layer layout
    to_hf: Callable[[np.ndarray], np.ndarray]  # our per-layer layout -> HF layout
    per_expert: bool = False  # one HF tensor per expert ("{e}" in the name): [L, E, ...]


# Gemma 3's image-text checkpoints (4B, 12B, 27B): the text model's tensors under one of these
# prefixes (files written by transformers 4.5x, 5.x), the vision tower's and the projector's
# beside them, not read.
_TEXT_TOWER_PREFIXES = ("language_model.model.", "model.language_model.")
_TEXT_TOWER_HEAD = "language_model.lm_head.weight"
_IMAGE_TEXT_TYPES = ("gemma3",)


def _text_tower_name(name: str) -> str | None:
    """An image-text checkpoint's tensor name as the text model's file names it (None: not
    the text model's)."""
    if name == _TEXT_TOWER_HEAD:
        return "lm_head.weight"
    for prefix in _TEXT_TOWER_PREFIXES:
        if name.startswith(prefix):
            return "model." + name[len(prefix) :]
    return (
        None
        if name.startswith(("model.", "language_model.", "vision_tower.", "multi_modal"))
        else name
    )


@dataclasses.dataclass(frozen=True)
class _Renamed:
    """A safetensors file's tensor read under the text model's name."""

    handle: Any
    name: str

    def get_tensor(self, _name):
        return self.handle.get_tensor(self.name)

    def get_slice(self, _name):
        return self.handle.get_slice(self.name)


_EXPERT_NAME = re.compile(r"(?P<block>\w+)\.experts\.(?P<e>\d+)\.(?P<rest>.+)")


def _identity(x):
    return x


def _layer_tensors(c: ModelConfig) -> dict[str, _Tensor]:
    """HF per-layer name suffix -> mapping (names follow LlamaForCausalLM / Qwen2 / Qwen3 /
    Gemma3ForCausalLM / Qwen3MoE / Mixtral)."""
    D, F, Q, K, H = c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim

    def proj_in(heads):  # HF [heads*H, D] -> ours [D, heads, H]
        return _Tensor(
            "",
            (heads * H, D),
            lambda w: w.T.reshape(D, heads, H),
            lambda w: w.reshape(D, heads * H).T,
        )

    def bias(heads):
        return _Tensor(
            "", (heads * H,), lambda b: b.reshape(heads, H), lambda b: b.reshape(heads * H)
        )

    def vec(n):
        return _Tensor("", (n,), _identity, _identity)

    def linear(out_dim, in_dim):  # HF [out, in] -> ours [in, out]
        return _Tensor("", (out_dim, in_dim), lambda w: w.T, lambda w: w.T)

    table = {
        "input_layernorm.weight": ("attn_norm", vec(D)),
        "self_attn.q_proj.weight": ("wq", proj_in(Q)),
        "self_attn.k_proj.weight": ("wk", proj_in(K)),
        "self_attn.v_proj.weight": ("wv", proj_in(K)),
        "self_attn.o_proj.weight": (
            "wo",
            _Tensor(
                "",
                (D, Q * H),
                lambda w: w.T.reshape(Q, H, D),
                lambda w: w.reshape(Q * H, D).T,
            ),
        ),
        "post_attention_layernorm.weight": ("mlp_norm", vec(D)),
        "mlp.gate_proj.weight": ("w_gate", linear(F, D)),
        "mlp.up_proj.weight": ("w_up", linear(F, D)),
        "mlp.down_proj.weight": ("w_down", linear(D, F)),
    }
    if c.is_gemma:  # Gemma's post_attention_layernorm norms the attention's output
        table["post_attention_layernorm.weight"] = ("post_attn_norm", vec(D))
        table["pre_feedforward_layernorm.weight"] = ("mlp_norm", vec(D))
        table["post_feedforward_layernorm.weight"] = ("post_mlp_norm", vec(D))
    if c.qkv_bias:
        table["self_attn.q_proj.bias"] = ("bq", bias(Q))
        table["self_attn.k_proj.bias"] = ("bk", bias(K))
        table["self_attn.v_proj.bias"] = ("bv", bias(K))
    if c.qk_norm:
        table["self_attn.q_norm.weight"] = ("q_norm", vec(H))
        table["self_attn.k_norm.weight"] = ("k_norm", vec(H))
    if c.is_moe:
        # Qwen3-MoE: mlp.gate (the router), mlp.experts.<e>.{gate,up,down}_proj; Mixtral:
        # block_sparse_moe.gate, block_sparse_moe.experts.<e>.{w1,w3,w2} (gate, up, down).
        E, Fe = c.num_experts, c.moe_intermediate_size
        for dense in ("gate_proj", "up_proj", "down_proj"):
            del table[f"mlp.{dense}.weight"]
        block, names = "mlp", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
        if c.model_type == "mixtral":
            block, names = "block_sparse_moe", {"gate": "w1", "up": "w3", "down": "w2"}
        table[f"{block}.gate.weight"] = ("w_router", linear(E, D))
        for name, shape in (("gate", (Fe, D)), ("up", (Fe, D)), ("down", (D, Fe))):
            t = dataclasses.replace(linear(*shape), per_expert=True)
            table[f"{block}.experts.{{e}}.{names[name]}.weight"] = (f"we_{name}", t)
    return {
        suffix: dataclasses.replace(t, param=f"layers.{name}")
        for suffix, (name, t) in table.items()
    }


def _global_tensors(c: ModelConfig) -> dict[str, _Tensor]:
    V, D = c.vocab_size, c.hidden_size
    out = {
        "model.embed_tokens.weight": _Tensor("embed", (V, D), _identity, _identity),
        "model.norm.weight": _Tensor("final_norm", (D,), _identity, _identity),
    }
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = _Tensor("lm_head", (V, D), lambda w: w.T, lambda w: w.T)
    return out


def _layer_names(config: ModelConfig):
    """(HF name, suffix pattern) of every per-layer tensor, in save order (a per-expert
    pattern's experts 0..E-1 in turn)."""
    table = _layer_tensors(config)
    for i in range(config.num_layers):
        for suffix, t in table.items():
            for e in range(config.num_experts) if t.per_expert else (None,):
                yield f"model.layers.{i}.{suffix.format(e=e)}", suffix


def hf_tensor_names(config: ModelConfig) -> list[str]:
    """Every tensor name a checkpoint of this config holds, in save order."""
    names = ["model.embed_tokens.weight"]
    names += [name for name, _ in _layer_names(config)]
    names.append("model.norm.weight")
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


def _expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    shapes = {n: t.hf_shape for n, t in _global_tensors(config).items()}
    table = _layer_tensors(config)
    for name, suffix in _layer_names(config):
        shapes[name] = table[suffix].hf_shape
    return shapes


# ----------------------------------------------------------------------------- loading


def _check_dir(path: pathlib.Path) -> None:
    if not path.is_dir():
        raise MissingPathError(f"checkpoint directory not found: {path}")
    if not (path / CONFIG_FILE).is_file():
        raise MissingPathError(f"no {CONFIG_FILE} in checkpoint directory {path}")


def _read_hf_config(path: pathlib.Path) -> dict:
    file = path / CONFIG_FILE
    try:
        cfg = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise UserError(f"{file} must hold a JSON object, got {type(cfg).__name__}")
    return cfg


def load_config(path: str | os.PathLike, **overrides) -> ModelConfig:
    """`ModelConfig` from `<path>/config.json`, or from a GGUF file's metadata (`path` a
    `.gguf` file or a directory holding one, `gguf_io.find_gguf`); `overrides` replace
    fields (e.g. dtype).

    A missing, malformed or unsupported config is a `UserError` naming the file.
    """
    path = pathlib.Path(path)
    gguf_file = gguf_io.find_gguf(path)
    if gguf_file is not None:
        cfg, where = gguf_io.open_gguf(gguf_file).hf_config, gguf_file
    else:
        _check_dir(path)
        cfg, where = _read_hf_config(path), path / CONFIG_FILE
    try:
        return ModelConfig.from_hf(cfg, **overrides)
    except KeyError as e:
        raise UserError(f"{where} lacks the key {e}") from None
    except (TypeError, ValueError) as e:
        raise UserError(f"{where}: {e}") from None


def _weight_files(path: pathlib.Path) -> list[pathlib.Path]:
    if (path / INDEX_FILE).is_file():
        with open(path / INDEX_FILE) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        for name in files:
            if not (path / name).is_file():
                raise MissingPathError(f"{INDEX_FILE} lists {name}, missing from {path}")
        return [path / name for name in files]
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise MissingPathError(f"no *.safetensors weights in checkpoint directory {path}")
    return files


def _default_dtype(path: pathlib.Path) -> str:
    cfg = _read_hf_config(path)
    stored = cfg.get("dtype") or cfg.get("torch_dtype")
    return "bfloat16" if stored == "bfloat16" else "float32"


def from_pretrained(
    path: str | os.PathLike,
    *,
    dtype: str | None = None,
    param_dtype: str = "float32",
    mesh: Mesh | None = None,
    **config_overrides,
) -> Decoder:
    """Load a local HF checkpoint directory, or a GGUF file, into a `Decoder`.

    Mixed precision: the parameters are stored in `param_dtype` (float32 by default,
    whatever the checkpoint's dtype: a bf16 checkpoint is upcast exactly, so training
    updates far below a bf16 ulp of the weight are not rounded away) and the model computes
    in `dtype`.

    Args:
      path: directory with config.json and model.safetensors, or sharded
        `*.safetensors` + model.safetensors.index.json; or a `.gguf` file (or a directory
        holding one and no config.json), its tensors dequantized (`gguf_io`).
      dtype: compute dtype, "float32" or "bfloat16"; None takes the checkpoint's dtype
        when it is bfloat16 and float32 otherwise (float32 for a GGUF file).
      param_dtype: parameter storage dtype, "float32" (the default: float32 masters) or
        "bfloat16" (half the memory, for inference or a frozen copy).
      mesh: a (data, fsdp, tensor) mesh; each parameter is placed on it with its
        partition spec (`sharding.PARAM_AXES`). None: the default device.
      config_overrides: other `ModelConfig` fields (e.g. remat="full").

    Raises `grpojax.errors.MissingPathError` (a FileNotFoundError) naming a missing
    directory/config/weights file, and `grpojax.errors.UserError` (a ValueError) naming an
    unreadable weights file or missing, unexpected or mis-shaped tensors.
    """
    path = pathlib.Path(path)
    if gguf_io.find_gguf(path) is None:
        _check_dir(path)
        if _is_sequence_classifier(_read_hf_config(path)):
            raise UserError(
                f"{path} is a sequence-classification checkpoint (a reward or value model), "
                "not a causal LM: load it with grpojax.models.load_reward_model / "
                "load_value_model"
            )
    dtype = dtype or ("float32" if gguf_io.find_gguf(path) else _default_dtype(path))
    config = load_config(path, dtype=dtype, param_dtype=param_dtype, **config_overrides)
    model, _ = _load_decoder(path, config, mesh, extra={})
    return model


def _load_decoder(path: pathlib.Path, config: ModelConfig, mesh, *, extra: dict):
    """(Decoder with the directory's weights, {name: np.ndarray} of the `extra` tensors).

    `extra` maps further tensor names the directory must hold to their HF shapes."""
    expected = {**_expected_shapes(config), **extra}
    with contextlib.ExitStack() as stack:
        handle_of, where = _weight_handles(path, stack)
        try:
            _validate(config, expected, handle_of)
        except ValueError as e:
            raise UserError(f"{where}: {e}") from None

        model = nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0)))
        if mesh is None:
            device = SingleDeviceSharding(jax.local_devices()[0])
            shardings: Mapping[str, Sharding] = {name: device for name in model.named_params()}
        else:
            shardings = param_shardings(model, mesh)
        params = model.named_params()
        sources = _param_sources(config)
        for name, var in params.items():
            array = jax.make_array_from_callback(
                tuple(var.shape),
                shardings[name],
                _reader(
                    sources[name],
                    handle_of,
                    config.params_dtype,
                    config.num_layers,
                    config.num_experts,
                ),
            )
            var.set_value(array)
        extras = {name: handle_of[name].get_tensor(name) for name in extra}
    return model, extras


def _weight_handles(path: pathlib.Path, stack: contextlib.ExitStack):
    """({HF tensor name: a handle with `get_tensor` / `get_slice`}, what to call the
    checkpoint in errors) for a HF directory's safetensors files or a GGUF file."""
    gguf_file = gguf_io.find_gguf(path)
    if gguf_file is not None:
        return gguf_io.open_gguf(gguf_file).handles(), f"GGUF file {gguf_file}"
    from safetensors import safe_open

    image_text = _read_hf_config(path).get("model_type") in _IMAGE_TEXT_TYPES
    handle_of: dict[str, Any] = {}
    for file in _weight_files(path):
        try:
            handle = stack.enter_context(safe_open(str(file), framework="numpy"))
            names = list(handle.keys())
        except Exception as e:  # safetensors' errors do not name the file
            raise UserError(f"cannot read weights file {file}: {e}") from None
        for name in names:
            ours = _text_tower_name(name) if image_text else name
            if ours is not None:
                handle_of[ours] = handle if ours == name else _Renamed(handle, name)
    return handle_of, f"checkpoint directory {path}"


def _validate(config, expected, handle_of) -> None:
    present = {n for n in handle_of if not n.endswith(_IGNORED_SUFFIXES)}
    optional = {"lm_head.weight"} if config.tie_word_embeddings else set()
    missing = sorted(set(expected) - present, key=_natural)
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s): {', '.join(missing)}")
    unexpected = sorted(present - set(expected) - optional, key=_natural)
    if unexpected:
        raise ValueError(
            f"checkpoint has {len(unexpected)} unexpected tensor(s) for model_type "
            f"{config.model_type!r}: {', '.join(unexpected)}"
        )
    if "lm_head.weight" in optional & present:
        expected = {**expected, "lm_head.weight": (config.vocab_size, config.hidden_size)}
    for name in sorted(present & set(expected), key=_natural):
        shape = tuple(handle_of[name].get_slice(name).get_shape())
        if shape != expected[name]:
            raise ValueError(f"tensor {name} has shape {shape}, expected {expected[name]}")


def _natural(name: str):
    return [int(p) if p.isdigit() else p for p in name.split(".")]


def _param_sources(config: ModelConfig) -> dict[str, tuple[str, _Tensor, bool]]:
    """Our parameter name -> (HF name or name pattern, mapping, stacked over layers)."""
    out = {t.param: (name, t, False) for name, t in _global_tensors(config).items()}
    for suffix, t in _layer_tensors(config).items():
        out[t.param] = ("model.layers.{i}." + suffix, t, True)
    return out


def _reader(source, handle_of, dtype, num_layers: int, num_experts: int):
    """Callback for `make_array_from_callback`: the shard at `index`, read layer by layer."""
    pattern, tensor, stacked = source

    def read(name):
        return tensor.to_ours(handle_of[name].get_tensor(name))

    def callback(index):
        if not stacked:
            return np.ascontiguousarray(read(pattern)[index], dtype=dtype)
        layer_ids = range(num_layers)[index[0]]
        if tensor.per_expert:  # [L, E, ...]: one HF tensor per (layer, expert)
            expert_ids = range(num_experts)[index[1]]
            parts = [
                np.stack([read(pattern.format(i=i, e=e))[index[2:]] for e in expert_ids])
                for i in layer_ids
            ]
        else:
            parts = [read(pattern.format(i=i))[index[1:]] for i in layer_ids]
        return np.ascontiguousarray(np.stack(parts), dtype=dtype)

    return callback


# ----------------------------------------------------------------------------- saving


_DTYPES = ("float32", "bfloat16")


def _check_save_args(max_shard_size, dtype) -> None:
    check_int("max_shard_size", max_shard_size, none_ok=True)  # bytes
    if dtype is not None and dtype not in _DTYPES:
        raise UserError(f"dtype must be one of {_DTYPES} (or None: the model's), got {dtype!r}")


def _out_config(config: ModelConfig, dtype: str | None) -> ModelConfig:
    if dtype is None:
        return config
    return dataclasses.replace(config, dtype=dtype, param_dtype=dtype)


def generation_config(config: ModelConfig) -> dict:
    """The `generation_config.json` dict: the special ids transformers' `generate` reads."""
    eos = list(config.eos_token_ids) if config.extra_eos_token_ids else config.eos_token_id
    out = {"bos_token_id": config.bos_token_id, "eos_token_id": eos}
    if config.pad_token_id is not None:
        out["pad_token_id"] = config.pad_token_id
    return {k: v for k, v in out.items() if v is not None}


@dataclasses.dataclass(frozen=True)
class HFTensor:
    """Where one tensor of a HF checkpoint lives in a `Decoder`'s parameters: the HF
    tensor is `to_hf(params[param][index])`, a view of that slice (a reshape and/or a
    transpose of it; never a copy) in HF's layout `hf_shape`."""

    name: str  # HF name, e.g. "model.layers.3.self_attn.q_proj.weight"
    param: str  # our parameter (`Decoder.named_params`), e.g. "layers.wq"
    index: tuple[int, ...]  # () for a global tensor, (layer,) or (layer, expert)
    hf_shape: tuple[int, ...]
    to_hf: Callable[[np.ndarray], np.ndarray]


def hf_tensor_plan(config: ModelConfig, *, with_lm_head: bool = True) -> list[HFTensor]:
    """Every tensor of `config`'s HF causal-LM checkpoint, in save order (`hf_tensor_names`),
    with the parameter slice it is read from (`lm_head.weight` left out when
    `with_lm_head` is False or the head is tied)."""
    globals_ = _global_tensors(config)
    layer_map = _layer_tensors(config)
    plan = []
    for name in hf_tensor_names(config):
        if name == "lm_head.weight" and not with_lm_head:
            continue
        index: tuple[int, ...] = ()
        if name in globals_:
            t = globals_[name]
        else:
            i, suffix = name.removeprefix("model.layers.").split(".", 1)
            index = (int(i),)
            found = _EXPERT_NAME.fullmatch(suffix)
            if found:  # <block>.experts.<e>.<rest>: the per-expert pattern, expert e
                index = (int(i), int(found["e"]))
                suffix = f"{found['block']}.experts.{{e}}.{found['rest']}"
            t = layer_map[suffix]
        plan.append(HFTensor(name, t.param, index, t.hf_shape, t.to_hf))
    return plan


def merged_lora_target(model: Decoder, param: str) -> str | None:
    """The LoRA target whose delta (alpha/r) A B `save_pretrained` adds to parameter
    `param` (active adapters only), or None."""
    if not lora.adapters_active(model):
        return None
    targets = set(model.lora.lora_config.targets)  # type: ignore[union-attr]
    if param == "lm_head":
        return lora.HEAD if lora.HEAD in targets else None
    target = lora.TARGET_OF_BASE.get(param.removeprefix("layers."))
    return target if target in targets else None


def _decoder_tensors(model: Decoder, dtype, *, with_lm_head: bool):
    """(HF name, HF-layout array) for every tensor of `model`, one layer slice at a time.

    Active LoRA adapters are merged: a target's layer slice is W + (alpha/r) A B, summed in
    float32 and then cast to `dtype`."""
    params = model.named_params()
    for t in hf_tensor_plan(model.config, with_lm_head=with_lm_head):
        value = np.asarray(jax.device_get(params[t.param][...][t.index]))
        target = merged_lora_target(model, t.param)
        if target is not None:
            layer = None if target == lora.HEAD else t.index[0]
            value = value.astype(np.float32) + lora.delta_numpy(model, target, layer)
        yield t.name, np.ascontiguousarray(t.to_hf(value), dtype=dtype)


def _write_weights(path: pathlib.Path, tensors, max_shard_size: int | None) -> None:
    """model.safetensors, or shards + index when `max_shard_size` splits them (one shard
    is written as model.safetensors, as transformers does)."""
    from safetensors.numpy import save_file

    for stale in [*path.glob("model*.safetensors"), path / INDEX_FILE]:
        stale.unlink(missing_ok=True)
    metadata = {"format": "pt"}
    if max_shard_size is None:
        save_file(dict(tensors), str(path / SINGLE_FILE), metadata=metadata)
        return
    shards: list[list[str]] = []
    current: dict[str, np.ndarray] = {}
    size = total = 0
    weight_map = {}

    def flush():
        tmp = path / f"model-shard-{len(shards):05d}.safetensors"
        save_file(current, str(tmp), metadata=metadata)
        shards.append([tmp.name, *current])

    for name, value in tensors:
        if current and size + value.nbytes > max_shard_size:
            flush()
            current, size = {}, 0
        current[name] = value
        size += value.nbytes
        total += value.nbytes
    if current:
        flush()
    if len(shards) == 1:
        (path / shards[0][0]).rename(path / SINGLE_FILE)
        return
    for k, (tmp_name, *names) in enumerate(shards):
        final = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        (path / tmp_name).rename(path / final)
        weight_map.update(dict.fromkeys(names, final))
    with open(path / INDEX_FILE, "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def _write_json(file: pathlib.Path, obj: dict) -> None:
    with open(file, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)


def save_pretrained(
    model: Decoder,
    path: str | os.PathLike,
    *,
    max_shard_size: int | None = None,
    tokenizer=None,
    dtype: str | None = None,
) -> None:
    """Write `model` as a HF causal-LM checkpoint: config.json, generation_config.json and
    model.safetensors (or shards). A model with LoRA adapters switched on is written merged
    (W + (alpha/r) A B); under `lora.adapters_off(model)`, its base weights.

    Tensors are gathered to the host one at a time (one layer slice of a stacked
    parameter) and written in `dtype` ("float32" or "bfloat16"; None: the parameter
    dtype). With `max_shard_size` (bytes), files are split like transformers does
    (`model-0000i-of-0000n.safetensors` plus `model.safetensors.index.json`; a single
    shard is `model.safetensors`). `tokenizer`, when given, is saved alongside.
    """
    _check_save_args(max_shard_size, dtype)
    config = _out_config(model.config, dtype)
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    _write_json(path / CONFIG_FILE, config.to_hf())
    _write_json(path / GENERATION_CONFIG_FILE, generation_config(config))
    tensors = _decoder_tensors(model, config.params_dtype, with_lm_head=True)
    _write_weights(path, tensors, max_shard_size)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path))


# ------------------------------------------------------------ LoRA adapters (PEFT format)

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
_PEFT_HEAD = "base_model.model"  # PeftModel -> LoraModel -> the causal LM
_PEFT_PREFIX = f"{_PEFT_HEAD}.model.layers"


def peft_adapter_tensors(model: Decoder, dtype=np.float32):
    """(PEFT name, array) for every adapter matrix of `model`, one layer at a time.

    PEFT keeps, per target module, `lora_A.weight` `[r, in]` and `lora_B.weight` `[out, r]`
    with delta W_hf = (lora_alpha / r) B A in HF's `[out, in]` Linear layout; ours are
    A `[L, *in, r]` and B `[L, r, *out]` with the in/out axes flattened in HF's order."""
    adapters = cast(lora.LoRA, model.lora)  # a model with adapters (`save_lora_adapter`)
    for t in adapters.lora_config.layer_targets:
        target = lora.TARGETS[t]
        a = np.asarray(jax.device_get(getattr(adapters, f"{t}_a")[...]))
        b = np.asarray(jax.device_get(getattr(adapters, f"{t}_b")[...]))
        r = a.shape[-1]
        for i in range(model.config.num_layers):
            stem = f"{_PEFT_PREFIX}.{i}.{target.hf_module}"
            yield f"{stem}.lora_A.weight", np.ascontiguousarray(a[i].reshape(-1, r).T, dtype)
            yield f"{stem}.lora_B.weight", np.ascontiguousarray(b[i].reshape(r, -1).T, dtype)
    if lora.HEAD in adapters.lora_config.targets:  # A `[D, r]`, B `[r, V]`
        stem = f"{_PEFT_HEAD}.{lora.HEAD}"
        a, b = (np.asarray(jax.device_get(getattr(adapters, f"lm_head_{m}")[...])) for m in "ab")
        yield f"{stem}.lora_A.weight", np.ascontiguousarray(a.T, dtype)
        yield f"{stem}.lora_B.weight", np.ascontiguousarray(b.T, dtype)


def save_lora_adapter(
    model: Decoder,
    path: str | os.PathLike,
    *,
    base_model_name_or_path: str | None = None,
    dtype: str | None = None,
) -> None:
    """Write `model`'s LoRA adapters in PEFT format: adapter_config.json and
    adapter_model.safetensors, which `peft.PeftModel.from_pretrained(base, path)` loads onto
    the transformers base model (the checkpoint the adapters were trained on).

    Args:
      model: a `Decoder` with adapters (`lora.add_lora`).
      path: output directory (created).
      base_model_name_or_path: recorded in adapter_config.json, where PEFT's
        `AutoPeftModelForCausalLM` looks for the base model.
      dtype: "float32" or "bfloat16" for the adapter tensors; None: the adapters' dtype.
    """
    from safetensors.numpy import save_file

    if not lora.has_adapters(model):
        raise UserError("the model has no LoRA adapters to export (grpojax.models.add_lora)")
    _check_save_args(None, dtype)
    assert model.lora is not None  # has_adapters(model)
    cfg = model.lora.lora_config
    first = getattr(model.lora, model.lora.names()[0])[...]
    out_dtype = np.dtype(jax.numpy.dtype(dtype)) if dtype is not None else first.dtype
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": cfg.rank,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "target_modules": sorted(
            t if t == lora.HEAD else lora.TARGETS[t].hf_module.split(".")[-1] for t in cfg.targets
        ),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
    }
    _write_json(path / ADAPTER_CONFIG_FILE, adapter_config)
    tensors = dict(peft_adapter_tensors(model, out_dtype))
    save_file(tensors, str(path / ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})


# ------------------------------------------------------------ sequence classification


def _is_sequence_classifier(hf_config: dict) -> bool:
    archs = hf_config.get("architectures") or []
    return any(isinstance(a, str) and a.endswith(_SEQ_CLS) for a in archs)


def save_sequence_classifier(
    model: RewardModel | ValueModel,
    path: str | os.PathLike,
    *,
    max_shard_size: int | None = None,
    tokenizer=None,
    dtype: str | None = None,
) -> float:
    """Write a `RewardModel` or `ValueModel` as a HF `*ForSequenceClassification` checkpoint
    (`transformers.AutoModelForSequenceClassification` loads it), `num_labels` 1.

    The backbone's tensors are the causal-LM file's without `lm_head`; the head's weight is
    `score.weight` `[1, D]`. Other arguments as `save_pretrained`. Returns the head's bias,
    which transformers' bias-free score layer cannot hold: when it is not 0 it is written to
    config.json as `grpojax_score_bias` (grpojax's loaders add it back; transformers' scores
    are grpojax's minus it).
    """
    if not isinstance(model, RewardModel | ValueModel):
        raise ValueError(
            f"model must be a grpojax RewardModel or ValueModel, got {type(model).__name__}"
        )
    _check_save_args(max_shard_size, dtype)
    config = _out_config(model.backbone.config, dtype)
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    bias = float(np.asarray(jax.device_get(model.head.b[...])))
    hf = config.to_hf()
    arch = hf["architectures"][0].removesuffix("ForCausalLM")
    hf.update(
        architectures=[arch + _SEQ_CLS],
        id2label={"0": "LABEL_0"},
        label2id={"LABEL_0": 0},
        num_labels=1,
    )
    hf[HEAD_KIND_KEY] = "reward" if isinstance(model, RewardModel) else "value"
    if bias != 0.0:
        hf[SCORE_BIAS_KEY] = bias
    _write_json(path / CONFIG_FILE, hf)
    score = np.asarray(jax.device_get(model.head.w[...]))[None, :]

    def tensors():
        yield from _decoder_tensors(model.backbone, config.params_dtype, with_lm_head=False)
        yield SCORE_TENSOR, np.ascontiguousarray(score, dtype=config.params_dtype)

    _write_weights(path, tensors(), max_shard_size)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path))
    return bias


def check_sequence_classifier(path: str | os.PathLike) -> dict:
    """The config.json dict of a one-label HF sequence-classification directory (the cheap
    checks, no weights read); anything else is a `UserError` naming the directory."""
    path = pathlib.Path(path)
    _check_dir(path)
    hf = _read_hf_config(path)
    if not _is_sequence_classifier(hf):
        raise UserError(
            f"{path} is not a sequence-classification checkpoint: its config.json "
            f"architectures are {hf.get('architectures')}, expected one ending in "
            f"{_SEQ_CLS!r} (e.g. Qwen2{_SEQ_CLS}, as `grpojax rm` and `grpojax export` write)"
        )
    labels = hf.get("id2label")
    num_labels = len(labels) if isinstance(labels, dict) else hf.get("num_labels", 2)
    if num_labels != 1:
        raise UserError(
            f"{path / CONFIG_FILE}: a reward or value model has one output (num_labels=1), "
            f"this checkpoint has {num_labels}"
        )
    load_config(path)  # a model_type or option this decoder does not support, named
    return hf


_Classifier = TypeVar("_Classifier", RewardModel, ValueModel)


def _load_sequence_classifier(
    path: str | os.PathLike,
    cls: type[_Classifier],
    *,
    dtype: str | None,
    mesh: Mesh | None,
    config_overrides: dict[str, Any],
) -> _Classifier:
    path = pathlib.Path(path)
    hf = check_sequence_classifier(path)
    dtype = dtype or _default_dtype(path)
    # No output matrix in the file: the backbone is built tied (it has no lm_head to fill).
    config = load_config(
        path, dtype=dtype, param_dtype=dtype, **{"tie_word_embeddings": True, **config_overrides}
    )
    D = config.hidden_size
    backbone, extras = _load_decoder(path, config, mesh, extra={SCORE_TENSOR: (1, D)})
    bias = hf.get(SCORE_BIAS_KEY, 0.0)
    if not isinstance(bias, int | float) or isinstance(bias, bool):
        raise UserError(f"{path / CONFIG_FILE}: {SCORE_BIAS_KEY} must be a number, got {bias!r}")
    model = cls(backbone, rngs=nnx.Rngs(0))
    head: ScalarHead = model.head
    w = np.asarray(extras[SCORE_TENSOR], np.float32)[0]
    b = np.asarray(bias, np.float32)
    if mesh is not None:
        from jax.sharding import NamedSharding, PartitionSpec

        rep = NamedSharding(mesh, PartitionSpec())
        w, b = jax.device_put(w, rep), jax.device_put(b, rep)
    head.w.set_value(jax.numpy.asarray(w))
    head.b.set_value(jax.numpy.asarray(b))
    return model


def load_reward_model(
    path: str | os.PathLike,
    *,
    dtype: str | None = None,
    mesh: Mesh | None = None,
    **config_overrides,
) -> RewardModel:
    """A `RewardModel` from a HF `*ForSequenceClassification` directory (num_labels 1), such
    as `save_sequence_classifier` or `grpojax rm` writes, or one trained elsewhere in
    transformers. Arguments as `from_pretrained`; the backbone is built without an output
    matrix. A directory that is not a one-label sequence-classification checkpoint is a
    `grpojax.errors.UserError` naming it."""
    return _load_sequence_classifier(
        path, RewardModel, dtype=dtype, mesh=mesh, config_overrides=config_overrides
    )


def load_value_model(
    path: str | os.PathLike,
    *,
    dtype: str | None = None,
    mesh: Mesh | None = None,
    **config_overrides,
) -> ValueModel:
    """A `ValueModel` (PPO critic: one value per token) from the same format as
    `load_reward_model`."""
    return _load_sequence_classifier(
        path, ValueModel, dtype=dtype, mesh=mesh, config_overrides=config_overrides
    )
