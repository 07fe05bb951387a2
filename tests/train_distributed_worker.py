"""One GRPO step on a given mesh, for the multi-device and multi-process tests.

As a script: `python train_distributed_worker.py OUT.npz [PROCESS_ID NUM_PROCESSES PORT]`.
Without the last three it runs in one process on its first device; with them it joins a
`jax.distributed` run on localhost (gloo CPU collectives) over all processes' devices, and
process 0 writes the result.
"""

from __future__ import annotations

import os
import sys

import numpy as np


def grpo_step_result(mesh, *, share_prompt: bool = False, **overrides):
    """(loss metrics, flattened updated params) of one fixed GRPO step on `mesh`;
    `overrides` replace fields of its `GRPOConfig`. With `share_prompt`, on 4 groups of 4
    rows sharing their prompts, each prompt run once per forward."""
    import jax
    import optax
    from jax.experimental import multihost_utils
    from train_helpers import FORWARD, grouped_grpo_batch, random_grpo_batch, small_model

    from grpojax.train import (
        GRPOConfig,
        batch_shardings,
        create_train_state,
        make_grpo_step,
        put_global,
        shard_train_state,
    )

    model = small_model(31)
    batch = grouped_grpo_batch(32, b=4, g=4) if share_prompt else random_grpo_batch(32, n=16)
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
    # SGD, not Adam, for the comparison: Adam's first steps move every coordinate by about
    # lr * sign(g), so a coordinate whose gradient is ~0 turns float32 summation-order noise
    # (different on every mesh) into an O(lr) difference that says nothing about sharding.
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1))
    graphdef, state = create_train_state(model, tx, rng=jax.random.key(5), with_ref=True)
    state, shardings = shard_train_state(state, tx, mesh)
    batch = put_global(batch, batch_shardings(batch, mesh))
    step = make_grpo_step(graphdef, tx, config, mesh=mesh, state_shardings=shardings, batch=batch)
    state, metrics = step(state, batch)
    metrics = {k: float(v) for k, v in metrics.items()}
    leaves = [
        multihost_utils.process_allgather(x, tiled=True) for x in jax.tree.leaves(state.params)
    ]
    flat = np.concatenate([np.ravel(np.asarray(x)) for x in leaves])
    return metrics, flat


def main(argv):
    out = argv[1]
    if len(argv) > 2:
        pid, nproc, port = int(argv[2]), int(argv[3]), int(argv[4])
        import jax

        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=f"localhost:{port}", num_processes=nproc, process_id=pid
        )
        from grpojax.models import make_mesh

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
