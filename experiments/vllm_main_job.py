"""The main job (`grpojax train`, the embedded default) sampled by vLLM against the built-in
engine, same seed, one after the other.

Each run is a whole `grpojax train` (SFT warm start, held-out greedy pass@1, 120 GRPO steps,
pass@1 again) in its own run directory; the vLLM one adds `rollout.engine=vllm` (vLLM in
its own environment, `--vllm-python`, default the test suite's `grpojax vllm-env` in the
user cache). Reported: held-out pass@1 before and after, wall seconds, and from the vLLM
run's `metrics.jsonl` the weight syncs and the sampler-vs-trainer logprob difference (the
largest `logprob_diff_max` of any step, the mean of `logprob_diff_mean`). The held-out
evaluation runs on the built-in engine in both (the policy is what is compared).

Last line: `vllm_main_job: seed=.. builtin_after=.. vllm_after=.. sync_s=.. logprob_diff=..`

    python experiments/vllm_main_job.py [--seed 0] [--vllm-python PATH] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import time

from benchlib import machine

ROOT = pathlib.Path(__file__).resolve().parent.parent


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
    args = parser.parse_args()
    python = args.vllm_python
    if python is None:
        sys.path.insert(0, str(ROOT / "tests"))
        from user_cache import user_cache_dir

        from grpojax.jobs.vllm_env import create_vllm_env

        python = str(create_vllm_env(user_cache_dir("vllm-env"), print_fn=lambda s: None))
    out = pathlib.Path(args.out)
    print(f"machine: {machine()}")
    print(f"the main job (embedded default), seed {args.seed}; vLLM from {python}")
    runs = {
        "builtin": _run("builtin", out, args.seed, []),
        "vllm": _run(
            "vllm", out, args.seed, ["rollout.engine=vllm", f"rollout.vllm.python={python}"]
        ),
    }
    print(f"{'engine':>8} {'pass@1 before':>13} {'after':>6} {'wall s':>7} {'steps':>5}")
    for name, r in runs.items():
        s = r["summary"]
        print(
            f"{name:>8} {s['before']:>13.3f} {s['after']:>6.3f} {r['wall']:>7.0f} {len(r['rl']):>5}"
        )
        print(f"         {r['last']}")
    rl = runs["vllm"]["rl"]
    sync = [m["time/weight_sync"] for m in rl if "time/weight_sync" in m]
    diff_max = max(m["logprob_diff_max"] for m in rl)
    diff_mean = sum(m["logprob_diff_mean"] for m in rl) / len(rl)
    print(
        f"vLLM run: {len(sync)} weight syncs, median {sorted(sync)[len(sync) // 2]:.3f} s; "
        f"logprob difference vs the trainer: max {diff_max:.2e} (any step), mean {diff_mean:.2e}"
    )
    print(
        f"vllm_main_job: seed={args.seed} "
        f"builtin_after={runs['builtin']['summary']['after']:.3f} "
        f"vllm_after={runs['vllm']['summary']['after']:.3f} "
        f"sync_s={sorted(sync)[len(sync) // 2]:.3f} logprob_diff={diff_max:.2e}"
    )


if __name__ == "__main__":
    main()
