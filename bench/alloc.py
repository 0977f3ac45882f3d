"""Cost of first-touching fresh host memory, with and without the malloc cache (one process).

    python -m bench.alloc [--mbytes 51] [--iters 5]

Prints the median time of copying a tensor into (a) a preallocated destination, (b) a fresh
``torch.empty`` each time with glibc's defaults, (c) a fresh ``torch.empty`` after
:func:`deepep_ascend.host.enable_malloc_cache`. (b)/(a) is what a per-call output costs
without a caching allocator; (c)/(a) with it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _median_ms(fn, iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mbytes", type=float, default=51.0, help="size of the copy in MB (1e6 B)")
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    src = torch.randn(int(args.mbytes * 1e6) // 4)
    dst = torch.empty_like(src)
    reused = _median_ms(lambda: dst.copy_(src), args.iters)
    fresh = _median_ms(lambda: torch.empty_like(src).copy_(src), args.iters)
    from deepep_ascend.host import enable_malloc_cache
    enabled = enable_malloc_cache()
    cached = _median_ms(lambda: torch.empty_like(src).copy_(src), args.iters)
    print(f"copy of {args.mbytes:.0f} MB: into reused memory {reused:.1f} ms; into fresh memory {fresh:.1f} ms "
          f"({fresh / reused:.1f}x); fresh with malloc cache{'' if enabled else ' (NOT applied)'} {cached:.1f} ms "
          f"({cached / reused:.1f}x)")


if __name__ == "__main__":
    main()
