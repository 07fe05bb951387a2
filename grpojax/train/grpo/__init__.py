"""The GRPO-family update: mu epochs x mini-batches x micro-batches in one compiled program.

    step = make_grpo_step(graphdef, tx, config, mesh=mesh, state_shardings=sh, batch=batch)
    state, metrics = step(state, batch)

`grpo_update(state, batch, graphdef=, tx=, config=)` is the pure function it jits (usable
inside a user's own `jax.jit`). `grpo_loss(model, batch, config)` is its first update's loss
(and gradient) without the optimizer, `grpo_loss_from_logprobs` the same loss from per-token
logprobs, and `grpo_batch_from_ids` builds a batch from token-id lists.

The GRPO variants (Dr.GRPO, DAPO, GSPO, dual clip, off-policy masking, rollout correction,
keep mask) are fields of `GRPOConfig`, and so are the policy loss and the advantage
estimator (a built-in name or "package.module:function", `grpojax.train.objectives`),
called inside the same compiled program; there is one step.

One concept a module, imports pointing one way (batch <- loss <- update):

- `grpojax.train.grpo.batch`: `GRPOBatch` and its building from a rollout or token-id lists,
  the checks of its rows, and the rows as the loss reads them (advantages, overlong filter);
- `grpojax.train.grpo.loss`: the forwards and the loss (`grpo_micro_loss`, `grpo_loss`,
  `grpo_loss_from_logprobs`, `MiniBatchRows`);
- `grpojax.train.grpo.update`: the scanned update (`grpo_update`, `make_grpo_step`): the rows
  permuted and split into mini- and micro-batches, what is precomputed, gradient
  accumulation, PPO-ptx (its docstring walks through one call of the step).

The package re-exports their public names, and keeps `GRPOConfig`, `_precompute_logp`,
`_blocks` and `_unblocks` importable from here as the one-module `grpo.py` had them.
"""

from grpojax.train.config import GRPOConfig as GRPOConfig
from grpojax.train.grpo.batch import (
    GRPOBatch,
    grpo_batch_from_ids,
    grpo_batch_from_rollout,
    grpo_batch_from_rows,
)
from grpojax.train.grpo.loss import (
    MiniBatchRows,
    grpo_loss,
    grpo_loss_from_logprobs,
    grpo_micro_loss,
)
from grpojax.train.grpo.loss import _precompute_logp as _precompute_logp
from grpojax.train.grpo.update import _blocks as _blocks
from grpojax.train.grpo.update import _unblocks as _unblocks
from grpojax.train.grpo.update import grpo_update, make_grpo_step

__all__ = [
    "GRPOBatch",
    "MiniBatchRows",
    "grpo_batch_from_ids",
    "grpo_batch_from_rollout",
    "grpo_batch_from_rows",
    "grpo_loss",
    "grpo_loss_from_logprobs",
    "grpo_micro_loss",
    "grpo_update",
    "make_grpo_step",
]
