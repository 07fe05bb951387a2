"""Benchmark: the default GRPO step with the fused attention op against the blockwise path.

The default GRPO config's step (`RunConfig().step_config`: share_prompt, so each group's
prompt runs once and its completions attend to it as a prefix; beta 0.04 with the
reference logprobs given) at the Qwen2.5-0.5B shape (`plan_memory.ARCHS["0.5b"]`: bf16
compute, float32 parameters, remat "full"), on B prompts of P tokens with G completions of
T tokens each (`benchlib.grpo_batch`: ragged, half to all of the width real), compiled with
`model.attention="blockwise"` (the baseline: the JAX-level online-softmax loop, tiles of
`attention.default_block()`) and `"fused"` (`jax.nn.dot_product_attention`: cuDNN on a GPU,
its XLA implementation elsewhere). For each T and path: the compiled step's scratch bytes
(`memory_analysis().temp_size_in_bytes`), the attention sites in its program (ops whose
metadata names `fused_attention` / `blockwise_attention` / `einsum_attention`: the fused
step must have no unfused one) and the median wall time of `--repeats` steps.

Usage: `python experiments/bench/bench_fused_step.py [--lengths 4096,16384] [--quick]`
(`--quick`: the built-in tiny model at T 64 and 128, to try the script on a CPU; its figures
are not a GPU's). Run on a quiet machine. The last line is
`bench_fused_step: speedup_<T>=.. temp_ratio_<T>=.. ...` (blockwise over fused, per T).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from benchlib import compiled_grpo_step, grpo_batch, machine, median_step_time

GB = 2**30
PATHS = ("blockwise", "fused")


def _config(quick: bool, attention: str):
    from grpojax.models import tiny_config

    if quick:
        return tiny_config(attention=attention, remat="full")
    from plan_memory import ARCHS, model_config

    return dataclasses.replace(model_config(ARCHS["0.5b"], "full"), attention=attention)


def _step(config, batch, group: int):
    """(compiled step, state): the default GRPO config's step (groups of `group`) for
    `config`'s model."""
    import jax
    from flax import nnx

    from grpojax.config import RunConfig
    from grpojax.models import Decoder
    from grpojax.train import OptimizerConfig, create_train_state, make_optimizer

    step_config = dataclasses.replace(RunConfig().step_config, group_size=group)
    tx = make_optimizer(OptimizerConfig(learning_rate=1e-6))
    graphdef, state = create_train_state(
        Decoder(config, rngs=nnx.Rngs(0)), tx, rng=jax.random.key(0)
    )
    return compiled_grpo_step(graphdef, tx, step_config, state, batch), state


def _sites(compiled) -> dict[str, int]:
    hlo = compiled.as_text()
    return {p: hlo.count(f"{p}_attention") for p in ("fused", "blockwise", "einsum")}


def measure(lengths, *, quick: bool, prompts: int, group: int, prompt: int, repeats: int):
    import jax

    rows = []
    for t in lengths:
        batch = grpo_batch(prompts, group, prompt, t)
        row: dict = {"T": t}
        for path in PATHS:
            compiled, state = _step(_config(quick, path), batch, group)
            sites = _sites(compiled)
            if path == "fused" and (sites["blockwise"] or sites["einsum"] or not sites["fused"]):
                sys.exit(f"the fused step at T={t} has unfused attention sites: {sites}")
            row[path] = dict(
                temp_gb=compiled.memory_analysis().temp_size_in_bytes / GB,
                s=median_step_time(compiled, state, batch, repeats),
                sites=sites,
            )
            del compiled, state
            jax.clear_caches()
        rows.append(row)
        print(
            f"  T={t}: "
            + ", ".join(f"{p} {row[p]['s']:.3f} s {row[p]['temp_gb']:.2f} GB" for p in PATHS),
            flush=True,
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--lengths", default=None, help="completion widths T (4096,16384; --quick: 64,128)"
    )
    parser.add_argument("--prompts", type=int, default=1, help="B prompts")
    parser.add_argument(
        "--group", type=int, default=None, help="G completions a prompt (the default config's)"
    )
    parser.add_argument("--prompt", type=int, default=256, help="P prompt width")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny model, T 64 and 128")
    args = parser.parse_args()
    args.lengths = args.lengths or ("64,128" if args.quick else "4096,16384")
    lengths = [int(x) for x in args.lengths.split(",")]
    from grpojax.config import RunConfig

    args.group = args.group or RunConfig().step_config.group_size
    prompt = 32 if args.quick else args.prompt
    import jax

    from grpojax.models import attention

    print(f"machine: {machine()}")
    print(
        f"the default GRPO step, {'tiny model' if args.quick else 'Qwen2.5-0.5B shape, bf16'}; "
        f"B={args.prompts} prompts of P={prompt} x G={args.group} completions; fused = "
        f"jax.nn.dot_product_attention ({attention.fused_implementation()}), blockwise tiles "
        f"of {attention.default_block()}; jax {jax.__version__}"
    )
    rows = measure(
        lengths,
        quick=args.quick,
        prompts=args.prompts,
        group=args.group,
        prompt=prompt,
        repeats=args.repeats,
    )
    print(
        f"\n{'T':>7} {'blockwise s':>12} {'fused s':>9} {'speedup':>8} "
        f"{'blockwise GB':>13} {'fused GB':>9} {'fused sites':>12}"
    )
    last = []
    for r in rows:
        b, f = r["blockwise"], r["fused"]
        speedup, temp = b["s"] / f["s"], b["temp_gb"] / max(f["temp_gb"], 1e-9)
        print(
            f"{r['T']:>7} {b['s']:>12.3f} {f['s']:>9.3f} {speedup:>7.2f}x "
            f"{b['temp_gb']:>13.2f} {f['temp_gb']:>9.2f} {f['sites']['fused']:>12}"
        )
        last += [f"speedup_{r['T']}={speedup:.2f}", f"temp_ratio_{r['T']}={temp:.2f}"]
    print("bench_fused_step: " + " ".join(last))


if __name__ == "__main__":
    main()
