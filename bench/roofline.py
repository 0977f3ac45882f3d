"""The single-copy memory roofline: what a transport that moves each byte with one copy cannot beat."""
from __future__ import annotations

import mmap

import torch

from bench.timing import time_phases


def memcpy_roofline(comm, dispatch_bytes: int, combine_bytes: int, iters: int, warmup: int,
                    fresh_dst: bool = False, fresh_combine_src: bool = False, experts=None) -> dict:
    """The single-copy memory roofline (collective).

    Every rank, concurrently and barrier-synchronised like the systems, copies its own dispatch
    bytes once (one ``uint8`` ``copy_`` of ``dispatch_bytes``) and then its combine bytes once.
    Returns ``{'dispatch', 'combine', 'round_trip'}`` → :class:`Timing` (max over ranks per
    iteration). A one-copy transport cannot beat ``round_trip``; ``system / roofline`` says how
    many copies' worth of time a system spends.

    ``fresh_dst=True`` copies into a newly allocated tensor each time (``clone``) instead of a
    preallocated one: the floor for an API that returns fresh tensors on a CPU without a caching
    allocator, where first-touch page faults can cost several times the copy itself.

    ``fresh_combine_src=True`` copies the combine bytes from new pages (an anonymous mapping) written
    just before (untimed), as a combine finds the experts' outputs of a step (``bench.low_latency``'s
    experts write theirs into new pages too): the floor for a call whose input is new memory, which
    reads slower than the one buffer the plain roofline copies again and again.

    ``experts`` (with ``fresh_combine_src``): a callable run (untimed) between the two copies, the benchmark's
    own experts on rows of the received shape. A system's copies find the caches as the experts' step left
    them (its inputs idle for as long as that step, its working set through the caches); this roofline's
    copies then do too. The step's own time is returned as ``'experts'`` (not in ``round_trip``).
    """
    src_d = torch.ones(max(int(dispatch_bytes), 1), dtype=torch.uint8)
    src_c = torch.ones(max(int(combine_bytes), 1), dtype=torch.uint8)
    if fresh_combine_src:
        dst_d, dst_c = torch.empty_like(src_d), torch.empty_like(src_c)
        made = {}

        def produce():  # the experts' step: new pages, written once
            made["c"] = torch.frombuffer(mmap.mmap(-1, src_c.numel()), dtype=torch.uint8).fill_(1)
        phases = [("dispatch", lambda: dst_d.copy_(src_d)), *([("experts", experts)] if experts is not None else []),
                  (None, produce), ("combine", lambda: dst_c.copy_(made["c"]))]
    elif experts is not None:
        raise ValueError("memcpy_roofline: experts needs fresh_combine_src=True")
    elif fresh_dst:
        phases = [("dispatch", lambda: src_d.clone()), ("combine", lambda: src_c.clone())]
    else:
        dst_d, dst_c = torch.empty_like(src_d), torch.empty_like(src_c)
        phases = [("dispatch", lambda: dst_d.copy_(src_d)), ("combine", lambda: dst_c.copy_(src_c))]
    t = time_phases(phases, comm, iters, warmup)
    t["round_trip"] = t["dispatch"] + t["combine"]
    return t


def roofline_after_experts(comm, dispatch_bytes: int, combine_bytes: int, iters: int, warmup: int, rows: int,
                           hidden: int, fp8: bool) -> dict:
    """:func:`memcpy_roofline` with the benchmarks' identity experts step between the copies (collective):
    ``rows`` received FP8 rows ``[rows, hidden]`` (a float32 scale per 128 channels) cast back to BF16 by
    :func:`bench.workload.per_token_cast_back`, as ``bench ep`` and ``bench low-latency`` do with what they
    receive; BF16 identity experts hand the rows on and do nothing. The combine's bytes come from new pages
    (``fresh_combine_src``). Returns the same ``{'dispatch', 'combine', 'round_trip'}`` timings, and with FP8
    ``'experts'``, the step's time."""
    from bench.workload import per_token_cast_back

    experts = None
    if fp8:
        # values like the received rows': torch's cast back takes longer on them than on zeros
        codes = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(0)).to(torch.float8_e4m3fn)
        scales = torch.ones(rows, hidden // 128)

        def experts():
            per_token_cast_back(codes, scales)
    return memcpy_roofline(comm, dispatch_bytes, combine_bytes, iters, warmup, fresh_combine_src=True,
                           experts=experts)
