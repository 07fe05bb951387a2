"""What the benchmark scripts share: the machine line, the issues' tiny Qwen2 (as a checkpoint
or in memory), the measured float32 matmul peak and a matmul FLOP count of a traced program."""

from __future__ import annotations

import math
import os
import pathlib
import platform
import statistics
import time
from collections.abc import Sequence

# The TRL workload's model: vocab 512, D 256, intermediate 688, 4 layers, 4 heads, 2 kv heads.
TINY_QWEN2 = dict(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=688,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
)


def machine() -> str:
    """'<CPU model> (<arch>), <n> cores, jax <version>[, <accelerator>]' for the table
    header; the accelerator (e.g. 'gpu NVIDIA H100 80GB HBM3') when JAX's default backend is
    not the CPU."""
    import jax

    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    line = f"{cpu} ({platform.machine()}), {os.cpu_count()} cores, jax {jax.__version__}"
    if jax.default_backend() != "cpu":
        line += f", {jax.default_backend()} {jax.devices()[0].device_kind}"
    return line


def exact_float32_matmuls() -> str:
    """Make JAX's float32 matmuls float32 on every backend ("highest" precision; on a GPU the
    default rounds operands to TF32, torch's default does not) and name the setting."""
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    return "float32 matmuls at 'highest' precision"


def build_tiny_qwen2(path: str | os.PathLike, *, tokenizer=None) -> None:
    """The random Qwen2 both benchmarks name, saved as safetensors with `transformers`:
    `TINY_QWEN2`'s architecture (head_dim = D / heads = 64), float32 (`build_qwen2`)."""
    build_qwen2(path, TINY_QWEN2, tokenizer=tokenizer)


def build_qwen2(
    path: str | os.PathLike,
    arch: dict,
    *,
    dtype: str = "float32",
    tokenizer=None,
    rope_theta: float = 10000.0,
    max_positions: int = 512,
) -> None:
    """A random Qwen2 of architecture `arch` (`TINY_QWEN2`'s keys), saved as safetensors
    with `transformers`: tied embeddings, weights in `dtype`, seed 0. `tokenizer` (saved
    alongside) also sets the bos/eos/pad ids.
    """
    import torch
    import transformers

    ids = {}
    if tokenizer is not None:
        ids = dict(
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    c = arch
    config = transformers.Qwen2Config(
        vocab_size=c["vocab_size"],
        hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"],
        num_hidden_layers=c["num_layers"],
        num_attention_heads=c["num_heads"],
        num_key_value_heads=c["num_kv_heads"],
        head_dim=c["head_dim"],
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        rope_theta=rope_theta,
        torch_dtype=dtype,
        **ids,
    )
    torch.manual_seed(0)
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    transformers.Qwen2ForCausalLM(config).to(getattr(torch, dtype)).save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)


def tiny_qwen2_config(**overrides):
    """The `ModelConfig` of `build_tiny_qwen2`'s checkpoint (Qwen2: q/k/v biases, no q/k norm,
    tied embeddings, float32); `overrides` replace its fields."""
    from grpojax.models import tiny_config

    qwen2 = dict(model_type="qwen2", qkv_bias=True, qk_norm=False, tie_word_embeddings=True)
    return tiny_config(**{**TINY_QWEN2, **qwen2, **overrides})


def tiny_qwen2_model(**overrides):
    """The tiny Qwen2 of `build_tiny_qwen2` as a grpojax `Decoder` built in memory (random
    init); `overrides` replace `tiny_qwen2_config` fields."""
    from flax import nnx

    from grpojax.models import Decoder

    return Decoder(tiny_qwen2_config(**overrides), rngs=nnx.Rngs(0))


def grpo_batch(b: int, g: int, p: int, t: int, seed: int = 0):
    """A `GRPOBatch` of B ragged left-padded prompts (width P) repeated G times, then G ragged
    completions (width T) each, random tokens, advantages and reference logprobs."""
    import jax.numpy as jnp
    import numpy as np

    from grpojax.train.grpo import GRPOBatch

    rng = np.random.default_rng(seed)
    plen = rng.integers(p // 2, p + 1, b)
    pmask = np.arange(p)[None, :] >= (p - plen)[:, None]
    prompts = np.where(pmask, rng.integers(3, 500, (b, p)), 0)
    cmask = np.arange(t)[None, :] < rng.integers(t // 2, t + 1, b * g)[:, None]
    tokens = np.concatenate([np.repeat(prompts, g, 0), rng.integers(3, 500, (b * g, t))], 1)
    return GRPOBatch(
        tokens_ns=jnp.asarray(tokens, jnp.int32),
        mask_ns=jnp.asarray(np.concatenate([np.repeat(pmask, g, 0), cmask], 1)),
        completion_mask_nt=jnp.asarray(cmask),
        advantages=jnp.asarray(rng.normal(size=b * g), jnp.float32),
        ref_logp_nt=jnp.asarray(rng.normal(-6.0, 0.5, (b * g, t)), jnp.float32),
    )


def matmul_peak(size: int | None = None, repeats: int = 5, dtype: str = "float32") -> float:
    """Measured FLOP/s of a square `jnp.dot` in `dtype` (2 n^3 FLOPs), median of `repeats`.

    `size` defaults to 2048 on the CPU and 8192 on an accelerator (large enough to fill it).
    """
    import jax
    import jax.numpy as jnp

    if size is None:
        size = 2048 if jax.default_backend() == "cpu" else 8192
    a = jax.random.normal(jax.random.key(0), (size, size), dtype)
    b = jax.random.normal(jax.random.key(1), (size, size), dtype)
    dot = jax.jit(jnp.dot)
    dot(a, b).block_until_ready()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dot(a, b).block_until_ready()
        times.append(time.perf_counter() - t0)
    return 2.0 * size**3 / statistics.median(times)


def dot_flops(jaxpr, *, while_trips: int | Sequence[int] = 1) -> int:
    """Matmul FLOPs of a traced program: 2 * prod(output shape) * prod(contracted sizes) per
    `dot_general`, a `scan` body counted `length` times, a `while` body `while_trips` times,
    the largest branch of a `cond`, and nested calls (jit, remat, custom rules) entered.

    Why not XLA's `cost_analysis()`: XLA:CPU counts the body of a while loop once whatever its
    trip count, so a model whose layers run under `lax.scan` reports the FLOPs of one layer
    (checked in `tests/test_experiment_scripts.py`, where this count is also compared with
    XLA's on a program without loops).

    Args:
      jaxpr: a `jax.make_jaxpr` result (`ClosedJaxpr`) or a `Jaxpr`.
      while_trips: iterations assumed for every `while` loop, or one count for each `while`
        loop whose body runs matmuls, in program order (the sampler's decode loops, from
        `grpojax.sampling.generate.decode_plan`); scans know their own length.
    """
    if not isinstance(while_trips, int):
        trips = iter(while_trips)
        total = _dot_flops(jaxpr, lambda: next(trips))
        if next(trips, None) is not None:
            raise ValueError("while_trips has more counts than the program has matmul loops")
        return total
    return _dot_flops(jaxpr, lambda: while_trips)


def _dot_flops(jaxpr, trips) -> int:
    """`dot_flops` with `trips()` giving the next while loop's iterations."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    total = 0
    for eqn in jaxpr.eqns:
        name, params = eqn.primitive.name, eqn.params
        if name == "dot_general":
            (contract, _), _ = params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            out = eqn.outvars[0].aval.shape
            total += 2 * math.prod(out) * math.prod(lhs[i] for i in contract)
        elif name == "scan":
            total += params["length"] * _dot_flops(params["jaxpr"], trips)
        elif name == "while":
            body = _dot_flops(params["body_jaxpr"], trips)
            total += trips() * body if body else 0
        elif name == "cond":
            total += max(_dot_flops(b, trips) for b in params["branches"])
        else:
            inner = params.get("jaxpr", params.get("call_jaxpr"))
            if inner is not None and hasattr(getattr(inner, "jaxpr", inner), "eqns"):
                total += _dot_flops(inner, trips)
    return total
