"""An independent pure-torch reference of ``EPBuffer.dispatch`` / ``combine`` (docs/semantics/deepep-api.md §13),
built from every rank's inputs as an all-to-all would deliver them (in the spirit of DeepEP's ``refs.py``):
received rows sorted by ``src_token_global_idx``, local expert ids, and the combine arithmetic token by token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BF16 = torch.bfloat16


@dataclass
class RefEP:
    src: torch.Tensor  # [n] int64 src_token_global_idx, ascending
    x: torch.Tensor  # [n, ...] rows of x (bytes or typed)
    sf: torch.Tensor | None
    topk_idx: torch.Tensor  # [n, K] local expert ids, -1 elsewhere
    weights: torch.Tensor | None  # [n, K], 0 where not local
    per_rank: list  # rows received from each rank
    counts: list  # (token, local expert) pairs per local expert


def ref_dispatch(xs, sfs, topk_idxs, weights, rank: int, num_experts: int, max_tokens: int) -> RefEP:
    """What ``rank`` receives: ``xs[s]``, ``sfs[s]``, ``topk_idxs[s]``, ``weights[s]`` are rank ``s``'s inputs."""
    R = len(xs)
    L = num_experts // R
    src, rows, sf_rows, ids, ws, per_rank = [], [], [], [], [], []
    for s in range(R):
        local = (topk_idxs[s] >= rank * L) & (topk_idxs[s] < (rank + 1) * L)
        tokens = torch.nonzero(local.any(dim=1)).squeeze(1)
        per_rank.append(tokens.numel())
        src.append(s * max_tokens + tokens)
        rows.append(xs[s][tokens])
        if sfs is not None:
            sf_rows.append(sfs[s][tokens])
        ids.append(torch.where(local[tokens], topk_idxs[s][tokens] - rank * L, -1))
        if weights is not None:
            ws.append(torch.where(local[tokens], weights[s][tokens], 0.0))
    recv_ids = torch.cat(ids)
    counts = [int((recv_ids == e).sum()) for e in range(L)]
    return RefEP(torch.cat(src), torch.cat(rows), torch.cat(sf_rows) if sfs is not None else None, recv_ids,
                 torch.cat(ws) if weights is not None else None, per_rank, counts)


def ref_dst_slots(topk_idx: torch.Tensor, num_experts: int, num_ranks: int,
                  rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dst_buffer_slot_idx, dst_gsge_idx)`` ``[N, K]`` int32 of ``rank``'s ``topk_idx``, token by token, slot by
    slot: at a token's first slot on each rank its place among the tokens sent there, and, for another rank, the
    index of that write among ``rank``'s writes to other ranks; -1 at every other slot."""
    n, k = topk_idx.shape
    L = num_experts // num_ranks
    slots, writes = torch.full((n, k), -1, dtype=torch.int32), torch.full((n, k), -1, dtype=torch.int32)
    sent_to, remote_writes = [0] * num_ranks, 0
    for t in range(n):
        seen = set()
        for j in range(k):
            e = int(topk_idx[t, j])
            if e < 0 or e // L in seen:
                continue
            r = e // L
            seen.add(r)
            slots[t, j] = sent_to[r]
            sent_to[r] += 1
            if r != rank:
                writes[t, j] = remote_writes
                remote_writes += 1
    return slots, writes


def ref_combine(y: torch.Tensor, topk_idx: torch.Tensor, num_experts: int, num_ranks: int, bias,
                num_nodes: int = 1, reduce_in_rank: bool = True) -> torch.Tensor:
    """DeepEP V2.5's combine of one origin rank's tokens, element by element in float32.

    ``y`` ``[N, K, H]`` bf16: the expert output of each (token, slot). Each rank first sums its slots of
    a token in slot order (float32, rounded to bf16). On one node the origin then adds those rank rows
    to ``f32(bias0) + f32(bias1)`` in the order of each rank's last slot in the token's row, rounding
    once. Across nodes (hybrid mode) each node first sums its ranks' rows in that order (float32 from
    +0.0, rounded to bf16), and the origin adds the node rows in the order of each node's last slot.
    Without ``reduce_in_rank`` (DeepEP's ``allow_multiple_reduction=False`` on the expanded layout) the
    origin adds every slot's row in slot order, one rounding in all.
    """
    N, K, H = y.shape
    L = num_experts // num_ranks
    out = torch.empty(N, H, dtype=BF16)
    b0, b1 = bias if isinstance(bias, tuple) else (bias, None)
    for t in range(N):
        acc = torch.zeros(H)
        if b0 is not None:
            acc = b0[t].float() + (b1[t].float() if b1 is not None else 0.0)
        elif b1 is not None:
            acc = b1[t].float() + 0.0
        ranks = [int(e) // L if e >= 0 else -1 for e in topk_idx[t].tolist()]
        last = {}
        for j, r in enumerate(ranks):
            if r >= 0:
                last[r] = j
        if not reduce_in_rank:
            for j, r in enumerate(ranks):
                if r >= 0:
                    acc += y[t, j].float()
            out[t] = acc.to(BF16)
            continue
        rank_rows = {}
        for r in last:
            part = torch.zeros(H)
            for j, rr in enumerate(ranks):
                if rr == r:
                    part += y[t, j].float()
            rank_rows[r] = part.to(BF16)
        if num_nodes > 1:
            per_node = num_ranks // num_nodes
            node_rows, node_last = {}, {}
            for r in sorted(last, key=last.get):
                g = r // per_node
                node_rows[g] = node_rows.get(g, torch.zeros(H)) + rank_rows[r].float()
                node_last[g] = max(node_last.get(g, -1), last[r])
            rows = [(node_last[g], node_rows[g].to(BF16)) for g in node_rows]
        else:
            rows = [(last[r], rank_rows[r]) for r in last]
        for _, row in sorted(rows, key=lambda item: item[0]):
            acc += row.float()
        out[t] = acc.to(BF16)
    return out


def pre_combine_data(src_global_idx: torch.Tensor, num_topk: int, hidden: int, seed: int) -> torch.Tensor:
    """``[n, K, H]`` bf16 expert outputs that depend only on the source token's global index and the slot
    (every rank can make the same values for the same token). Slots ``j % 3 == 0`` hold ``+B``, slots
    ``j % 3 == 2`` hold ``-B`` (``B = 2^24 (1 + m/8)`` per token), the others small values: float32 sums
    then cancel or round depending on which terms meet first, so the order of the additions shows in the
    bits at every level (slots in a rank, ranks in a node, nodes at the origin)."""
    seeds = (src_global_idx[:, None] * num_topk + torch.arange(num_topk)[None, :]).to(torch.float64)
    cols = torch.arange(1, hidden + 1, dtype=torch.float64)
    small = torch.sin((seeds[..., None] * 0.61803 + seed) * cols * 0.37)
    big = (2.0 ** 24) * (1 + (src_global_idx * 13 % 7).to(torch.float64) / 8)[:, None, None].expand_as(small)
    lane = torch.arange(num_topk)[None, :, None] % 3
    return torch.where(lane == 0, big, torch.where(lane == 2, -big, small)).to(BF16)
