"""Sampling transforms: greedy, temperature, top-k, top-p, min-p on float32 logits `[N, V]`.

`sample_tokens` draws one token per row and returns its logprob under the distribution it
was actually drawn from (temperature applied, truncated, renormalised), together with what a
trainer needs to apply the same truncation later (DeepSeek-V3.2's "keep sampling mask").

The kept set is always an *upper set* of the scaled logits z = logits / temperature:

    keep_v  <=>  z_v >= tau          (tau: the kept-set threshold, one scalar per token)

so it is described exactly by one float (`keep_threshold`, tau) or one integer
(`keep_count`, |{v : z_v >= tau}|). Ties at the boundary are all kept (top-k may keep more
than k tokens when the k-th largest logit is tied), which is what makes the set rebuildable
from either number. Truncations compose in Hugging Face's order: temperature, then top-k,
then top-p on the renormalised top-k distribution, then min-p; the final tau is the largest of
the individual thresholds.

A trainer applies the same truncation to the policy it trains (pi_theta) per token:

    keep_ntv = keep_mask_from_count(logits_ntv, rollout.keep_count_nt)   # rank-based, or
    keep_ntv = keep_mask_from_threshold(logits_ntv, rollout.keep_threshold_nt, temperature=T)
    logp_nt = kept_logprobs(logits_theta_ntv, tokens_nt, keep_ntv, temperature=T)

where `logits_ntv` are the behaviour policy's logits (the sampler's; recomputed with the old
parameters they agree to rounding, and the rank-based rebuild is immune to that rounding).
The helpers take any leading dimensions, so they can run per chunk of tokens to keep the
`[.., V]` mask small. Without truncation keep_count = V and tau = -inf: the mask is all True.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import Array

from grpojax.ops.checks import check_int, check_number
from grpojax.ops.logprobs import keep_mask_from_count, kept_logprobs

__all__ = [
    "SampleOutput",
    "SamplingConfig",
    "categorical",
    "first_argmax",
    "keep_mask_from_count",
    "keep_mask_from_threshold",
    "kept_logprobs",
    "sample_tokens",
]


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How the next token is drawn. Hashable, so it can be a static jit argument. A run
    (`grpojax train`) trains on truncated samples (top_k, top_p, min_p) in one of two ways:
    the built-in engines with `grpo.use_keep_mask=true` (the trainer renormalises its policy
    over the sampler's kept set, exactly), or `rollout.engine=vllm` with its rollout
    correction (the trainer's policy stays the full one, and each token is weighed by
    pi_old / mu, mu being vLLM's truncated distribution; docs/how-to/vllm.md).

    Attributes:
      temperature: z = logits / temperature. `0.0` means greedy (argmax), whatever the
        truncation fields say.
      top_k: keep the k largest z (ties at the k-th value kept too). `0` disables.
      top_p: nucleus: keep the smallest prefix of the sorted (top-k renormalised)
        distribution whose mass reaches `top_p`. `1.0` disables.
      min_p: keep tokens with p_v >= min_p * max_v p_v. `0.0` disables.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self):
        check_number("temperature", self.temperature, minimum=0, array_ok=False)
        check_int("top_k", self.top_k, minimum=0)
        check_number("top_p", self.top_p, minimum=0, maximum=1, strict=True, array_ok=False)
        check_number("min_p", self.min_p, minimum=0, maximum=1, strict_max=True, array_ok=False)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def truncates(self) -> bool:
        """Whether any truncation (top-k, top-p, min-p) is active."""
        return (not self.greedy) and (self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0)


class SampleOutput(NamedTuple):
    """One sampled token per row.

    token_n: `[N]` int32 sampled token.
    logp_n: `[N]` f32 log-probability of `token_n` under the distribution it was drawn from:
      z_tok - logsumexp_{v kept} z_v. Greedy: 0 (a point mass).
    keep_count_n: `[N]` int32 size of the kept set (V without truncation, 1 for greedy).
    keep_threshold_n: `[N]` f32 tau, the smallest kept scaled logit (-inf without
      truncation; the max logit for greedy).
    """

    token_n: Array
    logp_n: Array
    keep_count_n: Array
    keep_threshold_n: Array


def _threshold(z_nv: Array, config: SamplingConfig) -> Array:
    """tau `[N]` of the composed top-k / top-p / min-p truncation of scaled logits `z_nv`."""
    n, v = z_nv.shape
    tau_n = jnp.full((n,), -jnp.inf, jnp.float32)
    if config.top_k > 0 or config.top_p < 1.0:
        k = min(config.top_k, v) if config.top_k > 0 else v
        # Only the k largest matter for top-p after top-k, so sort k values, not V.
        sorted_nk, _ = jax.lax.top_k(z_nv, k)
        if config.top_k > 0:
            tau_n = jnp.maximum(tau_n, sorted_nk[:, k - 1])
        if config.top_p < 1.0:
            probs_nk = jax.nn.softmax(sorted_nk, axis=-1)
            mass_before_nk = jnp.cumsum(probs_nk, axis=-1) - probs_nk
            # Position i is kept while the mass strictly before it is below top_p; i = 0 always.
            n_keep = jnp.maximum(jnp.sum(mass_before_nk < config.top_p, axis=-1), 1)
            tau_p = jnp.take_along_axis(sorted_nk, (n_keep - 1)[:, None], axis=-1)[:, 0]
            tau_n = jnp.maximum(tau_n, tau_p)
    if config.min_p > 0.0:
        # p_v >= min_p * p_max  <=>  z_v >= z_max + log(min_p); renormalisation cancels.
        tau_n = jnp.maximum(tau_n, jnp.max(z_nv, axis=-1) + math.log(config.min_p))
    return tau_n


def first_argmax(x_nv: Array) -> Array:
    """`[N]` int32 index of the first largest entry of each row: `jnp.argmax(x, -1)` exactly,
    NaN included (a row holding NaN gives its first NaN).

    Two plain reductions, m = max_v x[v] and then min_v where(x[v] == m, v, V): XLA:CPU runs
    `jnp.argmax`'s (value, index) pair reduction as a scalar loop, about 3x the Gumbel draw
    it follows at the sampler's [32, 512] (docs/performance/step-time.md).
    """
    v = x_nv.shape[-1]
    top_n1 = jnp.max(x_nv, axis=-1, keepdims=True)
    at_top = (x_nv == top_n1) | jnp.isnan(x_nv)
    iota = jax.lax.broadcasted_iota(jnp.int32, x_nv.shape, x_nv.ndim - 1)
    return jnp.min(jnp.where(at_top, iota, v), axis=-1)


def _key_rows(key: Array) -> int | None:
    """The number of keys in a batch of keys (`[N]` typed or `[N, 2]` raw), None for one key."""
    typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    ndim = key.ndim if typed else key.ndim - 1
    return key.shape[0] if ndim == 1 else None


def categorical(key: Array, z_nv: Array) -> Array:
    """`[N]` int32 draws from softmax(z) per row by the Gumbel-max trick,
    `first_argmax(z + gumbel(key, z.shape))`: the same noise and the same argmax as
    `jax.random.categorical(key, z, axis=-1)`, so the same key gives the same tokens.
    `key` may also be `[N]` keys, row n's noise drawn from key n alone."""
    rows = _key_rows(key)
    if rows is None:
        noise = jax.random.gumbel(key, z_nv.shape, z_nv.dtype)
    elif rows == z_nv.shape[0]:
        noise = jax.vmap(lambda k: jax.random.gumbel(k, z_nv.shape[1:], z_nv.dtype))(key)
    else:
        raise ValueError(f"key must be one key or one per row ({z_nv.shape[0]}), got {rows}")
    return first_argmax(z_nv + noise)


def sample_tokens(logits_nv: Array, key: Array, *, config: SamplingConfig) -> SampleOutput:
    """Draw token_n ~ softmax(where(z >= tau, z, -inf)) with z = logits / temperature.

    Args:
      logits_nv: `[N, V]` logits (cast to float32).
      key: a `jax.random` key, one draw per row from it; or `[N]` keys, one per row.
      config: the `SamplingConfig` (static).

    Returns:
      `SampleOutput` with token, logprob under the sampled distribution, and the kept-set
      size and threshold (see the module docstring for how a trainer rebuilds the mask).
    """
    logits_nv = jnp.asarray(logits_nv, jnp.float32)
    if logits_nv.ndim != 2:
        raise ValueError(f"logits must be [N, V], got shape {logits_nv.shape}")
    n, v = logits_nv.shape
    if config.greedy:
        token_n = first_argmax(logits_nv)
        return SampleOutput(
            token_n=token_n,
            logp_n=jnp.zeros((n,), jnp.float32),
            keep_count_n=jnp.ones((n,), jnp.int32),
            keep_threshold_n=jnp.max(logits_nv, axis=-1),
        )
    z_nv = logits_nv / jnp.float32(config.temperature)
    if config.truncates:
        tau_n = _threshold(z_nv, config)
        keep_nv = z_nv >= tau_n[:, None]
        z_nv = jnp.where(keep_nv, z_nv, -jnp.inf)
        count_n = jnp.sum(keep_nv, axis=-1, dtype=jnp.int32)
    else:
        tau_n = jnp.full((n,), -jnp.inf, jnp.float32)
        count_n = jnp.full((n,), v, jnp.int32)
    token_n = categorical(key, z_nv)
    z_tok_n = jnp.take_along_axis(z_nv, token_n[:, None], axis=-1)[:, 0]
    logp_n = z_tok_n - jax.nn.logsumexp(z_nv, axis=-1)
    return SampleOutput(token_n, logp_n, count_n, tau_n)


def keep_mask_from_threshold(
    logits_ntv: Array, keep_threshold_nt: Array, *, temperature: float = 1.0
) -> Array:
    """Kept-set mask `[..., V]` bool: logits / temperature >= tau.

    Exact when `logits_ntv` are the sampler's own logits (the behaviour policy's). On
    recomputed logits that differ from the sampler's by rounding, a token sitting exactly at
    the boundary can flip; `keep_mask_from_count` is rank-based and immune to that.

    Args:
      logits_ntv: `[..., V]` logits (e.g. `[N, T, V]`).
      keep_threshold_nt: `[...]` the recorded tau (`Rollout.keep_threshold_nt`).
      temperature: the sampling temperature (> 0).
    """
    check_number("temperature", temperature, minimum=0, strict=True)
    z = jnp.asarray(logits_ntv, jnp.float32) / jnp.float32(temperature)
    return z >= jnp.asarray(keep_threshold_nt, jnp.float32)[..., None]
