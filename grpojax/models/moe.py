"""Mixture-of-experts MLP (Qwen3-MoE, Mixtral): a softmax router, top-k experts per token,
SwiGLU experts computed with one grouped matmul per projection (`jax.lax.ragged_dot`).

For a token x `[D]` with router weights W_r `[D, E]`:

    p = softmax(x W_r)                      (float32, over the E experts)
    S = top_k(p)                            (k expert ids; `selected_ntk` replays given ones)
    w_e = p_e, or p_e / sum_{j in S} p_j    (`norm_topk_prob`), for e in S
    y = sum_{e in S} w_e * (silu(x G_e) * (x U_e)) D_e

with expert weights G_e, U_e `[D, F_e]` and D_e `[F_e, D]`. Dispatch is dropless: the M*k
(token, expert) pairs are sorted by expert, each expert's contiguous group goes through
`ragged_dot` against that expert's weights (no capacity, no token dropped, no [M, E]
one-hot matmul), and the outputs are un-sorted and summed with their weights. Padding
tokens are routed like the others; their outputs are masked downstream as everywhere else.
(On a CPU, JAX lowers `ragged_dot` to a masked product over every expert: E times the
experts' FLOPs and memory there; GPUs and TPUs run it as a ragged dot.)

Load balancing (Switch Transformer's auxiliary loss, as transformers computes it; tested
against its Qwen3-MoE `aux_loss`): over the real tokens of every layer, with M token-layers,
f_e = (assignments to expert e) / M (k assignments a token, so sum_e f_e = k) and
P_e = the mean router probability of e,

    L_aux = E * sum_e f_e * P_e             (k when the load and the probabilities are uniform)

`moe_mlp` returns each layer's sums (`ExpertLoad`); `load_balancing_loss` turns their total
over layers (and forwards) into L_aux.

Routing replay: `moe_mlp(..., selected_ntk=S)` uses the given expert ids instead of the top
k (the weights w are still the router's probabilities at those ids, so the router gets its
gradient); S is what a previous forward returned, e.g. the sampler's.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import Array


class ExpertLoad(NamedTuple):
    """Sums over real tokens (and layers, once added up): `counts_e` `[E]` assignments to
    each expert, `probs_e` `[E]` router probabilities, `tokens` [] how many token-layers."""

    counts_e: Array
    probs_e: Array
    tokens: Array


class Routing(NamedTuple):
    """A forward's routing (`Decoder(..., return_routing=True)`): `experts_ntlk`
    `[N, T, L, k]` int32, the experts each token went to in each layer; `load`, the
    `ExpertLoad` summed over the layers (`load_balancing_loss(load)`: L_aux)."""

    experts_ntlk: Array
    load: ExpertLoad


def load_balancing_loss(load: ExpertLoad) -> Array:
    """L_aux = E * sum_e (counts_e / tokens) * (probs_e / tokens) (the module docstring);
    float32 []."""
    tokens = jnp.maximum(load.tokens, 1.0)
    e = load.counts_e.shape[-1]
    return e * jnp.sum((load.counts_e / tokens) * (load.probs_e / tokens))


def route(
    x_md: Array, w_router_de: Array, k: int, norm_topk_prob: bool, selected_mk: Array | None = None
) -> tuple[Array, Array, Array]:
    """(weights `[M, k]` float32, expert ids `[M, k]` int32, probabilities `[M, E]` float32)
    of M tokens `[M, D]`.

    The router's logits are accumulated in float32 and its softmax taken in float32, as
    transformers does; the top k in descending probability (ties: the lower id first).
    """
    logits = jnp.einsum(
        "md,de->me", x_md, w_router_de.astype(x_md.dtype), preferred_element_type=jnp.float32
    )
    probs = jax.nn.softmax(logits, axis=-1)
    if selected_mk is None:
        weights, selected_mk = jax.lax.top_k(probs, k)
    else:
        weights = jnp.take_along_axis(probs, selected_mk, axis=-1)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, selected_mk.astype(jnp.int32), probs


def moe_mlp(
    x_ntd: Array,
    w_router_de: Array,
    w_gate_edf: Array,
    w_up_edf: Array,
    w_down_efd: Array,
    *,
    k: int,
    norm_topk_prob: bool,
    selected_ntk: Array | None = None,
    mask_nt: Array | None = None,
) -> tuple[Array, Array, ExpertLoad]:
    """(y `[N, T, D]` in x's dtype, expert ids `[N, T, k]` int32, this layer's `ExpertLoad`
    over the tokens `mask_nt` marks real (None: all)): the module docstring's y for every
    token. Expert weights are cast to x's dtype; the grouped matmuls accumulate in float32
    and the k weighted outputs are summed in float32."""
    n, t, d = x_ntd.shape
    e = w_gate_edf.shape[0]
    dtype = x_ntd.dtype
    x_md = x_ntd.reshape(n * t, d)
    replay = None if selected_ntk is None else selected_ntk.reshape(n * t, k)
    weights_mk, selected_mk, probs_me = route(x_md, w_router_de, k, norm_topk_prob, replay)
    real_m = (
        jnp.ones((n * t,), jnp.float32)
        if mask_nt is None
        else mask_nt.reshape(n * t).astype(jnp.float32)
    )
    load = ExpertLoad(
        counts_e=jnp.zeros((e,), jnp.float32)
        .at[selected_mk.reshape(-1)]
        .add(jnp.repeat(real_m, k)),
        probs_e=jnp.einsum("me,m->e", probs_me, real_m),
        tokens=jnp.sum(real_m),
    )
    flat = selected_mk.reshape(-1)  # [M*k], pair j is token j // k
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    xs = jnp.take(x_md, order // k, axis=0)  # [M*k, D], grouped by expert

    def grouped(a, w):
        out = jax.lax.ragged_dot(a, w.astype(dtype), sizes, preferred_element_type=jnp.float32)
        return out.astype(dtype)

    h = jax.nn.silu(grouped(xs, w_gate_edf)) * grouped(xs, w_up_edf)
    ys = jax.lax.ragged_dot(h, w_down_efd.astype(dtype), sizes, preferred_element_type=jnp.float32)
    y_mkd = jnp.take(ys, jnp.argsort(order), axis=0).reshape(n * t, k, d)
    y_md = jnp.einsum("mkd,mk->md", y_mkd, weights_mk.astype(dtype).astype(jnp.float32))
    return y_md.astype(dtype).reshape(n, t, d), selected_mk.reshape(n, t, k), load
