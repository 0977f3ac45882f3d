"""Loading the native kernel library: where the built extension lies, whether it matches this code (its ABI
number), whether ``DEEPEP_ASCEND_NATIVE`` lets it be used, and the table of its C functions, called through the
``METH_FASTCALL`` bindings ``_fastcall`` where they were built (:func:`bindings`), else through ctypes.

The library loads once, when this module is imported; :data:`kernels` then holds its functions (or None
each, where it is not built, is stale or is switched off) and the wrappers in :mod:`.rows` and :mod:`.amx`
read them at every call. :func:`timing` times every call made through :data:`kernels` inside a block
(``python -m bench ... --native-split``).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.machinery
import os
import threading
import time
import warnings
from collections.abc import Iterator

from .. import settings

__all__ = ["ABI", "SIGNATURES", "Kernels", "available", "bindings", "ctypes_kernels", "kernels", "library_path", "load",
           "signature_codes", "timing"]

#: ``deepep_native_abi()`` of a library built from the sources next to this module (``csrc/sum_rows.c``):
#: the signatures below. A library that reports another number is refused.
ABI = 31

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_U16 = ctypes.c_uint16
_F32 = ctypes.c_float

# C function (name without its ``deepep_`` prefix) -> (return type, argument types): the ctypes calls' types, and
# the source of the METH_FASTCALL bindings (deepep_ascend/native/bindings.py generates csrc/bindings.c from it).
SIGNATURES = {
    "sum_rows_bf16": (_I64, [_I64, _I64, _I64, _P, _P, _P, _P, _P, _P, _P, _I64, _P, _I64, _P, _I64, _U16]),
    "dequant_rows_e4m3_bf16": (None, [_I64, _I64, _I64, _P, _I64, _P, _I64, _P, _P, _P, _P, _I64, _U16]),
    "swiglu_gate_bf16": (None, [_I64, _I64, _P, _I64, _I64, _F32, _F32, _P]),
    "swiglu_bf16": (_I64, [_I64, _I64, _P, _I64, _P, _P, _I64, _F32, _I64, _I64, _F32, _I64, _P, _I64, _U16]),
    "copy_rows": (_I64, [_I64, _I64, _P, _I64, _P, _I64, _P, _I64, _P, _I64]),
    "zero_rows": (_I64, [_I64, _I64, _P, _I64, _P, _I64]),
    "weighted_sum_rows_bf16": (_I64, [_I64, _I64, _I64, _P, _I64, _I64, _P, _P, _P, _I64, _U16]),
    "row_sums_avx2": (_I64, [_I64]),
    "ll_route": (_I64, [_I64, _I64, _P, _I64, _I64, _P, _P, _P]),
    "ll_dispatch_send": (_I64, [_I64, _I64, _P, _I64, _I64, _I64, _I64, _P, _P, _I64, _I64, _P, _P]),
    "ll_dispatch_recv": (_I64, [_I64, _I64, _I64, _P, _P, _P, _P, _I64, _P, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _P,
                                _P, _P]),
    "ll_stream_rows": (_I64, [_I64, _I64, _I64, _P]),
    "ll_streams": (_I64, [_I64, _I64]),
    "ll_combine_send": (_I64, [_I64, _I64, _I64, _I64, _I64, _P, _P, _I64, _I64, _P, _P, _I64, _I64, _I64, _P]),
    "ll_combine_recv": (_I64, [_I64, _I64, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _I64, _I64, _P, _P, _P, _I64,
                               _U16, _P, _P, _P, _I64, _P]),
    "ll_headers_agree": (_I64, [_I64, _I64, _P, _I64, _P, _I64, _I64, _I64]),
    "ll_publish": (_I64, [_I64, _P, _I64, _P, _I64, _P, _P, _I64]),
    "ll_await": (_I64, [_I64, _I64, _P, _P, _I64, _I64, _P, _I64, _I64, _I64, _I64]),
    "in_signal": (_I64, [_I64, _P, _I64, _P, _P, _P]),
    "in_poll": (_I64, [_P, _I64, _P, _P, _I64, _I64]),
    "in_exchange": (_I64, [_P, _P, _I64, _P, _I64, _P, _I64, _P, _I64, _P, _I64]),
    "in_gather": (_I64, [_P, _P, _P, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _P, _P, _I64, _P, _I64, _I64]),
    "in_vectors": (_I64, [_P, _I64, _P]),
    "in_stage": (_I64, [_P, _I64, _P, _P, _P, _P, _I64, _P, _P, _P, _I64, _I64]),
    "in_store": (_I64, [_I64, _I64, _P, _I64, _I64, _P, _P, _P, _P, _P]),
    "in_dispatch_tail": (_I64, [_P, _I64, _P, _I64, _I64, _P, _P, _P, _P, _P, _I64, _P, _P, _P, _I64, _I64, _P, _P,
                                _P, _P, _I64, _I64, _I64, _I64, _P, _I64, _P]),
    "in_combine_tail": (_I64, [_P, _P, _I64, _I64, _I64, _P, _P, _P, _P, _I64, _P, _P, _P, _I64, _P, _I64, _P, _I64, _P,
                               _P, _P, _P, _P, _U16, _P, _P, _P, _P, _I64, _I64, _P]),
    "in_combine": (_I64, [_P, _P, _I64, _I64, _I64, _P, _P, _P, _P, _I64, _P, _P, _P, _I64, _P, _I64, _P, _I64, _P, _P,
                          _P, _P, _P, _U16]),
    "ll_dispatch_issue": (_I64, [_P, _I64, _I64, _I64, _P, _P, _P, _I64, _P, _I64, _I64, _I64, _I64, _P, _I64, _I64,
                                 _P]),
    "ll_dispatch_finish": (_I64, [_P, _I64, _I64, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _P, _P, _P, _P]),
    "ll_combine_issue": (_I64, [_P, _I64, _P, _P, _I64, _I64, _I64, _I64, _I64, _P, _P, _I64, _I64, _P]),
    "ll_combine_finish": (_I64, [_P, _I64, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _I64, _U16, _P, _P, _P, _P, _P]),
    "ll_cast_messages": (_I64, [_I64, _I64, _P, _I64, _I64, _I64, _P, _I64]),
    "logfmt_meta": (None, [_I64, _P, _P]),
    "logfmt_params": (_I64, [_I64, _P, _P, _P, _P, _P, _P, _P, _P]),
    "logfmt_encode": (_I64, [_I64, _P, _P, _P, _P, _P, _P, _P, _P, _I64]),
    "logfmt_decode": (_I64, [_I64, _P, _P, _I64, _P, _P, _P, _P]),
    "logfmt_avx512": (_I64, [_I64]),
    "amx_bf16_available": (_I64, []),
    "amx_packed_elems": (_I64, [_I64, _I64]),
    "amx_pack_bf16": (None, [_P, _P, _I64, _I64, _I64]),
    "amx_gemm_bf16": (_I64, [_P, _I64, _P, _I64, _I64, _I64, _I64, _P, _P, _P, _I64]),
    "amx_fp4_packed_bytes": (_I64, [_I64, _I64]),
    "amx_pack_fp4": (None, [_P, _P, _I64, _P, _I64, _I64, _I64]),
    "dispatch_layout": (_I64, [_P, _I64, _I64, _I64, _I64, _P, _P, _P, _P]),
    "send_layout": (None, [_P, _I64, _I64, _I64, _P, _P, _P]),
    "recv_channel_prefix": (_I64, [_P, _P, _P, _I64, _I64, _P]),
    "local_experts": (None, [_P, _P, _I64, _I64, _I64]),
}


_CODES = {_P: "p", _I64: "q", _U16: "H", _F32: "f", None: "v"}


def signature_codes() -> dict[str, str]:
    """:data:`SIGNATURES` as ``name -> "<return code>:<argument codes>"`` (``p`` pointer, ``q`` int64, ``H``
    uint16, ``f`` float; ``v`` no value), the form ``_fastcall.names()`` reports."""
    return {name: _CODES[ret] + ":" + "".join(_CODES[a] for a in args) for name, (ret, args) in SIGNATURES.items()}


class Kernels:
    """The library's C functions as callables (their bindings, or ctypes calls), one attribute per function
    (``deepep_sum_rows_bf16`` is ``sum_rows_bf16``), every one None when no library is loaded. The wrappers look
    them up at each call, so setting one to None sends its wrapper to the torch path (what tests of those paths
    do)."""

    __slots__ = tuple(SIGNATURES)

    def __init__(self, lib: ctypes.CDLL | None = None):
        for name in self.__slots__:
            setattr(self, name, None if lib is None else getattr(lib, "deepep_" + name))


def library_path() -> str | None:
    """Path of the built kernel library next to this module, or None if it was not built."""
    here = os.path.dirname(os.path.abspath(__file__))
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = os.path.join(here, "_native" + suffix)
        if os.path.isfile(path):
            return path
    return None


def load() -> Kernels | None:
    """Load the library and type its functions.

    Returns:
        The :class:`Kernels`, or None where ``DEEPEP_ASCEND_NATIVE`` is off, the library was not built, or
        it cannot be used: it does not load, or it was built from other sources (its ABI number is not
        :data:`ABI`); those two warn (``RuntimeWarning``) and say how to rebuild.
    Raises:
        deepep_ascend.settings.SettingError: ``DEEPEP_ASCEND_NATIVE`` is not a boolean.
    """
    if not settings.NATIVE.get():
        return None
    path = library_path()
    if path is None:
        return None
    table = None
    try:
        lib = ctypes.CDLL(path)
        lib.deepep_native_abi.restype = _I64
        abi = int(lib.deepep_native_abi())
        why = f"was built from an older source (ABI {abi}, this code needs {ABI})"
        if abi == ABI:  # an older library lacks some of the functions: its ABI number says so first
            table = Kernels(lib)
    except (OSError, AttributeError) as exc:
        why = f"cannot be loaded ({exc})"
    if table is None:
        warnings.warn(f"deepep_ascend: the native kernel {path} {why}; using the torch paths. Rebuild it with "
                      f"`bash scripts/setup.sh` (or `pip install -e .`).", RuntimeWarning, stacklevel=2)
        return None
    for name, (restype, argtypes) in SIGNATURES.items():
        fn = getattr(table, name)
        fn.restype, fn.argtypes = restype, argtypes
    global _ctypes_table, _bindings
    _ctypes_table, _bindings = Kernels(lib), "ctypes"  # (a CDLL keeps the functions it typed: the same objects)
    fast = _fastcall_module(path)
    if fast is not None:
        fast.bind([ctypes.cast(getattr(table, name), ctypes.c_void_p).value for name in SIGNATURES])
        for name in SIGNATURES:
            setattr(table, name, getattr(fast, name))
        _bindings = "fastcall"
    return table


_ctypes_table: Kernels | None = None  # the library's functions as ctypes calls, once load() found it
_bindings = "none"  # how load()'s table calls them


def _fastcall_module(library: str):
    """``deepep_ascend.native._fastcall`` when it was built from :data:`SIGNATURES` (its ``names()`` agree), else
    None: not built (the install found no Python headers), or built from another table (a warning: rebuild)."""
    try:
        from . import _fastcall
    except ImportError:
        return None
    if dict(_fastcall.names()) != signature_codes():
        warnings.warn(f"deepep_ascend: the native bindings next to {library} were built from another signature "
                      f"table; using ctypes calls. Rebuild them with `bash scripts/setup.sh` (or `pip install -e .`).",
                      RuntimeWarning, stacklevel=3)
        return None
    return _fastcall


def bindings() -> str:
    """How :data:`kernels` calls the C functions: ``"fastcall"`` (``deepep_ascend.native._fastcall``'s
    ``METH_FASTCALL`` bindings, about a Python call's cost whatever the arguments), ``"ctypes"`` (its per-argument
    conversion: the bindings were not built) or ``"none"`` (no library)."""
    return _bindings


def ctypes_kernels() -> Kernels | None:
    """The library's functions as ctypes calls (the same C functions :data:`kernels` binds), or None where no
    library loaded: what :data:`kernels` holds where the bindings were not built. Tests run the data paths
    through it to check that both ways of calling give the same bits; ``python -m bench overhead --bindings``
    times a call through each."""
    return _ctypes_table


#: The loaded functions (all None where :func:`load` found no usable library); read once, at import.
kernels = load() or Kernels()


def available() -> bool:
    """Whether the native kernels are loaded (built, and not disabled by ``DEEPEP_ASCEND_NATIVE=0``)."""
    return kernels.sum_rows_bf16 is not None


_timing_lock = threading.Lock()


@contextlib.contextmanager
def timing() -> Iterator[dict[str, list[int]]]:
    """Time every call of a native function (through :data:`kernels`) that any thread of this process makes
    while the block is open.

    Yields a dict, filled as calls return: C function name (without its ``deepep_`` prefix) -> ``[calls,
    nanoseconds]`` (``time.perf_counter_ns`` around the call: the C function, its argument conversion
    and any polling it does for peers). Each function is replaced in :data:`kernels` by a timing wrapper for
    the duration (about half a microsecond per call) and restored on exit; functions not loaded stay None,
    so with no library (``DEEPEP_ASCEND_NATIVE=0``, or not built) the dict stays empty. The table is the
    process's: calls of every thread count, and one block may be open at a time in the process. Work an
    asynchronous call or a receive hook does after the block closed is not counted (a call running across
    the exit may still add to the dict): wait on the events inside the block.

    Raises:
        RuntimeError: a ``timing()`` block is already open in this process (any thread).
    """
    if not _timing_lock.acquire(blocking=False):
        raise RuntimeError("deepep_ascend.native.timing() is already active")
    totals: dict[str, list[int]] = {}
    count = threading.Lock()  # the worker thread of an asynchronous call adds to the same entries
    saved = {name: getattr(kernels, name) for name in Kernels.__slots__}

    def timed(name: str, fn):
        def call(*args):
            t0 = time.perf_counter_ns()
            try:
                return fn(*args)
            finally:
                dt = time.perf_counter_ns() - t0
                with count:
                    entry = totals.setdefault(name, [0, 0])
                    entry[0] += 1
                    entry[1] += dt
        return call

    try:
        for name, fn in saved.items():
            if fn is not None:
                setattr(kernels, name, timed(name, fn))
        yield totals
    finally:
        for name, fn in saved.items():
            setattr(kernels, name, fn)
        _timing_lock.release()
