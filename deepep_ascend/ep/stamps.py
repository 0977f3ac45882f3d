"""Stamps: telling that a call is handed exactly the tensors an earlier call made or took, unchanged since.

A stamp holds weak references to the tensors and their version counters (every in-place write torch
makes, through any view, bumps ``_version``). The Buffers use them to skip recomputing and re-validating
what they produced themselves: ``Buffer.dispatch`` trusts its own ``get_dispatch_layout`` outputs,
``combine`` and a cached dispatch the handle a synchronous dispatch returned (its seal),
``low_latency_combine`` its dispatch's routing and handle. A dead reference, another tensor or a
write since the stamp never matches, so a stale stamp only costs the full path. Nor does an inference
tensor (made under ``torch.inference_mode()``), which keeps no version counter: its writes cannot be seen.

Writes around torch (through ``.numpy()``, ``.data``, DLPack or a raw pointer) bump no counter, so a stamp
cannot see them. What such a write could turn into a read outside memory is checked again on every call
(a sealed handle's promised rows, ``arguments.check_handle_rows``); the rest is checked where it is used
(a dispatch whose routing mask disagrees with the counts raises ``RuntimeError``), and a low-latency
combine whose ``topk_idx`` was so written sums by its dispatch's routing.
"""

from __future__ import annotations

import weakref

__all__ = ["stamp", "stamp_matches", "written_since"]


def stamp(*tensors) -> tuple:
    """Weak references to ``tensors`` (None kept) and their version counters (-1 for an inference tensor)."""
    return tuple([None if t is None else (weakref.ref(t), -1 if t.is_inference() else t._version) for t in tensors])


def stamp_matches(stamped: tuple, *tensors) -> bool:
    """Whether ``tensors`` are the stamped ones, in order, none written since (never for an inference tensor)."""
    if len(stamped) != len(tensors):
        return False
    for s, t in zip(stamped, tensors):  # (a loop: a generator costs more than the checks, on every call)
        if s is None:
            if t is not None:
                return False
        elif t is None or s[0]() is not t or s[1] < 0 or t._version != s[1]:
            return False
    return True


def written_since(stamped: tuple, *tensors) -> int:
    """The position of the first of ``tensors`` that is the stamped tensor at that position and was written in place
    since the stamp (through torch); -1 if none is. A view of another tensor never counts: it shares its base's
    version counter, which a write anywhere in the base moves (the other half of a double buffer, say)."""
    for i, (s, t) in enumerate(zip(stamped, tensors)):
        if s is not None and t is not None and s[0]() is t and s[1] >= 0 and t._version != s[1] and t._base is None:
            return i
    return -1
