"""``python -m bench mega-moe`` (the README's MegaMoE figures) run as a test, and the collector pause around
its timed iterations.
"""

from __future__ import annotations

import pytest

from tests.support.buffer_helpers import all_ranks_ok, coll
from tests.support.mpi_utils import up_to_four_ranks

pytestmark = [pytest.mark.mpi(min_size=1), pytest.mark.watchdog(240)]


@up_to_four_ranks()
def test_benchmark_reports_fused_serial_and_unfused_stages(comm, tmp_path):
    """``python -m bench mega-moe`` (the README's MegaMoE figures) on the ``tiny`` preset: the fused call
    equals the serial one and matches the unfused sequence (exit code 0), and the JSON holds the unfused
    stages and the serial call's own stage times from its trace, each positive, adding up to no more
    than the serial call took."""
    import json

    from bench import mega_moe as bench

    path = comm.bcast(str(tmp_path / "mega_moe.json"), root=0)
    rc = coll(bench.main, ["--preset", "tiny", "--iters", "1", "--warmup", "1", "--warmup-s", "0", "--threads", "1",
                          "--json", path],
              what="bench mega-moe")
    ok = rc == 0
    if comm.rank == 0:
        t = json.load(open(path))["details"]["times_s"]
        stages, own = t["stages"], t["serial_call_stages"]
        ok = ok and set(stages) == {"dispatch", "l1", "act", "l2", "combine", "shared"}
        ok = ok and {"dispatch", "l1", "act", "l2", "combine", "shared", "reduce"} <= set(own)
        ok = ok and all(v > 0 for v in list(stages.values()) + list(own.values()))
        ok = ok and sum(own.values()) <= t["serial"] * 1.05 + 1e-3
        ok = ok and json.load(open(path))["details"]["gc"]["full_collection_ms"] > 0
    all_ranks_ok(comm, ok, "bench mega-moe ran, checked its outputs and reported both stage lists")


def test_benchmark_pauses_the_collector_and_restores_it():
    """``bench.timing.gc_paused`` (around the timed iterations of ``bench mega-moe`` and ``time_phases``):
    the collector is off inside, collects nothing there, and comes back as it was, after an exception too."""
    import gc

    from bench import timing as C

    assert gc.isenabled()
    with pytest.raises(RuntimeError, match="inside"):
        with C.gc_paused():
            assert not gc.isenabled()
            before = gc.get_count()[0]
            cycles = []
            for _ in range(5 * gc.get_threshold()[0]):  # would trigger collections with the collector on
                a = []
                a.append(a)
                cycles.append(a)
            assert gc.get_count()[0] > before  # nothing reset the generation-0 count
            raise RuntimeError("inside")
    assert gc.isenabled()
    gc.disable()
    try:
        with C.gc_paused():
            pass
        assert not gc.isenabled()  # left off as found
    finally:
        gc.enable()
