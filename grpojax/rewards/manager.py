"""Reward functions run in a pool of workers with a per-call timeout, then combined.

The protocol (close to TRL's): a reward function is a callable

    fn(prompts: list[str], completions: list[str], **columns) -> list[float | None]

returning one value per completion; `columns` are the dataset's other columns, one
value per sample (`answer=[...]`, `entry=[...]`). A function that declares no
`**kwargs` receives only the columns it names; a keyword-only parameter without a
default that no column provides is a `ValueError` naming the missing column.

`None` means "no opinion / not applicable": that function contributes nothing to the
sample's weighted total (as TRL's nansum does) and is left out of its own mean/std.
A sample that *no* function scored has no reward at all and is masked (invalid).

`RewardManager.compute` never raises for a misbehaving reward function and never puts
a NaN in the total: a call that times out, raises, returns a wrong-length list or a
non-number fails its samples; a NaN/inf value fails that one sample. Failed samples
get `valid_n = False` and `total_n = 0.0`, are counted per function and per failure
kind, and training goes on; the caller masks them out of the update.

Execution, per reward function (`RewardSpec.mode`):
  "process"  (default) a pool of worker processes started with `forkserver` (never
             `fork`: the trainer runs multithreaded JAX). A call that runs past
             `timeout_s` gets its worker killed and replaced. Functions and their
             inputs must pickle: module-level functions or `functools.partial` of them;
             this is checked up front with an error naming the function.
  "thread"   a pool of threads, for unpicklable callables. A hung thread cannot be
             killed, only abandoned (it keeps running in the background until it
             returns); its samples are failed and a fresh thread takes its place.
  "inline"   called directly in the caller's thread, no timeout (exceptions and bad
             values are still caught): for in-process JAX scorers such as
             `RewardModelScorer`. Inline calls overlap with the pool's work.
Each function's batch is cut into chunks (`chunk_size`, default ceil(N / num_workers)),
one call per chunk, so a hang or an exception fails only that chunk's samples.
Workers ignore SIGINT, so Ctrl-C reaches the driver, which can finish its step.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import inspect
import logging
import math
import multiprocessing
import multiprocessing.connection
import pathlib
import pickle
import queue
import signal
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, Protocol, cast

import numpy as np

from grpojax.ops.checks import check_choice, check_int, check_number
from grpojax.user_code import import_object, is_import_path

log = logging.getLogger(__name__)

MODES = ("process", "thread", "inline")
START_METHODS = ("forkserver", "spawn")
FAILURE_KINDS = ("timeouts", "exceptions", "nonfinite", "wrong_length", "worker_deaths")
# Start-up of a fresh worker (imports) is not charged to the per-call timeout.
_WORKER_START_TIMEOUT_S = 120.0
# Nor is a call's hand-over: from being sent to a worker to the function starting (unpickling
# the function, which may import its module, and the inputs; the worker being scheduled).
# A hand-over that takes longer than this (e.g. an import that hangs) is a timeout.
_HANDOVER_TIMEOUT_S = 120.0


class RewardFn(Protocol):
    def __call__(
        self, prompts: list[str], completions: list[str], **columns: Any
    ) -> list[float | None]: ...


@dataclasses.dataclass(frozen=True)
class RewardSpec:
    """One reward function with its weight, log name and execution mode."""

    fn: Callable[..., Sequence[float | None]]
    weight: float = 1.0
    name: str | None = None
    mode: Literal["process", "thread", "inline"] | None = None  # None: the manager's mode

    def __post_init__(self):
        if not callable(self.fn):
            raise ValueError(f"fn must be callable, got {self.fn!r}")
        check_number("weight", self.weight, array_ok=False)
        if self.mode is not None:
            check_choice("mode", self.mode, MODES)


@dataclasses.dataclass(frozen=True)
class RewardResult:
    """What one `compute` call returns (N = number of completions).

    total_n:  [N] float32  sum_f weight_f * r_f[n] over functions that scored n; 0.0 where
                           invalid (never NaN)
    valid_n:  [N] bool     no function failed on n and at least one scored it
    per_fn:   name -> [N] float32 per-function rewards, NaN where None or failed
    failed_fn: name -> [N] bool  where that function failed (timeout, exception, ...)
    stats:    flat name -> float for logging (see `RewardManager.compute`)
    errors:   a few failure messages, for the log
    """

    total_n: np.ndarray
    valid_n: np.ndarray
    per_fn: dict[str, np.ndarray]
    failed_fn: dict[str, np.ndarray]
    stats: dict[str, float]
    errors: list[str]


def _fn_name(fn) -> str:
    base = fn.func if isinstance(fn, functools.partial) else fn
    return getattr(base, "__name__", None) or type(base).__name__


def check_picklable(fn, name: str | None = None) -> bytes:
    """Pickle `fn` for a worker process, or raise a `ValueError` naming it.

    Functions pickle by reference (module + name), so one defined in an interactive
    `__main__` (no file to re-import in the worker) is refused too.
    """
    name = name or _fn_name(fn)
    hint = (
        "define it at module level (or use functools.partial of a module-level function), "
        "or run it with mode='thread'"
    )
    try:
        data = pickle.dumps(fn)
    except Exception as e:  # PicklingError, AttributeError ("Can't pickle local object"), ...
        raise ValueError(
            f"reward function {name!r} ({fn!r}) cannot be pickled for the process pool: "
            f"{type(e).__name__}: {e}. {hint}"
        ) from e
    base = fn.func if isinstance(fn, functools.partial) else fn
    main = sys.modules.get("__main__")
    if getattr(base, "__module__", None) == "__main__" and not getattr(main, "__file__", None):
        raise ValueError(
            f"reward function {name!r} is defined in an interactive __main__, which worker "
            f"processes cannot import; {hint}"
        )
    return data


def _column_filter(fn) -> tuple[frozenset[str] | None, frozenset[str]]:
    """(accepted column names or None for all, required column names) of `fn`."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None, frozenset()
    params = list(sig.parameters.values())
    P = inspect.Parameter
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        accepted = None
    else:
        # The first two positional parameters are prompts and completions.
        positional = [p for p in params if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
        skip = {p.name for p in positional[:2]}
        bound = set(fn.keywords) if isinstance(fn, functools.partial) else set()
        accepted = frozenset(
            p.name
            for p in params
            if p.name not in skip
            and p.name not in bound
            and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        )
    required = frozenset(
        p.name
        for p in params
        if p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is inspect.Parameter.empty
    )
    return accepted, required


REWARD_CONTRACT = "fn(prompts, completions, **columns) -> list[float | None]"


def reward_columns(fn) -> tuple[str, ...]:
    """The dataset columns `fn` cannot do without: its parameters after `prompts` and
    `completions` that have no default (keyword-only, or positional-or-keyword, which the
    manager passes by keyword). A `functools.partial`'s bound keywords are not columns."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return ()
    P = inspect.Parameter
    positional = [p for p in params if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    skip = {p.name for p in positional[:2]}
    return tuple(
        p.name
        for p in params
        if p.name not in skip
        and p.default is P.empty
        and p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)
    )


def resolve_reward_function(path: str, *, field: str = "functions") -> Callable:
    """The reward function `path` ("package.module:function") names, imported and checked.

    The module is imported with `importlib.import_module` (`grpojax.user_code`, shared with
    the GRPO objectives' paths), so it must be on `sys.path` (PYTHONPATH); worker processes
    import it again by name (functions pickle by reference), with the parent's `sys.path` as
    it is when they start (multiprocessing sends it to each new forkserver or spawn child).
    The signature must allow the manager's call `fn(prompts, completions, **columns)`: two
    positional arguments, then the columns by keyword (`reward_columns`).

    Raises:
      ValueError: one line naming `field`, for a path without ':', a module that does not
        import, a missing attribute, an object that is not callable, or a signature that
        cannot take that call.
    """
    if not is_import_path(path):
        raise ValueError(f"{field}: {path!r} must look like 'package.module:function'")
    fn: Any = import_object(field, path)
    if not callable(fn):
        raise ValueError(
            f"{field}: {path!r} is a {type(fn).__name__}, not a callable {REWARD_CONTRACT}"
        )
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return fn  # a builtin without a signature: the manager's calls will tell
    try:
        sig.bind([], [], **{c: [] for c in reward_columns(fn)})
    except TypeError:
        raise ValueError(
            f"{field}: {path!r} must be a function {REWARD_CONTRACT}; its signature {sig} "
            "cannot be called with prompts and completions as its first two arguments"
        ) from None
    return fn


def _to_values(out, n: int) -> list[float | None]:
    """Plain Python floats / None from a reward function's return (may raise)."""
    if isinstance(out, np.ndarray):
        out = out.tolist()
    values = list(out)
    if len(values) != n:
        raise _WrongLength(f"returned {len(values)} values for {n} completions")
    return [None if v is None else float(v) for v in values]


class _WrongLength(Exception):
    pass


def _call(fn, prompts, completions, columns) -> tuple[str, Any]:
    """Run one reward call and classify its outcome: ("ok", values) | (kind, message)."""
    try:
        out = fn(prompts, completions, **columns)
        return "ok", _to_values(out, len(completions))
    except _WrongLength as e:
        return "wrong_length", str(e)
    except BaseException as e:  # a reward function may raise anything, SystemExit included
        tb = traceback.format_exception_only(type(e), e)[-1].strip()
        return "exceptions", tb


def _worker_main(conn) -> None:
    """A worker process: receive (task_id, pickled call), answer (task_id, kind, payload)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver handles Ctrl-C, not the workers
    conn.send(("ready", None, None))
    fn_cache: dict[bytes, Any] = {}
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        task_id, fn_bytes, args_bytes = msg
        try:
            fn = fn_cache.get(fn_bytes)
            if fn is None:
                fn = fn_cache[fn_bytes] = pickle.loads(fn_bytes)
            prompts, completions, columns = pickle.loads(args_bytes)
        except BaseException as e:
            conn.send((task_id, "exceptions", f"cannot unpickle the call in the worker: {e!r}"))
            continue
        conn.send((task_id, "started", time.monotonic()))  # the call's clock starts here
        kind, payload = _call(fn, prompts, completions, columns)
        try:
            conn.send((task_id, kind, payload))
        except Exception as e:
            conn.send((task_id, "exceptions", f"cannot send the result back: {e!r}"))


@dataclasses.dataclass
class _Task:
    task_id: int
    fn_index: int
    start: int
    stop: int


class _ProcessWorker:
    def __init__(self, ctx) -> None:
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=_worker_main, args=(child,), daemon=True)
        self.proc.start()
        child.close()
        self.ready = False
        self.task: _Task | None = None
        self.sent = 0.0  # when the current call was handed over (time.monotonic())
        self.started: float | None = None  # when its function started; None: not yet

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()


def _script_hint() -> str:
    """Why a worker dies at start when the run was started from a script: the workers
    import the script again (forkserver and spawn run `__main__` as `__mp_main__`), and a
    script that trains without a main guard starts a second run inside each worker."""
    script = getattr(sys.modules.get("__main__"), "__file__", None)
    if not script:  # an interactive session
        return ""
    path = pathlib.Path(script)
    try:
        if "__main__" in path.read_text():  # a main guard: not this cause
            return ""
    except (OSError, UnicodeDecodeError):
        return ""
    return (
        f"; the workers import {path.name} again: if it starts the run at "
        'its top level, put that under `if __name__ == "__main__":` (or set '
        "rewards.mode=thread)"
    )


class _ProcessBackend:
    """Worker processes with one duplex pipe each; a hung worker is killed and replaced."""

    def __init__(self, num_workers: int, start_method: str):
        ctx = multiprocessing.get_context(start_method)
        if start_method == "forkserver":
            # Applies when this process starts its fork server: fresh workers then fork
            # from a server that has already imported this module (and JAX through it).
            ctx.set_forkserver_preload([__name__])
        self._ctx = ctx
        self.workers = [_ProcessWorker(ctx) for _ in range(num_workers)]
        self.restarts = 0

    def _await_ready(self, workers) -> None:
        deadline = time.monotonic() + _WORKER_START_TIMEOUT_S
        for w in workers:
            while not w.ready:
                left = deadline - time.monotonic()
                if left <= 0 or not w.conn.poll(left):
                    raise RuntimeError("reward worker process did not start in time")
                try:
                    w.ready = w.conn.recv()[0] == "ready"
                except (EOFError, OSError) as e:
                    raise RuntimeError(
                        f"reward worker process died on start-up: {e!r}{_script_hint()}"
                    ) from e

    def idle(self) -> list[_ProcessWorker]:
        pending = [w for w in self.workers if not w.ready]
        if pending:
            self._await_ready(pending)
        return [w for w in self.workers if w.task is None]

    def dispatch(self, w: _ProcessWorker, task: _Task, fn_bytes: bytes, args_bytes: bytes):
        w.task, w.sent, w.started = task, time.monotonic(), None
        w.conn.send((task.task_id, fn_bytes, args_bytes))

    def wait(self, timeout: float) -> list[tuple[_ProcessWorker, str, Any]]:
        """The calls that ended within `timeout`: (worker, kind, payload). A worker's
        "started" message (the time its function started, on the worker's clock: the same
        system-wide monotonic clock) sets `worker.started`."""
        busy = {w.conn: w for w in self.workers if w.task is not None}
        out = []
        for conn in multiprocessing.connection.wait(list(busy), timeout=timeout):
            w = busy[conn]
            try:
                _, kind, payload = w.conn.recv()  # conn itself, not typed as a Connection
                if kind == "started":
                    w.started = payload
                    if not w.conn.poll():
                        continue
                    _, kind, payload = w.conn.recv()
            except (EOFError, OSError):
                code = w.proc.exitcode
                out.append((w, "worker_deaths", f"worker process died (exit code {code})"))
                self.replace(w)
                continue
            out.append((w, kind, payload))
        return out

    def replace(self, w: _ProcessWorker) -> _ProcessWorker:
        w.kill()
        self.restarts += 1
        new = _ProcessWorker(self._ctx)
        self.workers[self.workers.index(w)] = new
        return new

    def close(self) -> None:
        for w in self.workers:
            try:
                w.conn.send(None)
            except OSError:
                pass
        deadline = time.monotonic() + 2.0
        for w in self.workers:
            w.proc.join(timeout=max(0.0, deadline - time.monotonic()))
            w.kill()
        self.workers = []


class _ThreadWorker:
    def __init__(self, outbox: queue.Queue):
        self.inbox: queue.Queue = queue.Queue()
        self.outbox = outbox
        self.task: _Task | None = None
        self.sent = 0.0
        self.started: float | None = None  # set by the thread when the function starts
        self.ready = True
        self.thread = threading.Thread(target=self._run, daemon=True, name="grpojax-reward")
        self.thread.start()

    def _run(self) -> None:
        while True:
            item = self.inbox.get()
            if item is None:
                return
            fn, prompts, completions, columns = item
            self.started = time.monotonic()
            kind, payload = _call(fn, prompts, completions, columns)
            self.outbox.put((self, kind, payload))


class _ThreadBackend:
    """Daemon threads; a hung thread is abandoned (it cannot be killed) and replaced."""

    def __init__(self, num_workers: int):
        self.outbox: queue.Queue = queue.Queue()
        self.workers = [_ThreadWorker(self.outbox) for _ in range(num_workers)]
        self.restarts = 0

    def idle(self) -> list[_ThreadWorker]:
        return [w for w in self.workers if w.task is None]

    def dispatch(self, w: _ThreadWorker, task: _Task, fn, args) -> None:
        w.task, w.sent, w.started = task, time.monotonic(), None
        w.inbox.put((fn, *args))

    def wait(self, timeout: float) -> list[tuple[_ThreadWorker, str, Any]]:
        out: list[tuple[_ThreadWorker, str, Any]] = []
        try:
            item = self.outbox.get(timeout=max(timeout, 0.0))
        except queue.Empty:
            return out
        while True:
            w = item[0]
            if w in self.workers:  # results of abandoned threads are dropped
                out.append(item)
            try:
                item = self.outbox.get_nowait()
            except queue.Empty:
                return out

    def replace(self, w: _ThreadWorker) -> _ThreadWorker:
        w.inbox.put(None)  # it exits after its (hung) call returns, if ever
        self.restarts += 1
        new = _ThreadWorker(self.outbox)
        self.workers[self.workers.index(w)] = new
        return new

    def close(self) -> None:
        for w in self.workers:
            w.inbox.put(None)
        self.workers = []


def _close_backends(backends: dict) -> None:
    for b in list(backends.values()):
        b.close()
    backends.clear()


class RewardManager:
    """Several weighted reward functions, run in a worker pool with a per-call timeout.

    Args:
      rewards: reward functions or `RewardSpec`s (weight, name, mode per function).
      weights: optional weights for plain functions (default 1.0 each).
      names: optional log names for plain functions (default: the function's name).
      mode: default execution mode, one of "process", "thread", "inline".
      num_workers: pool size (processes or threads), shared by all functions.
      timeout_s: per-call limit on the function's own running time, counted from the
        moment it starts in its worker: not the wait for a free worker, nor the hand-over
        (unpickling, scheduling; logged as `rewards/handover_s`, and bounded separately
        by a generous limit that only a hang reaches).
      chunk_size: completions per call (default ceil(N / num_workers)); with 1, a hang
        or an exception fails only the one sample.
      start_method: "forkserver" (default) or "spawn"; never "fork".

    Workers start on first use (or `start()`), are reused across calls, and are shut
    down by `close()` or the `with` block. Use one manager per training run.
    """

    def __init__(
        self,
        rewards: Sequence[Callable | RewardSpec],
        *,
        weights: Sequence[float] | None = None,
        names: Sequence[str] | None = None,
        mode: Literal["process", "thread", "inline"] = "process",
        num_workers: int = 2,
        timeout_s: float = 30.0,
        chunk_size: int | None = None,
        start_method: Literal["forkserver", "spawn"] = "forkserver",
    ):
        check_choice("mode", mode, MODES)
        if start_method not in START_METHODS:
            raise ValueError(
                f"start_method must be one of {START_METHODS} (never 'fork': the trainer is "
                f"multithreaded), got {start_method!r}"
            )
        check_int("num_workers", num_workers)
        check_number("timeout_s", timeout_s, minimum=0, strict=True, array_ok=False)
        check_int("chunk_size", chunk_size, none_ok=True)
        rewards = list(rewards)
        if not rewards:
            raise ValueError("RewardManager needs at least one reward function")
        for arg, label in ((weights, "weights"), (names, "names")):
            if arg is not None and len(arg) != len(rewards):
                raise ValueError(
                    f"{label} has {len(arg)} entries for {len(rewards)} reward functions"
                )
        specs = []
        for i, r in enumerate(rewards):
            if not isinstance(r, RewardSpec):
                r = RewardSpec(fn=r)
            if weights is not None:
                r = dataclasses.replace(r, weight=float(weights[i]))
            if names is not None:
                r = dataclasses.replace(r, name=names[i])
            name = r.name or _fn_name(r.fn)
            specs.append(dataclasses.replace(r, name=name, mode=r.mode or mode))
        self.specs: list[RewardSpec] = specs
        counts = collections.Counter(self.names)
        dups = sorted(n for n, c in counts.items() if c > 1)
        if dups:
            raise ValueError(f"reward names must be unique; repeated: {dups} (pass names=...)")
        self._fn_bytes = [
            check_picklable(s.fn, s.name) if s.mode == "process" else None for s in specs
        ]
        self._columns = [_column_filter(s.fn) for s in specs]
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self.chunk_size = chunk_size
        self.start_method = start_method
        self._backends: dict[str, Any] = {}
        # Closes the workers if the manager is collected unclosed (the finalizer keeps itself).
        weakref.finalize(self, _close_backends, self._backends)
        self._task_ids = 0
        self.totals: collections.Counter = collections.Counter()  # failures over the run

    @property
    def names(self) -> list[str]:
        return [cast(str, s.name) for s in self.specs]  # __init__ names every spec

    @property
    def weights(self) -> list[float]:
        """Each function's weight in the total, in `names` order."""
        return [float(s.weight) for s in self.specs]

    def start(self) -> RewardManager:
        """Start the pools the functions need and wait until their workers are ready."""
        modes = {s.mode for s in self.specs}
        if "process" in modes and "process" not in self._backends:
            self._backends["process"] = _ProcessBackend(self.num_workers, self.start_method)
            self._backends["process"].idle()  # waits for start-up
        if "thread" in modes and "thread" not in self._backends:
            self._backends["thread"] = _ThreadBackend(self.num_workers)
        return self

    def close(self) -> None:
        """Stop the workers (idempotent)."""
        _close_backends(self._backends)

    def __enter__(self) -> RewardManager:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _columns_for(self, i: int, columns: Mapping[str, Sequence]) -> dict[str, Sequence]:
        accepted, required = self._columns[i]
        missing = sorted(required - set(columns))
        if missing:
            raise ValueError(
                f"reward function {self.specs[i].name!r} needs column(s) {missing}; "
                f"available columns: {sorted(columns)}"
            )
        return {k: v for k, v in columns.items() if accepted is None or k in accepted}

    def compute(
        self, prompts: Sequence[str], completions: Sequence[str], **columns: Sequence
    ) -> RewardResult:
        """Score N completions with every function; see `RewardResult` for the outputs.

        `stats` keys (floats): `rewards/total/mean|std` (over valid samples),
        `rewards/valid_frac`, `rewards/time_s`, `rewards/worker_restarts`,
        `rewards/handover_s` (the longest time a call took from being handed to a worker to
        its function starting: not charged to `timeout_s`), and per function
        `rewards/<name>/mean|std` (over samples it scored), `/none` (samples it left
        unscored), `/failed` (samples failed) and the failure counts `/timeouts`,
        `/exceptions`, `/wrong_length`, `/worker_deaths` (calls) and `/nonfinite` (samples).
        """
        t0 = time.monotonic()
        prompts, completions = list(prompts), list(completions)
        n = len(completions)
        if len(prompts) != n:
            raise ValueError(f"got {len(prompts)} prompts for {n} completions (one per sample)")
        for k, v in columns.items():
            if len(v) != n:
                raise ValueError(f"column {k!r} has {len(v)} values for {n} completions")
        columns = {k: list(v) for k, v in columns.items()}
        fn_columns = [self._columns_for(i, columns) for i in range(len(self.specs))]
        if n and any(s.mode != "inline" for s in self.specs):
            self.start()

        nf = len(self.specs)
        values = np.full((nf, n), np.nan, np.float64)
        failed = np.zeros((nf, n), bool)
        counts: collections.Counter = collections.Counter()
        errors: list[str] = []
        handover = [0.0]  # the longest hand-over of this call's tasks

        def record(task: _Task, kind: str, payload) -> None:
            name = self.specs[task.fn_index].name
            sl = slice(task.start, task.stop)
            if kind == "ok":
                vals = np.array([np.nan if v is None else v for v in payload], np.float64)
                nonfinite = np.array([v is not None and not math.isfinite(v) for v in payload])
                values[task.fn_index, sl] = np.where(nonfinite, np.nan, vals)
                failed[task.fn_index, sl] |= nonfinite
                if nonfinite.any():
                    counts[(name, "nonfinite")] += int(nonfinite.sum())
                    errors.append(f"{name}: returned NaN/inf for {int(nonfinite.sum())} samples")
            else:
                failed[task.fn_index, sl] = True
                counts[(name, kind)] += 1
                errors.append(f"{name} [{task.start}:{task.stop}] {kind}: {payload}")

        chunk = self.chunk_size or max(1, math.ceil(n / self.num_workers))
        queues: dict[str, collections.deque] = {m: collections.deque() for m in MODES}
        for i, spec in enumerate(self.specs):
            for start in range(0, n, chunk):
                self._task_ids += 1
                # cast: __init__ sets every spec's mode.
                queues[cast(str, spec.mode)].append(
                    _Task(self._task_ids, i, start, min(start + chunk, n))
                )

        def args(task: _Task):
            sl = slice(task.start, task.stop)
            cols = {k: v[sl] for k, v in fn_columns[task.fn_index].items()}
            return prompts[sl], completions[sl], cols

        pools = [(self._backends[m], queues[m]) for m in ("process", "thread") if queues[m]]

        def pump(timeout: float) -> None:
            for backend, q in pools:
                for w in backend.idle():
                    if not q:
                        break
                    task = q.popleft()
                    if "process" in self._backends and backend is self._backends["process"]:
                        try:
                            blob = pickle.dumps(args(task))
                        except Exception as e:
                            record(task, "exceptions", f"cannot pickle the inputs: {e!r}")
                            continue
                        backend.dispatch(w, task, self._fn_bytes[task.fn_index], blob)
                    else:
                        backend.dispatch(w, task, self.specs[task.fn_index].fn, args(task))
            for backend, _ in pools:
                busy = [w for w in backend.workers if w.task is not None]
                if not busy:
                    continue
                now = time.monotonic()
                left = min(self._deadline(w) for w in busy) - now
                for w, kind, payload in backend.wait(min(timeout, max(left, 0.0))):
                    if w.started is not None:
                        handover[0] = max(handover[0], w.started - w.sent)
                    task, w.task = w.task, None
                    record(task, kind, payload)
                now = time.monotonic()
                for w in [w for w in backend.workers if w.task is not None]:
                    if now >= self._deadline(w):
                        if w.started is None:
                            why = (
                                f"the call did not start within {_HANDOVER_TIMEOUT_S:g} s of "
                                "being handed to its worker (unpickling it, or an import, hung)"
                            )
                        else:
                            why = f"call exceeded timeout_s={self.timeout_s}"
                        record(w.task, "timeouts", why)
                        backend.replace(w)

        def busy_any() -> bool:
            return any(q for _, q in pools) or any(
                w.task is not None for b, _ in pools for w in b.workers
            )

        pump(0.0)  # hand out pool work first, so inline functions overlap with it
        for task in queues["inline"]:
            kind, payload = _call(self.specs[task.fn_index].fn, *args(task))
            record(task, kind, payload)
        while busy_any():
            # With two pools, poll each in turn so neither waits on the other.
            pump(0.05 if len(pools) > 1 else self.timeout_s)

        return self._combine(values, failed, counts, errors, t0, handover[0])

    def _deadline(self, w) -> float:
        """When worker `w`'s call times out: `timeout_s` after its function started, or
        `_HANDOVER_TIMEOUT_S` after the hand-over began while it has not started."""
        if w.started is None:
            return w.sent + _HANDOVER_TIMEOUT_S
        return w.started + self.timeout_s

    def _combine(self, values, failed, counts, errors, t0, handover_s) -> RewardResult:
        n = values.shape[1]
        w = np.array([s.weight for s in self.specs], np.float64)[:, None]
        scored = ~np.isnan(values) & ~failed
        any_failed = failed.any(axis=0)
        valid = ~any_failed & scored.any(axis=0)
        total = np.where(scored, w * np.nan_to_num(values), 0.0).sum(axis=0)
        total = np.where(valid, total, 0.0).astype(np.float32)

        stats: dict[str, float] = {}
        restarts = sum(b.restarts for b in self._backends.values())
        for i, s in enumerate(self.specs):
            v = values[i][scored[i]]
            stats[f"rewards/{s.name}/mean"] = float(v.mean()) if v.size else float("nan")
            stats[f"rewards/{s.name}/std"] = float(v.std()) if v.size else float("nan")
            stats[f"rewards/{s.name}/none"] = float((np.isnan(values[i]) & ~failed[i]).sum())
            stats[f"rewards/{s.name}/failed"] = float(failed[i].sum())
            for kind in FAILURE_KINDS:
                c = counts.get((s.name, kind), 0)
                stats[f"rewards/{s.name}/{kind}"] = float(c)
                self.totals[(s.name, kind)] += c
        tv = total[valid]
        stats["rewards/total/mean"] = float(tv.mean()) if tv.size else float("nan")
        stats["rewards/total/std"] = float(tv.std()) if tv.size else float("nan")
        stats["rewards/valid_frac"] = float(valid.mean()) if n else 1.0
        stats["rewards/worker_restarts"] = float(restarts)
        stats["rewards/handover_s"] = float(handover_s)
        stats["rewards/time_s"] = time.monotonic() - t0
        if errors:
            log.warning(
                "reward failures (%d samples masked): %s%s",
                int((~valid & any_failed).sum()),
                "; ".join(errors[:3]),
                f" (+{len(errors) - 3} more)" if len(errors) > 3 else "",
            )
        return RewardResult(
            total_n=total,
            valid_n=valid,
            per_fn={name: values[i].astype(np.float32) for i, name in enumerate(self.names)},
            failed_fn={name: failed[i].copy() for i, name in enumerate(self.names)},
            stats=stats,
            errors=errors[:20],
        )
