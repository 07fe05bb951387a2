"""Training state and optimizer: the pytree every jitted step takes and returns.

API (stable; the PPO step and the driver build on it):

    tx = make_optimizer(OptimizerConfig(learning_rate=1e-5, warmup_steps=10))
    graphdef, state = create_train_state(model, tx, rng=jax.random.key(0),
                                         kl_controller=fixed_kl_controller(0.0),
                                         with_ref=True)
    state = shard_train_state(state, tx, mesh)          # place on a (data, fsdp, tensor) mesh
    state, applied_metrics = apply_gradients(state, tx, grads, loss=loss,
                                             schedule=make_schedule(cfg))

`TrainState` holds only arrays (a `flax.struct.dataclass`); the model's `nnx.GraphDef` is
kept outside as a static value and recombined with `nnx.merge(graphdef, state.params)`
inside the step.

LoRA: when the model carries adapters (`grpojax.models.add_lora`), `params` still holds the
whole model (base weights and adapters, so every forward, the sampler and checkpoints see one
state), but only the adapters are trained: `trainable_split` separates them, the steps
differentiate only them, and the optimizer state is built for them alone. There is no
reference copy: the reference policy is the same base weights with the adapters switched
off (`grpojax.models.adapters_off`).

Weight decay follows the Hugging Face Trainer (and so TRL) by default: AdamW's decoupled
decay skips biases and norm scales (`OptimizerConfig.decay_mask`, `decay_mask_except_bias_norm`).

`apply_gradients` is the one place where an update is applied: a non-finite loss or
gradient leaves `params` and `opt_state` untouched and increments `skipped`, so a single
bad batch can never poison the weights or the Adam moments.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax import Array
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from grpojax.models.decoder import BIAS_PARAMS, NORM_PARAMS
from grpojax.models.lora import LoRAParam
from grpojax.models.precision import cast_floating, compute_dtype_of
from grpojax.models.sharding import PARAM_AXES, logical_to_spec, put_global
from grpojax.ops.checks import check_choice, check_int, check_number
from grpojax.ops.kl import KLController, KLControllerState, fixed_kl_controller
from grpojax.user_code import import_object, is_import_path

SCHEDULES = ("constant", "cosine")
# Built-in weight-decay masks (`OptimizerConfig.decay_mask`); "package.module:function" too.
DECAY_MASKS = ("except_bias_norm", "all")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with linear warmup, a constant or cosine schedule, and global-norm clipping.

    Attributes:
      learning_rate: peak learning rate, > 0.
      schedule: "constant" (after warmup) or "cosine" (decay to
        `learning_rate * final_lr_fraction` at `total_steps`).
      warmup_steps: linear warmup from 0 over this many optimizer updates, >= 0.
      total_steps: length of the cosine schedule in optimizer updates (warmup included),
        > warmup_steps; ignored for "constant". None with "cosine": set by the driver to
        the run's number of updates (`make_schedule` needs it).
      final_lr_fraction: cosine end value as a fraction of the peak, in [0, 1].
      b1, b2, eps: Adam moments' decay rates (in [0, 1)) and epsilon (> 0).
      weight_decay: decoupled weight decay (AdamW), >= 0:
        `w <- w - lr * (adam_update + weight_decay * w)` on the parameters `decay_mask` picks.
      decay_mask: which trained parameters decay, by name (the optimizer sees the trained
        parameters: with LoRA, the adapters alone):
        "except_bias_norm" (default): all but biases (`bq`, `bk`, `bv`, a scalar head's `b`;
          Flax modules' `bias`) and norm scales (`decoder.NORM_PARAMS`; Flax norms' `scale`),
          the
          Hugging Face Trainer's rule (`get_decay_parameter_names`: no decay for names
          containing "bias" or a norm), which TRL inherits. Embeddings, the LM head, a
          scalar head's `w` and LoRA's A and B matrices decay, as there (HF + PEFT).
        "all": every trained parameter (grpojax before this option, and optax's default).
        "package.module:function": a function `params -> pytree of bool like params`
          (True: decays), as optax's `mask`. Research code can also pass such a function
          (or a bool pytree) to `make_optimizer(config, decay_mask=...)`.
      max_grad_norm: clip gradients to this global L2 norm before Adam; None disables.
    """

    learning_rate: float = 1e-6
    schedule: str = "constant"
    warmup_steps: int = 0
    total_steps: int | None = None
    final_lr_fraction: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    decay_mask: str = "except_bias_norm"
    max_grad_norm: float | None = 1.0

    def __post_init__(self):
        check_choice("schedule", self.schedule, SCHEDULES)
        check_number("learning_rate", self.learning_rate, minimum=0, strict=True, array_ok=False)
        check_int("warmup_steps", self.warmup_steps, minimum=0)
        if self.schedule == "cosine" and self.total_steps is not None:
            if not (isinstance(self.total_steps, int) and self.total_steps > self.warmup_steps):
                raise ValueError(
                    "schedule='cosine' needs total_steps, an int > warmup_steps "
                    f"({self.warmup_steps}), got {self.total_steps!r}"
                )
        check_number("final_lr_fraction", self.final_lr_fraction, minimum=0, maximum=1)
        for name in ("b1", "b2"):
            check_number(
                name, getattr(self, name), minimum=0, maximum=1, strict_max=True, array_ok=False
            )
        check_number("eps", self.eps, minimum=0, strict=True, array_ok=False)
        check_number("weight_decay", self.weight_decay, minimum=0, array_ok=False)
        resolve_decay_mask(self.decay_mask)
        check_number(
            "max_grad_norm",
            self.max_grad_norm,
            minimum=0,
            strict=True,
            none_ok=True,
            array_ok=False,
        )


# Flax's own names for a bias (`nnx.Linear`, `nnx.Conv`, `nnx.LayerNorm`, ...) and a norm's
# scale (`nnx.LayerNorm`, `nnx.RMSNorm`, `nnx.GroupNorm`, `nnx.BatchNorm`): a researcher's
# model built from Flax's modules is classed as grpojax's own.
FLAX_BIAS_NORM_PARAMS = ("bias", "scale")


def decay_mask_except_bias_norm(params):
    """The Hugging Face Trainer's weight-decay mask: True (decays) for every parameter but
    the biases and norm scales.

        decays(p) = name(p) not in BIAS_PARAMS + NORM_PARAMS + FLAX_BIAS_NORM_PARAMS
                                                          (the attribute's name)

    `params`: a pytree of parameters (an `nnx.State`, or the LoRA adapters alone, whose
    names `<t>_a` / `<t>_b` all decay); returns a pytree of Python bools like it. The rule
    reads each leaf's last path name, so stacked layers (`layers.attn_norm` `[L, D]`) and
    heads' backbones (`backbone.final_norm`) are classed by what they are, not by rank.
    """
    exempt = set(BIAS_PARAMS) | set(NORM_PARAMS) | set(FLAX_BIAS_NORM_PARAMS)
    return jax.tree_util.tree_map_with_path(
        lambda path, _: _param_name(path).rsplit(".", 1)[-1] not in exempt, params
    )


_DECAY_MASK_FNS = {"except_bias_norm": decay_mask_except_bias_norm, "all": None}


def resolve_decay_mask(spec: str) -> Callable | None:
    """The mask `spec` names, as optax's `mask` takes it: a function `params -> bool pytree`,
    or None ("all": no mask).

    Raises:
      ValueError: one line naming `decay_mask`, for anything but a key of `DECAY_MASKS` or
        an importable "package.module:function" naming a callable.
    """
    allowed = f"one of {DECAY_MASKS} or 'package.module:function'"
    if not isinstance(spec, str):
        raise ValueError(f"decay_mask must be {allowed}, got {spec!r}")
    if spec in _DECAY_MASK_FNS:
        return _DECAY_MASK_FNS[spec]
    if not is_import_path(spec):
        raise ValueError(f"decay_mask must be {allowed}, got {spec!r}")
    fn = import_object("decay_mask", spec)
    if not callable(fn):
        raise ValueError(
            f"decay_mask: {spec!r} must be a function params -> pytree of bool, got "
            f"{type(fn).__name__}"
        )
    return fn


def make_schedule(config: OptimizerConfig) -> optax.Schedule:
    """Learning rate as a function of the number of applied optimizer updates."""
    peak = config.learning_rate
    if config.schedule == "cosine":
        if config.total_steps is None:
            raise ValueError("schedule='cosine' needs total_steps (the schedule's length)")
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0,
            peak_value=peak,
            warmup_steps=config.warmup_steps,
            decay_steps=config.total_steps,
            end_value=peak * config.final_lr_fraction,
        )
    if config.warmup_steps == 0:
        return optax.constant_schedule(peak)
    return optax.join_schedules(
        [
            optax.linear_schedule(0.0, peak, config.warmup_steps),
            optax.constant_schedule(peak),
        ],
        [config.warmup_steps],
    )


def _decoupled_weight_decay(weight_decay: float, mask) -> optax.GradientTransformation:
    """`optax.add_decayed_weights(weight_decay)` on the parameters `mask` picks (u + wd * p
    there, u elsewhere), keeping the unmasked transform's state (`optax.EmptyState`).

    `optax.add_decayed_weights(..., mask=...)` wraps its state in a `MaskedState`, a
    different pytree node: Orbax then refuses to restore a checkpoint written with the other
    setting. Here the state is the same whatever the mask, so runs resume across
    `decay_mask` settings (and checkpoints written before the option existed)."""
    inner = optax.add_decayed_weights(weight_decay)
    if mask is None:
        return inner

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("weight decay needs the params: call tx.update(grads, state, params)")
        tree = mask(params) if callable(mask) else mask

        def one(decays, u, p):  # u, p: the subtrees under one mask leaf
            return inner.update(u, state, p)[0] if decays else u

        return jax.tree.map(one, tree, updates, params), state

    return optax.GradientTransformation(inner.init, update)


def make_optimizer(
    config: OptimizerConfig, *, decay_mask: Callable | Any | None = None
) -> optax.GradientTransformation:
    """optax chain: clip_by_global_norm (optional) -> AdamW with `make_schedule(config)`,
    decaying the parameters `config.decay_mask` picks.

    AdamW is `optax.adamw`'s chain (scale_by_adam -> decoupled weight decay ->
    scale_by_learning_rate) with the decay masked by `_decoupled_weight_decay`, so the
    optimizer state has `optax.adamw`'s structure for every mask.

    Non-finite updates are not filtered here: `apply_gradients` decides (it also sees the
    loss) and keeps the old state, so the schedule's count only advances on applied steps.

    Args:
      config: the optimizer's hyperparameters.
      decay_mask: research code's own mask, replacing `config.decay_mask`: a function
        `params -> pytree of bool like params` or such a pytree (True: decays; a leaf may
        stand for a whole subtree), as `optax.adamw(mask=...)` takes it. `params` is what
        the optimizer sees: the trained parameters (`trainable_split(state.params)[0]`;
        with LoRA, the adapters).
    """
    mask = resolve_decay_mask(config.decay_mask) if decay_mask is None else decay_mask
    adamw = optax.chain(
        optax.scale_by_adam(b1=config.b1, b2=config.b2, eps=config.eps),
        _decoupled_weight_decay(config.weight_decay, mask),
        optax.scale_by_learning_rate(make_schedule(config)),
    )
    if config.max_grad_norm is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(config.max_grad_norm), adamw)


@flax.struct.dataclass
class TrainState:
    """Everything a step reads and writes, as one pytree of arrays.

    params: `nnx.State` of the model's `nnx.Param`s (the graphdef is kept outside, static).
    opt_state: the optax state for `params`.
    step: `[]` int32, number of train-step calls completed (a call may do several
      optimizer updates: epochs x mini-batches).
    num_updates: `[]` int32, optimizer updates actually applied (skipped ones excluded).
    skipped: `[]` int32, running count of skipped (non-finite) updates.
    rng: a `jax.random` key, split inside the step (shuffling); checkpointed with the rest.
    kl_state: `KLControllerState` (beta of the KL coefficient controller).
    ref_params: `nnx.State` of the reference policy, or None (no reference kept: beta = 0,
      or reference logprobs supplied with the batch). Stored in the model's compute dtype
      (it is never updated, so it needs no float32 master). Iterative GRPO refreshes it.
      Or a `Teacher`: another model (on-policy distillation), read by the exact
      divergence only.
    """

    params: Any
    opt_state: Any
    step: Array
    num_updates: Array
    skipped: Array
    rng: Array
    kl_state: KLControllerState
    ref_params: Any = None


@flax.struct.dataclass
class Teacher:
    """A frozen reference of its own architecture (on-policy distillation's teacher, which
    may be larger than the policy): its graph definition (static) and parameters. As
    `TrainState.ref_params` it is read by the exact divergence (`kl_estimator="full"`),
    which runs its forward for its hidden states; it shares the policy's vocabulary."""

    graphdef: Any = flax.struct.field(pytree_node=False)
    params: Any


def split_params(model) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, params) of an NNX model whose state is only `nnx.Param`s."""
    # Two filters give exactly three parts; flax annotates the result as variadic.
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)  # type: ignore[misc]
    if jax.tree.leaves(rest):
        raise ValueError(
            "the model holds non-Param state (e.g. batch statistics or RNG streams); the "
            "train steps support models whose state is only nnx.Param"
        )
    return graphdef, params


def merge(graphdef: nnx.GraphDef, params: nnx.State):
    """The module for `params` (inside a step: a functional view, no copies)."""
    return nnx.merge(graphdef, params)


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def is_lora(params) -> bool:
    """Whether `params` (an `nnx.State`) holds LoRA adapters, i.e. trains only them."""
    return any(isinstance(v, LoRAParam) for v in jax.tree.leaves(params, is_leaf=_is_variable))


def trainable_split(params):
    """(trainable, frozen): LoRA -> (adapters, base weights); otherwise (params, None)."""
    if not is_lora(params):
        return params, None
    return nnx.split_state(params, LoRAParam, ...)


def join_trainable(trainable, frozen):
    """The inverse of `trainable_split`."""
    return trainable if frozen is None else nnx.merge_state(trainable, frozen)


def has_reference(state: TrainState) -> bool:
    """The state can give reference logprobs: a reference copy, or (LoRA) the base weights
    with the adapters off."""
    return state.ref_params is not None or is_lora(state.params)


def _is_compute(dtype) -> bool:
    return isinstance(dtype, str) and dtype == "compute"


def create_train_state(
    model,
    tx: optax.GradientTransformation,
    *,
    rng: Array,
    kl_controller: KLController | None = None,
    with_ref: bool = False,
    ref_dtype: Any = "compute",
    base_dtype: Any = "compute",
) -> tuple[nnx.GraphDef, TrainState]:
    """Split `model` and build its initial `TrainState`.

    Precision: the params (and so the optimizer moments, which optax makes like them) keep
    the model's parameter dtype, float32 masters by default; the reference copy is cast to
    `ref_dtype`. LoRA: the frozen base weights are cast to `base_dtype` (the compute dtype
    by default: they never train, so they need no float32 master; with bf16 compute this
    halves the base, and the forward is bit for bit that of the float32 base, which the
    decoder would round to bf16 where each weight is used); the adapters and their
    optimizer moments keep the parameter dtype.

    Args:
      model: an NNX module (`Decoder`, `ValueModel`, `RewardModel`, ...).
      tx: from `make_optimizer`.
      rng: a `jax.random` key (typed or raw uint32).
      kl_controller: initial KL coefficient state; default a fixed beta of 0.
      with_ref: keep a copy of the initial params as the reference policy (LoRA: no copy;
        the reference is the base weights with the adapters off).
      ref_dtype: dtype of the reference copy: "compute" (the default: the model's compute
        dtype, `grpojax.models.compute_dtype_of`; the params' own dtype for a model
        without one), None (the params' dtype) or a dtype.
      base_dtype: dtype of a LoRA model's frozen base weights in `params`, as `ref_dtype`.

    Returns:
      (graphdef, state); the params are the model's arrays (not copied; a LoRA base cast
      to another dtype is new arrays with the same placement), so place the model
      (e.g. `grpojax.models.shard_model`) before, or use `shard_train_state` after.
    """
    graphdef, params = split_params(model)
    controller = fixed_kl_controller(0.0) if kl_controller is None else kl_controller
    if is_lora(params):
        adapters, base = trainable_split(params)
        dtype = compute_dtype_of(model) if _is_compute(base_dtype) else base_dtype
        params = join_trainable(adapters, cast_floating(base, dtype))
    ref = None
    if with_ref and not is_lora(params):
        dtype = compute_dtype_of(model) if _is_compute(ref_dtype) else ref_dtype
        ref = cast_floating(jax.tree.map(jnp.copy, params), dtype)
    state = TrainState(
        params=params,
        opt_state=tx.init(trainable_split(params)[0]),
        step=jnp.zeros((), jnp.int32),
        num_updates=jnp.zeros((), jnp.int32),
        skipped=jnp.zeros((), jnp.int32),
        rng=rng,
        kl_state=controller.init(),
        ref_params=ref,
    )
    return graphdef, state


# ----------------------------------------------------------------------------------------
# Sharding of the state
# ----------------------------------------------------------------------------------------


def _param_name(path) -> str:
    parts = []
    for k in path:
        name = getattr(k, "key", getattr(k, "name", None))
        if name is None:
            name = str(getattr(k, "idx", k))
        parts.append(str(name))
    if parts and parts[-1] == "value":  # nnx.Variable's own pytree node
        parts = parts[:-1]
    return ".".join(parts)


def _spec_for(name: str, shape, mesh: Mesh) -> PartitionSpec:
    # Heads' backbones (`backbone.layers.wq`) shard like the bare decoder's parameters.
    for prefix in ("", "backbone.", "model.", "policy."):
        if name.startswith(prefix) and name[len(prefix) :] in PARAM_AXES:
            axes = PARAM_AXES[name[len(prefix) :]]
            if len(axes) == len(shape):
                return logical_to_spec(axes, tuple(shape), dict(mesh.shape))
    return PartitionSpec()


def param_sharding_tree(params, mesh: Mesh):
    """A pytree like `params` of `NamedSharding`s from the decoder's logical-axis table.

    Decoder parameters (also under a `backbone.` prefix) follow
    `grpojax.models.sharding.PARAM_AXES`; anything else (scalar heads) is replicated.
    """
    return jax.tree_util.tree_map_with_path(
        lambda path, x: NamedSharding(mesh, _spec_for(_param_name(path), jnp.shape(x), mesh)),
        params,
    )


def train_state_shardings(state: TrainState, tx: optax.GradientTransformation, mesh: Mesh):
    """A `TrainState` of `NamedSharding`s: params and their Adam moments sharded alike
    (`optax.tree_map_params`), scalars, counts and keys replicated."""
    # Any: this TrainState's leaves are shardings, where its fields are annotated Array.
    replicated: Any = NamedSharding(mesh, PartitionSpec())
    param_sh = param_sharding_tree(state.params, mesh)
    opt_sh = optax.tree_map_params(
        tx,
        lambda _, sh: sh,
        state.opt_state,
        trainable_split(param_sh)[0],
        transform_non_params=lambda _: replicated,
    )
    return TrainState(
        params=param_sh,
        opt_state=opt_sh,
        step=replicated,
        num_updates=replicated,
        skipped=replicated,
        rng=replicated,
        kl_state=jax.tree.map(lambda _: replicated, state.kl_state),
        ref_params=_ref_shardings(state.ref_params, param_sh, mesh),
    )


def _ref_shardings(ref, param_sh, mesh: Mesh):
    """The reference's shardings: the policy's, or a `Teacher`'s own (its parameters'
    logical axes on the same mesh)."""
    if ref is None:
        return None
    if isinstance(ref, Teacher):
        return Teacher(ref.graphdef, param_sharding_tree(ref.params, mesh))
    return param_sh


def shard_train_state(state: TrainState, tx: optax.GradientTransformation, mesh: Mesh):
    """`state` placed on `mesh` with `train_state_shardings`; returns (state, shardings)."""
    shardings = train_state_shardings(state, tx, mesh)
    return put_global(state, shardings), shardings


# ----------------------------------------------------------------------------------------
# The one place updates are applied
# ----------------------------------------------------------------------------------------


def tree_all_finite(tree) -> Array:
    """`[]` bool: every element of every leaf is finite."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


def apply_gradients(
    state: TrainState,
    tx: optax.GradientTransformation,
    grads,
    *,
    loss: Array,
    schedule: optax.Schedule | None = None,
) -> tuple[TrainState, dict[str, Array]]:
    """One optimizer update, skipped when the loss or any gradient is non-finite.

        applied = isfinite(loss) and all(isfinite(grads))
        params, opt_state <- tx(params, grads)   if applied, else unchanged

    Args:
      state: the current state (its `step` is not touched: a step may update many times).
      tx: the optimizer from `make_optimizer`.
      grads: a pytree like `state.params`, or (LoRA) like its adapters alone
        (`trainable_split`); only those are updated.
      loss: `[]` the loss the gradients belong to.
      schedule: `make_schedule(config)`, for the learning-rate metric (optional).

    Returns:
      (new_state, metrics) with metrics `grad_norm` (global L2 norm before clipping),
      `skipped` (1.0 if skipped, else 0.0) and `lr` (the rate this update used; 0 without
      a schedule).
    """
    finite = jnp.isfinite(loss) & tree_all_finite(grads)
    # Zero the gradient before the optimizer sees it, so the discarded branch stays finite
    # too (no NaN arithmetic in the moments, nothing for a debugger to trip on).
    safe_grads = jax.tree.map(lambda g: jnp.where(finite, g, jnp.zeros_like(g)), grads)
    trainable, frozen = trainable_split(state.params)
    updates, new_opt = tx.update(safe_grads, state.opt_state, trainable)
    new_params = optax.apply_updates(trainable, updates)

    def select(new, old):
        return jnp.where(finite, new, old)

    lr = schedule(state.num_updates) if schedule is not None else jnp.zeros(())
    new_trainable = jax.tree.map(select, new_params, trainable)
    new_state = dataclasses.replace(
        state,
        params=join_trainable(new_trainable, frozen),
        opt_state=jax.tree.map(select, new_opt, state.opt_state),
        num_updates=state.num_updates + finite.astype(jnp.int32),
        skipped=state.skipped + (~finite).astype(jnp.int32),
    )
    metrics = {
        "grad_norm": optax.tree.norm(grads).astype(jnp.float32),
        "skipped": (~finite).astype(jnp.float32),
        "lr": jnp.asarray(lr, jnp.float32),
    }
    return new_state, metrics


__all__ = [
    "DECAY_MASKS",
    "SCHEDULES",
    "OptimizerConfig",
    "TrainState",
    "apply_gradients",
    "create_train_state",
    "decay_mask_except_bias_norm",
    "has_reference",
    "is_lora",
    "join_trainable",
    "make_optimizer",
    "make_schedule",
    "merge",
    "param_sharding_tree",
    "put_global",
    "resolve_decay_mask",
    "shard_train_state",
    "split_params",
    "train_state_shardings",
    "trainable_split",
    "tree_all_finite",
]
