"""Every library internal the benchmarks use, imported here and nowhere else.

The commands import the library through its public names (``deepep_ascend.Buffer``, the DeepGEMM
functions, ``deepep_ascend.native``'s kernels, ``deepep_ascend.transports``' link model); what
they time or compare below the public API comes from this module, so that a change of the
library's internal layout is a change of this file alone.

=============================  ===============================================================
name here                      library internal (what a command does with it)
=============================  ===============================================================
``exit_job``, ``abort_job``    ``deepep_ascend.transports.process``: the MPI exit path
``mpiexec_path``               ``deepep_ascend.transports.process``: the sweep's launcher
``ll_zeros``                   ``deepep_ascend.ep.low_latency.zeros``: low-latency expert outputs
``host_empty``                 ``deepep_ascend.ep.memory.empty``: huge-page outputs (alloc)
``accumulate_rows``,           ``deepep_ascend.ep.reduce``: combine's row sum and its paths
``source_runs``,                 (combine-sum)
``two_source_run_limit``,
``CombineScratch``
``pack_groups``,               ``deepep_ascend.gemm.packing.pack_groups`` /
``pack_fp4_groups``              ``pack_fp4_groups``: weight packing (grouped-gemm)
``onednn_available()``,        ``deepep_ascend.gemm.packing.ONEDNN`` / ``PACKER``
``grouped_gemm_packer()``
``gemm_engine``,               ``deepep_ascend.mega_moe.experts``: MegaMoE's GEMM engine, per-expert
``expert_gemm``,                 GEMMs, operand dtype, dense GEMM, FP8 decode and SwiGLU;
``operand_dtype``,               ``deepep_ascend.mega_moe.weights.untransformed``: its cached
``dense_nt``, ``untransformed``,
``dequant_x``, ``activation``,   weights (mega-moe, grouped-gemm, moe-act)
``swiglu_params``
``logfmt_encode``,             ``deepep_ascend.gemm.logfmt.encode`` / ``decode``: LogFMT-10 on either
``logfmt_decode``,               path (``native=``), ``logfmt10_group_mask`` (logfmt)
``logfmt_group_mask``
``ll_floor_trip``              ``deepep_ascend.ep.low_latency.LowLatencyEngine``'s fused plan: a low-latency
                                 round trip of its native calls alone (overhead)
=============================  ===============================================================
"""
from __future__ import annotations

from deepep_ascend.ep import low_latency as _low_latency
from deepep_ascend.ep import memory as _memory
from deepep_ascend.ep import reduce as _reduce
from deepep_ascend.gemm import logfmt as _logfmt
from deepep_ascend.gemm import packing as _packing
from deepep_ascend.mega_moe.experts import (
    activation,
    dense_nt,
    dequant_x,
    expert_gemm,
    gemm_engine,
    operand_dtype,
    swiglu_params,
)
from deepep_ascend.mega_moe.weights import untransformed
from deepep_ascend.transports.process import abort_job, exit_job, mpiexec_path

ll_zeros = _low_latency.zeros
host_empty = _memory.empty

accumulate_rows = _reduce.accumulate_rows
source_runs = _reduce.source_runs
two_source_run_limit = _reduce.two_source_run_limit
CombineScratch = _reduce.CombineScratch

logfmt_encode = _logfmt.encode
logfmt_decode = _logfmt.decode
logfmt_group_mask = _logfmt.logfmt10_group_mask

pack_groups = _packing.pack_groups
pack_fp4_groups = _packing.pack_fp4_groups


def ll_floor_trip(buf, x, topk_idx, topk_weights, num_max_dispatch_tokens_per_rank: int, num_experts: int):
    """A callable running one low-latency round trip (BF16 dispatch, then the combine of the received rows) of
    ``buf`` through its engine's fused plan and nothing else: the call numbers, the headers and the four native
    calls (issue and finish of each), on outputs allocated once here and the route computed once here. No argument
    checks, pooled outputs, handle, stamps, traffic counters or abort checks: the floor a DeepEP call on this data
    path pays before its own Python. The callable returns ``combined_x`` ``[N, H]`` bf16 (the same tensor each
    time), or None where the fused path does not run (``buf`` spans nodes, masks ranks, or the kernels are not
    built). Collective, as the calls it makes; every rank must call it alike, as the public calls."""
    import torch

    from deepep_ascend.ep.low_latency_arguments import check_low_latency_dispatch_args

    ll = buf._ll
    m, e = num_max_dispatch_tokens_per_rank, num_experts
    lay, route = check_low_latency_dispatch_args(
        x, topk_idx, m, e, None, None, False, False, False, num_ranks=buf.group_size,
        num_rdma_bytes=buf.num_rdma_bytes, qp_depth=buf.nvshmem_qp_depth)
    plan = ll._fused_plan(lay, None) if route is not None and ll.native_path() else None
    if plan is None:
        return None
    n, h_ = x.shape
    num_local, rows = lay.L, buf.group_size * m
    recv_x = torch.zeros(num_local, rows, h_, dtype=torch.bfloat16)
    src_info = torch.zeros(num_local, rows, dtype=torch.int32)
    recv_count = torch.zeros(num_local, dtype=torch.int32)
    layout_range = torch.zeros(num_local, buf.group_size, dtype=torch.int64)
    combined = torch.empty(n, h_, dtype=torch.bfloat16)
    stale = torch.empty_like(recv_count)  # the rows the last trip wrote, which a receive zeroes past its own
    mb = _low_latency.MSG_HEADER + 2 * h_

    def finish(call, half, seq, op, flags):  # the engine's: the bounded poll, then (a peer late) its long wait
        return ll._finish(plan, lambda polls, timed: call(polls), half, seq, op, lay, flags, "ll_floor_trip", "copy")

    def trip():
        seq, half = ll.begin(_low_latency.OP_DISPATCH)
        hdr = ll._header(seq, _low_latency.OP_DISPATCH, 0, lay, _low_latency.F_PULL)
        if plan.dispatch_issue(half, route.slots, route.counts, ll._sent_rows, 1, x, False, False, mb, hdr, seq + 1):
            raise RuntimeError("ll_floor_trip: the dispatch's issue refused its operands")
        stale.copy_(recv_count)
        st = finish(lambda p: plan.dispatch_finish(half, seq, p, mb, recv_x.view(torch.uint8), None, src_info,
                                                   recv_count, layout_range, (stale, None, stale)),
                    half, seq, _low_latency.OP_DISPATCH, _low_latency.F_PULL)
        if st:
            raise RuntimeError(f"ll_floor_trip: the dispatch's finish returned status {st}")
        dispatch = seq + 1
        seq, half = ll.begin(_low_latency.OP_COMBINE)
        hdr = ll._header(seq, _low_latency.OP_COMBINE, 0, lay, 0, handle_id=dispatch)
        if plan.combine_issue(half, layout_range, recv_x, 1, False, ll._sent_rows, hdr, seq + 1):
            raise RuntimeError("ll_floor_trip: the combine's issue refused its operands")
        st = finish(lambda p: plan.combine_finish(half, seq, p, route.slots, topk_weights, route.counts, combined,
                                                  recv_x, layout_range), half, seq, _low_latency.OP_COMBINE, 0)
        if st:
            raise RuntimeError(f"ll_floor_trip: the combine's finish returned status {st}")
        return combined

    return trip


def onednn_available() -> bool:
    """Whether the grouped GEMMs can pack weights for oneDNN's inner product on this host."""
    return bool(_packing.ONEDNN)


def grouped_gemm_packer():
    """What the library's grouped GEMMs run on here: ``"amx"``, ``"onednn"`` or ``None`` (``torch.matmul``)."""
    return _packing.PACKER


__all__ = ["CombineScratch", "abort_job", "accumulate_rows", "activation", "dense_nt", "dequant_x", "exit_job",
           "expert_gemm", "gemm_engine", "grouped_gemm_packer", "host_empty", "ll_floor_trip", "ll_zeros",
           "mpiexec_path", "onednn_available", "operand_dtype", "pack_fp4_groups", "pack_groups", "source_runs",
           "swiglu_params", "two_source_run_limit", "untransformed"]
