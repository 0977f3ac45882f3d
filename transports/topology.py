"""Rank → (node, local rank) map and the channel kind of every pair (docs/design/transports.md §2.1).

A *node* is a UBMEM domain: by default the MPI shared-memory domain
(``MPI_COMM_TYPE_SHARED``), optionally split into simulated nodes of ``ranks_per_node``
ranks each, row-major (``rank = node * ranks_per_node + local_rank``), as DeepEP and the
Ascend ports number ranks.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ..settings import RANKS_PER_NODE, SettingError
from .errors import TransportConfigError


class ChannelKind(enum.IntEnum):
    """How bytes move between two ranks: to itself, load/store inside a node, one-sided RMA across."""

    SELF = 0
    UBMEM = 1
    URMA = 2


@dataclass(frozen=True)
class Topology:
    """Immutable placement of ranks on (possibly simulated) nodes.

    Attributes:
        world_size: number of ranks in the communicator.
        rank: this rank.
        ranks_per_node: ranks in each node (every node has the same size).
    """

    world_size: int
    rank: int
    ranks_per_node: int

    def __post_init__(self):
        if self.ranks_per_node <= 0 or self.world_size % self.ranks_per_node:
            raise TransportConfigError(
                f"ranks_per_node={self.ranks_per_node} must be a positive divisor of the world size "
                f"{self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise TransportConfigError(f"rank {self.rank} outside [0, {self.world_size})")

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    @property
    def node(self) -> int:
        return self.node_of(self.rank)

    @property
    def local_rank(self) -> int:
        return self.local_rank_of(self.rank)

    def node_of(self, r: int) -> int:
        return r // self.ranks_per_node

    def local_rank_of(self, r: int) -> int:
        return r % self.ranks_per_node

    def node_ranks(self, node: int | None = None) -> range:
        """World ranks of ``node`` (default: this rank's node), ascending."""
        node = self.node if node is None else node
        return range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node)

    def rail_peer(self, r: int, node: int) -> int:
        """The rank on ``node`` with the same local rank as ``r``."""
        return node * self.ranks_per_node + self.local_rank_of(r)

    def kind(self, a: int, b: int) -> ChannelKind:
        if a == b:
            return ChannelKind.SELF
        return ChannelKind.UBMEM if self.node_of(a) == self.node_of(b) else ChannelKind.URMA

    @classmethod
    def from_comm(cls, comm, ranks_per_node: int | None = None) -> Topology:
        """Build the topology collectively; every rank raises the same error on a bad layout.

        Args:
            comm: an mpi4py intracommunicator.
            ranks_per_node: ranks per simulated node; ``None`` takes
                ``$DEEPEP_ASCEND_RANKS_PER_NODE``, else the shared-memory domain.
        Raises:
            TransportConfigError: the value does not divide the world, differs between ranks,
                a node would span two shared-memory domains (hosts), or (default) the hosts hold
                unequal or non-contiguous blocks of ranks.
        """
        from mpi4py import MPI

        rank, size = comm.Get_rank(), comm.Get_size()
        source = "ranks_per_node"
        if ranks_per_node is None and RANKS_PER_NODE.is_set():
            source = f"${RANKS_PER_NODE.name}"
            try:
                ranks_per_node = RANKS_PER_NODE.get()
            except SettingError:
                ranks_per_node = RANKS_PER_NODE.raw()  # refused below on every rank, as given
        shared = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
        try:
            host_leader = shared.allreduce(rank, op=MPI.MIN)
        finally:
            shared.Free()
        info = comm.allgather((ranks_per_node, host_leader))
        requested = [r for r, _ in info]
        hosts = [h for _, h in info]
        error = None
        if len(set(requested)) != 1:
            error = f"ranks disagree on ranks_per_node: {requested} (rank i's value at index i)"
        else:
            rpn = requested[0]
            if rpn is None:
                # Default: one node per shared-memory domain, which must be equal, contiguous blocks.
                blocks = [hosts.index(h) for h in hosts]
                rpn = hosts.count(hosts[0])
                if (any(hosts.count(h) != rpn for h in hosts)
                        or any(b != (r // rpn) * rpn for r, b in enumerate(blocks))):
                    error = ("hosts hold unequal or non-contiguous blocks of ranks; place the same number "
                             "of consecutive ranks on every host or pass ranks_per_node")
            elif not isinstance(rpn, int) or rpn <= 0 or size % rpn:
                error = f"{source}={rpn!r} must be a positive int dividing the world size {size}"
            else:
                for node in range(size // rpn):
                    members = hosts[node * rpn:(node + 1) * rpn]
                    if len(set(members)) != 1:
                        error = (f"simulated node {node} (ranks {node * rpn}..{(node + 1) * rpn - 1}) spans "
                                 f"more than one shared-memory domain (host); ranks_per_node={rpn} must "
                                 f"divide the ranks placed on each host")
                        break
        if error is not None:
            raise TransportConfigError(f"rank {rank}: invalid topology: {error}")
        return cls(world_size=size, rank=rank, ranks_per_node=rpn)
