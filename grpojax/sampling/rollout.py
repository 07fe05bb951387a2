"""What the generation engines share: the `Rollout` they return, the static description
of one compiled program, the sharding constraints of its batch and cache, and the per-token
sampling keys.

Sampling keys: token t of sample n (row n = b*G + g, sample g of prompt b) is drawn with
key(n, t) = fold_in(fold_in(key_gen, n), t), key_gen split from the call's key. Nothing else
enters a draw, so a sample's tokens depend on its prompt, its index and the model, not on
which rows, slots or devices decoded beside it or in what order they finished: the static,
the continuous and the compacting engine draw the same tokens, and so do slot pools of any
size, row compactions and meshes of any shape (up to the rounding of the logits themselves).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array
from jax.sharding import Mesh

from grpojax.models import sharding
from grpojax.ops.masks import mask_from_lengths
from grpojax.sampling.transforms import SamplingConfig

__all__ = [
    "Rollout",
    "check_prompts",
    "empty_outputs",
    "generate_trace_count",
    "record_step",
    "token_keys",
]


class Rollout(NamedTuple):
    """The result of `generate`: B prompts, G samples each, N = B*G rows.

    Row n is sample n % G of prompt n // G. Masks are built from lengths.

    prompt_tokens_bp: `[B, P]` int32 prompts left-padded to the bucket width P.
    prompt_lengths_b: `[B]` int32 real prompt lengths.
    tokens_nt: `[N, T]` int32 completion tokens, T = max_new_tokens; `pad_id` after the end.
    lengths_n: `[N]` int32 completion lengths (the stop token, when present, is included).
    mask_nt: `[N, T]` bool, true at t < lengths_n.
    logp_nt: `[N, T]` f32 logprob of each token under the distribution it was sampled from
      (after temperature and truncation, renormalised); 0 for greedy.
    keep_count_nt: `[N, T]` int32 size of the kept set at each step (V without truncation).
    keep_threshold_nt: `[N, T]` f32 smallest kept scaled logit (-inf without truncation).
      See `grpojax.sampling.transforms` for how a trainer rebuilds the keep-sampling mask.
      logp, keep_count and keep_threshold are 0 where the mask is False.
    eos_found_n: `[N]` bool, the completion ended with an eos/stop id (False: truncated at T).
    routing_nslk: with `generate(..., record_routing=True)` on a mixture of experts (static
      engine), `[N, P + T, L, k]` int32: the experts each token of `sequences()` went to in
      each layer when the sampler ran it (the prompt's in its prefill, completion token t when
      it was fed back at step t + 1); the last completion token, never fed, holds experts
      0..k-1, which no logprob reads. None otherwise. For `model(..., routing_ntlk=)`.
    key: the advanced random key, to checkpoint and pass to the next call.
    decode_steps: `[]` int32 decode steps the program ran: tokens decoded per row before
      the loop stopped with the static engine (<= T; fewer when every row ended early), the
      steps of the slot pool with the continuous one.
    row_steps: `[]` int32 row-steps decoded, decode_steps x the rows each step decoded (N
      static, the slot count continuous); the decode's utilisation is
      sum(lengths_n) / row_steps.
    """

    prompt_tokens_bp: Array
    prompt_lengths_b: Array
    tokens_nt: Array
    lengths_n: Array
    mask_nt: Array
    logp_nt: Array
    keep_count_nt: Array
    keep_threshold_nt: Array
    eos_found_n: Array
    key: Array
    decode_steps: Array
    row_steps: Array
    routing_nslk: Array | None = None

    @property
    def group_size(self) -> int:
        return self.tokens_nt.shape[0] // self.prompt_tokens_bp.shape[0]

    def prompt_mask_bp(self) -> Array:
        """`[B, P]` bool mask of real prompt tokens (left padding)."""
        p = self.prompt_tokens_bp.shape[1]
        return mask_from_lengths(self.prompt_lengths_b, p, offset_n=p - self.prompt_lengths_b)

    @classmethod
    def from_outputs(
        cls,
        prompt_bp,
        lengths_b,
        outputs,
        len_n,
        eos_n,
        key,
        steps,
        rows_per_step: int,
        routing_nslk=None,
    ) -> Rollout:
        """The Rollout of an engine's decode: `outputs` are its (tokens, logp, keep count,
        keep threshold) `[N, T]` buffers (`empty_outputs`), `steps` the loop's steps, each
        decoding `rows_per_step` rows."""
        tokens_nt, logp_nt, count_nt, thr_nt = outputs
        return cls(
            prompt_tokens_bp=prompt_bp,
            prompt_lengths_b=lengths_b,
            tokens_nt=tokens_nt,
            lengths_n=len_n,
            mask_nt=mask_from_lengths(len_n, tokens_nt.shape[-1]),
            logp_nt=logp_nt,
            keep_count_nt=count_nt,
            keep_threshold_nt=thr_nt,
            eos_found_n=eos_n,
            key=key,
            decode_steps=steps,
            row_steps=steps * rows_per_step,
            routing_nslk=routing_nslk,
        )

    def sequences(self) -> tuple[Array, Array, Array]:
        """Prompt + completion per row, for the trainer's full forward.

        Returns `(tokens_ns, mask_ns, positions_ns)`, each `[N, P + T]`: the prompt repeated G
        times then the completion; mask = real prompt tokens and real completion tokens;
        positions = cumsum(mask) - 1 (clipped at 0), the same RoPE positions the sampler used.
        Completion token t of row n sits at column P + t.
        """
        g = self.group_size
        prompt_np = jnp.repeat(self.prompt_tokens_bp, g, axis=0)
        pmask_np = jnp.repeat(self.prompt_mask_bp(), g, axis=0)
        tokens = jnp.concatenate([prompt_np, self.tokens_nt], axis=1)
        mask = jnp.concatenate([pmask_np, self.mask_nt], axis=1)
        positions = jnp.maximum(jnp.cumsum(mask, axis=1, dtype=jnp.int32) - 1, 0)
        return tokens, mask, positions


@dataclasses.dataclass(frozen=True)
class Spec:
    """Everything static about one compiled generate program.

    slots, queues: the continuous engine's slot count and work queues (one per data shard;
    slots and samples split evenly between them); 0 and 1 for the static engine."""

    group_size: int
    max_new_tokens: int
    sampling: SamplingConfig
    stop_ids: tuple[int, ...]
    pad_id: int
    shared_prefill: bool
    mesh: Mesh | None
    cache_dtype: Any
    decode_plan: tuple[tuple[int, int], ...]
    slots: int = 0
    queues: int = 1
    record_routing: bool = False


_TRACES = [0]


def count_trace() -> None:
    """Called by each engine's program when it is traced."""
    _TRACES[0] += 1


def generate_trace_count() -> int:
    """How many times a generate program has been traced (each trace is one compilation)."""
    return _TRACES[0]


def batch_constraint(x: Array, mesh: Mesh | None) -> Array:
    """Shard the leading (batch) axis over the data axes (replicated where it does not divide)."""
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, sharding.batch_sharding(mesh, x.ndim, x.shape))


def cache_constraint(cache, mesh: Mesh | None):
    """Batch over the data axes, kv heads over `tensor`: the model's own cache layout."""
    if mesh is None:
        return cache
    return jax.lax.with_sharding_constraint(cache, sharding.cache_shardings(cache, mesh))


def check_prompts(prompts: np.ndarray, lengths: np.ndarray, *, rows: str) -> None:
    """ValueError unless `prompts` is `[R, W]` and `lengths` `[R]` with every length in
    [1, W] (R named `rows`: "b" prompts, "n" episodes' rows)."""
    r = rows.upper()
    if prompts.ndim != 2 or lengths.shape != (prompts.shape[0],):
        raise ValueError(
            f"prompt_tokens_{rows}p must be [{r}, W] and prompt_lengths_{rows} [{r}], got "
            f"{prompts.shape} and {lengths.shape}"
        )
    width = prompts.shape[1]
    if lengths.min() < 1 or lengths.max() > width:
        raise ValueError(f"prompt lengths must be in [1, {width}], got {lengths.tolist()}")


def token_keys(key_gen: Array, sample_n: Array, t_n: Array) -> Array:
    """`[N]` keys, row n's = fold_in(fold_in(key_gen, sample_n[n]), t_n[n]) (module docstring)."""
    return jax.vmap(lambda s, t: jax.random.fold_in(jax.random.fold_in(key_gen, s), t))(
        jnp.asarray(sample_n, jnp.int32), jnp.asarray(t_n, jnp.int32)
    )


def empty_outputs(shape: tuple[int, ...], pad_id: int) -> tuple[Array, Array, Array, Array]:
    """An engine's output buffers before decoding: tokens (`pad_id`), logprobs, kept-set
    sizes and thresholds (zeros), each of `shape` (`[N, T]`, or split by queue)."""
    return (
        jnp.full(shape, pad_id, jnp.int32),
        jnp.zeros(shape, jnp.float32),
        jnp.zeros(shape, jnp.int32),
        jnp.zeros(shape, jnp.float32),
    )


def record_step(bufs, out, t, live_n: Array, pad_id: int):
    """`bufs` (`empty_outputs`' four `[N, T]` buffers) with column t set to step t's sample
    `out` (`grpojax.sampling.transforms.sample_tokens`' token, logprob, kept-set size and
    threshold) on the live rows, and `pad_id` / 0 on the others. Returns (bufs, the values
    written: a tuple of four `[N]` arrays)."""
    vals = (
        jnp.where(live_n, out.token_n, pad_id),
        jnp.where(live_n, out.logp_n, 0.0),
        jnp.where(live_n, out.keep_count_n, 0),
        jnp.where(live_n, out.keep_threshold_n, 0.0),
    )
    bufs = tuple(
        jax.lax.dynamic_update_slice(buf, val[:, None].astype(buf.dtype), (0, t))
        for buf, val in zip(bufs, vals)
    )
    return bufs, vals
