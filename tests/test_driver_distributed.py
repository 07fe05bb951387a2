"""`grpojax train` across processes: 2 processes x 2 fake CPU devices (gloo collectives)
against 1 process x 4 devices, resume from 2 processes into 1 and from 1 into 2 and a stop
request on one process only, in one test so that the uninterrupted reference run is paid
for once; pipelined rollouts (`rollout.max_staleness`) across processes, interleaved and
split, with a process lost in a weight transfer; and `grpojax sft` across processes."""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from multidevice import free_port, xla_flags
from safetensors.numpy import load_file

from grpojax.distributed import KILL_AT_ENV

REPO = pathlib.Path(__file__).resolve().parents[1]
# A cross-process all-reduce (gloo) sums in another order than XLA's in-process one; the
# programs are otherwise the same, so gradients agree to float32 rounding. Adam with a tiny
# epsilon would turn that rounding, at coordinates whose exact gradient is ~0, into steps of
# the learning rate's size (m / sqrt(v) = +-1) and compare the optimizer, not the pipeline:
# these runs use Adam's eps = 1 for RL (an update ~ lr * g) and an SFT rate of 1e-7, so
# the arrays agree to rounding and the per-step rewards exactly.
PARAM_ATOL = 1e-6
# The runs' rewards, written beside them (the processes' working directory, on their
# sys.path). Any verifier scores a random model's completions 0: no reward, advantage or
# pass@k to compare, and every group dropped by dynamic sampling. `digest` (the reward,
# weight 1) is 1 for an eighth of the (prompt, completion) texts, 0.5 for another eighth,
# else 0, so about a third of the groups have zero variance; `heldout` (weight 0: the first
# reward, so the held-out score) is 0, 1/3, 2/3 or 1, so that the greedy pass@1 of 8 prompts
# is not 0 too. A completion scored against another row's prompt shows in both.
REWARD_MODULE = "digest_reward"
REWARD_SOURCE = """import zlib


def _codes(prompts, completions, salt, n):
    return [zlib.crc32(f"{p}\\x00{c}".encode(), salt) % n for p, c in zip(prompts, completions)]


def digest(prompts, completions, **_):
    return [{0: 1.0, 1: 0.5}.get(r, 0.0) for r in _codes(prompts, completions, 0, 8)]


def heldout(prompts, completions, **_):
    return [r / 3 for r in _codes(prompts, completions, 1, 4)]
"""


def _overrides(model_dir, run_dir, **extra):
    base = {
        "model.source": str(model_dir),
        "log.run_dir": str(run_dir),
        "data.size": "200",
        "rollout.prompts_per_step": "4",
        "rollout.max_new_tokens": "4",
        "grpo.group_size": "4",
        "grpo.beta": "0.04",
        "eval.heldout_size": "8",
        "eval.batch_size": "8",
        "eval.k": "2",
        "checkpoint.every": "1",
        "checkpoint.keep": "10",
        "checkpoint.async_save": "false",
        "rewards.mode": "thread",
        "rewards.names": "[]",
        "rewards.functions": f"[{REWARD_MODULE}:heldout,{REWARD_MODULE}:digest]",
        "rewards.weights": "[0.0,1.0]",
        "sft.steps": "2",
        "sft.batch_size": "8",
        "total_steps": "3",
        "optimizer.learning_rate": "1e-2",
        "optimizer.eps": "1.0",
        "sft.learning_rate": "1e-7",
        "optimizer.warmup_steps": "1",
        # fsdp over all 4 devices: with 2 processes the parameters are sharded across them.
        "mesh.data": "1",
        "mesh.fsdp": "4",
        "rollout.dynamic_sampling": "true",
        "rollout.max_resample_rounds": "2",
        # The continuous engine (auto picks static at T 4): one queue per process's shard.
        "rollout.engine": "continuous",
        "rollout.slots": "4",
        "sampling.temperature": "1.0",
    }
    base.update({k: str(v) for k, v in extra.items()})
    return [f"{k}={v}" for k, v in base.items()]


def _launch(
    nproc: int, args: list[str], cwd, *, command="train", resume=False, heartbeat=120, kill_at=None
):
    """Start `grpojax <command>` as `nproc` processes of 4 // nproc CPU devices each.

    `heartbeat`: seconds without heartbeats before the coordination service declares a
    process lost. 120 where no process is lost: a CI run once saw both processes of a
    healthy run declared lost after a 30 s stall of the (shared) machine.

    `kill_at`: process index -> `GRPOJAX_TEST_KILL_AT` spec (grpojax.distributed.kill_point) for
    that process alone, so that it signals itself at a named moment of the run."""
    env = dict(os.environ)
    env.pop(KILL_AT_ENV, None)
    env.update(
        XLA_FLAGS=xla_flags(4 // nproc),
        JAX_PLATFORMS="cpu",
        PYTHONPATH=str(REPO),
        GRPOJAX_HEARTBEAT_S=str(heartbeat),
    )
    port = free_port()
    cmd = [sys.executable, "-m", "grpojax.cli", command, "--no-progress", *args]
    if resume:
        cmd.append("--resume")
    procs = []
    for i in range(nproc):
        if nproc > 1:
            env.update(
                JAX_COORDINATOR_ADDRESS=f"localhost:{port}",
                JAX_NUM_PROCESSES=str(nproc),
                JAX_PROCESS_ID=str(i),
            )
        env_i = dict(env)
        if kill_at and i in kill_at:
            env_i[KILL_AT_ENV] = kill_at[i]
        procs.append(
            subprocess.Popen(
                cmd, cwd=cwd, env=env_i, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
            )
        )
    return procs


def _finish(procs, timeout=600) -> list[str]:
    out = []
    for p in procs:
        try:
            out.append(p.communicate(timeout=timeout)[0].decode())
        finally:
            if p.poll() is None:
                p.kill()
    return out


def _run(nproc, args, cwd, **kw) -> list[str]:
    procs = _launch(nproc, args, cwd, **kw)
    logs = _finish(procs)
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)
    return logs


def _rewards(run_dir) -> list[tuple[int, float]]:
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    by_step = {r["step"]: r["reward_mean"] for r in recs if "reward_mean" in r}
    return sorted(by_step.items())


def _final_arrays(run_dir) -> list[np.ndarray]:
    ck = run_dir / "checkpoints"
    last = max(int(p.name) for p in ck.iterdir() if p.name.isdigit())
    path = str(ck / str(last) / "state")
    c = ocp.PyTreeCheckpointer()
    meta = c.metadata(path)
    meta = getattr(getattr(meta, "item_metadata", meta), "tree", meta)
    args = jax.tree.map(lambda m: ocp.RestoreArgs(restore_type=np.ndarray), meta)
    return [np.asarray(x) for x in jax.tree.leaves(c.restore(path, restore_args=args))]


def _lags(run_dir) -> list[tuple[int, float]]:
    """[(step, staleness/max)] of a pipelined run's steps (the version lag it trained)."""
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return sorted({(r["step"], r["staleness/max"]) for r in recs if "staleness/max" in r})


def _assert_same_run(a, b):
    assert _rewards(a) == _rewards(b)
    xs, ys = _final_arrays(a), _final_arrays(b)
    assert len(xs) == len(ys)
    worst = 0.0
    for i, (x, y) in enumerate(zip(xs, ys)):
        if x.dtype.kind == "f":
            d = float(np.max(np.abs(x.astype(np.float64) - y), initial=0.0))
            if d > PARAM_ATOL:
                print(f"leaf {i} {x.shape}: max abs difference {d:.3e}")
            worst = max(worst, d)
        else:  # step counters, keys, buffer tokens: exact
            np.testing.assert_array_equal(x, y)
    assert worst <= PARAM_ATOL, worst
    return worst


@pytest.mark.slow
def test_two_processes_equal_one_and_resume_from_two_into_one_and_one_into_two(
    small_model_dir, tmp_path
):
    """One run of 3 RL steps continued across process counts, against one uninterrupted
    1 x 4-device run; each interruption comes from the process itself at a named moment
    (GRPOJAX_TEST_KILL_AT), so no timing is raced:
    - 2 x 2 devices, fresh (SFT + step 1): process 1 alone gets SIGTERM after step 1, and
      both stop after step 1 and save; only process 0 evaluates and prints;
    - 1 process resumes the 2-process checkpoint (2 -> 1), SIGTERM after step 2, saves;
    - 2 processes resume the 1-process checkpoint (1 -> 2) and finish (only process 0
      reports);
    - `grpojax eval` of the finished run in 2 processes: only process 0 prints, and its
      pass@1, mean@k and pass@k equal, exactly, the 1-process run's own held-out evaluation
      after its last step (same step, prompts, eval key and settings).
    Per-step rewards equal the reference's exactly (each step ran in a different leg) and the
    final arrays (parameters, optimizer, keys, buffer) within PARAM_ATOL. The mesh is fsdp 4,
    so with 2 processes each holds half of every parameter; the end-of-run Hugging Face
    export of the run finished in 2 processes (gathered across them) equals the 1-process
    run's within the same bound."""
    (tmp_path / f"{REWARD_MODULE}.py").write_text(REWARD_SOURCE)
    one = tmp_path / "one"
    _run(1, _overrides(small_model_dir, one), tmp_path)

    run = tmp_path / "two_one_two"
    args = _overrides(small_model_dir, run)
    # 2 processes, fresh; a stop request on process 1 alone stops both after step 1.
    logs = _run(2, args, tmp_path, kill_at={1: "rl_step:1:SIGTERM"})
    assert "stopped by signal on another process after step 1" in logs[0], logs[0]
    assert "held-out before RL" in logs[0] and "held-out before RL" not in logs[1]
    # 2 -> 1: one process continues the 2-process checkpoint, stops after step 2.
    logs = _run(1, args, tmp_path, resume=True, kill_at={0: "rl_step:2:SIGTERM"})
    assert "resumed" in logs[0] and "at step 1" in logs[0], logs[0]
    assert "stopped by SIGTERM after step 2" in logs[0], logs[0]
    # 1 -> 2: two processes resume the 1-process checkpoint and complete the run.
    logs = _run(2, args, tmp_path, resume=True)
    assert "resumed" in logs[0] and "at step 2" in logs[0], logs[0]
    assert "grpojax train: success_before" in logs[0]  # process 0 reports ...
    assert "grpojax train: success_before" not in logs[1]  # ... and only process 0
    print("2 -> 1 -> 2 vs 1: max abs array difference", _assert_same_run(one, run))
    exported = [load_file(d / "hf" / "model.safetensors") for d in (one, run)]
    assert sorted(exported[0]) == sorted(exported[1])
    for name, x in exported[0].items():
        np.testing.assert_allclose(exported[1][name], x, rtol=0, atol=PARAM_ATOL, err_msg=name)
    # `grpojax eval` in 2 processes (the mesh is fsdp 4 again, each process scores its own
    # rows): the same figures as the 1-process run's evaluation after its last step, and as
    # the 2-process run's own evaluation of the same step before it exited.
    logs = _run(2, ["--run-dir", str(run)], tmp_path, command="eval")
    assert "grpojax eval: pass@1=" in logs[0], logs[0]
    assert "grpojax eval:" not in logs[1], logs[1]
    scores = json.loads((run / "eval-3.json").read_text())
    for ref in (one, run):
        after = json.loads((ref / "summary.json").read_text())["eval_after"]
        assert {k: scores[k] for k in after} == after, (ref.name, scores, after)
    assert f"pass@1={scores['pass@1']:.3f} mean@2={scores['mean@2']:.3f}" in logs[0], logs[0]
    print("2-process grpojax eval:", {k: scores[k] for k in ("pass@1", "mean@2", "pass@2")})


@pytest.mark.slow
def test_pipelined_rollouts_across_processes_interleaved_split_and_a_lost_transfer(
    small_model_dir, tmp_path
):
    """`rollout.max_staleness=1` (single-turn, the compacting engine), 3 RL steps, against
    1 process x 4 devices interleaved (fsdp 4) uninterrupted:
    - 2 processes x 2 devices, interleaved: process 1 alone gets SIGTERM after step 1;
      both stop and save (the checkpoint holds the queued round, its rows sharded across
      the 2 processes);
    - 2 processes, **split placement** (`mesh.rollout_devices=2`: each process trains on
      its first device, fsdp 2 across the two, and samples on its second, data 2 across
      the two; the weights gathered over the training devices and copied within each
      process, the rows back through the hosts): resumed; step 1's update done and
      checkpointed, process 1 is SIGKILLed as it starts the weight transfer of version 2:
      process 0 exits non-zero within 2 minutes with an error naming the lost task;
    - 1 process x 4 devices, split 2 + 2, resumes and completes the run.
    Per-step rewards and version lags equal the reference's exactly, the final arrays
    within PARAM_ATOL (split trains on fsdp 2, the reference on fsdp 4, and gloo sums in
    another order: rounding only)."""
    (tmp_path / f"{REWARD_MODULE}.py").write_text(REWARD_SOURCE)
    extra = {
        "rollout.max_staleness": 1,
        "rollout.dynamic_sampling": "false",
        # The compacting engine: its phases' host reads on every process, rows across them.
        "rollout.engine": "compact",
        "sft.steps": 0,
        "total_steps": 3,
    }
    split = {"mesh.rollout_devices": 2, "mesh.fsdp": 2}
    one, run = tmp_path / "one", tmp_path / "two_split_one"
    _run(1, _overrides(small_model_dir, one, **extra), tmp_path)
    args = _overrides(small_model_dir, run, **extra)
    logs = _run(2, args, tmp_path, kill_at={1: "rl_step:1:SIGTERM"})
    assert "stopped by signal on another process after step 1" in logs[0], logs[0]
    # Split across the 2 processes; process 1 lost at the transfer of version 2. The
    # production default heartbeat (30 s): a lost peer is reported well within 2 minutes.
    args = _overrides(small_model_dir, run, **extra, **split)
    procs = _launch(2, args, tmp_path, resume=True, heartbeat=30, kill_at={1: "weight_transfer:2"})
    lost = _finish([procs[1]])[0]
    killed_at = time.monotonic()
    assert procs[1].returncode == -signal.SIGKILL, lost
    out = _finish([procs[0]], timeout=180)[0]
    waited = time.monotonic() - killed_at
    assert "resumed" in out and "at step 1" in out, out
    assert procs[0].returncode != 0, out
    assert waited < 120, waited
    # JAX's coordination service names the lost task as "task:1" / "task 1", or lists it on
    # the line after "tasks are unhealthy (stopped sending heartbeats):" (newer jaxlib).
    tail = out[-3000:].lower()
    assert re.search(r"task[: ]1\b|process 1\b|stopped sending heartbeats\):\s*1\b", tail), tail
    print(f"process 0 exited {waited:.1f}s after process 1 was lost in the weight transfer")
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(steps) == 2, steps  # step 2 trained in 2 processes, split, before the loss
    logs = _run(1, args, tmp_path, resume=True)
    assert "resumed" in logs[0] and "at step 2" in logs[0], logs[0]

    assert _lags(run) == _lags(one) == [(1, 0.0), (2, 1.0), (3, 1.0)]
    print(
        "pipelined, 2 -> 2 split (lost) -> 1 split vs 1: max abs array difference",
        _assert_same_run(one, run),
    )


@pytest.mark.slow
def test_sft_in_two_processes_equals_one(small_model_dir, tmp_path):
    """`grpojax sft` (SFT only, the model exported as a Hugging Face checkpoint) in 2
    processes x 2 CPU devices, the parameters fsdp-sharded across them, against 1 process x
    4 devices: the same held-out pass@1 before and after and the same final loss (1e-5
    relative: a cross-process all-reduce sums in another order), the exported tensors
    within PARAM_ATOL (each gathered from both processes' shards), and only process 0
    prints and writes the summary and the model."""
    (tmp_path / f"{REWARD_MODULE}.py").write_text(REWARD_SOURCE)
    summaries, models = [], []
    for nproc in (1, 2):
        run = tmp_path / f"sft_{nproc}"
        logs = _run(nproc, _overrides(small_model_dir, run), tmp_path, command="sft")
        assert "grpojax sft: success_before=" in logs[0], logs[0]
        assert all("grpojax sft:" not in log for log in logs[1:]), logs[1:]
        summaries.append(json.loads((run / "summary.json").read_text()))
        models.append(load_file(run / "sft_model" / "model.safetensors"))
    (one, two), (m1, m2) = summaries, models
    assert two["success_before"] == one["success_before"]
    assert two["success_after"] == one["success_after"]
    np.testing.assert_allclose(two["final_loss"], one["final_loss"], rtol=1e-5)
    assert sorted(m1) == sorted(m2)
    for name, x in m1.items():
        np.testing.assert_allclose(m2[name], x, rtol=0, atol=PARAM_ATOL, err_msg=name)
    print("grpojax sft, 2 processes vs 1: final loss", two["final_loss"], one["final_loss"])


EPISODES = {
    "env.name": "custom_envs:ShortTurnsEnv",
    "env.max_turn_tokens": 4,
    "data.name": "chain3",
    "rollout.max_new_tokens": 16,
    "rollout.prompts_per_step": 2,
    "rollout.engine": "continuous",
    "rollout.dynamic_sampling": "false",
    "sft.steps": 0,
    "eval.heldout_size": 2,
    "eval.batch_size": 2,
}


def _episode_overrides(model_dir, run_dir, **extra):
    """`_overrides` for a multi-turn run (`EPISODES`): the environment scores its episodes,
    so no reward functions."""
    kept = _overrides(model_dir, run_dir, **{**EPISODES, **extra})
    return [x for x in kept if not x.startswith("rewards.")]


def _env_counters(run_dir):
    """[(step, {env/<name>: value})] of every RL step's metrics."""
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    keys = lambda r: {k: v for k, v in r.items() if k.startswith("env/")}
    return [(r["step"], keys(r)) for r in recs if "reward_mean" in r]


@pytest.mark.slow
def test_episodes_in_two_processes_equal_one_and_resume_from_two_into_one(
    small_model_dir, tmp_path
):
    """A multi-turn run (`env.name`, 3-turn episodes, 3 RL steps, episodes in 4 decode
    slots) in 2 processes x 2 devices, fsdp 4 across them (the sampler's rows split over
    the processes, the environments stepped on process 0 alone and their results sent to
    both), against 1 process x 4 devices uninterrupted: process 1 alone gets SIGTERM after
    step 1, both save; 1 process resumes the 2-process checkpoint and finishes. The same
    episodes: per-step rewards and the environments' counters (turns, policy and
    environment tokens, end reasons) equal exactly, the final arrays within PARAM_ATOL."""
    (tmp_path / "custom_envs.py").write_text((REPO / "tests" / "custom_envs.py").read_text())
    one, run = tmp_path / "one", tmp_path / "two_one"
    _run(1, _episode_overrides(small_model_dir, one), tmp_path)
    args = _episode_overrides(small_model_dir, run)
    logs = _run(2, args, tmp_path, kill_at={1: "rl_step:1:SIGTERM"})
    assert "stopped by signal on another process after step 1" in logs[0], logs[0]
    logs = _run(1, args, tmp_path, resume=True)
    assert "resumed" in logs[0] and "at step 1" in logs[0], logs[0]
    counters = _env_counters(one)
    assert [s for s, _ in counters] == [1, 2, 3] and counters[0][1].get("env/turns", 0) > 0
    assert _env_counters(run) == counters
    print("episodes, 2 -> 1 vs 1: max abs array difference", _assert_same_run(one, run))


@pytest.mark.slow
def test_pipelined_episodes_across_processes_split_then_interleaved(small_model_dir, tmp_path):
    """Multi-turn rounds one step stale (`rollout.max_staleness=1`) across 2 processes x 2
    devices, against 1 process x 4 devices interleaved, uninterrupted:
    - **split placement** (`mesh.rollout_devices=2`: each process trains on its first
      device, fsdp 2 across the two, and plays episodes on its second, data 2 across the
      two; the environments on process 0, their results sent over the rollout devices by
      the worker thread while the loop's thread trains): process 1 alone gets SIGTERM after
      step 1 and both save;
    - **interleaved** (fsdp 4 across the processes; the rounds played on the loop's thread,
      the training devices' collectives in one order on every process): resumed, finishes.
    The episodes last 1-3 turns and play in lock step with the ended ones' rows dropped
    (`rollout.engine=compact`). The same episodes: per-step rewards, lags and environment
    counters exactly, the final arrays within PARAM_ATOL."""
    (tmp_path / "custom_envs.py").write_text((REPO / "tests" / "custom_envs.py").read_text())
    # Episodes of 1-3 turns in lock step, the ended ones' rows dropped as they end.
    stale = {
        "rollout.max_staleness": 1,
        "env.name": "custom_envs:UnevenTurnsEnv",
        "rollout.engine": "compact",
    }
    one, run = tmp_path / "one", tmp_path / "split_interleaved"
    _run(1, _episode_overrides(small_model_dir, one, **stale), tmp_path)
    split = {**stale, "mesh.rollout_devices": 2, "mesh.fsdp": 2}
    logs = _run(
        2,
        _episode_overrides(small_model_dir, run, **split),
        tmp_path,
        kill_at={1: "rl_step:1:SIGTERM"},
    )
    assert "stopped by signal on another process after step 1" in logs[0], logs[0]
    interleaved = {**stale, "mesh.rollout_devices": 0}
    logs = _run(2, _episode_overrides(small_model_dir, run, **interleaved), tmp_path, resume=True)
    assert "resumed" in logs[0] and "at step 1" in logs[0], logs[0]

    assert _lags(run) == _lags(one) == [(1, 0.0), (2, 1.0), (3, 1.0)]
    counters = _env_counters(one)
    turns = [c["env/turns"] / c["env/episodes"] for _, c in counters]
    assert any(t % 1 for t in turns), turns  # a round whose episodes end at different turns
    assert _env_counters(run) == counters
    print(
        "pipelined episodes, 2 split -> 2 interleaved vs 1: max abs array difference",
        _assert_same_run(one, run),
    )
