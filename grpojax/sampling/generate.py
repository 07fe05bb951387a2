"""Jitted batched generation: shared prompt prefill, group sampling, early-stopping decode loop.

`generate` is the driver's rollout call, with three engines: this module's static one
(below), the continuous-batching one (`grpojax.sampling.continuous`, `engine="continuous"`:
a pool of decode slots refilled as samples end) and the compacting one
(`grpojax.sampling.compact`, `engine="compact"`: rows compacted as samples end), which
return the same `Rollout` and draw the same tokens (`grpojax.sampling.rollout`). Static
engine: left-padded prompts are re-padded to a bucket width P (so a new prompt length within
a bucket reuses the compiled program) and prefilled once per prompt (B rows) into a prompt
cache that the N = B*G completions read as their shared `prefix` (one prefill and one copy
of each prompt's keys per group; each row's own cache holds only its completion).
`lax.while_loop`s then decode one token per step for all N rows and stop as soon as every
row has emitted a stop token; for long completions the decode runs in up to `decode_loops`
loops whose steps read only the cache slots they can have filled. The whole call is one
compiled program per (bucket, shapes, config): the model's graph definition is a static
argument and its state a traced one.

The model is a `grpojax.models` decoder: `model(tokens_nt, *, positions_nt, mask_nt, cache,
layer_params) -> (hidden_ntd, cache)` writing the T new tokens at `cache.index`, with the
weights of `model.layer_params(fuse=...)` built once per call, `model.logits(hidden_ntd)`
`[N, T, V]` f32, and a `KVCache` (`k: [L, N, K, H, S]`, `v: [L, N, K, S, H]`,
`mask_ns: [N, S]`, `index`) from `init_cache(model.config, ...)`: S = max_new_tokens for the
completions after a `prefix` of B rows and P slots (shared prefill), S = P + max_new_tokens
without one.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import Array
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from grpojax.models import sharding
from grpojax.models.decoder import init_cache
from grpojax.models.precision import COMPILER_OPTIONS, cast_floating, compute_dtype_of
from grpojax.models.sharding import put_global
from grpojax.ops.checks import check_int
from grpojax.ops.masks import MIN_PROMPT_WIDTH, PROMPT_BUCKET, mask_from_lengths, padded_width
from grpojax.sampling import compact, continuous
from grpojax.sampling.rollout import (
    Rollout,
    Spec,
    batch_constraint,
    cache_constraint,
    check_prompts,
    count_trace,
    empty_outputs,
    generate_trace_count,
    record_step,
    token_keys,
)
from grpojax.sampling.transforms import SamplingConfig, sample_tokens

__all__ = ["ENGINES", "Rollout", "bucket_width", "generate", "generate_trace_count"]

ENGINES = ("static", "continuous", "compact")


def bucket_width(
    length: int, *, bucket: int | str = PROMPT_BUCKET, min_width: int = MIN_PROMPT_WIDTH
) -> int:
    """The padded prompt width P for a longest prompt of `length` tokens.

    `grpojax.ops.masks.padded_width`, with `min_width` applied to the named buckets only (an
    explicit int multiple is taken as given). The defaults are the library's one prompt-width
    rule (`grpojax.ops.masks.prompt_width`).
    """
    if length < 1:
        raise ValueError(f"prompt length must be >= 1, got {length}")
    named = isinstance(bucket, str)
    return padded_width(length, bucket=bucket, min_width=min_width if named else 1)


def _generate_impl(graphdef, state, prompt_bp, lengths_b, budget_n, key, spec: Spec):
    count_trace()
    # Cast float32 masters to the compute dtype once per call rather than once per decode
    # step inside the loop: bit-identical (the decoder casts each parameter the same way
    # where it uses it), and the loop reads half the bytes of weights.
    state = cast_floating(state, compute_dtype_of(nnx.merge(graphdef, state)))
    model = nnx.merge(graphdef, state)
    b, p = prompt_bp.shape
    g, t_new, mesh = spec.group_size, spec.max_new_tokens, spec.mesh
    n = b * g
    max_len = p + t_new

    prompt_bp = batch_constraint(prompt_bp, mesh)
    mask_bp = mask_from_lengths(lengths_b, p, offset_n=p - lengths_b)
    pos_bp = jnp.maximum(jnp.cumsum(mask_bp, axis=1, dtype=jnp.int32) - 1, 0)
    lengths_n = jnp.repeat(lengths_b, g)
    # The weights every model call below reads, built once, with q|k|v and gate|up fused
    # into one matmul each (generate 5-7% faster on a 2-core CPU). Apart when the mesh
    # shards heads over `tensor`: concatenating them would reshard them.
    layers = model.layer_params(fuse=mesh is None or dict(mesh.shape).get("tensor", 1) == 1)

    routed = spec.record_routing  # each model call below also returns its routing
    run = functools.partial(model, layer_params=layers, return_routing=routed)

    prefix = None
    if spec.shared_prefill:
        prefix = init_cache(model.config, b, p, spec.cache_dtype)
        hidden, prefix, *route = run(
            prompt_bp, positions_nt=pos_bp, mask_nt=mask_bp, cache=prefix, prefill=True
        )
        prompt_route = [jnp.repeat(r.experts_ntlk, g, axis=0) for r in route]  # [N, P, L, k]
        prefix = cache_constraint(prefix, mesh)
        # Left padding puts every prompt's last real token in column P - 1.
        logits_n = jnp.repeat(model.logits(hidden[:, -1:])[:, 0], g, axis=0)
        # Each row's own cache holds its completion; the last sampled token is never fed.
        cache, base = init_cache(model.config, n, t_new, spec.cache_dtype), 0
    else:
        cache, base = init_cache(model.config, n, max_len, spec.cache_dtype), p
        rep = lambda x: batch_constraint(jnp.repeat(x, g, axis=0), mesh)
        hidden, cache, *route = run(
            rep(prompt_bp),
            positions_nt=rep(pos_bp),
            mask_nt=rep(mask_bp),
            cache=cache,
            prefill=True,
        )
        prompt_route = [r.experts_ntlk for r in route]
        logits_n = model.logits(hidden[:, -1:])[:, 0]
    cache = cache_constraint(cache, mesh)
    logits_n = batch_constraint(logits_n, mesh)

    next_key, gen_key = jax.random.split(key)
    stop_ids = jnp.asarray(spec.stop_ids, jnp.int32)

    rows_n = jnp.arange(n, dtype=jnp.int32)

    def sample_at(t, logits_n):
        # key(sample, step) (`rollout.token_keys`): independent of which rows are done and of P.
        keys = token_keys(gen_key, rows_n, jnp.full((n,), t, jnp.int32))
        return sample_tokens(logits_n, keys, config=spec.sampling)

    def record(t, out, bufs, done_n, len_n, ended_n):
        """Write step t's sample for the rows not yet ended; update done (a stop token),
        lengths and ended (done, or the row's budget reached)."""
        live_n = ~ended_n
        bufs = (*record_step(bufs[:4], out, t, live_n, spec.pad_id)[0], *bufs[4:])
        if spec.stop_ids:
            done_n = done_n | (live_n & jnp.isin(out.token_n, stop_ids))
        len_n = len_n + live_n.astype(jnp.int32)
        return bufs, done_n, len_n, ended_n | done_n | (len_n >= budget_n)

    bufs = tuple(batch_constraint(x, mesh) for x in empty_outputs((n, t_new), spec.pad_id))
    if routed:  # completion token t's routing, written when it is fed (experts 0..k-1 before)
        c = model.config
        unfed = jnp.arange(c.num_experts_per_tok, dtype=jnp.int32)
        shape = (n, t_new, c.num_layers, c.num_experts_per_tok)
        bufs += (batch_constraint(jnp.broadcast_to(unfed, shape), mesh),)
    done_n = jnp.zeros((n,), jnp.bool_)
    len_n = jnp.zeros((n,), jnp.int32)
    out0 = sample_at(0, logits_n)
    bufs, done_n, len_n, ended_n = record(0, out0, bufs, done_n, len_n, done_n)

    def cond(carry, t_end):
        t, _, _, _, _, _, ended_n = carry
        return (t < t_end) & ~jnp.all(ended_n)

    def body(carry, extent):
        t, cache, prev_tok_n, bufs, done_n, len_n, ended_n = carry
        model = nnx.merge(graphdef, state)
        hidden, cache, *route = model(
            prev_tok_n[:, None],
            positions_nt=(lengths_n + t - 1)[:, None],
            mask_nt=jnp.ones((n, 1), jnp.bool_),
            cache=cache,
            prefix=prefix,
            layer_params=layers,
            cache_extent=base + extent,
            return_routing=routed,
        )
        if routed:  # token t - 1 was fed at this step
            fed = route[0].experts_ntlk
            bufs = (*bufs[:4], jax.lax.dynamic_update_slice_in_dim(bufs[4], fed, t - 1, 1))
        logits_n = batch_constraint(model.logits(hidden)[:, 0], mesh)
        out = sample_at(t, logits_n)
        bufs, done_n, len_n, ended_n = record(t, out, bufs, done_n, len_n, ended_n)
        return t + 1, cache_constraint(cache, mesh), out.token_n, bufs, done_n, len_n, ended_n

    carry = (jnp.int32(1), cache, out0.token_n, bufs, done_n, len_n, ended_n)
    # One loop per (extent, end step) of the plan, each stopping once every row has ended.
    for extent, t_end in spec.decode_plan:
        carry = jax.lax.while_loop(
            functools.partial(cond, t_end=t_end),
            functools.partial(body, extent=extent),
            carry,
        )
    steps, _, _, bufs, done_n, len_n, _ = carry
    routing = jnp.concatenate([prompt_route[0], bufs[4]], axis=1) if routed else None
    return Rollout.from_outputs(
        prompt_bp, lengths_b, bufs[:4], len_n, done_n, next_key, steps, n, routing
    )


_generate_jit = jax.jit(_generate_impl, static_argnums=(0, 6), compiler_options=COMPILER_OPTIONS)


DECODE_LOOPS = 4  # `generate`'s and the driver's `rollout.decode_loops` default
DECODE_CHUNK_MIN = 128
DECODE_EXTENT_MULTIPLE = 8  # extents rounded up to it: whole vectors of keys per slice row


def decode_plan(max_new_tokens: int, loops: int) -> tuple[tuple[int, int], ...]:
    """`(extent, end)` of each decode loop: it runs steps t < end and reads the first `extent`
    completion slots. Steps t = 1 .. T-1 feed token t-1 into slot t-1 and read the t-1 filled
    slots before it. They are split into n equal chunks, n = (T-1) / `DECODE_CHUNK_MIN`
    rounded, between 1 and `loops`, each loop reading what its last step needs, rounded up to
    a multiple of `DECODE_EXTENT_MULTIPLE` (at most T). T 512, 4 loops: (128, 129),
    (256, 257), (384, 385), (512, 512); T <= 192: one loop reading all T slots."""
    steps, m = max_new_tokens - 1, DECODE_EXTENT_MULTIPLE
    if steps < 1:  # T = 1: the prefill samples the only token
        return ()
    n = min(loops, max(1, (steps + DECODE_CHUNK_MIN // 2) // DECODE_CHUNK_MIN))
    chunk = -(-steps // n)
    ends = [min(1 + i * chunk, max_new_tokens) for i in range(1, n + 1)]
    extent = lambda end: min(max_new_tokens, max(1, -(-(end - 2) // m) * m))
    return tuple((extent(end), end) for end in ends)


def generate(
    model,
    prompt_tokens_bp,
    prompt_lengths_b,
    *,
    key: Array,
    max_new_tokens: int,
    group_size: int = 1,
    sampling: SamplingConfig | None = None,
    eos_ids: tuple[int, ...] | list[int] | int = (),
    stop_ids: tuple[int, ...] | list[int] = (),
    pad_id: int = 0,
    bucket: int | str = PROMPT_BUCKET,
    min_bucket_width: int = MIN_PROMPT_WIDTH,
    shared_prefill: bool = True,
    mesh: Mesh | None = None,
    cache_dtype: Any = None,
    decode_loops: int = DECODE_LOOPS,
    engine: str = "static",
    slots: int | None = None,
    token_budget_n=None,
    record_routing: bool = False,
    lower: bool = False,
) -> Rollout | jax.stages.Lowered:
    """Sample G completions for each of B left-padded prompts with one compiled program.

    Row n = b*G + g is sample g of prompt b. Each step draws x_t ~ pi(. | prompt, x_<t) through
    `sample_tokens` (temperature / top-k / top-p / min-p per `sampling`); a row ends after it
    emits any of `eos_ids` or `stop_ids` (that token is part of the completion) or after
    `max_new_tokens` (or its own `token_budget_n`). The loop exits once every row has ended.
    Token t of row n is drawn with key(n, t) (`grpojax.sampling.rollout`), so every engine,
    any slot count and any mesh draw the same tokens for the same key.

    Args:
      model: an NNX decoder following the contract in the module docstring.
      prompt_tokens_bp: `[B, W]` int prompts, left-padded (real tokens at the right).
      prompt_lengths_b: `[B]` int real prompt lengths, 1 <= len <= W (host-readable: the bucket
        width is chosen from their maximum).
      key: `jax.random` key; the same key gives the same rollout. `Rollout.key` is the advanced
        key for the next call.
      max_new_tokens: T, completion buffer width and cap.
      group_size: G completions per prompt.
      sampling: the `SamplingConfig` (temperature 0 = greedy); default: temperature 1.
      eos_ids: token ids that end a completion (a row that ends on one has `eos_found_n`
        true). Empty, with `stop_ids`: always generate T tokens.
      stop_ids: more ids that end a completion, treated as `eos_ids` are.
      pad_id: the token written after a completion's end and in the prompt's left padding.
      bucket: "compact" (the library's rule), "pow2" or an int multiple; the prompt width
        P = bucket_width(max length).
      min_bucket_width: smallest P with a named bucket.
      shared_prefill: prefill each prompt once and repeat its KV cache G times (True), or
        prefill all N rows separately (False; for comparison only — same results).
      mesh: optional mesh with axes among (data, fsdp, tensor): the batch is sharded over the
        data axes; the model state keeps its own sharding. `None`: no constraints.
      cache_dtype: KV cache dtype (default: the model's choice).
      decode_loops: decode in up to this many loops (`decode_plan`); loop i (from 1) reads
        only about the first i*T/loops completion slots of the cache, in chunks of about
        `DECODE_CHUNK_MIN` steps or more (T <= 192: one loop). Less cache copied and read per step
        (`generate` at T 512: 1.49x on a 2-core CPU, 1.05x on an H100 at the 0.5B shape;
        docs/performance/step-time.md), one more compiled loop body each. The same function
        as one loop: in float32 the same tokens, logprobs within float32 rounding; in bf16
        the attention's sums over fewer slots round differently, and a row whose draw
        changes diverges.
      engine: "static" (all N rows decoded in lock step until the last ends),
        "continuous" (`grpojax.sampling.continuous`: a pool of `slots` decode slots, each
        refilled with the next pending sample when its sample ends) or "compact"
        (`grpojax.sampling.compact`: all N rows in lock step, the live ones compacted into
        fewer rows as samples end, the cache widened as the step grows, the layers
        unrolled; its own cache phases, not `decode_loops`; a few programs and host round
        trips a call). The same rollout.
      slots: the continuous engine's slot count, 1 .. N (None: `continuous.auto_slots`);
        rounded up to a multiple of the mesh's data shards.
      token_budget_n: `[N]` int per-row caps on the completion length, 1 .. max_new_tokens
        (None: max_new_tokens for every row); a row that reaches its cap without a stop id
        ends truncated (`eos_found_n` false).
      record_routing: a mixture-of-experts model's routing of every token is returned as
        `Rollout.routing_nslk` (for routing replay in the trainer's forward); static engine.
      lower: return the program this call would run, lowered and not run
        (`jax.stages.Lowered`: `.compile().memory_analysis()` gives its KV cache and other
        buffers' bytes, `.cost_analysis()` its FLOPs).

    Returns:
      A `Rollout` (see its docstring for shapes), or with `lower` the lowered program.
    """
    check_int("max_new_tokens", max_new_tokens)
    check_int("group_size", group_size)
    check_int("decode_loops", decode_loops)
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    sampling = SamplingConfig() if sampling is None else sampling
    if not isinstance(sampling, SamplingConfig):
        raise ValueError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
    if isinstance(eos_ids, int):
        eos_ids = (eos_ids,)
    stops = tuple(sorted({int(i) for i in (*eos_ids, *stop_ids)}))

    lengths = np.asarray(prompt_lengths_b).astype(np.int32)
    prompts = np.asarray(jax.device_get(prompt_tokens_bp)).astype(np.int32)
    check_prompts(prompts, lengths, rows="b")
    width = prompts.shape[1]
    p = bucket_width(int(lengths.max()), bucket=bucket, min_width=min_bucket_width)
    if p < width:  # drop left columns that are padding in every row
        prompts = prompts[:, width - p :]
    elif p > width:
        prompts = np.pad(prompts, ((0, 0), (p - width, 0)), constant_values=pad_id)
    # Padding never reaches the model unmasked, but keep it clean for the trainer's view.
    real = np.arange(p)[None, :] >= (p - lengths)[:, None]
    prompts = np.where(real, prompts, pad_id).astype(np.int32)
    if mesh is not None:
        # Host inputs become global arrays: every process passes the same prompts and key
        # (multi-process runs), each device receives its rows.
        prompts, lengths = put_global(
            (prompts, lengths),
            (
                sharding.batch_sharding(mesh, 2, prompts.shape),
                sharding.batch_sharding(mesh, 1, lengths.shape),
            ),
        )
        key = put_global(key, NamedSharding(mesh, PartitionSpec()))

    n = prompts.shape[0] * group_size
    if token_budget_n is None:
        budget = np.full((n,), max_new_tokens, np.int32)
    else:
        budget = np.asarray(token_budget_n)
        if budget.shape != (n,) or budget.min() < 1 or budget.max() > max_new_tokens:
            got = f"shape {budget.shape}" + (
                f", values {budget.min()}..{budget.max()}" if budget.size else ""
            )
            raise ValueError(f"token_budget_n must be [{n}] ints in [1, {max_new_tokens}], {got}")
        budget = budget.astype(np.int32)
    if mesh is not None:
        budget = put_global(budget, sharding.batch_sharding(mesh, 1, budget.shape))
    if record_routing and not (engine == "static" and model.config.is_moe):
        raise ValueError(
            "record_routing needs a mixture-of-experts model (config.num_experts > 0) and "
            f"engine='static', got num_experts={model.config.num_experts}, engine={engine!r}"
        )
    n_slots, queues = 0, 1
    if engine == "continuous":
        n_slots, queues = continuous.plan_slots(n, prompts.shape[0], slots, mesh)
    elif engine == "compact":
        if lower:
            raise ValueError("lower needs engine 'static' or 'continuous' (one program)")
        queues = continuous.plan_slots(n, prompts.shape[0], None, mesh)[1]
    spec = Spec(
        group_size=group_size,
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        stop_ids=stops,
        pad_id=int(pad_id),
        shared_prefill=bool(shared_prefill),
        mesh=mesh,
        cache_dtype=cache_dtype,
        decode_plan=decode_plan(
            max_new_tokens, compact.WIDTH_PHASES if engine == "compact" else decode_loops
        ),
        slots=n_slots,
        queues=queues,
        record_routing=bool(record_routing),
    )
    graphdef, state = nnx.split(model)
    args = (
        graphdef, state, jnp.asarray(prompts), jnp.asarray(lengths), jnp.asarray(budget), key,
        spec,
    )  # fmt: skip
    programs: dict[str, Any] = dict(
        continuous=continuous.continuous_jit, compact=compact.generate_compact
    )
    program = programs.get(engine, _generate_jit)
    run = program.lower if lower else program
    if mesh is None:
        return run(*args)
    # The model constrains its activations only under a mesh set with jax.set_mesh.
    with jax.set_mesh(mesh):
        return run(*args)
