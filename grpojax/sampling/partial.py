"""Partial rollouts: a slot engine whose samples outlive a weight update.

The pipelined loop (`rollout.max_staleness = k`) trains round s at step s. Decoding each
round whole, with one version of the weights, leaves the slots of the continuous engine
idle while the round's longest samples finish (the drain). Here the slots persist across
RL steps instead: a `Window` holds the k rounds in flight (R = k + 1 with the one added at a
step), its M = R*N samples are admitted to S slots in order (round by round, sample by
sample), and each step's call (`PartialDecoder.advance`, with that step's weights)

  1. appends round s + k (its prompts and key, nothing decoded);
  2. recomputes every live slot's KV cache with the new weights: one prefill of the
     slot's prompt and the completion tokens it has decoded so far. The keys and values an
     older version computed are not kept: a continued token then depends on one policy only,
     so its logprob is that version's (the trainer's importance weights are exact per
     token) and the window's state is tokens, not caches (a checkpoint holds no cache);
  3. decodes as the continuous engine does (`grpojax.sampling.continuous`: free slots
     refilled from the prompts' prefilled caches, one token per slot per step, the cache
     read up to a few static extents) until every sample of the window's first round,
     round s, has ended: the slots freed meanwhile take rounds s + 1 .. s + k's samples,
     so they do not drain;
  4. returns round s (its `Rollout` and `[N, T]` versions: the step that decoded each
     token) and the window of rounds s + 1 .. s + k, partly decoded.

Every token of round r is decoded by a call in [r - k, r] (the round joins at call r - k and
is finished by call r), so a token trained at step r is at most k steps stale: the bound
holds per token by construction, not by discarding samples. Token t of sample n of a round
is drawn with key(n, t) of the round's key (`grpojax.sampling.rollout.token_keys`): with
the same weights at every call the rounds are the continuous engine's, token for token.
Sample m of the window (round m // N, sample m % N) is prompt m // G of the window.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import Array
from jax.sharding import NamedSharding, PartitionSpec

from grpojax.models.decoder import init_cache
from grpojax.models.precision import COMPILER_OPTIONS, cast_floating, compute_dtype_of
from grpojax.ops.masks import mask_from_lengths
from grpojax.sampling.continuous import auto_slots, cache_extents
from grpojax.sampling.generate import DECODE_LOOPS, decode_plan
from grpojax.sampling.rollout import (
    Rollout,
    Spec,
    batch_constraint,
    cache_constraint,
    count_trace,
    empty_outputs,
)
from grpojax.sampling.transforms import SamplingConfig, sample_tokens

__all__ = ["PartialDecoder", "Window"]


@flax.struct.dataclass
class Window:
    """The rounds in flight between calls: Q rounds of B prompts, N = B*G samples each,
    M = Q*N samples (round q's sample n is m = q*N + n), S slots.

    prompts_qbp: `[Q, B, P]` int32 prompts, left-padded to the fixed width P.
    lengths_qb: `[Q, B]` int32 real prompt lengths.
    keys_q: `[Q, 2]` uint32 the rounds' keys' data (token t of sample n: key(n, t) of its
      round's key).
    tokens_mt, logp_mt, keep_count_mt, keep_threshold_mt: `[M, T]` as `Rollout`'s, so far.
    version_mt: `[M, T]` int32 the version (RL steps taken) of the weights that decoded
      each token; 0 past a sample's decoded tokens.
    lengths_m: `[M]` int32 tokens decoded so far (the completion length once ended).
    ended_m, eos_m: `[M]` bool the sample has ended; ended on a stop id.
    slot_sample_s: `[S]` int32 the window sample each slot decodes (-1: free).
    admitted: `[]` int32 samples given a slot so far (samples 0 .. admitted - 1).
    """

    prompts_qbp: Array
    lengths_qb: Array
    keys_q: Array
    tokens_mt: Array
    logp_mt: Array
    keep_count_mt: Array
    keep_threshold_mt: Array
    version_mt: Array
    lengths_m: Array
    ended_m: Array
    eos_m: Array
    slot_sample_s: Array
    admitted: Array


def _empty_samples(m: int, t: int, pad_id: int) -> tuple[Array, ...]:
    """(tokens, logp, keep count, keep threshold, version) `[M, T]`, lengths, ended, eos `[M]`."""
    return (
        *empty_outputs((m, t), pad_id),
        jnp.zeros((m, t), jnp.int32),
        jnp.zeros((m,), jnp.int32),
        jnp.zeros((m,), jnp.bool_),
        jnp.zeros((m,), jnp.bool_),
    )


def _advance_impl(graphdef, state, win: Window, prompt_bp, lengths_b, key, version, spec: Spec):
    """(round s's Rollout, its `[N, T]` versions, the window of the rounds after it, tokens
    decoded by this call) for the window with round s + k (`prompt_bp`, `key`) appended."""
    count_trace()
    state = cast_floating(state, compute_dtype_of(nnx.merge(graphdef, state)))
    model = nnx.merge(graphdef, state)
    q_held, b, p = win.prompts_qbp.shape
    g, t_new, mesh, s = spec.group_size, spec.max_new_tokens, spec.mesh, spec.slots
    n = b * g
    m_all = (q_held + 1) * n
    width = p - 1 + t_new
    extents = cache_extents(p, t_new, spec.decode_plan)
    i32 = jnp.int32
    layers = model.layer_params(fuse=mesh is None or dict(mesh.shape).get("tensor", 1) == 1)
    rows = lambda x: batch_constraint(x, mesh)

    # 1. The window with the new round appended (module docstring).
    prompts_mp = jnp.concatenate([win.prompts_qbp, prompt_bp[None]]).reshape(-1, p)
    plen = jnp.concatenate([win.lengths_qb, lengths_b[None]]).reshape(-1)
    keys_q = jax.random.wrap_key_data(
        jnp.concatenate([win.keys_q, jax.random.key_data(key)[None]]), impl=jax.random.key_impl(key)
    )
    fresh = _empty_samples(n, t_new, spec.pad_id)
    held = (
        win.tokens_mt, win.logp_mt, win.keep_count_mt, win.keep_threshold_mt, win.version_mt,
        win.lengths_m, win.ended_m, win.eos_m,
    )  # fmt: skip
    bufs = tuple(rows(jnp.concatenate([h, f])) for h, f in zip(held[:5], fresh[:5]))
    len_m, ended_m, eos_m = (jnp.concatenate([h, f]) for h, f in zip(held[5:], fresh[5:]))
    sample_s = win.slot_sample_s

    # The prompts (Q + 1 rounds' B), prefilled with these weights: refills copy from here.
    prompts_mp = rows(prompts_mp)
    pmask = mask_from_lengths(plen, p, offset_n=p - plen)
    ppos = jnp.maximum(jnp.cumsum(pmask, axis=1, dtype=i32) - 1, 0)
    prompts = init_cache(model.config, prompts_mp.shape[0], p, spec.cache_dtype)
    _, prompts = model(
        prompts_mp, positions_nt=ppos, mask_nt=pmask, cache=prompts, prefill=True,
        layer_params=layers,
    )  # fmt: skip
    prompts = cache_constraint(prompts, mesh)
    # A slot's first step feeds the prompt's last token (column P - 1) again: not yet readable.
    slot_mask_pw = jnp.pad(pmask & (jnp.arange(p) < p - 1)[None, :], ((0, 0), (0, t_new - 1)))

    # 2. The live slots' caches, recomputed: prompt + the completion decoded so far, whose
    # last token the next step feeds (a live slot has decoded t >= 1 tokens; step t reads
    # the P - 1 + t slots before its write slot). A free slot prefills one real token.
    live_s = sample_s >= 0
    m_s = jnp.maximum(sample_s, 0)
    t_s = jnp.where(live_s, len_m[m_s], 0)
    pb_s = m_s // g
    col = jnp.arange(width, dtype=i32)[None, :]
    row_sw = jnp.concatenate([prompts_mp[pb_s], bufs[0][m_s, : t_new - 1]], axis=1)
    pmask_sw = jnp.pad(pmask[pb_s], ((0, 0), (0, t_new - 1)))
    done_mask = jnp.where(col < p, pmask_sw, col < p - 1 + t_s[:, None])
    mask_sw = jnp.where(live_s[:, None], done_mask, col == p - 1)
    pos_sw = jnp.maximum(jnp.cumsum(mask_sw, axis=1, dtype=i32) - 1, 0)
    empty = init_cache(model.config, s, width, spec.cache_dtype)

    def recompute(extent: int):
        """The slots' first `extent` cache slots prefilled (the deepest live slot's fit)."""

        def run(_):
            sub = init_cache(model.config, s, extent, spec.cache_dtype)
            at = lambda x: rows(x[:, :extent])
            _, sub = model(
                at(row_sw), positions_nt=at(pos_sw), mask_nt=at(mask_sw), cache=sub,
                prefill=True, layer_params=layers,
            )  # fmt: skip
            return empty.replace(
                k=empty.k.at[..., :extent].set(sub.k),
                v=empty.v.at[:, :, :, :extent].set(sub.v),
                mask_ns=mask_sw,
            )

        return run

    # Only as many columns as the deepest live slot has filled, at one of the decode's
    # extents: the prefill's cost follows the slots' depth, not the cache's width.
    deepest = jnp.max(jnp.where(live_s, p - 1 + t_s, 0))
    branch = jnp.searchsorted(jnp.asarray(extents, i32), deepest).astype(i32)
    cache = jax.lax.switch(branch, [recompute(e) for e in extents], None)
    cache = cache_constraint(
        dataclasses.replace(cache, index=jnp.where(live_s, p - 1 + t_s, 0)), mesh
    )
    tok_s = jnp.where(live_s, bufs[0][m_s, jnp.maximum(t_s - 1, 0)], 0)
    pos_s = jnp.where(live_s, plen[pb_s] - 1 + t_s, 0)
    decoded_before = jnp.sum(len_m)

    stop_ids = jnp.asarray(spec.stop_ids, i32)

    def refill(carry):
        """Give each free slot the next sample not yet admitted (continuous engine's 1)."""
        cache, sample_s, t_s, tok_s, pos_s, admitted = carry
        free_s = sample_s < 0
        next_s = admitted + jnp.cumsum(free_s, dtype=i32) - 1
        take_s = free_s & (next_s < m_all)
        admitted = admitted + jnp.sum(take_s, dtype=i32)
        next_s = jnp.where(take_s, next_s, 0)
        pb_s = next_s // g
        sample_s = jnp.where(take_s, next_s, sample_s)
        t_s = jnp.where(take_s, 0, t_s)
        tok_s = jnp.where(take_s, prompts_mp[pb_s, p - 1], tok_s)
        pos_s = jnp.where(take_s, plen[pb_s] - 1, pos_s)

        def copy_prompts(cache):
            keep = lambda new, old, dims: jnp.where(take_s.reshape(dims), new, old)
            k_new = keep(prompts.k[:, pb_s], cache.k[..., :p], (1, s, 1, 1, 1))
            v_new = keep(prompts.v[:, pb_s], cache.v[:, :, :, :p], (1, s, 1, 1, 1))
            return cache.replace(
                k=cache.k.at[..., :p].set(k_new),
                v=cache.v.at[:, :, :, :p].set(v_new),
                mask_ns=keep(slot_mask_pw[pb_s], cache.mask_ns, (s, 1)),
                index=jnp.where(take_s, p - 1, cache.index),
            )

        cache = jax.lax.cond(jnp.any(take_s), copy_prompts, lambda c: c, cache)
        return cache, sample_s, t_s, tok_s, pos_s, admitted

    def step(carry, extent):
        """Refill, then decode one token per slot reading `extent` cache slots."""
        it, slot_carry, bufs, len_m, ended_m, eos_m = carry
        cache, sample_s, t_s, tok_s, pos_s, admitted = refill(slot_carry)
        cache = cache.replace(index=jnp.minimum(cache.index, width - 1))
        hidden, cache = nnx.merge(graphdef, state)(
            tok_s[:, None],
            positions_nt=pos_s[:, None],
            mask_nt=jnp.ones((s, 1), jnp.bool_),
            cache=cache,
            layer_params=layers,
            cache_extent=extent,
        )
        cache = cache_constraint(cache, mesh)
        logits_s = rows(model.logits(hidden)[:, 0])
        live_s = sample_s >= 0
        m_s = jnp.maximum(sample_s, 0)
        keys_s = jax.vmap(lambda k, i, t: jax.random.fold_in(jax.random.fold_in(k, i), t))(
            keys_q[m_s // n], m_s % n, t_s
        )
        out = sample_tokens(logits_s, keys_s, config=spec.sampling)
        t_next = t_s + 1
        stop_s = live_s & jnp.isin(out.token_n, stop_ids) if spec.stop_ids else live_s & False
        ended_s = live_s & (stop_s | (t_next >= t_new))
        # Each slot writes its own sample's row; an idle slot a row of its own past the
        # buffers (dropped), so the rows are unique: XLA:CPU then writes only the updates
        # in place (without the hint it copied the [M, T] buffers every step).
        beyond_s = m_all + jnp.arange(s, dtype=i32)
        row_s = jnp.where(live_s, sample_s, beyond_s)
        once = dict(mode="drop", unique_indices=True)
        vals = (out.token_n, out.logp_n, out.keep_count_n, out.keep_threshold_n)
        vals += (jnp.full((s,), version, i32),)
        bufs = tuple(
            buf.at[row_s, t_s].set(v.astype(buf.dtype), **once) for buf, v in zip(bufs, vals)
        )
        len_m = len_m.at[row_s].set(t_next, **once)
        ended_rows = jnp.where(ended_s, row_s, beyond_s)
        ended_m = ended_m.at[ended_rows].set(True, **once)
        eos_m = eos_m.at[ended_rows].set(stop_s, **once)
        slot_carry = (
            cache,
            rows(jnp.where(ended_s, -1, sample_s)),
            rows(t_next),
            rows(out.token_n),
            rows(pos_s + 1),
            admitted,
        )
        return it + 1, slot_carry, bufs, len_m, ended_m, eos_m

    def head_open(carry):
        return ~jnp.all(carry[4][:n])

    def need(carry):
        """Cache slots the next step reads: the deepest live slot's index."""
        _, (cache, sample_s, *_), *_ = carry
        return jnp.max(jnp.where(sample_s >= 0, cache.index, 0))

    def run_at(i):
        """Steps at extent i while round s is open and the need is within extent i."""
        lo, hi = (extents[i - 1] if i else -1), extents[i]
        in_range = lambda c: head_open(c) & (need(c) > lo) & (need(c) <= hi)
        return lambda carry: jax.lax.while_loop(in_range, lambda c: step(c, hi), carry)

    phases = [run_at(i) for i in range(len(extents))]

    def phase(carry):
        branch = jnp.searchsorted(jnp.asarray(extents, i32), need(carry)).astype(i32)
        return jax.lax.switch(branch, phases, carry)

    slot_carry = (cache, rows(sample_s), rows(t_s), rows(tok_s), rows(pos_s), win.admitted)
    carry = (i32(0), slot_carry, bufs, len_m, ended_m, eos_m)
    if len(phases) == 1:
        carry = jax.lax.while_loop(head_open, lambda c: step(c, extents[0]), carry)
    else:
        carry = jax.lax.while_loop(head_open, phase, carry)
    it, (_, sample_s, _, _, _, admitted), bufs, len_m, ended_m, eos_m = carry
    decoded = jnp.sum(len_m) - decoded_before

    # 4. Round s out; the window keeps rounds s + 1 .. s + k (slots renumbered).
    head = lambda x: rows(x[:n])
    rollout = Rollout.from_outputs(
        prompts_mp[:b], plen[:b], tuple(head(x) for x in bufs[:4]), head(len_m),
        head(eos_m), keys_q[0], it, s,
    )  # fmt: skip
    after = Window(
        prompts_qbp=prompts_mp[b:].reshape(q_held, b, p),
        lengths_qb=plen[b:].reshape(q_held, b),
        keys_q=jax.random.key_data(keys_q[1:]),
        tokens_mt=bufs[0][n:],
        logp_mt=bufs[1][n:],
        keep_count_mt=bufs[2][n:],
        keep_threshold_mt=bufs[3][n:],
        version_mt=bufs[4][n:],
        lengths_m=len_m[n:],
        ended_m=ended_m[n:],
        eos_m=eos_m[n:],
        slot_sample_s=jnp.where(sample_s >= 0, sample_s - n, -1),
        admitted=admitted - n,
    )
    return rollout, head(bufs[4]), after, decoded


_advance_jit = jax.jit(_advance_impl, static_argnums=(0, 7), compiler_options=COMPILER_OPTIONS)


class PartialDecoder:
    """Partial rollouts for rounds of B prompts x G samples, k rounds held between calls
    (module docstring). Prompts are left-padded to `prompt_width` P (fixed, so the window
    keeps one shape); `slots`: the slot count (None: `continuous.auto_slots(N)`)."""

    def __init__(
        self,
        *,
        rounds_ahead: int,
        n_prompts: int,
        group_size: int,
        prompt_width: int,
        max_new_tokens: int,
        sampling: SamplingConfig | None = None,
        stop_ids: tuple[int, ...] = (),
        pad_id: int = 0,
        slots: int | None = None,
        decode_loops: int = DECODE_LOOPS,
        mesh=None,
        cache_dtype=None,
    ):
        if rounds_ahead < 1:
            raise ValueError(f"rounds_ahead must be >= 1, got {rounds_ahead}")
        n = n_prompts * group_size
        if slots is not None and (
            isinstance(slots, bool) or not isinstance(slots, int) or slots < 1
        ):
            raise ValueError(f"slots must be a positive int or None, got {slots!r}")
        self.k, self.b, self.p = rounds_ahead, n_prompts, prompt_width
        self.spec = Spec(
            group_size=group_size,
            max_new_tokens=max_new_tokens,
            sampling=SamplingConfig() if sampling is None else sampling,
            stop_ids=tuple(sorted({int(i) for i in stop_ids})),
            pad_id=int(pad_id),
            shared_prefill=True,
            mesh=mesh,
            cache_dtype=cache_dtype,
            decode_plan=decode_plan(max_new_tokens, decode_loops),
            slots=auto_slots(n) if slots is None else min(slots, (rounds_ahead + 1) * n),
        )

    def pad_prompts(self, tokens_bp, lengths_b) -> tuple[np.ndarray, np.ndarray]:
        """`[B, P]` prompts left-padded (pad id) to the decoder's width, `[B]` lengths."""
        tokens = np.asarray(tokens_bp).astype(np.int32)
        lengths = np.asarray(lengths_b).astype(np.int32)
        b, w = tokens.shape
        if b != self.b or lengths.min() < 1 or lengths.max() > min(w, self.p):
            raise ValueError(
                f"partial rollouts take {self.b} prompts of 1 .. {self.p} tokens, got "
                f"{tokens.shape} with lengths {lengths.tolist()}"
            )
        if w > self.p:  # the left columns are padding in every row
            tokens, w = tokens[:, w - self.p :], self.p
        real = np.arange(self.p)[None, :] >= (self.p - lengths)[:, None]
        padded = np.pad(tokens, ((0, 0), (self.p - w, 0)), constant_values=self.spec.pad_id)
        return np.where(real, padded, self.spec.pad_id).astype(np.int32), lengths

    def window(self, prompts: list[tuple] | None = None, keys: list | None = None) -> Window:
        """A window of k rounds not yet decoded: `prompts` k (tokens `[B, W]`, lengths `[B]`),
        `keys` their k keys; None (both): an empty one, the shapes a checkpoint restores."""
        k, b, p = self.k, self.b, self.p
        if prompts is None or keys is None:
            prompts_kbp, lengths_kb = np.zeros((k, b, p), np.int32), np.ones((k, b), np.int32)
            keys_k2 = jnp.zeros((k, 2), jnp.uint32)
        elif len(prompts) != k or len(keys) != k:
            raise ValueError(f"a window holds {k} rounds, got {len(prompts)} and {len(keys)}")
        else:
            padded = [self.pad_prompts(*pr) for pr in prompts]
            prompts_kbp = np.stack([x for x, _ in padded])
            lengths_kb = np.stack([x for _, x in padded])
            keys_k2 = jnp.stack([jax.random.key_data(key) for key in keys])
        samples = _empty_samples(
            k * b * self.spec.group_size, self.spec.max_new_tokens, self.spec.pad_id
        )
        names = (
            *("tokens_mt", "logp_mt", "keep_count_mt", "keep_threshold_mt", "version_mt"),
            *("lengths_m", "ended_m", "eos_m"),
        )
        return Window(
            prompts_qbp=jnp.asarray(prompts_kbp),
            lengths_qb=jnp.asarray(lengths_kb),
            keys_q=keys_k2,
            slot_sample_s=jnp.full((self.spec.slots,), -1, jnp.int32),  # every slot free
            admitted=jnp.zeros((), jnp.int32),  # none admitted
            **dict(zip(names, samples)),
        )

    def advance(self, model, window: Window, tokens_bp, lengths_b, key, version: int):
        """Append round s + k (`tokens_bp` `[B, W]`, `lengths_b`, `key`), decode with `model`
        (the weights of `version` = s) until round s has ended: (round s's `Rollout`, its
        `[N, T]` int32 versions, the next window, tokens decoded by this call)."""
        prompts, lengths = self.pad_prompts(tokens_bp, lengths_b)
        graphdef, state = nnx.split(model)
        mesh = self.spec.mesh
        if mesh is not None:  # one layout whatever made the window (a restore, the last call)
            window = jax.device_put(window, NamedSharding(mesh, PartitionSpec()))
        args = (graphdef, state, window, jnp.asarray(prompts), jnp.asarray(lengths), key)
        if mesh is None:
            return _advance_jit(*args, jnp.int32(version), self.spec)
        with jax.set_mesh(mesh):
            return _advance_jit(*args, jnp.int32(version), self.spec)
