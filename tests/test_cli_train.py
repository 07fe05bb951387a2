"""`grpojax train/eval/sft/rm` command lines: config errors, resume wiring, the subcommands."""

import json
import pathlib
import re

import pytest

from grpojax import cli
from grpojax.jobs.main_job import DEFAULT_CONFIG


def _small(model_dir, run_dir, **extra):
    base = {
        "model.source": str(model_dir),
        "log.run_dir": str(run_dir),
        "data.size": "100",
        "rollout.prompts_per_step": "2",
        "grpo.group_size": "4",
        "eval.heldout_size": "4",
        "eval.batch_size": "4",
        "eval.k": "2",
        "checkpoint.every": "1",
        "checkpoint.async_save": "false",
        "sft.steps": "2",
        "sft.batch_size": "4",
        "optimizer.warmup_steps": "1",  # the default's 10 exceeds these runs' updates
    }
    base.update({k: str(v) for k, v in extra.items()})
    return [f"{k}={v}" for k, v in base.items()]


def test_invalid_override_is_one_clear_message(capsys):
    assert cli.main(["train", "grpo.beta=-1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "grpo.beta" in err and ">= 0" in err


def test_unknown_key_names_the_key_and_the_allowed_ones(capsys):
    assert cli.main(["train", "grpo.betta=0.1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "grpo.betta" in err and "beta" in err


def test_malformed_override_and_bad_choice(capsys):
    assert cli.main(["train", "algo=sarsa"]) == 2
    err = capsys.readouterr().err
    assert "algo" in err and "ppo" in err  # lists the allowed algorithms
    assert cli.main(["train", "total_steps"]) == 2
    assert "key=value" in capsys.readouterr().err


def test_default_config_is_the_embedded_default_and_overrides_apply():
    assert cli.load_run_config(None, []) == DEFAULT_CONFIG
    cfg = cli.load_run_config(None, ["algo=ppo", "seed=3"])
    assert cfg.algo == "ppo" and cfg.seed == 3
    assert cfg.data == DEFAULT_CONFIG.data and cfg.ppo == DEFAULT_CONFIG.ppo


CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "configs"


def test_experiments_default_yaml_is_the_embedded_default():
    assert cli.load_run_config(str(CONFIGS / "default.yaml"), []) == DEFAULT_CONFIG


def test_qwen_experiment_config_loads():
    cfg = cli.load_run_config(str(CONFIGS / "qwen2_5_0_5b_gsm8k.yaml"), [])
    assert not cfg.model.is_builtin and cfg.data.kind == "file"
    long = cli.load_run_config(str(CONFIGS / "qwen2_5_7b_long_cot.yaml"), [])
    assert long.rollout.max_new_tokens == 16384 and long.algo == "dapo"
    assert (long.grpo.overlong_max_len, long.grpo.overlong_buffer) == (16384, 3276)
    moe = cli.load_run_config(str(CONFIGS / "qwen3_30b_a3b_gsm8k.yaml"), [])
    assert moe.model.source == "Qwen/Qwen3-30B-A3B" and moe.mesh.fsdp == 16
    assert moe.model.routing_replay == "rollout"
    gemma = cli.load_run_config(str(CONFIGS / "gemma3_1b_gsm8k.yaml"), [])
    assert gemma.model.source == "google/gemma-3-1b-it"
    mistral = cli.load_run_config(str(CONFIGS / "mistral_7b_gsm8k.yaml"), [])
    assert mistral.model.source == "mistralai/Mistral-7B-Instruct-v0.1" and mistral.mesh.fsdp == 4


@pytest.mark.slow
def test_train_resume_eval_sft_rm_commands(small_model_dir, tmp_path, capsys):
    run_dir = tmp_path / "run"
    args = _small(small_model_dir, run_dir, total_steps=2)
    assert cli.main(["train", "--no-progress", *args]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    m = re.fullmatch(
        r"grpojax train: success_before=([\d.]+) success_after=([\d.]+) wall_s=([\d.]+) "
        r"first_step_s=([\d.]+) run_dir=(.+)",
        out[-1],
    )
    assert m and pathlib.Path(m.group(5)) == run_dir
    assert 0 < float(m.group(4)) <= float(m.group(3))  # first RL step within the run
    # --resume with a higher step budget continues the same run from its checkpoint.
    assert (
        cli.main(["train", "--no-progress", "--resume", f"log.run_dir={run_dir}", "total_steps=3"])
        == 0
    )
    text = capsys.readouterr().out
    assert "resumed" in text and "at step 2" in text
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3

    assert cli.main(["eval", "--no-progress", "--run-dir", str(run_dir), "eval.k=3"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert re.fullmatch(
        r"grpojax eval: pass@1=[\d.]+ mean@3=[\d.]+ pass@2=[\d.]+ pass@3=[\d.]+ step=3 run_dir=.+",
        line,
    )
    assert (run_dir / "eval-3.json").is_file()

    sft_dir = tmp_path / "sft"
    assert cli.main(["sft", "--no-progress", *_small(small_model_dir, sft_dir)]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("grpojax sft: success_before=")
    assert (sft_dir / "sft_model" / "config.json").is_file()

    rm_dir = tmp_path / "rm"
    assert (
        cli.main(
            [
                "rm",
                "--no-progress",
                "--steps",
                "3",
                "--batch-size",
                "4",
                "--heldout-pairs",
                "8",
                *_small(small_model_dir, rm_dir),
            ]
        )
        == 0
    )
    line = capsys.readouterr().out.strip().splitlines()[-1]
    m = re.fullmatch(r"grpojax rm: train_accuracy=([\d.]+) heldout_accuracy=([\d.]+) .*", line)
    assert m and 0.0 <= float(m.group(2)) <= 1.0


def test_commands_keep_a_persistent_compilation_cache(tmp_path, monkeypatch):
    """A user-level cache directory unless JAX_COMPILATION_CACHE_DIR names one; every
    program cached (no minimum compile time); GRPOJAX_COMPILATION_CACHE=0 leaves it off."""
    import jax

    names = (
        "jax_compilation_cache_dir",
        "jax_persistent_cache_min_compile_time_secs",
    )
    saved = {n: getattr(jax.config, n) for n in names}
    try:
        for var in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"):
            monkeypatch.delenv(var, raising=False)
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
        assert cli.enable_compilation_cache() == str(tmp_path / "grpojax" / "jax")
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "grpojax" / "jax")
        assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.0
        monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "mine"))
        assert cli.enable_compilation_cache() == str(tmp_path / "mine")
        monkeypatch.setenv(cli.CACHE_ENV, "0")
        assert cli.enable_compilation_cache() is None
    finally:
        for n, v in saved.items():
            jax.config.update(n, v)
