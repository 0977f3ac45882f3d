"""Differentiable normal-mode dispatch and combine: each one's backward is the other (spec §4.7).

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

Low-latency mode (``low_latency_dispatch`` / ``low_latency_combine``) does not exist in
``deepep_ascend`` yet; its autograd pair will join this module with it.

Example (every rank)::

    recv_x, recv_idx, recv_w, counts, handle = deepep_ascend.autograd.dispatch(
        buffer, x.bfloat16(), topk_idx, topk_weights, num_experts)
    y = experts(recv_x, recv_idx, recv_w, counts)           # [N_recv, H] bf16, weights applied
    out, _ = deepep_ascend.autograd.combine(buffer, y, handle)
    out.float().pow(2).mean().backward()                     # two collective calls per direction
"""

from __future__ import annotations

import torch

from .config import Config

__all__ = ["combine", "dispatch"]

_BF16 = torch.bfloat16
# Buffer.dispatch keyword arguments that dispatch() passes through (the rest are refused: the
# autograd path is synchronous, outputs are complete on return).
_DISPATCH_KWARGS = ("handle", "num_tokens_per_rank", "num_tokens_per_rdma_rank", "is_token_in_rank",
                    "num_tokens_per_expert", "expert_alignment", "num_worst_tokens", "config", "previous_event")


def _num_sms(buffer, config) -> int:
    return config.num_sms if config is not None else type(buffer).num_sms


def _check_bf16(x, op: str) -> None:
    if isinstance(x, tuple):
        raise TypeError(f"deepep_ascend.autograd.{op}: FP8 (data, scales) inputs are not differentiable; "
                        f"pass bfloat16 `x`")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"deepep_ascend.autograd.{op}: `x` must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != _BF16:
        raise TypeError(f"deepep_ascend.autograd.{op}: `x` must be bfloat16, got {x.dtype}: the backward pass "
                        f"goes through Buffer.combine, which is bf16-only as in DeepEP; cast first with "
                        f"x.bfloat16() (differentiable)")


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
                ntpr, ntprr, ntpe, itr, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
                kwargs.update(num_tokens_per_rank=ntpr, num_tokens_per_rdma_rank=ntprr, is_token_in_rank=itr,
                              num_tokens_per_expert=ntpe)
            recv_x, recv_idx, recv_w, counts, handle, _ = buffer.dispatch(
                x, topk_idx=topk_idx, topk_weights=topk_weights, **kwargs)
        else:  # cached dispatch: the handle fixes the routing; no top-k
            if topk_idx is not None or topk_weights is not None:
                raise ValueError("deepep_ascend.autograd.dispatch: a cached dispatch (handle=...) takes "
                                 "topk_idx=None and topk_weights=None")
            recv_x, recv_idx, recv_w, counts, _, _ = buffer.dispatch(x, handle=handle, **kwargs)
        ctx.buffer, ctx.handle, ctx.num_sms = buffer, handle, _num_sms(buffer, config)
        ctx.has_weights = topk_weights is not None
        ctx.x_rows = x.size(0)
        ctx.save_for_backward(recv_idx if recv_idx is not None else torch.empty(0))
        out.update(recv_topk_idx=recv_idx, num_recv_tokens_per_expert_list=counts, handle=handle)
        if recv_w is None:
            recv_w = torch.empty(0, dtype=torch.float32)
            ctx.mark_non_differentiable(recv_w)
        return recv_x, recv_w

    @staticmethod
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
        if combined_w is None:
            combined_w = torch.empty(0, dtype=torch.float32)
            ctx.mark_non_differentiable(combined_w)
        return combined_x, combined_w

    @staticmethod
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
             num_experts: int | None, **dispatch_kwargs):
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
    bad = sorted(set(dispatch_kwargs) - set(_DISPATCH_KWARGS))
    if bad:
        raise TypeError(f"deepep_ascend.autograd.dispatch: unsupported keyword(s) {bad}; allowed: "
                        f"{list(_DISPATCH_KWARGS)} (the autograd path is synchronous)")
    _check_bf16(x, "dispatch")
    out = {}
    recv_x, recv_w = _Dispatch.apply(x, topk_weights, buffer, topk_idx, num_experts,
                                     tuple(dispatch_kwargs.items()), out)
    if topk_weights is None:
        recv_w = None
    return recv_x, out["recv_topk_idx"], recv_w, out["num_recv_tokens_per_expert_list"], out["handle"]


def combine(buffer, x: torch.Tensor, handle, topk_weights: torch.Tensor | None = None, config: Config | None = None):
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
    _check_bf16(x, "combine")
    combined_x, combined_w = _Combine.apply(x, topk_weights, buffer, handle, config)
    return combined_x, (combined_w if topk_weights is not None else None)
