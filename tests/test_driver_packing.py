"""The driver's packing policy, and a reduced long-sequence run of `grpojax train`.

`Packer.plan` decides from the rows' lengths alone: `auto` packs when that removes at least
`min_saved_tokens` positions and a fifth of them, `always` and `never` do as they say, and
the padded fraction it reports is counted by hand here. The run: completions of up to 512
tokens from a random 1-layer model (long-tailed: the low temperature makes EOS rare), packed
rows and the blockwise attention in every forward; the sampler's logprobs must still equal
the trainer's (float32, 1e-5), as in the unpacked runs.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from grpojax.config import PackingSpec, load_config
from grpojax.driver.loop import train
from grpojax.driver.packing import Packer


def _packer(mode, min_saved=4096, share=False):
    spec = PackingSpec(mode=mode, min_saved_tokens=min_saved)
    return Packer(spec, group_size=4, share_prompt=share, rows_multiple=1, mesh=None)


def test_plan_decides_from_lengths_and_reports_the_padding():
    """8 rows (2 groups of 4), P = 4, T = 100; prompts of 3 tokens, completions 100, 10, 5,
    5 in each group: 8*3 + 2*120 = 264 real tokens among 8*104 = 832 unpacked positions.

    The packed width is chosen per batch: whole sequences (103, 13, 8, 8 twice) fill one
    row of 272 (264 rounded up to 5 significant bits) as well as two of 136, and three rows
    could not be narrower than the longest sequence (104 wide); the group layout (two
    groups of 3 + 120 tokens) fills one row of 248."""
    prompt = np.full(8, 3)
    comp = np.tile([100, 10, 5, 5], 2)
    none, padded = _packer("never").plan(prompt, comp, 4, 100)
    assert none is None and padded == pytest.approx(1 - 264 / 832)
    assert _packer("auto").plan(prompt, comp, 4, 100)[0] is None  # 560 saved: too few
    packing, padded = _packer("auto", min_saved=560).plan(prompt, comp, 4, 100)
    assert packing.src_rw.shape == (1, 272) and padded == pytest.approx(1 - 264 / 272)
    assert packing.parent_rw is None
    assert _packer("auto", min_saved=561).plan(prompt, comp, 4, 100)[0] is None
    # With share_prompt the unpacked forward runs each prompt once: 2*4 + 8*100 = 808
    # positions, 246 real; the group layout needs fewer positions than whole sequences.
    packing, padded = _packer("always", share=True).plan(prompt, comp, 4, 100)
    assert packing.src_rw.shape == (1, 248) and padded == pytest.approx(1 - 246 / 248)
    assert packing.parent_rw is not None
    assert _packer("never", share=True).plan(prompt, comp, 4, 100)[1] == pytest.approx(
        1 - 246 / 808
    )
    # One group of 8 balances badly over 2 rows (rows_multiple 2); whole sequences win.
    spec = PackingSpec(mode="always")
    packer = Packer(spec, group_size=8, share_prompt=True, rows_multiple=2, mesh=None)
    packing, _ = packer.plan(prompt, comp, 4, 100)
    assert packing.parent_rw is None and packing.src_rw.shape == (2, 136)


@pytest.mark.slow
def test_long_completion_run_packs_and_keeps_sampler_trainer_agreement(small_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    overrides = {
        "model.source": str(small_model_dir),
        "model.attention": "blockwise",
        "log.run_dir": str(run_dir),
        "log.progress": "false",
        "data.name": "chain3",
        "data.size": "200",
        "rollout.prompts_per_step": "2",
        "rollout.max_new_tokens": "512",
        "grpo.group_size": "4",
        "grpo.num_microbatches": "2",
        "sampling.temperature": "0.3",
        "grpo.forward.temperature": "0.3",
        "packing.mode": "always",
        "total_steps": "2",
        "optimizer.warmup_steps": "0",
        "eval.heldout_size": "2",
        "eval.batch_size": "2",
        "eval.k": "1",
        "checkpoint.every": "2",
        "checkpoint.async_save": "false",
        "rewards.mode": "thread",
        "sft.steps": "0",
    }
    cfg = load_config(None, [f"{k}={v}" for k, v in overrides.items()])
    result = train(cfg, show_progress=False, print_fn=lambda s: None)
    assert result.steps == 2 and result.stopped_by is None
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in records if "reward_mean" in r]
    assert len(rl) == 2
    for r in rl:
        assert r["packed"] == 1.0 and 0.0 <= r["padded_frac"] < 1.0
        assert r["completion_len_max"] > 100  # long completions
        assert r["logprob_diff_max"] <= 1e-5
        assert np.isfinite(r["loss"]) and r["grad_norm"] > 0
