"""``bench.internals.ll_floor_trip``, the floor ``bench overhead`` reports beside the low-latency calls: the same
combined rows as ``low_latency_dispatch`` + ``low_latency_combine``, call after call, and no floor where the fused
path does not run."""

from __future__ import annotations

import pytest
import torch
from mpi4py import MPI

from bench.internals import ll_floor_trip
from bench.workload import make_workload
from deepep_ascend import Buffer, native
from tests.support.mpi_utils import up_to_four_ranks, world

pytestmark = [pytest.mark.mpi(min_size=1),
              pytest.mark.skipif(not native.ll_available(), reason="native kernels not built")]


def _buffer(comm, tokens, hidden, experts):
    return Buffer(None, 0, Buffer.get_low_latency_rdma_size_hint(tokens, hidden, comm.Get_size(), experts),
                  low_latency_mode=True, comm=comm, explicitly_destroy=True)


@up_to_four_ranks()
def test_the_floor_sums_what_the_public_calls_sum():
    comm = world()
    tokens, hidden, topk, experts = 5, 256, 3, 4 * comm.Get_size()
    wl = make_workload(tokens, hidden, topk, experts, comm.Get_rank(), comm.Get_size(), seed=3)
    buf = _buffer(comm, tokens, hidden, experts)
    try:
        trip = ll_floor_trip(buf, wl.x, wl.topk_idx, wl.topk_weights, tokens, experts)
        assert comm.allreduce(trip is not None, op=MPI.LAND), "the fused path runs on one node"
        for _ in range(3):  # both window halves, and the reused outputs' stale rows
            recv_x, _, handle, _, _ = buf.low_latency_dispatch(wl.x, wl.topk_idx, tokens, experts, use_fp8=False)
            want = buf.low_latency_combine(recv_x, wl.topk_idx, wl.topk_weights, handle)[0].clone()
            got = trip()
            assert torch.equal(got, want)
            # an independent reference: identity experts, so each token's rows are x, summed with its weights
            ref = (wl.x.float() * wl.topk_weights.masked_fill(wl.topk_idx < 0, 0).sum(1, keepdim=True)).bfloat16()
            assert (got.float() - ref.float()).abs().max() <= 0.02 * ref.float().abs().max()
    finally:
        buf.destroy()


@up_to_four_ranks()
def test_no_floor_where_the_fused_path_does_not_run(monkeypatch):
    comm = world()
    monkeypatch.setenv("DEEPEP_ASCEND_LL_FUSED", "0")  # read when a Buffer is built
    tokens, hidden, topk, experts = 2, 128, 2, 2 * comm.Get_size()
    wl = make_workload(tokens, hidden, topk, experts, comm.Get_rank(), comm.Get_size())
    buf = _buffer(comm, tokens, hidden, experts)
    try:
        assert ll_floor_trip(buf, wl.x, wl.topk_idx, wl.topk_weights, tokens, experts) is None
    finally:
        buf.destroy()
