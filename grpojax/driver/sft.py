"""Supervised fine-tuning: the warm start before RL and `grpojax sft`'s run (`run_sft`).

Batches are drawn from a per-epoch permutation of the rows (the run's "sft_order" stream),
a function of the step only, so a resumed warm start replays the same batches; prompt and
completion are tokenized as the sampler sees them (`grpojax.data.encode_sft`, EOS appended).
"""

from __future__ import annotations

import functools

import numpy as np
from flax import nnx

from grpojax.config import RunConfig
from grpojax.data import encode_sft, pad_id_of, stop_ids_of
from grpojax.distributed import any_process, host_values, kill_point
from grpojax.driver.checkpoint import Checkpointer
from grpojax.driver.metrics import MetricsLogger, progress
from grpojax.driver.setup import (
    build_episode_runner,
    check_demonstrations,
)
from grpojax.driver.signals import GracefulExit
from grpojax.envs import demonstration_episodes, episode_batch
from grpojax.errors import UserError
from grpojax.models.sharding import put_global
from grpojax.rng import numpy_rng, run_key
from grpojax.train import (
    OptimizerConfig,
    SFTBatch,
    batch_shardings,
    create_train_state,
    make_optimizer,
    make_schedule,
    make_sft_step,
    shard_train_state,
)

__all__ = [
    "batch_rows",
    "demonstration_batch",
    "episode_demonstration_batch",
    "run_sft",
]


@functools.lru_cache(maxsize=4)
def _epoch_order(seed: int, purpose: str, num_rows: int, epoch: int) -> np.ndarray:
    return numpy_rng(seed, purpose, epoch).permutation(num_rows)


def batch_rows(seed: int, purpose: str, num_rows: int, batch_size: int, step: int) -> list[int]:
    """Row indices of batch `step` (from 0): epoch e visits the rows in a permutation drawn
    from the run's `purpose` stream e, batch i takes positions [i b, (i+1) b) of that
    sequence of epochs (straddling an epoch boundary where it falls on one). A function of
    the step only, so a resumed run draws the batches it would have drawn."""
    idx: list[int] = []
    pos = step * batch_size
    while len(idx) < batch_size:
        epoch, offset = divmod(pos, num_rows)
        take = min(batch_size - len(idx), num_rows - offset)
        order = _epoch_order(seed, purpose, num_rows, epoch)
        idx.extend(int(i) for i in order[offset : offset + take])
        pos += take
    return idx


def demonstration_batch(tokenizer, rows, cfg: RunConfig, *, pad_id: int) -> SFTBatch:
    """Host `SFTBatch` of (prompt, completion) rows as the sampler sees them
    (`grpojax.data.encode_sft`, completion width `rollout.max_new_tokens`); the loss mask is
    the completion (EOS included)."""
    enc = encode_sft(
        tokenizer,
        [r["prompt"] for r in rows],
        [r["completion"] for r in rows],
        completion_width=cfg.rollout.max_new_tokens,
        pad_id=pad_id,
    )
    tokens, mask = enc.sequences()
    p = enc.prompt_tokens_np.shape[1]
    loss_mask = np.zeros_like(mask)
    loss_mask[:, p:] = enc.completion_mask_nt()
    return SFTBatch(tokens, mask, loss_mask)


def episode_demonstration_batch(tokenizer, rows, cfg: RunConfig, *, pad_id: int) -> SFTBatch:
    """Host `SFTBatch` of an environment's scripted episodes on `rows` (`env.name` set:
    `grpojax.envs.demonstration_episodes`), laid out as the RL rows are (completion width
    `rollout.max_new_tokens`); the loss mask is the expert's ids, the environment's answers
    are context only. An environment without demonstrations is a UserError."""
    runner = build_episode_runner(cfg, rows, tokenizer, group_size=1)
    try:
        episodes = demonstration_episodes(runner, stop_ids=stop_ids_of(tokenizer))
    except ValueError as e:
        raise UserError(f"sft.steps={cfg.sft.steps} with env.name={cfg.env.name!r}: {e}") from None
    laid = episode_batch(episodes, width=cfg.rollout.max_new_tokens, pad_id=pad_id)
    p = laid.tokens_ns.shape[1] - laid.completion_mask_nt.shape[1]
    loss_mask = np.zeros_like(laid.mask_ns)
    loss_mask[:, p:] = laid.completion_mask_nt
    return SFTBatch(laid.tokens_ns, laid.mask_ns, loss_mask)


def run_sft(
    model,
    tokenizer,
    rows,
    cfg: RunConfig,
    *,
    mesh,
    logger: MetricsLogger | None = None,
    show_progress: bool = True,
    checkpointer: Checkpointer | None = None,
    resume: bool = False,
    stop: GracefulExit | None = None,
    stop_after: int | None = None,
) -> tuple[dict, bool]:
    """Warm-start `model` in place with `cfg.sft.steps` supervised steps on `rows`.

    Rows need `prompt` and `completion` columns (the built-in arithmetic task has both);
    with `env.name` set, the environment's scripted episodes on the rows are the
    demonstrations (`episode_demonstration_batch`).

    Args:
      checkpointer: where the SFT state (parameters, optimizer, step) is saved every
        `checkpointer.every` steps and when stopped early.
      resume: continue from the newest SFT checkpoint in `checkpointer` (bit-exact: the
        batch order is replayed up to that step).
      stop: a `GracefulExit`; once it is requested, SFT ends after the current step.
      stop_after: end after this many steps of this call (for tests and time-boxed jobs).

    Returns:
      (metrics of the last step, stopped): `stopped` is True when SFT ended early; `model`
      then holds the parameters of the last completed step.
    """
    s = cfg.sft
    if s.steps == 0:
        return {}, False
    check_demonstrations(cfg, rows)
    opt = OptimizerConfig(
        learning_rate=s.learning_rate, warmup_steps=min(10, s.steps // 10), max_grad_norm=1.0
    )
    tx = make_optimizer(opt)
    graphdef, state = create_train_state(model, tx, rng=run_key(cfg.seed, "sft_state"))
    state, shardings = shard_train_state(state, tx, mesh)
    start = 0
    if resume and checkpointer is not None and checkpointer.all_steps():
        restored = checkpointer.restore_latest({"sft": state}, shardings={"sft": shardings})
        if restored is not None:
            state, start = restored.state["sft"], restored.step

    pad_id = pad_id_of(tokenizer)
    step_fn, shape = None, None
    metrics: dict = {}
    stopped = False
    bar = progress(
        s.steps, "sft", keys=(("loss", "loss", ".3f"),), initial=start, disable=not show_progress
    )
    for i in range(start, s.steps):
        chosen = [rows[j] for j in batch_rows(cfg.seed, "sft_order", len(rows), s.batch_size, i)]
        make_batch = episode_demonstration_batch if cfg.env.enabled else demonstration_batch
        batch = make_batch(tokenizer, chosen, cfg, pad_id=pad_id)
        tokens = batch.tokens_ns
        batch = put_global(batch, batch_shardings(batch, mesh))  # each device: its rows
        if step_fn is None or tokens.shape != shape:
            shape = tokens.shape
            step_fn = make_sft_step(
                graphdef,
                tx,
                s.step,
                mesh=mesh,
                state_shardings=shardings,
                batch=batch,
                schedule=make_schedule(opt),
            )
        state, m = step_fn(state, batch)
        metrics = {k: float(v) for k, v in host_values(m).items()}
        if logger is not None:
            logger.log(i, {f"sft/{k}": v for k, v in metrics.items()})
        bar.update({"loss": metrics["loss"]})
        done = i + 1
        requested = any_process(stop is not None and stop.requested)  # all stop together
        stopped = done < s.steps and (
            requested or (stop_after is not None and done - start >= stop_after)
        )
        kill_point("sft_step", done)
        if checkpointer is not None:
            if checkpointer.save(done, {"sft": state}, {"sft_step": done}, force=stopped):
                kill_point("sft_save", done)
        if stopped:
            break
    bar.close()
    if checkpointer is not None:
        checkpointer.wait()
    nnx.update(model, state.params)
    return metrics, stopped
