"""SymmetricWindow: equal sizes enforced collectively, zero-copy views (docs/design/transports.md §2.1, §3.1, §8)."""

from __future__ import annotations

import pytest
import torch

from deepep_ascend.transports import TransportArgumentError


@pytest.mark.mpi(min_size=2)
def test_window_sizes_must_be_equal(shared_tp):
    tp = shared_tp
    me, n = tp.topology.rank, tp.topology.world_size
    # Different data sizes on different ranks: the same error on every rank, nothing allocated.
    with pytest.raises(TransportArgumentError) as ei:
        tp.create_window("uneven", 4096 if me == 0 else 8192, 2)
    assert f"rank {me}" in str(ei.value) and "uneven" in str(ei.value)
    # Different slot counts too.
    with pytest.raises(TransportArgumentError):
        tp.create_window("uneven_slots", 4096, 2 if me == n - 1 else 3)
    # The transport stays usable: an equal window builds and moves data.
    win = tp.create_window("even", 4096, 2)
    assert win.nbytes == 4096 and win.num_slots == 2
    tp.put(win, (me + 1) % n, 0, torch.full((16,), me + 1, dtype=torch.uint8))
    tp.barrier()
    assert torch.equal(tp.local_view(win, 0, 16), torch.full((16,), (me - 1) % n + 1, dtype=torch.uint8))


@pytest.mark.mpi(min_size=1)
def test_window_larger_than_the_hosts_free_shared_memory_is_refused():
    """A window whose segments on one host, with the windows mapped there already, add up to more than /dev/shm's
    free space is refused on every rank before anything is mapped (MPI would map it sparsely and a store past the
    free space would raise SIGBUS); each segment alone fits, so only the sum over the host's ranks decides. So is a
    shared segment (which reserves its pages) that fits only by taking the pages those windows still need. The
    transport stays usable."""
    import os

    from mpi4py import MPI

    from deepep_ascend.transports import SharedMemoryExhausted, SymmetricWindow

    from .helpers import destroy_quietly, make_transport

    tp = make_transport()  # its own: the large window below must not outlive the test
    try:
        st = os.statvfs("/dev/shm")
        free = tp.comm.allreduce(st.f_bavail * st.f_frsize, op=MPI.MIN)
        local = tp.comm.allreduce(1 if MPI.Get_processor_name() == tp.comm.bcast(MPI.Get_processor_name()) else 0)
        n = tp.topology.world_size
        if local != n:
            pytest.skip("ranks on more than one host")
        margin = 64 << 20
        nbytes = free // n + margin  # the host's sum is over the free space by n x 64 MiB; one segment is not
        assert SymmetricWindow.total_bytes(nbytes, 1, n) * n > free and (n == 1 or nbytes < free)
        with pytest.raises(SharedMemoryExhausted) as ei:
            tp.create_window("too_big", nbytes, 1)
        msg = str(ei.value)
        assert f"rank {tp.topology.rank}: create_window('too_big'): its {n} ranks on host" in msg, msg
        assert f"would map {n * SymmetricWindow.total_bytes(nbytes, 1, n):,} B" in msg and "/dev/shm" in msg, msg
        fits = max(0, (free - 2 * n * margin) // n)  # a sum under the free space is taken (its pages never touched)
        win = tp.create_window("fits", fits, 1)
        assert win.nbytes == fits
        # a segment of 2 x 64 MiB per rank fits the free space alone, not beside that window's pages
        with pytest.raises(SharedMemoryExhausted, match=r"create_segment\('landing'\): its \d+ ranks on host .* "
                                                        r"beside the .* of windows mapped there already"):
            tp.create_segment("landing", 2 * margin + (4 << 20))
        small = tp.create_window("small", 4096, 1)  # still usable
        me = tp.topology.rank
        tp.put(small, me, 0, torch.full((8,), 7, dtype=torch.uint8))
        assert tp.local_view(small, 0, 8).eq(7).all()
        tp.barrier()
    finally:
        destroy_quietly(tp)


@pytest.mark.mpi(min_size=1)
def test_window_negative_sizes_rejected(shared_tp):
    tp = shared_tp
    with pytest.raises(TransportArgumentError):
        tp.create_window("neg", -1, 1)
    with pytest.raises(TransportArgumentError):
        tp.create_window("neg_slots", 64, -1)


@pytest.mark.mpi(min_size=1)
def test_zero_size_window(shared_tp):
    tp = shared_tp
    me = tp.topology.rank
    win = tp.create_window("empty", 0, 1)
    assert win.nbytes == 0
    tp.put(win, me, 0, torch.empty(0, dtype=torch.uint8))  # zero-byte put: a counted no-op
    assert tp.local_view(win, 0, 0).numel() == 0
    with pytest.raises(TransportArgumentError):
        tp.put(win, me, 0, torch.zeros(1, dtype=torch.uint8))
    tp.signal(win, me, 0)  # the control region still works
    assert tp.wait_until(win, 0, [me], 1) == []


@pytest.mark.mpi(min_size=1)
def test_views_are_zero_copy(shared_tp):
    tp = shared_tp
    me = tp.topology.rank
    win = tp.create_window("zc", 8192, 1)
    a = tp.local_view(win, 0, 64)
    b = tp.peer_view(win, me, 0, 64)
    # The same memory every time, no copy: equal pointers, and the pointer is the shared segment's
    # address past the control region (white box: win._bufs holds the mpi4py buffers).
    assert a.data_ptr() == b.data_ptr() == win._bufs[me].address + win.control_bytes
    assert tp.local_view(win, 128, 16, torch.int64).data_ptr() == a.data_ptr() + 128
    a.fill_(0x3C)
    assert int(b[7]) == 0x3C
    # Typed views: shape and dtype follow nbytes / itemsize.
    v = tp.local_view(win, 256, 64, torch.float32)
    assert v.dtype == torch.float32 and v.shape == (16,)
    v.copy_(torch.arange(16, dtype=torch.float32))
    assert torch.equal(tp.local_view(win, 256, 64).view(torch.float32), torch.arange(16, dtype=torch.float32))
    bf = tp.local_view(win, 512, 8, torch.bfloat16)
    assert bf.shape == (4,)


@pytest.mark.mpi(min_size=1)
def test_store_through_peer_view_seen_by_owner(shared_tp):
    tp = shared_tp
    me, n = tp.topology.rank, tp.topology.world_size
    win = tp.create_window("pv", 64 * 1024, 1)
    chunk = 1024
    # Every rank stores a rank-coded block into every rank's window (including its own) through
    # peer_view, at the block reserved for it.
    for p in range(n):
        view = tp.peer_view(win, p, me * chunk, chunk, torch.int32)
        view.copy_(torch.arange(chunk // 4, dtype=torch.int32) * 1000 + me * 7 + p)
        del view
    tp.barrier()
    for src in range(n):
        got = tp.local_view(win, src * chunk, chunk, torch.int32)
        want = torch.arange(chunk // 4, dtype=torch.int32) * 1000 + src * 7 + me
        assert torch.equal(got, want), f"block written by rank {src}"
    tp.barrier()
    # And the other way: the owner stores through local_view, peers load through peer_view.
    tp.local_view(win, 32 * 1024, 8, torch.int64).fill_(me * 1_000_003 + 5)
    tp.barrier()
    for p in range(n):
        assert int(tp.peer_view(win, p, 32 * 1024, 8, torch.int64)[0]) == p * 1_000_003 + 5


@pytest.mark.mpi(min_size=1)
def test_windows_are_independent(shared_tp):
    tp = shared_tp
    me, n = tp.topology.rank, tp.topology.world_size
    w1 = tp.create_window("one", 4096, 2)
    w2 = tp.create_window("two", 4096, 2)
    # Data regions start undefined (not zeroed: with one rank per node MPICH may back the window
    # with recycled heap memory); set them first.
    tp.local_view(w1, 0, 4096).fill_(0)
    tp.local_view(w2, 0, 4096).fill_(0x22)
    tp.barrier()
    tp.put(w1, (me + 1) % n, 0, torch.full((4096,), 0x11, dtype=torch.uint8))
    tp.signal(w1, (me + 1) % n, 1, add=5)
    tp.barrier()
    assert bool((tp.local_view(w2, 0, 4096) == 0x22).all())
    assert tp.read_signal(w2, 1, (me - 1) % n) == 0
    assert tp.read_signal(w1, 1, (me - 1) % n) == 5
    assert bool((tp.local_view(w1, 0, 4096) == 0x11).all())
