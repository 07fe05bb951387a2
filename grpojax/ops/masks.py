"""Masks from lengths and masked reductions: the building blocks every other op reduces with.

Masks are always built from lengths, never from `token != pad_id` (pad may equal eos,
and the EOS that ends a completion is part of it). A mask is any array broadcastable to
its data, of bool or {0, 1} floats; reductions cast it to float32.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import Array

from grpojax.ops.checks import check_int, check_shape


def mask_from_lengths(lengths_n: Array, max_len: int, *, offset_n: Array | None = None) -> Array:
    """Boolean mask `[N, T]` true at `offset_n[n] <= t < offset_n[n] + lengths_n[n]`.

    Args:
      lengths_n: `[N]` integer lengths (number of real tokens per row): an array, or a list,
        tuple or NumPy array of numbers.
      max_len: `T`, the padded width (a static int >= 0).
      offset_n: optional `[N]` start index (left padding / prompt length); default 0.

    Examples:
      >>> import jax.numpy as jnp
      >>> import grpojax as gj
      >>> print(gj.mask_from_lengths(jnp.array([1, 2]), 3, offset_n=jnp.array([1, 0])))
      [[False  True False]
       [ True  True False]]
    """
    check_int("max_len", max_len, minimum=0)
    lengths = jnp.asarray(lengths_n)
    check_shape("lengths_n", lengths.shape, [(None,)], "1-D [N], one length per row")
    if offset_n is None:
        start = jnp.zeros_like(lengths)
    else:
        start = jnp.asarray(offset_n)
        check_shape("offset_n", start.shape, [lengths.shape], f"[N] like lengths_n {lengths.shape}")
    t = jnp.arange(max_len)[None, :]
    start = start[:, None]
    return (t >= start) & (t < start + lengths[:, None])


def masked_sum(x: Array, mask: Array, axis=None) -> Array:
    """sum(x * mask) over `axis` in float32; masked entries contribute exactly zero (even NaN).

    Examples:
      >>> import jax.numpy as jnp
      >>> import grpojax as gj
      >>> x = jnp.array([[1.0, 2.0, jnp.nan], [4.0, 5.0, 6.0]])
      >>> print(gj.masked_sum(x, jnp.array([[1, 1, 0], [1, 0, 0]]), axis=-1))  # NaN is masked out
      [3. 4.]
    """
    x = jnp.asarray(x, jnp.float32)
    m = jnp.broadcast_to(jnp.asarray(mask, jnp.bool_), x.shape)
    return jnp.sum(jnp.where(m, x, 0.0), axis=axis)


def masked_mean(x: Array, mask: Array, axis=None) -> Array:
    """sum(x * mask) / max(sum(mask), 1) over `axis`, float32. An empty mask gives 0, not NaN.

    Examples:
      >>> import jax.numpy as jnp
      >>> import grpojax as gj
      >>> x = jnp.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
      >>> print(gj.masked_mean(x, jnp.array([[1, 1, 0], [0, 0, 0]]), axis=-1))  # empty row: 0
      [1.5 0. ]
    """
    x = jnp.asarray(x, jnp.float32)
    count = masked_sum(jnp.ones_like(x), mask, axis=axis)
    return masked_sum(x, mask, axis=axis) / jnp.maximum(count, 1.0)


def masked_var(x: Array, mask: Array, axis=None, *, unbiased: bool = False) -> Array:
    """Masked variance over `axis`, float32: population (divide by n) or unbiased (n - 1).

    With fewer entries than the divisor needs (n = 0, or n = 1 when unbiased) gives 0.
    Masked entries are replaced by 0 before any arithmetic, so NaN or inf there reaches
    neither the value nor the gradient.

    Examples:
      >>> import jax.numpy as jnp
      >>> import grpojax as gj
      >>> x, m = jnp.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]), jnp.array([[1, 0, 1], [1, 1, 0]])
      >>> print(gj.masked_var(x, m, axis=-1))  # population: divide by n
      [1.   0.25]
      >>> print(gj.masked_var(x, m, axis=-1, unbiased=True))  # divide by n - 1
      [2.  0.5]
    """
    x = jnp.asarray(x, jnp.float32)
    x = jnp.where(jnp.broadcast_to(jnp.asarray(mask, jnp.bool_), x.shape), x, 0.0)
    count = masked_sum(jnp.ones_like(x), mask, axis=axis)
    mean = masked_mean(x, mask, axis=axis)
    if axis is not None:
        mean = jnp.expand_dims(mean, axis)
    sq = masked_sum(jnp.square(x - mean), mask, axis=axis)
    denom = count - 1.0 if unbiased else count
    return jnp.where(denom > 0, sq / jnp.maximum(denom, 1.0), 0.0)


# The one prompt-width rule of the library (sampler, prompt source, SFT encoding, trainer
# batches): short prompts in multiples of 8 (little padding), powers of two above 64.
PROMPT_BUCKET = "compact"
MIN_PROMPT_WIDTH = 8


def prompt_width(length: int) -> int:
    """The padded prompt width P for a longest prompt of `length` tokens (the one rule)."""
    return padded_width(length, bucket=PROMPT_BUCKET, min_width=MIN_PROMPT_WIDTH)


def padded_width(length: int, *, bucket: int | str = "pow2", min_width: int = 1) -> int:
    """The padded width for a longest row of `length` tokens (a static shape, not an array op).

    Rows whose longest length lands in the same bucket share a shape, hence one compiled
    program downstream. `bucket`:
      "pow2": the next power of two >= max(length, min_width);
      an int m: the next multiple of m >= max(length, min_width);
      "compact": multiples of 8 up to 64 (short prompts waste little padding), powers of
        two above (long prompts of varied length share a few programs).
    """
    if isinstance(bucket, bool) or not (
        bucket in ("pow2", "compact") or (isinstance(bucket, int) and bucket >= 1)
    ):
        raise ValueError(f"bucket must be 'pow2', 'compact' or an int >= 1, got {bucket!r}")
    check_int("min_width", min_width)
    length = max(int(length), min_width)
    if bucket == "compact":
        bucket = 8 if length <= 64 else "pow2"
    if bucket == "pow2":
        return 1 << (length - 1).bit_length()
    step = int(bucket)  # an int >= 1 (checked above)
    return -(-length // step) * step
