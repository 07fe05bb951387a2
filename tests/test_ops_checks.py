"""The shared validators: each accepts its documented range and names the field otherwise.

Also the ops' array-argument errors built on them: one line naming the argument and the
shape it wants, raised by grpojax before JAX would fail with a broadcasting error.
"""

import inspect
import math
import re

import jax.numpy as jnp
import numpy as np
import pytest

import grpojax as gj
from grpojax.ops.checks import broadcast_mask, check_choice, check_int, check_number, check_shape


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


def test_check_shape_and_broadcast_mask():
    check_shape("a", (4,), [(4,), (4, 6)], "[N] or [N, T]")
    check_shape("a", (4, 1), [(4,), (4, 6)], "[N] or [N, T]", broadcast=True)
    check_shape("a", (7,), [(None,)], "[N]")
    for shape, kw in (((2, 2), {}), ((4, 1), {}), ((4, 6, 1), {"broadcast": True})):
        with pytest.raises(ValueError, match=r"^a must be \[N\] or \[N, T\], got shape "):
            check_shape("a", shape, [(4,), (4, 6)], "[N] or [N, T]", **kw)
    m = broadcast_mask("m", [True, False, True], (2, 3))
    np.testing.assert_array_equal(m, [[True, False, True]] * 2)
    with pytest.raises(ValueError, match=r"^m must be a mask broadcastable to \(2, 3\), got"):
        broadcast_mask("m", jnp.ones((3, 2)), (2, 3))


@pytest.mark.parametrize("convert", [list, tuple, np.asarray, jnp.asarray])
def test_mask_from_lengths_takes_python_and_numpy_lengths(convert):
    lengths, offsets, t = [5, 3, 0], [0, 2, 1], 6
    expected = np.arange(t)[None, :] < np.asarray(lengths)[:, None]
    np.testing.assert_array_equal(gj.mask_from_lengths(convert(lengths), t), expected)
    start = np.asarray(offsets)[:, None]
    shifted = (np.arange(t) >= start) & (np.arange(t) < start + np.asarray(lengths)[:, None])
    got = gj.mask_from_lengths(convert(lengths), t, offset_n=convert(offsets))
    np.testing.assert_array_equal(got, shifted)


def test_mask_from_lengths_names_lengths_and_the_shape_it_wants():
    want = r"^lengths_n must be 1-D \[N\], one length per row, got shape "
    with pytest.raises(ValueError, match=want + r"\(1, 2\)$"):
        gj.mask_from_lengths([[5, 3]], 6)
    with pytest.raises(ValueError, match=want + r"\(\)$"):
        gj.mask_from_lengths(5, 6)
    with pytest.raises(ValueError, match=r"^offset_n must be \[N\] like lengths_n \(2,\)"):
        gj.mask_from_lengths([5, 3], 6, offset_n=[1, 2, 3])
    with pytest.raises(ValueError, match=r"^max_len must be an int >= 0, got 6.0$"):
        gj.mask_from_lengths([5, 3], 6.0)


TOKEN_LOSSES = {
    "policy_loss": lambda *a: gj.policy_loss(*a),
    "policy_loss[sequence]": lambda *a: gj.policy_loss(*a, ratio_level="sequence"),
    "cispo_loss": lambda *a: gj.cispo_loss(*a, clip_high=0.28),
    "sapo_loss": lambda *a: gj.sapo_loss(*a),
    "dppo_loss": lambda *a: gj.dppo_loss(*a, divergence="tv"),
    "clip_cov_loss": lambda *a: gj.clip_cov_loss(*a),
    "kl_cov_loss": lambda *a: gj.kl_cov_loss(*a),
}


@pytest.mark.parametrize("name", TOKEN_LOSSES)
def test_group_shaped_advantages_name_advantages_and_the_shapes_allowed(name):
    """[B, G] advantages (B=2 prompts x G=4 samples) for N=8 rows of T=5 tokens: a grpojax
    message, not a broadcasting error from inside JAX; [N] and [N, T] still work."""
    x, mask = jnp.zeros((8, 5)), jnp.ones((8, 5), bool)
    want = r"^advantages must be \[N\] or \[N, T\] matching logp_nt \[N, T\] = \(8, 5\), "
    with pytest.raises(ValueError, match=want + r"got shape \(2, 4\)$"):
        TOKEN_LOSSES[name](x, x, jnp.zeros((2, 4)), mask)
    for adv in (jnp.zeros(8), jnp.zeros((8, 5))):
        assert TOKEN_LOSSES[name](x, x, adv, mask)[0].shape == (8, 5)


@pytest.mark.parametrize(
    "fn",
    [
        lambda x, a, m: gj.gmpo_loss(x, x, a, m),
        lambda x, a, m: gj.off_policy_sequence_mask(x, x, a, m, delta=0.1),
    ],
)
def test_sequence_ops_name_advantages_n_and_the_shape_wanted(fn):
    x, mask = jnp.zeros((8, 5)), jnp.ones((8, 5), bool)
    want = r"^advantages_n must be \[N\] = \(8,\), one per sequence, got shape \(2, 4\)$"
    with pytest.raises(ValueError, match=want):
        fn(x, jnp.zeros((2, 4)), mask)


def test_kl_ops_name_their_arrays():
    x = jnp.zeros((2, 3))
    with pytest.raises(ValueError, match=r"^mask_nt must be a mask broadcastable to \(2, 3\)"):
        gj.kl(x, x, jnp.ones((3, 2), bool), estimator="k3")
    with pytest.raises(ValueError, match=r"^scores_n must be \[N\] with N = 2, got shape \(3,\)$"):
        gj.kl_penalty_rewards(jnp.zeros(3), x, x, x > -1, beta=0.1, estimator="k1")


# The keyword-default rule of `grpojax.ops` (its module docstring), as it stands per op.
REQUIRED = {
    "kl": ["estimator"],
    "kl_penalty_rewards": ["estimator", "beta"],
    "aggregate": ["mode"],
    "aggregate_parts": ["mode"],
    "dppo_loss": ["divergence"],
    "rollout_correction": ["level", "mode"],
    "cispo_loss": ["clip_high"],
}
DEFAULTS = {
    "value_loss": {"clip": 0.2},
    "value_loss_with_metrics": {"clip": 0.2},
    "cispo_loss": {"clip_low": 1.0},
    "policy_loss": {"clip_low": 0.2, "clip_high": 0.2, "ratio_level": "token"},
    "dppo_loss": {"delta": None},
}


def test_algorithm_selectors_have_no_default_and_paper_values_do():
    for name, keys in REQUIRED.items():
        params = inspect.signature(getattr(gj, name)).parameters
        for k in keys:
            assert params[k].default is inspect.Parameter.empty, f"{name}({k}=) has a default"
    for name, defaults in DEFAULTS.items():
        params = inspect.signature(getattr(gj, name)).parameters
        assert {k: params[k].default for k in defaults} == defaults, name
    x = jnp.zeros((1, 2))
    with pytest.raises(TypeError, match="estimator"):
        gj.kl(x, x)
    with pytest.raises(TypeError, match="divergence"):
        gj.dppo_loss(x, x, jnp.zeros(1), x > -1)
