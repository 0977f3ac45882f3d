"""The data plane's native kernels: combine's row sum in one pass (``csrc/sum_rows.c``), and MegaMoE's
elementwise stages, FP8 row decode and SwiGLU with its FP8 round trip (``csrc/moe_act.c``), and the groups
of an m-grouped BF16 GEMM on Intel AMX tiles (``csrc/amx_gemm.c``).

Built at install time as the optional extension ``deepep_ascend._native`` (``pyproject.toml``) and
loaded with :mod:`ctypes` (no Python headers needed; a ctypes call releases the GIL, so the
Buffer's worker sums while the caller computes). Where it was not built (no C compiler) or
``DEEPEP_ASCEND_NATIVE=0`` is set, :func:`available` is False, every function here returns False,
and the callers (:func:`deepep_ascend.ep.reduce.accumulate_rows`, :mod:`deepep_ascend.mega_moe`) use
their torch paths, which give the same bits (NaN payloads aside) -- except the grouped GEMMs, whose
oneDNN path sums in another order than the AMX kernel (same float32 accumulation; results agree to bf16
rounding).

Why C: combine sums each token's BF16 rows in float32 and rounds once (DeepEP's arithmetic).
torch has no gather-and-sum with BF16 inputs and a float32 accumulator (FBGEMM's BF16
``embedding_bag`` rounds half away from zero), so the torch paths convert rows to a float32
scratch first: about three passes over the rows where this kernel makes one
(``python -m bench combine-sum`` times both). MegaMoE's SwiGLU with its e4m3 round trip is about twenty
torch passes over float32 temporaries; the kernel makes one, after torch's own ``exp`` (so both paths
compute the same sigmoid). The grouped GEMMs multiply ~128 rows per expert, where oneDNN's kernels
(torch's CPU matmul; torch has no CPU grouped GEMM of its own) reach about half of what they reach on
one tall matrix; the AMX kernel keeps a group's rows in L2 while its weight streams past once and writes
into the caller's output (``python -m bench grouped-gemm`` times both). It also takes MXFP4 weights
(:class:`AmxFp4Weight`), decoding them into bf16 tiles panel by panel. It runs only where the CPU has
AMX-BF16 and Linux grants the process its tile state (:func:`amx_bf16`); elsewhere the grouped GEMMs
use oneDNN.
"""
from __future__ import annotations

import ctypes
import importlib.machinery
import operator
import os
import warnings

import torch

__all__ = ["AmxFp4Weight", "AmxWeight", "amx_bf16", "available", "dequant_rows_e4m3", "gemm_bf16_amx", "library_path",
           "sum_rows", "swiglu"]

_P = ctypes.c_void_p
_I64 = ctypes.c_int64


def library_path() -> str | None:
    """Path of the built kernel library next to this module, or None if it was not built."""
    here = os.path.dirname(os.path.abspath(__file__))
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = os.path.join(here, "_native" + suffix)
        if os.path.isfile(path):
            return path
    return None


_ABI = 5  # csrc/sum_rows.c's deepep_native_abi(): the signatures below


def _load():
    if os.environ.get("DEEPEP_ASCEND_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    path = library_path()
    if path is None:
        return None
    fns = None
    try:
        lib = ctypes.CDLL(path)
        lib.deepep_native_abi.restype = _I64
        abi = int(lib.deepep_native_abi())
        why = f"was built from an older source (ABI {abi}, this code needs {_ABI})"
        if abi == _ABI:  # an older library lacks some of these: its ABI number says so first
            fns = (lib.deepep_sum_rows_bf16, lib.deepep_dequant_rows_e4m3_bf16, lib.deepep_swiglu_gate_bf16,
                   lib.deepep_swiglu_bf16, lib.deepep_amx_bf16_available, lib.deepep_amx_packed_elems,
                   lib.deepep_amx_pack_bf16, lib.deepep_amx_gemm_bf16, lib.deepep_amx_fp4_packed_bytes,
                   lib.deepep_amx_pack_fp4)
    except (OSError, AttributeError) as exc:
        abi, why = None, f"cannot be loaded ({exc})"
    if fns is None:
        warnings.warn(f"deepep_ascend: the native kernel {path} {why}; using the torch paths. Rebuild it with "
                      f"`bash scripts/setup.sh` (or `pip install -e .`).", RuntimeWarning, stacklevel=2)
        return None
    sum_rows_fn, dequant, gate, swiglu_fn, amx_ok, packed_elems, pack, gemm, fp4_bytes, pack_fp4 = fns
    sum_rows_fn.restype = _I64
    sum_rows_fn.argtypes = [_I64, _I64, _I64, _P, _P, _P, _P, _P, _P, _I64, _P, _I64, _P, _I64, ctypes.c_uint16]
    dequant.restype = None
    dequant.argtypes = [_I64, _I64, _I64, _P, _I64, _P, _I64, _P, _P, _P, _P, _I64, ctypes.c_uint16]
    gate.restype = None
    gate.argtypes = [_I64, _I64, _P, _I64, _I64, ctypes.c_float, _P]
    swiglu_fn.restype = _I64
    swiglu_fn.argtypes = [_I64, _I64, _P, _I64, _P, _P, _I64, ctypes.c_float, _I64, _I64, _P, _I64, ctypes.c_uint16]
    amx_ok.restype = _I64
    amx_ok.argtypes = []
    packed_elems.restype = _I64
    packed_elems.argtypes = [_I64, _I64]
    pack.restype = None
    pack.argtypes = [_P, _P, _I64, _I64, _I64]
    gemm.restype = _I64
    gemm.argtypes = [_P, _I64, _P, _I64, _I64, _I64, _I64, _P, _P, _P, _I64]
    fp4_bytes.restype = _I64
    fp4_bytes.argtypes = [_I64, _I64]
    pack_fp4.restype = None
    pack_fp4.argtypes = [_P, _P, _I64, _P, _I64, _I64, _I64]
    return fns


_FNS = _load()
_SUM_ROWS, _DEQUANT, _GATE, _SWIGLU, _AMX_OK, _AMX_ELEMS, _AMX_PACK, _AMX_GEMM, _AMX_FP4_BYTES, _AMX_PACK_FP4 = (
    _FNS if _FNS is not None else (None,) * 10)
# The AMX kernel's CPU and OS checks (CPUID, XCR0, and Linux's per-process grant of the tile state) run once.
_AMX = bool(_AMX_OK is not None and _AMX_OK())
# The NaN that torch's vectorized float32 -> bfloat16 cast writes (its scalar cast of a 0-d tensor may
# write another, and copies keep a NaN's payload): the kernel writes this one for every NaN sum.
_NAN_BITS = int(torch.full((64,), float("nan")).to(torch.bfloat16).view(torch.int16)[0]) & 0xFFFF


def available() -> bool:
    """Whether the native kernels are loaded (built, and not disabled by ``DEEPEP_ASCEND_NATIVE=0``)."""
    return _SUM_ROWS is not None


def _matrix_ok(t, dtype: torch.dtype | None = None, cols: int | None = None) -> bool:
    """Whether the kernels take ``t`` as a matrix: a 2-D CPU tensor (of ``dtype`` and ``cols`` columns
    where given) with unit column stride. Callers with other operands use their torch paths."""
    return (isinstance(t, torch.Tensor) and t.dim() == 2 and t.device.type == "cpu"
            and (dtype is None or t.dtype == dtype) and (cols is None or t.size(1) == cols)
            and (t.stride(1) == 1 or t.size(1) <= 1))


def sum_rows(out: torch.Tensor, sources, bias=None, bias_offset: int = 0) -> bool:
    """``out[t] = bf16(start(t) + Σ_sources Σ_{i: tokens[i] == t} f32(rows[i]))``, one rounding.

    The reduction inside DeepEP's ``Buffer.combine`` kernels (float32 accumulation from the bias,
    ascending source rank, one round-to-nearest-even to BF16); no public DeepEP call of its own.

    Args:
        out: ``[m, H]`` bfloat16, rows of unit stride (any row stride).
        sources: ``(rows [R, H] bf16, tokens [cnt] int64[, index [cnt] int64])``, added in this
            order; ``tokens`` ascending in ``[0, m)`` (a token may repeat: its rows add in row order);
            row ``i`` of a source is ``rows[i]`` (``R >= cnt``), or ``rows[index[i]]`` if ``index`` is
            given (a gather without a copy; values in ``[0, R)``).
        bias: None (``start = +0.0``) or a pair ``(bias0 | None, bias1 | None)`` of
            ``[>= bias_offset + m, H]`` bf16: ``start(t) = f32(bias0[bias_offset + t]) +
            f32(bias1[...])``, a missing one +0.0. ``bias_offset >= 0``.
    Returns:
        True when done; False (nothing written) if the kernel is unavailable or an operand is not
        a CPU bf16 matrix with unit column stride.
    Raises:
        ValueError: ``out`` not 2-D or with overlapping rows, tokens or an index not a 1-D integer tensor, a source with fewer rows than
            tokens, an ``index`` of another length or with values outside ``[0, R)``, a negative
            ``bias_offset`` or bias fewer than ``bias_offset + m`` rows (nothing written); a
            source's tokens not ascending in ``[0, m)`` (``out`` then holds partial sums).
        MemoryError: the kernel ran out of memory for its per-token row list (rows from that token
            on are not written).
    """
    if _SUM_ROWS is None:
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
    if not all(t is None or _matrix_ok(t, torch.bfloat16, hidden) for t in operands):
        return False
    _rows_apart("out", out, "sum_rows")
    if (b0 is not None and b0.size(0) != m) or (b1 is not None and b1.size(0) != m):
        raise ValueError(f"deepep_ascend.native.sum_rows: bias rows [{bias_offset}, {bias_offset + m}) out of range")
    live = []  # (rows, tokens, index | None), int64 and contiguous
    for j, (rows, tokens, *rest) in enumerate(sources):
        if not tokens.numel():
            continue
        index = rest[0] if rest and rest[0] is not None else None
        for name, t in (("tokens", tokens), ("index", index)):
            if t is not None and (t.dim() != 1 or t.dtype not in (torch.int64, torch.int32)):
                raise ValueError(f"deepep_ascend.native.sum_rows: source {j}'s {name} must be a 1-D int64 or "
                                 f"int32 tensor, got {t.dtype} of shape {tuple(t.shape)}")
        tokens = tokens.to(torch.int64).contiguous()
        index = None if index is None else index.to(torch.int64).contiguous()
        if index is None and rows.size(0) < tokens.numel():
            raise ValueError(f"deepep_ascend.native.sum_rows: source {j} has {rows.size(0)} rows for "
                             f"{tokens.numel()} tokens (one row per token)")
        if index is not None and (index.shape != tokens.shape or int(index.min()) < 0
                                  or int(index.max()) >= rows.size(0)):
            got = f"[{int(index.min())}, {int(index.max())}]" if index.numel() else "none"
            raise ValueError(f"deepep_ascend.native.sum_rows: source {j}'s index must be {tokens.numel()} "
                             f"row numbers in [0, {rows.size(0)}), got shape {tuple(index.shape)} with values "
                             f"in {got}")
        live.append((rows, tokens, index))
    # The kernel's per-source arrays, one int64 row each: token pointers, counts, row pointers, row
    # strides, index pointers (0: none).
    meta = torch.tensor([[tokens.data_ptr(), tokens.numel(), rows.data_ptr(), rows.stride(0),
                          0 if index is None else index.data_ptr()] for rows, tokens, index in live],
                        dtype=torch.int64).reshape(-1, 5).t().contiguous()
    tok_ptr, counts, row_ptr, row_ld, index_ptr = meta
    any_index = any(index is not None for _, _, index in live)
    status = _SUM_ROWS(m, hidden, len(live), tok_ptr.data_ptr(), counts.data_ptr(), row_ptr.data_ptr(),
                       row_ld.data_ptr(), index_ptr.data_ptr() if any_index else None,
                       None if b0 is None else b0.data_ptr(), 0 if b0 is None else b0.stride(0),
                       None if b1 is None else b1.data_ptr(), 0 if b1 is None else b1.stride(0),
                       out.data_ptr(), out.stride(0), _NAN_BITS)
    if status == -1:
        raise MemoryError("deepep_ascend.native.sum_rows: the kernel ran out of memory for its row lists")
    if status:
        raise ValueError(f"deepep_ascend.native.sum_rows: source {status - 1}'s tokens are not ascending "
                         f"in [0, {m})")
    _written(out)
    return True


def _matrix(name: str, t: torch.Tensor, dtype: torch.dtype, cols: int, op: str) -> None:
    if not _matrix_ok(t, dtype, cols):
        raise ValueError(f"deepep_ascend.native.{op}: {name} must be a CPU {dtype} matrix of {cols} columns with "
                         f"unit column stride, got {getattr(t, 'dtype', type(t).__name__)} of shape "
                         f"{tuple(getattr(t, 'shape', ()))}")


def _rows_overlap(name: str, t: torch.Tensor) -> str | None:
    if t.size(0) > 1 and t.size(1) and t.stride(0) < t.size(1):
        return f"{name}'s rows overlap (row stride {t.stride(0)} < {t.size(1)} columns)"
    return None


def _rows_apart(name: str, t: torch.Tensor, op: str) -> None:
    why = _rows_overlap(name, t)
    if why:
        raise ValueError(f"deepep_ascend.native.{op}: {why}")


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
    if _DEQUANT is None:
        return False
    op = "dequant_rows_e4m3"
    if not isinstance(gran, int) or isinstance(gran, bool) or gran < 1 or out.dim() != 2 or out.size(1) % gran:
        raise ValueError(f"deepep_ascend.native.{op}: gran must be a positive int dividing out's columns, got "
                         f"gran {gran!r} for out of shape {tuple(out.shape)}")
    n, hidden = out.shape
    _matrix("out", out, torch.bfloat16, hidden, op)
    _rows_apart("out", out, op)
    if isinstance(codes, torch.Tensor) and codes.dtype in (torch.float8_e4m3fn, torch.int8):
        codes = codes.view(torch.uint8)
    _matrix("codes", codes, torch.uint8, hidden, op)
    _matrix("scales", scales, torch.uint8, hidden // gran, op)
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
    _DEQUANT(n, hidden, gran, codes.data_ptr(), codes.stride(0), scales.data_ptr(), scales.stride(0),
             None if index is None else index.data_ptr(), e4m3.data_ptr(), sf.data_ptr(), out.data_ptr(),
             out.stride(0), _NAN_BITS)
    _written(out)
    return True


_SWIGLU_BLOCK_FLOATS = 1 << 17  # floats of -g per block (512 KiB): exp_ and the kernel's second pass find it in L2


def swiglu(out: torch.Tensor, h: torch.Tensor, weights: torch.Tensor | None = None, clamp: float | None = None,
           fast_math: bool = True, gran: int = 0) -> bool:
    """MegaMoE's activation, one BF16 row of ``out`` per row of ``h``, bit for bit the torch path of
    :func:`deepep_ascend.mega_moe._activation` (NaN payloads aside)::

        g, u = h[:, :I], h[:, I:]  (clamped to <= clamp and to [-clamp, clamp] if clamp is not None)
        a = silu(g) * u * weights[:, None]   in float32: g / (1 + exp(-g)), or (1 / (1 + exp(-g))) * g if fast_math
        gran > 0: a = e4m3 round trip of a with UE8M0 scales per gran columns
        out = bf16(a)

    The exp is torch's (``Tensor.exp_`` on a float32 block of ``-g``), so both paths compute the same
    sigmoid; the kernel does the rest in one pass. DeepGEMM's MegaMoE SwiGLU epilogue with
    ``activation_clamp`` and its FP8 cast of the L2 input (no DeepGEMM call of its own).

    Args:
        out: ``[n, I]`` bfloat16, unit column stride, rows not overlapping (nor ``h``).
        h: ``[n, 2 I]`` bfloat16, unit column stride.
        weights: None (1) or ``[n]`` float32, the routing weight of each row.
        clamp: None, or the clamp as a float >= 0 (the caller rounds it as its reference does).
        gran: 0 (no FP8 round trip) or a positive int <= 256 dividing ``I``.
    Returns:
        True when done; False if the kernel is unavailable or a ``gran`` group holds a NaN, an
        infinity or a value of magnitude ``2**100`` or more (``out`` then partly written: use the
        codecs).
    Raises:
        ValueError: operands of another dtype, shape or layout, a negative or NaN ``clamp``, or a bad ``gran``.
    """
    if _SWIGLU is None:
        return False
    op = "swiglu"
    if out.dim() != 2:
        raise ValueError(f"deepep_ascend.native.{op}: out must be [n, I], got shape {tuple(out.shape)}")
    n, inter = out.shape
    _matrix("out", out, torch.bfloat16, inter, op)
    _rows_apart("out", out, op)
    _matrix("h", h, torch.bfloat16, 2 * inter, op)
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
    if not n or not inter:
        return True
    if weights is not None:
        weights = weights.contiguous()
    has_clamp = clamp is not None
    c = float(clamp) if has_clamp else 0.0
    block = min(n, max(1, _SWIGLU_BLOCK_FLOATS // inter))
    t = torch.empty(block, inter)
    for r0 in range(0, n, block):
        b = min(block, n - r0)
        tb, hb = t[:b], h[r0:r0 + b]
        _GATE(b, inter, hb.data_ptr(), hb.stride(0), has_clamp, c, tb.data_ptr())
        tb.exp_()
        ob = out[r0:r0 + b]
        if _SWIGLU(b, inter, hb.data_ptr(), hb.stride(0), tb.data_ptr(),
                   None if weights is None else weights[r0:].data_ptr(), has_clamp, c, int(bool(fast_math)), gran,
                   ob.data_ptr(), ob.stride(0), _NAN_BITS):
            _written(out)
            return False
    _written(out)
    return True


def amx_bf16() -> bool:
    """Whether :func:`gemm_bf16_amx` runs here: the kernels are loaded, were built with AMX support (x86-64
    Linux, gcc >= 11 or clang >= 12), the CPU has AMX-TILE and AMX-BF16, and Linux granted this process
    the tile state. Not in DeepGEMM (it decides how :mod:`deepep_ascend.gemm.grouped_gemm` packs weights)."""
    return _AMX


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the bytes two strided tensors span intersect (a conservative test on their extents)."""
    def span(t):
        lo = t.data_ptr()
        return lo, lo + sum((s - 1) * st for s, st in zip(t.shape, t.stride())) * t.element_size() + t.element_size()
    if not a.numel() or not b.numel():
        return False
    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def amx_packed_nbytes(n: int, k: int) -> int:
    """Bytes of :class:`AmxWeight`'s packed copy of an ``[n, k]`` weight (N and K padded to 32); needs the
    kernel (:func:`amx_bf16`)."""
    return int(_AMX_ELEMS(n, k)) * 2


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
            _AMX_PACK(self.data.data_ptr(), w.data_ptr(), w.stride(0), self.n, self.k)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.n, self.k))

    def size(self, dim: int | None = None):
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
    return int(_AMX_FP4_BYTES(n, k))


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
            _AMX_PACK_FP4(self.data.data_ptr(), data.data_ptr(), data.stride(0), exponents.data_ptr(),
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
    _matrix("a", a, torch.bfloat16, k, op)
    _matrix("out", out, torch.bfloat16, n, op)
    why = _write_refusal("out", out)
    if why:
        raise ValueError(f"deepep_ascend.native.{op}: {why}")
    m = a.size(0)
    if out.size(0) != m:
        raise ValueError(f"deepep_ascend.native.{op}: out has {out.size(0)} rows, a {m}")
    if _overlap(out, a):
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
    if _AMX_GEMM(out.data_ptr(), out.stride(0) if m > 1 else n, a.data_ptr(), a.stride(0) if m > 1 else k, n, k,
                 count, starts, ends, bps, int(kind is AmxFp4Weight)):
        raise MemoryError(f"deepep_ascend.native.{op}: no memory for the packed rows of a (up to "
                          f"{max(e - s for _, s, e in runs)} x {k})")
    _written(out)
    return True


def _write_refusal(name: str, t: torch.Tensor) -> str | None:
    """Why a kernel may not write the matrix ``t`` in place, or None: rows that overlap, or what torch refuses
    to write in place (a tensor autograd would have to track, since the kernel's write is invisible to it,
    or an inference tensor outside inference mode)."""
    if t.requires_grad and torch.is_grad_enabled():
        return (f"{name} requires grad; autograd cannot record this kernel's write (use torch.no_grad() or a "
                f"tensor that does not require grad)")
    if t.is_inference() and not torch.is_inference_mode_enabled():
        return f"{name} is an inference tensor; it can be written in place only inside torch.inference_mode()"
    return _rows_overlap(name, t)


def _written(t: torch.Tensor) -> None:
    """Bump ``t``'s version counter (shared with its base) after a native write, as an in-place torch op
    would: caches keyed on versions and autograd's saved-tensor checks see the change."""
    if not t.is_inference():
        torch.autograd.graph.increment_version(t)


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
