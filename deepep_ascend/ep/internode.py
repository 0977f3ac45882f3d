"""Normal-mode dispatch and combine across nodes: DeepEP's two hops (docs/semantics/deepep-api.md §5,
docs/design/transports.md §6).

Every rank ``(node b, local l)`` is at once a *sender* of its own tokens, a *forwarder* for its
rail peers ``(c, l)`` and a *receiver*. Two windows per rank:

* the **URMA window** (``num_rdma_bytes``): two halves, each split into one *box* per node.
  Box ``a`` of rank ``(b, l)`` receives what rail peer ``(a, l)`` sends it (``a = b``: the
  rank itself). Node peers read the boxes through UBMEM views (the window is node-shared).
* the **UBMEM window** (``num_nvl_bytes``): two halves, combine's staging of received rows for the
  node peers.

Dispatch, one round (tokens ``[k·q, (k+1)·q)`` of every sender):

1. *Hop 1, URMA*: a sender packs, for each node ``c``, the tokens of the round with at least one
   expert on ``c`` — once per node, whatever the number of target ranks there — with their
   target bitmask inside ``c``, and writes that block into box ``b`` of its rail peer ``(c, l)``
   (one ``put_with_signal``; its own node's block it writes into its own window, with the tokens a node
   peer receives: its rows to itself it copies in hop 2 from its own tensors).
2. The forwarder waits for its rail peers' blocks, then tells its node peers (UBMEM signal).
3. *Hop 2, UBMEM*: every receiver ``(b, j)`` gathers, for each source rank ``s`` in ascending
   order, the rows with bit ``j`` from box ``node(s)`` of forwarder ``(b, local(s))`` straight
   into its outputs (DeepEP's order: by global source rank, then token index).

Combine reverses it, with DeepEP's two roundings (docs/semantics/deepep-api.md §5): every receiver stages in its
UBMEM window its rows of the round that a node peer forwards (the rows it forwards itself it reads in
its ``x``); each forwarder sums, per token it forwarded, the rows of its node
peers in float32 from ``+0.0`` in ascending local rank and rounds to bf16; it writes those
partials into box ``b`` of the origin ``(a, l)``; the origin adds ``f32(bias0) + f32(bias1)``
and the partials in ascending node order, and rounds once more.

Synchronisation: three monotonic signal slots and nothing cleaned. ``U_READY`` (rail peer → rail
peer, a block is written), ``N_READY`` (node peer → node peer, my boxes / my staging are
complete), ``U_CREDIT`` (after finishing a round a rank tells its rail peers that its box half of
the round before is free). Every rank takes part in every round of a call (the same number
everywhere, known after round 0), and waits for ``N_READY`` of all node peers in every round —
which proves they finished reading the previous round, so the UBMEM staging needs no credit.

Round 0 of every call carries a header per block (operation, shapes, dtypes, handle id, status,
message); as in :mod:`.intranode`, a rank whose arguments were rejected sends only headers with
an error status and every rank raises the same :class:`ConsensusError` after the round. When the
round found a problem, the ranks first all-gather their own calls (:meth:`InternodeEngine._settle`),
so that ranks in different calls are named with the calls they are in.
"""

from __future__ import annotations

import functools
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple, NoReturn

import numpy as np
import torch

from ..rounding import align, ceil_div
from . import memory
from .handles import InternodeHandle
from .layout import recv_channel_prefix, send_layout, to_local_experts
from .phases import RECORDER as _PH
from .protocol import (
    CONSENSUS_WORDS,
    MAGIC,
    MSG_BYTES,
    MSG_WORD,
    OP_CACHED_DISPATCH,
    OP_COMBINE,
    OP_DISPATCH,
    OP_NAMES,
    W_CALL,
    W_CHANNELS,
    W_HANDLE,
    W_MAGIC,
    W_NEXP,
    W_NTOK,
    W_OP,
    W_OP_CALL,
    W_SBYTES,
    W_SDTYPE,
    W_STATUS,
    W_TOPK,
    W_WCOLS,
    W_XBYTES,
    W_XDTYPE,
    CallCounter,
    call_name,
    consensus_error,
    consensus_problems,
    dtype_code,
    header_call_name,
    sequence_problem,
)
from .reduce import CombineScratch, accumulate_rows
from .rows import SentRows

_CONSENSUS = list(CONSENSUS_WORDS)
U_READY, U_CREDIT = 0, 1  # slots of the URMA window
N_READY = 0  # slot of the UBMEM window
NUM_URMA_SLOTS, NUM_UBMEM_SLOTS = 2, 1
HDR = 256  # header bytes sent with every block (32 int64 words: the protocol's words, W_ROWS, W_AUX)
W_ROWS, W_AUX = 30, 31  # rows in this block; combine: largest token count of the sender's node
STAGE_HDR = 1024  # combine staging header: the 16 words, then the message at word 32
_ALIGN = 128


def _offsets(base: int, rows: int, row_fields) -> tuple[list, int]:
    """Field ``i`` of ``rows`` rows starts at ``offs[i]``; fields follow one another unpadded."""
    offs, off = [], base
    for nbytes in row_fields:
        offs.append(off)
        off += rows * nbytes
    return offs, off


class _Received(NamedTuple):
    """A non-cached dispatch's outputs, ``max(N_recv, num_worst_tokens)`` rows each."""

    x: torch.Tensor  # [rows, xb] uint8
    scales: torch.Tensor | None  # [rows, sb] uint8
    topk_idx: torch.Tensor | None  # [rows, K] int64
    topk_weights: torch.Tensor | None  # [rows, K] float32
    src_meta: torch.Tensor  # [rows, 8] uint8: int32 source token, int32 source node


@dataclass
class _DispatchCall:
    """A non-cached dispatch in progress: its arguments, then (from round 0's headers,
    :meth:`InternodeEngine._open_dispatch`) its counts, outputs and what this rank forwards."""

    call_id: int
    xb: int  # bytes per row of x
    sb: int  # bytes per row of the FP8 scales (0: none)
    num_topk: int
    with_scales: bool
    with_topk: bool
    num_experts: int
    expert_alignment: int
    num_worst_tokens: int
    num_channels: int
    ntok: np.ndarray | None = None  # [R] tokens of every rank
    counts_to_me: np.ndarray | None = None  # [R] int64 tokens each rank sends here
    gbl_prefix: torch.Tensor | None = None  # [R] int32 inclusive prefix of counts_to_me
    num_recv: int = 0
    num_recv_t: torch.Tensor | None = None  # 0-dim int64: num_recv, as yielded (set once the counts arrived)
    recv_counts: torch.Tensor | None = None  # [E / R] int64: (token, slot) pairs per local expert, likewise
    fwd_prefix: torch.Tensor | None = None  # [G] int32 inclusive prefix of fwd_counts (the handle's)
    recv_list: list | None = None
    fwd_counts: np.ndarray | None = None  # [G] int64 tokens this rank forwards, per source node
    out: _Received | None = None
    send_nvl_head: torch.Tensor | None = None
    recv_rdma_channel_prefix_matrix: torch.Tensor | None = None
    recv_gbl_channel_prefix_matrix: torch.Tensor | None = None
    cursor: list = field(default_factory=list)  # next row of each source's block
    fwd_src: list = field(default_factory=list)  # per source node: source token indices forwarded, per round (numpy)
    fwd_mask: list = field(default_factory=list)  # per source node: their [rows, P] receiver masks, per round (numpy)


@dataclass
class _CombineCall:
    """A combine in progress: its inputs, the handle, and how far the forwarded tokens got."""

    call_id: int
    rows: torch.Tensor  # [N_recv, 2H] uint8: the rows this rank returns (its x)
    topk_weights: torch.Tensor | None  # [>= N_recv, K'] float32
    bias: tuple | None
    handle: InternodeHandle
    hidden: int
    wcols: int  # columns of topk_weights, -1: none
    per_round: int  # tokens per origin per round
    src: torch.Tensor  # [N_recv] int64: each returned row's token at its origin
    starts: list  # R + 1 ints: rows from source s are [starts[s], starts[s + 1])
    forward_starts: list  # G + 1 ints: tokens forwarded for node a are rows [.., ..) of send_nvl_head
    combined: torch.Tensor  # [N, H] bf16
    combined_w: torch.Tensor | None  # [N, K'] float32
    forwarded_done: list  # per origin node: forwarded tokens already returned as partials
    staged_done: np.ndarray  # [P, R] int64: rows each node peer staged so far, per origin
    spans: list = field(default_factory=list)  # this round: rows [begin, end) of x returned to each origin
    src_max: int = -1  # the largest token index among the returned rows (-1: none)
    keyed: bool = False  # EPBuffer's order: the last weight column is each row's sort key
    node_order: torch.Tensor | None = None  # [N, G] int64: the origin's key of each node's partial
    # one rank per node: a node partial is this rank's returned rows as they lie in x (_returns_in_place)
    in_place: bool = False

    @property
    def weight_cols(self) -> int:
        return max(self.wcols, 0)

    @property
    def row_fields(self) -> list[int]:
        """Bytes per row of a staged or partial row's fields: weights first (4-byte aligned), then bf16 x."""
        return [4 * self.weight_cols, 2 * self.hidden]


class InternodeEngine:
    """Runs normal-mode calls for one Buffer when its ranks span more than one node.

    Same generator protocol as :class:`.intranode.IntranodeEngine`: the first ``next()`` returns
    the outputs, running to the end completes the data movement.

    Args:
        tp: the transport (any number of nodes).
        ubmem_win: the UBMEM window (combine staging), ``num_nvl_bytes`` per rank.
        urma_win: the URMA window (boxes), ``num_rdma_bytes`` per rank.
    """

    def __init__(self, tp, ubmem_win, urma_win):
        topo = tp.topology
        self.tp, self.nwin, self.uwin = tp, ubmem_win, urma_win
        self.rank, self.num_ranks = topo.rank, topo.world_size
        self.G, self.P = topo.num_nodes, topo.ranks_per_node
        self.node, self.local = topo.node, topo.local_rank
        self.rails = [topo.rail_peer(self.rank, c) for c in range(self.G)]
        self.remote_rails = [r for r in self.rails if r != self.rank]
        self.node_base = self.node * self.P
        self.node_peers = [p for p in topo.node_ranks() if p != self.rank]
        self.u_half = (urma_win.nbytes // 2) // _ALIGN * _ALIGN
        self.box = (self.u_half // self.G) // _ALIGN * _ALIGN
        self.n_half = (ubmem_win.nbytes // 2) // _ALIGN * _ALIGN
        self.stage_rows_off = STAGE_HDR + align(8 * self.num_ranks, 8)  # combine's staged rows, after the count vector
        self.seq = 0  # rounds run so far; identical on every rank
        self.op_calls = CallCounter()  # this rank's dispatches and combines (header word W_OP_CALL)
        self._pack = torch.empty(0, dtype=torch.uint8)  # staging of blocks bound for other nodes
        self._scratch = CombineScratch()
        self.outputs = memory.OutputPool()  # recv_x, combined_x: storage reused once the caller drops them
        # the halves of the node's windows and the box headers: see _half, _box_words
        self._views = memory.ViewCache(4 * self.P + 2 * self.P * self.G + 8)

    def release(self) -> None:
        """Drop the window views kept across calls (before the windows are freed; later calls make them again)."""
        self._views.clear()

    # -- sizing ----------------------------------------------------------------------
    def windows_hold_headers(self) -> bool:
        """Each node box holds a header and an error message, each staging half its header (no rows yet)."""
        return self.box >= HDR + MSG_BYTES and self.n_half >= STAGE_HDR + align(8 * self.num_ranks, 8)

    def min_window_bytes(self) -> str:
        """The smallest window sizes for which :meth:`windows_hold_headers` holds, as text."""
        box = align(HDR + MSG_BYTES, _ALIGN)
        stage = align(STAGE_HDR + align(8 * self.num_ranks, 8), _ALIGN)
        return f"at least num_nvl_bytes={2 * stage} and num_rdma_bytes={2 * self.G * box}, plus rows"
    def _dispatch_vec_ints(self, num_experts: int) -> int:
        return self.num_ranks + num_experts + self.G

    def dispatch_fields(self, xb, sb, k, cached) -> list[int]:
        """Row fields of a dispatch block, by decreasing alignment: topk ids, weights, scales, src, x, mask."""
        if cached:
            return [sb, xb, self.P]
        return [8 * k, 4 * k, sb, 4, xb, self.P]

    def dispatch_capacity(self, xb, sb, k, num_experts, cached) -> int:
        """Tokens per sender per round (every one of them may need every node)."""
        rows_off = HDR + (0 if cached else align(4 * self._dispatch_vec_ints(num_experts), 8))
        return max(0, (self.box - MSG_BYTES - rows_off) // sum(self.dispatch_fields(xb, sb, k, cached)))

    def combine_capacity(self, hidden, wcols) -> int:
        """Tokens per origin per round: its box takes them all, a staging half takes them from every origin a
        node peer forwards (the ``R - G`` of another local index than this rank's; none with one rank per node)."""
        row = 2 * hidden + 4 * max(wcols, 0)
        box_rows = (self.box - MSG_BYTES - HDR) // row
        staged = self.num_ranks - self.G
        if not staged:
            return max(0, box_rows)
        stage_rows = (self.n_half - STAGE_HDR - align(8 * self.num_ranks, 8)) // row // staged
        return max(0, min(box_rows, stage_rows))

    @staticmethod
    def size_hints(num_tokens, xb, sb, k, num_experts, num_ranks, num_nodes, combine_xb, wcols) -> tuple[int, int]:
        """``(num_nvl_bytes, num_rdma_bytes)`` for which calls of ``num_tokens`` tokens per rank never chunk."""
        rpn = num_ranks // num_nodes
        disp_row = 8 * k + 4 * k + sb + 4 + xb + rpn
        disp_box = HDR + align(4 * (num_ranks + num_experts + num_nodes), 8) + num_tokens * disp_row + MSG_BYTES
        comb_row = combine_xb + 4 * wcols
        comb_box = HDR + num_tokens * comb_row + MSG_BYTES
        box = align(max(disp_box, comb_box), _ALIGN)
        stage = STAGE_HDR + align(8 * num_ranks, 8) + (num_ranks - num_nodes) * num_tokens * comb_row
        stage = align(stage, _ALIGN)
        return 2 * stage + 2 * _ALIGN, 2 * num_nodes * box + 2 * _ALIGN

    # -- primitives ----------------------------------------------------------------------
    def _box_off(self, seq, a):
        return (seq % 2) * self.u_half + a * self.box

    def _half(self, urma: bool, p: int) -> torch.Tensor:
        """This round's half of node peer ``p``'s URMA (boxes) or UBMEM (staging) window, uint8, kept across
        calls (:class:`~.memory.ViewCache`: the transport's checked view once per half, a slice per use)."""
        half = self.seq % 2
        win, size = (self.uwin, self.u_half) if urma else (self.nwin, self.n_half)
        return self._views.get((urma, p, half), lambda: self.tp.peer_view(win, p, half * size, size))

    def _box(self, f, a, off, nbytes, dtype=torch.uint8):
        """View of forwarder ``f``'s box ``a`` (this round's half), ``nbytes`` from byte ``off``."""
        lo = a * self.box + off
        v = self._half(True, f)[lo:lo + nbytes]
        return v if dtype is torch.uint8 else v.view(dtype)

    def _box_words(self, f, a) -> np.ndarray:
        """The header words of forwarder ``f``'s box ``a`` (this round's half): int64 numpy, kept across calls."""
        half = self.seq % 2
        return self._views.get(("words", f, a, half), lambda: self._box(f, a, 0, HDR, torch.int64).numpy())

    def _stage(self, p, off, nbytes, dtype=torch.uint8):
        v = self._half(False, p)[off:off + nbytes]
        return v if dtype is torch.uint8 else v.view(dtype)

    @memory.outside_inference_mode  # kept across calls, and written by every dispatch whatever its mode
    def _pack_buffer(self, nbytes):
        if self._pack.numel() < nbytes:
            self._pack = memory.empty((max(nbytes, 2 * self._pack.numel()),), torch.uint8)
        return self._pack[:nbytes]

    def _block(self, c, nbytes):
        """Where to build the block bound for node ``c``: our own box ``node`` if ``c`` is our node."""
        if c == self.node:
            return self._box(self.rank, self.node, 0, nbytes)
        return self._pack_buffer(nbytes)

    def _send(self, c, blk, message: str | None, rows_put: tuple | None = None):
        """Deliver a block built by :meth:`_block` to the rail peer on node ``c`` and raise its ``U_READY``;
        ``rows_put``: ``(offset, rows)``, bytes the block leaves out, put first at that offset of the box."""
        if _PH.on:
            _PH.switch("send")
        if c == self.node:
            self.tp.record_put(self.rank, blk.numel())  # routed to ourselves: SELF traffic
            if message is not None:
                self._write_message(self._box(self.rank, self.node, self.box - MSG_BYTES, MSG_BYTES), message)
            return
        dst = self.rails[c]
        base = self._box_off(self.seq, self.node)
        if message is not None:
            msg = self._pack_buffer(blk.numel() + MSG_BYTES)[blk.numel():]
            self._write_message(msg, message)
            self.tp.put(self.uwin, dst, base + self.box - MSG_BYTES, msg)
        if rows_put is not None:  # completed with the block's put below (its flush), before the signal
            self.tp.put(self.uwin, dst, base + rows_put[0], rows_put[1])
        self.tp.put_with_signal(self.uwin, dst, base, blk, U_READY)

    @staticmethod
    def _write_message(view, message):
        view.copy_(torch.frombuffer(bytearray(message.encode("utf-8")[:MSG_BYTES].ljust(MSG_BYTES, b"\0")),
                                    dtype=torch.uint8))

    @staticmethod
    def _write_header(blk, words):
        hdr = blk[:HDR].view(torch.int64).numpy()
        hdr[:] = 0
        hdr[W_MAGIC] = MAGIC
        for k, v in words.items():
            hdr[k] = v

    def _full_header(self, hdr_words, read_message):
        """``[128]`` int64 header as :func:`consensus_problems` reads it (message from word 32 if any)."""
        h = np.zeros(128, dtype=np.int64)
        h[:HDR // 8] = hdr_words
        if h[W_STATUS]:
            h[MSG_WORD:] = read_message().numpy().view(np.int64)
        return h

    def _credit_wait(self, phase):
        """Before writing this round's half of the rail peers' boxes: they finished the round before."""
        if self.seq >= 2 and self.remote_rails:
            prev = _PH.switch("wait: rail boxes free") if _PH.on else None
            self.tp.wait_until(self.uwin, U_CREDIT, self.remote_rails, self.seq,
                               phase=f"{phase}: reuse of the rail peers' boxes")
            if _PH.on:
                _PH.switch(prev)

    def _await_rails(self, phase):
        if self.remote_rails:
            prev = _PH.switch("wait: rail blocks") if _PH.on else None
            self.tp.wait_until(self.uwin, U_READY, self.remote_rails, self.seq + 1,
                               phase=f"{phase}: blocks from the rail peers")
            if _PH.on:
                _PH.switch(prev)

    def _node_exchange(self, phase):
        prev = _PH.switch("signal") if _PH.on else None
        for p in self.node_peers:
            self.tp.signal(self.nwin, p, N_READY, ordered=True)
        if self.node_peers:
            if _PH.on:
                _PH.switch("wait: node peers")
            self.tp.wait_until(self.nwin, N_READY, self.node_peers, self.seq + 1, phase=f"{phase}: node peers")
        if _PH.on:
            _PH.switch(prev)

    def _end_round(self):
        if _PH.on:
            _PH.switch("signal")
        for r in self.remote_rails:
            self.tp.signal(self.uwin, r, U_CREDIT, ordered=True)
        self.seq += 1

    def _record(self, peer, nbytes):
        if nbytes:
            self.tp.record_fetch(peer, nbytes)

    def _settle(self, op, call_id, op_call, error, problems, phase) -> list[str]:
        """What every rank raises once round 0 of a call found ``problems`` here (every rank finds some
        when one does; docs/design/data-path.md, "Normal mode across nodes").

        Dispatch reads the peers' headers rail first, then node; combine node first, then the rail peers'
        verdicts. With ranks in different operations a rank can thus find a peer's header of an earlier
        call where it looks, or, in combine, no header of the ranks outside its node and rail. So on this
        error path every rank all-gathers its own call and refusal (``error``: None if it accepted its
        arguments), on the transport's own communicator (deadline and abort check included). Ranks all in
        the same call computed the same ``problems`` from the same headers and verdicts: kept. Otherwise
        every rank is named with its own call and refusal, the same list on every rank.
        """
        calls = self.tp.allgather_object((int(op), int(call_id), int(op_call), error),
                                         phase=f"{phase}: the ranks' calls")
        if len({(o, c) for o, c, _, _ in calls}) == 1:
            return problems
        return [sequence_problem((p, call_name(o, c, k)) for p, (o, c, k, _) in enumerate(calls))] + [
            f"rank {p} rejected its arguments: {e}" for p, (_, _, _, e) in enumerate(calls) if e is not None]

    # -- dispatch ------------------------------------------------------------------------
    def reject(self, op, call_id, message) -> NoReturn:
        """Take part in round 0 of a call with an error status; raises ConsensusError (on every rank)."""
        if op == OP_COMBINE:
            gen = self._combine_rounds(call_id=call_id, words={}, n=0, per_round=1, error=message, stage=None,
                                       forward=None, reduce=None)
        else:
            gen = self._dispatch_rounds(op=op, call_id=call_id, words={}, n=0, fields=[], pack=None, vec=None,
                                        error=message, on_headers=None, receive=None)
        for _ in gen:
            pass
        raise AssertionError("unreachable: the consensus check raises")  # pragma: no cover

    def _dispatch_rounds(self, *, op, call_id, words, n, fields, pack, vec, error, on_headers, receive,
                         in_node=None) -> Generator:
        """The round driver of dispatch and cached dispatch (hop 1, node exchange, hop 2 by ``receive``).

        ``in_node [N, G]`` bool: the token goes into the block for node ``c`` (:meth:`_block_rows`).
        ``pack(c, blk, offs, idx)`` fills the row fields of the tokens ``idx`` (of this round) bound for
        node ``c``; ``on_headers(headers, vecs, per_round)`` runs once after round 0 and returns the number
        of rounds; ``receive(vec_bytes, lo, hi)`` gathers this rank's rows of the round (this rank's own
        tokens ``[lo, hi)`` among them). Yields once, after round 0's headers are known (the caller yields
        its outputs then).
        """
        phase = f"{OP_NAMES[op]} call #{call_id}"
        vec_bytes = 0 if vec is None else align(4 * vec.numel(), 8)
        per_round = max(1, (self.box - MSG_BYTES - HDR - vec_bytes) // max(1, sum(fields)))
        op_call = self.op_calls.next(op)
        words = {**words, W_CALL: call_id, W_OP: op, W_OP_CALL: op_call, W_STATUS: int(error is not None)}
        rounds, rnd = 1, 0
        while rnd < rounds:
            self._credit_wait(phase)
            lo, hi = rnd * per_round, min(n, (rnd + 1) * per_round)
            sub = in_node[lo:hi] if (error is None and hi > lo) else None
            with_vec = rnd == 0 and vec is not None  # count vectors travel in round 0 only
            for c in [*range(self.node + 1, self.G), *range(self.node + 1)]:  # remote nodes first, own last
                if _PH.on:
                    _PH.switch("pack")
                idx = torch.nonzero(sub[:, c]).squeeze(1) if sub is not None else torch.empty(0, dtype=torch.int64)
                rows = idx.numel()
                offs, end = _offsets(HDR + (vec_bytes if with_vec else 0), rows, fields)
                blk = self._block(c, end)
                self._write_header(blk, {**words, W_ROWS: rows})
                if with_vec:
                    blk[HDR:HDR + 4 * vec.numel()].view(torch.int32).copy_(vec)
                if rows:
                    pack(c, blk, offs, idx + lo)
                self._send(c, blk, error)
            self._await_rails(phase)
            self._node_exchange(phase)
            if rnd == 0:
                headers, vecs = self._read_dispatch_headers(op, call_id, vec)
                problems = consensus_problems(headers, op, call_id)
                if problems:
                    self._end_round()
                    raise consensus_error(op, self._settle(op, call_id, op_call, error, problems, phase))
                rounds = on_headers(headers, vecs, per_round)
                yield
            receive(vec_bytes if with_vec else 0, lo, hi)
            self._end_round()
            rnd += 1

    def _block_rows(self, itr_nodes: torch.Tensor) -> torch.Tensor:
        """``[N, G]`` bool: token ``t`` goes into this rank's block for node ``c``: it has a target rank there,
        other than this rank itself on its own node (the rows this rank receives from itself it copies from
        its own tensors in hop 2; with one rank per node its own node's block carries no row)."""
        blocks = itr_nodes.any(2)
        mine = itr_nodes[:, self.node]
        blocks[:, self.node] = mine.sum(1, dtype=torch.int32) > mine[:, self.local]  # a target besides itself
        return blocks

    def _source_blocks(self, rows_off, fields) -> Iterator[tuple[int, int, int, int, list, torch.Tensor]]:
        """This round's non-empty dispatch blocks, by ascending source rank ``s = (a, l)``: each is
        box ``a`` of forwarder ``f = (our node, l)``. Yields ``(s, a, f, rows, field offsets, block view)``."""
        for s in range(self.num_ranks):
            a, ls = divmod(s, self.P)
            f = self.node_base + ls
            m = int(self._box_words(f, a)[W_ROWS])
            if m:
                offs, end = _offsets(rows_off, m, fields)
                yield s, a, f, m, offs, self._box(f, a, 0, end)

    def _read_dispatch_headers(self, op, call_id, vec) -> tuple[np.ndarray, list[torch.Tensor]]:
        """Round 0: every source's header (and count vector) from its forwarder's box, ``[R, 128]``."""
        if _PH.on:
            _PH.switch("control")
        headers = np.zeros((self.num_ranks, 128), dtype=np.int64)
        vecs = []
        for s in range(self.num_ranks):
            a, ls = divmod(s, self.P)
            f = self.node_base + ls
            hw = self._box_words(f, a)
            headers[s] = self._full_header(hw, lambda f=f, a=a: self._box(f, a, self.box - MSG_BYTES, MSG_BYTES))
            if vec is not None and not headers[s, W_STATUS] and headers[s, W_OP] == OP_DISPATCH:
                vecs.append(self._box(f, a, HDR, 4 * vec.numel(), torch.int32).numpy().copy())
        return headers, vecs

    def dispatch(self, *, call_id, x, scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_rank,
                 num_tokens_per_rdma_rank, num_tokens_per_expert, num_experts, expert_alignment, num_worst_tokens,
                 num_channels, handle_id, xdtype, sdtype, extra_words: dict | None = None) -> Generator:
        """Non-cached internode dispatch (docs/semantics/deepep-api.md §5). ``extra_words``: more header words
        every rank must agree on (``EPBuffer``'s collective arguments, ``protocol.W_EP_*``).
        ``x`` is ``[N, xb]`` uint8, ``scales`` ``[N, sb]`` uint8 or None.

        Yields once ``(recv_x_bytes, recv_scales_bytes, recv_topk_idx, recv_topk_weights,
        num_recv_tokens_per_expert_list, handle, num_recv, recv_counts)`` (``num_recv``: 0-dim int64
        tensor; ``recv_counts`` ``[E / R]`` int64: the (token, slot) pairs received per local expert) with
        ``handle`` an :class:`InternodeHandle` whose receive-side entries are filled when the generator ends.
        As :meth:`.intranode.IntranodeEngine.dispatch`: after round 0, or with ``num_worst_tokens > 0``
        before any communication (the count-dependent entries, ``send_nvl_head`` resized to the tokens this
        rank forwards, are filled in place after round 0).
        """
        n, xb = x.shape
        sb = scales.shape[1] if scales is not None else 0
        num_topk = topk_idx.shape[1] if topk_idx is not None else 0
        fields = self.dispatch_fields(xb, sb, num_topk, cached=False)
        itr_nodes = is_token_in_rank.view(n, self.G, self.P)
        in_node = itr_nodes.any(2)
        words = {W_NTOK: n, W_XBYTES: xb, W_XDTYPE: xdtype, W_SBYTES: sb, W_SDTYPE: sdtype,
                 W_TOPK: num_topk if topk_idx is not None else -1, W_NEXP: num_experts, W_HANDLE: handle_id,
                 W_CHANNELS: num_channels, W_WCOLS: -1, **(extra_words or {})}
        vec = torch.cat([num_tokens_per_rank, num_tokens_per_expert, num_tokens_per_rdma_rank]).to(torch.int32)
        call = _DispatchCall(call_id=call_id, xb=xb, sb=sb, num_topk=num_topk, with_scales=scales is not None,
                             with_topk=topk_idx is not None, num_experts=num_experts,
                             expert_alignment=expert_alignment, num_worst_tokens=num_worst_tokens,
                             num_channels=num_channels)
        # The handle's fixed-shape receive entries, filled in place by _open_dispatch / _close_dispatch.
        call.num_recv_t = torch.zeros((), dtype=torch.int64)
        call.recv_counts = torch.zeros(num_experts // self.num_ranks, dtype=torch.int64)
        call.gbl_prefix = torch.zeros(self.num_ranks, dtype=torch.int32)
        call.fwd_prefix = torch.zeros(self.G, dtype=torch.int32)
        call.send_nvl_head = torch.empty(0, self.P, dtype=torch.int32)
        call.recv_rdma_channel_prefix_matrix = torch.zeros(self.G, num_channels, dtype=torch.int32)
        call.recv_gbl_channel_prefix_matrix = torch.zeros(self.num_ranks, num_channels, dtype=torch.int32)
        rounds_gen = self._dispatch_rounds(
            op=OP_DISPATCH, call_id=call_id, words=words, n=n, fields=fields,
            pack=functools.partial(self._pack_dispatch_block, x, scales, topk_idx, topk_weights, itr_nodes), vec=vec,
            error=None, on_headers=functools.partial(self._open_dispatch, call),
            receive=functools.partial(self._receive_dispatch_blocks, call, fields,
                                      SentRows(x, scales, topk_idx, topk_weights, is_token_in_rank)),
            in_node=self._block_rows(itr_nodes))
        early = num_worst_tokens > 0  # static shapes: yield before the count exchange
        if early:
            call.out = self._dispatch_outputs(call, num_worst_tokens)
        else:
            next(rounds_gen)
        if _PH.on:
            _PH.switch("outputs")
        rdma_cpm, _ = send_layout(in_node, num_channels)
        gbl_cpm, _ = send_layout(is_token_in_rank, num_channels)
        # send_rdma_head[t][c]: position of token t among this rank's tokens for node c (-1: none).
        send_rdma_head = torch.where(in_node, in_node.to(torch.int32).cumsum(0, dtype=torch.int32) - 1,
                                     torch.full((n, self.G), -1, dtype=torch.int32))
        out = call.out
        handle = InternodeHandle(is_token_in_rank, rdma_cpm, gbl_cpm, call.recv_rdma_channel_prefix_matrix,
                                 call.fwd_prefix, call.recv_gbl_channel_prefix_matrix,
                                 call.gbl_prefix, out.src_meta, send_rdma_head, call.send_nvl_head)
        yield (out.x, out.scales, out.topk_idx, out.topk_weights, [] if early else call.recv_list, handle,
               call.num_recv_t, call.recv_counts)

        for _ in rounds_gen:
            pass
        if _PH.on:
            _PH.switch("epilogue")
        self._close_dispatch(call)

    def _dispatch_outputs(self, call: _DispatchCall, rows: int) -> _Received:
        """A dispatch's outputs of ``rows`` rows (``src_meta`` zeroed; padding: :meth:`_pad_outputs`)."""
        return _Received(
            self.outputs.empty((rows, call.xb), torch.uint8),
            torch.empty(rows, call.sb, dtype=torch.uint8) if call.with_scales else None,
            torch.empty(rows, call.num_topk, dtype=torch.int64) if call.with_topk else None,
            torch.empty(rows, call.num_topk, dtype=torch.float32) if call.with_topk else None,
            torch.zeros(rows, 8, dtype=torch.uint8))

    @staticmethod
    def _pad_outputs(out: _Received, num_recv: int) -> None:
        """Rows past ``num_recv``: zeros, and -1 expert ids (docs/semantics/deepep-api.md §4.4)."""
        if out.x.size(0) <= num_recv:
            return
        for t in (out.x, out.scales, out.topk_weights):
            if t is not None:
                t[num_recv:].zero_()
        if out.topk_idx is not None:
            out.topk_idx[num_recv:].fill_(-1)

    def _pack_dispatch_block(self, x, scales, topk_idx, topk_weights, itr_nodes, c, blk, offs, tok) -> None:
        """Fill the row fields of the block bound for node ``c`` with this rank's tokens ``tok``."""
        m, num_topk = tok.numel(), topk_idx.size(1) if topk_idx is not None else 0
        xb, sb, p = x.size(1), scales.size(1) if scales is not None else 0, self.P
        if num_topk:
            torch.index_select(topk_idx, 0, tok,
                               out=blk[offs[0]:offs[0] + 8 * num_topk * m].view(torch.int64).view(m, num_topk))
            torch.index_select(topk_weights, 0, tok,
                               out=blk[offs[1]:offs[1] + 4 * num_topk * m].view(torch.float32).view(m, num_topk))
        if sb:
            torch.index_select(scales, 0, tok, out=blk[offs[2]:offs[2] + sb * m].view(m, sb))
        blk[offs[3]:offs[3] + 4 * m].view(torch.int32).copy_(tok)
        torch.index_select(x, 0, tok, out=blk[offs[4]:offs[4] + xb * m].view(m, xb))
        torch.index_select(itr_nodes[:, c, :], 0, tok, out=blk[offs[5]:offs[5] + p * m].view(torch.bool).view(m, p))

    def _open_dispatch(self, call: _DispatchCall, headers, vecs, per_round) -> int:
        """After round 0: counts from every source's vector, the outputs, the forwarder's bookkeeping.
        Returns the number of rounds."""
        me, num_ranks, num_nodes, per_node = self.rank, self.num_ranks, self.G, self.P
        call.ntok = headers[:, W_NTOK].astype(np.int64)
        # a few small integer vectors: numpy, where each torch operator call costs several times as much
        vectors = np.stack(vecs).astype(np.int64)  # [R, R + E + G]
        call.counts_to_me = to_me = vectors[:, me]
        gbl = np.cumsum(to_me)
        call.gbl_prefix.numpy()[:] = gbl
        call.num_recv = num_recv = int(gbl[-1])
        call.num_recv_t.fill_(num_recv)
        local = call.num_experts // num_ranks
        per_expert = vectors[:, num_ranks + me * local:num_ranks + (me + 1) * local].sum(0)
        call.recv_counts.numpy()[:] = per_expert
        alignment = call.expert_alignment
        call.recv_list = [] if call.num_worst_tokens else [align(c, alignment) for c in per_expert.tolist()]
        if _PH.on:
            _PH.switch("outputs")
        # Tokens this rank forwards, per source node a: rail peer (a, l)'s count for our node.
        call.fwd_counts = vectors[[a * per_node + self.local for a in range(num_nodes)],
                                  num_ranks + call.num_experts + self.node]
        call.fwd_prefix.numpy()[:] = np.cumsum(call.fwd_counts)
        call.send_nvl_head.resize_(int(call.fwd_counts.sum()), per_node).fill_(-1)
        if call.out is None or num_recv > call.out.x.size(0):
            # counts first, or (worst-token mode) more rows than num_worst_tokens: the caller raises, and the
            # rows still arrive, into scratch outputs, so that every rank stays in step
            call.out = self._dispatch_outputs(call, num_recv)
        else:
            self._pad_outputs(call.out, num_recv)
        call.cursor = [0] + gbl[:-1].tolist()
        call.fwd_src = [[] for _ in range(num_nodes)]
        call.fwd_mask = [[] for _ in range(num_nodes)]
        return max(1, max(ceil_div(int(t), per_round) for t in call.ntok))

    def _receive_dispatch_blocks(self, call: _DispatchCall, fields, sent: SentRows, vec_bytes, lo, hi) -> None:
        """Hop 2 of a round: this rank's rows from every source, ascending source rank (its own from its own
        tensors, the others' from their blocks); as a forwarder, also keep the source indices and masks of
        what it forwards (for the handle)."""
        if _PH.on:
            _PH.switch("copy")
        me, num_topk, xb, sb, p = self.rank, call.num_topk, call.xb, call.sb, self.P
        out = call.out
        meta32 = out.src_meta.view(torch.int32)
        blocks = {s: rest for s, *rest in self._source_blocks(HDR + vec_bytes, fields)}
        for s in range(self.num_ranks):
            if s == me:
                # as forwarder of its own tokens on its own node (for the handle), then its rows to itself
                mine = sent.is_token_in_rank.view(-1, self.G, self.P)[:, self.node]  # [N, P]
                fwd = torch.nonzero(mine[lo:hi].any(1)).squeeze(1) + lo
                call.fwd_src[self.node].append(fwd.numpy())
                call.fwd_mask[self.node].append(mine[fwd].numpy())
                tok = torch.nonzero(mine[lo:hi, self.local]).squeeze(1) + lo
                srcs = (sent.x, sent.scales, sent.topk_idx, sent.topk_weights, tok.to(torch.int32))
                a, f, idx = self.node, me, tok
            elif s in blocks:
                a, f, m, offs, blk = blocks[s]
                mask = blk[offs[5]:offs[5] + p * m].view(torch.bool).view(m, p)
                src = blk[offs[3]:offs[3] + 4 * m].view(torch.int32)
                if f == me:  # as forwarder: what we forward from node a, for the handle
                    call.fwd_src[a].append(src.numpy().copy())
                    call.fwd_mask[a].append(mask.numpy().copy())
                idx = torch.nonzero(mask[:, self.local]).squeeze(1)
                srcs = (blk[offs[4]:offs[4] + xb * m].view(m, xb),
                        blk[offs[2]:offs[2] + sb * m].view(m, sb) if sb else None,
                        blk[offs[0]:offs[0] + 8 * num_topk * m].view(torch.int64).view(m, num_topk) if num_topk
                        else None,
                        blk[offs[1]:offs[1] + 4 * num_topk * m].view(torch.float32).view(m, num_topk) if num_topk
                        else None, src)
            else:
                continue
            got = idx.numel()
            if not got:
                continue
            at = call.cursor[s]
            if at + got > int(call.gbl_prefix[s]):
                raise RuntimeError(f"rank {me}: dispatch call #{call.call_id}: rank {s} sent more tokens than its "
                                   f"num_tokens_per_rank promised ({int(call.counts_to_me[s])})")
            rows_x, rows_s, rows_i, rows_w, rows_src = srcs
            torch.index_select(rows_x, 0, idx, out=out.x[at:at + got])
            if sb:
                torch.index_select(rows_s, 0, idx, out=out.scales[at:at + got])
            if num_topk:
                torch.index_select(rows_i, 0, idx, out=out.topk_idx[at:at + got])
                torch.index_select(rows_w, 0, idx, out=out.topk_weights[at:at + got])
            if s == me:
                meta32[at:at + got, 0] = rows_src
            else:
                torch.index_select(rows_src, 0, idx, out=meta32[at:at + got, 0])
            meta32[at:at + got, 1] = a
            call.cursor[s] = at + got
            self._record(f, got * sum(fields))

    def _close_dispatch(self, call: _DispatchCall) -> None:
        """After the last round: every source sent what it promised; the receive side of the handle; the
        received expert ids made local."""
        me, num_ranks, num_recv = self.rank, self.num_ranks, call.num_recv
        starts = [0] + [int(v) for v in call.gbl_prefix]
        for s in range(num_ranks):
            if call.cursor[s] != starts[s + 1]:
                raise RuntimeError(f"rank {me}: dispatch call #{call.call_id}: received {call.cursor[s] - starts[s]} "
                                   f"tokens from rank {s}, its num_tokens_per_rank promised "
                                   f"{int(call.counts_to_me[s])}")
        src_idx = call.out.src_meta.view(torch.int32)[:num_recv, 0]
        rel = recv_channel_prefix(src_idx, starts, call.ntok, call.num_channels)
        call.recv_gbl_channel_prefix_matrix.copy_(
            rel + torch.tensor(starts[:num_ranks], dtype=torch.int32).unsqueeze(1))
        self._finish_forward_handle(call)
        if call.out.topk_idx is not None and num_recv:
            to_local_experts(call.out.topk_idx[:num_recv], call.out.topk_weights[:num_recv], me,
                             call.num_experts // num_ranks)

    def _finish_forward_handle(self, call: _DispatchCall) -> None:
        """``send_nvl_head`` and ``recv_rdma_channel_prefix_matrix`` from what this rank forwarded."""
        per_node, num_channels = self.P, call.num_channels
        pos = 0
        for a in range(self.G):  # (numpy: small arrays)
            if call.fwd_mask[a]:
                mask = np.concatenate(call.fwd_mask[a])
                src = np.concatenate(call.fwd_src[a]).astype(np.int64)
            else:
                mask = np.zeros((0, per_node), dtype=bool)
                src = np.zeros(0, dtype=np.int64)
            m = mask.shape[0]
            if m != int(call.fwd_counts[a]):
                raise RuntimeError(f"rank {self.rank}: dispatch: forwarded {m} tokens of rank "
                                   f"{a * per_node + self.local}, its num_tokens_per_rdma_rank promised "
                                   f"{int(call.fwd_counts[a])}")
            # Row of each forwarded token inside receiver j's block of this source (-1: not for j).
            call.send_nvl_head[pos:pos + m] = torch.from_numpy(
                np.where(mask, np.cumsum(mask, 0, dtype=np.int32) - 1, -1).astype(np.int32))
            per_channel_tokens = max(1, ceil_div(int(call.ntok[a * per_node + self.local]), num_channels))
            per_channel = np.bincount(src // per_channel_tokens, minlength=num_channels)[:num_channels]
            call.recv_rdma_channel_prefix_matrix[a] = torch.from_numpy(np.cumsum(per_channel).astype(np.int32))
            pos += m

    # -- cached dispatch ---------------------------------------------------------------
    def cached_dispatch(self, *, call_id, x, scales, handle: InternodeHandle, num_channels, handle_id, xdtype,
                        sdtype, extra_words: dict | None = None) -> Generator:
        """Dispatch through an internode handle (docs/semantics/deepep-api.md §4.5, §5).
        Yields ``(recv_x, recv_scales)``."""
        n, xb = x.shape
        sb = scales.shape[1] if scales is not None else 0
        rows = handle.recv_src_meta.size(0)
        num_recv = int(handle.recv_gbl_rank_prefix_sum[-1])
        fields = self.dispatch_fields(xb, sb, 0, cached=True)
        itr_nodes = handle.is_token_in_rank.view(n, self.G, self.P)
        words = {W_NTOK: n, W_XBYTES: xb, W_XDTYPE: xdtype, W_SBYTES: sb, W_SDTYPE: sdtype,
                 W_TOPK: -1, W_NEXP: 0, W_HANDLE: handle_id, W_CHANNELS: num_channels, W_WCOLS: -1,
                 **(extra_words or {})}
        if _PH.on:
            _PH.switch("outputs")
        recv_x = self.outputs.empty((rows, xb), torch.uint8)
        if rows > num_recv:
            recv_x[num_recv:].zero_()
        recv_scales = None if scales is None else torch.zeros(rows, sb, dtype=torch.uint8)
        yield recv_x, recv_scales

        starts = [0] + [int(v) for v in handle.recv_gbl_rank_prefix_sum]
        cursor = starts[:self.num_ranks]

        def rounds_of(headers, vecs, per_round):
            return max(1, max(ceil_div(int(t), per_round) for t in headers[:, W_NTOK]))

        for _ in self._dispatch_rounds(
                op=OP_CACHED_DISPATCH, call_id=call_id, words=words, n=n, fields=fields,
                pack=functools.partial(self._pack_cached_block, x, scales, itr_nodes), vec=None, error=None,
                on_headers=rounds_of, in_node=self._block_rows(itr_nodes),
                receive=functools.partial(self._receive_cached_blocks, call_id, fields, starts, cursor, recv_x,
                                          recv_scales, SentRows(x, scales, None, None, handle.is_token_in_rank))):
            pass
        if cursor != starts[1:]:
            raise RuntimeError(f"rank {self.rank}: cached dispatch call #{call_id}: received "
                               f"{[c - s for c, s in zip(cursor, starts)]} tokens per source, this rank's handle "
                               f"expects {[b - a for a, b in zip(starts, starts[1:])]}; the handles passed on "
                               f"different ranks do not describe the same dispatch")

    def _pack_cached_block(self, x, scales, itr_nodes, c, blk, offs, tok) -> None:
        """Fill the row fields of a cached dispatch's block bound for node ``c`` with the tokens ``tok``."""
        m, xb, p = tok.numel(), x.size(1), self.P
        sb = scales.size(1) if scales is not None else 0
        if sb:
            torch.index_select(scales, 0, tok, out=blk[offs[0]:offs[0] + sb * m].view(m, sb))
        torch.index_select(x, 0, tok, out=blk[offs[1]:offs[1] + xb * m].view(m, xb))
        torch.index_select(itr_nodes[:, c, :], 0, tok, out=blk[offs[2]:offs[2] + p * m].view(torch.bool).view(m, p))

    def _receive_cached_blocks(self, call_id, fields, starts, cursor, recv_x, recv_scales, sent: SentRows,
                               vec_bytes, lo, hi) -> None:
        """Hop 2 of a cached dispatch's round: this rank's rows of every source, ascending source (its own
        from ``x`` and ``scales``, the others' from their blocks)."""
        if _PH.on:
            _PH.switch("copy")
        xb, p = recv_x.size(1), self.P
        sb = recv_scales.size(1) if recv_scales is not None else 0
        blocks = {s: rest for s, *rest in self._source_blocks(HDR, fields)}
        for s in range(self.num_ranks):
            if s == self.rank:
                own = sent.is_token_in_rank[lo:hi, s]
                f, idx, rows_x, rows_s = s, torch.nonzero(own).squeeze(1) + lo, sent.x, sent.scales
            elif s in blocks:
                _, f, m, offs, blk = blocks[s]
                idx = torch.nonzero(blk[offs[2]:offs[2] + p * m].view(torch.bool).view(m, p)[:, self.local]).squeeze(1)
                rows_x = blk[offs[1]:offs[1] + xb * m].view(m, xb)
                rows_s = blk[offs[0]:offs[0] + sb * m].view(m, sb) if sb else None
            else:
                continue
            got, at = idx.numel(), cursor[s]
            if at + got > starts[s + 1]:
                raise RuntimeError(f"rank {self.rank}: cached dispatch call #{call_id}: rank {s} sends more tokens "
                                   f"than this rank's handle expects ({starts[s + 1] - starts[s]}); the handles "
                                   f"passed on different ranks do not describe the same dispatch")
            if got:
                torch.index_select(rows_x, 0, idx, out=recv_x[at:at + got])
                if sb:
                    torch.index_select(rows_s, 0, idx, out=recv_scales[at:at + got])
                cursor[s] = at + got
                self._record(f, got * sum(fields))

    # -- combine -----------------------------------------------------------------------
    def _write_stage_header(self, words, n, call_id, error) -> None:
        """This rank's staging header of a combine round (with the error message of a rejected call)."""
        hdr = self._stage(self.rank, 0, STAGE_HDR, torch.int64).numpy()
        hdr[:] = 0
        hdr[W_MAGIC] = MAGIC
        for word, value in {**words, W_NTOK: n, W_CALL: call_id, W_OP: OP_COMBINE,
                            W_STATUS: int(error is not None)}.items():
            hdr[word] = value
        if error is not None:
            text = error.encode("utf-8")[:MSG_BYTES].ljust(MSG_BYTES, b"\0")
            hdr[MSG_WORD:] = np.frombuffer(text, dtype=np.int64)

    def _rail_verdict(self, call_id, op_call) -> tuple[list[str], int]:
        """Round 0 of a combine, after the rail exchange: why the nodes cannot run it together (empty: they
        can), and the most tokens a rank of any node has (which fixes the number of rounds)."""
        heads = [self._box_words(self.rank, c).copy() for c in range(self.G)]
        bad = []
        elsewhere = [c for c, head in enumerate(heads) if head[W_CALL] != call_id or head[W_OP] != OP_COMBINE]
        if elsewhere:
            bad.append(sequence_problem([(self.rank, call_name(OP_COMBINE, call_id, op_call))] + [
                (self.rails[c], header_call_name(heads[c], call_id)) for c in elsewhere]))
        for c, head in enumerate(heads):
            if head[W_STATUS] and c not in elsewhere:
                msg = self._box(self.rank, c, self.box - MSG_BYTES, MSG_BYTES).numpy().tobytes()
                bad.append(msg.rstrip(b"\0").decode("utf-8", "replace"))
        if not bad:  # every node agreed within itself: now the nodes against each other (one rank of each)
            bad = consensus_problems(np.stack(heads), OP_COMBINE, call_id, self.rails)
        return list(dict.fromkeys(bad)), max(int(head[W_AUX]) for head in heads)

    def _combine_rounds(self, *, call_id, words, n, per_round, error, stage, forward, reduce) -> Generator:
        """The round driver of combine: stage → node exchange → forward partials (URMA) → reduce.

        Round 0 also settles the call: the node's staging headers give the node's verdict, which
        travels with the partials to every rail peer; every rank raises the same
        :class:`ConsensusError` if any node refused. Yields once, after round 0's verdict.
        """
        phase = f"combine call #{call_id}"
        op_call = self.op_calls.next(OP_COMBINE)
        words = {**words, W_OP_CALL: op_call}
        rounds, rnd = 1, 0
        while rnd < rounds:
            if _PH.on:
                _PH.switch("pack")
            self._write_stage_header(words, n, call_id, error)
            if error is None and stage is not None:
                stage(rnd)
            self._node_exchange(phase)
            problems, node_max = [], 0
            if _PH.on:
                _PH.switch("control")
            mine = None
            if rnd == 0:
                node_ranks = list(range(self.node_base, self.node_base + self.P))
                headers = np.stack([self._stage(p, 0, STAGE_HDR, torch.int64).numpy().copy() for p in node_ranks])
                problems = consensus_problems(headers, OP_COMBINE, call_id, node_ranks)
                node_max = int(headers[:, W_NTOK].max())
                mine = headers[self.rank - self.node_base, _CONSENSUS]  # the node's, once it agreed
            self._credit_wait(phase)
            message = "; ".join(problems) if problems else None
            for a in [*range(self.node + 1, self.G), *range(self.node + 1)]:
                if _PH.on:
                    _PH.switch("reduce")
                rows_put = None
                if message is None and forward is not None:
                    blk, rows_put = forward(rnd, a)
                else:
                    blk = self._block(a, HDR)
                    self._write_header(blk, {})
                words_out = blk[:HDR].view(torch.int64).numpy()
                words_out[W_MAGIC], words_out[W_CALL], words_out[W_OP], words_out[W_AUX] = (MAGIC, call_id, OP_COMBINE,
                                                                                           node_max)
                words_out[W_OP_CALL], words_out[W_STATUS] = op_call, int(message is not None)
                if mine is not None:  # round 0: the words every node must agree on, for the rail peers' verdict
                    words_out[_CONSENSUS] = mine
                self._send(a, blk, message, rows_put)
            self._await_rails(phase)
            if _PH.on:
                _PH.switch("control")
            if rnd == 0:
                bad, largest = self._rail_verdict(call_id, op_call)
                if bad:
                    self._end_round()
                    raise consensus_error(OP_COMBINE, self._settle(OP_COMBINE, call_id, op_call, error, bad, phase))
                rounds = max(1, ceil_div(largest, per_round))
                yield
            if _PH.on:
                _PH.switch("reduce")
            reduce(rnd)
            self._end_round()
            rnd += 1

    def combine(self, *, call_id, x, topk_weights, bias, handle: InternodeHandle, num_channels,
                handle_id, order: torch.Tensor | None = None, extra_words: dict | None = None) -> Generator:
        """Internode combine (docs/semantics/deepep-api.md §5): forwarder partials rounded to bf16,
        then the origin's sum.

        With ``order`` (``[N, R]`` int64, docs/semantics/deepep-api.md §13.5) the sums follow keys instead of
        ascending rank: the last column of ``topk_weights`` is then each returned row's key (the
        forwarder adds its node peers' rows in ascending key), and the origin adds the node partials in
        ascending ``max(order[t, ranks of the node])``; that column comes back summed (meaningless).

        ``x`` is ``[>= N_recv, H]`` bf16. Yields ``(combined_x [N, H] bf16, combined_topk_weights | None)``.
        """
        hidden = x.shape[1]
        wcols = topk_weights.shape[1] if topk_weights is not None else -1
        n = handle.is_token_in_rank.size(0)
        num_recv = int(handle.recv_gbl_rank_prefix_sum[-1])
        if _PH.on:
            _PH.switch("outputs")
        combined = self.outputs.empty((n, hidden), torch.bfloat16)
        combined_w = torch.empty(n, wcols, dtype=torch.float32) if wcols >= 0 else None
        yield combined, combined_w

        if _PH.on:
            _PH.switch("control")
        call = _CombineCall(
            call_id=call_id, rows=x[:num_recv].view(torch.uint8), topk_weights=topk_weights, bias=bias, handle=handle,
            hidden=hidden, wcols=wcols, per_round=max(1, self.combine_capacity(hidden, wcols)),
            src=handle.recv_src_meta[:num_recv].view(torch.int32)[:, 0].to(torch.int64),
            starts=[0] + [int(v) for v in handle.recv_gbl_rank_prefix_sum],
            forward_starts=[0] + [int(v) for v in handle.recv_rdma_rank_prefix_sum],
            combined=combined, combined_w=combined_w, forwarded_done=[0] * self.G,
            staged_done=np.zeros((self.P, self.num_ranks), dtype=np.int64))
        call.src_max = int(call.src.max()) if num_recv else -1
        call.node_order = None if order is None else order.view(n, self.G, self.P).amax(2)
        call.keyed = order is not None
        call.in_place = self._returns_in_place(x, bias)
        words = {W_XBYTES: 2 * hidden, W_XDTYPE: dtype_code(torch.bfloat16), W_HANDLE: handle_id,
                 W_CHANNELS: num_channels, W_WCOLS: wcols, W_TOPK: -1, **(extra_words or {})}
        for _ in self._combine_rounds(call_id=call_id, words=words, n=n, per_round=call.per_round, error=None,
                                      stage=functools.partial(self._stage_returned_rows, call),
                                      forward=functools.partial(self._forward_partials, call),
                                      reduce=functools.partial(self._reduce_partials, call)):
            pass

    def _returns_in_place(self, x: torch.Tensor, bias) -> bool:
        """Whether a combine's node partials may be this rank's returned rows as they lie in ``x``: one rank per
        node (a partial sums one row) and ``x``'s rows contiguous. The partial of one row is the row rounded from
        ``+0.0 + row``, which differs from the row only at ``-0.0`` (``+0.0``) and in NaN payloads; the origin's
        sum starts from ``+0.0``, or from ``f32(bias0) + 0.0``, and a float32 sum that starts from ``+0.0`` never
        sees the sign of a zero it adds: the same bits (a NaN stays a NaN; its payload, which combine leaves
        unspecified, may differ on the torch path). Two biases can start the sum at ``-0.0`` (``-0.0 + -0.0``):
        the rows are rounded at the forwarder then.
        docs/design/data-path.md, "Normal mode across nodes"."""
        two_biases = bias is not None and all(b is not None for b in bias)
        return self.P == 1 and not two_biases and (x.size(0) < 2 or x.stride(0) == x.size(1)) and x.stride(1) == 1

    def _stage_returned_rows(self, call: _CombineCall, rnd: int) -> None:
        """Stage in this rank's UBMEM half its rows (and weights) of round ``rnd``'s tokens of every origin
        that a node peer forwards, ascending origin, with the count per origin (all origins); the forwarders
        of the node read them there. The rows of the origins this rank forwards itself (those of its local
        index) stay where they are: :meth:`_sum_node_rows` reads them in ``x``."""
        me, num_ranks, per_node = self.rank, self.num_ranks, self.P
        lo_t, hi_t = rnd * call.per_round, (rnd + 1) * call.per_round
        if lo_t == 0 and hi_t > call.src_max:  # every returned row in this round (always so in a single round)
            spans = list(zip(call.starts[:-1], call.starts[1:]))
        else:
            spans = []
            for s in range(num_ranks):
                begin, end = torch.searchsorted(call.src[call.starts[s]:call.starts[s + 1]],
                                                torch.tensor([lo_t, hi_t])).tolist()
                spans.append((call.starts[s] + begin, call.starts[s] + end))
        call.spans = spans
        sizes = torch.tensor([end - begin for begin, end in spans], dtype=torch.int32)
        staged = [span for s, span in enumerate(spans) if s % per_node != self.local and span[1] > span[0]]
        total = sum(end - begin for begin, end in staged)
        self._stage(me, STAGE_HDR, 4 * num_ranks, torch.int32).copy_(sizes)
        self._stage(me, 0, HDR, torch.int64)[W_ROWS] = total
        if not total:
            return
        xb, weight_cols = 2 * call.hidden, call.weight_cols
        offs, _ = _offsets(self.stage_rows_off, total, call.row_fields)
        xdst = self._stage(me, offs[1], total * xb).view(total, xb)
        wdst = self._stage(me, offs[0], total * 4 * weight_cols, torch.float32).view(total, weight_cols) \
            if weight_cols else None
        pos = 0
        for begin, end in staged:
            xdst[pos:pos + end - begin].copy_(call.rows[begin:end])
            if wdst is not None:
                wdst[pos:pos + end - begin].copy_(call.topk_weights[begin:end])
            pos += end - begin

    def _forward_partials(self, call: _CombineCall, rnd: int, origin_node: int) -> tuple[torch.Tensor, tuple | None]:
        """The block of partials for origin ``(origin_node, l)``: this round's tokens of it that this rank
        forwarded, each summed over the node peers that returned a row of it. Returns the block to send and
        ``(offset, rows)``, the rows it leaves out for :meth:`_send` to put from where they lie (or None)."""
        per_node = self.P
        origin = origin_node * per_node + self.local
        heads = call.handle.send_nvl_head[call.forward_starts[origin_node]:call.forward_starts[origin_node + 1]]
        node_peers = [self.node_base + p for p in range(per_node)]
        counts, begins = [], []  # rows of origin's tokens each node peer staged, and where they start there
        for peer in node_peers:
            if peer == self.rank:  # its own rows, in x (not staged)
                begin, end = call.spans[origin]
                counts.append(end - begin)
                begins.append(begin)
                continue
            sizes = self._stage(peer, STAGE_HDR, 4 * self.num_ranks, torch.int32).numpy()
            counts.append(int(sizes[origin]))
            # the peer staged the rows of every origin but those of its own local index, in origin order
            begins.append(int(sizes[:origin].sum()) - int(sizes[peer - self.node_base:origin:per_node].sum()))
        first = call.forwarded_done[origin_node]
        last = self._forwarded_until(heads, first, call.staged_done[:, origin], counts)
        rows = last - first
        offs, blk_end = _offsets(HDR, rows, call.row_fields)
        # in place: the rows are this rank's own in x (one rank per node), put from there (the origin's own node:
        # read there by _reduce_partials), and the block holds the header and the weights
        blk = self._block(origin_node, offs[1] if call.in_place else blk_end)
        self._write_header(blk, {W_ROWS: rows})
        rows_put = None
        if rows:
            self._sum_node_rows(call, blk, offs, heads[first:last] >= 0, node_peers, counts, begins, origin)
            if call.in_place and origin_node != self.node:
                begin = call.spans[origin][0]
                rows_put = (offs[1], call.rows[begin:begin + rows])
        else:
            for peer, count in zip(node_peers, counts):
                if count:
                    raise RuntimeError(f"rank {self.rank}: combine call #{call.call_id}: rank {peer} returned "
                                       f"{count} rows of rank {origin}'s tokens the handle did not forward "
                                       f"there; the handles passed on different ranks do not match")
        call.staged_done[:, origin] += counts
        call.forwarded_done[origin_node] = last
        return blk, rows_put

    @staticmethod
    def _forwarded_until(heads, first: int, staged_before, counts) -> int:
        """End of this round's forwarded tokens: those from ``first`` whose row in their first receiver's
        block (``heads [F, P]``, -1: not for that receiver) that receiver has staged by now."""
        if heads.size(0) <= first:
            return first
        staged_now = np.asarray(staged_before) + np.asarray(counts)
        rest = heads[first:].numpy()  # a few small arrays: numpy, where torch costs several times as much per call
        first_receiver = (rest >= 0).argmax(1)
        row = rest[np.arange(rest.shape[0]), first_receiver]
        return first + int(np.count_nonzero(row < staged_now[first_receiver]))

    def _sum_node_rows(self, call: _CombineCall, blk, offs, valid, node_peers, counts, begins, origin) -> None:
        """Into ``blk``: per forwarded token, the float32 sum from +0.0 of the node peers' rows in ascending
        local rank, rounded to bf16 (and the weights' sums); ``valid [rows, P]``: which peers have a row."""
        hidden, weight_cols = call.hidden, call.weight_cols
        xb, rows = 2 * hidden, valid.size(0)
        sources, weight_sources = [], []
        for p, (peer, count, begin) in enumerate(zip(node_peers, counts, begins)):
            pos = torch.nonzero(valid[:, p]).squeeze(1)
            if pos.numel() != count:
                raise RuntimeError(
                    f"rank {self.rank}: combine call #{call.call_id}: rank {peer} returned {count} rows of rank "
                    f"{origin}'s tokens, but the handle forwarded {pos.numel()} there; the handles passed "
                    f"on different ranks do not match")
            if not count:
                continue
            self._record(peer, count * (xb + 4 * weight_cols))
            if peer == self.rank:  # this rank's own rows: read where they lie in x (and topk_weights)
                sources.append((call.rows[begin:begin + count].view(torch.bfloat16), pos))
                if weight_cols:
                    weight_sources.append((call.topk_weights[begin:begin + count], pos))
                continue
            total = int(self._stage(peer, 0, HDR, torch.int64)[W_ROWS])
            peer_offs, _ = _offsets(self.stage_rows_off, total, call.row_fields)
            sources.append((self._stage(peer, peer_offs[1] + begin * xb, count * xb).view(count, xb)
                            .view(torch.bfloat16), pos))
            if weight_cols:
                weight_sources.append((self._stage(peer, peer_offs[0] + begin * 4 * weight_cols,
                                                   count * 4 * weight_cols, torch.float32).view(count, weight_cols),
                                       pos))
        # Node partial: float32 from +0.0 in ascending local rank (EPBuffer: ascending key), rounded to bf16 (in
        # place: the rows themselves, _returns_in_place)
        if not call.in_place:
            acc, tmp = self._scratch.get(hidden)
            keys = [weights[:, -1].to(torch.int64) for weights, _ in weight_sources] if call.keyed else None
            accumulate_rows(blk[offs[1]:offs[1] + rows * xb].view(torch.bfloat16).view(rows, hidden), sources, acc,
                            tmp, keys=keys)
        if weight_cols:
            wout = blk[offs[0]:offs[0] + rows * 4 * weight_cols].view(torch.float32).view(rows, weight_cols)
            wout.zero_()
            for weights, pos in weight_sources:
                wout.index_add_(0, pos, weights)

    def _reduce_partials(self, call: _CombineCall, rnd: int) -> None:
        """The origin's sum of round ``rnd``: ``f32(bias0) + f32(bias1)``, then the partials of every node
        in ascending node order, one rounding; the weights likewise."""
        me, hidden, weight_cols = self.rank, call.hidden, call.weight_cols
        n = call.combined.size(0)
        lo_t, hi_t = rnd * call.per_round, min(n, (rnd + 1) * call.per_round)
        if hi_t <= lo_t:
            return
        sources, keys = [], []
        wacc = call.combined_w[lo_t:hi_t].zero_() if call.combined_w is not None else None
        for c in range(self.G):
            tokens = torch.nonzero(call.handle.send_rdma_head[lo_t:hi_t, c] >= 0).squeeze(1)
            rows = int(self._box_words(me, c)[W_ROWS])
            if rows != tokens.numel():
                raise RuntimeError(f"rank {me}: combine call #{call.call_id}: node {c} returned {rows} partial rows "
                                   f"for tokens [{lo_t}, {hi_t}), the handle sent {tokens.numel()} there; the handles "
                                   f"passed on different ranks do not match")
            if not rows:
                continue
            offs, end = _offsets(HDR, rows, call.row_fields)
            blk = self._box(me, c, 0, end)
            if call.in_place and c == self.node:  # this rank's own returned rows, where they lie in x
                begin = call.spans[me][0]
                sources.append((call.rows[begin:begin + rows].view(torch.bfloat16).view(rows, hidden), tokens))
            else:
                sources.append((blk[offs[1]:offs[1] + rows * 2 * hidden].view(torch.bfloat16).view(rows, hidden),
                                tokens))
            if call.node_order is not None:
                keys.append(call.node_order[lo_t + tokens, c])
            if wacc is not None and weight_cols:
                wacc.index_add_(0, tokens, blk[offs[0]:offs[0] + rows * 4 * weight_cols]
                                .view(torch.float32).view(rows, weight_cols))
        acc, tmp = self._scratch.get(hidden)
        accumulate_rows(call.combined[lo_t:hi_t], sources, acc, tmp, call.bias, lo_t,
                        keys=keys if call.node_order is not None else None)
