"""Lifetime: destroy, closed/busy states, no leaked shared segments (docs/design/transports.md §2.4, §3.5, §8).

The nested-launch tests run only in the 1-rank job: they start their own
``mpiexec -n 2`` children (environment scrubbed of the parent's PMI/Hydra variables) and
attribute ``/dev/shm`` files to the child through its ``/proc/self/maps``, because other jobs on
the machine create (and, when killed, leak) ``mpich_shm_*`` files at the same time.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import math
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import pytest
import torch
from mpi4py import MPI

from deepep_ascend.settings import TIMEOUT_S
from deepep_ascend.transports import (
    State,
    TransportBusy,
    TransportClosed,
    WaitPolicy,
    resolve_timeout,
)
from deepep_ascend.transports import ubmem as ubmem_mod
from tests.support import REPO_ROOT
from tests.support.mpi_utils import run_child_job, up_to_four_ranks, world
from tests.transports.helpers import (
    destroy_quietly,
    make_transport,
    pattern,
    proc_shm_mappings,
)

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = REPO_ROOT
SHM = "/dev/shm"


# ---------------------------------------------------------------------------------------------
# timeouts and wait policy


def test_resolve_timeout(monkeypatch):
    monkeypatch.delenv(TIMEOUT_S.name, raising=False)
    assert resolve_timeout(None) == TIMEOUT_S.default == 100.0
    assert resolve_timeout(2.5) == 2.5
    monkeypatch.setenv(TIMEOUT_S.name, "7.5")
    assert resolve_timeout(None) == 7.5
    assert resolve_timeout(3) == 3.0  # the argument wins
    assert resolve_timeout(np.int64(4)) == 4.0 and resolve_timeout(np.float32(0.5)) == 0.5  # numpy's reals too
    for bad in (0, -1.0, "5", True, math.inf, math.nan):
        with pytest.raises(ValueError, match="positive, finite"):
            resolve_timeout(bad)
    monkeypatch.setenv(TIMEOUT_S.name, "soon")
    with pytest.raises(ValueError, match=TIMEOUT_S.name):
        resolve_timeout(None)


@pytest.mark.mpi(min_size=1)
def test_transport_timeout_from_environment(monkeypatch):
    monkeypatch.setenv(TIMEOUT_S.name, "7.5")
    tp = ubmem_mod.UbmemTransport(MPI.COMM_WORLD)
    try:
        assert tp.timeout_s == 7.5
        n = tp.topology.world_size
        assert tp.wait_policy.oversubscribed == (n > len(os.sched_getaffinity(0)))  # all ranks on this host
    finally:
        destroy_quietly(tp)


def test_wait_policy_pauses(monkeypatch):
    import deepep_ascend.transports.base as base

    yields = []
    monkeypatch.setattr(base.os, "sched_yield", lambda: yields.append(time.monotonic()))
    over = WaitPolicy(local_ranks=10 ** 6)
    assert over.oversubscribed
    it = over.pauses()
    t0 = time.monotonic()
    zeros = 0
    while (p := next(it)) == 0.0:  # never spins: each immediate poll follows a yield, for at most 1 ms
        zeros += 1
        assert len(yields) == zeros
    assert zeros >= 1 and yields[-1] - t0 < 1e-3 + 0.05  # (slack for a descheduled test process)
    sleeps = [p] + [next(it) for _ in range(9)]
    assert sleeps[:3] == [50e-6, 100e-6, 200e-6] and max(sleeps) == 200e-6  # doubling to a cap of 200 µs
    assert all(p > 0 for p in sleeps) and len(yields) == zeros
    calm = WaitPolicy(local_ranks=1)
    if not calm.oversubscribed:
        it = calm.pauses()
        assert [next(it) for _ in range(200)] == [0.0] * 200  # spins first


# ---------------------------------------------------------------------------------------------
# destroy


@pytest.mark.mpi(min_size=1)
def test_double_destroy_and_closed_ops(tp):
    me, n = tp.topology.rank, tp.topology.world_size
    win = tp.create_window("closed", 4096, 1)
    tp.destroy()
    assert tp.state is State.CLOSED
    tp.destroy()  # idempotent
    tp.destroy(force=True)
    peer = (me + 1) % n
    for op in [
        lambda: tp.put(win, peer, 0, torch.zeros(4, dtype=torch.uint8)),
        lambda: tp.get(win, peer, 0, torch.zeros(4, dtype=torch.uint8)),
        lambda: tp.signal(win, peer, 0),
        lambda: tp.put_with_signal(win, peer, 0, torch.zeros(4, dtype=torch.uint8), 0),
        lambda: tp.wait_until(win, 0, [peer], 1),
        lambda: tp.barrier(),
        lambda: tp.peer_view(win, peer, 0, 4),
        lambda: tp.local_view(win, 0, 4),
        lambda: tp.flush(),
        lambda: tp.create_window("again", 64, 1),
    ]:
        with pytest.raises(TransportClosed):
            op()
    tp.abort("after destroy")  # documented as never raising


@pytest.mark.mpi(min_size=1)
def test_closed_transport_refuses_every_op(tp):
    win = tp.create_window("closed2", 0, 1)
    tp.destroy()
    failures = []
    for name, op in [("read_signal", lambda: tp.read_signal(win, 0, 0)),
                     ("check_abort", tp.check_abort), ("fence", tp.fence),
                     ("traffic_counter_addresses", tp.traffic_counter_addresses)]:
        try:
            op()
            failures.append(f"{name}: no error")
        except TransportClosed:
            pass
        except Exception as exc:  # noqa: BLE001
            failures.append(f"{name}: {type(exc).__name__}: {exc}")
    assert not failures, failures


def _busy_destroy(tp):
    """destroy() while the caller holds a view; returns the TransportBusy, else fails.

    The view is deliberately not an argument: pytest's traceback repr shows every frame's
    arguments, and repr() of a view whose window was freed segfaults.
    """
    try:
        tp.destroy()
    except TransportBusy as exc:
        return exc
    # The window was freed under the view: never touch it (the mapping is gone).
    pytest.fail("destroy() freed the windows while a tensor view was alive (TransportBusy expected)")


@pytest.mark.mpi(min_size=1)
def test_live_view_makes_destroy_busy_everywhere(tp):
    me = tp.topology.rank
    win = tp.create_window("busy", 4096, 1)
    view = tp.local_view(win, 0, 16)
    view.fill_(me + 1)
    exc = _busy_destroy(tp)
    assert f"rank {me}" in str(exc)
    assert tp.state is State.OPEN  # still usable
    assert bool((view == me + 1).all())  # the view is still valid
    tp.barrier()
    del view
    tp.destroy()
    assert tp.state is State.CLOSED


@pytest.mark.mpi(min_size=2)
def test_view_on_one_rank_makes_destroy_busy_on_all(tp):
    me = tp.topology.rank
    win = tp.create_window("busy1", 4096, 1)
    view = tp.peer_view(win, 1, 0, 16) if me == 0 else None
    if me == 0:
        _busy_destroy(tp)
        del view
    else:
        with pytest.raises(TransportBusy):
            tp.destroy()
    tp.destroy()
    assert tp.state is State.CLOSED


@pytest.mark.mpi(min_size=1)
def test_destroy_force_ignores_views(tp):
    win = tp.create_window("force", 4096, 1)
    view = tp.local_view(win, 0, 16)
    tp.destroy(force=True)
    assert tp.state is State.CLOSED
    del view  # dangling now: dropped without being touched


@pytest.mark.mpi(min_size=1)
def test_destroy_collects_garbage_at_most_once(monkeypatch):
    calls = []
    real = gc.collect
    monkeypatch.setattr(ubmem_mod.gc, "collect", lambda *a: calls.append(1) or real(*a))
    tp = make_transport()
    try:
        for i in range(3):
            tp.create_window(f"gc{i}", 4096, 1)
    finally:
        destroy_quietly(tp)
    assert len(calls) <= 1, f"destroy() called gc.collect() {len(calls)} times"


# ---------------------------------------------------------------------------------------------
# no leaked segments


def _shm_listing() -> set:
    return set(os.listdir(SHM))


def _undeleted(maps) -> set:
    return {m for m in maps if not m.endswith("(deleted)")}


@pytest.mark.mpi(min_size=1)
@up_to_four_ranks()
def test_create_destroy_cycles_leave_nothing():
    comm = MPI.COMM_WORLD
    me, n = comm.Get_rank(), comm.Get_size()
    comm.Barrier()
    before = _shm_listing()
    named_before = _undeleted(proc_shm_mappings())  # MPICH's own per-node segment(s)
    windows_mapped_before = sum("mpich_shar" in m for m in proc_shm_mappings())
    for cycle in range(8):  # (each cycle's checks are the same; more cycles only add suite time)
        tp = make_transport()
        try:
            win = tp.create_window(f"cycle{cycle}", 1 << 20, 4)
            tp.local_view(win, 0, 1 << 20).fill_(cycle)  # touch every page
            tp.put(win, (me + 1) % n, 0, pattern(4096, cycle))
            tp.signal(win, (me + 1) % n, 3)
            tp.barrier()
            # The windows' backing files are already unlinked: nothing named beyond MPICH's own.
            extra = _undeleted(proc_shm_mappings()) - named_before
            assert not extra, f"cycle {cycle}: named shared-memory files mapped: {sorted(extra)}"
        finally:
            destroy_quietly(tp)
        assert tp.state is State.CLOSED
    assert sum("mpich_shar" in m for m in proc_shm_mappings()) == windows_mapped_before, \
        "window mappings survive destroy()"
    comm.Barrier()
    new = {f for f in _shm_listing() - before if not f.startswith("mpich_shm_")}  # other jobs' MPI_Init
    if new:
        time.sleep(1.0)  # another job's window file exists only until all its ranks mapped it
        new &= _shm_listing()
    assert not new, f"new files in {SHM}: {sorted(new)}"


# ---------------------------------------------------------------------------------------------
# nested jobs (1-rank run only)

one_rank_only = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1,
                                   reason="launches its own mpiexec; runs in the 1-rank job only")


def _run(args, timeout_s=120.0, **extra_env):
    """Run ``mpiexec -n 2 <args>`` in its own session; kill the whole group on timeout."""
    return run_child_job(2, args, REPO, timeout_s, **extra_env)


def _read_reports(report_dir: str) -> list:
    """``(rank, key, value)`` lines the child ranks wrote to ``report_dir``."""
    lines = []
    for name in sorted(os.listdir(report_dir)):
        with open(os.path.join(report_dir, name)) as f:
            for line in f:
                rank, key, value = line.rstrip("\n").split(" ", 2)
                lines.append((int(rank), key, value))
    return lines


def _run_nested_job(mode: str, timeout_s=120.0):
    report = tempfile.mkdtemp(prefix=f"nested_{mode}_")
    try:
        rc, out = _run([sys.executable, os.path.join(HERE, "nested_job.py"), mode], timeout_s=timeout_s,
                       DEEPEP_ASCEND_NESTED_REPORT=report)
        return rc, out, _read_reports(report)
    finally:
        shutil.rmtree(report, ignore_errors=True)


def _mapped_names(lines) -> set:
    names = set()
    for _, key, value in lines:
        if key == "MAPS":
            names |= {m.replace(" (deleted)", "") for m in json.loads(value.split(" ", 1)[1])}
    return names


def _left_behind(names) -> list:
    return sorted(nm for nm in names if os.path.exists(os.path.join(SHM, nm)))


@one_rank_only
def test_nested_job_leaves_no_segment():
    """Transport A destroyed explicitly, transport B forgotten (atexit hook), normal exit: nothing left."""
    rc, out, lines = _run_nested_job("lifetimes")
    assert rc == 0, out[-3000:]
    names = _mapped_names(lines)
    assert any(nm.startswith("mpich_shar") for nm in names), out[-3000:]  # the windows were seen
    assert sorted((r, v) for r, k, v in lines if k == "STATE-A") == [(0, "CLOSED"), (1, "CLOSED")], out[-3000:]
    assert sorted((r, v) for r, k, v in lines if k == "STATE") == [(0, "CLOSED"), (1, "CLOSED")], \
        "the atexit hook did not destroy the forgotten transport:\n" + out[-3000:]
    assert _left_behind(names) == [], out[-3000:]


@functools.cache
def _harness_child():
    report = tempfile.mkdtemp(prefix="nested_harness_")
    try:
        rc, out = _run([sys.executable, "-m", "pytest", "--with-mpi", "-q", "-p", "no:cacheprovider",
                        os.path.join(HERE, "nested_harness_case.py")],
                       DEEPEP_ASCEND_NESTED_REPORT=report)
        names = set()
        for r in range(2):
            path = os.path.join(report, f"rank{r}.json")
            if os.path.exists(path):
                with open(path) as f:
                    names |= {m.replace(" (deleted)", "") for m in json.load(f)}
        left = _left_behind(names)
        for nm in left:  # recorded for the assertions; do not let this suite add to the leak
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM, nm))
        return rc, out, names, left
    finally:
        shutil.rmtree(report, ignore_errors=True)


@one_rank_only
def test_harness_exit_leaves_no_window_segment():
    rc, out, names, left = _harness_child()
    assert rc == 0 and "1 passed" in out, out[-3000:]
    assert any(nm.startswith("mpich_shar") for nm in names), (names, out[-3000:])
    assert [nm for nm in left if not nm.startswith("mpich_shm_")] == [], left


@one_rank_only
def test_harness_exit_leaves_no_mpich_segment():
    rc, out, _, left = _harness_child()
    assert rc == 0, out[-3000:]
    assert left == [], left


@one_rank_only
def test_late_destroy_does_not_hang():
    _, out, lines = _run_nested_job("late", timeout_s=90)
    assert [(r, v) for r, k, v in lines if k == "EARLY"] == [(0, "timeout")], out[-3000:]
    late = [v for r, k, v in lines if k == "LATE-DONE"]
    assert late, "the late rank never returned from destroy():\n" + out[-3000:]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("lateness", [0.1, 0.7], ids=["early", "near_the_deadline"])
def test_destroy_frees_only_when_every_rank_arrived_well_before_the_deadline(lateness):
    """``destroy(timeout_s=2)`` with the last rank arriving ``lateness`` of the deadline after the others: early, every
    rank frees the windows; within a second of the deadline, every rank abandons them (no collective free, nothing
    raised). A rank that gave up meanwhile would have left its contribution to the reduction behind, and a peer
    completing against it must not enter a collective free that rank never joins (the job would hang at exit)."""
    comm = world()
    r, R = comm.Get_rank(), comm.Get_size()
    tp = make_transport()
    tp.create_window("w", 4096, 1)
    comm.Barrier()
    if r == R - 1:
        time.sleep(2.0 * lateness)
    t0 = time.monotonic()
    tp.destroy(timeout_s=2.0)
    took = time.monotonic() - t0
    states = comm.allgather((tp.state.name, tp.abandoned))
    want = ("CLOSED", lateness > 0.5)
    assert all(s == want for s in states) and took < 2.0, (states, took)


@pytest.mark.mpi(min_size=1)
def test_exit_hook_destroys_forgotten_transports_in_the_same_order_everywhere(monkeypatch):
    """The atexit hook frees forgotten transports newest first by creation serial, identical on
    every rank (a WeakSet's own order differs between processes, and mismatched collective frees
    of two transports hung jobs at exit); a transport whose owner set ``exit_departed`` gets the
    tolerant teardown with the ranks it returns, the others the plain one."""
    from deepep_ascend.transports import ubmem

    a, b = make_transport(), make_transport()
    b.exit_departed = lambda: [0]
    order, given = [], []
    for tp in (a, b):
        monkeypatch.setattr(tp, "destroy", lambda force=False, timeout_s=None, departed=None, tp=tp:
                            (order.append(tp._serial), given.append(departed)))
    live = [tp for tp in ubmem._LIVE if tp not in (a, b)]
    for tp in live:  # other tests' transports are not this test's to free
        ubmem._LIVE.discard(tp)
    try:
        ubmem._destroy_forgotten_transports()
    finally:
        for tp in live:
            ubmem._LIVE.add(tp)
    monkeypatch.undo()
    everyone = world().allgather([s - a._serial for s in order])
    destroy_quietly(b)
    destroy_quietly(a)
    assert order == [b._serial, a._serial] and all(o == everyone[0] for o in everyone), everyone
    assert given == [[0], None], given
