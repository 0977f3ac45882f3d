"""Child job of ``test_transports_urma.py::test_urma_over_tcp``: URMA over the real network path.

Launched as ``mpiexec -n 4 python nested_urma_tcp.py`` with ``MPIR_CVAR_NUM_CLIQUES=2
MPIR_CVAR_CLIQUES_BY_BLOCK=1 UCX_TLS=tcp,self`` and ``DEEPEP_ASCEND_RANKS_PER_NODE=2``: MPICH
treats ranks {0, 1} and {2, 3} as two hosts and carries RMA between them over UCX/TCP active
messages, which land only while the target is inside MPI (docs/design/transports.md §4.1, §4.3). Not a test
module (no ``test_`` prefix). When every check passed, each rank writes ``<rank> URMA-TCP-OK
<seconds>`` to ``$DEEPEP_ASCEND_NESTED_REPORT/rank<r>.txt`` (a file: mpiexec interleaves the
ranks' output mid-line); any failure raises (non-zero exit, mpiexec ends the job).
"""

from __future__ import annotations

import os
import sys
import time

import torch
from mpi4py import MPI

from deepep_ascend import settings
from deepep_ascend.transports import (
    ChannelKind,
    State,
    Team,
    TransportTimeout,
    create_transport,
)


def ramp(nbytes: int, seed: int) -> torch.Tensor:
    return ((torch.arange(nbytes, dtype=torch.int64) + seed * 37) % 251).to(torch.uint8)


def check(cond: bool, what: str) -> None:
    if not cond:
        raise AssertionError(f"rank {MPI.COMM_WORLD.rank}: {what}")


def main() -> None:
    comm = MPI.COMM_WORLD
    t0 = time.monotonic()
    tp = create_transport(comm)
    me, n, rpn = tp.topology.rank, tp.topology.world_size, tp.topology.ranks_per_node
    check((n, rpn, tp.topology.num_nodes) == (4, 2, 2), f"expected 4 ranks in 2 nodes, got {tp.topology}")
    rail = (me + rpn) % n
    check(tp.topology.kind(me, rail) is ChannelKind.URMA, "rail peer is not URMA")
    size = 256 * 1024 + 5
    win = tp.create_window("tcp", 2 * size + 4096, 4)
    DATA, ACK, B, C = 0, 1, 2, 3

    # put_with_signal rounds with the payload checked, double-buffered with acks.
    rounds = 60
    for i in range(1, rounds + 1):
        b = i % 2
        if i > 2:
            tp.wait_until(win, ACK, [rail], i - 2)
        check(tp.put_with_signal(win, rail, b * size, ramp(size, me * 1000 + i), DATA) == i, "signal value")
        tp.wait_until(win, DATA, [rail], i)
        check(torch.equal(tp.local_view(win, b * size, size), ramp(size, rail * 1000 + i)), f"round {i} payload")
        tp.signal(win, rail, ACK)

    # barrier per team, each publishing a put to the next member (own words per team: the teams of
    # different nodes run unsynchronised until the world barrier closing each team).
    for team in Team:
        members = tp.team_ranks(team)
        nxt = members[(members.index(me) + 1) % len(members)]
        prv = members[(members.index(me) - 1) % len(members)]
        for g in range(1, 11):
            off = 2 * size + 6 + 16 * team + (g % 2) * 8  # 8-aligned
            tp.put(win, nxt, off, torch.tensor([g * 100 + me], dtype=torch.int64))
            tp.barrier(team)
            got = int(tp.local_view(win, off, 8, torch.int64)[0])
            check(got == g * 100 + prv, f"barrier {team.name} gen {g}: got {got}")
        tp.barrier()

    # get from every rank after a barrier.
    tp.local_view(win, 0, size).copy_(ramp(size, 7 + me))
    tp.barrier()
    for p in range(n):
        out = torch.empty(size, dtype=torch.uint8)
        tp.get(win, p, 0, out)
        check(torch.equal(out, ramp(size, 7 + p)), f"get from rank {p}")
    tp.barrier()

    # progress: t = 2 waits only for its node peer u = 3 (UBMEM); s = 0 (other node) must complete a
    # 256 KiB put + put_with_signal to t before u is released, which over TCP needs t's progress.
    s, t, u = 0, 2, 3
    if me == t:
        tp.wait_until(win, B, [u], 1)
        check(tp.read_signal(win, DATA, s) == rounds + 1, "URMA signal landed during the UBMEM wait")
        check(torch.equal(tp.local_view(win, size, size), ramp(size, 4242)), "URMA data landed during the wait")
    elif me == s:
        time.sleep(0.2)
        tp.put(win, t, size, ramp(size, 4242))
        tp.put_with_signal(win, t, 0, ramp(8, 1), DATA)
        tp.signal(win, u, C)
    elif me == u:
        tp.wait_until(win, C, [s], 1)
        tp.signal(win, t, B)
    tp.barrier()
    stats = tp.stats.snapshot()
    check(int(stats["bytes_put"][ChannelKind.URMA].sum()) > rounds * size, "URMA bytes counted")
    tp.destroy()

    # a wait that expires names the rank on the other node.
    tp = create_transport(comm, timeout_s=30)
    win = tp.create_window("tcp_timeout", 0, 1)
    tp.barrier()
    if me == 0:
        try:
            tp.wait_until(win, 0, [3], 1, timeout_s=2.0)
            check(False, "no timeout")
        except TransportTimeout as exc:
            check(exc.pending_peers == [3] and "slot 0" in str(exc), str(exc))
            check(tp.state is State.POISONED, "not poisoned")
    comm.Barrier()
    tp.destroy()
    line = f"{me} URMA-TCP-OK {time.monotonic() - t0:.2f}\n"
    sys.stdout.write(line)
    with open(os.path.join(settings.NESTED_REPORT.get(), f"rank{me}.txt"), "w") as f:
        f.write(line)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
