"""Sequence packing for the train steps: several sequences per row, no compute on padding.

The rows of a batch (N = B*G rows; the prompt left-padded to P columns, the completion
right-padded to T, S = P + T: the layout of `grpojax.sampling.Rollout.sequences()`) are
assigned on the host to R packed rows ("bins") of W tokens, each holding up to J of the
batch's rows ("slots"), first-fit decreasing by length (`pack_plan`). The step keeps every
per-token quantity (logprobs, advantages, masks, losses) in the batch's own `[rows, T]`
layout, its rows reordered bin by bin (`Packing.to_slots`: R*J rows, an empty slot all
masked), so losses, every aggregation mode and gradient accumulation are what they are
unpacked; only the model forward runs on the packed `[R, W]` rows, with per-token positions
and segment ids (`packed_completion_hidden`), and its per-position outputs are gathered
back to `[R*J, T]` (`Packing.to_rows`).

Two layouts of a bin:

- whole sequences (`group_size=1`): a unit is one row, its prompt then its completion,
  `p_i + c_i` tokens, one segment;
- shared prompt (`group_size=G`): a unit is a group, its prompt once, then its G
  completions, `p + sum_i c_i` tokens; each completion is a segment of its own that also
  reads the prompt's segment (its parent, `grpojax.models.attention`), so the prompt is
  computed once per group, as `share_prompt` does unpacked.

Scored positions: `[R, W + J]`, the W packed positions and then, per slot, the hidden state
of its prompt's last token, which predicts completion token 0 (one position predicts G
first tokens when the prompt is shared). Completion token t >= 1 of a slot is predicted by
the packed position just before it. `Packing.score_rjt` says which scored position predicts
each `[slot, t]`, and `W + J` (out of range) where the token is not real.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax import Array


@flax.struct.dataclass
class Packing:
    """Where each row of a batch sits in the packed rows (int32 arrays; R bins of W tokens,
    J slots per bin, T completion columns).

    rows_rj: `[R, J]` the batch row in each slot, N (one past the last) for an empty slot.
    src_rw: `[R, W]` column of the bin's slot rows flattened, `[J * S]`, that each packed
      token comes from (slot j, column s: j * S + s); 0 at padding.
    segment_rw: `[R, W]` segment ids, 0 at padding.
    parent_rw: `[R, W]` the segment each token also reads (a completion: its group's shared
      prompt), 0 for none; None in the whole-sequence layout.
    position_rw: `[R, W]` RoPE positions, each sequence's own from 0.
    first_rj: `[R, J]` packed position of each slot's last prompt token (0 when empty).
    score_rjt: `[R, J, T]` scored position (in `[0, W + J)`) predicting completion token t
      of slot j; W + J where that token is not real.
    """

    rows_rj: Array | np.ndarray
    src_rw: Array | np.ndarray
    segment_rw: Array | np.ndarray
    position_rw: Array | np.ndarray
    first_rj: Array | np.ndarray
    score_rjt: Array | np.ndarray
    parent_rw: Array | np.ndarray | None = None

    @property
    def num_slots(self) -> int:
        """J, slots per bin."""
        return self.rows_rj.shape[-1]

    def to_slots(self, x_n: Array) -> Array:
        """`[N, ...]` batch rows -> `[R*J, ...]` in slot order (zeros / False when empty)."""
        x_n = jnp.asarray(x_n)
        padded = jnp.concatenate([x_n, jnp.zeros((1, *x_n.shape[1:]), x_n.dtype)])
        return jnp.take(padded, self.rows_rj.reshape(-1), axis=0)

    def from_slots(self, y: Array, num_rows: int) -> Array:
        """`[R*J, ...]` in slot order -> `[N, ...]` batch rows (the inverse of `to_slots`)."""
        out = jnp.zeros((num_rows + 1, *y.shape[1:]), y.dtype)
        return out.at[self.rows_rj.reshape(-1)].set(y)[:num_rows]

    def permuted(self, perm_n: Array) -> Packing:
        """The bins in the order of `perm_n`, a permutation of the `[R*J]` slot rows that
        keeps each bin's J rows together (`unit_permutation` with unit J)."""
        bins = perm_n[:: self.num_slots] // self.num_slots
        return jax.tree.map(lambda x: jnp.take(x, bins, axis=0), self)

    def to_rows(self, x_rx: Array) -> Array:
        """Scored positions `[R, W + J, ...]` -> `[R*J, T, ...]` (0 where not real)."""
        r, j, t = self.score_rjt.shape
        idx = self.score_rjt.reshape(r, j * t)
        idx = idx.reshape(r, j * t, *([1] * (x_rx.ndim - 2)))
        out = jnp.take_along_axis(x_rx, idx, axis=1, mode="fill", fill_value=0)
        return out.reshape(r * j, t, *x_rx.shape[2:])

    def from_rows(self, y_nt: Array) -> Array:
        """`[R*J, T]` in slot order -> scored positions `[R, W + J]` (0 elsewhere)."""
        r, j, t = self.score_rjt.shape
        width = self.src_rw.shape[1] + j
        out = jnp.zeros((r, width), y_nt.dtype)
        bins = jnp.broadcast_to(jnp.arange(r)[:, None], (r, j * t))
        return out.at[bins, self.score_rjt.reshape(r, j * t)].set(
            y_nt.reshape(r, j * t), mode="drop"
        )


def packed_completion_hidden(
    model, tokens_ns: Array, packing: Packing, lora_dropout_key: Array | None = None
) -> tuple[Array, Array]:
    """The decoder forward on packed rows; hidden states and targets at the scored positions.

    Args:
      model: a `grpojax.models.Decoder` (or anything with its call contract).
      tokens_ns: `[R*J, S]` the batch's tokens in slot order (`Packing.to_slots`).
      packing: the `Packing` of these R bins.
      lora_dropout_key: LoRA adapter dropout's key (None: none).

    Returns:
      (hidden `[R, W + J, D]`, targets `[R, W + J]`): each scored position's hidden state
      and the token it predicts where it predicts a completion token (`Packing.to_rows`
      picks those).
    """
    r, j, t = packing.score_rjt.shape
    s = tokens_ns.shape[1]
    slots = tokens_ns.reshape(r, j * s)
    tokens = jnp.take_along_axis(slots, packing.src_rw, axis=1)
    kw = {} if lora_dropout_key is None else {"lora_dropout_key": lora_dropout_key}
    hidden, _ = model(
        tokens,
        positions_nt=packing.position_rw,
        segment_ids_nt=packing.segment_rw,
        parent_ids_nt=packing.parent_rw,
        **kw,
    )
    first = jnp.take_along_axis(hidden, packing.first_rj[..., None], axis=1)
    next_tokens = jnp.concatenate([tokens[:, 1:], jnp.zeros((r, 1), tokens.dtype)], axis=1)
    first_targets = tokens_ns.reshape(r, j, s)[:, :, s - t]
    return (
        jnp.concatenate([hidden, first], axis=1),
        jnp.concatenate([next_tokens, first_targets], axis=1),
    )


def check_packing(packing: Packing, num_rows: int, completion_width: int, units: int) -> None:
    """A `ValueError` naming what does not fit: a packing of `num_rows` rows and
    `completion_width` T, its bins dividing into `units` (mini- x micro-batches)."""
    r, j, t = packing.score_rjt.shape
    if packing.rows_rj.shape != (r, j) or t != completion_width:
        raise ValueError(
            f"packing.score_rjt must be [R, J, T] with T={completion_width} and rows_rj [R, J], "
            f"got {packing.score_rjt.shape} and {packing.rows_rj.shape}"
        )
    if r % units:
        raise ValueError(
            f"packing's R={r} bins must divide into num_minibatches x num_microbatches = {units}"
        )
    if r * j < num_rows:
        raise ValueError(f"packing has {r * j} slots for {num_rows} rows")


# ----------------------------------------------------------------------------- the plan


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def bucket(x: int, multiple: int = 1, bits: int = 4) -> int:
    """x rounded up to a multiple of `multiple`, then to a value with at most `bits`
    significant bits in units of `multiple` (bits 4: 1..16, 18, 20, ..., 32, 36, 40, ...,
    at most 12.5% above; bits 5: at most 6.25%), so that batches of nearby sizes share one
    compiled step."""
    units = -(-max(int(x), 1) // multiple)
    step = 1 << max(units.bit_length() - bits, 0)
    return _round_up(units, step) * multiple


def _first_fit(
    lengths: Sequence[int], order: Iterable[int], width: int, fits_slot: Callable[[list[int]], bool]
) -> list[list[int]]:
    """First-fit decreasing into bins of `width`: the bins' unit lists."""
    room: list[int] = []
    bins: list[list[int]] = []
    for u in order:
        need = lengths[u]
        for b, free in enumerate(room):
            if free >= need and fits_slot(bins[b]):
                room[b] -= need
                bins[b].append(u)
                break
        else:
            room.append(width - need)
            bins.append([u])
    return bins


def _balanced(
    lengths: Sequence[int],
    order: Iterable[int],
    num_bins: int,
    fits_slot: Callable[[list[int]], bool],
) -> list[list[int]] | None:
    """Longest first, each unit to the least-loaded bin with a free slot (LPT: the fullest
    bin is within 4/3 of the best possible; ties to the lowest index): the bins' unit
    lists, or None when the slots run out."""
    heap = [(0, b) for b in range(num_bins)]  # (load, bin), a heap
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    for u in order:
        while heap and not fits_slot(bins[heap[0][1]]):
            heapq.heappop(heap)  # full: no more units for it
        if not heap:
            return None
        load, b = heapq.heappop(heap)
        bins[b].append(u)
        heapq.heappush(heap, (load + lengths[u], b))
    return bins


def _balanced_layout(lengths, order, multiple, fits_slot):
    """(bins, width): R = multiple x k bins balanced by `_balanced`, W their fullest load
    rounded by `bucket` (5 significant bits), for the k with the fewest positions R x W."""
    longest = max(lengths)
    best = None
    for k in range(1, len(lengths) // multiple + 2):
        bins = _balanced(lengths, order, multiple * k, fits_slot)
        if bins is None:
            continue
        width = bucket(max(sum(lengths[u] for u in b) for b in bins), bits=5)
        if best is None or multiple * k * width < len(best[0]) * best[1]:
            best = (bins, width)
        if width <= bucket(longest, bits=5):  # more bins cannot narrow the rows further
            break
    return best


def lengths_from_masks(mask_ns, completion_mask_nt) -> tuple[np.ndarray, np.ndarray]:
    """(prompt lengths, completion lengths) `[N]` of a batch's masks, with a `ValueError`
    naming the field unless prompts are left-padded and completions right-padded. The
    completion tokens are those of `completion_mask_nt` (an invalid sample's, all False
    there, has none)."""
    mask_ns = np.asarray(mask_ns, bool)
    completion_mask_nt = np.asarray(completion_mask_nt, bool)
    n, s = mask_ns.shape
    t = completion_mask_nt.shape[1]
    if completion_mask_nt.shape[0] != n or not 1 <= t < s:
        raise ValueError(
            f"packing needs mask_ns [N, S] and completion_mask_nt [N, T] with T < S, got "
            f"{mask_ns.shape} and {completion_mask_nt.shape}"
        )
    p = s - t
    prompt_n = mask_ns[:, :p].sum(1)
    comp_n = completion_mask_nt.sum(1)
    cols_p, cols_t = np.arange(p)[None, :], np.arange(t)[None, :]
    if not np.array_equal(mask_ns[:, :p], cols_p >= (p - prompt_n)[:, None]):
        raise ValueError("packing needs left-padded prompts: mask_ns[:, :P] must be 0...0 1...1")
    if not np.array_equal(completion_mask_nt, cols_t < comp_n[:, None]):
        raise ValueError(
            "packing needs right-padded completions: completion_mask_nt must be 1...1 0...0"
        )
    return prompt_n, comp_n


def pack_plan(
    mask_ns,
    completion_mask_nt,
    *,
    width: int | None = None,
    group_size: int = 1,
    rows_multiple: int = 1,
    max_slots: int | None = None,
) -> Packing:
    """`pack_lengths` of a batch's masks (`lengths_from_masks`); group_size > 1 also checks
    that each group's rows share their prompt.

    Args:
      mask_ns: `[N, S]` bool real tokens (prompt left-padded, completion right-padded).
      completion_mask_nt: `[N, T]` bool real completion tokens (the last T columns).
      width, group_size, rows_multiple, max_slots: as `pack_lengths`.
    """
    prompt_n, comp_n = lengths_from_masks(mask_ns, completion_mask_nt)
    mask_ns = np.asarray(mask_ns, bool)
    n, s = mask_ns.shape
    p = s - np.asarray(completion_mask_nt).shape[1]
    g = int(group_size)
    if g > 1 and n % g == 0:
        shared = mask_ns[:, :p].reshape(n // g, g, p)
        if not (shared == shared[:, :1]).all():
            raise ValueError("packing with group_size > 1: each group's rows must share a prompt")
    return pack_lengths(
        prompt_n,
        comp_n,
        prompt_width=p,
        completion_width=s - p,
        width=width,
        group_size=g,
        rows_multiple=rows_multiple,
        max_slots=max_slots,
    )


def pack_lengths(
    prompt_lengths_n,
    completion_lengths_n,
    *,
    prompt_width: int,
    completion_width: int,
    width: int | None = None,
    group_size: int = 1,
    rows_multiple: int = 1,
    max_slots: int | None = None,
) -> Packing:
    """Pack a batch's rows into bins, longest first.

    A row without completion tokens packs nothing (it still has a slot, all masked); a
    group packs its prompt once if any of its rows has completion tokens.

    Args:
      prompt_lengths_n: `[N]` real prompt tokens of each row (left-padded to P).
      completion_lengths_n: `[N]` real completion tokens (right-padded to T).
      prompt_width, completion_width: P and T, the batch's columns (S = P + T).
      width: W, tokens per packed row, at least the longest unit: first-fit decreasing
        into rows of W, R rounded up by `bucket`. None: W chosen for this batch, the units
        balanced over R = `rows_multiple` x k rows (longest first, to the least-loaded
        row), W the fullest row's load rounded up by at most 6.25% (`bucket`, 5 bits), for
        the k that gives the fewest positions R x W.
      group_size: 1 packs whole sequences; G > 1 packs each group of G contiguous rows
        (which share their prompt) as its prompt once and its G completions.
      rows_multiple: R is a multiple of this (the step's mini- x micro-batches).
      max_slots: at most this many rows per bin (rounded down to a multiple of G); None:
        no limit. Fewer slots keep the step's `[R*J, T]` arrays small.

    Returns:
      A `Packing` of NumPy int32 arrays, a function of the lengths alone. J is rounded up to
      a power of two in units of G, so nearby batches share their shapes; the extra bins and
      slots are empty.
    """
    prompt_n = np.asarray(prompt_lengths_n, np.int64)
    comp_n = np.asarray(completion_lengths_n, np.int64)
    n = prompt_n.shape[0]
    p, t = int(prompt_width), int(completion_width)
    s = p + t
    g = int(group_size)
    if comp_n.shape != (n,) or n == 0:
        raise ValueError(
            f"prompt and completion lengths must both be [N], got {n} and {comp_n.shape}"
        )
    if g < 1 or n % g:
        raise ValueError(f"group_size G={g} must be >= 1 and divide the {n} rows")
    if np.any((prompt_n < 0) | (prompt_n > p) | (comp_n < 0) | (comp_n > t)):
        raise ValueError(f"lengths must be in [0, P={p}] (prompts) and [0, T={t}] (completions)")
    if np.any((comp_n > 0) & (prompt_n == 0)):
        raise ValueError("packing: a row with a completion needs at least one prompt token")
    units = [list(range(u * g, u * g + g)) for u in range(n // g)]
    lengths = []
    for unit_rows in units:
        completions = int(comp_n[unit_rows].sum())
        lengths.append(completions + (int(prompt_n[unit_rows[0]]) if completions else 0))
    longest = max(lengths)
    if width is not None and width < longest:
        raise ValueError(
            f"packing width must be >= the longest {'group' if g > 1 else 'sequence'} "
            f"({longest} tokens), got {width}"
        )
    slot_cap = None if max_slots is None else max(g, (int(max_slots) // g) * g)

    def fits_slot(members):
        return slot_cap is None or (len(members) + 1) * g <= slot_cap

    # Longest first, ties in input order: the plan is a function of the lengths.
    order = sorted(range(len(units)), key=lambda u: -lengths[u])
    if width is None:
        bins, width = _balanced_layout(lengths, order, int(rows_multiple), fits_slot)
        bins = [b for b in bins if b] or [[]]
        r = _round_up(len(bins), rows_multiple)
    else:
        bins = _first_fit(lengths, order, width, fits_slot)
        r = bucket(len(bins), rows_multiple)

    per_bin = max(len(b) for b in bins)
    j = g * (1 << max(per_bin - 1, 0).bit_length())
    if slot_cap is not None:
        j = min(j, max(slot_cap, g * per_bin))

    rows = np.full((r, j), n, np.int32)
    src = np.zeros((r, width), np.int32)
    seg = np.zeros((r, width), np.int32)
    parent = np.zeros((r, width), np.int32)
    pos = np.zeros((r, width), np.int32)
    first = np.zeros((r, j), np.int32)
    score = np.full((r, j, t), width + j, np.int32)
    for b, members in enumerate(bins):
        at, slot, seg_id = 0, 0, 0
        for u in members:
            unit_rows = units[u]
            rows[b, slot : slot + g] = unit_rows
            if lengths[u] == 0:  # no completion tokens: a slot, nothing packed
                slot += g
                continue
            # The prompt: from the unit's first row (the group's shared prompt).
            pl = int(prompt_n[unit_rows[0]])
            seg_id += 1
            prompt_seg = seg_id
            src[b, at : at + pl] = slot * s + np.arange(p - pl, p)
            seg[b, at : at + pl] = prompt_seg
            pos[b, at : at + pl] = np.arange(pl)
            last_prompt = at + pl - 1
            at += pl
            for k, i in enumerate(unit_rows):
                sl = slot + k
                cl = int(comp_n[i])
                if cl == 0:
                    continue
                first[b, sl] = last_prompt
                if g > 1:  # a segment of its own, reading the prompt
                    seg_id += 1
                    seg[b, at : at + cl] = seg_id
                    parent[b, at : at + cl] = prompt_seg
                else:  # the prompt's segment continues
                    seg[b, at : at + cl] = prompt_seg
                src[b, at : at + cl] = sl * s + p + np.arange(cl)
                pos[b, at : at + cl] = pl + np.arange(cl)
                score[b, sl, 0] = width + sl
                score[b, sl, 1:cl] = at + np.arange(cl - 1)
                at += cl
            slot += g
    return Packing(
        rows_rj=rows,
        src_rw=src,
        segment_rw=seg,
        position_rw=pos,
        first_rj=first,
        score_rjt=score,
        parent_rw=parent if g > 1 else None,
    )


def padded_fraction(packing: Packing) -> float:
    """The fraction of the packed rows' W*R positions that hold no token."""
    seg = np.asarray(packing.segment_rw)
    return float(np.mean(seg == 0))


__all__ = [
    "Packing",
    "bucket",
    "check_packing",
    "lengths_from_masks",
    "pack_lengths",
    "pack_plan",
    "packed_completion_hidden",
    "padded_fraction",
]
