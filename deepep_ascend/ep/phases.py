"""Where a call's time goes: a per-phase breakdown of ``Buffer`` / ``EPBuffer`` calls, off by default.

Turn it on around the calls to measure::

    from deepep_ascend.ep import phases

    with phases.recording() as records:       # a list, filled as calls end (this process: this rank)
        buffer.low_latency_dispatch(x, topk_idx, 128, 256)
    for rec in records:
        print(rec.op, rec.engine, rec.total_ns, rec.phases)   # {"pack": ns, "wait: signals": ns, ...}

Each :class:`CallRecord` covers one public call from entry to return (``Buffer.dispatch`` /
``combine`` / ``low_latency_dispatch`` / ``low_latency_combine``, a low-latency receive hook,
``EPBuffer.dispatch`` / ``combine``). Inside it, the code marks phase boundaries: each mark starts
a named phase and closes the one before, so the phases **tile** the call: every nanosecond between
entry and return belongs to exactly one phase, and what no mark names is ``"other"``
(:data:`OTHER`). ``sum(rec.phases.values()) == rec.total_ns`` always; a large ``"other"`` means a
cost no mark names yet, never a hidden one.

Phase names (a phase may appear in any op; names are stable, ``docs/benchmarks.md`` explains them):

=============================  ========================================================================
``checks``                     argument validation (dtypes, shapes, values, the handle, the window's room)
``layout``                     routing counts computed inside the call (``get_dispatch_layout``,
                               ``EPBuffer.dispatch``)
``route``                      low-latency: (token, slot) pairs sorted by expert, counts per expert
``pack``                       this rank's outgoing rows written to its window or to a send block
                               (low-latency dispatch: with the FP8 cast)
``compact``                    ``EPBuffer.combine``: the rows combine sends (expanded layout: each
                               token's slots summed first)
``send``                       rows written into peers' windows (stores, ``put``; internode: with the
                               block's signal), counts and headers
``signal``                     flags raised at peers (low-latency: with the URMA flush that orders them)
``wait: <what>``               waiting for peers (flag polling): ``ready``, ``staging half free``,
                               ``x rows``, ``x read in place`` (intranode), ``rail blocks``, ``rail boxes
                               free``, ``node peers`` (internode), ``signals`` (low-latency; with
                               its signals by stores, the headers' check too: one native call)
``control``                    the control exchange's reading: headers, consensus, count vectors, prefix sums
``outputs``                    output tensors allocated, the handle built
``copy``                       received rows copied into the outputs (gathers, scatters, direct stores)
``reduce``                     combine's sums (low-latency: the weighted sum)
``epilogue``                   after the data: handle fields, local expert ids, ``EPBuffer``'s ``fill``
``counters``                   the traffic counters' snapshots (``Buffer.get_traffic``)
``other``                      the rest of the call (Python glue, anything no mark names)
=============================  ========================================================================

Cost when off: every phase boundary is one ``if RECORDER.on:`` (an attribute read); a recorded
entry point adds one Python call frame. When on, a boundary costs one ``time.perf_counter_ns()`` and
a dictionary update, which the phases include (a recorded call runs a little longer than an
unrecorded one). A native call that runs several steps (the low-latency fused path's) times them itself
while recording, and each step's time is moved to its phase (:meth:`PhaseRecorder.carve`). Records are
per thread: the part of an ``async_finish`` call that runs on the
Buffer's worker after the call returned is not in the call's record.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import time
from collections.abc import Callable, Iterator

__all__ = ["OTHER", "RECORDER", "CallRecord", "PhaseRecorder", "engine_of", "recording", "timed", "timed_call"]

#: The phase of time no mark names.
OTHER = "other"

_now = time.perf_counter_ns


@dataclasses.dataclass
class CallRecord:
    """One recorded call.

    Attributes:
        op: the call (``"dispatch"``, ``"combine"``, ``"low_latency_dispatch"``, ``"low_latency_combine"``,
            ``"low_latency_dispatch hook"``, ``"low_latency_combine hook"``, ``"ep_dispatch"``, ``"ep_combine"``,
            ``"get_dispatch_layout"``).
        engine: ``"intranode"``, ``"internode"`` or ``"low-latency"``.
        total_ns: nanoseconds from entry to return (``time.perf_counter_ns``).
        phases: phase name -> nanoseconds, in the order first entered; the values sum to ``total_ns``.
    """

    op: str
    engine: str
    total_ns: int
    phases: dict

    def as_dict(self) -> dict:
        return {"op": self.op, "engine": self.engine, "total_ns": self.total_ns, "phases": dict(self.phases)}


class _Open:
    __slots__ = ("op", "engine", "t0", "t", "current", "acc")

    def __init__(self, op: str, engine: str, t: int):
        self.op, self.engine, self.t0, self.t, self.current, self.acc = op, engine, t, t, OTHER, {}


class PhaseRecorder:
    """The recorder the library's marks write to (:data:`RECORDER`); see the module doc.

    ``on`` is the switch the marks read; :func:`recording` sets it. ``records`` collects the
    :class:`CallRecord` of every call that ends while ``on``.
    """

    def __init__(self):
        self.on = False
        self.records: list[CallRecord] = []
        self._local = threading.local()

    def begin(self, op: str, engine: str) -> bool:
        """Open the record of a call in this thread; False (nothing opened) inside a call already open."""
        if getattr(self._local, "call", None) is not None:
            return False
        self._local.call = _Open(op, engine, _now())
        return True

    def switch(self, phase: str | None) -> str | None:
        """Close the running phase and start ``phase`` (``None``: :data:`OTHER`); returns the closed
        phase's name, to switch back to after a nested phase (a wait). No open call in this thread: None."""
        call = getattr(self._local, "call", None)
        if call is None:
            return None
        t = _now()
        acc = call.acc
        prev = call.current
        acc[prev] = acc.get(prev, 0) + t - call.t
        call.current, call.t = phase or OTHER, t
        return prev

    def carve(self, phase: str, ns: int) -> None:
        """Count ``ns`` nanoseconds of the running phase as ``phase`` instead: a step timed inside a native call
        that runs several (its wait, its pack). Nothing without an open call in this thread."""
        call = getattr(self._local, "call", None)
        if call is None or ns <= 0:
            return
        call.acc[phase] = call.acc.get(phase, 0) + ns
        call.t += ns  # the running phase has ns less

    def end(self) -> CallRecord | None:
        """Close this thread's open call and keep its record (also returned)."""
        call = getattr(self._local, "call", None)
        if call is None:
            return None
        self._local.call = None
        t = _now()
        call.acc[call.current] = call.acc.get(call.current, 0) + t - call.t
        rec = CallRecord(call.op, call.engine, t - call.t0, {k: v for k, v in call.acc.items() if v or k == OTHER})
        rec.phases.setdefault(OTHER, 0)
        self.records.append(rec)
        return rec


#: The process's recorder: every Buffer and EPBuffer marks its phases here.
RECORDER = PhaseRecorder()


def engine_of(buffer) -> str:
    """``"internode"`` or ``"intranode"``: the normal-mode engine a ``Buffer`` (or an ``EPBuffer``'s) runs."""
    legacy = getattr(buffer, "_legacy", buffer)
    return "internode" if legacy._internode else "intranode"


def timed(op: str, engine: str | Callable = "low-latency") -> Callable:
    """Decorate an entry point: while :data:`RECORDER` is on, each call is one :class:`CallRecord` named
    ``op``; ``engine`` a name or a function of the call's first argument (the Buffer) returning it.
    A call made inside a recorded call belongs to the outer record."""
    def deco(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if not RECORDER.on:
                return fn(*args, **kwargs)
            opened = RECORDER.begin(op, engine(args[0]) if callable(engine) else engine)
            try:
                return fn(*args, **kwargs)
            finally:
                if opened:
                    RECORDER.end()
        return wrapper
    return deco


def timed_call(op: str, fn: Callable, engine: str = "low-latency"):
    """``fn()`` as one recorded call named ``op`` while :data:`RECORDER` is on (a receive hook), else just ``fn()``."""
    if not RECORDER.on:
        return fn()
    opened = RECORDER.begin(op, engine)
    try:
        return fn()
    finally:
        if opened:
            RECORDER.end()


@contextlib.contextmanager
def recording() -> Iterator[list[CallRecord]]:
    """Record every call of this process inside the block; yields the list the records go to (fresh).

    Not reentrant: a nested ``recording()`` raises ``RuntimeError``.
    """
    if RECORDER.on:
        raise RuntimeError("phases.recording() is already active")
    RECORDER.records = records = []
    RECORDER.on = True
    try:
        yield records
    finally:
        RECORDER.on = False
