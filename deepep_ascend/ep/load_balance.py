"""Redundant experts: the LB region of an ``EPBuffer`` and DeepEP V2.5's ``lb_prefetch_weights`` /
``lb_reduce_grads`` on it (docs/semantics/deepep-api.md §13.9).

The LB region is one node-shared segment per rank (a ``SharedSegment`` of the transports): a node peer
stores into it and loads from it directly, and a tensor planned at the same offset on every rank of the
node (a ``BufferAllocator`` plan) is found in a peer's segment without asking. Prefetch *pushes*: each
owner stores its experts' bytes into the replicas' slots. Gradient reduction *pulls*: each owner loads
its replicas' float32 rows and adds them into its own gradients, in a fixed order. Both are collective
over the group; every call agrees on its arguments first (a refusal or a mismatch raises on every rank
before a byte moves) and ends with a node barrier, so a call's results are complete and its inputs
free for reuse on every rank of the node when it returns.
"""

from __future__ import annotations

import torch

from ..transports import Team

__all__ = ["LoadBalanceRegion"]


def _as_list(tensors, name: str) -> list:
    """DeepEP's batching: one tensor or a non-empty sequence of tensors, as a list."""
    if isinstance(tensors, torch.Tensor):
        return [tensors]
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise ValueError(f"`{name}` must be a tensor or a non-empty sequence of tensors, got {tensors!r:.80}")
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"`{name}[{i}]` must be a torch.Tensor, got {type(t).__name__}")
    return list(tensors)


def _describe(t: torch.Tensor) -> str:
    return f"{t.dtype} {tuple(t.shape)} on {t.device}, contiguous={t.is_contiguous()}"


def _differences(peers: list, names: tuple) -> list[str]:
    """``"<name>: rank r: value, ..."`` for each of ``names`` on which the ``(rank, signature dict)`` pairs of
    ``peers`` differ."""
    out = []
    for name in names:
        seen = [(r, sig.get(name)) for r, sig in peers]
        if any(x != seen[0][1] for _, x in seen):
            out.append(f"{name}: " + ", ".join(f"rank {r}: {str(x)[:120]}" for r, x in seen))
    return out


class LoadBalanceRegion:
    """This rank's LB storage and the node peers' (DeepEP's "LSA domain" is the node here).

    Args:
        tp: a transport whose nodes are the physical nodes (node peers share memory).
        num_bytes: the storage size in bytes, the same on every rank (0: no region).

    Attributes:
        storage: ``[num_bytes]`` uint8, this rank's region (``buffer.lb_storage``); it stays valid as long
            as it is referenced, also after the buffer is destroyed.
        domain: the node's world ranks, ascending (row ``l`` of a redundancy mapping is ``domain[l]``).
        local_idx: this rank's row in the mapping.
    """

    def __init__(self, tp, num_bytes: int):
        topo = tp.topology
        self.tp, self.num_bytes = tp, num_bytes
        self.rank, self.node = topo.rank, topo.node
        self.domain = list(topo.node_ranks())
        self.local_idx = topo.local_rank
        self._segment = tp.create_segment("lb", num_bytes) if num_bytes else None
        self.storage = (self._segment.view(self.rank, 0, num_bytes) if num_bytes
                        else torch.zeros(0, dtype=torch.uint8))

    def release(self) -> None:
        """Drop the mappings of the peers' segments (the storage tensor keeps its own)."""
        if self._segment is not None:
            self._segment.release()
            self._segment = None

    # -- checks ---------------------------------------------------------------------------------------
    def offset_of(self, t: torch.Tensor) -> int | None:
        """``t``'s byte offset in this rank's storage, or ``None`` unless all its bytes lie inside it."""
        if not self.num_bytes or t.device.type != "cpu":
            return None
        off = t.data_ptr() - self.storage.data_ptr()
        return off if 0 <= off and off + t.nbytes <= self.num_bytes else None

    def _redundant(self, t: torch.Tensor, name: str, num_redundant: int) -> int:
        """Check a redundant tensor: contiguous, at least 1-D, ``num_redundant`` rows, inside the region."""
        if t.device.type != "cpu" or not t.is_contiguous() or t.dim() < 1 or t.size(0) != num_redundant:
            raise ValueError(f"`{name}` must be a contiguous CPU tensor of [num_redundant_experts={num_redundant}, "
                             f"...] (the redundancy mapping's columns), got {_describe(t)}")
        off = self.offset_of(t)
        if off is None:
            raise ValueError(f"`{name}` ({_describe(t)}) must lie in this buffer's LB region (plan it with the "
                             f"BufferAllocator given as lb_allocation_plan_or_num_bytes, or view buffer.lb_storage; "
                             f"the region has {self.num_bytes} bytes)")
        return off

    def mapping(self, redundancy_mapping, num_local_experts: int) -> torch.Tensor:
        """Check ``redundancy_mapping`` (``[num_nvlink_ranks, num_redundant_experts]`` int32, entries -1 or an
        expert of another rank of the node); returns it as int64."""
        m = redundancy_mapping
        n = len(self.domain)
        if (not isinstance(m, torch.Tensor) or m.device.type != "cpu" or m.dtype != torch.int32 or m.dim() != 2
                or m.size(0) != n):
            got = _describe(m) if isinstance(m, torch.Tensor) else type(m).__name__
            raise ValueError(f"`redundancy_mapping` must be a CPU int32 tensor of [num_nvlink_ranks={n}, "
                             f"num_redundant_experts], got {got}")
        m = m.to(torch.int64)
        num_experts = n * num_local_experts
        bad = (m < -1) | (m >= num_experts)
        if bad.any():
            r, c = (int(v) for v in torch.nonzero(bad)[0])
            raise ValueError(f"`redundancy_mapping[{r}, {c}]` = {int(m[r, c])}: expert ids must be -1 (unused slot) or "
                             f"in [0, num_nvlink_ranks * num_local_experts = {num_experts})")
        rows = torch.arange(n, dtype=torch.int64)[:, None]
        own = (m >= 0) & (torch.div(m, num_local_experts, rounding_mode="floor") == rows)
        if own.any():
            r, c = (int(v) for v in torch.nonzero(own)[0])
            raise ValueError(f"`redundancy_mapping[{r}, {c}]` = {int(m[r, c])} is an expert of domain rank {r} "
                             f"itself: a rank's own experts must not occupy its redundant slots")
        return m

    @staticmethod
    def num_sms(num_sms) -> None:
        if isinstance(num_sms, bool) or not isinstance(num_sms, int) or num_sms < 0:
            raise ValueError(f"`num_sms` must be a non-negative int (0: automatic), got {num_sms!r}")

    # -- agreement ------------------------------------------------------------------------------------
    def agree(self, op: str, error: Exception | None, signature: tuple) -> None:
        """Collective over the group (with the transport's deadline): raise on every rank when a rank refused
        its arguments, when ranks call different operations, or when the ranks of any node differ in
        ``signature`` (``(name, value)`` pairs: the operation, the mapping, offsets and sizes); this rank's own
        error is raised as itself. Every rank judges every node from the same gathered values, so a
        disagreement inside one node raises on the other nodes too."""
        values = self.tp.allgather_object(
            (None if error is None else f"{type(error).__name__}: {error}", self.node, signature),
            phase=f"EPBuffer.{op} (arguments)")
        if error is not None:
            raise error
        refused = [f"rank {r} refused its arguments ({v[0]})" for r, v in enumerate(values) if v[0] is not None]
        if refused:
            raise ValueError(f"EPBuffer.{op}: " + "; ".join(refused))
        sigs = [dict(v[2]) for v in values]
        problems = _differences(list(enumerate(sigs)), ("operation",))
        if not problems:  # other fields compare only within one operation, per node
            for node in sorted({v[1] for v in values}):
                peers = [(r, sig) for r, (sig, v) in enumerate(zip(sigs, values)) if v[1] == node]
                problems += [f"node {node}: {p}" for p in _differences(peers, tuple(dict(signature)))]
        if problems:
            raise ValueError(f"EPBuffer.{op}: the ranks disagree on collective arguments (every rank calls the same "
                             f"operation; every rank of a node passes the same redundancy mapping, LB offsets and "
                             f"sizes and num_local_experts): " + "; ".join(problems))

    # -- the two exchanges ----------------------------------------------------------------------------
    def check_prefetch(self, redundant_expert_weights, expert_weights, redundancy_mapping):
        """Local checks of ``lb_prefetch_weights``; returns ``(pairs, mapping, signature)``, ``pairs`` a list of
        ``(destination offset, bytes per expert, source bytes [L, bytes per expert])``."""
        dsts = _as_list(redundant_expert_weights, "redundant_expert_weights")
        srcs = _as_list(expert_weights, "expert_weights")
        if len(dsts) != len(srcs):
            raise ValueError(f"`redundant_expert_weights` and `expert_weights` must pair up, got {len(dsts)} and "
                             f"{len(srcs)} tensors")
        for i, s in enumerate(srcs):
            if s.device.type != "cpu" or not s.is_contiguous() or s.dim() < 1 or s.size(0) < 1:
                raise ValueError(f"`expert_weights[{i}]` must be a contiguous CPU tensor of [num_local_experts > 0, "
                                 f"...], got {_describe(s)}")
        num_local = srcs[0].size(0)
        for i, s in enumerate(srcs):
            if s.size(0) != num_local:
                raise ValueError(f"`expert_weights[{i}]` has {s.size(0)} experts, `expert_weights[0]` {num_local}: "
                                 f"every tensor holds the same num_local_experts")
        mapping = self.mapping(redundancy_mapping, num_local)
        num_redundant = mapping.size(1)
        pairs, sizes = [], []
        for i, (d, s) in enumerate(zip(dsts, srcs)):
            off = self._redundant(d, f"redundant_expert_weights[{i}]", num_redundant)
            width = s.nbytes // num_local
            if d.nbytes != num_redundant * width:
                raise ValueError(f"`redundant_expert_weights[{i}]` holds {d.nbytes // max(num_redundant, 1)} bytes "
                                 f"per expert, `expert_weights[{i}]` {width}: each pair moves the same bytes per "
                                 f"expert (trailing shapes and dtypes may differ)")
            pairs.append((off, width, s.reshape(-1).view(torch.uint8).view(num_local, width)))
            sizes.append((off, width))
        signature = (("operation", "lb_prefetch_weights"), ("num_local_experts", num_local),
                     ("LB offsets and bytes per expert", tuple(sizes)),
                     ("redundancy_mapping", tuple(map(tuple, mapping.tolist()))))
        return pairs, mapping, signature

    def check_reduce(self, redundant_expert_grads, expert_grads, redundancy_mapping):
        """Local checks of ``lb_reduce_grads``; returns ``(offset, mapping, signature)``."""
        for name, t in (("redundant_expert_grads", redundant_expert_grads), ("expert_grads", expert_grads)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"`{name}` must be a torch.Tensor, got {type(t).__name__}")
            if t.device.type != "cpu" or not t.is_contiguous() or t.dim() != 2 or t.dtype != torch.float32:
                raise ValueError(f"`{name}` must be a contiguous CPU float32 tensor of 2 dimensions, got "
                                 f"{_describe(t)}")
        num_local, hidden = expert_grads.shape
        if num_local < 1:
            raise ValueError("`expert_grads` must hold at least one expert (num_local_experts > 0), got 0 rows")
        mapping = self.mapping(redundancy_mapping, num_local)
        if redundant_expert_grads.size(1) != hidden:
            raise ValueError(f"`redundant_expert_grads` rows have {redundant_expert_grads.size(1)} elements, "
                             f"`expert_grads` rows {hidden}: both are [*, hidden]")
        off = self._redundant(redundant_expert_grads, "redundant_expert_grads", mapping.size(1))
        signature = (("operation", "lb_reduce_grads"), ("num_local_experts", num_local),
                     ("LB offset and hidden", (off, hidden)),
                     ("redundancy_mapping", tuple(map(tuple, mapping.tolist()))))
        return off, mapping, signature

    def _mine(self, mapping: torch.Tensor, num_local: int):
        """Per replica rank of this rank's experts, ascending: ``(world rank, slots, local expert ids)``,
        slots ascending."""
        out = []
        first = self.local_idx * num_local
        for row, peer in enumerate(self.domain):
            slots = torch.nonzero((mapping[row] >= first) & (mapping[row] < first + num_local)).squeeze(1)
            if slots.numel():
                out.append((peer, slots, mapping[row, slots] - first))
        return out

    def prefetch(self, pairs, mapping: torch.Tensor, phase: str) -> None:
        """Store this rank's experts into every replica slot that maps them, then meet the node (barrier).
        Runs after :meth:`agree`, an all-gather every rank enters only once done with its slots."""
        num_local = pairs[0][2].size(0)
        for peer, slots, local_ids in self._mine(mapping, num_local):
            moves = list(zip(slots.tolist(), local_ids.tolist()))
            for off, width, src in pairs:
                dst = self._segment.view(peer, off, mapping.size(1) * width).view(mapping.size(1), width)
                for slot, e in moves:  # one contiguous row copy each, straight into the slot
                    dst[slot].copy_(src[e])
                self.tp.record_put(peer, len(moves) * width)
        self.tp.barrier(Team.NODE, phase=f"{phase} (exit)")  # every slot of the node is filled

    def reduce(self, off: int, expert_grads: torch.Tensor, mapping: torch.Tensor, phase: str) -> None:
        """Add every replica's row of this rank's experts into ``expert_grads``, one float32 addition per
        replica, in ascending (domain rank, slot) order; then meet the node (barrier). Runs after
        :meth:`agree`, an all-gather every rank enters only once its replicas' gradients are written."""
        num_local, hidden = expert_grads.shape
        num_redundant = mapping.size(1)
        for peer, slots, local_ids in self._mine(mapping, num_local):
            rows = self._segment.view(peer, off, num_redundant * hidden * 4).view(torch.float32).view(num_redundant,
                                                                                                       hidden)
            # one slot at a time: a peer holding two replicas of one expert adds them in slot order
            for slot, e in zip(slots.tolist(), local_ids.tolist()):
                expert_grads[e].add_(rows[slot])
            self.tp.record_fetch(peer, slots.numel() * hidden * 4)
        self.tp.barrier(Team.NODE, phase=f"{phase} (exit)")  # every owner has read this rank's rows
