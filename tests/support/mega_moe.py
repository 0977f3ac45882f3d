"""MegaMoE's test cases (``tests/mega_moe``): shapes, weights, inputs and the symmetric buffers they run on.

Every rank generates *all* experts' weights from one seed (untransformed, so the reference sees
them as docs/semantics/mega-moe.md §2 states them), keeps its local slice, transforms it and calls the op; the
inputs (``x``, ``x_sf``, ``topk_idx``, ``topk_weights``) are all-gathered and
``reference.ref_mega_moe`` computes every rank's ``y`` in plain torch. Tolerances (docs/semantics/mega-moe.md §2):
``calc_diff < 1e-6`` (bf16) and ``< 1e-5`` (fp8×fp4). Token counts differ per rank and the last
rank of a multi-rank job has none; 20 % of slots are masked; routing is skewed (the last
``E/4`` experts receive nothing, a token may list an expert twice).
"""

from __future__ import annotations

import torch

import deepep_ascend as dea
from tests.support.buffer_helpers import coll
from tests.support.mpi_utils import gather_all, world
from tests.support.reference import mega_dequant_fp4_weights

E_PER_RANK, K, TMAX = 4, 3, 40
H_BF16, I_BF16 = 64, 32
H_FP8, I_FP8 = 128, 128
BF16 = torch.bfloat16


def _num_tokens(rank, size):
    if size > 1 and rank == size - 1:
        return 0
    return 17 + 7 * rank


def _routing(gen, t, num_experts):
    """Skewed: the last quarter of experts gets nothing; 20 % masked; duplicates allowed."""
    hot = max(1, num_experts - num_experts // 4)
    idx = torch.randint(0, hot, (t, K), generator=gen)
    idx[torch.rand(t, K, generator=gen) < 0.2] = -1
    w = torch.rand(t, K, generator=gen) + 0.25
    w[idx < 0] = 1e6  # ignored where idx = -1
    return idx, w


def expert_weights(kind, num_experts, hidden, inter, seed, width=None):
    """All experts' weights: (op weights of all experts, float32 untransformed for the reference)."""
    g = torch.Generator().manual_seed(seed)
    n1 = 2 * (width or inter)
    if kind == "bf16":
        w1 = (torch.randn(num_experts, n1, hidden, generator=g) / hidden ** 0.5).to(BF16)
        w2 = (torch.randn(num_experts, hidden, n1 // 2, generator=g) / inter ** 0.5).to(BF16)
        return (w1, w2), (w1.float(), w2.float())
    out, ref = [], []
    for n, k in ((n1, hidden), (hidden, n1 // 2)):
        data = torch.randint(-128, 128, (num_experts, n, k // 2), generator=g, dtype=torch.int8)
        sf_bytes = torch.randint(121, 125, (num_experts, n, k // 32), generator=g, dtype=torch.uint8)
        sf = sf_bytes.view(torch.int32)  # [E, n, k/128], four little-endian bytes per int
        out.append((data, sf))
        ref.append(mega_dequant_fp4_weights(data, sf))
    return tuple(out), tuple(ref)


def local_weights(kind, w, rank, el):
    """This rank's ``el`` experts of :func:`expert_weights`' op weights, untransformed (fp8: scales MN-major)."""
    sl = slice(rank * el, (rank + 1) * el)
    if kind == "bf16":
        return w[0][sl].contiguous(), w[1][sl].contiguous()
    mn = [dea.transform_sf_into_required_layout(s[sl].contiguous(), s.shape[1], 2 * d.shape[2],
                                                (1, 32), num_groups=el)
          for d, s in w]
    return (w[0][0][sl].contiguous(), mn[0]), (w[1][0][sl].contiguous(), mn[1])


def shared_weights(kind, hidden, inter, s, seed):
    """``s`` shared experts: (op weights ``(w1 [2·s·I, H], w2 [H, s·I])``, float32 ones for the reference)."""
    (w1, w2), (r1, r2) = expert_weights(kind, 1, hidden, inter, seed, width=s * inter)
    if kind == "bf16":
        return (w1[0], w2[0]), (r1[0], r2[0])
    return ((w1[0][0], w1[1][0]), (w2[0][0], w2[1][0])), (r1[0], r2[0])


class SymmBuffers:
    """A symmetric buffer per (kind, shared, backend), built once per test module (the ``env`` fixture)."""

    def __init__(self):
        self.bufs = {}

    def get(self, kind, shared, backend=None):
        key = (kind, shared, backend)
        if key not in self.bufs:
            comm = world()
            h, i = (H_BF16, I_BF16) if kind == "bf16" else (H_FP8, I_FP8)
            self.bufs[key] = coll(dea.get_symm_buffer_for_mega_moe, comm, E_PER_RANK * comm.Get_size(), TMAX, K, h,
                                  i, mma_type="bf16xbf16" if kind == "bf16" else "fp8xfp4",
                                  num_shared_experts=shared, backend=backend, what="get_symm_buffer_for_mega_moe")
        return self.bufs[key]


def fill(kind, buf, seed, rank, size):
    """Fill ``buf``'s input views with this rank's tokens (seeded by ``seed`` and the rank); returns their count."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    t = _num_tokens(rank, size)
    h = buf.hidden
    if kind == "bf16":
        buf.x[:t] = torch.randn(t, h, generator=g).to(BF16)
        x_sf = None
    else:
        buf.x[:t] = (torch.randn(t, h, generator=g) * 3).clamp(-448, 448).to(torch.float8_e4m3fn)
        x_sf = torch.randint(124, 130, (t, h // 32), generator=g, dtype=torch.uint8).view(torch.int32)
        buf.x_sf[:t] = x_sf
    idx, w = _routing(g, t, buf.num_experts)
    buf.topk_idx[:t] = idx
    buf.topk_weights[:t] = w
    return t


def gathered_inputs(buf, t, fp8):
    """Every rank's ``(x, x_sf or None, topk_idx, topk_weights)`` of its ``t`` tokens, as lists in rank order."""
    xs = gather_all(buf.x[:t])
    sfs = gather_all(buf.x_sf[:t]) if fp8 else [None] * len(xs)
    return xs, sfs, gather_all(buf.topk_idx[:t]), gather_all(buf.topk_weights[:t])


def call_op(kind, y, l1, l2, buf, stats=None, **kw):
    """``bf16_mega_moe`` or ``fp8_fp4_mega_moe`` by ``kind``."""
    fn = dea.bf16_mega_moe if kind == "bf16" else dea.fp8_fp4_mega_moe
    return fn(y, l1, l2, buf, stats, **kw)
