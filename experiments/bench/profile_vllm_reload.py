"""Where vLLM's in-place weight reload spends its time on the CPU build: the floor under any
weight push to vLLM's CPU engine, whatever carries the weights.

The model (`--shape`, as `bench_weight_push.py` names them; random init, float32) is
written once with `save_pretrained`; then this script runs itself under vLLM's Python
(`--vllm-python`), starts `vllm.LLM` on the folder as the engine's worker does, reads the
tensors into memory (so nothing below touches a file) and reloads them in place with
`reload_weights(weights_iterator=...)` `--calls` times, the last under cProfile. It prints
the median reload and the profile's totals for vLLM's copies into the freshly materialised
layers (`Tensor.copy_`) and the CPU linear layers' re-packing into oneDNN's layout
(`create_onednn_mm_handler`, in `dispatch_cpu_unquantized_gemm`). Last line:

    profile_vllm_reload: shape=.. reload_s=.. copy_s=.. repack_s=.. other_s=..

    python experiments/bench/profile_vllm_reload.py [--shape 0.5b] [--vllm-python PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile


def in_vllm(path: str, calls: int, shape: str) -> None:
    """The part run by vLLM's Python."""
    import cProfile
    import pstats
    import statistics
    import time

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from safetensors.torch import load_file
    from vllm import LLM

    llm = LLM(
        model=path, dtype="float32", skip_tokenizer_init=True, enforce_eager=True,
        max_model_len=64, kv_cache_memory_bytes=64 * 2**20, enable_chunked_prefill=False,
        block_size=32,
    )  # fmt: skip
    weights = load_file(str(pathlib.Path(path) / "model.safetensors"))

    def reload() -> float:
        t0 = time.perf_counter()
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights.items())})
        return time.perf_counter() - t0

    times = [reload() for _ in range(calls)]
    prof = cProfile.Profile()
    prof.enable()
    profiled = reload()
    prof.disable()
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (cc, nc, tottime, cumtime, ...)
    copy = sum(
        v[2]
        for k, v in stats.items()
        if k[2] == "<method 'copy_' of 'torch._C.TensorBase' objects>"
    )
    repack = sum(v[2] for k, v in stats.items() if "create_onednn_mm_handler" in k[2])
    reload_s = statistics.median(times)
    share = copy + repack
    print(json.dumps(dict(reload=reload_s, profiled=profiled, copy=copy, repack=repack)))
    print(
        f"reload in place, median of {calls}: {reload_s:.3f} s; profiled call {profiled:.3f} s: "
        f"copies into the materialised layers {copy:.3f} s, oneDNN re-packing {repack:.3f} s "
        f"({share / profiled:.0%} of it), the rest {profiled - share:.3f} s"
    )
    print(
        f"profile_vllm_reload: shape={shape} reload_s={reload_s:.3f} copy_s={copy:.3f} "
        f"repack_s={repack:.3f} other_s={profiled - share:.3f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="0.5b")
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--vllm-python", default=None)
    parser.add_argument("--in-vllm", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.in_vllm:
        in_vllm(args.in_vllm, args.calls, args.shape)
        return

    from bench_weight_push import shape_config
    from benchlib import machine
    from flax import nnx

    import grpojax.models as gm
    from grpojax.sampling.vllm_engine import _preloads

    python = args.vllm_python
    if python is None:
        from grpojax.jobs.vllm_env import create_vllm_env

        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tests"))
        from user_cache import user_cache_dir

        python = str(create_vllm_env(user_cache_dir("vllm-env"), print_fn=lambda s: None))
    print(f"machine: {machine()}; vLLM: {python}")
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as d:
        gm.save_pretrained(gm.Decoder(shape_config(args.shape), rngs=nnx.Rngs(0)), d)
        env = dict(os.environ)
        preload = [str(p) for p in _preloads(python)]
        if preload:  # as the engine starts its worker
            env["LD_PRELOAD"] = ":".join(preload)
        out = subprocess.run(
            [python, "-P", __file__, "--in-vllm", d, "--calls", str(args.calls),
             "--shape", args.shape],
            env=env, capture_output=True, text=True, check=False,
        )  # fmt: skip
    if out.returncode:
        sys.exit(f"vLLM's side failed:\n{out.stderr[-2000:]}")
    for line in out.stdout.splitlines():
        if line.startswith(("reload in place", "profile_vllm_reload:")):
            print(line)


if __name__ == "__main__":
    main()
