"""SmolLM2-135M-Instruct trained with GRPO (`experiments/configs/smollm2_135m_grpo.yaml`) on several
seeds: held-out accuracy before and after, learning curves, wall time and peak memory.

    python experiments/studies/smollm2_seeds.py [--seeds 0 1 2]
        [--variant full|lora|vllm|agent|tool|verifiers] [--out DIR] [key=value ...]
    python experiments/studies/smollm2_seeds.py --run-dirs DIR0 DIR1 DIR2 [--plot curves.png]

Runs `grpojax train --config experiments/configs/smollm2_135m_grpo.yaml seed=S
log.run_dir=...` for each seed, one after the other, with the variant's overrides
(`VARIANTS`: "full" the recipe as it is; "lora" LoRA adapters on the seven projections
instead of every weight (rank 16, alpha 32, learning rate 5e-5: ten times full
fine-tuning's); "vllm" vLLM's CPU build as the rollout engine, in the test suite's `grpojax
vllm-env` environment unless `--vllm-python` names another; "agent" the same questions
asked by `calc_agent.py`, an agent of the OpenAI client alone offering an `add` tool,
through grpojax's endpoint; "tool" 3-digit by 2-digit products asked by
`calc_agent.solve_product`, which offers a `multiply` tool, after an SFT warm start on a
hurried expert's demonstrations (`calc_agent.expert`: the tool on 15% of the questions);
"verifiers" the same task as a verifiers taskset, `vf_addition.py`, each episode verifiers'
own rollout through the endpoint), or reads finished runs. Prints per seed: greedy pass@1
and sampled mean@k on the held-out prompts before and after RL, the training reward over
the first and last 10 steps, the median step time, the run's wall time (the whole `grpojax
train` process where this script ran it; to the final evaluation for a run read back) and
its peak resident memory (the `grpojax` process's, from `wait4`; not for runs read back),
and the mean |behaviour logprob - trainer logprob| over the run (`logprob_diff_mean`:
vLLM's against the trainer's with vLLM, the built-in sampler's otherwise).
A run stopped by a signal before its final evaluation is read to its last periodic one
(`eval.every`), named as such. With `--plot` (default `<out>/curves.png`) it draws the
training reward per step and the held-out pass@1 and mean@k at each evaluation, one line
per seed.

Last line: `smollm2_seeds: variant=.. seeds=.. gain_min=.. gain_mean=.. before_mean=..
after_mean=.. wall_max_s=.. peak_rss_gb=.. commit=..` (gain: greedy pass@1 after minus
before).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

import yaml

HERE = pathlib.Path(__file__).resolve().parent
CONFIG = HERE.parent / "configs" / "smollm2_135m_grpo.yaml"
VARIANTS = {
    "full": [],
    "lora": ["lora.rank=16", "lora.alpha=32", "optimizer.learning_rate=5e-5"],
    "vllm": ["rollout.engine=vllm"],
    # The same task played by an agent that knows only the OpenAI client (calc_agent.py,
    # an `add` tool offered), served by grpojax's endpoint: each request a turn.
    "agent": [
        "env.name=agent:calc_agent:solve",
        "env.max_turns=3",
        "env.max_turn_tokens=48",
        "rollout.max_new_tokens=160",
        "data.max_prompt_tokens=320",
    ],
    # An agent that needs its tool (calc_agent.solve_product: "What is 347 * 29?", a
    # `multiply` tool offered), warm-started on a hurried expert's demonstrations
    # (calc_agent.expert: the tool on 15% of the questions, a rounded estimate on the rest),
    # then GRPO through grpojax's endpoint; the rows: calc_agent.write_product_rows.
    "tool": [
        "env.name=agent:calc_agent:solve_product",
        "env.kwargs.expert=calc_agent:expert",
        "env.max_turns=3",
        "env.max_turn_tokens=48",
        "rollout.max_new_tokens=96",
        "data.kind=file",
        "data.max_prompt_tokens=256",
        "sft.steps=40",
        "sft.batch_size=16",
        "sft.learning_rate=3e-5",
        "optimizer.learning_rate=1e-5",
    ],
    # The same task as a verifiers taskset (vf_addition.py, the `verifiers` package's own
    # classes), each episode verifiers' rollout of one task through grpojax's endpoint, its
    # reward verifiers' score; rows and the held-out split are the taskset's tasks.
    "verifiers": ["env.name=verifiers:vf_addition", "data.kind=env"],
    # A TextArena game (GuessTheNumber-v0: a number in 1-20, ten guesses, "higher"/"lower"
    # hints; the game's own reward: 1 for a win, else 1 - |last guess - target| / 19, and 0
    # here for a game cut short by the token budget), each episode one game from its seed.
    "textarena": [
        "env.name=textarena:GuessTheNumber-v0",
        "data.kind=env",
        "data.max_prompt_tokens=256",
        "env.max_turn_tokens=32",
        "rollout.max_new_tokens=256",
        "optimizer.learning_rate=1e-5",
    ],
}


def commit() -> str:
    out = subprocess.run(
        ["git", "describe", "--always", "--dirty"], cwd=HERE, capture_output=True, text=True
    )
    return out.stdout.strip() or "unknown"


def run_seed(seed: int, run_dir: pathlib.Path, overrides: list[str]) -> tuple[float, float]:
    """One `grpojax train` run at `seed`: (wall seconds, peak resident memory in GB)."""
    cmd = [sys.executable, "-m", "grpojax.cli", "train", "--config", str(CONFIG)]
    cmd += ["--no-progress", f"seed={seed}", f"log.run_dir={run_dir}", *overrides]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"seed {seed}: grpojax train failed ({' '.join(cmd)})")
    return wall, usage.ru_maxrss / 2**20  # KiB -> GiB


def read_run(run_dir: pathlib.Path) -> dict:
    """A finished run's evaluations, rewards, step times and (vLLM) logprob differences."""
    summary = json.loads((run_dir / "summary.json").read_text())
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl = sorted((r for r in recs if "reward_mean" in r), key=lambda r: r["step"])
    if not rl:
        raise SystemExit(f"{run_dir}: no RL step in metrics.jsonl")
    evals = [
        (r["step"], {k.removeprefix("eval/"): v for k, v in r.items()})
        for r in recs
        if "eval/pass@1" in r
    ]
    rewards = [r["reward_mean"] for r in rl]
    diffs = [r["logprob_diff_mean"] for r in rl if "logprob_diff_mean" in r]
    after, after_step = summary["eval_after"], rl[-1]["step"]
    if after is None:  # stopped (a signal) before its final evaluation: its last periodic one
        if not evals:
            raise SystemExit(f"{run_dir}: stopped by {summary.get('stopped_by')}, no evaluation")
        after_step, after = evals[-1]
        print(f"{run_dir}: stopped by {summary.get('stopped_by')}; 'after' is step {after_step}")
    return {
        "seed": int(yaml.safe_load((run_dir / "config.yaml").read_text())["seed"]),
        "before": summary["eval_before"],
        "after": after,
        "after_step": after_step,
        "evals": [(0, summary["eval_before"]), *evals],
        "steps": [r["step"] for r in rl],
        "rewards": rewards,
        "reward_first10": statistics.fmean(rewards[:10]),
        "reward_last10": statistics.fmean(rewards[-10:]),
        "step_s": statistics.median(r["step_time_s"] for r in rl),
        # To the last record (the final evaluation), the export after it not included.
        "wall_s": max(r["elapsed_s"] for r in recs if "elapsed_s" in r),
        "logprob_diff": statistics.fmean(diffs) if diffs else None,
    }


def plot(runs: list[dict], out: pathlib.Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for r in runs:
        steps, rewards = r["steps"], r["rewards"]
        w = 5  # a 5-step moving average
        smooth = [statistics.fmean(rewards[max(0, i - w + 1) : i + 1]) for i in range(len(rewards))]
        (line,) = left.plot(steps, smooth, label=f"seed {r['seed']}")
        left.plot(steps, rewards, color=line.get_color(), alpha=0.2)
        xs = [s for s, _ in r["evals"]]
        right.plot(xs, [e["pass@1"] for _, e in r["evals"]], "o-", color=line.get_color(),
                   label=f"seed {r['seed']} greedy pass@1")  # fmt: skip
        k = next(key for key in r["before"] if key.startswith("mean@"))
        right.plot(xs, [e[k] for _, e in r["evals"]], "s--", color=line.get_color(), alpha=0.6,
                   label=f"seed {r['seed']} sampled {k}")  # fmt: skip
    left.set(xlabel="RL step", ylabel="training reward (mean of the step's samples)",
             title="training reward (5-step average; raw faint)")  # fmt: skip
    right.set(xlabel="RL step", ylabel="held-out accuracy", title="held-out evaluation",
              ylim=(0, 1))  # fmt: skip
    left.legend()
    right.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="full")
    parser.add_argument("--out", type=pathlib.Path, default=None)
    parser.add_argument("--run-dirs", type=pathlib.Path, nargs="+")
    parser.add_argument("--commit", default=None, help="the commit read-back runs came from")
    parser.add_argument("--vllm-python", default=None)
    parser.add_argument("--plot", type=pathlib.Path, default=None)
    parser.add_argument("overrides", nargs="*", help="more key=value config overrides")
    args = parser.parse_args()
    out = args.out or pathlib.Path(f"runs/smollm2_{args.variant}")

    peaks: dict[int, float] = {}
    walls: dict[int, float] = {}
    if args.run_dirs:
        dirs, made = list(args.run_dirs), args.commit or "unknown"
    else:
        made = commit()
        overrides = [*VARIANTS[args.variant], *args.overrides]
        if args.variant in ("agent", "tool", "verifiers"):  # its module, for `grpojax train`
            paths = [str(HERE), os.environ.get("PYTHONPATH", "")]
            os.environ["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        if args.variant == "tool":
            sys.path.insert(0, str(HERE))
            from calc_agent import write_product_rows

            files = write_product_rows(out / "rows")
            rows = [f"data.path={files['train']}", f"data.eval_path={files['heldout']}"]
            overrides = [*VARIANTS["tool"], *rows, *args.overrides]
        if args.variant == "vllm":
            python = args.vllm_python
            if python is None:
                sys.path.insert(0, str(HERE.parents[1] / "tests"))
                from user_cache import user_cache_dir

                from grpojax.jobs.vllm_env import create_vllm_env

                python = str(create_vllm_env(user_cache_dir("vllm-env")))
            overrides.append(f"rollout.vllm.python={python}")
        dirs = []
        for seed in args.seeds:
            run_dir = out / f"seed{seed}"
            walls[seed], peaks[seed] = run_seed(seed, run_dir, overrides)
            dirs.append(run_dir)
    runs = [read_run(d) for d in dirs]
    for r in runs:  # the whole process where this script ran it: start-up and export too
        r["wall_s"] = walls.get(r["seed"], r["wall_s"])
    k = next(key for key in runs[0]["before"] if key.startswith("mean@"))
    print(f"{CONFIG.relative_to(HERE.parents[1])} ({args.variant}) at commit {made}")
    print(
        f"{'seed':>4} {'pass@1 before':>13} {'after':>6} {'gain':>6} {k + ' before':>12} "
        f"{'after':>6} {'reward 1-10':>11} {'last 10':>7} {'step s':>6} {'wall s':>7} "
        f"{'peak GB':>7} {'logp diff':>9}"
    )
    gains = []
    for r in runs:
        b, a = r["before"], r["after"]
        gains.append(a["pass@1"] - b["pass@1"])
        peak = peaks.get(r["seed"])
        diff = r["logprob_diff"]
        print(
            f"{r['seed']:>4} {b['pass@1']:>13.3f} {a['pass@1']:>6.3f} {gains[-1]:>+6.3f} "
            f"{b[k]:>12.3f} {a[k]:>6.3f} {r['reward_first10']:>11.3f} "
            f"{r['reward_last10']:>7.3f} {r['step_s']:>6.1f} {r['wall_s']:>7.0f} "
            f"{'-' if peak is None else f'{peak:.2f}':>7} "
            f"{'-' if diff is None else f'{diff:.2e}':>9}"
        )
    if any(r[w].get("tool_use") for r in runs for w in ("before", "after")):  # tool calls
        for r in runs:
            b, a = r["before"]["tool_use"], r["after"]["tool_use"]
            print(f"seed {r['seed']}: held-out greedy episodes calling a tool {b:.3f} -> {a:.3f}")
    figure = args.plot or out / "curves.png"
    plot(runs, figure, f"SmolLM2-135M-Instruct, GRPO ({args.variant}), commit {made}")
    print(f"curves: {figure}")
    peak = max(peaks.values()) if peaks else float("nan")
    print(
        f"smollm2_seeds: variant={args.variant} seeds={','.join(str(r['seed']) for r in runs)} "
        f"gain_min={min(gains):.3f} gain_mean={statistics.fmean(gains):.3f} "
        f"before_mean={statistics.fmean(r['before']['pass@1'] for r in runs):.3f} "
        f"after_mean={statistics.fmean(r['after']['pass@1'] for r in runs):.3f} "
        f"wall_max_s={max(r['wall_s'] for r in runs):.0f} peak_rss_gb={peak:.2f} commit={made}"
    )


if __name__ == "__main__":
    main()
