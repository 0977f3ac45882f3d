"""Normal-mode dispatch and combine across nodes: DeepEP's two hops (spec §5, transports §6).

Every rank ``(node b, local l)`` is at once a *sender* of its own tokens, a *forwarder* for its
rail peers ``(c, l)`` and a *receiver*. Two windows per rank:

* the **URMA window** (``num_rdma_bytes``): two halves, each split into one *box* per node.
  Box ``a`` of rank ``(b, l)`` receives what rail peer ``(a, l)`` sends it (``a = b``: the
  rank itself). Node peers read the boxes through UBMEM views (the window is node-shared).
* the **UBMEM window** (``num_nvl_bytes``): two halves, combine's staging of received rows.

Dispatch, one round (tokens ``[k·q, (k+1)·q)`` of every sender):

1. *Hop 1, URMA*: a sender packs, for each node ``c``, the tokens of the round with at least one
   expert on ``c`` — once per node, whatever the number of target ranks there — with their
   target bitmask inside ``c``, and writes that block into box ``b`` of its rail peer ``(c, l)``
   (one ``put_with_signal``; its own node's block it writes into its own window).
2. The forwarder waits for its rail peers' blocks, then tells its node peers (UBMEM signal).
3. *Hop 2, UBMEM*: every receiver ``(b, j)`` gathers, for each source rank ``s`` in ascending
   order, the rows with bit ``j`` from box ``node(s)`` of forwarder ``(b, local(s))`` straight
   into its outputs (DeepEP's order: by global source rank, then token index).

Combine reverses it, with DeepEP's two roundings (spec §5): every receiver stages its rows of
the round in its UBMEM window; each forwarder sums, per token it forwarded, the rows of its node
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
an error status and every rank raises the same :class:`ConsensusError` after the round.
"""

from __future__ import annotations

import numpy as np
import torch

from . import memory
from .protocol import (MAGIC, MSG_BYTES, MSG_WORD, OP_CACHED_DISPATCH, OP_COMBINE, OP_DISPATCH, OP_NAMES, W_CALL,
                       W_CHANNELS, W_HANDLE, W_MAGIC, W_NEXP, W_NTOK, W_OP, W_SBYTES, W_SDTYPE, W_STATUS, W_TOPK,
                       W_WCOLS, W_XBYTES, W_XDTYPE, consensus_error, consensus_problems, dtype_code)
from .reduce import CombineScratch, accumulate_rows
from .layout import recv_channel_prefix, send_layout

U_READY, U_CREDIT = 0, 1  # slots of the URMA window
N_READY = 0  # slot of the UBMEM window
NUM_URMA_SLOTS, NUM_UBMEM_SLOTS = 2, 1
HDR = 128  # header bytes sent with every block (16 int64 words)
W_ROWS, W_AUX = 14, 15  # rows in this block; combine: largest token count of the sender's node
STAGE_HDR = 1024  # combine staging header: the 16 words, then the message at word 32
_ALIGN = 128


def _a8(x: int) -> int:
    return -(-x // 8) * 8


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _offsets(base: int, rows: int, row_fields) -> tuple[list, int]:
    """Field ``i`` of ``rows`` rows starts at ``offs[i]``; fields follow one another unpadded."""
    offs, off = [], base
    for nbytes in row_fields:
        offs.append(off)
        off += rows * nbytes
    return offs, off


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
        self.seq = 0  # rounds run so far; identical on every rank
        self._pack = torch.empty(0, dtype=torch.uint8)  # staging of blocks bound for other nodes
        self._scratch = CombineScratch()
        self.outputs = memory.OutputPool()  # recv_x, combined_x: storage reused once the caller drops them

    # -- sizing ----------------------------------------------------------------------
    def windows_hold_headers(self) -> bool:
        """Each node box holds a header and an error message, each staging half its header (no rows yet)."""
        return self.box >= HDR + MSG_BYTES and self.n_half >= STAGE_HDR + _a8(8 * self.num_ranks)

    def min_window_bytes(self) -> str:
        """The smallest window sizes for which :meth:`windows_hold_headers` holds, as text."""
        box = -(-(HDR + MSG_BYTES) // _ALIGN) * _ALIGN
        stage = -(-(STAGE_HDR + _a8(8 * self.num_ranks)) // _ALIGN) * _ALIGN
        return f"at least num_nvl_bytes={2 * stage} and num_rdma_bytes={2 * self.G * box}, plus rows"
    def _dispatch_vec_ints(self, num_experts: int) -> int:
        return self.num_ranks + num_experts + self.G

    def dispatch_fields(self, xb, sb, k, cached):
        """Row fields of a dispatch block, by decreasing alignment: topk ids, weights, scales, src, x, mask."""
        if cached:
            return [sb, xb, self.P]
        return [8 * k, 4 * k, sb, 4, xb, self.P]

    def dispatch_capacity(self, xb, sb, k, num_experts, cached) -> int:
        """Tokens per sender per round (every one of them may need every node)."""
        rows_off = HDR + (0 if cached else _a8(4 * self._dispatch_vec_ints(num_experts)))
        return max(0, (self.box - MSG_BYTES - rows_off) // sum(self.dispatch_fields(xb, sb, k, cached)))

    def combine_capacity(self, hidden, wcols) -> int:
        """Tokens per origin per round: its box takes them all, a staging half takes them from every origin."""
        row = 2 * hidden + 4 * max(wcols, 0)
        box_rows = (self.box - MSG_BYTES - HDR) // row
        stage_rows = (self.n_half - STAGE_HDR - _a8(8 * self.num_ranks)) // row // self.num_ranks
        return max(0, min(box_rows, stage_rows))

    @staticmethod
    def size_hints(num_tokens, xb, sb, k, num_experts, num_ranks, num_nodes, combine_xb, wcols) -> tuple[int, int]:
        """``(num_nvl_bytes, num_rdma_bytes)`` for which calls of ``num_tokens`` tokens per rank never chunk."""
        rpn = num_ranks // num_nodes
        disp_row = 8 * k + 4 * k + sb + 4 + xb + rpn
        disp_box = HDR + _a8(4 * (num_ranks + num_experts + num_nodes)) + num_tokens * disp_row + MSG_BYTES
        comb_row = combine_xb + 4 * wcols
        comb_box = HDR + num_tokens * comb_row + MSG_BYTES
        box = -(-max(disp_box, comb_box) // _ALIGN) * _ALIGN
        stage = STAGE_HDR + _a8(8 * num_ranks) + num_ranks * num_tokens * comb_row
        stage = -(-stage // _ALIGN) * _ALIGN
        return 2 * stage + 2 * _ALIGN, 2 * num_nodes * box + 2 * _ALIGN

    # -- primitives ----------------------------------------------------------------------
    def _box_off(self, seq, a):
        return (seq % 2) * self.u_half + a * self.box

    def _box(self, f, a, off, nbytes, dtype=torch.uint8):
        """View of forwarder ``f``'s box ``a`` (this round's half), ``nbytes`` from byte ``off``."""
        return self.tp.peer_view(self.uwin, f, self._box_off(self.seq, a) + off, nbytes, dtype)

    def _stage(self, p, off, nbytes, dtype=torch.uint8):
        return self.tp.peer_view(self.nwin, p, (self.seq % 2) * self.n_half + off, nbytes, dtype)

    def _pack_buffer(self, nbytes):
        if self._pack.numel() < nbytes:
            self._pack = memory.empty((max(nbytes, 2 * self._pack.numel()),), torch.uint8)
        return self._pack[:nbytes]

    def _block(self, c, nbytes):
        """Where to build the block bound for node ``c``: our own box ``node`` if ``c`` is our node."""
        if c == self.node:
            return self._box(self.rank, self.node, 0, nbytes)
        return self._pack_buffer(nbytes)

    def _send(self, c, blk, message: str | None):
        """Deliver a block built by :meth:`_block` to the rail peer on node ``c`` and raise its ``U_READY``."""
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
        h[:16] = hdr_words
        if h[W_STATUS]:
            h[MSG_WORD:] = read_message().numpy().view(np.int64)
        return h

    def _credit_wait(self, phase):
        """Before writing this round's half of the rail peers' boxes: they finished the round before."""
        if self.seq >= 2 and self.remote_rails:
            self.tp.wait_until(self.uwin, U_CREDIT, self.remote_rails, self.seq,
                               phase=f"{phase}: reuse of the rail peers' boxes")

    def _await_rails(self, phase):
        if self.remote_rails:
            self.tp.wait_until(self.uwin, U_READY, self.remote_rails, self.seq + 1,
                               phase=f"{phase}: blocks from the rail peers")

    def _node_exchange(self, phase):
        for p in self.node_peers:
            self.tp.signal(self.nwin, p, N_READY, ordered=True)
        if self.node_peers:
            self.tp.wait_until(self.nwin, N_READY, self.node_peers, self.seq + 1, phase=f"{phase}: node peers")

    def _end_round(self):
        for r in self.remote_rails:
            self.tp.signal(self.uwin, r, U_CREDIT, ordered=True)
        self.seq += 1

    def _record(self, peer, nbytes):
        if nbytes:
            self.tp.record_fetch(peer, nbytes)

    # -- dispatch ------------------------------------------------------------------------
    def reject(self, op, call_id, message):
        """Take part in round 0 of a call with an error status; raises ConsensusError (on every rank)."""
        if op == OP_COMBINE:
            gen = self._combine_round0_only(call_id, message)
        else:
            gen = self._dispatch_rounds(op=op, call_id=call_id, words={}, n=0, fields=[], pack=None, vec=None,
                                        error=message, on_headers=None, receive=None)
        for _ in gen:
            pass
        raise AssertionError("unreachable: the consensus check raises")  # pragma: no cover

    def _dispatch_rounds(self, *, op, call_id, words, n, fields, pack, vec, error, on_headers, receive, in_node=None):
        """The round driver of dispatch and cached dispatch (hop 1, node exchange, hop 2 by ``receive``).

        ``in_node [N, G]`` bool: token has an expert on node ``c``. ``pack(k, c, blk, offs, idx)``
        fills the row fields of the tokens ``idx`` (of round ``k``) bound for node ``c``;
        ``on_headers(headers, vecs, cap)`` runs once after round 0 and returns the number of
        rounds; ``receive(k, cap, vec_bytes)`` gathers this rank's rows. Yields once, after round
        0's headers are known (the caller yields its outputs then).
        """
        phase = f"{OP_NAMES[op]} call #{call_id}"
        vec_bytes = 0 if vec is None else _a8(4 * vec.numel())
        cap = max(1, (self.box - MSG_BYTES - HDR - vec_bytes) // max(1, sum(fields)))
        words = {**words, W_CALL: call_id, W_OP: op, W_STATUS: int(error is not None)}
        rounds, k = 1, 0
        while k < rounds:
            self._credit_wait(phase)
            lo, hi = k * cap, min(n, (k + 1) * cap)
            sub = in_node[lo:hi] if (error is None and hi > lo) else None
            with_vec = k == 0 and vec is not None  # count vectors travel in round 0 only
            for c in [*range(self.node + 1, self.G), *range(self.node + 1)]:  # remote nodes first, own last
                idx = torch.nonzero(sub[:, c]).squeeze(1) if sub is not None else torch.empty(0, dtype=torch.int64)
                rows = idx.numel()
                offs, end = _offsets(HDR + (vec_bytes if with_vec else 0), rows, fields)
                blk = self._block(c, end)
                self._write_header(blk, {**words, W_ROWS: rows})
                if with_vec:
                    blk[HDR:HDR + 4 * vec.numel()].view(torch.int32).copy_(vec)
                if rows:
                    pack(k, c, blk, offs, idx + lo)
                self._send(c, blk, error)
            self._await_rails(phase)
            self._node_exchange(phase)
            if k == 0:
                headers, vecs = self._read_dispatch_headers(op, call_id, vec)
                problems = consensus_problems(headers, op, call_id)
                if problems:
                    self._end_round()
                    raise consensus_error(op, problems)
                rounds = on_headers(headers, vecs, cap)
                yield
            receive(k, cap, vec_bytes if with_vec else 0)
            self._end_round()
            k += 1

    def _source_blocks(self, rows_off, fields):
        """This round's non-empty dispatch blocks, by ascending source rank ``s = (a, l)``: each is
        box ``a`` of forwarder ``f = (our node, l)``. Yields ``(s, a, f, rows, field offsets, block view)``."""
        for s in range(self.num_ranks):
            a, ls = divmod(s, self.P)
            f = self.node_base + ls
            m = int(self._box(f, a, 0, HDR, torch.int64)[W_ROWS])
            if m:
                offs, end = _offsets(rows_off, m, fields)
                yield s, a, f, m, offs, self._box(f, a, 0, end)

    def _read_dispatch_headers(self, op, call_id, vec):
        """Round 0: every source's header (and count vector) from its forwarder's box, ``[R, 128]``."""
        headers = np.zeros((self.num_ranks, 128), dtype=np.int64)
        vecs = []
        for s in range(self.num_ranks):
            a, ls = divmod(s, self.P)
            f = self.node_base + ls
            hw = self._box(f, a, 0, HDR, torch.int64).numpy()
            headers[s] = self._full_header(hw, lambda f=f, a=a: self._box(f, a, self.box - MSG_BYTES, MSG_BYTES))
            if vec is not None and not headers[s, W_STATUS] and headers[s, W_OP] == OP_DISPATCH:
                vecs.append(self._box(f, a, HDR, 4 * vec.numel(), torch.int32).clone())
        return headers, vecs

    def dispatch(self, *, call_id, x, scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_rank,
                 num_tokens_per_rdma_rank, num_tokens_per_expert, num_experts, expert_alignment, num_worst_tokens,
                 num_channels, handle_id, xdtype, sdtype):
        """Non-cached internode dispatch (spec §5). ``x`` is ``[N, xb]`` uint8, ``scales`` ``[N, sb]`` uint8 or None.

        Yields once ``(recv_x_bytes, recv_scales_bytes, recv_topk_idx, recv_topk_weights,
        num_recv_tokens_per_expert_list, handle)`` with the 10-entry internode handle.
        """
        me, R, G, P = self.rank, self.num_ranks, self.G, self.P
        n, xb = x.shape
        sb = scales.shape[1] if scales is not None else 0
        k = topk_idx.shape[1] if topk_idx is not None else 0
        fields = self.dispatch_fields(xb, sb, k, cached=False)
        itr_nodes = is_token_in_rank.view(n, G, P)
        in_node = itr_nodes.any(2)
        words = {W_NTOK: n, W_XBYTES: xb, W_XDTYPE: xdtype, W_SBYTES: sb, W_SDTYPE: sdtype,
                 W_TOPK: k if topk_idx is not None else -1, W_NEXP: num_experts, W_HANDLE: handle_id,
                 W_CHANNELS: num_channels, W_WCOLS: -1}
        vec = torch.cat([num_tokens_per_rank, num_tokens_per_expert, num_tokens_per_rdma_rank]).to(torch.int32)

        def pack(rnd, c, blk, offs, tok):
            m = tok.numel()
            if k:
                torch.index_select(topk_idx, 0, tok, out=blk[offs[0]:offs[0] + 8 * k * m].view(torch.int64).view(m, k))
                torch.index_select(topk_weights, 0, tok,
                                   out=blk[offs[1]:offs[1] + 4 * k * m].view(torch.float32).view(m, k))
            if sb:
                torch.index_select(scales, 0, tok, out=blk[offs[2]:offs[2] + sb * m].view(m, sb))
            blk[offs[3]:offs[3] + 4 * m].view(torch.int32).copy_(tok)
            torch.index_select(x, 0, tok, out=blk[offs[4]:offs[4] + xb * m].view(m, xb))
            torch.index_select(itr_nodes[:, c, :], 0, tok, out=blk[offs[5]:offs[5] + P * m].view(torch.bool).view(m, P))

        st = {}

        def on_headers(headers, vecs, cap):
            ntok = headers[:, W_NTOK].astype(np.int64)
            V = torch.stack(vecs)  # [R, R + E + G]
            counts = V[:, :R]
            st["ntok"] = ntok
            st["counts_to_me"] = counts[:, me].to(torch.int64)
            gbl_prefix = counts[:, me].cumsum(0, dtype=torch.int32)
            num_recv = int(gbl_prefix[-1])
            local = num_experts // R
            per_expert = V[:, R + me * local:R + (me + 1) * local].sum(0, dtype=torch.int64)
            recv_list = [] if num_worst_tokens else [
                int(-(-int(c) // expert_alignment) * expert_alignment) for c in per_expert]
            # Tokens this rank forwards, per source node a: rail peer (a, l)'s count for our node.
            fwd_counts = V[[a * P + self.local for a in range(G)], R + num_experts + self.node].to(torch.int64)
            rows = max(num_recv, num_worst_tokens)
            out = dict(
                recv_x=self.outputs.empty((rows, xb), torch.uint8),
                recv_scales=torch.empty(rows, sb, dtype=torch.uint8) if scales is not None else None,
                recv_topk=torch.empty(rows, k, dtype=torch.int64) if topk_idx is not None else None,
                recv_w=torch.empty(rows, k, dtype=torch.float32) if topk_idx is not None else None,
                recv_src_meta=torch.zeros(rows, 8, dtype=torch.uint8),
                recv_list=recv_list, num_recv=num_recv, gbl_prefix=gbl_prefix, fwd_counts=fwd_counts,
                send_nvl_head=torch.full((int(fwd_counts.sum()), P), -1, dtype=torch.int32),
                recv_rdma_channel_prefix_matrix=torch.zeros(G, num_channels, dtype=torch.int32),
                recv_gbl_channel_prefix_matrix=torch.zeros(R, num_channels, dtype=torch.int32))
            if rows > num_recv:  # worst-case padding: zeros, and -1 expert ids (spec §4.4)
                for name in ("recv_x", "recv_scales", "recv_w"):
                    if out[name] is not None:
                        out[name][num_recv:].zero_()
                if out["recv_topk"] is not None:
                    out["recv_topk"][num_recv:].fill_(-1)
            st.update(out)
            st["cursor"] = [int(gbl_prefix[s - 1]) if s else 0 for s in range(R)]
            st["fwd_src"] = [[] for _ in range(G)]
            st["fwd_mask"] = [[] for _ in range(G)]
            return max(1, max(_ceil_div(int(t), cap) for t in ntok))

        def receive(rnd, cap, vec_bytes):
            rx, rs, rt, rw, meta = st["recv_x"], st["recv_scales"], st["recv_topk"], st["recv_w"], st["recv_src_meta"]
            meta32 = meta.view(torch.int32)
            for s, a, f, m, offs, blk in self._source_blocks(HDR + vec_bytes, fields):
                mask = blk[offs[5]:offs[5] + P * m].view(torch.bool).view(m, P)
                src = blk[offs[3]:offs[3] + 4 * m].view(torch.int32)
                if f == me:  # as forwarder: what we forward from node a, for the handle
                    st["fwd_src"][a].append(src.clone())
                    st["fwd_mask"][a].append(mask.clone())
                idx = torch.nonzero(mask[:, self.local]).squeeze(1)
                got = idx.numel()
                if not got:
                    continue
                c0 = st["cursor"][s]
                if c0 + got > int(st["gbl_prefix"][s]):
                    raise RuntimeError(f"rank {me}: dispatch call #{call_id}: rank {s} sent more tokens than its "
                                       f"num_tokens_per_rank promised ({int(st['counts_to_me'][s])})")
                torch.index_select(blk[offs[4]:offs[4] + xb * m].view(m, xb), 0, idx, out=rx[c0:c0 + got])
                if sb:
                    torch.index_select(blk[offs[2]:offs[2] + sb * m].view(m, sb), 0, idx, out=rs[c0:c0 + got])
                if k:
                    torch.index_select(blk[offs[0]:offs[0] + 8 * k * m].view(torch.int64).view(m, k), 0, idx,
                                       out=rt[c0:c0 + got])
                    torch.index_select(blk[offs[1]:offs[1] + 4 * k * m].view(torch.float32).view(m, k), 0, idx,
                                       out=rw[c0:c0 + got])
                torch.index_select(src, 0, idx, out=meta32[c0:c0 + got, 0])
                meta32[c0:c0 + got, 1] = a
                st["cursor"][s] = c0 + got
                self._record(f, got * sum(fields))

        rounds_gen = self._dispatch_rounds(op=OP_DISPATCH, call_id=call_id, words=words, n=n, fields=fields,
                                           pack=pack, vec=vec, error=None, on_headers=on_headers, receive=receive,
                                           in_node=in_node)
        next(rounds_gen)
        rdma_cpm, _ = send_layout(in_node, num_channels)
        gbl_cpm, _ = send_layout(is_token_in_rank, num_channels)
        # send_rdma_head[t][c]: position of token t among this rank's tokens for node c (-1: none).
        send_rdma_head = torch.where(in_node, in_node.to(torch.int32).cumsum(0, dtype=torch.int32) - 1,
                                     torch.full((n, G), -1, dtype=torch.int32))
        fwd_prefix = st["fwd_counts"].cumsum(0).to(torch.int32)
        handle = (is_token_in_rank, rdma_cpm, gbl_cpm, st["recv_rdma_channel_prefix_matrix"], fwd_prefix,
                  st["recv_gbl_channel_prefix_matrix"], st["gbl_prefix"], st["recv_src_meta"], send_rdma_head,
                  st["send_nvl_head"])
        yield st["recv_x"], st["recv_scales"], st["recv_topk"], st["recv_w"], st["recv_list"], handle, st["num_recv"]

        for _ in rounds_gen:
            pass
        num_recv, gbl_prefix = st["num_recv"], st["gbl_prefix"]
        starts = [0] + [int(v) for v in gbl_prefix]
        for s in range(R):
            if st["cursor"][s] != starts[s + 1]:
                raise RuntimeError(f"rank {me}: dispatch call #{call_id}: received {st['cursor'][s] - starts[s]} "
                                   f"tokens from rank {s}, its num_tokens_per_rank promised "
                                   f"{int(st['counts_to_me'][s])}")
        src_idx = st["recv_src_meta"].view(torch.int32)[:num_recv, 0]
        rel = recv_channel_prefix(src_idx, starts, st["ntok"], num_channels)
        st["recv_gbl_channel_prefix_matrix"].copy_(rel + torch.tensor(starts[:R], dtype=torch.int32).unsqueeze(1))
        self._finish_forward_handle(st, num_channels)
        if st["recv_topk"] is not None and num_recv:
            local = num_experts // R
            ids = st["recv_topk"][:num_recv]
            foreign = (ids < me * local) | (ids >= (me + 1) * local)
            ids.sub_(me * local).masked_fill_(foreign, -1)
            st["recv_w"][:num_recv].masked_fill_(foreign, 0.0)

    def _finish_forward_handle(self, st, num_channels):
        """``send_nvl_head`` and ``recv_rdma_channel_prefix_matrix`` from what this rank forwarded."""
        P = self.P
        pos = 0
        for a in range(self.G):
            if st["fwd_mask"][a]:
                mask = torch.cat(st["fwd_mask"][a])
                src = torch.cat(st["fwd_src"][a]).to(torch.int64)
            else:
                mask = torch.zeros(0, P, dtype=torch.bool)
                src = torch.zeros(0, dtype=torch.int64)
            m = mask.size(0)
            if m != int(st["fwd_counts"][a]):
                raise RuntimeError(f"rank {self.rank}: dispatch: forwarded {m} tokens of rank {a * P + self.local}, "
                                   f"its num_tokens_per_rdma_rank promised {int(st['fwd_counts'][a])}")
            # Row of each forwarded token inside receiver j's block of this source (-1: not for j).
            st["send_nvl_head"][pos:pos + m] = torch.where(mask, mask.to(torch.int32).cumsum(0, dtype=torch.int32) - 1,
                                                           torch.full_like(mask, -1, dtype=torch.int32))
            q = max(1, _ceil_div(int(st["ntok"][a * P + self.local]), num_channels))
            per_channel = torch.bincount(src // q, minlength=num_channels)[:num_channels]
            st["recv_rdma_channel_prefix_matrix"][a] = per_channel.cumsum(0).to(torch.int32)
            pos += m

    # -- cached dispatch ---------------------------------------------------------------
    def cached_dispatch(self, *, call_id, x, scales, handle, num_channels, handle_id, xdtype, sdtype):
        """Dispatch through an internode handle (spec §4.5, §5). Yields ``(recv_x, recv_scales)``."""
        me, R, G, P = self.rank, self.num_ranks, self.G, self.P
        n, xb = x.shape
        sb = scales.shape[1] if scales is not None else 0
        is_token_in_rank, gbl_prefix = handle[0], handle[6]
        rows = handle[7].size(0)
        num_recv = int(gbl_prefix[-1])
        fields = self.dispatch_fields(xb, sb, 0, cached=True)
        itr_nodes = is_token_in_rank.view(n, G, P)
        in_node = itr_nodes.any(2)
        words = {W_NTOK: n, W_XBYTES: xb, W_XDTYPE: xdtype, W_SBYTES: sb, W_SDTYPE: sdtype,
                 W_TOPK: -1, W_NEXP: 0, W_HANDLE: handle_id, W_CHANNELS: num_channels, W_WCOLS: -1}
        recv_x = self.outputs.empty((rows, xb), torch.uint8)
        if rows > num_recv:
            recv_x[num_recv:].zero_()
        recv_scales = None if scales is None else torch.zeros(rows, sb, dtype=torch.uint8)
        yield recv_x, recv_scales

        def pack(rnd, c, blk, offs, tok):
            m = tok.numel()
            if sb:
                torch.index_select(scales, 0, tok, out=blk[offs[0]:offs[0] + sb * m].view(m, sb))
            torch.index_select(x, 0, tok, out=blk[offs[1]:offs[1] + xb * m].view(m, xb))
            torch.index_select(itr_nodes[:, c, :], 0, tok, out=blk[offs[2]:offs[2] + P * m].view(torch.bool).view(m, P))

        starts = [0] + [int(v) for v in gbl_prefix]
        cursor = starts[:R]

        def on_headers(headers, vecs, cap):
            return max(1, max(_ceil_div(int(t), cap) for t in headers[:, W_NTOK]))

        def receive(rnd, cap, vec_bytes):
            for s, _, f, m, offs, blk in self._source_blocks(HDR, fields):
                idx = torch.nonzero(blk[offs[2]:offs[2] + P * m].view(torch.bool).view(m, P)[:, self.local]).squeeze(1)
                got, c0 = idx.numel(), cursor[s]
                if c0 + got > starts[s + 1]:
                    raise RuntimeError(f"rank {me}: cached dispatch call #{call_id}: rank {s} sends more tokens than "
                                       f"this rank's handle expects ({starts[s + 1] - starts[s]}); the handles passed "
                                       f"on different ranks do not describe the same dispatch")
                if got:
                    torch.index_select(blk[offs[1]:offs[1] + xb * m].view(m, xb), 0, idx, out=recv_x[c0:c0 + got])
                    if sb:
                        torch.index_select(blk[offs[0]:offs[0] + sb * m].view(m, sb), 0, idx,
                                           out=recv_scales[c0:c0 + got])
                    cursor[s] = c0 + got
                    self._record(f, got * sum(fields))

        for _ in self._dispatch_rounds(op=OP_CACHED_DISPATCH, call_id=call_id, words=words, n=n, fields=fields,
                                       pack=pack, vec=None, error=None, on_headers=on_headers, receive=receive,
                                       in_node=in_node):
            pass
        if cursor != starts[1:]:
            raise RuntimeError(f"rank {me}: cached dispatch call #{call_id}: received "
                               f"{[c - s for c, s in zip(cursor, starts)]} tokens per source, this rank's handle "
                               f"expects {[b - a for a, b in zip(starts, starts[1:])]}; the handles passed on "
                               f"different ranks do not describe the same dispatch")

    # -- combine -----------------------------------------------------------------------
    def _combine_round0_only(self, call_id, message):
        """A rejected combine: stage an error header, forward the node's verdict, raise with everyone."""
        gen = self._combine_rounds(call_id=call_id, words={}, n=0, q=1, error=message,
                                   stage=None, forward=None, reduce=None)
        yield from gen

    def _combine_rounds(self, *, call_id, words, n, q, error, stage, forward, reduce):
        """The round driver of combine: stage → node exchange → forward partials (URMA) → reduce."""
        phase = f"combine call #{call_id}"
        G = self.G
        rounds, k = 1, 0
        while k < rounds:
            hdr = self._stage(self.rank, 0, STAGE_HDR, torch.int64).numpy()
            hdr[:] = 0
            hdr[W_MAGIC] = MAGIC
            for w, v in {**words, W_NTOK: n, W_CALL: call_id, W_OP: OP_COMBINE,
                         W_STATUS: int(error is not None)}.items():
                hdr[w] = v
            if error is not None:
                text = error.encode("utf-8")[:MSG_BYTES].ljust(MSG_BYTES, b"\0")
                hdr[MSG_WORD:] = np.frombuffer(text, dtype=np.int64)
            elif stage is not None:
                stage(k)
            self._node_exchange(phase)
            node_ranks = list(range(self.node_base, self.node_base + self.P))
            problems = []
            node_max = 0
            if k == 0:
                headers = np.stack([self._stage(p, 0, STAGE_HDR, torch.int64).numpy().copy() for p in node_ranks])
                problems = consensus_problems(headers, OP_COMBINE, call_id, node_ranks)
                node_max = int(headers[:, W_NTOK].max())
            self._credit_wait(phase)
            for a in [*range(self.node + 1, G), *range(self.node + 1)]:
                message = "; ".join(problems) if problems else None
                if message is None and forward is not None:
                    blk = forward(k, a)
                else:
                    blk = self._block(a, HDR)
                    self._write_header(blk, {})
                hw = blk[:HDR].view(torch.int64).numpy()
                hw[W_MAGIC], hw[W_CALL], hw[W_OP], hw[W_AUX] = MAGIC, call_id, OP_COMBINE, node_max
                hw[W_STATUS] = int(message is not None)
                self._send(a, blk, message)
            self._await_rails(phase)
            if k == 0:
                heads = [self._box(self.rank, c, 0, HDR, torch.int64).numpy().copy() for c in range(G)]
                bad = []
                for c, h in enumerate(heads):
                    if h[W_STATUS]:
                        msg = self._box(self.rank, c, self.box - MSG_BYTES, MSG_BYTES).numpy().tobytes()
                        bad.append(msg.rstrip(b"\0").decode("utf-8", "replace"))
                    elif h[W_CALL] != call_id or h[W_OP] != OP_COMBINE:
                        bad.append(f"rank {self.rails[c]} is in a different call (call #{h[W_CALL]})")
                if bad:
                    self._end_round()
                    raise consensus_error(OP_COMBINE, list(dict.fromkeys(bad)))
                rounds = max(1, _ceil_div(max(int(h[W_AUX]) for h in heads), q))
                yield
            reduce(k)
            self._end_round()
            k += 1

    def combine(self, *, call_id, x, topk_weights, bias, handle, num_channels, handle_id):
        """Internode combine (spec §5): forwarder partials rounded to bf16, then the origin's sum.

        ``x`` is ``[>= N_recv, H]`` bf16. Yields ``(combined_x [N, H] bf16, combined_topk_weights | None)``.
        """
        me, R, G, P = self.rank, self.num_ranks, self.G, self.P
        hidden = x.shape[1]
        xb = 2 * hidden
        wcols = topk_weights.shape[1] if topk_weights is not None else -1
        w = max(wcols, 0)
        row_fields = [4 * w, xb]  # weights first (4-byte aligned), then the bf16 rows
        is_token_in_rank, fwd_prefix, gbl_prefix = handle[0], handle[4], handle[6]
        recv_src_meta, send_rdma_head, send_nvl_head = handle[7], handle[8], handle[9]
        n = is_token_in_rank.size(0)
        num_recv = int(gbl_prefix[-1])
        combined = self.outputs.empty((n, hidden), torch.bfloat16)
        combined_w = torch.empty(n, wcols, dtype=torch.float32) if wcols >= 0 else None
        yield combined, combined_w

        q = max(1, self.combine_capacity(hidden, wcols))
        starts = [0] + [int(v) for v in gbl_prefix]
        src = recv_src_meta[:num_recv].view(torch.int32)[:, 0].to(torch.int64)
        xrows = x[:num_recv].view(torch.uint8)
        fstarts = [0] + [int(v) for v in fwd_prefix]
        fwd_done = [0] * G  # forwarded tokens of each origin node already sent back
        stage_done = np.zeros((P, R), dtype=np.int64)  # rows of each node peer's blocks already staged
        words = {W_XBYTES: xb, W_XDTYPE: dtype_code(torch.bfloat16), W_HANDLE: handle_id, W_CHANNELS: num_channels,
                 W_WCOLS: wcols, W_TOPK: -1}
        vec_off = STAGE_HDR
        rows_off = STAGE_HDR + _a8(8 * R)

        def stage(k):
            lo_t, hi_t = k * q, (k + 1) * q
            spans = []
            for s in range(R):
                a, b = torch.searchsorted(src[starts[s]:starts[s + 1]], torch.tensor([lo_t, hi_t])).tolist()
                spans.append((starts[s] + a, starts[s] + b))
            sizes = torch.tensor([b - a for a, b in spans], dtype=torch.int32)
            total = int(sizes.sum())
            self._stage(me, vec_off, 4 * R, torch.int32).copy_(sizes)
            hdr = self._stage(me, 0, HDR, torch.int64)
            hdr[W_ROWS] = total
            if not total:
                return
            offs, _ = _offsets(rows_off, total, row_fields)
            xdst = self._stage(me, offs[1], total * xb).view(total, xb)
            wdst = self._stage(me, offs[0], total * 4 * w, torch.float32).view(total, w) if w else None
            if spans[-1][1] - spans[0][0] == total:  # adjacent spans (always so in a single round): one copy
                pieces = [(spans[0][0], spans[-1][1])]
            else:
                pieces = [span for span in spans if span[1] > span[0]]
            pos = 0
            for a, b in pieces:
                xdst[pos:pos + b - a].copy_(xrows[a:b])
                if wdst is not None:
                    wdst[pos:pos + b - a].copy_(topk_weights[a:b])
                pos += b - a

        def forward(k, a):
            """Partials for origin (a, l): this round's tokens of it that we forwarded, summed over our node."""
            sel = send_nvl_head[fstarts[a]:fstarts[a + 1]]
            origin = a * P + self.local
            counts, begins, peers = [], [], []
            for p in range(P):
                peer = self.node_base + p
                vecp = self._stage(peer, vec_off, 4 * R, torch.int32)
                counts.append(int(vecp[origin]))
                begins.append(int(vecp[:origin].sum()))
                peers.append(peer)
            counts_t = torch.tensor(counts, dtype=torch.int32)
            end = torch.as_tensor(stage_done[:, origin], dtype=torch.int32) + counts_t
            f_lo = fwd_done[a]
            if sel.size(0) > f_lo:
                rest = sel[f_lo:]
                valid = rest >= 0
                first = valid.to(torch.uint8).argmax(1)
                off = rest.gather(1, first.unsqueeze(1)).squeeze(1)
                f_hi = f_lo + int((off < end[first]).sum())
            else:
                f_hi = f_lo
            m = f_hi - f_lo
            offs, blk_end = _offsets(HDR, m, row_fields)
            blk = self._block(a, blk_end)
            self._write_header(blk, {W_ROWS: m})
            valid = sel[f_lo:f_hi] >= 0
            if m:
                sources, wsources = [], []
                for p in range(P):
                    cnt = counts[p]
                    pos = torch.nonzero(valid[:, p]).squeeze(1)
                    if pos.numel() != cnt:
                        raise RuntimeError(
                            f"rank {me}: combine call #{call_id}: rank {peers[p]} returned {cnt} rows of rank "
                            f"{origin}'s tokens, but the handle forwarded {pos.numel()} there; the handles passed "
                            f"on different ranks do not match")
                    if not cnt:
                        continue
                    total = int(self._stage(peers[p], 0, HDR, torch.int64)[W_ROWS])
                    poffs, _ = _offsets(rows_off, total, row_fields)
                    sources.append((self._stage(peers[p], poffs[1] + begins[p] * xb, cnt * xb).view(cnt, xb)
                                    .view(torch.bfloat16), pos))
                    if w:
                        wsources.append((self._stage(peers[p], poffs[0] + begins[p] * 4 * w, cnt * 4 * w,
                                                     torch.float32).view(cnt, w), pos))
                    self._record(peers[p], cnt * (xb + 4 * w))
                # Node partial: float32 from +0.0 in ascending local rank, rounded to bf16 into the block.
                acc, tmp = self._scratch.get(hidden)
                accumulate_rows(blk[offs[1]:offs[1] + m * xb].view(torch.bfloat16).view(m, hidden), sources, acc, tmp)
                if w:
                    wout = blk[offs[0]:offs[0] + m * 4 * w].view(torch.float32).view(m, w)
                    wout.zero_()
                    for wrows, pos in wsources:
                        wout.index_add_(0, pos, wrows)
            else:
                for p in range(P):
                    if counts[p]:
                        raise RuntimeError(f"rank {me}: combine call #{call_id}: rank {peers[p]} returned "
                                           f"{counts[p]} rows of rank {origin}'s tokens the handle did not forward "
                                           f"there; the handles passed on different ranks do not match")
            stage_done[:, origin] += counts
            fwd_done[a] = f_hi
            return blk

        def reduce(k):
            lo_t, hi_t = k * q, min(n, (k + 1) * q)
            m = max(0, hi_t - lo_t)
            if not m:
                return
            sources = []
            wacc = combined_w[lo_t:hi_t].zero_() if combined_w is not None else None
            for c in range(G):
                head = send_rdma_head[lo_t:hi_t, c]
                tok = torch.nonzero(head >= 0).squeeze(1)
                rows = int(self._box(me, c, 0, HDR, torch.int64)[W_ROWS])
                if rows != tok.numel():
                    raise RuntimeError(f"rank {me}: combine call #{call_id}: node {c} returned {rows} partial rows for "
                                       f"tokens [{lo_t}, {hi_t}), the handle sent {tok.numel()} there; the handles "
                                       f"passed on different ranks do not match")
                if not rows:
                    continue
                offs, end = _offsets(HDR, rows, row_fields)
                blk = self._box(me, c, 0, end)
                sources.append((blk[offs[1]:offs[1] + rows * xb].view(torch.bfloat16).view(rows, hidden), tok))
                if wacc is not None and w:
                    wacc.index_add_(0, tok, blk[offs[0]:offs[0] + rows * 4 * w].view(torch.float32).view(rows, w))
            # The origin: f32(bias0) + f32(bias1), then the node partials in ascending node, one rounding.
            acc, tmp = self._scratch.get(hidden)
            accumulate_rows(combined[lo_t:hi_t], sources, acc, tmp, bias, lo_t)

        gen = self._combine_rounds(call_id=call_id, words=words, n=n, q=q, error=None, stage=stage, forward=forward,
                                   reduce=reduce)
        for _ in gen:
            pass
