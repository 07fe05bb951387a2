"""A trainer's weights out as Hugging Face checkpoints transformers loads (`grpojax export`,
`grpojax.jobs.export`, and the end of a `grpojax train` run).

`export_policy` writes the policy to DIR (`AutoModelForCausalLM` + `AutoTokenizer`: config.json,
generation_config.json, model.safetensors or 5 GB shards, the tokenizer files) and, for a
PPO run, its critic to DIR/critic/ (`AutoModelForSequenceClassification`; a shared critic
is the policy's backbone under the value head). `grpojax train` calls `export_policy` at the
end of a run that finishes (`log.export_hf`), writing `<run_dir>/hf/`. A LoRA run
(`lora.rank` > 0) exports merged weights W + (alpha/r) A B; `export_adapter` (`--adapter`)
writes the adapters in PEFT format instead (adapter_config.json + adapter_model.safetensors, which
`peft.PeftModel.from_pretrained(base, DIR)` loads). Their base is `model.source` when the run
trained on that checkpoint as it is; otherwise (the built-in model, a GGUF file, which PEFT
cannot load as a base, or an SFT warm start before RL) the base weights are written beside
them, to DIR/base/, and named in adapter_config.json.

Many processes: every process takes part in gathering each parameter to the host (one
at a time); process 0 alone writes.
"""

from __future__ import annotations

import pathlib

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from grpojax.distributed import is_primary
from grpojax.driver.trainer import PPOTrainer, Trainer
from grpojax.errors import UserError
from grpojax.models import (
    ValueModel,
    adapters_off,
    has_adapters,
    save_lora_adapter,
    save_pretrained,
    save_sequence_classifier,
)
from grpojax.models.gguf_io import find_gguf

__all__ = ["DEFAULT_MAX_SHARD_SIZE", "export_adapter", "export_policy"]

DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # bytes per safetensors file, transformers' "5GB"
DTYPES = ("float32", "bfloat16")


def _on_host(module):
    """`module` with every parameter a host (NumPy) array when this is one of many
    processes (a sharded parameter is not addressable from one); as is otherwise."""
    if jax.process_count() == 1:
        return module
    graphdef, state = nnx.split(module)
    state = jax.tree.map(
        lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)), state
    )
    return nnx.merge(graphdef, state)


def _critic(trainer: Trainer):
    """The PPO critic as a `ValueModel` (None for the GRPO family)."""
    if not isinstance(trainer, PPOTrainer):
        return None
    critic = nnx.merge(trainer.graphs.critic, trainer.state.ppo.critic.params)
    if isinstance(critic, ValueModel):
        return critic
    # critic="shared": a scalar head on the actor's final hidden states.
    value = nnx.eval_shape(lambda: ValueModel(trainer.policy(), rngs=nnx.Rngs(0)))
    value.backbone = trainer.policy()
    value.head = critic
    return value


def export_policy(
    trainer: Trainer,
    tokenizer,
    out: str | pathlib.Path,
    *,
    dtype: str | None = None,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    with_critic: bool = False,
) -> dict:
    """Write `trainer`'s policy to `out` (and with `with_critic`, a PPO critic to
    `out/critic/`) in `dtype` (None: the model's compute dtype, `model.dtype`: a bf16 run
    trained on float32 masters exports bf16 weights, like the checkpoint it started from).
    Returns {"policy": path, "critic": path or None, "critic_bias": float}.
    Every process must call it; process 0 writes."""
    out = pathlib.Path(out)
    result = {"policy": str(out), "critic": None, "critic_bias": 0.0}
    policy = _on_host(trainer.policy())
    dtype = dtype or policy.config.dtype
    if is_primary():
        save_pretrained(
            policy, out, tokenizer=tokenizer, dtype=dtype, max_shard_size=max_shard_size
        )
    critic = _critic(trainer) if with_critic else None
    if critic is not None:
        critic = _on_host(critic)
        result["critic"] = str(out / "critic")
        if is_primary():
            result["critic_bias"] = save_sequence_classifier(
                critic,
                out / "critic",
                tokenizer=tokenizer,
                dtype=dtype,
                max_shard_size=max_shard_size,
            )
    return result


def export_adapter(trainer: Trainer, cfg, tokenizer, out: str | pathlib.Path, *, dtype=None):
    """Write a LoRA run's adapters in PEFT format to `out` (and, when the run's base is not
    `model.source` as it is on disk, the base weights to `out/base/`). Returns
    {"adapter": path, "base": the base's path}. Every process must call it; process 0
    writes."""
    out = pathlib.Path(out)
    policy = _on_host(trainer.policy())
    if not has_adapters(policy):
        raise UserError("--adapter: this run has no LoRA adapters (it ran with lora.rank=0)")
    base = cfg.model.source
    if cfg.model.is_builtin or cfg.sft.steps > 0 or find_gguf(base) is not None:
        base = str(out / "base")
        if is_primary():
            with adapters_off(policy):
                save_pretrained(policy, base, tokenizer=tokenizer, dtype=dtype)
    if is_primary():
        save_lora_adapter(policy, out, base_model_name_or_path=base, dtype=dtype)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(out))
    return {"adapter": str(out), "base": base}
