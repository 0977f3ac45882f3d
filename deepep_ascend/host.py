"""Host memory settings that a CPU port needs and a GPU library gets from its caching allocator.

torch's CPU tensors come from the C library's ``malloc``. glibc serves blocks above
``M_MMAP_THRESHOLD`` with a fresh ``mmap`` and unmaps them on free, so every large per-call
output (``recv_x``, ``combined_x``) is first-touched page by page. On the development VM that
made copies into fresh memory several times slower than into reused memory
(``python -m bench.alloc`` measures it). DeepEP on a GPU never pays this: PyTorch's CUDA caching allocator
reuses blocks. :func:`enable_malloc_cache` gives the process the same behaviour by keeping
large freed blocks in the heap for reuse (``mallopt``), at the price of not returning freed
memory to the OS (RSS stays at its peak, as with a caching allocator).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

MALLOC_CACHE_ENV = "DEEPEP_ASCEND_MALLOC_CACHE"
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_state = {"enabled": None}


def enable_malloc_cache(mmap_threshold: int = 1 << 30, trim_threshold: int = 1 << 40) -> bool:
    """Make glibc keep and reuse large freed blocks, process-wide; idempotent.

    Called by :class:`deepep_ascend.Buffer` unless ``$DEEPEP_ASCEND_MALLOC_CACHE=0``.
    Args:
        mmap_threshold: allocations below this many bytes come from the heap (reusable).
        trim_threshold: the heap is not shrunk until this many free bytes sit at its top.
    Returns:
        True if the settings were applied (glibc), False otherwise (other C libraries,
        or disabled by the environment variable).
    """
    if _state["enabled"] is not None:
        return _state["enabled"]
    ok = False
    if os.environ.get(MALLOC_CACHE_ENV, "1") != "0":
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold))) and \
                bool(libc.mallopt(_M_TRIM_THRESHOLD, int(trim_threshold)))
        except (OSError, AttributeError):
            ok = False
    _state["enabled"] = ok
    return ok
