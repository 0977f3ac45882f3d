"""Simulated Ascend 950 interconnect over MPI: topology, the channel contract, UBMEM.

``transports`` moves bytes and monotonic signals between ranks; it knows nothing of tokens.
See ``shared/spec/transports.md`` for the contract this package implements.
"""

from .base import DEFAULT_TIMEOUT_S, TIMEOUT_ENV, State, Team, WaitPolicy, resolve_timeout
from .errors import (TransportAborted, TransportArgumentError, TransportBusy, TransportClosed,
                     TransportConfigError, TransportError, TransportPeerTimeout, TransportPoisoned, TransportRuntimeError,
                     TransportTimeout, TransportUnsupported)
from .link_model import LinkStats
from .topology import RANKS_PER_NODE_ENV, ChannelKind, Topology
from .ubmem import SymmetricWindow, UbmemTransport


def create_transport(comm, ranks_per_node=None, timeout_s=None):
    """Collectively build the transport for ``comm``'s topology (UBMEM inside one node).

    Args:
        comm: mpi4py intracommunicator.
        ranks_per_node: simulated node size, else ``$DEEPEP_ASCEND_RANKS_PER_NODE``, else the host.
        timeout_s: default deadline of blocking operations, in seconds.
    Raises:
        TransportConfigError: invalid topology, or more than one node (URMA not built yet).
    """
    return UbmemTransport(comm, ranks_per_node=ranks_per_node, timeout_s=timeout_s)


__all__ = [
    "ChannelKind", "Topology", "RANKS_PER_NODE_ENV", "LinkStats", "SymmetricWindow", "UbmemTransport",
    "create_transport", "State", "Team", "WaitPolicy", "resolve_timeout", "TIMEOUT_ENV", "DEFAULT_TIMEOUT_S",
    "TransportError", "TransportArgumentError", "TransportConfigError", "TransportUnsupported",
    "TransportTimeout", "TransportAborted", "TransportPeerTimeout", "TransportPoisoned", "TransportClosed", "TransportBusy",
    "TransportRuntimeError",
]
