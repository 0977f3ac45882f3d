"""Exceptions raised by the transport layer (transports §2.3).

Every message names the operation, the calling rank and the peers involved, so a
failure in an 8-rank job can be traced from any one rank's output.
"""

from __future__ import annotations


class TransportError(RuntimeError):
    """Base class of every transport failure."""


class TransportArgumentError(TransportError, ValueError):
    """An argument was rejected before any memory was touched (bad rank, offset, size, dtype)."""


class TransportConfigError(TransportError, ValueError):
    """The job's layout cannot be used (e.g. ``ranks_per_node`` does not divide the world).

    Raised identically on every rank: the decision is taken collectively.
    """


class TransportUnsupported(TransportError):
    """The requested operation does not exist for this channel kind (e.g. a view of a URMA peer)."""


class TransportTimeout(TransportError, TimeoutError):
    """A blocking operation passed its deadline.

    Attributes: ``op``, ``rank``, ``window``, ``pending_peers`` (ranks that had not arrived), ``slot``,
    ``expected`` / ``observed`` (per pending peer), ``elapsed`` (seconds), ``phase``.
    """

    def __init__(self, op, rank, pending_peers, elapsed, phase="", slot=None, expected=None, observed=None,
                 window=None):
        self.op, self.rank, self.phase, self.slot, self.window = op, rank, phase, slot, window
        self.pending_peers = list(pending_peers)
        self.expected, self.observed, self.elapsed = expected, observed, elapsed
        where = f" in phase '{phase}'" if phase else ""
        slot_txt = f", slot {slot}" if slot is not None else ""
        detail = ""
        if expected is not None and observed is not None:
            detail = " (" + ", ".join(
                f"rank {p}: have {o}, need {e}" for p, e, o in zip(self.pending_peers, expected, observed)) + ")"
        win = f"(win='{window}')" if window else ""
        super().__init__(
            f"rank {rank}: {op}{win}{where}{slot_txt} timed out after {elapsed:.1f} s waiting for "
            f"rank(s) {self.pending_peers}{detail}. A peer is slow, crashed, or did not enter the "
            f"same collective call; raise DEEPEP_ASCEND_TIMEOUT_S if it is only slow.")


class TransportAborted(TransportError):
    """A peer aborted (it raised inside a collective phase); ``peer`` is that rank, ``reason`` its message."""

    def __init__(self, rank, peer, reason, op=""):
        self.rank, self.peer, self.reason, self.op = rank, peer, reason, op
        super().__init__(f"rank {rank}: {op + ': ' if op else ''}peer rank {peer} aborted: {reason}")


class TransportPeerTimeout(TransportAborted, TimeoutError):
    """A peer aborted because *it* timed out; ``pending_peers`` are the ranks that peer waited for.

    Lets every rank of a job report the same missing ranks as a ``TimeoutError``, fast, instead
    of each rank waiting out its own deadline.
    """

    def __init__(self, rank, peer, reason, pending_peers, op=""):
        self.pending_peers = list(pending_peers)
        super().__init__(rank, peer, reason, op=op)
        self.args = (f"rank {rank}: {op + ': ' if op else ''}peer rank {peer} timed out waiting for rank(s) "
                     f"{self.pending_peers}: {reason}",)


class TransportPoisoned(TransportError):
    """The transport failed earlier (timeout, abort, MPI error) and refuses further operations."""


class TransportClosed(TransportError):
    """The transport (or the Buffer owning it) was destroyed."""


class TransportBusy(TransportError):
    """``destroy()`` found live tensor views of window memory; freeing would leave them dangling."""


class TransportRuntimeError(TransportError):
    """An MPI call failed; the message carries the MPI error string."""
