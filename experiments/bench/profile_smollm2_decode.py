"""Where a decode step's time goes on SmolLM2-135M-Instruct (30 layers, D 576, vocabulary
49,152, float32), at the row counts and cache depths a chat rollout passes through.

A decode step of the compacting engine (`grpojax.sampling.compact`) is, for R live rows at
cache extent E: the 30 layers on one token a row (`Decoder.decode_step`: the weight matmuls,
the attention over E cached positions, the norms and RoPE, the cache write), the output
layer (`Decoder.logits`: [R, D] x [D, V]), and the draw (`sample_tokens`: per-row keys, a
Gumbel draw over the V logits, their logsumexp, the sampled token's logprob). Each part is
jitted alone and timed at the step's shapes (the fastest of `--repeats` calls of a loop of
`--steps` steps, so dispatch is amortized), and the whole step (the three in one program,
as the engine's loop body runs them) beside them. Against them: the weights' and the
cache's bytes a step reads at this machine's read bandwidth, and the step's FLOPs at its
float32 matmul peak (`benchlib.read_bandwidth`, `benchlib.matmul_peak`).

    python experiments/bench/profile_smollm2_decode.py [--rows 128 64 32 8] [--extents 160 448]

Last line: `profile_smollm2_decode: rows=.. extent=.. step_ms=.. layers=.. attention=..
head=.. draw=.. peak_frac=..` (the shares of the summed parts at the first row count and the
last extent; peak_frac: the step's FLOPs at peak over its time).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tools"))  # fetch_smollm2

from benchlib import machine, matmul_peak, read_bandwidth
from fetch_smollm2 import DEFAULT_DIR, fetch


def timed(fn, *args, repeats: int) -> float:
    """Seconds of the fastest of `repeats` calls (after one warm-up call)."""
    import jax

    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", default=None)
    parser.add_argument("--rows", type=int, nargs="+", default=[128, 64, 32, 8])
    parser.add_argument("--extents", type=int, nargs="+", default=[160, 448])
    parser.add_argument("--steps", type=int, default=8, help="steps per timed loop")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from grpojax.models import from_pretrained
    from grpojax.models.decoder import LayerCache, split_layers
    from grpojax.sampling import SamplingConfig
    from grpojax.sampling.rollout import token_keys
    from grpojax.sampling.transforms import sample_tokens

    path = pathlib.Path(args.gguf) if args.gguf else fetch(DEFAULT_DIR)
    model = from_pretrained(path)
    c = model.config
    graphdef, state = nnx.split(model)
    sampling = SamplingConfig(temperature=1.0)
    n_steps = args.steps

    def layers_of(state):
        m = nnx.merge(graphdef, state)
        return m, split_layers(m.layer_params(fuse=True), m.config.num_layers)

    def cache_for(r, e):
        layers = range(c.num_layers)
        k = tuple(jnp.zeros((r, c.num_kv_heads, c.head_dim, e), jnp.float32) for _ in layers)
        v = tuple(jnp.zeros((r, c.num_kv_heads, e, c.head_dim), jnp.float32) for _ in layers)
        mask = jnp.ones((r, e), bool)
        return LayerCache(k=k, v=v, mask_ns=mask, index=jnp.asarray(e - n_steps - 1, jnp.int32))

    @jax.jit
    def layers_only(state, tok, pos, cache):
        m, layers = layers_of(state)

        def body(i, carry):
            tok, cache, acc = carry
            h, cache = m.decode_step(tok, pos + i, cache, layers)
            return tok, cache, acc + h[0, 0, 0]

        return jax.lax.fori_loop(0, n_steps, body, (tok, cache, 0.0))[2]

    @jax.jit
    def head_only(state, h):
        m = nnx.merge(graphdef, state)

        def body(i, acc):
            return acc + m.logits(h + acc)[:, 0, 0].sum()

        return jax.lax.fori_loop(0, n_steps, body, 0.0)

    @jax.jit
    def draw_only(logits, key, sample):
        def body(i, acc):
            keys = token_keys(key, sample, jnp.full_like(sample, i))
            out = sample_tokens(logits + acc, keys, config=sampling)
            return acc + out.logp_n.sum() * 0.0 + out.token_n.sum().astype(jnp.float32) * 0.0

        return jax.lax.fori_loop(0, n_steps, body, 0.0)

    @jax.jit
    def whole(state, tok, pos, cache, key, sample):
        m, layers = layers_of(state)

        def body(i, carry):
            tok, cache = carry
            h, cache = m.decode_step(tok, pos + i, cache, layers)
            keys = token_keys(key, sample, jnp.full_like(sample, i))
            out = sample_tokens(m.logits(h)[:, 0], keys, config=sampling)
            return out.token_n, cache

        return jax.lax.fori_loop(0, n_steps, body, (tok, cache))[0]

    bandwidth = read_bandwidth(512)
    peak = matmul_peak()
    weights = sum(x.size for x in jax.tree.leaves(state)) * 4
    print(f"machine: {machine()}")
    print(
        f"jax {jax.__version__}; SmolLM2-135M-Instruct (GGUF -> float32), L {c.num_layers} "
        f"D {c.hidden_size} V {c.vocab_size}; read bandwidth {bandwidth / 1e9:.1f} GB/s, "
        f"float32 matmul peak {peak / 1e9:.0f} GFLOP/s; each part the fastest of "
        f"{args.repeats} loops of {n_steps} steps"
    )
    header = (
        f"{'rows':>4} {'extent':>6} {'step ms':>8} {'layers':>7} {'attn':>6} {'head':>6} "
        f"{'draw':>6} {'sum':>6} {'layers%':>7} {'head%':>6} {'draw%':>6} {'tok/s':>7} "
        f"{'floor ms':>8} {'peak%':>6}"
    )
    print(header)
    first = None
    key = jax.random.key(0)
    for r in args.rows:
        for e in args.extents:
            tok = jnp.ones((r,), jnp.int32)
            pos = jnp.full((r,), e - n_steps - 1, jnp.int32)
            sample = jnp.arange(r, dtype=jnp.int32)
            cache = cache_for(r, e)
            h = jnp.ones((r, 1, c.hidden_size), jnp.float32)
            logits = jax.random.normal(key, (r, c.vocab_size), jnp.float32)
            t_layers = timed(layers_only, state, tok, pos, cache, repeats=args.repeats) / n_steps
            # The attention's share: the layers at a 1-slot-deep cache cost the rest.
            small = cache_for(r, n_steps + 2)
            pos1 = jnp.zeros((r,), jnp.int32)
            t_flat = timed(layers_only, state, tok, pos1, small, repeats=args.repeats) / n_steps
            t_head = timed(head_only, state, h, repeats=args.repeats) / n_steps
            t_draw = timed(draw_only, logits, key, sample, repeats=args.repeats) / n_steps
            t_step = timed(whole, state, tok, pos, cache, key, sample, repeats=args.repeats)
            t_step /= n_steps
            parts = t_layers + t_head + t_draw
            # 2 FLOPs per weight a token (the tied embedding once, as the output layer) and
            # the attention's q.k and p.v over E positions.
            flops = r * 2 * weights / 4 + r * 4 * c.num_layers * c.num_heads * c.head_dim * e
            kv = 2 * r * c.num_layers * c.num_kv_heads * c.head_dim * e * 4
            floor = max((weights + kv) / bandwidth, flops / peak)
            print(
                f"{r:>4} {e:>6} {t_step * 1e3:>8.2f} {t_layers * 1e3:>7.2f} "
                f"{(t_layers - t_flat) * 1e3:>6.2f} {t_head * 1e3:>6.2f} {t_draw * 1e3:>6.2f} "
                f"{parts * 1e3:>6.2f} {t_layers / parts:>7.0%} {t_head / parts:>6.0%} "
                f"{t_draw / parts:>6.0%} {r / t_step:>7.0f} {floor * 1e3:>8.2f} "
                f"{flops / peak / t_step:>6.0%}",
                flush=True,
            )
            if first is None or (r == args.rows[0] and e == args.extents[-1]):
                first = (r, e, t_step, t_layers / parts, (t_layers - t_flat) / parts,
                         t_head / parts, t_draw / parts, flops / peak / t_step)  # fmt: skip
    r, e, t_step, f_layers, f_attn, f_head, f_draw, f_peak = first
    print(
        f"profile_smollm2_decode: rows={r} extent={e} step_ms={t_step * 1e3:.2f} "
        f"layers={f_layers:.2f} attention={f_attn:.2f} head={f_head:.2f} draw={f_draw:.2f} "
        f"peak_frac={f_peak:.2f}"
    )


if __name__ == "__main__":
    main()
