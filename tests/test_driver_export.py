"""`grpojax export` and the end-of-run export of `grpojax train`: the policy (and a PPO
critic) restored from the run's Orbax checkpoint and written in Hugging Face format, which
transformers loads with outputs equal to grpojax's; bad inputs are one-line errors."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from test_driver_loop import _overrides

import grpojax.models as gm
from grpojax import cli
from grpojax.driver.config import load_config
from grpojax.driver.export import export_run
from grpojax.driver.loop import train
from grpojax.errors import UserError


def _logits_diff(hf_dir, model):
    """Max abs logit difference, transformers (PyTorch) vs grpojax, on two rows."""
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    ids = np.array([tok.encode("3+4-2="), tok.encode("9-1+5=")])
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager")
    with torch.no_grad():
        ref = hf.eval()(input_ids=torch.tensor(ids)).logits.float().numpy()
    return float(np.max(np.abs(ref - np.asarray(gm.forward_logits(model, jnp.asarray(ids))))))


def test_ppo_run_exports_policy_and_critic(small_model_dir, tmp_path, capsys):
    run_dir = tmp_path / "run"
    extra = {"algo": "ppo", "ppo.critic": "separate", "total_steps": 2}
    cfg = load_config(None, _overrides(small_model_dir, run_dir, **extra))
    result = train(cfg, show_progress=False, print_fn=lambda s: None)
    assert result.stopped_by is None
    policy = result.trainer.policy()

    # The finished run wrote its final policy to <run_dir>/hf.
    assert _logits_diff(run_dir / "hf", policy) <= 1e-4
    assert (run_dir / "hf" / "generation_config.json").is_file()

    out = tmp_path / "export"
    assert cli.main(["export", str(run_dir), "--out", str(out)]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line == f"grpojax export: policy={out} critic={out / 'critic'} step=2 run_dir={run_dir}"
    diff = _logits_diff(out, policy)
    print("policy max abs logit diff", diff)
    assert diff <= 1e-4
    exported = gm.from_pretrained(out)
    for name, var in policy.named_params().items():
        np.testing.assert_array_equal(np.asarray(exported.named_params()[name][...]), var[...])

    # The critic: transformers' per-token values + the bias kept in config.json == grpojax's.
    from flax import nnx

    critic = nnx.merge(result.trainer.graphs.critic, result.trainer.state.ppo.critic.params)
    hf_critic = transformers.AutoModelForSequenceClassification.from_pretrained(
        out / "critic", attn_implementation="eager"
    ).eval()
    bias = json.loads((out / "critic" / "config.json").read_text()).get("grpojax_score_bias", 0.0)
    tokens = np.array([[5, 9, 12, 7, 20]])
    with torch.no_grad():
        hidden = hf_critic.model(input_ids=torch.tensor(tokens)).last_hidden_state
        hf_values = hf_critic.score(hidden)[..., 0].numpy() + bias
    values = np.asarray(critic(jnp.asarray(tokens)))
    print("critic max abs value diff", float(np.max(np.abs(hf_values - values))), "bias", bias)
    assert np.max(np.abs(hf_values - values)) <= 1e-4
    again = gm.load_value_model(out / "critic")
    np.testing.assert_array_equal(np.asarray(again(jnp.asarray(tokens))), values)

    # --step N and --dtype bfloat16.
    out16 = tmp_path / "export16"
    assert (
        cli.main(
            ["export", str(run_dir), "--out", str(out16), "--step", "1", "--dtype", "bfloat16"]
        )
        == 0
    )
    assert json.loads((out16 / "config.json").read_text())["dtype"] == "bfloat16"
    assert gm.from_pretrained(out16).named_params()["embed"][...].dtype == jnp.bfloat16


def test_stopped_run_is_not_exported_and_export_errors(small_model_dir, tmp_path, capsys):
    run_dir = tmp_path / "run"
    cfg = load_config(None, _overrides(small_model_dir, run_dir, total_steps=3))
    result = train(cfg, show_progress=False, print_fn=lambda s: None, stop_after=1)
    assert result.stopped_by == "stop_after" and not (run_dir / "hf").exists()

    def error(argv):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("grpojax export: error: "), err
        return err

    out = str(tmp_path / "out")
    assert "no checkpoint step 7" in error(["export", str(run_dir), "--out", out, "--step", "7"])
    assert "--dtype must be one of" in error(
        ["export", str(run_dir), "--out", out, "--dtype", "float16"]
    )
    assert "not a run directory" in error(["export", str(tmp_path), "--out", out])
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.yaml").write_text((run_dir / "config.yaml").read_text())
    with pytest.raises(UserError, match="no RL checkpoint"):
        export_run(empty, out=out)
    (tmp_path / "file").write_text("")
    assert "is not a directory" in error(["export", str(run_dir), "--out", str(tmp_path / "file")])
