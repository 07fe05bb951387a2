"""Multi-turn rollouts: the sampler's turns and the environments' answers, token in, token out.

`rollout_episodes(model, runner, ...)` plays N episodes (one per `EpisodeRunner` row) to
their end with `grpojax.sampling.multiturn`: each row's prompt is prefilled once; then, while
any episode goes on, one policy turn is sampled for every active row (each continuing its
own KV cache), the runner steps their environments concurrently and renders each answer to
ids once, and those ids are fed to the rows' caches. The episodes it returns hold exactly the
ids the model saw; `episode_batch` lays them out as the trainer's rows (prompt | completion,
the loss on policy ids only, the sampler's logprobs beside them).

Draws are keyed by (row, policy-token count) (`grpojax.sampling.multiturn`): one key serves
the whole rollout, and a row's tokens do not depend on the rows beside it.

An external engine (`rollout_episodes_external`, e.g. vLLM) plays the same loop from the
host: each turn, every active row's whole context (prompt, its turns and the environment's
answers, ids as the model saw them, never re-encoded text) goes to the engine as one
request, which continues it (vLLM's prefix cache holds what it has seen); draws are keyed by
(turn, row), and the environments' stop strings end a turn on the host (the ids after the
first one are dropped: a continuation does not change the ids before it).

Compaction (`compact=True`): the lock-step loop, but before a turn the rows whose episodes
have ended are dropped from the decode batch whenever the live ones fit the next smaller
of the compacting engine's batch sizes (`grpojax.sampling.compact.row_sizes`: each about
3/4 of the one before); the live rows' caches move with them (`take_rows`), and each row
keeps its sample id, so the episodes are the lock-step loop's id for id (logprobs to float
rounding: another batch size). Environments still step all at once each turn.

Slots (`slots=S`, continuous batching over episodes): the lock-step loop above decodes all N
rows until each turn's longest ends, and keeps a row whose episode is over in every later
turn, so with episodes of unequal turns and lengths most of its row-steps decode nothing. With
S slots the loop decodes S rows, each a live episode: a call decodes until the first slot's
turn ends; the runner steps the environments of the slots whose turns ended (concurrently);
their answers are fed, and a slot whose episode ended is refilled with the next pending
episode (its prompt fed into the emptied slot). The episodes are the lock-step loop's, id for
id (the same keys; logprobs to float rounding: the prompt is fed, not prefilled), and the
schedule depends on the ids alone, so a rollout is reproducible. Environments step when their
own turn ends rather than all at once, so slow tools overlap less than in the lock-step loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array
from jax.sharding import NamedSharding, PartitionSpec

from grpojax.data import pad_token_ids
from grpojax.envs.episode import Episode, EpisodeRunner, pad_episodes
from grpojax.ops.checks import check_int
from grpojax.sampling.compact import row_sizes
from grpojax.sampling.generate import bucket_width
from grpojax.sampling.multiturn import append, empty, sample_turn, start, take_rows
from grpojax.sampling.transforms import SamplingConfig

__all__ = ["EpisodeRows", "episode_batch", "rollout_episodes", "rollout_episodes_external"]

ANSWER_WIDTH_MULTIPLE = 16  # answers are padded to a multiple of it: few compiled widths


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _host(x) -> np.ndarray:
    """NumPy copy of a sampler output on every process: an array spread over processes is
    first replicated over its own devices (no other device takes part)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        assert isinstance(x.sharding, NamedSharding)  # the sampler's outputs: on its mesh
        whole = NamedSharding(x.sharding.mesh, PartitionSpec())
        return np.asarray(jax.jit(_identity, out_shardings=whole)(x).addressable_data(0))
    return np.asarray(x)


def _identity(x):  # module level: one compiled program per layout, not one per call
    return x


def rollout_episodes(
    model,
    runner: EpisodeRunner,
    *,
    key: Array,
    max_turn_tokens: int,
    sampling: SamplingConfig | None = None,
    stop_ids: tuple[int, ...] | list[int] = (),
    pad_id: int = 0,
    sample_ids_n=None,
    cache_dtype: Any = None,
    slots: int | None = None,
    compact: bool = False,
    stats: dict | None = None,
) -> list[Episode]:
    """Play every episode of `runner` to its end; return `runner.episodes`.

    Args:
      model: a `grpojax.models` decoder.
      runner: the N environments' `EpisodeRunner` (fresh: no turn taken yet).
      key: the rollout's sampling key (every turn's draws come from it, keyed by row and
        policy-token count).
      max_turn_tokens: the turn buffer's width T; a turn's budget is the smaller of it and
        the runner's (`EpisodeRunner.turn_budget`). A turn that uses its whole budget without
        a stop ends its episode ("token_budget").
      sampling: the `SamplingConfig` (default temperature 1).
      stop_ids: ids that end a turn (the tokenizer's EOS ids, `grpojax.data.stop_ids_of`).
        The environments' `stop_strings` end turns too (as `EpisodeRunner.stop_sequences`
        encodes them, taken once for all rows).
      pad_id: the padding id of prompts and buffers.
      sample_ids_n: `[N]` each row's index in the key (default 0 .. N-1).
      cache_dtype: the KV cache's dtype (default: the model's compute dtype).
      slots: None: every row decoded in lock step, turn by turn; S >= 1: S decode slots
        refilled with pending episodes as episodes end (module docstring; capped at N).
      compact: lock step with the ended episodes' rows dropped from the batch (module
        docstring); not with `slots`.
      stats: where given, stats["decode_row_steps"] gets the row-steps decoded (rows x
        steps of every sampler call: the denominator of the decode utilisation).

    Returns:
      The N `Episode`s, row order.
    """
    check_int("max_turn_tokens", max_turn_tokens)
    check_int("slots", slots, minimum=1, none_ok=True)
    if compact and slots is not None:
        raise ValueError("rollout_episodes: compact=True is the lock-step loop; pass no slots")
    prompts = runner.prompt_ids()
    if any(e.segments for e in runner.episodes):
        raise ValueError("rollout_episodes needs a fresh EpisodeRunner (no turn taken yet)")
    p = bucket_width(max(len(ids) for ids in prompts))
    # Every id of an episode fits in P + max_episode_tokens slots; an append's padding may
    # reach past a row's last one by up to its width: an answer's padded width, and with
    # slots a refilled prompt's (up to P, written into every slot).
    e = runner.max_episode_tokens
    slack = _round_up(min(e, runner.max_observation_tokens), ANSWER_WIDTH_MULTIPLE)
    if slots is not None:
        slack = max(slack, p)
    n = len(prompts)
    ids_n = np.arange(n, dtype=np.int32) if sample_ids_n is None else np.asarray(sample_ids_n)
    turn_kwargs: dict[str, Any] = dict(
        key=key,
        max_tokens=max_turn_tokens,
        sampling=sampling,
        stop_ids=stop_ids,
        stop_sequences=runner.stop_sequences(),
        pad_id=pad_id,
    )
    if slots is not None:
        if runner.seated:
            raise ValueError(
                "rollout_episodes: slots take no seats of shared games (a slot would hold a "
                "seat that waits); play them in lock step (no slots)"
            )
        _SlotLoop(model, runner, min(slots, n), p + e + slack, cache_dtype, ids_n).run(
            turn_kwargs, stats
        )
        return runner.episodes
    laid = pad_token_ids(prompts, [[]] * n, prompt_width=p, completion_width=1)
    state = start(
        model,
        laid.prompt_tokens_np,
        laid.prompt_lengths_n,
        capacity=p + e + slack,
        cache_dtype=cache_dtype,
    )
    rows_m = np.arange(n)  # the episode (runner row) each of the batch's M rows plays
    sizes = row_sizes(n) if compact else (n,)
    while live := runner.active_rows():
        size = min(m for m in sizes if m >= len(live))
        if size < len(rows_m):  # the live rows first, then ended ones, `size` in all
            order = np.argsort(~np.isin(rows_m, live), kind="stable")[:size]
            state, rows_m = take_rows(state, order), rows_m[order]
        budget_n = np.minimum(runner.turn_budgets(), max_turn_tokens)
        state, turn = sample_turn(
            model, state, budget_n=budget_n[rows_m], sample_ids_n=ids_n[rows_m], **turn_kwargs
        )
        lengths = _host(turn.lengths_n)
        if stats is not None:
            steps = int(lengths.max(initial=0))
            stats["decode_row_steps"] = stats.get("decode_row_steps", 0) + len(rows_m) * steps
        answers_nw, answer_len_n = runner.advance_turn(  # the batch's rows -> all N
            _every_row(_host(turn.tokens_nt), rows_m, n, pad_id),
            _every_row(lengths, rows_m, n, 0),
            _every_row(_host(turn.logp_nt), rows_m, n, 0),
            stopped_n=_every_row(
                _host(turn.stop_id_n) | _host(turn.stop_sequence_n), rows_m, n, False
            ),
            pad_id=pad_id,
            width_multiple=ANSWER_WIDTH_MULTIPLE,
        )
        if answer_len_n.any():
            state = append(model, state, answers_nw[rows_m], answer_len_n[rows_m])
    return runner.episodes


def _every_row(x: np.ndarray, rows_m: np.ndarray, n: int, fill) -> np.ndarray:
    """`x` (`[M, ...]`, the batch's rows) as `[N, ...]`: row rows_m[i] is x[i], the other
    rows `fill`."""
    if len(rows_m) == n and np.array_equal(rows_m, np.arange(n)):
        return x
    out = np.full((n, *x.shape[1:]), fill, x.dtype)
    out[rows_m] = x
    return out


class ExternalEngine(Protocol):
    """What `rollout_episodes_external` asks of an engine (`VLLMEngine.complete`)."""

    def complete(
        self,
        contexts: Sequence[Sequence[int]],
        *,
        max_tokens_n: Sequence[int],
        seeds: Sequence[int],
        sampling: SamplingConfig,
        stop_ids: Sequence[int] = (),
    ) -> tuple[list[list[int]], list[list[float]], list[bool]]: ...


@jax.jit
def _turn_seeds(key: Array, turn, ids_n: Array) -> Array:
    """`[N]` int32 seeds of one turn's draws, one per row id: a row's do not depend on the
    rows beside it."""
    k = jax.random.fold_in(key, turn)
    return jax.vmap(lambda i: jax.random.randint(jax.random.fold_in(k, i), (), 0, 2**31 - 1))(ids_n)


def _cut_at_stop_sequence(ids: list[int], sequences) -> int | None:
    """The length of the shortest prefix of a turn's `ids` that ends with one of
    `sequences` (the built-in turn's stop test after every id), or None."""
    for end in range(1, len(ids) + 1):
        if any(end >= len(q) and tuple(ids[end - len(q) : end]) == q for q in sequences):
            return end
    return None


def rollout_episodes_external(
    engine: ExternalEngine,
    runner: EpisodeRunner,
    *,
    key: Array,
    max_turn_tokens: int,
    sampling: SamplingConfig | None = None,
    stop_ids: tuple[int, ...] | list[int] = (),
    sample_ids_n=None,
    stats: dict | None = None,
) -> list[Episode]:
    """`rollout_episodes` on an external engine holding the policy's weights (module
    docstring): every active row's context sent each turn, its turn budget the smaller of
    `max_turn_tokens` and the runner's, its draws seeded by (turn, `sample_ids_n[n]`).
    stats["decode_row_steps"] gets the ids sampled (the engine's batch follows the live
    rows). Returns the N `Episode`s, row order."""
    check_int("max_turn_tokens", max_turn_tokens)
    prompts = runner.prompt_ids()
    if any(e.segments for e in runner.episodes):
        raise ValueError("rollout_episodes needs a fresh EpisodeRunner (no turn taken yet)")
    n = len(prompts)
    ids_n = np.arange(n, dtype=np.int32) if sample_ids_n is None else np.asarray(sample_ids_n)
    sampling = SamplingConfig() if sampling is None else sampling
    sequences = runner.stop_sequences()
    context = [list(p) for p in prompts]
    turn = 0
    while rows := runner.ready_rows():
        budget_n = np.minimum(runner.turn_budgets(), max_turn_tokens)
        seeds = np.asarray(_turn_seeds(key, turn, jnp.asarray(ids_n, jnp.int32)))
        ids, logprobs, stopped = engine.complete(
            [context[r] for r in rows],
            max_tokens_n=[int(budget_n[r]) for r in rows],
            seeds=[int(seeds[r]) for r in rows],
            sampling=sampling,
            stop_ids=stop_ids,
        )
        for j in range(len(rows)):
            cut = _cut_at_stop_sequence(ids[j], sequences)
            if cut is not None:
                ids[j], logprobs[j], stopped[j] = ids[j][:cut], logprobs[j][:cut], True
        if stats is not None:
            stats["decode_row_steps"] = stats.get("decode_row_steps", 0) + sum(map(len, ids))
        answers = runner.advance(rows, ids, logprobs, truncated=[not s for s in stopped])
        for r, turn_ids, answer in zip(rows, ids, answers):
            context[r] += [*turn_ids, *(answer or ())]
        for r, answer in runner.woken.items():  # seats another's move woke
            context[r] += answer
        turn += 1
    return runner.episodes


class _SlotLoop:
    """`rollout_episodes` over S decode slots (module docstring): the host's record of which
    episode each slot plays and the part of its turn sampled so far."""

    def __init__(self, model, runner: EpisodeRunner, s: int, capacity: int, cache_dtype, ids_n):
        self.model, self.runner, self.ids_n = model, runner, ids_n
        self.prompts = runner.prompt_ids()
        self.state = empty(model, s, capacity=capacity, cache_dtype=cache_dtype)
        self.row_k = np.full(s, -1, np.int64)  # the episode (row) each slot plays; -1 idle
        self.budget_k = np.zeros(s, np.int32)  # ids the slot's turn may still sample
        self.turn_ids: list[list[int]] = [[] for _ in range(s)]
        self.turn_logp: list[list[float]] = [[] for _ in range(s)]
        self.pending = list(range(len(self.prompts)))[::-1]  # popped from the end: row order

    def run(self, turn_kwargs: dict, stats: dict | None) -> None:
        s = len(self.row_k)
        self.max_tokens, self.pad_id = turn_kwargs["max_tokens"], turn_kwargs["pad_id"]
        k_tail = max((len(q) for q in turn_kwargs["stop_sequences"]), default=1)
        self._feed({k: None for k in range(s)})
        while (self.row_k >= 0).any():
            live = self.row_k >= 0
            recent = np.full((s, k_tail), -1, np.int32)
            for k in np.flatnonzero(live):
                tail = self.turn_ids[k][-k_tail:]
                recent[k, k_tail - len(tail) :] = tail
            self.state, turn = sample_turn(
                self.model,
                self.state,
                budget_n=np.where(live, self.budget_k, 0),
                sample_ids_n=self.ids_n[np.maximum(self.row_k, 0)],
                until="any",
                recent_nk=recent,
                **turn_kwargs,
            )
            lengths = _host(turn.lengths_n)
            if stats is not None:
                steps = int(lengths.max(initial=0))
                stats["decode_row_steps"] = stats.get("decode_row_steps", 0) + s * steps
            tokens, logp = _host(turn.tokens_nt), _host(turn.logp_nt).astype(np.float32)
            stopped = _host(turn.stop_id_n) | _host(turn.stop_sequence_n)
            ended = []
            for k in np.flatnonzero(live):
                self.turn_ids[k] += tokens[k, : lengths[k]].tolist()
                self.turn_logp[k] += logp[k, : lengths[k]].tolist()
                self.budget_k[k] -= lengths[k]
                if stopped[k] or self.budget_k[k] == 0:
                    ended.append(int(k))
            if not ended:  # a live slot with no budget: the runner's contract broken
                raise RuntimeError(f"no slot's turn ended in a call; budgets {self.budget_k}")
            answers = self.runner.advance(
                [int(self.row_k[k]) for k in ended],
                [self.turn_ids[k] for k in ended],
                [self.turn_logp[k] for k in ended],
                truncated=[not stopped[k] for k in ended],
            )
            for j in ended:
                self.turn_ids[j], self.turn_logp[j] = [], []
            self._feed(dict(zip(ended, answers)))

    def _feed(self, answers: dict[int, list[int] | None]) -> None:
        """Feed each slot k of `answers` its answer's ids; where the answer is None (its
        episode ended, or the slot is new), refill it with the next pending episode's prompt
        (or leave it idle). Then set each one's next turn budget. Answers and prompts go in
        two appends, each as wide as its own longest (the cache's spare room is sized for
        either)."""
        fed: dict[int, list[int]] = {}
        refill: dict[int, list[int]] = {}
        for k, answer in answers.items():
            if answer is not None:
                fed[k] = answer
            elif self.pending:
                self.row_k[k] = self.pending.pop()
                refill[k] = self.prompts[self.row_k[k]]
            else:
                self.row_k[k] = -1
        for part, width_of in (
            (fed, lambda w: _round_up(w, ANSWER_WIDTH_MULTIPLE)),
            (refill, bucket_width),
        ):
            longest = max((len(x) for x in part.values()), default=0)
            if not longest:
                continue
            s = len(self.row_k)
            tokens = np.full((s, width_of(longest)), self.pad_id, np.int32)
            lengths = np.zeros(s, np.int32)
            for k, x in part.items():
                tokens[k, : len(x)] = x
                lengths[k] = len(x)
            reset = np.isin(np.arange(s), list(refill)) if part is refill else None
            self.state = append(self.model, self.state, tokens, lengths, reset_n=reset)
        for k in answers:
            if self.row_k[k] >= 0:
                budget = self.runner.turn_budget(int(self.row_k[k]))
                self.budget_k[k] = min(budget, self.max_tokens)


class EpisodeRows(NamedTuple):
    """N episodes as the trainer's rows, S = P + T columns.

    tokens_ns: `[N, S]` int32 prompt (left-padded to P) then the completion's ids (policy and
      environment, right-padded to T).
    mask_ns: `[N, S]` bool every real id (the context the model attends to).
    completion_mask_nt: `[N, T]` bool the policy's ids (the loss; environment ids and padding
      False).
    sampler_logp_nt: `[N, T]` float32 the sampler's logprobs of the policy's ids (0 elsewhere).
    rewards_n: `[N]` float32 the episodes' final rewards.
    token_rewards_nt: `[N, T]` float32 per-turn rewards on each turn's last id, the final one
      on the last policy id (`Episode.token_rewards`).
    lengths_n: `[N]` int32 completion ids per episode (policy and environment).
    """

    tokens_ns: np.ndarray
    mask_ns: np.ndarray
    completion_mask_nt: np.ndarray
    sampler_logp_nt: np.ndarray
    rewards_n: np.ndarray
    token_rewards_nt: np.ndarray
    lengths_n: np.ndarray


def episode_batch(
    episodes: list[Episode],
    *,
    prompt_width: int | None = None,
    width: int | None = None,
    pad_id: int = 0,
) -> EpisodeRows:
    """Lay N episodes out as the trainer's rows (`EpisodeRows`): P = `prompt_width` (default
    `bucket_width` of the longest prompt), T = `width` (default the longest completion)."""
    longest = max(len(e.prompt_ids) for e in episodes)
    p = bucket_width(longest) if prompt_width is None else int(prompt_width)
    comp = pad_episodes(episodes, width=width, pad_id=pad_id)
    tokens_ns, mask_ns = pad_token_ids(
        [e.prompt_ids for e in episodes],
        [e.completion_ids() for e in episodes],
        prompt_width=p,
        completion_width=comp.tokens_nt.shape[1],
        pad_id=pad_id,
    ).sequences()
    return EpisodeRows(
        tokens_ns=tokens_ns,
        mask_ns=mask_ns,
        completion_mask_nt=comp.mask_nt,
        sampler_logp_nt=comp.logp_nt,
        rewards_n=comp.rewards_n,
        token_rewards_nt=comp.token_rewards_nt,
        lengths_n=comp.lengths_n,
    )
