"""Benchmark: token log-probs + backward, full logits vs the chunked custom-VJP path.

Measures `jax.grad(sum(logp))` w.r.t. both the hidden states and the LM head for

* naive:   `token_logprobs(hidden @ lm_head, tokens)` (full `[N*T, V]` float32 logits), and
* chunked: `token_logprobs_from_hidden(hidden, lm_head, tokens)`,

each in its own fresh subprocess so that the peak resident memory (VmHWM of the child,
which includes the Python/JAX runtime and the inputs, identical for both paths) belongs to
that path alone. XLA's own `compiled.memory_analysis()` temp bytes (scratch buffers of the
compiled program, excluding arguments and outputs) are printed beside it. Time is the
median of `--repeats` runs after a warm-up; compile time is reported separately.

    .venv/bin/python experiments/bench/bench_logprobs.py               # V=151,936 N*T=8,192 D=896
    .venv/bin/python experiments/bench/bench_logprobs.py --tokens 2048 --vocab 32768   # smaller

The last line of output is machine-readable:
    bench_logprobs: naive_peak_mb=.. chunked_peak_mb=.. mem_ratio=.. naive_s=.. chunked_s=..
    time_ratio=..  (on one line)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from benchlib import machine

MB = 1024 * 1024


def _proc_status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024  # kB -> MiB
    return float("nan")


def _child(args) -> None:
    """Runs one path in this (fresh) process and prints one JSON line."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from grpojax.ops.logprobs import token_logprobs, token_logprobs_from_hidden

    def hashed_uniform(shape, seed, scale):
        # Pseudo-random values of std `scale` from a hash of the element index: one fused
        # elementwise program that writes only its output. (jax.random / NumPy would leave
        # 1-3 copies of the 0.5 GiB LM head in the peak, which is not the op's memory.)
        x = jnp.arange(int(np.prod(shape)), dtype=jnp.uint32).reshape(shape)
        x = x * jnp.uint32(0x9E3779B1) + jnp.uint32(seed)
        for shift, mult in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):
            x = (x ^ (x >> shift)) * jnp.uint32(mult)
        x = x ^ (x >> 16)
        u = (x >> 8).astype(jnp.float32) * (1.0 / 2**24)
        return (u - 0.5) * np.float32(np.sqrt(12.0) * scale)

    make = jax.jit(hashed_uniform, static_argnums=(0, 1, 2))
    rss_start = _proc_status_mb("VmRSS")
    hidden = make((args.tokens, args.dim), 1, 1.0)
    lm_head = make((args.dim, args.vocab), 2, 1.0 / np.sqrt(args.dim))
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, args.vocab, size=(args.tokens,), dtype=np.int32))
    jax.block_until_ready((hidden, lm_head, tokens))
    rss_inputs = _proc_status_mb("VmRSS")

    if args.child == "naive":

        def loss(h, w):
            return jnp.sum(token_logprobs(h @ w, tokens))

    else:

        def loss(h, w):
            logp = token_logprobs_from_hidden(
                h,
                w,
                tokens,
                chunk_size=args.chunk_size,
                vocab_chunk_size=args.vocab_chunk_size,
            )
            return jnp.sum(logp)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    t0 = time.perf_counter()
    compiled = step.lower(hidden, lm_head).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    temp_bytes = int(getattr(mem, "temp_size_in_bytes", -1)) if mem is not None else -1

    times, cpu_times = [], []
    for i in range(args.warmup + args.repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        out = compiled(hidden, lm_head)
        jax.block_until_ready(out)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
            cpu_times.append(time.process_time() - c0)
        del out
    print(
        json.dumps(
            {
                "path": args.child,
                "compile_s": compile_s,
                "times_s": times,
                "median_s": statistics.median(times),
                "median_cpu_s": statistics.median(cpu_times),
                "xla_temp_mb": temp_bytes / MB,
                "rss_start_mb": rss_start,
                "rss_inputs_mb": rss_inputs,
                "peak_rss_mb": _proc_status_mb("VmHWM"),
            }
        ),
        flush=True,
    )


def _run_child(path: str, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", path]
    for name in ("tokens", "vocab", "dim", "chunk_size", "vocab_chunk_size", "repeats", "warmup"):
        cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        raise SystemExit(f"{path} child failed with exit code {proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192, help="N*T (default 8192)")
    p.add_argument("--vocab", type=int, default=151_936, help="V (default 151936, Qwen2)")
    p.add_argument("--dim", type=int, default=896, help="D (default 896, Qwen2-0.5B)")
    p.add_argument("--chunk-size", type=int, default=None, help="tokens per tile")
    p.add_argument("--vocab-chunk-size", type=int, default=None, help="vocab entries per tile")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--paths", default="naive,chunked", help="comma list: naive,chunked")
    p.add_argument("--child", choices=["naive", "chunked"], help=argparse.SUPPRESS)
    args = p.parse_args()

    if args.chunk_size is None or args.vocab_chunk_size is None:
        repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        sys.path.insert(0, repo)
        from grpojax.ops import logprobs

        args.chunk_size = args.chunk_size or logprobs.DEFAULT_CHUNK_SIZE
        args.vocab_chunk_size = args.vocab_chunk_size or logprobs.DEFAULT_VOCAB_CHUNK_SIZE
    if args.child:
        _child(args)
        return

    import jax

    paths = [s.strip() for s in args.paths.split(",") if s.strip()]
    print(f"machine: {machine()}, ", end="")
    print(f"backend {jax.default_backend()}")
    logits_mb = args.tokens * args.vocab * 4 / MB
    print(
        f"shape: N*T={args.tokens} V={args.vocab} D={args.dim} float32; one [N*T, V] f32 array "
        f"= {logits_mb:.0f} MiB; tiles {args.chunk_size} x {args.vocab_chunk_size}"
    )
    print("op: value_and_grad(sum(logp)) w.r.t. hidden [N*T, D] and lm_head [D, V]")
    print("peak_rss: child's VmHWM (whole process: runtime + inputs + the op), fresh process")
    print("xla_temp: compiled.memory_analysis().temp_size_in_bytes (XLA scratch only)")
    print(f"time: median wall (and process cpu) of {args.repeats} runs after {args.warmup} warm-up")
    with open("/proc/loadavg") as f:
        print(f"load average at start: {' '.join(f.read().split()[:3])}")
    results = {}
    for path in paths:
        results[path] = r = _run_child(path, args)
        print(
            f"  {path:8s} compile {r['compile_s']:7.2f} s | median {r['median_s']:8.3f} s "
            f"(runs {', '.join(f'{t:.3f}' for t in r['times_s'])}; cpu {r['median_cpu_s']:.1f} s)"
            f" | peak_rss "
            f"{r['peak_rss_mb']:9.1f} MiB (after inputs {r['rss_inputs_mb']:.1f}) | xla_temp "
            f"{r['xla_temp_mb']:9.1f} MiB",
            flush=True,
        )
    if {"naive", "chunked"} <= results.keys():
        n, c = results["naive"], results["chunked"]
        mem_ratio = c["peak_rss_mb"] / n["peak_rss_mb"]
        time_ratio = c["median_s"] / n["median_s"]
        extra_n = n["peak_rss_mb"] - n["rss_inputs_mb"]
        extra_c = c["peak_rss_mb"] - c["rss_inputs_mb"]
        cpu_ratio = c["median_cpu_s"] / n["median_cpu_s"]
        print(
            f"  ratio chunked/naive: peak_rss {mem_ratio:.3f}, wall time {time_ratio:.3f}, "
            f"process cpu time {cpu_ratio:.3f} (less sensitive to other load on the machine)"
        )
        print(
            f"  peak above inputs: naive {extra_n:.1f} MiB, chunked {extra_c:.1f} MiB "
            f"(ratio {extra_c / extra_n:.3f}); xla_temp ratio "
            f"{c['xla_temp_mb'] / max(n['xla_temp_mb'], 1e-9):.4f}"
        )
        print(
            f"bench_logprobs: naive_peak_mb={n['peak_rss_mb']:.1f} "
            f"chunked_peak_mb={c['peak_rss_mb']:.1f} mem_ratio={mem_ratio:.4f} "
            f"naive_s={n['median_s']:.3f} chunked_s={c['median_s']:.3f} "
            f"time_ratio={time_ratio:.4f}"
        )


if __name__ == "__main__":
    main()
