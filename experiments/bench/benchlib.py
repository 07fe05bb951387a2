"""What the benchmark scripts share: the machine line, the issues' tiny Qwen2 (as a checkpoint
or in memory), the measured float32 matmul peak, and a traced program's matmuls: their FLOP
count and the time they take alone."""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
import platform
import statistics
import sys
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


def sampler_prompts(b: int, p: int, vocab_size: int, seed: int = 0):
    """(prompts `[b, p]` int32 left-padded, lengths `[b]` int32): the sampler benchmarks'
    prompts, lengths drawn in [p/2, p], ids in [3, vocab_size)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    lengths = rng.integers(p // 2, p + 1, b).astype(np.int32)
    prompts = np.zeros((b, p), np.int32)
    for i, k in enumerate(lengths):
        prompts[i, p - k :] = rng.integers(3, vocab_size, k)
    return prompts, lengths


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


def read_bandwidth(mb: int) -> float:
    """Bytes read a second by a jitted sum over `mb` MB of float32 (best of 5)."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((mb * 2**20 // 4,), jnp.float32)
    f = jax.jit(jnp.sum)
    jax.block_until_ready(f(x))
    return x.nbytes / min(wall_times(lambda: f(x), 5))


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


@dataclasses.dataclass(frozen=True)
class Matmul:
    """One `dot_general` of a traced program and how many times the program runs it."""

    eqn: object  # the jaxpr equation: operand avals and the primitive's params
    runs: int

    @property
    def flops(self) -> int:
        """2 * prod(output shape) * prod(contracted sizes), times `runs`."""
        (contract, _), _ = self.eqn.params["dimension_numbers"]
        lhs, out = self.eqn.invars[0].aval.shape, self.eqn.outvars[0].aval.shape
        return 2 * math.prod(out) * math.prod(lhs[i] for i in contract) * self.runs


def matmuls(jaxpr, *, while_trips: int | Sequence[int] = 1) -> dict[tuple, Matmul]:
    """The matmuls of a traced program, one entry per distinct (operand shapes and dtypes,
    dimension numbers, precision, output type), with its run count: a `scan` body counted
    `length` times, a `while` body `while_trips` times, the branch of a `cond` with the most
    FLOPs, and nested calls (jit, remat, custom rules) entered.

    Args:
      jaxpr: a `jax.make_jaxpr` result (`ClosedJaxpr`) or a `Jaxpr`.
      while_trips: iterations assumed for every `while` loop, or one count for each `while`
        loop whose body runs matmuls, in program order (the sampler's decode loops,
        `decode_trips`); scans know their own length.
    """
    if isinstance(while_trips, int):
        found = _matmuls(jaxpr, lambda: while_trips)
    else:
        trips = iter(while_trips)
        found = _matmuls(jaxpr, lambda: next(trips))
        if next(trips, None) is not None:
            raise ValueError("while_trips has more counts than the program has matmul loops")
    out: dict[tuple, Matmul] = {}
    for m in found:
        key = _matmul_key(m.eqn)
        runs = out[key].runs if key in out else 0
        out[key] = Matmul(m.eqn, runs + m.runs)
    return out


def _matmul_key(eqn) -> tuple:
    avals = tuple((v.aval.shape, str(v.aval.dtype)) for v in eqn.invars)
    return avals, tuple(sorted((k, repr(v)) for k, v in eqn.params.items()))


def _matmuls(jaxpr, trips) -> list[Matmul]:
    """`matmuls` before grouping, `trips()` giving the next while loop's iterations."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    found = []
    for eqn in jaxpr.eqns:
        name, params = eqn.primitive.name, eqn.params
        if name == "dot_general":
            found.append(Matmul(eqn, 1))
        elif name == "scan":
            found += _times(_matmuls(params["jaxpr"], trips), params["length"])
        elif name == "while":
            body = _matmuls(params["body_jaxpr"], trips)
            found += _times(body, trips()) if body else []
        elif name == "cond":
            branches = [_matmuls(b, trips) for b in params["branches"]]
            found += max(branches, key=lambda ms: sum(m.flops for m in ms))
        else:
            inner = params.get("jaxpr", params.get("call_jaxpr"))
            if inner is not None and hasattr(getattr(inner, "jaxpr", inner), "eqns"):
                found += _matmuls(inner, trips)
    return found


def _times(found: list[Matmul], k: int) -> list[Matmul]:
    return [Matmul(m.eqn, m.runs * k) for m in found]


def dot_flops(jaxpr, *, while_trips: int | Sequence[int] = 1) -> int:
    """Matmul FLOPs of a traced program: the sum of `Matmul.flops` over `matmuls(jaxpr)`.

    Why not XLA's `cost_analysis()`: XLA:CPU counts the body of a while loop once whatever its
    trip count, so a model whose layers run under `lax.scan` reports the FLOPs of one layer
    (checked in `tests/test_experiment_scripts.py`, where this count is also compared with
    XLA's on a program without loops).
    """
    return total_flops(matmuls(jaxpr, while_trips=while_trips))


def total_flops(found: dict[tuple, Matmul]) -> int:
    """FLOPs of all the runs in a `matmuls` result."""
    return sum(m.flops for m in found.values())


def minus(a: dict[tuple, Matmul], b: dict[tuple, Matmul]) -> dict[tuple, Matmul]:
    """The matmul runs of `a` that are not in `b` (e.g. the decode loop's: a full `generate`
    minus a one-token one); `b` must be contained in `a`."""
    out = {}
    for key, m in a.items():
        runs = m.runs - (b[key].runs if key in b else 0)
        if runs < 0:
            raise ValueError(f"minus: b runs a matmul more often than a: {key}")
        if runs:
            out[key] = Matmul(m.eqn, runs)
    return out


def time_matmul(m: Matmul, repeats: int = 5) -> list[float]:
    """Wall seconds of running `m`'s matmul `m.runs` times in one compiled loop, alone, on
    random operands of its shapes: `repeats` timings after a first (compiling) call.

    Each iteration scales the smaller operand by a carried scalar that depends on the last
    product (always 1.0 in value), so XLA can neither hoist the product out of the loop nor
    skip a run; the extra work is one pass over that operand and one over the product. The
    operands stay in cache between runs, which a real program's interleaved ops may evict:
    the time estimates a floor for these matmuls with this backend's own kernels (not a
    strict one: a real program may run independent matmuls side by side).
    """
    import jax

    run, operands = matmul_loop(m)
    jax.block_until_ready(run(*operands))
    return wall_times(lambda: run(*operands), repeats)


def wall_times(fn, calls: int) -> list[float]:
    """Wall seconds of each of `calls` calls of `fn()`, blocked on its result."""
    import jax

    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return times


def compiled_grpo_step(graphdef, tx, config, state, batch):
    """`grpo_update` for `config` compiled for `state` and `batch`, the state donated."""
    import functools

    import jax

    from grpojax.train import grpo_update

    fn = functools.partial(grpo_update, graphdef=graphdef, tx=tx, config=config)
    return jax.jit(fn, donate_argnums=0).lower(state, batch).compile()


def median_step_time(compiled, state, batch, repeats: int) -> float:
    """Median wall seconds of `repeats` steps of `compiled` on `batch` after one to warm
    (the state threaded through, donated)."""
    import jax

    holder = {"state": state}

    def one():
        holder["state"], metrics = compiled(holder["state"], batch)
        return metrics

    jax.block_until_ready(one())  # warm
    return statistics.median(wall_times(one, repeats))


def matmul_loop(m: Matmul):
    """`(run, operands)` of `time_matmul`: `run(*operands)` is the sum of all the entries of
    `m.runs` products (each the same product, the scale being 1.0)."""
    import jax
    import jax.numpy as jnp

    avals = [v.aval for v in m.eqn.invars]
    small = 0 if avals[0].size <= avals[1].size else 1
    keys = jax.random.split(jax.random.key(0), 2)
    operands = [
        jax.random.normal(k, a.shape, a.dtype)
        if jnp.issubdtype(a.dtype, jnp.floating)
        else jnp.ones(a.shape, a.dtype)
        for k, a in zip(keys, avals)
    ]

    @jax.jit
    def run(*operands):
        def body(_, carry):
            scale, total = carry
            ops = list(operands)
            ops[small] = ops[small] * scale.astype(ops[small].dtype)
            total = total + jnp.sum(m.eqn.primitive.bind(*ops, **m.eqn.params), dtype=jnp.float32)
            return 1.0 + 1e-30 * total, total

        init = (jnp.float32(1.0), jnp.float32(0.0))
        return jax.lax.fori_loop(0, m.runs, body, init, unroll=min(m.runs, 4))[1]

    return run, operands


def matmul_floor(found: dict[tuple, Matmul], repeats: int = 5, stat=statistics.median):
    """Seconds a program's matmuls take alone (`time_matmul` of each, `stat` of its
    repeats, summed), and the rows `(Matmul, seconds)` slowest first."""
    rows = sorted(((m, stat(time_matmul(m, repeats))) for m in found.values()), key=lambda r: -r[1])
    return sum(s for _, s in rows), rows


def describe(m: Matmul) -> str:
    """'[32,256] x [256,512] -> [32,512] float32': a matmul's operand and output shapes."""
    lhs, rhs = (v.aval for v in m.eqn.invars)
    out = m.eqn.outvars[0].aval

    def shape(a):
        return "[" + ",".join(map(str, a.shape)) + "]"

    return f"{shape(lhs)} x {shape(rhs)} -> {shape(out)} {out.dtype}"


def generate_call(fn):
    """(the compiled entry point, its arguments) of the program a `generate` call `fn()`
    runs: `fn` is called once and the arguments `generate` prepared are kept."""
    module = sys.modules["grpojax.sampling.generate"]
    real, calls = module._generate_jit, []

    def keep_args(*args):
        calls.append(args)
        return real(*args)

    module._generate_jit = keep_args
    try:
        fn()
    finally:
        module._generate_jit = real
    return real, calls[0]


def generate_jaxpr(fn):
    """The jaxpr of the program a `generate` call `fn()` runs."""
    jitted, args = generate_call(fn)
    return jitted.trace(*args).jaxpr


def generate_hlo(fn) -> str:
    """The optimised HLO text of the program a `generate` call `fn()` runs (the names of its
    ops in a profiler trace)."""
    jitted, args = generate_call(fn)
    return jitted.lower(*args).compile().as_text()


def decode_trips(t: int) -> list[int]:
    """Steps each of `generate`'s decode loops runs for t new tokens when no row stops (its
    default `decode_loops`; `grpojax.sampling.generate.decode_plan`)."""
    import itertools

    from grpojax.sampling.generate import DECODE_LOOPS, decode_plan

    ends = [1] + [end for _, end in decode_plan(t, DECODE_LOOPS)]
    return [b - a for a, b in itertools.pairwise(ends)]
