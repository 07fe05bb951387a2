"""The Qwen-scale experiment scripts: their architecture tables and that the rehearsal starts
(the real runs take minutes to hours and are not part of the suite)."""

import importlib.util
import pathlib
import re
import subprocess
import sys

import pytest

EXPERIMENTS = pathlib.Path(__file__).resolve().parents[1] / "experiments"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, EXPERIMENTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "size, params",
    # The published models' parameter counts (safetensors totals, tied embedding once).
    [("0.5b", 494_032_768), ("1.5b", 1_543_714_304), ("7b", 7_615_616_512), ("8b", 8_190_735_360)],
)
def test_plan_memory_architectures_have_the_published_parameter_counts(size, params):
    plan = _load("plan_memory")
    cfg = plan.model_config(plan.ARCHS[size])
    assert cfg.num_params() == params
    assert (cfg.dtype, cfg.param_dtype, cfg.remat) == ("bfloat16", "float32", "full")


def test_rehearsal_dry_run_builds_tokenizer_checkpoint_and_run_config(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            str(EXPERIMENTS / "rehearse_qwen2_5_0_5b.py"),
            "--tiny",
            "--dry-run",
            "--keep",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert re.fullmatch(
        r"rehearsal: params=\d+ peak_rss_mb=\d+ step_s=nan export_max_abs_logit_diff=nan", last
    )
    ckpt = tmp_path / "ckpt"
    assert (ckpt / "config.json").is_file() and (ckpt / "tokenizer.json").is_file()
    assert (tmp_path / "train.jsonl").is_file()
