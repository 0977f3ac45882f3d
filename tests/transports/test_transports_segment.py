"""SharedSegment: node-shared memory whose tensors outlive the transport (transports.segment)."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest
import torch

from deepep_ascend.transports import TransportArgumentError, TransportRuntimeError


def _files_of_this_process():
    return [f for f in os.listdir("/dev/shm") if f.startswith(f"deepep_ascend.{os.getpid()}.")]


@pytest.mark.mpi(min_size=1)
def test_segment_stores_reach_the_owner_and_sizes_may_differ(shared_tp):
    tp = shared_tp
    me, n = tp.topology.rank, tp.topology.world_size
    seg = tp.create_segment("seg", 4096 * (me + 1))  # a different size on every rank
    assert seg.sizes == {p: 4096 * (p + 1) for p in range(n)}
    assert _files_of_this_process() == []  # unlinked once every peer mapped them
    for p in range(n):  # every rank stores its code into every rank's segment, at its own offset
        seg.view(p, 8 * me, 8).fill_(me + 1)
    tp.barrier()  # a barrier orders the stores before the reads below
    own = seg.view(me, 0, 8 * n).view(n, 8)
    assert torch.equal(own, torch.arange(1, n + 1, dtype=torch.uint8).unsqueeze(1).expand(n, 8))
    # the last byte of every peer's segment is reachable, one byte further is not
    for p in range(n):
        assert seg.view(p, 4096 * (p + 1) - 1, 1).numel() == 1
        with pytest.raises(TransportArgumentError, match=f"rank {p}: byte range"):
            seg.view(p, 4096 * (p + 1) - 1, 2)
    with pytest.raises(TransportArgumentError, match="not a rank of this node"):
        seg.view(n, 0, 1)
    # address(): view()'s first byte, range checked alike; offset_of() maps a view back to its offset
    for p in range(n):
        size = 4096 * (p + 1)
        for off, nbytes in ((0, 1), (8 * me, 8), (size - 3, 3), (size, 0)):
            v = seg.view(p, off, max(nbytes, 1) if off < size else 0)
            assert nbytes == 0 or seg.address(p, off, nbytes) == v.data_ptr()
            assert seg.address(p, off, nbytes) == seg.address(p, 0, 1) + off
            if v.numel():
                assert seg.offset_of(p, v) == off
        for off, nbytes in ((size - 1, 2), (-1, 1), (0, -1)):
            with pytest.raises(TransportArgumentError, match=f"rank {p}: byte range"):
                seg.address(p, off, nbytes)
    with pytest.raises(TransportArgumentError, match="not a rank of this node"):
        seg.address(n, 0, 1)
    assert seg.address(me, np.int64(8), np.int32(8)) == seg.address(me, 8, 8)  # numpy integers are integers
    for off, nbytes in ((1.5, 1), (0, True), (np.float64(8.0), 8), (8, "8")):  # no address from a non-integer
        with pytest.raises(TransportArgumentError, match="must be integers"):
            seg.address(me, off, nbytes)
    assert seg.offset_of(me, torch.zeros(4)) is None  # private memory
    tp.barrier()
    seg.release()
    with pytest.raises(TransportArgumentError, match="after release"):
        seg.address(me, 0, 1)


@pytest.mark.mpi(min_size=1)
def test_segment_bad_size_fails_on_every_rank(shared_tp):
    tp = shared_tp
    me, n = tp.topology.rank, tp.topology.world_size
    with pytest.raises(TransportArgumentError, match=f"rank {n - 1}: nbytes must be a non-negative int"):
        tp.create_segment("bad", -1 if me == n - 1 else 4096)
    assert _files_of_this_process() == []  # the good ranks' files were unlinked too
    with pytest.raises(TransportRuntimeError, match=f"rank {n - 1}: cannot create {1 << 80} B"):
        tp.create_segment("huge", 1 << 80 if me == n - 1 else 4096)  # beyond off_t: OverflowError inside
    assert _files_of_this_process() == []
    empty = tp.create_segment("none", 0)
    assert empty.sizes == dict.fromkeys(range(n), 0)
    with pytest.raises(TransportArgumentError):
        empty.view(me, 0, 1)


@pytest.mark.mpi(min_size=1)
def test_segment_tensors_outlive_destroy_and_release(tp):
    me, n = tp.topology.rank, tp.topology.world_size
    seg = tp.create_segment("keep", 1 << 16)
    kept = seg.view((me + 1) % n, 0, 1 << 16).view(torch.int32)
    kept.copy_(torch.arange(1 << 14, dtype=torch.int32) * (me + 1))
    seg.release()
    del seg
    tp.destroy()  # the segment is not a window: destroy does not refuse, and does not unmap it
    gc.collect()
    assert torch.equal(kept, torch.arange(1 << 14, dtype=torch.int32) * (me + 1))
