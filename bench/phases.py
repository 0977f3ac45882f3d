"""``--phases``: where each microsecond of a call goes, per op, over ranks (``deepep_ascend.ep.phases``).

:func:`record_steps` runs a command's timed steps again, after its timed loop (so the headline
numbers are measured with the recorder off), with the library's phase recorder on; each named step
becomes one op of the breakdown, its phases the sum of the records of the calls made inside it (a
step makes one call: a dispatch, a combine, a receive hook). :func:`breakdown` turns every rank's
records into the table :func:`breakdown_lines` prints and the document keeps under
``details["phases"]``:

* per rank, the **median call** (the recorded call whose total is the median), whose phases tile it;
* ``busiest_us``: that call's phases on the busiest rank (the rank whose median call is the longest:
  the collective is as slow as it); ``mean_us``: the mean over ranks of each rank's median call;
* ``share``: ``mean_us`` over the call's ``mean_us``; the shares add up to 1 (the phases tile the call;
  ``other`` is the unnamed rest);
* ``median_us``: each phase's own median over the recorded calls, mean over ranks (how typical the
  median call's split is: on a noisy host single calls' spikes land in different phases).
"""
from __future__ import annotations

import statistics
from collections.abc import Iterator, Sequence

from bench.timing import each_step


def ops_of(per_rank: list[list[dict]]) -> Iterator[tuple[str, list[list[dict]]]]:
    """Each op any rank recorded (first seen first) with its records per rank, ranks without any left out."""
    for name in dict.fromkeys(n for rows in per_rank for row in rows for n in row):
        per = [p for p in ([row[name] for row in rows if name in row] for rows in per_rank) if p]
        if per:
            yield name, per


def median_call(calls: list[dict], key: str) -> dict:
    """The call whose ``key`` is the median (the lower middle of an even count)."""
    return sorted(calls, key=lambda c: c[key])[(len(calls) - 1) // 2]


def record_steps(steps: Sequence[tuple], comm, iters: int, warmup: int = 1) -> list[dict]:
    """Run ``steps`` (:func:`bench.timing.each_step`; after the timed loop, so ``warmup`` iterations and no timed
    warm-up) with the phase recorder on, keeping the ``iters`` measured iterations. Collective. Returns this rank's
    iterations: ``[{step name: {"ops": [...], "engine": str, "total_ns": int, "phases": {name: ns}}}]`` (a named
    step in which no recorded call ran is left out)."""
    from deepep_ascend.ep import phases

    def measure(fn):
        first = len(records)
        fn()
        mine = records[first:]
        if not mine:
            return None
        merged: dict = {}
        for rec in mine:
            for ph, ns in rec.phases.items():
                merged[ph] = merged.get(ph, 0) + ns
        return {"ops": [r.op for r in mine], "engine": mine[0].engine, "total_ns": sum(r.total_ns for r in mine),
                "phases": merged}

    with phases.recording() as records:
        return each_step(steps, comm, iters, warmup, measure, min_seconds=0)


def breakdown(per_rank: list[list[dict]]) -> dict:
    """The table of every op from every rank's :func:`record_steps` result (``per_rank[r]``): see the module
    doc. Returns ``{op: {"ops", "engine", "iterations", "ranks", "busiest_rank", "call": {"busiest_us",
    "mean_us", "median_us"}, "phases": [{"phase", "busiest_us", "mean_us", "share", "median_us"}, ...]
    (largest mean first)}}``."""
    out = {}
    for name, per in ops_of(per_rank):
        phase_names = list(dict.fromkeys(ph for p in per for it in p for ph in it["phases"]))
        mids = [median_call(p, "total_ns") for p in per]
        busiest = max(range(len(per)), key=lambda r: mids[r]["total_ns"])
        call_mean = statistics.fmean(m["total_ns"] for m in mids) / 1e3
        rows = []
        for ph in phase_names:
            mean = statistics.fmean(m["phases"].get(ph, 0) for m in mids) / 1e3
            rows.append({"phase": ph, "busiest_us": mids[busiest]["phases"].get(ph, 0) / 1e3, "mean_us": mean,
                         "share": mean / call_mean if call_mean else None,
                         "median_us": statistics.fmean(statistics.median(it["phases"].get(ph, 0) for it in p)
                                                       for p in per) / 1e3})
        rows.sort(key=lambda r: -r["mean_us"])
        out[name] = {"ops": per[0][0]["ops"], "engine": per[0][0]["engine"], "iterations": min(len(p) for p in per),
                     "ranks": len(per), "busiest_rank": busiest,
                     "call": {"busiest_us": mids[busiest]["total_ns"] / 1e3, "mean_us": call_mean,
                              "median_us": statistics.fmean(statistics.median(it["total_ns"] for it in p)
                                                            for p in per) / 1e3},
                     "phases": rows}
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
        lines.append(f"{tag} {name}: {ops} ({op['engine']}), each rank's median call of {op['iterations']}, "
                     f"{op['ranks']} ranks | us: busiest rank (rank {op['busiest_rank']}), mean over ranks, share | "
                     f"per-phase median over calls (mean over ranks)")
        c = op["call"]
        lines.append(f"{tag}   {'call':<{w}} {c['busiest_us']:11.1f} {c['mean_us']:11.1f}  100.0%  "
                     f"{c['median_us']:11.1f}")
        for r in op["phases"]:
            share = f"{100 * r['share']:5.1f}%" if r["share"] is not None else "     -"
            lines.append(f"{tag}   {r['phase']:<{w}} {r['busiest_us']:11.1f} {r['mean_us']:11.1f}  {share}  "
                         f"{r['median_us']:11.1f}")
    return lines
