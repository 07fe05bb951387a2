"""Pipelined rollouts: wall time per RL step at rollout.max_staleness 0, 1 and 2.

Workload: the main job (`experiments/default.yaml`: the built-in tiny model, 32 prompts x 8
samples) without its SFT warm start, with a reward that costs real time: the main job's
`numeric_answer` reward plus a sleep per call, calibrated to a multiple (`--reward-ratio`,
default 1) of the measured generation time of a step, as a sandboxed test suite or a
remote judge would cost. A sleep holds no core, so this measures what the pipeline is for:
host work overlapping device work. (A reward that burns CPU competes with XLA for this
machine's two cores; it would measure the cores, not the schedule.)

Runs, in this order, in one process: a calibration run (k 0, no sleep: the median
`time/generate` of its steps), then k = 0, 1, 2 with the sleep (`--steps` RL steps each;
the first `--warmup` steps, which compile, are left out). Reported per k: the median step
wall time (`step_time_s`), its parts (`time/generate`, `time/reward`: the wait the loop saw,
`time/reward_busy`: the scoring's own time, `time/logprobs`, `time/update`; the rest is the
loop's own work: batch assembly, metrics, logging), and the speedup over k 0.

Placement: one device set (interleaved), the only placement built; the split placement
(rollout and training on disjoint devices) is not, so there is no 2 + 2 fake-device row.

Last line: `bench_async: speedup_1=.. speedup_2=.. reward_s=.. generate_s=..`

    python experiments/bench_async.py [--steps 10] [--reward-ratio 1.0] [--max-new-tokens 4]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import tempfile
import time

from benchlib import machine

REPO = pathlib.Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reward-ratio", type=float, default=1.0)
    parser.add_argument("--stalenesses", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--max-new-tokens", type=int, default=4, help="T (the main job's: 4; reasoning: more)"
    )
    args = parser.parse_args()

    import jax

    from grpojax.driver.config import load_config
    from grpojax.driver.loop import train
    from grpojax.rewards import RewardSpec, numeric_answer_reward

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench_async_"))

    def run(k: int, sleep_s: float) -> dict[str, float]:
        def reward(prompts, completions, *, answer):
            time.sleep(sleep_s)
            return numeric_answer_reward(prompts, completions, answer=answer)

        over = {
            "sft.steps": 0,
            "total_steps": args.steps,
            "optimizer.warmup_steps": 1,
            "rollout.max_staleness": k,
            "rollout.max_new_tokens": args.max_new_tokens,
            # unpacked: a packed layout is one compilation per new shape, and the runs'
            # lengths differ, so their compilations would land in different steps
            "packing.mode": "never",
            "eval.heldout_size": 8,
            "checkpoint.every": 1000,
            "log.tensorboard": "false",
            "log.plot": "false",
            "log.run_dir": str(tmp / f"k{k}_{sleep_s:.3f}"),
            "log.progress": "false",
        }
        cfg = load_config(REPO / "experiments/default.yaml", [f"{a}={b}" for a, b in over.items()])
        spec = RewardSpec(fn=reward, name="numeric_answer")
        train(cfg, reward_specs=[spec], show_progress=False, print_fn=lambda s: None)
        rows = [json.loads(x) for x in (pathlib.Path(cfg.log.run_dir) / "metrics.jsonl").open()]
        rows = [r for r in rows if "step_time_s" in r][args.warmup :]
        keys = (
            "step_time_s",
            "time/generate",
            "time/reward",
            "time/reward_busy",
            "time/logprobs",
            "time/update",
        )
        return {key: statistics.median(r.get(key, 0.0) for r in rows) for key in keys}

    print(f"machine: {machine()}")
    print(f"jax {jax.__version__} ({jax.default_backend()}, {jax.device_count()} devices)")
    calib = run(0, 0.0)
    sleep_s = args.reward_ratio * calib["time/generate"]
    print(
        f"workload: experiments/default.yaml without SFT, T {args.max_new_tokens}, "
        f"{args.steps} RL steps a run "
        f"(median of the last {args.steps - args.warmup}); reward = numeric_answer + "
        f"sleep {sleep_s:.3f} s a step ({args.reward_ratio:g} x the calibration run's "
        f"generation {calib['time/generate']:.3f} s); one device set (interleaved)"
    )
    print(
        f"{'k':>2} {'step s':>7} {'generate':>8} {'reward wait':>11} {'reward busy':>11} "
        f"{'logprobs':>8} {'update':>7} {'speedup':>8}"
    )
    base = None
    speedups = {}
    for k in args.stalenesses:
        m = run(k, sleep_s)
        base = m["step_time_s"] if base is None else base
        speedups[k] = base / m["step_time_s"]
        busy = m["time/reward_busy"] if k else m["time/reward"]
        print(
            f"{k:>2} {m['step_time_s']:>7.3f} {m['time/generate']:>8.3f} "
            f"{m['time/reward']:>11.3f} {busy:>11.3f} {m['time/logprobs']:>8.3f} "
            f"{m['time/update']:>7.3f} "
            f"{speedups[k]:>7.2f}x",
            flush=True,
        )
    line = " ".join(f"speedup_{k}={v:.2f}" for k, v in speedups.items() if k)
    print(
        f"bench_async: {line} reward_s={sleep_s:.3f} generate_s={calib['time/generate']:.3f} "
        f"t={args.max_new_tokens}"
    )


if __name__ == "__main__":
    main()
