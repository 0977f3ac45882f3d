"""DeepEP's ``group`` argument on MPI: a torch ProcessGroup or an mpi4py communicator -> the communicator used.

Every object that takes a ``group`` (``Buffer``, MegaMoE's symmetric buffer, :mod:`deepep_ascend.nn.dist`)
resolves it here, so that every such object over the same ranks shares one communicator.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import settings
from ..transports import Topology, quiet_allgather_object, quiet_barrier, timeout_problem

if TYPE_CHECKING:
    from mpi4py import MPI

__all__ = ["check_agreed", "get_logical_domain_size", "get_physical_domain_size", "mpi_comm_of", "resolve_deadline"]

_GROUP_COMMS: dict = {}  # a ProcessGroup's ranks, in its order -> the mpi4py communicator made for them


def mpi_comm_of(group, comm=None, owner: str = "Buffer") -> MPI.Intracomm:
    """Resolve DeepEP's ``group`` / ``comm`` pair to an mpi4py intracommunicator (collective over the group
    the first time a ProcessGroup other than the world is seen).

    ``group``: a ``torch.distributed.ProcessGroup`` (torch ranks must equal MPI ``COMM_WORLD`` ranks, as
    after :func:`deepep_ascend.nn.dist.init_distributed`), an mpi4py communicator, or ``None`` with
    ``comm`` an mpi4py intracommunicator.

    A ProcessGroup spanning the world in rank order is ``MPI.COMM_WORLD`` itself (the transport
    duplicates what it is given, so no communicator is made here). Any other ProcessGroup gets one
    ``MPI_Comm_create_group`` communicator, cached by its ranks in its order (every group over the
    same ranks in the same order shares it), so constructing many Buffers on a group, or on groups
    destroyed and made again, neither leaks communicators nor repeats the collective. The key is
    what every member computes alike: a key by the group object's identity once differed between
    ranks after ``destroy_process_group`` (a recycled ``id``), and the ranks without a cache hit
    waited forever for the others in ``MPI_Comm_create_group``.

    Raises:
        ValueError: neither a ProcessGroup nor a communicator; torch and MPI ranks differ; this rank is
            not a member of ``group`` (each message begins with ``owner``, the caller's name).
    """
    from mpi4py import MPI

    if isinstance(group, MPI.Comm):
        return group
    if group is None:
        if comm is None:
            raise ValueError(f"{owner}: pass a torch.distributed ProcessGroup or an mpi4py communicator as `group`, "
                             "or group=None with comm=<mpi4py communicator>")
        if not isinstance(comm, MPI.Intracomm):
            raise ValueError(f"{owner}: `comm` must be an mpi4py intracommunicator, got {type(comm).__name__}")
        return comm
    import torch.distributed as dist

    if isinstance(group, dist.ProcessGroup):
        # Under mpiexec the torch world rank must be the MPI world rank (initialise it so).
        world = MPI.COMM_WORLD
        if dist.get_rank() != world.Get_rank() or dist.get_world_size() != world.Get_size():
            raise ValueError(
                f"{owner}: torch.distributed rank/size ({dist.get_rank()}/{dist.get_world_size()}) differ from MPI "
                f"COMM_WORLD's ({world.Get_rank()}/{world.Get_size()}); initialise torch.distributed with the MPI "
                f"rank and size, or pass comm=")
        ranks = tuple(dist.get_process_group_ranks(group))
        if ranks == tuple(range(world.Get_size())):
            return world
        sub = _GROUP_COMMS.get(ranks)
        if sub is None:
            # MPI_Comm_create_group would spin while a late member is still working
            quiet_barrier(world, ranks, phase=f"the communicator of process group ranks {list(ranks)}")
            sub = world.Create_group(world.Get_group().Incl(list(ranks)))
            _GROUP_COMMS[ranks] = sub
        if sub.Get_rank() != group.rank():
            raise ValueError(f"{owner}: the ProcessGroup's rank order does not map onto MPI ranks")
        return sub
    if isinstance(group, int) and not isinstance(group, bool) and group == getattr(
            getattr(dist, "GroupMember", None), "NON_GROUP_MEMBER", object()):
        raise ValueError(f"{owner}: this rank is not a member of `group` (torch.distributed.new_group returned "
                         "GroupMember.NON_GROUP_MEMBER here); only the group's ranks take part")
    raise ValueError(f"{owner}: `group` must be a torch ProcessGroup, an mpi4py communicator or None, "
                     f"got {type(group).__name__}")


def check_agreed(comm, owner: str, arguments: dict, error: Exception | None = None,
                 timeout_s: float | None = None) -> None:
    """Collective: every rank of ``comm`` passed the same ``arguments`` (name -> value) to ``owner``'s
    constructor and none refused its own (``error``), before anything shared is allocated (ranks that
    disagree would otherwise build windows of different sizes and wait for each other).

    Raises:
        ValueError: on every rank: this rank's ``error`` itself (re-raised), or one naming each rank that
            refused its arguments and each argument the ranks disagree on, with every rank's value.
        transports.TransportTimeout: a rank did not reach the constructor within ``timeout_s`` (None: the
            library's deadline, ``$DEEPEP_ASCEND_TIMEOUT_S``).
    """
    values = quiet_allgather_object(comm, (None if error is None else f"{type(error).__name__}: {error}",
                                           tuple(arguments.items())), timeout_s,
                                    f"{owner}(): ranks agreeing on the constructor's arguments")
    if error is not None:
        raise error
    refused = [f"rank {r} refused its arguments ({v[0]})" for r, v in enumerate(values) if v[0] is not None]
    if refused:
        raise ValueError(f"{owner}: " + "; ".join(refused))
    values = [v[1] for v in values]
    problems = []
    for i, name in enumerate(arguments):
        seen = [v[i][1] for v in values]
        if any(x != seen[0] for x in seen):
            problems.append(f"{name}: " + ", ".join(f"rank {r}: {x!r}" for r, x in enumerate(seen)))
    if problems:
        raise ValueError(f"{owner}: the ranks disagree on collective arguments (every rank must pass the same): "
                         + "; ".join(problems))


def get_physical_domain_size(group, *, ranks_per_node: int | None = None) -> tuple[int, int]:
    """``(num_rdma_ranks, num_nvlink_ranks)`` of ``group``: its nodes (the URMA domain's size) and ranks per
    node (the UBMEM domain's); mirrors ``deep_ep.get_physical_domain_size(group)``. Collective over the group.

    ``ranks_per_node``: the simulated node size, as in ``EPBuffer`` (default ``$DEEPEP_ASCEND_RANKS_PER_NODE``,
    else the shared-memory domain). Raises ``TransportConfigError`` on a layout the transports refuse.
    """
    topo = Topology.from_comm(mpi_comm_of(group), ranks_per_node)
    return topo.num_nodes, topo.ranks_per_node


def get_logical_domain_size(group, allow_hybrid_mode: bool = True, *,
                            ranks_per_node: int | None = None) -> tuple[int, int]:
    """``(num_scaleout_ranks, num_scaleup_ranks)`` an ``EPBuffer`` over ``group`` would use; mirrors
    ``deep_ep.get_logical_domain_size(group, allow_hybrid_mode)``: ``(nodes, ranks per node)`` in hybrid mode
    across nodes, ``(1, R)`` on one node and with ``allow_hybrid_mode=False`` (docs/semantics/deepep-api.md §13.1).
    Collective over the group."""
    nodes, per_node = get_physical_domain_size(group, ranks_per_node=ranks_per_node)
    return (nodes, per_node) if nodes > 1 and allow_hybrid_mode else (1, nodes * per_node)


def resolve_deadline(owner: str, timeout_s, num_gpu_timeout_secs) -> tuple[float | None, Exception | None]:
    """The deadline in seconds of a V2.5 buffer's waits: ``timeout_s`` if given, else None where
    ``$DEEPEP_ASCEND_TIMEOUT_S`` is set (the transports read it), else DeepEP's ``num_gpu_timeout_secs``.
    Returns ``(deadline, error)``: ``error`` a ``ValueError`` naming the argument if it is not a positive,
    finite number (``transports.timeout_problem``; ``deadline`` None then), to be refused on every rank
    through :func:`check_agreed`."""
    deadline = timeout_s
    if deadline is None:
        deadline = None if settings.TIMEOUT_S.is_set() else num_gpu_timeout_secs
    problem = None if deadline is None else timeout_problem(
        "timeout_s" if timeout_s is not None else "num_gpu_timeout_secs", deadline)
    if problem is not None:
        return None, ValueError(f"{owner}: {problem}")
    return deadline, None
