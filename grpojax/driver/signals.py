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

Test hook: the driver calls `kill_point(event, n)` at a few named moments, and a test sets
`GRPOJAX_TEST_KILL_AT=<event>[:<n>][:SIGTERM]` to have the process signal itself there,
deterministically instead of racing a timer. Events: `sft_step` (SFT step n done, before its
checkpoint), `sft_save` (SFT checkpoint n being written), `rl_save` (RL checkpoint n being
written; n = 0 is the warm start), `rl_ckpt0` (RL checkpoint 0 complete, the SFT
checkpoints not yet removed), `rl_step` (RL step n done and logged, before its checkpoint),
`weight_transfer` (split placement: the weights of version n about to be copied to the
sampler's devices), `final_eval` (the final evaluation starting). Without `:<n>` the first
occurrence fires. The signal is SIGKILL to the process group when the process leads its
group (else to itself only), or SIGTERM to the process with `:SIGTERM`. Unset (always,
outside tests), a call is one dictionary lookup.
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


__all__ = ["KILL_AT_ENV", "KILL_EVENTS", "GracefulExit", "kill_point"]
