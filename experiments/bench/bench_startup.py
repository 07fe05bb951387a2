"""Time to the first RL step of the main job, with and without the persistent compilation
cache that `grpojax` commands now keep (`grpojax.cli.enable_compilation_cache`).

Each run is a fresh `grpojax train` process on the embedded default with `total_steps=1`
(and no warm-up: the schedule needs fewer warm-up steps than steps; everything before
the first RL step is the main job's own: set-up, model, 150 SFT
steps, the held-out evaluation of 200 prompts at k=4, the first step's compilations and
the step); `first_step_s` is read from its summary line and the process's whole wall time
is measured around it. Runs:

- `no cache`: `GRPOJAX_COMPILATION_CACHE=0`, as every run was before the CLI kept a cache;
- `cold cache`: an empty cache directory (the first run on a machine: compiles and writes);
- `warm cache`: the same directory again (every later run with the same shapes).

    python experiments/bench/bench_startup.py [--rounds 1] [--log-compiles]

`--log-compiles` adds the number of programs each run compiled or loaded (JAX_LOG_COMPILES).
Measure on a quiet machine.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from benchlib import machine

TRAIN = [sys.executable, "-m", "grpojax.cli", "train", "--no-progress"]
TRAIN += ["total_steps=1", "optimizer.warmup_steps=0"]  # the schedule needs warm-up < steps
LINE = re.compile(r"grpojax train: .* wall_s=([\d.]+) first_step_s=([\d.na]+) run_dir=")


def run_once(cache: str | None, work: pathlib.Path, log_compiles: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env["GRPOJAX_COMPILATION_CACHE"] = "0" if cache is None else "1"
    if cache is not None:
        env["JAX_COMPILATION_CACHE_DIR"] = cache
    if log_compiles:
        env["JAX_LOG_COMPILES"] = "1"
    run_dir = tempfile.mkdtemp(dir=work)
    t0 = time.perf_counter()
    proc = subprocess.run(
        [*TRAIN, f"log.run_dir={run_dir}/run"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    process_s = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"grpojax train failed:\n{proc.stderr[-3000:]}")
    m = LINE.search(proc.stdout)
    if m is None:
        raise SystemExit(f"no summary line in:\n{proc.stdout[-2000:]}")
    compiles = proc.stderr.count("Finished XLA compilation") if log_compiles else None
    return {"first_step_s": float(m.group(2)), "process_s": process_s, "compiles": compiles}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=1, help="rounds of the three runs")
    p.add_argument("--log-compiles", action="store_true")
    args = p.parse_args()
    results: dict[str, list[dict]] = {"no cache": [], "cold cache": [], "warm cache": []}
    with tempfile.TemporaryDirectory() as tmp:
        work = pathlib.Path(tmp)
        for r in range(args.rounds):
            cache = str(work / f"cache{r}")
            results["no cache"].append(run_once(None, work, args.log_compiles))
            results["cold cache"].append(run_once(cache, work, args.log_compiles))
            results["warm cache"].append(run_once(cache, work, args.log_compiles))
    print(f"machine: {machine()}")
    print("grpojax train total_steps=1 on the embedded default, fresh process per run")
    print(f"{'run':<12}{'first_step_s':>14}{'process_s':>12}{'ratio':>8}{'programs':>10}")
    base = statistics.median(x["first_step_s"] for x in results["no cache"])
    med = {}
    for name, xs in results.items():
        med[name] = statistics.median(x["first_step_s"] for x in xs)
        proc_s = statistics.median(x["process_s"] for x in xs)
        compiles = xs[-1]["compiles"]
        print(
            f"{name:<12}{med[name]:>14.1f}{proc_s:>12.1f}{med[name] / base:>8.2f}"
            f"{'' if compiles is None else compiles:>10}"
        )
    print(
        f"bench_startup: first_step_s_no_cache={med['no cache']:.1f} "
        f"first_step_s_cold={med['cold cache']:.1f} first_step_s_warm={med['warm cache']:.1f} "
        f"warm_ratio={med['warm cache'] / base:.2f} rounds={args.rounds}"
    )


if __name__ == "__main__":
    main()
