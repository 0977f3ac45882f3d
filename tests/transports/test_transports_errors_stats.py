"""Argument errors change nothing; LinkStats counts exactly (docs/design/transports.md §2.3, §5, §8)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepep_ascend.transports import ChannelKind, LinkStats, TransportArgumentError
from tests.transports.helpers import pattern

NBYTES, SLOTS = 4096, 4


def _snapshot(tp, win):
    data = tp.local_view(win, 0, NBYTES).clone()
    sig = [[int(v) for v in win.signals(s)] for s in range(SLOTS)]
    return data, sig, tp.stats.snapshot()


def _bad_calls(tp, win):
    """(op name, callable) pairs that must each raise TransportArgumentError before any change."""
    me, n = tp.topology.rank, tp.topology.world_size
    peer = (me + 1) % n

    def u8(k):
        return torch.arange(k, dtype=torch.uint8)

    noncontig = torch.arange(32, dtype=torch.uint8)[::2]
    transposed = torch.arange(64, dtype=torch.int32).reshape(8, 8).t()
    return [
        # put: peer, offset, range, source
        ("put", lambda: tp.put(win, -1, 0, u8(4))),
        ("put", lambda: tp.put(win, n, 0, u8(4))),
        ("put", lambda: tp.put(win, 1.5, 0, u8(4))),
        ("put", lambda: tp.put(win, None, 0, u8(4))),
        ("put", lambda: tp.put(win, peer, -1, u8(4))),
        ("put", lambda: tp.put(win, peer, 1.0, u8(4))),
        ("put", lambda: tp.put(win, peer, NBYTES, u8(1))),
        ("put", lambda: tp.put(win, peer, NBYTES - 3, u8(7))),  # straddles the end
        ("put", lambda: tp.put(win, peer, 0, u8(NBYTES + 1))),
        ("put", lambda: tp.put(win, peer, 0, noncontig)),
        ("put", lambda: tp.put(win, peer, 0, transposed)),
        ("put", lambda: tp.put(win, peer, 0, b"abcd")),
        ("put", lambda: tp.put(win, peer, 0, np.zeros(4, dtype=np.uint8))),
        ("put", lambda: tp.put(win, peer, 0, [1, 2, 3])),
        ("put", lambda: tp.put(win, peer, 0, None)),
        # get
        ("get", lambda: tp.get(win, n, 0, torch.empty(4, dtype=torch.uint8))),
        ("get", lambda: tp.get(win, -1, 0, torch.empty(4, dtype=torch.uint8))),
        ("get", lambda: tp.get(win, peer, -8, torch.empty(4, dtype=torch.uint8))),
        ("get", lambda: tp.get(win, peer, NBYTES - 4, torch.empty(8, dtype=torch.uint8))),
        ("get", lambda: tp.get(win, peer, 0, torch.empty(16, dtype=torch.uint8)[::2])),
        ("get", lambda: tp.get(win, peer, 0, bytearray(4))),
        # signal
        ("signal", lambda: tp.signal(win, peer, -1)),
        ("signal", lambda: tp.signal(win, peer, SLOTS)),
        ("signal", lambda: tp.signal(win, peer, 1.0)),
        ("signal", lambda: tp.signal(win, n, 0)),
        ("signal", lambda: tp.signal(win, peer, 0, add=-1)),
        ("signal", lambda: tp.signal(win, peer, 0, add=1.5)),
        ("signal", lambda: tp.signal(win, peer, 0, add=2 ** 63)),
        # put_with_signal (peer, slot and range are checked before the put)
        ("put_with_signal", lambda: tp.put_with_signal(win, peer, 0, u8(8), SLOTS)),
        ("put_with_signal", lambda: tp.put_with_signal(win, n, 0, u8(8), 0)),
        ("put", lambda: tp.put_with_signal(win, peer, NBYTES - 4, u8(8), 0)),
        # wait_until
        ("wait_until", lambda: tp.wait_until(win, SLOTS, [peer], 1)),
        ("wait_until", lambda: tp.wait_until(win, -1, [peer], 1)),
        ("wait_until", lambda: tp.wait_until(win, 0, [n], 1, timeout_s=0.5)),
        ("wait_until", lambda: tp.wait_until(win, 0, [-1], 1, timeout_s=0.5)),
        ("wait_until", lambda: tp.wait_until(win, 0, [peer, me], [1, 2, 3], timeout_s=0.5)),
        # views
        ("peer_view", lambda: tp.peer_view(win, n, 0, 8)),
        ("peer_view", lambda: tp.peer_view(win, peer, -8, 8)),
        ("peer_view", lambda: tp.peer_view(win, peer, NBYTES - 4, 8)),
        ("peer_view", lambda: tp.peer_view(win, peer, 4, 8, torch.int64)),   # misaligned offset
        ("peer_view", lambda: tp.peer_view(win, peer, 0, 12, torch.int64)),  # not a whole number of items
        ("peer_view", lambda: tp.local_view(win, 0, NBYTES + 1)),
        ("read_signal", lambda: tp.read_signal(win, SLOTS, peer)),
        # call tags: a number from 1 below 2**47, kind and op from 1 to 255
        ("set_call_tag", lambda: tp.set_call_tag(0, 1, 1)),
        ("set_call_tag", lambda: tp.set_call_tag(2 ** 47, 1, 1)),
        ("set_call_tag", lambda: tp.set_call_tag(1.0, 1, 1)),
        ("set_call_tag", lambda: tp.set_call_tag(1, 0, 1)),
        ("set_call_tag", lambda: tp.set_call_tag(1, 256, 1)),
        ("set_call_tag", lambda: tp.set_call_tag(1, 1, 0)),
        ("set_call_tag", lambda: tp.set_call_tag(1, 1, None)),
    ]


@pytest.mark.mpi(min_size=1)
def test_argument_errors_change_nothing(shared_tp):
    tp = shared_tp
    me, n = tp.topology.rank, tp.topology.world_size
    peer, prev = (me + 1) % n, (me - 1) % n
    win = tp.create_window("args", NBYTES, SLOTS)
    tp.local_view(win, 0, NBYTES).copy_(pattern(NBYTES, 500 + me))
    assert tp.signal(win, peer, 1, add=3) == 3
    tp.wait_until(win, 1, [prev], 3)
    tp.barrier()
    data0, sig0, stats0 = _snapshot(tp, win)
    for i, (op, call) in enumerate(_bad_calls(tp, win)):
        with pytest.raises(TransportArgumentError) as ei:
            call()
        assert isinstance(ei.value, ValueError)
        msg = str(ei.value)
        assert f"rank {me}" in msg and op in msg, (i, op, msg)
    tp.barrier()  # any stray write by a peer has landed by now
    data1, sig1, stats1 = _snapshot(tp, win)
    assert torch.equal(data0, data1), "an argument error modified window data"
    assert sig0 == sig1, "an argument error modified signal slots"
    for field in stats0:
        assert np.array_equal(stats0[field], stats1[field]), f"LinkStats.{field} changed"
    tp.barrier()  # every rank took its snapshot before anyone signals again
    # The failed signals did not advance the writer's shadow either: next value is 3 + 1.
    assert tp.signal(win, peer, 1) == 4
    tp.wait_until(win, 1, [prev], 4)
    assert tp.read_signal(win, 1, prev) == 4
    assert tp.state.name == "OPEN"
    tp.barrier()


@pytest.mark.mpi(min_size=1)
def test_put_with_signal_bad_add_changes_nothing(tp):
    me, n = tp.topology.rank, tp.topology.world_size
    peer = (me + 1) % n
    win = tp.create_window("pws_add", NBYTES, SLOTS)
    tp.local_view(win, 0, NBYTES).fill_(0)
    tp.barrier()
    data0, _, stats0 = _snapshot(tp, win)
    with pytest.raises(TransportArgumentError):
        tp.put_with_signal(win, peer, 0, torch.full((8,), 7, dtype=torch.uint8), 0, add=-1)
    tp.barrier()
    data1, _, stats1 = _snapshot(tp, win)
    problems = []
    if not torch.equal(data0, data1):
        problems.append("window bytes changed")
    if int(stats1["puts"].sum()) != int(stats0["puts"].sum()):
        problems.append("a put was counted")
    assert not problems, problems


@pytest.mark.mpi(min_size=1)
def test_read_signal_rejects_bad_source(shared_tp):
    tp = shared_tp
    n = tp.topology.world_size
    win = tp.create_window("rs", 0, 1)
    for src in (-1, n):
        with pytest.raises(TransportArgumentError):
            tp.read_signal(win, 0, src)


@pytest.mark.mpi(min_size=1)
def test_flush_rejects_bad_peer(shared_tp):
    tp = shared_tp
    n = tp.topology.world_size
    tp.flush()
    tp.flush(0)
    for dst in (-1, n):
        with pytest.raises(TransportArgumentError):
            tp.flush(dst)


# ---------------------------------------------------------------------------------------------
# accounting


def _script(r: int, n: int):
    """The ops rank ``r`` issues: (op, peer, nbytes). Peer-relative, so any rank can replay any rank."""
    ops = []
    for p in range(n):
        ops.append(("put", p, 100 + p))
    ops.append(("put", (r + 1) % n, 10))
    ops.append(("put", (r + 1) % n, 0))  # zero-byte put: counted, no bytes
    for p in range(n):
        ops.append(("get", p, 3 * (p + 1)))
    for p in range(n):
        ops.append(("signal", p, 0))
        ops.append(("signal", p, 0))
    ops.append(("put_with_signal", (r - 1) % n, 20))
    ops.append(("record_put", (r + 2) % n, 5))     # stores through peer views, counted by hand
    ops.append(("record_fetch", (r + 3) % n, 6))
    return ops


def _expected(r: int, n: int) -> dict:
    exp = LinkStats(n)
    for op, p, nb in _script(r, n):
        kind = ChannelKind.SELF if p == r else ChannelKind.UBMEM
        if op in ("put", "record_put"):
            exp.record_put(kind, p, nb)
        elif op in ("get", "record_fetch"):
            exp.record_fetch(kind, p, nb)
        elif op == "signal":
            exp.record_signal(kind, p)
        elif op == "put_with_signal":
            exp.record_put(kind, p, nb)
            exp.record_signal(kind, p)
    return exp.snapshot()


@pytest.mark.mpi(min_size=1)
def test_link_stats_exact(shared_tp):
    tp = shared_tp
    me, n = tp.topology.rank, tp.topology.world_size
    win = tp.create_window("acct", 64 * 1024, 2)
    tp.barrier()
    tp.stats.reset()
    for op, p, nb in _script(me, n):
        if op == "put":
            tp.put(win, p, 256 * me, torch.full((nb,), me, dtype=torch.uint8))
        elif op == "get":
            tp.get(win, p, 0, torch.empty(nb, dtype=torch.uint8))
        elif op == "signal":
            tp.signal(win, p, 0)
        elif op == "put_with_signal":
            tp.put_with_signal(win, p, 256 * me, torch.full((nb,), me, dtype=torch.uint8), 1)
        elif op == "record_put":
            tp.peer_view(win, p, 32768 + 8 * me, nb).fill_(1)  # views are not counted ...
            tp.record_put(p, nb)                               # ... until recorded
        elif op == "record_fetch":
            tp.peer_view(win, p, 0, nb).clone()
            tp.record_fetch(p, nb)
    tp.flush()
    tp.fence()
    tp.barrier()  # flush, fence and barrier move no counted bytes
    got = tp.stats.snapshot()
    want = _expected(me, n)
    for field in want:
        assert np.array_equal(got[field], want[field]), f"{field}:\n got {got[field]}\nwant {want[field]}"
    assert not got["bytes_put"][ChannelKind.URMA].any() and not got["puts"][ChannelKind.URMA].any()
    # SELF only in this rank's column; UBMEM never in it.
    for field in got:
        self_row = got[field][ChannelKind.SELF]
        assert not np.delete(self_row, me).any() and got[field][ChannelKind.UBMEM][me] == 0, field
    by_kind = LinkStats.bytes_by_kind(got)
    moved = {"SELF": 0, "UBMEM": 0, "URMA": 0}
    for op, p, nb in _script(me, n):
        moved["SELF" if p == me else "UBMEM"] += nb if op != "signal" else 0
    assert by_kind == moved, (by_kind, moved)
    # gather: row r is rank r's counters, as every rank can replay rank r's script.
    gathered = tp.stats.gather(tp.comm)
    for field in want:
        assert gathered[field].shape == (n, len(ChannelKind), n)
        for r in range(n):
            assert np.array_equal(gathered[field][r], _expected(r, n)[field]), (field, r)
    # snapshot / diff / reset
    before = tp.stats.snapshot()
    tp.put(win, me, 0, torch.zeros(7, dtype=torch.uint8))
    d = LinkStats.diff(tp.stats.snapshot(), before)
    assert d["bytes_put"][ChannelKind.SELF, me] == 7 and d["puts"].sum() == 1 and d["bytes_put"].sum() == 7
    tp.stats.reset()
    assert all(not v.any() for v in tp.stats.snapshot().values())
    tp.barrier()
