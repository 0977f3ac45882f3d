"""The normal path's routing counts in one C call each (``csrc/layout.c``): what
:mod:`deepep_ascend.ep.layout` computes with a dozen numpy or torch operator calls per call, which at a
decode step's or a small prefill's token counts cost more than the arithmetic.

Each wrapper returns None where the library is not loaded or the operands are not what the kernel takes
(the caller then takes its numpy path, the same integers), and otherwise new tensors.
"""
from __future__ import annotations

import ctypes

import torch

from .loader import kernels
from .operands import dense_ok, mark_written

__all__ = ["dispatch_layout", "local_experts", "recv_channel_prefix", "send_layout"]


def dispatch_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int,
                    last_slot: bool = False) -> tuple[torch.Tensor, ...] | None:
    """``(num_tokens_per_rank [R] int32, num_tokens_per_expert [E] int32, is_token_in_rank [N, R] bool)`` of a
    routing, in one pass (``deep_ep.Buffer.get_dispatch_layout``'s counts; docs/semantics/deepep-api.md §4.1),
    and with ``last_slot`` a fourth, ``[N, R]`` int64: each token's last top-k slot on each rank, -1 where it has
    none (:func:`deepep_ascend.ep.layout.last_slot_per_rank`, ``EPBuffer``'s combine key).

    Args:
        topk_idx: ``[N, K]`` contiguous int64, ids in ``[-1, num_experts)`` (-1: none).
        num_experts: ``E``, a positive multiple of ``num_ranks``.
    Returns:
        The tensors, or None: kernel not loaded, operands not as above, an id out of range, or no memory for
        the kernel's table of each expert's rank past 1,024 experts (nothing computed; the caller's path raises
        or handles it).
    """
    fn = kernels.dispatch_layout
    if fn is None or not dense_ok(topk_idx, torch.int64, ndim=2) or num_ranks <= 0 or num_experts % num_ranks:
        return None
    n, k = topk_idx.shape
    per_rank = torch.empty(num_ranks, dtype=torch.int32)
    per_expert = torch.empty(num_experts, dtype=torch.int32)
    in_rank = torch.empty(n, num_ranks, dtype=torch.bool)
    last = torch.empty(n, num_ranks, dtype=torch.int64) if last_slot else None
    if fn(topk_idx.data_ptr(), n, k, num_experts, num_ranks, per_rank.data_ptr(), per_expert.data_ptr(),
          in_rank.data_ptr(), None if last is None else last.data_ptr()):
        return None
    return (per_rank, per_expert, in_rank) if last is None else (per_rank, per_expert, in_rank, last)


def send_layout(is_token_in_rank: torch.Tensor, num_channels: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(channel_prefix_matrix [R, C] int32, send_head [N, R] int32)`` of a routing mask in one pass
    (:func:`deepep_ascend.ep.layout.send_layout`; docs/semantics/deepep-api.md §4.3).

    Args:
        is_token_in_rank: ``[N, R]`` contiguous bool.
        num_channels: ``C >= 1``.
    Returns:
        The two tensors, or None (kernel not loaded, operands not as above).
    """
    fn = kernels.send_layout
    if fn is None or not dense_ok(is_token_in_rank, torch.bool, ndim=2) or num_channels < 1:
        return None
    n, r = is_token_in_rank.shape
    channel_prefix = torch.empty(r, num_channels, dtype=torch.int32)
    send_head = torch.empty(n, r, dtype=torch.int32)
    scratch = (ctypes.c_int32 * max(1, 2 * r))()
    fn(is_token_in_rank.data_ptr(), n, r, num_channels, channel_prefix.data_ptr(), send_head.data_ptr(), scratch)
    return channel_prefix, send_head


def recv_channel_prefix(recv_src_idx: torch.Tensor, block_starts, num_tokens_per_source,
                        num_channels: int) -> torch.Tensor | None:
    """``recv_channel_prefix_matrix [R, C]`` int32 in one pass (:func:`deepep_ascend.ep.layout.recv_channel_prefix`;
    docs/semantics/deepep-api.md §4.3).

    Args:
        recv_src_idx: ``[>= block_starts[-1]]`` contiguous int32 source token of each received row.
        block_starts: ``R + 1`` ascending ints (rows of source ``s``: ``[block_starts[s], block_starts[s+1])``).
        num_tokens_per_source: ``R`` ints.
        num_channels: ``C >= 1``.
    Returns:
        The matrix, or None (kernel not loaded, operands not as above, a negative token index).
    """
    fn = kernels.recv_channel_prefix
    r = len(num_tokens_per_source)
    if (fn is None or not dense_ok(recv_src_idx, torch.int32, ndim=1) or num_channels < 1 or len(block_starts) != r + 1
            or r == 0 or not 0 <= int(block_starts[0]) <= int(block_starts[r]) <= recv_src_idx.numel()):
        return None
    out = torch.empty(r, num_channels, dtype=torch.int32)
    starts = (ctypes.c_int64 * (r + 1))(*(int(v) for v in block_starts))
    ntok = (ctypes.c_int64 * r)(*(int(v) for v in num_tokens_per_source))
    if fn(recv_src_idx.data_ptr(), starts, ntok, r, num_channels, out.data_ptr()):
        return None
    return out


def local_experts(recv_topk_idx: torch.Tensor, recv_topk_weights: torch.Tensor, rank: int,
                  num_local_experts: int) -> bool:
    """In place, one pass: received global expert ids -> this rank's local ids, -1 and weight +0.0 for other
    ranks' experts (:func:`deepep_ascend.ep.layout.to_local_experts`; docs/semantics/deepep-api.md §4.2).

    Args:
        recv_topk_idx: ``[N_recv, K]`` contiguous int64; recv_topk_weights: the same shape, contiguous float32.
    Returns:
        True when done; False (nothing written) if the kernel is not loaded or the operands are not as above.
    """
    fn = kernels.local_experts
    if (fn is None or not dense_ok(recv_topk_idx, torch.int64, ndim=2)
            or not dense_ok(recv_topk_weights, torch.float32, ndim=2)
            or recv_topk_idx.shape != recv_topk_weights.shape):
        return False
    fn(recv_topk_idx.data_ptr(), recv_topk_weights.data_ptr(), recv_topk_idx.numel(),
       rank * num_local_experts, num_local_experts)
    mark_written(recv_topk_idx)
    mark_written(recv_topk_weights)
    return True
