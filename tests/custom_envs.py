"""A user-defined environment, named by path in the tests ("custom_envs:ShortTurnsEnv").

Built so that a random policy plays genuinely multi-turn episodes: nearly every printable
character ends a turn, so turns are one or two ids long, and the environment answers each
with a fixed observation until `max_turns`. Deterministic given the row and the turns.
"""

import string
import zlib

from grpojax.envs import Environment, Step

OBSERVATION = "ok"


class ShortTurnsEnv(Environment):
    """Three short turns, each answered "ok". Per-turn reward 0.25 for a turn holding a
    digit (none otherwise); final reward: the share of turns holding a digit. Scripted
    expert: "7" every turn (all rewards earned)."""

    max_turns = 3
    stop_strings = tuple(string.ascii_letters + string.digits + string.punctuation)

    def __init__(self, row, **kwargs):
        super().__init__(row, **kwargs)
        self.turns: list[str] = []

    def reset(self) -> str:
        return self.row["prompt"]

    def step(self, completion: str) -> Step:
        self.turns.append(completion)
        has_digit = any(c.isdigit() for c in completion)
        return Step(observation=OBSERVATION, reward=0.25 if has_digit else None)

    def reward(self) -> float:
        return sum(any(c.isdigit() for c in t) for t in self.turns) / self.max_turns

    def demonstration(self, observation):
        return "7"


class UnevenTurnsEnv(ShortTurnsEnv):
    """`ShortTurnsEnv` whose episodes last 1, 2 or 3 turns, by the prompt (crc32 of its text
    mod 3, plus 1): a round's episodes end at different turns."""

    def __init__(self, row, **kwargs):
        super().__init__(row, **kwargs)
        self.max_turns = zlib.crc32(str(row["prompt"]).encode()) % 3 + 1


def chain_agent(client, row):
    """An agent that knows only the OpenAI client (named "agent:custom_envs:chain_agent"):
    asks the row's prompt, then answers each reply "ok" and asks again, three calls in all
    unless a reply is cut ("length"); reward: the share of replies holding a digit."""
    messages = [{"role": "user", "content": row["prompt"]}]
    digits = 0
    for _ in range(3):
        reply = client.chat.completions.create(model="policy", messages=messages)
        text = reply.choices[0].message.content or ""
        digits += any(c.isdigit() for c in text)
        if reply.choices[0].finish_reason == "length":
            break
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "ok"}]
    return digits / 3


def chain_expert(request, row):
    """`chain_agent`'s demonstrations ("custom_envs:chain_expert"): "7" to every request."""
    assert request["messages"][-1]["role"] == "user"
    return "7"
