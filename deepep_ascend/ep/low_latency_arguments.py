"""Argument checks of ``Buffer``'s low-latency calls (docs/semantics/deepep-api.md §6), before anything is sent.

As in :mod:`.checks`, a failed check raises :class:`~deepep_ascend.ep.arguments.Rejected`; the Buffer
then refuses the call on every rank (:meth:`LowLatencyEngine.reject`): this rank raises the carried
exception, every other rank a ``LowLatencyRefused`` naming it.
"""

from __future__ import annotations

import functools

import torch

from .. import native
from . import low_latency as ll
from .arguments import check, check_tensor, check_topk_idx, check_writable
from .handles import LowLatencyHandle
from .phases import RECORDER as _PH

__all__ = ["check_low_latency_combine_args", "check_low_latency_dispatch_args", "check_low_latency_handle",
           "check_low_latency_routing", "low_latency_layout"]


@functools.lru_cache(maxsize=64)
def _layout(m: int, hidden: int, num_experts: int, num_ranks: int) -> tuple[ll.Layout, int]:
    """``(Layout, size_hint)`` of ``(M, H, E, R)``: made once per shape (a call's shapes repeat every step)."""
    return ll.Layout(m, hidden, num_experts, num_ranks), ll.size_hint(m, hidden, num_ranks, num_experts)


def low_latency_layout(m: int, hidden: int, num_experts: int, *, num_ranks: int, num_rdma_bytes: int,
                       op: str) -> ll.Layout:
    """The window layout of a call with ``(M, H, E)``, which must fit ``num_rdma_bytes`` (the same object for the
    same shape: read it, never change it).

    Raises:
        Rejected: ``ValueError`` when ``num_rdma_bytes`` is below :func:`low_latency.size_hint`, or when DeepEP's
            layout puts the receive region at an odd byte (hidden 1 or 3 with an odd ``M`` and at most 3 experts:
            ``M·d`` odd and above ``E·M·c``), where no BF16 row can be addressed.
    """
    lay, need = _layout(m, hidden, num_experts, num_ranks)
    if num_rdma_bytes < need:
        check(False, ValueError,
              f"{op}: num_rdma_bytes={num_rdma_bytes} is below get_low_latency_rdma_size_hint(M={m}, "
              f"H={hidden}, R={num_ranks}, E={num_experts}) = {need} B that this call needs")
    if lay.recv_off % 2:
        check(False, ValueError,
              f"{op}: (M={m}, H={hidden}, E={num_experts}) puts the receive region at the odd byte {lay.recv_off} "
              f"of DeepEP's low-latency layout, where BF16 rows cannot lie; use an even hidden (or M) for this size")
    return lay


def check_low_latency_routing(topk_idx, num_experts, m, rows_name: str, rows: int, *, num_ranks: int,
                              qp_depth: int, trusted: bool = False) -> ll.NativeRoute | None:
    """``topk_idx`` ``[rows, K]`` int64, ``E < 65536``, ``rows <= M < 65536``, no expert selected more than
    ``M`` times.

    DeepEP caps ``M`` at its NVSHMEM queue-pair depth (``qp_depth / 2 - 1 = 511``); MPI windows have no
    queue pairs, so here ``M`` is bounded by the window (the size hint) and by the 16 bits the call's
    header gives it (docs/semantics/deepep-api.md §6.7). ``qp_depth`` is kept for the message only.
    An expert listed twice in one row is two (token, slot) rows (docs/semantics/deepep-api.md §0); a source has
    ``M`` rows per expert, so an expert selected more than ``M`` times in all is refused.
    ``trusted``: ``topk_idx`` is the very tensor a dispatch of the same ``E`` and ``M`` checked, unchanged
    since (``LowLatencyEngine.dispatched_route``): its values are not checked again.

    Where the native kernels are loaded, one pass of :func:`deepep_ascend.native.ll_route` gives what the checks
    read (value range, the most selections of one expert) and the call's route, returned; else the checks run
    in torch and the result is None.

    Raises:
        Rejected: ``ValueError`` / ``TypeError`` (as :func:`~.checks.check_topk_idx`, rows, ``M``,
            more than ``M`` selections of one expert).
    """
    routed = None
    if not trusted and native.ll_available():
        check_topk_idx(topk_idx, num_experts, num_ranks, values=False)
        m_ok = isinstance(m, int) and not isinstance(m, bool) and 1 <= m < 65536
        # (an invalid M is refused below, before status 2 is read: 1 only keeps the kernel's arithmetic sane)
        if _PH.on:
            _PH.switch("route")
        routed = native.ll_route(topk_idx.contiguous(), num_experts, m if m_ok else 1)
        if _PH.on:
            _PH.switch("checks")
        status, (lo, hi, most, arg), counts, slots = routed
        if status == 1:
            check(False, ValueError, f"`topk_idx` values must lie in [-1, {num_experts}), got min {lo}, max {hi}")
    else:
        check_topk_idx(topk_idx, num_experts, num_ranks, values=not trusted)
    if num_experts >= 65536:
        check(False, ValueError, f"num_experts must be below 65536 in low-latency mode, got {num_experts}")
    if topk_idx.size(0) != rows:
        check(False, ValueError, f"`topk_idx` has {topk_idx.size(0)} rows, {rows_name} has {rows}")
    if not (isinstance(m, int) and not isinstance(m, bool) and m >= 1):
        check(False, ValueError, f"num_max_dispatch_tokens_per_rank must be an int >= 1, got {m!r}")
    if m >= 65536:
        check(False, ValueError,
              f"num_max_dispatch_tokens_per_rank={m} must be below 65536 (the low-latency header's 16 bits; "
              f"DeepEP's own cap is nvshmem_qp_depth / 2 - 1 = {qp_depth // 2 - 1}, docs/semantics/deepep-api.md §6.7)")
    if rows > m:
        check(False, ValueError, f"{rows_name} has {rows} tokens, more than num_max_dispatch_tokens_per_rank={m}")
    if routed is not None:
        if status == 2:
            check(False, ValueError,
                  f"`topk_idx` selects expert {arg} {most} times (each slot of a row counts, "
                  f"docs/semantics/deepep-api.md §0), more than the num_max_dispatch_tokens_per_rank={m} rows a "
                  f"source has per expert")
        return ll.NativeRoute(counts, slots, m)
    if topk_idx.size(1) > 1 and rows and not trusted:  # only a repeated expert in a row can exceed rows <= M
        per_expert = torch.bincount(topk_idx.reshape(-1) + 1, minlength=num_experts + 1)[1:]
        most = int(per_expert.max())
        if most > m:  # (the message's argmax only then)
            check(False, ValueError,
                  f"`topk_idx` selects expert {int(per_expert.argmax())} {most} times (each slot of a row counts, "
                  f"docs/semantics/deepep-api.md §0), more than the num_max_dispatch_tokens_per_rank={m} rows a "
                  f"source has per expert")
    return None


def check_low_latency_handle(handle, *, num_ranks: int, trusted: bool = False) -> LowLatencyHandle:
    """A 5-entry low-latency handle (:class:`LowLatencyHandle`), converted. ``trusted``: its tensors are the
    very ones a dispatch returned, unwritten since (``LowLatencyEngine.dispatched_route``): ``layout_range``'s
    values are not checked again (its type and shape are).

    Raises:
        Rejected: ``ValueError`` (length, ``M``/``H``/``E`` not positive ints or ``E`` not a multiple
            of ``R``, ``layout_range`` out of bounds), ``TypeError`` / ``ValueError`` naming the entry.
    """
    check(isinstance(handle, (tuple, list)) and len(handle) == 5, ValueError,
          "`handle` must be the 5-tuple (src_info, layout_range, M, H, E) of low_latency_dispatch")
    if type(handle) is not LowLatencyHandle:  # (a dispatch's own handle is one already)
        handle = LowLatencyHandle._make(handle)
    m, hidden, num_experts = handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts
    if not all(isinstance(v, int) and v > 0 for v in (m, hidden, num_experts)):
        check(False, ValueError,
              f"`handle` entries 2-4 (M, H, E) must be positive ints, got {(m, hidden, num_experts)!r}")
    r = num_ranks
    if num_experts % r:
        check(False, ValueError, f"`handle` has E={num_experts}, not a multiple of {r} ranks")
    num_local = num_experts // r
    check_tensor(handle.src_info, "handle.src_info", torch.int32, shape=(num_local, r * m))
    check_tensor(handle.layout_range, "handle.layout_range", torch.int64, shape=(num_local, r))
    if trusted:
        return handle
    count, begin = handle.layout_range & 0xFFFFFFFF, handle.layout_range >> 32
    check(bool((count <= m).all()) and bool((begin + count <= r * m).all()) and bool((begin >= 0).all()), ValueError,
          "`handle.layout_range` is not (begin << 32 | count) with count <= M and begin + count <= R*M")
    return handle


def check_low_latency_dispatch_args(x, topk_idx, m, num_experts, cumulative_local_expert_recv_stats,
                                    dispatch_wait_recv_cost_stats, use_fp8: bool, round_scale: bool, use_ue8m0: bool,
                                    *, num_ranks: int, num_rdma_bytes: int,
                                    qp_depth: int) -> tuple[ll.Layout, ll.NativeRoute | None]:
    """Arguments of ``Buffer.low_latency_dispatch`` (see there); returns the call's window layout and its native
    route (None where the native kernels are not loaded; see :func:`check_low_latency_routing`).

    Raises:
        Rejected: DeepEP's classes (``TypeError`` / ``ValueError`` / ``AssertionError`` /
            ``RuntimeError``) naming the argument.
    """
    r = num_ranks
    check_tensor(x, "x", torch.bfloat16, ndim=2)
    n, hidden = x.shape
    route = check_low_latency_routing(topk_idx, num_experts, m, "x", n, num_ranks=r, qp_depth=qp_depth)
    check(hidden >= 1, ValueError, "`x` must have hidden >= 1")
    check(not use_ue8m0 or round_scale, RuntimeError,
          "use_ue8m0=True requires round_scale=True (docs/semantics/deepep-api.md §6.4)")
    check(not use_ue8m0 or use_fp8, ValueError, "use_ue8m0=True requires use_fp8=True")
    if use_fp8 and hidden % 128:
        check(False, ValueError,
              f"FP8 low-latency dispatch needs hidden % 128 == 0 (per-128-channel scales), got {hidden}")
    if use_ue8m0 and hidden % 512:
        check(False, ValueError, f"UE8M0 scales pack 4 groups per int32: hidden % 512 == 0 needed, got {hidden}")
    num_local = num_experts // r
    if cumulative_local_expert_recv_stats is not None:
        check_tensor(cumulative_local_expert_recv_stats, "cumulative_local_expert_recv_stats", torch.int32,
                     shape=(num_local,))
        check_writable(cumulative_local_expert_recv_stats, "cumulative_local_expert_recv_stats")
    if dispatch_wait_recv_cost_stats is not None:
        check_tensor(dispatch_wait_recv_cost_stats, "dispatch_wait_recv_cost_stats", torch.int64, shape=(r,))
        check_writable(dispatch_wait_recv_cost_stats, "dispatch_wait_recv_cost_stats")
    return low_latency_layout(m, hidden, num_experts, num_ranks=r, num_rdma_bytes=num_rdma_bytes,
                              op="low_latency_dispatch"), route


def check_low_latency_combine_args(x, topk_idx, topk_weights, handle, use_logfmt: bool, zero_copy: bool, out,
                                   combine_wait_recv_cost_stats, stale_zero_copy: str | None, *, num_ranks: int,
                                   num_rdma_bytes: int, qp_depth: int, trusted: bool = False,
                                   dispatched_topk_idx: torch.Tensor | None = None
                                   ) -> tuple[LowLatencyHandle, ll.Layout, ll.NativeRoute | None]:
    """Arguments of ``Buffer.low_latency_combine`` (see there).

    Args:
        stale_zero_copy: with ``zero_copy``, why the zero-copy buffer holds no data for this call
            (:meth:`LowLatencyEngine.stale_zero_copy`), else None.
        trusted: ``topk_idx`` and ``handle`` are the last dispatch's own, unchanged since
            (:meth:`LowLatencyEngine.dispatched_route`): only their types and shapes are checked.
        dispatched_topk_idx: the ``topk_idx`` of the dispatch that made ``handle``
            (:meth:`LowLatencyEngine.dispatched_topk_idx`), or None (not known): ``topk_idx`` must hold the same
            values (DeepEP), or the rows the peers return do not belong to its tokens.
    Returns:
        ``(handle as a LowLatencyHandle, the call's window layout, its native route or None)`` (the route as
        :func:`check_low_latency_routing` returns it; None when ``trusted``).
    Raises:
        Rejected: as :func:`check_low_latency_dispatch_args`.
    """
    r = num_ranks
    handle = check_low_latency_handle(handle, num_ranks=r, trusted=trusted)
    m, hidden, num_experts = handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts
    check_tensor(x, "x", torch.bfloat16, shape=(num_experts // r, r * m, hidden))
    check_tensor(topk_idx, "topk_idx", ndim=2)
    route = check_low_latency_routing(topk_idx, num_experts, m, "topk_idx", topk_idx.size(0), num_ranks=r,
                                      qp_depth=qp_depth, trusted=trusted)
    check_tensor(topk_weights, "topk_weights", torch.float32, shape=tuple(topk_idx.shape))
    if dispatched_topk_idx is not None and not trusted and not torch.equal(topk_idx, dispatched_topk_idx):
        if topk_idx.shape != dispatched_topk_idx.shape:
            why = f"has shape {tuple(topk_idx.shape)}, the dispatch's {tuple(dispatched_topk_idx.shape)}"
        else:
            t, j = (int(v) for v in torch.nonzero(topk_idx != dispatched_topk_idx)[0])
            why = f"holds {int(topk_idx[t, j])} at [{t}, {j}], the dispatch's {int(dispatched_topk_idx[t, j])}"
        check(False, ValueError,
              f"`topk_idx` is not the topk_idx of the dispatch that made `handle`: it {why}; combine needs that "
              f"dispatch's topk_idx (DeepEP: num_combined_tokens equals the number of dispatched tokens)")
    check(not (zero_copy and use_logfmt), RuntimeError,
          "zero_copy and use_logfmt are incompatible (docs/semantics/deepep-api.md §6.3)")
    if use_logfmt and hidden % 128:
        check(False, ValueError,
              f"use_logfmt needs hidden % 128 == 0 (LogFMT-10 works on 128-channel groups), got {hidden}")
    check(stale_zero_copy is None, RuntimeError, stale_zero_copy or "")
    if out is not None:
        check_tensor(out, "out", torch.bfloat16, shape=(topk_idx.size(0), hidden))
        check(out.is_contiguous(), ValueError, "`out` must be contiguous")
        check_writable(out, "out")
    if combine_wait_recv_cost_stats is not None:
        check_tensor(combine_wait_recv_cost_stats, "combine_wait_recv_cost_stats", torch.int64, shape=(r,))
        check_writable(combine_wait_recv_cost_stats, "combine_wait_recv_cost_stats")
    layout = low_latency_layout(m, hidden, num_experts, num_ranks=r, num_rdma_bytes=num_rdma_bytes,
                                op="low_latency_combine")
    return handle, layout, route
