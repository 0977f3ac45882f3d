"""MegaMoE on CPU ranks: DeepGEMM's fused dispatch → L1 GEMM → SwiGLU → L2 GEMM → combine (mega-moe.md).

Public surface (DeepGEMM 2.6 names, exported at the package top level):

* :func:`get_symm_buffer_for_mega_moe` → :class:`SymmBuffer` (views ``x``, ``x_sf``, ``topk_idx``,
  ``topk_weights`` that callers fill before every call, plus scratch views kept for parity);
* :func:`transform_weights_for_mega_moe` (upstream's L1 interleave and scale-factor order);
* :func:`bf16_mega_moe` and :func:`fp8_fp4_mega_moe`, writing ``y [num_tokens, hidden]`` bf16.

How a call runs (design.md "mega_moe.py"; mega-moe.md §5, CPU design)
-----------------------------------------------------------------------
Two backends (``sym_buffer.backend``, chosen at construction; the same ``y`` bit for bit):

* ``shm`` (the default when every rank is on one node; mega-moe.md §5 "shm pulls from peer windows"):
  the views ``x``, ``x_sf``, ``topk_idx``, ``topk_weights`` lie in a node-shared segment
  (:meth:`transports.Transport.create_segment`) that every rank maps, next to an output area for
  the L2 rows a rank computes. After the consensus every rank's inputs are final, so a dispatch is a
  pull: each rank gathers its experts' pair rows straight from the peers' views (one copy, no
  synchronisation). L2 writes into the output area, and after one barrier every rank sums its pairs'
  rows where they lie in their owners' areas (positions from the all-gathered counts): the combine
  is the final sum's reads. A call is two synchronisations: the consensus and that barrier. A call
  whose received rows overfill some rank's area (only when the area is capped at 256 MiB) takes
  the Buffer's path, on every rank alike.
* ``buffer`` (across nodes, or asked for): rows move through the normal-mode
  :class:`deepep_ascend.Buffer` that the symmetric buffer owns (``sym_buffer.ep_buffer``;
  dispatch of pair rows, combine with the dispatch's handle). No low-latency path is used.

1. **Validation, then consensus.** Each rank checks its own arguments (shapes, dtypes, sizes,
   ``num_tokens <= num_max_tokens_per_rank``, expert ids, weights against the buffer) *before*
   anything moves; then the ranks meet at the transport's barrier (it sleeps while it waits and
   has the Buffer's deadline: a rank that never comes is named in a ``TimeoutError``, not waited
   for forever), which carries each rank's verdict, token count and per-expert pair counts: in
   its segment (``shm``; read after the barrier) or in one small all-gather after it (``buffer``;
   polled the same way). If any rank failed, every rank raises: the failing
   rank its own error (``TypeError``/``ValueError``), the others a
   :class:`deepep_ascend.ConsensusError` (a ``ValueError``) naming it. The buffer stays usable.
2. **Pairs, not tokens.** Every valid (token, k) slot is one dispatched row (upstream's
   convention: a token routed twice to one rank is sent twice). So each returned row of the
   combine has exactly one contributor, the Buffer's float32 combine sum is exact, and the final
   reduction can follow the reference: ``y = bf16(Σ_k o_k [+ shared])`` in ascending ``k``.
3. **Expert waves.** Local experts are cut into waves of ``num_experts_per_wave`` (same on every
   rank; keyword ``num_experts_per_wave`` or ``$DEEPEP_ASCEND_MEGA_MOE_EXPERTS_PER_WAVE``). The
   default, from the all-gathered counts, is one wave per 24 MiB that a rank moves (dispatch and
   combine bytes of the pairs it receives, on average), rounded, between 1 and ``min(4, E_l)``.
   With the ``buffer`` backend every wave costs a cross-rank synchronisation per dispatch and
   combine (waiting for the slowest rank included) and hides only its share of the data movement,
   so small payloads run as one wave (``shm`` waves need no synchronisation, only a hand-off to the
   worker; the same rule keeps the results of both backends alike). Measured here (``python -m bench mega-moe --compare-waves 1,2,4``; README):
   ``cpu-pro-mini`` (9.5 MB per rank) ran as fast with one wave as with two and slower with four;
   ``cpu-comm-heavy`` (50 MB) ran 23-35 % slower with one wave than with two. Wave ``w``
   dispatches the pairs whose local expert id (``e % E_l``) lies in the wave. Received rows are
   sorted (stably) by expert, so the order is expert, source rank, token, k (mega-moe.md §5).
4. **Grouped GEMMs.** Each wave's rows are sorted (stably) by local expert, unpadded: a fused op
   needs no aligned layout in memory, so the zero-padded m-grouped contiguous layout (and its two
   scatter/gather copies per GEMM) that the public :func:`m_grouped_bf16_gemm_nt_contiguous` takes
   is never built; each expert's rows are one GEMM (:func:`_expert_gemm`).
   L1 and L2 multiply exact bf16 values with float32 accumulation, on copies of the
   un-transformed weights cached by tensor identity and version (FP4 weights: the FP4 copies the
   AMX kernel decodes itself where it runs and their scales qualify, else dequantized), packed once
   where the CPU has native bf16, for the AMX kernel (which writes each expert's rows straight into
   the wave's output) or else for oneDNN (only the packed copy is kept:
   :func:`deepep_ascend.gemm.packing.pack_groups`; switch for every weight cache:
   :func:`deepep_ascend.set_dequantized_weight_cache`). FP8 activations are
   dequantized per row before L1 (exact in bf16; e4m3 decoded by :func:`deepep_ascend.e4m3_to_float`,
   and the float32 engine takes L1's and L2's inputs as float32 holding those bf16 values, with
   no bf16 round trip). The engine (:func:`gemm_engine`) is that
   bf16 GEMM where the CPU has native bf16 (AMX / AVX512-BF16), else one float32
   matmul per expert on the same values (same math, only the summation order may differ; the
   cache then holds float32, ``12·H·I`` bytes per expert instead of ``6·H·I``): on the AVX2-only
   EPYC of this VM torch's bf16 matmul ran at 0.4-7 GFLOP/s against 17-44 for float32.
5. **Pipeline.** The caller's thread computes, the Buffer's worker communicates; torch's GEMMs and
   copies release the GIL. ``shm``: the worker pulls wave ``w+1`` (issued after L1(w)) while the
   caller runs SwiGLU and L2 of wave ``w``; wave 0 is pulled on the caller, which needs it at once; the
   shared expert runs before the barrier. ``buffer`` (``async_finish=True`` +
   :class:`~deepep_ascend.EventOverlap`), per wave ``w``::

        wait dispatch(w) ─ L1(w) ║ worker: combine(w-1)
        issue dispatch(w+1) ─ SwiGLU(w), L2(w) ║ worker: dispatch(w+1) data
        issue combine(w)

   and the shared expert (if any) runs while the last combine is in flight (with one wave, that
   is the only overlap: the dispatch is waited for at once). With
   ``overlap=False`` (keyword) the same waves run with synchronous calls, one stage after the
   other (the in-library baseline; same row partitions, so the same ``y`` bit for bit).

Math (mega-moe.md §2): ``X`` = ``x`` (bf16) or e4m3 × UE8M0 per 32 channels; ``h = W1[e] @ X``
(fp32 accumulation); ``g = bf16(h[:I])``, ``u = bf16(h[I:])``; clamp ``c``: ``g = min(g, bf16(c))``,
``u = clamp(u, -bf16(c), bf16(c))`` in bf16; ``a = silu(g) · u · w`` in fp32 with
``silu(g) = g / (1 + exp(-g))`` (``fast_math=True``: ``g · (1 / (1 + exp(-g)))``); fp8 path:
``â = e4m3(a / s) · s`` with ``s = ceil_to_ue8m0(max(amax, 1e-4) / 448)`` per 32 channels, bf16
path ``â = bf16(a)``; ``o = bf16(W2[e] @ â)``; ``y = bf16(Σ_k o_k + shared)`` in fp32, ascending k.

Shared experts (mega-moe.md §1.4, DeepGEMM-Ascend parity): ``num_shared_experts`` S on the
buffer; ``shared_l1_weights`` ``[2·S·I, H]`` (gate rows ``0..S·I-1``, then up rows; **not**
transformed) and ``shared_l2_weights`` ``[H, S·I]``, as bf16 tensors (bf16 op) or ``(data, sf)``
pairs (fp8 op: packed FP4 int8 ``[.., K/2]`` or e4m3 ``[.., K]`` data with packed UE8M0 int32
scales per 32 along K). Computed locally for all tokens with the same activation (clamp,
SwiGLU, weight 1, fp8 requantisation on the fp8 path) and added after the routed terms.

Tracing: every call leaves ``sym_buffer.last_trace`` (a :class:`MegaMoETrace`) with per-wave
compute intervals on the caller and communication intervals on the worker;
:meth:`MegaMoETrace.overlap` measures how much worker activity ran under compute.
"""

from __future__ import annotations

import math
import numbers
import pickle
import time
import warnings
from dataclasses import dataclass, field

import torch

from ..settings import (DG_COMM_KERNEL_DEBUG, MEGA_MOE_BACKEND, MEGA_MOE_EXPERTS_PER_WAVE, MEGA_MOE_GEMM,
                        SettingError)
from ..transports import Topology, TransportPoisoned, quiet_allgather_object

from .. import native as _native
from ..checks import check_storage
from ..ep.buffer import Buffer
from ..ep.failure import abort_peers, run_step
from ..ep.group import mpi_comm_of
from ..gemm import packing as _packing
from ..gemm import scales as _scales
from ..gemm.dequant import dequantize_operand, dequantize_weights
from ..gemm.fp8 import FP8_E4M3_MAX, cast_to_e4m3, e4m3_to_float, e4m3_ue8m0_round_trip_, per_token_cast_back_torch
from ..gemm.packing import amx_runs, mm_group, native_bf16, pack_fp4_groups, pack_groups, packed_nbytes
from ..gemm.weight_cache import cacheable, cached_by_tensors, optional_copy_fits
from ..native.operands import matrix_ok
from ..ep.protocol import ConsensusError
from ..ep.reduce import CombineScratch, accumulate_rows

__all__ = [
    "SymmBuffer",
    "bf16_mega_moe",
    "fp8_fp4_mega_moe",
    "get_symm_buffer_for_mega_moe",
    "transform_weights_for_mega_moe",
]

BF16 = torch.bfloat16
FP8 = torch.float8_e4m3fn
_TOKEN_ALIGN = 384  # LCM of upstream's block-M candidates (mega-moe.md §1.1)
_VIEW_ALIGN = 64
_INTERLEAVE = 8
_SF_GRAN = 32
_WAVE_BYTES = 24 << 20  # rows a rank moves (dispatch + combine) per wave by default; see _experts_per_wave
_MAX_WAVES = 4
_MAX_WINDOW_BYTES = 256 << 20
_MAX_OUT_BYTES = 256 << 20  # cap of the shm backend's L2 output area per rank (a fuller call takes the Buffer)
_BACKENDS = ("shm", "buffer")
_VERDICT_MSG, _VERDICT_CHARS = 16384, 2000  # shm consensus record: its length, then the pickled verdict
# e4m3 × 2**(b-127) is a multiple of 2**(b-136); bf16 holds multiples of 2**-133 exactly (so b >= 3)
_MIN_EXACT_SF_BYTE = 3


def gemm_engine() -> str:
    """``'bf16'`` (the library's m-grouped bf16 GEMMs) or ``'fp32'`` (float32 matmuls of the same bf16 values).

    ``$DEEPEP_ASCEND_MEGA_MOE_GEMM`` forces one; by default ``'bf16'`` where the CPU multiplies
    bf16 natively (AMX tiles or AVX512-BF16), else ``'fp32'``. Both compute exact products of
    bf16 operands with float32 accumulation and one bf16 rounding (only the summation order may
    differ); without native bf16, torch's bf16 matmul is 10-100x slower than its float32 one.

    Raises:
        SettingError: (a ValueError) the variable is set to anything else.
    """
    return MEGA_MOE_GEMM.get() or ("bf16" if native_bf16() else "fp32")


def _align(x: int, a: int) -> int:
    return -(-x // a) * a


def _dispatch_row_bytes(hidden: int, is_fp8: bool) -> int:
    """Bytes of one dispatched pair row: e4m3 data then one UE8M0 byte per 32 channels, or bf16."""
    return hidden + hidden // _SF_GRAN if is_fp8 else 2 * hidden


def _operand_dtype(engine: str) -> torch.dtype:
    """dtype of GEMM operands: bf16, or float32 holding bf16 values for the ``fp32`` engine (no round trip)."""
    return BF16 if engine == "bf16" else torch.float32


def _expert_gemm(engine: str, a: torch.Tensor, w, bounds: list, out: torch.Tensor | None = None) -> torch.Tensor:
    """``d [n, N]`` bf16: rows ``bounds[g]:bounds[g+1]`` of ``a [n, K]`` (sorted by expert, no padding rows)
    times ``w[g].T``, float32 accumulation, one bf16 rounding. ``w``: ``[G, N, K]``, or (``bf16`` engine) a
    tuple of ``G`` packed ``[N, K]`` weights, AMX or oneDNN (:func:`~deepep_ascend.gemm.packing.pack_groups`).
    ``bf16`` engine: bf16 operands; ``fp32``: one float32 matmul per group on the same bf16 values (``a``
    bf16 or float32 holding bf16 values, ``w`` float32). ``out``: a contiguous ``[n, N]`` bf16 tensor to
    write ``d`` into (returned), else a new one."""
    n = a.size(0)
    if engine == "bf16":
        packed = w if isinstance(w, tuple) else None
        d = out if out is not None else torch.empty(n, w[0].size(0) if packed else w.size(1), dtype=BF16)
        runs = [(g, bounds[g], bounds[g + 1]) for g in range(len(bounds) - 1) if bounds[g + 1] > bounds[g]]
        if not amx_runs(packed, d, lambda: a, runs):
            for g, s, e in runs:
                d[s:e] = mm_group(a[s:e], None if packed else w[g].t(), packed, g)
        return d
    af = a.float()
    df = torch.empty(n, w.size(1), dtype=torch.float32)
    for g in range(len(bounds) - 1):
        s, e = bounds[g], bounds[g + 1]
        if e > s:
            torch.matmul(af[s:e], w[g].t(), out=df[s:e])
    return df.to(BF16) if out is None else out.copy_(df)


# ----------------------------------------------------------------------------------------------
# symmetric buffer


class SymmBuffer:
    """The symmetric buffer of one rank (``deep_gemm.get_symm_buffer_for_mega_moe``'s result).

    Attributes:
        group: the group given to the constructor; ``ep_buffer``: the normal-mode
            :class:`~deepep_ascend.Buffer` (its transport's barrier and deadline; with the ``buffer``
            backend it moves the rows); ``num_ranks``, ``rank``.
        backend: ``'shm'`` (every rank in one UBMEM domain: peers pull inputs from each other's segments
            and read L2 outputs where they lie) or ``'buffer'`` (rows through the ``ep_buffer``).
        num_experts, num_topk, hidden, intermediate_hidden, num_shared_experts, mma_type,
        activation: the constructor's arguments; ``num_local_experts = num_experts // num_ranks``.
        num_max_tokens_per_rank: rounded up to a multiple of 384 (upstream's rule).
        num_ring_tokens: rows of the scratch ``l1_acts``/``l2_acts`` views (free on CPU).
        buffer: flat int8 tensor backing every view: this rank's part of a node-shared segment (``shm``;
            the same segment then holds an output area of ``min(R·Tmax·K, 256 MiB / 2H)`` rows of
            ``H`` bf16) or private memory (``buffer``).
        x: ``[Tmax, H]`` bf16 (``bf16xbf16``) or float8_e4m3fn (``fp8xfp4``).
        x_sf: ``[Tmax, H/128]`` int32, four UE8M0 bytes (one per 32 channels) per int, row-major
            (fp8 only; ``None`` for bf16).
        topk_idx: ``[Tmax, K]`` int64 global expert ids, -1 = masked slot.
        topk_weights: ``[Tmax, K]`` float32 (ignored where ``topk_idx`` is -1).
        l1_acts, l1_acts_sf, l2_acts, l2_acts_sf: scratch for parity (contents unspecified).
        last_trace: :class:`MegaMoETrace` of the last call (``None`` before the first).
    """

    def __init__(self, group, comm, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden,
                 mma_type, activation, num_shared_experts, timeout_s=None, backend=None):
        self.group = group
        self.num_ranks, self.rank = comm.Get_size(), comm.Get_rank()
        self.num_experts, self.num_topk = num_experts, num_topk
        self.hidden, self.intermediate_hidden = hidden, intermediate_hidden
        self.num_local_experts = num_experts // self.num_ranks
        self.num_max_tokens_per_rank = _align(max(1, num_max_tokens_per_rank), _TOKEN_ALIGN)
        self.mma_type, self.activation = mma_type, activation
        self.num_shared_experts = num_shared_experts
        self.is_fp8 = mma_type == "fp8xfp4"
        tmax, h, i = self.num_max_tokens_per_rank, hidden, intermediate_hidden
        self.num_ring_tokens = _align(min(tmax * num_topk * self.num_ranks, 2 * _TOKEN_ALIGN), _TOKEN_ALIGN)
        ring = self.num_ring_tokens
        act_dtype = FP8 if self.is_fp8 else BF16
        specs = [("x", (tmax, h), act_dtype)]
        if self.is_fp8:
            specs.append(("x_sf", (tmax, h // 128), torch.int32))
        specs += [("topk_idx", (tmax, num_topk), torch.int64), ("topk_weights", (tmax, num_topk), torch.float32),
                  ("l1_acts", (ring, h), act_dtype), ("l2_acts", (ring, i), act_dtype)]
        if self.is_fp8:
            specs += [("l1_acts_sf", (ring, h // 128), torch.int32), ("l2_acts_sf", (ring, i // 128), torch.int32)]
        offsets, total = [], 0
        for name, shape, dtype in specs:
            offsets.append(total)
            total = _align(total + math.prod(shape) * dtype.itemsize, _VIEW_ALIGN)
        # The node layout first (collective; every rank gets the same answer): it decides the backend and
        # which of the Buffer's windows to size.
        topo = Topology.from_comm(comm)
        if backend == "shm" and topo.num_nodes > 1:
            raise ValueError(f"get_symm_buffer_for_mega_moe: backend 'shm' needs every rank in one UBMEM domain "
                             f"(node); these {self.num_ranks} ranks span {topo.num_nodes} nodes: use backend "
                             f"'buffer' (or the default)")
        self.backend = backend or ("shm" if topo.num_nodes == 1 else "buffer")
        # Rows moved per dispatch (Buffer path): one per (token, k) pair of a wave; the windows stream larger
        # waves. One node: the UBMEM window for up to 128 MiB (or 128 pairs); across nodes both windows, for up
        # to 4096 pairs per call.
        elems, isz = _dispatch_row_bytes(h, self.is_fp8) // (1 if self.is_fp8 else 2), 1 if self.is_fp8 else 2
        pairs = max(1, tmax * num_topk)
        if topo.num_nodes > 1:
            rpn, rows = topo.ranks_per_node, min(pairs, 4096)
            nvl = Buffer.get_normal_buffer_size_hint(rows, elems, self.num_ranks, 1, num_experts, isz,
                                                     ranks_per_node=rpn)
            rdma = Buffer.get_normal_rdma_buffer_size_hint(rows, elems, self.num_ranks, rpn, 1, num_experts, isz)
            self.ep_buffer = Buffer(None, _align(nvl, 128), _align(rdma, 128), comm=comm, explicitly_destroy=True,
                                    timeout_s=timeout_s, ranks_per_node=rpn)
        else:
            nbytes = Buffer.get_normal_buffer_size_hint(pairs, elems, self.num_ranks, 1, num_experts, isz)
            per_pair = max(1, nbytes // pairs)
            nbytes = min(nbytes, max(_align(_MAX_WINDOW_BYTES // 2, 128), 128 * per_pair))
            nbytes = max(nbytes, Buffer.get_normal_buffer_size_hint(64, elems, self.num_ranks, 1, num_experts, isz))
            self.ep_buffer = Buffer(None, _align(nbytes, 128), comm=comm, explicitly_destroy=True,
                                    timeout_s=timeout_s, ranks_per_node=topo.ranks_per_node)
        self._segment, self._peer_views, self._out_rows = None, None, 0
        if self.backend == "shm":
            # Inputs, then the L2 output area (every row a rank receives, up to _MAX_OUT_BYTES), in a segment
            # every rank maps: peers pull inputs and read outputs where they lie.
            self._out_rows = min(self.num_ranks * tmax * num_topk, max(1, _MAX_OUT_BYTES // (2 * h)))
            self._total = total
            self._verdict_bytes = _align(8 + 16 * num_experts + _VERDICT_MSG, _VIEW_ALIGN)  # counts: ~8 B each
            nbytes = total + self._out_rows * 2 * h + 2 * self._verdict_bytes
            try:
                self._segment = self.ep_buffer.runtime.create_segment("mega_moe", nbytes)
            except BaseException:
                self.ep_buffer.destroy()
                raise
            self._peer_views = [self._views(self._segment.view(p, 0, nbytes), specs, offsets, True)
                                for p in range(self.num_ranks)]
            self._consensus_calls = 0
            self.buffer = self._segment.view(self.rank, 0, total).view(torch.int8)
            views = self._peer_views[self.rank]
        else:
            self.buffer = torch.zeros(total, dtype=torch.int8)
            views = self._views(self.buffer, specs, offsets)
        for name, _shape, _dtype in specs:
            setattr(self, name, views[name])
        if not self.is_fp8:
            self.x_sf = self.l1_acts_sf = self.l2_acts_sf = None
        self.last_trace = None
        self._reduce_scratch = CombineScratch()  # the final sum's float32 blocks without the native kernel
        self._destroyed = False

    def _views(self, flat, specs, offsets, with_out=False) -> dict:
        """Name -> view of ``flat`` (bytes of one rank's views, then, shm backend, its ``out`` area ``[rows, H]``)."""
        flat = flat.view(torch.uint8)
        out = {}
        for (name, shape, dtype), off in zip(specs, offsets):
            n = math.prod(shape) * dtype.itemsize
            view = flat[off:off + n].view(dtype).view(shape)
            if name.endswith("_sf") and name.startswith("l"):  # MN-major scratch scales (parity)
                view = flat[off:off + n].view(dtype).view(shape[::-1]).t()
            out[name] = view
        if with_out:  # the shm backend's: L2 output area, then two verdict slots (consensus, by call parity)
            a, b = self._total, self._total + self._out_rows * 2 * self.hidden
            out["out"] = flat[a:b].view(BF16).view(self._out_rows, self.hidden)
            out["verdict"] = flat[b:b + 2 * self._verdict_bytes].view(2, self._verdict_bytes)
        return out

    def destroy(self) -> None:
        """Collectively free the Buffer (its window and worker) and the views' memory."""
        if self._destroyed:
            return
        self._destroyed = True
        self.ep_buffer.destroy()
        if self._segment is not None:
            self._segment.release()
            self._segment, self._peer_views = None, None
        self.buffer = torch.empty(0, dtype=torch.int8)
        for name in ("x", "x_sf", "topk_idx", "topk_weights", "l1_acts", "l1_acts_sf", "l2_acts", "l2_acts_sf"):
            setattr(self, name, None)

    def __repr__(self) -> str:
        return (f"SymmBuffer(rank {self.rank}/{self.num_ranks}, {self.mma_type}, E={self.num_experts}, "
                f"Tmax={self.num_max_tokens_per_rank}, K={self.num_topk}, H={self.hidden}, "
                f"I={self.intermediate_hidden}, shared={self.num_shared_experts})")


def _check_symm_args(num_ranks, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden,
                     use_fp8_dispatch, mma_type, activation, num_shared_experts, backend=None) -> None:
    """The checks of mega-moe.md §1.1 on one rank's arguments (``AssertionError``, as upstream)."""
    assert activation == "swiglu", f"MegaMoE: activation must be 'swiglu', got {activation!r}"
    assert backend is None or backend in _BACKENDS, (
        f"MegaMoE: backend (keyword, else ${MEGA_MOE_BACKEND.name}) must be one of {_BACKENDS} or unset, got {backend!r}")
    assert mma_type in ("fp8xfp4", "bf16xbf16"), f"MegaMoE: mma_type must be 'fp8xfp4' or 'bf16xbf16', got {mma_type!r}"
    if use_fp8_dispatch is not None:
        warnings.warn("get_symm_buffer_for_mega_moe: use_fp8_dispatch is deprecated; use mma_type",
                      DeprecationWarning, stacklevel=3)  # the caller of get_symm_buffer_for_mega_moe
        assert bool(use_fp8_dispatch) == (mma_type == "fp8xfp4"), (
            f"MegaMoE: use_fp8_dispatch={use_fp8_dispatch} disagrees with mma_type={mma_type!r}")
    for name, v in (("num_experts", num_experts), ("num_max_tokens_per_rank", num_max_tokens_per_rank),
                    ("num_topk", num_topk), ("hidden", hidden), ("intermediate_hidden", intermediate_hidden)):
        assert isinstance(v, int) and v >= (0 if name == "num_max_tokens_per_rank" else 1), (
            f"MegaMoE: {name} must be a positive int, got {v!r}")
    assert num_topk <= 32, f"MegaMoE: num_topk must be <= 32, got {num_topk}"
    assert isinstance(num_shared_experts, int) and 0 <= num_shared_experts <= 2, (
        f"MegaMoE: num_shared_experts must be 0, 1 or 2, got {num_shared_experts!r}")
    if mma_type == "fp8xfp4":
        assert hidden % 128 == 0 and intermediate_hidden % 128 == 0, (
            f"MegaMoE fp8xfp4: hidden ({hidden}) and intermediate_hidden ({intermediate_hidden}) must be multiples "
            f"of 128")
    else:
        assert intermediate_hidden % _INTERLEAVE == 0, (
            f"MegaMoE bf16xbf16: intermediate_hidden ({intermediate_hidden}) must be a multiple of {_INTERLEAVE} "
            f"(the L1 gate/up interleave)")
    assert num_experts % num_ranks == 0, (
        f"MegaMoE: num_experts ({num_experts}) must be a multiple of the group size ({num_ranks})")


def get_symm_buffer_for_mega_moe(group, num_experts: int, num_max_tokens_per_rank: int, num_topk: int, hidden: int,
                                 intermediate_hidden: int, use_fp8_dispatch=None, mma_type: str = "fp8xfp4",
                                 activation: str = "swiglu", *, num_shared_experts: int = 0,
                                 timeout_s: float | None = None, backend: str | None = None) -> SymmBuffer:
    """Collective: the symmetric buffer of MegaMoE (mirrors ``deep_gemm.get_symm_buffer_for_mega_moe``).

    Args:
        group: an mpi4py communicator or a ``torch.distributed`` ProcessGroup (as
            :class:`~deepep_ascend.Buffer`); every rank passes the same other arguments.
        num_experts: ``E``, a multiple of the group size; num_topk: ``K <= 32``.
        num_max_tokens_per_rank: capacity per rank, rounded up to a multiple of 384.
        hidden, intermediate_hidden: ``H``, ``I``. ``fp8xfp4`` needs ``H % 128 == 0`` and
            ``I % 128 == 0``; ``bf16xbf16`` needs ``I % 8 == 0`` (the L1 interleave).
        use_fp8_dispatch: deprecated alias of ``mma_type == 'fp8xfp4'`` (warns; must agree).
        mma_type: ``'fp8xfp4'`` or ``'bf16xbf16'``; activation: ``'swiglu'`` only.
        num_shared_experts: 0-2 shared experts (keyword-only; DeepGEMM-Ascend extension).
        timeout_s: deadline of the Buffer's waits (default ``$DEEPEP_ASCEND_TIMEOUT_S``).
        backend: keyword-only, how rows move (``SymmBuffer.backend``): ``'shm'`` (needs every rank on one
            node) or ``'buffer'``; default ``$DEEPEP_ASCEND_MEGA_MOE_BACKEND``, else ``'shm'`` on one node and
            ``'buffer'`` across nodes. Both give the same ``y`` bit for bit.
    Raises:
        AssertionError: the checks of mega-moe.md §1.1, on the rank whose arguments fail them (every rank
            when all pass the same); the other ranks raise :class:`~deepep_ascend.ConsensusError` naming it.
        ConsensusError: (a ``ValueError``) on every rank when ranks pass different arguments, naming the
            argument and every rank's value.
        ValueError: bad ``group``; ``backend='shm'`` on ranks that span several nodes (every rank).
    """
    comm = mpi_comm_of(group)
    if backend is None:
        try:
            backend = MEGA_MOE_BACKEND.get()
        except SettingError:
            backend = MEGA_MOE_BACKEND.raw()  # refused by the argument checks, collectively
    args = dict(num_experts=num_experts, num_max_tokens_per_rank=num_max_tokens_per_rank, num_topk=num_topk,
                hidden=hidden, intermediate_hidden=intermediate_hidden, mma_type=mma_type, activation=activation,
                num_shared_experts=num_shared_experts, backend=backend)
    err = None
    try:
        _check_symm_args(comm.Get_size(), use_fp8_dispatch=use_fp8_dispatch, **args)
    except AssertionError as exc:
        err = exc
    # Before the Buffer, whose window sizes follow from these: a rank with other arguments would otherwise
    # fail there on a window size, or build a buffer whose first call fails (num_experts), or none at all
    # (intermediate_hidden); a rank whose checks failed would leave the others waiting in it.
    # Plain values, compared for what they mean (True is 1, capacities 8 and 300 are both 384 rows) and always
    # picklable; a rank whose checks failed sends its message only.
    mine = None if err is not None else {k: v if v is None or isinstance(v, str) else int(v) for k, v in args.items()}
    if mine is not None:
        mine["num_max_tokens_per_rank"] = _align(max(1, num_max_tokens_per_rank), _TOKEN_ALIGN)
    gathered = quiet_allgather_object(comm, (None if err is None else str(err), mine))
    if err is not None:
        raise err
    _check_agreement(comm.Get_rank(), "get_symm_buffer_for_mega_moe", gathered)
    return SymmBuffer(group, comm, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden, mma_type,
                      activation, num_shared_experts, timeout_s, backend)


# ----------------------------------------------------------------------------------------------
# weight transform


def _l1_perm(i: int) -> torch.Tensor:
    """Row order of upstream's L1 interleave: gate 0-7, up 0-7, gate 8-15, up 8-15, ... (index into rows)."""
    blocks = torch.arange(i // _INTERLEAVE).unsqueeze(1) * _INTERLEAVE + torch.arange(_INTERLEAVE)
    return torch.stack([blocks, blocks + i], 1).reshape(-1)


def _sf_perm(n: int) -> torch.Tensor:
    """Within each 128-row group, row ``32i + j`` moves to ``4j + i`` (new position p holds old row perm[p])."""
    p = torch.arange(n)
    local = p % 128
    return p - local + 32 * (local % 4) + local // 4


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel())
    return inv


def _rows(t: torch.Tensor, perm: torch.Tensor, mn_major: bool) -> torch.Tensor:
    out = t.index_select(-2, perm)
    return _scales.mn_major(out, out.element_size()) if mn_major else out.contiguous()


def _check_weights(kind: str, l1, l2, num_local=None, hidden=None, inter=None, where="transform_weights_for_mega_moe"):
    """Validate local-expert weights; returns ``(E_l, H, I)``. Raises TypeError / ValueError."""
    if kind == "bf16":
        for name, t in (("l1_weights", l1), ("l2_weights", l2)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{where}: bf16 `{name}` must be a torch.Tensor, got {type(t).__name__} "
                                f"(an (data, sf) pair is the fp8xfp4 format)")
            if t.dtype != BF16:
                raise TypeError(f"{where}: `{name}` must be bfloat16, got {t.dtype}")
            check_storage(f"{where}: `{name}`", t)
            if t.dim() != 3:
                raise ValueError(f"{where}: `{name}` must be 3-D, got shape {tuple(t.shape)}")
        e, two_i, h = l1.shape
        i = two_i // 2
        if two_i % 2 or tuple(l2.shape) != (e, h, i):
            raise ValueError(f"{where}: l1_weights {tuple(l1.shape)} [E_l, 2I, H] and l2_weights {tuple(l2.shape)} "
                             f"[E_l, H, I] do not match")
    else:
        for name, p in (("l1_weights", l1), ("l2_weights", l2)):
            if not (isinstance(p, (tuple, list)) and len(p) == 2):
                raise TypeError(f"{where}: fp8xfp4 `{name}` must be an (int8 data, int32 sf) pair, got "
                                f"{type(p).__name__}")
            data, sf = p
            if not isinstance(data, torch.Tensor) or data.dtype != torch.int8:
                raise TypeError(f"{where}: `{name}[0]` must be int8 (FP4 packed two per byte), got "
                                f"{getattr(data, 'dtype', type(data).__name__)}")
            if not isinstance(sf, torch.Tensor) or sf.dtype != torch.int32:
                raise TypeError(f"{where}: `{name}[1]` must be int32 (packed UE8M0), got "
                                f"{getattr(sf, 'dtype', type(sf).__name__)}")
            check_storage(f"{where}: `{name}[0]`", data)
            check_storage(f"{where}: `{name}[1]`", sf)
            if data.dim() != 3 or sf.dim() != 3:
                raise ValueError(f"{where}: `{name}` data and sf must be 3-D, got {tuple(data.shape)} and "
                                 f"{tuple(sf.shape)}")
        e, two_i, h2 = l1[0].shape
        h, i = 2 * h2, two_i // 2
        if h % 128 or i % 128 or two_i % 2:
            raise ValueError(f"{where}: fp8xfp4 needs H % 128 == 0 and I % 128 == 0, got H={h}, I={i} "
                             f"(l1 data {tuple(l1[0].shape)})")
        want = {"l1 data": (e, 2 * i, h // 2), "l1 sf": (e, 2 * i, h // 128),
                "l2 data": (e, h, i // 2), "l2 sf": (e, h, i // 128)}
        got = {"l1 data": tuple(l1[0].shape), "l1 sf": tuple(l1[1].shape),
               "l2 data": tuple(l2[0].shape), "l2 sf": tuple(l2[1].shape)}
        for k, shape in want.items():
            if shape != got[k]:
                raise ValueError(f"{where}: {k} must be {shape} for E_l={e}, H={h}, I={i}, got {got[k]}")
    if i % _INTERLEAVE:
        raise ValueError(f"{where}: I={i} must be a multiple of {_INTERLEAVE} (the L1 gate/up interleave)")
    for name, want, got in (("local experts", num_local, e), ("hidden", hidden, h), ("intermediate_hidden", inter, i)):
        if want is not None and want != got:
            raise ValueError(f"{where}: weights have {name}={got}, the buffer has {want}")
    return e, h, i


def transform_weights_for_mega_moe(l1_weights, l2_weights, activation: str = "swiglu"):
    """Reorder local-expert weights as upstream does; same shapes, dtypes and container types.

    bf16: ``l1 [E_l, 2I, H]`` (rows ``0..I-1`` gate, ``I..2I-1`` up), ``l2 [E_l, H, I]``.
    fp8xfp4: ``l1 = (int8 [E_l, 2I, H/2], int32 [E_l, 2I, H/128])``,
    ``l2 = (int8 [E_l, H, I/2], int32 [E_l, H, I/128])`` (FP4 packed two per byte; UE8M0 per 32
    along K, four per int; MN-major or row-major scales, returned MN-major).

    Upstream's order, reproduced exactly: (1) L1 rows interleaved in blocks of 8 (gate 0-7, up
    0-7, gate 8-15, ...), L1 scale rows likewise; (2) fp8 path, L1 and L2 scales: in each
    128-row group row ``32i + j`` moves to ``4j + i``; (3) L2 data unchanged (the same tensor).
    Returns ``(l1, l2)``. Raises ``TypeError``/``ValueError`` on bad input (see module docs).
    """
    if activation != "swiglu":
        raise ValueError(f"transform_weights_for_mega_moe: activation must be 'swiglu', got {activation!r}")
    kind = "bf16" if isinstance(l1_weights, torch.Tensor) else "fp8"
    _e, _h, i = _check_weights(kind, l1_weights, l2_weights)
    perm = _l1_perm(i)
    if kind == "bf16":
        return l1_weights.index_select(-2, perm).contiguous(), l2_weights
    d1, s1 = l1_weights
    d2, s2 = l2_weights
    s1_t = _rows(s1.index_select(-2, perm), _sf_perm(2 * i), True)
    s2_t = _rows(s2, _sf_perm(s2.size(-2)), True)
    return (type(l1_weights)((d1.index_select(-2, perm).contiguous(), s1_t)),
            type(l2_weights)((d2, s2_t)))


def _untransformed(kind: str, l1, l2, engine: str):
    """``(w1 [E_l, 2I, H], w2 [E_l, H, I])`` in the natural order (gate rows, then up rows): exact bf16 values,
    stored bf16 (engine ``bf16``) or float32 (engine ``fp32``); with the ``bf16`` engine where they can be packed
    and the cache holds them, each is instead the tuple of its experts' packed copies
    (:func:`~deepep_ascend.gemm.packing.pack_groups`; one copy of the weights is cached, not two); FP4
    weights, where the AMX kernel runs and their scales qualify, are instead the FP4 copies it decodes itself
    (:func:`~deepep_ascend.gemm.packing.pack_fp4_groups`, a quarter of the bytes, no bf16 copy). Cached by
    identity and version of the transformed tensors (:func:`deepep_ascend.gemm.weight_cache.cached_by_tensors`)."""
    tensors = (l1, l2) if kind == "bf16" else (l1[0], l1[1], l2[0], l2[1])

    def build():
        if kind == "bf16":
            i = l1.size(-2) // 2
            w1 = l1.index_select(-2, _inverse(_l1_perm(i))).contiguous()
            # l2 itself when already contiguous: cache a detached alias, so the entry does not keep the key
            # tensor alive (the entry dies with it)
            w2 = l2.detach().contiguous()
        else:
            (d1, s1), (d2, s2) = l1, l2
            i = d1.size(-2) // 2
            inv = _inverse(_l1_perm(i))
            s1_nat = s1.index_select(-2, _inverse(_sf_perm(2 * i))).index_select(-2, inv)
            s2_nat = s2.index_select(-2, _inverse(_sf_perm(s2.size(-2))))
            d1_nat = d1.index_select(-2, inv)
            if engine == "bf16" and cacheable(tensors):
                # the FP4 copies the AMX kernel decodes itself: a quarter of the bytes, the same results
                packed = pack_fp4_groups(d1_nat, s1_nat, _SF_GRAN), pack_fp4_groups(d2, s2_nat, _SF_GRAN)
                if None not in packed:
                    return packed
            w1 = dequantize_operand(d1_nat, s1_nat.contiguous(), 1, _SF_GRAN, "l1_weights").to(BF16)
            w2 = dequantize_operand(d2, s2_nat.contiguous(), 1, _SF_GRAN, "l2_weights").to(BF16)
        if engine != "bf16":
            return w1.float(), w2.float()
        if not cacheable(tensors):
            return w1, w2  # packing on every call would cost more than the matmuls' own reorders
        if _packing.PACKER is not None and not optional_copy_fits(packed_nbytes(w1) + packed_nbytes(w2)):
            return w1, w2
        packed1, packed2 = pack_groups(w1), pack_groups(w2)
        return (w1, w2) if packed1 is None else (packed1, packed2)

    return cached_by_tensors(("mega_moe_untransformed", kind, engine), tensors, build)


def _shared_bf16(kind: str, s1, s2, h: int, si: int, where: str):
    """Validate and return bf16 ``(w1 [2·S·I, H], w2 [H, S·I])`` of the shared experts (natural order)."""
    if kind == "bf16":
        for name, t, shape in (("shared_l1_weights", s1, (2 * si, h)), ("shared_l2_weights", s2, (h, si))):
            if not isinstance(t, torch.Tensor) or t.dtype != BF16:
                raise TypeError(f"{where}: `{name}` must be a bfloat16 tensor, got {getattr(t, 'dtype', type(t))}")
            check_storage(f"{where}: `{name}`", t)
            if tuple(t.shape) != shape:
                raise ValueError(f"{where}: `{name}` must be {shape}, got {tuple(t.shape)}")
        return s1, s2
    out = []
    for name, p, (n, k) in (("shared_l1_weights", s1, (2 * si, h)), ("shared_l2_weights", s2, (h, si))):
        if not (isinstance(p, (tuple, list)) and len(p) == 2 and all(isinstance(t, torch.Tensor) for t in p)):
            raise TypeError(f"{where}: `{name}` must be a (data, sf) pair of tensors, got {type(p).__name__}")
        data, sf = p
        check_storage(f"{where}: `{name}[0]`", data)
        check_storage(f"{where}: `{name}[1]`", sf)
        if data.dtype == torch.int8:
            want = (n, k // 2)
        elif data.dtype == FP8:
            want = (n, k)
        else:
            raise TypeError(f"{where}: `{name}[0]` must be int8 (packed FP4) or float8_e4m3fn, got {data.dtype}")
        if sf.dtype != torch.int32:
            raise TypeError(f"{where}: `{name}[1]` must be int32 packed UE8M0, got {sf.dtype}")
        if tuple(data.shape) != want or tuple(sf.shape) != (n, k // 128):
            raise ValueError(f"{where}: `{name}` must be data {want} and sf {(n, k // 128)}, got "
                             f"{tuple(data.shape)} and {tuple(sf.shape)}")
        out.append(dequantize_weights(data, sf, 1, _SF_GRAN).to(BF16))
    return tuple(out)


# ----------------------------------------------------------------------------------------------
# trace


@dataclass
class MegaMoETrace:
    """Timeline of one call (``time.perf_counter`` seconds).

    ``compute``: ``(stage, wave, start, end)`` on the caller (stages ``l1``, ``act``, ``l2``,
    ``shared``, ``reduce``); ``comm``: ``(op, wave, issue_start, issue_end, worker_start,
    worker_end)``: the caller-side part of each Buffer call (validation, the counts round, and in
    ``overlap=False`` everything) and the worker-side part (data movement; ``worker_*`` equal
    ``issue_end`` when synchronous).
    """

    overlap_mode: bool
    num_waves: int
    experts_per_wave: int
    start: float = 0.0
    backend: str = ""
    end: float = 0.0
    compute: list = field(default_factory=list)
    comm: list = field(default_factory=list)

    def stage_times(self) -> dict:
        """Seconds per stage: ``dispatch``/``combine`` (caller part + worker part), ``l1``, ``act``, ``l2``, ..."""
        out: dict = {}
        for stage, _w, s, e in self.compute:
            out[stage] = out.get(stage, 0.0) + e - s
        for op, _w, s0, e0, s1, e1 in self.comm:
            out[op] = out.get(op, 0.0) + (e0 - s0) + (e1 - s1)
        return out

    def overlap(self) -> dict:
        """``worker_busy`` (s), ``hidden`` (worker time under caller compute, s), ``fraction`` = hidden / busy,
        ``compute`` (s), ``total`` (s)."""
        busy = _union([(c[4], c[5]) for c in self.comm if c[5] > c[4]])
        comp = _union([(s, e) for _st, _w, s, e in self.compute])
        hidden = _intersection(busy, comp)
        b = sum(e - s for s, e in busy)
        return dict(worker_busy=b, hidden=hidden, fraction=hidden / b if b > 0 else 0.0,
                    compute=sum(e - s for s, e in comp), total=self.end - self.start)


def _union(intervals):
    out = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [tuple(x) for x in out]


def _intersection(a, b) -> float:
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


# ----------------------------------------------------------------------------------------------
# the op


class _Invalid(Exception):
    pass


def _validate(kind, y, l1, l2, sb, stats, activation, clamp, shared_l1, shared_l2, recipe, op):
    """Local checks (raise TypeError/ValueError); returns the validated pieces."""
    if not isinstance(sb, SymmBuffer):
        raise TypeError(f"{op}: `sym_buffer` must come from get_symm_buffer_for_mega_moe, got {type(sb).__name__}")
    if sb._destroyed:
        raise RuntimeError(f"{op}: the symmetric buffer was destroyed")
    want_mma = "bf16xbf16" if kind == "bf16" else "fp8xfp4"
    if sb.mma_type != want_mma:
        raise ValueError(f"{op} needs a buffer built with mma_type={want_mma!r}, this one has {sb.mma_type!r}")
    if activation != "swiglu":
        raise ValueError(f"{op}: activation must be 'swiglu', got {activation!r}")
    if recipe is not None and tuple(recipe) != (1, 1, 32):
        raise ValueError(f"{op}: recipe must be (1, 1, 32), got {tuple(recipe)}")
    if clamp is not None and (isinstance(clamp, bool) or not isinstance(clamp, numbers.Real) or not clamp >= 0):
        raise ValueError(f"{op}: activation_clamp must be None or a number >= 0, got {clamp!r}")
    if not isinstance(y, torch.Tensor):
        raise TypeError(f"{op}: `y` must be a torch.Tensor, got {type(y).__name__}")
    if y.dtype != BF16:
        raise TypeError(f"{op}: `y` must be bfloat16, got {y.dtype}")
    check_storage(f"{op}: `y`", y)
    if y.dim() != 2 or y.size(1) != sb.hidden:
        raise ValueError(f"{op}: `y` must be [num_tokens, {sb.hidden}], got {tuple(y.shape)}")
    if not y.is_contiguous():
        raise ValueError(f"{op}: `y` must be contiguous")
    t = y.size(0)
    if t > sb.num_max_tokens_per_rank:
        raise ValueError(f"{op}: num_tokens = y.size(0) = {t} exceeds num_max_tokens_per_rank "
                         f"({sb.num_max_tokens_per_rank}, aligned to 384)")
    _check_weights(kind, l1, l2, sb.num_local_experts, sb.hidden, sb.intermediate_hidden, op)
    if stats is not None:
        if not isinstance(stats, torch.Tensor) or stats.dtype != torch.int32:
            raise TypeError(f"{op}: cumulative_local_expert_recv_stats must be an int32 tensor, got "
                            f"{getattr(stats, 'dtype', type(stats).__name__)}")
        check_storage(f"{op}: cumulative_local_expert_recv_stats", stats)
        if tuple(stats.shape) != (sb.num_local_experts,):
            raise ValueError(f"{op}: cumulative_local_expert_recv_stats must be [{sb.num_local_experts}], got "
                             f"{tuple(stats.shape)}")
    s = sb.num_shared_experts
    if s == 0 and (shared_l1 is not None or shared_l2 is not None):
        raise ValueError(f"{op}: shared expert weights given but the buffer has num_shared_experts=0")
    shared = None
    if s:
        if shared_l1 is None or shared_l2 is None:
            raise ValueError(f"{op}: the buffer has num_shared_experts={s}: pass shared_l1_weights and "
                             f"shared_l2_weights")
        shared = _shared_bf16(kind, shared_l1, shared_l2, sb.hidden, s * sb.intermediate_hidden, op)
    idx = sb.topk_idx[:t]
    if t:
        lo, hi = int(idx.min()), int(idx.max())
        if lo < -1 or hi >= sb.num_experts:
            raise ValueError(f"{op}: topk_idx[:{t}] values must lie in [-1, {sb.num_experts}), got min {lo}, "
                             f"max {hi}")
    return t, shared


def _dequant_x(kind, data, sf_bytes, dtype=BF16, index=None, native=True):
    """Received activations ``[n, H]`` as ``dtype``: bf16, or float32 holding the same bf16 values
    (what the fp32 engine multiplies), from rows ``index`` (int64 ``[n]``; all rows if None) of ``data``
    and ``sf_bytes``. bf16 rows as they are; fp8: e4m3 × UE8M0 bytes ``[., H/32]``
    (:func:`deepep_ascend.per_token_cast_back`; the native kernel gathers and decodes in one pass, same
    bits; ``native=False`` skips it), exact in bf16 unless a scale byte is below ``_MIN_EXACT_SF_BYTE`` (then
    rounded through bf16, as the kernel always does: so its bf16 rows widened are the float32 result too)."""
    if kind == "bf16":
        data = data if index is None else data.index_select(0, index)
        return data if dtype == BF16 else data.float()
    if native and matrix_ok(data) and matrix_ok(sf_bytes):
        out = torch.empty(data.size(0) if index is None else index.numel(), data.size(1), dtype=BF16)
        if _native.dequant_rows_e4m3(out, data, sf_bytes, index, _SF_GRAN):
            return out if dtype == BF16 else out.float()
    if index is not None:
        data, sf_bytes = data.index_select(0, index), sf_bytes.index_select(0, index)
    sf = _scales.unpack_ue8m0_from_int(sf_bytes)
    if dtype == BF16 or (sf_bytes.numel() and int(sf_bytes.min()) < _MIN_EXACT_SF_BYTE):
        return per_token_cast_back_torch(data, sf, _SF_GRAN, BF16).to(dtype)
    return per_token_cast_back_torch(data, sf, _SF_GRAN, torch.float32)


def _activation(kind, h, i, weights, clamp, fast_math, dtype=BF16, native=True):
    """SwiGLU of L1 outputs ``h [N, 2I]`` bf16 times ``weights [N]`` fp32 → L2 input ``[N, I]`` as ``dtype``
    (bf16, or float32 holding the same bf16 values). In-place float32 steps in the reference's order; the fp8
    path's cast to e4m3 with UE8M0 per 32 and back is done in one float32 rounding pass
    (:func:`deepep_ascend.gemm.fp8.e4m3_ue8m0_round_trip_`, bit for bit the codec's result). The native
    kernel (:func:`deepep_ascend.native.swiglu`; ``native=False`` skips it) computes the same bits in one pass
    after torch's exp (its bf16 rows widened are the float32 result: the round trip's values are bf16 values)."""
    c = None if clamp is None else float(torch.tensor(float(clamp), dtype=BF16))  # the bf16 value of the clamp
    if (native and matrix_ok(h, BF16) and (c is None or c >= 0)  # NaN or < 0: torch's clamp rules
            and weights.dtype == torch.float32 and weights.dim() == 1):
        out = torch.empty(h.size(0), i, dtype=BF16)
        if _native.swiglu(out, h, weights, c, fast_math, 0 if kind == "bf16" else _SF_GRAN):
            return out if dtype == BF16 else out.float()
    g, u = h[:, :i], h[:, i:]
    if clamp is not None:
        g = g.clamp(max=c)
        u = u.clamp(-c, c)
    gf = g.float()
    denom = torch.neg(gf).exp_().add_(1.0)
    a = denom.reciprocal_().mul_(gf) if fast_math else torch.div(gf, denom, out=denom)
    a.mul_(u).mul_(weights.unsqueeze(1))
    if kind == "bf16":
        a = a.to(BF16)
        return a if dtype == BF16 else a.float()
    if not e4m3_ue8m0_round_trip_(a, _SF_GRAN):  # NaN, inf or huge values: through the codes
        n = a.size(0)
        grp = a.view(n, i // _SF_GRAN, _SF_GRAN)
        s = _scales.ceil_to_ue8m0(grp.abs().amax(-1).clamp(min=1e-4) / FP8_E4M3_MAX).unsqueeze(-1)
        e4m3_to_float(cast_to_e4m3(grp.div_(s)), out=grp).mul_(s)  # e4m3 × UE8M0: exact in bf16
    return a.to(BF16) if dtype == BF16 else a


def _wave_override(num_experts_per_wave, op: str):
    """The wave size asked for on this rank: the keyword, else ``$DEEPEP_ASCEND_MEGA_MOE_EXPERTS_PER_WAVE``,
    else ``None`` (the default rule). Raises ``ValueError`` naming the keyword or the variable."""
    if num_experts_per_wave is not None:
        if (isinstance(num_experts_per_wave, bool) or not isinstance(num_experts_per_wave, numbers.Integral)
                or num_experts_per_wave < 1):
            raise ValueError(f"{op}: num_experts_per_wave must be a positive int, got {num_experts_per_wave!r}")
        return int(num_experts_per_wave)
    try:
        return MEGA_MOE_EXPERTS_PER_WAVE.get()
    except SettingError as exc:
        raise SettingError(f"{op}: {exc}") from None


def _experts_per_wave(sb, counts, override):
    """Wave size in local experts, the same on every rank: ``override`` (from :func:`_wave_override`, equal on
    every rank) capped at ``E_l``, else the default rule from the all-gathered counts ``[R, E]``."""
    el = sb.num_local_experts
    if override is not None:
        return min(override, el)
    rows = int(counts.sum()) / sb.num_ranks  # rows each rank receives, on average
    row_bytes = _dispatch_row_bytes(sb.hidden, sb.is_fp8) + 2 * sb.hidden  # + the bf16 row combined back
    waves = max(1, min(_MAX_WAVES, el, round(rows * row_bytes / _WAVE_BYTES)))
    return -(-el // waves)


def _check_agreement(me: int, op: str, gathered: list) -> None:
    """Raise :class:`~deepep_ascend.ConsensusError` when any rank rejected ``op`` or ranks passed different
    values; ``gathered``: per rank, in rank order, ``(its error message or None, its dict of what every rank
    must pass alike)``. Every rank sees the same list, so every rank raises the same error."""
    bad = [(r, m) for r, (m, _v) in enumerate(gathered) if m is not None]
    if bad:
        raise ConsensusError(f"rank {me}: {op} was rejected on rank(s) {[r for r, _ in bad]}: "
                             + "; ".join(f"rank {r}: {m}" for r, m in bad))
    first = gathered[0][1]
    for name in first:
        if any(v[name] != first[name] for _m, v in gathered):
            raise ConsensusError(f"rank {me}: {op}: ranks disagree on {name}: "
                                 + ", ".join(f"rank {r}: {v[name]!r}" for r, (_m, v) in enumerate(gathered))
                                 + "; every rank must pass the same value")


def _consensus(sb, verdict, op) -> list:
    """Every rank's ``verdict`` (its error text or None, its per-expert pair counts, its wave override), in
    rank order. Ranks first meet at the transport's barrier, then all-gather through the transport
    (:meth:`transports.Transport.allgather_object`); both sleep between polls, have the Buffer's deadline
    and fail fast when a peer aborted. A blocking collective entered early spins in MPICH's ``sched_yield``
    loop, which, with more ranks than cores, starves the rank still working toward the call, and it has no
    deadline: a rank that never comes would hang the others, and so would a peer that timed out in the
    barrier just as the others passed it (they would wait for it in the all-gather). The barrier names the
    ranks that did not come; on any timeout the waiting rank raises ``TimeoutError`` and the Buffer is
    aborted (peers learn at once). The ``shm`` backend needs no all-gather: :func:`_consensus_shm`."""
    buf = sb.ep_buffer
    if sb.backend == "shm":
        return _consensus_shm(sb, verdict, op)
    run_step(buf.runtime, buf.rank, lambda: buf.runtime.barrier(phase=f"{op} consensus"))
    return run_step(buf.runtime, buf.rank, lambda: buf.runtime.allgather_object(verdict, phase=f"{op} consensus"))


def _consensus_shm(sb, verdict, op) -> list:
    """:func:`_consensus` in one barrier (shm backend): each rank writes its verdict, pickled as the Buffer
    backend's all-gather sends it (so both compare the same values), into its segment's slot for this call's
    parity, meets the others at the transport's barrier, and reads every rank's. A slot is written again two
    calls later, after a barrier that every rank enters only once it read this call's. A message longer than
    2000 characters is cut; a verdict that cannot be encoded becomes a rejection naming this rank: every rank
    still enters the barrier, so the ranks never fall out of step."""
    buf, me = sb.ep_buffer, sb.rank
    msg, counts, settings, t = verdict
    try:
        if msg is not None and len(msg) > _VERDICT_CHARS:
            msg = msg[:_VERDICT_CHARS] + " [cut]"
        blob = pickle.dumps((msg, counts, settings, t))
        if len(blob) > sb._verdict_bytes - 8:
            raise ValueError(f"{len(blob)} B, room for {sb._verdict_bytes - 8}")
    except Exception as exc:  # noqa: BLE001 - sent to every rank as this rank's rejection
        blob = pickle.dumps((f"rank {me}: {op}: its verdict could not be encoded ({type(exc).__name__})", None,
                             None, 0))
    slot = sb._consensus_calls % 2
    sb._consensus_calls += 1
    rec = sb._peer_views[me]["verdict"][slot]
    rec[:8].view(torch.int64).fill_(len(blob))
    rec[8:8 + len(blob)].copy_(torch.frombuffer(bytearray(blob), dtype=torch.uint8))
    run_step(buf.runtime, buf.rank, lambda: buf.runtime.barrier(phase=f"{op} consensus"))
    out = []
    for p in range(sb.num_ranks):
        r = sb._peer_views[p]["verdict"][slot]
        out.append(pickle.loads(r[8:8 + int(r[:8].view(torch.int64))].numpy().tobytes()))
    return out


def _run(kind, y, l1_weights, l2_weights, sym_buffer, stats, activation, activation_clamp, fast_math, recipe,
         shared_l1, shared_l2, overlap, num_experts_per_wave, op):
    sb = sym_buffer
    me = getattr(sb, "rank", 0)
    err, counts, t, shared, override, settings = None, None, 0, None, None, None
    try:
        t, shared = _validate(kind, y, l1_weights, l2_weights, sb, stats, activation, activation_clamp, shared_l1,
                              shared_l2, recipe, op)
        idx = sb.topk_idx[:t]
        valid = idx >= 0
        counts = torch.bincount(idx[valid], minlength=sb.num_experts).to(torch.int64)
        override = _wave_override(num_experts_per_wave, op)
        # what every rank must pass alike (each rank's experts serve every rank's tokens), as plain values
        settings = {f"num_experts_per_wave (keyword, else ${MEGA_MOE_EXPERTS_PER_WAVE.name}; None = default)": override,
                    "activation_clamp": None if activation_clamp is None else float(activation_clamp),
                    "fast_math": bool(fast_math)}
    except Exception as exc:  # noqa: BLE001 - reported to every rank, re-raised here
        err = exc
    if not isinstance(sb, SymmBuffer) or sb._destroyed:
        raise err
    gathered = _consensus(sb, (None if err is None else f"{type(err).__name__}: {err}",
                               None if counts is None else counts.numpy(), settings, t), op)
    if err is not None:
        raise err
    _check_agreement(me, op, [(m, o) for m, _c, o, _t in gathered])
    cmat = torch.stack([torch.from_numpy(c) for _m, c, _o, _t in gathered])  # [R, E] pairs each rank sends per expert
    tokens = [int(n) for _m, _c, _o, n in gathered]

    try:
        _fused(kind, y, l1_weights, l2_weights, sb, stats, activation_clamp, fast_math, shared, overlap, t, cmat,
               tokens, override)
    except BaseException as exc:  # a failure after the ranks agreed: the peers must not wait for this rank
        abort_peers(sb.ep_buffer.runtime, sb.ep_buffer.rank, exc)
        raise


class _Experts:
    """One call's expert compute on the caller's thread, shared by both backends: per wave, rows sorted
    (stably) by local expert, unpadded (a fused op needs no aligned layout in memory), L1, SwiGLU × w
    (+ fp8 requantisation), L2; each stage timed into the trace."""

    def __init__(self, kind, sb, w1, w2, engine, epw, clamp, fast_math, trace):
        self.kind, self.sb, self.w1, self.w2, self.engine, self.epw = kind, sb, w1, w2, engine, epw
        self.clamp, self.fast_math, self.trace = clamp, fast_math, trace
        self.op_dtype = _operand_dtype(engine)

    def timed(self, stage, w, fn, *args, **kw):
        s0 = time.perf_counter()
        r = fn(*args, **kw)
        self.trace.compute.append((stage, w, s0, time.perf_counter()))
        return r

    def l1(self, w, data, sf_bytes, local, ws):
        """Wave ``w``'s rows: ``data [n, H]`` (bf16, or e4m3 with UE8M0 bytes ``sf_bytes [n, H/32]``), local
        expert ids ``local [n]`` (0 = the wave's first expert), routing weights ``ws [n]`` float32; any order
        (the sort is stable, so rows of one expert keep theirs)."""
        el, epw = self.sb.num_local_experts, self.epw
        n = local.numel()
        e0 = w * epw
        ne = min(epw, el - e0)
        order = torch.argsort(local, stable=True)
        bounds = [0] + (torch.bincount(local, minlength=ne).cumsum(0).tolist() if n else [0] * ne)
        if self.kind == "bf16":
            xs = data.index_select(0, order).to(self.op_dtype)
        else:
            xs = _dequant_x(self.kind, data, sf_bytes, self.op_dtype, index=order)
        hh = _expert_gemm(self.engine, xs, self.w1[e0:e0 + ne], bounds)
        return dict(n=n, order=order, bounds=bounds, e0=e0, ne=ne, h=hh, ws=ws.index_select(0, order))

    def act(self, st):
        st["act"] = _activation(self.kind, st["h"], self.sb.intermediate_hidden, st["ws"], self.clamp,
                                self.fast_math, self.op_dtype)

    def l2(self, st, out=None):
        """L2 of the wave in the sorted order (into ``out`` ``[n, H]`` bf16 if given)."""
        e0, ne = st["e0"], st["ne"]
        return _expert_gemm(self.engine, st["act"], self.w2[e0:e0 + ne], st["bounds"], out=out)


def _fused(kind, y, l1_weights, l2_weights, sb, stats, activation_clamp, fast_math, shared, overlap, t, cmat,
           tokens, override):
    """The call once every rank accepted it: waves of dispatch, L1, activation, L2 and combine, then the sum
    over k into ``y`` (see the module docstring). ``cmat [R, E]``: pairs each rank routes to each expert;
    ``tokens``: each rank's token count."""
    el = sb.num_local_experts
    epw = _experts_per_wave(sb, cmat, override)
    num_waves = -(-el // epw)
    trace = MegaMoETrace(overlap, num_waves, epw, start=time.perf_counter())
    engine = gemm_engine()
    w1, w2 = _untransformed(kind, l1_weights, l2_weights, engine)
    ex = _Experts(kind, sb, w1, w2, engine, epw, activation_clamp, fast_math, trace)
    # This rank's pairs, in (token, k) order.
    idx = sb.topk_idx[:t].reshape(-1)
    pair = torch.nonzero(idx >= 0).squeeze(1)
    # The shm backend keeps every received row's L2 output in its segment until the ranks meet; a call
    # that would overfill some rank's (only with a capped segment) takes the Buffer's path, alike on every
    # rank since all see the same counts.
    rows = cmat.sum(0).view(sb.num_ranks, el).sum(1)
    trace.backend = "shm" if sb.backend == "shm" and int(rows.max()) <= sb._out_rows else "buffer"
    run = _waves_shm if trace.backend == "shm" else _waves_buffer
    terms = run(ex, sb, t, cmat, tokens, idx, pair, shared, overlap)

    s0 = time.perf_counter()
    # y = bf16(+0.0 + Σ_k o_k + shared) in float32, ascending k. A masked pair adds nothing: the sum
    # from +0.0 never holds -0.0, so adding its +0.0 row would change no bit. ``terms``: (rows, tokens,
    # positions of those rows) in the order to add them (ascending k), then the shared expert's.
    if t and not _native.sum_rows(y[:t], terms):
        # combine's torch paths (accumulate_rows: the same additions in the same order)
        sources = [(rows.index_select(0, at[0]) if at else rows, tok) for rows, tok, *at in terms]
        accumulate_rows(y[:t], sources, *sb._reduce_scratch.get(sb.hidden), native=False)
    trace.compute.append(("reduce", -1, s0, time.perf_counter()))
    if stats is not None:
        stats += cmat[:, sb.rank * el:(sb.rank + 1) * el].sum(0).to(torch.int32)
    if DG_COMM_KERNEL_DEBUG.get():
        sb.buffer.zero_()
    prev_end = -math.inf
    for rec in trace.comm:  # Buffer's worker-side start: when issued, or when the op before it left the worker
        if overlap and trace.backend == "buffer":  # (shm: each pull records its own)
            rec[4] = max(rec[3], prev_end)
            prev_end = rec[5]
    trace.end = time.perf_counter()
    sb.last_trace = trace


def _shared_terms(ex, sb, t, shared):
    if shared is None:
        return []
    out = ex.timed("shared", -1, _shared_expert, ex.kind, sb, t, shared, ex.clamp, ex.fast_math, ex.engine)
    return [(out, torch.arange(t))]


def _waves_shm(ex, sb, t, cmat, tokens, idx, pair, shared, overlap):
    """The shm backend (one UBMEM domain; mega-moe.md §5 "shm pulls from peer windows"): every rank's
    inputs lie in its segment, final once the ranks agreed, so wave ``w``'s dispatch is a pull: from
    each source rank (ascending) the rows of its pairs bound for the wave's experts, gathered straight
    from that rank's ``x``/``x_sf``/``topk_weights`` (one copy, no synchronisation; the worker pulls wave
    ``w+1`` while the caller computes wave ``w``). L2 writes each wave's rows into this rank's output
    area (experts ascending, then source rank, token, k); after one barrier every rank sums its pairs'
    rows where they lie in their owners' areas (their positions follow from the all-gathered counts), so
    combine moves each row once, inside the final sum. Returns the sum's terms."""
    me, nr, el, k, trace = sb.rank, sb.num_ranks, sb.num_local_experts, sb.num_topk, ex.trace
    buf = sb.ep_buffer
    tp, worker = buf.runtime, buf.get_comm_stream()
    epw, num_waves = ex.epw, trace.num_waves
    per_expert = cmat.sum(0)  # [E] rows every expert receives
    blocks = per_expert.view(nr, el)
    start = (blocks.cumsum(1) - blocks).reshape(-1)  # [E] first row of expert e in its owner's area
    peers = sb._peer_views

    def pull(w):
        lo = me * el + w * epw
        hi = min((me + 1) * el, lo + epw)
        n = int(per_expert[lo:hi].sum())
        data = torch.empty(n, sb.hidden, dtype=sb.x.dtype)
        sf = torch.empty(n, sb.hidden // 128, dtype=torch.int32) if sb.is_fp8 else None
        ws = torch.empty(n, dtype=torch.float32)
        local = torch.empty(n, dtype=torch.int64)
        c = 0
        for s in range(nr):
            v = peers[s]
            ids = v["topk_idx"][:tokens[s]].reshape(-1)
            sel = torch.nonzero((ids >= lo) & (ids < hi)).squeeze(1)
            m = sel.numel()
            want = int(cmat[s, lo:hi].sum())
            if m != want:
                raise RuntimeError(f"rank {me}: MegaMoE dispatch: rank {s}'s topk_idx routes {m} pairs to experts "
                                   f"[{lo}, {hi}), the counts it sent for this call say {want} (was it changed "
                                   f"during the call?)")
            if not m:
                continue
            tok = torch.div(sel, k, rounding_mode="floor")
            torch.index_select(v["x"][:tokens[s]], 0, tok, out=data[c:c + m])
            if sf is not None:
                torch.index_select(v["x_sf"][:tokens[s]], 0, tok, out=sf[c:c + m])
            torch.index_select(v["topk_weights"][:tokens[s]].reshape(-1), 0, sel, out=ws[c:c + m])
            torch.sub(ids.index_select(0, sel), lo, out=local[c:c + m])
            tp.record_fetch(s, m * (_dispatch_row_bytes(sb.hidden, sb.is_fp8) + 4))
            c += m
        return data, None if sf is None else sf.view(torch.uint8), local, ws

    def issue(w):
        s0 = time.perf_counter()
        rec = ["dispatch", w, s0, s0, s0, s0]
        trace.comm.append(rec)
        if not overlap or w == 0:  # the caller waits for wave 0 at once: a worker would only add a hand-off
            out = pull(w)
            rec[3] = rec[4] = rec[5] = time.perf_counter()
            return lambda: out

        def task():
            rec[4] = time.perf_counter()
            try:
                return pull(w)
            finally:
                rec[5] = time.perf_counter()
        rec[5] = float("nan")
        fut = worker.submit(task)
        rec[3] = time.perf_counter()
        return fut.result

    out_area = peers[me]["out"]
    base = 0
    try:
        cur = issue(0)
        for w in range(num_waves):
            data, sf, local, ws = cur()
            st = ex.timed("l1", w, ex.l1, w, data, sf, local, ws)
            if w + 1 < num_waves:
                cur = issue(w + 1)
            ex.timed("act", w, ex.act, st)
            ex.timed("l2", w, ex.l2, st, out=out_area[base:base + st["n"]])
            base += st["n"]
        shared_terms = _shared_terms(ex, sb, t, shared)
    finally:
        worker.drain()  # no pull outlives the call
    # Every rank's L2 rows are in place, and every pull from this rank's inputs is done (the caller may
    # refill them once this returns): the call's one synchronisation after the consensus.
    s0 = time.perf_counter()
    tp.barrier(phase="MegaMoE combine: expert outputs written")
    e0 = time.perf_counter()
    trace.comm.append(["combine", -1, s0, e0, e0, e0])

    # Where this rank's pairs lie: expert e's rows in its owner's area start at start[e], then the rows of
    # lower source ranks, then this rank's pairs to e in (token, k) order.
    e_of = idx.index_select(0, pair)
    n = e_of.numel()
    by_expert = torch.argsort(e_of, stable=True)
    mine = cmat[me]
    within = torch.arange(n) - (mine.cumsum(0) - mine).index_select(0, e_of.index_select(0, by_expert))
    rank_in = torch.empty_like(within)
    rank_in[by_expert] = within
    pos = start.index_select(0, e_of) + cmat[:me].sum(0).index_select(0, e_of) + rank_in
    owner = torch.div(e_of, el, rounding_mode="floor")
    key = torch.remainder(pair, k) * nr + owner  # terms in ascending k, then owner rank
    by_key = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=k * nr).tolist()
    tok = torch.div(pair, k, rounding_mode="floor").index_select(0, by_key)
    pos = pos.index_select(0, by_key)
    terms, c = [], 0
    for key_, m in enumerate(counts):
        if m:
            r = key_ % nr
            terms.append((peers[r]["out"], tok[c:c + m], pos[c:c + m]))
            tp.record_fetch(r, m * 2 * sb.hidden)
        c += m
    return terms + shared_terms


def _waves_buffer(ex, sb, t, cmat, tokens, idx, pair, shared, overlap):
    """The Buffer backend: each wave's pairs go through the normal-mode :class:`~deepep_ascend.Buffer`
    (dispatch of pair rows, combine back with the dispatch's handle), asynchronously on its worker when
    ``overlap``. Returns the final sum's terms (slot j of each wave's combined rows, read where they lie)."""
    kind, el, k, h, trace, epw = ex.kind, sb.num_local_experts, sb.num_topk, sb.hidden, ex.trace, ex.epw
    num_waves = trace.num_waves
    buf = sb.ep_buffer
    worker = buf.get_comm_stream()
    now = time.perf_counter
    wts = sb.topk_weights[:t].reshape(-1)
    e_of = idx.index_select(0, pair)
    wave_of = torch.remainder(e_of, el) // epw
    if kind == "bf16":
        xrows = sb.x[:t]
    else:  # one row of bytes per token: e4m3 data, then its H/32 UE8M0 bytes
        xrows = torch.cat([sb.x[:t].view(torch.uint8), sb.x_sf[:t].contiguous().view(torch.uint8)], 1)
    waves = []
    for w in range(num_waves):
        sel = pair[wave_of == w]
        waves.append((sel, idx.index_select(0, sel).unsqueeze(1).contiguous(),
                      wts.index_select(0, sel).unsqueeze(1).contiguous()))

    def dispatch(w):
        sel, tidx, tw = waves[w]
        rows = xrows.index_select(0, torch.div(sel, k, rounding_mode="floor"))
        ntpr, ntprr, ntpe, itr, _ = buf.get_dispatch_layout(tidx, sb.num_experts)
        s0 = now()
        out = buf.dispatch(rows, num_tokens_per_rank=ntpr, num_tokens_per_rdma_rank=ntprr, is_token_in_rank=itr,
                           num_tokens_per_expert=ntpe, topk_idx=tidx, topk_weights=tw, async_finish=overlap)
        issued.append(out[5])
        return out, _mark("dispatch", w, s0)

    def _mark(op_name, w, s0):
        e0 = now()
        rec = [op_name, w, s0, e0, e0, e0]
        trace.comm.append(rec)
        if overlap:  # the worker runs FIFO: a marker queued now records when this op's data movement ended
            rec[5] = float("nan")

            def done(rec=rec):
                rec[5] = time.perf_counter()
            worker.submit(done)
        return rec

    pending = []  # (wave, combined, event)
    issued = []  # every dispatch's and combine's EventOverlap, in the worker's order

    def l1(w, recv_x, recv_idx, recv_w):
        local = recv_idx[:, 0] - w * epw
        if kind == "bf16":
            return ex.l1(w, recv_x, None, local, recv_w[:, 0])
        return ex.l1(w, recv_x[:, :h].view(FP8), recv_x[:, h:], local, recv_w[:, 0])

    def l2(st):
        o = ex.l2(st)
        # Back to the handle's order by a gather with the inverse permutation: torch's CPU row gather
        # is faster than the scatter (index_copy_) it replaces.
        order = st["order"]
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel())
        return o.index_select(0, inverse)

    def combine(w, o, handle):
        s0 = now()
        combined, _cw, ev = buf.combine(o, handle, async_finish=overlap)
        issued.append(ev)
        _mark("combine", w, s0)
        pending.append((w, combined, ev))

    try:
        cur = dispatch(0)
        for w in range(num_waves):
            (recv_x, recv_idx, recv_w, _lst, handle, ev), _rec = cur
            if ev.event is not None:
                ev.current_stream_wait()
            st = ex.timed("l1", w, l1, w, recv_x, recv_idx, recv_w)
            if w + 1 < num_waves:
                cur = dispatch(w + 1)
            ex.timed("act", w, ex.act, st)
            o = ex.timed("l2", w, l2, st)
            combine(w, o, handle)
        shared_terms = _shared_terms(ex, sb, t, shared)
        for w, combined, ev in pending:
            if ev.event is not None:
                ev.current_stream_wait()
    except BaseException as exc:
        buf.get_comm_stream().drain()
        if isinstance(exc, TransportPoisoned):  # refused because an op on the worker failed first: report that
            first = next((e for e in (ev.event.exception() for ev in issued if ev.event is not None)
                          if e is not None), None)
            if first is not None:
                raise first from exc
        raise
    worker.drain()
    terms = []  # slot j of each wave's combined rows, read where they lie (no [t*k, H] scatter)
    for j in range(k):
        for w, combined, _ev in pending:
            sel = waves[w][0]
            q = torch.nonzero(torch.remainder(sel, k) == j).squeeze(1)
            terms.append((combined, torch.div(sel.index_select(0, q), k, rounding_mode="floor"), q))
    return terms + shared_terms


def _dense_nt(engine, a, w):
    """bf16 ``a @ w.T`` with float32 accumulation (engine as :func:`gemm_engine`; ``a`` as :func:`_operand_dtype`)."""
    if engine == "bf16":
        return torch.matmul(a, w.t())
    return torch.matmul(a.float(), w.float().t()).to(BF16)


def _shared_expert(kind, sb, t, shared, clamp, fast_math, engine):
    """Shared experts on all ``t`` local tokens: bf16 ``[t, H]`` (weight 1, same activation)."""
    w1s, w2s = shared
    si = w2s.size(1)
    if kind == "bf16":
        x = sb.x[:t]
    else:
        x = _dequant_x(kind, sb.x[:t], sb.x_sf[:t].contiguous().view(torch.uint8), _operand_dtype(engine))
    h = _dense_nt(engine, x, w1s)
    a = _activation(kind, h, si, torch.ones(t), clamp, fast_math, _operand_dtype(engine))
    return _dense_nt(engine, a, w2s)


def bf16_mega_moe(y, l1_weights, l2_weights, sym_buffer, cumulative_local_expert_recv_stats=None,
                  activation: str = "swiglu", activation_clamp=None, fast_math: bool = True, *,
                  shared_l1_weights=None, shared_l2_weights=None, overlap: bool = True,
                  num_experts_per_wave: int | None = None) -> None:
    """Fused BF16 MoE over the EP group (mirrors ``deep_gemm.bf16_mega_moe``); collective, synchronous.

    Reads ``sym_buffer.x[:T]``, ``topk_idx[:T]``, ``topk_weights[:T]`` with ``T = y.size(0)``
    (may differ per rank, 0 allowed) and writes ``y [T, H]`` bf16 in place.

    Args:
        y: bf16 ``[T, H]``, contiguous, output only; ``T <= sym_buffer.num_max_tokens_per_rank``.
        l1_weights, l2_weights: this rank's experts after :func:`transform_weights_for_mega_moe`:
            bf16 ``[E_l, 2I, H]`` and ``[E_l, H, I]``.
        sym_buffer: from :func:`get_symm_buffer_for_mega_moe` with ``mma_type='bf16xbf16'``.
        cumulative_local_expert_recv_stats: optional int32 ``[E_l]``; each call adds the (token, k)
            pairs received per local expert from all ranks (masked slots not counted).
        activation: ``'swiglu'``; activation_clamp: ``None`` or ``c >= 0`` (see module docs);
        fast_math: reciprocal form of the sigmoid.
        shared_l1_weights, shared_l2_weights: keyword-only; bf16 ``[2·S·I, H]`` / ``[H, S·I]``
            when the buffer has ``num_shared_experts = S > 0`` (not transformed).
        overlap: keyword-only; ``False`` runs the same waves with synchronous communication.
        num_experts_per_wave: keyword-only wave size (default: see module docs); every rank must ask for
            the same one (keyword, else ``$DEEPEP_ASCEND_MEGA_MOE_EXPERTS_PER_WAVE``).
    Raises:
        TypeError / ValueError: bad arguments on any rank (every rank raises; peers a
            :class:`~deepep_ascend.ConsensusError` naming the rank), before anything moves; ranks
            passing different ``num_experts_per_wave``, ``activation_clamp`` or ``fast_math`` (each rank's
            experts serve every rank's tokens): ``ConsensusError`` on every rank. Tensors must be dense CPU
            tensors (a ``meta`` or sparse one: ``ValueError``).
        TimeoutError / transports errors: as :meth:`deepep_ascend.Buffer.dispatch`; also when a rank does
            not enter the call within the buffer's timeout (``TimeoutError`` naming it, on the ranks that
            waited; the symmetric buffer is then unusable: destroy it and build a new one). A rank that
            fails after the ranks agreed (an unexpected error in its expert compute) raises its error and
            aborts the buffer: the others raise ``TransportAborted`` naming it at once.
        RuntimeError: (``shm`` backend) a peer's ``topk_idx`` no longer routes the pairs its counts announced
            (its inputs were changed during the call); the buffer is aborted as above.
    """
    _run("bf16", y, l1_weights, l2_weights, sym_buffer, cumulative_local_expert_recv_stats, activation,
         activation_clamp, fast_math, None, shared_l1_weights, shared_l2_weights, overlap, num_experts_per_wave,
         "bf16_mega_moe")


def fp8_fp4_mega_moe(y, l1_weights, l2_weights, sym_buffer, cumulative_local_expert_recv_stats=None,
                     recipe=(1, 1, 32), activation: str = "swiglu", activation_clamp=None, fast_math: bool = True, *,
                     shared_l1_weights=None, shared_l2_weights=None, overlap: bool = True,
                     num_experts_per_wave: int | None = None) -> None:
    """Fused FP8×FP4 MoE over the EP group (mirrors ``deep_gemm.fp8_fp4_mega_moe``); collective, synchronous.

    Reads ``sym_buffer.x[:T]`` (e4m3), ``x_sf[:T]`` (int32, four UE8M0 bytes per int, one per 32
    channels), ``topk_idx[:T]``, ``topk_weights[:T]``; writes ``y [T, H]`` bf16 in place.

    Args:
        l1_weights, l2_weights: transformed ``(int8 [E_l, 2I, H/2], int32 [E_l, 2I, H/128])`` and
            ``(int8 [E_l, H, I/2], int32 [E_l, H, I/128])`` (FP4 e2m1 + UE8M0 per 32 along K).
        recipe: must be ``(1, 1, 32)``.
        shared_l1_weights, shared_l2_weights: keyword-only ``(data, sf)`` pairs, see module docs.
        Others as :func:`bf16_mega_moe`.
    Raises:
        as :func:`bf16_mega_moe`.
    """
    _run("fp8", y, l1_weights, l2_weights, sym_buffer, cumulative_local_expert_recv_stats, activation,
         activation_clamp, fast_math, recipe, shared_l1_weights, shared_l2_weights, overlap, num_experts_per_wave,
         "fp8_fp4_mega_moe")
