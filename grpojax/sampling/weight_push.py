"""A policy's weights handed to another process on the same host through shared memory, in
Hugging Face's tensor names and layouts, without a checkpoint file (`rollout.engine=vllm`'s
weight push, `grpojax.sampling.vllm_engine`).

One file in `/dev/shm` (a named buffer both processes map) holds a bucket of the model's
parameters at a time, in the engine's dtype and in grpojax's own layouts (each stacked
parameter's layers `lo..hi` as one contiguous block). Every HF tensor is a strided view of
that block (`hf_tensor_plan`: a reshape and/or a transpose of a layer slice), so a push
copies each parameter into the buffer once, and the reader builds its tensors as views
(`torch.as_strided(flat, shape, strides, offset)`, in elements) that its own load copies
into place:

    buf = SharedWeights(path, model, dtype="float32", bucket_bytes=2**30)
    for k in range(len(buf.buckets)):
        tensors = buf.fill(model, k)   # [[name, shape, strides, offset], ...] in save order
        ... the reader loads `tensors` from `path` before bucket k + 1 overwrites them ...

Buckets split the model between decoder layers (a layer's tensors are never split), each
at most `bucket_bytes` unless one unit alone is larger; the embedding, the final norm and an
untied head are one unit and come last (vLLM pads the vocabulary, so it loads those layers
only when the whole push has arrived). The file is the largest bucket's size; one bucket
holds the whole model when it fits. Active LoRA adapters are merged (W + (alpha/r) A
B in float32, then the engine's dtype), as `save_pretrained` writes them.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from grpojax.models import lora
from grpojax.models.hf_io import hf_tensor_plan, merged_lora_target

__all__ = ["SharedWeights"]


@dataclasses.dataclass(frozen=True)
class _Block:
    """One parameter's slice `[lo:hi]` (layers; the whole array for a global) at `offset`
    bytes of the buffer."""

    param: str
    lo: int | None
    hi: int | None
    shape: tuple[int, ...]
    offset: int


@dataclasses.dataclass(frozen=True)
class _Bucket:
    blocks: tuple[_Block, ...]
    names: tuple[str, ...]  # the HF tensors it holds, in save order
    nbytes: int


class SharedWeights:
    """A model's weights in buckets of one shared-memory file (module docstring).

    Args:
      path: the file (created, or resized; `/dev/shm/...` on Linux).
      model: a `Decoder` of the shapes to push (its config and parameter shapes).
      dtype: the reader's dtype, "float32" or "bfloat16".
      bucket_bytes: a bucket's size limit, > 0.
      with_lm_head: send an untied `lm_head.weight`.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        model,
        *,
        dtype: str,
        bucket_bytes: int,
        with_lm_head: bool = True,
    ):
        self.path, self.dtype = pathlib.Path(path), np.dtype(jnp.dtype(dtype))
        self.plan_config = model.config
        self.plan = hf_tensor_plan(model.config, with_lm_head=with_lm_head)
        shapes = {k: tuple(v.shape) for k, v in model.named_params().items()}
        self.buckets = self._split(shapes, int(bucket_bytes))
        self.nbytes = max(b.nbytes for b in self.buckets)
        with open(self.path, "a+b") as f:
            f.truncate(self.nbytes)
            self._map = mmap.mmap(f.fileno(), self.nbytes)
        self.buffer = np.frombuffer(self._map, np.uint8)
        self._tensors = [self._views(b) for b in self.buckets]

    def _split(self, param_shapes: dict, limit: int) -> list[_Bucket]:
        """Units (a decoder layer, or one global tensor) packed in order into buckets."""
        shapes = {t.name: t.hf_shape for t in self.plan}
        item = self.dtype.itemsize
        units: list[tuple[int | None, list[str]]] = []  # (layer or None, HF names)
        for t in self.plan:
            layer = t.index[0] if t.index else None
            if layer is not None and units and units[-1][0] == layer:
                units[-1][1].append(t.name)
            else:
                units.append((layer, [t.name]))
        # The global tensors (embedding, final norm, untied head) last and together: vLLM
        # pads the vocabulary, so its embedding and head layers count as loaded only when
        # the whole push ends, and their tensors must not be overwritten before.
        glob = [n for layer, ns in units if layer is None for n in ns]
        units = [u for u in units if u[0] is not None] + [(None, glob)]

        def size(unit):
            return sum(int(np.prod(shapes[n])) * item for n in unit[1])

        groups: list[list[tuple[int | None, list[str]]]] = [[]]
        for unit in units:
            total = sum(size(u) for u in groups[-1])
            if groups[-1] and total + size(unit) > limit:
                groups.append([])
            groups[-1].append(unit)
        by_name = {t.name: t for t in self.plan}
        buckets = []
        for group in groups:
            names = [n for _, ns in group for n in ns]
            params = dict.fromkeys(by_name[n].param for n in names)  # save order
            layers = [layer for layer, _ in group if layer is not None]
            blocks, offset = [], 0
            for p in params:
                shape = param_shapes[p]
                lo = hi = None
                if p.startswith("layers."):
                    lo, hi = min(layers), max(layers) + 1
                    shape = (hi - lo, *shape[1:])
                blocks.append(_Block(p, lo, hi, shape, offset))
                offset += int(np.prod(shape)) * item
            buckets.append(_Bucket(tuple(blocks), tuple(names), offset))
        return buckets

    def _block_view(self, block: _Block) -> np.ndarray:
        n = int(np.prod(block.shape)) * self.dtype.itemsize
        raw = self.buffer[block.offset : block.offset + n]
        return raw.view(self.dtype).reshape(block.shape)

    def _views(self, bucket: _Bucket) -> list[list]:
        """[name, shape, strides, offset] (elements) of every HF tensor of `bucket`."""
        blocks = {b.param: b for b in bucket.blocks}
        plan = {t.name: t for t in self.plan}
        base = self.buffer.ctypes.data
        out = []
        for name in bucket.names:
            t = plan[name]
            block = blocks[t.param]
            index = t.index if block.lo is None else (t.index[0] - block.lo, *t.index[1:])
            view = t.to_hf(self._block_view(block)[index])
            if not np.shares_memory(view, self.buffer) or view.shape != t.hf_shape:
                raise AssertionError(f"{name}: its HF layout is not a view of {t.param}")
            item = self.dtype.itemsize
            offset = (view.__array_interface__["data"][0] - base) // item
            strides = [s // item for s in view.strides]
            out.append([name, list(view.shape), strides, int(offset)])
        return out

    def fill(self, model, k: int) -> list[list]:
        """Copy bucket `k` of `model`'s weights (LoRA merged) into the buffer; returns its
        tensors as [name, shape, strides, offset] in elements of the dtype, save order."""
        params = model.named_params()
        for block in self.buckets[k].blocks:
            value = params[block.param][...]
            part = block.lo is not None and (block.lo, block.hi) != (0, value.shape[0])
            on_host = all(d.platform == "cpu" for d in value.devices())
            if part and not on_host:  # only the bucket's layers leave the device
                value = value[block.lo : block.hi]
            host = np.asarray(jax.device_get(value))
            if part and on_host:  # a view of the host array, no copy
                host = host[block.lo : block.hi]
            target = merged_lora_target(model, block.param)
            if target is not None:
                delta = lora.delta_numpy(model, target)
                if block.lo is not None:
                    delta = delta[block.lo : block.hi]
                host = host.astype(np.float32) + delta
            np.copyto(self._block_view(block), host, casting="unsafe")
        return self._tensors[k]

    def close(self) -> None:
        """Unmap the buffer and remove its file."""
        self.buffer = np.empty(0, np.uint8)
        try:
            self._map.close()
        except BufferError:  # a caller's view still holds it: unmapped when that goes
            pass
        self.path.unlink(missing_ok=True)
