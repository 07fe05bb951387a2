"""The GRPO step's batch: `GRPOBatch`, N = B*G rows in the rollout layout.

`grpo_batch_from_rows` builds one from a step's sampled rows (`grpojax.train.rows.TrainBatch`:
the driver's path, rewards in, advantages computed inside the step),
`grpo_batch_from_rollout` from a `grpojax.sampling.Rollout` by that same path (its rewards, or
advantages computed outside),
`grpo_batch_from_ids` from Python lists of token ids. `_check_rows` checks a batch's own
fields against the config; `_prepare_rows` gives its rows as the loss reads them
(advantages computed from the rewards inside the step, DAPO's overlong filter), before any
split into mini-batches.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import flax.struct
import jax.numpy as jnp
import numpy as np
from jax import Array
from jax.sharding import Mesh

from grpojax.data.source import pad_token_ids
from grpojax.models.sharding import batch_sharding, make_mesh, put_global
from grpojax.ops.checks import check_int
from grpojax.ops.corrections import truncated_completion_mask
from grpojax.ops.masks import prompt_width as default_prompt_width
from grpojax.train.config import GRPOConfig, compute_advantages
from grpojax.train.objectives import estimator_inputs
from grpojax.train.packing import Packing
from grpojax.train.rows import TrainBatch, assemble_batch, rollout_groups
from grpojax.train.sft import SFTBatch


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


def grpo_batch_from_rows(
    batch: TrainBatch,
    config: GRPOConfig,
    *,
    old_logp_nt: Array | None = None,
    ref_logp_nt: Array | None = None,
    ptx: SFTBatch | None = None,
) -> GRPOBatch:
    """The `GRPOBatch` of a step's sampled rows, with what `config` reads of them: the
    rewards (advantages computed inside the step; the estimator's extra inputs), the
    reference's logprobs when it keeps a reference, the sampler's logprobs for rollout
    correction or off-policy masking, the kept-set sizes for the keep mask, the ptx rows
    when ptx_coef > 0, and each completion's end (`TrainBatch.host["eos_n"]`, placed like
    the rows) for the overlong filter. `old_logp_nt`: pi_old of a step that updates more
    than once (None: the step's own forward)."""
    g = config
    return GRPOBatch(
        tokens_ns=batch.tokens_ns,
        mask_ns=batch.mask_ns,
        completion_mask_nt=batch.completion_mask_nt,
        old_logp_nt=old_logp_nt,
        ref_logp_nt=ref_logp_nt if g.uses_reference else None,
        sampler_logp_nt=batch.sampler_logp_nt if g.uses_sampler_logp else None,
        keep_count_nt=batch.keep_count_nt if g.use_keep_mask else None,
        rewards_n=batch.rewards_n,
        valid_n=batch.valid_n,
        lengths_n=batch.lengths_n,
        ptx=ptx if g.ptx_coef else None,
        greedy_rewards_n=batch.greedy_rewards_n,
        rewards_nr=batch.rewards_nr,
        packing=batch.packing,
        eos_found_n=(
            put_global(np.asarray(batch.host["eos_n"], bool), batch.valid_n.sharding)
            if g.overlong_filter
            else None
        ),
        routing_nslk=batch.routing_nslk,
    )


def grpo_batch_from_rollout(
    rollout,
    *,
    config: GRPOConfig,
    rewards: Array | None = None,
    advantages: Array | None = None,
    valid: Array | None = None,
    mesh: Mesh | None = None,
    old_logp_nt: Array | None = None,
    ref_logp_nt: Array | None = None,
) -> GRPOBatch:
    """A `GRPOBatch` of a `grpojax.sampling.Rollout`'s N = B*G rows, by the driver's path:
    `rollout_groups` -> `assemble_batch` (the library's prompt width, masks from lengths)
    -> `grpo_batch_from_rows` (what `config` reads of them).

    Args:
      rollout: one `generate` call's result (its arrays addressable in this process).
      config: the step's config.
      rewards: `[N]` sequence rewards: the step computes the advantages
        (`config.advantage_estimator`). Or
      advantages: `[N]` or `[N, T]` advantages computed outside (e.g. `compute_advantages`);
        exactly one of the two.
      valid: `[N]` bool samples whose reward is valid (None: all); invalid ones train on
        nothing.
      mesh: where the batch goes (its rows over the data axes); None: the mesh of the
        rollout's arrays, or one over their devices.
      old_logp_nt: `[N, T]` pi_old (None: computed in the step).
      ref_logp_nt: `[N, T]` pi_ref (None: computed in the step from the reference).
    """
    if (rewards is None) == (advantages is None):
        raise ValueError("grpo_batch_from_rollout: give exactly one of rewards= or advantages=")
    if mesh is None:
        sharding = rollout.tokens_nt.sharding
        mesh = getattr(sharding, "mesh", None) or make_mesh(devices=list(sharding.device_set))
    n = rollout.tokens_nt.shape[0]
    groups, rows = rollout_groups(rollout, np.zeros(n) if rewards is None else rewards, valid)
    batch = assemble_batch(groups, rows, pad_id=0, mesh=mesh)
    out = grpo_batch_from_rows(batch, config, old_logp_nt=old_logp_nt, ref_logp_nt=ref_logp_nt)
    if advantages is None:
        return out
    adv = put_global(
        np.asarray(advantages, np.float32),
        batch_sharding(mesh, np.ndim(advantages), np.shape(advantages)),
    )
    return dataclasses.replace(out, advantages=adv, rewards_n=None)


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
        estimator = config.advantage_estimator_fn
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


__all__ = ["GRPOBatch", "grpo_batch_from_ids", "grpo_batch_from_rollout"]
