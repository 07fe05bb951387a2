"""The RL driver loop: prompts -> sampler -> rewards -> advantages -> jitted update -> log/save.

`train(cfg)` runs one `RunConfig` end to end: build the model, tokenizer, data and reward
functions; optionally warm-start with SFT; evaluate the held-out set; run `total_steps` RL
steps (GRPO family or PPO); evaluate again; plot. Everything numeric stays in the jitted
pieces (`grpojax.sampling.generate`, the train steps); this module only moves data between
them and keeps the run's state.

The run's state is explicit and checkpointed as two parts (`grpojax.driver.checkpoint`):

  arrays  {"train": TrainState | PPOState, "sample_key": key}: parameters, optimizer,
          step counters, the step's shuffle key, the KL controller (inside the train
          state), the reference policy, and the sampler's key.
  JSON    `DriverState`: RL step, data position (`PromptSource.state()`), the DAPO
          dynamic-sampling buffer (groups sampled but not used yet), running counters
          (failed reward samples, resampling rounds, ...), the before-training evaluation.

Because the sampler, the rewards and the step are deterministic functions of that state,
a run stopped after step k and resumed continues bit-exactly (tested).

DAPO dynamic sampling (`RunConfig.use_dynamic_sampling`): each step needs B groups of G
completions. Groups whose (valid) rewards all agree carry no GRPO signal and are dropped;
further rounds of B prompts are sampled until B groups are collected, at most
`rollout.max_resample_rounds` extra rounds. Surplus groups wait in the buffer for the next
step; if the rounds run out, dropped groups fill the batch (their advantages are 0) so the
jitted step always sees the same shape, and the shortfall is logged.

Failed reward calls (timeouts, exceptions, NaN) never stop the run: those samples get
`valid = False`, no advantage, an empty completion mask (no loss, no KL), and are counted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import json
import logging
import pathlib
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from grpojax.driver.checkpoint import Checkpointer
from grpojax.driver.config import RunConfig, config_to_dict, save_config
from grpojax.driver.evaluate import decode_completions, evaluate, prompt_width
from grpojax.driver.metrics import MetricsLogger, plot_before_after, plot_metrics, progress
from grpojax.driver.signals import GracefulExit
from grpojax.sampling import generate

log = logging.getLogger(__name__)

# Smallest padded prompt width: short prompts (the built-in task's are ~6 tokens) should not
# pay for 16 columns of padding in every forward.
MIN_PROMPT_WIDTH = 8

__all__ = [
    "DriverState",
    "Group",
    "RunResult",
    "Trainer",
    "assemble_batch",
    "build_datasets",
    "build_model",
    "build_reward_manager",
    "heldout_evaluator",
    "make_run_dir",
    "run_sft",
    "start_run",
    "train",
]


# ----------------------------------------------------------------------------------------
# Building blocks from the config
# ----------------------------------------------------------------------------------------


def build_model(cfg: RunConfig, *, mesh=None):
    """(model, tokenizer) for `cfg.model`: the built-in tiny model or a local HF directory."""
    from grpojax.models import Decoder, builtin_tokenizer, from_pretrained, shard_model, tiny_config

    spec = cfg.model
    if spec.is_builtin:
        config = tiny_config(dtype=spec.dtype, param_dtype=spec.param_dtype, remat=spec.remat)
        model = Decoder(config, rngs=nnx.Rngs(cfg.seed))
        if mesh is not None:
            shard_model(model, mesh)
        return model, builtin_tokenizer()
    from transformers import AutoTokenizer

    path = pathlib.Path(spec.source)
    if not path.is_dir():
        raise FileNotFoundError(
            f"model.source {spec.source!r} is neither 'tiny' nor an existing local directory"
        )
    model = from_pretrained(path, dtype=spec.dtype, mesh=mesh, remat=spec.remat)
    return model, AutoTokenizer.from_pretrained(path)


def build_datasets(cfg: RunConfig, tokenizer):
    """(train rows, held-out rows or None) for `cfg.data` (rows are dicts with `prompt`)."""
    from grpojax.data import (
        FormattedRows,
        PromptFormatter,
        arithmetic_task,
        load_prompt_dataset,
        reasoning_gym_split,
    )

    d = cfg.data
    if d.kind == "arithmetic":
        task = arithmetic_task(d.name)
        train_rows = task.rows("train", d.size, seed=cfg.seed)
        heldout = task.rows("heldout", cfg.eval.heldout_size, seed=cfg.seed)
        if d.template is not None:
            fmt = PromptFormatter(d.template, tokenizer=tokenizer, chat=d.chat_template)
            train_rows = FormattedRows(train_rows, fmt, name=f"arithmetic:{d.name}")
            heldout = FormattedRows(heldout, fmt, name=f"arithmetic:{d.name}:heldout")
        return train_rows, heldout
    if d.kind == "reasoning_gym":
        return reasoning_gym_split(
            d.name,
            train_size=d.size,
            heldout_size=cfg.eval.heldout_size,
            seed=cfg.seed,
            template=d.template,
            tokenizer=tokenizer,
            chat=d.chat_template,
            system_prompt=d.system_prompt,
        )
    kwargs = dict(
        template=d.template,
        tokenizer=tokenizer,
        chat=d.chat_template,
        system_prompt=d.system_prompt,
        prompt_column=d.prompt_column,
    )
    train_rows = load_prompt_dataset(d.path, **kwargs)
    heldout = load_prompt_dataset(d.eval_path, **kwargs) if d.eval_path else None
    return train_rows, heldout


def _reward_function(name: str, tokenizer):
    from grpojax import rewards

    fns = {
        "numeric_answer": rewards.numeric_answer_reward,
        "math_answer": rewards.math_answer_reward,
        "format": rewards.format_reward,
        "reasoning_gym": rewards.reasoning_gym_reward,
        "code_execution": rewards.code_execution_reward,
    }
    return fns[name]


def build_reward_manager(cfg: RunConfig, tokenizer, reward_specs: Sequence | None = None):
    """A `RewardManager` for `cfg.rewards` (or for `reward_specs`, functions or RewardSpecs,
    when given: research code and tests plug their own functions in this way)."""
    from grpojax.rewards import RewardManager

    r = cfg.rewards
    if reward_specs is not None:
        return RewardManager(
            list(reward_specs), mode=r.mode, num_workers=r.num_workers, timeout_s=r.timeout_s
        )
    fns = [_reward_function(n, tokenizer) for n in r.names]
    return RewardManager(
        fns,
        weights=list(r.resolved_weights),
        names=list(r.names),
        mode=r.mode,
        num_workers=r.num_workers,
        timeout_s=r.timeout_s,
    )


def heldout_evaluator(cfg: RunConfig, tokenizer, heldout, manager, *, mesh, show_progress=True):
    """`run_eval(model, tag) -> scores | None`: held-out pass@1 and mean@k as `cfg.eval` sets
    them, scored by the run's first reward function (a failed score counts as 0), with an
    evaluation key fixed by the seed so every evaluation of a run sees the same samples.
    Returns None when the data has no held-out split."""
    name = manager.names[0]
    key = jax.random.key(cfg.seed + 1_000_003)

    def score_fn(prompts, completions, columns):
        res = manager.compute(prompts, completions, **columns)
        return np.nan_to_num(res.per_fn[name], nan=0.0)

    def run_eval(model, tag: str) -> dict | None:
        if heldout is None:
            return None
        return evaluate(
            model,
            tokenizer,
            heldout,
            score_fn=score_fn,
            max_new_tokens=cfg.rollout.max_new_tokens,
            k=cfg.eval.k,
            temperature=cfg.eval.temperature,
            batch_size=cfg.eval.batch_size,
            key=key,
            mesh=mesh,
            desc=f"eval {tag}",
            min_prompt_width=MIN_PROMPT_WIDTH,
            show_progress=show_progress,
        )

    return run_eval


def make_run_dir(cfg: RunConfig, *, root: str | pathlib.Path = "runs") -> pathlib.Path:
    """`cfg.log.run_dir`, or a fresh `runs/<algo>-<timestamp>` (made unique)."""
    if cfg.log.run_dir is not None:
        return pathlib.Path(cfg.log.run_dir)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = pathlib.Path(root) / f"{cfg.algo}-{stamp}"
    path, i = base, 1
    while path.exists():
        path = base.with_name(f"{base.name}-{i}")
        i += 1
    return path


def start_run(cfg: RunConfig, *, root: str | pathlib.Path = "runs"):
    """What every run command begins with: the run directory (made, with `config.yaml`
    saved in it), the mesh, the model and tokenizer, and the train / held-out rows.

    Returns `(run_dir, mesh, model, tokenizer, train_rows, heldout_rows)`.
    """
    from grpojax.models import make_mesh

    run_dir = make_run_dir(cfg, root=root)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    mesh = make_mesh(data=cfg.mesh.data, fsdp=cfg.mesh.fsdp, tensor=cfg.mesh.tensor)
    model, tokenizer = build_model(cfg, mesh=mesh)
    train_rows, heldout = build_datasets(cfg, tokenizer)
    return run_dir, mesh, model, tokenizer, train_rows, heldout


def latest_run_dir(root: str | pathlib.Path = "runs") -> pathlib.Path | None:
    """The most recently modified run directory under `root` holding checkpoints, or None."""
    root = pathlib.Path(root)
    if not root.is_dir():
        return None
    runs = [p for p in root.iterdir() if (p / "checkpoints").is_dir()]
    return max(runs, key=lambda p: p.stat().st_mtime) if runs else None


def _stop_ids(tokenizer) -> tuple[int, ...]:
    eos = tokenizer.eos_token_id
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list | tuple) else (int(eos),)


def _pad_id(tokenizer) -> int:
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if candidate is not None:
            return int(candidate)
    return 0


# ----------------------------------------------------------------------------------------
# SFT warm start
# ----------------------------------------------------------------------------------------


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

    Rows need `prompt` and `completion` columns (the built-in arithmetic task has both).
    Batches are drawn from a seeded per-epoch permutation, a function of the step only;
    prompt and completion are tokenized as the sampler will see them
    (`grpojax.data.encode_sft`, EOS appended).

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
    from grpojax.data import encode_sft
    from grpojax.train import (
        OptimizerConfig,
        create_train_state,
        make_optimizer,
        make_schedule,
        make_sft_step,
        shard_train_state,
    )
    from grpojax.train.sft import SFTBatch

    s = cfg.sft
    if s.steps == 0:
        return {}, False
    first = rows[0]
    if "completion" not in first:
        raise ValueError(
            f"sft.steps={s.steps} needs demonstrations: the training rows have no 'completion' "
            f"column (columns: {sorted(first)}); set sft.steps=0"
        )
    opt = OptimizerConfig(
        learning_rate=s.learning_rate, warmup_steps=min(10, s.steps // 10), max_grad_norm=1.0
    )
    tx = make_optimizer(opt)
    graphdef, state = create_train_state(model, tx, rng=jax.random.key(cfg.seed))
    state, shardings = shard_train_state(state, tx, mesh)
    start = 0
    if resume and checkpointer is not None and checkpointer.all_steps():
        restored = checkpointer.restore_latest({"sft": state}, shardings={"sft": shardings})
        if restored is not None:
            state, start = restored.state["sft"], restored.step

    rng = np.random.default_rng([cfg.seed, 17])
    order, pos, epoch = rng.permutation(len(rows)), 0, 0

    def next_indices() -> list[int]:
        nonlocal order, pos, epoch
        idx = []
        while len(idx) < s.batch_size:
            if pos == len(order):
                epoch += 1
                order, pos = np.random.default_rng([cfg.seed, 17, epoch]).permutation(len(rows)), 0
            idx.append(int(order[pos]))
            pos += 1
        return idx

    for _ in range(start):  # replay the batch order of the steps already taken
        next_indices()
    width = cfg.rollout.max_new_tokens
    step_fn, shape = None, None
    metrics: dict = {}
    stopped = False
    bar = progress(
        s.steps,
        "sft",
        keys=(("loss", "loss", ".3f"),),
        initial=start,
        disable=not show_progress,
    )
    for i in range(start, s.steps):
        batch_rows = [rows[j] for j in next_indices()]
        enc = encode_sft(
            tokenizer,
            [r["prompt"] for r in batch_rows],
            [r["completion"] for r in batch_rows],
            completion_width=width,
            min_width=MIN_PROMPT_WIDTH,
            pad_id=_pad_id(tokenizer),
        )
        tokens, mask = enc.sequences()
        p = enc.prompt_tokens_np.shape[1]
        loss_mask = np.zeros_like(mask)
        loss_mask[:, p:] = enc.completion_mask_nt()
        batch = SFTBatch(jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(loss_mask))
        if step_fn is None or tokens.shape != shape:
            shape = tokens.shape
            step_fn = make_sft_step(
                graphdef,
                tx,
                cfg.sft.step,
                mesh=mesh,
                state_shardings=shardings,
                batch=batch,
                schedule=make_schedule(opt),
            )
        state, m = step_fn(state, batch)
        if logger is not None:
            metrics = {k: float(v) for k, v in m.items()}
            logger.log(i, {f"sft/{k}": v for k, v in metrics.items()})
        bar.update({"loss": m["loss"]})
        done = i + 1
        stopped = done < s.steps and (
            (stop is not None and stop.requested)
            or (stop_after is not None and done - start >= stop_after)
        )
        if checkpointer is not None:
            checkpointer.save(done, {"sft": state}, {"sft_step": done}, force=stopped)
        if stopped:
            break
    bar.close()
    if checkpointer is not None:
        checkpointer.wait()
    nnx.update(model, state.params)
    return metrics, stopped


# ----------------------------------------------------------------------------------------
# Groups, the dynamic-sampling buffer and batch assembly (host NumPy)
# ----------------------------------------------------------------------------------------


@dataclasses.dataclass
class Group:
    """G completions of one prompt with their rewards (host arrays, T = max_new_tokens).

    prompt_ids: the prompt's real token ids (no padding).
    tokens_gt, lengths_g, logp_gt, keep_threshold_gt, eos_g: from the `Rollout` rows.
    total_g: `[G]` weighted reward (0 where invalid); valid_g: `[G]` bool.
    per_fn: name -> `[G]` reward of each function (NaN where unscored or failed).
    """

    prompt_ids: list[int]
    tokens_gt: np.ndarray
    lengths_g: np.ndarray
    logp_gt: np.ndarray
    keep_threshold_gt: np.ndarray
    eos_g: np.ndarray
    total_g: np.ndarray
    valid_g: np.ndarray
    per_fn: dict[str, np.ndarray]

    def reward_std(self) -> float:
        """Std of the valid samples' rewards (0 when fewer than two are valid)."""
        v = self.total_g[self.valid_g]
        return float(v.std()) if v.size > 1 else 0.0

    def to_json(self) -> dict:
        # JSON has no inf/NaN: non-finite values travel as the strings "inf", "-inf", "nan".
        def floats(x):
            return [[float(v) if np.isfinite(v) else str(float(v)) for v in row] for row in x]

        return {
            "prompt_ids": [int(i) for i in self.prompt_ids],
            "tokens_gt": self.tokens_gt.tolist(),
            "lengths_g": self.lengths_g.tolist(),
            "logp_gt": floats(self.logp_gt),
            "keep_threshold_gt": floats(self.keep_threshold_gt),
            "eos_g": self.eos_g.tolist(),
            "total_g": [float(v) for v in self.total_g],
            "valid_g": self.valid_g.tolist(),
            "per_fn": {k: floats(v[None])[0] for k, v in self.per_fn.items()},
        }

    @classmethod
    def from_json(cls, d: dict) -> Group:
        def arr(x, dtype):
            return np.array([[float(v) for v in row] for row in x], dtype)

        return cls(
            prompt_ids=list(d["prompt_ids"]),
            tokens_gt=np.array(d["tokens_gt"], np.int32),
            lengths_g=np.array(d["lengths_g"], np.int32),
            logp_gt=arr(d["logp_gt"], np.float32),
            keep_threshold_gt=arr(d["keep_threshold_gt"], np.float32),
            eos_g=np.array(d["eos_g"], bool),
            total_g=np.array(d["total_g"], np.float32),
            valid_g=np.array(d["valid_g"], bool),
            per_fn={k: arr([v], np.float32)[0] for k, v in d["per_fn"].items()},
        )


def groups_from_rollout(rollout, prompt_ids: list[list[int]], reward) -> list[Group]:
    """Split a `Rollout` of B prompts x G samples and its `RewardResult` into B groups."""
    g = rollout.group_size
    host = jax.device_get(
        (
            rollout.tokens_nt,
            rollout.lengths_n,
            rollout.logp_nt,
            rollout.keep_threshold_nt,
            rollout.eos_found_n,
        )
    )
    tokens, lengths, logp, thr, eos = (np.asarray(x) for x in host)
    out = []
    for b, ids in enumerate(prompt_ids):
        sl = slice(b * g, (b + 1) * g)
        out.append(
            Group(
                prompt_ids=list(ids),
                tokens_gt=tokens[sl].astype(np.int32),
                lengths_g=lengths[sl].astype(np.int32),
                logp_gt=logp[sl].astype(np.float32),
                keep_threshold_gt=thr[sl].astype(np.float32),
                eos_g=eos[sl].astype(bool),
                total_g=np.asarray(reward.total_n[sl], np.float32),
                valid_g=np.asarray(reward.valid_n[sl], bool),
                per_fn={k: np.asarray(v[sl], np.float32) for k, v in reward.per_fn.items()},
            )
        )
    return out


@dataclasses.dataclass
class AssembledBatch:
    """B groups as `[N, ...]` host arrays, N = B*G, S = P + T."""

    tokens_ns: np.ndarray
    mask_ns: np.ndarray
    completion_mask_nt: np.ndarray
    lengths_n: np.ndarray
    rewards_n: np.ndarray
    valid_n: np.ndarray
    sampler_logp_nt: np.ndarray
    keep_threshold_nt: np.ndarray
    eos_n: np.ndarray


def assemble_batch(
    groups: Sequence[Group], *, pad_id: int, min_prompt_width: int = MIN_PROMPT_WIDTH
):
    """Stack groups into one batch: prompts left-padded to the bucket width P (`prompt_width`).

    Invalid samples (failed reward calls) get an all-False completion mask, so they add
    nothing to any loss term; masks are built from lengths.
    """
    p = prompt_width(max(len(gr.prompt_ids) for gr in groups), min_width=min_prompt_width)
    rows_tok, rows_mask = [], []
    for gr in groups:
        g, t = gr.tokens_gt.shape
        prompt = np.full((p,), pad_id, np.int32)
        prompt[p - len(gr.prompt_ids) :] = gr.prompt_ids
        pmask = np.arange(p) >= p - len(gr.prompt_ids)
        cmask = np.arange(t)[None, :] < gr.lengths_g[:, None]
        rows_tok.append(np.concatenate([np.broadcast_to(prompt, (g, p)), gr.tokens_gt], 1))
        rows_mask.append(np.concatenate([np.broadcast_to(pmask, (g, p)), cmask], 1))
    tokens = np.concatenate(rows_tok).astype(np.int32)
    mask = np.concatenate(rows_mask)
    valid = np.concatenate([gr.valid_g for gr in groups])
    lengths = np.concatenate([gr.lengths_g for gr in groups])
    cmask = mask[:, p:] & valid[:, None]
    return AssembledBatch(
        tokens_ns=tokens,
        mask_ns=mask,
        completion_mask_nt=cmask,
        lengths_n=lengths,
        rewards_n=np.concatenate([gr.total_g for gr in groups]),
        valid_n=valid,
        sampler_logp_nt=np.concatenate([gr.logp_gt for gr in groups]),
        keep_threshold_nt=np.concatenate([gr.keep_threshold_gt for gr in groups]),
        eos_n=np.concatenate([gr.eos_g for gr in groups]),
    )


# ----------------------------------------------------------------------------------------
# Trainers: GRPO family and PPO behind one small interface
# ----------------------------------------------------------------------------------------


def _make_logprob_fn(graphdef, forward, mesh, group_size: int):
    """Jitted trainer-side pass: (policy logp `[N, T]`, policy entropy `[N, T]`) or
    (None, None) without `with_policy`, and ref logp `[N, T]` (None without a reference).
    `group_size` > 1 runs each group's shared prompt once (`policy_logprobs`)."""
    from grpojax.train.common import policy_logprobs

    @functools.partial(jax.jit, static_argnames="with_policy")
    def fn(params, ref_params, tokens, mask, cmask, *, with_policy):
        logp = ent = ref = None
        if with_policy:
            logp, ent = policy_logprobs(
                nnx.merge(graphdef, params),
                tokens,
                mask,
                cmask,
                forward=forward,
                with_entropy=True,
                group_size=group_size,
            )
        if ref_params is not None:
            ref, _ = policy_logprobs(
                nnx.merge(graphdef, ref_params),
                tokens,
                mask,
                cmask,
                forward=forward,
                group_size=group_size,
            )
        return logp, ent, ref

    def call(params, ref_params, tokens, mask, cmask, *, with_policy=True):
        if ref_params is None and not with_policy:
            return None, None, None
        with jax.set_mesh(mesh):
            return fn(params, ref_params, tokens, mask, cmask, with_policy=with_policy)

    return call


class Trainer:
    """The algorithm-specific half of the loop: state, logprobs, batch and update.

    `state` is the checkpointed train pytree; `policy_params()` the sampler's parameters;
    `logprobs(batch)` the trainer-side pass (policy logprobs for the sampler comparison,
    entropy, reference logprobs); `update(batch, logp)` one jitted step.
    """

    def __init__(self, cfg: RunConfig, model, mesh):
        from grpojax.train import (
            create_train_state,
            make_optimizer,
            make_schedule,
            shard_train_state,
        )

        self.cfg, self.mesh = cfg, mesh
        opt = cfg.optimizer_for("optimizer")
        self.tx = make_optimizer(opt)
        self.schedule = make_schedule(opt)
        self._steps: dict[tuple, Callable] = {}
        key = jax.random.key(cfg.seed)
        if cfg.is_ppo:
            from grpojax.train.ppo import create_ppo_state, init_critic, shard_ppo_state

            critic = init_critic(
                model, mode=cfg.ppo.critic, rngs=nnx.Rngs(jax.random.fold_in(key, 1))
            )
            copt = cfg.optimizer_for("critic_optimizer")
            self.critic_tx = make_optimizer(copt)
            self.critic_schedule = make_schedule(copt)
            graphs, ppo_state = create_ppo_state(
                model, critic, self.tx, self.critic_tx, config=cfg.ppo, rng=key
            )
            ppo_state, shardings = shard_ppo_state(ppo_state, self.tx, self.critic_tx, mesh)
            self.graphs, self.graphdef = graphs, graphs.actor
            ref = jax.tree.map(jnp.copy, ppo_state.actor.params)
            self.state = {"ppo": ppo_state, "ref": ref}
            self.shardings = {"ppo": shardings, "ref": shardings.actor.params}
            self.forward = cfg.ppo.forward
        else:
            graphdef, st = create_train_state(
                model,
                self.tx,
                rng=key,
                kl_controller=None,
                with_ref=cfg.grpo.uses_reference,
            )
            st, shardings = shard_train_state(st, self.tx, mesh)
            self.graphdef = graphdef
            self.state = {"grpo": st}
            self.shardings = {"grpo": shardings}
            self.forward = cfg.grpo.forward
        # The driver's batches are G samples per prompt, in contiguous groups.
        group = cfg.group_size if cfg.grpo.share_prompt else 1
        self._logprob_fn = _make_logprob_fn(self.graphdef, self.forward, mesh, group)

    def policy_params(self):
        if self.cfg.is_ppo:
            return self.state["ppo"].actor.params
        return self.state["grpo"].params

    def ref_params(self):
        if self.cfg.is_ppo:
            return self.state["ref"]
        return self.state["grpo"].ref_params

    def policy(self):
        return nnx.merge(self.graphdef, self.policy_params())

    def logprobs(self, batch: AssembledBatch, *, with_policy: bool = True):
        """(policy logp, entropy, ref logp), each `[N, T]` or None (see `_make_logprob_fn`).

        The policy pass only feeds metrics (sampler-vs-trainer difference, entropy): the
        steps compute the logprobs they train on themselves.
        """
        return self._logprob_fn(
            self.policy_params(),
            self.ref_params(),
            jnp.asarray(batch.tokens_ns),
            jnp.asarray(batch.mask_ns),
            jnp.asarray(batch.completion_mask_nt),
            with_policy=with_policy,
        )

    def update(self, batch: AssembledBatch, logp, ref_logp) -> dict:
        """One jitted train step on `batch`; returns the step's metrics (device scalars)."""
        from grpojax.train import compute_advantages
        from grpojax.train.grpo import GRPOBatch, make_grpo_step
        from grpojax.train.ppo import PPOBatch, make_ppo_step

        cfg = self.cfg
        tokens = jnp.asarray(batch.tokens_ns)
        mask = jnp.asarray(batch.mask_ns)
        cmask = jnp.asarray(batch.completion_mask_nt)
        if cfg.is_ppo:
            scores = jnp.where(jnp.asarray(batch.valid_n), jnp.asarray(batch.rewards_n), 0.0)
            b = PPOBatch(tokens, mask, cmask, scores.astype(jnp.float32), ref_logp)
            key = ("ppo", tokens.shape)
            if key not in self._steps:
                self._steps[key] = make_ppo_step(
                    cfg.ppo,
                    self.graphs,
                    self.tx,
                    self.critic_tx,
                    mesh=self.mesh,
                    state=self.state["ppo"],
                    batch=b,
                    actor_schedule=self.schedule,
                    critic_schedule=self.critic_schedule,
                )
            self.state["ppo"], metrics = self._steps[key](self.state["ppo"], b)
            return metrics
        g = cfg.grpo
        adv = compute_advantages(
            jnp.asarray(batch.rewards_n),
            g,
            mask_nt=cmask,
            lengths_n=jnp.asarray(batch.lengths_n),
            valid_n=jnp.asarray(batch.valid_n),
        )
        single = g.num_epochs == 1 and g.num_minibatches == 1
        b = GRPOBatch(
            tokens_ns=tokens,
            mask_ns=mask,
            completion_mask_nt=cmask,
            advantages=adv,
            # The trainer-side pass already has them: the step need not recompute.
            old_logp_nt=None if single or logp is None else logp,
            ref_logp_nt=ref_logp if g.uses_reference else None,
            sampler_logp_nt=(
                jnp.asarray(batch.sampler_logp_nt)
                if g.tis_cap is not None or g.off_policy_delta is not None
                else None
            ),
            keep_threshold_nt=jnp.asarray(batch.keep_threshold_nt) if g.use_keep_mask else None,
        )
        key = ("grpo", tokens.shape, adv.shape)
        if key not in self._steps:
            self._steps[key] = make_grpo_step(
                self.graphdef,
                self.tx,
                g,
                mesh=self.mesh,
                state_shardings=self.shardings["grpo"],
                batch=b,
                schedule=self.schedule,
            )
        self.state["grpo"], metrics = self._steps[key](self.state["grpo"], b)
        return metrics


# ----------------------------------------------------------------------------------------
# Driver state
# ----------------------------------------------------------------------------------------


_COUNTERS = (
    "samples",
    "failed_reward_samples",
    "resample_rounds",
    "dropped_groups",
    "zero_var_fill_groups",
)


@dataclasses.dataclass
class DriverState:
    """The host-side state of the loop (JSON in the checkpoint; arrays live in `Trainer`).

    step: RL steps completed.
    data: the prompt source's position (`PromptSource.state()`).
    buffer: dynamic-sampling groups sampled but not yet trained on.
    counters: running totals (`_COUNTERS`).
    eval_before: held-out evaluation before RL (kept so a resumed run can report it).
    """

    step: int = 0
    data: dict = dataclasses.field(default_factory=dict)
    buffer: list[Group] = dataclasses.field(default_factory=list)
    counters: dict[str, float] = dataclasses.field(
        default_factory=lambda: dict.fromkeys(_COUNTERS, 0.0)
    )
    eval_before: dict | None = None

    def to_json(self, cfg: RunConfig) -> dict:
        return {
            "step": self.step,
            "data": self.data,
            "buffer": [g.to_json() for g in self.buffer],
            "counters": self.counters,
            "eval_before": self.eval_before,
            "config": config_to_dict(cfg),
        }

    @classmethod
    def from_json(cls, d: dict) -> DriverState:
        return cls(
            step=int(d["step"]),
            data=dict(d["data"]),
            buffer=[Group.from_json(g) for g in d.get("buffer", [])],
            counters={**dict.fromkeys(_COUNTERS, 0.0), **d.get("counters", {})},
            eval_before=d.get("eval_before"),
        )


@dataclasses.dataclass
class RunResult:
    """What `train` returns: the run directory, the before/after evaluations, timings."""

    run_dir: pathlib.Path
    eval_before: dict | None
    eval_after: dict | None
    steps: int
    stopped_by: str | None
    wall_s: float
    trainer: Trainer

    @property
    def success_before(self) -> float | None:
        return None if self.eval_before is None else self.eval_before["pass@1"]

    @property
    def success_after(self) -> float | None:
        return None if self.eval_after is None else self.eval_after["pass@1"]


# ----------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------


class _Sampler:
    """One round of sampling: B prompts -> G completions each -> rewards -> groups."""

    def __init__(self, cfg, tokenizer, source, manager, mesh):
        self.cfg, self.tok, self.source, self.manager, self.mesh = (
            cfg,
            tokenizer,
            source,
            manager,
            mesh,
        )
        self.stop_ids = _stop_ids(tokenizer)
        self.pad_id = _pad_id(tokenizer)

    def round(self, model, key, times: dict) -> tuple[list[Group], Any, dict]:
        cfg = self.cfg
        pb = self.source.next_batch(cfg.rollout.prompts_per_step)
        t0 = time.perf_counter()
        # A fresh host copy of the key: a key returned by the previous program carries that
        # program's placement, which would be a new jit cache entry (a recompile).
        key = jax.random.wrap_key_data(
            np.asarray(jax.random.key_data(key)), impl=jax.random.key_impl(key)
        )
        rollout = generate(
            model,
            pb.tokens_bp,
            pb.lengths_b,
            key=key,
            max_new_tokens=cfg.rollout.max_new_tokens,
            group_size=cfg.group_size,
            sampling=cfg.sampling,
            eos_ids=self.stop_ids,
            pad_id=self.pad_id,
            bucket=prompt_width(int(np.max(pb.lengths_b)), min_width=MIN_PROMPT_WIDTH),
            mesh=self.mesh,
        )
        jax.block_until_ready(rollout.tokens_nt)
        t1 = time.perf_counter()
        g = cfg.group_size
        texts = decode_completions(
            self.tok, rollout.tokens_nt, rollout.lengths_n, rollout.eos_found_n
        )
        prompts = [p for p in pb.prompts for _ in range(g)]
        columns = {k: [v for v in vals for _ in range(g)] for k, vals in pb.columns.items()}
        reward = self.manager.compute(prompts, texts, **columns)
        t2 = time.perf_counter()
        times["generate"] += t1 - t0
        times["reward"] += t2 - t1
        width = pb.tokens_bp.shape[1]
        ids = [
            [int(x) for x in pb.tokens_bp[b, width - int(pb.lengths_b[b]) :]]
            for b in range(len(pb.prompts))
        ]
        return groups_from_rollout(rollout, ids, reward), rollout.key, reward.stats


def _collect(sampler: _Sampler, trainer: Trainer, ds: DriverState, key, times: dict):
    """B groups for this step (dynamic sampling: from the buffer and fresh rounds)."""
    cfg = sampler.cfg
    b = cfg.rollout.prompts_per_step
    dynamic = cfg.use_dynamic_sampling
    groups: list[Group] = list(ds.buffer) if dynamic else []
    dropped: list[Group] = []
    stats: dict[str, float] = {}
    fresh: list[Group] = []
    rounds = 0
    model = trainer.policy()
    while len(groups) < b:
        if dynamic and rounds > cfg.rollout.max_resample_rounds:
            # Out of attempts: keep the shape static with zero-signal groups.
            need = b - len(groups)
            ds.counters["zero_var_fill_groups"] += min(need, len(dropped))
            groups += dropped[:need]
            break
        new, key, stats = sampler.round(model, key, times)
        rounds += 1
        fresh += new
        if dynamic:
            for gr in new:
                (groups if gr.reward_std() > 0 else dropped).append(gr)
        else:
            groups += new
    ds.counters["resample_rounds"] += max(0, rounds - 1)
    ds.counters["dropped_groups"] += len(dropped)
    ds.buffer = groups[b:] if dynamic else []
    return groups[:b], fresh, key, rounds, stats


def _step_metrics(batch, fresh, step_metrics, logp, ent, rounds, cfg, sampler_stats):
    """Host-side metrics of one step (floats)."""
    m: dict[str, float] = {}
    valid = batch.valid_n
    r = batch.rewards_n[valid]
    m["reward_mean"] = float(r.mean()) if r.size else float("nan")
    m["reward_std"] = float(r.std()) if r.size else float("nan")
    names = fresh[0].per_fn.keys() if fresh else []
    for name in names:
        vals = np.concatenate([gr.per_fn[name] for gr in fresh])
        vals = vals[np.isfinite(vals)]
        m[f"reward/{name}"] = float(vals.mean()) if vals.size else float("nan")
    sampled = np.concatenate([gr.total_g[gr.valid_g] for gr in fresh]) if fresh else []
    m["reward_sampled_mean"] = float(np.mean(sampled)) if len(sampled) else float("nan")
    m["frac_zero_std_groups"] = float(np.mean([gr.reward_std() == 0 for gr in fresh]))
    lengths = batch.lengths_n
    m["completion_len_mean"] = float(lengths.mean())
    m["completion_len_min"] = float(lengths.min())
    m["completion_len_max"] = float(lengths.max())
    m["truncated_frac"] = float(np.mean(~batch.eos_n))
    failed = sum(int((~gr.valid_g).sum()) for gr in fresh)
    m["reward_failed_samples"] = float(failed)
    m["ds_rounds"] = float(rounds)
    # Sampler vs trainer: the same tokens' logprobs from the decode loop and from a full
    # forward. Differences beyond rounding mean the two programs disagree.
    cmask = batch.completion_mask_nt
    if logp is not None:
        logp_h, ent_h = np.asarray(logp), np.asarray(ent)
        diff = np.abs(logp_h - batch.sampler_logp_nt)[cmask]
        m["logprob_diff_max"] = float(diff.max()) if diff.size else 0.0
        m["logprob_diff_mean"] = float(diff.mean()) if diff.size else 0.0
        m["entropy"] = float(ent_h[cmask].mean()) if cmask.any() else 0.0
    for k, v in step_metrics.items():
        key = {"kl_ref": "kl", "kl_ref_token": "kl_token", "entropy": "step_entropy"}.get(k, k)
        if cfg.is_ppo and k == "reward_mean":
            key = "ppo_shaped_reward_mean"
        m[key] = float(v)
    for k in ("rewards/worker_restarts",):
        if k in sampler_stats:
            m[k.replace("rewards/", "reward_")] = sampler_stats[k]
    return m


def _replicated(mesh):
    return NamedSharding(mesh, PartitionSpec())


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
        then not repeated), else an SFT checkpoint (`<checkpoints>-sft`, SFT continues).
        Without it, a checkpoint directory that already holds checkpoints is an error.
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
    from grpojax.data import PromptSource

    t_start = time.perf_counter()
    run_dir, mesh, model, tokenizer, train_rows, heldout = start_run(cfg, root=run_root)
    ckpt_dir = pathlib.Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints"
    ckpt = Checkpointer(
        ckpt_dir,
        every=cfg.checkpoint.every,
        keep=cfg.checkpoint.keep,
        async_save=cfg.checkpoint.async_save,
    )
    sft_ckpt = Checkpointer(
        ckpt_dir.with_name(ckpt_dir.name + "-sft"),
        every=cfg.checkpoint.every,
        keep=1,
        async_save=cfg.checkpoint.async_save,
    )
    if not cfg.checkpoint.resume and (ckpt.all_steps() or sft_ckpt.all_steps()):
        _close_checkpointers(ckpt, sft_ckpt)
        raise ValueError(
            f"{ckpt_dir} already holds checkpoints of an earlier run: continue it with "
            f"checkpoint.resume=true (--resume), or start a fresh run in another log.run_dir"
        )
    manager = build_reward_manager(cfg, tokenizer, reward_specs)
    source = PromptSource(
        train_rows,
        tokenizer,
        seed=cfg.seed,
        max_prompt_tokens=cfg.data.max_prompt_tokens,
        add_special_tokens=None,
        min_width=MIN_PROMPT_WIDTH,
    )
    run_eval = heldout_evaluator(
        cfg, tokenizer, heldout, manager, mesh=mesh, show_progress=show_progress
    )

    restored = None
    ds = DriverState()
    trainer = sample_key = None
    # The arrays' structure for a restore comes from a freshly built trainer.
    if cfg.checkpoint.resume and ckpt.all_steps():
        trainer = Trainer(cfg, model, mesh)
        abstract = {"train": trainer.state, "sample_key": jax.random.key(0)}
        shardings = {"train": trainer.shardings, "sample_key": _replicated(mesh)}
        restored = ckpt.restore_latest(abstract, shardings=shardings)
    logger = MetricsLogger(
        run_dir,
        jsonl=cfg.log.jsonl,
        tensorboard=cfg.log.tensorboard,
        wandb=cfg.log.wandb,
        wandb_project=cfg.log.wandb_project,
        config=config_to_dict(cfg),
        resume_step=restored.step if restored is not None else None,
    )
    stopped_by = None
    eval_after = None
    try:
        # SIGTERM/SIGINT from here on: finish the SFT or RL step in flight, save, return.
        with GracefulExit() as stop:
            if restored is not None:
                trainer.state = restored.state["train"]
                sample_key = restored.state["sample_key"]
                ds = DriverState.from_json(restored.driver_state)
                source.restore(ds.data)
                print_fn(
                    f"grpojax: resumed {run_dir} at step {ds.step} (checkpoint {restored.step})"
                )
            else:
                if cfg.sft.steps:
                    t0 = time.perf_counter()
                    _, sft_stopped = run_sft(
                        model,
                        tokenizer,
                        train_rows,
                        cfg,
                        mesh=mesh,
                        logger=None,
                        show_progress=show_progress,
                        checkpointer=sft_ckpt,
                        resume=cfg.checkpoint.resume,
                        stop=stop,
                        stop_after=stop_after_sft,
                    )
                    if sft_stopped:
                        stopped_by = stop.signal_name or "stop_after"
                    else:
                        print_fn(
                            f"grpojax: SFT warm start, {cfg.sft.steps} steps in "
                            f"{time.perf_counter() - t0:.1f}s"
                        )
                if stopped_by is None:
                    ds.eval_before = run_eval(model, "before")
                    if ds.eval_before is not None:
                        print_fn("grpojax: held-out before RL: " + _fmt_eval(ds.eval_before))
                    trainer = Trainer(cfg, model, mesh)
                    sample_key = jax.random.key(cfg.seed + 2)
                    # RL step 0 is the warm-started policy and its evaluation: a run stopped
                    # before its first periodic checkpoint resumes from here.
                    ckpt.save(0, _ckpt_tree(trainer, sample_key), ds.to_json(cfg), force=True)
                    ckpt.wait()
                    sft_ckpt.clear()
            del model

            sampler = _Sampler(cfg, tokenizer, source, manager, mesh)
            done_this_run = 0
            if stopped_by is None and (stop.requested or stop_after == 0):
                stopped_by = stop.signal_name or "stop_after"
            bar = progress(
                cfg.total_steps,
                cfg.algo,
                initial=ds.step,
                disable=not (show_progress and cfg.log.progress) or stopped_by is not None,
            )
            while stopped_by is None and ds.step < cfg.total_steps:
                t0 = time.perf_counter()
                times = {"generate": 0.0, "reward": 0.0}
                groups, fresh, sample_key, rounds, rstats = _collect(
                    sampler, trainer, ds, sample_key, times
                )
                batch = assemble_batch(groups, pad_id=sampler.pad_id)
                t1 = time.perf_counter()
                with_policy = policy_metrics_every > 0 and ds.step % policy_metrics_every == 0
                logp, ent, ref_logp = trainer.logprobs(batch, with_policy=with_policy)
                jax.block_until_ready((logp, ref_logp))
                t2 = time.perf_counter()
                step_metrics = trainer.update(batch, logp, ref_logp)
                step_metrics = jax.device_get(step_metrics)
                t3 = time.perf_counter()
                ds.step += 1
                done_this_run += 1
                ds.data = source.state()
                n_samples = sum(gr.tokens_gt.shape[0] for gr in fresh)
                ds.counters["samples"] += n_samples
                ds.counters["failed_reward_samples"] += sum(
                    int((~gr.valid_g).sum()) for gr in fresh
                )
                m = _step_metrics(batch, fresh, step_metrics, logp, ent, rounds, cfg, rstats)
                m.update({f"total/{k}": v for k, v in ds.counters.items()})
                m["time/generate"] = times["generate"]
                m["time/reward"] = times["reward"]
                m["time/logprobs"] = t2 - t1
                m["time/update"] = t3 - t2
                m["step_time_s"] = t3 - t0
                gen_tokens = float(sum(int(gr.lengths_g.sum()) for gr in fresh))
                m["tokens_per_s"] = gen_tokens / max(t3 - t0, 1e-9)
                m["ds_buffer"] = float(len(ds.buffer))
                if cfg.eval.every and ds.step % cfg.eval.every == 0 and ds.step < cfg.total_steps:
                    ev = run_eval(trainer.policy(), f"step {ds.step}")
                    if ev is not None:
                        m.update({f"eval/{k}": v for k, v in ev.items()})
                        m["success"] = ev["pass@1"]
                if ds.step % cfg.log.every == 0:
                    logger.log(ds.step, m)
                bar.update(m)
                ckpt.save(ds.step, _ckpt_tree(trainer, sample_key), ds.to_json(cfg))
                if stop.requested:
                    stopped_by = stop.signal_name
                elif stop_after is not None and done_this_run >= stop_after:
                    stopped_by = "stop_after"
            bar.close()
        if trainer is not None:
            ckpt.save(ds.step, _ckpt_tree(trainer, sample_key), ds.to_json(cfg), force=True)
        ckpt.wait()
        if stopped_by is None:
            eval_after = run_eval(trainer.policy(), "after")
            if eval_after is not None:
                print_fn("grpojax: held-out after RL: " + _fmt_eval(eval_after))
                logger.log(ds.step, {f"eval/{k}": v for k, v in eval_after.items()})
            if cfg.log.plot:
                _plots(run_dir, ds.eval_before, eval_after, cfg)
        else:
            where = ckpt.directory if trainer is not None else sft_ckpt.directory
            phase = f"step {ds.step}" if trainer is not None else "an SFT step"
            print_fn(
                f"grpojax: stopped by {stopped_by} after {phase}; checkpoint saved in "
                f"{where} (continue with --resume / checkpoint.resume=true)"
            )
        (run_dir / "summary.json").write_text(
            json.dumps(
                {
                    "steps": ds.step,
                    "stopped_by": stopped_by,
                    "eval_before": ds.eval_before,
                    "eval_after": eval_after,
                    "counters": ds.counters,
                },
                indent=2,
            )
        )
    finally:
        logger.close()
        _close_checkpointers(ckpt, sft_ckpt)
        manager.close()
    return RunResult(
        run_dir=run_dir,
        eval_before=ds.eval_before,
        eval_after=eval_after,
        steps=ds.step,
        stopped_by=stopped_by,
        wall_s=time.perf_counter() - t_start,
        trainer=trainer,
    )


def _close_checkpointers(ckpt: Checkpointer, sft_ckpt: Checkpointer) -> None:
    """Wait for and release both; the SFT directory goes when empty (no SFT state left)."""
    ckpt.close()
    sft_ckpt.close()
    with contextlib.suppress(OSError):
        sft_ckpt.directory.rmdir()


def _ckpt_tree(trainer: Trainer, sample_key):
    return {"train": trainer.state, "sample_key": sample_key}


def _fmt_eval(ev: dict) -> str:
    return ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in ev.items())


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
            wanted = ["reward_mean", "kl", "entropy", "completion_len_mean", "grad_norm"]
            from grpojax.driver.metrics import read_jsonl

            have = {k for r in read_jsonl(jsonl) for k in r}
            keys = [k for k in wanted if k in have]
            if keys:
                plot_metrics(jsonl, run_dir / "metrics.png", keys=keys)
