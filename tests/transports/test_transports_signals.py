"""Signals, waits, timeouts, abort and barrier (docs/design/transports.md §2.2, §2.3, §3.3, §8).

Failure tests leave the transport POISONED on some ranks and rely on the ``tp`` fixture's
teardown: ``destroy`` must then agree on every rank to skip the collective frees, without
hanging.
"""

from __future__ import annotations

import ctypes
import time

import numpy as np
import pytest
import torch

from deepep_ascend.transports import (
    ChannelKind,
    State,
    Team,
    TransportAborted,
    TransportArgumentError,
    TransportError,
    TransportPoisoned,
    TransportTimeout,
    TransportUnsupported,
)
from tests.transports.helpers import pattern

# Generous bounds for timeouts (2 cores, up to 8 ranks, other jobs on the machine).
SLACK_S = 3.0


# ---------------------------------------------------------------------------------------------
# signal counts


@pytest.mark.mpi(min_size=1)
def test_signal_counts_and_reuse_without_reset(shared_tp):
    tp = shared_tp
    n = tp.topology.world_size
    win = tp.create_window("sig", 0, 4)
    SLOT, K = 2, 5
    adds = [1, 1, 3]  # round r adds adds[r] per signal: values keep growing, never reset
    total = 0
    for r, add in enumerate(adds):
        for p in range(n):
            for j in range(K):
                value = tp.signal(win, p, SLOT, add=add, ordered=(j % 2 == 0))
                assert value == total + (j + 1) * add  # the writer's running value for (slot, p)
        total += K * add
        assert tp.wait_until(win, SLOT, list(range(n)), total, phase=f"round {r}") == []
        got = [tp.read_signal(win, SLOT, s) for s in range(n)]
        assert got == [total] * n, f"round {r}: slot[{SLOT}][src] = {got}, expected {total} from every rank"
        assert [int(x) for x in win.signals(SLOT)] == got
        tp.barrier()  # nobody starts the next round before everyone checked exact values
    for other in (0, 1, 3):  # slots nobody signalled stay zero
        assert [tp.read_signal(win, other, s) for s in range(n)] == [0] * n


@pytest.mark.mpi(min_size=1)
def test_signals_by_stores_at_their_addresses(shared_tp):
    """A rank storing its running value at ``signal_address`` of each node peer signals as ``signal()`` does:
    ``wait_until`` sees it, ``signal_words_address`` loads the same words as ``signals()``, and the counters count
    what ``record_signal`` records. A URMA peer has no address."""
    tp = shared_tp
    me, n = tp.topology.rank, tp.topology.world_size
    win = tp.create_window("stores", 0, 2)
    direct = [p for p in range(n) if tp.channel_kind(win, p) is not ChannelKind.URMA]
    before = tp.stats.snapshot()["signals"].copy()
    for value in (3, 8):
        tp.fence()
        for p in direct:
            ctypes.c_int64.from_address(tp.signal_address(win, p, 1)).value = value
            tp.record_signal(p)
        assert tp.wait_until(win, 1, direct, value, phase="stored signals") == []
        words = np.ctypeslib.as_array((ctypes.c_int64 * n).from_address(tp.signal_words_address(win, 1)))
        assert words.tolist() == win.signals(1).tolist()
        assert [int(words[p]) for p in direct] == [value] * len(direct)
        tp.barrier()
    counted = tp.stats.snapshot()["signals"] - before
    assert counted.sum() == 2 * len(direct) and all(counted[:, p].sum() == 2 for p in direct)
    assert win.signals(0).tolist() == [0] * n  # another slot: untouched
    for p in set(range(n)) - set(direct):
        with pytest.raises(TransportUnsupported):
            tp.signal_address(win, p, 1)
    with pytest.raises(TransportArgumentError):
        tp.signal_address(win, me, 2)
    with pytest.raises(TransportArgumentError):
        tp.signal_words_address(win, -1)
    for bad in (-1, n, "a", True):  # the counters' peer: a rank of the world
        for record in (tp.record_signal, lambda p: tp.record_put(p, 8), lambda p: tp.record_fetch(p, 8)):
            with pytest.raises(TransportArgumentError):
                record(bad)
    tp.barrier()


@pytest.mark.mpi(min_size=1)
def test_counting_at_the_counter_addresses_is_recording(shared_tp):
    """Adding at ``traffic_counter_addresses()`` changes the counters exactly as ``record_put`` / ``record_signal``
    of the same peers do: the cell of each peer's channel kind, in the same snapshot fields."""
    tp = shared_tp
    n = tp.topology.world_size
    bytes_put, puts, signals = tp.traffic_counter_addresses()
    assert bytes_put.shape == puts.shape == signals.shape == (n,) and bytes_put.dtype == np.int64
    start = tp.stats.snapshot()
    for p in range(n):
        tp.record_put(p, 100 + p)
        tp.record_signal(p)
    recorded = tp.stats.diff(tp.stats.snapshot(), start)
    start = tp.stats.snapshot()
    for p in range(n):
        ctypes.c_int64.from_address(int(bytes_put[p])).value += 100 + p
        ctypes.c_int64.from_address(int(puts[p])).value += 1
        ctypes.c_int64.from_address(int(signals[p])).value += 1
    stored = tp.stats.diff(tp.stats.snapshot(), start)
    for field in ("bytes_put", "puts", "signals", "bytes_fetched", "gets"):
        assert np.array_equal(recorded[field], stored[field]), field
    assert int(recorded["bytes_put"].sum()) == sum(100 + p for p in range(n))


@pytest.mark.mpi(min_size=2)
def test_quiet_waits_have_a_deadline(comm):
    """The waits of collective constructors (``quiet_wait``, under ``quiet_barrier`` and ``quiet_allgather_object``)
    have a deadline: rank 0 waits for a message rank 1 sends only after it, and gets a ``TransportTimeout`` naming
    rank 1 and the phase; the message then completes the request."""
    from mpi4py import MPI

    from deepep_ascend.transports.base import quiet_wait
    me = comm.Get_rank()
    box = np.zeros(1, dtype=np.int64)
    if me == 0:
        req = comm.Irecv(box, source=1, tag=77)
        t0 = time.monotonic()
        with pytest.raises(TransportTimeout) as ei:
            quiet_wait([req], comm.Get_size(), 0.3, "a test's wait", me, [1])
        waited = time.monotonic() - t0
        msg = str(ei.value)
        comm.send(None, dest=1, tag=78)  # now rank 1 may send
        req.Wait()
        assert 0.3 <= waited <= 0.3 + SLACK_S and box[0] == 42
        assert "rank(s) [1]" in msg and "a test's wait" in msg, msg
    elif me == 1:
        comm.recv(source=0, tag=78)
        comm.Send(np.array([42], dtype=np.int64), dest=0, tag=77)
    MPI.COMM_WORLD.Barrier()


@pytest.mark.mpi(min_size=1)
def test_wait_until_per_source_values(shared_tp):
    tp = shared_tp
    me, n = tp.topology.rank, tp.topology.world_size
    win = tp.create_window("persrc", 0, 1)
    for p in range(n):  # rank s sends s+1 increments to everyone
        for _ in range(me + 1):
            tp.signal(win, p, 0)
    assert tp.wait_until(win, 0, list(range(n)), [s + 1 for s in range(n)]) == []
    assert tp.wait_until(win, 0, [], []) == []  # nothing to wait for
    tp.barrier()


# ---------------------------------------------------------------------------------------------
# wait_until timeouts


def _withholding_setup(tp, withhold):
    """Every rank not in ``withhold`` signals slot 0 of every other rank."""
    me, n = tp.topology.rank, tp.topology.world_size
    win = tp.create_window("timeout", 4096, 1)
    if me not in withhold:
        for p in range(n):
            if p != me:
                tp.signal(win, p, 0)
    return win, [p for p in range(n) if p != me]


def _assert_poisoned(tp, win):
    me, n = tp.topology.rank, tp.topology.world_size
    assert tp.state is State.POISONED
    peer = (me + 1) % n
    for name, op in [
        ("put", lambda: tp.put(win, peer, 0, torch.zeros(4, dtype=torch.uint8))),
        ("get", lambda: tp.get(win, peer, 0, torch.zeros(4, dtype=torch.uint8))),
        ("signal", lambda: tp.signal(win, peer, 0)),
        ("put", lambda: tp.put_with_signal(win, peer, 0, torch.zeros(4, dtype=torch.uint8), 0)),
        ("wait_until", lambda: tp.wait_until(win, 0, [peer], 0)),
        ("barrier", lambda: tp.barrier(timeout_s=1)),
        ("peer_view", lambda: tp.peer_view(win, peer, 0, 4)),
        ("view", lambda: tp.local_view(win, 0, 4)),
        ("flush", lambda: tp.flush(peer)),
    ]:
        with pytest.raises(TransportPoisoned) as ei:
            op()
        assert name in str(ei.value), (name, str(ei.value))


@pytest.mark.mpi(min_size=2)
def test_wait_until_timeout_names_the_missing_rank(tp):
    me = tp.topology.rank
    win, others = _withholding_setup(tp, withhold={0})
    if me == 0:
        assert tp.wait_until(win, 0, others, 1) == []  # everyone else did signal rank 0
        assert tp.state is State.OPEN
        return
    t0 = time.monotonic()
    with pytest.raises(TransportTimeout) as ei:
        tp.wait_until(win, 0, others, 1, timeout_s=1.0, phase="withheld-phase")
    elapsed = time.monotonic() - t0
    e = ei.value
    assert isinstance(e, TimeoutError) and isinstance(e, TransportError)
    assert 1.0 <= elapsed <= 1.0 + SLACK_S, elapsed
    assert e.elapsed >= 1.0
    assert (e.op, e.rank, e.pending_peers, e.slot, e.expected, e.observed, e.phase) == \
        ("wait_until", me, [0], 0, [1], [0], "withheld-phase")
    msg = str(e)
    for part in (f"rank {me}:", "wait_until", "slot 0", "withheld-phase", "[0]", "rank 0: have 0, need 1"):
        assert part in msg, (part, msg)
    _assert_poisoned(tp, win)
    with pytest.raises(TransportPoisoned, match="timed out"):  # the reason names the first failure
        tp.signal(win, 0, 0)


@pytest.mark.mpi(min_size=2)
def test_wait_until_timeout_return_mode(tp):
    me, n = tp.topology.rank, tp.topology.world_size
    withhold = {0, n - 1}
    win, others = _withholding_setup(tp, withhold)
    t0 = time.monotonic()
    pending = tp.wait_until(win, 0, others, 1, timeout_s=0.5, on_timeout="return")
    assert time.monotonic() - t0 <= 0.5 + SLACK_S
    assert pending == sorted(withhold - {me}), pending
    assert tp.state is State.OPEN  # "return" mode does not poison
    tp.barrier()  # everyone has seen the gap before the late ranks fill it
    # The late ranks signal now; everyone completes and the transport is still fine.
    if me in withhold:
        for p in others:
            tp.signal(win, p, 0)
    assert tp.wait_until(win, 0, others, 1) == []
    tp.barrier()


@pytest.mark.mpi(min_size=2)
def test_destroy_after_timeout_on_every_rank(tp):
    """Some ranks POISONED, rank 0 not: destroy agrees to skip the frees everywhere, then CLOSED."""
    me = tp.topology.rank
    win, others = _withholding_setup(tp, withhold={0})
    if me != 0:
        with pytest.raises(TransportTimeout):
            tp.wait_until(win, 0, others, 1, timeout_s=0.5)
    t0 = time.monotonic()
    tp.destroy()
    assert time.monotonic() - t0 < 5.0 + SLACK_S
    assert tp.state is State.CLOSED
    tp.destroy()  # idempotent


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("failure", ["timeout", "abort"])
def test_destroy_inside_failure_handler(tp, failure):
    me = tp.topology.rank
    win, others = _withholding_setup(tp, withhold={0})
    if me == 0:
        if failure == "abort":
            time.sleep(0.3)
            tp.abort("injected")
        tp.destroy()
    else:
        try:
            if failure == "timeout":
                tp.wait_until(win, 0, others, 1, timeout_s=0.5)
            else:
                tp.barrier(timeout_s=30)
        except (TransportTimeout, TransportAborted):
            tp.destroy()  # the usual clean-up-then-re-raise pattern
    assert tp.state is State.CLOSED


# ---------------------------------------------------------------------------------------------
# abort


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("where", ["wait_until", "barrier"])
@pytest.mark.parametrize("aborter", ["first", "last"])
def test_abort_wakes_waiting_peers(tp, where, aborter):
    me, n = tp.topology.rank, tp.topology.world_size
    bad = 0 if aborter == "first" else n - 1
    reason = f"injected failure on rank {bad} (ünïcode ✓)"
    win = tp.create_window("abort", 0, 1)
    if me == bad:
        time.sleep(0.3)  # let the others block first
        tp.abort(reason)
        assert tp.state is State.POISONED
        with pytest.raises(TransportPoisoned):
            tp.barrier(timeout_s=1)
        return
    t0 = time.monotonic()
    with pytest.raises(TransportAborted) as ei:
        if where == "wait_until":
            tp.wait_until(win, 0, [bad], 1, timeout_s=60, phase="abort-test")
        else:
            tp.barrier(timeout_s=60)
    assert time.monotonic() - t0 < 10.0  # far below the 60 s timeout
    e = ei.value
    assert (e.peer, e.rank, e.reason) == (bad, me, reason), (e.peer, e.rank, e.reason)
    assert where in e.op
    assert reason in str(e) and f"peer rank {bad}" in str(e)
    assert tp.state is State.POISONED
    with pytest.raises(TransportPoisoned):
        tp.signal(win, bad, 0)


# ---------------------------------------------------------------------------------------------
# barrier


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("team", [Team.WORLD, Team.NODE, Team.RAIL])
def test_barrier_generations(shared_tp, team):
    """100 generations; each one publishes a value that the next rank of the team must see."""
    tp = shared_tp
    me = tp.topology.rank
    members = tp.team_ranks(team)
    assert me in members
    i = members.index(me)
    nxt, prv = members[(i + 1) % len(members)], members[(i - 1) % len(members)]
    win = tp.create_window("gen", 64, 1)
    for g in range(1, 101):
        buf = (g % 2) * 8  # parity buffers: a write of g+2 cannot land before the check of g
        tp.put(win, nxt, buf, torch.tensor([g * 1000 + me], dtype=torch.int64))
        tp.barrier(team)
        got = int(tp.local_view(win, buf, 8, torch.int64)[0])
        assert got == g * 1000 + prv, f"generation {g}: got {got} from rank {prv}"


@pytest.mark.mpi(min_size=2)
def test_barrier_waits_for_late_rank(shared_tp):
    tp = shared_tp
    me, n = tp.topology.rank, tp.topology.world_size
    late = n - 1
    win = tp.create_window("late", 8 * n, 1)
    tp.barrier()
    for rnd in range(2):
        marker = torch.tensor([rnd * 7919 + 1], dtype=torch.int64)
        arrive = leave = None
        if me == late:
            time.sleep(0.3)
            for p in range(n):  # what the late rank stores just before arriving ...
                tp.put(win, p, 8 * late, marker)
            arrive = time.monotonic()
        tp.barrier()
        leave = time.monotonic()
        # ... every rank sees after leaving: the barrier held them.
        assert int(tp.local_view(win, 8 * late, 8, torch.int64)[0]) == int(marker[0])
        times = tp.comm.allgather((arrive, leave))
        t_arrive = times[late][0]
        assert all(t_leave >= t_arrive for _, t_leave in times), times  # CLOCK_MONOTONIC is system-wide
        tp.barrier()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("team", [Team.WORLD, Team.NODE])
def test_barrier_timeout_names_missing_rank(tp, team):
    me, n = tp.topology.rank, tp.topology.world_size
    missing = n - 1
    if me == missing:
        return  # never arrives; goes straight to teardown (destroy)
    t0 = time.monotonic()
    with pytest.raises(TransportTimeout) as ei:
        tp.barrier(team, timeout_s=1.0)
    assert 1.0 <= time.monotonic() - t0 <= 1.0 + SLACK_S
    e = ei.value
    assert e.op == "barrier" and e.pending_peers == [missing] and team.name in e.phase, (e.op, e.pending_peers, e.phase)
    assert f"[{missing}]" in str(e) and f"rank {me}:" in str(e)
    assert tp.state is State.POISONED


@pytest.mark.mpi(min_size=1)
def test_barrier_publishes_stores(shared_tp):
    """A store through a peer view before the barrier is visible to the owner after it."""
    tp = shared_tp
    me, n = tp.topology.rank, tp.topology.world_size
    win = tp.create_window("pub", 4096 * n, 1)
    for rnd in range(3):
        for p in range(n):
            tp.peer_view(win, p, 4096 * me, 4096).copy_(pattern(4096, rnd * 100 + me * 10 + p))
        tp.barrier()
        for s in range(n):
            assert torch.equal(tp.local_view(win, 4096 * s, 4096), pattern(4096, rnd * 100 + s * 10 + me))
        tp.barrier()


@pytest.mark.mpi(min_size=2)
def test_second_abort_keeps_first_reason(tp):
    me = tp.topology.rank
    win = tp.create_window("abort2", 0, 1)
    tp.comm.Barrier()
    if me == 0:
        tp.abort("original failure")
        tp.abort("secondary cleanup failure")  # never raises
    tp.comm.Barrier()
    if me == 0:
        return
    with pytest.raises(TransportAborted) as ei:
        tp.wait_until(win, 0, [0], 1, timeout_s=30)
    assert ei.value.reason == "original failure", ei.value.reason


@pytest.mark.mpi(min_size=1)
def test_allgather_object_gives_every_rank_s_object_in_rank_order(shared_tp):
    tp = shared_tp
    me, n = tp.topology.rank, tp.topology.world_size
    for rnd in range(3):  # sizes differ per rank and per round
        got = tp.allgather_object({"rank": me, "items": list(range(me + rnd))}, phase=f"round {rnd}")
        assert got == [{"rank": r, "items": list(range(r + rnd))} for r in range(n)], got
    assert tp.state is State.OPEN


@pytest.mark.mpi(min_size=2)
def test_allgather_object_has_a_deadline(tp):
    """A rank that does not enter: the others raise TransportTimeout after the deadline (the message says the
    missing rank cannot be named) and are poisoned, instead of waiting forever as in a blocking MPI_Allgather."""
    me, n = tp.topology.rank, tp.topology.world_size
    if me == n - 1:
        return  # never enters; the fixture's collective destroy copes with the others' poisoned state
    t0 = time.monotonic()
    with pytest.raises(TransportTimeout) as ei:
        tp.allgather_object(me, phase="gather-phase", timeout_s=0.5)
    assert 0.5 <= time.monotonic() - t0 <= 0.5 + SLACK_S
    msg = str(ei.value)
    for part in (f"rank {me}:", "allgather_object", "gather-phase", "does not say which"):
        assert part in msg, (part, msg)
    # a wait on a request (no signal words) lists no observed values: no empty parentheses either
    bare = str(TransportTimeout("allgather_object", me, [], 1.0, phase="p", expected=[], observed=[]))
    assert "missing)." in bare and "()" not in bare, bare
    assert tp.state is State.POISONED
    with pytest.raises(TransportPoisoned):
        tp.allgather_object(me)
