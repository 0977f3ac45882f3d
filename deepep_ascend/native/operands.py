"""Which tensors the native kernels take and may write: the predicates the kernels' wrappers check, and that
their callers (the GEMMs, MegaMoE) ask first to choose between a kernel and a torch path.

The kernels read matrices through a data pointer and a row stride: a 2-D CPU tensor with unit column
stride. They write through that pointer too, which autograd and torch's in-place checks do not see, so a
write target is also checked for what torch would refuse to write in place, and its version counter is
bumped afterwards (:func:`mark_written`).
"""

from __future__ import annotations

import torch

__all__ = ["dense_ok", "matrix_ok", "mark_written", "overlap", "require_dense", "require_matrix",
           "require_rows_apart", "rows_overlap", "write_refusal"]


def matrix_ok(t, dtype: torch.dtype | None = None, cols: int | None = None) -> bool:
    """Whether the kernels take ``t`` as a matrix: a 2-D CPU tensor (of ``dtype`` and ``cols`` columns
    where given) with unit column stride (any row stride). Callers with other operands use their torch
    paths. Never raises (``t`` may be anything)."""
    return (isinstance(t, torch.Tensor) and t.dim() == 2 and t.is_cpu
            and (dtype is None or t.dtype == dtype) and (cols is None or t.size(1) == cols)
            and (t.stride(1) == 1 or t.size(1) <= 1))


def dense_ok(t, dtype: torch.dtype, numel: int | None = None, ndim: int | None = None) -> bool:
    """Whether ``t`` is a contiguous CPU ``dtype`` tensor (of ``numel`` elements and ``ndim`` dims where given):
    what the kernels that walk a whole tensor through its data pointer take. Never raises."""
    # (``is_cpu``, not ``device.type``: building the device object costs more than the rest of the test)
    return (isinstance(t, torch.Tensor) and t.dtype == dtype and t.is_cpu and t.is_contiguous()
            and (numel is None or t.numel() == numel) and (ndim is None or t.dim() == ndim))


def require_dense(op: str, name: str, t, dtype: torch.dtype, numel: int | None = None,
                  ndim: int | None = None) -> None:
    """Raise ``ValueError`` naming ``op`` and ``name`` unless :func:`dense_ok` takes ``t``."""
    if not dense_ok(t, dtype, numel, ndim):
        want = f"{numel} elements" if numel is not None else (f"{ndim}-D" if ndim is not None else "any shape")
        raise ValueError(f"deepep_ascend.native.{op}: {name} must be a contiguous CPU {dtype} tensor of {want}, got "
                         f"{getattr(t, 'dtype', type(t).__name__)} of shape {tuple(getattr(t, 'shape', ()))}"
                         f"{'' if not isinstance(t, torch.Tensor) or t.is_contiguous() else ' (not contiguous)'}")


def require_matrix(name: str, t, dtype: torch.dtype, cols: int, op: str) -> None:
    """Raise ``ValueError`` naming ``op`` and ``name`` unless :func:`matrix_ok` takes ``t`` as a ``dtype``
    matrix of ``cols`` columns."""
    if not matrix_ok(t, dtype, cols):
        raise ValueError(f"deepep_ascend.native.{op}: {name} must be a CPU {dtype} matrix of {cols} columns with "
                         f"unit column stride, got {getattr(t, 'dtype', type(t).__name__)} of shape "
                         f"{tuple(getattr(t, 'shape', ()))}")


def rows_overlap(name: str, t: torch.Tensor) -> str | None:
    """Why the rows of matrix ``t`` overlap (a row stride below its column count), or None."""
    if t.size(0) > 1 and t.size(1) and t.stride(0) < t.size(1):
        return f"{name}'s rows overlap (row stride {t.stride(0)} < {t.size(1)} columns)"
    return None


def require_rows_apart(name: str, t: torch.Tensor, op: str) -> None:
    """Raise ``ValueError`` naming ``op`` if the rows of matrix ``t`` overlap (:func:`rows_overlap`)."""
    why = rows_overlap(name, t)
    if why:
        raise ValueError(f"deepep_ascend.native.{op}: {why}")


def write_refusal(name: str, t: torch.Tensor) -> str | None:
    """Why a kernel may not write the matrix ``t`` in place, or None: rows that overlap, or what torch refuses
    to write in place (a tensor autograd would have to track, since the kernel's write is invisible to it,
    or an inference tensor outside inference mode)."""
    if t.requires_grad and torch.is_grad_enabled():
        return (f"{name} requires grad; autograd cannot record this kernel's write (use torch.no_grad() or a "
                f"tensor that does not require grad)")
    if t.is_inference() and not torch.is_inference_mode_enabled():
        return f"{name} is an inference tensor; it can be written in place only inside torch.inference_mode()"
    return rows_overlap(name, t)


def overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the bytes two strided tensors span intersect (a conservative test on their extents)."""
    def span(t):
        lo = t.data_ptr()
        return lo, lo + sum((s - 1) * st for s, st in zip(t.shape, t.stride())) * t.element_size() + t.element_size()
    if not a.numel() or not b.numel():
        return False
    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def mark_written(*tensors: torch.Tensor) -> None:
    """Bump each tensor's version counter (shared with its base) after a native write, as an in-place torch op
    would: caches keyed on versions and autograd's saved-tensor checks see the change."""
    live = [t for t in tensors if not t.is_inference()]
    if live:
        torch.autograd.graph.increment_version(live)
