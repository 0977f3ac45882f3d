"""DeepGEMM-aligned grouped GEMMs on CPU torch (mega-moe.md §3).

Naming (DeepGEMM): the first letter is A's storage (``n`` = ``[M, K]``, ``t`` = ``[K, M]``), the
second B's (``t`` = ``[N, K]``, ``n`` = ``[K, N]``); every variant computes
``D[M, N] (+)= op(A) @ op(B)``, so ``_nt`` is ``A @ B.T``. Results are written into ``d`` in
place (any strides); the functions return ``None`` like DeepGEMM.

Math. BF16: ``d = bf16(A @ B.T)`` with float32 accumulation. The packed paths below (the library's AMX
kernel, oneDNN's packed inner product on AMX or AVX512-BF16) flush denormal bf16 inputs and products to
zero, as the hardware's bf16 dot products do; ``torch.matmul``, which multiplies weights that are not
packed (caches off or full, weights that require grad), keeps them, so products of denormal operands
depend on the path (found on an AVX512-BF16 CPU: 2^-126 from the matmul, 0 from the packed weights). FP8/FP4:
each operand is a ``(data, sf)`` pair and is dequantized first, ``deq[mn, k] = value(data[mn,
k]) * sf[mn // gran_mn, k // gran_k]`` in float32 (FP4 values from the e2m1 table), then
``d = bf16(deq(A) @ deq(B).T)``. When both dequantized operands are exactly representable in
bf16 (power-of-two UE8M0 scales) the product runs as a bf16 matmul with float32 accumulation,
which is exact emulation of block-scaled MMA; otherwise (legacy float32 scales) in float32.
Weights (B) are dequantized once and cached by tensor identity and version
(:func:`deepep_ascend.gemm.quant.dequantize_weights`). K-grouped results accumulate in float32.

Prepacked weights. Where the CPU multiplies bf16 natively the m-grouped bf16 products run on
weights packed once per group: with Intel AMX (and the native kernels built) on
:func:`deepep_ascend.native.gemm_bf16_amx`, which writes each group's rows straight into ``d``;
otherwise (AVX512-BF16, or ``DEEPEP_ASCEND_NATIVE=0``) on oneDNN's inner product with the weight in
oneDNN's blocked layout (``torch.ops.mkldnn._reorder_linear_weight`` / ``_linear_pointwise``, what
torch's inductor uses for frozen linear weights). Each group is packed on first use and cached like
the dequantized weights: by the identity (a view: its base and geometry) and version counter of ``b``
(or of its cached dequantized copy), so an in-place write to ``b`` is seen by the next call; writes
that bypass the version counter (``.data``, numpy) are not, clear the cache after them.
:func:`deepep_ascend.set_dequantized_weight_cache` switches every weight cache. Weights that require
grad, inference tensors, disabled caches and calls autograd records multiply with ``torch.matmul``.
A plain bf16 matmul reorders its weight on every call, which for ~128 rows per group cost about as
much as the multiply. Same float32 accumulation; the summation order inside either kernel may differ
from ``torch.matmul``'s, so results agree to bf16 rounding, not always bit for bit.

Scale factors (``recipe``): ``(gran_m_a, gran_n_b, gran_k)`` or per operand ``recipe_a`` /
``recipe_b`` = ``(gran_mn, gran_k)``. Without a recipe it is inferred per operand: float32 A
scales are per token at 128 (``(1, 128)``); float32 B scales ``[G, ceil(N/128), ceil(K/128)]``
are 128×128 blocks, ``[G, N, ceil(K/128)]`` per row; packed UE8M0 (int32) scales are per row
at ``gran_k`` 128 for FP8 data and 32 for FP4 data, unless only the other granularity matches
the scale width. Scales are logical ``[..., MN, K-groups]`` whatever the data storage (``nn``
B scales are ``[G, N, ...]``).

Layouts:

* **m-grouped contiguous**: ``a [M, K]``, ``b [G, N, K]`` (``nt``) or ``[G, K, N]`` (``nn``),
  ``d`` bf16 ``[M, N]``. ``grouped_layout`` int32 ``[M]``: ``g`` marks a row of group ``g``,
  ``-1`` a padding row (written as zeros); each group is one contiguous run starting at a
  multiple of :func:`get_mk_alignment_for_contiguous_layout` (``ValueError`` otherwise). With
  ``use_psum_layout``: int32 ``[G]`` non-decreasing exclusive ends; group ``g`` covers
  ``[align(end[g-1]), end[g])``; other rows are untouched except ``[end[g], align(end[g]))``,
  zeroed when ``ensure_zero_padding``.
* **m-grouped masked** (DeepEP low-latency layout): ``a [G, Mmax, K]``, ``b [G, N, K]``,
  ``d [G, Mmax, N]``, ``masked_m`` int32 ``[G]``: ``d[g, :masked_m[g]] = a[g, :masked_m[g]] @
  b[g].T``; rows past ``masked_m[g]`` are untouched; ``expected_m`` is a hint.
* **k-grouped** (weight gradients): ``tn``: ``a [ΣK, M]``, ``b [ΣK, N]``; ``nt``: ``a [M, ΣK]``,
  ``b [N, ΣK]``; ``d``/``c`` float32 ``[G, M, N]``: ``d[g] = c[g] + A_g^T B_g`` over group
  ``g``'s K segment (``c=None`` means zeros; ``c`` may alias ``d``).

``compiled_dims``, ``disable_ue8m0_cast``, ``expected_m`` and ``expected_m_for_psum_layout`` are
accepted for API parity and do not change results. Bad shapes, dtypes or layouts raise
``ValueError``/``TypeError`` naming the argument.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import native as _native
from ..native.operands import matrix_ok, overlap, write_refusal
from . import quant as _q
from .quant import (
    _dequantize_operand,
    _to_exact_bf16,
    align,
    ceil_div,
    dequantize_weights,
)

__all__ = [
    "bf16_gemm_nn",
    "bf16_gemm_nt",
    "bf16_gemm_tn",
    "bf16_gemm_tt",
    "bf16_m_grouped_gemm_nt_masked",
    "fp8_fp4_gemm_nn",
    "fp8_fp4_gemm_nt",
    "fp8_fp4_gemm_tn",
    "fp8_fp4_gemm_tt",
    "fp8_gemm_nn",
    "fp8_gemm_nt",
    "fp8_gemm_tn",
    "fp8_gemm_tt",
    "fp8_m_grouped_gemm_nt_masked",
    "get_k_alignment_for_contiguous_layout",
    "get_m_alignment_for_contiguous_layout",
    "get_mk_alignment_for_contiguous_layout",
    "get_theoretical_mk_alignment_for_contiguous_layout",
    "k_grouped_bf16_gemm_tn_contiguous",
    "k_grouped_fp8_gemm_nt_contiguous",
    "k_grouped_fp8_gemm_tn_contiguous",
    "m_grouped_bf16_gemm_nn_contiguous",
    "m_grouped_bf16_gemm_nt_contiguous",
    "m_grouped_bf16_gemm_nt_masked",
    "m_grouped_fp8_fp4_gemm_nn_contiguous",
    "m_grouped_fp8_fp4_gemm_nt_contiguous",
    "m_grouped_fp8_fp4_gemm_nt_masked",
    "m_grouped_fp8_gemm_nn_contiguous",
    "m_grouped_fp8_gemm_nt_contiguous",
    "m_grouped_fp8_gemm_nt_masked",
    "set_mk_alignment_for_contiguous_layout",
]

BF16 = torch.bfloat16
FP32 = torch.float32
_FP8 = torch.float8_e4m3fn

# ----------------------------------------------------------------------------------------------
# alignment

_mk_alignment = 128


def get_mk_alignment_for_contiguous_layout() -> int:
    """Rows (m-grouped) or K (k-grouped) per group are aligned to this; default 128."""
    return _mk_alignment


def set_mk_alignment_for_contiguous_layout(new_value: int) -> None:
    """Set the contiguous-layout alignment (a positive int; ``ValueError`` otherwise)."""
    global _mk_alignment
    if not isinstance(new_value, int) or isinstance(new_value, bool) or new_value <= 0:
        raise ValueError(f"new_value must be a positive int, got {new_value!r}")
    _mk_alignment = new_value


def get_theoretical_mk_alignment_for_contiguous_layout(
    expected_m: int | None = None,
) -> int:
    """The alignment the kernels would pick for ``expected_m``; on CPU the current value."""
    return _mk_alignment


get_m_alignment_for_contiguous_layout = get_mk_alignment_for_contiguous_layout
get_k_alignment_for_contiguous_layout = get_mk_alignment_for_contiguous_layout


# ----------------------------------------------------------------------------------------------
# argument checks


def _tensor(name, t, dtypes=None, dim=None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    _q._check_storage(name, t)
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(
            f"{name} must have dtype {' or '.join(map(str, dtypes))}, got {t.dtype}"
        )
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")
    return t


def _pair(name, p) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(p, (tuple, list)) or len(p) != 2:
        raise TypeError(f"{name} must be a (data, sf) pair, got {type(p).__name__}")
    data, sf = p
    _tensor(f"{name}[0] (data)", data, (_FP8, torch.int8, torch.uint8))
    _tensor(f"{name}[1] (sf)", sf, (FP32, torch.int32))
    return data, sf


def _int_list(name, t, length=None) -> list[int]:
    _tensor(name, t, (torch.int32, torch.int64), 1)
    if length is not None and t.numel() != length:
        raise ValueError(f"{name} must have {length} entries, got {t.numel()}")
    return [int(v) for v in t.tolist()]


def _k_of(data: torch.Tensor, k_dim: int = -1) -> int:
    """Logical K of an operand stored K-major: FP4 packs two values per byte."""
    return data.size(k_dim) * (2 if data.dtype in (torch.int8, torch.uint8) else 1)


def _resolve_grans(a, b, recipe, recipe_a, recipe_b, k, n, num_b_dims):
    """((gran_m_a, gran_k_a), (gran_n_b, gran_k_b)) from the recipe or the scales."""
    (a_data, a_sf), (b_data, b_sf) = a, b

    def infer(data, sf, mn_extent, is_b):
        fp4 = data.dtype != _FP8
        if sf.dtype == FP32:
            if is_b and sf.dim() == num_b_dims and sf.size(-2) != mn_extent:
                return (128, 128)
            return (1, 128)
        words = sf.size(-1)
        pref, other = (32, 128) if fp4 else (128, 32)
        for g in (pref, other):
            if ceil_div(ceil_div(k, g), 4) == words:
                return (1, g)
        return (1, pref)

    if recipe_a is not None or recipe_b is not None:
        ga = (
            tuple(recipe_a)
            if recipe_a is not None
            else infer(a_data, a_sf, None, False)
        )
        gb = tuple(recipe_b) if recipe_b is not None else infer(b_data, b_sf, n, True)
    elif recipe is not None:
        recipe = tuple(recipe)
        if len(recipe) != 3:
            raise ValueError(
                f"recipe must be (gran_m_a, gran_n_b, gran_k), got {recipe}"
            )
        ga, gb = (recipe[0], recipe[2]), (recipe[1], recipe[2])
    else:
        ga, gb = infer(a_data, a_sf, None, False), infer(b_data, b_sf, n, True)
    for name, g in (("recipe_a", ga), ("recipe_b", gb)):
        if len(g) != 2 or any(not isinstance(v, int) or v <= 0 for v in g):
            raise ValueError(f"{name} must be (gran_mn, gran_k) positive ints, got {g}")
    return ga, gb


def _matmul_bf16_out(x: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
    """bf16 ``x @ w_t`` with float32 accumulation; float32 operands go through a float32 matmul."""
    if x.dtype == BF16 and w_t.dtype == BF16:
        return torch.matmul(x, w_t)
    return torch.matmul(x.float(), w_t.float()).to(BF16)


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AMX tiles or AVX512-BF16), per torch's probes (not in
    DeepGEMM: it decides whether bf16 weights are packed for oneDNN and :func:`deepep_ascend.mega_moe.gemm_engine`)."""
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
_ONEDNN = bool(_REORDER is not None and _LINEAR is not None and torch.backends.mkldnn.is_available()
               and native_bf16())
# How weights are packed: for the AMX kernel where it runs (faster than oneDNN at ~128 rows per group, and
# never slower in bench.grouped_gemm's sweep), else for oneDNN, else not at all.
_PACKER = "amx" if _native.amx_bf16() else ("onednn" if _ONEDNN else None)
_PACKING = _PACKER is not None
_AMX_WEIGHTS = (_native.AmxWeight, _native.AmxFp4Weight)  # what the AMX kernel multiplies


def _pack_one(w_nk: torch.Tensor, packer: str):
    return _native.AmxWeight(w_nk) if packer == "amx" else _REORDER(w_nk, None)


def _pack_groups(b_nk: torch.Tensor, packer: str | None = None):
    """Per-group packed copies of bf16 weights ``b_nk [G, N, K]`` (any strides; each reports the shape
    ``[N, K]``): :class:`~deepep_ascend.native.AmxWeight` or oneDNN's (``packer`` ``"amx"`` or
    ``"onednn"``; default: what this machine runs), or ``None`` where packing is unavailable (no native
    bf16, no oneDNN) or ``b_nk`` is not bf16."""
    packer = packer or _PACKER
    if packer is None or b_nk.dtype != BF16:
        return None
    return tuple(_pack_one(b_nk[g], packer) for g in range(b_nk.size(0)))


def _packed_nbytes(b_nk: torch.Tensor) -> int:
    """Bytes of the packed copies of all groups of bf16 ``b_nk [G, N, K]`` for this machine's packer (oneDNN's
    blocked layout counted as ``N x K``)."""
    g, n, k = b_nk.shape
    if _PACKER == "amx":
        return g * _native.amx_packed_nbytes(n, k)
    return g * n * k * b_nk.element_size()


class _LazyPacked:
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


def _packed_weights(b_nk: torch.Tensor, keys: tuple, tag):
    """:class:`_LazyPacked` groups of ``b_nk``, cached by the identity and version of the caller's tensors
    ``keys`` that ``b_nk`` derives from (bf16 weights: themselves; FP8/FP4 weights: their data and scales, not
    the dequantized copy, which is a cached value that may be evicted or, for inference tensors, not cached
    at all); ``None`` (multiply with ``torch.matmul``) where packing is unavailable, ``b_nk`` is not bf16 or empty, the
    cache cannot hold it (caches disabled, an inference tensor, a packed copy that does not fit the caches'
    budget beside what is cached, since a packed copy pushes nothing out: packing on every call would cost
    more than the matmul's own reorder) or a key requires grad (weights being trained change every step,
    possibly through ``.data``, which no version counter sees). ``tag`` names what else the copy depends on:
    ``b``'s layout and, for FP8/FP4 weights, the scale granularity they were dequantized at."""
    if (not _PACKING or b_nk.dtype != BF16 or b_nk.numel() == 0 or any(k.requires_grad for k in keys)
            or not _q._cacheable(keys)):  # N or K of 0: nothing to pack (oneDNN refuses it)
        return None

    def build():
        nbytes, w = _packed_nbytes(b_nk), b_nk.detach()
        return _LazyPacked(w.size(0), lambda g: _pack_one(w[g], _PACKER), nbytes) if _q._fits(nbytes) else None

    return _q._cached_by_tensors(("packed_weights", tag), keys, build, optional=True)


def _fp4_packable(data: torch.Tensor) -> bool:
    """Whether ``data`` can be MXFP4 weights ``[G, N, K/2]`` for :class:`~deepep_ascend.native.AmxFp4Weight`,
    the grouped GEMMs packing for the AMX kernel here."""
    return _PACKER == "amx" and data.dtype in (torch.int8, torch.uint8) and data.dim() == 3


def _fp4_exponents(sf: torch.Tensor, gran_k: int, n: int, k: int) -> torch.Tensor | None:
    """The UE8M0 exponent byte of each 32 K values, uint8 ``[..., N, ceil(K/32)]``, of FP4 weight scales ``sf``
    (one per row and ``gran_k`` K values, float32 or packed UE8M0), when every scale is a power of two that
    :class:`~deepep_ascend.native.AmxFp4Weight` takes (:data:`~deepep_ascend.native.AMX_FP4_EXPONENTS`);
    else None (the weights are then dequantized to bf16)."""
    groups = ceil_div(k, gran_k)
    if gran_k % 32 or sf.size(-2) != n:
        return None
    s = _q._scales_as_float("sf", sf)
    if s.size(-1) < groups:
        return None
    bits = s[..., :groups].contiguous().view(torch.int32)
    e = (bits >> 23) & 0xFF
    lo, hi = _native.AMX_FP4_EXPONENTS
    not_powers_of_two = bool(((bits <= 0) | ((bits & 0x7FFFFF) != 0)).any())
    if not_powers_of_two or (e.numel() and not lo <= int(e.min()) <= int(e.max()) <= hi):
        return None
    return e.to(torch.uint8).repeat_interleave(gran_k // 32, -1)[..., :ceil_div(k, 32)].contiguous()


def _pack_fp4_groups(data: torch.Tensor, sf: torch.Tensor, gran_k: int):
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


def _packed_fp4_weights(data: torch.Tensor, sf: torch.Tensor, gran: tuple, n: int, k: int):
    """:class:`_LazyPacked` copies of MXFP4 weights ``(data [G, N, K/2], sf)`` (scales per row and
    ``gran[1]`` K values), cached by identity and version of ``data`` and ``sf`` as an optional entry (as
    :func:`_packed_weights`; :class:`~deepep_ascend.native.AmxFp4Weight` groups, each packed on first use);
    None where the AMX kernel is unavailable, the scales do not qualify
    (:func:`_fp4_exponents`; remembered), the operands require grad or the caches are off. The multiply then
    uses the dequantized bf16 weights. Preferred to them: a quarter of the packed bf16 copy's bytes and no
    dequantized copy, at about the same speed (``python -m bench.grouped_gemm``, row "per group, AMX, FP4
    weights"). A copy that does not fit the budget beside what is cached serves this call only (each group
    packed as it is used, in one pass over its bytes; the budget's warning says so): far cheaper than
    dequantizing the weights again, which is what the bf16 way would do each call."""
    if not _fp4_packable(data) or gran[0] != 1 or data.requires_grad or not _q._cacheable((data, sf)):
        return None

    def build():
        exps, w = _fp4_exponents(sf, gran[1], n, k), data.detach()
        if exps is None:
            return _NOT_FP4
        return _LazyPacked(w.size(0), lambda g: _native.AmxFp4Weight(w[g], exps[g]),
                           w.size(0) * _native.amx_fp4_packed_nbytes(n, k))

    p = _q._cached_by_tensors(("packed_fp4_weights", gran), (data, sf), build, optional=True)
    return None if p is _NOT_FP4 else p


# cached (0 bytes) in place of an FP4 copy for scales the decoder cannot take: later calls go the bf16 way
# without scanning the scales again
_NOT_FP4 = object()


def _mm_group(x: torch.Tensor, w_t: torch.Tensor | None, packed, g: int) -> torch.Tensor:
    """bf16 ``x @ w_t`` (``w_t = B[g]`` as ``[K, N]``) with float32 accumulation, on the packed copy
    ``packed[g]`` when there is one, ``x`` is bf16 and autograd does not record the call (the packed
    kernels have no backward; packed weights never require grad). ``w_t`` may be None when ``packed`` is
    given and those hold. (Whole grouped calls take the AMX kernel in one go: :func:`_amx_runs`.)"""
    if packed is not None and x.dtype == BF16 and not (x.requires_grad and torch.is_grad_enabled()):
        p = packed[g]
        if not isinstance(p, _AMX_WEIGHTS):
            return _LINEAR(x, p, None, "none", [], "")
        x = x if matrix_ok(x) else x.contiguous()
        out = torch.empty(x.size(0), p.n, dtype=BF16)
        _native.gemm_bf16_amx(out, x, p)
        return out
    return _matmul_bf16_out(x, w_t)


def _amx_runs(packed, d: torch.Tensor, rows, runs: list) -> bool:
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


class _Operands:
    """Per-group access to A rows and B weights, bf16 or FP8/FP4 (dequantized)."""

    def __init__(
        self, a, b, kind: str, b_layout: str, recipe=None, recipe_a=None, recipe_b=None
    ):
        self.fp8 = kind == "fp8"
        self.b_layout = b_layout  # "nt": b [G, N, K]; "nn": b [G, K, N]
        if self.fp8:
            self.a_data, self.a_sf = _pair("a", a)
            self.b_data, self.b_sf = _pair("b", b)
            if self.a_data.dtype != _FP8:
                raise TypeError(f"a[0] must be float8_e4m3fn, got {self.a_data.dtype}")
            if b_layout == "nn" and self.b_data.dtype != _FP8:
                raise TypeError("packed FP4 B is only supported with the nt layout")
            self.a_t, self.b_t = self.a_data, self.b_data
        else:
            self.a_t = _tensor("a", a, (BF16,))
            self.b_t = _tensor("b", b, (BF16,))
        self._packed = False  # not looked up yet (see mm)
        self.k = _k_of(self.a_t)
        bk = _k_of(self.b_t, -1 if b_layout == "nt" else -2)
        if self.b_t.dim() != 3:
            raise ValueError(
                f"b must be 3-D [G, N, K] / [G, K, N], got shape {tuple(self.b_t.shape)}"
            )
        if bk != self.k:
            raise ValueError(f"K mismatch: a has K={self.k}, b has K={bk}")
        self.g = self.b_t.size(0)
        self.n = self.b_t.size(1) if b_layout == "nt" else self.b_t.size(2)
        if self.fp8:
            self.ga, self.gb = _resolve_grans(
                (self.a_data, self.a_sf),
                (self.b_data, self.b_sf),
                recipe,
                recipe_a,
                recipe_b,
                self.k,
                self.n,
                3,
            )
            if self.ga[0] != 1:
                raise ValueError(
                    f"A scales must be per row (gran_m 1), got recipe_a {self.ga}"
                )
            self._b_deq = None

    def _dequantized(self) -> torch.Tensor:
        """The FP8/FP4 weights dequantized, ``[G, N, K]`` (cached: :func:`dequantize_weights`)."""
        if self._b_deq is None:
            self._b_deq = dequantize_weights(
                self.b_data,
                self.b_sf,
                self.gb[0],
                self.gb[1],
                k_major=self.b_layout == "nt",
            )
        return self._b_deq

    def weight_t(self, g: int) -> torch.Tensor:
        """``B[g]`` as ``[K, N]`` (bf16 or float32)."""
        if not self.fp8:
            return self.b_t[g].t() if self.b_layout == "nt" else self.b_t[g]
        return self._dequantized()[g].t()

    def packed(self):
        """The packed weights (:func:`_packed_fp4_weights` for MXFP4 weights the AMX kernel decodes itself,
        where it applies and fits, else :func:`_packed_weights`), or None."""
        if self._packed is False:
            p = None
            if self.fp8 and self.b_layout == "nt" and self.b_data.dtype != _FP8:
                p = _packed_fp4_weights(self.b_data, self.b_sf, self.gb, self.n, self.k)
            if p is None:
                src = self._dequantized() if self.fp8 else self.b_t
                b_nk = src if self.fp8 or self.b_layout == "nt" else src.transpose(-1, -2)
                # keyed like the dequantized copy it is packed from: the same data and scales read at
                # another granularity are other weights
                tag = (self.b_layout, *self.gb) if self.fp8 else self.b_layout
                p = _packed_weights(b_nk, (self.b_data, self.b_sf) if self.fp8 else (src,), tag)
            self._packed = p
        return self._packed

    def mm(self, x: torch.Tensor, g: int) -> torch.Tensor:
        """bf16 ``x @ B[g]^T`` (``x`` from :meth:`rows`), float32 accumulation, on prepacked weights
        where available (:func:`_packed_weights`)."""
        return _mm_group(x, self.weight_t(g), self.packed(), g)

    def rows(self, a_data, a_sf=None) -> torch.Tensor:
        if not self.fp8:
            return a_data
        gran = self.ga[1]
        if (a_data.dim() == 2 and a_sf.dtype in _q._INT_DTYPES_FOR_UE8M0 and self.k % gran == 0
                and a_sf.dim() == 2 and a_sf.size(0) == a_data.size(0)):
            groups = self.k // gran
            e = _q._row_major(a_sf).view(torch.uint8)
            # e4m3 values are multiples of 2**-9 up to 448: times 2**(e - 127) they are exact bf16 values
            # (subnormal ones multiples of 2**-133) for e in [3, 246], so the per-token cast back (the native
            # kernel where built) gives the bf16 operand directly, without the float32 round trip
            e = e[:, :groups] if e.size(1) >= groups else e[:0]
            if e.numel() and 3 <= int(e.min()) and int(e.max()) <= 246:
                return _q.per_token_cast_back(a_data, a_sf, gran, BF16)
        return _to_exact_bf16(_dequantize_operand(a_data, a_sf, 1, gran, "a"))


def _check_d(d, shape, dtypes=(BF16,)):
    _tensor("d", d, dtypes)
    if tuple(d.shape) != tuple(shape):
        raise ValueError(f"d must have shape {tuple(shape)}, got {tuple(d.shape)}")


# ----------------------------------------------------------------------------------------------
# m-grouped contiguous


def _contiguous_runs(layout: list[int], m: int, num_groups: int, use_psum: bool):
    """[(group, start, end)] for groups with rows, plus [(start, end)] padding ranges to zero."""
    alignment = _mk_alignment
    runs, zero = [], []
    if use_psum:
        prev = 0
        for g, end in enumerate(layout):
            start = align(prev, alignment)
            if end < prev:
                raise ValueError(
                    f"grouped_layout (psum) must be non-decreasing, got {layout}"
                )
            if end != prev and end < start:
                raise ValueError(
                    f"grouped_layout (psum): group {g} ends at {end}, before its aligned start {start}"
                )
            if end > m:
                raise ValueError(f"grouped_layout (psum): end {end} exceeds M={m}")
            if end > start:
                runs.append((g, start, end))
            zero.append((end, min(align(end, alignment), m)))
            prev = end
        return runs, zero
    t = torch.tensor(layout, dtype=torch.int64)
    if m and bool(((t < -1) | (t >= num_groups)).any()):
        raise ValueError(f"grouped_layout values must be -1 or in [0, {num_groups})")
    if m == 0:
        return runs, zero
    vals, counts = torch.unique_consecutive(t, return_counts=True)
    ends = torch.cumsum(counts, 0).tolist()
    seen = set()
    for v, e, c in zip(vals.tolist(), ends, counts.tolist()):
        s = e - c
        if v < 0:
            zero.append((s, e))
            continue
        if v in seen:
            raise ValueError(f"grouped_layout: group {v} is not one contiguous run")
        if s % alignment:
            raise ValueError(
                f"grouped_layout: group {v} starts at row {s}, not a multiple of the alignment "
                f"{alignment} (get_mk_alignment_for_contiguous_layout)"
            )
        seen.add(v)
        runs.append((v, s, e))
    return runs, zero


def _m_grouped_contiguous(
    ops: _Operands, d, grouped_layout, use_psum_layout, ensure_zero_padding
):
    m = ops.a_t.size(0)
    if ops.a_t.dim() != 2:
        raise ValueError(f"a must be 2-D [M, K], got shape {tuple(ops.a_t.shape)}")
    _check_d(d, (m, ops.n))
    if use_psum_layout:
        layout = _int_list("grouped_layout", grouped_layout, ops.g)
    else:
        layout = _int_list("grouped_layout", grouped_layout, m)
    runs, zero = _contiguous_runs(layout, m, ops.g, use_psum_layout)
    if ops.fp8 and ops.a_sf.size(0) != m:
        raise ValueError(
            f"a[1] (sf) must have {m} rows, got shape {tuple(ops.a_sf.shape)}"
        )
    if not (runs and _amx_runs(ops.packed(), d, lambda: ops.rows(ops.a_t, ops.a_sf if ops.fp8 else None), runs)):
        for g, s, e in runs:
            x = ops.rows(ops.a_t[s:e], ops.a_sf[s:e] if ops.fp8 else None)
            d[s:e] = ops.mm(x, g)
    if ensure_zero_padding or not use_psum_layout:
        for s, e in zero:
            if e > s:
                d[s:e] = 0


def m_grouped_bf16_gemm_nt_contiguous(
    a,
    b,
    d,
    grouped_layout,
    compiled_dims="nk",
    use_psum_layout=False,
    ensure_zero_padding=True,
    expected_m_for_psum_layout=None,
) -> None:
    """``deep_gemm.m_grouped_bf16_gemm_nt_contiguous``: ``d[rows of g] = bf16(a[rows] @ b[g].T)``.

    ``a`` bf16 ``[M, K]``; ``b`` bf16 ``[G, N, K]``; ``d`` bf16 ``[M, N]``, written in place;
    ``grouped_layout`` int32 ``[M]`` (group per row, -1 = padding row, zeroed) or, with
    ``use_psum_layout``, ``[G]`` exclusive row ends (the module docstring's m-grouped contiguous
    layout; groups start at multiples of :func:`get_mk_alignment_for_contiguous_layout`).
    Float32 accumulation, one bf16 rounding. ``compiled_dims`` and ``expected_m_for_psum_layout``
    are accepted for parity and change nothing. Raises ``TypeError`` (dtypes) or ``ValueError``
    (shapes, a layout that is not one aligned run per group, group ids outside ``[-1, G)``)
    naming the argument, before ``d`` is written."""
    ops = _Operands(a, b, "bf16", "nt")
    _m_grouped_contiguous(ops, d, grouped_layout, use_psum_layout, ensure_zero_padding)


def m_grouped_bf16_gemm_nn_contiguous(
    a,
    b,
    d,
    grouped_layout,
    compiled_dims="nk",
    use_psum_layout=False,
    ensure_zero_padding=True,
) -> None:
    """``deep_gemm.m_grouped_bf16_gemm_nn_contiguous``: as :func:`m_grouped_bf16_gemm_nt_contiguous`
    with ``b`` bf16 ``[G, K, N]`` (``d[rows of g] = bf16(a[rows] @ b[g])``); same layouts and errors."""
    ops = _Operands(a, b, "bf16", "nn")
    _m_grouped_contiguous(ops, d, grouped_layout, use_psum_layout, ensure_zero_padding)


def m_grouped_fp8_fp4_gemm_nt_contiguous(
    a,
    b,
    d,
    grouped_layout,
    recipe=None,
    recipe_a=None,
    recipe_b=None,
    compiled_dims="nk",
    disable_ue8m0_cast=False,
    use_psum_layout=False,
    ensure_zero_padding=True,
    expected_m_for_psum_layout=None,
) -> None:
    """``deep_gemm.m_grouped_fp8_fp4_gemm_nt_contiguous`` (alias ``m_grouped_fp8_gemm_nt_contiguous``):
    ``d[rows of g] = bf16(deq(a)[rows] @ deq(b[g]).T)``.

    ``a = (float8_e4m3fn [M, K], sf)``: float32 ``[M, ceil(K/128)]`` or packed UE8M0 int32 scales;
    ``b = (float8_e4m3fn [G, N, K] or FP4 e2m1 int8 [G, N, K/2] (two nibbles per byte), sf)``;
    ``d`` bf16 ``[M, N]``, written in place. Scale granularities come from ``recipe`` /
    ``recipe_a`` / ``recipe_b`` or are inferred (module docstring, "Scale factors"); the layout
    arguments are those of :func:`m_grouped_bf16_gemm_nt_contiguous`. ``compiled_dims``,
    ``disable_ue8m0_cast`` and ``expected_m_for_psum_layout`` change nothing. Raises ``TypeError``
    (dtypes, an operand that is not a ``(data, sf)`` pair) or ``ValueError`` (shapes, scale shapes
    that fit no granularity, a bad recipe or layout) naming the argument, before ``d`` is written."""
    ops = _Operands(a, b, "fp8", "nt", recipe, recipe_a, recipe_b)
    _m_grouped_contiguous(ops, d, grouped_layout, use_psum_layout, ensure_zero_padding)


def m_grouped_fp8_fp4_gemm_nn_contiguous(
    a,
    b,
    d,
    grouped_layout,
    recipe=None,
    recipe_a=None,
    recipe_b=None,
    compiled_dims="nk",
    disable_ue8m0_cast=False,
    use_psum_layout=False,
    ensure_zero_padding=True,
) -> None:
    """``deep_gemm.m_grouped_fp8_fp4_gemm_nn_contiguous`` (alias ``m_grouped_fp8_gemm_nn_contiguous``): as
    :func:`m_grouped_fp8_fp4_gemm_nt_contiguous` with ``b = (float8_e4m3fn [G, K, N], sf)``, its scales
    logical ``[G, N, K-groups]`` (FP4 ``b`` is K-major only: ``TypeError`` here); same layouts and errors."""
    ops = _Operands(a, b, "fp8", "nn", recipe, recipe_a, recipe_b)
    _m_grouped_contiguous(ops, d, grouped_layout, use_psum_layout, ensure_zero_padding)


m_grouped_fp8_gemm_nt_contiguous = m_grouped_fp8_fp4_gemm_nt_contiguous
m_grouped_fp8_gemm_nn_contiguous = m_grouped_fp8_fp4_gemm_nn_contiguous


# ----------------------------------------------------------------------------------------------
# m-grouped masked


def _rows_of_groups(t: torch.Tensor) -> torch.Tensor | None:
    """``t [G, Mmax, C]`` as a ``[G·Mmax, C]`` view, or None where its strides do not allow one."""
    try:
        return t.view(-1, t.size(-1))
    except RuntimeError:
        return None


def _masked_rows(ops: _Operands, runs: list):
    """The masked layout's A as bf16 ``[G·Mmax, K]``: a view of ``a`` (bf16), or for FP8 the rows of ``runs``
    dequantized into a buffer whose other rows are never touched (a decode batch fills few of its
    ``G·Mmax`` rows); None where ``a`` is not one matrix or its rows are not exact in bf16."""
    a = _rows_of_groups(ops.a_t)
    if a is None or not ops.fp8:
        return a
    sf = _rows_of_groups(ops.a_sf)
    if sf is None:
        return None
    out = torch.empty(a.size(0), a.size(1), dtype=BF16)
    for _, s, e in runs:
        x = ops.rows(a[s:e], sf[s:e])
        if x.dtype != BF16:  # scales that leave values inexact in bf16: float32 products, group by group
            return None
        out[s:e] = x
    return out


def _m_grouped_masked(ops: _Operands, d, masked_m, expected_m):
    if ops.a_t.dim() != 3 or ops.a_t.size(0) != ops.g:
        raise ValueError(
            f"a must be [G={ops.g}, Mmax, K], got shape {tuple(ops.a_t.shape)}"
        )
    mmax = ops.a_t.size(1)
    _check_d(d, (ops.g, mmax, ops.n))
    counts = _int_list("masked_m", masked_m, ops.g)
    if any(c < 0 or c > mmax for c in counts):
        raise ValueError(f"masked_m entries must be in [0, {mmax}], got {counts}")
    if (
        not isinstance(expected_m, int)
        or isinstance(expected_m, bool)
        or expected_m < 0
    ):
        raise ValueError(
            f"expected_m must be a non-negative int (a hint), got {expected_m!r}"
        )
    if ops.fp8 and tuple(ops.a_sf.shape[:2]) != (ops.g, mmax):
        raise ValueError(
            f"a[1] (sf) must be [G, Mmax, ...], got shape {tuple(ops.a_sf.shape)}"
        )
    runs = [(g, g * mmax, g * mmax + c) for g, c in enumerate(counts) if c]
    flat = _rows_of_groups(d)  # [G·Mmax, N] views where the strides allow (one AMX call for every group)
    if not (runs and flat is not None and _amx_runs(ops.packed(), flat, lambda: _masked_rows(ops, runs), runs)):
        for g, c in enumerate(counts):
            if c:
                x = ops.rows(ops.a_t[g, :c], ops.a_sf[g, :c] if ops.fp8 else None)
                d[g, :c] = ops.mm(x, g)


def m_grouped_bf16_gemm_nt_masked(
    a, b, d, masked_m, expected_m, compiled_dims="nk"
) -> None:
    """``deep_gemm.m_grouped_bf16_gemm_nt_masked`` (alias ``bf16_m_grouped_gemm_nt_masked``), on the
    layout DeepEP's ``low_latency_dispatch`` returns: ``d[g, :masked_m[g]] = bf16(a[g, :masked_m[g]] @ b[g].T)``.

    ``a`` bf16 ``[G, Mmax, K]``; ``b`` bf16 ``[G, N, K]``; ``d`` bf16 ``[G, Mmax, N]``, rows past
    ``masked_m[g]`` untouched; ``masked_m`` int32 ``[G]`` (each in ``[0, Mmax]``); ``expected_m``
    (int) is a hint and ``compiled_dims`` changes nothing. Float32 accumulation, one bf16 rounding.
    Raises ``TypeError``/``ValueError`` naming the argument (dtypes, shapes, ``masked_m`` out of
    range), before ``d`` is written."""
    _m_grouped_masked(_Operands(a, b, "bf16", "nt"), d, masked_m, expected_m)


def m_grouped_fp8_fp4_gemm_nt_masked(
    a,
    b,
    d,
    masked_m,
    expected_m,
    recipe=None,
    recipe_a=None,
    recipe_b=None,
    compiled_dims="nk",
    disable_ue8m0_cast=False,
) -> None:
    """``deep_gemm.m_grouped_fp8_fp4_gemm_nt_masked`` (aliases ``m_grouped_fp8_gemm_nt_masked``,
    ``fp8_m_grouped_gemm_nt_masked``): :func:`m_grouped_bf16_gemm_nt_masked` on dequantized operands.

    ``a = (float8_e4m3fn [G, Mmax, K], sf [G, Mmax, K-groups])`` (float32 or packed UE8M0 int32);
    ``b = (float8_e4m3fn [G, N, K] or FP4 e2m1 int8 [G, N, K/2], sf)``; ``d`` bf16 ``[G, Mmax, N]``.
    Scales as in :func:`m_grouped_fp8_fp4_gemm_nt_contiguous`; ``masked_m``, ``expected_m`` and the
    errors as in the bf16 masked variant."""
    ops = _Operands(a, b, "fp8", "nt", recipe, recipe_a, recipe_b)
    _m_grouped_masked(ops, d, masked_m, expected_m)


m_grouped_fp8_gemm_nt_masked = m_grouped_fp8_fp4_gemm_nt_masked
fp8_m_grouped_gemm_nt_masked = m_grouped_fp8_fp4_gemm_nt_masked
bf16_m_grouped_gemm_nt_masked = m_grouped_bf16_gemm_nt_masked


# ----------------------------------------------------------------------------------------------
# k-grouped


def _k_segments(
    ks_cpu, grouped_layout, use_psum_layout, total_k
) -> list[tuple[int, int]]:
    if grouped_layout is not None:
        layout = _int_list("grouped_layout", grouped_layout)
    else:
        layout = None
    if use_psum_layout:
        if layout is None:
            raise ValueError("use_psum_layout=True needs grouped_layout (psum ends)")
        segs, prev = [], 0
        for g, end in enumerate(layout):
            start = align(prev, _mk_alignment)
            if end < prev or (end != prev and end < start):
                raise ValueError(
                    f"grouped_layout (psum) invalid at group {g}: {layout}"
                )
            segs.append((start, max(start, end)) if end != prev else (start, start))
            prev = end
        ks = [e - s for s, e in segs]
        if ks_cpu is not None and [int(v) for v in ks_cpu] != ks:
            raise ValueError(
                f"ks_cpu {list(ks_cpu)} disagrees with grouped_layout {layout}"
            )
    else:
        if ks_cpu is None:
            if layout is None:
                raise ValueError("ks_cpu or grouped_layout is required")
            ks = layout
        else:
            if not isinstance(ks_cpu, Sequence) or not all(
                isinstance(v, int) for v in ks_cpu
            ):
                raise TypeError(f"ks_cpu must be a list of ints, got {ks_cpu!r}")
            ks = list(ks_cpu)
            if layout is not None and layout != ks:
                raise ValueError(f"ks_cpu {ks} disagrees with grouped_layout {layout}")
        if any(v < 0 for v in ks):
            raise ValueError(f"ks must be non-negative, got {ks}")
        segs, off = [], 0
        for v in ks:
            segs.append((off, off + v))
            off += v
    if segs and segs[-1][1] > total_k:
        raise ValueError(
            f"K segments end at {segs[-1][1]}, beyond the operands' K={total_k}"
        )
    return segs


def _k_grouped(a_t, b_t, d, c, segs, gran_k=None):
    """``a_t [ΣK, M]``, ``b_t [ΣK, N]`` float32 (or bf16) K-major views; float32 accumulation."""
    m, n = a_t.size(1), b_t.size(1)
    g = len(segs)
    _check_d(d, (g, m, n), (FP32,))
    if c is not None:
        _tensor("c", c, (FP32,))
        if tuple(c.shape) != (g, m, n):
            raise ValueError(f"c must have shape {(g, m, n)}, got {tuple(c.shape)}")
    for i, (s, e) in enumerate(segs):
        if gran_k is not None and (s % gran_k or (e - s) % gran_k):
            raise ValueError(
                f"group {i}'s K segment [{s}, {e}) is not a multiple of gran_k={gran_k}"
            )
        acc = torch.matmul(a_t[s:e].t().float(), b_t[s:e].float())
        d[i] = acc if c is None else c[i] + acc


def k_grouped_bf16_gemm_tn_contiguous(
    a,
    b,
    d,
    ks_cpu,
    grouped_layout,
    c=None,
    compiled_dims="mn",
    use_psum_layout=False,
) -> None:
    """``deep_gemm.k_grouped_bf16_gemm_tn_contiguous`` (weight gradients):
    ``d[g] = c[g] + a[seg_g].T @ b[seg_g]`` in float32.

    ``a`` bf16 ``[ΣK, M]``; ``b`` bf16 ``[ΣK, N]``; ``d`` float32 ``[G, M, N]``, written in place;
    ``c`` float32 ``[G, M, N]`` or None (zeros; may alias ``d``); ``ks_cpu`` per-group K (list of
    ints, 0 allowed) and ``grouped_layout`` int32 ``[G]`` the same Ks (or, with
    ``use_psum_layout``, their running ends). ``compiled_dims`` changes nothing. Raises
    ``TypeError``/``ValueError`` naming the argument (dtypes, shapes, negative Ks, Ks that disagree
    with ``grouped_layout`` or end past ``ΣK``; rows past the last segment are not read)."""
    _tensor("a", a, (BF16,), 2)
    _tensor("b", b, (BF16,), 2)
    if a.size(0) != b.size(0):
        raise ValueError(
            f"a and b must have the same ΣK rows, got {a.size(0)} and {b.size(0)}"
        )
    segs = _k_segments(ks_cpu, grouped_layout, use_psum_layout, a.size(0))
    _k_grouped(a, b, d, c, segs)


def _per_channel_deq(name, pair, gran_k, k_axis):
    data, sf = _pair(name, pair)
    if data.dtype != _FP8 or sf.dtype != FP32:
        raise TypeError(f"{name} must be (float8_e4m3fn data, float32 per-channel sf)")
    if data.dim() != 2:
        raise ValueError(f"{name}[0] must be 2-D, got shape {tuple(data.shape)}")
    dk = data if k_axis == 0 else data.t()  # [ΣK, MN]
    want = (ceil_div(dk.size(0), gran_k), dk.size(1))
    sk = sf if k_axis == 0 else sf.t()
    if tuple(sk.shape) != want:
        raise ValueError(
            f"{name}[1] (sf) must be {'[ΣK/gran_k, MN]' if k_axis == 0 else '[MN, ΣK/gran_k]'}"
            f" = {want if k_axis == 0 else want[::-1]}, got {tuple(sf.shape)}"
        )
    return dk.float() * sk.repeat_interleave(gran_k, dim=0)[: dk.size(0)]


def _k_grouped_fp8(a, b, d, ks_cpu, grouped_layout, c, recipe, use_psum_layout, k_axis):
    recipe = tuple(recipe)
    if len(recipe) != 3 or recipe[0] != 1 or recipe[1] != 1:
        raise ValueError(f"k-grouped FP8 needs recipe (1, 1, gran_k), got {recipe}")
    gran_k = recipe[2]
    a_t = _per_channel_deq("a", a, gran_k, k_axis)
    b_t = _per_channel_deq("b", b, gran_k, k_axis)
    if a_t.size(0) != b_t.size(0):
        raise ValueError(
            f"a and b must have the same ΣK, got {a_t.size(0)} and {b_t.size(0)}"
        )
    segs = _k_segments(ks_cpu, grouped_layout, use_psum_layout, a_t.size(0))
    _k_grouped(a_t, b_t, d, c, segs, gran_k)


def k_grouped_fp8_gemm_tn_contiguous(
    a,
    b,
    d,
    ks_cpu,
    grouped_layout,
    c=None,
    recipe=(1, 1, 128),
    compiled_dims="mn",
    use_psum_layout=False,
) -> None:
    """``deep_gemm.k_grouped_fp8_gemm_tn_contiguous``: ``d[g] = c[g] + deq(a)_g^T deq(b)_g`` in float32.

    ``a = (float8_e4m3fn [ΣK, M], float32 sf [ΣK/gran_k, M])``, ``b = (float8_e4m3fn [ΣK, N],
    float32 sf [ΣK/gran_k, N])`` (:func:`deepep_ascend.per_channel_cast_to_fp8`); ``recipe``
    ``(1, 1, gran_k)``; every group's K must be a multiple of ``gran_k`` so its scales restart with
    it. ``d``, ``c``, ``ks_cpu``, ``grouped_layout`` as in :func:`k_grouped_bf16_gemm_tn_contiguous`.
    Raises ``TypeError``/``ValueError`` naming the argument (dtypes, shapes, recipe, a K segment not a
    multiple of ``gran_k``)."""
    _k_grouped_fp8(a, b, d, ks_cpu, grouped_layout, c, recipe, use_psum_layout, 0)


def k_grouped_fp8_gemm_nt_contiguous(
    a,
    b,
    d,
    ks_cpu,
    grouped_layout,
    c=None,
    recipe=(1, 1, 128),
    compiled_dims="mn",
    use_psum_layout=False,
) -> None:
    """``deep_gemm.k_grouped_fp8_gemm_nt_contiguous``: :func:`k_grouped_fp8_gemm_tn_contiguous` on
    K-last operands, ``a = (float8_e4m3fn [M, ΣK], float32 sf [M, ΣK/gran_k])``, ``b = (float8_e4m3fn
    [N, ΣK], float32 sf [N, ΣK/gran_k])``; same result as the ``tn`` variant on the transposed
    operands, same arguments and errors."""
    _k_grouped_fp8(a, b, d, ks_cpu, grouped_layout, c, recipe, use_psum_layout, 1)


# ----------------------------------------------------------------------------------------------
# dense (G = 1)


def _dense_out(x, w_t, d, c):
    m, n = x.size(0), w_t.size(1)
    _check_d(d, (m, n), (BF16, FP32))
    if c is not None:
        _tensor("c", c, (FP32,))
        if tuple(c.shape) != (m, n):
            raise ValueError(f"c must have shape {(m, n)}, got {tuple(c.shape)}")
    if d.dtype == BF16 and c is None:
        d.copy_(_matmul_bf16_out(x, w_t))
        return
    acc = torch.matmul(x.float(), w_t.float())
    d.copy_(acc if c is None else c + acc)


def _bf16_dense(a, b, d, c, layout):
    _tensor("a", a, (BF16,), 2)
    _tensor("b", b, (BF16,), 2)
    x = a if layout[0] == "n" else a.t()
    w_t = b.t() if layout[1] == "t" else b
    if x.size(1) != w_t.size(0):
        raise ValueError(
            f"K mismatch: op(a) is {tuple(x.shape)}, op(b) is {tuple(w_t.shape)}"
        )
    _dense_out(x, w_t, d, c)


def bf16_gemm_nt(a, b, d, c=None, compiled_dims="nk") -> None:
    """``deep_gemm.bf16_gemm_nt``: ``d = a @ b.T (+ c)``; ``a`` bf16 ``[M, K]``, ``b`` bf16 ``[N, K]``;
    ``d`` bf16 or float32, written in place; ``c`` float32 of ``d``'s shape or None (added in
    float32; DeepGEMM's accumulate input). Float32 accumulation. ``compiled_dims`` changes nothing.
    Raises ``TypeError``/``ValueError`` naming the argument (dtypes, shapes, K mismatch)."""
    _bf16_dense(a, b, d, c, "nt")


def bf16_gemm_nn(a, b, d, c=None, compiled_dims="nk") -> None:
    """``deep_gemm.bf16_gemm_nn``: ``d = a @ b (+ c)``; ``a`` bf16 ``[M, K]``, ``b`` bf16 ``[K, N]``;
    ``d`` bf16 or float32, written in place; ``c`` float32 of ``d``'s shape or None (added in
    float32; DeepGEMM's accumulate input). Float32 accumulation. ``compiled_dims`` changes nothing.
    Raises ``TypeError``/``ValueError`` naming the argument (dtypes, shapes, K mismatch)."""
    _bf16_dense(a, b, d, c, "nn")


def bf16_gemm_tn(a, b, d, c=None, compiled_dims="mn") -> None:
    """``deep_gemm.bf16_gemm_tn``: ``d = a.T @ b (+ c)``; ``a`` bf16 ``[K, M]``, ``b`` bf16 ``[K, N]``;
    ``d`` bf16 or float32, written in place; ``c`` float32 of ``d``'s shape or None (added in
    float32; DeepGEMM's accumulate input). Float32 accumulation. ``compiled_dims`` changes nothing.
    Raises ``TypeError``/``ValueError`` naming the argument (dtypes, shapes, K mismatch)."""
    _bf16_dense(a, b, d, c, "tn")


def bf16_gemm_tt(a, b, d, c=None, compiled_dims="mn") -> None:
    """``deep_gemm.bf16_gemm_tt``: ``d = a.T @ b.T (+ c)``; ``a`` bf16 ``[K, M]``, ``b`` bf16 ``[N, K]``;
    ``d`` bf16 or float32, written in place; ``c`` float32 of ``d``'s shape or None (added in
    float32; DeepGEMM's accumulate input). Float32 accumulation. ``compiled_dims`` changes nothing.
    Raises ``TypeError``/``ValueError`` naming the argument (dtypes, shapes, K mismatch)."""
    _bf16_dense(a, b, d, c, "tt")


def _fp8_dense(a, b, d, c, layout, recipe, recipe_a, recipe_b):
    a_data, a_sf = _pair("a", a)
    b_data, b_sf = _pair("b", b)
    if a_data.dim() != 2 or b_data.dim() != 2:
        raise ValueError("a[0] and b[0] must be 2-D")
    # logical K-major views [M, K] / [N, K]; scales are logical [MN, K-groups]
    a_km = a_data if layout[0] == "n" else a_data.t()
    b_km = b_data if layout[1] == "t" else b_data.t()
    if layout != "nt" and (a_data.dtype != _FP8 or b_data.dtype != _FP8):
        raise TypeError(
            "packed FP4 operands are only supported K-major (the nt layout)"
        )
    k = _k_of(a_km)
    if _k_of(b_km) != k:
        raise ValueError(f"K mismatch: a has K={k}, b has K={_k_of(b_km)}")
    ga, gb = _resolve_grans(
        (a_km, a_sf), (b_km, b_sf), recipe, recipe_a, recipe_b, k, b_km.size(0), 2
    )
    x = _to_exact_bf16(_dequantize_operand(a_km, a_sf, ga[0], ga[1], "a"))
    w = dequantize_weights(b_data, b_sf, gb[0], gb[1], k_major=layout[1] == "t")
    _dense_out(
        x if x.dtype == w.dtype else x.float(),
        w.t() if x.dtype == w.dtype else w.t().float(),
        d,
        c,
    )


def fp8_fp4_gemm_nt(
    a,
    b,
    d,
    c=None,
    recipe=None,
    recipe_a=None,
    recipe_b=None,
    compiled_dims="nk",
    disable_ue8m0_cast=False,
) -> None:
    """``deep_gemm.fp8_fp4_gemm_nt`` (alias ``fp8_gemm_nt``): ``d = deq(a) @ deq(b).T (+ c)``;
    ``a = (float8_e4m3fn [M, K], sf)``, ``b = (float8_e4m3fn [N, K] or FP4 int8 [N, K/2], sf)``.
    Operands are ``(data, sf)`` pairs, dequantized first (module docstring: "Math", "Scale
    factors"; ``recipe``/``recipe_a``/``recipe_b`` as there); packed FP4 ``b`` (int8, two e2m1
    nibbles per byte) only in the ``nt`` layout. ``d`` bf16 or float32 ``[M, N]``, written in place;
    ``c`` float32 or None. ``compiled_dims`` and ``disable_ue8m0_cast`` change nothing. Raises
    ``TypeError``/``ValueError`` naming the argument (dtypes, shapes, scale shapes, recipe)."""
    _fp8_dense(a, b, d, c, "nt", recipe, recipe_a, recipe_b)


def fp8_fp4_gemm_nn(
    a,
    b,
    d,
    c=None,
    recipe=None,
    recipe_a=None,
    recipe_b=None,
    compiled_dims="nk",
    disable_ue8m0_cast=False,
) -> None:
    """``deep_gemm.fp8_fp4_gemm_nn`` (alias ``fp8_gemm_nn``): ``d = deq(a) @ deq(b) (+ c)``;
    ``a = (float8_e4m3fn [M, K], sf)``, ``b = (float8_e4m3fn [K, N], sf logical [N, K-groups])``.
    Operands are ``(data, sf)`` pairs, dequantized first (module docstring: "Math", "Scale
    factors"; ``recipe``/``recipe_a``/``recipe_b`` as there); packed FP4 ``b`` (int8, two e2m1
    nibbles per byte) only in the ``nt`` layout. ``d`` bf16 or float32 ``[M, N]``, written in place;
    ``c`` float32 or None. ``compiled_dims`` and ``disable_ue8m0_cast`` change nothing. Raises
    ``TypeError``/``ValueError`` naming the argument (dtypes, shapes, scale shapes, recipe)."""
    _fp8_dense(a, b, d, c, "nn", recipe, recipe_a, recipe_b)


def fp8_fp4_gemm_tn(
    a,
    b,
    d,
    c=None,
    recipe=None,
    recipe_a=None,
    recipe_b=None,
    compiled_dims="mn",
    disable_ue8m0_cast=False,
) -> None:
    """``deep_gemm.fp8_fp4_gemm_tn`` (alias ``fp8_gemm_tn``): ``d = deq(a).T @ deq(b) (+ c)``;
    ``a = (float8_e4m3fn [K, M], sf logical [M, K-groups])``, ``b = (float8_e4m3fn [K, N], sf logical
    [N, K-groups])``.
    Operands are ``(data, sf)`` pairs, dequantized first (module docstring: "Math", "Scale
    factors"; ``recipe``/``recipe_a``/``recipe_b`` as there); packed FP4 ``b`` (int8, two e2m1
    nibbles per byte) only in the ``nt`` layout. ``d`` bf16 or float32 ``[M, N]``, written in place;
    ``c`` float32 or None. ``compiled_dims`` and ``disable_ue8m0_cast`` change nothing. Raises
    ``TypeError``/``ValueError`` naming the argument (dtypes, shapes, scale shapes, recipe)."""
    _fp8_dense(a, b, d, c, "tn", recipe, recipe_a, recipe_b)


def fp8_fp4_gemm_tt(
    a,
    b,
    d,
    c=None,
    recipe=None,
    recipe_a=None,
    recipe_b=None,
    compiled_dims="mn",
    disable_ue8m0_cast=False,
) -> None:
    """``deep_gemm.fp8_fp4_gemm_tt`` (alias ``fp8_gemm_tt``): ``d = deq(a).T @ deq(b).T (+ c)``;
    ``a = (float8_e4m3fn [K, M], sf logical [M, K-groups])``, ``b = (float8_e4m3fn [N, K], sf)``.
    Operands are ``(data, sf)`` pairs, dequantized first (module docstring: "Math", "Scale
    factors"; ``recipe``/``recipe_a``/``recipe_b`` as there); packed FP4 ``b`` (int8, two e2m1
    nibbles per byte) only in the ``nt`` layout. ``d`` bf16 or float32 ``[M, N]``, written in place;
    ``c`` float32 or None. ``compiled_dims`` and ``disable_ue8m0_cast`` change nothing. Raises
    ``TypeError``/``ValueError`` naming the argument (dtypes, shapes, scale shapes, recipe)."""
    _fp8_dense(a, b, d, c, "tt", recipe, recipe_a, recipe_b)


fp8_gemm_nt = fp8_fp4_gemm_nt
fp8_gemm_nn = fp8_fp4_gemm_nn
fp8_gemm_tn = fp8_fp4_gemm_tn
fp8_gemm_tt = fp8_fp4_gemm_tt
