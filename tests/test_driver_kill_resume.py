"""`grpojax train` killed at any moment and resumed == the uninterrupted run, bit for bit.

The driver's test hook (`grpojax.distributed.kill_point`, `GRPOJAX_TEST_KILL_AT`) makes
the run signal itself at a named moment, so each case hits its moment every time instead of
racing a timer: mid-SFT, during an SFT checkpoint write, during RL checkpoint 0's write (the
SFT -> RL hand-off), right after RL checkpoint 0, mid-RL, during an RL checkpoint write and
during the final evaluation; each with SIGKILL to the process group and with SIGTERM (a
graceful stop, except in the final evaluation, which SIGTERM ends). After the kill,
`grpojax train --resume` finishes the run; every RL checkpoint (parameters, optimizer state,
RNG keys, data position, counters), every logged metric but timings (rewards included) and
the summary must equal those of one uninterrupted run (shared by all cases).

Runs are small (a 1-layer model, 4 SFT and 3 RL steps, a checkpoint every step, asynchronous
writes as in a real run) and start from a warm fork server (`cli_forkserver`), except the
uninterrupted run, a fresh process with PyTorch hidden, whose stderr must stay empty: no
library noise (transformers' "PyTorch was not found", Orbax's "Exception ignored") in a
normal run.
"""

import json
import os
import pathlib
import signal
import subprocess
import sys

import jax
import pytest

from grpojax.config import load_config
from grpojax.distributed import KILL_AT_ENV
from grpojax.driver.checkpoint import Checkpointer, host_copy, saved_steps
from grpojax.driver.setup import build_mesh, build_model
from grpojax.driver.trainer import checkpoint_target, make_trainer

REPO = pathlib.Path(__file__).resolve().parents[1]
TOTAL_STEPS = 3

MOMENTS = {
    "mid_sft": "sft_step:3",  # SFT checkpoint 1 complete (2 may be): something to resume
    "sft_save": "sft_save:2",
    "handoff": "rl_save:0",
    "after_rl_ckpt0": "rl_ckpt0",
    "mid_rl": "rl_step:2",
    "rl_save": "rl_save:2",
    "final_eval": "final_eval",
}

# Importing transformers without PyTorch is what prints "PyTorch was not found"; the test
# machines have PyTorch (for the parity tests), so the uninterrupted run hides it.
HIDE_TORCH = """
import importlib.util, sys
_find_spec = importlib.util.find_spec
def find_spec(name, *args, **kwargs):
    return None if name.split(".")[0] == "torch" else _find_spec(name, *args, **kwargs)
importlib.util.find_spec = find_spec
from grpojax.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _args(model_dir, run_dir):
    over = {
        "model.source": model_dir,
        "log.run_dir": run_dir,
        "log.tensorboard": "false",
        "log.plot": "false",
        "data.size": 200,
        "rollout.prompts_per_step": 2,
        "rollout.max_new_tokens": 4,
        "rollout.engine": "continuous",  # auto picks static at T 4
        "rollout.slots": 3,
        "grpo.group_size": 4,
        "sft.steps": 4,
        "sft.batch_size": 4,
        "total_steps": TOTAL_STEPS,
        "optimizer.warmup_steps": 1,
        "eval.heldout_size": 2,
        "eval.batch_size": 2,
        "eval.k": 1,
        "checkpoint.every": 1,
        "checkpoint.keep": TOTAL_STEPS + 2,
        "rewards.num_workers": 1,
    }
    return ["train", "--no-progress", *(f"{k}={v}" for k, v in over.items())]


@pytest.fixture(scope="module")
def reference(small_model_dir, tmp_path_factory):
    """One uninterrupted run (a fresh process, PyTorch hidden): its run directory."""
    tmp = tmp_path_factory.mktemp("reference")
    run_dir = tmp / "run"
    proc = subprocess.run(
        [sys.executable, "-c", HIDE_TORCH, *_args(small_model_dir, run_dir)],
        cwd=tmp,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return run_dir, proc


@pytest.fixture(scope="module")
def restore_target(reference):
    """(abstract arrays, shardings) of the runs' RL checkpoints, from the run's config."""
    cfg = load_config(reference[0] / "config.yaml")
    mesh = build_mesh(cfg)
    model, _ = build_model(cfg, mesh=mesh)
    return checkpoint_target(make_trainer(cfg, model, mesh), mesh)


@pytest.fixture(scope="module")
def expected(reference, restore_target):
    """What every resumed run must end with: the uninterrupted run's checkpoints, metrics
    and summary."""
    run_dir = reference[0]
    summary = json.loads((run_dir / "summary.json").read_text())
    return _checkpoints(run_dir, restore_target), _metrics(run_dir), summary


def _bits(tree):
    leaves, treedef = jax.tree.flatten(host_copy(tree))
    return treedef, [(x.dtype.str, x.shape, x.tobytes()) for x in leaves]


def _checkpoints(run_dir, target):
    abstract, shardings = target
    steps = saved_steps(run_dir / "checkpoints")
    with Checkpointer(run_dir / "checkpoints", async_save=False) as ckpt:
        out = {}
        for step in steps:
            r = ckpt.restore(step, abstract, shardings=shardings)
            driver = {k: v for k, v in r.driver_state.items() if k != "config"}
            out[step] = (_bits(r.state), driver)
    return out


def _metrics(run_dir):
    """Every logged value but timings, by step."""
    timing = ("time", "elapsed_s", "step_time_s", "tokens_per_s")
    out = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out.append({k: v for k, v in rec.items() if k not in timing and not k.startswith("time/")})
    return out


def test_uninterrupted_run_prints_no_library_noise(reference):
    run_dir, proc = reference
    assert proc.stderr == "", proc.stderr  # no "PyTorch was not found", no "Exception ignored"
    assert proc.stdout.strip().splitlines()[-1].startswith("grpojax train: success_before=")
    assert saved_steps(run_dir / "checkpoints") == list(range(TOTAL_STEPS + 1))


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGKILL", "SIGTERM"])
@pytest.mark.parametrize("moment", list(MOMENTS))
def test_killed_and_resumed_equals_uninterrupted(
    moment, sig, cli_server, expected, restore_target, small_model_dir, tmp_path
):
    want, want_metrics, want_summary = expected
    run_dir = tmp_path / "run"
    env = {KILL_AT_ENV: f"{MOMENTS[moment]}:{sig}"}
    first = cli_server.run(_args(small_model_dir, run_dir), cwd=tmp_path, env=env)
    log = f"first run:\n{first.stdout}\n{first.stderr}"
    if sig == "SIGKILL":
        assert first.returncode == -signal.SIGKILL, log
    elif moment == "final_eval":  # past the graceful stop: SIGTERM ends the process
        assert first.returncode == -signal.SIGTERM, log
    else:  # the step in flight finishes, is saved, exit 0
        assert first.returncode == 0 and "stopped by SIGTERM" in first.stdout, log
    resumed = cli_server.run(
        ["train", "--no-progress", "--resume", f"log.run_dir={run_dir}"], cwd=tmp_path
    )
    log += f"\nresumed run:\n{resumed.stdout}\n{resumed.stderr}"
    assert resumed.returncode == 0, log

    got = _checkpoints(run_dir, restore_target)
    assert sorted(got) == sorted(want) == list(range(TOTAL_STEPS + 1)), log
    for step in want:
        assert got[step][1] == want[step][1], f"driver state of checkpoint {step}\n{log}"
        (tree_got, leaves_got), (tree_want, leaves_want) = got[step][0], want[step][0]
        assert tree_got == tree_want, f"checkpoint {step}\n{log}"
        differ = [i for i, (a, b) in enumerate(zip(leaves_got, leaves_want)) if a != b]
        assert not differ, f"checkpoint {step}: leaves {differ} differ\n{log}"
    assert _metrics(run_dir) == want_metrics, log
    assert json.loads((run_dir / "summary.json").read_text()) == want_summary, log
    # Nothing left behind: the warm start's checkpoints go once RL checkpoint 0 exists, and
    # the resumed run removed any checkpoint write the kill cut short.
    assert not (run_dir / "checkpoints-sft").exists(), log
    assert not list(run_dir.glob("checkpoints*/*.orbax-checkpoint-tmp*")), log
