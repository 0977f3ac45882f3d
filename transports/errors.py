"""Exceptions raised by the transport layer (docs/design/transports.md §2.3).

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

    Attributes: ``op``, ``rank``, ``window``, ``waited_for`` (ranks whose signal did not arrive),
    ``pending_peers`` (the ranks the failure is attributed to: ``waited_for``, except that a node
    peer that was itself blocked is replaced by the ranks it waited for, see ``blocked_on``),
    ``slot``, ``expected`` / ``observed`` (per ``waited_for`` rank), ``elapsed`` (seconds), ``phase``.
    """

    def __init__(self, op, rank, pending_peers, elapsed, phase="", slot=None, expected=None, observed=None,
                 window=None, blocked_on=None):
        self.op, self.rank, self.phase, self.slot, self.window = op, rank, phase, slot, window
        self.waited_for = list(pending_peers)
        self.expected, self.observed, self.elapsed = expected, observed, elapsed
        # blocked_on: {waited-for node peer: ranks it was itself waiting for}; then pending_peers
        # are the ranks at the end of those chains (the likely missing ones), waited_for the direct ones.
        self.blocked_on = dict(blocked_on or {})
        if self.blocked_on:
            roots = [q for p in self.waited_for for q in self.blocked_on.get(p, [p])]
            self.pending_peers = sorted(dict.fromkeys(roots))
        else:
            self.pending_peers = list(self.waited_for)
        where = f" in phase '{phase}'" if phase else ""
        slot_txt = f", slot {slot}" if slot is not None else ""
        detail = ""
        if expected and observed:
            detail = " (" + ", ".join(
                f"rank {p}: have {o}, need {e}" for p, e, o in zip(self.waited_for, expected, observed)) + ")"
        chain = ""
        if self.blocked_on:
            chain = "; " + "; ".join(f"rank {p} was itself waiting for rank(s) {q}"
                                     for p, q in self.blocked_on.items()) \
                + f", so the missing rank(s) are likely {self.pending_peers}"
        win = f"(win='{window}')" if window else ""
        whom = (f"rank(s) {self.waited_for}" if self.waited_for else
                "the other ranks (an MPI collective does not say which of them is missing)")
        super().__init__(
            f"rank {rank}: {op}{win}{where}{slot_txt} timed out after {elapsed:.1f} s waiting for "
            f"{whom}{detail}{chain}. A peer is slow, crashed, or did not enter the "
            f"same collective call; if it is only slow, raise the deadline (the buffer's timeout argument where one "
            f"was passed, else DEEPEP_ASCEND_TIMEOUT_S).")


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
        whom = f"rank(s) {self.pending_peers}" if self.pending_peers else "the other ranks"
        self.args = (f"rank {rank}: {op + ': ' if op else ''}peer rank {peer} timed out waiting for {whom}: "
                     f"{reason}",)


class TransportCallMismatch(TransportError):
    """A peer is in another kind of collective call at the same place in its sequence of calls (see
    ``Transport.set_call_tag``): the ranks made different calls, so neither wait can end. ``peer`` is that rank,
    ``seq`` the shared call number, ``mine`` / ``theirs`` the two ``(kind, op)`` pairs the callers tagged, named in
    the message by ``names`` (``{(kind, op): name}``, the transport's ``call_names``). The transport is poisoned
    (the callers' protocols are out of step)."""

    def __init__(self, rank, peer, seq, mine, theirs, op="", names=None):
        self.rank, self.peer, self.seq, self.mine, self.theirs, self.op = rank, peer, seq, mine, theirs, op
        names = names or {}

        def name(tag):
            return names.get(tag, f"a call of kind {tag[0]}, op {tag[1]}")

        super().__init__(f"rank {rank}: {op + ': ' if op else ''}ranks made different calls: this rank is in "
                         f"{name(mine)}, rank {peer} in {name(theirs)}, both call #{seq} of their sequences of calls")


class TransportPoisoned(TransportError):
    """The transport failed earlier (timeout, abort, MPI error) and refuses further operations."""


class TransportClosed(TransportError):
    """The transport (or the Buffer owning it) was destroyed."""


class TransportBusy(TransportError):
    """``destroy()`` found live tensor views of window memory; freeing would leave them dangling."""


class TransportRuntimeError(TransportError):
    """An MPI call failed; the message carries the MPI error string."""


class SharedMemoryExhausted(TransportRuntimeError):
    """A window or segment would take more shared memory than ``/dev/shm`` has free on a host (raised on every rank
    before anything is mapped; docs/design/transports.md §3.5)."""
