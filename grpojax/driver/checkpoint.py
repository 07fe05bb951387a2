"""Orbax checkpoints of a run: the train-state pytree plus the driver's small JSON state.

One checkpoint step holds three Orbax items:

  state   the train state (params, optimizer state, step, RNG keys, KL controller, ...):
          any pytree of jax arrays, written by `StandardSave` (sharded, OCDBT).
  driver  JSON: data position, dynamic-sampling buffer, config snapshot, ... (the
          caller's dict; must be JSON-serialisable).
  meta    JSON written by this module: typed PRNG key implementations, the leaves' paths,
          dtypes and shapes, and a per-leaf fingerprint of the saved arrays.

Saving is asynchronous (the device-to-host copy happens before `save` returns, so the
caller may donate the state to the next step) and atomic (Orbax writes a temporary
directory and renames it when complete). Restoring walks the steps from the newest down:
a step that fails to read, or whose arrays do not match the fingerprints taken at save
time, is reported with a warning naming it, moved aside as `<step>.corrupt`, and the
previous step is used. A readable step whose leaves (paths, dtypes, shapes) are not those
of the state asked for is not corrupt: the state was built from another config (e.g. a
`--resume` override that adds or drops the reference, or another model); that is an
error naming the differences (`CheckpointMismatchError`), and nothing is moved. Arrays
restore onto whatever shardings the caller asks for, so a checkpoint written on one mesh
restores onto another mesh shape.

Typed PRNG keys (`jax.random.key`) are stored as their raw `key_data` and re-wrapped with
the recorded implementation on restore, so restored keys are bit-equal and typed again.

A failed read leaves Orbax's other reads of that step in flight on an event loop it has
already closed; when they finish they print "Event loop is closed" / "Task exception was
never retrieved" tracebacks. From the first restore on, a filter drops exactly those
(`_silence_orphaned_reads`; installed before the read, since the orphans may finish before
the failure reaches us); Orbax's own log lines about a step that fails to restore are
folded into the warning (or error) naming it (`_held_orbax_logs`), so a clean fallback
prints only that warning.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import json
import logging
import os
import pathlib
import re
import shutil
import sys
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax import Array
from jax.experimental import multihost_utils

from grpojax.errors import UserError
from grpojax.ops.checks import check_int

_FORMAT = 1
_TMP_RE = re.compile(r"^(\d+)\.orbax-checkpoint-tmp")


class CorruptCheckpointError(RuntimeError):
    """A checkpoint step whose contents do not match what was saved."""


class NoReadableCheckpointError(UserError, RuntimeError):
    """Checkpoints exist but none can be read (each one is corrupt or unreadable)."""


class CheckpointMismatchError(UserError, RuntimeError):
    """A readable checkpoint of another train state than the one asked for (other leaves,
    dtypes or shapes): built from another config, not corrupt."""


# Storage errors (TensorStore) read "<ABSL STATUS>: ...", e.g. "NOT_FOUND: Error opening ...".
_STORAGE_ERROR = re.compile(r"^[A-Z][A-Z_]+: ")
_ORPHAN_MESSAGES = (
    "Task exception was never retrieved",
    "Future exception was never retrieved",
    "Task was destroyed but it is pending",
)


# A failed restore can also leave Orbax's metadata coroutines created but never awaited;
# Python reports them at exit ("sys:1: RuntimeWarning: coroutine ... was never awaited").
# Filtered from import on, not from the first restore: a caller's `warnings.catch_warnings`
# around that restore would drop a filter added inside it before the exit-time report.
_ORBAX_COROUTINES = (r"Store\._get_array_metadatas",)
_UNAWAITED = {
    "message": f"coroutine '({'|'.join(_ORBAX_COROUTINES)})' was never awaited",
    "category": RuntimeWarning,
}
warnings.filterwarnings("ignore", **_UNAWAITED)


def _collect_unawaited_coroutines() -> None:
    """Collect, now and under the filter above, the garbage a failed restore left.

    The unawaited coroutines sit in reference cycles, so they are reported whenever the
    cyclic collector next runs, in whatever thread: inside a caller's
    `warnings.catch_warnings()` with `simplefilter("always")` that report would be shown."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", **_UNAWAITED)
        gc.collect()


def _from_orbax(obj) -> bool:
    code = getattr(obj, "cr_code", None)  # a coroutine's
    return code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename


class _OrphanedReadLogFilter(logging.Filter):
    """Drops asyncio's reports of Orbax reads orphaned by a failed restore."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        if not msg.startswith(_ORPHAN_MESSAGES):
            return True
        exc = record.exc_info[1] if record.exc_info else None
        storage = isinstance(exc, ValueError) and bool(_STORAGE_ERROR.match(str(exc)))
        return not (storage or f"{os.sep}orbax{os.sep}" in msg)


_silenced: list[bool] = []


@contextlib.contextmanager
def _held_orbax_logs():
    """Hold back Orbax's log records (the "absl" logger) while restoring one step; the caller
    replays them (`logging.getLogger("absl").handle`) if the step restored."""
    held: list[logging.LogRecord] = []

    class Hold(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            held.append(record)
            return False

    logger, hold = logging.getLogger("absl"), Hold()
    logger.addFilter(hold)
    try:
        yield held
    finally:
        logger.removeFilter(hold)


def _silence_orphaned_reads() -> None:
    """From now on (once per process), drop the tracebacks that Orbax reads orphaned by a
    failed restore print when they finish after Orbax closed their event loop: the
    unraisable "RuntimeError: Event loop is closed" from TensorStore's completion callback
    (or from an Orbax coroutine), asyncio's "... exception was never retrieved" log
    records carrying a storage error. Anything else passes through unchanged."""
    if _silenced:
        return
    _silenced.append(True)
    previous = sys.unraisablehook

    def hook(unraisable) -> None:
        exc, obj = unraisable.exc_value, unraisable.object
        closed_loop = isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"
        if (closed_loop and (obj is None or inspect.iscoroutine(obj))) or _from_orbax(obj):
            return
        previous(unraisable)

    sys.unraisablehook = hook
    logging.getLogger("asyncio").addFilter(_OrphanedReadLogFilter())


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


def _leaf_types(tree) -> list[str]:
    """Each leaf's dtype and shape, e.g. "float32[4,6]" (keys as their raw key data)."""
    return [f"{jnp.dtype(x.dtype).name}{list(jnp.shape(x))}" for x in jax.tree.leaves(tree)]


def _few(items: list[str]) -> str:
    """The first 3 of `items` and how many more (for one-line errors)."""
    if not items:
        return "none"
    return "; ".join(items[:3]) + (f" and {len(items) - 3} more" if len(items) > 3 else "")


def _mismatch(meta: dict, target) -> str | None:
    """What differs between the leaves a checkpoint's `meta` records and `target`'s, or
    None. Checkpoints saved before dtypes and shapes were recorded compare paths only."""
    saved, here = meta.get("leaf_paths"), _leaf_paths(target)
    if not isinstance(saved, list):
        return None  # no record to compare: the restore itself decides
    saved_set, here_set = set(saved), set(here)
    saved_only = [p for p in saved if p not in here_set]
    here_only = [p for p in here if p not in saved_set]
    if saved_only or here_only:
        return (
            f"leaves only in the checkpoint: {_few(saved_only)}; only in this run: "
            f"{_few(here_only)}"
        )
    types = meta.get("leaf_types")
    if isinstance(types, list) and len(types) == len(saved):
        saved_types = dict(zip(saved, types))
        differ = [
            f"{p} {saved_types[p]} saved, {t} here"
            for p, t in zip(here, _leaf_types(target))
            if saved_types[p] != t
        ]
        if differ:
            return f"leaves of another dtype or shape: {_few(differ)}"
    return None


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

        fp(x) = (sum_i bits_i * (2654435761 i + 1)) xor size      (mod 2^32)

    with i the row-major flat index of each element (of each 32-bit word for 8-byte
    types). Weighting each element by an odd multiple of its index makes swapped, zeroed
    or altered elements change the sum; it is a corruption check, not a cryptographic hash.

    The flat index is built from one iota per axis instead of flattening `x`: flattening a
    sharded array gathers it whole onto every device, while this sum stays sharded
    (elementwise work on the local shard, then one scalar all-reduce).
    """
    bits = _as_uint32(x)
    if bits.ndim == 0:
        bits = bits.reshape(1)
    idx = jnp.zeros(bits.shape, jnp.uint32)
    for axis, size in enumerate(bits.shape):
        idx = idx * jnp.uint32(size) + jax.lax.broadcasted_iota(jnp.uint32, bits.shape, axis)
    weights = idx * jnp.uint32(2654435761) + jnp.uint32(1)
    return jnp.sum(bits * weights, dtype=jnp.uint32) ^ jnp.uint32(bits.size)


# All the leaves placed on the same devices are fingerprinted by ONE compiled program
# (compiled once per tree structure, shapes and shardings), not one program per leaf. On a
# sharded mesh every leaf's sum ends in a collective, and XLA:CPU admits 32 programs in
# flight per device: with a few dozen independent collective programs queued and none
# awaited, one device's launch of a program waits for a free slot while the other devices
# already wait in that program's collective, and the rendezvous aborts the process after
# 40 s. One program per leaf (64 for the GRPO train state) did that at the first
# checkpoint of `grpojax train` on fsdp and tensor meshes of fake CPU devices
# (`tests/test_driver_loop.py::test_train_on_model_parallel_meshes`).
_fingerprints_jit = jax.jit(lambda leaves: tuple(_fingerprint_leaf(x) for x in leaves))


def _placement(x: Array) -> tuple[int, ...]:
    """The ids of the devices `x` lives on, in its mesh's order: the leaves given to one
    compiled program must agree on the devices and on their order."""
    mesh = getattr(x.sharding, "mesh", None)
    if mesh is not None:
        return tuple(d.id for d in mesh.devices.flat)
    return tuple(sorted(d.id for d in x.sharding.device_set))


def fingerprints(tree) -> list[int]:
    """Per-leaf uint32 fingerprints (as Python ints) of a pytree of arrays, keys unwrapped.

    One program per set of devices the leaves live on (usually one: the mesh), each
    finished before the next is dispatched.
    """
    leaves = [jax.random.key_data(x) if _is_key(x) else x for x in jax.tree.leaves(tree)]
    leaves = [x if isinstance(x, jax.Array) else jnp.asarray(x) for x in leaves]
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, x in enumerate(leaves):
        groups.setdefault(_placement(x), []).append(i)
    out = [0] * len(leaves)
    for members in groups.values():
        values = _fingerprints_jit([leaves[i] for i in members])
        for i, v in zip(members, values, strict=True):
            # Scalars are replicated; reading the local copy also works across processes.
            out[i] = int(np.asarray(v.addressable_data(0)))
    return out


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
        check_int("every", every)
        check_int("keep", keep, none_ok=True)
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
            "leaf_types": _leaf_types(raw_state),
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
        """Restore checkpoint `step` (raises if it is unreadable or corrupt, and
        `CheckpointMismatchError` if it holds another state than `abstract_state`).

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
        _silence_orphaned_reads()
        # The small JSON record first: a state of other leaves is another config's, which
        # the state's read would report as a failure like any corruption.
        meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        meta = meta.meta
        if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
            raise CorruptCheckpointError(f"step {step}: missing or unknown 'meta' item")
        differs = _mismatch(meta, target)
        if differs:
            raise CheckpointMismatchError(
                f"checkpoint step {step} in {self.directory} holds another train state than "
                f"this config builds ({differs}): resume with the config it was saved with "
                f"(the run's config.yaml, without overrides that change the model, the "
                f"algorithm or whether there is a reference), or start a new run"
            )
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target), driver=ocp.args.JsonRestore()
            ),
        )
        raw = restored.state
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

        A step that cannot be read or fails its fingerprint check is renamed to
        `<step>.corrupt` (so a later save of the same step number does not collide with it)
        and the previous step is tried; once one restores, each step passed over is
        reported with `warnings.warn` naming it. A readable step of another state (other
        leaves, dtypes or shapes) raises `CheckpointMismatchError` and moves nothing.
        Unfinalised temporary directories (a save interrupted by a crash) are reported
        and removed. Raises `NoReadableCheckpointError` (a `grpojax.errors.UserError` and a
        `RuntimeError`) when checkpoints exist but none is readable.

        Arguments as in `restore`.
        """
        self._manager.wait_until_finished()  # no save of ours is in flight below
        for entry in sorted(self.directory.iterdir()) if self.directory.exists() else ():
            match = _TMP_RE.match(entry.name)
            if match:
                warnings.warn(
                    f"ignoring unfinalised checkpoint of step {match.group(1)} ({entry}): "
                    "a save that did not complete; removed",
                    stacklevel=2,
                )
                if jax.process_index() == 0:
                    shutil.rmtree(entry, ignore_errors=True)
        steps = self.all_steps()
        bad: list[tuple[int, str]] = []
        for step in reversed(steps):
            with _held_orbax_logs() as held:
                try:
                    restored = self.restore(step, abstract_state, shardings=shardings)
                except CheckpointMismatchError:
                    raise  # another config's state: the caller's to fix, not corruption
                except Exception as e:  # any read failure means: fall back to the previous step
                    msg = " ".join(f"{type(e).__name__}: {e}".split())
                    msg = msg.split(" [tensorstore_spec=")[0]  # a page of JSON, not the cause
                    warned = [r.getMessage() for r in held if r.levelno >= logging.WARNING]
                    if warned:
                        msg += f" [{warned[0]}]"
                    bad.append((step, msg[:500] + " ..." if len(msg) > 500 else msg))
                    restored = None
            if restored is None:
                _collect_unawaited_coroutines()
                self._quarantine(step)
                continue
            for record in held:
                logging.getLogger("absl").handle(record)
            for step_bad, msg in bad:
                warnings.warn(
                    f"checkpoint step {step_bad} in {self.directory} is corrupt or unreadable; "
                    f"falling back to the previous checkpoint. ({msg})",
                    stacklevel=2,
                )
            return restored
        if bad:
            raise NoReadableCheckpointError(
                f"no readable checkpoint in {self.directory}: steps {[s for s, _ in bad]} are "
                f"all corrupt (moved aside as <step>.corrupt); step {bad[0][0]}: {bad[0][1]}"
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


def saved_steps(directory: str | os.PathLike) -> list[int]:
    """The finalised checkpoint steps in `directory`, ascending ([] when it does not exist).
    Creates and changes nothing."""
    directory = pathlib.Path(directory).absolute()
    return sorted(ocp.utils.checkpoint_steps(directory)) if directory.is_dir() else []


def host_copy(tree):
    """NumPy copy of a pytree of arrays (typed keys as key data), e.g. to compare states."""
    return jax.tree.map(
        lambda x: np.asarray(jax.device_get(jax.random.key_data(x) if _is_key(x) else x)), tree
    )


__all__ = [
    "Checkpointer",
    "CorruptCheckpointError",
    "NoReadableCheckpointError",
    "Restored",
    "fingerprints",
    "host_copy",
    "saved_steps",
]
