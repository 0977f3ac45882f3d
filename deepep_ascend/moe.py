"""A DeepSeek-style MoE layer with expert parallelism through :class:`deepep_ascend.Buffer`.

Built as DeepSeek-V2/V3 build theirs (``modeling_deepseek.py``: ``MoEGate``, ``DeepseekV3MoE``):

* :class:`MoEGate` — ``logits = x @ W_gate^T`` in float32; scores ``softmax`` (V2) or
  ``sigmoid`` (V3); optional group-limited routing (``n_group`` groups of experts, keep the best
  ``topk_group`` groups: a group scores its max (softmax) or the sum of its top-2 (sigmoid));
  optional selection bias (V3's ``e_score_correction_bias``: changes which experts are chosen,
  not their weights); top-k; weights = the chosen scores, renormalised if ``norm_topk_prob``,
  times ``routed_scaling_factor``. An optional Switch-style balance loss
  (``aux_loss_alpha · E · Σ_e f_e · P_e``) is left in ``gate.aux_loss`` during training.
* :class:`LocalExperts` — this rank's ``E / ep_size`` routed experts, SwiGLU MLPs
  ``w2 · (silu(w1 · x) ⊙ (w3 · x))``, stored stacked (``w1, w3 [L, I, H]``, ``w2 [L, H, I]``),
  computed on the received slots sorted by expert (the contiguous grouped-GEMM layout) with
  :mod:`deepep_ascend.grouped_gemm`'s m-/k-grouped BF16 GEMMs (or, ``experts_impl="loop"``, a
  float32 matmul per local expert); each row's outputs are weighted by its received top-k
  weights and summed over its local slots in float32.
* :class:`MoE` — gate → :func:`deepep_ascend.autograd.dispatch` (bf16 rows) → local experts →
  :func:`deepep_ascend.autograd.combine` → plus the optional shared expert (a plain SwiGLU MLP
  on every rank). Expert parameters exist only on their owner rank (expert ``e`` on EP rank
  ``e // L``); everything else is replicated.

Numerics: the layer input is cast to bf16 for the dispatch (DeepEP's BF16 path, and the
backward combine is bf16-only), experts compute in float32, each rank's weighted partial is
rounded to bf16 once, the combine sums the partials in float32 in ascending rank order and
rounds once more. Gradients take the same path backwards (bf16 on the wire, float32 inside).

Every forward and backward issues the same two collective ``Buffer`` calls on every rank of the
EP group, in the same order, whatever the routing (a rank with no tokens still calls them).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from . import autograd as ep_autograd

try:  # DeepGEMM-aligned m-/k-grouped GEMMs (deepep_ascend.grouped_gemm), when present
    from . import grouped_gemm as _gg
except ImportError:  # pragma: no cover - older checkouts
    _gg = None

__all__ = ["LocalExperts", "MoE", "MoEGate", "SwiGLU", "expert_init_generator", "is_expert_param"]

_BF16 = torch.bfloat16


def expert_init_generator(seed: int, expert_id: int) -> torch.Generator:
    """The generator that initialises global expert ``expert_id`` (independent of the EP layout)."""
    return torch.Generator().manual_seed(int(seed) * 1_000_003 + int(expert_id) + 1)


def is_expert_param(name: str) -> bool:
    """True for parameter / buffer names of routed experts (owned by one EP rank), from ``state_dict()`` keys."""
    return ".experts." in f".{name}"


class SwiGLU(nn.Module):
    """``w2(silu(w1 x) * w3 x)`` without biases (DeepSeek's MLP / shared expert)."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.w1 = nn.Linear(hidden, intermediate, bias=False)
        self.w3 = nn.Linear(hidden, intermediate, bias=False)
        self.w2 = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoEGate(nn.Module):
    """Top-k router (DeepSeek ``MoEGate``). ``forward(x [N, H])`` → ``(topk_idx [N, K] int64,
    topk_weights [N, K] float32)``; ``topk_weights`` is differentiable w.r.t. ``x`` and ``weight``.

    Args:
        hidden, num_experts, top_k: sizes.
        score_func: ``"softmax"`` or ``"sigmoid"``.
        n_group, topk_group: group-limited routing (``n_group`` divides ``num_experts``; 1 = off).
        routed_scaling_factor: multiplies the weights.
        norm_topk_prob: renormalise the chosen scores to sum to 1 (before scaling) when ``top_k > 1``.
        use_selection_bias: add V3's ``e_score_correction_bias`` (a buffer, zeros) to the scores
            used for choosing experts only.
        aux_loss_alpha: > 0 stores a balance loss in ``self.aux_loss`` when training.
    """

    def __init__(self, hidden: int, num_experts: int, top_k: int, score_func: str = "softmax", n_group: int = 1,
                 topk_group: int = 1, routed_scaling_factor: float = 1.0, norm_topk_prob: bool = True,
                 use_selection_bias: bool = False, aux_loss_alpha: float = 0.0):
        super().__init__()
        if score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"MoEGate: score_func must be 'softmax' or 'sigmoid', got {score_func!r}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"MoEGate: top_k={top_k} must lie in [1, num_experts={num_experts}]")
        if n_group < 1 or num_experts % n_group or not 1 <= topk_group <= n_group:
            raise ValueError(f"MoEGate: n_group={n_group} must divide num_experts={num_experts} and "
                             f"1 <= topk_group={topk_group} <= n_group")
        if n_group > 1 and top_k > topk_group * (num_experts // n_group):
            raise ValueError(f"MoEGate: top_k={top_k} exceeds the experts of topk_group={topk_group} groups")
        self.num_experts, self.top_k, self.score_func = num_experts, top_k, score_func
        self.n_group, self.topk_group = n_group, topk_group
        self.routed_scaling_factor, self.norm_topk_prob = float(routed_scaling_factor), norm_topk_prob
        self.aux_loss_alpha = float(aux_loss_alpha)
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if use_selection_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(num_experts))
        else:
            self.e_score_correction_bias = None
        self.aux_loss = None

    def forward(self, x: torch.Tensor):
        n = x.size(0)
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.softmax(-1) if self.score_func == "softmax" else logits.sigmoid()
        choice = scores.detach()
        if self.e_score_correction_bias is not None:
            choice = choice + self.e_score_correction_bias
        if self.n_group > 1:
            grouped = choice.view(n, self.n_group, self.num_experts // self.n_group)
            if self.score_func == "softmax":
                group_scores = grouped.amax(-1)
            else:
                group_scores = grouped.topk(min(2, grouped.size(-1)), dim=-1).values.sum(-1)
            group_idx = group_scores.topk(self.topk_group, dim=-1).indices
            keep = torch.zeros(n, self.n_group, dtype=torch.bool).scatter_(1, group_idx, True)
            choice = choice.masked_fill(~keep.repeat_interleave(grouped.size(-1), dim=1), float("-inf"))
        topk_idx = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, topk_idx)
        if self.norm_topk_prob and self.top_k > 1:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        weights = weights * self.routed_scaling_factor
        self.aux_loss = None
        if self.training and self.aux_loss_alpha > 0 and n > 0:
            frac = torch.bincount(topk_idx.reshape(-1), minlength=self.num_experts).float() / (n * self.top_k)
            prob = (scores / scores.sum(-1, keepdim=True)).mean(0)
            self.aux_loss = self.aux_loss_alpha * self.num_experts * (frac * prob).sum()
        return topk_idx.contiguous(), weights.to(torch.float32).contiguous()


class _GroupedLinear(torch.autograd.Function):
    """``d[rows of g] = a[rows of g] @ w[g].T`` for the m-grouped contiguous psum layout, differentiable.

    Forward: ``grouped_gemm.m_grouped_bf16_gemm_nt_contiguous`` (bf16 operands, float32
    accumulation, bf16 out); backward: ``m_grouped_bf16_gemm_nn_contiguous`` for ``a`` and
    ``k_grouped_bf16_gemm_tn_contiguous`` (float32) for ``w`` — DeepGEMM's three training GEMMs.
    ``a`` bf16 ``[M, K]``, ``w`` float32 master weights ``[G, N, K]``, ``ends`` int32 ``[G]`` psum ends.
    """

    @staticmethod
    def forward(ctx, a, w, ends):
        wb = w.detach().to(_BF16)
        d = torch.zeros(a.size(0), w.size(1), dtype=_BF16)
        _gg.m_grouped_bf16_gemm_nt_contiguous(a.detach(), wb, d, ends, use_psum_layout=True)
        ctx.save_for_backward(a.detach(), wb, ends)
        return d

    @staticmethod
    def backward(ctx, grad_d):
        a, wb, ends = ctx.saved_tensors
        g = grad_d.to(_BF16).contiguous()
        grad_a = torch.zeros_like(a)
        _gg.m_grouped_bf16_gemm_nn_contiguous(g, wb, grad_a, ends, use_psum_layout=True)
        grad_w = torch.zeros(wb.shape, dtype=torch.float32)
        _gg.k_grouped_bf16_gemm_tn_contiguous(g, a, grad_w, None, ends, use_psum_layout=True)
        return grad_a, grad_w, None


class LocalExperts(nn.Module):
    """The routed experts of one EP rank: global ids ``[first, first + num_local)``, SwiGLU, stacked weights.

    ``forward(recv_x [M, H] bf16, recv_topk_idx [M, K] local ids / -1, recv_topk_weights [M, K])``
    returns ``[M, H]`` float32: for each row, ``Σ_k w_k · expert_{idx_k}(x)`` over its local slots.

    ``impl``: ``"grouped"`` runs the three GEMMs of each direction as DeepGEMM-style m-grouped
    (forward, input gradient) and k-grouped (weight gradient) BF16 GEMMs from
    :mod:`deepep_ascend.grouped_gemm` on the received slots laid out contiguously per expert at
    ``get_mk_alignment_for_contiguous_layout()``-aligned offsets (bf16 operands and activations,
    float32 accumulation and master weights); ``"loop"`` runs a float32 matmul per local expert.
    Default: ``"grouped"`` when the module exists.
    """

    def __init__(self, num_local: int, hidden: int, intermediate: int, first_expert: int = 0, seed: int = 0,
                 impl: str | None = None):
        super().__init__()
        impl = impl or ("grouped" if _gg is not None else "loop")
        if impl not in ("grouped", "loop") or (impl == "grouped" and _gg is None):
            raise ValueError(f"LocalExperts: impl must be 'loop' or 'grouped' (grouped_gemm available: "
                             f"{_gg is not None}), got {impl!r}")
        self.impl = impl
        self.num_local, self.first_expert = num_local, first_expert
        w1 = torch.empty(num_local, intermediate, hidden)
        w3 = torch.empty(num_local, intermediate, hidden)
        w2 = torch.empty(num_local, hidden, intermediate)
        for i in range(num_local):  # nn.Linear's default init, from the global expert's own generator
            g = expert_init_generator(seed, first_expert + i)
            b1, b2 = 1 / math.sqrt(hidden), 1 / math.sqrt(intermediate)
            w1[i].uniform_(-b1, b1, generator=g)
            w3[i].uniform_(-b1, b1, generator=g)
            w2[i].uniform_(-b2, b2, generator=g)
        self.w1, self.w3, self.w2 = nn.Parameter(w1), nn.Parameter(w3), nn.Parameter(w2)

    def forward(self, recv_x: torch.Tensor, recv_topk_idx: torch.Tensor, recv_topk_weights: torch.Tensor):
        m, k = recv_topk_idx.shape
        flat = recv_topk_idx.reshape(-1)
        counts = torch.bincount(flat[flat >= 0], minlength=self.num_local).tolist()
        # Slots sorted by local expert (stable: then by row, slot); the -1 slots sort first.
        order = torch.argsort(flat, stable=True)[flat.numel() - sum(counts):]
        rows = torch.div(order, k, rounding_mode="floor")
        ws = recv_topk_weights.reshape(-1).index_select(0, order)
        if self.impl == "grouped":
            y = self._grouped(recv_x.index_select(0, rows).to(_BF16), counts)
        else:
            xs = recv_x.index_select(0, rows).float()
            ys = [F.linear(F.silu(F.linear(seg, self.w1[e])) * F.linear(seg, self.w3[e]), self.w2[e])
                  for e, seg in enumerate(xs.split(counts))]  # every expert, even with 0 rows: zero grads, not None
            y = torch.cat(ys)
        y = y * ws.unsqueeze(1)
        return torch.zeros(m, recv_x.size(1), dtype=torch.float32).index_add(0, rows, y)

    def _grouped(self, xs: torch.Tensor, counts: list) -> torch.Tensor:
        """SwiGLU of ``xs`` (bf16 rows sorted by expert, ``counts`` per expert) with grouped GEMMs; float32 out."""
        align = _gg.get_mk_alignment_for_contiguous_layout()
        starts, ends, end = [], [], 0
        for c in counts:
            start = -(-end // align) * align
            starts.append(start)
            end = start + c
            ends.append(end)
        pos = torch.cat([torch.arange(s, s + c) for s, c in zip(starts, counts)]) if counts else \
            torch.empty(0, dtype=torch.int64)
        ends_t = torch.tensor(ends, dtype=torch.int32)
        a = xs.new_zeros(end, xs.size(1)).index_copy(0, pos, xs)
        h1 = _GroupedLinear.apply(a, self.w1, ends_t)
        h3 = _GroupedLinear.apply(a, self.w3, ends_t)
        act = (F.silu(h1.float()) * h3.float()).to(_BF16)
        return _GroupedLinear.apply(act, self.w2, ends_t).index_select(0, pos).float()


class MoE(nn.Module):
    """DeepSeek MoE block over expert parallelism: ``forward(x [..., H])`` → ``[..., H]`` (``x``'s dtype).

    Args:
        buffer: a normal-mode :class:`deepep_ascend.Buffer` over the EP group (shared by layers).
        hidden: model width ``H``; intermediate: routed expert width ``I``.
        num_experts: ``E``, a multiple of the EP size; top_k: experts per token.
        num_shared_experts: 0 = no shared expert, else one SwiGLU of width ``num_shared_experts * I``.
        seed: expert ``e`` is initialised from :func:`expert_init_generator` ``(seed, e)``, so the
            model does not depend on the EP size; the gate and the shared expert use torch's
            global RNG (seed it identically on every rank).
        experts_impl: ``"grouped"`` (grouped GEMMs, the default when ``grouped_gemm`` exists) or
            ``"loop"`` (float32, one matmul per local expert); see :class:`LocalExperts`.
        **gate_kwargs: :class:`MoEGate` options (``score_func``, ``n_group``, ``topk_group``,
            ``routed_scaling_factor``, ``norm_topk_prob``, ``use_selection_bias``, ``aux_loss_alpha``).
    Attributes:
        last_topk_idx: ``[N, K]`` routing of the last forward (for routing traces).
    """

    def __init__(self, buffer, hidden: int, intermediate: int, num_experts: int, top_k: int,
                 num_shared_experts: int = 0, seed: int = 0, experts_impl: str | None = None, **gate_kwargs):
        super().__init__()
        ep_size, ep_rank = buffer.group_size, buffer.rank
        if num_experts % ep_size:
            raise ValueError(f"MoE: num_experts={num_experts} must be a multiple of the EP size {ep_size}")
        self.buffer = buffer
        self.hidden, self.num_experts, self.top_k = hidden, num_experts, top_k
        self.num_local_experts = num_experts // ep_size
        self.gate = MoEGate(hidden, num_experts, top_k, **gate_kwargs)
        self.experts = LocalExperts(self.num_local_experts, hidden, intermediate,
                                    first_expert=ep_rank * self.num_local_experts, seed=seed, impl=experts_impl)
        self.shared_experts = SwiGLU(hidden, intermediate * num_shared_experts) if num_shared_experts else None
        self.last_topk_idx = None

    @property
    def aux_loss(self):
        return self.gate.aux_loss

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        h = x.reshape(-1, self.hidden)
        topk_idx, topk_weights = self.gate(h)
        self.last_topk_idx = topk_idx
        recv_x, recv_idx, recv_w, _, handle = ep_autograd.dispatch(self.buffer, h.to(_BF16), topk_idx, topk_weights,
                                                                   self.num_experts)
        y = self.experts(recv_x, recv_idx, recv_w)
        out, _ = ep_autograd.combine(self.buffer, y.to(_BF16), handle)
        out = out.to(x.dtype)
        if self.shared_experts is not None:
            out = out + self.shared_experts(h)
        return out.view(shape)
