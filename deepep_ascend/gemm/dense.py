"""DeepGEMM's dense GEMMs on CPU torch: ``bf16_gemm_{nt,nn,tn,tt}`` and ``fp8_fp4_gemm_{nt,nn,tn,tt}`` (aliases
``fp8_gemm_*``), one group of the grouped GEMMs' arithmetic (:mod:`.operands`).

``d`` (bf16 or float32, any strides) is written in place; ``c`` (float32 or None) is DeepGEMM's accumulate
input, added in float32. ``compiled_dims`` and ``disable_ue8m0_cast`` are accepted for API parity and do not
change results. Bad shapes, dtypes or layouts raise ``ValueError``/``TypeError`` naming the argument.
"""

from __future__ import annotations

import torch

from .arguments import check_apart, check_operand, check_out, check_pair
from .dequant import dequantize_operand, dequantize_weights, to_exact_bf16
from .operands import k_of, resolve_grans
from .packing import matmul_bf16_out

__all__ = [
    "bf16_gemm_nn",
    "bf16_gemm_nt",
    "bf16_gemm_tn",
    "bf16_gemm_tt",
    "fp8_fp4_gemm_nn",
    "fp8_fp4_gemm_nt",
    "fp8_fp4_gemm_tn",
    "fp8_fp4_gemm_tt",
    "fp8_gemm_nn",
    "fp8_gemm_nt",
    "fp8_gemm_tn",
    "fp8_gemm_tt",
]

BF16 = torch.bfloat16
FP32 = torch.float32
FP8 = torch.float8_e4m3fn


def _dense_out(x, w_t, d, c):
    m, n = x.size(0), w_t.size(1)
    check_out(d, (m, n), (BF16, FP32))
    check_apart(d, ("a", x), ("b", w_t))
    if c is not None:
        check_operand("c", c, (FP32,))
        if tuple(c.shape) != (m, n):
            raise ValueError(f"c must have shape {(m, n)}, got {tuple(c.shape)}")
    if d.dtype == BF16 and c is None:
        d.copy_(matmul_bf16_out(x, w_t))
        return
    acc = torch.matmul(x.float(), w_t.float())
    d.copy_(acc if c is None else c + acc)


def _bf16_dense(a, b, d, c, layout):
    check_operand("a", a, (BF16,), 2)
    check_operand("b", b, (BF16,), 2)
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
    a_data, a_sf = check_pair("a", a)
    b_data, b_sf = check_pair("b", b)
    if a_data.dim() != 2 or b_data.dim() != 2:
        raise ValueError("a[0] and b[0] must be 2-D")
    # logical K-major views [M, K] / [N, K]; scales are logical [MN, K-groups]
    a_km = a_data if layout[0] == "n" else a_data.t()
    b_km = b_data if layout[1] == "t" else b_data.t()
    if layout != "nt" and (a_data.dtype != FP8 or b_data.dtype != FP8):
        raise TypeError(
            "packed FP4 operands are only supported K-major (the nt layout)"
        )
    k = k_of(a_km)
    if k_of(b_km) != k:
        raise ValueError(f"K mismatch: a has K={k}, b has K={k_of(b_km)}")
    ga, gb = resolve_grans(
        (a_km, a_sf), (b_km, b_sf), recipe, recipe_a, recipe_b, k, b_km.size(0), 2
    )
    x = to_exact_bf16(dequantize_operand(a_km, a_sf, ga[0], ga[1], "a"))
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
    Operands are ``(data, sf)`` pairs, dequantized first (:mod:`deepep_ascend.gemm.operands`: "Math",
    "Scale factors"; ``recipe``/``recipe_a``/``recipe_b`` as there); packed FP4 ``b`` (int8, two e2m1
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
    Operands are ``(data, sf)`` pairs, dequantized first (:mod:`deepep_ascend.gemm.operands`: "Math",
    "Scale factors"; ``recipe``/``recipe_a``/``recipe_b`` as there); packed FP4 ``b`` (int8, two e2m1
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
    Operands are ``(data, sf)`` pairs, dequantized first (:mod:`deepep_ascend.gemm.operands`: "Math",
    "Scale factors"; ``recipe``/``recipe_a``/``recipe_b`` as there); packed FP4 ``b`` (int8, two e2m1
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
    Operands are ``(data, sf)`` pairs, dequantized first (:mod:`deepep_ascend.gemm.operands`: "Math",
    "Scale factors"; ``recipe``/``recipe_a``/``recipe_b`` as there); packed FP4 ``b`` (int8, two e2m1
    nibbles per byte) only in the ``nt`` layout. ``d`` bf16 or float32 ``[M, N]``, written in place;
    ``c`` float32 or None. ``compiled_dims`` and ``disable_ue8m0_cast`` change nothing. Raises
    ``TypeError``/``ValueError`` naming the argument (dtypes, shapes, scale shapes, recipe)."""
    _fp8_dense(a, b, d, c, "tt", recipe, recipe_a, recipe_b)


fp8_gemm_nt = fp8_fp4_gemm_nt
fp8_gemm_nn = fp8_fp4_gemm_nn
fp8_gemm_tn = fp8_fp4_gemm_tn
fp8_gemm_tt = fp8_fp4_gemm_tt
