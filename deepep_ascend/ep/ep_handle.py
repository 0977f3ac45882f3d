"""``EPHandle``: what an ``EPBuffer.dispatch`` learned about the routing, reused by a cached dispatch and
consumed by ``combine`` (DeepEP V2.5's ``deep_ep.EPHandle``; docs/semantics/deepep-api.md §13.3), and
``AscendEPHandle``, the same with DeepEP-Ascend's layout of two fields (docs/semantics/deepep-api.md §13.10).

Rows received by a rank are ordered by ``src_token_global_idx = src_rank * num_max_tokens_per_rank +
src_token_idx`` (DeepEP's deterministic order, on every call), so every field below is a pure function of
the routing, identical run after run.
"""

from __future__ import annotations

import threading

import torch

from .handles import InternodeHandle, IntranodeHandle
from .layout import first_slots

__all__ = ["AscendEPHandle", "EPHandle", "ascend_column_order"]


class _Assignable:
    """An ``EPHandle`` field as DeepEP has it, a plain attribute its tests reassign (``handle.recv_src_metadata =
    handle.recv_src_metadata[:n]``): it reads what was assigned, else the dispatch's own value, the private
    attribute ``field``, set by the pending function ``fill`` (``"_per_source"``, ``"_per_expert"``) when first
    read (:meth:`EPHandle._filled`). The buffer's calls read the private attributes, never the assigned ones."""

    def __init__(self, field: str, fill: str):
        self.field, self.fill = field, fill

    def __set_name__(self, owner, name: str) -> None:
        self.assigned = f"_set_{name}"
        self.__doc__ = f"``{name}``: see the class doc (assignable, as DeepEP's attribute)."

    def __get__(self, handle, owner=None):
        if handle is None:
            return self
        if self.assigned in handle.__dict__:
            return handle.__dict__[self.assigned]
        return self._value(handle)

    def __set__(self, handle, value) -> None:
        handle.__dict__[self.assigned] = value

    def _value(self, handle):
        """The field's value when nothing was assigned."""
        return getattr(handle._filled(self.fill), self.field)


class EPHandle:
    """The routing of one ``EPBuffer.dispatch``; mirrors ``deep_ep.EPHandle`` (DeepEP V2.5).

    ``R`` ranks, ``L = num_experts / R`` local experts, ``K`` top-k slots, ``n`` rows received (the
    real count with ``do_cpu_sync``, else the capacity ``R * num_max_tokens_per_rank``; rows past the
    real count hold -1 metadata). Tensors are CPU ``torch.int32`` unless said otherwise.

    Attributes:
        do_expand: whether the dispatch used the expanded layout (one row per (token, local expert)).
        num_experts, expert_alignment, num_max_tokens_per_rank: the dispatch's arguments.
        num_sms: the dispatch's ``num_sms`` as DeepEP resolves it: ``get_theoretical_num_sms()`` for 0, else
            rounded up to even (``ElasticBuffer``: as passed); a cached dispatch leaves it unchanged (no meaning
            on CPU ranks; kept for DeepEP's ``combine`` default and for code that reads it).
        topk_idx: the dispatch's ``[N, K]`` ``topk_idx`` (by reference; must not be modified while the
            handle is in use: reading it after an in-place change raises ``AssertionError``).
        num_recv_tokens: ``n`` (see above): ``recv_x``'s rows in the compact layout.
        num_expanded_tokens: rows of the expanded ``recv_x`` (``sum(align(count_e))`` with
            ``do_cpu_sync``, else the capacity), in the compact layout too (DeepEP fills it in both).
        num_recv_tokens_per_expert_list: per local expert, the received (token, expert) count aligned
            up to ``expert_alignment`` (a Python list; empty without ``do_cpu_sync``).
        psum_num_recv_tokens_per_scaleup_rank: ``[P]`` (``P`` ranks per node) inclusive prefix sum, over
            scale-up index ``i``, of the rows received from the ranks ``(node, i)`` of every node; ``[-1]``
            is the real count (on one node ``P = R``: per source rank).
        psum_num_recv_tokens_per_rank: ``[R]`` inclusive prefix sum of the rows received from each rank
            (DeepEP-Ascend's field; the same as the one above on one node).
        psum_num_recv_tokens_per_expert: ``[L]``: compact layout, the inclusive prefix sum of the aligned
            counts; expanded layout, ``align(psum[e-1]) + count_e`` (expert ``e``'s rows start at
            ``align(psum[e-1], expert_alignment)`` and end at ``psum[e]``).
        num_unaligned_recv_tokens_per_expert: ``[L]`` the (token, expert) counts received.
        recv_src_metadata: ``[n, 2 + K]``: column 0 ``src_token_global_idx``; column 1 ``src_rank * K +
            j`` with ``j`` the token's last top-k slot on this rank; columns ``2 + j`` the expanded row of
            slot ``j`` (-1: not on this rank, or the compact layout). DeepEP-Ascend orders the columns
            differently: see :attr:`ascend_recv_src_metadata`.
        dst_buffer_slot_idx: ``[N, K]``: at each token's first top-k slot on a rank, the token's place among this
            rank's tokens sent to that rank, in token order (its row in that rank's partition of rows from this
            rank); -1 at every other slot (a later slot of the same rank, no expert). On one node and across nodes.
        token_metadata_at_forward, channel_linked_list: ``None`` (DeepEP's hybrid-mode kernel state).
    """

    def __init__(self, *, buffer_uid: int, legacy: IntranodeHandle | InternodeHandle, do_expand: bool, num_experts: int,
                 expert_alignment: int, num_max_tokens_per_rank: int, num_sms: int, topk_idx: torch.Tensor,
                 num_recv_tokens: int, num_valid_tokens: int, num_expanded_tokens: int,
                 num_recv_tokens_per_expert_list: list | None,
                 psum_num_recv_tokens_per_scaleup_rank: torch.Tensor | None,
                 psum_num_recv_tokens_per_rank: torch.Tensor | None,
                 psum_num_recv_tokens_per_expert: torch.Tensor | None,
                 num_unaligned_recv_tokens_per_expert: torch.Tensor | None,
                 recv_src_metadata: torch.Tensor, dst_buffer_slot_idx: torch.Tensor, recv_topk_idx: torch.Tensor,
                 combine_order: torch.Tensor):
        self.do_expand = do_expand
        self.num_experts = num_experts
        self.expert_alignment = expert_alignment
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.num_sms = num_sms
        self.num_recv_tokens = num_recv_tokens
        self.num_expanded_tokens = num_expanded_tokens
        self._per_expert_list = num_recv_tokens_per_expert_list
        self._psum_per_scaleup_rank = psum_num_recv_tokens_per_scaleup_rank
        self._psum_per_rank = psum_num_recv_tokens_per_rank
        self._psum_per_expert = psum_num_recv_tokens_per_expert
        self._unaligned_per_expert = num_unaligned_recv_tokens_per_expert
        self._recv_src_metadata = recv_src_metadata
        # functions of the handle that set the per-source and the per-expert fields above when one of them is first
        # read (most steps read none), or None once they are set (_filled); taking the handle as an argument, they
        # hold no reference to it: no cycle, so a dropped handle frees its tensors at once, not at a garbage collection
        self._per_source = None
        self._per_expert = None
        self._fill_lock = threading.Lock()
        self._dst_buffer_slot_idx = dst_buffer_slot_idx  # or a function of the handle computing it on first read
        self.token_metadata_at_forward = None
        self.channel_linked_list = None
        self._topk_idx = topk_idx
        self._topk_idx_version = None if topk_idx.is_inference() else topk_idx._version
        # Not DeepEP's: what this library's cached dispatch and combine read.
        self._buffer_uid = buffer_uid
        self._legacy = legacy  # the engines' handle (docs/semantics/deepep-api.md §4.3)
        self._num_valid = num_valid_tokens
        self._recv_topk_idx = recv_topk_idx  # [n, K] int64 local expert ids, -1 elsewhere
        self._order = combine_order  # [N, R] int64 (the last top-k slot of each token on each rank), or a function of
        # the handle computing it
        # stamps.stamp of (recv_topk_weights, recv_topk_idx) as this dispatch returned them, weights 0 wherever the
        # id is -1 (compact layout), or None: a combine handed them unchanged skips masking them again
        self._masked_weights = None

    def _filled(self, which: str) -> EPHandle:
        """The handle with its fields of ``which`` (``"_per_source"``, ``"_per_expert"``) set: the pending function
        runs once, under a lock (a deferred epilogue's worker and the caller may read at once)."""
        if getattr(self, which) is not None:
            with self._fill_lock:
                fill = getattr(self, which)
                if fill is not None:
                    fill(self)
                    setattr(self, which, None)
        return self

    psum_num_recv_tokens_per_scaleup_rank = _Assignable("_psum_per_scaleup_rank", "_per_source")
    psum_num_recv_tokens_per_rank = _Assignable("_psum_per_rank", "_per_source")
    psum_num_recv_tokens_per_expert = _Assignable("_psum_per_expert", "_per_expert")
    num_unaligned_recv_tokens_per_expert = _Assignable("_unaligned_per_expert", "_per_expert")
    num_recv_tokens_per_expert_list = _Assignable("_per_expert_list", "_per_expert")
    recv_src_metadata = _Assignable("_recv_src_metadata", "_per_source")  # the buffer's calls: _own_metadata()

    def _own_metadata(self) -> torch.Tensor:
        """The dispatch's ``recv_src_metadata`` (what combine reads, whatever the caller assigned)."""
        return self._filled("_per_source")._recv_src_metadata

    @property
    def dst_buffer_slot_idx(self) -> torch.Tensor:
        """See the class doc (computed when first read: most callers never read it; assignable)."""
        if "_set_dst_buffer_slot_idx" in self.__dict__:
            return self._set_dst_buffer_slot_idx
        if callable(self._dst_buffer_slot_idx):  # a function of the handle (holding no reference to it)
            self._dst_buffer_slot_idx = self._dst_buffer_slot_idx(self)
        return self._dst_buffer_slot_idx

    @dst_buffer_slot_idx.setter
    def dst_buffer_slot_idx(self, value) -> None:
        self._set_dst_buffer_slot_idx = value

    @property
    def _combine_order(self) -> torch.Tensor:
        """``[N, R]`` int64: each token's last top-k slot on each rank (-1: none), combine's key (computed at the
        first combine)."""
        if callable(self._order):
            self._order = self._order(self)
        return self._order

    @property
    def topk_idx(self) -> torch.Tensor:
        """The dispatch's ``topk_idx``. Raises ``AssertionError`` if it was modified in place since."""
        assert self._topk_idx_version is None or self._topk_idx._version == self._topk_idx_version, \
            "`topk_idx` must not be modified while the EP handle is in use"
        return self._topk_idx

    @property
    def ascend_recv_src_metadata(self) -> torch.Tensor:
        """:attr:`recv_src_metadata` in DeepEP-Ascend's column order, ``[n, K + 2]``: columns ``j < K`` the
        expanded row of slot ``j`` (-1: none), column ``K`` ``src_token_global_idx``, column ``K + 1`` the
        token's last top-k slot ``j`` on this rank (DeepEP-Ascend stores ``j`` alone where DeepEP stores
        ``src_rank * K + j``; -1 on rows past the real count)."""
        return ascend_column_order(self.recv_src_metadata)


def ascend_column_order(meta: torch.Tensor) -> torch.Tensor:
    """``recv_src_metadata`` ``[n, 2 + K]`` in DeepEP V2.5's column order -> DeepEP-Ascend's ``[n, K + 2]`` (the
    expanded rows of the K slots, ``src_token_global_idx``, the last local slot ``j``; -1 stays -1)."""
    k = meta.size(1) - 2
    lane = torch.where(meta[:, 1] >= 0, meta[:, 1] % max(k, 1), meta[:, 1])
    return torch.cat([meta[:, 2:], meta[:, :1], lane[:, None]], dim=1)


class _AscendField(_Assignable):
    """A field of :class:`AscendEPHandle` computed from the V2.5 handle on first read (``compute(handle)``, once,
    under a lock of its own) and assignable, as DeepEP-Ascend's plain attributes are."""

    def __init__(self, compute):
        self.compute = compute

    def __set_name__(self, owner, name: str) -> None:
        super().__set_name__(owner, name)
        self.cached = f"_ascend_{name}"

    def _value(self, handle):
        d = handle.__dict__
        if self.cached not in d:
            with handle._ascend_lock:  # not the fill lock: computing reads fields that take it
                if self.cached not in d:
                    d[self.cached] = self.compute(handle)
        return d[self.cached]


def _metadata(handle: AscendEPHandle) -> torch.Tensor:
    """``recv_src_metadata`` in DeepEP-Ascend's column order (class doc) from the dispatch's own."""
    return ascend_column_order(handle._own_metadata())


def _writes(handle: AscendEPHandle) -> torch.Tensor:
    """``dst_gsge_idx`` ``[N, K]`` (class doc)."""
    dest, first, _ = first_slots(handle.topk_idx, handle.num_experts, handle._num_ranks)
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
