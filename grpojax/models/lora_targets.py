"""Where LoRA adapters attach: the target table and the adapters' logical axes.

Data only, below both `lora` (the adapters themselves) and `sharding` (the table of every
parameter's logical axes, adapters included): `sharding` reads the targets to give each
adapter the axes of its base weight, and `lora` places new adapters with that table, so the
shared facts live here and neither module imports the other's importer. `grpojax.models.lora`
re-exports every name.

A target's base weight is `[L, *in, *out]` with `n_in` input axes after L; its adapter is
A `[L, *in, r]`, B `[L, r, *out]` (the LM head's, `lm_head`: A `[D, r]`, B `[r, V]`).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class _Target:
    base: str  # LayerStack attribute of the base weight
    hf_module: str  # HF module path inside a decoder layer
    n_in: int  # how many leading (after L) axes of the base weight are input axes
    a_spec: str  # einsum: x, A (one layer) -> x A  `[N, T, r]`
    b_spec: str  # einsum: x A, B (one layer) -> delta, in the base output's layout


TARGETS: dict[str, _Target] = {
    "q": _Target("wq", "self_attn.q_proj", 1, "ntd,dr->ntr", "ntr,rqh->ntqh"),
    "k": _Target("wk", "self_attn.k_proj", 1, "ntd,dr->ntr", "ntr,rkh->ntkh"),
    "v": _Target("wv", "self_attn.v_proj", 1, "ntd,dr->ntr", "ntr,rkh->ntkh"),
    "o": _Target("wo", "self_attn.o_proj", 2, "ntqh,qhr->ntr", "ntr,rd->ntd"),
    "gate": _Target("w_gate", "mlp.gate_proj", 1, "ntd,dr->ntr", "ntr,rf->ntf"),
    "up": _Target("w_up", "mlp.up_proj", 1, "ntd,dr->ntr", "ntr,rf->ntf"),
    "down": _Target("w_down", "mlp.down_proj", 1, "ntf,fr->ntr", "ntr,rd->ntd"),
}
ALL_TARGETS = tuple(TARGETS)  # the layer targets, also the default
TARGET_OF_BASE = {t.base: name for name, t in TARGETS.items()}
HEAD = "lm_head"  # the output projection's adapter: A `[D, r]`, B `[r, V]`
TARGET_NAMES = (*ALL_TARGETS, HEAD)  # every allowed target, in canonical order


def adapter_axes(base_axes: tuple[str, ...], n_in: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Logical axes of (A, B) from the base weight's `(layers, *in, *out)` axes."""
    head, out = base_axes[: 1 + n_in], base_axes[1 + n_in :]
    return (*head, "lora_rank"), (base_axes[0], "lora_rank", *out)


__all__ = [
    "ALL_TARGETS",
    "HEAD",
    "TARGETS",
    "TARGET_NAMES",
    "TARGET_OF_BASE",
    "adapter_axes",
]
