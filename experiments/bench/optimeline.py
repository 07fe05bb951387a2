"""Where a compiled program's wall time goes, from a `jax.profiler` trace of it: each XLA op
named in the trace is put in a category read from the program's optimised HLO, and every
instant of a loop iteration is charged to one category only.

XLA:CPU runs independent ops of a program side by side on its threads, so summing the traced
op times counts the overlapped ones twice (the decode program's ops sum to ~1.5x its wall
time). Here the instants of an interval are charged by priority: to the matmuls when one runs,
else to the other ops (norms, attention's softmax, sampling, ...), else to the slice copies
(a dynamic slice copied out of a bigger array: a layer's weights or cache out of the stacked
ones), else to no op (the executor's scheduling and waits). The slice copies' time is thus
split into what ran beside other work (hidden) and what ran alone (exposed on the critical
path). The traced times carry the profiler's own cost, a few microseconds an op.
"""

from __future__ import annotations

import collections
import itertools
import math
import re
from typing import NamedTuple

MATMUL, OTHER, SLICE, IDLE = "matmuls", "other ops", "slice copies", "no op running"
HIDDEN = "slice copies hidden"
PRIORITY = (MATMUL, OTHER, SLICE)  # first running category takes the instant

_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.-]+) \(.*\) -> .* \{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.-]+) = (\S+) ([\w-]+)\(")
_CALLS = re.compile(r"calls=%?([\w.-]+)")
_SHAPE = re.compile(r"^[a-z]+\d*\[([\d,]*)\]")

# Trace events that are not one XLA op: the executor, thread-pool bookkeeping, containers.
_NOT_OPS = ("$", "end:", "ThunkExecutor", "Threadpool", "Slinky", "PjitFunction", "while")


class _Instruction(NamedTuple):
    name: str
    op: str
    shape: str
    called: str | None  # the computation a fusion calls


def _elements(shape: str) -> int:
    m = _SHAPE.match(shape)
    if m is None:  # a tuple or a token
        return 0
    return math.prod(int(d) for d in filter(None, m.group(1).split(",")))


def op_categories(hlo_text: str) -> dict[str, str]:
    """{instruction name: MATMUL, SLICE or OTHER} for the instructions of an optimised HLO
    module (`compiled.as_text()`).

    MATMUL: a `dot` or `convolution`, or a fusion whose computation holds one. SLICE: a
    dynamic slice, or a fusion without a dot whose largest dynamic slice has at least half
    the elements of the fusion's result (a copy out of a stacked array, possibly transposed
    on the way). Everything else is OTHER."""
    bodies: dict[str, list[_Instruction]] = {}
    current = None
    for line in hlo_text.splitlines():
        if m := _COMPUTATION.match(line):
            current = bodies.setdefault(m.group(1), [])
        elif line.startswith("}"):
            current = None
        elif current is not None and (m := _INSTRUCTION.match(line)):
            calls = _CALLS.search(line)
            current.append(_Instruction(m.group(1), m.group(3), m.group(2), calls and calls[1]))

    def contents(comp: str) -> tuple[bool, int]:
        """(holds a dot, elements of its largest dynamic slice)."""
        rows = bodies.get(comp, [])
        dot = any(x.op in ("dot", "convolution") for x in rows)
        sliced = [_elements(x.shape) for x in rows if x.op == "dynamic-slice"]
        return dot, max(sliced, default=0)

    out = {}
    for x in (x for rows in bodies.values() for x in rows):
        if x.op in ("dot", "convolution"):
            out[x.name] = MATMUL
        elif x.op == "dynamic-slice":
            out[x.name] = SLICE
        elif x.op == "fusion":
            dot, largest = contents(x.called)
            size = _elements(x.shape)
            out[x.name] = MATMUL if dot else SLICE if size and 2 * largest >= size else OTHER
        else:
            out[x.name] = OTHER
    return out


def is_op(name: str) -> bool:
    """Whether a trace event's name is one XLA op (not the executor or a loop container)."""
    return not name.startswith(_NOT_OPS)


def attribute(ops, start: float, end: float, category_of, priority=PRIORITY) -> dict[str, float]:
    """Charge each instant of [start, end) to one category.

    Args:
      ops: (start, duration, name) of the ops that ran, on any thread (clipped here).
      category_of: name -> MATMUL, OTHER or SLICE (or one of `priority`).
      priority: the categories, first running one taking the instant (default MATMUL, OTHER,
        SLICE); an instant with none running is IDLE.

    Returns:
      {MATMUL, OTHER, SLICE, IDLE: time} summing to end - start (SLICE: the time slice
      copies ran alone), and HIDDEN: the time slice copies ran beside a matmul or another op.
    """
    edges = []
    for t, dur, name in ops:
        a, b = max(t, start), min(t + dur, end)
        if b > a:
            cat = category_of(name)
            edges += [(a, 1, cat), (b, -1, cat)]
    edges.sort(key=lambda e: (e[0], e[1]))
    running = collections.Counter()
    out = dict.fromkeys((*priority, IDLE), 0.0)
    hidden, now = 0.0, start
    for t, step, cat in [*edges, (end, 0, None)]:
        span = t - now
        if span > 0:
            top = next((c for c in priority if running[c] > 0), IDLE)
            out[top] += span
            if top != SLICE and running[SLICE] > 0:
                hidden += span
        now = t
        if cat is not None:
            running[cat] += step
    out[HIDDEN] = hidden
    return out


def loop_body(hlo_text: str, loop: str) -> set[str]:
    """Names of the instructions of the body computation of the `while` instruction `loop`."""
    body = re.search(rf"^\s*(?:ROOT )?%?{re.escape(loop)} = .*\bbody=%?([\w.-]+)", hlo_text, re.M)
    if body is None:
        raise ValueError(f"no while instruction {loop!r} in the HLO")
    names, inside = set(), False
    for line in hlo_text.splitlines():
        if m := _COMPUTATION.match(line):
            inside = m.group(1) == body.group(1)
        elif inside and (m := _INSTRUCTION.match(line)):
            names.add(m.group(1))
    return names


def step_breakdown(events, loop: str, category_of, priority=PRIORITY) -> dict:
    """Mean per step of a loop that runs the traced `while` op `loop` once a step (one event
    an iteration of the enclosing loop, such as the layer loop of a decode step).

    A step runs from one `loop` event's start to the next's when that comes within 1.5x the
    median gap (the same call; the last step of a call is left out).

    `priority`: as `attribute`'s.

    Returns:
      {"steps": n, "step": `attribute` of a step, "ops": Counter of each op's traced time a
      step}.
    """
    events = [e for e in events if e.get("ph") == "X"]
    starts = sorted(e["ts"] for e in events if e["name"] == loop)
    ops = [(e["ts"], e["dur"], e["name"]) for e in events if is_op(e["name"])]
    gaps = sorted(b - a for a, b in itertools.pairwise(starts))
    median = gaps[len(gaps) // 2] if gaps else 0.0
    steps = [(a, b) for a, b in itertools.pairwise(starts) if b - a <= 1.5 * median]
    total, traced = collections.Counter(), collections.Counter()
    for a, b in steps:
        total.update(attribute(ops, a, b, category_of, priority))
        for t, d, name in ops:
            if a <= t < b:
                traced[name] += d
    m = max(len(steps), 1)
    return {
        "steps": len(steps),
        "step": {k: v / m for k, v in total.items()},
        "ops": collections.Counter({k: v / m for k, v in traced.items()}),
    }
