"""Weights packed once for the bf16 GEMM kernels, and the products on them.

Where the CPU multiplies bf16 natively the m-grouped bf16 products run on weights packed once per group:
with Intel AMX (and the native kernels built) on :func:`deepep_ascend.native.gemm_bf16_amx`, which writes
each group's rows straight into ``d`` (:func:`amx_runs`); otherwise (AVX512-BF16, or
``DEEPEP_ASCEND_NATIVE=0``) on oneDNN's inner product with the weight in oneDNN's blocked layout
(``torch.ops.mkldnn._reorder_linear_weight`` / ``_linear_pointwise``, what torch's inductor uses for frozen
linear weights). :data:`PACKER` says which. MXFP4 weights whose scales the AMX kernel can decode are
packed as such (:func:`packed_fp4_weights`), at a quarter of the packed bf16 bytes.

Each group is packed on first use (:class:`LazyPacked`) and cached like the dequantized weights
(:mod:`.weight_cache`): by the identity (a view: its base and geometry) and version counter of ``b`` (or
of the FP8/FP4 data and scales it was dequantized from), so an in-place write to ``b`` is seen by the next
call; writes that bypass the version counter (``.data``, numpy) are not, clear the cache after them.
:func:`deepep_ascend.set_dequantized_weight_cache` switches every weight cache. Weights that require
grad, inference tensors, disabled caches and calls autograd records multiply with ``torch.matmul``
(:func:`mm_group`). A plain bf16 matmul reorders its weight on every call, which for ~128 rows per group
cost about as much as the multiply. Same float32 accumulation; the summation order inside either kernel
may differ from ``torch.matmul``'s, so results agree to bf16 rounding, not always bit for bit. The packed
kernels flush denormal bf16 inputs and products to zero, as the hardware's bf16 dot products do;
``torch.matmul`` keeps them.

Not in DeepGEMM (whose GPU kernels need no packing); the grouped GEMMs (:mod:`.grouped`) and MegaMoE use it.
"""

from __future__ import annotations

import torch

from .. import native as _native
from ..native.operands import matrix_ok, overlap, write_refusal
from .scales import ceil_div, scales_as_float
from .weight_cache import cacheable, cached_by_tensors, optional_copy_fits

__all__ = [
    "LazyPacked",
    "ONEDNN",
    "PACKER",
    "amx_runs",
    "matmul_bf16_out",
    "mm_group",
    "native_bf16",
    "pack_fp4_groups",
    "pack_groups",
    "packed_fp4_weights",
    "packed_nbytes",
    "packed_weights",
]

BF16 = torch.bfloat16


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AMX tiles or AVX512-BF16), per torch's probes (not in
    DeepGEMM: it decides whether bf16 weights are packed for oneDNN and
    :func:`deepep_ascend.mega_moe.experts.gemm_engine`)."""
    cpu = getattr(torch, "cpu", None)
    for probe in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"):
        fn = getattr(cpu, probe, None)
        try:
            if fn is not None and fn():
                return True
        except Exception:  # noqa: BLE001 - a probe that fails means no native bf16
            pass
    return False


# oneDNN's prepacked inner product (the ops torch's inductor uses for frozen linear weights). A bf16 matmul
# reorders its weight into oneDNN's blocked layout on every call; a grouped GEMM with ~100 rows per group
# spends about as long on that as on the multiply, so the weights are packed once and cached.
_REORDER = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
_LINEAR = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
#: Whether oneDNN's packed inner product runs here (its ops exist, oneDNN is built in, native bf16).
ONEDNN = bool(_REORDER is not None and _LINEAR is not None and torch.backends.mkldnn.is_available()
              and native_bf16())
#: How weights are packed: ``"amx"`` for the AMX kernel where it runs (faster than oneDNN at ~128 rows per
#: group, and never slower in bench.grouped_gemm's sweep), else ``"onednn"`` for oneDNN, else None (not at all).
PACKER = "amx" if _native.amx_bf16() else ("onednn" if ONEDNN else None)
_PACKING = PACKER is not None
_AMX_WEIGHTS = (_native.AmxWeight, _native.AmxFp4Weight)  # what the AMX kernel multiplies


def _pack_one(w_nk: torch.Tensor, packer: str):
    return _native.AmxWeight(w_nk) if packer == "amx" else _REORDER(w_nk, None)


def pack_groups(b_nk: torch.Tensor, packer: str | None = None):
    """Per-group packed copies of bf16 weights ``b_nk [G, N, K]`` (any strides; each reports the shape
    ``[N, K]``): :class:`~deepep_ascend.native.AmxWeight` or oneDNN's (``packer`` ``"amx"`` or
    ``"onednn"``; default: what this machine runs), or ``None`` where packing is unavailable (no native
    bf16, no oneDNN) or ``b_nk`` is not bf16."""
    packer = packer or PACKER
    if packer is None or b_nk.dtype != BF16:
        return None
    return tuple(_pack_one(b_nk[g], packer) for g in range(b_nk.size(0)))


def packed_nbytes(b_nk: torch.Tensor) -> int:
    """Bytes of the packed copies of all groups of bf16 ``b_nk [G, N, K]`` for this machine's packer (oneDNN's
    blocked layout counted as ``N x K``)."""
    g, n, k = b_nk.shape
    if PACKER == "amx":
        return g * _native.amx_packed_nbytes(n, k)
    return g * n * k * b_nk.element_size()


class LazyPacked:
    """Per-group packed copies of ``count`` weight groups, group ``g`` packed by ``pack(g)`` on first use (a
    masked call with few active groups, or a first call, packs only what it multiplies: what a matmul would
    reorder anyway); ``nbytes``: their bytes once all are packed (what the weight caches count from the
    start). Packing the same group twice from two threads is harmless."""

    def __init__(self, count: int, pack, nbytes: int):
        self._pack, self.nbytes = pack, nbytes
        self.groups = [None] * count

    def __getitem__(self, g: int):
        p = self.groups[g]
        if p is None:
            # outside inference mode: a group packed during a call under it must serve later calls too
            with torch.inference_mode(False), torch.no_grad():
                p = self.groups[g] = self._pack(g)
        return p


def packed_weights(b_nk: torch.Tensor, keys: tuple, tag):
    """:class:`LazyPacked` groups of ``b_nk``, cached by the identity and version of the caller's tensors
    ``keys`` that ``b_nk`` derives from (bf16 weights: themselves; FP8/FP4 weights: their data and scales, not
    the dequantized copy, which is a cached value that may be evicted or, for inference tensors, not cached
    at all); ``None`` (multiply with ``torch.matmul``) where packing is unavailable, ``b_nk`` is not bf16 or
    empty, the cache cannot hold it (caches disabled, an inference tensor, a packed copy that does not fit the caches'
    budget beside what is cached, since a packed copy pushes nothing out: packing on every call would cost
    more than the matmul's own reorder) or a key requires grad (weights being trained change every step,
    possibly through ``.data``, which no version counter sees). ``tag`` names what else the copy depends on:
    ``b``'s layout and, for FP8/FP4 weights, the scale granularity they were dequantized at."""
    if (not _PACKING or b_nk.dtype != BF16 or b_nk.numel() == 0 or any(k.requires_grad for k in keys)
            or not cacheable(keys)):  # N or K of 0: nothing to pack (oneDNN refuses it)
        return None

    def build():
        nbytes, w = packed_nbytes(b_nk), b_nk.detach()
        if not optional_copy_fits(nbytes):
            return None
        return LazyPacked(w.size(0), lambda g: _pack_one(w[g], PACKER), nbytes)

    return cached_by_tensors(("packed_weights", tag), keys, build, optional=True)


def _fp4_packable(data: torch.Tensor) -> bool:
    """Whether ``data`` can be MXFP4 weights ``[G, N, K/2]`` for :class:`~deepep_ascend.native.AmxFp4Weight`,
    the grouped GEMMs packing for the AMX kernel here."""
    return PACKER == "amx" and data.dtype in (torch.int8, torch.uint8) and data.dim() == 3


def _fp4_exponents(sf: torch.Tensor, gran_k: int, n: int, k: int) -> torch.Tensor | None:
    """The UE8M0 exponent byte of each 32 K values, uint8 ``[..., N, ceil(K/32)]``, of FP4 weight scales ``sf``
    (one per row and ``gran_k`` K values, float32 or packed UE8M0), when every scale is a power of two that
    :class:`~deepep_ascend.native.AmxFp4Weight` takes (:data:`~deepep_ascend.native.AMX_FP4_EXPONENTS`);
    else None (the weights are then dequantized to bf16)."""
    groups = ceil_div(k, gran_k)
    if gran_k % 32 or sf.size(-2) != n:
        return None
    s = scales_as_float("sf", sf)
    if s.size(-1) < groups:
        return None
    bits = s[..., :groups].contiguous().view(torch.int32)
    e = (bits >> 23) & 0xFF
    lo, hi = _native.AMX_FP4_EXPONENTS
    not_powers_of_two = bool(((bits <= 0) | ((bits & 0x7FFFFF) != 0)).any())
    if not_powers_of_two or (e.numel() and not lo <= int(e.min()) <= int(e.max()) <= hi):
        return None
    return e.to(torch.uint8).repeat_interleave(gran_k // 32, -1)[..., :ceil_div(k, 32)].contiguous()


def pack_fp4_groups(data: torch.Tensor, sf: torch.Tensor, gran_k: int):
    """Per-group :class:`~deepep_ascend.native.AmxFp4Weight` copies of MXFP4 weights ``data [G, N, K/2]`` with
    scales ``sf`` (per row and ``gran_k`` K values), packed now (MegaMoE's weights are all used every call);
    None where the AMX kernel is unavailable or the scales do not qualify (:func:`_fp4_exponents`). No budget
    check: the alternative, dequantized bf16 weights, takes about four times the bytes, so a copy that does
    not fit the caches serves its call only, as that bf16 copy would."""
    if not _fp4_packable(data):
        return None
    g, n, half = data.shape
    exps = _fp4_exponents(sf, gran_k, n, 2 * half)
    if exps is None:
        return None
    return tuple(_native.AmxFp4Weight(data[i], exps[i]) for i in range(g))


# cached (0 bytes) in place of an FP4 copy for scales the decoder cannot take: later calls go the bf16 way
# without scanning the scales again
_NOT_FP4 = object()


def packed_fp4_weights(data: torch.Tensor, sf: torch.Tensor, gran: tuple, n: int, k: int):
    """:class:`LazyPacked` copies of MXFP4 weights ``(data [G, N, K/2], sf)`` (scales per row and
    ``gran[1]`` K values), cached by identity and version of ``data`` and ``sf`` as an optional entry (as
    :func:`packed_weights`; :class:`~deepep_ascend.native.AmxFp4Weight` groups, each packed on first use);
    None where the AMX kernel is unavailable, the scales do not qualify
    (:func:`_fp4_exponents`; remembered), the operands require grad or the caches are off. The multiply then
    uses the dequantized bf16 weights. Preferred to them: a quarter of the packed bf16 copy's bytes and no
    dequantized copy, at about the same speed (``python -m bench grouped-gemm``, row "per group, AMX, FP4
    weights"). A copy that does not fit the budget beside what is cached serves this call only (each group
    packed as it is used, in one pass over its bytes; the budget's warning says so): far cheaper than
    dequantizing the weights again, which is what the bf16 way would do each call."""
    if not _fp4_packable(data) or gran[0] != 1 or data.requires_grad or not cacheable((data, sf)):
        return None

    def build():
        exps, w = _fp4_exponents(sf, gran[1], n, k), data.detach()
        if exps is None:
            return _NOT_FP4
        return LazyPacked(w.size(0), lambda g: _native.AmxFp4Weight(w[g], exps[g]),
                          w.size(0) * _native.amx_fp4_packed_nbytes(n, k))

    p = cached_by_tensors(("packed_fp4_weights", gran), (data, sf), build, optional=True)
    return None if p is _NOT_FP4 else p


def matmul_bf16_out(x: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
    """bf16 ``x @ w_t`` with float32 accumulation; float32 operands go through a float32 matmul."""
    if x.dtype == BF16 and w_t.dtype == BF16:
        return torch.matmul(x, w_t)
    return torch.matmul(x.float(), w_t.float()).to(BF16)


def mm_group(x: torch.Tensor, w_t: torch.Tensor | None, packed, g: int) -> torch.Tensor:
    """bf16 ``x @ w_t`` (``w_t = B[g]`` as ``[K, N]``) with float32 accumulation, on the packed copy
    ``packed[g]`` when there is one, ``x`` is bf16 and autograd does not record the call (the packed
    kernels have no backward; packed weights never require grad). ``w_t`` may be None when ``packed`` is
    given and those hold. (Whole grouped calls take the AMX kernel in one go: :func:`amx_runs`.)"""
    if packed is not None and x.dtype == BF16 and not (x.requires_grad and torch.is_grad_enabled()):
        p = packed[g]
        if not isinstance(p, _AMX_WEIGHTS):
            return _LINEAR(x, p, None, "none", [], "")
        x = x if matrix_ok(x) else x.contiguous()
        out = torch.empty(x.size(0), p.n, dtype=BF16)
        _native.gemm_bf16_amx(out, x, p)
        return out
    return matmul_bf16_out(x, w_t)


def amx_runs(packed, d: torch.Tensor, rows, runs: list) -> bool:
    """``d[s:e] = bf16(a[s:e] @ B[g].T)`` for every run ``(g, s, e)`` in one call of the AMX kernel
    (:func:`deepep_ascend.native.gemm_bf16_amx`), ``a = rows()`` (bf16 ``[M, K]``, made only once the rest
    qualifies). True when done (``d``'s version counter bumped, as by an in-place op); False (nothing
    written) where the kernel does not apply: ``packed`` not AMX weights, ``d`` not a bf16 matrix it can
    write (unit column stride, rows apart) or one torch would not write in place (it requires grad, or is
    an inference tensor outside inference mode: the caller's torch write raises as torch does), ``a`` not
    bf16, or autograd recording the call; the caller then multiplies group by group."""
    if (packed is None or not runs or not isinstance(packed[runs[0][0]], _AMX_WEIGHTS)
            or not matrix_ok(d, BF16) or write_refusal("d", d)):
        return False
    a = rows()
    if (a is None or a.dtype != BF16 or (a.requires_grad and torch.is_grad_enabled()) or not matrix_ok(a)
            or overlap(d, a)):
        return False
    index = {}  # each group's weight once, in the order of the runs
    for g, _, _ in runs:
        index.setdefault(g, len(index))
    return _native.gemm_bf16_amx(d, a, [packed[g] for g in index], [(index[g], s, e) for g, s, e in runs])
