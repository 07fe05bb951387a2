"""Benchmark: one attention layer's forward and forward+backward at long lengths, by backend.

One row of T tokens, causal, no padding (the case every kernel takes), a Qwen2.5-7B layer's
heads by default (28 query heads, 4 key-value heads of 128), bf16 inputs. Backends:

- `einsum`: grpojax's reference (`grpojax.models.attention`, whole float32 score array).
- `blockwise[:B]`: grpojax's online softmax in B x B tiles (default 256), custom VJP.
- `fused`: grpojax's `fused` backend, `jax.nn.dot_product_attention` (cuDNN on a GPU) after
  the mask conversion (each row's real tokens moved first): what `model.attention=auto`
  runs on a GPU for bf16 rows of one sequence.
- `xla`, `cudnn`: `jax.nn.dot_product_attention(implementation=...)`, `is_causal=True`.
- `tokamax-IMPL`: `tokamax.dot_product_attention(implementation=IMPL)`, IMPL one of
  mosaic, triton, cudnn, xla, xla_chunked (if tokamax imports).

For each T and backend: XLA's compiled scratch bytes of the forward+backward program
(`memory_analysis().temp_size_in_bytes`, known without running), then, where it fits
`--max-run-gb`, the median wall time of `--repeats` forwards and of forward+backwards, and
tokens/s = T / time. Before timing, each backend's output and gradients at `--check-t` are
compared with the einsum path on float32 copies of the same inputs at 'highest' precision:
relative error ||x - ref|| / ||ref||, the largest of out, dq, dk, dv.

Usage: `python experiments/bench/bench_attention.py [--lengths 4096,8192,16384,32768]
[--backends einsum,blockwise,cudnn,...]`. Last line
`bench_attention: T=.. best=.. best_fwd_bwd_tok_s=.. blockwise_over_einsum_temp=..
fused_over_blockwise=..` (the fused path's forward+backward speed over the blockwise one's).
"""

from __future__ import annotations

import argparse
import functools
import statistics

import numpy as np
from benchlib import machine, wall_times

GB = 2**30


def _attend(backend: str):
    """`f(q [1, T, Q, H], k, v [1, T, K, H]) -> [1, T, Q, H]` for `backend`."""
    import jax
    import jax.numpy as jnp

    from grpojax.models.attention import SelfMask, attention

    name, _, arg = backend.partition(":")
    if name in ("einsum", "blockwise", "fused"):
        block = int(arg) if arg else 256

        def ours(q, k, v):
            mask = SelfMask.from_mask(jnp.ones(q.shape[:2], jnp.int32))
            return attention(q, k, v, mask, implementation=name, block=block)

        return ours
    if name in ("xla", "cudnn"):
        return functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation=name)
    if name.startswith("tokamax-"):
        import tokamax
        from absl import flags

        if not flags.FLAGS.is_parsed():  # tokamax reads absl flags; this script has its own
            flags.FLAGS.mark_as_parsed()

        return functools.partial(
            tokamax.dot_product_attention, is_causal=True, implementation=name[len("tokamax-") :]
        )
    raise ValueError(f"unknown backend {backend!r}")


def _programs(backend: str):
    """(forward, forward+backward) jitted functions of (q, k, v, do)."""
    import jax
    import jax.numpy as jnp

    f = _attend(backend)

    def loss(q, k, v, do):
        return jnp.sum(f(q, k, v).astype(jnp.float32) * do.astype(jnp.float32))

    fwd = jax.jit(lambda q, k, v, do: f(q, k, v))
    fwd_bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    return fwd, fwd_bwd


def _inputs(t: int, heads: int, kv_heads: int, head_dim: int, dtype, seed: int):
    import jax

    ks = jax.random.split(jax.random.key(seed), 4)
    shapes = [(1, t, heads, head_dim), (1, t, kv_heads, head_dim), (1, t, kv_heads, head_dim)]
    shapes.append(shapes[0])
    return [jax.random.normal(k, s, dtype) for k, s in zip(ks, shapes)]


def _rel(x, ref) -> float:
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    if not np.all(np.isfinite(x)):
        return float("nan")
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def check(backend: str, args, dtype) -> float:
    """Largest relative error of out, dq, dk, dv against the float32 einsum path."""
    import jax
    import jax.numpy as jnp

    q, k, v, do = _inputs(args.check_t, args.heads, args.kv_heads, args.head_dim, dtype, seed=1)
    fwd, fwd_bwd = _programs(backend)
    ref_fwd, ref_fwd_bwd = _programs("einsum")
    f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
    with jax.default_matmul_precision("highest"):
        ref = [ref_fwd(*f32), *ref_fwd_bwd(*f32)]
    got = [fwd(q, k, v, do), *fwd_bwd(q, k, v, do)]
    return max(_rel(g, r) for g, r in zip(got, ref))


def measure(backend: str, t: int, args, dtype) -> dict:
    q, k, v, do = _inputs(t, args.heads, args.kv_heads, args.head_dim, dtype, seed=0)
    fwd, fwd_bwd = _programs(backend)
    row = {"backend": backend, "T": t}
    try:
        compiled = fwd_bwd.lower(q, k, v, do).compile()
        fwd_c = fwd.lower(q, k, v, do).compile()
    except Exception as e:  # a kernel that does not take this shape / device
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        return row
    row["temp_gb"] = compiled.memory_analysis().temp_size_in_bytes / GB
    row["fwd_temp_gb"] = fwd_c.memory_analysis().temp_size_in_bytes / GB
    if row["temp_gb"] > args.max_run_gb:
        return row
    try:
        for name, prog in (("fwd", fwd_c), ("fwd_bwd", compiled)):
            prog(q, k, v, do)  # warm
            row[f"{name}_s"] = statistics.median(
                wall_times(lambda p=prog: p(q, k, v, do), args.repeats)
            )
            row[f"{name}_tok_s"] = t / row[f"{name}_s"]
    except Exception as e:  # out of memory at run time
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    return row


def main() -> None:
    import jax.numpy as jnp

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="4096,8192,16384,32768")
    parser.add_argument(
        "--backends",
        default="einsum,blockwise,blockwise:1024,fused,xla,cudnn,tokamax-mosaic,tokamax-triton",
    )
    parser.add_argument("--heads", type=int, default=28)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-run-gb", type=float, default=100.0)
    parser.add_argument("--check-t", type=int, default=2048)
    args = parser.parse_args()
    dtype = jnp.dtype(args.dtype)
    lengths = [int(x) for x in args.lengths.split(",")]
    print(f"machine: {machine()}")
    print(
        f"one row, causal, {args.heads} query / {args.kv_heads} kv heads of {args.head_dim},"
        f" {args.dtype}; median of {args.repeats}",
        flush=True,
    )
    backends = []
    for b in args.backends.split(","):
        try:
            err = check(b, args, dtype)
        except Exception as e:
            print(f"  {b}: unavailable ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
            continue
        print(f"  {b}: max rel err vs float32 einsum at T={args.check_t}: {err:.2e}", flush=True)
        backends.append(b)
    rows = []
    for t in lengths:
        for b in backends:
            row = measure(b, t, args, dtype)
            rows.append(row)
            print("  ", {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()})
    print(
        f"{'T':>6} {'backend':<16} {'temp_GB':>8} {'fwd_ms':>8} {'fb_ms':>8} "
        f"{'fwd tok/s':>10} {'fb tok/s':>10} {'fb vs einsum':>12}"
    )
    for t in lengths:
        base = next((r for r in rows if r["T"] == t and r["backend"] == "einsum"), {})
        for r in (r for r in rows if r["T"] == t):
            if "error" in r:
                print(f"{t:>6} {r['backend']:<16} {r['error']}")
                continue
            fwd_ms = r.get("fwd_s", float("nan")) * 1e3
            fb_ms = r.get("fwd_bwd_s", float("nan")) * 1e3
            ratio = base.get("fwd_bwd_s", float("nan")) / r.get("fwd_bwd_s", float("nan"))
            print(
                f"{t:>6} {r['backend']:<16} {r['temp_gb']:>8.2f} {fwd_ms:>8.2f} {fb_ms:>8.2f} "
                f"{r.get('fwd_tok_s', float('nan')):>10.0f} "
                f"{r.get('fwd_bwd_tok_s', float('nan')):>10.0f} {ratio:>12.2f}"
            )
    t = max(lengths)
    timed = [r for r in rows if r["T"] == t and "fwd_bwd_s" in r]
    best = min(timed, key=lambda r: r["fwd_bwd_s"]) if timed else {"backend": "none"}
    temps = {r["backend"]: r.get("temp_gb") for r in rows if r["T"] == t}
    block = next((v for b, v in temps.items() if b.startswith("blockwise") and v), float("nan"))
    ratio = block / (temps.get("einsum") or float("nan"))
    fb = {r["backend"]: r["fwd_bwd_s"] for r in timed}
    blockwise_s = min((v for b, v in fb.items() if b.startswith("blockwise")), default=float("nan"))
    print(
        f"bench_attention: T={t} best={best['backend']} "
        f"best_fwd_bwd_tok_s={best.get('fwd_bwd_tok_s', float('nan')):.0f} "
        f"blockwise_over_einsum_temp={ratio:.3f} "
        f"fused_over_blockwise={blockwise_s / fb.get('fused', float('nan')):.2f}"
    )


if __name__ == "__main__":
    main()
