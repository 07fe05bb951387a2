"""Metrics out of the loop: JSONL always, TensorBoard, Weights & Biases, progress bar, plots.

`MetricsLogger.log(step, metrics)` takes a (possibly nested) dict of scalars: jax/NumPy
0-d arrays or size-1 arrays, Python numbers or bools. Nested dicts are flattened with "/"
(`{"reward": {"format": 0.5}}` -> `"reward/format"`), which TensorBoard and W&B show as
groups. Every value becomes a Python float.

JSONL: one JSON object per line, `{"step": int, "time": unix seconds, "elapsed_s": float,
<metrics>}`, written and flushed on every call so a killed run loses nothing. Non-finite
values (NaN, +-inf) are written as `null` so every line is valid JSON; TensorBoard and W&B
receive the float as is. On a resumed run, `MetricsLogger(..., resume_step=k)` drops the
lines logged after step k (the steps the resumed run is about to redo) and any partial
last line.

Only process 0 writes (in a `jax.distributed` run the others get a logger that does
nothing), unless `enabled` says otherwise.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import pathlib
import sys
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

RESERVED_KEYS = ("step", "time", "elapsed_s")


def _to_float(key: str, value: Any) -> float:
    if isinstance(value, bool | numbers.Number) and not isinstance(value, complex):
        return float(value)
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        host = np.asarray(value)  # jax.Array -> host (blocks until computed)
        # kind "V" admits ml_dtypes' bfloat16 / float8, which are not np.number subtypes.
        if host.size == 1 and host.dtype.kind in "biufV":
            try:
                return float(host.reshape(()))
            except (TypeError, ValueError):
                pass  # a structured ("V") dtype: reported below
        raise ValueError(
            f"metric {key!r} must be a scalar (a 0-d or size-1 array), got shape {host.shape} "
            f"dtype {host.dtype}"
        )
    raise ValueError(
        f"metric {key!r} must be a number, bool or scalar array, got {type(value).__name__}"
    )


def flatten_metrics(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """`{"a": {"b": x}}` -> `{"a/b": float(x)}`; raises ValueError on non-scalars."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if not isinstance(key, str):
            raise ValueError(f"metric names must be str, got {key!r}")
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten_metrics(value, prefix=name + "/"))
        else:
            out[name] = _to_float(name, value)
    return out


def _json_value(x: float) -> float | None:
    return x if math.isfinite(x) else None


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """The records of a metrics JSONL file (a partial last line, from a kill, is skipped)."""
    records = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def _wandb_module():
    try:
        import wandb
    except ImportError:
        return None
    return wandb


class MetricsLogger:
    """Per-step scalar metrics to JSONL, TensorBoard and (optionally) Weights & Biases.

    Args:
      run_dir: directory of the run; writes `<run_dir>/metrics.jsonl` and TensorBoard
        events under `<run_dir>/tensorboard/`.
      jsonl: write the JSONL file.
      tensorboard: write TensorBoard events (tensorboardX).
      wandb: log to Weights & Biases; used only when `import wandb` works, otherwise a
        warning says so and the other writers carry on.
      wandb_project, wandb_run_name: passed to `wandb.init`.
      config: a JSON-able dict (e.g. the run config) given to W&B as the run's config.
      resume_step: when resuming from checkpoint step k, drop JSONL records with
        step > k first (they are about to be logged again).
      enabled: write anything at all (default: only on process 0).
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        jsonl: bool = True,
        tensorboard: bool = True,
        wandb: bool = False,
        wandb_project: str | None = None,
        wandb_run_name: str | None = None,
        config: Mapping[str, Any] | None = None,
        resume_step: int | None = None,
        enabled: bool | None = None,
    ):
        if enabled is None:
            enabled = jax.process_index() == 0
        self.enabled = enabled
        self.run_dir = pathlib.Path(run_dir)
        self.jsonl_path = self.run_dir / "metrics.jsonl" if jsonl else None
        self._start = time.time()
        self._jsonl = None
        self._tb = None
        self._wandb = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.jsonl_path is not None:
            if resume_step is not None and self.jsonl_path.exists():
                kept = [r for r in read_jsonl(self.jsonl_path) if r.get("step", 0) <= resume_step]
                tmp = self.jsonl_path.with_suffix(".jsonl.tmp")
                tmp.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
                os.replace(tmp, self.jsonl_path)
            self._jsonl = open(self.jsonl_path, "a", encoding="utf-8")
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(logdir=str(self.run_dir / "tensorboard"))
        if wandb:
            module = _wandb_module()
            if module is None:
                warnings.warn(
                    "wandb logging was enabled but the wandb package is not installed; "
                    "logging to JSONL/TensorBoard only (pip install wandb to enable it)",
                    stacklevel=2,
                )
            else:
                self._wandb = module.init(
                    project=wandb_project,
                    name=wandb_run_name,
                    dir=str(self.run_dir),
                    config=dict(config) if config is not None else None,
                    resume="allow",
                )

    @property
    def writers(self) -> tuple[str, ...]:
        """Names of the active writers ("jsonl", "tensorboard", "wandb")."""
        active = [("jsonl", self._jsonl), ("tensorboard", self._tb), ("wandb", self._wandb)]
        return tuple(name for name, w in active if w is not None)

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict[str, float]:
        """Write one step's metrics; returns the flattened float dict that was logged."""
        flat = flatten_metrics(metrics)
        for key in RESERVED_KEYS:
            if key in flat:
                raise ValueError(f"metric name {key!r} is reserved (used for {RESERVED_KEYS})")
        if not self.enabled:
            return flat
        step = int(step)
        now = time.time()
        if self._jsonl is not None:
            record = {"step": step, "time": now, "elapsed_s": now - self._start}
            record.update({k: _json_value(v) for k, v in flat.items()})
            self._jsonl.write(json.dumps(record, allow_nan=False) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for key, value in flat.items():
                self._tb.add_scalar(key, value, global_step=step, walltime=now)
        if self._wandb is not None:
            self._wandb.log(flat, step=step)
        return flat

    def flush(self) -> None:
        if self._jsonl is not None:
            self._jsonl.flush()
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        """Flush and close every writer (idempotent)."""
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ----------------------------------------------------------------------------------------
# Progress bar
# ----------------------------------------------------------------------------------------

# (metric name, label, format) shown on the bar when present in the step's metrics.
DEFAULT_PROGRESS_KEYS: tuple[tuple[str, str, str], ...] = (
    ("reward_mean", "reward", ".3f"),
    ("success", "success", ".2f"),
    ("kl", "kl", ".4f"),
    ("step_time_s", "s/step", ".2f"),
)


class Progress:
    """A tqdm bar over `total` steps that shows the key numbers of the latest step.

    `update(metrics)` advances by one step and shows the `keys` found in `metrics`
    (flattened names; values formatted with each key's format). `postfix` holds the last
    shown text. Use as a context manager or call `close()`.
    """

    def __init__(
        self,
        total: int,
        desc: str,
        *,
        keys: Sequence[tuple[str, str, str]] = DEFAULT_PROGRESS_KEYS,
        initial: int = 0,
        disable: bool | None = None,
        file=None,
    ):
        from tqdm.auto import tqdm

        self.keys = tuple(keys)
        self.postfix: dict[str, str] = {}
        self._bar = tqdm(
            total=total,
            desc=desc,
            initial=initial,
            disable=disable,
            file=sys.stderr if file is None else file,
            dynamic_ncols=True,
        )

    @property
    def n(self) -> int:
        return self._bar.n

    def update(self, metrics: Mapping[str, Any] | None = None, n: int = 1) -> None:
        if metrics:
            flat = flatten_metrics(metrics)
            self.postfix = {
                label: format(flat[key], fmt) for key, label, fmt in self.keys if key in flat
            }
            self._bar.set_postfix(self.postfix, refresh=False)
        self._bar.update(n)

    def close(self) -> None:
        self._bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def progress(total: int, desc: str, **kwargs) -> Progress:
    """A `Progress` bar over `total` steps labelled `desc` (kwargs as in `Progress`)."""
    return Progress(total, desc, **kwargs)


# ----------------------------------------------------------------------------------------
# Plots
# ----------------------------------------------------------------------------------------


def _figure(figsize):
    # A bare Figure renders with Agg on savefig and never touches pyplot's global backend
    # (safe headless and inside notebooks).
    from matplotlib.figure import Figure

    return Figure(figsize=figsize)


def plot_metrics(
    jsonl_path: str | os.PathLike,
    png_path: str | os.PathLike,
    *,
    keys: Iterable[str | tuple[str, ...]] | None = None,
    title: str | None = None,
    missing: str = "error",
) -> list[str | tuple[str, ...]]:
    """Curves of metrics against step from a metrics JSONL file, one panel per key.

    Args:
      jsonl_path: a file written by `MetricsLogger`.
      png_path: output PNG.
      keys: the panels: a metric name, or a tuple of names drawn together in one panel
        with a legend (e.g. ("clip_frac_low", "clip_frac_high")). Default: every metric in
        the file, sorted, one per panel.
      title: figure title.
      missing: a panel none of whose names any record holds: "error" (a ValueError
        listing the available names) or "note" (the panel is drawn empty, saying
        "not logged", e.g. the KL of a run with beta = 0).

    Returns:
      The panels drawn with data (as given in `keys`). Null (non-finite) values leave gaps.
    """
    if missing not in ("error", "note"):
        raise ValueError(f"missing must be 'error' or 'note', got {missing!r}")
    records = read_jsonl(jsonl_path)
    available = sorted({k for r in records for k in r if k not in RESERVED_KEYS})
    panels = available if keys is None else list(keys)
    names = {p: (p,) if isinstance(p, str) else tuple(p) for p in panels}
    absent = [p for p in panels if not any(n in available for n in names[p])]
    if absent and missing == "error":
        raise ValueError(f"metrics {absent} not found in {jsonl_path}; available: {available}")
    if not panels:
        raise ValueError(f"{jsonl_path} holds no metrics to plot")
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig = _figure((4.5 * cols, 3.0 * rows))
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        ax.set_title(" / ".join(names[panel]), fontsize=9)
        ax.set_xlabel("step")
        if panel in absent:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
            ax.set_xticks([])
            ax.set_yticks([])
            continue
        for key in names[panel]:
            pts = [(r["step"], r[key]) for r in records if key in r]
            steps = np.array([p[0] for p in pts], dtype=float)
            vals = np.array([np.nan if p[1] is None else p[1] for p in pts], dtype=float)
            ax.plot(steps, vals, marker="." if len(pts) < 50 else None, label=key)
        if len(names[panel]) > 1:
            ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    pathlib.Path(png_path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=100)
    return [p for p in panels if p not in absent]


def plot_before_after(
    before: float | Mapping[str, float],
    after: float | Mapping[str, float],
    png_path: str | os.PathLike,
    *,
    title: str = "held-out success",
    labels: tuple[str, str] = ("before", "after"),
) -> dict[str, tuple[float, float]]:
    """Bar chart of held-out scores before and after training.

    Args:
      before, after: one score (e.g. success rate in [0, 1]) or a dict of named scores
        (e.g. {"pass@1": ..., "mean@8": ...}) with the same names.
      png_path: output PNG.
      title, labels: figure title and the two bar labels.

    Returns:
      {name: (before, after)} as plotted.
    """
    if isinstance(before, Mapping) != isinstance(after, Mapping):
        raise ValueError("before and after must both be numbers or both be dicts")
    if not isinstance(before, Mapping):
        before, after = {"success": before}, {"success": after}
    if set(before) != set(after):
        raise ValueError(f"before has scores {sorted(before)}, after has {sorted(after)}")
    names = list(before)
    pairs = {n: (float(before[n]), float(after[n])) for n in names}
    fig = _figure((max(4.0, 1.8 * len(names) + 1.5), 3.5))
    ax = fig.subplots()
    x = np.arange(len(names))
    width = 0.38
    for i, label in enumerate(labels):
        vals = [pairs[n][i] for n in names]
        bars = ax.bar(x + (i - 0.5) * width, vals, width, label=label)
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.set_xticks(x, names)
    ax.set_title(title)
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    pathlib.Path(png_path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=100)
    return pairs


__all__ = [
    "DEFAULT_PROGRESS_KEYS",
    "MetricsLogger",
    "Progress",
    "flatten_metrics",
    "plot_before_after",
    "plot_metrics",
    "progress",
    "read_jsonl",
]
