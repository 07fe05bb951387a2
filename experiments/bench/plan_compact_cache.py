"""How many rows a fixed KV-cache budget holds: the compacting engine against one cache of
N x (P + T) slots (the static engine's, and the continuous engine's with N slots).

The compacting engine (`grpojax.sampling.compact`) holds R x (P + e) slots at a time: R the
smallest of its row sizes that holds the live samples, e the extent of the phase holding the
step; while it resizes, the old and the new cache both (`compact.cache_slots`, a host
simulation of its schedule). For each workload and T, the budget is the static engine's
cache for `--rows` rows; the row count it allows the compacting engine is the largest N
whose peak fits it, N's lengths drawn as the benchmarks draw them (lognormal, mean T/4,
clipped to [16, T]; or every row to T). Slots are per layer and kv head; multiply by
2 x layers x kv heads x head dim x bytes for bytes. Nothing is run on a device.

    python experiments/bench/plan_compact_cache.py [--rows 128] [--ts 1024 32768]

Also printed: the engine's decode utilisation on the same lengths (real tokens over
row-steps), from its schedule.

Last line: `plan_compact_cache: rows=.. t=.. longtail_rows=.. uniform_rows=..`
"""

from __future__ import annotations

import argparse

import numpy as np
from bench_long_context import longtail_lengths

from grpojax.sampling import compact
from grpojax.sampling.generate import decode_plan

P = 32


def peak_slots(lengths, t: int, layers: int) -> tuple[float, int]:
    plan = decode_plan(t, compact.WIDTH_PHASES)
    return compact.cache_slots(lengths, P, t, plan, num_layers=layers)


def utilisation(lengths) -> float:
    """Real tokens / row-steps of the compacting engine on `lengths` (its schedule: step
    t >= 1 decodes the smallest row size holding the samples still live; the prefill draws
    token 0 of all N), as `tests/test_sampling_compact.py` checks it against the engine."""
    sizes = compact.row_sizes(len(lengths))
    live = [int((lengths > t).sum()) for t in range(1, int(lengths.max()))]
    steps = len(lengths) + sum(min(r for r in sizes if r >= k) for k in live)
    return float(lengths.sum()) / steps


def rows_within(budget: int, t: int, draw, layers: int) -> int:
    """The largest N (by bisection over N) whose compacting peak fits `budget` slots."""
    fits = lambda k: peak_slots(draw(k), t, layers)[0] <= budget
    lo, hi = 1, 2
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--ts", type=int, nargs="+", default=[1024, 32768])
    parser.add_argument("--layers", type=int, default=36, help="a resize goes layer by layer")
    args = parser.parse_args()
    n = args.rows
    print(
        f"prompt width P {P}; {args.layers} layers; row sizes {compact.row_sizes(n)} (N {n}); "
        f"cache widened in up to {compact.WIDTH_PHASES} phases"
    )
    print(
        f"{'T':>6} {'lengths':>9} {'static slots':>13} {'compact peak':>13} {'ratio':>6} "
        f"{'rows in budget':>15} {'utilisation':>12}"
    )
    found = {}
    for t in args.ts:
        draws = {
            "long tail": lambda k, t=t: longtail_lengths(k, t),
            "uniform": lambda k, t=t: np.full(k, t),
        }
        for label, draw in draws.items():
            peak, full = peak_slots(draw(n), t, args.layers)
            rows = rows_within(full, t, draw, args.layers)
            found[(t, label)] = rows
            print(
                f"{t:>6} {label:>9} {full:>13,} {peak:>13,.0f} {full / peak:>5.2f}x "
                f"{n:>6} -> {rows:<6} {utilisation(draw(n)):>12.3f}",
                flush=True,
            )
    t = args.ts[-1]
    print(
        f"plan_compact_cache: rows={n} t={t} longtail_rows={found[(t, 'long tail')]} "
        f"uniform_rows={found[(t, 'uniform')]}"
    )


if __name__ == "__main__":
    main()
