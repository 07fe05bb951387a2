"""Bit-identical runs across a change of the driver: the same configs run by two checkouts,
compared array by array on the final checkpoints and line by line on `metrics.jsonl`.

    # each checkout runs every case into its own folder, from its own folder (the current
    # directory comes first on sys.path, before an editable install)
    cd /path/to/old && PYTHONPATH=. python /path/to/new/experiments/studies/driver_equivalence.py \
        run --out /tmp/eq/old
    cd /path/to/new && python experiments/studies/driver_equivalence.py run --out /tmp/eq/new \
        --resume-from /tmp/eq/old
    python experiments/studies/driver_equivalence.py compare /tmp/eq/old /tmp/eq/new

The cases are the issue's list (a few RL steps each, float32, one process): the main job
shortened, PPO, one step of staleness interleaved and split (`mesh.rollout_devices`, two
fake devices), a multi-turn run in decode slots, on-policy distillation, LoRA, packed rows,
dynamic sampling. `resume` is a run stopped after 2 of 4 steps: with `--resume-from`, the
checkpoint the *other* checkout wrote is copied and resumed by this one (the checkpoint
layout across the change), and compared with the other checkout's uninterrupted run.

Compared: every leaf of the newest RL checkpoint's arrays (`np.array_equal`: bit for bit,
NaN equal to NaN), its JSON (driver state and metadata), and every metric but the
wall-clock ones (`CLOCK`, the reward workers' seconds), which must be equal floats; the
config record's derived fields (`DERIVED`) are left out. Ends with one
`driver_equivalence: cases=... identical=... differing=...` line.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time
import warnings

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
# The config record in a checkpoint's JSON: before issue 55 the GRPO fields a run derives
# (distillation's divergence and weights, staleness's correction) were written into the
# saved `grpo` section; after, the section is saved as given and the values are derived
# again by `RunConfig.step_config`. Those paths may differ; the step they give may not.
DERIVED = (
    *(
        f".driver.config.grpo.{k}"
        for k in ("beta", "pg_coef", "kl_divergence", "kl_jsd_beta", "rollout_correction_mode")
    ),
    ".driver.config.checkpoint.resume",  # and how the run was started: True once resumed
)
CLOCK = ("time", "time/", "elapsed_s", "step_time_s", "tokens_per_s", "wall_s")

# name -> (overrides, fake devices); the small model is written by `_models`.
SMALL = {
    "data.name": "chain3",
    "data.size": "200",
    "rollout.prompts_per_step": "2",
    "rollout.max_new_tokens": "4",
    "grpo.group_size": "4",
    "optimizer.learning_rate": "1e-3",
    "eval.heldout_size": "4",
    "eval.batch_size": "4",
    "eval.k": "2",
    "checkpoint.every": "1",
    "checkpoint.async_save": "false",
    "rewards.mode": "thread",
    "sft.steps": "0",
    "total_steps": "3",
    "log.tensorboard": "false",
    "log.plot": "false",
    "log.export_hf": "false",
    "log.progress": "false",
}
ENV = {  # tests/custom_envs.py's short-turn environment on the arithmetic rows
    "env.name": "custom_envs:ShortTurnsEnv",
    "rollout.max_new_tokens": "16",
    "env.max_turn_tokens": "4",
    "rollout.engine": "continuous",
    "rollout.slots": "3",
}
CASES: dict[str, tuple[dict, int]] = {
    "main": (
        {
            "total_steps": "3",
            "sft.steps": "20",
            "rollout.prompts_per_step": "8",
            "eval.heldout_size": "16",
            "checkpoint.every": "1",
            "checkpoint.async_save": "false",
            "log.progress": "false",
            "log.export_hf": "false",
        },
        1,
    ),
    "ppo": ({**SMALL, "algo": "ppo"}, 1),
    "stale1": ({**SMALL, "rollout.max_staleness": "1"}, 1),
    "stale1_split": ({**SMALL, "rollout.max_staleness": "1", "mesh.rollout_devices": "1"}, 2),
    "episodes_slots": ({**SMALL, **ENV}, 1),
    "distill": ({**SMALL, "algo": "distill", "distill.teacher": "{teacher}"}, 1),
    "lora": ({**SMALL, "lora.rank": "4"}, 1),
    "packed": ({**SMALL, "packing.mode": "always", "rollout.max_new_tokens": "8"}, 1),
    "dynamic": ({**SMALL, "algo": "dapo", "rollout.max_resample_rounds": "2"}, 1),
    "overlap_off": ({**SMALL, "rollout.overlap_rewards": "false"}, 1),
    "resume": ({**SMALL, "total_steps": "4"}, 1),
}


def _models(out: pathlib.Path) -> dict[str, str]:
    """A 1-layer policy and a 2-layer teacher (the built-in tokenizer), written once."""
    from flax import nnx

    import grpojax.models as gm

    paths = {}
    for name, (layers, seed) in {"model": (1, 0), "teacher": (2, 5)}.items():
        path = out / name
        if not (path / "config.json").exists():
            cfg = gm.tiny_config(
                hidden_size=32,
                intermediate_size=64,
                num_layers=layers,
                num_heads=2,
                num_kv_heads=1,
                head_dim=16,
            )
            gm.save_pretrained(
                gm.Decoder(cfg, rngs=nnx.Rngs(seed)), path, tokenizer=gm.builtin_tokenizer()
            )
        paths[name] = str(path)
    return paths


def _case_child(name: str, run_dir: str, models: dict, stop_after: int | None, resume: bool):
    """Runs in a child process (fake devices are set before JAX starts)."""
    from grpojax.config import load_config
    from grpojax.driver.loop import train

    over, _ = CASES[name]
    over = {k: v.format(**models) for k, v in over.items()}
    if name != "main":
        over["model.source"] = models["model"]
    over["log.run_dir"] = run_dir
    if resume:
        over["checkpoint.resume"] = "true"
    cfg = load_config(None, [f"{k}={v}" for k, v in over.items()])
    train(cfg, show_progress=False, print_fn=lambda s: None, stop_after=stop_after)


def _run_case(name: str, out: pathlib.Path, models: dict, resume_from: pathlib.Path | None):
    devices = CASES[name][1]
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")

    def child(run_dir: pathlib.Path, stop_after=None, resume=False):
        code = (
            "import sys, json; sys.path[:0] = %r; import driver_equivalence as d; "
            "d._case_child(*json.loads(sys.argv[1]))" % [str(HERE), str(HERE.parents[1] / "tests")]
        )
        args = json.dumps([name, str(run_dir), models, stop_after, resume])
        subprocess.run([sys.executable, "-c", code, args], env=env, check=True)

    run_dir = out / name
    shutil.rmtree(run_dir, ignore_errors=True)
    t0 = time.perf_counter()
    child(run_dir)
    if name == "resume":  # stopped after 2 of 4 steps, then resumed
        half = out / "resume_half"
        shutil.rmtree(half, ignore_errors=True)
        if resume_from is None:
            child(half, stop_after=2)
            stopped = out / "resume_half_stopped"  # kept for the other checkout to resume
            shutil.rmtree(stopped, ignore_errors=True)
            shutil.copytree(half, stopped)
        else:  # the other checkout's checkpoint, resumed by this one
            shutil.copytree(resume_from / "resume_half_stopped", half)
        child(half, resume=True)
    return time.perf_counter() - t0


def _metrics(run_dir: pathlib.Path) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not _clock(k)} for r in rows]


def _clock(key: str) -> bool:
    """A wall-clock figure (or the run's own folder): never equal across two runs."""
    return key in CLOCK or key.startswith("time/") or key.endswith(("handover_s", "time_s"))


def _without_clock(tree):
    """A JSON tree without its wall-clock figures and run folder (`_clock`)."""
    if isinstance(tree, dict):
        return {k: _without_clock(v) for k, v in tree.items() if not _clock(k) and k != "run_dir"}
    if isinstance(tree, list):
        return [_without_clock(v) for v in tree]
    return tree


def _arrays(run_dir: pathlib.Path) -> dict[str, np.ndarray]:
    """The newest RL checkpoint's arrays, by path, read with Orbax's own metadata."""
    import orbax.checkpoint as ocp

    ckpt = run_dir / "checkpoints"
    step = max(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())
    items = [p for p in (ckpt / str(step)).iterdir() if p.is_dir()]
    out = {}
    with ocp.PyTreeCheckpointer() as ck, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # restored without target shardings: host arrays
        for item in items:
            try:
                tree = ck.restore(item)
            except Exception:  # a JSON item (the driver's state): compared as metrics are
                continue
            flat = _flatten(tree, item.name)
            out.update(flat)
    return out


def _flatten(tree, prefix: str) -> dict[str, np.ndarray]:
    out = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.update(_flatten(v, f"{prefix}/{k}"))
    elif isinstance(tree, list | tuple):
        for i, v in enumerate(tree):
            out.update(_flatten(v, f"{prefix}/{i}"))
    elif tree is not None:
        out[prefix] = np.asarray(tree)
    return out


def _driver_json(run_dir: pathlib.Path) -> dict:
    ckpt = run_dir / "checkpoints"
    step = max(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())
    return {
        name: _without_clock(json.loads((ckpt / str(step) / name / "metadata").read_text()))
        for name in ("driver", "meta")
    }


def _json_diffs(a, b, path: str = "") -> list[str]:
    """The paths at which two JSON trees differ, with both values."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [
            d
            for k in sorted(a.keys() | b.keys())
            for d in _json_diffs(a.get(k), b.get(k), f"{path}.{k}")
        ]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _json_diffs(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} vs {b!r}"]


def compare_runs(a: pathlib.Path, b: pathlib.Path) -> list[str]:
    """What differs between two run directories (empty: bit-identical)."""
    diffs = []
    ma, mb = _metrics(a), _metrics(b)
    if len(ma) != len(mb):
        diffs.append(f"metrics.jsonl: {len(ma)} vs {len(mb)} lines")
    for i, (ra, rb) in enumerate(zip(ma, mb)):
        if ra.keys() != rb.keys():
            diffs.append(f"metrics line {i}: keys differ: {sorted(ra.keys() ^ rb.keys())}")
        for k in ra.keys() & rb.keys():
            if ra[k] != rb[k] and not (ra[k] != ra[k] and rb[k] != rb[k]):  # NaN == NaN
                diffs.append(f"metrics line {i}: {k} {ra[k]!r} vs {rb[k]!r}")
    xa, xb = _arrays(a), _arrays(b)
    if xa.keys() != xb.keys():
        diffs.append(f"checkpoint leaves differ: {sorted(xa.keys() ^ xb.keys())[:8]}")
    for k in sorted(xa.keys() & xb.keys()):
        if xa[k].shape != xb[k].shape or not np.array_equal(xa[k], xb[k], equal_nan=True):
            diffs.append(f"checkpoint {k}: differs")
    for d in _json_diffs(_driver_json(a), _driver_json(b)):
        if not d.startswith(DERIVED):
            diffs.append(f"checkpoint JSON {d}")
    if not xa:
        diffs.append("no checkpoint arrays read")
    return diffs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", required=True, type=pathlib.Path)
    r.add_argument("--cases", default=",".join(CASES))
    r.add_argument("--resume-from", type=pathlib.Path, default=None)
    c = sub.add_parser("compare")
    c.add_argument("a", type=pathlib.Path)
    c.add_argument("b", type=pathlib.Path)
    c.add_argument("--cases", default=",".join(CASES))
    args = p.parse_args(argv)
    cases = args.cases.split(",")
    if args.cmd == "run":
        args.out.mkdir(parents=True, exist_ok=True)
        import grpojax

        print(f"grpojax from {pathlib.Path(grpojax.__file__).parent}")
        models = _models(args.out.parent)
        for name in cases:
            s = _run_case(name, args.out, models, args.resume_from)
            print(f"{name}: {s:.1f}s", flush=True)
        return 0
    print("| case | identical | first differences |\n| --- | --- | --- |")
    same = []
    for name in cases:
        diffs = compare_runs(args.a / name, args.b / name)
        if name == "resume":  # the resumed run against the uninterrupted one
            diffs += [f"resumed: {d}" for d in compare_runs(args.a / name, args.b / "resume_half")]
        same.append(not diffs)
        print(f"| {name} | {'yes' if not diffs else 'NO'} | {'; '.join(diffs[:3])} |")
    print(
        f"driver_equivalence: cases={len(cases)} identical={sum(same)} "
        f"differing={len(cases) - sum(same)}"
    )
    return 0 if all(same) else 1


if __name__ == "__main__":
    sys.exit(main())
