"""Whether and how a step's batch is packed (`PackingSpec`), decided on the host per step.

`Packer(spec, ...)(batch)` returns the batch with its `packing` set (a
`grpojax.train.packing.Packing` placed on the mesh) or unchanged, and the step's metrics
`packed` (1 or 0) and `padded_frac` (the share of the token positions the forward runs
that hold no token, in the layout it runs). The plan is a function of the rows' prompt and
completion lengths, which every process has (`TrainBatch.host`), so all processes build
the same plan.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from grpojax.config import PackingSpec, RunConfig
from grpojax.models.sharding import batch_sharding, put_global
from grpojax.train.packing import Packing, pack_lengths, padded_fraction
from grpojax.train.rows import TrainBatch


class Packer:
    """The step's packing policy (see the module docstring).

    Args:
      spec: the run's `PackingSpec`.
      group_size: G; rows come in contiguous groups of G sharing a prompt.
      share_prompt: the unpacked step runs each group's prompt once; the packed rows then
        hold whole groups (each prompt once) or whole sequences, whichever layout needs
        fewer positions for the batch at hand (few groups balance badly over the rows).
      rows_multiple: the step's mini- x micro-batches (the packed rows divide into them).
      mesh: where the packing's arrays are placed.
    """

    def __init__(
        self, spec: PackingSpec, *, group_size: int, share_prompt: bool, rows_multiple: int, mesh
    ):
        self.spec = spec
        self.unit = group_size if share_prompt else 1
        self.rows_multiple = rows_multiple
        self.mesh = mesh

    def plan(self, prompt_n: np.ndarray, completion_n: np.ndarray, p: int, t: int):
        """(the `Packing` of these lengths or None, padded fraction of the layout chosen)."""
        g = self.unit
        n = len(prompt_n)
        # The unpacked forward: every row's P + T columns, or with groups each prompt once.
        real = int(completion_n.sum()) + int(prompt_n[::g].sum())
        unpacked = (n // g) * p + n * t
        unpacked_padded = 1.0 - real / unpacked
        if self.spec.mode == "never":
            return None, unpacked_padded
        layouts = [
            pack_lengths(
                prompt_n,
                completion_n,
                prompt_width=p,
                completion_width=t,
                group_size=unit,
                rows_multiple=self.rows_multiple,
                max_slots=self.spec.max_slots,
            )
            for unit in sorted({g, 1}, reverse=True)
        ]
        packing = min(layouts, key=lambda x: x.src_rw.size)  # the group layout on a tie
        packed = packing.src_rw.size
        saved = unpacked - packed
        if self.spec.mode == "auto" and (
            saved < self.spec.min_saved_tokens or packed > 0.8 * unpacked
        ):
            return None, unpacked_padded
        return packing, padded_fraction(packing)

    def __call__(self, batch: TrainBatch) -> tuple[TrainBatch, dict[str, float]]:
        host = batch.host
        s = batch.tokens_ns.shape[1]
        t = batch.completion_mask_nt.shape[1]
        completion_n = np.where(host["valid_n"], host["lengths_n"], 0)
        packing, padded = self.plan(host["prompt_lengths_n"], completion_n, s - t, t)
        metrics = {"packed": float(packing is not None), "padded_frac": padded}
        if packing is None:
            return batch, metrics
        return dataclasses.replace(batch, packing=self._place(packing)), metrics

    def _place(self, packing: Packing) -> Packing:
        leaves = {f.name: getattr(packing, f.name) for f in dataclasses.fields(packing)}
        leaves = {k: v for k, v in leaves.items() if v is not None}
        shardings = {k: batch_sharding(self.mesh, v.ndim, v.shape) for k, v in leaves.items()}
        return Packing(**put_global(leaves, shardings))


def packing_spec(cfg: RunConfig) -> PackingSpec:
    """`cfg.packing`, with mode "never" where the run's rows cannot be packed. Multi-turn
    runs (`env.name` set) are not packed: an episode's loss mask has holes at the
    environment's ids, and the packed layout takes each completion's loss as one contiguous
    run (`RunConfig` refuses mode "always" with an environment). Nor are the rows of a run
    that replays the sampler's expert routing (`model.routing_replay`) or adds the experts'
    load-balancing loss (`grpo.router_aux_coef`): both are laid out per row."""
    aux = not cfg.is_ppo and cfg.grpo.router_aux_coef > 0
    unpacked = cfg.env.enabled or cfg.model.routing_replay != "none" or aux
    return dataclasses.replace(cfg.packing, mode="never") if unpacked else cfg.packing


def build_packer(cfg: RunConfig, mesh) -> Packer:
    """The run's `Packer`, from `packing_spec(cfg)` and the step's layout."""
    step = cfg.step_config
    spec = packing_spec(cfg)
    return Packer(
        spec,
        group_size=cfg.group_size,
        share_prompt=step.share_prompt,
        rows_multiple=step.num_minibatches * step.num_microbatches,
        mesh=mesh,
    )


__all__ = ["Packer", "build_packer", "packing_spec"]
