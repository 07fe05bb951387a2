"""The continuous-batching engine against the static one and the trainer's recompute: the same
tokens for the same key whatever the slot count, logprobs the trainer reproduces, stop ids,
budgets and truncated sampling as in the static engine, no recompilation per call."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from grpojax.models import Decoder, tiny_config
from grpojax.ops.logprobs import token_logprobs
from grpojax.sampling import SamplingConfig, generate, generate_trace_count
from grpojax.sampling.continuous import (
    auto_episode_engine,
    auto_slots,
    cache_extents,
    plan_slots,
)
from grpojax.sampling.generate import decode_plan
from grpojax.sampling.transforms import keep_mask_from_count, kept_logprobs

T_NEW = 12
PROMPTS = np.array(
    [
        [0, 0, 0, 5, 6, 7, 8],
        [9, 10, 11, 12, 13, 14, 15],
        [0, 0, 0, 0, 0, 4, 3],
        [0, 0, 21, 22, 23, 24, 25],
    ],
    np.int32,
)
LENGTHS = np.array([4, 7, 2, 5], np.int32)
G = 3
N = len(LENGTHS) * G
BUDGET = np.random.default_rng(0).integers(1, T_NEW + 1, size=N).astype(np.int32)
FIELDS = ("tokens_nt", "lengths_n", "mask_nt", "eos_found_n", "keep_count_nt")


@pytest.fixture(scope="module")
def model():
    return Decoder(tiny_config(num_layers=2), rngs=nnx.Rngs(0))


def assert_same_rollout(a, b, logp_atol=1e-5):
    """Equal tokens, lengths, masks, stops and kept-set sizes; logprobs and thresholds within
    float32 rounding (the two engines sum the attention over different cache layouts)."""
    for name in FIELDS:
        np.testing.assert_array_equal(np.asarray(getattr(a, name)), np.asarray(getattr(b, name)))
    np.testing.assert_allclose(np.asarray(a.logp_nt), np.asarray(b.logp_nt), atol=logp_atol)
    np.testing.assert_allclose(
        np.asarray(a.keep_threshold_nt), np.asarray(b.keep_threshold_nt), atol=1e-4
    )
    np.testing.assert_array_equal(jax.random.key_data(a.key), jax.random.key_data(b.key))


SAMPLINGS = [
    SamplingConfig(temperature=1.0),
    SamplingConfig(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02),
    SamplingConfig(temperature=0.0),
]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["t1", "truncated", "greedy"])
@pytest.mark.parametrize("eos", [(), (3, 7, 11)], ids=["no-eos", "eos"])
def test_equals_static_engine_for_every_slot_count(model, sampling, eos):
    kw = dict(
        key=jax.random.key(1), max_new_tokens=T_NEW, group_size=G, sampling=sampling,
        eos_ids=eos, token_budget_n=BUDGET,
    )  # fmt: skip
    static = generate(model, PROMPTS, LENGTHS, **kw)
    lengths = np.asarray(static.lengths_n)
    assert (lengths <= BUDGET).all() and (lengths[~np.asarray(static.eos_found_n)] == BUDGET[
        ~np.asarray(static.eos_found_n)]).all()  # fmt: skip
    if eos and sampling.temperature > 0:
        assert np.asarray(static.eos_found_n).any()  # the stop ids are exercised
    for slots in (1, 2, 5, N):
        cont = generate(model, PROMPTS, LENGTHS, engine="continuous", slots=slots, **kw)
        assert_same_rollout(static, cont)
        # Every slot-step of a live sample produces one of its tokens: the loop ran
        # sum(lengths) slot-steps of real work, and at most slots - 1 idle ones a step.
        assert int(cont.row_steps) == int(cont.decode_steps) * slots
        assert int(cont.decode_steps) >= -(-int(lengths.sum()) // slots)


def test_continuous_logprobs_equal_trainer_recompute(model):
    """Sampler logprobs (plain and truncated) equal the trainer's full-forward recompute."""
    for sampling in SAMPLINGS[:2]:
        r = generate(
            model, PROMPTS, LENGTHS, key=jax.random.key(2), max_new_tokens=T_NEW,
            group_size=G, sampling=sampling, eos_ids=(3,), engine="continuous", slots=4,
        )  # fmt: skip
        diff = trainer_logp_diff(model, r, sampling)
        print(f"max |continuous sampler logp - trainer logp| = {diff:.3e}")
        assert diff <= 1e-5


def trainer_logp_diff(model, r, sampling: SamplingConfig) -> float:
    """max |sampler logp - the trainer's full-forward recompute| over the rollout `r`'s real
    completion tokens (the keep-sampling mask rebuilt from the kept-set sizes when
    `sampling` truncates)."""
    tokens, mask, _ = r.sequences()
    p = r.prompt_tokens_bp.shape[1]
    hidden, _ = model(tokens, mask_nt=mask)
    logits = model.logits(hidden)[:, p - 1 : -1]
    if sampling.truncates:
        keep = keep_mask_from_count(logits, r.keep_count_nt)
        trainer = kept_logprobs(logits, r.tokens_nt, keep, temperature=sampling.temperature)
    else:
        trainer = token_logprobs(logits, r.tokens_nt)
    return float(np.abs(np.asarray(trainer - r.logp_nt))[np.asarray(r.mask_nt)].max())


def test_bf16_continuous_matches_static_within_bf16_rounding():
    """bf16 compute: the engines' logprobs of the tokens they share agree within the bound
    the static engine's tests hold bf16 decode to against its own full forward."""
    model = Decoder(tiny_config(num_layers=2, dtype="bfloat16"), rngs=nnx.Rngs(0))
    kw = dict(key=jax.random.key(3), max_new_tokens=T_NEW, group_size=G, eos_ids=(3,))
    static = generate(model, PROMPTS, LENGTHS, **kw)
    cont = generate(model, PROMPTS, LENGTHS, engine="continuous", slots=3, **kw)
    tokens, mask, _ = cont.sequences()
    p = cont.prompt_tokens_bp.shape[1]
    hidden, _ = model(tokens, mask_nt=mask)
    trainer = token_logprobs(model.logits(hidden)[:, p - 1 : -1], cont.tokens_nt)
    m = np.asarray(cont.mask_nt)
    diff = np.abs(np.asarray(trainer - cont.logp_nt))[m]
    print(f"bf16: max |continuous logp - trainer logp| = {diff.max():.3e}")
    assert diff.max() <= 0.05
    # Rows whose tokens agree up to their end agree in logprob to bf16 rounding.
    same = (np.asarray(static.tokens_nt) == np.asarray(cont.tokens_nt)).all(axis=1)
    assert same.any()
    d = np.abs(np.asarray(static.logp_nt) - np.asarray(cont.logp_nt))[same]
    assert d.max() <= 0.05


def test_deterministic_and_invariant_to_prompt_padding(model):
    kw = dict(key=jax.random.key(4), max_new_tokens=T_NEW, group_size=G, eos_ids=(3,),
              engine="continuous", slots=5)  # fmt: skip
    a = generate(model, PROMPTS, LENGTHS, **kw)
    b = generate(model, PROMPTS, LENGTHS, **kw)
    assert_same_rollout(a, b, logp_atol=0)
    wide = np.concatenate([np.full((len(LENGTHS), 13), 77, np.int32), PROMPTS], axis=1)
    c = generate(model, wide, LENGTHS, min_bucket_width=32, **kw)
    assert c.prompt_tokens_bp.shape[1] == 32
    assert_same_rollout(a, c)


def test_one_program_per_bucket_and_slot_count(model):
    kw = dict(key=jax.random.key(5), max_new_tokens=T_NEW, group_size=G,
              engine="continuous", slots=4)  # fmt: skip
    generate(model, PROMPTS, LENGTHS, **kw)
    before = generate_trace_count()
    rng = np.random.default_rng(0)
    for longest in (8, 5, 3):
        lens = np.array([longest, 1, max(1, longest - 2), 2], np.int32)
        budget = rng.integers(1, T_NEW + 1, size=N)
        generate(model, rng.integers(1, 50, size=(4, 8)), lens, token_budget_n=budget, **kw)
    assert generate_trace_count() == before


def test_single_token_prompts_and_budgets_of_one(model):
    prompts = np.array([[0, 0, 9], [0, 0, 4]], np.int32)
    lengths = np.array([1, 1], np.int32)
    kw = dict(key=jax.random.key(6), max_new_tokens=1, group_size=2)
    static = generate(model, prompts, lengths, bucket=1, **kw)
    cont = generate(model, prompts, lengths, bucket=1, engine="continuous", slots=3, **kw)
    assert cont.prompt_tokens_bp.shape[1] == 1
    assert_same_rollout(static, cont)
    np.testing.assert_array_equal(np.asarray(cont.lengths_n), 1)


def test_slot_plan_and_cache_extents():
    assert auto_slots(64, "cpu") == 8 and auto_slots(3, "cpu") == 1
    assert auto_slots(64, "gpu") == 32 and auto_slots(3, "gpu") == 2
    assert plan_slots(24, 8, None, None) == (auto_slots(24), 1)  # this backend's count
    assert (
        auto_episode_engine(512, "cpu") == "continuous"
        and auto_episode_engine(64, "cpu") == "static"
    )
    assert auto_episode_engine(512, "gpu") == "static"
    assert plan_slots(24, 8, 100, None) == (24, 1)  # capped at N
    mesh = jax.make_mesh((1, 1, 1), ("data", "fsdp", "tensor"))
    assert plan_slots(24, 8, 5, mesh) == (5, 1)
    # T 512, P 32: the static engine's extents shifted by the prompt, the last the whole cache.
    assert cache_extents(32, 512, decode_plan(512, 4)) == (160, 288, 416, 543)
    assert cache_extents(8, 12, decode_plan(12, 4)) == (19,)
    assert cache_extents(8, 17, decode_plan(17, 4)) == (24,)  # the plan's last extent is 16
    assert cache_extents(1, 1, decode_plan(1, 4)) == (1,)


def test_bad_arguments_are_named(model):
    kw = dict(key=jax.random.key(0), max_new_tokens=4, group_size=2)
    with pytest.raises(ValueError, match="engine must be one of"):
        generate(model, PROMPTS, LENGTHS, engine="paged", **kw)
    with pytest.raises(ValueError, match="slots must be a positive int"):
        generate(model, PROMPTS, LENGTHS, engine="continuous", slots=0, **kw)
    with pytest.raises(ValueError, match=r"token_budget_n must be \[8\] ints in \[1, 4\]"):
        generate(model, PROMPTS, LENGTHS, token_budget_n=np.full(8, 5), **kw)
    with pytest.raises(ValueError, match="token_budget_n"):
        generate(model, PROMPTS, LENGTHS, token_budget_n=np.full(3, 2), **kw)
