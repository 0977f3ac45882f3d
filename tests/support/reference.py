"""Single-process reference of DeepEP V1 semantics in torch (numpy for the FP8 kernel arithmetic): the test oracle.

Every function takes *all* ranks' inputs (gathered into one process, e.g. with
``mpi_utils.gather_all``) and computes what one rank must observe, following
``docs/semantics/deepep-api.md`` §4.1 (layout), §4.4 (dispatch), §4.6 (combine), §4.8 (FP8 cast)
and docs/semantics/deepep-api.md §9 (``calc_diff``). It is written with plain loops and simple torch ops, for clarity
rather than speed, and deliberately does not import ``deepep_ascend``: it must stay an independent oracle.

Conventions (docs/semantics/deepep-api.md §0): ``R`` ranks, expert ``e`` lives on rank ``e // L`` with local id
``e % L`` (``L = E / R``); ``-1`` in ``topk_idx`` means "no expert".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

__all__ = [
    "RefDispatch",
    "align_up",
    "calc_diff",
    "per_token_cast_back",
    "per_token_cast_to_fp8",
    "ref_combine",
    "ref_dispatch",
    "ref_dispatch_layout",
    "ref_rank_prefix_matrix",
    "ref_recv_rows",
]
__all__ += ["RefLowLatencyDispatch", "ref_ll_cast_fp8", "ref_ll_combine", "ref_ll_dispatch"]  # low-latency section

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_GROUP = 128  # channels per scale


def align_up(x: int, alignment: int) -> int:
    """Smallest multiple of ``alignment`` that is >= ``x``."""
    return (x + alignment - 1) // alignment * alignment


def _check_topk_idx(topk_idx: torch.Tensor, num_experts: int) -> None:
    if topk_idx.dim() != 2:
        raise ValueError(
            f"topk_idx must be 2-D [N, K], got shape {tuple(topk_idx.shape)}"
        )
    if topk_idx.numel():
        bad = (topk_idx < -1) | (topk_idx >= num_experts)
        if bool(bad.any()):
            raise ValueError(
                f"topk_idx values must be -1 or in [0, {num_experts}), got "
                f"{topk_idx[bad][:5].tolist()}"
            )


# ----------------------------------------------------------------------------------------------
# docs/semantics/deepep-api.md §4.1 layout


def ref_dispatch_layout(
    topk_idx: torch.Tensor,
    num_experts: int,
    num_ranks: int,
    ranks_per_node: int | None = None,
):
    """Reference of ``Buffer.get_dispatch_layout`` for one rank's ``topk_idx [N, K]``.

    Returns ``(num_tokens_per_rank [R] int32, num_tokens_per_rdma_rank [R/rpn] int32 | None,
    num_tokens_per_expert [E] int32, is_token_in_rank [N, R] bool)``:

    * ``num_tokens_per_rank[j]``: tokens with at least one expert on rank ``j`` (each token once);
    * ``num_tokens_per_expert[e]``: (token, slot) pairs selecting ``e`` — a token listing ``e``
      twice counts twice;
    * ``num_tokens_per_rdma_rank[b]``: tokens with at least one expert on node ``b``. ``None``
      unless there is more than one node: DeepEP's rule (``ranks_per_node=None``) is nodes of 8
      ranks and the per-node count only when ``R > 8``; pass ``ranks_per_node`` for simulated
      nodes.
    """
    if num_experts % num_ranks != 0:
        raise ValueError(
            f"num_experts={num_experts} not divisible by num_ranks={num_ranks}"
        )
    _check_topk_idx(topk_idx, num_experts)
    L = num_experts // num_ranks
    N = topk_idx.size(0)

    counts = [0] * num_experts
    in_rank = [[False] * num_ranks for _ in range(N)]
    for t, row in enumerate(topk_idx.tolist()):
        for e in row:
            if e >= 0:
                counts[e] += 1  # every (token, slot) pair
                in_rank[t][e // L] = True  # each token once per rank
    num_tokens_per_expert = torch.tensor(counts, dtype=torch.int32)
    is_token_in_rank = torch.tensor(in_rank, dtype=torch.bool).reshape(N, num_ranks)
    num_tokens_per_rank = is_token_in_rank.sum(dim=0).to(torch.int32)

    rpn = 8 if ranks_per_node is None else ranks_per_node
    num_nodes = max(1, num_ranks // rpn)
    if num_nodes > 1 and (ranks_per_node is not None or num_ranks > 8):
        is_token_in_node = is_token_in_rank.view(N, num_nodes, rpn).any(dim=2)
        num_tokens_per_rdma_rank = is_token_in_node.sum(dim=0).to(torch.int32)
    else:
        num_tokens_per_rdma_rank = None
    return (
        num_tokens_per_rank,
        num_tokens_per_rdma_rank,
        num_tokens_per_expert,
        is_token_in_rank,
    )


def ref_rank_prefix_matrix(is_token_in_ranks: Sequence[torch.Tensor]) -> torch.Tensor:
    """``P [R, R] int32``, ``P[i][j] = Σ_{k ≤ i}`` tokens rank ``k`` sends to rank ``j``
    (docs/semantics/deepep-api.md §4.3)."""
    R = len(is_token_in_ranks)
    P = torch.zeros(R, R, dtype=torch.int32)
    running = torch.zeros(R, dtype=torch.int32)
    for i in range(R):
        running = running + is_token_in_ranks[i].sum(dim=0).to(torch.int32)
        P[i] = running
    return P


def ref_recv_rows(
    is_token_in_ranks: Sequence[torch.Tensor], rank: int
) -> list[tuple[int, int]]:
    """The ``(source rank, source token)`` of each row ``rank`` receives, in dispatch order:
    source rank ascending (including ``rank`` itself), then source token index ascending
    (docs/semantics/deepep-api.md §4.4).
    """
    rows = []
    for s, mask in enumerate(is_token_in_ranks):
        for t, to_rank in enumerate(mask[:, rank].tolist()):
            if to_rank:
                rows.append((s, t))
    return rows


# ----------------------------------------------------------------------------------------------
# docs/semantics/deepep-api.md §4.4 dispatch


class RefDispatch(NamedTuple):
    """Expected results of a normal (non-cached) ``Buffer.dispatch`` on one rank."""

    recv_x: (
        torch.Tensor | tuple[torch.Tensor, torch.Tensor]
    )  # [N_recv, H] (or (data, scales))
    recv_topk_idx: torch.Tensor | None  # [N_recv, K] local expert id or -1
    recv_topk_weights: torch.Tensor | None  # [N_recv, K] float32, 0.0 where idx == -1
    num_recv_tokens_per_expert_list: list[
        int
    ]  # L ints, aligned up ([] with num_worst_tokens)
    rank_prefix_matrix: torch.Tensor  # [R, R] int32 (handle[0], every column)
    recv_src_idx: torch.Tensor  # [N_recv] int32 (handle[3])
    recv_src_rank: (
        torch.Tensor
    )  # [N_recv] int32 source rank of each row (not in DeepEP's API)
    is_token_in_rank: (
        torch.Tensor
    )  # [N_rank, R] bool of this rank's own tokens (handle[4])
    num_recv_tokens: int  # real number of received rows (before worst-case padding)


def _take_rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Byte copies of rows ``rows`` of a 2-D tensor, result contiguous (any dtype, any strides)."""
    return t.index_select(0, torch.tensor(rows, dtype=torch.long)).contiguous()


def ref_dispatch(
    xs: Sequence[torch.Tensor | tuple[torch.Tensor, torch.Tensor]],
    topk_idxs: Sequence[torch.Tensor],
    topk_weights_list: Sequence[torch.Tensor] | None,
    num_experts: int,
    rank: int,
    expert_alignment: int = 1,
    is_token_in_ranks: Sequence[torch.Tensor] | None = None,
    num_worst_tokens: int = 0,
) -> RefDispatch:
    """What ``rank`` receives from a normal dispatch, given every rank's inputs (lists by rank).

    * ``xs[s]``: rank ``s``'s ``x``, a ``[N_s, H]`` tensor (any dtype) or an
      ``(data [N_s, H] float8_e4m3fn, scales [N_s, S])`` tuple (scales of any strides);
    * ``topk_idxs[s]``: ``[N_s, K]`` expert ids or ``-1`` (routing and per-expert counts);
    * ``topk_weights_list``: ``[N_s, K]`` float32 per rank, or ``None`` for a dispatch without
      top-k (then ``recv_topk_idx``/``recv_topk_weights`` are ``None``);
    * ``is_token_in_ranks``: optional routing masks overriding the ones derived from
      ``topk_idxs`` (as when the caller passes its own ``is_token_in_rank``);
    * ``num_worst_tokens = W > 0``: outputs padded to ``W`` rows (trailing ``recv_topk_idx`` = -1,
      all other trailing values 0 — the port's choice for DeepEP's uninitialised rows),
      ``num_recv_tokens_per_expert_list == []``; ``W`` below the real count raises ``ValueError``.

    Rows: grouped by source rank ascending, then source token index ascending; ``recv_x`` rows
    are byte copies and received scales are contiguous. ``recv_topk_idx`` is ``e - rank*L`` where
    expert ``e`` is on ``rank``, else -1 (dtype of the input ids); ``recv_topk_weights`` is the
    original weight where that index is >= 0, exactly 0.0 elsewhere. The list has ``L`` entries
    ``align_up(Σ_s num_tokens_per_expert_s[rank*L + i], expert_alignment)``.
    """
    R = len(xs)
    if len(topk_idxs) != R or (
        topk_weights_list is not None and len(topk_weights_list) != R
    ):
        raise ValueError(
            "xs, topk_idxs and topk_weights_list must have one entry per rank"
        )
    if not 0 <= rank < R:
        raise ValueError(f"rank={rank} out of range for {R} ranks")
    L = num_experts // R
    layouts = [ref_dispatch_layout(idx, num_experts, R) for idx in topk_idxs]
    masks = (
        list(is_token_in_ranks)
        if is_token_in_ranks is not None
        else [lay[3] for lay in layouts]
    )

    rows = ref_recv_rows(masks, rank)
    n_recv = len(rows)
    if num_worst_tokens and num_worst_tokens < n_recv:
        raise ValueError(
            f"num_worst_tokens={num_worst_tokens} < received tokens {n_recv}"
        )

    # recv_x: byte copies, source after source
    def gather(per_rank: Sequence[torch.Tensor]) -> torch.Tensor:
        parts = [
            _take_rows(per_rank[s], [t for (ss, t) in rows if ss == s])
            for s in range(R)
        ]
        return torch.cat(parts, dim=0).contiguous()

    is_fp8 = isinstance(xs[0], tuple)
    if is_fp8:
        recv_x = (gather([x[0] for x in xs]), gather([x[1] for x in xs]))
    else:
        recv_x = gather(xs)

    recv_topk_idx = recv_topk_weights = None
    if topk_weights_list is not None:
        K = topk_idxs[0].size(1)
        idx_lists = [idx.tolist() for idx in topk_idxs]
        w_lists = [w.to(torch.float32).tolist() for w in topk_weights_list]
        idx_rows, w_rows = [], []
        for s, t in rows:
            idx_row, w_row = [], []
            for k in range(K):
                e = idx_lists[s][t][k]
                if (
                    e >= 0 and e // L == rank
                ):  # expert on this rank: local id, keep weight
                    idx_row.append(e - rank * L)
                    w_row.append(w_lists[s][t][k])
                else:
                    idx_row.append(-1)
                    w_row.append(0.0)
            idx_rows.append(idx_row)
            w_rows.append(w_row)
        recv_topk_idx = torch.tensor(idx_rows, dtype=topk_idxs[0].dtype).reshape(
            n_recv, K
        )
        recv_topk_weights = torch.tensor(w_rows, dtype=torch.float32).reshape(n_recv, K)

    num_recv_tokens_per_expert_list = []
    for i in range(L):
        total = sum(int(lay[2][rank * L + i]) for lay in layouts)
        num_recv_tokens_per_expert_list.append(align_up(total, expert_alignment))

    recv_src_idx = torch.tensor([t for (_, t) in rows], dtype=torch.int32)
    recv_src_rank = torch.tensor([s for (s, _) in rows], dtype=torch.int32)

    if num_worst_tokens:
        pad = num_worst_tokens - n_recv

        def padded(t: torch.Tensor, value=0) -> torch.Tensor:
            return torch.cat(
                [t, torch.full((pad, *t.shape[1:]), value, dtype=t.dtype)], dim=0
            )

        recv_x = (padded(recv_x[0]), padded(recv_x[1])) if is_fp8 else padded(recv_x)
        if recv_topk_idx is not None:
            recv_topk_idx = padded(recv_topk_idx, -1)
            recv_topk_weights = padded(recv_topk_weights)
        recv_src_idx = padded(recv_src_idx)
        recv_src_rank = padded(recv_src_rank, -1)
        num_recv_tokens_per_expert_list = []

    return RefDispatch(
        recv_x=recv_x,
        recv_topk_idx=recv_topk_idx,
        recv_topk_weights=recv_topk_weights,
        num_recv_tokens_per_expert_list=num_recv_tokens_per_expert_list,
        rank_prefix_matrix=ref_rank_prefix_matrix(masks),
        recv_src_idx=recv_src_idx,
        recv_src_rank=recv_src_rank,
        is_token_in_rank=masks[rank].clone(),
        num_recv_tokens=n_recv,
    )


# ----------------------------------------------------------------------------------------------
# docs/semantics/deepep-api.md §4.6 combine


def _split_bias(bias):
    if bias is None:
        return None, None
    if isinstance(bias, torch.Tensor):
        return bias, None
    if isinstance(bias, (tuple, list)) and len(bias) == 2:
        return bias[0], bias[1]
    raise TypeError("bias must be None, a tensor or a 2-tuple of tensors")


def ref_combine(
    xs: Sequence[torch.Tensor],
    is_token_in_ranks: Sequence[torch.Tensor],
    rank: int,
    bias=None,
    topk_weights: Sequence[torch.Tensor] | None = None,
    ranks_per_node: int | None = None,
):
    """What the origin ``rank`` gets back from a normal ``Buffer.combine`` (docs/semantics/deepep-api.md §4.6).

    * ``xs[s]``: rank ``s``'s combine input ``[>= N_recv_s, H]`` bf16, in rank ``s``'s dispatch
      row order (worst-case extra rows are ignored);
    * ``is_token_in_ranks[s]``: rank ``s``'s routing mask ``[N_s, R]`` of the dispatch whose
      handle is used — it fixes each receiver's row order (:func:`ref_recv_rows`);
    * ``bias``: ``None``, a tensor, or a 2-tuple (entries may be ``None``), each ``[N_rank, H]``;
    * ``topk_weights``: per-rank ``[>= N_recv_s, K']`` float32, or ``None``.

    Per original token ``t`` of ``rank``, per element: ``acc = f32(bias0) + f32(bias1)`` (missing
    → 0.0), then for each rank ``s`` that received ``t``, ascending ``s``, ``acc += f32(row)``;
    output ``acc.to(bfloat16)`` (round to nearest even). No weights are applied to ``x``.
    Weights: ``Σ_s w_s[row]`` in float32 starting from 0.0, ascending ``s``.

    ``ranks_per_node`` below ``R`` gives the internode rule (docs/semantics/deepep-api.md §5), two roundings: per node
    ``c`` (ranks ``c·rpn .. (c+1)·rpn - 1``) that received ``t``, ``partial_c = bf16(0.0 + Σ f32(row))``
    ascending rank; then ``acc = f32(bias0) + f32(bias1)``, ``acc += f32(partial_c)`` ascending
    ``c``, output ``bf16(acc)``. Weights: the same two float32 sums, never rounded.
    Returns ``(combined_x [N_rank, H] bf16, combined_topk_weights [N_rank, K'] float32 | None)``.
    """
    R = len(xs)
    if len(is_token_in_ranks) != R:
        raise ValueError("xs and is_token_in_ranks must have one entry per rank")
    mask = is_token_in_ranks[rank]
    N = mask.size(0)
    H = xs[0].size(1)

    b0, b1 = _split_bias(bias)
    zeros = torch.zeros(N, H, dtype=torch.float32)
    acc = (zeros if b0 is None else b0.to(torch.float32)) + (
        zeros if b1 is None else b1.to(torch.float32)
    )
    w_acc = None
    if topk_weights is not None:
        w_acc = torch.zeros(N, topk_weights[0].size(1), dtype=torch.float32)

    if ranks_per_node is not None and ranks_per_node < R:
        return _ref_combine_two_level(xs, is_token_in_ranks, rank, acc, w_acc, topk_weights, ranks_per_node)

    # One pass per receiver s, ascending: every element gets its partials added in ascending-s
    # order, each a single float32 add. Receiver s holds this rank's tokens (in token order)
    # right after the tokens of all lower source ranks (dispatch order, docs/semantics/deepep-api.md §4.4).
    for s in range(R):
        tokens = torch.nonzero(mask[:, s], as_tuple=False).flatten()  # ascending t
        first = sum(int(is_token_in_ranks[k][:, s].sum()) for k in range(rank))
        rows = torch.arange(first, first + tokens.numel())
        acc[tokens] = acc[tokens] + xs[s].index_select(0, rows).to(torch.float32)
        if w_acc is not None:
            w_acc[tokens] = w_acc[tokens] + topk_weights[s].index_select(0, rows).to(
                torch.float32
            )
    return acc.to(torch.bfloat16), w_acc


def _ref_combine_two_level(xs, is_token_in_ranks, rank, acc, w_acc, topk_weights, rpn):
    """Internode combine of :func:`ref_combine`: node partials rounded to bf16, then the origin's sum."""
    R = len(xs)
    mask = is_token_in_ranks[rank]
    N, H = acc.shape
    for c in range(R // rpn):
        part = torch.zeros(N, H, dtype=torch.float32)
        wpart = None if w_acc is None else torch.zeros_like(w_acc)
        reached = torch.zeros(N, dtype=torch.bool)
        for s in range(c * rpn, (c + 1) * rpn):
            tokens = torch.nonzero(mask[:, s], as_tuple=False).flatten()
            first = sum(int(is_token_in_ranks[k][:, s].sum()) for k in range(rank))
            rows = torch.arange(first, first + tokens.numel())
            part[tokens] = part[tokens] + xs[s].index_select(0, rows).to(torch.float32)
            if wpart is not None:
                wpart[tokens] = wpart[tokens] + topk_weights[s].index_select(0, rows).to(torch.float32)
            reached[tokens] = True
        tokens = torch.nonzero(reached, as_tuple=False).flatten()
        acc[tokens] = acc[tokens] + part[tokens].to(torch.bfloat16).to(torch.float32)
        if w_acc is not None:
            w_acc[tokens] = w_acc[tokens] + wpart[tokens]
    return acc.to(torch.bfloat16), w_acc


# ----------------------------------------------------------------------------------------------
# docs/semantics/deepep-api.md §9 calc_diff, §4.8 FP8


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepEP's similarity distance: ``1 − 2·Σ(x+1)(y+1) / Σ[(x+1)² + (y+1)²]`` in float64."""
    x, y = x.double() + 1, y.double() + 1
    denominator = (x * x + y * y).sum()
    sim = 2 * (x * y).sum() / denominator
    return (1 - sim).item()


def per_token_cast_to_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepEP's per-token, per-128-channel FP8 cast (docs/semantics/deepep-api.md §4.8).

    ``x [N, H]`` (bf16 or float32). Each group of 128 channels (the last zero-padded) gets
    ``amax = max(max|x|, 1e-4)``; ``data = e4m3(x · (448/amax))``, ``scale = amax / 448``.
    Returns ``(data [N, H] float8_e4m3fn, scales [N, ceil(H/128)] float32)``, both contiguous.
    """
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [N, H], got shape {tuple(x.shape)}")
    N, H = x.shape
    S = math.ceil(H / FP8_GROUP)
    padded = torch.zeros(N, S * FP8_GROUP, dtype=torch.float32)
    padded[:, :H] = x.to(torch.float32)
    groups = padded.view(N, S, FP8_GROUP)
    amax = groups.abs().amax(dim=2).clamp(min=1e-4)  # [N, S] float32
    data = (groups * (FP8_MAX / amax).unsqueeze(2)).to(torch.float8_e4m3fn)
    data = data.view(N, S * FP8_GROUP)[:, :H].contiguous()
    scales = (amax / FP8_MAX).contiguous()
    return data, scales


def _ue8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """Unpack int32 UE8M0 scales (4 exponent bytes per int32, little-endian) to float32."""
    N, P = scales.shape
    # A fresh standard-strided copy: .contiguous() keeps odd strides of size-1 dims (e.g. a
    # column-major [N, 1]), which torch then refuses to view as bytes.
    raw = torch.empty(N, P, dtype=scales.dtype).copy_(scales).view(torch.uint8).view(N, P * 4).to(torch.int32)
    return torch.pow(
        torch.tensor(2.0, dtype=torch.float32), (raw - 127).to(torch.float32)
    )


def per_token_cast_back(
    data: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Inverse of :func:`per_token_cast_to_fp8`: ``data · scale`` per 128-channel group.

    ``scales`` float32 ``[N, ceil(H/128)]`` (any strides), or int32 packed UE8M0 (docs/semantics/deepep-api.md §6.4:
    byte ``b`` means ``2^(b−127)``, groups ``4p..4p+3`` in int32 ``p``). Returns ``[N, H]`` of ``dtype``.
    """
    N, H = data.shape
    S = math.ceil(H / FP8_GROUP)
    if scales.dtype == torch.int32:
        scales = _ue8m0_to_float(scales)
    scales = scales.to(torch.float32)[:, :S]
    padded = torch.zeros(N, S * FP8_GROUP, dtype=torch.float32)
    padded[:, :H] = data.to(torch.float32)
    out = padded.view(N, S, FP8_GROUP) * scales.unsqueeze(2)
    return out.view(N, S * FP8_GROUP)[:, :H].to(dtype)


# ==============================================================================================
# MegaMoE (docs/semantics/mega-moe.md §2) — independent of deepep_ascend: plain torch over all ranks' inputs
# ==============================================================================================

_MEGA_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def mega_calc_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """docs/semantics/mega-moe.md §2 metric: ``1 − 2Σab / Σ(a² + b²)`` in float64 (0 for two all-zero tensors)."""
    a, b = a.double(), b.double()
    den = (a * a + b * b).sum()
    return 0.0 if float(den) == 0 else float(1 - 2 * (a * b).sum() / den)


def mega_ue8m0_bytes_to_float(b: torch.Tensor) -> torch.Tensor:
    """UE8M0 bytes (any int dtype, values 0..254) → float32 ``2^(b−127)`` (float64 power, exact)."""
    return torch.pow(2.0, b.to(torch.float64) - 127).to(torch.float32)


def mega_unpack_int32_ue8m0(sf: torch.Tensor) -> torch.Tensor:
    """int32 ``[..., W]`` (four little-endian exponent bytes per int, any strides) → float32 ``[..., 4W]``."""
    raw = sf.contiguous().view(torch.uint8).reshape(*sf.shape[:-1], 4 * sf.shape[-1])
    return mega_ue8m0_bytes_to_float(raw)


def mega_fp4_to_float(packed: torch.Tensor) -> torch.Tensor:
    """int8 ``[..., K/2]`` (element 2i in the low nibble, bit 3 = sign) → float32 ``[..., K]``."""
    u = packed.view(torch.uint8).to(torch.int64)
    codes = torch.stack([u & 0xF, u >> 4], -1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])
    mag = torch.tensor(_MEGA_E2M1, dtype=torch.float32)[codes & 7]
    return torch.where(codes >= 8, -mag, mag)


def mega_dequant_fp4_weights(data: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
    """Untransformed FP4 weights ``(int8 [.., N, K/2], int32 [.., N, K/128])`` → float32 ``[.., N, K]``."""
    vals = mega_fp4_to_float(data)
    scale = mega_unpack_int32_ue8m0(sf)
    return vals * scale.repeat_interleave(32, dim=-1)[..., : vals.shape[-1]]


def mega_dequant_x(x: torch.Tensor, x_sf: torch.Tensor | None) -> torch.Tensor:
    """``X`` of docs/semantics/mega-moe.md §2 step 1: bf16 ``x`` as float32,
    or e4m3 ``x`` times its UE8M0 scale per 32 channels."""
    if x_sf is None:
        return x.float()
    return x.float() * mega_unpack_int32_ue8m0(x_sf).repeat_interleave(32, dim=-1)[:, : x.shape[1]]


def mega_swiglu(h: torch.Tensor, inter: int, w: torch.Tensor, clamp, fp8: bool, activation: str = "swiglu",
                alpha: float = 1.0, up_bias: float = 0.0, fast_math: bool = False) -> torch.Tensor:
    """Steps 3-5: bf16 rounding, clamp, the activation times ``w`` in fp32, then fp8 (UE8M0 per 32) or bf16 →
    float32. ``'swiglu'``: ``silu(g)·u``; ``'swigluoai'`` (DeepGEMM PR #445, gpt-oss): ``g·sigmoid(alpha·g)·
    (u + up_bias)`` with ``alpha`` and ``up_bias`` as float32. The sigmoid as DeepGEMM's epilogue writes it:
    ``g / (1 + exp(-(alpha·g)))``, or ``(1 / (1 + exp(-(alpha·g))))·g`` with ``fast_math``."""
    g, u = h[:, :inter].to(torch.bfloat16), h[:, inter:].to(torch.bfloat16)
    if clamp is not None:
        c = float(torch.tensor(float(clamp)).to(torch.bfloat16))
        g = g.float().clamp(max=c)
        u = u.float().clamp(-c, c)
    g, u = g.float(), u.float()
    if activation == "swigluoai":
        a32 = torch.tensor(alpha, dtype=torch.float32)
        b32 = torch.tensor(up_bias, dtype=torch.float32)
        e = torch.exp(-(a32 * g))
        u = u + b32
    else:
        assert activation == "swiglu", activation
        e = torch.exp(-g)
    s = (1 / (1 + e)) * g if fast_math else g / (1 + e)
    a = s * u * w.unsqueeze(1)
    if not fp8:
        return a.to(torch.bfloat16).float()
    n = a.shape[0]
    grp = a.reshape(n, inter // 32, 32)
    amax = grp.abs().amax(-1).clamp(min=1e-4).double()
    s = torch.pow(2.0, torch.ceil(torch.log2(amax / 448.0))).float().unsqueeze(-1)
    q = (grp / s).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    return (q * s).reshape(n, inter)


def ref_mega_moe(xs, x_sfs, topk_idxs, topk_weights, w1, w2, clamp=None, shared=None, ranks=None,
                 activation="swiglu", alpha=1.0, up_bias=0.0):
    """Every rank's ``y`` of MegaMoE (docs/semantics/mega-moe.md §2), from all ranks' inputs in one process.

    Args:
        xs: per rank ``[T_r, H]`` bf16 or e4m3; x_sfs: per rank int32 ``[T_r, H/128]`` or None (bf16).
        topk_idxs, topk_weights: per rank ``[T_r, K]`` int64 / float32.
        w1, w2: float32 **untransformed** weights of all ``E`` experts, ``[E, 2I, H]`` (gate rows
            first) and ``[E, H, I]`` (already dequantized).
        clamp: ``None`` or the activation clamp; shared: ``None`` or float32 ``(w1s [2·S·I, H],
            w2s [H, S·I])`` (weight 1, same activation, added after the routed terms).
        ranks: compute only these ranks' outputs (others ``None``); default all.
        activation, alpha, up_bias: ``'swiglu'``, or ``'swigluoai'`` with its parameters (:func:`mega_swiglu`).
    Returns: per rank bf16 ``[T_r, H]``. Pairs are grouped by expert (fp32 matmuls), each output
    ``o_k`` rounded to bf16, summed in fp32 in ascending ``k``, then the shared term, rounded once.
    """
    fp8 = x_sfs[0] is not None
    inter = w2.shape[2]
    outs = []
    for r, x in enumerate(xs):
        if ranks is not None and r not in ranks:
            outs.append(None)
            continue
        t, k = topk_idxs[r].shape
        hid = x.shape[1]
        X = mega_dequant_x(x, x_sfs[r] if fp8 else None)
        o = torch.zeros(t, k, hid)
        idx, wts = topk_idxs[r], topk_weights[r]
        for e in torch.unique(idx[idx >= 0]).tolist():
            tok, slot = torch.nonzero(idx == e, as_tuple=True)
            h = X[tok] @ w1[e].t()
            a = mega_swiglu(h, inter, wts[tok, slot], clamp, fp8, activation, alpha, up_bias)
            o[tok, slot] = (a @ w2[e].t()).to(torch.bfloat16).float()
        acc = torch.zeros(t, hid)
        for j in range(k):
            acc = acc + o[:, j]
        if shared is not None:
            w1s, w2s = shared
            a = mega_swiglu(X @ w1s.t(), w2s.shape[1], torch.ones(t), clamp, fp8, activation, alpha, up_bias)
            acc = acc + (a @ w2s.t()).to(torch.bfloat16).float()
        outs.append(acc.to(torch.bfloat16))
    return outs


__all__ += ["mega_calc_diff", "mega_dequant_fp4_weights", "mega_dequant_x", "mega_fp4_to_float", "mega_swiglu",
            "mega_unpack_int32_ue8m0", "ref_mega_moe"]


# ==============================================================================================
# Low-latency mode (docs/semantics/deepep-api.md §6.2-§6.4, §7): per-expert fixed slots, FP8 cast with round_scale/UE8M0


class RefLowLatencyDispatch(NamedTuple):
    """What rank ``rank`` must receive from ``low_latency_dispatch`` (rows past the counts are 0)."""

    recv_x: torch.Tensor  # [L, R*M, H] bf16 or float8_e4m3fn
    recv_scales: torch.Tensor | None  # [L, R*M, S] float32 or [L, R*M, H/512] int32 (row-major here)
    recv_count: torch.Tensor  # [L] int32
    src_info: torch.Tensor  # [L, R*M] int32
    layout_range: torch.Tensor  # [L, R] int64, begin << 32 | count


def _e4m3_codes_satfinite(v: np.ndarray) -> np.ndarray:
    """uint8 e4m3fn codes of float32 ``v``, as CUDA's ``__nv_cvt_float2_to_fp8x2(v, __NV_SATFINITE,
    __NV_E4M3)`` gives them: round to nearest, ties to the even code; magnitudes past 448 (infinities
    too) saturate to 448; NaN gives 0x7F; the sign bit is kept (``-0.0`` gives 0x80).

    Written from the format's definition (exponent bias 7, three mantissa bits, subnormal step
    ``2**-9``) in float64, where every candidate and every distance is exact; it uses neither
    torch's cast nor any float8 type."""
    code = np.arange(127)  # 0x00..0x7E, the non-negative finite codes, ascending in value
    exp, man = code >> 3, code & 7
    values = np.where(exp == 0, man * 2.0**-9, (1 + man / 8) * 2.0 ** (exp - 7))
    a = np.abs(v.astype(np.float64))
    nan = np.isnan(a)
    a = np.minimum(np.where(nan, 0.0, a), values[-1])
    hi = np.minimum(np.searchsorted(values, a, side="left"), 126)  # first value >= a
    lo = np.maximum(hi - 1, 0)
    below, above = a - values[lo], values[hi] - a
    pick = np.where(above < below, hi, np.where(below < above, lo, np.where(hi % 2 == 0, hi, lo)))
    pick = np.where(nan, 0x7F, pick)
    return (pick | np.where(np.signbit(v), 0x80, 0)).astype(np.uint8)


def ref_ll_cast_fp8(x: torch.Tensor, round_scale: bool = False, use_ue8m0: bool = False):
    """DeepEP LL dispatch's per-token FP8 cast (docs/semantics/deepep-api.md §6.4), in numpy float32 in the
    kernel's operation order (``deep_ep`` ``internode_ll.cu`` dispatch and ``calculate_fp8_scales``):

    * ``amax = fmaxf(1e-4f, |x_i|...)`` per 128 channels (``fmaxf`` skips NaN elements);
    * plain: ``scale = 448.0f / amax`` (one IEEE division), ``scale_inv = amax * (1 / 448.0f)``;
    * ``round_scale``: ``k = exponent(amax * (1 / 448.0f)) + (mantissa != 0)`` from the bits,
      ``scale = bits((127 - k) << 23)``, ``scale_inv = bits((127 + k) << 23)`` (no clamp);
    * ``data = cvt_satfinite_e4m3(x * scale)`` (:func:`_e4m3_codes_satfinite`); the stored scale is
      ``scale_inv``, with ``use_ue8m0`` its byte ``bits >> 23`` (byte ``i`` of word ``p`` is group
      ``4p + i``).

    ``x [N, H]`` bf16 or float32, ``H % 128 == 0``. Returns ``(data [N, H] e4m3, scales)``: float32
    ``[N, H/128]``, or with ``use_ue8m0`` int32 ``[N, H/512]``.
    """
    n, h = x.shape
    if h % FP8_GROUP:
        raise ValueError(f"hidden must be a multiple of {FP8_GROUP}, got {h}")
    if use_ue8m0 and not round_scale:
        raise ValueError("use_ue8m0 requires round_scale")
    s = h // FP8_GROUP
    groups = x.float().numpy().reshape(n, s, FP8_GROUP)
    f32 = np.float32
    with np.errstate(all="ignore"):  # infinities and NaN follow IEEE arithmetic, as on the GPU
        amax = np.fmax.reduce(np.abs(groups), axis=2, initial=f32(1e-4))
        inv448 = f32(1) / f32(FP8_MAX)
        if round_scale:
            bits = (amax * inv448).view(np.uint32).astype(np.int64)
            k = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0)
            scale = (((127 - k) << 23) & 0xFFFFFFFF).astype(np.uint32).view(np.float32)
            scale_inv = (((127 + k) << 23) & 0xFFFFFFFF).astype(np.uint32).view(np.float32)
        else:
            scale = f32(FP8_MAX) / amax
            scale_inv = amax * inv448
        scaled = groups * scale[:, :, None]
    data = torch.from_numpy(_e4m3_codes_satfinite(scaled).reshape(n, h)).view(torch.float8_e4m3fn)
    if use_ue8m0:
        exp_bytes = (scale_inv.view(np.uint32) >> 23).astype(np.uint8)
        return data, torch.from_numpy(np.ascontiguousarray(exp_bytes).view(np.int32).reshape(n, s // 4))
    return data, torch.from_numpy(np.ascontiguousarray(scale_inv))


def ref_ll_dispatch(
    xs: Sequence[torch.Tensor],
    topk_idxs: Sequence[torch.Tensor],
    rank: int,
    num_experts: int,
    num_max_tokens: int,
    use_fp8: bool = False,
    round_scale: bool = False,
    use_ue8m0: bool = False,
    masked: Sequence[int] = (),
) -> RefLowLatencyDispatch:
    """Reference of ``low_latency_dispatch`` on ``rank`` from every rank's bf16 ``x`` and ``topk_idx``.

    Local expert ``e`` (global ``rank * L + e``) receives one row per (source, token, slot) that
    selects it, sources ascending, then tokens, then slots; sources in ``masked`` send nothing.
    """
    R = len(xs)
    L = num_experts // R
    M = num_max_tokens
    H = xs[0].shape[1]
    if use_fp8:
        casts = [ref_ll_cast_fp8(x, round_scale, use_ue8m0) for x in xs]
        recv_x = torch.zeros(L, R * M, H, dtype=torch.float8_e4m3fn)
        recv_scales = torch.zeros(L, R * M, casts[0][1].shape[1], dtype=casts[0][1].dtype)
    else:
        recv_x = torch.zeros(L, R * M, H, dtype=torch.bfloat16)
        recv_scales = None
    recv_count = torch.zeros(L, dtype=torch.int32)
    src_info = torch.zeros(L, R * M, dtype=torch.int32)
    layout_range = torch.zeros(L, R, dtype=torch.int64)
    for e in range(L):
        g = rank * L + e
        row = 0
        for s in range(R):
            begin = row
            if s not in masked:
                idx = topk_idxs[s]
                for t in range(idx.shape[0]):
                    for j in range(idx.shape[1]):
                        if int(idx[t, j]) != g:
                            continue
                        if use_fp8:
                            recv_x[e, row] = casts[s][0][t]
                            recv_scales[e, row] = casts[s][1][t]
                        else:
                            recv_x[e, row] = xs[s][t]
                        src_info[e, row] = t
                        row += 1
            layout_range[e, s] = (begin << 32) | (row - begin)
        recv_count[e] = row
    return RefLowLatencyDispatch(recv_x, recv_scales, recv_count, src_info, layout_range)


def ref_ll_combine(
    expert_out,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    num_experts: int,
    num_ranks: int,
    hidden: int,
    masked: Sequence[int] = (),
) -> torch.Tensor:
    """Reference of ``low_latency_combine`` for one rank's tokens (docs/semantics/deepep-api.md §6.3).

    ``expert_out(t, e)`` is the bf16 ``[H]`` row expert ``e`` produced for this rank's token ``t``.
    Per token: float32 ``acc = 0``; slots in order, skipping -1 and experts of masked ranks,
    ``acc = acc + f32(y) * w``; result ``bf16(acc)`` (zeros without a valid slot).
    """
    L = num_experts // num_ranks
    n, k = topk_idx.shape
    out = torch.zeros(n, hidden, dtype=torch.float32)
    for t in range(n):
        acc = torch.zeros(hidden, dtype=torch.float32)
        for j in range(k):
            e = int(topk_idx[t, j])
            if e < 0 or e // L in masked:
                continue
            acc = acc + expert_out(t, e).float() * topk_weights[t, j]
        out[t] = acc
    return out.to(torch.bfloat16)
