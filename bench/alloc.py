"""Cost of writing a per-call output into fresh host memory, with and without huge pages.

    python -m bench.alloc [--mbytes 211] [--iters 5]

Median time of copying a tensor into (a) a preallocated destination, (b) a fresh
``torch.empty`` (4 KiB page faults on first touch), (c) a fresh
:func:`deepep_ascend.ep.memory.empty` (huge pages advised before the first touch). (b)/(a) is what
an output costs without a caching allocator; (c)/(a) what the library's outputs cost.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from deepep_ascend.ep import memory as host


def _interleaved_medians_ms(fns, iters: int) -> list:
    """Median ms of each of ``fns`` over ``iters`` calls, timed in alternation after one warm-up
    call each, so that the host's drift during the run hits every function alike."""
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for _ in range(iters):
        for fn, ts in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return [statistics.median(ts) * 1e3 for ts in times]


def _median_ms(fn, iters: int) -> float:
    return _interleaved_medians_ms([fn], iters)[0]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mbytes", type=float, default=211.0, help="size of the copy in MB (1e6 B); "
                    "211 MB is recv_x at 4 ranks of the default benchmark")
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    src = torch.randn(int(args.mbytes * 1e6) // 4)
    dst = torch.empty_like(src)
    reused = _median_ms(lambda: dst.copy_(src), args.iters)
    fresh = _median_ms(lambda: torch.empty_like(src).copy_(src), args.iters)
    huge = _median_ms(lambda: host.empty(src.shape, src.dtype).copy_(src), args.iters)
    print(f"copy of {args.mbytes:.0f} MB: into reused memory {reused:.1f} ms; into fresh torch.empty "
          f"{fresh:.1f} ms ({fresh / reused:.1f}x); into fresh host.empty (huge pages) {huge:.1f} ms "
          f"({huge / reused:.1f}x)")


if __name__ == "__main__":
    main()
