"""Benchmark: long sequences on this machine, each ratio against today's path in the same run.

(a) Attention. One GRPO step (the built-in tiny model: 6 layers, width 256, 8 query / 2
    key-value heads; one sequence of a 64-token prompt and a T-token completion; 1 epoch, one
    micro-batch, remat "dots_no_batch", what `model.remat=auto` takes here) compiled with
    `model.attention="einsum"` (the reference: whole `[T, S]` score arrays) and with
    `"blockwise"` (`grpojax.models.attention`: online softmax in tiles, custom VJP). For each
    T: XLA's compiled scratch bytes (`memory_analysis().temp_size_in_bytes`) and the median
    wall time of `--repeats` steps; the einsum step is compiled at every T (its temp bytes
    are known without running) but only run where its scratch fits `--max-run-gb`.

(b) Packing. A batch of `--rows` completions whose lengths are drawn from a lognormal
    (sigma 1, clipped to [16, T_max], median chosen so the mean is about T_max / 4: a long
    tail, most completions short, a few at the budget) after 32-token prompts, G = 8 per
    prompt. The same GRPO step (blockwise attention, `--micro` micro-batches) on the padded
    batch (`share_prompt`, each prompt once: today's driver layout) and on the packed batch
    as the driver packs it (`grpojax.train.packing.pack_lengths`: groups with their prompt
    once or whole sequences, whichever needs fewer positions, in rows whose width is chosen
    for the batch): the fraction of the forward's token positions that hold no token, and
    the update's real tokens per second (prompt and completion tokens / median step time).

Usage: `python experiments/bench/bench_long_context.py [--lengths 1024,4096,16384] [--quick]`.
Run on a quiet machine. The last line is
`bench_long_context: temp_growth_16k_over_4k=.. packed_speedup=.. padded_frac_packed=..`.
"""

from __future__ import annotations

import argparse
import math

import numpy as np
from benchlib import compiled_grpo_step, machine, median_step_time

GB = 2**30


def _model(attention: str, block: int | None):
    from flax import nnx

    from grpojax.models import Decoder, tiny_config

    cfg = tiny_config(remat="dots_no_batch", attention=attention, attention_block=block)
    return Decoder(cfg, rngs=nnx.Rngs(0))


def _state(model):
    import jax

    from grpojax.train import OptimizerConfig, create_train_state, make_optimizer

    tx = make_optimizer(OptimizerConfig(learning_rate=1e-5))
    graphdef, state = create_train_state(model, tx, rng=jax.random.key(0))
    return graphdef, state, tx


def _one_sequence_batch(t: int, prompt: int = 64):
    import jax.numpy as jnp

    from grpojax.train import GRPOBatch

    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(3, 40, (1, prompt + t)), jnp.int32)
    return GRPOBatch(
        tokens_ns=tokens,
        mask_ns=jnp.ones((1, prompt + t), bool),
        completion_mask_nt=jnp.ones((1, t), bool),
        advantages=jnp.ones((1,), jnp.float32),
    )


def attention_rows(lengths, repeats: int, max_run_gb: float, block: int | None):
    import jax

    from grpojax.train import GRPOConfig

    config = GRPOConfig(beta=0.0, shuffle=False)
    rows = []
    for t in lengths:
        batch = _one_sequence_batch(t)
        row = {"T": t}
        for impl in ("einsum", "blockwise"):
            graphdef, state, tx = _state(_model(impl, block))
            compiled = compiled_grpo_step(graphdef, tx, config, state, batch)
            temp = compiled.memory_analysis().temp_size_in_bytes
            row[f"{impl}_temp_gb"] = temp / GB
            if temp / GB <= max_run_gb:
                row[f"{impl}_s"] = median_step_time(compiled, state, batch, repeats)
            else:
                row[f"{impl}_s"] = math.nan
            del compiled, state
            jax.clear_caches()
        rows.append(row)
        print(
            f"  T={t}: einsum {row['einsum_temp_gb']:.2f} GB {row['einsum_s']:.2f} s, "
            f"blockwise {row['blockwise_temp_gb']:.2f} GB {row['blockwise_s']:.2f} s",
            flush=True,
        )
    return rows


def longtail_lengths(n: int, t_max: int, seed: int = 0, sigma: float = 1.0) -> np.ndarray:
    """`[n]` completion lengths: lognormal(mu, sigma) clipped to [16, t_max], mu chosen by
    bisection so that the clipped mean is t_max / 4."""
    rng = np.random.default_rng(seed)
    z = rng.standard_normal(n)

    def mean_at(mu):
        return np.clip(np.exp(mu + sigma * z), 16, t_max).mean()

    lo, hi = 0.0, math.log(t_max)
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mean_at(mid) < t_max / 4 else (lo, mid)
    return np.clip(np.exp(lo + sigma * z), 16, t_max).round().astype(np.int64)


def packing_rows(t_max: int, rows: int, group: int, micro: int, repeats: int, block: int | None):
    import jax.numpy as jnp

    from grpojax.train import GRPOBatch, GRPOConfig
    from grpojax.train.packing import pack_lengths, padded_fraction

    p = 32
    lengths = longtail_lengths(rows, t_max)
    rng = np.random.default_rng(1)
    prompts = np.repeat(rng.integers(3, 40, (rows // group, p)), group, axis=0)
    tokens = np.concatenate([prompts, rng.integers(3, 40, (rows, t_max))], 1)
    cmask = np.arange(t_max)[None, :] < lengths[:, None]
    mask = np.concatenate([np.ones((rows, p), bool), cmask], 1)
    batch = GRPOBatch(
        tokens_ns=jnp.asarray(tokens, jnp.int32),
        mask_ns=jnp.asarray(mask),
        completion_mask_nt=jnp.asarray(cmask),
        advantages=jnp.asarray(rng.standard_normal(rows), jnp.float32),
    )
    # As the driver packs (`grpojax.driver.packing.Packer`): whichever of the group layout
    # and whole sequences needs fewer positions, the width chosen for the batch.
    plan = min(
        (
            pack_lengths(
                np.full(rows, p),
                lengths,
                prompt_width=p,
                completion_width=t_max,
                group_size=unit,
                rows_multiple=micro,
            )
            for unit in (group, 1)
        ),
        key=lambda x: x.src_rw.size,
    )
    packed = batch.replace(packing=plan)
    real = int(lengths.sum()) + (rows // group) * p
    padded_positions = (rows // group) * p + rows * t_max
    config = GRPOConfig(
        group_size=group, beta=0.0, share_prompt=True, num_microbatches=micro, shuffle=False
    )
    out = {
        "rows": rows,
        "T_max": t_max,
        "mean_len": float(lengths.mean()),
        "real_tokens": real,
        "padded_frac_padded": 1 - real / padded_positions,
        "padded_frac_packed": padded_fraction(plan),
        "packed_shape": tuple(plan.src_rw.shape),
    }
    for name, b in (("padded", batch), ("packed", packed)):
        graphdef, state, tx = _state(_model("blockwise", block))
        compiled = compiled_grpo_step(graphdef, tx, config, state, b)
        out[f"{name}_s"] = median_step_time(compiled, state, b, repeats)
        out[f"{name}_tok_s"] = real / out[f"{name}_s"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,4096,16384")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-run-gb", type=float, default=8.0)
    parser.add_argument(
        "--block", type=int, default=None, help="attention tile (default: 1,024 on a GPU, 256 else)"
    )
    parser.add_argument("--pack-tmax", type=int, default=1024)
    parser.add_argument("--pack-rows", type=int, default=64)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="T 256, 1024; 32 rows of <= 256")
    args = parser.parse_args()
    if args.quick:
        args.lengths, args.pack_tmax, args.pack_rows, args.repeats = "256,1024", 256, 32, 2
    lengths = [int(x) for x in args.lengths.split(",")]

    print(f"machine: {machine()}")
    print("(a) one GRPO step, tiny model, 1 sequence of 64 + T tokens")
    arows = attention_rows(lengths, args.repeats, args.max_run_gb, args.block)
    print(
        f"{'T':>6} {'einsum_GB':>10} {'block_GB':>9} {'GB ratio':>8} {'einsum_s':>9} "
        f"{'block_s':>8} {'speedup':>7}"
    )
    for r in arows:
        print(
            f"{r['T']:>6} {r['einsum_temp_gb']:>10.3f} {r['blockwise_temp_gb']:>9.3f} "
            f"{r['blockwise_temp_gb'] / r['einsum_temp_gb']:>8.3f} {r['einsum_s']:>9.3f} "
            f"{r['blockwise_s']:>8.3f} {r['einsum_s'] / r['blockwise_s']:>7.2f}"
        )
    by_t = {r["T"]: r for r in arows}
    growth = math.nan  # the last line's: 16,384 over 4,096 tokens
    for top in (t for t in lengths if t > 4096 and 4096 in by_t):
        blockwise = by_t[top]["blockwise_temp_gb"] / by_t[4096]["blockwise_temp_gb"]
        ein = by_t[top]["einsum_temp_gb"] / by_t[4096]["einsum_temp_gb"]
        print(f"temp growth {top} / 4096: blockwise {blockwise:.2f}x, einsum {ein:.2f}x")
        if top == 16384:
            growth = blockwise

    print(
        f"(b) packing: {args.pack_rows} completions (G={args.group}) of lognormal lengths "
        f"<= {args.pack_tmax}, 32-token prompts, {args.micro} micro-batches"
    )
    p = packing_rows(
        args.pack_tmax, args.pack_rows, args.group, args.micro, args.repeats, args.block
    )
    print(
        f"mean completion {p['mean_len']:.0f} of {p['T_max']} ({p['mean_len'] / p['T_max']:.2f}); "
        f"packed rows {p['packed_shape']}"
    )
    print(f"{'layout':<7} {'padded_frac':>11} {'step_s':>8} {'real tok/s':>10}")
    for name in ("padded", "packed"):
        print(
            f"{name:<7} {p[f'padded_frac_{name}']:>11.3f} {p[f'{name}_s']:>8.3f} "
            f"{p[f'{name}_tok_s']:>10.0f}"
        )
    speedup = p["packed_tok_s"] / p["padded_tok_s"]
    print(
        f"bench_long_context: temp_growth_16k_over_4k={growth:.2f} packed_speedup={speedup:.2f} "
        f"padded_frac_packed={p['padded_frac_packed']:.3f}"
    )


if __name__ == "__main__":
    main()
