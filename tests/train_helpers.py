"""Shared builders for the train-step tests: a very small decoder and ragged random batches."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from grpojax.models import Decoder, tiny_config
from grpojax.ops.masks import mask_from_lengths
from grpojax.train import ForwardConfig, GRPOBatch, SFTBatch, sft_batch_from_lengths

# Small tiles so the chunked log-softmax really runs over several token and vocab chunks.
FORWARD = ForwardConfig(chunk_size=16, vocab_chunk_size=32)


def small_config(**overrides):
    kw = dict(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2)
    kw.update(head_dim=16)
    kw.update(overrides)
    return tiny_config(**kw)


def small_model(seed: int = 0, **overrides) -> Decoder:
    return Decoder(small_config(**overrides), rngs=nnx.Rngs(seed))


def random_grpo_batch(seed: int, *, n=8, p=4, t=6, vocab=100, token_adv=False, extras=False):
    """Ragged left-padded prompts and right-padded completions, masks from lengths."""
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(3, vocab, (n, p + t)), jnp.int32)
    plen = jnp.asarray(rng.integers(1, p + 1, n), jnp.int32)
    clen = jnp.asarray(rng.integers(1, t + 1, n), jnp.int32)
    pmask = mask_from_lengths(plen, p, offset_n=p - plen)
    cmask = mask_from_lengths(clen, t)
    shape = (n, t) if token_adv else (n,)
    adv = jnp.asarray(rng.normal(size=shape), jnp.float32)
    batch = GRPOBatch(
        tokens_ns=tokens,
        mask_ns=jnp.concatenate([pmask, cmask], axis=1),
        completion_mask_nt=cmask,
        advantages=adv,
    )
    if extras:
        batch = batch.replace(
            sampler_logp_nt=jnp.asarray(rng.normal(-4.6, 0.3, (n, t)), jnp.float32),
        )
    return batch


def grouped_grpo_batch(seed: int, *, b=4, g=4, p=5, t=6, vocab=100):
    """B ragged left-padded prompts, each repeated G times (the sampler's layout), then G
    different ragged completions per prompt."""
    rng = np.random.default_rng(seed)
    plen = rng.integers(1, p + 1, b)
    pmask = np.arange(p)[None, :] >= (p - plen)[:, None]
    prompts = np.where(pmask, rng.integers(3, vocab, (b, p)), 0)
    cmask = np.arange(t)[None, :] < rng.integers(1, t + 1, b * g)[:, None]
    tokens = np.concatenate([np.repeat(prompts, g, 0), rng.integers(3, vocab, (b * g, t))], 1)
    return random_grpo_batch(seed, n=b * g, p=p, t=t).replace(
        tokens_ns=jnp.asarray(tokens, jnp.int32),
        mask_ns=jnp.asarray(np.concatenate([np.repeat(pmask, g, 0), cmask], 1)),
        completion_mask_nt=jnp.asarray(cmask),
    )


def full_logits_logp(model, batch) -> np.ndarray:
    """Reference completion logprobs from full `[N, S, V]` logits, in NumPy (float64)."""
    mask = np.asarray(batch.mask_ns)
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    hidden, _ = model(batch.tokens_ns, positions_nt=jnp.asarray(positions), mask_nt=batch.mask_ns)
    logits = np.asarray(model.logits(hidden), np.float64)
    t = batch.completion_mask_nt.shape[1]
    s = logits.shape[1]
    z = logits[:, s - t - 1 : s - 1]
    z = z - z.max(-1, keepdims=True)
    logsm = z - np.log(np.exp(z).sum(-1, keepdims=True))
    tok = np.asarray(batch.tokens_ns)[:, s - t :]
    return np.take_along_axis(logsm, tok[..., None], -1)[..., 0], logsm


def params_close(a, b, *, rtol, atol=0.0):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def grad_recorder() -> optax.GradientTransformation:
    """An "optimizer" whose state is the last gradient it saw and whose update is 0."""
    return optax.GradientTransformation(
        init=lambda p: jax.tree.map(jnp.zeros_like, p),
        update=lambda g, s, p=None: (jax.tree.map(jnp.zeros_like, g), g),
    )


def random_text_batch(seed: int, *, n=4, s=7, vocab=100) -> SFTBatch:
    """Right-padded ragged rows of "pretraining text" (lengths 2..S): every real token after
    the first is a target."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, s + 1, n)
    tokens = np.where(np.arange(s) < lengths[:, None], rng.integers(3, vocab, (n, s)), 0)
    return sft_batch_from_lengths(tokens, np.ones(n, np.int32), lengths)
