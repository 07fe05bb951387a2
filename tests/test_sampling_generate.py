"""The jitted sampler on the built-in tiny model (random init): cache decode vs full forwards,
sampler logprobs vs the trainer's recompute, padding invariance, EOS, determinism, compiles."""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from grpojax.models import Decoder, tiny_config
from grpojax.ops.logprobs import token_logprobs
from grpojax.sampling import SamplingConfig, generate, generate_trace_count
from grpojax.sampling.transforms import keep_mask_from_count, kept_logprobs

T_NEW = 8
PROMPTS = np.array(
    [
        [0, 0, 0, 5, 6, 7, 8],
        [9, 10, 11, 12, 13, 14, 15],
        [0, 0, 0, 0, 0, 4, 3],
    ],
    np.int32,
)
LENGTHS = np.array([4, 7, 2], np.int32)
PAD = 0
gen_module = importlib.import_module("grpojax.sampling.generate")  # not the function


@pytest.fixture(scope="module")
def model():
    return Decoder(tiny_config(num_layers=2), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def full_logits(model):
    """Full forward without a cache over prompt + completion: `[N, P + T, V]` f32."""

    @jax.jit
    def fwd(state, tokens, mask):
        m = nnx.merge(nnx.graphdef(model), state)
        hidden, _ = m(tokens, mask_nt=mask)
        return m.logits(hidden)

    return lambda tokens, mask: fwd(nnx.state(model), tokens, mask)


def argmax_decode_reference(full_logits, prompts, lengths, g, t_new):
    """Greedy decoding by repeated full forwards (no cache) on a fixed-width buffer.

    Row = left-padded prompt then the tokens so far; columns not yet generated are masked and,
    being to the right, cannot influence earlier positions through causal attention.
    """
    p = prompts.shape[1]
    toks = np.repeat(prompts, g, axis=0)
    lens = np.repeat(lengths, g)
    buf = np.concatenate([toks, np.zeros((len(toks), t_new), np.int32)], axis=1)
    pmask = np.arange(p)[None, :] >= (p - lens)[:, None]
    for t in range(t_new):
        mask = np.concatenate(
            [pmask, np.broadcast_to(np.arange(t_new) < t, (len(toks), t_new))], axis=1
        )
        logits = np.asarray(full_logits(jnp.asarray(buf), jnp.asarray(mask)))
        buf[:, p + t] = logits[:, p + t - 1].argmax(-1)
    return buf[:, p:]


def test_greedy_equals_argmax_of_full_forwards(model, full_logits):
    r = generate(
        model,
        PROMPTS,
        LENGTHS,
        key=jax.random.key(0),
        max_new_tokens=T_NEW,
        group_size=2,
        sampling=SamplingConfig(temperature=0.0),
        pad_id=PAD,
    )
    p = r.prompt_tokens_bp.shape[1]
    assert p == 8  # the library's prompt-width rule: multiples of 8, at least 8
    ref = argmax_decode_reference(full_logits, np.asarray(r.prompt_tokens_bp), LENGTHS, 2, T_NEW)
    np.testing.assert_array_equal(np.asarray(r.tokens_nt), ref)
    np.testing.assert_array_equal(np.asarray(r.lengths_n), T_NEW)
    assert not np.asarray(r.eos_found_n).any()


def test_sampler_logprobs_equal_trainer_recompute(model, full_logits):
    r = generate(
        model,
        PROMPTS,
        LENGTHS,
        key=jax.random.key(1),
        max_new_tokens=T_NEW,
        group_size=3,
        sampling=SamplingConfig(temperature=1.0),
    )
    tokens, mask, _ = r.sequences()
    p = r.prompt_tokens_bp.shape[1]
    logits = full_logits(tokens, mask)
    # Column p + t - 1 predicts completion token t.
    trainer = token_logprobs(logits[:, p - 1 : -1], r.tokens_nt)
    diff = np.abs(np.asarray(trainer - r.logp_nt))[np.asarray(r.mask_nt)]
    print(f"max |sampler logp - trainer logp| = {diff.max():.3e}")
    assert diff.max() <= 1e-5


def test_truncated_logprobs_and_keep_mask_rebuild_on_trainer_logits(model, full_logits):
    cfg = SamplingConfig(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02)
    r = generate(
        model, PROMPTS, LENGTHS, key=jax.random.key(2), max_new_tokens=T_NEW, group_size=2,
        sampling=cfg,
    )  # fmt: skip
    tokens, mask, _ = r.sequences()
    p = r.prompt_tokens_bp.shape[1]
    logits = full_logits(tokens, mask)[:, p - 1 : -1]
    keep = keep_mask_from_count(logits, r.keep_count_nt)
    m = np.asarray(r.mask_nt)
    assert (np.asarray(r.keep_count_nt)[m] < logits.shape[-1]).all()
    assert np.asarray(jnp.take_along_axis(keep, r.tokens_nt[..., None], -1))[m].all()
    lp = kept_logprobs(logits, r.tokens_nt, keep, temperature=cfg.temperature)
    diff = np.abs(np.asarray(lp - r.logp_nt))[m]
    print(f"max |truncated sampler logp - trainer kept-set logp| = {diff.max():.3e}")
    assert diff.max() <= 1e-5


def test_prompt_padding_and_bucket_width_do_not_change_outputs(model):
    cfg = SamplingConfig(temperature=1.0, top_p=0.95)
    kw = dict(key=jax.random.key(3), max_new_tokens=T_NEW, group_size=2, sampling=cfg)
    a = generate(model, PROMPTS, LENGTHS, **kw)
    wide = np.concatenate([np.full((3, 13), 77, np.int32), PROMPTS], axis=1)  # junk left pad
    b = generate(model, wide, LENGTHS, min_bucket_width=32, **kw)
    assert a.prompt_tokens_bp.shape[1] == 8 and b.prompt_tokens_bp.shape[1] == 32
    np.testing.assert_array_equal(np.asarray(a.tokens_nt), np.asarray(b.tokens_nt))
    np.testing.assert_array_equal(np.asarray(a.lengths_n), np.asarray(b.lengths_n))
    np.testing.assert_allclose(np.asarray(a.logp_nt), np.asarray(b.logp_nt), atol=1e-5)
    # The junk in the padding never reaches the returned prompt either.
    bp = np.asarray(b.prompt_tokens_bp)
    assert (bp[:, :-7] == 0).all() and (bp[:, -7:][PROMPTS == 0] == 0).all()


def test_shared_prefill_equals_per_sample_prefill(model):
    kw = dict(key=jax.random.key(4), max_new_tokens=T_NEW, group_size=3)
    a = generate(model, PROMPTS, LENGTHS, shared_prefill=True, **kw)
    b = generate(model, PROMPTS, LENGTHS, shared_prefill=False, **kw)
    np.testing.assert_array_equal(np.asarray(a.tokens_nt), np.asarray(b.tokens_nt))
    np.testing.assert_allclose(np.asarray(a.logp_nt), np.asarray(b.logp_nt), atol=1e-5)


@pytest.mark.parametrize("shared_prefill", [True, False])
def test_decode_loops_read_less_and_sample_the_same(model, monkeypatch, shared_prefill):
    """`decode_loops`: loop i reads only the completion slots its steps can have filled. With
    chunks of at least 2 steps, T = 8 decodes in three loops, steps 1-3, 4-6 and 7, reading
    2, 5 and 6 slots (the program holds three loops and slices of those widths): the same
    tokens, lengths and steps as one loop over the whole cache, logprobs within float32
    rounding. With stops that end every row at step 4, in the second loop, the third runs no
    step and the results still agree."""
    plan = gen_module.decode_plan  # defaults: chunks of about 128 steps or more, extents of 8
    assert plan(512, 4) == ((128, 129), (256, 257), (384, 385), (512, 512))
    assert plan(192, 4) == ((192, 192),) and plan(32, 4) == ((32, 32),)
    monkeypatch.setattr(gen_module, "DECODE_CHUNK_MIN", 2)
    monkeypatch.setattr(gen_module, "DECODE_EXTENT_MULTIPLE", 1)
    assert plan(8, 3) == ((2, 4), (5, 7), (6, 8))
    assert plan(8, 1) == ((6, 8),)
    # Never more loops than chunks of DECODE_CHUNK_MIN steps (7 steps: 4 loops).
    assert plan(8, 9) == ((1, 3), (3, 5), (5, 7), (6, 8))
    assert plan(1, 3) == ()
    kw = dict(key=jax.random.key(9), max_new_tokens=T_NEW, group_size=2)
    kw["shared_prefill"] = shared_prefill

    def both(**extra):
        one = generate(model, PROMPTS, LENGTHS, decode_loops=1, **kw, **extra)
        three = generate(model, PROMPTS, LENGTHS, decode_loops=3, **kw, **extra)
        for name in ("tokens_nt", "lengths_n", "eos_found_n", "decode_steps"):
            np.testing.assert_array_equal(
                np.asarray(getattr(three, name)), np.asarray(getattr(one, name))
            )
        # Two programs whose attention reads 2, 5 and 6 slots against 8 (the extra ones
        # masked): the same sums, possibly reduced in other orders. |logp| ~ 5, an ulp 4.8e-7:
        # 1e-5 as this file's other sampler comparisons (bit-equal on this CPU); a slot
        # left unread moves the hidden states by ~1 (test_sampling_compact's decode step).
        np.testing.assert_allclose(np.asarray(three.logp_nt), np.asarray(one.logp_nt), atol=1e-5)
        return one

    free = both()
    assert int(free.decode_steps) == T_NEW
    toks = np.asarray(free.tokens_nt)
    stops = sorted(set(toks[:, 4].tolist()))  # every row ends by step 4, in loop 2
    ends = [np.flatnonzero(np.isin(row, stops))[0] for row in toks]
    ended = both(stop_ids=stops)
    assert max(ends) == 4 and int(ended.decode_steps) == 5

    text = generate(model, PROMPTS, LENGTHS, decode_loops=3, lower=True, **kw).as_text()
    base = 0 if shared_prefill else 8  # the prompt's slots, in the row cache without a prefix
    c, n = model.config, 3 * 2
    for extent in (2, 5, 6):
        assert f"sizes = [1, {n}, {c.num_kv_heads}, {c.head_dim}, {base + extent}]" in text
    assert text.count("stablehlo.while") >= 3


def test_prompt_cache_is_kept_once_per_group(model):
    """`lower=True` returns the program `generate` would run, not run. With the shared
    prefill its buffers hold each prompt's KV cache once: from G = 2 to G = 8 samples of
    128-token prompts and 4 new tokens they grow by less than a quarter of the 6 more
    copies of the prompts' cache that a cache per row holds (with the prompt repeated into
    each row's cache, as before the prefix cache, they grew by 0.59 of it)."""
    c = model.config
    prompts = np.tile(np.arange(1, 129, dtype=np.int32) % c.vocab_size, (2, 1))
    lengths = np.full((2,), 128, np.int32)

    def temp_bytes(g):
        lowered = generate(
            model,
            prompts,
            lengths,
            key=jax.random.key(0),
            max_new_tokens=4,
            group_size=g,
            lower=True,
        )
        assert isinstance(lowered, jax.stages.Lowered)
        return lowered.compile().memory_analysis().temp_size_in_bytes

    slot_bytes = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4  # k and v, float32
    prompt_copies = (8 - 2) * 2 * 128 * slot_bytes
    assert temp_bytes(8) - temp_bytes(2) < prompt_copies / 4  # measured: 0.04; 0.59 before


def test_eos_stops_and_masks(model):
    kw = dict(key=jax.random.key(5), max_new_tokens=T_NEW, group_size=2)
    free = generate(model, PROMPTS, LENGTHS, **kw)
    toks = np.asarray(free.tokens_nt)
    eos = int(toks[0, 2])  # a token that row 0 samples at step 2
    stop = int(toks[3, 4])
    r = generate(model, PROMPTS, LENGTHS, eos_ids=eos, stop_ids=[stop], pad_id=PAD, **kw)
    # The per-step draws do not depend on which rows are done, so prefixes agree.
    for n in range(toks.shape[0]):
        hits = np.flatnonzero(np.isin(toks[n], [eos, stop]))
        length = hits[0] + 1 if hits.size else T_NEW
        assert int(r.lengths_n[n]) == length
        assert bool(r.eos_found_n[n]) == bool(hits.size)
        np.testing.assert_array_equal(np.asarray(r.tokens_nt[n, :length]), toks[n, :length])
        assert (np.asarray(r.tokens_nt[n, length:]) == PAD).all()
        assert (np.asarray(r.logp_nt[n, length:]) == 0).all()
        np.testing.assert_array_equal(np.asarray(r.mask_nt[n]), np.arange(T_NEW) < length)
    assert int(r.lengths_n[0]) <= 3 and bool(r.eos_found_n[0])


def test_loop_stops_early_when_every_row_ended(model):
    kw = dict(key=jax.random.key(6), max_new_tokens=T_NEW, group_size=2)
    free = generate(model, PROMPTS, LENGTHS, **kw)
    toks = np.asarray(free.tokens_nt)
    # Stop on everything sampled at steps 0..1: all rows end by step 1.
    stops = sorted(set(toks[:, :2].ravel().tolist()))
    r = generate(model, PROMPTS, LENGTHS, stop_ids=stops, **kw)
    assert np.asarray(r.eos_found_n).all()
    assert int(r.decode_steps) == int(np.asarray(r.lengths_n).max()) <= 2
    assert int(free.decode_steps) == T_NEW


def test_deterministic_per_key_and_key_advances(model):
    kw = dict(max_new_tokens=T_NEW, group_size=2)
    a = generate(model, PROMPTS, LENGTHS, key=jax.random.key(7), **kw)
    b = generate(model, PROMPTS, LENGTHS, key=jax.random.key(7), **kw)
    c = generate(model, PROMPTS, LENGTHS, key=a.key, **kw)
    np.testing.assert_array_equal(np.asarray(a.tokens_nt), np.asarray(b.tokens_nt))
    np.testing.assert_array_equal(np.asarray(a.logp_nt), np.asarray(b.logp_nt))
    np.testing.assert_array_equal(jax.random.key_data(a.key), jax.random.key_data(b.key))
    assert not np.array_equal(jax.random.key_data(a.key), jax.random.key_data(jax.random.key(7)))
    assert not np.array_equal(np.asarray(a.tokens_nt), np.asarray(c.tokens_nt))
    # Samples of one prompt differ from each other (G rows are not copies).
    assert not np.array_equal(np.asarray(a.tokens_nt[0]), np.asarray(a.tokens_nt[1]))


def test_no_recompilation_within_a_bucket(model):
    kw = dict(key=jax.random.key(8), max_new_tokens=T_NEW, group_size=2)
    rng = np.random.default_rng(0)
    generate(model, PROMPTS, LENGTHS, **kw)  # compiled (or cached) for bucket 8
    before = generate_trace_count()
    for width, longest in [(8, 8), (12, 5), (16, 6), (3, 3)]:
        lens = np.array([longest, 1, max(1, longest - 2)], np.int32)
        prompts = rng.integers(1, 50, size=(3, width)).astype(np.int32)
        generate(model, prompts, lens, **kw)
    assert generate_trace_count() == before
    generate(model, rng.integers(1, 50, size=(3, 9)), np.array([9, 2, 3]), **kw)
    assert generate_trace_count() == before + 1  # bucket 16: one new program


def test_bad_arguments_are_named(model):
    with pytest.raises(ValueError, match="prompt lengths"):
        generate(model, PROMPTS, np.array([0, 1, 2]), key=jax.random.key(0), max_new_tokens=2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, PROMPTS, LENGTHS, key=jax.random.key(0), max_new_tokens=0)
    with pytest.raises(ValueError, match="group_size"):
        generate(model, PROMPTS, LENGTHS, key=jax.random.key(0), max_new_tokens=2, group_size=0)
    with pytest.raises(ValueError, match="bucket"):
        generate(model, PROMPTS, LENGTHS, key=jax.random.key(0), max_new_tokens=2, bucket=0)
