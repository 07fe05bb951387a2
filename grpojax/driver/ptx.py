"""PPO-ptx's data: the batch of text each RL step's next-token term trains on.

Rows are drawn from the training rows in the run's "ptx_order" stream, batch i being
`batch_rows(seed, "ptx_order", num_rows, ptx.batch_size, i)` for RL step i: a function of
the step only, so a resumed run draws the same rows (nothing to checkpoint). Two kinds of
text (`PtxSpec.column`):

- None: the demonstrations (`prompt` + `completion`), encoded as the SFT warm start encodes
  them (`demonstration_batch`), the loss on the completion tokens;
- a column name: that column's text, cut to `ptx.max_tokens` tokens and right-padded to it
  (one shape for every step), every token after the first a target.
"""

from __future__ import annotations

import numpy as np
from jax.sharding import Mesh

from grpojax.config import RunConfig
from grpojax.data import encode_texts, pad_id_of
from grpojax.driver.sft import batch_rows, demonstration_batch
from grpojax.models.sharding import put_global
from grpojax.train import SFTBatch, batch_shardings

__all__ = ["PtxData", "ptx_data"]


class PtxData:
    """`batch(step)`: the ptx rows of RL step `step` as a global `SFTBatch` on the mesh
    (each process builds the whole batch and keeps its devices' rows)."""

    def __init__(self, cfg: RunConfig, rows, tokenizer, mesh: Mesh):
        self.cfg, self.rows, self.tokenizer, self.mesh = cfg, rows, tokenizer, mesh
        self.pad_id = pad_id_of(tokenizer)

    def host_batch(self, step: int) -> SFTBatch:
        """The host (NumPy) `SFTBatch` of step `step`."""
        p = self.cfg.ptx
        idx = batch_rows(self.cfg.seed, "ptx_order", len(self.rows), p.batch_size, step)
        chosen = [self.rows[i] for i in idx]
        if p.column is None:
            return demonstration_batch(self.tokenizer, chosen, self.cfg, pad_id=self.pad_id)
        tokens, lengths = encode_texts(
            self.tokenizer,
            [str(r[p.column]) for r in chosen],
            width=p.max_tokens,
            pad_id=self.pad_id,
        )
        mask = np.arange(p.max_tokens)[None, :] < lengths[:, None]
        loss_mask = mask.copy()
        loss_mask[:, 0] = False
        return SFTBatch(tokens, mask, loss_mask)

    def batch(self, step: int) -> SFTBatch:
        batch = self.host_batch(step)
        return put_global(batch, batch_shardings(batch, self.mesh))


def ptx_data(cfg: RunConfig, rows, tokenizer, mesh: Mesh) -> PtxData | None:
    """The run's `PtxData`, or None when the step's `ptx_coef` is 0."""
    if not cfg.step_config.ptx_coef:
        return None
    return PtxData(cfg, rows, tokenizer, mesh)
