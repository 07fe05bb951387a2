"""The environment protocol: one object per episode, text in and text (or ids) out.

An episode alternates policy turns and environment answers. The environment sees only text:
`reset()` gives the first prompt, `step(completion)` receives each decoded policy turn and
answers with a `Step`, `reward()` scores the finished episode once. Tokens are the runner's
business (`grpojax.envs.episode`): it renders the prompt and every observation through the
tokenizer (its chat template when it has one) exactly once, and the sampler and the trainer
only ever see those ids.

    from grpojax.envs import Environment, Step

    class Countdown(Environment):
        '''Say the numbers from `start` down to 1, one per turn.'''

        max_turns = 10

        def __init__(self, row, **kwargs):
            super().__init__(row, **kwargs)
            self.expected = int(row["start"])
            self.correct = 0

        def reset(self):
            return f"Count down from {self.expected}, one number per turn."

        def step(self, completion):
            ok = completion.strip() == str(self.expected)
            self.correct += ok
            self.expected -= 1
            if not ok or self.expected == 0:
                return Step(observation=None, done=True, info={"mistakes": int(not ok)})
            return Step(observation="next", reward=0.1)

        def reward(self):
            return float(self.expected == 0)

A runner (`EpisodeRunner`) builds one instance per episode from its data row, calls `reset`,
then `step` after every policy turn until a step says `done` or a budget ends the episode,
then `reward` once. `step` may block (a tool call, a sandboxed program): the runner calls the
steps of all rows concurrently, each with a wall-clock timeout. Environments are named in a
config as "package.module:Class" (`load_environment`).
"""

from __future__ import annotations

import abc
import dataclasses
import types
from collections.abc import Mapping, Sequence
from typing import Any

from grpojax.errors import UserError
from grpojax.user_code import import_object, is_import_path

__all__ = ["Environment", "RawText", "Step", "load_environment"]


class RawText(str):
    """Text the model sees exactly as written, as a prompt or an observation: no chat
    template and no plain-text framing around it (an OpenAI `/v1/completions` prompt, and
    what an agent appends to it; `grpojax.envs.agent`). A prompt is encoded with the
    tokenizer's special tokens (its BOS where it adds one), an observation without."""

    __slots__ = ()


Prompt = str | list[dict[str, Any]]


@dataclasses.dataclass(frozen=True)
class Step:
    """The environment's answer to one policy turn.

    observation: what the policy sees next. Text is rendered by the runner (as a chat message
      of the environment's `observation_role` where the tokenizer has a chat template, else
      in a plain format) and tokenised once; `RawText` is tokenised as it is; a list of chat
      messages is rendered as those messages, each of its own role; a sequence of ints is
      used as token ids exactly as given; None: nothing to add (with `done`, the usual case).
    reward: this turn's reward, or None for none. It belongs to the policy turn just taken
      (`Episode.turn_rewards`, placed on that turn's last token by `Episode.token_rewards`).
    done: the episode is over; the observation, if any, is dropped.
    info: int counters for this turn (e.g. {"tool_calls": 1, "tool_errors": 1}); the runner
      sums them per episode and over the batch. Other values are ignored.
    """

    observation: str | Sequence[int] | Sequence[Mapping[str, Any]] | None = None
    reward: float | None = None
    done: bool = False
    info: Mapping[str, Any] = dataclasses.field(default_factory=lambda: types.MappingProxyType({}))


def _check_budget(name: str, value: Any, *, none_ok: bool) -> None:
    if value is None and none_ok:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        allowed = "None or an int >= 1" if none_ok else "an int >= 1"
        raise UserError(f"env {name} must be {allowed}, got {value!r}")


class Environment(abc.ABC):
    """One episode of a task, built from the episode's data row.

    Budgets (class attributes; each may be overridden per instance by the keyword of the same
    name):
      max_turns: policy turns at most; the episode ends ("max_turns") after that many turns
        unless a step ended it first.
      stop_strings: strings that end a policy turn besides EOS (e.g. ("</tool_call>",)); the
        sampler ends a turn right after the first token that completes one, so the turn holds
        the string. The runner turns them into token-id sequences for the sampler.
      max_turn_tokens: the most tokens one policy turn may sample (None: only the episode's
        token budget bounds it); a turn cut by it ends the episode ("token_budget").
      observation_role: the chat role observations are rendered as ("user" or "tool", or any
        role the tokenizer's chat template knows).
      seats: the players of one game (1: a task of its own). With more, `table` builds the
        seats over shared games and `poll` says when a seat is to move (self-play).

    Subclasses implement `reset`, `step` and `reward`, and keep whatever state they need on
    the instance (it lives for one episode). `tool_schemas` lists the tools the prompt should
    offer (`grpojax.envs.tools.ToolEnvironment` fills it).
    """

    max_turns: int = 8
    seats: int = 1
    stop_strings: tuple[str, ...] = ()
    max_turn_tokens: int | None = None
    observation_role: str = "user"

    def __init__(
        self,
        row: Mapping[str, Any],
        *,
        max_turns: int | None = None,
        stop_strings: Sequence[str] | None = None,
        max_turn_tokens: int | None = None,
    ):
        if not isinstance(row, Mapping):
            raise UserError(
                f"env row must be a mapping of column -> value, got {type(row).__name__}"
            )
        self.row = row
        if max_turns is not None:
            self.max_turns = max_turns
        if stop_strings is not None:
            if isinstance(stop_strings, str) or not all(
                isinstance(s, str) and s for s in stop_strings
            ):
                raise UserError(
                    f"env stop_strings must be a sequence of non-empty strings, got "
                    f"{stop_strings!r}"
                )
            self.stop_strings = tuple(stop_strings)
        if max_turn_tokens is not None:
            self.max_turn_tokens = max_turn_tokens
        _check_budget("max_turns", self.max_turns, none_ok=False)
        _check_budget("max_turn_tokens", self.max_turn_tokens, none_ok=True)

    @abc.abstractmethod
    def reset(self) -> Prompt:
        """The first prompt: plain text, chat messages [{"role": ..., "content": ...}], or
        `RawText` (encoded as written)."""

    @abc.abstractmethod
    def step(self, completion: str) -> Step:
        """Answer the policy's decoded turn (`completion`, special tokens removed)."""

    @abc.abstractmethod
    def reward(self) -> float:
        """The episode's final (sequence) reward; called once, after the episode ended."""

    def tool_schemas(self) -> list[dict[str, Any]]:
        """JSON schemas of the tools the prompt offers (the chat template's `tools=`)."""
        return []

    @classmethod
    def table(cls, row: Mapping[str, Any], group_size: int, **kwargs: Any) -> list[Environment]:
        """The `seats * group_size` episodes of `row`, seat-major: index s*G + g is seat s of
        game g. One seat (the default): G independent instances `cls(row, **kwargs)`. A game
        of several seats (`seats` > 1, e.g. TextArena self-play) makes G shared games and one
        instance per seat of each; the runner keeps each seat's turns its own episode."""
        if cls.seats != 1:
            raise NotImplementedError(f"{cls.__name__}: {cls.seats} seats; it must override table")
        return [cls(row, **kwargs) for _ in range(group_size)]

    def poll(self) -> Step | None:
        """A seat of a shared game (`seats` > 1), asked before each of its turns: None while
        another seat is to move (the row samples nothing and waits); else a Step: done when
        the game ended on another seat's move, or the observation of what happened since this
        seat's last turn (None: nothing). The runner asks it after `reset` (a seat that waits
        first gets its prompt without the generation prompt, and what it then sees as a
        message after it) and after every `step` that gave no observation. One seat (the
        default): never asked."""
        return Step()

    def turn_truncated(self, completion: str) -> None:
        """The policy's last turn (`completion`) ran out of its token budget: the episode is
        over ("token_budget") and `step` is not called for it; `reward` follows. Nothing by
        default (an agent's endpoint answers its waiting request here)."""
        return None

    def demonstration(self, observation: str | None) -> str | None:
        """The next policy turn an expert would write (the SFT warm start's data,
        `grpojax.envs.demonstration_episodes`), or None for no demonstration (the default).

        Called on a fresh instance after `reset()` with None, then after each `step` with
        that step's observation text ("" for none), so an implementation may keep state
        between calls. A turn that ends at one of `stop_strings` ends there (as a sampled one
        would); any other ends with EOS, added by the caller.
        """
        return None


ENV_CONTRACT = "an Environment subclass, named as 'package.module:Class'"


def load_environment(path: str, *, field: str = "env") -> type[Environment]:
    """The `Environment` subclass `path` ("package.module:Class") names, imported.

    The import and the walk down a dotted attribute are `grpojax.user_code.import_object`'s,
    shared with the reward functions and the GRPO objectives, so the module must be on
    `sys.path`.

    Raises:
      UserError: one line naming `field`, for a path of another form, a module that does not
        import, a missing attribute, or an object that is not an Environment subclass.
    """
    if not is_import_path(path):
        raise UserError(f"{field}: {path!r} must be {ENV_CONTRACT}")
    obj = import_object(field, path)
    if not (isinstance(obj, type) and issubclass(obj, Environment)):
        what = f"the class {obj.__name__}" if isinstance(obj, type) else f"a {type(obj).__name__}"
        raise UserError(f"{field}: {path!r} is {what}, not {ENV_CONTRACT}")
    if getattr(obj, "__abstractmethods__", None):
        missing = ", ".join(sorted(obj.__abstractmethods__))
        raise UserError(f"{field}: {path!r} does not implement {missing}; needs {ENV_CONTRACT}")
    return obj
