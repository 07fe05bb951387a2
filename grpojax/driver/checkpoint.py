"""Orbax checkpoints of a run: the train-state pytree plus the driver's small JSON state.

One checkpoint step holds three Orbax items:

  state   the train state (params, optimizer state, step, RNG keys, KL controller, ...):
          any pytree of jax arrays, written by `StandardSave` (sharded, OCDBT).
  driver  JSON: data position, dynamic-sampling buffer, config snapshot, ... (the
          caller's dict; must be JSON-serialisable).
  meta    JSON written by this module: typed PRNG key implementations and a per-leaf
          fingerprint of the saved arrays.

Saving is asynchronous (the device-to-host copy happens before `save` returns, so the
caller may donate the state to the next step) and atomic (Orbax writes a temporary
directory and renames it when complete). Restoring walks the steps from the newest down:
a step that fails to read, or whose arrays do not match the fingerprints taken at save
time, is reported with a warning naming it, moved aside as `<step>.corrupt`, and the
previous step is used. Arrays restore onto whatever shardings the caller asks for, so a
checkpoint written on one mesh restores onto another mesh shape.

Typed PRNG keys (`jax.random.key`) are stored as their raw `key_data` and re-wrapped with
the recorded implementation on restore, so restored keys are bit-equal and typed again.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax import Array
from jax.experimental import multihost_utils

_FORMAT = 1
_TMP_RE = re.compile(r"^(\d+)\.orbax-checkpoint-tmp")


class CorruptCheckpointError(RuntimeError):
    """A checkpoint step whose contents do not match what was saved."""


class Restored(NamedTuple):
    """What `Checkpointer.restore` returns.

    step: the checkpoint's step number.
    state: the train-state pytree, placed on the requested shardings.
    driver_state: the JSON driver state dict saved with it.
    """

    step: int
    state: Any
    driver_state: dict


def _is_key(x) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _leaf_paths(tree) -> list[str]:
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)]


def _as_uint32(x: Array) -> Array:
    """The bits of `x` as uint32 (one element per element; 8-byte types get a last axis)."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    size = jnp.dtype(x.dtype).itemsize
    if size == 4:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    if size == 8:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)  # adds a trailing axis of 2
    unsigned = {1: jnp.uint8, 2: jnp.uint16}[size]
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _fingerprint_leaf(x: Array) -> Array:
    """`[]` uint32 position-weighted sum of the bits of `x` (wrapping arithmetic).

    Weighting each element by an odd multiple of its flat index makes swapped, zeroed or
    altered elements change the sum; it is a corruption check, not a cryptographic hash.
    """
    bits = _as_uint32(x).reshape(-1)
    idx = jax.lax.iota(jnp.uint32, bits.shape[0])
    weights = idx * jnp.uint32(2654435761) + jnp.uint32(1)
    return jnp.sum(bits * weights, dtype=jnp.uint32) ^ jnp.uint32(bits.shape[0])


# One small jitted reduction per leaf, run where the leaf lives (sharded or not, leaves may
# sit on different devices); compiled once per (shape, dtype, sharding).
_fingerprint_jit = jax.jit(_fingerprint_leaf)


def fingerprints(tree) -> list[int]:
    """Per-leaf uint32 fingerprints (as Python ints) of a pytree of arrays, keys unwrapped."""
    leaves = [jax.random.key_data(x) if _is_key(x) else x for x in jax.tree.leaves(tree)]
    outs = [_fingerprint_jit(jnp.asarray(x)) for x in leaves]
    # The result is replicated; reading the local copy also works across processes.
    return [int(np.asarray(v.addressable_data(0))) for v in outs]


def _unwrap_keys(tree) -> tuple[Any, dict[str, str]]:
    """(tree with typed keys replaced by their uint32 key data, {leaf path: impl name})."""
    impls: dict[str, str] = {}

    def unwrap(path, x):
        if _is_key(x):
            impls[jax.tree_util.keystr(path)] = str(jax.random.key_impl(x))
            return jax.random.key_data(x)
        return x

    return jax.tree_util.tree_map_with_path(unwrap, tree), impls


def _default_sharding(x):
    sharding = getattr(x, "sharding", None)
    if sharding is not None:
        return sharding
    return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])


def _abstract_target(abstract_state, shardings):
    """ShapeDtypeStructs (typed keys as key data) carrying the target shardings."""

    def leaf(x, sharding):
        sharding = _default_sharding(x) if sharding is None else sharding
        if _is_key(x):
            data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype))
            return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding)
        return jax.ShapeDtypeStruct(jnp.shape(x), x.dtype, sharding=sharding)

    if shardings is None:
        return jax.tree.map(lambda x: leaf(x, None), abstract_state)
    return jax.tree.map(leaf, abstract_state, shardings)


class Checkpointer:
    """Periodic, asynchronous, atomic checkpoints of (train state, driver state).

    Example:
      >>> ckpt = Checkpointer(run_dir / "checkpoints", every=50, keep=3)   # doctest: +SKIP
      >>> restored = ckpt.restore_latest(state, shardings=state_shardings)
      >>> for step in ...:
      ...     ckpt.save(step, state, {"data": loader.position()})   # only every 50 steps
      >>> ckpt.save(last_step, state, driver_state, force=True)      # at exit
      >>> ckpt.close()                                               # waits for the write

    Args:
      directory: where step directories `<step>/` are written (created if missing).
      every: save only steps that are multiples of `every` (>= 1) unless forced.
      keep: keep the newest `keep` (>= 1) checkpoints; None keeps all.
      async_save: write in a background thread (Orbax async checkpointing).
      verify: record per-leaf fingerprints at save time and check them on restore.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        every: int = 1,
        keep: int | None = 3,
        async_save: bool = True,
        verify: bool = True,
    ):
        if not (isinstance(every, int) and not isinstance(every, bool) and every >= 1):
            raise ValueError(f"every must be an int >= 1, got {every!r}")
        if keep is not None and not (isinstance(keep, int) and keep >= 1):
            raise ValueError(f"keep must be None or an int >= 1, got {keep!r}")
        self.directory = pathlib.Path(directory).absolute()
        self.every = every
        self.keep = keep
        self.verify = verify
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            save_interval_steps=every,
            enable_async_checkpointing=async_save,
            create=True,
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    # -- saving ------------------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        """Whether `save(step, ...)` without `force` would write."""
        return self._manager.should_save(step)

    def save(self, step: int, state, driver_state: dict | None = None, *, force: bool = False):
        """Save `state` and `driver_state` as checkpoint `step` if due (or `force`).

        Returns True when a save was started. With async saving the files are complete
        only after `wait()` / `close()`; a crash before that leaves no half checkpoint
        (the temporary directory is never finalised and is ignored on restore).

        Args:
          step: the step number (int >= 0); steps must increase between saves.
          state: pytree of jax arrays (typed PRNG keys allowed).
          driver_state: JSON-serialisable dict (default {}).
          force: save even if `step` is not a multiple of `every` (e.g. at exit).
        """
        step = int(step)
        driver_state = {} if driver_state is None else driver_state
        if not isinstance(driver_state, dict):
            raise ValueError(f"driver_state must be a dict, got {type(driver_state).__name__}")
        try:
            json.dumps(driver_state, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(
                f"driver_state must be JSON-serialisable (dicts, lists, str, finite numbers, "
                f"bool, None): {e}"
            ) from None
        if step in self._manager.all_steps():
            return False  # already saved (e.g. a forced save at exit right after a periodic one)
        if not force and not self._manager.should_save(step):
            return False
        raw_state, key_impls = _unwrap_keys(state)
        meta = {
            "format": _FORMAT,
            "key_impls": key_impls,
            "leaf_paths": _leaf_paths(raw_state),
            "fingerprints": fingerprints(raw_state) if self.verify else None,
        }
        return self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(raw_state),
                driver=ocp.args.JsonSave(driver_state),
                meta=ocp.args.JsonSave(meta),
            ),
            force=force,
        )

    def clear(self) -> None:
        """Delete every checkpoint (after waiting for in-flight saves)."""
        self._manager.wait_until_finished()
        for step in self.all_steps():
            self._manager.delete(step)

    def wait(self) -> None:
        """Block until any in-flight asynchronous save is written and finalised."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Wait for in-flight saves, then release the manager."""
        self._manager.wait_until_finished()
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- restoring ---------------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """Finalised checkpoint steps on disk, ascending."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def restore(self, step: int, abstract_state, *, shardings=None) -> Restored:
        """Restore checkpoint `step` (raises if it is unreadable or corrupt).

        Args:
          step: an existing step.
          abstract_state: pytree like the saved state: arrays or `jax.ShapeDtypeStruct`s
            (e.g. `jax.eval_shape` of the state builder); gives structure, shapes and
            dtypes (typed key dtypes included).
          shardings: pytree of `jax.sharding.Sharding` like `abstract_state`, the
            placement of the restored arrays (any mesh shape). Default: each leaf's own
            `.sharding` if it has one, else the first local device.
        """
        target = _abstract_target(abstract_state, shardings)
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target),
                driver=ocp.args.JsonRestore(),
                meta=ocp.args.JsonRestore(),
            ),
        )
        raw, meta = restored.state, restored.meta
        if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
            raise CorruptCheckpointError(f"step {step}: missing or unknown 'meta' item")
        paths = _leaf_paths(raw)
        if meta["leaf_paths"] != paths:
            raise CorruptCheckpointError(
                f"step {step}: the saved state has leaves {meta['leaf_paths']}, the restore "
                f"target has {paths}"
            )
        if meta.get("fingerprints") is not None:
            got = fingerprints(raw)
            bad = [p for p, a, b in zip(paths, got, meta["fingerprints"]) if a != b]
            if bad:
                raise CorruptCheckpointError(
                    f"step {step}: arrays differ from what was saved at {bad[:5]}"
                )
        key_impls = meta["key_impls"]

        def rewrap(path, x, want):
            name = jax.tree_util.keystr(path)
            if _is_key(want):
                if name not in key_impls:
                    raise CorruptCheckpointError(f"step {step}: {name} was not saved as a key")
                return jax.random.wrap_key_data(x, impl=key_impls[name])
            return x

        state = jax.tree_util.tree_map_with_path(rewrap, raw, abstract_state)
        return Restored(step=int(step), state=state, driver_state=restored.driver)

    def restore_latest(self, abstract_state, *, shardings=None) -> Restored | None:
        """Restore the newest readable checkpoint, or None when there is none.

        A step that cannot be read or fails its fingerprint check is reported with
        `warnings.warn` naming the step, renamed to `<step>.corrupt` (so a later save of
        the same step number does not collide with it) and the previous step is tried.
        Unfinalised temporary directories (a save interrupted by a crash) are reported
        and ignored. Raises `RuntimeError` when checkpoints exist but none is readable.

        Arguments as in `restore`.
        """
        for entry in sorted(self.directory.iterdir()) if self.directory.exists() else ():
            match = _TMP_RE.match(entry.name)
            if match:
                warnings.warn(
                    f"ignoring unfinalised checkpoint of step {match.group(1)} ({entry}): "
                    "a save that did not complete",
                    stacklevel=2,
                )
        steps = self.all_steps()
        bad: list[int] = []
        for step in reversed(steps):
            try:
                return self.restore(step, abstract_state, shardings=shardings)
            except Exception as e:  # any read failure means: fall back to the previous step
                msg = f"{type(e).__name__}: {e}"
                if len(msg) > 500:
                    msg = msg[:500] + " ..."
                warnings.warn(
                    f"checkpoint step {step} in {self.directory} is corrupt or unreadable; "
                    f"falling back to the previous checkpoint. ({msg})",
                    stacklevel=2,
                )
                bad.append(step)
                self._quarantine(step)
        if bad:
            raise RuntimeError(
                f"no readable checkpoint in {self.directory}: steps {bad} are all corrupt"
            )
        return None

    def _quarantine(self, step: int) -> None:
        if jax.process_index() == 0:
            src = self.directory / str(step)
            dst = self.directory / f"{step}.corrupt"
            n = 1
            while dst.exists():
                dst = self.directory / f"{step}.corrupt{n}"
                n += 1
            if src.exists():
                src.rename(dst)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"grpojax_checkpoint_quarantine_{step}")
        self._manager.reload()


def host_copy(tree):
    """NumPy copy of a pytree of arrays (typed keys as key data), e.g. to compare states."""
    return jax.tree.map(
        lambda x: np.asarray(jax.device_get(jax.random.key_data(x) if _is_key(x) else x)), tree
    )


__all__ = [
    "Checkpointer",
    "CorruptCheckpointError",
    "Restored",
    "fingerprints",
    "host_copy",
]
