"""The GRPO-family update: mu epochs x mini-batches x micro-batches in one compiled program.

    step = make_grpo_step(graphdef, tx, config, mesh=mesh, state_shardings=sh, batch=batch)
    state, metrics = step(state, batch)

`grpo_update(state, batch, graphdef=, tx=, config=)` is the pure function it jits (usable
inside a user's own `jax.jit`). `grpo_loss(model, batch, config)` is its first update's loss
(and gradient) without the optimizer, `grpo_loss_from_logprobs` the same loss from per-token
logprobs, and `grpo_batch_from_ids` builds a batch from token-id lists. Inside one call of
the step, PureJaxRL-style:

1. rows are permuted per epoch (from the state's key) and laid out as
   `[M mini-batches, K micro-batches, N/(M K) rows]`;
2. when the batch carries no old logprobs, the first update (at the step's input
   parameters) uses `stop_gradient(logp)` of its own forward, so its ratios are exactly 1;
   when the policy is updated more than once (mu > 1 or M > 1), a forward pass over the
   epoch-0 layout with the same function and shapes computes them for the later updates;
3. reference logprobs, when beta > 0 and the batch has none, come from `state.ref_params`
   the same way (beta = 0: no reference forward at all — a static decision); with
   `kl_estimator="full"` the reference runs inside each micro-batch's loss instead, for its
   hidden states (the exact KL over the vocabulary, `grpojax.ops.kl_from_hidden`);
4. `lax.scan` over epochs and over mini-batches; each mini-batch sums K micro-batch
   gradients, every micro loss divided by the mini-batch's *global* denominator, so
   accumulation equals the un-accumulated update; then `apply_gradients` (non-finite ->
   skipped).

PPO-ptx (`config.ptx_coef` > 0): the batch carries a separate batch of text, `ptx` (an
`SFTBatch` of N' rows, N' divisible by M x K). Its rows are split like the RL rows, without
shuffling, into M mini-batches of K micro-batches (`ptx_minibatches`); mini-batch m's ptx
rows join update m of every epoch, and micro-batch j's loss adds

    ptx_coef * NLL_j / tokens(ptx mini-batch m),   NLL_j = -sum m_{n,s} log pi(x_{n,s} | x_{n,<s})

(`grpojax.train.sft.ptx_micro_loss`), so the K micro-batch gradients sum to
grad(RL loss of the mini-batch) + ptx_coef * grad(token-mean NLL of its ptx rows) exactly,
and that sum is the one optimizer update. With ptx_coef = 0 the ptx rows are ignored and
nothing about the compiled program changes.

The GRPO variants (Dr.GRPO, DAPO, GSPO, dual clip, off-policy masking, rollout correction,
keep mask) are fields of `GRPOConfig`, and so are the policy loss and the advantage
estimator (a built-in name or "package.module:function", `grpojax.train.objectives`),
called inside the same compiled program; there is one step.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, cast

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax import Array
from jax.sharding import Mesh

from grpojax.data.source import pad_token_ids
from grpojax.models.lora import dropout_rate as lora_dropout_rate
from grpojax.models.moe import load_balancing_loss
from grpojax.ops.aggregation import aggregate, aggregate_parts
from grpojax.ops.checks import check_int
from grpojax.ops.corrections import (
    off_policy_sequence_mask,
    rollout_correction,
    truncated_completion_mask,
)
from grpojax.ops.kl import kl, kl_is_corrected
from grpojax.ops.logprobs import divergence_from_hidden
from grpojax.ops.masks import masked_mean
from grpojax.ops.masks import prompt_width as default_prompt_width
from grpojax.train.common import (
    Scored,
    accumulate_gradients,
    logprobs_from_hidden,
    make_update_step,
    merge_units,
    scored_hidden,
    split_units,
    unit_permutation,
)
from grpojax.train.config import GRPOConfig, compute_advantages, norm_constant_for
from grpojax.train.objectives import (
    estimator_inputs,
    resolve_advantage_estimator,
    resolve_policy_loss,
    uses_minibatch_statistics,
)
from grpojax.train.packing import Packing, check_packing
from grpojax.train.sft import SFTBatch, num_targets, ptx_micro_loss, ptx_minibatches
from grpojax.train.state import (
    Teacher,
    TrainState,
    apply_gradients,
    has_reference,
    is_lora,
    join_trainable,
    split_params,
    trainable_split,
)


@flax.struct.dataclass
class GRPOBatch:
    """One GRPO step's data, N = B*G rows, S = P + T columns (see `grpojax.train.common`).

    tokens_ns: `[N, S]` int32 prompt (left-padded, width P) + completion (width T).
    mask_ns: `[N, S]` bool real prompt and completion tokens (from lengths).
    completion_mask_nt: `[N, T]` bool real completion tokens (from lengths; EOS included).
    advantages: `[N]` or `[N, T]` float32 (e.g. from `compute_advantages`); None: computed
      inside the step from `rewards_n` by `compute_advantages(rewards_n, config, ...)`.
    old_logp_nt: optional `[N, T]` log pi_old; None: recomputed inside the step.
    ref_logp_nt: optional `[N, T]` log pi_ref; None with beta > 0: computed from
      `state.ref_params` inside the step.
    sampler_logp_nt: optional `[N, T]` the sampler's logprobs (rollout correction, off-policy
      masking).
    keep_count_nt: optional `[N, T]` int32 the sampler's kept-set sizes (keep mask).
    rewards_n: optional `[N]` float32 sequence rewards, rows in contiguous groups of G
      (needed when `advantages` is None).
    valid_n: optional `[N]` bool, samples whose reward is valid (the others are left out of
      the group statistics and get advantage 0); None: all valid.
    lengths_n: optional `[N]` int32 completion lengths (DAPO's overlong penalty).
    greedy_rewards_n: optional `[N]` float32 reward of the greedy completion of each row's
      prompt (the "remax" estimator's baseline).
    rewards_nr: optional `[N, R]` float32 rewards before weighting, one column per reward
      function (the "gdpo" estimator). These two are the estimators' extra inputs
      (`grpojax.train.objectives.BATCH_INPUTS`): the step passes an estimator those it
      declares, and a declared one that is None is a `ValueError` naming it.
    ptx: optional `SFTBatch` of N' rows `[N', S']` of pretraining text (its own width), the
      PPO-ptx term's data; required when `config.ptx_coef` > 0, ignored when it is 0. N'
      must divide into num_minibatches x num_microbatches.
    eos_found_n: optional `[N]` bool, the completion ended with its own EOS or stop string
      (`Rollout.eos_found_n`); required by `config.overlong_filter`.
    packing: optional `grpojax.train.packing.Packing` of these N rows (`pack_plan`): the
      forwards run on its packed rows, and its bins, not rows, are what the step shuffles
      and splits into mini- and micro-batches (its R bins must divide into
      num_minibatches x num_microbatches). Every other field stays `[N, ...]` in batch
      order. Losses, metrics and gradients are those of the unpacked step (up to float
      rounding) whenever the mini-batches hold the same rows (one mini-batch).
    """

    tokens_ns: Array
    mask_ns: Array
    completion_mask_nt: Array
    advantages: Array | None = None
    old_logp_nt: Array | None = None
    ref_logp_nt: Array | None = None
    sampler_logp_nt: Array | None = None
    keep_count_nt: Array | None = None
    rewards_n: Array | None = None
    valid_n: Array | None = None
    lengths_n: Array | None = None
    ptx: SFTBatch | None = None
    greedy_rewards_n: Array | None = None
    rewards_nr: Array | None = None
    packing: Packing | None = None
    eos_found_n: Array | None = None
    routing_nslk: Array | None = None


def grpo_batch_from_rollout(
    rollout,
    advantages: Array,
    *,
    config: GRPOConfig | None = None,
    old_logp_nt: Array | None = None,
    ref_logp_nt: Array | None = None,
) -> GRPOBatch:
    """A `GRPOBatch` from a `grpojax.sampling.Rollout` and its advantages.

    Sampler logprobs are attached when `config` asks for rollout correction or off-policy
    masking, the kept-set sizes when it asks for the keep mask.
    """
    tokens, mask, _ = rollout.sequences()
    need_sampler = config is not None and config.uses_sampler_logp
    need_keep = config is not None and config.use_keep_mask
    return GRPOBatch(
        tokens_ns=tokens,
        mask_ns=mask,
        completion_mask_nt=rollout.mask_nt,
        advantages=jnp.asarray(advantages, jnp.float32),
        old_logp_nt=old_logp_nt,
        ref_logp_nt=ref_logp_nt,
        sampler_logp_nt=rollout.logp_nt if need_sampler else None,
        keep_count_nt=rollout.keep_count_nt if need_keep else None,
    )


def grpo_batch_from_ids(
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    rewards: Sequence[float],
    *,
    group_size: int,
    pad_id: int = 0,
    prompt_width: int | None = None,
    completion_width: int | None = None,
    old_logp: Sequence[Sequence[float]] | None = None,
    ref_logp: Sequence[Sequence[float]] | None = None,
    eos_found: Sequence[bool] | None = None,
) -> GRPOBatch:
    """A `GRPOBatch` from Python lists of token ids: N = B*G samples, groups of G contiguous.

    The layout is the driver's (`grpojax.train.common`): row n is prompt n left-padded to P
    (`grpojax.data.pad_token_ids`), then completion n right-padded to T, so S = P + T;
    `mask_ns`, `completion_mask_nt` `[N, T]` and `lengths_n` `[N]` come from the lengths.
    The batch carries `rewards_n` `[N]` and no advantages: the step computes them
    (`config.advantage_estimator`), over groups of `group_size` rows.

    Args:
      prompt_ids: N lists (one per sample; the G samples of a group must hold the same
        prompt) or B = N / G lists (one per prompt) of int ids, each non-empty.
      completion_ids: N lists of int ids; the EOS that ends a completion is part of it
        (trained). An empty completion is allowed (it adds nothing to the loss).
      rewards: N numbers, the sequence rewards.
      group_size: G >= 2; N must be a multiple of it.
      pad_id: the id at padded positions (masks come from lengths: any id works).
      prompt_width: P; None: `grpojax.data.prompt_width` of the longest prompt (the
        driver's rule).
      completion_width: T; None: the longest completion. T is also Dr.GRPO's constant when
        `config.norm_constant` is None: pass the completion budget for a fixed one.
      old_logp: optional N lists of floats, one per completion token (the
        sampler's or your own log pi_old / log pi_ref), `[N, T]` with 0 at padding. None:
        the step computes them (pi_old from its input parameters, pi_ref from the state's
        reference).
      ref_logp: optional N lists of floats, one per completion token (the
        sampler's or your own log pi_old / log pi_ref), `[N, T]` with 0 at padding. None:
        the step computes them (pi_old from its input parameters, pi_ref from the state's
        reference).
      eos_found: optional N bools, whether completion n ended with its own EOS (False: cut
        by the budget); `config.overlong_filter` needs it.

    Raises:
      ValueError: one line naming the argument, for lists of different lengths, N not a
        multiple of `group_size` or a group whose prompts differ, a logprob row whose
        length is not its completion's, a row longer than its width.
    """
    check_int("group_size", group_size, minimum=2)
    n = len(completion_ids)
    if n == 0 or n % group_size:
        raise ValueError(
            f"completion_ids: N={n} samples must be a positive multiple of group_size="
            f"{group_size} (contiguous groups of G samples)"
        )
    b = n // group_size
    if len(prompt_ids) == b:
        prompt_ids = [row for row in prompt_ids for _ in range(group_size)]
    elif len(prompt_ids) == n:
        for i in range(b):
            group = prompt_ids[i * group_size : (i + 1) * group_size]
            if any(list(p) != list(group[0]) for p in group):
                raise ValueError(
                    f"prompt_ids: rows {i * group_size}..{(i + 1) * group_size - 1} form one "
                    f"group of group_size={group_size} but hold different prompts"
                )
    else:
        raise ValueError(
            f"prompt_ids: expected N={n} (one per sample) or B={b} (one per prompt) lists, "
            f"got {len(prompt_ids)}"
        )
    if len(rewards) != n:
        raise ValueError(f"rewards: expected N={n} numbers (one per sample), got {len(rewards)}")
    if prompt_width is None:
        prompt_width = default_prompt_width(max((len(p) for p in prompt_ids), default=1))
    if completion_width is None:
        completion_width = max(1, max(len(c) for c in completion_ids))
    rows = pad_token_ids(
        prompt_ids,
        completion_ids,
        prompt_width=prompt_width,
        completion_width=completion_width,
        pad_id=pad_id,
    )
    tokens, mask = rows.sequences()

    def per_token(name, values):
        if values is None:
            return None
        if len(values) != n:
            raise ValueError(f"{name}: expected N={n} lists (one per sample), got {len(values)}")
        out = np.zeros((n, completion_width), np.float32)
        for i, (row, length) in enumerate(zip(values, rows.completion_lengths_n, strict=True)):
            if len(row) != length:
                raise ValueError(
                    f"{name}: row {i} has {len(row)} values for a completion of {length} tokens"
                )
            out[i, :length] = row
        return jnp.asarray(out)

    if eos_found is not None and len(eos_found) != n:
        raise ValueError(
            f"eos_found: expected N={n} booleans, one per sample, got {len(eos_found)}"
        )
    return GRPOBatch(
        tokens_ns=jnp.asarray(tokens, jnp.int32),
        mask_ns=jnp.asarray(mask),
        completion_mask_nt=jnp.asarray(rows.completion_mask_nt()),
        old_logp_nt=per_token("old_logp", old_logp),
        ref_logp_nt=per_token("ref_logp", ref_logp),
        rewards_n=jnp.asarray(np.asarray(rewards, np.float32)),
        lengths_n=jnp.asarray(rows.completion_lengths_n, jnp.int32),
        eos_found_n=None if eos_found is None else jnp.asarray(np.asarray(eos_found, bool)),
    )


def _check_rows(batch: GRPOBatch, config: GRPOConfig) -> None:
    """The checks of a batch's own fields (shapes, the inputs `config` asks for)."""
    n, s = batch.tokens_ns.shape
    nt = batch.completion_mask_nt.shape
    if batch.mask_ns.shape != (n, s) or nt[0] != n or not 1 <= nt[1] < s:
        raise ValueError(
            f"expected tokens_ns/mask_ns [N, S] and completion_mask_nt [N, T] with T < S, got "
            f"{batch.tokens_ns.shape}, {batch.mask_ns.shape}, {nt}"
        )
    if batch.advantages is None:
        if batch.rewards_n is None or batch.rewards_n.shape != (n,):
            got = None if batch.rewards_n is None else batch.rewards_n.shape
            raise ValueError(
                f"a batch without advantages needs rewards_n [N]={n} to compute them in the "
                f"step, got {got}"
            )
        for name in ("valid_n", "lengths_n", "greedy_rewards_n"):
            x = getattr(batch, name)
            if x is not None and x.shape != (n,):
                raise ValueError(f"{name} must be [N]={n}, got {x.shape}")
        r = batch.rewards_nr
        if r is not None and (r.ndim != 2 or r.shape[0] != n or r.shape[1] < 1):
            raise ValueError(f"rewards_nr must be [N, R]=({n}, R) with R >= 1, got {r.shape}")
        estimator = resolve_advantage_estimator(config.advantage_estimator)
        estimator_inputs(  # a declared input the batch lacks: the error names it
            estimator,
            config.advantage_estimator,
            {"greedy_rewards_n": batch.greedy_rewards_n, "rewards_nr": batch.rewards_nr},
        )
        if config.overlong_max_len is not None and batch.lengths_n is None:
            raise ValueError("overlong_max_len is set: the batch must carry lengths_n")
        if n % config.group_size:
            raise ValueError(
                f"N={n} rows must divide into groups of group_size={config.group_size}"
            )
    elif batch.advantages.shape not in ((n,), nt):
        raise ValueError(f"advantages must be [N]={n} or [N, T]={nt}, got {batch.advantages.shape}")
    if config.overlong_filter and (batch.eos_found_n is None or batch.eos_found_n.shape != (n,)):
        got = None if batch.eos_found_n is None else batch.eos_found_n.shape
        raise ValueError(
            f"overlong_filter is set: the batch must carry eos_found_n [N]={n}, got {got}"
        )
    if config.rollout_correction_mode is not None and batch.sampler_logp_nt is None:
        raise ValueError("rollout_correction_mode is set: the batch must carry sampler_logp_nt")
    if config.use_keep_mask and batch.keep_count_nt is None:
        raise ValueError("use_keep_mask is set: the batch must carry keep_count_nt")


def _check_batch(batch: GRPOBatch, config: GRPOConfig, state: TrainState) -> None:
    _check_rows(batch, config)
    n, nt = batch.tokens_ns.shape[0], batch.completion_mask_nt.shape
    per_update = config.num_minibatches * config.num_microbatches
    if batch.packing is not None:
        check_packing(batch.packing, n, nt[1], per_update)
    elif n % per_update:
        raise ValueError(
            f"N={n} rows must divide into num_minibatches x num_microbatches = {per_update}"
        )
    if config.share_prompt and batch.packing is None and n % (per_update * config.group_size):
        raise ValueError(
            f"share_prompt=True splits whole groups: N={n} rows must divide into "
            f"group_size x num_minibatches x num_microbatches = {per_update * config.group_size}"
        )
    if config.uses_reference and config.kl_estimator == "full" and not has_reference(state):
        raise ValueError(
            "kl_estimator='full' runs the reference inside the step: keep a reference in the "
            "state (create_train_state(..., with_ref=True))"
        )
    if config.uses_reference and batch.ref_logp_nt is None and not has_reference(state):
        raise ValueError(
            "beta > 0 needs reference logprobs: pass batch.ref_logp_nt or keep a reference "
            "in the state (create_train_state(..., with_ref=True))"
        )
    if config.ref_refresh_every is not None and is_lora(state.params):
        raise ValueError(
            "ref_refresh_every is not supported with LoRA: the reference is the base model "
            "(adapters off), of which there is one copy"
        )
    if config.ref_refresh_every is not None and state.ref_params is None:
        raise ValueError("ref_refresh_every is set but the state holds no ref_params")
    exact_only = config.kl_estimator == "full" and not config.reward_kl_coef
    if isinstance(state.ref_params, Teacher) and not (exact_only and config.beta > 0):
        raise ValueError(
            "a Teacher reference (another model) is read by the exact divergence only: "
            f"beta > 0, kl_estimator='full' and reward_kl_coef=0, got beta={config.beta}, "
            f"kl_estimator={config.kl_estimator!r}, reward_kl_coef={config.reward_kl_coef}"
        )
    if isinstance(state.ref_params, Teacher) and config.ref_refresh_every is not None:
        raise ValueError("ref_refresh_every copies the policy into its reference, not a Teacher")


def _prepare_rows(
    batch: GRPOBatch, config: GRPOConfig, token_rewards_nt: Array | None = None
) -> GRPOBatch:
    """The batch as the loss reads it: advantages (from the rewards when the batch has
    none; `token_rewards_nt`: REINFORCE++'s KL penalty, `_reward_kl`), DAPO's overlong
    filter applied to the completion mask, the reward-side fields dropped. Runs on the whole
    batch, before any split into mini- and micro-batches."""
    if batch.advantages is None:
        if config.reward_kl_coef > 0 and token_rewards_nt is None:
            raise ValueError("reward_kl_coef > 0: the advantages need token_rewards_nt")
        assert batch.rewards_n is not None  # _check_rows: no advantages, so rewards_n
        # Group statistics over the whole batch, inside the compiled program.
        adv = compute_advantages(
            batch.rewards_n,
            config,
            mask_nt=batch.completion_mask_nt,
            lengths_n=batch.lengths_n,
            valid_n=batch.valid_n,
            greedy_rewards_n=batch.greedy_rewards_n,
            rewards_nr=batch.rewards_nr,
            token_rewards_nt=token_rewards_nt,
        )
        batch = dataclasses.replace(batch, advantages=adv)
    if config.overlong_filter:
        # DAPO's overlong filtering: truncated completions leave the loss (after the group
        # statistics, which counted their rewards).
        lengths = jnp.sum(batch.completion_mask_nt, axis=1)
        assert batch.eos_found_n is not None  # _check_rows: overlong_filter needs it
        keep_n = truncated_completion_mask(lengths, batch.eos_found_n)
        batch = dataclasses.replace(
            batch, completion_mask_nt=batch.completion_mask_nt & keep_n[:, None]
        )
    advantages = jnp.asarray(batch.advantages, jnp.float32)
    batch = dataclasses.replace(
        batch,
        advantages=advantages,
        eos_found_n=None,
        rewards_n=None,
        valid_n=None,
        lengths_n=None,
        greedy_rewards_n=None,
        rewards_nr=None,
    )
    if config.off_policy_delta is not None and advantages.ndim != 1:
        raise ValueError("off-policy sequence masking needs sequence advantages [N]")
    return batch


def _blocks(x: Array, perm_n: Array, m: int, k: int, g: int) -> Array:
    """`[N, ...]` -> `[M, K, N/(M K), ...]` rows in `perm_n` order, split interleaved by
    units of g contiguous rows (g = G keeps groups whole, g = 1 splits rows)."""
    return _split_blocks(jnp.take(x, perm_n, axis=0), m, k, g)


def _split_blocks(x: Array, m: int, k: int, g: int) -> Array:
    """`[N, ...]` -> `[M, K, N/(M K), ...]` in units of g contiguous rows."""
    return jax.vmap(lambda y: split_units(y, k, g))(split_units(x, m, g))


def _block_batch(batch: GRPOBatch, perm_n: Array, m: int, k: int, g: int) -> GRPOBatch:
    """`_blocks` of every row field; a packing's bins (units of g = J slot rows) follow
    their slots (`Packing.permuted`)."""
    packing = batch.packing
    blocks = jax.tree.map(
        lambda x: _blocks(x, perm_n, m, k, g), dataclasses.replace(batch, packing=None)
    )
    if packing is None:
        return blocks
    bins = jax.tree.map(lambda x: _split_blocks(x, m, k, 1), packing.permuted(perm_n))
    return dataclasses.replace(blocks, packing=bins)


def _unblocks(x: Array, perm_n: Array, g: int) -> Array:
    """Inverse of `_blocks`."""
    flat = merge_units(jax.vmap(lambda y: merge_units(y, g))(x), g)
    return jnp.zeros_like(flat).at[perm_n].set(flat)


def _module(graphdef, params, adapters: bool = True):
    """The module of `params`; `adapters=False`: its LoRA adapters switched off (the
    reference policy of a LoRA run: the same base weights)."""
    model = nnx.merge(graphdef, params)
    if not adapters:
        model.lora_enabled = False  # a fresh module of this trace: nothing to restore
    return model


def _hidden(
    graphdef,
    params,
    mb: GRPOBatch,
    config: GRPOConfig,
    adapters: bool = True,
    dropout_key=None,
    replay: bool = True,
    with_load: bool = False,
) -> tuple[Scored, Array, float | None]:
    """(the forward's `Scored` hidden states and targets, lm_head `[D, V]`, the model's
    final-logit soft-cap or None); `replay`: the batch's `routing_nslk` replayed (the
    policy's forwards; a reference routes anew); `with_load`: the `Scored` carries the
    experts' load (`router_aux_coef`)."""
    model = _module(graphdef, params, adapters)
    scored = scored_hidden(
        model,
        mb.tokens_ns,
        mb.mask_ns,
        mb.completion_mask_nt.shape[1],
        group_size=config.group_size if config.share_prompt else 1,
        lora_dropout_key=dropout_key,
        packing=mb.packing,
        routing_nslk=mb.routing_nslk if replay else None,
        with_load=with_load,
    )
    return scored, model.lm_head_dv(), model.config.final_logit_softcapping


def _full_kl(graphdef, params, ref_params, mb: GRPOBatch, config: GRPOConfig, dropout_key=None):
    """(logp `[n, T]`, entropy or None, the exact `config.kl_divergence` of pi from pi_ref
    `[n, T]`, the policy forward's `moe.ExpertLoad` or None) from the policy's and the
    reference's hidden states, in vocabulary tiles (no `[n, T, V]` array)."""
    with_load = config.router_aux_coef > 0
    scored, w, cap = _hidden(
        graphdef, params, mb, config, dropout_key=dropout_key, with_load=with_load
    )
    mask = scored.from_rows(jnp.asarray(mb.completion_mask_nt, jnp.bool_))
    keep = mb.keep_count_nt if config.use_keep_mask else None
    logp, ent = logprobs_from_hidden(
        scored.hidden,
        w,
        scored.targets,
        mask,
        forward=config.forward,
        with_entropy=config.entropy_coef != 0,
        keep_count_nt=None if keep is None else scored.from_rows(keep),
        softcap=cap,
    )
    if isinstance(ref_params, Teacher):  # another model: its own graph
        ref, ref_w, ref_cap = _hidden(
            ref_params.graphdef, ref_params.params, mb, config, replay=False
        )
    elif ref_params is None and is_lora(params):  # the reference: base weights, adapters off
        ref, ref_w, ref_cap = _hidden(graphdef, params, mb, config, adapters=False, replay=False)
    else:
        ref, ref_w, ref_cap = _hidden(graphdef, ref_params, mb, config, replay=False)
    kl_nt = divergence_from_hidden(
        scored.hidden,
        w,
        jax.lax.stop_gradient(ref.hidden),
        jax.lax.stop_gradient(ref_w),
        mask,
        divergence=config.kl_divergence,
        beta=config.kl_jsd_beta,
        chunk_size=config.forward.chunk_size,
        vocab_chunk_size=config.forward.vocab_chunk_size,
        temperature=config.forward.temperature,
        softcap=cap,
        ref_softcap=ref_cap,
    )
    ent = None if ent is None else scored.to_rows(ent)
    return scored.to_rows(logp), ent, scored.to_rows(kl_nt), scored.load


def _forward_logp(
    graphdef,
    params,
    mb: GRPOBatch,
    config: GRPOConfig,
    *,
    with_entropy: bool,
    adapters=True,
    dropout_key=None,
    replay: bool = True,
    with_load: bool = False,
):
    """(logp `[n, T]`, entropy or None, the experts' load or None): `policy_logprobs` of the
    batch's rows with the step's forward settings."""
    scored, w, cap = _hidden(
        graphdef,
        params,
        mb,
        config,
        adapters=adapters,
        dropout_key=dropout_key,
        replay=replay,
        with_load=with_load,
    )
    keep = mb.keep_count_nt if config.use_keep_mask else None
    logp, ent = logprobs_from_hidden(
        scored.hidden,
        w,
        scored.targets,
        scored.from_rows(jnp.asarray(mb.completion_mask_nt, jnp.bool_)),
        forward=config.forward,
        with_entropy=with_entropy,
        keep_count_nt=None if keep is None else scored.from_rows(keep),
        softcap=cap,
    )
    return scored.to_rows(logp), None if ent is None else scored.to_rows(ent), scored.load


def _precompute_logp(
    graphdef,
    params,
    blocks: GRPOBatch,
    config: GRPOConfig,
    adapters: bool = True,
    replay: bool = True,
) -> Array:
    """Logprobs of every block `[M, K, n, T]` with the update's forward (no gradient)."""
    m, k = blocks.tokens_ns.shape[:2]
    flat = jax.tree.map(lambda x: x.reshape(m * k, *x.shape[2:]), blocks)

    def one(mb):
        return _forward_logp(
            graphdef, params, mb, config, with_entropy=False, adapters=adapters, replay=replay
        )[0]

    out = jax.lax.map(one, flat)
    return jax.lax.stop_gradient(out.reshape(m, k, *out.shape[1:]))


def _reward_kl(
    graphdef, params, ref_params, batch: GRPOBatch, config: GRPOConfig, blocks: int = 1
) -> tuple[Array, Array, Array]:
    """(old_logp_nt, ref_logp_nt, token rewards), each `[N, T]`: REINFORCE++'s KL penalty
    in the reward (`config.reward_kl_coef` > 0),

        token_reward_t = -reward_kl_coef * kl(old_logp_t, ref_logp_t)    (kl_estimator)

    at real tokens, 0 elsewhere. pi_old's and pi_ref's logprobs come from the batch or, where
    it has none, from forwards without gradient at `params` (pi_old: the step's input
    parameters) and `ref_params` (None: a LoRA policy's base, adapters off), on the batch's
    rows unpacked, in `blocks` contiguous chunks (groups kept whole)."""
    rows = dataclasses.replace(batch, packing=None, ptx=None)
    n = rows.tokens_ns.shape[0]
    unit = config.group_size if config.share_prompt else 1
    if n % (blocks * unit):
        blocks = 1

    def logp_of(p, adapters=True, replay=True):
        chunks = jax.tree.map(lambda x: x.reshape(1, blocks, n // blocks, *x.shape[1:]), rows)
        out = _precompute_logp(graphdef, p, chunks, config, adapters=adapters, replay=replay)
        return out.reshape(n, *out.shape[3:])

    old = rows.old_logp_nt
    if old is None:
        old = logp_of(params)
    ref = rows.ref_logp_nt
    if ref is None:
        ref = (
            logp_of(params, adapters=False, replay=False)
            if ref_params is None
            else logp_of(ref_params, replay=False)
        )
    mask = jnp.asarray(rows.completion_mask_nt, jnp.bool_)
    kl_nt = kl(old, ref, estimator=config.kl_estimator)
    rewards = jnp.where(mask, -config.reward_kl_coef * kl_nt, 0.0)
    return old, ref, jax.lax.stop_gradient(rewards)


@flax.struct.dataclass
class MiniBatchRows:
    """The rows of a whole mini-batch, for a policy loss with mini-batch statistics
    (`grpojax.train.objectives`: Clip-Cov, KL-Cov), as K micro-batches of n rows.

    logp_knt: `[K, n, T]` log-probabilities at the update's parameters (no gradient).
    old_logp_knt: `[K, n, T]` the old log-probabilities the loss compares them with.
    advantages: `[K, n]` or `[K, n, T]`.
    mask_knt: `[K, n, T]` real completion tokens.
    unit: rows per unit of the split (static): G with share_prompt (whole groups), else 1.
    """

    logp_knt: Array
    old_logp_knt: Array
    advantages: Array
    mask_knt: Array
    unit: int = flax.struct.field(pytree_node=False, default=1)


def _call_policy_loss(fn, config: GRPOConfig, logp, old_logp, adv, mask):
    """`fn(...)` checked: (`[N, T]` or `[N]` float32 loss, dict of float32 scalars)."""
    spec = config.policy_loss
    out = fn(logp, old_logp, adv, mask, config=config)
    if not (isinstance(out, tuple | list) and len(out) == 2 and isinstance(out[1], dict)):
        raise ValueError(
            f"policy_loss {spec!r} must return a pair (loss, metrics dict), got "
            f"{type(out).__name__}"
        )
    loss, metrics = jnp.asarray(out[0], jnp.float32), out[1]
    shape = tuple(mask.shape)
    if loss.shape not in (shape, shape[:1]):
        raise ValueError(
            f"policy_loss {spec!r} returned a loss of shape {loss.shape}; expected "
            f"[N, T]={shape} or [N]={shape[:1]}"
        )
    metrics = {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}
    for k, v in metrics.items():
        if v.shape != ():
            raise ValueError(f"policy_loss {spec!r}: metric {k!r} must be a scalar, got {v.shape}")
    return loss, metrics


def _policy_term(config, logp, old_logp, adv, mask, rows, micro_index):
    """The policy loss of this micro-batch's rows: computed on them alone, or (with `rows`,
    for a loss with mini-batch statistics) on the whole mini-batch, this micro-batch's rows
    carrying the gradient, then sliced back to them."""
    fn = resolve_policy_loss(config.policy_loss)
    if rows is None:
        return _call_policy_loss(fn, config, logp, old_logp, adv, mask)
    k, g = rows.logp_knt.shape[0], rows.unit

    def whole(x_knt, own):
        return merge_units(x_knt.at[micro_index].set(own), g)

    loss, metrics = _call_policy_loss(
        fn,
        config,
        whole(rows.logp_knt, logp),
        whole(rows.old_logp_knt, old_logp),
        merge_units(rows.advantages, g),
        merge_units(rows.mask_knt, g),
    )
    return split_units(loss, k, g)[micro_index], metrics


def grpo_micro_loss(
    params,
    mb: GRPOBatch,
    *,
    graphdef: nnx.GraphDef,
    config: GRPOConfig,
    denominator: Array,
    num_tokens: Array,
    old_from_current: bool | Array = False,
    num_sequences: Array | None = None,
    minibatch_rows: MiniBatchRows | None = None,
    micro_index: Array | int = 0,
    ref_params=None,
    lora_dropout_key: Array | None = None,
) -> tuple[Array, dict[str, Array]]:
    """The GRPO loss of one micro-batch, divided by the mini-batch's global denominator.

        loss_t = pg_coef w_t keep_i pg_t + beta kl_t - entropy_coef H_t
        loss   = aggregate(loss_nt, mask, mode=config.aggregation, denominator=denominator)

    With `config.entropy_aggregation="token-mean"` the entropy term leaves loss_t and is
    subtracted as entropy_coef * sum_t H_t / num_tokens (the update's token mean, TRL's).
    pg is `config.policy_loss` (`grpojax.train.objectives`). A policy loss with one value per
    sequence, pg_i (GMPO), enters as sum_i w_i keep_i pg_i / num_sequences (the mini-batch's
    non-empty sequences) plus the aggregated KL and entropy terms.

    Args:
      params: the policy's `nnx.State` (differentiated).
      mb: a micro-batch (`GRPOBatch` of n rows; `old_logp_nt` and, when beta > 0,
        `ref_logp_nt` filled in unless `old_from_current`).
      graphdef: the policy's graph definition (static).
      config: the step's configuration (static).
      denominator: `[]` the mini-batch's aggregation denominator (all its micro-batches).
      num_tokens: `[]` real tokens of the mini-batch, to weight the metrics.
      old_from_current: use `stop_gradient(logp)` as the old logprobs: True (static; the
        batch has none and there is one update), False, or a traced `[]` bool (true on the
        first update of a step, whose parameters are the ones the old logprobs describe:
        the ratio is then exactly 1 by construction, not up to the rounding of a
        differently fused forward).
      num_sequences: `[]` non-empty sequences of the mini-batch, the denominator of a
        per-sequence policy loss (None: this micro-batch's).
      minibatch_rows: for a policy loss with mini-batch statistics, the whole mini-batch
        (`MiniBatchRows`), of which this micro-batch is number `micro_index`; None: the
        loss sees this micro-batch only.
      micro_index: `[]` int, this micro-batch's index in `minibatch_rows`.
      ref_params: the reference's `nnx.State`, for `kl_estimator="full"` (its forward runs
        here, without gradient); unused otherwise. None with LoRA params: the reference is
        `params` with the adapters off.
      lora_dropout_key: the key of this micro-batch's LoRA adapter dropout (the policy's
        forward only; the reference has its adapters off), for params whose adapters have
        dropout > 0; None: no dropout.

    Returns:
      (loss `[]`, metrics): metrics already weighted so that summing over the micro-batches
      of a mini-batch (`combine_metrics`) gives mini-batch values.
    """
    loss, metrics, _ = _micro_loss(
        params,
        mb,
        graphdef=graphdef,
        config=config,
        denominator=denominator,
        num_tokens=num_tokens,
        old_from_current=old_from_current,
        num_sequences=num_sequences,
        minibatch_rows=minibatch_rows,
        micro_index=micro_index,
        ref_params=ref_params,
        lora_dropout_key=lora_dropout_key,
    )
    return loss, metrics


def _micro_loss(
    params,
    mb: GRPOBatch,
    *,
    graphdef,
    config: GRPOConfig,
    denominator,
    num_tokens,
    old_from_current,
    num_sequences,
    minibatch_rows,
    micro_index,
    ref_params,
    lora_dropout_key,
):
    """`grpo_micro_loss` and the forward's per-token arrays: (loss, metrics, (logp_nt,
    old_logp_nt, entropy_nt or None)), each `[n, T]`. With `config.router_aux_coef` > 0 the
    loss adds coef * L_aux / num_microbatches (the micro-batches' mean of the mixture of
    experts' load-balancing loss over a mini-batch; `grpojax.models.moe`)."""
    mask = jnp.asarray(mb.completion_mask_nt, jnp.bool_)
    full_kl_nt = None
    with_load = config.router_aux_coef > 0
    if config.uses_reference and config.kl_estimator == "full":
        logp, ent, full_kl_nt, load = _full_kl(
            graphdef, params, ref_params, mb, config, dropout_key=lora_dropout_key
        )
    else:
        with_entropy = config.entropy_coef != 0
        logp, ent, load = _forward_logp(
            graphdef,
            params,
            mb,
            config,
            with_entropy=with_entropy,
            dropout_key=lora_dropout_key,
            with_load=with_load,
        )
    if old_from_current is True:
        old_logp = jax.lax.stop_gradient(logp)
    elif old_from_current is False:
        old_logp = mb.old_logp_nt
    else:
        # Array-valued old_from_current: the caller filled old_logp_nt in (see grpo_micro_loss).
        old = cast(Array, mb.old_logp_nt)
        old_logp = jnp.where(old_from_current, jax.lax.stop_gradient(logp), old)
    loss, metrics = _loss_terms(
        logp,
        old_logp,
        mb.advantages,
        mask,
        config=config,
        ref_logp_nt=mb.ref_logp_nt,
        sampler_logp_nt=mb.sampler_logp_nt,
        entropy_nt=ent,
        full_kl_nt=full_kl_nt,
        denominator=denominator,
        num_tokens=num_tokens,
        num_sequences=num_sequences,
        minibatch_rows=minibatch_rows,
        micro_index=micro_index,
    )
    if with_load:
        if load is None:
            raise ValueError("router_aux_coef > 0 needs a mixture-of-experts model")
        aux = load_balancing_loss(load)
        loss = loss + config.router_aux_coef * aux / config.num_microbatches
        metrics = {**metrics, "router_aux_loss": aux}
    return loss, metrics, (logp, old_logp, ent)


def _loss_terms(
    logp,
    old_logp,
    advantages,
    mask,
    *,
    config: GRPOConfig,
    ref_logp_nt,
    sampler_logp_nt,
    entropy_nt,
    full_kl_nt,
    denominator,
    num_tokens,
    num_sequences,
    minibatch_rows,
    micro_index,
):
    """The loss of `grpo_micro_loss` from its per-token arrays (everything after the
    forward): (loss, metrics)."""
    ent = entropy_nt
    pg, pm = _policy_term(config, logp, old_logp, advantages, mask, minibatch_rows, micro_index)
    per_sequence = pg.ndim == 1
    keep_n = jnp.ones(mask.shape[:1], jnp.bool_)
    if config.off_policy_delta is not None:
        behaviour = old_logp if sampler_logp_nt is None else sampler_logp_nt
        keep_n = off_policy_sequence_mask(
            logp, behaviour, advantages, mask, delta=config.off_policy_delta
        )
    rc_metrics = None
    if config.rollout_correction_mode is not None:
        weight_nt, rc_metrics = rollout_correction(
            old_logp,
            sampler_logp_nt,
            mask,
            level=config.rollout_correction_level,
            mode=config.rollout_correction_mode,
            low=config.rollout_correction_low,
            high=config.rollout_correction_high,
        )
        if per_sequence:
            if config.rollout_correction_level != "sequence":
                raise ValueError(
                    f"policy_loss {config.policy_loss!r} returns one loss per sequence [N]: "
                    "rollout_correction_level must be 'sequence'"
                )
            # Sequence-level weights are one value on every real token of the row.
            pg = pg * jnp.max(weight_nt, axis=-1)
        else:
            pg = pg * weight_nt
    agg: dict[str, Any] = dict(
        mode=config.aggregation, norm_constant=norm_constant_for(config, mask.shape[1])
    )
    if per_sequence:
        nonempty_n = jnp.any(mask, axis=-1)
        pg_n = jnp.where(nonempty_n, pg * keep_n.astype(jnp.float32), 0.0)
        if num_sequences is None:
            num_sequences = jnp.sum(nonempty_n, dtype=jnp.float32)
        pg_loss = jnp.where(num_sequences > 0, jnp.sum(pg_n) / jnp.maximum(num_sequences, 1), 0.0)
        total_nt = jnp.zeros(mask.shape, jnp.float32)
    else:
        pg_nt = pg * keep_n[:, None].astype(jnp.float32)
        # pg_coef (on-policy distillation's rl_coef) weighs the term; 1 is the RL algorithms'.
        total_nt = pg_nt if config.pg_coef == 1.0 else config.pg_coef * pg_nt

    n_tok = jnp.sum(mask, dtype=jnp.float32)
    share = n_tok / jnp.maximum(num_tokens, 1.0)

    def token_mean(x):
        return masked_mean(x, mask) * share

    # The loss's own diagnostics first: the step's names below take precedence.
    metrics: dict[str, Array] = {}
    for name, v in pm.items():
        key = "approx_kl" if name == "approx_kl_k3" else name
        metrics[key] = v if name.endswith(("_min", "_max")) else v * share
    if config.uses_reference:
        if full_kl_nt is not None:
            kl_nt = full_kl_nt
        elif config.kl_is_corrected:
            kl_nt = kl_is_corrected(logp, old_logp, ref_logp_nt)
        else:
            kl_nt = kl(logp, ref_logp_nt, estimator=config.kl_estimator)
        kl_nt = jnp.where(mask, kl_nt, 0.0)
        total_nt = total_nt + config.beta * kl_nt
        metrics["kl_loss"] = aggregate(kl_nt, mask, **agg, denominator=denominator)
        metrics["kl_ref"] = token_mean(jax.lax.stop_gradient(kl_nt))
    bonus: float | Array = 0.0  # the entropy term when it is not aggregated with the loss
    if ent is not None:
        ent = jnp.where(mask, ent, 0.0)
        if config.entropy_aggregation == "token-mean":
            # TRL's bonus: the token mean of the update (this micro-batch's share of it).
            bonus = config.entropy_coef * jnp.sum(ent) / jnp.maximum(num_tokens, 1.0)
        else:
            total_nt = total_nt - config.entropy_coef * ent
        metrics["entropy"] = token_mean(jax.lax.stop_gradient(ent))
    if per_sequence:
        weighted = pg_loss if config.pg_coef == 1.0 else config.pg_coef * pg_loss
        loss = weighted + aggregate(total_nt, mask, **agg, denominator=denominator) - bonus
        metrics["pg_loss"] = jax.lax.stop_gradient(pg_loss)
    else:
        loss = aggregate(total_nt, mask, **agg, denominator=denominator) - bonus
        metrics["pg_loss"] = jax.lax.stop_gradient(
            aggregate(pg_nt, mask, **agg, denominator=denominator)
        )
    metrics["kept_seq_frac"] = jnp.sum(keep_n & jnp.any(mask, axis=-1), dtype=jnp.float32)
    if rc_metrics is not None:
        for name, v in rc_metrics.items():
            metrics[f"rollout_{name}"] = v * share
    metrics = {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}
    return loss, metrics


def _update_counts(mask: Array, config: GRPOConfig) -> tuple[Array, Array, Array]:
    """(aggregation denominator, real tokens, non-empty sequences) of one update's rows,
    mask `[..., T]` (every leading axis is rows): the global counts its micro losses
    divide by."""
    flat_mask = mask.reshape(-1, mask.shape[-1])
    _, den = aggregate_parts(
        jnp.zeros(flat_mask.shape, jnp.float32),
        flat_mask,
        mode=config.aggregation,
        norm_constant=norm_constant_for(config, flat_mask.shape[1]),
    )
    num_tokens = jnp.sum(flat_mask, dtype=jnp.float32)
    num_sequences = jnp.sum(jnp.any(flat_mask, axis=-1), dtype=jnp.float32)
    return den, num_tokens, num_sequences


def _summarise(per_update: dict[str, Array]) -> dict[str, Array]:
    out = {}
    for name, v in per_update.items():
        if name.endswith("_min"):
            out[name] = jnp.min(v)
        elif name.endswith("_max"):
            out[name] = jnp.max(v)
        elif name == "skipped":
            out["skipped"] = jnp.sum(v)
        else:
            out[name] = jnp.mean(v)
    for name in ("loss", "ratio_min", "ratio_max", "grad_norm"):
        if name in per_update:
            out[f"first_{name}"] = per_update[name][0]
    out["lr"] = per_update["lr"][-1]
    return out


def grpo_loss_from_logprobs(
    logp_nt: Array,
    old_logp_nt: Array,
    advantages: Array,
    mask_nt: Array,
    *,
    config: GRPOConfig,
    ref_logp_nt: Array | None = None,
    sampler_logp_nt: Array | None = None,
    entropy_nt: Array | None = None,
) -> tuple[Array, dict[str, Array]]:
    """The GRPO step's loss from per-token log-probabilities, the N rows as one update.

        loss_t = pg_coef w_t keep_i pg_t + beta kl_t - entropy_coef H_t
        loss   = aggregate(loss_nt, mask_nt, mode=config.aggregation)

    The same code as the step after its forward (`grpo_micro_loss`), for research code with
    its own model: differentiate through `logp_nt`. pg is `config.policy_loss`, kl the
    per-token `config.kl_estimator`, and the entropy term follows
    `config.entropy_aggregation` (see `GRPOConfig`).

    Args:
      logp_nt: `[N, T]` float32 log pi_theta of the sampled tokens (the gradient flows
        through it); padding may hold finite garbage.
      old_logp_nt: `[N, T]` log pi_old; `stop_gradient(logp_nt)` for the first update of a
        batch (ratio 1).
      advantages: `[N]` or `[N, T]` (e.g. `compute_advantages(rewards_n, config)`).
      mask_nt: `[N, T]` bool real completion tokens (from lengths).
      config: the `GRPOConfig` (static).
      ref_logp_nt: `[N, T]` log pi_ref; required when `config.beta` > 0 (a per-token
        estimator: "full" needs hidden states, use `grpo_loss`).
      sampler_logp_nt: `[N, T]` the sampler's logprobs; required by rollout correction,
        read by off-policy masking when given.
      entropy_nt: `[N, T]` per-token entropy H_t of the policy; required when
        `config.entropy_coef` != 0.

    Returns:
      (loss `[]`, metrics): the step's per-update metrics (`pg_loss`, `kl_loss`, `kl_ref`,
      `entropy`, `kept_seq_frac`, the policy loss's own), float32 scalars.
    """
    logp = jnp.asarray(logp_nt, jnp.float32)
    mask = jnp.asarray(mask_nt, jnp.bool_)
    if logp.ndim != 2 or mask.shape != logp.shape:
        raise ValueError(
            f"logp_nt and mask_nt must both be [N, T], got {logp.shape} and {mask.shape}"
        )
    arrays = {
        "old_logp_nt": old_logp_nt,
        "ref_logp_nt": ref_logp_nt,
        "sampler_logp_nt": sampler_logp_nt,
        "entropy_nt": entropy_nt,
    }
    for name, x in arrays.items():
        if x is not None and jnp.shape(x) != logp.shape:
            raise ValueError(f"{name} must be [N, T]={logp.shape}, got {jnp.shape(x)}")
    if jnp.shape(advantages) not in (logp.shape[:1], logp.shape):
        raise ValueError(
            f"advantages must be [N]={logp.shape[:1]} or [N, T]={logp.shape}, got "
            f"{jnp.shape(advantages)}"
        )
    needs = {
        "ref_logp_nt": config.uses_reference,
        "sampler_logp_nt": config.rollout_correction_mode is not None,
        "entropy_nt": config.entropy_coef != 0,
    }
    for name, needed in needs.items():
        if needed and arrays[name] is None:
            raise ValueError(f"{name} is required by this config ({_why(name)})")
    if config.uses_reference and config.kl_estimator == "full":
        raise ValueError(
            "kl_estimator='full' needs the models' hidden states: use grpo_loss, or a "
            "per-token kl_estimator here"
        )
    if config.off_policy_delta is not None and jnp.ndim(advantages) != 1:
        raise ValueError("off-policy sequence masking needs sequence advantages [N]")
    den, num_tokens, num_sequences = _update_counts(mask, config)
    f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
    loss, metrics = _loss_terms(
        logp,
        f32(old_logp_nt),
        f32(advantages),
        mask,
        config=config,
        ref_logp_nt=None if ref_logp_nt is None else f32(ref_logp_nt),
        sampler_logp_nt=None if sampler_logp_nt is None else f32(sampler_logp_nt),
        entropy_nt=None if entropy_nt is None or config.entropy_coef == 0 else f32(entropy_nt),
        full_kl_nt=None,
        denominator=den,
        num_tokens=num_tokens,
        num_sequences=num_sequences,
        minibatch_rows=None,
        micro_index=0,
    )
    metrics["kept_seq_frac"] = metrics["kept_seq_frac"] / jnp.maximum(num_sequences, 1.0)
    return loss, metrics


def _why(name: str) -> str:
    return {
        "ref_logp_nt": "beta > 0",
        "sampler_logp_nt": "rollout_correction_mode is set",
        "entropy_nt": "entropy_coef != 0",
    }[name]


def grpo_loss(
    model,
    batch: GRPOBatch,
    config: GRPOConfig,
    *,
    ref_params=None,
    with_grads: bool = False,
) -> tuple[Array, dict[str, Any]]:
    """The GRPO loss of a batch at the model's parameters, without an optimizer update.

        loss = aggregate(w_t keep_i pg_t + beta kl_t - entropy_coef H_t)   (`GRPOConfig`)

    Exactly the first update of `grpo_update` on the same batch, with the whole batch as one
    update (no mini- or micro-batches, no shuffle): the step's own functions prepare the
    batch (advantages from `rewards_n` when it has none, DAPO's overlong filter), run the
    forward and compute the loss, and `with_grads=True` differentiates what the step
    differentiates (a LoRA model: its adapters). Pure and traceable: call it inside your
    own `jax.jit` (closing over the model's graph and the config).

    Args:
      model: an `nnx.Module` whose state is only `nnx.Param`s, or a `(graphdef, params)`
        pair (e.g. `create_train_state`'s graph and `state.params`).
      batch: a `GRPOBatch` of N rows (`grpo_batch_from_ids` builds one from token-id
        lists), unpacked. Without `old_logp_nt` the old policy is the model itself
        (`stop_gradient(logp)`: every ratio is 1, the step's first update).
      config: the `GRPOConfig` (static); its num_epochs / num_minibatches /
        num_microbatches / shuffle are not used.
      ref_params: the reference policy's params, for beta > 0 when the batch has no
        `ref_logp_nt` (and for `kl_estimator="full"`); None with a LoRA model: its base
        weights with the adapters off, as in the step.
      with_grads: also return the gradient of the loss.

    LoRA adapter dropout is not applied (the loss is deterministic).

    Returns:
      (loss `[]`, aux) with aux: "logp_nt" `[N, T]` log pi_theta of the completion tokens,
      "old_logp_nt" `[N, T]`, "ref_logp_nt" `[N, T]` or None, "advantages" `[N]` or
      `[N, T]` (as the loss used them), "completion_mask_nt" `[N, T]` (after the overlong
      filter), "entropy_nt" `[N, T]` or None (entropy_coef = 0), "metrics" (the step's
      per-update metrics, with "loss", and "grad_norm" when `with_grads`), and "grads"
      (like the params, or a LoRA model's adapters) when `with_grads`.
    """
    if isinstance(model, tuple | list) and len(model) == 2:
        graphdef, params = model
    elif isinstance(model, nnx.Module):
        graphdef, params = split_params(model)
    else:
        raise ValueError(
            f"model must be an nnx.Module or a (graphdef, params) pair, got {type(model).__name__}"
        )
    _check_rows(batch, config)
    n = batch.tokens_ns.shape[0]
    if batch.packing is not None:
        raise ValueError("grpo_loss takes unpacked rows: batch.packing must be None")
    if config.share_prompt and n % config.group_size:
        raise ValueError(
            f"share_prompt=True reads contiguous groups: N={n} rows must divide into "
            f"group_size={config.group_size}"
        )
    full_kl = config.uses_reference and config.kl_estimator == "full"
    if config.uses_reference and ref_params is None and not is_lora(params):
        if full_kl or batch.ref_logp_nt is None:
            raise ValueError(
                "beta > 0 needs the reference: pass ref_params"
                + ("" if full_kl else " or batch.ref_logp_nt")
            )
    one = dataclasses.replace(config, num_minibatches=1, num_microbatches=1)
    ptx = ptx_minibatches(batch.ptx, one)
    token_rewards = None
    if config.reward_kl_coef > 0 and batch.advantages is None:
        _, ref, token_rewards = _reward_kl(graphdef, params, ref_params, batch, config)
        batch = dataclasses.replace(batch, ref_logp_nt=ref)
    batch = _prepare_rows(dataclasses.replace(batch, ptx=None), config, token_rewards)
    if full_kl:
        batch = dataclasses.replace(batch, ref_logp_nt=None)
    elif config.uses_reference and batch.ref_logp_nt is None:
        block = jax.tree.map(lambda x: x[None, None], batch)  # the step's [M, K, n] layout
        if ref_params is None:  # LoRA: the base weights, adapters off
            ref = _precompute_logp(graphdef, params, block, config, adapters=False, replay=False)
        else:
            ref = _precompute_logp(graphdef, ref_params, block, config, replay=False)
        batch = dataclasses.replace(batch, ref_logp_nt=ref[0, 0])
    den, num_tokens, num_sequences = _update_counts(
        jnp.asarray(batch.completion_mask_nt, jnp.bool_), config
    )
    trainable, frozen = trainable_split(params)

    def loss_fn(p):
        full = join_trainable(p, frozen)
        loss, metrics, arrays = _micro_loss(
            full,
            batch,
            graphdef=graphdef,
            config=config,
            denominator=den,
            num_tokens=num_tokens,
            old_from_current=batch.old_logp_nt is None,
            num_sequences=num_sequences,
            minibatch_rows=None,
            micro_index=0,
            ref_params=ref_params if full_kl else None,
            lora_dropout_key=None,
        )
        if ptx is not None:
            ptx_mb = jax.tree.map(lambda x: x[0, 0], ptx)
            term, metrics["ptx_loss"] = ptx_micro_loss(
                full, ptx_mb, graphdef=graphdef, config=config, num_tokens=num_targets(ptx_mb)
            )
            loss = loss + term
        return loss, (metrics, arrays)

    if with_grads:
        (loss, (metrics, arrays)), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable)
        metrics["grad_norm"] = optax.tree.norm(grads).astype(jnp.float32)
    else:
        loss, (metrics, arrays) = loss_fn(trainable)
    metrics["kept_seq_frac"] = metrics["kept_seq_frac"] / jnp.maximum(num_sequences, 1.0)
    metrics["loss"] = loss
    logp, old_logp, ent = arrays
    aux = {
        "logp_nt": jax.lax.stop_gradient(logp),
        "old_logp_nt": old_logp,
        "ref_logp_nt": batch.ref_logp_nt,
        "advantages": batch.advantages,
        "completion_mask_nt": batch.completion_mask_nt,
        "entropy_nt": None if ent is None else jax.lax.stop_gradient(ent),
        "metrics": metrics,
    }
    if with_grads:
        aux["grads"] = grads
    return loss, aux


def grpo_update(
    state: TrainState,
    batch: GRPOBatch,
    *,
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    config: GRPOConfig,
    schedule: optax.Schedule | None = None,
) -> tuple[TrainState, dict[str, Array]]:
    """One GRPO step: mu epochs x M mini-batches of updates, as a pure function.

    Args:
      state: the `TrainState` (policy params, optimizer, key, optional reference).
      batch: a `GRPOBatch` of N rows; N divisible by M x K. Its advantages, or (when they
        are None) its rewards, from which the step computes them (`compute_advantages`).
      graphdef: the policy's graph definition (static).
      tx: the optimizer (`make_optimizer`).
      config: a `GRPOConfig` (static).
      schedule: optional learning-rate schedule for the `lr` metric.

    Returns:
      (new_state, metrics): scalars averaged over the mu x M updates (`*_min` / `*_max`
      over all of them, `skipped` summed), `first_loss` / `first_ratio_min` /
      `first_ratio_max` / `first_grad_norm` of the first update (taken at the step's input
      parameters; the ratio ones when the policy loss reports `ratio_min` / `ratio_max`, as
      every built-in does), `skipped_total` (running count), `lr`. Besides the step's own
      (`loss`, `pg_loss`, `kl_loss`, `kl_ref`, `entropy`, `kept_seq_frac`, `grad_norm`), the
      policy loss's metrics under their names (`approx_kl_k3` as `approx_kl`) and, with
      rollout correction, `rollout_weight_mean`, `rollout_masked_frac`,
      `rollout_truncated_frac`, `rollout_kl_k1`, `rollout_kl_k3` (KL(pi_sampler || pi_old)),
      and with `ptx_coef` > 0 `ptx_loss`, the mean next-token NLL per target token of the
      ptx rows (`loss` includes ptx_coef times it).
    """
    _check_batch(batch, config, state)
    m, k, mu = config.num_minibatches, config.num_microbatches, config.num_epochs
    # `[M, K, n', S']` or None (ptx_coef = 0); out of the batch before its rows are permuted.
    ptx_blocks = ptx_minibatches(batch.ptx, config)
    batch = dataclasses.replace(batch, ptx=None)
    packing = batch.packing
    if packing is None:
        n = batch.tokens_ns.shape[0]
        unit = config.group_size if config.share_prompt else 1
    else:  # the bins are the units: J slot rows each, R*J rows in slot order (below)
        unit = packing.num_slots
        n = packing.rows_rj.shape[0] * unit
    # LoRA dropout (p > 0): the gradient forwards drop the adapters' input with keys from a
    # third split of the state's key (so p = 0 runs draw exactly the keys they always did);
    # pi_old's logprobs are then computed without dropout, never taken from a dropped forward.
    dropout = lora_dropout_rate(_module(graphdef, state.params))
    if dropout > 0:
        rng, shuffle_key, dropout_key = jax.random.split(state.rng, 3)
    else:
        rng, shuffle_key = jax.random.split(state.rng)
        dropout_key = None
    if config.shuffle:
        keys = jax.random.split(shuffle_key, mu)
        perms = jnp.stack([unit_permutation(key, n, unit) for key in keys])
    else:
        perms = jnp.broadcast_to(jnp.arange(n), (mu, n))
    token_rewards = None
    if config.reward_kl_coef > 0 and batch.advantages is None:
        # REINFORCE++'s KL in the reward: pi_old's and pi_ref's logprobs before the
        # advantages (kept for the loss; pi_old only where the loss would precompute it).
        old, ref, token_rewards = _reward_kl(
            graphdef, state.params, state.ref_params, batch, config, blocks=m * k
        )
        batch = dataclasses.replace(batch, ref_logp_nt=ref)
        if not (mu == 1 and m == 1 and dropout == 0):
            batch = dataclasses.replace(batch, old_logp_nt=old)
    batch = _prepare_rows(batch, config, token_rewards)
    if packing is not None:
        # Every row field into slot order, bin by bin; empty slots are rows with no tokens.
        slots = jax.tree.map(packing.to_slots, dataclasses.replace(batch, packing=None))
        batch = dataclasses.replace(slots, packing=packing)
    with_rows = uses_minibatch_statistics(resolve_policy_loss(config.policy_loss)) and k > 1

    single_update = mu == 1 and m == 1 and dropout == 0
    old_from_current = batch.old_logp_nt is None and single_update
    need_old = batch.old_logp_nt is None and not single_update
    full_kl = config.uses_reference and config.kl_estimator == "full"
    if full_kl:  # the exact KL needs the reference's hidden states, not its logprobs
        batch = dataclasses.replace(batch, ref_logp_nt=None)
    need_ref = config.uses_reference and not full_kl and batch.ref_logp_nt is None
    if need_old or need_ref:
        blocks0 = _block_batch(batch, perms[0], m, k, unit)
        if need_old:
            old = _precompute_logp(graphdef, state.params, blocks0, config)
            batch = dataclasses.replace(batch, old_logp_nt=_unblocks(old, perms[0], unit))
        if need_ref and state.ref_params is None:  # LoRA: the base weights, adapters off
            ref = _precompute_logp(
                graphdef, state.params, blocks0, config, adapters=False, replay=False
            )
            batch = dataclasses.replace(batch, ref_logp_nt=_unblocks(ref, perms[0], unit))
        elif need_ref:
            ref = _precompute_logp(graphdef, state.ref_params, blocks0, config, replay=False)
            batch = dataclasses.replace(batch, ref_logp_nt=_unblocks(ref, perms[0], unit))

    def minibatch_step(st: TrainState, xs):
        mini, first_update, ptx_mini, update_index = xs
        mask = jnp.asarray(mini.completion_mask_nt, jnp.bool_)
        den, num_tokens, num_sequences = _update_counts(mask, config)
        old_now = True if old_from_current else (first_update & need_old)
        if dropout > 0:  # the old logprobs stay the undropped forward's (precomputed)
            old_now = False
        rows = None
        if with_rows:
            # The loss's statistics span the mini-batch: the other micro-batches' logprobs at
            # these parameters, one forward without gradient.
            now = _precompute_logp(
                graphdef, st.params, jax.tree.map(lambda x: x[None], mini), config
            )
            now = now[0]
            if old_now is True:
                old = now
            elif need_old:
                old = jnp.where(first_update, now, mini.old_logp_nt)
            else:
                old = mini.old_logp_nt
            rows = MiniBatchRows(
                logp_knt=now,
                old_logp_knt=old,
                advantages=mini.advantages,
                mask_knt=mask,
                unit=unit,
            )

        def loss_fn(params, xs):
            mb, j, ptx_mb = xs
            key = None
            if dropout_key is not None:
                key = jax.random.fold_in(jax.random.fold_in(dropout_key, update_index), j)
            loss, metrics = grpo_micro_loss(
                params,
                mb,
                graphdef=graphdef,
                config=config,
                denominator=den,
                num_tokens=num_tokens,
                old_from_current=old_now,
                num_sequences=num_sequences,
                minibatch_rows=rows,
                micro_index=j,
                ref_params=st.ref_params if full_kl else None,
                lora_dropout_key=key,
            )
            if ptx_mb is not None:
                term, metrics["ptx_loss"] = ptx_micro_loss(
                    params, ptx_mb, graphdef=graphdef, config=config, num_tokens=ptx_tokens
                )
                loss = loss + term
            return loss, metrics

        ptx_tokens = None if ptx_mini is None else num_targets(ptx_mini)
        micro = (mini, jnp.arange(k), ptx_mini)
        # LoRA: differentiate the adapters only (no base-weight gradients are computed).
        trainable, frozen = trainable_split(st.params)
        loss, grads, aux = accumulate_gradients(
            lambda p, xs: loss_fn(join_trainable(p, frozen), xs), trainable, micro, k
        )
        st, upd = apply_gradients(st, tx, grads, loss=loss, schedule=schedule)
        # Kept among the mini-batch's sequences (not its empty rows, e.g. packing's slots).
        aux["kept_seq_frac"] = aux["kept_seq_frac"] / jnp.maximum(num_sequences, 1.0)
        return st, {"loss": loss, **aux, **upd}

    def epoch_step(st: TrainState, xs):
        perm_n, epoch = xs
        blocks = _block_batch(batch, perm_n, m, k, unit)
        first = (epoch == 0) & (jnp.arange(m) == 0)
        update_index = epoch * m + jnp.arange(m)
        return jax.lax.scan(minibatch_step, st, (blocks, first, ptx_blocks, update_index))

    state, per_update = jax.lax.scan(epoch_step, state, (perms, jnp.arange(mu)))
    per_update = jax.tree.map(lambda v: v.reshape(mu * m), per_update)
    metrics = _summarise(per_update)

    new_step = state.step + 1
    ref_params = state.ref_params
    if config.ref_refresh_every is not None:
        refresh = (new_step % config.ref_refresh_every) == 0
        ref_params = jax.tree.map(
            # The reference keeps its own (compute) dtype: the masters are cast into it.
            lambda p, r: jnp.where(refresh, p.astype(r.dtype), r),
            state.params,
            state.ref_params,
        )
        metrics["ref_refreshed"] = refresh.astype(jnp.float32)
    state = dataclasses.replace(state, step=new_step, rng=rng, ref_params=ref_params)
    metrics["skipped_total"] = state.skipped.astype(jnp.float32)
    return state, metrics


def make_grpo_step(
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    config: GRPOConfig,
    *,
    mesh: Mesh,
    state_shardings: Any,
    batch: GRPOBatch,
    schedule: optax.Schedule | None = None,
    donate: bool = True,
):
    """The jitted GRPO step, `step(state, batch) -> (state, metrics)`: the one call site.

    Args:
      graphdef: as `grpo_update` (closed over, static).
      tx: as `grpo_update` (closed over, static).
      config: as `grpo_update` (closed over, static).
      schedule: as `grpo_update` (closed over, static).
      mesh: the (data, fsdp, tensor) mesh (a mesh of one device works the same).
      state_shardings: from `grpojax.train.state.shard_train_state` /
        `train_state_shardings`.
      batch: an example batch (shapes and which optional fields are present fix the
        shardings; a batch with other shapes recompiles).
      donate: donate the input state's buffers.
    """

    return make_update_step(
        grpo_update,
        graphdef=graphdef,
        tx=tx,
        config=config,
        mesh=mesh,
        state_shardings=state_shardings,
        batch=batch,
        schedule=schedule,
        donate=donate,
    )


__all__ = [
    "GRPOBatch",
    "MiniBatchRows",
    "grpo_batch_from_ids",
    "grpo_batch_from_rollout",
    "grpo_loss",
    "grpo_loss_from_logprobs",
    "grpo_micro_loss",
    "grpo_update",
    "make_grpo_step",
]
