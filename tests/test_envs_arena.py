"""TextArena games (the real `textarena` package, 0.7.4) as environments
(`env.name=textarena:<env id>`, `grpojax.envs.arena`).

A scripted player (binary search) wins every GuessTheNumber-v0 game through the runner:
each answer is the game's own hint, rendered once after the move's ids, and the reward is
the game's (1 for a win). The tiny model (random init) plays a few games with the multi-turn
sampler: the trainer's logprobs equal the sampler's within 1e-5 on every move. Multi-player
games and unknown ids are refused in one line; the held-out split holds other seeds."""

from __future__ import annotations

import re

import pytest
from env_fixtures import assert_trainer_matches_sampler, random_episodes
from flax import nnx

from grpojax.envs import (
    EpisodeRunner,
    environment_rows,
    make_environments,
    resolve_environment,
)
from grpojax.errors import UserError
from grpojax.models import Decoder, tiny_config
from grpojax.models.tokenizer import EOS_ID, builtin_tokenizer

GAME = "textarena:GuessTheNumber-v0"


def _encode(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_a_binary_search_player_wins_every_game_and_sees_the_games_hints():
    """Four games (seeds from the train split), guesses by binary search over 1..20 from the
    hints: every game ends "done" within 5 moves with the game's reward 1.0; each answer is
    exactly the game's message (a hint), rendered once; the prompt is the game's rules."""
    tok = builtin_tokenizer()
    rows = environment_rows(GAME, "train", 4, seed=0)
    envs = make_environments(resolve_environment(GAME), rows)
    runner = EpisodeRunner(envs, tok, max_episode_tokens=400, chat=False)
    prompts = runner.prompt_ids()
    assert all("Guess The Number" in tok.decode(p) for p in prompts)
    bounds = {r: [1, 20] for r in range(len(envs))}
    while rows_left := runner.active_rows():
        guesses = {r: sum(bounds[r]) // 2 for r in rows_left}
        moves = [_encode(tok, f"[{guesses[r]}]") for r in rows_left]
        answers = runner.advance(rows_left, moves, [[0.0] * len(m) for m in moves])
        for r, ids in zip(rows_left, answers):
            if ids is None:
                continue
            hint = tok.decode(ids)
            assert re.fullmatch(r"\nThe target number is (lower|higher)\.\n", hint), hint
            bounds[r][1 if "lower" in hint else 0] = guesses[r] + (-1 if "lower" in hint else 1)
    for e in runner.episodes:
        assert e.done_reason == "done" and e.final_reward == 1.0 and e.num_turns <= 5


def test_the_tiny_model_plays_games_whose_logprobs_the_trainer_reproduces():
    """Random moves of the tiny model (turns ended at any of half the vocabulary): the games
    run several moves, their rewards are the game's, and the trainer's logprobs on the rows
    equal the sampler's within 1e-5 (float32)."""
    tok = builtin_tokenizer()
    model = Decoder(tiny_config(num_layers=2), rngs=nnx.Rngs(0))
    rows = environment_rows(GAME, "train", 2, seed=1)
    envs = make_environments(resolve_environment(GAME), rows, group_size=2, max_turns=3)
    runner = EpisodeRunner(envs, tok, max_episode_tokens=160, chat=False)
    episodes = random_episodes(model, runner, stop_ids=(EOS_ID, *range(40, 90)))
    assert max(e.num_turns for e in episodes) >= 2
    assert all(0.0 <= e.final_reward <= 1.0 for e in episodes)
    assert_trainer_matches_sampler(model, episodes)


def test_other_games_and_names_are_refused_in_one_line():
    with pytest.raises(UserError, match=r"not a single-player game .*number of players"):
        resolve_environment("textarena:TicTacToe-v0")
    with pytest.raises(UserError, match=r"no such TextArena env id \(close: \['GuessTheNumber"):
        resolve_environment("textarena:GuessTheNumbr-v0")
    train = {r["seed"] for r in environment_rows(GAME, "train", 50, seed=0)}
    held = {r["seed"] for r in environment_rows(GAME, "heldout", 10, seed=0)}
    assert len(train) == 50 and len(held) == 10 and not train & held
