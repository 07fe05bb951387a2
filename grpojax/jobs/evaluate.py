"""`grpojax eval`: a run's checkpoint evaluated on its held-out prompts (pass@1, mean@k and
pass@j: `grpojax.driver.evaluate`)."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Sequence

from grpojax.distributed import is_primary
from grpojax.driver.evaluate import heldout_evaluator
from grpojax.driver.setup import build_datasets, build_reward_manager, build_tokenizer
from grpojax.errors import UserError
from grpojax.jobs.restore import open_run, restore_trainer

__all__ = ["evaluate_run"]


def evaluate_run(
    run_dir,
    *,
    step: int | None = None,
    overrides: Sequence[str] = (),
    show_progress: bool = True,
) -> dict[str, float]:
    """Evaluate a run's checkpoint on its held-out prompts (pass@1, mean@k and pass@j).

    Reads `<run_dir>/config.yaml` (with `key=value` overrides, e.g. `eval.k=8`), rebuilds
    the model, restores checkpoint `step` (default: the newest readable one) and runs
    `evaluate`. Returns the scores plus `step`, and writes them to
    `<run_dir>/eval-<step>.json`.

    A directory that is not a run, a run without checkpoints (or without `step`), without a
    held-out split, or whose checkpoint cannot be read is a `grpojax.errors.UserError`.
    """
    run_dir = pathlib.Path(run_dir)
    cfg, ckpt_dir = open_run(run_dir, step=step, overrides=overrides, purpose="evaluate")
    tokenizer = build_tokenizer(cfg)
    _, heldout = build_datasets(cfg, tokenizer)
    if heldout is None:
        raise UserError("this run's data has no held-out split (set data.eval_path)")
    mesh, trainer, step = restore_trainer(cfg, ckpt_dir, tokenizer, step=step)
    manager = None if cfg.env.enabled else build_reward_manager(cfg)
    evaluator = heldout_evaluator(
        cfg, tokenizer, heldout, manager, mesh=mesh, show_progress=show_progress
    )
    try:
        scores = evaluator(trainer.policy(), f"step {step}")
    finally:
        if manager is not None:
            manager.close()
    scores["step"] = float(step)
    if is_primary():
        (run_dir / f"eval-{step}.json").write_text(json.dumps(scores, indent=2))
    return scores
