"""The tool-use experiment on several seeds: held-out success before and after GRPO.

    python experiments/studies/tool_use_seeds.py [--seeds 0 1] [--out DIR]
    python experiments/studies/tool_use_seeds.py --run-dirs DIR0 DIR1     # finished runs, read only

Runs `grpojax train --config experiments/configs/tool_use.yaml seed=S log.run_dir=<out>/seed<S>` for
each seed, one after the other (or reads finished runs), and prints, per seed: greedy
pass@1 and sampled mean@1 on the held-out tasks before and after RL, the share of greedy
episodes that call the calculator (tool use) and their policy turns, the training reward
over the first and last 10 RL steps, and the wall time (the warm start's, the median RL
step's). The commit is the checkout's (`git describe --always --dirty`) when it runs the
seeds; a run read back names the commit it was given with `--commit`.

Last line: `tool_use_seeds: seeds=.. gain_min=.. gain_mean=.. mean1_gain_min=.. before_max=..
after_min=.. commit=..` (gain: greedy pass@1 after minus before; mean1_gain: the same of
sampled mean@1).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import time

import yaml

HERE = pathlib.Path(__file__).resolve().parent
CONFIG = HERE.parent / "configs" / "tool_use.yaml"


def commit() -> str:
    out = subprocess.run(
        ["git", "describe", "--always", "--dirty"], cwd=HERE, capture_output=True, text=True
    )
    return out.stdout.strip() or "unknown"


def run_seed(seed: int, run_dir: pathlib.Path) -> float:
    """One `grpojax train` run of the YAML at `seed`; its wall seconds."""
    cmd = [sys.executable, "-m", "grpojax.cli", "train", "--config", str(CONFIG)]
    cmd += ["--no-progress", f"seed={seed}", f"log.run_dir={run_dir}"]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    return time.perf_counter() - t0


def read_run(run_dir: pathlib.Path) -> dict:
    """The figures of a finished run: its summary's evaluations and its metrics' rewards,
    warm-start time and RL step times."""
    summary = json.loads((run_dir / "summary.json").read_text())
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl = sorted((r for r in recs if "reward_mean" in r), key=lambda r: r["step"])
    if not rl:
        raise SystemExit(f"{run_dir}: no RL step in metrics.jsonl")
    rewards = [r["reward_mean"] for r in rl]
    first = rl[0]
    return {
        "before": summary["eval_before"],
        "after": summary["eval_after"],
        "reward_first10": statistics.fmean(rewards[:10]),
        "reward_last10": statistics.fmean(rewards[-10:]),
        "steps": len(rl),
        # The first step's elapsed time less its own: the warm start and evaluation before.
        "warm_s": first["elapsed_s"] - first["step_time_s"],
        "step_s": statistics.median(r["step_time_s"] for r in rl),
        "wall_s": rl[-1]["elapsed_s"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/tool_use_seeds"))
    parser.add_argument("--run-dirs", type=pathlib.Path, nargs="+")
    parser.add_argument("--commit", default=None, help="the commit read-back runs came from")
    args = parser.parse_args()

    if args.run_dirs:
        dirs = list(args.run_dirs)
        seeds = [int(yaml.safe_load((d / "config.yaml").read_text())["seed"]) for d in dirs]
        made = args.commit or "unknown"
    else:
        made = commit()
        dirs, seeds = [], list(args.seeds)
        for seed in seeds:
            run_dir = args.out / f"seed{seed}"
            run_seed(seed, run_dir)
            dirs.append(run_dir)
    runs = [read_run(d) for d in dirs]
    config = CONFIG.relative_to(HERE.parents[1])
    print(f"{config} at commit {made}; held-out greedy pass@1, sampled mean@1")
    print(
        f"{'seed':>4} {'pass@1 before':>13} {'after':>6} {'gain':>6} {'mean@1':>7} {'after':>6} "
        f"{'tool use':>8} {'after':>6} {'turns':>6} {'reward 1-10':>11} {'last 10':>7} "
        f"{'warm s':>7} {'step s':>6} {'wall s':>7}"
    )
    gains, mean1_gains = [], []
    for seed, r in zip(seeds, runs):
        b, a = r["before"], r["after"]
        gain = a["pass@1"] - b["pass@1"]
        gains.append(gain)
        mean1_gains.append(a["mean@1"] - b["mean@1"])
        print(
            f"{seed:>4} {b['pass@1']:>13.3f} {a['pass@1']:>6.3f} {gain:>+6.3f} "
            f"{b['mean@1']:>7.3f} {a['mean@1']:>6.3f} {b.get('tool_use', 0):>8.3f} "
            f"{a.get('tool_use', 0):>6.3f} {a.get('turns', 0):>6.2f} "
            f"{r['reward_first10']:>11.3f} {r['reward_last10']:>7.3f} {r['warm_s']:>7.0f} "
            f"{r['step_s']:>6.1f} {r['wall_s']:>7.0f}"
        )
    print(
        f"tool_use_seeds: seeds={','.join(map(str, seeds))} gain_min={min(gains):.3f} "
        f"gain_mean={statistics.fmean(gains):.3f} mean1_gain_min={min(mean1_gains):.3f} "
        f"before_max={max(r['before']['pass@1'] for r in runs):.3f} "
        f"after_min={min(r['after']['pass@1'] for r in runs):.3f} commit={made}"
    )


if __name__ == "__main__":
    main()
