"""The RL loop: sample groups, score them, update (advantages inside the step), log, save.

`train(cfg)` runs one `RunConfig` end to end:

    set up (setup.py)  ->  [SFT warm start (sft.py)]  ->  evaluate (evaluate.py)
    for each RL step:
        got     = rollouts.next(policy, logprobs) # B prompts x G samples, scored, as one
                                                  # batch, and the trainer's logprob pass
                                                  # on it: reference (and policy, for the
                                                  # metrics) (rollouts.py)
        ptx     = ptx_data.batch(step)            # PPO-ptx text, when ptx_coef > 0 (ptx.py)
        metrics = trainer.update(batch, ..., ptx) # one jitted step (trainer.py)
        log(metrics); checkpoint(step)
    evaluate; plot

How the samples are produced (engine, strategy, dynamic-sampling buffer, rounds sampled
ahead) is the `Rollouts` object's alone; the loop does not branch on it.

The run's state is checkpointed as two parts (`grpojax.driver.checkpoint`):

  arrays  `RunArrays(train=trainer.checkpoint_state(), **rollouts.arrays(ds))`: parameters,
          optimizer, step counters, the step's shuffle key, the KL controller, the
          reference policy; the sampler's key, the dynamic-sampling buffer's rows and the
          queued rounds' rows.
  JSON    `DriverState`: RL step, data position, the dynamic-sampling buffer's and the
          queued rounds' groups, running counters, the before-training evaluation.

Every checkpoint holds both complete (RL checkpoint 0, the warm-started policy, included):
the sampler, the rewards and the step are deterministic functions of that state, so a run
resumed from any checkpoint continues bit-exactly (tested).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import pathlib
import time
import warnings
from collections.abc import Callable, Sequence

import numpy as np

from grpojax.config import RunConfig, config_to_dict
from grpojax.distributed import any_process, host_values, is_primary, kill_point
from grpojax.driver.checkpoint import Checkpointer, saved_steps
from grpojax.driver.evaluate import heldout_evaluator
from grpojax.driver.export import export_policy
from grpojax.driver.metrics import (
    MetricsLogger,
    plot_before_after,
    plot_metrics,
    progress,
    read_jsonl,
)
from grpojax.driver.packing import build_packer
from grpojax.driver.ptx import ptx_data
from grpojax.driver.setup import (
    build_reward_manager,
    check_run_dir,
    make_run_dir,
    prompt_source,
    start_run,
)
from grpojax.driver.sft import run_sft
from grpojax.driver.signals import GracefulExit
from grpojax.driver.trainer import (
    BASE_FINGERPRINT_KEY,
    TEACHER_FINGERPRINT_KEY,
    RunArrays,
    Trainer,
    check_lora_base,
    check_teacher_weights,
    checkpoint_target,
    make_trainer,
    restore_lora_base,
    save_lora_base,
)
from grpojax.errors import MissingPathError, UserError
from grpojax.rollouts.episodes import env_step_metrics
from grpojax.rollouts.sampler import DriverState
from grpojax.rollouts.strategy import Rollouts, StepRollout
from grpojax.train.common import logprob_agreement
from grpojax.train.rows import Group, TrainBatch

__all__ = ["RunResult", "step_metrics", "train"]


@dataclasses.dataclass
class RunResult:
    """What `train` returns: the run directory, the before/after evaluations, timings.

    `first_step_s`: seconds from the start of `train` to the end of this invocation's first
    RL step (set-up, model, SFT warm start, held-out evaluation, the first step's
    compilations and the step itself); None when it ran no RL step.
    """

    run_dir: pathlib.Path
    eval_before: dict | None
    eval_after: dict | None
    steps: int
    stopped_by: str | None
    wall_s: float
    trainer: Trainer | None
    first_step_s: float | None = None

    @property
    def success_before(self) -> float | None:
        return None if self.eval_before is None else self.eval_before["pass@1"]

    @property
    def success_after(self) -> float | None:
        return None if self.eval_after is None else self.eval_after["pass@1"]


def step_metrics(
    cfg: RunConfig,
    batch: TrainBatch,
    fresh: Sequence[Group],
    update_metrics: dict,
    policy_stats: dict | None,
) -> dict[str, float]:
    """Host-side metrics of one step (floats): rewards, lengths, sampler-vs-trainer logprob
    difference (`policy_stats`), and the update's own metrics."""
    h = batch.host
    m: dict[str, float] = {}
    r = h["rewards_n"][h["valid_n"]]
    m["reward_mean"] = float(r.mean()) if r.size else float("nan")
    m["reward_std"] = float(r.std()) if r.size else float("nan")
    for name in fresh[0].per_fn if fresh else []:
        vals = np.concatenate([gr.per_fn[name] for gr in fresh])
        vals = vals[np.isfinite(vals)]
        m[f"reward/{name}"] = float(vals.mean()) if vals.size else float("nan")
    sampled = np.concatenate([gr.total_g[gr.valid_g] for gr in fresh]) if fresh else []
    m["reward_sampled_mean"] = float(np.mean(sampled)) if len(sampled) else float("nan")
    greedy = [gr.greedy_reward for gr in fresh if gr.greedy_reward is not None]
    if greedy:  # ReMax: the greedy baseline, and how far the samples are above it
        ok = np.isfinite(greedy)
        m["greedy_reward_mean"] = float(np.mean(np.asarray(greedy)[ok])) if ok.any() else math.nan
        m["greedy_reward_failed"] = float((~ok).sum())
    m["frac_zero_std_groups"] = float(np.mean([gr.reward_std() == 0 for gr in fresh]))
    m["completion_len_mean"] = float(h["lengths_n"].mean())
    m["completion_len_min"] = float(h["lengths_n"].min())
    m["completion_len_max"] = float(h["lengths_n"].max())
    m["truncated_frac"] = float(np.mean(~h["eos_n"]))
    m["reward_failed_samples"] = float(sum(int((~gr.valid_g).sum()) for gr in fresh))
    # Differences beyond rounding mean the decode loop and the trainer's forward disagree.
    m.update({k: float(v) for k, v in (policy_stats or {}).items()})
    renamed = {"kl_ref": "kl", "kl_ref_token": "kl_token", "entropy": "step_entropy"}
    if cfg.is_ppo:
        renamed["reward_mean"] = "ppo_shaped_reward_mean"
    for k, v in update_metrics.items():
        m[renamed.get(k, k)] = float(v)
    return m


def _step_log(
    cfg: RunConfig,
    got: StepRollout,
    update_metrics: dict,
    policy_stats: dict | None,
    ds: DriverState,
    times: dict,
    seconds: dict[str, float],
) -> dict[str, float]:
    """The metrics line of one RL step: `step_metrics`, the batch's layout, the running
    totals (counted here: the step's fresh samples and failed reward calls), the rounds,
    the phases' seconds (`times` from the rollouts, `seconds` {logprobs, update, step} from
    the loop), decode utilisation, the environment's counts, version lags, the background
    threads' own seconds and the reward workers' restarts."""
    fresh = got.fresh
    ds.counters["samples"] += sum(len(gr.lengths_g) for gr in fresh)
    ds.counters["failed_reward_samples"] += sum(int((~gr.valid_g).sum()) for gr in fresh)
    m = step_metrics(cfg, got.batch, fresh, update_metrics, policy_stats)
    m.update(got.layout)
    m.update({f"total/{k}": v for k, v in ds.counters.items()})
    m.update(
        {
            "ds_rounds": float(got.rounds),
            "ds_buffer": float(len(ds.buffer)),
            "time/generate": times["generate"],
            "time/reward": times["reward"],
            "time/logprobs": seconds["logprobs"],
            "time/update": seconds["update"],
            # real tokens / row-steps decoded (`Rollout.row_steps`)
            "decode_utilisation": times.get("decode_tokens", 0.0)
            / max(times.get("decode_row_steps", 0.0), 1.0),
            "step_time_s": seconds["step"],
            "tokens_per_s": float(sum(int(gr.lengths_g.sum()) for gr in fresh))
            / max(seconds["step"], 1e-9),
        }
    )
    m.update(env_step_metrics(times))
    if got.lag is not None:  # every sample's version lag (0 .. k)
        m["staleness/mean"] = float(got.lag.mean())
        m["staleness/max"] = float(got.lag.max())
    if "token_lag_tokens" in times:  # partial rollouts: every token's version lag
        m["staleness/token_mean"] = times["token_lag_sum"] / max(times["token_lag_tokens"], 1.0)
        m["staleness/token_max"] = times["token_lag_max"]
    if "weight_transfer" in times:  # split placement: the copy to the sampler
        m["time/weight_transfer"] = times["weight_transfer"]
    if "weight_sync" in times:  # an external engine (vLLM): the push of new weights
        m["time/weight_sync"] = times["weight_sync"]
    for phase in ("generate", "reward"):  # what ran in the background: its own
        if f"{phase}_busy" in times:  # time beside the wait the loop saw
            m[f"time/{phase}_busy"] = times[f"{phase}_busy"]
    if "rewards/worker_restarts" in got.stats:
        m["reward_worker_restarts"] = got.stats["rewards/worker_restarts"]
        m["time/reward_handover"] = got.stats["rewards/handover_s"]
    return m


def _fmt_eval(ev: dict) -> str:
    return ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in ev.items())


# The panels of a run's metrics.png, by the names `step_metrics` logs: "kl" is the step's
# KL to the reference (`kl_ref`: GRPO's token mean, PPO's per-sequence mean), absent when
# the run keeps no reference (beta / kl_coef 0); the clip fractions are the policy loss's
# (PPO's clip, CISPO, GMPO, Clip-Cov; SAPO, DPPO and KL-Cov log none). A panel a run does
# not log says "not logged".
METRIC_PANELS = (
    "reward_mean",
    "kl",
    ("clip_frac_low", "clip_frac_high"),
    "entropy",
    "completion_len_mean",
    "grad_norm",
)


def _plots(run_dir: pathlib.Path, before, after, cfg: RunConfig) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if before is not None and after is not None:
            keys = [k for k in before if k.startswith(("pass@", "mean@"))]
            plot_before_after(
                {k: before[k] for k in keys},
                {k: after[k] for k in keys},
                run_dir / "success.png",
                title=f"held-out success ({cfg.algo})",
            )
        jsonl = run_dir / "metrics.jsonl"
        if jsonl.exists() and jsonl.stat().st_size:
            have = {k for r in read_jsonl(jsonl) for k in r}
            if any(k in have for p in METRIC_PANELS for k in ((p,) if isinstance(p, str) else p)):
                plot_metrics(jsonl, run_dir / "metrics.png", keys=METRIC_PANELS, missing="note")


def _checkpoint_dirs(cfg: RunConfig, run_dir: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """(RL checkpoint directory, SFT warm-start checkpoint directory) of a run."""
    rl_dir = pathlib.Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints"
    return rl_dir, rl_dir.with_name(rl_dir.name + "-sft")


def _check_checkpoints(cfg: RunConfig, run_dir: pathlib.Path) -> None:
    """Resume needs a checkpoint; a fresh run must not mix with an earlier run's. Checked
    before anything is loaded or written (a UserError)."""
    rl_dir, sft_dir = _checkpoint_dirs(cfg, run_dir)
    have = bool(saved_steps(rl_dir) or saved_steps(sft_dir))
    if cfg.checkpoint.resume and not run_dir.exists():
        raise MissingPathError(
            f"checkpoint.resume=true (--resume): the run directory {run_dir} (log.run_dir) "
            "does not exist; nothing to resume"
        )
    if cfg.checkpoint.resume and not have:
        raise UserError(
            f"checkpoint.resume=true (--resume): {rl_dir} holds no checkpoint to resume; "
            f"start a fresh run without --resume"
        )
    if not cfg.checkpoint.resume and have:
        raise UserError(
            f"{rl_dir} already holds checkpoints of an earlier run: continue it with "
            f"checkpoint.resume=true (--resume), or start a fresh run in another log.run_dir"
        )


class _Checkpoints:
    """The run's two checkpoint directories: RL steps (`<dir>`) and the SFT warm start
    (`<dir>-sft`, deleted once RL checkpoint 0 holds the warm-started policy)."""

    def __init__(self, cfg: RunConfig, run_dir: pathlib.Path):
        c = cfg.checkpoint
        self.rl_dir, sft_dir = _checkpoint_dirs(cfg, run_dir)
        kw = dict(every=c.every, async_save=c.async_save)
        self.rl = Checkpointer(self.rl_dir, keep=c.keep, **kw)
        self.sft = Checkpointer(sft_dir, keep=1, **kw)

    def save_rl(self, trainer, rollouts, ds, source, cfg, *, force=False) -> None:
        """Save RL step `ds.step` (if due, or `force`) with the rollouts' arrays (their
        queued rounds waited for first) and then the data position, so every checkpoint is
        complete: a round of episodes draws its prompts on the worker thread that plays it,
        so the position is the source's only once the queued rounds are done."""
        if not force and not self.rl.should_save(ds.step):
            return
        arrays = RunArrays(train=trainer.checkpoint_state(), **rollouts.arrays(ds))
        ds.data = source.state()
        driver = ds.to_json(cfg)
        if trainer.base_fingerprint() is not None:  # LoRA: the base the adapters belong to
            driver[BASE_FINGERPRINT_KEY] = trainer.base_fingerprint()
        if trainer.teacher_fingerprint() is not None:  # distill: the teacher it learns from
            driver[TEACHER_FINGERPRINT_KEY] = trainer.teacher_fingerprint()
        if self.rl.save(ds.step, arrays, driver, force=force):
            kill_point("rl_save", ds.step)

    def close(self) -> None:
        """Wait for and release both; the SFT directory goes when empty."""
        self.rl.close()
        self.sft.close()
        with contextlib.suppress(OSError):
            self.sft.directory.rmdir()


def _warm_start(
    cfg: RunConfig,
    run,
    ckpts: _Checkpoints,
    rollouts: Rollouts,
    ds: DriverState,
    source,
    run_eval,
    stop: GracefulExit,
    *,
    reward_weights,
    show_progress: bool,
    stop_after_sft: int | None,
    print_fn: Callable[[str], None],
) -> tuple[Trainer | None, str | None]:
    """A fresh run's start: the SFT warm start (`sft.steps` > 0), the held-out evaluation
    before RL (`ds.eval_before`), the trainer, and RL checkpoint 0 (the warm-started
    policy: a run stopped before its first periodic checkpoint resumes from there).
    Returns (trainer, None), or (None, what stopped it) when the SFT was stopped."""
    if cfg.sft.steps:
        t0 = time.perf_counter()
        _, sft_stopped = run_sft(
            run.model,
            run.tokenizer,
            run.train_rows,
            cfg,
            mesh=run.mesh,
            show_progress=show_progress,
            checkpointer=ckpts.sft,
            resume=cfg.checkpoint.resume,
            stop=stop,
            stop_after=stop_after_sft,
        )
        if sft_stopped:
            return None, stop.signal_name or "stop_after"
        print_fn(
            f"grpojax: SFT warm start, {cfg.sft.steps} steps in {time.perf_counter() - t0:.1f}s"
        )
    ds.eval_before = run_eval(run.model, "before")
    if ds.eval_before is not None:
        print_fn("grpojax: held-out before RL: " + _fmt_eval(ds.eval_before))
    trainer = make_trainer(
        cfg, run.model, run.mesh, reward_weights=reward_weights, teacher_dir=run.teacher_dir
    )
    save_lora_base(trainer, cfg, ckpts.rl_dir)  # warm-started LoRA base, once
    ckpts.save_rl(trainer, rollouts, ds, source, cfg, force=True)
    ckpts.rl.wait()
    kill_point("rl_ckpt0")
    ckpts.sft.clear()
    return trainer, None


def train(
    cfg: RunConfig,
    *,
    reward_specs: Sequence | None = None,
    stop_after: int | None = None,
    show_progress: bool = True,
    run_root: str | pathlib.Path = "runs",
    print_fn: Callable[[str], None] = print,
    policy_metrics_every: int = 1,
    stop_after_sft: int | None = None,
) -> RunResult:
    """Run `cfg`: [SFT warm start] -> eval -> RL steps -> eval, with logs and checkpoints.

    Args:
      cfg: the run configuration. `cfg.checkpoint.resume` continues from the newest
        readable checkpoint in the run directory: an RL checkpoint (step 0 is the
        warm-started policy, saved right after SFT and the first evaluation, which are
        then not repeated), else an SFT checkpoint (SFT continues); with none of either it
        is an error. Without it, a checkpoint directory that already holds checkpoints is
        an error.
      reward_specs: reward functions / `RewardSpec`s replacing `cfg.rewards.names`.
      stop_after: stop (as on SIGTERM: save and return) after this many RL steps of this
        invocation (0: right after the warm start is saved); for tests and time-boxed jobs.
      show_progress: tqdm bars for SFT, RL and evaluation.
      run_root: where a run directory is created when `cfg.log.run_dir` is None.
      print_fn: where human-readable lines go.
      policy_metrics_every: run the extra policy forward that gives the
        sampler-vs-trainer logprob difference and the entropy every this many steps
        (0: never; the update itself does not need it).
      stop_after_sft: stop (as on SIGTERM) after this many SFT steps of this invocation.

    Returns:
      A `RunResult`; `stopped_by` is the signal name (or "stop_after") when the run ended
      early, after saving a checkpoint.
    """
    t_start = time.perf_counter()
    first_step_s = None
    if cfg.env.enabled and reward_specs is not None:
        raise UserError(
            f"reward_specs: a multi-turn run (env.name={cfg.env.name!r}) is scored by its "
            "environment; pass no reward functions"
        )
    if not is_primary():  # process 0 alone prints, shows progress and writes files
        print_fn, show_progress = (lambda _: None), False
    show_progress = show_progress and cfg.log.progress  # SFT, RL and evaluation bars alike
    run_dir = make_run_dir(cfg, root=run_root)
    check_run_dir(run_dir)
    _check_checkpoints(cfg, run_dir)
    run = start_run(cfg, run_dir=run_dir, check_rewards=reward_specs is None, check_prompts=True)
    ckpts = _Checkpoints(cfg, run.run_dir)
    have_rl = bool(ckpts.rl.all_steps())
    # A multi-turn run's rewards are its environment's (`grpojax.rollouts.episodes`).
    manager = None if cfg.env.enabled else build_reward_manager(cfg, reward_specs)
    reward_weights = None if manager is None else manager.weights
    source = prompt_source(cfg, run.train_rows, run.tokenizer)
    ptx_source = ptx_data(cfg, run.train_rows, run.tokenizer, run.mesh)
    ds = DriverState()
    trainer: Trainer | None = None
    restored = None
    rollouts: Rollouts | None = None
    logger = None
    stopped_by = None
    eval_after = None
    try:
        # How the samples are produced: engine, strategy, buffer, rounds ahead, the key.
        rollouts = Rollouts(
            cfg,
            run.tokenizer,
            source,
            manager,
            train_mesh=run.mesh,
            sample_mesh=run.rollout_mesh,  # split placement: `mesh.rollout_devices`
            packer=build_packer(cfg, run.mesh),
        )
        run_eval = heldout_evaluator(
            cfg,
            run.tokenizer,
            run.heldout_rows,
            manager,
            mesh=run.mesh,
            show_progress=show_progress,
            engine=rollouts.external_engine,  # vLLM evaluates what it samples
        )
        if cfg.checkpoint.resume and have_rl:
            trainer = make_trainer(
                cfg, run.model, run.mesh, reward_weights=reward_weights, teacher_dir=run.teacher_dir
            )
            restore_lora_base(trainer, cfg, ckpts.rl_dir)
            abstract, shardings = checkpoint_target(trainer, run.mesh)
            restored = ckpts.rl.restore_latest(abstract, shardings=shardings)
            if restored is not None:
                check_lora_base(trainer, restored.driver_state, f"{ckpts.rl_dir}")
                check_teacher_weights(trainer, restored.driver_state, f"{ckpts.rl_dir}")
        logger = MetricsLogger(
            run.run_dir,
            jsonl=cfg.log.jsonl,
            tensorboard=cfg.log.tensorboard,
            wandb=cfg.log.wandb,
            wandb_project=cfg.log.wandb_project,
            config=config_to_dict(cfg),
            resume_step=restored.step if restored is not None else None,
        )
        # SIGTERM/SIGINT from here on: finish the SFT or RL step in flight, save, return.
        with GracefulExit() as stop:
            if restored is not None:
                trainer.state = trainer.with_checkpoint_state(restored.state.train)
                ds = DriverState.from_json(restored.driver_state)
                rollouts.restore(restored.state, ds)
                source.restore(ds.data)
                # A run stopped between RL checkpoint 0 and the SFT clean-up left the warm
                # start's checkpoints behind; RL checkpoint 0 supersedes them.
                ckpts.sft.clear()
                print_fn(
                    f"grpojax: resumed {run.run_dir} at step {ds.step} (checkpoint {restored.step})"
                )
            else:
                trainer, stopped_by = _warm_start(
                    cfg,
                    run,
                    ckpts,
                    rollouts,
                    ds,
                    source,
                    run_eval,
                    stop,
                    reward_weights=reward_weights,
                    show_progress=show_progress,
                    stop_after_sft=stop_after_sft,
                    print_fn=print_fn,
                )

            done_this_run = 0
            if stopped_by is None and (stop.requested or stop_after == 0):
                stopped_by = stop.signal_name or "stop_after"
            bar = progress(
                cfg.total_steps,
                cfg.algo,
                initial=ds.step,
                disable=not show_progress or stopped_by is not None,
            )
            while stopped_by is None and ds.step < cfg.total_steps:
                t0 = time.perf_counter()
                times = {"generate": 0.0, "reward": 0.0}
                # B groups of G completions, scored, and the trainer's logprob pass on their
                # batch: reference logprobs (and the policy's, for the sampler-vs-trainer
                # metrics).
                policy = trainer.policy()
                with_policy = policy_metrics_every > 0 and ds.step % policy_metrics_every == 0
                logprobs = functools.partial(trainer.logprobs, with_policy=with_policy)
                got = rollouts.next(policy, ds, logprobs, times)
                logp, ent, ref_logp = got.logprobs
                t1 = time.perf_counter()
                policy_stats = None
                if logp is not None:  # sampler vs trainer, on the devices
                    policy_stats = host_values(
                        logprob_agreement(
                            logp, got.batch.sampler_logp_nt, ent, got.batch.completion_mask_nt
                        )
                    )
                # Update: advantages from the rewards, inside the jitted step.
                t2 = time.perf_counter()
                # PPO-ptx's rows of this step: a function of the step (resume is exact).
                ptx = None if ptx_source is None else ptx_source.batch(ds.step)
                update_metrics = host_values(trainer.update(got.batch, logp, ref_logp, ptx=ptx))
                t3 = time.perf_counter()
                ds.step += 1
                done_this_run += 1
                if first_step_s is None:
                    first_step_s = t3 - t_start
                seconds = {"logprobs": got.logprob_s + t2 - t1, "update": t3 - t2, "step": t3 - t0}
                m = _step_log(cfg, got, update_metrics, policy_stats, ds, times, seconds)
                if cfg.eval.every and ds.step % cfg.eval.every == 0 and ds.step < cfg.total_steps:
                    rollouts.drain()  # the reward functions serve one caller at a time
                    ev = run_eval(trainer.policy(), f"step {ds.step}", ds.step)
                    if ev is not None:
                        m.update({f"eval/{k}": v for k, v in ev.items()})
                        m["success"] = ev["pass@1"]
                if ds.step % cfg.log.every == 0:
                    logger.log(ds.step, m)
                bar.update(m)
                kill_point("rl_step", ds.step)
                ckpts.save_rl(trainer, rollouts, ds, source, cfg)
                if any_process(stop.requested):  # every process stops after the same step
                    stopped_by = stop.signal_name or "signal on another process"
                elif stop_after is not None and done_this_run >= stop_after:
                    stopped_by = "stop_after"
            bar.close()
        if trainer is not None:
            ckpts.save_rl(trainer, rollouts, ds, source, cfg, force=True)
        ckpts.rl.wait()
        if stopped_by is None:
            kill_point("final_eval")
            eval_after = run_eval(trainer.policy(), "after", ds.step)
            if eval_after is not None:
                print_fn("grpojax: held-out after RL: " + _fmt_eval(eval_after))
                logger.log(ds.step, {f"eval/{k}": v for k, v in eval_after.items()})
            if cfg.log.plot and is_primary():
                _plots(run.run_dir, ds.eval_before, eval_after, cfg)
            if cfg.log.export_hf:
                # Only a finished run: a stopped one is continued with --resume, and its
                # checkpoint can be exported any time with `grpojax export`.
                hf_dir = run.run_dir / "hf"
                export_policy(trainer, run.tokenizer, hf_dir)
                print_fn(f"grpojax: final policy exported to {hf_dir} (Hugging Face format)")
        else:
            where = ckpts.rl.directory if trainer is not None else ckpts.sft.directory
            phase = f"step {ds.step}" if trainer is not None else "an SFT step"
            print_fn(
                f"grpojax: stopped by {stopped_by} after {phase}; checkpoint saved in "
                f"{where} (continue with --resume / checkpoint.resume=true)"
            )
        summary = {
            "steps": ds.step,
            "stopped_by": stopped_by,
            "eval_before": ds.eval_before,
            "eval_after": eval_after,
            "counters": ds.counters,
        }
        if is_primary():
            (run.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    finally:
        if rollouts is not None:
            rollouts.close()
        if logger is not None:
            logger.close()
        ckpts.close()
        if manager is not None:
            manager.close()
    return RunResult(
        run_dir=run.run_dir,
        eval_before=ds.eval_before,
        eval_after=eval_after,
        steps=ds.step,
        stopped_by=stopped_by,
        wall_s=time.perf_counter() - t_start,
        trainer=trainer,
        first_step_s=first_step_s,
    )
