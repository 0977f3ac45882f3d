"""Numpy integers in the V1 API: DeepEP's bindings take any integer with ``__index__``, so ported code may pass a
``numpy.int64`` where DeepEP's signature says ``int`` (a size computed with numpy, an expert count read from an
array). Each such argument is the int it holds: the same checks, header words, sizes and bits as with ints, also when
only one rank passes numpy integers. ``EPBuffer``'s own case is in ``test_ep_buffer.py``.

Run: ``mpiexec -n N python -m pytest --with-mpi -q tests/ep/test_numpy_integers.py`` (N = 1, 2, 4).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepep_ascend import Buffer, Config, EPBuffer
from tests.support.buffer_helpers import BF16, all_ranks_ok, bits, coll, make_topk_idx

pytestmark = pytest.mark.mpi(min_size=1)

N, H, K, E_PER_RANK, M = 12, 256, 2, 4, 16


def _inputs(comm):
    r, R = comm.Get_rank(), comm.Get_size()
    gen = torch.Generator().manual_seed(40 + r)
    idx = make_topk_idx("uniform", N, E_PER_RANK * R, K, r, R, gen)
    return torch.randn(N, H, generator=gen).to(BF16), idx, torch.rand(N, K, generator=gen)


def test_size_hints_and_config_take_numpy_integers_and_give_ints(comm):
    """The size hints are Python ints equal to the int arguments' (a numpy value would be refused by the very
    constructor it sizes), and ``Config`` takes numpy integers as DeepEP's bound ``Config`` does."""
    R, i = comm.Get_size(), np.int64
    hints = [(Buffer.get_normal_buffer_size_hint(i(N), i(H), i(R), i(K), i(E_PER_RANK * R)),
              Buffer.get_normal_buffer_size_hint(N, H, R, K, E_PER_RANK * R)),
             (Buffer.get_low_latency_rdma_size_hint(i(M), i(H), i(R), i(E_PER_RANK * R)),
              Buffer.get_low_latency_rdma_size_hint(M, H, R, E_PER_RANK * R))]
    ok = all(type(got) is int and got == want for got, want in hints)
    config = Config(i(20), i(6), i(256), i(6), i(256))
    ok &= all(type(v) is int for v in (config.num_sms, config.num_max_nvl_chunked_send_tokens))
    all_ranks_ok(comm, ok, f"hints {hints}, config {config}")


def test_size_hints_of_narrow_numpy_integers_do_not_overflow(comm):
    """DeepSeek-V3-sized hints from ``numpy.int32`` / ``numpy.uint16`` arguments: numpy arithmetic on them wraps
    around silently (a negative or far too small size); the hints compute in Python ints, so they equal the ints'
    hints exactly."""
    from deepep_ascend import EngramBuffer

    cases = [(Buffer.get_low_latency_rdma_size_hint, (1024, 7168, 8, 256)),
             (Buffer.get_normal_buffer_size_hint, (4096, 7168, 64, 8, 256)),
             (Buffer.get_normal_rdma_buffer_size_hint, (4096, 7168, 64, 8, 8, 256)),
             (lambda *a: EPBuffer.get_buffer_size_hint(comm, *a), (8192, 7168, 8)),
             (Config().get_nvl_buffer_size_hint, (14336, 8)),
             (lambda e, *a: EngramBuffer.get_storage_size_hint(comm, [e], *a), (1000000, 7168, 40960, 8))]
    bad = []
    for fn, args in cases:
        want = fn(*args)
        for kind in (np.int32, np.uint16):
            if all(v <= np.iinfo(kind).max for v in args):
                got = fn(*map(kind, args))
                if got != want or type(got) is not type(want) or (isinstance(got, tuple)
                                                                     and any(type(v) is not int for v in got)):
                    bad.append((args, kind.__name__, got, want))
    all_ranks_ok(comm, not bad, f"hints from narrow numpy integers: {bad}")


def test_normal_mode_numpy_integers_are_the_ints_they_hold(comm):
    """``Buffer(num_nvl_bytes=numpy.int64)``, ``get_dispatch_layout(num_experts=numpy.int64)`` and ``dispatch``'s
    ``expert_alignment`` / ``num_worst_tokens`` as numpy integers on the last rank only: the same call on every rank,
    the same bits as with ints."""
    R, r = comm.Get_size(), comm.Get_rank()
    E = E_PER_RANK * R
    num = np.int64 if r == R - 1 else int
    buf = coll(lambda: Buffer(None, num(Buffer.get_normal_buffer_size_hint(N, H, R, K, E)), comm=comm,
                              explicitly_destroy=True))
    try:
        x, idx, w = _inputs(comm)

        def trip(e, alignment, worst):
            ntpr, _, ntpe, itr, _ = buf.get_dispatch_layout(idx, e)
            recv_x, _, recv_w, counts, handle, _ = buf.dispatch(
                x, num_tokens_per_rank=ntpr, is_token_in_rank=itr, num_tokens_per_expert=ntpe, topk_idx=idx,
                topk_weights=w, expert_alignment=alignment, num_worst_tokens=worst)
            combined, _, _ = buf.combine(recv_x, handle, topk_weights=recv_w)
            return recv_x.clone(), counts, combined

        got = coll(lambda: trip(num(E), num(4), num(R * N)), what="round trip, numpy integers")
        want = coll(lambda: trip(E, 4, R * N), what="round trip, ints")
        all_ranks_ok(comm, torch.equal(bits(got[0]), bits(want[0])) and got[1] == want[1]
                     and all(type(c) is int for c in got[1]) and torch.equal(bits(got[2]), bits(want[2])),
                     f"rank {r}: numpy integers changed the round trip")
    finally:
        coll(buf.destroy, what="destroy")


def test_low_latency_numpy_integers_are_the_ints_they_hold(comm):
    """``low_latency_dispatch``'s ``M`` and ``E``, and ``clean_low_latency_buffer``'s arguments, as numpy integers
    on the last rank only: the ranks agree on the call, and the rows are those of ints."""
    R, r = comm.Get_size(), comm.Get_rank()
    E = E_PER_RANK * R
    num = np.int64 if r == R - 1 else int
    buf = coll(lambda: Buffer(None, 0, num(Buffer.get_low_latency_rdma_size_hint(M, H, R, E)),
                              low_latency_mode=True, num_qps_per_rank=num(E_PER_RANK), comm=comm,
                              explicitly_destroy=True))
    try:
        x, idx, w = _inputs(comm)

        def trip(m, e):
            recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, idx, m, e, use_fp8=False)
            combined, _, _ = buf.low_latency_combine(recv_x, idx, w, handle)
            return recv_x.clone(), count.clone(), combined

        got = coll(lambda: trip(num(M), num(E)), what="LL round trip, numpy integers")
        coll(lambda: buf.clean_low_latency_buffer(num(M), num(H), num(E)), what="clean_low_latency_buffer")
        want = coll(lambda: trip(M, E), what="LL round trip, ints")
        all_ranks_ok(comm, all(torch.equal(bits(a), bits(b)) for a, b in zip(got, want)),
                     f"rank {r}: numpy integers changed the LL round trip")
    finally:
        coll(buf.destroy, what="destroy")


def test_ep_buffer_byte_counts_take_numpy_integers(comm):
    """``EPBuffer(num_bytes=numpy.int64, lb_allocation_plan_or_num_bytes=numpy.int64)`` builds, and a dispatch with
    ``num_experts`` a numpy integer on the last rank gives the rows of ints."""
    R, r = comm.Get_size(), comm.Get_rank()
    E = E_PER_RANK * R
    num = np.int64 if r == R - 1 else int
    size = EPBuffer.get_buffer_size_hint(comm, N, H, K)
    buf = coll(lambda: EPBuffer(comm, num_bytes=num(size), lb_allocation_plan_or_num_bytes=num(0),
                                explicitly_destroy=True))
    try:
        x, idx, w = _inputs(comm)
        got = coll(lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=num(E),
                                        num_max_tokens_per_rank=N)[0].clone())
        want = coll(lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E,
                                         num_max_tokens_per_rank=N)[0])
        all_ranks_ok(comm, torch.equal(bits(got), bits(want)), f"rank {r}: numpy num_experts changed the rows")
    finally:
        coll(buf.destroy, what="destroy")
