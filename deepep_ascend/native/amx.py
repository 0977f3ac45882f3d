"""The grouped GEMMs' kernel on Intel AMX tiles (``csrc/amx_gemm.c``): weights packed once into the tile
layout (:class:`AmxWeight` for bf16, :class:`AmxFp4Weight` for MXFP4, decoded into bf16 tiles panel by
panel) and the product of a row block, or of the groups of an m-grouped GEMM, with them
(:func:`gemm_bf16_amx`).

It runs only where the CPU has AMX-BF16 and Linux grants the process its tile state (:func:`amx_bf16`);
elsewhere the grouped GEMMs use oneDNN.
"""
from __future__ import annotations

import ctypes
import operator

import torch

from .loader import kernels
from .operands import mark_written, overlap, require_matrix, write_refusal

__all__ = ["AMX_FP4_EXPONENTS", "AmxFp4Weight", "AmxWeight", "amx_bf16", "amx_fp4_packed_nbytes", "amx_packed_nbytes",
           "gemm_bf16_amx"]

_P = ctypes.c_void_p
_I64 = ctypes.c_int64

# The AMX kernel's CPU and OS checks (CPUID, XCR0, and Linux's per-process grant of the tile state) run once.
_AMX = bool(kernels.amx_bf16_available is not None and kernels.amx_bf16_available())


def amx_bf16() -> bool:
    """Whether :func:`gemm_bf16_amx` runs here: the kernels are loaded, were built with AMX support (x86-64
    Linux, gcc >= 11 or clang >= 12), the CPU has AMX-TILE and AMX-BF16, and Linux granted this process
    the tile state. Not in DeepGEMM (it decides how :mod:`deepep_ascend.gemm.packing` packs weights)."""
    return _AMX


def amx_packed_nbytes(n: int, k: int) -> int:
    """Bytes of :class:`AmxWeight`'s packed copy of an ``[n, k]`` weight (N and K padded to 32); needs the
    kernel (:func:`amx_bf16`)."""
    return int(kernels.amx_packed_elems(n, k)) * 2


class AmxWeight:
    """One bf16 weight ``w [N, K]`` (a GEMM's ``B`` in DeepGEMM's ``nt`` layout: ``d = a @ w.T``) packed
    once into AMX B tiles for :func:`gemm_bf16_amx`: per 32 columns and 32-deep K block, pairs of K values
    interleaved (AMX's VNNI order), N padded to 32 and K to 32 with zeros (``(N+31)//32*32 *
    (K+31)//32*32 * 2`` bytes). Shaped like the tensor it packs (``shape``, ``size``, ``dtype``), so the
    grouped GEMMs hold it where they hold oneDNN's packed copies. Attributes: ``data`` (flat bf16 tensor),
    ``n``, ``k``, ``nbytes``.

    Raises:
        ValueError: ``w`` not a 2-D CPU bfloat16 tensor; RuntimeError: the kernel is unavailable
        (:func:`amx_bf16` is False).
    """

    __slots__ = ("data", "n", "k")
    dtype = torch.bfloat16

    def __init__(self, w: torch.Tensor):
        if not _AMX:
            raise RuntimeError("deepep_ascend.native.AmxWeight: the AMX kernel is unavailable here (amx_bf16() is "
                               "False)")
        if not (isinstance(w, torch.Tensor) and w.dim() == 2 and w.dtype == torch.bfloat16
                and w.device.type == "cpu"):
            raise ValueError(f"deepep_ascend.native.AmxWeight: w must be a 2-D CPU bfloat16 [N, K] tensor, got "
                             f"{getattr(w, 'dtype', type(w).__name__)} of shape {tuple(getattr(w, 'shape', ()))}")
        if w.stride(1) != 1 and w.size(1) > 1:
            w = w.contiguous()
        self.n, self.k = w.shape
        self.data = torch.empty(amx_packed_nbytes(self.n, self.k) // 2, dtype=torch.bfloat16)
        if self.data.numel():
            kernels.amx_pack_bf16(self.data.data_ptr(), w.data_ptr(), w.stride(0), self.n, self.k)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.n, self.k))

    def size(self, dim: int | None = None) -> tuple | int:
        return self.shape if dim is None else self.shape[dim]

    @property
    def nbytes(self) -> int:
        """Bytes of the packed copy (what the weight caches count)."""
        return self.data.nbytes


#: The UE8M0 exponents :class:`AmxFp4Weight` takes: every nonzero e2m1 value (0.5 to 6) times 2**(e - 127)
#: is then a normal bf16 number, which the kernel's exponent addition needs.
AMX_FP4_EXPONENTS = (2, 252)


def amx_fp4_packed_nbytes(n: int, k: int) -> int:
    """Bytes of :class:`AmxFp4Weight`'s packed copy of an ``[n, k]`` FP4 weight (N and K padded to 32:
    half a byte per element plus one exponent byte per 32); needs the kernel (:func:`amx_bf16`)."""
    return int(kernels.amx_fp4_packed_bytes(n, k))


class AmxFp4Weight:
    """One MXFP4 weight (the ``nt`` ``B`` of DeepGEMM's ``m_grouped_fp8_fp4_gemm_nt_contiguous``: e2m1 codes
    with one UE8M0 scale per 32 K values) packed once for :func:`gemm_bf16_amx`, which decodes it into bf16
    AMX tiles one 32-column panel at a time: the same bf16 bits as the dequantized weight
    (``dequantize_weights``; code 8, "-0", gives +0), so results equal :class:`AmxWeight`'s on that copy bit
    for bit, while the weight streams at about a quarter of the bytes. Per 16 columns and 32-deep K block,
    256 bytes of nibbles (AMX's VNNI pair order) and 16 exponent bytes; N and K padded to 32 (code 0).
    Attributes as :class:`AmxWeight`'s: ``data`` (flat uint8 tensor), ``n``, ``k``, ``nbytes``, ``shape``.

    Args:
        data: ``[N, K/2]`` int8 or uint8, two e2m1 codes per byte (element ``2i`` in the low nibble, as
            ``pack_fp4``), unit column stride.
        exponents: ``[N, ceil(K/32)]`` uint8, the UE8M0 exponent byte of each 32 K values (scale
            ``2**(e - 127)``), every one in :data:`AMX_FP4_EXPONENTS`.
    Raises:
        ValueError: operands of another type, dtype, shape or layout, or an exponent out of range (the
            callers then use the dequantized bf16 weight); RuntimeError: the kernel is unavailable.
    """

    __slots__ = ("data", "n", "k")
    dtype = torch.bfloat16  # what the kernel multiplies (the decoded tiles)

    def __init__(self, data: torch.Tensor, exponents: torch.Tensor):
        op = "deepep_ascend.native.AmxFp4Weight"
        if not _AMX:
            raise RuntimeError(f"{op}: the AMX kernel is unavailable here (amx_bf16() is False)")
        if not (isinstance(data, torch.Tensor) and data.dim() == 2 and data.dtype in (torch.int8, torch.uint8)
                and data.device.type == "cpu"):
            raise ValueError(f"{op}: data must be a 2-D CPU int8/uint8 [N, K/2] tensor, got "
                             f"{getattr(data, 'dtype', type(data).__name__)} of shape "
                             f"{tuple(getattr(data, 'shape', ()))}")
        self.n, self.k = data.size(0), 2 * data.size(1)
        kb = (self.k + 31) // 32
        if not (isinstance(exponents, torch.Tensor) and exponents.dtype == torch.uint8
                and exponents.device.type == "cpu" and tuple(exponents.shape) == (self.n, kb)):
            raise ValueError(f"{op}: exponents must be a CPU uint8 [{self.n}, {kb}] tensor, got "
                             f"{getattr(exponents, 'dtype', type(exponents).__name__)} of shape "
                             f"{tuple(getattr(exponents, 'shape', ()))}")
        lo, hi = AMX_FP4_EXPONENTS
        if exponents.numel() and not (int(exponents.min()) >= lo and int(exponents.max()) <= hi):
            raise ValueError(f"{op}: every exponent must be in [{lo}, {hi}] (normal bf16 values), got "
                             f"[{int(exponents.min())}, {int(exponents.max())}]")
        if data.stride(1) != 1 and data.size(1) > 1:
            data = data.contiguous()
        if exponents.stride(1) != 1 and exponents.size(1) > 1:
            exponents = exponents.contiguous()
        self.data = torch.empty(amx_fp4_packed_nbytes(self.n, self.k), dtype=torch.uint8)
        if self.data.numel():
            kernels.amx_pack_fp4(self.data.data_ptr(), data.data_ptr(), data.stride(0), exponents.data_ptr(),
                                 exponents.stride(0), self.n, self.k)

    shape = AmxWeight.shape
    size = AmxWeight.size
    nbytes = AmxWeight.nbytes


def gemm_bf16_amx(out: torch.Tensor, a: torch.Tensor, w, runs=None) -> bool:
    """``out = bf16(a @ W.T)`` for weights ``W [N, K]`` packed as :class:`AmxWeight` (or :class:`AmxFp4Weight`,
    decoded to the same bf16 values panel by panel): float32 accumulation on
    AMX tiles (TDPBF16PS: denormal inputs and outputs flushed to zero, as in oneDNN's AMX kernels), one
    round-to-nearest-even rounding per output. With ``runs``, the groups of DeepGEMM's
    ``m_grouped_bf16_gemm_nt_contiguous`` in one call: ``out[s:e] = bf16(a[s:e] @ w[g].T)`` for each
    ``(g, s, e)``, other rows untouched, each group's weight fetched while the previous group computes.
    The sum runs in another order than oneDNN's, so results agree with ``torch.matmul`` to bf16 rounding,
    not always bit for bit.

    Args:
        out: ``[M, N]`` bfloat16, unit column stride, rows not overlapping each other nor ``a``.
        a: ``[M, K]`` bfloat16, unit column stride.
        w: an :class:`AmxWeight` (``runs`` None: every row), or with ``runs`` a sequence of them, all
            ``[N, K]``; or :class:`AmxFp4Weight` likewise (all of one kind).
        runs: None, or a sequence of ``(g, s, e)`` ints, ``0 <= g < len(w)``, ``0 <= s <= e <= M``, in any
            order, no two sharing a row.
    Returns:
        True when done; False (nothing written) if the kernel is unavailable.
    Raises:
        ValueError: operands of another type, dtype, shape or layout, runs out of range or overlapping,
            ``out`` overlapping ``a``, or ``out`` a tensor torch would not write in place here (it requires
            grad with grad mode on, or is an inference tensor outside inference mode). The write bumps
            ``out``'s version counter, as an in-place op does.
        MemoryError: the kernel could not allocate its scratch for ``a``'s packed rows (nothing written).
    """
    if not _AMX:
        return False
    op = "gemm_bf16_amx"
    if runs is None:
        ws = [w]
    else:
        try:
            ws = list(w)
        except TypeError:
            ws = []
    kind = type(ws[0]) if ws else None
    if kind not in (AmxWeight, AmxFp4Weight) or not all(type(x) is kind for x in ws):
        raise ValueError(f"deepep_ascend.native.{op}: w must be an AmxWeight or an AmxFp4Weight (or with runs a "
                         f"non-empty sequence of them, all of one kind), got {type(w).__name__}")
    n, k = ws[0].n, ws[0].k
    if any((x.n, x.k) != (n, k) for x in ws):
        raise ValueError(f"deepep_ascend.native.{op}: every weight must be [{n}, {k}], got "
                         f"{sorted({(x.n, x.k) for x in ws})}")
    require_matrix("a", a, torch.bfloat16, k, op)
    require_matrix("out", out, torch.bfloat16, n, op)
    why = write_refusal("out", out)
    if why:
        raise ValueError(f"deepep_ascend.native.{op}: {why}")
    m = a.size(0)
    if out.size(0) != m:
        raise ValueError(f"deepep_ascend.native.{op}: out has {out.size(0)} rows, a {m}")
    if overlap(out, a):
        raise ValueError(f"deepep_ascend.native.{op}: out overlaps a")
    runs = [(0, 0, m)] if runs is None else _runs(runs, len(ws), m, op)
    if not runs or not n:
        return True
    if not k:
        for _, s, e in runs:
            out[s:e].zero_()
        return True
    count = len(runs)
    starts = (_I64 * count)(*(r[1] for r in runs))
    ends = (_I64 * count)(*(r[2] for r in runs))
    bps = (_P * count)(*(ws[r[0]].data.data_ptr() for r in runs))
    if kernels.amx_gemm_bf16(out.data_ptr(), out.stride(0) if m > 1 else n, a.data_ptr(), a.stride(0) if m > 1 else k,
                             n, k, count, starts, ends, bps, int(kind is AmxFp4Weight)):
        raise MemoryError(f"deepep_ascend.native.{op}: no memory for the packed rows of a (up to "
                          f"{max(e - s for _, s, e in runs)} x {k})")
    mark_written(out)
    return True


def _is_bool(v) -> bool:
    """A Python, numpy or torch boolean (``operator.index`` takes the latter two as 0 and 1)."""
    return isinstance(v, bool) or str(getattr(v, "dtype", "")) in ("bool", "torch.bool")


def _runs(runs, groups: int, m: int, op: str) -> list:
    """``runs`` as a list of ``(g, s, e)`` Python ints, checked, without empty ones, sorted by ``s``."""
    def bad(what):
        return ValueError(f"deepep_ascend.native.{op}: runs must be a sequence of (g, s, e) ints with 0 <= g < "
                          f"{groups} and 0 <= s <= e <= {m}, rows not shared by two runs; {what}")
    try:
        items = [tuple(r) for r in runs]
    except TypeError:
        raise bad(f"got {type(runs).__name__}") from None
    out = []
    for r in items:
        try:
            if len(r) != 3 or any(_is_bool(v) for v in r):
                raise TypeError
            g, s, e = (operator.index(v) for v in r)
        except TypeError:
            raise bad(f"got {r!r}") from None
        if not (0 <= g < groups and 0 <= s <= e <= m):
            raise bad(f"got {r!r}")
        if e > s:
            out.append((g, s, e))
    out.sort(key=lambda r: r[1])
    for prev, cur in zip(out, out[1:]):
        if cur[1] < prev[2]:
            raise bad(f"{prev!r} and {cur!r} overlap")
    return out
