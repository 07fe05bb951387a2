"""What every run command builds from its `RunConfig` before the first step: the run
directory (with `config.yaml`), the mesh, the model and tokenizer, the train / held-out rows
and the reward functions. Nothing here steps or samples.

`start_run` checks the user's input cheapest first (mesh, model directory, tokenizer, data
files, SFT demonstrations, reward columns) and loads the weights last, so a bad input fails
in seconds, before anything is written or compiled; each problem is a
`grpojax.errors.UserError` naming the field or file.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import logging
import pathlib
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from grpojax import rewards
from grpojax.config import RunConfig, save_config
from grpojax.data import (
    FormattedRows,
    PromptFormatter,
    PromptSource,
    PromptTooLongWarning,
    arithmetic_task,
    load_prompt_dataset,
    reasoning_gym_split,
    stop_ids_of,
)
from grpojax.driver.packing import packing_spec
from grpojax.envs.registry import environment_rows
from grpojax.errors import UserError
from grpojax.models import (
    Decoder,
    attention,
    builtin_tokenizer,
    from_pretrained,
    load_reward_model,
    load_tokenizer,
    make_mesh,
    shard_model,
    tiny_config,
)
from grpojax.models import load_config as load_model_config
from grpojax.models.config import ModelConfig, auto_remat
from grpojax.models.gguf_io import find_gguf
from grpojax.models.hf_io import check_sequence_classifier
from grpojax.models.hub import resolve_checkpoint
from grpojax.models.tokenizer import TOKENIZER_FILES
from grpojax.rewards import RewardManager
from grpojax.rng import run_key, run_seed
from grpojax.rollouts.episodes import build_episode_runner

__all__ = [
    "REWARD_FUNCTIONS",
    "Run",
    "build_datasets",
    "build_mesh",
    "build_model",
    "build_reward_manager",
    "build_rollout_mesh",
    "build_teacher",
    "build_tokenizer",
    "check_demonstrations",
    "check_prompt_budget",
    "check_ptx_rows",
    "check_reward_columns",
    "check_reward_model",
    "check_run_dir",
    "check_teacher",
    "latest_run_dir",
    "make_run_dir",
    "prompt_source",
    "reward_functions",
    "reward_model_scorer",
    "start_run",
]

# The built-in reward functions by config name (`RewardsSpec.names`).
REWARD_FUNCTIONS = {
    "numeric_answer": rewards.numeric_answer_reward,
    "final_number": rewards.final_number_reward,
    "math_answer": rewards.math_answer_reward,
    "format": rewards.format_reward,
    "reasoning_gym": rewards.reasoning_gym_reward,
    "code_execution": rewards.code_execution_reward,
}


def _split_devices(cfg: RunConfig) -> tuple[list, list]:
    """(training devices, rollout devices): the last `mesh.rollout_devices` / P devices of
    each of the P processes sample (in one process: the last `mesh.rollout_devices`), so
    that every process holds both kinds and the weights reach the sampler without a
    cross-host copy (`grpojax.models.sharding.move_to_mesh`)."""
    devices, n, procs = jax.devices(), cfg.mesh.rollout_devices, jax.process_count()
    if n % procs:
        raise UserError(
            f"mesh.rollout_devices={n} must be a multiple of the process count ({procs}): "
            "each process lends the same number of its devices to the sampler"
        )
    local: dict[int, list] = {}
    for d in devices:
        local.setdefault(d.process_index, []).append(d)
    each = n // procs
    if n and each >= min(len(ds) for ds in local.values()):
        raise UserError(
            f"mesh.rollout_devices={n} leaves no device to train on: each of the {procs} "
            f"process(es) has {min(len(ds) for ds in local.values())} "
            f"{jax.default_backend()} device(s) and would lend {each}"
        )
    train = [d for ds in local.values() for d in ds[: len(ds) - each]]
    rollout = [d for ds in local.values() for d in ds[len(ds) - each :]]
    return train, rollout


def build_mesh(cfg: RunConfig) -> Mesh:
    """The (data, fsdp, tensor, context) training mesh of `cfg.mesh` over all devices but
    the `mesh.rollout_devices` last ones."""
    m = cfg.mesh
    devices, _ = _split_devices(cfg)
    try:
        return make_mesh(
            data=m.data, fsdp=m.fsdp, tensor=m.tensor, context=m.context, devices=devices
        )
    except ValueError:
        n = len(devices)
        held = (
            f" (mesh.rollout_devices={m.rollout_devices} of them held)" if m.rollout_devices else ""
        )
        raise UserError(
            f"mesh.data={m.data}, mesh.fsdp={m.fsdp}, mesh.tensor={m.tensor}, "
            f"mesh.context={m.context} do not fit the "
            f"{n} {jax.default_backend()} device(s) here{held}: the sizes must multiply to "
            f"{n} (one of them may be -1, the devices left over)"
        ) from None


def build_rollout_mesh(cfg: RunConfig, train_mesh: Mesh) -> Mesh | None:
    """The sampler's mesh with `mesh.rollout_devices` = n >= 1 ("split" placement): the
    last n devices (n / P of each of P processes), rows over data = n / tensor, the
    training mesh's tensor size, no fsdp (the rollout layout: weights replicated but for
    tensor); None when n is 0. Across processes each process's training devices must
    hold every tensor shard (the weights are copied within each process)."""
    _, devices = _split_devices(cfg)
    if not devices:
        return None
    tensor = dict(train_mesh.shape)["tensor"]
    if len(devices) % tensor:
        raise UserError(
            f"mesh.rollout_devices={len(devices)} must be a multiple of the tensor size "
            f"({tensor}): the rollout mesh keeps the training mesh's tensor axis"
        )
    held: dict[int, set[int]] = {}  # process -> the tensor shards its training devices hold
    t_axis = train_mesh.axis_names.index("tensor")
    for at, d in np.ndenumerate(train_mesh.devices):
        t = at[t_axis]
        held.setdefault(d.process_index, set()).add(t)
    for proc, shards in sorted(held.items()):
        if shards != set(range(tensor)):
            raise UserError(
                f"mesh.rollout_devices={cfg.mesh.rollout_devices}: process {proc}'s training "
                f"devices hold tensor shards {sorted(shards)} of {tensor}; with split placement "
                "across processes each process's must hold all (mesh.tensor within a host)"
            )
    return make_mesh(data=len(devices) // tensor, fsdp=1, tensor=tensor, devices=devices)


@functools.cache
def _checkpoint_dir(source: str, revision: str | None, field: str) -> pathlib.Path:
    """`resolve_checkpoint`, once per process: a Hub id is looked up (or fetched) once."""
    return resolve_checkpoint(source, revision, field=field)


def _model_dir(cfg: RunConfig) -> pathlib.Path:
    """`model.source` as a directory holding a supported config.json, or a GGUF file
    (checked): the local directory or file, or a Hub id's snapshot in the Hub cache (fetched
    once per process)."""
    path = _checkpoint_dir(cfg.model.source, cfg.model.revision, "model.source")
    load_model_config(path)  # a missing, malformed or unsupported config.json, named
    return path


def build_tokenizer(cfg: RunConfig):
    """The tokenizer of `cfg.model`: the built-in one, or the model directory's own."""
    if cfg.model.is_builtin:
        return builtin_tokenizer()
    return load_tokenizer(_model_dir(cfg))


def build_model(cfg: RunConfig, *, mesh: Mesh | None = None, tokenizer=None):
    """(model, tokenizer) for `cfg.model`: the built-in tiny model (weights from the run's
    "model_init" key) or a Hugging Face checkpoint in a local directory. `tokenizer`, when
    given, is returned as is (not loaded again)."""
    spec = cfg.model
    if tokenizer is None:
        tokenizer = build_tokenizer(cfg)
    if spec.routing_replay != "none":
        experts = 0 if spec.is_builtin else load_model_config(_model_dir(cfg)).num_experts
        if not experts:
            raise UserError(
                f"model.routing_replay={spec.routing_replay!r} replays a mixture of experts' "
                f"routing, but model.source={spec.source!r} is a dense model (no "
                "num_experts); set model.routing_replay=none"
            )
    if spec.is_builtin:
        config = tiny_config(
            dtype=spec.dtype, param_dtype=spec.param_dtype, attention=spec.attention
        )
        config = dataclasses.replace(config, remat=model_remat(cfg, config, mesh))
        model = Decoder(config, rngs=nnx.Rngs(run_key(cfg.seed, "model_init")))
        if mesh is not None:
            shard_model(model, mesh)
        return model, tokenizer
    path = _model_dir(cfg)
    remat = spec.remat
    if remat == "auto":
        config = dataclasses.replace(load_model_config(path), dtype=spec.dtype)
        remat = model_remat(cfg, config, mesh)
    model = from_pretrained(
        path,
        dtype=spec.dtype,
        param_dtype=spec.param_dtype,
        mesh=mesh,
        remat=remat,
        attention=spec.attention,
    )
    return model, tokenizer


def device_memory_bytes() -> int | None:
    """The first local device's memory for arrays (`bytes_limit`), None where the backend
    reports none (a CPU)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("bytes_limit")


def model_remat(cfg: RunConfig, config, mesh: Mesh | None) -> str:
    """`cfg.model.remat` with "auto" resolved (`grpojax.models.config.auto_remat`, logged)
    for `config` (the model's `ModelConfig`, its compute dtype set): one forward's tokens a
    device are a micro-batch's rows (N / (mini-batches x micro-batches)) over the data
    axes, times the prompt and completion budgets (`data.max_prompt_tokens` +
    `rollout.max_new_tokens`) over the context axis; the memory is the first local
    device's `bytes_limit`."""
    if cfg.model.remat != "auto":
        return cfg.model.remat
    step = cfg.step_config
    shape = dict(mesh.shape) if mesh is not None else {}
    shards = shape.get("data", 1) * shape.get("fsdp", 1)
    rows = cfg.samples_per_step // (step.num_minibatches * step.num_microbatches)
    width = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    tokens = -(-rows // shards) * -(-width // shape.get("context", 1))
    policy, why = auto_remat(config, tokens, device_memory_bytes(), shape.get("tensor", 1))
    logging.getLogger(__name__).info("model.remat=auto: %s (%s)", policy, why)
    return policy


def check_teacher(cfg: RunConfig, policy_config, tokenizer=None) -> pathlib.Path:
    """The directory of algo "distill"'s teacher (`cfg.distill.teacher`), checked from its
    config and tokenizer files (no weights read): its vocabulary must be the policy's
    (`policy_config`, the policy's `ModelConfig`): the same size, and where the teacher's
    directory holds a tokenizer, the same token -> id map as the policy's (`tokenizer`;
    None: built from `cfg.model`); otherwise a `UserError` naming both."""
    d, spec = cfg.distill, cfg.model
    path = _checkpoint_dir(d.teacher, d.teacher_revision, "distill.teacher")
    teacher_config = load_model_config(path)
    where = f"distill.teacher={d.teacher!r}"
    if teacher_config.vocab_size != policy_config.vocab_size:
        raise UserError(
            f"{where} has a vocabulary of {teacher_config.vocab_size} ids, the policy "
            f"(model.source={spec.source!r}) {policy_config.vocab_size}: distillation compares "
            "next-token distributions over one vocabulary (the same tokenizer)"
        )
    if find_gguf(path) is not None or any((path / n).is_file() for n in TOKENIZER_FILES):
        tokenizer = build_tokenizer(cfg) if tokenizer is None else tokenizer
        mine, theirs = tokenizer.get_vocab(), load_tokenizer(path).get_vocab()
        differ = sorted(t for t in set(mine) | set(theirs) if mine.get(t) != theirs.get(t))
        if differ:
            t = differ[0]
            raise UserError(
                f"{where}: its tokenizer is not the policy's (model.source={spec.source!r}): "
                f"{len(differ)} tokens map to other ids, e.g. {t!r} -> {theirs.get(t)} in the "
                f"teacher's, {mine.get(t)} in the policy's"
            )
    return path


def build_teacher(
    cfg: RunConfig, policy_config, *, mesh: Mesh | None = None, path: pathlib.Path | None = None
) -> Decoder:
    """The frozen teacher of algo "distill", stored in `model.dtype` and sharded on `mesh`:
    from `path` when the run has checked it already (`Run.teacher_dir`), else from
    `check_teacher`'s directory."""
    spec = cfg.model
    return from_pretrained(
        check_teacher(cfg, policy_config) if path is None else path,
        dtype=spec.dtype,
        param_dtype=spec.dtype,
        mesh=mesh,
        attention=spec.attention,
    )


def build_datasets(cfg: RunConfig, tokenizer):
    """(train rows, held-out rows or None) for `cfg.data` (rows are dicts with `prompt`).
    Procedural tasks are generated from the run's "data" seed; the held-out rows are
    `cfg.eval.heldout_size` of them (for `data.eval_path`: the file's first rows). With
    `env.name` set the `prompt` is the template's text, never chat-wrapped: the runner
    renders an environment's prompt through the chat template (an agent its own messages)."""
    d = cfg.data
    seed = run_seed(cfg.seed, "data")
    chat = d.chat_template and not cfg.env.enabled
    if d.kind == "env":
        return (
            environment_rows(cfg.env.name, "train", d.size, seed=seed),
            environment_rows(cfg.env.name, "heldout", cfg.eval.heldout_size, seed=seed),
        )
    if d.kind == "arithmetic":
        task = arithmetic_task(d.name)
        train_rows = task.rows("train", d.size, seed=seed)
        heldout = task.rows("heldout", cfg.eval.heldout_size, seed=seed)
        if d.template is not None:
            fmt = PromptFormatter(d.template, tokenizer=tokenizer, chat=chat)
            train_rows = FormattedRows(train_rows, fmt, name=f"arithmetic:{d.name}")
            heldout = FormattedRows(heldout, fmt, name=f"arithmetic:{d.name}:heldout")
        return train_rows, heldout
    if d.kind == "reasoning_gym":
        return reasoning_gym_split(
            d.name,
            train_size=d.size,
            heldout_size=cfg.eval.heldout_size,
            seed=seed,
            template=d.template,
            tokenizer=tokenizer,
            chat=chat,
            system_prompt=d.system_prompt,
        )
    kwargs = dict(
        template=d.template,
        tokenizer=tokenizer,
        chat=chat,
        system_prompt=d.system_prompt,
        prompt_column=d.prompt_column,
    )
    train_rows = load_prompt_dataset(d.path, **kwargs)
    heldout = None
    if d.eval_path:
        # The file's first eval.heldout_size rows, in file order: every evaluation of a run
        # (and `grpojax eval` later) sees the same prompts.
        heldout = load_prompt_dataset(d.eval_path, **kwargs).first(cfg.eval.heldout_size)
    return train_rows, heldout


def dry_run(cfg: RunConfig) -> str:
    """`grpojax train --dry-run`: what can be checked of `cfg` before any model, tokenizer or
    device is set up (the config itself is checked by loading it): the training and
    held-out rows are read (files, generated tasks or an environment's rows; templates
    filled without the tokenizer's chat template), every reward's columns are found in
    them, and a local `model.source` holds a supported config.json. A one-line summary,
    then the attention path of each call site (`attention_report`; for a model whose config
    is here to read); a `UserError` naming the field or file otherwise."""
    plain = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, chat_template=False))
    train_rows, heldout = build_datasets(plain, tokenizer=None)
    if not cfg.env.enabled:
        check_reward_columns(cfg, train_rows, heldout)
    check_demonstrations(cfg, train_rows)
    src, spec = cfg.model.source, cfg.model
    config: ModelConfig | None = None  # the model's config, where it is here to read
    if spec.is_builtin:
        model = "the built-in tiny model"
        config = tiny_config(dtype=spec.dtype, attention=spec.attention)
    elif pathlib.Path(src).expanduser().is_dir() or find_gguf(src) is not None:
        config = load_model_config(pathlib.Path(src).expanduser())
        model = f"{config.model_type} at {src}"
        config = dataclasses.replace(config, dtype=spec.dtype, attention=spec.attention)
    else:
        model = f"{src} (a Hub id: fetched when the run starts, not checked here)"
    held = "none" if heldout is None else f"{len(heldout)} rows"
    paths = "decided when the run starts" if config is None else attention_report(cfg, config)
    return (
        f"config ok; algo={cfg.algo} total_steps={cfg.total_steps}; training data "
        f"{len(train_rows)} rows ({_source_name(train_rows, cfg)}), held-out {held}; "
        f"model {model}\nattention on {jax.default_backend()} (model.attention="
        f"{cfg.model.attention}, {config.compute_dtype.name if config else cfg.model.dtype}): "
        f"{paths}"
    )


def attention_report(cfg: RunConfig, config: ModelConfig) -> str:
    """Which attention path (`attention.call_path`) each attention call site of `cfg`'s run
    takes on this machine's backend with the model `config`, '; '-separated: the trainer's
    passes (policy, old policy, reference, value model: one layout), packed steps where
    packing may pack, and the built-in sampler's prefill and decode (vLLM attends itself).
    Widths are the budgets (prompts of at most `data.max_prompt_tokens`, completions of at
    most `rollout.max_new_tokens`); a path that is not the fused op where the fused op was
    asked for (`fused`, or `auto` on a GPU) says why."""
    p, c = cfg.data.max_prompt_tokens, cfg.rollout.max_new_tokens
    facts: dict[str, Any] = dict(
        dtype=config.compute_dtype,
        softcap=config.attn_logit_softcapping is not None,
        # windows that differ by layer reach the fused op as static ones (the decoder's
        # switch), a decode step's aside (it takes the einsum)
        window="none" if set(config.layer_windows()) == {None} else "static",
    )
    sites: list[tuple[str, dict[str, Any]]] = []
    if cfg.step_config.share_prompt:
        sites += [
            (f"trainer prompts (T<={p})", dict(t=p)),
            (f"trainer completions over their prompt (T<={c} after {p})", dict(t=c, earlier=p)),
        ]
    else:
        sites.append((f"trainer rows (T<={p + c})", dict(t=p + c)))
    if packing_spec(cfg).mode != "never":
        sites.append(
            (f"packed steps (packing.mode={cfg.packing.mode})", dict(t=p + c, packed=True))
        )
    if cfg.rollout_engine != "vllm":
        sites += [
            (f"sampler prefill (T<={p})", dict(t=p)),
            ("sampler decode", dict(t=1, earlier=p + c, decoding=True)),
        ]
    said = []
    for name, call in sites:
        path, why = attention.call_path(config.attention, **{**facts, **call})
        said.append(f"{name}: {path}" + ("" if why is None else f" ({why})"))
    return "; ".join(said)


def _source_name(rows, cfg: RunConfig) -> str:
    name = getattr(rows, "name", None)
    return str(name or cfg.data.path or f"{cfg.data.kind}:{cfg.data.name}")


def check_demonstrations(cfg: RunConfig, rows) -> None:
    """With `sft.steps` > 0 the training rows need a `completion` column (a UserError);
    an environment's demonstrations are its own (`grpojax.envs.demonstration_episodes`)."""
    if cfg.sft.steps and not cfg.env.enabled and "completion" not in rows[0]:
        raise UserError(
            f"sft.steps={cfg.sft.steps} needs demonstrations: the training rows "
            f"({_source_name(rows, cfg)}) have no 'completion' column (columns: "
            f"{sorted(rows[0])}); add one, or set sft.steps=0"
        )


def check_ptx_rows(cfg: RunConfig, rows) -> None:
    """With the step's `ptx_coef` > 0 the training rows need the ptx text: `ptx.column`, or
    `prompt` and `completion` when it is None (a UserError naming the field)."""
    step = cfg.step_config
    if not step.ptx_coef:
        return
    section = "ppo" if cfg.is_ppo else "grpo"
    column = cfg.ptx.column
    needed = ["prompt", "completion"] if column is None else [column]
    missing = [c for c in needed if c not in rows[0]]
    if missing:
        what = "demonstrations (ptx.column=null)" if column is None else f"ptx.column={column!r}"
        raise UserError(
            f"{section}.ptx_coef={step.ptx_coef} trains on {what}: the training rows "
            f"({_source_name(rows, cfg)}) have no {missing} column (columns: "
            f"{sorted(rows[0])}); set ptx.column to a text column, or {section}.ptx_coef=0"
        )


def reward_functions(cfg: RunConfig) -> list:
    """The reward functions of `cfg.rewards`, in `weights` order: the built-ins of `names`
    (`REWARD_FUNCTIONS`), then the user's `functions` (imported by path)."""
    r = cfg.rewards
    # None for "reward_model": its scorer (weights) is built with the manager.
    fns = [REWARD_FUNCTIONS.get(n) for n in r.names]
    fns += list(r.resolved_functions)
    return fns


def check_reward_columns(cfg: RunConfig, *row_sets) -> None:
    """Each reward of `cfg.rewards` (`names` and `functions`) reads columns (its arguments
    without a default after prompts and completions, e.g. `answer`); rows that lack one are a
    UserError naming both."""
    fns = reward_functions(cfg)
    fields = ["rewards.names"] * len(cfg.rewards.names) + ["rewards.functions"] * len(
        cfg.rewards.functions
    )
    labels = list(cfg.rewards.names) + list(cfg.rewards.functions)
    for rows in row_sets:
        if rows is None:
            continue
        columns = set(rows[0])
        for fn, field, label in zip(fns, fields, labels):
            if fn is None:  # the reward model reads prompt + completion only
                continue
            missing = [c for c in rewards.reward_columns(fn) if c not in columns]
            if missing:
                raise UserError(
                    f"{field}: the {label!r} reward reads the column(s) {missing}, which "
                    f"the rows of {_source_name(rows, cfg)} lack (columns: {sorted(columns)}); "
                    "add them or choose another reward"
                )


def build_reward_manager(cfg: RunConfig, reward_specs: Sequence | None = None) -> RewardManager:
    """A `RewardManager` for `cfg.rewards` (or for `reward_specs`, functions or RewardSpecs,
    when given: research code and tests plug their own functions in this way)."""
    r = cfg.rewards
    pool = dict(mode=r.mode, num_workers=r.num_workers, timeout_s=r.timeout_s)
    if reward_specs is not None:
        return RewardManager(list(reward_specs), **pool)
    fns = reward_functions(cfg)
    if "reward_model" in r.names:  # names come first in `fns`
        fns[r.names.index("reward_model")] = rewards.RewardSpec(
            reward_model_scorer(cfg), mode="inline"
        )
    if "code_execution" in r.names:
        # Refuse here, before any worker starts, where the sandbox cannot confine generated
        # code's writes (inside the manager every call would just fail).
        limits = rewards.SandboxLimits(accept_weak_isolation=r.sandbox_accept_weak_isolation)
        caps = rewards.sandbox_capabilities()
        if not (caps.filesystem_isolation or limits.accept_weak_isolation):
            raise UserError(
                "rewards.names includes code_execution, but the sandbox cannot confine "
                f"generated code's writes to its temp directory here ({caps.filesystem_note}); "
                "set rewards.sandbox_accept_weak_isolation=true to run it with weaker isolation"
            )
        rewards.check_sandbox_isolation(limits)  # warns once when weaker isolation is accepted
        i = r.names.index("code_execution")
        fns[i] = functools.partial(rewards.code_execution_reward, limits=limits)
    return RewardManager(fns, weights=list(r.resolved_weights), names=list(r.log_names), **pool)


def check_reward_model(cfg: RunConfig) -> None:
    """`rewards.reward_model`, when set, is a one-label sequence-classification checkpoint
    (a directory or a Hub id; config.json only: the weights load with the reward manager)."""
    if cfg.rewards.reward_model is None:
        return
    path = _checkpoint_dir(cfg.rewards.reward_model, None, "rewards.reward_model")
    try:
        check_sequence_classifier(path)
    except UserError as e:
        raise type(e)(f"rewards.reward_model: {e}") from None


def reward_model_scorer(cfg: RunConfig) -> rewards.RewardModelScorer:
    """The inline scorer of `rewards.reward_model`: its weights and its own tokenizer; the
    text is prompt + completion + the tokenizer's first stop id (as `grpojax rm` trains),
    right-padded to the longest prompt + completion the run samples."""
    path = _checkpoint_dir(cfg.rewards.reward_model, None, "rewards.reward_model")
    try:
        model = load_reward_model(path)
        tokenizer = load_tokenizer(path)
    except UserError as e:
        raise type(e)(f"rewards.reward_model: {e}") from None
    stop = stop_ids_of(tokenizer)
    return rewards.RewardModelScorer(
        model,
        tokenizer,
        max_length=cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens + 1,
        batch_size=min(64, cfg.samples_per_step),
        end_token_id=stop[0] if stop else None,
    )


def make_run_dir(cfg: RunConfig, *, root: str | pathlib.Path = "runs", kind: str | None = None):
    """`cfg.log.run_dir`, or a fresh `<root>/<kind or algo>-<timestamp>` (made unique)."""
    if cfg.log.run_dir is not None:
        return pathlib.Path(cfg.log.run_dir)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = pathlib.Path(root) / f"{kind or cfg.algo}-{stamp}"
    path, i = base, 1
    while path.exists():
        path = base.with_name(f"{base.name}-{i}")
        i += 1
    return path


def latest_run_dir(root: str | pathlib.Path = "runs") -> pathlib.Path | None:
    """The most recently modified run directory under `root` holding checkpoints, or None."""
    root = pathlib.Path(root)
    if not root.is_dir():
        return None
    runs = [p for p in root.iterdir() if (p / "checkpoints").is_dir()]
    return max(runs, key=lambda p: p.stat().st_mtime) if runs else None


def prompt_source(cfg: RunConfig, rows, tokenizer) -> PromptSource:
    """The RL prompt stream over `rows`: the run's "prompts" order, `data.max_prompt_tokens`."""
    return PromptSource(
        rows,
        tokenizer,
        seed=run_seed(cfg.seed, "prompts"),
        max_prompt_tokens=cfg.data.max_prompt_tokens,
        add_special_tokens=None,
        name=_source_name(rows, cfg),
        # An environment renders each episode's prompt from its row.
        prompt_column=None if cfg.env.enabled else "prompt",
    )


def check_prompt_budget(cfg: RunConfig, rows, tokenizer) -> None:
    """Draw the first RL batch from a throwaway `prompt_source`, so that "no prompt fits
    data.max_prompt_tokens" (or an unusable prompt) is a UserError now, not after the warm
    start and compilation."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PromptTooLongWarning)
        prompt_source(cfg, rows, tokenizer).next_rows(cfg.rollout.prompts_per_step)


def check_run_dir(path: pathlib.Path) -> None:
    """The run directory may exist (as a directory) or not; anything else is a UserError."""
    for p in (path, *path.parents):
        if p.exists() and not p.is_dir():
            raise UserError(f"log.run_dir {str(path)!r}: {str(p)!r} exists and is not a directory")


class Run(NamedTuple):
    """What `start_run` builds: the run directory, training mesh, model, tokenizer, rows,
    the sampler's mesh with split placement (`build_rollout_mesh`; None: interleaved), and
    algo "distill"'s teacher directory, checked (`check_teacher`; None: no teacher)."""

    run_dir: pathlib.Path
    mesh: Mesh
    model: Any
    tokenizer: Any
    train_rows: Any
    heldout_rows: Any
    rollout_mesh: Mesh | None = None
    teacher_dir: pathlib.Path | None = None


def start_run(
    cfg: RunConfig,
    *,
    root: str | pathlib.Path = "runs",
    kind: str | None = None,
    run_dir: pathlib.Path | None = None,
    check_rewards: bool = True,
    check_prompts: bool = False,
):
    """What every run command begins with: the mesh, the tokenizer, the train / held-out rows
    (checked: SFT demonstrations when `sft.steps` > 0, the reward functions' columns unless
    `check_rewards` is False; the first RL batch's prompts with `check_prompts`), the
    model, and the run directory (`run_dir`, else
    `make_run_dir`), made with `config.yaml` saved in it once everything loaded. A `Run`."""
    if jax.process_count() > 1 and cfg.log.run_dir is None and run_dir is None:
        raise UserError(
            "a multi-process run needs log.run_dir: every process must write to the same "
            "run directory"
        )
    run_dir = make_run_dir(cfg, root=root, kind=kind) if run_dir is None else run_dir
    check_run_dir(run_dir)
    mesh = build_mesh(cfg)
    rollout_mesh = build_rollout_mesh(cfg, mesh)
    tokenizer = build_tokenizer(cfg)
    check_reward_model(cfg)
    train_rows, heldout = build_datasets(cfg, tokenizer)
    check_demonstrations(cfg, train_rows)
    check_ptx_rows(cfg, train_rows)
    if check_rewards and not cfg.env.enabled:  # an environment scores its own episodes
        check_reward_columns(cfg, train_rows, heldout)
    if check_prompts:
        check_prompt_budget(cfg, train_rows, tokenizer)
    if cfg.env.enabled:  # the environment accepts the rows and renders their prompts
        for rows in (train_rows, heldout):
            if rows is not None:
                first = [rows[i] for i in range(min(len(rows), cfg.rollout.prompts_per_step))]
                build_episode_runner(cfg, first, tokenizer, group_size=1)
    model, _ = build_model(cfg, mesh=mesh, tokenizer=tokenizer)
    teacher_dir = None
    if cfg.algo == "distill":  # before any SFT or evaluation: the teacher's files fit
        teacher_dir = check_teacher(cfg, model.config, tokenizer)
    run_dir.mkdir(parents=True, exist_ok=True)
    if jax.process_index() == 0:  # every process writes to the same directory
        save_config(cfg, run_dir / "config.yaml")
    return Run(run_dir, mesh, model, tokenizer, train_rows, heldout, rollout_mesh, teacher_dir)
