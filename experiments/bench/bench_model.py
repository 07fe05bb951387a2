"""Benchmark the decoder: compile time at L and 2L layers (the layer scan keeps it flat)
and forward throughput in tokens/s, on whatever devices JAX sees.

    python experiments/bench/bench_model.py [--layers 6] [--batch 8] [--seq 128] [--iters 10]

The last line is machine-readable:
    bench_model: compile_s_L=<a> compile_s_2L=<b> compile_ratio=<b/a> fwd_tok_s=<x>
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from benchlib import machine
from flax import nnx

import grpojax.models as gm


def _compiled_forward(config, batch, seq):
    """(compile seconds, compiled fn, args) for a jitted full forward to logits."""
    model = gm.Decoder(config, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    tokens = jnp.zeros((batch, seq), jnp.int32)
    mask = jnp.ones((batch, seq), jnp.bool_)

    def forward(state, tokens, mask):
        return gm.forward_logits(nnx.merge(graphdef, state), tokens, mask)

    lowered = jax.jit(forward).lower(state, tokens, mask)
    start = time.perf_counter()
    compiled = lowered.compile()
    return time.perf_counter() - start, compiled, (state, tokens, mask)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3, help="compile timings to take the min of")
    args = parser.parse_args()
    # Measure real compiles, not persistent-cache hits.
    jax.config.update("jax_enable_compilation_cache", False)

    base = gm.tiny_config(num_layers=args.layers)
    deep = dataclasses.replace(base, num_layers=2 * args.layers)
    compile_l = min(_compiled_forward(base, args.batch, args.seq)[0] for _ in range(args.repeats))
    compile_2l = min(_compiled_forward(deep, args.batch, args.seq)[0] for _ in range(args.repeats))

    _, fn, fn_args = _compiled_forward(base, args.batch, args.seq)
    jax.block_until_ready(fn(*fn_args))  # warm-up
    times = []
    for _ in range(args.iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*fn_args))
        times.append(time.perf_counter() - start)
    step_s = float(np.median(times))
    tok_s = args.batch * args.seq / step_s

    dev = jax.devices()[0]
    print(f"machine: {machine()}")
    print(f"jax {jax.__version__}, {jax.device_count()} x {dev.platform} ({dev.device_kind})")
    print(
        f"model: tiny_config params={base.num_params():,} D={base.hidden_size} "
        f"V={base.vocab_size}; batch={args.batch} seq={args.seq}"
    )
    print(f"{'layers':>8} {'compile_s':>10}")
    print(f"{args.layers:>8} {compile_l:>10.3f}")
    print(f"{2 * args.layers:>8} {compile_2l:>10.3f}")
    print(f"forward: median {step_s * 1e3:.1f} ms/step over {args.iters} -> {tok_s:,.0f} tokens/s")
    print(
        f"bench_model: compile_s_L={compile_l:.3f} compile_s_2L={compile_2l:.3f} "
        f"compile_ratio={compile_2l / compile_l:.3f} fwd_tok_s={tok_s:.0f}"
    )


if __name__ == "__main__":
    main()
