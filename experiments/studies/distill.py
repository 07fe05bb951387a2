"""On-policy distillation of the main job's policy into a smaller student, against SFT on
the teacher's greedy outputs and against GRPO, on the built-in arithmetic task (chain3).

Teacher: the main job (`grpojax train` with no arguments: `grpojax.jobs.main_job`'s
`DEFAULT_CONFIG`, the built-in 6-layer, width-256 tiny model, 4.6M parameters; SFT warm
start 150 steps, GRPO 120 steps), run once with seed 0 into `<out>/teacher` (or `--teacher`
DIR: a finished run directory, whose `hf/` export is used, or a Hugging Face directory).
Its exported final policy is `distill.teacher`.

Student: a 2-layer, width-128 decoder of the same family and the same built-in tokenizer
(0.42M parameters), random weights from `nnx.Rngs(seed)`, saved as a Hugging Face
directory and loaded by every run as `model.source`. For each seed every method starts
from the same warm start: the main job's SFT warm start (150 steps on the task's gold
demonstrations), a function of the seed only, repeated by each run; the held-out success
before the methods' steps is checked to be identical across the methods of a seed.

From the warm start, K steps (`--steps`, 60) of each method, with the main job's data,
rollout (B = 32 prompts per step, G = 8 samples, T = 4 tokens), optimizer and evaluation
settings (greedy held-out pass@1 on 200 prompts of the seed's held-out split):

  distill      `algo=distill`: the student samples, the frozen teacher scores every position
               of the samples, and each completion token t of a sample x is trained on the
               exact reverse KL over the whole vocabulary V (no reward term, rl_coef 0):

                   loss_t = KL(pi_theta(. | x_<t) || pi_T(. | x_<t))
                          = sum_{v in V} p_v (log p_v - log q_v),
                   p_v = pi_theta(v | x_<t),  q_v = pi_T(v | x_<t) (the teacher),

               averaged over each sample's completion tokens, then over the step's samples
               (GRPO's "seq-mean-token-mean"; `grpo.beta` = 1, set by the algo).
  grpo         `algo=grpo`: the main job's GRPO (group-normalised advantages of the 0/1
               numeric-answer reward, clipped ratio, no KL term).
  sft_teacher  SFT on the teacher's greedy outputs: the K x B prompts the RL methods draw
               in their K steps (the seed's RL prompt stream, `prompt_source`), each with
               the teacher's greedy completion y* (T = 4 tokens, EOS appended as for the
               gold demonstrations), and K supervised steps of B = 32 of those rows
               (one epoch, in the seed's SFT order) from the same warm start:

                   loss = -(1 / sum_rows |y*|) sum_rows sum_t log pi_theta(y*_t | prompt, y*_<t)

               matched to the RL methods by optimizer steps (K) and prompts seen (K x B),
               with the warm start's own SFT optimizer (AdamW, constant lr 1e-3 after a
               warmup of min(10, K/10) steps; `grpojax.driver.sft.run_sft`). The RL methods
               see G = 8 samples of each prompt; this baseline sees one (the teacher's).

The teacher is also evaluated on each seed's held-out prompts (the students' figures'
prompts, with the same evaluation key), and its greedy labels' accuracy on the SFT
prompts is printed.

    PYTHONPATH=. .venv/bin/python experiments/studies/distill.py [--out runs/distill-experiment]
        [--teacher DIR] [--steps 60] [--seeds 0,1] [--quick]

`--quick`: a smoke run of well under a minute (the test's): seed 0 only, a teacher of the
student's size from a 4-step SFT-only run (`grpojax sft`), a 4-step warm start, 2 steps
per method, 2 held-out prompts, small batches; its figures mean nothing.

Printed: the machine, the teacher, one table row per (method, seed) -- success_before,
success_after, gain = after - before, wall_s (a run's own wall time, start-up, warm start
and evaluations included) -- and last a line

    distill: distill_gain=<x> sft_gain=<x> grpo_gain=<x> teacher_success=<x> student_start=<x>

(each gain the mean over seeds; teacher_success the teacher's held-out pass@1, mean over the
seeds' held-out sets; student_start the mean warm-start pass@1).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))  # benchlib

import jax
import numpy as np
from benchlib import machine
from flax import nnx

import grpojax.models as gm
from grpojax.cli import enable_compilation_cache
from grpojax.config import RunConfig, load_config
from grpojax.data import encode_prompts, pad_id_of, stop_ids_of
from grpojax.driver.evaluate import heldout_evaluator
from grpojax.driver.loop import train
from grpojax.driver.setup import build_reward_manager, prompt_source, start_run
from grpojax.driver.sft import run_sft
from grpojax.jobs.main_job import default_yaml, summary_line
from grpojax.jobs.sft import sft_job
from grpojax.sampling import SamplingConfig, decode_completions, generate

STUDENT = dict(
    num_layers=2, hidden_size=128, intermediate_size=384, num_heads=4, num_kv_heads=2, head_dim=32
)
METHODS = ("distill", "sft_teacher", "grpo")

# --quick: every run this small (the teacher's too, on top of the main job's config).
QUICK = [
    "sft.steps=4",
    "sft.batch_size=8",
    "data.size=64",
    "rollout.prompts_per_step=4",
    "grpo.group_size=2",
    "eval.heldout_size=2",
    "eval.batch_size=2",
    "eval.k=2",
    "log.plot=false",
    "log.tensorboard=false",
    "optimizer.warmup_steps=0",
]


def say(line: str = "") -> None:
    print(line, flush=True)


def driver_print(tag: str):
    return lambda s: say(f"  [{tag}] {s}")


def config(base: pathlib.Path, run_dir: pathlib.Path, seed: int, extra) -> RunConfig:
    """The main job's config (`base`, its YAML) with `seed`, `log.run_dir` and `extra`."""
    return load_config(base, [f"seed={seed}", f"log.run_dir={run_dir}", *extra])


def teacher_policy(path: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path | None]:
    """(the teacher's Hugging Face directory, its run directory or None) of `--teacher`."""
    if (path / "config.json").is_file():
        return path, None
    if (path / "hf" / "config.json").is_file():
        return path / "hf", path
    raise SystemExit(f"--teacher {path}: neither a Hugging Face directory nor a run with hf/")


def train_teacher(base, out, quick) -> pathlib.Path:
    """The main job (seed 0) into `<out>/teacher`; its final policy is `<out>/teacher/hf`.
    With `quick`: `grpojax sft` of `QUICK`'s warm start on a random student-sized model,
    `<out>/teacher/sft_model`."""
    run_dir = out / "teacher"
    if quick:  # the student's architecture: its compiled programs serve both
        source = student_init(out, 100)
        cfg = config(base, run_dir, 0, [*QUICK, f"model.source={source}"])
        r = sft_job(cfg, show_progress=False, print_fn=driver_print("teacher"))
        say(f"  [teacher] quick SFT-only teacher: {r}")
        return run_dir / "sft_model"
    cfg = config(base, run_dir, 0, [])
    result = train(cfg, show_progress=False, print_fn=driver_print("teacher"))
    say("  [teacher] " + summary_line(result))
    return run_dir


def student_init(out: pathlib.Path, seed: int) -> pathlib.Path:
    path = out / f"student_init_seed{seed}"
    cfg = gm.tiny_config(**STUDENT)
    gm.save_pretrained(gm.Decoder(cfg, rngs=nnx.Rngs(seed)), path, tokenizer=gm.builtin_tokenizer())
    return path


def greedy_completions(model, tokenizer, prompts, max_new_tokens, mesh):
    """The greedy completions of `model` (texts without the stop token, and whether each
    ended with EOS inside the budget), one `generate` call."""
    pad_id = pad_id_of(tokenizer)
    tokens, lengths = encode_prompts(tokenizer, prompts, add_special_tokens=True, pad_id=pad_id)
    ro = generate(
        model,
        tokens,
        lengths,
        key=jax.random.key(0),  # unused by greedy decoding
        max_new_tokens=max_new_tokens,
        sampling=SamplingConfig(temperature=0.0),
        eos_ids=stop_ids_of(tokenizer),
        pad_id=pad_id,
        mesh=mesh,
    )
    host = [np.asarray(x) for x in (ro.tokens_nt, ro.lengths_n, ro.eos_found_n)]
    return decode_completions(tokenizer, *host), host[2].astype(bool)


def run_sft_teacher(cfg: RunConfig, teacher_dir: pathlib.Path, k: int) -> dict:
    """`sft_teacher` (module docstring), laid out as `train` lays out a run: start-up, the
    gold SFT warm start, held-out evaluation, K SFT steps on the teacher's greedy outputs,
    held-out evaluation; also the teacher's own held-out evaluation with this seed's key."""
    t0 = time.perf_counter()
    run = start_run(cfg, run_dir=pathlib.Path(cfg.log.run_dir), check_prompts=True)
    manager = build_reward_manager(cfg)
    try:
        run_eval = heldout_evaluator(
            cfg, run.tokenizer, run.heldout_rows, manager, mesh=run.mesh, show_progress=False
        )
        run_sft(run.model, run.tokenizer, run.train_rows, cfg, mesh=run.mesh, show_progress=False)
        before = run_eval(run.model, "before")
        say(f"  [sft_teacher] held-out before: pass@1 {before['pass@1']:.3f}")

        # The prompts the RL methods draw in their K steps, labelled by the teacher.
        b = cfg.rollout.prompts_per_step
        source = prompt_source(cfg, run.train_rows, run.tokenizer)
        rows = [dict(r) for _ in range(k) for r in source.next_rows(b)]
        teacher = gm.from_pretrained(teacher_dir, dtype=cfg.model.dtype, mesh=run.mesh)
        t = cfg.rollout.max_new_tokens
        texts, ended = greedy_completions(
            teacher, run.tokenizer, [r["prompt"] for r in rows], t, run.mesh
        )
        scores = manager.compute(
            [r["prompt"] for r in rows], texts, answer=[r["answer"] for r in rows]
        ).per_fn[manager.names[0]]
        label_acc = float(np.mean(np.nan_to_num(scores, nan=0.0)))
        # A completion that used the whole budget without EOS cannot take the EOS that
        # SFT appends: it keeps its first T - 1 tokens (the built-in tokenizer is one
        # character per token). Counted and printed.
        unended = int((~ended).sum())
        for r, text, e in zip(rows, texts, ended, strict=True):
            r["completion"] = text if e else text[: t - 1]
        say(
            f"  [sft_teacher] {len(rows)} teacher greedy labels ({k} steps x {b} prompts): "
            f"{label_acc:.3f} correct, {unended} without EOS in {t} tokens"
        )
        teacher_eval = run_eval(teacher, "teacher")
        say(f"  [sft_teacher] teacher on this seed's held-out: pass@1 {teacher_eval['pass@1']:.3f}")
        del teacher

        cfg2 = dataclasses.replace(cfg, sft=dataclasses.replace(cfg.sft, steps=k, batch_size=b))
        last, _ = run_sft(run.model, run.tokenizer, rows, cfg2, mesh=run.mesh, show_progress=False)
        after = run_eval(run.model, "after")
        say(f"  [sft_teacher] held-out after: pass@1 {after['pass@1']:.3f}")
    finally:
        manager.close()
    wall = time.perf_counter() - t0
    summary = {
        "eval_before": before,
        "eval_after": after,
        "teacher_eval": teacher_eval,
        "teacher_label_accuracy": label_acc,
        "teacher_labels_without_eos": unended,
        "sft_teacher_steps": k,
        "sft_teacher_batch_size": b,
        "final_sft_loss": last.get("loss"),
        "wall_s": wall,
    }
    (run.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return {"before": before, "after": after, "wall_s": wall, "teacher": teacher_eval}


def run_rl(cfg: RunConfig, tag: str) -> dict:
    result = train(cfg, show_progress=False, print_fn=driver_print(tag))
    return {"before": result.eval_before, "after": result.eval_after, "wall_s": result.wall_s}


def fmt(x: float) -> str:
    return "nan" if x is None or math.isnan(x) else f"{x:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/distill-experiment"))
    parser.add_argument("--teacher", type=pathlib.Path, default=None)
    parser.add_argument("--steps", type=int, default=None, help="K steps per method (60)")
    parser.add_argument("--seeds", default=None, help="0,1 (--quick: 0)")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    k = args.steps if args.steps is not None else (2 if args.quick else 60)
    seeds = [int(s) for s in (args.seeds or ("0" if args.quick else "0,1")).split(",")]
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    base = out / "main_job.yaml"
    base.write_text(default_yaml())  # the main job's embedded default
    t_all = time.perf_counter()
    cache = enable_compilation_cache()  # as `grpojax train` does

    say(f"machine: {machine()}")
    say(f"date: {datetime.datetime.now().isoformat(timespec='seconds')}")
    say(f"JAX compilation cache: {cache}")
    say("load average at start (1/5/15 min): " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    tcfg, scfg = gm.tiny_config(), gm.tiny_config(**STUDENT)
    say(
        f"teacher: built-in tiny model, {tcfg.num_layers} layers x {tcfg.hidden_size}, "
        f"{tcfg.num_params():,} params; student: {scfg.num_layers} layers x "
        f"{scfg.hidden_size}, {scfg.num_params():,} params; K = {k} steps per method, "
        f"seeds {seeds}{', --quick' if args.quick else ''}"
    )

    if args.teacher is None:
        say(f"teacher: training the main job (seed 0) into {out / 'teacher'}")
        teacher_run = train_teacher(base, out, args.quick)
        teacher_dir, teacher_run = teacher_policy(teacher_run)
    else:
        teacher_dir, teacher_run = teacher_policy(args.teacher.resolve())
        say(f"teacher: reusing {teacher_dir}")
    if teacher_run is not None and (teacher_run / "summary.json").is_file():
        s = json.loads((teacher_run / "summary.json").read_text())
        say(
            f"teacher run: held-out pass@1 {fmt(s['eval_before']['pass@1'])} after its warm "
            f"start -> {fmt(s['eval_after']['pass@1'])} after GRPO (seed 0's held-out split)"
        )

    common = ["log.export_hf=false", f"total_steps={k}", *(QUICK if args.quick else [])]
    extra = {
        "distill": ["algo=distill", f"distill.teacher={teacher_dir}"],
        "grpo": ["algo=grpo"],
        "sft_teacher": ["algo=grpo"],
    }
    results: dict[tuple[str, int], dict] = {}
    teacher_success: dict[int, float] = {}
    for seed in seeds:
        source = student_init(out, seed)
        for method in METHODS:
            run_dir = out / f"seed{seed}" / method
            cfg = config(base, run_dir, seed, [f"model.source={source}", *common, *extra[method]])
            say(f"run: {method}, seed {seed} -> {run_dir}")
            if method == "sft_teacher":
                r = run_sft_teacher(cfg, teacher_dir, k)
                teacher_success[seed] = r["teacher"]["pass@1"]
            else:
                r = run_rl(cfg, f"{method}")
            results[method, seed] = r
            say(
                f"  -> {method} seed {seed}: {fmt(r['before']['pass@1'])} -> "
                f"{fmt(r['after']['pass@1'])} in {r['wall_s']:.1f}s"
            )
        befores = {m: results[m, seed]["before"] for m in METHODS}
        same = all(b == befores[METHODS[0]] for b in befores.values())
        say(
            f"warm start, seed {seed}: held-out evaluation before the methods' steps "
            f"{'identical across methods' if same else 'DIFFERS across methods'}: "
            + ", ".join(f"{m} {fmt(b['pass@1'])}" for m, b in befores.items())
        )

    say()
    say(f"{'method':<12} {'seed':>4} {'success_before':>15} {'success_after':>14} "
        f"{'gain':>7} {'wall_s':>8}")  # fmt: skip
    gains: dict[str, list[float]] = {m: [] for m in METHODS}
    for method in METHODS:
        for seed in seeds:
            r = results[method, seed]
            b, a = r["before"]["pass@1"], r["after"]["pass@1"]
            gains[method].append(a - b)
            say(f"{method:<12} {seed:>4} {b:>15.3f} {a:>14.3f} {a - b:>+7.3f} {r['wall_s']:>8.1f}")
    for seed in seeds:
        say(f"{'teacher':<12} {seed:>4} {'':>15} {teacher_success[seed]:>14.3f} {'':>7} {'':>8}")
    say()
    say("load average at end (1/5/15 min): " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    say(f"total wall time: {time.perf_counter() - t_all:.1f}s")
    start = float(np.mean([results["distill", s]["before"]["pass@1"] for s in seeds]))
    say(
        f"distill: distill_gain={fmt(float(np.mean(gains['distill'])))} "
        f"sft_gain={fmt(float(np.mean(gains['sft_teacher'])))} "
        f"grpo_gain={fmt(float(np.mean(gains['grpo'])))} "
        f"teacher_success={fmt(float(np.mean(list(teacher_success.values()))))} "
        f"student_start={fmt(start)}"
    )


if __name__ == "__main__":
    main()
