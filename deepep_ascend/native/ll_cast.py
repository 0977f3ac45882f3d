"""The low-latency dispatch's FP8 messages written straight from the BF16 rows (``csrc/ll_cast.c``).

The FP8 cast of a low-latency dispatch (docs/semantics/deepep-api.md §6.4) is the largest part of a
decode step's dispatch on the torch path: about eight passes over float32 temporaries of ``N x H``. The
kernel makes one pass per token and writes each message's bytes once, the bits of that torch path.
"""

from __future__ import annotations

import torch

from .loader import kernels
from .operands import write_refusal

__all__ = ["ll_cast_message_bytes", "ll_cast_messages"]

_GROUP = 128


def ll_cast_message_bytes(hidden: int, use_ue8m0: bool) -> int:
    """Bytes of one FP8 dispatch message: the 16-byte header, ``hidden`` e4m3 codes, then ``hidden / 128``
    float32 scales, or with ``use_ue8m0`` ``hidden / 512`` int32 words of packed exponent bytes."""
    return 16 + hidden + (hidden // _GROUP if use_ue8m0 else 4 * (hidden // _GROUP))


def ll_cast_messages(x: torch.Tensor, out: torch.Tensor, round_scale: bool, use_ue8m0: bool) -> bool:
    """Write ``x``'s FP8 dispatch messages into ``out`` (the cast inside DeepEP's ``low_latency_dispatch``).

    Row ``t`` of ``out`` becomes ``[int32 t | 12 zero bytes | e4m3 codes (H B) | scales]``: per group of 128
    channels, ``amax`` over its non-NaN ``|x|`` floored at ``f32(1e-4)``; without ``round_scale`` codes
    ``e4m3(clamp(x · (448 / amax), ±448))`` and the float32 scale ``amax · f32(1/448)``; with ``round_scale``
    the scale rounded up to a power of two ``2^(e-127)`` (``e`` clamped to ``[1, 254]``) and codes of ``x ·
    2^(127-e)``; with ``use_ue8m0`` the scale's exponent byte ``e`` instead of its float32 (bytes of groups
    ``4p..4p+3`` form int32 word ``p``, little-endian). A NaN element gives the NaN code with its sign bit
    (``0x7f`` / ``0xff``); an infinity gives NaN without ``round_scale`` (scale ``inf``), ``±448`` with it. The bits of
    :func:`deepep_ascend.gemm.fp8.low_latency_cast_to_fp8_` followed by
    :func:`deepep_ascend.gemm.scales.pack_ue8m0_to_int` (docs/semantics/deepep-api.md §6.4).

    Args:
        x: ``[N, H]`` bfloat16 CPU matrix, unit column stride (any row stride), ``H % 128 == 0`` (``% 512`` with
            ``use_ue8m0``).
        out: ``[N, mb]`` uint8 CPU matrix, unit column stride, rows apart, not overlapping ``x``, with ``mb =``
            :func:`ll_cast_message_bytes` ``(H, use_ue8m0)``; every byte is written.
        round_scale: power-of-two scales. use_ue8m0: exponent-byte scales (needs ``round_scale``).
    Returns:
        True when written; False (nothing written) where the kernel is not loaded.
    Raises:
        ValueError: any operand outside the above (nothing written).
    """
    fn = kernels.ll_cast_messages
    if fn is None:
        return False
    op = "deepep_ascend.native.ll_cast_messages"
    # Checked with the cheapest tensor attributes (shape, stride(), is_cpu): this runs once per dispatch, and at a
    # decode step's few tokens these checks would otherwise cost more than the cast.
    if not (isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16 and x.is_cpu and x.dim() == 2
            and (x.stride()[1] == 1 or x.shape[1] <= 1)):
        raise ValueError(f"{op}: x must be a 2-D CPU torch.bfloat16 matrix with unit column stride, got "
                         f"{getattr(x, 'dtype', type(x).__name__)} of shape {tuple(getattr(x, 'shape', ()))}")
    n, hidden = x.shape
    if use_ue8m0 and not round_scale:
        raise ValueError(f"{op}: use_ue8m0=True needs round_scale=True, got round_scale={round_scale!r}")
    step = 512 if use_ue8m0 else _GROUP
    if hidden % step:
        raise ValueError(f"{op}: x's hidden size must be a multiple of {step}"
                         f"{' (use_ue8m0)' if use_ue8m0 else ''}, got {hidden}")
    mb = ll_cast_message_bytes(hidden, bool(use_ue8m0))
    if not (isinstance(out, torch.Tensor) and out.dtype == torch.uint8 and out.is_cpu and out.dim() == 2
            and tuple(out.shape) == (n, mb) and out.stride()[1] == 1):
        raise ValueError(f"{op}: out must be a [{n}, {mb}] CPU uint8 matrix with unit column stride, got "
                         f"{getattr(out, 'dtype', type(out).__name__)} of shape {tuple(getattr(out, 'shape', ()))}")
    x_ld, out_ld = x.stride()[0], out.stride()[0] if n > 1 else mb
    # write_refusal only where one of its cases can apply (it reads the slower attributes)
    why = write_refusal("out", out) if out.requires_grad or out.is_inference() or out_ld < mb else None
    if why is None and n:  # the byte extents of the two
        x0, o0 = x.data_ptr(), out.data_ptr()
        if x0 < o0 + (n - 1) * out_ld + mb and o0 < x0 + 2 * ((n - 1) * x_ld + hidden):
            why = "out overlaps x"
    if why:
        raise ValueError(f"{op}: {why}")
    if fn(n, hidden, x.data_ptr(), x_ld, int(bool(round_scale)), int(bool(use_ue8m0)), out.data_ptr(), out_ld):
        raise ValueError(f"{op}: the kernel refused hidden={hidden}, use_ue8m0={use_ue8m0}")  # checked above
    if not out.is_inference():  # mark_written(out), without its generality
        torch.autograd.graph.increment_version(out)
    return True
