"""Sampler vs trainer log-probability agreement in bfloat16 (and float32 for scale).

A tiny random Qwen2 decoder (q/k/v biases, GQA, untied head; every parameter drawn at
random, norms around 1) samples G completions for B prompts with `grpojax.sampling.generate`
(prefill + cached decode, one token at a time); the trainer-side pass
(`grpojax.train.policy_logprobs`, the chunked float32 log-softmax) then scores the same
tokens, once with the group's prompt run once (`group_size=G`, the driver's default) and
once as a full causal forward (`group_size=1`). Printed: max and mean |logp_trainer -
logp_sampler| over the real completion tokens, the figure the driver logs per step as
`logprob_diff_max` / `logprob_diff_mean`. A third trainer path, `packed`, runs the rows
packed (`grpojax.train.packing`: the group's prompt once, then its completions, segment
ids in attention). `--attention blockwise` makes every multi-token forward (the sampler's
prefill, the trainer's passes) use the blockwise attention path with tiles of
`--block` tokens; the sampler's one-token decode steps stay on the einsum path.

    PYTHONPATH=. python experiments/studies/bf16_logprob_agreement.py
    PYTHONPATH=. python experiments/studies/bf16_logprob_agreement.py --seeds 3 --tokens 64

The last lines are machine-readable, one per (dtype, trainer path):
    agreement: dtype=bfloat16 param_dtype=float32 attention=auto path=shared max=.. mean=..
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpojax.models import Decoder, ModelConfig
from grpojax.models.precision import COMPILER_OPTIONS
from grpojax.ops.masks import mask_from_lengths
from grpojax.sampling import SamplingConfig, generate
from grpojax.train import policy_logprobs
from grpojax.train.packing import pack_plan


def tiny_qwen2(
    dtype: str, param_dtype: str, vocab: int, attention: str = "auto", block: int | None = None
) -> ModelConfig:
    return ModelConfig(
        attention=attention,
        attention_block=block,
        model_type="qwen2",
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=352,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        qkv_bias=True,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        dtype=dtype,
        param_dtype=param_dtype,
    )


def random_model(config: ModelConfig, seed: int) -> Decoder:
    """A Decoder whose every parameter is random (biases and norm gains too)."""
    model = Decoder(config, rngs=nnx.Rngs(seed))
    key = jax.random.key(seed + 1)
    for i, (name, var) in enumerate(sorted(model.named_params().items())):
        k = jax.random.fold_in(key, i)
        x = jax.random.normal(k, var.shape, jnp.float32)
        if name.endswith("norm"):
            value = 1.0 + 0.1 * x
        elif name.split(".")[-1].startswith("b"):
            value = 0.1 * x
        else:
            value = 0.05 * x
        var.set_value(value.astype(var[...].dtype))
    return model


def measure(
    dtype: str,
    param_dtype: str,
    *,
    seed: int,
    b: int,
    g: int,
    t: int,
    vocab: int,
    attention: str = "auto",
    block: int | None = None,
):
    config = tiny_qwen2(dtype, param_dtype, vocab, attention, block)
    model = random_model(config, seed)
    rng = np.random.default_rng(seed)
    width = 12
    lengths = rng.integers(3, width + 1, size=b).astype(np.int32)
    prompts = rng.integers(0, vocab, size=(b, width)).astype(np.int32)
    roll = generate(
        model,
        prompts,
        lengths,
        key=jax.random.key(seed),
        max_new_tokens=t,
        group_size=g,
        sampling=SamplingConfig(temperature=1.0),
        eos_ids=(0,),
    )
    p = roll.prompt_tokens_bp.shape[1]
    prompt_ns = jnp.repeat(roll.prompt_tokens_bp, g, axis=0)
    pmask = jnp.repeat(
        mask_from_lengths(roll.prompt_lengths_b, p, offset_n=p - roll.prompt_lengths_b), g, 0
    )
    tokens = jnp.concatenate([prompt_ns, roll.tokens_nt], axis=1)
    mask = jnp.concatenate([pmask, roll.mask_nt], axis=1)
    out = {}
    plan = jax.tree.map(jnp.asarray, pack_plan(mask, roll.mask_nt, group_size=g))
    for path, group in (("shared", g), ("full", 1), ("packed", g)):
        packing = plan if path == "packed" else None

        def trainer_logp(m, tok, msk, cm, group=group, packing=packing):
            if packing is None:
                return policy_logprobs(m, tok, msk, cm, group_size=group)[0]
            slots = [packing.to_slots(x) for x in (tok, msk, cm)]
            logp = policy_logprobs(m, *slots, packing=packing)[0]
            return packing.from_slots(logp, tok.shape[0])

        # Compiled like the driver's trainer pass (same XLA options as the sampler).
        fn = jax.jit(trainer_logp, compiler_options=COMPILER_OPTIONS)
        logp = fn(model, tokens, mask, roll.mask_nt)
        diff = jnp.where(roll.mask_nt, jnp.abs(logp - roll.logp_nt), 0.0)
        out[path] = (float(jnp.max(diff)), float(jnp.sum(diff) / jnp.sum(roll.mask_nt)))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--attention", default="auto", choices=("auto", "einsum", "blockwise"))
    ap.add_argument("--block", type=int, default=None, help="blockwise tile (default: per backend)")
    args = ap.parse_args()
    cases = [("float32", "float32"), ("bfloat16", "float32"), ("bfloat16", "bfloat16")]
    for dtype, param_dtype in cases:
        per_path: dict[str, list] = {"shared": [], "full": [], "packed": []}
        for seed in range(args.seeds):
            res = measure(
                dtype,
                param_dtype,
                seed=seed,
                b=args.prompts,
                g=args.group,
                t=args.tokens,
                vocab=args.vocab,
                attention=args.attention,
                block=args.block,
            )
            for k, v in res.items():
                per_path[k].append(v)
        for path, vals in per_path.items():
            mx = max(v[0] for v in vals)
            mean = float(np.mean([v[1] for v in vals]))
            print(
                f"agreement: dtype={dtype} param_dtype={param_dtype} "
                f"attention={args.attention} path={path} "
                f"max={mx:.3g} mean={mean:.3g}"
            )


if __name__ == "__main__":
    main()
