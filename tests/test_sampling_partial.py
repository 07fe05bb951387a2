"""Partial rollouts (`grpojax.sampling.partial`): with the same weights at every call the
rounds are the continuous engine's, token for token; with new weights at every call each
token's logprob is the one its recorded version's full forward gives; every token of round
r is decoded by a call in [r - k, r]; a window saved to the host and restored continues
bit-exactly."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from grpojax.models import Decoder, tiny_config
from grpojax.ops.logprobs import token_logprobs
from grpojax.sampling import SamplingConfig, generate
from grpojax.sampling.partial import PartialDecoder, Window

T_NEW = 16
G = 3
B = 3
N = B * G
EOS = (3, 7, 11)
WIDTH = 8  # the decoder's fixed prompt width (rounds come narrower)
SAMPLING = SamplingConfig(temperature=1.0)


def _round(r: int) -> tuple[np.ndarray, np.ndarray]:
    """Round r's B prompts, left-padded to 6 columns, lengths 2..6."""
    rng = np.random.default_rng(100 + r)
    lengths = rng.integers(2, 7, size=B).astype(np.int32)
    tokens = np.zeros((B, 6), np.int32)
    for i, n in enumerate(lengths):
        tokens[i, 6 - n :] = rng.integers(12, 60, size=n)
    return tokens, lengths


def _keys(n: int) -> list:
    """Round r's key as `generate` takes it."""
    return [jax.random.fold_in(jax.random.key(7), r) for r in range(n)]


def _gen_keys(n: int) -> list:
    """The keys the rounds' tokens are drawn with (`generate`: split(key)[1])."""
    return [jax.random.split(key)[1] for key in _keys(n)]


@pytest.fixture(scope="module")
def models():
    """Three versions of the weights: the second and third perturbed, so a token's
    logprob tells which decoded it."""
    base = Decoder(tiny_config(num_layers=2), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(base)
    out = [base]
    for v in (1, 2):
        noise = jax.tree.map(
            lambda x, i=v: x + 0.05 * jax.random.normal(jax.random.key(i), x.shape, x.dtype)
            if jnp.issubdtype(x.dtype, jnp.floating) else x,
            state,
        )  # fmt: skip
        out.append(nnx.merge(graphdef, noise))
    return out


def _run(
    decoder: PartialDecoder, weights: list, rounds: int, window: Window | None = None, start=0
):
    """Rounds start .. rounds - 1 through the decoder, call s with weights[s % len]:
    [(rollout, versions, decoded)], the final window."""
    k = decoder.k
    keys = _gen_keys(rounds + k)
    if window is None:
        window = decoder.window([_round(r) for r in range(k)], keys[:k])
    out = []
    for s in range(start, rounds):
        rollout, versions, window, decoded = decoder.advance(
            weights[s % len(weights)], window, *_round(s + k), keys[s + k], s
        )
        out.append((rollout, np.asarray(versions), int(decoded)))
    return out, window


def _decoder(k: int, slots: int) -> PartialDecoder:
    return PartialDecoder(
        rounds_ahead=k, n_prompts=B, group_size=G, prompt_width=WIDTH, max_new_tokens=T_NEW,
        sampling=SAMPLING, stop_ids=EOS, pad_id=0, slots=slots,
    )  # fmt: skip


@pytest.mark.parametrize("k,slots", [(1, 4), (2, 5)])
def test_same_weights_give_the_continuous_engines_rounds(models, k, slots):
    decoder = _decoder(k, slots)
    got, _ = _run(decoder, models[:1], 4)
    spans = 0
    for r, (rollout, versions, _) in enumerate(got):
        tokens, lengths = _round(r)
        want = generate(
            models[0], np.pad(tokens, ((0, 0), (WIDTH - 6, 0))), lengths,
            key=_keys(4 + k)[r], max_new_tokens=T_NEW, group_size=G, sampling=SAMPLING,
            eos_ids=EOS, engine="continuous", slots=slots, bucket=WIDTH, min_bucket_width=WIDTH,
        )  # fmt: skip
        for name in ("tokens_nt", "lengths_n", "eos_found_n", "keep_count_nt"):
            np.testing.assert_array_equal(
                np.asarray(getattr(rollout, name)), np.asarray(getattr(want, name)), err_msg=name
            )
        # float32 rounding: a recomputed cache is a prefill's, the engine's a decode's
        np.testing.assert_allclose(np.asarray(rollout.logp_nt), np.asarray(want.logp_nt), atol=1e-5)
        mask = np.asarray(rollout.mask_nt)
        spans += int(sum(len(set(versions[i][mask[i]])) > 1 for i in range(N)))
    assert spans > 0  # some samples were continued by a later call


def _forward_logp(model, rollout) -> np.ndarray:
    """`[N, T]` each completion token's logprob under `model`, from one full forward of
    prompt + completion (temperature 1, no truncation: the sampler's distribution)."""
    tokens, mask, positions = rollout.sequences()
    hidden, _ = model(tokens, positions_nt=positions, mask_nt=mask)
    p, t = rollout.prompt_tokens_bp.shape[1], rollout.tokens_nt.shape[1]
    logits = model.logits(hidden)[:, p - 1 : p - 1 + t]
    return np.asarray(token_logprobs(logits, rollout.tokens_nt))


@pytest.mark.parametrize("k,slots", [(1, 4), (2, 5)])
def test_each_token_is_its_recorded_versions(models, k, slots):
    """New weights at every call: each token's logprob is its version's full forward's
    (float32 rounding, 1e-5), not another version's; the versions of round r lie in
    [r - k, r] (the staleness bound per token)."""
    rounds = 5
    got, _ = _run(_decoder(k, slots), models, rounds)
    spans = 0
    for r, (rollout, versions, _) in enumerate(got):
        mask = np.asarray(rollout.mask_nt)
        seen = versions[mask]
        assert seen.min() >= max(0, r - k) and seen.max() <= r, (r, np.unique(seen))
        assert (versions[~mask] == 0).all()
        spans += int(sum(len(set(versions[i][mask[i]])) > 1 for i in range(N)))
        logp = np.asarray(rollout.logp_nt)
        for v in np.unique(seen):
            at = mask & (versions == v)
            np.testing.assert_allclose(
                logp[at], _forward_logp(models[v % len(models)], rollout)[at], atol=1e-5
            )
            other = _forward_logp(models[(v + 1) % len(models)], rollout)[at]
            assert np.abs(logp[at] - other).max() > 1e-2  # the check tells versions apart
    assert spans > 0  # some samples were continued with newer weights


def test_a_saved_window_continues_bit_exactly(models):
    """Rounds 0-4 uninterrupted against rounds 0-1, the window through the host (as a
    checkpoint holds it), then rounds 2-4: the same arrays, bit for bit."""
    decoder = _decoder(2, 5)
    whole, _ = _run(decoder, models, 5)
    first, window = _run(decoder, models, 2)
    # A checkpoint's copy: plain host arrays.
    host = {f: np.asarray(getattr(window, f)) for f in Window.__dataclass_fields__}
    restored = Window(**{f: jnp.asarray(x) for f, x in host.items()})
    rest, _ = _run(decoder, models, 5, window=restored, start=2)
    for (a, va, da), (b, vb, db) in zip(whole, first + rest):
        for name in ("tokens_nt", "logp_nt", "lengths_n", "eos_found_n", "keep_count_nt"):
            np.testing.assert_array_equal(
                np.asarray(getattr(a, name)), np.asarray(getattr(b, name))
            )
        np.testing.assert_array_equal(va, vb)
        assert da == db


def test_decoder_refuses_prompts_it_cannot_hold():
    decoder = _decoder(1, 4)
    with pytest.raises(ValueError, match=r"partial rollouts take 3 prompts of 1 \.\. 8 tokens"):
        decoder.pad_prompts(np.ones((3, 9), np.int32), np.array([9, 9, 9]))
    # Wider than the decoder, but the extra columns are padding: cropped.
    tokens, _ = decoder.pad_prompts(np.pad(_round(0)[0], ((0, 0), (4, 0))), _round(0)[1])
    np.testing.assert_array_equal(tokens, np.pad(_round(0)[0], ((0, 0), (2, 0))))
    with pytest.raises(ValueError, match="a window holds 1 rounds"):
        decoder.window([_round(0), _round(1)], _gen_keys(2))
    with pytest.raises(ValueError, match="rounds_ahead must be >= 1"):
        PartialDecoder(rounds_ahead=0, n_prompts=B, group_size=G, prompt_width=8, max_new_tokens=4)
