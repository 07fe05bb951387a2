"""The RL driver loop: end to end on a very small model, exact resume, SIGTERM, bad rewards,
model-parallel meshes against a data-parallel one, dynamic sampling and batch assembly
against independent NumPy constructions."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from multidevice import run_with_devices

from grpojax.config import load_config
from grpojax.driver.checkpoint import CheckpointMismatchError, host_copy
from grpojax.driver.loop import METRIC_PANELS, train
from grpojax.models import make_mesh
from grpojax.models.sharding import batch_sharding, put_global
from grpojax.rewards import RewardSpec
from grpojax.rollouts.sampler import DriverState, collect
from grpojax.train.rows import Group, RowArrays, assemble_batch, empty_rows

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
        "decode_utilisation",
    }
    assert required <= set(rl[0]), required - set(rl[0])
    assert all(0.0 < r["decode_utilisation"] <= 1.0 for r in rl)
    # metrics.png's panels are names the run logs (beta > 0: the KL too).
    panels = {k for p in METRIC_PANELS for k in ((p,) if isinstance(p, str) else p)}
    assert panels <= set(rl[0]), panels - set(rl[0])
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


def test_ppo_full_vocabulary_kl_run_logs_a_finite_kl(small_model_dir, tmp_path):
    """`algo=ppo ppo.kl_estimator=full`: two RL steps log the exact KL to the reference, 0 at
    step 1 (the reference is the policy the step starts from) and finite, >= 0 after an
    update. The one reference copy sits in the actor's state, for the step."""
    run_dir = tmp_path / "run"
    extra = {"algo": "ppo", "ppo.kl_estimator": "full", "total_steps": 2}
    cfg = load_config(None, _overrides(small_model_dir, run_dir, **extra))
    result = train(cfg, show_progress=False, print_fn=lambda s: None)
    assert result.steps == 2 and result.stopped_by is None
    state = result.trainer.state
    assert state.ref_params is None and state.ppo.actor.ref_params is not None
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    kl = [r["kl"] for r in records if "reward_mean" in r]
    print("kl per RL step", kl)
    assert len(kl) == 2 and all(np.isfinite(kl)), kl
    assert abs(kl[0]) <= 1e-6 and kl[1] >= 0.0, kl


def test_ppo_at_kl_coef_0_keeps_and_runs_no_reference(small_model_dir, tmp_path):
    """`algo=ppo ppo.kl_coef=0` (the main job's value): the trainer holds no reference copy (not
    beside the state, not in the actor's state), its logprob pass runs no reference forward
    (no reference logprobs), the log has no KL, and the shaped reward is the score (mean
    per-sequence sum = mean score, float32). Resuming it with `ppo.kl_coef=0.05` (a state
    with a reference) is a one-line error naming the reference's leaves, and the run's
    checkpoints stay where they are (not moved aside as corrupt)."""
    run_dir = tmp_path / "run"
    extra = {"algo": "ppo", "ppo.kl_coef": 0, "ppo.critic": "shared", "ppo.num_epochs": 1}
    extra["total_steps"] = 1
    cfg = load_config(None, _overrides(small_model_dir, run_dir, **extra))
    assert cfg.ppo.kl_coef == 0.0 and not cfg.ppo.uses_reference
    result = train(cfg, show_progress=False, print_fn=lambda s: None)
    trainer = result.trainer
    assert trainer.state.ref_params is None and trainer.state.ppo.actor.ref_params is None
    assert trainer.ref_params() is None and trainer._ref_for_logprobs() is None
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (rl,) = [r for r in records if "ppo_shaped_reward_mean" in r]
    assert "kl" not in rl and "kl_token" not in rl and rl["beta"] == 0.0
    assert rl["ppo_shaped_reward_mean"] == pytest.approx(rl["score_mean"], rel=1e-6, abs=1e-7)

    ckpt_dir = run_dir / "checkpoints"
    saved = sorted(p.name for p in ckpt_dir.iterdir())
    extra.update({"ppo.kl_coef": 0.05, "total_steps": 2, "checkpoint.resume": "true"})
    cfg = load_config(None, _overrides(small_model_dir, run_dir, **extra))
    with pytest.raises(CheckpointMismatchError, match=r"only in this run: \.train\.ref_params\["):
        train(cfg, show_progress=False, print_fn=lambda s: None)
    assert sorted(p.name for p in ckpt_dir.iterdir()) == saved


def test_truncated_sampling_logprobs_agree_with_the_trainer(small_model_dir, tmp_path):
    """top-k + top-p sampling with the keep-sampling mask: the trainer-side logprob of each
    sampled token (renormalised over the sampler's kept set) equals the sampler's within
    1e-4 (float32, cached decode vs full forward), as untruncated sampling does above. Without
    the renormalisation they would differ by log(kept mass), far above that here (a random
    model's top 3 tokens of a ~100-token vocabulary hold a fraction of its mass). With two
    mini-batches that pass is the step's pi_old, so the first update's ratio is 1 (1e-4)."""
    extra = {
        "total_steps": 1,
        "sampling.top_k": 3,
        "sampling.top_p": 0.9,
        "grpo.use_keep_mask": "true",
        "grpo.num_minibatches": 2,
    }
    cfg = load_config(None, _overrides(small_model_dir, tmp_path / "run", **extra))
    train(cfg, show_progress=False, print_fn=lambda s: None)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    (rl,) = [r for r in map(json.loads, lines) if "reward_mean" in r]
    assert rl["logprob_diff_max"] < 1e-4
    assert abs(rl["first_ratio_min"] - 1) < 1e-4 and abs(rl["first_ratio_max"] - 1) < 1e-4


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


def _flaky(prompts, completions, **_):
    """Variance under a random policy; for about half the prompts (by a checksum of the
    text) the third sample of each five fails (NaN: invalid), so some steps have failed
    samples and some have none."""
    return [
        float("nan") if zlib.crc32(p.encode()) % 2 and i % 5 == 2 else float("1" in c)
        for i, (p, c) in enumerate(zip(prompts, completions))
    ]


def test_rewards_overlapped_with_the_logprob_pass_give_the_same_run(small_model_dir, tmp_path):
    """`rollout.overlap_rewards` (the default) == the rewards first: 4 GRPO steps (2 epochs
    over 2 mini-batches, so pi_old is the early pass's policy logprobs; beta > 0, so the
    reference's are used too), final state bit for bit and every metric equal but the
    timings. Steps with failed samples (NaN rewards: invalid, masked out and packed
    without) rerun the pass on the scored batch; the others use the early pass."""
    specs = [RewardSpec(_flaky, name="r", mode="thread")]
    extra = {"total_steps": 4, "grpo.beta": 0.04, "grpo.num_epochs": 2, "grpo.num_minibatches": 2}
    quiet = dict(show_progress=False, print_fn=lambda s: None, reward_specs=specs)
    runs = {}
    for overlap in ("true", "false"):
        over = {**extra, "rollout.overlap_rewards": overlap}
        cfg = load_config(None, _overrides(small_model_dir, tmp_path / overlap, **over))
        runs[overlap] = train(cfg, **quiet)
    leaves_a, tree_a = jax.tree.flatten(host_copy(runs["true"].trainer.state))
    leaves_b, tree_b = jax.tree.flatten(host_copy(runs["false"].trainer.state))
    assert tree_a == tree_b
    for x, y in zip(leaves_a, leaves_b):
        np.testing.assert_array_equal(x, y)

    def records(name):
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return [json.loads(x) for x in lines if "reward_mean" in x]

    timing = ("time", "elapsed_s", "step_time_s", "tokens_per_s")
    untimed = {
        k: [
            {m: v for m, v in r.items() if m not in timing and not m.startswith("time/")}
            for r in records(k)
        ]
        for k in runs
    }
    assert untimed["true"] == untimed["false"]
    assert all("time/reward_busy" in r for r in records("true"))  # the overlapped path ran
    assert not any("time/reward_busy" in r for r in records("false"))
    failed = [r["reward_failed_samples"] for r in records("true")]
    assert min(failed) == 0 < max(failed), failed  # both paths taken


_REWARD_CALLS: list[tuple[list[str], list[str]]] = []


def _recorded_reward(prompts, completions, **_):
    """Records its calls (thread mode: this process); a reward with many values."""
    _REWARD_CALLS.append((list(prompts), list(completions)))
    return [_text_score(c) for c in completions]


def _text_score(c: str) -> float:
    return float("1" in c) + 0.1 * len(c)


def _length_reward(prompts, completions, **_):
    return [float(len(c)) for c in completions]


def _greedy_text(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    """Greedy decoding by repeated full forwards (no KV cache): the independent reference."""
    from grpojax.data import encode_prompts, stop_ids_of

    tokens, lengths = encode_prompts(tokenizer, [prompt])
    ids = list(tokens[0, tokens.shape[1] - int(lengths[0]) :])
    stop, out = set(stop_ids_of(tokenizer)), []
    for _ in range(max_new_tokens):
        x = np.asarray([ids + out], np.int32)
        pos, mask = np.arange(x.shape[1])[None], np.ones_like(x, bool)
        hidden, _ = model(jnp.asarray(x), positions_nt=jnp.asarray(pos), mask_nt=jnp.asarray(mask))
        nxt = int(np.argmax(np.asarray(model.logits(hidden))[0, -1]))
        if nxt in stop:
            break
        out.append(nxt)
    return tokenizer.decode(out, skip_special_tokens=False)


@pytest.mark.slow
def test_remax_driver_scores_the_greedy_completion_of_each_prompt(
    small_model_dir, tmp_path, monkeypatch
):
    """`grpo.advantage_estimator=remax`, one step: each round also decodes B greedy
    completions, scored by the run's reward manager; they equal greedy decoding by full
    forwards of the starting policy, and every sample of a prompt's group carries its
    greedy reward into the step (checked on the batch the trainer receives). The run's
    `rollout.decode_loops`, `rollout.engine` and `rollout.slots` reach all three kinds of
    `generate` call (sampled, greedy, held-out evaluation)."""
    from grpojax.driver import evaluate as evaluate_mod
    from grpojax.driver import trainer as trainer_mod
    from grpojax.driver.setup import build_model, build_tokenizer
    from grpojax.rollouts import sampler as rollout_mod

    seen = []
    original = trainer_mod.GRPOTrainer.update

    def update(self, batch, logp, ref_logp, **kw):
        seen.append(dict(batch.host))
        return original(self, batch, logp, ref_logp, **kw)

    monkeypatch.setattr(trainer_mod.GRPOTrainer, "update", update)
    loops = []  # (rows, (decode_loops, engine, slots)) of each generate call
    for module in (rollout_mod, evaluate_mod):

        def spy(model, prompts, *args, _real=module.generate, **kw):
            engine = (kw.get("decode_loops"), kw.get("engine"), kw.get("slots"))
            loops.append((len(prompts) * kw.get("group_size", 1), engine))
            return _real(model, prompts, *args, **kw)

        monkeypatch.setattr(module, "generate", spy)
    _REWARD_CALLS.clear()
    extra = {
        "total_steps": 1,
        "grpo.advantage_estimator": "remax",
        # One call per batch: the greedy call is the one of B = 2 completions (evaluation's
        # are of 4 and 8).
        "rewards.num_workers": 1,
        "checkpoint.every": 10,
        "log.tensorboard": "false",
        "log.plot": "false",
        "rollout.decode_loops": "2",  # T 4 still decodes in one loop: the same programs
        "rollout.engine": "continuous",
        "rollout.slots": "3",
    }
    cfg = load_config(None, _overrides(small_model_dir, tmp_path / "run", **extra))
    specs = [RewardSpec(_recorded_reward, name="recorded", mode="thread")]
    result = train(cfg, reward_specs=specs, show_progress=False, print_fn=lambda s: None)
    assert result.steps == 1
    b, g = 2, 4
    # Sampled (B*G), greedy (B) and evaluation (4 greedy, 4 x k=2 sampled) calls.
    assert {rows for rows, _ in loops} >= {b * g, b, 4, 8}, loops
    assert all(e == (2, "continuous", 3) for _, e in loops), loops
    sampled = [c for c in _REWARD_CALLS if len(c[1]) == b * g]
    greedy = [c for c in _REWARD_CALLS if len(c[1]) == b]
    assert len(greedy) == 1 and len(seen) == 1
    prompts, texts = greedy[0]
    model, tokenizer = build_model(cfg)[0], build_tokenizer(cfg)
    assert texts == [_greedy_text(model, tokenizer, p, 4) for p in prompts]
    host = seen[0]
    want = np.repeat([_text_score(c) for c in texts], g).astype(np.float32)
    np.testing.assert_allclose(host["greedy_rewards_n"], want, rtol=1e-6)
    # The samples of the same round, same prompts: rewards_n is theirs, G per prompt.
    same_round = [c for c in sampled if c[0] == list(np.repeat(prompts, g))]
    assert same_round
    np.testing.assert_allclose(
        host["rewards_n"], [_text_score(c) for c in same_round[0][1]], rtol=1e-6
    )
    rl = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rl if "reward_mean" in r]
    np.testing.assert_allclose(rl[0]["greedy_reward_mean"], want.mean(), rtol=1e-6)
    for name in ("pg_loss", "grad_norm", "greedy_reward_mean"):
        assert np.isfinite(rl[0][name]), name
    assert rl[0]["greedy_reward_failed"] == 0 and rl[0]["skipped"] == 0


@pytest.mark.slow
def test_gdpo_driver_passes_per_function_rewards_and_weights(
    small_model_dir, tmp_path, monkeypatch
):
    """`grpo.advantage_estimator=gdpo` with two weighted reward functions, one step: the
    step gets the per-function rewards as `[N, R]` columns (their weighted sum is
    `rewards_n`) and the reward manager's weights as `gdpo_weights`; finite metrics."""
    from grpojax.driver import trainer as trainer_mod

    seen = []
    original = trainer_mod.GRPOTrainer.update

    def update(self, batch, logp, ref_logp, **kw):
        seen.append((dict(batch.host), np.asarray(batch.rewards_nr)))
        return original(self, batch, logp, ref_logp, **kw)

    monkeypatch.setattr(trainer_mod.GRPOTrainer, "update", update)
    extra = {
        "total_steps": 1,
        "grpo.advantage_estimator": "gdpo",
        "checkpoint.every": 10,
        "log.tensorboard": "false",
        "log.plot": "false",
    }
    cfg = load_config(None, _overrides(small_model_dir, tmp_path / "run", **extra))
    specs = [
        RewardSpec(_has_digit_one, name="digit_one", mode="thread"),
        RewardSpec(_length_reward, weight=0.5, name="length", mode="thread"),
    ]
    result = train(cfg, reward_specs=specs, show_progress=False, print_fn=lambda s: None)
    assert result.steps == 1
    assert result.trainer.step_config.gdpo_weights == (1.0, 0.5)
    host, rewards_nr = seen[0]
    assert rewards_nr.shape == (8, 2)
    np.testing.assert_array_equal(host["rewards_nr"], rewards_nr)
    np.testing.assert_allclose(rewards_nr @ [1.0, 0.5], host["rewards_n"], rtol=1e-6)
    rl = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rl if "reward_mean" in r]
    for name in ("pg_loss", "grad_norm", "loss"):
        assert np.isfinite(rl[0][name]), name
    assert rl[0]["skipped"] == 0


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


_MESH_CHILD = """
import json, pathlib
from grpojax.config import load_config
from grpojax.driver.loop import METRIC_PANELS, train
from grpojax.rewards import RewardSpec
from grpojax.train.rows import Group, RowArrays, assemble_batch, empty_rows

def length_reward(prompts, completions, **_):
    return [min(len(c), 8) / 8.0 for c in completions]

base = {
    "model.source": MODEL, "total_steps": 2, "optimizer.warmup_steps": 0,
    "sft.steps": 2, "sft.batch_size": 8, "data.size": 64,
    "eval.heldout_size": 4, "eval.batch_size": 4, "eval.k": 1, "eval.temperature": 0.0,
    "rollout.prompts_per_step": 2, "rollout.max_new_tokens": 4, "grpo.group_size": 4,
    "rewards.mode": "thread", "checkpoint.every": 1,
    "log.tensorboard": "false", "log.plot": "false", "log.progress": "false",
}
meshes = {
    "data4": {"mesh.data": 4, "mesh.fsdp": 1},
    "fsdp2_tensor2": {"mesh.fsdp": 2, "mesh.tensor": 2},
    "fsdp2_context2": {"mesh.fsdp": 2, "mesh.context": 2},
}
for name, mesh in meshes.items():
    run_dir = pathlib.Path(ROOT) / name
    over = {**base, **mesh, "log.run_dir": str(run_dir)}
    result = train(
        load_config(None, [f"{k}={v}" for k, v in over.items()]),
        reward_specs=[RewardSpec(length_reward, name="length", mode="thread")],
        show_progress=False,
        print_fn=lambda s: None,
    )
    rl = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rl if "reward_mean" in r]
    keys = ("reward_mean", "completion_len_mean", "grad_norm", "entropy")
    print("RUN", json.dumps({
        "mesh": name,
        "steps": result.steps,
        "stopped_by": result.stopped_by,
        "checkpoints": sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir()
                              if p.name.isdigit()),
        "eval": [result.eval_before, result.eval_after],
        **{k: [r[k] for r in rl] for k in keys},
    }), flush=True)
"""


@pytest.mark.slow
@pytest.mark.multidevice
def test_train_on_model_parallel_meshes(small_model_dir, tmp_path):
    """`train` (SFT warm start, evaluation, 2 GRPO steps, a checkpoint after every SFT and RL
    step) completes on an fsdp=2 x tensor=2 mesh of 4 fake CPU devices (both model-parallel
    axes at once) and on fsdp=2 x context=2 (each sequence's tokens over 2 devices), and
    samples what the data-parallel mesh samples.

    Before checkpoint fingerprints became one program, the first checkpoint on a
    model-parallel mesh aborted the run (XLA:CPU's collective rendezvous timed out with 3 of
    4 devices waiting). Bound: the meshes differ only in float32 summation order, so the
    sampled completions are the same: per-step reward and completion length equal the
    data-parallel run's exactly, gradient norm and entropy within 1e-5 relative to the run's
    largest value (observed ~2e-7; a step whose groups all tie has a gradient norm of ~1e-7,
    pure rounding, which no relative bound on that entry alone can hold)."""
    code = f"ROOT = {str(tmp_path)!r}\nMODEL = {str(small_model_dir)!r}\n" + _MESH_CHILD
    out = run_with_devices(code, n_devices=4)
    runs = {r["mesh"]: r for r in (json.loads(x[4:]) for x in out.splitlines() if x[:4] == "RUN ")}
    assert sorted(runs) == ["data4", "fsdp2_context2", "fsdp2_tensor2"], out
    ref = runs["data4"]
    for name, run in runs.items():
        assert run["steps"] == 2 and run["stopped_by"] is None, run
        assert run["checkpoints"] == [0, 1, 2], run
        assert run["reward_mean"] == ref["reward_mean"], (name, run, ref)
        assert run["completion_len_mean"] == ref["completion_len_mean"], (name, run, ref)
        assert run["eval"] == ref["eval"], (name, run, ref)
        for key in ("grad_norm", "entropy"):
            scale = 1e-5 * np.max(np.abs(ref[key]))
            np.testing.assert_allclose(
                run[key], ref[key], rtol=0, atol=scale, err_msg=f"{name} {key}"
            )
    # The rewards vary, so the steps trained on a real signal.
    assert 0.0 < ref["reward_mean"][0] < 1.0, ref


# ----------------------------------------------------------------------------------------
# Host-side pieces against independent constructions
# ----------------------------------------------------------------------------------------


MESH = make_mesh(fsdp=1, devices=jax.devices()[:1])


def _group(rng, prompt_len, g=3, t=5, rewards=None, valid=None):
    lengths = rng.integers(1, t + 1, size=g).astype(np.int32)
    valid = np.asarray(valid if valid is not None else np.ones(g, bool))
    return Group(
        prompt_ids=[int(x) for x in rng.integers(4, 50, size=prompt_len)],
        lengths_g=lengths,
        eos_g=lengths < t,
        total_g=np.asarray(rewards if rewards is not None else rng.random(g), np.float32),
        valid_g=valid,
        per_fn={"f": np.where(valid, rng.random(g), np.nan).astype(np.float32)},
    )


def _rows(tokens_nt, offset=0.0):
    """RowArrays whose logp and thresholds are tokens + offset (rows recognisable)."""
    tokens = np.asarray(tokens_nt, np.int32)
    f = tokens.astype(np.float32) + offset
    return put_global(
        RowArrays(tokens, f, -f),
        RowArrays(*(batch_sharding(MESH, 2, tokens.shape),) * 3),
    )


def test_assemble_batch_layout_matches_a_loop_construction():
    rng = np.random.default_rng(0)
    groups = [_group(rng, 3), _group(rng, 9, valid=[True, False, True]), _group(rng, 5)]
    completions = rng.integers(4, 50, size=(9, 5))
    batch = assemble_batch(groups, _rows(completions), pad_id=0, mesh=MESH)
    p = 16  # longest prompt 9 -> next multiple of 8 (the compact bucket)
    tokens, mask = np.asarray(batch.tokens_ns), np.asarray(batch.mask_ns)
    cmask = np.asarray(batch.completion_mask_nt)
    assert tokens.shape == (9, p + 5)
    n = 0
    for gr in groups:
        for j in range(3):
            lp = len(gr.prompt_ids)
            expect_tok = [0] * (p - lp) + gr.prompt_ids + list(completions[n])
            expect_mask = [False] * (p - lp) + [True] * lp + [t < gr.lengths_g[j] for t in range(5)]
            assert tokens[n].tolist() == expect_tok
            assert mask[n].tolist() == expect_mask
            expect_c = [bool(gr.valid_g[j]) and t < gr.lengths_g[j] for t in range(5)]
            assert cmask[n].tolist() == expect_c
            n += 1
    assert not cmask[4].any()  # the failed sample trains on nothing
    np.testing.assert_array_equal(np.asarray(batch.sampler_logp_nt), completions)
    np.testing.assert_array_equal(batch.host["valid_n"], [1, 1, 1, 1, 0, 1, 1, 1, 1])


def test_group_json_round_trip_is_exact():
    rng = np.random.default_rng(1)
    gr = _group(rng, 4, valid=[True, False, True])
    gr.row = 6
    back = Group.from_json(json.loads(json.dumps(gr.to_json())))
    for f in ("lengths_g", "eos_g", "total_g", "valid_g"):
        np.testing.assert_array_equal(getattr(back, f), getattr(gr, f))
    np.testing.assert_array_equal(back.per_fn["f"], gr.per_fn["f"])
    assert back.prompt_ids == gr.prompt_ids and back.row == 6 and back.greedy_reward is None
    for greedy in (0.25, float("nan")):  # ReMax's baseline, also when its reward failed
        gr.greedy_reward = greedy
        back = Group.from_json(json.loads(json.dumps(gr.to_json())))
        np.testing.assert_array_equal(back.greedy_reward, greedy)


def test_assemble_batch_fills_the_estimators_batch_inputs():
    """greedy_rewards_n: each group's greedy reward on its G rows (a failed one, NaN, as 0
    on an invalid group); rewards_nr: the per-function rewards as columns, None as 0."""
    rng = np.random.default_rng(2)
    groups = [_group(rng, 3), _group(rng, 5, valid=[False] * 3)]
    groups[0].per_fn["g"] = np.float32([1.0, np.nan, 3.0])
    groups[1].per_fn["g"] = np.float32([4.0, 5.0, 6.0])
    groups[0].greedy_reward, groups[1].greedy_reward = 0.5, float("nan")
    rows = _rows(rng.integers(4, 50, size=(6, 5)))
    plain = assemble_batch(groups, rows, pad_id=0, mesh=MESH)
    assert plain.greedy_rewards_n is None and plain.rewards_nr is None
    batch = assemble_batch(
        groups, rows, pad_id=0, mesh=MESH, inputs=("greedy_rewards_n", "rewards_nr")
    )
    np.testing.assert_array_equal(np.asarray(batch.greedy_rewards_n), [0.5] * 3 + [0.0] * 3)
    f = [np.nan_to_num(gr.per_fn["f"]) for gr in groups]
    expect = np.stack([np.concatenate(f), [1, 0, 3, 4, 5, 6]], axis=1).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(batch.rewards_nr), expect)


class _FakeSampler:
    """Hands out prepared rounds of groups; round k's row r holds tokens 100 k + r."""

    def __init__(self, cfg, rounds):
        self.cfg, self.rounds, self.calls, self.mesh = cfg, list(rounds), 0, MESH

    def round(self, model, key, times, version=0):
        self.calls += 1
        groups = self.rounds.pop(0)
        g, t = 3, self.cfg.rollout.max_new_tokens
        for i, gr in enumerate(groups):
            gr.row = i * g
        n = len(groups) * g
        tokens = 100 * self.calls + np.repeat(np.arange(n)[:, None], t, axis=1)
        return groups, _rows(tokens), key, {}


def _ds_config(**extra):
    over = {
        "rollout.prompts_per_step": 2,
        "rollout.dynamic_sampling": "true",
        "rollout.max_resample_rounds": 2,
        "rollout.max_new_tokens": 4,
        "grpo.group_size": 3,
    }
    over.update(extra)
    return load_config(None, [f"{k}={v}" for k, v in over.items()])


def test_dynamic_sampling_drops_zero_variance_groups_and_buffers_surplus():
    rng = np.random.default_rng(2)
    flat = lambda: _group(rng, 4, rewards=[1.0, 1.0, 1.0])
    good = lambda: _group(rng, 4, rewards=[0.0, 1.0, 0.0])
    r1, r2 = [flat(), good()], [good(), good()]
    cfg = _ds_config()
    sampler = _FakeSampler(cfg, [r1, r2])
    ds = DriverState()
    empty = empty_rows(6, 4, MESH)
    groups, rows, buffer, _, _, rounds, _ = collect(sampler, None, ds, empty, None, {})
    assert rounds == 2 and sampler.calls == 2
    assert groups == [r1[1], r2[0]]  # kept in sampling order, the flat group dropped
    # Their rows, gathered on the devices: round 1 rows 3-5, round 2 rows 0-2.
    np.testing.assert_array_equal(np.asarray(rows.tokens_nt)[:, 0], [103, 104, 105, 200, 201, 202])
    assert ds.buffer == [r2[1]]  # surplus waits for the next step, at buffer row 0
    assert ds.buffer[0].row == 0
    np.testing.assert_array_equal(np.asarray(buffer.tokens_nt)[:3, 0], [203, 204, 205])
    assert ds.counters["dropped_groups"] == 1 and ds.counters["resample_rounds"] == 1
    # Next step starts from the buffer and needs one more round.
    sampler.rounds = [[good(), flat()]]
    groups2, rows2, _, _, _, rounds2, _ = collect(sampler, None, ds, buffer, None, {})
    assert rounds2 == 1 and groups2[0] is r2[1] and ds.buffer == []
    np.testing.assert_array_equal(np.asarray(rows2.tokens_nt)[:, 0], [203, 204, 205, 300, 301, 302])


def test_dynamic_sampling_with_a_staleness_bound_drops_only_stale_buffered_groups():
    """`collect(max_lag=k)` (pipelined rollouts): a buffered group drawn more than k steps
    before the step is not trained but counted; one within the bound is."""
    rng = np.random.default_rng(4)

    def good(version):
        gr = _group(rng, 4, rewards=[0.0, 1.0, 0.0])
        gr.version = version
        return gr

    old, recent = good(0), good(2)
    ds = DriverState(step=3, buffer=[old, recent])
    old.row, recent.row = 0, 3
    fresh = good(3)
    sampler = _FakeSampler(_ds_config(), [[fresh, good(3)]])
    groups, _, _, _, _, rounds, _ = collect(
        sampler, None, ds, empty_rows(6, 4, MESH), None, {}, max_lag=1
    )
    assert groups == [recent, fresh] and rounds == 1
    assert ds.counters["stale_dropped_groups"] == 1


def test_dynamic_sampling_fills_with_dropped_groups_when_rounds_run_out():
    rng = np.random.default_rng(3)
    flat = lambda: _group(rng, 4, rewards=[0.0, 0.0, 0.0])
    rounds_data = [[flat(), flat()] for _ in range(3)]
    sampler = _FakeSampler(_ds_config(), rounds_data)
    ds = DriverState()
    groups, _, _, _, _, rounds, _ = collect(sampler, None, ds, empty_rows(6, 4, MESH), None, {})
    # 1 round + max_resample_rounds=2 extra rounds, then the batch keeps its static shape.
    assert rounds == 3 and len(groups) == 2
    assert ds.counters["zero_var_fill_groups"] == 2


@pytest.mark.parametrize(
    "over, strategy, slots",
    [
        ({}, "overlapped", 0),
        ({"rollout.overlap_rewards": "false"}, "sequential", 0),
        ({"algo": "dapo"}, "sequential", 0),  # dynamic sampling: rounds until B groups
        ({"rollout.stop_strings": "[x]"}, "sequential", 0),  # scoring cuts completions
        ({"rollout.max_staleness": 2}, "pipelined", 2),
        ({"rollout.max_staleness": 2, "rollout.partial": "true"}, "pipelined", 0),
    ],
)
def test_rollouts_choose_their_strategy_once_and_hold_the_checkpoint_rollout_arrays(
    over, strategy, slots
):
    """`Rollouts` picks how a run's samples are produced from the config alone, and its
    checkpoint arrays have the restore target's structure: N-row buffer, k pending slots
    (partial rollouts: one window of the rounds in flight instead)."""
    from grpojax.driver.packing import build_packer
    from grpojax.driver.setup import build_datasets, build_reward_manager, prompt_source
    from grpojax.models import builtin_tokenizer
    from grpojax.rollouts.strategy import Rollouts, rollout_arrays

    base = {"rollout.prompts_per_step": 2, "grpo.group_size": 4, "rollout.max_new_tokens": 4}
    cfg = load_config(None, [f"{k}={v}" for k, v in {**base, **over}.items()])
    tok = builtin_tokenizer()
    rows, _ = build_datasets(cfg, tok)
    manager = build_reward_manager(cfg)
    rollouts = Rollouts(
        cfg,
        tok,
        prompt_source(cfg, rows, tok),
        manager,
        train_mesh=MESH,
        sample_mesh=None,
        packer=build_packer(cfg, MESH),
    )
    try:
        assert rollouts.strategy == strategy
        assert (rollouts.pipe is not None) == (strategy == "pipelined")
        ds = DriverState()
        arrays = rollouts.arrays(ds)
        partial = strategy == "pipelined" and slots == 0  # one window, not k row slots
        assert ds.pending == [] and len(arrays["pending"]) == (1 if partial else slots)
        assert arrays["buffer"].tokens_nt.shape == (cfg.samples_per_step, 4)
        target = rollout_arrays(cfg, MESH)
        got = (arrays["buffer"], arrays["pending"])
        assert jax.tree.structure(target) == jax.tree.structure(got)
        assert [x.shape for x in jax.tree.leaves(target)] == [x.shape for x in jax.tree.leaves(got)]
    finally:
        rollouts.close()
        manager.close()
