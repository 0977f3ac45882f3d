"""The single-copy memory roofline: what a transport that moves each byte with one copy cannot beat."""
from __future__ import annotations

import torch

from bench.timing import time_phases


def memcpy_roofline(comm, dispatch_bytes: int, combine_bytes: int, iters: int, warmup: int,
                    fresh_dst: bool = False) -> dict:
    """The single-copy memory roofline (collective).

    Every rank, concurrently and barrier-synchronised like the systems, copies its own dispatch
    bytes once (one ``uint8`` ``copy_`` of ``dispatch_bytes``) and then its combine bytes once.
    Returns ``{'dispatch', 'combine', 'round_trip'}`` → :class:`Timing` (max over ranks per
    iteration). A one-copy transport cannot beat ``round_trip``; ``system / roofline`` says how
    many copies' worth of time a system spends.

    ``fresh_dst=True`` copies into a newly allocated tensor each time (``clone``) instead of a
    preallocated one: the floor for an API that returns fresh tensors on a CPU without a caching
    allocator, where first-touch page faults can cost several times the copy itself.
    """
    src_d = torch.ones(max(int(dispatch_bytes), 1), dtype=torch.uint8)
    src_c = torch.ones(max(int(combine_bytes), 1), dtype=torch.uint8)
    if fresh_dst:
        phases = [("dispatch", lambda: src_d.clone()), ("combine", lambda: src_c.clone())]
    else:
        dst_d, dst_c = torch.empty_like(src_d), torch.empty_like(src_c)
        phases = [("dispatch", lambda: dst_d.copy_(src_d)), ("combine", lambda: dst_c.copy_(src_c))]
    t = time_phases(phases, comm, iters, warmup)
    t["round_trip"] = t["dispatch"] + t["combine"]
    return t
