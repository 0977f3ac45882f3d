"""Simulated Ascend 950 interconnect over MPI: topology, the channel contract, UBMEM and URMA.

``transports`` moves bytes and monotonic signals between ranks; it knows nothing of tokens.
docs/design/transports.md describes the contract this package implements.
"""

from .base import (
    State,
    Team,
    WaitPolicy,
    quiet_allgather_object,
    quiet_barrier,
    quiet_wait,
    resolve_timeout,
    timeout_problem,
)
from .errors import (
    SharedMemoryExhausted,
    TransportAborted,
    TransportArgumentError,
    TransportBusy,
    TransportCallMismatch,
    TransportClosed,
    TransportConfigError,
    TransportError,
    TransportPeerTimeout,
    TransportPoisoned,
    TransportRuntimeError,
    TransportTimeout,
    TransportUnsupported,
)
from .link_model import (
    PROFILES,
    LinkEmulator,
    LinkProfile,
    LinkSpec,
    LinkStats,
    emulator_from_env,
    gather_link_stats,
    get_profile,
    project,
)
from .topology import ChannelKind, Topology
from .ubmem import CALL_CHECK_S, SymmetricWindow, Transport, UbmemTransport


def create_transport(comm, ranks_per_node=None, timeout_s=None) -> Transport:
    """Collectively build the transport for ``comm``'s topology, any number of (simulated) nodes.

    Pairs on one node use UBMEM (load/store into MPI shared memory), pairs on different nodes
    URMA (one-sided MPI RMA on the same segments); see :class:`Transport`.

    Args:
        comm: mpi4py intracommunicator.
        ranks_per_node: simulated node size (row-major: ``rank = node * rpn + local``), else
            ``$DEEPEP_ASCEND_RANKS_PER_NODE``, else the host's shared-memory domain.
        timeout_s: default deadline of blocking operations, in seconds.
    Raises:
        TransportConfigError: invalid topology (same error on every rank), or, with more than
            one node, MPI's RMA windows are not ``MPI_WIN_UNIFIED``.
    """
    return Transport(comm, ranks_per_node=ranks_per_node, timeout_s=timeout_s)


__all__ = [
    "CALL_CHECK_S", "ChannelKind", "Topology", "LinkStats", "LinkSpec", "LinkProfile", "LinkEmulator",
    "PROFILES", "get_profile", "project", "gather_link_stats", "emulator_from_env", "SymmetricWindow", "Transport",
    "UbmemTransport", "create_transport", "State", "Team", "WaitPolicy", "quiet_allgather_object", "quiet_barrier",
    "quiet_wait", "resolve_timeout", "timeout_problem",
    "TransportError", "TransportArgumentError", "TransportCallMismatch", "TransportConfigError", "TransportUnsupported",
    "TransportTimeout", "TransportAborted", "TransportPeerTimeout", "TransportPoisoned", "TransportClosed",
    "TransportBusy", "TransportRuntimeError", "SharedMemoryExhausted",
]
