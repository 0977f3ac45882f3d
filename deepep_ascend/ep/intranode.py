"""Normal-mode dispatch and combine inside one UBMEM domain (spec §4), over the transport's window.

Protocol (one rank's view; every rank runs the same steps for every call):

* The window's data region is split into two halves. Each rank *stages* its outgoing data in
  its **own** window, one *chunk* per half, alternating halves; every peer then *pulls* what
  it needs straight from there with a gather (``index_select(..., out=)``) into its output
  tensors. So a token crosses the channel once per destination rank, and a token bound to
  several ranks is staged once (DeepEP copies it once per destination instead).
* Signals (transport slots, monotonic counters): ``READY`` (sender → receivers: a chunk is
  staged) and ``CONSUMED`` (receiver → sender: done reading it). Before staging into a half,
  a sender waits until every peer consumed the chunk that half held before; that chunk is
  normally long consumed, so a call costs one real synchronisation (the first ``READY``).
  Nothing is ever cleaned: every rank counts the chunks of every rank, identically.
* Chunk 0 of every call carries a header (operation, shapes, dtypes, handle id, a status
  word and an error message) and small per-rank vectors (counts). Every rank checks every
  header after the first ``READY``: a rank whose arguments were rejected stages only its
  header with an error status, and then **every** rank raises the same ``ValueError`` while
  the protocol stays consistent (the Buffer remains usable). This also catches ranks that
  disagree on ``hidden``, dtypes, ``num_experts`` or handles.
* Payloads larger than a half stream through in rounds: dispatch rounds cover ``q`` tokens
  of each sender; combine rounds cover ``q`` tokens of each *origin*, so each origin sums all
  contributions to a token in the same round, in ascending source rank (bit-exact order).

Dispatch's ``x`` rows (the bulk of its bytes) need not be staged at all. Each rank's ``recv_x``
is placed, when it fits, in its **landing segment** (a :class:`transports.SharedSegment` the
Buffer maps once; the tensor keeps its memory alive after ``destroy()``), and chunk 0's header
advertises the free range it will use. After the headers every rank knows every receiver's row
count, hence where each of its rows goes, and decides identically:

* **direct**: the call is one round and every ``recv_x`` fits its advertised range. Each sender
  gathers its rows straight into every receiver's ``recv_x`` (one copy instead of stage + gather)
  and raises ``XDATA``; receivers still gather the small fields from the staged chunk.
* **staged**: ``x`` goes through the window with the rest, as above.

Chunk 0 is staged before the decision, so whether it holds ``x`` follows a prediction every rank
makes alike: direct if the previous dispatch could have been (at first: if every rank has a
landing segment). A wrong "direct" guess (``late``)
stages ``x`` of chunk 0 after the headers and raises ``XDATA``; receivers wait for it, then
gather as in the staged path. Ranks that keep many outputs alive, windows that stream, or
``$DEEPEP_ASCEND_LANDING_BYTES=0`` make dispatch staged (after at most one late call).

Combine's ``x`` need not be staged either when it lies in the sender's own landing segment
(``combine(recv_x)``, or expert outputs written into ``recv_x``): chunk 0's header then gives its
offset, each origin reads its rows there (they follow the rows of lower origin
ranks, as the handle's ``rank_prefix_matrix`` says), and the sender waits for every peer's
``CONSUMED`` of its last chunk before the call returns, since ``x`` is the caller's again after it.
A sender whose call fails aborts (the Buffer's guard) before its caller gets ``x`` back, so an
origin that read rows in place checks for an abort after its last read and raises instead of
returning them. Each rank decides for itself; the count vector and top-k weights are staged either way.
"""

from __future__ import annotations

import numpy as np
import torch

from . import memory
from .. import native as _native
from .layout import combine_round_tokens, recv_channel_prefix, send_layout
from .protocol import (HEADER_BYTES, MAGIC, MSG_BYTES, MSG_WORD, OP_CACHED_DISPATCH, OP_COMBINE, OP_DISPATCH, OP_NAMES,
                       W_CALL, W_CHANNELS, W_HANDLE, W_LAND_BYTES, W_LAND_OFF, W_LAND_ROWS, W_MAGIC, W_NEXP, W_NTOK,
                       W_OP, W_PREFIX, W_SBYTES, W_SDTYPE, W_STATUS, W_TOPK, W_WCOLS, W_XBYTES, W_XDTYPE, W_XSEG_OFF,
                       ConsensusError, check_consensus, dtype_code, prefix_checksum)
from .reduce import CombineScratch, accumulate_rows

READY, CONSUMED, XDATA = 0, 1, 2
NUM_SLOTS = 3
_ALIGN = 128


def _align(x: int) -> int:
    return -(-x // _ALIGN) * _ALIGN


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def rows_before(rank_prefix_matrix: torch.Tensor, s: int, j: int) -> int:
    """Rows rank ``j`` receives from ranks below ``s``: where ``s``'s rows start in ``j``'s ``recv_x``."""
    return int(rank_prefix_matrix[s - 1, j]) if s else 0


class _Regions:
    """Byte layout of one half: header, small int32 vectors, then one array per row field."""

    def __init__(self, half_bytes: int, vec_ints: int, row_fields):
        self.vec_off = HEADER_BYTES
        self.rows_off = HEADER_BYTES + _align(4 * vec_ints)
        self.row_bytes = sum(row_fields)
        self.capacity = max(0, (half_bytes - self.rows_off - _ALIGN * len(row_fields)) // max(1, self.row_bytes))
        self.field_offs, off = [], self.rows_off
        for nbytes in row_fields:
            self.field_offs.append(off)
            off += _align(self.capacity * nbytes)

    @staticmethod
    def min_half_bytes(vec_ints: int, row_fields, rows: int) -> int:
        return HEADER_BYTES + _align(4 * vec_ints) + sum(_align(rows * b) for b in row_fields)


class IntranodeEngine:
    """Runs normal-mode calls for one Buffer over its transport ``tp`` and UBMEM window ``win``.

    Each public method is a generator: the first ``next()`` returns the output tensors (after
    the count exchange for a non-cached dispatch, before any communication otherwise); running
    it to the end completes the data movement. The Buffer runs the rest inline or on its worker.
    """

    def __init__(self, tp, win, segment=None):
        self.tp, self.win = tp, win
        self.rank = tp.topology.rank
        self.num_ranks = tp.topology.world_size
        self.segment = segment  # SharedSegment of the node (recv_x landing ranges), or None
        own = segment is not None and segment.sizes.get(self.rank, 0) > 0
        self.landing = memory.SegmentPool(segment, self.rank) if own else None
        # Identical on every rank: could the last dispatch store directly? At first: does every rank
        # have a landing segment (segment.sizes lists them all: one node)?
        self._predict_direct = segment is not None and all(segment.sizes.get(p, 0) > 0 for p in range(self.num_ranks))
        self._xdata_calls = 0  # dispatches so far that sent x after the headers (XDATA rounds), identical everywhere
        self.last_x_path = None  # how the last dispatch moved x: "direct", "staged" or "late" (module doc)
        self.last_combine_in_place = None  # did the peers read the last combine's x in place (module doc)?
        self.half_bytes = (win.nbytes // 2) // _ALIGN * _ALIGN
        self.staged = [0] * self.num_ranks  # chunks staged so far by every rank, identical everywhere
        self.peers = [p for p in range(self.num_ranks) if p != self.rank]
        self._scratch = CombineScratch()
        self.outputs = memory.OutputPool()  # recv_x, combined_x: storage reused once the caller drops them

    # -- sizing ------------------------------------------------------------------
    def dispatch_regions(self, xb, sb, k, num_experts, cached):
        fields = [xb, sb] if cached else [xb, sb, 8 * max(k, 0), 4 * max(k, 0), self.num_ranks]
        return _Regions(self.half_bytes, self.num_ranks + num_experts, fields)

    def combine_regions(self, xb, wcols):
        return _Regions(self.half_bytes, self.num_ranks, [xb, 4 * max(wcols, 0)])

    @staticmethod
    def size_hint(num_tokens, xb, sb, k, num_experts, num_ranks, combine_xb, wcols) -> int:
        """Window bytes for which calls of up to ``num_tokens`` tokens per rank never chunk (worst case)."""
        disp = _Regions.min_half_bytes(num_ranks + num_experts,
                                       [xb, sb, 8 * k, 4 * k, num_ranks], num_tokens) + _ALIGN * 5
        comb = _Regions.min_half_bytes(num_ranks, [combine_xb, 4 * wcols], num_ranks * num_tokens) + _ALIGN * 2
        return 2 * max(disp, comb)

    # -- primitives ----------------------------------------------------------------
    def _half(self, p):
        return (self.staged[p] % 2) * self.half_bytes

    def _view(self, p, off, nbytes, dtype=torch.uint8):
        return self.tp.peer_view(self.win, p, self._half(p) + off, nbytes, dtype)

    def _begin_stage(self, phase):
        """Wait until every peer consumed the chunk this rank's next half held before."""
        seq = self.staged[self.rank]
        if seq >= 2 and self.peers:
            self.tp.wait_until(self.win, CONSUMED, self.peers, seq - 1, phase=f"{phase}: reuse of staging half")

    def _publish(self):
        for p in self.peers:
            self.tp.signal(self.win, p, READY, ordered=True)

    def _await(self, sources, phase):
        peers = [s for s in sources if s != self.rank]
        if peers:
            self.tp.wait_until(self.win, READY, peers, [self.staged[s] + 1 for s in peers], phase=phase)

    def _consume(self, sources):
        for s in sources:
            if s != self.rank:
                self.tp.signal(self.win, s, CONSUMED, ordered=True)
            self.staged[s] += 1

    def _write_header(self, words: dict, message: str = ""):
        hdr = self._view(self.rank, 0, HEADER_BYTES, torch.int64).numpy()
        hdr[:MSG_WORD] = 0
        hdr[W_MAGIC] = MAGIC
        for k, v in words.items():
            hdr[k] = v
        text = message.encode("utf-8")[:MSG_BYTES].ljust(MSG_BYTES, b"\0")
        hdr[MSG_WORD:] = np.frombuffer(text, dtype=np.int64)

    def _read_headers(self):
        return np.stack([self._view(p, 0, HEADER_BYTES, torch.int64).numpy().copy() for p in range(self.num_ranks)])

    def _round0(self, op, call_id, words, vec: torch.Tensor | None, stage_rows, error: str | None, phase):
        """Stage chunk 0 (header, vector, rows), exchange READY, check the consensus.

        Returns the stacked headers ``[R, 128]`` int64. On a consensus failure, consumes chunk 0
        of every rank (so counters stay aligned) and raises :class:`ConsensusError`.
        """
        self._begin_stage(phase)
        words = {**words, W_CALL: call_id, W_OP: op, W_STATUS: int(error is not None)}
        if error is None and vec is not None and vec.numel():
            self._view(self.rank, HEADER_BYTES, 4 * vec.numel(), torch.int32).copy_(vec)
        if error is None:
            stage_rows()
        self._write_header(words, error or "")
        self._publish()
        self._await(range(self.num_ranks), phase)
        headers = self._read_headers()
        try:
            check_consensus(headers, op, call_id)
        except ConsensusError:
            self._consume(range(self.num_ranks))
            raise
        return headers

    def _rounds(self, rounds, stage, phase):
        """Yield ``(round, active sources)`` for rounds 0.. of a call whose chunk 0 is exchanged.

        ``rounds[s]`` = chunks rank ``s`` stages in this call. Before yielding round ``k > 0`` this
        stages this rank's chunk ``k`` and waits for the active sources' chunks; after the body
        it marks them consumed.
        """
        for rnd in range(max(rounds)):
            active = [s for s in range(self.num_ranks) if rounds[s] > rnd]
            if rnd:
                if rounds[self.rank] > rnd:
                    self._begin_stage(phase)
                    stage(rnd)
                    self._publish()
                self._await(active, phase)
            yield rnd, active
            self._consume(active)

    def _record(self, peer, nbytes):
        if nbytes:
            self.tp.record_fetch(peer, nbytes)

    # -- direct stores into the receivers' recv_x -------------------------------------------
    def _advertise(self, rows: int | None = None, xb: int = 0):
        """Header words naming where peers may store this rank's ``recv_x`` (a free range of its
        landing segment), and that range ``(offset, nbytes)`` or None. ``rows``: known already
        (cached dispatch): advertise exactly ``rows * xb`` bytes, or nothing if they do not fit."""
        if self.landing is None:
            return {W_LAND_BYTES: -1}, None
        off, cap = self.landing.largest_free()
        if rows is not None:
            if not 0 < rows * xb <= cap:
                return {W_LAND_BYTES: -1}, None
            cap = rows * xb
        return {W_LAND_OFF: off, W_LAND_BYTES: cap}, (off, cap)

    def _recv_x(self, advertised, rows: int, xb: int) -> torch.Tensor:
        """``recv_x`` ``[rows, xb]`` uint8: at the start of the advertised range if it fits (the rule
        :meth:`_direct_plan` assumes on every rank), else from the private output pool."""
        if advertised is not None and 0 < rows * xb <= advertised[1]:
            return self.landing.take(advertised[0], rows * xb).view(rows, xb)
        return self.outputs.empty((rows, xb), torch.uint8)

    def _direct_plan(self, headers, rows, xb: int, one_round: bool):
        """Where each rank's ``recv_x`` starts in its segment, if senders can store straight into
        all of them: the call is one round and every rank's ``rows[j] * xb`` bytes fit the range
        it advertised. Else None. Every rank computes the same answer (from headers and counts)."""
        if not one_round:
            return None
        plan = []
        for j in range(self.num_ranks):
            need, cap = rows[j] * xb, int(headers[j, W_LAND_BYTES])  # cap -1: j advertised nothing
            if need > max(cap, 0):
                return None
            plan.append(int(headers[j, W_LAND_OFF]))
        return plan

    def _store_direct(self, x, is_token_in_rank, rank_prefix_matrix, plan):
        """Gather this rank's rows for every receiver ``j`` straight into ``j``'s ``recv_x`` (at the
        rows ``rank_prefix_matrix`` gives this rank there), then raise ``XDATA`` at every peer.
        This is the only copy of ``x`` (the staged path copies it twice: stage, then gather)."""
        me, nr = self.rank, self.num_ranks
        n, xb = x.shape
        for j in [(me + 1 + i) % nr for i in range(nr)]:  # peers first, own rows last; receivers staggered
            idx = torch.nonzero(is_token_in_rank[:, j]).squeeze(1)
            cnt = idx.numel()
            start = rows_before(rank_prefix_matrix, me, j)
            if cnt != int(rank_prefix_matrix[me, j]) - start:  # never store outside j's rows for this rank
                raise RuntimeError(f"rank {me}: dispatch: is_token_in_rank routes {cnt} tokens to rank {j}, but the "
                                   f"counts exchanged for this call say {int(rank_prefix_matrix[me, j]) - start} "
                                   f"(was it changed before the call finished?)")
            if not cnt:
                continue
            dst = self.segment.view(j, plan[j] + start * xb, cnt * xb).view(cnt, xb)
            if cnt == n:
                dst.copy_(x)
            else:
                torch.index_select(x, 0, idx, out=dst)
        self._raise_xdata()

    def _raise_xdata(self):
        """``XDATA`` at every peer, after one release fence for all of them."""
        for i, p in enumerate(self.peers):
            self.tp.signal(self.win, p, XDATA, ordered=i == 0)

    def _send_x(self, headers, rank_prefix_matrix, one_round: bool, predicted: bool, x, is_token_in_rank,
                stage_x0, phase) -> bool:
        """After the headers of a dispatch: choose how ``x`` moves (module doc), alike on every rank,
        and send it. Direct: store into the receivers' ``recv_x`` (returns True). Late (chunk 0 went
        without ``x`` on a wrong guess): ``stage_x0()`` now, raise ``XDATA``, wait for the peers'.
        Staged: nothing more to do here. Updates the prediction for the next dispatch."""
        nr = self.num_ranks
        rows = [max(int(rank_prefix_matrix[nr - 1, j]), int(headers[j, W_LAND_ROWS])) for j in range(nr)]
        plan = self._direct_plan(headers, rows, x.shape[1], one_round)
        self._predict_direct = plan is not None
        direct = predicted and plan is not None
        self.last_x_path = "direct" if direct else "late" if predicted else "staged"
        if direct:
            self._store_direct(x, is_token_in_rank, rank_prefix_matrix, plan)
        elif predicted:
            stage_x0()  # into the half chunk 0 is in: this rank's staged count has not moved on yet
            self._raise_xdata()
            self._await_xdata(phase)
        return direct

    def _await_xdata(self, phase):
        self._xdata_calls += 1
        if self.peers:
            self.tp.wait_until(self.win, XDATA, self.peers, self._xdata_calls, phase=f"{phase}: x rows")

    # -- dispatch ------------------------------------------------------------------------
    def reject(self, op, call_id, message):
        """Take part in chunk 0 of a call with an error status; raises ConsensusError (on every rank)."""
        self._round0(op, call_id, {}, None, lambda: None, message, f"{OP_NAMES[op]} call #{call_id}")
        raise AssertionError("unreachable: the consensus check raises")  # pragma: no cover

    def dispatch(self, *, call_id, x, scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_rank,
                 num_tokens_per_expert, num_experts, expert_alignment, num_worst_tokens, num_channels,
                 handle_id, xdtype, sdtype):
        """Non-cached dispatch (spec §4.2, §4.4). ``x`` is ``[N, xb]`` uint8, ``scales`` ``[N, sb]`` uint8 or None.

        Yields once ``(recv_x_bytes, recv_scales_bytes, recv_topk_idx, recv_topk_weights,
        num_recv_tokens_per_expert_list, handle_parts)``; ``recv_x_bytes`` has
        ``max(N_recv, num_worst_tokens)`` rows.
        """
        me, nr = self.rank, self.num_ranks
        n, xb = x.shape
        sb = scales.shape[1] if scales is not None else 0
        k = topk_idx.shape[1] if topk_idx is not None else 0
        regions = self.dispatch_regions(xb, sb, k, num_experts, cached=False)
        q = max(1, regions.capacity)
        words = {W_NTOK: n, W_XBYTES: xb, W_XDTYPE: xdtype, W_SBYTES: sb, W_SDTYPE: sdtype,
                 W_TOPK: k if topk_idx is not None else -1, W_NEXP: num_experts, W_HANDLE: handle_id,
                 W_CHANNELS: num_channels, W_WCOLS: -1, W_LAND_ROWS: num_worst_tokens}
        vec = torch.cat([num_tokens_per_rank.to(torch.int32), num_tokens_per_expert.to(torch.int32)])
        predicted = self._predict_direct
        land_words, advertised = self._advertise()
        words.update(land_words)

        def stage(rnd, with_x=True, only_x=False):
            lo, hi = rnd * q, min(n, (rnd + 1) * q)
            m = hi - lo
            if m <= 0:
                return
            fo = regions.field_offs
            if with_x:
                self._view(me, fo[0], m * xb).view(m, xb).copy_(x[lo:hi])
            if only_x:
                return
            if sb:
                self._view(me, fo[1], m * sb).view(m, sb).copy_(scales[lo:hi])
            if k:
                self._view(me, fo[2], m * k * 8, torch.int64).view(m, k).copy_(topk_idx[lo:hi])
                self._view(me, fo[3], m * k * 4, torch.float32).view(m, k).copy_(topk_weights[lo:hi])
            self._view(me, fo[4], m * nr, torch.bool).view(m, nr).copy_(is_token_in_rank[lo:hi])

        phase = f"dispatch call #{call_id}"
        headers = self._round0(OP_DISPATCH, call_id, words, vec, lambda: stage(0, with_x=not predicted), None, phase)

        ntok = headers[:, W_NTOK].astype(np.int64)
        rounds = [max(1, _ceil_div(int(t), q)) for t in ntok]
        vecs = torch.stack([self._view(p, HEADER_BYTES, 4 * (nr + num_experts), torch.int32).clone()
                            for p in range(nr)])
        counts = vecs[:, :nr]  # counts[s][j]: tokens s sends to j
        rank_prefix_matrix = counts.cumsum(0, dtype=torch.int32)
        num_recv = int(rank_prefix_matrix[nr - 1, me])
        local = num_experts // nr
        per_expert = vecs[:, nr + me * local: nr + (me + 1) * local].sum(0, dtype=torch.int64)
        if num_worst_tokens:
            recv_list = []
        else:
            recv_list = [int(-(-int(c) // expert_alignment) * expert_alignment) for c in per_expert]
        rows = max(num_recv, num_worst_tokens)
        recv_x = self._recv_x(advertised, rows, xb)
        recv_scales = torch.empty(rows, sb, dtype=torch.uint8) if scales is not None else None
        recv_topk = torch.empty(rows, k, dtype=torch.int64) if topk_idx is not None else None
        recv_w = torch.empty(rows, k, dtype=torch.float32) if topk_idx is not None else None
        recv_src_idx = torch.empty(rows, dtype=torch.int32)
        if rows > num_recv:  # worst-case padding: zeros, and -1 expert ids (spec §4.4)
            for t in (recv_x, recv_scales, recv_w, recv_src_idx):
                if t is not None:
                    t[num_recv:].zero_()
            if recv_topk is not None:
                recv_topk[num_recv:].fill_(-1)
        channel_prefix_matrix, send_head = send_layout(is_token_in_rank, num_channels)
        recv_channel_prefix_matrix = torch.zeros(nr, num_channels, dtype=torch.int32)  # filled after the data
        yield (recv_x, recv_scales, recv_topk, recv_w, recv_list,
               (rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, send_head, recv_src_idx,
                num_recv))

        direct = self._send_x(headers, rank_prefix_matrix, max(rounds) == 1, predicted, x, is_token_in_rank,
                              lambda: stage(0, only_x=True), phase)
        cursor = [rows_before(rank_prefix_matrix, s, me) for s in range(nr)]
        for rnd, active in self._rounds(rounds, stage, phase):
            for s in active:
                m = min(q, int(ntok[s]) - rnd * q)
                if m <= 0:
                    continue
                fo = regions.field_offs
                mask = self._view(s, fo[4], m * nr, torch.bool).view(m, nr)[:, me]
                idx = torch.nonzero(mask).squeeze(1)
                c, got = cursor[s], idx.numel()
                if not got:
                    continue
                if not direct:
                    torch.index_select(self._view(s, fo[0], m * xb).view(m, xb), 0, idx, out=recv_x[c:c + got])
                if sb:
                    torch.index_select(self._view(s, fo[1], m * sb).view(m, sb), 0, idx, out=recv_scales[c:c + got])
                if k:
                    torch.index_select(self._view(s, fo[2], m * k * 8, torch.int64).view(m, k), 0, idx,
                                       out=recv_topk[c:c + got])
                    torch.index_select(self._view(s, fo[3], m * k * 4, torch.float32).view(m, k), 0, idx,
                                       out=recv_w[c:c + got])
                torch.add(idx, rnd * q, out=recv_src_idx[c:c + got])
                cursor[s] = c + got
                self._record(s, got * (xb + sb + 12 * k))  # counted by the receiver, however the rows came
        if direct:
            self._await_xdata(phase)
        for s in range(nr):
            if cursor[s] != int(rank_prefix_matrix[s, me]):
                start = int(rank_prefix_matrix[s, me]) - int(counts[s, me])
                raise RuntimeError(f"rank {me}: dispatch call #{call_id}: received {cursor[s] - start} tokens from "
                                   f"rank {s}, its num_tokens_per_rank promised {int(counts[s, me])}")
        starts = [rows_before(rank_prefix_matrix, s, me) for s in range(nr)] + [num_recv]
        recv_channel_prefix_matrix.copy_(recv_channel_prefix(recv_src_idx, starts, ntok, num_channels))
        if recv_topk is not None and num_recv:
            ids = recv_topk[:num_recv]
            foreign = (ids < me * local) | (ids >= (me + 1) * local)
            ids.sub_(me * local).masked_fill_(foreign, -1)
            recv_w[:num_recv].masked_fill_(foreign, 0.0)

    # -- cached dispatch ---------------------------------------------------------------
    def cached_dispatch(self, *, call_id, x, scales, rank_prefix_matrix, recv_src_idx, is_token_in_rank,
                        num_channels, handle_id, xdtype, sdtype):
        """Dispatch through a handle (spec §4.5): same routing, no counting. Yields ``(recv_x, recv_scales)``."""
        me, nr = self.rank, self.num_ranks
        n, xb = x.shape
        sb = scales.shape[1] if scales is not None else 0
        regions = self.dispatch_regions(xb, sb, 0, 0, cached=True)
        q = max(1, regions.capacity)
        rows = recv_src_idx.numel()
        words = {W_NTOK: n, W_XBYTES: xb, W_XDTYPE: xdtype, W_SBYTES: sb, W_SDTYPE: sdtype,
                 W_TOPK: -1, W_NEXP: 0, W_HANDLE: handle_id, W_CHANNELS: num_channels, W_WCOLS: -1, W_LAND_ROWS: rows,
                 W_PREFIX: prefix_checksum(rank_prefix_matrix)}
        vec = is_token_in_rank.sum(0, dtype=torch.int32)
        num_recv = int(rank_prefix_matrix[nr - 1, me])
        land_words, advertised = self._advertise(rows, xb)
        words.update(land_words)
        recv_x = self._recv_x(advertised, rows, xb)
        if rows > num_recv:
            recv_x[num_recv:].zero_()
        recv_scales = None if scales is None else torch.zeros(rows, sb, dtype=torch.uint8)
        yield recv_x, recv_scales
        # Read only now: an async cached dispatch runs the part above on the caller's thread while
        # earlier calls may still run on the worker (which updates the prediction in call order).
        predicted = self._predict_direct

        def stage(rnd, with_x=True, only_x=False):
            lo, hi = rnd * q, min(n, (rnd + 1) * q)
            if hi > lo:
                if with_x:
                    self._view(me, regions.field_offs[0], (hi - lo) * xb).view(hi - lo, xb).copy_(x[lo:hi])
                if sb and not only_x:
                    self._view(me, regions.field_offs[1], (hi - lo) * sb).view(hi - lo, sb).copy_(scales[lo:hi])

        phase = f"cached dispatch call #{call_id}"
        headers = self._round0(OP_CACHED_DISPATCH, call_id, words, vec, lambda: stage(0, with_x=not predicted), None,
                               phase)
        self._check_counts(rank_prefix_matrix, phase)
        ntok = headers[:, W_NTOK].astype(np.int64)
        rounds = [max(1, _ceil_div(int(t), q)) for t in ntok]
        direct = self._send_x(headers, rank_prefix_matrix, max(rounds) == 1, predicted, x, is_token_in_rank,
                              lambda: stage(0, only_x=True), phase)
        src = recv_src_idx[:num_recv].to(torch.int64)
        starts = [rows_before(rank_prefix_matrix, s, me) for s in range(nr)] + [num_recv]
        for rnd, active in self._rounds(rounds, stage, phase):
            for s in active:
                if direct and not sb:  # one round, nothing staged to gather: only count the rows received
                    self._record(s, (starts[s + 1] - starts[s]) * xb)
                    continue
                m = min(q, int(ntok[s]) - rnd * q)
                block = src[starts[s]:starts[s + 1]]
                lo, hi = torch.searchsorted(block, torch.tensor([rnd * q, rnd * q + max(m, 0)])).tolist()
                if hi <= lo:
                    continue
                idx = block[lo:hi] - rnd * q
                a, b = starts[s] + lo, starts[s] + hi
                if not direct:
                    torch.index_select(self._view(s, regions.field_offs[0], m * xb).view(m, xb), 0, idx,
                                       out=recv_x[a:b])
                if sb:
                    torch.index_select(self._view(s, regions.field_offs[1], m * sb).view(m, sb), 0, idx,
                                       out=recv_scales[a:b])
                self._record(s, (hi - lo) * (xb + sb))
        if direct:
            self._await_xdata(phase)

    def _check_counts(self, rank_prefix_matrix, phase):
        """Every rank compares what each sender's handle sends with its own handle's prefix matrix."""
        nr = self.num_ranks
        sent = torch.stack([self._view(p, HEADER_BYTES, 4 * nr, torch.int32).clone() for p in range(nr)])
        expected = torch.diff(rank_prefix_matrix.to(torch.int64), dim=0, prepend=torch.zeros(1, nr, dtype=torch.int64))
        if not torch.equal(sent.to(torch.int64), expected):
            self._consume(range(nr))
            raise ConsensusError(
                f"{phase}: the handles passed on different ranks do not describe the same dispatch "
                f"(tokens each rank's handle sends: {sent.tolist()}; this rank's handle expects {expected.tolist()})")

    # -- combine -----------------------------------------------------------------------
    def combine(self, *, call_id, x, topk_weights, bias, rank_prefix_matrix, recv_src_idx, is_token_in_rank,
                num_channels, handle_id):
        """Combine (spec §4.6): unweighted float32 sum over receiving ranks, ascending rank, one rounding.

        ``x`` is ``[>= N_recv, H]`` bf16. Yields ``(combined_x [N, H] bf16, combined_topk_weights | None)``.
        """
        me, nr = self.rank, self.num_ranks
        hidden = x.shape[1]
        xb = 2 * hidden
        wcols = topk_weights.shape[1] if topk_weights is not None else -1
        regions = self.combine_regions(xb, wcols)
        n = is_token_in_rank.shape[0]
        num_recv = int(rank_prefix_matrix[nr - 1, me])
        combined = self.outputs.empty((n, hidden), torch.bfloat16)
        combined_w = torch.empty(n, wcols, dtype=torch.float32) if wcols >= 0 else None
        yield combined, combined_w

        counts = torch.diff(rank_prefix_matrix.to(torch.int64), dim=0, prepend=torch.zeros(1, nr, dtype=torch.int64))
        q = combine_round_tokens(counts, regions.capacity, max(1, int(counts.max())))
        src = recv_src_idx[:num_recv].to(torch.int64)
        starts = [rows_before(rank_prefix_matrix, s, me) for s in range(nr)] + [num_recv]
        # x read in place (module doc): it lies in this rank's landing segment, which every peer maps.
        xseg = self.segment.offset_of(me, x) if self.landing is not None else None
        self.last_combine_in_place = xseg is not None
        words = {W_NTOK: n, W_XBYTES: xb, W_XDTYPE: dtype_code(torch.bfloat16), W_SBYTES: 0, W_SDTYPE: 0,
                 W_TOPK: -1, W_NEXP: 0, W_HANDLE: handle_id, W_CHANNELS: num_channels, W_WCOLS: wcols,
                 W_PREFIX: prefix_checksum(rank_prefix_matrix),
                 W_XSEG_OFF: -1 if xseg is None else xseg}

        own_span = [(0, 0)]  # this round's rows for this rank itself: read from x, never staged
        # Only a two-rank origin sums two sources by runs, where clean rows pay off, and only without
        # the native kernel (indifferent to -0.0, as the bags are); the cleaning add costs nearly
        # three plain copies.
        clean_staging = nr == 2 and not _native.available()

        def stage(rnd):
            """Stage, for every other origin, this rank's rows of that origin's tokens [rnd*q, (rnd+1)*q).

            The count vector lists every origin (own included); the rows of origins ``s != me``
            follow one another in ascending ``s``.
            """
            lo_t, hi_t = rnd * q, (rnd + 1) * q
            spans = []
            for s in range(nr):
                block = src[starts[s]:starts[s + 1]]
                lo, hi = torch.searchsorted(block, torch.tensor([lo_t, hi_t])).tolist()
                spans.append((starts[s] + lo, starts[s] + hi))
            own_span[0] = spans[me]
            sizes = torch.tensor([b - a for a, b in spans], dtype=torch.int32)
            self._view(me, HEADER_BYTES, 4 * nr, torch.int32).copy_(sizes)
            total = int(sizes.sum()) - int(sizes[me])
            if not total or (xseg is not None and wcols <= 0):
                return
            xdst = self._view(me, regions.field_offs[0], total * xb).view(total, xb) if xseg is None else None
            wdst = (self._view(me, regions.field_offs[1], total * wcols * 4, torch.float32).view(total, wcols)
                    if wcols > 0 else None)
            pieces = [span for s, span in enumerate(spans) if s != me]
            if all(spans[s][1] == spans[s + 1][0] for s in range(nr - 1)):
                # Adjacent spans (always so in a single round): two copies, around the own rows.
                pieces = [(spans[0][0], spans[me][0]), (spans[me][1], spans[-1][1])]
            pos = 0
            for a, b in pieces:
                if b <= a:
                    continue
                if xdst is not None:  # else peers read these rows of x in place
                    dst = xdst[pos:pos + b - a].view(torch.bfloat16)
                    if clean_staging:
                        # + 0.0 (exact) turns -0.0 into +0.0 on the way: staged rows are "clean", which
                        # spares the origin a sign-of-zero pass over a two-source sum (accumulate_rows).
                        torch.add(x[a:b], 0.0, out=dst)
                    else:
                        dst.copy_(x[a:b])
                if wdst is not None:
                    wdst[pos:pos + b - a].copy_(topk_weights[a:b])
                pos += b - a

        phase = f"combine call #{call_id}"
        # stage() writes the per-origin row counts; each origin checks its count against its handle.
        headers = self._round0(OP_COMBINE, call_id, words, None, lambda: stage(0), None, phase)
        ntok = headers[:, W_NTOK].astype(np.int64)
        num_rounds = max(1, max(_ceil_div(int(t), q) for t in ntok))
        acc, tmp = self._scratch.get(hidden)
        block = acc.size(0)
        read = [0] * nr  # rows of each rank's x read so far by this origin (x read in place)
        for rnd, _ in self._rounds([num_rounds] * nr, stage, phase):
            lo_t, hi_t = rnd * q, min(n, (rnd + 1) * q)
            m = max(0, hi_t - lo_t)
            edges = torch.arange(0, m + block, block).clamp_(max=m)
            sources = []  # per rank j: (rows of j for this rank [cnt, H] bf16, token ids, block bounds, staged)
            for j in range(nr):
                sizes = self._view(j, HEADER_BYTES, 4 * nr, torch.int32)
                cnt = int(sizes[me])
                tokens = torch.nonzero(is_token_in_rank[lo_t:hi_t, j]).squeeze(1) if m else None
                if (0 if tokens is None else tokens.numel()) != cnt:
                    raise RuntimeError(
                        f"rank {me}: {phase}: rank {j} returned {cnt} rows for tokens [{lo_t}, {hi_t}) of this rank, "
                        f"but the handle routed {0 if tokens is None else tokens.numel()} there; the handles "
                        f"passed on different ranks do not match")
                if not cnt:
                    continue
                if j == me:
                    a, b = own_span[0]
                    rows = x[a:b]
                    wrows = topk_weights[a:b] if combined_w is not None and wcols > 0 else None
                else:
                    off = int(sizes[:me].sum()) - (int(sizes[j]) if j < me else 0)  # in j's staged rows
                    wrows = (self._view(j, regions.field_offs[1] + off * wcols * 4, cnt * wcols * 4, torch.float32)
                             .view(cnt, wcols) if combined_w is not None and wcols > 0 else None)
                    if headers[j, W_XSEG_OFF] >= 0:  # j's x in its landing segment (the view checks the range)
                        row0 = rows_before(rank_prefix_matrix, me, j) + read[j]
                        read[j] += cnt
                        rows = self.segment.view(j, int(headers[j, W_XSEG_OFF]) + row0 * xb, cnt * xb)
                    else:
                        rows = self._view(j, regions.field_offs[0] + off * xb, cnt * xb)
                    rows = rows.view(cnt, xb).view(torch.bfloat16)
                sources.append((rows, wrows, tokens, torch.searchsorted(tokens, edges).tolist(),
                                j != me and clean_staging and headers[j, W_XSEG_OFF] < 0))
                self._record(j, cnt * (xb + 4 * max(wcols, 0)))
            if combined_w is not None:  # weights are small: one pass per source, ascending rank
                wout = combined_w[lo_t:hi_t]
                wout.zero_()
                for _, wrows, tokens, _, _ in sources:
                    if wrows is not None:
                        wout.index_add_(0, tokens, wrows)
            accumulate_rows(combined[lo_t:hi_t], [(rows, tokens) for rows, _, tokens, _, _ in sources], acc, tmp,
                            bias, lo_t, edges=edges, bounds=[src[3] for src in sources],
                            clean=[src[4] for src in sources])
        if any(read):
            # A sender whose call failed aborted before its caller could reuse its x: if rows read
            # from it in place may have changed meanwhile, this rank raises too instead of returning them.
            self.tp.check_abort()
        # x is the caller's again once no peer reads it (peers have rows of it unless all are this rank's own)
        if xseg is not None and num_recv > starts[me + 1] - starts[me]:
            self.tp.wait_until(self.win, CONSUMED, self.peers, self.staged[me], phase=f"{phase}: x read in place")
