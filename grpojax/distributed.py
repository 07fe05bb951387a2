"""Processes: many hosts, one driver process per host under `jax.distributed`, one global mesh.

Every process runs the same program on the same config. Host-side decisions (which
prompts, which groups, when to stop) are made identically on every process from data every
process holds; arrays that carry the batch (rollouts, logprobs, the training batch) are
global `jax.Array`s whose rows live on the devices of the mesh, so each process holds, and
turns into text and rewards, only its own rows. What crosses processes on the host is small
per-row data (rewards, lengths, validity: a few numbers a completion) and stop flags,
gathered over one device of each process, its first (`host_allgather`): never over the
devices that split placement lends to the sampler (each process's last ones), whose decode
runs on another thread, so the two threads never share a device's collectives.

    initialize()            join the run when launched as several processes (on CPU: no
                            persistent compilation cache, see `initialize`)
    size_cpu_thread_pool()  room in XLA:CPU's thread pool for many fake devices' collectives
    owned_rows(x)           the rows of a global array this process answers for
    rows_to_host(x, rows)   NumPy copy of those rows (from this process's devices)
    gather_rows(arrays, rows, n)   every process's rows -> full [N, ...] arrays on every host
    host_allgather(tree)    every process's host arrays, stacked (over each one's first device)
    on_primary(compute)     process 0's `compute()`, sent to every process (an environment's step)
    process_devices(mesh)   one device of each process in a mesh (where a host collective runs)
    host_values(tree)       NumPy copies of replicated results (a step's metrics)
    any_process(flag)       True on every process when it is True on one (stop requests)
    is_primary()            process 0: the one that writes logs, plots and summaries

Launch (2 processes on one machine, 2 CPU devices each; on GPUs drop XLA_FLAGS):

    JAX_COORDINATOR_ADDRESS=localhost:12345 JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=0 \\
        grpojax train log.run_dir=runs/two-hosts ... &
    JAX_COORDINATOR_ADDRESS=localhost:12345 JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=1 \\
        grpojax train log.run_dir=runs/two-hosts ...

On SLURM, Open MPI or a TPU pod, JAX detects the cluster itself: set
`GRPOJAX_DISTRIBUTED=auto` (one task per host). A process that dies stops the others: the
coordination service misses its heartbeats for `GRPOJAX_HEARTBEAT_S` seconds (default 30)
and ends every process with an error naming the lost task.

Test hook: the driver and the rollouts call `kill_point(event, n)` at a few named moments,
and a test sets `GRPOJAX_TEST_KILL_AT=<event>[:<n>][:SIGTERM]` to have the process signal
itself there, deterministically instead of racing a timer. Events: `sft_step` (SFT step n
done, before its checkpoint), `sft_save` (SFT checkpoint n being written), `rl_save` (RL
checkpoint n being written; n = 0 is the warm start), `rl_ckpt0` (RL checkpoint 0 complete,
the SFT checkpoints not yet removed), `rl_step` (RL step n done and logged, before its
checkpoint), `weight_transfer` (split placement: the weights of version n about to be copied
to the sampler's devices), `final_eval` (the final evaluation starting). Without `:<n>` the
first occurrence fires. The signal is SIGKILL to the process group when the process leads
its group (else to itself only), or SIGTERM to the process with `:SIGTERM`. Unset (always,
outside tests), a call is one dictionary lookup.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from grpojax.errors import UserError

log = logging.getLogger(__name__)

__all__ = [
    "KILL_AT_ENV",
    "KILL_EVENTS",
    "any_process",
    "gather_rows",
    "host_allgather",
    "host_values",
    "initialize",
    "is_primary",
    "kill_point",
    "owned_rows",
    "rows_to_host",
    "size_cpu_thread_pool",
]

_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count="
# Threads per fake CPU device: how many of a device's collectives may block at once.
THREADS_PER_CPU_DEVICE = 4


def size_cpu_thread_pool(environ=None) -> int | None:
    """Give XLA:CPU's thread pool room for every fake device's blocking collectives.

    With `XLA_FLAGS=--xla_force_host_platform_device_count=N`, the N CPU devices of a process
    share one pool of max(cores, N) threads, and an in-process collective holds its thread
    until every participant arrives. A device may run a loop's collectives and one outside
    that loop at once, so all N threads can end up waiting at rendezvous whose missing
    participants are queued for a thread: a deadlock that XLA ends after 40 s with an abort
    (seen on 2 cores in an 8-device FSDP x tensor-parallel GRPO step).
    This sets `PJRT_NPROC`, the pool size XLA reads, to max(cores, 4 N) in `environ` (default
    `os.environ`) unless it is set; it has effect only before JAX creates its CPU backend
    (the first computation or `jax.devices()`). Returns the size set, or None.
    """
    environ = os.environ if environ is None else environ
    counts = [f for f in environ.get("XLA_FLAGS", "").split() if f.startswith(_DEVICE_COUNT_FLAG)]
    if not counts or environ.get("PJRT_NPROC"):
        return None
    n = counts[-1][len(_DEVICE_COUNT_FLAG) :]
    n = int(n) if n.isdigit() else 0
    if n <= 1:
        return None
    size = max(os.cpu_count() or 1, THREADS_PER_CPU_DEVICE * n)
    environ["PJRT_NPROC"] = str(size)
    return size


def initialize() -> bool:
    """Join a multi-process run if this process was launched as one; True if it did.

    From `JAX_COORDINATOR_ADDRESS` / `JAX_NUM_PROCESSES` / `JAX_PROCESS_ID`, or, with
    `GRPOJAX_DISTRIBUTED=auto`, JAX's own cluster detection (SLURM, Open MPI, TPU pods, ...).
    On CPU the collectives go through gloo, and JAX's persistent compilation cache is turned
    off (`_no_cache_across_cpu_processes`). Must run before any JAX computation.
    """
    given = [k for k in _ENV if os.environ.get(k)]
    auto = os.environ.get("GRPOJAX_DISTRIBUTED", "").lower() == "auto"
    if not given and not auto:
        return False
    if given and len(given) != len(_ENV):
        missing = [k for k in _ENV if k not in given]
        raise UserError(f"a multi-process launch sets all of {_ENV}; missing {missing}")
    if jax.distributed.is_initialized():
        return True
    if os.environ.get("JAX_PLATFORMS", "").startswith("cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    heartbeat = int(os.environ.get("GRPOJAX_HEARTBEAT_S", "30"))
    if given:
        jax.distributed.initialize(
            coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
            num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
            process_id=int(os.environ["JAX_PROCESS_ID"]),
            heartbeat_timeout_seconds=heartbeat,
        )
    else:
        jax.distributed.initialize(heartbeat_timeout_seconds=heartbeat)
    _no_cache_across_cpu_processes()
    log.info(
        "grpojax: process %d of %d, %d local devices",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
    )
    return True


def _no_cache_across_cpu_processes() -> None:
    """Turn JAX's persistent compilation cache off for a multi-process CPU run.

    On CPU the cache key differs between processes and only process 0 writes, so on a warm
    cache process 0 loads a program that the others compile. A loaded executable and a freshly
    compiled one of the same program (byte-identical optimized HLO) need not agree over gloo:
    a 2-process GRPO step (data 2 x fsdp 2, 2 epochs x 2 mini-batches x 2 micro-batches) hung
    in its collectives whenever one process loaded it and the other compiled it, and ran
    when both compiled or both loaded (XLA in jaxlib 0.10.2). Nothing guarantees that every
    process finds the same entries, so no process reads or writes the cache. Multi-process
    runs on accelerators keep it.
    """
    if jax.process_count() == 1 or jax.devices()[0].platform != "cpu":
        return
    if jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir:
        log.warning(
            "grpojax: persistent compilation cache %s off for this multi-process CPU run "
            "(a program loaded on one process and compiled on another can hang in gloo)",
            jax.config.jax_compilation_cache_dir,
        )
    jax.config.update("jax_enable_compilation_cache", False)


def is_primary() -> bool:
    """Whether this is process 0 (the writer of logs, plots and summaries)."""
    return jax.process_index() == 0


def owned_rows(x: jax.Array) -> np.ndarray:
    """`[R]` sorted row indices (axis 0) of global array `x` that this process answers for.

    A row lives on the devices whose shard holds it; when several processes hold it (the
    array replicated across hosts), the lowest process id answers for it. Every row has
    exactly one owner, so per-row work (decoding, rewards) is done once.
    """
    n = x.shape[0]
    owner = np.full(n, np.iinfo(np.int64).max, np.int64)
    for device, index in x.sharding.devices_indices_map(x.shape).items():
        rows = np.arange(n)[index[0] if index else slice(None)]
        owner[rows] = np.minimum(owner[rows], device.process_index)
    return np.flatnonzero(owner == jax.process_index())


def rows_to_host(x: jax.Array, rows: np.ndarray) -> np.ndarray:
    """NumPy copy of `x[rows]` read from this process's devices (`rows` it holds)."""
    if x.is_fully_addressable:
        return np.asarray(jax.device_get(x))[rows]
    out = np.empty((len(rows), *x.shape[1:]), x.dtype)
    where = {int(r): i for i, r in enumerate(rows)}
    filled = np.zeros(len(rows), bool)
    for shard in x.addressable_shards:
        idx = shard.index[0] if shard.index else slice(None)
        shard_rows = np.arange(x.shape[0])[idx]
        data = np.asarray(shard.data)
        for j, r in enumerate(shard_rows):
            i = where.get(int(r))
            if i is not None and not filled[i]:
                out[i] = data[j]
                filled[i] = True
    if not filled.all():
        raise ValueError(
            f"rows {rows[~filled].tolist()} are not held by process {jax.process_index()}"
        )
    return out


def gather_rows(
    arrays: Mapping[str, np.ndarray], rows: np.ndarray, n: int
) -> dict[str, np.ndarray]:
    """Full `[N, ...]` arrays on every process from each process's `[R, ...]` own rows.

    Args:
      arrays: name -> `[R, ...]` values of this process's `rows` (same names, dtypes and
        trailing shapes on every process).
      rows: `[R]` the row indices (disjoint across processes, together covering 0..N-1).
      n: N, the number of rows.
    """
    out = {}
    for name, v in arrays.items():
        v = np.asarray(v)
        full = np.zeros((n, *v.shape[1:]), v.dtype)
        full[rows] = v
        out[name] = full
    if jax.process_count() == 1:
        return out
    mine = np.zeros(n, bool)
    mine[rows] = True
    # Sent as raw bytes [N, row bytes]: JAX without x64 would round float64 (an evaluation's
    # scores) to float32 and wrap int64, and the gathered rows must equal the sent ones.
    raw = {k: v.reshape(n, -1).view(np.uint8) if v.size else v for k, v in out.items()}
    stacked = host_allgather({"mine": mine, **raw})
    own = np.asarray(stacked["mine"])  # [P, N]
    if not (own.sum(0) == 1).all():
        raise ValueError("every row needs exactly one owning process")
    who = own.argmax(0)
    return {
        k: np.ascontiguousarray(np.asarray(stacked[k])[who, np.arange(n)])
        .view(v.dtype)
        .reshape(v.shape)
        if v.size
        else v
        for k, v in out.items()
    }


def host_values(tree):
    """NumPy copies of a pytree of replicated (or fully addressable) arrays, e.g. a step's
    scalar metrics: read from this process's first copy, so it works on every process."""

    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(x.addressable_data(0))
        return np.asarray(jax.device_get(x))

    return jax.tree.map(one, tree)


def any_process(flag: bool) -> bool:
    """True on every process when `flag` is True on at least one (collective)."""
    if jax.process_count() == 1:
        return bool(flag)
    flags = host_allgather(np.asarray([bool(flag)]))
    return bool(np.asarray(flags).any())


def process_devices(mesh: Mesh | None = None) -> list:
    """One device of each process, by process index: its first among `mesh`'s devices
    (every device when None: `jax.devices()` order), so a collective over them stays on
    that mesh's devices. A mesh without a device of some process is a ValueError."""
    first: dict[int, object] = {}
    for d in jax.devices() if mesh is None else mesh.devices.flat:
        first.setdefault(d.process_index, d)
    if len(first) != jax.process_count():
        raise ValueError(
            f"the mesh has devices of processes {sorted(first)}, not of all {jax.process_count()}"
        )
    return [first[p] for p in sorted(first)]


def host_allgather(tree, devices: list | None = None):
    """`[P, ...]` NumPy stacks of every process's host arrays (a pytree; same shapes and
    dtypes on every process, dtypes JAX keeps: no 64-bit ones without x64), on every
    process: a collective over `devices`, one of each process (`process_devices`; default
    each process's first). (JAX's `process_allgather` runs over every device, which would
    share the rollout devices of a split placement with their decode thread.)"""
    if jax.process_count() == 1:
        return jax.tree.map(lambda x: np.asarray(x)[None], tree)
    devices = process_devices() if devices is None else list(devices)
    sharding = NamedSharding(Mesh(np.array(devices), ("processes",)), PartitionSpec("processes"))
    mine = next(d for d in devices if d.process_index == jax.process_index())

    def stacked(x):
        x = np.asarray(x)[None]
        shard = jax.device_put(x, mine)
        return jax.make_array_from_single_device_arrays(
            (len(devices), *x.shape[1:]), sharding, [shard]
        )

    replicated = NamedSharding(sharding.mesh, PartitionSpec())
    gathered = jax.jit(_identity, out_shardings=replicated)(jax.tree.map(stacked, tree))
    return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), gathered)


def _identity(tree):  # module level: one jit cache entry per layout, not per call
    return tree


def on_primary(compute, devices: list | None = None):
    """`compute()`'s value, computed on process 0 alone and sent to every process (pickled;
    two `host_allgather`s over `devices`, one of each process: its length, then its bytes).
    One process: `compute()`. Every process must call it at the same point (a collective);
    `compute` runs nowhere else, so its side effects (an environment's step, a tool call)
    happen once. Where `compute` raises or its value does not pickle, every process raises a
    RuntimeError naming it (none is left waiting)."""
    if jax.process_count() == 1:
        return compute()
    payload = b""
    if is_primary():
        try:
            payload = pickle.dumps(("ok", compute()))
        except Exception as e:  # sent, so that the other processes stop too
            payload = pickle.dumps(("error", f"{type(e).__name__}: {e}"))
    size = int(np.asarray(host_allgather(np.asarray([len(payload)], np.int32), devices))[0, 0])
    mine = np.zeros(size, np.uint8)
    if is_primary():
        mine[:] = np.frombuffer(payload, np.uint8)
    status, value = pickle.loads(np.asarray(host_allgather(mine, devices))[0].tobytes())
    if status == "error":
        raise RuntimeError(f"process 0's computation for every process failed: {value}")
    return value


KILL_AT_ENV = "GRPOJAX_TEST_KILL_AT"
KILL_EVENTS = (
    "sft_step",
    "sft_save",
    "rl_save",
    "rl_ckpt0",
    "rl_step",
    "weight_transfer",
    "final_eval",
)
_killed: list[str] = []  # the spec that fired (once per process)


def kill_point(event: str, n: int | None = None) -> None:
    """The test hook (module docstring): signal this process if `GRPOJAX_TEST_KILL_AT` names
    this moment (once per process)."""
    spec = os.environ.get(KILL_AT_ENV)
    if not spec or _killed:
        return
    name, *rest = spec.split(":")
    sig = signal.SIGKILL
    if rest and rest[-1] in ("SIGTERM", "SIGKILL"):
        sig = getattr(signal, rest.pop())
    if name not in KILL_EVENTS or len(rest) > 1 or (rest and not rest[0].isdigit()):
        raise ValueError(
            f"{KILL_AT_ENV}={spec!r}: expected <event>[:<n>][:SIGTERM|SIGKILL] with event one "
            f"of {KILL_EVENTS}"
        )
    if name != event or (rest and n != int(rest[0])):
        return
    _killed.append(spec)
    if sig == signal.SIGKILL and os.getpgrp() == os.getpid():
        os.killpg(0, signal.SIGKILL)  # the process and its children (reward workers)
    os.kill(os.getpid(), sig)
