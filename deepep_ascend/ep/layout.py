"""Routing → counts, masks and prefix matrices (docs/semantics/deepep-api.md §4.1, §4.3).
Pure torch, never communicates.

Duplicate experts in one ``topk_idx`` row (the same expert listed twice) follow DeepEP's
counting (docs/semantics/deepep-api.md §0): each (token, slot) pair counts once for its expert in
``num_tokens_per_expert``, a token counts once per rank in ``num_tokens_per_rank``, and each
slot is delivered as its own ``recv_topk_idx`` entry (so a combine of ``recv_topk_weights``
returns both weights). Nothing is merged or rejected.
"""

from __future__ import annotations

import numpy as np
import torch

from .. import native as _native
from ..rounding import ceil_div

topk_idx_t = torch.int64


def dispatch_layout(topk_idx: torch.Tensor, num_experts: int,
                    num_ranks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Counts of a routing; mirrors the computation of ``deep_ep.Buffer.get_dispatch_layout``.

    Args:
        topk_idx: ``[N, K]`` integer tensor, values in ``[-1, num_experts)`` (-1 = no expert).
        num_experts: ``E``, divisible by ``num_ranks``.
        num_ranks: ``R``.
    Returns:
        ``num_tokens_per_rank [R]`` int32 (tokens with at least one expert on rank j, once each),
        ``num_tokens_per_expert [E]`` int32 ((token, slot) pairs per expert),
        ``is_token_in_rank [N, R]`` bool.
    """
    done = _native.dispatch_layout(topk_idx, num_experts, num_ranks)  # one C pass where built
    if done is not None:
        return done
    n = topk_idx.size(0)
    num_local = num_experts // num_ranks
    # numpy on the small routing arrays (a few cheap calls instead of a dozen torch ops). -1 becomes expert
    # E, i.e. rank R: one extra bin and one extra column, dropped at the end (no boolean indexing).
    idx = topk_idx.numpy()
    experts = np.where(idx >= 0, idx, num_experts).astype(np.int64, copy=False)
    num_tokens_per_expert = np.bincount(experts.reshape(-1), minlength=num_experts + 1)[:num_experts].astype(np.int32)
    in_rank = np.zeros((n, num_ranks + 1), dtype=np.bool_)
    in_rank[np.arange(n)[:, None], np.minimum(experts // num_local, num_ranks)] = True
    is_token_in_rank = np.ascontiguousarray(in_rank[:, :num_ranks])
    num_tokens_per_rank = is_token_in_rank.sum(0, dtype=np.int32)
    return (torch.from_numpy(num_tokens_per_rank), torch.from_numpy(num_tokens_per_expert),
            torch.from_numpy(is_token_in_rank))


def last_slot_per_rank(topk_idx: torch.Tensor, num_experts: int, num_ranks: int) -> torch.Tensor:
    """``[N, R]`` int64: each token's last top-k slot ``j`` with an expert on each rank, -1 where it has none
    (``EPBuffer``'s combine key, docs/semantics/deepep-api.md §13.5); the torch path of
    :func:`deepep_ascend.native.dispatch_layout`'s ``last_slot``.

    Args:
        topk_idx: ``[N, K]`` int64, values in ``[-1, num_experts)`` (-1 = no expert).
    """
    return _slot_per_rank(topk_idx, num_experts, num_ranks, "amax", -1)[1]


def _slot_per_rank(topk_idx: torch.Tensor, num_experts: int, num_ranks: int, reduce: str,
                   none: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dest [N, K], slot [N, R])`` int64: each top-k slot's rank (0 for a slot without an expert), and per rank
    the ``reduce`` (``"amax"``, ``"amin"``) of the token's slots with an expert there, ``none`` where it has none."""
    n, k = topk_idx.shape
    dest = torch.div(topk_idx, num_experts // num_ranks, rounding_mode="floor").clamp(min=0)
    lanes = torch.where(topk_idx >= 0, torch.arange(k), none)
    return dest, torch.full((n, num_ranks), none, dtype=torch.int64).scatter_reduce_(1, dest, lanes, reduce=reduce)


def first_slots(topk_idx: torch.Tensor, num_experts: int,
                num_ranks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dest [N, K] int64, first [N, K] bool, sent [N, R] bool)``: each top-k slot's rank (0 for a slot without an
    expert), whether it is the token's first slot with an expert on that rank (the one that carries the token
    there), and whether the token goes to each rank.

    Args:
        topk_idx: ``[N, K]`` int64, values in ``[-1, num_experts)`` (-1 = no expert).
    """
    k = topk_idx.size(1)
    dest, first_slot = _slot_per_rank(topk_idx, num_experts, num_ranks, "amin", k)  # k: no slot there
    return dest, (topk_idx >= 0) & (first_slot.gather(1, dest) == torch.arange(k)), first_slot < k


def dst_buffer_slots(topk_idx: torch.Tensor, num_experts: int, num_ranks: int) -> torch.Tensor:
    """``[N, K]`` int32, ``EPHandle.dst_buffer_slot_idx`` (docs/semantics/deepep-api.md §13.3): at each token's first
    slot on a rank (:func:`first_slots`) its place among the tokens sent to that rank, in token order (its row in
    that rank's partition of rows from this rank); -1 at every other slot.

    Args:
        topk_idx: ``[N, K]`` int64, values in ``[-1, num_experts)`` (-1 = no expert).
    """
    dest, first, sent = first_slots(topk_idx, num_experts, num_ranks)
    place = sent.cumsum(0, dtype=torch.int32) - 1
    return torch.where(first, place.gather(1, dest), -1).to(torch.int32)


def tokens_per_node(is_token_in_rank: torch.Tensor, num_nodes: int, ranks_per_node: int) -> torch.Tensor:
    """``num_tokens_per_rdma_rank [G]`` int32: tokens with an expert on each node
    (``is_token_in_rank [N, G·P]`` bool)."""
    n = is_token_in_rank.size(0)
    return is_token_in_rank.view(n, num_nodes, ranks_per_node).any(2).sum(0, dtype=torch.int32)


def to_local_experts(recv_topk_idx: torch.Tensor, recv_topk_weights: torch.Tensor, rank: int,
                     num_local_experts: int) -> None:
    """In place: received global expert ids -> this rank's local ids, ``-1`` (weight 0) for other ranks' experts.

    ``recv_topk_idx`` ``[N_recv, K]`` int64 and ``recv_topk_weights`` ``[N_recv, K]`` float32, the real
    rows only (DeepEP's ``recv_topk_idx`` holds local expert ids, docs/semantics/deepep-api.md §4.2).
    """
    if _native.local_experts(recv_topk_idx, recv_topk_weights, rank, num_local_experts):  # one C pass where built
        return
    first = rank * num_local_experts
    foreign = (recv_topk_idx < first) | (recv_topk_idx >= first + num_local_experts)
    recv_topk_idx.sub_(first).masked_fill_(foreign, -1)
    recv_topk_weights.masked_fill_(foreign, 0.0)


def channel_quota(num_tokens: int, num_channels: int) -> int:
    """Tokens per channel ``q = ceil(N/C)`` (at least 1): channel ``c`` owns tokens ``[c·q, min((c+1)·q, N))``."""
    return max(1, ceil_div(num_tokens, num_channels))


def send_layout(is_token_in_rank: torch.Tensor, num_channels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sender-side handle entries: ``channel_prefix_matrix [R, C]`` int32 and ``send_head [N, R]`` int32.

    ``channel_prefix_matrix[j][c]`` = this rank's tokens for rank ``j`` in channels ``0..c``
    (inclusive); ``send_head[t][j]`` = position of token ``t`` in the sequence of its channel's
    tokens for rank ``j``, or -1 if not sent (docs/semantics/deepep-api.md §4.3).
    """
    done = _native.send_layout(is_token_in_rank, num_channels)  # one C pass where built
    if done is not None:
        return done
    n, r = is_token_in_rank.shape
    if not n:
        return torch.zeros(r, num_channels, dtype=torch.int32), torch.zeros(0, r, dtype=torch.int32)
    # numpy on small integer arrays: a handful of cheap calls instead of a dozen torch ops
    mask = is_token_in_rank.numpy()
    sent = mask.astype(np.int32)
    before = np.cumsum(sent, axis=0, dtype=np.int32) - sent  # [N, R] tokens for rank j before token t
    q = channel_quota(n, num_channels)
    ends = np.minimum(np.arange(1, num_channels + 1) * q, n)  # channel c: tokens [c·q, min((c+1)·q, N))
    channel_prefix = before[ends - 1] + sent[ends - 1]  # [C, R] tokens of channels 0..c (inclusive)
    position = before - before[np.arange(n) // q * q]  # minus the tokens of earlier channels
    send_head = np.where(mask, position, np.int32(-1))
    return torch.from_numpy(np.ascontiguousarray(channel_prefix.T)), torch.from_numpy(send_head)


def recv_channel_prefix(recv_src_idx: torch.Tensor, block_starts, num_tokens_per_source,
                        num_channels: int) -> torch.Tensor:
    """Receiver-side ``recv_channel_prefix_matrix [R, C]`` int32: start of channel ``c`` in source ``s``'s block.

    Args:
        recv_src_idx: ``[N_recv]`` int32 source token index of each received row.
        block_starts: ``R + 1`` ints, rows of source ``s`` are ``[block_starts[s], block_starts[s+1])``.
        num_tokens_per_source: ``R`` ints, ``N`` of each source (fixes its channel size).
    """
    done = _native.recv_channel_prefix(recv_src_idx, block_starts, num_tokens_per_source, num_channels)
    if done is not None:  # one C pass where built
        return done
    r = len(num_tokens_per_source)
    starts = [int(v) for v in block_starts]
    # numpy, all sources at once: each row's bin is (its source, its token's channel in that source)
    src = recv_src_idx[starts[0]:starts[r]].numpy().astype(np.int64)
    per_source = np.diff(starts)
    q = [channel_quota(int(t), num_channels) for t in num_tokens_per_source]
    width = num_channels + 1  # a last bin per source for tokens past its channels (none in a valid handle)
    channel = np.minimum(src // np.repeat(q, per_source), num_channels)
    bins = np.repeat(np.arange(r, dtype=np.int64) * width, per_source) + channel
    counts = np.bincount(bins, minlength=r * width)[:r * width].reshape(r, width)[:, :num_channels]
    return torch.from_numpy((counts.cumsum(1) - counts).astype(np.int32))


ALL_TOKENS = 1 << 62  # a round range covering any token count (still an int64)


def combine_round_tokens(recv_counts, capacity_rows: int, max_tokens: int) -> int:
    """Largest per-origin token range ``q`` such that every rank stages at most ``capacity_rows`` rows.

    In combine round ``k`` rank ``j`` stages, for every origin ``s``, its rows for tokens
    ``[k·q, (k+1)·q)`` of ``s``: at most ``min(q, M[s][j])`` rows, ``M = recv_counts [R, R]`` (a numpy
    array or a tensor)
    (``M[s][j]`` tokens sent from ``s`` to ``j``). All ranks hold the same ``M`` (from the
    handle), so all pick the same ``q``. Returns at least 1 (caller checks the capacity), and
    :data:`ALL_TOKENS` when every rank's rows fit at once: one round, however many tokens an
    origin has (an origin may have more tokens than any count in ``M``; a ``q`` of the largest
    count would then cost a second round, a full synchronisation, for the last few tokens).
    """
    recv_counts = np.asarray(recv_counts)  # a few small integer sums: numpy, not torch ops
    if int(recv_counts.sum(0).max()) <= capacity_rows:
        return ALL_TOKENS
    hi = max(1, max_tokens)

    def rows(q):
        return int(np.minimum(recv_counts, q).sum(0).max())

    lo = 1
    while lo < hi:  # largest q with rows(q) <= capacity, by bisection on a monotone function
        mid = (lo + hi + 1) // 2
        if rows(mid) <= capacity_rows:
            lo = mid
        else:
            hi = mid - 1
    return lo
