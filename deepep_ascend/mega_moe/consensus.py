"""The ranks' agreement before a MegaMoE call moves anything: every rank's verdict (its error or None), pair
counts per expert, settings and token count, exchanged at the transport's barrier
(docs/semantics/mega-moe.md §5, "Validation, then consensus"); and the check that turns a rejection or a
disagreement into the same :class:`~deepep_ascend.ConsensusError` on every rank (also used by the symmetric
buffer's constructor)."""

from __future__ import annotations

import pickle

import torch

from ..ep.failure import run_step
from ..ep.protocol import ConsensusError

VERDICT_MSG, _VERDICT_CHARS = 16384, 2000  # shm consensus record: its length, then the pickled verdict


def check_agreement(me: int, op: str, gathered: list) -> None:
    """Raise :class:`~deepep_ascend.ConsensusError` when any rank rejected ``op`` or ranks passed different
    values; ``gathered``: per rank, in rank order, ``(its error message or None, its dict of what every rank
    must pass alike)``. Every rank sees the same list, so every rank raises the same error."""
    bad = [(r, m) for r, (m, _v) in enumerate(gathered) if m is not None]
    if bad:
        raise ConsensusError(f"rank {me}: {op} was rejected on rank(s) {[r for r, _ in bad]}: "
                             + "; ".join(f"rank {r}: {m}" for r, m in bad))
    first = gathered[0][1]
    for name in first:
        if any(v[name] != first[name] for _m, v in gathered):
            raise ConsensusError(f"rank {me}: {op}: ranks disagree on {name}: "
                                 + ", ".join(f"rank {r}: {v[name]!r}" for r, (_m, v) in enumerate(gathered))
                                 + "; every rank must pass the same value")


def consensus(sb, verdict, op) -> list:
    """Every rank's ``verdict`` (its error text or None, its per-expert pair counts, its settings, its token
    count), in rank order. Ranks first meet at the transport's barrier, then all-gather through the transport
    (:meth:`transports.Transport.allgather_object`); both sleep between polls, have the Buffer's deadline
    and fail fast when a peer aborted. A blocking collective entered early spins in MPICH's ``sched_yield``
    loop, which, with more ranks than cores, starves the rank still working toward the call, and it has no
    deadline: a rank that never comes would hang the others, and so would a peer that timed out in the
    barrier just as the others passed it (they would wait for it in the all-gather). The barrier names the
    ranks that did not come; on any timeout the waiting rank raises ``TimeoutError`` and the Buffer is
    aborted (peers learn at once). The ``shm`` backend needs no all-gather: :func:`_consensus_shm`."""
    buf = sb.ep_buffer
    if sb.backend == "shm":
        return _consensus_shm(sb, verdict, op)
    run_step(buf.runtime, buf.rank, lambda: buf.runtime.barrier(phase=f"{op} consensus"))
    return run_step(buf.runtime, buf.rank, lambda: buf.runtime.allgather_object(verdict, phase=f"{op} consensus"))


def _consensus_shm(sb, verdict, op) -> list:
    """:func:`consensus` in one barrier (shm backend): each rank writes its verdict, pickled as the Buffer
    backend's all-gather sends it (so both compare the same values), into its segment's slot for this call's
    parity, meets the others at the transport's barrier, and reads every rank's. A slot is written again two
    calls later, after a barrier that every rank enters only once it read this call's. A message longer than
    2000 characters is cut; a verdict that cannot be encoded becomes a rejection naming this rank: every rank
    still enters the barrier, so the ranks never fall out of step."""
    buf, me = sb.ep_buffer, sb.rank
    msg, counts, settings, t = verdict
    try:
        if msg is not None and len(msg) > _VERDICT_CHARS:
            msg = msg[:_VERDICT_CHARS] + " [cut]"
        blob = pickle.dumps((msg, counts, settings, t))
        if len(blob) > sb._verdict_bytes - 8:
            raise ValueError(f"{len(blob)} B, room for {sb._verdict_bytes - 8}")
    except Exception as exc:  # noqa: BLE001 - sent to every rank as this rank's rejection
        blob = pickle.dumps((f"rank {me}: {op}: its verdict could not be encoded ({type(exc).__name__})", None,
                             None, 0))
    slot = sb._consensus_calls % 2
    sb._consensus_calls += 1
    rec = sb._peer_views[me]["verdict"][slot]
    rec[:8].view(torch.int64).fill_(len(blob))
    rec[8:8 + len(blob)].copy_(torch.frombuffer(bytearray(blob), dtype=torch.uint8))
    run_step(buf.runtime, buf.rank, lambda: buf.runtime.barrier(phase=f"{op} consensus"))
    out = []
    for p in range(sb.num_ranks):
        r = sb._peer_views[p]["verdict"][slot]
        out.append(pickle.loads(r[8:8 + int(r[:8].view(torch.int64))].numpy().tobytes()))
    return out
