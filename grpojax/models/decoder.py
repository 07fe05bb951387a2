"""The Flax NNX decoder (Llama 3.x / Mistral / Qwen2 / Qwen3 / Gemma 2 and 3; Mixtral / Qwen3-MoE)
with a KV cache.

The L layers' parameters are stacked along a leading axis and run under one
`jax.lax.scan`, so compile time does not grow with depth; each layer body can be
rematerialized (`config.remat`). Numerics: parameters stored in `config.param_dtype`
(float32 masters by default) and cast to `config.dtype` where each is used; matmuls in
`config.dtype`; RMSNorm statistics, RoPE angles, attention scores and softmax, the
attention-weighted sum of values, and logits accumulated in float32.

Forward contract (what the sampler and the train steps build on):

    hidden_ntd, cache = model(tokens_nt, *, positions_nt, mask_nt, cache=None)

  tokens_nt   [N, T] int     token ids; padding anywhere the mask is False (left padding ok)
  positions_nt [N, T] int    RoPE positions, e.g. `positions_from_mask(mask_nt)`
                             = cumsum(mask) - 1 (optional without a cache)
  mask_nt     [N, T] bool    real tokens (default: all True)
  cache       KVCache|None   None: causal attention among the T tokens (padding masked).
                             A KVCache: the T tokens attend to every filled real slot of
                             the cache and causally among themselves, then are written at
                             slots [cache.index, cache.index + T) (prefill: index 0,
                             T = prompt width; decode: T = 1), or from each row's own
                             `index[n]` when the index is `[N]`. The caller keeps
                             index + T <= S.
  prefill     bool (static)  True with a fresh cache: the tokens attend among themselves
                             only (the empty cache is not read) and are written at [0, T).
  prefix      KVCache|None   a filled cache of B rows shared by groups of N/B contiguous
                             rows, read only: the tokens attend to its real slots too.
  layer_params dict|None     the stacked layer parameters to run, built once by
                             `model.layer_params(fuse=True)` outside a caller's loop
                             (None: read from the module on every call).
  hidden_ntd  [N, T, D]      final-norm hidden states, compute dtype
  cache       the updated KVCache (index advanced by T), or None

`model.lm_head_dv()` is the `[D, V]` output matrix (the embedding transposed when
tied), so logprobs can be computed in chunks from `hidden_ntd`;
`model.logits(hidden_ntd)` gives `[N, T, V]` float32 when full logits are wanted.

`KVCache` is a plain pytree: `k, v: [L, N, K, S, H]`, `mask_ns: [N, S]` bool (filled
real slots), `index: int32 []` or `[N]` (next write slot, shared or per row). A prefilled
cache of B prompts can be read as the `prefix` of N = B*G rows (`model(..., prefix=)`), so
G samples share one prompt prefill and one copy of its keys: the static sampler decodes that
way, and the trainer's passes run each prompt once through `shared_prefix_forward`
(differentiable).

Value and reward heads (`ValueModel`, `RewardModel`) reuse the same backbone.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx
from jax import Array

from grpojax.models import lora, moe, sharding
from grpojax.models.attention import SelfMask, attention, attention_with_cache, takes_fused
from grpojax.models.config import ModelConfig


@flax.struct.dataclass
class KVCache:
    """Per-layer keys/values of the tokens decoded so far.

    k: `[L, N, K, H, S]`, v: `[L, N, K, S, H]` (K kv heads, S = max cache length, H
      head_dim): heads before slots, and the keys transposed, so both attention products
      take a head's cache as a plain right-hand matrix, `q [G, H] x k [H, S]` and
      `p [G, S] x v [S, H]`: XLA:CPU's dot on a `[S, H]` key matrix contracted over H ran
      2.5x slower at S 512 (docs/performance/step-time.md).
    mask_ns: `[N, S]` bool, True at slots holding a real token.
    index: `[]` int32, the next slot to write; or `[N]` int32, each row's own next slot (the
      continuous-batching sampler's slots, each at its own point of its own sequence).
    """

    k: Array
    v: Array
    mask_ns: Array
    index: Array

    def readable_ns(self) -> Array:
        """`[N, S]` bool: the slots new tokens may attend to, real ones before `index`."""
        index = jnp.reshape(jnp.asarray(self.index, jnp.int32), (-1, 1))  # [1, 1] or [N, 1]
        return self.mask_ns & (jnp.arange(self.mask_ns.shape[1])[None, :] < index)


@flax.struct.dataclass
class LayerCache:
    """A `KVCache` kept as one array per layer, for `Decoder.decode_step`'s unrolled layers.

    k: L arrays `[N, K, H, S]`; v: L arrays `[N, K, S, H]` (one layer of `KVCache`'s
    layout each); mask_ns: `[N, S]` bool, the slots the next token reads; index: `[]` int32,
    the slot it is written at (every row's, rows in lock step)."""

    k: tuple[Array, ...]
    v: tuple[Array, ...]
    mask_ns: Array
    index: Array

    @classmethod
    def from_stacked(cls, cache: KVCache) -> LayerCache:
        """The same slots as `cache` (shared index), one array per layer."""
        layers = range(cache.k.shape[0])
        return cls(
            k=tuple(cache.k[i] for i in layers),
            v=tuple(cache.v[i] for i in layers),
            mask_ns=cache.readable_ns(),
            index=jnp.asarray(cache.index, jnp.int32),
        )


def split_layers(layer_params: dict[str, Array], num_layers: int) -> tuple[dict, ...]:
    """`Decoder.layer_params(...)`'s stacked `[L, ...]` dict as L per-layer dicts (one copy
    of the weights, made once outside a decode loop)."""
    return tuple({k: w[i] for k, w in layer_params.items()} for i in range(num_layers))


def init_cache(config: ModelConfig, batch: int, max_len: int, dtype=None) -> KVCache:
    """An empty cache for `batch` sequences of up to `max_len` tokens (dtype: compute dtype)."""
    if batch <= 0 or max_len <= 0:
        raise ValueError(f"batch and max_len must be positive, got {batch} and {max_len}")
    dtype = config.compute_dtype if dtype is None else jnp.dtype(dtype)
    shape = (config.num_layers, batch, config.num_kv_heads, max_len, config.head_dim)
    return KVCache(
        k=jnp.zeros((*shape[:3], shape[4], shape[3]), dtype),
        v=jnp.zeros(shape, dtype),
        mask_ns=jnp.zeros((batch, max_len), jnp.bool_),
        index=jnp.zeros((), jnp.int32),
    )


def positions_from_mask(mask_nt: Array) -> Array:
    """RoPE positions `[N, T]` int32: position of each real token among the real ones.

    p[n, t] = sum_{s <= t} mask[n, s] - 1, clipped at 0 (padding before the first token).
    """
    m = jnp.asarray(mask_nt, jnp.int32)
    return jnp.maximum(jnp.cumsum(m, axis=-1) - 1, 0).astype(jnp.int32)


def last_token_index(mask_nt: Array) -> Array:
    """`[N]` int32 index of the last real token of each row (0 for an empty row)."""
    t = jnp.arange(mask_nt.shape[-1], dtype=jnp.int32)
    return jnp.maximum(jnp.max(jnp.where(mask_nt, t, -1), axis=-1), 0)


# ----------------------------------------------------------------------------- layer math


def rms_norm(x: Array, weight: Array, eps: float, *, gemma: bool = False) -> Array:
    """y = w * x / sqrt(mean(x^2) + eps); statistics in float32, output in x's dtype.

    `gemma`: y = (1 + w) * x / sqrt(mean(x^2) + eps), the product in float32 and then cast
    (Gemma's norm: its scales are stored centred on 0)."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + eps)
    if gemma:
        return (y * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    return weight.astype(x.dtype) * y.astype(x.dtype)


def rope(x_nthh: Array, cos_nth: Array, sin_nth: Array) -> Array:
    """Rotate-half RoPE on `[N, T, heads, H]`: x*cos + rotate_half(x)*sin (HF layout)."""
    half = x_nthh.shape[-1] // 2
    rotated = jnp.concatenate([-x_nthh[..., half:], x_nthh[..., :half]], axis=-1)
    cos = cos_nth[:, :, None, :].astype(x_nthh.dtype)
    sin = sin_nth[:, :, None, :].astype(x_nthh.dtype)
    return x_nthh * cos + rotated * sin


def rope_angles(positions_nt: Array, inv_freq: Array, scale: float = 1.0) -> tuple[Array, Array]:
    """cos, sin `[N, T, H]` float32 of angle = position * inv_freq (each frequency twice),
    times `scale` (YaRN's attention factor, `ModelConfig.rope_attention_factor`)."""
    angles = positions_nt.astype(jnp.float32)[..., None] * inv_freq[None, None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)
    if scale == 1.0:
        return jnp.cos(angles), jnp.sin(angles)
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


_REMAT = {
    "full": None,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


# Projections that read the same input, run as one matmul when fused by
# `Decoder.layer_params(fuse=True)`: fused name -> the parts concatenated along the output.
FUSED_PROJECTIONS = {"wqkv": ("wq", "wk", "wv"), "w_gate_up": ("w_gate", "w_up")}
MOE_PARAMS = ("w_router", "we_gate", "we_up", "we_down")


# Biases and norm scales by attribute name (`LayerStack`, `Decoder`, `ScalarHead`): what the
# Hugging Face Trainer exempts from weight decay (`grpojax.train.OptimizerConfig.decay_mask`).
BIAS_PARAMS = ("bq", "bk", "bv", "b")
NORM_PARAMS = (
    "attn_norm",
    "post_attn_norm",
    "mlp_norm",
    "post_mlp_norm",
    "q_norm",
    "k_norm",
    "final_norm",
)
# A full-attention layer's window in a model with sliding layers: longer than any sequence.
NO_WINDOW = 2**30


class LayerStack(nnx.Module):
    """All L transformer blocks, each parameter stacked along a leading `L` axis.

    Shapes: attn_norm/mlp_norm `[L, D]`; wq `[L, D, Q, H]`; wk, wv `[L, D, K, H]`;
    wo `[L, Q, H, D]`; bq `[L, Q, H]`, bk, bv `[L, K, H]` (qkv_bias);
    q_norm, k_norm `[L, H]` (qk_norm); post_attn_norm, post_mlp_norm `[L, D]` (Gemma: the
    attention's and the MLP's outputs normed before the residual sum; every Gemma norm scale
    starts at 0, `rms_norm(gemma=True)`); w_gate, w_up `[L, D, F]`; w_down `[L, F, D]` (dense),
    or, with `config.num_experts` E > 0, w_router `[L, D, E]`, we_gate, we_up `[L, E, D, F_e]`,
    we_down `[L, E, F_e, D]` (`grpojax.models.moe`).
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        c = config
        L, D, F, Q, K, H = (
            c.num_layers,
            c.hidden_size,
            c.intermediate_size,
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
        )
        pdt = c.params_dtype

        def normal(shape):
            return nnx.Param(
                0.02 * jax.random.normal(rngs.params(), shape, jnp.float32).astype(pdt)
            )

        def const(shape, value):
            return nnx.Param(jnp.full(shape, value, pdt))

        one = 0.0 if c.is_gemma else 1.0  # a norm's neutral scale
        self.attn_norm = const((L, D), one)
        self.wq = normal((L, D, Q, H))
        self.wk = normal((L, D, K, H))
        self.wv = normal((L, D, K, H))
        self.wo = normal((L, Q, H, D))
        if c.qkv_bias:
            self.bq = const((L, Q, H), 0.0)
            self.bk = const((L, K, H), 0.0)
            self.bv = const((L, K, H), 0.0)
        if c.qk_norm:
            self.q_norm = const((L, H), one)
            self.k_norm = const((L, H), one)
        if c.is_gemma:
            self.post_attn_norm = const((L, D), one)
            self.post_mlp_norm = const((L, D), one)
        self.mlp_norm = const((L, D), one)
        if c.is_moe:
            E, Fe = c.num_experts, c.moe_intermediate_size
            self.w_router = normal((L, D, E))
            self.we_gate = normal((L, E, D, Fe))
            self.we_up = normal((L, E, D, Fe))
            self.we_down = normal((L, E, Fe, D))
        else:
            self.w_gate = normal((L, D, F))
            self.w_up = normal((L, D, F))
            self.w_down = normal((L, F, D))

    def param_names(self, config: ModelConfig) -> tuple[str, ...]:
        names = ["attn_norm", "wq", "wk", "wv", "wo"]
        if config.qkv_bias:
            names += ["bq", "bk", "bv"]
        if config.qk_norm:
            names += ["q_norm", "k_norm"]
        if config.is_gemma:
            names += ["post_attn_norm", "post_mlp_norm"]
        mlp = MOE_PARAMS if config.is_moe else ("w_gate", "w_up", "w_down")
        return (*names, "mlp_norm", *mlp)


def _block(
    config: ModelConfig,
    p: dict[str, Array],
    x_ntd: Array,
    cos_nth: Array,
    sin_nth: Array,
    self_mask: SelfMask,
    kv_cache: tuple[Array, Array] | None,
    cache_allowed_ns: Array | None,
    lora_scale: float | None = None,
    lora_dropout: float = 0.0,
    kv_dtype=None,
    prefix_kv: tuple[Array, Array] | None = None,
    prefix_allowed_bs: Array | None = None,
    replay_ntk: Array | None = None,
    token_mask_nt: Array | None = None,
    window: int | Array | None = None,
    write_kv=None,
):
    """One pre-norm block: x + attn(norm(x)); then + SwiGLU(norm(x)), or + the mixture of
    SwiGLU experts (`moe.moe_mlp`) when `p` holds a router. Gemma (`config.is_gemma`):
    x + norm(attn(norm(x))), then x + norm(GeGLU(norm(x))).

    `p` holds this layer's parameters, with q|k|v and gate|up either apart or fused
    (`FUSED_PROJECTIONS`: one matmul each, the same values). It may hold LoRA adapters
    (`lora_<t>_a/_b`, with the projections apart), applied unmerged with `lora_scale`
    (`lora.project`; with this layer's dropout key, their input dropped at `lora_dropout`);
    without them each projection is the plain einsum. The T tokens attend to this layer's
    `kv_cache` (keys, values) where `cache_allowed_ns` allows, to their group's `prefix_kv`
    (keys `[B, K, H, P]`, values `[B, K, P, H]`) where `prefix_allowed_bs` allows, and
    among themselves as `self_mask` allows; without either (no cache, or an empty one) among
    themselves only. The attention backend is `config.attention` (`grpojax.models.attention`);
    `window` (a traced int, with `self_mask.positions`) is this layer's sliding window.
    A mixture of experts routes each token to `replay_ntk`'s experts when given (routing
    replay), else to its router's top k, and counts its load over `token_mask_nt`'s tokens.
    Returns (x, (k `[N, K, H, T]`, v `[N, K, T, H]`) of the T tokens in `kv_dtype`, or None
    when `kv_dtype` is None: the cache's layout), (the experts each token went to `[N, T, k]`
    int32, this layer's `moe.ExpertLoad`) or None for a dense MLP); the caller writes the keys
    and values after all layers. `write_kv` (decoding one token): a function that writes the
    new keys and values into this layer's cache and returns it (keys, values): the token
    then attends to that cache only, its own slot included (`cache_allowed_ns` allows it),
    so the cache is written in place before it is read."""
    cdt = config.compute_dtype
    eps = config.rms_norm_eps
    norm = lambda x, name: rms_norm(x, p[name], eps, gemma=config.is_gemma)
    h = norm(x_ntd, "attn_norm")

    def proj(spec, x, name):
        return lora.project(spec, x, p, name, cdt, lora_scale, lora_dropout)

    if "wqkv" in p:
        q_heads, kv_heads, hd = config.num_heads, config.num_kv_heads, config.head_dim
        q, k, v = jnp.split(
            proj("ntd,de->nte", h, "wqkv"), (q_heads * hd, (q_heads + kv_heads) * hd), axis=-1
        )
        q, k, v = (x.reshape(*x.shape[:2], -1, hd) for x in (q, k, v))
    else:
        q = proj("ntd,dqh->ntqh", h, "wq")
        k = proj("ntd,dkh->ntkh", h, "wk")
        v = proj("ntd,dkh->ntkh", h, "wv")
    if config.qkv_bias:
        q = q + p["bq"].astype(cdt)
        k = k + p["bk"].astype(cdt)
        v = v + p["bv"].astype(cdt)
    if config.qk_norm:
        q = norm(q, "q_norm")
        k = norm(k, "k_norm")
    q = rope(q, cos_nth, sin_nth)
    k = rope(k, cos_nth, sin_nth)
    new_kv: tuple[Array, ...] | None = None
    if kv_dtype is not None:
        new_kv = (jnp.transpose(k, (0, 2, 3, 1)), jnp.swapaxes(v, 1, 2))
        new_kv = tuple(x.astype(kv_dtype) for x in new_kv)
    impl = config.attention
    scale = config.attention_scale if config.query_pre_attn_scalar else None
    how: dict[str, Any] = dict(
        implementation=impl,
        block=config.attention_block,
        window=window,
        scale=scale,
        softcap=config.attn_logit_softcapping,
    )
    if write_kv is not None:
        kv_cache = write_kv(new_kv)
        how["self_keys"] = False
    if kv_cache is None and prefix_kv is None:
        # Context parallelism: whole sequences a device, heads over tensor x context, and
        # back to tokens over context after (`grpojax.models.sharding`); no-ops without it.
        whole = ("batch", "attn_seq", "attn_heads", "head_dim")
        q, k, v = (sharding.constrain(x, whole) for x in (q, k, v))
        o = attention(q, k, v, self_mask, **how)
        o = sharding.constrain(o, ("batch", "seq", "act_heads", "head_dim"))
    else:
        read = lambda kv, allowed: None if kv is None else (*(x.astype(cdt) for x in kv), allowed)
        o = attention_with_cache(
            q,
            k,
            v,
            self_mask,
            cache=read(kv_cache, cache_allowed_ns),
            prefix=read(prefix_kv, prefix_allowed_bs),
            **how,
        )
    o = proj("ntqh,qhd->ntd", o, "wo")
    x_ntd = x_ntd + (norm(o, "post_attn_norm") if config.is_gemma else o)
    h = norm(x_ntd, "mlp_norm")
    if "w_router" in p:
        y, selected, load = moe.moe_mlp(
            h,
            p["w_router"],
            p["we_gate"],
            p["we_up"],
            p["we_down"],
            k=config.num_experts_per_tok,
            norm_topk_prob=config.norm_topk_prob,
            selected_ntk=replay_ntk,
            mask_nt=token_mask_nt,
        )
        x_ntd = sharding.constrain(x_ntd + y, ("batch", "seq", "act_embed"))
        return x_ntd, new_kv, (selected, load)
    if "w_gate_up" in p:
        gate, up = jnp.split(proj("ntd,df->ntf", h, "w_gate_up"), 2, axis=-1)
    else:
        gate = proj("ntd,df->ntf", h, "w_gate")
        up = proj("ntd,df->ntf", h, "w_up")
    act = jax.nn.silu if config.hidden_act == "silu" else _gelu_tanh
    y = proj("ntf,fd->ntd", act(gate) * up, "w_down")
    x_ntd = x_ntd + (norm(y, "post_mlp_norm") if config.is_gemma else y)
    x_ntd = sharding.constrain(x_ntd, ("batch", "seq", "act_embed"))
    return x_ntd, new_kv, None


def _gelu_tanh(x: Array) -> Array:
    """GELU's tanh approximation (`gelu_pytorch_tanh`)."""
    return jax.nn.gelu(x, approximate=True)


class Decoder(nnx.Module):
    """Decoder-only transformer: embed -> L scanned blocks -> final RMSNorm.

    Parameters: embed `[V, D]`, layers (`LayerStack`), final_norm `[D]`, and
    lm_head `[D, V]` unless `tie_word_embeddings`; optionally LoRA adapters in `lora`
    (`grpojax.models.lora.add_lora`), applied while the static `lora_enabled` is True
    (`lora.adapters_off(model)` switches them off). See the module docstring for the
    call contract.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        pdt = config.params_dtype
        V, D = config.vocab_size, config.hidden_size
        self.embed = nnx.Param(0.02 * jax.random.normal(rngs.params(), (V, D)).astype(pdt))
        self.layers = LayerStack(config, rngs=rngs)
        self.final_norm = nnx.Param(jnp.full((D,), 0.0 if config.is_gemma else 1.0, pdt))
        if not config.tie_word_embeddings:
            self.lm_head = nnx.Param(0.02 * jax.random.normal(rngs.params(), (D, V)).astype(pdt))
        self.lora: lora.LoRA | None = nnx.data(None)  # data even while None: a module later
        self.lora_enabled = True

    def named_params(self) -> dict[str, nnx.Param]:
        """Dotted name -> Param for every parameter (layer params are `layers.<name>`,
        LoRA adapters, when present, `lora.<t>_a` / `lora.<t>_b`)."""
        out = {"embed": self.embed}
        for name in self.layers.param_names(self.config):
            out[f"layers.{name}"] = getattr(self.layers, name)
        out["final_norm"] = self.final_norm
        if not self.config.tie_word_embeddings:
            out["lm_head"] = self.lm_head
        if self.lora is not None:
            for name in self.lora.names():
                out[f"lora.{name}"] = getattr(self.lora, name)
        return out

    def layer_params(
        self, lora_dropout_key: Array | None = None, *, fuse: bool = False
    ) -> dict[str, Array]:
        """The layers' stacked parameters `[L, ...]` as the forward runs them, with the active
        LoRA adapters (and their per-layer dropout keys, given `lora_dropout_key`).

        `fuse`: q|k|v and gate|up concatenated along their outputs (`wqkv` `[L, D, (Q+2K)H]`,
        `w_gate_up` `[L, D, 2F]`), so each layer runs one matmul for each group, with the
        same values. Without adapters only (each target's adapter needs its own
        projection); with them the projections stay apart. A caller that runs the model
        many times on the same weights builds this once and passes it as `layer_params`:
        the sampler's decode loop does (concatenating inside the loop would copy the
        weights on every step)."""
        stacked = {
            name: getattr(self.layers, name)[...] for name in self.layers.param_names(self.config)
        }
        adapters = lora.stacked_adapters(self, lora_dropout_key)
        if fuse and not adapters:
            for fused, parts in FUSED_PROJECTIONS.items():
                if not all(name in stacked for name in parts):
                    continue  # a mixture of experts: no dense gate|up
                flat = [stacked.pop(name) for name in parts]
                flat = [w.reshape(*w.shape[:2], -1) for w in flat]  # [L, D, out]
                stacked[fused] = jnp.concatenate(flat, axis=-1)
        return {**stacked, **adapters}

    def __call__(
        self,
        tokens_nt: Array,
        *,
        positions_nt: Array | None = None,
        mask_nt: Array | None = None,
        cache: KVCache | None = None,
        prefill: bool = False,
        prefix: KVCache | None = None,
        lora_dropout_key: Array | None = None,
        layer_params: dict[str, Array] | None = None,
        cache_extent: int | None = None,
        segment_ids_nt: Array | None = None,
        parent_ids_nt: Array | None = None,
        routing_ntlk: Array | None = None,
        return_routing: bool = False,
    ) -> Any:
        """`prefill=True` (static; with a `cache` that holds no tokens yet, as `init_cache`
        makes it): the T tokens attend among themselves only, as without a cache, and are
        written at slots [0, T); the empty cache is not read, which saves the attention over
        its S slots and the compiler's constant folding of that fully masked attention.
        `prefix`: a filled cache of B rows, read only, that groups of J = N / B contiguous
        rows share (row n reads prefix row n // J; the G samples of one prompt): the tokens
        attend to its filled real slots as well, before the cache's; with or without a
        `cache`, and with `prefill`.
        `lora_dropout_key`: a key for the adapters' input dropout (training forwards of a
        model with `lora.dropout` > 0); None (every other forward): no dropout.
        `layer_params`: this model's `layer_params(...)`, built once by a caller that runs
        the model in a loop (None: built here, with `lora_dropout_key`).
        `cache_extent` (static): the tokens read only the cache's first `cache_extent` slots,
        which must hold every filled one (None: all S). Each layer then copies and reads
        that many slots: a decode loop whose cache is mostly still empty reads less.
        `segment_ids_nt`: `[N, T]` int32 for packed rows (several sequences per row, each a
        run of one id, 0 at padding): a token attends causally within its own segment
        only, and `mask_nt` defaults to `segment_ids_nt > 0`; `positions_nt` (each
        segment's own positions) is then required.
        `routing_ntlk` (a mixture of experts only): `[N, T, L, k]` int32 expert ids; token
        (n, t) goes to experts `routing_ntlk[n, t, l]` in layer l instead of its router's top
        k (routing replay: the router still weighs them, `grpojax.models.moe`).
        `return_routing` (static): return (hidden, cache, `moe.Routing`: the experts each
        token went to `[N, T, L, k]` and the experts' load over the real tokens, for
        `moe.load_balancing_loss`; None for a dense model) instead of (hidden, cache)."""
        c = self.config
        cdt = c.compute_dtype
        if tokens_nt.ndim != 2:
            raise ValueError(f"tokens_nt must be [N, T], got shape {tokens_nt.shape}")
        n, t = tokens_nt.shape
        if mask_nt is None and segment_ids_nt is not None:
            mask_nt = segment_ids_nt > 0
        mask_nt = jnp.ones((n, t), jnp.bool_) if mask_nt is None else mask_nt.astype(jnp.bool_)
        if positions_nt is None:
            if cache is not None or prefix is not None or segment_ids_nt is not None:
                raise ValueError(
                    "positions_nt is required with a cache or a prefix (positions after it) and "
                    "with segment_ids_nt (each segment's own positions)"
                )
            positions_nt = positions_from_mask(mask_nt)
        if prefill and cache is None:
            raise ValueError("prefill=True needs the (empty) cache to write the tokens into")
        if prefix is not None and (prefix.k.shape[1] < 1 or n % prefix.k.shape[1]):
            raise ValueError(f"prefix rows ({prefix.k.shape[1]}) must divide the {n} rows")
        replay_xs = None
        if routing_ntlk is not None:
            want = (n, t, c.num_layers, c.num_experts_per_tok)
            if not c.is_moe or tuple(routing_ntlk.shape) != want:
                raise ValueError(
                    f"routing_ntlk must be [N, T, L, k] = {want} for a mixture of experts, got "
                    f"shape {tuple(routing_ntlk.shape)} (num_experts={c.num_experts})"
                )
            replay_xs = jnp.transpose(routing_ntlk.astype(jnp.int32), (2, 0, 1, 3))

        x = jnp.take(self.embed[...], tokens_nt, axis=0).astype(cdt)
        if c.is_gemma:  # in the compute dtype, as transformers scales in the weights' dtype
            x = x * jnp.asarray(c.hidden_size**0.5, cdt)
        x = sharding.constrain(x, ("batch", "seq", "act_embed"))
        rope = [rope_angles(positions_nt, jnp.asarray(c.inv_freq()), c.rope_attention_factor)]
        windows = c.layer_windows()
        windowed = any(w is not None for w in windows)
        if c.rope_local_theta and windowed:  # the sliding layers' own frequencies (Gemma 3)
            rope.append(rope_angles(positions_nt, jnp.asarray(c.inv_freq(local=True))))

        # A sliding window compares positions: the keys' and queries' (`SelfMask.positions`).
        positions = positions_nt if windowed else None
        if segment_ids_nt is None:
            if parent_ids_nt is not None:
                raise ValueError("parent_ids_nt needs segment_ids_nt (packed rows)")
            self_mask = SelfMask.from_mask(mask_nt, positions=positions)
        else:
            self_mask = SelfMask.packed(segment_ids_nt, parent_ids_nt, positions=positions)
        cache_read = None if prefill else cache  # the cache the tokens read, if any
        read_cache = cache_read is not None
        cache_allowed = None if cache_read is None else cache_read.readable_ns()
        prefix_allowed = None if prefix is None else prefix.readable_ns()

        if layer_params is None:
            layer_params = self.layer_params(lora_dropout_key)
        adapters = self.lora if lora.adapters_active(self) else None
        lora_scale = None if adapters is None else adapters.lora_config.scale
        lora_dropout = 0.0 if adapters is None else adapters.lora_config.dropout

        kv_dtype = None if cache is None else cache.k.dtype

        extent = None if cache_read is None else cache_read.mask_ns.shape[1]
        if read_cache and cache_extent is not None:
            assert cache_allowed is not None and extent is not None  # both set when read_cache
            if not 1 <= int(cache_extent) <= extent:
                raise ValueError(f"cache_extent must be in [1, {extent}], got {cache_extent}")
            extent = int(cache_extent)
            cache_allowed = cache_allowed[:, :extent]

        def layer_cache(layer):
            """This layer's keys and values, the first `extent` slots: one copy each."""
            if not read_cache:
                return None
            _, n_c, k_c, h_c, _ = cache.k.shape
            at = (layer, 0, 0, 0, 0)
            k = jax.lax.dynamic_slice(cache.k, at, (1, n_c, k_c, h_c, extent))
            v = jax.lax.dynamic_slice(cache.v, at, (1, n_c, k_c, extent, h_c))
            return k[0], v[0]

        # One window for every layer (Mistral) stays a Python int: the fused attention
        # (`attention.fused_attention`) takes a static window only. Windows that differ by
        # layer (Gemma 3) go through the scan as an int32 a layer, or, where the fused op
        # is asked for and T > 1 (a decode step takes the einsum anyway), as the index of
        # one of the distinct windows, each layer a `lax.switch` between branches whose
        # window is static (None: full attention).
        static_window = windows[0] if windowed and len(set(windows)) == 1 else None
        distinct = sorted(set(windows), key=lambda w: NO_WINDOW if w is None else w)
        switched = (
            windowed
            and static_window is None
            and t > 1
            and takes_fused(c.attention)
            and c.attn_logit_softcapping is None
        )

        def body(x, xs):
            if switched:
                *rest, index = xs
                branches = [functools.partial(one_layer, window=w) for w in distinct]
                return jax.lax.switch(index, branches, x, tuple(rest))
            *rest, window = xs
            return one_layer(x, tuple(rest), window if static_window is None else static_window)

        def one_layer(x, xs, window):
            p, layer, prefix_kv, replay = xs
            cos, sin = rope[0]
            if len(rope) > 1 and window is not None:  # a sliding layer: the local frequencies
                if isinstance(window, int):
                    cos, sin = rope[1] if window < NO_WINDOW else rope[0]
                else:
                    local = window < NO_WINDOW
                    cos, sin = (jnp.where(local, a, b) for a, b in zip(rope[1], rope[0]))
            x, new_kv, selected = _block(
                c,
                p,
                x,
                cos,
                sin,
                self_mask,
                layer_cache(layer),
                cache_allowed,
                lora_scale,
                lora_dropout,
                kv_dtype,
                prefix_kv,
                prefix_allowed,
                replay,
                mask_nt,
                window,
            )
            return x, (new_kv, selected)

        if c.remat != "none":
            body = jax.checkpoint(body, policy=_REMAT[c.remat], prevent_cse=False)
        prefix_xs = None if prefix is None else (prefix.k, prefix.v)
        layers = jnp.arange(c.num_layers, dtype=jnp.int32)
        window_xs = None
        if switched:
            window_xs = jnp.asarray([distinct.index(w) for w in windows], jnp.int32)
        elif windowed and static_window is None:
            window_xs = jnp.asarray([NO_WINDOW if w is None else w for w in windows], jnp.int32)
        xs = (layer_params, layers, prefix_xs, replay_xs, window_xs)
        x, (new_kv, selected) = jax.lax.scan(body, x, xs)
        hidden = rms_norm(x, self.final_norm[...], c.rms_norm_eps, gemma=c.is_gemma)
        routing = None
        if selected is not None:  # ([L, N, T, k], ExpertLoad of [L, ...]) from the scan
            experts, load = selected
            load = jax.tree.map(lambda x: jnp.sum(x, axis=0), load)
            routing = moe.Routing(jnp.transpose(experts, (1, 2, 0, 3)), load)
        new_cache = None if cache is None else self._write_cache(cache, new_kv, mask_nt)
        return (hidden, new_cache, routing) if return_routing else (hidden, new_cache)

    def decode_step(
        self,
        tokens_n: Array,
        positions_n: Array,
        cache: LayerCache,
        layers: tuple[dict[str, Array], ...],
    ) -> tuple[Array, LayerCache]:
        """One token for each of N rows in lock step, the layers unrolled: each layer reads
        its own weights (`split_layers`) and its own keys and values (`LayerCache`) in place,
        so a decode loop copies neither out of stacked `[L, ...]` arrays (the scanned
        `__call__` slices both on every step). The same function as `__call__` on one token
        with a `KVCache` holding the same slots (the same attention over the same key sets).

        tokens_n, positions_n: `[N]` int32, the fed tokens and their RoPE positions.
        cache: every row's keys and values; the token is written at slot `cache.index` (`[]`,
          the same for every row), in place, then reads that slot and those `cache.mask_ns`
          marks.
        layers: L per-layer parameter dicts (`split_layers(model.layer_params(...))`).
        Returns (hidden `[N, 1, D]` after the final norm, the cache with the slot written and
        the index advanced)."""
        c = self.config
        n = tokens_n.shape[0]
        tokens_nt, positions_nt = tokens_n[:, None], positions_n[:, None]
        mask_nt = jnp.ones((n, 1), jnp.bool_)
        x = jnp.take(self.embed[...], tokens_nt, axis=0).astype(c.compute_dtype)
        if c.is_gemma:
            x = x * jnp.asarray(c.hidden_size**0.5, c.compute_dtype)
        x = sharding.constrain(x, ("batch", "seq", "act_embed"))
        windows = c.layer_windows()
        windowed = any(w is not None for w in windows)
        angles = rope_angles(positions_nt, jnp.asarray(c.inv_freq()), c.rope_attention_factor)
        local = angles
        if c.rope_local_theta and windowed:
            local = rope_angles(positions_nt, jnp.asarray(c.inv_freq(local=True)))
        self_mask = SelfMask.from_mask(mask_nt, positions=positions_nt if windowed else None)
        adapters = self.lora if lora.adapters_active(self) else None
        lora_scale = None if adapters is None else adapters.lora_config.scale
        slot = jnp.asarray(cache.index, jnp.int32)
        mask = jax.lax.dynamic_update_slice(cache.mask_ns, mask_nt, (0, slot))
        ks, vs = list(cache.k), list(cache.v)

        def write(layer, new_kv):
            ks[layer] = jax.lax.dynamic_update_slice(ks[layer], new_kv[0], (0, 0, 0, slot))
            vs[layer] = jax.lax.dynamic_update_slice(vs[layer], new_kv[1], (0, 0, slot, 0))
            return ks[layer], vs[layer]

        for layer, (p, w) in enumerate(zip(layers, windows)):
            window = (NO_WINDOW if w is None else w) if windowed else None
            cos, sin = local if w is not None else angles
            x, _, _ = _block(
                c, p, x, cos, sin, self_mask, None, mask, lora_scale, 0.0, ks[layer].dtype,
                window=window, token_mask_nt=mask_nt,
                write_kv=functools.partial(write, layer),
            )  # fmt: skip
        hidden = rms_norm(x, self.final_norm[...], c.rms_norm_eps, gemma=c.is_gemma)
        return hidden, LayerCache(k=tuple(ks), v=tuple(vs), mask_ns=mask, index=slot + 1)

    @staticmethod
    def _write_cache(cache: KVCache, new_kv, mask_nt: Array) -> KVCache:
        """The cache with the T new slots of all layers written."""
        n, t = mask_nt.shape
        # One write of the T new slots of all layers, after the scan (not a rewrite of the
        # whole cache inside it): in place in the sampler's decode loop.
        index = jnp.asarray(cache.index, jnp.int32)
        if index.ndim == 0:
            k = jax.lax.dynamic_update_slice(cache.k, new_kv[0], (0, 0, 0, 0, index))
            v = jax.lax.dynamic_update_slice(cache.v, new_kv[1], (0, 0, 0, index, 0))
            m = jax.lax.dynamic_update_slice(cache.mask_ns, mask_nt, (0, index))
        else:  # each row at its own slot: one scatter in the cache's own layout, in place
            # (XLA:CPU writes only the updates when told the indices are unique and sorted;
            # without the hint the scatter cost 40% of a decode step at 8 rows x 543 slots).
            # index[n] + T <= S is the caller's to keep (rows must not write past the cache).
            rows_n1 = jnp.arange(n, dtype=jnp.int32)[:, None]
            slots_nt = index[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
            hint: dict[str, Any] = dict(unique_indices=True, indices_are_sorted=True)
            # Advanced indices on the row and slot axes put [N, T] first in the update.
            k_new = jnp.moveaxis(new_kv[0], (1, 4), (0, 1))
            v_new = jnp.moveaxis(new_kv[1], (1, 3), (0, 1))
            k = cache.k.at[:, rows_n1, :, :, slots_nt].set(k_new, **hint)
            v = cache.v.at[:, rows_n1, :, slots_nt].set(v_new, **hint)
            m = cache.mask_ns.at[rows_n1, slots_nt].set(mask_nt, **hint)
        return KVCache(k=k, v=v, mask_ns=m, index=index + t)

    def lm_head_dv(self) -> Array:
        """The output matrix `[D, V]` (embedding transposed when tied) in the compute dtype.

        The matrix the logits are computed with, on every path: `logits` (the sampler) and
        the chunked float32 log-softmax of the train steps (which upcasts it exactly), so
        float32 masters and a bf16 compute dtype give both paths the same weights.
        Gradients flow back through the cast to the parameter.

        With an active adapter on the head (`lora` target `lm_head`) it is the merged
        W + (alpha / r) A B in float32 instead (`lora.merged_head`; why merged and why float32:
        the `grpojax.models.lora` docstring), and gradients reach A and B through it."""
        w = self._base_head_dv()
        return lora.merged_head(self, w) if lora.head_active(self) else w

    def _base_head_dv(self) -> Array:
        """The base output matrix `[D, V]` (embedding transposed when tied, no adapter) in
        the compute dtype."""
        w = self.embed[...].T if self.config.tie_word_embeddings else self.lm_head[...]
        return w.astype(self.config.compute_dtype)

    def logits(self, hidden_ntd: Array) -> Array:
        """logits = hidden @ W_out, `[N, T, V]` float32 (accumulated in float32); with an
        active head adapter, + (alpha / r) (hidden A) B, unmerged (`lora.head_delta_logits`);
        then c tanh(logits / c) with the config's `final_logit_softcapping` c (Gemma 2)."""
        w = self._base_head_dv().astype(hidden_ntd.dtype)
        out = jnp.einsum("...d,dv->...v", hidden_ntd, w, preferred_element_type=jnp.float32)
        if lora.head_active(self):
            out = out + lora.head_delta_logits(self, hidden_ntd)
        cap = self.config.final_logit_softcapping
        return out if cap is None else cap * jnp.tanh(out / cap)


class ScalarHead(nnx.Module):
    """A linear map D -> 1 applied in float32: y = h . w + b (value or reward head)."""

    def __init__(self, hidden_size: int, *, rngs: nnx.Rngs):
        self.w = nnx.Param(0.02 * jax.random.normal(rngs.params(), (hidden_size,), jnp.float32))
        self.b = nnx.Param(jnp.zeros((), jnp.float32))

    def __call__(self, hidden_ntd: Array) -> Array:
        h = hidden_ntd.astype(jnp.float32)
        return jnp.einsum("...d,d->...", h, self.w[...]) + self.b[...]


class ValueModel(nnx.Module):
    """PPO critic: a decoder backbone and a scalar head, one value per token.

    values_nt = head(backbone(tokens_nt)) `[N, T]` float32 (padding positions hold
    whatever the head gives; losses mask them).
    """

    def __init__(self, backbone: Decoder, *, rngs: nnx.Rngs):
        self.backbone = backbone
        self.head = ScalarHead(backbone.config.hidden_size, rngs=rngs)

    def __call__(self, tokens_nt, *, positions_nt=None, mask_nt=None) -> Array:
        hidden, _ = self.backbone(tokens_nt, positions_nt=positions_nt, mask_nt=mask_nt)
        return self.head(hidden)


class RewardModel(nnx.Module):
    """Sequence reward model: a decoder backbone and a scalar head read at the last real token.

    reward_n = head(hidden[n, last_token_index(mask)[n]]) `[N]` float32, so the same
    sequence gives the same reward under left or right padding.
    """

    def __init__(self, backbone: Decoder, *, rngs: nnx.Rngs):
        self.backbone = backbone
        self.head = ScalarHead(backbone.config.hidden_size, rngs=rngs)

    def __call__(self, tokens_nt, *, mask_nt, positions_nt=None) -> Array:
        hidden, _ = self.backbone(tokens_nt, positions_nt=positions_nt, mask_nt=mask_nt)
        last_n = last_token_index(mask_nt)
        hidden_nd = jnp.take_along_axis(hidden, last_n[:, None, None], axis=1)[:, 0]
        return self.head(hidden_nd)


def shared_prefix_forward(
    model: Decoder,
    tokens_ns: Array,
    mask_ns: Array,
    positions_ns: Array,
    *,
    prefix_width: int,
    group_size: int,
    lora_dropout_key: Array | None = None,
    routing_nslk: Array | None = None,
    with_load: bool = False,
) -> Any:
    """The forward of `model(tokens_ns, ...)` with each group's prefix computed once.

    Rows come in contiguous groups of G that share their first P columns (the G samples of
    one left-padded prompt): rows b*G .. b*G+G-1 must hold the same tokens, mask and
    positions in columns [0, P). The B = N/G prefixes are run once into a KV cache of B
    rows and P slots; the N suffixes (columns [P, S)) then attend to it as their `prefix`
    (each group's keys read once, not copied to its G rows). Same results as the full
    forward up to float rounding, with B*P + N*(S-P) token positions instead of N*S, and
    differentiable (the prefix's gradient sums over its group).

    Args:
      model: a `Decoder`.
      tokens_ns: `[N, S]` as in the call contract (N = B*G).
      mask_ns: `[N, S]` as in the call contract (N = B*G).
      positions_ns: `[N, S]` as in the call contract (N = B*G).
      prefix_width: P (static), 1 <= P < S.
      group_size: G (static) >= 1, dividing N.
      lora_dropout_key: the adapters' dropout key (None: no dropout); the prefix and the
        suffix forward use fold_in(key, 0) and fold_in(key, 1).
      routing_nslk: `[N, S, L, k]` experts to replay (a mixture of experts; `Decoder`'s
        `routing_ntlk`), the prefix's read from each group's first row; None: routed anew.
      with_load (static): also return the mixture of experts' `moe.ExpertLoad` over the
        real tokens of both forwards (a group's prefix counted once).

    Returns:
      (prefix_hidden_bpd `[B, P, D]`, suffix_hidden_ntd `[N, S - P, D]`), with `with_load`
      and the load after them.
    """
    n, s = tokens_ns.shape
    p, g = int(prefix_width), int(group_size)
    if not 1 <= p < s:
        raise ValueError(f"prefix_width P={p} must be in [1, S) with S={s}")
    if g < 1 or n % g:
        raise ValueError(f"group_size G={g} must be >= 1 and divide the {n} rows")
    mask_ns = jnp.asarray(mask_ns, jnp.bool_)
    cache: KVCache | None = init_cache(model.config, n // g, p)
    prefix = lambda x: x[::g, :p]
    keys: tuple[Array | None, ...] = (None, None)
    if lora_dropout_key is not None:
        keys = tuple(jax.random.fold_in(lora_dropout_key, i) for i in (0, 1))
    replay = (None, None) if routing_nslk is None else (prefix(routing_nslk), routing_nslk[:, p:])
    h_prefix, cache, *r_prefix = model(
        prefix(tokens_ns),
        positions_nt=prefix(positions_ns),
        mask_nt=prefix(mask_ns),
        cache=cache,
        prefill=True,
        lora_dropout_key=keys[0],
        routing_ntlk=replay[0],
        return_routing=with_load,
    )
    h_suffix, _, *r_suffix = model(
        tokens_ns[:, p:],
        positions_nt=positions_ns[:, p:],
        mask_nt=mask_ns[:, p:],
        prefix=cache,
        lora_dropout_key=keys[1],
        routing_ntlk=replay[1],
        return_routing=with_load,
    )
    if with_load:
        dense = r_prefix[0] is None  # no experts: no load
        load = None if dense else jax.tree.map(jnp.add, r_prefix[0].load, r_suffix[0].load)
        return h_prefix, h_suffix, load
    return h_prefix, h_suffix


def forward_logits(model: Decoder, tokens_nt: Array, mask_nt: Array | None = None) -> Array:
    """Full-sequence logits `[N, T, V]` float32 with positions = cumsum(mask) - 1."""
    hidden, _ = model(tokens_nt, mask_nt=mask_nt)
    return model.logits(hidden)
