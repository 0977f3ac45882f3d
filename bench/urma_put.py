"""URMA put bandwidth between two simulated nodes, per window exposure (transports §4).

Run with two ranks, one per simulated node::

    mpiexec -n 2 python -m bench.urma_put                                   # default exposure
    DEEPEP_ASCEND_URMA_EXPOSURE=create mpiexec -n 2 python -m bench.urma_put

Rank 0 ``put_with_signal``s ``--bytes`` (default 4 MiB) into rank 1's window ``--iters`` times;
rank 1 waits for each signal in the transport's normal wait loop (which sleeps between polls when
ranks outnumber cores). Prints the exposure, median and min time per put and GB/s (1e9 B/s).
The ``allocate`` exposure (``MPI_Win_allocate``) lets MPICH copy directly on one host; the
``create`` exposure (``MPI_Win_create`` over node-shared segments) goes through active messages
that land only while the target is inside MPI.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> int:
    """Run the put loop (collective over exactly 2 ranks); rank 0 prints the result line. Returns 0."""
    p = argparse.ArgumentParser(prog="python -m bench.urma_put", description=__doc__.split("\n")[0])
    p.add_argument("--bytes", type=int, default=4 << 20, help="payload per put (default 4 MiB)")
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args()
    torch.set_num_threads(1)
    from deepep_ascend.transports import create_transport
    from mpi4py import MPI

    from deepep_ascend.settings import URMA_EXPOSURE

    comm = MPI.COMM_WORLD
    if comm.Get_size() != 2:
        raise SystemExit("run with exactly 2 ranks (mpiexec -n 2)")
    r = comm.Get_rank()
    tp = create_transport(comm, ranks_per_node=1)
    win = tp.create_window("bench", args.bytes, 1)
    src = torch.ones(args.bytes, dtype=torch.uint8)
    times = []
    for i in range(args.iters + 1):
        comm.Barrier()
        if r == 0:
            t = time.perf_counter()
            tp.put_with_signal(win, 1, 0, src, 0)
            times.append(time.perf_counter() - t)
        else:
            tp.wait_until(win, 0, [0], i + 1, phase="bench")
    comm.Barrier()
    if r == 0:
        times = times[1:]  # the first put also maps the target's pages
        med = statistics.median(times)
        print(f"[urma_put] exposure {URMA_EXPOSURE.get()} | "
              f"{args.bytes} B x {args.iters} | median {med * 1e3:.3f} ms (min {min(times) * 1e3:.3f}) | "
              f"{args.bytes / med / 1e9:.2f} GB/s", flush=True)
    del win
    tp.destroy()
    return 0


if __name__ == "__main__":
    from bench import common as C

    C.run_main(main)  # the benchmarks' exit path (barrier, MPI_Finalize, exit; MPI_Abort if a rank raises)
