"""Roofline of a GRPO step on this machine: each phase's matmul FLOPs, its time, and the
fraction of the measured float32 matmul peak it reaches; then the cost curves.

Model (`--arch`): `tiny`, the TRL workload's Qwen2 (vocab 512, D 256, intermediate 688,
4 layers, 4 heads, 2 kv heads, tied embeddings, float32), or `0.5b`, the Qwen2.5-0.5B shape
(`plan_memory.ARCHS`: vocab 151,936, D 896, 24 layers, bfloat16 compute, float32 masters),
or `30m`, issue 60's Qwen3-style decoder (`qwen3_30m_config`: D 512, 8 layers, float32);
random weights built in memory. Float32 matmuls run at 'highest' precision (no TF32 on a
GPU), and the peak is measured in the model's compute dtype. Workload: B = 4 prompts x G = 8
samples, prompts padded to P = 32, T = 32 new tokens at temperature 1 with no EOS (every row
decodes all T tokens), GRPO with share_prompt, beta 0.04, token-mean, AdamW, and the
driver's default rematerialisation policy.

Phases (each one compiled program, timed after its compile, median of `--repeats`):

- prefill: `generate` with one new token (each prompt's forward into the KV cache, the first
  logits and draw);
- decode: one step of the sampler's loop, (time(T tokens) - time(1 token)) / (T - 1);
- ref logprobs: the no-gradient logprob pass of the B*G rows (each prompt run once);
- update: the jitted GRPO step (forward, backward, AdamW).

FLOPs are counted from each program's jaxpr (`benchlib.dot_flops`: 2*M*N*K per matmul, scans
times their length, the decode loop times its steps), not from XLA's `cost_analysis()`,
which on XLA:CPU counts a loop body once whatever its trip count (a 4-layer model reports the
FLOPs of one layer). Only matmul FLOPs count: they are what the peak is measured on. The peak
is the median rate of a square `jnp.dot` (2048^2 on the CPU, 8192^2 on an accelerator) in the
model's compute dtype, measured in the same run.

Beside each phase, its matmuls alone (`benchlib.matmul_floor`): every distinct matmul of the
program (shapes, dtypes, dimension numbers) run as often as the phase runs it, in a compiled
loop of its own, median of `--repeats`; the fraction of the peak the phase would reach if
nothing but its matmuls took time, and the rest of its time (attention's softmax, norms,
RoPE, sampling, the loss, AdamW, copies, loop overhead). The operands stay in cache in those
loops, so this estimates the phase's floor with this backend's matmul kernels; it is not a
strict bound (the real program may run small matmuls beside other work on another thread).
The slowest matmuls are listed with their rates.

Cost curves: generation and update tokens/s (completion tokens) as the number of sequences
N = B*G grows (32 .. 512 at T = 32) and as the completion length grows (32, 128, 512 at
N = 32; `--ns`, `--ts` choose other points), with the fraction of the peak; a row is marked
where the step from the previous point gains less than 10%.

`--profile decode|update` instead prints the XLA ops taking the most time in that program
(from a `jax.profiler` trace; ops on the two threads overlap, so the column sums to more
than the wall time). For decode it then charges each instant of a decode step to one kind
of op (`optimeline`: matmuls, else other ops, else slice copies, else no op) and lists the
heaviest ops inside the layer loop and outside it. The last line is

    bench_roofline: step_frac=<f> decode_frac=<d> update_frac=<u> step_matmuls_frac=<m> arch=<a>

(`step_matmuls_frac`: the step's fraction of the peak were its matmuls all it did.)

Usage: `python experiments/bench/bench_roofline.py [--arch tiny|0.5b] [--quick] [--repeats 3]
[--profile decode]`.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
import statistics
import tempfile

import optimeline
from benchlib import (
    decode_trips,
    describe,
    exact_float32_matmuls,
    generate_hlo,
    generate_jaxpr,
    grpo_batch,
    machine,
    matmul_floor,
    matmul_peak,
    matmuls,
    minus,
    tiny_qwen2_config,
    total_flops,
    wall_times,
)

B, G, P, T = 4, 8, 32, 32


def median_s(fn, repeats: int) -> float:
    """Median wall seconds of `fn()` (blocked on) over `repeats` calls after a first one."""
    import jax

    jax.block_until_ready(fn())
    return statistics.median(wall_times(fn, repeats))


def model_config(arch: str):
    """The `ModelConfig` of `--arch`, with the rematerialisation policy the driver's default
    (`model.remat=auto`) takes for this workload: "dots_no_batch" (B x G rows of P + T
    tokens keep their projections within half of any device here)."""
    remat = "dots_no_batch"
    if arch == "tiny":
        return tiny_qwen2_config(remat=remat)
    if arch == "30m":
        return qwen3_30m_config(remat=remat)
    from plan_memory import ARCHS
    from plan_memory import model_config as arch_config

    return arch_config(ARCHS[arch], remat=remat)


def qwen3_30m_config(**overrides):
    """`30m`: the vLLM comparison's Qwen3-style decoder (issue 60): vocab 8,192, D 512,
    intermediate 1,536, 8 layers, 8 heads and 4 kv heads of 64, q/k norm, untied head,
    float32; 33.6M parameters."""
    from grpojax.models import ModelConfig

    fields = dict(
        model_type="qwen3", vocab_size=8192, hidden_size=512, intermediate_size=1536,
        num_layers=8, num_heads=8, num_kv_heads=4, head_dim=64, qk_norm=True,
        tie_word_embeddings=False, rope_theta=1_000_000.0, max_position_embeddings=4096,
    )  # fmt: skip
    return ModelConfig(**{**fields, **overrides})


class Workload:
    """The model, its optimizer state and the compiled phase programs at one (N, T)."""

    def __init__(self, config):
        import jax
        from flax import nnx

        from grpojax.models import Decoder, make_mesh
        from grpojax.train import OptimizerConfig, create_train_state, make_optimizer
        from grpojax.train.state import shard_train_state

        self.mesh = make_mesh()
        self.model = Decoder(config, rngs=nnx.Rngs(0))
        self.tx = make_optimizer(OptimizerConfig(learning_rate=1e-6, max_grad_norm=1.0))
        self.graphdef, state = create_train_state(self.model, self.tx, rng=jax.random.key(0))
        self.state, self.shardings = shard_train_state(state, self.tx, self.mesh)

    def prompts(self, b: int):
        import numpy as np

        rng = np.random.default_rng(b)
        lengths = rng.integers(P // 2, P + 1, b).astype(np.int32)
        prompts = np.zeros((b, P), np.int32)
        for i, n in enumerate(lengths):
            prompts[i, P - n :] = rng.integers(3, 500, n)
        return prompts, lengths

    def generate(self, b: int, t: int, **kw):
        """`fn()` running the sampler for B prompts x G samples x t tokens (`kw`: more of
        `generate`'s arguments, e.g. `decode_loops`)."""
        import jax

        from grpojax.sampling import SamplingConfig, generate

        prompts, lengths = self.prompts(b)
        key = jax.random.key(0)
        return lambda: generate(
            self.model,
            prompts,
            lengths,
            key=key,
            max_new_tokens=t,
            group_size=G,
            sampling=SamplingConfig(temperature=1.0),
            **kw,
        )

    def ref_logprobs(self, batch):
        import jax
        from flax import nnx

        from grpojax.train import policy_logprobs

        graphdef = self.graphdef

        @jax.jit
        def logp(params, batch):
            model = nnx.merge(graphdef, params)
            return policy_logprobs(
                model, batch.tokens_ns, batch.mask_ns, batch.completion_mask_nt, group_size=G
            )[0]

        return logp, (self.state.params, batch)

    def update(self, batch):
        from grpojax.train import GRPOConfig
        from grpojax.train.grpo import make_grpo_step

        cfg = GRPOConfig(group_size=G, beta=0.04, aggregation="token-mean", share_prompt=True)
        step = make_grpo_step(
            self.graphdef,
            self.tx,
            cfg,
            mesh=self.mesh,
            state_shardings=self.shardings,
            batch=batch,
            donate=False,
        )
        return step, (self.state, batch)


def program_matmuls(jitted, *args) -> dict:
    """`benchlib.matmuls` of a `jax.jit` object's program for `args` (traced, not run)."""
    return matmuls(jitted.trace(*args).jaxpr)


def generation_point(w: Workload, n: int, t: int, repeats: int) -> dict:
    """Prefill (1 token) and full generation (t tokens) at N = n rows: time, FLOPs and the
    matmuls of each (the decode loop's are the full program's minus the prefill's)."""
    b = n // G
    one, full = w.generate(b, 1), w.generate(b, t)
    pre_m = matmuls(generate_jaxpr(one), while_trips=0)
    full_m = matmuls(generate_jaxpr(full), while_trips=decode_trips(t))
    pre_f, full_f = total_flops(pre_m), total_flops(full_m)
    pre_s, full_s = median_s(one, repeats), median_s(full, repeats)
    return dict(
        prefill_s=pre_s,
        prefill_flops=pre_f,
        prefill_matmuls=pre_m,
        gen_s=full_s,
        gen_flops=full_f,
        decode_matmuls=minus(full_m, pre_m),
        decode_step_s=(full_s - pre_s) / (t - 1),
        decode_step_flops=(full_f - pre_f) / (t - 1),
        tokens=n * t,
    )


def update_point(w: Workload, n: int, t: int, repeats: int, with_ref: bool = False) -> dict:
    import jax

    batch = grpo_batch(n // G, G, P, t)
    step, args = w.update(batch)
    update_m = program_matmuls(step.jitted, *args)
    out = dict(
        update_s=median_s(lambda: step(*args)[1], repeats),
        update_flops=total_flops(update_m),
        update_matmuls=update_m,
        tokens=n * t,
    )
    if with_ref:
        logp, largs = w.ref_logprobs(batch)
        out["ref_s"] = median_s(lambda: logp(*largs), repeats)
        out["ref_matmuls"] = program_matmuls(logp, *largs)
        out["ref_flops"] = total_flops(out["ref_matmuls"])
    jax.clear_caches()  # one program per shape: free the compiled ones as the curve grows
    return out


def profile(w: Workload, which: str, repeats: int) -> None:
    """Print the XLA ops with the most traced time in one program (decode or update)."""
    import jax

    if which == "decode":
        fn = w.generate(B, T)
    else:
        step, args = w.update(grpo_batch(B, G, P, T))
        fn = lambda: step(*args)[1]
    jax.block_until_ready(fn())
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            for _ in range(repeats):
                jax.block_until_ready(fn())
        (path,) = glob.glob(f"{tmp}/**/*.trace.json.gz", recursive=True)
        events = json.load(gzip.open(path))["traceEvents"]
    total, count = collections.Counter(), collections.Counter()
    for e in events:
        name = e.get("name", "")
        if e.get("ph") != "X" or name.startswith("$") or "Thunk" in name or "Slinky" in name:
            continue
        total[name] += e["dur"]
        count[name] += 1
    print(f"{which}: XLA ops by traced time per call (mean of {repeats} calls)")
    print(f"{'op':<44} {'ms/call':>8} {'runs/call':>9}")
    for name, us in total.most_common(25):
        print(f"{name[:44]:<44} {us / repeats / 1e3:>8.2f} {count[name] / repeats:>9.0f}")
    kinds = collections.Counter()
    for name, us in total.items():
        if optimeline.is_op(name):  # not containers (their ops are listed) nor bookkeeping
            kinds[re.sub(r"\.\d+$", "", name)] += us
    print(f"by kind (containers excluded): total {sum(kinds.values()) / repeats / 1e3:.2f} ms")
    for name, us in kinds.most_common(8):
        print(f"  {name[:42]:<42} {us / repeats / 1e3:>8.2f}")
    if which == "decode":
        decode_breakdown(events, generate_hlo(fn), repeats)


def decode_breakdown(events, hlo: str, calls: int) -> None:
    """Print one decode step with each instant charged to one kind of op (`optimeline`):
    what the ops overlapping on two threads leave on the critical path."""
    runs = collections.Counter(e["name"] for e in events if e.get("ph") == "X")
    busy = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e["name"].startswith("while") and runs[e["name"]] > calls:
            busy[e["name"]] += e["dur"]
    loop = busy.most_common(1)[0][0]  # the layer loop: many runs a call, the most time
    categories = optimeline.op_categories(hlo)
    kind = lambda name: categories.get(name, optimeline.OTHER)
    got = optimeline.step_breakdown(events, loop, kind)
    kinds = (*optimeline.PRIORITY, optimeline.IDLE)
    wall = sum(got["step"][k] for k in kinds)
    print(
        f"\ndecode: one step (from one start of the layer loop {loop} to the next, mean of "
        f"{got['steps']}), each instant charged to one kind of op: matmuls first, then other"
        " ops, then slice copies (a copy beside other work is hidden)"
    )
    for k in kinds:
        label = "slice copies alone" if k == optimeline.SLICE else k
        print(f"  {label:<28} {got['step'][k] / 1e3:>7.3f} ms {got['step'][k] / wall:>6.1%}")
    print(f"  {'step':<28} {wall / 1e3:>7.3f} ms")
    print(f"  {'slice copies hidden':<28} {got['step'][optimeline.HIDDEN] / 1e3:>7.3f} ms")
    body = optimeline.loop_body(hlo, loop)
    for where, inside in (("in the layer loop", True), ("outside it", False)):
        top = [(n, us) for n, us in got["ops"].most_common() if (n in body) == inside][:6]
        print(f"  heaviest ops {where} (traced ms a step):")
        for name, us in top:
            print(f"    {name[:40]:<40} {kind(name):<14} {us / 1e3:>7.3f}")


def curve_rows(points: list[tuple[int, dict]], key_s: str, key_f: str, peak: float, label: str):
    print(f"{label:>6} {'tokens/s':>10} {'gain':>6} {'GFLOP/s':>8} {'of peak':>7}")
    prev = None
    for x, pt in points:
        tps = pt["tokens"] / pt[key_s]
        rate = pt[key_f] / pt[key_s]
        gain = "" if prev is None else f"{tps / prev:.2f}x"
        mark = " saturated" if prev is not None and tps / prev < 1.10 else ""
        print(f"{x:>6} {tps:>10.0f} {gain:>6} {rate / 1e9:>8.1f} {rate / peak:>7.1%}{mark}")
        prev = tps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--arch", choices=("tiny", "0.5b", "30m"), default="tiny")
    parser.add_argument("--quick", action="store_true", help="small curves (N 32, 64; T 32, 64)")
    parser.add_argument("--ns", type=int, nargs="+", help="sequence counts of the N curves")
    parser.add_argument("--ts", type=int, nargs="+", help="completion lengths of the T curves")
    parser.add_argument("--profile", choices=("decode", "update"))
    parser.add_argument(
        "--upcast-logits",
        action="store_true",
        help="the LM-head logits tiles in float32 on every backend (the pre-change baseline)",
    )
    args = parser.parse_args()

    import jax

    if args.upcast_logits:
        import grpojax.ops.logprobs

        grpojax.ops.logprobs._narrow_logit_operands = lambda: False

    precision = exact_float32_matmuls()
    config = model_config(args.arch)
    w = Workload(config)
    if args.profile:
        profile(w, args.profile, args.repeats)
        return
    peak = matmul_peak(dtype=config.dtype)
    print(f"machine: {machine()}")
    print(f"{config.dtype} matmul peak (square jnp.dot, median): {peak / 1e9:.1f} GFLOP/s")
    print(
        f"workload: B={B} prompts x G={G}, P={P}, T={T} new tokens; model {args.arch}: "
        f"D={config.hidden_size} L={config.num_layers} V={config.vocab_size}, "
        f"{config.dtype} compute, remat {config.remat}; {precision}"
        + ("; logits tiles upcast to float32" if args.upcast_logits else "")
    )

    gen = generation_point(w, B * G, T, args.repeats)
    upd = update_point(w, B * G, T, args.repeats, with_ref=True)
    phases = [
        ("prefill", gen["prefill_s"], gen["prefill_matmuls"]),
        (f"decode (x{T - 1} steps)", gen["gen_s"] - gen["prefill_s"], gen["decode_matmuls"]),
        ("ref logprobs", upd["ref_s"], upd["ref_matmuls"]),
        ("update", upd["update_s"], upd["update_matmuls"]),
    ]
    floors = [matmul_floor(found, args.repeats) for _, _, found in phases]
    print(
        f"\n{'phase':<22} {'GFLOP':>7} {'s':>8} {'GFLOP/s':>8} {'of peak':>7} "
        f"{'matmuls s':>9} {'of peak':>7} {'rest s':>8}"
    )
    for (name, s, found), (floor_s, _) in zip(phases, floors):
        f = total_flops(found)
        print(
            f"{name:<22} {f / 1e9:>7.2f} {s:>8.4f} {f / s / 1e9:>8.1f} {f / s / peak:>7.1%} "
            f"{floor_s:>9.4f} {f / floor_s / peak:>7.1%} {s - floor_s:>8.4f}"
        )
    step_s = sum(s for _, s, _ in phases)
    step_f = sum(total_flops(found) for _, _, found in phases)
    floor_s = sum(s for s, _ in floors)
    print(
        f"{'step (sum)':<22} {step_f / 1e9:>7.2f} {step_s:>8.4f} {step_f / step_s / 1e9:>8.1f} "
        f"{step_f / step_s / peak:>7.1%} {floor_s:>9.4f} {step_f / floor_s / peak:>7.1%} "
        f"{step_s - floor_s:>8.4f}"
    )
    print(
        "matmuls s: the phase's matmuls alone, each distinct one run as often as the phase runs "
        "it\nin a loop of its own (operands in cache; benchlib.time_matmul); 'of peak' beside it "
        "is\nabout the most the phase could reach if nothing but its matmuls took time. Slowest:"
    )
    slowest = sorted(
        ((name, m, ms) for (name, _, _), (_, rows) in zip(phases, floors) for m, ms in rows),
        key=lambda r: -r[2],
    )
    print(f"  {'phase':<22} {'matmul':<44} {'runs':>5} {'s':>8} {'GFLOP/s':>8}")
    for name, m, ms in slowest[:10]:
        print(f"  {name:<22} {describe(m):<44} {m.runs:>5} {ms:>8.4f} {m.flops / ms / 1e9:>8.1f}")
    d_s, d_f = gen["decode_step_s"], gen["decode_step_flops"]
    print(f"one decode step: {d_s * 1e3:.2f} ms for {d_f / 1e6:.0f} MFLOP "
          f"({d_f / peak * 1e3:.2f} ms at the peak)")  # fmt: skip
    print(f"update / ref logprobs time: {upd['update_s'] / upd['ref_s']:.2f} "
          f"(FLOPs: {upd['update_flops'] / upd['ref_flops']:.2f})")  # fmt: skip

    ns = args.ns or ((32, 64) if args.quick else (32, 64, 128, 256, 512))
    ts = args.ts or ((32, 64) if args.quick else (32, 128, 512))
    gen_n = [(n, generation_point(w, n, T, args.repeats)) for n in ns]
    jax.clear_caches()
    upd_n = [(n, update_point(w, n, T, args.repeats)) for n in ns]
    gen_t = [(t, generation_point(w, B * G, t, args.repeats)) for t in ts]
    jax.clear_caches()
    upd_t = [(t, update_point(w, B * G, t, args.repeats)) for t in ts]
    print(f"\ngeneration as N grows (T={T}, tokens = N*T completion tokens, prefill included)")
    curve_rows(gen_n, "gen_s", "gen_flops", peak, "N")
    print(f"\nupdate as N grows (P={P}, T={T}, tokens = N*T completion tokens)")
    curve_rows(upd_n, "update_s", "update_flops", peak, "N")
    print(f"\ngeneration as T grows (N={B * G})")
    curve_rows(gen_t, "gen_s", "gen_flops", peak, "T")
    print(f"\nupdate as T grows (N={B * G}, P={P})")
    curve_rows(upd_t, "update_s", "update_flops", peak, "T")
    print(
        f"bench_roofline: step_frac={step_f / step_s / peak:.3f} "
        f"decode_frac={d_f / d_s / peak:.3f} "
        f"update_frac={upd['update_flops'] / upd['update_s'] / peak:.3f} "
        f"step_matmuls_frac={step_f / floor_s / peak:.3f} arch={args.arch}"
    )


if __name__ == "__main__":
    main()
