"""URMA put bandwidth between two simulated nodes, per window exposure (docs/design/transports.md §4).

Run with two ranks, one per simulated node::

    mpiexec -n 2 python -m bench urma-put                                   # default exposure
    DEEPEP_ASCEND_URMA_EXPOSURE=create mpiexec -n 2 python -m bench urma-put

Rank 0 ``put_with_signal``s ``--bytes`` (default 4 MiB) into rank 1's window ``--iters`` times;
rank 1 waits for each signal in the transport's normal wait loop (which sleeps between polls when
ranks outnumber cores). Prints the exposure, median and min time per put and GB/s (1e9 B/s).
The ``allocate`` exposure (``MPI_Win_allocate``) lets MPICH copy directly on one host; the
``create`` exposure (``MPI_Win_create`` over node-shared segments) goes through active messages
that land only while the target is inside MPI. ``--json FILE``: the result ``urma/put_with_signal``
(rank 0's times; bytes: the payload of one put), the exposure in ``details``.
"""
from __future__ import annotations

import statistics
import time

import torch

from bench import cli, schema
from bench.timing import Timing, each_step


def add_arguments(p) -> None:
    """The command's options: the shared ones (``bench.cli``) and its own."""
    p.add_argument("--bytes", type=cli.int_at_least(1), default=4 << 20, help="payload per put (default 4 MiB)")
    cli.add_shared(p, iters=10, warmup=1, json=None, helps=dict(warmup="the first puts also map the target's pages"))


def check_args(p, a) -> None:
    """The job's size: exactly 2 ranks (``p.error``, argparse's usage error, printed by rank 0 alone)."""
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_size() != 2:
        p.error(f"runs on exactly 2 ranks (mpiexec -n 2), got {MPI.COMM_WORLD.Get_size()}")


def run(args) -> int:
    """Run the put loop (collective over exactly 2 ranks); rank 0 prints the result line. Returns 0."""
    torch.set_num_threads(1)
    from mpi4py import MPI

    from deepep_ascend.settings import URMA_EXPOSURE
    from deepep_ascend.transports import create_transport

    comm = MPI.COMM_WORLD
    exposure = URMA_EXPOSURE.get()  # as the transport reads it
    r = comm.Get_rank()
    tp = create_transport(comm, ranks_per_node=1)
    held = {"win": tp.create_window("bench", args.bytes, 1)}  # dropped before tp.destroy()
    src = torch.ones(args.bytes, dtype=torch.uint8)
    puts = [0]

    def put() -> float | None:
        """One put and its signal; rank 0 returns its seconds (the origin's), rank 1 waits for the signal."""
        puts[0] += 1
        if r == 0:
            t = time.perf_counter()
            tp.put_with_signal(held["win"], 1, 0, src, 0)
            return time.perf_counter() - t
        tp.wait_until(held["win"], 0, [0], puts[0], phase="bench")
        return None

    rows = each_step([("put", put)], comm, args.iters, args.warmup, lambda fn: fn())  # a barrier before each put
    times = [row["put"] for row in rows if "put" in row]  # rank 0's
    comm.Barrier()
    if r == 0:
        med = statistics.median(times)
        print(f"[urma_put] exposure {exposure} | "
              f"{args.bytes} B x {args.iters} | median {med * 1e3:.3f} ms (min {min(times) * 1e3:.3f}) | "
              f"{args.bytes / med / 1e9:.2f} GB/s", flush=True)
        if args.json:
            schema.write(args.json, schema.document(
                "urma-put", argv=args._argv, params=cli.params_of(args, comm.Get_size()),
                results=[schema.result("urma/put_with_signal", None, timing=Timing(times), nbytes=args.bytes,
                                       formula="payload of one put")],
                checks=dict(ok=True), details=dict(exposure=exposure, timed_on="rank 0 (the origin)")))
    held.clear()
    tp.destroy()
    return 0


def main(argv=None) -> int:
    """``python -m bench urma-put`` in-process, without the MPI exit path (tests)."""
    from bench import commands

    return commands.call("urma-put", argv)


if __name__ == "__main__":
    from bench import commands

    commands.alias("urma-put")
