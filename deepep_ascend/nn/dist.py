"""Start-up helpers: torch.distributed from an ``mpiexec`` launch, EP/DP groups, group → MPI communicator.

DeepEP's training code runs under ``torchrun`` with NCCL and hands ``Buffer`` a ProcessGroup.
Here the launcher is ``mpiexec`` and the collectives of the model (gradient all-reduce,
statistics) run over gloo, so these helpers set torch.distributed up with the MPI rank and size
and a rendezvous address agreed over MPI; ``Buffer`` then accepts the torch groups directly
(torch ranks equal MPI ranks)::

    from deepep_ascend import Buffer
    from deepep_ascend.nn import dist as ep_dist
    ep_dist.init_distributed()                        # gloo, rank/size from MPI
    groups = ep_dist.build_groups(ep_size=4)         # EP blocks of 4 ranks, DP across them
    buffer = Buffer(groups.ep_group, num_nvl_bytes)  # or Buffer(None, ..., comm=ep_dist.mpi_comm_of(g))

Group layout (``W`` ranks, ``ep_size`` dividing ``W``): EP group ``i`` is ranks
``[i*ep_size, (i+1)*ep_size)`` (contiguous, so an EP group stays inside a node when nodes are
contiguous rank blocks, as under ``mpiexec``); the expert-DP group of EP position ``j`` is ranks
``{j, j + ep_size, j + 2*ep_size, ...}`` (the replicas of the same experts). The dense (non-expert)
parameters are replicated on every rank, so their DP group is the whole world.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch.distributed as tdist

from ..checks import is_int
from ..ep.group import check_agreed
from ..ep.group import mpi_comm_of as _resolve
from ..transports import quiet_barrier

if TYPE_CHECKING:
    from mpi4py import MPI

__all__ = ["ParallelGroups", "build_groups", "init_distributed", "mpi_comm_of", "world_comm"]


def world_comm() -> MPI.Intracomm:
    """``mpi4py.MPI.COMM_WORLD``."""
    from mpi4py import MPI

    return MPI.COMM_WORLD


def init_distributed(backend: str = "gloo", timeout_s: float = 600.0, comm=None,
                     master_addr: str | None = None) -> tuple[int, int]:
    """Initialise ``torch.distributed`` from an ``mpiexec`` launch (collective over ``comm``).

    Rank and world size come from ``comm`` (default ``MPI.COMM_WORLD``). The rendezvous is agreed
    over MPI, not taken from ``$MASTER_ADDR``/``$MASTER_PORT`` (a stale port left there by an
    earlier group would be reused): rank 0 picks a free TCP port and broadcasts it; the address is
    ``master_addr`` if given, else ``127.0.0.1`` on one host (gloo then binds to the loopback
    interface unless ``GLOO_SOCKET_IFNAME`` is set), else rank 0's host address. An already
    initialised default group is kept after checking that its rank and size equal MPI's.

    Returns:
        ``(rank, world_size)``.
    Raises:
        RuntimeError: torch.distributed is already initialised with another rank or size.
    """
    comm = comm or world_comm()
    rank, size = comm.Get_rank(), comm.Get_size()
    if tdist.is_initialized():
        if tdist.get_rank() != rank or tdist.get_world_size() != size:
            raise RuntimeError(f"init_distributed: torch.distributed is initialised with rank/size "
                               f"{tdist.get_rank()}/{tdist.get_world_size()}, MPI has {rank}/{size}")
        return rank, size
    # the first collective: ranks that arrive early must not spin (transports.quiet_barrier)
    quiet_barrier(comm, phase="init_distributed (every rank)")
    hosts = comm.allgather(socket.gethostname())
    one_host = len(set(hosts)) == 1 and master_addr is None
    port = None
    if rank == 0:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1" if one_host else "", 0))
            port = s.getsockname()[1]
    port = comm.bcast(port, root=0)
    addr = master_addr or ("127.0.0.1" if one_host else socket.gethostbyname(hosts[0]))
    if one_host:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    tdist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=size,
                             timeout=datetime.timedelta(seconds=timeout_s))
    return rank, size


@dataclass
class ParallelGroups:
    """The groups of one rank. ``ep_group``: the ranks sharing one set of experts through ``Buffer``;
    ``expert_dp_group``: the ranks holding the same experts (size ``W / ep_size``; gradients of
    expert parameters are summed over it); ``dp_group``: all ranks (dense parameters)."""

    ep_group: object
    expert_dp_group: object
    dp_group: object
    ep_size: int
    ep_rank: int
    expert_dp_size: int
    expert_dp_rank: int
    ep_ranks: tuple
    expert_dp_ranks: tuple


def build_groups(ep_size: int | None = None) -> ParallelGroups:
    """Build the EP and DP groups (collective over the world; call after :func:`init_distributed`).

    Every rank creates every group in the same order, as ``torch.distributed.new_group`` needs.
    ``ep_size`` defaults to the world size (pure EP; the expert-DP groups then have one rank).

    Raises:
        ValueError: on every rank: ``ep_size`` does not divide the world size, or the ranks passed different
            values (each rank's is named; groups built from different sizes would leave ranks waiting in
            ``new_group``).
    """
    from mpi4py import MPI

    world = tdist.get_world_size()
    rank = tdist.get_rank()
    ep_size = world if ep_size is None else ep_size
    error = None
    if not is_int(ep_size) or ep_size < 1 or world % ep_size:
        error = ValueError(f"build_groups: ep_size={ep_size!r} must divide the world size {world} (a positive int)")
    check_agreed(MPI.COMM_WORLD, "build_groups", {"ep_size": None if error else int(ep_size)}, error)
    ep_size = int(ep_size)
    dp = world // ep_size
    ep_group = dp_group_e = None
    ep_ranks = edp_ranks = ()
    for i in range(dp):
        ranks = tuple(range(i * ep_size, (i + 1) * ep_size))
        g = tdist.group.WORLD if dp == 1 else tdist.new_group(list(ranks))
        if rank in ranks:
            ep_group, ep_ranks = g, ranks
    for j in range(ep_size):
        ranks = tuple(range(j, world, ep_size))
        g = tdist.group.WORLD if ep_size == 1 else tdist.new_group(list(ranks))
        if rank in ranks:
            dp_group_e, edp_ranks = g, ranks
    return ParallelGroups(ep_group=ep_group, expert_dp_group=dp_group_e, dp_group=tdist.group.WORLD,
                          ep_size=ep_size, ep_rank=ep_ranks.index(rank), expert_dp_size=dp,
                          expert_dp_rank=edp_ranks.index(rank), ep_ranks=ep_ranks, expert_dp_ranks=edp_ranks)


def mpi_comm_of(group) -> MPI.Intracomm:
    """The mpi4py communicator with ``group``'s ranks in ``group``'s order (collective over the group).

    Uses the same mapping as ``Buffer(group, ...)`` (torch ranks must equal MPI ``COMM_WORLD``
    ranks, as after :func:`init_distributed`); the result is cached per group, so later calls
    are local. ``None`` or the world group give ``MPI.COMM_WORLD``; an mpi4py communicator is
    returned as is.

    Raises:
        ValueError: torch and MPI ranks differ, or ``group`` is neither a ProcessGroup nor a communicator.
    """
    from mpi4py import MPI

    return _resolve(MPI.COMM_WORLD if group is None else group, owner="nn.dist.mpi_comm_of")
