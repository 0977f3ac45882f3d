"""URMA: the transport across (simulated) nodes (docs/design/transports.md §2.2, §4.1, §8).

The world is split row-major into nodes of ``ranks_per_node`` ranks for every divisor that gives
more than one node (8 ranks: 1, 2, 4; 4 ranks: 1, 2; 2 ranks: 1; skipped with 1 rank). Pairs on
the same node use UBMEM, pairs on different nodes URMA (MPI RMA), in the same job and windows.

Module-scoped transports (one per ``ranks_per_node``) serve the tests that leave them OPEN;
failure tests (timeouts, aborts) build their own. ``test_urma_over_tcp`` re-runs the main
paths in a nested 4-rank job whose two simulated nodes talk over UCX/TCP
(``nested_urma_tcp.py``), where an RMA operation lands only while its target drives MPI progress.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

import numpy as np
import pytest
import torch
from mpi4py import MPI

from deepep_ascend.transports import (
    ChannelKind,
    LinkStats,
    State,
    Team,
    TransportAborted,
    TransportArgumentError,
    TransportClosed,
    TransportError,
    TransportPeerTimeout,
    TransportPoisoned,
    TransportTimeout,
    TransportUnsupported,
)
from tests.support import REPO_ROOT
from tests.support.mpi_utils import run_child_job, up_to_four_ranks
from tests.transports.helpers import (
    MIB,
    destroy_quietly,
    make_transport,
    pattern,
    proc_shm_mappings,
    ramp,
)

N = MPI.COMM_WORLD.Get_size()
#: ranks_per_node values that split the world into more than one node.
MULTI = [d for d in range(1, N) if N % d == 0]
#: Two nodes (the shape of most failure tests), if the world can be split at all.
HALF = [N // 2] if N % 2 == 0 and N >= 2 else []
SLACK_S = 3.0
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = REPO_ROOT


@pytest.fixture(scope="module", params=MULTI, ids=[f"rpn{d}" for d in MULTI])
def mtp(request):
    """A transport with ``ranks_per_node = param`` (more than one node), shared by the module's tests."""
    t = make_transport(ranks_per_node=request.param)
    yield t
    destroy_quietly(t)


def _kind(tp, a: int, b: int) -> ChannelKind:
    return tp.topology.kind(a, b)


def _assert_bytes(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.numel() == want.numel(), f"{what}: {got.numel()} bytes, expected {want.numel()}"
    if not torch.equal(got, want):
        bad = (got != want).nonzero()
        i = int(bad[0])
        raise AssertionError(f"{what}: {bad.numel()} of {want.numel()} bytes differ; first at byte {i}: "
                             f"got {int(got[i])}, expected {int(want[i])}")


# ---------------------------------------------------------------------------------------------
# topology as the transport sees it


@pytest.mark.mpi(min_size=2)
def test_row_major_placement_and_kinds(mtp):
    tp = mtp
    topo = tp.topology
    me, n, rpn = topo.rank, topo.world_size, topo.ranks_per_node
    assert topo.num_nodes == n // rpn > 1
    assert (topo.node, topo.local_rank) == (me // rpn, me % rpn)
    # Every rank agrees on every rank's place, and it is row-major.
    places = tp.comm.allgather((topo.node, topo.local_rank))
    assert places == [(r // rpn, r % rpn) for r in range(n)]
    kinds = np.array([[int(_kind(tp, a, b)) for b in range(n)] for a in range(n)])
    want = np.array([[0 if a == b else (1 if a // rpn == b // rpn else 2) for b in range(n)] for a in range(n)])
    assert np.array_equal(kinds, want), kinds
    assert tp.team_ranks(Team.NODE) == list(range(topo.node * rpn, (topo.node + 1) * rpn))
    assert tp.team_ranks(Team.RAIL) == [nd * rpn + me % rpn for nd in range(n // rpn)]
    assert tp.team_ranks(Team.WORLD) == list(range(n))


# ---------------------------------------------------------------------------------------------
# put / get


SIZES = [0, 1, 7, 4096, MIB]
GUARD = 64
SENTINEL = 0xA5


def _layout():
    """Byte offset of each size's slot in the window, with GUARD bytes of sentinel on both sides."""
    offs, at = [], GUARD
    for size in SIZES:
        offs.append(at)
        at += size + 2 * GUARD + 8
    return offs, at


def _ring_rounds(tp, name: str, nbytes: int):
    """Ring rounds over a new window of ``nbytes``: yields ``(k, dst, src, win, own)`` for ``k`` = 0.., this rank
    writing to ``dst = me + k`` and receiving from ``src = me - k``, with ``own`` (this rank's data region)
    filled with ``SENTINEL`` and every rank past a barrier; the view is dropped and the ranks meet at the end."""
    me, n = tp.topology.rank, tp.topology.world_size
    win = tp.create_window(name, nbytes, 1)
    own = tp.local_view(win, 0, nbytes)
    for k in range(n):
        own.fill_(SENTINEL)
        tp.barrier()
        yield k, (me + k) % n, (me - k) % n, win, own
    del own
    tp.barrier()


@pytest.mark.mpi(min_size=2)
def test_put_every_pair_and_size(mtp):
    """Ring rounds cover every (src, dst) pair, so SELF, UBMEM and URMA; each size lands exactly."""
    tp = mtp
    me = tp.topology.rank
    offs, total = _layout()
    for k, dst, src, win, own in _ring_rounds(tp, "urma_put", total):
        before = tp.stats.snapshot()
        for si, size in enumerate(SIZES):
            payload = pattern(size, me * 1009 + k * 31 + si)
            tp.put(win, dst, offs[si], payload)
            payload.fill_(0x5A)  # reusable once put returns: nothing delivered changes
        tp.flush(dst)
        d = LinkStats.diff(tp.stats.snapshot(), before)
        kind = _kind(tp, me, dst)
        assert d["bytes_put"][kind, dst] == sum(SIZES) and d["puts"][kind, dst] == len(SIZES)
        assert d["bytes_put"].sum() == sum(SIZES)
        tp.barrier()
        for si, size in enumerate(SIZES):
            what = f"round {k}: {size} B from rank {src} ({_kind(tp, src, me).name})"
            at = offs[si]
            _assert_bytes(own[at:at + size], pattern(size, src * 1009 + k * 31 + si), what)
            assert bool((own[at - GUARD:at] == SENTINEL).all()), f"{what}: bytes before the range touched"
            assert bool((own[at + size:at + size + GUARD] == SENTINEL).all()), f"{what}: bytes after touched"


# (source offset, destination offset, bytes): gaps on both sides, destination order not the source's
PUT_BLOCKS = {
    "mixed": [(0, 70_000, 4096), (5000, 64, 7), (5007, 30_000, 0), (6000, 200, 20_000), (40_000, 80_000, MIB)],
    # rows of one size at multiples of it, as the LL engine sends them (the load/store path's row scatter)
    "rows": [(r * 4104, d * 4104, 4104) for r, d in ((5, 0), (0, 7), (9, 3), (2, 200), (3, 120))],
}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout", sorted(PUT_BLOCKS))
def test_put_blocks_every_pair(mtp, layout):
    """``put_blocks``: scattered blocks of one source, in another order at the destination (an empty one among
    them), land exactly and only there for SELF, UBMEM and URMA pairs, counted as one put of their total."""
    tp = mtp
    me = tp.topology.rank
    blocks = PUT_BLOCKS[layout]
    total = 80_000 + MIB + GUARD
    for k, dst, src, win, own in _ring_rounds(tp, "urma_put_blocks", total):
        payload = pattern(40_000 + MIB, me * 131 + k)
        before = tp.stats.snapshot()
        columns = [list(c) for c in zip(*blocks)]
        if layout == "rows":  # arrays and tensors are sequences of ints too
            columns = [np.array(columns[0]), torch.tensor(columns[1]), columns[2]]
        tp.put_blocks(win, dst, payload, *columns)
        payload.fill_(0x5A)  # reusable once put_blocks returns
        tp.flush(dst)
        d = LinkStats.diff(tp.stats.snapshot(), before)
        kind = _kind(tp, me, dst)
        want_total = sum(c for _, _, c in blocks)
        assert d["bytes_put"][kind, dst] == want_total and d["puts"][kind, dst] == 1, (kind, d["puts"])
        tp.barrier()
        sent = pattern(40_000 + MIB, src * 131 + k)
        expect = torch.full((total,), SENTINEL, dtype=torch.uint8)
        for a, b, c in blocks:
            expect[b:b + c] = sent[a:a + c]
        _assert_bytes(own, expect, f"round {k}: blocks from rank {src} ({_kind(tp, src, me).name})")


@pytest.mark.mpi(min_size=2)
def test_put_blocks_refuses_bad_blocks(mtp):
    """Overlapping destinations, a block past the source or the window, lists of different lengths, negative,
    huge, float, bool or string values, a source overlapping its destination: ``TransportArgumentError``
    naming the problem, nothing written, the transport still usable."""
    tp = mtp
    me, n = tp.topology.rank, tp.topology.world_size
    dst = (me + n // 2) % n  # another node when there are two
    win = tp.create_window("urma_put_blocks_bad", 4096, 1)
    own = tp.local_view(win, 0, 4096)
    own.fill_(SENTINEL)
    tp.barrier()
    src = pattern(1024, me)
    for args, needle in [(([0, 10], [0, 50], [100, 100]), "overlap"),
                         (([1000], [0], [100]), "of src"),
                         (([2 ** 63 - 1], [0], [1]), r"\[0, 2\*\*62\)"),  # no int64 wrap past the check
                         (([0], [4000], [200]), "outside the data region"),
                         (([0], [5000], [0]), "outside the data region"),  # empty, yet past the window
                         (([0, 1], [0], [1]), "of one length"),
                         (([0], [-8], [1]), r"\[0, 2\*\*62\)"),
                         (([0], [0.5], [1]), "0.5"),
                         (([0], [0], [True]), "True"),
                         (([0], ["16"], [1]), "'16'"),
                         ((0, [0], [1]), "sequence of ints")]:
        with pytest.raises(TransportArgumentError, match=needle):
            tp.put_blocks(win, dst, src, *args)
    # a source that is this rank's own bytes of the window, copied onto themselves (load/store peers only)
    mine = tp.local_view(win, 0, 64)
    with pytest.raises(TransportArgumentError, match="overlaps"):
        tp.put(win, me, 32, mine)
    with pytest.raises(TransportArgumentError, match="overlaps"):
        tp.put_blocks(win, me, mine, [0], [16], [64])
    del mine
    tp.flush(dst)
    tp.barrier()
    assert bool((own == SENTINEL).all()), "a refused put_blocks wrote bytes"
    del own
    tp.barrier()


@pytest.mark.mpi(min_size=2)
def test_get_across_nodes(mtp):
    tp = mtp
    me, n = tp.topology.rank, tp.topology.world_size
    span = MIB + 4096
    win = tp.create_window("urma_get", span, 1)
    tp.local_view(win, 0, span).copy_(pattern(span, me * 13 + 1))
    tp.barrier()
    for p in range(n):
        full = pattern(span, p * 13 + 1)
        before = tp.stats.snapshot()
        for size, off in [(0, 0), (1, 5), (7, span - 7), (4096, 123), (MIB, 4096)]:
            out = torch.full((size,), 0xEE, dtype=torch.uint8)
            tp.get(win, p, off, out)
            _assert_bytes(out, full[off:off + size], f"get {size} B at {off} from rank {p}")
        typed = torch.empty(4, 8, dtype=torch.int16)
        tp.get(win, p, 64, typed)
        _assert_bytes(typed.reshape(-1).view(torch.uint8), full[64:128], f"typed get from rank {p}")
        d = LinkStats.diff(tp.stats.snapshot(), before)
        kind = _kind(tp, me, p)
        assert d["bytes_fetched"][kind, p] == 1 + 7 + 4096 + MIB + 64 and d["gets"][kind, p] == 6
        assert d["bytes_put"].sum() == 0
    tp.barrier()
    # Released by an ordered signal instead of a barrier.
    tp.local_view(win, 0, 4096).copy_(pattern(4096, me * 13 + 2))
    for p in range(n):
        tp.signal(win, p, 0)
    tp.wait_until(win, 0, list(range(n)), 1)
    for p in range(n):
        out = torch.empty(4096, dtype=torch.uint8)
        tp.get(win, p, 0, out)
        _assert_bytes(out, pattern(4096, p * 13 + 2), f"get after signal from rank {p}")
    tp.barrier()


# ---------------------------------------------------------------------------------------------
# put_with_signal, signals


ROUNDS = 60
PAYLOAD = 128 * 1024 + 3
HEADER = 7


@pytest.mark.mpi(min_size=2)
def test_put_with_signal_rounds_across_nodes(mtp):
    """Each rank streams to the same local rank of the next node; the receiver checks every byte.

    Double-buffered with a 'consumed' ack; each round also puts a small header first (an
    observer of the signal sees earlier puts to the same dst). Every 4th round uses put +
    ordered signal instead of put_with_signal.
    """
    tp = mtp
    me, n, rpn = tp.topology.rank, tp.topology.world_size, tp.topology.ranks_per_node
    dst, src = (me + rpn) % n, (me - rpn) % n
    assert _kind(tp, me, dst) is ChannelKind.URMA and _kind(tp, src, me) is ChannelKind.URMA
    stride = PAYLOAD + 61
    hdr_base = 2 * stride
    win = tp.create_window("urma_pws", hdr_base + 2 * 64, 2)
    DATA, ACK = 0, 1
    before = tp.stats.snapshot()
    for i in range(1, ROUNDS + 1):
        b = i % 2
        if i > 2:
            tp.wait_until(win, ACK, [dst], i - 2, phase=f"ack {i - 2}")
        tp.put(win, dst, hdr_base + b * 64, pattern(HEADER, me * 7919 + i + 5))
        payload = ramp(PAYLOAD, me * 7919 + i)
        if i % 4 == 3:
            tp.put(win, dst, b * stride, payload)
            value = tp.signal(win, dst, DATA)
        else:
            value = tp.put_with_signal(win, dst, b * stride, payload, DATA)
        assert value == i
        tp.wait_until(win, DATA, [src], i, phase=f"data {i}")
        _assert_bytes(tp.local_view(win, hdr_base + b * 64, HEADER), pattern(HEADER, src * 7919 + i + 5),
                      f"round {i}: header from rank {src}")
        _assert_bytes(tp.local_view(win, b * stride, PAYLOAD), ramp(PAYLOAD, src * 7919 + i),
                      f"round {i}: payload from rank {src}")
        tp.signal(win, src, ACK)
    d = LinkStats.diff(tp.stats.snapshot(), before)
    urma = ChannelKind.URMA
    assert d["bytes_put"][urma, dst] == ROUNDS * (PAYLOAD + HEADER) and d["puts"][urma, dst] == 2 * ROUNDS
    if dst == src:  # two nodes: data and acks go to the same rank
        assert d["signals"][urma, dst] == 2 * ROUNDS
    else:
        assert d["signals"][urma, dst] == ROUNDS and d["signals"][urma, src] == ROUNDS
    assert d["bytes_put"][ChannelKind.UBMEM].sum() == 0
    assert tp.read_signal(win, DATA, src) == ROUNDS
    tp.barrier()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("force_urma", [False, True], ids=["kinds", "all_urma"])
def test_deferred_puts_then_batched_signals_to_every_rank(mtp, force_urma):
    """Puts without local completion to every rank (SELF, UBMEM, URMA), one ``flush()``, then one
    ``put_with_signal_many``: an observer of each signal sees that round's payload, blocks and header, and the
    returned values are the running sums of the uneven adds. A deferred put over URMA holds its source until
    the flush (the source's storage has one more user until then), and a bad argument anywhere in the batch is
    refused before any signal moves. ``all_urma``: node peers too over URMA (``force_urma``), as the low-latency
    engine's windows without UBMEM stores."""
    tp = mtp
    me, n = tp.topology.rank, tp.topology.world_size
    size, blocks = 3000 + 17, [(0, 40, 100), (300, 700, 64)]  # (src, dst, bytes) of put_blocks, after the payload
    stride = size + 1024
    win = tp.create_window(f"urma_defer{int(force_urma)}", n * 2 * stride + 2 * n * 64, 2, force_urma=force_urma)
    hdr_base = n * 2 * stride
    DATA, ACK = 0, 1
    sums = [0] * n
    for i in range(1, 7):
        b = i % 2
        if i > 2:
            tp.wait_until(win, ACK, list(range(n)), i - 2, phase=f"ack {i - 2}")
        for p in range(n):
            payload = pattern(size, me * 7919 + p * 31 + i)  # a fresh tensor, dropped once the put returns
            at = (me * 2 + b) * stride
            users = torch._C._storage_Use_Count(payload.untyped_storage()._cdata)
            tp.put(win, p, at, payload, local_completion=False)
            held = torch._C._storage_Use_Count(payload.untyped_storage()._cdata) - users
            assert held == (tp.channel_kind(win, p) is ChannelKind.URMA), f"round {i}: peer {p}: held {held}"
            tp.put_blocks(win, p, payload, [s for s, _, _ in blocks], [at + size + d for _, d, _ in blocks],
                          [k for _, _, k in blocks], local_completion=False)
        tp.flush()
        adds = [1 + (p + i) % 3 for p in range(n)]
        header = pattern(16, me * 13 + i)
        values = tp.put_with_signal_many(win, list(range(n)), [hdr_base + (b * n + me) * 64] * n, header, DATA, adds)
        sums = [s + a for s, a in zip(sums, adds)]
        assert values == sums, f"round {i}: signal values {values} != {sums}"
        for s in range(n):  # source s added 1 + (me + k) % 3 in each round k so far
            want = sum(1 + (me + k) % 3 for k in range(1, i + 1))
            assert tp.wait_until(win, DATA, [s], want, phase=f"data {i} from {s}") == []
        for s in range(n):
            got = tp.local_view(win, (s * 2 + b) * stride, size + 1024)
            sent = pattern(size, s * 7919 + me * 31 + i)
            _assert_bytes(got[:size], sent, f"round {i}: payload from rank {s}")
            for so, d, k in blocks:
                _assert_bytes(got[size + d:size + d + k], sent[so:so + k], f"round {i}: block from rank {s}")
            _assert_bytes(tp.local_view(win, hdr_base + (b * n + s) * 64, 16), pattern(16, s * 13 + i),
                          f"round {i}: header from rank {s}")
        for s in range(n):
            tp.signal(win, s, ACK)
    before = [tp.read_signal(win, DATA, s) for s in range(n)]
    tp.barrier()
    with pytest.raises(TransportArgumentError, match="one length"):
        tp.put_with_signal_many(win, list(range(n)), [hdr_base] * n, pattern(16, 0), DATA, [1] * (n + 1))
    with pytest.raises(TransportArgumentError, match="add=-1"):
        tp.put_with_signal_many(win, list(range(n)), [hdr_base] * n, pattern(16, 0), DATA, [1] * (n - 1) + [-1])
    with pytest.raises(TransportArgumentError, match="appear once"):
        tp.put_with_signal_many(win, [n - 1, 0, n - 1], [hdr_base] * 3, pattern(16, 0), DATA, [1] * 3)
    # the source overlapping this rank's own destination bytes, listed last: refused before any rank is written
    mine = tp.local_view(win, hdr_base, 16)
    with pytest.raises(TransportArgumentError, match="overlaps"):
        tp.put_with_signal_many(win, [p for p in range(n) if p != me] + [me], [hdr_base] * n, mine, DATA, [1] * n)
    tp.barrier()
    assert [tp.read_signal(win, DATA, s) for s in range(n)] == before
    tp.barrier()


@pytest.mark.mpi(min_size=2)
def test_signal_many_orders_deferred_puts_and_counts(mtp):
    """``signal_many`` (ordered) after deferred puts to every rank: an observer of each signal sees the payload
    put before it; the values are the running sums of the uneven adds; the traffic counters count one signal
    per rank; bad arguments are refused before any signal moves."""
    tp = mtp
    me, n = tp.topology.rank, tp.topology.world_size
    size = 5000 + 3
    win = tp.create_window("urma_sigmany", n * 2 * size, 2)
    DATA, ACK = 0, 1
    sums = [0] * n
    before = tp.stats.snapshot()
    for i in range(1, 6):
        b = i % 2
        if i > 2:
            tp.wait_until(win, ACK, list(range(n)), i - 2, phase=f"ack {i - 2}")
        for p in range(n):
            tp.put(win, p, (me * 2 + b) * size, pattern(size, me * 7919 + p * 31 + i), local_completion=False)
        adds = [1 + (p * i) % 4 for p in range(n)]
        sums = [s + a for s, a in zip(sums, adds)]
        assert tp.signal_many(win, list(range(n)), DATA, adds) == sums
        for s in range(n):
            assert tp.wait_until(win, DATA, [s], sum(1 + (me * k) % 4 for k in range(1, i + 1)),
                                 phase=f"data {i} from {s}") == []
            _assert_bytes(tp.local_view(win, (s * 2 + b) * size, size), pattern(size, s * 7919 + me * 31 + i),
                          f"round {i}: payload from rank {s}")
        tp.signal_many(win, list(range(n)), ACK, [1] * n)
    d = LinkStats.diff(tp.stats.snapshot(), before)
    assert all(int(d["signals"][:, p].sum()) == 2 * 5 for p in range(n)), d["signals"]
    tp.barrier()
    at = [tp.read_signal(win, DATA, s) for s in range(n)]
    tp.barrier()
    with pytest.raises(TransportArgumentError, match="one length"):
        tp.signal_many(win, list(range(n)), DATA, [1] * (n + 1))
    with pytest.raises(TransportArgumentError, match="add=-2"):
        tp.signal_many(win, list(range(n)), DATA, [1] * (n - 1) + [-2])
    with pytest.raises(TransportArgumentError, match="appear once"):
        tp.signal_many(win, [0, n - 1, 0], DATA, [1] * 3)
    tp.barrier()
    assert [tp.read_signal(win, DATA, s) for s in range(n)] == at
    tp.barrier()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("force_urma", [False, True], ids=["kinds", "all_urma"])
def test_flush_of_one_rank_completes_its_deferred_puts(mtp, force_urma):
    """``flush(dst)`` completes the deferred puts to ``dst`` on every window that reaches it over URMA, a
    ``force_urma`` window's node peers included: the transport lets their sources go then."""
    tp = mtp
    me, n = tp.topology.rank, tp.topology.world_size
    win = tp.create_window(f"urma_flush1_{int(force_urma)}", 4096, 1, force_urma=force_urma)
    for p in range(n):
        src = pattern(4096, me * 31 + p)
        users = torch._C._storage_Use_Count(src.untyped_storage()._cdata)
        tp.put(win, p, 0, src, local_completion=False)
        urma = tp.channel_kind(win, p) is ChannelKind.URMA
        assert torch._C._storage_Use_Count(src.untyped_storage()._cdata) - users == urma
        tp.flush(p)
        assert torch._C._storage_Use_Count(src.untyped_storage()._cdata) == users, f"peer {p}: source still held"
    tp.barrier()


@pytest.mark.mpi(min_size=2)
def test_signals_refuse_bool_arguments_and_a_word_past_int64(mtp):
    """A ``bool`` is not a rank, slot or offset (``True`` would silently mean 1); a signal whose running value
    would pass int64 is refused before it moves (the word would wrap and read smaller), by every signal call."""
    tp = mtp
    me, n = tp.topology.rank, tp.topology.world_size
    peer = (me + 1) % n
    win = tp.create_window("urma_sigargs", 64, 2)
    data = pattern(8, me)
    for call in (lambda: tp.put(win, True, 0, data), lambda: tp.put(win, peer, True, data),
                 lambda: tp.signal(win, True, 0), lambda: tp.signal(win, peer, True),
                 lambda: tp.signal_many(win, [True], 0, [1]), lambda: tp.signal_many(win, [peer], True, [1]),
                 lambda: tp.put_with_signal_many(win, [True], [0], data, 0, [1]),
                 lambda: tp.put_with_signal_many(win, [peer], [True], data, 0, [1])):
        with pytest.raises(TransportArgumentError):
            call()
    big = 2 ** 62 - 1
    assert tp.signal_many(win, [peer], 1, [big]) == [big]
    assert tp.signal(win, peer, 1, add=big) == 2 * big
    for call in (lambda: tp.signal(win, peer, 1, add=big), lambda: tp.signal_many(win, [peer], 1, [big]),
                 lambda: tp.put_with_signal(win, peer, 0, data, 1, add=big),
                 lambda: tp.put_with_signal_many(win, [peer], [0], data, 1, [big])):
        with pytest.raises(TransportArgumentError, match="would pass int64"):
            call()
    src = (me - 1) % n
    assert tp.wait_until(win, 1, [src], 2 * big, phase="the two signals") == []
    assert tp.read_signal(win, 1, src) == 2 * big  # the refused calls moved nothing
    tp.barrier()
    assert tp.signal(win, peer, 1, add=1) == 2 * big + 1  # the largest value left
    tp.barrier()


@pytest.mark.mpi(min_size=2)
def test_signal_counts_every_kind(mtp):
    tp = mtp
    n = tp.topology.world_size
    win = tp.create_window("urma_sig", 0, 3)
    SLOT, K = 1, 4
    total = 0
    for r, add in enumerate([1, 2, 5]):  # three rounds, values keep growing, nothing reset
        for p in range(n):
            for j in range(K):
                value = tp.signal(win, p, SLOT, add=add, ordered=(j % 2 == 0))
                assert value == total + (j + 1) * add
        total += K * add
        assert tp.wait_until(win, SLOT, list(range(n)), total, phase=f"round {r}") == []
        got = [tp.read_signal(win, SLOT, s) for s in range(n)]
        assert got == [total] * n, f"round {r}: slot[{SLOT}][src] = {got}"
        tp.barrier()
    for other in (0, 2):
        assert [tp.read_signal(win, other, s) for s in range(n)] == [0] * n
    tp.barrier()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("team", [Team.WORLD, Team.NODE, Team.RAIL])
def test_barrier_teams_reach_other_nodes(mtp, team):
    """30 generations; each publishes a put (URMA or UBMEM) that the next team member must see."""
    tp = mtp
    me = tp.topology.rank
    members = tp.team_ranks(team)
    i = members.index(me)
    nxt, prv = members[(i + 1) % len(members)], members[(i - 1) % len(members)]
    win = tp.create_window("urma_gen", 64, 1)
    for g in range(1, 31):
        buf = (g % 2) * 8
        tp.put(win, nxt, buf, torch.tensor([g * 1000 + me], dtype=torch.int64))
        tp.barrier(team)
        got = int(tp.local_view(win, buf, 8, torch.int64)[0])
        assert got == g * 1000 + prv, f"generation {g}: got {got} from rank {prv}"
    tp.barrier()


# ---------------------------------------------------------------------------------------------
# argument errors, views, accounting


@pytest.mark.mpi(min_size=2)
def test_argument_errors_for_urma_peers(mtp):
    """The checks of docs/design/transports.md §2.3 for a peer on another node:
    raised before anything moves or is counted."""
    tp = mtp
    me, n, rpn = tp.topology.rank, tp.topology.world_size, tp.topology.ranks_per_node
    peer = (me + rpn) % n
    assert _kind(tp, me, peer) is ChannelKind.URMA
    win = tp.create_window("urma_args", 4096, 2)
    tp.local_view(win, 0, 4096).copy_(pattern(4096, 300 + me))
    tp.barrier()
    data0, stats0 = tp.local_view(win, 0, 4096).clone(), tp.stats.snapshot()
    sig0 = [[int(v) for v in win.signals(s)] for s in range(2)]
    u8 = torch.arange(8, dtype=torch.uint8)
    bad = [
        ("put", lambda: tp.put(win, peer, -1, u8)),
        ("put", lambda: tp.put(win, peer, 4092, u8)),
        ("put", lambda: tp.put(win, peer, 0, torch.arange(32, dtype=torch.uint8)[::2])),
        ("put", lambda: tp.put(win, peer, 0, np.zeros(4, dtype=np.uint8))),
        ("get", lambda: tp.get(win, peer, 4090, torch.empty(8, dtype=torch.uint8))),
        ("get", lambda: tp.get(win, peer, 0, torch.empty(16, dtype=torch.uint8)[::2])),
        ("signal", lambda: tp.signal(win, peer, 2)),
        ("signal", lambda: tp.signal(win, peer, 0, add=-1)),
        ("signal", lambda: tp.signal(win, peer, 0, add=2 ** 63)),
        ("put_with_signal", lambda: tp.put_with_signal(win, peer, 0, u8, 2)),
        ("put_with_signal", lambda: tp.put_with_signal(win, peer, 0, u8, 0, add=-1)),
        ("put", lambda: tp.put_with_signal(win, peer, 4092, u8, 0)),
        ("wait_until", lambda: tp.wait_until(win, 2, [peer], 1)),
        ("read_signal", lambda: tp.read_signal(win, 2, peer)),
        ("flush", lambda: tp.flush(n)),
    ]
    for i, (op, call) in enumerate(bad):
        with pytest.raises(TransportArgumentError) as ei:
            call()
        assert f"rank {me}" in str(ei.value) and op in str(ei.value), (i, op, str(ei.value))
    # Load/store views of a peer on another node do not exist.
    for call in (lambda: tp.peer_view(win, peer, 0, 8), lambda: tp.peer_view(win, peer, 0, 8, torch.int64)):
        with pytest.raises(TransportUnsupported, match="another node"):
            call()
    tp.barrier()
    assert torch.equal(tp.local_view(win, 0, 4096), data0), "an argument error modified window data"
    assert [[int(v) for v in win.signals(s)] for s in range(2)] == sig0
    for field, arr in tp.stats.snapshot().items():
        assert np.array_equal(arr, stats0[field]), f"LinkStats.{field} changed"
    tp.barrier()
    # The rejected signals did not advance the writer's shadow.
    assert tp.signal(win, peer, 0) == 1
    assert tp.wait_until(win, 0, [(me - rpn) % n], 1) == []
    assert tp.state is State.OPEN
    tp.barrier()


def _script(r: int, n: int):
    ops = [("put", p, 100 + p) for p in range(n)]
    ops += [("put", (r + 1) % n, 0)]  # zero-byte: counted, no bytes
    ops += [("get", p, 3 * (p + 1)) for p in range(n)]
    ops += [("signal", p, 0) for p in range(n) for _ in range(2)]
    ops += [("put_with_signal", (r - 1) % n, 20), ("put_with_signal", (r + n // 2) % n, 30)]
    return ops


def _expected(r: int, n: int, rpn: int) -> dict:
    exp = LinkStats(n)
    for op, p, nb in _script(r, n):
        kind = ChannelKind.SELF if p == r else (ChannelKind.UBMEM if p // rpn == r // rpn else ChannelKind.URMA)
        if op == "put":
            exp.record_put(kind, p, nb)
        elif op == "get":
            exp.record_fetch(kind, p, nb)
        elif op == "signal":
            exp.record_signal(kind, p)
        else:
            exp.record_put(kind, p, nb)
            exp.record_signal(kind, p)
    return exp.snapshot()


@pytest.mark.mpi(min_size=2)
def test_link_stats_exact_with_urma(mtp):
    tp = mtp
    me, n, rpn = tp.topology.rank, tp.topology.world_size, tp.topology.ranks_per_node
    win = tp.create_window("urma_acct", 64 * 1024, 2)
    tp.barrier()
    tp.stats.reset()
    for op, p, nb in _script(me, n):
        if op == "put":
            tp.put(win, p, 256 * me, torch.full((nb,), me, dtype=torch.uint8))
        elif op == "get":
            tp.get(win, p, 0, torch.empty(nb, dtype=torch.uint8))
        elif op == "signal":
            tp.signal(win, p, 0)
        else:
            tp.put_with_signal(win, p, 256 * me, torch.full((nb,), me, dtype=torch.uint8), 1)
    tp.flush()
    tp.fence()
    tp.barrier()
    got = tp.stats.snapshot()
    want = _expected(me, n, rpn)
    for field in want:
        assert np.array_equal(got[field], want[field]), f"{field}:\n got {got[field]}\nwant {want[field]}"
    assert got["bytes_put"][ChannelKind.URMA].sum() > 0
    gathered = tp.stats.gather(tp.comm)
    for field in want:
        for r in range(n):
            assert np.array_equal(gathered[field][r], _expected(r, n, rpn)[field]), (field, r)
    tp.barrier()


# ---------------------------------------------------------------------------------------------
# progress: a rank inside a UBMEM-only wait still takes URMA traffic


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("rpn", [d for d in MULTI if d >= 2], ids=lambda d: f"rpn{d}")
def test_target_in_ubmem_wait_receives_urma(rpn):
    """``t`` waits only for its node peer ``u``; ``u`` is released only after ``s`` (another node)
    completed a 1 MiB put and a put_with_signal to ``t``. Over TCP, that completion needs ``t``'s
    MPI progress while ``t`` is in its UBMEM wait (see ``nested_urma_tcp.py``).
    """
    tp = make_transport(ranks_per_node=rpn)
    try:
        me = tp.topology.rank
        s, t, u = 0, rpn, rpn + 1
        A, B, C = 0, 1, 2
        win = tp.create_window("urma_progress", MIB + 4096, 3)
        tp.barrier()
        if me == t:
            tp.wait_until(win, B, [u], 1, phase="UBMEM-only wait")
            # Acquired after u's UBMEM signal: s's data and signal are already here, no more waiting.
            assert tp.read_signal(win, A, s) == 1
            _assert_bytes(tp.local_view(win, 0, MIB), pattern(MIB, 4242), "1 MiB put from another node")
            _assert_bytes(tp.local_view(win, MIB, 64), pattern(64, 4243), "put_with_signal payload")
        elif me == s:
            time.sleep(0.2)  # t is already waiting
            tp.put(win, t, 0, pattern(MIB, 4242))
            tp.put_with_signal(win, t, MIB, pattern(64, 4243), A)
            tp.signal(win, u, C)
        elif me == u:
            tp.wait_until(win, C, [s], 1)
            tp.signal(win, t, B)
        tp.barrier()
    finally:
        destroy_quietly(tp)


# ---------------------------------------------------------------------------------------------
# failures across nodes


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("rpn", HALF, ids=lambda d: f"rpn{d}")
@pytest.mark.parametrize("op", ["wait_until", "barrier"])
@up_to_four_ranks()
def test_timeout_names_peer_on_another_node(rpn, op):
    """The last rank (last node) never signals / never arrives: node-0 ranks time out naming it.

    Every rank reaches the closing MPI barrier, also after a failed assertion (``finally``), so a
    failure is reported instead of leaving the others in that barrier."""
    tp = make_transport(ranks_per_node=rpn)
    try:
        me, n = tp.topology.rank, tp.topology.world_size
        missing = n - 1
        win = tp.create_window("urma_timeout", 64, 2)
        if op == "wait_until" and me not in (0, missing):
            # rank 0 waits for these too: only the missing rank is pending. Signalled and completed
            # before the barrier, so a rank descheduled on a loaded host cannot miss the 2 s wait.
            tp.signal(win, 0, 1)
            tp.flush(0)
        tp.barrier()
        if me != missing:
            if me == 0 or op == "barrier":
                srcs = [p for p in range(n) if p != me]
                t0 = time.monotonic()
                with pytest.raises(TransportTimeout) as ei:
                    if op == "wait_until":
                        tp.wait_until(win, 1, srcs, 1, timeout_s=2.0, phase="remote")
                    else:
                        tp.barrier(Team.WORLD, timeout_s=2.0)
                elapsed = time.monotonic() - t0
                e = ei.value
                assert isinstance(e, TimeoutError) and isinstance(e, TransportError)
                assert 2.0 <= elapsed <= 2.0 + SLACK_S, elapsed
                assert e.pending_peers == [missing], e.pending_peers
                assert _kind(tp, me, missing) is ChannelKind.URMA or me // rpn == missing // rpn
                msg = str(e)
                assert f"rank {me}:" in msg and f"[{missing}]" in msg, msg
                if op == "wait_until":
                    assert e.slot == 1 and "slot 1" in msg and f"rank {missing}: have 0, need 1" in msg, msg
                assert tp.state is State.POISONED
    finally:
        tp.comm.Barrier()  # the missing rank stays until the others timed out
        destroy_quietly(tp)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("rpn", HALF, ids=lambda d: f"rpn{d}")
@pytest.mark.parametrize("where", ["wait_until", "barrier", "peer_timeout"])
def test_abort_reaches_other_node(rpn, where):
    tp = make_transport(ranks_per_node=rpn)
    try:
        me, n = tp.topology.rank, tp.topology.world_size
        bad = n - 1
        reason = f"injected failure on rank {bad} (ünïcode ✓)"
        win = tp.create_window("urma_abort", 0, 1)
        tp.barrier()
        if me == bad:
            time.sleep(0.3)  # the others block first
            tp.abort(reason, pending_peers=[0] if where == "peer_timeout" else None)
            assert tp.state is State.POISONED
            with pytest.raises(TransportPoisoned):
                tp.signal(win, 0, 0)
        else:
            t0 = time.monotonic()
            with pytest.raises(TransportAborted) as ei:
                if where == "barrier":
                    tp.barrier(timeout_s=60)
                else:
                    tp.wait_until(win, 0, [bad], 1, timeout_s=60, phase="abort-test")
            assert time.monotonic() - t0 < 10.0
            e = ei.value
            assert (e.peer, e.rank, e.reason) == (bad, me, reason), (e.peer, e.rank, e.reason)
            if where == "peer_timeout":
                assert isinstance(e, TransportPeerTimeout) and isinstance(e, TimeoutError)
                assert e.pending_peers == [0]
            assert tp.state is State.POISONED
    finally:
        tp.comm.Barrier()  # every rank, also after a failed assertion: a failure, not a hang
        destroy_quietly(tp)
    assert tp.state is State.CLOSED


# ---------------------------------------------------------------------------------------------
# lifecycle


@pytest.mark.mpi(min_size=2)
def test_lifecycle_multi_node_no_leak():
    comm = MPI.COMM_WORLD
    me, n = comm.Get_rank(), comm.Get_size()
    comm.Barrier()
    before = set(os.listdir("/dev/shm"))
    named_before = {m for m in proc_shm_mappings() if not m.endswith("(deleted)")}
    mapped_before = sum("mpich_shar" in m for m in proc_shm_mappings())
    for cycle, rpn in enumerate(MULTI + MULTI[:1]):
        tp = make_transport(ranks_per_node=rpn)
        try:
            win = tp.create_window(f"urma_cycle{cycle}", 1 << 20, 2)
            far = (me + rpn) % n
            tp.put(win, far, 0, pattern(4096, cycle))
            tp.put_with_signal(win, far, 4096, pattern(64, cycle), 1)
            tp.barrier()
            assert not ({m for m in proc_shm_mappings() if not m.endswith("(deleted)")} - named_before)
        finally:
            destroy_quietly(tp)
        assert tp.state is State.CLOSED
        tp.destroy()  # idempotent
    # The last transport refuses everything once closed (URMA peers included).
    far = (me + MULTI[-1]) % n
    for op in [lambda: tp.put(win, far, 0, torch.zeros(4, dtype=torch.uint8)),
               lambda: tp.get(win, far, 0, torch.zeros(4, dtype=torch.uint8)),
               lambda: tp.signal(win, far, 0), lambda: tp.flush(far), lambda: tp.barrier(Team.RAIL),
               lambda: tp.wait_until(win, 0, [far], 1)]:
        with pytest.raises(TransportClosed):
            op()
    tp.progress()  # a no-op once closed
    tp.abort("after destroy")  # never raises
    assert sum("mpich_shar" in m for m in proc_shm_mappings()) == mapped_before, "window mappings survive"
    comm.Barrier()
    new = {f for f in set(os.listdir("/dev/shm")) - before if not f.startswith("mpich_shm_")}
    if new:
        time.sleep(1.0)  # another job's window file exists only until all its ranks mapped it
        new &= set(os.listdir("/dev/shm"))
    assert not new, f"new files in /dev/shm: {sorted(new)}"


# ---------------------------------------------------------------------------------------------
# the real network path: a nested 4-rank job, two simulated nodes over UCX/TCP (1-rank run only)


@pytest.mark.skipif(N != 1, reason="launches its own mpiexec -n 4; runs in the 1-rank job only")
def test_urma_over_tcp():
    report = tempfile.mkdtemp(prefix="nested_urma_tcp_")
    # UCX_LOG_LEVEL: the poisoned transport of the timeout check is never freed (by design), and
    # UCX lists its registrations at exit as warnings.
    rc, out = run_child_job(4, [sys.executable, os.path.join(HERE, "nested_urma_tcp.py")], REPO, 150.0,
                            MPIR_CVAR_NUM_CLIQUES="2", MPIR_CVAR_CLIQUES_BY_BLOCK="1", UCX_TLS="tcp,self",
                            UCX_LOG_LEVEL="error", DEEPEP_ASCEND_RANKS_PER_NODE="2", DEEPEP_ASCEND_TIMEOUT_S="30",
                            DEEPEP_ASCEND_NESTED_REPORT=report)
    try:
        done = []
        for r in range(4):
            path = os.path.join(report, f"rank{r}.txt")
            if os.path.exists(path):
                with open(path) as f:
                    done.append(f.read().split()[:2])
    finally:
        shutil.rmtree(report, ignore_errors=True)
    assert rc == 0, out[-4000:]
    assert done == [[str(r), "URMA-TCP-OK"] for r in range(4)], out[-4000:]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("rpn", HALF, ids=lambda d: f"rpn{d}")
@pytest.mark.parametrize("exposure", ["allocate", "create"])
def test_both_window_exposures_move_data_and_signals(rpn, exposure, monkeypatch):
    """Default: one MPI_Win_allocate window (same-host segments shared via MPI_Win_shared_query);
    ``$DEEPEP_ASCEND_URMA_EXPOSURE=create``: node-shared segments exposed with MPI_Win_create.
    Both carry puts with signals, gets and barriers across nodes and UBMEM views inside a node."""
    monkeypatch.setenv("DEEPEP_ASCEND_URMA_EXPOSURE", exposure)
    tp = make_transport(ranks_per_node=rpn)
    try:
        me, n = tp.topology.rank, tp.topology.world_size
        dst, src = (me + rpn) % n, (me - rpn) % n
        win = tp.create_window(f"exposure_{exposure}", 2 * 4096, 1)
        assert win._rma is not None and win._rma_is_win == (exposure == "allocate"), \
            f"exposure {exposure}: RMA window is the allocated one: {win._rma_is_win}"
        for i in range(1, 4):
            tp.put_with_signal(win, dst, 0, ramp(4096, me * 31 + i), 0)
            tp.wait_until(win, 0, [src], i, phase=f"round {i}")
            _assert_bytes(tp.local_view(win, 0, 4096), ramp(4096, src * 31 + i), f"{exposure} round {i}")
            tp.barrier()  # nobody overwrites before everyone checked
        out = torch.empty(4096, dtype=torch.uint8)
        tp.get(win, dst, 0, out)
        _assert_bytes(out, ramp(4096, ((dst - rpn) % n) * 31 + 3), f"{exposure}: get from rank {dst}")
        peer = tp.topology.node * rpn + (tp.topology.local_rank + 1) % rpn
        view = tp.peer_view(win, peer, 0, 4096)  # UBMEM load from a node peer's segment
        _assert_bytes(view.clone(), ramp(4096, ((peer - rpn) % n) * 31 + 3), f"{exposure}: view of rank {peer}")
        del view
        tp.barrier()
    finally:
        destroy_quietly(tp)
