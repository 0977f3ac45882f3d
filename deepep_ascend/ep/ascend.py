"""DeepEP-Ascend 1.0's ``EPBuffer`` and ``EPHandle``: the same buffer and data plane as :mod:`.ep_buffer`, with the
handle's fields as DeepEP-Ascend lays them out (docs/semantics/deepep-api.md §13.10). Reached as
``deepep_ascend.ascend.EPBuffer`` (the face :mod:`deepep_ascend.ascend`).

DeepEP V2.5 and DeepEP-Ascend give ``recv_src_metadata`` the same name and shape but different column orders; code
written for either reads it unchanged by choosing the namespace it imports.
"""

from __future__ import annotations

import threading

import torch

from .ep_buffer import EPBuffer
from .ep_handle import EPHandle, ascend_column_order
from .layout import first_slots

__all__ = ["AscendEPBuffer", "AscendEPHandle"]


class _AscendField:
    """A field of :class:`AscendEPHandle` computed from the V2.5 handle on first read (``compute(handle)``, once,
    under a lock of its own) and assignable, as DeepEP-Ascend's plain attributes are."""

    def __init__(self, compute):
        self.compute = compute

    def __set_name__(self, owner, name: str) -> None:
        self.assigned, self.cached = f"_set_{name}", f"_ascend_{name}"

    def __get__(self, handle, owner=None):
        if handle is None:
            return self
        d = handle.__dict__
        if self.assigned in d:
            return d[self.assigned]
        if self.cached not in d:
            with handle._ascend_lock:  # not the fill lock: computing reads fields that take it
                if self.cached not in d:
                    d[self.cached] = self.compute(handle)
        return d[self.cached]

    def __set__(self, handle, value) -> None:
        handle.__dict__[self.assigned] = value


def _metadata(handle: AscendEPHandle) -> torch.Tensor:
    """``recv_src_metadata`` in DeepEP-Ascend's column order (class doc) from the dispatch's own."""
    return ascend_column_order(handle._own_metadata())


def _writes(handle: AscendEPHandle) -> torch.Tensor:
    """``dst_gsge_idx`` ``[N, K]`` (class doc)."""
    dest, first = first_slots(handle.topk_idx, handle.num_experts, handle._num_ranks)
    remote = first & (dest != handle._rank)
    index = remote.reshape(-1).cumsum(0, dtype=torch.int32).view_as(remote) - 1
    return torch.where(remote, index, -1).to(torch.int32)


class AscendEPHandle(EPHandle):
    """:class:`EPHandle` with DeepEP-Ascend's metadata column order and its ``dst_gsge_idx`` (every other field as
    there). ``N`` this rank's tokens, ``K`` top-k slots, ``n`` rows received; ``torch.int32``:

    Attributes:
        recv_src_metadata: ``[n, K + 2]``: columns ``j < K`` the expanded row of slot ``j`` (-1: not on this rank,
            or the compact layout), column ``K`` ``src_token_global_idx``, column ``K + 1`` the token's last slot
            ``j`` on this rank (-1 on rows past the real count).
        dst_gsge_idx: ``[N, K]``: at the token's first slot on each other rank, the index of that write among this
            rank's writes to other ranks, token by token and slot by slot (the CPU counterpart of DeepEP-Ascend's
            per-core scatter-gather entry); -1 on slots of this rank, later slots of a rank and slots without an
            expert.
    Both are computed from the dispatch on first read and assignable; :attr:`ascend_recv_src_metadata` equals
    :attr:`recv_src_metadata` here. The buffer's own calls read the V2.5 fields, whatever is assigned.
    """

    def __init__(self, *, rank: int, num_ranks: int, **fields):
        super().__init__(**fields)
        self._rank, self._num_ranks = rank, num_ranks
        self._ascend_lock = threading.Lock()

    recv_src_metadata = _AscendField(_metadata)
    dst_gsge_idx = _AscendField(_writes)

    @property
    def ascend_recv_src_metadata(self) -> torch.Tensor:
        """:attr:`recv_src_metadata` (already in DeepEP-Ascend's order)."""
        return self.recv_src_metadata


class AscendEPBuffer(EPBuffer):
    """DeepEP-Ascend 1.0's ``deep_ep.EPBuffer``: :class:`EPBuffer` (same arguments, calls and results) whose
    dispatches return :class:`AscendEPHandle`."""

    def _make_handle(self, **fields) -> AscendEPHandle:
        return AscendEPHandle(rank=self.rank_idx, num_ranks=self.num_ranks, **fields)
