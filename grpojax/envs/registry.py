"""Environments by config name: the built-ins, their rows, and user classes by import path.

    ENVIRONMENTS         name -> (Environment class, row generator `(n, seed) -> rows`)
    resolve_environment  "calculator" | "python" | "guess_number" | "package.module:Class" |
                         "agent:package.module:function" | "textarena:<env id>" |
                         "openenv:package.module:EnvClass" | "openenv:http://HOST:PORT" |
                         "verifiers:<taskset id>"
    row_generator        the rows of a built-in, a TextArena game or an OpenEnv env (one seed a
                         row, `seed_rows`) or a verifiers taskset (its tasks)
    environment_rows     a built-in's train or held-out rows (disjoint, by a hash of the row)

The held-out split is a function of the row's content (`is_heldout`: SHA-256 of its JSON,
one row in `HELDOUT_EVERY`), not of the seed, so no seed can put a held-out task into
training; the rows of a split are the generator's rows of that split, in order, drawn from
successive seeds derived from `seed` until there are n.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from typing import Any

from grpojax.envs import arena, openenv_env, verifiers_env
from grpojax.envs.agent import agent_environment
from grpojax.envs.base import Environment, load_environment
from grpojax.envs.builtin import (
    CalculatorEnv,
    GuessNumberEnv,
    PythonToolEnv,
    guess_number_rows,
    multiplication_rows,
)
from grpojax.errors import UserError

__all__ = [
    "ENVIRONMENTS",
    "environment_rows",
    "is_heldout",
    "resolve_environment",
    "row_generator",
]

RowGenerator = Callable[[int, int], list[dict[str, Any]]]
ENVIRONMENTS: dict[str, tuple[type[Environment], RowGenerator]] = {
    "calculator": (CalculatorEnv, multiplication_rows),
    "python": (PythonToolEnv, multiplication_rows),
    "guess_number": (GuessNumberEnv, guess_number_rows),
}
AGENT_PREFIX = "agent:"
HELDOUT_EVERY = 10
SPLITS = ("train", "heldout")
_MAX_DRAWS = 64  # generator calls per split before a split is declared (nearly) empty


def resolve_environment(name: str, *, field: str = "env.name") -> type[Environment]:
    """The Environment class of a built-in name, a "package.module:Class" path, or
    "agent:package.module:function", an OpenAI-client agent (`grpojax.envs.agent`)."""
    if name in ENVIRONMENTS:
        return ENVIRONMENTS[name][0]
    if name.startswith(AGENT_PREFIX):
        return agent_environment(name[len(AGENT_PREFIX) :])
    if name.startswith(arena.PREFIX):
        return arena.textarena_environment(name[len(arena.PREFIX) :])
    if name.startswith(openenv_env.PREFIX):
        return openenv_env.openenv_environment(name[len(openenv_env.PREFIX) :])
    if name.startswith(verifiers_env.PREFIX):
        return verifiers_env.verifiers_environment(name[len(verifiers_env.PREFIX) :])
    return load_environment(name, field=field)


def seed_rows(label: str) -> RowGenerator:
    """One reset seed a row (a TextArena game's, an OpenEnv env's): `(n, seed) -> rows`
    `{"prompt": "<label> #<s>", "seed": s}` for n successive seeds from one derived from
    `seed`."""

    def rows(n: int, seed: int) -> list[dict[str, Any]]:
        first = seed * 1_000_003 % (2**31)
        return [{"prompt": f"{label} #{first + k}", "seed": first + k} for k in range(n)]

    return rows


def row_generator(name: str) -> RowGenerator | None:
    """The row generator of environment `name` (a built-in's; one seed a row for a TextArena
    game or an OpenEnv env; a verifiers taskset's tasks), None for one that has none (its
    rows come from `data`)."""
    if name in ENVIRONMENTS:
        return ENVIRONMENTS[name][1]
    if name.startswith((arena.PREFIX, openenv_env.PREFIX)):
        return seed_rows(name.split(":", 1)[1])
    if name.startswith(verifiers_env.PREFIX):
        return verifiers_env.verifiers_rows(name[len(verifiers_env.PREFIX) :])
    return None


def is_heldout(row: Mapping[str, Any]) -> bool:
    """Whether `row` belongs to the held-out split: SHA-256 of its JSON (sorted keys, the
    `prompt` column left out) is 0 modulo `HELDOUT_EVERY`."""
    content = {k: v for k, v in row.items() if k != "prompt"}
    digest = hashlib.sha256(json.dumps(content, sort_keys=True, default=str).encode()).digest()
    return int.from_bytes(digest[:8], "big") % HELDOUT_EVERY == 0


def environment_rows(name: str, split: str, n: int, *, seed: int) -> list[dict[str, Any]]:
    """`n` rows of built-in environment `name` in `split` ("train" or "heldout").

    Rows of one split never appear in the other (`is_heldout`); the same arguments give the
    same rows. Raises UserError for an unknown name or split, or a split the generator
    (almost) never reaches.
    """
    generate = row_generator(name)
    if generate is None:
        raise UserError(
            f"data.kind='env' needs a built-in env.name {tuple(ENVIRONMENTS)} or "
            f"'{arena.PREFIX}<env id>', '{openenv_env.PREFIX}...' or "
            f"'{verifiers_env.PREFIX}<taskset id>', got {name!r}"
        )
    if split not in SPLITS:
        raise UserError(f"split must be one of {SPLITS}, got {split!r}")
    want = split == "heldout"
    rows: list[dict[str, Any]] = []
    for draw in range(_MAX_DRAWS):
        batch = generate(max(n, 64) * HELDOUT_EVERY // (1 if want else HELDOUT_EVERY - 1), seed)
        rows += [r for r in batch if is_heldout(r) == want]
        if len(rows) >= n:
            return rows[:n]
        seed = (seed * 1_000_003 + draw + 1) % (2**63)
    raise UserError(f"env {name!r}: only {len(rows)} {split} rows after {_MAX_DRAWS} draws")
