"""The run configuration: one frozen `RunConfig` composing every sub-config, YAML + overrides.

The step, sampler and optimizer configs live with their modules (`GRPOConfig`,
`PPOConfig`, `SFTConfig`, `OptimizerConfig`, `SamplingConfig`); this module adds the specs
only the driver needs (model, data, rewards, rollout, SFT warm start, evaluation,
checkpoints, logging, mesh) and nests them all under `RunConfig`.

    cfg = load_config("experiments/configs/default.yaml", ["algo=dapo", "seed=3"])
    save_config(cfg, run_dir / "config.yaml")          # loads back to an equal RunConfig

Loading goes through OmegaConf: `OmegaConf.structured(RunConfig)` (types and defaults),
merged with the YAML file and then the `key=value` overrides, and converted back to the
frozen dataclasses so every `__post_init__` validation runs. `algo` picks a preset for the
`grpo` section first (e.g. `algo=dapo` sets clip-higher and token-mean aggregation); the
file's and the overrides' values are applied on top of it. Any problem (unknown key, wrong
type, out-of-range value, unknown choice) is one `ConfigError` naming the field path and
what is allowed.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import pathlib
import typing
from collections.abc import Sequence
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from grpojax.data.arithmetic import ARITHMETIC_PRESETS
from grpojax.data.files import FILE_FORMATS
from grpojax.envs.registry import ENVIRONMENTS, resolve_environment, row_generator
from grpojax.errors import UserError
from grpojax.models.config import ATTENTION_IMPLEMENTATIONS, REMAT_POLICIES
from grpojax.models.lora import ALL_TARGETS as LORA_TARGETS
from grpojax.models.lora import LoRAConfig
from grpojax.ops.checks import check_choice, check_int, check_number
from grpojax.ops.logprobs import DIVERGENCES
from grpojax.rewards.manager import resolve_reward_function
from grpojax.sampling.continuous import auto_engine, auto_episode_engine
from grpojax.sampling.generate import DECODE_LOOPS, ENGINES
from grpojax.sampling.transforms import SamplingConfig
from grpojax.sampling.vllm_engine import WEIGHT_TRANSFERS
from grpojax.train.config import (
    GRPO_PRESETS,
    GRPOConfig,
    PPOConfig,
    SFTConfig,
    budget_fields,
)
from grpojax.train.objectives import estimator_batch_inputs
from grpojax.train.state import OptimizerConfig

# The GRPO family are presets of `GRPOConfig`; "ppo" uses the `ppo` section (with a critic).
# "reinforce_pp" is REINFORCE++-baseline (group-mean baseline, the KL in the loss);
# "reinforce_pp_plain" is REINFORCE++ itself (no baseline, the KL in the reward).
ALGOS = (
    "grpo",
    "dr_grpo",
    "dapo",
    "gspo",
    "rloo",
    "reinforce_pp",
    "reinforce_pp_plain",
    "distill",
    "ppo",
)
DTYPES = ("float32", "bfloat16")
ROUTING_REPLAY = ("none", "rollout")  # not "off": YAML reads a boolean
DATA_KINDS = ("arithmetic", "reasoning_gym", "file", "env")
# Built-in reward functions by config name (`grpojax.rewards.<name>_reward`).
REWARD_NAMES = (
    "numeric_answer",
    "final_number",
    "math_answer",
    "format",
    "reasoning_gym",
    "code_execution",
    "reward_model",
)
REWARD_MODES = ("process", "thread", "inline")


class ConfigError(UserError):
    """An invalid run configuration; the message names the field path and what is allowed."""


def algo_grpo_config(algo: str, max_new_tokens: int | None = None) -> GRPOConfig:
    """The `GRPOConfig` preset of a GRPO-family `algo` (the default one for "ppo").

    The driver's batches are G samples of each prompt in contiguous groups, so its presets
    run each prompt once per forward (`share_prompt=True`). `max_new_tokens` (the run's
    `rollout.max_new_tokens`; None: `RolloutSpec`'s default) fills the fields that follow
    the completion budget (`grpojax.train.config.budget_fields`: DAPO's overlong lengths);
    the run's YAML and overrides still replace them.
    """
    if algo not in ALGOS:
        raise ConfigError(f"algo must be one of {ALGOS}, got {algo!r}")
    preset = GRPO_PRESETS.get(algo, GRPO_PRESETS["grpo"])
    if algo in ("rloo", "reinforce_pp"):
        preset = dataclasses.replace(preset, advantage_estimator=algo)
    if max_new_tokens is None:
        max_new_tokens = RolloutSpec.max_new_tokens
    fields = budget_fields(algo, max_new_tokens)
    return dataclasses.replace(preset, share_prompt=True, **fields)


# ----------------------------------------------------------------------------------------
# Validation helpers (messages: "<field> must be <allowed>, got <value>")
# ----------------------------------------------------------------------------------------


# ----------------------------------------------------------------------------------------
# Driver specs
# ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Which policy to train.

    Attributes:
      source: "tiny" (the built-in few-million-parameter model and tokenizer), the path
        of a local Hugging Face directory (config.json, *.safetensors, tokenizer files),
        or a Hugging Face Hub id such as "Qwen/Qwen2.5-0.5B-Instruct", fetched into the
        Hub's cache (`grpojax.models.hub`; HF_HUB_OFFLINE=1 reads the cache only).
      revision: for a Hub id, the branch, tag or commit to load (None: the default branch).
      dtype: compute dtype of the forward, backward and sampler, one of `DTYPES`
        ("bfloat16" on accelerators). The reference policy is stored in it.
      param_dtype: storage dtype of the trained parameters and their optimizer moments,
        one of `DTYPES`; "float32" (the default) keeps float32 masters whatever `dtype`
        and whatever the dtype of a Hugging Face checkpoint.
      remat: rematerialisation policy of each layer, "auto" (the default) or one of
        `grpojax.models.config.REMAT_POLICIES`. "dots_no_batch" keeps each layer's
        projection outputs for the backward pass and recomputes the rest (norms, RoPE,
        attention, SiLU): less memory than "none" and, measured on the TRL workload's model
        on CPU, a faster update (docs/performance/step-time.md); "full" keeps only each
        layer's input. "auto" takes "dots_no_batch" while the projections it keeps for one
        forward's tokens a device (micro-batch rows over the data axes x (prompt + completion
        budget)) stay within half the device's memory, else "full"
        (`grpojax.models.config.auto_remat`; logged; a CPU: "dots_no_batch").
      attention: the attention backend, one of
        `grpojax.models.config.ATTENTION_IMPLEMENTATIONS`: "auto" (the default; on a GPU
        cuDNN's fused flash attention for every call it can express: the trainer's
        prompts and completions over them, the sampler's prefill, not packed steps, soft
        caps or decode steps; else the einsum for short sequences, the blockwise path,
        whose memory is linear in length, beyond 512 x 512 scores per row and head),
        "einsum", "blockwise" or "fused" (`jax.nn.dot_product_attention`, cuDNN on a GPU;
        `grpojax.models.attention`). `grpojax train --dry-run` names each call site's path.
      routing_replay: a mixture of experts' routing in the trainer's passes, one of
        `ROUTING_REPLAY`: "none" (the default: each pass routes every token anew) or "rollout"
        (the sampler records the experts each token went to and the policy's logprob pass
        and update replay them, so near a router tie the trainer's logprobs are the
        sampler's; `grpojax.models.moe`). "rollout" needs a mixture-of-experts checkpoint,
        a GRPO-family algo on single-turn rows, the static engine, unpacked rows
        (`packing.mode` auto or never: auto then never packs), `rollout.max_staleness=0` and
        no dynamic sampling; the reference policy routes anew.
    """

    source: str = "tiny"
    revision: str | None = None
    dtype: str = "float32"
    param_dtype: str = "float32"
    remat: str = "auto"
    attention: str = "auto"
    routing_replay: str = "none"

    def __post_init__(self):
        if not (isinstance(self.source, str) and self.source):
            raise ValueError(
                "source must be 'tiny', a local Hugging Face directory or a Hub id, got "
                f"{self.source!r}"
            )
        if self.revision is not None and not (isinstance(self.revision, str) and self.revision):
            raise ValueError(f"revision must be None or a non-empty string, got {self.revision!r}")
        if self.revision is not None and self.is_builtin:
            raise ValueError("revision applies to a Hub id, not to source 'tiny'")
        check_choice("dtype", self.dtype, DTYPES)
        check_choice("param_dtype", self.param_dtype, DTYPES)
        check_choice("remat", self.remat, ("auto", *REMAT_POLICIES))
        check_choice("attention", self.attention, ATTENTION_IMPLEMENTATIONS)
        check_choice("routing_replay", self.routing_replay, ROUTING_REPLAY)

    @property
    def is_builtin(self) -> bool:
        return self.source == "tiny"


@dataclasses.dataclass(frozen=True)
class DistillSpec:
    """On-policy distillation (`algo: distill`): the policy samples, a frozen teacher scores
    every position of its samples, and each token's loss is the exact divergence of the
    policy's next-token distribution from the teacher's over the whole vocabulary, in
    vocabulary tiles (`grpojax.ops.divergence_from_hidden`: no `[N, T, V]` array), plus
    `rl_coef` times the GRPO policy-gradient term of the rewards:

        loss_t = D(pi_theta(. | x_<t), pi_teacher(. | x_<t)) + rl_coef * pg_t

    The algo sets the step's `grpo.beta` to 1 (the divergence's weight; a `grpo.beta` from a
    file or an override, such as the main job's 0, does not apply) and needs
    `grpo.kl_estimator` "full" (the preset's); the other `grpo` fields (group size,
    aggregation, mini-batches) apply as to GRPO. The divergence is logged as `kl` (its
    term of the loss as `kl_loss`).

    Attributes:
      teacher: the teacher checkpoint (required): a local Hugging Face directory or a Hub
        id, as `model.source`; any supported architecture, larger than the policy or not,
        with the policy's tokenizer (the same vocabulary). Stored in `model.dtype`, sharded
        on the run's mesh; rebuilt from here on resume (checkpoints do not hold it, only
        its weights' fingerprint: another teacher is refused).
      teacher_revision: for a Hub id, the revision to load (None: the default branch).
      divergence: one of `grpojax.ops.logprobs.DIVERGENCES`: "reverse_kl" (the default,
        KL(pi_theta || pi_teacher), mode seeking: on-policy distillation's), "forward_kl"
        (KL(pi_teacher || pi_theta)) or "jsd" (GKD's generalised JSD with `jsd_beta`).
      jsd_beta: in (0, 1), the JSD's weight of the teacher (0.5: symmetric).
      rl_coef: >= 0, the weight of the GRPO term (0, the default: distillation alone).
    """

    teacher: str = ""
    teacher_revision: str | None = None
    divergence: str = "reverse_kl"
    jsd_beta: float = 0.5
    rl_coef: float = 0.0

    def __post_init__(self):
        check_choice("divergence", self.divergence, DIVERGENCES)
        check_number("jsd_beta", self.jsd_beta, minimum=0.0, maximum=1.0, strict=True,
                     strict_max=True)  # fmt: skip
        check_number("rl_coef", self.rl_coef, minimum=0.0, array_ok=False)


@dataclasses.dataclass(frozen=True)
class LoRASpec:
    """LoRA: train low-rank adapters beside one copy of the frozen base weights
    (`grpojax.models.lora`); the reference policy is the base with adapters off.

    Attributes:
      rank: r, the adapters' inner dimension, >= 0; 0 (the default) trains every parameter.
      alpha: > 0; adapters are scaled by alpha / rank (PEFT's `lora_alpha`).
      targets: projections to adapt, a non-empty subset of
        ("q", "k", "v", "o", "gate", "up", "down", "lm_head") (HF's q_proj ... down_proj,
        lm_head; default: the seven layer projections). lm_head needs dropout 0 and a
        model without tied embeddings.
      dropout: p in [0, 1), dropout on the adapters' input in the GRPO step's gradient
        forwards (PEFT's `lora_dropout`); the sampler, the reference, evaluation and the
        old policy's logprobs run without it. GRPO-family algorithms only.
    """

    rank: int = 0
    alpha: float = 16.0
    targets: tuple[str, ...] = LORA_TARGETS

    dropout: float = 0.0

    def __post_init__(self):
        check_int("rank", self.rank, minimum=0)
        # The other fields are LoRAConfig's, checked by it (rank 0 trains without adapters).
        LoRAConfig(
            rank=max(self.rank, 1), alpha=self.alpha, targets=self.targets, dropout=self.dropout
        )

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def lora_config(self) -> LoRAConfig:
        return LoRAConfig(
            rank=self.rank,
            alpha=float(self.alpha),
            targets=tuple(self.targets),
            dropout=float(self.dropout),
        )


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """Where prompts come from (see `grpojax.data`).

    Attributes:
      kind: one of `DATA_KINDS`: "arithmetic" (built-in procedural task with a hash-based
        held-out split), "reasoning_gym" (a reasoning-gym task), "file" (local JSONL /
        JSON / Parquet), "env" (the rows of the built-in environment `env.name`, with a
        hash-based held-out split: `grpojax.envs.registry.environment_rows`).
      name: the arithmetic preset (one of `ARITHMETIC_PRESETS`) or the reasoning-gym task
        name (e.g. "basic_arithmetic", "countdown"); unused for "file".
      path: for "file": the training file (suffix one of `FILE_FORMATS`).
      eval_path: for "file": an optional held-out file, of which the first
        `eval.heldout_size` rows are evaluated (None: no held-out evaluation).
      template: a `str.format` prompt template over the row's columns (None: the
        `prompt_column` as is).
      chat_template: wrap the prompt with the tokenizer's chat template (with `env.name` set
        the rows' prompt stays the template's text: the runner renders an environment's
        prompt through the chat template itself, an agent its own messages).
      system_prompt: optional system message (needs `chat_template`).
      prompt_column: the column holding the prompt when `template` is None.
      max_prompt_tokens: prompts longer than this are skipped (counted, with a warning).
      size: rows of a procedural task's training split (reasoning-gym needs a size).
    """

    kind: str = "arithmetic"
    name: str = "add2"
    path: str | None = None
    eval_path: str | None = None
    template: str | None = None
    chat_template: bool = False
    system_prompt: str | None = None
    prompt_column: str = "prompt"
    max_prompt_tokens: int = 128
    size: int = 10000

    def __post_init__(self):
        check_choice("kind", self.kind, DATA_KINDS)
        if self.kind == "arithmetic":
            check_choice("name", self.name, tuple(ARITHMETIC_PRESETS))
        elif self.kind == "reasoning_gym":
            if not (isinstance(self.name, str) and self.name):
                raise ValueError(f"name must be a reasoning-gym task name, got {self.name!r}")
        elif self.kind == "file":
            for field in ("path", "eval_path"):
                value = getattr(self, field)
                if field == "path" and value is None:
                    raise ValueError(
                        f"path is required for kind='file' (a file ending in {tuple(FILE_FORMATS)})"
                    )
                if value is not None and pathlib.Path(value).suffix not in FILE_FORMATS:
                    raise ValueError(
                        f"{field} must end in one of {tuple(FILE_FORMATS)}, got {value!r}"
                    )
        if self.system_prompt is not None and not self.chat_template:
            raise ValueError("system_prompt needs chat_template=true")
        check_int("max_prompt_tokens", self.max_prompt_tokens, minimum=1)
        check_int("size", self.size, minimum=1)


@dataclasses.dataclass(frozen=True)
class RewardsSpec:
    """The reward functions, by name, and how they are run (`grpojax.rewards.RewardManager`).

    Attributes:
      names: built-in reward names, each one of `REWARD_NAMES`, no repeats; may be empty
        when `functions` is not (at least one reward overall).
      functions: your own reward functions as "package.module:function" paths, imported
        (from `sys.path` / PYTHONPATH) and checked when the config is built: each must be
        callable as `fn(prompts, completions, **columns) -> list[float | None]`, the
        protocol of the built-ins (`grpojax.rewards.manager`). Each is logged under its
        function name (`reward/<function>`, the mean), which must not repeat a name.
      weights: one finite weight per reward: first one per `names` entry, then one per
        `functions` entry (None: all 1.0). The total reward is sum_f weight_f * r_f; each
        function is also logged on its own.
      timeout_s: per-call limit on a reward function's own running time (from its start in a
        worker: not the wait for a worker, nor the hand-over), > 0.
      num_workers: worker processes/threads, >= 1.
      mode: one of `REWARD_MODES`.
      sandbox_accept_weak_isolation: let `code_execution` run generated code where the
        sandbox cannot confine its writes to its temporary directory (no Landlock; see
        `grpojax.rewards.sandbox`). False: such a run stops at start-up with one error.
      reward_model: a HF sequence-classification checkpoint, its directory or Hub id (e.g. a
        `grpojax rm` run's `hf/`) scoring prompt + completion (+ its tokenizer's EOS), run
        inline (`grpojax.rewards.RewardModelScorer`); set exactly when `names` includes
        "reward_model".
    """

    names: tuple[str, ...] = ("numeric_answer",)
    functions: tuple[str, ...] = ()
    weights: tuple[float, ...] | None = None
    timeout_s: float = 30.0
    num_workers: int = 2
    mode: str = "process"
    sandbox_accept_weak_isolation: bool = False
    reward_model: str | None = None

    def __post_init__(self):
        names = tuple(self.names)
        object.__setattr__(self, "names", names)
        functions = tuple(self.functions)
        object.__setattr__(self, "functions", functions)
        if not names and not functions:
            raise ValueError(
                f"names must list at least one reward of {REWARD_NAMES} (or functions at "
                "least one 'package.module:function')"
            )
        for n in names:
            if n not in REWARD_NAMES:
                raise ValueError(f"names: unknown reward {n!r}; allowed: {REWARD_NAMES}")
        if len(set(names)) != len(names):
            raise ValueError(f"names must not repeat a reward, got {names}")
        _ = self.resolved_functions  # imported (and checked) once, kept
        log_names = self.log_names
        repeated = sorted({n for n in log_names if log_names.count(n) > 1})
        if repeated:
            raise ValueError(
                f"functions: rewards are logged by name and {repeated} would repeat "
                f"(names {names}, functions {functions}); rename the function"
            )
        if self.weights is not None:
            weights = tuple(float(w) for w in self.weights)
            object.__setattr__(self, "weights", weights)
            if len(weights) != len(log_names):
                raise ValueError(
                    f"weights must have one entry per reward: {len(names)} for names then "
                    f"{len(functions)} for functions ({len(log_names)}), got {len(weights)}"
                )
            if not all(math.isfinite(w) for w in weights):
                raise ValueError(f"weights must be finite numbers, got {weights}")
        check_number("timeout_s", self.timeout_s, minimum=0.0, strict=True)
        check_int("num_workers", self.num_workers, minimum=1)
        check_choice("mode", self.mode, REWARD_MODES)
        if not isinstance(self.sandbox_accept_weak_isolation, bool):
            raise ValueError(
                "sandbox_accept_weak_isolation must be true or false, got "
                f"{self.sandbox_accept_weak_isolation!r}"
            )
        if ("reward_model" in names) != (self.reward_model is not None):
            raise ValueError(
                "reward_model: set it to a sequence-classification checkpoint directory "
                "exactly when rewards.names includes 'reward_model' (names "
                f"{list(names)}, reward_model {self.reward_model!r})"
            )

    @functools.cached_property
    def resolved_functions(self) -> tuple:
        """The callables `functions` names, imported once, when the config is built."""
        return tuple(resolve_reward_function(p, field="functions") for p in self.functions)

    @property
    def log_names(self) -> tuple[str, ...]:
        """Each reward's log name, in `weights` order: the built-in names, then each
        function's name (the part of its path after the last '.' or ':')."""
        own = tuple(p.rpartition(":")[2].rpartition(".")[2] for p in self.functions)
        return self.names + own

    @property
    def resolved_weights(self) -> tuple[float, ...]:
        return self.weights if self.weights is not None else (1.0,) * len(self.log_names)


VLLM_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class VllmSpec:
    """vLLM as the rollout engine (`rollout.engine=vllm`, `grpojax.sampling.vllm_engine`): a
    vLLM process of its own, token ids in and out, the policy's weights pushed to it after
    every update and checked on a probe sequence.

    Attributes:
      python: the Python of vLLM's own environment (`grpojax vllm-env DIR` makes one and
        prints this path); required with the engine.
      dtype: the weights' dtype in vLLM, one of `VLLM_DTYPES`.
      max_num_seqs: sequences vLLM decodes at once, >= 1.
      kv_cache_mb: vLLM's KV cache in MiB, >= 1.
      prefix_caching: vLLM's prefix cache (a prompt's G samples share its blocks; reset
        after every weight load).
      correction: with the step's `rollout_correction_mode` unset (`grpo.` or `ppo.`), the
        importance correction between the trainer's pi_old and vLLM's logprobs (its kernels
        round differently, so the sampled tokens' logprobs differ by more than float
        rounding): "truncate" (TIS, the default), "mask", "icepop", or "none"; the
        difference is logged either way (`logprob_diff_*`). With truncated sampling
        (`sampling.top_k/top_p/min_p`) vLLM's logprobs are those of the truncated
        distribution mu and the weight pi_old / mu is the kept mass (<= 1), so a correction
        is required ("none" is refused) and "truncate" weighs every token exactly (its cap
        never binds); "mask" and "icepop" zero the tokens whose kept mass is below their
        band's low end.
      probe_tol: a weight load's check: vLLM's logprobs of a fixed probe sequence against
        the policy's, relative to max(1, |logp|), > 0; None: 1e-2 when both compute in
        float32 (`dtype` and `model.dtype`; measured on a CPU: about 1e-6 at 5M and 34M
        parameters, 2e-3 at Qwen2.5-0.5B's shape), 5e-2 when either is bfloat16
        (`RunConfig.vllm_probe_tol`). It catches a load that failed or holds other weights,
        not one version in place of the next after a small update.
      start_timeout_s, timeout_s: the engine's start and each request's limit, seconds, > 0.
      weight_transfer: how each version's weights reach vLLM: "memory" (a shared-memory
        buffer on this host, `grpojax.sampling.weight_push`, loaded in place by vLLM's
        `reload_weights`; the default) or "files" (`save_pretrained` to /dev/shm, reloaded
        from there).
      bucket_mb: the shared-memory buffer's size limit in MiB, >= 1: a push larger than it
        goes in buckets of whole decoder layers, each loaded before the next is written.
      enforce_eager: vLLM's model run eagerly (true) or with CUDA graphs (false); null:
        eager on a CPU, CUDA graphs on a GPU.
      tensor_parallel_size: GPUs vLLM shards the model over, >= 1 (a push is then one
        bucket, which each of vLLM's worker processes reads).
      gpu_memory_utilization: on a GPU, vLLM's share of its memory (weights, activations,
        KV cache), in (0, 1); null: what JAX leaves (1 - XLA_PYTHON_CLIENT_MEM_FRACTION,
        0.75 by default, - 0.05). The two shares must fit in the GPU, checked at start. On a
        CPU `kv_cache_mb` sizes the cache and this is not used.
    """

    python: str | None = None
    dtype: str = "float32"
    max_num_seqs: int = 256
    kv_cache_mb: int = 1024
    prefix_caching: bool = True
    correction: str = "truncate"
    probe_tol: float | None = None
    start_timeout_s: float = 300.0
    timeout_s: float = 600.0
    weight_transfer: str = "memory"
    bucket_mb: int = 1024
    enforce_eager: bool | None = None
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float | None = None

    def __post_init__(self):
        check_choice("weight_transfer", self.weight_transfer, WEIGHT_TRANSFERS)
        check_int("bucket_mb", self.bucket_mb, minimum=1)
        if self.enforce_eager is not None and not isinstance(self.enforce_eager, bool):
            raise ValueError(
                f"enforce_eager must be true, false or null, got {self.enforce_eager!r}"
            )
        check_int("tensor_parallel_size", self.tensor_parallel_size, minimum=1)
        check_number(
            "gpu_memory_utilization", self.gpu_memory_utilization, minimum=0.0, maximum=1.0,
            strict=True, strict_max=True, none_ok=True,
        )  # fmt: skip
        if self.python is not None and not (isinstance(self.python, str) and self.python):
            raise ValueError(f"python must be a path to a Python executable, got {self.python!r}")
        check_choice("dtype", self.dtype, VLLM_DTYPES)
        check_int("max_num_seqs", self.max_num_seqs, minimum=1)
        check_int("kv_cache_mb", self.kv_cache_mb, minimum=1)
        if not isinstance(self.prefix_caching, bool):
            raise ValueError(f"prefix_caching must be true or false, got {self.prefix_caching!r}")
        check_choice("correction", self.correction, STALENESS_CORRECTIONS)
        if self.probe_tol is not None:
            check_number("probe_tol", self.probe_tol, minimum=0.0, strict=True)
        check_number("start_timeout_s", self.start_timeout_s, minimum=0.0, strict=True)
        check_number("timeout_s", self.timeout_s, minimum=0.0, strict=True)


@dataclasses.dataclass(frozen=True)
class RolloutSpec:
    """How much is sampled per step. Samples per prompt: G = `grpo.group_size`.

    Attributes:
      prompts_per_step: B prompts per step (N = B * G completions), >= 1.
      max_new_tokens: T, the completion budget, >= 1.
      dynamic_sampling: DAPO's resampling of groups with zero reward variance; None means
        on for algo "dapo" and off otherwise (see `RunConfig.use_dynamic_sampling`).
      max_resample_rounds: extra sampling rounds to fill the batch, >= 0.
      stop_strings: strings that end a completion (e.g. ["</answer>"]): it is cut right
        after the first token whose decoded prefix contains one, on the host after decoding
        (`grpojax.sampling.stop`), for the RL samples and the held-out evaluation alike; the
        trainer sees the kept tokens only. Non-empty strings; empty: only EOS ids stop.
      decode_loops: the sampler decodes in up to this many loops, each reading only the
        KV cache slots its steps can have filled (`grpojax.sampling.generate`'s
        `decode_loops`; completions of T <= 192 tokens always take one), >= 1; 1: one loop
        over the whole cache. The same function either way (float32: the same tokens,
        logprobs within float32 rounding; bf16 rounds the attention's sums differently, so
        a sampled row may diverge); used for the RL rounds, ReMax's greedy round and the
        held-out evaluation.
      engine: the sampler's engine (`grpojax.sampling.generate`'s `engine`): "compact",
        all N rows in lock step, the live ones compacted into fewer rows as samples end and
        the cache widened as the step grows (`grpojax.sampling.compact`); "continuous",
        a pool of `slots` decode slots refilled with the next pending sample as samples
        end; "static", all N rows in lock step until the longest ends; or "auto" (the
        default): static below `max_new_tokens` 256, from it compact on a CPU and
        continuous on an accelerator (`grpojax.sampling.continuous.auto_engine`, from the
        CPU measurements in docs/concepts/rollout-engine.md). The same tokens and logprobs either
        way (each token's key depends on its sample and position only). Multi-turn runs
        (`env.name`): "continuous" plays the episodes in `slots` decode slots, each
        refilled with the next pending episode when its episode ends
        (`grpojax.envs.rollout_episodes`), "static" all N episodes turn by turn in lock
        step, "compact" in lock step with the ended episodes' rows dropped from the batch
        as the live ones fit fewer rows, "auto" the lock step on an accelerator
        (`grpojax.sampling.continuous.auto_episode_engine`); the same episodes either way.
        "vllm": a vLLM process of its own (`rollout.vllm`), the weights pushed to it after
        every update; GRPO-family and PPO rounds (ReMax's greedy round included) and
        multi-turn episodes (each turn's context sent as ids: `rollout_episodes_external`),
        one process, without the keep mask, routing replay or
        `mesh.rollout_devices` (with `max_staleness` >= 1 its rounds decode beside the
        updates, as split placement's); a run's held-out evaluations sample with it too
        (`grpojax eval` and `grpojax sft` evaluate on the built-in engine, "auto"'s choice).
      max_staleness: k >= 0, pipelined rollouts (`grpojax.rollouts.pipeline`): 0 samples
        each step's round with the weights it trains (on-policy, in sequence); k >= 1 keeps
        k rounds sampled ahead, so each round's rewards are computed on a host thread while
        the next rounds decode and the updates run (multi-turn runs: each round's episodes,
        tools included, played on a host thread with a copy of the weights), and every
        sample is trained exactly k steps after the weights that drew it (fewer in the
        first k steps). With dynamic sampling the top-up rounds a step needs beyond the
        queue are sampled then, with its own weights (lag 0), and a buffered group older
        than k steps is not trained (counted: `total/stale_dropped_groups`). GRPO family;
        single-turn rounds and multi-turn episodes, in one process or across processes,
        on the training devices or on split placement's rollout devices.
      overlap_rewards: with max_staleness 0, run the trainer's logprob pass (the reference's
        and the policy's logprobs) while a round's rewards are computed on a host thread,
        on the batch laid out before them (every sample valid); if a reward call failed,
        the pass runs again on the batch without it, so the step is the same either way.
        Single-turn runs without dynamic sampling or `stop_strings` (which cut completions
        when scored); elsewhere, and with false, the rewards come first.
      staleness_correction: with max_staleness >= 1 and `grpo.rollout_correction_mode`
        unset, the importance correction between the trainer's pi_old and the sampler's
        logprobs applied to the stale samples: "truncate" (TIS, the default), "mask",
        "icepop", or "none".
      partial: partial rollouts (`grpojax.sampling.partial`), with max_staleness k >= 1:
        the decode slots outlive the weight updates. Each step appends round s + k to the
        k rounds in flight, recomputes the live slots' KV caches with the new weights and
        decodes until round s has ended (the slots freed meanwhile take the later rounds'
        samples, so they never drain), then trains round s; each token records the version
        that decoded it, lies in [s - k, s] (a staleness bound per token) and carries that
        version's logprob for the correction. Single-turn rows on the built-in engine
        ("auto" or "continuous"; `slots` as the continuous engine's), one process, one
        device set, without dynamic sampling or ReMax's greedy round; a round's rewards are
        computed when it has ended, in the step that trains it (beside the trainer's
        logprob pass with `overlap_rewards`).
      slots: the continuous engine's slot count, >= 1 (capped at N); None:
        `grpojax.sampling.continuous.auto_slots` (one slot per
        `grpojax.sampling.continuous.AUTO_SLOTS_PER_ROW` rows on a CPU, per 2 on an
        accelerator).
      vllm: the vLLM engine's settings (`VllmSpec`), read with `engine` "vllm".
    """

    prompts_per_step: int = 8
    max_new_tokens: int = 32
    dynamic_sampling: bool | None = None
    max_resample_rounds: int = 4
    stop_strings: tuple[str, ...] = ()
    decode_loops: int = DECODE_LOOPS
    engine: str = "auto"
    slots: int | None = None
    max_staleness: int = 0
    overlap_rewards: bool = True
    staleness_correction: str = "truncate"
    partial: bool = False
    vllm: VllmSpec = dataclasses.field(default_factory=VllmSpec)

    def __post_init__(self):
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings))
        if not all(isinstance(x, str) and x for x in self.stop_strings):
            raise ValueError(
                f"stop_strings must be non-empty strings, got {list(self.stop_strings)!r}"
            )
        check_int("prompts_per_step", self.prompts_per_step, minimum=1)
        check_int("max_new_tokens", self.max_new_tokens, minimum=1)
        check_int("max_resample_rounds", self.max_resample_rounds, minimum=0)
        check_int("decode_loops", self.decode_loops, minimum=1)
        if self.engine not in ("auto", *ENGINES, "vllm"):
            raise ValueError(
                f"engine must be one of {['auto', *ENGINES, 'vllm']}, got {self.engine!r}"
            )
        if self.engine == "vllm" and self.vllm.python is None:
            raise ValueError(
                "engine 'vllm' needs rollout.vllm.python, the Python of vLLM's own environment "
                "(`grpojax vllm-env DIR` makes one and prints it)"
            )
        if self.slots is not None:
            check_int("slots", self.slots, minimum=1)
        check_int("max_staleness", self.max_staleness, minimum=0)
        if not isinstance(self.overlap_rewards, bool):
            raise ValueError(f"overlap_rewards must be true or false, got {self.overlap_rewards!r}")
        check_choice("staleness_correction", self.staleness_correction, STALENESS_CORRECTIONS)
        if not isinstance(self.partial, bool):
            raise ValueError(f"partial must be true or false, got {self.partial!r}")
        if self.partial and not self.max_staleness:
            raise ValueError(
                "partial=true needs max_staleness >= 1: the samples in flight are continued "
                "by the next steps' weights"
            )

    def engine_kwargs(self) -> dict:
        """`generate`'s decode arguments of single-turn rows (engine, slots, decode_loops);
        "auto" resolved by `auto_engine`, and so is "vllm" (the built-in engine of what
        runs without the run's vLLM process: `grpojax eval`'s and `grpojax sft`'s
        evaluations). (A run's engine, episodes and
        routing replay included: `RunConfig.rollout_engine`.)"""
        builtin = self.engine in ENGINES
        engine = self.engine if builtin else auto_engine(self.max_new_tokens)
        return dict(engine=engine, slots=self.slots, decode_loops=self.decode_loops)


STALENESS_CORRECTIONS = ("truncate", "mask", "icepop", "none")  # not "off": YAML reads a boolean
PACKING_MODES = ("auto", "always", "never")  # not on/off: YAML reads those as booleans


@dataclasses.dataclass(frozen=True)
class PackingSpec:
    """Sequence packing of the RL step and the trainer-side logprob pass
    (`grpojax.train.packing`): a step's completions, with their prompts, placed into packed
    rows by length, so the forwards spend nothing on padding; the step's numbers are those of
    the unpacked step. Rows are whole sequences (P + T tokens wide), or with the step's
    `share_prompt` whole groups, each prompt once before its G completions (P + G*T wide);
    P is the step's prompt width.

    Attributes:
      mode: "auto" (the default): a step's batch is packed when that removes at least
        `min_saved_tokens` of the token positions its forward would run unpacked, and at
        least a fifth of them (each new packed shape is one more compilation, which short
        completions do not repay); "always"; "never".
      min_saved_tokens: auto's threshold, >= 0.
      max_slots: at most this many completions per packed row, >= 1 (rounded down to a
        multiple of G with share_prompt); None: no limit. The step's per-token arrays are
        `[R x slots, T]`: fewer slots keep them small.
    """

    mode: str = "auto"
    min_saved_tokens: int = 4096
    max_slots: int | None = None

    def __post_init__(self):
        check_choice("mode", self.mode, PACKING_MODES)
        check_int("min_saved_tokens", self.min_saved_tokens, minimum=0)
        check_int("max_slots", self.max_slots, minimum=1, none_ok=True)


@dataclasses.dataclass(frozen=True)
class SftSpec:
    """Supervised warm start before RL (on the task's demonstrations).

    Attributes:
      steps: optimizer steps, >= 0 (0 skips the warm start).
      learning_rate: > 0 (constant, AdamW; the RL `optimizer` is separate).
      batch_size: demonstrations per step, >= 1.
      step: the SFT step config (`grpojax.train.config.SFTConfig`).
    """

    steps: int = 0
    learning_rate: float = 1e-3
    batch_size: int = 32
    step: SFTConfig = dataclasses.field(default_factory=SFTConfig)

    def __post_init__(self):
        check_int("steps", self.steps, minimum=0)
        check_number("learning_rate", self.learning_rate, minimum=0.0, strict=True)
        check_int("batch_size", self.batch_size, minimum=1)


@dataclasses.dataclass(frozen=True)
class PtxSpec:
    """PPO-ptx's text, used when the step's `ptx_coef` > 0 (`grpo.ptx_coef` or
    `ppo.ptx_coef`): each RL step adds ptx_coef x the mean next-token NLL of `batch_size`
    rows drawn from the training rows (the run's "ptx_order" stream, a function of the step,
    so resume is exact).

    Attributes:
      batch_size: rows per RL step, >= 1; with ptx_coef > 0 it must divide into the step's
        num_minibatches x num_microbatches.
      column: None: the rows' demonstrations (`prompt` + `completion`, encoded as the SFT
        warm start encodes them; the loss on the completion tokens, as in SFT). Else a text
        column of the rows: its whole text is the target (every token after the first).
      max_tokens: with `column`: texts are cut to this many tokens and padded to it, >= 2.
    """

    batch_size: int = 8
    column: str | None = None
    max_tokens: int = 128

    def __post_init__(self):
        check_int("batch_size", self.batch_size, minimum=1)
        if self.column is not None and not (isinstance(self.column, str) and self.column):
            raise ValueError(f"column must be None or a column name, got {self.column!r}")
        check_int("max_tokens", self.max_tokens, minimum=2)


@dataclasses.dataclass(frozen=True)
class EnvSpec:
    """Agentic episodes (`grpojax.envs`): every RL sample plays a multi-turn episode.

    Attributes:
      name: None (the default): single-turn completions scored by `rewards`. Else the
        environment of every episode, built from its data row: a built-in (one of
        `grpojax.envs.registry.ENVIRONMENTS`: "calculator", "python", "guess_number"), your
        own `grpojax.envs.Environment` subclass as "package.module:Class", an agent that
        only knows the OpenAI client as "agent:package.module:function" (`fn(client, row)
        -> reward`, served by a loopback OpenAI-compatible endpoint: `grpojax.envs.agent`),
        or a TextArena game as "textarena:<env id>" (`grpojax.envs.arena`; `data.kind=env`
        then draws one game seed a row; a two-player game is self-play, each seat's G
        episodes of a row a group, so `rollout.prompts_per_step` must be even), an OpenEnv
        environment as "openenv:package.module:EnvClass" or "openenv:http://HOST:PORT"
        (`grpojax.envs.openenv_env`; one reset seed a row), or a verifiers taskset as
        "verifiers:<taskset id>" (`grpojax.envs.verifiers_env`; its tasks as the rows, each
        episode verifiers' rollout through the endpoint); imported and checked when the
        config is built. The sample's reward is the episode's return (the
        environment's final reward plus its per-turn rewards; `rewards` is not used), its
        token budget `rollout.max_new_tokens` (every id after the prompt, the policy's and
        the environment's); the loss, the KL and the logprob metrics cover the policy's ids
        only.
      max_turns: policy turns per episode, >= 1 (None: the environment's own `max_turns`).
      max_turn_tokens: the most ids one policy turn samples, >= 1 (an environment's own
        `max_turn_tokens` may lower it); a turn that reaches it without a stop ends its
        episode ("token_budget").
      max_observation_tokens: an observation's ids are cut to this many, >= 1.
      max_observation_chars: an observation's text is cut to this many characters, >= 1.
      step_timeout_s: seconds one `reset`, `step` or `reward` call may take, > 0; a call
        that runs over ends its episode ("error": the sample is masked out and counted).
      kwargs: keyword arguments of the environment's constructor, `Env(row, **kwargs)`
        (e.g. `env.kwargs.step_penalty=0.1` for guess_number,
        `env.kwargs.expert=package.module:function` for an agent's demonstrations); checked
        on the first rows when the run starts.
    """

    name: str | None = None
    max_turns: int | None = None
    max_turn_tokens: int = 64
    max_observation_tokens: int = 128
    max_observation_chars: int = 4096
    step_timeout_s: float = 30.0
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.name is not None:
            if not (isinstance(self.name, str) and self.name):
                raise ValueError(f"name must be None or an environment name, got {self.name!r}")
            if self.name not in ENVIRONMENTS and ":" not in self.name:
                raise ValueError(
                    f"name must be a built-in environment {tuple(ENVIRONMENTS)}, "
                    f"'package.module:Class', 'agent:package.module:function', "
                    f"'textarena:<env id>', 'openenv:...' or 'verifiers:<taskset id>', "
                    f"got {self.name!r}"
                )
            _ = self.environment_class  # imported (and checked) once, kept
        check_int("max_turns", self.max_turns, minimum=1, none_ok=True)
        check_int("max_turn_tokens", self.max_turn_tokens, minimum=1)
        check_int("max_observation_tokens", self.max_observation_tokens, minimum=1)
        check_int("max_observation_chars", self.max_observation_chars, minimum=1)
        check_number("step_timeout_s", self.step_timeout_s, minimum=0.0)
        if not self.step_timeout_s > 0:
            raise ValueError(f"step_timeout_s must be > 0, got {self.step_timeout_s!r}")
        if "max_turns" in self.kwargs:
            raise ValueError("kwargs must not hold max_turns: set env.max_turns")

    @functools.cached_property
    def environment_class(self) -> type | None:
        """The environment class `name` names (a built-in or "package.module:Class"),
        imported once, when the config is built; None without one."""
        return None if self.name is None else resolve_environment(self.name, field="name")

    @property
    def enabled(self) -> bool:
        return self.name is not None


@dataclasses.dataclass(frozen=True)
class EvalSpec:
    """Held-out evaluation: pass@1 (greedy), mean@k and the unbiased pass@j for j = 2, 4, ...,
    k (k samples at `temperature`; `grpojax.driver.evaluate`).

    Attributes:
      heldout_size: held-out prompts, >= 1 (with `data.eval_path`: the file's first
        `heldout_size` rows, in file order; all of them when it has fewer).
      k: samples per prompt for mean@k and pass@j, >= 1.
      temperature: sampling temperature of the k samples, >= 0.
      every: evaluate every this many RL steps, >= 0 (0: only before and after training).
      batch_size: prompts per generation call, >= 1.
    """

    heldout_size: int = 200
    k: int = 4
    temperature: float = 1.0
    every: int = 0
    batch_size: int = 64

    def __post_init__(self):
        check_int("heldout_size", self.heldout_size, minimum=1)
        check_int("k", self.k, minimum=1)
        check_number("temperature", self.temperature, minimum=0.0)
        check_int("every", self.every, minimum=0)
        check_int("batch_size", self.batch_size, minimum=1)


@dataclasses.dataclass(frozen=True)
class CheckpointSpec:
    """Orbax checkpoints (`grpojax.driver.checkpoint.Checkpointer`).

    Attributes:
      dir: checkpoint directory (None: `<run_dir>/checkpoints`).
      every: save every this many steps, >= 1 (and always at exit).
      keep: newest checkpoints kept, >= 1.
      resume: continue from the newest readable checkpoint in `dir` if there is one.
      async_save: write in the background.
    """

    dir: str | None = None
    every: int = 50
    keep: int = 3
    resume: bool = False
    async_save: bool = True

    def __post_init__(self):
        check_int("every", self.every, minimum=1)
        check_int("keep", self.keep, minimum=1)


@dataclasses.dataclass(frozen=True)
class LogSpec:
    """Where and how the run reports (`grpojax.driver.metrics`).

    Attributes:
      run_dir: the run's directory (None: `runs/<algo>-<timestamp>`, named by the driver).
      jsonl: metrics JSONL (`<run_dir>/metrics.jsonl`).
      tensorboard: TensorBoard events (`<run_dir>/tensorboard`).
      wandb: Weights & Biases, used only if the package is installed.
      wandb_project: the W&B project.
      every: log every this many steps, >= 1.
      progress: show progress bars (SFT, RL, held-out evaluation); `--no-progress` also hides them.
      plot: write PNG plots at the end of the run.
      export_hf: after a run that finishes (not one stopped early), write the final policy
        to `<run_dir>/hf/` as a Hugging Face checkpoint (`grpojax.driver.export`).
    """

    run_dir: str | None = None
    jsonl: bool = True
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "grpojax"
    every: int = 1
    progress: bool = True
    plot: bool = True
    export_hf: bool = True

    def __post_init__(self):
        check_int("every", self.every, minimum=1)
        if not isinstance(self.export_hf, bool):
            raise ValueError(f"export_hf must be true or false, got {self.export_hf!r}")


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """Device mesh sizes (`grpojax.models.make_mesh`); one may be -1 (the rest of the
    devices), the others >= 1.

    Attributes:
      data: data-parallel size (rows split, weights replicated).
      fsdp: fully-sharded data-parallel size (rows split, weights and optimizer state
        sharded); -1 (the default): every device not taken by the others.
      tensor: tensor-parallel size (heads and MLP columns split).
      context: context-parallel size, 1 (the default) or more: each sequence's tokens
        split over this many devices (the residual stream, MLP and logits a device hold
        T / context tokens; attention runs on whole sequences with its heads split over
        tensor x context, two all-to-alls a layer; weights sharded over fsdp x context;
        `grpojax.models.sharding`), for sequences whose activations do not fit one
        device. The sampler's rows are not split over it (each context group decodes the
        same rows).
      rollout_devices: 0 (the default): the sampler shares the training mesh ("interleaved"
        placement); n >= 1: the last n devices sample (n / P of each of P processes), on
        a mesh of their own (rows over `data` = n / tensor, weights replicated but for
        `tensor`), and data/fsdp/tensor lay out the training mesh over the others
        ("split" placement, `grpojax.rollouts.pipeline`): after each update the weights
        are copied, resharded, to the rollout devices, and rounds decode there while the
        trainer updates. Needs `rollout.max_staleness` >= 1; across processes, n a
        multiple of the process count and `tensor` within a process.
    """

    data: int = 1
    fsdp: int = -1
    tensor: int = 1
    context: int = 1
    rollout_devices: int = 0

    def __post_init__(self):
        sizes = {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor}
        sizes["context"] = self.context
        for name, v in sizes.items():
            if not (isinstance(v, int) and not isinstance(v, bool) and (v >= 1 or v == -1)):
                raise ValueError(
                    f"{name} must be an int >= 1 or -1 (the remaining devices), got {v!r}"
                )
        if list(sizes.values()).count(-1) > 1:
            raise ValueError(f"at most one of data/fsdp/tensor/context may be -1, got {sizes}")
        check_int("rollout_devices", self.rollout_devices, minimum=0)


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything a `grpojax train` run needs. Sections are documented on their classes.

    Attributes:
      algo: one of `ALGOS`. GRPO-family names select a `grpo` preset (`algo_grpo_config`)
        under the loaded values; "ppo" trains with the `ppo` section and a critic.
      seed: the one seed every random key is split from, >= 0.
      total_steps: RL steps, >= 1.
      model, data, rewards, rollout, sampling: what is sampled from what.
      env: multi-turn episodes with an environment (`EnvSpec`; off by default).
      lora: LoRA adapters (`LoRASpec`; rank 0, the default: full fine-tuning).
      grpo: the GRPO-family step (`GRPOConfig`; its `group_size` is G for every algo).
      ppo: the PPO step (`PPOConfig`), used when algo == "ppo".
      distill: the teacher and divergence of algo "distill" (`DistillSpec`).
      optimizer: the policy's optimizer (`OptimizerConfig`).
      critic_optimizer: PPO's critic optimizer (None: same as `optimizer`).
      packing: sequence packing of the step (`PackingSpec`).
      sft, ptx, eval, checkpoint, log, mesh: the driver's sections (`ptx`: the text of the
        step's PPO-ptx term, when its `ptx_coef` > 0).
    """

    algo: str = "grpo"
    seed: int = 0
    total_steps: int = 100
    model: ModelSpec = dataclasses.field(default_factory=ModelSpec)
    lora: LoRASpec = dataclasses.field(default_factory=LoRASpec)
    data: DataSpec = dataclasses.field(default_factory=DataSpec)
    rewards: RewardsSpec = dataclasses.field(default_factory=RewardsSpec)
    rollout: RolloutSpec = dataclasses.field(default_factory=RolloutSpec)
    env: EnvSpec = dataclasses.field(default_factory=EnvSpec)
    sampling: SamplingConfig = dataclasses.field(default_factory=SamplingConfig)
    grpo: GRPOConfig = dataclasses.field(default_factory=lambda: algo_grpo_config("grpo"))
    # G samples of a prompt are contiguous rows: PPO runs each prompt once per forward too
    # (its `group_size` is filled from `grpo.group_size` by the trainer).
    ppo: PPOConfig = dataclasses.field(default_factory=lambda: PPOConfig(share_prompt=True))
    distill: DistillSpec = dataclasses.field(default_factory=DistillSpec)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    critic_optimizer: OptimizerConfig | None = None
    packing: PackingSpec = dataclasses.field(default_factory=PackingSpec)
    sft: SftSpec = dataclasses.field(default_factory=SftSpec)
    ptx: PtxSpec = dataclasses.field(default_factory=PtxSpec)
    eval: EvalSpec = dataclasses.field(default_factory=EvalSpec)
    checkpoint: CheckpointSpec = dataclasses.field(default_factory=CheckpointSpec)
    log: LogSpec = dataclasses.field(default_factory=LogSpec)
    mesh: MeshSpec = dataclasses.field(default_factory=MeshSpec)

    def __post_init__(self):
        check_choice("algo", self.algo, ALGOS)
        check_int("seed", self.seed, minimum=0)
        check_int("total_steps", self.total_steps, minimum=1)
        step = self.step_config
        if self.lora.enabled and self.is_ppo and self.ppo.critic != "shared":
            raise ValueError(
                "lora.rank > 0 with algo 'ppo' needs ppo.critic=shared (a value head on the "
                "adapted policy's hidden states); a separate critic with LoRA is not supported"
            )
        if self.lora.enabled and self.is_ppo and self.lora.dropout > 0:
            raise ValueError(
                "lora.dropout > 0 is supported with the GRPO-family algorithms only; the PPO "
                "step runs its adapters without dropout (set lora.dropout=0 with algo 'ppo')"
            )
        if self.lora.enabled and self.grpo.ref_refresh_every is not None:
            raise ValueError(
                "grpo.ref_refresh_every must be null with lora.rank > 0: the reference is the "
                "base model (adapters off), of which there is one copy"
            )
        # Trainer logprobs must describe the distribution the sampler drew from.
        section = "ppo" if self.is_ppo else "grpo"
        if not self.sampling.greedy and step.forward.temperature != self.sampling.temperature:
            raise ValueError(
                f"{section}.forward.temperature ({step.forward.temperature}) must equal "
                f"sampling.temperature ({self.sampling.temperature}): the trainer's logprobs "
                "must be those of the sampling distribution"
            )
        if self.sampling.truncates and self.rollout.engine == "vllm":
            # vLLM's logprobs are the truncated sampler's, mu = pi / (kept mass) on the kept
            # set; pi_old and pi_theta stay the full-vocabulary policy, and the rollout
            # correction's weight pi_old / mu (the kept mass, <= 1) is the exact ratio
            # between the two on every token vLLM can draw (docs/how-to/vllm.md).
            if step.rollout_correction_mode is None:
                raise ValueError(
                    "sampling.top_k/top_p/min_p with rollout.engine=vllm need the rollout "
                    "correction: vLLM's logprobs are the truncated distribution's and the "
                    "trainer's the full policy's; set rollout.vllm.correction to truncate "
                    f"(the default), mask or icepop, or {section}.rollout_correction_mode"
                )
        elif self.sampling.truncates:
            # A truncated sampler (top-k/top-p/min-p) draws from the kept set renormalised;
            # the trainer's full-vocabulary logprob would differ by log(kept mass).
            if self.is_ppo:
                raise ValueError(
                    "sampling.top_k/top_p/min_p: algo 'ppo' trains on the untruncated "
                    "policy; truncated sampling needs a GRPO-family algo with "
                    "grpo.use_keep_mask=true, or rollout.engine=vllm with its correction"
                )
            if not self.grpo.use_keep_mask:
                raise ValueError(
                    "grpo.use_keep_mask must be true when sampling truncates "
                    "(sampling.top_k/top_p/min_p): the trainer's logprobs must be those of "
                    "the sampling distribution, renormalised over the sampler's kept set"
                )
        if self.data.kind == "env" and (self.env.name is None or not row_generator(self.env.name)):
            raise ValueError(
                f"data.kind='env' takes the rows of a built-in environment, a TextArena "
                f"game, an OpenEnv env or a verifiers taskset: env.name must be one of "
                f"{tuple(ENVIRONMENTS)}, 'textarena:<env id>', 'openenv:...' or "
                f"'verifiers:<taskset id>', got {self.env.name!r}"
            )
        if self.env.enabled:
            self._check_env()
        if self.model.routing_replay != "none":
            self._check_routing_replay()
        if self.algo == "distill":
            self._check_distill()
        if not self.is_ppo and self.grpo.router_aux_coef > 0 and self.packing.mode == "always":
            raise ValueError(
                "grpo.router_aux_coef > 0 is not supported with packing.mode='always' (the "
                "experts' load is counted on unpacked rows); set packing.mode=auto or never"
            )
        if self.rollout.engine == "vllm":
            self._check_vllm()
        if self.rollout.max_staleness:
            self._check_staleness()
        elif self.mesh.rollout_devices:
            raise ValueError(
                f"mesh.rollout_devices={self.mesh.rollout_devices} needs "
                "rollout.max_staleness >= 1: on-policy, the rollout devices would idle through "
                "every update (set mesh.rollout_devices=0 for interleaved placement)"
            )
        n = self.samples_per_step
        chunks = step.num_minibatches * step.num_microbatches
        if n % chunks:
            raise ValueError(
                f"rollout.prompts_per_step * grpo.group_size = {n} completions per step must "
                f"be divisible by {section}.num_minibatches * {section}.num_microbatches "
                f"= {chunks}"
            )
        if step.share_prompt and self.rollout.prompts_per_step % chunks:
            raise ValueError(
                f"rollout.prompts_per_step ({self.rollout.prompts_per_step}) must be divisible "
                f"by {section}.num_minibatches * {section}.num_microbatches = {chunks} with "
                f"{section}.share_prompt=true (whole groups per micro-batch); or set "
                f"{section}.share_prompt=false"
            )
        if self.ppo.group_size not in (1, self.grpo.group_size):
            raise ValueError(
                f"ppo.group_size ({self.ppo.group_size}) is G, taken from grpo.group_size "
                f"({self.grpo.group_size}) by the driver: leave it unset"
            )
        if step.ptx_coef and self.ptx.batch_size % chunks:
            raise ValueError(
                f"ptx.batch_size ({self.ptx.batch_size}) must be divisible by "
                f"{section}.num_minibatches * {section}.num_microbatches = {chunks} "
                f"({section}.ptx_coef > 0 splits the ptx rows like the RL rows)"
            )
        updates = self.total_steps * step.num_epochs * step.num_minibatches
        for name in ("optimizer", "critic_optimizer"):
            opt = getattr(self, name)
            if opt and opt.schedule == "cosine" and opt.total_steps is None:
                if updates <= opt.warmup_steps:
                    raise ValueError(
                        f"{name}.warmup_steps ({opt.warmup_steps}) must be below the run's "
                        f"{updates} optimizer updates (total_steps x {section}.num_epochs x "
                        f"{section}.num_minibatches) for the cosine schedule"
                    )

    def _check_routing_replay(self) -> None:
        """What `model.routing_replay="rollout"` cannot combine with yet (each a ValueError
        naming the field): the rows that carry the sampler's routing are the single-turn,
        unpacked, on-policy ones of a GRPO-family step."""
        refusals = {
            "algo 'ppo'": self.is_ppo,
            "env.name (multi-turn episodes)": self.env.enabled,
            f"rollout.engine={self.rollout.engine!r}": self.rollout.engine
            in ("continuous", "compact"),
            "packing.mode='always'": self.packing.mode == "always",
            f"rollout.max_staleness={self.rollout.max_staleness}": self.rollout.max_staleness > 0,
            "dynamic sampling": self.use_dynamic_sampling,
        }
        refused = [name for name, on in refusals.items() if on]
        if refused:
            raise ValueError(
                "model.routing_replay='rollout' is not supported with "
                f"{', '.join(refused)}: the sampler's routing reaches the trainer on "
                "single-turn, unpacked, on-policy rows of a GRPO-family step (static engine); "
                "set model.routing_replay=none"
            )

    def _check_distill(self) -> None:
        """What algo "distill" needs (each a ValueError naming the field); the step's
        divergence and policy-gradient weight come from the `distill` section
        (`step_config`)."""
        d, g = self.distill, self.grpo
        if not d.teacher:
            raise ValueError(
                "algo 'distill' needs distill.teacher: a checkpoint directory or Hub id"
            )
        if g.kl_estimator != "full":
            raise ValueError(
                "algo 'distill' computes the exact divergence to the teacher: "
                f"grpo.kl_estimator must be 'full', got {g.kl_estimator!r}"
            )
        if g.reward_kl_coef or g.ref_refresh_every is not None:
            raise ValueError(
                "algo 'distill': the teacher is the reference; grpo.reward_kl_coef must be 0 "
                "and grpo.ref_refresh_every null"
            )

    def _check_vllm(self) -> None:
        """What `rollout.engine="vllm"` cannot combine with yet (a ValueError naming them)."""
        refusals = {
            # vLLM decodes in its own process (on its own devices): nothing to lend it.
            f"mesh.rollout_devices={self.mesh.rollout_devices}": self.mesh.rollout_devices > 0,
            "grpo.use_keep_mask (vLLM reports no kept sets)": (
                not self.is_ppo and self.grpo.use_keep_mask
            ),
            f"model.routing_replay={self.model.routing_replay!r}": (
                self.model.routing_replay != "none"
            ),
        }
        refused = [name for name, on in refusals.items() if on]
        if refused:
            raise ValueError(
                f"rollout.engine='vllm' is not supported with {', '.join(refused)} yet; use "
                "the built-in engines (rollout.engine=auto) for these"
            )

    def _check_staleness(self) -> None:
        """What pipelined rollouts need (each a ValueError naming the field); their default
        correction of the stale samples is `step_config`'s."""
        k = self.rollout.max_staleness
        if self.is_ppo:
            raise ValueError(
                f"rollout.max_staleness={k} needs a GRPO-family algo; algo 'ppo' trains "
                "on-policy (max_staleness=0)"
            )
        if self.rollout.partial:
            refusals = {
                "env.name (multi-turn episodes)": self.env.enabled,
                f"rollout.engine={self.rollout.engine!r}": self.rollout.engine
                not in ("auto", "continuous"),
                "dynamic sampling": self.use_dynamic_sampling,
                "ReMax's greedy round": "greedy_rewards_n" in self.batch_inputs,
                f"mesh.rollout_devices={self.mesh.rollout_devices}": self.mesh.rollout_devices > 0,
            }
            refused = [name for name, on in refusals.items() if on]
            if refused:
                raise ValueError(
                    f"rollout.partial=true is not supported with {', '.join(refused)}: partial "
                    "rollouts continue single-turn samples in the built-in engine's slots "
                    "(rollout.engine auto or continuous) on one device set; set "
                    "rollout.partial=false"
                )

    def _check_env(self) -> None:
        """What a multi-turn run cannot combine with (each a ValueError naming the field)."""
        if self.data.system_prompt is not None:
            raise ValueError(
                "data.system_prompt is not used with env.name set: the environment writes the "
                "prompt (an agent its own messages); put the system message there"
            )
        if self.rollout.stop_strings:
            raise ValueError(
                "rollout.stop_strings must be empty with env.name set: an episode's turns end "
                "at the environment's own stop_strings, EOS or the turn budget"
            )
        if self.sampling.truncates:
            raise ValueError(
                "sampling.top_k/top_p/min_p are not supported with env.name set (the episode "
                "rows keep no kept-set sizes); sample from the full distribution"
            )
        if self.packing.mode == "always":
            raise ValueError(
                "packing.mode='always' is not supported with env.name set (an episode's loss "
                "mask has holes at the environment's ids); use 'auto' or 'never'"
            )
        seats = self.env.environment_class.seats
        if self.rollout.prompts_per_step % seats:
            raise ValueError(
                f"rollout.prompts_per_step={self.rollout.prompts_per_step} must be a multiple of "
                f"{seats}: env.name={self.env.name!r} seats {seats} players, and each seat's G "
                "episodes of a row are a group of their own"
            )
        if seats > 1 and self.rollout.engine == "continuous":
            raise ValueError(
                f"rollout.engine='continuous' cannot play env.name={self.env.name!r}: its seats "
                "wait for each other, and a slot cannot hold a seat that waits; use 'static', "
                "'compact' or 'auto'"
            )
        if not self.is_ppo:
            inputs = self.batch_inputs
            if inputs:
                raise ValueError(
                    f"grpo.advantage_estimator={self.grpo.advantage_estimator!r} needs "
                    f"{list(inputs)}, which episodes do not provide (one reward each, no "
                    "greedy round); choose another estimator or unset env.name"
                )

    @property
    def is_ppo(self) -> bool:
        return self.algo == "ppo"

    def optimizer_for(self, name: str = "optimizer") -> OptimizerConfig:
        """`optimizer` or `critic_optimizer` (None: the policy's) as the trainer uses it: a
        cosine schedule without `total_steps` spans the run's optimizer updates
        (total_steps x epochs x mini-batches), so overriding `total_steps` resizes it."""
        if name not in ("optimizer", "critic_optimizer"):
            raise ValueError(f"name must be 'optimizer' or 'critic_optimizer', got {name!r}")
        opt = getattr(self, name) or self.optimizer
        if opt.schedule == "cosine" and opt.total_steps is None:
            step = self.step_config
            updates = self.total_steps * step.num_epochs * step.num_minibatches
            opt = dataclasses.replace(opt, total_steps=updates)
        return opt

    @functools.cached_property
    def step_config(self) -> GRPOConfig | PPOConfig:
        """The step config the algo trains with, with what the run derives from its other
        sections (the config's own fields stay as given):

        - algo "ppo": `ppo` with its `group_size` G (`grpo.group_size`: the driver's rows are
          G samples per prompt in contiguous groups), and with the vLLM engine and
          `ppo.rollout_correction_mode` unset, `rollout.vllm.correction`'s;
        - algo "distill": beta 1 (the divergence to the teacher is the loss), pg_coef
          `distill.rl_coef`, the divergence `distill.divergence` / `distill.jsd_beta`;
        - pipelined rollouts (`rollout.max_staleness` >= 1) with
          `grpo.rollout_correction_mode` unset: `rollout.staleness_correction`'s ("none"
          leaves it unset); the vLLM engine likewise `rollout.vllm.correction`'s.
        """
        vllm_mode = self.rollout.vllm.correction
        vllm = self.rollout.engine == "vllm" and vllm_mode != "none"
        if self.is_ppo:
            p = dataclasses.replace(self.ppo, group_size=self.group_size)
            if vllm and p.rollout_correction_mode is None:
                p = dataclasses.replace(p, rollout_correction_mode=vllm_mode)
            return p
        g = self.grpo
        if self.algo == "distill":
            d = self.distill
            g = dataclasses.replace(
                g, beta=1.0, pg_coef=d.rl_coef, kl_divergence=d.divergence, kl_jsd_beta=d.jsd_beta
            )
        mode = self.rollout.staleness_correction
        if self.rollout.max_staleness and g.rollout_correction_mode is None and mode != "none":
            g = dataclasses.replace(g, rollout_correction_mode=mode)
        if vllm and g.rollout_correction_mode is None:
            g = dataclasses.replace(g, rollout_correction_mode=vllm_mode)
        return g

    @property
    def group_size(self) -> int:
        """G, samples per prompt."""
        return self.grpo.group_size

    @property
    def samples_per_step(self) -> int:
        """N = B * G, the completions (or episodes) a step trains on."""
        return self.rollout.prompts_per_step * self.grpo.group_size

    @property
    def rollout_engine(self) -> str:
        """The sampler's engine ("static", "continuous", "compact" or "vllm") with "auto"
        resolved: multi-turn runs by `auto_episode_engine`, single-turn rows by
        `auto_engine`; a run that replays the sampler's expert routing records it with the
        static engine."""
        if self.model.routing_replay == "rollout":
            return "static"
        if self.rollout.engine != "auto":
            return self.rollout.engine
        if self.env.enabled:
            return auto_episode_engine(self.rollout.max_new_tokens)
        return self.rollout.engine_kwargs()["engine"]

    @property
    def vllm_probe_tol(self) -> float:
        """`rollout.vllm.probe_tol`, or its default: 1e-2 when vLLM and the policy both
        compute in float32, else 5e-2."""
        v = self.rollout.vllm
        if v.probe_tol is not None:
            return v.probe_tol
        return 1e-2 if v.dtype == "float32" and self.model.dtype == "float32" else 5e-2

    @property
    def batch_inputs(self) -> tuple[str, ...]:
        """The GRPO estimator's extra batch inputs (`grpojax.train.objectives.BATCH_INPUTS`:
        what a round adds to the batch, e.g. ReMax's greedy rewards); () for PPO."""
        if self.is_ppo:
            return ()
        return estimator_batch_inputs(self.grpo.advantage_estimator_fn)

    @property
    def use_dynamic_sampling(self) -> bool:
        if self.rollout.dynamic_sampling is None:
            return self.algo == "dapo"
        return self.rollout.dynamic_sampling


# ----------------------------------------------------------------------------------------
# Loading and saving
# ----------------------------------------------------------------------------------------


def _first_line(e: BaseException) -> str:
    msg = getattr(e, "msg", None) or str(e)
    return msg.strip().splitlines()[0] if msg.strip() else type(e).__name__


def _type_at(path: str):
    """(the dataclass owning the last component of `path`, that field's type) or None."""
    cls: Any = RunConfig
    parts = [p for p in path.split(".") if p]
    field_type = None
    for i, part in enumerate(parts):
        if not dataclasses.is_dataclass(cls):
            return None
        hints = typing.get_type_hints(cls)
        if part not in hints:
            return (cls, None) if i == len(parts) - 1 else None
        field_type = hints[part]
        if i < len(parts) - 1:
            args = [a for a in typing.get_args(field_type) if a is not type(None)]
            cls = args[0] if args and dataclasses.is_dataclass(args[0]) else field_type
    return cls, field_type


def _type_name(tp) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _rephrase(e: OmegaConfBaseException) -> ConfigError:
    key = getattr(e, "full_key", None) or ""
    msg = _first_line(e)
    if isinstance(e, ConfigKeyError) and key:
        found = _type_at(key)
        allowed = ""
        if found is not None and dataclasses.is_dataclass(found[0]):
            allowed = f" (allowed keys: {[f.name for f in dataclasses.fields(found[0])]})"
        return ConfigError(f"unknown config key '{key}': {msg}{allowed}")
    if key:
        found = _type_at(key)
        expected = f" (expected {_type_name(found[1])})" if found and found[1] is not None else ""
        return ConfigError(f"invalid value for '{key}': {msg}{expected}")
    return ConfigError(f"invalid config: {msg}")


def _prefix(path: str, cls, e: Exception) -> str:
    msg = str(e)
    if msg.endswith(("got 'False'", "got 'True'")) and "must be one of" in msg:
        # A text field given off/no/on/yes: YAML read a boolean, OmegaConf made it text.
        msg += " (YAML reads an unquoted off, no, on or yes as a boolean)"
    if not path:
        return msg
    head = msg.split(" ", 1)[0].rstrip(":,")
    names = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    return f"{path}.{msg}" if head in names else f"{path}: {msg}"


def _to_object(node: DictConfig, path: str = ""):
    """`OmegaConf.to_object`, children first, so a `__post_init__` error names its path."""
    for key in node.keys():
        child = node[key]
        if isinstance(child, DictConfig) and dataclasses.is_dataclass(OmegaConf.get_type(child)):
            _to_object(child, f"{path}.{key}" if path else str(key))
    try:
        return OmegaConf.to_object(node)
    except (ValueError, TypeError) as e:
        raise ConfigError(_prefix(path, OmegaConf.get_type(node), e)) from None
    except OmegaConfBaseException as e:
        raise _rephrase(e) from None


def _load_yaml(yaml_path) -> DictConfig:
    path = pathlib.Path(yaml_path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} not found")
    try:
        loaded = OmegaConf.load(path)
    except Exception as e:  # YAML syntax errors come in several types
        mark = getattr(e, "problem_mark", None)  # YAML syntax errors say where
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        what = getattr(e, "problem", None) or _first_line(e)
        raise ConfigError(f"cannot parse config file {str(path)!r}{where}: {what}") from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of sections")
    return loaded


def _load_overrides(overrides: Sequence[str]) -> DictConfig:
    if isinstance(overrides, str):
        raise ConfigError(f"overrides must be a list of 'key=value' strings, got {overrides!r}")
    for item in overrides:
        if not isinstance(item, str) or "=" not in item or item.startswith("="):
            raise ConfigError(f"override {item!r} must look like key=value (e.g. grpo.beta=0.0)")
    for item in overrides:
        try:
            OmegaConf.from_dotlist([item])
        except (OmegaConfBaseException, yaml.YAMLError) as e:
            raise ConfigError(
                f"cannot parse override {item!r} (values are YAML: quote strings with braces, "
                f"colons or commas, e.g. key='{{question}} ='): {_first_line(e)}"
            ) from None
    return OmegaConf.from_dotlist(list(overrides))


def load_config(
    yaml_path: str | os.PathLike | None = None, overrides: Sequence[str] = ()
) -> RunConfig:
    """The `RunConfig` of defaults <- algo preset <- YAML file <- `key=value` overrides.

    Args:
      yaml_path: a YAML file of (a subset of) the sections, or None.
      overrides: dotted `key=value` strings, e.g. `["algo=ppo", "ppo.gamma=0.99",
        "rewards.names=[numeric_answer,format]", "checkpoint.dir=null"]`.

    Raises:
      ConfigError: one message naming the field path and what is allowed.
    """
    file_cfg = _load_yaml(yaml_path) if yaml_path is not None else OmegaConf.create({})
    over_cfg = _load_overrides(overrides)
    try:
        given = OmegaConf.merge(file_cfg, over_cfg)
        algo = given.get("algo", RunConfig.algo)
        budget = OmegaConf.select(given, "rollout.max_new_tokens")
    except OmegaConfBaseException as e:
        raise _rephrase(e) from None
    if algo not in ALGOS:
        raise ConfigError(f"algo must be one of {ALGOS}, got {algo!r}")
    if not (isinstance(budget, int) and budget >= 1):
        budget = None  # the default's, or a bad value that the merge below reports
    # The preset under the file and the overrides, its budget-following fields from the
    # run's completion budget (a value the file or an override gives still wins).
    # (The algo itself comes with the merge: a base of algo "distill" would lack its teacher.)
    base = OmegaConf.structured(RunConfig(grpo=algo_grpo_config(algo, budget)))
    try:
        merged = OmegaConf.merge(base, file_cfg, over_cfg)
    except OmegaConfBaseException as e:
        raise _rephrase(e) from None
    return _to_object(merged)


def config_to_dict(cfg: RunConfig) -> dict:
    """A plain nested dict of `cfg` (JSON/YAML-able): for checkpoints and run loggers."""
    if not isinstance(cfg, RunConfig):
        raise ValueError(f"expected a RunConfig, got {type(cfg).__name__}")

    def plain(x):
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        if isinstance(x, list | tuple):
            return [plain(v) for v in x]
        return x

    return plain(OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True))


def save_config(cfg: RunConfig, path: str | os.PathLike) -> pathlib.Path:
    """Write `cfg` as YAML (every field) to `path`; `load_config(path) == cfg`."""
    if not isinstance(cfg, RunConfig):
        raise ValueError(f"expected a RunConfig, got {type(cfg).__name__}")
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)), encoding="utf-8")
    return path


__all__ = [
    "ALGOS",
    "DATA_KINDS",
    "DTYPES",
    "REWARD_MODES",
    "REWARD_NAMES",
    "CheckpointSpec",
    "ConfigError",
    "DataSpec",
    "EvalSpec",
    "LogSpec",
    "MeshSpec",
    "ModelSpec",
    "PackingSpec",
    "PtxSpec",
    "RewardsSpec",
    "RolloutSpec",
    "RunConfig",
    "SftSpec",
    "VllmSpec",
    "algo_grpo_config",
    "config_to_dict",
    "load_config",
    "save_config",
]
