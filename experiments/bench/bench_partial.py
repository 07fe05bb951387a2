"""Partial rollouts' decode against the continuous engine's, rounds of one model, no training.

Workload: the main job's built-in tiny model at random weights (seed 0), rounds of B prompts
(8-12 random ids, width 16) x G samples, T `--max-new-tokens`, the built-in EOS (id 2) as the
stop id, temperature 1. A random model draws EOS about once in 100 tokens, so completion
lengths are about geometric: mean about 100, a few samples a round running to T, a long
tail. Both engines decode the same rounds (the same prompts and keys) with `--slots` slots:

  continuous  `generate(engine="continuous")`, one call a round: the slots refill from the
              round's samples and drain while its longest ones finish;
  partial     `grpojax.sampling.partial.PartialDecoder` with k `--k` rounds in flight: call
              s appends round s + k and decodes until round s has ended, the freed slots
              taking the later rounds' samples (the weights are the same at every call
              here, so only the schedule differs; each call recomputes the live slots'
              caches all the same).

The first `--warmup` calls (which compile) are left out; per engine: seconds, tokens decoded
(by each call: the partial engine's include the later rounds' tokens), decode steps, ms a
step, utilisation (tokens / (steps x slots)) and tokens/s, summed over the timed calls.
`--decode-loops 1` reads the whole cache every step in both (no extents): what is left is
the engines' own bookkeeping.

Last line: `bench_partial: continuous_tok_s=.. partial_tok_s=.. ratio=.. util_continuous=..
util_partial=.. ms_step_continuous=.. ms_step_partial=..`

    python experiments/bench/bench_partial.py [--slots 8] [--k 1] [--max-new-tokens 512]
        [--calls 8] [--decode-loops 4]
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np
from benchlib import machine
from flax import nnx

from grpojax.models import Decoder, tiny_config
from grpojax.models.tokenizer import EOS_ID
from grpojax.sampling import generate
from grpojax.sampling.generate import DECODE_LOOPS
from grpojax.sampling.partial import PartialDecoder

WIDTH = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8, help="B")
    parser.add_argument("--group", type=int, default=8, help="G")
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--k", type=int, default=1, help="rounds in flight")
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--calls", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--decode-loops", type=int, default=DECODE_LOOPS)
    args = parser.parse_args()
    b, g, t, s, k = args.prompts, args.group, args.max_new_tokens, args.slots, args.k

    model = Decoder(tiny_config(), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)

    def prompts():
        lengths = rng.integers(8, 13, size=b).astype(np.int32)
        tokens = np.zeros((b, WIDTH), np.int32)
        for i, n in enumerate(lengths):
            tokens[i, WIDTH - n :] = rng.integers(5, 90, size=n)
        return tokens, lengths

    rounds = [prompts() for _ in range(args.calls + k)]
    keys = [jax.random.fold_in(jax.random.key(1), r) for r in range(args.calls + k)]
    gen_keys = [jax.random.split(key)[1] for key in keys]  # `generate`'s split

    timed: dict[str, list[tuple[float, int, int]]] = {"continuous": [], "partial": []}
    for r in range(args.calls):
        t0 = time.perf_counter()
        out = generate(
            model, *rounds[r], key=keys[r], max_new_tokens=t, group_size=g, eos_ids=(EOS_ID,),
            engine="continuous", slots=s, decode_loops=args.decode_loops, bucket=WIDTH,
            min_bucket_width=WIDTH,
        )  # fmt: skip
        jax.block_until_ready(out.tokens_nt)
        row = (time.perf_counter() - t0, int(out.lengths_n.sum()), int(out.decode_steps))
        timed["continuous"].append(row)

    decoder = PartialDecoder(
        rounds_ahead=k, n_prompts=b, group_size=g, prompt_width=WIDTH, max_new_tokens=t,
        stop_ids=(EOS_ID,), slots=s, decode_loops=args.decode_loops,
    )  # fmt: skip
    window = decoder.window(rounds[:k], gen_keys[:k])
    for r in range(args.calls):
        t0 = time.perf_counter()
        out, _, window, decoded = decoder.advance(model, window, *rounds[r + k], gen_keys[r + k], r)
        jax.block_until_ready(out.tokens_nt)
        timed["partial"].append((time.perf_counter() - t0, int(decoded), int(out.decode_steps)))

    print(f"machine: {machine()}")
    print(
        f"workload: tiny model at random, B {b} x G {g}, T {t}, {s} slots, k {k}, "
        f"decode_loops {args.decode_loops}; {args.calls} calls each, the first {args.warmup} "
        "left out"
    )
    head = ("engine", "s", "tokens", "steps", "ms/step", "util", "tok/s")
    print(" ".join(f"{h:>{w}}" for h, w in zip(head, (10, 7, 7, 6, 7, 5, 7))))
    summary = {}
    for name, rows in timed.items():
        seconds, tokens, steps = (sum(x) for x in zip(*rows[args.warmup :]))
        util = tokens / (steps * s)
        summary[name] = (tokens / seconds, util, 1000 * seconds / steps)
        print(
            f"{name:>10} {seconds:>7.2f} {tokens:>7d} {steps:>6d} {1000 * seconds / steps:>7.2f} "
            f"{util:>5.2f} {tokens / seconds:>7.0f}"
        )
    (c_tok, c_util, c_ms), (p_tok, p_util, p_ms) = summary["continuous"], summary["partial"]
    print(
        f"bench_partial: continuous_tok_s={c_tok:.0f} partial_tok_s={p_tok:.0f} "
        f"ratio={p_tok / c_tok:.2f} util_continuous={c_util:.2f} util_partial={p_util:.2f} "
        f"ms_step_continuous={c_ms:.2f} ms_step_partial={p_ms:.2f}"
    )


if __name__ == "__main__":
    main()
