"""DeepGEMM's grouped GEMMs on CPU torch (docs/semantics/mega-moe.md §3): m-grouped (contiguous and masked, the MoE
forward) and k-grouped (weight gradients), bf16 and FP8/FP4.

How operands are read (the arithmetic, FP8/FP4 dequantization, scale granularities ``recipe``) is
:mod:`.operands`; the weights the m-grouped products pack once, :mod:`.packing`.

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

from .arguments import check_apart, check_operand, check_out, check_pair, int_list
from .operands import GroupedOperands
from .packing import amx_runs
from .scales import align, ceil_div

__all__ = [
    "bf16_m_grouped_gemm_nt_masked",
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
FP8 = torch.float8_e4m3fn


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
    ops: GroupedOperands, d, grouped_layout, use_psum_layout, ensure_zero_padding
):
    m = ops.a_t.size(0)
    if ops.a_t.dim() != 2:
        raise ValueError(f"a must be 2-D [M, K], got shape {tuple(ops.a_t.shape)}")
    check_out(d, (m, ops.n))
    check_apart(d, ("a", ops.a_t), ("b", ops.b_t))
    if use_psum_layout:
        layout = int_list("grouped_layout", grouped_layout, ops.g)
    else:
        layout = int_list("grouped_layout", grouped_layout, m)
    runs, zero = _contiguous_runs(layout, m, ops.g, use_psum_layout)
    if ops.fp8 and ops.a_sf.size(0) != m:
        raise ValueError(
            f"a[1] (sf) must have {m} rows, got shape {tuple(ops.a_sf.shape)}"
        )
    if not (runs and amx_runs(ops.packed(), d, lambda: ops.rows(ops.a_t, ops.a_sf if ops.fp8 else None), runs)):
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
    ops = GroupedOperands(a, b, "bf16", "nt")
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
    ops = GroupedOperands(a, b, "bf16", "nn")
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
    ``recipe_a`` / ``recipe_b`` or are inferred (:mod:`.operands`, "Scale factors"); the layout
    arguments are those of :func:`m_grouped_bf16_gemm_nt_contiguous`. ``compiled_dims``,
    ``disable_ue8m0_cast`` and ``expected_m_for_psum_layout`` change nothing. Raises ``TypeError``
    (dtypes, an operand that is not a ``(data, sf)`` pair) or ``ValueError`` (shapes, scale shapes
    that fit no granularity, a bad recipe or layout) naming the argument, before ``d`` is written."""
    ops = GroupedOperands(a, b, "fp8", "nt", recipe, recipe_a, recipe_b)
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
    ops = GroupedOperands(a, b, "fp8", "nn", recipe, recipe_a, recipe_b)
    _m_grouped_contiguous(ops, d, grouped_layout, use_psum_layout, ensure_zero_padding)


m_grouped_fp8_gemm_nt_contiguous = m_grouped_fp8_fp4_gemm_nt_contiguous
m_grouped_fp8_gemm_nn_contiguous = m_grouped_fp8_fp4_gemm_nn_contiguous


def _rows_of_groups(t: torch.Tensor) -> torch.Tensor | None:
    """``t [G, Mmax, C]`` as a ``[G·Mmax, C]`` view, or None where its strides do not allow one."""
    try:
        return t.view(-1, t.size(-1))
    except RuntimeError:
        return None


def _masked_rows(ops: GroupedOperands, runs: list):
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


def _m_grouped_masked(ops: GroupedOperands, d, masked_m, expected_m):
    if ops.a_t.dim() != 3 or ops.a_t.size(0) != ops.g:
        raise ValueError(
            f"a must be [G={ops.g}, Mmax, K], got shape {tuple(ops.a_t.shape)}"
        )
    mmax = ops.a_t.size(1)
    check_out(d, (ops.g, mmax, ops.n))
    check_apart(d, ("a", ops.a_t), ("b", ops.b_t))
    counts = int_list("masked_m", masked_m, ops.g)
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
    if not (runs and flat is not None and amx_runs(ops.packed(), flat, lambda: _masked_rows(ops, runs), runs)):
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
    _m_grouped_masked(GroupedOperands(a, b, "bf16", "nt"), d, masked_m, expected_m)


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
    ops = GroupedOperands(a, b, "fp8", "nt", recipe, recipe_a, recipe_b)
    _m_grouped_masked(ops, d, masked_m, expected_m)


m_grouped_fp8_gemm_nt_masked = m_grouped_fp8_fp4_gemm_nt_masked
fp8_m_grouped_gemm_nt_masked = m_grouped_fp8_fp4_gemm_nt_masked
bf16_m_grouped_gemm_nt_masked = m_grouped_bf16_gemm_nt_masked


def _k_segments(
    ks_cpu, grouped_layout, use_psum_layout, total_k
) -> list[tuple[int, int]]:
    if grouped_layout is not None:
        layout = int_list("grouped_layout", grouped_layout)
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
    check_out(d, (g, m, n), (FP32,))
    if c is not None:
        check_operand("c", c, (FP32,))
        if tuple(c.shape) != (g, m, n):
            raise ValueError(f"c must have shape {(g, m, n)}, got {tuple(c.shape)}")
    for i, (s, e) in enumerate(segs):  # every group checked before any d[i] is written
        if gran_k is not None and (s % gran_k or (e - s) % gran_k):
            raise ValueError(
                f"group {i}'s K segment [{s}, {e}) is not a multiple of gran_k={gran_k}"
            )
    for i, (s, e) in enumerate(segs):
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
    check_operand("a", a, (BF16,), 2)
    check_operand("b", b, (BF16,), 2)
    if a.size(0) != b.size(0):
        raise ValueError(
            f"a and b must have the same ΣK rows, got {a.size(0)} and {b.size(0)}"
        )
    segs = _k_segments(ks_cpu, grouped_layout, use_psum_layout, a.size(0))
    _k_grouped(a, b, d, c, segs)


def _per_channel_deq(name, pair, gran_k, k_axis):
    data, sf = check_pair(name, pair)
    if data.dtype != FP8 or sf.dtype != FP32:
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
