"""TextArena games (the real `textarena` package, 0.7.4) as environments
(`env.name=textarena:<env id>`, `grpojax.envs.arena`).

A scripted player (binary search) wins every GuessTheNumber-v0 game through the runner:
each answer is the game's own hint, rendered once after the move's ids, and the reward is
the game's (1 for a win). The tiny model (random init) plays a few games with the multi-turn
sampler: the trainer's logprobs equal the sampler's within 1e-5 on every move.

Self-play (TicTacToe-v0, both seats the policy): scripted seats play whole games through
the runner, each seat's turns its own episode, seat 1 waiting first (its prompt without the
generation prompt, seat 0's move its first message) and the game's +1/-1 its reward; the
tiny model plays games in lock step and compacted, id for id the same, with the trainer's
logprobs equal to the sampler's; a game cut short is 0 for both seats, a seat left waiting
on an ended one is "stalled". Games for three or more players and unknown ids are refused
in one line; the held-out split holds other seeds."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from env_fixtures import assert_trainer_matches_sampler, chatml_tokenizer, random_episodes
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


SELF_PLAY = "textarena:TicTacToe-v0"


def _move(tok, cell):
    return _encode(tok, f"[{cell}]")


def test_self_play_seats_take_turns_and_score_the_game():
    """Two TicTacToe games of one row (G = 2), the chat template on: rows 0-1 are seat 0 of
    games 0-1, rows 2-3 seat 1. Seat 0 takes cells 0, 1, 2 and wins on its third move; seat
    1 takes 8, 7. Only the seat to move is ready each turn; seat 1's prompt ends with its
    user message (no assistant header) and its completion opens with seat 0's move as the
    next user message; each seat's episode ends "done" with the game's reward (+1 / -1)."""
    tok = chatml_tokenizer()
    rows = environment_rows(SELF_PLAY, "train", 1, seed=0)
    envs = make_environments(resolve_environment(SELF_PLAY), rows, group_size=2)
    assert len(envs) == 4 and [e.seat for e in envs] == [0, 0, 1, 1]
    runner = EpisodeRunner(envs, tok, max_episode_tokens=4000)
    prompts = [tok.decode(p) for p in runner.prompt_ids()]
    assert all(p.endswith("<|im_start|>assistant\n") for p in prompts[:2])
    assert all(p.endswith("<|im_end|>\n") and "Player 1" in p for p in prompts[2:])
    assert runner.waiting == {2, 3} and runner.turn_budgets().tolist()[2:] == [0, 0]
    cells = {r: iter([0, 1, 2] if envs[r].seat == 0 else [8, 7]) for r in range(4)}
    turns = []
    while ready := runner.ready_rows():
        turns.append(ready)
        moves = [[*_move(tok, next(cells[r])), tok.eos_token_id] for r in ready]
        runner.advance(ready, moves, [[0.0] * len(m) for m in moves])
        for r, answer in runner.woken.items():
            assert runner.last_observations[r] in tok.decode(answer)  # what poll() gave
            if runner.episodes[r].num_turns == 0:  # seat 1's first message: seat 0's move
                text = tok.decode(answer)
                assert text.startswith("<|im_start|>user\n[Player 0] [0]\n"), text
                assert text.endswith("<|im_start|>assistant\n"), text
    assert turns == [[0, 1], [2, 3], [0, 1], [2, 3], [0, 1]]
    eps = runner.episodes
    assert [e.done_reason for e in eps] == ["done"] * 4
    assert [e.final_reward for e in eps] == [1.0, 1.0, -1.0, -1.0]
    assert [e.num_turns for e in eps] == [3, 3, 2, 2]
    assert [e.segments[0].kind for e in eps] == ["policy", "policy", "env", "env"]
    assert runner.waiting == set()


def test_the_tiny_model_plays_self_play_in_lock_step_and_compacted_alike():
    """The tiny model on both seats of 4 games (2 rows, G = 2), plain text: the lock-step
    loop and the compacting one give the same ids, the trainer's logprobs equal the
    sampler's within 1e-5, every game ends for both seats at once with rewards summing to 0
    (a win, or 0 each for a draw or a game cut short), and slots are refused."""
    tok = builtin_tokenizer()
    model = Decoder(tiny_config(num_layers=2), rngs=nnx.Rngs(0))
    rows = environment_rows(SELF_PLAY, "train", 2, seed=2)
    cls = resolve_environment(SELF_PLAY)

    def play(**engine):
        envs = make_environments(cls, rows, group_size=2, max_turns=4)
        runner = EpisodeRunner(envs, tok, max_episode_tokens=4000, chat=False)
        return random_episodes(model, runner, stop_ids=(EOS_ID, *range(40, 90)), **engine)

    lock, compact = play(), play(compact=True)
    assert [e.tokens() for e in lock] == [e.tokens() for e in compact]
    assert_trainer_matches_sampler(model, lock)
    assert max(e.num_turns for e in lock) >= 2
    by_game = np.array([e.final_reward for e in lock]).reshape(2, 2, 2)  # row, seat, game
    np.testing.assert_array_equal(by_game.sum(axis=1), 0.0)
    runner = EpisodeRunner(make_environments(cls, rows), tok, max_episode_tokens=400)
    with pytest.raises(ValueError, match="slots take no seats"):
        random_episodes(model, runner, stop_ids=(EOS_ID,), slots=2)


class _LowestCell:
    """An external engine (`rollout_episodes_external`'s protocol) that takes the lowest
    free cell the context's last board offers, then EOS; it keeps every context it saw."""

    def __init__(self, tok):
        self.tok, self.seen = tok, []

    def complete(self, contexts, *, max_tokens_n, seeds, sampling, stop_ids=()):
        self.seen.append([list(c) for c in contexts])
        text = [self.tok.decode(c) for c in contexts]
        cells = [re.findall(r"'\[(\d)\]'", t.rsplit("Available Moves:", 1)[1])[0] for t in text]
        ids = [[*_move(self.tok, c), EOS_ID] for c in cells]
        return ids, [[0.0] * len(i) for i in ids], [True] * len(ids)


def test_self_play_on_an_external_engine_sends_each_seat_its_whole_context():
    """vLLM's loop (`rollout_episodes_external`) with a scripted engine on 2 games: only the
    seat to move is asked each turn, and its context is exactly its episode's ids so far
    (the woken seat's answer included). Lowest-free-cell play: seat 0 takes 0, 2, 4, 6 and
    wins on the diagonal 2-4-6; seat 1 takes 1, 3, 5."""
    from grpojax.envs import rollout_episodes_external

    tok = builtin_tokenizer()
    rows = environment_rows(SELF_PLAY, "train", 1, seed=0)
    envs = make_environments(resolve_environment(SELF_PLAY), rows, group_size=2)
    runner = EpisodeRunner(envs, tok, max_episode_tokens=4000, chat=False)
    engine = _LowestCell(tok)
    eps = rollout_episodes_external(engine, runner, key=jax.random.key(0), max_turn_tokens=8)
    assert [len(c) for c in engine.seen] == [2] * 7  # 7 moves, each seat of both games
    seen = [c for call in engine.seen for c in call]
    assert all(any(ep.tokens()[: len(c)] == c for ep in eps) for c in seen)
    for ep in eps:  # the last context sent is the whole episode before its last move
        assert ep.tokens()[: -len(ep.segments[-1].ids)] in seen
    assert [e.final_reward for e in eps] == [1.0, 1.0, -1.0, -1.0]
    assert [e.num_turns for e in eps] == [4, 4, 3, 3]


def test_a_game_cut_short_is_zero_for_both_seats_and_a_waiting_seat_stalls():
    """Seat 0's first move runs out of its token budget: the game is cut, and seat 1
    (waiting) ends "done" in the same call; both rewards 0. Seat 0's second move raises in
    the game: its episode ends "error"; seat 1, waiting on it, ends "stalled" (reward 0)
    with the error counted."""
    tok = builtin_tokenizer()
    cls = resolve_environment(SELF_PLAY)
    rows = environment_rows(SELF_PLAY, "train", 1, seed=0)
    runner = EpisodeRunner(make_environments(cls, rows), tok, max_episode_tokens=4000, chat=False)
    move = _move(tok, 4)
    runner.advance([0], [move], [[0.0] * len(move)], truncated=[True])
    assert [e.done_reason for e in runner.episodes] == ["token_budget", "done"]
    assert [e.final_reward for e in runner.episodes] == [0.0, 0.0]

    envs = make_environments(cls, rows)
    runner = EpisodeRunner(envs, tok, max_episode_tokens=4000, chat=False)
    for row, cell in ((0, 4), (1, 0)):
        runner.advance([row], [_move(tok, cell)], [[0.0] * len(_move(tok, cell))])

    def broken(action):
        raise RuntimeError("the game broke")

    envs[0].shared.env.step = broken
    runner.advance([0], [_move(tok, 8)], [[0.0] * len(_move(tok, 8))])
    assert [e.done_reason for e in runner.episodes] == ["error", "stalled"]
    assert [e.final_reward for e in runner.episodes] == [0.0, 0.0]
    assert runner.metrics()["seat_stalls"] == 1 and not runner.active_rows()


def test_other_games_and_names_are_refused_in_one_line():
    assert resolve_environment(SELF_PLAY).seats == 2
    assert resolve_environment(GAME).seats == 1
    with pytest.raises(UserError, match=r"takes neither one player nor two"):
        resolve_environment("textarena:ThreePlayerTicTacToe-v0")
    with pytest.raises(UserError, match=r"no such TextArena env id \(close: \['GuessTheNumber"):
        resolve_environment("textarena:GuessTheNumbr-v0")
    train = {r["seed"] for r in environment_rows(GAME, "train", 50, seed=0)}
    held = {r["seed"] for r in environment_rows(GAME, "heldout", 10, seed=0)}
    assert len(train) == 50 and len(held) == 10 and not train & held
