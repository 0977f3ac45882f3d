"""Topology: row-major maps, channel kinds, collective validation of ``ranks_per_node``
(docs/design/transports.md §2.1, §8).

Hand-built ``Topology`` objects are pure (every rank checks them alone); ``Topology.from_comm``
and ``create_transport`` are collective and must raise the *same* ``TransportConfigError`` on
every rank.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
from mpi4py import MPI

from deepep_ascend.settings import RANKS_PER_NODE
from deepep_ascend.transports import (
    ChannelKind,
    Topology,
    Transport,
    TransportConfigError,
    TransportError,
    UbmemTransport,
    create_transport,
)
from tests.transports.helpers import TIMEOUT_S, destroy_quietly, make_transport

# Expected kind matrices for 8 ranks: S = SELF, U = UBMEM (same node), R = URMA (other node).
KIND_8_RPN2 = """
SURRRRRR
USRRRRRR
RRSURRRR
RRUSRRRR
RRRRSURR
RRRRUSRR
RRRRRRSU
RRRRRRUS
"""
KIND_8_RPN4 = """
SUUURRRR
USUURRRR
UUSURRRR
UUUSRRRR
RRRRSUUU
RRRRUSUU
RRRRUUSU
RRRRUUUS
"""
_LETTER = {"S": ChannelKind.SELF, "U": ChannelKind.UBMEM, "R": ChannelKind.URMA}


def _parse(matrix: str):
    return [[_LETTER[c] for c in row] for row in matrix.split()]


# ---------------------------------------------------------------------------------------------
# hand-built topologies (no communication)


@pytest.mark.parametrize("rpn", [1, 2, 4, 8])
def test_row_major_maps(rpn):
    world = 8
    nodes = world // rpn
    for r in range(world):
        t = Topology(world_size=world, rank=r, ranks_per_node=rpn)
        assert (t.world_size, t.rank, t.ranks_per_node, t.num_nodes) == (world, r, rpn, nodes)
        assert t.node == r // rpn and t.local_rank == r % rpn
        assert list(t.node_ranks()) == list(range((r // rpn) * rpn, (r // rpn + 1) * rpn))
        for a in range(world):
            assert t.node_of(a) == a // rpn
            assert t.local_rank_of(a) == a % rpn
            assert a == t.node_of(a) * rpn + t.local_rank_of(a)  # row-major
            for n in range(nodes):
                peer = t.rail_peer(a, n)
                assert peer == n * rpn + a % rpn
                assert t.node_of(peer) == n and t.local_rank_of(peer) == t.local_rank_of(a)
        for n in range(nodes):
            assert list(t.node_ranks(n)) == list(range(n * rpn, (n + 1) * rpn))


@pytest.mark.parametrize("rpn,expected", [(2, KIND_8_RPN2), (4, KIND_8_RPN4)])
def test_kind_matrix(rpn, expected):
    want = _parse(expected)
    for r in range(8):  # the matrix does not depend on which rank builds the topology
        t = Topology(world_size=8, rank=r, ranks_per_node=rpn)
        got = [[t.kind(a, b) for b in range(8)] for a in range(8)]
        assert got == want, f"rank {r}, ranks_per_node={rpn}"


def test_kind_matrix_single_node_and_all_urma():
    one = Topology(world_size=8, rank=3, ranks_per_node=8)
    assert all(one.kind(a, b) == (ChannelKind.SELF if a == b else ChannelKind.UBMEM)
               for a in range(8) for b in range(8))
    flat = Topology(world_size=8, rank=3, ranks_per_node=1)
    assert all(flat.kind(a, b) == (ChannelKind.SELF if a == b else ChannelKind.URMA)
               for a in range(8) for b in range(8))


def test_topology_is_immutable():
    t = Topology(world_size=8, rank=0, ranks_per_node=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.rank = 1  # type: ignore[misc]


@pytest.mark.parametrize("world,rank,rpn", [(8, 0, 3), (8, 0, 0), (8, 0, -2), (8, 8, 4), (8, -1, 4), (6, 0, 4)])
def test_invalid_hand_built_topology(world, rank, rpn):
    with pytest.raises(TransportConfigError):
        Topology(world_size=world, rank=rank, ranks_per_node=rpn)


def test_config_error_is_a_value_error():
    assert issubclass(TransportConfigError, ValueError) and issubclass(TransportConfigError, TransportError)


# ---------------------------------------------------------------------------------------------
# Topology.from_comm (collective)


def _same_error_everywhere(exc: BaseException, comm=MPI.COMM_WORLD) -> None:
    """Every rank raised the same TransportConfigError (messages equal up to the 'rank r:' prefix)."""
    me = comm.Get_rank()
    msg = str(exc)
    assert isinstance(exc, TransportConfigError), repr(exc)
    assert msg.startswith(f"rank {me}:"), msg
    stripped = re.sub(r"^rank \d+:", "", msg)
    all_msgs = comm.allgather((type(exc).__name__, stripped))
    assert len(set(all_msgs)) == 1, all_msgs


def _from_comm_error(rpn):
    with pytest.raises(TransportConfigError) as ei:
        Topology.from_comm(MPI.COMM_WORLD, rpn)
    return ei.value


@pytest.mark.mpi(min_size=1)
def test_from_comm_default_is_one_node(monkeypatch):
    monkeypatch.delenv(RANKS_PER_NODE.name, raising=False)
    comm = MPI.COMM_WORLD
    t = Topology.from_comm(comm)
    assert (t.world_size, t.rank, t.ranks_per_node, t.num_nodes) == (comm.size, comm.rank, comm.size, 1)


@pytest.mark.mpi(min_size=1)
def test_from_comm_valid_divisors(monkeypatch):
    monkeypatch.delenv(RANKS_PER_NODE.name, raising=False)
    comm = MPI.COMM_WORLD
    for rpn in [d for d in range(1, comm.size + 1) if comm.size % d == 0]:
        t = Topology.from_comm(comm, rpn)
        assert t == Topology(world_size=comm.size, rank=comm.rank, ranks_per_node=rpn)


@pytest.mark.mpi(min_size=1)
def test_from_comm_rpn_not_dividing_world(monkeypatch):
    monkeypatch.delenv(RANKS_PER_NODE.name, raising=False)
    n = MPI.COMM_WORLD.size
    bad = [n + 1, 0, -1] + ([3] if n % 3 else [])
    for rpn in bad:  # same list on every rank
        exc = _from_comm_error(rpn)
        assert f"ranks_per_node={rpn}" in str(exc), str(exc)
        _same_error_everywhere(exc)


@pytest.mark.mpi(min_size=2)
def test_from_comm_rpn_differs_between_ranks(monkeypatch):
    monkeypatch.delenv(RANKS_PER_NODE.name, raising=False)
    comm = MPI.COMM_WORLD
    rpn = 1 if comm.rank == 0 else comm.size  # each value alone would be valid
    exc = _from_comm_error(rpn)
    assert "disagree" in str(exc), str(exc)
    _same_error_everywhere(exc)


@pytest.mark.mpi(min_size=1)
def test_from_comm_env_var(monkeypatch):
    comm = MPI.COMM_WORLD
    n = comm.size
    monkeypatch.setenv(RANKS_PER_NODE.name, str(n))
    assert Topology.from_comm(comm).ranks_per_node == n
    for value in [str(n + 1), "0", "abc"]:
        monkeypatch.setenv(RANKS_PER_NODE.name, value)
        _same_error_everywhere(_from_comm_error(None))
    # An explicit argument wins over the environment.
    monkeypatch.setenv(RANKS_PER_NODE.name, "abc")
    assert Topology.from_comm(comm, n).ranks_per_node == n


@pytest.mark.mpi(min_size=2)
def test_from_comm_env_var_differs_between_ranks(monkeypatch):
    comm = MPI.COMM_WORLD
    monkeypatch.setenv(RANKS_PER_NODE.name, "1" if comm.rank == 0 else str(comm.size))
    exc = _from_comm_error(None)
    assert "disagree" in str(exc), str(exc)
    _same_error_everywhere(exc)


# ---------------------------------------------------------------------------------------------
# create_transport: any number of nodes (UBMEM inside, URMA across)


@pytest.mark.mpi(min_size=2)
def test_create_transport_any_number_of_nodes(monkeypatch):
    monkeypatch.delenv(RANKS_PER_NODE.name, raising=False)
    comm = MPI.COMM_WORLD
    n = comm.size
    for rpn in [d for d in range(1, n + 1) if n % d == 0]:
        tp = make_transport(ranks_per_node=rpn)
        try:
            assert tp.topology == Topology(world_size=n, rank=comm.rank, ranks_per_node=rpn)
            assert isinstance(tp, Transport) and Transport is UbmemTransport
            tp.barrier()
        finally:
            destroy_quietly(tp)
    monkeypatch.setenv(RANKS_PER_NODE.name, "1")  # same through the environment
    tp = make_transport()
    try:
        assert tp.topology.num_nodes == n
        tp.barrier()
    finally:
        destroy_quietly(tp)


@pytest.mark.mpi(min_size=1)
def test_create_transport_bad_rpn(monkeypatch):
    monkeypatch.delenv(RANKS_PER_NODE.name, raising=False)
    comm = MPI.COMM_WORLD
    with pytest.raises(TransportConfigError) as ei:
        create_transport(comm, ranks_per_node=comm.size + 1, timeout_s=TIMEOUT_S)
    _same_error_everywhere(ei.value)


class _DupSpy:
    """Wraps a communicator and records the communicators ``Dup`` hands out."""

    def __init__(self, comm):
        self._comm = comm
        self.dups = []

    def Dup(self, *args, **kwargs):  # mpi4py's name
        d = self._comm.Dup(*args, **kwargs)
        self.dups.append(d)
        return d

    def __getattr__(self, name):
        return getattr(self._comm, name)


def _leaked_dups(spy) -> int:
    leaked = [d for d in spy.dups if d != MPI.COMM_NULL]
    for d in leaked:  # same on every rank, so freeing here is collective and safe
        d.Free()
    return len(leaked)


@pytest.mark.mpi(min_size=2)
def test_separate_memory_model_refused_and_freed(monkeypatch):
    """URMA needs MPI_WIN_UNIFIED (targets load their slots): refused on every rank, nothing leaked."""
    from mpi4py import MPI as _MPI

    from deepep_ascend.transports import urma as urma_mod

    me = MPI.COMM_WORLD.rank
    # Only the last rank's window pretends to be separate: the decision must still be collective.
    monkeypatch.setattr(urma_mod, "_memory_model",
                        lambda win: _MPI.WIN_SEPARATE if me == MPI.COMM_WORLD.size - 1 else win.model)
    spy = _DupSpy(MPI.COMM_WORLD)
    with pytest.raises(TransportConfigError) as ei:
        create_transport(spy, ranks_per_node=1, timeout_s=TIMEOUT_S)
    assert "MPI_WIN_UNIFIED" in str(ei.value), str(ei.value)
    assert _leaked_dups(spy) == 0
    # And a later user window on a good transport is refused the same way, leaving it usable.
    monkeypatch.setattr(urma_mod, "_memory_model", lambda win: win.model)
    tp = make_transport(ranks_per_node=1)
    try:
        monkeypatch.setattr(urma_mod, "_memory_model",
                            lambda win: _MPI.WIN_SEPARATE if me == 0 else win.model)
        with pytest.raises(TransportConfigError):
            tp.create_window("separate", 64, 1)
        monkeypatch.setattr(urma_mod, "_memory_model", lambda win: win.model)
        win = tp.create_window("unified", 64, 1)
        tp.signal(win, (me + 1) % tp.topology.world_size, 0)
        assert tp.wait_until(win, 0, [(me - 1) % tp.topology.world_size], 1) == []
        tp.barrier()
    finally:
        destroy_quietly(tp)


@pytest.mark.mpi(min_size=1)
def test_config_error_frees_its_communicator(monkeypatch):
    monkeypatch.delenv(RANKS_PER_NODE.name, raising=False)
    spy = _DupSpy(MPI.COMM_WORLD)
    with pytest.raises(TransportConfigError):
        create_transport(spy, ranks_per_node=MPI.COMM_WORLD.size + 1, timeout_s=TIMEOUT_S)
    assert _leaked_dups(spy) == 0
