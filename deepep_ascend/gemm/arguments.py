"""Argument checks shared by the codecs and the GEMMs: each raises ``TypeError`` (a wrong type or dtype) or
``ValueError`` (a wrong shape, value or storage) whose message names the argument.

Storage (a dense CPU tensor) is :func:`deepep_ascend.checks.check_storage`, the check every room makes.
"""

from __future__ import annotations

import numpy as np
import torch

from ..checks import check_storage
from ..native.operands import overlap

__all__ = ["FLOAT_DTYPES", "check_float_rows", "check_gran", "check_operand", "check_out", "check_pair",
           "check_tensor", "int_list"]

#: Input dtypes of the casts (computed in float32).
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def check_tensor(name: str, t, dtypes=None, dims=None) -> torch.Tensor:
    """``t`` itself if it is a dense CPU tensor with a dtype in ``dtypes`` and a dim count in ``dims``
    (either None: any).

    Raises:
        TypeError: ``t`` not a tensor, or of another dtype. ValueError: another dim count, or ``t`` not a
        dense CPU tensor.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    check_storage(name, t)
    if dtypes is not None and t.dtype not in dtypes:
        want = ", ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({want}), got {t.dtype}")
    if dims is not None and t.dim() not in dims:
        raise ValueError(
            f"{name} must have {' or '.join(map(str, dims))} dims, got shape {tuple(t.shape)}"
        )
    return t


def check_gran(name: str, gran: int) -> int:
    """``gran`` if it is a positive int (not a bool), else ``ValueError`` naming ``name``."""
    if not isinstance(gran, int) or isinstance(gran, bool) or gran <= 0:
        raise ValueError(f"{name} must be a positive int, got {gran!r}")
    return gran


def check_float_rows(name: str, x, min_dims: int = 2) -> torch.Tensor:
    """``x`` if it is a float tensor (:data:`FLOAT_DTYPES`) of at least ``min_dims`` dims; raises as
    :func:`check_tensor`."""
    check_tensor(name, x, FLOAT_DTYPES)
    if x.dim() < min_dims:
        raise ValueError(
            f"{name} must have at least {min_dims} dims, got shape {tuple(x.shape)}"
        )
    return x


def check_operand(name: str, t, dtypes=None, dim: int | None = None) -> torch.Tensor:
    """A GEMM operand: ``t`` if it is a dense CPU tensor of one of ``dtypes`` with ``dim`` dims (None: any).

    Raises:
        TypeError: not a tensor, or another dtype. ValueError: another dim count, or not a dense CPU tensor.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    check_storage(name, t)
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(
            f"{name} must have dtype {' or '.join(map(str, dtypes))}, got {t.dtype}"
        )
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")
    return t


def check_pair(name: str, p) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8/FP4 GEMM operand ``(data, sf)``: data ``float8_e4m3fn`` or int8/uint8 (packed FP4), scales
    float32 or int32 (packed UE8M0). Returns ``(data, sf)``; raises as :func:`check_operand`, and
    ``TypeError`` if ``p`` is not a pair."""
    if not isinstance(p, (tuple, list)) or len(p) != 2:
        raise TypeError(f"{name} must be a (data, sf) pair, got {type(p).__name__}")
    data, sf = p
    check_operand(f"{name}[0] (data)", data, (torch.float8_e4m3fn, torch.int8, torch.uint8))
    check_operand(f"{name}[1] (sf)", sf, (torch.float32, torch.int32))
    return data, sf


def int_list(name: str, t, length: int | None = None) -> list[int]:
    """The values of a 1-D int32/int64 tensor (of ``length`` entries where given) as Python ints; raises as
    :func:`check_operand`, and ``ValueError`` for another length."""
    check_operand(name, t, (torch.int32, torch.int64), 1)
    if length is not None and t.numel() != length:
        raise ValueError(f"{name} must have {length} entries, got {t.numel()}")
    return [int(v) for v in t.tolist()]


def check_out(d, shape, dtypes=(torch.bfloat16,)) -> None:
    """A GEMM's output ``d``: a dense CPU tensor of one of ``dtypes`` and exactly ``shape``; raises as
    :func:`check_operand`, and ``ValueError`` for another shape."""
    check_operand("d", d, dtypes)
    if tuple(d.shape) != tuple(shape):
        raise ValueError(f"d must have shape {tuple(shape)}, got {tuple(d.shape)}")


def check_apart(d, *inputs) -> None:
    """``d`` may be written while ``inputs`` (tensors, or None) are read: no two of its elements share memory (an
    expanded tensor), and it overlaps no input unless it is that very input (same memory, shape, strides and
    dtype: each row read before it is written). The GEMMs write group by group, so a ``d`` over part of an input
    would overwrite rows a later group still reads.

    Raises:
        ValueError: naming ``d`` and the input it overlaps.
    """
    if any(st == 0 and sz > 1 for st, sz in zip(d.stride(), d.shape)):
        raise ValueError(f"d has elements sharing memory (strides {tuple(d.stride())} for shape {tuple(d.shape)}): "
                         f"the GEMM's writes would collide")
    for name, t in inputs:
        if not isinstance(t, torch.Tensor) or not t.numel():
            continue
        same = (t.data_ptr() == d.data_ptr() and t.shape == d.shape and t.stride() == d.stride()
                and t.dtype == d.dtype)
        if not same and overlap(d, t) and _rows_meet(d, t):
            raise ValueError(f"d overlaps {name} without being it: rows of {name} would be overwritten before they "
                             f"are read (give d memory of its own)")


def _row_spans(t: torch.Tensor):
    """Sorted byte ranges ``(starts, ends)`` of ``t``'s rows (numpy), or None unless its last dimension has unit
    stride (a row is then one range)."""
    if t.dim() == 0 or (t.stride(-1) != 1 and t.size(-1) > 1):
        return None
    lead = t.shape[:-1]
    starts = np.zeros(1, dtype=np.int64)
    for size, stride in zip(lead, t.stride()[:-1]):
        starts = (starts[:, None] + np.arange(size, dtype=np.int64)[None, :] * stride).reshape(-1)
    starts = np.sort(starts * t.element_size() + t.data_ptr())
    return starts, starts + t.size(-1) * t.element_size()


def _rows_meet(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a row of ``a`` and a row of ``b`` share a byte (their extents already overlap); True where the rows
    are not ranges (the conservative answer)."""
    sa, sb = _row_spans(a), _row_spans(b)
    if sa is None or sb is None:
        return True
    (a0, a1), (b0, b1) = sa, sb
    k = np.searchsorted(b1, a0, side="right")  # per row of a: the first row of b ending past its start
    hit = k < b0.size
    return bool(np.any(b0[np.minimum(k, b0.size - 1)][hit] < a1[hit]))
