"""Where a continuous-engine decode step's time goes at 8, 16, 32 and 128 slots (issue 60).

Workload (issue 60's long tail): the `30m` Qwen3-style decoder (`bench_roofline.model_config`:
D 512, 8 layers, 8/4 heads of 64, vocabulary 8,192, 33.6M parameters, float32), B 16 prompts x
G 8 samples (N 128 rows), prompts padded to P 32, temperature 1, no stop id; each row's
completion length drawn from `bench_long_context.longtail_lengths` (lognormal clipped to
[16, T], mean T/4) and imposed as its `token_budget_n`, T 1,024 (`--t`): every slot's cache
holds P - 1 + T = 1,055 positions. `engine="continuous"` at each slot count of `--slots`.

For each slot count the engine's program is lowered and compiled once (`compile s`), then

1. timed: one call, blocked on; step ms = the call's wall time / its decode steps (the
   engine's `decode_steps`: iterations of its `while_loop`, each a refill, one decode step of
   all slots and the bookkeeping; the prompts' prefill, ~0.1% of the work, is included);
   token ms = wall / real tokens = step ms / live slots a step (live = tokens / steps);
2. profiled: a second call, with `jax.profiler` traces over `--windows` windows of about
   `--window-steps` steps each, spread over the call (25%, 50%, 75% of its duration); each
   step (from one start of a decode layer loop to the next: `optimeline.step_breakdown`) has
   every instant charged to one category, the first running one of: weight matmuls (the
   layers' dots), attention matmuls (the batched q.k and p.v dots over the cache), lm head
   (the dot outside the layer loop), other layer ops (norms, RoPE, softmax, ...), sampling
   and bookkeeping (ops outside the layer loop: the draw, the cache write scatter, the
   output writes), refill (the prompt-cache copy into refilled slots), slice copies (the
   layer loop's dynamic slices of the stacked per-layer weights and of the cache up to the
   step's extent), else idle (no op running: the executor's scheduling and waits). The
   profiler costs a few microseconds an op, so the traced step is slower than the timed one;
   the categories are reported in traced ms and as fractions.

A host simulation of the engine's schedule (same refill order, same extent choice:
`continuous.cache_extents`, the smallest extent holding the deepest live slot) gives each
step's extent and live slots, so the cache bytes a step reads (K and V of every slot up to
the extent, all layers) against the live ones (each live slot's filled positions only) and
the weight bytes (all but the embedding table); its decode steps are checked against the
engine's. A simple model, from this machine's memory read bandwidth (a jitted sum over 512 MB)
and float32 matmul peak (`benchlib.matmul_peak`): weights read once a step + the slots'
matmul FLOPs at peak + the cache read once up to the extent, for every slot.

Ratios are against the first slot count of the same run. The last line is
`profile_decode_slots: t=.. rows=.. arch=.. step_ms_<s>=.. tok_ms_<s>=.. tok_ratio_<s>=..
fastest_slots=.. worst_pair=<a>-<b> grew_most=<category> cores=..` (tok_ratio: token ms
against the first slot count's; worst_pair: the consecutive slot counts where a token's cost
rose the most; grew_most: the category whose traced ms a token grew the most between them).

    python experiments/bench/profile_decode_slots.py [--slots 8 16 32 128] [--t 1024] [--quick]
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import itertools
import json
import os
import re
import tempfile
import time

import optimeline
from bench_long_context import longtail_lengths
from bench_roofline import model_config
from benchlib import (
    exact_float32_matmuls,
    machine,
    matmul_peak,
    read_bandwidth,
    sampler_prompts,
    wall_times,
)

P = 32
W_MM, A_MM, HEAD = "weight matmuls", "attention matmuls", "lm head"
OTHER, BOOK, REFILL = "other layer ops", "sampling+bookkeeping", "refill copies"
SLICE, IDLE = optimeline.SLICE, optimeline.IDLE
PRIORITY = (W_MM, A_MM, HEAD, OTHER, BOOK, REFILL, SLICE)
CATEGORIES = (*PRIORITY, IDLE)
SHORT = dict(
    zip(CATEGORIES, ("w-mm", "attn-mm", "head", "other", "book", "refill", "slices", "idle"))
)


# ---------------------------------------------------------------- the optimised HLO


def _computations(hlo: str) -> dict[str, list[str]]:
    bodies, current = {}, None
    for line in hlo.splitlines():
        if m := optimeline._COMPUTATION.match(line):
            current = bodies.setdefault(m.group(1), [])
        elif line.startswith("}"):
            current = None
        elif current is not None:
            current.append(line)
    return bodies


_NAME = re.compile(r"^\s*(?:ROOT )?%?([\w.-]+) = ")


def _name(line: str) -> str | None:
    m = _NAME.match(line)
    return m.group(1) if m else None


def _called(line: str) -> list[str]:
    out = re.findall(r"(?:calls|body|condition|to_apply)=%?([\w.-]+)", line)
    for group in re.findall(r"branch_computations=\{([^}]*)\}", line):
        out += [x.strip().lstrip("%") for x in group.split(",")]
    return out


def hlo_map(hlo: str, cache_shape: tuple[int, ...], slots: int, head_dim: int, extents):
    """(category of each top-level op name, {decode layer loop name: its extent}, names of
    container ops to leave out of the attribution: the loops and the phase switch)."""
    bodies = _computations(hlo)
    base = optimeline.op_categories(hlo)

    def reach(comp: str, seen=None) -> set[str]:
        seen = set() if seen is None else seen
        if comp in seen or comp not in bodies:
            return seen
        seen.add(comp)
        for line in bodies[comp]:
            for c in _called(line):
                reach(c, seen)
        return seen

    def has(comps, pattern) -> bool:
        return any(re.search(pattern, ln) for c in comps for ln in bodies.get(c, []))

    layer_bodies, loops, containers = set(), {}, set()
    refill_comps = set()
    cache_t = "f32[" + ",".join(map(str, cache_shape)) + "]"
    for lines in bodies.values():
        for line in lines:
            name = _name(line)
            if name is None:
                continue
            if " while(" in line:
                containers.add(name)
                body = re.search(r"body=%?([\w.-]+)", line).group(1)
                direct = bodies.get(body, [])
                nested = any(" while(" in ln for ln in direct)
                if not nested and has(reach(body), r" dot\("):
                    # a layer loop: a decode step's when its x is [S, 1, D]
                    x_shape = re.search(r"\(s32\[\], f32\[(\d+),(\d+),\d+\]", line)
                    if x_shape and int(x_shape[1]) == slots and int(x_shape[2]) == 1:
                        layer_bodies.add(body)
                        sizes = re.findall(
                            rf"\[1?,?{slots},\d+,{head_dim},(\d+)\]",
                            "\n".join(ln for c in reach(body) for ln in bodies[c]),
                        )
                        loops[name] = max(set(map(int, sizes)) & set(extents), default=0)
            elif " conditional(" in line:
                branches = [c for ln in [line] for c in _called(ln)]
                inner = set().union(*(reach(c) for c in branches)) if branches else set()
                if has(inner, r" while\("):
                    containers.add(name)  # the phase switch: spans whole phases
                elif cache_t in line.split(" conditional(")[0]:
                    refill_comps |= inner
                    base[name] = REFILL
    layer_ops = {_name(ln) for c in layer_bodies for ln in bodies[c]} - {None}
    refill_ops = {_name(ln) for c in refill_comps for ln in bodies[c]} - {None}

    def batched(name: str) -> bool:
        line = next((ln for c in bodies.values() for ln in c if _name(ln) == name), "")
        comps = reach(m.group(1)) if (m := re.search(r"calls=%?([\w.-]+)", line)) else set()
        return "lhs_batch_dims" in line or has(comps, r" dot\(.*lhs_batch_dims")

    category = {}
    for line in (ln for c in bodies.values() for ln in c):
        name = _name(line)
        if name is not None and name not in base:  # tuple-shaped: multi-output fusions
            called = reach(m.group(1)) if (m := re.search(r"calls=%?([\w.-]+)", line)) else set()
            base[name] = optimeline.MATMUL if has(called, r" dot\(") else optimeline.OTHER
    for name, kind in base.items():
        if kind == REFILL or name in refill_ops:
            category[name] = REFILL
        elif name in layer_ops:
            if kind == optimeline.MATMUL:
                category[name] = A_MM if batched(name) else W_MM
            else:
                category[name] = SLICE if kind == optimeline.SLICE else OTHER
        else:
            category[name] = HEAD if kind == optimeline.MATMUL else BOOK
    return category, loops, containers


# ---------------------------------------------------------------- the schedule


def simulate(budget, slots: int, extents, width: int):
    """The engine's schedule on the host: per step (extent read, live slots, live cache
    positions summed over live slots). Refill in slot order, samples in order; the extent is
    the smallest holding the deepest live slot's write index before the refill."""
    import numpy as np

    n = len(budget)
    sample = np.full(slots, -1)
    t = np.zeros(slots, int)
    index = np.zeros(slots, int)
    nxt, out = 0, []
    ext = np.asarray(extents)
    while (sample >= 0).any() or nxt < n:
        need = int(index[sample >= 0].max()) if (sample >= 0).any() else 0
        extent = int(ext[np.searchsorted(ext, need)])
        for k in np.flatnonzero(sample < 0):
            if nxt < n:
                sample[k], t[k], index[k], nxt = nxt, 0, P - 1, nxt + 1
        live = sample >= 0
        out.append((extent, int(live.sum()), int(index[live].sum() + live.sum())))
        t[live] += 1
        index[live] = np.minimum(index[live] + 1, width - 1)
        ended = live & (t >= budget[np.maximum(sample, 0)])
        sample[ended] = -1
    return out


# ---------------------------------------------------------------- measurements


def cpu_caches() -> str:
    out = []
    for d in sorted(glob.glob("/sys/devices/system/cpu/cpu0/cache/index*")):
        try:
            level = open(f"{d}/level").read().strip()
            kind = open(f"{d}/type").read().strip()
            size = open(f"{d}/size").read().strip()
        except OSError:
            continue
        if kind != "Instruction":
            out.append(f"L{level} {size}")
    return ", ".join(out) or "unknown"


def traced_windows(run, fractions, window_s: float, expected_s: float):
    """Call `run()` once (asynchronously dispatched) and trace a window of `window_s` at each
    fraction of `expected_s`. Returns (its wall seconds, [trace events of each window])."""
    import jax

    windows = []
    t0 = time.perf_counter()
    out = run()
    for f in fractions:
        wait = t0 + f * expected_s - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        with tempfile.TemporaryDirectory() as tmp:
            jax.profiler.start_trace(tmp)
            time.sleep(window_s)
            jax.profiler.stop_trace()
            paths = glob.glob(f"{tmp}/**/*.trace.json.gz", recursive=True)
            if paths:
                windows.append(json.load(gzip.open(paths[0]))["traceEvents"])
    jax.block_until_ready(out)
    return time.perf_counter() - t0, windows


def breakdown(windows, category, loops, containers):
    """Mean traced ms a step by category, over every decode layer loop seen in the windows,
    and {extent: (steps, traced ms a step)}."""
    total, steps = collections.Counter(), 0
    by_extent = collections.defaultdict(lambda: [0, 0.0])
    kind = lambda name: category.get(name, BOOK)
    for events in windows:
        events = [e for e in events if e.get("name") not in containers or e["name"] in loops]
        seen = collections.Counter(e["name"] for e in events if e.get("ph") == "X")
        for loop in (name for name in loops if seen[name] > 2):
            got = optimeline.step_breakdown(events, loop, kind, PRIORITY)
            k = got["steps"]
            total.update({c: v * k for c, v in got["step"].items()})
            steps += k
            by_extent[loops[loop]][0] += k
            by_extent[loops[loop]][1] += k * sum(got["step"][c] for c in CATEGORIES)
    per = {c: total[c] / max(steps, 1) / 1e3 for c in (*CATEGORIES, optimeline.HIDDEN)}
    ext = {e: (k, us / max(k, 1) / 1e3) for e, (k, us) in sorted(by_extent.items())}
    return steps, per, ext


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, nargs="+", default=[8, 16, 32, 128])
    parser.add_argument("--t", type=int, default=1024, help="T: completion budget, cache width")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--arch", choices=("tiny", "30m"), default="30m")
    parser.add_argument("--windows", type=int, default=3)
    parser.add_argument("--window-steps", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="T 96, 4 x 4 rows, slots 8 16")
    args = parser.parse_args()
    if args.quick:
        args.t, args.prompts, args.group, args.slots = 96, 4, 4, [8, 16]
        args.windows, args.window_steps = 1, 10

    import jax
    import numpy as np
    from flax import nnx

    from grpojax.models import Decoder
    from grpojax.sampling import SamplingConfig, continuous, generate

    precision = exact_float32_matmuls()
    config = model_config(args.arch)
    model = Decoder(config, rngs=nnx.Rngs(0))
    b, g, t_new = args.prompts, args.group, args.t
    n = b * g
    prompts, plens = sampler_prompts(b, P, config.vocab_size)
    budget = longtail_lengths(n, t_new).astype(np.int32)
    tokens = int(budget.sum())
    width = P - 1 + t_new
    L, K, H = config.num_layers, config.num_kv_heads, config.head_dim
    kv_pos_bytes = 2 * L * K * H * 4  # K and V of one position, all layers, float32
    weight_bytes = (config.num_params() - config.vocab_size * config.hidden_size) * 4
    matmul_params = weight_bytes // 4  # multiply-adds a token in the layers and the head

    bw = read_bandwidth(64 if args.quick else 512)
    peak = matmul_peak(512 if args.quick else None)
    print(f"machine: {machine()}; caches {cpu_caches()}")
    print(
        f"jax {jax.__version__} ({jax.default_backend()}); model {args.arch}: "
        f"D={config.hidden_size} L={L} heads {config.num_heads}/{K} of {H} "
        f"V={config.vocab_size}, {config.num_params() / 1e6:.1f}M params, {config.dtype}; "
        f"{precision}; read bandwidth {bw / 1e9:.1f} GB/s, matmul peak {peak / 1e9:.0f} GFLOP/s"
    )
    print(
        f"workload: N={n} rows (B {b} x G {g}), P {P}, T {t_new} (cache width {width}), "
        f"temperature 1, long-tail budgets (mean {budget.mean():.0f}, max {budget.max()}), "
        f"{tokens} tokens; engine continuous; weights read a step {weight_bytes / 1e6:.0f} MB"
    )

    def run_for(slots):
        real, calls = continuous.continuous_jit, []

        class Spy:
            def lower(self, *a):
                calls.append(a)
                return real.lower(*a)

        continuous.continuous_jit = Spy()
        try:
            lowered = generate(
                model, prompts, plens, key=jax.random.key(1), max_new_tokens=t_new,
                group_size=g, sampling=SamplingConfig(temperature=1.0),
                token_budget_n=budget, engine="continuous", slots=slots, lower=True,
            )  # fmt: skip
        finally:
            continuous.continuous_jit = real
        t0 = time.perf_counter()
        compiled = lowered.compile()
        compile_s = time.perf_counter() - t0
        a = calls[0]
        return compile_s, compiled, (lambda: compiled(*a[1:6])), a[6]

    rows = []
    for slots in args.slots:
        compile_s, compiled, run, spec = run_for(slots)
        s = spec.slots
        extents = continuous.cache_extents(P, t_new, spec.decode_plan)
        sched = simulate(budget, s, extents, width)
        (wall,) = wall_times(run, 1)
        steps = len(sched)
        hlo = compiled.as_text()
        cache_shape = (L, s, K, H, width)
        category, loops, containers = hlo_map(hlo, cache_shape, s, H, extents)
        window_s = max(0.3, args.window_steps * wall / steps)
        fracs = [(i + 1) / (args.windows + 1) for i in range(args.windows)]
        holder = {}

        def traced_run(holder=holder, run=run):
            out = run()
            holder["out"] = out
            return out

        traced_wall, windows = traced_windows(traced_run, fracs, window_s, wall)
        engine_steps = int(holder["out"].decode_steps)
        traced_steps, per, by_extent = breakdown(windows, category, loops, containers)
        ext_read = np.array([e for e, _, _ in sched], float)
        live_pos = np.array([p for _, _, p in sched], float)
        cache_read = s * ext_read.mean() * kv_pos_bytes
        live_read = live_pos.mean() * kv_pos_bytes
        flops = 2 * matmul_params * s
        attn_flops = 2 * 2 * config.num_heads * H * L * s * ext_read.mean()
        model_s = weight_bytes / bw + (flops + attn_flops) / peak + cache_read / bw
        rows.append(
            dict(
                slots=s, steps=engine_steps, sim_steps=steps, compile_s=compile_s, wall=wall,
                step_ms=wall / engine_steps * 1e3, tok_ms=wall / tokens * 1e3,
                live=tokens / engine_steps, extent=ext_read.mean(), cache_mb=cache_read / 1e6,
                live_mb=live_read / 1e6, model_ms=model_s * 1e3, traced_wall=traced_wall,
                traced_steps=traced_steps, per=per, by_extent=by_extent,
                state_mb=(L * s * K * H * width * 2 * 4) / 1e6,
            )
        )  # fmt: skip
        del compiled
        jax.clear_caches()
        print(
            f"  slots {s}: {wall:.1f} s, {engine_steps} steps (schedule {steps}), "
            f"compile {compile_s:.1f} s, traced call {traced_wall:.1f} s, "
            f"{traced_steps} steps traced",
            flush=True,
        )

    base = rows[0]
    print(
        f"\n{'slots':>5} {'steps':>6} {'live':>6} {'extent':>6} {'step ms':>8} {'tok ms':>7} "
        f"{'tok/s':>6} {'step x':>6} {'tok x':>6} {'cache MB':>8} {'live MB':>7} "
        f"{'cache/w':>7} {'model ms':>8} {'meas/mod':>8}"
    )
    for r in rows:
        print(
            f"{r['slots']:>5} {r['steps']:>6} {r['live']:>6.1f} {r['extent']:>6.0f} "
            f"{r['step_ms']:>8.2f} {r['tok_ms']:>7.3f} {1e3 / r['tok_ms']:>6.0f} "
            f"{r['step_ms'] / base['step_ms']:>6.2f} {r['tok_ms'] / base['tok_ms']:>6.2f} "
            f"{r['cache_mb']:>8.0f} {r['live_mb']:>7.0f} "
            f"{r['cache_mb'] * 1e6 / weight_bytes:>7.2f} {r['model_ms']:>8.2f} "
            f"{r['step_ms'] / r['model_ms']:>8.2f}"
        )
    print(
        "\ntraced ms a step by category (each instant charged to the first running of: "
        + ", ".join(PRIORITY)
        + "; else idle); 'hidden': slice copies running beside other work"
    )
    head = " ".join(f"{SHORT[c]:>8}" for c in CATEGORIES)
    print(f"{'slots':>5} {head} {'hidden':>7} {'traced':>7} {'x slots0':>8}")
    for r in rows:
        per = r["per"]
        traced = sum(per[c] for c in CATEGORIES)
        base_t = sum(base["per"][c] for c in CATEGORIES)
        cells = " ".join(f"{per[c]:>8.2f}" for c in CATEGORIES)
        print(
            f"{r['slots']:>5} {cells} {per[optimeline.HIDDEN]:>7.2f} {traced:>7.2f} "
            f"{traced / max(base_t, 1e-9):>8.2f}"
        )
    print("\nfraction of the traced step")
    for r in rows:
        traced = sum(r["per"][c] for c in CATEGORIES) or 1.0
        cells = " ".join(f"{r['per'][c] / traced:>8.1%}" for c in CATEGORIES)
        print(f"{r['slots']:>5} {cells}")
    print("\ntraced ms a token by category (ms a step / live slots a step)")
    for r in rows:
        cells = " ".join(f"{r['per'][c] / r['live']:>8.3f}" for c in CATEGORIES)
        print(f"{r['slots']:>5} {cells}")
    print("\ntraced ms a step at each extent read (steps traced)")
    for r in rows:
        cells = ", ".join(f"{e}: {ms:.2f} ({k})" for e, (k, ms) in r["by_extent"].items())
        print(f"{r['slots']:>5} {cells}")
    # The consecutive pair of slot counts where a token got dearest, and the category whose
    # traced ms a token grew the most between them.
    worst, pair = "none", (rows[0]["slots"], rows[0]["slots"])
    pairs = list(itertools.pairwise(rows))
    if pairs:
        a, z = max(pairs, key=lambda az: az[1]["tok_ms"] / az[0]["tok_ms"])
        grew = {c: z["per"][c] / z["live"] - a["per"][c] / a["live"] for c in CATEGORIES}
        worst, pair = max(grew, key=grew.get), (a["slots"], z["slots"])
    fields = [f"t={t_new}", f"rows={n}", f"arch={args.arch}"]
    fields += [f"step_ms_{r['slots']}={r['step_ms']:.2f}" for r in rows]
    fields += [f"tok_ms_{r['slots']}={r['tok_ms']:.3f}" for r in rows]
    fields += [f"tok_ratio_{r['slots']}={r['tok_ms'] / base['tok_ms']:.2f}" for r in rows]
    fields += [f"fastest_slots={min(rows, key=lambda r: r['tok_ms'])['slots']}"]
    fields += [f"worst_pair={pair[0]}-{pair[1]}", f"grew_most={SHORT.get(worst, worst)}"]
    fields += [f"cores={os.cpu_count()}"]
    print("profile_decode_slots: " + " ".join(fields))


if __name__ == "__main__":
    main()
