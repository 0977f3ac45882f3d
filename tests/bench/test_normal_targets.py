"""`python -m bench normal`'s verdicts follow the targets of the workload it ran: the medium call's 5x at every rank
count at 1024 tokens x hidden 2048, top-8 of 64 experts; the main job's elsewhere."""
from types import SimpleNamespace

import pytest

from bench.normal import MEDIUM_CALL, summarize
from bench.timing import Timing


def _results(library_s: float, peer_s: float) -> dict:
    return {name: SimpleNamespace(timings={"round_trip": Timing([t])})
            for name, t in (("deepep_ascend", library_s), ("mpi_alltoallv", peer_s))}


@pytest.mark.parametrize(("ranks", "shape", "want"), [
    (8, MEDIUM_CALL, 5.0), (4, MEDIUM_CALL, 5.0), (2, MEDIUM_CALL, 5.0),
    (8, (4096, 7168, 8, 256), 3.0), (4, (512, 2048, 8, 64), 3.0), (2, (4096, 7168, 8, 256), 5.0),
    (3, MEDIUM_CALL, None), (8, None, 3.0),
])
def test_the_speedup_verdict_uses_the_workloads_target(ranks, shape, want):
    s = summarize(_results(1.0, 4.0), None, ranks, shape=shape)  # 4x the library: between the two targets
    assert s["speedup_over_faster_peer"] == pytest.approx(4.0)
    assert s.get("speedup_target") == want
    verdict = [line for line in s["lines"] if "speedup over the faster peer" in line][0]
    if want is None:
        assert "target" not in verdict and "speedup_target_met" not in s
    else:
        assert s["speedup_target_met"] is (4.0 >= want)
        assert f"target >= {want:g}x at {ranks} ranks: {'met' if 4.0 >= want else 'MISSED'}" in verdict
