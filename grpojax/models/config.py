"""Model configuration: one frozen dataclass for the Llama / Mistral / Qwen2 / Qwen3 / Gemma 2 /
Gemma 3 dense decoders and the Qwen3-MoE and Mixtral mixtures of experts.

`ModelConfig` is hashable (usable as a static jit argument) and validated on
construction. `ModelConfig.from_hf(config_dict)` reads a Hugging Face `config.json`
dict and refuses options this decoder does not implement, naming them;
`ModelConfig.to_hf()` writes the dict back. `tiny_config()` is the built-in
few-million-parameter model whose vocabulary matches the built-in tokenizer.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp
import numpy as np

from grpojax.models.attention import IMPLEMENTATIONS
from grpojax.ops.checks import check_choice, check_int, check_number

SUPPORTED_MODEL_TYPES = (
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "gemma2",
    "gemma3_text",
)
MOE_MODEL_TYPES = ("mixtral", "qwen3_moe")
# Gemma's layer: RMSNorm scales (1 + w), a norm after attention and after the MLP too, the
# embedding scaled by sqrt(D), GELU (tanh) gating, q.k scaled by query_pre_attn_scalar^-1/2.
GEMMA_MODEL_TYPES = ("gemma2", "gemma3_text")
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")
LAYER_TYPES = ("full_attention", "sliding_attention")
ATTENTION_IMPLEMENTATIONS = IMPLEMENTATIONS
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch")
DTYPES = ("float32", "bfloat16")

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
_QK_NORM_TYPES = ("qwen3", "qwen3_moe", "gemma3_text")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Rope scaling: `llama3` (Llama 3.1+: long wavelengths divided by `factor`, short ones
    kept, a smooth ramp between), `linear` (Gemma 3's global layers: every frequency divided
    by `factor`; the other fields unused) or `yarn` (YaRN, Peng et al. 2023, as Qwen3's and
    Qwen2.5's long-context checkpoints set it: frequencies whose wavelength fits
    `original_max_position_embeddings` more than `beta_fast` times kept, fewer than
    `beta_slow` times divided by `factor`, a linear ramp between over the dimensions; and
    cos/sin scaled by `attention_factor`, by default 0.1 ln(factor) + 1, or with `mscale`
    and `mscale_all_dim` the ratio of two such terms; `truncate` rounds the ramp's ends
    outward to whole dimensions)."""

    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    rope_type: str = "llama3"
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self):
        check_choice("rope_type", self.rope_type, ("llama3", "linear", "yarn"))
        for name in ("beta_fast", "beta_slow"):
            check_number(name, getattr(self, name), minimum=0, strict=True, array_ok=False)
        for name in ("attention_factor", "mscale", "mscale_all_dim"):
            check_number(name, getattr(self, name), minimum=0, none_ok=True, array_ok=False)
        check_number("factor", self.factor, minimum=0, strict=True, array_ok=False)
        check_number(
            "low_freq_factor", self.low_freq_factor, minimum=0, strict=True, array_ok=False
        )
        check_number("high_freq_factor", self.high_freq_factor, array_ok=False)
        if not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                f"high_freq_factor must be > low_freq_factor ({self.low_freq_factor}), "
                f"got {self.high_freq_factor!r}"
            )
        check_int("original_max_position_embeddings", self.original_max_position_embeddings)

    @property
    def yarn_attention_factor(self) -> float:
        """YaRN's cos/sin scale (1 for the other types)."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)

        def mscale(m: float) -> float:
            return 1.0 if self.factor <= 1 else 0.1 * m * math.log(self.factor) + 1.0

        if self.mscale and self.mscale_all_dim:
            return mscale(self.mscale) / mscale(self.mscale_all_dim)
        return mscale(1.0)

    def yarn_inv_freq(self, inv: np.ndarray, theta: float, dim: int) -> np.ndarray:
        """YaRN's frequencies from the unscaled ones `inv` `[H/2]` (class docstring): the
        dimension d where a frequency turns `r` times over the original context is
        dim ln(L / (2 pi r)) / (2 ln theta); between those of beta_fast and beta_slow the
        interpolated (divided by `factor`) and the original frequencies are mixed linearly."""

        def turning_dim(rotations: float) -> float:
            length = self.original_max_position_embeddings
            return dim * math.log(length / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = turning_dim(self.beta_fast), turning_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # no zero-width ramp
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
        keep = (1 - ramp).astype(np.float32)  # 1: the original frequency, 0: interpolated
        interpolated = inv / np.float32(self.factor)
        return (interpolated * (1 - keep) + inv * keep).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Decoder hyperparameters (names follow the HF config where one exists).

    Fields:
      model_type: one of `SUPPORTED_MODEL_TYPES`; decides the HF tensor names written back.
      vocab_size: V. hidden_size: D. intermediate_size: F (SwiGLU width). num_layers: L.
      num_heads: query heads. num_kv_heads: K key/value heads (GQA; divides num_heads).
      head_dim: H, may differ from D / num_heads (Qwen3).
      rope_theta: RoPE base. rope_scaling: `RopeScaling` or None (of the full-attention
        layers when `rope_local_theta` is set).
      rms_norm_eps: RMSNorm epsilon. qkv_bias: q/k/v projections have a bias (Qwen2).
      qk_norm: RMSNorm over head_dim on q and k before RoPE (Qwen3, Qwen3-MoE, Gemma 3).
      hidden_act: the MLP's gate activation, one of `HIDDEN_ACTS` ("silu": SwiGLU;
        "gelu_pytorch_tanh": GeGLU with the tanh GELU, Gemma).
      sliding_window: W, or None: a token of a sliding-attention layer reads only the keys
        whose position is within W - 1 before its own (itself included: HF's rule).
      layer_types: each layer's attention, one of `LAYER_TYPES` ("sliding_attention" reads
        through the window); () (the default): every layer sliding when `sliding_window` is
        set (Mistral v0.1), else full. `layer_windows()` gives the per-layer windows.
      rope_local_theta: the sliding layers' RoPE base, unscaled (Gemma 3's 10,000); None:
        every layer uses `rope_theta` and `rope_scaling`.
      query_pre_attn_scalar: scores are q.k / sqrt(query_pre_attn_scalar) (Gemma); None:
        head_dim.
      attn_logit_softcapping: c > 0: attention scores -> c tanh(scores / c) (Gemma 2);
        None: none.
      final_logit_softcapping: c > 0: logits -> c tanh(logits / c) before the softmax, in
        the sampler and every chunked logprob op (Gemma 2); None: none.
      num_experts: E, experts in every layer's MLP (`model_type` in `MOE_MODEL_TYPES`); 0
        (the default): the dense SwiGLU MLP of width `intermediate_size`.
      num_experts_per_tok: k, experts each token is routed to (top-k of the router's
        softmax), 1 <= k <= E when E > 0. moe_intermediate_size: F_e, each expert's SwiGLU
        width. norm_topk_prob: the k routing weights are renormalised to sum to 1 (HF's
        `norm_topk_prob`; Mixtral always does); otherwise they are the softmax probabilities.
      tie_word_embeddings: the LM head is the embedding transposed.
      dtype: compute dtype ("float32" or "bfloat16"); param_dtype: storage dtype
        ("float32" by default: float32 masters, each cast to `dtype` where it is used).
        Norm statistics, softmax and logits are always float32.
      remat: rematerialization policy of each scanned layer, one of `REMAT_POLICIES`.
      attention: the attention backend, one of `ATTENTION_IMPLEMENTATIONS`
        (`grpojax.models.attention`): "auto" (the default: on a GPU cuDNN's fused flash
        attention where the mask allows; else the einsum for short sequences, the
        blockwise path whose memory is linear in length beyond), "einsum", "blockwise" or
        "fused" (`jax.nn.dot_product_attention`: cuDNN on a GPU, XLA's elsewhere; the
        unfused choice for packed rows, soft caps, decode steps). attention_block:
        the blockwise path's tile size, >= 1; None (the default): 1,024 on a GPU, 256
        elsewhere (`attention.default_block`).
      max_position_embeddings: positions the model was trained for (informational).
      bos_token_id / eos_token_id / pad_token_id: special ids (None when absent).
      extra_eos_token_ids: further ids that also end a sequence (HF `eos_token_id` lists,
        e.g. Llama 3 instruct); `eos_token_ids` gives all of them.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    model_type: str = "llama"
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    qkv_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    dtype: str = "float32"
    param_dtype: str = "float32"
    remat: str = "none"
    attention: str = "auto"
    attention_block: int | None = None
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    extra_eos_token_ids: tuple[int, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    hidden_act: str = "silu"
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    rope_local_theta: float | None = None
    query_pre_attn_scalar: int | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None

    def __post_init__(self):
        check_choice("model_type", self.model_type, SUPPORTED_MODEL_TYPES)
        self._check_experts()
        self._check_attention_layout()
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            check_int(name, getattr(self, name))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads must be a multiple of num_kv_heads ({self.num_kv_heads}), "
                f"got {self.num_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (RoPE rotates pairs), got {self.head_dim}")
        check_number("rope_theta", self.rope_theta, minimum=0, strict=True, array_ok=False)
        check_number("rms_norm_eps", self.rms_norm_eps, minimum=0, strict=True, array_ok=False)
        check_choice("dtype", self.dtype, DTYPES)
        check_choice("param_dtype", self.param_dtype, DTYPES)
        check_choice("remat", self.remat, REMAT_POLICIES)
        check_choice("attention", self.attention, ATTENTION_IMPLEMENTATIONS)
        if self.attention_block is not None:
            check_int("attention_block", self.attention_block)
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(
                "rope_scaling must be a RopeScaling or None, got "
                f"{type(self.rope_scaling).__name__}"
            )
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            self._check_token_id(name, getattr(self, name), none_ok=True)
        if not isinstance(self.extra_eos_token_ids, tuple):
            raise ValueError(
                f"extra_eos_token_ids must be a tuple of ints, got {self.extra_eos_token_ids!r}"
            )
        if self.extra_eos_token_ids and self.eos_token_id is None:
            raise ValueError("extra_eos_token_ids needs eos_token_id to be set")
        for value in self.extra_eos_token_ids:
            self._check_token_id("extra_eos_token_ids", value)

    def _check_experts(self) -> None:
        check_int("num_experts", self.num_experts, minimum=0)
        moe_type = self.model_type in MOE_MODEL_TYPES
        if moe_type != (self.num_experts > 0):
            raise ValueError(
                f"num_experts must be >= 1 exactly when model_type is one of {MOE_MODEL_TYPES}, "
                f"got num_experts={self.num_experts} with model_type {self.model_type!r}"
            )
        if self.model_type == "mixtral" and not self.norm_topk_prob:
            raise ValueError("model_type 'mixtral' renormalises its top k: norm_topk_prob=True")
        if not moe_type:
            return
        check_int("moe_intermediate_size", self.moe_intermediate_size)
        check_int("num_experts_per_tok", self.num_experts_per_tok)
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], got "
                f"{self.num_experts_per_tok}"
            )

    def _check_attention_layout(self) -> None:
        check_choice("hidden_act", self.hidden_act, HIDDEN_ACTS)
        check_int("sliding_window", self.sliding_window, none_ok=True)
        if not isinstance(self.layer_types, tuple):
            raise ValueError(f"layer_types must be a tuple of strings, got {self.layer_types!r}")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(
                f"layer_types must name all {self.num_layers} layers (num_layers), got "
                f"{len(self.layer_types)}"
            )
        for kind in self.layer_types:
            check_choice("layer_types", kind, LAYER_TYPES)
        if self.is_moe and self.hidden_act != "silu":
            raise ValueError(
                f"hidden_act must be 'silu' for a mixture of experts, got {self.hidden_act!r}"
            )
        if "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is None")
        check_int("query_pre_attn_scalar", self.query_pre_attn_scalar, none_ok=True)
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            check_number(name, getattr(self, name), minimum=0, strict=True, none_ok=True,
                         array_ok=False)  # fmt: skip
        if self.rope_local_theta is not None:
            check_number(
                "rope_local_theta", self.rope_local_theta, minimum=0, strict=True, array_ok=False
            )

    @property
    def is_gemma(self) -> bool:
        """Gemma's layer (`GEMMA_MODEL_TYPES`): (1 + w) norms, four norms a layer, the
        embedding scaled by sqrt(hidden_size)."""
        return self.model_type in GEMMA_MODEL_TYPES

    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window (None: full attention)."""
        kinds = self.layer_types or (
            ("sliding_attention" if self.sliding_window else "full_attention",) * self.num_layers
        )
        return tuple(self.sliding_window if k == "sliding_attention" else None for k in kinds)

    @property
    def attention_scale(self) -> float:
        """The scores' factor: 1 / sqrt(query_pre_attn_scalar or head_dim)."""
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def is_moe(self) -> bool:
        """Every layer's MLP is a mixture of `num_experts` experts."""
        return self.num_experts > 0

    def _check_token_id(self, name: str, value, *, none_ok: bool = False) -> None:
        """A token id is an int in `[0, vocab_size)`."""
        check_int(name, value, minimum=0, none_ok=none_ok)
        if value is not None and value >= self.vocab_size:
            allowed = f"{'None or ' if none_ok else ''}an int in [0, {self.vocab_size})"
            raise ValueError(f"{name} must be {allowed} (the vocabulary), got {value!r}")

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends a sequence: eos_token_id first, then the extras."""
        if self.eos_token_id is None:
            return ()
        return (self.eos_token_id, *self.extra_eos_token_ids)

    @property
    def compute_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def params_dtype(self):
        return jnp.dtype(self.param_dtype)

    def num_params(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        d, f, h = self.hidden_size, self.intermediate_size, self.head_dim
        attn = d * h * (2 * self.num_heads + 2 * self.num_kv_heads)
        if self.qkv_bias:
            attn += h * (self.num_heads + 2 * self.num_kv_heads)
        if self.qk_norm:
            attn += 2 * h
        if self.is_moe:
            mlp = self.num_experts * (3 * d * self.moe_intermediate_size + d)
        else:
            mlp = 3 * d * f
        per_layer = attn + mlp + (4 if self.is_gemma else 2) * d
        emb = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + emb + d

    @property
    def rope_attention_factor(self) -> float:
        """The factor on cos/sin of the (full-attention) layers' RoPE: YaRN's
        `attention_factor`, 1 otherwise."""
        return 1.0 if self.rope_scaling is None else self.rope_scaling.yarn_attention_factor

    def inv_freq(self, *, local: bool = False) -> np.ndarray:
        """RoPE inverse frequencies `[H/2]` float32, with the configured scaling.

        inv_freq_i = 1 / theta^(2i / H); linear scaling divides them all by `factor`; llama3
        scaling divides wavelengths longer than original_max / low_freq_factor by `factor`
        and interpolates smoothly down to original_max / high_freq_factor (as in Llama 3.1).
        `local`: the sliding layers' frequencies (base `rope_local_theta`, unscaled) when
        that is set.
        """
        dim = self.head_dim
        exponent = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
        theta = self.rope_local_theta if local and self.rope_local_theta else self.rope_theta
        inv = (np.float32(1.0) / (np.float32(theta) ** exponent)).astype(np.float32)
        rs = None if local and self.rope_local_theta else self.rope_scaling
        if rs is None:
            return inv
        if rs.rope_type == "linear":
            return (inv / np.float32(rs.factor)).astype(np.float32)
        if rs.rope_type == "yarn":
            return rs.yarn_inv_freq(inv, theta, dim)
        low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
        high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / rs.factor, inv)
        smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
            rs.high_freq_factor - rs.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)

    # ---------------------------------------------------------------- HF config IO

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], **overrides) -> ModelConfig:
        """Build from a Hugging Face `config.json` dict; `overrides` replace fields.

        Raises ValueError for an unsupported `model_type` (listing the supported ones)
        or an option this decoder does not implement (naming it). Gemma 3's image-text
        configs (`model_type` "gemma3": 4B, 12B, 27B) give their text model's.
        """
        cfg = _gemma_config(cfg)
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r}; supported: {SUPPORTED_MODEL_TYPES}"
            )
        unsupported = []
        gemma = model_type in GEMMA_MODEL_TYPES
        act = cfg.get("hidden_activation") or cfg.get("hidden_act", "silu")
        want_act = "gelu_pytorch_tanh" if gemma else "silu"
        if act != want_act:
            unsupported.append(f"hidden_act={act!r} (only {want_act!r})")
        if cfg.get("mlp_bias"):
            unsupported.append("mlp_bias=True")
        if cfg.get("attention_bias") and model_type != "qwen2":
            unsupported.append("attention_bias=True")
        if cfg.get("use_sliding_window"):  # Qwen2/3: windows above max_window_layers only
            unsupported.append("use_sliding_window=True")
        window, longest = cfg.get("sliding_window"), cfg.get("max_position_embeddings", 4096)
        layout: dict[str, Any] = {}
        if model_type in ("mistral", "mixtral") and window is not None and window < longest:
            # Mistral 7B v0.1's 4096 of 32768, every layer; v0.2+, Nemo and Small have none (a
            # window at least max_position_embeddings long never cuts a trained-for sequence).
            layout = dict(sliding_window=int(window))
        layer_types = cfg.get("layer_types")
        if gemma:  # transformers' config class filled layer_types in (_gemma_config)
            layout = dict(
                sliding_window=int(window) if window is not None else None,
                layer_types=tuple(cfg["layer_types"]),
                query_pre_attn_scalar=int(cfg.get("query_pre_attn_scalar", 256)),
                hidden_act=act,
                final_logit_softcapping=cfg.get("final_logit_softcapping"),
                attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
            )
            if model_type == "gemma3_text" and cfg.get("attn_logit_softcapping") is not None:
                # transformers' Gemma 3 attention does not apply it: refused, not guessed.
                unsupported.append(
                    f"attn_logit_softcapping={cfg['attn_logit_softcapping']} (Gemma 3's "
                    "attention does not soft-cap in transformers)"
                )
            if cfg.get("use_bidirectional_attention"):
                unsupported.append("use_bidirectional_attention=True")
        elif layer_types and any(t != "full_attention" for t in layer_types):
            unsupported.append("layer_types other than 'full_attention'")
        if cfg.get("pretraining_tp", 1) != 1:
            unsupported.append(f"pretraining_tp={cfg['pretraining_tp']}")
        moe: dict[str, Any] = {}
        if model_type == "qwen3_moe":
            # Qwen3-30B-A3B and -235B-A22B: every layer sparse. A dense layer among them (HF's
            # decoder_sparse_step > 1 or mlp_only_layers) would need per-layer MLP kinds.
            if cfg.get("decoder_sparse_step", 1) != 1:
                unsupported.append(f"decoder_sparse_step={cfg['decoder_sparse_step']} (only 1)")
            if cfg.get("mlp_only_layers"):
                unsupported.append(f"mlp_only_layers={cfg['mlp_only_layers']} (only [])")
            moe = dict(
                num_experts=int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0),
                num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                moe_intermediate_size=int(cfg["moe_intermediate_size"]),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            )
        if model_type == "mixtral":  # every layer sparse; experts as wide as intermediate_size
            if cfg.get("router_jitter_noise"):
                unsupported.append(f"router_jitter_noise={cfg['router_jitter_noise']} (only 0)")
            moe = dict(
                num_experts=int(cfg["num_local_experts"]),
                num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                moe_intermediate_size=int(cfg["intermediate_size"]),
                norm_topk_prob=True,
            )

        rope = cfg.get("rope_parameters") or {}
        legacy_scaling = cfg.get("rope_scaling")
        if model_type == "gemma3_text":  # per layer type: {"full_attention": {...}, ...}
            local = rope.get("sliding_attention") or {}
            local_theta = local.get("rope_theta", cfg.get("rope_local_base_freq", 10000.0))
            if local.get("rope_type", "default") != "default":
                unsupported.append(f"sliding_attention rope_type={local['rope_type']!r}")
            layout.update(rope_local_theta=float(local_theta))
            rope = rope.get("full_attention") or {"rope_theta": cfg.get("rope_theta", 1e6)}
        rope_theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = dict(legacy_scaling) if legacy_scaling else dict(rope)
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        rope_scaling = None
        if rope_type == "llama3":
            rope_scaling = RopeScaling(
                factor=float(scaling["factor"]),
                low_freq_factor=float(scaling["low_freq_factor"]),
                high_freq_factor=float(scaling["high_freq_factor"]),
                original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
            )
        elif rope_type == "linear":
            rope_scaling = RopeScaling(factor=float(scaling["factor"]), rope_type="linear")
        elif rope_type == "yarn":
            original = scaling.get("original_max_position_embeddings")
            original = int(original or cfg.get("max_position_embeddings", 8192))
            factor = scaling.get("factor")
            if factor is None:  # DeepSeek-V3's way: the context's growth
                factor = cfg["max_position_embeddings"] / original
            optional = ("attention_factor", "mscale", "mscale_all_dim")
            rope_scaling = RopeScaling(
                factor=float(factor),
                original_max_position_embeddings=original,
                rope_type="yarn",
                beta_fast=float(scaling.get("beta_fast") or 32.0),
                beta_slow=float(scaling.get("beta_slow") or 1.0),
                truncate=bool(scaling.get("truncate", True)),
                **{k: float(scaling[k]) for k in optional if scaling.get(k) is not None},
            )
        elif rope_type != "default":
            unsupported.append(
                f"rope_type={rope_type!r} (supported: 'default', 'linear', 'llama3', 'yarn')"
            )
        if scaling.get("partial_rotary_factor", 1.0) != 1.0:
            unsupported.append("partial_rotary_factor != 1")
        if unsupported:
            raise ValueError(
                f"unsupported options for model_type {model_type!r}: {', '.join(unsupported)}"
            )

        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // num_heads
        eos = cfg.get("eos_token_id")
        extra_eos: tuple[int, ...] = ()
        if isinstance(eos, list):
            eos, extra_eos = (eos[0], tuple(eos[1:])) if eos else (None, ())
        kwargs = dict(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            qkv_bias=model_type == "qwen2",
            qk_norm=model_type in _QK_NORM_TYPES,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos,
            extra_eos_token_ids=extra_eos,
            pad_token_id=cfg.get("pad_token_id"),
            **moe,
            **layout,
        )
        kwargs.update(overrides)
        return cls(**kwargs)

    def to_hf(self) -> dict[str, Any]:
        """The Hugging Face `config.json` dict for this model (transformers 5 layout)."""
        rope: dict[str, Any] = {"rope_theta": self.rope_theta, "rope_type": "default"}
        rs = self.rope_scaling
        if rs is not None and rs.rope_type == "linear":
            rope.update(rope_type="linear", factor=rs.factor)
        elif rs is not None and rs.rope_type == "yarn":
            rope.update(
                rope_type="yarn",
                factor=rs.factor,
                original_max_position_embeddings=rs.original_max_position_embeddings,
                beta_fast=rs.beta_fast,
                beta_slow=rs.beta_slow,
                truncate=rs.truncate,
            )
            optional = {"attention_factor": rs.attention_factor, "mscale": rs.mscale}
            optional["mscale_all_dim"] = rs.mscale_all_dim
            rope.update({k: v for k, v in optional.items() if v is not None})
        elif rs is not None:
            llama3 = ("factor", "low_freq_factor", "high_freq_factor")
            rope.update({k: getattr(rs, k) for k in llama3}, rope_type="llama3")
            rope["original_max_position_embeddings"] = rs.original_max_position_embeddings
        expected_bias = self.model_type == "qwen2"
        expected_norm = self.model_type in _QK_NORM_TYPES
        if self.qkv_bias != expected_bias or self.qk_norm != expected_norm:
            raise ValueError(
                f"model_type {self.model_type!r} implies qkv_bias={expected_bias} and "
                f"qk_norm={expected_norm}, got qkv_bias={self.qkv_bias}, qk_norm={self.qk_norm}"
            )
        cfg: dict[str, Any] = {
            "architectures": [_ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": rope,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids)
            if self.extra_eos_token_ids
            else self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "torch_dtype": self.param_dtype,
            "dtype": self.param_dtype,
        }
        if self.model_type == "llama":
            cfg.update(attention_bias=False, mlp_bias=False)
        elif self.model_type in ("mistral", "mixtral"):
            cfg.update(sliding_window=self.sliding_window)
        elif self.is_gemma:
            del cfg["hidden_act"], cfg["rope_theta"]
            cfg.update(
                hidden_activation=self.hidden_act,
                sliding_window=self.sliding_window,
                layer_types=[
                    "full_attention" if w is None else "sliding_attention"
                    for w in self.layer_windows()
                ],
                query_pre_attn_scalar=self.query_pre_attn_scalar or self.head_dim,
                attn_logit_softcapping=self.attn_logit_softcapping,
                final_logit_softcapping=self.final_logit_softcapping,
                use_bidirectional_attention=False,
            )
            if self.model_type == "gemma3_text":
                theta = self.rope_local_theta or self.rope_theta
                local = {"rope_theta": theta, "rope_type": "default"}
                cfg.update(rope_parameters={"full_attention": rope, "sliding_attention": local})
        else:
            cfg.update(use_sliding_window=False)
        if self.model_type in _QK_NORM_TYPES:
            cfg.update(attention_bias=False)
        if self.model_type == "mixtral":
            cfg.update(
                num_local_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                intermediate_size=self.moe_intermediate_size,
                router_jitter_noise=0.0,
                router_aux_loss_coef=0.0,
                output_router_logits=False,
            )
        elif self.is_moe:
            cfg.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=1,
                mlp_only_layers=[],
                router_aux_loss_coef=0.0,
                output_router_logits=False,
            )
        return cfg


def _gemma_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A Gemma 2 or 3 config with transformers' defaults filled in (their config.json files
    leave defaults out, an image-text checkpoint's `text_config` most of them), an
    image-text checkpoint's (`gemma3`) as its text model's with the outer special ids;
    other configs as they are."""
    model_type = cfg.get("model_type")
    if model_type not in ("gemma2", "gemma3", "gemma3_text"):
        return cfg
    import transformers

    text = dict(cfg.get("text_config") or {}) if model_type == "gemma3" else dict(cfg)
    if model_type == "gemma3":
        ids = ("bos_token_id", "eos_token_id", "pad_token_id")
        text.update({k: cfg[k] for k in ids if cfg.get(k) is not None})
    text.pop("model_type", None)
    config_class = (
        transformers.Gemma2Config if model_type == "gemma2" else transformers.Gemma3TextConfig
    )
    return config_class(**text).to_dict()


def tiny_config(**overrides) -> ModelConfig:
    """The built-in tiny model (about 4.6M parameters), vocabulary = the built-in tokenizer.

    Qwen3-style (q/k norm keeps a tiny model's attention logits tame), untied head,
    6 layers of width 256 with 8 query and 2 key/value heads. `overrides` go to
    `dataclasses.replace`-style construction.
    """
    from grpojax.models.tokenizer import BOS_ID, EOS_ID, PAD_ID, builtin_vocab

    kwargs: dict[str, Any] = dict(
        model_type="qwen3",
        vocab_size=len(builtin_vocab()),
        hidden_size=256,
        intermediate_size=768,
        num_layers=6,
        num_heads=8,
        num_kv_heads=2,
        head_dim=32,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        qk_norm=True,
        tie_word_embeddings=False,
        max_position_embeddings=1024,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    kwargs.update(overrides)
    return ModelConfig(**kwargs)


# `model.remat=auto` (`auto_remat`) keeps the projections (`dots_no_batch`) while what they
# add over full remat stays within this share of a device's memory (the rest: the weights,
# optimizer state, reference, logits tiles and the sampler's cache).
AUTO_REMAT_SHARE = 0.5


def kept_projection_bytes(config: ModelConfig, tokens: int, tensor: int = 1) -> int:
    """Bytes `dots_no_batch` keeps beyond `full` remat on one device for a forward of
    `tokens` tokens there (its rows' whole width), estimated:

        2 L tokens ((Q H + 2 K H + 2 F) / tensor + 2 D) b

    (the outputs of q|k|v, gate|up and of o and down; F the MLP width, a mixture of
    experts' k x its expert width; b the compute dtype's bytes; the tensor axis splits all
    but the D-wide outputs). The factor 2 is XLA's, read off compiled GRPO steps: the
    estimate is 0.95-1.07x the difference of their scratch memory for Qwen2.5-1.5B,
    Qwen2.5-7B and Qwen3-8B at 5k-34k tokens a device on fsdp 8, 1.02-1.17x on fsdp 4 x
    tensor 2 (experiments/results/long_context_cpu/plan_memory_long.txt)."""
    c = config
    f = c.num_experts_per_tok * c.moe_intermediate_size if c.is_moe else c.intermediate_size
    split = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim + 2 * f
    per_token = split / tensor + 2 * c.hidden_size
    return int(2 * c.num_layers * tokens * per_token * c.compute_dtype.itemsize)


def auto_remat(
    config: ModelConfig, tokens: int, device_bytes: int | None, tensor: int = 1
) -> tuple[str, str]:
    """(policy, why) for `model.remat=auto`: "dots_no_batch" (the faster update) while
    `kept_projection_bytes` stays within `AUTO_REMAT_SHARE` of `device_bytes` (one device's
    memory; None, as on a CPU: no limit), else "full" (memory linear in depth x width only
    through the layers' inputs)."""
    kept = kept_projection_bytes(config, tokens, tensor)
    if device_bytes is None:
        return "dots_no_batch", "the device reports no memory limit"
    budget = AUTO_REMAT_SHARE * device_bytes
    fits = kept <= budget
    why = (
        f"dots_no_batch would keep {kept / 1e9:.1f} GB of projections for {tokens} tokens a "
        f"device, {'within' if fits else 'over'} {budget / 1e9:.1f} GB "
        f"({AUTO_REMAT_SHARE:g} of the device's {device_bytes / 1e9:.1f} GB)"
    )
    return ("dots_no_batch" if fits else "full"), why
