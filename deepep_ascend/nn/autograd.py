"""Differentiable dispatch and combine, normal and low-latency mode: each one's backward is the other
(docs/semantics/deepep-api.md §4.7).

DeepEP's README trains with four helpers (``dispatch_forward`` / ``dispatch_backward`` /
``combine_forward`` / ``combine_backward``); this module wraps the same calls in
``torch.autograd.Function``s so that ``loss.backward()`` drives them:

* :func:`dispatch` — forward: ``Buffer.get_dispatch_layout`` (unless the layout is passed) and
  ``Buffer.dispatch``; backward: ``Buffer.combine`` of the gradients of ``recv_x`` and
  ``recv_topk_weights`` through the same handle (sum over the ranks that received each token,
  float32 accumulation in ascending rank order, one rounding to bf16).
* :func:`combine` — forward: ``Buffer.combine``; backward: a cached ``Buffer.dispatch`` of the
  gradient of ``combined_x`` (and of ``combined_topk_weights``, packed into the same rows, so
  it is one call) through the handle.

Both backward passes are collective, like the forward passes: every rank of the Buffer runs them
in the same order, which ``loss.backward()`` guarantees when every rank builds the same graph.
A rank with no tokens to send, or none received, still takes part and gets zero-size or zero
gradients, never ``None``. The gradients are the exact adjoints of the forward maps: the
gradient of a ``recv_topk_weights`` slot whose expert is not on the receiving rank
(``recv_topk_idx == -1``, forward value 0) is dropped before the combine.

Dtypes: ``x`` must be bfloat16. The data plane moves any dtype, but the backward of dispatch is
a combine, which is bf16-only as in DeepEP, so float32 (or float64) ``x`` is refused with a
``TypeError`` instead of being rounded silently; cast first (``x.bfloat16()`` is itself
differentiable: its backward casts the bf16 gradient back to ``x``'s dtype). ``topk_weights``
are float32 and their gradients stay float32 end to end. FP8 ``(data, scales)`` inputs are not
differentiable and are refused.

The wrappers' own refusals (dtype, keywords, and here ``get_dispatch_layout``'s checks, which do not
communicate) go through the Buffer's first round like its own (``refuse_call``): the rank at fault raises
its error, every other rank a ``ConsensusError`` naming it, and the Buffer stays usable.

Low-latency mode has its pair too (docs/semantics/deepep-api.md §6):

* :func:`low_latency_dispatch` — forward: ``Buffer.low_latency_dispatch`` (BF16, ``use_fp8=False``);
  backward: ``Buffer.low_latency_combine`` of the gradient of the packed ``recv_x`` through the
  same handle with unit weights: each token's gradient is the float32 sum of its slots'
  gradients (slots in top-k order, one rounding to bf16), padding rows dropped.
* :func:`low_latency_combine` — forward: ``Buffer.low_latency_combine``; backward, with ``g`` the
  gradient of ``combined_x`` and ``y`` the expert outputs: (1) ``Buffer.low_latency_dispatch`` of
  ``g`` (BF16) with the same ``topk_idx``, which lands ``g[t]`` in exactly the slots of the
  forward handle (same routing, same slots; checked); (2) a second, narrow LL dispatch of each
  token's ``topk_weights`` row (float32 bits) and ``topk_idx`` row (16 bits each), moved verbatim,
  so each slot finds its own weight ``w[t, j]`` (the ``j`` whose expert is the slot's; for an expert
  listed twice in a row, its first row takes the first such ``j``, its second row the second);
  ``grad_y[slot] = bf16(w[t, j] * g[t])``, padding rows 0. (3) Only if ``topk_weights`` requires
  grad: each slot's ``dot(g[t], y[slot])`` (float32) is split exactly into three bf16 parts
  ``hi + mid + lo`` and returned with an LL combine of ``4K``-column rows (part ``p`` of slot ``j``
  in column ``p·K + j``, unit weights, so every column sums one value: exact), then
  ``grad_w[t, j] = hi + mid + lo``, the float32 dot product itself (exact for ``|dot| > 2^-100``).
  So the backward is two LL calls, three with weight gradients; calls (2) and (3) have
  ``hidden = 4K`` (one width per top-k: ranks of different top-k meet there with different hidden
  sizes, which the LL header refuses on every rank), which a Buffer sized for an ``H`` at least that fits.

``use_fp8=True`` (``Buffer.low_latency_dispatch``'s default, kept here) is refused with a
``TypeError`` when ``x`` requires grad: FP8 rows are not differentiable; pass ``use_fp8=False``.
Without grad it is passed through (non-differentiable outputs). ``async_finish``,
``return_recv_hook``, ``zero_copy`` and ``out`` are refused (the autograd path is synchronous).
Every rank must run the same backward calls: same graph, and ``topk_weights.requires_grad``
the same on every rank (it decides whether call (3) runs).

:class:`deepep_ascend.EPBuffer` (DeepEP V2.5) has its pair (docs/semantics/deepep-api.md §13):

* :func:`ep_dispatch` — forward: ``EPBuffer.dispatch`` (compact or expanded layout); backward:
  ``EPBuffer.combine`` of the gradients of ``recv_x`` and ``recv_topk_weights`` through the same
  handle. In the expanded layout each receiving rank first sums a token's slot gradients in slot
  order (float32, one rounding to bf16), then the origin adds the ranks' rows in the order of each
  rank's last top-k slot (float32, one rounding): V2.5's combine arithmetic. Alignment gaps and
  capacity rows have no forward influence and get none back (combine reads the slots only).
* :func:`ep_combine` — forward: ``EPBuffer.combine``; backward: a cached ``EPBuffer.dispatch`` of
  the gradient of ``combined_x`` (bf16) with the gradient of ``combined_topk_weights`` as its
  ``topk_weights`` (float32, moved verbatim), with ``do_zero_padding`` in the expanded layout: every
  slot row gets its token's gradient, alignment gaps get zeros. ``bias`` tensors get the gradient
  of ``combined_x`` itself (a bias is added once per token).

Example (every rank)::

    recv_x, recv_idx, recv_w, counts, handle = deepep_ascend.nn.autograd.dispatch(
        buffer, x.bfloat16(), topk_idx, topk_weights, num_experts)
    y = experts(recv_x, recv_idx, recv_w, counts)           # [N_recv, H] bf16, weights applied
    out, _ = deepep_ascend.nn.autograd.combine(buffer, y, handle)
    out.float().pow(2).mean().backward()                     # two collective calls per direction

Gradients are first order only: a backward is one communication call, not itself differentiable.
Differentiating a gradient through it again (``create_graph=True``, then a second ``grad``) raises
``RuntimeError`` (:func:`first_order_only`) rather than dropping this path's terms.
"""

from __future__ import annotations

import functools

import torch

from ..ep.config import Config
from ..ep.failure import abort_peers
from ..ep.handles import LowLatencyHandle, NormalHandle
from ..ep.protocol import CallMismatch, ConsensusError
from ..ep.rows import dense

__all__ = ["combine", "dispatch", "ep_combine", "ep_dispatch", "first_order_only", "low_latency_combine",
           "low_latency_dispatch"]

_BF16 = torch.bfloat16


class _NotTwice(torch.autograd.Function):
    """The identity on ``value``, tied to ``anchors`` (the gradients a backward was given): differentiating
    through it raises."""

    @staticmethod
    def forward(ctx, value, *anchors):
        return value.clone()

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("deepep_ascend.nn: a gradient is differentiated again through an expert-parallel "
                           "dispatch, combine or grouped GEMM; their backward is not differentiable (first-order "
                           "gradients only)")


def first_order_only(backward):
    """Decorate an ``autograd.Function.backward``: run it without autograd, and when it runs with
    ``create_graph=True`` tie each float result to the gradients it was given and to the saved tensors that require
    grad (a combine's backward depends on its weights and rows) through an identity whose backward raises
    ``RuntimeError``. A second-order gradient that reaches it then raises, while one that does not (or a
    plain first-order backward) is unaffected. (``torch.autograd.function.once_differentiable`` ties them to
    copies of the results instead, so ``torch.autograd.grad(g, x)`` silently skips this path.)"""
    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        anchors = []
        if torch.is_grad_enabled():  # create_graph: the results may depend on the gradients and the saved inputs
            anchors = [t for t in (*grads, *ctx.saved_tensors) if isinstance(t, torch.Tensor) and t.requires_grad]
        differentiable = bool(anchors)
        try:
            with torch.no_grad():
                out = backward(ctx, *grads)
        except BaseException as exc:
            # A backward makes several collective calls with work of its own between them: if that work fails
            # here, the peers are already in (or on their way to) the next call, so abort the buffer now, as a
            # failed call does, rather than let them wait out the deadline (nothing for a Buffer's own
            # failures, which aborted already, or for a refusal every rank raised).
            runtime = getattr(getattr(ctx, "buffer", None), "runtime", None)
            if runtime is not None:
                abort_peers(runtime, runtime.topology.rank, exc)
            raise
        if not differentiable:
            return out
        return tuple(_NotTwice.apply(o, *anchors) if isinstance(o, torch.Tensor) and o.is_floating_point() else o
                     for o in (out if isinstance(out, tuple) else (out,)))
    return wrapper

# Buffer.dispatch keyword arguments that dispatch() passes through (the rest are refused: the
# autograd path is synchronous, outputs are complete on return).
_DISPATCH_KWARGS = ("handle", "num_tokens_per_rank", "num_tokens_per_rdma_rank", "is_token_in_rank",
                    "num_tokens_per_expert", "expert_alignment", "num_worst_tokens", "config", "previous_event")


def _num_sms(buffer, config) -> int:
    return config.num_sms if config is not None else type(buffer).num_sms


def _check_bf16(x, op: str, backward: str = "Buffer.combine") -> None:
    if isinstance(x, tuple):
        raise TypeError(f"deepep_ascend.nn.autograd.{op}: FP8 (data, scales) inputs are not differentiable; "
                        f"pass bfloat16 `x`")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"deepep_ascend.nn.autograd.{op}: `x` must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != _BF16:
        raise TypeError(f"deepep_ascend.nn.autograd.{op}: `x` must be bfloat16, got {x.dtype}: the backward pass "
                        f"goes through {backward}, which is bf16-only as in DeepEP; cast first with "
                        f"x.bfloat16() (differentiable)")


def _check_kwargs(kwargs, allowed, op: str) -> None:
    bad = sorted(set(kwargs) - set(allowed))
    if bad:
        raise TypeError(f"deepep_ascend.nn.autograd.{op}: unsupported keyword(s) {bad}; allowed: {list(allowed)} "
                        f"(the autograd path is synchronous)")


def _refused_everywhere(buffer, op: str, *checks) -> None:
    """Run the wrapper's own ``checks`` (callables raising ``TypeError`` / ``ValueError``); on a failure, refuse
    the Buffer's call ``op`` on this rank with that error (``refuse_call``), so that the peers' matching call
    raises a ``ConsensusError`` naming this rank instead of waiting for it, then raise the error here."""
    try:
        for c in checks:
            c()
    except (TypeError, ValueError) as exc:
        refuse = getattr(buffer, "refuse_call", None)
        if refuse is None:  # not a Buffer: nothing collective to take part in
            raise
        refuse(op, exc)


def _rows_problem(op: str, x, topk_idx) -> None:
    """``topk_idx`` has one row per token of ``x`` (the layout the wrapper computes from it would name its own
    ``is_token_in_rank`` instead)."""
    if isinstance(topk_idx, torch.Tensor) and topk_idx.dim() >= 1 and topk_idx.size(0) != x.size(0):
        raise ValueError(f"deepep_ascend.nn.autograd.{op}: `topk_idx` has {topk_idx.size(0)} rows, `x` has "
                         f"{x.size(0)} tokens")


def _cached_problem(op: str, topk_idx, topk_weights) -> None:
    if topk_idx is not None or topk_weights is not None:
        raise ValueError(f"deepep_ascend.nn.autograd.{op}: a cached dispatch (handle=...) takes "
                         f"topk_idx=None and topk_weights=None")


def _weights_or_placeholder(ctx, weights: torch.Tensor | None) -> torch.Tensor:
    """A dispatch's or combine's output weights, or (no weights) an empty non-differentiable float32
    placeholder: an autograd Function returns tensors only."""
    if weights is None:
        weights = torch.empty(0, dtype=torch.float32)
        ctx.mark_non_differentiable(weights)
    return weights


class _Dispatch(torch.autograd.Function):
    """Inputs ``(x, topk_weights | None, buffer, topk_idx, num_experts, kwargs, out)``; returns
    ``(recv_x, recv_topk_weights)`` (the latter an empty placeholder without top-k) and fills
    ``out`` with the non-differentiable results."""

    @staticmethod
    def forward(ctx, x, topk_weights, buffer, topk_idx, num_experts, kwargs, out):
        kwargs = dict(kwargs)
        handle = kwargs.pop("handle", None)
        config = kwargs.get("config")
        if handle is None:
            if kwargs.get("num_tokens_per_rank") is None:
                layout = []
                # get_dispatch_layout does not communicate: its refusal goes through the dispatch's round
                _refused_everywhere(buffer, "dispatch",
                                    lambda: layout.extend(buffer.get_dispatch_layout(topk_idx, num_experts)))
                ntpr, ntprr, ntpe, itr, _ = layout
                kwargs.update(num_tokens_per_rank=ntpr, num_tokens_per_rdma_rank=ntprr, is_token_in_rank=itr,
                              num_tokens_per_expert=ntpe)
            recv_x, recv_idx, recv_w, counts, handle, _ = buffer.dispatch(
                x, topk_idx=topk_idx, topk_weights=topk_weights, **kwargs)
        else:  # cached dispatch: the handle fixes the routing; no top-k (checked by dispatch())
            recv_x, recv_idx, recv_w, counts, _, _ = buffer.dispatch(x, handle=handle, **kwargs)
        ctx.buffer, ctx.handle, ctx.num_sms = buffer, handle, _num_sms(buffer, config)
        ctx.has_weights = topk_weights is not None
        ctx.x_rows = x.size(0)
        ctx.save_for_backward(recv_idx if recv_idx is not None else torch.empty(0))
        out.update(recv_topk_idx=recv_idx, num_recv_tokens_per_expert_list=counts, handle=handle)
        return recv_x, _weights_or_placeholder(ctx, recv_w)

    @staticmethod
    @first_order_only
    def backward(ctx, grad_recv_x, grad_recv_w):
        (recv_idx,) = ctx.saved_tensors
        grad_w_in = None
        if ctx.has_weights:
            # The forward value of a slot not on this rank is 0 whatever the weight: no gradient.
            grad_w_in = grad_recv_w.masked_fill(recv_idx < 0, 0.0).contiguous()
        grad_x, grad_w, _ = ctx.buffer.combine(grad_recv_x.to(_BF16).contiguous(), ctx.handle,
                                               topk_weights=grad_w_in, config=Config(ctx.num_sms))
        return grad_x, (grad_w if ctx.has_weights else None), None, None, None, None, None


class _Combine(torch.autograd.Function):
    """Inputs ``(x, topk_weights | None, buffer, handle, config)``; returns ``(combined_x,
    combined_topk_weights)`` (the latter an empty placeholder without weights)."""

    @staticmethod
    def forward(ctx, x, topk_weights, buffer, handle, config):
        combined_x, combined_w, _ = buffer.combine(x, handle, topk_weights=topk_weights, config=config)
        ctx.buffer, ctx.handle, ctx.num_sms = buffer, handle, _num_sms(buffer, config)
        ctx.wcols = topk_weights.size(1) if topk_weights is not None else -1
        return combined_x, _weights_or_placeholder(ctx, combined_w)

    @staticmethod
    @first_order_only
    def backward(ctx, grad_combined_x, grad_combined_w):
        g = grad_combined_x.to(_BF16).contiguous()
        n, hidden = g.shape
        if ctx.wcols >= 0:
            # One cached dispatch carries both gradients: rows of [bf16 x grad | float32 weight grad] bytes.
            gw = grad_combined_w.to(torch.float32).contiguous()
            packed = torch.cat([g.view(torch.uint8).view(n, 2 * hidden),
                                gw.view(torch.uint8).view(n, 4 * ctx.wcols)], dim=1)
            recv, *_ = ctx.buffer.dispatch(packed, handle=ctx.handle, config=Config(ctx.num_sms))
            rows = recv.size(0)
            grad_x = recv[:, :2 * hidden].contiguous().view(_BF16).view(rows, hidden)
            grad_w = recv[:, 2 * hidden:].contiguous().view(torch.float32).view(rows, ctx.wcols)
            return grad_x, grad_w, None, None, None
        grad_x, *_ = ctx.buffer.dispatch(g, handle=ctx.handle, config=Config(ctx.num_sms))
        return grad_x, None, None, None, None


def dispatch(buffer, x: torch.Tensor, topk_idx: torch.Tensor | None, topk_weights: torch.Tensor | None,
             num_experts: int | None, **dispatch_kwargs
             ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, list[int] | None, NormalHandle]:
    """Differentiable ``Buffer.dispatch`` (normal mode); backward = ``Buffer.combine`` through the handle.

    Args:
        buffer: a normal-mode :class:`deepep_ascend.Buffer`.
        x: ``[N, H]`` bfloat16 (see the module docstring for other dtypes); may require grad.
        topk_idx: ``[N, K]`` int64 global expert ids, -1 = none (``None`` for a cached dispatch).
        topk_weights: ``[N, K]`` float32, may require grad (``None`` for a cached dispatch).
        num_experts: ``E``; the layout is computed with ``buffer.get_dispatch_layout`` unless
            ``num_tokens_per_rank``, ``is_token_in_rank`` and ``num_tokens_per_expert`` are passed.
        **dispatch_kwargs: passed to ``Buffer.dispatch``: the layout tensors, ``handle`` (cached
            dispatch), ``expert_alignment``, ``num_worst_tokens``, ``config``, ``previous_event``.
            ``async_finish`` / ``allocate_on_comm_stream`` are refused (the outputs are complete
            on return).
    Returns:
        ``(recv_x [N_recv, H] bf16, recv_topk_idx [N_recv, K] int64 | None,
        recv_topk_weights [N_recv, K] float32 | None, num_recv_tokens_per_expert_list, handle)``
        as ``Buffer.dispatch`` (without the event). ``recv_x`` and ``recv_topk_weights`` carry
        gradients back to ``x`` and ``topk_weights``.
    Raises:
        TypeError: non-bf16 or FP8 ``x``; an unsupported keyword. Otherwise as ``Buffer.dispatch``
            (collective errors), in the forward and the backward pass.
    """
    cached = dispatch_kwargs.get("handle") is not None
    _refused_everywhere(buffer, "cached_dispatch" if cached else "dispatch",
                        lambda: _check_kwargs(dispatch_kwargs, _DISPATCH_KWARGS, "dispatch"),
                        lambda: _check_bf16(x, "dispatch"),
                        lambda: cached and _cached_problem("dispatch", topk_idx, topk_weights),
                        lambda: _rows_problem("dispatch", x, topk_idx))
    out = {}
    recv_x, recv_w = _Dispatch.apply(x, topk_weights, buffer, topk_idx, num_experts,
                                     tuple(dispatch_kwargs.items()), out)
    if topk_weights is None:
        recv_w = None
    return recv_x, out["recv_topk_idx"], recv_w, out["num_recv_tokens_per_expert_list"], out["handle"]


def combine(buffer, x: torch.Tensor, handle, topk_weights: torch.Tensor | None = None,
            config: Config | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Differentiable ``Buffer.combine`` (normal mode); backward = cached ``Buffer.dispatch`` through the handle.

    Args:
        buffer: the Buffer that made ``handle``.
        x: ``[N_recv, H]`` bfloat16, rows in dispatch order (typically the experts' weighted outputs).
        handle: the handle from :func:`dispatch` (or ``Buffer.dispatch``).
        topk_weights: optional ``[N_recv, K']`` float32, summed per original token like ``x``.
        config: optional :class:`Config` (its ``num_sms`` must match the dispatch's).
    Returns:
        ``(combined_x [N, H] bf16, combined_topk_weights [N, K'] float32 | None)``; both carry
        gradients back to ``x`` and ``topk_weights``.
    Raises:
        TypeError: non-bf16 ``x``. Otherwise as ``Buffer.combine``.
    """
    _refused_everywhere(buffer, "combine", lambda: _check_bf16(x, "combine"))
    combined_x, combined_w = _Combine.apply(x, topk_weights, buffer, handle, config)
    return combined_x, (combined_w if topk_weights is not None else None)


# ==================================================================================================
# Low-latency mode (docs/semantics/deepep-api.md §6)
# ==================================================================================================
# Buffer.low_latency_dispatch / low_latency_combine keyword arguments passed through (the rest are
# refused: the autograd path is synchronous and its inputs are ordinary tensors).
_LL_DISPATCH_KWARGS = ("cumulative_local_expert_recv_stats", "dispatch_wait_recv_cost_stats", "use_fp8",
                       "round_scale", "use_ue8m0")
_LL_COMBINE_KWARGS = ("use_logfmt", "combine_wait_recv_cost_stats")


def _ll_valid_rows(handle: LowLatencyHandle) -> torch.Tensor:
    """``[L, R·M]`` bool: the rows of the packed layout that hold a received (token, slot)."""
    count = (handle.layout_range & 0xFFFFFFFF).sum(1)  # [L] rows received per local expert
    return torch.arange(handle.src_info.size(1)).unsqueeze(0) < count.unsqueeze(1)


def _ll_same_slots(h_fwd: LowLatencyHandle, h_bwd: LowLatencyHandle, valid: torch.Tensor) -> None:
    """Raise unless ``h_bwd`` has ``h_fwd``'s slots: same per-expert ranges (``layout_range``), so the same
    valid rows (``valid = _ll_valid_rows(h_fwd)``), and the same source of every valid row."""
    if not (torch.equal(h_fwd.layout_range, h_bwd.layout_range)
            and torch.equal(h_fwd.src_info[valid], h_bwd.src_info[valid])):
        raise RuntimeError("deepep_ascend.nn.autograd.low_latency_combine backward: the dispatch of the gradient did "
                           "not land in the forward handle's slots (were ranks masked between forward and "
                           "backward, or is `topk_idx` not the dispatch's?)")


def _ll_repeat_rank(handle: LowLatencyHandle, valid: torch.Tensor) -> torch.Tensor:
    """``[L, R·M, 1]`` int64: for each valid row, how many earlier rows of its local expert hold the same
    (source, token), i.e. which repeat of the expert in that token's ``topk_idx`` row it is (0 unless the
    row lists the expert twice, docs/semantics/deepep-api.md §0). A (source, token)'s rows for one expert are
    consecutive, in slot order (the packed layout of ``Buffer.low_latency_dispatch``)."""
    L, rows = handle.src_info.shape
    count = (handle.layout_range & 0xFFFFFFFF).reshape(-1)  # [L·R] rows per (local expert, source)
    m = handle.num_max_dispatch_tokens_per_rank
    # valid rows in row-major order are grouped by (expert, source): key = that group, then the token
    key = torch.repeat_interleave(torch.arange(count.numel()), count) * m + handle.src_info[valid].to(torch.int64)
    out = torch.zeros(L, rows, dtype=torch.int64)
    if key.numel():
        pos = torch.arange(key.numel())
        first = torch.ones(key.numel(), dtype=torch.bool)
        first[1:] = key[1:] != key[:-1]
        out[valid] = pos - torch.where(first, pos, 0).cummax(0).values
    return out.unsqueeze(-1)


def _ll_narrow_cols(k: int) -> int:
    """bf16 columns of the backward's weight/index dispatch and dot-product combine: ``4K`` (``3K`` used), so rows
    are whole 8-byte words (the LL engine views message bytes as int32) and their width tells the top-k: ranks of
    different top-k meet in that dispatch with different hidden sizes, which its header refuses on every rank."""
    return 4 * k


def _split3(v: torch.Tensor):
    """float32 ``v`` -> bf16 ``(hi, mid, lo)`` with ``f32(hi) + f32(mid) + f32(lo) == v`` exactly
    (24 significand bits = 3 x 8; exact for 2^-100 < |v| < 3e38 and for 0)."""
    hi = v.to(_BF16)
    r = v - hi.float()  # exact in float32
    mid = r.to(_BF16)
    lo = (r - mid.float()).to(_BF16)  # <= 8 significant bits left: exact
    return hi, mid, lo


class _LLDispatch(torch.autograd.Function):
    """Inputs ``(x, buffer, topk_idx, M, E, kwargs, out)``; returns the packed bf16 ``recv_x`` and
    fills ``out`` with ``recv_count`` and ``handle``."""

    @staticmethod
    def forward(ctx, x, buffer, topk_idx, m, num_experts, kwargs, out):
        recv_x, recv_count, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, m, num_experts,
                                                                       **dict(kwargs))
        ctx.buffer, ctx.handle = buffer, handle
        ctx.save_for_backward(topk_idx)
        out.update(recv_count=recv_count, handle=handle)
        return recv_x

    @staticmethod
    @first_order_only
    def backward(ctx, grad_recv_x):
        (topk_idx,) = ctx.saved_tensors
        # Adjoint of "copy token t into each of its slots": sum the slots' gradients = combine with
        # weight 1 per slot (-1 slots and padding rows are skipped by the combine itself).
        ones = torch.ones(topk_idx.shape, dtype=torch.float32)
        grad_x, _, _ = ctx.buffer.low_latency_combine(grad_recv_x.to(_BF16).contiguous(), topk_idx, ones, ctx.handle)
        return grad_x, None, None, None, None, None, None


class _LLCombine(torch.autograd.Function):
    """Inputs ``(x, topk_weights, buffer, topk_idx, handle, kwargs)``; returns ``combined_x``."""

    @staticmethod
    def forward(ctx, x, topk_weights, buffer, topk_idx, handle, kwargs):
        combined, _, _ = buffer.low_latency_combine(x, topk_idx, topk_weights, handle, **dict(kwargs))
        ctx.buffer, ctx.handle = buffer, LowLatencyHandle._make(handle)  # a plain 5-tuple passed the call's checks
        ctx.save_for_backward(x, topk_weights, topk_idx)
        return combined

    @staticmethod
    @first_order_only
    def backward(ctx, grad_combined):
        y, w, topk_idx = ctx.saved_tensors
        buffer, handle = ctx.buffer, ctx.handle
        m, num_experts = handle.num_max_dispatch_tokens_per_rank, handle.num_experts
        n, k = topk_idx.shape
        L = y.size(0)
        cols = _ll_narrow_cols(k)  # 4K: 8-byte rows, one width per top-k
        need = type(buffer).get_low_latency_rdma_size_hint(m, cols, buffer.group_size, num_experts)
        if buffer.num_rdma_bytes < need:  # refused in this backward's first call, so that every peer raises too
            buffer.refuse_call("low_latency_dispatch", ValueError(
                f"rank {buffer.rank}: deepep_ascend.nn.autograd.low_latency_combine backward: its weight-row dispatch "
                f"carries 4 x top-k = {cols} bf16 columns (H={cols}), and num_rdma_bytes={buffer.num_rdma_bytes} is "
                f"below get_low_latency_rdma_size_hint(M={m}, H={cols}, R={buffer.group_size}, E={num_experts}) = "
                f"{need}; size a Buffer for the autograd pair with deepep_ascend.nn.MoE."
                f"get_low_latency_rdma_size_hint(M, H, R, E, top_k), which takes max(H, 4 x top-k)"))
        # (1) g[t] into every slot of token t: the forward's slots (same routing), checked.
        g = grad_combined.to(_BF16).contiguous()
        recv_g, _, h_g, _, _ = buffer.low_latency_dispatch(g, topk_idx, m, num_experts, use_fp8=False)
        valid = _ll_valid_rows(handle)  # [L, R·M]
        _ll_same_slots(handle, h_g, valid)
        # (2) each token's weights (float32 bits) and experts (low 16 bits) to its slots, verbatim.
        idx16 = (topk_idx & 0xFFFF).to(torch.int32).to(torch.int16)  # -1 -> 0xFFFF, no expert (E < 65536)
        meta = torch.cat([dense(w.to(torch.float32)).view(torch.int16).view(n, 2 * k), idx16,
                          torch.zeros(n, cols - 3 * k, dtype=torch.int16)], dim=1)
        # Each expert reads its sources' weight rows by its own K: the plain calls take a top-k per rank, this
        # backward one top-k on every rank, which this dispatch's header checks (its width is 4K) at no cost.
        try:
            recv_meta, _, h_m, _, _ = buffer.low_latency_dispatch(meta.view(_BF16), topk_idx, m, num_experts,
                                                                  use_fp8=False)
        except CallMismatch:
            raise  # the ranks are in different kinds of calls: not this dispatch's width
        except ConsensusError as exc:
            raise ConsensusError(
                f"rank {buffer.rank}: deepep_ascend.nn.autograd.low_latency_combine backward: the ranks' top-k differ "
                f"(topk_idx.size(1)); the low-latency autograd pair needs one top-k on every rank. Its dispatch of "
                f"weight rows, 4 x top-k columns wide (H below), was refused: {exc}") from None
        _ll_same_slots(handle, h_m, valid)
        recv_meta = recv_meta.view(torch.int16)  # [L, R·M, 4K]
        slot_w = recv_meta[..., :2 * k].contiguous().view(torch.float32)  # [L, R·M, K]
        slot_e = recv_meta[..., 2 * k:3 * k].to(torch.int32) & 0xFFFF
        experts = (buffer.rank * L + torch.arange(L, dtype=torch.int32)).view(L, 1, 1)
        # The slot's top-k column: among the columns listing this expert, the one this row repeats (the
        # first unless the token lists the expert twice).
        matches = slot_e == experts  # [L, R·M, K]
        nth = (matches.cumsum(-1) - 1 == _ll_repeat_rank(handle, valid)) & matches
        j = nth.to(torch.int8).argmax(-1, keepdim=True)  # [L, R·M, 1]
        wj = slot_w.gather(-1, j).masked_fill(~valid.unsqueeze(-1), 0.0)  # [L, R·M, 1]
        g32 = recv_g.float()
        grad_y = (g32 * wj).to(_BF16) if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            # (3) dot(g[t], y[slot]) per slot, back to (t, j) exactly as three bf16 parts.
            dots = (g32 * y.float()).sum(-1, keepdim=True).masked_fill(~valid.unsqueeze(-1), 0.0)
            rows = torch.zeros(L, y.size(1), cols, dtype=_BF16)
            for p, part in enumerate(_split3(dots)):
                rows.scatter_(-1, j + p * k, part)
            ones = torch.ones(n, k, dtype=torch.float32)
            parts, _, _ = buffer.low_latency_combine(rows, topk_idx, ones, h_m)  # h_m: the narrow call's handle
            parts = parts.float()
            grad_w = (parts[:, :k] + parts[:, k:2 * k]) + parts[:, 2 * k:3 * k]
            grad_w = grad_w.to(w.dtype)
        return grad_y, grad_w, None, None, None, None


def low_latency_dispatch(buffer, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                         num_experts: int, **kwargs
                         ) -> tuple[torch.Tensor | tuple[torch.Tensor, torch.Tensor], torch.Tensor, LowLatencyHandle]:
    """Differentiable ``Buffer.low_latency_dispatch``; backward = ``Buffer.low_latency_combine`` with unit weights.

    Args:
        buffer: a low-latency :class:`deepep_ascend.Buffer` (``low_latency_mode=True``).
        x: ``[N, H]`` bfloat16, ``N <= M``; may require grad.
        topk_idx: ``[N, K]`` int64 global expert ids, -1 = none (an expert listed twice is two slots,
            docs/semantics/deepep-api.md §0).
        num_max_dispatch_tokens_per_rank: ``M``, the same on every rank.
        num_experts: ``E``, a multiple of the number of ranks ``R``; ``L = E / R``.
        **kwargs: passed to ``Buffer.low_latency_dispatch``: ``use_fp8`` (default ``True`` as there;
            must be ``False`` when ``x`` requires grad), ``round_scale``, ``use_ue8m0``,
            ``cumulative_local_expert_recv_stats``, ``dispatch_wait_recv_cost_stats``.
            ``async_finish`` / ``return_recv_hook`` are refused.
    Returns:
        ``(recv_x [L, R·M, H] bf16, recv_count [L] int32, handle)`` as ``Buffer.low_latency_dispatch``
        (without the event and hook). ``recv_x`` carries gradients back to ``x``: the gradient of
        token ``t`` is the sum over its valid slots of the slots' gradients (float32, top-k order,
        one rounding to bf16); padding rows (past ``recv_count``) get none.
    Raises:
        TypeError: non-bf16 ``x``; ``use_fp8=True`` with ``x`` requiring grad; an unsupported keyword.
            Otherwise as ``Buffer.low_latency_dispatch`` / ``low_latency_combine`` (collective errors),
            in the forward and the backward pass.
    """
    differentiable = isinstance(x, torch.Tensor) and x.requires_grad and torch.is_grad_enabled()

    def grad_checks():
        if not differentiable:
            return
        _check_bf16(x, "low_latency_dispatch", "Buffer.low_latency_combine")
        if kwargs.get("use_fp8", True):
            raise TypeError("deepep_ascend.nn.autograd.low_latency_dispatch: use_fp8=True (the default, as in DeepEP) "
                            "is not differentiable; pass use_fp8=False when `x` requires grad")

    _refused_everywhere(buffer, "low_latency_dispatch",
                        lambda: _check_kwargs(kwargs, _LL_DISPATCH_KWARGS, "low_latency_dispatch"), grad_checks)
    if not differentiable and kwargs.get("use_fp8", True):  # nothing to differentiate: the plain call (FP8 outputs)
        recv_x, recv_count, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank,
                                                                       num_experts, **kwargs)
        return recv_x, recv_count, handle
    out = {}
    recv_x = _LLDispatch.apply(x, buffer, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                               tuple(kwargs.items()), out)
    return recv_x, out["recv_count"], out["handle"]


def low_latency_combine(buffer, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle,
                        **kwargs) -> torch.Tensor:
    """Differentiable ``Buffer.low_latency_combine``; backward = LL dispatches of the gradient (module docstring).

    Args:
        buffer: the Buffer that made ``handle``.
        x: ``[L, R·M, H]`` bfloat16 expert outputs in the dispatch's packed layout; may require grad.
        topk_idx: the dispatch's ``[N, K]`` int64 routing.
        topk_weights: ``[N, K]`` float32; may require grad.
        handle: the handle from :func:`low_latency_dispatch` (or ``Buffer.low_latency_dispatch``).
        **kwargs: ``use_logfmt``, ``combine_wait_recv_cost_stats`` (passed on); ``zero_copy``,
            ``out``, ``async_finish``, ``return_recv_hook`` are refused.
    Returns:
        ``combined_x [N, H]`` bf16, ``bf16(sum_j f32(x[slot(t, j)]) * w[t, j])``. Gradients:
        ``x``: ``bf16(w[t, j] * g[t])`` in slot ``(t, j)``'s row, 0 in padding rows;
        ``topk_weights``: float32 ``dot(g[t], x[slot(t, j)])``, 0 for -1 slots.
    Raises:
        TypeError: non-bf16 ``x``; an unsupported keyword. Otherwise as ``Buffer.low_latency_combine``
            (forward) and ``Buffer.low_latency_dispatch`` / ``low_latency_combine`` (backward).
            RuntimeError (backward): the gradient's dispatch did not land in the handle's slots.
            ConsensusError (a ``ValueError``; backward, on every rank): the ranks' ``topk_idx`` have
            different top-k (the forward, like the plain calls, takes them); the message gives each rank's
            ``H = 4K`` of the refused weight-row dispatch. The Buffer stays usable.
            ValueError (backward, on every rank, in its first call): the Buffer's ``num_rdma_bytes`` is
            below the hint for calls of ``hidden = 4K`` (only if that exceeds ``H``; the message names
            ``MoE.get_low_latency_rdma_size_hint``, which sizes for both). The Buffer stays usable.
    """
    _refused_everywhere(buffer, "low_latency_combine",
                        lambda: _check_kwargs(kwargs, _LL_COMBINE_KWARGS, "low_latency_combine"),
                        lambda: _check_bf16(x, "low_latency_combine", "Buffer.low_latency_dispatch"))
    return _LLCombine.apply(x, topk_weights, buffer, topk_idx, handle, tuple(kwargs.items()))


# ==================================================================================================
# EPBuffer (DeepEP V2.5, docs/semantics/deepep-api.md §13)
# ==================================================================================================
# EPBuffer.dispatch / combine keyword arguments passed through; the rest are refused (the autograd path
# is synchronous, its outputs complete on return, and FP8 rows are not differentiable).
_EP_DISPATCH_KWARGS = ("num_experts", "cumulative_local_expert_recv_stats", "num_max_tokens_per_rank",
                       "expert_alignment", "num_sms", "num_qps", "previous_event", "allocate_on_comm_stream",
                       "handle", "do_cpu_sync", "do_expand", "do_zero_padding")
_EP_COMBINE_KWARGS = ("num_sms", "num_qps", "previous_event", "allocate_on_comm_stream")


class _EPDispatch(torch.autograd.Function):
    """Inputs ``(x, topk_weights | None, buffer, topk_idx, kwargs, out)``; returns ``(recv_x,
    recv_topk_weights)`` (the latter an empty placeholder without weights) and fills ``out`` with
    ``recv_topk_idx`` and ``handle``."""

    @staticmethod
    def forward(ctx, x, topk_weights, buffer, topk_idx, kwargs, out):
        recv_x, recv_idx, recv_w, handle, _ = buffer.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights,
                                                              **dict(kwargs))
        ctx.buffer, ctx.handle = buffer, handle
        ctx.has_weights = topk_weights is not None
        out.update(recv_topk_idx=recv_idx, handle=handle)
        return recv_x, _weights_or_placeholder(ctx, recv_w)

    @staticmethod
    @first_order_only
    def backward(ctx, grad_recv_x, grad_recv_w):
        # combine returns each slot's weight from the rank that owns it, so the gradient of a slot that is
        # not local (forward value 0) is never read: no masking needed
        grad_w_in = grad_recv_w.to(torch.float32).contiguous() if ctx.has_weights else None
        grad_x, grad_w, _ = ctx.buffer.combine(grad_recv_x.to(_BF16).contiguous(), ctx.handle, topk_weights=grad_w_in)
        return grad_x, (grad_w if ctx.has_weights else None), None, None, None, None


class _EPCombine(torch.autograd.Function):
    """Inputs ``(x, topk_weights | None, bias0 | None, bias1 | None, buffer, handle, kwargs)``; returns
    ``(combined_x, combined_topk_weights)`` (the latter an empty placeholder without weights)."""

    @staticmethod
    def forward(ctx, x, topk_weights, bias0, bias1, buffer, handle, kwargs):
        bias = bias0 if bias1 is None else (bias0, bias1)
        combined_x, combined_w, _ = buffer.combine(x, handle, topk_weights=topk_weights, bias=bias, **dict(kwargs))
        ctx.buffer, ctx.handle = buffer, handle
        ctx.has_weights = topk_weights is not None
        ctx.biases = (bias0 is not None, bias1 is not None)
        return combined_x, _weights_or_placeholder(ctx, combined_w)

    @staticmethod
    @first_order_only
    def backward(ctx, grad_combined_x, grad_combined_w):
        g = grad_combined_x.to(_BF16).contiguous()
        gw = grad_combined_w.to(torch.float32).contiguous() if ctx.has_weights else None
        expand = ctx.handle.do_expand
        grad_x, _, grad_w, _, _ = ctx.buffer.dispatch(g, topk_weights=gw, handle=ctx.handle, do_expand=expand,
                                                      do_zero_padding=expand)
        grad_b = [g if has else None for has in ctx.biases]
        return grad_x, grad_w, grad_b[0], grad_b[1], None, None, None


def ep_dispatch(buffer, x: torch.Tensor, topk_idx: torch.Tensor | None = None,
                topk_weights: torch.Tensor | None = None, **dispatch_kwargs):
    """Differentiable ``EPBuffer.dispatch`` (DeepEP V2.5's ``deep_ep.EPBuffer.dispatch``); backward =
    ``EPBuffer.combine`` of the gradients through the handle (module docstring).

    Args:
        buffer: a :class:`deepep_ascend.EPBuffer` (or ``ElasticBuffer``).
        x: ``[N, H]`` bfloat16, ``N <= num_max_tokens_per_rank``; may require grad.
        topk_idx: ``[N, K]`` int64 global expert ids, -1 = none (``None`` for a cached dispatch with
            ``handle=``).
        topk_weights: ``[N, K]`` float32 or None; may require grad (also with ``handle=``: dispatched again).
        **dispatch_kwargs: passed to ``EPBuffer.dispatch``: ``num_experts``, ``expert_alignment``,
            ``do_expand``, ``do_zero_padding``, ``do_cpu_sync``, ``num_max_tokens_per_rank``, ``handle``,
            ``cumulative_local_expert_recv_stats``, ``previous_event``, ``num_sms``, ``num_qps``,
            ``allocate_on_comm_stream``. ``async_with_compute_stream``, ``defer_epilogue``,
            ``do_handle_copy`` and ``use_tma_aligned_col_major_sf`` are refused.
    Returns:
        ``(recv_x, recv_topk_idx, recv_topk_weights, handle)`` as ``EPBuffer.dispatch`` (without the
        event): compact layout ``recv_x [n, H]`` bf16, ``recv_topk_idx [n, K]`` local ids / -1,
        ``recv_topk_weights [n, K]`` float32; expanded layout (``do_expand=True``) ``recv_x [rows, H]``
        grouped by local expert (expert ``e``'s rows ``[align(psum[e-1]), psum[e])``, ``psum =
        handle.psum_num_recv_tokens_per_expert``), ``recv_topk_idx`` None, ``recv_topk_weights [rows]``.
        ``recv_x`` and ``recv_topk_weights`` carry gradients back to ``x`` and ``topk_weights``.
    Raises:
        TypeError: non-bf16 or FP8 ``x``; an unsupported keyword. Otherwise as ``EPBuffer.dispatch``
            (forward) and ``EPBuffer.combine`` (backward): errors raised on every rank.
    """
    _refused_everywhere(buffer, "cached_dispatch" if dispatch_kwargs.get("handle") is not None else "dispatch",
                        lambda: _check_kwargs(dispatch_kwargs, _EP_DISPATCH_KWARGS, "ep_dispatch"),
                        lambda: _check_bf16(x, "ep_dispatch", "EPBuffer.combine"))
    out = {}
    recv_x, recv_w = _EPDispatch.apply(x, topk_weights, buffer, topk_idx, tuple(dispatch_kwargs.items()), out)
    return recv_x, out["recv_topk_idx"], (recv_w if topk_weights is not None else None), out["handle"]


def ep_combine(buffer, x: torch.Tensor, handle, topk_weights: torch.Tensor | None = None, bias=None,
               **combine_kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Differentiable ``EPBuffer.combine`` (DeepEP V2.5's ``deep_ep.EPBuffer.combine``); backward = a
    cached ``EPBuffer.dispatch`` of the gradients through the handle (module docstring).

    Args:
        buffer: the EPBuffer that made ``handle``.
        x: bfloat16 ``[handle.num_recv_tokens, H]`` (compact) or ``[handle.num_expanded_tokens, H]``
            (expanded), rows in the dispatch's order; may require grad.
        handle: the :class:`~deepep_ascend.EPHandle` of :func:`ep_dispatch` (or ``EPBuffer.dispatch``).
        topk_weights: optional float32 ``[num_recv_tokens, K]`` (expanded: ``[num_expanded_tokens]``);
            may require grad.
        bias: None, a ``[N, H]`` bf16 tensor or a pair of them, added once per token; may require grad.
        **combine_kwargs: ``previous_event``, ``num_sms``, ``num_qps``, ``allocate_on_comm_stream``;
            ``async_with_compute_stream`` and ``defer_epilogue`` are refused.
    Returns:
        ``(combined_x [N, H] bf16, combined_topk_weights [N, K] float32 | None)``. Gradients: ``x``
        gets each token's ``combined_x`` gradient in every row (slot) of the token, zeros in alignment
        gaps; ``topk_weights`` the gradient of each slot's ``combined_topk_weights`` on the rank owning
        the slot, 0 elsewhere; each bias the ``combined_x`` gradient (bf16).
    Raises:
        TypeError: non-bf16 ``x``; an unsupported keyword. Otherwise as ``EPBuffer.combine`` (forward)
            and ``EPBuffer.dispatch`` (backward).
    """
    def bias_check():
        if isinstance(bias, tuple) and len(bias) != 2:
            raise ValueError(f"deepep_ascend.nn.autograd.ep_combine: `bias` must be a tensor or a pair, got "
                             f"{len(bias)} items")

    _refused_everywhere(buffer, "combine", lambda: _check_kwargs(combine_kwargs, _EP_COMBINE_KWARGS, "ep_combine"),
                        lambda: _check_bf16(x, "ep_combine", "EPBuffer.dispatch"), bias_check)
    bias0, bias1 = bias if isinstance(bias, tuple) else (bias, None)
    combined_x, combined_w = _EPCombine.apply(x, topk_weights, bias0, bias1, buffer, handle,
                                              tuple(combine_kwargs.items()))
    return combined_x, (combined_w if topk_weights is not None else None)
