"""Sampler vs trainer log-probabilities on a mixture of experts, with and without routing
replay, in bfloat16 (and float32 for scale).

A random Qwen3-MoE decoder (`--experts` E experts, top `--top-k`, renormalised as in
Qwen3-30B-A3B; every parameter drawn at random, norms around 1, experts of O(1) effect)
samples G completions for B prompts with `grpojax.sampling.generate(record_routing=True)`
(prefill + cached decode, one token at a time, each token's experts recorded). The trainer's
pass then runs prompt + completion as one full causal forward, twice: routing recomputed
(its own top k) and routing replayed (`model(..., routing_ntlk=rollout.routing_nslk)`).
Printed per (dtype, seed): the share of fed tokens whose recomputed experts differ from the
sampler's in some layer, and max / mean |logp_trainer - logp_sampler| over the real
completion tokens both ways. In bf16 the decode step and the full forward round differently,
so a token near a router tie can go to other experts in the trainer: the mismatch replay
removes.

    PYTHONPATH=. python experiments/studies/moe_routing_replay.py [--seeds 3] [--tokens 32]

Last line: `moe_routing_replay: f32_flipped=.. f32_recomputed_max=.. ... bf16_flipped=..
bf16_recomputed_max=.. bf16_replayed_max=.. bf16_recomputed_mean=.. bf16_replayed_mean=..`
(per dtype: the seeds' mean share of flipped tokens, the worst seed's max, the mean of means).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))  # benchlib

import jax
import jax.numpy as jnp
import numpy as np
from benchlib import machine
from flax import nnx

from grpojax.models import Decoder, ModelConfig
from grpojax.sampling import generate


def random_moe(dtype: str, experts: int, top_k: int, seed: int) -> Decoder:
    config = ModelConfig(
        model_type="qwen3_moe",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        qk_norm=True,
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        dtype=dtype,
    )
    model = Decoder(config, rngs=nnx.Rngs(seed))
    keys = iter(jax.random.split(jax.random.key(seed + 100), 64))
    for name, var in model.named_params().items():
        noise = jax.random.normal(next(keys), var.shape)
        var.set_value(1.0 + 0.2 * noise if "norm" in name else 0.3 * noise / 4.0)
    return model


def logp_of(model, rollout, routing):
    tokens, mask, positions = rollout.sequences()
    hidden, _, recomputed = model(
        tokens, positions_nt=positions, mask_nt=mask, routing_ntlk=routing, return_routing=True
    )
    logp = jax.nn.log_softmax(model.logits(hidden), axis=-1)
    p = rollout.prompt_tokens_bp.shape[1]
    logp = jnp.take_along_axis(logp[:, p - 1 : -1], rollout.tokens_nt[..., None], -1)[..., 0]
    return np.asarray(logp), np.asarray(recomputed.experts_ntlk)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    args = parser.parse_args()

    print(f"machine: {machine()}")
    print(
        f"model: random Qwen3-MoE, D 64, 4 layers, {args.experts} experts, top {args.top_k} "
        f"renormalised; {args.prompts} prompts x {args.group} samples, T {args.tokens}, "
        "temperature 1"
    )
    print(
        f"{'dtype':>9} {'seed':>4} {'flipped':>8} {'recomp max':>10} {'replay max':>10} "
        f"{'recomp mean':>11} {'replay mean':>11}"
    )
    summary = {}
    for dtype in ("float32", "bfloat16"):
        rows = []
        for seed in range(args.seeds):
            model = random_moe(dtype, args.experts, args.top_k, seed)
            rng = np.random.default_rng(seed)
            lengths = rng.integers(4, 13, args.prompts)
            prompts = rng.integers(3, 256, (args.prompts, 12))
            r = generate(
                model,
                prompts,
                lengths,
                key=jax.random.key(seed),
                max_new_tokens=args.tokens,
                group_size=args.group,
                record_routing=True,
            )
            mask = np.asarray(r.mask_nt)
            sampled = np.asarray(r.logp_nt)
            recomputed, routing = logp_of(model, r, None)
            replayed, _ = logp_of(model, r, r.routing_nslk)
            n, p = mask.shape[0], r.prompt_tokens_bp.shape[1]
            fed = np.asarray(r.sequences()[1]).copy()
            fed[np.arange(n), p + np.asarray(r.lengths_n) - 1] = False  # never fed
            differs = np.any(
                np.sort(routing, -1) != np.sort(np.asarray(r.routing_nslk), -1), axis=(-1, -2)
            )
            flipped = float(differs[fed].mean())
            d_rec = np.abs(recomputed - sampled)[mask]
            d_rep = np.abs(replayed - sampled)[mask]
            rows.append((flipped, d_rec.max(), d_rep.max(), d_rec.mean(), d_rep.mean()))
            print(
                f"{dtype:>9} {seed:>4} {flipped:>8.2%} {d_rec.max():>10.3g} {d_rep.max():>10.3g} "
                f"{d_rec.mean():>11.3g} {d_rep.mean():>11.3g}",
                flush=True,
            )
        a = np.array(rows)
        summary[dtype] = (a[:, 0].mean(), a[:, 1].max(), a[:, 2].max(), *a[:, 3:].mean(0))
    names = ("flipped", "recomputed_max", "replayed_max", "recomputed_mean", "replayed_mean")
    short = {"float32": "f32", "bfloat16": "bf16"}
    line = " ".join(
        f"{short[dtype]}_{name}={value:.3g}"
        for dtype, values in summary.items()
        for name, value in zip(names, values)
    )
    print(f"moe_routing_replay: {line}")


if __name__ == "__main__":
    main()
