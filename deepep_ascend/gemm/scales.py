"""UE8M0 scale factors and the layouts DeepGEMM's GEMMs take them in, bit-exact with DeepGEMM and DeepEP.

Spec: ``docs/semantics/mega-moe.md`` §4 (formats, packings). Every function is vectorized torch on CPU; none loops over
elements.

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

Also DeepGEMM's size helpers (:func:`ceil_div`, :func:`align`, :func:`get_tma_aligned_size`) and what the
codecs share: a row's K groups (:func:`group_last_dim`), scales read as float32 from any packing
(:func:`scales_as_float`) or expanded to one per element (:func:`expand_scales`), and the MN-major copy
(:func:`mn_major`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..rounding import align, ceil_div
from .arguments import FLOAT_DTYPES, check_gran, check_tensor

__all__ = [
    "AMAX_FLOOR",
    "UE8M0_INT_DTYPES",
    "align",
    "ceil_div",
    "ceil_to_ue8m0",
    "expand_scales",
    "get_mn_major_tma_aligned_packed_ue8m0_tensor",
    "get_mn_major_tma_aligned_tensor",
    "get_tma_aligned_size",
    "group_last_dim",
    "mn_major",
    "pack_ue8m0_pairs_mn_major",
    "pack_ue8m0_to_int",
    "row_major",
    "scales_as_float",
    "transform_sf_into_required_layout",
    "ue8m0_byte_to_float",
    "ue8m0_bytes",
    "unpack_ue8m0_from_int",
]

#: Floor under a group's ``max|x|`` in every FP8 and FP4 cast (an all-zero group still gets a finite scale).
AMAX_FLOOR = 1e-4
_UE8M0_PAD_BYTE = 127  # upstream pads packed groups with 1.0
#: dtypes of packed UE8M0 scales: int32 (four bytes per word), int16 (pairs) and uint8 (one byte each).
UE8M0_INT_DTYPES = (torch.int32, torch.int16, torch.uint8)


def get_tma_aligned_size(mn: int, element_size: int) -> int:
    """MN extent padded to 16 bytes: ``align(mn, 16 // element_size)`` (DeepGEMM's TMA rule).

    Raises ``ValueError`` if ``element_size`` does not divide 16.
    """
    if element_size <= 0 or 16 % element_size != 0:
        raise ValueError(f"element_size must divide 16, got {element_size}")
    return align(mn, 16 // element_size)


def row_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` with row-major strides, viewable as another element size. ``Tensor.contiguous`` keeps any
    stride of a size-1 dimension (an MN-major ``[M, 1]`` stays ``(1, M)``) and of an empty tensor, and
    ``Tensor.view(dtype)`` then refuses it."""
    if t.is_contiguous() and (t.dim() == 0 or t.stride(-1) == 1):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def group_last_dim(x: torch.Tensor, gran: int, copy: bool = False) -> torch.Tensor:
    """float32 ``[..., K]`` zero-padded and viewed as ``[..., ceil(K/gran), gran]``; ``copy``:
    never ``x``'s own storage (for callers that scale the groups in place)."""
    k = x.size(-1)
    kp = align(k, gran)
    xf = x.to(torch.float32, copy=copy)
    if kp != k:
        xf = torch.nn.functional.pad(xf, (0, kp - k))
    return xf.reshape(*x.shape[:-1], kp // gran, gran)


def ceil_to_ue8m0(x: torch.Tensor) -> torch.Tensor:
    """Round ``|x|`` up to a power of two, from the float32 bits (docs/semantics/mega-moe.md §4,
    docs/semantics/deepep-api.md §6.4).

    ``e = exponent(|x|) + (1 if any mantissa bit else 0)``, clamped to [1, 254]; returns float32
    ``2**(e - 127)`` with ``x``'s shape. So ``0`` gives ``2**-126`` (the clamp) and values at or
    above ``2**127`` give ``2**127``. Raises ``TypeError`` for a non-floating tensor.
    """
    check_tensor("x", x, FLOAT_DTYPES)
    bits = x.abs().float().view(torch.int32)
    exp = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exp.clamp(1, 254) << 23).view(torch.float32)


def ue8m0_bytes(sf: torch.Tensor) -> torch.Tensor:
    """Exponent bytes (uint8, ``b = e + 127``) of float32 powers of two ``2**e``, same shape.

    Raises ``TypeError`` unless ``sf`` is float32 and ``ValueError`` if an element is not a
    positive normal power of two (mantissa bits set, zero, negative, subnormal, inf or NaN);
    round with :func:`ceil_to_ue8m0` first.
    """
    check_tensor("sf", sf, (torch.float32,))
    bits = sf.contiguous().view(torch.int32)
    exp = (bits >> 23) & 0xFF
    bad = ((bits & 0x7FFFFF) != 0) | (bits < 0) | (exp == 0) | (exp == 255)
    if bool(bad.any()):
        raise ValueError(
            f"sf must hold positive normal powers of two to be stored as UE8M0; got e.g. "
            f"{sf.reshape(-1)[bad.reshape(-1)][:4].tolist()} (use ceil_to_ue8m0)"
        )
    return exp.to(torch.uint8)


def ue8m0_byte_to_float(b: torch.Tensor) -> torch.Tensor:
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
    dtype = torch.int32 if per_word == 4 else torch.int16
    if not padded_g:  # K = 0: no scale at all (an empty row's strides refuse the dtype view)
        return torch.empty((*b.shape[:-1], 0), dtype=dtype)
    if padded_g != g:
        pad = torch.full(
            (*b.shape[:-1], padded_g - g), _UE8M0_PAD_BYTE, dtype=torch.uint8
        )
        b = torch.cat([b, pad], dim=-1)
    return row_major(b).view(dtype)


def pack_ue8m0_to_int(x: torch.Tensor) -> torch.Tensor:
    """Pack float32 power-of-two scales ``[..., G]`` into int32 ``[..., ceil(G/4)]`` (row-major).

    Four exponent bytes per int32, little-endian (byte ``j`` of word ``c`` is group ``4c + j``);
    when ``G % 4 != 0`` the missing bytes are 127 (DeepGEMM's helper requires ``G % 4 == 0``;
    docs/semantics/mega-moe.md §4 pads). Raises ``TypeError``/``ValueError`` as :func:`ue8m0_bytes` and for a
    0-dim input.
    """
    check_tensor("x", x, (torch.float32,))
    if x.dim() == 0:
        raise ValueError("x must have at least one dim (the group axis)")
    return _pack_bytes(ue8m0_bytes(x), 4)


def unpack_ue8m0_from_int(packed_sf: torch.Tensor) -> torch.Tensor:
    """Inverse of the packings: int32 ``[..., W]`` -> float32 ``[..., 4W]``, int16 ``[..., W]``
    -> float32 ``[..., 2W]``, uint8 bytes ``[..., W]`` -> ``[..., W]``. Any strides (MN-major is
    fine). Pad groups come back as 1.0; slice to the real group count. Byte 0 decodes to
    ``2**-127`` and byte 255 to NaN (docs/semantics/mega-moe.md §4). Raises ``TypeError`` for other dtypes.
    """
    check_tensor("packed_sf", packed_sf, UE8M0_INT_DTYPES)
    if packed_sf.dim() == 0:
        raise ValueError("packed_sf must have at least one dim")
    b = row_major(packed_sf).view(torch.uint8)
    return ue8m0_byte_to_float(b)


def scales_as_float(name: str, sf: torch.Tensor) -> torch.Tensor:
    """float32 scales from ``sf``: itself if float32, else the packed UE8M0 ``[..., W]`` decoded by
    :func:`unpack_ue8m0_from_int` (``[..., 4W]`` from int32, ``[..., 2W]`` from int16, ``[..., W]`` from
    uint8). Raises ``TypeError`` naming ``name`` for another dtype."""
    if sf.dtype in UE8M0_INT_DTYPES:
        return unpack_ue8m0_from_int(sf)
    if sf.dtype != torch.float32:
        raise TypeError(
            f"{name} must be float32 or packed UE8M0 (int32/int16/uint8), got {sf.dtype}"
        )
    return sf


def expand_scales(
    sf: torch.Tensor, mn: int, k: int, gran_mn: int, gran_k: int
) -> torch.Tensor:
    """One scale per element: float32 ``sf [..., >= ceil(mn/gran_mn), >= ceil(k/gran_k)]`` -> ``[..., mn, k]``,
    element ``(i, j)`` taking ``sf[..., i // gran_mn, j // gran_k]`` (a new tensor)."""
    i = torch.arange(mn) // gran_mn
    j = torch.arange(k) // gran_k
    return sf.index_select(-2, i).index_select(-1, j)


def mn_major(t: torch.Tensor, element_size: int) -> torch.Tensor:
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
    check_tensor("sf", sf, (torch.float32,), (2, 3))
    return sf if _is_mn_major(sf, 4) else mn_major(sf, 4)


def get_mn_major_tma_aligned_packed_ue8m0_tensor(sf: torch.Tensor) -> torch.Tensor:
    """float32 power-of-two scales ``[MN, G]`` / ``[B, MN, G]`` -> packed UE8M0 int32
    ``[..., MN, ceil(G/4)]``, MN-major TMA-aligned (``stride(-2) == 1``,
    ``stride(-1) == get_tma_aligned_size(MN, 4)``). Raises as :func:`pack_ue8m0_to_int`.
    """
    check_tensor("sf", sf, (torch.float32,), (2, 3))
    return mn_major(pack_ue8m0_to_int(sf), 4)


def pack_ue8m0_pairs_mn_major(sf: torch.Tensor) -> torch.Tensor:
    """Ascend's 16-bit packing: two UE8M0 bytes per int16, MN-major (docs/semantics/mega-moe.md §4).

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
    check_tensor(
        "sf", sf, (torch.int16, torch.float32, torch.uint8, torch.int32), (2, 3)
    )
    if sf.dtype == torch.int16:
        return sf if sf.stride(-2) == 1 or sf.shape[-2] <= 1 else mn_major(sf, 2)
    if sf.dtype == torch.float32:
        b = ue8m0_bytes(sf)
    elif sf.dtype == torch.int32:
        b = row_major(sf).view(torch.uint8)
    else:
        b = sf
    return mn_major(_pack_bytes(b, 2), 2)


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
    check_tensor("sf", sf, (torch.float32, torch.int32), (2, 3))
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
    check_gran("recipe gran_mn", gran_mn)
    check_gran("recipe gran_k", gran_k)
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
        return sf if _is_mn_major(sf, 4) else mn_major(sf, 4)
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
