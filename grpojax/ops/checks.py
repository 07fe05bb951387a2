"""Validation of hyperparameters shared by the ops: one wording for every error.

Only concrete Python/NumPy values are checked; a 0-d array (a traced or scheduled value
passed into a jitted step) passes through, since it cannot be inspected at trace time.
"""

from __future__ import annotations

import math
import numbers

import jax
import numpy as np


def check_choice(name: str, value, allowed: tuple[str, ...]) -> None:
    """Raise `ValueError` naming `name` and the allowed values unless `value in allowed`."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {tuple(allowed)}, got {value!r}")


def check_int(name: str, value, *, minimum: int = 1, none_ok: bool = False) -> None:
    """Require a Python/NumPy int (not a bool) >= `minimum` (or None when `none_ok`)."""
    if value is None and none_ok:
        return
    if not (
        isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= minimum
    ):
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
