"""Sharding as data: logical axis names per array, and a table from logical to mesh axes.

Every parameter of the decoder is described by a tuple of logical axis names
(`PARAM_AXES`); `RULES` maps each logical name to mesh axes of the
(`data`, `fsdp`, `tensor`, `context`) mesh. A mesh axis whose size does not divide an
array dimension is dropped for that dimension (replicated), so small models and odd
head counts shard without special cases. Activations are sharded over the batch
(`data` x `fsdp`) and their tokens over `context`; `constrain` applies that inside the
forward only when a mesh has been set with `jax.set_mesh`, and is a no-op otherwise.

Context parallelism (`context` > 1) splits each sequence's tokens over the axis: the
residual stream, the projections, the MLP and the logits hold T / C tokens a device, and
the weights are sharded over fsdp x context. Attention needs every key of a row: the
decoder constrains q, k and v to whole sequences with their heads split over tensor x
context (`attn_heads`), which XLA carries out as an all-to-all, and the output back to
tokens over context (DeepSpeed-Ulysses' layout, the sharding written down rather than
coded). Each device then attends over whole rows for H / (tensor x C) heads, so the causal
triangle costs every device the same (no zig-zag order needed), and any attention backend
(einsum, blockwise, fused) runs unchanged; the price is two all-to-alls of q|k|v and the
output per layer, and heads that tensor x C does not divide are replicated over the axis
(correct, with no saving).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from grpojax.models import lora_targets

MESH_AXES = ("data", "fsdp", "tensor", "context")
# The axes `constrain` needs on a mesh (a mesh without `context` has none to split over).
BASE_AXES = ("data", "fsdp", "tensor")

# Logical axis -> mesh axis (or tuple of axes, or None = replicated).
RULES: Mapping[str, str | tuple[str, ...] | None] = {
    # parameters
    "vocab": "tensor",
    "embed": ("fsdp", "context"),
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    # Experts are laid over the fsdp devices: each holds E / fsdp whole experts (expert
    # parallelism within the fsdp group) instead of a 1/fsdp slice of every expert.
    "expert": "fsdp",
    "router": None,  # the router's E outputs: small, replicated
    "layers": None,
    "norm": None,
    "lora_rank": None,  # LoRA adapters' inner dimension: small, replicated
    # activations
    "batch": ("data", "fsdp"),
    "seq": "context",
    "act_embed": None,
    "act_heads": "tensor",
    # whole sequences: inside attention (heads over tensor x context, see the docstring),
    # and a batch's arrays between programs (`batch_sharding`)
    "attn_seq": None,
    "attn_heads": ("tensor", "context"),
    "cache_seq": None,
}

# Parameter name (as in `Decoder.named_params`) -> logical axes, one per dimension.
PARAM_AXES: Mapping[str, tuple[str, ...]] = {
    "embed": ("vocab", "embed"),
    "layers.attn_norm": ("layers", "norm"),
    "layers.wq": ("layers", "embed", "heads", "head_dim"),
    "layers.wk": ("layers", "embed", "kv_heads", "head_dim"),
    "layers.wv": ("layers", "embed", "kv_heads", "head_dim"),
    "layers.wo": ("layers", "heads", "head_dim", "embed"),
    "layers.bq": ("layers", "heads", "head_dim"),
    "layers.bk": ("layers", "kv_heads", "head_dim"),
    "layers.bv": ("layers", "kv_heads", "head_dim"),
    "layers.q_norm": ("layers", "head_dim"),
    "layers.k_norm": ("layers", "head_dim"),
    "layers.mlp_norm": ("layers", "norm"),
    "layers.post_attn_norm": ("layers", "norm"),
    "layers.post_mlp_norm": ("layers", "norm"),
    "layers.w_gate": ("layers", "embed", "mlp"),
    "layers.w_up": ("layers", "embed", "mlp"),
    "layers.w_down": ("layers", "mlp", "embed"),
    "layers.w_router": ("layers", "embed", "router"),
    "layers.we_gate": ("layers", "expert", "embed", "mlp"),
    "layers.we_up": ("layers", "expert", "embed", "mlp"),
    "layers.we_down": ("layers", "expert", "mlp", "embed"),
    "final_norm": ("norm",),
    "lm_head": ("embed", "vocab"),
}
# LoRA adapters (`lora.<t>_a` / `lora.<t>_b`) follow their base weight: A keeps its input
# axes, B its output axes, the rank axis is replicated (the LM head's too: A `[D, r]`,
# B `[r, V]`).
PARAM_AXES = {
    **PARAM_AXES,
    **{
        f"lora.{t}_{m}": axes
        for t, target in lora_targets.TARGETS.items()
        for m, axes in zip(
            "ab", lora_targets.adapter_axes(PARAM_AXES[f"layers.{target.base}"], target.n_in)
        )
    },
    "lora.lm_head_a": ("embed", "lora_rank"),
    "lora.lm_head_b": ("lora_rank", "vocab"),
}

# Activations and cache, by role.
ACTIVATION_AXES: Mapping[str, tuple[str, ...]] = {
    "tokens_nt": ("batch", "seq"),
    "hidden_ntd": ("batch", "seq", "act_embed"),
    "cache_k": ("layers", "batch", "act_heads", "head_dim", "cache_seq"),
    "cache_v": ("layers", "batch", "act_heads", "cache_seq", "head_dim"),
    "cache_mask_ns": ("batch", "cache_seq"),
}


def make_mesh(
    *, data: int = 1, fsdp: int = -1, tensor: int = 1, context: int = 1, devices=None
) -> Mesh:
    """A (data, fsdp, tensor, context) mesh; one size may be -1 (takes the remaining
    devices)."""
    devices = jax.devices() if devices is None else list(devices)
    sizes = [data, fsdp, tensor, context]
    if sizes.count(-1) > 1:
        raise ValueError(f"at most one of data/fsdp/tensor/context may be -1, got {sizes}")
    known = math.prod(s for s in sizes if s != -1)
    if any(s == 0 or s < -1 for s in sizes) or len(devices) % known:
        raise ValueError(
            f"mesh sizes data/fsdp/tensor/context={sizes} do not fit {len(devices)} devices"
        )
    sizes = [len(devices) // known if s == -1 else s for s in sizes]
    if math.prod(sizes) != len(devices):
        raise ValueError(
            f"mesh sizes data/fsdp/tensor/context={sizes} use {math.prod(sizes)} devices, "
            f"have {len(devices)}"
        )
    types = (AxisType.Auto,) * len(MESH_AXES)
    return jax.make_mesh(tuple(sizes), MESH_AXES, axis_types=types, devices=devices)


def logical_to_spec(
    axes: tuple[str, ...],
    shape: tuple[int, ...] | None = None,
    mesh_shape: Mapping[str, int] | None = None,
    rules: Mapping[str, str | tuple[str, ...] | None] = RULES,
) -> PartitionSpec:
    """PartitionSpec for logical `axes`; with `shape` and `mesh_shape`, mesh axes that do
    not divide their dimension (or are absent from the mesh) are dropped."""
    used: set[str] = set()
    spec = []
    for i, name in enumerate(axes):
        if name not in rules:
            raise ValueError(f"unknown logical axis {name!r}; known: {sorted(rules)}")
        target = rules[name]
        targets = () if target is None else (target,) if isinstance(target, str) else target
        kept: list[str] = []
        for mesh_axis in targets:
            if mesh_axis in used:
                continue
            if mesh_shape is not None:
                if mesh_axis not in mesh_shape:
                    continue
                if mesh_axis == "context" and mesh_shape[mesh_axis] == 1:
                    continue  # no context parallelism: the specs of a (data, fsdp, tensor) mesh
                size = math.prod(mesh_shape[a] for a in kept) * mesh_shape[mesh_axis]
                if shape is not None and shape[i] % size:
                    continue
            kept.append(mesh_axis)
            used.add(mesh_axis)
        spec.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
    return PartitionSpec(*spec)


def param_shardings(model, mesh: Mesh) -> dict[str, NamedSharding]:
    """Parameter name -> NamedSharding for a `Decoder` (abstract or concrete)."""
    out = {}
    for name, var in model.named_params().items():
        spec = logical_to_spec(PARAM_AXES[name], tuple(var.shape), dict(mesh.shape))
        out[name] = NamedSharding(mesh, spec)
    return out


def shard_model(model, mesh: Mesh):
    """Place every parameter of `model` (a `Decoder`, or a module with `.backbone`) on `mesh`
    with its partition spec, in place; returns the model. Head parameters are replicated."""
    from flax import nnx

    decoder = getattr(model, "backbone", model)
    shardings = param_shardings(decoder, mesh)
    for name, var in decoder.named_params().items():
        var.set_value(jax.device_put(var[...], shardings[name]))
    if decoder is not model:
        replicated = NamedSharding(mesh, PartitionSpec())
        for _, var in nnx.iter_graph(model):
            if isinstance(var, nnx.Variable) and not _is_sharded_on(var[...], mesh):
                var.set_value(jax.device_put(var[...], replicated))
    return model


def _is_sharded_on(x, mesh: Mesh) -> bool:
    s = getattr(x, "sharding", None)
    return isinstance(s, NamedSharding) and s.mesh == mesh


def put_global(tree, shardings):
    """Place host values on (possibly multi-process) shardings.

    Every process must hold the same full values (e.g. built from the same seed); each
    device receives its slice. Works for one process and for `jax.distributed` runs.
    """

    def put(x, sh):
        if x is None:
            return None
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            data = jax.random.key_data(x)
            impl = jax.random.key_impl(x)
            return jax.random.wrap_key_data(put(data, sh), impl=impl)
        if sh.is_fully_addressable:
            return jax.device_put(x, sh)
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            # Already global (e.g. a model loaded onto the mesh): reshard, no host copy.
            return x if x.sharding == sh else jax.jit(lambda a: a, out_shardings=sh)(x)
        host = jax.device_get(x)
        return jax.make_array_from_callback(jnp.shape(host), sh, lambda idx: host[idx])

    return jax.tree.map(put, tree, shardings, is_leaf=lambda x: x is None)


def move_to_mesh(tree, mesh: Mesh):
    """`tree`'s arrays on another `mesh`, each with its partition spec (in one process a
    leaf on no named mesh is replicated), copied device to device (the weights a split
    placement's sampler decodes with).

    In one process this is `jax.device_put`. Across processes JAX copies only between the
    same devices, so each leaf is first gathered on its own mesh to the layout it takes on
    `mesh` (its spec without the axes of size 1 there: a collective over the source
    devices, which hold that shard for a moment), then every process copies the shards
    its own target devices need from its own source devices. Each axis that shards on
    `mesh` must have the same size on the source mesh, and each process's source devices
    must hold every shard its target devices need (a ValueError naming the leaf).
    """

    def spec_of(x):
        return x.sharding.spec if isinstance(x.sharding, NamedSharding) else PartitionSpec()

    targets = jax.tree.map(lambda x: NamedSharding(mesh, spec_of(x)), tree)
    if all(x.is_fully_addressable for x in jax.tree.leaves(tree)):
        return jax.device_put(tree, targets)
    sizes = dict(mesh.shape)

    def gathered_layout(path, x):
        if not isinstance(x.sharding, NamedSharding):
            raise ValueError(f"move_to_mesh: {jax.tree_util.keystr(path)} is on no named mesh")
        kept = []
        for entry in spec_of(x):
            names = entry if isinstance(entry, tuple) else (() if entry is None else (entry,))
            names = tuple(n for n in names if sizes.get(n, 1) > 1)
            for n in names:
                if dict(x.sharding.mesh.shape)[n] != sizes[n]:
                    raise ValueError(
                        f"move_to_mesh: {jax.tree_util.keystr(path)} is sharded over {n!r} of "
                        f"size {dict(x.sharding.mesh.shape)[n]}, {sizes[n]} on the target mesh"
                    )
            kept.append(names[0] if len(names) == 1 else (names or None))
        return NamedSharding(x.sharding.mesh, PartitionSpec(*kept))

    layouts = jax.tree_util.tree_map_with_path(gathered_layout, tree)
    gathered = jax.jit(_identity, out_shardings=layouts)(tree)

    def local_copy(path, x, target):
        held = {_index_key(s.index, x.shape): s.data for s in x.addressable_shards}
        shards = []
        for device, index in target.addressable_devices_indices_map(x.shape).items():
            data = held.get(_index_key(index, x.shape))
            if data is None:
                raise ValueError(
                    f"move_to_mesh: process {jax.process_index()}'s source devices do not "
                    f"hold the shard {index} of {jax.tree_util.keystr(path)} that its "
                    f"device {device} needs"
                )
            shards.append(jax.device_put(data, device))
        return jax.make_array_from_single_device_arrays(x.shape, target, shards)

    return jax.tree_util.tree_map_with_path(local_copy, gathered, targets)


def _identity(tree):  # module level: one jit cache entry per layout
    return tree


def _index_key(index, shape) -> tuple:
    """A shard's index (a tuple of slices) in a comparable form."""
    return tuple(sl.indices(n) for sl, n in zip(index, shape))


def replicated(mesh: Mesh) -> NamedSharding:
    """The fully replicated sharding on `mesh` (scalars, keys, small tables)."""
    return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh, ndim: int = 2, shape: tuple[int, ...] | None = None):
    """NamedSharding for a batch-major array (`[N, ...]`, rows over data x fsdp, the rest
    whole: a step's inputs and the sampler's buffers; the model splits tokens over context
    itself)."""
    axes = ("batch",) + ("attn_seq",) * (ndim - 1)
    return NamedSharding(mesh, logical_to_spec(axes, shape, dict(mesh.shape)))


def cache_shardings(cache, mesh: Mesh):
    """A KVCache-shaped pytree of NamedShardings (batch over data x fsdp, kv heads over tensor)."""
    mesh_shape = dict(mesh.shape)
    spec = lambda role, x: NamedSharding(
        mesh, logical_to_spec(ACTIVATION_AXES[role], tuple(x.shape), mesh_shape)
    )
    return type(cache)(
        k=spec("cache_k", cache.k),
        v=spec("cache_v", cache.v),
        mask_ns=spec("cache_mask_ns", cache.mask_ns),
        # A shared index is replicated; a per-row one (`[N]`) follows the rows.
        index=batch_sharding(mesh, 1, cache.index.shape)
        if getattr(cache.index, "ndim", 0) == 1
        else NamedSharding(mesh, PartitionSpec()),
    )


def constrain(x, logical_axes: tuple[str, ...]):
    """`with_sharding_constraint` by logical axes under the mesh set with `jax.set_mesh`;
    the identity when no (data, fsdp, tensor[, context]) mesh is set."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not set(BASE_AXES) <= set(mesh.axis_names):
        return x
    spec = logical_to_spec(logical_axes, tuple(x.shape), dict(mesh.shape))
    return jax.lax.with_sharding_constraint(x, spec)
