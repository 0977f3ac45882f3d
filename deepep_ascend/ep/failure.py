"""What a rank does when a collective step fails: abort its peers so that they fail fast, naming it.

The ``Buffer`` runs every protocol step through :func:`run_step`; so does anything built on a Buffer's
transport (MegaMoE's consensus and waves), so that a failure there has the Buffer's semantics too: the
peers waiting for this rank raise ``TransportAborted`` naming it instead of waiting out their deadline.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import TypeVar

import torch

from ..transports import State, Transport, TransportAborted, TransportPoisoned, TransportTimeout
from .protocol import ConsensusError

__all__ = ["abort_peers", "raise_if_a_peer_aborted", "refused_on_every_rank", "run_step"]

T = TypeVar("T")

_REFUSED = "_deepep_ascend_refused_on_every_rank"  # the attribute refused_on_every_rank sets


def refused_on_every_rank(exc: BaseException) -> BaseException:
    """``exc``, marked as the error of a call this rank refused in the call's first round, which every peer took
    part in (they raise a ``ConsensusError`` naming this rank; the Buffer stays usable): :func:`abort_peers`
    leaves it alone. Returns ``exc``."""
    setattr(exc, _REFUSED, True)
    return exc


def abort_peers(runtime: Transport | None, rank: int, exc: BaseException) -> None:
    """Abort ``runtime``'s peers for an unexpected failure ``exc`` of this ``rank``.

    Not for a consensus error (every rank raised it already), a rank's own refusal that its peers heard
    (:func:`refused_on_every_rank`), a peer's abort, or a call refused because this transport failed earlier
    (the peers heard of that failure then, and a second abort would hide its reason). A ``TransportTimeout``
    reaches the peers as a timeout naming the same pending ranks.
    """
    if (runtime is None or isinstance(exc, (ConsensusError, TransportAborted, TransportPoisoned))
            or getattr(exc, _REFUSED, False)):
        return
    text = str(exc)
    if not text.startswith(f"rank {rank}:"):
        text = f"rank {rank}: {type(exc).__name__}: {text}"
    if isinstance(exc, TransportTimeout):
        runtime.abort(text, pending_peers=exc.pending_peers)
    else:
        runtime.abort(text)


def run_step(runtime: Transport | None, rank: int, fn: Callable[[], T]) -> T:
    """``fn()`` without autograd (the data plane is not differentiable, as DeepEP's kernels); on any failure,
    :func:`abort_peers`, then re-raise.

    The failed step's frames are cleared from the traceback: they hold views of window memory, and a caller
    keeping the exception would otherwise keep them alive and make ``destroy()`` refuse (``TransportBusy``).
    """
    try:
        if not torch.is_grad_enabled():
            return fn()
        # torch.no_grad() without its Python context manager, whose entry and exit cost more than the switch
        torch._C._set_grad_enabled(False)
        try:
            return fn()
        finally:
            torch._C._set_grad_enabled(True)
    except BaseException as exc:
        if exc.__traceback__ is not None:
            traceback.clear_frames(exc.__traceback__.tb_next)
        abort_peers(runtime, rank, exc)
        raise


def raise_if_a_peer_aborted(runtime: Transport | None, phase: str) -> None:
    """At the wait of an asynchronous call whose data movement completed here: raise if a peer aborted meanwhile.

    A rank that finds an input of its own asynchronous call written in place (``InputGuard``) aborts after its
    worker read the inputs, when the peers' share of the call may be complete already: their outputs may hold
    the written values, and this check makes their wait say so instead of returning them
    (docs/semantics/deepep-api.md §3.3). Nothing when ``runtime`` is destroyed or failed here (that failure was
    raised where it happened).

    Raises:
        TransportAborted: naming the peer and its reason (``TransportPeerTimeout`` if the peer timed out).
    """
    if runtime is not None and runtime.state is State.OPEN:
        runtime.check_abort(phase)
