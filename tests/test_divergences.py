"""`divergence_from_hidden`: the exact full-vocabulary reverse KL, forward KL and generalised
JSD of a policy from a reference (a distillation teacher), tiled over tokens and vocabulary.
Values against float64 NumPy written from the definitions; gradients against `jax.grad` of the
plain full-vocabulary definitions (so the custom VJPs' formulas are checked, not assumed)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_logprobs import ATOL, divergence_of, f64, make_inputs, np_log_softmax

from grpojax.ops import divergence_from_hidden, kl_from_hidden

DIVERGENCES = ("reverse_kl", "forward_kl", "jsd")
BETA = 0.3  # not 0.5: the JSD's two sides weigh differently, so a swap would show


def np_divergence(z, y, name, beta=BETA, temperature=1.0):
    """float64 D(p, q) per row, p = softmax(z / t) the policy, q = softmax(y / t)."""
    logp = np_log_softmax(np.asarray(z, np.float64) / temperature)
    logq = np_log_softmax(np.asarray(y, np.float64) / temperature)
    return divergence_of(logp, logq, name, beta)


def jnp_divergence(z, y, name, beta=BETA, temperature=1.0):
    """The same definitions in plain jnp over `[..., V]` logits, for `jax.grad`."""
    logp = jax.nn.log_softmax(z / temperature, axis=-1)
    logq = jax.nn.log_softmax(y / temperature, axis=-1)
    return divergence_of(logp, logq, name, beta, jnp)


def _inputs(seed):
    hidden, lm_head, _, weights, ref_hidden, mask = make_inputs(seed=seed)
    ref_lm_head = lm_head + 0.3 * jax.random.normal(jax.random.key(seed + 100), lm_head.shape)
    return hidden, lm_head, ref_hidden, ref_lm_head, weights, mask


@pytest.mark.parametrize("name", DIVERGENCES)
@pytest.mark.parametrize(("chunk_size", "vocab_chunk_size"), [(4, 10), (64, 1000), (1, 7)])
def test_each_divergence_and_its_gradient_equal_the_full_vocabulary_definition(
    name, chunk_size, vocab_chunk_size
):
    """Ragged tiles (N*T = 21, V = 53), temperature 0.9, a ragged mask: values within ATOL of
    float64 NumPy, >= 0, 0 where masked; the gradients w.r.t. the policy's hidden states and
    LM head within ATOL (rtol 1e-5) of `jax.grad` of the plain definition, and none reach the
    reference."""
    hidden, lm_head, ref_hidden, ref_lm_head, weights, mask = _inputs(seed=21)
    kw = dict(
        divergence=name,
        beta=BETA,
        chunk_size=chunk_size,
        vocab_chunk_size=vocab_chunk_size,
        temperature=0.9,
    )
    got = divergence_from_hidden(hidden, lm_head, ref_hidden, ref_lm_head, mask, **kw)
    z64, y64 = f64(hidden) @ f64(lm_head), f64(ref_hidden) @ f64(ref_lm_head)
    ref = np.where(mask, np_divergence(z64, y64, name, temperature=0.9), 0.0)
    np.testing.assert_allclose(got, ref, atol=ATOL, rtol=0)
    assert np.all(np.asarray(got) >= 0.0) and float(np.max(ref)) > 0.05

    def chunked(h, w, rh, rw):
        return jnp.sum(weights * divergence_from_hidden(h, w, rh, rw, mask, **kw))

    def full(h, w):
        y = jax.lax.stop_gradient(ref_hidden @ ref_lm_head)
        d = jnp_divergence(h @ w, y, name, temperature=0.9)
        return jnp.sum(weights * jnp.where(mask, d, 0.0))

    g_chunk = jax.grad(chunked, argnums=(0, 1, 2, 3))(hidden, lm_head, ref_hidden, ref_lm_head)
    g_full = jax.grad(full, argnums=(0, 1))(hidden, lm_head)
    for a, b in zip(g_chunk[:2], g_full):
        assert np.abs(np.asarray(b)).max() > 1e-3
        np.testing.assert_allclose(a, b, atol=ATOL, rtol=1e-5)
    for g in g_chunk[2:]:
        np.testing.assert_array_equal(np.asarray(g), 0.0)


def test_divergences_known_cases():
    """reverse_kl is `kl_from_hidden`, bit for bit; forward_kl swaps the models' roles in
    it; every divergence of a model from itself is 0; the JSD with beta 0.5 is symmetric and
    at most log 2, and with beta near 0 it is beta times the forward KL to first order."""
    hidden, lm_head, ref_hidden, ref_lm_head, _, mask = _inputs(seed=22)
    kw = dict(chunk_size=4, vocab_chunk_size=10)

    def div(h, w, rh, rw, name, beta=None):
        return np.asarray(
            divergence_from_hidden(h, w, rh, rw, mask, divergence=name, beta=beta, **kw)
        )

    args = (hidden, lm_head, ref_hidden, ref_lm_head)
    swapped = (ref_hidden, ref_lm_head, hidden, lm_head)
    np.testing.assert_array_equal(
        div(*args, "reverse_kl"), np.asarray(kl_from_hidden(*args, mask, **kw))
    )
    np.testing.assert_allclose(div(*args, "forward_kl"), div(*swapped, "reverse_kl"), atol=ATOL)
    for name in DIVERGENCES:
        same = div(hidden, lm_head, hidden, lm_head, name, beta=0.5)
        np.testing.assert_allclose(same, 0.0, atol=2e-6)
    half = div(*args, "jsd", beta=0.5)
    np.testing.assert_allclose(half, div(*swapped, "jsd", beta=0.5), atol=ATOL)
    assert np.all(half <= np.log(2.0) + 1e-6)
    # JSD_beta = beta KL(q || m) + ...; as beta -> 0, JSD_beta / beta -> KL(q || p).
    small = div(*args, "jsd", beta=1e-3) / 1e-3
    np.testing.assert_allclose(small, div(*args, "forward_kl"), rtol=0.02, atol=1e-3)


def test_a_traced_temperature_gives_the_static_ones_values_and_a_gradient_of_its_own():
    """Under jit the temperature may be a traced scalar: values and policy gradients equal
    the static number's (1e-6, ATOL), and the temperature's gradient equals a float64 NumPy
    central difference of the definition (rtol 1e-5)."""
    hidden, lm_head, ref_hidden, ref_lm_head, weights, mask = _inputs(seed=23)
    z64, y64 = f64(hidden) @ f64(lm_head), f64(ref_hidden) @ f64(ref_lm_head)
    w64, m = f64(weights), np.asarray(mask)
    for name in ("forward_kl", "jsd"):

        def loss(h, w, t, name=name):
            d = divergence_from_hidden(
                h, w, ref_hidden, ref_lm_head, mask, divergence=name, beta=BETA,
                chunk_size=4, vocab_chunk_size=10, temperature=t,
            )  # fmt: skip
            return jnp.sum(weights * d)

        static = jax.jit(jax.value_and_grad(lambda h, w: loss(h, w, 1.2), argnums=(0, 1)))
        traced = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
        (v_s, g_s), (v_t, g_t) = static(hidden, lm_head), traced(hidden, lm_head, 1.2)
        np.testing.assert_allclose(v_t, v_s, rtol=1e-6, atol=1e-6, err_msg=name)
        for a, b in zip(g_s, g_t[:2]):
            np.testing.assert_allclose(b, a, atol=ATOL, err_msg=name)

        def np_loss(t, name=name):
            return np.sum(w64 * np.where(m, np_divergence(z64, y64, name, temperature=t), 0.0))

        eps = 1e-5
        d_t = (np_loss(1.2 + eps) - np_loss(1.2 - eps)) / (2 * eps)
        np.testing.assert_allclose(g_t[2], d_t, rtol=1e-5, err_msg=name)


def test_bad_arguments_name_the_field():
    hidden, lm_head, ref_hidden, ref_lm_head, _, _ = _inputs(seed=24)
    args = (hidden, lm_head, ref_hidden, ref_lm_head)
    with pytest.raises(ValueError, match=r"^divergence must be one of \['reverse_kl'"):
        divergence_from_hidden(*args, divergence="kl")
    with pytest.raises(ValueError, match="divergence='jsd' needs beta"):
        divergence_from_hidden(*args, divergence="jsd")
    for beta in (0.0, 1.0, float("nan")):
        with pytest.raises(ValueError, match=r"^beta must be"):
            divergence_from_hidden(*args, divergence="jsd", beta=beta)
    with pytest.raises(ValueError, match="vocabularies differ"):
        divergence_from_hidden(
            hidden, lm_head, ref_hidden, ref_lm_head[:, :-1], divergence="jsd", beta=0.5
        )
