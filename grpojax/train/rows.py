"""Sampled rows on the devices, and the batch a step trains on built from them.

A `Group` is the G completions of one prompt, described on the host by small per-row data
(prompt ids, lengths, rewards, validity); its completion tokens, sampler logprobs and
kept-set thresholds stay on the devices as rows of a `RowArrays` (global arrays, rows
sharded over the mesh's data axes). `take_rows` gathers rows of several `RowArrays` on the
devices; `assemble_batch` lays B groups and their rows out as the step's `TrainBatch`:
prompts left-padded to the library's prompt width, masks from lengths, per-row rewards.
The driver's rollouts (`grpojax.rollouts.strategy`) produce groups and rows; research code
can build them itself.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from grpojax.models.sharding import batch_sharding, put_global
from grpojax.ops.masks import prompt_width
from grpojax.train.packing import Packing

__all__ = [
    "Group",
    "RowArrays",
    "TrainBatch",
    "assemble_batch",
    "empty_rows",
    "fit_prompt_columns",
    "fit_routing",
    "make_groups",
    "rollout_groups",
    "take_rows",
]


@flax.struct.dataclass
class RowArrays:
    """Completion rows on the devices (global arrays, rows over the data axes), T columns.

    tokens_nt: `[R, T]` int32 completion tokens.
    logp_nt: `[R, T]` float32 the sampler's logprobs.
    keep_count_nt: `[R, T]` int32 the sampler's kept-set sizes.
    policy_mask_nt: `[R, T]` bool the policy's ids of multi-turn episodes (environment ids
      False: context, not loss; `grpojax.rollouts.episodes`), or None: every completion id up
      to the row's length is the policy's.
    token_rewards_nt: `[R, T]` float32 multi-turn episodes' rewards at their ids
      (`grpojax.envs.Episode.token_rewards`: per-turn rewards at each turn's last id, the
      final one at the last policy id), PPO's per-token rewards; or None.
    routing_nslk: `[R, P_max + T, L, k]` int32 the experts the sampler routed each prompt
      and completion token to (`model.routing_replay`), the prompt's right-aligned in its
      first P_max = `data.max_prompt_tokens` columns (`fit_prompt_columns`); or None.
    """

    tokens_nt: jax.Array
    logp_nt: jax.Array
    keep_count_nt: jax.Array
    policy_mask_nt: jax.Array | None = None
    token_rewards_nt: jax.Array | None = None
    routing_nslk: jax.Array | None = None


@functools.partial(jax.jit, static_argnums=(1, 2))
def fit_routing(routing_nslk, prompt_width: int, width: int):
    """`fit_prompt_columns` of a routing `[N, P + T, L, k]`, jitted (a host call site)."""
    return fit_prompt_columns(routing_nslk, prompt_width, width)


def fit_prompt_columns(x_ns: jax.Array, prompt_width: int, width: int) -> jax.Array:
    """`x_ns` `[N, P + T, ...]` (a left-padded prompt's P columns, then T) with its prompt
    part made `width` wide: the last `width` of the P columns, or all of them after
    `width - P` columns of padding on the left. Every real prompt token stays (it sits in
    the last columns) while `width` is at least the longest prompt. The padding columns of
    routing (`[..., L, k]`) hold experts 0..k-1: padding's route, which no real token reads.
    """
    p = int(prompt_width)
    if width <= p:
        return x_ns[:, p - width :]
    pad = jnp.broadcast_to(
        jnp.arange(x_ns.shape[-1], dtype=x_ns.dtype), (x_ns.shape[0], width - p, *x_ns.shape[2:])
    )
    return jnp.concatenate([pad, x_ns], axis=1)


def empty_rows(n: int, t: int, mesh: Mesh, *, policy_mask: bool = False) -> RowArrays:
    """`RowArrays` of n zero rows (the empty dynamic-sampling buffer); with `policy_mask`,
    the multi-turn rows' `policy_mask_nt` and `token_rewards_nt` too."""
    host = {
        "tokens_nt": np.zeros((n, t), np.int32),
        "logp_nt": np.zeros((n, t), np.float32),
        "keep_count_nt": np.zeros((n, t), np.int32),
    }
    if policy_mask:
        host["policy_mask_nt"] = np.zeros((n, t), bool)
        host["token_rewards_nt"] = np.zeros((n, t), np.float32)
    shardings = {k: batch_sharding(mesh, 2, x.shape) for k, x in host.items()}
    return RowArrays(**put_global(host, shardings))


@functools.partial(jax.jit, static_argnames="out_sharding")
def _take_rows(segments: tuple[RowArrays, ...], index_n, *, out_sharding):
    pool = jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *segments)
    return jax.tree.map(
        lambda x: jax.lax.with_sharding_constraint(jnp.take(x, index_n, axis=0), out_sharding),
        pool,
    )


def take_rows(segments: Sequence[RowArrays], index_n: np.ndarray, mesh: Mesh) -> RowArrays:
    """Rows `index_n` (host `[M]`, the same on every process) of the concatenated segments,
    gathered on the devices into `[M, T]` arrays sharded like a batch."""
    index = put_global(np.asarray(index_n, np.int32), NamedSharding(mesh, PartitionSpec()))
    t = segments[0].tokens_nt.shape[1]
    with jax.set_mesh(mesh):
        return _take_rows(
            tuple(segments), index, out_sharding=batch_sharding(mesh, 2, (len(index_n), t))
        )


@dataclasses.dataclass
class Group:
    """G completions of one prompt: small host data; the tokens stay on the devices.

    prompt_ids: the prompt's real token ids (no padding).
    lengths_g: `[G]` completion lengths; eos_g: `[G]` ended with a stop token.
    total_g: `[G]` weighted reward (0 where invalid); valid_g: `[G]` bool.
    per_fn: name -> `[G]` reward of each function (NaN where unscored or failed).
    row: index of the group's first row in the step's row pool (`collect`).
    greedy_reward: the reward of the prompt's greedy completion (ReMax's baseline); None
      when not sampled, NaN when its reward failed (then every `valid_g` is False).
    version: the RL steps the policy that sampled the group had taken (its weights'
      version; the step that trains it is `version` + its lag, `grpojax.rollouts.pipeline`).
    """

    prompt_ids: list[int]
    lengths_g: np.ndarray
    eos_g: np.ndarray
    total_g: np.ndarray
    valid_g: np.ndarray
    per_fn: dict[str, np.ndarray]
    row: int = 0
    greedy_reward: float | None = None
    version: int = 0

    def reward_std(self) -> float:
        """Std of the valid samples' rewards (0 when fewer than two are valid)."""
        v = self.total_g[self.valid_g]
        return float(v.std()) if v.size > 1 else 0.0

    def to_json(self) -> dict:
        # JSON has no inf/NaN: non-finite values travel as the strings "inf", "-inf", "nan".
        def floats(x):
            return [float(v) if np.isfinite(v) else str(float(v)) for v in x]

        return {
            "prompt_ids": [int(i) for i in self.prompt_ids],
            "lengths_g": self.lengths_g.tolist(),
            "eos_g": self.eos_g.tolist(),
            "total_g": [float(v) for v in self.total_g],
            "valid_g": self.valid_g.tolist(),
            "per_fn": {k: floats(v) for k, v in self.per_fn.items()},
            "row": int(self.row),
            "version": int(self.version),
            "greedy_reward": None
            if self.greedy_reward is None
            else floats([self.greedy_reward])[0],
        }

    @classmethod
    def from_json(cls, d: dict) -> Group:
        return cls(
            prompt_ids=list(d["prompt_ids"]),
            lengths_g=np.array(d["lengths_g"], np.int32),
            eos_g=np.array(d["eos_g"], bool),
            total_g=np.array(d["total_g"], np.float32),
            valid_g=np.array(d["valid_g"], bool),
            per_fn={k: np.array([float(v) for v in x], np.float32) for k, x in d["per_fn"].items()},
            row=int(d["row"]),
            greedy_reward=None if d.get("greedy_reward") is None else float(d["greedy_reward"]),
            version=int(d.get("version", 0)),
        )


def make_groups(
    prompt_ids: Sequence[Sequence[int]],
    columns: dict[str, np.ndarray],
    *,
    per_fn: dict[str, np.ndarray] | None = None,
    greedy_b: dict[str, np.ndarray] | None = None,
    version: int = 0,
) -> list[Group]:
    """The B groups of N = B*G host rows, group b holding rows b*G ... b*G + G - 1.

    Args:
      prompt_ids: B lists of real prompt ids.
      columns: "lengths", "eos", "total", "valid": `[N]` each.
      per_fn: name -> `[N]` each reward function's reward (default: none).
      greedy_b: {"total", "valid"}: `[B]` the prompts' greedy rewards (ReMax), or None; a
        group whose greedy reward failed gets NaN and no valid sample (no baseline).
      version: the sampling policy's version (`Group.version`).
    """
    g = len(columns["valid"]) // len(prompt_ids)
    groups = []
    for b, ids in enumerate(prompt_ids):
        sl = slice(b * g, (b + 1) * g)
        valid = np.asarray(columns["valid"][sl], bool)
        greedy_reward = None
        if greedy_b is not None:
            ok = bool(greedy_b["valid"][b])
            greedy_reward = float(greedy_b["total"][b]) if ok else float("nan")
            valid = valid & ok
        groups.append(
            Group(
                prompt_ids=[int(x) for x in ids],
                lengths_g=np.asarray(columns["lengths"][sl], np.int32),
                eos_g=np.asarray(columns["eos"][sl], bool),
                total_g=np.asarray(columns["total"][sl], np.float32),
                valid_g=valid,
                per_fn={k: np.asarray(v[sl], np.float32) for k, v in (per_fn or {}).items()},
                row=b * g,
                greedy_reward=greedy_reward,
                version=version,
            )
        )
    return groups


def rollout_groups(rollout, rewards_n, valid_n=None) -> tuple[list[Group], RowArrays]:
    """(the B groups, their N rows) of a `grpojax.sampling.Rollout` scored with `rewards_n`
    `[N]` (`valid_n` `[N]` bool: samples whose reward is valid; None: all), for
    `assemble_batch`: research code's way onto the driver's path. The rollout's arrays must
    be addressable here (one process; the driver gathers each process's rows instead)."""
    width = rollout.prompt_tokens_bp.shape[1]
    prompts, lengths = np.asarray(rollout.prompt_tokens_bp), np.asarray(rollout.prompt_lengths_b)
    n = rollout.tokens_nt.shape[0]
    columns = {
        "lengths": np.asarray(rollout.lengths_n),
        "eos": np.asarray(rollout.eos_found_n),
        "total": np.asarray(rewards_n, np.float32).reshape(n),
        "valid": np.ones(n, bool) if valid_n is None else np.asarray(valid_n, bool).reshape(n),
    }
    prompt_ids = [row[width - int(m) :] for row, m in zip(prompts, lengths)]
    rows = RowArrays(rollout.tokens_nt, rollout.logp_nt, rollout.keep_count_nt)
    return make_groups(prompt_ids, columns), rows


@flax.struct.dataclass
class TrainBatch:
    """One step's batch on the devices (global arrays), N = B*G rows, S = P + T columns.

    tokens_ns, mask_ns: `[N, S]` prompt (left-padded to P) + completion, mask from lengths.
    completion_mask_nt: `[N, T]` real completion tokens of valid samples (multi-turn: the
      policy's ids only).
    rewards_n, valid_n, lengths_n: `[N]` per-row rewards, validity, completion lengths.
    sampler_logp_nt, keep_count_nt: `[N, T]` from the sampler.
    host: the same per-row values as NumPy (every process), for metrics and packing
      (`prompt_lengths_n` too).
    greedy_rewards_n: `[N]` the group's greedy reward per row, or None (not asked for).
    rewards_nr: `[N, R]` per-function rewards before weighting, or None (not asked for).
    packing: the rows' `grpojax.train.packing.Packing` when the step runs packed
      (`grpojax.driver.packing.Packer`), else None.
    token_rewards_nt: `[N, T]` multi-turn episodes' rewards at their ids
      (`RowArrays.token_rewards_nt`; PPO's per-token rewards), or None.
    routing_nslk: `[N, S, L, k]` int32 the sampler's expert routing of every token
      (`model.routing_replay`), or None.
    """

    tokens_ns: jax.Array
    mask_ns: jax.Array
    completion_mask_nt: jax.Array
    rewards_n: jax.Array
    valid_n: jax.Array
    lengths_n: jax.Array
    sampler_logp_nt: jax.Array
    keep_count_nt: jax.Array
    host: dict = flax.struct.field(pytree_node=False)
    greedy_rewards_n: jax.Array | None = None
    rewards_nr: jax.Array | None = None
    packing: Packing | None = None
    token_rewards_nt: jax.Array | None = None
    routing_nslk: jax.Array | None = None


@jax.jit
def _join(prompt_np, pmask_np, rows: RowArrays, lengths_n, valid_n):
    """(tokens `[N, P + T]`, mask, loss mask `[N, T]`, routing `[N, P + T, L, k]` or None)."""
    t = rows.tokens_nt.shape[1]
    cmask = jnp.arange(t)[None, :] < lengths_n[:, None]
    if rows.policy_mask_nt is not None:  # multi-turn: the loss on the policy's ids only
        cmask_loss = cmask & rows.policy_mask_nt
    else:
        cmask_loss = cmask
    tokens = jnp.concatenate([prompt_np, rows.tokens_nt], axis=1)
    mask = jnp.concatenate([pmask_np, cmask], axis=1)
    routing = rows.routing_nslk
    if routing is not None:
        routing = fit_prompt_columns(routing, routing.shape[1] - t, prompt_np.shape[1])
    return tokens, mask, cmask_loss & valid_n[:, None], routing


def assemble_batch(
    groups: Sequence[Group],
    rows: RowArrays,
    *,
    pad_id: int,
    mesh,
    inputs: Sequence[str] = (),
) -> TrainBatch:
    """The step's batch from B groups and their rows (`rows[i*G:(i+1)*G]` is group i's):
    prompts left-padded to the library's prompt width P (`grpojax.ops.masks.prompt_width` of
    the longest), masks from lengths (and the loss mask from `rows.policy_mask_nt` where
    the rows have one: multi-turn episodes). Invalid samples (failed reward calls) get an
    all-False completion mask, so they add nothing to any loss term. `inputs`: the
    estimator's extra batch inputs to fill (`grpojax.train.objectives.BATCH_INPUTS`):
    "greedy_rewards_n", each row its group's `greedy_reward` (ReMax's baseline; NaN, a failed
    greedy reward whose group is invalid, becomes 0), and "rewards_nr", each row's
    per-function rewards before weighting (`Group.per_fn`, NaN as 0)."""
    g = len(groups[0].lengths_g)
    p = prompt_width(max(len(gr.prompt_ids) for gr in groups))
    prompt = np.full((len(groups), p), pad_id, np.int32)
    for i, gr in enumerate(groups):
        prompt[i, p - len(gr.prompt_ids) :] = gr.prompt_ids
    plen = np.array([len(gr.prompt_ids) for gr in groups])
    pmask = np.arange(p)[None, :] >= (p - plen)[:, None]
    host = {
        "rewards_n": np.concatenate([gr.total_g for gr in groups]).astype(np.float32),
        "valid_n": np.concatenate([gr.valid_g for gr in groups]),
        "lengths_n": np.concatenate([gr.lengths_g for gr in groups]).astype(np.int32),
        "eos_n": np.concatenate([gr.eos_g for gr in groups]),
        "prompt_lengths_n": np.repeat(plen, g).astype(np.int32),
    }
    if "greedy_rewards_n" in inputs:
        if any(gr.greedy_reward is None for gr in groups):
            raise ValueError("the estimator needs greedy rewards; a group has none")
        greedy = np.array([gr.greedy_reward for gr in groups], np.float32)
        # A failed greedy reward is NaN; its group is invalid, so 0 is never read.
        host["greedy_rewards_n"] = np.repeat(np.nan_to_num(greedy, nan=0.0), g)
    if "rewards_nr" in inputs:
        per_fn = [np.stack(list(gr.per_fn.values()), axis=1) for gr in groups]  # [G, R] each
        host["rewards_nr"] = np.nan_to_num(np.concatenate(per_fn), nan=0.0).astype(np.float32)
    n = len(host["valid_n"])
    extra = [k for k in ("greedy_rewards_n", "rewards_nr") if k in host]
    placed = put_global(
        {
            "prompt_np": np.repeat(prompt, g, axis=0),
            "pmask_np": np.repeat(pmask, g, axis=0),
            "rewards_n": host["rewards_n"],
            "valid_n": host["valid_n"],
            "lengths_n": host["lengths_n"],
            **{k: host[k] for k in extra},
        },
        {
            "prompt_np": batch_sharding(mesh, 2, (n, p)),
            "pmask_np": batch_sharding(mesh, 2, (n, p)),
            "rewards_n": batch_sharding(mesh, 1, (n,)),
            "valid_n": batch_sharding(mesh, 1, (n,)),
            "lengths_n": batch_sharding(mesh, 1, (n,)),
            **{k: batch_sharding(mesh, host[k].ndim, host[k].shape) for k in extra},
        },
    )
    with jax.set_mesh(mesh):
        tokens, mask, cmask, routing = _join(
            placed["prompt_np"], placed["pmask_np"], rows, placed["lengths_n"], placed["valid_n"]
        )
    return TrainBatch(
        tokens_ns=tokens,
        mask_ns=mask,
        completion_mask_nt=cmask,
        rewards_n=placed["rewards_n"],
        valid_n=placed["valid_n"],
        lengths_n=placed["lengths_n"],
        sampler_logp_nt=rows.logp_nt,
        keep_count_nt=rows.keep_count_nt,
        host=host,
        greedy_rewards_n=placed.get("greedy_rewards_n"),
        rewards_nr=placed.get("rewards_nr"),
        token_rewards_nt=rows.token_rewards_nt,
        routing_nslk=routing,
    )
