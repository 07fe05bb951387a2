"""Pipelined rollouts (`rollout.max_staleness`, `grpojax.rollouts.pipeline`), single-turn and
multi-turn: every round is trained once, exactly k steps after the weights that drew it; the
sampler drew with the weights whose version it reports; a stopped and resumed run equals the
uninterrupted one; the configuration's refusals and default correction."""

import json

import jax
import numpy as np
import pytest
from multidevice import run_with_devices
from test_driver_envs import _overrides as _env_overrides
from test_driver_loop import _overrides

from grpojax.config import load_config
from grpojax.driver.checkpoint import Checkpointer, host_copy, saved_steps
from grpojax.driver.loop import train
from grpojax.driver.setup import build_mesh, build_model
from grpojax.driver.trainer import checkpoint_target, make_trainer
from grpojax.errors import UserError
from grpojax.models.tokenizer import PAD_ID
from grpojax.train.rows import Group, assemble_batch

K = 2
STEPS = 3
B, G = 2, 4
QUIET = dict(show_progress=False, print_fn=lambda s: None)


def _cfg(kind, model_dir, run_dir, **extra):
    over = {
        "rollout.max_staleness": K,
        "total_steps": STEPS,
        "optimizer.warmup_steps": 1,
        "optimizer.learning_rate": "1e-2",  # versions far enough apart to tell them apart
        "checkpoint.keep": STEPS + 2,
        "eval.heldout_size": 2,
        "eval.batch_size": 2,
        "eval.k": 1,
        **extra,
    }
    overrides = _overrides if kind == "single_turn" else _env_overrides
    return load_config(None, overrides(model_dir, run_dir, **over))


@pytest.fixture(scope="module", params=["single_turn", "episodes"])
def uninterrupted(request, small_model_dir, tmp_path_factory):
    """(kind, run directory, config, a trainer, the checkpoints' restore target) of an
    uninterrupted run: single-turn (rewards scored on the worker thread) or multi-turn
    (episodes played on the worker thread with a copy of the weights)."""
    kind = request.param
    run_dir = tmp_path_factory.mktemp("pipeline") / "run"
    cfg = _cfg(kind, small_model_dir, run_dir)
    result = train(cfg, **QUIET)
    assert result.steps == STEPS and result.stopped_by is None
    mesh = build_mesh(cfg)
    model, _ = build_model(cfg, mesh=mesh)
    trainer = make_trainer(cfg, model, mesh)
    return kind, run_dir, cfg, trainer, checkpoint_target(trainer, mesh)


def _restore(run_dir, target):
    abstract, shardings = target
    with Checkpointer(run_dir / "checkpoints", async_save=False) as ckpt:
        return {
            s: ckpt.restore(s, abstract, shardings=shardings)
            for s in saved_steps(run_dir / "checkpoints")
        }


def _metrics(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _assert_same_run(run_dir, other, target):
    """Every checkpoint of the two runs bit-exact (arrays and driver state, reward timings
    aside) and their metrics equal (timings aside)."""
    want, got = _restore(run_dir, target), _restore(other, target)
    assert sorted(got) == sorted(want)

    def untimed_state(driver):  # the queued rounds' reward timings (time_s, handover_s) vary
        out = {k: v for k, v in driver.items() if k != "config"}
        untimed = lambda stats: {k: v for k, v in stats.items() if not k.endswith("_s")}
        # (partial rollouts' rounds in flight hold only their data position: no stats)
        out["pending"] = [
            {**p, **({"stats": untimed(p["stats"])} if "stats" in p else {})}
            for p in out.get("pending", [])
        ]
        return out

    for step in want:
        a, b = want[step], got[step]
        assert untimed_state(a.driver_state) == untimed_state(b.driver_state), step
        la, ta = jax.tree.flatten(host_copy(a.state))
        lb, tb = jax.tree.flatten(host_copy(b.state))
        assert ta == tb
        for x, y in zip(la, lb):
            np.testing.assert_array_equal(x, y)  # bit-exact

    def untimed(run):
        timing = ("time", "elapsed_s", "step_time_s", "tokens_per_s")
        return [
            {k: v for k, v in m.items() if k not in timing and not k.startswith("time/")}
            for m in _metrics(run)
        ]

    assert untimed(other) == untimed(run_dir)


def test_every_round_is_trained_once_k_steps_after_its_weights(uninterrupted):
    _, run_dir, cfg, _, target = uninterrupted
    # On by default with staleness: derived into the step, the config's field left unset.
    assert cfg.step_config.rollout_correction_mode == "truncate"
    assert cfg.grpo.rollout_correction_mode is None
    steps = [m for m in _metrics(run_dir) if "staleness/max" in m]
    assert [m["step"] for m in steps] == list(range(1, STEPS + 1))
    for m in steps:  # step s trains round s, drawn by the weights of step max(0, s - k)
        s = m["step"] - 1
        assert m["staleness/max"] == m["staleness/mean"] == min(s, K)
        assert 0 < m["rollout_weight_mean"] <= 2.0  # the truncated IS weights, logged
    ckpts = _restore(run_dir, target)
    assert sorted(ckpts) == list(range(STEPS + 1))
    seen = []
    for step, r in ckpts.items():
        pending = r.driver_state.get("pending", [])
        # After step m: rounds m .. m+k-1 queued, round r drawn at version max(0, r - k),
        # and the data source has handed out exactly the prompts of rounds 0 .. m+k-1.
        assert len(pending) == (K if step else 0)
        groups = [[Group.from_json(g) for g in p["groups"]] for p in pending]
        assert [{g.version for g in gs} for gs in groups] == [
            {max(0, step + i - K)} for i in range(len(pending))
        ]
        drawn = step + K if step else 0
        assert r.driver_state["data"]["index"] == drawn * B
        seen.append([tuple(g.prompt_ids) for gs in groups for g in gs])
    # With k = 2, checkpoint m queues rounds m and m + 1: round m + 1 is queued again,
    # unchanged, at checkpoint m + 1, then trained by step m + 1.
    for m in range(1, STEPS):
        assert seen[m][B:] == seen[m + 1][:B]


def test_the_sampler_drew_with_the_weights_of_the_version_it_reports(uninterrupted):
    _, run_dir, _, trainer, target = uninterrupted
    ckpts = _restore(run_dir, target)
    step = STEPS  # the last checkpoint: rounds drawn at versions STEPS - k and STEPS - k + 1
    r = ckpts[step]
    for i, p in enumerate(r.driver_state["pending"]):
        groups = [Group.from_json(g) for g in p["groups"]]
        rows = r.state.pending[i]
        version = groups[0].version
        batch = assemble_batch(groups, rows, pad_id=PAD_ID, mesh=trainer.mesh)
        mask = np.asarray(batch.completion_mask_nt)
        sampler = np.asarray(batch.sampler_logp_nt)
        diffs = {}
        for v in (version, step):
            trainer.state = trainer.with_checkpoint_state(ckpts[v].state.train)
            logp, _, _ = trainer.logprobs(batch)
            diffs[v] = np.abs(np.asarray(logp) - sampler)[mask].max()
        # float32 sampler vs trainer program: 1e-5, as for the on-policy sampler; the
        # newer weights' logprobs are far from the sampler's.
        assert diffs[version] <= 1e-5, diffs
        assert diffs[step] > 1e-3, diffs


def test_stopped_and_resumed_equals_uninterrupted(uninterrupted, small_model_dir, tmp_path):
    kind, run_dir, _, _, target = uninterrupted
    other = tmp_path / "run"
    first = train(_cfg(kind, small_model_dir, other), stop_after=1, **QUIET)
    assert first.stopped_by == "stop_after" and first.steps == 1
    second = train(_cfg(kind, small_model_dir, other, **{"checkpoint.resume": "true"}), **QUIET)
    assert second.steps == STEPS
    _assert_same_run(run_dir, other, target)


def test_split_placement_equals_interleaved(uninterrupted, small_model_dir, tmp_path):
    """Split placement gives the interleaved run, bit for bit (every checkpoint's arrays,
    the queued rounds' rows included, driver state and metrics): the same rounds from the
    same versions, the same updates; and every version is sampled from a copy on the
    rollout devices, never from the trainer's weights.

    Single-turn: `mesh.rollout_devices=2` on 4 fake devices (the trainer on devices 0-1,
    fsdp 2; the sampler on devices 2-3, rows over data 2, the weights resharded to that
    layout after each update, rows copied back) against the interleaved loop on devices
    0-1 (`_split_devices` hands it those alone, as a 2-device process would have), in the
    same child. Multi-turn: `mesh.rollout_devices=1` on 2 fake devices against the
    in-process run on one device (on 2 + 2, the multi-turn engine's logprobs round
    differently on the replicated layout than on the fsdp one, by <= 4.8e-7)."""
    kind, run_dir, _, _, target = uninterrupted
    n_devices, n_rollout = (4, 2) if kind == "single_turn" else (2, 1)
    reference = tmp_path / "interleaved" if kind == "single_turn" else run_dir
    split = tmp_path / "split"
    run_with_devices(
        f"""
        import pathlib
        from flax import nnx
        from test_driver_pipeline import QUIET, STEPS, _cfg
        from grpojax.driver import setup
        from grpojax.rollouts import pipeline
        from grpojax.driver.loop import train

        def run(out, **extra):
            cfg = _cfg({kind!r}, pathlib.Path({str(small_model_dir)!r}), pathlib.Path(out), **extra)
            result = train(cfg, **QUIET)
            assert result.steps == STEPS and result.stopped_by is None, result

        if {kind == "single_turn"}:
            split_devices = setup._split_devices
            setup._split_devices = lambda cfg: (jax.devices()[:2], [])
            run({str(reference)!r})
            setup._split_devices = split_devices

        copies = []  # (version, the devices its copy's leaves are on)
        transfer = pipeline.RolloutPipeline.rollout_weights
        def spy(self, model, version, times=None):
            out = transfer(self, model, version, times)
            leaves = jax.tree.leaves(nnx.state(out))
            copies.append((version, {{d.id for x in leaves for d in x.devices()}}))
            return out
        pipeline.RolloutPipeline.rollout_weights = spy
        run({str(split)!r}, **{{"mesh.rollout_devices": {n_rollout}}})
        rollout = set(range({n_devices - n_rollout}, {n_devices}))
        assert sorted({{v for v, _ in copies}}) == list(range(STEPS)), copies
        assert all(devices == rollout for _, devices in copies), copies
        """,
        n_devices=n_devices,
    )
    _assert_same_run(reference, split, target)
    # Split runs log the copy's seconds every step (one version each), interleaved ones not.
    logged = [json.loads(x) for x in (split / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in logged if "reward_mean" in r]
    assert len(steps) == STEPS and all(r["time/weight_transfer"] > 0 for r in steps), steps
    logged = [json.loads(x) for x in (reference / "metrics.jsonl").read_text().splitlines()]
    assert not any("time/weight_transfer" in r for r in logged)


@pytest.mark.parametrize(
    "extra, match",
    [
        ({"algo": "ppo"}, "needs a GRPO-family algo"),
        ({"rollout.staleness_correction": "tis"}, "staleness_correction must be one of"),
        ({"rollout.max_staleness": -1}, "max_staleness"),
        ({"rollout.max_staleness": 0, "mesh.rollout_devices": 1}, "rollout_devices=1 needs"),
        ({"mesh.rollout_devices": -1}, "rollout_devices must be"),
    ],
)
def test_refusals_name_the_field(extra, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        load_config(None, [f"{k}={v}" for k, v in {"rollout.max_staleness": 1, **extra}.items()])


def test_rollout_devices_must_leave_training_devices():
    cfg = load_config(
        None, ["rollout.max_staleness=1", f"mesh.rollout_devices={jax.device_count()}"]
    )
    with pytest.raises(UserError, match=r"mesh.rollout_devices=1 leaves no device to train on"):
        build_mesh(cfg)


def test_default_correction_applies_only_when_stale_and_unset():
    def mode(**over):
        cfg = load_config(None, [f"{k}={v}" for k, v in over.items()])
        return cfg.step_config.rollout_correction_mode

    assert mode() is None
    assert mode(**{"rollout.max_staleness": 1}) == "truncate"
    assert mode(**{"rollout.max_staleness": 1, "rollout.staleness_correction": "none"}) is None
    assert mode(**{"rollout.max_staleness": 1, "rollout.staleness_correction": "icepop"}) == (
        "icepop"
    )
    explicit = {"rollout.max_staleness": 2, "grpo.rollout_correction_mode": "mask"}
    assert mode(**explicit) == "mask"  # the user's own choice wins


def _odd_text(prompts, completions, **_):
    """A reward with variance for about half the prompts (those whose text's code points sum
    to an odd number: each completion's own sum, odd or even) and none for the others, so
    dynamic sampling drops groups and tops rounds up."""
    return [
        float(sum(map(ord, p)) % 2 and sum(map(ord, c)) % 2) for p, c in zip(prompts, completions)
    ]


def test_dynamic_sampling_with_rounds_ahead(small_model_dir, tmp_path):
    """algo dapo with `rollout.max_staleness=1`: the top-up rounds a step needs beyond the
    queue are sampled with its own weights (lag 0), so every trained group is within the
    bound (its lag logged) and no step stops for want of a queued round; buffered groups
    past the bound are counted; a run stopped and resumed equals the uninterrupted one."""
    from grpojax.rewards import RewardSpec

    quiet = {**QUIET, "reward_specs": [RewardSpec(_odd_text, name="odd_text", mode="thread")]}
    over = {"algo": "dapo", "rollout.max_staleness": 1, "rollout.max_resample_rounds": 2}
    over["total_steps"] = steps = 5
    over["checkpoint.keep"] = steps + 2
    run_dir = tmp_path / "a"
    cfg = _cfg("single_turn", small_model_dir, run_dir, **over)
    assert train(cfg, **quiet).steps == steps
    logged = [m for m in _metrics(run_dir) if "staleness/max" in m]
    # Steps topped up beyond the queue (3 rounds: the 2 queued, 1 sampled then), lags of 0
    # and 1 (the queued round drawn a step before), flat groups dropped and counted.
    assert max(m["ds_rounds"] for m in logged) > 1
    assert {m["staleness/max"] for m in logged} == {0.0, 1.0}
    assert logged[-1]["total/dropped_groups"] > 0
    other = tmp_path / "b"
    first = train(_cfg("single_turn", small_model_dir, other, **over), stop_after=1, **quiet)
    assert first.stopped_by == "stop_after"
    resume = {**over, "checkpoint.resume": "true"}
    assert train(_cfg("single_turn", small_model_dir, other, **resume), **quiet).steps == steps
    mesh = build_mesh(cfg)
    model, _ = build_model(cfg, mesh=mesh)
    _assert_same_run(run_dir, other, checkpoint_target(make_trainer(cfg, model, mesh), mesh))


def test_a_checkpoint_holds_the_prompts_of_episodes_still_being_played(
    small_model_dir, tmp_path, monkeypatch
):
    """A round of episodes draws its prompts on the worker thread that plays it: with that
    thread slow to start, each checkpoint's data position still counts every queued
    round's prompts (the position is taken after the queued rounds are done)."""
    import time

    from grpojax.rollouts.episodes import EpisodeSampler

    real = EpisodeSampler.sample_round

    def slow_to_draw(self, *args, **kwargs):
        time.sleep(0.5)  # the main thread reaches the checkpoint first
        return real(self, *args, **kwargs)

    monkeypatch.setattr(EpisodeSampler, "sample_round", slow_to_draw)
    run_dir = tmp_path / "run"
    cfg = _cfg("episodes", small_model_dir, run_dir, total_steps=2)
    assert train(cfg, **QUIET).steps == 2
    mesh = build_mesh(cfg)
    model, _ = build_model(cfg, mesh=mesh)
    ckpts = _restore(run_dir, checkpoint_target(make_trainer(cfg, model, mesh), mesh))
    assert [c.driver_state["data"]["index"] for c in ckpts.values()] == [
        (step + K if step else 0) * B for step in ckpts
    ]
