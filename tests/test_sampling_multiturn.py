"""The multi-turn sampler (`grpojax.sampling.multiturn`) on the built-in tiny model (random
init, float32): each row's cache continued across policy turns and appended environment ids
gives the trainer's logprobs on the concatenated episode; draws keyed by the row and its
policy-token count; turns end at stop ids, stop sequences and budgets."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from grpojax.models import Decoder, tiny_config
from grpojax.sampling import SamplingConfig
from grpojax.sampling.multiturn import append, empty, sample_turn, start, take_rows
from grpojax.train.common import policy_logprobs

PAD = 0
PROMPTS = np.array([[0, 0, 5, 6, 7], [9, 10, 11, 12, 13], [0, 0, 0, 4, 3]], np.int32)
LENGTHS = np.array([3, 5, 2], np.int32)
# Per turn: each row's budget (0: sits the turn out), then the environment's answer to it.
BUDGETS = [[6, 4, 5], [3, 0, 7], [5, 6, 2]]
ANSWERS = [[[20, 21], [], [30, 31, 32, 33, 34]], [[22], [40, 41, 42], [35, 36]]]
CAPACITY = 5 + 6 + 2 + 3 + 3 + 5 + 6 + 5 + 2 + 4  # P + turns + answers, with room to spare
ATOL = 1e-5  # float32: the cache's attention sums over its slots, the trainer's over columns


@pytest.fixture(scope="module")
def model():
    return Decoder(tiny_config(num_layers=2), rngs=nnx.Rngs(0))


def _episodes(model, prompts, lengths, *, key, sampling, sample_ids=None, stop_ids=()):
    """Run the turns and answers above; per row, its segments [(kind, ids, logps)]."""
    n = len(prompts)
    state = start(model, prompts, lengths, capacity=CAPACITY)
    segments = [[] for _ in range(n)]
    for turn, budget in enumerate(BUDGETS):
        state, out = sample_turn(
            model,
            state,
            key=key,
            budget_n=np.asarray(budget[:n]),
            max_tokens=8,
            sample_ids_n=sample_ids,
            sampling=sampling,
            stop_ids=stop_ids,
            pad_id=PAD,
        )
        toks, logp, lens = (np.asarray(x) for x in (out.tokens_nt, out.logp_nt, out.lengths_n))
        for r in range(n):
            assert np.all(toks[r, lens[r] :] == PAD) and np.all(logp[r, lens[r] :] == 0)
            if lens[r]:
                segments[r].append(("policy", toks[r, : lens[r]], logp[r, : lens[r]]))
        if turn < len(ANSWERS):
            answers = ANSWERS[turn][:n]
            width = max(len(a) for a in answers)
            obs = np.full((n, width), PAD, np.int32)
            for r, a in enumerate(answers):
                obs[r, : len(a)] = a
                if a:
                    segments[r].append(("env", np.asarray(a, np.int32), None))
            state = append(model, state, obs, np.array([len(a) for a in answers], np.int32))
    return state, segments


def _trainer_view(prompts, lengths, segments):
    """The trainer's batch of the episodes: [prompt (left-padded P) | completion (right-padded
    T)], the completion the segments' ids concatenated; the loss mask on policy ids; the
    sampler's logprobs there."""
    n, p = prompts.shape
    comps = [np.concatenate([s[1] for s in segs]) for segs in segments]
    t = max(len(c) for c in comps)
    tokens = np.full((n, p + t), PAD, np.int32)
    mask = np.zeros((n, p + t), bool)
    policy = np.zeros((n, t), bool)
    sampler_logp = np.zeros((n, t), np.float32)
    tokens[:, :p] = prompts
    mask[:, :p] = np.arange(p)[None, :] >= (p - lengths)[:, None]
    for r, segs in enumerate(segments):
        col = 0
        for kind, ids, logp in segs:
            tokens[r, p + col : p + col + len(ids)] = ids
            mask[r, p + col : p + col + len(ids)] = True
            if kind == "policy":
                policy[r, col : col + len(ids)] = True
                sampler_logp[r, col : col + len(ids)] = logp
            col += len(ids)
    return tokens, mask, policy, sampler_logp


def test_sampler_logprobs_equal_the_trainers_across_turns_with_environment_ids_between(model):
    """Three policy turns with environment answers between them (one row sits a turn out,
    another gets no answer once): every policy token's sampler logprob equals the trainer's
    recompute on the concatenated episode within ATOL; the positions and cache slots end
    where the real tokens say."""
    _check_turns_against_the_trainer(model)


def test_a_sliding_window_holds_across_turns():
    """The same with a Gemma 3 of sliding (4 tokens) and full layers: the window counts the
    cache's keys by position across turns and environment ids."""
    cfg = tiny_config(
        num_layers=2,
        model_type="gemma3_text",
        hidden_act="gelu_pytorch_tanh",
        sliding_window=4,
        layer_types=("sliding_attention", "full_attention"),
        rope_local_theta=1e4,
        query_pre_attn_scalar=24,
    )
    _check_turns_against_the_trainer(Decoder(cfg, rngs=nnx.Rngs(0)))


def _check_turns_against_the_trainer(model):
    state, segments = _episodes(
        model, PROMPTS, LENGTHS, key=jax.random.key(3), sampling=SamplingConfig(temperature=1.0)
    )
    tokens, mask, policy, sampler_logp = _trainer_view(PROMPTS, LENGTHS, segments)
    logp, _ = policy_logprobs(model, jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(policy))
    logp = np.asarray(logp)
    assert policy.sum() > 20 and (mask[:, 5:] & ~policy).sum() == 13  # env ids in the context
    np.testing.assert_allclose(np.where(policy, logp, 0), sampler_logp, atol=ATOL, rtol=0)
    real = mask.sum(1)
    np.testing.assert_array_equal(np.asarray(state.pos_n), real)
    np.testing.assert_array_equal(np.asarray(state.cache.index), 5 + real - LENGTHS)
    sampled = [sum(len(s[1]) for s in segs if s[0] == "policy") for segs in segments]
    np.testing.assert_array_equal(np.asarray(state.sampled_n), sampled)
    assert [len(s) for s in segments] == [5, 3, 5]  # row 1: no answer 1, no turn 2


def test_a_rows_draws_do_not_depend_on_the_rows_beside_it(model):
    """Draws are keyed by (sample id, policy-token count): row 2 run alone with its sample id
    samples what it sampled in the batch of three."""
    sampling = SamplingConfig(temperature=1.0)
    key = jax.random.key(7)
    _, batch = _episodes(model, PROMPTS, LENGTHS, key=key, sampling=sampling)
    _, alone = _episodes(
        model, PROMPTS[2:], LENGTHS[2:], key=key, sampling=sampling, sample_ids=np.array([2])
    )
    # Budgets and answers above are given per row index, so row 2 alone gets row 0's: compare
    # turn 1 up to the shorter budget.
    m = min(BUDGETS[0][0], BUDGETS[0][2])
    np.testing.assert_array_equal(alone[0][0][1][:m], batch[2][0][1][:m])
    np.testing.assert_allclose(alone[0][0][2][:m], batch[2][0][2][:m], atol=ATOL, rtol=0)


def test_turns_end_at_stop_ids_stop_sequences_and_budgets(model):
    """A turn of 8 tokens (a fixed key: the same draws each time); the same turn with two of
    its tokens as a stop sequence ends after them (sequence included), with one as a stop id
    right after it; a budget of 3 ends it after 3 tokens, flagged as neither stop."""
    sampling = SamplingConfig(temperature=1.0)
    prompts, lengths = PROMPTS[:1], LENGTHS[:1]

    def turn(**kw):
        st = start(model, prompts, lengths, capacity=CAPACITY)
        kw.setdefault("budget_n", np.array([8]))
        _, out = sample_turn(
            model, st, key=jax.random.key(0), max_tokens=8, sampling=sampling, **kw
        )
        return out

    full = turn()
    toks = np.asarray(full.tokens_nt)[0].tolist()
    assert int(full.lengths_n[0]) == 8
    # The first pair of tokens (and the first token) not seen earlier in the turn.
    i = next(
        i for i in range(2, 8) if toks[i - 2 : i] not in [toks[j : j + 2] for j in range(i - 2)]
    )
    j = next(j for j in range(1, 8) if toks[j] not in toks[:j])
    out = turn(stop_sequences=[toks[i - 2 : i]])
    assert int(out.lengths_n[0]) == i and bool(out.stop_sequence_n[0])
    np.testing.assert_array_equal(np.asarray(out.tokens_nt)[0, :i], toks[:i])
    out = turn(stop_ids=[toks[j]])
    assert int(out.lengths_n[0]) == j + 1 and bool(out.stop_id_n[0])
    out = turn(budget_n=np.array([3]))
    assert int(out.lengths_n[0]) == 3
    assert not bool(out.stop_id_n[0]) and not bool(out.stop_sequence_n[0])


def _real_prompts(rows):
    return [PROMPTS[r, PROMPTS.shape[1] - LENGTHS[r] :].tolist() for r in rows]


def _fed(model, state, ids, *, reset):
    """`append` of the id lists `ids` (one per row, [] for none), rows `reset` emptied first."""
    width = max(max(len(x) for x in ids), 1)
    tokens = np.full((len(ids), width), PAD, np.int32)
    for r, x in enumerate(ids):
        tokens[r, : len(x)] = x
    lengths = np.array([len(x) for x in ids], np.int32)
    return append(model, state, tokens, lengths, reset_n=np.asarray(reset))


def test_a_slot_refilled_with_a_prompt_samples_as_a_fresh_start(model):
    """Slots: `empty`, then each prompt fed into an emptied slot (`reset_n`) gives the turn a
    prefilled `start` gives (ids equal, logprobs to ATOL); and a slot reused for another
    prompt after a turn of its own samples that prompt's turn as if it were new."""
    sampling = SamplingConfig(temperature=1.0)
    key = jax.random.key(3)
    kw = dict(key=key, max_tokens=8, sampling=sampling, pad_id=PAD)
    budget = np.array([8, 8, 8])
    _, ref = sample_turn(
        model, start(model, PROMPTS, LENGTHS, capacity=CAPACITY), budget_n=budget, **kw
    )
    st = _fed(model, empty(model, 3, capacity=CAPACITY), _real_prompts(range(3)), reset=[1, 1, 1])
    st, out = sample_turn(model, st, budget_n=budget, **kw)
    np.testing.assert_array_equal(np.asarray(out.tokens_nt), np.asarray(ref.tokens_nt))
    np.testing.assert_allclose(np.asarray(out.logp_nt), np.asarray(ref.logp_nt), atol=ATOL, rtol=0)
    # Slot 1 now plays row 0's prompt (sample id 0): its turn is row 0's fresh one.
    st = _fed(model, st, [[], _real_prompts([0])[0], []], reset=[0, 1, 0])
    _, again = sample_turn(
        model, st, budget_n=np.array([0, 8, 0]), sample_ids_n=np.array([0, 0, 2]), **kw
    )
    np.testing.assert_array_equal(np.asarray(again.tokens_nt)[1], np.asarray(ref.tokens_nt)[0])
    np.testing.assert_allclose(
        np.asarray(again.logp_nt)[1], np.asarray(ref.logp_nt)[0], atol=ATOL, rtol=0
    )
    with pytest.raises(ValueError, match="overruns the cache"):
        _fed(model, st, [list(range(1, CAPACITY)), [], []], reset=[0, 0, 0])


def test_until_any_returns_at_the_first_turn_end_and_a_turn_goes_on_across_calls(model):
    """`until="any"` stops after the step in which the first row ends its turn, the others
    part-way; a second call goes on with them and the two calls' ids are the one call's. A
    stop sequence split across the two calls is found when `recent_nk` carries the first
    call's last ids, and missed without them."""
    sampling = SamplingConfig(temperature=1.0)
    kw = dict(key=jax.random.key(4), max_tokens=8, sampling=sampling, pad_id=PAD)
    fresh = lambda: start(model, PROMPTS, LENGTHS, capacity=CAPACITY)
    _, whole = sample_turn(model, fresh(), budget_n=np.array([8, 2, 8]), **kw)
    st, first = sample_turn(model, fresh(), budget_n=np.array([8, 2, 8]), until="any", **kw)
    np.testing.assert_array_equal(np.asarray(first.lengths_n), [2, 2, 2])
    assert not np.asarray(first.stop_id_n | first.stop_sequence_n).any()
    _, rest = sample_turn(model, st, budget_n=np.array([6, 0, 6]), **kw)
    joined = np.concatenate([np.asarray(first.tokens_nt)[:, :2], np.asarray(rest.tokens_nt)], 1)
    np.testing.assert_array_equal(joined[[0, 2], :8], np.asarray(whole.tokens_nt)[[0, 2]])
    np.testing.assert_array_equal(joined[1, :2], np.asarray(whole.tokens_nt)[1, :2])
    # Row 0's ids 1 and 2 (0-based) as a stop sequence, the first call ending after id 1.
    toks = np.asarray(whole.tokens_nt)[0].tolist()
    pair = toks[1:3]
    st, first = sample_turn(model, fresh(), budget_n=np.array([2, 1, 1]), **kw)
    budget = np.array([6, 0, 0])
    _, on = sample_turn(
        model, st, budget_n=budget, stop_sequences=[pair], recent_nk=[[toks[1]]] * 3, **kw
    )
    assert int(on.lengths_n[0]) == 1 and bool(on.stop_sequence_n[0])
    assert int(np.asarray(on.tokens_nt)[0, 0]) == toks[2]
    _, blind = sample_turn(model, st, budget_n=budget, stop_sequences=[pair], **kw)
    assert int(blind.lengths_n[0]) > 1  # its first id alone cannot end the pair
    with pytest.raises(ValueError, match="until must be"):
        sample_turn(model, fresh(), budget_n=np.array([1, 1, 1]), until="some", **kw)


def test_taken_rows_go_on_as_they_would_have_in_the_whole_batch(model):
    """`take_rows(state, [2, 0])`: the kept rows' caches, hidden states and counters are
    theirs, and the next turn of the two (their own sample ids) samples what the three
    rows' turn samples for them; an order outside the rows is refused."""
    key = jax.random.key(4)
    state = start(model, PROMPTS, LENGTHS, capacity=CAPACITY)
    kw = dict(key=key, max_tokens=8, sampling=SamplingConfig(temperature=1.0), pad_id=PAD)
    state, _ = sample_turn(model, state, budget_n=np.array([3, 2, 4]), **kw)
    kept = take_rows(state, [2, 0])
    for whole, part in zip(jax.tree.leaves(state), jax.tree.leaves(kept)):
        axis = 1 if whole.ndim == 5 else 0  # KVCache k, v: [L, N, ...]
        np.testing.assert_array_equal(np.take(np.asarray(whole), [2, 0], axis), np.asarray(part))
    _, all_three = sample_turn(model, state, budget_n=np.array([5, 5, 5]), **kw)
    _, two = sample_turn(
        model, kept, budget_n=np.array([5, 5]), sample_ids_n=np.array([2, 0]), **kw
    )
    np.testing.assert_array_equal(
        np.asarray(two.tokens_nt), np.asarray(all_three.tokens_nt)[[2, 0]]
    )
    np.testing.assert_allclose(
        np.asarray(two.logp_nt), np.asarray(all_three.logp_nt)[[2, 0]], atol=ATOL, rtol=0
    )
    for bad in ([], [3], [-1], [[0]]):
        with pytest.raises(ValueError, match=r"^order_m must be a non-empty \[M\] of row"):
            take_rows(state, bad)


def test_bad_arguments_are_refused_with_the_field_named(model):
    st = start(model, PROMPTS, LENGTHS, capacity=12)
    with pytest.raises(ValueError, match="budget_n exceeds the cache's room"):
        sample_turn(model, st, key=jax.random.key(0), budget_n=np.array([8, 8, 8]), max_tokens=8)
    with pytest.raises(ValueError, match="budget_n must be"):
        sample_turn(model, st, key=jax.random.key(0), budget_n=np.array([1, -1, 1]), max_tokens=8)
    with pytest.raises(ValueError, match="capacity"):
        start(model, PROMPTS, LENGTHS, capacity=5)
    with pytest.raises(ValueError, match="tokens_nw must be"):
        append(model, st, np.zeros((2, 3), np.int32), np.zeros(2, np.int32))
