"""The decode attention's two products on XLA:CPU: the scores q k^T against the weighted sum
p v, same bytes read, at a 30m-shape decode step (one layer: N rows, K kv heads, G query
heads each, head dim H, S cache slots; float32, exact matmuls).

The compacting engine's cache keeps a layer's keys as `[N, K, H, S]` and its values as
`[N, K, S, H]` (`grpojax.models.decoder.KVCache`); this times the scores in that layout and
in the values' layout against the value product, the fastest of 30 calls each, and the
scores written as H multiply-adds of `[N, K, G, S]` arrays instead of a dot (one loop fusion
vectorised along S: faster here, alone; inside the decode program it was not, see
`experiments/results/compact_cpu/README.md`).

    python experiments/bench/bench_score_product.py [--rows 128] [--slots 288]

Last line: `bench_score_product: rows=.. slots=.. scores_ms=.. values_ms=.. ratio=..`
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
from benchlib import exact_float32_matmuls, machine


def fastest_ms(f, *args, calls: int = 30) -> float:
    f = jax.jit(f)
    f(*args).block_until_ready()
    best = float("inf")
    for _ in range(calls):
        t0 = time.perf_counter()
        f(*args).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def _multiply_adds(q, x):
    """z[n,k,g,s] = sum_h q[n,k,g,h] x[n,k,h,s], in order h = 0..H-1."""
    z = q[..., 0, None] * x[:, :, None, 0, :]
    for i in range(1, q.shape[-1]):
        z = z + q[..., i, None] * x[:, :, None, i, :]
    return z


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--slots", type=int, default=288)
    args = parser.parse_args()
    precision = exact_float32_matmuls()
    n, k, g, h, s = args.rows, 4, 2, 64, args.slots
    q, p = jnp.ones((n, k, g, h)), jnp.ones((n, k, g, s))
    k_hs, k_sh = jnp.ones((n, k, h, s)), jnp.ones((n, k, s, h))
    mb = n * k * h * s * 4 / 2**20
    print(f"machine: {machine()}; {precision}")
    print(f"one layer: N {n}, K {k}, G {g}, H {h}, S {s}; keys or values {mb:.1f} MB")
    rows = {
        "scores, keys [N,K,H,S]": fastest_ms(
            lambda q, x: jnp.einsum("nkgh,nkhs->nkgs", q, x), q, k_hs
        ),
        "scores, keys [N,K,S,H]": fastest_ms(
            lambda q, x: jnp.einsum("nksh,nkgh->nksg", x, q), q, k_sh
        ),
        "scores, H multiply-adds": fastest_ms(_multiply_adds, q, k_hs),
        "values, [N,K,S,H]": fastest_ms(lambda p, x: jnp.einsum("nkgs,nksh->nkgh", p, x), p, k_sh),
    }
    print(f"{'product':>24} {'ms':>7} {'GB/s':>6}")
    for name, ms in rows.items():
        print(f"{name:>24} {ms:>7.3f} {mb / 1024 / (ms / 1e3):>6.1f}")
    scores, values = rows["scores, keys [N,K,H,S]"], rows["values, [N,K,S,H]"]
    print(
        f"bench_score_product: rows={n} slots={s} scores_ms={scores:.3f} "
        f"values_ms={values:.3f} ratio={scores / values:.2f}"
    )


if __name__ == "__main__":
    main()
