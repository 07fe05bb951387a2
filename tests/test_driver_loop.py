"""The RL driver loop: end to end on a very small model, exact resume, SIGTERM, bad rewards,
dynamic sampling and batch assembly against independent NumPy constructions."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from grpojax.driver.checkpoint import host_copy
from grpojax.driver.config import load_config
from grpojax.driver.loop import (
    DriverState,
    Group,
    _collect,
    assemble_batch,
    train,
)
from grpojax.rewards import RewardSpec

REPO = pathlib.Path(__file__).resolve().parents[1]


def _overrides(model_dir, run_dir, **extra):
    base = {
        "model.source": str(model_dir),
        "log.run_dir": str(run_dir),
        "log.progress": "false",
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
        "checkpoint.keep": "3",
        "checkpoint.async_save": "false",
        "rewards.mode": "thread",
        "sft.steps": "0",
    }
    base.update({k: str(v) for k, v in extra.items()})
    return [f"{k}={v}" for k, v in base.items()]


def _has_digit_one(prompts, completions, **_):
    """A deterministic reward with variance under a random policy."""
    return [1.0 if "1" in c else 0.0 for c in completions]


def test_loop_end_to_end_writes_logs_checkpoints_and_plots(small_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    cfg = load_config(None, _overrides(small_model_dir, run_dir, total_steps=3, **{"sft.steps": 2}))
    result = train(cfg, show_progress=False, print_fn=lambda s: None)
    assert result.steps == 3 and result.stopped_by is None
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in records if "reward_mean" in r]
    assert [r["step"] for r in rl] == [1, 2, 3]
    required = {
        "reward_mean",
        "reward_std",
        "reward/numeric_answer",
        "frac_zero_std_groups",
        "completion_len_mean",
        "completion_len_min",
        "completion_len_max",
        "truncated_frac",
        "entropy",
        "clip_frac_low",
        "clip_frac_high",
        "approx_kl",
        "grad_norm",
        "lr",
        "skipped",
        "reward_failed_samples",
        "logprob_diff_max",
        "logprob_diff_mean",
        "time/generate",
        "time/reward",
        "time/logprobs",
        "time/update",
        "tokens_per_s",
    }
    assert required <= set(rl[0]), required - set(rl[0])
    # The decode loop and the trainer's full forward give the same logprobs (rounding only).
    assert max(r["logprob_diff_max"] for r in rl) < 1e-4
    assert all(0.0 <= r["frac_zero_std_groups"] <= 1.0 for r in rl)
    assert any(f.name.startswith("events") for f in (run_dir / "tensorboard").rglob("*"))
    assert (
        sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())[-1]
        == 3
    )
    for name in ("config.yaml", "summary.json", "success.png", "metrics.png"):
        assert (run_dir / name).is_file(), name
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and 0.0 <= summary["eval_after"]["pass@1"] <= 1.0


def test_resume_is_bit_exact(small_model_dir, tmp_path):
    """SFT then 2k RL steps in one go == stopped mid-SFT, resumed and stopped after k RL
    steps, resumed again for k more; with dynamic sampling on so the carried-over buffer and
    data position are part of the state."""
    k = 2
    specs = [RewardSpec(_has_digit_one, name="digit_one", mode="thread")]
    extra = {
        "total_steps": 2 * k,
        "sft.steps": 4,
        "sft.batch_size": 8,
        "rollout.dynamic_sampling": "true",
        "rollout.max_resample_rounds": 2,
        "grpo.beta": 0.04,
        "grpo.num_minibatches": 2,
    }
    quiet = dict(show_progress=False, print_fn=lambda s: None, reward_specs=specs)
    full = train(load_config(None, _overrides(small_model_dir, tmp_path / "a", **extra)), **quiet)
    cfg_b = load_config(None, _overrides(small_model_dir, tmp_path / "b", **extra))
    cfg_resume = load_config(
        None, _overrides(small_model_dir, tmp_path / "b", **extra, **{"checkpoint.resume": "true"})
    )
    sft_dir, rl_dir = tmp_path / "b" / "checkpoints-sft", tmp_path / "b" / "checkpoints"

    def steps(d):
        return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.is_dir() else []

    zeroth = train(cfg_b, stop_after_sft=2, **quiet)  # stopped during the SFT warm start
    assert zeroth.stopped_by == "stop_after" and zeroth.steps == 0 and zeroth.trainer is None
    assert steps(sft_dir) == [2] and steps(rl_dir) == []
    with pytest.raises(ValueError, match="already holds checkpoints of an earlier run"):
        train(cfg_b, **quiet)  # a fresh run must not mix with the stopped one's checkpoints
    first = train(cfg_resume, stop_after=k, **quiet)  # SFT steps 3-4, evaluation, k RL steps
    assert first.stopped_by == "stop_after" and first.steps == k
    # The warm start is RL checkpoint 0; the SFT checkpoints are gone once it is saved.
    assert steps(rl_dir) == [0, 1, 2] and steps(sft_dir) == []
    second = train(cfg_resume, **quiet)
    assert second.steps == 2 * k and full.steps == 2 * k
    a, b = host_copy(full.trainer.state), host_copy(second.trainer.state)
    leaves_a, tree_a = jax.tree.flatten(a)
    leaves_b, tree_b = jax.tree.flatten(b)
    assert tree_a == tree_b
    for x, y in zip(leaves_a, leaves_b):
        np.testing.assert_array_equal(x, y)  # bit-exact, no tolerance
    # The resumed run reports the before-RL evaluation from the checkpoint.
    assert second.eval_before == full.eval_before
    # Metrics of the redone steps are identical too.
    ra = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    rb = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    key = "reward_mean"
    assert [r[key] for r in ra if key in r] == [r[key] for r in rb if key in r]


def _raise_on_some(prompts, completions, **_):
    if any("7" in p for p in prompts):
        raise RuntimeError("reward service unavailable")
    return [1.0 if "1" in c else 0.0 for c in completions]


def _hang_sometimes(prompts, completions, **_):
    if any("3" in p for p in prompts):
        time.sleep(3.0)
    return [0.5] * len(completions)


def _nan_reward(prompts, completions, **_):
    return [float("nan") if "2" in c else 0.0 for c in completions]


def test_failing_and_hanging_rewards_do_not_stop_training(small_model_dir, tmp_path):
    specs = [
        RewardSpec(_raise_on_some, name="raises", mode="thread"),
        RewardSpec(_hang_sometimes, name="hangs", mode="thread"),
        RewardSpec(_nan_reward, name="nan", mode="thread"),
    ]
    cfg = load_config(
        None,
        _overrides(
            small_model_dir,
            tmp_path / "run",
            total_steps=3,
            **{"rewards.timeout_s": 0.5, "rollout.prompts_per_step": 4},
        ),
    )
    result = train(cfg, reward_specs=specs, show_progress=False, print_fn=lambda s: None)
    assert result.steps == 3
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in records if "reward_mean" in r]
    assert rl[-1]["total/failed_reward_samples"] > 0
    assert sum(r["reward_failed_samples"] for r in rl) == rl[-1]["total/failed_reward_samples"]
    params = jax.tree.leaves(host_copy(result.trainer.policy_params()))
    assert all(np.all(np.isfinite(p)) for p in params)


def test_sigterm_finishes_step_saves_and_exits_zero(small_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    args = _overrides(small_model_dir, run_dir, total_steps=10_000, **{"checkpoint.every": 1000})
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "grpojax.cli", "train", "--no-progress", *args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    jsonl = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if jsonl.exists() and sum(1 for _ in jsonl.open()) >= 2:
            break
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    assert proc.poll() is None, proc.stdout.read()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert "stopped by SIGTERM" in out
    last = max(json.loads(x)["step"] for x in jsonl.read_text().splitlines())
    steps = [int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()]
    # The step in flight finished, was logged and saved: nothing is lost.
    assert max(steps) == last


# ----------------------------------------------------------------------------------------
# Host-side pieces against independent constructions
# ----------------------------------------------------------------------------------------


def _group(rng, prompt_len, g=3, t=5, rewards=None, valid=None):
    lengths = rng.integers(1, t + 1, size=g).astype(np.int32)
    return Group(
        prompt_ids=[int(x) for x in rng.integers(4, 50, size=prompt_len)],
        tokens_gt=rng.integers(4, 50, size=(g, t)).astype(np.int32),
        lengths_g=lengths,
        logp_gt=rng.normal(size=(g, t)).astype(np.float32),
        keep_threshold_gt=np.full((g, t), -np.inf, np.float32),
        eos_g=lengths < t,
        total_g=np.asarray(rewards if rewards is not None else rng.random(g), np.float32),
        valid_g=np.asarray(valid if valid is not None else np.ones(g, bool)),
        per_fn={
            "f": np.where(
                np.asarray(valid if valid is not None else np.ones(g, bool)), rng.random(g), np.nan
            ).astype(np.float32)
        },
    )


def test_assemble_batch_layout_matches_a_loop_construction():
    rng = np.random.default_rng(0)
    groups = [_group(rng, 3), _group(rng, 9, valid=[True, False, True]), _group(rng, 5)]
    batch = assemble_batch(groups, pad_id=0, min_prompt_width=8)
    p = 16  # longest prompt 9 -> next power of two
    assert batch.tokens_ns.shape == (9, p + 5)
    n = 0
    for gr in groups:
        for j in range(3):
            row_tok = batch.tokens_ns[n]
            row_mask = batch.mask_ns[n]
            lp = len(gr.prompt_ids)
            expect_tok = [0] * (p - lp) + gr.prompt_ids + list(gr.tokens_gt[j])
            expect_mask = [False] * (p - lp) + [True] * lp + [t < gr.lengths_g[j] for t in range(5)]
            assert row_tok.tolist() == expect_tok
            assert row_mask.tolist() == expect_mask
            expect_c = [bool(gr.valid_g[j]) and t < gr.lengths_g[j] for t in range(5)]
            assert batch.completion_mask_nt[n].tolist() == expect_c
            n += 1
    assert not batch.completion_mask_nt[4].any()  # the failed sample trains on nothing


def test_group_json_round_trip_is_exact():
    rng = np.random.default_rng(1)
    gr = _group(rng, 4, valid=[True, False, True])
    back = Group.from_json(json.loads(json.dumps(gr.to_json())))
    for f in ("tokens_gt", "lengths_g", "logp_gt", "keep_threshold_gt", "eos_g", "total_g"):
        np.testing.assert_array_equal(getattr(back, f), getattr(gr, f))
    np.testing.assert_array_equal(back.per_fn["f"], gr.per_fn["f"])
    assert back.prompt_ids == gr.prompt_ids


class _FakeSampler:
    """Hands out prepared rounds of groups; records how many rounds were asked for."""

    def __init__(self, cfg, rounds):
        self.cfg, self.rounds, self.calls = cfg, list(rounds), 0

    def round(self, model, key, times):
        self.calls += 1
        return self.rounds.pop(0), key, {}


class _FakeTrainer:
    def policy(self):
        return None


def _ds_config(**extra):
    over = {
        "rollout.prompts_per_step": 2,
        "rollout.dynamic_sampling": "true",
        "rollout.max_resample_rounds": 2,
        "grpo.group_size": 3,
    }
    over.update(extra)
    return load_config(None, [f"{k}={v}" for k, v in over.items()])


def test_dynamic_sampling_drops_zero_variance_groups_and_buffers_surplus():
    rng = np.random.default_rng(2)
    flat = lambda: _group(rng, 4, rewards=[1.0, 1.0, 1.0])
    good = lambda: _group(rng, 4, rewards=[0.0, 1.0, 0.0])
    r1, r2 = [flat(), good()], [good(), good()]
    sampler = _FakeSampler(_ds_config(), [r1, r2])
    ds = DriverState()
    groups, _, _, rounds, _ = _collect(sampler, _FakeTrainer(), ds, None, {})
    assert rounds == 2 and sampler.calls == 2
    assert groups == [r1[1], r2[0]]  # kept in sampling order, the flat group dropped
    assert ds.buffer == [r2[1]]  # surplus waits for the next step
    assert ds.counters["dropped_groups"] == 1 and ds.counters["resample_rounds"] == 1
    # Next step starts from the buffer and needs one more round.
    sampler.rounds = [[good(), flat()]]
    groups2, _, _, rounds2, _ = _collect(sampler, _FakeTrainer(), ds, None, {})
    assert rounds2 == 1 and groups2[0] is r2[1] and ds.buffer == []


def test_dynamic_sampling_fills_with_dropped_groups_when_rounds_run_out():
    rng = np.random.default_rng(3)
    flat = lambda: _group(rng, 4, rewards=[0.0, 0.0, 0.0])
    rounds_data = [[flat(), flat()] for _ in range(3)]
    sampler = _FakeSampler(_ds_config(), rounds_data)
    ds = DriverState()
    groups, _, _, rounds, _ = _collect(sampler, _FakeTrainer(), ds, None, {})
    # 1 round + max_resample_rounds=2 extra rounds, then the batch keeps its static shape.
    assert rounds == 3 and len(groups) == 2
    assert ds.counters["zero_var_fill_groups"] == 2
