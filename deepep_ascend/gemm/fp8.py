"""FP8 e4m3 casts, bit-exact with DeepGEMM and DeepEP: per-token, per-block and per-channel casts and their
cast-backs, DeepEP's low-latency dispatch cast, and a fast e4m3 decode.

Spec: ``docs/semantics/mega-moe.md`` §4 (formats, recipes) and ``docs/semantics/deepep-api.md`` §4.8 / §6.4 (DeepEP's
FP8 casts). Every function is vectorized torch on CPU; none loops over elements.

**e4m3** (``torch.float8_e4m3fn``): max 448, no inf. Values are clamped to ±448 and then cast with
round-to-nearest-even (torch's CPU cast is RNE and saturating). Scales are float32 or UE8M0
(:mod:`.scales`).

Two FP8 per-token recipes exist upstream and differ in rare last-bit cases:

* DeepGEMM (``per_token_cast_to_fp8``, ``per_block_cast_to_fp8``, ...; docs/semantics/mega-moe.md §4):
  ``sf = amax / 448`` (optionally ``ceil_to_ue8m0``), ``data = e4m3(x * (1 / sf))``.
* DeepEP's low-latency dispatch kernel (:func:`low_latency_cast_to_fp8`, docs/semantics/deepep-api.md §6.4):
  ``data = e4m3(x * (448 / amax))`` with one IEEE float32 division, ``amax`` skipping NaN elements; it
  stores ``amax * f32(1/448)`` and with ``round_scale`` derives the power of two from those bits.
* DeepEP's test helper ``deep_ep.utils.math.per_token_cast_to_fp8`` (``scale_style='deepep'``,
  docs/semantics/deepep-api.md §4.8): torch's ``448.0 / amax``, which is ``reciprocal(amax) * 448`` (two
  roundings), and ``scale = amax / 448``. The two DeepEP casts differ by one code in about 0.1 % of elements.
"""

from __future__ import annotations

import torch

from .. import native as _native
from ..checks import check_storage
from ..native.operands import matrix_ok
from .arguments import FLOAT_DTYPES, check_float_rows, check_gran, check_tensor
from .scales import (
    AMAX_FLOOR,
    UE8M0_INT_DTYPES,
    align,
    ceil_div,
    ceil_to_ue8m0,
    expand_scales,
    group_last_dim,
    pack_ue8m0_to_int,
    row_major,
    scales_as_float,
    ue8m0_byte_to_float,
)

__all__ = [
    "FP8_E4M3_MAX",
    "cast_to_e4m3",
    "e4m3_to_float",
    "e4m3_ue8m0_round_trip_",
    "low_latency_cast_to_fp8",
    "low_latency_cast_to_fp8_",
    "per_block_cast_back",
    "per_block_cast_to_fp8",
    "per_channel_cast_to_fp8",
    "per_token_cast_back",
    "per_token_cast_back_torch",
    "per_token_cast_to_fp8",
]

#: Largest finite e4m3 magnitude.
FP8_E4M3_MAX = 448.0


def cast_to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Clamp to ±448, then cast to ``float8_e4m3fn`` with round-to-nearest-even (NaN stays NaN).

    ``x``: a float32/bf16/fp16/float64 tensor of any shape; returns ``float8_e4m3fn`` of the same
    shape (not in DeepGEMM; the cast the per-token and per-block codecs end with). Raises
    ``TypeError`` for another type or dtype."""
    check_tensor("x", x, FLOAT_DTYPES)
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
    check_storage("x", x)
    if out is None:
        out = torch.empty(x.shape, dtype=torch.float32)
    elif not isinstance(out, torch.Tensor) or out.dtype != torch.float32 or tuple(out.shape) != tuple(x.shape):
        raise ValueError(f"out must be a float32 tensor of shape {tuple(x.shape)}, got "
                         f"{getattr(out, 'dtype', type(out).__name__)} {tuple(getattr(out, 'shape', ()))}")
    else:
        check_storage("out", out)
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


def e4m3_ue8m0_round_trip_(x: torch.Tensor, gran: int) -> bool:
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
    ``scale_style='deepep'`` instead multiplies by ``reciprocal(amax) * 448``, rounded twice as DeepEP's
    torch helper's ``448.0 / amax`` is (docs/semantics/deepep-api.md §4.8; only without ``use_ue8m0``; not
    the LL kernel's cast, :func:`low_latency_cast_to_fp8`); the stored ``sf`` is the same.

    Returns ``(data [..., M, K] float8_e4m3fn, sf)`` with ``sf`` float32 ``[..., M,
    ceil(K/gran_k)]``, or with ``use_packed_ue8m0`` (needs ``use_ue8m0``) int32 ``[..., M,
    ceil(ceil(K/gran_k)/4)]`` row-major (see :func:`pack_ue8m0_to_int`;
    :func:`get_mn_major_tma_aligned_packed_ue8m0_tensor` gives the GEMM layout).
    Raises ``TypeError`` for a non-float ``x``, ``ValueError`` for < 2 dims, a bad ``gran_k`` or
    inconsistent flags.
    """
    check_float_rows("x", x)
    check_gran("gran_k", gran_k)
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
    g = group_last_dim(x, gran_k)
    amax = g.abs().amax(dim=-1).clamp(min=AMAX_FLOOR)
    sf = amax / FP8_E4M3_MAX
    if use_ue8m0:
        sf = ceil_to_ue8m0(sf)
    if scale_style == "deepep":  # the helper's torch `448.0 / amax`: a reciprocal, then a product (two roundings)
        mult = amax.reciprocal().mul_(FP8_E4M3_MAX)
    else:
        mult = 1.0 / sf
    data = cast_to_e4m3(g * mult.unsqueeze(-1))
    data = data.reshape(*x.shape[:-1], g.size(-2) * g.size(-1))[..., :k].contiguous()
    return data, (pack_ue8m0_to_int(sf) if use_packed_ue8m0 else sf)


def low_latency_cast_to_fp8(
    x: torch.Tensor, round_scale: bool = False, use_ue8m0: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepEP low-latency dispatch's FP8 cast, bit-exact (docs/semantics/deepep-api.md §6.4).

    ``x`` ``[..., N, H]`` float (DeepEP takes bf16); per token and 128 channels (last group zero-padded),
    ``amax = max(1e-4, max|x|)`` in float32 over the group's non-NaN elements (``fmaxf``) and
    ``r = amax * f32(1/448)``:

    * ``round_scale=False``: ``data = e4m3(x * (448 / amax))``, the quotient one IEEE float32 division
      (not torch's ``448.0 / t``, a reciprocal and a product); scale ``r`` (may differ by one ulp from
      ``amax / 448``);
    * ``round_scale=True``: ``k = ceil(log2(r))`` from ``r``'s bits (:func:`ceil_to_ue8m0`),
      ``data = e4m3(x * 2**-k)``, scale ``2**k``;
    * ``use_ue8m0`` (requires ``round_scale``): scales as packed UE8M0 int32
      ``[..., N, ceil(H/512)]``, byte ``k + 127``, groups ``4p..4p+3`` in word ``p``.

    ``e4m3`` rounds to nearest even and saturates at ±448; a NaN element gives an e4m3 NaN (sign
    unspecified). An infinity makes its group's plain scale ``0`` (finite elements give ±0, the
    infinity NaN, stored scale ``inf``, as DeepEP's arithmetic); with ``round_scale`` DeepEP's
    power-of-two helper is outside its domain, and here the scale clamps to ``2**127`` (the infinity
    gives ±448).

    Returns ``(data [..., N, H] e4m3, scales)``, scales float32 ``[..., N, ceil(H/128)]`` or int32,
    row-major (DeepEP hands them out column-major: ``get_mn_major_tma_aligned_tensor`` /
    a transpose gives that layout). Raises ``ValueError`` for ``use_ue8m0`` without
    ``round_scale`` (DeepEP: ``RuntimeError``), ``TypeError``/``ValueError`` for bad ``x``.
    """
    check_float_rows("x", x)
    if use_ue8m0 and not round_scale:
        raise ValueError("use_ue8m0=True requires round_scale=True")
    k = x.size(-1)
    g = group_last_dim(x, 128, copy=True)
    data = torch.empty(*x.shape[:-1], g.size(-2) * 128, dtype=torch.float8_e4m3fn)
    sf = low_latency_cast_to_fp8_(g, data, round_scale)
    data = data[..., :k].contiguous() if data.size(-1) != k else data
    return data, (pack_ue8m0_to_int(sf) if use_ue8m0 else sf)


def low_latency_cast_to_fp8_(groups: torch.Tensor, data_out: torch.Tensor, round_scale: bool = False) -> torch.Tensor:
    """In-place core of :func:`low_latency_cast_to_fp8` (the cast inside DeepEP's
    ``low_latency_dispatch``, docs/semantics/deepep-api.md §6.4), for callers that own scratch memory.

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

    DeepEP's kernel arithmetic, in float32 (docs/semantics/deepep-api.md §6.4): ``amax`` skips NaN
    elements (``fmaxf``), the plain scale is one IEEE division ``448 / amax`` (torch's ``448.0 / t``
    is a reciprocal and a product: two roundings, one e4m3 code off in about 0.1 % of elements).
    """
    # amax and amin separately: torch.aminmax over 128-element groups is far slower on CPU.
    amax = torch.maximum(groups.amax(dim=-1), groups.amin(dim=-1).neg_())
    nan = amax.isnan()
    if bool(nan.any()):  # fmaxf skips NaN: such a group's amax is over its other elements
        where = nan.nonzero(as_tuple=True)
        g = groups[where].abs_()
        amax[where] = g.masked_fill_(g.isnan(), 0.0).amax(dim=-1)
    amax.clamp_(min=AMAX_FLOOR)
    r = amax * torch.tensor(1.0 / FP8_E4M3_MAX, dtype=torch.float32)
    if round_scale:
        sf = ceil_to_ue8m0(r)
        mult = sf.reciprocal()  # exact: a power of two
    else:
        sf = r
        mult = torch.full_like(amax, FP8_E4M3_MAX).div_(amax)
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
    check_tensor("x", x, FLOAT_DTYPES, (2,))
    check_gran("gran_k", gran_k)
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
    check_float_rows("x", x)
    check_gran("gran_k", gran_k)
    n, k = x.shape[-2], x.shape[-1]
    np_, kp = align(n, gran_k), align(k, gran_k)
    xf = torch.nn.functional.pad(x.float(), (0, kp - k, 0, np_ - n))
    v = xf.reshape(*x.shape[:-2], np_ // gran_k, gran_k, kp // gran_k, gran_k)
    amax = v.abs().amax(dim=(-3, -1), keepdim=True).clamp(min=AMAX_FLOOR)
    sf = amax / FP8_E4M3_MAX
    if use_ue8m0:
        sf = ceil_to_ue8m0(sf)
    data = cast_to_e4m3(v * (1.0 / sf)).reshape(*x.shape[:-2], np_, kp)[..., :n, :k]
    return data.contiguous(), sf.reshape(*x.shape[:-2], np_ // gran_k, kp // gran_k)


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
    check_tensor("x_fp8", x_fp8, (torch.float8_e4m3fn,))
    check_tensor("x_scales", x_scales)
    check_gran("gran_k", gran_k)
    if x_fp8.dim() < 2 or x_scales.dim() != x_fp8.dim():
        raise ValueError(
            f"x_fp8 [..., M, K] and x_scales [..., M, S] need the same >= 2 dims, got "
            f"{tuple(x_fp8.shape)} and {tuple(x_scales.shape)}"
        )
    m, k = x_fp8.shape[-2], x_fp8.shape[-1]
    # one scale per group: UE8M0 bytes (what the native kernel reads) or float32
    packed = x_scales.dtype in UE8M0_INT_DTYPES
    sf = row_major(x_scales).view(torch.uint8) if packed else scales_as_float("x_scales", x_scales)
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
    return per_token_cast_back_torch(x_fp8, ue8m0_byte_to_float(sf) if packed else sf, gran_k, dtype)


def per_token_cast_back_torch(x_fp8: torch.Tensor, sf: torch.Tensor, gran_k: int, dtype: torch.dtype) -> torch.Tensor:
    """:func:`per_token_cast_back`'s torch path, on operands the caller has checked: ``x_fp8 [..., M, K]``
    e4m3 and ``sf`` float32 ``[..., M, >= ceil(K/gran_k)]`` (one scale per ``gran_k`` channels); returns
    ``dtype`` ``[..., M, K]``, computed in float32. MegaMoE calls it where the native decode does not apply."""
    m, k = x_fp8.shape[-2], x_fp8.shape[-1]
    vals = e4m3_to_float(x_fp8)
    if k % gran_k == 0:  # scale groups in place, without a full-size scale tensor
        g = k // gran_k
        vals.view(*vals.shape[:-1], g, gran_k).mul_(sf[..., :g].unsqueeze(-1))
    else:
        vals.mul_(expand_scales(sf, m, k, 1, gran_k))
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
    check_tensor("x_fp8", x_fp8, (torch.float8_e4m3fn,))
    check_tensor("sf", sf, (torch.float32,))
    n, k = x_fp8.shape[-2], x_fp8.shape[-1]
    want = (*x_fp8.shape[:-2], ceil_div(n, gran_k), ceil_div(k, gran_k))
    if tuple(sf.shape) != want:
        raise ValueError(f"sf must have shape {want}, got {tuple(sf.shape)}")
    return e4m3_to_float(x_fp8).mul_(expand_scales(sf, n, k, gran_k, gran_k)).to(dtype)
