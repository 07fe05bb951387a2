"""The vLLM engine's weight push, in memory against through files, in one run.

For each model shape (`--shapes`; random init, float32, the weights vLLM holds in float32
too), one `grpojax.sampling.vllm_engine.VLLMEngine` per route is started and given the
weights `--calls` more times (`VLLMEngine.sync`, a new version each time, each checked by
the probe: the sync raises if vLLM's logprobs of the probe differ from the policy's):

  files   `save_pretrained` to a folder in /dev/shm, vLLM's `reload_weights` from it
  memory  the parameters copied into a shared-memory buffer (`weight_push.SharedWeights`),
          vLLM's `reload_weights` over views of it (`--bucket-mb` buckets)

The figure is each route's median sync, with its parts (`VLLMEngine.last_sync`: writing the
file or filling the buffer, vLLM's load, the probe's check) and the ratio files / memory.
Shapes: `135m` SmolLM2-135M (Llama, D 576, 30 layers, V 49,152, tied head), `0.5b`
Qwen2.5-0.5B (D 896, 24 layers, V 151,936, tied), `30m` (untied head). With `--lora` a
135M model with rank-16 adapters on every projection is pushed merged (W + (alpha/r) A B).

Measure on a quiet machine. Last line:

    bench_weight_push: shape=.. files_s=.. memory_s=.. speedup=..   (the last --shapes one's)

    python experiments/bench/bench_weight_push.py [--shapes 135m 0.5b] [--vllm-python PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time

from bench_roofline import qwen3_30m_config
from benchlib import machine


def shape_config(name: str):
    import grpojax.models as gm

    if name == "135m":
        fields = dict(
            model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
            num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
            tie_word_embeddings=True, rope_theta=100000.0, max_position_embeddings=8192,
        )  # fmt: skip
        return gm.ModelConfig(**fields)
    if name == "30m":
        return qwen3_30m_config()
    from plan_memory import ARCHS
    from plan_memory import model_config as arch_config

    return dataclasses.replace(arch_config(ARCHS[name]), remat="none")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["135m", "0.5b"])
    parser.add_argument("--routes", nargs="+", default=["files", "memory"])
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--bucket-mb", type=float, default=1024)
    parser.add_argument("--lora", action="store_true", help="also a 135M model with adapters")
    parser.add_argument("--vllm-python", default=None)
    args = parser.parse_args()

    import jax
    from flax import nnx

    import grpojax.models as gm
    from grpojax.sampling.vllm_engine import VLLMEngine

    python = args.vllm_python
    if python is None:
        from grpojax.jobs.vllm_env import create_vllm_env

        sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2] / "tests"))
        from user_cache import user_cache_dir

        python = str(create_vllm_env(user_cache_dir("vllm-env"), print_fn=lambda s: None))

    print(f"machine: {machine()}")
    print(f"vLLM: {python}; calls {args.calls} per route (median), bucket {args.bucket_mb} MiB")
    cases = [(s, False) for s in args.shapes] + ([("135m", True)] if args.lora else [])
    header = (
        "| model | params | route | sync s (median) | write | vLLM load | check | files / memory |"
    )
    print(header)
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    last = {}
    for shape, with_lora in cases:
        config = shape_config(shape)
        model = gm.Decoder(config, rngs=nnx.Rngs(0))
        if with_lora:
            model = gm.add_lora(model, gm.LoRAConfig(rank=16, alpha=32.0), rngs=nnx.Rngs(1))
        n = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
        medians = {}
        for route in args.routes:
            engine = VLLMEngine(
                python=python, max_model_len=64, kv_cache_mb=64, max_num_seqs=8,
                weight_transfer=route, bucket_mb=args.bucket_mb,
            )  # fmt: skip
            try:
                t0 = time.perf_counter()
                engine.sync(model, 0)
                start = time.perf_counter() - t0
                syncs, parts = [], []
                for v in range(1, args.calls + 1):
                    syncs.append(engine.sync(model, v))
                    parts.append(engine.last_sync)
            finally:
                engine.close()
            med = statistics.median(syncs)
            medians[route] = med
            part = {k: statistics.median(p[k] for p in parts) for k in parts[0]}
            ratio = ""
            if route == "memory" and "files" in medians:
                ratio = f"**{medians['files'] / med:.1f}x**"
            name = f"{shape}{' + LoRA r16 (merged)' if with_lora else ''}"
            print(
                f"| {name} | {n / 1e6:.0f}M | {route} | {med:.3f} (min {min(syncs):.3f}) | "
                f"{part['write']:.3f} | {part['load']:.3f} | {part['check']:.3f} | {ratio} |"
            )
            print(f"  ({route}: vLLM start with the first sync {start:.1f} s)", file=sys.stderr)
        if not with_lora:
            last = dict(shape=shape, **{f"{r}_s": f"{m:.3f}" for r, m in medians.items()})
            if "files" in medians and "memory" in medians:
                last["speedup"] = f"{medians['files'] / medians['memory']:.2f}"
        del model
    print("bench_weight_push: " + " ".join(f"{k}={v}" for k, v in last.items()))


if __name__ == "__main__":
    main()
