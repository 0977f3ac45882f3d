"""The weight caches: copies of weights that the GEMMs and MegaMoE build once and reuse while the weights
are unchanged (dequantized FP8/FP4 weights, weights packed for the AMX kernel or oneDNN, MegaMoE's
un-transformed weights), and their public controls.

A copy is keyed by the identity (a view: its base and geometry) and version counter of the tensors it was
built from (:func:`cached_by_tensors`), so an in-place write is seen by the next call and an entry dies with
its tensors. The caches share one byte budget, least recently used copies dropped first; optional copies
(packed ones: callers can multiply without them) never push out anything. The budget starts at
``DEEPEP_ASCEND_WEIGHT_CACHE_BYTES`` (:mod:`deepep_ascend.settings`), read when the caches are first used,
else a quarter of physical memory; :func:`set_dequantized_weight_cache` changes it.

Public controls (not in DeepGEMM, whose GPU kernels read FP8/FP4 weights directly):
:func:`set_dequantized_weight_cache`, :func:`clear_dequantized_weight_cache`,
:func:`dequantized_weight_cache_info` (:class:`WeightCacheInfo`). For the other rooms: :func:`cacheable`,
:func:`cached_by_tensors`, :func:`optional_copy_fits`.
"""

from __future__ import annotations

import collections
import contextlib
import operator
import os
import sys
import threading
import warnings
import weakref

import numpy as np
import torch

from .. import settings
from ..host import physical_memory_bytes

__all__ = [
    "WeightCacheInfo",
    "cacheable",
    "cached_by_tensors",
    "clear_dequantized_weight_cache",
    "dequantized_weight_cache_info",
    "optional_copy_fits",
    "set_dequantized_weight_cache",
]


# Re-entrant: dropping an entry can free a tensor that keys another entry, whose finalizer (_forget) takes
# the lock again; values are also released after the lock where the code can arrange it.
_cache_lock = threading.RLock()

_cache: collections.OrderedDict = collections.OrderedDict()  # key -> _Entry, least recently used first
_cache_enabled = True
_cache_max_bytes: int | None = None  # the budget; None until the caches are first used (_max_bytes)
_cache_bytes = 0
_cache_stats = {"hits": 0, "misses": 0, "evictions": 0}
_cache_warned = False


def _check_max_bytes(name: str, value) -> int:
    """``value`` as an int >= 0 (any integer type but bool), else ValueError naming ``name``."""
    try:
        n = (None if isinstance(value, bool) or getattr(value, "dtype", None) == torch.bool
             or getattr(value, "ndim", 0) != 0 else operator.index(value))
    except TypeError:
        n = None
    if n is None or n < 0:
        raise ValueError(f"{name} must be an int >= 0 (bytes), got {value!r}")
    return n


def _max_bytes() -> int:
    """The caches' budget in bytes (call with the lock held). Read at the caches' first use, not at import (a
    bad value must not keep the package from importing): ``DEEPEP_ASCEND_WEIGHT_CACHE_BYTES`` if set, else a
    quarter of the machine's physical memory (8 GiB where the OS does not say), unless
    :func:`set_dequantized_weight_cache` set one first.

    Raises:
        deepep_ascend.settings.SettingError: the variable holds something other than an int >= 0 (the
            budget stays unset: every use raises until the variable or the budget is fixed).
    """
    global _cache_max_bytes
    if _cache_max_bytes is None:
        value = settings.WEIGHT_CACHE_BYTES.get()
        if value is None:
            memory = physical_memory_bytes()
            value = 8 << 30 if memory is None else memory // 4
        _cache_max_bytes = value
    return _cache_max_bytes


WeightCacheInfo = collections.namedtuple("WeightCacheInfo", "hits misses evictions entries nbytes max_bytes")
WeightCacheInfo.__doc__ = """:func:`dequantized_weight_cache_info`'s counters (since the last clear) and sizes
(bytes)."""


def set_dequantized_weight_cache(enabled: bool | None = None, max_bytes: int | None = None) -> None:
    """Enable or disable the weight caches (on at import): the dequantized copies of
    :func:`~deepep_ascend.gemm.dequant.dequantize_weights`, the bf16 GEMMs' prepacked weights and MegaMoE's
    un-transformed weights. Disabling clears them. Not in DeepGEMM.

    Args:
        enabled: whether calls cache the copies they build (``None``: unchanged, to set only the budget).
        max_bytes: the caches' budget in bytes (an int >= 0; ``None`` keeps the current one). The
            initial budget is ``DEEPEP_ASCEND_WEIGHT_CACHE_BYTES`` if set (read when the caches are first
            used, unless a budget was set here before), else a quarter of physical memory, per process.
            Past it, the least recently used copies are dropped, prepacked ones first (rebuilt on their
            next use; a ``RuntimeWarning`` says so once per process); a copy larger than the whole budget
            is not cached, and a prepacked copy is made only if it fits beside what is cached (else the
            weight multiplies with ``torch.matmul``, as with the caches off). Lowering the budget drops
            copies now.
    Raises:
        ValueError: ``max_bytes`` not an int >= 0, or ``enabled`` not True, False or None.
    """
    global _cache_enabled, _cache_max_bytes
    if max_bytes is not None:
        max_bytes = _check_max_bytes("max_bytes", max_bytes)
    if enabled is not None and not isinstance(enabled, (bool, np.bool_)):
        raise ValueError(f"enabled must be True, False or None, got {enabled!r}")
    if enabled is not None:
        _cache_enabled = bool(enabled)
        if not enabled:
            clear_dequantized_weight_cache()
    if max_bytes is not None:
        with _locked():
            _cache_max_bytes = max_bytes
            evicted = _evict_to(max_bytes)
        del evicted  # released outside the lock


def clear_dequantized_weight_cache() -> None:
    """Drop every cached weight copy (dequantized, prepacked, un-transformed) and reset the counters of
    :func:`dequantized_weight_cache_info`."""
    global _cache_bytes
    with _locked():
        entries = list(_cache.values())
        _cache.clear()
        _cache_bytes = 0
        _cache_stats.update(hits=0, misses=0, evictions=0)
    del entries  # the cached tensors die here, outside the lock


def dequantized_weight_cache_info() -> WeightCacheInfo:
    """The weight caches' state, like ``functools.lru_cache``'s ``cache_info()`` (not in DeepGEMM, whose
    GPU kernels read FP8/FP4 weights directly): ``hits``, ``misses`` (calls that found no copy while the
    caches were on) and ``evictions`` (copies dropped for the byte budget) since the last
    :func:`clear_dequantized_weight_cache`, and ``entries``, ``nbytes`` (bytes the cached copies hold;
    prepacked weights count in full once cached, though each group is packed on first use) and
    ``max_bytes`` (the budget, :func:`set_dequantized_weight_cache`).

    Raises:
        deepep_ascend.settings.SettingError: the budget is still unread and ``DEEPEP_ASCEND_WEIGHT_CACHE_BYTES``
            is not an int >= 0.
    """
    with _locked():
        return WeightCacheInfo(_cache_stats["hits"], _cache_stats["misses"], _cache_stats["evictions"], len(_cache),
                               _cache_bytes, _max_bytes())


def _nbytes(value, keys) -> int:
    """Bytes a cached value holds: tensors by their storage (0 when it is a key tensor's, e.g. weights used
    as they are; oneDNN's opaque packed tensors by their logical size), tuples and lists by their items, other
    objects by their ``nbytes`` (0 without)."""
    if isinstance(value, torch.Tensor):
        if value.is_mkldnn:
            return value.nbytes
        storage = value.untyped_storage()
        if any(storage.data_ptr() == k.untyped_storage().data_ptr() for k in keys):
            return 0
        return storage.nbytes()
    if isinstance(value, (tuple, list)):
        return sum(_nbytes(v, keys) for v in value)
    return int(getattr(value, "nbytes", 0))


class _Entry:
    """One cached copy: weak references to its key tensors' bases (and their ids), their versions, the value,
    its bytes, and whether it is optional (a prepacked copy: callers can multiply without it, so it never
    pushes out a required copy such as a dequantized weight)."""

    __slots__ = ("refs", "ids", "versions", "value", "nbytes", "optional")

    def __init__(self, bases, versions, value, nbytes, optional):
        self.refs = tuple(weakref.ref(b) for b in bases)
        self.ids = tuple(id(b) for b in bases)
        self.versions, self.value, self.nbytes, self.optional = versions, value, nbytes, optional


_state = threading.local()  # .depth: this thread is inside a critical section of the caches

_pending: collections.deque = collections.deque()  # ids of dead key tensors whose entries are still to drop


@contextlib.contextmanager
def _section():
    """The caches' lock, counted in ``_state.depth`` (what tells :func:`_forget` it runs inside a section)."""
    with _cache_lock:
        _state.depth = getattr(_state, "depth", 0) + 1
        try:
            yield
        finally:
            _state.depth -= 1


@contextlib.contextmanager
def _locked():
    """The caches' lock. Finalizers of key tensors (:func:`_forget`) can run inside it, on this thread, when a
    garbage collection or a release happens there; they only queue the dead tensor, and the entries keyed on
    it are dropped when the outermost section ends, never while a section is iterating over the entries."""
    try:
        with _section():
            yield
    finally:
        if _pending and not getattr(_state, "depth", 0):
            _process_pending()


def _drop(key) -> _Entry | None:
    """Remove ``key``'s entry (the lock held) and return it, to be released after the lock."""
    global _cache_bytes
    entry = _cache.pop(key, None)
    if entry is not None:
        _cache_bytes -= entry.nbytes
    return entry


def _evict_to(budget: int, protect: tuple = ()) -> list:
    """Drop entries until the cache holds at most ``budget`` bytes (the lock held): the optional ones (packed
    copies) first, then the required ones, each least recently used first, never one whose value is among
    ``protect``; returns them, to be released after the lock."""
    evicted = []
    for optional in (True, False):
        for key in list(_cache):
            if _cache_bytes <= budget:
                break
            entry = _cache.get(key)
            if entry is None or entry.optional != optional or any(entry.value is t for t in protect):
                continue
            evicted.append(_drop(key))
    _cache_stats["evictions"] += len(evicted)
    return evicted


def optional_copy_fits(nbytes: int) -> bool:
    """Whether an optional copy (a prepacked weight) of ``nbytes`` would be kept: the caches are on and it fits
    the budget beside every cached copy, since an optional copy pushes out none (two weights whose packed
    copies take turns pushing each other out would be packed on every call, slower than not packing).
    Callers skip building an optional copy that would not be kept and multiply without it; the budget's
    warning says so (once per process) when the caches are on. Raises ``SettingError`` as
    :func:`cached_by_tensors`."""
    with _locked():
        enabled, fits = _cache_enabled, nbytes + _cache_bytes <= _max_bytes()
    if enabled and not fits:
        _warn_budget(nbytes, True)
    return enabled and fits


def _caller_stacklevel() -> int:
    """``warnings.warn``'s stacklevel of the first frame outside this package (its caller's code)."""
    pkg = os.path.dirname(os.path.abspath(__file__))
    f, level = sys._getframe(1), 1
    while f is not None:
        where = os.path.dirname(os.path.abspath(f.f_code.co_filename))
        if where != pkg and not where.startswith(pkg + os.sep):
            break
        f, level = f.f_back, level + 1
    return level


def _warn_budget(nbytes: int, too_big: bool) -> None:
    global _cache_warned
    if _cache_warned:
        return
    _cache_warned = True
    what = (f"a copy of {nbytes} bytes does not fit it and was not cached" if too_big else
            f"older copies were dropped to make room for one of {nbytes} bytes")
    warnings.warn(f"deepep_ascend: the weight caches' budget of {_cache_max_bytes} bytes is full ({what}): "
                  f"weights beyond it are dequantized or packed again when used, or multiply unpacked. Raise it with "
                  f"set_dequantized_weight_cache(max_bytes=...) or {settings.WEIGHT_CACHE_BYTES.name}; "
                  f"dequantized_weight_cache_info() counts the evictions.", RuntimeWarning,
                  stacklevel=_caller_stacklevel())


def cacheable(tensors) -> bool:
    """Whether :func:`cached_by_tensors` can cache on ``tensors``: the caches are enabled and no tensor
    is an inference tensor (those have no version counter to tell an in-place write)."""
    return _cache_enabled and not any(t.is_inference() for t in tensors)


def _tensor_key(t: torch.Tensor) -> tuple:
    """``(base, key)``: a view is keyed by its base tensor (whose version counter it shares) and its
    geometry, so a fresh view of the same weights each call (``w[layer]``) still hits."""
    base = t._base if t._base is not None else t
    return base, (id(base), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


_watched: dict = {}  # id -> weak reference of each base tensor with a finalizer registered (one per tensor)


def cached_by_tensors(tag: tuple, tensors: tuple, build, optional: bool = False):
    """``build()``, cached while every tensor of ``tensors`` lives with its current version counter.

    The key is ``tag`` plus each tensor's base identity and view geometry: an in-place write
    through any view sharing a tensor's version counter invalidates the entry, and entries die
    with their base tensors. Writes that bypass the version counter (``.data``, numpy or DLPack
    aliases) are not seen: clear the cache after them (:func:`clear_dequantized_weight_cache`). The
    entries hold at most the byte budget (:func:`set_dequantized_weight_cache`), least recently used
    dropped first (optional copies before required ones), never a cached copy among ``tensors`` (which
    the new entry needs); an ``optional`` copy is kept only if it fits without pushing out anything.
    ``build`` runs without autograd and outside inference mode (a cached value must not hold a graph,
    which would keep its keys alive, nor be an inference tensor, which a later call outside inference
    mode could not use with autograd) and may return None to decline (nothing cached, None returned).
    With the caches disabled or an inference tensor among ``tensors``, every call builds.

    Args:
        tag: a hashable tuple naming what ``build`` makes of the tensors (e.g. ``("dequantize", 1, 128,
            True)``): two callers caching different things on the same tensors use different tags.
        tensors: the tensors the value derives from (its key).
        build: a function of no arguments returning the value (any object; its bytes as :func:`_nbytes`
            counts them) or None.
        optional: the value is a copy callers can do without (a packed weight).
    Returns:
        The cached or built value, or None if ``build`` declined.
    Raises:
        deepep_ascend.settings.SettingError: ``DEEPEP_ASCEND_WEIGHT_CACHE_BYTES`` is not an int >= 0 (read at
            the caches' first use); whatever ``build`` raises.
    """
    global _cache_bytes
    if not cacheable(tensors):
        with torch.no_grad():
            return build()
    bases, keys = zip(*(_tensor_key(t) for t in tensors))
    key = tag + keys
    versions = tuple(t._version for t in tensors)
    stale = None
    with _locked():
        _max_bytes()  # a bad budget setting raises here, before anything is built
        hit = _cache.get(key)
        if hit is not None:
            if hit.versions == versions and all(r() is b for r, b in zip(hit.refs, bases)):
                _cache.move_to_end(key)
                _cache_stats["hits"] += 1
                return hit.value
            stale = _drop(key)
        _cache_stats["misses"] += 1
    hit = stale = None  # a stale entry's tensors die here, outside the lock
    with torch.inference_mode(False), torch.no_grad():
        out = build()
    if out is None:  # the builder declined (a copy that could not be kept)
        return None
    nbytes = _nbytes(out, tensors)
    evicted, new, full = [], [], False
    with _locked():
        if _cache_enabled:  # not switched off while building
            stale = _drop(key)  # another thread built it meanwhile
            budget = _max_bytes()
            room = budget - nbytes
            full = (nbytes + _cache_bytes > budget if optional else
                    nbytes + sum(e.nbytes for e in list(_cache.values()) if any(e.value is t for t in tensors))
                    > budget)
            if not full:
                evicted = _evict_to(room, protect=tensors)
                _cache[key] = _Entry(bases, versions, out, nbytes, optional)
                _cache_bytes += nbytes
                for b in bases:
                    ref = _watched.get(id(b))
                    if ref is None or ref() is not b:
                        _watched[id(b)] = weakref.ref(b)
                        new.append(b)
    for b in new:  # before anything that can raise (a warning filtered into an error)
        weakref.finalize(b, _forget, id(b))
    del stale
    if full or evicted:
        del evicted
        _warn_budget(nbytes, full)
    return out


def _forget(base_id: int) -> None:
    """A key tensor died (its finalizer): queue it; its entries are dropped at once, or when the section of the
    caches this thread is in ends (:func:`_locked`)."""
    _pending.append(base_id)
    if not getattr(_state, "depth", 0):
        _process_pending()


def _process_pending() -> None:
    """Drop the entries keyed on the dead tensors queued by :func:`_forget` (only entries whose reference to that
    tensor is dead: an id can be reused). Their values are released outside the lock (which can queue more)."""
    while _pending:
        with _section():  # not _locked(): its exit would come back here
            ids = set()
            while _pending:
                ids.add(_pending.popleft())
            for i in ids:
                ref = _watched.get(i)
                if ref is not None and ref() is None:
                    del _watched[i]
            entries = [_drop(k) for k, e in list(_cache.items())
                       if any(i in ids and r() is None for i, r in zip(e.ids, e.refs))]
        del entries
