"""Graceful shutdown: SIGTERM/SIGINT ask the training loop to stop after the current step.

A preempted job (SIGTERM from a scheduler) or a Ctrl-C should not lose the step in flight
or leave a half-written checkpoint: the first signal only sets a flag, the loop checks it
between steps, saves and exits 0. A second signal gets the behaviour the process had
before (normally: terminate, or KeyboardInterrupt for SIGINT), for when saving hangs.

    with GracefulExit() as stop:
        for step in range(start, total):
            state = train_step(state, ...)
            if stop.requested:
                break
        ckpt.save(step, state, driver_state, force=True)

In a multi-process (`jax.distributed`) run each process sees its own signals; the loop
should agree on stopping (e.g. a tiny all-reduce of the flag) before saving collectively.

The test hook that kills a process at a named moment is `grpojax.distributed.kill_point`.
"""

from __future__ import annotations

import os
import signal
import threading
import warnings
from types import FrameType


class GracefulExit:
    """Context manager that turns the first SIGTERM/SIGINT into a flag.

    Attributes:
      requested: True once a handled signal has arrived.
      signal_name: "SIGTERM" / "SIGINT" of the first signal, or None.

    Args:
      signals: the signals to handle (default SIGTERM and SIGINT).

    Handlers can only be installed from the main thread; elsewhere the context warns and
    does nothing (the flag then never becomes true).
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)):
        self.signals = tuple(signals)
        self.requested = False
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            self._default(signum, frame)
            return
        self.requested = True
        self.signal_name = signal.Signals(signum).name

    def _default(self, signum: int, frame: FrameType | None) -> None:
        """What the process would have done without us."""
        previous = self._previous.get(signum, signal.SIG_DFL)
        if callable(previous):
            previous(signum, frame)  # e.g. Python's SIGINT handler: KeyboardInterrupt
        elif previous == signal.SIG_IGN:
            return
        else:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def __enter__(self) -> GracefulExit:
        if threading.current_thread() is not threading.main_thread():
            warnings.warn(
                "GracefulExit: signal handlers can only be installed from the main thread; "
                "SIGTERM/SIGINT keep their default behaviour",
                stacklevel=2,
            )
            return self
        for sig in self.signals:
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()


__all__ = ["GracefulExit"]
