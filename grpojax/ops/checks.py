"""Validation shared by the ops: one wording for every error.

Hyperparameters: only concrete Python/NumPy values are checked; a 0-d array (a traced or
scheduled value passed into a jitted step) passes through, since it cannot be inspected at
trace time. Array arguments: shapes are static, so they are checked under `jit` too.
"""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np


def check_choice(name: str, value, allowed: tuple[str, ...]) -> None:
    """Raise `ValueError` naming `name` and the allowed values unless `value in allowed`."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {tuple(allowed)}, got {value!r}")


def check_int(name: str, value, *, minimum: int = 1, none_ok: bool = False) -> None:
    """Require a Python/NumPy int (not a bool) >= `minimum` (or None when `none_ok`)."""
    if value is None and none_ok:
        return
    integral = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if not (integral and int(value) >= minimum):
        allowed = f"{'None or ' if none_ok else ''}an int >= {minimum}"
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def check_number(
    name: str,
    value,
    *,
    minimum: float = -math.inf,
    maximum: float = math.inf,
    strict: bool = False,
    strict_max: bool = False,
    none_ok: bool = False,
    array_ok: bool = True,
) -> None:
    """Require a finite real in `[minimum, maximum]`.

    `strict` excludes `minimum` (`> minimum`), `strict_max` excludes `maximum`
    (`< maximum`): e.g. `minimum=0, maximum=1, strict_max=True` is `[0, 1)`.
    `none_ok` also accepts None (an option that is off); `array_ok` lets a 0-d array pass
    unchecked.
    """
    if value is None and none_ok:
        return
    if array_ok and isinstance(value, jax.Array | np.ndarray) and value.ndim == 0:
        return
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if ok:
        v = float(value)
        ok = (
            math.isfinite(v)
            and (v > minimum if strict else v >= minimum)
            and (v < maximum if strict_max else v <= maximum)
        )
    if not ok:
        bounds = []
        if minimum != -math.inf:
            bounds.append(f"{'>' if strict else '>='} {minimum:g}")
        if maximum != math.inf:
            bounds.append(f"{'<' if strict_max else '<='} {maximum:g}")
        allowed = f"{'None or ' if none_ok else ''}a finite number {' and '.join(bounds)}"
        raise ValueError(f"{name} must be {allowed.rstrip()}, got {value!r}")


def check_shape(name: str, shape, allowed, want: str, *, broadcast: bool = False) -> None:
    """Raise `ValueError` naming `name` and `want` unless `shape` fits one of `allowed`.

    A shape fits an allowed shape of the same rank whose every size is equal to it, or is
    None (any size); with `broadcast`, a size of 1 also fits (it broadcasts). `want` says
    what is allowed in the docstring's letters, e.g. "[N] or [N, T] matching logp_nt".
    """
    shape = tuple(shape)
    for ok in allowed:
        if len(ok) == len(shape) and all(
            a is None or a == s or (broadcast and s == 1) for s, a in zip(shape, ok)
        ):
            return
    raise ValueError(f"{name} must be {want}, got shape {shape}")


def broadcast_mask(name: str, mask, shape) -> jax.Array:
    """`mask` as a bool array broadcast to `shape`; a `ValueError` naming `name` if it cannot be."""
    m = jnp.asarray(mask, jnp.bool_)
    shape = tuple(shape)
    try:
        ok = np.broadcast_shapes(m.shape, shape) == shape
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"{name} must be a mask broadcastable to {shape}, got shape {m.shape}")
    return jnp.broadcast_to(m, shape)
