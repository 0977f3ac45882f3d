"""LogFMT-10 in C (``csrc/logfmt.c``): the metadata of each group of 128 channels, the groups' parameters, the
encoded body and tail, and the decoded values. Each gives the bits of :mod:`deepep_ascend.gemm.logfmt`'s torch path
(docs/semantics/deepep-api.md §6.3).

Each wrapper checks its operands (contiguous CPU tensors of the dtypes and shapes named; ``ValueError``
otherwise, nothing written), returns False where the library is not loaded, and otherwise writes its outputs.
"""

from __future__ import annotations

import torch

from .loader import kernels
from .operands import mark_written, overlap, require_dense, write_refusal

__all__ = ["logfmt_avx512", "logfmt_decode", "logfmt_encode", "logfmt_meta", "logfmt_params"]

_GROUP, _BODY, _TAIL = 128, 160, 96


def _shape(op: str, name: str, t: torch.Tensor, shape: tuple) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"deepep_ascend.native.{op}: {name} must be {list(shape)}, got {list(t.shape)}")


def _groups(op: str, name: str, t: torch.Tensor, dtype: torch.dtype, cols: int) -> int:
    """Check ``t``, a contiguous ``[G, cols]`` ``dtype`` tensor; returns ``G``."""
    require_dense(op, name, t, dtype, ndim=2)
    if t.size(1) != cols:
        raise ValueError(f"deepep_ascend.native.{op}: {name} must be [G, {cols}], got {tuple(t.shape)}")
    return t.size(0)


def _tail_rows(op: str, tail: torch.Tensor, use: torch.Tensor, g: int) -> int:
    """Check ``use`` (bool ``[G]``) and ``tail`` (uint8 ``[F, 96]``, ``F`` the groups without use); returns ``F``."""
    require_dense(op, "use", use, torch.bool, numel=g, ndim=1)
    require_dense(op, "tail", tail, torch.uint8, ndim=2)
    num_tail = g - int(use.sum()) if g else 0
    if tuple(tail.shape) != (num_tail, _TAIL):
        raise ValueError(f"deepep_ascend.native.{op}: tail must be [{num_tail}, {_TAIL}] (one row per group without "
                         f"use), got {tuple(tail.shape)}")
    return num_tail


def _outputs(op: str, inputs: dict, outputs: dict) -> None:
    """Refuse outputs torch would not write in place, or that overlap an input or each other."""
    operands = {**inputs, **outputs}
    for name, t in outputs.items():
        why = write_refusal(name, t if t.dim() == 2 else t.view(1, -1))  # (dense: one row, nothing to overlap)
        if why:
            raise ValueError(f"deepep_ascend.native.{op}: {why}")
        for other, u in operands.items():
            if other != name and overlap(t, u):
                raise ValueError(f"deepep_ascend.native.{op}: {name} overlaps {other}")


def logfmt_avx512(enable: bool | None = None) -> bool:
    """Whether the kernels' AVX-512 paths run (they do where the CPU has AVX-512F); ``enable`` False turns them off
    (the portable C paths, the same bits), True back on where the CPU has it, None leaves them. Returns the state
    after the call; False where the library is not loaded."""
    fn = kernels.logfmt_avx512
    if fn is None:
        return False
    return bool(fn(-1 if enable is None else int(bool(enable))))


def logfmt_meta(x: torch.Tensor, meta: torch.Tensor) -> bool:
    """``meta[g] = (amax, amin)`` of each group ``x[g]``: the largest magnitude and the smallest nonzero one (0 for
    an all-zero group), as bf16 bits without the sign (a NaN above inf, as its bits order).

    Args:
        x: int16 ``[G, 128]`` contiguous, the groups' bf16 bits.
        meta: int16 ``[G, 2]`` contiguous, written.
    Returns:
        True when written; False (nothing written) where the kernel is not loaded.
    Raises:
        ValueError: an operand outside the above, or ``meta`` overlapping ``x``.
    """
    fn = kernels.logfmt_meta
    if fn is None:
        return False
    op = "logfmt_meta"
    g = _groups(op, "x", x, torch.int16, _GROUP)
    require_dense(op, "meta", meta, torch.int16, ndim=2)
    _shape(op, "meta", meta, (g, 2))
    _outputs(op, {"x": x}, {"meta": meta})
    fn(g, x.data_ptr(), meta.data_ptr())
    mark_written(meta)
    return True


def logfmt_params(meta: torch.Tensor, log2_of: torch.Tensor, use: torch.Tensor, lb: torch.Tensor, step: torch.Tensor,
                  rho: torch.Tensor, p: torch.Tensor, two_lb: torch.Tensor) -> int | None:
    """Each group's parameters from its metadata, the bits of ``deepep_ascend.gemm.logfmt._logfmt_params``: ``la =
    log2_of[amax]``, ``lb = max(log2_of[amin], la - 32)``, ``use = la < 0 and lb < la``; where ``use``, ``step = (la
    - lb) / 510`` and ``rho = 2 - log2((1 + 2**step) / 2) / step`` (float64 series, rounded to float32), else ``lb =
    0, step = 1``; ``p = 2**step`` and ``two_lb = 2**lb`` (float64, the decoder's).

    Args:
        meta: int16 ``[G, 2]`` contiguous, ``(amax, amin)`` bf16 bits (a sign bit is ignored).
        log2_of: float32 ``[32768]`` contiguous, ``log2`` of each bf16 magnitude.
        use: bool ``[G]``; lb, step, rho: float32 ``[G]``; p, two_lb: float64 ``[G]``; contiguous, written.
    Returns:
        The number of groups without ``use`` (they travel as BF16); None (nothing written) where the kernel is not
        loaded.
    Raises:
        ValueError: an operand outside the above, or an output overlapping another operand; nothing written.
    """
    fn = kernels.logfmt_params
    if fn is None:
        return None
    op = "logfmt_params"
    require_dense(op, "meta", meta, torch.int16, ndim=2)
    g = meta.size(0)
    _shape(op, "meta", meta, (g, 2))
    require_dense(op, "log2_of", log2_of, torch.float32, numel=1 << 15, ndim=1)
    outputs = {"use": (use, torch.bool), "lb": (lb, torch.float32), "step": (step, torch.float32),
               "rho": (rho, torch.float32), "p": (p, torch.float64), "two_lb": (two_lb, torch.float64)}
    for name, (t, dtype) in outputs.items():
        require_dense(op, name, t, dtype, numel=g, ndim=1)
    _outputs(op, {"meta": meta, "log2_of": log2_of}, {name: t for name, (t, _) in outputs.items()})
    fallback = fn(g, meta.data_ptr(), log2_of.data_ptr(), use.data_ptr(), lb.data_ptr(), step.data_ptr(),
                  rho.data_ptr(), p.data_ptr(), two_lb.data_ptr())
    mark_written(use, lb, step, rho, p, two_lb)
    return int(fallback)


def logfmt_encode(x: torch.Tensor, use: torch.Tensor, lb: torch.Tensor, step: torch.Tensor, rho: torch.Tensor,
                  log2_of: torch.Tensor, body: torch.Tensor, tail: torch.Tensor) -> bool:
    """Encode groups: ``body[g]`` the ten-bit codes of a group with ``use[g]`` (code ``c = int(clamp(((log2_of[|x|]
    - lb) / step) + rho, 0, 511))`` in float32, operation by operation, ``| sign << 9``; two planes: the low
    bytes, then the top two bits of four values per byte), or a BF16 group's bytes 0..159; ``tail`` the BF16
    groups' bytes 160..255, in group order.

    Args:
        x: int16 ``[G, 128]`` contiguous, the groups' bf16 bits.
        use: bool ``[G]``; lb, step, rho: float32 ``[G]`` (read where ``use``); log2_of: float32 ``[32768]``,
            ``log2`` of each bf16 magnitude; all contiguous.
        body: uint8 ``[G, 160]``; tail: uint8 ``[F, 96]``, ``F`` the groups without ``use``; contiguous, written.
    Returns:
        True when written; False (nothing written) where the kernel is not loaded.
    Raises:
        ValueError: an operand outside the above (``tail`` with another row count than the groups without
            ``use`` included), or an output overlapping another operand; nothing written.
    """
    fn = kernels.logfmt_encode
    if fn is None:
        return False
    op = "logfmt_encode"
    g = _groups(op, "x", x, torch.int16, _GROUP)
    for name, t in (("lb", lb), ("step", step), ("rho", rho)):
        require_dense(op, name, t, torch.float32, numel=g, ndim=1)
    require_dense(op, "log2_of", log2_of, torch.float32, numel=1 << 15, ndim=1)
    require_dense(op, "body", body, torch.uint8, ndim=2)
    _shape(op, "body", body, (g, _BODY))
    num_tail = _tail_rows(op, tail, use, g)
    _outputs(op, {"x": x, "use": use, "lb": lb, "step": step, "rho": rho, "log2_of": log2_of},
             {"body": body, "tail": tail})
    fn(g, x.data_ptr(), use.data_ptr(), lb.data_ptr(), step.data_ptr(), rho.data_ptr(), log2_of.data_ptr(),
       body.data_ptr(), tail.data_ptr(), num_tail)
    mark_written(body, tail)
    return True


def logfmt_decode(body: torch.Tensor, tail: torch.Tensor, use: torch.Tensor, p: torch.Tensor, two_lb: torch.Tensor,
                  out: torch.Tensor) -> bool:
    """Decode groups: ``out[g]`` float32, for a group with ``use[g]`` value ``c | sign << 9`` giving ``±coarse[k] ·
    fine[l]`` (``c + 31 = 32k + l``; ``c = 0``: +0) with ``fine[l] = p^l`` and ``coarse[k] = (p^31 · p)^(k-1) ·
    two_lb`` as float64 products rounded once to float32, multiplied in float32; for the others their BF16 bytes
    (body, then their ``tail`` row) widened exactly.

    Args:
        body: uint8 ``[G, 160]``; tail: uint8 ``[F, 96]``, ``F`` the groups without ``use``; use: bool ``[G]``;
            p, two_lb: float64 ``[G]`` (``2**step``, ``2**lb``; read where ``use``); all contiguous.
        out: float32 ``[G, 128]`` contiguous, written.
    Returns:
        True when written; False (nothing written) where the kernel is not loaded.
    Raises:
        ValueError: an operand outside the above, or ``out`` overlapping another operand; nothing written.
    """
    fn = kernels.logfmt_decode
    if fn is None:
        return False
    op = "logfmt_decode"
    g = _groups(op, "body", body, torch.uint8, _BODY)
    num_tail = _tail_rows(op, tail, use, g)
    for name, t in (("p", p), ("two_lb", two_lb)):
        require_dense(op, name, t, torch.float64, numel=g, ndim=1)
    require_dense(op, "out", out, torch.float32, ndim=2)
    _shape(op, "out", out, (g, _GROUP))
    _outputs(op, {"body": body, "tail": tail, "use": use, "p": p, "two_lb": two_lb}, {"out": out})
    fn(g, body.data_ptr(), tail.data_ptr(), num_tail, use.data_ptr(), p.data_ptr(), two_lb.data_ptr(),
       out.data_ptr())
    mark_written(out)
    return True
