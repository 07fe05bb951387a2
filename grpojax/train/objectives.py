"""Pluggable GRPO objectives: the policy losses and advantage estimators a `GRPOConfig` names.

`GRPOConfig.policy_loss` and `GRPOConfig.advantage_estimator` each hold a built-in name (a
key of `POLICY_LOSSES` / `ADVANTAGE_ESTIMATORS`) or the path `"package.module:function"` of
your own function. A path is imported and its signature checked when the config is built
(a missing module or attribute, or a wrong signature, is one `ValueError` naming the
field); the step calls the function inside its one jitted program, so it must be
traceable (jax.numpy, no host callbacks). The contracts:

    policy loss:  fn(logp_nt, old_logp_nt, advantages, mask_nt, *, config)
                      -> (loss_nt [N, T] or loss_n [N], metrics)

      logp_nt      `[N, T]` float32 log pi_theta of the sampled tokens (the gradient flows
                   through it); padding holds finite garbage.
      old_logp_nt  `[N, T]` float32 log pi_old (a constant).
      advantages   `[N]` or `[N, T]` float32 (as the estimator returned them).
      mask_nt      `[N, T]` bool real completion tokens.
      config       the step's `GRPOConfig`: read hyperparameters from its fields.
      loss         `[N, T]` per token, 0 at padding, reduced with `config.aggregation` like
                   the built-ins; or `[N]` one per sequence (GMPO), averaged over the
                   mini-batch's non-empty sequences. Minimised (a negated objective).
      metrics      dict of float32 scalars, each a mean over the real tokens it was given
                   (names ending in `_min` / `_max`: extremes); the step combines them
                   over micro-batches weighted by real tokens.

    advantage estimator:  fn(rewards_n, *, group_size, mask_nt, lengths_n, valid_n, config)
                              -> [N] or [N, T] float32

      rewards_n    `[N]` float32 rewards (DAPO's overlong penalty already added), rows in
                   contiguous groups of G = `group_size` (a static int).
      mask_nt      `[N, T]` bool completion mask (None only when called without one).
      lengths_n    `[N]` int completion lengths, or None.
      valid_n      `[N]` bool valid samples (give invalid ones 0), or None (all valid).
      config       the step's `GRPOConfig`.

Extra inputs. An estimator that needs more of the batch than the contract's arguments
declares them in the attribute `fn.batch_inputs`, a tuple of names from `BATCH_INPUTS`
(fields of `GRPOBatch` and keywords of `compute_advantages`); the step passes each as a
keyword argument of the same name. A declared input the batch lacks (None) is one
`ValueError` naming the field and the estimator; names also in `fn.optional_batch_inputs`
may be absent and arrive as None. An estimator without the attribute is called exactly as
above, so every function written to the contract keeps working. The inputs:

      greedy_rewards_n  `[N]` float32 the reward of the greedy (temperature 0) completion
                        of each row's prompt, equal across a group (ReMax's baseline).
      rewards_nr        `[N, R]` float32 the rewards before weighting, one column per
                        reward function (GDPO); `rewards_n` is their weighted sum.
      token_rewards_nt  `[N, T]` float32 per-token rewards to add to the score, 0 at
                        padding: REINFORCE++'s KL penalty `-reward_kl_coef * KL_t`, which
                        the GRPO step computes from pi_old's and pi_ref's logprobs when
                        `config.reward_kl_coef` > 0 (absent otherwise: declare it optional).

The built-ins "remax" (`batch_inputs = ("greedy_rewards_n",)`) and "gdpo"
(`batch_inputs = ("rewards_nr",)`, weights `config.gdpo_weights`) use them, and the two
REINFORCE++ estimators take `token_rewards_nt` (optional). `grpojax
train` fills what the configured estimator declares, built-in or user-defined (it samples
the greedy completions only then), and, for an estimator taking `rewards_nr`, sets an
unset `gdpo_weights` to the reward manager's weights (`grpojax.rollouts.sampler`,
`grpojax.driver.trainer`).

The estimator runs once on the whole batch, before it is split into mini- and
micro-batches. The loss runs on each micro-batch, so a custom loss whose statistics span the
batch sees the micro-batch; set the attribute `fn.minibatch_statistics = True` to give it
the whole mini-batch instead (its rows of the result are used, and with more than one
micro-batch the step spends one extra forward pass per mini-batch to know the other rows'
log-probabilities; accumulation then stays exact). The built-in Clip-Cov and KL-Cov do so.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import jax.numpy as jnp
from jax import Array

from grpojax.ops.advantages import (
    gdpo_advantages,
    gpg_advantages,
    group_advantages,
    last_token_mask,
    maxrl_advantages,
    opo_advantages,
    pass_at_k_advantages,
    reinforce_pp_baseline_advantages,
    reinforce_pp_returns,
    remax_advantages,
    rloo_advantages,
    whiten,
)
from grpojax.ops.losses import policy_loss
from grpojax.ops.surrogates import (
    cispo_loss,
    clip_cov_loss,
    dppo_loss,
    gmpo_loss,
    kl_cov_loss,
    sapo_loss,
)
from grpojax.user_code import import_object, is_import_path

# ----------------------------------------------------------------------------------------
# Built-in policy losses: the ops, with hyperparameters from the config's fields
# ----------------------------------------------------------------------------------------


def ppo_clip(logp_nt, old_logp_nt, advantages, mask_nt, *, config):
    """PPO's clipped surrogate (`grpojax.ops.policy_loss`): clip_low, clip_high, dual_clip,
    ratio_level ("sequence" is GSPO). `[N, T]`."""
    return policy_loss(
        logp_nt,
        old_logp_nt,
        advantages,
        mask_nt,
        clip_low=config.clip_low,
        clip_high=config.clip_high,
        dual_clip=config.dual_clip,
        ratio_level=config.ratio_level,
    )


def cispo(logp_nt, old_logp_nt, advantages, mask_nt, *, config):
    """CISPO (`grpojax.ops.cispo_loss`): the stop-gradient IS weight clipped to
    [1 - clip_low, 1 + clip_high]. `[N, T]`."""
    return cispo_loss(
        logp_nt,
        old_logp_nt,
        advantages,
        mask_nt,
        clip_low=config.clip_low,
        clip_high=config.clip_high,
    )


def sapo(logp_nt, old_logp_nt, advantages, mask_nt, *, config):
    """SAPO (`grpojax.ops.sapo_loss`): sigmoid gate, sapo_tau_pos / sapo_tau_neg. `[N, T]`."""
    return sapo_loss(
        logp_nt,
        old_logp_nt,
        advantages,
        mask_nt,
        tau_pos=config.sapo_tau_pos,
        tau_neg=config.sapo_tau_neg,
    )


def gmpo(logp_nt, old_logp_nt, advantages, mask_nt, *, config):
    """GMPO (`grpojax.ops.gmpo_loss`): geometric mean of the token ratios, clipped in log
    space to [-clip_low, clip_high] (the paper: 0.4 each). `[N]`, needs `[N]` advantages."""
    return gmpo_loss(
        logp_nt,
        old_logp_nt,
        advantages,
        mask_nt,
        clip_low=config.clip_low,
        clip_high=config.clip_high,
    )


def dppo(logp_nt, old_logp_nt, advantages, mask_nt, *, config):
    """DPPO (`grpojax.ops.dppo_loss`): Binary-TV / Binary-KL trust region, dppo_divergence
    and dppo_delta. `[N, T]`."""
    return dppo_loss(
        logp_nt,
        old_logp_nt,
        advantages,
        mask_nt,
        divergence=config.dppo_divergence,
        delta=config.dppo_delta,
    )


def clip_cov(logp_nt, old_logp_nt, advantages, mask_nt, *, config):
    """Clip-Cov (`grpojax.ops.clip_cov_loss`): PPO's clip (clip_low, clip_high) with the
    top clip_cov_ratio of the mini-batch's tokens in the covariance band
    [clip_cov_lb, clip_cov_ub] detached (the largest covariances). `[N, T]`."""
    return clip_cov_loss(
        logp_nt,
        old_logp_nt,
        advantages,
        mask_nt,
        clip_low=config.clip_low,
        clip_high=config.clip_high,
        clip_cov_ratio=config.clip_cov_ratio,
        clip_cov_lb=config.clip_cov_lb,
        clip_cov_ub=config.clip_cov_ub,
    )


def kl_cov(logp_nt, old_logp_nt, advantages, mask_nt, *, config):
    """KL-Cov (`grpojax.ops.kl_cov_loss`): the unclipped surrogate plus kl_cov_coef *
    |logp - old_logp| on the top kl_cov_ratio of the mini-batch's tokens by covariance.
    `[N, T]`."""
    return kl_cov_loss(
        logp_nt,
        old_logp_nt,
        advantages,
        mask_nt,
        kl_cov_ratio=config.kl_cov_ratio,
        ppo_kl_coef=config.kl_cov_coef,
    )


def _declare(fn: Callable, **attributes: object) -> None:
    """Set a built-in's function attributes (the module docstring's `fn.batch_inputs`, ...):
    setattr, as the type checker takes no attribute assignment on a function."""
    for name, value in attributes.items():
        setattr(fn, name, value)


_declare(clip_cov, minibatch_statistics=True)
_declare(kl_cov, minibatch_statistics=True)

POLICY_LOSSES: dict[str, Callable] = {
    "ppo_clip": ppo_clip,
    "cispo": cispo,
    "sapo": sapo,
    "gmpo": gmpo,
    "dppo": dppo,
    "clip_cov": clip_cov,
    "kl_cov": kl_cov,
}
# Built-ins that return one loss per sequence, `[N]`.
SEQUENCE_LOSSES = ("gmpo",)

# ----------------------------------------------------------------------------------------
# Built-in advantage estimators
# ----------------------------------------------------------------------------------------


def _group(scale):
    def estimator(rewards_n, *, group_size, mask_nt, lengths_n, valid_n, config):
        return group_advantages(
            rewards_n,
            group_size=group_size,
            scale=scale,
            eps=config.adv_eps,
            std=config.adv_std,
            mask_n=valid_n,
        )

    return estimator


grpo = _group("group")
grpo.__doc__ = "GRPO: (r - mean_g) / (std_g + adv_eps), adv_std population or unbiased. `[N]`."
grpo_batch_std = _group("batch")
grpo_batch_std.__doc__ = "(r - mean_g) / (std_batch + adv_eps). `[N]`."
dr_grpo = _group("none")
dr_grpo.__doc__ = "Dr.GRPO: r - mean_g. `[N]`."


def rloo(rewards_n, *, group_size, mask_nt, lengths_n, valid_n, config):
    """RLOO: r - mean of the other G-1 valid samples. `[N]`."""
    return rloo_advantages(rewards_n, group_size=group_size, mask_n=valid_n)


def reinforce_pp(
    rewards_n, *, group_size, mask_nt, lengths_n, valid_n, config, token_rewards_nt=None
):
    """REINFORCE++-baseline: group-mean baseline, reward-to-go (with `token_rewards_nt`,
    the KL penalty of `reward_kl_coef`, when given), global whitening. `[N, T]`."""
    if mask_nt is None:
        raise ValueError(
            "advantage_estimator='reinforce_pp' needs mask_nt ([N, T] token advantages)"
        )
    return reinforce_pp_baseline_advantages(
        rewards_n,
        mask_nt,
        group_size=group_size,
        token_rewards_nt=token_rewards_nt,
        mask_n=valid_n,
    )


def reinforce_pp_plain(
    rewards_n, *, group_size, mask_nt, lengths_n, valid_n, config, token_rewards_nt=None
):
    """REINFORCE++ (Hu et al. 2025), no baseline and no critic: per-token rewards, their
    reward-to-go, whitened over every real token of the batch.

        r_t = score_n [t = last real token] + token_rewards_t     (-reward_kl_coef * KL_t)
        G_t = sum_{k >= t, real} r_k                              (gamma = 1)
        A_t = (G_t - mean) / sqrt(var + 1e-8)                     (all real tokens, population)

    i.e. the paper's A_t = r(x, y) - beta sum_{i >= t} KL_i, normalised over the batch.
    Invalid samples (`valid_n` false) are 0 and left out of the statistics. `[N, T]`."""
    if mask_nt is None:
        raise ValueError(
            "advantage_estimator='reinforce_pp_plain' needs mask_nt ([N, T] token advantages)"
        )
    mask = jnp.asarray(mask_nt, jnp.bool_)
    if valid_n is not None:
        mask = mask & jnp.asarray(valid_n, jnp.bool_)[:, None]
    score = jnp.asarray(rewards_n, jnp.float32)[:, None]
    token_rewards = jnp.where(last_token_mask(mask), score, 0.0)
    if token_rewards_nt is not None:
        token_rewards = token_rewards + jnp.where(mask, token_rewards_nt, 0.0)
    returns = reinforce_pp_returns(token_rewards, mask, gamma=1.0)
    return whiten(returns, mask)


def pass_at_k(rewards_n, *, group_size, mask_nt, lengths_n, valid_n, config):
    """Pass@k Training's closed form for binary rewards, k = pass_at_k, eps = adv_eps. `[N]`."""
    return pass_at_k_advantages(
        rewards_n, group_size=group_size, k=config.pass_at_k, eps=config.adv_eps, mask_n=valid_n
    )


def opo(rewards_n, *, group_size, mask_nt, lengths_n, valid_n, config):
    """OPO: r minus the length-weighted group mean (lengths_n, else the mask's row sums). `[N]`."""
    if lengths_n is None:
        if mask_nt is None:
            raise ValueError("advantage_estimator='opo' needs lengths_n or mask_nt")
        lengths_n = jnp.sum(jnp.asarray(mask_nt, jnp.bool_), axis=-1, dtype=jnp.int32)
    return opo_advantages(rewards_n, lengths_n, group_size=group_size, mask_n=valid_n)


def gpg(rewards_n, *, group_size, mask_nt, lengths_n, valid_n, config):
    """GPG: alpha (r - mean_g) / gpg_f_norm, alpha = B / (B - M). `[N]`."""
    return gpg_advantages(
        rewards_n, group_size=group_size, f_norm=config.gpg_f_norm, mask_n=valid_n
    )


def maxrl(rewards_n, *, group_size, mask_nt, lengths_n, valid_n, config):
    """MaxRL: (r - mean_g) / (mean_g + adv_eps), for rewards in {0, 1}. `[N]`."""
    return maxrl_advantages(rewards_n, group_size=group_size, eps=config.adv_eps, mask_n=valid_n)


def remax(rewards_n, *, group_size, mask_nt, lengths_n, valid_n, config, greedy_rewards_n):
    """ReMax: r minus the reward of the prompt's greedy completion (`greedy_rewards_n`). `[N]`."""
    return remax_advantages(rewards_n, greedy_rewards_n, mask_n=valid_n)


def gdpo(rewards_n, *, group_size, mask_nt, lengths_n, valid_n, config, rewards_nr):
    """GDPO: each reward function's column of `rewards_nr` normalised within its group
    (adv_eps, adv_std), summed with `config.gdpo_weights` (None: all 1), the sum normalised
    over the batch. `rewards_n` is not used. `[N]`."""
    return gdpo_advantages(
        rewards_nr,
        group_size=group_size,
        eps=config.adv_eps,
        weights=config.gdpo_weights,
        std=config.adv_std,
        mask_n=valid_n,
    )


_declare(remax, batch_inputs=("greedy_rewards_n",))
_declare(gdpo, batch_inputs=("rewards_nr",))
for _fn in (reinforce_pp, reinforce_pp_plain):
    _declare(_fn, batch_inputs=("token_rewards_nt",), optional_batch_inputs=("token_rewards_nt",))

ADVANTAGE_ESTIMATORS: dict[str, Callable] = {
    "grpo": grpo,
    "grpo_batch_std": grpo_batch_std,
    "dr_grpo": dr_grpo,
    "rloo": rloo,
    "reinforce_pp": reinforce_pp,
    "reinforce_pp_plain": reinforce_pp_plain,
    "pass_at_k": pass_at_k,
    "opo": opo,
    "gpg": gpg,
    "maxrl": maxrl,
    "remax": remax,
    "gdpo": gdpo,
}
# Built-ins that return token advantages, `[N, T]`.
TOKEN_ESTIMATORS = ("reinforce_pp", "reinforce_pp_plain")
# What an estimator may ask for in `fn.batch_inputs` (fields of `GRPOBatch`), with their
# shapes, for the error messages.
BATCH_INPUTS: dict[str, str] = {
    "greedy_rewards_n": "[N]",
    "rewards_nr": "[N, R]",
    "token_rewards_nt": "[N, T]",
}

# ----------------------------------------------------------------------------------------
# Resolution: a built-in name or "package.module:function"
# ----------------------------------------------------------------------------------------

_LOSS_CONTRACT = "fn(logp_nt, old_logp_nt, advantages, mask_nt, *, config)"
_ESTIMATOR_CONTRACT = "fn(rewards_n, *, group_size, mask_nt, lengths_n, valid_n, config)"


def _check_signature(field: str, spec: str, fn, contract: str, probe) -> None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        raise ValueError(f"{field}: {spec!r} must be a function {contract}") from None
    try:
        probe(sig)
    except TypeError:
        raise ValueError(
            f"{field}: {spec!r} must be a function {contract}; its signature is {sig}"
        ) from None


def _declared_inputs(field: str, spec: str, fn) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(`fn.batch_inputs`, `fn.optional_batch_inputs`) as tuples, checked against
    `BATCH_INPUTS`."""
    out = []
    for attr in ("batch_inputs", "optional_batch_inputs"):
        names = getattr(fn, attr, ())
        if isinstance(names, str) or not all(isinstance(x, str) for x in names):
            raise ValueError(f"{field}: {spec!r}.{attr} must be a tuple of names, got {names!r}")
        unknown = [x for x in names if x not in BATCH_INPUTS]
        if unknown:
            raise ValueError(
                f"{field}: {spec!r}.{attr} names {unknown}; the batch inputs an estimator "
                f"may ask for are {tuple(BATCH_INPUTS)}"
            )
        out.append(tuple(names))
    required, optional = out
    if not set(optional) <= set(required):
        raise ValueError(
            f"{field}: {spec!r}.optional_batch_inputs {optional} must be names of "
            f"batch_inputs {required}"
        )
    return required, optional


def _resolve(field, spec, builtins, contract, probe) -> Callable:
    if not isinstance(spec, str):
        raise ValueError(
            f"{field} must be one of {tuple(builtins)} or 'package.module:function', got {spec!r}"
        )
    if spec in builtins:
        return builtins[spec]
    if not is_import_path(spec):
        raise ValueError(
            f"{field} must be one of {tuple(builtins)} or 'package.module:function', got {spec!r}"
        )
    fn = import_object(field, spec)
    if not callable(fn):
        raise ValueError(
            f"{field}: {spec!r} must be a function {contract}, got {type(fn).__name__}"
        )
    _check_signature(field, spec, fn, contract, lambda sig: probe(sig, fn))
    return fn


def resolve_policy_loss(spec: str) -> Callable:
    """The policy-loss function `spec` names: a key of `POLICY_LOSSES` or
    "package.module:function" (imported; signature checked against the contract above).

    Raises:
      ValueError: naming `policy_loss`, for an unknown name, a module that does not import,
        a missing attribute, or a function that cannot be called as
        `fn(logp_nt, old_logp_nt, advantages, mask_nt, *, config)`.
    """
    return _resolve(
        "policy_loss",
        spec,
        POLICY_LOSSES,
        _LOSS_CONTRACT,
        lambda sig, fn: sig.bind(None, None, None, None, config=None),
    )


def resolve_advantage_estimator(spec: str) -> Callable:
    """The advantage estimator `spec` names: a key of `ADVANTAGE_ESTIMATORS` or
    "package.module:function" (imported; signature checked against the contract above).

    An estimator's `batch_inputs` / `optional_batch_inputs` attributes (module docstring)
    are checked too, and its signature must take the inputs it declares as keywords.

    Raises:
      ValueError: naming `advantage_estimator`, as `resolve_policy_loss`, and for declared
        inputs that are not names of `BATCH_INPUTS`.
    """

    def probe(sig, fn):
        required, _ = _declared_inputs("advantage_estimator", spec, fn)
        extra = dict.fromkeys(required)
        kw = dict(group_size=2, mask_nt=None, lengths_n=None, valid_n=None, config=None)
        sig.bind(None, **kw, **extra)

    fn = _resolve("advantage_estimator", spec, ADVANTAGE_ESTIMATORS, _ESTIMATOR_CONTRACT, probe)
    _declared_inputs("advantage_estimator", spec, fn)
    return fn


def estimator_batch_inputs(fn: Callable) -> tuple[str, ...]:
    """The batch inputs an estimator declares (`fn.batch_inputs`; () without one)."""
    return tuple(getattr(fn, "batch_inputs", ()))


def estimator_inputs(fn: Callable, spec: str, available: dict) -> dict:
    """The keyword arguments `fn` asks for (`fn.batch_inputs`), taken from `available`
    (name -> array or None).

    Raises:
      ValueError: naming the field and the estimator, for a declared input that is None and
        not in `fn.optional_batch_inputs`.
    """
    optional = tuple(getattr(fn, "optional_batch_inputs", ()))
    out = {}
    for name in estimator_batch_inputs(fn):
        value = available.get(name)
        if value is None and name not in optional:
            raise ValueError(
                f"advantage_estimator={spec!r} needs the batch field {name} "
                f"({BATCH_INPUTS[name]}); the batch has none"
            )
        out[name] = value
    return out


def uses_minibatch_statistics(fn: Callable) -> bool:
    """Whether a policy loss asks for the whole mini-batch (`fn.minibatch_statistics`)."""
    return bool(getattr(fn, "minibatch_statistics", False))


def check_advantages(adv: Array, n: int, t: int | None, spec: str) -> Array:
    """`adv` as float32, or a ValueError naming the estimator unless it is `[N]` / `[N, T]`."""
    adv = jnp.asarray(adv, jnp.float32)
    allowed = [(n,)] + ([(n, t)] if t is not None else [])
    if adv.shape not in allowed:
        want = f"[N]={(n,)}" + (f" or [N, T]={(n, t)}" if t is not None else "")
        raise ValueError(
            f"advantage_estimator {spec!r} returned advantages of shape {adv.shape}; "
            f"expected {want}"
        )
    return adv


__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "BATCH_INPUTS",
    "POLICY_LOSSES",
    "SEQUENCE_LOSSES",
    "TOKEN_ESTIMATORS",
    "check_advantages",
    "estimator_batch_inputs",
    "estimator_inputs",
    "resolve_advantage_estimator",
    "resolve_policy_loss",
    "uses_minibatch_statistics",
]
