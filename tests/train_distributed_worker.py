"""One GRPO step on a given mesh, for the multi-device and multi-process tests.

As a script: `python train_distributed_worker.py OUT.npz [PROCESS_ID NUM_PROCESSES PORT]`.
Without the last three it runs in one process on its first device; with them it joins a
`jax.distributed` run on localhost over all processes' devices (joined as the driver joins:
`grpojax.distributed.initialize`), and process 0 writes the result.
"""

from __future__ import annotations

import os
import sys

import numpy as np


def grpo_step_result(mesh, **overrides):
    """(loss metrics, flattened updated params) of one fixed GRPO step on `mesh`;
    `overrides` as `grpo_step_state`'s."""
    metrics, state = grpo_step_state(mesh, **overrides)
    return metrics, _flat_global(state.params)


def _flat_global(tree):
    """Every leaf of `tree` gathered to the host and concatenated, float32 `[P]`."""
    import jax
    from jax.experimental import multihost_utils

    leaves = [multihost_utils.process_allgather(x, tiled=True) for x in jax.tree.leaves(tree)]
    return np.concatenate([np.ravel(np.asarray(x, np.float32)) for x in leaves])


def lora_grpo_step_result(mesh):
    """One fixed LoRA GRPO step on `mesh` (rank 4 on every target, B nonzero so A's gradient
    is too; SGD with momentum so the optimizer state is not empty): (loss metrics, flattened
    updated adapters, flattened optimizer state, the stepped state)."""
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from grpojax.models import LoRAConfig, add_lora
    from grpojax.train.state import trainable_split

    def with_lora(model):
        add_lora(model, LoRAConfig(rank=4, alpha=8.0), rngs=nnx.Rngs(7))
        rng = np.random.default_rng(8)
        for name in model.lora.names():
            if name.endswith("_b"):
                var = getattr(model.lora, name)
                var.set_value(jnp.asarray(0.05 * rng.standard_normal(var.shape), jnp.float32))
        return model

    # Momentum is linear in the gradients, so, unlike Adam's first steps (see below), it
    # keeps float32 summation-order noise at its size.
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1, momentum=0.9))
    metrics, state = grpo_step_state(mesh, edit_model=with_lora, tx=tx)
    adapters, _ = trainable_split(state.params)
    return metrics, _flat_global(adapters), _flat_global(state.opt_state), state


def grpo_step_state(
    mesh,
    *,
    edit_model=None,
    tx=None,
    batch_fields=None,
    share_prompt=False,
    shape=None,
    pack_width=None,
    model_overrides=None,
    **overrides,
):
    """(loss metrics, stepped `TrainState`) of one fixed GRPO step on
    `mesh`; `edit_model` changes the model before the state is built (e.g. adds adapters),
    `tx` replaces the optimizer, `batch_fields` (name -> NumPy array or None) replace fields
    of its `GRPOBatch` (e.g. rewards instead of advantages), `overrides` fields of its
    `GRPOConfig`. With `share_prompt`, on 4 groups of 4 rows sharing their prompts, each
    prompt run once per forward. `shape`: the batch's prompt and completion widths
    (dict(p=, t=); default 4 and 6, grouped 5 and 6); `pack_width`: the rows packed into
    bins of that width (`pack_plan`, two bins per micro-batch at least);
    `model_overrides`: fields of the small model's config (e.g. a sliding window)."""
    import jax
    import jax.numpy as jnp
    import optax
    from train_helpers import FORWARD, grouped_grpo_batch, random_grpo_batch, small_model

    from grpojax.train import (
        GRPOConfig,
        batch_shardings,
        create_train_state,
        make_grpo_step,
        put_global,
        shard_train_state,
    )
    from grpojax.train.packing import pack_plan

    model = small_model(31, **(model_overrides or {}))
    if edit_model is not None:
        model = edit_model(model)
    shape = shape or {}
    if share_prompt:
        batch = grouped_grpo_batch(32, b=4, g=4, **shape)
    else:
        batch = random_grpo_batch(32, n=16, **shape)
    if batch_fields:
        batch = batch.replace(
            **{k: None if v is None else jnp.asarray(v) for k, v in batch_fields.items()}
        )
    fields = dict(
        num_epochs=2,
        num_minibatches=2,
        num_microbatches=2,
        beta=0.05,
        entropy_coef=0.01,
        forward=FORWARD,
    )
    if share_prompt:
        fields.update(group_size=4, share_prompt=True)
    config = GRPOConfig(**{**fields, **overrides})
    if pack_width is not None:
        chunks = config.num_minibatches * config.num_microbatches
        plan = pack_plan(
            batch.mask_ns,
            batch.completion_mask_nt,
            width=pack_width,
            group_size=config.group_size if share_prompt else 1,
            rows_multiple=2 * chunks,
        )
        batch = batch.replace(packing=jax.tree.map(jnp.asarray, plan))
    # SGD, not Adam, for the comparison: Adam's first steps move every coordinate by about
    # lr * sign(g), so a coordinate whose gradient is ~0 turns float32 summation-order noise
    # (different on every mesh) into an O(lr) difference that says nothing about sharding.
    if tx is None:
        tx = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1))
    graphdef, state = create_train_state(model, tx, rng=jax.random.key(5), with_ref=True)
    state, shardings = shard_train_state(state, tx, mesh)
    batch = put_global(batch, batch_shardings(batch, mesh))
    step = make_grpo_step(graphdef, tx, config, mesh=mesh, state_shardings=shardings, batch=batch)
    state, metrics = step(state, batch)
    metrics = {k: float(v) for k, v in metrics.items()}
    return metrics, state


def main(argv):
    out = argv[1]
    if len(argv) > 2:
        pid, nproc, port = int(argv[2]), int(argv[3]), int(argv[4])
        os.environ.update(
            JAX_COORDINATOR_ADDRESS=f"localhost:{port}",
            JAX_NUM_PROCESSES=str(nproc),
            JAX_PROCESS_ID=str(pid),
        )
        import jax

        from grpojax.distributed import initialize
        from grpojax.models import make_mesh

        initialize()  # as the driver joins: gloo collectives, no compilation cache on CPU

        mesh = make_mesh(data=2, fsdp=-1)
    else:
        pid = 0
        import jax

        from grpojax.models import make_mesh

        mesh = make_mesh(fsdp=1, devices=jax.devices()[:1])
    metrics, flat = grpo_step_result(mesh)
    if pid == 0:
        np.savez(out, params=flat, **{k: np.float64(v) for k, v in metrics.items()})
    if len(argv) > 2:
        jax.distributed.shutdown()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main(sys.argv)
