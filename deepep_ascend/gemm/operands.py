"""How the GEMMs read their operands: the arithmetic, the scale granularities, and per-group access to
A's rows and B's weights (:class:`GroupedOperands`).

Math. BF16: ``d = bf16(A @ B.T)`` with float32 accumulation. The packed paths (the library's AMX
kernel, oneDNN's packed inner product on AMX or AVX512-BF16; :mod:`.packing`) flush denormal bf16 inputs
and products to zero, as the hardware's bf16 dot products do; ``torch.matmul``, which multiplies weights
that are not packed (caches off or full, weights that require grad), keeps them, so products of denormal
operands depend on the path (found on an AVX512-BF16 CPU: 2^-126 from the matmul, 0 from the packed
weights). FP8/FP4: each operand is a ``(data, sf)`` pair and is dequantized first, ``deq[mn, k] =
value(data[mn, k]) * sf[mn // gran_mn, k // gran_k]`` in float32 (FP4 values from the e2m1 table), then
``d = bf16(deq(A) @ deq(B).T)``. When both dequantized operands are exactly representable in
bf16 (power-of-two UE8M0 scales) the product runs as a bf16 matmul with float32 accumulation,
which is exact emulation of block-scaled MMA; otherwise (legacy float32 scales) in float32.
Weights (B) are dequantized once and cached by tensor identity and version
(:func:`deepep_ascend.gemm.dequant.dequantize_weights`). K-grouped results accumulate in float32.

Scale factors (``recipe``): ``(gran_m_a, gran_n_b, gran_k)`` or per operand ``recipe_a`` /
``recipe_b`` = ``(gran_mn, gran_k)``. Without a recipe it is inferred per operand: float32 A
scales are per token at 128 (``(1, 128)``); float32 B scales ``[G, ceil(N/128), ceil(K/128)]``
are 128×128 blocks, ``[G, N, ceil(K/128)]`` per row; packed UE8M0 (int32) scales are per row
at ``gran_k`` 128 for FP8 data and 32 for FP4 data, unless only the other granularity matches
the scale width. Scales are logical ``[..., MN, K-groups]`` whatever the data storage (``nn``
B scales are ``[G, N, ...]``).
"""

from __future__ import annotations

import torch

from .arguments import check_operand, check_pair
from .dequant import dequantize_operand, dequantize_weights, to_exact_bf16
from .fp8 import per_token_cast_back
from .packing import mm_group, packed_fp4_weights, packed_weights
from .scales import UE8M0_INT_DTYPES, ceil_div, row_major

__all__ = ["GroupedOperands", "k_of", "resolve_grans"]

BF16 = torch.bfloat16
FP32 = torch.float32
FP8 = torch.float8_e4m3fn


def k_of(data: torch.Tensor, k_dim: int = -1) -> int:
    """Logical K of an operand stored K-major: FP4 packs two values per byte."""
    return data.size(k_dim) * (2 if data.dtype in (torch.int8, torch.uint8) else 1)


def resolve_grans(a, b, recipe, recipe_a, recipe_b, k, n, num_b_dims):
    """The scale granularities ``((gran_m_a, gran_k_a), (gran_n_b, gran_k_b))`` of FP8/FP4 operands ``a``
    and ``b`` (``(data, sf)`` pairs, logical ``[MN, K]``): from ``recipe_a`` / ``recipe_b``, else ``recipe``
    ``(gran_m_a, gran_n_b, gran_k)``, else inferred from the scales (module docstring, "Scale factors").
    ``k`` is the logical K, ``n`` B's N and ``num_b_dims`` B's scale dims (3 grouped, 2 dense). Raises
    ``ValueError`` for a recipe of another form."""
    (a_data, a_sf), (b_data, b_sf) = a, b

    def infer(data, sf, mn_extent, is_b):
        fp4 = data.dtype != FP8
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


class GroupedOperands:
    """Per-group access to A rows and B weights of an m-grouped GEMM, bf16 or FP8/FP4 (dequantized).

    Args:
        a: bf16 ``[M, K]`` / ``[G, Mmax, K]``, or for ``kind="fp8"`` an ``(e4m3 data, sf)`` pair.
        b: bf16 ``[G, N, K]`` (``b_layout="nt"``) or ``[G, K, N]`` (``"nn"``), or for ``kind="fp8"`` a
            ``(data, sf)`` pair, data e4m3 or (``nt`` only) packed FP4 int8 ``[G, N, K/2]``.
        kind: ``"bf16"`` or ``"fp8"``.
        recipe, recipe_a, recipe_b: scale granularities (:func:`resolve_grans`); A's must be per row.
    Raises:
        TypeError: dtypes, or an FP8 operand that is not a pair. ValueError: shapes, K mismatch, a recipe.
    """

    def __init__(
        self, a, b, kind: str, b_layout: str, recipe=None, recipe_a=None, recipe_b=None
    ):
        self.fp8 = kind == "fp8"
        self.b_layout = b_layout  # "nt": b [G, N, K]; "nn": b [G, K, N]
        if self.fp8:
            self.a_data, self.a_sf = check_pair("a", a)
            self.b_data, self.b_sf = check_pair("b", b)
            if self.a_data.dtype != FP8:
                raise TypeError(f"a[0] must be float8_e4m3fn, got {self.a_data.dtype}")
            if b_layout == "nn" and self.b_data.dtype != FP8:
                raise TypeError("packed FP4 B is only supported with the nt layout")
            self.a_t, self.b_t = self.a_data, self.b_data
        else:
            self.a_t = check_operand("a", a, (BF16,))
            self.b_t = check_operand("b", b, (BF16,))
        self._packed = False  # not looked up yet (see mm)
        self.k = k_of(self.a_t)
        bk = k_of(self.b_t, -1 if b_layout == "nt" else -2)
        if self.b_t.dim() != 3:
            raise ValueError(
                f"b must be 3-D [G, N, K] / [G, K, N], got shape {tuple(self.b_t.shape)}"
            )
        if bk != self.k:
            raise ValueError(f"K mismatch: a has K={self.k}, b has K={bk}")
        self.g = self.b_t.size(0)
        self.n = self.b_t.size(1) if b_layout == "nt" else self.b_t.size(2)
        if self.fp8:
            self.ga, self.gb = resolve_grans(
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
        """The packed weights (:func:`packed_fp4_weights` for MXFP4 weights the AMX kernel decodes itself,
        where it applies and fits, else :func:`packed_weights`), or None."""
        if self._packed is False:
            p = None
            if self.fp8 and self.b_layout == "nt" and self.b_data.dtype != FP8:
                p = packed_fp4_weights(self.b_data, self.b_sf, self.gb, self.n, self.k)
            if p is None:
                src = self._dequantized() if self.fp8 else self.b_t
                b_nk = src if self.fp8 or self.b_layout == "nt" else src.transpose(-1, -2)
                # keyed like the dequantized copy it is packed from: the same data and scales read at
                # another granularity are other weights
                tag = (self.b_layout, *self.gb) if self.fp8 else self.b_layout
                p = packed_weights(b_nk, (self.b_data, self.b_sf) if self.fp8 else (src,), tag)
            self._packed = p
        return self._packed

    def mm(self, x: torch.Tensor, g: int) -> torch.Tensor:
        """bf16 ``x @ B[g]^T`` (``x`` from :meth:`rows`), float32 accumulation, on prepacked weights
        where available (:func:`packed_weights`)."""
        return mm_group(x, self.weight_t(g), self.packed(), g)

    def rows(self, a_data, a_sf=None) -> torch.Tensor:
        """A's rows ``a_data [m, K]`` (with their scales ``a_sf`` for FP8) as GEMM input: bf16 where the
        dequantized values are exact in bf16 (power-of-two scales), else float32."""
        if not self.fp8:
            return a_data
        gran = self.ga[1]
        if (a_data.dim() == 2 and a_sf.dtype in UE8M0_INT_DTYPES and self.k % gran == 0
                and a_sf.dim() == 2 and a_sf.size(0) == a_data.size(0)):
            groups = self.k // gran
            e = row_major(a_sf).view(torch.uint8)
            # e4m3 values are multiples of 2**-9 up to 448: times 2**(e - 127) they are exact bf16 values
            # (subnormal ones multiples of 2**-133) for e in [3, 246], so the per-token cast back (the native
            # kernel where built) gives the bf16 operand directly, without the float32 round trip
            e = e[:, :groups] if e.size(1) >= groups else e[:0]
            if e.numel() and 3 <= int(e.min()) and int(e.max()) <= 246:
                return per_token_cast_back(a_data, a_sf, gran, BF16)
        return to_exact_bf16(dequantize_operand(a_data, a_sf, 1, gran, "a"))
