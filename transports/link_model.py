"""Per-link accounting of the simulated channels (transports §5).

``LinkStats`` counts, for the operations issued by one rank, the bytes and messages moved
per (channel kind, peer). Each transfer is counted once, by the rank that issued it: a store
into a peer's window (``put``), a load from it (``get`` / a gather through a peer view,
counted in the data's direction as ``fetched``), a signal.
"""

from __future__ import annotations

import numpy as np

from .topology import ChannelKind

_FIELDS = ("bytes_put", "bytes_fetched", "puts", "gets", "signals", "atomics")


class LinkStats:
    """Counters ``[kind, peer]`` (int64) for one rank; kinds are :class:`ChannelKind`.

    Attributes (each ``np.ndarray[len(ChannelKind), world_size]`` of int64):
        bytes_put: bytes this rank stored into ``peer``'s memory.
        bytes_fetched: bytes this rank loaded from ``peer``'s memory (data moved peer → this rank).
        puts, gets, signals, atomics: message counts.
    """

    def __init__(self, world_size: int):
        self.world_size = world_size
        for name in _FIELDS:
            setattr(self, name, np.zeros((len(ChannelKind), world_size), dtype=np.int64))

    def record_put(self, kind: ChannelKind, peer: int, nbytes: int) -> None:
        self.bytes_put[kind, peer] += nbytes
        self.puts[kind, peer] += 1

    def record_fetch(self, kind: ChannelKind, peer: int, nbytes: int) -> None:
        self.bytes_fetched[kind, peer] += nbytes
        self.gets[kind, peer] += 1

    def record_signal(self, kind: ChannelKind, peer: int) -> None:
        self.signals[kind, peer] += 1

    def snapshot(self) -> dict:
        """A copy of every counter, ``{field: array}``."""
        return {name: getattr(self, name).copy() for name in _FIELDS}

    def reset(self) -> None:
        for name in _FIELDS:
            getattr(self, name)[...] = 0

    @staticmethod
    def diff(after: dict, before: dict) -> dict:
        return {k: after[k] - before[k] for k in after}

    @staticmethod
    def bytes_by_kind(snap: dict) -> dict:
        """``{'SELF': n, 'UBMEM': n, 'URMA': n}``: bytes moved (put + fetched) per channel kind."""
        total = snap["bytes_put"] + snap["bytes_fetched"]
        return {k.name: int(total[k].sum()) for k in ChannelKind}

    def gather(self, comm) -> dict:
        """Collective: ``{field: array[world, kind, world]}``, row ``r`` = rank ``r``'s counters."""
        return {name: np.stack(comm.allgather(getattr(self, name))) for name in _FIELDS}
