"""LoRA adapters on the decoder's stacked layers: one copy of the base weights, adapters beside.

For a target projection with base weight `W` (our layout `[L, *in, *out]`), the layer computes

    y = x W + (alpha / r) * (x A) B          A `[L, *in, r]`, B `[L, r, *out]`

applied unmerged (the base matmul is unchanged; the adapter adds two thin matmuls). A is
Gaussian with std 1/sqrt(fan_in) and B is zero, so a freshly added adapter leaves the
model's outputs bit-identical.

Dropout (`LoRAConfig.dropout` = p > 0, PEFT's `lora_dropout`) acts on the adapter's input
only, and only in a forward given a key (the train step's gradient pass):

    y = x W + (alpha / r) * (drop(x) A) B,   drop(x) = x * m / (1 - p),  m ~ Bernoulli(1 - p)

so E[drop(x)] = x and the expected adapter delta is the undropped one. Every call without a
key (the sampler, the reference, evaluation, pi_old's logprobs) runs without dropout. The
mask of layer l and target t comes from fold_in(split(key, L)[l], index of t).

Targets, by Hugging Face module name:

    q -> self_attn.q_proj (wq `[L, D, Q, H]`)   k, v -> k_proj, v_proj (`[L, D, K, H]`)
    o -> self_attn.o_proj (wo `[L, Q, H, D]`)   gate, up -> mlp.gate_proj, up_proj (`[L, D, F]`)
    down -> mlp.down_proj (w_down `[L, F, D]`)
    lm_head -> lm_head (the output projection `[D, V]`; optional, not in the default targets)

The LM head's adapter (A `[D, r]`, B `[r, V]`, one for the model, not stacked) gives
logits = h W + (alpha / r) (h A) B. The sampler's `Decoder.logits` applies it unmerged (two
thin matmuls per decode step; merging would add a `[D, r] x [r, V]` product and a `[D, V]`
write to every step). The train steps' chunked logprob / entropy / KL path takes one `[D, V]`
matrix (`Decoder.lm_head_dv`), so there the head is merged once per forward:
W_eff = W + (alpha / r) A B, in float32 (D * V * 4 bytes, one extra copy of the head,
and D * V * r flops, small next to the N * T * D * V of the logits), and gradients reach A
and B through it (dA = s dW_eff B^T, dB = s A^T dW_eff). Float32, not the compute dtype:
rounding W_eff to bf16 would drop every adapter update below W's bf16 ulp (2^-8 relative),
which is all of them early on, as B starts at zero. Both paths multiply the same
compute-dtype h and W with float32 accumulation, so they agree to float32 rounding. The head
adapter takes no dropout (the merged matrix cannot drop its input): `lm_head` with
dropout > 0 is refused, and so is `lm_head` on a model with tied embeddings (the adapter
would leave the tied embedding as it is, and the merged weights could not be written tied).

Adapters live in `model.lora` (a `LoRA` module) as `LoRAParam`s, a subclass of `nnx.Param`:
`nnx.state(model, LoRAParam)` selects only them, and `nnx.split(model, LoRAParam, ...)`
splits them from the base. They shard like their base weight (`adapter_axes`: A keeps the
base's input axes, B its output axes, the rank axis is replicated).

The reference policy is the same model with adapters switched off (`adapters_off(model)`),
not a second copy of the base weights. The switch is a static attribute of the decoder
(`lora_enabled`), so it is part of the NNX graphdef: a jitted function keyed on the
graphdef traces each setting separately, and toggling inside a traced function (after
`nnx.merge`) changes only the code traced from then on. With adapters off the forward is
the base model's program exactly.

Why not qwix (google/qwix, what Tunix uses): its LoRA provider intercepts `jnp.einsum` /
`dot_general` calls and finds which weight an operand is by walking the Python stack to the
current NNX module (`self`) and matching the operand to one of that module's `nnx.Param`
attributes (by identity, through a chain of unary ops, or by shape). The decoder here
stacks every layer's weights along L and runs the layers under one `jax.lax.scan`: the
einsums run in a plain function inside the scan body, the operand is a per-layer slice
produced by the scan (not a unary chain from `LayerStack.wq`), the module found on the
stack is the `Decoder` (whose attributes hold `layers`, not `wq`), and no attribute has the
per-layer shape. So qwix finds no weight and adds no adapter, silently. Even where it did
match, it creates adapters lazily by setting attributes on the module during the first
traced call, with the per-layer shape (`[D, r]`: one adapter shared by all layers, created
inside a scan trace), and it has no switch to run the same module without adapters (the
reference policy would need a second model object). PEFT export also needs the adapter's
mapping to HF module names, which lives with the HF tensor table here anyway.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import Array

from grpojax.models.lora_targets import (
    ALL_TARGETS,
    HEAD,
    TARGET_NAMES,
    TARGET_OF_BASE,
    TARGETS,
    adapter_axes,
)
from grpojax.models.sharding import PARAM_AXES, logical_to_spec
from grpojax.ops.checks import check_choice, check_int, check_number


class LoRAParam(nnx.Param):
    """A trainable LoRA adapter matrix (A or B); the base weights stay plain `nnx.Param`s."""


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """LoRA hyperparameters.

    Attributes:
      rank: r >= 1, the inner dimension of each adapter.
      alpha: > 0; the adapter's output is scaled by alpha / r (PEFT's `lora_alpha`).
      targets: a non-empty subset of ("q", "k", "v", "o", "gate", "up", "down", "lm_head")
        (default: the seven layer projections).
      dropout: p in [0, 1), dropout on the adapters' input in forwards given a key (0 when
        the targets include "lm_head").
    """

    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = ALL_TARGETS
    dropout: float = 0.0

    def __post_init__(self):
        check_int("rank", self.rank, minimum=1)
        check_number("alpha", self.alpha, minimum=0, strict=True, array_ok=False)
        targets = tuple(self.targets)
        if not targets or len(set(targets)) != len(targets):
            raise ValueError(
                f"targets must be a non-empty list of distinct names from {TARGET_NAMES}, "
                f"got {list(targets)}"
            )
        for t in targets:
            check_choice("targets", t, TARGET_NAMES)
        check_number("dropout", self.dropout, minimum=0, maximum=1, strict_max=True, array_ok=False)
        object.__setattr__(self, "dropout", float(self.dropout))
        if HEAD in targets and self.dropout > 0:
            raise ValueError(
                "dropout must be 0 when targets include lm_head (the head's adapter is merged "
                "into one matrix in the train steps, which cannot drop its input), "
                f"got {self.dropout!r}"
            )
        # Canonical order, so the config (and the parameter order) does not depend on spelling.
        object.__setattr__(self, "targets", tuple(t for t in TARGET_NAMES if t in targets))

    @property
    def layer_targets(self) -> tuple[str, ...]:
        """The targets inside the decoder layers (stacked along L), without `lm_head`."""
        return tuple(t for t in self.targets if t != HEAD)

    @property
    def scale(self) -> float:
        """alpha / r."""
        return float(self.alpha) / self.rank


class LoRA(nnx.Module):
    """The adapters of every target, stacked along L like the base weights.

    Attributes `<t>_a` `[L, *in, r]` and `<t>_b` `[L, r, *out]` (`LoRAParam`) for each layer
    target t, and `lm_head_a` `[D, r]`, `lm_head_b` `[r, V]` for the head (`lm_head`: the
    `[D, V]` output matrix, needed only then).
    """

    def __init__(self, layers, lora_config: LoRAConfig, *, rngs: nnx.Rngs, lm_head=None):
        self.lora_config = lora_config
        for t in lora_config.targets:
            if t == HEAD:
                if lm_head is None:
                    raise ValueError("lora targets include lm_head but no lm_head was given")
                (D, V), dtype = tuple(lm_head.shape), lm_head[...].dtype
                a = jax.random.normal(rngs.params(), (D, lora_config.rank), jnp.float32)
                self.lm_head_a = LoRAParam((a / math.sqrt(D)).astype(dtype))
                self.lm_head_b = LoRAParam(jnp.zeros((lora_config.rank, V), dtype))
                continue
            target = TARGETS[t]
            w = getattr(layers, target.base)
            shape, dtype = tuple(w.shape), w[...].dtype
            L, in_shape, out_shape = shape[0], shape[1 : 1 + target.n_in], shape[1 + target.n_in :]
            fan_in = math.prod(in_shape)
            a = jax.random.normal(rngs.params(), (L, *in_shape, lora_config.rank), jnp.float32)
            setattr(self, f"{t}_a", LoRAParam((a / math.sqrt(fan_in)).astype(dtype)))
            setattr(self, f"{t}_b", LoRAParam(jnp.zeros((L, lora_config.rank, *out_shape), dtype)))

    def names(self) -> tuple[str, ...]:
        return tuple(f"{t}_{m}" for t in self.lora_config.targets for m in ("a", "b"))


def add_lora(model, lora_config: LoRAConfig, *, rngs: nnx.Rngs):
    """Attach fresh adapters (A random, B zero) to a `Decoder` in place; returns the model.

    The model's outputs are unchanged until B is trained. Adapters take the base weights'
    dtype (float32 masters by default) and, when the base weights are sharded, are placed
    with the matching partition specs.
    """
    if getattr(model, "lora", None) is not None:
        raise ValueError("the model already has LoRA adapters")
    head = None
    if HEAD in lora_config.targets:
        if model.config.tie_word_embeddings:
            raise ValueError(
                "lora.targets includes lm_head, but this model ties its output matrix to the "
                "embedding (tie_word_embeddings); drop lm_head from lora.targets"
            )
        head = model.lm_head
    layers = model.layers
    missing = [t for t in lora_config.targets if t != HEAD and not hasattr(layers, TARGETS[t].base)]
    if missing:
        raise ValueError(
            f"lora.targets {', '.join(missing)}: this model has no dense {'/'.join(missing)} "
            "projection (a mixture of experts' MLP takes no adapters); target among q, k, v, o"
        )
    model.lora = LoRA(model.layers, lora_config, rngs=rngs, lm_head=head)
    model.lora_enabled = True
    mesh = _mesh_of(model.embed[...])
    # Many processes: every one holds the same values (same key); the train state's
    # `put_global` places them.
    if mesh is not None and jax.process_count() == 1:
        for name in model.lora.names():
            var = getattr(model.lora, name)
            spec = logical_to_spec(PARAM_AXES[f"lora.{name}"], tuple(var.shape), dict(mesh.shape))
            var.set_value(jax.device_put(var[...], jax.sharding.NamedSharding(mesh, spec)))
    return model


def _mesh_of(x):
    s = getattr(x, "sharding", None)
    return s.mesh if isinstance(s, jax.sharding.NamedSharding) else None


def has_adapters(model) -> bool:
    """Whether `model` (a Decoder, or a head model over one) carries LoRA adapters."""
    decoder = getattr(model, "backbone", model)
    return getattr(decoder, "lora", None) is not None


def adapters_active(model) -> bool:
    """Whether the forward applies adapters: the model has them and they are switched on."""
    return has_adapters(model) and bool(getattr(model, "lora_enabled", True))


@contextlib.contextmanager
def adapters_off(model):
    """Within the block, `model` runs as its base weights alone (the reference policy).

    Sets the static `lora_enabled` attribute and restores it on exit. Use it around the
    forward calls themselves (inside a traced function, on the merged module) or around
    `nnx.split` (the graphdef then carries the setting); entering it around a call of an
    already-jitted function that closes over the module does not retrace it.
    """
    decoder = getattr(model, "backbone", model)
    before = getattr(decoder, "lora_enabled", True)
    decoder.lora_enabled = False
    try:
        yield model
    finally:
        decoder.lora_enabled = before


DROPOUT_KEY = "lora_dropout_key"  # the per-layer key in the forward's scanned dict


def dropout_input(x: Array, key: Array, rate: float) -> Array:
    """Inverted dropout: x * m / (1 - rate), m ~ Bernoulli(1 - rate) elementwise (x's shape
    and dtype)."""
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros((), x.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def matmul(spec: str, x: Array, w: Array) -> Array:
    """`einsum(spec, x, w)` for a projection spec `<lead><in>,<in><out>-><lead><out>` (e.g.
    `ntd,dqh->ntqh`: x's trailing axes contracted with w's leading ones, in order), with the
    weight gradient taken as one 2-D matmul.

    Forward and input gradient are the einsums autodiff would run. The weight gradient is
    `x2^T dy2` with x2 `[prod(lead), prod(in)]` and dy2 `[prod(lead), prod(out)]`, both
    row-major: left to autodiff, with the (n, t) axes contracted, XLA:CPU wrote dy
    transposed from inside an elementwise fusion and ran a slower dot, which made the GRPO
    update's forward + backward about 15% slower (`experiments/bench/bench_roofline.py`).
    """
    return jnp.einsum(spec, x, w)


def _matmul_fwd(spec, x, w):
    return jnp.einsum(spec, x, w), (x, w)


def _matmul_bwd(spec, res, dy):
    x, w = res
    ins, out = spec.split("->")
    xs, ws = ins.split(",")
    n_lead = len(xs) - sum(c in ws for c in xs)
    if out != xs[:n_lead] + ws[len(xs) - n_lead :]:
        raise ValueError(f"matmul needs a '<lead><in>,<in><out>-><lead><out>' spec, got {spec}")
    dx = jnp.einsum(f"{out},{ws}->{xs}", dy, w)
    rows = math.prod(x.shape[:n_lead])
    dw = jnp.einsum("mi,mo->io", x.reshape(rows, -1), dy.reshape(rows, -1))
    return dx, dw.reshape(w.shape).astype(w.dtype)


matmul.defvjp(_matmul_fwd, _matmul_bwd)


def project(
    spec: str,
    x: Array,
    p: dict[str, Array],
    base: str,
    cdt,
    scale: float | None,
    dropout: float = 0.0,
):
    """`einsum(spec, x, W)` for the base weight `p[base]`, plus the adapter when `p` has one.

    x W + scale * (drop(x) A) B, everything in the compute dtype `cdt` (A and B cast where
    used, as the base weight is). `scale` None: no adapter. drop is `dropout_input` with
    rate `dropout` when `p` holds this layer's `DROPOUT_KEY`, else the identity.
    """
    y = matmul(spec, x, p[base].astype(cdt))
    t = TARGET_OF_BASE.get(base)
    if scale is None or t is None or f"lora_{t}_a" not in p:
        return y
    target = TARGETS[t]
    if dropout > 0 and DROPOUT_KEY in p:
        x = dropout_input(x, jax.random.fold_in(p[DROPOUT_KEY], ALL_TARGETS.index(t)), dropout)
    xa = matmul(target.a_spec, x, p[f"lora_{t}_a"].astype(cdt))
    delta = matmul(target.b_spec, xa, p[f"lora_{t}_b"].astype(cdt))
    return y + jnp.asarray(scale, cdt) * delta


def stacked_adapters(model, dropout_key: Array | None = None) -> dict[str, Array]:
    """`lora_<t>_a/_b` -> stacked arrays for the forward's scan (empty when inactive), and
    with `dropout_key` (and dropout > 0) `DROPOUT_KEY` -> `[L]` per-layer keys."""
    if not adapters_active(model):
        return {}
    out = {
        f"lora_{t}_{m}": getattr(model.lora, f"{t}_{m}")[...]
        for t in model.lora.lora_config.layer_targets
        for m in ("a", "b")
    }
    if dropout_key is not None and model.lora.lora_config.dropout > 0:
        out[DROPOUT_KEY] = jax.random.split(dropout_key, model.config.num_layers)
    return out


def dropout_rate(model) -> float:
    """The adapters' dropout p of `model` (a Decoder or a head model over one); 0 without
    active adapters."""
    decoder = getattr(model, "backbone", model)
    return decoder.lora.lora_config.dropout if adapters_active(decoder) else 0.0


def head_active(model) -> bool:
    """Whether the forward applies an adapter on the LM head (`lm_head` among active targets)."""
    return adapters_active(model) and HEAD in model.lora.lora_config.targets


def merged_head(model, w_dv: Array) -> Array:
    """W_eff = W + (alpha / r) A B `[D, V]` float32, from the base head `w_dv` in the compute
    dtype and the adapter cast to it (as `project` casts), the product accumulated in float32.
    Differentiable in A and B."""
    cdt = w_dv.dtype
    a = model.lora.lm_head_a[...].astype(cdt).astype(jnp.float32)
    b = model.lora.lm_head_b[...].astype(cdt).astype(jnp.float32)
    scale = jnp.float32(model.lora.lora_config.scale)
    return w_dv.astype(jnp.float32) + scale * jnp.matmul(a, b)


def head_delta_logits(model, hidden_ntd: Array) -> Array:
    """(alpha / r) (h A) B `[..., V]` float32: the head adapter's term of the logits, unmerged
    (h in its dtype, A and B cast to it, float32 accumulation)."""
    cdt = hidden_ntd.dtype
    a = model.lora.lm_head_a[...].astype(cdt)
    b = model.lora.lm_head_b[...].astype(cdt).astype(jnp.float32)
    xa = jnp.einsum("...d,dr->...r", hidden_ntd, a, preferred_element_type=jnp.float32)
    return jnp.float32(model.lora.lora_config.scale) * jnp.einsum("...r,rv->...v", xa, b)


def delta_numpy(model, t: str, layer: int | None = None) -> np.ndarray:
    """(alpha / r) A B for target t in the base weight's layout (float32, on the host);
    one layer `[*in, *out]` or all `[L, *in, *out]`; for `lm_head`, `[D, V]` (`layer` unused)."""
    a = np.asarray(jax.device_get(getattr(model.lora, f"{t}_a")[...]), np.float32)
    b = np.asarray(jax.device_get(getattr(model.lora, f"{t}_b")[...]), np.float32)
    if t == HEAD:
        return np.float32(model.lora.lora_config.scale) * (a @ b)
    if layer is not None:
        a, b = a[layer : layer + 1], b[layer : layer + 1]
    L, r = a.shape[0], a.shape[-1]
    in_shape, out_shape = a.shape[1:-1], b.shape[2:]
    d = np.matmul(a.reshape(L, -1, r), b.reshape(L, r, -1)).reshape(L, *in_shape, *out_shape)
    d = np.float32(model.lora.lora_config.scale) * d
    return d[0] if layer is not None else d


def merge_adapters(model):
    """A new `Decoder` without adapters whose weights are W + (alpha / r) A B (float32 math,
    stored in the parameter dtype); `model` is left as it is."""
    graphdef, state = nnx.split(model)
    # tree.map rebuilds the Variables: merging `state` itself would share them with `model`.
    merged = nnx.merge(graphdef, jax.tree.map(lambda x: x, state))
    if not has_adapters(merged):
        return merged
    for t in merged.lora.lora_config.targets:
        var = merged.lm_head if t == HEAD else getattr(merged.layers, TARGETS[t].base)
        w = var[...]
        new = np.asarray(jax.device_get(w), np.float32) + delta_numpy(merged, t)
        value = jnp.asarray(new, w.dtype)
        sharding = getattr(w, "sharding", None)
        var.set_value(jax.device_put(value, sharding) if sharding is not None else value)
    merged.lora = None
    merged.lora_enabled = True
    return merged


__all__ = [
    "ALL_TARGETS",
    "HEAD",
    "TARGETS",
    "TARGET_NAMES",
    "LoRA",
    "LoRAConfig",
    "LoRAParam",
    "adapter_axes",
    "adapters_active",
    "adapters_off",
    "add_lora",
    "delta_numpy",
    "dropout_input",
    "dropout_rate",
    "has_adapters",
    "head_active",
    "head_delta_logits",
    "merge_adapters",
    "merged_head",
]
