"""The backend-neutral transport contract, its wait policy and its lifetime states (docs/design/transports.md §2).

A :class:`Transport` moves bytes and monotonic signals between ranks through symmetric
windows. It knows ranks, byte ranges and counters, never tokens. Backends: UBMEM
(:mod:`transports.ubmem`, load/store inside a node over MPI shared memory); URMA
(one-sided MPI RMA between nodes, :mod:`transports.urma`).
"""

from __future__ import annotations

import enum
import math
import numbers
import os
import time
from collections.abc import Iterator

from ..settings import TIMEOUT_S


def resolve_timeout(timeout_s: float | None) -> float:
    """The deadline in seconds: the argument, else ``$DEEPEP_ASCEND_TIMEOUT_S``, else its default (100 s,
    DeepEP's host-side wait).

    Raises:
        ValueError: the argument is not a positive, finite number (:func:`timeout_problem`); ``SettingError``
            (a ValueError naming the variable): the variable is not.
    """
    if timeout_s is None:
        return float(TIMEOUT_S.get())
    problem = timeout_problem("timeout_s", timeout_s)
    if problem is not None:
        raise ValueError(problem)
    return float(timeout_s)


def timeout_problem(name: str, timeout_s) -> str | None:
    """Why ``timeout_s`` (argument ``name``) is no deadline, or None: a deadline is a positive, finite real number
    of seconds (numpy's included, not a bool; an infinite one would let a wait hang, and NaN compares unequal to
    itself on every rank)."""
    if isinstance(timeout_s, bool) or not (isinstance(timeout_s, numbers.Real) and 0 < timeout_s < math.inf):
        return f"{name} must be a positive, finite number of seconds, got {timeout_s!r}"
    return None


class State(enum.Enum):
    OPEN = "open"
    POISONED = "poisoned"
    CLOSED = "closed"


class Team(enum.IntEnum):
    """Barrier teams: every rank, the ranks of this node, the rail (same local rank on every node)."""

    WORLD = 0
    NODE = 1
    RAIL = 2


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


QUIET_BARRIER_TAG = 32_701  # point-to-point tag of quiet_barrier over a subset of ranks (MPI guarantees tags <= 32767)


def quiet_barrier(comm, ranks=None, timeout_s: float | None = None, phase: str = "") -> None:
    """Wait until every rank of ``comm`` (or only ``ranks``, ranks of ``comm``) arrives, polling
    non-blocking MPI and sleeping as :class:`WaitPolicy` does, instead of entering a blocking
    collective at once.

    Whole communicator: ``MPI_Ibarrier``. A subset (before its communicator exists, e.g. ahead of
    ``MPI_Comm_create_group``): every listed rank sends an empty message tagged
    ``QUIET_BARRIER_TAG`` on ``comm`` to the first listed rank, which answers each once all have
    arrived; only the listed ranks call it, each with the same list.

    MPICH's blocking collectives wait in a ``sched_yield`` loop; when ranks outnumber cores, ranks
    that arrive early take most of the CPU from the one still working toward the call (a 4-rank
    test once ran past its 180 s watchdog with three ranks in ``MPI_Comm_create_group`` and the
    fourth still making its data). Called before the first collective of a construction, where
    ranks arrive furthest apart; the blocking collectives after it then find everyone there.
    The wait has the deadline ``timeout_s`` (:func:`resolve_timeout`: else ``$DEEPEP_ASCEND_TIMEOUT_S``);
    a rank that spends longer loading data before a constructor needs a larger one.

    Raises:
        TransportTimeout: a rank did not arrive by the deadline (``phase`` names the step; the root of a
            subset names the ranks that did not arrive, a whole-communicator barrier cannot).
    """
    import numpy as np

    n = comm.Get_size()
    timeout = resolve_timeout(timeout_s)
    if ranks is None:
        quiet_wait([comm.Ibarrier()], n, timeout, phase, comm.Get_rank())
        return
    ranks, me, empty = list(ranks), comm.Get_rank(), np.empty(0, dtype=np.uint8)
    root, others = ranks[0], ranks[1:]
    if me == root:
        quiet_wait([comm.Irecv(empty, source=r, tag=QUIET_BARRIER_TAG) for r in others], n, timeout, phase, me,
                   others)
        quiet_wait([comm.Isend(empty, dest=r, tag=QUIET_BARRIER_TAG) for r in others], n, timeout, phase, me, others)
    else:
        quiet_wait([comm.Isend(empty, dest=root, tag=QUIET_BARRIER_TAG)], n, timeout, phase, me, [root])
        quiet_wait([comm.Irecv(empty, source=root, tag=QUIET_BARRIER_TAG)], n, timeout, phase, me, [root])


def quiet_wait(requests, local_ranks: int, timeout_s: float | None = None, phase: str = "", rank: int = -1,
               peers=None) -> None:
    """Complete the MPI ``requests`` by polling ``MPI_Testall`` and pausing between polls as
    :class:`WaitPolicy` does for ``local_ranks`` ranks on this host (a short yield phase, then sleeps, when they
    outnumber the cores), instead of a blocking wait that spins in ``sched_yield`` until it completes.

    Args:
        timeout_s: the deadline in seconds (None: none; the library's callers pass one). phase, rank: named in
            the error. peers: the ranks request ``i`` waits for (``peers[i]``), or None (a collective).
    Raises:
        TransportTimeout: a request is incomplete at the deadline (the pending ranks named where ``peers``
            says which).
    """
    from mpi4py import MPI

    from .errors import TransportTimeout

    pauses = WaitPolicy(local_ranks=local_ranks).pauses()
    start = time.monotonic()
    while not MPI.Request.Testall(requests):
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            pending = [] if peers is None else [p for p, r in zip(peers, requests) if not r.Test()]
            raise TransportTimeout("collective", rank, pending, time.monotonic() - start, phase=phase)
        pause = next(pauses)
        if pause:
            time.sleep(pause)


def quiet_allgather_object(comm, obj, timeout_s: float | None = None, phase: str = "") -> list:
    """Every rank's picklable ``obj`` in rank order (:func:`allgather_object`), waiting with :func:`quiet_wait`:
    for collective constructors, before any transport exists, with the deadline ``timeout_s``
    (:func:`resolve_timeout`).

    Raises:
        TransportTimeout: a rank did not take part by the deadline (``phase`` names the step).
    """
    timeout, me = resolve_timeout(timeout_s), comm.Get_rank()
    return allgather_object(comm, obj, lambda req: quiet_wait([req], comm.Get_size(), timeout, phase, me))


def allgatherv_bytes(comm, data, counts: list, wait) -> list:
    """Every rank's ``uint8`` array ``data`` (``counts[r]`` bytes on rank ``r``, known everywhere), in rank order,
    as views of one receive buffer: one ``MPI_Iallgatherv`` on ``comm``, completed by ``wait(request)``."""
    import numpy as np
    from mpi4py import MPI

    displs = np.concatenate(([0], np.cumsum(counts[:-1], dtype=np.int64))).tolist() if counts else []
    recv = np.empty(sum(counts), dtype=np.uint8)
    wait(comm.Iallgatherv([data, MPI.BYTE], [recv, (counts, displs), MPI.BYTE]))
    return [recv[d:d + n] for d, n in zip(displs, counts)]


def allgather_object(comm, obj, wait) -> list:
    """Every rank's picklable ``obj``, in rank order: an ``MPI_Iallgather`` of the pickled sizes, then
    :func:`allgatherv_bytes`, each request completed by ``wait(request)`` (a polled wait that sleeps, so that
    no rank spins in a blocking collective, and may have a deadline)."""
    import pickle

    import numpy as np

    data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
    sizes = np.zeros(comm.Get_size(), dtype=np.int64)
    wait(comm.Iallgather(np.array([data.size], dtype=np.int64), sizes))
    return [pickle.loads(part.tobytes()) for part in allgatherv_bytes(comm, data, sizes.tolist(), wait)]


class WaitPolicy:
    """How a waiting rank spends its time (docs/design/transports.md §3.4).

    Measured on 2 cores: spinning collapses to milliseconds per hand-off once ranks
    outnumber cores (the spinners starve the rank that must signal), while short sleeps give
    a steady ~50 µs. So an oversubscribed rank never spins: it yields (``sched_yield``, which hands
    its core to a runnable peer at once) for up to 1 ms, then sleeps from 50 µs doubling to 200 µs
    (a longer sleep is latency added to every hand-off that ends during it, with the cores idle).
    Otherwise it spins ~200 polls, yields for up to 50 µs, then sleeps from 2 µs doubling to 200 µs.

    Args:
        local_ranks: ranks sharing this host; ``oversubscribed`` when they outnumber the cores
            this process may run on.
    """

    def __init__(self, local_ranks: int):
        self.oversubscribed = local_ranks > _cpu_count()

    def pauses(self) -> Iterator[float]:
        """Yield, once per unsuccessful poll, how long to pause: 0 = poll again now."""
        if self.oversubscribed:
            # a sleep lasts its length plus the timer slack; a yield lets the rank being waited for run now
            start = time.monotonic()
            while time.monotonic() - start < 1e-3:
                os.sched_yield()
                yield 0.0
            sleep = 50e-6
            while True:
                yield sleep
                sleep = min(sleep * 2, 200e-6)
        for _ in range(200):
            yield 0.0
        start = time.monotonic()
        while time.monotonic() - start < 50e-6:
            os.sched_yield()
            yield 0.0
        sleep = 2e-6
        while True:
            yield sleep
            sleep = min(sleep * 2, 200e-6)
