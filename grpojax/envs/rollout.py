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
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
from jax import Array

from grpojax.data import pad_token_ids
from grpojax.envs.episode import Episode, EpisodeRunner, pad_episodes
from grpojax.ops.checks import check_int
from grpojax.sampling.generate import bucket_width
from grpojax.sampling.multiturn import append, sample_turn, start
from grpojax.sampling.transforms import SamplingConfig

__all__ = ["EpisodeRows", "episode_batch", "rollout_episodes"]

ANSWER_WIDTH_MULTIPLE = 16  # answers are padded to a multiple of it: few compiled widths


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


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

    Returns:
      The N `Episode`s, row order.
    """
    check_int("max_turn_tokens", max_turn_tokens)
    prompts = runner.prompt_ids()
    if any(e.segments for e in runner.episodes):
        raise ValueError("rollout_episodes needs a fresh EpisodeRunner (no turn taken yet)")
    p = bucket_width(max(len(ids) for ids in prompts))
    laid = pad_token_ids(prompts, [[]] * len(prompts), prompt_width=p, completion_width=1)
    # Every id of an episode fits in P + max_episode_tokens slots; an answer's padding may
    # reach past its row's last one by up to the padded width.
    e = runner.max_episode_tokens
    slack = _round_up(min(e, runner.max_observation_tokens), ANSWER_WIDTH_MULTIPLE)
    state = start(
        model,
        laid.prompt_tokens_np,
        laid.prompt_lengths_n,
        capacity=p + e + slack,
        cache_dtype=cache_dtype,
    )
    stop_sequences = runner.stop_sequences()
    while runner.active_rows():
        budget_n = np.minimum(runner.turn_budgets(), max_turn_tokens)
        state, turn = sample_turn(
            model,
            state,
            key=key,
            budget_n=budget_n,
            max_tokens=max_turn_tokens,
            sample_ids_n=sample_ids_n,
            sampling=sampling,
            stop_ids=stop_ids,
            stop_sequences=stop_sequences,
            pad_id=pad_id,
        )
        answers_nw, answer_len_n = runner.advance_turn(
            turn.tokens_nt,
            turn.lengths_n,
            turn.logp_nt,
            stopped_n=np.asarray(turn.stop_id_n) | np.asarray(turn.stop_sequence_n),
            pad_id=pad_id,
            width_multiple=ANSWER_WIDTH_MULTIPLE,
        )
        if answer_len_n.any():
            state = append(model, state, answers_nw, answer_len_n)
    return runner.episodes


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
