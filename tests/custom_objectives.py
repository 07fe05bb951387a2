"""User-defined GRPO (and PPO) objectives, named by path in the tests ("custom_objectives:<name>").

What a researcher would write in their own module: plain functions of arrays, following the
contracts of `grpojax.train.objectives`; and one reward function (`rewards.functions`).
"""

import jax
import jax.numpy as jnp

import grpojax as gj


def vanilla_pg(logp_nt, old_logp_nt, advantages, mask_nt, *, config):
    """Unclipped importance-weighted policy gradient: loss_t = -r_t A_t (no trust region)."""
    ratio = jnp.exp(jnp.where(mask_nt, logp_nt - old_logp_nt, 0.0))
    adv = advantages[:, None] if advantages.ndim == 1 else advantages
    loss = jnp.where(mask_nt, -ratio * adv, 0.0)
    return loss, {"ratio_mean": gj.masked_mean(jax.lax.stop_gradient(ratio), mask_nt)}


def cispo_by_hand(logp_nt, old_logp_nt, advantages, mask_nt, *, config):
    """CISPO written from MiniMax-M1 (arXiv 2506.13585), not with `gj.cispo_loss`:
    loss_t = -sg(clip(r_t, 1 - clip_low, 1 + clip_high)) A_t logp_t, r_t = exp(logp_t -
    old_logp_t); and the fractions of real tokens whose weight is clipped below / above."""
    ratio = jnp.exp(jnp.where(mask_nt, logp_nt - old_logp_nt, 0.0))
    lower, upper = 1.0 - config.clip_low, 1.0 + config.clip_high
    weight = jax.lax.stop_gradient(jnp.clip(ratio, lower, upper))
    adv = advantages[:, None] if advantages.ndim == 1 else advantages
    loss = jnp.where(mask_nt, -weight * adv * logp_nt, 0.0)
    sg_ratio = jax.lax.stop_gradient(ratio)
    return loss, {
        "clip_frac_low": gj.masked_mean(sg_ratio < lower, mask_nt),
        "clip_frac_high": gj.masked_mean(sg_ratio > upper, mask_nt),
    }


def cispo_with_its_weight(logp_nt, old_logp_nt, advantages, mask_nt, *, config):
    """`cispo_by_hand` with a metric of its own, the mean clipped weight (the PPO step's
    test: a user loss's own metrics are logged)."""
    loss, metrics = cispo_by_hand(logp_nt, old_logp_nt, advantages, mask_nt, config=config)
    ratio = jnp.exp(jnp.where(mask_nt, logp_nt - old_logp_nt, 0.0))
    weight = jnp.clip(ratio, 1.0 - config.clip_low, 1.0 + config.clip_high)
    return loss, {**metrics, "cispo_weight_mean": gj.masked_mean(weight, mask_nt)}


def ppo_clip_again(logp_nt, old_logp_nt, advantages, mask_nt, *, config):
    """PPO's clipped surrogate as a user loss, from the config's band (`ppo.policy_loss`'s
    test: the same update as the built-in)."""
    return gj.policy_loss(
        logp_nt,
        old_logp_nt,
        advantages,
        mask_nt,
        clip_low=config.clip_low,
        clip_high=config.clip_high,
    )


def odd_code_sum(prompts, completions, **_):
    """A reward with variance under a random policy: 1.0 where the completion's characters'
    code points sum to an odd number."""
    return [float(sum(map(ord, c)) % 2) for c in completions]


def sign_advantages(rewards_n, *, group_size, mask_nt, lengths_n, valid_n, config):
    """A = sign(r - group mean), 0 for invalid samples."""
    r = rewards_n.reshape(-1, group_size)
    adv = jnp.sign(r - r.mean(axis=1, keepdims=True)).reshape(-1)
    return adv if valid_n is None else jnp.where(valid_n, adv, 0.0)


def missing_config(logp_nt, old_logp_nt, advantages, mask_nt):
    """Wrong: no `config` keyword."""
    return -advantages, {}


def estimator_without_group_size(rewards_n, *, config):
    """Wrong: lacks the estimator's keywords."""
    return rewards_n


NOT_A_FUNCTION = 3


def greedy_margin(
    rewards_n, *, group_size, mask_nt, lengths_n, valid_n, config, greedy_rewards_n, rewards_nr
):
    """An estimator with extra batch inputs: r - r_greedy, plus the first reward column
    when the batch carries `rewards_nr` (optional)."""
    adv = rewards_n - greedy_rewards_n
    return adv if rewards_nr is None else adv + rewards_nr[:, 0]


greedy_margin.batch_inputs = ("greedy_rewards_n", "rewards_nr")
greedy_margin.optional_batch_inputs = ("rewards_nr",)


def asks_for_values(rewards_n, *, group_size, mask_nt, lengths_n, valid_n, config, values_n):
    """Wrong: `values_n` is not a batch input an estimator may ask for."""
    return rewards_n - values_n


asks_for_values.batch_inputs = ("values_n",)


def forgets_its_input(rewards_n, *, group_size, mask_nt, lengths_n, valid_n, config):
    """Wrong: declares `greedy_rewards_n` but does not take it."""
    return rewards_n


forgets_its_input.batch_inputs = ("greedy_rewards_n",)


def no_embedding_decay(params):
    """A weight-decay mask (`optimizer.decay_mask`): the Hugging Face rule, and the token
    embedding exempt too."""
    hf = gj.train.decay_mask_except_bias_norm(params)
    return jax.tree_util.tree_map_with_path(
        lambda path, decays: decays and getattr(path[0], "key", None) != "embed", hf
    )
