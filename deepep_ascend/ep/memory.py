"""Output tensors backed by transparent huge pages: the CPU port's answer to a caching allocator.

torch's CPU tensors come from ``malloc``; large ones are fresh ``mmap`` regions that the
kernel fills one 4 KiB page fault at a time on first touch. On the development VM that made
writing a per-call output (``recv_x``, ``combined_x``) 5-6x slower than writing reused memory,
and it dominated dispatch and combine (``python -m bench alloc`` measures it). DeepEP on a GPU
never pays this: PyTorch's CUDA caching allocator reuses blocks.

:func:`empty` allocates large outputs with 2 MiB of slack, advises the 2 MiB-aligned body with
``madvise(MADV_HUGEPAGE)`` *before* the first touch, and returns a view of it: the kernel then
faults in huge pages, 512x fewer faults. It needs only THP in ``madvise`` or ``always`` mode
(the Linux default is one of them) and changes nothing process-wide, unlike
``THP_MEM_ALLOC_ENABLE=1``, which torch reads once at start-up for every allocation.

:class:`OutputPool` goes one step further for outputs made on every call: it hands out again the
storage of outputs the caller has dropped, as the CUDA caching allocator does.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import threading

import torch

from ..rounding import align

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_MIN_BYTES = 2 * HUGE_PAGE  # below this a huge page would be mostly slack
# Below this malloc serves a request from its heap, whose pages stay mapped between calls; above it a freed
# output's pages may go back to the kernel (an mmap'd chunk, or a trimmed heap top) and fault in again.
_POOL_MIN_BYTES = 256 << 10
_SMALL_GRAIN = 64 << 10  # pooled blocks below _MIN_BYTES are rounded to this, not to a huge page


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


def storage_users(t: torch.Tensor) -> int | None:
    """Tensors (views included) sharing ``t``'s storage, or None if torch does not tell."""
    try:
        return torch._C._storage_Use_Count(t.untyped_storage()._cdata) - 1  # minus the temporary storage object
    except Exception:  # noqa: BLE001 - private API: no reuse without it
        return None


def _alias(t: torch.Tensor, dtype: torch.dtype, shape) -> torch.Tensor:
    """A new tensor (not a view: no ``_base``) of ``dtype`` and ``shape`` on ``t``'s storage, from ``t``'s offset."""
    return torch.empty(0, dtype=dtype).set_(t.untyped_storage(),
                                            t.storage_offset() * t.element_size() // dtype.itemsize, shape)


def _block(nbytes: int) -> torch.Tensor:
    """A ``[nbytes]`` uint8 tensor from :func:`empty` that is not a view (owns its storage alone)."""
    return _alias(empty((nbytes,), torch.uint8), torch.uint8, (nbytes,))


def outside_inference_mode(fn):
    """Decorate ``fn`` to run with ``torch.inference_mode`` off: what it makes to keep across calls (a
    Buffer's own tensors, pooled outputs, scratch, window views) is then a normal tensor, versioned and
    writable in place in either mode. Made under ``torch.inference_mode()`` it would be an inference tensor,
    which a later call outside that mode may not write in place, and whose writes no version counter shows."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not torch.is_inference_mode_enabled():
            return fn(*args, **kwargs)
        with torch.inference_mode(False):
            return fn(*args, **kwargs)
    return wrapper


class ViewCache:
    """Window views an engine makes on every call, kept across calls by a key the caller picks (rank,
    offset, length, dtype, ...): a dict lookup costs a tenth of slicing and viewing a window again, and
    calls of one shape take the same few views every time. Holds at most ``limit`` views; past that it
    starts over rather than grow (call shapes that keep changing). Not thread-safe: one engine's calls
    run one at a time."""

    def __init__(self, limit: int):
        self.limit = limit
        self._views: dict = {}

    def get(self, key, make):
        """The view under ``key``; ``make()`` builds it on a miss (outside inference mode: it is kept)."""
        v = self._views.get(key)
        if v is None:
            if len(self._views) >= self.limit:
                self._views.clear()
            v = self._views[key] = outside_inference_mode(make)()
        return v

    def clear(self) -> None:
        """Drop every view (the window is about to be freed)."""
        self._views.clear()


class OutputPool:
    """Large per-call outputs (``recv_x``, ``combined_x``) on storage the caller has dropped.

    The CPU stand-in for PyTorch's CUDA caching allocator, which makes DeepEP's fresh outputs
    cheap on a GPU: here a fresh tensor costs a zero-filled page per fault on first touch (+9 ms
    for a 117 MB ``recv_x`` on the development VM, over a 14 ms copy). A block is handed out
    again only when no tensor (the returned one, or any view of it) still uses its storage, so
    results a caller keeps are never overwritten. Best fit, each block ~12.5% larger than the request
    that made it, so varying token counts reuse it. Outputs from 256 KiB up are pooled (above malloc's
    heap a freed output's pages go back to the kernel and fault in again); blocks of 4 MiB and more
    (huge pages) and smaller ones (64 KiB grain) are kept apart, so that a small output never takes a
    large block, at most ``max_blocks`` of each kind (least recently used dropped first). Smaller
    requests and a torch without storage use counts get plain allocations. Thread-safe (the Buffer's
    worker allocates for async calls).
    """

    def __init__(self, max_blocks: int = 4):
        self.max_blocks = max_blocks
        # huge-page blocks, and blocks below _MIN_BYTES (kept apart: a small output never takes a large block)
        self._blocks: dict[bool, list[torch.Tensor]] = {False: [], True: []}
        self._lock = threading.Lock()

    @outside_inference_mode
    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous ``shape`` tensor of ``dtype`` (contents stale), not a view."""
        nbytes = math.prod(shape) * dtype.itemsize  # (a tuple: making a torch.Size costs more than the empty)
        if nbytes < _POOL_MIN_BYTES:
            return torch.empty(shape, dtype=dtype)
        want = nbytes + nbytes // 8
        small = want < _MIN_BYTES
        with self._lock:
            blocks = self._blocks[small]
            free = [i for i, b in enumerate(blocks) if b.numel() >= nbytes and storage_users(b) == 1]
            if free:  # by index: list.remove would compare tensors with ==
                blk = blocks.pop(min(free, key=lambda i: blocks[i].numel()))
            else:
                grain = _SMALL_GRAIN if small else HUGE_PAGE
                blk = _block(align(want, grain))
                if storage_users(blk) != 1:
                    return blk[:nbytes].view(dtype).view(shape)
                if len(blocks) >= self.max_blocks:
                    blocks.pop(0)
            blocks.append(blk)
            return _alias(blk, dtype, shape)


class SegmentPool:
    """Outputs placed in this rank's :class:`~transports.segment.SharedSegment`, where node peers
    can store into them directly (normal dispatch's ``recv_x``).

    A block is a tensor with a storage of its own over a byte range of the segment; the range is
    free again once no tensor (the one handed out, or any view of it) uses that storage, the rule of
    :class:`OutputPool` (a bare ``UntypedStorage`` object held alone does not count: torch's use
    count does not see it). Allocation is in two steps because peers must learn where to store before
    the size is known: :meth:`largest_free` names a range (advertised to the peers), :meth:`take`
    claims the first bytes of it. Without storage use counts nothing is ever free again (the caller
    then falls back to private outputs). Each method is thread-safe, but a :meth:`largest_free` /
    :meth:`take` pair must not interleave with another pair (the Buffer allocates on the caller's
    thread only).
    """

    ALIGN = 4096

    def __init__(self, segment, rank: int):
        self.segment, self.rank = segment, rank
        self.nbytes = segment.sizes.get(rank, 0)
        self._live: list[tuple[int, int, torch.Tensor]] = []  # (offset, nbytes, block)
        self._lock = threading.Lock()

    def largest_free(self) -> tuple[int, int]:
        """``(offset, nbytes)`` of the largest range no live output uses (``nbytes`` 0: none)."""
        with self._lock:
            self._live = [b for b in self._live if storage_users(b[2]) != 1]
            best, pos = (0, 0), 0
            for start, end in sorted((o, o + n) for o, n, _ in self._live) + [(self.nbytes, self.nbytes)]:
                if start - pos > best[1]:
                    best = (pos, start - pos)
                pos = max(pos, align(end, self.ALIGN))
            return best

    @outside_inference_mode
    def take(self, offset: int, nbytes: int) -> torch.Tensor:
        """A ``[nbytes]`` uint8 tensor over bytes ``[offset, offset + nbytes)``, in use until dropped."""
        block = self.segment.view(self.rank, offset, nbytes)
        with self._lock:
            self._live.append((offset, nbytes, block))
        return _alias(block, torch.uint8, (nbytes,))
