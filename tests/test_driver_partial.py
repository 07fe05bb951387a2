"""Partial rollouts in the loop (`rollout.partial=true`, `grpojax.rollouts.partial`): every
trained token within k steps of the weights that decoded it, samples continued across
updates, the window of rounds in flight checkpointed and a run stopped mid-round resumed
bit-exactly; the configuration's refusals."""

import jax
import numpy as np
import pytest
from test_driver_pipeline import QUIET, _assert_same_run, _cfg, _metrics, _restore

from grpojax.config import load_config
from grpojax.driver.loop import train
from grpojax.driver.setup import build_mesh, build_model
from grpojax.driver.trainer import checkpoint_target, make_trainer

K = 2
STEPS = 4
N = 8  # 2 prompts x 4 samples
# 3 slots for the 3 rounds' 24 samples in flight: each call ends with up to 3 samples of the
# later rounds part-decoded, continued by the next step's weights.
PARTIAL = {
    "rollout.partial": "true",
    "rollout.max_staleness": K,
    "rollout.slots": 3,
    "rollout.max_new_tokens": 12,
    "total_steps": STEPS,
}


@pytest.fixture(scope="module")
def uninterrupted(small_model_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("partial") / "run"
    cfg = _cfg("single_turn", small_model_dir, run_dir, **PARTIAL)
    result = train(cfg, **QUIET)
    assert result.steps == STEPS and result.stopped_by is None
    mesh = build_mesh(cfg)
    model, _ = build_model(cfg, mesh=mesh)
    return run_dir, cfg, checkpoint_target(make_trainer(cfg, model, mesh), mesh)


def test_every_token_is_within_k_steps_of_its_weights(uninterrupted):
    """Logged per step: the groups' lags (their oldest token's) and every token's, within
    [0, k]; later steps train tokens of several versions; the correction is on."""
    run_dir, cfg, _ = uninterrupted
    assert cfg.step_config.rollout_correction_mode == "truncate"
    steps = [m for m in _metrics(run_dir) if "staleness/token_max" in m]
    assert [m["step"] for m in steps] == list(range(1, STEPS + 1))
    for m in steps:
        s = m["step"] - 1
        assert 0 <= m["staleness/token_mean"] <= m["staleness/token_max"] <= min(s, K)
        assert m["staleness/max"] <= min(s, K)  # a group's lag: its oldest token's
        assert 0 < m["decode_utilisation"] <= 1
    assert steps[0]["staleness/token_max"] == 0  # round 0: version 0 only
    # Round s is decoded by versions s - k .. s: some tokens older than the step's own.
    assert max(m["staleness/token_max"] for m in steps[1:]) >= 1
    assert any(0 < m["staleness/token_mean"] < m["staleness/token_max"] for m in steps[1:])


def test_the_window_holds_the_rounds_in_flight(uninterrupted):
    """After step m the checkpoint's window holds rounds m .. m + k - 1, part-decoded by
    versions <= m, with the source's position before each (k rounds of B prompts apart);
    the checkpoint before step 0 an empty window."""
    run_dir, _, target = uninterrupted
    ckpts = _restore(run_dir, target)
    assert sorted(ckpts) == list(range(STEPS + 1))
    for step, r in ckpts.items():
        (window,) = r.state.pending
        pending = r.driver_state.get("pending", [])
        if step == 0:
            assert pending == [] and int(window.admitted) == 0
            continue
        assert [p["data"]["index"] for p in pending] == [(step + i) * 2 for i in range(K)]
        assert r.driver_state["data"]["index"] == (step + K) * 2
        lengths = np.asarray(window.lengths_m)
        versions = np.asarray(window.version_mt)
        decoded = np.arange(versions.shape[1])[None, :] < lengths[:, None]
        assert decoded.any()  # the next rounds were started
        assert versions[decoded].max() <= step - 1 and versions[~decoded].max(initial=0) == 0
        live = np.asarray(window.slot_sample_s)
        live = live[live >= 0]
        ended = np.asarray(window.ended_m)
        assert not ended[live].any() and (lengths[live] >= 1).all()
        assert int(window.admitted) <= K * N


def test_stopped_mid_round_and_resumed_equals_uninterrupted(
    uninterrupted, small_model_dir, tmp_path
):
    """Stopped after step 1 (a weight update with samples in flight, part-decoded by
    versions 0 and 1), resumed: every checkpoint (the window included) bit-exact and the
    metrics equal."""
    run_dir, _, target = uninterrupted
    other = tmp_path / "run"
    first = train(_cfg("single_turn", small_model_dir, other, **PARTIAL), stop_after=1, **QUIET)
    assert first.stopped_by == "stop_after" and first.steps == 1
    (window,) = _restore(other, target)[1].state.pending
    assert (np.asarray(window.slot_sample_s) >= 0).any()  # samples were in flight
    resumed = {**PARTIAL, "checkpoint.resume": "true"}
    second = train(_cfg("single_turn", small_model_dir, other, **resumed), **QUIET)
    assert second.steps == STEPS
    _assert_same_run(run_dir, other, target)


def test_rewards_waited_for_equal_rewards_beside_the_logprob_pass(
    uninterrupted, small_model_dir, tmp_path
):
    """`rollout.overlap_rewards=false` (each round's rewards waited for before its batch)
    gives the run whose rewards were computed beside the logprob pass, bit for bit."""
    run_dir, _, target = uninterrupted
    other = tmp_path / "run"
    over = {**PARTIAL, "rollout.overlap_rewards": "false"}
    assert train(_cfg("single_turn", small_model_dir, other, **over), **QUIET).steps == STEPS
    _assert_same_run(run_dir, other, target)


@pytest.mark.parametrize(
    "extra, match",
    [
        ({"rollout.max_staleness": 0}, "partial=true needs max_staleness >= 1"),
        ({"rollout.engine": "static"}, r"rollout.engine='static'"),
        ({"algo": "dapo"}, "dynamic sampling"),
        ({"grpo.advantage_estimator": "remax"}, "ReMax's greedy round"),
        ({"mesh.rollout_devices": 1}, r"mesh.rollout_devices=1"),
        ({"rollout.partial": "maybe"}, "invalid value for 'rollout.partial'"),
    ],
)
def test_refusals_name_the_field(extra, match):
    over = {"rollout.partial": "true", "rollout.max_staleness": 1, **extra}
    with pytest.raises(ValueError, match=match):
        load_config(None, [f"{k}={v}" for k, v in over.items()])


def test_the_decoders_slots_and_width_come_from_the_config():
    from grpojax.rollouts.partial import partial_decoder

    over = {"rollout.partial": "true", "rollout.max_staleness": 3, "rollout.slots": 5}
    cfg = load_config(None, [f"{k}={v}" for k, v in over.items()])
    decoder = partial_decoder(cfg, (7,), 0, None)
    assert decoder.k == 3 and decoder.spec.slots == 5
    assert decoder.p == cfg.data.max_prompt_tokens and decoder.spec.stop_ids == (7,)
    window = decoder.window()
    m = 3 * cfg.samples_per_step
    assert window.tokens_mt.shape == (m, cfg.rollout.max_new_tokens)
    assert jax.tree.leaves(window)[0].shape == (3, cfg.rollout.prompts_per_step, decoder.p)


def test_each_windowed_token_is_its_versions(uninterrupted):
    """The checkpoints' rounds in flight: every decoded token's recorded logprob is the one
    a full forward of the weights of its recorded version gives (those checkpointed after
    that many steps; float32 rounding, 1e-5), and far from the newest weights'."""
    from grpojax.ops.logprobs import token_logprobs

    run_dir, cfg, target = uninterrupted
    ckpts = _restore(run_dir, target)
    mesh = build_mesh(cfg)
    model, _ = build_model(cfg, mesh=mesh)
    trainer = make_trainer(cfg, model, mesh)
    g = cfg.group_size
    seen = set()
    for step in range(1, STEPS + 1):
        (window,) = ckpts[step].state.pending
        k, b, p = window.prompts_qbp.shape
        prompts = np.repeat(np.asarray(window.prompts_qbp).reshape(k * b, p), g, axis=0)
        plen = np.repeat(np.asarray(window.lengths_qb).reshape(-1), g)
        tokens, lengths = np.asarray(window.tokens_mt), np.asarray(window.lengths_m)
        t = tokens.shape[1]
        decoded = np.arange(t)[None, :] < lengths[:, None]
        mask = np.concatenate([np.arange(p)[None, :] >= (p - plen)[:, None], decoded], axis=1)
        seq = np.concatenate([prompts, tokens], axis=1)
        positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
        versions, recorded = np.asarray(window.version_mt), np.asarray(window.logp_mt)

        def forward(version, seq=seq, mask=mask, positions=positions, p=p, t=t, tokens=tokens):
            trainer.state = trainer.with_checkpoint_state(ckpts[version].state.train)
            policy = trainer.policy()
            hidden, _ = policy(seq, positions_nt=positions, mask_nt=mask)
            logits = policy.logits(hidden)[:, p - 1 : p - 1 + t]
            return np.asarray(token_logprobs(logits, tokens))

        for v in np.unique(versions[decoded]):
            assert v < step
            seen.add(int(v))
            at = decoded & (versions == v)
            np.testing.assert_allclose(recorded[at], forward(int(v))[at], atol=1e-5)
            # The check tells versions apart: the newest weights' logprobs are far.
            assert np.abs(recorded[at] - forward(STEPS)[at]).max() > 1e-3
    assert len(seen) >= 3  # versions 0 .. STEPS - 1 decoded tokens left in flight
