"""Logprobs, entropy and full-vocabulary KL: full and chunked forms.

References are float64 NumPy written here (independent of the JAX code), hand-computed
distributions, and equivalences (chunked == full, in value and gradient; vmap == loop).
Tolerances: float32 values and gradients 1e-5 absolute unless a test says otherwise.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_fixtures import dot_generals

import grpojax.ops.logprobs as lp
from grpojax.ops.logprobs import (
    divergence_from_hidden,
    entropy,
    entropy_from_hidden,
    full_kl,
    kl_from_hidden,
    token_logprobs,
    token_logprobs_from_hidden,
)

ATOL = 1e-5

# Ragged on purpose: N*T = 21 is not a multiple of 4 or 8, V = 53 not of 10 or 16.
N, T, D, V = 3, 7, 16, 53
# (64, 1000) exceeds both sizes: one tile, clamped.
TILINGS = [(4, 10), (8, 16), (64, 1000), (1, 7)]


# ------------------------------------------------------------------ NumPy references


def np_log_softmax(x):
    x = np.asarray(x, np.float64)
    mx = x.max(-1, keepdims=True)
    return x - mx - np.log(np.exp(x - mx).sum(-1, keepdims=True))


def np_token_logprobs(logits, tokens, temperature=1.0):
    logp = np_log_softmax(np.asarray(logits, np.float64) / temperature)
    return np.take_along_axis(logp, np.asarray(tokens)[..., None], axis=-1)[..., 0]


def np_entropy(logits, temperature=1.0):
    logp = np_log_softmax(np.asarray(logits, np.float64) / temperature)
    return -(np.exp(logp) * logp).sum(-1)


def np_kl(logits, ref_logits, temperature=1.0):
    logp = np_log_softmax(np.asarray(logits, np.float64) / temperature)
    logq = np_log_softmax(np.asarray(ref_logits, np.float64) / temperature)
    return (np.exp(logp) * (logp - logq)).sum(-1)


def divergence_of(logp, logq, name, beta=0.5, xp=np):
    """D(p || q) per position from full log-softmaxes `[..., V]` (p the policy, q the
    reference), written from the definitions with array module `xp` (float64 NumPy for
    values, jnp for `jax.grad`): "reverse_kl" KL(p || q), "forward_kl" KL(q || p), "jsd"
    beta KL(q || m) + (1 - beta) KL(p || m) with m = beta q + (1 - beta) p."""
    p, q = xp.exp(logp), xp.exp(logq)
    if name == "reverse_kl":
        return (p * (logp - logq)).sum(-1)
    if name == "forward_kl":
        return (q * (logq - logp)).sum(-1)
    logm = xp.log(beta * q + (1 - beta) * p)
    return beta * (q * (logq - logm)).sum(-1) + (1 - beta) * (p * (logp - logm)).sum(-1)


def f64(x):
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


# ------------------------------------------------------------------ fixtures


def make_inputs(seed=0, n=N, t=T, d=D, v=V, dtype=jnp.float32):
    k = jax.random.split(jax.random.key(seed), 6)
    hidden = jax.random.normal(k[0], (n, t, d)).astype(dtype)
    lm_head = (jax.random.normal(k[1], (d, v)) * 0.6).astype(dtype)
    tokens = jax.random.randint(k[2], (n, t), 0, v)
    weights = jax.random.normal(k[3], (n, t))
    ref_hidden = (hidden.astype(jnp.float32) + 0.4 * jax.random.normal(k[4], (n, t, d))).astype(
        dtype
    )
    lengths = jnp.array([t, t // 2, 1][:n] + [t] * max(0, n - 3))
    mask = jnp.arange(t)[None, :] < lengths[:, None]  # ragged, from lengths
    return hidden, lm_head, tokens, weights, ref_hidden, mask


# ------------------------------------------------------------------ token_logprobs


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_token_logprobs_matches_numpy(temperature):
    k1, k2 = jax.random.split(jax.random.key(1))
    logits = 3.0 * jax.random.normal(k1, (2, 3, 5, 41))  # extra leading dim
    tokens = jax.random.randint(k2, (2, 3, 5), 0, 41)
    got = token_logprobs(logits, tokens, temperature=temperature)
    assert got.dtype == jnp.float32 and got.shape == (2, 3, 5)
    np.testing.assert_allclose(got, np_token_logprobs(logits, tokens, temperature), atol=ATOL)


def test_token_logprobs_hand_values():
    # Uniform logits over V: every token has log-probability -log V.
    got = token_logprobs(jnp.zeros((2, 3, 8)), jnp.zeros((2, 3), jnp.int32))
    np.testing.assert_allclose(got, np.full((2, 3), -np.log(8.0)), atol=1e-6)
    # logits (0, log 3): p = (1/4, 3/4).
    logits = jnp.array([[[0.0, np.log(3.0)]]])
    np.testing.assert_allclose(
        token_logprobs(logits, jnp.array([[1]])), [[np.log(0.75)]], atol=1e-6
    )
    # Temperature 2 on logits (0, 2 log 3) gives the same distribution.
    logits2 = jnp.array([[[0.0, 2 * np.log(3.0)]]])
    np.testing.assert_allclose(
        token_logprobs(logits2, jnp.array([[0]]), temperature=2.0), [[np.log(0.25)]], atol=1e-6
    )


def test_token_logprobs_bf16_logits_computed_in_f32():
    k1, k2 = jax.random.split(jax.random.key(2))
    # Large logits: a bf16 log-softmax would be off by ~0.1 here.
    logits = (20.0 * jax.random.normal(k1, (4, 6, 300))).astype(jnp.bfloat16)
    tokens = jax.random.randint(k2, (4, 6), 0, 300)
    got = token_logprobs(logits, tokens, temperature=0.7)
    assert got.dtype == jnp.float32
    # Reference on the exact bf16 values, in float64.
    np.testing.assert_allclose(got, np_token_logprobs(f64(logits), tokens, 0.7), atol=5e-5)


# ------------------------------------------------------------------ chunked logprobs


@pytest.mark.parametrize("chunk_size,vocab_chunk_size", TILINGS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_equal_full_value_and_grad(chunk_size, vocab_chunk_size, temperature):
    hidden, lm_head, tokens, weights, _, _ = make_inputs()

    def full(h, w):
        return token_logprobs(h @ w, tokens, temperature=temperature)

    def chunked(h, w):
        return token_logprobs_from_hidden(
            h,
            w,
            tokens,
            chunk_size=chunk_size,
            vocab_chunk_size=vocab_chunk_size,
            temperature=temperature,
        )

    got = chunked(hidden, lm_head)
    assert got.dtype == jnp.float32 and got.shape == (N, T)
    ref = np_token_logprobs(f64(hidden) @ f64(lm_head), tokens, temperature)
    np.testing.assert_allclose(got, ref, atol=ATOL)
    np.testing.assert_allclose(got, full(hidden, lm_head), atol=ATOL)

    def scalar(fn):
        return lambda h, w: jnp.sum(weights * fn(h, w))

    g_full = jax.grad(scalar(full), argnums=(0, 1))(hidden, lm_head)
    g_chunk = jax.grad(scalar(chunked), argnums=(0, 1))(hidden, lm_head)
    for a, b in zip(g_chunk, g_full):
        assert a.shape == b.shape and a.dtype == jnp.float32
        np.testing.assert_allclose(a, b, atol=ATOL, rtol=1e-5)


def test_chunked_logprobs_grad_matches_numpy_formula():
    # d/dz of sum_n w_n logp_n is w_n (onehot - p): an independent float64 check.
    hidden, lm_head, tokens, weights, _, _ = make_inputs(seed=3)
    h64, w64 = f64(hidden).reshape(-1, D), f64(lm_head)
    logp = np_log_softmax(h64 @ w64)
    onehot = np.eye(V)[np.asarray(tokens).reshape(-1)]
    dz = np.asarray(weights, np.float64).reshape(-1, 1) * (onehot - np.exp(logp))
    d_h, d_w = jax.grad(
        lambda h, w: jnp.sum(
            weights * token_logprobs_from_hidden(h, w, tokens, chunk_size=5, vocab_chunk_size=12)
        ),
        argnums=(0, 1),
    )(hidden, lm_head)
    np.testing.assert_allclose(d_h.reshape(-1, D), dz @ w64.T, atol=ATOL)
    np.testing.assert_allclose(d_w, h64.T @ dz, atol=ATOL)


@pytest.fixture(params=[False, True], ids=["upcast", "narrow"])
def narrow_logits(request, monkeypatch):
    """Both operand policies of the logits tiles on this machine: float32 upcast (XLA:CPU's)
    and bf16 operands with float32 accumulation (an accelerator's)."""
    monkeypatch.setattr(lp, "_narrow_logit_operands", lambda: request.param)
    return request.param


def test_chunked_logprobs_bf16_inputs(narrow_logits):
    hidden, lm_head, tokens, weights, _, _ = make_inputs(seed=4, dtype=jnp.bfloat16)
    got = token_logprobs_from_hidden(hidden, lm_head, tokens, chunk_size=4, vocab_chunk_size=10)
    assert got.dtype == jnp.float32
    # Float32 math on the exact bf16 values: matches float64 NumPy to float32 accuracy.
    np.testing.assert_allclose(
        got, np_token_logprobs(f64(hidden) @ f64(lm_head), tokens), atol=ATOL
    )

    def loss(h, w):
        logp = token_logprobs_from_hidden(h, w, tokens, chunk_size=4, vocab_chunk_size=10)
        return jnp.sum(weights * logp)

    d_h, d_w = jax.grad(loss, argnums=(0, 1))(hidden, lm_head)
    assert d_h.dtype == jnp.bfloat16 and d_w.dtype == jnp.bfloat16
    # Same gradient in float32 on the upcast inputs; bf16 output rounding is 2^-8 relative.
    r_h, r_w = jax.grad(loss, argnums=(0, 1))(
        hidden.astype(jnp.float32), lm_head.astype(jnp.float32)
    )
    np.testing.assert_allclose(f64(d_h), r_h, rtol=2**-8, atol=1e-3)
    np.testing.assert_allclose(f64(d_w), r_w, rtol=2**-8, atol=1e-3)
    # The logits tiles multiply bf16 operands only under the narrow policy; the cotangent
    # matmuls (float32 dl) are float32 under both.
    grad_fn = jax.grad(loss, argnums=(0, 1))
    dots = {
        tuple(str(v.aval.dtype) for v in e.invars) for e in dot_generals(grad_fn, hidden, lm_head)
    }
    assert (("bfloat16", "bfloat16") in dots) == narrow_logits
    assert ("float32", "float32") in dots


def test_chunked_entropy_and_kl_bf16_inputs(narrow_logits):
    hidden, lm_head, _, weights, ref_hidden, mask = make_inputs(seed=6, dtype=jnp.bfloat16)
    z, z_ref = f64(hidden) @ f64(lm_head), f64(ref_hidden) @ f64(lm_head)
    kw = dict(chunk_size=4, vocab_chunk_size=10)
    ent = entropy_from_hidden(hidden, lm_head, **kw)
    np.testing.assert_allclose(ent, np_entropy(z), atol=ATOL)
    kl = kl_from_hidden(hidden, lm_head, ref_hidden, lm_head, mask_nt=mask, **kw)
    np.testing.assert_allclose(kl, np_kl(z, z_ref) * mask, atol=ATOL)

    def loss(h, w):
        return jnp.sum(weights * kl_from_hidden(h, w, ref_hidden, lm_head, mask_nt=mask, **kw))

    # Same gradient as float32 on the upcast inputs, to bf16 output rounding (2^-8 relative).
    d_h, d_w = jax.grad(loss, argnums=(0, 1))(hidden, lm_head)
    up = lambda x: x.astype(jnp.float32)
    r_h, r_w = jax.grad(
        lambda h, w: jnp.sum(
            weights * kl_from_hidden(h, w, up(ref_hidden), up(lm_head), mask_nt=mask, **kw)
        ),
        argnums=(0, 1),
    )(up(hidden), up(lm_head))
    np.testing.assert_allclose(f64(d_h), r_h, rtol=2**-8, atol=1e-3)
    np.testing.assert_allclose(f64(d_w), r_w, rtol=2**-8, atol=1e-3)


def test_chunked_logprobs_any_leading_dims_and_tied_embedding():
    k1, k2, k3 = jax.random.split(jax.random.key(5), 3)
    hidden = jax.random.normal(k1, (2, 2, 5, D))
    embedding_vd = jax.random.normal(k2, (V, D)) * 0.5
    tokens = jax.random.randint(k3, (2, 2, 5), 0, V)
    got = token_logprobs_from_hidden(
        hidden, embedding_vd.T, tokens, chunk_size=3, vocab_chunk_size=11
    )
    assert got.shape == (2, 2, 5)
    ref = np_token_logprobs(f64(hidden) @ f64(embedding_vd).T, tokens)
    np.testing.assert_allclose(got, ref, atol=ATOL)


# ------------------------------------------------------------------ entropy


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_entropy_matches_numpy_and_masks(temperature):
    k1 = jax.random.key(6)
    logits = 4.0 * jax.random.normal(k1, (N, T, V))
    _, _, _, _, _, mask = make_inputs()
    got = entropy(logits, mask, temperature=temperature)
    ref = np.where(mask, np_entropy(logits, temperature), 0.0)
    np.testing.assert_allclose(got, ref, atol=ATOL)
    np.testing.assert_allclose(entropy(logits), np_entropy(logits), atol=ATOL)


def test_entropy_hand_values_and_minus_inf_logits():
    # Uniform over 8 -> log 8; one-hot (others -inf) -> 0 with a finite gradient.
    np.testing.assert_allclose(entropy(jnp.zeros((1, 1, 8))), [[np.log(8.0)]], atol=1e-6)
    logits = jnp.array([[[0.0, -jnp.inf, -jnp.inf], [0.0, 0.0, -jnp.inf]]])
    np.testing.assert_allclose(entropy(logits), [[0.0, np.log(2.0)]], atol=1e-6)
    grad = jax.grad(lambda x: jnp.sum(entropy(x)))(logits)
    assert np.all(np.isfinite(grad))


@pytest.mark.parametrize("chunk_size,vocab_chunk_size", [(4, 10), (64, 1000), (1, 7)])
def test_chunked_entropy_equals_full_value_and_grad(chunk_size, vocab_chunk_size):
    hidden, lm_head, _, weights, _, mask = make_inputs(seed=7)
    hidden = 3.0 * hidden  # sharper distributions: exercises the peaked-entropy path

    def full(h, w):
        return entropy(h @ w, mask, temperature=0.8)

    def chunked(h, w):
        return entropy_from_hidden(
            h, w, mask, chunk_size=chunk_size, vocab_chunk_size=vocab_chunk_size, temperature=0.8
        )

    got = chunked(hidden, lm_head)
    ref = np.where(mask, np_entropy(f64(hidden) @ f64(lm_head), 0.8), 0.0)
    np.testing.assert_allclose(got, ref, atol=ATOL)
    np.testing.assert_allclose(got, full(hidden, lm_head), atol=ATOL)
    g_full = jax.grad(lambda h, w: jnp.sum(weights * full(h, w)), argnums=(0, 1))(hidden, lm_head)
    g_chunk = jax.grad(lambda h, w: jnp.sum(weights * chunked(h, w)), argnums=(0, 1))(
        hidden, lm_head
    )
    # Tiled against full, other reduction orders: |z / T| reaches ~34 here (ulp 3.8e-6), the
    # gradient p (log p + H) carries a few ulps of log p, and d_w sums it over 21 tokens of
    # |h| <= ~8: ~1e-5 (1.1e-5 seen, |d_w| <= 3.6), so 4 ATOL. A wrong VJP is O(|g|) ~ 1.
    for a, b in zip(g_chunk, g_full):
        np.testing.assert_allclose(a, b, atol=4 * ATOL, rtol=1e-5)
    # Masked rows get exactly no gradient.
    assert np.all(np.asarray(g_chunk[0])[~np.asarray(mask)] == 0.0)


def test_chunked_entropy_hand_values():
    # Zero LM head -> uniform over V -> entropy log V for every token.
    hidden = jnp.ones((2, 3, 4))
    got = entropy_from_hidden(hidden, jnp.zeros((4, 37)), chunk_size=4, vocab_chunk_size=8)
    np.testing.assert_allclose(got, np.full((2, 3), np.log(37.0)), atol=1e-6)


# ------------------------------------------------------------------ KL


def test_full_kl_matches_numpy_and_hand_values():
    k1, k2 = jax.random.split(jax.random.key(8))
    logits = 2.0 * jax.random.normal(k1, (N, T, V))
    ref_logits = 2.0 * jax.random.normal(k2, (N, T, V))
    _, _, _, _, _, mask = make_inputs()
    got = full_kl(logits, ref_logits, mask, temperature=1.3)
    np.testing.assert_allclose(got, np.where(mask, np_kl(logits, ref_logits, 1.3), 0.0), atol=ATOL)
    # p = (1/2, 1/2), q = (1/4, 3/4): KL = 1/2 log 2 + 1/2 log(2/3).
    p = jnp.log(jnp.array([[[0.5, 0.5]]]))
    q = jnp.log(jnp.array([[[0.25, 0.75]]]))
    hand = 0.5 * np.log(2.0) + 0.5 * np.log(2.0 / 3.0)
    np.testing.assert_allclose(full_kl(p, q), [[hand]], atol=1e-6)
    assert float(full_kl(p, p)[0, 0]) == 0.0


@pytest.mark.parametrize("chunk_size,vocab_chunk_size", [(4, 10), (64, 1000)])
def test_chunked_kl_matches_numpy_value_and_grad(chunk_size, vocab_chunk_size):
    hidden, lm_head, _, weights, ref_hidden, mask = make_inputs(seed=9)
    k = jax.random.key(10)
    ref_lm_head = lm_head + 0.2 * jax.random.normal(k, lm_head.shape)
    kw = dict(chunk_size=chunk_size, vocab_chunk_size=vocab_chunk_size, temperature=0.9)

    got = kl_from_hidden(hidden, lm_head, ref_hidden, ref_lm_head, mask, **kw)
    ref = np_kl(f64(hidden) @ f64(lm_head), f64(ref_hidden) @ f64(ref_lm_head), 0.9)
    np.testing.assert_allclose(got, np.where(mask, ref, 0.0), atol=ATOL)
    assert np.all(np.asarray(got) >= 0.0)

    def chunked(h, w):
        return jnp.sum(weights * kl_from_hidden(h, w, ref_hidden, ref_lm_head, mask, **kw))

    def full(h, w):
        ref_logits = jax.lax.stop_gradient(ref_hidden @ ref_lm_head)
        return jnp.sum(weights * full_kl(h @ w, ref_logits, mask, temperature=0.9))

    g_chunk = jax.grad(chunked, argnums=(0, 1))(hidden, lm_head)
    g_full = jax.grad(full, argnums=(0, 1))(hidden, lm_head)
    for a, b in zip(g_chunk, g_full):
        np.testing.assert_allclose(a, b, atol=ATOL, rtol=1e-5)


def test_chunked_kl_self_is_zero_and_reference_is_constant():
    hidden, lm_head, _, _, ref_hidden, _ = make_inputs(seed=11)
    kw = dict(chunk_size=4, vocab_chunk_size=10)
    same = kl_from_hidden(hidden, lm_head, hidden, lm_head, **kw)
    np.testing.assert_array_equal(np.asarray(same), 0.0)
    # A logit shift common to the whole vocabulary leaves the distribution unchanged.
    # (The reference has width D + 1: the two models need only share V.)
    ref_h = jnp.concatenate([hidden, jnp.ones((N, T, 1))], axis=-1)
    ref_w = jnp.concatenate([lm_head, jnp.full((1, V), 5.0)], axis=0)
    # The reference's logits come from another matmul (D + 1 terms) at |z + 5| <= ~14, where
    # an ulp is 9.5e-7: the KL's float32 floor is a few of those (7.2e-7 seen). An unshifted
    # normalisation would give 5.
    np.testing.assert_allclose(kl_from_hidden(hidden, lm_head, ref_h, ref_w, **kw), 0.0, atol=ATOL)
    grads = jax.grad(
        lambda rh, rw: jnp.sum(kl_from_hidden(hidden, lm_head, rh, rw, **kw)), argnums=(0, 1)
    )(ref_hidden, lm_head)
    for g in grads:
        np.testing.assert_array_equal(np.asarray(g), 0.0)


def test_masked_rows_with_nonfinite_hidden_do_not_poison_gradients():
    hidden, lm_head, _, weights, ref_hidden, mask = make_inputs(seed=12)
    hidden = jnp.where(mask[..., None], hidden, jnp.nan)
    kw = dict(chunk_size=4, vocab_chunk_size=10)
    for fn in (
        lambda h, w: entropy_from_hidden(h, w, mask, **kw),
        lambda h, w: kl_from_hidden(h, w, ref_hidden, lm_head, mask, **kw),
    ):
        value = fn(hidden, lm_head)
        assert np.all(np.asarray(value)[~np.asarray(mask)] == 0.0)

        def loss(h, w, fn=fn):
            return jnp.sum(weights * fn(h, w))

        d_h, d_w = jax.grad(loss, argnums=(0, 1))(hidden, lm_head)
        assert np.all(np.isfinite(d_w)) and np.all(np.isfinite(np.asarray(d_h)[np.asarray(mask)]))


# ------------------------------------------------------------------ transformations


def test_jit_vmap_grad():
    hidden, lm_head, tokens, weights, ref_hidden, mask = make_inputs(seed=13, n=2, t=5)
    kw = dict(chunk_size=3, vocab_chunk_size=10, temperature=0.8)

    def per_row(h_td, tok_t, m_t, rh_td):
        return (
            token_logprobs_from_hidden(h_td, lm_head, tok_t, **kw),
            entropy_from_hidden(h_td, lm_head, m_t, **kw),
            kl_from_hidden(h_td, lm_head, rh_td, lm_head, m_t, **kw),
        )

    batched = jax.jit(jax.vmap(per_row))(hidden, tokens, mask, ref_hidden)
    one = jax.jit(per_row)
    looped = [one(hidden[i], tokens[i], mask[i], ref_hidden[i]) for i in range(2)]
    for j, out in enumerate(batched):
        np.testing.assert_allclose(out, np.stack([row[j] for row in looped]), atol=ATOL)

    def loss(h, w):
        out = jax.vmap(
            lambda h_td, tok_t: token_logprobs_from_hidden(h_td, w, tok_t, **kw), in_axes=(0, 0)
        )(h, tokens)
        return jnp.sum(weights * out)

    def loss_full(h, w):
        return jnp.sum(weights * token_logprobs(h @ w, tokens, temperature=0.8))

    g = jax.jit(jax.grad(loss, argnums=(0, 1)))(hidden, lm_head)
    g_ref = jax.grad(loss_full, argnums=(0, 1))(hidden, lm_head)
    for a, b in zip(g, g_ref):
        np.testing.assert_allclose(a, b, atol=ATOL, rtol=1e-5)


# A traced temperature may differ from the Python number by an ulp of z = logits / T: XLA
# folds a division by a constant into a multiplication by its rounded reciprocal. Values:
# rtol and atol 1e-6 (up to 9.5e-7 seen, on values ~2). Gradients: ATOL, this file's 1e-5,
# since KL's p (log p - log q - KL) cancels and turns one ulp of z into a few 1e-6 (3.8e-6
# seen). Both figures held with other XLA flags and ISA levels.
TRACED_TOL = 1e-6


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.3])
def test_traced_or_numpy_temperature_equals_the_python_number(temperature):
    """Under jit a temperature may be a traced scalar (a schedule): values and gradients equal
    the Python number's (TRACED_TOL, ATOL), a NumPy scalar or 0-d array is the static number itself
    (bitwise), and the temperature's own gradient equals a float64 NumPy central difference
    (rtol and atol 1e-5; the difference's own error is below 1e-9)."""
    hidden, lm_head, tokens, weights, ref_hidden, mask = make_inputs(seed=15)
    kw = dict(chunk_size=4, vocab_chunk_size=10)
    z64, y64 = f64(hidden) @ f64(lm_head), f64(ref_hidden) @ f64(lm_head)
    m, w64 = np.asarray(mask), f64(weights)
    cases = {
        "logprobs": (
            lambda h, w, t: token_logprobs_from_hidden(h, w, tokens, temperature=t, **kw),
            lambda t: np_token_logprobs(z64, np.asarray(tokens), t),
        ),
        "entropy": (
            lambda h, w, t: entropy_from_hidden(h, w, mask, temperature=t, **kw),
            lambda t: np.where(m, np_entropy(z64, t), 0.0),
        ),
        "kl": (
            lambda h, w, t: kl_from_hidden(h, w, ref_hidden, lm_head, mask, temperature=t, **kw),
            lambda t: np.where(m, np_kl(z64, y64, t), 0.0),
        ),
    }
    tol = dict(rtol=TRACED_TOL, atol=TRACED_TOL)
    for name, (chunked, np_fn) in cases.items():

        def loss(h, w, t, chunked=chunked):
            return jnp.sum(weights * chunked(h, w, t))

        static = jax.jit(lambda h, w, chunked=chunked: chunked(h, w, temperature))
        traced = jax.jit(chunked)(hidden, lm_head, jnp.float32(temperature))
        np.testing.assert_allclose(traced, static(hidden, lm_head), **tol, err_msg=name)
        as_float = chunked(hidden, lm_head, float(np.float32(temperature)))
        for t in (np.float32(temperature), np.asarray(temperature, np.float32)):
            np.testing.assert_array_equal(chunked(hidden, lm_head, t), as_float, err_msg=name)

        g_static = jax.jit(jax.grad(lambda h, w: loss(h, w, temperature), argnums=(0, 1)))(
            hidden, lm_head
        )
        g_traced = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(
            hidden, lm_head, jnp.float32(temperature)
        )
        for a, b in zip(g_static, g_traced[:2]):
            a, b = np.asarray(a), np.asarray(b)
            assert np.isfinite(b).all() and np.abs(b).max() > 0
            np.testing.assert_allclose(b, a, atol=ATOL, err_msg=name)
        eps = 1e-5
        d_t = (np.sum(w64 * np_fn(temperature + eps)) - np.sum(w64 * np_fn(temperature - eps))) / (
            2 * eps
        )
        # float32 against float64: each token's d/dT carries a few ulps of |z / T| <= ~10
        # (9.5e-7), summed with weights of total ~10: ~5e-6 absolute (5.7e-6 seen, for a
        # gradient of 0.97), whatever its size, so atol 1e-5 beside rtol 1e-5.
        np.testing.assert_allclose(g_traced[2], d_t, rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_final_logit_softcap_in_every_chunked_form(temperature):
    """`softcap` c (Gemma 2): every chunked form equals its full-logits definition on
    c tanh(logits / c), in value (float64 NumPy) and in gradient (autodiff through full
    capped logits in jnp), for the policy's cap and a reference's own (`ref_softcap`), a
    static and a traced temperature. Logits reach +-9 here (caps 3 and 5), so the tanh bends
    them far from the identity (checked: the uncapped values differ by > 0.1)."""
    hidden, lm_head, tokens, weights, ref_hidden, mask = make_inputs(seed=21)
    lm_head = 3.0 * lm_head
    kw = dict(chunk_size=4, vocab_chunk_size=10)
    cap, ref_cap = 3.0, 5.0
    z64 = 3.0 * np.tanh(f64(hidden) @ f64(lm_head) / 3.0)
    y64 = 5.0 * np.tanh(f64(ref_hidden) @ f64(lm_head) / 5.0)
    m = np.asarray(mask)

    def capped(h, w, c):
        return c * jnp.tanh(jnp.einsum("ntd,dv->ntv", h, w) / c)

    def np_div(kind):
        lp, lq = np_log_softmax(z64 / temperature), np_log_softmax(y64 / temperature)
        return divergence_of(lp, lq, kind)

    def jnp_div(z, y, kind):
        lp, lq = jax.nn.log_softmax(z, -1), jax.nn.log_softmax(y, -1)
        return divergence_of(lp, lq, kind, xp=jnp)

    cases = {
        "logprobs": (
            lambda h, w, t: token_logprobs_from_hidden(
                h, w, tokens, temperature=t, softcap=cap, **kw
            ),
            lambda h, w, t: jax.nn.log_softmax(capped(h, w, cap) / t, -1)[
                jnp.arange(N)[:, None], jnp.arange(T)[None], tokens
            ],
            np_token_logprobs(z64, np.asarray(tokens), temperature),
        ),
        "entropy": (
            lambda h, w, t: entropy_from_hidden(h, w, mask, temperature=t, softcap=cap, **kw),
            lambda h, w, t: jnp.where(
                mask,
                -jnp.sum(
                    jax.nn.softmax(capped(h, w, cap) / t, -1)
                    * jax.nn.log_softmax(capped(h, w, cap) / t, -1),
                    -1,
                ),
                0.0,
            ),
            np.where(m, np_entropy(z64, temperature), 0.0),
        ),
    }
    for kind in ("reverse_kl", "forward_kl", "jsd"):
        extra = dict(beta=0.5) if kind == "jsd" else {}
        cases[kind] = (
            lambda h, w, t, kind=kind, extra=extra: divergence_from_hidden(
                h,
                w,
                ref_hidden,
                lm_head,
                mask,
                divergence=kind,
                temperature=t,
                softcap=cap,
                ref_softcap=ref_cap,
                **extra,
                **kw,
            ),
            lambda h, w, t, kind=kind: jnp.where(
                mask,
                jnp_div(capped(h, w, cap) / t, capped(ref_hidden, lm_head, ref_cap) / t, kind),
                0.0,
            ),
            np.where(m, np_div(kind), 0.0),
        )
    uncapped = np_token_logprobs(f64(hidden) @ f64(lm_head), np.asarray(tokens), temperature)
    assert np.abs(uncapped - cases["logprobs"][2]).max() > 0.1
    for name, (chunked, full, want) in cases.items():
        for t in (temperature, jnp.float32(temperature)):
            got = jax.jit(chunked)(hidden, lm_head, t)
            np.testing.assert_allclose(np.asarray(got), want, atol=ATOL, err_msg=name)
            g_got = jax.grad(
                lambda h, w, fn=chunked, t=t: jnp.sum(weights * fn(h, w, t)), argnums=(0, 1)
            )(hidden, lm_head)
            g_want = jax.grad(
                lambda h, w, fn=full, t=t: jnp.sum(weights * fn(h, w, t)), argnums=(0, 1)
            )(hidden, lm_head)
            # Tiled against full (other orders), gradients up to ~12 (ulp 9.5e-7, 4.7e-6
            # seen): rtol 1e-5 as this file's other tiled-gradient checks.
            for a, b in zip(g_want, g_got):
                np.testing.assert_allclose(
                    np.asarray(b), np.asarray(a), atol=ATOL, rtol=1e-5, err_msg=name
                )


def test_chunked_program_never_materialises_full_logits():
    """The gradient programs' temporary bytes at M and 4M tokens: the naive path's grow by at
    least the [M, V] float32 logits, the chunked paths' by far less. Growth, not one size: the
    part constant in M is 3.6 MiB on XLA:CPU for logprobs but 36 MiB on an H100 (buffers shaped
    like the LM head), over 1/16 of the logits at M = 2048 yet the same at M = 8192."""
    v, d = 32768, 64
    k1, k2, k3 = jax.random.split(jax.random.key(14), 3)
    lm_head = jax.random.normal(k2, (d, v)) * 0.1

    def temp_bytes(m):
        hidden = jax.random.normal(k1, (m, d))
        tokens = jax.random.randint(k3, (m,), 0, v)
        fns = {
            "naive": lambda h, w: token_logprobs(h @ w, tokens),
            "logprobs": lambda h, w: token_logprobs_from_hidden(
                h, w, tokens, chunk_size=256, vocab_chunk_size=2048
            ),
            "entropy": lambda h, w: entropy_from_hidden(
                h, w, chunk_size=256, vocab_chunk_size=2048
            ),
            "kl": lambda h, w: kl_from_hidden(
                h, w, 0.5 * h, w, chunk_size=256, vocab_chunk_size=2048
            ),
            "jsd": lambda h, w: divergence_from_hidden(
                h,
                w,
                0.5 * h,
                w,
                divergence="jsd",
                beta=0.5,
                chunk_size=256,
                vocab_chunk_size=2048,
            ),
        }
        out = {}
        for name, fn in fns.items():
            grad = jax.jit(jax.grad(lambda h, w, fn=fn: jnp.sum(fn(h, w)), argnums=(0, 1)))
            out[name] = grad.lower(hidden, lm_head).compile().memory_analysis().temp_size_in_bytes
        return out

    m = 2048
    small, large = temp_bytes(m), temp_bytes(4 * m)
    logits_growth = 3 * m * v * 4  # 768 MiB more logits from M to 4M
    # The measure sees the naive path's full logits ...
    assert large["naive"] - small["naive"] >= logits_growth
    # ... and the chunked programs' bytes grow with M by far less: the [M, D] rows (0.5 MiB per
    # 2,048 tokens each), while the tiles (256 x 2048 x 4 B = 2 MiB) stay as they are.
    for name in ("logprobs", "entropy", "kl", "jsd"):
        assert large[name] - small[name] < logits_growth / 16, (name, small[name], large[name])


# ------------------------------------------------------------------ errors


def test_bad_inputs_raise_clear_errors():
    hidden, lm_head, tokens, _, _, _ = make_inputs()
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(hidden @ lm_head, tokens, temperature=0.0)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs_from_hidden(hidden, lm_head, tokens, temperature=-1.0)
    with pytest.raises(ValueError, match=r"^temperature must be a finite number > 0, got"):
        entropy_from_hidden(hidden, lm_head, temperature=np.float32(0.0))
    with pytest.raises(
        ValueError, match=r"^temperature must be a number > 0 or a 0-d array, got shape \(2,\)$"
    ):
        token_logprobs_from_hidden(hidden, lm_head, tokens, temperature=jnp.ones(2))
    with pytest.raises(ValueError, match="chunk_size"):
        token_logprobs_from_hidden(hidden, lm_head, tokens, chunk_size=0)
    with pytest.raises(ValueError, match="vocab_chunk_size"):
        entropy_from_hidden(hidden, lm_head, vocab_chunk_size=2.5)
    with pytest.raises(ValueError, match=r"embedding_vd\.T"):
        token_logprobs_from_hidden(hidden, lm_head.T, tokens)
    with pytest.raises(ValueError, match="tokens_nt"):
        token_logprobs_from_hidden(hidden, lm_head, tokens[:, :-1])
    with pytest.raises(ValueError, match="integer"):
        token_logprobs_from_hidden(hidden, lm_head, tokens.astype(jnp.float32))
    with pytest.raises(ValueError, match="mask_nt"):
        entropy(hidden @ lm_head, jnp.ones((N, T + 1), bool))
    with pytest.raises(ValueError, match="vocabularies"):
        kl_from_hidden(hidden, lm_head, hidden, lm_head[:, :-1])
    with pytest.raises(ValueError, match="same shape"):
        full_kl(hidden @ lm_head, (hidden @ lm_head)[..., :-1])
