"""MegaMoE's expert compute on rows an :class:`~deepep_ascend.EPBuffer` delivered in DeepEP V2.5's expanded
layout: :func:`mega_moe_experts` (docs/semantics/mega-moe.md §9). The handle's
``psum_num_recv_tokens_per_expert`` is DeepGEMM's psum layout: each expert's rows are multiplied where they
lie, by the same pieces (:mod:`.experts`) and on the same cached weights (:mod:`.weights`) as the fused ops."""

from __future__ import annotations

import torch

from ..checks import check_storage
from ..ep.ep_buffer import EPBuffer, handle_made_by
from ..ep.ep_handle import EPHandle
from ..rounding import align
from .experts import activation as swiglu_rows
from .experts import check_clamp, dequant_x, expert_gemm, gemm_engine, operand_dtype, swiglu_params
from .formats import BF16, FP8
from .weights import check_weights, untransformed

_OP = "mega_moe_experts"


def _spans(ends: list, alignment: int) -> list:
    """The psum layout's rows as maximal runs of back-to-back experts: ``[(s, e, g0, bounds)]``, rows ``[s, e)``
    holding experts ``g0 ..`` whose rows start at ``s + bounds[j]`` (``bounds`` as :func:`~.experts.expert_gemm`
    takes them). Expert ``g``'s rows are ``[align(ends[g-1]), ends[g])``; empty experts are skipped, and an
    alignment gap starts a new run (its rows are never read)."""
    spans, prev = [], 0
    for g, end in enumerate(ends):
        start = align(prev, alignment)
        prev = end
        if end == start:
            continue
        if spans and spans[-1][1] == start:  # follows the previous expert without a gap
            s, _e, g0, bounds = spans[-1]
            bounds += [bounds[-1]] * (g - g0 - len(bounds) + 1) + [end - s]
            spans[-1] = (s, end, g0, bounds)
        else:
            spans.append((start, end, g, [0, end - start]))
    return spans


def _check(buffer, recv_x, recv_topk_weights, handle, l1_weights, l2_weights, out):
    """The call's checks, before anything is computed: returns ``(kind, data, sf_bytes, ends, i)``."""
    if not isinstance(buffer, EPBuffer):
        raise TypeError(f"{_OP}: `buffer` must be a deepep_ascend.EPBuffer, got {type(buffer).__name__}")
    if not isinstance(handle, EPHandle):
        raise TypeError(f"{_OP}: `handle` must be an EPHandle from EPBuffer.dispatch, got {type(handle).__name__}")
    if not handle_made_by(handle, buffer):
        raise ValueError(f"{_OP}: `handle` comes from another buffer's dispatch")
    if not handle.do_expand:
        raise ValueError(f"{_OP}: `handle` is of the compact layout; dispatch with do_expand=True (the expanded "
                         f"layout, one row per (token, local expert), is what the grouped GEMMs read)")
    kind = "bf16" if isinstance(l1_weights, torch.Tensor) else "fp8"
    psum = handle.psum_num_recv_tokens_per_expert
    el = psum.numel()
    _e, h, i = check_weights(kind, l1_weights, l2_weights, el, None, None, _OP)
    if kind == "bf16":
        if not isinstance(recv_x, torch.Tensor) or recv_x.dtype != BF16:
            raise TypeError(f"{_OP}: bf16 weights need bf16 `recv_x` (dispatch bf16 x), got "
                            f"{getattr(recv_x, 'dtype', type(recv_x).__name__)}")
        data, sf = recv_x, None
    else:
        if not (isinstance(recv_x, (tuple, list)) and len(recv_x) == 2
                and all(isinstance(t, torch.Tensor) for t in recv_x)):
            raise TypeError(f"{_OP}: fp8xfp4 weights need `recv_x` = (float8_e4m3fn data, int32 sf), as "
                            f"EPBuffer.dispatch returns an FP8 pair; got {type(recv_x).__name__}")
        data, sf = recv_x
        if data.dtype != FP8:
            raise TypeError(f"{_OP}: `recv_x[0]` must be float8_e4m3fn, got {data.dtype}")
        if sf.dtype != torch.int32:
            raise TypeError(f"{_OP}: `recv_x[1]` must be int32 (UE8M0 per 32 channels, four per int), got {sf.dtype}")
        check_storage(f"{_OP}: `recv_x[1]`", sf)
    check_storage(f"{_OP}: `recv_x`", data)
    n = handle.num_expanded_tokens
    if data.dim() != 2 or tuple(data.shape) != (n, h) or not data.is_contiguous():
        raise ValueError(f"{_OP}: `recv_x` must be contiguous [num_expanded_tokens, hidden] = [{n}, {h}] (the "
                         f"handle's rows, the weights' hidden), got {tuple(data.shape)}"
                         + ("" if data.is_contiguous() else " (not contiguous)"))
    if sf is not None and tuple(sf.shape) != (n, h // 128):
        raise ValueError(f"{_OP}: `recv_x[1]` must be [{n}, {h // 128}], got {tuple(sf.shape)}")
    w = recv_topk_weights
    if not isinstance(w, torch.Tensor) or w.dtype != torch.float32:
        raise TypeError(f"{_OP}: `recv_topk_weights` must be a float32 tensor (the expanded dispatch's 1-D weights), "
                        f"got {getattr(w, 'dtype', type(w).__name__)}")
    if tuple(w.shape) != (n,):
        raise ValueError(f"{_OP}: `recv_topk_weights` must be [{n}] (the handle's rows), got {tuple(w.shape)}")
    check_storage(f"{_OP}: `recv_topk_weights`", w)
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.dtype != BF16:
            raise TypeError(f"{_OP}: `out` must be a bfloat16 tensor, got {getattr(out, 'dtype', type(out).__name__)}")
        check_storage(f"{_OP}: `out`", out)
        if tuple(out.shape) != (n, h) or not out.is_contiguous():
            raise ValueError(f"{_OP}: `out` must be contiguous [{n}, {h}], got {tuple(out.shape)}"
                             + ("" if out.is_contiguous() else f" with strides {out.stride()} (not contiguous)"))
    ends = psum.tolist()
    if ends and (any(b < a for a, b in zip([0] + ends, ends)) or ends[-1] > n):
        raise ValueError(f"{_OP}: the handle's psum_num_recv_tokens_per_expert {ends} is not a layout of {n} rows")
    if sf is not None and not (sf.is_contiguous() and sf.stride(-1) == 1):
        # column-major scales: one row-major copy (torch calls [n, 1] with strides (1, n) contiguous)
        sf = torch.empty(sf.shape, dtype=sf.dtype).copy_(sf)
    sf_bytes = None if sf is None else sf.view(torch.uint8)  # [n, H/32]
    return kind, data, sf_bytes, ends, i


def mega_moe_experts(buffer, recv_x, recv_topk_weights, handle, l1_weights, l2_weights,
                     activation: str = "swiglu", activation_clamp=None, fast_math: bool = True, *,
                     activation_alpha: float = 1.0, activation_up_bias: float = 0.0,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """MegaMoE's routed experts on the rows of ``EPBuffer.dispatch(..., do_expand=True)``: L1, SwiGLU (or
    ``'swigluoai'``) × each row's top-k weight (+ the FP8 round trip on the fp8 path), L2; per row, the
    arithmetic of :func:`fp8_fp4_mega_moe` / :func:`bf16_mega_moe` between their dispatch and combine
    (docs/semantics/mega-moe.md §9). Local, no communication: ``EPBuffer.combine(out, handle)`` then returns
    the rows to their tokens.

    DeepGEMM has no such entry (its Mega MoE always moves the rows itself); its unfused path is the m-grouped
    GEMMs with ``use_psum_layout=True`` on DeepEP's expanded layout, and that is how this reads the rows:
    local expert ``g``'s rows are ``[align(psum[g-1], expert_alignment), psum[g])`` with ``psum =
    handle.psum_num_recv_tokens_per_expert``, multiplied where they lie (no sort, no copy into another
    layout). Alignment gaps and rows past ``psum[-1]`` (``do_cpu_sync=False``) are never read, whatever they
    hold (``do_zero_padding`` is not needed).

    Args:
        buffer: the :class:`~deepep_ascend.EPBuffer` whose dispatch made ``handle``.
        recv_x: bf16 ``[n, H]`` (bf16 weights), or the FP8 pair ``(float8_e4m3fn [n, H], int32 [n, H/128])``
            (fp8xfp4 weights): a dispatch of MegaMoE's ``x`` / ``x_sf`` (UE8M0 per 32 channels, four per
            int; row- or column-major). ``n = handle.num_expanded_tokens``; contiguous data.
        recv_topk_weights: float32 ``[n]``, the expanded dispatch's weights (each row's top-k weight).
        handle: that dispatch's :class:`~deepep_ascend.EPHandle` (``do_expand=True``; any
            ``expert_alignment``, ``do_cpu_sync`` either way).
        l1_weights, l2_weights: this rank's experts after :func:`transform_weights_for_mega_moe`, as the fused
            ops take them: bf16 ``[E_l, 2I, H]`` / ``[E_l, H, I]``, or FP4 ``(int8, int32)`` pairs
            ``[E_l, 2I, H/2]``/``[E_l, 2I, H/128]`` and ``[E_l, H, I/2]``/``[E_l, H, I/128]``;
            ``E_l = len(handle.psum_num_recv_tokens_per_expert)``.
        activation, activation_clamp, fast_math, activation_alpha, activation_up_bias: as the fused ops.
        out: optional contiguous bf16 ``[n, H]`` to write into (returned), else a new tensor.
    Returns:
        ``out``: bf16 ``[n, H]``; the row of (token, slot) ``j`` is that pair's L2 output, the ``o_j`` of
        MegaMoE's final sum (the top-k weight applied before L2, as MegaMoE applies it); every other row 0.
    Raises:
        TypeError / ValueError, on the calling rank before anything is written: ``buffer`` not an EPBuffer, a
        handle of another buffer or of the compact layout, weights of the wrong shapes or dtypes (or an ``E_l``
        other than the handle's), ``recv_x`` / ``recv_topk_weights`` / ``out`` not matching the handle and
        the weights, a bad activation, clamp or parameter. (The peers learn of it at their next collective
        call, e.g. the combine's deadline.)
    """
    kind, data, sf_bytes, ends, i = _check(buffer, recv_x, recv_topk_weights, handle, l1_weights, l2_weights, out)
    oai = swiglu_params(activation, activation_alpha, activation_up_bias, _OP)
    check_clamp(activation_clamp, _OP)
    n, h = data.shape
    engine = gemm_engine()
    op_dtype = operand_dtype(engine)
    w1, w2 = untransformed(kind, l1_weights, l2_weights, engine)
    y = torch.empty(n, h, dtype=BF16) if out is None else out
    done = 0  # rows of y written (or zeroed) so far
    for s, e, g0, bounds in _spans(ends, handle.expert_alignment):
        y[done:s] = 0
        g1 = g0 + len(bounds) - 1
        # the fp32 engine widens bf16 rows itself; fp8 rows are decoded as the fused ops decode them
        xs = data[s:e] if kind == "bf16" else dequant_x(kind, data[s:e], sf_bytes[s:e], op_dtype)
        hh = expert_gemm(engine, xs, w1[g0:g1], bounds)
        act = swiglu_rows(kind, hh, i, recv_topk_weights[s:e], activation_clamp, fast_math, op_dtype, oai=oai)
        expert_gemm(engine, act, w2[g0:g1], bounds, out=y[s:e])
        done = e
    y[done:] = 0
    return y

