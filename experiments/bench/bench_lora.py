"""LoRA GRPO step against the full-parameter GRPO step: peak memory and step time.

Memory, at the Qwen2.5-0.5B shape (`plan_memory.ARCHS["0.5b"]`: bf16 compute, float32
masters, full remat, AdamW), with no weights: the model and train state exist only as
abstract shapes (`jax.eval_shape`), the step is `make_grpo_step` as the driver builds it on
a one-device mesh, and XLA's `memory_analysis()` of the compiled step gives
peak = args + out - alias + temp (the buffers live while the step runs).

- full: every parameter trained: float32 params + AdamW moments, and the reference policy's
  copy in the state (bf16, `create_train_state(with_ref=True)`'s default).
- lora: adapters of rank `--rank` on q k v o gate up down; the state holds the base weights
  (frozen, stored in the compute dtype, bf16: `create_train_state`'s `base_dtype`), the
  float32 adapters and their AdamW moments; no reference copy (the reference is the base
  with adapters off).

Both compile the same batch (`--prompts` x `--group` sequences of `--prompt-len` +
`--completion-len` tokens, old and reference logprobs supplied, as the driver's
trainer-side pass does for full fine-tuning), so the difference is the state, the gradients
and the optimizer update. Caveat: these are the CPU compiler's buffer assignments; a GPU/TPU
compile fuses differently (temp bytes indicative to tens of percent; args/out exact).

Step time, measured for real at the built-in tiny model's shape (float32, one CPU device):
the median of `--steps` jitted GRPO steps after one warm-up, same batch for both.

Usage: `python experiments/bench/bench_lora.py [--rank 16] [--quick]`. Last line:
`bench_lora: lora_peak_mb=<a> full_peak_mb=<b> mem_ratio=<a/b> lora_step_s=<c> full_step_s=<d>`.
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchlib import machine
from plan_memory import ARCHS, model_config

MB = 1e6


def _grpo_batch(n, p, t, *, abstract: bool, vocab: int = 100, seed: int = 0):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from grpojax.train.grpo import GRPOBatch

    if abstract:
        sds = jax.ShapeDtypeStruct
        return GRPOBatch(
            tokens_ns=sds((n, p + t), jnp.int32),
            mask_ns=sds((n, p + t), jnp.bool_),
            completion_mask_nt=sds((n, t), jnp.bool_),
            old_logp_nt=sds((n, t), jnp.float32),
            ref_logp_nt=sds((n, t), jnp.float32),
            rewards_n=sds((n,), jnp.float32),
        )
    rng = np.random.default_rng(seed)
    return GRPOBatch(
        tokens_ns=jnp.asarray(rng.integers(3, vocab, (n, p + t)), jnp.int32),
        mask_ns=jnp.ones((n, p + t), bool),
        completion_mask_nt=jnp.ones((n, t), bool),
        old_logp_nt=jnp.asarray(rng.normal(-4.6, 0.3, (n, t)), jnp.float32),
        ref_logp_nt=jnp.asarray(rng.normal(-4.6, 0.3, (n, t)), jnp.float32),
        rewards_n=jnp.asarray(rng.integers(0, 2, n), jnp.float32),
    )


def _build(cfg, tx, rank: int | None, alpha: float):
    """(model, train state) of the full (rank None) or LoRA model."""
    import jax
    from flax import nnx

    from grpojax.models import Decoder, LoRAConfig, add_lora
    from grpojax.train.state import create_train_state

    model = Decoder(cfg, rngs=nnx.Rngs(0))
    if rank is not None:
        add_lora(model, LoRAConfig(rank=rank, alpha=alpha), rngs=nnx.Rngs(1))
    return model, create_train_state(model, tx, rng=jax.random.key(0), with_ref=True)[1]


def _step(cfg, tx, config, state, batch, graphdef):
    from grpojax.models import make_mesh
    from grpojax.train.grpo import make_grpo_step
    from grpojax.train.state import train_state_shardings

    mesh = make_mesh(devices=__import__("jax").devices()[:1])
    shardings = train_state_shardings(state, tx, mesh)
    return (
        mesh,
        shardings,
        make_grpo_step(graphdef, tx, config, mesh=mesh, state_shardings=shardings, batch=batch),
    )


def peak_bytes(args, rank: int | None) -> dict:
    """XLA's per-device peak of the compiled 0.5B-shape GRPO step (abstract, no weights)."""
    import jax
    from flax import nnx

    from grpojax.train import batch_shardings
    from grpojax.train.config import GRPOConfig
    from grpojax.train.state import OptimizerConfig, make_optimizer

    cfg = model_config(ARCHS["0.5b"])
    tx = make_optimizer(OptimizerConfig(learning_rate=1e-6, weight_decay=0.01))
    config = GRPOConfig(
        group_size=args.group, beta=0.04, num_minibatches=1, num_microbatches=args.microbatches
    )
    model = nnx.eval_shape(lambda: _build(cfg, tx, rank, args.alpha)[0])
    graphdef = nnx.split(model)[0]
    state = jax.eval_shape(lambda: _build(cfg, tx, rank, args.alpha)[1])
    batch = _grpo_batch(
        args.prompts * args.group, args.prompt_len, args.completion_len, abstract=True
    )
    mesh, shardings, step = _step(cfg, tx, config, state, batch, graphdef)
    bsh = batch_shardings(batch, mesh)
    sds = lambda tree, sh: jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, sh
    )
    t0 = time.perf_counter()
    with jax.set_mesh(mesh):
        compiled = step.jitted.lower(sds(state, shardings), sds(batch, bsh)).compile()
    mem = compiled.memory_analysis()
    peak = (
        mem.argument_size_in_bytes
        + mem.output_size_in_bytes
        - mem.alias_size_in_bytes
        + mem.temp_size_in_bytes
    )
    trainable = state.params if rank is None else None
    if rank is not None:
        from grpojax.train.state import trainable_split

        trainable = trainable_split(state.params)[0]
    return dict(
        peak=peak,
        args=mem.argument_size_in_bytes,
        temp=mem.temp_size_in_bytes,
        trainable=sum(x.size for x in jax.tree.leaves(trainable)),
        compile_s=time.perf_counter() - t0,
    )


def step_seconds(args, rank: int | None) -> float:
    """Median wall time of a real jitted GRPO step at the tiny model's shape."""
    import jax

    from grpojax.models import tiny_config
    from grpojax.train.config import GRPOConfig
    from grpojax.train.state import OptimizerConfig, make_optimizer

    cfg = tiny_config()
    tx = make_optimizer(OptimizerConfig(learning_rate=1e-4))
    config = GRPOConfig(group_size=4, beta=0.04)
    model, state = _build(cfg, tx, rank, args.alpha)
    graphdef = __import__("flax").nnx.split(model)[0]
    batch = _grpo_batch(16, 16, 32, abstract=False, vocab=cfg.vocab_size)
    mesh, _, step = _step(cfg, tx, config, state, batch, graphdef)
    from grpojax.train.state import shard_train_state

    state, _ = shard_train_state(state, tx, mesh)
    state, m = step(state, batch)  # compile + warm up
    jax.block_until_ready(m["loss"])
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        state, m = step(state, batch)
        jax.block_until_ready(m["loss"])
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def sampler_seconds(args) -> dict:
    """The sampler at the tiny shape: `generate` with adapters applied unmerged, against a
    model whose weights were merged (no adapter matmuls) plus the on-device merge a step
    would pay to sample from merged weights (W + (alpha/r) A B for the 7 targets, jitted).
    Best of `--steps` calls each (after a warm-up)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from grpojax.models import LoRAConfig, add_lora, merge_adapters, tiny_config
    from grpojax.models.decoder import Decoder
    from grpojax.models.lora import TARGETS
    from grpojax.sampling import SamplingConfig, generate

    cfg = tiny_config()
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    add_lora(model, LoRAConfig(rank=args.rank, alpha=args.alpha), rngs=nnx.Rngs(1))
    rng = np.random.default_rng(0)
    for name in model.lora.names():
        var = getattr(model.lora, name)
        var.set_value(jnp.asarray(0.01 * rng.standard_normal(var.shape), jnp.float32))
    merged = merge_adapters(model)
    b, width, g, t_new = 8, 16, 4, 32
    prompts = np.asarray(rng.integers(3, cfg.vocab_size, (b, width)), np.int32)
    lengths = np.full((b,), width, np.int32)

    def best(fn):
        jax.block_until_ready(fn(0))
        times = []
        for i in range(args.steps):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(i + 1))
            times.append(time.perf_counter() - t0)
        return min(times)

    def gen(m):
        return lambda i: generate(
            m, prompts, lengths, key=jax.random.key(i), max_new_tokens=t_new, group_size=g,
            sampling=SamplingConfig(temperature=1.0),
        ).tokens_nt  # fmt: skip

    scale = model.lora.lora_config.scale

    @jax.jit
    def merge(layers, adapters):
        out = {}
        for t, target in TARGETS.items():
            w, a, bm = layers[target.base], adapters[f"{t}_a"], adapters[f"{t}_b"]
            L, r = a.shape[0], a.shape[-1]
            d = jnp.matmul(a.reshape(L, -1, r), bm.reshape(L, r, -1)).reshape(w.shape)
            out[target.base] = w + scale * d
        return out

    layers = {t.base: getattr(model.layers, t.base)[...] for t in TARGETS.values()}
    adapters = {n: getattr(model.lora, n)[...] for n in model.lora.names()}
    return dict(
        unmerged=best(gen(model)),
        merged=best(gen(merged)),
        merge=best(lambda i: merge(layers, adapters)),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--completion-len", type=int, default=384)
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="a smaller 0.5B-shape batch, 3 steps")
    args = p.parse_args()
    if args.quick:
        args.prompts, args.prompt_len, args.completion_len, args.steps = 2, 32, 64, 3

    print(f"machine: {machine()}")
    n = args.prompts * args.group
    print(
        f"0.5B shape (bf16 compute, f32 masters, full remat), batch {n} x "
        f"({args.prompt_len} + {args.completion_len}) tokens, {args.microbatches} micro-batches"
    )
    full = peak_bytes(args, None)
    lora = peak_bytes(args, args.rank)
    for name, r in (("full", full), ("lora", lora)):
        print(
            f"  {name:4s}: peak {r['peak'] / MB:9.1f} MB (args {r['args'] / MB:.1f}, temp "
            f"{r['temp'] / MB:.1f}), trainable {r['trainable']:,}, compile {r['compile_s']:.0f} s"
        )
    full_s = step_seconds(args, None)
    lora_s = step_seconds(args, args.rank)
    print(
        f"tiny shape, real steps (median of {args.steps}): full {full_s:.3f} s, lora {lora_s:.3f} s"
    )
    samp = sampler_seconds(args)
    print(
        f"tiny shape, sampler (8 prompts x 4 x 32 new tokens, best of {args.steps}): adapters "
        f"unmerged {samp['unmerged']:.3f} s, merged weights {samp['merged']:.3f} s + merge "
        f"{samp['merge']:.4f} s"
    )
    print(
        f"bench_lora: lora_peak_mb={lora['peak'] / MB:.1f} full_peak_mb={full['peak'] / MB:.1f} "
        f"mem_ratio={lora['peak'] / full['peak']:.3f} lora_step_s={lora_s:.4f} "
        f"full_step_s={full_s:.4f}"
    )


if __name__ == "__main__":
    main()
