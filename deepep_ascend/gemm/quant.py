"""FP8 / FP4 codecs and UE8M0 scale packings, bit-exact with DeepGEMM and DeepEP.

Spec: ``mega-moe.md`` §4 (formats, recipes, packings) and ``deepep-buffer-api.md`` §4.8 / §6.4
(DeepEP's FP8 casts). Every function is vectorized torch on CPU; none loops over elements.

Formats
-------
* **e4m3** (``torch.float8_e4m3fn``): max 448, no inf. Values are clamped to ±448 and then cast
  with round-to-nearest-even (torch's CPU cast is RNE and saturating).
* **UE8M0**: one byte ``b`` meaning ``2**(b - 127)``; 255 is NaN, 0 is ``2**-127``.
  ``ceil_to_ue8m0`` rounds a float32 *up* to a power of two from its bits (exponent, +1 if any
  mantissa bit is set, byte clamped to [1, 254]).
* **Packed UE8M0 (DeepGEMM / DeepEP)**: four exponent bytes per int32, little-endian: byte ``j``
  of word ``c`` is K-group ``4c + j``. A group count that is not a multiple of 4 is padded with
  byte 127 (1.0). GEMM operands store it MN-major (``stride(-2) == 1``,
  ``stride(-1) == get_tma_aligned_size(MN, 4)``).
* **Packed UE8M0 pairs (Ascend)**: two exponent bytes per int16 (byte ``j`` of word ``c`` is
  K-group ``2c + j``), MN-major with ``stride(-1) == get_tma_aligned_size(MN, 2)`` (our choice:
  the same 16-byte rule). :func:`pack_ue8m0_pairs_mn_major` returns an input already in that
  form unchanged (the same tensor object).
* **FP4 e2m1** (MXFP4): magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6} with codes 0..7, bit 3 the sign.
  Encoding counts the thresholds 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5 that ``|x|`` *strictly*
  exceeds (ties go to the smaller magnitude: 0.75 → 0.5, 1.75 → 1.5, 3.5 → 3) and saturates at 6;
  a value that encodes to magnitude 0 never carries the sign (no −0 code). Two codes per byte,
  element ``2i`` in the low nibble, stored as int8 ``[..., K/2]``. torch's
  ``float4_e2m1fn_x2`` is storage-only on CPU (no casts, no indexing), so it is accepted only as
  an input to :func:`unpack_fp4` (viewed as bytes).

Two FP8 per-token recipes exist upstream and differ in rare last-bit cases:

* DeepGEMM (``per_token_cast_to_fp8``, ``per_block_cast_to_fp8``, ...; mega-moe.md §4):
  ``sf = amax / 448`` (optionally ``ceil_to_ue8m0``), ``data = e4m3(x * (1 / sf))``.
* DeepEP (:func:`low_latency_cast_to_fp8`, deepep-buffer-api.md §6.4, and with
  ``scale_style='deepep'`` the normal-mode helper of §4.8): ``data = e4m3(x * (448 / amax))``;
  the LL kernel stores ``amax * f32(1/448)`` and with ``round_scale`` derives the power of two
  from those bits.

LogFMT-10 (:func:`logfmt10_encode` / :func:`logfmt10_decode`, deepep-buffer-api.md §6.3) is
DeepEP's lossy 10-bit transport of low-latency combine rows: per 128 channels a sign and a 9-bit
code on a log scale between the group's smallest and largest magnitude, 4 bytes of metadata.

Power-of-two scales make dequantized FP8/FP4 values exact in bf16 (barring underflow below bf16's
smallest subnormal), which is what :func:`dequantize_weights` checks before returning a cached
bf16 copy; otherwise it returns float32.
"""

from __future__ import annotations

import collections
import contextlib
import math
import operator
import os
import sys
import threading
import warnings
import weakref
from collections.abc import Sequence

import numpy as np
import torch

from .. import native as _native
from .. import settings
from ..native.operands import matrix_ok

__all__ = [
    "FP4_E2M1_MAX",
    "FP8_E4M3_MAX",
    "align",
    "cast_back_from_fp4",
    "cast_to_e4m3",
    "ceil_div",
    "ceil_to_ue8m0",
    "clear_dequantized_weight_cache",
    "dequantize_e2m1",
    "dequantize_weights",
    "dequantized_weight_cache_info",
    "e4m3_to_float",
    "get_mn_major_tma_aligned_packed_ue8m0_tensor",
    "get_mn_major_tma_aligned_tensor",
    "get_tma_aligned_size",
    "LOGFMT_BODY_BYTES",
    "LOGFMT_GROUP",
    "LOGFMT_META_BYTES",
    "LOGFMT_TAIL_BYTES",
    "logfmt10_decode",
    "logfmt10_encode",
    "logfmt10_group_mask",
    "logfmt10_wire_bytes",
    "low_latency_cast_to_fp8",
    "pack_fp4",
    "pack_ue8m0_pairs_mn_major",
    "pack_ue8m0_to_int",
    "per_block_cast_back",
    "per_block_cast_to_fp8",
    "per_channel_cast_to_fp8",
    "per_token_cast_back",
    "per_token_cast_to_fp4",
    "per_token_cast_to_fp8",
    "quantize_e2m1",
    "set_dequantized_weight_cache",
    "transform_sf_into_required_layout",
    "ue8m0_bytes",
    "unpack_fp4",
    "unpack_ue8m0_from_int",
    "WeightCacheInfo",
]

FP8_E4M3_MAX = 448.0
FP4_E2M1_MAX = 6.0
_AMAX_FLOOR = 1e-4
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_THRESHOLDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_UE8M0_PAD_BYTE = 127  # upstream pads packed groups with 1.0
_INT_DTYPES_FOR_UE8M0 = (torch.int32, torch.int16, torch.uint8)


# ----------------------------------------------------------------------------------------------
# small helpers


def ceil_div(x: int, y: int) -> int:
    """``ceil(x / y)`` for non-negative ints."""
    return (x + y - 1) // y


def align(x: int, y: int) -> int:
    """Smallest multiple of ``y`` that is ``>= x``."""
    return ceil_div(x, y) * y


def get_tma_aligned_size(mn: int, element_size: int) -> int:
    """MN extent padded to 16 bytes: ``align(mn, 16 // element_size)`` (DeepGEMM's TMA rule).

    Raises ``ValueError`` if ``element_size`` does not divide 16.
    """
    if element_size <= 0 or 16 % element_size != 0:
        raise ValueError(f"element_size must divide 16, got {element_size}")
    return align(mn, 16 // element_size)


def _storage_problem(t: torch.Tensor) -> str | None:
    """Why ``t`` is not a dense CPU tensor (``"must be ..., got ..."``), or None: a ``meta`` tensor has no data,
    and a sparse, mkldnn, nested or other device's one is not memory the CPU kernels can read."""
    if t.device.type != "cpu":
        return f"must be a CPU tensor, got device {t.device}"
    if t.layout != torch.strided or t.is_nested:
        return f"must be a dense (strided) tensor, got {'a nested tensor' if t.is_nested else f'layout {t.layout}'}"
    return None


def _check_storage(name: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` if it is a dense CPU tensor, else ``ValueError`` naming it (:func:`_storage_problem`)."""
    problem = _storage_problem(t)
    if problem is not None:
        raise ValueError(f"{name} {problem}")
    return t


def _check_tensor(name: str, t, dtypes=None, dims=None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    _check_storage(name, t)
    if dtypes is not None and t.dtype not in dtypes:
        want = ", ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({want}), got {t.dtype}")
    if dims is not None and t.dim() not in dims:
        raise ValueError(
            f"{name} must have {' or '.join(map(str, dims))} dims, got shape {tuple(t.shape)}"
        )
    return t


def _check_gran(name: str, gran: int) -> int:
    if not isinstance(gran, int) or isinstance(gran, bool) or gran <= 0:
        raise ValueError(f"{name} must be a positive int, got {gran!r}")
    return gran


_FLOAT_INPUTS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _row_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` with row-major strides, viewable as another element size. ``Tensor.contiguous`` keeps any
    stride of a size-1 dimension (an MN-major ``[M, 1]`` stays ``(1, M)``) and of an empty tensor, and
    ``Tensor.view(dtype)`` then refuses it."""
    if t.is_contiguous() and (t.dim() == 0 or t.stride(-1) == 1):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def cast_to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Clamp to ±448, then cast to ``float8_e4m3fn`` with round-to-nearest-even (NaN stays NaN).

    ``x``: a float32/bf16/fp16/float64 tensor of any shape; returns ``float8_e4m3fn`` of the same
    shape (not in DeepGEMM; the cast the per-token and per-block codecs end with). Raises
    ``TypeError`` for another type or dtype."""
    _check_tensor("x", x, _FLOAT_INPUTS)
    return x.float().clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def e4m3_to_float(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """float32 values of ``float8_e4m3fn`` codes, bit for bit as ``x.float()`` (NaN codes included).

    Torch's CPU cast from e4m3 converts one element at a time (~5 ns each here); this one moves
    the code's sign, exponent and mantissa bits into a float16 whose exponent bias is 8 less
    (subnormals included), lets the vectorised float16 → float32 conversion run, and rescales by
    ``2**8`` (exact); NaN codes cost one more masked pass. ``x`` any shape and strides
    (``float8_e4m3fn``, or its bytes as int8/uint8); ``out`` optional float32 of the same shape, not
    overlapping itself (written and returned). Raises ``TypeError`` for a non-tensor or a wrong
    dtype of ``x``, ``ValueError`` for a wrong ``out`` or for either not a dense CPU tensor.
    """
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.float8_e4m3fn, torch.int8, torch.uint8):
        raise TypeError(f"x must be a float8_e4m3fn tensor (or its int8/uint8 bytes), got "
                        f"{getattr(x, 'dtype', type(x).__name__)}")
    _check_storage("x", x)
    if out is None:
        out = torch.empty(x.shape, dtype=torch.float32)
    elif not isinstance(out, torch.Tensor) or out.dtype != torch.float32 or tuple(out.shape) != tuple(x.shape):
        raise ValueError(f"out must be a float32 tensor of shape {tuple(x.shape)}, got "
                         f"{getattr(out, 'dtype', type(out).__name__)} {tuple(getattr(out, 'shape', ()))}")
    else:
        _check_storage("out", out)
    if x.dim() == 0:  # the NaN pass indexes by position: give it one dimension
        e4m3_to_float(x.reshape(1), out.view(1))
        return out
    b = x.view(torch.int8)
    half = b.to(torch.int16)  # sign-extended: bit 15 is the sign
    half.bitwise_left_shift_(7).bitwise_and_(-0x8000 | 0x3F80)  # S.EEEE.MMM -> S.0EEEE.MMM0000000
    out.copy_(half.view(torch.float16)).mul_(256.0)
    if b.numel() and (int(b.max()) == 127 or int(b.view(torch.uint8).max()) == 255):  # 0x7F / 0xFF: NaN
        where = (torch.bitwise_or(b, -128) == -1).nonzero(as_tuple=True)  # both codes | 0x80 == 0xFF
        nan_bits = torch.where(b[where] < 0, -0x100000, 0x7FF00000).to(torch.int32)  # torch's: 0xFFF00000, 0x7FF00000
        out.view(torch.int32).index_put_(where, nan_bits)
    return out


def _e4m3_ue8m0_round_trip_(x: torch.Tensor, gran: int) -> bool:
    """Replace float32 ``x [n, K]`` (contiguous, ``K % gran == 0``) in place by what a per-token
    e4m3 cast with UE8M0 scales per ``gran`` channels and its cast back give, bit for bit:
    ``s = ceil_to_ue8m0(max(amax, 1e-4) / 448)``, ``e4m3(clamp(x / s, ±448)) * s``.

    Returns ``False`` (``x`` untouched) where that shortcut does not apply: a NaN or infinity in
    ``x``, or an ``|x|`` of ``2**100`` or more. The shortcut rounds in float32 by adding and
    subtracting ``c`` (RNE at ``ulp(c)``): ``c = 2**(exponent(x) + 20)`` keeps e4m3's three mantissa
    bits, and ``c >= s * 2**14`` gives its subnormals' fixed step ``s * 2**-9``. Since ``s`` is a
    power of two, ``x / s`` has ``x``'s mantissa, so neither the division nor the codes are needed:
    eight passes over ``x`` instead of about fourteen for cast, decode and rescale.
    """
    n, k = x.shape
    ax = x.abs()
    amax = ax.view(n, k // gran, gran).amax(-1)
    if amax.numel() and not bool((amax < 2.0**100).all()):  # NaN fails the comparison too
        return False
    sf = ceil_to_ue8m0(amax.clamp_(min=1e-4).div_(FP8_E4M3_MAX))
    c = ax.view(torch.int32).bitwise_and(0x7F800000).add_(20 << 23)
    cv = c.view(n, k // gran, gran)
    torch.maximum(cv, sf.view(torch.int32).add_(14 << 23).unsqueeze(-1), out=cv)
    cf = c.view(torch.float32)
    torch.copysign(ax.add_(cf).sub_(cf), x, out=x)
    return True


# ----------------------------------------------------------------------------------------------
# UE8M0


def ceil_to_ue8m0(x: torch.Tensor) -> torch.Tensor:
    """Round ``|x|`` up to a power of two, from the float32 bits (mega-moe.md §4, DeepEP §6.4).

    ``e = exponent(|x|) + (1 if any mantissa bit else 0)``, clamped to [1, 254]; returns float32
    ``2**(e - 127)`` with ``x``'s shape. So ``0`` gives ``2**-126`` (the clamp) and values at or
    above ``2**127`` give ``2**127``. Raises ``TypeError`` for a non-floating tensor.
    """
    _check_tensor("x", x, _FLOAT_INPUTS)
    bits = x.abs().float().view(torch.int32)
    exp = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exp.clamp(1, 254) << 23).view(torch.float32)


def ue8m0_bytes(sf: torch.Tensor) -> torch.Tensor:
    """Exponent bytes (uint8, ``b = e + 127``) of float32 powers of two ``2**e``, same shape.

    Raises ``TypeError`` unless ``sf`` is float32 and ``ValueError`` if an element is not a
    positive normal power of two (mantissa bits set, zero, negative, subnormal, inf or NaN);
    round with :func:`ceil_to_ue8m0` first.
    """
    _check_tensor("sf", sf, (torch.float32,))
    bits = sf.contiguous().view(torch.int32)
    exp = (bits >> 23) & 0xFF
    bad = ((bits & 0x7FFFFF) != 0) | (bits < 0) | (exp == 0) | (exp == 255)
    if bool(bad.any()):
        raise ValueError(
            f"sf must hold positive normal powers of two to be stored as UE8M0; got e.g. "
            f"{sf.reshape(-1)[bad.reshape(-1)][:4].tolist()} (use ceil_to_ue8m0)"
        )
    return exp.to(torch.uint8)


def _ue8m0_byte_to_float(b: torch.Tensor) -> torch.Tensor:
    """uint8 exponent bytes -> float32 ``2**(b-127)`` (0 -> 2**-127 subnormal, 255 -> NaN)."""
    b32 = b.to(torch.int32)
    f = (b32 << 23).view(torch.float32)
    f = torch.where(b32 == 0, torch.tensor(2.0**-127, dtype=torch.float32), f)
    return torch.where(b32 == 255, torch.tensor(float("nan"), dtype=torch.float32), f)


def _pack_bytes(b: torch.Tensor, per_word: int) -> torch.Tensor:
    """uint8 ``[..., G]`` -> int32 (4 per word) or int16 (2 per word) ``[..., ceil(G/per_word)]``,
    little-endian, padded with byte 127; contiguous row-major."""
    g = b.size(-1)
    padded_g = align(g, per_word)
    if padded_g != g:
        pad = torch.full(
            (*b.shape[:-1], padded_g - g), _UE8M0_PAD_BYTE, dtype=torch.uint8
        )
        b = torch.cat([b, pad], dim=-1)
    dtype = torch.int32 if per_word == 4 else torch.int16
    return _row_major(b).view(dtype)


def pack_ue8m0_to_int(x: torch.Tensor) -> torch.Tensor:
    """Pack float32 power-of-two scales ``[..., G]`` into int32 ``[..., ceil(G/4)]`` (row-major).

    Four exponent bytes per int32, little-endian (byte ``j`` of word ``c`` is group ``4c + j``);
    when ``G % 4 != 0`` the missing bytes are 127 (DeepGEMM's helper requires ``G % 4 == 0``;
    mega-moe.md §4 pads). Raises ``TypeError``/``ValueError`` as :func:`ue8m0_bytes` and for a
    0-dim input.
    """
    _check_tensor("x", x, (torch.float32,))
    if x.dim() == 0:
        raise ValueError("x must have at least one dim (the group axis)")
    return _pack_bytes(ue8m0_bytes(x), 4)


def unpack_ue8m0_from_int(packed_sf: torch.Tensor) -> torch.Tensor:
    """Inverse of the packings: int32 ``[..., W]`` -> float32 ``[..., 4W]``, int16 ``[..., W]``
    -> float32 ``[..., 2W]``, uint8 bytes ``[..., W]`` -> ``[..., W]``. Any strides (MN-major is
    fine). Pad groups come back as 1.0; slice to the real group count. Byte 0 decodes to
    ``2**-127`` and byte 255 to NaN (spec §4). Raises ``TypeError`` for other dtypes.
    """
    _check_tensor("packed_sf", packed_sf, _INT_DTYPES_FOR_UE8M0)
    if packed_sf.dim() == 0:
        raise ValueError("packed_sf must have at least one dim")
    b = _row_major(packed_sf).view(torch.uint8)
    return _ue8m0_byte_to_float(b)


def _mn_major(t: torch.Tensor, element_size: int) -> torch.Tensor:
    """Same values as ``t [..., MN, C]``, stored with ``stride(-2) == 1`` and ``stride(-1) ==
    get_tma_aligned_size(MN, element_size)`` (batch dims outermost, unpadded)."""
    mn, c = t.shape[-2], t.shape[-1]
    aligned = get_tma_aligned_size(mn, element_size)
    buf = torch.zeros((*t.shape[:-2], c, aligned), dtype=t.dtype)
    out = buf.transpose(-1, -2)[..., :mn, :]
    out.copy_(t)
    return out


def _is_mn_major(t: torch.Tensor, element_size: int) -> bool:
    mn = t.shape[-2]
    return t.stride(-2) == 1 and (
        t.shape[-1] <= 1 or t.stride(-1) == get_tma_aligned_size(mn, element_size)
    )


def get_mn_major_tma_aligned_tensor(sf: torch.Tensor) -> torch.Tensor:
    """float32 scales ``[MN, G]`` or ``[B, MN, G]`` in MN-major TMA-aligned storage (same values):
    ``stride(-2) == 1``, ``stride(-1) == get_tma_aligned_size(MN, 4)``. Returns ``sf`` itself if
    it is already stored that way. Raises ``TypeError`` (dtype) / ``ValueError`` (dims).
    """
    _check_tensor("sf", sf, (torch.float32,), (2, 3))
    return sf if _is_mn_major(sf, 4) else _mn_major(sf, 4)


def get_mn_major_tma_aligned_packed_ue8m0_tensor(sf: torch.Tensor) -> torch.Tensor:
    """float32 power-of-two scales ``[MN, G]`` / ``[B, MN, G]`` -> packed UE8M0 int32
    ``[..., MN, ceil(G/4)]``, MN-major TMA-aligned (``stride(-2) == 1``,
    ``stride(-1) == get_tma_aligned_size(MN, 4)``). Raises as :func:`pack_ue8m0_to_int`.
    """
    _check_tensor("sf", sf, (torch.float32,), (2, 3))
    return _mn_major(pack_ue8m0_to_int(sf), 4)


def pack_ue8m0_pairs_mn_major(sf: torch.Tensor) -> torch.Tensor:
    """Ascend's 16-bit packing: two UE8M0 bytes per int16, MN-major (mega-moe.md §4).

    ``sf`` ``[MN, G]`` or ``[B, MN, G]``, one of:

    * int16 stored MN-major (``stride(-2) == 1``): already packed, returned as is (same object);
    * float32 powers of two (one per group);
    * uint8 exponent bytes (one per group);
    * int32 DeepGEMM-packed words (four groups each; re-paired, ``W`` words -> ``2W`` pairs).

    Returns int16 ``[..., MN, ceil(G/2)]`` with ``stride(-2) == 1`` and
    ``stride(-1) == get_tma_aligned_size(MN, 2)``; byte ``j`` of word ``c`` is group ``2c + j``,
    an odd group count is padded with byte 127. Raises ``TypeError`` for other dtypes,
    ``ValueError`` for bad dims or non-power-of-two float scales.
    """
    _check_tensor(
        "sf", sf, (torch.int16, torch.float32, torch.uint8, torch.int32), (2, 3)
    )
    if sf.dtype == torch.int16:
        return sf if sf.stride(-2) == 1 or sf.shape[-2] <= 1 else _mn_major(sf, 2)
    if sf.dtype == torch.float32:
        b = ue8m0_bytes(sf)
    elif sf.dtype == torch.int32:
        b = sf.contiguous().view(torch.uint8)
    else:
        b = sf
    return _mn_major(_pack_bytes(b, 2), 2)


def transform_sf_into_required_layout(
    sf: torch.Tensor,
    mn: int,
    k: int,
    recipe: Sequence[int],
    num_groups: int | None = None,
    is_sfa: bool | None = None,
    disable_ue8m0_cast: bool = False,
    psum_layout=None,
) -> torch.Tensor:
    """Put scales into the layout DeepGEMM's GEMMs take (CPU subset of DeepGEMM's helper).

    ``recipe`` is ``(gran_mn, gran_k)``, or ``(gran_m_a, gran_n_b, gran_k)`` with ``is_sfa``
    choosing A's or B's ``gran_mn``. ``sf`` is ``[MN', G]`` or, with ``num_groups``,
    ``[num_groups, MN', G]``:

    * float32, ``gran_mn == 1``, ``disable_ue8m0_cast=False``: powers of two ``[.., mn,
      ceil(k/gran_k)]`` -> packed UE8M0 int32 MN-major
      (:func:`get_mn_major_tma_aligned_packed_ue8m0_tensor`). Non-powers of two raise
      ``ValueError`` (upstream would silently truncate the mantissa).
    * float32, ``gran_mn == 1``, ``disable_ue8m0_cast=True``: float32 MN-major TMA-aligned.
    * float32, ``gran_mn > 1`` (block weight scales ``[.., ceil(mn/gran_mn), ceil(k/gran_k)]``):
      returned unchanged.
    * int32 (already packed, ``[.., mn, ceil(ceil(k/gran_k)/4)]``): MN-major TMA-aligned (the
      same tensor if already so).

    ``psum_layout`` is accepted and ignored. Raises ``ValueError`` on shape or recipe mismatch,
    ``TypeError`` on dtype.
    """
    _check_tensor("sf", sf, (torch.float32, torch.int32), (2, 3))
    recipe = tuple(recipe)
    if len(recipe) == 3:
        if is_sfa is None:
            raise ValueError(
                "a 3-element recipe needs is_sfa to pick A's or B's granularity"
            )
        gran_mn, gran_k = (recipe[0] if is_sfa else recipe[1]), recipe[2]
    elif len(recipe) == 2:
        gran_mn, gran_k = recipe
    else:
        raise ValueError(f"recipe must have 2 or 3 entries, got {recipe}")
    _check_gran("recipe gran_mn", gran_mn)
    _check_gran("recipe gran_k", gran_k)
    want_dims = 3 if num_groups is not None else 2
    if sf.dim() != want_dims or (num_groups is not None and sf.size(0) != num_groups):
        raise ValueError(
            f"sf must be {'[num_groups, MN, G]' if num_groups is not None else '[MN, G]'}"
            f" (num_groups={num_groups}), got shape {tuple(sf.shape)}"
        )
    groups = ceil_div(k, gran_k)
    if sf.dtype == torch.int32:
        if gran_mn != 1:
            raise ValueError("packed UE8M0 (int32) scales need gran_mn == 1")
        want = (mn, ceil_div(groups, 4))
        if tuple(sf.shape[-2:]) != want:
            raise ValueError(
                f"packed sf must be [..., {want[0]}, {want[1]}], got {tuple(sf.shape)}"
            )
        return sf if _is_mn_major(sf, 4) else _mn_major(sf, 4)
    want = (ceil_div(mn, gran_mn), groups)
    if tuple(sf.shape[-2:]) != want:
        raise ValueError(
            f"sf must be [..., {want[0]}, {want[1]}], got {tuple(sf.shape)}"
        )
    if gran_mn != 1:
        return sf
    if disable_ue8m0_cast:
        return get_mn_major_tma_aligned_tensor(sf)
    return get_mn_major_tma_aligned_packed_ue8m0_tensor(sf)


# ----------------------------------------------------------------------------------------------
# FP8 casts


def _float_rows(name: str, x: torch.Tensor, min_dims: int = 2) -> torch.Tensor:
    _check_tensor(name, x, _FLOAT_INPUTS)
    if x.dim() < min_dims:
        raise ValueError(
            f"{name} must have at least {min_dims} dims, got shape {tuple(x.shape)}"
        )
    return x


def _group_last_dim(x: torch.Tensor, gran: int, copy: bool = False) -> torch.Tensor:
    """float32 ``[..., K]`` zero-padded and viewed as ``[..., ceil(K/gran), gran]``; ``copy``:
    never ``x``'s own storage (for callers that scale the groups in place)."""
    k = x.size(-1)
    kp = align(k, gran)
    xf = x.to(torch.float32, copy=copy)
    if kp != k:
        xf = torch.nn.functional.pad(xf, (0, kp - k))
    return xf.reshape(*x.shape[:-1], kp // gran, gran)


def per_token_cast_to_fp8(
    x: torch.Tensor,
    use_ue8m0: bool = False,
    gran_k: int = 128,
    use_packed_ue8m0: bool = False,
    *,
    scale_style: str = "deepgemm",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token FP8 cast, one scale per ``gran_k`` channels (DeepGEMM's argument order).

    ``x`` ``[..., M, K]`` float (bf16/fp16/fp32/fp64), computed in float32. Per row and group
    (the last one zero-padded): ``amax = max(max|x|, 1e-4)``, ``sf = amax / 448``, with
    ``use_ue8m0`` ``sf = ceil_to_ue8m0(sf)``; ``data = e4m3(x * (1 / sf))`` (clamped to ±448, RNE).
    ``scale_style='deepep'`` instead multiplies by ``448 / amax`` (DeepEP's helper, §4.8; only
    without ``use_ue8m0``); the stored ``sf`` is the same.

    Returns ``(data [..., M, K] float8_e4m3fn, sf)`` with ``sf`` float32 ``[..., M,
    ceil(K/gran_k)]``, or with ``use_packed_ue8m0`` (needs ``use_ue8m0``) int32 ``[..., M,
    ceil(ceil(K/gran_k)/4)]`` row-major (see :func:`pack_ue8m0_to_int`;
    :func:`get_mn_major_tma_aligned_packed_ue8m0_tensor` gives the GEMM layout).
    Raises ``TypeError`` for a non-float ``x``, ``ValueError`` for < 2 dims, a bad ``gran_k`` or
    inconsistent flags.
    """
    _float_rows("x", x)
    _check_gran("gran_k", gran_k)
    if use_packed_ue8m0 and not use_ue8m0:
        raise ValueError("use_packed_ue8m0=True requires use_ue8m0=True")
    if scale_style not in ("deepgemm", "deepep"):
        raise ValueError(
            f"scale_style must be 'deepgemm' or 'deepep', got {scale_style!r}"
        )
    if scale_style == "deepep" and use_ue8m0:
        raise ValueError(
            "scale_style='deepep' has no UE8M0 variant; use low_latency_cast_to_fp8"
        )
    k = x.size(-1)
    g = _group_last_dim(x, gran_k)
    amax = g.abs().amax(dim=-1).clamp(min=_AMAX_FLOOR)
    sf = amax / FP8_E4M3_MAX
    if use_ue8m0:
        sf = ceil_to_ue8m0(sf)
    mult = (FP8_E4M3_MAX / amax) if scale_style == "deepep" else (1.0 / sf)
    data = cast_to_e4m3(g * mult.unsqueeze(-1))
    data = data.reshape(*x.shape[:-1], g.size(-2) * g.size(-1))[..., :k].contiguous()
    return data, (pack_ue8m0_to_int(sf) if use_packed_ue8m0 else sf)


def low_latency_cast_to_fp8(
    x: torch.Tensor, round_scale: bool = False, use_ue8m0: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepEP low-latency dispatch's FP8 cast, bit-exact (deepep-buffer-api.md §6.4).

    ``x`` ``[..., N, H]`` float; per token and 128 channels (last group zero-padded),
    ``amax = max(1e-4, max|x|)`` in float32 and ``r = amax * f32(1/448)``:

    * ``round_scale=False``: ``data = e4m3(x * (448 / amax))``, scale ``r`` (may differ by one
      ulp from ``amax / 448``);
    * ``round_scale=True``: ``k = ceil(log2(r))`` from ``r``'s bits (:func:`ceil_to_ue8m0`),
      ``data = e4m3(x * 2**-k)``, scale ``2**k``;
    * ``use_ue8m0`` (requires ``round_scale``): scales as packed UE8M0 int32
      ``[..., N, ceil(H/512)]``, byte ``k + 127``, groups ``4p..4p+3`` in word ``p``.

    Returns ``(data [..., N, H] e4m3, scales)``, scales float32 ``[..., N, ceil(H/128)]`` or int32,
    row-major (DeepEP hands them out column-major: ``get_mn_major_tma_aligned_tensor`` /
    a transpose gives that layout). Raises ``ValueError`` for ``use_ue8m0`` without
    ``round_scale`` (DeepEP: ``RuntimeError``), ``TypeError``/``ValueError`` for bad ``x``.
    """
    _float_rows("x", x)
    if use_ue8m0 and not round_scale:
        raise ValueError("use_ue8m0=True requires round_scale=True")
    k = x.size(-1)
    g = _group_last_dim(x, 128, copy=True)
    data = torch.empty(*x.shape[:-1], g.size(-2) * 128, dtype=torch.float8_e4m3fn)
    sf = low_latency_cast_to_fp8_(g, data, round_scale)
    data = data[..., :k].contiguous() if data.size(-1) != k else data
    return data, (pack_ue8m0_to_int(sf) if use_ue8m0 else sf)


def low_latency_cast_to_fp8_(groups: torch.Tensor, data_out: torch.Tensor, round_scale: bool = False) -> torch.Tensor:
    """In-place core of :func:`low_latency_cast_to_fp8` (the cast inside DeepEP's
    ``low_latency_dispatch``, deepep-buffer-api.md §6.4), for callers that own scratch memory.

    Args:
        groups: float32 ``[..., S, 128]``, contiguous in the last dim; overwritten (scaled and
            clamped in place).
        data_out: ``float8_e4m3fn`` holding ``groups``' elements as ``[..., S·128]``, any row
            stride (e.g. the data field of window messages); receives the e4m3 values.
        round_scale: power-of-two scales (``ceil_to_ue8m0``), as in the public cast.
    Returns:
        float32 scales ``[..., S]``.
    Raises:
        RuntimeError (from torch) if ``data_out`` cannot hold ``groups``' elements.

    Same bits as ``|x|.amax()`` gave: ``max(max, -min)`` is ``max|x|``, and the multiply, clamp
    and RNE cast are the same float32 operations. A group holding a NaN gets the canonical NaN
    as ``amax`` (``|x|.amax()`` would carry an input NaN's payload into the scale).
    """
    # amax and amin separately: torch.aminmax over 128-element groups is far slower on CPU.
    amax = torch.maximum(groups.amax(dim=-1), groups.amin(dim=-1).neg_())
    amax.masked_fill_(amax.isnan(), math.nan).clamp_(min=_AMAX_FLOOR)  # NaN groups: canonical NaN
    r = amax * torch.tensor(1.0 / FP8_E4M3_MAX, dtype=torch.float32)
    if round_scale:
        sf = ceil_to_ue8m0(r)
        mult = 1.0 / sf  # exact: a power of two
    else:
        sf = r
        mult = FP8_E4M3_MAX / amax
    groups.mul_(mult.unsqueeze(-1)).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    data_out.copy_(groups.view(data_out.shape))
    return sf


def per_channel_cast_to_fp8(
    x: torch.Tensor, use_ue8m0: bool = False, gran_k: int = 128
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel FP8 cast (K-grouped weight-gradient operands): one scale per column and
    ``gran_k`` rows. ``x`` ``[K, N]`` float with ``K % gran_k == 0``; same math as
    :func:`per_token_cast_to_fp8` along dim 0. Returns ``(data [K, N] e4m3, sf float32
    [K/gran_k, N])``. Raises ``TypeError``/``ValueError`` (dims, ``K % gran_k``).
    """
    _check_tensor("x", x, _FLOAT_INPUTS, (2,))
    _check_gran("gran_k", gran_k)
    if x.size(0) % gran_k:
        raise ValueError(f"x.size(0)={x.size(0)} must be a multiple of gran_k={gran_k}")
    data, sf = per_token_cast_to_fp8(x.t(), use_ue8m0, gran_k)
    return data.t().contiguous(), sf.t().contiguous()


def per_block_cast_to_fp8(
    x: torch.Tensor, use_ue8m0: bool = False, gran_k: int = 128
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block FP8 cast of weights: one scale per ``gran_k × gran_k`` tile.

    ``x`` ``[..., N, K]`` float (e.g. ``[E, N, K]``); tiles at the edges are zero-padded for the
    amax. ``sf = max(amax, 1e-4) / 448`` per tile (``ceil_to_ue8m0`` with ``use_ue8m0``),
    ``data = e4m3(x * (1 / sf))``. Returns ``(data [..., N, K] e4m3, sf float32 [...,
    ceil(N/gran_k), ceil(K/gran_k)])``. Raises ``TypeError``/``ValueError`` for bad input.
    """
    _float_rows("x", x)
    _check_gran("gran_k", gran_k)
    n, k = x.shape[-2], x.shape[-1]
    np_, kp = align(n, gran_k), align(k, gran_k)
    xf = torch.nn.functional.pad(x.float(), (0, kp - k, 0, np_ - n))
    v = xf.reshape(*x.shape[:-2], np_ // gran_k, gran_k, kp // gran_k, gran_k)
    amax = v.abs().amax(dim=(-3, -1), keepdim=True).clamp(min=_AMAX_FLOOR)
    sf = amax / FP8_E4M3_MAX
    if use_ue8m0:
        sf = ceil_to_ue8m0(sf)
    data = cast_to_e4m3(v * (1.0 / sf)).reshape(*x.shape[:-2], np_, kp)[..., :n, :k]
    return data.contiguous(), sf.reshape(*x.shape[:-2], np_ // gran_k, kp // gran_k)


def _scales_as_float(name: str, sf: torch.Tensor) -> torch.Tensor:
    if sf.dtype in _INT_DTYPES_FOR_UE8M0:
        return unpack_ue8m0_from_int(sf)
    if sf.dtype != torch.float32:
        raise TypeError(
            f"{name} must be float32 or packed UE8M0 (int32/int16/uint8), got {sf.dtype}"
        )
    return sf


def _expand(
    sf: torch.Tensor, mn: int, k: int, gran_mn: int, gran_k: int
) -> torch.Tensor:
    """float32 ``[..., >=ceil(mn/gran_mn), >=ceil(k/gran_k)]`` -> ``[..., mn, k]``."""
    i = torch.arange(mn) // gran_mn
    j = torch.arange(k) // gran_k
    return sf.index_select(-2, i).index_select(-1, j)


def per_token_cast_back(
    x_fp8: torch.Tensor,
    x_scales: torch.Tensor,
    gran_k: int = 128,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Inverse of the per-token casts: ``data * scale`` per ``gran_k``-channel group.

    ``x_fp8`` ``[..., M, K]`` e4m3; ``x_scales`` float32 ``[..., M, >= ceil(K/gran_k)]`` or
    packed UE8M0 (int32 four per word, int16 pairs, uint8 bytes), any strides (row- or
    MN-major). Computed in float32 and returned as ``dtype`` (bf16 by default, as DeepEP's
    helper); a 2-D bf16 cast back with UE8M0 scales runs the native kernel
    (:func:`deepep_ascend.native.dequant_rows_e4m3`, same bits) where it was built. Raises
    ``TypeError`` for wrong dtypes, ``ValueError`` for mismatched shapes.
    """
    _check_tensor("x_fp8", x_fp8, (torch.float8_e4m3fn,))
    _check_tensor("x_scales", x_scales)
    _check_gran("gran_k", gran_k)
    if x_fp8.dim() < 2 or x_scales.dim() != x_fp8.dim():
        raise ValueError(
            f"x_fp8 [..., M, K] and x_scales [..., M, S] need the same >= 2 dims, got "
            f"{tuple(x_fp8.shape)} and {tuple(x_scales.shape)}"
        )
    m, k = x_fp8.shape[-2], x_fp8.shape[-1]
    # one scale per group: UE8M0 bytes (what the native kernel reads) or float32
    packed = x_scales.dtype in _INT_DTYPES_FOR_UE8M0
    sf = _row_major(x_scales).view(torch.uint8) if packed else _scales_as_float("x_scales", x_scales)
    if tuple(sf.shape[:-1]) != tuple(x_fp8.shape[:-1]) or sf.size(-1) < ceil_div(
        k, gran_k
    ):
        raise ValueError(
            f"x_scales shape {tuple(x_scales.shape)} does not fit x_fp8 {tuple(x_fp8.shape)} "
            f"at gran_k={gran_k}"
        )
    if packed and dtype == torch.bfloat16 and x_fp8.dim() == 2 and k % gran_k == 0 and matrix_ok(x_fp8):
        out = torch.empty(m, k, dtype=torch.bfloat16)
        if _native.dequant_rows_e4m3(out, x_fp8, sf[:, :k // gran_k], None, gran_k):
            return out
    return _cast_back_torch(x_fp8, _ue8m0_byte_to_float(sf) if packed else sf, gran_k, dtype)


def _cast_back_torch(x_fp8: torch.Tensor, sf: torch.Tensor, gran_k: int, dtype: torch.dtype) -> torch.Tensor:
    """:func:`per_token_cast_back`'s torch path on checked operands (``sf`` float32 scales)."""
    m, k = x_fp8.shape[-2], x_fp8.shape[-1]
    vals = e4m3_to_float(x_fp8)
    if k % gran_k == 0:  # scale groups in place, without a full-size scale tensor
        g = k // gran_k
        vals.view(*vals.shape[:-1], g, gran_k).mul_(sf[..., :g].unsqueeze(-1))
    else:
        vals.mul_(_expand(sf, m, k, 1, gran_k))
    return vals.to(dtype)


def per_block_cast_back(
    x_fp8: torch.Tensor,
    sf: torch.Tensor,
    gran_k: int = 128,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of :func:`per_block_cast_to_fp8`: ``x_fp8 [..., N, K]`` e4m3 times its tile scale
    ``sf`` float32 ``[..., ceil(N/gran_k), ceil(K/gran_k)]``, returned as ``dtype``.
    Raises ``TypeError``/``ValueError`` on bad input."""
    _check_tensor("x_fp8", x_fp8, (torch.float8_e4m3fn,))
    _check_tensor("sf", sf, (torch.float32,))
    n, k = x_fp8.shape[-2], x_fp8.shape[-1]
    want = (*x_fp8.shape[:-2], ceil_div(n, gran_k), ceil_div(k, gran_k))
    if tuple(sf.shape) != want:
        raise ValueError(f"sf must have shape {want}, got {tuple(sf.shape)}")
    return e4m3_to_float(x_fp8).mul_(_expand(sf, n, k, gran_k, gran_k)).to(dtype)


# ----------------------------------------------------------------------------------------------
# FP4 e2m1


def quantize_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Encode (already scaled) values as e2m1 codes, uint8 0..15, same shape.

    Magnitude index = number of thresholds 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5 strictly below
    ``|x|`` (ties to the smaller magnitude, saturation at 6); bit 3 is the sign, set only for a
    negative ``x`` with a nonzero magnitude. NaN input gives an unspecified code. ``x`` is
    float32/bf16/fp16/float64 (``TypeError`` otherwise).
    """
    _check_tensor("x", x, _FLOAT_INPUTS)
    ax = x.float().abs().clamp_max(FP4_E2M1_MAX)
    idx = torch.bucketize(ax, torch.tensor(_E2M1_THRESHOLDS, dtype=torch.float32))
    code = idx.to(torch.uint8)
    neg = (x < 0) & (idx != 0)
    return code | (neg.to(torch.uint8) << 3)


def dequantize_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (uint8/int8, low 4 bits used) -> float32 values (code 8, "−0", gives +0), same
    shape. Raises ``TypeError`` for another dtype."""
    _check_tensor("codes", codes, (torch.uint8, torch.int8))
    c = codes.to(torch.int32) & 0xF
    lut = torch.tensor(
        _E2M1_VALUES + tuple(-v for v in _E2M1_VALUES), dtype=torch.float32
    )
    lut[8] = 0.0
    return lut[c]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack codes ``[..., K]`` (K even) into int8 ``[..., K/2]``: element ``2i`` in the low
    nibble, ``2i+1`` in the high nibble. Raises ``TypeError``/``ValueError`` on bad input."""
    _check_tensor("codes", codes, (torch.uint8, torch.int8))
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
    _check_tensor("packed", packed, (torch.int8, torch.uint8, torch.float4_e2m1fn_x2))
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
    _float_rows("x", x)
    _check_gran("gran_k", gran_k)
    if x.size(-1) % 2:
        raise ValueError(f"x's last dim must be even for FP4 packing, got {x.size(-1)}")
    if use_packed_ue8m0 and not use_ue8m0:
        raise ValueError("use_packed_ue8m0=True requires use_ue8m0=True")
    k = x.size(-1)
    g = _group_last_dim(x, gran_k)
    amax = g.abs().amax(dim=-1).clamp(min=_AMAX_FLOOR)
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
    _check_tensor("packed", packed, (torch.int8, torch.uint8, torch.float4_e2m1fn_x2))
    _check_tensor("sf", sf)
    _check_gran("gran_k", gran_k)
    if use_packed_ue8m0 and sf.dtype not in _INT_DTYPES_FOR_UE8M0:
        raise TypeError(f"use_packed_ue8m0=True needs an integer sf, got {sf.dtype}")
    vals = dequantize_e2m1(unpack_fp4(packed))
    m, k = vals.shape[-2], vals.shape[-1]
    s = _scales_as_float("sf", sf)
    if tuple(s.shape[:-1]) != tuple(vals.shape[:-1]) or s.size(-1) < ceil_div(
        k, gran_k
    ):
        raise ValueError(
            f"sf shape {tuple(sf.shape)} does not fit packed {tuple(packed.shape)} at gran_k={gran_k}"
        )
    return vals * _expand(s, m, k, 1, gran_k)


# ----------------------------------------------------------------------------------------------
# dequantized weights (cached)


def _dequantize_operand(
    data: torch.Tensor,
    sf: torch.Tensor,
    gran_mn: int,
    gran_k: int,
    name: str = "operand",
) -> torch.Tensor:
    """float32 ``[..., MN, K]`` of an FP8 (e4m3 ``[..., MN, K]``) or FP4 (int8 ``[..., MN, K/2]``)
    operand with float32 scales ``[..., ceil(MN/gran_mn), ceil(K/gran_k)]`` or packed UE8M0
    ``[..., MN, >= ceil(ceil(K/gran_k)/per_word)]`` (then ``gran_mn`` must be 1)."""
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
    if sf.dtype in _INT_DTYPES_FOR_UE8M0:
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
    return vals * _expand(s, mn, k, gran_mn, gran_k)


def _to_exact_bf16(x: torch.Tensor) -> torch.Tensor:
    """``x`` as bf16 if every value is exactly representable, else ``x`` (float32)."""
    b = x.to(torch.bfloat16)
    return b if torch.equal(b.float(), x) else x


# Re-entrant: dropping an entry can free a tensor that keys another entry, whose finalizer (_forget) takes
# the lock again; values are also released after the lock where the code can arrange it.
_cache_lock = threading.RLock()
_cache: collections.OrderedDict = collections.OrderedDict()  # key -> (refs, versions, value, nbytes)
_cache_enabled = True
_cache_max_bytes: int | None = None  # the budget; None until the caches are first used (_max_bytes)
_cache_bytes = 0
_cache_stats = {"hits": 0, "misses": 0, "evictions": 0}
_cache_warned = False


def _check_max_bytes(name: str, value) -> int:
    """``value`` as an int >= 0 (any integer type but bool), else ValueError naming ``name``."""
    try:
        n = (None if isinstance(value, bool) or getattr(value, "dtype", None) == torch.bool
             or getattr(value, "ndim", 0) != 0 else operator.index(value))
    except TypeError:
        n = None
    if n is None or n < 0:
        raise ValueError(f"{name} must be an int >= 0 (bytes), got {value!r}")
    return n


def _max_bytes() -> int:
    """The caches' budget in bytes (call with the lock held). Read at the caches' first use, not at import (a
    bad value must not keep the package from importing): ``DEEPEP_ASCEND_WEIGHT_CACHE_BYTES`` if set, else a
    quarter of the machine's physical memory (8 GiB where the OS does not say), unless
    :func:`set_dequantized_weight_cache` set one first.

    Raises:
        deepep_ascend.settings.SettingError: the variable holds something other than an int >= 0 (the
            budget stays unset: every use raises until the variable or the budget is fixed).
    """
    global _cache_max_bytes
    if _cache_max_bytes is None:
        value = settings.WEIGHT_CACHE_BYTES.get()
        if value is None:
            try:
                value = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
            except (AttributeError, ValueError, OSError):
                value = 8 << 30
        _cache_max_bytes = value
    return _cache_max_bytes


WeightCacheInfo = collections.namedtuple("WeightCacheInfo", "hits misses evictions entries nbytes max_bytes")
WeightCacheInfo.__doc__ = """:func:`dequantized_weight_cache_info`'s counters (since the last clear) and sizes (bytes)."""


def set_dequantized_weight_cache(enabled: bool | None = None, max_bytes: int | None = None) -> None:
    """Enable or disable the weight caches (on at import): the dequantized copies of
    :func:`dequantize_weights`, the bf16 GEMMs' prepacked weights and MegaMoE's
    un-transformed weights. Disabling clears them. Not in DeepGEMM.

    Args:
        enabled: whether calls cache the copies they build (``None``: unchanged, to set only the budget).
        max_bytes: the caches' budget in bytes (an int >= 0; ``None`` keeps the current one). The
            initial budget is ``DEEPEP_ASCEND_WEIGHT_CACHE_BYTES`` if set (read when the caches are first
            used, unless a budget was set here before), else a quarter of physical memory, per process.
            Past it, the least recently used copies are dropped, prepacked ones first (rebuilt on their
            next use; a ``RuntimeWarning`` says so once per process); a copy larger than the whole budget
            is not cached, and a prepacked copy is made only if it fits beside what is cached (else the
            weight multiplies with ``torch.matmul``, as with the caches off). Lowering the budget drops
            copies now.
    Raises:
        ValueError: ``max_bytes`` not an int >= 0, or ``enabled`` not True, False or None.
    """
    global _cache_enabled, _cache_max_bytes
    if max_bytes is not None:
        max_bytes = _check_max_bytes("max_bytes", max_bytes)
    if enabled is not None and not isinstance(enabled, (bool, np.bool_)):
        raise ValueError(f"enabled must be True, False or None, got {enabled!r}")
    if enabled is not None:
        _cache_enabled = bool(enabled)
        if not enabled:
            clear_dequantized_weight_cache()
    if max_bytes is not None:
        with _locked():
            _cache_max_bytes = max_bytes
            evicted = _evict_to(max_bytes)
        del evicted  # released outside the lock


def clear_dequantized_weight_cache() -> None:
    """Drop every cached weight copy (dequantized, prepacked, un-transformed) and reset the counters of
    :func:`dequantized_weight_cache_info`."""
    global _cache_bytes
    with _locked():
        entries = list(_cache.values())
        _cache.clear()
        _cache_bytes = 0
        _cache_stats.update(hits=0, misses=0, evictions=0)
    del entries  # the cached tensors die here, outside the lock


def dequantized_weight_cache_info() -> WeightCacheInfo:
    """The weight caches' state, like ``functools.lru_cache``'s ``cache_info()`` (not in DeepGEMM, whose
    GPU kernels read FP8/FP4 weights directly): ``hits``, ``misses`` (calls that found no copy while the
    caches were on) and ``evictions`` (copies dropped for the byte budget) since the last
    :func:`clear_dequantized_weight_cache`, and ``entries``, ``nbytes`` (bytes the cached copies hold;
    prepacked weights count in full once cached, though each group is packed on first use) and
    ``max_bytes`` (the budget, :func:`set_dequantized_weight_cache`).

    Raises:
        deepep_ascend.settings.SettingError: the budget is still unread and ``DEEPEP_ASCEND_WEIGHT_CACHE_BYTES``
            is not an int >= 0.
    """
    with _locked():
        return WeightCacheInfo(_cache_stats["hits"], _cache_stats["misses"], _cache_stats["evictions"], len(_cache),
                               _cache_bytes, _max_bytes())


def _nbytes(value, keys) -> int:
    """Bytes a cached value holds: tensors by their storage (0 when it is a key tensor's, e.g. weights used
    as they are; oneDNN's opaque packed tensors by their logical size), tuples and lists by their items, other
    objects by their ``nbytes`` (0 without)."""
    if isinstance(value, torch.Tensor):
        if value.is_mkldnn:
            return value.nbytes
        storage = value.untyped_storage()
        if any(storage.data_ptr() == k.untyped_storage().data_ptr() for k in keys):
            return 0
        return storage.nbytes()
    if isinstance(value, (tuple, list)):
        return sum(_nbytes(v, keys) for v in value)
    return int(getattr(value, "nbytes", 0))


class _Entry:
    """One cached copy: weak references to its key tensors' bases (and their ids), their versions, the value,
    its bytes, and whether it is optional (a prepacked copy: callers can multiply without it, so it never
    pushes out a required copy such as a dequantized weight)."""

    __slots__ = ("refs", "ids", "versions", "value", "nbytes", "optional")

    def __init__(self, bases, versions, value, nbytes, optional):
        self.refs = tuple(weakref.ref(b) for b in bases)
        self.ids = tuple(id(b) for b in bases)
        self.versions, self.value, self.nbytes, self.optional = versions, value, nbytes, optional


_state = threading.local()  # .depth: this thread is inside a critical section of the caches
_pending: collections.deque = collections.deque()  # ids of dead key tensors whose entries are still to drop


@contextlib.contextmanager
def _section():
    """The caches' lock, counted in ``_state.depth`` (what tells :func:`_forget` it runs inside a section)."""
    with _cache_lock:
        _state.depth = getattr(_state, "depth", 0) + 1
        try:
            yield
        finally:
            _state.depth -= 1


@contextlib.contextmanager
def _locked():
    """The caches' lock. Finalizers of key tensors (:func:`_forget`) can run inside it, on this thread, when a
    garbage collection or a release happens there; they only queue the dead tensor, and the entries keyed on
    it are dropped when the outermost section ends, never while a section is iterating over the entries."""
    try:
        with _section():
            yield
    finally:
        if _pending and not getattr(_state, "depth", 0):
            _process_pending()


def _drop(key) -> _Entry | None:
    """Remove ``key``'s entry (the lock held) and return it, to be released after the lock."""
    global _cache_bytes
    entry = _cache.pop(key, None)
    if entry is not None:
        _cache_bytes -= entry.nbytes
    return entry


def _evict_to(budget: int, protect: tuple = ()) -> list:
    """Drop entries until the cache holds at most ``budget`` bytes (the lock held): the optional ones (packed
    copies) first, then the required ones, each least recently used first, never one whose value is among
    ``protect``; returns them, to be released after the lock."""
    evicted = []
    for optional in (True, False):
        for key in list(_cache):
            if _cache_bytes <= budget:
                break
            entry = _cache.get(key)
            if entry is None or entry.optional != optional or any(entry.value is t for t in protect):
                continue
            evicted.append(_drop(key))
    _cache_stats["evictions"] += len(evicted)
    return evicted


def _fits(nbytes: int) -> bool:
    """Whether an optional copy (a prepacked weight) of ``nbytes`` would be kept: the caches are on and it fits
    the budget beside every cached copy, since an optional copy pushes out none (two weights whose packed
    copies take turns pushing each other out would be packed on every call, slower than not packing).
    Callers skip building an optional copy that would not be kept and multiply without it; the budget's
    warning says so (once per process) when the caches are on. Raises ``SettingError`` as
    :func:`_cached_by_tensors`."""
    with _locked():
        enabled, fits = _cache_enabled, nbytes + _cache_bytes <= _max_bytes()
    if enabled and not fits:
        _warn_budget(nbytes, True)
    return enabled and fits


def _caller_stacklevel() -> int:
    """``warnings.warn``'s stacklevel of the first frame outside this package (its caller's code)."""
    pkg = os.path.dirname(os.path.abspath(__file__))
    f, level = sys._getframe(1), 1
    while f is not None:
        where = os.path.dirname(os.path.abspath(f.f_code.co_filename))
        if where != pkg and not where.startswith(pkg + os.sep):
            break
        f, level = f.f_back, level + 1
    return level


def _warn_budget(nbytes: int, too_big: bool) -> None:
    global _cache_warned
    if _cache_warned:
        return
    _cache_warned = True
    what = (f"a copy of {nbytes} bytes does not fit it and was not cached" if too_big else
            f"older copies were dropped to make room for one of {nbytes} bytes")
    warnings.warn(f"deepep_ascend: the weight caches' budget of {_cache_max_bytes} bytes is full ({what}): "
                  f"weights beyond it are dequantized or packed again when used, or multiply unpacked. Raise it with "
                  f"set_dequantized_weight_cache(max_bytes=...) or {settings.WEIGHT_CACHE_BYTES.name}; "
                  f"dequantized_weight_cache_info() counts the evictions.", RuntimeWarning,
                  stacklevel=_caller_stacklevel())


def _cacheable(tensors) -> bool:
    """Whether :func:`_cached_by_tensors` can cache on ``tensors``: the caches are enabled and no tensor
    is an inference tensor (those have no version counter to tell an in-place write)."""
    return _cache_enabled and not any(t.is_inference() for t in tensors)


def _tensor_key(t: torch.Tensor) -> tuple:
    """``(base, key)``: a view is keyed by its base tensor (whose version counter it shares) and its
    geometry, so a fresh view of the same weights each call (``w[layer]``) still hits."""
    base = t._base if t._base is not None else t
    return base, (id(base), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


_watched: dict = {}  # id -> weak reference of each base tensor with a finalizer registered (one per tensor)


def _cached_by_tensors(tag: tuple, tensors: tuple, build, optional: bool = False):
    """``build()``, cached while every tensor of ``tensors`` lives with its current version counter.

    The key is ``tag`` plus each tensor's base identity and view geometry: an in-place write
    through any view sharing a tensor's version counter invalidates the entry, and entries die
    with their base tensors. Writes that bypass the version counter (``.data``, numpy or DLPack
    aliases) are not seen: clear the cache after them (:func:`clear_dequantized_weight_cache`). The
    entries hold at most the byte budget (:func:`set_dequantized_weight_cache`), least recently used
    dropped first (optional copies before required ones), never a cached copy among ``tensors`` (which
    the new entry needs); an ``optional`` copy is kept only if it fits without pushing out anything.
    ``build`` runs without autograd and outside inference mode (a cached value must not hold a graph,
    which would keep its keys alive, nor be an inference tensor, which a later call outside inference
    mode could not use with autograd) and may return None to decline (nothing cached, None returned).
    With the caches disabled or an inference tensor among ``tensors``, every call builds.

    Args:
        tag: a hashable tuple naming what ``build`` makes of the tensors (e.g. ``("dequantize", 1, 128,
            True)``): two callers caching different things on the same tensors use different tags.
        tensors: the tensors the value derives from (its key).
        build: a function of no arguments returning the value (any object; its bytes as :func:`_nbytes`
            counts them) or None.
        optional: the value is a copy callers can do without (a packed weight).
    Returns:
        The cached or built value, or None if ``build`` declined.
    Raises:
        deepep_ascend.settings.SettingError: ``DEEPEP_ASCEND_WEIGHT_CACHE_BYTES`` is not an int >= 0 (read at
            the caches' first use); whatever ``build`` raises.
    """
    global _cache_bytes
    if not _cacheable(tensors):
        with torch.no_grad():
            return build()
    bases, keys = zip(*(_tensor_key(t) for t in tensors))
    key = tag + keys
    versions = tuple(t._version for t in tensors)
    stale = None
    with _locked():
        _max_bytes()  # a bad budget setting raises here, before anything is built
        hit = _cache.get(key)
        if hit is not None:
            if hit.versions == versions and all(r() is b for r, b in zip(hit.refs, bases)):
                _cache.move_to_end(key)
                _cache_stats["hits"] += 1
                return hit.value
            stale = _drop(key)
        _cache_stats["misses"] += 1
    hit = stale = None  # a stale entry's tensors die here, outside the lock
    with torch.inference_mode(False), torch.no_grad():
        out = build()
    if out is None:  # the builder declined (a copy that could not be kept)
        return None
    nbytes = _nbytes(out, tensors)
    evicted, new, full = [], [], False
    with _locked():
        if _cache_enabled:  # not switched off while building
            stale = _drop(key)  # another thread built it meanwhile
            budget = _max_bytes()
            room = budget - nbytes
            full = (nbytes + _cache_bytes > budget if optional else
                    nbytes + sum(e.nbytes for e in list(_cache.values()) if any(e.value is t for t in tensors))
                    > budget)
            if not full:
                evicted = _evict_to(room, protect=tensors)
                _cache[key] = _Entry(bases, versions, out, nbytes, optional)
                _cache_bytes += nbytes
                for b in bases:
                    ref = _watched.get(id(b))
                    if ref is None or ref() is not b:
                        _watched[id(b)] = weakref.ref(b)
                        new.append(b)
    for b in new:  # before anything that can raise (a warning filtered into an error)
        weakref.finalize(b, _forget, id(b))
    del stale
    if full or evicted:
        del evicted
        _warn_budget(nbytes, full)
    return out


def _forget(base_id: int) -> None:
    """A key tensor died (its finalizer): queue it; its entries are dropped at once, or when the section of the
    caches this thread is in ends (:func:`_locked`)."""
    _pending.append(base_id)
    if not getattr(_state, "depth", 0):
        _process_pending()


def _process_pending() -> None:
    """Drop the entries keyed on the dead tensors queued by :func:`_forget` (only entries whose reference to that
    tensor is dead: an id can be reused). Their values are released outside the lock (which can queue more)."""
    while _pending:
        with _section():  # not _locked(): its exit would come back here
            ids = set()
            while _pending:
                ids.add(_pending.popleft())
            for i in ids:
                ref = _watched.get(i)
                if ref is not None and ref() is None:
                    del _watched[i]
            entries = [_drop(k) for k, e in list(_cache.items())
                       if any(i in ids and r() is None for i, r in zip(e.ids, e.refs))]
        del entries


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
    (legacy float32 scales: mega-moe.md §4 says dequantize to fp32).

    With ``cache`` (and the module cache enabled) the result is cached keyed by the identity and
    version counter of ``data`` and ``sf`` (an in-place write invalidates it; entries die with the
    tensors; within the caches' byte budget, :func:`set_dequantized_weight_cache`). Raises
    ``TypeError``/``ValueError`` on bad input.
    """
    _check_tensor("data", data)
    _check_tensor("sf", sf)
    _check_gran("gran_mn", gran_mn)
    _check_gran("gran_k", gran_k)

    def build():
        logical = data if k_major else data.transpose(-1, -2)
        return _to_exact_bf16(_dequantize_operand(logical, sf, gran_mn, gran_k, "weights"))

    if not cache:
        return build()
    return _cached_by_tensors(("dequantize", gran_mn, gran_k, k_major), (data, sf), build)


# ----------------------------------------------------------------------------------------------
# LogFMT-10 (DeepEP's low-latency combine transport, deepep-buffer-api.md §6.3)

#: Channels per LogFMT group.
LOGFMT_GROUP = 128
#: Bytes of one group's body: 128 ten-bit values (a BF16 group's first 160 bytes).
LOGFMT_BODY_BYTES = 160
#: Bytes of a BF16 group past its body (256 - 160), sent in the row's tail.
LOGFMT_TAIL_BYTES = 96
#: Metadata bytes per group: ``(amax, amin)`` as two bf16.
LOGFMT_META_BYTES = 4
_LOGFMT_LEVELS = 510  # step = (la - lb) / 510: codes 1..511 cover [lb, la]
_LOGFMT_CLIP = 32.0  # lb >= la - 32
_LN2 = 0.6931471805599453
_bf16_log2 = None


def _bf16_log2_table() -> torch.Tensor:
    """float32 ``[32768]``: ``log2`` of the bf16 magnitude with bits ``b`` (computed in float64,
    rounded once); ``b = 0`` gives ``-inf``, exponent 255 (inf, NaN) ``+inf``."""
    global _bf16_log2
    if _bf16_log2 is None:
        mags = torch.arange(1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
        t = torch.log2(mags.double()).float()
        t[0x7F80:] = float("inf")
        _bf16_log2 = t
    return _bf16_log2


def _expm1_f64(r: torch.Tensor, degree: int) -> torch.Tensor:
    """``e**r - 1`` for float64 ``r >= 0`` by Horner's rule on the Taylor series to ``degree``.

    Multiplies, divides and adds only: torch's ``exp``/``log`` kernels take different vector
    and scalar paths depending on where an element falls in the tensor, these do not, so a
    group's parameters have the same bits whatever batch it is encoded or decoded in.
    """
    p = torch.ones_like(r)
    for k in range(degree, 1, -1):
        p = 1.0 + p * r / k
    return p * r


def _exp2_f64(v: torch.Tensor) -> torch.Tensor:
    """``2**v`` for float64 ``-1022 <= v < 1024``, relative error below 1e-13."""
    n = torch.floor(v)
    scale = ((n.to(torch.int64) + 1023) << 52).view(torch.float64)  # 2**n from the bits
    return (1.0 + _expm1_f64((v - n) * _LN2, 14)) * scale


_logfmt_lut = None


def _logfmt_luts():
    """Decode lookup tables: ``spread`` int32 ``[256, 4]`` (a top-bits byte -> its four values'
    bits 8-9, in place), and for each 10-bit value ``v = c | sign << 9`` the int64 indices
    ``hi_of[v]`` / ``lo_of[v]`` into the per-group tables of :func:`logfmt10_decode`: with
    ``c' = c + 31``, ``hi = c' >> 5`` (+17 for the sign; 0 only for ``c = 0``), ``lo = c' & 31``."""
    global _logfmt_lut
    if _logfmt_lut is None:
        b = torch.arange(256, dtype=torch.int32).unsqueeze(1)
        spread = ((b >> torch.tensor([0, 2, 4, 6], dtype=torch.int32)) & 3) << 8
        v = torch.arange(1024, dtype=torch.int64)
        c = (v & 0x1FF) + 31
        _logfmt_lut = (spread.contiguous(), (c >> 5) + (v >> 9) * 17, c & 31)
    return _logfmt_lut


def _logfmt_params(amax_bits: torch.Tensor, amin_bits: torch.Tensor):
    """Per group, from the metadata's bf16 magnitude bits (int16): ``(use, lb, step, rho, em1)``.

    ``la = log2 amax``, ``lb = max(log2 amin, la - 32)``, ``use = la < 0 and lb < la``,
    ``step = (la - lb) / 510`` (float32) and ``rho = 2 - log2((1 + 2**step) / 2) / step``
    (float64 series, rounded to float32); ``em1 = 2**step - 1`` (float64). Groups that go as
    BF16 get ``lb = 0, step = 1`` (unused). Encoder and decoder both call this on the same
    bits, so they agree on every parameter bit for bit.
    """
    table = _bf16_log2_table()
    la = table[amax_bits.long()]
    lb = torch.maximum(table[amin_bits.long()], la - _LOGFMT_CLIP)
    use = (la < 0) & (lb < la)
    step = torch.where(use, (la - lb) / _LOGFMT_LEVELS, 1.0)
    lb = torch.where(use, lb, 0.0)
    s = step.double()
    em1 = _expm1_f64(s * _LN2, 10)  # step <= 32/510: s·ln2 < 0.044, ten terms reach float64 rounding
    u = em1 / 2  # (1 + 2**s) / 2 - 1
    z = u / (2.0 + u)
    z2 = z * z  # log(1 + u) = 2 atanh(z), z < 0.012: four terms reach float64 rounding
    atanh = z * (1.0 + z2 * (1.0 / 3 + z2 * (1.0 / 5 + z2 * (1.0 / 7 + z2 / 9))))
    rho = (2.0 - (2.0 * atanh / _LN2) / s).float()
    return use, lb, step, rho, em1


def _logfmt_rows(name: str, x: torch.Tensor) -> int:
    if x.dim() < 1 or x.size(-1) % LOGFMT_GROUP:
        raise ValueError(
            f"{name} must have a last dim that is a multiple of {LOGFMT_GROUP} (LogFMT groups), "
            f"got shape {tuple(x.shape)}"
        )
    return x.numel() // LOGFMT_GROUP


def logfmt10_group_mask(meta: torch.Tensor) -> torch.Tensor:
    """bool ``[..., S]``: which groups of :func:`logfmt10_encode`'s ``meta`` travel as LogFMT
    (``la < 0`` and ``lb < la``); the others travel as BF16. Raises ``TypeError``/``ValueError``
    unless ``meta`` is bf16 ``[..., S, 2]``."""
    _check_tensor("meta", meta, (torch.bfloat16,))
    if meta.dim() < 2 or meta.size(-1) != 2:
        raise ValueError(f"meta must be [..., S, 2], got shape {tuple(meta.shape)}")
    bits = meta.contiguous().view(torch.int16)
    return _logfmt_params(bits[..., 0], bits[..., 1])[0]


def logfmt10_wire_bytes(meta: torch.Tensor) -> torch.Tensor:
    """int64 ``[...]``: bytes each row takes on the wire, ``4S + 160·(LogFMT groups) + 256·(BF16
    groups)``: ``1.25H + H/32`` when every group is LogFMT (spec §11), at most ``2H + H/32``.
    ``meta`` as :func:`logfmt10_encode` returns it (bf16 ``[..., S, 2]``); raises as
    :func:`logfmt10_group_mask`."""
    use = logfmt10_group_mask(meta)
    s = use.size(-1)
    return (LOGFMT_META_BYTES + LOGFMT_BODY_BYTES) * s + LOGFMT_TAIL_BYTES * (~use).sum(-1)


def logfmt10_encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Encode bf16 rows to LogFMT-10 (DeepEP's low-latency combine format, spec §6.3).

    Per group of 128 channels (``S = H / 128`` groups per row), with magnitudes ``|x|``:

    * ``amax = max|x|`` and ``amin`` = the smallest **nonzero** ``|x|`` (0 if the group is all
      zero), both exact bf16 values, are the group's metadata. ``la = log2 amax``,
      ``lb = max(log2 amin, la - 32)`` (``log2`` of the bf16 value rounded to float32). The
      group is LogFMT only if ``la < 0`` and ``lb < la``, else it travels as BF16, exactly
      (any ``|x| >= 1``, all magnitudes equal, all zero, inf or NaN). DeepEP's kernel takes
      ``amin`` over all elements, so there one zero sends a group to ``lb = la - 32``; skipping
      zeros gives the same or a finer step, and a zero still decodes to zero.
    * Code ``c = floor(max((log2|x| - lb) / step + rho, 0))`` (float32, at most 511) with
      ``step = (la - lb) / 510``, ``rho = 2 - log2((1 + 2**step) / 2) / step``: the level
      ``2**(lb + (c - 1)·step)`` nearest to ``|x|`` in linear terms. A zero, and a magnitude
      below about ``2**lb`` (possible only when ``lb`` was clipped to ``la - 32``), get
      ``c = 0``. The 10-bit value is ``c | sign << 9``.

    Wire format (little-endian), per row of ``S`` groups:

    * ``meta`` bf16 ``[..., S, 2]``: ``(amax, amin)`` per group, 4 bytes, ``H/32`` per row.
      The metadata is exact and both ends derive ``la, lb, step, rho`` from it with the same
      arithmetic, so it costs no precision beyond the 9-bit codes.
    * ``body`` uint8 ``[..., S, 160]``: a LogFMT group's 128 values at 10 bits each, in two
      planes: byte ``j`` holds value ``j``'s low 8 bits, and byte ``128 + j // 4`` its top two
      (code bit 8, sign) at bits ``2·(j % 4)`` and ``2·(j % 4) + 1``; a BF16 group's first 160
      bytes.
    * ``tail`` uint8 ``[F, 96]``: the last 96 bytes of each of the ``F`` BF16 groups, in
      row-major order (rows, then groups).

    A row takes ``1.25H + H/32`` bytes when all its groups are LogFMT (spec §11), plus 96 per
    BF16 group, ``2H + H/32`` at most (:func:`logfmt10_wire_bytes`).

    Args:
        x: bfloat16 ``[..., H]``, ``H % 128 == 0``; any strides.
    Returns:
        ``(body, meta, tail)`` as above (``body`` and ``meta`` with ``x``'s leading dims).
    Raises:
        TypeError: ``x`` is not a bfloat16 tensor. ValueError: ``H % 128 != 0``.
    """
    _check_tensor("x", x, (torch.bfloat16,))
    g = _logfmt_rows("x", x)
    lead, s = x.shape[:-1], x.size(-1) // LOGFMT_GROUP
    xb = x.reshape(g, LOGFMT_GROUP).view(torch.int16)
    mag = xb & 0x7FFF  # bf16 magnitudes order like their bits (NaN above inf)
    if g:
        amax = mag.amax(1)
        amin = torch.where(amax == 0, 0, ((mag - 1) & 0x7FFF).amin(1) + 1)  # 0 -> 0x7FFF: skips zeros
    else:
        amax = amin = mag.new_zeros(0)
    meta = torch.stack([amax, amin], 1).view(torch.bfloat16)
    use, lb, step, rho, _ = _logfmt_params(amax, amin)
    raw = xb.view(torch.uint8)  # [g, 256]: the BF16 bytes
    sel = torch.nonzero(use).squeeze(1)
    every = g > 0 and sel.numel() == g
    body = None if every else raw[:, :LOGFMT_BODY_BYTES].clone()
    if sel.numel():
        m, xs = (mag, xb) if every else (mag.index_select(0, sel), xb.index_select(0, sel))
        if not every:
            lb, step, rho = lb[sel], step[sel], rho[sel]
        q = _bf16_log2_table().index_select(0, m.view(-1).to(torch.int32)).view(-1, LOGFMT_GROUP)
        q.sub_(lb[:, None]).div_(step[:, None]).add_(rho[:, None]).clamp_(0, 511)
        v = q.to(torch.int32)  # truncation = floor for q >= 0; -inf (a zero) was clamped to 0
        v.bitwise_or_(((xs >> 15) & 0x200).view(v.shape))  # sign bit (arithmetic shift of int16)
        packed = torch.empty(v.size(0), LOGFMT_BODY_BYTES, dtype=torch.uint8)
        packed[:, :LOGFMT_GROUP] = v  # low 8 bits (the cast wraps)
        top = (v >> 8).view(-1, 32, 4)  # code bit 8, sign
        packed[:, LOGFMT_GROUP:] = top[..., 0] | (top[..., 1] << 2) | (top[..., 2] << 4) | (top[..., 3] << 6)
        if every:
            body = packed
        else:
            body.index_copy_(0, sel, packed)
    tail = raw[:, LOGFMT_BODY_BYTES:].index_select(0, torch.nonzero(~use).squeeze(1))  # one copy, contiguous
    return body.view(*lead, s, LOGFMT_BODY_BYTES), meta.view(*lead, s, 2), tail


def logfmt10_decode(body: torch.Tensor, meta: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
    """Decode :func:`logfmt10_encode`'s ``(body, meta, tail)`` to float32 ``[..., H]``.

    LogFMT groups: code ``c > 0`` gives ``sign · 2**((c - 1)·step + lb)``, ``c = 0`` gives
    ``0`` (positive). The power is the product of two per-group float32 tables,
    ``2**(lb + 32·k·step)`` and ``2**(l·step)`` with ``c - 1 = 32k + l`` (each from float64,
    rounded once), so it is within 1.5 float32 ulp of the exact power, and an element's value
    depends only on its group's bytes (the same bits whatever batch it is decoded in). BF16 groups decode
    exactly. Relative error of a LogFMT element with ``|x| >= 2**lb``: at most
    ``(2**step - 1) / (2**step + 1)`` (half a level, in linear terms) plus float32 rounding;
    below ``2**lb`` (a clipped ``lb``) the error is at most ``2**lb``.

    Raises ``TypeError`` for wrong dtypes (``body``/``tail`` uint8, ``meta`` bf16) and
    ``ValueError`` for mismatched shapes or a ``tail`` whose row count is not the number of
    BF16 groups.
    """
    _check_tensor("body", body, (torch.uint8,))
    _check_tensor("meta", meta, (torch.bfloat16,))
    _check_tensor("tail", tail, (torch.uint8,))
    if body.dim() < 2 or body.size(-1) != LOGFMT_BODY_BYTES or meta.shape != (*body.shape[:-1], 2):
        raise ValueError(
            f"body [..., S, 160] and meta [..., S, 2] must match, got {tuple(body.shape)} and "
            f"{tuple(meta.shape)}"
        )
    lead = body.shape[:-2]
    g = body.numel() // LOGFMT_BODY_BYTES
    bits = meta.reshape(g, 2).view(torch.int16)
    use, lb, step, _, em1 = _logfmt_params(bits[:, 0], bits[:, 1])
    fb = ~use
    nfb = int(fb.sum())
    if tail.dim() != 2 or tail.shape != (nfb, LOGFMT_TAIL_BYTES):
        raise ValueError(
            f"tail must be [{nfb}, {LOGFMT_TAIL_BYTES}] (one row per BF16 group), got "
            f"{tuple(tail.shape)}"
        )
    flat = body.reshape(g, LOGFMT_BODY_BYTES)
    sel = torch.nonzero(use).squeeze(1)
    every = g > 0 and sel.numel() == g
    out = None if every else torch.empty(g, LOGFMT_GROUP, dtype=torch.float32)
    if sel.numel():
        if not every:
            flat, lb, em1 = flat.index_select(0, sel), lb[sel], em1[sel]
        n = flat.size(0)
        spread, hi_of, lo_of = _logfmt_luts()
        v = spread.index_select(0, flat[:, LOGFMT_GROUP:].reshape(-1).to(torch.int32)).view(n, LOGFMT_GROUP)
        v |= flat[:, :LOGFMT_GROUP]  # the 10-bit values
        v = v.view(-1)
        hi = hi_of.index_select(0, v).view(n, LOGFMT_GROUP)
        lo = lo_of.index_select(0, v).view(n, LOGFMT_GROUP)
        # value(c) = 2**(lb + (c-1)·step) = coarse[hi] · fine[lo] with coarse[h] =
        # 2**(lb + 32·(h-1)·step) (h = 1..16), coarse[0] = 0, the negatives at 17 + h, and
        # fine[l] = 2**(l·step): two lookups and a multiply per value.
        p = 1.0 + em1.unsqueeze(1)  # 2**step
        ones = torch.ones(n, 1, dtype=torch.float64)
        fine = torch.cat([ones, p.expand(n, 31)], 1).cumprod(1)
        coarse = torch.cat([ones, (fine[:, 31:] * p).expand(n, 15)], 1).cumprod(1)  # 2**(32·step·k)
        coarse = coarse * _exp2_f64(lb.double()).unsqueeze(1)
        zero = torch.zeros(n, 1, dtype=torch.float64)
        coarse = torch.cat([zero, coarse, zero, -coarse], 1).float()
        dec = coarse.gather(1, hi).mul_(fine.float().gather(1, lo))
        if every:
            out = dec
        else:
            out.index_copy_(0, sel, dec)
    if nfb:
        fbi = torch.nonzero(fb).squeeze(1)
        raw = torch.cat([body.reshape(g, LOGFMT_BODY_BYTES).index_select(0, fbi), tail], 1)
        out.index_copy_(0, fbi, raw.view(torch.bfloat16).float())
    return out.view(*lead, body.size(-2) * LOGFMT_GROUP)
