"""`grpojax sft`: supervised fine-tuning alone (`grpojax.driver.sft.run_sft`, the same warm
start `grpojax train` runs before RL), with held-out pass@1 before and after."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable

import jax
from flax import nnx
from jax.experimental.multihost_utils import process_allgather

from grpojax.config import RunConfig
from grpojax.distributed import is_primary
from grpojax.driver.evaluate import heldout_evaluator
from grpojax.driver.setup import build_reward_manager, start_run
from grpojax.driver.sft import run_sft
from grpojax.errors import UserError
from grpojax.models import save_pretrained

__all__ = ["sft_job"]


def sft_job(
    cfg: RunConfig,
    *,
    print_fn: Callable[[str], None] = print,
    run_root: str | pathlib.Path = "runs",
    show_progress: bool = True,
) -> dict:
    """`grpojax sft`: SFT only (`cfg.sft`), held-out pass@1 before and after, the model saved
    as a Hugging Face checkpoint in `<run_dir>/sft_model`. Returns the figures."""
    if cfg.sft.steps < 1:
        raise UserError("grpojax sft needs sft.steps >= 1 (e.g. sft.steps=200)")
    show_progress = show_progress and cfg.log.progress
    run = start_run(cfg, root=run_root, kind="sft")
    manager = None if cfg.env.enabled else build_reward_manager(cfg)
    run_eval = heldout_evaluator(
        cfg, run.tokenizer, run.heldout_rows, manager, mesh=run.mesh, show_progress=show_progress
    )
    try:
        before = run_eval(run.model, "before")
        last, _ = run_sft(
            run.model,
            run.tokenizer,
            run.train_rows,
            cfg,
            mesh=run.mesh,
            show_progress=show_progress,
        )
        after = run_eval(run.model, "after")
    finally:
        if manager is not None:
            manager.close()
    if jax.process_count() > 1:  # a collective: every process sends its shards
        params = nnx.state(run.model, nnx.Param)
        nnx.update(run.model, jax.tree.map(lambda x: process_allgather(x, tiled=True), params))
    if is_primary():
        save_pretrained(run.model, run.run_dir / "sft_model", tokenizer=run.tokenizer)
    out = {
        "success_before": None if before is None else before["pass@1"],
        "success_after": None if after is None else after["pass@1"],
        "final_loss": last.get("loss"),
        "run_dir": str(run.run_dir),
    }
    if not is_primary():
        return out
    (run.run_dir / "summary.json").write_text(json.dumps(out, indent=2))

    def fmt(x):
        return "nan" if x is None else f"{x:.3f}"

    print_fn(
        f"grpojax sft: success_before={fmt(out['success_before'])} "
        f"success_after={fmt(out['success_after'])} run_dir={run.run_dir}"
    )
    return out
