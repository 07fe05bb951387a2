"""Multi-turn sampling: each row's KV cache continued across turns, token in and token out.

An agentic episode alternates policy turns and environment answers. Re-encoding the decoded
conversation each turn would re-prefill it (quadratic in the turns) and, worse, could hand
the trainer ids the sampler never produced (a BPE merges differently across a turn
boundary). Here each of N rows keeps one cache for its whole episode and only ever receives
ids: the prompt's, the ones it sampled, and the environment's, appended as given.

    state = start(model, prompt_np, lengths_n, capacity=S)        # prefill, once
    state, turn = sample_turn(model, state, key=k, ...)           # a policy turn per row
    state = append(model, state, obs_nw, obs_len_n)               # environment ids per row
    state, turn = sample_turn(model, state, key=k, ...)           # ... and so on

Layout: row n's cache holds its left-padded prompt in slots [0, P), then every token fed
after it at the row's own next slot (`KVCache.index` `[N]`); `state.pos_n` counts the real
tokens so far (the next RoPE position). A row that sits a turn out (finished, or waiting)
writes nothing real: its slot is masked and its index stays. Slots past a row's index hold
nothing it reads. So the tokens of row n that the model attended to are exactly its real
tokens in order, at positions 0, 1, ... — the trainer's forward over the concatenated
episode (prompt | turn 1 | answer 1 | turn 2 ...) sees the same keys at the same positions,
and the sampler's logprobs equal the trainer's up to float rounding (tests).

A turn feeds each sampled token at once (the cache ends a turn holding all of them, and
`state.hidden_nd` the hidden state after the last one), so an append or the next turn
continues from there: nothing is prefilled twice.

Sampling keys: policy token j of row n (its j-th sampled token over the whole episode) is
drawn with key(sample_ids_n[n], j) (`grpojax.sampling.rollout.token_keys`), so a row's draws
do not depend on the rows beside it, on how its turns were batched or on the answers' lengths.

A turn ends for a row at one of `stop_ids` (e.g. EOS, a single-token `</tool_call>`), at one
of `stop_sequences` (id sequences, e.g. a multi-token `</tool_call>` as the tokenizer encodes
it; the sequence is part of the turn), or at its budget `budget_n` (per-turn and episode
token budgets, the caller's to combine). A turn is one compiled program per (N, S, T, V,
config); an append one per answer width W (round widths up to a few buckets).

Compaction: `take_rows(state, order)` keeps some of the rows (each as it was), so a loop
can drop the rows whose episodes ended and decode the next turns at a smaller batch size.

Slots (continuous batching over episodes): the N rows may be S decode slots that a host loop
(`grpojax.envs.rollout`) refills with the next pending episode as episodes end. `empty`
makes S slots holding nothing; `append(..., reset_n=...)` starts a new episode in the slots
it names (their index, position and policy-token count back to 0, then the prompt fed like an
answer); `sample_turn(..., until="any")` returns as soon as one slot's turn ends, the others
part-way through theirs (the next call goes on with them: `recent_nk` carries each slot's
last ids so a stop sequence split across two calls is still found).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import Array

from grpojax.models.decoder import KVCache, init_cache
from grpojax.models.precision import COMPILER_OPTIONS, cast_floating, compute_dtype_of
from grpojax.ops.checks import check_int
from grpojax.sampling.rollout import check_prompts, empty_outputs, record_step, token_keys
from grpojax.sampling.transforms import SamplingConfig, sample_tokens

__all__ = ["TurnOutput", "TurnState", "append", "empty", "sample_turn", "start", "take_rows"]


class TurnState(NamedTuple):
    """N rows' episodes between calls (a pytree; every field is per row).

    cache: the rows' `KVCache`, S slots, `index` `[N]` int32 each row's next slot.
    hidden_nd: `[N, D]` the final hidden state after each row's last fed token (its next
      token's logits are `model.logits` of it).
    pos_n: `[N]` int32 real tokens fed so far (the next token's RoPE position).
    sampled_n: `[N]` int32 policy tokens sampled so far (the sampling key's step).
    """

    cache: KVCache
    hidden_nd: Array
    pos_n: Array
    sampled_n: Array


class TurnOutput(NamedTuple):
    """One policy turn of N rows, T = the turn's token cap.

    tokens_nt: `[N, T]` int32 sampled ids, `pad_id` after each row's turn.
    lengths_n: `[N]` int32 tokens sampled this turn (0 for a row not in the turn).
    logp_nt, keep_count_nt, keep_threshold_nt: as `grpojax.sampling.Rollout`'s (0 after the
      turn).
    stop_id_n: `[N]` bool, the turn ended on one of `stop_ids`.
    stop_sequence_n: `[N]` bool, the turn ended with one of `stop_sequences`.
    """

    tokens_nt: Array
    lengths_n: Array
    logp_nt: Array
    keep_count_nt: Array
    keep_threshold_nt: Array
    stop_id_n: Array
    stop_sequence_n: Array


def _model(graphdef, state):
    state = cast_floating(state, compute_dtype_of(nnx.merge(graphdef, state)))
    return nnx.merge(graphdef, state)


def _start_impl(graphdef, state, prompt_np, lengths_n, capacity: int, cache_dtype):
    model = _model(graphdef, state)
    n, p = prompt_np.shape
    cols = jnp.arange(p, dtype=jnp.int32)[None, :]
    mask_np = cols >= (p - lengths_n)[:, None]
    pos_np = jnp.maximum(jnp.cumsum(mask_np, axis=1, dtype=jnp.int32) - 1, 0)
    cache = init_cache(model.config, n, capacity, cache_dtype)
    hidden, cache = model(
        prompt_np, positions_nt=pos_np, mask_nt=mask_np, cache=cache, prefill=True
    )
    # Left padding puts every prompt's last real token in column P - 1.
    cache = dataclasses.replace(cache, index=jnp.full((n,), p, jnp.int32))
    return TurnState(cache, hidden[:, -1], lengths_n, jnp.zeros((n,), jnp.int32))


_start_jit = jax.jit(_start_impl, static_argnums=(0, 4, 5), compiler_options=COMPILER_OPTIONS)


def start(
    model, prompt_tokens_np, prompt_lengths_n, *, capacity: int, cache_dtype: Any = None
) -> TurnState:
    """Prefill N left-padded prompts `[N, P]` (`prompt_lengths_n` `[N]` real lengths) into a
    cache of `capacity` slots per row (P + every token the episode may add, answers' padding
    included: `append` writes W slots, `sample_turn` one per step)."""
    prompts = jnp.asarray(prompt_tokens_np, jnp.int32)
    lengths = np.asarray(prompt_lengths_n, np.int32)
    check_prompts(np.asarray(prompts), lengths, rows="n")
    check_int("capacity", capacity, minimum=prompts.shape[1] + 1)
    graphdef, state = nnx.split(model)
    return _start_jit(graphdef, state, prompts, jnp.asarray(lengths), capacity, cache_dtype)


def empty(model, n: int, *, capacity: int, cache_dtype: Any = None) -> TurnState:
    """N slots holding nothing yet (`capacity` cache slots each): start an episode in one with
    `append(..., reset_n=...)`."""
    check_int("n", n)
    check_int("capacity", capacity, minimum=2)
    cache = init_cache(model.config, n, capacity, cache_dtype)
    cache = dataclasses.replace(cache, index=jnp.zeros((n,), jnp.int32))
    zeros = jnp.zeros((n,), jnp.int32)
    hidden = jnp.zeros((n, model.config.hidden_size), model.config.compute_dtype)
    return TurnState(cache, hidden, zeros, zeros)


def _take_rows_impl(st: TurnState, order_m) -> TurnState:
    take = lambda x, axis: jnp.take(x, order_m, axis=axis)
    cache = dataclasses.replace(
        st.cache,
        k=take(st.cache.k, 1),
        v=take(st.cache.v, 1),
        mask_ns=take(st.cache.mask_ns, 0),
        index=take(st.cache.index, 0),
    )
    return TurnState(cache, take(st.hidden_nd, 0), take(st.pos_n, 0), take(st.sampled_n, 0))


_take_rows_jit = jax.jit(_take_rows_impl)


def take_rows(state: TurnState, order_m) -> TurnState:
    """The M rows `order_m` (`[M]` int, indices into the N rows) of `state`, in that order:
    their caches, hidden states and counters, each row as it was (a batch that drops the
    rows whose episodes ended; one small program per (N, M))."""
    order = np.asarray(order_m, np.int32)
    n = state.pos_n.shape[0]
    if order.ndim != 1 or order.size == 0 or order.min() < 0 or order.max() >= n:
        raise ValueError(f"order_m must be a non-empty [M] of row indices < {n}, got {order}")
    return _take_rows_jit(state, jnp.asarray(order))


def _feed(model, layers, st: TurnState, tokens_nw, lengths_n) -> TurnState:
    """Feed each row its first lengths_n[n] of tokens_nw `[N, W]` at its own next slot;
    rows with length 0 are left as they are."""
    w = tokens_nw.shape[1]
    cols = jnp.arange(w, dtype=jnp.int32)[None, :]
    mask_nw = cols < lengths_n[:, None]
    hidden, cache = model(
        tokens_nw,
        positions_nt=st.pos_n[:, None] + cols,
        mask_nt=mask_nw,
        cache=st.cache,
        layer_params=layers,
    )
    cache = dataclasses.replace(cache, index=st.cache.index + lengths_n)
    last = jnp.take_along_axis(hidden, jnp.maximum(lengths_n - 1, 0)[:, None, None], axis=1)
    hidden_nd = jnp.where((lengths_n > 0)[:, None], last[:, 0], st.hidden_nd)
    return st._replace(cache=cache, hidden_nd=hidden_nd, pos_n=st.pos_n + lengths_n)


def _append_impl(graphdef, state, st: TurnState, tokens_nw, lengths_n, reset_n):
    model = _model(graphdef, state)
    if reset_n is not None:
        zero = jnp.zeros_like(st.pos_n)
        cache = st.cache
        cache = dataclasses.replace(
            cache,
            mask_ns=cache.mask_ns & ~reset_n[:, None],
            index=jnp.where(reset_n, zero, cache.index),
        )
        st = TurnState(
            cache,
            st.hidden_nd,
            jnp.where(reset_n, zero, st.pos_n),
            jnp.where(reset_n, zero, st.sampled_n),
        )
    return _feed(model, model.layer_params(fuse=True), st, tokens_nw, lengths_n)


_append_jit = jax.jit(_append_impl, static_argnums=(0,), compiler_options=COMPILER_OPTIONS)


def append(model, state: TurnState, tokens_nw, lengths_n, *, reset_n=None) -> TurnState:
    """Feed each row n the ids `tokens_nw[n, :lengths_n[n]]` (an environment's answer, right
    padded to a common width W; 0 for a row with nothing to add) after its last token.

    `reset_n`: `[N]` bool rows that start a new episode first (a slot refilled): their cache
    is emptied and their position and policy-token count set to 0, so their ids here are the
    new episode's prompt (at positions 0 .. len - 1)."""
    tokens = jnp.asarray(tokens_nw, jnp.int32)
    lengths = jnp.asarray(lengths_n, jnp.int32)
    n = state.pos_n.shape[0]
    if tokens.ndim != 2 or tokens.shape[0] != n or lengths.shape != (n,):
        raise ValueError(
            f"tokens_nw must be [{n}, W] and lengths_n [{n}], got {tokens.shape} and "
            f"{lengths.shape}"
        )
    reset = None if reset_n is None else jnp.asarray(reset_n, jnp.bool_)
    if reset is not None and reset.shape != (n,):
        raise ValueError(f"reset_n must be [{n}] bools, got shape {reset.shape}")
    index = np.asarray(state.cache.index)
    if reset is not None:
        index = np.where(np.asarray(reset), 0, index)
    capacity = state.cache.mask_ns.shape[1]
    if np.any(index + tokens.shape[1] > capacity):
        raise ValueError(
            f"an append of width {tokens.shape[1]} overruns the cache ({capacity} slots, next "
            f"slots {index.tolist()})"
        )
    graphdef, model_state = nnx.split(model)
    return _append_jit(graphdef, model_state, state, tokens, lengths, reset)


def _ends_with(tail_nk: Array, sequences: tuple[tuple[int, ...], ...]) -> Array:
    """`[N]` bool: the last tokens of each row (`tail_nk`, newest last) are one of the
    sequences."""
    k = tail_nk.shape[1]
    hit = jnp.zeros(tail_nk.shape[:1], jnp.bool_)
    for seq in sequences:
        ref = jnp.asarray(seq, jnp.int32)[None, :]
        hit = hit | jnp.all(tail_nk[:, k - len(seq) :] == ref, axis=1)
    return hit


def _turn_impl(
    graphdef,
    state,
    st: TurnState,
    key_gen,
    sample_ids_n,
    budget_n,
    max_tokens: int,
    sampling: SamplingConfig,
    stop_ids: tuple[int, ...],
    stop_sequences: tuple[tuple[int, ...], ...],
    pad_id: int,
    until: str,
    recent_nk,
):
    model = _model(graphdef, state)
    layers = model.layer_params(fuse=True)
    n = st.pos_n.shape[0]
    stops = jnp.asarray(stop_ids if stop_ids else (-1,), jnp.int32)
    idle_n = budget_n < 1

    def cond(carry):
        t, _, _, _, _, _, ended_n = carry
        go = ~jnp.all(ended_n)
        if until == "any":  # stop once a row that took part has ended its turn
            go = go & ~jnp.any(ended_n & ~idle_n)
        return (t < max_tokens) & go

    def body(carry):
        t, st, bufs, tail_nk, stop_id_n, stop_seq_n, ended_n = carry
        logits_nv = model.logits(st.hidden_nd[:, None])[:, 0]
        keys = token_keys(key_gen, sample_ids_n, st.sampled_n)
        out = sample_tokens(logits_nv, keys, config=sampling)
        live_n = ~ended_n
        bufs, vals = record_step(bufs, out, t, live_n, pad_id)
        fed = _feed(model, layers, st, vals[0][:, None], live_n.astype(jnp.int32))
        fed = fed._replace(sampled_n=st.sampled_n + live_n)
        tail_nk = jnp.where(
            live_n[:, None], jnp.concatenate([tail_nk[:, 1:], vals[0][:, None]], axis=1), tail_nk
        )
        stop_id_n = stop_id_n | (live_n & jnp.isin(out.token_n, stops))
        if stop_sequences:
            stop_seq_n = stop_seq_n | (live_n & _ends_with(tail_nk, stop_sequences))
        ended_n = ended_n | stop_id_n | stop_seq_n | (t + 1 >= budget_n)
        return t + 1, fed, bufs, tail_nk, stop_id_n, stop_seq_n, ended_n

    none_n = jnp.zeros((n,), jnp.bool_)
    carry = (
        jnp.int32(0),
        st,
        empty_outputs((n, max_tokens), pad_id),
        recent_nk,
        none_n,
        none_n,
        idle_n,
    )
    _, st_out, bufs, _, stop_id_n, stop_seq_n, _ = jax.lax.while_loop(cond, body, carry)
    turn = TurnOutput(
        tokens_nt=bufs[0],
        lengths_n=st_out.sampled_n - st.sampled_n,
        logp_nt=bufs[1],
        keep_count_nt=bufs[2],
        keep_threshold_nt=bufs[3],
        stop_id_n=stop_id_n,
        stop_sequence_n=stop_seq_n,
    )
    return st_out, turn


_turn_jit = jax.jit(
    _turn_impl, static_argnums=(0, *range(6, 12)), compiler_options=COMPILER_OPTIONS
)


def sample_turn(
    model,
    state: TurnState,
    *,
    key: Array,
    budget_n,
    max_tokens: int,
    sample_ids_n=None,
    sampling: SamplingConfig | None = None,
    stop_ids: tuple[int, ...] | list[int] = (),
    stop_sequences: tuple[tuple[int, ...], ...] | list[list[int]] = (),
    pad_id: int = 0,
    until: str = "all",
    recent_nk=None,
) -> tuple[TurnState, TurnOutput]:
    """Sample one policy turn for every row with `budget_n[n]` > 0 (at most that many tokens,
    and at most `max_tokens` T); rows with budget 0 sit the turn out.

    Args:
      model: the decoder `start` was given.
      state: the rows' `TurnState`.
      key: the episode's generation key (the same key for every turn of the episode: draws
        are keyed by the row's policy-token count, module docstring).
      budget_n: `[N]` int the tokens each row may sample this turn (0 = not in this turn);
        the caller keeps index + budget within the cache's capacity.
      max_tokens: T, the width of the turn's buffers (static).
      sample_ids_n: `[N]` int each row's sample index in the key (default 0 .. N-1).
      sampling: the `SamplingConfig` (default temperature 1).
      stop_ids: ids that end a turn (included in it).
      stop_sequences: id sequences that end a turn when the turn's last ids equal one
        (included in it).
      pad_id: written after each row's turn.
      until: "all": every row's turn ends (a stop, or its budget) before this returns; "any":
        it returns after the step in which the first row ends its turn, the others part-way
        through theirs (their `stop_*_n` False, their budget not spent; the slots' host loop
        goes on with them in its next call).
      recent_nk: `[N, K]` int each row's last K ids of its turn so far, newest last, -1
        where the turn has fewer (None: a fresh turn). A call that goes on with a turn begun
        in an earlier call passes them, so a stop sequence split across the two is found.

    Returns:
      `(state, TurnOutput)`: the state with every sampled token fed.
    """
    check_int("max_tokens", max_tokens)
    n = state.pos_n.shape[0]
    budget = np.asarray(budget_n, np.int32)
    if budget.shape != (n,) or budget.min() < 0:
        raise ValueError(f"budget_n must be [{n}] non-negative ints, got {budget.tolist()}")
    capacity = state.cache.mask_ns.shape[1]
    room = capacity - np.asarray(state.cache.index)
    if np.any(budget > room):
        raise ValueError(
            f"budget_n exceeds the cache's room left ({room.tolist()} of {capacity} slots)"
        )
    sampling = SamplingConfig() if sampling is None else sampling
    ids = np.arange(n, dtype=np.int32) if sample_ids_n is None else np.asarray(sample_ids_n)
    seqs = tuple(tuple(int(i) for i in s) for s in stop_sequences)
    if any(len(s) == 0 for s in seqs):
        raise ValueError("stop_sequences must not hold an empty sequence")
    if until not in ("all", "any"):
        raise ValueError(f"until must be 'all' or 'any', got {until!r}")
    k = max((len(s) for s in seqs), default=1)
    recent = np.full((n, k), -1, np.int32)
    if recent_nk is not None:
        given = np.asarray(recent_nk, np.int32)
        if given.ndim != 2 or given.shape[0] != n:
            raise ValueError(f"recent_nk must be [{n}, K], got shape {given.shape}")
        width = min(k, given.shape[1])
        if width:
            recent[:, k - width :] = given[:, given.shape[1] - width :]
    graphdef, model_state = nnx.split(model)
    return _turn_jit(
        graphdef,
        model_state,
        state,
        key,
        jnp.asarray(ids, jnp.int32),
        jnp.asarray(budget),
        max_tokens,
        sampling,
        tuple(int(i) for i in stop_ids),
        seqs,
        pad_id,
        until,
        jnp.asarray(recent),
    )
