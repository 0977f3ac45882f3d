"""``--phases``: where each microsecond of a call goes, per op, over ranks (``deepep_ascend.ep.phases``).

:func:`record_steps` runs a command's timed steps again, after its timed loop (so the headline
numbers are measured with the recorder off), with the library's phase recorder on; each named step
becomes one op of the breakdown, its phases the sum of the records of the calls made inside it (a
step makes one call: a dispatch, a combine, a receive hook). :func:`breakdown` turns every rank's
records into the table :func:`breakdown_lines` prints and the document keeps under
``details["phases"]``:

* per rank, each phase's **median** over the recorded iterations (0 in an iteration without it);
* ``busiest_us``: the largest of those medians over ranks; ``mean_us``: their mean over ranks;
* ``share``: ``mean_us`` over the call's ``mean_us`` (the call: the median of each rank's call
  totals, busiest and mean alike). Phases tile each call (``other`` is the unnamed rest), so the
  shares add up to about 1 (medians of parts need not add up to the median of the whole exactly;
  ``sum_share`` says by how much).
"""
from __future__ import annotations

import statistics
from collections.abc import Sequence

from bench.timing import gc_paused


def record_steps(steps: Sequence[tuple], comm, iters: int, warmup: int = 1) -> list[dict]:
    """Run ``steps`` (``(name or None, fn)``, as :func:`bench.timing.time_phases` takes them) ``warmup``
    times unrecorded, then ``iters`` times with the phase recorder on; a barrier before each named
    step, the garbage collector paused. Collective. Returns this rank's iterations:
    ``[{step name: {"ops": [...], "engine": str, "total_ns": int, "phases": {name: ns}}}]`` (a named
    step in which no recorded call ran is left out)."""
    from deepep_ascend.ep import phases

    out = []
    with gc_paused():
        for it in range(warmup + iters):
            row = {}
            with phases.recording() as records:
                for name, fn in steps:
                    if name is None:
                        fn()
                        continue
                    comm.Barrier()
                    first = len(records)
                    fn()
                    mine = records[first:]
                    if mine:
                        merged: dict = {}
                        for rec in mine:
                            for ph, ns in rec.phases.items():
                                merged[ph] = merged.get(ph, 0) + ns
                        row[name] = {"ops": [r.op for r in mine], "engine": mine[0].engine,
                                     "total_ns": sum(r.total_ns for r in mine), "phases": merged}
            if it >= warmup:
                out.append(row)
    return out


def breakdown(per_rank: list[list[dict]]) -> dict:
    """The table of every op from every rank's :func:`record_steps` result (``per_rank[r]``): see the module
    doc. Returns ``{op: {"ops", "engine", "iterations", "ranks", "call": {"busiest_us", "mean_us"}, "phases":
    [{"phase", "busiest_us", "mean_us", "share"}, ...] (largest mean first), "sum_share"}}``."""
    out = {}
    names = list(dict.fromkeys(n for rows in per_rank for row in rows for n in row))
    for name in names:
        per = [[row[name] for row in rows if name in row] for rows in per_rank]
        per = [p for p in per if p]
        if not per:
            continue
        phase_names = list(dict.fromkeys(ph for p in per for it in p for ph in it["phases"]))
        totals = [statistics.median(it["total_ns"] for it in p) / 1e3 for p in per]
        call_mean = statistics.fmean(totals)
        rows = []
        for ph in phase_names:
            med = [statistics.median(it["phases"].get(ph, 0) for it in p) / 1e3 for p in per]
            mean = statistics.fmean(med)
            rows.append({"phase": ph, "busiest_us": max(med), "mean_us": mean,
                         "share": mean / call_mean if call_mean else None})
        rows.sort(key=lambda r: -r["mean_us"])
        out[name] = {"ops": per[0][0]["ops"], "engine": per[0][0]["engine"], "iterations": min(len(p) for p in per),
                     "ranks": len(per), "call": {"busiest_us": max(totals), "mean_us": call_mean}, "phases": rows,
                     "sum_share": sum(r["share"] or 0.0 for r in rows)}
    return out


def gather_breakdown(local: list[dict], comm) -> dict | None:
    """:func:`breakdown` of every rank's records, on rank 0 (None elsewhere). Collective."""
    per_rank = comm.gather(local, root=0)
    return breakdown(per_rank) if per_rank is not None else None


def breakdown_lines(table: dict, tag: str = "[phases]") -> list[str]:
    """The printed table: per op a header line, the call's row, then one row per phase (largest first)."""
    lines = []
    w = max([len(r["phase"]) for op in table.values() for r in op["phases"]] + [8])
    for name, op in table.items():
        ops = "+".join(dict.fromkeys(op["ops"]))
        lines.append(f"{tag} {name}: {ops} ({op['engine']}), median of {op['iterations']} recorded calls per rank, "
                     f"{op['ranks']} ranks | us busiest rank | us mean over ranks | share of the call")
        c = op["call"]
        lines.append(f"{tag}   {'call':<{w}} {c['busiest_us']:11.1f} {c['mean_us']:11.1f}   100.0%")
        for r in op["phases"]:
            share = f"{100 * r['share']:6.1f}%" if r["share"] is not None else "     -"
            lines.append(f"{tag}   {r['phase']:<{w}} {r['busiest_us']:11.1f} {r['mean_us']:11.1f}  {share}")
        lines.append(f"{tag}   {'(sum of phase medians)':<{w}} {'':11} {'':11}  {100 * op['sum_share']:6.1f}%")
    return lines

