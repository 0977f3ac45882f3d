"""The handles ``Buffer.dispatch`` and ``Buffer.low_latency_dispatch`` return, as named tuples.

DeepEP V1 returns its handles as plain tuples and reads them back by position. Here each is a
:class:`typing.NamedTuple` with DeepEP's entries in DeepEP's order, so user code that indexes,
unpacks, compares or iterates a handle works as with DeepEP, and the library reads every entry by
name. A plain tuple (or list) of the right length is accepted wherever a handle is, and converted
after its checks (``IntranodeHandle._make(h)``; the tensors are the caller's, not copies).

Notation: ``R`` ranks, ``N`` tokens of this rank, ``C = config.num_sms // 2`` channels (token
``t`` of a rank with ``N`` tokens is in channel ``t // ceil(N / C)``), ``G`` nodes of ``P`` ranks,
``N_recv`` rows received, ``N_rows = max(N_recv, num_worst_tokens)`` rows of the outputs (rows past
``N_recv`` are padding, zero here).

The Buffer also records which of its dispatches made each handle (:func:`record_origin`), keyed by the
identity of one of the handle's tensors, so that a handle from another Buffer or a dispatch of another
``num_sms`` is refused by name.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch

__all__ = [
    "HandleOrigin",
    "InternodeHandle",
    "IntranodeHandle",
    "LowLatencyHandle",
    "NormalHandle",
    "origin_of",
    "record_origin",
]


class IntranodeHandle(NamedTuple):
    """Handle of a normal dispatch inside one node: the 6-tuple ``deep_ep.Buffer.dispatch`` returns there.

    Passed back to ``Buffer.combine`` and to a cached ``Buffer.dispatch`` (the same routing, no
    counting). Every tensor is on the CPU, contiguous.

    Attributes:
        rank_prefix_matrix: ``[R, R]`` int32; ``[s, j]`` = tokens ranks ``0..s`` send to rank ``j``
            (inclusive prefix over source ranks), the same on every rank. Column ``j`` is rank
            ``j``'s receive layout: source ``s``'s rows start at ``[s - 1, j]`` (0 for ``s = 0``) and
            ``[R - 1, j]`` is ``j``'s ``N_recv``.
        channel_prefix_matrix: ``[R, C]`` int32; ``[j, c]`` = this rank's tokens for rank ``j`` in
            channels ``0..c`` (inclusive prefix).
        recv_channel_prefix_matrix: ``[R, C]`` int32; ``[s, c]`` = first row of source ``s``'s
            channel ``c`` within source ``s``'s block of received rows (exclusive prefix, relative
            to the block's first row).
        recv_src_idx: ``[N_rows]`` int32; index of each received row's token on its source rank.
            Rows are grouped by source rank ascending, then source token order.
        is_token_in_rank: ``[N, R]`` bool; token ``t`` goes to rank ``j`` (it has an expert there).
        send_head: ``[N, R]`` int32; position of token ``t`` among its channel's tokens for rank
            ``j``, ``-1`` where not sent.
    """

    rank_prefix_matrix: torch.Tensor
    channel_prefix_matrix: torch.Tensor
    recv_channel_prefix_matrix: torch.Tensor
    recv_src_idx: torch.Tensor
    is_token_in_rank: torch.Tensor
    send_head: torch.Tensor


class InternodeHandle(NamedTuple):
    """Handle of a normal dispatch across ``G > 1`` nodes: the 10-tuple of ``deep_ep.Buffer.internode_dispatch``.

    Token ``t`` of rank ``(b, l)`` (node ``b``, local rank ``l``) travels once per node ``a`` that
    has one of its experts, to its rail peer ``(a, l)`` (the *forwarder*), which hands it on to
    its node's receivers. Every tensor is on the CPU, contiguous.

    Attributes:
        is_token_in_rank: ``[N, R]`` bool; token ``t`` goes to rank ``j``.
        rdma_channel_prefix_matrix: ``[G, C]`` int32; ``[a, c]`` = this rank's tokens bound for node
            ``a`` in channels ``0..c`` (inclusive prefix).
        gbl_channel_prefix_matrix: ``[R, C]`` int32; ``[j, c]`` = this rank's tokens for rank ``j`` in
            channels ``0..c`` (inclusive prefix).
        recv_rdma_channel_prefix_matrix: ``[G, C]`` int32; ``[a, c]`` = tokens this rank forwards for
            its rail peer on node ``a`` in that peer's channels ``0..c`` (inclusive prefix).
        recv_rdma_rank_prefix_sum: ``[G]`` int32; tokens this rank forwards for the rail peers of
            nodes ``0..a`` (inclusive prefix); the last entry is ``F``, all it forwards.
        recv_gbl_channel_prefix_matrix: ``[R, C]`` int32; ``[s, c]`` = first row of source ``s``'s
            channel ``c`` among the received rows (absolute).
        recv_gbl_rank_prefix_sum: ``[R]`` int32; rows received from ranks ``0..s`` (inclusive
            prefix); the last entry is ``N_recv``.
        recv_src_meta: ``[N_rows, 8]`` uint8; per received row two int32: the token's index on its
            source rank, then the source's node (DeepEP keeps its own 8-byte source record here).
        send_rdma_head: ``[N, G]`` int32; position of token ``t`` among this rank's tokens bound for
            node ``a``, ``-1`` where none of its experts is on ``a``.
        send_nvl_head: ``[F, P]`` int32; for each token this rank forwards (grouped by source node
            ascending, then source token order), its row in local rank ``p``'s block of that
            source, ``-1`` where not for ``p``.
    """

    is_token_in_rank: torch.Tensor
    rdma_channel_prefix_matrix: torch.Tensor
    gbl_channel_prefix_matrix: torch.Tensor
    recv_rdma_channel_prefix_matrix: torch.Tensor
    recv_rdma_rank_prefix_sum: torch.Tensor
    recv_gbl_channel_prefix_matrix: torch.Tensor
    recv_gbl_rank_prefix_sum: torch.Tensor
    recv_src_meta: torch.Tensor
    send_rdma_head: torch.Tensor
    send_nvl_head: torch.Tensor


class LowLatencyHandle(NamedTuple):
    """Handle of a low-latency dispatch: the 5-tuple ``deep_ep.Buffer.low_latency_dispatch`` returns.

    ``L = num_experts / R`` local experts, ``M = num_max_dispatch_tokens_per_rank``. The received
    rows of local expert ``e`` are packed from row 0 of ``recv_x[e]``: source ranks ascending, then
    (token, top-k slot) ascending.

    Attributes:
        src_info: ``[L, R·M]`` int32; index on its source rank of the token of each received row
            (rows past the expert's count: 0).
        layout_range: ``[L, R]`` int64; ``begin << 32 | count``: the rows of local expert ``e`` from
            source ``s`` are ``[begin, begin + count)`` of ``recv_x[e]``.
        num_max_dispatch_tokens_per_rank: ``M`` (int), as passed to the dispatch.
        hidden: ``H`` (int), the dispatch's hidden size.
        num_experts: ``E`` (int), the number of experts of all ranks.
    """

    src_info: torch.Tensor
    layout_range: torch.Tensor
    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int


#: The handle of a normal-mode dispatch: one node, or several.
NormalHandle = IntranodeHandle | InternodeHandle


class HandleOrigin(NamedTuple):
    """Which dispatch made a handle: the Buffer's serial number, the call number within it, its channels, and
    ``sealed``: a :func:`~deepep_ascend.ep.stamps.stamp` of the handle's entries taken once the dispatch completed
    (``()``: none), so that a later call handed those very tensors, none written since, may skip re-checking them."""

    buffer_id: int
    dispatch_id: int
    num_channels: int
    sealed: tuple = ()


_ORIGINS: dict[int, HandleOrigin] = {}  # id(identity tensor) -> origin; the entry dies with the tensor


def _identity(handle: NormalHandle) -> torch.Tensor:
    """The tensor whose identity stands for ``handle`` (made by the dispatch, never by the caller)."""
    if isinstance(handle, IntranodeHandle):
        return handle.rank_prefix_matrix
    return handle.recv_gbl_rank_prefix_sum


def record_origin(handle: NormalHandle, origin: HandleOrigin) -> None:
    """Remember that ``origin`` made ``handle`` for as long as the handle's tensors live."""
    key = id(_identity(handle))
    _ORIGINS[key] = origin
    weakref.finalize(_identity(handle), _ORIGINS.pop, key, None)


def origin_of(handle: NormalHandle) -> HandleOrigin | None:
    """The dispatch that made ``handle`` (``None``: a handle this process's Buffers did not make)."""
    return _ORIGINS.get(id(_identity(handle)))
