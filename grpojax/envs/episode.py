"""Episodes as token segments, and the host-side stepping of N environments between turns.

An episode's ids are its prompt, then alternating segments: a policy turn (the ids the
sampler drew, with their logprobs) and an environment answer (ids the runner rendered once
from the observation). Nothing is ever re-encoded from text: the trainer's sequence is
`Episode.tokens()`, exactly the ids the sampler's cache saw, and `loss_mask()` is 1 on the
policy's ids only. A single-turn rollout is the one-segment case.

    prompt | policy turn 1 | env answer 1 | policy turn 2 | ...      tokens()   [P + C]
       0   |  1 1 1 1 1    |   0 0 0 0    |  1 1 1        |          loss_mask  [P + C]
           |  lp lp lp ... |   0 0 0 0    |  lp lp lp     |  sampler_logprobs  [C]

`EpisodeRunner` drives N environments (one per row; rows n = b*G + g as everywhere) with no
model: the sampler asks it for each row's prompt ids, per-turn token budgets and stop
sequences, samples a turn for every active row, and hands the turn back to `advance`, which
steps every environment concurrently and returns the ids to append to each row's cache (None
once the row's episode is over). Seats of a shared game (`Environment.seats` > 1, e.g.
TextArena self-play) take turns: a seat whose `poll` says another is to move waits (its turn
budget is 0, so it samples nothing) and is woken, with what happened since its last move,
after the step that hands it the move. The JAX side's loop (`grpojax.sampling.multiturn`):

    runner = EpisodeRunner(envs, tokenizer, max_episode_tokens=T)
    prompts = runner.prompt_ids()                       # N lists of ids, left-pad them
    state = start(model, prompt_np, lengths_n, capacity=P + T + W_max)
    while runner.active_rows():
        state, turn = sample_turn(model, state, key=key, budget_n=runner.turn_budgets(),
                                  max_tokens=T_turn, stop_ids=stop_ids_of(tokenizer),
                                  stop_sequences=runner.stop_sequences())
        obs_nw, obs_len_n = runner.advance_turn(turn.tokens_nt, turn.lengths_n, turn.logp_nt,
                                                stopped_n=turn.stop_id_n | turn.stop_sequence_n)
        state = append(model, state, obs_nw, obs_len_n)
    batch = pad_episodes(runner.episodes, width=T)      # tokens, masks, logprobs, rewards
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import logging
import math
import pickle
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, NamedTuple

import numpy as np

from grpojax.envs.base import Environment, Prompt, RawText, Step
from grpojax.envs.tools import has_chat_template, tools_prompt
from grpojax.errors import UserError

__all__ = [
    "DONE_REASONS",
    "PLAIN_OBSERVATION_FORMAT",
    "Episode",
    "EpisodeBatch",
    "EpisodeRunner",
    "Segment",
    "demonstration_episodes",
    "make_environments",
    "pad_episodes",
    "render_observation",
    "render_prompt",
]

log = logging.getLogger(__name__)

# done:         a step said done.
# eos:          the policy's turn ended with one of the runner's `end_ids`.
# max_turns:    the environment's `max_turns` policy turns were taken.
# token_budget: a turn ran out of its token budget, or no observation and next turn fit in
#               `max_episode_tokens`.
# error:        a step raised, timed out or returned something other than a Step (reward 0).
# stalled:      a seat of a shared game waited while no row could move (another seat's
#               episode ended first, cut by a budget or an error): reward 0, as for a game cut
#               short.
DONE_REASONS = ("done", "eos", "max_turns", "token_budget", "error", "stalled")
DoneReason = Literal["done", "eos", "max_turns", "token_budget", "error", "stalled"]
PLAIN_OBSERVATION_FORMAT = "\n{observation}\n"
# Appended where an observation is cut (for its character cap or the episode's token budget).
TRUNCATION_NOTE = " ...(cut)"
_SENTINEL = "GRPOJAX_ASSISTANT_TURN"


@dataclasses.dataclass(frozen=True)
class Segment:
    """A run of ids after the prompt: a policy turn (`logprobs`: the sampler's logprob of each
    id, same length) or an environment answer (`logprobs` None)."""

    ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None
    kind: Literal["policy", "env"]

    def __post_init__(self):
        if self.kind == "policy":
            if self.logprobs is None or len(self.logprobs) != len(self.ids):
                got = None if self.logprobs is None else len(self.logprobs)
                raise ValueError(
                    f"a policy segment needs one logprob per id: {len(self.ids)} ids, {got} "
                    "logprobs"
                )
        elif self.kind == "env":
            if self.logprobs is not None:
                raise ValueError("an env segment carries no logprobs (logprobs=None)")
        else:
            raise ValueError(f"segment kind must be 'policy' or 'env', got {self.kind!r}")


@dataclasses.dataclass
class Episode:
    """One episode's ids and outcome. P = len(prompt_ids), C = completion ids (all segments).

    turn_rewards: one per policy turn (the Step's reward; None for none or a failed step).
    final_reward: `Environment.reward()` once the episode ended (0.0 after an error).
    done_reason: one of DONE_REASONS once ended, else None.
    counters: this episode's int counters (the steps' info, summed, and the runner's events).
    """

    prompt_ids: tuple[int, ...]
    segments: list[Segment] = dataclasses.field(default_factory=list)
    turn_rewards: list[float | None] = dataclasses.field(default_factory=list)
    final_reward: float | None = None
    done_reason: DoneReason | None = None
    counters: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)

    @property
    def finished(self) -> bool:
        return self.done_reason is not None

    @property
    def num_turns(self) -> int:
        """Policy turns taken."""
        return sum(s.kind == "policy" for s in self.segments)

    @property
    def num_policy_tokens(self) -> int:
        return sum(len(s.ids) for s in self.segments if s.kind == "policy")

    @property
    def num_env_tokens(self) -> int:
        return sum(len(s.ids) for s in self.segments if s.kind == "env")

    @property
    def num_completion_tokens(self) -> int:
        """C: every id after the prompt."""
        return sum(len(s.ids) for s in self.segments)

    def completion_ids(self) -> list[int]:
        """`[C]` the segments' ids in order."""
        return [i for s in self.segments for i in s.ids]

    def tokens(self) -> list[int]:
        """`[P + C]` the prompt's ids then every segment's, exactly as sampled / rendered."""
        return [*self.prompt_ids, *self.completion_ids()]

    def completion_mask(self) -> np.ndarray:
        """`[C]` bool, True on policy ids."""
        return np.array([s.kind == "policy" for s in self.segments for _ in s.ids], bool)

    def loss_mask(self) -> np.ndarray:
        """`[P + C]` bool aligned with `tokens()`: True on policy ids, False on prompt / env."""
        return np.concatenate([np.zeros(len(self.prompt_ids), bool), self.completion_mask()])

    def sampler_logprobs(self) -> np.ndarray:
        """`[C]` float32 aligned with the completion: each policy id's sampler logprob, 0 on
        env ids."""
        out = [lp for s in self.segments for lp in (s.logprobs or (0.0,) * len(s.ids))]
        return np.asarray(out, np.float32)

    def turn_ends(self) -> list[int]:
        """Index in the completion of each policy turn's last id, in turn order."""
        ends, t = [], 0
        for s in self.segments:
            t += len(s.ids)
            if s.kind == "policy":
                ends.append(t - 1)
        return ends

    def token_rewards(self) -> np.ndarray:
        """`[C]` float32: turn k's reward on its last id, plus `final_reward` on the last policy
        id (r_t for token-level returns, e.g. `grpojax.reinforce_pp_returns`)."""
        out = np.zeros(self.num_completion_tokens, np.float32)
        ends = self.turn_ends()
        for end, r in zip(ends, self.turn_rewards):
            if r is not None:
                out[end] += r
        if ends and self.final_reward is not None:
            out[ends[-1]] += self.final_reward
        return out


class EpisodeBatch(NamedTuple):
    """N episodes' completions right-padded to width T (`pad_episodes`).

    tokens_nt: `[N, T]` int32 completion ids (policy and env), `pad_id` after.
    lengths_n: `[N]` int32 completion lengths C_n.
    mask_nt: `[N, T]` bool, True on policy ids (the loss mask; env ids and padding False).
    logp_nt: `[N, T]` float32 sampler logprobs, 0 off the mask.
    token_rewards_nt: `[N, T]` float32 `Episode.token_rewards`, 0 after.
    rewards_n: `[N]` float32 final rewards (0 where None).
    num_turns_n: `[N]` int32 policy turns.
    """

    tokens_nt: np.ndarray
    lengths_n: np.ndarray
    mask_nt: np.ndarray
    logp_nt: np.ndarray
    token_rewards_nt: np.ndarray
    rewards_n: np.ndarray
    num_turns_n: np.ndarray


def pad_episodes(
    episodes: Sequence[Episode], *, width: int | None = None, pad_id: int = 0
) -> EpisodeBatch:
    """Stack N episodes' completions into `[N, T]` arrays, T = `width` (default: the longest).
    A completion longer than `width` is a ValueError (the runner's budget prevents it)."""
    lengths = np.array([e.num_completion_tokens for e in episodes], np.int32)
    t = int(lengths.max(initial=0)) if width is None else int(width)
    if lengths.size and lengths.max() > t:
        raise ValueError(f"an episode has {int(lengths.max())} completion ids > width {t}")
    n = len(episodes)
    tokens = np.full((n, t), pad_id, np.int32)
    mask = np.zeros((n, t), bool)
    logp = np.zeros((n, t), np.float32)
    token_rewards = np.zeros((n, t), np.float32)
    for i, e in enumerate(episodes):
        c = int(lengths[i])
        tokens[i, :c] = e.completion_ids()
        mask[i, :c] = e.completion_mask()
        logp[i, :c] = e.sampler_logprobs()
        token_rewards[i, :c] = e.token_rewards()
    rewards = np.array([e.final_reward or 0.0 for e in episodes], np.float32)
    turns = np.array([e.num_turns for e in episodes], np.int32)
    return EpisodeBatch(tokens, lengths, mask, logp, token_rewards, rewards, turns)


def _encode(tokenizer: Any, text: str, *, add_special_tokens: bool = False) -> list[int]:
    return [int(i) for i in tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]]


def _use_chat(tokenizer: Any, chat: bool | None) -> bool:
    if chat is None:
        return has_chat_template(tokenizer)
    if chat and not has_chat_template(tokenizer):
        raise UserError("chat=True but the tokenizer has no chat_template")
    return chat


def render_prompt(
    tokenizer: Any,
    prompt: Prompt,
    *,
    tools: Sequence[Mapping[str, Any]] = (),
    chat: bool | None = None,
    generation_prompt: bool = True,
) -> list[int]:
    """The ids of an episode's first prompt (`Environment.reset()`'s value), `tools` offered.
    `generation_prompt` False: the chat template's text ends after the prompt's last message
    (a seat that waits for another's move first; `render_observation(after_prompt=True)`
    continues it).

    With the chat template (chat None: where the tokenizer has one) the text is
    `tools_prompt`'s (text becomes the user message; the generation prompt is added) and is
    encoded without the tokenizer's own special tokens (the template wrote them); plain text
    is encoded with them, as `grpojax.data.PromptSource` does, and so is `RawText` (never
    templated; no tools).
    """
    if isinstance(prompt, RawText):
        if tools:
            raise UserError("env prompt: RawText takes no tools (it is encoded as written)")
        text, special = str(prompt), True
    else:
        use_chat = _use_chat(tokenizer, chat)
        text = tools_prompt(
            tokenizer, tools, prompt, chat=use_chat, generation_prompt=generation_prompt
        )
        special = not use_chat
    ids = _encode(tokenizer, text, add_special_tokens=special)
    if not ids:
        raise UserError(f"env prompt encodes to zero tokens: {text!r}")
    return ids


def _template_pieces(tokenizer: Any, messages: Sequence[Mapping[str, Any]]) -> tuple[str, str]:
    """(marker, between): the text the chat template writes after an assistant turn's content
    when the turn is last (the end-of-turn marker, its common prefix with `between`) and
    `between`, the text from the end of the assistant content to the start of the next
    assistant content with `messages` in between."""
    context = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _SENTINEL}]
    try:
        closed = tokenizer.apply_chat_template(context, tokenize=False)
        after = tokenizer.apply_chat_template(
            [*context, *messages], tokenize=False, add_generation_prompt=True
        )
    except Exception as e:  # jinja2 TemplateError, or a template's own raise_exception
        roles = " / ".join(sorted({repr(str(m.get("role"))) for m in messages}))
        raise UserError(
            f"env observation_role {roles}: the tokenizer's chat template cannot render a "
            f"{roles} message after an assistant turn ({type(e).__name__}: {e}); use a role "
            "it knows"
        ) from None
    if _SENTINEL not in closed or _SENTINEL not in after:
        raise UserError("the tokenizer's chat template drops assistant messages' content")
    close = closed[closed.rindex(_SENTINEL) + len(_SENTINEL) :]
    between = after[after.index(_SENTINEL) + len(_SENTINEL) :]
    same = 0
    while same < min(len(close), len(between)) and close[same] == between[same]:
        same += 1
    return close[:same], between


def _after_prompt_text(tokenizer: Any, messages: Sequence[Mapping[str, Any]]) -> str:
    """The chat template's text from the end of a prompt rendered without the generation
    prompt to the start of the assistant's first turn, `messages` in between."""
    context = [{"role": "user", "content": _SENTINEL}]
    before = tokenizer.apply_chat_template(context, tokenize=False)
    after = tokenizer.apply_chat_template(
        [*context, *messages], tokenize=False, add_generation_prompt=True
    )
    if not after.startswith(before):
        raise UserError(
            "the tokenizer's chat template rewrites a prompt when a message follows it; a "
            "seat that waits first cannot be rendered with it"
        )
    return after[len(before) :]


def render_observation(
    tokenizer: Any,
    observation: str | Sequence[int] | Sequence[Mapping[str, Any]],
    *,
    role: str = "user",
    policy_ids: Sequence[int] = (),
    chat: bool | None = None,
    plain_format: str = PLAIN_OBSERVATION_FORMAT,
    after_prompt: bool = False,
) -> list[int]:
    """The ids to append after a policy turn (`policy_ids`, as sampled) for `observation`;
    with `after_prompt`, right after a prompt rendered without its generation prompt (a seat
    that waited for another's first move: the template's text between the prompt's last
    message and the assistant's first turn, the observation in between).

    Ids given directly are returned as given (an empty sequence: none); `RawText` is
    tokenised as it is, without special tokens (empty: none). Text, or chat
    messages (several, of their own roles: an agent's tool results and user message,
    `grpojax.envs.agent`):
      - with the chat template (chat None: where the tokenizer has one): the template is
        rendered twice with `tokenize=False`, on a stand-in conversation [user, assistant
        "<S>"] alone and with the observation (text: as a `role` message; messages: as
        given) and the generation prompt after it. The text after "<S>" in the second is
        everything between the end of the assistant's content and the start of its next
        turn: the template's end-of-turn marker, the observation message, the next
        assistant header (Qwen:
        "<|im_end|>\\n<|im_start|>user\\n{obs}<|im_end|>\\n<|im_start|>assistant\\n"). It is
        tokenised once. The stand-in keeps templates that rewrite earlier turns (Qwen3 drops
        past reasoning) from changing the suffix. The sampled turn may already end with the
        marker's leading ids (it stopped at EOS = <|im_end|>) or not (it stopped at a stop
        string such as </tool_call>): the longest run of the suffix's leading ids that lies
        within the marker and equals the turn's last ids is dropped, so the marker appears
        once either way (as the policy's id where it sampled it, else as an env id).
      - without: `plain_format.format(observation=text)` ("\\n{observation}\\n"; messages:
        their contents joined by newlines), tokenised once without special tokens.

    The ids are not those a tokenisation of the whole conversation would give at the
    boundary (a BPE merge across it), which does not matter: the sampler and the trainer
    both see these.
    """
    if isinstance(observation, RawText):
        return _encode(tokenizer, observation)
    messages = None
    if not isinstance(observation, str):
        if not observation or not all(isinstance(m, Mapping) for m in observation):
            return [int(i) for i in observation]  # type: ignore[arg-type]
        messages = [dict(m) for m in observation]  # type: ignore[arg-type]
    if not _use_chat(tokenizer, chat):
        text = observation if messages is None else _contents(messages)
        return _encode(tokenizer, plain_format.format(observation=text))
    if messages is None:
        messages = [{"role": role, "content": observation}]
    if after_prompt:
        return _encode(tokenizer, _after_prompt_text(tokenizer, messages))
    marker, between = _template_pieces(tokenizer, messages)
    ids = _encode(tokenizer, between)
    tail = list(policy_ids)
    # Leading ids of `between` that spell part of the marker: the only ones the turn may
    # already hold.
    within = 0
    while within < min(len(ids), len(tail)):
        text = tokenizer.decode(
            ids[: within + 1], skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        if not marker.startswith(text):
            break
        within += 1
    for k in range(min(within, len(tail)), 0, -1):
        if tail[-k:] == ids[:k]:
            return ids[k:]
    return ids


def make_environments(
    env_cls: type[Environment],
    rows: Sequence[Mapping[str, Any]],
    *,
    group_size: int = 1,
    **kwargs: Any,
) -> list[Environment]:
    """N = B*S*G environments, S = `env_cls.seats`: row n = (b*S + s)*G + g is seat s of game g
    of rows[b] (`Environment.table`); one seat: n = b*G + g, env_cls(row, **kwargs) each."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise UserError(f"group_size must be an int >= 1, got {group_size!r}")
    envs: list[Environment] = []
    for row in rows:
        made = env_cls.table(row, group_size, **kwargs)
        if len(made) != env_cls.seats * group_size:
            raise UserError(
                f"{env_cls.__name__}.table made {len(made)} environments for {env_cls.seats} "
                f"seats x {group_size} games"
            )
        envs.extend(made)
    return envs


def _finite(value: Any) -> float | None:
    """`value` as a finite float; None where it is not a number or not finite."""
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _check_positive(name: str, value: Any, *, integer: bool) -> None:
    ok = not isinstance(value, bool) and isinstance(value, int if integer else int | float)
    if not (ok and value > 0):
        raise UserError(f"{name} must be {'an int' if integer else 'a number'} > 0, got {value!r}")


class EpisodeRunner:
    """N environments' episodes, stepped between the sampler's turns (no model here).

    Args:
      envs: one `Environment` per row (`make_environments`).
      tokenizer: renders prompts and observations (a `transformers` tokenizer).
      max_episode_tokens: the completion's token budget (every id after the prompt, policy and
        env): `turn_budgets` never lets a turn exceed it, an observation is cut to leave room
        for at least one more policy id, and where not even that fits the episode ends
        ("token_budget").
      max_observation_chars: an observation's text is cut to this many characters (plus
        TRUNCATION_NOTE) before it is rendered.
      max_observation_tokens: an answer's ids are cut to this many (the text so that its
        rendering, with TRUNCATION_NOTE, fits): the multi-turn sampler's cache keeps this many
        slots spare for an answer's padding (`grpojax.envs.rollout`).
      step_timeout_s: wall-clock seconds one `step` (or `reward`, or `reset`) call may take.
        A call that runs over is abandoned (a thread cannot be killed; it runs on until it
        returns, and an interpreter exit waits for it), its episode ends with reason "error"
        and reward 0.
      max_workers: threads stepping environments at once (default: one per row, at most 64).
      chat: render through the tokenizer's chat template (None: where it has one).
      end_ids: ids that end the whole episode when a policy turn ends with one (e.g.
        <|endoftext|>); the step still sees the turn. Default none: EOS ends a turn only.
      plain_format: the observation format without a chat template.
      share: for a run across processes, a function that returns `compute()`'s value
        computed on one process, on every process (`grpojax.distributed.on_primary`): every
        environment call (reset, step, reward) then runs there alone, and each process
        keeps the same episodes from the same results. None (one process): run here.

    Calls: `prompt_ids()` once; then per turn `turn_budgets()` (and `stop_sequences()`) for the
    sampler, `advance(...)` (or `advance_turn(...)` on the sampler's arrays) with what it
    sampled; `episodes` and `metrics()` at the end. `last_observations[r]` is row r's last
    Step observation as the env returned it (before any cut or rendering; None before the
    first turn and after a failed or truncated turn; a woken seat's, its `poll`'s). Errors in a
    step or reward never raise out of `advance`; bad input from the caller (a finished row, a
    turn over its budget) does.
    """

    def __init__(
        self,
        envs: Sequence[Environment],
        tokenizer: Any,
        *,
        max_episode_tokens: int,
        max_observation_chars: int = 8192,
        max_observation_tokens: int = 1024,
        step_timeout_s: float = 60.0,
        max_workers: int | None = None,
        chat: bool | None = None,
        end_ids: Sequence[int] = (),
        plain_format: str = PLAIN_OBSERVATION_FORMAT,
        share: Callable[[Callable[[], Any]], Any] | None = None,
    ):
        self.envs = list(envs)
        self.share = share
        if not self.envs or not all(isinstance(e, Environment) for e in self.envs):
            raise UserError("EpisodeRunner needs one or more Environment instances (envs)")
        _check_positive("max_episode_tokens", max_episode_tokens, integer=True)
        _check_positive("max_observation_chars", max_observation_chars, integer=True)
        _check_positive("max_observation_tokens", max_observation_tokens, integer=True)
        _check_positive("step_timeout_s", step_timeout_s, integer=False)
        if max_workers is not None:
            _check_positive("max_workers", max_workers, integer=True)
        if "{observation}" not in plain_format:
            raise UserError(f"plain_format must contain '{{observation}}', got {plain_format!r}")
        self.tokenizer = tokenizer
        self.chat = _use_chat(tokenizer, chat)
        self.max_episode_tokens = int(max_episode_tokens)
        self.max_observation_chars = int(max_observation_chars)
        self.max_observation_tokens = int(max_observation_tokens)
        self.step_timeout_s = float(step_timeout_s)
        self.max_workers = int(max_workers) if max_workers else min(len(self.envs), 64)
        self.end_ids = frozenset(int(i) for i in end_ids)
        self.plain_format = plain_format
        self.counters: collections.Counter[str] = collections.Counter()
        self.errors: list[str] = []  # the first few step / reward failures, for the log
        self.episodes: list[Episode] = []
        self.last_observations: list[str | Sequence[Any] | None] = [None] * len(self.envs)
        self._prompts: list[list[int]] | None = None
        # Seats of shared games (`Environment.seats` > 1): the rows waiting for another seat's
        # move, and the answers of the rows the last `advance` woke (`woken`).
        self.seated = any(env.seats > 1 for env in self.envs)
        self.waiting: set[int] = set()
        self.woken: dict[int, list[int]] = {}

    # -- what the sampler asks -------------------------------------------------------------

    def prompt_ids(self) -> list[list[int]]:
        """Each row's prompt ids (calls every `reset`, concurrently, on the first call)."""
        if self._prompts is None:
            results = self._run_all(
                {r: env.reset for r, env in enumerate(self.envs)}, self.step_timeout_s
            )
            for r, env in enumerate(self.envs):
                status, value = results[r]
                if status != "ok":
                    why = _failed(status, value)
                    raise UserError(f"row {r}: {type(env).__name__}.reset() {why}")
            if self.seated:
                self._first_polls()
            prompts = [
                render_prompt(
                    self.tokenizer,
                    results[r][1],
                    tools=env.tool_schemas(),
                    chat=self.chat,
                    generation_prompt=r not in self.waiting,
                )
                for r, env in enumerate(self.envs)
            ]
            self._prompts = prompts
            self.episodes = [Episode(prompt_ids=tuple(p)) for p in prompts]
        return [list(p) for p in self._prompts]

    def active_rows(self) -> list[int]:
        """Rows whose episode goes on (all of them before the first turn)."""
        self.prompt_ids()
        return [r for r, e in enumerate(self.episodes) if not e.finished]

    def ready_rows(self) -> list[int]:
        """Active rows that take the next turn: all but the seats waiting for another's move."""
        return [r for r in self.active_rows() if r not in self.waiting]

    def turn_budget(self, row: int) -> int:
        """Tokens row `row` may sample in its next turn: 0 once finished or while it waits for
        another seat's move, else min(max_turn_tokens, max_episode_tokens - completion ids so
        far)."""
        self.prompt_ids()
        ep = self.episodes[row]
        if ep.finished or row in self.waiting:
            return 0
        left = self.max_episode_tokens - ep.num_completion_tokens
        cap = self.envs[row].max_turn_tokens
        return max(0, left if cap is None else min(cap, left))

    def turn_budgets(self) -> np.ndarray:
        """`[N]` int32 `turn_budget` of every row (the sampler's `budget_n`)."""
        return np.array([self.turn_budget(r) for r in range(len(self.envs))], np.int32)

    def stop_sequences(self) -> tuple[tuple[int, ...], ...]:
        """The active environments' `stop_strings` as id sequences (each string encoded alone,
        no special tokens), no repeats: the sampler ends a turn whose last ids equal one. A
        BPE tokenizer may spell a string differently after other text; a turn that writes it
        so runs on to EOS or its budget (Qwen2.5's </tool_call> is one added token: exact)."""
        strings = dict.fromkeys(s for r in self.active_rows() for s in self.envs[r].stop_strings)
        seqs = (tuple(_encode(self.tokenizer, s)) for s in strings)
        return tuple(dict.fromkeys(s for s in seqs if s))

    # -- one turn --------------------------------------------------------------------------

    def advance(
        self,
        rows: Sequence[int],
        policy_ids: Sequence[Sequence[int]],
        policy_logprobs: Sequence[Sequence[float]],
        texts: Sequence[str] | None = None,
        *,
        truncated: Sequence[bool] | None = None,
    ) -> list[list[int] | None]:
        """Record a policy turn for each of `rows` and step their environments concurrently.

        Args:
          rows: ready rows that took a turn (each once; `ready_rows`).
          policy_ids: each row's sampled ids this turn (>= 1, <= its `turn_budget`).
          policy_logprobs: the sampler's logprob of each of those ids.
          texts: each turn decoded (None: `tokenizer.decode(ids, skip_special_tokens=True)`).
          truncated: per row, the turn ran out of its budget without a stop (EOS or stop
            string): the episode ends ("token_budget") and its step is not called.

        Returns:
          Per row (in `rows` order), the ids to append before its next turn ([] where the step
          gave no observation: the next turn follows at once, or the row waits for another
          seat), or None where the episode ended. A step that raises, times out or returns no
          Step ends that episode with reward 0 ("error", counted); the other rows go on.
          Seats of shared games: after the steps, every waiting seat and every stepped one
          that got no observation is polled (`Environment.poll`); the waiting rows it wakes
          that took no turn here have their answers in `woken` (row -> ids) until the next
          call. Where no active row is ready after that, the waiting ones end ("stalled").
        """
        self.prompt_ids()
        rows = [int(r) for r in rows]
        n = len(rows)
        truncated = [False] * n if truncated is None else [bool(t) for t in truncated]
        if not (len(policy_ids) == len(policy_logprobs) == len(truncated) == n):
            raise ValueError(
                f"advance got {n} rows, {len(policy_ids)} policy_ids, {len(policy_logprobs)} "
                f"policy_logprobs and {len(truncated)} truncated flags; one each per row"
            )
        if texts is not None and len(texts) != n:
            raise ValueError(f"advance got {len(texts)} texts for {n} rows")
        if len(set(rows)) != n:
            raise ValueError(f"advance got a row twice: {rows}")
        turns: list[list[int]] = []
        for k, r in enumerate(rows):
            if not 0 <= r < len(self.envs) or self.episodes[r].finished or r in self.waiting:
                raise ValueError(f"row {r} is not a ready row (ready: {self.ready_rows()})")
            ids = [int(i) for i in policy_ids[k]]
            budget = self.turn_budget(r)
            if not 1 <= len(ids) <= budget:
                raise ValueError(
                    f"row {r}: a turn of {len(ids)} ids; it must have 1 to {budget} (turn_budget)"
                )
            turns.append(ids)
        if texts is None:
            texts = [self.tokenizer.decode(ids, skip_special_tokens=True) for ids in turns]
        for k, r in enumerate(rows):
            lps = tuple(float(x) for x in policy_logprobs[k])
            self.episodes[r].segments.append(Segment(tuple(turns[k]), lps, "policy"))
            self._count(r, "turns", 1)
            self._count(r, "policy_tokens", len(turns[k]))

        calls = {
            r: functools.partial(self.envs[r].step, texts[k])
            for k, r in enumerate(rows)
            if not truncated[k]
        }
        results = self._run_all(calls, self.step_timeout_s)
        out: dict[int, list[int]] = {}
        ended: list[int] = []
        told: dict[int, Callable[[], Any]] = {}
        self.woken = {}
        silent: list[int] = []  # seats whose step gave no observation: polled below
        for k, r in enumerate(rows):
            ep, env = self.episodes[r], self.envs[r]
            self.last_observations[r] = None
            if truncated[k]:
                ep.turn_rewards.append(None)
                self._count(r, "truncated_turns", 1)
                self._end(r, "token_budget")
                ended.append(r)
                told[r] = functools.partial(env.turn_truncated, texts[k])
                continue
            step = self._checked_step(r, *results[r])
            if step is None:
                ep.turn_rewards.append(None)
                self._end(r, "error")
                ep.final_reward = 0.0
                continue
            self.last_observations[r] = step.observation
            ep.turn_rewards.append(self._turn_reward(r, step.reward))
            for key, value in step.info.items():
                if isinstance(value, int | np.integer):
                    self._count(r, str(key), int(value))
            if step.done:
                reason: DoneReason | None = "done"
            elif turns[k][-1] in self.end_ids:
                reason = "eos"
            elif ep.num_turns >= env.max_turns:
                reason = "max_turns"
            elif self.seated and step.observation is None:
                reason = None
                out[r] = []
                silent.append(r)
            else:
                answer = self._observation_ids(r, step.observation, turns[k])
                reason = "token_budget" if answer is None else None
                if answer is not None:
                    self._add_answer(r, answer)
                    out[r] = answer
            if reason is not None:
                self._end(r, reason)
                ended.append(r)

        for r, (status, value) in self._run_all(told, self.step_timeout_s).items():
            if status != "ok":
                self._error(r, "step_errors", f"turn_truncated {_failed(status, value)}")
        self._rewards(ended)
        if self.seated:  # after the rewards: a seat's ended episode may have cut its game
            self._rewards(self._poll_seats(silent, out))
        return [out.get(r) for r in rows]

    def _rewards(self, ended: list[int]) -> None:
        """Each ended row's `reward()`, concurrently, as its final reward."""
        rewards = self._run_all({r: self.envs[r].reward for r in ended}, self.step_timeout_s)
        for r in ended:
            self.episodes[r].final_reward = self._final_reward(r, *rewards[r])

    def _first_polls(self) -> None:
        """After the resets: the seats that wait for another's first move (`waiting`)."""
        polls = self._run_all({r: env.poll for r, env in enumerate(self.envs)}, self.step_timeout_s)
        for r, env in enumerate(self.envs):
            status, value = polls[r]
            name = f"row {r}: {type(env).__name__}.poll() after reset()"
            if status != "ok":
                raise UserError(f"{name} {_failed(status, value)}")
            if value is None:
                self.waiting.add(r)
            elif not isinstance(value, Step) or value.done or value.observation is not None:
                raise UserError(
                    f"{name} gave {value!r}; before a seat's first turn it must be None (it "
                    "waits) or Step() (it moves first, its prompt reset()'s)"
                )
        if len(self.waiting) == len(self.envs):
            raise UserError("every seat waits for another after reset(): no seat moves first")

    def _poll_seats(self, silent: list[int], out: dict[int, list[int]]) -> list[int]:
        """Poll the waiting seats and the stepped ones in `silent`; wake, keep waiting or end
        each (its answer into `out` for a stepped row, else `woken`). Returns the rows it
        ended whose `reward` is due."""
        asked = sorted(set(silent) | {r for r in self.waiting if not self.episodes[r].finished})
        polls = self._run_all({r: self.envs[r].poll for r in asked}, self.step_timeout_s)
        ended: list[int] = []
        for r in asked:
            status, value = polls[r]
            ep = self.episodes[r]
            if status == "ok" and value is None:
                self.waiting.add(r)
                continue
            self.waiting.discard(r)
            value = self._checked_step(r, status, value, call="poll")
            if value is None:
                out.pop(r, None)
                self._end(r, "error")
                ep.final_reward = 0.0
                continue
            if value.done:
                out.pop(r, None)
                self._end(r, "done")
                ended.append(r)
                continue
            self.last_observations[r] = value.observation
            turns = [seg for seg in ep.segments if seg.kind == "policy"]
            answer = self._observation_ids(
                r, value.observation, list(turns[-1].ids) if turns else [], after_prompt=not turns
            )
            if answer is None:
                out.pop(r, None)
                self._end(r, "token_budget")
                ended.append(r)
                continue
            self._add_answer(r, answer)
            if r in out:
                out[r] = answer
            else:
                self.woken[r] = answer
        if self.active_rows() and not self.ready_rows():
            for r in sorted(self.waiting):
                self._error(r, "seat_stalls", "waited for a seat whose episode had ended")
                out.pop(r, None)
                self._end(r, "stalled")
                self.episodes[r].final_reward = 0.0
            self.waiting.clear()
        return ended

    def advance_turn(
        self,
        tokens_nt: Any,
        lengths_n: Any,
        logp_nt: Any,
        *,
        stopped_n: Any,
        pad_id: int = 0,
        width_multiple: int = 16,
    ) -> tuple[np.ndarray, np.ndarray]:
        """`advance` on a sampler turn's arrays over all N rows; the answers padded for
        `append`.

        Args:
          tokens_nt: `[N, T]` the turn's ids; lengths_n: `[N]` ids per row (0 for rows that
            sat out, which must be exactly the finished and waiting ones); logp_nt: `[N, T]`
            logprobs.
          stopped_n: `[N]` bool, the turn ended at a stop id or stop sequence (else it ran
            out of its budget: truncated).
          width_multiple: W is rounded up to a multiple of it (fewer compiled widths).

        Returns:
          (tokens_nw `[N, W]` int32 each row's answer ids then `pad_id`, lengths_nw `[N]`
          int32; 0 for rows that ended or had nothing to add): the stepped rows' answers and
          the woken seats'.
        """
        tokens = np.asarray(tokens_nt)
        lengths = np.asarray(lengths_n)
        logp = np.asarray(logp_nt, np.float32)
        stopped = np.asarray(stopped_n, bool)
        n = len(self.envs)
        if tokens.ndim != 2 or tokens.shape[0] != n or lengths.shape != (n,):
            raise ValueError(
                f"tokens_nt must be [{n}, T] and lengths_n [{n}], got {tokens.shape} and "
                f"{lengths.shape}"
            )
        rows = self.ready_rows()
        if not np.array_equal(lengths > 0, np.isin(np.arange(n), rows)):
            raise ValueError(
                f"lengths_n must be > 0 exactly on the ready rows {rows}, got {lengths.tolist()}"
            )
        answers = dict(
            zip(
                rows,
                self.advance(
                    rows,
                    [tokens[r, : lengths[r]].tolist() for r in rows],
                    [logp[r, : lengths[r]].tolist() for r in rows],
                    truncated=[not stopped[r] for r in rows],
                ),
            )
        )
        answers.update(self.woken)
        out_len = np.zeros(n, np.int32)
        for r, ids in answers.items():
            out_len[r] = len(ids) if ids is not None else 0
        m = max(int(width_multiple), 1)
        width = max(m, -(-int(out_len.max(initial=0)) // m) * m)
        out = np.full((n, width), pad_id, np.int32)
        for r, ids in answers.items():
            if ids:
                out[r, : len(ids)] = ids
        return out, out_len

    def metrics(self) -> dict[str, int]:
        """Counters over every episode so far (ints): turns, policy_tokens, env_tokens,
        episodes_<reason>, step_errors, step_timeouts, reward_errors, reward_timeouts,
        bad_turn_rewards, truncated_turns, observation_char_truncations,
        observation_token_truncations, and the steps' info counters (for `ToolEnvironment`:
        tool_calls, parse_errors, unknown_tools, bad_arguments, tool_errors, tool_timeouts,
        output_truncations, final_answers)."""
        return dict(sorted(self.counters.items()))

    # -- internals -------------------------------------------------------------------------

    def _count(self, row: int, key: str, value: int) -> None:
        self.counters[key] += value
        self.episodes[row].counters[key] += value

    def _end(self, row: int, reason: DoneReason) -> None:
        self.episodes[row].done_reason = reason
        self._count(row, f"episodes_{reason}", 1)

    def _error(self, row: int, key: str, message: str) -> None:
        self._count(row, key, 1)
        if len(self.errors) < 20:
            self.errors.append(f"row {row} ({type(self.envs[row]).__name__}): {message}")
        log.warning("env row %d: %s", row, message)

    def _checked_step(self, row: int, status: str, value: Any, call: str = "step") -> Step | None:
        """The Step a `step` (or `poll`) call gave; None, the failure counted, where it timed
        out, raised or returned something else."""
        if status == "timeout":
            self._error(row, "step_timeouts", f"{call} timed out after {self.step_timeout_s:g} s")
            return None
        if status == "error":
            self._error(row, "step_errors", f"{call} raised {type(value).__name__}: {value}")
            return None
        if not isinstance(value, Step):
            self._error(row, "step_errors", f"{call} returned {type(value).__name__}, not a Step")
            return None
        return value

    def _add_answer(self, row: int, answer: list[int]) -> None:
        """Append a non-empty answer to row `row`'s episode as an env segment, counted."""
        if answer:
            self.episodes[row].segments.append(Segment(tuple(answer), None, "env"))
            self._count(row, "env_tokens", len(answer))

    def _turn_reward(self, row: int, reward: Any) -> float | None:
        if reward is None:
            return None
        value = _finite(reward)
        if value is None:
            self._error(row, "bad_turn_rewards", f"step reward {reward!r} is not a finite number")
        return value

    def _final_reward(self, row: int, status: str, value: Any) -> float:
        if status == "timeout":
            self._error(row, "reward_timeouts", f"reward timed out after {self.step_timeout_s:g} s")
            return 0.0
        if status == "error":
            self._error(row, "reward_errors", f"reward raised {type(value).__name__}: {value}")
            return 0.0
        reward = _finite(value)
        if reward is None:
            self._error(row, "reward_errors", f"reward {value!r} is not a finite number")
            return 0.0
        return reward

    def _observation_ids(
        self,
        row: int,
        observation: str | Sequence[Any] | None,
        turn: list[int],
        *,
        after_prompt: bool = False,
    ) -> list[int] | None:
        """The answer's ids, cut to leave room for one more policy id; None: no room.
        `after_prompt`: the first answer of a seat that waited first (`render_observation`)."""
        room = self.max_episode_tokens - self.episodes[row].num_completion_tokens - 1
        if room < 0:
            return None
        room = min(room, self.max_observation_tokens)
        if observation is None:
            return []
        if not isinstance(observation, str):
            ids = render_observation(
                self.tokenizer,
                observation,
                policy_ids=turn,
                chat=self.chat,
                plain_format=self.plain_format,
                after_prompt=after_prompt,
            )
            if len(ids) > room:
                self._count(row, "observation_token_truncations", 1)
                ids = ids[:room]
            return ids
        text = observation
        if len(text) > self.max_observation_chars:
            self._count(row, "observation_char_truncations", 1)
            text = text[: self.max_observation_chars] + TRUNCATION_NOTE
        raw = isinstance(observation, RawText)

        def render(text: str) -> list[int]:
            return render_observation(
                self.tokenizer,
                RawText(text) if raw else text,
                role=self.envs[row].observation_role,
                policy_ids=turn,
                chat=self.chat,
                plain_format=self.plain_format,
                after_prompt=after_prompt,
            )

        ids = render(text)
        if len(ids) <= room:
            return ids
        self._count(row, "observation_token_truncations", 1)
        if len(render(TRUNCATION_NOTE)) > room:
            return None
        # The longest prefix of the text whose rendering (with the note) fits; the template's
        # framing is kept whole. Token counts grow with the prefix, so bisect it.
        lo, hi = 0, len(text)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if len(render(text[:mid] + TRUNCATION_NOTE)) <= room:
                lo = mid
            else:
                hi = mid - 1
        return render(text[:lo] + TRUNCATION_NOTE)

    def _run_all(
        self, calls: Mapping[int, Callable[[], Any]], timeout_s: float
    ) -> dict[int, tuple[str, Any]]:
        """Run the calls concurrently: row -> ("ok", value) | ("error", exc) | ("timeout",
        None), each call's timeout counted from when a worker starts it. With `share`, on
        its one process, the results sent to every process (an exception that does not
        pickle as a RuntimeError naming it)."""
        if self.share is None:
            return self._run_here(calls, timeout_s)

        def portable() -> dict[int, tuple[str, Any]]:
            results = self._run_here(calls, timeout_s)
            return {r: (s, _portable(s, v)) for r, (s, v) in results.items()}

        return self.share(portable)

    def _run_here(
        self, calls: Mapping[int, Callable[[], Any]], timeout_s: float
    ) -> dict[int, tuple[str, Any]]:
        if not calls:
            return {}
        started: dict[int, float] = {}

        def run(row: int, fn: Callable[[], Any]) -> Any:
            started[row] = time.monotonic()
            return fn()

        results: dict[int, tuple[str, Any]] = {}
        pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=min(len(calls), self.max_workers), thread_name_prefix="grpojax-env"
        )
        try:
            futures = {pool.submit(run, r, fn): r for r, fn in calls.items()}
            pending = set(futures)
            while pending:
                running = [started[futures[f]] for f in pending if futures[f] in started]
                wait_s = min(running) + timeout_s - time.monotonic() if running else 0.01
                done, pending = concurrent.futures.wait(
                    pending,
                    timeout=max(wait_s, 0.0),
                    return_when=concurrent.futures.FIRST_COMPLETED,
                )
                for f in done:
                    exc = f.exception()
                    results[futures[f]] = ("ok", f.result()) if exc is None else ("error", exc)
                now = time.monotonic()
                for f in list(pending):
                    r = futures[f]
                    if r in started and now - started[r] >= timeout_s:
                        results[r] = ("timeout", None)
                        pending.discard(f)
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        return results


def _failed(status: str, value: Any) -> str:
    """How an environment call `_run_all` ran failed: "timed out" or "raised <exception>"."""
    return "timed out" if status == "timeout" else f"raised {value!r}"


def _portable(status: str, value: Any) -> Any:
    """An environment call's result as it can be sent to other processes: a Step's info as
    a plain dict; an exception that does not pickle as a RuntimeError naming it."""
    if isinstance(value, Step):
        return dataclasses.replace(value, info=dict(value.info))
    if status == "error":
        try:
            pickle.dumps(value)
        except Exception:
            return RuntimeError(f"{type(value).__name__}: {value}")
    return value


def _contents(messages: Sequence[Mapping[str, Any]]) -> str:
    """Chat messages as plain text: their contents ("" for none) joined by newlines."""
    return "\n".join(str(m.get("content") or "") for m in messages)


def _observation_text(tokenizer: Any, observation: Sequence[Any]) -> str:
    """A non-text observation as a demonstration reads it: chat messages' contents joined by
    newlines (`_contents`), ids decoded (special tokens removed)."""
    if observation and isinstance(observation[0], Mapping):
        return _contents(observation)
    return tokenizer.decode([int(i) for i in observation], skip_special_tokens=True)


def demonstration_episodes(runner: EpisodeRunner, *, stop_ids: Sequence[int]) -> list[Episode]:
    """Play every row of a fresh `runner` with its environment's scripted expert
    (`Environment.demonstration`) and return `runner.episodes`: an SFT warm start's data
    (`grpojax.envs.episode_batch` lays them out, the loss on the expert's ids only).

    Each round, every active row's `demonstration` gets the text of its last observation
    (`runner.last_observations`: None before the first turn, "" after a step without one,
    ids decoded, chat messages' contents joined by newlines). Its turn is encoded without
    special tokens, then `stop_ids[0]` (EOS) unless the text ends with one of the env's
    `stop_strings`, as a sampled turn would end; a turn longer than the row's `turn_budget`
    is cut to it (truncated: "token_budget").
    The rows' turns go to `runner.advance` together, with logprobs 0.

    Raises:
      ValueError: for empty `stop_ids`, a runner that has taken a turn, an env class that
        does not implement `demonstration`, or a demonstration that is None (or not text)
        before its episode ended; the last two name the row and the env class.
    """
    eos = [int(i) for i in stop_ids][:1]
    if not eos:
        raise ValueError("demonstration_episodes needs stop_ids (the tokenizer's EOS id first)")
    for r, env in enumerate(runner.envs):
        if type(env).demonstration is Environment.demonstration:
            raise ValueError(
                f"row {r}: {type(env).__name__} has no demonstrations (it does not implement "
                "Environment.demonstration)"
            )
    runner.prompt_ids()
    if any(e.segments or e.finished for e in runner.episodes):
        raise ValueError("demonstration_episodes needs a fresh EpisodeRunner (no turn taken yet)")
    while rows := runner.ready_rows():
        turns, texts, truncated = [], [], []
        for r in rows:
            env, ep = runner.envs[r], runner.episodes[r]
            observation = runner.last_observations[r]
            if observation is None and ep.num_turns:
                observation = ""
            elif observation is not None and not isinstance(observation, str):
                observation = _observation_text(runner.tokenizer, observation)
            text = env.demonstration(observation)
            if not isinstance(text, str):
                got = "None" if text is None else f"a {type(text).__name__}, not text"
                raise ValueError(
                    f"row {r}: {type(env).__name__}.demonstration returned {got} before the "
                    f"episode ended (turn {ep.num_turns + 1})"
                )
            ids = _encode(runner.tokenizer, text)
            if not text.endswith(tuple(env.stop_strings)):
                ids += eos
            budget = runner.turn_budget(r)
            turns.append(ids[:budget])
            texts.append(text)
            truncated.append(len(ids) > budget)
        logprobs = [[0.0] * len(ids) for ids in turns]
        runner.advance(rows, turns, logprobs, texts, truncated=truncated)
    return runner.episodes
