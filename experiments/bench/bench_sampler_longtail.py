"""Continuous batching against the static engine on long-tailed completion lengths.

Workload: B prompts x G samples (`--prompts`, `--group`; N = B*G rows), prompt width P 32,
temperature 1, no stop id. Each row's completion length is drawn from the packing benchmark's
long tail (`bench_long_context.longtail_lengths`: lognormal, sigma 1, clipped to [16, T],
mean T / 4) and imposed as the row's `token_budget_n`, so a random-weights model stops where
the draw says and the measurement does not depend on what an untrained model emits. `--uniform`
adds, at the smallest T, the case where every row runs to T (no loss wanted there).

For each T (`--ts`) and each engine (static, and continuous at each `--slots`), the program is
lowered and compiled (`compile s`), then timed in alternating rounds (`--calls` calls of each
per round, `--rounds` rounds); s/call is the fastest call, the speedup the static engine's
fastest call over the engine's. Reported per engine:
decode slot utilisation = real tokens / (decode steps x rows or slots decoded per step),
generated tokens per second, and whether its tokens equal the static engine's (same key:
token t of row n is drawn with key(n, t) by both engines).

Last line: `bench_sampler_longtail: utilisation_static=.. utilisation_continuous=..
speedup=.. uniform_ratio=..` for the largest T, with the best continuous slot count there
(uniform_ratio: static time / continuous time at that slot count, at the smallest T).
`--compact` adds the compacting engine (`engine="compact"`; several programs, so its
compile column is its first call's time, compiles and run); the line then also carries
`compact_tok_s=.. compact_over_continuous=..` (against the best continuous slot count).
`--bound` measures the read bandwidth (a jitted sum over 1 GB) and adds each engine's time
over the memory bound of an engine that reads only what it must: every decode step reads
the weights once and each live row's cache, `sum_t (W + kv (P + t) live_t) / bandwidth`
(W the weights' bytes in the compute dtype, kv a token's keys and values over all layers,
live_t the rows still decoding at step t); the line then carries `best_vs_bound=..`.

    python experiments/bench/bench_sampler_longtail.py [--arch tiny|0.5b|30m] [--ts 512 2048]
"""

from __future__ import annotations

import argparse

from bench_long_context import longtail_lengths
from bench_roofline import model_config
from benchlib import exact_float32_matmuls, machine, read_bandwidth, sampler_prompts, wall_times

P = 32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=("tiny", "0.5b", "30m"), default="tiny")
    parser.add_argument("--ts", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--slots", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--calls", type=int, default=1)
    parser.add_argument("--uniform", action="store_true", help="also every row to T")
    parser.add_argument("--compact", action="store_true", help="also the compacting engine")
    parser.add_argument("--bound", action="store_true", help="times over the memory bound")
    args = parser.parse_args()

    import jax
    import numpy as np
    from flax import nnx

    from grpojax.models import Decoder
    from grpojax.sampling import SamplingConfig, generate

    precision = exact_float32_matmuls()
    config = model_config(args.arch)
    model = Decoder(config, rngs=nnx.Rngs(0))
    b, g = args.prompts, args.group
    n = b * g
    prompts, plens = sampler_prompts(b, P, config.vocab_size)

    bandwidth = read_bandwidth(1024) if args.bound else None
    print(f"machine: {machine()}")
    if bandwidth:
        print(f"read bandwidth (jitted sum over 1 GB, best of 5): {bandwidth / 1e9:.0f} GB/s")
    print(
        f"jax {jax.__version__} ({jax.default_backend()}); model {args.arch}: "
        f"D={config.hidden_size} L={config.num_layers} V={config.vocab_size}, "
        f"{config.dtype} compute; {precision}"
    )
    print(
        f"workload: N={n} rows (B {b} x G {g}), P {P}, temperature 1, lengths drawn per row "
        f"(long tail: lognormal clipped to [16, T], mean T/4) as token budgets; min of "
        f"{args.calls} calls a round, {args.rounds} rounds"
    )
    print(
        f"{'T':>5} {'lengths':>8} {'engine':>14} {'util':>6} {'steps':>6} {'s/call':>8} "
        f"{'tok/s':>8} {'speedup':>8} {'compile s':>9} {'same tokens':>11}"
        + (f" {'x bound':>8}" if bandwidth else "")
    )
    summary = {}
    for t in args.ts:
        cases = [("longtail", longtail_lengths(n, t).astype(np.int32))]
        if args.uniform and t == min(args.ts):
            cases.append(("uniform", np.full(n, t, np.int32)))
        for label, budget in cases:
            engines = [("static", dict(engine="static"))] + [
                (f"continuous:{s}", dict(engine="continuous", slots=s)) for s in args.slots
            ]
            if args.compact:
                engines.append(("compact", dict(engine="compact")))

            def call(kw, budget=budget, t=t):
                return generate(
                    model, prompts, plens, key=jax.random.key(1), max_new_tokens=t,
                    group_size=g, sampling=SamplingConfig(temperature=1.0),
                    token_budget_n=budget, **kw,
                )  # fmt: skip

            first = {}
            for name, kw in engines:
                if kw["engine"] == "compact":  # several programs: its first call, compiles in
                    (compile_s,) = wall_times(lambda kw=kw: call(kw), 1)
                else:
                    lowered = lambda kw=kw: call(dict(kw, lower=True)).compile()
                    (compile_s,) = wall_times(lowered, 1)
                first[name] = (compile_s, call(kw))  # (the call compiles again: not timed)
            times = {name: [] for name, _ in engines}
            for _ in range(args.rounds):
                for name, kw in engines:
                    times[name].append(min(wall_times(lambda kw=kw: call(kw), args.calls)))
            ref = first["static"][1]
            tokens = int(budget.sum())
            for name, _ in engines:
                compile_s, r = first[name]
                best = min(times[name])
                ratio = min(times["static"]) / best
                util = tokens / int(r.row_steps)
                same = bool(np.array_equal(np.asarray(r.tokens_nt), np.asarray(ref.tokens_nt)))
                vs_bound = best / decode_bound_s(config, budget, bandwidth) if bandwidth else None
                print(
                    f"{t:>5} {label:>8} {name:>14} {util:>6.1%} {int(r.decode_steps):>6} "
                    f"{best:>8.2f} {tokens / best:>8.0f} {ratio:>7.2f}x "
                    f"{compile_s:>9.1f} {same!s:>11}" + (f" {vs_bound:>7.2f}x" if vs_bound else ""),
                    flush=True,
                )
                summary[(t, label, name)] = (util, ratio, tokens / best, vs_bound)
    t = max(args.ts)
    best = max(
        (k for k in summary if k[0] == t and k[1] == "longtail" and k[2].startswith("cont")),
        key=lambda k: summary[k][1],
    )
    static_util = summary[(t, "longtail", "static")][0]
    line = (
        f"bench_sampler_longtail: t={t} utilisation_static={static_util:.3f} "
        f"utilisation_continuous={summary[best][0]:.3f} speedup={summary[best][1]:.2f} "
        f"slots={best[2].split(':')[1]} rows={n} arch={args.arch}"
    )
    if args.uniform:
        t0 = min(args.ts)
        line += f" uniform_ratio={summary[(t0, 'uniform', best[2])][1]:.2f} uniform_t={t0}"
    line += f" continuous_tok_s={summary[best][2]:.0f}"
    if args.compact:
        compact = summary[(t, "longtail", "compact")]
        line += (
            f" compact_tok_s={compact[2]:.0f}"
            f" compact_over_continuous={compact[2] / summary[best][2]:.2f}"
        )
    if bandwidth:
        vs = min(v[3] for k, v in summary.items() if k[:2] == (t, "longtail"))
        line += f" best_vs_bound={vs:.2f}"
    print(line)


def decode_bound_s(config, budget_n, bandwidth: float) -> float:
    """Seconds an engine reading only what it must spends decoding rows of `budget_n` tokens
    after P-token prompts: each step reads the weights (in the compute dtype) once and each
    live row's keys and values so far, at `bandwidth` bytes a second."""
    import numpy as np

    size = np.dtype(config.dtype).itemsize
    weights = config.num_params() * size
    kv = 2 * config.num_layers * config.num_kv_heads * config.head_dim * size
    steps = np.arange(int(budget_n.max()))
    live = np.asarray(budget_n)[None, :] > steps[:, None]  # [steps, N]
    context = ((P + steps)[:, None] * live).sum()
    return float(len(steps) * weights + kv * context) / bandwidth


if __name__ == "__main__":
    main()
