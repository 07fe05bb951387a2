"""Models: the Flax NNX decoder family (Llama 3.x, Mistral, Qwen2, Qwen3), heads, HF IO, sharding.

Logits from a loaded checkpoint, in one line each:

    model = grpojax.models.from_pretrained(path)           # config.json + *.safetensors, or a .gguf
    hidden_ntd, _ = model(tokens_nt, mask_nt=mask_nt)     # positions = cumsum(mask) - 1
    logits_ntv = model.logits(hidden_ntd)                 # [N, T, V] float32

or `grpojax.models.forward_logits(model, tokens_nt, mask_nt)`. For chunked logprobs
use `hidden_ntd` with `model.lm_head_dv()` (`[D, V]`). The tokenizer (and chat
template) of the same directory or GGUF file: `load_tokenizer(path)` (transformers'
AutoTokenizer). GGUF files (llama.cpp's, quantized or not) are dequantized on load
(`gguf_io`).
The call contract, including the KV cache for decoding, is in `decoder`'s docstring.
LoRA adapters (`add_lora`, `adapters_off`, `merge_adapters`; `lora`'s docstring) sit
beside one copy of the base weights. Reward and value models go out and back in as HF
sequence-classification checkpoints
(`save_sequence_classifier`, `load_reward_model`, `load_value_model`).
"""

from grpojax.models.config import (
    REMAT_POLICIES,
    SUPPORTED_MODEL_TYPES,
    ModelConfig,
    RopeScaling,
    tiny_config,
)
from grpojax.models.decoder import (
    Decoder,
    KVCache,
    RewardModel,
    ScalarHead,
    ValueModel,
    forward_logits,
    init_cache,
    last_token_index,
    positions_from_mask,
    shared_prefix_forward,
)
from grpojax.models.hf_io import (
    from_pretrained,
    load_config,
    load_reward_model,
    load_value_model,
    save_lora_adapter,
    save_pretrained,
    save_sequence_classifier,
)
from grpojax.models.lora import (
    LoRAConfig,
    LoRAParam,
    adapters_off,
    add_lora,
    has_adapters,
    merge_adapters,
)
from grpojax.models.precision import cast_floating, compute_dtype_of
from grpojax.models.sharding import (
    ACTIVATION_AXES,
    PARAM_AXES,
    RULES,
    batch_sharding,
    cache_shardings,
    logical_to_spec,
    make_mesh,
    param_shardings,
    shard_model,
)
from grpojax.models.tokenizer import builtin_tokenizer, builtin_vocab, load_tokenizer

__all__ = [
    "ACTIVATION_AXES",
    "PARAM_AXES",
    "REMAT_POLICIES",
    "RULES",
    "SUPPORTED_MODEL_TYPES",
    "Decoder",
    "KVCache",
    "LoRAConfig",
    "LoRAParam",
    "ModelConfig",
    "RewardModel",
    "RopeScaling",
    "ScalarHead",
    "ValueModel",
    "adapters_off",
    "add_lora",
    "batch_sharding",
    "builtin_tokenizer",
    "builtin_vocab",
    "cache_shardings",
    "cast_floating",
    "compute_dtype_of",
    "forward_logits",
    "from_pretrained",
    "has_adapters",
    "init_cache",
    "last_token_index",
    "load_config",
    "load_reward_model",
    "load_tokenizer",
    "load_value_model",
    "logical_to_spec",
    "make_mesh",
    "merge_adapters",
    "param_shardings",
    "positions_from_mask",
    "save_lora_adapter",
    "save_pretrained",
    "save_sequence_classifier",
    "shard_model",
    "shared_prefix_forward",
    "tiny_config",
]
