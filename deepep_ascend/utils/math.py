"""``deep_ep.utils.math``: the integer helpers, DeepEP's similarity measure and its FP8 helper casts."""
from __future__ import annotations

import torch

from ..gemm import fp8 as _fp8
from ..gemm.scales import align, ceil_div

__all__ = ["align", "calc_diff", "ceil_div", "per_token_cast_back", "per_token_cast_to_fp8"]


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
    per 128 channels, as BF16 (:func:`deepep_ascend.per_token_cast_back`)."""
    return _fp8.per_token_cast_back(x_fp8, x_scales)
