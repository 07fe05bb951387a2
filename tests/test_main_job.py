"""The main job on the embedded default, in a reduced form (few steps), and its config."""

import dataclasses
import json
import re

import pytest

from grpojax.config import RunConfig, load_config
from grpojax.jobs.main_job import DEFAULT_CONFIG, config_diff, default_yaml, main_job


def test_default_config_is_a_frozen_runconfig_on_the_builtin_model_and_task():
    assert isinstance(DEFAULT_CONFIG, RunConfig)
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULT_CONFIG.seed = 1  # type: ignore[misc]
    assert DEFAULT_CONFIG.model.is_builtin and DEFAULT_CONFIG.data.kind == "arithmetic"
    assert DEFAULT_CONFIG.sft.steps > 0 and DEFAULT_CONFIG.algo == "grpo"


def test_default_yaml_round_trips(tmp_path):
    path = tmp_path / "default.yaml"
    path.write_text(default_yaml())
    assert load_config(path) == DEFAULT_CONFIG
    # Only differences are written, so a preset still applies beneath the file.
    assert "group_size" not in config_diff(DEFAULT_CONFIG).get("grpo", {})
    dapo = load_config(path, ["algo=dapo"])
    assert dapo.grpo.clip_high == 0.28 and dapo.grpo.beta == DEFAULT_CONFIG.grpo.beta


@pytest.mark.slow
def test_reduced_main_job_prints_the_summary_line_and_writes_the_run(tmp_path):
    cfg = dataclasses.replace(
        DEFAULT_CONFIG,
        total_steps=2,
        optimizer=dataclasses.replace(DEFAULT_CONFIG.optimizer, warmup_steps=1),
        sft=dataclasses.replace(DEFAULT_CONFIG.sft, steps=3),
        eval=dataclasses.replace(DEFAULT_CONFIG.eval, heldout_size=16, batch_size=16, k=2),
        log=dataclasses.replace(DEFAULT_CONFIG.log, run_dir=str(tmp_path / "run")),
    )
    lines = []
    result = main_job(cfg, print_fn=lines.append, show_progress=False)
    m = re.fullmatch(
        r"grpojax train: success_before=([\d.]+) success_after=([\d.]+) wall_s=([\d.]+) "
        r"first_step_s=([\d.]+) run_dir=(.+)",
        lines[-1],
    )
    assert m, lines[-1]
    before, after = float(m.group(1)), float(m.group(2))
    assert 0.0 <= before <= 1.0 and 0.0 <= after <= 1.0
    assert abs(before - result.success_before) < 5e-4
    run_dir = tmp_path / "run"
    assert m.group(5) == str(run_dir)
    assert 0 < float(m.group(4)) <= float(m.group(3)) and result.first_step_s is not None
    for name in ("config.yaml", "metrics.jsonl", "summary.json", "success.png"):
        assert (run_dir / name).is_file(), name
    assert any((run_dir / "tensorboard").iterdir())
    assert (run_dir / "checkpoints" / "2").is_dir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["eval_after"]["pass@1"] == result.success_after
