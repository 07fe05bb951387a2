"""The shared validators: each accepts its documented range and names the field otherwise."""

import math
import re

import jax.numpy as jnp
import numpy as np
import pytest

from grpojax.ops.checks import check_choice, check_int, check_number


@pytest.mark.parametrize(
    "kwargs, good, bad, message",
    [
        (dict(), [-1e9, 0, 2.5], [math.nan, math.inf, "1", True], "x must be a finite number, got"),
        (dict(minimum=0), [0, 0.0, 3], [-1e-9], "x must be a finite number >= 0, got"),
        (dict(minimum=0, strict=True), [1e-9], [0, 0.0], "x must be a finite number > 0, got"),
        (dict(maximum=1), [1, 1.0, -5], [1.0 + 1e-9], "x must be a finite number <= 1, got"),
        (
            dict(maximum=1, strict_max=True),
            [0.999, -5],
            [1, 1.0],
            "x must be a finite number < 1, got",
        ),
        # [0, 1): min_p, LoRA dropout, Adam's b1 / b2
        (
            dict(minimum=0, maximum=1, strict_max=True),
            [0, 0.5, np.float32(0.25)],
            [1.0, -0.1, None],
            "x must be a finite number >= 0 and < 1, got",
        ),
        # (0, 1): both ends open
        (
            dict(minimum=0, maximum=1, strict=True, strict_max=True),
            [0.5],
            [0, 1],
            "x must be a finite number > 0 and < 1, got",
        ),
        (
            dict(minimum=0, none_ok=True),
            [None, 2],
            [-1],
            "x must be None or a finite number >= 0, got",
        ),
    ],
)
def test_check_number_bounds_and_wording(kwargs, good, bad, message):
    for v in good:
        check_number("x", v, **kwargs)
    for v in bad:
        with pytest.raises(ValueError, match="^" + re.escape(f"{message} {v!r}") + "$"):
            check_number("x", v, **kwargs)


def test_check_number_scalar_arrays_pass_unless_refused():
    check_number("x", jnp.float32(2.0), maximum=1)  # a traced/scheduled value: not inspected
    with pytest.raises(ValueError, match=r"^x must be a finite number <= 1, got"):
        check_number("x", np.float64(2.0), maximum=1)  # a NumPy scalar is a real number
    with pytest.raises(ValueError, match=r"^x must be a finite number <= 1, got Array"):
        check_number("x", jnp.asarray(0.5), maximum=1, array_ok=False)


def test_check_int_and_check_choice():
    check_int("n", 1)
    check_int("n", np.int64(0), minimum=0)
    check_int("n", None, none_ok=True)
    for v in (0, 1.0, True, None):
        with pytest.raises(ValueError, match=rf"^n must be an int >= 1, got {v!r}$"):
            check_int("n", v)
    with pytest.raises(ValueError, match=r"^n must be None or an int >= 2, got 1$"):
        check_int("n", 1, minimum=2, none_ok=True)
    check_choice("c", "a", ("a", "b"))
    with pytest.raises(ValueError, match=r"^c must be one of \('a', 'b'\), got 'z'$"):
        check_choice("c", "z", ("a", "b"))
