"""The data plane's row kernels: combine's row sum in one pass (``csrc/sum_rows.c``), the low-latency paths'
row moves straight into place and weighted row sum (``csrc/ll_rows.c``), and MegaMoE's elementwise stages,
FP8 row decode and SwiGLU with its FP8 round trip (``csrc/moe_act.c``).

Each wrapper checks its operands, returns False where the library is not loaded (the caller then takes
its torch path, which gives the same bits, NaN payloads aside) and otherwise writes its output in place.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from .. import settings
from .loader import kernels
from .operands import mark_written, matrix_ok, require_matrix, require_rows_apart

__all__ = ["NAN_BITS", "ROW_SUMS_MODES", "copy_rows", "dequant_rows_e4m3", "row_sums_avx2", "sum_rows", "swiglu",
           "weighted_sum_rows", "zero_rows"]

#: The NaN that torch's vectorized float32 -> bfloat16 cast writes (its scalar cast of a 0-d tensor may
#: write another, and copies keep a NaN's payload): the kernels write this one for every NaN sum.
NAN_BITS = int(torch.full((64,), float("nan"), dtype=torch.float32).to(torch.bfloat16).view(torch.int16)[0]) & 0xFFFF


#: :func:`row_sums_avx2`'s modes, in the kernel's numbering (``DEEPEP_ASCEND_ROW_SUMS`` spells them).
ROW_SUMS_MODES = {"portable": 0, "avx2": 1, "auto": 2}


def row_sums_avx2(mode: bool | str | None = None) -> bool:
    """Whether the row sums of :func:`sum_rows`, :func:`weighted_sum_rows` and the low-latency combine's receive run
    the register-blocked AVX2 loop (``csrc/sum_rows.c``: each output row's float32 sum in eight AVX2 registers, 64
    columns at a time) instead of the portable one (a float32 row in memory that every input row reads and writes
    again, vectorised by the compiler). Both give the same bits.

    Args:
        mode: None leaves it; ``"portable"`` or False turns the AVX2 loop off; ``"avx2"`` or True on where the CPU
            has AVX2; ``"auto"`` back to the default: on where the CPU has AVX2 but not AVX-512BW (those hosts keep
            the compiler's AVX-512 clone of the portable loop, which the AVX2 loop was not measured against).
    Returns:
        Whether the AVX2 loop runs after the call; False where the library is not loaded.
    Raises:
        ValueError: another ``mode`` (nothing changed).
    """
    if mode is None:
        code = -1
    elif isinstance(mode, bool):
        code = int(mode)
    elif isinstance(mode, str) and mode in ROW_SUMS_MODES:
        code = ROW_SUMS_MODES[mode]
    else:
        raise ValueError(f"deepep_ascend.native.row_sums_avx2: mode must be None, a bool or one of "
                         f"{', '.join(ROW_SUMS_MODES)}, got {mode!r}")
    fn = kernels.row_sums_avx2
    return False if fn is None else bool(fn(code))


def _row_numbers(name: str, rows: torch.Tensor, op: str = "copy_rows") -> int:
    """Check ``rows``, a 1-D contiguous int64 tensor (the kernel checks its values); returns its length."""
    if not (isinstance(rows, torch.Tensor) and rows.dim() == 1 and rows.dtype == torch.int64
            and rows.device.type == "cpu" and (rows.stride(0) == 1 or rows.numel() <= 1)):
        raise ValueError(f"deepep_ascend.native.{op}: {name} must be a contiguous 1-D int64 CPU tensor, "
                         f"got {getattr(rows, 'dtype', type(rows).__name__)} of shape "
                         f"{tuple(getattr(rows, 'shape', ()))}")
    return rows.numel()


def _out_of_range(op: str, name: str, values: torch.Tensor, lo_ok: int, limit: int) -> ValueError | None:
    """The error for ``values`` outside ``[lo_ok, limit)`` (the kernels refuse such operands, writing nothing;
    this names the range for the message), or None."""
    if not values.numel():
        return None
    lo, hi = (int(v) for v in torch.aminmax(values))
    if lo < lo_ok or hi >= limit:
        return ValueError(f"deepep_ascend.native.{op}: {name} must be in [{lo_ok}, {limit}), got [{lo}, {hi}]")
    return None


def copy_rows(dst: torch.Tensor, dst_rows: torch.Tensor | None, src: torch.Tensor,
              src_rows: torch.Tensor | None) -> bool:
    """``dst[dst_rows[i]] = src[src_rows[i]]`` for every ``i``, one ``memcpy`` per row, no temporary.

    What ``dst.index_copy_(0, dst_rows, src.index_select(0, src_rows))`` computes (the callers' torch
    path; the same bytes), in one pass instead of two. No DeepEP call of its own: the row moves inside
    its low-latency kernels.

    Args:
        dst, src: 2-D CPU tensors of one dtype and one column count, unit column stride (any row
            stride); their memory must not overlap, nor may two of ``dst_rows`` repeat.
        dst_rows, src_rows: 1-D contiguous int64 row numbers of equal length, or None for ``0..n-1``
            (not both None).
    Returns:
        True when done; False (nothing written) if the kernel is unavailable or ``dst``/``src`` are not
        such matrices.
    Raises:
        ValueError: both row numbers None, row numbers of another dtype, shape or length, or outside the
            matrices; ``dst``'s rows overlapping (nothing written).
    """
    if kernels.copy_rows is None or not (matrix_ok(dst) and matrix_ok(src)) or dst.dtype != src.dtype \
            or dst.size(1) != src.size(1):
        return False
    if dst_rows is None and src_rows is None:
        raise ValueError("deepep_ascend.native.copy_rows: dst_rows and src_rows cannot both be None")
    require_rows_apart("dst", dst, "copy_rows")
    n_dst = None if dst_rows is None else _row_numbers("dst_rows", dst_rows)
    n_src = None if src_rows is None else _row_numbers("src_rows", src_rows)
    n = n_dst if n_dst is not None else n_src
    if (n_src if n_src is not None else n) != n:
        raise ValueError(f"deepep_ascend.native.copy_rows: dst_rows has {n_dst} entries, src_rows {n_src}")
    for name, rows, t in (("dst", dst_rows, dst), ("src", src_rows, src)):
        if rows is None and n > t.size(0):
            raise ValueError(f"deepep_ascend.native.copy_rows: {n} rows, but {name} has {t.size(0)}")
    if n:
        e = dst.element_size()
        if kernels.copy_rows(n, dst.size(1) * e, dst.data_ptr(), dst.stride(0) * e,
                             None if dst_rows is None else dst_rows.data_ptr(), dst.size(0), src.data_ptr(),
                             src.stride(0) * e, None if src_rows is None else src_rows.data_ptr(), src.size(0)):
            raise next(err for name, rows, t in (("dst_rows", dst_rows, dst), ("src_rows", src_rows, src))
                       if rows is not None and (err := _out_of_range("copy_rows", name, rows, 0, t.size(0))))
        mark_written(dst)
    return True


def zero_rows(dst: torch.Tensor, rows: torch.Tensor | None) -> bool:
    """``dst[rows[i]] = 0`` for every ``i`` (``rows`` None: every row of ``dst``), rows of 1 KiB and more by
    streaming stores (whole cache lines written to memory without being read first; adjacent rows as one
    run), shorter ones by ``memset``.

    What ``dst.index_fill_(0, rows, 0)`` computes (the callers' torch path; the same bytes), at about half
    the memory traffic for rows the caller does not read back at once (an expanded layout's padding). No
    DeepEP call of its own: ``do_zero_padding``'s zeroing.

    Args:
        dst: 2-D CPU tensor, unit column stride (any row stride, any dtype); rows apart.
        rows: 1-D contiguous int64 row numbers in ``[0, dst.size(0))`` (repeats allowed), or None.
    Returns:
        True when done; False (nothing written) if the kernel is unavailable or ``dst`` is not such a matrix.
    Raises:
        ValueError: row numbers of another dtype or shape, or outside ``dst``; ``dst``'s rows overlapping
            (nothing written).
    """
    if kernels.zero_rows is None or not matrix_ok(dst):
        return False
    require_rows_apart("dst", dst, "zero_rows")
    n = dst.size(0) if rows is None else _row_numbers("rows", rows, "zero_rows")
    if n:
        e = dst.element_size()
        if kernels.zero_rows(n, dst.size(1) * e, dst.data_ptr(), dst.stride(0) * e,
                             None if rows is None else rows.data_ptr(), dst.size(0)):
            raise _out_of_range("zero_rows", "rows", rows, 0, dst.size(0))
        mark_written(dst)
    return True


def weighted_sum_rows(out: torch.Tensor, rows: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> bool:
    """``out[t] = bf16(Σ_j f32(rows[index[t, j]]) * weights[t, j])`` over the slots ``j`` with ``index[t, j] >= 0``,
    in slot order from ``+0.0``, each product rounded to float32 before its add, one rounding.

    The reduction of DeepEP's ``Buffer.low_latency_combine`` (docs/semantics/deepep-api.md §6.3), reading
    the returned rows where they lie; the bits of its torch path (NaN payloads aside).

    Args:
        out: ``[n, H]`` bfloat16, unit column stride (any row stride), rows apart.
        rows: ``[R, H]`` bfloat16, unit column stride.
        index: ``[n, k]`` contiguous int64, values in ``[-1, R)`` (-1: slot left out).
        weights: ``[n, k]`` contiguous float32.
    Returns:
        True when done; False (nothing written) if the kernel is unavailable or ``out``/``rows`` are not
        such matrices.
    Raises:
        ValueError: ``index`` or ``weights`` of another dtype or shape, not contiguous, or ``index``
            outside ``[-1, R)``; ``out``'s rows overlapping (nothing written).
    """
    fn = kernels.weighted_sum_rows_bf16
    if fn is None or not (matrix_ok(out, torch.bfloat16) and matrix_ok(rows, torch.bfloat16, out.size(1))):
        return False
    n, hidden = out.shape
    require_rows_apart("out", out, "weighted_sum_rows")
    for name, t, dtype in (("index", index, torch.int64), ("weights", weights, torch.float32)):
        if not (isinstance(t, torch.Tensor) and t.dim() == 2 and t.size(0) == n and t.dtype == dtype
                and t.is_contiguous() and t.device.type == "cpu"):
            raise ValueError(f"deepep_ascend.native.weighted_sum_rows: {name} must be a contiguous [{n}, k] {dtype} "
                             f"CPU tensor, got {getattr(t, 'dtype', type(t).__name__)} of shape "
                             f"{tuple(getattr(t, 'shape', ()))}")
    if index.shape != weights.shape:
        raise ValueError(f"deepep_ascend.native.weighted_sum_rows: index {tuple(index.shape)} and weights "
                         f"{tuple(weights.shape)} differ")
    if n and hidden:
        if fn(n, hidden, index.size(1), rows.data_ptr(), rows.stride(0), rows.size(0), index.data_ptr(),
              weights.data_ptr(), out.data_ptr(), out.stride(0), NAN_BITS):
            raise _out_of_range("weighted_sum_rows", "index", index, -1, rows.size(0))
        mark_written(out)
    elif (err := _out_of_range("weighted_sum_rows", "index", index, -1, rows.size(0))) is not None:
        raise err  # (nothing to compute: the values are still checked)
    return True


def sum_rows(out: torch.Tensor, sources, bias=None, bias_offset: int = 0, keys=None) -> bool:
    """``out[t] = bf16(start(t) + Σ_sources Σ_{i: tokens[i] == t} f32(rows[i]))``, one rounding.

    The reduction inside DeepEP's ``Buffer.combine`` kernels (float32 accumulation from the bias,
    ascending source rank, one round-to-nearest-even to BF16); no public DeepEP call of its own.

    Args:
        out: ``[m, H]`` bfloat16, rows of unit stride (any row stride).
        sources: ``(rows [R, H] bf16, tokens [cnt] int64[, index [cnt] int64])``, added in this
            order; ``tokens`` ascending in ``[0, m)`` (a token may repeat: its rows add in row order);
            row ``i`` of a source is ``rows[i]`` (``R >= cnt``), or ``rows[index[i]]`` if ``index`` is
            given (a gather without a copy; values in ``[0, R)``).
        keys: None (each token's rows add in source order), or per source ``None`` or ``[cnt]``
            int64 sort keys: each token's rows then add in ascending key, ties in source order
            (``EPBuffer.combine``'s order, docs/semantics/deepep-api.md §13.5).
        bias: None (``start = +0.0``) or a pair ``(bias0 | None, bias1 | None)`` of
            ``[>= bias_offset + m, H]`` bf16: ``start(t) = f32(bias0[bias_offset + t]) +
            f32(bias1[...])``, a missing one +0.0. ``bias_offset >= 0``.
    Returns:
        True when done; False (nothing written) if the kernel is unavailable or an operand is not
        a CPU bf16 matrix with unit column stride.
    Raises:
        ValueError: ``out`` not 2-D or with overlapping rows, tokens or an index not a 1-D integer tensor,
            a source with fewer rows than tokens, an ``index`` of another length or with values outside
            ``[0, R)``, a negative ``bias_offset`` or bias fewer than ``bias_offset + m`` rows (nothing
            written); a source's tokens not ascending in ``[0, m)`` (``out`` then holds partial sums).
        MemoryError: the kernel ran out of memory for its per-token row list (rows from that token
            on are not written).
    """
    if kernels.sum_rows_bf16 is None:
        return False
    sources = list(sources)  # iterated more than once below
    if out.dim() != 2:
        raise ValueError(f"deepep_ascend.native.sum_rows: out must be [m, H], got shape {tuple(out.shape)}")
    m, hidden = out.shape
    b0, b1 = (None, None) if bias is None else (bias[0], bias[1])
    if b0 is None:  # f32(b1) + 0.0 == 0.0 + f32(b1): the one given bias goes first
        b0, b1 = b1, None
    if bias_offset < 0:
        raise ValueError(f"deepep_ascend.native.sum_rows: bias_offset must be >= 0, got {bias_offset}")
    if b0 is not None:
        b0 = b0[bias_offset:bias_offset + m]
    if b1 is not None:
        b1 = b1[bias_offset:bias_offset + m]
    operands = (out, b0, b1, *(src[0] for src in sources))
    if not all(t is None or matrix_ok(t, torch.bfloat16, hidden) for t in operands):
        return False
    require_rows_apart("out", out, "sum_rows")
    if (b0 is not None and b0.size(0) != m) or (b1 is not None and b1.size(0) != m):
        raise ValueError(f"deepep_ascend.native.sum_rows: bias rows [{bias_offset}, {bias_offset + m}) out of range")
    keys = [None] * len(sources) if keys is None else list(keys)
    if len(keys) != len(sources):
        raise ValueError(f"deepep_ascend.native.sum_rows: {len(keys)} key tensors for {len(sources)} sources")
    live = []  # (rows, tokens, index | None, key | None), int64 and contiguous
    for j, ((rows, tokens, *rest), key) in enumerate(zip(sources, keys)):
        if not tokens.numel():
            continue
        index = rest[0] if rest and rest[0] is not None else None
        if key is not None and key.shape != tokens.shape:
            raise ValueError(f"deepep_ascend.native.sum_rows: source {j}'s keys must have the shape of its tokens "
                             f"{tuple(tokens.shape)}, got {tuple(key.shape)}")
        for name, t in (("tokens", tokens), ("index", index), ("keys", key)):
            if t is not None and (t.dim() != 1 or t.dtype not in (torch.int64, torch.int32)):
                raise ValueError(f"deepep_ascend.native.sum_rows: source {j}'s {name} must be a 1-D int64 or "
                                 f"int32 tensor, got {t.dtype} of shape {tuple(t.shape)}")
        tokens = tokens.to(torch.int64).contiguous()
        index = None if index is None else index.to(torch.int64).contiguous()
        key = None if key is None else key.to(torch.int64).contiguous()
        if index is None and rows.size(0) < tokens.numel():
            raise ValueError(f"deepep_ascend.native.sum_rows: source {j} has {rows.size(0)} rows for "
                             f"{tokens.numel()} tokens (one row per token)")
        if index is not None and (index.shape != tokens.shape or int(index.min()) < 0
                                  or int(index.max()) >= rows.size(0)):
            got = f"[{int(index.min())}, {int(index.max())}]" if index.numel() else "none"
            raise ValueError(f"deepep_ascend.native.sum_rows: source {j}'s index must be {tokens.numel()} "
                             f"row numbers in [0, {rows.size(0)}), got shape {tuple(index.shape)} with values "
                             f"in {got}")
        live.append((rows, tokens, index, key))
    # The kernel's per-source arrays, one int64 row each: token pointers, counts, row pointers, row
    # strides, index pointers, key pointers (0: none).
    # (numpy: a few small host arrays, several torch operator calls cheaper to build there)
    meta = np.array([[tokens.data_ptr(), tokens.numel(), rows.data_ptr(), rows.stride(0),
                      0 if index is None else index.data_ptr(), 0 if key is None else key.data_ptr()]
                     for rows, tokens, index, key in live], dtype=np.int64).reshape(-1, 6).T.copy()
    base, step = meta.ctypes.data, meta.strides[0]  # (each .ctypes access builds an object: about 1 µs)
    tok_ptr, counts, row_ptr, row_ld, index_ptr, key_ptr = (base + i * step for i in range(6))
    any_index = any(index is not None for _, _, index, _ in live)
    any_key = any(key is not None for _, _, _, key in live)
    status = kernels.sum_rows_bf16(m, hidden, len(live), tok_ptr, counts, row_ptr, row_ld,
                                   index_ptr if any_index else None, key_ptr if any_key else None,
                                   None if b0 is None else b0.data_ptr(), 0 if b0 is None else b0.stride(0),
                                   None if b1 is None else b1.data_ptr(), 0 if b1 is None else b1.stride(0),
                                   out.data_ptr(), out.stride(0), NAN_BITS)
    if status == -1:
        raise MemoryError("deepep_ascend.native.sum_rows: the kernel ran out of memory for its row lists")
    if status:
        raise ValueError(f"deepep_ascend.native.sum_rows: source {status - 1}'s tokens are not ascending "
                         f"in [0, {m})")
    mark_written(out)
    return True


_TABLES = []  # e4m3 code -> float32, UE8M0 byte -> float32 scale: built on first use


def _decode_tables() -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's lookup tables, from the formats' definitions (docs/semantics/mega-moe.md §4): an e4m3
    code's value is torch's own ``float8_e4m3fn`` cast (NaN codes included); UE8M0 byte ``b`` is
    ``2**(b - 127)``, byte 0 the subnormal ``2**-127`` and byte 255 NaN."""
    if not _TABLES:
        codes = torch.arange(256, dtype=torch.int32)
        e4m3 = codes.to(torch.uint8).view(torch.float8_e4m3fn).float()
        scale = (codes << 23).view(torch.float32).clone()
        scale[0], scale[255] = 2.0 ** -127, float("nan")
        _TABLES.extend((e4m3, scale))
    return _TABLES[0], _TABLES[1]


def dequant_rows_e4m3(out: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                      index: torch.Tensor | None = None, gran: int = 32) -> bool:
    """``out[r] = bf16(e4m3(codes[i]) * 2^(scales[i] - 127))`` per ``gran``-column group, ``i = index[r]``.

    Gather and decode in one pass: what ``per_token_cast_back(codes[index], scales[index], gran,
    torch.bfloat16)`` gives, bit for bit (NaN payloads aside) -- DeepEP's ``per_token_cast_back`` test
    helper on received FP8 rows with UE8M0 scale bytes (no DeepEP call of its own).

    Args:
        out: ``[n, H]`` bfloat16, unit column stride, rows not overlapping (nor the inputs); ``H % gran == 0``.
        codes: ``[R, H]`` float8_e4m3fn (or its uint8/int8 bytes), unit column stride.
        scales: ``[R, H / gran]`` uint8 UE8M0 bytes, unit column stride.
        index: None (row ``r``, ``R >= n``) or ``[n]`` int64 row numbers in ``[0, R)``.
    Returns:
        True when done, False (nothing written) if the kernel is unavailable.
    Raises:
        ValueError: operands of another dtype, shape or layout, or ``index`` values out of range.
    """
    if kernels.dequant_rows_e4m3_bf16 is None:
        return False
    op = "dequant_rows_e4m3"
    if not isinstance(gran, int) or isinstance(gran, bool) or gran < 1 or out.dim() != 2 or out.size(1) % gran:
        raise ValueError(f"deepep_ascend.native.{op}: gran must be a positive int dividing out's columns, got "
                         f"gran {gran!r} for out of shape {tuple(out.shape)}")
    n, hidden = out.shape
    require_matrix("out", out, torch.bfloat16, hidden, op)
    require_rows_apart("out", out, op)
    if isinstance(codes, torch.Tensor) and codes.dtype in (torch.float8_e4m3fn, torch.int8):
        codes = codes.view(torch.uint8)
    require_matrix("codes", codes, torch.uint8, hidden, op)
    require_matrix("scales", scales, torch.uint8, hidden // gran, op)
    rows = min(codes.size(0), scales.size(0))
    if index is None:
        if rows < n:
            raise ValueError(f"deepep_ascend.native.{op}: codes/scales have {codes.size(0)}/{scales.size(0)} rows "
                             f"for {n} output rows")
    else:
        if index.dim() != 1 or index.dtype != torch.int64 or index.numel() != n:
            raise ValueError(f"deepep_ascend.native.{op}: index must be [{n}] int64, got {index.dtype} of shape "
                             f"{tuple(index.shape)}")
        if n and (int(index.min()) < 0 or int(index.max()) >= rows):
            raise ValueError(f"deepep_ascend.native.{op}: index values must lie in [0, {rows}), got "
                             f"[{int(index.min())}, {int(index.max())}]")
        index = index.contiguous()
    if not n or not hidden:
        return True
    e4m3, sf = _decode_tables()
    kernels.dequant_rows_e4m3_bf16(n, hidden, gran, codes.data_ptr(), codes.stride(0), scales.data_ptr(),
                                   scales.stride(0), None if index is None else index.data_ptr(), e4m3.data_ptr(),
                                   sf.data_ptr(), out.data_ptr(), out.stride(0), NAN_BITS)
    mark_written(out)
    return True


_SWIGLU_BLOCK_FLOATS = 1 << 17  # floats of -g per block (512 KiB): exp_ and the kernel's second pass find it in L2


def swiglu(out: torch.Tensor, h: torch.Tensor, weights: torch.Tensor | None = None, clamp: float | None = None,
           fast_math: bool = True, gran: int = 0, *, alpha: float = 1.0, up_bias: float | None = None) -> bool:
    """MegaMoE's activation, one BF16 row of ``out`` per row of ``h``, bit for bit the torch path of
    :func:`deepep_ascend.mega_moe.experts.activation` (NaN payloads aside)::

        g, u = h[:, :I], h[:, I:]  (clamped to <= clamp and to [-clamp, clamp] if clamp is not None)
        s = g * sigmoid(alpha * g)  in float32: g / (1 + exp(-(alpha g))), or (1 / (1 + exp(-(alpha g)))) * g
                                    if fast_math (alpha = 1: silu)
        a = s * v * weights[:, None]   v = u + up_bias (swigluoai), or u if up_bias is None (plain SwiGLU)
        gran > 0: a = e4m3 round trip of a with UE8M0 scales per gran columns
        out = bf16(a)

    The exp is torch's (``Tensor.exp_`` on a float32 block of ``-(alpha g)``), so both paths compute the
    same sigmoid; the kernel does the rest in one pass. DeepGEMM's MegaMoE SwiGLU epilogue with
    ``activation_clamp`` (and, for ``activation='swigluoai'``, ``activation_alpha`` /
    ``activation_up_bias``, DeepGEMM PR #445) and its FP8 cast of the L2 input (no DeepGEMM call of its own).

    Args:
        out: ``[n, I]`` bfloat16, unit column stride, rows not overlapping (nor ``h``).
        h: ``[n, 2 I]`` bfloat16, unit column stride.
        weights: None (1) or ``[n]`` float32, the routing weight of each row.
        clamp: None, or the clamp as a float >= 0 (the caller rounds it as its reference does).
        gran: 0 (no FP8 round trip) or a positive int <= 256 dividing ``I``.
        alpha: keyword-only, the sigmoid's scale, a finite float (used as float32; 1 for plain SwiGLU).
        up_bias: keyword-only, None (plain SwiGLU: ``u`` as it is) or a finite float added to ``u`` in
            float32 (swigluoai).
    Returns:
        True when done; False if the kernel is unavailable or a ``gran`` group holds a NaN, an
        infinity or a value of magnitude ``2**100`` or more (``out`` then partly written: use the
        codecs).
    Raises:
        ValueError: operands of another dtype, shape or layout, a negative or NaN ``clamp``, a bad ``gran``,
            or a non-finite ``alpha`` / ``up_bias``.
    """
    if kernels.swiglu_bf16 is None:
        return False
    op = "swiglu"
    if out.dim() != 2:
        raise ValueError(f"deepep_ascend.native.{op}: out must be [n, I], got shape {tuple(out.shape)}")
    n, inter = out.shape
    require_matrix("out", out, torch.bfloat16, inter, op)
    require_rows_apart("out", out, op)
    require_matrix("h", h, torch.bfloat16, 2 * inter, op)
    if h.size(0) != n:
        raise ValueError(f"deepep_ascend.native.{op}: h has {h.size(0)} rows, out {n}")
    if weights is not None and (weights.dtype != torch.float32 or weights.dim() != 1 or weights.numel() != n):
        raise ValueError(f"deepep_ascend.native.{op}: weights must be None or [{n}] float32, got {weights.dtype} of "
                         f"shape {tuple(weights.shape)}")
    if not isinstance(gran, int) or isinstance(gran, bool) or gran < 0 or gran > 256 or (gran and inter % gran):
        raise ValueError(f"deepep_ascend.native.{op}: gran must be 0 or an int in [1, 256] dividing I = {inter}, "
                         f"got {gran!r}")
    if clamp is not None and not float(clamp) >= 0:
        raise ValueError(f"deepep_ascend.native.{op}: clamp must be None or a number >= 0, got {clamp!r}")
    for name, v in (("alpha", alpha), ("up_bias", 0.0 if up_bias is None else up_bias)):
        if not math.isfinite(float(v)):
            raise ValueError(f"deepep_ascend.native.{op}: {name} must be a finite number, got {v!r}")
    if not n or not inter:
        return True
    if weights is not None:
        weights = weights.contiguous()
    has_clamp = clamp is not None
    c = float(clamp) if has_clamp else 0.0
    gate, kernel = kernels.swiglu_gate_bf16, kernels.swiglu_bf16
    block = min(n, max(1, _SWIGLU_BLOCK_FLOATS // inter))
    t = torch.empty(block, inter, dtype=torch.float32)
    for r0 in range(0, n, block):
        b = min(block, n - r0)
        tb, hb = t[:b], h[r0:r0 + b]
        gate(b, inter, hb.data_ptr(), hb.stride(0), has_clamp, c, float(alpha), tb.data_ptr())
        tb.exp_()
        ob = out[r0:r0 + b]
        if kernel(b, inter, hb.data_ptr(), hb.stride(0), tb.data_ptr(),
                  None if weights is None else weights[r0:].data_ptr(), has_clamp, c, int(bool(fast_math)),
                  up_bias is not None, 0.0 if up_bias is None else float(up_bias), gran, ob.data_ptr(),
                  ob.stride(0), NAN_BITS):
            mark_written(out)
            return False
    mark_written(out)
    return True


def _row_sums_from_settings() -> None:
    """The row sums' loop from ``DEEPEP_ASCEND_ROW_SUMS``, once, when this module loads.

    Raises:
        deepep_ascend.settings.SettingError: the variable holds a bad value.
    """
    row_sums_avx2(settings.ROW_SUMS.get())


_row_sums_from_settings()
