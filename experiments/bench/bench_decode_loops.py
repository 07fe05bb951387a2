"""Decode loops against one loop: `generate`'s time as the completion grows, in the same run.

`generate(decode_loops=k)` splits the T - 1 decode steps into up to k loops, loop i reading
only the first cache slots its steps can have filled (`decode_plan`); `decode_loops=1` is one
loop over all T slots on every step. For each completion length T (`--ts`), N = B*G = 32 rows
(`bench_roofline`'s workload: B 4 prompts x G 8, P 32, temperature 1, no EOS, so every row
decodes all T tokens; `--arch tiny|0.5b`), both programs are compiled, then timed in
alternating rounds (the minimum of `--calls` calls of each per round). The speedup is the
median over `--rounds` rounds of (one loop's time / the decode loops' time). Same key, so the
same draws: tokens should be equal and logprobs equal up to the order of the attention's sums
(the unread slots are the masked ones); the table prints both checks.

The last line is `bench_decode_loops: t<T>=<speedup> ... loops=<k> arch=<a>`.

    python experiments/bench/bench_decode_loops.py [--arch tiny|0.5b] [--ts 256 512 1024]
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench_roofline import B, G, Workload, model_config
from benchlib import exact_float32_matmuls, machine, wall_times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=("tiny", "0.5b"), default="tiny")
    parser.add_argument("--ts", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--calls", type=int, default=2, help="calls of each program a round")
    args = parser.parse_args()

    import jax
    import numpy as np

    from grpojax.sampling.generate import DECODE_LOOPS, decode_plan

    precision = exact_float32_matmuls()
    config = model_config(args.arch)
    w = Workload(config)
    print(f"machine: {machine()}")
    print(
        f"jax {jax.__version__} ({jax.default_backend()}); model {args.arch}: "
        f"D={config.hidden_size} L={config.num_layers} V={config.vocab_size}, "
        f"{config.dtype} compute; {precision}"
    )
    print(
        f"workload: N={B * G} rows (B {B} x G {G}), temperature 1, no EOS; decode_loops "
        f"{DECODE_LOOPS} against 1; min of {args.calls} calls a round, {args.rounds} rounds"
    )
    print(
        f"{'T':>5} {'loops':>5} {'one loop s':>10} {'loops s':>8} {'speedup':>8} "
        f"{'compile s (1, k)':>17} {'tokens equal':>12} {'max |dlogp|':>11}"
    )
    summary = []
    for t in args.ts:
        one, many = w.generate(B, t, decode_loops=1), w.generate(B, t)
        compile_s = []
        for fn in (one, many):
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            compile_s.append(time.perf_counter() - t0)
        ratios, one_s, many_s = [], [], []
        for _ in range(args.rounds):
            one_s.append(min(wall_times(one, args.calls)))
            many_s.append(min(wall_times(many, args.calls)))
            ratios.append(one_s[-1] / many_s[-1])
        a, b = one(), many()
        equal = np.mean(np.asarray(a.tokens_nt) == np.asarray(b.tokens_nt))
        mask = np.asarray(a.mask_nt)
        dlogp = np.max(np.abs(np.asarray(a.logp_nt) - np.asarray(b.logp_nt)) * mask)
        speedup = statistics.median(ratios)
        # the first call's time less a steady one: compile (and transfer) time
        compiled = f"{compile_s[0] - min(one_s):.1f}, {compile_s[1] - min(many_s):.1f}"
        print(
            f"{t:>5} {len(decode_plan(t, DECODE_LOOPS)):>5} {statistics.median(one_s):>10.4f} "
            f"{statistics.median(many_s):>8.4f} {speedup:>7.2f}x {compiled:>17} "
            f"{equal:>12.1%} {dlogp:>11.2e}"
        )
        summary.append(f"t{t}={speedup:.3f}")
        jax.clear_caches()  # two programs per T: free them before the next
    print(f"bench_decode_loops: {' '.join(summary)} loops={DECODE_LOOPS} arch={args.arch}")


if __name__ == "__main__":
    main()
