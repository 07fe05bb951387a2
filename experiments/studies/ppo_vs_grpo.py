"""Experiment: PPO vs GRPO and its family, from one SFT warm start, on one budget.

Eight algorithms train the built-in tiny model through the driver's public entry
(`grpojax.jobs.main_job.main_job` on `experiments/configs/default.yaml` plus `key=value`
overrides), each from the same SFT warm start, with the same N = B x G sampled completions
per step and the same number of steps:

    grpo, dr_grpo, dapo, gspo, rloo, reinforce_pp     (algo=<name>, the driver's presets)
    ppo_separate                                      (algo=ppo ppo.critic=separate)
    ppo_shared                                        (algo=ppo ppo.critic=shared: value head)

Per task, one `grpojax sft`-style job (`sft_job`) trains the warm start once and saves it as
a Hugging Face directory; every RL run starts from it (`model.source=<dir> sft.steps=0`).
Presets are adapted to the task's completion budget T = `rollout.max_new_tokens` where a
preset names a length: Dr.GRPO's `norm_constant` = T (its preset's 1024 would scale the loss
by T/1024); DAPO's overlong penalty (1024/256) never fires at these lengths. DAPO's dynamic
sampling is off by default (`--dapo-dynamic-sampling` turns it on) so that every algorithm
samples exactly N completions a step.

Tasks:
  arithmetic  the built-in task of the main job (`chain3`: "3+7-2=" -> "8"), numeric reward.
  gym         reasoning-gym `basic_arithmetic` with three one-digit terms, + and -, negation
              and no parentheses ("Calculate 7 - 2 - 6." -> "<answer>-1</answer>"), scored
              by reasoning-gym's own scorer (`rewards.names=[reasoning_gym]`, answer tag).
              Why this task: it is the built-in task's skill in reasoning-gym's format
              (words, signs, answer tags); its prompts are short (20-23 characters for the
              character tokenizer: one 24-token prompt bucket) and its 5,119 distinct
              training questions leave the held-out ones to be generalised to, not
              recalled. Within reach of the 4.6M-parameter model after a warm start
              (held-out pass@1 0.34 after 300 SFT steps). Variants that failed: with
              parentheses and nested negation prompts run to 62 characters, and a 30-step
              GRPO run (N = 128) after a 200-step warm start did not move held-out pass@1
              (0.16 -> 0.14); with two terms there are only 158 distinct training questions,
              which the warm start memorised (held-out pass@1 0.07). Tasks with long prompts
              or answers (count_bits, letter_counting, number_sorting) leave the model no
              success to reinforce. reasoning-gym rows have no demonstrations, so the script
              writes them as JSONL files (`data.kind=file`, completion =
              "<answer>{answer}</answer>") for the SFT warm start.

Recorded per run (each run is its own subprocess, so peak RSS is that run's):
  - held-out greedy pass@1 and mean@k (k samples at temperature 1) before RL and every
    `--eval-every` steps (the driver's evaluation, `eval.every`), and after the last step;
  - the reward curve (`reward_mean` of each step's N samples);
  - seconds per phase of each step (the driver's `time/generate`, `time/reward`,
    `time/logprobs`, `time/update`, and `step_time_s`); wall-clock curves use the cumulative
    `step_time_s`, compiles excluded (a step that compiled the RL step, the first and any
    that brought a new prompt bucket, counts as the median of the others) and evaluations
    not counted; the medians in the table leave those steps out;
  - memory: XLA's `memory_analysis()` of the compiled RL step (argument + output - aliased +
    temp bytes, as in `bench_step.py`; the step is compiled ahead of time on the first call
    with each batch shape and that executable runs every such step), the largest over the
    shapes seen, and the process's peak RSS.

Outputs in `--out`: `steps.csv` (one row per run and step), `evals.csv` (one row per run
and evaluation), `runs.csv` (one row per run), `summary.csv` and `table.md` (mean and
sample std over seeds per task and algorithm), `learning_curves.png`, `memory_time.png`,
`runs/` (each run's directory: config, metrics.jsonl, result.json). The last line printed is

    ppo_vs_grpo: runs=<n> failed=<n> <task>_<algo>_pass1=<mean> ... <task>_mem_ratio=<x>
    <task>_best=<algo> wall_s=<s>

(`mem_ratio`: GRPO's XLA step peak / PPO-with-separate-critic's).

Full mode (the default): both tasks, 8 algorithms, 3 seeds (48 RL runs), evaluation every
10 steps on 100 held-out prompts with k = 4, RL learning rate 1.5e-4 (the main job's) after
3 warm-up steps, cosine to 10%:
  arithmetic  150 SFT steps, then 40 RL steps of 16 prompts x 8 samples (128 completions);
  gym         300 SFT steps, then 30 RL steps of 8 prompts x 8 samples (64 completions).
Sized to about an hour on this 2-core machine: a gym step costs about 5x an arithmetic one
(T = 24 against 4) and PPO's update about 4x GRPO's, so the gym task gets half the batch
and 3/4 of the steps. Measured on the quiet 2-core machine: 57 minutes (3,248 s of it the
warm starts' and runs' own time; the rest process start-up). Command:

    python experiments/studies/ppo_vs_grpo.py --out experiments/results/ppo_vs_grpo

Run again into the same `--out`, it reads back every run that already finished with the
same configuration (`overrides.json` beside its `result.json`) and runs only the rest.

`--quick` (a few minutes): 8 algorithms x 1 seed x 6 steps of 4 prompts x 4 samples,
16 held-out prompts, the arithmetic task only, a 60-step warm start. Any knob can be set
by its flag on top of either mode (e.g. `--quick --algos grpo ppo_separate --steps 2`).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import os
import pathlib
import resource
import shutil
import statistics
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
DEFAULT_YAML = HERE.parent / "configs" / "default.yaml"
BENCH = HERE.parent / "bench"  # benchlib

ALGOS = (
    "grpo",
    "dr_grpo",
    "dapo",
    "gspo",
    "rloo",
    "reinforce_pp",
    "ppo_separate",
    "ppo_shared",
)
TASKS = ("arithmetic", "gym")
GYM_TASK = "basic_arithmetic"
GYM_CONFIG = dict(
    min_terms=3,
    max_terms=3,
    min_digits=1,
    max_digits=1,
    operators=("+", "-"),
    allow_parentheses=False,
)
MEMORY_KEYS = ("xla_peak_mb", "xla_argument_mb", "xla_output_mb", "xla_temp_mb")
PHASES = ("generate", "reward", "logprobs", "update")


@dataclasses.dataclass(frozen=True)
class Mode:
    """The size of an experiment (one of `MODES`, then any flag on top)."""

    tasks: tuple[str, ...]
    algos: tuple[str, ...]
    seeds: int
    steps: dict  # per task: RL steps
    prompts: dict  # per task: B prompts per step
    group: int  # G samples per prompt
    heldout: int
    k: int
    eval_every: int
    sft_steps: dict  # per task
    lr: float  # RL peak learning rate (cosine after `warmup` steps)
    warmup: int


MODES = {
    "full": Mode(
        tasks=TASKS,
        algos=ALGOS,
        seeds=3,
        steps={"arithmetic": 40, "gym": 30},
        prompts={"arithmetic": 16, "gym": 8},
        group=8,
        heldout=100,
        k=4,
        eval_every=10,
        sft_steps={"arithmetic": 150, "gym": 300},
        lr=1.5e-4,
        warmup=3,
    ),
    "quick": Mode(
        tasks=("arithmetic",),
        algos=ALGOS,
        seeds=1,
        steps={"arithmetic": 6, "gym": 6},
        prompts={"arithmetic": 4, "gym": 4},
        group=4,
        heldout=16,
        k=2,
        eval_every=3,
        sft_steps={"arithmetic": 60, "gym": 60},
        lr=1.5e-4,
        warmup=3,
    ),
}


# ----------------------------------------------------------------------------------------
# Configurations (key=value overrides of experiments/configs/default.yaml)
# ----------------------------------------------------------------------------------------


def task_overrides(task: str, data_dir: pathlib.Path) -> list[str]:
    """The data and reward overrides of a task (T = max_new_tokens included)."""
    if task == "arithmetic":
        return ["data.kind=arithmetic", "data.name=chain3", "rollout.max_new_tokens=4"]
    if task == "gym":
        return [
            "data.kind=file",
            f"data.path={data_dir / 'train.jsonl'}",
            f"data.eval_path={data_dir / 'heldout.jsonl'}",
            "data.max_prompt_tokens=24",
            "rewards.names=[reasoning_gym]",
            "rollout.max_new_tokens=24",
        ]
    raise ValueError(f"task must be one of {TASKS}, got {task!r}")


def max_new_tokens(overrides: list[str]) -> int:
    return int(next(o for o in overrides if o.startswith("rollout.max_new_tokens=")).split("=")[1])


def algo_overrides(algo: str, t: int, *, dapo_dynamic_sampling: bool = False) -> list[str]:
    """The driver's `algo` preset, adapted to the completion budget `t` where it names one."""
    if algo == "ppo_separate":
        return ["algo=ppo", "ppo.critic=separate"]
    if algo == "ppo_shared":
        return ["algo=ppo", "ppo.critic=shared"]
    if algo not in ALGOS:
        raise ValueError(f"algo must be one of {ALGOS}, got {algo!r}")
    out = [f"algo={algo}"]
    if algo == "dr_grpo":
        out.append(f"grpo.norm_constant={float(t)}")
    if algo == "dapo":
        out.append(f"rollout.dynamic_sampling={str(dapo_dynamic_sampling).lower()}")
    return out


def common_overrides(mode: Mode, task: str, run_dir: pathlib.Path) -> list[str]:
    return [
        f"rollout.prompts_per_step={mode.prompts[task]}",
        f"grpo.group_size={mode.group}",
        f"eval.heldout_size={mode.heldout}",
        f"eval.k={mode.k}",
        f"eval.batch_size={min(mode.heldout, 200)}",
        f"log.run_dir={run_dir}",
        "log.tensorboard=false",
        "log.plot=false",
        "log.export_hf=false",
        "log.progress=false",
        "rewards.mode=thread",
    ]


def write_gym_files(data_dir: pathlib.Path, *, train_size: int, heldout_size: int) -> None:
    """reasoning-gym rows as JSONL, with demonstrations (`completion`) for the warm start."""
    from grpojax.data import reasoning_gym_split

    data_dir.mkdir(parents=True, exist_ok=True)
    train, heldout = reasoning_gym_split(
        GYM_TASK, train_size=train_size, heldout_size=heldout_size, seed=0, config=GYM_CONFIG
    )
    for name, rows in (("train.jsonl", train), ("heldout.jsonl", heldout)):
        with open(data_dir / name, "w", encoding="utf-8") as f:
            for r in rows:
                row = {
                    "prompt": r["prompt"],
                    "completion": f"<answer>{r['answer']}</answer>",
                    "answer": r["answer"],
                    "task": r["task"],
                    "entry": r["entry"],
                }
                f.write(json.dumps(row) + "\n")


# ----------------------------------------------------------------------------------------
# Workers (one subprocess each)
# ----------------------------------------------------------------------------------------


def _record_step_memory(sink: dict) -> None:
    """Make every step built by `grpojax.train.common.jit_step` compile ahead of time on its
    first call, record XLA's memory analysis of that executable in `sink`, and run it.

    Instrumentation only: the driver's loop, trainer and step functions are unchanged; the
    executable is the one `jax.jit` would have compiled for those arguments.
    """
    import jax

    import grpojax.train.common as common
    import grpojax.train.ppo as ppo

    original = common.jit_step

    def jit_step(fn, *, mesh, **kw):
        call = original(fn, mesh=mesh, **kw)
        compiled = {}

        def run(state, batch):
            # One executable per batch shape: a prompt bucket first seen later (a batch of
            # only short prompts) compiles, and is recorded, on the call that brings it.
            shapes = tuple((x.shape, x.dtype) for x in jax.tree.leaves(batch))
            sink["calls"] = sink.get("calls", 0) + 1
            if shapes not in compiled:
                t0 = time.perf_counter()
                with jax.set_mesh(mesh):
                    compiled[shapes] = call.jitted.lower(state, batch).compile()
                mem = compiled[shapes].memory_analysis()
                peak = (
                    mem.argument_size_in_bytes
                    + mem.output_size_in_bytes
                    - mem.alias_size_in_bytes
                    + mem.temp_size_in_bytes
                )
                sink.setdefault("steps", []).append(
                    dict(
                        xla_peak_mb=peak / 2**20,
                        xla_argument_mb=mem.argument_size_in_bytes / 2**20,
                        xla_output_mb=mem.output_size_in_bytes / 2**20,
                        xla_temp_mb=mem.temp_size_in_bytes / 2**20,
                        compile_s=time.perf_counter() - t0,
                        call=sink["calls"],
                    )
                )
            return compiled[shapes](state, batch)

        run.jitted = call.jitted
        return run

    common.jit_step = jit_step
    ppo.jit_step = jit_step


def _quiet_print(path: pathlib.Path):
    def print_fn(line: str) -> None:
        with open(path, "a", encoding="utf-8") as f:
            f.write(line + "\n")

    return print_fn


def sft_worker(overrides: list[str], out: pathlib.Path) -> dict:
    """The warm start of one task: `sft_job`, the model saved to `<run_dir>/sft_model`."""
    from grpojax.config import load_config
    from grpojax.jobs.sft import sft_job

    cfg = load_config(DEFAULT_YAML, overrides)
    t0 = time.perf_counter()
    res = sft_job(cfg, show_progress=False, print_fn=_quiet_print(out / "log.txt"))
    res["wall_s"] = time.perf_counter() - t0
    res["model_dir"] = str(pathlib.Path(res["run_dir"]) / "sft_model")
    return res


def rl_worker(overrides: list[str], out: pathlib.Path) -> dict:
    """One RL run through `main_job`; returns its curves, memory and timings."""
    from grpojax.config import load_config
    from grpojax.driver.metrics import read_jsonl
    from grpojax.jobs.main_job import main_job

    mem: dict = {}
    _record_step_memory(mem)
    cfg = load_config(DEFAULT_YAML, overrides)
    t0 = time.perf_counter()
    # policy_metrics_every=0: no diagnostic policy forward, so each algorithm's logprob
    # phase is only what its update needs (the reference, PPO's pi_old).
    result = main_job(
        cfg, print_fn=_quiet_print(out / "log.txt"), show_progress=False, policy_metrics_every=0
    )
    wall = time.perf_counter() - t0
    rows = read_jsonl(result.run_dir / "metrics.jsonl")
    k = cfg.eval.k
    steps, evals = [], []
    if result.eval_before is not None:
        ev = result.eval_before
        evals.append(dict(step=0, pass1=ev["pass@1"], mean_k=ev[f"mean@{k}"]))
    # Wall-clock without compiles: a step that compiled the RL step (the first, and any
    # that brought a new prompt bucket; the sampler compiles on the same steps) counts as
    # the median of the others, so a compilation-cache hit changes nothing.
    rl_steps = mem.get("steps", [])
    if not rl_steps:
        raise RuntimeError("no compiled RL step was recorded")
    times = [r["step_time_s"] for r in rows if "step_time_s" in r]
    one_call_per_step = mem["calls"] == len(times)
    compile_steps = {m["call"] if one_call_per_step else 1 for m in rl_steps}
    usual = [x for i, x in enumerate(times, 1) if i not in compile_steps] or times
    median = statistics.median(usual)
    wall_clock = 0.0
    for r in rows:
        if "step_time_s" in r:
            wall_clock += median if len(steps) + 1 in compile_steps else r["step_time_s"]
            steps.append(
                dict(
                    step=r["step"],
                    wall_s=wall_clock,
                    reward_mean=r["reward_mean"],
                    step_time_s=r["step_time_s"],
                    **{f"{p}_s": r[f"time/{p}"] for p in PHASES},
                )
            )
        if "eval/pass@1" in r:
            evals.append(dict(step=r["step"], pass1=r["eval/pass@1"], mean_k=r[f"eval/mean@{k}"]))
    at_step = {s["step"]: s["wall_s"] for s in steps}
    for e in evals:
        e["wall_s"] = at_step.get(e["step"], 0.0)
    # Memory: the largest of the compiled RL steps (one per prompt bucket seen).
    memory = max(rl_steps, key=lambda m: m["xla_peak_mb"])
    return dict(
        steps=steps,
        evals=evals,
        memory={k: memory[k] for k in (*MEMORY_KEYS, "compile_s")},
        compiled_steps=len(rl_steps),
        compile_steps=sorted(compile_steps),
        rss_peak_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        wall_s=wall,
        samples_total=json.loads((result.run_dir / "summary.json").read_text())["counters"][
            "samples"
        ],
        completions_per_step=cfg.rollout.prompts_per_step * cfg.group_size,
    )


def run_worker(kind: str, overrides: list[str], out: pathlib.Path) -> dict:
    """Run a worker in a fresh subprocess; its result JSON is `out/result.json`."""
    result_file, asked = out / "result.json", out / "overrides.json"
    # An interrupted experiment, run again into the same --out, reads back every run that
    # finished with the same configuration instead of repeating it.
    if result_file.exists() and asked.exists() and json.loads(asked.read_text()) == overrides:
        return json.loads(result_file.read_text())
    shutil.rmtree(out, ignore_errors=True)  # a fresh run: nothing of an earlier one is left
    out.mkdir(parents=True)
    asked.write_text(json.dumps(overrides))
    cmd = [sys.executable, __file__, "--worker", kind, "--worker-out", str(out), "--", *overrides]
    env = dict(os.environ)
    # One persistent compilation cache for every run: seeds (and algorithms sharing the
    # sampler's shapes) reuse programs; XLA's memory analysis is the same on a cache hit.
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(out.parents[2] / "jax_cache"))
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(HERE.parents[1]), env.get("PYTHONPATH")) if p
    )
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    (out / "stderr.txt").write_text(proc.stderr)
    if proc.returncode != 0 or not result_file.exists():
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"{kind} worker failed (rc={proc.returncode}) in {out}:\n{tail}")
    return json.loads(result_file.read_text())


# ----------------------------------------------------------------------------------------
# Aggregation, CSVs, table, figures
# ----------------------------------------------------------------------------------------


def _mean_std(xs: list[float]) -> tuple[float, float]:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    if not xs:
        return math.nan, math.nan
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def _write_csv(path: pathlib.Path, rows: list[dict]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def run_row(task: str, algo: str, seed: int, res: dict) -> dict:
    """One row of runs.csv: final held-out scores, memory, median phase times."""
    steps = res["steps"]
    compiles = set(res["compile_steps"])  # steps that compiled (the first at least)
    later = [s for i, s in enumerate(steps, 1) if i not in compiles] or steps
    last = res["evals"][-1]
    tail = steps[-max(1, len(steps) // 4) :]
    row = dict(
        task=task,
        algo=algo,
        seed=seed,
        steps=len(steps),
        completions_per_step=res["completions_per_step"],
        pass1_before=res["evals"][0]["pass1"],
        pass1_final=last["pass1"],
        # Paired: the same held-out prompts before and after (arithmetic draws them per seed).
        pass1_gain=last["pass1"] - res["evals"][0]["pass1"],
        mean_k_final=last["mean_k"],
        reward_first=steps[0]["reward_mean"],
        reward_last_quarter=statistics.fmean(s["reward_mean"] for s in tail),
        **{k: res["memory"][k] for k in MEMORY_KEYS},
        rss_peak_mb=res["rss_peak_mb"],
        first_step_s=steps[0]["step_time_s"],
        compiled_steps=res["compiled_steps"],
        step_s=statistics.median(s["step_time_s"] for s in later),
        **{f"{p}_s": statistics.median(s[f"{p}_s"] for s in later) for p in PHASES},
        wall_s=res["wall_s"],
    )
    return row


SUMMARY_FIELDS = (
    "pass1_before",
    "pass1_final",
    "pass1_gain",
    "mean_k_final",
    "reward_last_quarter",
    "xla_peak_mb",
    "rss_peak_mb",
    "step_s",
    "generate_s",
    "reward_s",
    "logprobs_s",
    "update_s",
)


def summarise(runs: list[dict]) -> list[dict]:
    out = []
    keys = sorted(
        {(r["task"], r["algo"]) for r in runs}, key=lambda ta: (ta[0], ALGOS.index(ta[1]))
    )
    for task, algo in keys:
        mine = [r for r in runs if (r["task"], r["algo"]) == (task, algo)]
        row = dict(task=task, algo=algo, seeds=len(mine))
        for f in SUMMARY_FIELDS:
            row[f], row[f + "_std"] = _mean_std([r[f] for r in mine])
        out.append(row)
    return out


def markdown_table(summary: list[dict], k: int) -> str:
    head = (
        f"| task | algo | seeds | pass@1 before | pass@1 after | gain | mean@{k} after "
        "| reward (last 1/4) | XLA step peak MB | peak RSS MB | s/step | generate | reward "
        "| logprobs | update |\n"
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: | ---: | ---: |\n"
    )

    def pm(r, f, fmt):
        return f"{r[f]:{fmt}} ± {r[f + '_std']:{fmt.lstrip('+')}}"

    lines = []
    for r in summary:
        lines.append(
            f"| {r['task']} | {r['algo']} | {r['seeds']} | {r['pass1_before']:.3f} "
            f"| {pm(r, 'pass1_final', '.3f')} | {pm(r, 'pass1_gain', '+.3f')} "
            f"| {pm(r, 'mean_k_final', '.3f')} "
            f"| {pm(r, 'reward_last_quarter', '.3f')} | {r['xla_peak_mb']:.1f} "
            f"| {r['rss_peak_mb']:.0f} | {r['step_s']:.3f} | {r['generate_s']:.3f} "
            f"| {r['reward_s']:.3f} | {r['logprobs_s']:.3f} | {r['update_s']:.3f} |"
        )
    note = (
        "\nMean ± sample std over seeds. pass@1: greedy, held-out; gain: pass@1 after - "
        "before, run by run (on the same prompts); mean@k: k samples at "
        "temperature 1. XLA step peak: argument + output - aliased + temp bytes of the "
        "compiled RL step. Times: medians over the steps that compiled nothing (seconds).\n"
    )
    return head + "\n".join(lines) + "\n" + note


def _band(ax, xs_by_seed, ys_by_seed, label, color):
    """Mean over seeds and a min-max band, on the x grid of the first seed."""
    import numpy as np

    n = min(len(y) for y in ys_by_seed)
    ys = np.array([y[:n] for y in ys_by_seed], dtype=float)
    xs = np.array([x[:n] for x in xs_by_seed], dtype=float).mean(axis=0)
    ax.plot(xs, ys.mean(axis=0), label=label, color=color, lw=1.5)
    if len(ys) > 1:
        ax.fill_between(xs, ys.min(axis=0), ys.max(axis=0), color=color, alpha=0.15, lw=0)


def plot_curves(results: dict, tasks: list[str], algos: list[str], k: int, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = [
        ("held-out pass@1 (greedy)", "evals", "step", "pass1"),
        (f"held-out mean@{k}", "evals", "step", "mean_k"),
        ("reward (train samples)", "steps", "step", "reward_mean"),
        ("held-out pass@1 vs wall-clock", "evals", "wall_s", "pass1"),
    ]
    colors = plt.get_cmap("tab10")
    fig, axes = plt.subplots(len(tasks), len(cols), figsize=(4.2 * len(cols), 3.4 * len(tasks)))
    axes = [axes] if len(tasks) == 1 else axes
    for i, task in enumerate(tasks):
        for j, (title, part, xkey, ykey) in enumerate(cols):
            ax = axes[i][j]
            for a, algo in enumerate(algos):
                seeds = [v for (t, al, _), v in results.items() if (t, al) == (task, algo)]
                if not seeds:
                    continue
                xs = [[p[xkey] for p in s[part]] for s in seeds]
                ys = [[p[ykey] for p in s[part]] for s in seeds]
                _band(ax, xs, ys, algo, colors(a))
            ax.set_title(f"{task}: {title}", fontsize=9)
            ax.set_xlabel(
                "seconds (sum of step times, no compiles)" if xkey == "wall_s" else "RL step"
            )
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("mean over seeds, band = min..max", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_memory_time(summary: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    tasks = sorted({r["task"] for r in summary})
    fig, axes = plt.subplots(len(tasks), 2, figsize=(11, 3.6 * len(tasks)))
    axes = [axes] if len(tasks) == 1 else axes
    for i, task in enumerate(tasks):
        rows = [r for r in summary if r["task"] == task]
        names = [r["algo"] for r in rows]
        x = np.arange(len(rows))
        ax = axes[i][0]
        ax.bar(x - 0.2, [r["xla_peak_mb"] for r in rows], 0.4, label="XLA step peak")
        ax.bar(x + 0.2, [r["rss_peak_mb"] for r in rows], 0.4, label="process peak RSS")
        ax.set_yscale("log")
        ax.set_ylabel("MB")
        ax.set_title(f"{task}: memory", fontsize=9)
        ax.legend(fontsize=7)
        ax = axes[i][1]
        bottom = np.zeros(len(rows))
        for p in PHASES:
            v = np.array([r[f"{p}_s"] for r in rows])
            ax.bar(x, v, 0.6, bottom=bottom, label=p)
            bottom += v
        ax.set_ylabel("seconds per step (median)")
        ax.set_title(f"{task}: step time by phase", fontsize=9)
        ax.legend(fontsize=7)
        for a in axes[i]:
            a.set_xticks(x, names, rotation=30, ha="right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary_line(summary: list[dict], runs: int, failed: int, wall: float) -> str:
    parts = [f"runs={runs}", f"failed={failed}"]
    for task in sorted({r["task"] for r in summary}):
        rows = {r["algo"]: r for r in summary if r["task"] == task}
        for algo, r in rows.items():
            parts.append(f"{task}_{algo}_pass1={r['pass1_final']:.3f}")
        if "grpo" in rows and "ppo_separate" in rows:
            ratio = rows["grpo"]["xla_peak_mb"] / rows["ppo_separate"]["xla_peak_mb"]
            parts.append(f"{task}_mem_ratio={ratio:.3f}")
        best = max(rows.values(), key=lambda r: r["pass1_final"])
        parts.append(f"{task}_best={best['algo']}")
    parts.append(f"wall_s={wall:.1f}")
    return "ppo_vs_grpo: " + " ".join(parts)


# ----------------------------------------------------------------------------------------
# The experiment
# ----------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=False, default="ppo_vs_grpo_out", help="output directory")
    p.add_argument("--quick", action="store_true", help="a small version (a few minutes)")
    p.add_argument("--tasks", nargs="+", choices=TASKS)
    p.add_argument("--algos", nargs="+", choices=ALGOS)
    p.add_argument("--seeds", type=int, help="seeds 0 .. n-1")
    p.add_argument("--steps", type=int, help="RL steps")
    p.add_argument("--prompts", type=int, help="B prompts per step")
    p.add_argument("--group", type=int, help="G samples per prompt")
    p.add_argument("--heldout", type=int, help="held-out prompts")
    p.add_argument("--k", type=int, help="samples per held-out prompt for mean@k")
    p.add_argument("--eval-every", type=int, help="evaluate every this many RL steps")
    p.add_argument("--sft-steps", type=int, help="warm-start SFT steps (every task)")
    p.add_argument("--lr", type=float, help="RL peak learning rate")
    p.add_argument("--warmup", type=int, help="RL learning-rate warmup steps")
    p.add_argument("--dapo-dynamic-sampling", action="store_true")
    p.add_argument("--worker", choices=("sft", "rl"), help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def build_mode(args) -> Mode:
    mode = MODES["quick" if args.quick else "full"]

    def every_task(value):  # a flag sets a per-task size for every task
        return None if value is None else {t: value for t in TASKS}

    fields = dict(
        tasks=tuple(args.tasks) if args.tasks else None,
        algos=tuple(args.algos) if args.algos else None,
        seeds=args.seeds,
        steps=every_task(args.steps),
        prompts=every_task(args.prompts),
        sft_steps=every_task(args.sft_steps),
        group=args.group,
        heldout=args.heldout,
        k=args.k,
        eval_every=args.eval_every,
        lr=args.lr,
        warmup=args.warmup,
    )
    return dataclasses.replace(mode, **{k: v for k, v in fields.items() if v is not None})


def experiment(args) -> str:
    """Run the experiment of `args` into `args.out`; returns the summary line."""
    mode = build_mode(args)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # The experiment's cost: every warm start's and run's own wall time (the same whether
    # this invocation ran it or read it back from an earlier one into the same --out).
    wall = 0.0
    results: dict[tuple, dict] = {}
    failed = 0
    for task in mode.tasks:
        data_dir = out / "data" / task
        if task == "gym":
            write_gym_files(data_dir, train_size=20000, heldout_size=mode.heldout)
        t_over = task_overrides(task, data_dir)
        sft_dir = out / "runs" / task / "sft"
        sft = run_worker(
            "sft",
            [
                *t_over,
                *common_overrides(mode, task, sft_dir),
                f"sft.steps={mode.sft_steps[task]}",
                "seed=0",
            ],
            sft_dir,
        )
        wall += sft["wall_s"]
        print(
            f"{task}: warm start ({mode.sft_steps[task]} SFT steps, {sft['wall_s']:.0f}s): "
            f"held-out pass@1 {sft['success_before']:.3f} -> {sft['success_after']:.3f}",
            flush=True,
        )
        t = max_new_tokens(t_over)
        for algo in mode.algos:
            for seed in range(mode.seeds):
                run_dir = out / "runs" / task / f"{algo}-s{seed}"
                overrides = [
                    *t_over,
                    *common_overrides(mode, task, run_dir),
                    *algo_overrides(algo, t, dapo_dynamic_sampling=args.dapo_dynamic_sampling),
                    f"model.source={sft['model_dir']}",
                    "sft.steps=0",
                    f"seed={seed}",
                    f"total_steps={mode.steps[task]}",
                    f"eval.every={mode.eval_every}",
                    f"checkpoint.every={mode.steps[task]}",
                    "checkpoint.keep=1",
                    f"optimizer.learning_rate={mode.lr}",
                    f"optimizer.warmup_steps={min(mode.warmup, max(0, mode.steps[task] - 1))}",
                ]
                try:
                    res = run_worker("rl", overrides, run_dir)
                except RuntimeError as e:
                    failed += 1
                    print(f"{task} {algo} seed {seed}: FAILED: {e}", flush=True)
                    continue
                results[(task, algo, seed)] = res
                wall += res["wall_s"]
                row = run_row(task, algo, seed, res)
                print(
                    f"{task} {algo} seed {seed}: pass@1 {row['pass1_before']:.3f} -> "
                    f"{row['pass1_final']:.3f}, {row['step_s']:.3f} s/step, XLA step "
                    f"{row['xla_peak_mb']:.1f} MB, RSS {row['rss_peak_mb']:.0f} MB, "
                    f"{row['wall_s']:.0f}s",
                    flush=True,
                )
    if not results:
        raise SystemExit("ppo_vs_grpo: every run failed")
    return write_outputs(out, results, mode, wall=wall, failed=failed)


def write_outputs(out: pathlib.Path, results: dict, mode: Mode, *, wall: float, failed: int) -> str:
    """The CSVs, table, figures and summary line of `results` ({(task, algo, seed): worker
    result}); returns the summary line."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    from benchlib import machine

    runs = [run_row(t, a, s, res) for (t, a, s), res in results.items()]
    steps_rows, eval_rows = [], []
    for (task, algo, seed), res in results.items():
        for s in res["steps"]:
            steps_rows.append(dict(task=task, algo=algo, seed=seed, **s))
        for e in res["evals"]:
            eval_rows.append(dict(task=task, algo=algo, seed=seed, **e))
    _write_csv(out / "steps.csv", steps_rows)
    _write_csv(out / "evals.csv", eval_rows)
    _write_csv(out / "runs.csv", runs)
    summary = summarise(runs)
    _write_csv(out / "summary.csv", summary)
    tasks_done = [t for t in mode.tasks if any(r["task"] == t for r in runs)]
    plot_curves(results, tasks_done, list(mode.algos), mode.k, out / "learning_curves.png")
    plot_memory_time(summary, out / "memory_time.png")
    header = (
        f"machine: {machine()}\n\n"
        + "".join(
            f"{t}: N = {mode.prompts[t]} x {mode.group} = {mode.prompts[t] * mode.group} "
            f"completions per step, {mode.steps[t]} RL steps; "
            for t in tasks_done
        )
        + f"{mode.seeds} seed(s), {mode.heldout} held-out prompts, evaluation every "
        f"{mode.eval_every} steps; wall {wall:.0f} s (the sum of the warm starts' and "
        "runs' own wall times).\n\n"
    )
    table = markdown_table(summary, mode.k)
    (out / "table.md").write_text(header + table, encoding="utf-8")
    print(header + table)
    line = summary_line(summary, len(runs), failed, wall)
    (out / "summary_line.txt").write_text(line + "\n", encoding="utf-8")
    return line


# The columns each CSV must have (a subset; all values finite numbers or names).
CSV_COLUMNS = {
    "steps.csv": (
        "task",
        "algo",
        "seed",
        "step",
        "wall_s",
        "reward_mean",
        "step_time_s",
        *tuple(f"{p}_s" for p in PHASES),
    ),
    "evals.csv": ("task", "algo", "seed", "step", "wall_s", "pass1", "mean_k"),
    "runs.csv": (
        "task",
        "algo",
        "seed",
        "pass1_before",
        "pass1_final",
        "mean_k_final",
        *MEMORY_KEYS,
        "rss_peak_mb",
        "step_s",
        "wall_s",
    ),
    "summary.csv": ("task", "algo", "seeds", *SUMMARY_FIELDS),
}
NAME_COLUMNS = ("task", "algo")
LINE_RE = r"ppo_vs_grpo: runs=\d+ failed=\d+( [a-z0-9_@]+=[^ ]+)+ wall_s=[\d.]+"


def check_outputs(out, *, tasks, algos, seeds: int) -> dict:
    """Check an output directory is complete and well formed; raise ValueError naming the
    first problem. Returns {csv name: rows}.

    Every CSV has its columns, one summary/table row per (task, algo) and one runs.csv row
    per seed; every value outside the name columns is a finite number; scores lie in
    [0, 1]; memory and times are > 0 (phases >= 0); both figures are non-empty PNGs; the
    summary line has a pass@1 per (task, algo)."""
    import re

    out = pathlib.Path(out)
    tables = {}
    for name, cols in CSV_COLUMNS.items():
        path = out / name
        if not path.is_file():
            raise ValueError(f"{name}: missing")
        with open(path, newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
        if not rows:
            raise ValueError(f"{name}: no rows")
        missing = [c for c in cols if c not in rows[0]]
        if missing:
            raise ValueError(f"{name}: missing columns {missing}")
        for i, r in enumerate(rows):
            for c, v in r.items():
                if c in NAME_COLUMNS:
                    continue
                try:
                    x = float(v)
                except (TypeError, ValueError):
                    raise ValueError(f"{name} row {i}: {c}={v!r} is not a number") from None
                if not math.isfinite(x):
                    raise ValueError(f"{name} row {i}: {c}={v} is not finite")
                if c in ("pass1", "mean_k", "pass1_before", "pass1_final", "mean_k_final"):
                    if not 0.0 <= x <= 1.0:
                        raise ValueError(f"{name} row {i}: {c}={x} outside [0, 1]")
                if c in (*MEMORY_KEYS[:1], "rss_peak_mb", "step_time_s", "step_s") and x <= 0:
                    raise ValueError(f"{name} row {i}: {c}={x} must be > 0")
                if c.endswith("_s") and x < 0:
                    raise ValueError(f"{name} row {i}: {c}={x} must be >= 0")
        tables[name] = rows
    want = {(t, a) for t in tasks for a in algos}
    got = [(r["task"], r["algo"]) for r in tables["summary.csv"]]
    if sorted(got) != sorted(want):
        raise ValueError(f"summary.csv: rows for {sorted(got)}, expected {sorted(want)}")
    runs = sorted((r["task"], r["algo"], int(r["seed"])) for r in tables["runs.csv"])
    if runs != sorted((t, a, s) for t, a in want for s in range(seeds)):
        raise ValueError(f"runs.csv: runs {runs}, expected {len(want)} x {seeds} seeds")
    table = (out / "table.md").read_text(encoding="utf-8")
    for t, a in want:
        if not re.search(rf"^\| {t} \| {a} \| {seeds} \|", table, flags=re.M):
            raise ValueError(f"table.md: no row for task {t}, algo {a}")
    for fig in ("learning_curves.png", "memory_time.png"):
        data = (out / fig).read_bytes() if (out / fig).is_file() else b""
        if not data.startswith(b"\x89PNG") or len(data) < 1000:
            raise ValueError(f"{fig}: missing or not a PNG")
    line = (out / "summary_line.txt").read_text(encoding="utf-8").strip()
    if not re.fullmatch(LINE_RE, line):
        raise ValueError(f"summary_line.txt: malformed: {line!r}")
    fields = dict(kv.split("=", 1) for kv in line.split(": ", 1)[1].split())
    for t, a in want:
        if not 0.0 <= float(fields.get(f"{t}_{a}_pass1", "nan")) <= 1.0:
            raise ValueError(f"summary line: no valid {t}_{a}_pass1 in {line!r}")
    return tables


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        out = pathlib.Path(args.worker_out)
        fn = sft_worker if args.worker == "sft" else rl_worker
        res = fn(list(args.overrides), out)
        (out / "result.json").write_text(json.dumps(res))
        return
    print(experiment(args))


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main()
