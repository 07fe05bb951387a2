"""TextArena's games as environments: `env.name=textarena:<env id>`, e.g.
`textarena:GuessTheNumber-v0` or, as self-play, `textarena:TicTacToe-v0`
(`pip install "grpojax[textarena]"`, textarena 0.7.4).

Each game is played from its unwrapped "-raw" variant, so its messages arrive one by one
and nothing is repeated back. Rows: `{"prompt": "<env id> #<seed>", "seed": seed}`
(`registry.seed_rows`), split into train and held-out by content as the built-ins' are; a
row's G games all start from its seed.

Single-player games: each episode is one game. `reset` starts it and gives its first
prompt; each policy turn is the move (`env.step(action=...)`), and the game's messages since
(hints, invalid-move notices) are the environment's answer, rendered once after the sampled
ids. The episode's reward is the game's own for player 0 at its end (`env.close()`), 0 for a
game cut short by the turn or token budget.

Two-player games, self-play: the policy holds every seat. Each seat's turns are an episode
of their own (`Environment.seats` = 2): a row's G games give two groups of G episodes, seat
0's and seat 1's, so each group's baseline is one seat's over the same opening (a
role-conditioned baseline, as SPIRAL's). A seat's prompt is the game's prompt for its player;
while the other seat moves it waits (`poll`), then sees what happened since its last move
(the other seat's move as "[Player k] ...", the game's messages) as one message. The
reward is the game's for that player: +1 a win, -1 a loss, 0 a draw, and 0 for both seats
of a game cut short (a seat's turn or token budget, or an error). Games for three or more
players are not taken.
"""

from __future__ import annotations

import difflib
import threading
from collections.abc import Mapping
from typing import Any

from grpojax.envs.base import Environment, Step
from grpojax.errors import UserError

__all__ = ["PREFIX", "TextArenaEnv", "textarena_environment"]

PREFIX = "textarena:"
TESTED_VERSION = "0.7.4"
# TextArena seeds Python's global `random` in a game's reset and draws from it there:
# resets run one at a time, so a seed gives the same game whatever other thread resets.
_RESETS = threading.Lock()


def _textarena():
    try:
        import textarena
    except ImportError:
        raise UserError(
            f'env.name {PREFIX}...: textarena is not installed; pip install "grpojax[textarena]" '
            f"(textarena {TESTED_VERSION})"
        ) from None
    return textarena


def _raw_id(game: str) -> str:
    """The game's unwrapped id: `game` + "-raw" where TextArena registers it."""
    from textarena.envs.registration import ENV_REGISTRY

    if game not in ENV_REGISTRY:
        near = difflib.get_close_matches(game, [k for k in ENV_REGISTRY if "-raw" not in k])
        raise UserError(f"env.name {PREFIX}{game}: no such TextArena env id (close: {near})")
    raw = f"{game}-raw"
    return raw if not game.endswith("-raw") and raw in ENV_REGISTRY else game


def _text(observation: Any, player: int) -> str:
    """A raw observation (a list of (from, message, type)) as text, the player's own moves
    (already in its ids) left out; a wrapped one (text) as it is."""
    if isinstance(observation, str):
        return observation
    lines = []
    for source, message, _ in observation:
        if source == player:
            continue
        lines.append(str(message) if source < 0 else f"[Player {source}] {message}")
    return "\n".join(lines)


class _Game:
    """One TextArena game shared by its seats' environments; every call under its lock."""

    def __init__(self, env_id: str, players: int, seed: int):
        self.env_id, self.players, self.seed = env_id, players, seed
        self.lock = threading.Lock()
        self.env: Any = None
        self.cut = False  # a seat's episode ended before the game did
        self.rewards: Mapping[int, float] | None = None

    def start(self) -> None:
        with self.lock:
            if self.env is None:
                with _RESETS:
                    self.env = _textarena().make(env_id=self.env_id)
                    self.env.reset(num_players=self.players, seed=self.seed)

    def over(self) -> bool:
        return self.cut or bool(self.env.state.done)

    def take(self, player: int) -> str:
        """What `player` has not seen yet, as text (emptied: it sees it once)."""
        pending = self.env.state.observations[player]
        self.env.state.observations[player] = []
        return _text(pending, player)

    def to_move(self) -> int:
        return int(self.env.state.current_player_id)

    def reward(self, player: int) -> float:
        """`player`'s reward; asked before the game is over (the seat's episode ended first),
        the game is cut: 0 for every seat."""
        with self.lock:
            self.cut = self.cut or not self.env.state.done
            if self.rewards is None and not self.cut:
                self.rewards = self.env.close()[0] or {}
            return 0.0 if self.cut else float((self.rewards or {}).get(player, 0.0))


class TextArenaEnv(Environment):
    """One seat of a TextArena game an episode (module docstring); `game` is the env id,
    `env_id` the one made (its "-raw" variant) and `seats` its players, 1 or 2 (all three set
    by `textarena_environment`). `table` makes a row's G games."""

    game: str = ""
    env_id: str = ""
    max_turns = 16

    def __init__(self, row: Mapping[str, Any], **kwargs: Any):
        super().__init__(row, **kwargs)
        self.shared = _Game(self.env_id, self.seats, int(row.get("seed", 0)))
        self.seat = 0

    @classmethod
    def table(cls, row: Mapping[str, Any], group_size: int, **kwargs: Any) -> list[Environment]:
        seats = [[cls(row, **kwargs) for _ in range(group_size)] for _ in range(cls.seats)]
        for g in range(group_size):  # game g: seat s plays through seat 0's `_Game`
            for s in range(cls.seats):
                seats[s][g].shared, seats[s][g].seat = seats[0][g].shared, s
        return [env for seat in seats for env in seat]

    def reset(self) -> str:
        self.shared.start()
        with self.shared.lock:
            return self.shared.take(self.seat)

    def poll(self) -> Step | None:
        with self.shared.lock:
            if self.shared.over():
                return Step(done=True)
            if self.shared.to_move() != self.seat:
                return None
            return Step(observation=self.shared.take(self.seat) or None)

    def step(self, completion: str) -> Step:
        with self.shared.lock:
            if self.shared.cut:
                return Step(done=True)
            done, _ = self.shared.env.step(action=completion)
            if done:
                return Step(done=True)
            if self.shared.to_move() != self.seat:  # the other seat's move: it waits (`poll`)
                return Step()
            return Step(observation=self.shared.take(self.seat))

    def reward(self) -> float:
        return self.shared.reward(self.seat)


def _players(ta, raw: str, game: str) -> int:
    """1 or 2: the players the game takes (TextArena checks num_players at reset)."""
    errors = []
    for players in (1, 2):
        try:
            ta.make(env_id=raw).reset(num_players=players, seed=0)
            return players
        except Exception as e:
            errors.append(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    raise UserError(
        f"env.name {PREFIX}{game}: takes neither one player nor two ({errors[-1]}); single- "
        "and two-player games only"
    )


def textarena_environment(game: str) -> type[TextArenaEnv]:
    """The `TextArenaEnv` subclass of env id `game` (checked against TextArena's registry;
    games for more than two players refused)."""
    ta = _textarena()
    raw = _raw_id(game)
    with _RESETS:
        players = _players(ta, raw, game)
    attrs = {"game": game, "env_id": raw, "seats": players}
    return type(f"TextArena_{game}", (TextArenaEnv,), attrs)
