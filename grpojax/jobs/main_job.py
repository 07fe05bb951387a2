"""The main job on the embedded default: `grpojax train` with no arguments.

`DEFAULT_CONFIG` is a complete run sized for a 2-core laptop CPU (a few minutes): the
built-in tiny model and character tokenizer, a short SFT warm start on the built-in
arithmetic task (chained one-digit additions and subtractions, "3+7-2=" -> "8"), greedy
held-out evaluation, GRPO on the numeric-answer reward, and the held-out evaluation again.
Everything lands in one run directory (config, checkpoints, metrics JSONL, TensorBoard
events, PNG plots, summary.json); the last line printed is

    grpojax train: success_before=<x> success_after=<y> wall_s=<s> first_step_s=<s> run_dir=<path>

(`first_step_s`: seconds from the start to the end of the first RL step, start-up included.)

What it reaches (held-out greedy pass@1 before and after GRPO, per seed, with the wall time,
the date and the result file): docs/performance/rehearsal.md, "The main job".

`experiments/configs/default.yaml` is `default_yaml()` written out (only the fields that differ
from the `RunConfig` defaults, so `algo=...` presets still apply beneath it).
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
from collections.abc import Callable

from omegaconf import OmegaConf

from grpojax.config import (
    CheckpointSpec,
    DataSpec,
    EvalSpec,
    LogSpec,
    RewardsSpec,
    RolloutSpec,
    RunConfig,
    SftSpec,
    algo_grpo_config,
    config_to_dict,
)
from grpojax.distributed import is_primary
from grpojax.driver.loop import train
from grpojax.sampling.transforms import SamplingConfig
from grpojax.train.config import PPOConfig
from grpojax.train.state import OptimizerConfig

__all__ = ["DEFAULT_CONFIG", "config_diff", "default_yaml", "main_job", "summary_line"]

DEFAULT_CONFIG = RunConfig(
    algo="grpo",
    seed=0,
    total_steps=120,
    data=DataSpec(kind="arithmetic", name="chain3", size=20000, max_prompt_tokens=16),
    rewards=RewardsSpec(names=("numeric_answer",), mode="thread", num_workers=1, timeout_s=10.0),
    rollout=RolloutSpec(prompts_per_step=32, max_new_tokens=4),
    sampling=SamplingConfig(temperature=1.0),
    grpo=dataclasses.replace(algo_grpo_config("grpo"), group_size=8, beta=0.0),
    ppo=PPOConfig(
        share_prompt=True,
        critic="shared",
        num_epochs=1,
        kl_coef=0.0,
        gamma=1.0,
        lam=1.0,
        vf_coef=0.1,
        whiten_advantages=True,
    ),
    # Warmup: Adam's first steps move every weight by about the learning rate, which at
    # the peak undoes much of the warm start; the cosine decay (over the run's updates)
    # keeps the late steps from drifting.
    optimizer=OptimizerConfig(
        learning_rate=1.5e-4, schedule="cosine", warmup_steps=10, final_lr_fraction=0.1
    ),
    sft=SftSpec(steps=150, learning_rate=1e-3, batch_size=64),
    eval=EvalSpec(heldout_size=200, k=4, temperature=1.0, every=0, batch_size=200),
    checkpoint=CheckpointSpec(every=40, keep=2),
    log=LogSpec(every=1),
)


def config_diff(cfg: RunConfig) -> dict:
    """The fields of `cfg` that differ from `RunConfig(algo=cfg.algo)` with its preset, as a
    nested dict (what a YAML file needs to say to give back `cfg`)."""
    preset = algo_grpo_config(cfg.algo, cfg.rollout.max_new_tokens)
    base = config_to_dict(RunConfig(algo=cfg.algo, grpo=preset))
    full = config_to_dict(cfg)

    def diff(a, b):
        out = {}
        for k, v in a.items():
            if isinstance(v, dict) and isinstance(b.get(k), dict):
                sub = diff(v, b[k])
                if sub:
                    out[k] = sub
            elif b.get(k) != v:
                out[k] = v
        return out

    return diff(full, base)


def default_yaml() -> str:
    """`DEFAULT_CONFIG` as YAML (differences from the `RunConfig` defaults only)."""
    header = (
        "# The embedded default of `grpojax train` (grpojax.jobs.main_job.DEFAULT_CONFIG).\n"
        "# Only fields that differ from RunConfig's defaults are listed; `algo=...` presets\n"
        "# apply beneath them. Regenerate: python -c 'from grpojax.jobs.main_job import\n"
        '# default_yaml; print(default_yaml(), end="")\' > experiments/configs/default.yaml\n'
    )
    return header + OmegaConf.to_yaml(OmegaConf.create(config_diff(DEFAULT_CONFIG)))


def summary_line(result) -> str:
    """`grpojax train: success_before=<x> success_after=<y> wall_s=<s> first_step_s=<s>
    run_dir=<path>` (one line; `first_step_s`: `RunResult.first_step_s`, nan without one)."""

    def fmt(x):
        return "nan" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"

    def fmt1(x):
        return "nan" if x is None else f"{x:.1f}"

    return (
        f"grpojax train: success_before={fmt(result.success_before)} "
        f"success_after={fmt(result.success_after)} wall_s={result.wall_s:.1f} "
        f"first_step_s={fmt1(result.first_step_s)} run_dir={result.run_dir}"
    )


def main_job(
    cfg: RunConfig = DEFAULT_CONFIG,
    *,
    print_fn: Callable[[str], None] = print,
    run_root: str | pathlib.Path = "runs",
    show_progress: bool = True,
    **train_kwargs,
):
    """Run `cfg` (default: the embedded default) and print the summary line last.

    Returns the `grpojax.driver.loop.RunResult`.
    """
    if not isinstance(cfg, RunConfig):
        raise ValueError(f"cfg must be a RunConfig, got {type(cfg).__name__}")
    result = train(
        cfg, print_fn=print_fn, run_root=run_root, show_progress=show_progress, **train_kwargs
    )
    if is_primary():
        print_fn(summary_line(result))
    return result
