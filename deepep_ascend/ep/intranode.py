"""Normal-mode dispatch and combine inside one UBMEM domain (docs/semantics/deepep-api.md §4),
over the transport's window.

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
  Nothing is ever cleaned: every rank counts the chunks of every rank, identically. Where every
  rank is mapped and the kernels are built, the signals are stores and bounded polls from C, and
  chunk 0's exchange one C call (:class:`~deepep_ascend.native.IntranodePlan`; the transport's
  ``wait_until`` takes over a wait that outlasts the poll); else the transport's calls.
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

import functools
from collections.abc import Generator
from typing import NamedTuple, NoReturn

import numpy as np
import torch

from .. import native as _native
from .. import settings
from ..native.operands import matrix_ok
from ..rounding import align, ceil_div
from ..transports import TransportUnsupported
from . import memory
from .handles import IntranodeHandle
from .layout import (
    ALL_TOKENS,
    combine_round_tokens,
    recv_channel_prefix,
    send_layout,
    to_local_experts,
)
from .phases import RECORDER as _PH
from .protocol import (
    HEADER_BYTES,
    MAGIC,
    MSG_BYTES,
    MSG_WORD,
    OP_CACHED_DISPATCH,
    OP_COMBINE,
    OP_DISPATCH,
    OP_NAMES,
    SHARED_WORDS,
    W_CALL,
    W_CHANNELS,
    W_HANDLE,
    W_LAND_BYTES,
    W_LAND_OFF,
    W_LAND_ROWS,
    W_MAGIC,
    W_NEXP,
    W_NTOK,
    W_OP,
    W_OP_CALL,
    W_PREFIX,
    W_SBYTES,
    W_SDTYPE,
    W_STATUS,
    W_TOPK,
    W_WCOLS,
    W_XBYTES,
    W_XDTYPE,
    W_XSEG_OFF,
    CallCounter,
    ConsensusError,
    check_consensus,
    dtype_code,
    prefix_checksum,
)
from .reduce import CombineScratch, accumulate_rows
from .rows import SentRows

READY, CONSUMED, XDATA = 0, 1, 2
NUM_SLOTS = 3
_ALIGN = 128
_POLLS = 2000  # polls of a native wait (a pause each: about 0.1 ms) before the transport's wait_until
_VIEW_CACHE_ENTRIES = 256  # window slices an engine keeps (IntranodeEngine._view)


def _rows_from_prefix(prefix: list, nr: int) -> np.ndarray:
    """``[R, R]`` int64 rows each rank sends each rank, from the rank prefix matrix as nested lists."""
    inclusive = np.array(prefix, dtype=np.int64).reshape(nr, nr)
    counts = inclusive.copy()
    counts[1:] -= inclusive[:-1]
    return counts


def _routed_elsewhere(me: int, j: int, routed: int, exchanged: int) -> RuntimeError:
    """A dispatch's routing mask that disagrees with the counts exchanged for it (changed during the call)."""
    return RuntimeError(f"rank {me}: dispatch: is_token_in_rank routes {routed} tokens to rank {j}, but the counts "
                        f"exchanged for this call say {exchanged} (was it changed before the call finished?)")


def _returned_elsewhere(me: int, phase: str, j: int, returned: int, routed: int, lo: int, hi: int) -> RuntimeError:
    """A combine source whose returned rows disagree with this origin's handle (the ranks' handles differ)."""
    return RuntimeError(f"rank {me}: {phase}: rank {j} returned {returned} rows for tokens [{lo}, {hi}) of this rank, "
                        f"but the handle routed {routed} there; the handles passed on different ranks do not match")


def rows_before(prefix: list, s: int, j: int) -> int:
    """Rows rank ``j`` receives from ranks below ``s``: where ``s``'s rows start in ``j``'s ``recv_x``.
    ``prefix``: the rank prefix matrix as nested lists (``rank_prefix_matrix.tolist()``), read without a
    torch op per entry."""
    return prefix[s - 1][j] if s else 0


class _Received(NamedTuple):
    """A non-cached dispatch's outputs, ``max(N_recv, num_worst_tokens)`` rows each."""

    x: torch.Tensor  # [rows, xb] uint8
    scales: torch.Tensor | None  # [rows, sb] uint8
    topk_idx: torch.Tensor | None  # [rows, K] int64
    topk_weights: torch.Tensor | None  # [rows, K] float32
    src_idx: torch.Tensor  # [rows] int32

    @property
    def row_bytes(self) -> int:
        """Bytes a received row moves, as the traffic counters count it: x, scales, ids and weights."""
        return self.x.size(1) + (self.scales.size(1) if self.scales is not None else 0) + 12 * (
            self.topk_idx.size(1) if self.topk_idx is not None else 0)


class _Returned(NamedTuple):
    """What a combine returns from this rank: its rows of ``x`` and their origins."""

    x: torch.Tensor  # [>= N_recv, H] bf16
    topk_weights: torch.Tensor | None  # [>= N_recv, K'] float32
    src: torch.Tensor  # [>= N_recv] int32: each row's token at its origin (ascending within an origin's block)
    starts: list  # R + 1 ints: origin s's rows are [starts[s], starts[s + 1])
    in_place: bool  # x lies in this rank's landing segment: peers read its rows there, nothing staged
    own_span: list  # [begin, end): this round's rows for this rank itself (set when the round is staged)


class _Source(NamedTuple):
    """One rank's rows for this rank's tokens in a combine round (arguments of ``accumulate_rows``)."""

    rows: torch.Tensor  # [cnt, H] bf16
    weights: torch.Tensor | None  # [cnt, K'] float32
    tokens: torch.Tensor  # [cnt] int64, ascending, relative to the round's first token
    rank: int  # the rank that returned these rows


class _Regions:
    """Byte layout of one half: header, small int32 vectors, then one array per row field."""

    def __init__(self, half_bytes: int, vec_ints: int, row_fields):
        self.vec_off = HEADER_BYTES
        self.rows_off = HEADER_BYTES + align(4 * vec_ints, _ALIGN)
        self.row_bytes = sum(row_fields)
        self.capacity = max(0, (half_bytes - self.rows_off - _ALIGN * len(row_fields)) // max(1, self.row_bytes))
        self.field_offs, off = [], self.rows_off
        for nbytes in row_fields:
            self.field_offs.append(off)
            off += align(self.capacity * nbytes, _ALIGN)

    @staticmethod
    def min_half_bytes(vec_ints: int, row_fields, rows: int) -> int:
        return HEADER_BYTES + align(4 * vec_ints, _ALIGN) + sum(align(rows * b, _ALIGN) for b in row_fields)


def _tokens_by_rank(mask: np.ndarray, nr: int) -> tuple[list[int], torch.Tensor]:
    """``mask`` ``[n, nr]`` bool (``is_token_in_rank``) as ``(counts, tokens)``: ``counts[j]`` tokens routed to
    rank ``j``, and ``tokens`` (int64, contiguous) every rank's token indices, rank-major, ascending within
    a rank. One numpy nonzero over the transposed mask: a small array, where torch costs several calls."""
    ranks_of, token_ids = np.nonzero(mask.T)
    # nonzero's index arrays are strided views of one [k, 2] array: copy to the layout index ops want
    return np.bincount(ranks_of, minlength=nr).tolist(), torch.from_numpy(np.ascontiguousarray(token_ids))


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
        self._regions = {}  # (count words, row fields) -> _Regions of the half
        self.staged = [0] * self.num_ranks  # chunks staged so far by every rank, identical everywhere
        self.peers = [p for p in range(self.num_ranks) if p != self.rank]
        # dispatch's direct stores: peers first, own rows last, each rank starting at the one after it
        self._store_order = [(self.rank + 1 + i) % self.num_ranks for i in range(self.num_ranks)]
        self.op_calls = CallCounter()  # this rank's dispatches and combines (header word W_OP_CALL)
        self._scratch = CombineScratch()
        self.outputs = memory.OutputPool()  # recv_x, combined_x: storage reused once the caller drops them
        self._views = memory.ViewCache(_VIEW_CACHE_ENTRIES)  # window slices: see _view, _rows
        self._plan = self._make_plan()  # the native plan of the fixed work (module doc), or None
        self._polls = 0 if tp.wait_policy.oversubscribed else _POLLS  # never spin where ranks outnumber cores
        # this rank's per-peer signal counters (their address array kept alive here), for the plan to count at
        self._signal_counter_cells = tp.traffic_counter_addresses()[2] if self._plan is not None else None
        self._signal_counters = 0 if self._plan is None else int(self._signal_counter_cells.ctypes.data)

    def _make_plan(self):
        """The :class:`~deepep_ascend.native.IntranodePlan` of this engine's window when every rank's window and
        signal words are mapped (one node, kernels loaded, ``DEEPEP_ASCEND_NORMAL_NATIVE`` on), else None.
        Decided once: the plan's signal words are then written through it alone (transports' signal_address)."""
        if not (_native.intranode_available() and settings.NORMAL_NATIVE.get() and self.half_bytes >= HEADER_BYTES):
            return None  # (a window too small for a header is refused by the Buffer)
        tp, win, me, nr = self.tp, self.win, self.rank, self.num_ranks
        try:
            slots = {slot: ([tp.signal_address(win, p, slot) if p != me else 0 for p in range(nr)],
                            tp.signal_words_address(win, slot)) for slot in (READY, CONSUMED, XDATA)}
            bases = [win.typed(p, torch.uint8).data_ptr() for p in range(nr)]
        except TransportUnsupported:  # a rank reached by one-sided writes only: the transport's calls
            return None
        return _native.IntranodePlan(num_ranks=nr, me=me, bases=bases, half_bytes=self.half_bytes,
                                   header_words=HEADER_BYTES // 8, vec_offset=HEADER_BYTES, slots=slots, ready=READY,
                                   out_words=MSG_WORD, cols=SHARED_WORDS)

    def release(self) -> None:
        """Drop the window views kept across calls (before the window is freed; later calls make them again)."""
        self._views.clear()

    # -- sizing ------------------------------------------------------------------
    def dispatch_regions(self, xb, sb, k, num_experts, cached) -> _Regions:
        fields = (xb, sb) if cached else (xb, sb, 8 * max(k, 0), 4 * max(k, 0), self.num_ranks)
        return self._half_regions(self.num_ranks + num_experts, fields)

    def combine_regions(self, xb, wcols) -> _Regions:
        return self._half_regions(self.num_ranks, (xb, 4 * max(wcols, 0)))

    def _half_regions(self, count_words: int, fields: tuple) -> _Regions:
        """The half's layout for ``count_words`` count words and rows of ``fields``, kept per shape: the shapes a
        model calls with (each call asks twice: the Buffer's room check, then here)."""
        key = (count_words, fields)
        regions = self._regions.get(key)
        if regions is None:
            if len(self._regions) >= 64:
                self._regions.clear()
            regions = self._regions[key] = _Regions(self.half_bytes, count_words, list(fields))
        return regions

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

    def _view(self, p, off, nbytes, dtype=torch.uint8, as_numpy: bool = False):
        # A slice of the window's typed view (as numpy with ``as_numpy``), kept per (rank, offset, length,
        # dtype): calls of one shape take the same few slices every time, and a dict lookup costs a tenth
        # of a torch slice. The engine's offsets stay inside its halves by construction (_Regions), and
        # peers are node peers, so the transport's per-call checks are spared.
        lo = ((self.staged[p] % 2) * self.half_bytes + off) // dtype.itemsize
        n = nbytes // dtype.itemsize

        def make():
            v = self.win.typed(p, dtype)[lo:lo + n]
            return v.numpy() if as_numpy else v
        return self._views.get((p, lo, n, dtype, as_numpy), make)

    def _rows(self, p, off, rows: int, cols: int, dtype=torch.uint8):
        """``[rows, cols]`` of ``dtype`` at ``off`` of ``p``'s current half: :meth:`_view`, kept likewise."""
        lo = ((self.staged[p] % 2) * self.half_bytes + off) // dtype.itemsize
        return self._views.get(("rows", p, lo, rows, cols, dtype),
                               lambda: self.win.typed(p, dtype)[lo:lo + rows * cols].view(rows, cols))

    def _begin_stage(self, phase):
        """Wait until every peer consumed the chunk this rank's next half held before."""
        seq = self.staged[self.rank]
        if seq >= 2 and self.peers:
            prev = _PH.switch("wait: staging half free") if _PH.on else None
            self._wait(CONSUMED, None, seq - 1, f"{phase}: reuse of staging half")
            if _PH.on:
                _PH.switch(prev)

    def _signal(self, slot, dsts: list | None):
        """Raise ``slot`` at every rank of ``dsts`` (peers; None: all of them), after one release fence."""
        plan = self._plan
        if plan is None:
            for i, p in enumerate(self.peers if dsts is None else dsts):
                self.tp.signal(self.win, p, slot, ordered=i == 0)
            return
        counters = self._counters()
        plan.signal(slot, None if dsts is None else np.array(dsts, dtype=np.int64), counters)
        if not counters:
            self._record_signals(dsts)

    def _counters(self) -> int:
        """Where the plan counts its signals: the transport's counters, or 0 while a link emulator is set (it
        charges only what ``record_signal`` counts: :meth:`_record_signals` then)."""
        return self._signal_counters if self.tp.stats.emulator is None else 0

    def _tails_ok(self) -> bool:
        """Whether the rest of a one-round call may run in one native call (:meth:`_direct_tail`, the combine's
        tail): a plan, and no link emulator (which charges each receive's emulated time before the signals that
        release the peers, so its calls take the steps one by one)."""
        return self._plan is not None and self.tp.stats.emulator is None

    def _consumed_by_plan(self) -> None:
        """After a native call that consumed every rank's chunk (the plan counted it): the same count here."""
        self.staged[:] = self._plan.staged.tolist()

    def _record_signals(self, dsts: list | None) -> None:
        for p in self.peers if dsts is None else dsts:
            self.tp.record_signal(p)

    def _wait(self, slot, srcs: list | None, value, phase, need_staged: bool = False):
        """Wait until every rank of ``srcs`` (peers; None: all of them) raised ``slot`` to ``value`` (plus its
        staged count with ``need_staged``): a bounded poll first where the engine has its native plan,
        then the transport's wait_until (deadline, abort checks)."""
        plan = self._plan
        if plan is not None:
            self.tp.check_abort(phase)  # a poll sees no abort words: a rank must hear of a peer's abort first
            if plan.poll(slot, None if srcs is None else np.array(srcs, dtype=np.int64), value, self._polls,
                        need_staged):
                return
        srcs = self.peers if srcs is None else srcs
        need = [self.staged[s] + value for s in srcs] if need_staged else value
        self.tp.wait_until(self.win, slot, srcs, need, phase=phase)

    def _publish(self):
        if _PH.on:
            _PH.switch("signal")
        self._signal(READY, None)

    def _await(self, sources, phase):
        peers = [s for s in sources if s != self.rank]
        if peers:
            prev = _PH.switch("wait: ready") if _PH.on else None
            self._wait(READY, None if len(peers) == len(self.peers) else peers, 1, phase, need_staged=True)
            if _PH.on:
                _PH.switch(prev)

    def _consume(self, sources):
        if _PH.on:
            _PH.switch("signal")
        if len(sources) == self.num_ranks:
            self._signal(CONSUMED, None)
        else:
            peers = [s for s in sources if s != self.rank]
            if peers:
                self._signal(CONSUMED, peers)
        for s in sources:
            self.staged[s] += 1
        if self._plan is not None:
            self._plan.staged[:] = self.staged

    def _write_header(self, words: dict, message: str = ""):
        hdr = self._view(self.rank, 0, HEADER_BYTES, torch.int64, as_numpy=True)
        if self._fill_header(hdr, words, message) < hdr.size:
            hdr[MSG_WORD:] = 0

    @staticmethod
    def _fill_header(hdr: np.ndarray, words: dict, message: str) -> int:
        """The header of ``words`` (and ``message``) into ``hdr`` (int64 ``[HEADER_BYTES / 8]``). Returns the words
        written: the first :data:`~.protocol.MSG_WORD` without a message (the rest of ``hdr`` left as it was),
        all with one."""
        row = [0] * MSG_WORD
        row[W_MAGIC] = MAGIC
        for w, v in words.items():
            row[w] = v
        hdr[:MSG_WORD] = row
        if not message:
            return MSG_WORD
        text = message.encode("utf-8")[:MSG_BYTES].ljust(MSG_BYTES, b"\0")
        hdr[MSG_WORD:] = np.frombuffer(text, dtype=np.int64)
        return hdr.size

    def _read_headers(self):
        if _PH.on:
            _PH.switch("control")
        return np.stack([self._view(p, 0, HEADER_BYTES, torch.int64, as_numpy=True) for p in range(self.num_ranks)])

    def _round0(self, op, call_id, words, vec: torch.Tensor | None, stage_rows, error: str | None, phase):
        """Stage chunk 0 (header, vector, rows), exchange READY, check the consensus.

        Returns the headers ``[R, W]`` int64 (``W``: at least :data:`~.protocol.MSG_WORD` words). On a consensus
        failure, consumes chunk 0 of every rank (so counters stay aligned) and raises :class:`ConsensusError`.
        """
        self._begin_stage(phase)
        if _PH.on:
            _PH.switch("pack")
        words = {**words, W_CALL: call_id, W_OP: op, W_OP_CALL: self.op_calls.next(op),
                 W_STATUS: int(error is not None)}
        vec = vec if error is None and vec is not None and vec.numel() else None
        plan = self._plan
        if plan is None or _PH.on:  # step by step (with phases: each step timed on its own)
            if vec is not None:
                self._view(self.rank, HEADER_BYTES, 4 * vec.numel(), torch.int32).copy_(vec)
            if error is None:
                stage_rows()
            self._write_header(words, error or "")
            self._publish()
            self._await(range(self.num_ranks), phase)
            headers = self._read_headers()
        else:
            if error is None:
                stage_rows()
            nwords = self._fill_header(plan.header, words, error or "")
            counters = self._counters()
            self.tp.check_abort(phase)  # as _wait
            status, headers = plan.exchange(nwords, vec, counters, self._polls)
            if not counters:
                self._record_signals(None)
            if status == 0 and error is None:
                return headers  # every rank in this call, its arguments accepted, agreeing on every shared word
            if status < 0:  # a peer is late: the long wait, then the headers
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

    def shared_empty(self, rows: int, hidden: int) -> torch.Tensor | None:
        """An uninitialised ``[rows, hidden]`` bf16 tensor in this rank's landing segment, or None (no segment,
        no room). A combine whose ``x`` is this tensor has its rows read by the peers in place (module doc):
        whoever writes a combine input here spares the call its staging copy. Call on the caller's thread
        (the segment's allocation rule, :class:`~deepep_ascend.ep.memory.SegmentPool`)."""
        nbytes = rows * hidden * 2
        if self.landing is None or nbytes <= 0:
            return None
        off, cap = self.landing.largest_free()
        if nbytes > cap:
            return None
        return self.landing.take(off, nbytes).view(torch.bfloat16).view(rows, hidden)

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

    def _store_direct(self, x, is_token_in_rank, prefix: list, plan):
        """Gather this rank's rows for every receiver ``j`` straight into ``j``'s ``recv_x`` (at the
        rows the rank prefix matrix ``prefix``, nested lists, gives this rank there), then raise ``XDATA``
        at every peer. This is the only copy of ``x`` (the staged path copies it twice: stage, then gather)."""
        me, nr = self.rank, self.num_ranks
        n, xb = x.shape
        if _PH.on:
            _PH.switch("copy")
        if self._plan is not None and matrix_ok(x) and is_token_in_rank.is_contiguous():  # one native call
            dst, want = self._store_targets(prefix, plan, xb)
            status, got = self._plan.store(x, is_token_in_rank, self._store_order, dst, want)
            if status:
                j = status - 1
                raise _routed_elsewhere(me, j, got[j], want[j])
            self._raise_xdata()
            return
        # every receiver's token list from one nonzero over the transposed mask (receiver-major, tokens
        # ascending), in numpy: a small bool array, where it costs a few torch calls less
        routed, tokens = _tokens_by_rank(is_token_in_rank.numpy(), nr)
        first = [0] * (nr + 1)
        for j in range(nr):
            first[j + 1] = first[j] + routed[j]
        for j in self._store_order:
            cnt = routed[j]
            start = rows_before(prefix, me, j)
            if cnt != prefix[me][j] - start:  # never store outside j's rows for this rank
                raise _routed_elsewhere(me, j, cnt, prefix[me][j] - start)
            if not cnt:
                continue
            dst = self.segment.view(j, plan[j] + start * xb, cnt * xb).view(cnt, xb)
            if cnt == n:
                dst.copy_(x)
            else:
                torch.index_select(x, 0, tokens[first[j]:first[j + 1]], out=dst)
        self._raise_xdata()

    def _store_targets(self, prefix: list, plan: list, xb: int) -> tuple[list, list]:
        """The native stores' operands: each receiver ``j``'s address for this rank's rows in its ``recv_x`` (0 where
        it gets none) and their count, from the rank prefix matrix ``prefix`` (nested lists) and the direct plan."""
        me, nr = self.rank, self.num_ranks
        want = [prefix[me][j] - rows_before(prefix, me, j) for j in range(nr)]
        dst = [self.segment.address(j, plan[j] + rows_before(prefix, me, j) * xb, want[j] * xb) if want[j] else 0
               for j in range(nr)]
        return dst, want

    def _check_received(self, ends: list, prefix: list, phase: str) -> None:
        """Raise ``RuntimeError`` unless every source ``s``'s rows end at ``prefix[s][me]`` in ``recv_x`` (``ends[s]``:
        where they end), the count its ``num_tokens_per_rank`` promised."""
        me = self.rank
        for s, end in enumerate(ends):
            if end != prefix[s][me]:
                start = rows_before(prefix, s, me)
                raise RuntimeError(f"rank {me}: {phase}: received {end - start} tokens from rank {s}, its "
                                   f"num_tokens_per_rank promised {prefix[s][me] - start}")

    def _raise_xdata(self):
        """``XDATA`` at every peer, after one release fence for all of them."""
        if _PH.on:
            _PH.switch("signal")
        self._signal(XDATA, None)

    def _x_path(self, headers, prefix: list, one_round: bool, predicted: bool, xb: int) -> list | None:
        """After the headers of a dispatch: how ``x`` moves (module doc), alike on every rank. Returns the direct
        plan (:meth:`_direct_plan`) when this call stores directly, else None; updates the prediction for the next
        dispatch. ``prefix``: the rank prefix matrix as nested lists."""
        nr = self.num_ranks
        land_rows = headers[:, W_LAND_ROWS].tolist()
        rows = [max(prefix[nr - 1][j], land_rows[j]) for j in range(nr)]
        plan = self._direct_plan(headers, rows, xb, one_round)
        self._predict_direct = plan is not None
        direct = predicted and plan is not None
        self.last_x_path = "direct" if direct else "late" if predicted else "staged"
        return plan if direct else None

    def _send_x(self, plan: list | None, prefix: list, predicted: bool, x, is_token_in_rank, stage_x0, phase) -> bool:
        """Send ``x`` the way :meth:`_x_path` chose: direct (``plan``), store into the receivers' ``recv_x``
        (returns True); late (chunk 0 went without ``x`` on a wrong guess): ``stage_x0()`` now, raise ``XDATA``,
        wait for the peers'; staged: nothing more to do here."""
        if plan is not None:
            self._store_direct(x, is_token_in_rank, prefix, plan)
        elif predicted:
            stage_x0()  # into the half chunk 0 is in: this rank's staged count has not moved on yet
            self._raise_xdata()
            self._await_xdata(phase)
        return plan is not None

    def _direct_tail(self, plan: list, prefix: list, ntok: list, x, is_token_in_rank, regions: _Regions,
                     out: _Received, num_experts: int, rcp: torch.Tensor, phase: str) -> None:
        """The rest of a one-round dispatch on the direct path, in one native call
        (:meth:`~deepep_ascend.native.IntranodePlan.dispatch_tail`): :meth:`_store_direct`, the gather of every
        source's chunk 0 (:meth:`_gather_native`), its consumption, the receive's channel prefix into ``rcp`` and
        :meth:`_await_xdata`, the same steps in the same order, checked as they are. ``prefix``: the rank prefix
        matrix as nested lists."""
        me, nr = self.rank, self.num_ranks
        at = [rows_before(prefix, s, me) for s in range(nr)]
        dst, want = self._store_targets(prefix, plan, x.size(1))
        self._xdata_calls += 1
        self.tp.check_abort(phase)  # the poll sees no abort words: a rank must hear of a peer's abort first
        local = num_experts // nr
        if _PH.on:
            _PH.switch("copy")
        status, got, routed = self._plan.dispatch_tail(
            x, is_token_in_rank, self._store_order, dst, want, regions.field_offs, ntok, at,
            out.scales, out.topk_idx, out.topk_weights, out.src_idx, (me * local, local), at + [prefix[nr - 1][me]],
            rcp, XDATA, CONSUMED, self._xdata_calls, self._signal_counters, self._polls, _PH.on)
        if _PH.on and status <= 0:
            ns = self._plan.ns
            _PH.carve("signal", ns[1])
            _PH.carve("epilogue", ns[2])
            _PH.carve("wait: x rows", ns[3])
        if 0 < status <= nr:
            raise _routed_elsewhere(me, status - 1, routed[status - 1], want[status - 1])
        if status == nr + 1:
            raise ValueError(f"deepep_ascend.native.IntranodePlan.dispatch_tail: the rows routed here from the "
                             f"sources (starting at rows {at}) do not fit {out.src_idx.size(0)} output rows")
        if status == nr + 2:  # the received tokens and block starts are the engine's own: not reached
            raise RuntimeError(f"rank {me}: {phase}: the received rows' channel prefix was refused")
        self._consumed_by_plan()
        for s in range(nr):
            if got[s]:
                self._record(s, got[s] * out.row_bytes)  # counted by the receiver, however the rows came
        if status < 0 and self.peers:  # a peer's x rows not yet stored: the long wait
            if _PH.on:
                _PH.switch("wait: x rows")
            self._wait(XDATA, None, self._xdata_calls, f"{phase}: x rows")
        self._check_received([a + g for a, g in zip(at, got)], prefix, phase)

    def _await_xdata(self, phase):
        self._xdata_calls += 1
        if self.peers:
            prev = _PH.switch("wait: x rows") if _PH.on else None
            self._wait(XDATA, None, self._xdata_calls, f"{phase}: x rows")
            if _PH.on:
                _PH.switch(prev)

    # -- dispatch ------------------------------------------------------------------------
    def reject(self, op, call_id, message) -> NoReturn:
        """Take part in chunk 0 of a call with an error status; raises ConsensusError (on every rank)."""
        self._round0(op, call_id, {}, None, lambda: None, message, f"{OP_NAMES[op]} call #{call_id}")
        raise AssertionError("unreachable: the consensus check raises")  # pragma: no cover

    def dispatch(self, *, call_id, x, scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_rank,
                 num_tokens_per_expert, num_experts, expert_alignment, num_worst_tokens, num_channels,
                 handle_id, xdtype, sdtype, extra_words: dict | None = None) -> Generator:
        """Non-cached dispatch (docs/semantics/deepep-api.md §4.2, §4.4). ``extra_words``: more header
        words every rank must agree on (``EPBuffer``'s collective arguments, ``protocol.W_EP_*``).
        ``x`` is ``[N, xb]`` uint8, ``scales`` ``[N, sb]`` uint8 or None.

        Yields once ``(recv_x_bytes, recv_scales_bytes, recv_topk_idx, recv_topk_weights,
        num_recv_tokens_per_expert_list, handle, num_recv, recv_counts)`` (``num_recv``: 0-dim int64
        tensor, the rows received; ``recv_counts`` ``[E / R]`` int64: the (token, slot) pairs received per local
        expert, unaligned) with ``handle`` an :class:`IntranodeHandle` whose ``recv_channel_prefix_matrix`` is
        filled when the generator ends. ``recv_x_bytes`` has ``max(N_recv, num_worst_tokens)`` rows.

        Without ``num_worst_tokens`` the outputs' shapes depend on the counts, so the yield comes after
        round 0 (the count exchange). With ``num_worst_tokens > 0`` every shape is known in advance
        (``num_worst_tokens`` rows) and the yield comes before any communication: ``num_recv``,
        ``recv_counts``, the handle's ``rank_prefix_matrix`` and the padding rows are filled in place
        later, before the generator ends (docs/semantics/deepep-api.md §3.4). If more than
        ``num_worst_tokens`` rows arrive, the call still runs in step with its peers (the rows land in
        scratch outputs, the caller's stay padding) and ``num_recv`` tells the caller to raise.
        """
        if _PH.on:
            _PH.switch("control")
        me, nr = self.rank, self.num_ranks
        n, xb = x.shape
        sb = scales.shape[1] if scales is not None else 0
        num_topk = topk_idx.shape[1] if topk_idx is not None else 0
        regions = self.dispatch_regions(xb, sb, num_topk, num_experts, cached=False)
        per_round = max(1, regions.capacity)
        words = {W_NTOK: n, W_XBYTES: xb, W_XDTYPE: xdtype, W_SBYTES: sb, W_SDTYPE: sdtype,
                 W_TOPK: num_topk if topk_idx is not None else -1, W_NEXP: num_experts, W_HANDLE: handle_id,
                 W_CHANNELS: num_channels, W_WCOLS: -1, W_LAND_ROWS: num_worst_tokens, **(extra_words or {})}
        # two small int32 vectors (the Buffers checked their dtype): one numpy concatenation, where torch.cat
        # costs several times as much
        vec = torch.from_numpy(np.concatenate((num_tokens_per_rank.numpy(), num_tokens_per_expert.numpy())))
        stage = functools.partial(self._stage_dispatch_chunk, regions, per_round,
                                  SentRows(x, scales, topk_idx, topk_weights, is_token_in_rank))
        phase = f"dispatch call #{call_id}"
        channel_prefix_matrix, send_head = send_layout(is_token_in_rank, num_channels)
        recv_channel_prefix_matrix = torch.zeros(nr, num_channels, dtype=torch.int32)  # filled after the data
        num_recv_t = torch.zeros((), dtype=torch.int64)
        recv_counts = torch.zeros(num_experts // nr, dtype=torch.int64)  # filled once the counts arrived
        early = num_worst_tokens > 0
        if early:
            # Static shapes: outputs, handle and offsets exist before the counts (filled in place below).
            # The landing range advertised is exactly the outputs' rows, so a receiver with more rows than
            # num_worst_tokens is never stored into directly (every rank's _direct_plan sees it too big).
            if _PH.on:
                _PH.switch("outputs")
            land_words, advertised = self._advertise(num_worst_tokens, xb)
            out = self._dispatch_outputs(advertised, num_worst_tokens, num_worst_tokens, xb, sb, num_topk,
                                         scales is not None, topk_idx is not None)
            rank_prefix_matrix = torch.zeros(nr, nr, dtype=torch.int32)
            handle = IntranodeHandle(rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix,
                                     out.src_idx, is_token_in_rank, send_head)
            yield out.x, out.scales, out.topk_idx, out.topk_weights, [], handle, num_recv_t, recv_counts
        else:
            land_words, advertised = self._advertise()
        words.update(land_words)
        # Read after the yield when there is one: earlier calls may still run on the worker meanwhile,
        # and they update the prediction in call order.
        predicted = self._predict_direct
        headers = self._round0(OP_DISPATCH, call_id, words, vec, lambda: stage(0, with_x=not predicted), None, phase)

        ntok = headers[:, W_NTOK].tolist()
        rounds = [max(1, ceil_div(t, per_round)) for t in ntok]
        counts, per_expert = self._read_count_vectors(num_experts)  # counts[s][j]: tokens s sends to j
        prefix_np = counts.cumsum(0, dtype=np.int32)
        prefix = prefix_np.tolist()  # the rank prefix matrix as lists: read entry by entry below
        num_recv = prefix[nr - 1][me]
        num_recv_t.fill_(num_recv)
        recv_counts.numpy()[:] = per_expert
        if early:
            rank_prefix_matrix.copy_(torch.from_numpy(prefix_np))
            if _PH.on:
                _PH.switch("outputs")
            if num_recv > num_worst_tokens:  # the caller raises; the rows still arrive, into scratch outputs
                out = self._dispatch_outputs(None, num_recv, num_recv, xb, sb, num_topk, scales is not None,
                                             topk_idx is not None)
            else:
                self._pad_outputs(out, num_recv)
        else:
            rank_prefix_matrix = torch.from_numpy(prefix_np)
            recv_list = (per_expert.tolist() if expert_alignment == 1 else
                         ((per_expert + expert_alignment - 1) // expert_alignment * expert_alignment).tolist())
            if _PH.on:
                _PH.switch("outputs")
            out = self._dispatch_outputs(advertised, num_recv, num_recv, xb, sb, num_topk, scales is not None,
                                         topk_idx is not None)
            handle = IntranodeHandle(rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix,
                                     out.src_idx, is_token_in_rank, send_head)
            yield out.x, out.scales, out.topk_idx, out.topk_weights, recv_list, handle, num_recv_t, recv_counts

        plan = self._x_path(headers, prefix, max(rounds) == 1, predicted, x.shape[1])
        if plan is not None and self._tails_ok() and matrix_ok(x) and is_token_in_rank.is_contiguous():
            # every remaining step in one native call
            self._direct_tail(plan, prefix, ntok, x, is_token_in_rank, regions, out, num_experts,
                              recv_channel_prefix_matrix, phase)
            return
        direct = self._send_x(plan, prefix, predicted, x, is_token_in_rank, lambda: stage(0, only_x=True), phase)
        cursor = [rows_before(prefix, s, me) for s in range(nr)]
        for rnd, active in self._rounds(rounds, stage, phase):
            if self._plan is not None:  # every source's rows in one native pass, the ids made local on the way
                self._gather_native(active, ntok, per_round, rnd, regions, out, cursor, direct,
                                    (me * (num_experts // nr), num_experts // nr))
                continue
            for s in active:
                rows = min(per_round, ntok[s] - rnd * per_round)
                if rows > 0:
                    cursor[s] = self._gather_dispatch_chunk(s, rows, rnd * per_round, regions, out, cursor[s], direct)
        if direct:
            self._await_xdata(phase)
        if _PH.on:
            _PH.switch("epilogue")
        self._check_received(cursor, prefix, phase)
        starts = [rows_before(prefix, s, me) for s in range(nr)] + [num_recv]
        recv_channel_prefix_matrix.copy_(recv_channel_prefix(out.src_idx, starts, ntok, num_channels))
        if out.topk_idx is not None and num_recv and self._plan is None:  # (the native gather did it)
            to_local_experts(out.topk_idx[:num_recv], out.topk_weights[:num_recv], me, num_experts // nr)

    def _stage_dispatch_chunk(self, regions: _Regions, per_round: int, sent: SentRows, rnd: int, with_x: bool = True,
                              only_x: bool = False) -> None:
        """Stage this rank's tokens ``[rnd·per_round, (rnd+1)·per_round)`` into its current half: ``x`` rows
        (unless ``with_x`` is False), then (unless ``only_x``) scales, top-k ids and weights, routing mask."""
        n = sent.x.size(0)
        if _PH.on:
            _PH.switch("pack")
        lo, hi = rnd * per_round, min(n, (rnd + 1) * per_round)
        rows = hi - lo
        if rows <= 0:
            return
        me, offs = self.rank, regions.field_offs
        xb = sent.x.size(1)
        if self._plan is not None:  # every field in one native call, but those that are no matrix of rows
            fields = [(sent.x, offs[0])] if with_x else []
            if not only_x:
                fields += [(t, off) for t, off in zip(sent[1:], offs[1:]) if t is not None]
            native, other = [], []
            for field in fields:
                (native if matrix_ok(field[0]) else other).append(field)
            self._plan.stage(native, [(lo, hi)])
            for t, off in other:
                self._rows(me, off, rows, t.size(1), t.dtype).copy_(t[lo:hi])
            return
        if with_x:
            self._rows(me, offs[0], rows, xb).copy_(sent.x[lo:hi])
        if only_x:
            return
        sb = sent.scales.size(1) if sent.scales is not None else 0
        num_topk = sent.topk_idx.size(1) if sent.topk_idx is not None else 0
        if sb:
            self._rows(me, offs[1], rows, sb).copy_(sent.scales[lo:hi])
        if num_topk:
            self._rows(me, offs[2], rows, num_topk, torch.int64).copy_(sent.topk_idx[lo:hi])
            self._rows(me, offs[3], rows, num_topk, torch.float32).copy_(
                sent.topk_weights[lo:hi])
        if sent.is_token_in_rank is not None:
            nr = self.num_ranks
            self._rows(me, offs[4], rows, nr, torch.bool).copy_(sent.is_token_in_rank[lo:hi])

    def _read_count_vectors(self, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
        """After chunk 0: ``counts [R, R]`` int32 (``[s, j]``: tokens ``s`` sends to ``j``) and this rank's
        received (token, slot) pairs per local expert ``[E / R]`` int64, from every rank's staged vector
        (numpy: a few small arrays, cheaper there than as torch ops)."""
        me, nr = self.rank, self.num_ranks
        local = num_experts // nr
        vecs = self._count_vectors(nr + num_experts)
        return vecs[:, :nr], vecs[:, nr + me * local: nr + (me + 1) * local].sum(0, dtype=np.int64)

    def _count_vectors(self, n: int) -> np.ndarray:
        """Every rank's chunk-0 count vector, ``[R, n]`` int32 (one native gather where the engine has a plan)."""
        if self._plan is not None:
            return self._plan.vectors(n)
        return np.stack([self._view(p, HEADER_BYTES, 4 * n, torch.int32, as_numpy=True) for p in range(self.num_ranks)])

    def _dispatch_outputs(self, advertised, num_recv: int, rows: int, xb: int, sb: int, num_topk: int,
                          with_scales: bool, with_topk: bool) -> _Received:
        """A dispatch's outputs of ``rows`` rows; rows past ``num_recv`` padded (:meth:`_pad_outputs`)."""
        out = _Received(self._recv_x(advertised, rows, xb),
                        torch.empty(rows, sb, dtype=torch.uint8) if with_scales else None,
                        torch.empty(rows, num_topk, dtype=torch.int64) if with_topk else None,
                        torch.empty(rows, num_topk, dtype=torch.float32) if with_topk else None,
                        torch.empty(rows, dtype=torch.int32))
        self._pad_outputs(out, num_recv)
        return out

    @staticmethod
    def _pad_outputs(out: _Received, num_recv: int) -> None:
        """Rows of ``out`` past ``num_recv``: zeros, expert id -1 (docs/semantics/deepep-api.md §4.4)."""
        if out.x.size(0) <= num_recv:
            return
        for t in (out.x, out.scales, out.topk_weights, out.src_idx):
            if t is not None:
                t[num_recv:].zero_()
        if out.topk_idx is not None:
            out.topk_idx[num_recv:].fill_(-1)

    def _gather_dispatch_chunk(self, s: int, rows: int, first_token: int, regions: _Regions, out: _Received, at: int,
                               direct: bool) -> int:
        """Gather into ``out`` from row ``at`` the rows for this rank of the ``rows`` tokens (from ``first_token``)
        rank ``s`` staged; ``x`` rows only if not stored directly. Returns the next free row."""
        if _PH.on:
            _PH.switch("copy")
        me, nr, offs = self.rank, self.num_ranks, regions.field_offs
        # the staged routing mask is small: its column searched in numpy, a few torch calls spared
        idx_np = np.flatnonzero(self._view(s, offs[4], rows * nr, torch.bool, as_numpy=True)[me::nr])
        got = idx_np.size
        idx = torch.from_numpy(idx_np)
        if not got:
            return at
        xb = out.x.size(1)
        sb = out.scales.size(1) if out.scales is not None else 0
        num_topk = out.topk_idx.size(1) if out.topk_idx is not None else 0
        if not direct:
            torch.index_select(self._rows(s, offs[0], rows, xb), 0, idx, out=out.x[at:at + got])
        if sb:
            torch.index_select(self._rows(s, offs[1], rows, sb), 0, idx, out=out.scales[at:at + got])
        if num_topk:
            torch.index_select(self._rows(s, offs[2], rows, num_topk, torch.int64), 0, idx,
                               out=out.topk_idx[at:at + got])
            torch.index_select(self._rows(s, offs[3], rows, num_topk, torch.float32), 0, idx,
                               out=out.topk_weights[at:at + got])
        torch.add(idx, first_token, out=out.src_idx[at:at + got])
        self._record(s, got * (xb + sb + 12 * num_topk))  # counted by the receiver, however the rows came
        return at + got

    def _gather_native(self, active, ntok: list, per_round: int, rnd: int, regions: _Regions, out: _Received,
                       cursor: list, direct: bool, local_experts: tuple[int, int]) -> None:
        """:meth:`_gather_dispatch_chunk` of every active source of round ``rnd`` in one native call
        (:meth:`~deepep_ascend.native.IntranodePlan.gather`), the ids made local on the way (``local_experts``:
        ``(first, L)``, the epilogue's :func:`to_local_experts`); advances ``cursor``."""
        if _PH.on:
            _PH.switch("copy")
        nr, lo = self.num_ranks, rnd * per_round
        rows = [0] * nr
        for s in active:
            rows[s] = max(0, min(per_round, ntok[s] - lo))
        got = self._plan.gather(regions.field_offs, rows, lo, cursor, None if direct else out.x, out.scales,
                               out.topk_idx, out.topk_weights, out.src_idx, local_experts)
        for s in range(nr):
            if got[s]:
                cursor[s] += got[s]
                self._record(s, got[s] * out.row_bytes)  # counted by the receiver, however the rows came

    # -- cached dispatch ---------------------------------------------------------------
    def cached_dispatch(self, *, call_id, x, scales, handle: IntranodeHandle, num_channels, handle_id, xdtype,
                        sdtype, extra_words: dict | None = None) -> Generator:
        """Dispatch through a handle (docs/semantics/deepep-api.md §4.5): same routing, no counting.
        Yields ``(recv_x, recv_scales)``."""
        me, nr = self.rank, self.num_ranks
        rank_prefix_matrix, recv_src_idx = handle.rank_prefix_matrix, handle.recv_src_idx
        n, xb = x.shape
        sb = scales.shape[1] if scales is not None else 0
        if _PH.on:
            _PH.switch("control")
        regions = self.dispatch_regions(xb, sb, 0, 0, cached=True)
        per_round = max(1, regions.capacity)
        rows = recv_src_idx.numel()
        words = {W_NTOK: n, W_XBYTES: xb, W_XDTYPE: xdtype, W_SBYTES: sb, W_SDTYPE: sdtype,
                 W_TOPK: -1, W_NEXP: 0, W_HANDLE: handle_id, W_CHANNELS: num_channels, W_WCOLS: -1, W_LAND_ROWS: rows,
                 W_PREFIX: prefix_checksum(rank_prefix_matrix), **(extra_words or {})}
        vec = handle.is_token_in_rank.sum(0, dtype=torch.int32)
        prefix = rank_prefix_matrix.tolist()  # read entry by entry below
        num_recv = prefix[nr - 1][me]
        land_words, advertised = self._advertise(rows, xb)
        words.update(land_words)
        if _PH.on:
            _PH.switch("outputs")
        recv_x = self._recv_x(advertised, rows, xb)
        if rows > num_recv:
            recv_x[num_recv:].zero_()
        recv_scales = None if scales is None else torch.zeros(rows, sb, dtype=torch.uint8)
        yield recv_x, recv_scales
        # Read only now: an async cached dispatch runs the part above on the caller's thread while
        # earlier calls may still run on the worker (which updates the prediction in call order).
        predicted = self._predict_direct
        stage = functools.partial(self._stage_dispatch_chunk, regions, per_round,
                                  SentRows(x, scales, None, None, None))
        phase = f"cached dispatch call #{call_id}"
        headers = self._round0(OP_CACHED_DISPATCH, call_id, words, vec, lambda: stage(0, with_x=not predicted), None,
                               phase)
        self._check_counts(prefix, phase)
        ntok = headers[:, W_NTOK].tolist()
        rounds = [max(1, ceil_div(t, per_round)) for t in ntok]
        direct = self._send_x(self._x_path(headers, prefix, max(rounds) == 1, predicted, x.shape[1]), prefix,
                              predicted, x, handle.is_token_in_rank, lambda: stage(0, only_x=True), phase)
        src = recv_src_idx[:num_recv].to(torch.int64)
        starts = [rows_before(prefix, s, me) for s in range(nr)] + [num_recv]
        for rnd, active in self._rounds(rounds, stage, phase):
            for s in active:
                if direct and not sb:  # one round, nothing staged to gather: only count the rows received
                    self._record(s, (starts[s + 1] - starts[s]) * xb)
                    continue
                staged = min(per_round, ntok[s] - rnd * per_round)
                self._gather_cached_chunk(s, src[starts[s]:starts[s + 1]], starts[s], rnd * per_round, staged, regions,
                                          recv_x, recv_scales, direct, whole=staged == ntok[s])
        if direct:
            self._await_xdata(phase)

    def _gather_cached_chunk(self, s: int, block: torch.Tensor, block_start: int, first_token: int, staged: int,
                             regions: _Regions, recv_x: torch.Tensor, recv_scales: torch.Tensor | None,
                             direct: bool, whole: bool = False) -> None:
        """Gather the rows of rank ``s``'s staged tokens ``[first_token, first_token + staged)`` that the handle
        routes here: ``block`` lists the source token of each of ``s``'s rows (they start at ``block_start``).
        ``whole``: the chunk holds every token of ``s`` (one round), so every row of ``block`` is in it."""
        if _PH.on:
            _PH.switch("copy")
        if whole:
            lo, hi = 0, block.numel()
        else:
            lo, hi = torch.searchsorted(block, torch.tensor([first_token, first_token + max(staged, 0)])).tolist()
        if hi <= lo:
            return
        idx = block[lo:hi] - first_token
        begin, end = block_start + lo, block_start + hi
        xb = recv_x.size(1)
        sb = recv_scales.size(1) if recv_scales is not None else 0
        if not direct:
            torch.index_select(self._rows(s, regions.field_offs[0], staged, xb), 0, idx,
                               out=recv_x[begin:end])
        if sb:
            torch.index_select(self._rows(s, regions.field_offs[1], staged, sb), 0, idx,
                               out=recv_scales[begin:end])
        self._record(s, (hi - lo) * (xb + sb))

    def _check_counts(self, prefix: list, phase):
        """Every rank compares what each sender's handle sends with its own handle's prefix matrix
        (``prefix``, nested lists)."""
        if _PH.on:
            _PH.switch("control")
        nr = self.num_ranks
        sent = self._count_vectors(nr)
        expected = _rows_from_prefix(prefix, nr)
        if not np.array_equal(sent, expected):
            self._consume(range(nr))
            raise ConsensusError(
                f"{phase}: the handles passed on different ranks do not describe the same dispatch "
                f"(tokens each rank's handle sends: {sent.tolist()}; this rank's handle expects {expected.tolist()})")

    # -- combine -----------------------------------------------------------------------
    def combine(self, *, call_id, x, topk_weights, bias, handle: IntranodeHandle, num_channels,
                handle_id, order: torch.Tensor | None = None, extra_words: dict | None = None) -> Generator:
        """Combine (docs/semantics/deepep-api.md §4.6): unweighted float32 sum over receiving ranks,
        ascending rank, one rounding; with ``order`` (``[N, R]`` int64, docs/semantics/deepep-api.md §13.5) each
        token's rows add in ascending ``order[token, rank]`` instead.

        ``x`` is ``[>= N_recv, H]`` bf16. Yields ``(combined_x [N, H] bf16, combined_topk_weights | None)``.
        """
        me, nr = self.rank, self.num_ranks
        rank_prefix_matrix = handle.rank_prefix_matrix
        hidden = x.shape[1]
        xb = 2 * hidden
        wcols = topk_weights.shape[1] if topk_weights is not None else -1
        regions = self.combine_regions(xb, wcols)
        n = handle.is_token_in_rank.shape[0]
        prefix = rank_prefix_matrix.tolist()  # read entry by entry below
        num_recv = prefix[nr - 1][me]
        if _PH.on:
            _PH.switch("outputs")
        combined = self.outputs.empty((n, hidden), torch.bfloat16)
        combined_w = torch.empty(n, wcols, dtype=torch.float32) if wcols >= 0 else None
        yield combined, combined_w

        if _PH.on:
            _PH.switch("control")
        if max(prefix[nr - 1]) <= regions.capacity:  # every rank's returned rows fit at once: one round
            per_round = ALL_TOKENS
        else:
            counts = _rows_from_prefix(prefix, nr)
            per_round = combine_round_tokens(counts, regions.capacity, max(1, int(counts.max())))
        # x read in place (module doc): it lies in this rank's landing segment, which every peer maps.
        xseg = self.segment.offset_of(me, x) if self.landing is not None else None
        self.last_combine_in_place = xseg is not None
        words = {W_NTOK: n, W_XBYTES: xb, W_XDTYPE: dtype_code(torch.bfloat16), W_SBYTES: 0, W_SDTYPE: 0,
                 W_TOPK: -1, W_NEXP: 0, W_HANDLE: handle_id, W_CHANNELS: num_channels, W_WCOLS: wcols,
                 W_PREFIX: prefix_checksum(rank_prefix_matrix),
                 W_XSEG_OFF: -1 if xseg is None else xseg, **(extra_words or {})}
        # Staged rows are copied as they are: turning -0.0 into +0.0 on the way would spare a torch-path origin of
        # two ranks a sign-of-zero pass, but two -0.0 biases start its sum at -0.0, where that sign shows.
        returned = _Returned(x, topk_weights, handle.recv_src_idx,
                             [rows_before(prefix, s, me) for s in range(nr)] + [num_recv],
                             in_place=xseg is not None, own_span=[0, 0])
        stage = functools.partial(self._stage_combine_chunk, regions, per_round, returned)
        phase = f"combine call #{call_id}"
        # stage() writes the per-origin row counts; each origin checks its count against its handle.
        headers = self._round0(OP_COMBINE, call_id, words, None, lambda: stage(0), None, phase)
        num_rounds = max(1, max(ceil_div(t, per_round) for t in headers[:, W_NTOK].tolist()))
        read = [0] * nr  # rows of each rank's x read so far by this origin (x read in place)
        native = self._plan is not None and self._native_combine_ok(x, topk_weights, bias, handle, order)
        # x is the caller's again once no peer reads it (peers have rows of it unless all are this rank's own)
        in_place_wait = xseg is not None and num_recv > returned.starts[me + 1] - returned.starts[me]
        if native and num_rounds == 1 and self._tails_ok():  # the receive, its consumption and that wait in one call
            self.tp.check_abort(phase)  # the poll sees no abort words: a rank must hear of a peer's abort first
            need = self.staged[me] + 1 if in_place_wait else 0
            if _PH.on:
                _PH.switch("reduce")
            short = self._combine_native(headers, regions, returned, handle, prefix, 0, min(n, per_round), combined,
                                         combined_w, bias, read, phase, order,
                                         (CONSUMED, need, self._signal_counters, self._polls))
            if _PH.on:
                ns = self._plan.ns
                _PH.carve("signal", ns[1])
                _PH.carve("wait: x read in place", ns[2])
            self._consumed_by_plan()
            if any(read):
                self.tp.check_abort()  # as below
            if short:
                if _PH.on:
                    _PH.switch("wait: x read in place")
                self._wait(CONSUMED, None, need, f"{phase}: x read in place")
            return
        acc, tmp = self._scratch.get(hidden)
        for rnd, _ in self._rounds([num_rounds] * nr, stage, phase):
            if _PH.on:
                _PH.switch("reduce")
            lo_t, hi_t = rnd * per_round, min(n, (rnd + 1) * per_round)
            if native:  # every source found, checked and summed in one native call
                self._combine_native(headers, regions, returned, handle, prefix, lo_t, hi_t, combined, combined_w,
                                     bias, read, phase, order)
                continue
            sources = self._combine_sources(headers, regions, returned, handle, prefix, lo_t, hi_t,
                                            combined_w is not None, read, phase)
            if combined_w is not None:  # weights are small: one pass per source, ascending rank
                wout = combined_w[lo_t:hi_t]
                wout.zero_()
                for source in sources:
                    if source.weights is not None:
                        wout.index_add_(0, source.tokens, source.weights)
            keys = None if order is None else [order[lo_t + source.tokens, source.rank] for source in sources]
            # the block edges and bounds of the torch routes are left to accumulate_rows, which makes them
            # only when a route needs them (the native kernel does not)
            accumulate_rows(combined[lo_t:hi_t], [(source.rows, source.tokens) for source in sources], acc, tmp,
                            bias, lo_t, keys=keys)
        if any(read):
            # A sender whose call failed aborted before its caller could reuse its x: if rows read
            # from it in place may have changed meanwhile, this rank raises too instead of returning them.
            self.tp.check_abort()
        if in_place_wait:
            if _PH.on:
                _PH.switch("wait: x read in place")
            self._wait(CONSUMED, None, self.staged[me], f"{phase}: x read in place")

    @staticmethod
    def _native_combine_ok(x, topk_weights, bias, handle: IntranodeHandle, order) -> bool:
        """Whether :meth:`_combine_native` takes these operands (else the torch glue does the receive)."""
        return (matrix_ok(x, torch.bfloat16) and (topk_weights is None or matrix_ok(
            topk_weights, torch.float32)) and (bias is None or all(b is None or matrix_ok(
                b, torch.bfloat16, x.size(1)) for b in bias)) and handle.is_token_in_rank.is_contiguous()
            and (order is None or (order.dtype == torch.int64 and order.is_contiguous())))

    def _combine_native(self, headers, regions: _Regions, returned: _Returned, handle: IntranodeHandle, prefix: list,
                        lo_t: int, hi_t: int, combined, combined_w, bias, read: list, phase: str, order=None,
                        tail: tuple | None = None) -> bool:
        """:meth:`_combine_sources` and its sum (rows and weights) for this rank's tokens ``[lo_t, hi_t)`` in one
        native call (:meth:`~deepep_ascend.native.IntranodePlan.combine`), the same bits; with ``tail`` (the last
        round's ``(slot, need, counters, polls)``, as there) also its consumption (the caller then counts every
        rank's chunk consumed) and the in-place wait's poll. Returns whether that poll ran out."""
        me, nr = self.rank, self.num_ranks
        x, weights = returned.x, returned.topk_weights
        hidden = x.size(1)
        xb = 2 * hidden
        wcols = weights.size(1) if weights is not None else -1
        rows_at, ld, cap, w_at, w_ld = [0] * nr, [0] * nr, [0] * nr, [0] * nr, [0] * nr
        begin, end = returned.own_span
        rows_at[me], ld[me], cap[me] = x.data_ptr() + 2 * begin * x.stride(0), x.stride(0), end - begin
        if combined_w is not None and wcols > 0:
            w_at[me], w_ld[me] = weights.data_ptr() + 4 * begin * weights.stride(0), weights.stride(0)
        for j in self.peers:
            xseg = int(headers[j, W_XSEG_OFF])
            if xseg >= 0:  # j's x in its landing segment: the rows left for this rank (address() checks the range)
                row0 = rows_before(prefix, me, j) + read[j]
                left = prefix[me][j] - row0
                # (none left: an address never read, so that a row j still claims is refused, not looked for staged)
                rows_at[j] = self.segment.address(j, xseg + row0 * xb, left * xb) if left > 0 else 1
                ld[j], cap[j] = hidden, max(left, 0)
        lo_t = min(lo_t, hi_t)  # (a round past this origin's last token: no rows, the sources' counts still checked)
        b0, b1 = (None, None) if bias is None else (None if b is None else b[lo_t:hi_t] for b in bias)
        status, got, want = self._plan.combine(
            regions.field_offs, lo_t, handle.is_token_in_rank, rows_at, ld, cap, w_at, w_ld, b0, b1,
            combined[lo_t:hi_t], None if combined_w is None else combined_w[lo_t:hi_t], order, tail, _PH.on)
        short = tail is not None and status == nr + 1
        if status > 0 and not short:
            j = status - 1
            raise _returned_elsewhere(me, phase, j, want[j], got[j], lo_t, hi_t)
        if status < -1:
            j = -2 - status
            raise RuntimeError(f"rank {me}: {phase}: rank {j}'s rows for tokens [{lo_t}, {hi_t}) of this rank lie "
                               f"outside what it staged or exposes; the handles passed on different ranks do not match")
        if status < 0:
            raise MemoryError(f"rank {me}: {phase}: the native row sum ran out of memory")
        for j in range(nr):
            if got[j]:
                if rows_at[j] and j != me:
                    read[j] += got[j]
                self._record(j, got[j] * (xb + 4 * max(wcols, 0)))
        return short

    def _stage_combine_chunk(self, regions: _Regions, per_round: int, returned: _Returned, rnd: int) -> None:
        """Stage, for every other origin, this rank's rows of that origin's tokens [rnd·per_round, (rnd+1)·per_round).

        The count vector lists every origin (own included); the rows of origins ``s != me``
        follow one another in ascending ``s``. Rows of ``x`` read in place are not staged.
        """
        if _PH.on:
            _PH.switch("pack")
        me, nr = self.rank, self.num_ranks
        lo_t, hi_t = rnd * per_round, (rnd + 1) * per_round
        starts = returned.starts
        if lo_t == 0 and hi_t >= ALL_TOKENS:  # one round: every row (tokens are below ALL_TOKENS)
            spans = [(starts[s], starts[s + 1]) for s in range(nr)]
        else:
            spans = []
            for s in range(nr):
                block = returned.src[starts[s]:starts[s + 1]]
                lo, hi = torch.searchsorted(block, torch.tensor([lo_t, hi_t], dtype=block.dtype)).tolist()
                spans.append((starts[s] + lo, starts[s] + hi))
        returned.own_span[:] = spans[me]
        sizes = [end - begin for begin, end in spans]
        total = sum(sizes) - sizes[me]
        weights = returned.topk_weights
        wcols = weights.size(1) if weights is not None else -1
        pieces = [span for s, span in enumerate(spans) if s != me]
        if all(spans[s][1] == spans[s + 1][0] for s in range(nr - 1)):
            # Adjacent spans (always so in a single round): two copies, around the own rows.
            pieces = [(spans[0][0], spans[me][0]), (spans[me][1], spans[-1][1])]
        if (self._plan is not None and matrix_ok(returned.x)
                and (weights is None or matrix_ok(weights))):  # the vector and every piece in one native call
            fields = [] if returned.in_place else [(returned.x, regions.field_offs[0])]
            if wcols > 0:
                fields.append((weights, regions.field_offs[1]))
            self._plan.stage(fields if total else [], pieces, vec=np.array(sizes, dtype=np.int32), stream_side="send")
            return
        self._view(me, HEADER_BYTES, 4 * nr, torch.int32, as_numpy=True)[:] = sizes
        if not total or (returned.in_place and wcols <= 0):
            return
        xb = returned.x.size(1) * 2
        xdst = self._rows(me, regions.field_offs[0], total, xb) if not returned.in_place else None
        wdst = (self._rows(me, regions.field_offs[1], total, wcols, torch.float32)
                if wcols > 0 else None)
        pos = 0
        for begin, end in pieces:
            if end <= begin:
                continue
            if xdst is not None:  # else peers read these rows of x in place
                xdst[pos:pos + end - begin].view(torch.bfloat16).copy_(returned.x[begin:end])
            if wdst is not None:
                wdst[pos:pos + end - begin].copy_(weights[begin:end])
            pos += end - begin

    def _combine_sources(self, headers, regions: _Regions, returned: _Returned, handle: IntranodeHandle, prefix: list,
                         lo_t: int, hi_t: int, with_weights: bool, read: list, phase: str) -> list[_Source]:
        """The rows every rank ``j`` returned for this rank's tokens ``[lo_t, hi_t)``, ascending ``j``: this
        rank's own from ``x``, the others' staged in ``j``'s window or read in place from its ``x``.
        ``prefix``: the handle's rank prefix matrix as nested lists."""
        me, nr = self.rank, self.num_ranks
        weights = returned.topk_weights
        wcols = weights.size(1) if weights is not None else -1
        xb = 2 * returned.x.size(1)
        m = max(0, hi_t - lo_t)
        # every rank's tokens of the round from one nonzero over the transposed mask (rank-major, ascending)
        if m:
            routed, routed_tokens = _tokens_by_rank(handle.is_token_in_rank.numpy()[lo_t:hi_t], nr)
        else:
            routed, routed_tokens = [0] * nr, None
        sources, first = [], 0
        for j in range(nr):
            sizes = self._view(j, HEADER_BYTES, 4 * nr, torch.int32, as_numpy=True).tolist()
            cnt = sizes[me]
            if routed[j] != cnt:
                raise _returned_elsewhere(me, phase, j, cnt, routed[j], lo_t, hi_t)
            tokens = routed_tokens[first:first + cnt] if cnt else None
            first += cnt
            if not cnt:
                continue
            staged_x = j != me and headers[j, W_XSEG_OFF] < 0
            if j == me:
                begin, end = returned.own_span
                rows = returned.x[begin:end]
                wrows = weights[begin:end] if with_weights and wcols > 0 else None
            else:
                off = sum(sizes[:me]) - (sizes[j] if j < me else 0)  # in j's staged rows
                wrows = (self._rows(j, regions.field_offs[1] + off * wcols * 4, cnt, wcols, torch.float32)
                         if with_weights and wcols > 0 else None)
                if not staged_x:  # j's x in its landing segment (the view checks the range)
                    row0 = rows_before(prefix, me, j) + read[j]
                    read[j] += cnt
                    rows = self.segment.view(j, int(headers[j, W_XSEG_OFF]) + row0 * xb, cnt * xb)
                    rows = rows.view(torch.bfloat16).view(cnt, xb // 2)
                else:
                    rows = self._rows(j, regions.field_offs[0] + off * xb, cnt, xb // 2, torch.bfloat16)
            sources.append(_Source(rows, wrows, tokens, j))
            self._record(j, cnt * (xb + 4 * max(wcols, 0)))
        return sources
