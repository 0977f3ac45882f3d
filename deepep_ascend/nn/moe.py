"""A DeepSeek-style MoE layer with expert parallelism through :class:`deepep_ascend.Buffer` or
:class:`deepep_ascend.EPBuffer`.

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
  :mod:`deepep_ascend.gemm.grouped`'s m-/k-grouped BF16 GEMMs (or, ``experts_impl="loop"``, a
  float32 matmul per local expert); each row's outputs are weighted by its received top-k
  weights and summed over its local slots in float32.
* :class:`MoE` — gate → :func:`deepep_ascend.nn.autograd.dispatch` (bf16 rows) → local experts →
  :func:`deepep_ascend.nn.autograd.combine` → plus the optional shared expert (a plain SwiGLU MLP
  on every rank). Expert parameters exist only on their owner rank (expert ``e`` on EP rank
  ``e // L``); everything else is replicated.
* The low-latency path (``MoE(..., mode="low_latency", num_max_dispatch_tokens_per_rank=M)``, the
  default when the Buffer was built with ``low_latency_mode=True``): gate →
  :func:`deepep_ascend.nn.autograd.low_latency_dispatch` (BF16) → the local experts on DeepEP's
  packed ``[L, R·M, H]`` layout, rows ``[0, recv_count[e])`` of expert ``e`` valid
  (:meth:`LocalExperts.forward_packed`: the masked grouped GEMM, as DeepEP's LL kernels feed
  DeepGEMM, or a per-expert loop) → :func:`deepep_ascend.nn.autograd.low_latency_combine`, which
  applies the gate's top-k weights itself → plus the shared expert.
* The expanded path (``mode="expanded"``, the only one on an :class:`deepep_ascend.EPBuffer`): gate →
  :func:`deepep_ascend.nn.autograd.ep_dispatch` (bf16, ``do_expand=True``, ``do_zero_padding=True``)
  → the local experts on DeepEP V2.5's expanded layout, one row per (token, local expert) grouped by
  expert, whose prefix sums ``handle.psum_num_recv_tokens_per_expert`` are the grouped GEMMs' psum
  layout as they are (:meth:`LocalExperts.forward_expanded`: no sort, no copy into another layout) →
  each row times its received weight, rounded to bf16 → :func:`deepep_ascend.nn.autograd.ep_combine`
  → plus the shared expert.

Numerics, normal path: the layer input is cast to bf16 for the dispatch (DeepEP's BF16 path, and
the backward combine is bf16-only), experts compute in float32, each rank's weighted partial is
rounded to bf16 once, the combine sums the partials in float32 in ascending rank order and
rounds once more. Expanded path: each (token, local expert) row's weighted output is rounded to
bf16, the receiving rank sums a token's rows in top-k slot order in float32 and rounds, the origin
adds the ranks' rows in float32 in the order of each rank's last top-k slot and rounds once more
(DeepEP V2.5's combine, docs/semantics/deepep-api.md §13.5). With ``top_k = 1`` (one term per sum)
the normal and expanded paths give the same bits; otherwise they differ by those roundings and
orders. Low-latency path: each (token, slot)'s expert output is rounded to bf16 and
the combine sums ``f32(y_j) · w_j`` in float32 in top-k order, rounding once. Gradients take the
same paths backwards (bf16 on the wire, float32 inside).

Every forward and backward issues the same collective buffer calls on every rank of the EP
group, in the same order, whatever the routing (a rank with no tokens still calls them): two
per direction on the normal and expanded paths; on the low-latency path two forward and three
backward (an LL combine for dispatch's backward; two LL dispatches and one narrow LL combine for
combine's, see :mod:`deepep_ascend.nn.autograd`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..ep.buffer import Buffer
from ..ep.ep_buffer import EPBuffer
from ..ordering import stable_argsort
from ..rounding import align as align_up
from . import autograd as ep_autograd

try:  # DeepGEMM-aligned m-/k-grouped GEMMs (deepep_ascend.gemm.grouped), when present
    from ..gemm import grouped as _gg
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
    Logits, scores and weights are computed in float32 (DeepSeek's choice), under ``torch.autocast`` too, or in
    float64 when ``x`` or ``weight`` is float64 (then ``topk_weights`` is float64 too: for ``gradcheck``).

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

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = x.size(0)
        dt = torch.promote_types(torch.promote_types(x.dtype, self.weight.dtype), torch.float32)
        with torch.autocast(x.device.type, enabled=False):  # float32 logits under autocast too (the docstring's)
            logits = F.linear(x.to(dt), self.weight.to(dt))
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
        return topk_idx.contiguous(), weights.contiguous()


class _GroupedLinear(torch.autograd.Function):
    """``d[rows of g] = a[rows of g] @ w[g].T`` for the m-grouped contiguous psum layout, differentiable.

    Forward: ``grouped.m_grouped_bf16_gemm_nt_contiguous`` (bf16 operands, float32
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
    @ep_autograd.first_order_only
    def backward(ctx, grad_d):
        a, wb, ends = ctx.saved_tensors
        g = grad_d.to(_BF16).contiguous()
        grad_a = torch.zeros_like(a)
        _gg.m_grouped_bf16_gemm_nn_contiguous(g, wb, grad_a, ends, use_psum_layout=True)
        grad_w = torch.zeros(wb.shape, dtype=torch.float32)
        _gg.k_grouped_bf16_gemm_tn_contiguous(g, a, grad_w, None, ends, use_psum_layout=True)
        return grad_a, grad_w, None


class _MaskedLinear(torch.autograd.Function):
    """``d[g, :c_g] = a[g, :c_g] @ w[g].T`` on the masked layout (DeepEP's low-latency output), differentiable.

    Forward: ``grouped.m_grouped_bf16_gemm_nt_masked`` (bf16 operands, float32 accumulation,
    bf16 out; rows past ``c_g`` are 0). Backward: the same masked GEMM against ``w`` transposed
    for ``a`` (``grad_a[g, :c_g] = grad_d[g, :c_g] @ w[g]``, padding rows 0) and the k-grouped
    ``k_grouped_bf16_gemm_tn_contiguous`` (float32) over the valid rows for ``w``.
    ``a`` bf16 ``[G, Mmax, K]``, ``w`` float32 master weights ``[G, N, K]``, ``masked_m`` int32 ``[G]``.
    """

    @staticmethod
    def forward(ctx, a, w, masked_m):
        counts = masked_m.tolist()
        wb = w.detach().to(_BF16)
        d = torch.zeros(a.size(0), a.size(1), w.size(1), dtype=_BF16)
        _gg.m_grouped_bf16_gemm_nt_masked(a.detach(), wb, d, masked_m, max(counts, default=0))
        ctx.save_for_backward(a.detach(), wb, masked_m)
        return d

    @staticmethod
    @ep_autograd.first_order_only
    def backward(ctx, grad_d):
        a, wb, masked_m = ctx.saved_tensors
        counts = masked_m.tolist()
        valid = torch.arange(a.size(1)).unsqueeze(0) < masked_m.unsqueeze(1)  # [G, Mmax]
        g = grad_d.to(_BF16).contiguous()  # rows past masked_m are read by neither GEMM
        grad_a = torch.zeros_like(a)
        _gg.m_grouped_bf16_gemm_nt_masked(g, wb.transpose(1, 2).contiguous(), grad_a, masked_m,
                                          max(counts, default=0))
        grad_w = torch.zeros(wb.shape, dtype=torch.float32)
        _gg.k_grouped_bf16_gemm_tn_contiguous(g[valid], a[valid], grad_w, counts, None)
        return grad_a, grad_w, None


class LocalExperts(nn.Module):
    """The routed experts of one EP rank: global ids ``[first, first + num_local)``, SwiGLU, stacked weights.

    ``forward(recv_x [M, H] bf16, recv_topk_idx [M, K] local ids / -1, recv_topk_weights [M, K])``
    (normal dispatch's output) returns ``[M, H]`` float32: for each row, ``Σ_k w_k · expert_{idx_k}(x)``
    over its local slots. :meth:`forward_packed` takes low-latency dispatch's packed layout instead,
    :meth:`forward_expanded` ``EPBuffer``'s expanded layout.

    ``impl``: ``"grouped"`` runs the three GEMMs of each direction as DeepGEMM-style grouped BF16
    GEMMs from :mod:`deepep_ascend.gemm.grouped` (bf16 operands and activations, float32
    accumulation and master weights): in :meth:`forward`, m-grouped contiguous GEMMs (forward,
    input gradient) on the received slots laid out per expert at
    ``get_mk_alignment_for_contiguous_layout()``-aligned offsets; in :meth:`forward_packed`,
    m-grouped masked GEMMs straight on the packed layout; k-grouped GEMMs for the weight
    gradients in both. ``"loop"`` runs a matmul per local expert in float32 (float64 if the
    weights and input are float64). Default: ``"grouped"`` when the module exists.
    """

    def __init__(self, num_local: int, hidden: int, intermediate: int, first_expert: int = 0, seed: int = 0,
                 impl: str | None = None):
        super().__init__()
        impl = impl or ("grouped" if _gg is not None else "loop")
        if impl not in ("grouped", "loop") or (impl == "grouped" and _gg is None):
            raise ValueError(f"LocalExperts: impl must be 'loop' or 'grouped' (grouped GEMMs available: "
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

    def _loop_dtype(self, x: torch.Tensor) -> torch.dtype:
        """The ``"loop"`` path's compute dtype: float32, or float64 with float64 input or weights."""
        return torch.promote_types(torch.promote_types(x.dtype, self.w1.dtype), torch.float32)

    def _swiglu(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Local expert ``e`` on rows ``x`` (the ``"loop"`` path; any row count, 0 included)."""
        w1, w3, w2 = (w[e].to(x.dtype) for w in (self.w1, self.w3, self.w2))
        return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)

    def forward(self, recv_x: torch.Tensor, recv_topk_idx: torch.Tensor,
                recv_topk_weights: torch.Tensor) -> torch.Tensor:
        m, k = recv_topk_idx.shape
        flat = recv_topk_idx.reshape(-1)
        counts = torch.bincount(flat[flat >= 0], minlength=self.num_local).tolist()
        # Slots sorted by local expert (stable: then by row, slot); the -1 slots sort first.
        order = stable_argsort(flat, -1, self.num_local)[flat.numel() - sum(counts):]
        rows = torch.div(order, k, rounding_mode="floor")
        ws = recv_topk_weights.reshape(-1).index_select(0, order)
        if self.impl == "grouped":
            y = self._grouped(recv_x.index_select(0, rows).to(_BF16), counts)
        else:
            xs = recv_x.index_select(0, rows).to(self._loop_dtype(recv_x))
            # every expert, even with 0 rows: zero gradients, not None
            y = torch.cat([self._swiglu(e, seg) for e, seg in enumerate(xs.split(counts))])
        y = y * ws.unsqueeze(1)
        return torch.zeros(m, recv_x.size(1), dtype=y.dtype).index_add(0, rows, y)

    def forward_packed(self, recv_x: torch.Tensor, recv_count: torch.Tensor) -> torch.Tensor:
        """The experts on low-latency dispatch's packed layout, unweighted (the LL combine weights).

        Args:
            recv_x: ``[L, Mmax, H]`` (bf16 from :func:`deepep_ascend.nn.autograd.low_latency_dispatch`,
                ``Mmax = R·M``); rows ``[0, recv_count[e])`` of local expert ``e`` are its tokens.
            recv_count: ``[L]`` int32 valid rows per local expert.
        Returns:
            ``[L, Mmax, H]`` float32 (float64 on the float64 ``"loop"`` path): row ``p < recv_count[e]``
            is ``expert_e(recv_x[e, p])``; padding rows are 0 and get no gradient.
        Raises:
            ValueError: ``recv_x`` not ``[num_local, Mmax, H]`` or ``recv_count`` not ``[num_local]``.
        """
        num_local, mmax, _ = recv_x.shape
        if num_local != self.num_local or recv_count.shape != (num_local,):
            raise ValueError(f"LocalExperts.forward_packed: expected recv_x [{self.num_local}, Mmax, H] and "
                             f"recv_count [{self.num_local}], got {tuple(recv_x.shape)} and {tuple(recv_count.shape)}")
        if self.impl == "grouped":  # padding rows: silu(0) * 0 = 0 through every GEMM
            return self._grouped_swiglu(_MaskedLinear, recv_x.to(_BF16), recv_count.to(torch.int32)).float()
        xs = recv_x.to(self._loop_dtype(recv_x))
        # One matmul chain per local expert on its valid rows, zero-padded back to Mmax rows.
        return torch.stack([F.pad(self._swiglu(e, xs[e, :c]), (0, 0, 0, mmax - c))
                            for e, c in enumerate(recv_count.tolist())])

    def forward_expanded(self, recv_x: torch.Tensor, recv_topk_weights: torch.Tensor,
                         psum_num_recv_tokens_per_expert: torch.Tensor, expert_alignment: int) -> torch.Tensor:
        """The experts on ``EPBuffer.dispatch``'s expanded layout, each row times its weight.

        Local expert ``e``'s rows are ``[align(psum[e-1], expert_alignment), psum[e])`` (``psum[-1] = 0``),
        DeepGEMM's psum layout: the ``"grouped"`` path hands ``psum`` to the m-/k-grouped GEMMs as it is
        (``use_psum_layout=True``), the ``"loop"`` path slices each expert's rows.

        Args:
            recv_x: ``[rows, H]`` (bf16 from :func:`deepep_ascend.nn.autograd.ep_dispatch` with ``do_expand=True``).
            recv_topk_weights: ``[rows]`` float32, each row's top-k weight (0 in alignment gaps: dispatch
                with ``do_zero_padding=True``, since gap rows are multiplied by it).
            psum_num_recv_tokens_per_expert: ``[num_local]`` int32, the handle's field of that name.
            expert_alignment: the dispatch's ``expert_alignment``; the ``"grouped"`` path needs it equal to
                ``gemm.grouped.get_mk_alignment_for_contiguous_layout()`` (the GEMMs' psum rule).
        Returns:
            ``[rows, H]`` float32 (float64 on the float64 ``"loop"`` path): row ``p`` of expert ``e`` is
            ``recv_topk_weights[p] · expert_e(recv_x[p])``; gap rows are 0.
        Raises:
            ValueError: shapes that do not match ``[rows, H]`` / ``[rows]`` / ``[num_local]``, or (grouped)
                an ``expert_alignment`` other than the GEMMs' alignment.
        """
        rows = recv_x.size(0)
        psum = psum_num_recv_tokens_per_expert
        if recv_x.dim() != 2 or recv_topk_weights.shape != (rows,) or psum.shape != (self.num_local,):
            raise ValueError(f"LocalExperts.forward_expanded: expected recv_x [rows, H], recv_topk_weights [rows] and "
                             f"psum_num_recv_tokens_per_expert [{self.num_local}], got {tuple(recv_x.shape)}, "
                             f"{tuple(recv_topk_weights.shape)} and {tuple(psum.shape)}")
        if self.impl == "grouped":
            align = _gg.get_mk_alignment_for_contiguous_layout()
            if expert_alignment != align:
                raise ValueError(f"LocalExperts.forward_expanded: expert_alignment={expert_alignment} must equal the "
                                 f"grouped GEMMs' get_mk_alignment_for_contiguous_layout()={align}")
            y = self._grouped_swiglu(_GroupedLinear, recv_x.to(_BF16), psum.to(torch.int32)).float()
        else:
            xs = recv_x.to(self._loop_dtype(recv_x))
            ends = psum.tolist()
            starts = [0] + [align_up(end, expert_alignment) for end in ends[:-1]]
            pos = torch.cat([torch.arange(s, e) for s, e in zip(starts, ends)]) if ends else \
                torch.empty(0, dtype=torch.int64)
            # every expert, even with 0 rows: zero gradients, not None
            segs = torch.cat([self._swiglu(e, xs[s:t]) for e, (s, t) in enumerate(zip(starts, ends))])
            y = xs.new_zeros(rows, xs.size(1)).index_copy(0, pos, segs)
        return y * recv_topk_weights.unsqueeze(1)

    def _grouped(self, xs: torch.Tensor, counts: list) -> torch.Tensor:
        """SwiGLU of ``xs`` (bf16 rows sorted by expert, ``counts`` per expert) with grouped GEMMs; float32 out."""
        align = _gg.get_mk_alignment_for_contiguous_layout()
        starts, ends, end = [], [], 0
        for c in counts:
            start = align_up(end, align)
            starts.append(start)
            end = start + c
            ends.append(end)
        pos = torch.cat([torch.arange(s, s + c) for s, c in zip(starts, counts)]) if counts else \
            torch.empty(0, dtype=torch.int64)
        ends_t = torch.tensor(ends, dtype=torch.int32)
        a = xs.new_zeros(end, xs.size(1)).index_copy(0, pos, xs)
        return self._grouped_swiglu(_GroupedLinear, a, ends_t).index_select(0, pos).float()

    def _grouped_swiglu(self, linear, a: torch.Tensor, layout: torch.Tensor) -> torch.Tensor:
        """bf16 SwiGLU of bf16 ``a`` through ``linear`` (:class:`_GroupedLinear` with psum ``ends``, or
        :class:`_MaskedLinear` with ``masked_m``): ``w2(silu(w1 a) * w3 a)``, the product in float32."""
        h1 = linear.apply(a, self.w1, layout)
        h3 = linear.apply(a, self.w3, layout)
        act = (F.silu(h1.float()) * h3.float()).to(_BF16)
        return linear.apply(act, self.w2, layout)


class MoE(nn.Module):
    """DeepSeek MoE block over expert parallelism: ``forward(x [..., H])`` → ``[..., H]`` (``x``'s dtype, any float
    dtype: the gate, the routed experts and the shared experts each compute in their own weights' dtype).

    Three communication paths (``mode``): DeepEP's two modes on a :class:`deepep_ascend.Buffer`, and
    DeepEP V2.5's expanded layout on a :class:`deepep_ascend.EPBuffer`:

    * ``"normal"`` — :func:`deepep_ascend.nn.autograd.dispatch` / :func:`~deepep_ascend.nn.autograd.combine`
      on a Buffer with a UBMEM window (``num_nvl_bytes >= Buffer.get_normal_buffer_size_hint(N, H, R,
      K, E)`` for ``N`` tokens per rank); any number of tokens per batch. The training default.
    * ``"low_latency"`` — :func:`deepep_ascend.nn.autograd.low_latency_dispatch` (BF16, ``use_fp8=False``)
      / :func:`~deepep_ascend.nn.autograd.low_latency_combine` on a Buffer built with
      ``low_latency_mode=True`` and ``num_rdma_bytes >= Buffer.get_low_latency_rdma_size_hint(M, H,
      R, E)``, ``M = num_max_dispatch_tokens_per_rank``. The routed experts run on the packed
      ``[L, R·M, H]`` layout (:meth:`LocalExperts.forward_packed`); the combine applies the top-k
      weights. Every forward may carry at most ``M`` tokens per rank (``M`` the same on every rank,
      at most 511 as in DeepEP); a larger batch raises ``ValueError`` on its rank and an error
      naming that rank on the others (the Buffer stays usable). FP8 dispatch is not offered (not
      differentiable).
    * ``"expanded"`` — :func:`deepep_ascend.nn.autograd.ep_dispatch` (``do_expand=True``) /
      :func:`~deepep_ascend.nn.autograd.ep_combine` on an EPBuffer (built with
      ``num_max_tokens_per_rank >= N``, ``hidden = H``, ``num_topk = K``, or a ``num_bytes`` at least
      its size hint); the mode of every EPBuffer layer. The experts run on the expanded layout with the
      handle's ``psum_num_recv_tokens_per_expert`` as the grouped GEMMs' psum layout
      (:meth:`LocalExperts.forward_expanded`; ``expert_alignment`` is the GEMMs'
      ``get_mk_alignment_for_contiguous_layout()``, 1 on the ``"loop"`` path). A batch above the
      EPBuffer's ``num_max_tokens_per_rank`` raises ``ValueError`` on its rank and a ``ConsensusError``
      naming it on the others.

    The paths compute the same function up to bf16 roundings (module docstring).
    ``mode=None`` picks ``"expanded"`` on an EPBuffer; on a Buffer it picks ``"low_latency"`` when
    ``buffer.low_latency_mode`` is set, else ``"normal"``.
    One Buffer built with both windows (``num_nvl_bytes`` and ``low_latency_mode=True, num_rdma_bytes``)
    serves both paths, on one node and across nodes: pass ``mode`` explicitly, or switch with
    ``layer.mode = ...``.

    Args:
        buffer: a :class:`deepep_ascend.Buffer` or :class:`deepep_ascend.EPBuffer` over the EP group (shared
            by layers), see above.
        hidden: model width ``H``; intermediate: routed expert width ``I``.
        num_experts: ``E``, a multiple of the EP size; top_k: experts per token.
        num_shared_experts: 0 = no shared expert, else one SwiGLU of width ``num_shared_experts * I``.
        seed: expert ``e`` is initialised from :func:`expert_init_generator` ``(seed, e)``, so the
            model does not depend on the EP size; the gate and the shared expert use torch's
            global RNG (seed it identically on every rank).
        experts_impl: ``"grouped"`` (grouped GEMMs, the default when :mod:`deepep_ascend.gemm.grouped` imports) or
            ``"loop"`` (float32, one matmul per local expert); see :class:`LocalExperts`.
        mode: ``"normal"``, ``"low_latency"``, ``"expanded"`` or ``None`` (from the buffer), see above.
        num_max_dispatch_tokens_per_rank: ``M`` of the low-latency path (required there): the most
            tokens one rank may send per forward, and the Buffer's size hint argument. On an EPBuffer,
            optional: the dispatch's ``num_max_tokens_per_rank`` (default: the EPBuffer's).
        **gate_kwargs: :class:`MoEGate` options (``score_func``, ``n_group``, ``topk_group``,
            ``routed_scaling_factor``, ``norm_topk_prob``, ``use_selection_bias``, ``aux_loss_alpha``).
    Attributes:
        last_topk_idx: ``[N, K]`` routing of the last forward (for routing traces).
    Raises:
        ValueError: ``num_experts`` not a multiple of the EP size; on the low-latency path a Buffer
            without ``low_latency_mode``, a missing or bad ``M``, or ``num_rdma_bytes`` below the hint;
            ``"expanded"`` without an EPBuffer, or another mode with one. ``forward``: ``TypeError`` /
            ``ValueError`` for an ``x`` that is not a floating tensor ``[..., hidden]`` (the peers' calls then
            raise a ``ConsensusError`` naming this rank).

    Example (low-latency path, every rank)::

        M = 128  # tokens per rank and forward, at most
        buffer = Buffer(group, 0, MoE.get_low_latency_rdma_size_hint(M, H, group.size(), E, K),
                        low_latency_mode=True)
        moe = MoE(buffer, H, I, E, K, num_max_dispatch_tokens_per_rank=M)   # mode from the Buffer
        y = moe(x)              # x [..., H] with at most M tokens

    Example (expanded path, every rank)::

        buffer = EPBuffer(group, num_max_tokens_per_rank=N, hidden=H, num_topk=K)
        moe = MoE(buffer, H, I, E, K)   # mode "expanded"
        y = moe(x)                      # x [..., H] with at most N tokens
    """

    def __init__(self, buffer, hidden: int, intermediate: int, num_experts: int, top_k: int,
                 num_shared_experts: int = 0, seed: int = 0, experts_impl: str | None = None,
                 mode: str | None = None, num_max_dispatch_tokens_per_rank: int | None = None, **gate_kwargs):
        super().__init__()
        self._ep = isinstance(buffer, EPBuffer)
        ep_size, ep_rank = (buffer.num_ranks, buffer.rank_idx) if self._ep else (buffer.group_size, buffer.rank)
        if num_experts % ep_size:
            raise ValueError(f"MoE: num_experts={num_experts} must be a multiple of the EP size {ep_size}")
        self.buffer = buffer
        self.hidden, self.num_experts, self.top_k = hidden, num_experts, top_k
        self.num_local_experts = num_experts // ep_size
        self.num_max_dispatch_tokens_per_rank = num_max_dispatch_tokens_per_rank
        self.mode = mode if mode is not None else ("expanded" if self._ep else "low_latency"
                                                   if getattr(buffer, "low_latency_mode", False) else "normal")
        self.gate = MoEGate(hidden, num_experts, top_k, **gate_kwargs)
        self.experts = LocalExperts(self.num_local_experts, hidden, intermediate,
                                    first_expert=ep_rank * self.num_local_experts, seed=seed, impl=experts_impl)
        self.shared_experts = SwiGLU(hidden, intermediate * num_shared_experts) if num_shared_experts else None
        self.last_topk_idx = None

    @property
    def mode(self) -> str:
        """``"normal"``, ``"low_latency"`` or ``"expanded"``; settable (checked against the buffer)."""
        return self._mode

    @mode.setter
    def mode(self, value: str) -> None:
        if value not in ("normal", "low_latency", "expanded"):
            raise ValueError(f"MoE: mode must be 'normal', 'low_latency' or 'expanded', got {value!r}")
        if (value == "expanded") != self._ep:
            raise ValueError(f"MoE: mode={value!r} needs " + ("a deepep_ascend.Buffer; an EPBuffer runs mode='expanded'"
                                                              if self._ep else "a deepep_ascend.EPBuffer"))
        if value == "low_latency":
            self._check_low_latency()
        self._mode = value

    def _check_low_latency(self) -> None:
        b, m = self.buffer, self.num_max_dispatch_tokens_per_rank
        if not getattr(b, "low_latency_mode", False):
            raise ValueError("MoE: mode='low_latency' needs a Buffer built with low_latency_mode=True and "
                             "num_rdma_bytes >= "
                             "Buffer.get_low_latency_rdma_size_hint(M, hidden, num_ranks, num_experts)")
        if not isinstance(m, int) or isinstance(m, bool) or m < 1:
            raise ValueError(f"MoE: the low-latency path needs num_max_dispatch_tokens_per_rank, an int >= 1 (the most "
                             f"tokens a rank sends per forward), got {m!r}"
                             + ("; pass mode='normal' for this Buffer's normal path" if m is None else ""))
        depth = getattr(b, "nvshmem_qp_depth", None)
        if depth is not None and m > depth // 2 - 1:
            raise ValueError(f"MoE: num_max_dispatch_tokens_per_rank={m} exceeds the low-latency limit "
                             f"nvshmem_qp_depth / 2 - 1 = {depth // 2 - 1}")
        need = self.get_low_latency_rdma_size_hint(m, self.hidden, b.group_size, self.num_experts, self.top_k)
        if b.num_rdma_bytes < need:
            raise ValueError(f"MoE: the Buffer's num_rdma_bytes={b.num_rdma_bytes} is below the {need} bytes this "
                             f"layer's low-latency calls need (MoE.get_low_latency_rdma_size_hint(M={m}, "
                             f"H={self.hidden}, R={b.group_size}, E={self.num_experts}, K={self.top_k}))")

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int, top_k: int) -> int:
        """``num_rdma_bytes`` a low-latency Buffer needs for this layer (forward and backward).

        ``Buffer.get_low_latency_rdma_size_hint(M, max(H, H'), R, E)`` with ``H' = 4K``: the backward's
        narrow LL calls (weights and indices; exact weight gradients) carry ``4K`` bf16 columns. For every
        real model (``4K <= H``) it is the Buffer's own hint.
        """
        hidden = max(hidden, ep_autograd._ll_narrow_cols(top_k))
        return Buffer.get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)

    @property
    def aux_loss(self) -> torch.Tensor | None:
        return self.gate.aux_loss

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        problem = self._input_problem(x)
        if problem is not None:  # refused in the first collective call, so that the peers raise too (naming this rank)
            self.buffer.refuse_call("low_latency_dispatch" if self._mode == "low_latency" else "dispatch", problem)
        shape = x.shape
        h = x.reshape(-1, self.hidden)
        topk_idx, topk_weights = self.gate(h)
        self.last_topk_idx = topk_idx
        topk_weights = topk_weights.float()  # the Buffer's weights are float32
        if self._mode == "expanded":
            out = self._routed_expanded(h, topk_idx, topk_weights)
        elif self._mode == "low_latency":
            out = self._routed_low_latency(h, topk_idx, topk_weights)
        else:
            out = self._routed_normal(h, topk_idx, topk_weights)
        out = out.to(x.dtype)
        if self.shared_experts is not None:  # in its weights' dtype, as the gate and the routed experts cast
            out = out + self.shared_experts(h.to(self.shared_experts.w1.weight.dtype)).to(x.dtype)
        return out.view(shape)

    def _input_problem(self, x) -> Exception | None:
        """Why ``forward`` cannot take ``x`` (a floating tensor ``[..., hidden]``), or None."""
        if not isinstance(x, torch.Tensor):
            return TypeError(f"MoE: x must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            return TypeError(f"MoE: x must be a floating tensor, got {x.dtype}")
        if x.dim() < 1 or x.size(-1) != self.hidden:
            return ValueError(f"MoE: x must be [..., hidden={self.hidden}], got shape {tuple(x.shape)}")
        return None

    def _routed_normal(self, h, topk_idx, topk_weights):
        recv_x, recv_idx, recv_w, _, handle = ep_autograd.dispatch(self.buffer, h.to(_BF16), topk_idx, topk_weights,
                                                                   self.num_experts)
        y = self.experts(recv_x, recv_idx, recv_w)
        out, _ = ep_autograd.combine(self.buffer, y.to(_BF16), handle)
        return out

    def _routed_expanded(self, h, topk_idx, topk_weights):
        align = _gg.get_mk_alignment_for_contiguous_layout() if self.experts.impl == "grouped" else 1
        kwargs = {} if self.num_max_dispatch_tokens_per_rank is None else \
            {"num_max_tokens_per_rank": self.num_max_dispatch_tokens_per_rank}
        # zero padding: the gaps' weights are 0, so their rows (multiplied by them) are 0, never NaN
        recv_x, _, recv_w, handle = ep_autograd.ep_dispatch(
            self.buffer, h.to(_BF16), topk_idx, topk_weights, num_experts=self.num_experts, expert_alignment=align,
            do_expand=True, do_zero_padding=True, **kwargs)
        y = self.experts.forward_expanded(recv_x, recv_w, handle.psum_num_recv_tokens_per_expert,
                                          handle.expert_alignment)
        out, _ = ep_autograd.ep_combine(self.buffer, y.to(_BF16), handle)
        return out

    def _routed_low_latency(self, h, topk_idx, topk_weights):
        m = self.num_max_dispatch_tokens_per_rank
        try:  # the Buffer validates collectively: a rank with too many tokens fails every rank's call
            recv_x, recv_count, handle = ep_autograd.low_latency_dispatch(self.buffer, h.to(_BF16), topk_idx, m,
                                                                          self.num_experts, use_fp8=False)
        except Exception as exc:
            if h.size(0) > m:
                raise ValueError(f"MoE (low-latency): this batch has {h.size(0)} tokens on EP rank {self.buffer.rank}, "
                                 f"more than num_max_dispatch_tokens_per_rank={m}; send smaller batches, or build "
                                 f"the layer with a larger M (and the Buffer with "
                                 f"MoE.get_low_latency_rdma_size_hint(M, ...))") from exc
            raise
        y = self.experts.forward_packed(recv_x, recv_count)
        return ep_autograd.low_latency_combine(self.buffer, y.to(_BF16), topk_idx, topk_weights, handle)
