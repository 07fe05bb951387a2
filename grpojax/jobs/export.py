"""`grpojax export`: a run's RL checkpoint out as Hugging Face checkpoints
(`grpojax.driver.export`: the policy, a PPO run's critic, or a LoRA run's adapters).

    grpojax export RUN_DIR [--step N] --out DIR [--dtype float32|bfloat16] [--adapter]
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable

from grpojax.driver.export import DEFAULT_MAX_SHARD_SIZE, DTYPES, export_adapter, export_policy
from grpojax.driver.setup import build_tokenizer
from grpojax.errors import UserError
from grpojax.jobs.restore import open_run, restore_trainer

__all__ = ["export_run"]


def export_run(
    run_dir: str | pathlib.Path,
    *,
    out: str | pathlib.Path,
    step: int | None = None,
    dtype: str | None = None,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    adapter: bool = False,
    print_fn: Callable[[str], None] = print,
) -> dict:
    """`grpojax export`: restore `run_dir`'s RL checkpoint `step` (default: the newest
    readable one) and write it with `export_policy` (critic included) to `out`; with
    `adapter`, a LoRA run's adapters with `export_adapter` instead.

    Returns `export_policy`'s dict plus "step". A directory that is not a run, a run with no
    checkpoint or without `step`, an unknown dtype, an `out` that is a file, or a checkpoint
    that cannot be read is a `grpojax.errors.UserError`.
    """
    if dtype is not None and dtype not in DTYPES:
        raise UserError(f"--dtype must be one of {DTYPES}, got {dtype!r}")
    out = pathlib.Path(out)
    for p in (out, *out.parents):
        if p.exists() and not p.is_dir():
            raise UserError(f"--out {str(out)!r}: {str(p)!r} exists and is not a directory")
    cfg, ckpt_dir = open_run(run_dir, step=step, purpose="export")
    tokenizer = build_tokenizer(cfg)
    _, trainer, step = restore_trainer(cfg, ckpt_dir, tokenizer, step=step)
    if adapter:
        result = export_adapter(trainer, cfg, tokenizer, out, dtype=dtype)
        result["step"] = step
        return result
    result = export_policy(
        trainer, tokenizer, out, dtype=dtype, max_shard_size=max_shard_size, with_critic=True
    )
    result["step"] = step
    if result["critic_bias"]:
        print_fn(
            f"grpojax export: note: the critic's head bias {result['critic_bias']:.6g} has no "
            "place in transformers' bias-free score layer; it is kept as grpojax_score_bias in "
            f"{out / 'critic' / 'config.json'} (transformers' values are grpojax's minus it)"
        )
    return result
