"""Memory plan: per-device bytes of the compiled GRPO and PPO steps at Qwen scale, with no
weights. The seeds' memory claim (GRPO drops the critic) checked at real sizes.

Each (size, layout, algorithm) is compiled ahead of time in its own subprocess on the
layout's fake CPU devices (`--xla_force_host_platform_device_count`, 8 or 16): the model
and the train state exist only as `jax.ShapeDtypeStruct`s with their `NamedSharding`s
(`jax.eval_shape`), the
step is `make_grpo_step` / `make_ppo_step` exactly as the driver builds it, and
`jit.lower(state, batch).compile().memory_analysis()` gives XLA's per-device bytes:

- args: the step's inputs (state + batch shard); out: its outputs; alias: outputs written
  into donated inputs (the state); temp: activations, gradients, optimizer temporaries;
  code: generated code.
- step peak = args + out - alias + temp (the buffers live while the step runs).
- resident = step peak + what the driver keeps on the device outside the step: PPO's frozen
  reference policy (`PPOTrainer.state.ref_params`); GRPO's reference is inside its state.

Setup (what the driver does for these algorithms): compute dtype bfloat16, float32 master
parameters and AdamW moments, full remat, chunked logprobs; the reference is a copy of the
policy's parameters, in the compute dtype inside GRPO's state (`create_train_state(
with_ref=True)`); PPO's `+ref` column counts `PPOTrainer`'s frozen copy at float32, twice
what the trainer keeps in bf16 (an overestimate left so that the recorded tables compare).
GRPO: policy + reference, beta=0.04 (k3), old and reference logprobs supplied by the
trainer-side pass, advantages computed in the step from rewards. PPO: policy + critic
(`critic="separate"`: a `ValueModel` on a full copy of the backbone, its own AdamW) +
reference. Both: 1 epoch, `--minibatches` x `--microbatches` per step.

The batch (global, the same for both layouts): `--prompts` prompts x `--group` samples of
`--prompt-len` + `--completion-len` tokens. The default, 64 x 8 x (256 + 768) = 512
sequences of 1,024 tokens, is 8 prompts x 8 samples x 1,024 tokens per device on fsdp 8:
G = 8 as in the GSM8K example config and DeepSeekMath, 768 new tokens for math reasoning,
and 4 mini-batches x 2 micro-batches (as `experiments/configs/qwen2_5_0_5b_gsm8k.yaml`) so one
forward/backward holds 8 rows x 1,024 tokens per data shard.

Caveat: these are the CPU compiler's buffer assignments. A GPU/TPU compile fuses and
schedules differently (and may keep bf16 where the CPU backend widens), so temp bytes are
indicative to within tens of percent; args/out (the state) are exact.

Mixtures of experts (`--sizes 30b-a3b`, Qwen3-30B-A3B: 128 experts, top 8): the CPU backend
has no grouped matmul, so JAX lowers `jax.lax.ragged_dot` there to a dense product over every
expert of an [E, M*k, D] masked copy of the tokens (GPU and TPU lower it to a ragged dot).
Its CPU temp bytes are that expansion's (GRPO on fsdp 8: 401 GB a device, measured
2026-11-27), not what an accelerator allocates, so the default sizes leave it out; its
parameter count and state bytes are exact.

Usage: `python experiments/bench/plan_memory.py [--sizes 0.5b,1.5b] [--layouts fsdp8,fsdp4_tp2]
[--quick]`. The last line is `plan_memory: <size>_grpo_gb=... <size>_ppo_gb=...
<size>_ratio=... fits80=...` (worst layout per size).

Long reasoning traces (`--long`): the GRPO step alone for Qwen2.5-1.5B, Qwen2.5-7B and
Qwen3-8B with completions of 4k, 16k and 32k tokens after 1,024-token prompts, every
completion at the budget (the most a packed or padded row can hold), attention "auto" (the
blockwise path at these lengths: memory linear in length). The batch is `--prompts` x
`--group` sequences, split into `--minibatches` x `--microbatches` so that each forward
holds `--prompts * --group / (minibatches * microbatches * data shards)` sequences per
device (1 by default). Each row says whether the step fits an 80 GB GPU (H100) and a 95 GB
TPU v5p chip, 10% headroom off both; `--remats` tries each policy. The last line is
`plan_memory_long: <size>_<T>_gb=... fits80=... fits95=...` (the first remat of `--remats`
that fits, per size and length). The `_cp` layouts split each sequence's tokens over the
context axis (`mesh.context`): with `--microbatches` raised so that a forward holds as
many sequences as the data shards (fsdp1_cp8: 1, fsdp2_cp8: 2), 64k and 128k completions
(`--lengths 65536,131072`) compile for 8 and 16 devices
(experiments/results/context_parallel_cpu).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
import time

GB = 1e9
DEVICE_GB = 80.0
TPU_V5P_GB = 95.0  # HBM per TPU v5p chip
LONG_SIZES = "1.5b,7b,8b"
LONG_LENGTHS = "4096,16384,32768"
# Headroom assumed off the 80 GB: the CUDA context, cuBLAS/cuDNN workspaces, NCCL buffers
# and allocator fragmentation (XLA's BFC allocator reserves ~75-90% by default), plus the
# sampler's bf16 copy and KV cache are separate programs whose buffers are freed between
# phases only if the driver lets them go. 10% is the usual planning margin.
HEADROOM = 0.10


@dataclasses.dataclass(frozen=True)
class Arch:
    """Published Hugging Face config numbers (config.json of each model)."""

    name: str
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    num_experts: int = 0  # a mixture of experts (Qwen3-MoE): E experts, top k, width F_e
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    # Gemma 3: every `full_every`-th layer full, the others through a `sliding_window`, with
    # their own RoPE base; the full layers' RoPE linearly scaled by `rope_linear_factor`.
    sliding_window: int | None = None
    full_every: int = 0
    rope_local_theta: float | None = None
    rope_linear_factor: float | None = None
    query_pre_attn_scalar: int | None = None


def _gemma3(name, hidden, inter, layers, heads, kv, vocab, window, factor):
    """Gemma 3's text model (its config.json's text_config): head_dim 256, tied, 5 sliding
    layers of every 6, local RoPE base 10,000, global 1e6."""
    return Arch(
        name,
        "gemma3_text",
        hidden,
        inter,
        layers,
        heads,
        kv,
        256,
        vocab,
        True,
        False,
        True,
        sliding_window=window,
        full_every=6,
        rope_local_theta=10_000.0,
        rope_linear_factor=factor,
        query_pre_attn_scalar=256,
    )


ARCHS = {
    "0.5b": Arch("Qwen2.5-0.5B", "qwen2", 896, 4864, 24, 14, 2, 64, 151936, True, True, False),
    "1.5b": Arch("Qwen2.5-1.5B", "qwen2", 1536, 8960, 28, 12, 2, 128, 151936, True, True, False),
    "7b": Arch("Qwen2.5-7B", "qwen2", 3584, 18944, 28, 28, 4, 128, 152064, False, True, False),
    "8b": Arch("Qwen3-8B", "qwen3", 4096, 12288, 36, 32, 8, 128, 151936, False, False, True),
    "30b-a3b": Arch(
        "Qwen3-30B-A3B",
        "qwen3_moe",
        2048,
        6144,
        48,
        32,
        4,
        128,
        151936,
        False,
        False,
        True,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
    ),
    "gemma3-1b": _gemma3("Gemma-3-1B", 1152, 6912, 26, 4, 1, 262144, 512, None),
    "gemma3-4b": _gemma3("Gemma-3-4B", 2560, 10240, 34, 8, 4, 262208, 1024, 8.0),
    "gemma3-12b": _gemma3("Gemma-3-12B", 3840, 15360, 48, 16, 8, 262208, 1024, 8.0),
}
LAYOUTS = {
    "fsdp8": dict(fsdp=8, tensor=1),
    "fsdp4_tp2": dict(fsdp=4, tensor=2),
    # context parallelism (`mesh.context`): each sequence's tokens over the context axis
    "fsdp4_cp2": dict(fsdp=4, context=2),
    "fsdp1_cp8": dict(fsdp=1, context=8),
    "fsdp2_cp8": dict(fsdp=2, context=8),  # 16 devices
    "fsdp1_cp16": dict(fsdp=1, context=16),  # 16 devices
}


def layout_devices(layout: str) -> int:
    """The devices a layout spans (the product of its mesh sizes)."""
    n = 1
    for size in LAYOUTS[layout].values():
        n *= size
    return n


def model_config(arch: Arch, remat: str = "full"):
    from grpojax.models import ModelConfig
    from grpojax.models.config import GEMMA_MODEL_TYPES, RopeScaling

    gemma = {}
    if arch.model_type in GEMMA_MODEL_TYPES:
        factor = arch.rope_linear_factor
        gemma = dict(
            hidden_act="gelu_pytorch_tanh",
            sliding_window=arch.sliding_window,
            layer_types=tuple(
                "full_attention" if (i + 1) % arch.full_every == 0 else "sliding_attention"
                for i in range(arch.num_layers)
            ),
            rope_local_theta=arch.rope_local_theta,
            rope_scaling=None if factor is None else RopeScaling(factor, rope_type="linear"),
            query_pre_attn_scalar=arch.query_pre_attn_scalar,
        )
    return ModelConfig(
        model_type=arch.model_type,
        vocab_size=arch.vocab_size,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_layers=arch.num_layers,
        num_heads=arch.num_heads,
        num_kv_heads=arch.num_kv_heads,
        head_dim=arch.head_dim,
        tie_word_embeddings=arch.tie_word_embeddings,
        qkv_bias=arch.qkv_bias,
        qk_norm=arch.qk_norm,
        rope_theta=arch.rope_theta,
        rms_norm_eps=arch.rms_norm_eps,
        dtype="bfloat16",
        param_dtype="float32",
        remat=remat,
        max_position_embeddings=32768,
        num_experts=arch.num_experts,
        num_experts_per_tok=arch.num_experts_per_tok,
        moe_intermediate_size=arch.moe_intermediate_size,
        norm_topk_prob=arch.norm_topk_prob,
        **gemma,
    )


def _sds(tree, shardings):
    """ShapeDtypeStructs of `tree` carrying `shardings` (a matching tree)."""
    import jax

    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


def _per_device_bytes(tree, shardings) -> int:
    """Bytes of one device's shards of an abstract `tree` placed with `shardings`."""
    import jax
    import numpy as np

    total = 0
    for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings), strict=True):
        total += int(np.prod(s.shard_shape(x.shape))) * x.dtype.itemsize
    return total


def _batch(args, with_rewards: bool):
    """Abstract rollout batch, [N, S] with N = prompts x group, S = P + T."""
    import jax
    import jax.numpy as jnp

    n, p, t = args.prompts * args.group, args.prompt_len, args.completion_len
    sds = jax.ShapeDtypeStruct
    common = dict(
        tokens_ns=sds((n, p + t), jnp.int32),
        mask_ns=sds((n, p + t), jnp.bool_),
        completion_mask_nt=sds((n, t), jnp.bool_),
    )
    if with_rewards:
        return common | dict(
            old_logp_nt=sds((n, t), jnp.float32),
            ref_logp_nt=sds((n, t), jnp.float32),
            rewards_n=sds((n,), jnp.float32),
            valid_n=sds((n,), jnp.bool_),
            lengths_n=sds((n,), jnp.int32),
        )
    return common | dict(scores_n=sds((n,), jnp.float32), ref_logp_nt=sds((n, t), jnp.float32))


def worker(args) -> dict:
    import jax
    from flax import nnx

    from grpojax.models import Decoder, make_mesh
    from grpojax.train import batch_shardings
    from grpojax.train.config import GRPOConfig, PPOConfig
    from grpojax.train.state import (
        OptimizerConfig,
        create_train_state,
        make_optimizer,
        param_sharding_tree,
        train_state_shardings,
    )

    assert len(jax.devices()) == layout_devices(args.layout), jax.devices()
    arch = ARCHS[args.size]
    cfg = dataclasses.replace(model_config(arch, args.remat), attention=args.attention)
    mesh = make_mesh(**LAYOUTS[args.layout])
    tx = make_optimizer(OptimizerConfig(learning_rate=1e-6, weight_decay=0.01))
    t0 = time.perf_counter()

    if args.worker == "grpo":
        from grpojax.train.grpo import GRPOBatch, make_grpo_step

        config = GRPOConfig(
            group_size=args.group,
            beta=0.04,
            aggregation="token-mean",
            clip_high=0.28,
            num_minibatches=args.minibatches,
            num_microbatches=args.microbatches,
        )

        def build():
            model = Decoder(cfg, rngs=nnx.Rngs(0))
            return create_train_state(model, tx, rng=jax.random.key(0), with_ref=True)[1]

        graphdef = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))[0]
        state = jax.eval_shape(build)
        shardings = train_state_shardings(state, tx, mesh)
        batch = GRPOBatch(**_batch(args, with_rewards=True))
        bsh = batch_shardings(batch, mesh)
        step = make_grpo_step(
            graphdef, tx, config, mesh=mesh, state_shardings=shardings, batch=batch
        )
        param_bytes = _per_device_bytes(state.params, shardings.params)
        outside = 0  # the reference lives in the state
        trainable = sum(x.size for x in jax.tree.leaves(state.params))
    else:
        from grpojax.train.ppo import (
            PPOBatch,
            PPOGraphs,
            create_ppo_state,
            init_critic,
            make_ppo_step,
            ppo_state_shardings,
        )

        config = PPOConfig(
            critic="separate",
            num_epochs=1,
            num_minibatches=args.minibatches,
            num_microbatches=args.microbatches,
        )

        def build_modules():
            actor = Decoder(cfg, rngs=nnx.Rngs(0))
            critic = init_critic(actor, mode="separate", rngs=nnx.Rngs(1))
            return actor, critic

        def build():
            actor, critic = build_modules()
            return create_ppo_state(actor, critic, tx, tx, config=config, rng=jax.random.key(0))[1]

        actor, critic = nnx.eval_shape(build_modules)
        graphs = PPOGraphs(nnx.split(actor)[0], nnx.split(critic)[0])
        state = jax.eval_shape(build)
        shardings = ppo_state_shardings(state, tx, tx, mesh)
        batch = PPOBatch(**_batch(args, with_rewards=False))
        bsh = batch_shardings(batch, mesh)
        # make_ppo_step derives the same shardings from `state` (abstract is enough).
        step = make_ppo_step(config, graphs, tx, tx, mesh=mesh, state=state, batch=batch)
        param_bytes = _per_device_bytes(state.actor.params, shardings.actor.params)
        # PPOTrainer keeps a frozen copy of the actor's parameters beside the step's state.
        outside = _per_device_bytes(
            state.actor.params, param_sharding_tree(state.actor.params, mesh)
        )
        trainable = sum(x.size for x in jax.tree.leaves((state.actor.params, state.critic.params)))

    trace_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    with jax.set_mesh(mesh):
        lowered = step.jitted.lower(_sds(state, shardings), _sds(batch, bsh))
    lower_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = lowered.compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    peak = (
        mem.argument_size_in_bytes
        + mem.output_size_in_bytes
        - mem.alias_size_in_bytes
        + mem.temp_size_in_bytes
    )
    return dict(
        size=args.size,
        layout=args.layout,
        algo=args.worker,
        trainable=int(trainable),
        policy_params=int(cfg.num_params()),
        policy_param_bytes=param_bytes,
        args=mem.argument_size_in_bytes,
        out=mem.output_size_in_bytes,
        alias=mem.alias_size_in_bytes,
        temp=mem.temp_size_in_bytes,
        code=mem.generated_code_size_in_bytes,
        peak=peak,
        outside=outside,
        resident=peak + outside,
        trace_s=trace_s,
        lower_s=lower_s,
        compile_s=compile_s,
        rss_peak_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    )


def _run_worker(size, layout, algo, argv, timeout) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "")
        + f" --xla_force_host_platform_device_count={layout_devices(layout)}"
    ).strip()
    env["JAX_PLATFORMS"] = "cpu"
    cmd = [sys.executable, __file__, "--worker", algo, "--size", size, "--layout", layout, *argv]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return dict(size=size, layout=layout, algo=algo, error=f"timeout after {timeout}s")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = proc.stderr.strip().splitlines()[-3:]
        return dict(size=size, layout=layout, algo=algo, error=f"rc={proc.returncode}: {tail}")
    return json.loads(lines[-1][len("RESULT ") :])


def _arch_table(sizes) -> None:
    from grpojax.models import ModelConfig  # noqa: F401  (num_params below)

    print(
        f"{'model':<13} {'D':>5} {'F':>6} {'L':>3} {'Q':>3} {'K':>2} {'H':>4} {'V':>7} "
        f"{'tied':>5} {'qkv_b':>5} {'qk_n':>5} {'params':>7}"
    )
    for s in sizes:
        a = ARCHS[s]
        n = model_config(a).num_params()
        print(
            f"{a.name:<13} {a.hidden_size:>5} {a.intermediate_size:>6} {a.num_layers:>3} "
            f"{a.num_heads:>3} {a.num_kv_heads:>2} {a.head_dim:>4} {a.vocab_size:>7} "
            f"{a.tie_word_embeddings!s:>5} {a.qkv_bias!s:>5} {a.qk_norm!s:>5} {n / 1e9:>6.2f}B"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=None, help=f"subset of {list(ARCHS)} (default: all)")
    parser.add_argument("--layouts", default="fsdp8,fsdp4_tp2", help=f"subset of {list(LAYOUTS)}")
    parser.add_argument(
        "--prompts", type=int, default=None, help="B prompts per step (global; 64, --long 16)"
    )
    parser.add_argument("--group", type=int, default=8, help="G samples per prompt")
    parser.add_argument(
        "--prompt-len", type=int, default=None, help="P prompt tokens (256, --long 1024)"
    )
    parser.add_argument("--completion-len", type=int, default=768, help="T new tokens")
    parser.add_argument("--minibatches", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=None, help="2, --long 4")
    parser.add_argument("--remat", default="full")
    parser.add_argument("--attention", default="auto", help="model.attention")
    parser.add_argument(
        "--long",
        action="store_true",
        help="long traces: GRPO, sizes 1.5b,7b,8b x completions 4k,16k,32k (see the docstring)",
    )
    parser.add_argument("--lengths", default=LONG_LENGTHS, help="--long's completion lengths")
    parser.add_argument("--remats", default="full", help="--long's remat policies to try")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per compile")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="fast check: 0.5B, fsdp 8, 16 prompts x 8 x (64 + 64) tokens",
    )
    parser.add_argument("--worker", choices=("grpo", "ppo"), help=argparse.SUPPRESS)
    parser.add_argument("--size", help=argparse.SUPPRESS)
    parser.add_argument("--layout", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return

    if args.long:
        args.sizes = args.sizes or LONG_SIZES
        args.prompts = args.prompts or 16
        args.prompt_len = args.prompt_len or 1024
        args.microbatches = args.microbatches or 4
        long_main(args)
        return
    # Mixtures of experts only when asked for: see the docstring's caveat.
    args.sizes = args.sizes or ",".join(k for k, a in ARCHS.items() if not a.num_experts)
    args.prompts = args.prompts or 64
    args.prompt_len = args.prompt_len or 256
    args.microbatches = args.microbatches or 2
    if args.quick:
        args.sizes, args.layouts = "0.5b", "fsdp8"
        args.prompts, args.prompt_len, args.completion_len = 16, 64, 64
    sizes = [s for s in args.sizes.split(",") if s]
    layouts = [s for s in args.layouts.split(",") if s]
    for s in sizes:
        if s not in ARCHS:
            sys.exit(f"unknown size {s!r}; known: {list(ARCHS)}")
    for s in layouts:
        if s not in LAYOUTS:
            sys.exit(f"unknown layout {s!r}; known: {list(LAYOUTS)}")
    passthrough = [
        f"--prompts={args.prompts}",
        f"--group={args.group}",
        f"--prompt-len={args.prompt_len}",
        f"--completion-len={args.completion_len}",
        f"--minibatches={args.minibatches}",
        f"--microbatches={args.microbatches}",
        f"--remat={args.remat}",
        f"--attention={args.attention}",
    ]

    from benchlib import machine

    results = []
    for size in sizes:  # smallest first: a failure at 0.5B stops nothing but costs least
        for layout in layouts:
            for algo in ("grpo", "ppo"):
                t0 = time.perf_counter()
                r = _run_worker(size, layout, algo, passthrough, args.timeout)
                r["wall_s"] = time.perf_counter() - t0
                results.append(r)
                status = r.get("error") or f"peak {r['peak'] / GB:.2f} GB/device"
                print(f"  [{size} {layout} {algo}] {r['wall_s']:.0f}s: {status}", flush=True)

    n = args.prompts * args.group
    s = args.prompt_len + args.completion_len
    devices = "/".join(str(n) for n in sorted({layout_devices(x) for x in layouts}))
    print(f"machine: {machine()}, {devices} fake CPU devices (XLA CPU compiler, AOT, no weights)")
    print(
        f"batch: {args.prompts} prompts x {args.group} samples x ({args.prompt_len} + "
        f"{args.completion_len}) tokens = {n} x {s} global; {args.minibatches} mini-batches x "
        f"{args.microbatches} micro-batches, 1 epoch; bf16 compute, f32 params + AdamW, "
        f"remat={args.remat}"
    )
    _arch_table(sizes)
    budget = DEVICE_GB * (1 - HEADROOM)
    print(
        f"per-device GB (1e9 bytes); fits = resident <= {budget:.0f} GB "
        f"({DEVICE_GB:.0f} GB less {HEADROOM:.0%} headroom)"
    )
    header = (
        f"{'size':<5} {'layout':<9} {'algo':<4} {'trainable':>9} {'args':>6} {'out':>6} "
        f"{'alias':>6} {'temp':>6} {'code_MB':>7} {'peak':>6} {'+ref':>5} {'resident':>8} "
        f"{'fits':>4} {'compile_s':>9} {'rss_MB':>7}"
    )
    print(header)
    for r in results:
        if "error" in r:
            print(f"{r['size']:<5} {r['layout']:<9} {r['algo']:<4} FAILED: {r['error']}")
            continue
        fits = "yes" if r["resident"] / GB <= budget else "NO"
        print(
            f"{r['size']:<5} {r['layout']:<9} {r['algo']:<4} {r['trainable'] / 1e9:>8.2f}B "
            f"{r['args'] / GB:>6.2f} {r['out'] / GB:>6.2f} {r['alias'] / GB:>6.2f} "
            f"{r['temp'] / GB:>6.2f} {r['code'] / 2**20:>7.1f} {r['peak'] / GB:>6.2f} "
            f"{r['outside'] / GB:>5.2f} {r['resident'] / GB:>8.2f} {fits:>4} "
            f"{r['compile_s']:>9.1f} {r['rss_peak_mb']:>7.0f}"
        )
    print(
        "peak = args + out - alias + temp (XLA memory_analysis); +ref = PPO's frozen "
        "reference kept beside the step; resident = peak + ref"
    )

    summary, fits_all = [], []
    ratios = []
    for size in sizes:
        ok = {
            (r["layout"], r["algo"]): r for r in results if r["size"] == size and "error" not in r
        }
        per_layout = []
        for layout in layouts:
            g, p = ok.get((layout, "grpo")), ok.get((layout, "ppo"))
            if g and p:
                per_layout.append((layout, g, p, g["resident"] / p["resident"]))
        if not per_layout:
            continue
        print(
            f"{size}: GRPO/PPO resident ratio "
            + ", ".join(f"{lay} {ratio:.3f}" for lay, _, _, ratio in per_layout)
        )
        worst_g = max(g["resident"] for _, g, _, _ in per_layout) / GB
        worst_p = max(p["resident"] for _, _, p, _ in per_layout) / GB
        ratio = max(r for *_, r in per_layout)
        ratios.append(ratio)
        fits_all.append(
            f"{size}:{'grpo' if worst_g <= budget else '-'}{'+ppo' if worst_p <= budget else ''}"
        )
        summary += [
            f"{size}_grpo_gb={worst_g:.2f}",
            f"{size}_ppo_gb={worst_p:.2f}",
            f"{size}_ratio={ratio:.3f}",
        ]
    failed = sum("error" in r for r in results)
    print(
        "plan_memory: "
        + " ".join(summary)
        + f" fits80={','.join(fits_all) or 'none'} failed={failed}"
    )


def long_main(args) -> None:
    """`--long`: the GRPO step at long completion lengths (module docstring)."""
    from benchlib import machine

    sizes = [x for x in args.sizes.split(",") if x]
    lengths = [int(x) for x in args.lengths.split(",")]
    layouts = [x for x in args.layouts.split(",") if x]
    remats = [x for x in args.remats.split(",") if x]
    prompt_len = args.prompt_len
    rows_per_forward = args.prompts * args.group / (args.minibatches * args.microbatches)
    results = []
    for size in sizes:
        for t in lengths:
            for layout in layouts:
                for remat in remats:
                    argv = [
                        f"--prompts={args.prompts}",
                        f"--group={args.group}",
                        f"--prompt-len={prompt_len}",
                        f"--completion-len={t}",
                        f"--minibatches={args.minibatches}",
                        f"--microbatches={args.microbatches}",
                        f"--remat={remat}",
                        f"--attention={args.attention}",
                    ]
                    t0 = time.perf_counter()
                    r = _run_worker(size, layout, "grpo", argv, args.timeout)
                    r.update(T=t, remat=remat, wall_s=time.perf_counter() - t0)
                    results.append(r)
                    status = r.get("error") or f"peak {r['peak'] / GB:.2f} GB/device"
                    print(f"  [{size} T={t} {layout} {remat}] {r['wall_s']:.0f}s: {status}")

    devices = "/".join(str(n) for n in sorted({layout_devices(x) for x in layouts}))
    print(f"machine: {machine()}, {devices} fake CPU devices (XLA CPU compiler, AOT, no weights)")
    print(
        f"GRPO step: {args.prompts} prompts x {args.group} samples x ({prompt_len} + T) tokens, "
        f"{args.minibatches} mini-batches x {args.microbatches} micro-batches "
        f"({rows_per_forward:g} sequences per forward, over the data shards), 1 epoch; bf16 "
        f"compute, f32 params + AdamW, reference in the state, attention={args.attention}"
    )
    _arch_table(sizes)
    b80, b95 = DEVICE_GB * (1 - HEADROOM), TPU_V5P_GB * (1 - HEADROOM)
    print(f"per-device GB (1e9 bytes); fits80: <= {b80:.0f} GB, fits95: <= {b95:.1f} GB")
    print(
        f"{'size':<5} {'T':>6} {'layout':<9} {'remat':<13} {'args':>6} {'temp':>6} "
        f"{'peak':>6} {'fits80':>6} {'fits95':>6} {'compile_s':>9}"
    )
    for r in results:
        head = f"{r['size']:<5} {r['T']:>6} {r['layout']:<9} {r['remat']:<13}"
        if "error" in r:
            print(f"{head} FAILED: {r['error']}")
            continue
        peak = r["peak"] / GB
        print(
            f"{head} {r['args'] / GB:>6.2f} {r['temp'] / GB:>6.2f} {peak:>6.2f} "
            f"{'yes' if peak <= b80 else 'NO':>6} {'yes' if peak <= b95 else 'NO':>6} "
            f"{r['compile_s']:>9.1f}"
        )
    summary, fit80, fit95 = [], [], []
    for size in sizes:
        for t in lengths:
            ok = [r for r in results if r["size"] == size and r["T"] == t and "error" not in r]
            if not ok:
                continue
            best = min(ok, key=lambda r: r["peak"])
            summary.append(f"{size}_{t}_gb={best['peak'] / GB:.2f}")
            if best["peak"] / GB <= b80:
                fit80.append(f"{size}:{t}:{best['layout']}:{best['remat']}")
            if best["peak"] / GB <= b95:
                fit95.append(f"{size}:{t}:{best['layout']}:{best['remat']}")
    print(
        "plan_memory_long: "
        + " ".join(summary)
        + f" fits80={','.join(fit80) or 'none'} fits95={','.join(fit95) or 'none'}"
    )


if __name__ == "__main__":
    main()
