"""Benchmark: grpojax's jitted sampler vs Hugging Face `transformers` generate (PyTorch).

Both sides load the same random Qwen2 checkpoint, built here into a temp dir (`--arch`):
`tiny`, the TRL workload's model (vocab 512, D 256, intermediate 688, 4 layers, 4 heads,
2 kv heads, tied embeddings, float32), or `0.5b`, the Qwen2.5-0.5B shape (vocab 151,936,
D 896, 24 layers, 14 heads, 2 kv heads, weights and compute in bfloat16 on both sides). They
sample the same 4 prompts x 8 samples x 32 new tokens at temperature 1 with no truncation
and no EOS stop (all 32 tokens forced on both sides). JAX runs on its default backend and
torch on CUDA when it has it, else on the CPU; float32 matmuls are exact on both (no TF32).
grpojax's compile time is reported separately and not counted. Also: the same with 256-token
prompts, where grpojax's shared prefill keeps one KV cache per prompt (B*P + N*T slots) and the
per-sample prefill one per row (N*(P+T)), with the bytes of each program's buffers (XLA's
memory analysis: KV cache, activations and other temporaries); and the max difference between
the sampler's logprobs and the trainer's recompute (full forward + `token_logprobs`). And a
bound: the time grpojax's sampler matmuls take alone (`benchlib.matmul_floor`: each distinct
matmul run as often as a call runs it, in a loop of its own), and the speedup over
`transformers.generate` the sampler would reach if nothing else took time.

    .venv/bin/python experiments/bench/bench_sampler.py [--arch tiny|0.5b] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from benchlib import (
    TINY_QWEN2,
    build_qwen2,
    decode_trips,
    exact_float32_matmuls,
    generate_jaxpr,
    machine,
    matmul_floor,
    matmuls,
)
from flax import nnx

from grpojax.models import from_pretrained
from grpojax.ops.logprobs import token_logprobs
from grpojax.sampling import SamplingConfig, generate

TORCH_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

B, G, T_NEW, VOCAB = 4, 8, 32, 512
PROMPT_LENGTHS = (11, 16, 7, 13)


def make_prompts(lengths, width: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    prompts = np.zeros((len(lengths), width), np.int32)
    for b, n in enumerate(lengths):
        prompts[b, width - n :] = rng.integers(3, VOCAB, size=n)
    return prompts, np.asarray(lengths, np.int32)


def sample(model, prompts, lengths, i: int, **kw):
    return generate(
        model,
        prompts,
        lengths,
        key=jax.random.key(i),
        max_new_tokens=T_NEW,
        group_size=G,
        sampling=SamplingConfig(temperature=1.0),
        **kw,
    )


def temp_bytes(model, prompts, lengths, **kw) -> int:
    """Bytes of the generate program's buffers besides its inputs and outputs."""
    lowered = sample(model, prompts, lengths, 0, lower=True, **kw)
    return int(lowered.compile().memory_analysis().temp_size_in_bytes)


def time_grpojax(model, prompts, lengths, repeats: int, **kw) -> tuple[float, float, object]:
    """(compile seconds, best steady-state seconds per call, last rollout)."""
    call = lambda i: sample(model, prompts, lengths, i, **kw)
    t0 = time.perf_counter()
    r = jax.block_until_ready(call(0))
    first = time.perf_counter() - t0
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        r = jax.block_until_ready(call(i + 1))
        times.append(time.perf_counter() - t0)
    best = min(times)
    return max(first - best, 0.0), best, r


def time_hf(hf, prompts, lengths, repeats: int) -> float:
    ids = torch.tensor(prompts, dtype=torch.long, device=TORCH_DEVICE)
    attn = torch.tensor(
        np.arange(prompts.shape[1])[None] >= (prompts.shape[1] - lengths)[:, None],
        device=TORCH_DEVICE,
    )
    kw = dict(
        attention_mask=attn.long(),
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        num_return_sequences=G,
        max_new_tokens=T_NEW,
        min_new_tokens=T_NEW,
        eos_token_id=None,
        pad_token_id=0,
    )
    with torch.no_grad():
        out = hf.generate(ids, **kw)  # warm-up
        assert out.shape == (B * G, prompts.shape[1] + T_NEW), out.shape
        times = []
        for i in range(repeats):
            torch.manual_seed(i)
            if TORCH_DEVICE == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            hf.generate(ids, **kw)
            if TORCH_DEVICE == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    return min(times)


def max_logp_diff(model, rollout) -> float:
    tokens, mask, positions = rollout.sequences()
    p = rollout.prompt_tokens_bp.shape[1]
    graphdef, state = nnx.split(model)

    @jax.jit
    def recompute(state, tokens, mask, positions, completion):
        m = nnx.merge(graphdef, state)
        hidden, _ = m(tokens, positions_nt=positions, mask_nt=mask)
        return token_logprobs(m.logits(hidden)[:, p - 1 : -1], completion)

    trainer = recompute(state, tokens, mask, positions, rollout.tokens_nt)
    return float(jnp.max(jnp.abs(trainer - rollout.logp_nt) * rollout.mask_nt))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=("tiny", "0.5b"), default="tiny")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    # torch shares the accelerator: JAX (its backend not started yet) takes memory as needed.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    cores = os.cpu_count() or 1
    torch.set_num_threads(cores)
    precision = exact_float32_matmuls()

    with tempfile.TemporaryDirectory() as tmp:
        if args.arch == "tiny":
            dtype = "float32"
            build_qwen2(tmp, TINY_QWEN2)
        else:
            from plan_memory import ARCHS

            a, dtype = ARCHS[args.arch], "bfloat16"
            fields = {k: getattr(a, k) for k in TINY_QWEN2}
            build_qwen2(tmp, fields, dtype=dtype, rope_theta=a.rope_theta, max_positions=32768)
        # Weights in the compute dtype on both sides (the sampler needs no float32 masters).
        model = from_pretrained(tmp, dtype=dtype, param_dtype=dtype)
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=getattr(torch, dtype))
        hf = hf.to(TORCH_DEVICE).eval()

    prompts, lengths = make_prompts(PROMPT_LENGTHS, max(PROMPT_LENGTHS))
    n_tok = B * G * T_NEW
    compile_s, gj_s, rollout = time_grpojax(model, prompts, lengths, args.repeats)
    assert int(rollout.lengths_n.min()) == T_NEW
    compile_ps, gj_ps_s, _ = time_grpojax(
        model, prompts, lengths, args.repeats, shared_prefill=False
    )
    hf_s = time_hf(hf, prompts, lengths, args.repeats)
    diff = max_logp_diff(model, rollout)
    # The sampler's matmuls alone, each run as often as a call runs it (best of the repeats).
    program = generate_jaxpr(lambda: sample(model, prompts, lengths, 0))
    floor_s, _ = matmul_floor(
        matmuls(program, while_trips=decode_trips(T_NEW)), args.repeats, stat=min
    )

    # The prompt's share grows with its length: the same comparison with 256-token prompts.
    long_prompts, long_lengths = make_prompts((256, 240, 200, 256), 256)
    _, long_shared, _ = time_grpojax(model, long_prompts, long_lengths, args.repeats)
    _, long_per, _ = time_grpojax(
        model, long_prompts, long_lengths, args.repeats, shared_prefill=False
    )
    long_hf = time_hf(hf, long_prompts, long_lengths, args.repeats)
    mem_shared = temp_bytes(model, long_prompts, long_lengths)
    mem_per = temp_bytes(model, long_prompts, long_lengths, shared_prefill=False)

    gj_tok_s, hf_tok_s, ps_tok_s = n_tok / gj_s, n_tok / hf_s, n_tok / gj_ps_s
    print(f"machine: {machine()}")
    print(
        f"  jax {jax.__version__} ({jax.default_backend()}), torch {torch.__version__} "
        f"({TORCH_DEVICE}), transformers {transformers.__version__}; {precision}"
    )
    print(
        f"workload: {B} prompts x {G} samples x {T_NEW} new tokens, temperature 1, no EOS; "
        f"model {args.arch}, {dtype}"
    )
    print(f"{'run':47s} {'s/call':>8s} {'tok/s':>10s} {'compile s':>10s} {'temp MB':>8s}")
    rows = [
        ("grpojax shared prefill", gj_s, gj_tok_s, f"{compile_s:.2f}", ""),
        ("grpojax per-sample prefill", gj_ps_s, ps_tok_s, f"{compile_ps:.2f}", ""),
        (f"transformers generate (torch {TORCH_DEVICE})", hf_s, hf_tok_s, "-", ""),
        (
            "grpojax shared prefill, 256-token prompts",
            long_shared,
            n_tok / long_shared,
            "",
            f"{mem_shared / 1e6:.1f}",
        ),
        (
            "grpojax per-sample prefill, 256-token prompts",
            long_per,
            n_tok / long_per,
            "",
            f"{mem_per / 1e6:.1f}",
        ),
        ("transformers generate, 256-token prompts", long_hf, n_tok / long_hf, "-", ""),
    ]
    for name, s, tps, comp, mem in rows:
        print(f"{name:47s} {s:8.4f} {tps:10.1f} {comp:>10s} {mem:>8s}")
    print(
        f"with 256-token prompts: shared prefill {long_per / long_shared:.2f}x the per-sample "
        f"prefill's speed in {mem_shared / mem_per:.2f} of its buffer bytes, "
        f"{long_hf / long_shared:.2f}x transformers generate"
    )
    print(
        f"grpojax's matmuls alone (each in a loop of its own, benchlib.matmul_floor): "
        f"{floor_s:.4f} s a call, so at most {hf_s / floor_s:.2f}x transformers generate "
        f"at this shape with this backend's matmul kernels"
    )
    print(f"max |sampler logp - trainer logp| = {diff:.3e}")
    print(
        f"bench_sampler: grpojax_tok_s={gj_tok_s:.1f} hf_tok_s={hf_tok_s:.1f} "
        f"speedup={gj_tok_s / hf_tok_s:.2f} shared_prefill_speedup={gj_ps_s / gj_s:.2f} "
        f"long_prompt_speedup={long_hf / long_shared:.2f} max_logp_diff={diff:.3e} "
        f"matmuls_only_speedup={hf_s / floor_s:.2f} "
        f"arch={args.arch}"
    )


if __name__ == "__main__":
    main()
