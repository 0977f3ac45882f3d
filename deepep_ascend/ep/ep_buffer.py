"""``EPBuffer``: DeepEP V2.5's expert-parallel API (what DeepEP-Ascend 1.0 speaks) on the normal-mode
engines that V1 ``Buffer`` runs on (docs/semantics/deepep-api.md §13).

A dispatch runs the engines' dispatch (routing, counts, one copy of every row into the receiver's
``recv_x``), then an epilogue builds the :class:`~deepep_ascend.ep.ep_handle.EPHandle` and, for the
expanded layout, places every (token, local expert) row at its slot. A combine (expanded layout:
after a local reduction of each token's slots) runs the engines' combine with DeepEP V2.5's order:
each rank's row is added at the position of that rank's last top-k slot in the token's row.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from .. import native as _native
from .. import settings
from ..checks import as_int, is_int
from ..ordering import stable_argsort
from ..rounding import align, ceil_div
from ..transports import Topology, create_transport, timeout_problem
from . import memory
from .allocator import BufferAllocator, BufferBase, get_num_allocation_alignment
from .arguments import (
    MAX_EXPERT_ALIGNMENT,
    Rejected,
    check,
    check_tensor,
    check_writable,
    checked_dispatch_layout,
    context_idx_problem,
    expert_alignment_ok,
    sl_idx_problem,
)
from .buffer import Buffer
from .ep_handle import EPHandle
from .event import EventHandle, EventOverlap
from .group import check_agreed, mpi_comm_of
from .handles import InternodeHandle
from .internode import InternodeEngine
from .intranode import IntranodeEngine
from .layout import dst_buffer_slots, last_slot_per_rank
from .load_balance import LoadBalanceRegion
from .memory import outside_inference_mode
from .phases import RECORDER as _PH
from .phases import engine_of, timed
from .protocol import (
    CALL_BARRIER,
    CALL_LOAD_BALANCE,
    EP_MODE_CPU_SYNC,
    EP_MODE_EXPAND,
    EP_MODE_WEIGHTS,
    EP_MODE_ZERO_PADDING,
    W_EP_ALIGNMENT,
    W_EP_MAX_TOKENS,
    W_EP_MODE,
    dtype_code,
)
from .reduce import CombineScratch, accumulate_rows
from .rows import zero_rows
from .stamps import stamp, stamp_matches

__all__ = ["EPBuffer", "ElasticBuffer"]

#: Experts the size hint makes room for in the count exchange (a call with more still works: the
#: engines then move its rows in more rounds).
NUM_MAX_EXPERTS = 1024
#: Top-k slots the size hint assumes when ``num_topk=0``.
NUM_MAX_TOPK = 32


def handle_made_by(handle: EPHandle, buffer: EPBuffer) -> bool:
    """Whether ``handle`` came from a dispatch of ``buffer`` (what a cached dispatch, combine and MegaMoE's
    :func:`~deepep_ascend.mega_moe.mega_moe_experts` check)."""
    return handle._buffer_uid == buffer._legacy._uid


def _typed(rows: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Byte rows ``[n, m * itemsize]`` (unit stride along a row) viewed as ``[n, m]`` of ``like``'s dtype (no
    copy)."""
    return rows.view(like.dtype)


def _check_expanded_capacity(topk_idx: torch.Tensor, L: int, R: int) -> None:
    """Without CPU sync the expanded layout has DeepEP's worst-case rows, ``R·num_max_tokens_per_rank·min(K, L)``
    (plus the alignment gaps): room for at most ``L`` rows per token and rank, which only an expert listed twice
    in one ``topk_idx`` row can exceed (``K > L``). Raises ``ValueError`` naming the first such token."""
    dest = torch.where(topk_idx >= 0, topk_idx // L, R)  # column R collects the -1 slots
    per_rank = torch.zeros(topk_idx.size(0), R + 1, dtype=torch.int64).scatter_add_(1, dest, torch.ones_like(dest))
    over = torch.nonzero(per_rank[:, :R] > L)
    if over.numel():
        t, j = (int(v) for v in over[0])
        raise ValueError(f"`topk_idx` row {t} sends {int(per_rank[t, j])} slots to rank {j}, which holds {L} "
                         f"experts (L): with do_cpu_sync=False the expanded layout has room for at most L rows per "
                         f"token and rank (DeepEP's capacity R·num_max_tokens_per_rank·min(K, L)); list each expert "
                         f"once per token, or pass do_cpu_sync=True")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``[n, m]`` of any strides as contiguous byte rows ``[n, m * itemsize]`` (a view when contiguous)."""
    if t.size(1) and t.stride(1) == 1 and t.stride(0) == t.size(1):  # the usual case: one dtype view
        return t.view(torch.uint8)
    return t.contiguous().reshape(-1).view(torch.uint8).view(t.size(0), t.size(1) * t.element_size())


class EPBuffer(BufferBase):
    """The expert-parallel communication buffer of DeepEP V2.5 (``deep_ep.EPBuffer``).

    Args:
        group: a torch ProcessGroup (ranks equal to MPI's, as under ``mpiexec``) or an mpi4py communicator.
        num_bytes: buffer bytes per rank, a multiple of :func:`get_num_allocation_alignment`; or ``None``
            to size by the MoE shape below (:meth:`get_buffer_size_hint`).
        num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch: the MoE shape (``num_topk=0``:
            up to :data:`NUM_MAX_TOPK` slots). ``num_max_tokens_per_rank`` is also the dispatch default.
        lb_allocation_plan_or_num_bytes: bytes of the load-balance region, or a
            :class:`~deepep_ascend.ep.allocator.BufferAllocator` plan materialized in it (0: none): a
            node-shared segment per rank (``lb_storage``) for :meth:`lb_prefetch_weights` and
            :meth:`lb_reduce_grads` (docs/semantics/deepep-api.md §13.9).
        deterministic: accepted; every dispatch here is deterministic (rows ordered by source token).
        allow_hybrid_mode, allow_multiple_reduction, prefer_overlap_with_compute: DeepEP's switches.
            ``allow_hybrid_mode=False`` across nodes sends every row straight to its rank (DeepEP's direct
            mode); ``allow_multiple_reduction=False`` (expanded layout, hybrid mode across nodes) gives
            DeepEP's one-rounding arithmetic through ``K`` combine passes (docs/semantics/deepep-api.md §13.5).
        sl_idx, num_allocated_qps, num_gpu_timeout_secs: accepted, no meaning on CPU ranks.
        num_cpu_timeout_secs: deadline of every wait in seconds; ``None`` (the default): ``$DEEPEP_ASCEND_TIMEOUT_S``
            if set, else DeepEP's 300.
        explicitly_destroy: as DeepEP: :meth:`destroy` must then be called on every rank.
        ranks_per_node: simulated node size (default ``$DEEPEP_ASCEND_RANKS_PER_NODE``, else the
            shared-memory domain); more than one node takes DeepEP's two hops over URMA and UBMEM.

    Raises:
        ValueError: ``num_bytes`` not a positive multiple of the alignment, or neither it nor a shape;
            ranks disagreeing on a collective argument (``num_bytes``, the LB bytes,
            ``num_max_tokens_per_rank``, the mode switches, ``explicitly_destroy``, the timeout): raised
            on every rank, naming the argument and each rank's value, before anything is allocated.
    """

    @outside_inference_mode  # its own tensors are kept across calls: normal tensors in either mode
    def __init__(self, group, num_bytes: int | None = None, num_max_tokens_per_rank: int = 0, hidden: int = 0,
                 num_topk: int = 0, use_fp8_dispatch: bool = False,
                 lb_allocation_plan_or_num_bytes: BufferAllocator | int = 0, deterministic: bool = False,
                 allow_hybrid_mode: bool = True, allow_multiple_reduction: bool = True,
                 prefer_overlap_with_compute: bool = True, sl_idx: int | None = None, num_allocated_qps: int = 0,
                 num_cpu_timeout_secs: int | None = None, num_gpu_timeout_secs: int = 100,
                 explicitly_destroy: bool = False, *, ranks_per_node: int | None = None):
        super().__init__(explicitly_destroy)
        comm = mpi_comm_of(group, None, self.api_name)
        self.group = group
        self.rank_idx, self.num_ranks = comm.Get_rank(), comm.Get_size()
        self.deterministic = deterministic
        self.allow_hybrid_mode = allow_hybrid_mode
        self.allow_multiple_reduction = allow_multiple_reduction
        self.prefer_overlap_with_compute = prefer_overlap_with_compute
        # DeepEP's automatic count (hybrid mode takes more queue pairs); no queue pairs exist here
        self.sl_idx = sl_idx
        self.num_allocated_qps = num_allocated_qps or (65 if allow_hybrid_mode else 17)
        num_max_tokens_per_rank, hidden, num_topk = map(as_int, (num_max_tokens_per_rank, hidden, num_topk))
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        alignment = get_num_allocation_alignment()
        plan = lb_allocation_plan_or_num_bytes if isinstance(lb_allocation_plan_or_num_bytes, BufferAllocator) else None
        num_lb_bytes = plan.num_bytes if plan is not None else as_int(lb_allocation_plan_or_num_bytes)
        num_bytes = as_int(num_bytes)
        shape_error = next((ValueError(f"{self.api_name}: {name} must be an int >= 0, got {value!r}")
                            for name, value in (("num_max_tokens_per_rank", num_max_tokens_per_rank),
                                                ("hidden", hidden), ("num_topk", num_topk))
                            if not is_int(value) or value < 0), None)
        error = None
        if shape_error is not None:
            error = shape_error
        elif num_bytes is None and (num_max_tokens_per_rank <= 0 or hidden <= 0):
            error = ValueError(f"{self.api_name}: pass num_bytes, or num_max_tokens_per_rank and hidden (> 0); "
                               f"got num_max_tokens_per_rank={num_max_tokens_per_rank}, hidden={hidden}")
        elif num_bytes is not None and (not isinstance(num_bytes, int) or num_bytes <= 0 or num_bytes % alignment):
            error = ValueError(f"{self.api_name}: num_bytes must be a positive multiple of {alignment} "
                               f"(get_num_allocation_alignment()), got {num_bytes!r}")
        elif not isinstance(num_lb_bytes, int) or num_lb_bytes < 0 or num_lb_bytes % alignment:
            error = ValueError(f"EPBuffer: lb_allocation_plan_or_num_bytes must be a BufferAllocator or a "
                               f"non-negative multiple of {alignment} bytes, got {lb_allocation_plan_or_num_bytes!r}")
        elif plan is not None and plan.materialized:
            error = ValueError("EPBuffer: the lb_allocation_plan was already materialized")
        error = error or sl_idx_problem(self.api_name, sl_idx)
        error = self._constructor_problem() or error  # a subclass's own argument first
        if num_cpu_timeout_secs is not None:
            bad_timeout = timeout_problem("num_cpu_timeout_secs", num_cpu_timeout_secs)
            error = error or (ValueError(f"{self.api_name}: {bad_timeout}") if bad_timeout else None)
            timeout = None if bad_timeout else float(num_cpu_timeout_secs)
        else:  # DeepEP's default, unless the environment sets one
            timeout = None if settings.TIMEOUT_S.is_set() else 300.0
        # agreed before any collective that sizes or allocates (a rank that refused would leave the others waiting)
        check_agreed(comm, self.api_name, {
            "num_bytes": num_bytes, "num_max_tokens_per_rank": num_max_tokens_per_rank, "hidden": hidden,
            "num_topk": num_topk, "use_fp8_dispatch": bool(use_fp8_dispatch), "lb bytes": num_lb_bytes,
            "allow_hybrid_mode": bool(allow_hybrid_mode), "allow_multiple_reduction": bool(allow_multiple_reduction),
            "explicitly_destroy": bool(explicitly_destroy), "num_cpu_timeout_secs": num_cpu_timeout_secs}, error,
            timeout if error is None and (timeout is None or timeout > 0) else None)
        if num_bytes is None:
            num_bytes = EPBuffer.get_buffer_size_hint(group, num_max_tokens_per_rank, hidden, num_topk,
                                                      use_fp8_dispatch, allow_hybrid_mode, allow_multiple_reduction,
                                                      ranks_per_node=ranks_per_node)
        self.num_bytes, self.num_lb_bytes = num_bytes, num_lb_bytes
        topo = Topology.from_comm(comm, ranks_per_node)
        self._physical = (topo.num_nodes, topo.ranks_per_node)
        self._direct = topo.num_nodes > 1 and not allow_hybrid_mode
        # DeepEP's direct mode sends every row straight to its destination rank: the engines run with one
        # rank per node, so no forwarder relays a row (docs/semantics/deepep-api.md §13.1)
        data_nodes, data_rpn = (self.num_ranks, 1) if self._direct else self._physical
        self._windows = _split(num_bytes, self.num_ranks, data_nodes)
        self._legacy = Buffer(group, num_nvl_bytes=self._windows[0], num_rdma_bytes=self._windows[1],
                              explicitly_destroy=explicitly_destroy, ranks_per_node=data_rpn, timeout_s=timeout)
        self._legacy.api_name = self.api_name
        self.runtime = self._legacy.runtime
        # the LB region is shared inside a physical node (DeepEP's NVLink domain); in direct mode the engines'
        # transport sees one rank per node, so the region gets a transport of the physical nodes
        self._lb_tp = None
        if num_lb_bytes and self._direct:
            self._lb_tp = create_transport(comm, ranks_per_node=topo.ranks_per_node, timeout_s=timeout)
        self._lb = LoadBalanceRegion(self._lb_tp or self.runtime, num_lb_bytes)
        self.lb_storage = self._lb.storage
        if plan is not None:
            plan.materialize(self.lb_storage)
        self.num_rdma_ranks, self.num_nvlink_ranks = self.get_physical_domain_size()
        self.num_scaleout_ranks, self.num_scaleup_ranks = self.get_logical_domain_size()
        self.scaleout_rank_idx = self.rank_idx // self.num_scaleup_ranks
        self.scaleup_rank_idx = self.rank_idx % self.num_scaleup_ranks
        self._scratch = CombineScratch()
        self._outputs = memory.OutputPool()  # the expanded layout's rows

    def _constructor_problem(self) -> Exception | None:
        """A subclass's own argument error, refused on every rank with the others (none here)."""
        return None

    # -- sizes ------------------------------------------------------------------------------
    @staticmethod
    @functools.lru_cache(maxsize=256)  # a function of a few ints, asked by every dispatch
    def _window_needs(num_ranks: int, num_nodes: int, num_max_tokens_per_rank: int, x_bytes: int, sf_bytes: int,
                      num_topk: int, hidden: int, num_experts: int = NUM_MAX_EXPERTS) -> tuple[int, int]:
        """``(UBMEM, URMA)`` window bytes a call of this shape needs in one round (the engines' worst case,
        with room for ``num_experts`` experts' counts, which the first round carries: across nodes they must fit
        one node box)."""
        if num_nodes == 1:
            return IntranodeEngine.size_hint(num_max_tokens_per_rank, x_bytes, sf_bytes, num_topk, num_experts,
                                             num_ranks, 2 * hidden, num_topk), 0
        # combine's rows carry each row's sort key across nodes (docs/semantics/deepep-api.md §13.5)
        return InternodeEngine.size_hints(num_max_tokens_per_rank, x_bytes, sf_bytes, num_topk, num_experts,
                                          num_ranks, num_nodes, 2 * hidden, num_topk + 1)

    @staticmethod
    def _bytes_for(needs: tuple[int, int], num_ranks: int, num_nodes: int) -> int:
        """The smallest ``num_bytes`` whose :func:`_split` covers ``needs``."""
        unit = get_num_allocation_alignment()
        nvl, rdma = needs
        if num_nodes == 1:
            return align(nvl, unit)
        total = num_ranks + num_nodes
        n = align(max(nvl + rdma, ceil_div(nvl * total, num_ranks), ceil_div(rdma * total, num_nodes)), unit)
        while n > unit and _covers(_split(n - unit, num_ranks, num_nodes), needs):
            n -= unit
        while not _covers(_split(n, num_ranks, num_nodes), needs):
            n += unit
        return n

    @staticmethod
    def get_buffer_size_hint(group, num_max_tokens_per_rank: int, hidden: int, num_topk: int = 0,
                             use_fp8_dispatch: bool = False, allow_hybrid_mode: bool = True,
                             allow_multiple_reduction: bool = True, *, ranks_per_node: int | None = None) -> int:
        """Bytes per rank that calls of this MoE shape need (``deep_ep.EPBuffer.get_buffer_size_hint``).

        Collective (it reads the group's topology; ``ranks_per_node`` as in the constructor).

        Exact: a buffer of these bytes takes every call with at most ``num_max_tokens_per_rank`` tokens
        of ``hidden`` (BF16, or FP8 with float32 scales per 128 channels) and ``num_topk`` slots (0: up to
        :data:`NUM_MAX_TOPK`); one alignment unit less is refused by such a call (``ValueError``).
        Returns a multiple of :func:`get_num_allocation_alignment`.
        """
        num_max_tokens_per_rank, hidden, num_topk, ranks_per_node = map(as_int, (num_max_tokens_per_rank, hidden,
                                                                                num_topk, ranks_per_node))
        comm = mpi_comm_of(group, None)
        num_ranks, num_nodes = comm.Get_size(), Topology.from_comm(comm, ranks_per_node).num_nodes
        if num_nodes > 1 and not allow_hybrid_mode:  # direct mode: one rank per node for the engines
            num_nodes = num_ranks
        k = num_topk if num_topk > 0 else NUM_MAX_TOPK
        x_bytes, sf_bytes = (hidden, 4 * ceil_div(hidden, 128)) if use_fp8_dispatch else (2 * hidden, 0)
        needs = EPBuffer._window_needs(num_ranks, num_nodes, num_max_tokens_per_rank, x_bytes, sf_bytes, k, hidden)
        return EPBuffer._bytes_for(needs, num_ranks, num_nodes)

    def get_physical_domain_size(self) -> tuple[int, int]:
        """``(num_rdma_ranks, num_nvlink_ranks)``: nodes and ranks per node (URMA and UBMEM domains)."""
        return self._physical

    def get_logical_domain_size(self) -> tuple[int, int]:
        """``(num_scaleout_ranks, num_scaleup_ranks)``: ``(nodes, ranks per node)`` in hybrid mode across
        nodes; ``(1, num_ranks)`` on one node and in direct mode (``allow_hybrid_mode=False``)."""
        if self._direct:
            return 1, self.num_ranks
        return self._legacy.num_nodes, self._legacy.ranks_per_node

    def _memory_usage(self) -> dict[str, int]:
        return {"UBMEM window": self._windows[0], "URMA window": self._windows[1], "LB storage": self.num_lb_bytes}

    def _destroy(self) -> None:
        self._legacy.destroy()
        self._lb.release()
        if self._lb_tp is not None:
            self._lb_tp.destroy()

    def barrier(self, wait_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True,
                context_idx: int | None = None) -> None:
        """Block until every rank of the group reached it; mirrors ``deep_ep.EPBuffer.barrier`` (DeepEP's
        ``comm.barrier``). ``wait_comm_stream``, ``with_cpu_sync`` and ``sequential`` are accepted (the barrier
        always waits for this rank's queued calls, on the CPU); ``context_idx`` is None or 0 (one group).

        Raises:
            RuntimeError: the buffer was destroyed. ValueError: another ``context_idx`` (after this rank took part
                in the barrier, so that later barriers stay paired).
            transports.TransportTimeout: a rank did not arrive within the deadline (naming it; the peers are
                aborted, so a rank waiting in another call fails at once).
            ConsensusError: a rank is in a ``dispatch``, ``combine`` or load-balance call at this barrier's place in
                the sequence of calls (the ranks' calls differ; the buffer is failed, docs/semantics/deepep-api.md §8).
        """
        self._usable("barrier")
        bad = context_idx_problem(self.api_name, context_idx)
        legacy = self._legacy
        legacy._tag_call(CALL_BARRIER, 1)  # (a rank in a dispatch or combine meanwhile: ConsensusError, not a timeout)
        legacy._worker.drain()
        legacy._guard(lambda: self.runtime.barrier(phase=f"{self.api_name}.barrier"))
        if bad:  # raised after taking part, so that the ranks' barriers stay paired
            raise bad

    def get_traffic(self, lifetime: bool = False) -> dict[str, int]:
        """Bytes this rank moved per channel kind (``SELF``, ``UBMEM``, ``URMA``) in its last call, or
        since construction with ``lifetime`` (as ``Buffer.get_traffic``; not in DeepEP)."""
        return self._legacy.get_traffic(lifetime)

    def get_comm_stream(self):
        """The buffer's worker (the CPU analogue of DeepEP's communication stream)."""
        return self._legacy.get_comm_stream()

    @staticmethod
    def capture() -> EventHandle:
        """An event on the caller's thread (complete once recorded, as everything before it ran)."""
        return EventHandle()

    def get_theoretical_num_sms(self, num_experts: int, num_topk: int, *args, **kwargs) -> int:
        """DeepEP's SM estimate has no CPU meaning: returns :attr:`Buffer.num_sms` (accepted for porting)."""
        return Buffer.num_sms

    def _handle_num_sms(self, num_sms, num_experts: int, num_topk: int):
        """The ``num_sms`` a new handle keeps, resolved as DeepEP V2.5's dispatch does: 0 (automatic) becomes
        :meth:`get_theoretical_num_sms`, a positive int is rounded up to even, anything else is kept as passed."""
        if num_sms == 0:
            return self.get_theoretical_num_sms(num_experts, num_topk)
        return align(num_sms, 2) if is_int(num_sms) and num_sms > 0 else num_sms

    def _make_handle(self, **fields) -> EPHandle:
        """A new dispatch's handle (:class:`EPHandle`'s keyword arguments)."""
        return EPHandle(**fields)

    def _qps_problem(self, num_qps) -> Exception | None:
        """Why a call's ``num_qps`` is refused, or None: not a non-negative int (``ValueError``, as
        ``EngramBuffer.fetch``), or above ``num_allocated_qps`` (DeepEP's ``AssertionError``). 0 (automatic:
        :meth:`get_theoretical_num_qps`, capped at the allocated count) always fits; no meaning on CPU ranks."""
        if not is_int(num_qps) or num_qps < 0:
            return ValueError(f"`num_qps` must be a non-negative int (0: automatic), got {num_qps!r}")
        if num_qps == 0 or not is_int(self.num_allocated_qps):
            return None
        if num_qps > self.num_allocated_qps:
            return AssertionError(f"Allocated QPs are not enough: num_qps={num_qps}, num_allocated_qps="
                                  f"{self.num_allocated_qps}")
        return None

    def get_theoretical_num_qps(self, num_sms: int) -> int:
        """DeepEP's QP estimate (no CPU meaning, kept for porting): ``min(num_sms, 9)`` in direct mode,
        ``16 * num_sms + 1`` in hybrid mode, capped at ``num_allocated_qps``."""
        num_qps = 16 * num_sms + 1 if self.allow_hybrid_mode else min(num_sms, 8 + 1)
        return min(num_qps, self.num_allocated_qps)

    def _usable(self, op: str) -> None:
        if self.runtime is None:
            raise RuntimeError(f"{self.api_name}.{op}: the buffer was destroyed")

    def refuse_call(self, op: str, error: Exception) -> None:
        """Take this rank's part in the collective ``dispatch`` or ``combine`` as a rejection of its arguments,
        then raise ``error``: the peers' matching call raises a ``ConsensusError`` naming this rank, the buffer
        stays usable (``Buffer.refuse_call``, for wrappers with checks of their own). Not in DeepEP.

        Args:
            op: ``"dispatch"``, ``"cached_dispatch"`` (``dispatch(handle=...)``) or ``"combine"``.
            error: the exception this rank raises.
        Raises:
            ``error`` (always); ``ValueError`` for another ``op``; ``RuntimeError`` when the buffer was destroyed.
        """
        if op not in ("dispatch", "cached_dispatch", "combine"):
            raise ValueError(f"EPBuffer.refuse_call: `op` must be 'dispatch', 'cached_dispatch' or 'combine', "
                             f"got {op!r}")
        self._usable(op)
        self._legacy.refuse_call(op, error)

    # -- dispatch ---------------------------------------------------------------------------
    @timed("ep_dispatch", engine_of)
    def dispatch(self, x, topk_idx: torch.Tensor | None = None, topk_weights: torch.Tensor | None = None,
                 cumulative_local_expert_recv_stats: torch.Tensor | None = None, num_experts: int | None = None,
                 num_max_tokens_per_rank: int | None = None, expert_alignment: int | None = None,
                 num_sms: int = 0, num_qps: int = 0, previous_event: EventHandle | None = None,
                 async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False,
                 handle: EPHandle | None = None, do_handle_copy: bool = False, do_cpu_sync: bool | None = None,
                 do_expand: bool = False, do_zero_padding: bool = False, use_tma_aligned_col_major_sf: bool = False,
                 defer_epilogue: bool = False):
        """Send each token to every rank owning one of its experts; mirrors ``deep_ep.EPBuffer.dispatch``
        (docs/semantics/deepep-api.md §13.2).

        Args:
            x: ``[N, hidden]`` BF16 (any 2-D dtype moves as bytes), or FP8 ``(data [N, hidden] 1-byte
                dtype, sf [N, S] any dtype and strides)`` whose scale rows travel with their tokens.
            topk_idx: ``[N, K]`` int64 expert ids in ``[-1, num_experts)`` (-1: none); an expert listed twice
                in a row counts per slot (docs/semantics/deepep-api.md §0); ``None`` with ``handle``.
            topk_weights: ``[N, K]`` float32 or None (also allowed with ``handle``: then dispatched too).
            cumulative_local_expert_recv_stats: ``[L]`` int32, incremented by this call's per-expert counts.
            num_experts: ``E``, a multiple of the ranks (from ``handle`` if given).
            num_max_tokens_per_rank: at least ``N`` on every rank (default: the constructor's).
            expert_alignment: expanded layout: each expert's rows start at a multiple of it (default 1; an int in
                ``[1, 2**31 - 1]``, DeepEP's 32-bit type).
            num_sms, num_qps, allocate_on_comm_stream, use_tma_aligned_col_major_sf (scales returned
                column-major when True): accepted as in DeepEP.
            previous_event: an event (``capture()``) to wait for before the call (needs
                ``allocate_on_comm_stream=True``, as in DeepEP).
            async_with_compute_stream: the data movement runs on the buffer's worker; wait on the event.
                Until it completes the worker reads ``x``, ``topk_idx`` and ``topk_weights``: leave them
                untouched (DeepEP's rule); one written in place makes the wait raise ``RuntimeError`` naming
                it, and the peers fail too (docs/semantics/deepep-api.md §3.3).
            handle: a previous dispatch's :class:`EPHandle`: same routing, no counts exchanged
                (``do_cpu_sync`` must not be True; ``topk_idx`` must be None).
            do_handle_copy: must be False (as in DeepEP V2.5; ``ElasticBuffer`` takes V2's True).
            do_cpu_sync: True: outputs sized by the real counts; False: by capacity (``R *
                num_max_tokens_per_rank`` rows; shapes independent of other ranks), the real count in
                ``handle.psum_num_recv_tokens_per_scaleup_rank[-1]``. Default True unless ``handle``.
            do_expand, do_zero_padding: the expanded layout (one row per (token, local expert), grouped
                by expert, 1-D weights), and zeroed alignment gaps.
            defer_epilogue: return only the event (needs ``async_with_compute_stream``); its
                ``current_stream_wait()`` returns ``(recv_x, recv_topk_idx, recv_topk_weights, handle)``.
        Returns:
            ``(recv_x, recv_topk_idx, recv_topk_weights, handle, event)``: ``recv_x`` like ``x`` (FP8: the
            pair); ``recv_topk_idx`` ``[n, K]`` int64 local expert ids or -1 (``None`` expanded);
            ``recv_topk_weights`` ``[n, K]`` float32 (expanded: ``[rows]``; ``None`` without weights).
        Raises:
            TypeError / ValueError: bad arguments on any rank (among them, with ``do_expand`` and
                ``do_cpu_sync=False``, a ``topk_idx`` row sending more than ``L`` slots to one rank: DeepEP's
                capacity has no room for them), or ranks disagreeing on ``num_experts``,
                ``num_max_tokens_per_rank``, ``expert_alignment``, the layout flags or dtypes: every rank
                raises (``ConsensusError`` naming the ranks).
            AssertionError: DeepEP's flag checks (``do_handle_copy``, ``do_cpu_sync`` with ``handle``,
                ``defer_epilogue`` without ``async_with_compute_stream``, ``num_qps`` above
                ``num_allocated_qps``; ``ValueError`` for a ``num_qps`` that is not a non-negative int), on the
                failing rank (``ConsensusError`` on the others).
            RuntimeError / TypeError: ``previous_event`` without ``allocate_on_comm_stream=True`` (DeepEP's check),
                or not an event, likewise.
            TimeoutError / transports.TransportAborted: as ``Buffer.dispatch``.
        """
        self._usable("dispatch")
        # DeepEP's flag assertions, raised inside the call's first round so that every rank raises
        flag_problem = (AssertionError("`do_handle_copy` must be False (DeepEP V2.5 copies no handle)")
                        if do_handle_copy else
                        _defer_problem(defer_epilogue, async_with_compute_stream) or
                        (AssertionError("Cannot do CPU sync with cached handle")
                         if handle is not None and do_cpu_sync else None) or
                        _stream_problem(previous_event, allocate_on_comm_stream) or
                        self._qps_problem(num_qps))
        if handle is not None:
            do_cpu_sync = False
        do_cpu_sync = True if do_cpu_sync is None else bool(do_cpu_sync)
        # a malformed x or handle is refused inside the checked round (check_common, precheck_cached), on every rank
        x_problem = (f"`x` must be a tensor or an (x, sf) pair, got a tuple of {len(x)}"
                     if isinstance(x, tuple) and len(x) != 2 else None)
        data, sf = (x if isinstance(x, tuple) else (x, None)) if x_problem is None else (None, None)
        num_experts = as_int(num_experts)
        if isinstance(handle, EPHandle):
            num_experts = handle.num_experts if num_experts is None else num_experts
            expert_alignment = handle.expert_alignment if expert_alignment is None else expert_alignment
            num_max_tokens_per_rank = handle.num_max_tokens_per_rank if num_max_tokens_per_rank is None \
                else num_max_tokens_per_rank
        max_tokens = self.num_max_tokens_per_rank if num_max_tokens_per_rank is None else num_max_tokens_per_rank
        alignment = 1 if expert_alignment is None else expert_alignment
        mode = (EP_MODE_EXPAND if do_expand else 0) | (EP_MODE_CPU_SYNC if do_cpu_sync else 0) | \
            (EP_MODE_ZERO_PADDING if do_zero_padding else 0) | (EP_MODE_WEIGHTS if topk_weights is not None else 0)
        # (numpy integers are the same values as ints: ranks passing either agree; anything else is refused below)
        words = {W_EP_MAX_TOKENS: int(max_tokens) if is_int(max_tokens) else -1,
                 W_EP_ALIGNMENT: int(alignment) if is_int(alignment) else -1, W_EP_MODE: mode}
        prev = _previous(previous_event)
        R = self.num_ranks

        def check_common():
            if flag_problem is not None:
                raise Rejected(flag_problem)
            check(x_problem is None, TypeError, x_problem)
            check(is_int(max_tokens) and max_tokens > 0, ValueError,
                  lambda: f"`num_max_tokens_per_rank` must be a positive int (here or at construction), got "
                          f"{max_tokens!r}")
            check(expert_alignment_ok(alignment), ValueError,
                  lambda: f"`expert_alignment` must be an int in [1, {MAX_EXPERT_ALIGNMENT}], got {alignment!r}")
            check(not do_zero_padding or do_expand, ValueError, "`do_zero_padding` needs do_expand=True")
            check_tensor(data, "x[0]" if sf is not None else "x", ndim=2)
            check(data.size(1) >= 1, ValueError, lambda: f"`x` must have hidden >= 1, got shape {tuple(data.shape)}")
            n = data.size(0)
            check(n <= max_tokens, ValueError, lambda: f"`x` has {n} tokens, more than "
                                                       f"num_max_tokens_per_rank={max_tokens}")
            if sf is not None:
                check(data.element_size() == 1, TypeError, lambda: f"FP8 `x[0]` must be a 1-byte dtype, got "
                                                                   f"{data.dtype}")
                check_tensor(sf, "x[1] (sf)", ndim=2)
                check(sf.size(0) == n, ValueError, lambda: f"`x[1]` (sf) must have {n} rows, got {sf.size(0)}")
            if topk_weights is not None:
                routing = handle.topk_idx if handle is not None else topk_idx
                k = routing.size(1) if isinstance(routing, torch.Tensor) else -1
                check_tensor(topk_weights, "topk_weights", torch.float32, shape=(n, k))
            if cumulative_local_expert_recv_stats is not None:
                check_tensor(cumulative_local_expert_recv_stats, "cumulative_local_expert_recv_stats", torch.int32,
                             shape=(num_experts // R,) if isinstance(num_experts, int) else None)
                check_writable(cumulative_local_expert_recv_stats, "cumulative_local_expert_recv_stats")
            return n

        def payload(n, k_weights):
            """``x`` (and scales, and dispatched weights of a cached call) as byte rows."""
            xb = _bytes(data)
            extra = [] if sf is None else [_padded_bytes(sf)]
            if k_weights is not None:
                extra.append(_bytes(k_weights))
            sb = extra[0] if len(extra) == 1 else (torch.cat(extra, dim=1) if extra else None)
            hidden = data.size(1)
            sf_bytes = 0 if sf is None else extra[0].size(1)  # dispatched weights count as the top-k slots
            k = (handle.topk_idx if handle is not None else topk_idx).size(1)
            G = self._legacy.num_nodes
            # every expert's count must fit one round (a node box across nodes): past the hint's experts, the call's
            E = max(NUM_MAX_EXPERTS, handle.num_experts if handle is not None else num_experts)
            needs = EPBuffer._window_needs(R, G, max_tokens, xb.size(1), sf_bytes, k, hidden, E)
            check(_covers(self._windows, needs), ValueError,
                  lambda: f"num_bytes={self.num_bytes} is below the {EPBuffer._bytes_for(needs, R, G)} bytes a call "
                  f"of num_max_tokens_per_rank={max_tokens} with rows of {xb.size(1)} B (`x` {tuple(data.shape)} "
                  f"{data.dtype}; +{sf_bytes} B of scales), {k} top-k slots"
                  + (f" and num_experts={E}" + (f" across {G} nodes" if G > 1 else "") if E > NUM_MAX_EXPERTS else "")
                  + f" needs; see EPBuffer.get_buffer_size_hint (room for {NUM_MAX_EXPERTS} experts' counts)")
            return xb, sb

        if handle is None:
            def precheck():
                check(topk_idx is not None, ValueError, "`topk_idx` is required without a handle")
                check_tensor(topk_idx, "topk_idx", torch.int64, ndim=2)
                n = check_common()
                check(is_int(num_experts) and num_experts > 0 and num_experts % R == 0, ValueError,
                      lambda: f"`num_experts` must be a positive multiple of the {R} ranks, got {num_experts!r}")
                check(topk_idx.size(0) == n, ValueError,
                      lambda: f"`topk_idx` must have {n} rows (one per token of x), got {topk_idx.size(0)}")
                # every expert's count lies in the window: a num_experts no window holds is refused before the
                # layout, whose tensors have num_experts entries (payload() below checks this call's bytes)
                check(4 * num_experts <= self.num_bytes, ValueError,
                      lambda: f"num_experts={num_experts}: its counts (4 B each) cannot fit num_bytes={self.num_bytes}")
                if _PH.on:
                    _PH.switch("layout")
                # the ids' range checked on the way; the combine's keys in the same pass where every combine needs them
                layout = checked_dispatch_layout(topk_idx, num_experts, R, last_slot=keys_always)
                if keys_always:
                    *layout, made["order"] = layout
                if _PH.on:
                    _PH.switch("checks")
                if do_expand and not do_cpu_sync and topk_idx.numel() and topk_idx.size(1) > num_experts // R:
                    _check_expanded_capacity(topk_idx, num_experts // R, R)
                xb, sb = payload(n, None)
                weights = topk_weights if topk_weights is not None else torch.zeros(topk_idx.shape, dtype=torch.float32)
                return xb, sb, dtype_code(data.dtype), topk_idx, weights, num_experts, layout

            keys_always, made = self._keys_always(), {}
            outputs, event = self._legacy._run_dispatch(
                precheck=precheck, num_worst_tokens=0 if do_cpu_sync else R * max_tokens, previous_event=prev,
                async_finish=async_with_compute_stream, extra_words=words,
                inputs={"x": x, "topk_idx": topk_idx, "topk_weights": topk_weights})
            recv_x, recv_sf, recv_topk, recv_w, recv_list, legacy, num_recv, recv_counts = outputs
            if sf is not None and recv_sf.size(1) != sf.size(1) * sf.element_size():  # the engines' padding
                recv_sf = recv_sf[:, :sf.size(1) * sf.element_size()]
            return self._finish_dispatch(
                event, defer_epilogue, data=data, sf=sf, recv_x=recv_x, recv_sf=recv_sf, recv_topk=recv_topk,
                recv_w=recv_w if topk_weights is not None else None, legacy=legacy, num_recv=num_recv,
                recv_list=recv_list, recv_counts=recv_counts,
                topk_idx=topk_idx, num_experts=num_experts, alignment=alignment, max_tokens=max_tokens,
                num_sms=num_sms, do_cpu_sync=do_cpu_sync, do_expand=do_expand, do_zero_padding=do_zero_padding,
                col_major_sf=use_tma_aligned_col_major_sf, stats=cumulative_local_expert_recv_stats, handle=None,
                order=made.get("order"))

        def precheck_cached():
            check(topk_idx is None, ValueError, "`topk_idx` must be None with a cached handle (it is the handle's)")
            check(isinstance(handle, EPHandle), TypeError, lambda: f"`handle` must be an EPHandle, got "
                                                                   f"{type(handle).__name__}")
            check(handle_made_by(handle, self), ValueError, "`handle` comes from another buffer")
            check(handle.do_expand == do_expand, ValueError,
                  lambda: f"`handle` was made with do_expand={handle.do_expand}, this call passes "
                          f"do_expand={do_expand}")
            check((num_experts, alignment, max_tokens) == (handle.num_experts, handle.expert_alignment,
                                                           handle.num_max_tokens_per_rank), ValueError,
                  lambda: f"num_experts, expert_alignment, num_max_tokens_per_rank ({num_experts}, {alignment}, "
                          f"{max_tokens}) "
                  f"differ from the handle's ({handle.num_experts}, {handle.expert_alignment}, "
                  f"{handle.num_max_tokens_per_rank})")
            n = check_common()
            made_for = handle.topk_idx.size(0)
            check(n == made_for, ValueError, lambda: f"`x` has {n} tokens but the handle was made for {made_for}")
            xb, sb = payload(n, topk_weights)
            return xb, sb, dtype_code(data.dtype), handle._legacy

        (recv_x, recv_extra), event = self._legacy._run_cached_dispatch(
            precheck=precheck_cached, previous_event=prev, async_finish=async_with_compute_stream, extra_words=words,
            inputs={"x": x, "topk_weights": topk_weights})
        sf_bytes = 0 if sf is None else sf.size(1) * sf.element_size()
        recv_sf = None if sf is None else recv_extra[:, :sf_bytes]
        recv_w = None
        if topk_weights is not None:
            recv_w = recv_extra[:, align(sf_bytes, 4):]
        return self._finish_dispatch(
            event, defer_epilogue, data=data, sf=sf, recv_x=recv_x, recv_sf=recv_sf, recv_topk=handle._recv_topk_idx,
            recv_w=recv_w, legacy=handle._legacy, num_recv=handle._num_valid, recv_list=None, recv_counts=None,
            topk_idx=handle.topk_idx,
            num_experts=handle.num_experts, alignment=handle.expert_alignment,
            max_tokens=handle.num_max_tokens_per_rank,
            num_sms=num_sms, do_cpu_sync=False, do_expand=do_expand, do_zero_padding=do_zero_padding,
            col_major_sf=use_tma_aligned_col_major_sf, stats=cumulative_local_expert_recv_stats, handle=handle)

    def _finish_dispatch(self, event: EventOverlap, defer_epilogue: bool, **kw):
        """Allocate the outputs now (every shape is known once the counts are), fill them in the epilogue:
        inline, on the worker after the data movement (async), or at the event's wait (deferred)."""
        if _PH.on:
            _PH.switch("outputs")
        outputs, fill = self._allocate(**kw)
        if event.event is None:  # synchronous: the rows are here
            if _PH.on:
                _PH.switch("epilogue")
            fill()
            event = EventOverlap(EventHandle())
        elif defer_epilogue:
            done = event.event
            event = EventOverlap(EventHandle())
            event.register_hook_after_wait(lambda: (done.current_stream_wait(), fill(), outputs)[2])
            return event
        else:  # the worker runs the epilogue after the rows arrived; the caller waits on its event (whose wait
            # also runs the data movement's input guard, docs/semantics/deepep-api.md §3.3)
            moved = event.event

            def epilogue():  # only after a data movement that succeeded: its error, not the epilogue's, is the one
                if moved.exception() is None:
                    fill()

            event = EventOverlap(EventHandle(self._legacy._worker.submit(epilogue), moved.current_stream_wait),
                                 _flat(outputs))
        if defer_epilogue:
            event.register_hook_after_wait(lambda: outputs)
            return event
        return (*outputs, event)

    def _allocate(self, *, data, sf, recv_x, recv_sf, recv_topk, recv_w, legacy, num_recv, recv_list, recv_counts,
                  topk_idx, num_experts, alignment, max_tokens, num_sms, do_cpu_sync, do_expand,
                  do_zero_padding, col_major_sf, stats, handle, order=None):
        """The outputs ``(recv_x, recv_topk_idx, recv_topk_weights, handle)`` with their final shapes, and the
        epilogue that fills them from the engines' compact rows (docs/semantics/deepep-api.md §13.2).
        ``recv_counts``: the engine's ``[L]`` int64 (token, slot) pairs per local expert (filled once the counts
        arrived: with ``do_cpu_sync`` now, else by the time the epilogue runs), or None (cached dispatch)."""
        R = self.num_ranks
        L = num_experts // R
        k = topk_idx.size(1)
        rows = recv_x.size(0)
        fresh = handle is None
        if fresh:
            # filled in both layouts, as DeepEP does (the rows an expanded dispatch of this routing would have)
            if do_cpu_sync:
                expanded = int(align(np.asarray(recv_list, dtype=np.int64), alignment).sum())
            else:
                expanded = align(R * max_tokens * min(k, L) + L * (alignment - 1), alignment)
            # the per-source and per-expert fields are set by fill() (expanded layout) or when first read
            handle = self._make_handle(
                buffer_uid=self._legacy._uid, legacy=legacy, do_expand=do_expand, num_experts=num_experts,
                expert_alignment=alignment, num_max_tokens_per_rank=max_tokens,
                num_sms=self._handle_num_sms(num_sms, num_experts, k), topk_idx=topk_idx,
                num_recv_tokens=rows, num_valid_tokens=0, num_expanded_tokens=expanded,
                num_recv_tokens_per_expert_list=None, psum_num_recv_tokens_per_scaleup_rank=None,
                psum_num_recv_tokens_per_rank=None, psum_num_recv_tokens_per_expert=None,
                num_unaligned_recv_tokens_per_expert=None,
                recv_src_metadata=torch.full((rows, 2 + k), -1, dtype=torch.int32) if do_expand else None,
                dst_buffer_slot_idx=None, recv_topk_idx=recv_topk, combine_order=order)
        # weights: the engines' float32 rows, or (cached dispatch) byte columns beside the scales
        in_place_w = recv_w is not None and recv_w.dtype == torch.float32
        if not do_expand:
            out_x = _typed(recv_x, data)
            sf_rows = None if sf is None else _typed(recv_sf, sf)
            out_sf = sf_rows if sf is None or not col_major_sf else _col_major(sf_rows.shape, sf.dtype)
            w_out = recv_w if in_place_w else (None if recv_w is None else torch.empty(rows, k, dtype=torch.float32))
            x_exp = sf_exp = None
            outputs = ((out_x if sf is None else (out_x, out_sf)), recv_topk, w_out, handle)
        else:
            rows_exp = handle.num_expanded_tokens
            # reused storage once the caller dropped an earlier output (fresh pages cost a fault each)
            x_exp = self._outputs.empty((rows_exp, recv_x.size(1)), torch.uint8)
            sf_exp = None if sf is None else torch.empty((rows_exp, recv_sf.size(1)), dtype=torch.uint8)
            w_out = None if recv_w is None else torch.empty(rows_exp, dtype=torch.float32)
            out_x = _typed(x_exp, data)
            out_sf = None if sf is None else (_col_major((rows_exp, sf.size(1)), sf.dtype) if col_major_sf
                                              else _typed(sf_exp, sf))
            outputs = ((out_x if sf is None else (out_x, out_sf)), None, w_out, handle)

        def fill():
            # the count is read only here: without do_cpu_sync an async dispatch's count arrives on the worker,
            # after the outputs were allocated (docs/semantics/deepep-api.md §3.4)
            valid = int(num_recv)
            weights_in = recv_w if recv_w is None or in_place_w else recv_w.contiguous().view(torch.float32)
            valid_topk = recv_topk[:valid]
            if recv_counts is not None:  # the engines' per-expert counts: the numbers the routing gives
                counts = recv_counts
            elif stats is not None:
                counts = torch.bincount(valid_topk.reshape(-1) + 1, minlength=L + 1)[1:]  # -1 lands in bin 0
            if stats is not None:
                stats.add_(counts.to(torch.int32))
            if fresh:
                handle._num_valid = valid
                self._fill_handle(handle, legacy, valid_topk, counts, do_cpu_sync)
            if not do_expand:
                # weights from the engines are 0 already where the expert is not local (to_local_experts) and
                # on padding rows; a cached dispatch's come as bytes, masked here
                if w_out is not None and not in_place_w:
                    w_out.copy_(weights_in).masked_fill_(recv_topk < 0, 0.0)
                if w_out is not None:
                    handle._masked_weights = stamp(w_out, recv_topk)
                if out_sf is not None and col_major_sf:
                    out_sf.copy_(sf_rows)
                return
            src_rows, slots, lane = handle._expand
            used = handle._expanded_used  # rows up to the last expert's aligned end
            if used and _native.copy_rows(x_exp, slots, recv_x, src_rows):  # each row straight to its slot
                if sf_exp is not None and not _native.copy_rows(sf_exp, slots, recv_sf, src_rows):
                    sf_exp.index_copy_(0, slots, recv_sf.index_select(0, src_rows))
            elif used and 2 * slots.numel() >= used:  # mostly real rows: one gather straight into place
                rows_of = torch.zeros(used, dtype=torch.int64)  # padding rows take row 0, zeroed below if asked
                rows_of[slots] = src_rows
                torch.index_select(recv_x, 0, rows_of, out=x_exp[:used])
                if sf_exp is not None:
                    torch.index_select(recv_sf, 0, rows_of, out=sf_exp[:used])
            elif used:  # mostly padding (large alignments): gather the real rows, then one block per expert
                rows = recv_x.index_select(0, src_rows)  # grouped by expert already (slot order)
                sf_rows_all = None if sf_exp is None else recv_sf.index_select(0, src_rows)
                for lo, hi, at in _expand_blocks(handle):
                    x_exp[at:at + hi - lo].copy_(rows[lo:hi])
                    if sf_exp is not None:
                        sf_exp[at:at + hi - lo].copy_(sf_rows_all[lo:hi])
            if w_out is not None and slots.numel():
                w_out.index_copy_(0, slots, weights_in[src_rows, lane])
            if used < x_exp.size(0):  # capacity rows past the real ones (do_cpu_sync=False): zeros
                zero_rows(x_exp[used:])
                if sf_exp is not None:
                    sf_exp[used:].zero_()
                if w_out is not None:
                    w_out[used:].zero_()
            if do_zero_padding:  # streaming stores: torch fills uint8 rows byte by byte, through the cache
                gaps = _padding_rows(handle)
                zero_rows(x_exp, gaps)
                if sf_exp is not None:
                    zero_rows(sf_exp, gaps)
                if w_out is not None:
                    w_out.index_fill_(0, gaps, 0.0)
            if out_sf is not None and col_major_sf:
                out_sf.copy_(_typed(sf_exp, sf))

        return outputs, fill

    def _fill_handle(self, handle: EPHandle, legacy, valid_topk: torch.Tensor, counts: torch.Tensor,
                     listed: bool) -> None:
        """The handle's fields from the routing that arrived (counts, prefix sums, metadata, order): those the
        expanded layout's epilogue needs now, the rest as functions run when first read. ``counts``: ``[L]`` int64
        (token, slot) pairs per local expert; ``listed``: whether ``num_recv_tokens_per_expert_list`` is filled
        (``do_cpu_sync``)."""
        R, me, k = self.num_ranks, self.rank_idx, valid_topk.size(1)
        P, num_recv = self.num_scaleup_ranks, valid_topk.size(0)
        alignment, max_tokens = handle.expert_alignment, handle.num_max_tokens_per_rank
        internode = isinstance(legacy, InternodeHandle)

        def per_source(handle: EPHandle) -> None:
            column = legacy.recv_gbl_rank_prefix_sum if internode else legacy.rank_prefix_matrix[:, me]
            column = column.to(torch.int64)
            per_rank = torch.diff(column, prepend=torch.zeros(1, dtype=torch.int64))
            handle._psum_per_rank = column.to(torch.int32)
            handle._psum_per_scaleup_rank = torch.cumsum(per_rank.view(-1, P).sum(0), 0, dtype=torch.int32)
            src_rank = torch.repeat_interleave(torch.arange(R), per_rank)
            src_token = (legacy.recv_src_meta[:num_recv].view(torch.int32)[:, 0] if internode
                         else legacy.recv_src_idx[:num_recv]).to(torch.int64)
            meta = handle._recv_src_metadata
            if meta is None:
                meta = handle._recv_src_metadata = torch.full((handle.num_recv_tokens, 2 + k), -1, dtype=torch.int32)
            meta[:num_recv, 0] = (src_rank * max_tokens + src_token).to(torch.int32)
            last = (torch.where(valid_topk >= 0, torch.arange(k), -1).amax(dim=1) if k
                    else torch.zeros(num_recv, dtype=torch.int64))
            meta[:num_recv, 1] = (src_rank * k + last).to(torch.int32)

        def per_expert(handle: EPHandle) -> None:  # L small ints: numpy; int32 counts of int32 rows cannot overflow
            c = counts.numpy()
            aligned = c if alignment == 1 else (c + alignment - 1) // alignment * alignment
            handle._unaligned_per_expert = torch.from_numpy(c.astype(np.int32))
            handle._per_expert_list = aligned.tolist() if listed else []
            if handle.do_expand:  # each expert's rows end past its aligned start
                handle._psum_per_expert = torch.from_numpy((np.cumsum(aligned) - aligned + c).astype(np.int32))
            else:
                handle._psum_per_expert = torch.from_numpy(np.cumsum(aligned, dtype=np.int32))

        handle._per_source = per_source
        if handle.do_expand:  # the expanded epilogue places rows by the per-expert fields: set now
            per_expert(handle)
            self._expanded_slots(handle, valid_topk, counts, handle._psum_per_expert.to(torch.int64) - counts)
        else:
            handle._per_expert = per_expert

        def combine_order(handle: EPHandle) -> torch.Tensor:  # (raises if the caller changed topk_idx since)
            return last_slot_per_rank(handle.topk_idx, handle.num_experts, R)

        def dst_buffer_slot_idx(handle: EPHandle) -> torch.Tensor:  # (raises if the caller changed topk_idx since)
            return dst_buffer_slots(handle.topk_idx, handle.num_experts, R)

        if handle._order is None:  # made with the layout where every combine needs it, else when a combine does
            handle._order = combine_order
        handle._dst_buffer_slot_idx = dst_buffer_slot_idx

    @staticmethod
    def _expanded_slots(handle: EPHandle, valid_topk: torch.Tensor, counts: torch.Tensor, starts: torch.Tensor):
        """Each received (row, slot) with a local expert gets its expanded row: experts in order, each
        expert's rows in received order (ascending source token), then slot order. ``valid_topk``: ``[n, K]``
        int64 local ids in ``[-1, L)``; ``counts``, ``starts``: ``[L]`` int64 pairs and first row per expert."""
        k = valid_topk.size(1)
        flat = valid_topk.reshape(-1)
        pairs = torch.nonzero(flat >= 0).squeeze(1)  # (row, slot) order
        experts = flat[pairs]
        order = stable_argsort(experts, 0, counts.numel())  # by expert, then row and slot
        pairs, experts = pairs[order], experts[order]
        rows_idx, lanes = pairs // k, pairs % k
        first = torch.cumsum(counts, 0) - counts
        slots = (starts - first)[experts] + torch.arange(experts.numel())
        handle._recv_src_metadata[rows_idx, 2 + lanes] = slots.to(torch.int32)  # the eager columns
        handle._expand = (rows_idx, slots, lanes)
        handle._expand_geometry = (counts, starts)  # for the few callers of the blocks and the padding rows
        handle._padding = None  # made when a zero-padding dispatch first asks, then kept for the cached ones
        alignment = handle.expert_alignment
        handle._expanded_used = int(starts[-1]) + align(int(counts[-1]), alignment) if counts.numel() else 0

    # -- combine ----------------------------------------------------------------------------
    @timed("ep_combine", engine_of)
    def combine(self, x: torch.Tensor, handle: EPHandle, topk_weights: torch.Tensor | None = None, bias=None,
                num_sms: int = 0, num_qps: int = 0, previous_event: EventHandle | None = None,
                async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False,
                defer_epilogue: bool = False):
        """Return every received row to its token's rank and reduce; mirrors ``deep_ep.EPBuffer.combine``
        (docs/semantics/deepep-api.md §13.5).

        Per token: ``acc = f32(bias0) + f32(bias1)``, then each rank's BF16 row added in float32 at the
        position of that rank's last top-k slot in the token's row, one rounding to BF16. No weights
        are applied. Expanded layout: each rank first sums a token's slots in slot order (float32,
        rounded to BF16).

        Args:
            x: ``[handle.num_recv_tokens, hidden]`` BF16 (expanded: ``[handle.num_expanded_tokens, hidden]``).
            handle: the dispatch's :class:`EPHandle`.
            topk_weights: ``[num_recv_tokens, K]`` float32 (expanded: ``[num_expanded_tokens]``) or None;
                returned per original slot (each slot's weight from the rank that owns it, 0 for -1).
            bias: None, a ``[N, hidden]`` BF16 tensor, or a pair of them.
            previous_event, async_with_compute_stream, defer_epilogue: as in :meth:`dispatch` (``x``,
                ``topk_weights`` and ``bias`` are the inputs read until the event completes).
        Returns:
            ``(combined_x [N, hidden] bf16, combined_topk_weights [N, K] float32 | None, event)``, or with
            ``defer_epilogue`` the event whose wait returns the pair.
        Raises:
            TypeError / ValueError: bad arguments or a handle from another buffer, on every rank.
            AssertionError / RuntimeError: DeepEP's flag checks, as in :meth:`dispatch` (``defer_epilogue``,
                ``num_qps``; ``previous_event`` without ``allocate_on_comm_stream``).
            TimeoutError / transports.TransportAborted: as ``Buffer.combine``.
        """
        self._usable("combine")
        # raised in the first round, on every rank
        flag_problem = (_defer_problem(defer_epilogue, async_with_compute_stream) or
                        _stream_problem(previous_event, allocate_on_comm_stream) or
                        self._qps_problem(num_qps))
        prev = _previous(previous_event)
        words = {}
        if isinstance(handle, EPHandle):
            mode = (EP_MODE_EXPAND if handle.do_expand else 0) | (EP_MODE_WEIGHTS if topk_weights is not None else 0)
            words = {W_EP_MAX_TOKENS: handle.num_max_tokens_per_rank, W_EP_ALIGNMENT: handle.expert_alignment,
                     W_EP_MODE: mode}

        # one rounding over separate rows at the origin: DeepEP's arithmetic without multiple reductions
        # (expanded: every slot's row; across nodes in hybrid mode: every rank's row; direct mode needs no
        # passes, each rank being its own node there)
        by_slots = isinstance(handle, EPHandle) and (
            (handle.do_expand and not self.allow_multiple_reduction)
            or (self._legacy.num_nodes > 1 and not self._direct and not self.allow_multiple_reduction))
        if by_slots:
            return self._combine_by_slots(x, handle, topk_weights, bias, prev, words, defer_epilogue, flag_problem)

        def precheck():
            biases, k = self._check_combine(x, handle, topk_weights, bias, flag_problem)
            if _PH.on:
                _PH.switch("compact")
            compact_x, compact_w = self._compact(x, topk_weights, handle)
            if keyed and nodes > 1:  # each row's key as a weight column (docs/semantics/deepep-api.md §13.5)
                meta = handle._own_metadata()
                lane = torch.where(meta[:, 1] >= 0, meta[:, 1] % max(k, 1), 0).to(torch.float32)[:, None]
                compact_w = lane if compact_w is None else torch.cat([compact_w, lane], dim=1)
            return compact_x, compact_w, biases, handle._legacy, handle._combine_order if keyed else None

        # The order of a token's rows matters only in a sum of three or more terms (a bias counting as one): a
        # float32 sum of at most two from +0.0 is commutative (signed zeros included; docs/design/data-path.md).
        # Where no sum can have three terms (_keys_always) and no bias is given the keys are neither made nor sent.
        nodes = self._legacy.num_nodes
        keyed = self._keys_always() or not (bias is None or isinstance(bias, tuple) and all(b is None for b in bias))
        (combined, combined_w), event = self._legacy._run_combine(
            precheck=precheck, previous_event=prev, async_finish=async_with_compute_stream, extra_words=words,
            inputs={"x": x, "topk_weights": topk_weights, "bias": bias})
        if keyed and nodes > 1 and combined_w is not None:  # the keys' column is not the caller's
            combined_w = combined_w[:, :-1] if topk_weights is not None else None
        return self._combine_result(combined, combined_w, event, defer_epilogue)

    def _keys_always(self) -> bool:
        """Whether a combine's sums can have three terms without a bias, so that every combine adds a token's rows
        in key order: one node sums up to ``R`` rows; across nodes a forwarder up to ``P`` rows of its node and the
        origin the ``G`` node partials."""
        nodes = self._legacy.num_nodes
        return max((self.num_ranks,) if nodes == 1 else (self.num_ranks // nodes, nodes)) > 2

    @staticmethod
    def _combine_result(combined, combined_w, event: EventOverlap, defer_epilogue: bool):
        if event.event is None:
            event = EventOverlap(EventHandle())
        if defer_epilogue:
            done = event.event
            out = EventOverlap(EventHandle())
            out.register_hook_after_wait(lambda: (done.current_stream_wait(), (combined, combined_w))[1])
            return out
        return combined, combined_w, event

    def _check_combine(self, x, handle, topk_weights, bias, flag_problem: Exception | None = None):
        """``combine``'s argument checks (raise ``Rejected``; ``flag_problem`` first); returns ``(biases | None,
        num_topk)``."""
        if flag_problem is not None:
            raise Rejected(flag_problem)
        check(isinstance(handle, EPHandle), TypeError, lambda: f"`handle` must be an EPHandle, got "
                                                               f"{type(handle).__name__}")
        check(handle_made_by(handle, self), ValueError, "`handle` comes from another buffer")
        rows = handle.num_expanded_tokens if handle.do_expand else handle.num_recv_tokens
        check_tensor(x, "x", torch.bfloat16, ndim=2)
        check(x.size(0) == rows, ValueError, lambda: f"`x` must have {rows} rows (the handle's "
              f"{'num_expanded_tokens' if handle.do_expand else 'num_recv_tokens'}), got {x.size(0)}")
        k = handle.topk_idx.size(1)
        if topk_weights is not None:
            check_tensor(topk_weights, "topk_weights", torch.float32,
                         shape=(rows,) if handle.do_expand else (rows, k))
        biases = bias if isinstance(bias, tuple) else (bias, None)
        check(len(biases) == 2, ValueError, lambda: f"`bias` must be a tensor or a pair, got {len(biases)} items")
        n = handle.topk_idx.size(0)
        for i, b in enumerate(biases):
            if b is not None:
                check_tensor(b, f"bias[{i}]", torch.bfloat16, shape=(n, x.size(1)))
        if biases[0] is None:
            biases = (biases[1], None)
        return (None if biases[0] is None else biases), k

    def _combine_by_slots(self, x, handle: EPHandle, topk_weights, bias, prev, words, defer_epilogue: bool,
                          flag_problem: Exception | None):
        """Combine with one rounding at the origin over separate rows (docs/semantics/deepep-api.md §13.5):
        the expanded layout with ``allow_multiple_reduction=False`` (every slot's row) or hybrid mode across
        nodes without multiple reductions (every rank's row). Runs ``K`` combines through the engines, pass
        ``j`` carrying only the rows that belong at slot ``j`` (zeros elsewhere, so each pass returns that
        row exactly), then sums the passes in slot order from the bias, in float32, rounding once.
        Synchronous."""
        ys, state = [], {}
        k = handle._topk_idx.size(1)  # (its shape: the first round refuses one written since, on every rank)
        per_slot = handle.do_expand and not self.allow_multiple_reduction

        def precheck(j):
            if j == 0:
                state["biases"], _ = self._check_combine(x, handle, topk_weights, bias, flag_problem)
                state["w"] = self._compact_weights(topk_weights, handle)
                if not per_slot:
                    state["x"] = self._compact(x, None, handle)[0]
            meta = handle._own_metadata()
            rows = meta.size(0)
            xj = torch.zeros(rows, x.size(1), dtype=torch.bfloat16)
            # each row straight to its place (native); torch's index_copy_ moves rows element by element
            if per_slot:
                rows_j, slots_j = _slots_by_lane(handle)[j]
                if not _native.copy_rows(xj, rows_j, x, slots_j):
                    xj.index_copy_(0, rows_j, x.index_select(0, slots_j))
            else:
                lane = torch.where(meta[:, 1] >= 0, meta[:, 1] % max(k, 1), -1)
                sel = torch.nonzero(lane == j).squeeze(1)
                if not _native.copy_rows(xj, sel, state["x"], sel):
                    xj.index_copy_(0, sel, state["x"].index_select(0, sel))
            return xj, state["w"] if j == 0 else None, None, handle._legacy, None

        combined_w = None
        for j in range(k):
            (y, w), event = self._legacy._run_combine(precheck=lambda j=j: precheck(j), previous_event=prev if j == 0
                                                      else None, async_finish=False, extra_words=words)
            ys.append(y)
            if j == 0:
                combined_w = w
        n = handle.topk_idx.size(0)
        if _PH.on:
            _PH.switch("reduce")
        combined = torch.empty(n, x.size(1), dtype=torch.bfloat16)
        acc, tmp = self._scratch.get(x.size(1))
        everyone = torch.arange(n)
        accumulate_rows(combined, [(y, everyone) for y in ys], acc, tmp, state["biases"], disjoint=False)
        return self._combine_result(combined, combined_w, EventOverlap(), defer_epilogue)
    # -- redundant experts (load balance) --------------------------------------------------------
    def lb_get_theoretical_num_sms(self) -> int:
        """DeepEP's bandwidth-based SM count for the LB exchanges has no CPU meaning: returns
        :attr:`Buffer.num_sms` (even), accepted for porting (``deep_ep.EPBuffer.lb_get_theoretical_num_sms``)."""
        return align(Buffer.num_sms, 2)

    def _lb_call(self, op: str, num_sms, previous_event, check):
        """Run ``check()`` (the local checks) on this rank, agree with the group, return its result."""
        error, result, signature = None, None, ()
        try:
            self._usable(op)
            LoadBalanceRegion.num_sms(num_sms)
            if previous_event is not None and not isinstance(previous_event, EventHandle):
                raise TypeError(f"`previous_event` must be an EventHandle (EPBuffer.capture()) or None, got "
                                f"{type(previous_event).__name__}")
            *result, signature = check()
        except Exception as exc:  # raised on every rank by the agreement
            error = exc
        if self.runtime is None:
            raise error
        # (a rank in another call meanwhile: ConsensusError naming both, not a timeout)
        self._legacy._tag_call(CALL_LOAD_BALANCE, 1 if op == "lb_prefetch_weights" else 2)
        if previous_event is not None and error is None:
            previous_event.current_stream_wait()
        self._legacy._worker.drain()  # no queued dispatch or combine shares the transport with the exchange
        self._legacy._named_mismatch(lambda: self._lb.agree(op, error, signature))
        return result

    def lb_prefetch_weights(self, redundant_expert_weights, expert_weights, redundancy_mapping: torch.Tensor,
                            num_sms: int = 0, previous_event: EventHandle | None = None) -> EventOverlap:
        """Copy this rank's expert weights into the redundant slots that peers of its node hold for them;
        mirrors ``deep_ep.EPBuffer.lb_prefetch_weights`` (docs/semantics/deepep-api.md §13.9).

        Collective: every rank of the group calls it (ranks without redundant slots too). Each owner stores
        its experts' bytes straight into the replicas' LB regions (UBMEM stores inside the node). Unused
        slots (-1) and bytes outside the slots are left as they were.

        Args:
            redundant_expert_weights: a tensor or a non-empty sequence of tensors, each contiguous
                ``[num_redundant_experts, *shape]`` (any dtype) lying in this buffer's LB region
                (``lb_allocation_plan_or_num_bytes``), at the same offset on every rank of the node.
            expert_weights: as many contiguous CPU tensors ``[num_local_experts, *shape']`` (``num_local_experts
                > 0``, the same in every tensor and on every rank of the node); each pair moves the same bytes
                per expert, their dtypes and trailing shapes may differ (the bytes are copied as they are).
            redundancy_mapping: ``[num_nvlink_ranks, num_redundant_experts]`` int32 (CPU), identical on every
                rank of the node: entry ``[l, c]`` is the expert in slot ``c`` of the node's ``l``-th rank, an id
                ``owner * num_local_experts + local_expert`` with node-local ``owner`` other than ``l``, or -1.
            num_sms: accepted (a non-negative int; no meaning on CPU ranks).
            previous_event: an event (``capture()``) waited for before the call.
        Returns:
            an :class:`EventOverlap` holding a completed event: the slots are filled on every rank of the node
            when the call returns (the exchange runs on the caller's thread); ``wait()`` returns ``None``.
        Raises:
            ValueError / TypeError: on every rank, before any byte moves: a tensor outside the LB region, not
                contiguous or of the wrong row count, pairs of different bytes per expert, a malformed mapping
                (shape, dtype, an id out of range, a rank's own expert in its own slot), a bad ``num_sms`` or
                ``previous_event``; or ranks of a node disagreeing on the mapping, the LB offsets, the sizes or
                ``num_local_experts``, or ranks calling different operations (naming each rank's value; raised
                on the ranks of every node). The buffer stays usable.
            RuntimeError: the buffer was destroyed.
            transports.TransportTimeout: a rank did not take part within the deadline.
        """
        pairs, mapping = self._lb_call("lb_prefetch_weights", num_sms, previous_event, lambda: self._lb.check_prefetch(
            redundant_expert_weights, expert_weights, redundancy_mapping))
        self._lb.prefetch(pairs, mapping, "EPBuffer.lb_prefetch_weights")
        return EventOverlap(EventHandle())

    def lb_reduce_grads(self, redundant_expert_grads: torch.Tensor, expert_grads: torch.Tensor,
                        redundancy_mapping: torch.Tensor, num_sms: int = 0,
                        previous_event: EventHandle | None = None) -> EventOverlap:
        """Add the gradients of every replica of this rank's experts into ``expert_grads`` (in place, never
        overwritten); mirrors ``deep_ep.EPBuffer.lb_reduce_grads`` (docs/semantics/deepep-api.md §13.9).

        Collective, the mirror of :meth:`lb_prefetch_weights` with the same mapping. Each owner loads its
        replicas' rows from their LB regions and adds them in float32, one addition per replica, in ascending
        (node-local rank, slot) order onto what ``expert_grads`` held (seed it with the local gradient, or
        zeros). ``redundant_expert_grads`` is only read: zero or overwrite it before the next accumulation.

        Args:
            redundant_expert_grads: ``[num_redundant_experts, hidden]`` float32, contiguous, in this buffer's LB
                region at the same offset on every rank of the node.
            expert_grads: ``[num_local_experts, hidden]`` float32, contiguous (any CPU memory).
            redundancy_mapping: as in :meth:`lb_prefetch_weights`.
            num_sms, previous_event: as in :meth:`lb_prefetch_weights`.
        Returns:
            an :class:`EventOverlap` holding a completed event: ``expert_grads`` holds every contribution, and
            every peer has finished reading this rank's ``redundant_expert_grads``, when the call returns.
        Raises:
            ValueError / TypeError: on every rank, before any byte moves, as :meth:`lb_prefetch_weights`; also a
                dtype other than float32, a tensor that is not 2-D, or rows of different ``hidden``.
            RuntimeError: the buffer was destroyed.
            transports.TransportTimeout: a rank did not take part within the deadline.
        """
        off, mapping = self._lb_call("lb_reduce_grads", num_sms, previous_event, lambda: self._lb.check_reduce(
            redundant_expert_grads, expert_grads, redundancy_mapping))
        self._lb.reduce(off, expert_grads, mapping, "EPBuffer.lb_reduce_grads")
        return EventOverlap(EventHandle())

    def _compact(self, x: torch.Tensor, topk_weights, handle: EPHandle):
        """The compact rows combine sends: one per received token (expanded layout: its slots summed in
        slot order, float32, one rounding) and its weights per slot (0 where the slot is not local)."""
        rows = handle._recv_topk_idx.size(0)
        if not handle.do_expand:
            return x.contiguous(), self._compact_weights(topk_weights, handle)
        # the sums go where the peers read them (the landing segment when it has room): the staging copy
        # of the engines' combine is folded into this pass
        out = self._legacy._combine_input(rows, x.size(1))
        out[handle._num_valid:].zero_()  # rows past the real count (the kernel writes every real one)
        live = [(x, rows_j, slots_j) for rows_j, slots_j in _slots_by_lane(handle) if rows_j.numel()]
        if live:
            n_valid = handle._num_valid
            target = out[:n_valid]
            if not _native.sum_rows(target, live):  # the kernel reads the slots in place; torch gathers them
                acc, tmp = self._scratch.get(x.size(1))
                accumulate_rows(target, [(x.index_select(0, idx), tok) for _, tok, idx in live], acc, tmp,
                                native=False)
        return out, self._compact_weights(topk_weights, handle)

    @staticmethod
    def _compact_weights(topk_weights, handle: EPHandle):
        """Combine's weights per received row and slot: the caller's, 0 where the slot is not on this rank
        (expanded layout: gathered from the 1-D weights at each slot)."""
        if topk_weights is None:
            return None
        recv_topk = handle._recv_topk_idx
        if not handle.do_expand:
            if handle._masked_weights is not None and stamp_matches(handle._masked_weights, topk_weights, recv_topk):
                return topk_weights  # the dispatch's own weights, unchanged: 0 wherever the id is -1 already
            return topk_weights.masked_fill(recv_topk < 0, 0.0)
        src_rows, slots, lanes = handle._expand
        w = torch.zeros(recv_topk.shape, dtype=torch.float32)
        w[src_rows, lanes] = topk_weights[slots]
        return w


class ElasticBuffer(EPBuffer):
    """DeepEP 2.1's ``deep_ep.ElasticBuffer``: the same buffer with V2's signatures.

    Differences from :class:`EPBuffer`, as in DeepEP: the constructor takes ``num_cpu_bytes`` third
    (accepted; every byte is host memory here) and no load-balance region, ``sl_idx`` defaults to 3;
    ``dispatch`` defaults to ``do_handle_copy=True`` (the handle keeps a copy of ``topk_idx``, so that the
    caller may change it), and ``dispatch`` / ``combine`` take ``previous_event_before_epilogue`` (waited
    for before the call) instead of ``defer_epilogue``; a handle keeps a positive ``num_sms`` unrounded;
    ``barrier(use_comm_stream, with_cpu_sync)``. V2's other methods (``engram_*``, ``pp_*``, ``agrs_*``,
    ``all_gather``) are DeepEP V2.5's separate buffers here: ``EngramBuffer``, ``PPBuffer``, ``BucketBuffer``.
    """

    @outside_inference_mode  # its own tensors are kept across calls: normal tensors in either mode
    def __init__(self, group, num_bytes: int | None = None, num_cpu_bytes: int = 0, num_max_tokens_per_rank: int = 0,
                 hidden: int = 0, num_topk: int = 0, use_fp8_dispatch: bool = False, deterministic: bool = False,
                 allow_hybrid_mode: bool = True, allow_multiple_reduction: bool = True,
                 prefer_overlap_with_compute: bool = True, sl_idx: int = 3, num_allocated_qps: int = 0,
                 num_cpu_timeout_secs: int | None = None, num_gpu_timeout_secs: int = 100,
                 explicitly_destroy: bool = False, *, ranks_per_node: int | None = None):
        self.num_cpu_bytes = num_cpu_bytes  # checked with the other arguments, on every rank
        super().__init__(group, num_bytes, num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch, 0,
                         deterministic, allow_hybrid_mode, allow_multiple_reduction, prefer_overlap_with_compute,
                         sl_idx, num_allocated_qps, num_cpu_timeout_secs, num_gpu_timeout_secs, explicitly_destroy,
                         ranks_per_node=ranks_per_node)

    def barrier(self, use_comm_stream: bool = True, with_cpu_sync: bool = False) -> None:
        """``deep_ep.ElasticBuffer.barrier`` (V2's arguments, both accepted): :meth:`EPBuffer.barrier`."""
        super().barrier(use_comm_stream, with_cpu_sync)

    def _handle_num_sms(self, num_sms, num_experts: int, num_topk: int):
        """As :meth:`EPBuffer._handle_num_sms`, a positive count kept as passed (V2 does not round it)."""
        return self.get_theoretical_num_sms(num_experts, num_topk) if num_sms == 0 else num_sms

    def _constructor_problem(self) -> Exception | None:
        if not isinstance(self.num_cpu_bytes, int) or self.num_cpu_bytes < 0:
            return ValueError(f"ElasticBuffer: num_cpu_bytes must be a non-negative int, got {self.num_cpu_bytes!r}")
        return None

    def dispatch(self, x, topk_idx: torch.Tensor | None = None, topk_weights: torch.Tensor | None = None,
                 cumulative_local_expert_recv_stats: torch.Tensor | None = None, num_experts: int | None = None,
                 num_max_tokens_per_rank: int | None = None, expert_alignment: int | None = None,
                 num_sms: int = 0, num_qps: int = 0, previous_event: EventHandle | None = None,
                 previous_event_before_epilogue: EventHandle | None = None,
                 async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False,
                 handle: EPHandle | None = None, do_handle_copy: bool = True, do_cpu_sync: bool | None = None,
                 do_expand: bool = False, do_zero_padding: bool = False, use_tma_aligned_col_major_sf: bool = False):
        """``deep_ep.ElasticBuffer.dispatch``: :meth:`EPBuffer.dispatch` with V2's arguments (class doc)."""
        if previous_event_before_epilogue is not None:
            previous_event_before_epilogue.current_stream_wait()
        copy = do_handle_copy and handle is None and isinstance(topk_idx, torch.Tensor)
        return super().dispatch(
            x, topk_idx.clone() if copy else topk_idx, topk_weights, cumulative_local_expert_recv_stats, num_experts,
            num_max_tokens_per_rank, expert_alignment, num_sms, num_qps, previous_event, async_with_compute_stream,
            allocate_on_comm_stream, handle, False, do_cpu_sync, do_expand, do_zero_padding,
            use_tma_aligned_col_major_sf)

    def combine(self, x: torch.Tensor, handle: EPHandle, topk_weights: torch.Tensor | None = None, bias=None,
                num_sms: int = 0, num_qps: int = 0, previous_event: EventHandle | None = None,
                previous_event_before_epilogue: EventHandle | None = None, async_with_compute_stream: bool = False,
                allocate_on_comm_stream: bool = False):
        """``deep_ep.ElasticBuffer.combine``: :meth:`EPBuffer.combine` with V2's arguments (class doc)."""
        if previous_event_before_epilogue is not None:
            previous_event_before_epilogue.current_stream_wait()
        return super().combine(x, handle, topk_weights, bias, num_sms, num_qps, previous_event,
                               async_with_compute_stream, allocate_on_comm_stream)


def _defer_problem(defer_epilogue: bool, async_with_compute_stream: bool) -> AssertionError | None:
    """DeepEP's assertion on ``defer_epilogue`` (it needs ``async_with_compute_stream``), or None."""
    if defer_epilogue and not async_with_compute_stream:
        return AssertionError("`defer_epilogue` requires async_with_compute_stream")
    return None


def _stream_problem(previous_event, allocate_on_comm_stream: bool) -> Exception | None:
    """DeepEP's checks of a ``previous_event``: an event (``TypeError`` else), and with it
    ``allocate_on_comm_stream=True`` (its dispatch and combine then allocate on the communication stream;
    ``RuntimeError``; docs/semantics/deepep-api.md §13.2), or None."""
    if previous_event is None:
        return None
    if not isinstance(previous_event, (EventHandle, EventOverlap)):
        return TypeError(f"`previous_event` must be an EventHandle (capture()) or None, got "
                         f"{type(previous_event).__name__}")
    if not allocate_on_comm_stream:
        return RuntimeError("`previous_event` requires allocate_on_comm_stream=True")
    return None


def _previous(previous_event) -> EventOverlap | None:
    """The event a call waits for before its first round: ``previous_event`` when it is one (a bad one is refused
    in that round, on every rank, by :func:`_stream_problem`), else None."""
    return EventOverlap(previous_event) if isinstance(previous_event, (EventHandle, EventOverlap)) else None


def _slots_by_lane(handle: EPHandle) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per top-k slot ``j``, in slot order: the received rows with slot ``j`` on this rank (ascending) and
    their expanded rows, read from the handle's metadata once and kept on it (every combine of the handle
    sums the same slots)."""
    cached = getattr(handle, "_lane_slots", None)
    if cached is None:
        meta = handle._recv_src_metadata[:handle._num_valid]  # the expanded columns only
        cached = []
        for j in range(meta.size(1) - 2):
            rows_j = torch.nonzero(meta[:, 2 + j] >= 0).squeeze(1)
            cached.append((rows_j, meta[rows_j, 2 + j].to(torch.int64)))
        handle._lane_slots = cached
    return cached


def _expand_blocks(handle: EPHandle) -> list[tuple[int, int, int]]:
    """``(first, end, at)`` per expert with rows: its pairs ``[first, end)`` in ``handle._expand``'s order go to
    expanded rows from ``at``."""
    counts, starts = handle._expand_geometry
    ends = torch.cumsum(counts, 0)
    return [(hi - c, hi, at) for c, hi, at in zip(counts.tolist(), ends.tolist(), starts.tolist()) if c]


def _padding_rows(handle: EPHandle) -> torch.Tensor:
    """``[rows]`` int64: the expanded rows between each expert's last row and its aligned end (kept on the
    handle)."""
    if handle._padding is None:
        counts, starts = handle._expand_geometry
        gaps = align(counts, handle.expert_alignment) - counts
        total = int(gaps.sum())
        first_gap = torch.cumsum(gaps, 0) - gaps
        handle._padding = (torch.repeat_interleave(starts + counts - first_gap, gaps) + torch.arange(total) if total
                           else torch.zeros(0, dtype=torch.int64))
    return handle._padding


def _padded_bytes(t: torch.Tensor) -> torch.Tensor:
    """:func:`_bytes` of ``t``, rows padded with zeros to a multiple of 4 bytes: the engines' row fields
    are 4-byte aligned (scales of 2-byte packs or odd byte counts travel this way)."""
    rows = _bytes(t)
    width = rows.size(1)
    if width % 4 == 0:
        return rows
    out = torch.zeros(rows.size(0), align(width, 4), dtype=torch.uint8)
    out[:, :width] = rows
    return out


def _col_major(shape, dtype: torch.dtype) -> torch.Tensor:
    """An empty ``[rows, cols]`` tensor stored column by column (strides ``(1, rows)``)."""
    return torch.empty((shape[1], shape[0]), dtype=dtype).t()


def _flat(outputs):
    """The tensors of a dispatch's outputs (kept alive by the event until its wait)."""
    for o in outputs:
        if isinstance(o, torch.Tensor):
            yield o
        elif isinstance(o, tuple):
            yield from _flat(o)


def _split(num_bytes: int, num_ranks: int, num_nodes: int) -> tuple[int, int]:
    """``num_bytes`` as ``(UBMEM, URMA)`` windows: all UBMEM on one node; across nodes in the ratio of what
    a token costs each (the UBMEM staging holds rows from every rank, the URMA boxes one per node)."""
    if num_nodes == 1:
        return num_bytes, 0
    unit = get_num_allocation_alignment()
    nvl = num_bytes * num_ranks // (num_ranks + num_nodes) // unit * unit
    return nvl, num_bytes - nvl


def _covers(windows: tuple[int, int], needs: tuple[int, int]) -> bool:
    return windows[0] >= needs[0] and windows[1] >= needs[1]
