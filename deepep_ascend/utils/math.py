"""``deep_ep.utils.math``: the integer helpers, DeepEP's similarity measure and its FP8 helper casts."""
from __future__ import annotations

import torch

from ..gemm import fp8 as _fp8
from ..gemm.scales import UE8M0_INT_DTYPES
from ..rounding import align, ceil_div

__all__ = ["align", "calc_diff", "ceil_div", "count_bytes", "create_grouped_scores", "hash_tensor", "hash_tensors",
           "inplace_unique", "per_token_cast_back", "per_token_cast_to_fp8", "safe_div"]


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepEP's ``calc_diff``: ``1 - 2·Σ(x'y') / Σ(x'² + y'²)`` with ``x' = x + 1``, ``y' = y + 1`` in float64
    (0 for equal tensors; the measure DeepEP's tests bound)."""
    x, y = x.double() + 1, y.double() + 1
    return float(1 - 2 * (x * y).sum() / (x * x + y * y).sum())


def per_token_cast_to_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepEP's test helper ``per_token_cast_to_fp8(x)``: ``x`` ``[M, K]`` -> ``(e4m3 [M, K], float32 scales
    [M, ceil(K / 128)])``, ``448 / amax`` per 128 channels as the helper rounds it
    (:func:`deepep_ascend.per_token_cast_to_fp8` with ``scale_style='deepep'``; docs/semantics/deepep-api.md §4.8).
    Raises ``TypeError`` / ``ValueError`` as that function."""
    return _fp8.per_token_cast_to_fp8(x, scale_style="deepep")


def per_token_cast_back(x_fp8: torch.Tensor, x_scales: torch.Tensor) -> torch.Tensor:
    """DeepEP's ``per_token_cast_back``: e4m3 ``[M, K]`` times its scales (float32, or packed UE8M0 int32)
    per 128 channels, as BF16 (:func:`deepep_ascend.per_token_cast_back`). As DeepEP's helper, the scales are
    taken by element count: ``M`` rows of ``ceil(K / 128)`` values (UE8M0: bytes) in row-major order, whatever
    the shape they come in (a low-latency receive's ``[M / 4, K / 128]`` int32 view, say).

    Raises:
        TypeError / ValueError: as :func:`deepep_ascend.per_token_cast_back`; scales whose element count is not
            ``M`` rows of them.
    """
    if isinstance(x_fp8, torch.Tensor) and isinstance(x_scales, torch.Tensor) and x_fp8.dim() == 2:
        m = x_fp8.size(0)
        flat = x_scales.contiguous()
        if flat.dtype in UE8M0_INT_DTYPES:
            flat = flat.view(torch.uint8)
        if m and flat.numel() % m:
            raise ValueError(f"per_token_cast_back: {x_scales.numel()} scales of {x_scales.dtype} do not make "
                             f"{m} rows (x_fp8 {tuple(x_fp8.shape)})")
        x_scales = flat.reshape(m, -1) if m else flat.reshape(0, 0)
    return _fp8.per_token_cast_back(x_fp8, x_scales)


def safe_div(a, b):
    """DeepEP's ``safe_div``: ``a / b``, and 0 for ``0 / 0`` (a rate over nothing).

    Raises:
        ZeroDivisionError: ``b`` is 0 and ``a`` is not.
    """
    if b == 0 and a == 0:
        return 0
    return a / b


def count_bytes(*tensors) -> int:
    """DeepEP's ``count_bytes``: the bytes of every tensor given, nested lists and tuples included, None skipped."""
    total = 0
    for t in tensors:
        if isinstance(t, (tuple, list)):
            total += count_bytes(*t)
        elif t is not None:
            total += t.numel() * t.element_size()
    return total


def hash_tensor(t: torch.Tensor) -> int:
    """DeepEP's ``hash_tensor``: a cheap checksum of ``t``'s bytes, the sum of its elements read as int32 when
    they are 4 bytes wide, else of its bytes (any layout: a contiguous copy is summed)."""
    t = t.contiguous()
    words = t.view(torch.int32) if t.element_size() == 4 else t.view(torch.uint8)
    return int(words.sum())


def hash_tensors(*tensors) -> int:
    """DeepEP's ``hash_tensors``: :func:`hash_tensor` of every tensor given (nested lists and tuples included,
    anything else skipped), combined by XOR."""
    value = 0
    for t in tensors:
        if isinstance(t, (tuple, list)):
            value ^= hash_tensors(*t)
        elif isinstance(t, torch.Tensor):
            value ^= hash_tensor(t)
    return value


def inplace_unique(x: torch.Tensor, num_slots: int) -> None:
    """DeepEP's ``inplace_unique``: each row of the 2-D integer ``x`` (values in ``[-1, num_slots)``, negative
    ones empty) rewritten in place as its distinct values, descending, then ``-1`` (at most ``num_slots``
    columns keep values).

    Raises:
        ValueError: ``x`` not 2-D. RuntimeError: a value at or past ``num_slots`` (torch's scatter refuses it).
    """
    if x.dim() != 2:
        raise ValueError(f"inplace_unique: x must be 2-D, got shape {tuple(x.shape)}")
    present = torch.zeros(x.size(0), num_slots + 1, dtype=torch.bool, device=x.device)
    present.scatter_(1, x.masked_fill(x < 0, num_slots), True)
    values = torch.arange(num_slots, dtype=x.dtype, device=x.device).expand(x.size(0), num_slots)
    values = torch.where(present[:, :num_slots], values, -1).sort(dim=-1, descending=True).values
    keep = min(num_slots, x.size(1))
    x.fill_(-1)
    x[:, :keep] = values[:, :keep]


def create_grouped_scores(scores: torch.Tensor, group_idx: torch.Tensor, num_groups: int) -> torch.Tensor:
    """DeepEP's ``create_grouped_scores``: ``scores`` ``[N, E]`` with the experts of every group not listed in
    its row of ``group_idx`` ``[N, G]`` set to 0 (``E / num_groups`` experts per group, consecutive)."""
    n, e = scores.shape
    keep = torch.zeros(n, num_groups, dtype=torch.bool, device=scores.device).scatter_(1, group_idx, True)
    return (scores.view(n, num_groups, -1) * keep.unsqueeze(-1)).view(n, e)
