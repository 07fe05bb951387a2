"""KL divergence to the reference policy: per-token estimators, reward shaping, controllers.

The estimators approximate `KL(pi_theta || pi_ref)` from tokens sampled from the policy,
using only the log-probabilities of the sampled tokens (Schulman, "Approximating KL
Divergence", 2020). They are elementwise: any shape works, `[N, T]` is the usual one, and
reducing over tokens is left to the caller (with the mask). Given `mask_nt`, masked
positions are 0 and their inputs are selected away before any arithmetic, so NaN or inf
there (a reference's logprobs at padding) reaches neither the values nor the gradients.
Used two ways: as a loss term (GRPO, `kl` / `kl_is_corrected`) or folded into the rewards
(InstructGPT PPO, `kl_penalty_rewards`), with the coefficient optionally adapted by a
`KLController`.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax.numpy as jnp
from jax import Array

from grpojax.ops.advantages import last_token_mask
from grpojax.ops.checks import broadcast_mask, check_choice, check_number, check_shape

ESTIMATORS = ("k1", "k2", "k3", "abs")


def _clip(x: Array, clamp: float | None) -> Array:
    if clamp is None:
        return x
    return jnp.clip(x, -clamp, clamp)


def _check_clamp(clamp) -> None:
    check_number("clamp", clamp, minimum=0, strict=True, none_ok=True)


def _k3(logp: Array, ref_logp: Array, clamp: float | None) -> Array:
    d = _clip(ref_logp - logp, clamp)
    # expm1 keeps the small-|d| regime accurate; the max guards the last rounding step.
    return jnp.maximum(jnp.expm1(d) - d, 0.0)


def _select(mask_nt, *xs):
    """(mask or None, *xs as float32 with 0 at masked positions), all broadcast to one shape."""
    xs = [jnp.asarray(x, jnp.float32) for x in xs]
    if mask_nt is None:
        return None, *xs
    shape = jnp.broadcast_shapes(*(x.shape for x in xs))
    mask = broadcast_mask("mask_nt", mask_nt, shape)
    return mask, *(jnp.where(mask, x, 0.0) for x in xs)


def _masked(x: Array, mask: Array | None) -> Array:
    return x if mask is None else jnp.where(mask, x, 0.0)


def kl(
    logp_nt: Array,
    ref_logp_nt: Array,
    mask_nt: Array | None = None,
    *,
    estimator: str,
    clamp: float | None = 20.0,
) -> Array:
    """Per-token estimate of `KL(pi_theta || pi_ref)` from tokens sampled from `pi_theta`.

    With `log r = ref_logp - logp = log(pi_ref(a_t) / pi_theta(a_t))`:

        k1  = -log r = logp - ref_logp           unbiased, high variance, can be < 0
        abs = |logp - ref_logp|                  biased, >= 0
        k2  = 0.5 * (log r)^2                    biased (low for nearby policies), >= 0
        k3  = r - log r - 1                      unbiased, low variance, >= 0

    k3 is the estimator of the GRPO paper (DeepSeekMath, eq. 4). Its gradient with respect
    to `logp` is `1 - exp(ref_logp - logp)`. For k3 only (the one with an `exp`), `log r` is
    clamped to `[-clamp, clamp]` first so that `exp` cannot overflow; beyond the clamp the
    gradient is 0. `clamp=None` disables it. `estimator` has no default: the estimators
    are different quantities (GRPO uses k3, InstructGPT's reward penalty k1).

    Args:
      logp_nt: `[N, T]` log pi_theta of the sampled tokens (any shape: the op is elementwise).
      ref_logp_nt: `[N, T]` log pi_ref of the same tokens.
      mask_nt: optional `[N, T]` bool or {0, 1} mask of real tokens (broadcastable to the
        inputs); masked positions give 0 and no gradient, whatever the inputs hold there.
      estimator: one of "k1", "k2", "k3", "abs".
      clamp: bound on |log r| for k3, > 0, or None.

    Returns:
      `[N, T]` float32 per-token estimates; without a mask they are not masked (reduce with
      the mask).

    Examples:
      >>> import jax.numpy as jnp
      >>> import numpy as np
      >>> import grpojax as gj
      >>> logp, ref_logp = jnp.array([[-1.0, -1.0, -1.0]]), jnp.array([[-1.0, -2.0, 0.0]])
      >>> print(gj.kl(logp, ref_logp, estimator="k1"))  # logp - ref_logp
      [[ 0.  1. -1.]]
      >>> print(np.round(np.asarray(gj.kl(logp, ref_logp, estimator="k3")), 4))  # r - log r - 1
      [[0.     0.3679 0.7183]]
    """
    check_choice("estimator", estimator, ESTIMATORS)
    _check_clamp(clamp)
    mask, logp, ref_logp = _select(mask_nt, logp_nt, ref_logp_nt)
    if estimator == "k1":
        out = logp - ref_logp
    elif estimator == "abs":
        out = jnp.abs(logp - ref_logp)
    elif estimator == "k2":
        out = 0.5 * jnp.square(logp - ref_logp)
    else:
        out = _k3(logp, ref_logp, clamp)
    return _masked(out, mask)


def kl_is_corrected(
    logp_nt: Array,
    old_logp_nt: Array,
    ref_logp_nt: Array,
    mask_nt: Array | None = None,
    *,
    clamp: float | None = 20.0,
) -> Array:
    """Importance-corrected k3 estimator of `KL(pi_theta || pi_ref)` (DeepSeek-V3.2).

    The tokens were sampled from `pi_old`, not `pi_theta`, so the k3 estimate is reweighted:

        kl_t = pi_theta(a_t) / pi_old(a_t) * (pi_ref(a_t)/pi_theta(a_t)
                                              - log(pi_ref(a_t)/pi_theta(a_t)) - 1)
             = exp(logp - old_logp) * k3(logp, ref_logp)

    Gradient: both factors carry it; the ratio is deliberately NOT stop-gradiented.
    Expanding, `kl_t = pi_ref/pi_old - (pi_theta/pi_old) * log(pi_ref/pi_theta)
    - pi_theta/pi_old`, so `E_{a ~ pi_old}[kl_t] = 1 + KL(pi_theta || pi_ref) - 1` exactly,
    as a function of theta; hence `E_{pi_old}[grad kl_t] = grad KL(pi_theta || pi_ref)`.
    Without the ratio (DeepSeekMath), `E_{pi_old}[grad k3] = -E_{pi_ref}[grad logp]` at
    `pi_old = pi_theta`, the gradient of the reverse KL, which is biased. `old_logp_nt` and
    `ref_logp_nt` are data (no gradient is expected through them). Both log-ratios are
    clamped to `[-clamp, clamp]` before `exp`.

    Args:
      logp_nt: `[N, T]` log pi_theta of the sampled tokens (differentiated).
      old_logp_nt: `[N, T]` log pi_old, the sampling policy's log-probabilities.
      ref_logp_nt: `[N, T]` log pi_ref.
      mask_nt: optional `[N, T]` mask of real tokens; masked positions give 0 and no
        gradient, whatever the inputs hold there.
      clamp: bound on |log-ratio| before `exp`, > 0, or None.

    Returns:
      `[N, T]` float32 per-token estimates, >= 0.

    Examples:
      >>> import jax.numpy as jnp
      >>> import numpy as np
      >>> import grpojax as gj
      >>> logp, old_logp = jnp.array([[-1.0, -1.0, -1.0]]), jnp.array([[-1.0, -2.0, -1.0]])
      >>> ref_logp = jnp.array([[-2.0, -2.0, -1.0]])  # k3 = [e^-1, e^-1, 0], ratio [1, e, 1]
      >>> print(np.round(np.asarray(gj.kl_is_corrected(logp, old_logp, ref_logp)), 4))
      [[0.3679 1.     0.    ]]
    """
    _check_clamp(clamp)
    mask, logp, old_logp, ref_logp = _select(mask_nt, logp_nt, old_logp_nt, ref_logp_nt)
    ratio = jnp.exp(_clip(logp - old_logp, clamp))
    return _masked(ratio * _k3(logp, ref_logp, clamp), mask)


def kl_penalty_rewards(
    scores_n: Array,
    logp_nt: Array,
    ref_logp_nt: Array,
    mask_nt: Array,
    *,
    beta: float | Array,
    estimator: str,
    clamp: float | None = 20.0,
) -> Array:
    """Per-token rewards with the KL penalty folded in (InstructGPT / Ziegler et al. PPO).

        r_t = -beta * KL_t                    for real tokens before the last one
        r_T = score_n - beta * KL_T           on the last real token
        r_t = 0                               on masked positions

    `KL_t = kl(logp, ref_logp, mask_nt, estimator=estimator)` (Ziegler et al. and
    InstructGPT use k1). The last real token is found from the mask, which may have a left
    offset (prompt masked out). A row with an empty mask gets all zeros. Garbage (NaN, inf)
    at masked positions, or in the score of an empty row, reaches no value or gradient.
    Example (seed): score 0.8, KL 0.05, beta 6 -> total 0.8 - 0.3 = 0.5.

    Args:
      scores_n: `[N]` sequence scores (reward model or verifier).
      logp_nt: `[N, T]` log pi of the sampled tokens under the sampling policy.
      ref_logp_nt: `[N, T]` log pi_ref of the same tokens.
      mask_nt: `[N, T]` mask of real completion tokens.
      beta: KL coefficient (a float or a traced scalar, e.g. a controller's `state.beta`).
      estimator: KL estimator name (no default), see `kl`.
      clamp: see `kl`.

    Returns:
      `[N, T]` float32 token rewards, to feed `gae` or `reinforce_pp_returns`.

    Examples:
      >>> import jax.numpy as jnp
      >>> import grpojax as gj
      >>> logp, ref_logp = jnp.full((2, 3), -1.0), jnp.full((2, 3), -1.5)  # k1 = 0.5
      >>> scores, mask = jnp.array([1.0, 2.0]), jnp.array([[1, 1, 1], [1, 1, 0]])
      >>> r = gj.kl_penalty_rewards(scores, logp, ref_logp, mask, beta=0.5, estimator="k1")
      >>> print(r)  # -0.5 * 0.5 per real token, plus the score on the last one
      [[-0.25 -0.25  0.75]
       [-0.25  1.75  0.  ]]
    """
    logp_shape = jnp.shape(logp_nt)
    check_shape("logp_nt", logp_shape, [(None, None)], "[N, T]")
    scores = jnp.asarray(scores_n, jnp.float32)
    check_shape("scores_n", scores.shape, [logp_shape[:1]], f"[N] with N = {logp_shape[0]}")
    kl_nt = kl(logp_nt, ref_logp_nt, mask_nt, estimator=estimator, clamp=clamp)
    mask = broadcast_mask("mask_nt", mask_nt, kl_nt.shape)
    rewards = -jnp.asarray(beta, jnp.float32) * kl_nt
    rewards = jnp.where(last_token_mask(mask), rewards + scores[:, None], rewards)
    return jnp.where(mask, rewards, 0.0)


class KLControllerState(NamedTuple):
    """State of a KL coefficient controller.

    Examples:
      >>> import jax.numpy as jnp
      >>> import grpojax as gj
      >>> state = gj.KLControllerState(beta=jnp.float32(0.05))
      >>> round(float(state.beta), 4)
      0.05
    """

    beta: Array  # [] float32: the current KL coefficient


@dataclasses.dataclass(frozen=True)
class KLController:
    """A KL coefficient schedule as pure `init` / `update` functions (like an optax transform).

    Fixed when `target` is None; otherwise the adaptive rule of Ziegler et al. (2019):

        e     = clip(current_kl / target - 1, -0.2, 0.2)
        beta <- beta * (1 + e * n_steps / horizon)

    Frozen and hashable, so it can sit in a config or be closed over by a jitted step.
    Build it with `fixed_kl_controller` or `adaptive_kl_controller`.

    Examples:
      >>> import grpojax as gj
      >>> ctl = gj.adaptive_kl_controller(0.1, target=6.0, horizon=10000)
      >>> state = ctl.init()
      >>> state = ctl.update(state, current_kl=12.0, n_steps=256)  # KL too high: beta grows
      >>> round(float(state.beta), 6)  # 0.1 * (1 + 0.2 * 256 / 10000)
      0.100512
    """

    init_beta: float
    target: float | None = None
    horizon: float | None = None

    def __post_init__(self):
        check_number("init_beta", self.init_beta, minimum=0, array_ok=False)
        if (self.target is None) != (self.horizon is None):
            raise ValueError(
                f"target and horizon must be given together (adaptive) or neither, got "
                f"target={self.target!r} and horizon={self.horizon!r}"
            )
        for name in ("target", "horizon"):
            check_number(
                name, getattr(self, name), minimum=0, strict=True, none_ok=True, array_ok=False
            )

    @property
    def adaptive(self) -> bool:
        return self.target is not None

    def init(self) -> KLControllerState:
        """The initial state, `beta = init_beta`."""
        return KLControllerState(beta=jnp.asarray(self.init_beta, jnp.float32))

    def update(
        self, state: KLControllerState, *, current_kl: Array | float, n_steps: Array | int
    ) -> KLControllerState:
        """The next state after `n_steps` samples with observed mean KL `current_kl`.

        Args:
          state: the current state.
          current_kl: `[]` the measured KL, in the same units as `target` (e.g. the mean
            per-sequence KL of the batch).
          n_steps: `[]` the number of samples (or steps) since the last update.
        """
        if self.target is None or self.horizon is None:  # fixed
            return state
        error = jnp.clip(jnp.asarray(current_kl, jnp.float32) / self.target - 1.0, -0.2, 0.2)
        mult = 1.0 + error * jnp.asarray(n_steps, jnp.float32) / self.horizon
        return KLControllerState(beta=state.beta * mult)


def fixed_kl_controller(beta: float) -> KLController:
    """A controller whose coefficient stays at `beta`.

    Examples:
      >>> import grpojax as gj
      >>> ctl = gj.fixed_kl_controller(0.05)
      >>> state = ctl.update(ctl.init(), current_kl=12.0, n_steps=256)  # ignored: beta is fixed
      >>> round(float(state.beta), 4)
      0.05
    """
    return KLController(init_beta=beta)


def adaptive_kl_controller(init_beta: float, *, target: float, horizon: float) -> KLController:
    """Ziegler et al.'s proportional controller steering the KL toward `target`.

    `beta <- beta * (1 + clip(KL / target - 1, -0.2, 0.2) * n_steps / horizon)`.

    Examples:
      >>> import grpojax as gj
      >>> ctl = gj.adaptive_kl_controller(0.1, target=6.0, horizon=10000)
      >>> state = ctl.update(ctl.init(), current_kl=3.0, n_steps=256)  # KL too low: beta shrinks
      >>> round(float(state.beta), 6)  # 0.1 * (1 + clip(3 / 6 - 1, -0.2, 0.2) * 256 / 10000)
      0.099488
    """
    return KLController(init_beta=init_beta, target=target, horizon=horizon)
