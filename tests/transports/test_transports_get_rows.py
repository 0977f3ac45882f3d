"""``Transport.get_rows``: a gathering read of rows of a peer's window straight into rows of an output of any
strides (docs/design/transports.md §2.2), for every pair kind: SELF, UBMEM, URMA across simulated nodes and
over a ``force_urma`` window, with rows below and above ``SMALL_ROW_BYTES`` (node peers' short rows take the
load path, long ones the indexed MPI read); argument errors before anything is read or counted.

Reference: the peer's rows all-gathered with mpi4py and indexed with torch.
"""

from __future__ import annotations

import pytest
import torch

from deepep_ascend.transports import ChannelKind, TransportArgumentError
from tests.support.mpi_utils import gather_all
from tests.transports.helpers import destroy_quietly, make_transport, pattern

ROWS, OFFSET = 97, 256
ROW_BYTES = 48  # the argument-error test's row size


def _fill(tp, win, row_bytes):
    """Write this rank's rows (a rank-coded pattern) after ``OFFSET``; every rank's rows, gathered."""
    mine = pattern(ROWS * row_bytes, seed=tp.topology.rank + 3).view(ROWS, row_bytes)
    tp.local_view(win, OFFSET, ROWS * row_bytes).copy_(mine.reshape(-1))
    tp.barrier()
    return gather_all(mine)


def _check_all_peers(tp, win, everyone, row_bytes):
    me, n = tp.topology.rank, tp.topology.world_size
    g = torch.Generator().manual_seed(me)
    ok = True
    for peer in range(n):
        count = 40
        rows = torch.randint(0, ROWS, (count,), generator=g)
        # contiguous output, rows scattered over a larger block
        out = torch.zeros(64, row_bytes, dtype=torch.uint8)
        pos = torch.randperm(64, generator=g)[:count]
        tp.get_rows(win, peer, OFFSET, row_bytes, rows, out, pos)
        want = torch.zeros_like(out)
        want[pos] = everyone[peer][rows]
        ok &= torch.equal(out, want)
        # a strided 3-D output (column-major columns of 4-byte packs, like the Engram scale block)
        block = torch.zeros(row_bytes // 4 * 8 * 5, dtype=torch.int32)
        out3 = block.as_strided((8, 5, row_bytes // 4), (1, row_bytes // 4 * 8, 8))
        pos = torch.randperm(40, generator=g)[:count]
        tp.get_rows(win, peer, OFFSET, row_bytes, rows, out3, pos)
        want3 = torch.zeros(40, row_bytes // 4, dtype=torch.int32)
        want3[pos] = everyone[peer][rows].view(torch.int32)
        ok &= torch.equal(out3.reshape(40, -1), want3)
    return ok


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("row_bytes", [48, 160], ids=["short_rows", "long_rows"])
@pytest.mark.parametrize("layout", ["one_node", "force_urma", "two_nodes"])
def test_get_rows_every_pair(layout, row_bytes):
    from mpi4py import MPI
    n = MPI.COMM_WORLD.Get_size()
    if layout == "two_nodes" and n % 2:
        pytest.skip("two simulated nodes need an even number of ranks")
    tp = make_transport(ranks_per_node=n // 2 if layout == "two_nodes" else n)
    try:
        win = tp.create_window("rows", OFFSET + ROWS * row_bytes, 0, force_urma=layout == "force_urma")
        everyone = _fill(tp, win, row_bytes)
        before = tp.stats.bytes_fetched.copy()
        ok = _check_all_peers(tp, win, everyone, row_bytes)
        fetched = tp.stats.bytes_fetched - before
        me = tp.topology.rank
        for peer in range(n):
            kind = tp.channel_kind(win, peer)
            ok &= int(fetched[int(kind), peer]) == 2 * 40 * row_bytes
        if layout != "one_node" and n > 1:
            ok &= int(fetched[int(ChannelKind.URMA)].sum()) > 0
        assert ok, f"rank {me}: get_rows results or accounting differ ({layout}) {fetched}"
        tp.barrier()
    finally:
        destroy_quietly(tp)


@pytest.mark.mpi(min_size=1)
def test_get_rows_argument_errors(shared_tp):
    tp = shared_tp
    win = tp.create_window("rows_err", OFFSET + ROWS * ROW_BYTES, 0)
    me = tp.topology.rank
    out = torch.full((8, ROW_BYTES), 7, dtype=torch.uint8)
    rows, pos = torch.arange(4), torch.arange(4)
    before = tp.stats.bytes_fetched.copy()
    cases = [
        (me, ROWS + 1 + torch.arange(4), pos, out, "data region"),  # past the window
        (me, -rows - 1, pos, out, ">= 0"),
        (me, rows, pos + 8, out, "out_rows"),
        (me, rows, pos[:3], out, "one length"),
        (me, rows.int(), pos, out, "int64"),
        (me, rows, pos, torch.zeros(8, ROW_BYTES + 1, dtype=torch.uint8), "rows"),
        (tp.topology.world_size, rows, pos, out, "outside"),
    ]
    for peer, r, p, o, text in cases:
        with pytest.raises(TransportArgumentError, match=text):
            tp.get_rows(win, peer, OFFSET, ROW_BYTES, r, o, p)
    assert torch.equal(out, torch.full_like(out, 7)), "nothing read"
    assert (tp.stats.bytes_fetched == before).all(), "nothing counted"
    tp.barrier()
