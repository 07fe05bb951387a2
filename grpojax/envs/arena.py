"""TextArena's games as environments: `env.name=textarena:<env id>`, e.g.
`textarena:GuessTheNumber-v0` (`pip install "grpojax[textarena]"`, textarena 0.7.4).

Each episode is one game of the single-player env id (its unwrapped "-raw" variant, so the
game's messages arrive one by one and nothing is repeated back): `reset` starts the game
with the row's `seed` and gives its first prompt; each policy turn is the move
(`env.step(action=...)`), and the game's messages since (hints, invalid-move notices, the
other seats' moves) are the environment's answer, rendered once after the sampled ids; the
game's own reward for player 0 at its end (`env.close()`) is the episode's reward, 0 for a
game cut short by the turn or token budget. Rows: `{"prompt": "<env id> #<seed>", "seed":
seed}` (`registry.seed_rows`), split into train and held-out by content as the built-ins' are.

Multi-player games are not taken: one episode is one policy's sequence, and self-play (the
policy on every seat, each seat's turns its own sequence) is not built yet.
"""

from __future__ import annotations

import difflib
from typing import Any

from grpojax.envs.base import Environment, Step
from grpojax.errors import UserError

__all__ = ["PREFIX", "TextArenaEnv", "textarena_environment"]

PREFIX = "textarena:"
TESTED_VERSION = "0.7.4"


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


class TextArenaEnv(Environment):
    """One single-player TextArena game an episode (module docstring); `game` is the env id
    and `env_id` the one made, its "-raw" variant (both set by `textarena_environment`)."""

    game: str = ""
    env_id: str = ""
    max_turns = 16

    def reset(self) -> str:
        ta = _textarena()
        self.env = ta.make(env_id=self.env_id)
        self.env.reset(num_players=1, seed=int(self.row.get("seed", 0)))
        self.player, observation = self.env.get_observation()
        return _text(observation, self.player)

    def step(self, completion: str) -> Step:
        done, _ = self.env.step(action=completion)
        if done:
            return Step(done=True)
        self.player, observation = self.env.get_observation()
        return Step(observation=_text(observation, self.player))

    def reward(self) -> float:
        rewards, _ = self.env.close()
        return float(rewards.get(0, 0.0)) if rewards else 0.0


def textarena_environment(game: str) -> type[TextArenaEnv]:
    """The `TextArenaEnv` subclass of env id `game` (checked against TextArena's registry;
    multi-player games refused)."""
    ta = _textarena()
    raw = _raw_id(game)
    try:  # a game for more players refuses one (TextArena checks num_players at reset)
        ta.make(env_id=raw).reset(num_players=1, seed=0)
    except Exception as e:
        raise UserError(
            f"env.name {PREFIX}{game}: not a single-player game ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}); single-player games only"
        ) from None
    return type(f"TextArena_{game}", (TextArenaEnv,), {"game": game, "env_id": raw})
