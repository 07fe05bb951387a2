"""The main job (`grpojax train`, the embedded default) sampled by vLLM against the built-in
engine, same seed, one after the other.

Each run is a whole `grpojax train` (SFT warm start, held-out greedy pass@1, 120 GRPO steps,
pass@1 again) in its own run directory; the vLLM one adds `rollout.engine=vllm` (vLLM in
its own environment, `--vllm-python`, default the test suite's `grpojax vllm-env` in the
user cache). Reported: held-out pass@1 before and after, wall seconds, and from the vLLM
run's `metrics.jsonl` the weight syncs and the sampler-vs-trainer logprob difference (the
largest `logprob_diff_max` of any step, the mean of `logprob_diff_mean`; with them, when
logged, the largest `logprob_excess_max` and the means of the rollout correction's
`rollout_weight_mean` and `rollout_truncated_frac`). Each run's held-out evaluations sample
with its own engine (greedy: vLLM's greedy tokens are the built-in engine's).

`--top-p P` samples both runs with `sampling.top_p=P`: the built-in run with
`grpo.use_keep_mask=true` (its exact path), the vLLM run through its rollout correction
(docs/how-to/vllm.md). `--set KEY=VALUE` (repeatable) adds any override to both runs, and
`--engines vllm` (or `builtin`) runs one of them.

Last line: `vllm_main_job: seed=.. builtin_after=.. vllm_after=.. sync_s=.. logprob_diff=..`
(a run not made reads `-`)

    python experiments/studies/vllm_main_job.py [--seed 0] [--vllm-python PATH] [--out DIR]
        [--top-p P] [--set KEY=VALUE ...] [--engines both|builtin|vllm]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))  # benchlib

from benchlib import machine

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run(name: str, out: pathlib.Path, seed: int, extra: list[str]) -> dict:
    run_dir = out / name
    cmd = [
        sys.executable,
        "-m",
        "grpojax.cli",
        "train",
        "--no-progress",
        f"seed={seed}",
        f"log.run_dir={run_dir}",
        *extra,
    ]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"{name}: grpojax train failed:\n{done.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    summary = {k: summary[f"eval_{k}"]["pass@1"] for k in ("before", "after")}
    rl = [
        json.loads(line)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if "reward_mean" in line
    ]
    return {
        "summary": summary,
        "wall": wall,
        "rl": rl,
        "last": done.stdout.strip().splitlines()[-1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vllm-python", default=None)
    parser.add_argument("--out", default="/tmp/vllm_main_job")
    parser.add_argument("--top-p", type=float, default=None, help="sampling.top_p of both runs")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--engines", choices=("both", "builtin", "vllm"), default="both")
    args = parser.parse_args()
    extra = list(args.set)
    keep_mask = []
    if args.top_p is not None:
        extra.append(f"sampling.top_p={args.top_p}")
        if args.top_p < 1.0:  # the built-in engines' exact path for truncated sampling
            keep_mask = ["grpo.use_keep_mask=true"]
    python = args.vllm_python
    if python is None and args.engines != "builtin":
        sys.path.insert(0, str(ROOT / "tests"))
        from user_cache import user_cache_dir

        from grpojax.jobs.vllm_env import create_vllm_env

        python = str(create_vllm_env(user_cache_dir("vllm-env"), print_fn=lambda s: None))
    out = pathlib.Path(args.out)
    print(f"machine: {machine()}")
    print(f"the main job (embedded default), seed {args.seed}; vLLM from {python}")
    print(f"overrides of both runs: {extra}")
    runs = {}
    if args.engines in ("both", "builtin"):
        runs["builtin"] = _run("builtin", out, args.seed, [*extra, *keep_mask])
    if args.engines in ("both", "vllm"):
        vllm = ["rollout.engine=vllm", f"rollout.vllm.python={python}"]
        runs["vllm"] = _run("vllm", out, args.seed, [*extra, *vllm])
    print(f"{'engine':>8} {'pass@1 before':>13} {'after':>6} {'wall s':>7} {'steps':>5}")
    for name, r in runs.items():
        s = r["summary"]
        print(
            f"{name:>8} {s['before']:>13.3f} {s['after']:>6.3f} {r['wall']:>7.0f} {len(r['rl']):>5}"
        )
        print(f"         {r['last']}")
    for name, r in runs.items():
        rl = r["rl"]
        logged = [m for m in rl if "logprob_diff_max" in m]
        print(
            f"{name} run: logprob difference vs the trainer logged on {len(logged)} of "
            f"{len(rl)} steps: max {max(m['logprob_diff_max'] for m in logged):.2e} (any step), "
            f"mean {sum(m['logprob_diff_mean'] for m in logged) / len(logged):.2e}"
        )
        if all("logprob_excess_max" in m for m in logged):
            excess = max(m["logprob_excess_max"] for m in logged)
            print(f"  largest trainer logprob above the sampler's (any step): {excess:.2e}")
        for key in ("rollout_weight_mean", "rollout_truncated_frac", "rollout_kl_k1"):
            if all(key in m for m in rl):
                print(f"  {key}: mean over steps {sum(m[key] for m in rl) / len(rl):.4f}")
    sync_s, diff = "-", "-"
    if "vllm" in runs:
        rl = runs["vllm"]["rl"]
        sync = sorted(m["time/weight_sync"] for m in rl if "time/weight_sync" in m)
        sync_s = f"{sync[len(sync) // 2]:.3f}"
        diff = f"{max(m['logprob_diff_max'] for m in rl):.2e}"
        print(f"vLLM run: {len(sync)} weight syncs, median {sync_s} s")

    def after(name):
        return f"{runs[name]['summary']['after']:.3f}" if name in runs else "-"

    print(
        f"vllm_main_job: seed={args.seed} builtin_after={after('builtin')} "
        f"vllm_after={after('vllm')} sync_s={sync_s} logprob_diff={diff}"
    )


if __name__ == "__main__":
    main()
