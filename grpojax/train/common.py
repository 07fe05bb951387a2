"""Shared pieces of the train steps: the policy forward, micro-batching, the jit call site.

API (stable; the GRPO, PPO, SFT and reward-model steps all use it):

- `policy_logprobs(model, tokens_ns, mask_ns, completion_mask_nt, *, forward=...)` ->
  `(logp_nt, entropy_nt)`: one decoder forward over prompt + completion, then per-token
  log-probabilities (and optionally entropies) of the T completion tokens, computed chunked
  from the hidden states (`grpojax.ops.logprobs`), never from full `[N, T, V]` logits.
  With `group_size=G`, rows in contiguous groups of G sharing a prompt run that prompt once.
- `ForwardConfig`: chunk sizes and temperature of that computation (static).
- `make_logprob_pass(graphdef, forward, mesh, group_size, chunks)`: the same forward over a
  whole step's batch (policy logprobs and entropy, reference logprobs; packed rows, LoRA's
  adapters-off reference), jitted once: the driver's logprob pass before each update.
- `split_micro(tree, k)` / `accumulate_gradients(loss_fn, params, micro, k)`: exact gradient
  accumulation; `loss_fn` must already divide by the *global* denominator, so the sums over
  micro-batches equal the un-accumulated loss and gradient.
- `batch_shardings(batch, mesh)` and `jit_step(fn, ...)`: the single `jax.jit` call site of a
  step, with in/out shardings on a (data, fsdp, tensor) mesh and the state donated.

Layout of a sequence batch (as `grpojax.sampling.Rollout.sequences()` returns it): column
`P + t` of `tokens_ns` (S = P + T columns) holds completion token t, which the hidden state
at column `P + t - 1` predicts. The prompt is left-padded, so column `P - 1` is the last
real prompt token of every row. Positions are `max(cumsum(mask) - 1, 0)`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax import Array
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from grpojax.models.decoder import shared_prefix_forward
from grpojax.models.precision import COMPILER_OPTIONS
from grpojax.models.sharding import batch_sharding
from grpojax.ops.checks import check_int, check_number
from grpojax.ops.logprobs import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_VOCAB_CHUNK_SIZE,
    entropy_from_hidden,
    keep_mask_from_count,
    kept_logprobs,
    token_logprobs_from_hidden,
)
from grpojax.train.packing import Packing, packed_completion_hidden


@dataclasses.dataclass(frozen=True)
class ForwardConfig:
    """How per-token log-probabilities are computed from hidden states (static).

    Attributes:
      chunk_size: tokens per tile of the chunked log-softmax, >= 1.
      vocab_chunk_size: vocabulary entries per tile, >= 1.
      temperature: the sampling temperature the logprobs are taken at, > 0 (use the
        sampler's so that trainer and sampler logprobs describe the same distribution).
    """

    chunk_size: int = DEFAULT_CHUNK_SIZE
    vocab_chunk_size: int = DEFAULT_VOCAB_CHUNK_SIZE
    temperature: float = 1.0

    def __post_init__(self):
        check_int("chunk_size", self.chunk_size)
        check_int("vocab_chunk_size", self.vocab_chunk_size)
        check_number("temperature", self.temperature, minimum=0, strict=True, array_ok=False)


def positions_from_mask(mask_ns: Array) -> Array:
    """`[N, S]` int32 RoPE positions `max(cumsum(mask) - 1, 0)` (as the sampler used)."""
    return jnp.maximum(jnp.cumsum(jnp.asarray(mask_ns, jnp.int32), axis=1) - 1, 0)


def completion_hidden(
    model,
    tokens_ns: Array,
    mask_ns: Array,
    completion_width: int,
    *,
    group_size: int = 1,
    lora_dropout_key: Array | None = None,
    routing_nslk: Array | None = None,
):
    """Decoder forward; the hidden states that predict the T completion tokens.

    Args:
      model: a `grpojax.models.Decoder` (or anything with its call contract).
      tokens_ns: `[N, S]` int prompt + completion tokens, S = P + T.
      mask_ns: `[N, S]` bool attention mask (real prompt and completion tokens).
      completion_width: T (static), 1 <= T < S.
      group_size: G (static). 1: one forward over all N*S positions. G > 1: rows come in
        contiguous groups of G sharing the prompt columns (the G samples of one prompt, as
        the sampler and the driver lay them out) and each prompt is run once
        (`grpojax.models.shared_prefix_forward`): same values up to rounding, B*P + N*T
        positions instead of N*(P+T).
      lora_dropout_key: a key for LoRA adapter dropout (the train steps' gradient forward of
        a model with `lora.dropout` > 0); None: no dropout.
      routing_nslk: `[N, S, L, k]` int32 experts to replay in a mixture of experts (the
        sampler's, `Rollout.routing_nslk`; routing replay); None: each token routed anew.

    Returns:
      (hidden_ntd `[N, T, D]`, targets_nt `[N, T]`): hidden at columns P-1 .. S-2 and the
      tokens at columns P .. S-1.
    """
    hidden, targets, _ = _completion_forward(
        model,
        tokens_ns,
        mask_ns,
        completion_width,
        group_size=group_size,
        lora_dropout_key=lora_dropout_key,
        routing_nslk=routing_nslk,
    )
    return hidden, targets


def _completion_forward(
    model,
    tokens_ns: Array,
    mask_ns: Array,
    completion_width: int,
    *,
    group_size: int = 1,
    lora_dropout_key: Array | None = None,
    routing_nslk: Array | None = None,
    with_load: bool = False,
):
    """`completion_hidden`'s (hidden, targets) and, with `with_load` (a mixture of experts),
    the forward's `grpojax.models.moe.ExpertLoad` over its real tokens (else None)."""
    s = tokens_ns.shape[1]
    t = int(completion_width)
    if not 1 <= t < s:
        raise ValueError(f"completion width T={t} must be in [1, S) with S={s} (S = P + T)")
    mask = jnp.asarray(mask_ns, jnp.bool_)
    positions = positions_from_mask(mask)
    targets = tokens_ns[:, s - t :]
    # Only passed when given: `model` may be anything with the decoder's call contract.
    kw: dict = {} if lora_dropout_key is None else {"lora_dropout_key": lora_dropout_key}
    if group_size == 1:
        if routing_nslk is not None:
            kw["routing_ntlk"] = routing_nslk
        hidden, _, *routing = model(
            tokens_ns, positions_nt=positions, mask_nt=mask, return_routing=with_load, **kw
        )
        load = routing[0].load if with_load and routing[0] is not None else None
        return hidden[:, s - t - 1 : s - 1], targets, load
    if routing_nslk is not None:
        kw["routing_nslk"] = routing_nslk
    h_prompt, h_completion, *load = shared_prefix_forward(
        model,
        tokens_ns,
        mask,
        positions,
        prefix_width=s - t,
        group_size=group_size,
        with_load=with_load,
        **kw,
    )
    # Left padding puts every prompt's last real token, which predicts completion token 0,
    # in column P - 1.
    first = jnp.repeat(h_prompt[:, -1:], group_size, axis=0)
    hidden = jnp.concatenate([first, h_completion[:, : t - 1]], axis=1)
    return hidden, targets, load[0] if with_load else None


def _kept_logprobs_chunked(
    h_ntd, w_dv, tokens_nt, count_nt, *, chunk_size, temperature, softcap=None
):
    """log pi(token) renormalised over the sampler's kept set, rebuilt by rank on the
    trainer's logits: K = {v : z_v >= z_(c)}, z_(c) the c-th largest, c = keep_count (ties
    with it kept, as the sampler keeps them), plus the token itself.

    By rank, not by the sampler's threshold value: the sampler's boundary token sits at its
    threshold exactly, so recomputed logits that differ by rounding would drop it about half
    the time; a rank only changes where two logits are within rounding of each other, which
    swaps two nearly equal masses. The token is added because the sampler kept it whatever
    its recomputed rank (only a rounding swap at the boundary can leave it out).

    Token-chunked with full-vocabulary tiles `[C, V]` (one sort per tile); each chunk is
    rematerialised in the backward pass (`jax.checkpoint`), so one `[C, V]` tile is live.
    """
    n, t, d = h_ntd.shape
    m = n * t
    c = min(chunk_size, m)
    k = -(-m // c)
    pad = k * c - m
    v = w_dv.shape[1]
    h = jnp.pad(h_ntd.reshape(m, d), ((0, pad), (0, 0))).reshape(k, c, d)
    tok = jnp.pad(tokens_nt.reshape(m).astype(jnp.int32), (0, pad)).reshape(k, c)
    # Padding rows carry count 0, which keep_mask_from_count clips to 1: finite garbage.
    cnt = jnp.pad(count_nt.reshape(m).astype(jnp.int32), (0, pad)).reshape(k, c)

    @jax.checkpoint
    def one(args):
        h_cd, tok_c, cnt_c = args
        z = jnp.einsum("cd,dv->cv", h_cd, w_dv, preferred_element_type=jnp.float32)
        if softcap is not None:
            z = softcap * jnp.tanh(z / softcap)
        z = z / jnp.float32(temperature)
        is_tok = jnp.arange(v, dtype=jnp.int32)[None, :] == tok_c[:, None]
        keep = keep_mask_from_count(jax.lax.stop_gradient(z), cnt_c) | is_tok
        return kept_logprobs(z, tok_c, keep)

    out = jax.lax.map(one, (h, tok, cnt))
    return out.reshape(k * c)[:m].reshape(n, t)


def policy_logprobs(
    model,
    tokens_ns: Array,
    mask_ns: Array,
    completion_mask_nt: Array,
    *,
    forward: ForwardConfig = ForwardConfig(),
    with_entropy: bool = False,
    keep_count_nt: Array | None = None,
    group_size: int = 1,
    lora_dropout_key: Array | None = None,
    packing: Packing | None = None,
    routing_nslk: Array | None = None,
) -> tuple[Array, Array | None]:
    """Per-token log-probabilities (and entropies) of the completion tokens.

        hidden = model(tokens, mask)                        [N, S, D]
        logp[n, t] = log softmax(hidden[n, P+t-1] @ W / temperature)[tokens[n, P+t]]

    computed in `[C, Vc]` tiles (`token_logprobs_from_hidden`). With `keep_count_nt`
    (the sampler's kept-set sizes c, DeepSeek-V3.2's keep-sampling mask) the softmax is
    renormalised over the c highest logits (and the target) instead, token-chunked over
    full-vocabulary tiles with one sort per tile.

    Args:
      model: a decoder (call contract of `grpojax.models.Decoder`, with `lm_head_dv()`).
      tokens_ns: `[N, S]` int32, S = P + T.
      mask_ns: `[N, S]` bool attention mask, from lengths.
      completion_mask_nt: `[N, T]` bool real completion tokens; fixes T.
      forward: chunking and temperature.
      with_entropy: also return the per-token entropy of the (untruncated) policy.
      keep_count_nt: optional `[N, T]` int kept-set sizes (`Rollout.keep_count_nt`).
      group_size: G > 1 runs each group's shared prompt once (`completion_hidden`).
      lora_dropout_key: LoRA adapter dropout's key (`completion_hidden`); None: none.
      packing: the rows' `grpojax.train.packing.Packing`: they are in its slot order
        (`Packing.to_slots`) and the forward runs on its packed rows (`group_size` is then
        the packing's own); None: one row per sequence.
      routing_nslk: `[N, S, L, k]` experts to replay (`completion_hidden`); not with
        `packing`.

    Returns:
      (logp_nt `[N, T]` f32, entropy_nt `[N, T]` f32 (0 where masked) or None). Padding
      positions hold finite garbage (packed: 0); reduce with the mask.
    """
    scored = scored_hidden(
        model,
        tokens_ns,
        mask_ns,
        completion_mask_nt.shape[1],
        group_size=group_size,
        lora_dropout_key=lora_dropout_key,
        packing=packing,
        routing_nslk=routing_nslk,
    )
    logp, ent = logprobs_from_hidden(
        scored.hidden,
        model.lm_head_dv(),
        scored.targets,
        scored.from_rows(completion_mask_nt),
        forward=forward,
        with_entropy=with_entropy,
        keep_count_nt=None if keep_count_nt is None else scored.from_rows(keep_count_nt),
        softcap=model.config.final_logit_softcapping,
    )
    return scored.to_rows(logp), None if ent is None else scored.to_rows(ent)


class Scored(NamedTuple):
    """Hidden states and the tokens they predict, at the positions a forward scores: `[N, T]`
    (one row per sequence) or a packing's `[R, W + J]`; `to_rows` / `from_rows` map
    per-position arrays between that layout and the batch's `[N, T]`."""

    hidden: Array
    targets: Array
    packing: Packing | None = None
    load: Any = None  # the forward's moe.ExpertLoad (`scored_hidden(with_load=True)`)

    def to_rows(self, x: Array) -> Array:
        return x if self.packing is None else self.packing.to_rows(x)

    def from_rows(self, y: Array) -> Array:
        return y if self.packing is None else self.packing.from_rows(y)


def scored_hidden(
    model,
    tokens_ns: Array,
    mask_ns: Array,
    completion_width: int,
    *,
    group_size: int = 1,
    lora_dropout_key: Array | None = None,
    packing: Packing | None = None,
    routing_nslk: Array | None = None,
    with_load: bool = False,
) -> Scored:
    """`completion_hidden`, or with `packing` its packed forward
    (`grpojax.train.packing.packed_completion_hidden`), as a `Scored`. `routing_nslk`:
    experts to replay (`completion_hidden`); `with_load`: the `Scored` carries the
    mixture of experts' load (`load`). Both on unpacked rows only."""
    if packing is None:
        hidden, targets, load = _completion_forward(
            model,
            tokens_ns,
            mask_ns,
            completion_width,
            group_size=group_size,
            lora_dropout_key=lora_dropout_key,
            routing_nslk=routing_nslk,
            with_load=with_load,
        )
        return Scored(hidden, targets, load=load)
    if routing_nslk is not None or with_load:
        raise ValueError(
            "routing replay (routing_nslk) and the load-balancing loss (with_load) apply to "
            "unpacked rows, not packing"
        )
    hidden, targets = packed_completion_hidden(model, tokens_ns, packing, lora_dropout_key)
    return Scored(hidden, targets, packing)


def logprobs_from_hidden(
    hidden_ntd: Array,
    w_dv: Array,
    targets_nt: Array,
    completion_mask_nt: Array,
    *,
    forward: ForwardConfig = ForwardConfig(),
    with_entropy: bool = False,
    keep_count_nt: Array | None = None,
    softcap: float | None = None,
) -> tuple[Array, Array | None]:
    """`policy_logprobs` from hidden states already computed (`completion_hidden`).

    For callers that need the hidden states too (the PPO shared-backbone critic).
    Shapes: hidden `[N, T, D]`, w `[D, V]`, targets / mask / keep count `[N, T]`;
    `softcap`: the model's final-logit soft-cap (`ModelConfig.final_logit_softcapping`).
    """
    if keep_count_nt is None:
        logp = token_logprobs_from_hidden(
            hidden_ntd,
            w_dv,
            targets_nt,
            chunk_size=forward.chunk_size,
            vocab_chunk_size=forward.vocab_chunk_size,
            temperature=forward.temperature,
            softcap=softcap,
        )
    else:
        logp = _kept_logprobs_chunked(
            hidden_ntd,
            w_dv,
            targets_nt,
            keep_count_nt,
            chunk_size=forward.chunk_size,
            temperature=forward.temperature,
            softcap=softcap,
        )
    ent = None
    if with_entropy:
        ent = entropy_from_hidden(
            hidden_ntd,
            w_dv,
            jnp.asarray(completion_mask_nt, jnp.bool_),
            chunk_size=forward.chunk_size,
            vocab_chunk_size=forward.vocab_chunk_size,
            temperature=forward.temperature,
            softcap=softcap,
        )
    return logp, ent


# ----------------------------------------------------------------------------------------
# Micro-batches and exact accumulation
# ----------------------------------------------------------------------------------------


def split_micro(tree, k: int):
    """Split the leading N axis of every leaf into `[k, N/k, ...]`, interleaved.

    Micro-batch j holds rows j, j+k, j+2k, ...: with the batch sharded contiguously over
    devices, every device keeps an equal share of every micro-batch (no resharding).
    """

    def split(x):
        n = x.shape[0]
        if n % k:
            raise ValueError(f"batch of {n} rows is not divisible into {k} micro/mini-batches")
        return jnp.swapaxes(x.reshape(n // k, k, *x.shape[1:]), 0, 1)

    return jax.tree.map(split, tree)


def merge_micro(tree):
    """Inverse of `split_micro`: `[k, N/k, ...]` back to `[N, ...]`."""

    def merge(x):
        k, m = x.shape[:2]
        return jnp.swapaxes(x, 0, 1).reshape(k * m, *x.shape[2:])

    return jax.tree.map(merge, tree)


def split_units(tree, k: int, g: int = 1):
    """`split_micro` over units of g contiguous rows: `[N, ...]` -> `[k, N/k, ...]`, micro-
    batch j holding units j, j+k, ... whole (g = G keeps groups sharing a prompt together;
    g = 1 is `split_micro`)."""

    def split(x):
        n = x.shape[0]
        units = split_micro(x.reshape(n // g, g, *x.shape[1:]), k)
        return units.reshape(k, n // k, *x.shape[1:])

    return jax.tree.map(split, tree)


def merge_units(tree, g: int = 1):
    """Inverse of `split_units`: `[k, N/k, ...]` back to `[N, ...]`."""

    def merge(x):
        k, n = x.shape[:2]
        units = merge_micro(x.reshape(k, n // g, g, *x.shape[2:]))
        return units.reshape(k * n, *x.shape[2:])

    return jax.tree.map(merge, tree)


def unit_permutation(key: Array, n: int, g: int = 1) -> Array:
    """`[N]` a random order of the N rows that keeps each contiguous unit of g rows together
    (g = 1: `jax.random.permutation(key, n)`)."""
    if g == 1:
        return jax.random.permutation(key, n)
    units = jax.random.permutation(key, n // g)
    return (units[:, None] * g + jnp.arange(g)).reshape(n)


def _combine(key: str, a: Array, b: Array) -> Array:
    if key.endswith("_min"):
        return jnp.minimum(a, b)
    if key.endswith("_max"):
        return jnp.maximum(a, b)
    return a + b


def loss_metric_name(name: str) -> str:
    """The name a policy loss's metric is logged under: `approx_kl_k3` as `approx_kl`."""
    return "approx_kl" if name == "approx_kl_k3" else name


def loss_metrics(metrics: dict[str, Array], share: Array) -> dict[str, Array]:
    """A policy loss's metrics over one micro-batch as a step logs them (`loss_metric_name`):
    each times `share`, the micro-batch's share of the step's tokens, so `combine_metrics`
    sums them to the step's mean; those ending in `_min`/`_max` as they are."""
    return {
        loss_metric_name(k): v if k.endswith(("_min", "_max")) else v * share
        for k, v in metrics.items()
    }


def combine_metrics(a: dict[str, Array], b: dict[str, Array]) -> dict[str, Array]:
    """Merge two micro-batches' metric dicts: keys ending in `_min`/`_max` by min/max, all
    others by sum (so per-micro-batch metrics must be pre-divided by global counts)."""
    return {k: _combine(k, a[k], b[k]) for k in a}


def accumulate_gradients(
    loss_fn: Callable[[Any, Any], tuple[Array, dict[str, Array]]],
    params,
    micro,
    num_micro: int,
) -> tuple[Array, Any, dict[str, Array]]:
    """Sum of `value_and_grad(loss_fn)` over micro-batches, one `lax.scan`.

        loss = sum_j loss_fn(params, micro_j),   grads = sum_j grad loss_fn(params, micro_j)

    `loss_fn(params, micro_j) -> (loss_j, aux_j)` must return loss_j = numerator_j /
    global_denominator (`grpojax.ops.aggregation.aggregate(..., denominator=)`), so the
    sums are the full-batch loss and gradient exactly (up to float rounding). `aux` values
    are combined with `combine_metrics`.

    Args:
      loss_fn: the per-micro-batch loss.
      params: differentiated pytree.
      micro: pytree with leading axis `num_micro` (from `split_micro`).
      num_micro: K >= 1 (static).

    Returns:
      (loss `[]`, grads like params, aux dict).
    """
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    if num_micro == 1:
        (loss, aux), grads = grad_fn(params, jax.tree.map(lambda x: x[0], micro))
        return loss, grads, aux

    first = jax.tree.map(lambda x: x[0], micro)
    (loss0, aux0), grads0 = grad_fn(params, first)
    rest = jax.tree.map(lambda x: x[1:], micro)

    def body(carry, mb):
        loss, grads, aux = carry
        (l_j, a_j), g_j = grad_fn(params, mb)
        grads = jax.tree.map(jnp.add, grads, g_j)
        return (loss + l_j, grads, combine_metrics(aux, a_j)), None

    (loss, grads, aux), _ = jax.lax.scan(body, (loss0, grads0, aux0), rest)
    return loss, grads, aux


# ----------------------------------------------------------------------------------------
# Shardings and the jit call site
# ----------------------------------------------------------------------------------------


def batch_shardings(batch, mesh: Mesh):
    """`NamedSharding` per leaf of a batch: leading (N) axis over data x fsdp where it
    divides, other axes replicated; scalars replicated. `None` leaves stay `None`."""

    def one(x):
        shape = tuple(jnp.shape(x))
        if not shape:
            return NamedSharding(mesh, PartitionSpec())
        return batch_sharding(mesh, len(shape), shape)

    return jax.tree.map(one, batch)


def jit_step(
    fn: Callable,
    *,
    mesh: Mesh,
    state_shardings,
    batch_shardings,
    donate: bool = True,
):
    """The single jit call site of a step: `fn(state, batch) -> (state, metrics)`.

    Compiled with `in_shardings=(state_shardings, batch_shardings)`, the state's shardings
    out and metrics replicated, the state donated (its buffers are reused for the new one),
    and `mesh` set while it runs so the model's activation constraints apply. The same
    code runs on a mesh of one device and on a multi-host slice.

    Returns:
      `call(state, batch) -> (state, metrics)`; `call.jitted` is the `jax.jit` object.
    """
    replicated = NamedSharding(mesh, PartitionSpec())
    jitted = jax.jit(
        fn,
        in_shardings=(state_shardings, batch_shardings),
        out_shardings=(state_shardings, replicated),
        donate_argnums=(0,) if donate else (),
        compiler_options=COMPILER_OPTIONS,  # bf16 rounds as the sampler's program does
    )

    def call(state, batch):
        with jax.set_mesh(mesh):
            return jitted(state, batch)

    setattr(call, "jitted", jitted)  # noqa: B010 (mypy accepts no attribute on a function)
    return call


def make_update_step(
    update: Callable,
    *,
    graphdef,
    tx,
    config,
    mesh: Mesh,
    state_shardings,
    batch,
    schedule=None,
    donate: bool = True,
):
    """Jit `update(state, batch, *, graphdef, tx, config, schedule)` at its one call site.

    The shared body of `make_grpo_step`, `make_sft_step` and `make_reward_model_step`:
    the static arguments are closed over and `batch` (an example) fixes the batch
    shardings (`batch_shardings`); see `jit_step` for the rest.
    """

    def fn(state, b):
        return update(state, b, graphdef=graphdef, tx=tx, config=config, schedule=schedule)

    return jit_step(
        fn,
        mesh=mesh,
        state_shardings=state_shardings,
        batch_shardings=batch_shardings(batch, mesh),
        donate=donate,
    )


ADAPTERS_OFF = "adapters_off"  # a LoRA run's reference: the policy's base, adapters off


def make_logprob_pass(graphdef, forward, mesh: Mesh, group_size: int, chunks: int = 1):
    """The trainer-side logprob pass of a step's batch, jitted (the driver calls it once a
    step, beside the update): `call(params, ref_params, tokens, mask, cmask, keep=None,
    packing=None, routing=None, *, with_policy=True)` -> (policy logp `[N, T]`, policy
    entropy `[N, T]`) or (None, None) without `with_policy`, and ref logp `[N, T]` (None
    without a reference).
    `group_size` > 1 runs each group's shared prompt once (`policy_logprobs`). With
    `keep` (`[N, T]` kept-set thresholds) the policy's logp is renormalised over the
    sampler's kept set, as the step's is (`GRPOConfig.use_keep_mask`); the reference's and
    the entropy stay those of the full distribution. `ref_params` may be `ADAPTERS_OFF`: the
    reference of a LoRA run, the policy's own base weights with the adapters switched off.
    With `packing` (`TrainBatch.packing`) the forwards run on its packed rows; the results
    come back in the batch's row order. The rows are run `chunks` at a time, one after the
    other (the step's mini- x micro-batches: no forward holds more rows than the step's).
    `routing` (`TrainBatch.routing_nslk`): the sampler's experts, replayed in the policy's
    forward (the reference routes anew)."""

    def one(
        params, ref_params, tokens, mask, cmask, keep, routing, packing, with_policy, ref_is_base
    ):
        logp = ent = ref = None
        kw = dict(forward=forward, group_size=group_size, packing=packing)
        if with_policy:
            model = nnx.merge(graphdef, params)
            logp, ent = policy_logprobs(
                model,
                tokens,
                mask,
                cmask,
                with_entropy=True,
                keep_count_nt=keep,
                routing_nslk=routing,
                **kw,
            )
        if ref_is_base:
            base = nnx.merge(graphdef, params)
            base.lora_enabled = False  # a fresh module of this trace: nothing to restore
            ref, _ = policy_logprobs(base, tokens, mask, cmask, **kw)
        elif ref_params is not None:
            ref, _ = policy_logprobs(nnx.merge(graphdef, ref_params), tokens, mask, cmask, **kw)
        return logp, ent, ref

    def fn(
        params, ref_params, tokens, mask, cmask, keep, routing, packing, *, with_policy, ref_is_base
    ):
        n = tokens.shape[0]
        rows = (tokens, mask, cmask, keep, routing)
        unit = group_size
        if packing is not None:  # the rows in slot order; the results back in batch order
            rows = jax.tree.map(packing.to_slots, rows)
            unit = packing.num_slots
        parts = split_units(rows, chunks, unit)
        if packing is not None:
            parts = (*parts, split_units(packing, chunks, 1))
        else:
            parts = (*parts, None)

        def chunk(xs):
            return one(params, ref_params, *xs, with_policy, ref_is_base)

        out = merge_units(jax.lax.map(chunk, parts), unit)
        if packing is None:
            return out
        return jax.tree.map(lambda x: packing.from_slots(x, n), out)

    jitted = jax.jit(
        fn, static_argnames=("with_policy", "ref_is_base"), compiler_options=COMPILER_OPTIONS
    )

    def call(
        params,
        ref_params,
        tokens,
        mask,
        cmask,
        keep=None,
        packing=None,
        routing=None,
        *,
        with_policy=True,
    ):
        if ref_params is None and not with_policy:
            return None, None, None
        ref_is_base = isinstance(ref_params, str) and ref_params == ADAPTERS_OFF
        if ref_is_base:
            ref_params = None
        with jax.set_mesh(mesh):
            return jitted(
                params,
                ref_params,
                tokens,
                mask,
                cmask,
                keep,
                routing,
                packing,
                with_policy=with_policy,
                ref_is_base=ref_is_base,
            )

    return call


@jax.jit
def logprob_agreement(logp_nt, sampler_logp_nt, entropy_nt, mask_nt):
    """Sampler vs trainer over the real completion tokens (`[N, T]` each; scalars, computed
    where the rows live): max and mean |logp - sampler logp|; the largest excess
    max(0, logp - sampler logp), one-sided: a truncated sampler's logprob (vLLM's with
    `sampling.top_p` etc.) is the full policy's minus log(kept mass) <= 0, so only the
    mismatch (kernels, weights) can put the trainer's above it, where it exceeds the
    token's -log(kept mass); and the mean entropy.
    Jitted here: the driver calls it on the host after each logprob pass."""
    delta = jnp.where(mask_nt, logp_nt - sampler_logp_nt, 0.0)
    diff = jnp.abs(delta)
    count = jnp.maximum(jnp.sum(mask_nt), 1)
    return {
        "logprob_diff_max": jnp.max(diff),
        "logprob_diff_mean": jnp.sum(diff) / count,
        "logprob_excess_max": jnp.maximum(jnp.max(delta), 0.0),
        "entropy": jnp.sum(jnp.where(mask_nt, entropy_nt, 0.0)) / count,
    }


__all__ = [
    "ADAPTERS_OFF",
    "ForwardConfig",
    "accumulate_gradients",
    "batch_shardings",
    "combine_metrics",
    "completion_hidden",
    "jit_step",
    "logprob_agreement",
    "make_logprob_pass",
    "make_update_step",
    "merge_micro",
    "policy_logprobs",
    "positions_from_mask",
    "split_micro",
]
