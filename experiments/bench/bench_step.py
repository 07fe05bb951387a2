"""Benchmark: one GRPO update vs one PPO update (critic as large as the actor), same model
and batch. The seeds' central claim made measurable: GRPO drops the critic, so its step
needs roughly half the memory (parameters, gradients and Adam moments of one model, not
two).

Each algorithm runs in a fresh subprocess (so peak RSS is its own) and reports:

- step_s: median wall time of `--repeats` steps after the compile (state donated, outputs
  blocked on);
- xla_peak_mb: from the compiled step's `memory_analysis()`:
  argument + output - aliased (donated state reused for the output) + temp bytes, i.e. the
  device buffers live while the step runs. This is the number `mem_ratio` uses;
- rss_peak_mb: peak resident set size of the subprocess (`ru_maxrss`: includes Python,
  JAX, the compiler and host copies made while building the state, so less sharp);
- update FLOP/s: `6 * trainable params * tokens * update passes / step_s` (a forward is
  2 FLOPs per parameter per token, its backward 4). PPO's extra no-grad forward of actor
  and critic (old logprobs and values for GAE) and the entropy pass are not counted as
  update FLOPs but are in its time.

The machine's float32 matmul peak is measured in the parent (median of a square
`jnp.dot`). The last line is
`bench_step: grpo_step_s=... ppo_step_s=... grpo_peak_mb=... ppo_peak_mb=... mem_ratio=...
update_flops_frac=...` with `update_flops_frac` the GRPO update's achieved fraction of that
peak. Usage: `python experiments/bench/bench_step.py [--layers 8 --width 512 ...]`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

from benchlib import machine, matmul_peak


def _model_config(args):
    from grpojax.models import tiny_config

    return tiny_config(
        vocab_size=args.vocab,
        hidden_size=args.width,
        intermediate_size=3 * args.width,
        num_layers=args.layers,
        num_heads=args.width // 64,
        num_kv_heads=max(1, args.width // 128),
        head_dim=64,
    )


def _batch_arrays(args):
    """Ragged rows: left-padded prompts of width P, completions of width T, from lengths."""
    import jax.numpy as jnp
    import numpy as np

    from grpojax.ops.masks import mask_from_lengths

    rng = np.random.default_rng(0)
    n, p, t = args.rows, args.prompt, args.completion
    plen = jnp.asarray(rng.integers(p // 2, p + 1, n))
    clen = jnp.asarray(rng.integers(t // 2, t + 1, n))
    mask = jnp.concatenate(
        [mask_from_lengths(plen, p, offset_n=p - plen), mask_from_lengths(clen, t)], 1
    )
    tokens = jnp.where(mask, jnp.asarray(rng.integers(3, args.vocab, (n, p + t)), jnp.int32), 0)
    return dict(
        tokens_ns=tokens,
        mask_ns=mask,
        completion_mask_nt=mask[:, p:],
        scores_n=jnp.asarray(rng.normal(size=n), jnp.float32),
        ref_logp_nt=jnp.asarray(-rng.uniform(1.0, 8.0, (n, t)), jnp.float32),
    )


def _count(params) -> int:
    import jax

    return int(sum(x.size for x in jax.tree.leaves(params)))


def _measure(step, mesh, state, batch, repeats: int):
    """(compile_s, median step_s, memory analysis, metrics) of a `jit_step` callable."""
    import jax

    t0 = time.perf_counter()
    with jax.set_mesh(mesh):
        compiled = step.jitted.lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    state, metrics = step(state, batch)  # first call: loads the compiled program
    jax.block_until_ready(metrics)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - t0)
    return compile_s, statistics.median(times), mem, metrics


def worker(args) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from grpojax.models import Decoder, make_mesh
    from grpojax.train.state import OptimizerConfig, make_optimizer

    cfg = _model_config(args)
    arrays = _batch_arrays(args)
    mesh = make_mesh(fsdp=1, devices=jax.devices()[:1])
    tx = make_optimizer(OptimizerConfig(learning_rate=1e-5))
    actor = Decoder(cfg, rngs=nnx.Rngs(0))
    tokens = int(arrays["mask_ns"].size)

    if args.worker == "grpo":
        from grpojax.train.config import GRPOConfig
        from grpojax.train.grpo import GRPOBatch, make_grpo_step
        from grpojax.train.state import create_train_state, shard_train_state

        config = GRPOConfig(aggregation="token-mean", beta=0.04, group_size=4)
        batch = GRPOBatch(
            tokens_ns=arrays["tokens_ns"],
            mask_ns=arrays["mask_ns"],
            completion_mask_nt=arrays["completion_mask_nt"],
            advantages=arrays["scores_n"],
            ref_logp_nt=arrays["ref_logp_nt"],
        )
        graphdef, state = create_train_state(actor, tx, rng=jax.random.key(0))
        del actor
        state, shardings = shard_train_state(state, tx, mesh)
        trainable = _count(state.params)
        passes = config.num_epochs
        step = make_grpo_step(
            graphdef, tx, config, mesh=mesh, state_shardings=shardings, batch=batch
        )
    else:
        from grpojax.train.config import PPOConfig
        from grpojax.train.ppo import (
            PPOBatch,
            create_ppo_state,
            init_critic,
            make_ppo_step,
            shard_ppo_state,
        )

        config = PPOConfig(critic="separate", num_epochs=1, num_minibatches=1)
        batch = PPOBatch(**arrays)
        critic = init_critic(actor, mode="separate", rngs=nnx.Rngs(1))
        graphs, state = create_ppo_state(
            actor, critic, tx, tx, config=config, rng=jax.random.key(0)
        )
        del actor, critic
        state, _ = shard_ppo_state(state, tx, tx, mesh)
        trainable = _count(state.actor.params) + _count(state.critic.params)
        passes = config.num_epochs
        step = make_ppo_step(config, graphs, tx, tx, mesh=mesh, state=state, batch=batch)

    compile_s, step_s, mem, metrics = _measure(step, mesh, state, batch, args.repeats)
    peak = (
        mem.argument_size_in_bytes
        + mem.output_size_in_bytes
        - mem.alias_size_in_bytes
        + mem.temp_size_in_bytes
    )
    flops = 6.0 * trainable * tokens * passes
    return dict(
        algo=args.worker,
        params=trainable,
        tokens=tokens,
        compile_s=compile_s,
        step_s=step_s,
        xla_peak_mb=peak / 2**20,
        xla_argument_mb=mem.argument_size_in_bytes / 2**20,
        xla_temp_mb=mem.temp_size_in_bytes / 2**20,
        rss_peak_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        update_flops=flops,
        update_flops_per_s=flops / step_s,
        loss=float(jnp.asarray(metrics["loss"])),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512, help="D, a multiple of 128")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--rows", type=int, default=8, help="N sequences")
    parser.add_argument("--prompt", type=int, default=16, help="P prompt width")
    parser.add_argument("--completion", type=int, default=48, help="T completion width")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", choices=("grpo", "ppo"), help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return

    import jax

    peak = matmul_peak()
    results = {}
    for algo in ("grpo", "ppo"):
        cmd = [sys.executable, __file__, "--worker", algo, *sys.argv[1:]]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            sys.exit(f"{algo} worker failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
        results[algo] = json.loads(lines[-1][len("RESULT ") :])

    dev = jax.devices()[0]
    print(f"machine: {machine()}, device={dev.platform}:{dev.device_kind}")
    print(f"float32 matmul peak (2048^2 jnp.dot): {peak / 1e9:.1f} GFLOP/s")
    g, p = results["grpo"], results["ppo"]
    print(
        f"model: L={args.layers} D={args.width} V={args.vocab}; actor params "
        f"{g['params'] / 1e6:.1f}M; batch N={args.rows} x S={args.prompt + args.completion} "
        f"= {g['tokens']} tokens; 1 epoch x 1 mini-batch; AdamW"
    )
    header = (
        f"{'algo':<5} {'params':>8} {'compile_s':>9} {'step_s':>7} {'xla_peak_MB':>11} "
        f"{'xla_args_MB':>11} {'xla_temp_MB':>11} {'rss_peak_MB':>11} {'GFLOP/s':>8} {'of peak':>7}"
    )
    print(header)
    for r in (g, p):
        print(
            f"{r['algo']:<5} {r['params'] / 1e6:>7.1f}M {r['compile_s']:>9.1f} "
            f"{r['step_s']:>7.3f} {r['xla_peak_mb']:>11.1f} {r['xla_argument_mb']:>11.1f} "
            f"{r['xla_temp_mb']:>11.1f} {r['rss_peak_mb']:>11.1f} "
            f"{r['update_flops_per_s'] / 1e9:>8.1f} {r['update_flops_per_s'] / peak:>7.1%}"
        )
    print("peak memory: xla = argument + output - aliased + temp bytes of the compiled step")
    ratio = g["xla_peak_mb"] / p["xla_peak_mb"]
    frac = g["update_flops_per_s"] / peak
    print(
        f"bench_step: grpo_step_s={g['step_s']:.4f} ppo_step_s={p['step_s']:.4f} "
        f"grpo_peak_mb={g['xla_peak_mb']:.1f} ppo_peak_mb={p['xla_peak_mb']:.1f} "
        f"mem_ratio={ratio:.3f} update_flops_frac={frac:.3f}"
    )


if __name__ == "__main__":
    main()
