"""The baselines a user would pick instead of deepep_ascend, measured in the same run on the same data.

:class:`PeerPipeline` produces DeepEP-V1 results bit for bit with a generic all-to-all:

* :func:`mpi_alltoallv_roundtrip`: MPI ``Alltoall`` (counts) + ``Alltoallv`` (rows);
* :func:`gloo_all_to_all_roundtrip`: torch gloo ``all_to_all_single`` (after :func:`start_gloo`).

The single-copy memory roofline, the third baseline, is :func:`bench.roofline.memcpy_roofline`.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from bench.roundtrip import RoundTripResult, run_round_trip, split_x
from bench.workload import Workload, reference_layout


def start_gloo(comm, timeout_s: float = 600.0):
    """Initialise ``torch.distributed`` (gloo) from the mpiexec launch and return its world group
    (collective over ``comm``): :func:`deepep_ascend.nn.dist.init_distributed`, which agrees the
    rendezvous over MPI (loopback on one host) and keeps an existing default group of the same
    rank and size."""
    import torch.distributed as dist

    from deepep_ascend.nn.dist import init_distributed

    init_distributed("gloo", timeout_s=timeout_s, comm=comm)
    return dist.group.WORLD


def _as_byte_rows(t: torch.Tensor) -> torch.Tensor:
    """Contiguous ``[n, ...]`` → ``[n, row_bytes]`` uint8 view (also for ``n == 0``)."""
    row = int(np.prod(t.shape[1:], dtype=np.int64)) * t.element_size()
    return t.view(torch.uint8).view(t.size(0), row)


class _MpiExchange:
    """Row exchange over ``MPI_Alltoallv`` with one contiguous datatype per row size."""

    name = "mpi_alltoallv"

    def __init__(self, comm):
        self.comm = comm
        self._types: dict[int, Any] = {}

    def _rowtype(self, row_bytes: int):
        from mpi4py import MPI
        t = self._types.get(row_bytes)
        if t is None:
            t = self._types[row_bytes] = MPI.BYTE.Create_contiguous(row_bytes).Commit()
        return t

    def counts(self, send_counts: np.ndarray) -> np.ndarray:
        recv = np.empty_like(send_counts)
        self.comm.Alltoall(send_counts, recv)
        return recv

    def rows(self, send: torch.Tensor, out: torch.Tensor, send_counts, recv_counts) -> None:
        """``send [n_send, ...]`` (rows grouped by destination) → ``out [n_recv, ...]`` (by source)."""
        sb, rb = _as_byte_rows(send), _as_byte_rows(out)
        row = sb.size(1)
        if row == 0:
            return
        t = self._rowtype(row)
        sd = np.concatenate(([0], np.cumsum(send_counts)[:-1]))
        rd = np.concatenate(([0], np.cumsum(recv_counts)[:-1]))
        self.comm.Alltoallv([sb.numpy(), (send_counts, sd), t], [rb.numpy(), (recv_counts, rd), t])

    def close(self):
        for t in self._types.values():
            t.Free()
        self._types.clear()


class _GlooExchange:
    """Row exchange over ``torch.distributed.all_to_all_single`` (gloo), rows as raw bytes."""

    name = "gloo_all_to_all"

    def __init__(self, group=None):
        import torch.distributed as dist
        self.dist, self.group = dist, group

    def counts(self, send_counts: np.ndarray) -> np.ndarray:
        s = torch.from_numpy(np.ascontiguousarray(send_counts, dtype=np.int64))
        r = torch.empty_like(s)
        self.dist.all_to_all_single(r, s, group=self.group)
        return r.numpy()

    def rows(self, send: torch.Tensor, out: torch.Tensor, send_counts, recv_counts) -> None:
        sb, rb = _as_byte_rows(send), _as_byte_rows(out)
        if sb.size(1) == 0:
            return
        self.dist.all_to_all_single(rb, sb, output_split_sizes=[int(c) for c in recv_counts],
                                    input_split_sizes=[int(c) for c in send_counts], group=self.group)

    def close(self):
        pass


class Workspace:
    """Named scratch buffers reused across calls (grown when too small), the CPU stand-in for a
    GPU caching allocator: on this VM first-touch page faults cost ~5x a copy of the same bytes
    (211 MB: ~160 ms to fault in, ~27 ms to copy), so a pipeline that allocates its
    intermediates afresh every call would measure the kernel's page-fault path, not its design."""

    def __init__(self):
        self._bufs: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous ``[*shape]`` tensor of ``dtype`` backed by buffer ``name`` (contents stale)."""
        n = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        b = self._bufs.get(name)
        if b is None or b.numel() < n:
            b = self._bufs[name] = torch.empty(max(n, 1), dtype=torch.uint8)
        return b[:n].view(dtype).view(tuple(shape))

    def clear(self):
        self._bufs.clear()


class PeerPipeline:
    """The pipeline a user would write with a generic all-to-all (MPI ``Alltoallv`` or gloo
    ``all_to_all_single``), producing DeepEP-V1 results bit for bit.

    * layout: :func:`reference_layout` (pure torch);
    * dispatch: order tokens by destination rank (``is_token_in_rank.T.nonzero()`` → sorted by
      destination, then token), ``index_select`` the payload and a packed metadata row (``int64``
      top-k ids, ``float32`` weights, FP8 scales), all-to-all the counts, then the payload and the
      metadata; the receiver turns global expert ids into local ones (``-1`` elsewhere, weight
      ``0.0``) — the rows arrive grouped by source rank ascending, then source token ascending,
      which is DeepEP's order;
    * combine: all-to-all the (identity-expert) rows and weights back, then, per destination rank
      **ascending**, widen to float32 and ``index_add_`` into a float32 accumulator that starts at
      ``0.0``, and one cast to BF16 — the same float32 additions in the same order as DeepEP's.

    Returned tensors are fresh (as DeepEP's); intermediates (send rows, rows coming back, the
    float32 accumulator and widening scratch) live in a :class:`Workspace` reused across calls.
    """

    def __init__(self, exchange, rank: int, num_ranks: int, num_experts: int):
        self.ex, self.rank, self.num_ranks, self.num_experts = exchange, rank, num_ranks, num_experts
        self.name = exchange.name
        self.local_experts = num_experts // num_ranks
        self.ws = Workspace()
        self._traffic: dict | None = None

    def layout(self, topk_idx, num_experts):
        return reference_layout(topk_idx, num_experts, self.num_ranks)

    def _count_traffic(self, send_counts, row_bytes):
        """Bytes this rank sent, SELF vs peers (one shared-memory node: peers are UBMEM)."""
        own = int(send_counts[self.rank]) * row_bytes
        self._traffic = {"SELF": own, "UBMEM": int(send_counts.sum()) * row_bytes - own, "URMA": 0}

    def dispatch(self, x, layout, topk_idx, topk_weights):
        payload, scales = split_x(x)
        is_token_in_rank = layout[3]
        dst, tok = is_token_in_rank.t().nonzero(as_tuple=True)
        send_counts = is_token_in_rank.sum(0).numpy().astype(np.int64)
        recv_counts = self.ex.counts(send_counts)
        n_send, n_recv = int(send_counts.sum()), int(recv_counts.sum())
        # payload
        send_x = self.ws.get("send_x", (n_send,) + tuple(payload.shape[1:]), payload.dtype)
        torch.index_select(payload, 0, tok, out=send_x)
        recv_x = torch.empty((n_recv,) + tuple(payload.shape[1:]), dtype=payload.dtype)
        self.ex.rows(send_x, recv_x, send_counts, recv_counts)
        # metadata: [topk_idx int64 | topk_weights f32 | scales f32]
        parts = [topk_idx.view(torch.uint8), topk_weights.view(torch.uint8)]
        if scales is not None:
            parts.append(scales.contiguous().view(torch.uint8))
        meta_all = torch.cat(parts, dim=1)
        meta = self.ws.get("send_meta", (n_send, meta_all.size(1)), torch.uint8)
        torch.index_select(meta_all, 0, tok, out=meta)
        recv_meta = self.ws.get("recv_meta", (n_recv, meta.size(1)), torch.uint8)
        self.ex.rows(meta, recv_meta, send_counts, recv_counts)
        k = topk_idx.size(1)
        ridx = recv_meta[:, :8 * k].contiguous().view(torch.int64)
        rw = recv_meta[:, 8 * k:12 * k].contiguous().view(torch.float32)
        lo = self.rank * self.local_experts
        mine = (ridx >= lo) & (ridx < lo + self.local_experts)
        recv_topk_idx = torch.where(mine, ridx - lo, -1)
        recv_topk_weights = torch.where(mine, rw, 0.0)
        counts = torch.bincount(recv_topk_idx[mine], minlength=self.local_experts).tolist()
        if scales is not None:
            recv_x = (recv_x, recv_meta[:, 12 * k:].contiguous().view(torch.float32))
        self._count_traffic(send_counts, _as_byte_rows(payload).size(1) + meta.size(1))
        handle = (tok, send_counts, recv_counts, topk_idx.size(0))
        return recv_x, recv_topk_idx, recv_topk_weights, counts, handle

    def combine(self, y, handle, topk_weights):
        tok, send_counts, recv_counts, n = handle
        n_send, h = int(send_counts.sum()), y.size(1)
        back = self.ws.get("back", (n_send, h), y.dtype)
        self.ex.rows(y.contiguous(), back, recv_counts, send_counts)
        back_w = acc_w = None
        if topk_weights is not None:
            back_w = self.ws.get("back_w", (n_send, topk_weights.size(1)), torch.float32)
            self.ex.rows(topk_weights.contiguous(), back_w, recv_counts, send_counts)
            acc_w = torch.zeros((n, topk_weights.size(1)), dtype=torch.float32)
        acc = self.ws.get("acc", (n, h), torch.float32).zero_()
        widened = self.ws.get("widen", (int(send_counts.max(initial=0)), h), torch.float32)
        start = 0
        for c in send_counts.tolist():  # ascending destination rank = ascending contributor
            if c:
                idx = tok[start:start + c]
                w = widened[:c]
                w.copy_(back[start:start + c])
                acc.index_add_(0, idx, w)
                if acc_w is not None:
                    acc_w.index_add_(0, idx, back_w[start:start + c])
            start += c
        row_bytes = h * y.element_size() + (4 * topk_weights.size(1) if topk_weights is not None else 0)
        self._count_traffic(recv_counts, row_bytes)
        return acc.to(torch.bfloat16), acc_w

    def traffic(self) -> dict | None:
        return self._traffic

    def close(self):
        self.ex.close()
        self.ws.clear()


def _peer_roundtrip(exchange, wl: Workload, comm, iters: int, warmup: int, **kw):
    system = PeerPipeline(exchange, comm.Get_rank(), comm.Get_size(), wl.params["num_experts"])
    try:
        return run_round_trip(system, wl, comm, iters, warmup, **kw)
    finally:
        system.close()


def mpi_alltoallv_roundtrip(wl: Workload, comm, iters: int, warmup: int, **kw) -> RoundTripResult:
    """Baseline (a): :class:`PeerPipeline` over MPI ``Alltoall`` (counts) + ``Alltoallv`` (rows)."""
    return _peer_roundtrip(_MpiExchange(comm), wl, comm, iters, warmup, **kw)


def gloo_all_to_all_roundtrip(wl: Workload, comm, iters: int, warmup: int, group=None,
                              **kw) -> RoundTripResult:
    """Baseline (b): :class:`PeerPipeline` over torch gloo ``all_to_all_single`` (needs
    :func:`start_gloo` first; ``group`` defaults to the world group)."""
    return _peer_roundtrip(_GlooExchange(group), wl, comm, iters, warmup, **kw)

