"""Run set-up: the RNG tree (named purposes, no seed offsets) and reward-function wiring."""

import dataclasses

import jax
import numpy as np
import pytest

from grpojax import rewards
from grpojax.config import load_config
from grpojax.driver.setup import build_reward_manager
from grpojax.rng import PURPOSES, numpy_rng, run_key, run_seed


def _bits(key) -> tuple[int, ...]:
    return tuple(int(x) for x in np.asarray(jax.random.key_data(key)).ravel())


def test_every_purpose_has_its_own_stream_and_no_stream_is_a_seed_offset():
    keys = {p: _bits(run_key(3, p)) for p in PURPOSES}
    assert len(set(keys.values())) == len(PURPOSES)
    # Seed s's streams are none of seed s+1's, s+2's ... (the old `seed + offset` pattern).
    others = {_bits(run_key(3 + d, p)) for d in range(1, 4) for p in PURPOSES}
    assert not set(keys.values()) & others
    # Independent of the order or number of purposes asked for: a pure function.
    assert _bits(run_key(3, "sample")) == keys["sample"]
    assert run_seed(3, "data") == run_seed(3, "data") >= 0
    a, b = numpy_rng(3, "sft_order", 0).random(4), numpy_rng(3, "sft_order", 1).random(4)
    assert not np.allclose(a, b)


def test_unknown_purpose_is_refused():
    with pytest.raises(ValueError, match="unknown RNG purpose 'sampel'"):
        run_key(0, "sampel")


def test_code_execution_without_filesystem_isolation_stops_at_set_up(monkeypatch):
    caps = rewards.sandbox_capabilities()
    weak = dataclasses.replace(caps, filesystem_isolation=False, filesystem_note="no Landlock")
    monkeypatch.setattr(rewards, "sandbox_capabilities", lambda: weak)
    monkeypatch.setattr(rewards.sandbox, "sandbox_capabilities", lambda: weak)
    cfg = load_config(None, ["rewards.names=[code_execution]", "rewards.mode=inline"])
    with pytest.raises(ValueError, match=r"rewards\.sandbox_accept_weak_isolation=true"):
        build_reward_manager(cfg)
    ok = load_config(
        None,
        [
            "rewards.names=[code_execution]",
            "rewards.mode=inline",
            "rewards.sandbox_accept_weak_isolation=true",
        ],
    )
    build_reward_manager(ok).close()


def test_auto_remat_resolves_from_the_run_and_the_device_memory(monkeypatch):
    """`model.remat=auto` (the default) builds the policy with "dots_no_batch" where the
    device reports no memory (a CPU) or where one micro-batch's projections fit half of it,
    and with "full" where they do not: 8 prompts x 8 samples over 2 micro-batches of 1 + 1
    mini-batch = 32 rows of 128 + 32 tokens a forward on one device."""
    from grpojax.driver import setup
    from grpojax.models.config import kept_projection_bytes

    cfg = load_config(None, ["grpo.num_microbatches=2"])
    assert cfg.model.remat == "auto"
    policy = lambda: setup.build_model(cfg)[0].config.remat
    assert policy() == "dots_no_batch"  # the CPU reports no memory
    kept = kept_projection_bytes(setup.build_model(cfg)[0].config, 32 * (128 + 32))
    monkeypatch.setattr(setup, "device_memory_bytes", lambda: 2 * kept)
    assert policy() == "dots_no_batch"
    monkeypatch.setattr(setup, "device_memory_bytes", lambda: 2 * kept - 2)
    assert policy() == "full"
    cfg = load_config(None, ["grpo.num_microbatches=2", "model.remat=dots"])
    assert policy() == "dots"
