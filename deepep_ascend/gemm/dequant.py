"""FP8/FP4 GEMM operands back to float: :func:`dequantize_operand` (any operand, float32) and
:func:`dequantize_weights` (weights, once: cached in :mod:`.weight_cache`).

Spec: ``docs/semantics/mega-moe.md`` §4. Power-of-two scales make dequantized FP8/FP4 values exact in bf16 (barring
underflow below bf16's smallest subnormal), which is what :func:`dequantize_weights` checks before
returning a cached bf16 copy (:func:`to_exact_bf16`); otherwise it returns float32.
"""

from __future__ import annotations

import torch

from .arguments import check_gran, check_tensor
from .fp4 import dequantize_e2m1, unpack_fp4
from .fp8 import e4m3_to_float
from .scales import UE8M0_INT_DTYPES, ceil_div, expand_scales, unpack_ue8m0_from_int
from .weight_cache import cached_by_tensors

__all__ = ["dequantize_operand", "dequantize_weights", "to_exact_bf16"]


def dequantize_operand(
    data: torch.Tensor,
    sf: torch.Tensor,
    gran_mn: int,
    gran_k: int,
    name: str = "operand",
) -> torch.Tensor:
    """float32 ``[..., MN, K]`` of an FP8 (e4m3 ``[..., MN, K]``) or FP4 (int8 ``[..., MN, K/2]``)
    operand with float32 scales ``[..., ceil(MN/gran_mn), ceil(K/gran_k)]`` or packed UE8M0
    ``[..., MN, >= ceil(ceil(K/gran_k)/per_word)]`` (then ``gran_mn`` must be 1): ``value(data) * scale``,
    the GEMMs' dequantization (docs/semantics/mega-moe.md §4), uncached (weights: :func:`dequantize_weights`).

    Raises:
        TypeError: ``data`` or ``sf`` of another dtype. ValueError: scales whose shape does not fit ``data``
        at ``(gran_mn, gran_k)``. Messages start with ``name``.
    """
    if data.dtype == torch.float8_e4m3fn:
        vals = e4m3_to_float(data)
    elif data.dtype in (torch.int8, torch.uint8):
        vals = dequantize_e2m1(unpack_fp4(data))
    else:
        raise TypeError(
            f"{name} data must be float8_e4m3fn or int8 (packed FP4), got {data.dtype}"
        )
    mn, k = vals.shape[-2], vals.shape[-1]
    if sf.dim() != vals.dim():
        raise ValueError(
            f"{name} scales {tuple(sf.shape)} must have the dims of data {tuple(data.shape)}"
        )
    if sf.dtype in UE8M0_INT_DTYPES:
        if gran_mn != 1:
            raise ValueError(
                f"{name}: packed UE8M0 scales need gran_mn == 1, got {gran_mn}"
            )
        s = unpack_ue8m0_from_int(sf)
        ok = (
            s.shape[-2] == mn
            and s.size(-1) >= ceil_div(k, gran_k)
            and s.size(-1) - ceil_div(k, gran_k) < 4
        )
    elif sf.dtype == torch.float32:
        s = sf
        ok = tuple(s.shape[-2:]) == (ceil_div(mn, gran_mn), ceil_div(k, gran_k))
    else:
        raise TypeError(
            f"{name} scales must be float32 or packed UE8M0 int32, got {sf.dtype}"
        )
    if not ok or tuple(s.shape[:-2]) != tuple(vals.shape[:-2]):
        raise ValueError(
            f"{name} scales shape {tuple(sf.shape)} does not fit data {tuple(data.shape)} "
            f"with granularity ({gran_mn}, {gran_k})"
        )
    return vals * expand_scales(s, mn, k, gran_mn, gran_k)


def to_exact_bf16(x: torch.Tensor) -> torch.Tensor:
    """``x`` as bf16 if every value is exactly representable, else ``x`` (float32)."""
    b = x.to(torch.bfloat16)
    return b if torch.equal(b.float(), x) else x


def dequantize_weights(
    data: torch.Tensor,
    sf: torch.Tensor,
    gran_mn: int = 1,
    gran_k: int = 128,
    cache: bool = True,
    k_major: bool = True,
) -> torch.Tensor:
    """Dequantize FP8/FP4 weights ``[..., N, K]`` once, returning bf16 when that is exact.

    ``k_major=False`` means ``data`` is stored ``[..., K, N]`` (FP8 only); the result is still
    the logical ``[..., N, K]`` (a transposed view) and the scales stay logical ``[..., N, ...]``.

    ``data`` e4m3 ``[..., N, K]`` or packed FP4 int8 ``[..., N, K/2]``; ``sf`` float32
    ``[..., ceil(N/gran_mn), ceil(K/gran_k)]`` (e.g. 128×128 blocks) or packed UE8M0 (``gran_mn``
    1). The float32 product ``data * scale`` is returned as bf16 if every value survives the
    bf16 round trip (always the case for power-of-two scales without underflow), else as float32
    (legacy float32 scales: docs/semantics/mega-moe.md §4 says dequantize to fp32).

    With ``cache`` (and the module cache enabled) the result is cached keyed by the identity and
    version counter of ``data`` and ``sf`` (an in-place write invalidates it; entries die with the
    tensors; within the caches' byte budget, :func:`set_dequantized_weight_cache`). Raises
    ``TypeError``/``ValueError`` on bad input.
    """
    check_tensor("data", data)
    check_tensor("sf", sf)
    check_gran("gran_mn", gran_mn)
    check_gran("gran_k", gran_k)

    def build():
        logical = data if k_major else data.transpose(-1, -2)
        return to_exact_bf16(dequantize_operand(logical, sf, gran_mn, gran_k, "weights"))

    if not cache:
        return build()
    return cached_by_tensors(("dequantize", gran_mn, gran_k, k_major), (data, sf), build)
