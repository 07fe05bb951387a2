"""A finished or stopped run's RL checkpoint, back in a `Trainer`: what `grpojax eval` and
`grpojax export` start from.

    cfg, ckpt_dir = open_run(run_dir, step=step, overrides=overrides, purpose="evaluate")
    mesh, trainer, step = restore_trainer(cfg, ckpt_dir, tokenizer, step=step)

Split in two so a caller can refuse a run (e.g. one without held-out data) before any model
is built.
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence

from jax.sharding import Mesh

from grpojax.config import RunConfig, load_config
from grpojax.driver.checkpoint import Checkpointer, saved_steps
from grpojax.driver.setup import build_mesh, build_model
from grpojax.driver.trainer import (
    Trainer,
    check_lora_base,
    checkpoint_target,
    make_trainer,
    restore_lora_base,
)
from grpojax.errors import MissingPathError, UserError

__all__ = ["open_run", "restore_trainer"]


def open_run(
    run_dir: str | pathlib.Path,
    *,
    step: int | None = None,
    overrides: Sequence[str] = (),
    purpose: str = "restore",
) -> tuple[RunConfig, pathlib.Path]:
    """(the run's config with `overrides`, its RL checkpoint directory). A directory without
    config.yaml, a run without checkpoints, or without checkpoint `step`, is a
    `grpojax.errors.UserError` (the message says there is nothing to `purpose`)."""
    run_dir = pathlib.Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise MissingPathError(f"{run_dir} is not a run directory (no config.yaml)")
    cfg = load_config(run_dir / "config.yaml", list(overrides))
    ckpt_dir = pathlib.Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints"
    steps = saved_steps(ckpt_dir)
    if not steps:
        raise MissingPathError(f"no checkpoint in {ckpt_dir}: nothing to {purpose}")
    if step is not None and step not in steps:
        raise UserError(f"no checkpoint step {step} in {ckpt_dir}; it holds steps {steps}")
    return cfg, ckpt_dir


def restore_trainer(
    cfg: RunConfig, ckpt_dir: pathlib.Path, tokenizer, *, step: int | None = None
) -> tuple[Mesh, Trainer, int]:
    """(mesh, trainer holding checkpoint `step` (None: the newest readable one), that step).
    A checkpoint that cannot be read into this config's model is a UserError."""
    mesh = build_mesh(cfg)
    model, _ = build_model(cfg, mesh=mesh, tokenizer=tokenizer)
    trainer = make_trainer(cfg, model, mesh)
    restore_lora_base(trainer, cfg, ckpt_dir)
    abstract, shardings = checkpoint_target(trainer, mesh)
    with Checkpointer(ckpt_dir, async_save=False) as ckpt:
        if step is None:
            restored = ckpt.restore_latest(abstract, shardings=shardings)
        else:
            try:
                restored = ckpt.restore(step, abstract, shardings=shardings)
            except Exception as e:  # a corrupt step, or a config that does not match it
                raise UserError(
                    f"cannot restore checkpoint step {step} in {ckpt_dir}: {type(e).__name__}: {e}"
                ) from None
    check_lora_base(
        trainer, restored.driver_state, f"checkpoint step {restored.step} in {ckpt_dir}"
    )
    trainer.state = trainer.with_checkpoint_state(restored.state.train)
    return mesh, trainer, int(restored.step)
