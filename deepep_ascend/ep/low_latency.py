"""Low-latency (LL) dispatch and combine: DeepEP's fixed-slot, signal-driven mode (docs/semantics/deepep-api.md §6, §7).

Every rank sends straight to the owner of each expert; nothing is exchanged before the data
(no collective, no count round): each sender writes its rows into **fixed slots** of the
receiver's window and then its per-expert **counts** with one **signal**. The receiver waits for
one signal per source, reads the counts and unpacks. Two halves alternate call by call
(docs/semantics/deepep-api.md §6.6); signals only grow (docs/design/transports.md §3.3), so nothing is ever cleaned.

Windows (each rank's segment is node-shared, and world-exposed for RMA with several nodes):

* ``ll`` (``num_rdma_bytes``): half ``h`` at ``h * (num_rdma_bytes // 2)``. A call with
  ``(M, H, E)`` lays a half out exactly as docs/semantics/deepep-api.md §6.8 sizes it, with ``S = ceil(H/128)``,
  ``d = 16 + max(2H, H + 4S)``, ``c = 4S + 2H``:

  ``[sig: align(4E, 128) | send: max(M·d, E·M·c) | recv: E·M·max(d, c)]``

  - *sig*: int32 counts ``[R sources][L local experts]``, each row written by its source;
  - *send*: dispatch: this rank's messages ``[N, d]`` (the FP8 cast done once per token);
    combine: the zero-copy buffer, bf16 ``[L, R·M, H]`` contiguous
    (:meth:`LowLatencyEngine.combine_buffer`);
  - *recv*: dispatch (pushed rows, the torch path; ``Layout.indexed_ok``, flag ``F_INDEXED``): an int32 index
    table ``[L, R, M]``, then from ``index_bytes = align(4·E·M, 64)`` a slot per (source ``s``, token ``t``)
    at ``index_bytes + (s·M + t)·m``, ``m`` = this call's message size (``<= d``): ``s`` writes each token it
    sends here once, and for the ``i``-th pair of local expert ``e`` the token at ``(e·R + s)·M + i`` of the
    table (fits when ``E > R`` but for tiny calls; where it does not, as with ``E == R``, whose tokens meet each
    rank's single expert once anyway, a fixed slot of ``M`` messages per (local expert ``e``, source ``s``) at
    ``((e·R + s)·M)·m`` serves instead); the
    native path's index table only (below); combine: a fixed slot of ``M`` bf16 rows per
    global expert ``g`` at ``g·M·2H`` (rows in the order the receiver sent them: tokens, then top-k slots); combine
    with ``use_logfmt`` (``H % 128 == 0``, :func:`~deepep_ascend.gemm.logfmt.logfmt10_encode`'s wire
    format): three regions ``[meta: E·M·4S | body: E·M·160S | tail: E·M·S·96]`` holding the
    same fixed slots, row ``(g, i)``'s metadata at ``(g·M + i)·4S`` of the first, its body at
    ``(g·M + i)·160S`` of the second, and slot ``g``'s BF16-group tails packed (rows, then
    groups) from ``g·M·S·96`` of the third. A row sends ``1.25H + H/32`` bytes (docs/semantics/deepep-api.md §11) plus
    96 per group that falls back to BF16; the regions total ``E·M·c`` with ``c = 4S + 2H``, the
    hint's combine message, which is what rows whose groups all fall back fill: the hint covers
    any data and nothing more.

  A message is ``[int32 source token index | 12 zero bytes | payload]``, payload bf16 ``2H`` B,
  or FP8 ``H`` B + scales (``4S`` B float32, or ``H/128`` B packed UE8M0).
* ``ll_ctl`` (``2·R·256`` B, independent of the call): one 256-byte header per (half, source):
  call number, operation, status, ``M``, ``H``, ``E``, FP8 flags and, for a refused call, the
  refusing rank's message. Signal slots ``0``/``1`` (one per half) and ``2`` (clean's barrier).
  A source's word in slot ``h`` reads ``k + 1`` once it has published LL call ``k`` (call numbers are the
  same on every rank), its word in slot ``2`` the number of its last clean: a value, not a count of
  signals, so a call that skipped a masked peer leaves nothing for the pair to make up once it is
  unmasked (shrink mode, docs/api/low-latency.md).

Ordering: data and count puts, then (URMA) ``flush(dst)``, then the header with
``put_with_signal`` on ``ll_ctl`` — an observer of the signal sees all of it. Same-node
peers are written with direct stores into their mapped window when ``allow_ubmem`` (DeepEP's
``allow_nvlink_for_low_latency_mode``), else through ``put`` like remote peers.

Double buffer safety: a rank issues call ``k+1`` only after its receive of call ``k`` (the
hook rule); every call signals every (unmasked) peer; so a peer writing half ``k % 2`` again
(call ``k+2``) has received call ``k+1`` from this rank, which this rank sent after finishing
its receive of call ``k``.

Native dispatch (every live peer mapped): rows are not pushed. Each sender stages its messages once in
its send region and writes only each routed token's index into the destinations' index tables (int32
``[L, R, M]`` at the start of *recv*) and the counts; each receiver loads its rows from the sources' send
regions. Every call first stamps its half (call number + 1, bytes 24-31 of the rank's own ``ll_ctl``
header of that half); a receiver reads each source's stamp after its loads and refuses the rows if it
moved (a seqlock against a third call in flight; docs/design/data-path.md, "Native dispatch").

Native zero-copy combine (every live peer mapped, ``zero_copy=True``, ``Layout.can_pull``: ``M·S >= 2``,
and ``E·M·H % 4 == 0`` when ``M·S == 2``): rows are not pushed either. The experts' outputs already lie in
the sender's send region; the sender publishes its ``layout_range`` (int64 ``[L, R]``) right after them
(send-region offset ``E·M·2H`` rounded up to 8 bytes, inside its ``E·M·c`` bytes), writes the counts and
flags its header ``F_PULL``; each receiver sums its rows straight from the sources' send regions and then
checks their stamps, as the dispatch does. A source's choice is its own: one call may mix pushed and pulled
sources.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import math
import mmap
import struct
import time
import warnings
import weakref
from typing import NamedTuple

import numpy as np
import torch

from .. import native, settings
from ..gemm.fp8 import low_latency_cast_to_fp8_
from ..gemm.logfmt import (
    LOGFMT_BODY_BYTES,
    LOGFMT_META_BYTES,
    LOGFMT_TAIL_BYTES,
    logfmt10_decode,
    logfmt10_encode,
    logfmt10_group_mask,
)
from ..gemm.scales import pack_ue8m0_to_int
from ..native.operands import mark_written
from ..ordering import stable_argsort
from ..rounding import align, ceil_div
from ..transports import CALL_CHECK_S, ChannelKind, TransportTimeout
from . import memory
from .handles import LowLatencyHandle
from .phases import RECORDER as _PH
from .protocol import ConsensusError, ordinal, sequence_problem
from .rows import INT_OF_WIDTH, common_width, wide, zero_rows
from .stamps import stamp, stamp_matches

OP_DISPATCH, OP_COMBINE = 1, 2
OP_NAMES = {OP_DISPATCH: "low_latency_dispatch", OP_COMBINE: "low_latency_combine"}
SLOT_CLEAN = 2
NUM_CTL_SLOTS = 3
HDR_BYTES = 256
#: Polls of the short wait (native.ll_await, a pause each: about 0.1 ms) before the long one (transports' wait_until).
_AWAIT_POLLS = 2000
_HDR_WORDS = 3  # int64 words of a header without a message: call/op/flags/status, M/E/H, the op's count
# Bytes [24, 32) of a rank's own header slot of half h in its own ll_ctl: its send-region stamp (see begin).
_STAMP_OFF = 24
_MSG_OFF = 32
MSG_HEADER = 16  # bytes before the payload in a dispatch message
F_FP8, F_UE8M0, F_LOGFMT, F_PULL, F_INDEXED = 1, 2, 4, 8, 16
#: Largest ``num_max_dispatch_tokens_per_rank`` (DeepEP: ``nvshmem_qp_depth / 2 - 1``,
#: docs/semantics/deepep-api.md §6.7).
QP_DEPTH = 1024


def size_hint(m: int, hidden: int, num_ranks: int, num_experts: int) -> int:
    """docs/semantics/deepep-api.md §6.8, exactly:
    bytes of ``num_rdma_bytes`` a call with ``(M, H, E)`` needs (``R`` unused).

    ``S = ceil(H/128)`` (= ``H/128`` for DeepEP's sizes), ``d = 16 + max(2H, H + 4S)``,
    ``c = 4S + 2H``; ``send = max(M·d, E·M·c)``, ``recv = E·M·max(d, c)``,
    ``sig = align(4E, 128)``; ``total = 2(send + recv + sig)``; ``(total // 128 + 1)·128``.
    """
    s = ceil_div(hidden, 128)
    d = 16 + max(2 * hidden, hidden + 4 * s)
    c = 4 * s + 2 * hidden
    send = max(m * d, num_experts * m * c)
    recv = num_experts * m * max(d, c)
    sig = align(4 * num_experts, 128)
    total = 2 * (send + recv + sig)
    return (total // 128 + 1) * 128


class Layout:
    """Byte layout of one half for a call with ``(M, H, E)`` on ``R`` ranks (see the module doc)."""

    def __init__(self, m, hidden, num_experts, num_ranks):
        self.M, self.H, self.E, self.R = m, hidden, num_experts, num_ranks
        self.L = num_experts // num_ranks
        self.S = ceil_div(hidden, 128)
        self.d = MSG_HEADER + max(2 * hidden, hidden + 4 * self.S)
        self.c = 4 * self.S + 2 * hidden
        self.sig = align(4 * num_experts, 128)
        self.send_off = self.sig
        self.recv_off = self.sig + max(m * self.d, num_experts * m * self.c)
        self.end = self.recv_off + num_experts * m * max(self.d, self.c)
        # A zero-copy combine's published layout_range, after the [L, R·M, H] rows in the send region (whose
        # E·M·c bytes leave E·M·4S past them): room for 8E bytes when M·S >= 2, but int64 words need an 8-byte
        # boundary, which odd sizes push past the region when M·S == 2 (E·M·H % 4 != 0).
        self.pull_off = self.send_off + align(num_experts * m * 2 * hidden, 8)
        self.can_pull = m * self.S >= 2 and self.pull_off + 8 * num_experts <= self.recv_off
        # The native kernels view the recv region as int32 (the dispatch's index table): odd sizes (tiny or odd H,
        # when M·d outgrows E·M·c) leave it off a 4-byte boundary, and such calls take the torch path.
        self.native_ok = self.recv_off % 4 == 0
        # The torch path's indexed dispatch: the index table, then M messages per source (each token once per
        # destination rank, whatever number of its experts live there). It fits but where E == R (one expert per
        # rank: a token goes to a rank once anyway) or the call is tiny; the fixed slots serve those.
        self.index_bytes = align(4 * num_experts * m, 64)
        self.indexed_ok = (self.native_ok
                           and self.index_bytes + num_ranks * m * self.d <= num_experts * m * max(self.d, self.c))
        # LogFMT combine (H % 128 == 0): [meta E·M·4S | body E·M·160S | tail E·M·S·96] = E·M·c bytes.
        self.lf_meta, self.lf_body, self.lf_tail = (LOGFMT_META_BYTES * self.S, LOGFMT_BODY_BYTES * self.S,
                                                    LOGFMT_TAIL_BYTES * self.S)  # per row
        self.lf_body_off = num_experts * m * self.lf_meta
        self.lf_tail_off = self.lf_body_off + num_experts * m * self.lf_body
        self.lf_end = self.lf_tail_off + num_experts * m * self.lf_tail


def zeros(shape, dtype) -> torch.Tensor:
    """Zero-filled tensor; large ones from an anonymous mapping, so untouched pages cost nothing.

    LL outputs (``[L, R·M, H]``) are mostly padding: zeroing them would cost more than the call.
    """
    shape = torch.Size(shape)
    nbytes = shape.numel() * dtype.itemsize
    if nbytes < (1 << 20):
        return torch.zeros(shape, dtype=dtype)
    # A tensor on the mapping's storage, not a view of the uint8 one: a view keeps its base alive
    # (``_base``), so the storage would always look shared and OutputPool would never reuse it.
    storage = torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).untyped_storage()
    return torch.empty(0, dtype=dtype).set_(storage, 0, shape)


class OutputPool:
    """Reuses the storage of LL outputs the caller has dropped: the CPU stand-in for PyTorch's
    CUDA caching allocator, which makes DeepEP's fresh ``[L, R·M, H]`` outputs free on a GPU.

    Here a fresh output costs a page fault per 4 KiB it touches (the zero-filled padding is
    never touched); a recycled one is handed out unzeroed, with the rows its last user wrote, for its
    writer to zero those it does not write again. An entry is reused only when no tensor (the returned
    view or any view of it) still shares its storage, so results a caller keeps are never overwritten,
    and only when its writer reported its rows (:meth:`written`) and nothing wrote into it since, as its
    version counter says: a write torch does not count (through ``.numpy()``, ``.data``, or a dtype view
    made under ``torch.inference_mode()``) is not seen (docs/semantics/deepep-api.md §6.2).
    """

    MAX_PER_KEY = 4

    def __init__(self):
        # (shape, dtype) -> list of [base tensor, rows written, version]; rows written: None (not reported) or
        # [L] int32 counts, rows [0, count[e]) of each block e; version: the base's version counter when reported
        self._entries = {}

    @staticmethod
    def written(ent: list, counts: torch.Tensor) -> None:
        """Record on ``ent`` (an entry :meth:`get` returned) that its writer wrote rows ``[0, counts[e])`` of each
        block ``e`` (``[L]`` int32, kept: not to be changed afterwards). A later write by the caller through any
        view of the output (DeepEP's outputs are the caller's to overwrite) moves the version counter, and the
        output is then not handed out again."""
        ent[1] = counts
        ent[2] = ent[0]._version

    @memory.outside_inference_mode
    def get(self, shape, dtype, channels_first=False) -> tuple[torch.Tensor, list, torch.Tensor | None]:
        """``(view, entry, stale)``: a tensor of ``shape`` ``[L, rows, ...]`` (``channels_first``: stored as
        ``[L, S, rows]`` and returned transposed to ``[L, rows, S]``), zero but for rows ``[0, stale[e])`` of
        each block ``e`` when ``stale`` (``[L]`` int32) is not None: a reused output, whose writer must zero
        the rows of them it does not write (the native dispatch receive does, in its pass; the torch path's
        after it, :func:`_zero_stale_rows`), then report its own rows with :meth:`written`."""
        store = (shape[0], shape[2], shape[1]) if channels_first else tuple(shape)
        entries = self._entries.setdefault((store, dtype), [])
        # Dropped by the caller, and either its writer never reported (a failed call) or the caller wrote into it
        # since (any rows): not handed out again. Zeroing it whole would touch every page of a mostly untouched
        # mapping; a new one costs nothing until written.
        kept, ent = [], None  # (one pass, one use count per entry: this runs on every call)
        for e in entries:
            if memory.storage_users(e[0]) != 1:
                kept.append(e)
            elif e[1] is not None and e[0]._version == e[2]:
                kept.append(e)
                ent = ent or e
        entries[:] = kept
        stale = None if ent is None else ent[1]
        if ent is None:
            ent = [zeros(store, dtype), None, 0]
            if memory.storage_users(ent[0]) == 1:
                entries.append(ent)
                if len(entries) > self.MAX_PER_KEY:
                    entries.pop(0)
        ent[1] = None  # until the writer reports its rows
        view = ent[0].transpose(1, 2) if channels_first else ent[0][:]
        return view, ent, stale


class _Route(NamedTuple):
    """A dispatch's (token, slot) pairs of live experts, grouped by expert (tokens, then slots, ascending)."""

    experts: torch.Tensor  # [P] int64, ascending: each pair's expert
    flat: torch.Tensor  # [P] int64: each pair's flat index token·K + slot into topk_idx
    tokens: torch.Tensor  # [P] int64: each pair's token
    rank: torch.Tensor  # [P] int64: each pair's row among its expert's pairs (its slot row)
    counts: torch.Tensor  # [E] int64 pairs per expert
    starts: torch.Tensor  # [E] int64 first pair of each expert
    counts32: torch.Tensor  # counts as int32 (the count vectors sent)


class NativeRoute(NamedTuple):
    """A call's route as :func:`deepep_ascend.native.ll_route` computes it (the native path's): independent of the
    shrink mask (a masked rank's experts are skipped where the route is used)."""

    counts: torch.Tensor  # [E] int32 selections per expert
    slots: torch.Tensor  # [N, K] int64: e·M + the pair's row among expert e's pairs (tokens, then slots), or -1
    m: int  # the M the slots are numbered with


class _DispatchCall(NamedTuple):
    """A dispatch whose sends are issued: what its receive needs."""

    seq: int  # LL call number (0 for the first; messages count from 1)
    half: int  # window half (and signal slot) of the call
    need: int  # value every live source's signal reaches (seq + 1)
    lay: Layout
    flags: int
    message_bytes: int  # bytes per message (slot stride)
    scale_bytes: int  # bytes of FP8 scales per message (0: BF16)
    recv_x: torch.Tensor  # [L, R·M, H]
    recv_scales: torch.Tensor | None  # [L, R·M, S'] channels-first
    src_info: torch.Tensor  # [L, R·M] int32
    recv_count: torch.Tensor  # [L] int32
    layout_range: torch.Tensor  # [L, R] int64
    written: tuple  # OutputPool entries of recv_x, recv_scales (or None), src_info
    route: _Route  # the sends' route, for the combine of this dispatch's handle
    route_stamp: tuple  # stamps.stamp of (topk_idx, mask) when the route was computed
    plan: native.LLPlan | None = None  # the fused path's plan (_fused_plan), None on the step-by-step path


class LowLatencyRefused(ConsensusError):
    """The call completed its signals but was refused: a rank rejected its arguments, ranks
    disagree on ``M``/``H``/``E``/FP8 flags, or counts do not match the handle. The Buffer
    stays usable (every rank consumed the same call)."""


class Pending:
    """An LL call whose sends are issued; :meth:`receive` waits for the sources and unpacks."""

    def __init__(self, receive, outputs):
        self._receive = receive
        self.outputs = outputs

    def receive(self) -> tuple:
        fn, self._receive = self._receive, None
        fn()
        return self.outputs


class LowLatencyEngine:
    """Runs LL calls for one Buffer.

    Args:
        tp: the transport. nbytes: ``num_rdma_bytes`` (the ``ll`` window).
        allow_ubmem: same-node peers by direct stores (else ``put``).
        shrink: mask peers that miss the deadline instead of raising.
    """

    def __init__(self, tp, nbytes: int, allow_ubmem: bool, shrink: bool):
        topo = tp.topology
        self.tp = tp
        self.rank, self.R = topo.rank, topo.world_size
        # Without allow_ubmem, node peers go over URMA too (DeepEP's LL mode without NVLink).
        self.win = tp.create_window("ll", nbytes, 0, force_urma=not allow_ubmem)
        self.ctl = tp.create_window("ll_ctl", 2 * self.R * HDR_BYTES, NUM_CTL_SLOTS, force_urma=not allow_ubmem)
        self.nbytes = nbytes
        self.half = nbytes // 2
        self.kinds = [tp.channel_kind(self.win, p) for p in range(self.R)]
        self.direct = [k is not ChannelKind.URMA for k in self.kinds]  # load/store reach: SELF, UBMEM
        self.shrink = shrink
        self.mask = torch.zeros(self.R, dtype=torch.int32)
        self.calls = 0  # LL data calls issued (dispatch, combine, refused ones); same on every rank
        self.op_calls = {OP_DISPATCH: 0, OP_COMBINE: 0}  # this rank's calls of each (header word 2)
        self.cleans = 0  # clean_low_latency_buffer calls; same on every rank
        self._sent = {}  # (ctl slot, dst) -> the signal value last published to dst
        self._peer_cache = None  # (mask version, masked bools, order, live peers, any masked, order array), _peers
        # The native path (every live peer mapped, kernels loaded): each rank's window data region by address
        # (0: not mapped), window views kept across calls (released by release()), rows sent per destination.
        self._bases = torch.tensor([tp.peer_view(self.win, p, 0, nbytes).data_ptr() if self.direct[p] else 0
                                    for p in range(self.R)], dtype=torch.int64)
        # Each mapped source's send-region stamp of half h (0: not mapped), read by the dispatch receive's seqlock.
        ctl_bases = [tp.peer_view(self.ctl, p, 0, 2 * self.R * HDR_BYTES).data_ptr() if self.direct[p] else 0
                     for p in range(self.R)]
        self._stamps = [torch.tensor([b + (h * self.R + p) * HDR_BYTES + _STAMP_OFF if b else 0
                                      for p, b in enumerate(ctl_bases)], dtype=torch.int64) for h in (0, 1)]
        self._all_direct = all(self.direct)
        # Signals by stores where every rank is mapped and the kernels are loaded (native.ll_publish, ll_await):
        # per half, each destination's header slot and signal word by address, and this rank's own signal words.
        # Decided once, so that this engine stays the only writer of those words (transports' signal_address).
        self._store_signals = None
        if self._all_direct and native.signals_available():
            self._store_signals = tuple(
                (torch.tensor([b + (h * self.R + self.rank) * HDR_BYTES for b in ctl_bases], dtype=torch.int64),
                 torch.tensor([tp.signal_address(self.ctl, p, h) for p in range(self.R)], dtype=torch.int64),
                 tp.signal_words_address(self.ctl, h)) for h in (0, 1))
            # polls of a short wait before the long one (none where ranks outnumber cores: never spin there)
            self._await_polls = 0 if tp.wait_policy.oversubscribed else _AWAIT_POLLS
        # The fused path (native.LLPlan): each call's steps in two native calls, issue and finish; plans by (M, H, E)
        self._fusable = self._store_signals is not None and native.fused_available() and settings.LL_FUSED.get()
        self._plans = {}
        self._views = memory.ViewCache(64 + 2 * self.R)
        self._sent_rows = torch.zeros(self.R, dtype=torch.int64)
        self._no_stamps = torch.zeros(self.R, dtype=torch.int64)  # pushed rows: no source's stamp to check
        self._hdr_words = np.zeros(_HDR_WORDS, dtype=np.int64)  # see _header
        self._hdr_bytes = torch.from_numpy(self._hdr_words).view(torch.uint8)
        self.pending_hook = None  # call number awaiting its hook
        self.zero_copy_for = None  # call number the last combine_buffer() view belongs to
        self.zero_copy_shape = None  # and the (M, H, E) it was laid out for
        self.pool = OutputPool()
        self.combined_pool = memory.OutputPool()  # combined_x: its storage reused once the caller drops it
        self._scratch_bufs = {}  # name -> flat tensor, see _scratch
        # The last received dispatch: stamps of (topk_idx, mask) at its route, of its handle's
        # tensors after its receive, its (M, H, E) and route; see dispatched_route.
        self._dispatched = None
        # The last dispatches' topk_idx (copies), by their handle's src_info; see dispatched_topk_idx.
        self._dispatched_idx = collections.OrderedDict()

    # -- helpers -----------------------------------------------------------------------
    def _peers(self) -> tuple:
        """``(mask version, masked bools, order, live peers, any masked)``, read again only after a write to
        ``mask`` (its version counter moves; a torch read per peer per call costs more than the rest of a small
        call's bookkeeping)."""
        cached = self._peer_cache
        if cached is None or cached[0] != self.mask._version:
            masked = [bool(v) for v in self.mask.tolist()]
            order = [p for p in ((self.rank + i) % self.R for i in range(1, self.R + 1)) if not masked[p]]
            cached = self._peer_cache = (self.mask._version, masked, order, [p for p in range(self.R) if not masked[p]],
                                         any(masked), torch.tensor(order, dtype=torch.int64))
        return cached

    def live_peers(self) -> list[int]:
        return self._peers()[3]

    def order(self) -> list[int]:
        """Destinations starting after this rank (spreads the load), masked ones left out."""
        return self._peers()[2]

    def masked(self) -> list[bool]:
        """``mask`` as Python bools."""
        return self._peers()[1]

    def _mask_arg(self) -> torch.Tensor | None:
        """``mask`` for a native kernel: None when no rank is masked."""
        return self.mask if self._peers()[4] else None

    def _view(self, key: tuple, make) -> torch.Tensor | np.ndarray:
        """A window view (a tensor, or a numpy array on one) kept across calls under ``key`` (``make()`` builds it
        once); :meth:`release` drops them."""
        return self._views.get(key, make)

    def _counts_view(self, base: int, L: int) -> torch.Tensor:
        """int32 ``[R, L]`` view of the count words of the half at ``base`` (source-major)."""
        return self._view(("sig", base, L),
                          lambda: self.tp.local_view(self.win, base, 4 * L * self.R, torch.int32).view(self.R, L))

    def release(self) -> None:
        """Drop the window views and plans kept across calls (before the windows are freed)."""
        self._views.clear()
        self._plans.clear()

    def _fused_plan(self, lay: Layout, cost) -> native.LLPlan | None:
        """The plan of calls of ``lay``'s shape when this call may take the fused path (native.LLPlan: signals by
        stores, no rank masked, no shrink mode, no wait-time statistics ``cost``, no link emulation), else None.
        Built on first use and kept (a few per buffer: shapes that keep changing start the cache over)."""
        if (not self._fusable or cost is not None or self.shrink or self._peers()[4]
                or self.tp.stats.emulator is not None):
            return None
        key = (lay.M, lay.H, lay.E)
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= 8:
                self._plans.clear()
            stores = self._store_signals
            plan = self._plans[key] = native.LLPlan(
                num_ranks=self.R, num_local=lay.L, m=lay.M, hidden=lay.H, me=self.rank, bases=self._bases.tolist(),
                order=self.order(), recv_off=lay.recv_off, send_off=lay.send_off, pull_off=lay.pull_off,
                hdr_words=HDR_BYTES // 8, counters=self.tp.traffic_counter_addresses(),
                halves=[(h * self.half, self._stamps[h].tolist(), stores[h][0].tolist(), stores[h][1].tolist(),
                         stores[h][2], self._header_rows(h).data_ptr()) for h in (0, 1)])
        return plan

    def native_path(self) -> bool:
        """Whether calls take the native path: the kernels are loaded and every rank is mapped (one node with
        ``allow_ubmem``), masked or not; else the torch path (URMA peers, or ``DEEPEP_ASCEND_NATIVE=0``).

        Masks do not count: the two paths lay out a half's receive region differently (an index table of
        int32 entries, or message slots), and a peer that unmasked this rank may already be writing its
        next call into the half this rank still uses with the peer masked. With one path per topology each
        source's writes stay inside its own slots (docs/semantics/deepep-api.md §7)."""
        return self._all_direct and native.ll_available()

    def dispatched_route(self, topk_idx, handle) -> _Route | NativeRoute | None:
        """The route of the last received dispatch when ``topk_idx`` is the very tensor that dispatch took and
        ``handle`` holds the very tensors it returned (none written since, same ``M``/``H``/``E``) and the
        mask is unchanged since its route: a combine of that dispatch may then skip re-validating them and
        reuse its route. None otherwise (any object: never raises)."""
        d = self._dispatched
        if d is None or not isinstance(handle, (tuple, list)) or len(handle) != 5:
            return None
        stamped, mhe, route = d
        if not stamp_matches(stamped, topk_idx, self.mask, handle[0], handle[1]):
            return None
        return route if all(type(v) is int for v in handle[2:]) and tuple(handle[2:]) == mhe else None

    def fits(self, lay: Layout) -> bool:
        return lay.end <= self.half

    def combine_buffer(self, lay: Layout) -> torch.Tensor:
        """bf16 ``[L, R·M, H]`` view of the send region of the half the next call uses (stamped for that call:
        the caller writes it before the call begins).

        With the previous call's hook pending on the native path, first waits until every live peer has issued
        that call: a peer may still be loading the call before it (same half) from this send region, and is
        done once it has issued the next one (the hook rule).

        Raises:
            transports.TransportTimeout: (not in shrink mode) a peer did not issue that call by the deadline.
        """
        h = self.calls % 2
        if self.pending_hook is not None and self.native_path():
            seq = self.pending_hook
            self._wait_sources(seq % 2, seq + 1, f"get_next_low_latency_combine_buffer: peers issuing LL call "
                               f"#{seq + 1} (their loads from this half are done then)", None)
        self.zero_copy_for = self.calls
        self.zero_copy_shape = (lay.M, lay.H, lay.E)
        self._stamp(h, self.calls + 1)
        return self.tp.local_view(self.win, h * self.half + lay.send_off, lay.L * self.R * lay.M * 2 * lay.H,
                                  torch.bfloat16).view(lay.L, self.R * lay.M, lay.H)

    def stale_zero_copy(self, handle=None) -> str | None:
        """Why a zero-copy combine of ``handle`` issued now would not find the caller's data (None: it would): no
        buffer handed out for this call, or one laid out for another handle's ``(M, H, E)`` (its rows then lie
        elsewhere in the send region)."""
        if self.zero_copy_for == self.calls:
            shape = tuple(handle[2:5]) if isinstance(handle, (tuple, list)) and len(handle) == 5 else None
            if shape is None or shape == self.zero_copy_shape:
                return None
            return (f"low_latency_combine(zero_copy=True): the buffer from get_next_low_latency_combine_buffer was "
                    f"laid out for a handle of (M, H, E) = {self.zero_copy_shape}, but this combine's handle has "
                    f"{shape}; get the buffer with the handle the combine passes")
        if self.zero_copy_for is None:
            return (f"low_latency_combine(zero_copy=True) is LL call #{self.calls + 1}, but no buffer was handed out "
                    f"for it: call get_next_low_latency_combine_buffer(handle) and write the experts' outputs into it "
                    f"first (its send region holds nothing of this call)")
        return (f"low_latency_combine(zero_copy=True) is LL call #{self.calls + 1}, but the buffer from "
                f"get_next_low_latency_combine_buffer was handed out for call #{self.zero_copy_for + 1} (another LL "
                f"call ran in between, so that data is in the other half); get the buffer right before the combine")

    def _header(self, seq, op, status, lay, flags, message=None, handle_id=0):
        """The call's header as uint8 bytes (built in Python: the same for every destination, no torch op).
        Without a message, the engine's one header buffer, rewritten by the next call (every put of it
        completes before the call returns). ``handle_id``: a combine's :meth:`handle_id` (0: not known)."""
        words = ((seq << 16) | (flags << 8) | (op << 4) | status,
                 ((lay.M & 0xFFFF) | ((lay.E & 0xFFFF) << 16) | (lay.H << 32)) if lay is not None else 0,
                 self.op_calls[op] | (handle_id << 32))  # word 2: errors name each rank's call by its low half
        if not message:
            self._hdr_words[:] = words
            return self._hdr_bytes
        raw = bytearray(HDR_BYTES)
        struct.pack_into("<3q", raw, 0, *words)
        text = message.encode("utf-8")[:HDR_BYTES - _MSG_OFF - 1]
        raw[_MSG_OFF:_MSG_OFF + len(text)] = text
        return torch.frombuffer(raw, dtype=torch.uint8)

    def _raise_to(self, slot, dst, value) -> int:
        """What to add to ``dst``'s word ``slot[me]`` so that it reads ``value`` (the last value sent there
        is kept per destination: a call that skipped a masked ``dst`` left its word behind)."""
        add = value - self._sent.get((slot, dst), 0)
        self._sent[(slot, dst)] = value
        return add

    def _publish(self, h, hdr, seq, dsts) -> None:
        """Publish call ``seq`` to every rank of ``dsts`` (a list; all of :meth:`order` when it is that list): as
        :meth:`_signal` to each, with signals by stores in one native call (header stores, one fence, signal
        stores) where the engine has them."""
        stores = self._store_signals
        if stores is None:
            remote = []
            for dst in dsts:
                if self.kinds[dst] is ChannelKind.URMA:
                    remote.append(dst)
                else:
                    self._signal(dst, h, hdr, seq)
            if remote:  # every rank over URMA in one flush and one batch of signals (each waits on its own)
                if _PH.on:
                    _PH.switch("signal")
                self.tp.flush()
                off = (h * self.R + self.rank) * HDR_BYTES
                self.tp.put_with_signal_many(self.ctl, remote, [off] * len(remote), hdr, h,
                                             [self._raise_to(h, dst, seq + 1) for dst in remote])
            return
        if _PH.on:
            _PH.switch("signal")
        peers = self._peers()
        order = peers[5] if dsts is peers[2] else torch.tensor(dsts, dtype=torch.int64)
        hdr_addrs, sig_addrs, _ = stores[h]
        if not native.ll_publish(order, hdr, hdr_addrs, sig_addrs, seq + 1):
            raise RuntimeError(f"rank {self.rank}: the native kernel ll_publish is no longer loaded (it was when "
                               f"this Buffer was made, and its signals need it)")
        tp, nbytes = self.tp, hdr.numel()
        for dst in dsts:
            tp.record_put(dst, nbytes)
            tp.record_signal(dst)

    def _signal(self, dst, h, hdr, seq):
        """Publish call ``seq`` to ``dst``: everything written to it before, then the header, then the
        signal, which then reads ``seq + 1`` (see :meth:`_wait_sources`)."""
        if self._store_signals is not None:
            self._publish(h, hdr, seq, [dst])
            return
        if _PH.on:
            _PH.switch("signal")
        if self.direct[dst] and hdr is self._hdr_bytes:  # a store into the mapped header, then the signal
            # (numpy: a 24-byte store costs a tenth of a torch copy_)
            self._view(("hdr_out", dst, h), lambda: self.tp.peer_view(
                self.ctl, dst, (h * self.R + self.rank) * HDR_BYTES, _HDR_WORDS * 8, torch.int64).numpy())[:] = \
                self._hdr_words
            self.tp.record_put(dst, _HDR_WORDS * 8)
            self.tp.signal(self.ctl, dst, h, add=self._raise_to(h, dst, seq + 1))  # ordered: after every store
            return
        if self.kinds[dst] is ChannelKind.URMA:
            self.tp.flush(dst)
        self.tp.put_with_signal(self.ctl, dst, (h * self.R + self.rank) * HDR_BYTES, hdr, h,
                                add=self._raise_to(h, dst, seq + 1))

    def begin(self, op: int) -> tuple[int, int]:
        """Number and half of a new call of ``op`` (checks the hook rule first)."""
        if self.pending_hook is not None:
            raise RuntimeError(
                f"rank {self.rank}: LL call #{self.pending_hook + 1} still awaits its receive hook; call the hook "
                f"before issuing another low-latency call (only two LL buffers: receive k, then issue k+1, "
                f"docs/semantics/deepep-api.md §6.6)")
        seq = self.calls
        self.calls += 1
        self.op_calls[op] += 1
        self._stamp(seq % 2, seq + 1)
        return seq, seq % 2

    def _stamp(self, h: int, value: int) -> None:
        """Stamp this rank's send region of half ``h`` with ``value`` (call number + 1) before anything rewrites
        it: a receiver loading rows from it checks the stamp after its loads (the seqlock of
        :meth:`_receive_dispatch_native`). Stores stay in program order (TSO), so the stamp lands first."""
        words = self._view(("stamp",), lambda: self.tp.local_view(self.ctl, 0, 2 * self.R * HDR_BYTES,
                                                                  torch.int64).numpy())
        words[((h * self.R + self.rank) * HDR_BYTES + _STAMP_OFF) // 8] = value

    def reject(self, op, message) -> None:
        """Refuse a call on every rank: headers with an error status to every live peer, then wait for theirs
        (the caller raises; the peers' :meth:`_check_headers` raise ``LowLatencyRefused`` naming this rank)."""
        seq, h = self.begin(op)
        hdr = self._header(seq, op, 1, None, 0, message)
        self._publish(h, hdr, seq, self.order())
        # Wait for the others' signals too (their data is discarded): the double-buffer rule
        # needs this rank's next call to follow its receive of this one.
        self._wait_sources(h, seq + 1, f"{OP_NAMES[op]} call #{seq + 1} (refused here)", None)

    # -- waiting -----------------------------------------------------------------------
    def _wait_sources(self, slot, need, phase, cost, peers=None):
        """Wait until ``slot`` holds ``need`` from every live source (or ``peers``); shrink mode masks late ones.

        ``cost`` (``[R]`` int64 or None) += nanoseconds from the start of the wait until each
        source's signal was observed (granularity: one polling slice, at most 1 ms).
        Raises:
            transports.TransportTimeout: (not in shrink mode) naming the ranks past the deadline.
        """
        pending = self.live_peers() if peers is None else [p for p in peers if not self.masked()[p]]
        if cost is None and not self.shrink:  # one wait: no slicing overhead
            if pending:
                self.tp.wait_until(self.ctl, slot, pending, need, phase=phase)
            return
        t0 = time.monotonic_ns()
        timeout = self.tp.timeout_s
        slice_s = 2e-4
        next_tag_check = CALL_CHECK_S
        while pending:
            waited = (time.monotonic_ns() - t0) / 1e9
            if waited >= next_tag_check:  # (each slice is too short for the wait's own look at the ranks' calls)
                next_tag_check = waited + CALL_CHECK_S
                self.tp.check_call_tags(phase)
            left = timeout - waited
            if left <= 0:
                if self.shrink:
                    warnings.warn(f"rank {self.rank}: {phase}: rank(s) {pending} missed the {timeout:g} s deadline; "
                                  f"masked (shrink mode)", RuntimeWarning, stacklevel=3)
                    self.mask[pending] = 1
                    return
                observed = [self.tp.read_signal(self.ctl, slot, p) for p in pending]
                raise TransportTimeout("wait_until", self.rank, pending, (time.monotonic_ns() - t0) / 1e9,
                                       phase=phase, window=self.ctl.name, slot=slot, expected=[need] * len(pending),
                                       observed=observed)
            still = self.tp.wait_until(self.ctl, slot, pending, need, timeout_s=min(slice_s, left), phase=phase,
                                       on_timeout="return")
            if cost is not None:
                arrived = [p for p in pending if p not in still]
                if arrived:
                    cost[arrived] += time.monotonic_ns() - t0
            pending = still
            slice_s = min(2 * slice_s, 1e-3)

    def _await_call(self, h, seq, op, lay, flags, phase, cost) -> list[int]:
        """Wait for every live source's signal of call ``seq`` (half ``h``), then :meth:`_check_headers` (its
        return value). With signals by stores, and neither ``cost`` nor shrink mode, one native call first polls
        the signal words a short while and checks the headers (the wait while the peers are on time); a source
        still short then gets the long wait, with its deadline and abort checks (:meth:`_wait_sources`)."""
        stores = self._store_signals
        if stores is not None and cost is None and not self.shrink:
            self.tp.check_abort(phase)  # a short wait sees no abort words: a late rank must hear of one first
            agreed = native.ll_await(stores[h][2], self.R, self._mask_arg(), seq + 1, self._await_polls,
                                     self._header_rows(h), self.rank, seq, op, F_PULL if op == OP_COMBINE else 0)
            if agreed is not None and agreed > 0:
                return self._pulled_sources(h) if agreed == 3 else []
            if agreed == 0:  # arrived, and the headers disagree: say why
                return self._check_headers(h, seq, op, lay, flags)
        return self._wait_long(h, seq, op, lay, flags, phase, cost)

    def _wait_long(self, h, seq, op, lay, flags, phase, cost, late: bool = True) -> list[int]:
        """The wait past the bounded poll: every live source's signal with its deadline and abort checks (when
        ``late``), then :meth:`_check_headers` (its return value; it raises on a disagreement, saying why)."""
        if late:
            self._wait_sources(h, seq + 1, phase, cost)
        return self._check_headers(h, seq, op, lay, flags)

    def _finish(self, plan: native.LLPlan, finish, h, seq, op, lay, flags, phase, work: str) -> int:
        """A fused finish, ``finish(polls, timed)`` (:class:`native.LLPlan`), and its status. It returns -1 when a
        source is late: then the long wait, with its deadline and abort checks, and the headers, and the finish
        again without polling; -2 when the headers disagree: :meth:`_check_headers` raises saying why. Recording
        phases, the finish's bounded wait counts as ``wait: signals``, the rest as ``work``."""
        on = _PH.on
        status = finish(self._await_polls, on)
        if on:
            _PH.carve("wait: signals", plan.ns[0])
        if status < 0:
            if on and status == -1:
                _PH.switch("wait: signals")
            self._wait_long(h, seq, op, lay, flags, phase, None, late=status == -1)
            if on:
                _PH.switch(work)
            status = finish(0, on)
            if on:
                _PH.carve("wait: signals", plan.ns[0])
        return status

    def _check_headers(self, h, seq, op, lay, flags) -> list[int]:
        """Every live source's header against ours; refusals and disagreements raise on every rank. Returns the
        live sources whose header says ``F_PULL`` (a combine's rows left in their send regions; empty otherwise)."""
        if _PH.on:
            _PH.switch("control")
        hdr = self._header_rows(h)
        ignore = F_PULL if op == OP_COMBINE else 0  # a combine source's own choice (zero_copy), see the module doc
        agreed = native.ll_headers_agree(hdr, self.rank, self._mask_arg(), seq, op, ignore)
        if agreed:  # one pass; else say why below (3: a source set an ignored flag)
            return self._pulled_sources(h) if agreed == 3 else []
        view = self.tp.local_view(self.ctl, h * self.R * HDR_BYTES, self.R * HDR_BYTES).view(self.R, HDR_BYTES)
        words = view[:, :_HDR_WORDS * 8].clone().view(torch.int64).numpy()
        problems = []
        live = self.live_peers()
        if any(int(words[s, 0]) >> 16 != seq or (int(words[s, 0]) >> 4) & 0xF != op for s in live):
            problems.append(sequence_problem((s, _call_name(words[s])) for s in live))
        for s in live:
            w0 = int(words[s, 0])
            if w0 & 0xF and w0 >> 16 == seq:
                msg = view[s, _MSG_OFF:].numpy().tobytes().rstrip(b"\0").decode("utf-8", "replace")
                problems.append(f"rank {s} rejected its arguments: {msg}")
        if not problems:
            keep = 0xFF & ~ignore
            mine = ((int(words[self.rank, 0]) >> 8) & keep, int(words[self.rank, 1]))
            for s in live:
                theirs = ((int(words[s, 0]) >> 8) & keep, int(words[s, 1]))
                if theirs != mine:
                    problems.append("ranks disagree on (M, H, E, use_fp8, use_ue8m0, use_logfmt): " + ", ".join(
                        f"rank {p}: {_describe(words[p])}" for p in live))
                    break
        if not problems and op == OP_COMBINE:
            handles = self._handles_problem(words)
            if handles:
                problems.append(handles)
        if problems:
            raise LowLatencyRefused(f"rank {self.rank}: {OP_NAMES[op]} call #{seq + 1} refused on every rank: "
                                    + "; ".join(problems))
        return self._pulled_sources(h) if op == OP_COMBINE else []

    def _handles_problem(self, words) -> str | None:
        """Why the live sources of a combine (header words ``[R, >= 3]`` int64) cannot go on together: their handles
        come from different dispatches (word 2's high half, :meth:`handle_id`; 0, not known, is not compared).
        None if they can."""
        live = self.live_peers()
        ids = {int(words[s, 2]) >> 32 for s in live} - {0}
        if len(ids) < 2:
            return None
        return ("ranks combine the handles of different dispatches: " + ", ".join(
            f"rank {s}: " + (f"LL call #{int(words[s, 2]) >> 32}" if int(words[s, 2]) >> 32 else "not known")
            for s in live))

    # -- dispatch ----------------------------------------------------------------------
    def dispatch(self, x, topk_idx, lay: Layout, use_fp8, round_scale, use_ue8m0, cum_stats, wait_stats,
                 route: NativeRoute | None = None) -> Pending:
        """Issue the sends of a dispatch; returns a :class:`Pending` whose receive fills the outputs.

        ``x`` ``[N, H]`` bf16, ``topk_idx`` ``[N, K]`` int64 (both dense); ``cum_stats`` ``[L]`` int32
        and ``wait_stats`` ``[R]`` int64 or None (see ``Buffer.low_latency_dispatch``). ``route``: the native
        route of ``topk_idx`` (from the argument checks) when not None; with it, and every live peer mapped,
        the call takes the native path (:meth:`_dispatch_native`), else the torch path below.
        """
        R, L, M, H, E = self.R, lay.L, lay.M, lay.H, lay.E
        seq, h = self.begin(OP_DISPATCH)
        base = h * self.half
        flags = (F_FP8 if use_fp8 else 0) | (F_UE8M0 if use_ue8m0 else 0)
        scale_words = (H // 512 if use_ue8m0 else lay.S) if use_fp8 else 0  # per token
        if route is not None and route.m == M and lay.native_ok and self.native_path():
            return self._remember(self._dispatch_native(x, topk_idx, lay, seq, h, flags, scale_words, use_fp8,
                                                        round_scale, use_ue8m0, cum_stats, wait_stats, route), topk_idx)
        if _PH.on:
            _PH.switch("pack")
        messages = self._write_messages(x, lay, base, use_fp8, round_scale, use_ue8m0, scale_words)
        if _PH.on:
            _PH.switch("route")
        route = self._route(topk_idx, L, E)
        route_stamp = stamp(topk_idx, self.mask)
        self._dispatched = None
        if lay.indexed_ok:
            flags |= F_INDEXED
        hdr = self._header(seq, OP_DISPATCH, 0, lay, flags)
        dsts = self.order()
        ends = torch.cumsum(route.counts.view(R, L).sum(1), 0).tolist()  # the route's last pair + 1 of each rank
        # Each pair's slot row at its destination: row j of local expert e's run -> slot (e, me).
        slot_rows = ((route.experts % L) * R + self.rank) * M + route.rank
        send = self._send_indexed if lay.indexed_ok else self._send_messages
        for dst in dsts:
            send(dst, messages, route, lay, base, ends[dst - 1] if dst else 0, ends[dst], slot_rows)
            self._put_counts(dst, base, route.counts32[dst * L:(dst + 1) * L], L)
        self._publish(h, hdr, seq, dsts)

        # Outputs (allocated now, filled by the receive; reused ones come unzeroed, the receive zeroes the rows
        # an earlier user left past its own).
        if _PH.on:
            _PH.switch("outputs")
        (recv_x, recv_scales, src_info), entries, stale = self._dispatch_outputs(lay, use_fp8, use_ue8m0, scale_words)
        call = _DispatchCall(seq, h, seq + 1, lay, flags, messages.size(1), 4 * scale_words, recv_x,
                             recv_scales, src_info, torch.zeros(L, dtype=torch.int32),
                             torch.zeros(L, R, dtype=torch.int64), entries, route, route_stamp)
        outputs = ((recv_x, recv_scales) if use_fp8 else recv_x, call.recv_count,
                   LowLatencyHandle(src_info, call.layout_range, M, H, E))
        return self._remember(Pending(functools.partial(self._receive_dispatch, call, cum_stats, wait_stats, stale),
                                      outputs), topk_idx)

    def _dispatch_outputs(self, lay: Layout, use_fp8: bool, use_ue8m0: bool, scale_words: int) -> tuple:
        """A dispatch's outputs from the pool: ``((recv_x [L, R·M, H], recv_scales [L, R·M, S'] or None, src_info
        [L, R·M] int32), their pool entries, their stale counts)`` (:meth:`OutputPool.get`; the scales
        channels-first, as DeepEP lays them out)."""
        L, RM, H = lay.L, self.R * lay.M, lay.H
        got = [self.pool.get((L, RM, H), torch.float8_e4m3fn if use_fp8 else torch.bfloat16),
               self.pool.get((L, RM, scale_words), torch.int32 if use_ue8m0 else torch.float32, channels_first=True)
               if use_fp8 else (None, None, None),
               self.pool.get((L, RM), torch.int32)]
        return tuple(zip(*got))

    _KEPT = 16  # dispatches whose topk_idx a combine can be checked against (handles held at once, microbatches)

    def _remember(self, pending: Pending, topk_idx: torch.Tensor) -> Pending:
        """Keep a copy of a dispatch's ``topk_idx`` by its handle's ``src_info``, for :meth:`dispatched_topk_idx`
        (a few KB at a decode step's sizes); returns ``pending``."""
        src_info = pending.outputs[2].src_info
        # A key already there (an id reused after its tensor died) moves to the end, as the newest entry: kept in
        # its old place, a live handle's entry would be evicted first and its combine go unchecked.
        self._dispatched_idx.pop(id(src_info), None)
        self._dispatched_idx[id(src_info)] = (weakref.ref(src_info), topk_idx.clone(), self.calls)
        if len(self._dispatched_idx) > self._KEPT:
            self._dispatched_idx.popitem(last=False)
        return pending

    def _dispatch_of(self, handle) -> tuple | None:
        src_info = handle[0] if isinstance(handle, (tuple, list)) and handle else None
        ent = self._dispatched_idx.get(id(src_info))
        return ent if ent is not None and ent[0]() is src_info else None

    def dispatched_topk_idx(self, handle) -> torch.Tensor | None:
        """The ``topk_idx`` (a copy) of the dispatch that made ``handle``, when it is one of this engine's last
        :attr:`_KEPT` dispatches (the handle it returned, not a copy); else None. A combine of that handle must pass
        the same values (DeepEP), or the rows its peers return do not belong to its tokens."""
        ent = self._dispatch_of(handle)
        return None if ent is None else ent[1]

    def handle_id(self, handle) -> int:
        """The LL call number (1, 2, ...) of the dispatch that made ``handle``, as :meth:`dispatched_topk_idx` knows
        it, else 0. Ranks count LL calls alike, so the ranks of one combine must name the same dispatch: the
        combine's header carries it, and ranks naming different ones are refused (:meth:`_check_headers`)."""
        ent = self._dispatch_of(handle)
        return 0 if ent is None else ent[2]

    def _dispatch_native(self, x, topk_idx, lay: Layout, seq, h, flags, scale_words, use_fp8, round_scale, use_ue8m0,
                         cum_stats, wait_stats, route: NativeRoute) -> Pending:
        """:meth:`dispatch` on the native path, where every live peer is mapped: each token's message staged once
        in this rank's send region (FP8: :meth:`_write_messages`; BF16: the payload, a copy of ``x``), then one
        kernel writes each routed token's index into its slot of the destination's index table and the counts,
        then one header and signal per destination. Each receiver loads its rows from the sources' send regions
        (:meth:`_receive_dispatch_native`): a row moves once, from the send region into ``recv_x``."""
        R, L, M, H, E = self.R, lay.L, lay.M, lay.H, lay.E
        base = h * self.half
        flags |= F_PULL
        self._dispatched = None  # its route is no longer the last received one
        plan = self._fused_plan(lay, wait_stats)
        if plan is not None:  # stage, send, publish and count in one native call
            if _PH.on:
                _PH.switch("send")
            mb = MSG_HEADER + (H + 4 * scale_words if use_fp8 else 2 * H)
            if plan.dispatch_issue(h, route.slots, route.counts, self._sent_rows, 2 if use_fp8 else 1, x, round_scale,
                                   use_ue8m0, mb, self._header(seq, OP_DISPATCH, 0, lay, flags), seq + 1, _PH.on):
                raise RuntimeError(f"rank {self.rank}: low_latency_dispatch call #{seq + 1}: the fused send refused "
                                   f"its route or its x (changed after the argument checks?)")
            if _PH.on:
                ns = plan.ns
                _PH.carve("pack", ns[0])
                _PH.carve("signal", ns[1])
        else:
            if _PH.on:
                _PH.switch("pack")
            if use_fp8:
                mb = self._write_messages(x, lay, base, use_fp8, round_scale, use_ue8m0, scale_words).size(1)
            else:  # the payloads only: receivers take the token index from the index table, not a message header
                n, mb = x.size(0), MSG_HEADER + 2 * H
                self._view(("dstage", base + lay.send_off, n, mb), lambda: self.tp.local_view(
                    self.win, base + lay.send_off, n * mb).view(n, mb)[:, MSG_HEADER:]).copy_(x.view(torch.uint8))
            if _PH.on:
                _PH.switch("send")
            native.ll_dispatch_send(route.slots, M, L, self.rank, self._bases, self._mask_arg(), base + lay.recv_off,
                                    base + self.rank * L * 4, route.counts, self._sent_rows)
            hdr = self._header(seq, OP_DISPATCH, 0, lay, flags)
            sent = self._sent_rows.tolist()
            dsts = self.order()
            for dst in dsts:
                # The rows the receiver loads from here (its count of this traffic is the sender's, as for a push),
                # their index words and the counts.
                if sent[dst]:
                    self.tp.record_put(dst, sent[dst] * (mb + 4))
                self.tp.record_put(dst, 4 * L)
            self._publish(h, hdr, seq, dsts)
        if _PH.on:
            _PH.switch("outputs")
        # Reused outputs come unzeroed where the receive's pass zeroes them (the rows it does not write).
        (recv_x, recv_scales, src_info), entries, stale = self._dispatch_outputs(lay, use_fp8, use_ue8m0, scale_words)
        call = _DispatchCall(seq, h, seq + 1, lay, flags, mb, 4 * scale_words, recv_x, recv_scales, src_info,
                             torch.zeros(L, dtype=torch.int32), torch.zeros(L, R, dtype=torch.int64),
                             entries, route, stamp(topk_idx, self.mask), plan)
        outputs = ((recv_x, recv_scales) if use_fp8 else recv_x, call.recv_count,
                   LowLatencyHandle(src_info, call.layout_range, M, H, E))
        return Pending(functools.partial(self._receive_dispatch_native, call, cum_stats, wait_stats,
                                         stale), outputs)

    def _await_dispatch(self, call: _DispatchCall, wait_stats) -> tuple[int, str]:
        """Wait for every live source's signal of the dispatch ``call`` and check their headers; returns the
        window offset of the call's half and the phase name its errors carry."""
        phase = f"low_latency_dispatch call #{call.seq + 1}"
        if _PH.on:
            _PH.switch("wait: signals")
        self._await_call(call.half, call.seq, OP_DISPATCH, call.lay, call.flags, phase, wait_stats)
        return call.half * self.half, phase

    def _receive_dispatch_native(self, call: _DispatchCall, cum_stats, wait_stats, stale) -> None:
        """:meth:`_receive_dispatch` on the native path: one kernel turns the counts into ``recv_count`` /
        ``layout_range``, loads every row routed here from its source's send region (found through the index
        table the sources wrote here) into ``recv_x`` / scales / ``src_info``, zeroes the rows an earlier user
        of a reused output left past them (``stale``: :meth:`OutputPool.get`'s counts per output), and
        then checks that no source began rewriting its send region meanwhile (its stamp, see :meth:`begin`).

        Raises:
            RuntimeError: a source announced more than ``M`` rows for one expert, or a token index outside
                ``[0, M)``; or a source's send region was restamped by a later call while the rows were loaded
                (a caller kept more than two LL calls in flight, docs/semantics/deepep-api.md §6.6): the rows
                may be torn, the error names the source and both calls.
        """
        R, lay = self.R, call.lay
        L, M, mb = lay.L, lay.M, call.message_bytes
        plan = call.plan
        if plan is not None:  # the bounded wait, the headers and the loads in one native call
            phase = f"low_latency_dispatch call #{call.seq + 1}"
            if _PH.on:
                _PH.switch("copy")
            self.tp.check_abort(phase)  # the bounded wait sees no abort words: a late rank must hear of one first
            args = (mb, call.recv_x.view(torch.uint8), call.recv_scales, call.src_info, call.recv_count,
                    call.layout_range, stale)
            status = self._finish(plan, lambda polls, timed: plan.dispatch_finish(call.half, call.seq, polls, *args,
                                                                                  timed=timed),
                                  call.half, call.seq, OP_DISPATCH, lay, call.flags, phase, "copy")
            bad = plan.bad
            if status in (0, 3):
                mark_written(*(t for t in (call.recv_x, call.src_info, call.recv_count, call.layout_range,
                                           call.recv_scales) if t is not None))
        else:
            base, phase = self._await_dispatch(call, wait_stats)
            if _PH.on:
                _PH.switch("copy")
            sig = self._counts_view(base, L)
            index = self._view(("dindex", base, lay.recv_off, L * R * M),
                               lambda: self.tp.local_view(self.win, base + lay.recv_off, 4 * L * R * M, torch.int32))
            status, bad = native.ll_dispatch_recv(sig, self._mask_arg(), index, self._bases, base + lay.send_off,
                                                  self._stamps[call.half], call.seq + 1, M, mb,
                                                  call.recv_x.view(torch.uint8), call.recv_scales, call.src_info,
                                                  call.recv_count, call.layout_range, stale)
        if status == 1:
            raise RuntimeError(f"rank {self.rank}: {phase}: a source announced more than M={M} tokens for one expert")
        if status == 2:  # the pool's counts are this engine's own: not reached
            raise RuntimeError(f"rank {self.rank}: {phase}: a reused output's stale row counts lie outside "
                               f"[0, {R * M}]")
        if status == 4:
            what = ("is not mapped here" if bad[2] < 0 else
                    f"listed a token index outside [0, {M}) as its row {bad[2]} for local expert {bad[1]}")
            raise RuntimeError(f"rank {self.rank}: {phase}: source rank {bad[0]} {what}")
        if status == 3:
            # The outputs' pool entries were never reported written (OutputPool.written): not reused.
            raise RuntimeError(
                f"rank {self.rank}: {phase}: source rank {bad[0]} began rewriting its send region for LL call "
                f"#{bad[1]} while this rank loaded call #{call.seq + 1}'s rows from it (rows may be torn); at most "
                f"two LL calls may be in flight: receive call k before issuing call k+2 "
                f"(docs/semantics/deepep-api.md §6.6)")
        self._finish_dispatch(call, cum_stats, call.recv_count.clone())  # rows [0, recv_count[e]) of expert e

    def _write_messages(self, x, lay: Layout, base: int, use_fp8: bool, round_scale: bool, use_ue8m0: bool,
                        scale_words: int) -> torch.Tensor:
        """This rank's messages ``[N, mb]`` uint8 in the send region: ``[int32 token | 12 B | payload]``, the
        FP8 cast once per token (docs/semantics/deepep-api.md §6.4). FP8: one native pass from ``x``
        (:func:`deepep_ascend.native.ll_cast_messages`), else torch from a float32 scratch kept across calls;
        same bytes. ``mb`` (the message bytes, also the slot stride) is at most ``lay.d``."""
        n, H = x.size(0), lay.H
        sb = 4 * scale_words
        mb = MSG_HEADER + (H if use_fp8 else 2 * H) + sb
        off = base + lay.send_off
        rows = self._view(("msgs", off, n, mb), lambda: self.tp.local_view(self.win, off, n * mb).view(n, mb))
        if use_fp8 and x.stride()[1] == 1 and native.ll_cast_messages(x, rows, round_scale, use_ue8m0):
            return rows
        if not n:  # no message (the empty scales below could not be viewed as bytes)
            return rows
        rows[:, :MSG_HEADER].zero_()
        rows[:, :4].copy_(torch.arange(n, dtype=torch.int32).view(torch.uint8).view(n, 4))
        if use_fp8:
            xf = self._scratch("cast", (n, H), torch.float32)
            xf.copy_(x)
            sf = low_latency_cast_to_fp8_(xf.view(n, H // 128, 128),
                                          rows[:, MSG_HEADER:MSG_HEADER + H].view(torch.float8_e4m3fn), round_scale)
            scales = pack_ue8m0_to_int(sf) if use_ue8m0 else sf
            rows[:, MSG_HEADER + H:mb].copy_(scales.view(torch.uint8).view(n, sb))
        else:
            rows[:, MSG_HEADER:mb].copy_(x.view(torch.uint8).view(n, 2 * H))
        return rows

    def _route(self, topk_idx, num_local: int, num_experts: int) -> _Route:
        """The (token, slot) pairs of live experts grouped by expert, tokens then slots ascending in each."""
        num_topk = topk_idx.size(1)
        flat = topk_idx.reshape(-1)
        valid = flat >= 0
        if any(self.masked()):
            valid &= self.mask[(flat.clamp(min=0) // num_local)] == 0
        pos = torch.nonzero(valid).squeeze(1)
        experts = flat[pos]
        order = stable_argsort(experts, 0, num_experts)
        experts = experts[order]
        pos = pos[order]
        counts = torch.bincount(experts, minlength=num_experts)
        starts = torch.cumsum(counts, 0) - counts
        return _Route(experts, pos, pos // num_topk, torch.arange(pos.numel()) - starts[experts], counts, starts,
                      counts.to(torch.int32))

    def _send_messages(self, dst: int, messages: torch.Tensor, route: _Route, lay: Layout, base: int, lo: int,
                       hi: int, slot_rows: torch.Tensor) -> None:
        """Write ``dst``'s messages (the route's pairs ``[lo, hi)``; ``slot_rows`` ``[P]`` int64 each pair's slot
        row at its destination) into its slots: one scatter into its mapped window (same node with
        ``allow_ubmem``, or this rank), else one put of every pair's message, read where it lies."""
        if _PH.on:
            _PH.switch("send")
        L, R, M = lay.L, self.R, lay.M
        mb = messages.size(1)
        if hi <= lo:
            return
        tokens = route.tokens[lo:hi]  # ordered by local expert, then token/slot
        if self.direct[dst]:
            recv = self.tp.peer_view(self.win, dst, base + lay.recv_off, L * R * M * mb).view(L * R * M, mb)
            slot_rows = slot_rows[lo:hi]
            if not native.copy_rows(recv, slot_rows, messages, tokens):  # each row straight into its slot
                dv = wide(recv)
                dv.index_copy_(0, slot_rows, wide(messages).index_select(0, tokens).view(torch.uint8).view(dv.dtype))
            self.tp.record_put(dst, (hi - lo) * mb)
            return
        # one block per pair, from the token's message to the pair's slot: MPI moves them all in one put
        self.tp.put_blocks(self.win, dst, messages, tokens * mb, slot_rows[lo:hi] * mb + (base + lay.recv_off),
                           torch.full((hi - lo,), mb, dtype=torch.int64), local_completion=False)

    def _send_indexed(self, dst: int, messages: torch.Tensor, route: _Route, lay: Layout, base: int, lo: int,
                      hi: int, slot_rows: torch.Tensor) -> None:
        """Write ``dst``'s part of an indexed dispatch (``F_INDEXED``, ``Layout.indexed_ok``): each token ``t`` the
        route's pairs ``[lo, hi)`` send there, once, into its slot of this rank's region in ``dst``'s *recv*
        (``index_bytes + (me·M + t)·mb``), and for every pair its token into its entry of ``dst``'s index table
        (int32 ``[L, R, M]`` at the start of *recv*; ``slot_rows`` as for :meth:`_send_messages`), the table the
        native path's receive reads too. A token bound for several of ``dst``'s experts crosses once: a top-k
        dispatch moves up to ``min(K, L)`` times fewer bytes to each rank than one message per pair. Mapped: one
        row copy and one index scatter into its window; else one put of the messages, read where they lie, and
        one of the index runs (one per local expert)."""
        if _PH.on:
            _PH.switch("send")
        if hi <= lo:
            return
        L, R, M, mb = lay.L, self.R, lay.M, messages.size(1)
        tokens = route.tokens[lo:hi]  # by local expert, then token/slot
        present = torch.zeros(messages.size(0), dtype=torch.bool)
        present[tokens] = True
        uniq = torch.nonzero(present).squeeze(1)
        number = tokens.to(torch.int32)
        msg_off = base + lay.recv_off + lay.index_bytes + self.rank * M * mb
        idx_off = base + lay.recv_off
        n = uniq.numel()
        if self.direct[dst]:
            recv = self.tp.peer_view(self.win, dst, msg_off, messages.size(0) * mb).view(-1, mb)
            if not native.copy_rows(recv, uniq, messages, uniq):
                wide(recv).index_copy_(0, uniq, wide(messages).index_select(0, uniq))
            self.tp.peer_view(self.win, dst, idx_off, 4 * L * R * M, torch.int32).index_copy_(0, slot_rows[lo:hi],
                                                                                              number)
            self.tp.record_put(dst, n * mb + 4 * (hi - lo))
            return
        self.tp.put_blocks(self.win, dst, messages, uniq * mb, msg_off + uniq * mb,
                           torch.full((n,), mb, dtype=torch.int64), local_completion=False)
        # The pairs of each local expert fill its slot's first rows: one block per expert with pairs.
        counts = route.counts[dst * L:(dst + 1) * L]
        live = torch.nonzero(counts).squeeze(1)
        firsts = (torch.cumsum(counts, 0) - counts).index_select(0, live)
        self.tp.put_blocks(self.win, dst, number, 4 * firsts, idx_off + 4 * (live * R + self.rank) * M,
                           4 * counts.index_select(0, live), local_completion=False)

    def _receive_dispatch(self, call: _DispatchCall, cum_stats, wait_stats, stale) -> None:
        """Wait for every live source, check the headers, then unpack the received messages into the outputs:
        expert ``e``'s rows packed from row 0 of ``recv_x[e]``, by source, then token/slot; then zero the rows
        an earlier user of a reused output left past them (``stale``: :meth:`OutputPool.get`'s counts
        of recv_x, scales, src_info)."""
        me, R, lay = self.rank, self.R, call.lay
        L, M, H = lay.L, lay.M, lay.H
        base, phase = self._await_dispatch(call, wait_stats)
        if call.flags & F_INDEXED and self._unpack_indexed_native(call, base, phase, stale):
            self._finish_dispatch(call, cum_stats, call.recv_count.clone())
            return
        cnt = self._read_counts(base, L).t().contiguous()  # [L, R]
        if any(self.masked()):
            cnt[:, self.mask.bool()] = 0
        lo, hi = (int(v) for v in torch.aminmax(cnt))  # one pass
        if lo < 0 or hi > M:
            raise RuntimeError(f"rank {me}: {phase}: a source announced more than M={M} tokens for one expert")
        begin = torch.cumsum(cnt, 1) - cnt
        call.recv_count.copy_(cnt.sum(1))
        call.layout_range.copy_((begin.to(torch.int64) << 32) | cnt.to(torch.int64))
        total = int(call.recv_count.sum())
        if _PH.on:
            _PH.switch("copy")
        if total:
            mb, sb = call.message_bytes, call.scale_bytes
            recv_x, recv_scales = call.recv_x, call.recv_scales
            f = torch.nonzero((torch.arange(M) < cnt.unsqueeze(2)).view(-1)).squeeze(1)  # by expert, source, row
            # Where each message lands: expert e's rows are packed from row 0 of recv_x[e].
            e_of = f // (R * M)
            row_of = torch.arange(total) - (torch.cumsum(call.recv_count, 0) - call.recv_count).to(torch.int64)[e_of]
            dst_rows = e_of * (R * M) + row_of
            if call.flags & F_INDEXED:  # slot -> its source's token (_send_indexed)
                index = self.tp.local_view(self.win, base + lay.recv_off, 4 * L * R * M, torch.int32)
                number = index.index_select(0, f).to(torch.int64)
                lo, hi = (int(v) for v in torch.aminmax(number))
                if lo < 0 or hi >= M:
                    i = int(torch.nonzero((number < 0) | (number >= M))[0])
                    raise RuntimeError(f"rank {me}: {phase}: source rank {int(f[i]) // M % R} listed a token index "
                                       f"outside [0, {M}) for local expert {int(e_of[i])}")
                blocks = self.tp.local_view(self.win, base + lay.recv_off + lay.index_bytes,
                                            R * M * mb).view(R * M, mb)
                f = (f // M % R) * M + number
            else:
                blocks = self.tp.local_view(self.win, base + lay.recv_off, L * R * M * mb).view(L * R * M, mb)
            xb = H * recv_x.element_size()
            rx = recv_x.view(torch.uint8).view(L * R * M, xb)
            msgs = None
            if not native.copy_rows(rx, dst_rows, blocks[:, MSG_HEADER:MSG_HEADER + xb], f):  # slot -> row, one pass
                msgs = wide(blocks).index_select(0, f).view(torch.uint8)  # [total, mb]
                # One scatter in the widest element type dividing every field: torch copies column
                # slices element by element (byte-wise copies were ~95 % of the receive).
                w = common_width(mb, MSG_HEADER, xb, sb)
                rx.view(INT_OF_WIDTH[w]).index_copy_(
                    0, dst_rows, msgs.view(INT_OF_WIDTH[w])[:, MSG_HEADER // w:(MSG_HEADER + xb) // w])
            if mb % 4 == 0 and blocks.storage_offset() % 4 == 0:  # the small fields gathered column-wise, in place
                info = blocks.view(torch.int32)[:, 0].index_select(0, f)
            else:
                msgs = wide(blocks).index_select(0, f).view(torch.uint8) if msgs is None else msgs
                info = _bytes_copy(msgs[:, :4]).view(torch.int32).view(-1)
            call.src_info.view(-1).index_copy_(0, dst_rows, info)
            if recv_scales is not None:  # FP8: every field is a multiple of 4 bytes (H % 128 == 0)
                sc = blocks.view(torch.int32)[:, (MSG_HEADER + xb) // 4:(MSG_HEADER + xb + sb) // 4].index_select(0, f)
                # recv_scales is channels-first: its storage is [L, S', R*M]; scatter flat, s-major.
                sw = sc.size(1)
                flat = ((e_of * (sw * R * M) + row_of).unsqueeze(0)
                        + (torch.arange(sw) * (R * M)).unsqueeze(1)).view(-1)
                recv_scales.transpose(1, 2).view(-1).index_copy_(
                    0, flat, sc.t().contiguous().view(recv_scales.dtype).view(-1))
        _zero_stale_rows((call.recv_x, call.recv_scales, call.src_info), stale, call.recv_count)
        self._finish_dispatch(call, cum_stats, call.recv_count.clone())  # rows [0, recv_count[e]) of expert e

    def _unpack_indexed_native(self, call: _DispatchCall, base: int, phase: str, stale) -> bool:
        """The receive of an indexed dispatch (:meth:`_send_indexed`) in one native pass, where the kernels are
        loaded: :func:`native.ll_dispatch_recv` reads the index table as the native path does, each source's
        messages in its region of this rank's *recv* (pushed here, so no stamps to check), and writes ``recv_x``,
        the scales, ``src_info``, ``recv_count`` and ``layout_range`` and zeroes the stale rows, the bytes of the
        torch code below it. Returns False (nothing written) without the kernels.

        Raises:
            RuntimeError: a source announced more than ``M`` tokens for one expert, or listed a token index outside
                ``[0, M)``.
        """
        lay, R = call.lay, self.R
        L, M, mb = lay.L, lay.M, call.message_bytes
        if not native.ll_available():
            return False
        if _PH.on:
            _PH.switch("copy")
        key = ("pushed", base + lay.recv_off, L, M, mb)  # the table and regions: where recv lies, their shape
        index, regions = self._view(key, lambda: (
            self.tp.local_view(self.win, base + lay.recv_off, 4 * L * R * M, torch.int32),
            torch.tensor([int(self._bases[self.rank]) + base + lay.recv_off + lay.index_bytes + s * M * mb
                          for s in range(R)], dtype=torch.int64)))
        status, bad = native.ll_dispatch_recv(self._counts_view(base, L), self._mask_arg(), index, regions, 0,
                                              self._no_stamps, 0, M, mb, call.recv_x.view(torch.uint8),
                                              call.recv_scales, call.src_info, call.recv_count, call.layout_range,
                                              stale)
        if status == 1:
            raise RuntimeError(f"rank {self.rank}: {phase}: a source announced more than M={M} tokens for one expert")
        if status == 4:
            raise RuntimeError(f"rank {self.rank}: {phase}: source rank {bad[0]} listed a token index outside "
                               f"[0, {M}) for local expert {bad[1]}")
        return True

    def _finish_dispatch(self, call: _DispatchCall, cum_stats, written) -> None:
        """A received dispatch's epilogue: ``written`` (the rows this call wrote, in the form its path's reuse
        of the outputs reads) recorded on the outputs' pool entries, ``cum_stats`` counted, and the call kept as
        the route a combine of its handle may reuse."""
        for ent in call.written:
            if ent is not None:
                OutputPool.written(ent, written)
        if cum_stats is not None:
            cum_stats.add_(call.recv_count)
        lay = call.lay
        self._dispatched = (call.route_stamp + stamp(call.src_info, call.layout_range), (lay.M, lay.H, lay.E),
                            call.route)

    @memory.outside_inference_mode
    def _scratch(self, name, shape, dtype) -> torch.Tensor:
        """A ``shape`` view of the engine's scratch ``name``, grown on demand and kept across
        calls: fresh temporaries of this size cost page faults on every call."""
        numel = math.prod(shape)
        buf = self._scratch_bufs.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            buf = self._scratch_bufs[name] = torch.empty(numel, dtype=dtype)
        return buf[:numel].view(shape)

    def _put_counts(self, dst, base, cnt, L) -> None:
        off = base + self.rank * L * 4
        if self.direct[dst]:
            self.tp.peer_view(self.win, dst, off, 4 * L, torch.int32).copy_(cnt)
            self.tp.record_put(dst, 4 * L)
        else:
            self.tp.put(self.win, dst, off, cnt.contiguous(), local_completion=False)

    def _read_counts(self, base, L) -> torch.Tensor:
        return self.tp.local_view(self.win, base, 4 * L * self.R, torch.int32).view(self.R, L).clone()

    # -- combine -----------------------------------------------------------------------
    def combine(self, x, topk_idx, topk_weights, handle: LowLatencyHandle, lay: Layout, zero_copy, out, wait_stats,
                use_logfmt=False, route: _Route | None = None, keep_own: bool = False) -> Pending:
        """Issue the sends of a combine; returns a :class:`Pending` whose receive fills ``combined_x``.

        ``x`` ``[L, R·M, H]`` bf16 (None with ``zero_copy``: the send region holds the rows), ``topk_idx``
        / ``topk_weights`` ``[N, K]`` int64 / float32, ``out`` ``[N, H]`` bf16 or None. ``use_logfmt``:
        rows travel LogFMT-10 encoded (:meth:`_send_logfmt`) and are decoded to float32 before the
        weighted sum. ``route``: :meth:`dispatched_route` of ``(topk_idx, handle)`` when not None (the
        receive then reuses it instead of routing ``topk_idx`` again). ``keep_own``: the receive runs before
        the caller gets ``x`` back (a synchronous call), so this rank's own rows are summed where they lie in
        ``x`` instead of being copied into its window first (the same bits; the torch path too, BF16 rows with
        the native kernels loaded)."""
        R, L, M, H = self.R, lay.L, lay.M, lay.H
        layout_range = handle.layout_range
        handle_id = self.handle_id(handle)
        seq, h = self.begin(OP_COMBINE)
        self.zero_copy_for = None
        base = h * self.half
        flags = F_LOGFMT if use_logfmt else 0
        src = (self.tp.local_view(self.win, base + lay.send_off, L * R * M * 2 * H, torch.bfloat16).view(L, R * M, H)
               if zero_copy else x)
        if not use_logfmt and (src.stride(2) == 1 or H == 1) and lay.native_ok and self.native_path():
            if not isinstance(route, NativeRoute) or route.m != M:
                route = self.native_route(topk_idx, lay)
            return self._combine_native(src, topk_idx, topk_weights, layout_range, lay, seq, h, out, wait_stats, route,
                                        keep_own, pull=zero_copy and lay.can_pull, handle_id=handle_id)
        if isinstance(route, NativeRoute):  # the torch path routes with its own structure
            route = None
        cnt_all = (layout_range & 0xFFFFFFFF).to(torch.int32)  # [L, R]
        beg_all = (layout_range >> 32).to(torch.int64)
        if _PH.on:
            _PH.switch("pack")
        enc = self._encode_logfmt(src, cnt_all, beg_all, lay) if use_logfmt else None
        hdr = self._header(seq, OP_COMBINE, 0, lay, flags, handle_id=handle_id)
        dsts = self.order()
        plan = (self._row_plan(layout_range, lay)
                if enc is None and src.is_contiguous() and any(self.direct[d] for d in dsts) else None)
        # A synchronous call's own rows stay where they lie in src: its receive sums them there (ll_combine_recv).
        own = (src, layout_range) if keep_own and enc is None and src.stride(2) == 1 and native.ll_available() else None
        for dst in dsts:
            if _PH.on:
                _PH.switch("send")
            if enc is not None:
                self._send_logfmt(dst, enc, lay, base)
            elif own is not None and dst == self.rank:
                pass  # only the counts below
            elif plan is None or not self.direct[dst] or not self._store_rows(dst, src, plan, lay, base):
                self._send_rows(dst, src, beg_all[:, dst], cnt_all[:, dst].to(torch.int64), lay, base)
            self._put_counts(dst, base, cnt_all[:, dst].contiguous(), L)
        self._publish(h, hdr, seq, dsts)
        need = seq + 1
        if _PH.on:
            _PH.switch("outputs")
        combined = out if out is not None else self.combined_pool.empty((topk_idx.size(0), H), torch.bfloat16)
        return Pending(functools.partial(self._receive_combine, seq, h, need, lay, flags, topk_idx, topk_weights,
                                         combined, wait_stats, use_logfmt, route, stamp(self.mask), own), (combined,))

    def native_route(self, topk_idx: torch.Tensor, lay: Layout) -> NativeRoute:
        """:func:`deepep_ascend.native.ll_route` of a ``topk_idx`` the argument checks passed (values in ``[-1, E)``,
        no expert more than ``M`` times)."""
        status, _, counts, slots = native.ll_route(topk_idx, lay.E, lay.M)
        if status:  # the checks refused such a topk_idx before: not reached
            raise RuntimeError(f"rank {self.rank}: topk_idx changed after its checks (ll_route status {status})")
        return NativeRoute(counts, slots, lay.M)

    def _combine_native(self, src, topk_idx, topk_weights, layout_range, lay: Layout, seq, h, out, wait_stats,
                        route: NativeRoute, keep_own: bool, pull: bool = False, handle_id: int = 0) -> Pending:
        """:meth:`combine` on the native path (BF16 rows): one kernel stores every returned row and the counts into
        every destination's window (with ``keep_own``, this rank's own rows stay in ``src`` for its receive),
        then one header and signal per destination. The bytes of the torch path. With ``pull`` (a zero-copy
        combine: ``src`` is this rank's send region) no row moves here: ``layout_range`` is published after the
        rows, the kernel writes the counts only, and the header says ``F_PULL`` (the receivers read the rows)."""
        L, H = lay.L, lay.H
        base = h * self.half
        if _PH.on:
            _PH.switch("send")
        layout_range = layout_range.contiguous()
        hdr = self._header(seq, OP_COMBINE, 0, lay, F_PULL if pull else 0, handle_id=handle_id)
        plan = self._fused_plan(lay, wait_stats)
        if plan is not None:  # rows (or the published layout), counts, publish and count in one native call
            if plan.combine_issue(h, layout_range, src, 2 if pull else 1 if keep_own else 0, pull, self._sent_rows,
                                  hdr, seq + 1, _PH.on):
                raise ValueError(f"rank {self.rank}: low_latency_combine call #{seq + 1}: the handle's layout_range "
                                 f"holds a count above M={lay.M} or a run outside [0, {self.R * lay.M})")
            if _PH.on:
                _PH.carve("signal", plan.ns[1])
        else:
            if pull:
                self._view(("lr_out", base + lay.pull_off, L), lambda: self.tp.local_view(  # keyed by M, H's offset
                    self.win, base + lay.pull_off, 8 * L * self.R, torch.int64).view(L, self.R)).copy_(layout_range)
            native.ll_combine_send(layout_range, src, lay.M, self.rank, self._bases, self._mask_arg(),
                                   base + lay.recv_off, base + self.rank * L * 4, self._sent_rows,
                                   keep="all" if pull else "own" if keep_own else "none")
            sent = self._sent_rows.tolist()
            dsts = self.order()
            for dst in dsts:
                if sent[dst]:
                    self.tp.record_put(dst, sent[dst] * 2 * H)
                self.tp.record_put(dst, 4 * L)
            self._publish(h, hdr, seq, dsts)
        if _PH.on:
            _PH.switch("outputs")
        combined = out if out is not None else self.combined_pool.empty((topk_idx.size(0), H), torch.bfloat16)
        own = (src, layout_range) if keep_own or pull else None
        return Pending(functools.partial(self._receive_combine_native, seq, h, lay, topk_weights, combined, wait_stats,
                                         route, own, plan), (combined,))

    def _receive_combine_native(self, seq, h, lay: Layout, topk_weights, combined, wait_stats,
                                route: NativeRoute, own: tuple | None, plan: native.LLPlan | None = None) -> None:
        """:meth:`_receive_combine` on the native path: one kernel checks the counts returned against the route's
        and sums every token's returned rows (docs/semantics/deepep-api.md §6.3), each where it lies: a pushed
        source's in this rank's window, this rank's own in ``own`` (``(src, layout_range)``, or None), a
        zero-copy source's in its send region (read through its published ``layout_range``; its stamp is checked
        afterwards, as the dispatch's).

        Raises:
            LowLatencyRefused: a source returned another count of rows than this rank's route expects.
            RuntimeError: a zero-copy source began rewriting its send region while its rows were read.
        """
        L, M, H, E = lay.L, lay.M, lay.H, lay.E
        base = h * self.half
        phase = f"low_latency_combine call #{seq + 1}"
        if plan is not None:
            self._receive_combine_fused(plan, seq, h, lay, topk_weights, combined, route, own, phase)
            return
        if _PH.on:
            _PH.switch("wait: signals")
        pulled = [d for d in self._await_call(h, seq, OP_COMBINE, lay, 0, phase, wait_stats) if d != self.rank]
        if _PH.on:
            _PH.switch("reduce")
        sig = self._counts_view(base, L)
        rows = self._view(("crows", base, lay.recv_off, E * M, H), lambda: self.tp.local_view(
            self.win, base + lay.recv_off, E * M * 2 * H, torch.bfloat16).view(E * M, H))
        sources = None
        if own is not None or pulled:
            sources = [None] * self.R
            me = self.rank
            if own is not None:
                sources[me] = (own[0], own[1].numpy()[:, me] >> 32)
            for d in pulled:
                sources[d] = (self._view(("psend", d, base, L, M, H), lambda d=d: self.tp.peer_view(
                                  self.win, d, base + lay.send_off, L * self.R * M * 2 * H,
                                  torch.bfloat16).view(L, self.R * M, H)),
                              self._view(("plr", d, base + lay.pull_off, L), lambda d=d: self.tp.peer_view(
                                  self.win, d, base + lay.pull_off, 8 * L * self.R,
                                  torch.int64).view(L, self.R).numpy())[:, me] >> 32)
        error = None
        try:
            bad = native.ll_combine_recv(combined, rows, route.slots, topk_weights, sig, route.counts,
                                         self._mask_arg(), M, sources)
        except ValueError as exc:  # a rewritten source's begins fail the kernel's checks: the stamps say why
            bad, error = (), exc
        # Outside the handler, so that the stamps' error has no context (whose frames would hold window views), and
        # before judging the counts, which such a source moves too.
        self._check_pulled_stamps(h, seq, pulled, phase)
        if error is not None:
            raise error
        if bad:
            raise _count_refusal(self.rank, phase, L, *bad)

    def _receive_combine_fused(self, plan: native.LLPlan, seq, h, lay: Layout, topk_weights, combined,
                               route: NativeRoute, own: tuple | None, phase: str) -> None:
        """:meth:`_receive_combine_native` in one native call (:meth:`native.LLPlan.combine_finish`): the bounded wait,
        the headers, the sum of every row where it lies, the pulled sources' stamps; the same bits and errors."""
        if _PH.on:
            _PH.switch("reduce")
        self.tp.check_abort(phase)  # the bounded wait sees no abort words: a late rank must hear of one first
        own_src, own_lr = (None, None) if own is None else own
        args = (route.slots, topk_weights, route.counts, combined, own_src, own_lr)
        status = self._finish(plan, lambda polls, timed: plan.combine_finish(h, seq, polls, *args, timed=timed),
                              h, seq, OP_COMBINE, lay, 0, phase, "reduce")
        if status == 0:
            mark_written(combined)
            return
        bad = plan.bad
        if status == 3:
            mark_written(combined)
            raise _torn_sum(self.rank, phase, bad[0], bad[1], seq)
        if status == 2:
            raise _count_refusal(self.rank, phase, lay.L, *bad)
        if status == 4:
            raise MemoryError(f"rank {self.rank}: {phase}: no memory for the sum's source table")
        raise ValueError(f"rank {self.rank}: {phase}: the route's slots or a source's rows lie outside its counts")

    def _check_pulled_stamps(self, h: int, seq: int, pulled: list[int], phase: str) -> None:
        """After every load of call ``seq``'s rows from the ``pulled`` sources' send regions of half ``h`` (x86 keeps
        loads in order): their stamps still read ``seq + 1``.

        Raises:
            RuntimeError: a source's stamp moved (it began rewriting the region: the rows read may be torn).
        """
        addrs = self._stamps[h].tolist() if pulled else ()
        for d in pulled:
            now = ctypes.c_int64.from_address(addrs[d]).value
            if now != seq + 1:
                raise _torn_sum(self.rank, phase, d, now, seq)

    def _header_rows(self, h: int) -> torch.Tensor:
        """int64 ``[R, HDR_BYTES / 8]`` view of the sources' call headers of half ``h`` in this rank's ``ll_ctl``."""
        return self._view(("hdr", h), lambda: self.tp.local_view(
            self.ctl, h * self.R * HDR_BYTES, self.R * HDR_BYTES, torch.int64).view(self.R, HDR_BYTES // 8))

    def _pulled_sources(self, h: int) -> list[int]:
        """The live sources whose header of half ``h`` (already checked to be this call's) says ``F_PULL``: their
        rows stay in their send regions."""
        flagged = np.flatnonzero((self._header_rows(h).numpy()[:, 0] >> 8) & F_PULL)
        masked = self.masked()
        return [int(d) for d in flagged if not masked[d]]

    def _row_plan(self, layout_range: torch.Tensor, lay: Layout) -> tuple[list, torch.Tensor, torch.Tensor]:
        """Every destination's rows of a combine at once: ``(ends, src_rows, slot_rows)``, the rows grouped by
        destination rank ``s`` (rows ``[ends[s-1], ends[s])``), then local expert ``e``: rows ``[b, b + c)`` of
        ``src[e]`` (``layout_range[e, s]``) as rows of ``src.view(-1, H)``, and their rows of slot ``me·L + e``
        in ``s``'s receive region ``[E·M, H]``."""
        R, L, M = self.R, lay.L, lay.M
        cnt = (layout_range & 0xFFFFFFFF).t().reshape(-1)  # [R·L] runs, destination-major
        first = torch.cumsum(cnt, 0)
        ends = first[L - 1::L].tolist()
        first -= cnt
        e_of = torch.arange(L).repeat(R)
        at = torch.arange(ends[-1])
        src_rows = torch.repeat_interleave(e_of * (R * M) + (layout_range >> 32).t().reshape(-1) - first, cnt) + at
        slot_rows = torch.repeat_interleave((self.rank * L + e_of) * M - first, cnt) + at
        return ends, src_rows, slot_rows

    def _store_rows(self, dst: int, src: torch.Tensor, plan, lay: Layout, base: int) -> bool:
        """Store ``dst``'s BF16 rows of :meth:`_row_plan` straight into its slots (mapped window, one native
        call); False (nothing written) where the native kernel is not available."""
        ends, src_rows, slot_rows = plan
        lo, hi = ends[dst - 1] if dst else 0, ends[dst]
        if hi > lo:
            E, M, H = lay.E, lay.M, lay.H
            slots = self.tp.peer_view(self.win, dst, base + lay.recv_off, E * M * 2 * H, torch.bfloat16)
            if not native.copy_rows(slots.view(E * M, H), slot_rows[lo:hi], src.view(-1, H), src_rows[lo:hi]):
                return False
            self.tp.record_put(dst, (hi - lo) * 2 * H)
        return True

    def _send_rows(self, dst: int, src: torch.Tensor, begins: torch.Tensor, counts: torch.Tensor, lay: Layout,
                   base: int) -> None:
        """Return ``dst``'s rows as BF16: rows ``[b, b + c)`` of local expert ``e`` (``begins`` / ``counts``
        ``[L]`` int64, one run each) into slot ``me·L + e`` of ``dst``'s receive region, stored (mapped window,
        every run in one native call) or put."""
        me, L, M, H, E = self.rank, lay.L, lay.M, lay.H, lay.E
        total = int(counts.sum())
        if not total:
            return
        if self.direct[dst] and src.is_contiguous():  # each row straight into its slot
            slots = self.tp.peer_view(self.win, dst, base + lay.recv_off, E * M * 2 * H, torch.bfloat16)
            e_of = torch.repeat_interleave(torch.arange(L), counts)
            at = torch.arange(total) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
            src_rows = e_of * src.size(1) + torch.repeat_interleave(begins, counts) + at
            if native.copy_rows(slots.view(E * M, H), (me * L + e_of) * M + at, src.view(-1, H), src_rows):
                self.tp.record_put(dst, total * 2 * H)
                return
        runs = [(e, b, c) for e, (b, c) in enumerate(zip(begins.tolist(), counts.tolist())) if c]
        if self.direct[dst]:
            slots = self.tp.peer_view(self.win, dst, base + lay.recv_off, E * M * 2 * H, torch.bfloat16).view(E, M, H)
            for e, b, c in runs:
                slots[me * L + e, :c].copy_(src[e, b:b + c])
            self.tp.record_put(dst, total * 2 * H)
        elif src.is_contiguous():  # every run in one put, each read where it lies in src
            per_expert = src.size(1) * 2 * H
            self.tp.put_blocks(self.win, dst, src, [e * per_expert + b * 2 * H for e, b, _ in runs],
                               [base + lay.recv_off + (me * L + e) * M * 2 * H for e, _, _ in runs],
                               [c * 2 * H for _, _, c in runs], local_completion=False)
        else:
            for e, b, c in runs:
                self.tp.put(self.win, dst, base + lay.recv_off + (me * L + e) * M * 2 * H, src[e, b:b + c].contiguous(),
                            local_completion=False)

    def _receive_combine(self, seq, h, need, lay: Layout, flags, topk_idx, topk_weights, combined, wait_stats,
                         use_logfmt, route, mask_stamp, own=None) -> None:
        """Wait for every live source, check the headers and the counts against ``topk_idx``, then reduce
        (docs/semantics/deepep-api.md §6.3): per token, slots in order into one float32 accumulator,
        one rounding into ``combined``. ``own``: ``(src, layout_range)`` when this rank's own rows were left in
        ``src`` (the sum reads them there), else None."""
        me, L, M, H, E = self.rank, lay.L, lay.M, lay.H, lay.E
        base = h * self.half
        n, k = topk_idx.shape
        phase = f"low_latency_combine call #{seq + 1}"
        if _PH.on:
            _PH.switch("wait: signals")
        pulled = self._await_call(h, seq, OP_COMBINE, lay, flags, phase, wait_stats)
        if pulled:  # rows left in place: only the native path reads them
            raise LowLatencyRefused(
                f"rank {me}: {phase}: rank(s) {pulled} left their rows in place for the native receive (a zero-copy "
                f"combine), but this rank receives on the torch path (URMA peers, or DEEPEP_ASCEND_NATIVE=0 here "
                f"only); set DEEPEP_ASCEND_NATIVE alike on every rank")
        if _PH.on:
            _PH.switch("route")
        if route is None or not stamp_matches(mask_stamp, self.mask):  # (a shrink-mode wait may mask a source)
            route = self._route(topk_idx, L, E)
        counts = route.counts
        if _PH.on:
            _PH.switch("control")
        got = self._read_counts(base, L).view(-1).to(torch.int64)  # [R * L] = [E]
        wrong = got != counts
        if any(self.masked()):
            wrong &= (self.mask == 0).repeat_interleave(L)
        if bool(wrong.any()):
            g = int(torch.nonzero(wrong)[0, 0])
            raise LowLatencyRefused(
                f"rank {me}: {phase}: rank {g // L} returned {int(got[g])} rows of expert {g}, but this rank's "
                f"topk_idx selects it {int(counts[g])} times; combine needs the topk_idx of the dispatch that "
                f"made the handle, on every rank")
        if _PH.on:
            _PH.switch("reduce")
        if use_logfmt:  # every received row decoded once, in (expert, row) order
            decoded = self._receive_logfmt(base, lay, route.experts, route.rank)
        else:
            rows = self.tp.local_view(self.win, base + lay.recv_off, E * M * 2 * H, torch.bfloat16).view(E * M, H)
            index = torch.full((n * k,), -1, dtype=torch.int64)  # each (token, slot)'s returned row
            index[route.flat] = route.experts * M + route.rank
            if own is not None:  # own rows where they lie, the others in the window; the counts checked above
                sources = [None] * self.R
                sources[me] = (own[0], own[1].numpy()[:, me] >> 32)
                bad = native.ll_combine_recv(combined, rows, index.view(n, k), topk_weights.contiguous(),
                                             self._counts_view(base, L), route.counts32, self._mask_arg(), M, sources)
                if bad:
                    raise _count_refusal(me, phase, L, *bad)
                return
            if native.weighted_sum_rows(combined, rows, index.view(n, k), topk_weights.contiguous()):
                return  # one pass over the returned rows, the arithmetic of the loop below
        # The pairs in (token, slot) order: row_of[i] is pos[i]'s place in the route (and row of `decoded`).
        pos, row_of = torch.sort(route.flat)
        experts, rank_in_e = route.experts[row_of], route.rank[row_of]
        acc = self._scratch("acc", (n, H), torch.float32).zero_()
        y_all = self._scratch("products", (n, H), torch.float32)
        g_all = self._scratch("gathered", (n, H), torch.bfloat16)
        slot_j = pos % k
        tok = pos // k
        for j in range(k):  # docs/semantics/deepep-api.md §6.3: slots in order, one float32 accumulator, one rounding
            sel = torch.nonzero(slot_j == j).squeeze(1)
            cnt = sel.numel()
            if not cnt:
                continue
            y = y_all[:cnt]
            if use_logfmt:
                torch.index_select(decoded, 0, row_of[sel], out=y)
            else:
                g = g_all[:cnt]
                torch.index_select(rows, 0, experts[sel] * M + rank_in_e[sel], out=g)
                y.copy_(g)
            y.mul_(topk_weights[tok[sel], j].unsqueeze(1))
            if cnt == n:  # every token has slot j (tokens ascend within a slot): a dense add
                acc.add_(y)
            else:
                acc.index_add_(0, tok[sel], y)
        combined.copy_(acc)

    def _encode_logfmt(self, src, cnt_all, beg_all, lay: Layout):
        """The rows of every run (local expert ``e``, live destination ``s``: rows
        ``[beg, beg + cnt)`` of ``src[e]``) LogFMT-10 encoded once, runs in ``(e, s)`` order.
        Returns ``(meta, body, tail, first, runs, tail_first)``: int32 views of the wire parts,
        each run's first row and row count, and each row's first tail (one past the end too)."""
        R, L, M, H = self.R, lay.L, lay.M, lay.H
        cnt = cnt_all.clone()
        cnt[:, self.mask.bool()] = 0
        runs = cnt.view(-1).to(torch.int64)
        first = torch.cumsum(runs, 0) - runs
        offs = (torch.arange(L).unsqueeze(1) * (R * M) + beg_all).view(-1)
        rows = torch.repeat_interleave(offs - first, runs) + torch.arange(int(runs.sum()))
        body, meta, tail = logfmt10_encode(src.reshape(L * R * M, H).index_select(0, rows))
        fb_rows = (~logfmt10_group_mask(meta)).sum(1)
        tail_first = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(fb_rows, 0)]).tolist()
        # int32 views (every offset and size is a multiple of 4 bytes): copies move 4 bytes at a time
        return (meta.view(torch.int32), body.view(torch.int32), tail.view(torch.int32), first.tolist(),
                runs.tolist(), tail_first)

    def _send_logfmt(self, dst, enc, lay: Layout, base):
        """Store (same node, ``allow_ubmem``) or put each of ``dst``'s runs as its metadata, body
        and BF16 tails straight into slot ``me·L + e`` of ``dst``'s three regions: one copy per
        hop, nothing staged in the window."""
        me, R, L, M = self.rank, self.R, lay.L, lay.M
        meta, body, tail, first, runs, tail_first = enc
        region = base + lay.recv_off
        peer = self.tp.peer_view(self.win, dst, region, lay.lf_end, torch.int32) if self.direct[dst] else None
        nbytes = 0
        for e in range(L):
            c, a = runs[e * R + dst], first[e * R + dst]
            if not c:
                continue
            t0, t1 = tail_first[a], tail_first[a + c]
            g = me * L + e
            for off, part, size in ((g * M * lay.lf_meta, meta[a:a + c], c * lay.lf_meta),
                                    (lay.lf_body_off + g * M * lay.lf_body, body[a:a + c], c * lay.lf_body),
                                    (lay.lf_tail_off + g * M * lay.lf_tail, tail[t0:t1],
                                     (t1 - t0) * LOGFMT_TAIL_BYTES)):
                if not size:
                    continue
                if peer is not None:
                    peer[off // 4:(off + size) // 4].copy_(part.reshape(-1))
                else:
                    self.tp.put(self.win, dst, region + off, part, local_completion=False)
                nbytes += size
        if peer is not None and nbytes:
            self.tp.record_put(dst, nbytes)

    def _receive_logfmt(self, base, lay: Layout, slot_g, slot_i):
        """float32 ``[P, H]``: the received LogFMT rows ``(slot_g[p], slot_i[p])``, given in slot
        order (experts ascending, rows ascending within each: every received row once)."""
        E, M, S = lay.E, lay.M, lay.S
        region = self.tp.local_view(self.win, base + lay.recv_off, lay.lf_end, torch.int32)
        rows = slot_g * M + slot_i
        meta = region[:lay.lf_body_off // 4].view(E * M, -1).index_select(0, rows)
        meta = meta.view(torch.bfloat16).view(-1, S, 2)
        body = region[lay.lf_body_off // 4:lay.lf_tail_off // 4].view(E * M, -1).index_select(0, rows)
        body = body.view(torch.uint8).view(-1, S, LOGFMT_BODY_BYTES)
        fb = ~logfmt10_group_mask(meta)
        # The BF16 groups' tails: slot g's packed (rows, then groups) from tail g·M·S.
        per_slot = torch.zeros(E, dtype=torch.int64).index_add_(0, slot_g, fb.sum(1))
        slot_first = torch.cumsum(per_slot, 0) - per_slot
        fb_slot = slot_g[torch.nonzero(fb)[:, 0]]
        at = fb_slot * (M * S) + torch.arange(fb_slot.numel()) - slot_first[fb_slot]
        tail = region[lay.lf_tail_off // 4:].view(E * M * S, -1).index_select(0, at)
        return logfmt10_decode(body, meta, tail.view(torch.uint8))

    # -- clean ---------------------------------------------------------------------------
    def clean(self) -> None:
        """Barrier of the live ranks on the clean slot (shrink mode masks those missing the deadline)."""
        self.cleans += 1
        peers = [p for p in self.order() if p != self.rank]
        for dst in peers:
            self.tp.signal(self.ctl, dst, SLOT_CLEAN, add=self._raise_to(SLOT_CLEAN, dst, self.cleans))
        self._wait_sources(SLOT_CLEAN, self.cleans, "clean_low_latency_buffer", None, peers=peers)


def _torn_sum(rank: int, phase: str, src: int, now: int, seq: int) -> RuntimeError:
    """The error of a combine that read zero-copy source ``src``'s rows while its stamp moved to ``now``."""
    return RuntimeError(
        f"rank {rank}: {phase}: source rank {src} began rewriting its send region for LL call #{now} while this rank "
        f"read call #{seq + 1}'s rows from it (the sum may mix both); at most two LL calls may be in flight: "
        f"receive call k before issuing call k+2 (docs/semantics/deepep-api.md §6.6)")


def _count_refusal(rank: int, phase: str, num_local: int, g: int, got: int, want: int) -> LowLatencyRefused:
    """The refusal of a combine whose rows of expert ``g`` came back ``got`` times where its route expects ``want``."""
    return LowLatencyRefused(
        f"rank {rank}: {phase}: rank {g // num_local} returned {got} rows of expert {g}, but this rank's topk_idx "
        f"selects it {want} times; combine needs the topk_idx of the dispatch that made the handle, on every rank")


def _bytes_copy(t: torch.Tensor) -> torch.Tensor:
    """A fresh, standard-strided copy of the uint8 matrix ``t`` (viewable as any element size)."""
    return torch.empty(t.shape, dtype=torch.uint8).copy_(t)


def _zero_stale_rows(outputs, stale, count: torch.Tensor) -> None:
    """Zero rows ``[count[e], stale[e])`` of every expert ``e`` of each output ``[L, rows, ...]`` (``count``,
    ``stale``: ``[L]`` int32; a ``None`` stale or output is skipped): what a reused output's earlier user wrote
    past this call's rows (:meth:`OutputPool.get`)."""
    for t, old in zip(outputs, stale):
        if t is not None and old is not None:
            r = torch.arange(t.size(1))
            past = (r >= count.unsqueeze(1)) & (r < old.unsqueeze(1))  # [L, rows]
            _zero_output_rows(t, torch.nonzero(past.view(-1)).squeeze(1))


def _zero_output_rows(t: torch.Tensor, flat: torch.Tensor) -> None:
    """Zero the flat rows ``flat`` (int64 ``e·rows + r``) of an output ``t`` ``[L, rows, ...]``: a contiguous one
    as rows of bytes, one copy from a zero row each (zero bytes are the zero of every dtype, FP8 included); the
    channels-first scales (stored ``[L, S, rows]``) element by element."""
    if not flat.numel():
        return
    rows = t.size(1)
    if t.is_contiguous() and t.stride(-1) == 1:  # (a size-1 last dim is "contiguous" at any stride)
        zero_rows(t.view(torch.uint8).view(t.size(0) * rows, -1), flat)
    else:
        t[flat // rows, flat % rows] = 0


def call_name(op: int, seq: int) -> str:
    """How messages name LL call ``seq`` (0 for the first) of ``op``: ``"low_latency_combine call #4"``."""
    return f"{OP_NAMES[op]} call #{seq + 1}"


def _call_name(w) -> str:
    """A header's call as errors name it: ``"low_latency_dispatch call #4 (its 3rd low_latency_dispatch)"``."""
    op, n = (int(w[0]) >> 4) & 0xF, int(w[2]) & 0xFFFFFFFF
    name = OP_NAMES.get(op, f"operation code {op}")
    return f"{name} call #{(int(w[0]) >> 16) + 1}" + (f" (its {ordinal(n)} {name})" if n > 0 else "")


def _describe(w) -> str:
    w0, w1 = int(w[0]), int(w[1])
    flags = (w0 >> 8) & 0xFF
    return (f"M={w1 & 0xFFFF}, H={w1 >> 32}, E={(w1 >> 16) & 0xFFFF}, use_fp8={bool(flags & F_FP8)}, "
            f"use_ue8m0={bool(flags & F_UE8M0)}, use_logfmt={bool(flags & F_LOGFMT)}, "
            f"rows pulled={bool(flags & F_PULL)}")
