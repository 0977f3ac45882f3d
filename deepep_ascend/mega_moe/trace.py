"""The timeline of one MegaMoE call: :class:`MegaMoETrace`, left in ``sym_buffer.last_trace``
(docs/semantics/mega-moe.md §5)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class MegaMoETrace:
    """Timeline of one call (``time.perf_counter`` seconds).

    ``compute``: ``(stage, wave, start, end)`` on the caller (stages ``l1``, ``act``, ``l2``,
    ``shared``, ``reduce``); ``comm``: ``(op, wave, issue_start, issue_end, worker_start,
    worker_end)``: the caller-side part of each Buffer call (validation, the counts round, and in
    ``overlap=False`` everything) and the worker-side part (data movement; ``worker_*`` equal
    ``issue_end`` when synchronous).
    """

    overlap_mode: bool
    num_waves: int
    experts_per_wave: int
    start: float = 0.0
    backend: str = ""
    end: float = 0.0
    compute: list = field(default_factory=list)
    comm: list = field(default_factory=list)

    def stage_times(self) -> dict:
        """Seconds per stage: ``dispatch``/``combine`` (caller part + worker part), ``l1``, ``act``, ``l2``, ..."""
        out: dict = {}
        for stage, _w, s, e in self.compute:
            out[stage] = out.get(stage, 0.0) + e - s
        for op, _w, s0, e0, s1, e1 in self.comm:
            out[op] = out.get(op, 0.0) + (e0 - s0) + (e1 - s1)
        return out

    def overlap(self) -> dict:
        """``worker_busy`` (s), ``hidden`` (worker time under caller compute, s), ``fraction`` = hidden / busy,
        ``compute`` (s), ``total`` (s)."""
        busy = _union([(c[4], c[5]) for c in self.comm if c[5] > c[4]])
        comp = _union([(s, e) for _st, _w, s, e in self.compute])
        hidden = _intersection(busy, comp)
        b = sum(e - s for s, e in busy)
        return dict(worker_busy=b, hidden=hidden, fraction=hidden / b if b > 0 else 0.0,
                    compute=sum(e - s for s, e in comp), total=self.end - self.start)


def _union(intervals):
    out = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [tuple(x) for x in out]


def _intersection(a, b) -> float:
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total

