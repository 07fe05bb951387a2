"""Faults of the vLLM engine (`rollout.engine=vllm`, `grpojax.sampling.vllm_engine`), with the
real engine: nothing is mocked but the fault itself, injected by signalling the worker
process (SIGKILL, SIGSTOP) or by naming a Python that cannot serve.

- a worker killed with a request in flight, and one stopped past `timeout_s`, are one line
  naming `rollout.engine=vllm` and the log; the worker is gone (no orphan), the engine
  holds no version, the next sync starts a new worker that samples what the first one did
  (the same key, the same tokens and logprobs), and `close` leaves nothing in /dev/shm;
- every failed start is one line naming the engine and its log (which is kept, and ends
  with the error), leaves no process and nothing in /dev/shm, and does not hang: a Python
  that does not exist, a file that is no program, a program that is not Python, one that
  never answers (`start_timeout_s`), a Python without vLLM (this project's own: the
  message says so and how to make vLLM's environment), and a vLLM outside
  `SUPPORTED_VLLM` (the range moved instead of installing another vLLM; the message names
  the version found and `grpojax vllm-env`, whose pin is in the range);
- weights of other shapes than vLLM's model (an extra layer, a wider MLP, which vLLM's
  loader would narrow): one line before anything is pushed; vLLM keeps its weights and
  version and samples what it sampled before. A push vLLM's loader rejects (a tensor its
  model has not): one line, the half-loaded worker stopped, no version held, and the next
  sync starts a worker that samples what the first one did;
- a training run whose engine is killed mid-request, resumed, whose engine then hangs,
  resumed again: each stop one line with the checkpoints before it intact, and the run
  finishes equal to an uninterrupted one bit for bit (every logged metric but the timings,
  the held-out evaluations, the final parameters); the uninterrupted run logs
  `time/weight_sync` on exactly the steps that pushed weights and `eval/weight_sync` with
  each evaluation that pushed;
- multi-turn episodes (`env.name`) sampled ahead (`rollout.max_staleness=1`) by vLLM: each
  step's staleness as scheduled, one push per version, the on-policy step's sampler and
  trainer logprobs within float32's 1e-4.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
import typing

import jax
import numpy as np
import pytest
import test_sampling_vllm
from flax import nnx
from model_fixtures import scrambled
from test_sampling_vllm import (
    _assert_queued_round_is_version_2s,
    _config,
    _odd_length,
    _records,
    _sample,
    _vllm_overrides,
)

from grpojax.config import load_config
from grpojax.sampling import vllm_engine as ve

pytestmark = pytest.mark.slow

# test_sampling_vllm's fixtures, this module's too: vLLM's environment, the run's checkpoint.
vllm_python = test_sampling_vllm.vllm_python
vllm_model_dir = test_sampling_vllm.vllm_model_dir

SHM = pathlib.Path("/dev/shm")


def _gone(pid: int) -> bool:
    """The process `pid` has ended and been reaped (no orphan, no zombie)."""
    return not pathlib.Path(f"/proc/{pid}").exists()


def _left_in_shm(before: set[str], pids) -> list[str]:
    """New entries of /dev/shm that belong to this process's engines or to the workers
    `pids` (other processes' entries, e.g. a parallel test's, not counted)."""
    if not SHM.is_dir():
        return []
    mine = {str(os.getpid()), *map(str, pids)}
    return [
        name
        for name in sorted(set(os.listdir(SHM)) - before)
        if mine & set(re.findall(r"\d+", name))
    ]


class _Recorded(subprocess.Popen):
    """Popen that remembers what it started (the engine's workers)."""

    started: typing.ClassVar[list[subprocess.Popen]] = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _Recorded.started.append(self)


@pytest.fixture
def workers(monkeypatch):
    """The processes engines start during the test."""
    _Recorded.started = []
    monkeypatch.setattr(ve.subprocess, "Popen", _Recorded)
    return _Recorded.started


def _one_line(err) -> str:
    msg = str(err.value)
    assert "\n" not in msg, msg
    assert msg.startswith("rollout.engine=vllm: "), msg
    return msg


def _engine(python, **kw):
    return ve.VLLMEngine(python=python, max_model_len=32, kv_cache_mb=16, max_num_seqs=16, **kw)


def _finish(engine, before, workers) -> None:
    """`close`, then: no worker running, nothing of the engine's in /dev/shm; the log an
    error named kept (and removed here)."""
    engine.close()
    assert all(_gone(p.pid) for p in workers), [p.pid for p in workers]
    assert not engine.dir.exists()
    assert _left_in_shm(before, [p.pid for p in workers]) == []
    assert engine.log.exists()  # the error named it
    engine.log.unlink()


def test_a_worker_killed_mid_request_or_hung_is_one_line_and_leaves_nothing(
    vllm_python, workers, monkeypatch
):
    before = set(os.listdir(SHM)) if SHM.is_dir() else set()
    model = scrambled(_config(), 3)
    e = _engine(vllm_python)
    try:
        e.sync(model, 0)
        drawn = _sample(e, model, jax.random.key(0))
        first = e.proc.pid
        # Killed with a request in flight: stopped before the request is written (so it
        # cannot answer it), killed after.
        real_send = ve.VLLMEngine._send

        def dies_mid_request(self, request, doing):
            pid = self.proc.pid
            if request["op"] == "generate":
                os.kill(pid, signal.SIGSTOP)
            real_send(self, request, doing)
            if request["op"] == "generate":
                os.kill(pid, signal.SIGKILL)

        with monkeypatch.context() as m:
            m.setattr(ve.VLLMEngine, "_send", dies_mid_request)
            with pytest.raises(ve.VLLMEngineError) as err:
                _sample(e, model, jax.random.key(0))
        msg = _one_line(err)
        assert re.match(
            r"rollout\.engine=vllm: the vLLM process exited \(killed by SIGKILL\) while "
            r"sampling 2 x 4 completions \(log: ",
            msg,
        ), msg
        assert str(e.log) in msg
        assert e.proc is None and e.version is None and _gone(first)
        # The next sync starts a new worker (version 0 again: the engine holds none), which
        # samples what the first one did.
        assert e.sync(model, 0) is not None
        assert e.proc.pid != first
        again = _sample(e, model, jax.random.key(0))
        np.testing.assert_array_equal(np.asarray(again.tokens_nt), np.asarray(drawn.tokens_nt))
        np.testing.assert_array_equal(np.asarray(again.logp_nt), np.asarray(drawn.logp_nt))
        # Hung: stopped, past timeout_s, then killed by the engine.
        second = e.proc.pid
        e.timeout_s = 2.0
        os.kill(second, signal.SIGSTOP)
        t0 = time.perf_counter()
        with pytest.raises(ve.VLLMEngineError) as err:
            _sample(e, model, jax.random.key(1))
        assert time.perf_counter() - t0 < 15.0
        msg = _one_line(err)
        assert re.match(
            r"rollout\.engine=vllm: the vLLM process answered nothing for 2 s while sampling "
            r"2 x 4 completions \(rollout\.vllm\.timeout_s\) and was stopped \(log: ",
            msg,
        ), msg
        assert e.proc is None and e.version is None and _gone(second)
    finally:
        _finish(e, before, workers)
    assert len(workers) == 2


def _script(path: pathlib.Path, text: str) -> str:
    path.write_text(text)
    path.chmod(0o755)
    return str(path)


def test_a_failed_start_is_one_line_and_leaves_nothing(vllm_python, workers, tmp_path, monkeypatch):
    from grpojax.jobs.vllm_env import VLLM_VERSION

    assert ve.supported_vllm(VLLM_VERSION)  # `grpojax vllm-env` installs a supported one
    assert ve.supported_vllm("0.32.1+cpu") and not ve.supported_vllm("0.33.0")
    how = re.escape("make vLLM's environment with `grpojax vllm-env DIR` and name DIR/bin/python")
    cases = [
        (str(tmp_path / "nope" / "python"), r"rollout\.vllm\.python='.*' is not a Python"),
        (
            _script(tmp_path / "text", "not a program\n"),
            rf"rollout\.vllm\.python='.*' could not be run \(OSError: .*\); {how}",
        ),
        (
            "/bin/sh",  # exits at once: dash knows no -P, bash reads the worker as a script
            r"the vLLM process exited \(code \d+\) while starting; is rollout\.vllm\.python="
            r"'/bin/sh' the Python of vLLM's environment",
        ),
        (
            _script(tmp_path / "silent", "#!/bin/sh\nexec sleep 60\n"),
            r"the vLLM process answered nothing for 1 s while starting "
            r"\(rollout\.vllm\.start_timeout_s\) and was stopped",
        ),
        (
            sys.executable,  # this project's environment: no vLLM
            rf"vLLM is not importable in rollout\.vllm\.python='{re.escape(sys.executable)}' "
            rf"\(ModuleNotFoundError: No module named 'vllm'\); {how}",
        ),
        (
            vllm_python,  # vLLM 0.32, with the supported range moved past it
            rf"rollout\.vllm\.python='.*' has vLLM {re.escape(VLLM_VERSION)}, which grpojax "
            r"does not support \(vllm >=0\.33,<0\.34\); pin a supported one: "
            r"`grpojax vllm-env DIR` installs it",
        ),
    ]
    model = scrambled(_config(), 3)
    monkeypatch.setattr(ve, "SUPPORTED_VLLM", ((0, 33), (0, 34)))
    for python, expected in cases:
        before = set(os.listdir(SHM)) if SHM.is_dir() else set()
        e = _engine(python, start_timeout_s=1.0 if "silent" in python else 120.0)
        t0 = time.perf_counter()
        try:
            with pytest.raises(ve.VLLMEngineError) as err:
                e.sync(model, 0)
            assert time.perf_counter() - t0 < 60.0
            msg = _one_line(err)
            assert re.match(rf"rollout\.engine=vllm: {expected}", msg), msg
            assert f"(log: {e.log})" in msg
            assert e.proc is None and e.version is None
            # The log ends with the error (the worker's own lines before it).
            assert e.log.read_text().splitlines()[-1].startswith("grpojax: ")
        finally:
            _finish(e, before, workers)
    assert len(workers) == 4  # those that started a process: each one gone


def test_a_push_of_other_shapes_or_one_vllm_rejects_is_one_line_and_loses_nothing(
    vllm_python, workers, monkeypatch
):
    before = set(os.listdir(SHM)) if SHM.is_dir() else set()
    model = scrambled(_config(), 3)
    e = _engine(vllm_python)
    try:
        e.sync(model, 1)
        drawn = _sample(e, model, jax.random.key(5))

        def same_as_drawn():
            again = _sample(e, model, jax.random.key(5))
            np.testing.assert_array_equal(np.asarray(again.tokens_nt), np.asarray(drawn.tokens_nt))
            np.testing.assert_array_equal(np.asarray(again.logp_nt), np.asarray(drawn.logp_nt))

        # Weights of other shapes are refused before anything reaches vLLM (its loader would
        # take a wider MLP, narrowed, and only the probe would see it): its weights and the
        # version it holds stay, and it samples as before without a new push.
        for field, value in (("num_layers", 3), ("intermediate_size", 256)):
            config = dataclasses.replace(_config(), **{field: value})
            with pytest.raises(ve.VLLMEngineError) as err:
                e.sync(scrambled(config, 4), 2)
            msg = _one_line(err)
            assert re.match(
                r"rollout\.engine=vllm: the weights of version 2 do not fit the model vLLM "
                r"runs: model\.layers\.\d\.\S+ is ",
                msg,
            ), msg
            assert e.version == 1
            same_as_drawn()
        # A push vLLM's loader rejects (a tensor its model does not have): one line, the
        # half-loaded worker is stopped, and the next sync starts one on the policy.
        real_fill = ve.SharedWeights.fill

        def with_a_stranger(self, m, k):
            _, shape, strides, offset = real_fill(self, m, k)[0]
            stranger = ["model.layers.0.mlp.stranger_proj.weight", shape, strides, offset]
            return [stranger, *real_fill(self, m, k)]

        monkeypatch.setattr(ve.SharedWeights, "fill", with_a_stranger)
        with pytest.raises(ve.VLLMEngineError) as err:
            e.sync(scrambled(_config(), 4), 2)
        msg = _one_line(err)
        assert re.match(
            r"rollout\.engine=vllm: vLLM failed while loading weights of version 2: ", msg
        ), msg
        assert e.version is None and e.proc is None
        monkeypatch.setattr(ve.SharedWeights, "fill", real_fill)
        assert e.sync(model, 1) is not None  # a new worker, started on the policy
        same_as_drawn()
    finally:
        _finish(e, before, workers)


# -- training runs --------------------------------------------------------------------------

# The logged timings: the keys a resumed run does not repeat bit for bit.
_TIMED = re.compile(r"^(time|time/.*|elapsed_s|step_time_s|tokens_per_s|eval/weight_sync)$")


def _untimed(records):
    return [{k: v for k, v in r.items() if not _TIMED.match(k)} for r in records]


def _all_records(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_run_whose_engine_dies_or_hangs_stops_and_resumes_bit_exactly(
    vllm_python, vllm_model_dir, tmp_path, workers, monkeypatch
):
    from grpojax.driver.checkpoint import saved_steps
    from grpojax.driver.loop import train

    def over(run_dir):
        extra = {"eval.every": "2", "rollout.vllm.timeout_s": "5", "checkpoint.keep": "5"}
        return _vllm_overrides(vllm_model_dir, run_dir, vllm_python, total_steps=4, **extra)

    from grpojax.rewards import RewardSpec

    # A reward that varies under the scrambled policy: every step's update moves the weights.
    specs = [RewardSpec(_odd_length, name="odd_length", mode="thread")]
    quiet = dict(show_progress=False, print_fn=lambda s: None, reward_specs=specs)
    ref = train(load_config(None, over(tmp_path / "ref")), **quiet)
    assert ref.steps == 4
    rl = _records(tmp_path / "ref")
    assert any(r["frac_zero_std_groups"] < 1.0 for r in rl)  # advantages: the weights move
    # A push before every round whose weights vLLM does not hold yet: version 0's was the
    # evaluation's before RL, version 2's the evaluation's after step 2.
    assert ["time/weight_sync" in r for r in rl] == [False, True, False, True]
    assert ["eval/weight_sync" in r for r in rl] == [False, True, False, False]
    final = _all_records(tmp_path / "ref")[-1]  # the evaluation after RL (version 4's push)
    assert "eval/pass@1" in final and final["eval/weight_sync"] > 0.0

    # The RL rounds' requests (G 4; the evaluations ask for 1 and eval.k 2), across the
    # three runs: round 3 (step 3's) dies mid-request, round 5 (step 4's, in the run
    # resumed at step 2) hangs.
    real_send = ve.VLLMEngine._send
    rounds: list[int] = []
    faults = {3: "dies", 5: "hangs"}

    def faulty(self, request, doing):
        fault = None
        if request["op"] == "generate" and request["n"] == 4:
            rounds.append(self.proc.pid)
            fault = faults.get(len(rounds))
        if fault is not None:
            os.kill(self.proc.pid, signal.SIGSTOP)
        pid = self.proc.pid
        real_send(self, request, doing)
        if fault == "dies":
            os.kill(pid, signal.SIGKILL)

    run_dir = tmp_path / "run"
    monkeypatch.setattr(ve.VLLMEngine, "_send", faulty)
    expected = {
        3: r"the vLLM process exited \(killed by SIGKILL\) while sampling 2 x 4 completions",
        5: r"the vLLM process answered nothing for 5 s while sampling 2 x 4 completions "
        r"\(rollout\.vllm\.timeout_s\) and was stopped",
    }
    logs = []
    # (the round that fails, the step it samples for, the resume flag)
    for at, step, resume in ((3, 3, []), (5, 4, ["checkpoint.resume=true"])):
        with pytest.raises(ve.VLLMEngineError) as err:
            train(load_config(None, [*over(run_dir), *resume]), **quiet)
        msg = _one_line(err)
        assert re.match(rf"rollout\.engine=vllm: {expected[at]} \(log: ", msg), msg
        assert len(rounds) == at and _gone(rounds[-1])
        logs.append(re.search(r"\(log: (\S+)\)", msg).group(1))
        # The checkpoints before the failed step are intact: the next run resumes there.
        assert saved_steps(run_dir / "checkpoints") == list(range(step))
    done = train(load_config(None, [*over(run_dir), "checkpoint.resume=true"]), **quiet)
    assert done.steps == 4 and len(rounds) == 6
    assert all(_gone(p.pid) for p in workers)
    for log in logs:  # the logs the errors named, kept for the user
        assert pathlib.Path(log).exists()
        pathlib.Path(log).unlink()

    # Bit for bit the uninterrupted run: every logged value but the timings (each resumed
    # run pushes the weights to its new engine at its first round), the held-out
    # evaluations, the final parameters.
    got, want = _untimed(_all_records(run_dir)), _untimed(_all_records(tmp_path / "ref"))
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for a, b in zip(got, want, strict=True):
        assert a == b, {k: (a.get(k), b.get(k)) for k in {*a, *b} if a.get(k) != b.get(k)}
    strip = lambda ev: {k: v for k, v in ev.items() if k != "weight_sync"}
    assert strip(done.eval_after) == strip(ref.eval_after)
    ours = nnx.state(done.trainer.policy(), nnx.Param)
    theirs = nnx.state(ref.trainer.policy(), nnx.Param)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_episodes_sampled_ahead_by_vllm(vllm_python, vllm_model_dir, tmp_path):
    """`env.name` with `rollout.max_staleness=1` on vLLM: the episodes of each round played
    on the pipeline's worker thread with a copy of the weights of the step that queued it,
    the copy pushed to vLLM before the round (one push per version); a queued round's
    logprobs are those of the version it records (float32, 1e-4), not the newer weights'."""
    from test_driver_envs import _overrides as _env_overrides

    from grpojax.driver.loop import train

    run_dir = tmp_path / "run"
    over = _env_overrides(
        vllm_model_dir,
        run_dir,
        total_steps=3,
        **{
            "rollout.engine": "vllm",
            "rollout.vllm.python": vllm_python,
            "rollout.vllm.kv_cache_mb": "16",
            "rollout.vllm.max_num_seqs": "16",
            "rollout.max_staleness": "1",
            "checkpoint.keep": "5",
        },
    )
    cfg = load_config(None, over)
    assert cfg.step_config.rollout_correction_mode == "truncate"
    assert train(cfg, show_progress=False, print_fn=lambda s: None).steps == 3
    rl = _records(run_dir)
    assert [r["step"] for r in rl] == [1, 2, 3]
    # Step s trains the round drawn by the weights of step max(0, s - 1): versions 0, 0, 1;
    # version 0 was pushed for the evaluation before RL, version 1 for step 3's round.
    assert [r["staleness/max"] for r in rl] == [0, 1, 1]
    assert [r["staleness/mean"] for r in rl] == [0, 1, 1]
    assert ["time/weight_sync" in r for r in rl] == [False, False, True]
    for r in rl:
        assert r["env/turns_mean"] > 1.0  # multi-turn
    assert rl[0]["logprob_diff_max"] <= 1e-4, rl[0]["logprob_diff_max"]  # on-policy, float32
    # The stale steps' differences are the versions' (1 update apart), not vLLM's:
    assert min(r["logprob_diff_max"] for r in rl[1:]) > 1e-3
    final = _all_records(run_dir)[-1]
    assert "eval/pass@1" in final and final["eval/weight_sync"] > 0.0
    # The last checkpoint queues the episodes drawn by version 2: vLLM's logprobs are the
    # weights of step 2's, not step 3's.
    _assert_queued_round_is_version_2s(cfg, run_dir)
