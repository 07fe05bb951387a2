"""Loss aggregation: reduce an unreduced `[N, T]` loss to a scalar, the way each recipe does.

The recipes (PPO/GRPO token-mean, the original GRPO per-sequence mean, Dr.GRPO's constant
normaliser) differ only in how tokens and sequences are weighted. Each mode is written
as numerator / denominator with both parts *sums* over the batch, so that

    sum over micro-batches of numerators / sum over micro-batches of denominators

is exactly the full-batch value, and scaling each micro-batch's numerator by the full
batch's denominator (`aggregate(..., denominator=global_den)`) gives gradients that sum
to the full-batch gradient.

A row whose mask is all false (batch padding) is not a sequence: no mode counts it. To
drop a sequence *without* changing the normalisation (e.g. DeepSeek-V3.2 off-policy
masking, where the 1/G stays), multiply its loss by 0 instead of masking it out.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import Array

from grpojax.ops.checks import check_choice, check_number
from grpojax.ops.masks import masked_sum

AGGREGATION_MODES = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)


def _check_mode(mode: str, norm_constant) -> None:
    check_choice("mode", mode, AGGREGATION_MODES)
    if mode == "seq-mean-token-sum-norm":
        if norm_constant is None:
            raise ValueError(
                "mode='seq-mean-token-sum-norm' needs norm_constant (e.g. the maximum "
                "completion length), got None"
            )
        check_number("norm_constant", norm_constant, minimum=0, strict=True)


def _safe_divide(num: Array, den: Array) -> Array:
    # Double where: an empty batch gives 0 (its numerator is 0) and a finite gradient.
    den = jnp.asarray(den, jnp.float32)
    ok = den > 0
    return jnp.where(ok, num / jnp.where(ok, den, 1.0), 0.0)


def aggregate_parts(
    loss_nt: Array, mask_nt: Array, *, mode: str, norm_constant: float | None = None
) -> tuple[Array, Array]:
    """(numerator, denominator) of the aggregated loss; `aggregate` is their ratio.

    With l_{i,t} the loss, m_{i,t} the mask, S_i = sum_t m_{i,t} l_{i,t},
    n_i = sum_t m_{i,t} and K = #{i : n_i > 0} (non-empty sequences):

    - "token-mean":              sum_i S_i           / sum_i n_i
    - "seq-mean-token-mean":     sum_{n_i>0} S_i/n_i / K
    - "seq-mean-token-sum":      sum_i S_i           / K
    - "seq-mean-token-sum-norm": sum_i S_i           / (K * norm_constant)   (Dr.GRPO)

    Both parts are sums over sequences, so they add across micro-batches.

    Args:
      loss_nt: `[N, T]` unreduced loss (any leading axes before T are summed over).
      mask_nt: `[N, T]` real tokens.
      mode: one of `AGGREGATION_MODES`.
      norm_constant: > 0, required by "seq-mean-token-sum-norm" (e.g. the maximum
        completion length); ignored by the other modes.

    Returns:
      (numerator, denominator), float32 scalars.

    Examples:
      >>> import jax.numpy as jnp
      >>> import grpojax as gj
      >>> loss = jnp.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
      >>> num, den = gj.aggregate_parts(loss, jnp.array([[1, 1, 0], [1, 1, 1]]), mode="token-mean")
      >>> print(float(num), float(den))  # 1 + 2 + 4 + 5 + 6, and 5 real tokens
      18.0 5.0
    """
    _check_mode(mode, norm_constant)
    loss = jnp.asarray(loss_nt, jnp.float32)
    mask = jnp.broadcast_to(jnp.asarray(mask_nt, jnp.bool_), loss.shape)
    seq_sum_n = masked_sum(loss, mask, axis=-1)
    seq_len_n = jnp.sum(mask, axis=-1, dtype=jnp.float32)
    if mode == "token-mean":
        return jnp.sum(seq_sum_n), jnp.sum(seq_len_n)
    nonempty_n = seq_len_n > 0
    num_seqs = jnp.sum(nonempty_n, dtype=jnp.float32)
    if mode == "seq-mean-token-mean":
        seq_mean_n = jnp.where(nonempty_n, seq_sum_n / jnp.maximum(seq_len_n, 1.0), 0.0)
        return jnp.sum(seq_mean_n), num_seqs
    if mode == "seq-mean-token-sum":
        return jnp.sum(seq_sum_n), num_seqs
    return jnp.sum(seq_sum_n), num_seqs * jnp.asarray(norm_constant, jnp.float32)


def aggregate(
    loss_nt: Array,
    mask_nt: Array,
    *,
    mode: str,
    norm_constant: float | None = None,
    denominator: Array | float | None = None,
) -> Array:
    """Aggregated scalar loss: numerator / denominator of `aggregate_parts`.

    With `denominator=None` this is the value of the given batch alone. For gradient
    accumulation, pass the *full* batch's denominator (the sum of `aggregate_parts(...)[1]`
    over all micro-batches, computed before the backward passes): then each micro-batch
    returns numerator_mb / denominator_full, and these values and their gradients sum
    exactly to the full-batch loss and gradient. A denominator <= 0 gives 0.

    Args:
      loss_nt: `[N, T]` unreduced loss.
      mask_nt: `[N, T]` real tokens.
      mode: as in `aggregate_parts`.
      norm_constant: as in `aggregate_parts`.
      denominator: optional scalar overriding this batch's own denominator.

    Returns:
      float32 scalar.

    Examples:
      >>> import jax.numpy as jnp
      >>> import grpojax as gj
      >>> loss = jnp.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
      >>> m = jnp.array([[1, 1, 0], [1, 1, 1]])
      >>> round(float(gj.aggregate(loss, m, mode="token-mean")), 4)  # 18 / 5
      3.6
      >>> round(float(gj.aggregate(loss, m, mode="seq-mean-token-mean")), 4)  # (1.5 + 5) / 2
      3.25
    """
    num, den = aggregate_parts(loss_nt, mask_nt, mode=mode, norm_constant=norm_constant)
    return _safe_divide(num, den if denominator is None else jnp.asarray(denominator))


__all__ = ["AGGREGATION_MODES", "aggregate", "aggregate_parts"]
