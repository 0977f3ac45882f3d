"""Output tensors backed by transparent huge pages: the CPU port's answer to a caching allocator.

torch's CPU tensors come from ``malloc``; large ones are fresh ``mmap`` regions that the
kernel fills one 4 KiB page fault at a time on first touch. On the development VM that made
writing a per-call output (``recv_x``, ``combined_x``) 5-6x slower than writing reused memory,
and it dominated dispatch and combine (``python -m bench.alloc`` measures it). DeepEP on a GPU
never pays this: PyTorch's CUDA caching allocator reuses blocks.

:func:`empty` allocates large outputs with 2 MiB of slack, advises the 2 MiB-aligned body with
``madvise(MADV_HUGEPAGE)`` *before* the first touch, and returns a view of it: the kernel then
faults in huge pages, 512x fewer faults. It needs only THP in ``madvise`` or ``always`` mode
(the Linux default is one of them) and changes nothing process-wide, unlike
``THP_MEM_ALLOC_ENABLE=1``, which torch reads once at start-up for every allocation.
"""

from __future__ import annotations

import ctypes
import ctypes.util

import torch

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_MIN_BYTES = 2 * HUGE_PAGE  # below this a huge page would be mostly slack


def _load_madvise():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_madvise = _load_madvise()


def empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype)`` whose memory is faulted in as huge pages when large.

    The result is contiguous; its storage is up to 2 MiB larger than needed. Falls back to a
    plain ``torch.empty`` below 4 MiB or where ``madvise`` is unavailable or refused.
    """
    shape = torch.Size(shape)
    nbytes = shape.numel() * dtype.itemsize
    if nbytes < _MIN_BYTES or _madvise is None:
        return torch.empty(shape, dtype=dtype)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    offset = (-raw.data_ptr()) % HUGE_PAGE
    body = nbytes // HUGE_PAGE * HUGE_PAGE
    if _madvise(raw.data_ptr() + offset, body, _MADV_HUGEPAGE) != 0:
        return torch.empty(shape, dtype=dtype)
    return raw[offset:offset + nbytes].view(dtype).view(shape)
