"""FP4 e2m1 (MXFP4) codecs, bit-exact with DeepGEMM: the e2m1 encode and decode, two codes per byte, and the
per-token cast with its cast back.

Spec: ``docs/semantics/mega-moe.md`` §4. Every function is vectorized torch on CPU; none loops over elements.

**FP4 e2m1**: magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6} with codes 0..7, bit 3 the sign. Encoding counts the
thresholds 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5 that ``|x|`` *strictly* exceeds (ties go to the smaller
magnitude: 0.75 → 0.5, 1.75 → 1.5, 3.5 → 3) and saturates at 6; a value that encodes to magnitude 0 never
carries the sign (no −0 code). Two codes per byte, element ``2i`` in the low nibble, stored as int8
``[..., K/2]``. torch's ``float4_e2m1fn_x2`` is storage-only on CPU (no casts, no indexing), so it is
accepted only as an input to :func:`unpack_fp4` (viewed as bytes). Scales are float32 or UE8M0
(:mod:`.scales`).
"""

from __future__ import annotations

import torch

from .arguments import FLOAT_DTYPES, check_float_rows, check_gran, check_tensor
from .scales import (
    AMAX_FLOOR,
    UE8M0_INT_DTYPES,
    ceil_div,
    ceil_to_ue8m0,
    expand_scales,
    group_last_dim,
    pack_ue8m0_to_int,
    scales_as_float,
)

__all__ = [
    "FP4_E2M1_MAX",
    "cast_back_from_fp4",
    "dequantize_e2m1",
    "pack_fp4",
    "per_token_cast_to_fp4",
    "quantize_e2m1",
    "unpack_fp4",
]

#: Largest e2m1 magnitude.
FP4_E2M1_MAX = 6.0
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_THRESHOLDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def quantize_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Encode (already scaled) values as e2m1 codes, uint8 0..15, same shape.

    Magnitude index = number of thresholds 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5 strictly below
    ``|x|`` (ties to the smaller magnitude, saturation at 6); bit 3 is the sign, set only for a
    negative ``x`` with a nonzero magnitude. NaN input gives an unspecified code. ``x`` is
    float32/bf16/fp16/float64 (``TypeError`` otherwise).
    """
    check_tensor("x", x, FLOAT_DTYPES)
    ax = x.float().abs().clamp_max(FP4_E2M1_MAX)
    idx = torch.bucketize(ax, torch.tensor(_E2M1_THRESHOLDS, dtype=torch.float32))
    code = idx.to(torch.uint8)
    neg = (x < 0) & (idx != 0)
    return code | (neg.to(torch.uint8) << 3)


def dequantize_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (uint8/int8, low 4 bits used) -> float32 values (code 8, "−0", gives +0), same
    shape. Raises ``TypeError`` for another dtype."""
    check_tensor("codes", codes, (torch.uint8, torch.int8))
    c = codes.to(torch.int32) & 0xF
    lut = torch.tensor(
        _E2M1_VALUES + tuple(-v for v in _E2M1_VALUES), dtype=torch.float32
    )
    lut[8] = 0.0
    return lut[c]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack codes ``[..., K]`` (K even) into int8 ``[..., K/2]``: element ``2i`` in the low
    nibble, ``2i+1`` in the high nibble. Raises ``TypeError``/``ValueError`` on bad input."""
    check_tensor("codes", codes, (torch.uint8, torch.int8))
    if codes.dim() == 0 or codes.size(-1) % 2:
        raise ValueError(
            f"codes' last dim must be even, got shape {tuple(codes.shape)}"
        )
    c = codes.to(torch.uint8) & 0xF
    pairs = c.reshape(*c.shape[:-1], c.size(-1) // 2, 2)  # explicit: -1 is ambiguous with zero rows
    return (pairs[..., 0] | (pairs[..., 1] << 4)).view(torch.int8)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_fp4`: int8/uint8 (or torch ``float4_e2m1fn_x2`` storage)
    ``[..., W]`` -> uint8 codes ``[..., 2W]``. Raises ``TypeError`` for other dtypes."""
    check_tensor("packed", packed, (torch.int8, torch.uint8, torch.float4_e2m1fn_x2))
    if packed.dim() == 0:
        raise ValueError("packed must have at least one dim")
    b = packed.contiguous().view(torch.uint8)
    return torch.stack([b & 0xF, b >> 4], dim=-1).reshape(*b.shape[:-1], 2 * b.size(-1))


def per_token_cast_to_fp4(
    x: torch.Tensor,
    use_ue8m0: bool = True,
    gran_k: int = 128,
    use_packed_ue8m0: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token FP4 e2m1 cast with one scale per ``gran_k`` elements (MXFP4: ``gran_k=32``).

    ``x`` ``[..., M, K]`` float, ``K`` even. Per row and group (last one zero-padded):
    ``amax = max(max|x|, 1e-4)``, ``sf = amax / 6`` (``ceil_to_ue8m0`` with ``use_ue8m0``),
    codes = :func:`quantize_e2m1` of ``x * (1 / sf)``. Returns ``(packed int8 [..., M, K/2],
    sf)`` with ``sf`` float32 ``[..., M, ceil(K/gran_k)]`` or, with ``use_packed_ue8m0``, int32
    ``[..., M, ceil(ceil(K/gran_k)/4)]``. DeepGEMM has no default for ``use_ue8m0``; ours is
    ``True`` (MX). Raises ``TypeError``/``ValueError`` on bad input.
    """
    check_float_rows("x", x)
    check_gran("gran_k", gran_k)
    if x.size(-1) % 2:
        raise ValueError(f"x's last dim must be even for FP4 packing, got {x.size(-1)}")
    if use_packed_ue8m0 and not use_ue8m0:
        raise ValueError("use_packed_ue8m0=True requires use_ue8m0=True")
    k = x.size(-1)
    g = group_last_dim(x, gran_k)
    amax = g.abs().amax(dim=-1).clamp(min=AMAX_FLOOR)
    sf = amax / FP4_E2M1_MAX
    if use_ue8m0:
        sf = ceil_to_ue8m0(sf)
    codes = quantize_e2m1(g * (1.0 / sf).unsqueeze(-1)).reshape(*x.shape[:-1], g.size(-2) * g.size(-1))[..., :k]
    return pack_fp4(codes), (pack_ue8m0_to_int(sf) if use_packed_ue8m0 else sf)


def cast_back_from_fp4(
    packed: torch.Tensor,
    sf: torch.Tensor,
    gran_k: int = 128,
    use_packed_ue8m0: bool = False,
) -> torch.Tensor:
    """Dequantize packed FP4: int8 ``[..., M, K/2]`` with ``sf`` float32 ``[..., M,
    >= ceil(K/gran_k)]`` or packed UE8M0 int (detected by dtype; ``use_packed_ue8m0`` is
    accepted for DeepGEMM parity and must then agree). Returns float32 ``[..., M, K]``.
    Raises ``TypeError``/``ValueError`` on bad input.
    """
    check_tensor("packed", packed, (torch.int8, torch.uint8, torch.float4_e2m1fn_x2))
    check_tensor("sf", sf)
    check_gran("gran_k", gran_k)
    if use_packed_ue8m0 and sf.dtype not in UE8M0_INT_DTYPES:
        raise TypeError(f"use_packed_ue8m0=True needs an integer sf, got {sf.dtype}")
    vals = dequantize_e2m1(unpack_fp4(packed))
    m, k = vals.shape[-2], vals.shape[-1]
    s = scales_as_float("sf", sf)
    if tuple(s.shape[:-1]) != tuple(vals.shape[:-1]) or s.size(-1) < ceil_div(
        k, gran_k
    ):
        raise ValueError(
            f"sf shape {tuple(sf.shape)} does not fit packed {tuple(packed.shape)} at gran_k={gran_k}"
        )
    return vals * expand_scales(s, m, k, 1, gran_k)
