"""MetricsLogger (JSONL, TensorBoard, W&B), progress bar and plots."""

from __future__ import annotations

import io
import json
import math
import sys
import types

import jax.numpy as jnp
import numpy as np
import pytest

from grpojax.driver.metrics import (
    MetricsLogger,
    flatten_metrics,
    plot_before_after,
    plot_metrics,
    progress,
    read_jsonl,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _metrics(step: int):
    rng = np.random.default_rng(step)
    return {
        "reward_mean": jnp.asarray(rng.random(), jnp.float32),
        "kl": np.float64(rng.random() * 1e-3),
        "tokens": int(rng.integers(10, 100)),
        "truncated": jnp.asarray([step % 2 == 0]),  # size-1 bool array
        "reward": {"format": rng.random(), "answer": jnp.asarray(rng.random(), jnp.bfloat16)},
    }


def _expected(step: int) -> dict[str, float]:
    """Independent conversion of `_metrics(step)` to the flat float dict."""
    m = _metrics(step)
    return {
        "reward_mean": float(np.asarray(m["reward_mean"])),
        "kl": float(m["kl"]),
        "tokens": float(m["tokens"]),
        "truncated": 1.0 if step % 2 == 0 else 0.0,
        "reward/format": float(m["reward"]["format"]),
        "reward/answer": float(np.asarray(m["reward"]["answer"], np.float32)),
    }


def test_jsonl_records_every_step_flushed(tmp_path):
    logger = MetricsLogger(tmp_path, tensorboard=False)
    assert logger.writers == ("jsonl",)
    for step in range(3):
        logger.log(step, _metrics(step))
        # Flushed on every write: readable before close (a kill loses nothing).
        assert len(read_jsonl(tmp_path / "metrics.jsonl")) == step + 1
    logger.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3
    for step, line in enumerate(lines):
        record = json.loads(line)
        assert record["step"] == step
        assert isinstance(record["time"], float) and record["elapsed_s"] >= 0
        got = {k: v for k, v in record.items() if k not in ("step", "time", "elapsed_s")}
        assert got == _expected(step)  # exact: float32 -> float64 is lossless


def test_non_finite_values_become_null(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        logger.log(0, {"a": float("nan"), "b": jnp.inf, "c": -np.inf, "d": 1.5})
    line = (tmp_path / "metrics.jsonl").read_text().strip()
    assert "NaN" not in line and "Infinity" not in line
    record = json.loads(line)  # strict JSON parses it
    assert record["a"] is None and record["b"] is None and record["c"] is None
    assert record["d"] == 1.5


def test_bad_metrics_are_clear_errors(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        with pytest.raises(ValueError, match=r"metric 'x' must be a scalar.*shape \(3,\)"):
            logger.log(0, {"x": jnp.zeros(3)})
        with pytest.raises(ValueError, match="metric 'y/z' must be a number"):
            logger.log(0, {"y": {"z": "text"}})
        with pytest.raises(ValueError, match="'step' is reserved"):
            logger.log(0, {"step": 1})
    assert flatten_metrics({"a": {"b": {"c": 2}}}) == {"a/b/c": 2.0}


def test_resume_drops_records_after_the_checkpoint(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        for step in range(6):
            logger.log(step, {"x": step})
    with open(tmp_path / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 6, "x": ')  # a line cut short by a kill
    with MetricsLogger(tmp_path, tensorboard=False, resume_step=3) as logger:
        logger.log(4, {"x": 40})
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["x"]) for r in records] == [(0, 0), (1, 1), (2, 2), (3, 3), (4, 40)]


def test_tensorboard_events_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path) as logger:
        assert logger.writers == ("jsonl", "tensorboard")
        for step in range(4):
            logger.log(step, _metrics(step))
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert tags == set(_expected(0))
    for key in ("reward_mean", "reward/format", "tokens"):
        events = acc.Scalars(key)
        assert [e.step for e in events] == [0, 1, 2, 3]
        want = np.array([_expected(s)[key] for s in range(4)], np.float32)
        np.testing.assert_array_equal(np.array([e.value for e in events], np.float32), want)


def test_wandb_absent_is_skipped_with_warning(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with pytest.warns(UserWarning, match="wandb package is not installed"):
        logger = MetricsLogger(tmp_path, tensorboard=False, wandb=True)
    assert logger.writers == ("jsonl",)
    logger.log(0, {"x": 1.0})
    logger.close()
    assert read_jsonl(tmp_path / "metrics.jsonl")[0]["x"] == 1.0


def test_wandb_used_when_installed_and_enabled(tmp_path, monkeypatch):
    calls = []

    class FakeRun:
        def log(self, data, step):
            calls.append(("log", dict(data), step))

        def finish(self):
            calls.append(("finish",))

    def init(**kwargs):
        calls.append(("init", kwargs["project"], kwargs["config"]))
        return FakeRun()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    # Disabled by config: never touched, even though importable.
    MetricsLogger(tmp_path / "off", tensorboard=False, wandb=False).close()
    assert calls == []
    with MetricsLogger(
        tmp_path, tensorboard=False, wandb=True, wandb_project="p", config={"seed": 1}
    ) as logger:
        assert logger.writers == ("jsonl", "wandb")
        logger.log(7, {"a": jnp.asarray(0.5), "b": {"c": 2}})
    assert calls == [("init", "p", {"seed": 1}), ("log", {"a": 0.5, "b/c": 2.0}, 7), ("finish",)]


def test_disabled_logger_writes_nothing(tmp_path):
    logger = MetricsLogger(tmp_path / "run", enabled=False)
    assert logger.log(0, {"x": 1}) == {"x": 1.0}
    logger.close()
    assert not (tmp_path / "run").exists()


def test_progress_shows_key_numbers():
    out = io.StringIO()
    with progress(5, "grpo", file=out, disable=False) as bar:
        bar.update({"reward_mean": jnp.asarray(0.25), "kl": 1e-3, "step_time_s": 1.5, "x": 3})
        assert bar.postfix == {"reward": "0.250", "kl": "0.0010", "s/step": "1.50"}
        bar.update({"success": 0.5})
        assert bar.postfix == {"success": "0.50"}
        bar.update()
        assert bar.n == 3
    text = out.getvalue()
    assert "grpo" in text and "success=0.50" in text


def test_plot_metrics_writes_png(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        for step in range(5):
            logger.log(step, {"reward_mean": step / 4, "kl": float("nan") if step == 2 else 0.1})
    png = tmp_path / "plots" / "curves.png"
    assert plot_metrics(tmp_path / "metrics.jsonl", png) == ["kl", "reward_mean"]
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert plot_metrics(tmp_path / "metrics.jsonl", png, keys=["kl"]) == ["kl"]
    with pytest.raises(
        ValueError, match=r"\['nope'\] not found.*available: \['kl', 'reward_mean'\]"
    ):
        plot_metrics(tmp_path / "metrics.jsonl", png, keys=["nope"])
    # A tuple is one panel of several curves; with missing="note" an absent metric's panel
    # is drawn saying "not logged" and left out of the returned (plotted) panels.
    panels = ["reward_mean", ("kl", "nope"), "nope2"]
    assert plot_metrics(tmp_path / "metrics.jsonl", png, keys=panels, missing="note") == [
        "reward_mean",
        ("kl", "nope"),
    ]
    with pytest.raises(ValueError, match=r"\['nope2'\] not found"):
        plot_metrics(tmp_path / "metrics.jsonl", png, keys=panels)


def test_main_job_plot_has_kl_and_clip_fraction_panels(tmp_path):
    """The run's metrics.png (`loop.METRIC_PANELS`): reward, KL to the reference, the clip
    fractions (low and high in one panel), entropy, length and gradient norm. A beta = 0
    run logs no KL: its panel says "not logged" and the others are drawn."""
    from grpojax.driver.loop import METRIC_PANELS, _plots
    from grpojax.jobs.main_job import DEFAULT_CONFIG

    assert METRIC_PANELS == (
        "reward_mean",
        "kl",
        ("clip_frac_low", "clip_frac_high"),
        "entropy",
        "completion_len_mean",
        "grad_norm",
    )
    logged = ["reward_mean", "clip_frac_low", "clip_frac_high", "entropy"]
    logged += ["completion_len_mean", "grad_norm"]
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        for step in range(1, 4):
            logger.log(step, {k: 0.1 * step for k in logged})
    png = tmp_path / "metrics.png"
    drawn = plot_metrics(tmp_path / "metrics.jsonl", png, keys=METRIC_PANELS, missing="note")
    assert drawn == [p for p in METRIC_PANELS if p != "kl"]
    png.unlink()
    _plots(tmp_path, None, None, DEFAULT_CONFIG)  # what the loop calls at the end of a run
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_plot_before_after(tmp_path):
    png = tmp_path / "before_after.png"
    assert plot_before_after(0.25, 0.5, png) == {"success": (0.25, 0.5)}
    assert png.read_bytes()[:8] == PNG_MAGIC
    pairs = plot_before_after({"pass@1": 0.2, "mean@4": 0.3}, {"pass@1": 0.6, "mean@4": 0.5}, png)
    assert pairs == {"pass@1": (0.2, 0.6), "mean@4": (0.3, 0.5)}
    with pytest.raises(ValueError, match="before has scores"):
        plot_before_after({"a": 0.1}, {"b": 0.2}, png)
    with pytest.raises(ValueError, match="both be numbers or both be dicts"):
        plot_before_after(0.1, {"b": 0.2}, png)
    assert not math.isnan(pairs["pass@1"][1])
