"""Timing: barrier-synchronised phases, the max over ranks per iteration, and one-process medians.

* :func:`each_step` — the loop every barrier-synchronised measurement runs: untimed iterations first (at least
  ``warmup`` of them and for at least :data:`MIN_WARMUP_S` seconds, :func:`warm_up`), then each named step
  measured after a barrier, Python's garbage collector paused throughout (:func:`gc_paused`);
* :func:`time_phases` / :func:`time_collective` — :func:`each_step` with ``time.perf_counter`` around each
  step, the max over ranks per iteration (one ``Allreduce(MAX)`` at the end), median/min/max over
  iterations (:class:`Timing`);
* :func:`time_loops` — several calls back to back as an application's loop runs them (no barrier between
  them, the garbage collector as the caller has it), systems alternating segment by segment;
* :func:`interleaved_medians_ms` — one process: the median of each of several functions timed in
  alternation, so that the host's drift hits every function alike;
* :func:`progress_bar` — a tqdm bar over the iterations on rank 0 (``--no-progress`` turns it off).
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np


@dataclasses.dataclass
class Timing:
    """Per-iteration times in seconds (each the max over ranks) and their summary."""

    times: list

    @property
    def median(self) -> float:
        return statistics.median(self.times) if self.times else float("nan")

    @property
    def min(self) -> float:
        return min(self.times) if self.times else float("nan")

    @property
    def max(self) -> float:
        return max(self.times) if self.times else float("nan")

    def __add__(self, other: Timing) -> Timing:
        """Iteration-wise sum (e.g. dispatch + combine = round trip)."""
        return Timing([a + b for a, b in zip(self.times, other.times)])

    def as_dict(self) -> dict:
        return dict(median_s=self.median, min_s=self.min, max_s=self.max, times_s=list(self.times))

    def fmt(self, unit: str = "ms") -> str:
        s = {"s": 1.0, "ms": 1e3, "us": 1e6}[unit]
        return f"{self.median * s:9.3f} {unit} (min {self.min * s:.3f}, max {self.max * s:.3f})"


Phase = tuple  # (name or None, fn): None = untimed step (no barrier), e.g. bookkeeping

#: ``--warmup-s``'s default: the least wall time, in seconds, that :func:`time_phases` and :func:`time_loops` run
#: a system untimed before timing it, beyond their ``warmup`` iterations. On the host measured, a system's calls
#: run slower for their first tens of milliseconds of activity (after start-up or a pause); a count of iterations
#: alone leaves a fast system inside that ramp while a slow one is past it (docs/benchmarks.md, "How timing works").
DEFAULT_WARMUP_S = 0.25
#: The value in force: a command's ``--warmup-s`` (:func:`bench.commands.parse` sets it).
MIN_WARMUP_S = DEFAULT_WARMUP_S


def warm_up(step: Callable[[], Any], comm, warmup: int, min_seconds: float | None = None) -> int:
    """Run ``step()`` (one collective iteration) ``warmup`` times, then again until ``min_seconds`` (default
    :data:`MIN_WARMUP_S`) have passed on the slowest rank since the ranks met to begin; returns the iterations run.
    Collective: the ranks agree on every further iteration through an ``allreduce(MAX)`` of their elapsed time."""
    min_seconds = MIN_WARMUP_S if min_seconds is None else min_seconds
    if min_seconds > 0:
        comm.Barrier()  # the clock starts with every rank here (not with one waiting for the others)
    start = time.perf_counter()
    for _ in range(warmup):
        step()
    runs = warmup
    if min_seconds <= 0:
        return runs
    from mpi4py import MPI

    while comm.allreduce(time.perf_counter() - start, op=MPI.MAX) < min_seconds:
        step()
        runs += 1
    return runs


@contextlib.contextmanager
def gc_paused():
    """Collect once, then keep Python's cyclic garbage collector off inside the block (restored after).

    A full collection walks every tracked object, some 170,000 after ``import torch``; timed by the
    ``[gc]`` line of ``bench.mega_moe``. Inside a collective call it stalls every rank, so a timed
    iteration that holds one measures the collector rather than the system."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def full_gc_seconds() -> tuple[float, int]:
    """``(seconds, objects)``: the time of one full ``gc.collect()`` in this process, and how many objects
    the collector tracks (what a full collection walks)."""
    objects = len(gc.get_objects())
    t0 = time.perf_counter()
    gc.collect()
    return time.perf_counter() - t0, objects


def each_step(steps: Sequence[Phase], comm, iters: int, warmup: int, measure: Callable[[Callable[[], Any]], Any],
              progress: Callable[[int], None] | None = None, min_seconds: float | None = None) -> list[dict]:
    """The benchmarks' one loop: run ``steps`` (``(name or None, fn)``) in order untimed (:func:`warm_up`: ``warmup``
    times, and on for ``min_seconds``, default :data:`MIN_WARMUP_S`), then ``iters`` times with each named step run
    as ``measure(fn)`` after a ``comm.Barrier()``; unnamed steps run plainly, without a barrier. The garbage
    collector is paused throughout. ``progress(i)`` is called after each of the first ``warmup`` and of the
    measured iterations (a bar of ``warmup + iters``). Collective: all ranks must pass the same steps. Returns this
    rank's measured iterations, ``[{step name: measure's record}]`` (a record of None is left out)."""
    out: list[dict] = []
    warmed = 0

    def iteration(keep: bool) -> dict:
        row = {}
        for name, fn in steps:
            if name is None:
                fn()
                continue
            comm.Barrier()
            if not keep:
                fn()
            elif (rec := measure(fn)) is not None:
                row[name] = rec
        return row

    def warm_iteration() -> None:
        nonlocal warmed
        iteration(False)
        if progress is not None and warmed < warmup:  # the bar counts the required warm-up, not the timed one
            progress(warmed)
        warmed += 1

    with gc_paused():
        warm_up(warm_iteration, comm, warmup, min_seconds)
        for it in range(iters):
            out.append(iteration(True))
            if progress is not None:
                progress(warmup + it)
    return out


def _elapsed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def time_phases(phases: Sequence[Phase], comm, iters: int, warmup: int,
                progress: Callable[[int], None] | None = None) -> dict[str, Timing]:
    """Time the named ones of ``phases`` over ``iters`` iterations of :func:`each_step` (after its warm-up):
    ``time.perf_counter()`` around each, after its barrier. One ``Allreduce(MAX)`` then turns each rank's times
    into the per-iteration maximum over ranks, so the slowest rank defines every iteration. Collective."""
    from mpi4py import MPI

    names = [p[0] for p in phases if p[0] is not None]
    rows = each_step(phases, comm, iters, warmup, _elapsed, progress)
    local = np.array([[row[n] for row in rows] for n in names], dtype=np.float64).reshape(len(names), iters)
    glob = np.empty_like(local)
    comm.Allreduce(local, glob, op=MPI.MAX)
    return {n: Timing(glob[i].tolist()) for i, n in enumerate(names)}


def time_loops(loops: dict[str, Callable[[], Any]], comm, segments: int, per_segment: int,
               warmup: int) -> dict[str, Timing]:
    """Time each of ``loops`` (name -> one collective step, e.g. a round trip) as a training or decode loop
    runs it: ``per_segment`` steps back to back, no barrier between them, Python's garbage collector left as
    the caller has it (on by default: what a cycle per step costs shows). Systems alternate segment by
    segment (a barrier before each segment) so that the host's drift hits all alike; each warmed up first,
    untimed (:func:`warm_up`: ``warmup`` steps, and on for :data:`MIN_WARMUP_S` seconds). Returns, per name, a
    :class:`Timing` over segments of the time per step: each segment's elapsed time divided by
    ``per_segment``, the max over ranks. Collective."""
    from mpi4py import MPI

    for fn in loops.values():
        warm_up(fn, comm, warmup)
    local = np.zeros((len(loops), segments), dtype=np.float64)
    for k in range(segments):
        for i, fn in enumerate(loops.values()):
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(per_segment):
                fn()
            local[i, k] = (time.perf_counter() - t0) / per_segment
    glob = np.empty_like(local)
    comm.Allreduce(local, glob, op=MPI.MAX)
    return {name: Timing(glob[i].tolist()) for i, name in enumerate(loops)}


def time_collective(fn: Callable[[], Any], comm, iters: int, warmup: int) -> Timing:
    """Time one collective operation: :func:`time_phases` with the single phase ``fn``."""
    return time_phases([("op", fn)], comm, iters, warmup)["op"]


def interleaved_medians_ms(fns: Sequence[Callable[[], Any]], iters: int, warmup: int = 1,
                           min_seconds: float | None = None) -> list:
    """Median milliseconds of each of ``fns`` over ``iters`` calls, timed in alternation after untimed
    rounds of all of them (at least ``warmup``, and on for ``min_seconds``, default :data:`MIN_WARMUP_S`; one
    process, no barrier), so that the host's drift during the run hits every function alike."""
    min_seconds = MIN_WARMUP_S if min_seconds is None else min_seconds
    start, rounds = time.perf_counter(), 0
    while rounds < warmup or (time.perf_counter() - start < min_seconds and fns):
        for fn in fns:
            fn()
        rounds += 1
    times = [[] for _ in fns]
    for _ in range(iters):
        for fn, ts in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return [statistics.median(ts) * 1e3 for ts in times]


class ProgressBar:
    """A tqdm bar counting timed iterations on stderr, or nothing (tqdm missing, off, or not rank 0).

    ``callback`` is what :func:`time_phases` takes as ``progress`` (``None`` without a bar);
    :meth:`close` ends the bar (safe to call without one)."""

    def __init__(self, bar=None):
        self.bar = bar
        self.callback = (lambda i: bar.update(1)) if bar is not None else None

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def progress_bar(enabled: bool, total: int, desc: str) -> ProgressBar:
    """A :class:`ProgressBar` of ``total`` iterations labelled ``desc`` when ``enabled`` (rank 0 and no
    ``--no-progress``) and tqdm is installed; tqdm itself stays quiet when stderr is not a terminal."""
    if not enabled:
        return ProgressBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return ProgressBar()
    return ProgressBar(tqdm(total=total, desc=desc, unit="it", leave=False, file=sys.stderr, disable=None))
