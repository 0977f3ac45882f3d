"""``--native-split``: how much of each call runs in the native kernels, and how much around them.

:func:`record_split` runs a command's timed steps again, after its timed loop (so the headline numbers
are measured without the timers), with :func:`deepep_ascend.native.timing` on: each named step is one
op, timed from its start to its end (``time.perf_counter_ns``, a barrier before it, the garbage
collector paused) together with the native calls made inside it. Unlike ``--phases``, which switches
the library's step-by-step marks on (and some engines to their step-by-step path with them), this
runs the calls exactly as the timed loop does; the only cost added is a timing wrapper per native call
(about half a microsecond each).

Per op, :func:`split_table` takes each rank's median call (the iteration whose time is the median) and
reports, as the mean over ranks and for the busiest rank (the rank whose median call is the longest):

* ``call_us``: the step's time from start to end;
* ``native_us``: the time inside native calls (the C functions, their ctypes argument conversion and any
  polling they do for peers);
* ``outside_us``: the rest: the Python of the call, the torch operations it makes, and waits for peers
  made from Python (a source late past a native poll's budget);

with ``native_us + outside_us == call_us``, and each native function's time in that call (mean over ranks).
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

from bench.phases import median_call, ops_of
from bench.timing import each_step


def record_split(steps: Sequence[tuple], comm, iters: int, warmup: int = 1) -> list[dict]:
    """Run ``steps`` (:func:`bench.timing.each_step`; after the timed loop, so ``warmup`` iterations and no timed
    warm-up) with the native calls timed, keeping the ``iters`` measured iterations. Collective. Returns this
    rank's iterations: ``[{step name: {"call_ns": int, "native_ns": int,
    "kernels": {function: ns}}}]``."""
    from deepep_ascend import native

    def measure(fn):
        before = {k: v[1] for k, v in totals.items()}
        t0 = time.perf_counter_ns()
        fn()
        call_ns = time.perf_counter_ns() - t0
        kernels = {k: v[1] - before.get(k, 0) for k, v in totals.items()}
        kernels = {k: ns for k, ns in kernels.items() if ns}
        return {"call_ns": call_ns, "native_ns": sum(kernels.values()), "kernels": kernels}

    with native.timing() as totals:
        return each_step(steps, comm, iters, warmup, measure, min_seconds=0)


def split_table(per_rank: list[list[dict]]) -> dict:
    """The table of every op from every rank's :func:`record_split` result (``per_rank[r]``); see the module
    doc. Returns ``{op: {"iterations", "ranks", "busiest_rank", "call_us", "native_us", "outside_us",
    "outside_share", "busiest": {"call_us", "native_us", "outside_us"}, "kernels": [{"kernel", "us"}, ...]
    (largest first)}}``: each rank's median call (``native_us + outside_us == call_us``), mean over ranks."""
    out = {}
    for name, per in ops_of(per_rank):
        mids = [median_call(p, "call_ns") for p in per]
        busiest = max(range(len(per)), key=lambda r: mids[r]["call_ns"])
        call = statistics.fmean(m["call_ns"] for m in mids) / 1e3
        native = statistics.fmean(m["native_ns"] for m in mids) / 1e3
        kernels = list(dict.fromkeys(k for m in mids for k in m["kernels"]))
        rows = [{"kernel": k, "us": statistics.fmean(m["kernels"].get(k, 0) for m in mids) / 1e3} for k in kernels]
        rows.sort(key=lambda r: -r["us"])
        b = mids[busiest]
        out[name] = {"iterations": min(len(p) for p in per), "ranks": len(per), "busiest_rank": busiest,
                     "call_us": call, "native_us": native, "outside_us": call - native,
                     "outside_share": (call - native) / call if call else None,
                     "busiest": {"call_us": b["call_ns"] / 1e3, "native_us": b["native_ns"] / 1e3,
                                 "outside_us": (b["call_ns"] - b["native_ns"]) / 1e3},
                     "kernels": rows}
    return out


def gather_split(local: list[dict], comm) -> dict | None:
    """:func:`split_table` of every rank's records, on rank 0 (None elsewhere). Collective."""
    per_rank = comm.gather(local, root=0)
    return split_table(per_rank) if per_rank is not None else None


def split_lines(table: dict, tag: str = "[native]", top: int = 4) -> list[str]:
    """The printed table: per op one line (medians, mean over ranks; the busiest rank's call) and its ``top``
    native functions."""
    from deepep_ascend import native

    lines = [] if native.available() else [
        f"{tag} the native kernels are not loaded (DEEPEP_ASCEND_NATIVE=0, or not built): every call is outside"]
    if not table:
        lines.append(f"{tag} no library call ran (--systems): nothing to split")
    for name, op in table.items():
        share = f"{100 * op['outside_share']:.1f}%" if op["outside_share"] is not None else "-"
        kern = ", ".join(f"{r['kernel']} {r['us']:.1f}" for r in op["kernels"][:top]) or "none"
        lines.append(f"{tag} {name}: call {op['call_us']:.1f} us (busiest rank {op['busiest_rank']}: "
                     f"{op['busiest']['call_us']:.1f}) = native {op['native_us']:.1f} + outside {op['outside_us']:.1f} "
                     f"({share} outside) | median of {op['iterations']}, mean over {op['ranks']} ranks | "
                     f"native us: {kern}")
    return lines
