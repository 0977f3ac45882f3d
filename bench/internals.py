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


def onednn_available() -> bool:
    """Whether the grouped GEMMs can pack weights for oneDNN's inner product on this host."""
    return bool(_packing.ONEDNN)


def grouped_gemm_packer():
    """What the library's grouped GEMMs run on here: ``"amx"``, ``"onednn"`` or ``None`` (``torch.matmul``)."""
    return _packing.PACKER


__all__ = ["CombineScratch", "abort_job", "accumulate_rows", "activation", "dense_nt", "dequant_x", "exit_job",
           "expert_gemm", "gemm_engine", "grouped_gemm_packer", "host_empty", "ll_zeros", "mpiexec_path",
           "onednn_available", "operand_dtype", "pack_fp4_groups", "pack_groups", "source_runs", "swiglu_params",
           "two_source_run_limit", "untransformed"]
