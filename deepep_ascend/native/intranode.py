"""The normal-mode engine's control words by loads and stores, on one node (``csrc/intranode.c``).

:class:`deepep_ascend.ep.intranode.IntranodeEngine` synchronises with three signal slots (``READY``,
``CONSUMED``, ``XDATA``) and exchanges a header per rank in chunk 0 of every call. Through the transport
each signal is a Python call per peer and each wait a polling loop in Python; the header is written and
read with numpy and compared with a few numpy ops. A :class:`IntranodePlan` does the same with plain loads
and stores from C, as :func:`deepep_ascend.native.ll_publish` does for the low-latency path:

* :meth:`IntranodePlan.signal`: one release fence, then each destination's running value plus one stored into
  the word this rank alone writes there (what transports' ``signal()`` stores);
* :meth:`IntranodePlan.poll`: this rank's signal words polled for a bounded number of rounds, then an acquire
  fence (transports' ``wait_until`` while the peers are on time);
* :meth:`IntranodePlan.exchange`: chunk 0 of a call: the count vector and header stored, ``READY`` to every
  peer, every peer's ``READY`` polled, the header words gathered and compared;
* :meth:`IntranodePlan.vectors`: every rank's count vector of chunk 0, gathered;
* :meth:`IntranodePlan.stage`: pieces of rows of a call's fields, and its count vector, copied into this rank's
  current half;
* :meth:`IntranodePlan.store`: dispatch's direct stores, each receiver's rows of ``x`` into its ``recv_x``;
* :meth:`IntranodePlan.gather`: a dispatch chunk's receive: every source's rows for this rank (``x``, scales,
  top-k ids and weights, source token) from its staged chunk into the outputs, in one pass;
* :meth:`IntranodePlan.combine`: a combine round's receive: every source's rows for this origin's tokens,
  checked against the counts the sources sent, summed in float32 with the bias in ascending source order
  and rounded once (:func:`~deepep_ascend.native.sum_rows`'s kernel), and the top-k weights summed; with
  ``tail``, a one-round combine's rest too (``CONSUMED`` to every peer, the peers' ``CONSUMED`` polled);
* :meth:`IntranodePlan.dispatch_tail`: a one-round dispatch's rest on the direct path in one call: the stores,
  ``XDATA``, the receive, ``CONSUMED``, the received rows' channel prefix, the ``XDATA`` poll.

A poll that runs out returns False (or ``-1``) having read nothing: the engine then waits with the
transport's ``wait_until``, which has the deadline and the abort checks. The plan is checked once, when it
is built (every address nonzero, the header inside a half); its methods pass raw addresses and check only
what a call brings. A plan's signal words must be written through it alone (transports'
``signal_address`` rule): the engine decides once, when it is made, whether it has one. None of this is a
DeepEP call: it is the inside of DeepEP's notify kernels.
"""

from __future__ import annotations

import numpy as np
import torch

from .ll import stream_side_number
from .loader import kernels
from .operands import matrix_ok
from .rows import NAN_BITS

__all__ = ["IntranodePlan", "intranode_available"]

# Plan words (csrc/intranode.c: CTL_*)
_GATHER_DTYPES = (torch.uint8, torch.uint8, torch.int64, torch.float32, torch.int32)  # gather's x .. src_idx
(_R, _ME, _HALF, _HDR_WORDS, _VEC_OFF, _BASES, _STAGED, _PEERS, _READY_SENT, _READY_ADDR, _READY_OWN,
 _WORDS) = range(12)


def intranode_available() -> bool:
    """Whether the ten functions of ``csrc/intranode.c`` are loaded."""
    k = kernels
    return not (k.in_signal is None or k.in_poll is None or k.in_exchange is None or k.in_gather is None
                or k.in_combine is None or k.in_stage is None or k.in_store is None or k.in_vectors is None
                or k.in_dispatch_tail is None or k.in_combine_tail is None)


def _store_operands(op: str, x: torch.Tensor, mask: torch.Tensor, num_ranks: int, order: list) -> None:
    """Refuse (``ValueError`` naming ``op``) what the direct stores do not take: ``x`` an ``[n, xb]`` uint8 matrix,
    ``mask`` ``[n, R]`` contiguous bool, ``order`` a permutation of the ``R`` ranks (the receivers' order; the
    kernel skips a rank listed again, but a list that is not a permutation is a caller's mistake)."""
    if not (matrix_ok(x, torch.uint8) and mask.dtype == torch.bool and mask.is_contiguous()
            and tuple(mask.shape) == (x.size(0), num_ranks)):
        raise ValueError(f"deepep_ascend.native.IntranodePlan.{op}: x [n, xb] uint8 and mask [n, {num_ranks}] bool "
                         f"expected, got {x.dtype}{list(x.shape)} and {mask.dtype}{list(mask.shape)}")
    if sorted(order) != list(range(num_ranks)):
        raise ValueError(f"deepep_ascend.native.IntranodePlan.{op}: order must list each of the {num_ranks} ranks "
                         f"once, got {list(order)}")


def _gather_outputs(op: str, outs: tuple) -> None:
    """Refuse (``ValueError`` naming ``op``) receive outputs ``(x, scales, topk_idx, topk_weights, src_idx)`` the
    gather does not take: each None or contiguous, of ``src_idx``'s rows and of :data:`_GATHER_DTYPES`, the top-k
    ids and weights both or neither and of one shape."""
    n, topk_idx, topk_weights = outs[4].size(0), outs[2], outs[3]
    if not all(t is None or (t.dtype == dtype and t.size(0) == n and t.is_contiguous())
               for t, dtype in zip(outs, _GATHER_DTYPES)) or (topk_idx is None) != (topk_weights is None) \
            or (topk_idx is not None and topk_idx.shape != topk_weights.shape):
        got = [None if t is None else (t.dtype, tuple(t.shape), t.is_contiguous()) for t in outs]
        raise ValueError(f"deepep_ascend.native.IntranodePlan.{op}: outputs must be contiguous tensors of {n} rows "
                         f"of dtypes {_GATHER_DTYPES}, top-k ids and weights both or neither and of one shape, "
                         f"got {got}")


class IntranodePlan:
    """One engine's control words by address (``csrc/intranode.c``'s plan words).

    Args:
        num_ranks, me: ``R`` and this rank.
        bases: each rank's window data-region address (``[R]``, all nonzero).
        half_bytes: bytes of one half of a data region (a rank stages into half ``staged[rank] & 1``).
        header_words: int64 words of a header, at the start of a half.
        vec_offset: byte offset of the count vector in a half (at or after the header).
        slots: ``{slot: (addresses, own)}`` for each signal slot: ``addresses[d]`` the address of this rank's
            word of the slot at rank ``d`` (transports' ``signal_address``; 0 for ``me``), ``own`` the address of
            this rank's own words of the slot, ``[R]`` int64 (``signal_words_address``).
        ready: which slot of ``slots`` :meth:`exchange` signals and polls.
        out_words: the words of each rank's header :meth:`exchange` returns (the first ones).
        cols: the header words (each below ``out_words``) every rank's header must share with this rank's.

    Attributes:
        staged: ``[R]`` int64, chunks staged so far by each rank: the caller keeps it equal to its own count.
        sent: ``{slot: [R] int64}``, the value last stored at each rank (what transports' ``signal()`` keeps).
        header: ``[header_words]`` int64, the header :meth:`exchange` stores (the caller fills it).
    Raises:
        ValueError: ``R < 1``, ``me`` out of range, an address of zero, a header that does not fit a half, a
            column outside ``out_words``.
    """

    def __init__(self, *, num_ranks: int, me: int, bases, half_bytes: int, header_words: int, vec_offset: int,
                 slots: dict, ready: int, out_words: int, cols):
        R = num_ranks
        bases = np.asarray(bases, dtype=np.int64)
        cols = np.array(cols, dtype=np.int64)
        if not (R >= 1 and 0 <= me < R and bases.shape == (R,) and bases.all() and header_words >= 1
                and 8 * header_words <= vec_offset <= half_bytes and ready in slots
                and 0 < out_words <= header_words and all(0 <= c < out_words for c in cols.tolist())):
            raise ValueError(f"deepep_ascend.native.IntranodePlan: R={R}, me={me}, bases {bases.tolist()}, "
                             f"half_bytes={half_bytes}, header_words={header_words}, vec_offset={vec_offset}, "
                             f"ready slot {ready} of {sorted(slots)}, out_words={out_words}, columns "
                             f"{cols.tolist()}: out of range or not mapped")
        self.num_ranks, self.me, self.half_bytes, self.vec_offset = R, me, half_bytes, vec_offset
        self.addrs, self.own, self.sent = {}, {}, {}
        for slot, (addresses, own) in slots.items():
            a = np.asarray(addresses, dtype=np.int64)
            if a.shape != (R,) or not own or not all(a[d] for d in range(R) if d != me):
                raise ValueError(f"deepep_ascend.native.IntranodePlan: slot {slot} needs a nonzero word at every "
                                 f"other rank and its own words, got {addresses!r}, {own!r}")
            self.addrs[slot], self.own[slot] = a, int(own)
            self.sent[slot] = np.zeros(R, dtype=np.int64)
        self.bases, self.out_words, self.cols = bases, out_words, cols
        self.staged = np.zeros(R, dtype=np.int64)
        self.peers = np.array([p for p in range(R) if p != me], dtype=np.int64)
        self.header = np.zeros(header_words, dtype=np.int64)
        self._plan = np.zeros(_WORDS, dtype=np.int64)
        self._plan[:_BASES] = (R, me, half_bytes, header_words, vec_offset)
        self._plan[_BASES:] = (bases.ctypes.data, self.staged.ctypes.data, self.peers.ctypes.data,
                               self.sent[ready].ctypes.data, self.addrs[ready].ctypes.data, self.own[ready])
        # the addresses each call passes, read once (numpy's .ctypes costs about a microsecond a read)
        self._address = self._plan.ctypes.data
        self._header_address = self.header.ctypes.data
        self._staged_address = self.staged.ctypes.data
        self._peers_address = self.peers.ctypes.data
        self._cols_address = cols.ctypes.data
        # the receives' per-source operands, one row each: field offsets [5], then [R] each: gather's rows, (unused),
        # first output row, rows received; combine's row and weight addresses and strides, rows promised,
        # rows readable at those addresses; the stores' order, addresses, rows wanted and routed (rows 5-8, as
        # dispatch_tail reads them, with the channel prefix's block starts [R + 1] in row 9)
        self._ops = np.zeros((11, max(R + 1, 5)), dtype=np.int64)
        self._ops_addresses = [row.ctypes.data for row in self._ops]
        self._ops_table = np.array(self._ops_addresses, dtype=np.int64)  # the rows' addresses, for dispatch_tail
        self._ops_table_address = self._ops_table.ctypes.data
        self._ns = np.zeros(4, dtype=np.int64)  # a timed call's steps (:attr:`ns`)
        self._ns_address = self._ns.ctypes.data
        # stage's fields (source, its row stride, row bytes, offset) and pieces (first row, end), one row each
        self._fields = np.zeros((6, max(8, R)), dtype=np.int64)
        self._fields_addresses = [row.ctypes.data for row in self._fields]
        self._tokens = np.zeros(0, dtype=np.int64)  # combine's scratch: each source's tokens, then their keys
        self._tokens_address = self._tokens.ctypes.data
        self._slot_addresses = {slot: (self.sent[slot].ctypes.data, self.addrs[slot].ctypes.data, self.own[slot])
                                for slot in slots}

    @property
    def ns(self) -> list[int]:
        """Nanoseconds of the last ``timed`` call's steps: :meth:`dispatch_tail`'s ``[stores + gather, signals,
        channel prefix, poll]``; :meth:`combine`'s with ``tail``, in the first three, ``[receive, signal, poll]``."""
        return self._ns.tolist()

    def signal(self, slot: int, dsts: np.ndarray | None = None, counters: int = 0) -> None:
        """Raise ``slot`` at every rank of ``dsts`` (``[n]`` int64, ranks other than this one; None: every peer),
        after one release fence. ``counters``: the address of this rank's ``[R]`` int64 signal counters to add
        one to per destination (``Transport.traffic_counter_addresses()[2]``), or 0.

        Raises:
            ValueError: a destination out of range or this rank itself (nothing stored).
        """
        sent, addrs, _ = self._slot_addresses[slot]
        if dsts is None:
            n, ptr = self.num_ranks - 1, self._peers_address
        else:
            n, ptr = dsts.size, dsts.ctypes.data
        if kernels.in_signal(n, ptr, self.num_ranks, sent, addrs, counters or None):
            raise ValueError(f"deepep_ascend.native.IntranodePlan.signal: destinations {dsts!r} must be ranks in "
                             f"[0, {self.num_ranks}) other than {self.me}")

    def poll(self, slot: int, srcs: np.ndarray | None, add: int, polls: int, need_staged: bool = False) -> bool:
        """Whether every rank of ``srcs`` (``[n]`` int64; None: every peer) raised ``slot`` to at least ``add``
        (plus its ``staged`` count with ``need_staged``) within ``polls`` rounds; after True, the data those
        signals released may be read (acquire)."""
        if srcs is None:
            n, ptr = self.num_ranks - 1, self._peers_address
        else:
            n, ptr = srcs.size, srcs.ctypes.data
        return not kernels.in_poll(self._slot_addresses[slot][2], n, ptr,
                                    self._staged_address if need_staged else None, add, polls)

    def exchange(self, nwords: int, vec: torch.Tensor | None, counters: int, polls: int) -> tuple[int, np.ndarray]:
        """Chunk 0 of a call (``csrc/intranode.c``'s ``deepep_in_exchange``): ``vec`` (contiguous; None: none) at
        ``vec_offset`` of this rank's half and the first ``nwords`` words of :attr:`header` (zeros after), the
        ready slot raised at every peer (``counters`` as in :meth:`signal`), every peer's polled up to ``polls``
        rounds until it reads its ``staged + 1``.

        Returns:
            ``(status, headers)``: status -1 if a peer is still short (nothing read; ``headers`` unset); else 0 when
            every rank's header agrees with this rank's at ``cols``, 1 when not. ``headers``: ``[R, out_words]``
            int64, the first words of every rank's header.
        Raises:
            ValueError: ``nwords`` outside the header, ``vec`` past the half or not contiguous (nothing written).
        """
        vec_bytes = 0 if vec is None else vec.numel() * vec.element_size()
        if (not 0 < nwords <= self.header.size or self.vec_offset + vec_bytes > self.half_bytes
                or (vec is not None and not vec.is_contiguous())):
            raise ValueError(f"deepep_ascend.native.IntranodePlan.exchange: {nwords} header words or {vec_bytes} "
                             f"vector bytes (contiguous) do not fit a header of {self.header.size} words and a half of "
                             f"{self.half_bytes} bytes")
        out = np.empty((self.num_ranks, self.out_words), dtype=np.int64)
        status = kernels.in_exchange(self._address, self._header_address, nwords,
                                      None if vec is None else vec.data_ptr(), vec_bytes, counters or None, polls,
                                      out.ctypes.data, self.out_words, self._cols_address, self.cols.size)
        return status, out

    def vectors(self, n: int) -> np.ndarray:
        """Every rank's count vector in its current half (``n`` int32 at ``vec_offset``), as ``[R, n]`` int32
        (``csrc/intranode.c``'s ``deepep_in_vectors``). Read after the exchange that released them.

        Raises:
            ValueError: ``n`` ints pass the half.
        """
        out = np.empty((self.num_ranks, n), dtype=np.int32)
        if kernels.in_vectors(self._address, n, out.ctypes.data):
            raise ValueError(f"deepep_ascend.native.IntranodePlan.vectors: {n} ints at byte {self.vec_offset} pass "
                             f"the half of {self.half_bytes} bytes")
        return out

    def gather(self, offsets, rows: list, first: int, at: list, x: torch.Tensor | None, scales: torch.Tensor | None,
               topk_idx: torch.Tensor | None, topk_weights: torch.Tensor | None, src_idx: torch.Tensor,
               local_experts: tuple[int, int] = (0, 0)) -> list:
        """A dispatch chunk's receive (``csrc/intranode.c``'s ``deepep_in_gather``): for each source ``s`` with
        ``rows[s] > 0`` staged tokens (from token ``first``, the round's first), its tokens routed to this rank
        (its staged mask's column) in ascending order, from output row ``at[s]`` on: the token's ``x`` row (None:
        not gathered), scales, top-k ids and weights into those outputs, and its index ``first + t`` into
        ``src_idx``.

        Args:
            offsets: the byte offsets in a half of the staged ``x``, scales, ids, weights and ``[rows, R]`` bool
                mask (the dispatch regions' ``field_offs``).
            rows, at: ``R`` ints each. first: the chunk's first token (alike for every source).
            x, scales: ``[N, xb]`` / ``[N, sb]`` uint8 (xb, sb: the staged row bytes), contiguous, or None.
            topk_idx, topk_weights: ``[N, k]`` int64 / float32, contiguous, both or neither.
            src_idx: ``[N]`` int32, contiguous.
            local_experts: ``(first, L)``: the ids land as this rank's local ones, ``id - first`` where that lies
                in ``[0, L)``, else -1 with weight 0 (:func:`~deepep_ascend.native.local_experts`); ``L = 0``: as
                staged.
        Returns:
            The rows received from each source (``R`` ints).
        Raises:
            ValueError: an output of another dtype, not contiguous or not of ``N`` rows, or a source's rows that
                would pass row ``N`` (nothing written).
        """
        n = src_idx.size(0)
        _gather_outputs("gather", (x, scales, topk_idx, topk_weights, src_idx))
        g, R = self._ops, self.num_ranks
        g[0, :5] = offsets
        g[1, :R] = rows
        g[3, :R] = at
        a = self._ops_addresses
        k = 0 if topk_idx is None else topk_idx.size(1)
        if kernels.in_gather(self._address, a[0], a[1], first, 0 if x is None else x.size(1),
                             0 if scales is None else scales.size(1), k, None if x is None else x.data_ptr(),
                             None if scales is None else scales.data_ptr(),
                             None if topk_idx is None else topk_idx.data_ptr(),
                             None if topk_weights is None else topk_weights.data_ptr(), src_idx.data_ptr(), a[3], n,
                             a[4], *local_experts):
            raise ValueError(f"deepep_ascend.native.IntranodePlan.gather: the rows routed here from the sources "
                             f"(starting at rows {at}) do not fit {n} output rows")
        return g[4, :R].tolist()

    def dispatch_tail(self, x: torch.Tensor, mask: torch.Tensor, order: list, dst: list, want: list, offsets,
                      ntok: list, at: list, scales: torch.Tensor | None, topk_idx: torch.Tensor | None,
                      topk_weights: torch.Tensor | None, src_idx: torch.Tensor, local_experts: tuple[int, int],
                      starts: list, rcp: torch.Tensor, xdata: int, consumed: int, xdata_need: int, counters: int,
                      polls: int, timed: bool = False) -> tuple[int, list, list]:
        """The rest of a one-round dispatch on the direct path once every rank's counts are exchanged, in one native
        call (``csrc/intranode.c``'s ``deepep_in_dispatch_tail``): :meth:`store` of ``x`` (``order``, ``dst``,
        ``want`` as there), the ``xdata`` slot raised at every peer, :meth:`gather` of every source's chunk 0 without
        ``x`` (``offsets``; ``ntok[s]`` staged tokens each, from output row ``at[s]``), the ``consumed`` slot raised at
        every peer and :attr:`staged` + 1 for every rank, the received rows' channel prefix into ``rcp``
        (:func:`~deepep_ascend.native.recv_channel_prefix` of ``src_idx`` with ``starts``, ``R + 1`` block starts,
        and ``ntok``), then every peer's ``xdata`` word polled up to ``polls`` rounds for ``xdata_need``.
        ``counters``: as in :meth:`signal`, for both slots. ``timed``: time the steps (:attr:`ns`).

        Returns:
            ``(status, got, routed)``: ``got`` the rows gathered from each source, ``routed`` the rows ``mask`` routes
            to each rank; status 0 when done, -1 when a peer's ``xdata`` is still short (the rest done), ``1 + j``
            when ``mask`` routes ``routed[j]`` rows to rank ``j``, not ``want[j]`` (nothing written), ``R + 1`` when
            a source's rows pass the outputs (stored and ``xdata`` raised), ``R + 2`` when the channel prefix was
            refused (all but it and the poll done).
        Raises:
            ValueError: ``x``, ``mask`` or the outputs as :meth:`store` and :meth:`gather` refuse them, ``starts``,
                ``ntok`` or ``rcp`` of another length or kind (nothing written).
        """
        R = self.num_ranks
        n = src_idx.size(0)
        _store_operands("dispatch_tail", x, mask, R, order)
        _gather_outputs("dispatch_tail", (None, scales, topk_idx, topk_weights, src_idx))
        if not (len(starts) == R + 1 and len(ntok) == R and rcp.dtype == torch.int32 and rcp.is_contiguous()
                and rcp.dim() == 2 and rcp.size(0) == R and rcp.size(1) >= 1):
            raise ValueError(f"deepep_ascend.native.IntranodePlan.dispatch_tail: {R + 1} block starts, {R} token "
                             f"counts and rcp [{R}, C >= 1] contiguous int32 expected, got {len(starts)}, "
                             f"{len(ntok)} and {rcp.dtype}{list(rcp.shape)}")
        g = self._ops
        g[0, :5] = offsets
        g[1, :R] = ntok
        g[3, :R] = at
        g[5, :R] = order
        g[6, :R] = dst
        g[7, :R] = want
        g[9, :R + 1] = starts
        xd_sent, xd_addrs, xd_own = self._slot_addresses[xdata]
        cs_sent, cs_addrs, _ = self._slot_addresses[consumed]
        status = kernels.in_dispatch_tail(
            self._address, x.size(0), x.data_ptr(), x.stride(0), x.size(1), mask.data_ptr(), self._ops_table_address,
            xd_sent, xd_addrs, xd_own, xdata_need, cs_sent, cs_addrs, counters or None,
            0 if scales is None else scales.size(1), 0 if topk_idx is None else topk_idx.size(1),
            None if scales is None else scales.data_ptr(), None if topk_idx is None else topk_idx.data_ptr(),
            None if topk_weights is None else topk_weights.data_ptr(), src_idx.data_ptr(), n, *local_experts,
            rcp.size(1), rcp.data_ptr(), polls, self._ns_address if timed else None)
        return status, g[4, :R].tolist(), g[8, :R].tolist()

    def combine(self, offsets, lo: int, mask: torch.Tensor, rows_at: list, ld: list, cap: list, w_at: list, w_ld: list,
                bias0: torch.Tensor | None, bias1: torch.Tensor | None, out: torch.Tensor,
                w_out: torch.Tensor | None, order: torch.Tensor | None = None,
                tail: tuple[int, int, int, int] | None = None, timed: bool = False) -> tuple[int, list, list]:
        """A combine round's receive for this origin's tokens ``[lo, lo + m)`` (``csrc/intranode.c``'s
        ``deepep_in_combine``). Source ``j`` returned the rows of the tokens whose ``mask[t, j]`` is set, in
        ascending order; its count vector (in its current half) must say as many. Its rows are at address
        ``rows_at[j]`` (row stride ``ld[j]`` elements, ``cap[j]`` rows readable there) if nonzero, else staged in
        its half at ``offsets[0]`` after the rows it staged for lower origins; its weight rows likewise (``w_at``,
        ``w_ld``, ``cap``, ``offsets[1]``).

        ``out[t] = bf16(f32(bias0[t]) + f32(bias1[t]) + Σ_j f32(row))`` in ascending ``j`` (a bias None: +0.0),
        one rounding, DeepEP's combine sum; with ``order`` the rows of a token add in ascending
        ``order[lo + t, j]`` instead, ties in ``j`` (``EPBuffer``'s order, :func:`~.rows.sum_rows`'s keys); with
        ``w_out``, ``w_out[t] = +0.0 + Σ_j w`` in ascending ``j``.

        Args:
            offsets: the combine regions' ``field_offs`` (staged rows, staged weights).
            mask: ``[N, R]`` bool, contiguous, ``N >= lo + m`` (the handle's ``is_token_in_rank``).
            rows_at, ld, cap, w_at, w_ld: ``R`` ints each (this rank's own rows must be given: they are not
                staged).
            bias0, bias1: ``[>= m, H]`` bf16 matrices (rows ``lo..`` of the caller's bias), or None.
            order: ``[N, R]`` int64, contiguous, or None.
            out: ``[m, H]`` bf16 matrix. w_out: ``[m, wcols]`` float32, contiguous, or None. Both are written
                without bumping their version counters: the engine's own new outputs, which nothing has read.
            tail: ``(slot, need, counters, polls)`` for a call's last round (``deepep_in_combine_tail``): once summed,
                ``slot`` raised at every peer (``counters`` as in :meth:`signal`) and :attr:`staged` + 1 for every
                rank, then with ``need > 0`` every peer's ``slot`` word polled up to ``polls`` rounds for ``need``.
            timed: with ``tail``, time the steps (:attr:`ns`).
        Returns:
            ``(status, got, want)``: status 0 when done (``got``: the rows of each source); ``j + 1`` when source
            ``j`` returned ``want[j]`` rows but the mask routes ``got[j]``; ``-2 - j`` when source ``j``'s rows would
            lie past ``cap[j]`` or its half (its count vector does not fit this origin's); -1 when the row sum ran
            out of memory. Nothing is written unless the status is 0; with ``tail``, ``R + 1`` when a peer's word is
            still short after the polls (the rest done).
        Raises:
            ValueError: an operand of another dtype or shape (nothing written).
        """
        R = self.num_ranks
        m, hidden = out.shape if out.dim() == 2 else (-1, -1)
        wcols = 0 if w_out is None else w_out.size(1)
        if not (matrix_ok(out, torch.bfloat16) and mask.dtype == torch.bool and mask.is_contiguous()
                and mask.dim() == 2 and mask.size(1) == R and 0 <= lo and lo + m <= mask.size(0)
                and all(b is None or (matrix_ok(b, torch.bfloat16, hidden) and b.size(0) >= m) for b in (bias0, bias1))
                and (w_out is None or (w_out.dtype == torch.float32 and w_out.is_contiguous() and w_out.dim() == 2
                                       and w_out.size(0) == m))
                and (order is None or (order.dtype == torch.int64 and order.is_contiguous()
                                       and order.shape == mask.shape))):
            raise ValueError(f"deepep_ascend.native.IntranodePlan.combine: out [m, H] bf16, mask [N >= {lo} + m, {R}] "
                             f"bool, biases [>= m, H] bf16, w_out [m, wcols] float32 expected, got out "
                             f"{out.dtype}{list(out.shape)}, mask {mask.dtype}{list(mask.shape)}, biases "
                             f"{[None if b is None else (b.dtype, tuple(b.shape)) for b in (bias0, bias1)]}, w_out "
                             f"{None if w_out is None else (w_out.dtype, tuple(w_out.shape))}, order "
                             f"{None if order is None else (order.dtype, tuple(order.shape))}")
        if bias0 is None:  # f32(b1) + 0.0 == 0.0 + f32(b1): the one given bias goes first
            bias0, bias1 = bias1, None
        if self._tokens.size < 2 * R * m:
            self._tokens = np.zeros(max(2 * R * m, 2 * self._tokens.size), dtype=np.int64)
            self._tokens_address = self._tokens.ctypes.data
        g, a = self._ops, self._ops_addresses
        g[0, :len(offsets)] = offsets
        g[5, :R] = rows_at
        g[6, :R] = ld
        g[7, :R] = w_at
        g[8, :R] = w_ld
        g[10, :R] = cap
        b0, b1 = ((None, 0) if b is None else (b.data_ptr(), b.stride(0)) for b in (bias0, bias1))
        args = (self._address, a[0], lo, m, hidden, mask.data_ptr(), a[5], a[6], a[10], wcols, a[7], a[8], *b0, *b1,
                out.data_ptr(), out.stride(0), None if w_out is None else w_out.data_ptr(),
                None if order is None else order.data_ptr(), self._tokens_address, a[4], a[9], NAN_BITS)
        if tail is None:
            status = kernels.in_combine(*args)
        else:
            slot, need, counters, polls = tail
            sent, addrs, own = self._slot_addresses[slot]
            status = kernels.in_combine_tail(*args, sent, addrs, counters or None, own, need, polls,
                                             self._ns_address if timed else None)
        return status, g[4, :R].tolist(), g[9, :R].tolist()

    def stage(self, fields, pieces, vec: np.ndarray | None = None, stream_side: str | None = None) -> None:
        """Rows of each ``(tensor, offset)`` of ``fields`` into this rank's current half from byte ``offset`` on:
        the rows of each ``(lo, hi)`` of ``pieces``, one piece after the other (at most ``max(8, R)`` fields and
        pieces); then
        ``vec`` (int32, contiguous) at ``vec_offset`` (``csrc/intranode.c``'s ``deepep_in_stage``). Each tensor
        must be a 2-D CPU matrix with unit column stride (:func:`~.operands.matrix_ok`; any dtype, any row stride)
        holding every row of the pieces: the caller checks (the engine asks ``matrix_ok`` of its operands and
        stages the others with torch), this method reads them as such. ``stream_side``: a side of
        :func:`~.ll.ll_stream_rows` (``"send"`` for a combine's returned rows) whose mode decides whether the rows
        go by streaming stores (the same bytes), or None (plain stores).

        Raises:
            ValueError: too many fields or pieces, a reversed piece, or a field or ``vec`` past the half (nothing
                written); a ``stream_side`` that is not a side.
        """
        side = stream_side_number("IntranodePlan.stage", stream_side, "stream_side", none_ok=True)
        f, n, k = self._fields, len(fields), len(pieces)
        if n > f.shape[1] or k > f.shape[1] or (vec is not None and not (vec.dtype == np.int32
                                                                         and vec.flags.c_contiguous)):
            raise ValueError(f"deepep_ascend.native.IntranodePlan.stage: at most {f.shape[1]} fields and pieces, and "
                             f"a contiguous int32 vector expected, got {n} fields, {k} pieces, vector "
                             f"{None if vec is None else (vec.dtype, vec.shape)}")
        sizes = [t.element_size() for t, _ in fields]
        f[0, :n] = [t.data_ptr() for t, _ in fields]
        f[1, :n] = [size * t.stride(0) for size, (t, _) in zip(sizes, fields)]
        f[2, :n] = [size * t.size(1) for size, (t, _) in zip(sizes, fields)]
        f[3, :n] = [offset for _, offset in fields]
        f[4, :k] = [lo for lo, _ in pieces]
        f[5, :k] = [hi for _, hi in pieces]
        a = self._fields_addresses
        if kernels.in_stage(self._address, n, a[0], a[1], a[2], a[3], k, a[4], a[5],
                            None if vec is None else vec.ctypes.data, 0 if vec is None else vec.size, side):
            raise ValueError(f"deepep_ascend.native.IntranodePlan.stage: the pieces {list(pieces)} of the fields at "
                             f"offsets {[offset for _, offset in fields]} or the vector pass the half of "
                             f"{self.half_bytes} bytes")

    def store(self, x: torch.Tensor, mask: torch.Tensor, order: list, dst: list, want: list) -> tuple[int, list]:
        """Dispatch's direct stores (``csrc/intranode.c``'s ``deepep_in_store``): for each rank ``j`` with ``dst[j]``
        nonzero, the rows of ``x`` whose ``mask[t, j]`` is set, ascending, from address ``dst[j]`` on (the caller
        checked that the receiver's range holds ``want[j]`` rows); token by token, each row to its receivers in the
        order of ``order`` (a permutation of the ranks), so that ``x`` is read once.

        Args:
            x: ``[n, xb]`` uint8 matrix (unit column stride). mask: ``[n, R]`` bool, contiguous.
            order, dst, want: ``R`` ints each (``order`` each rank once).
        Returns:
            ``(status, got)``: 0 when stored; ``j + 1`` when ``mask`` routes ``got[j]`` rows to ``j``, not ``want[j]``
            (nothing stored).
        Raises:
            ValueError: ``x`` or ``mask`` of another kind or shape, ``order`` not a permutation (nothing stored).
        """
        R = self.num_ranks
        _store_operands("store", x, mask, R, order)
        g, a = self._ops, self._ops_addresses
        g[5, :R] = order
        g[6, :R] = dst
        g[7, :R] = want
        status = kernels.in_store(x.size(0), R, x.data_ptr(), x.stride(0), x.size(1), mask.data_ptr(), a[5], a[6],
                                  a[7], a[4])
        return status, g[4, :R].tolist()
