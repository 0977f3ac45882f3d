"""Row matrices of bytes, as the engines handle them: seen through their widest integer type, and rows zeroed.

torch's index operators (``index_select``, ``index_copy_``, ``index_fill_``) run element by element, so on
uint8 rows they cost several times what the same rows cost as int64 elements; :func:`wide` gives that view.
:func:`zero_rows` zeroes chosen rows by streaming stores (the native kernel: whole cache lines, not read first),
which beats any per-element fill and halves a ``memset``'s memory traffic (a dispatch of ``python -m bench ep
--expand --zero-padding`` zeroes ~13,000 rows, 95 MB).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import native

INT_OF_WIDTH = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


class SentRows(NamedTuple):
    """A normal-mode dispatch's own tokens, as both engines move them (``None``: a field the call does not
    move): what the intranode engine stages, and what the internode engine copies its rows to itself from."""

    x: torch.Tensor  # [N, xb] uint8
    scales: torch.Tensor | None  # [N, sb] uint8
    topk_idx: torch.Tensor | None  # [N, K] int64
    topk_weights: torch.Tensor | None  # [N, K] float32
    is_token_in_rank: torch.Tensor | None  # [N, R] bool (the routing mask receivers select by)

_zero = torch.zeros(0, dtype=torch.uint8)  # a zero row, grown to the longest row seen


def common_width(*sizes: int) -> int:
    """Largest of 8, 4, 2, 1 bytes dividing every size (field offsets and widths of a message)."""
    return next(w for w in (8, 4, 2, 1) if all(n % w == 0 for n in sizes))


def dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous with standard strides (any shape and dtype; ``t`` itself when it already is). torch
    calls any zero-element tensor contiguous, so ``contiguous()`` keeps e.g. the stride 0 of an expanded
    gradient, which byte views (``view(dtype)`` of another size) refuse."""
    return t.contiguous() if t.numel() else torch.empty(t.shape, dtype=t.dtype)


def wide(rows: torch.Tensor) -> torch.Tensor:
    """``[n, m]`` uint8 rows (contiguous rows) viewed with the widest integer type that divides
    them: torch's row gathers and copies run per element, so 8-byte elements are ~3x faster."""
    w = common_width(rows.size(1), rows.data_ptr(), rows.stride(0) if rows.size(0) > 1 else 0)
    try:
        return rows.view(INT_OF_WIDTH[w]) if w > 1 else rows
    except RuntimeError:  # a layout torch will not reinterpret: stay bytes
        return rows


def zero_rows(rows: torch.Tensor, which: torch.Tensor | None = None) -> None:
    """Zero rows ``which`` (1-D int64, in range; None: every row) of the matrix ``rows`` (unit column stride):
    streaming stores (:func:`deepep_ascend.native.zero_rows`), else one ``memcpy`` per row from a zero row
    (uint8 rows), else torch."""
    global _zero
    if native.zero_rows(rows, which):
        return
    if which is None:
        rows.zero_()
        return
    cols = rows.size(1)
    zero = _zero
    if zero.numel() < cols:
        zero = _zero = torch.zeros(cols, dtype=torch.uint8)
    if rows.dtype != torch.uint8 or not native.copy_rows(rows, which, zero[:cols].expand(which.numel(), cols), None):
        (wide(rows) if rows.dtype == torch.uint8 else rows).index_fill_(0, which, 0)
