"""The data plane's native kernel: combine's row sum in one pass (``csrc/sum_rows.c``).

Built at install time as the optional extension ``deepep_ascend._native`` (``pyproject.toml``) and
loaded with :mod:`ctypes` (no Python headers needed; a ctypes call releases the GIL, so the
Buffer's worker sums while the caller computes). Where it was not built (no C compiler) or
``DEEPEP_ASCEND_NATIVE=0`` is set, :func:`available` is False and
:func:`deepep_ascend.intranode.accumulate_rows` uses its torch paths, which give the same bits.

Why C: combine sums each token's BF16 rows in float32 and rounds once (DeepEP's arithmetic).
torch has no gather-and-sum with BF16 inputs and a float32 accumulator (FBGEMM's BF16
``embedding_bag`` rounds half away from zero), so the torch paths convert rows to a float32
scratch first: about three passes over the rows where this kernel makes one
(``python -m bench.combine_sum`` times both).
"""
from __future__ import annotations

import ctypes
import importlib.machinery
import os
import warnings

import torch

__all__ = ["available", "library_path", "sum_rows"]

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


_ABI = 2  # csrc/sum_rows.c's deepep_native_abi(): the signatures below


def _load():
    if os.environ.get("DEEPEP_ASCEND_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    path = library_path()
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(path)
        lib.deepep_native_abi.restype = _I64
        abi = int(lib.deepep_native_abi())
        fn = lib.deepep_sum_rows_bf16
    except (OSError, AttributeError) as exc:
        abi, why = None, f"cannot be loaded ({exc})"
    else:
        why = f"was built from an older source (ABI {abi}, this code needs {_ABI})"
    if abi != _ABI:
        warnings.warn(f"deepep_ascend: the native kernel {path} {why}; using the torch paths. Rebuild it with "
                      f"`bash scripts/setup.sh` (or `pip install -e .`).", RuntimeWarning, stacklevel=2)
        return None
    fn.restype = _I64
    fn.argtypes = [_I64, _I64, _I64, _P, _P, _P, _P, _P, _P, _I64, _P, _I64, _P, _I64, ctypes.c_uint16]
    return fn


_SUM_ROWS = _load()
# The NaN that torch's vectorized float32 -> bfloat16 cast writes (its scalar cast of a 0-d tensor may
# write another, and copies keep a NaN's payload): the kernel writes this one for every NaN sum.
_NAN_BITS = int(torch.full((64,), float("nan")).to(torch.bfloat16).view(torch.int16)[0]) & 0xFFFF


def available() -> bool:
    """Whether the native kernel is loaded (built, and not disabled by ``DEEPEP_ASCEND_NATIVE=0``)."""
    return _SUM_ROWS is not None


def _rows_ok(t: torch.Tensor | None, cols: int) -> bool:
    return t is None or (t.dtype == torch.bfloat16 and t.dim() == 2 and t.size(1) == cols
                         and (t.stride(1) == 1 or cols <= 1) and t.device.type == "cpu")


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
    if not all(_rows_ok(t, hidden) for t in (out, b0, b1, *(src[0] for src in sources))):
        return False
    if m > 1 and hidden and out.stride(0) < hidden:
        raise ValueError(f"deepep_ascend.native.sum_rows: out's rows overlap (row stride {out.stride(0)} < "
                         f"{hidden} columns)")
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
    return True
