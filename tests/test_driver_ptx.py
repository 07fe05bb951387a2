"""PPO-ptx in the driver: a short run logs a finite `ptx_loss`, the rows are a function of
the step, and bad settings are one error naming the field."""

import json
import math

import jax
import numpy as np
import pytest
from test_driver_loop import _overrides

from grpojax.config import ConfigError, load_config
from grpojax.driver.loop import train
from grpojax.driver.ptx import PtxData, ptx_data
from grpojax.driver.setup import check_ptx_rows
from grpojax.errors import UserError
from grpojax.models import builtin_tokenizer, make_mesh


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_short_run_with_ptx_logs_a_finite_ptx_loss(small_model_dir, tmp_path, algo):
    """One RL step with ptx on (the demonstrations), GRPO and PPO: `ptx_loss` is logged."""
    run_dir = tmp_path / "run"
    extra = {
        "algo": algo,
        "total_steps": 1,
        f"{algo}.ptx_coef": 0.5,
        "ptx.batch_size": 4,
        "log.tensorboard": "false",
        "log.plot": "false",
    }
    if algo == "ppo":
        extra.update({"ppo.num_epochs": 1, "ppo.critic": "shared"})
    cfg = load_config(None, _overrides(small_model_dir, run_dir, **extra))
    result = train(cfg, show_progress=False, print_fn=lambda s: None)
    assert result.stopped_by is None
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in records if "reward_mean" in r]
    assert len(rl) == cfg.total_steps
    for r in rl:
        assert r["ptx_loss"] > 0 and math.isfinite(r["ptx_loss"]), r["ptx_loss"]
        assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"])


def _rows(n=10):
    return [
        {"prompt": f"{i} + {i} =", "completion": f" {2 * i}", "text": f"{i} {i}"} for i in range(n)
    ]


def test_ptx_rows_are_a_function_of_the_step_and_columns_are_read():
    mesh = make_mesh(fsdp=1)
    tok = builtin_tokenizer()
    base = ["grpo.ptx_coef=1.0", "ptx.batch_size=4", "rollout.max_new_tokens=8"]
    cfg = load_config(None, base)
    a, b = PtxData(cfg, _rows(), tok, mesh), PtxData(cfg, _rows(), tok, mesh)
    # Resume: a fresh instance asked for step 5 directly draws what a long run draws.
    long_run = [a.host_batch(i) for i in range(6)]
    resumed = b.host_batch(5)
    for x, y in zip(jax.tree.leaves(long_run[5]), jax.tree.leaves(resumed), strict=True):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(a.host_batch(0).tokens_ns, a.host_batch(1).tokens_ns)
    demo = a.host_batch(0)  # demonstrations: the loss mask is the completion (EOS included)
    assert demo.loss_mask_ns.sum() < demo.mask_ns.sum() and demo.tokens_ns.shape[0] == 4
    cfg = load_config(None, [*base, "ptx.column=text", "ptx.max_tokens=6"])
    text = PtxData(cfg, _rows(), tok, mesh).host_batch(0)  # every real token but the first
    assert text.tokens_ns.shape == (4, 6)
    np.testing.assert_array_equal(text.loss_mask_ns[:, 1:], text.mask_ns[:, 1:])
    assert not text.loss_mask_ns[:, 0].any() and text.mask_ns[:, 0].all()
    assert ptx_data(load_config(None, []), _rows(), tok, mesh) is None  # ptx_coef = 0


def test_bad_ptx_settings_name_the_field():
    with pytest.raises(ConfigError, match=r"ptx\.batch_size \(3\) must be divisible by grpo"):
        load_config(None, ["grpo.ptx_coef=0.1", "ptx.batch_size=3", "grpo.num_microbatches=2"])
    with pytest.raises(ConfigError, match=r"ppo\.ptx_coef must be a finite number >= 0"):
        load_config(None, ["algo=ppo", "ppo.ptx_coef=-1"])
    with pytest.raises(ConfigError, match=r"ptx\.max_tokens must be an int >= 2"):
        load_config(None, ["ptx.max_tokens=1"])
    cfg = load_config(None, ["grpo.ptx_coef=0.1", "ptx.column=text"])
    with pytest.raises(UserError, match=r"ptx\.column='text'.*no \['text'\] column"):
        check_ptx_rows(cfg, [{"prompt": "1 + 1 ="}])
    cfg = load_config(None, ["grpo.ptx_coef=0.1"])
    with pytest.raises(UserError, match=r"demonstrations \(ptx\.column=null\).*\['completion'\]"):
        check_ptx_rows(cfg, [{"prompt": "1 + 1 ="}])
