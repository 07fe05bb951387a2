"""Hugging Face checkpoints in the driver: `grpojax export` and the end-of-run export of
`grpojax train` (the policy, and a PPO critic, restored from the run's Orbax checkpoint,
which transformers loads with outputs equal to grpojax's); `grpojax rm`'s saved reward model
used as the RL reward from the config (`rewards.reward_model`); bad inputs are one-line
errors."""

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
from grpojax.config import load_config
from grpojax.driver.loop import train
from grpojax.errors import UserError
from grpojax.jobs.export import export_run


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
    from safetensors import safe_open

    with safe_open(str(out16 / "model.safetensors"), framework="numpy") as f:
        assert {f.get_slice(name).get_dtype() for name in f.keys()} == {"BF16"}
    # Loaded back: bf16 compute (the checkpoint's dtype) on float32 masters.
    again = gm.from_pretrained(out16)
    assert again.config.dtype == "bfloat16"
    assert again.named_params()["embed"][...].dtype == jnp.float32


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
    with pytest.raises(UserError, match=r"no checkpoint in .*nothing to export"):
        export_run(empty, out=out)
    (tmp_path / "file").write_text("")
    assert "is not a directory" in error(["export", str(run_dir), "--out", str(tmp_path / "file")])


def test_reward_model_from_config_raises_its_own_score(small_model_dir, tmp_path):
    """`grpojax rm` on its synthetic pairs saves <run>/hf; `rewards.names=[reward_model]`
    with `rewards.reward_model=<run>/hf` makes it the RL reward, and RL raises its score."""
    from grpojax.jobs.rm import reward_model_job

    rm_dir = tmp_path / "rm"
    rm_cfg = load_config(None, _overrides(small_model_dir, rm_dir))
    out = reward_model_job(
        rm_cfg,
        steps=30,
        batch_size=16,
        learning_rate=1e-2,
        heldout_pairs=16,
        print_fn=lambda s: None,
        show_progress=False,
    )
    hf_dir = rm_dir / "hf"
    assert out["hf"] == str(hf_dir)
    cfg = json.loads((hf_dir / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForSequenceClassification"]
    assert "grpojax_score_bias" not in cfg  # a Bradley-Terry head's bias gets no gradient

    run_dir = tmp_path / "rl"
    extra = {
        "rewards.names": "[reward_model]",
        "rewards.reward_model": str(hf_dir),
        "total_steps": 10,
        "rollout.prompts_per_step": 4,
        "grpo.group_size": 8,
        "optimizer.learning_rate": 5e-2,
        "log.export_hf": "false",
        "checkpoint.every": 100,
    }
    cfg = load_config(None, _overrides(small_model_dir, run_dir, **extra))
    train(cfg, show_progress=False, print_fn=lambda s: None)
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in records if "reward/reward_model" in r]
    scores = [r["reward/reward_model"] for r in rl]
    spread = np.mean([r["reward_std"] for r in rl[:2]])
    print("reward model score per RL step", np.round(scores, 3).tolist(), "spread", spread)
    assert len(scores) == 10
    # Measured: -0.015 over the first two steps, +0.047 over the last two (the policy
    # settles on what the model scores highest: reward_std 0.02 -> 0.001); the bar is the
    # first steps' spread of scores, 0.023, a third of the rise.
    assert np.mean(scores[-2:]) - np.mean(scores[:2]) > spread


@pytest.mark.parametrize(
    "overrides",
    [["rewards.names=[reward_model]"], ["rewards.reward_model=/some/dir"]],
)
def test_reward_model_name_and_directory_go_together(overrides):
    from grpojax.config import ConfigError

    with pytest.raises(ConfigError, match=r"^rewards\.reward_model: set it to a sequence-cl"):
        load_config(None, overrides)


def test_bad_reward_model_directory_fails_before_the_policy_loads(
    small_model_dir, tmp_path, capsys, monkeypatch
):
    import grpojax.driver.setup as setup

    def no_model(*a, **k):
        raise AssertionError("the policy model was loaded before the reward model was checked")

    monkeypatch.setattr(setup, "from_pretrained", no_model)
    for target, message in (
        (tmp_path / "nowhere", "checkpoint directory not found"),
        (small_model_dir, "is not a sequence-classification checkpoint"),
    ):
        args = _overrides(small_model_dir, tmp_path / "run")
        args += ["rewards.names=[reward_model]", f"rewards.reward_model={target}"]
        assert cli.main(["train", "--no-progress", *args]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
        assert err.startswith("grpojax train: error: rewards.reward_model: ") and message in err


def test_shared_critic_exports_as_the_policy_backbone_under_the_value_head(
    small_model_dir, tmp_path
):
    from grpojax.driver.export import export_policy
    from grpojax.driver.setup import build_mesh, build_model
    from grpojax.driver.trainer import make_trainer

    extra = {"algo": "ppo", "ppo.critic": "shared"}
    cfg = load_config(None, _overrides(small_model_dir, tmp_path / "run", **extra))
    mesh = build_mesh(cfg)
    model, tokenizer = build_model(cfg, mesh=mesh)
    trainer = make_trainer(cfg, model, mesh)
    result = export_policy(trainer, tokenizer, tmp_path / "out", with_critic=True)
    assert result["critic"] == str(tmp_path / "out" / "critic")
    tokens = jnp.asarray([[5, 9, 12, 7, 20]])
    hidden, _ = trainer.policy()(tokens)
    from flax import nnx

    head = nnx.merge(trainer.graphs.critic, trainer.state.ppo.critic.params)
    want = np.asarray(head(hidden))
    got = np.asarray(gm.load_value_model(tmp_path / "out" / "critic")(tokens))
    np.testing.assert_array_equal(got, want)
