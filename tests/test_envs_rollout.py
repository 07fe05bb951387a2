"""Multi-turn rollouts on the built-in tiny model (random init, float32) with a scripted
environment: the trainer's logprobs on the episodes' rows equal the sampler's on every policy
id, with the environment's ids in the context and out of the loss (zero gradient); the rows
hold exactly the ids sampled and rendered, never a re-encoding of their text."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from env_fixtures import assert_trainer_matches_sampler, random_episodes
from flax import nnx

from grpojax.envs import (
    Environment,
    EpisodeRunner,
    Step,
    episode_batch,
    make_environments,
)
from grpojax.models import Decoder, tiny_config
from grpojax.models.tokenizer import EOS_ID, PAD_ID, builtin_tokenizer
from grpojax.train import GRPOBatch, GRPOConfig, grpo_loss, grpo_loss_from_logprobs
from grpojax.train.common import policy_logprobs

ATOL = 1e-5  # float32: the cache's attention sums over its slots, the trainer's over columns


class CountingEnv(Environment):
    """Answers every turn with "turn k of K" until its row's K turns are over; reward = the
    share of turns that contained a digit."""

    max_turns = 6

    def reset(self):
        self.turns, self.digits = 0, 0
        return f"Count to {self.row['k']}:"

    def step(self, completion: str) -> Step:
        self.turns += 1
        self.digits += any(c.isdigit() for c in completion)
        done = self.turns >= self.row["k"]
        return Step(
            observation=None if done else f" turn {self.turns} of {self.row['k']} ", done=done
        )

    def reward(self) -> float:
        return self.digits / self.turns


@pytest.fixture(scope="module")
def model():
    return Decoder(tiny_config(num_layers=2), rngs=nnx.Rngs(0))


# Turns end at any of half the vocabulary, so a random model's turns are a few ids long.
STOPS = (EOS_ID, *range(40, 90))


def _rollout(model, rows, *, key, env=CountingEnv, group_size=2, budgets=None, **engine):
    """(runner, episodes) of `env` on `rows` (`budgets`: the runner's, default 64 ids an
    episode) played by `random_episodes` with `key` and the `engine` arguments."""
    envs = make_environments(env, rows, group_size=group_size)
    budgets = {"max_episode_tokens": 64, **(budgets or {})}
    runner = EpisodeRunner(envs, builtin_tokenizer(), chat=False, **budgets)
    return runner, random_episodes(model, runner, stop_ids=STOPS, key=key, **engine)


def test_trainer_logprobs_equal_the_samplers_across_turns_and_env_ids_get_no_gradient(model):
    rows = [{"k": 3}, {"k": 4}, {"k": 1}]
    runner, episodes = _rollout(model, rows, key=0)
    assert [e.done_reason for e in episodes].count("done") >= 4, [e.done_reason for e in episodes]
    assert max(e.num_turns for e in episodes) >= 3 and sum(e.num_env_tokens for e in episodes) > 40
    batch = episode_batch(episodes, pad_id=PAD_ID)
    tokens, mask, policy = (jnp.asarray(x) for x in batch[:3])
    p = tokens.shape[1] - policy.shape[1]
    env_ids = np.asarray(mask[:, p:] & ~policy)
    assert env_ids.sum() == sum(e.num_env_tokens for e in episodes)

    def loss_of(logp_nt):
        adv = jnp.asarray(batch.rewards_n - batch.rewards_n.mean())
        cfg = GRPOConfig(group_size=2, beta=0.0)
        return grpo_loss_from_logprobs(
            logp_nt, jax.lax.stop_gradient(logp_nt), adv, policy, config=cfg
        )[0]

    logp, _ = policy_logprobs(model, tokens, mask, policy)
    np.testing.assert_allclose(
        np.where(policy, logp, 0.0), batch.sampler_logp_nt, atol=ATOL, rtol=0
    )
    grad = np.asarray(jax.grad(loss_of)(logp))
    assert np.all(grad[env_ids] == 0.0) and np.all(grad[~np.asarray(mask[:, p:])] == 0.0)
    assert np.count_nonzero(grad[np.asarray(policy)]) > 0
    # Every row is exactly its episode's ids: prompt (left-padded), then the segments.
    for r, e in enumerate(episodes):
        row = np.asarray(tokens[r])[np.asarray(mask[r])]
        np.testing.assert_array_equal(row, e.tokens())
    # The GRPO step's own loss on these rows (grpo_loss: its first update): the same
    # logprobs, a finite gradient.
    grpo_batch = GRPOBatch(
        tokens_ns=tokens,
        mask_ns=mask,
        completion_mask_nt=policy,
        rewards_n=jnp.asarray(batch.rewards_n),
        sampler_logp_nt=jnp.asarray(batch.sampler_logp_nt),
    )
    loss, aux = grpo_loss(model, grpo_batch, GRPOConfig(group_size=2, beta=0.0), with_grads=True)
    np.testing.assert_allclose(
        np.where(policy, aux["logp_nt"], 0.0), batch.sampler_logp_nt, atol=ATOL, rtol=0
    )
    assert np.isfinite(float(loss)) and 0 < float(aux["metrics"]["grad_norm"]) < np.inf
    # The runner's own counters agree with the episodes.
    m = runner.metrics()
    assert m["turns"] == sum(e.num_turns for e in episodes)
    assert m["env_tokens"] == sum(e.num_env_tokens for e in episodes)


def test_an_episode_is_the_same_whatever_rows_it_is_rolled_out_beside(model):
    """Draws are keyed by (row, policy-token count): the group of row {"k": 3} rolled out
    alone equals its rows in the batch of three prompts."""
    key = 5
    _, batch = _rollout(model, [{"k": 3}, {"k": 2}, {"k": 4}], key=key)
    _, alone = _rollout(model, [{"k": 3}], key=key)
    for a, b in zip(alone, batch[:2]):
        assert a.tokens() == b.tokens()
        np.testing.assert_allclose(a.sampler_logprobs(), b.sampler_logprobs(), atol=ATOL)


def _assert_plays_the_lock_step(model, lock, other):
    """`other` = (runner, episodes, stats) of another engine against the lock-step loop's
    `lock`: each episode's ids, end, segments and rewards equal, its logprobs within ATOL,
    the runners' counters equal, fewer row-steps decoded, and the trainer's logprobs equal
    the other engine's on every policy id."""
    (lock_runner, lock_eps, lock_stats), (runner, eps, stats) = lock, other
    for a, b in zip(lock_eps, eps, strict=True):
        assert a.tokens() == b.tokens() and a.done_reason == b.done_reason
        assert [s.kind for s in a.segments] == [s.kind for s in b.segments]
        assert a.final_reward == b.final_reward and a.turn_rewards == b.turn_rewards
        np.testing.assert_allclose(b.sampler_logprobs(), a.sampler_logprobs(), atol=ATOL, rtol=0)
    assert runner.metrics() == lock_runner.metrics()
    assert 0 < stats["decode_row_steps"] < lock_stats["decode_row_steps"]
    assert_trainer_matches_sampler(model, eps, atol=ATOL)


def test_slots_play_the_lock_step_loops_episodes_id_for_id_in_fewer_row_steps(model):
    """Three decode slots refilled as episodes end (episodes of 1 to 5 turns, so the lock-step
    loop keeps finished rows in every later turn): each episode's ids, rewards and end are
    the lock-step loop's, its logprobs equal to ATOL, the trainer's logprobs equal the
    slots' on every policy id, and the sampler decodes fewer row-steps."""
    rows = [{"k": 1}, {"k": 5}, {"k": 2}, {"k": 4}, {"k": 1}]
    key = 7
    lock_stats, slot_stats = {}, {}
    lock_runner, lock = _rollout(model, rows, key=key, stats=lock_stats)
    slot_runner, slot = _rollout(model, rows, key=key, slots=3, stats=slot_stats)
    assert len(slot) == 10 and max(e.num_turns for e in slot) >= 4
    _assert_plays_the_lock_step(
        model, (lock_runner, lock, lock_stats), (slot_runner, slot, slot_stats)
    )
    # One slot (every episode in turn) gives the same episodes.
    _, again = _rollout(model, rows, key=key, slots=1)
    assert [e.tokens() for e in again] == [e.tokens() for e in lock]


class WordyCountingEnv(CountingEnv):
    """`CountingEnv` with a prompt wider than its answers (a game's rules, say)."""

    def reset(self):
        return "Count slowly, one number a turn, and nothing else. " * 2 + super().reset()


def test_slots_refill_a_long_prompt_beside_an_episode_deep_in_its_cache(model):
    """Prompts (bucket 128) wider than an answer may be (`max_observation_tokens` 16): a slot
    refilled with one while the other slot is deep in its episode plays the lock-step loop's
    episodes id for id. (The refill's padding, written into every slot, once ran past the
    deep slot's cache: the cache's spare room covered answers only.)"""
    rows = [{"k": 1}, {"k": 5}, {"k": 1}, {"k": 4}]
    play = functools.partial(
        _rollout,
        model,
        rows,
        key=3,
        env=WordyCountingEnv,
        group_size=1,
        budgets={"max_observation_tokens": 16},
    )
    (runner, lock), (_, slot) = play(), play(slots=2)
    assert len(runner.episodes[0].prompt_ids) > 100
    assert max(e.num_turns for e in lock) >= 3
    assert [e.tokens() for e in slot] == [e.tokens() for e in lock]
    assert [e.final_reward for e in slot] == [e.final_reward for e in lock]


def test_compaction_plays_the_lock_step_loops_episodes_at_smaller_batch_sizes(model):
    """`compact=True` (episodes of 1 to 6 turns, 12 rows): the rows of ended episodes are
    dropped as the live ones fit a smaller batch size (12 -> 9 -> 6 -> 4 -> 3 -> 2 -> 1,
    `row_sizes`); each episode's ids, rewards, segments and end equal the lock-step loop's,
    its logprobs within ATOL; the trainer's logprobs equal the compacted sampler's; fewer
    row-steps are decoded; slots and compaction together are refused."""
    from grpojax.sampling.compact import row_sizes

    assert row_sizes(12) == (12, 9, 6, 4, 3, 2, 1)
    rows = [{"k": 1}, {"k": 6}, {"k": 2}, {"k": 1}, {"k": 3}, {"k": 1}]
    key = 11
    lock_stats, compact_stats = {}, {}
    lock_runner, lock = _rollout(model, rows, key=key, stats=lock_stats)
    runner, compacted = _rollout(model, rows, key=key, compact=True, stats=compact_stats)
    assert len(compacted) == 12 and max(e.num_turns for e in compacted) >= 5
    _assert_plays_the_lock_step(
        model, (lock_runner, lock, lock_stats), (runner, compacted, compact_stats)
    )
    with pytest.raises(ValueError, match="compact=True is the lock-step loop; pass no slots"):
        _rollout(model, rows, key=key, compact=True, slots=2)


class OneAnswerEnv(Environment):
    """Answers the first turn with "?" and ends after the second."""

    max_turns = 2

    def reset(self):
        self.seen: list[str] = []
        return "a b"

    def step(self, completion: str) -> Step:
        self.seen.append(completion)
        return Step(observation="?" if len(self.seen) == 1 else None, done=len(self.seen) == 2)

    def reward(self) -> float:
        return 1.0


def test_the_rows_hold_the_sampled_ids_where_the_text_would_re_encode_differently():
    """A BPE tokenizer that merges "a" "b" into "ab": a policy that sampled the ids of "a"
    then "b" wrote text that re-encodes to the single id of "ab". The episode and the
    trainer's row hold the two sampled ids (and their two logprobs), not the re-encoding."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "a": 2, "b": 3, "ab": 4, " ": 5, "?": 6}
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")], unk_token=None))
    bpe.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>", eos_token="<eos>")
    sampled = [2, 3, 1]  # "a", "b", <eos>
    text = tok.decode(sampled, skip_special_tokens=True)
    assert text == "ab" and tok.encode(text) == [4] != sampled[:2]

    runner = EpisodeRunner([OneAnswerEnv({})], tok, max_episode_tokens=16, chat=False)
    assert runner.prompt_ids() == [[2, 5, 3]]
    (answer,) = runner.advance([0], [sampled], [[-0.5, -0.25, -0.125]])
    assert answer == tok.encode("\n?\n") and runner.envs[0].seen == ["ab"]
    assert runner.advance([0], [[3, 2]], [[-1.0, -2.0]]) == [None]  # "ba", then done
    (episode,) = runner.episodes
    assert episode.done_reason == "done"
    batch = episode_batch(runner.episodes, prompt_width=4, pad_id=0)
    row = batch.tokens_ns[0][batch.mask_ns[0]].tolist()
    assert row == [2, 5, 3, *sampled, *answer, 3, 2]
    np.testing.assert_array_equal(
        batch.sampler_logp_nt[0][batch.completion_mask_nt[0]], [-0.5, -0.25, -0.125, -1.0, -2.0]
    )
