"""Explicit sharding (sharding in types) for the few ops that move data across a sharded axis.

Most ops are elementwise or reduce along an axis, so on a mesh whose axes are Explicit they
keep their inputs' shardings as written. A few regroup or reorder rows across the batch
axis: `[N] -> [B, G]` groups (a reshape that cannot keep `N`'s sharding when `B` does not
divide by the number of shards), sorting every token of the batch (Clip-Cov / KL-Cov), and
the tiled logprob engine's dynamic slices over flattened rows. On an Explicit mesh JAX
rejects these unless told how the result is sharded. `in_auto_mode` runs such a body with
the Explicit axes switched to Auto, so the compiler places the intermediates exactly as it
does on an Auto mesh, and gives the outputs the shardings the caller's inputs imply. On an
Auto mesh or without a mesh it is a plain call.
"""

from __future__ import annotations

import jax
from jax.sharding import AxisType, PartitionSpec


def _explicit_mesh(args):
    """The abstract mesh in force (from the context, else from the inputs' types) if it has
    an Explicit axis; None otherwise."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        for leaf in jax.tree.leaves(args):
            leaf_mesh = jax.typeof(leaf).sharding.mesh
            if not leaf_mesh.empty:
                mesh = leaf_mesh
                break
    if mesh.empty or AxisType.Explicit not in mesh.axis_types:
        return None
    return mesh


def in_auto_mode(fn, out_specs, *args):
    """`fn(*args)`, with an Explicit mesh's axes treated as Auto inside `fn`.

    Args:
      fn: a pure function of arrays.
      out_specs: a `PartitionSpec` (or a pytree prefix of them) for `fn`'s outputs on the
        Explicit mesh, usually built with `leading_spec` from the inputs.
      *args: arrays (or pytrees of arrays; None is allowed).

    Differentiable: gradients come back with the inputs' shardings.
    """
    mesh = _explicit_mesh(args)
    if mesh is None:
        return fn(*args)
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.sharding.auto_axes(fn, out_sharding=out_specs)(*args)


def leading_spec(x, ndim: int) -> PartitionSpec:
    """The spec of the first `ndim` axes of `x`'s type, padded with None to `ndim` entries:
    the sharding of an output that shares `x`'s leading axes (e.g. `[N, T]` from `[N, T, D]`)."""
    spec = tuple(jax.typeof(x).sharding.spec)[:ndim]
    return PartitionSpec(*spec, *([None] * (ndim - len(spec))))
