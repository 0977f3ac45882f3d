"""The low-latency calls' fixed work in one native call per step (``csrc/ll_calls.c``).

At a decode step's few tokens a low-latency call's time is its count of small operations, not its bytes:
the torch path of :mod:`deepep_ascend.ep.low_latency` routes, packs, unpacks and checks with some sixty
torch ops per call (a few microseconds each, whatever their size). Each function here does one of those
steps in one pass and writes the same bytes as that torch path:

* :func:`ll_route`: ``topk_idx``'s value range, the most selections of one expert, per-expert counts and
  each (token, slot)'s row in its expert's slot;
* :func:`ll_dispatch_send`: each routed token's index into its slot of every mapped destination's index
  table, and the per-expert counts;
* :func:`ll_combine_send`: every returned row of every mapped destination straight into its slot, and the
  per-expert counts;
* :func:`ll_dispatch_recv`: counts -> ``recv_count`` / ``layout_range``, every routed row loaded from its
  source's send region -> ``recv_x`` / scales / ``src_info``, then the sources' stamps (a seqlock);
  :func:`ll_stream_rows` says when it stores those rows by streaming stores;
* :func:`ll_combine_recv`: the counts against the route's, then the weighted sum of the returned rows;
* :func:`ll_headers_agree`: the call headers' consensus in one pass (the caller explains a disagreement);
* :func:`ll_publish`: a call's header into every destination, one fence, every destination's signal word;
* :func:`ll_await`: the receive's wait while the peers are on time (bounded polling), then the headers.

No DeepEP call of their own: the steps inside DeepEP's low-latency kernels. Each returns None / False where
the library is not loaded (the caller then takes its torch path). Window memory is passed as byte
addresses (``bases``: one per rank, 0 where a rank is not mapped) plus byte offsets the caller derived from
a layout it checked against the window; the tensors are checked here, the row numbers in C before anything
is written.
"""

from __future__ import annotations

import ctypes
import operator

import numpy as np
import torch

from .. import settings
from .loader import kernels
from .operands import mark_written, require_dense
from .rows import NAN_BITS

__all__ = ["LL_STREAM_MODES", "LL_STREAM_SIDES", "ll_available", "ll_await", "ll_combine_recv", "ll_combine_send",
           "ll_dispatch_recv", "ll_dispatch_send", "ll_headers_agree", "ll_publish", "ll_route",
           "ll_stream_min_bytes", "ll_stream_rows", "ll_streams", "signals_available", "stream_side_number"]

#: :func:`ll_stream_rows`' modes, in the kernel's numbering.
LL_STREAM_MODES = ("never", "large", "always")
#: :func:`ll_stream_rows`' sides, in the kernel's numbering: a dispatch's received rows, a combine's sent rows.
LL_STREAM_SIDES = ("receive", "send")


def ll_available() -> bool:
    """Whether every function of this module has its kernel loaded (else each returns None / False)."""
    k = kernels
    return not (k.ll_route is None or k.ll_dispatch_send is None or k.ll_dispatch_recv is None
                or k.ll_combine_send is None or k.ll_combine_recv is None or k.ll_headers_agree is None)


def signals_available() -> bool:
    """Whether :func:`ll_publish` and :func:`ll_await` have their kernels loaded."""
    return kernels.ll_publish is not None and kernels.ll_await is not None


def _mask(op: str, mask, num_ranks: int):
    """``mask``'s address (None: no rank masked), after checking it is ``[R]`` int32."""
    if mask is None:
        return None
    require_dense(op, "mask", mask, torch.int32, num_ranks)
    return mask.data_ptr()


def ll_route(topk_idx: torch.Tensor, num_experts: int, m: int) -> tuple[int, list, torch.Tensor, torch.Tensor] | None:
    """One pass over ``topk_idx``: what a low-latency call checks and routes by.

    Args:
        topk_idx: ``[n, k]`` contiguous int64, ``-1`` = no expert.
        num_experts: ``E >= 1``; m: ``M >= 1``, the rows per (expert, source) slot.
    Returns:
        None where the kernel is not loaded; else ``(status, [lo, hi, most, arg], counts, slots)``:
        ``lo``/``hi`` the smallest and largest value (0, 0 when empty); status 1: a value outside ``[-1, E)``
        (nothing else computed); else ``most`` selections of expert ``arg`` (the first selected that often,
        each slot of a row counting) and ``counts`` ``[E]`` int32 the selections per expert; status 2: ``most
        > M`` (``slots`` not computed); status 0: ``slots`` ``[n, k]`` int64, ``e·M + i`` for the pair that is
        the ``i``-th of expert ``e``'s pairs in (token, slot) order, ``-1`` where ``topk_idx`` is ``-1``.
    Raises:
        ValueError: ``topk_idx`` not a contiguous 2-D int64 CPU tensor; ``E`` or ``M`` not a positive int.
    """
    fn = kernels.ll_route
    if fn is None:
        return None
    require_dense("ll_route", "topk_idx", topk_idx, torch.int64, ndim=2)
    for name, v in (("num_experts", num_experts), ("m", m)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"deepep_ascend.native.ll_route: {name} must be a positive int, got {v!r}")
    n, k = topk_idx.shape
    counts = torch.empty(num_experts, dtype=torch.int32)
    slots = torch.empty(n, k, dtype=torch.int64)
    stats = (ctypes.c_int64 * 4)()  # a ctypes array: a torch tensor and its tolist() cost several times more
    status = fn(n, k, topk_idx.data_ptr(), num_experts, m, counts.data_ptr(), slots.data_ptr(), stats)
    return int(status), stats[:], counts, slots


def ll_dispatch_send(slots: torch.Tensor, m: int, num_local: int, me: int, bases: torch.Tensor,
                     mask: torch.Tensor | None, index_off: int, counts_off: int, counts: torch.Tensor,
                     sent: torch.Tensor) -> bool:
    """A dispatch's route and counts into every mapped, unmasked destination (DeepEP's dispatch send, with the
    rows left in this rank's send region for the receivers to load, :func:`ll_dispatch_recv`).

    Pair ``(t, j)`` with ``slots[t, j] = e·M + i`` (:func:`ll_route`) goes to rank ``d = e // L``: the int32
    token ``t`` at byte ``bases[d] + index_off + (((e % L)·R + me)·M + i)·4`` (the destination's index table
    ``[L, R, M]``). Then ``counts[d·L:(d+1)·L]`` at ``bases[d] + counts_off``.

    Args:
        slots: ``[n, k]`` contiguous int64 in ``[-1, L·R·M)``. bases: ``[R]`` contiguous int64 addresses (0: not
            mapped). mask: ``[R]`` int32 or None. counts: ``[L·R]`` contiguous int32. sent: ``[R]`` contiguous
            int64, set to the pairs routed to each rank.
    Returns:
        True when done; False (nothing written) where the kernel is not loaded.
    Raises:
        ValueError: operands of another dtype, shape or layout, or slots out of range (nothing written).
    """
    fn = kernels.ll_dispatch_send
    if fn is None:
        return False
    op = "ll_dispatch_send"
    require_dense(op, "slots", slots, torch.int64, ndim=2)
    num_ranks = bases.numel()
    require_dense(op, "bases", bases, torch.int64, num_ranks)
    require_dense(op, "counts", counts, torch.int32, num_local * num_ranks)
    require_dense(op, "sent", sent, torch.int64, num_ranks)
    n, k = slots.shape
    if fn(n, k, slots.data_ptr(), m, num_local, num_ranks, me, bases.data_ptr(), _mask(op, mask, num_ranks),
          index_off, counts_off, counts.data_ptr(), sent.data_ptr()):
        raise ValueError(f"deepep_ascend.native.{op}: slots must lie in [-1, {num_local * num_ranks * m})")
    return True


def ll_stream_rows(mode: str | None = None, min_bytes: int | None = None, *, side: str = "receive") -> str | None:
    """When the low-latency calls store their rows by streaming (non-temporal) stores, which write memory without
    first reading each destination line, per ``side``: ``"receive"``, :func:`ll_dispatch_recv`'s rows into
    ``recv_x`` (every low-latency dispatch's receive on one node); ``"send"``, the rows a combine returns: those
    :func:`ll_combine_send` stores into the destinations' windows (every low-latency combine's sends on one node,
    zero-copy excepted) and those a normal-mode combine on one node stages in its window for the origins to read
    (:meth:`IntranodePlan.stage <deepep_ascend.native.IntranodePlan.stage>`). Each side's
    mode: ``"large"`` (the default) when the call's rows take at least its ``min_bytes`` (16 MiB received, 2 MiB
    sent by default), ``"never"`` or ``"always"``; rows under 256 bytes are copied plainly in every mode. The
    bytes written are the same; the stores are faster into cold lines, and the rows' next read (the experts', the
    combine's sum) slower where they would have been cached, which only a call's rows that fit in the cache can
    be (docs/design/data-path.md, "Streaming stores", measures both; ``python -m bench ll-receive``,
    ``python -m bench low-latency --stream-rows / --stream-sends``). Modes and thresholds are this process's (each
    rank sets its own), set from ``DEEPEP_ASCEND_LL_STREAM_ROWS`` / ``_MIN_BYTES`` and
    ``DEEPEP_ASCEND_LL_STREAM_SENDS`` / ``_SEND_MIN_BYTES`` when the library loads.

    Args:
        mode: ``"never"``, ``"large"`` or ``"always"`` to set it, or None to leave it.
        min_bytes: ``"large"``'s threshold in bytes of the call's rows (received, or copied by a combine) (an int
            in ``[0, 2**63)``) to set it, or None to leave it (:func:`ll_stream_min_bytes` reads it).
        side: ``"receive"`` or ``"send"``.
    Returns:
        The side's mode in force after the call; None where the library is not loaded.
    Raises:
        ValueError: ``mode`` is not None nor one of the three, ``min_bytes`` not None nor such an int, or ``side``
            not one of the two (nothing set).
    """
    code = stream_side_number("ll_stream_rows", side)
    if mode is not None and mode not in LL_STREAM_MODES:
        raise ValueError(f"deepep_ascend.native.ll_stream_rows: mode must be one of {', '.join(LL_STREAM_MODES)} "
                         f"or None, got {mode!r}")
    nbytes = -1 if min_bytes is None else _byte_count("ll_stream_rows", "min_bytes", min_bytes, none_ok=True)
    fn = kernels.ll_stream_rows
    if fn is None:
        return None
    return LL_STREAM_MODES[int(fn(code, -1 if mode is None else LL_STREAM_MODES.index(mode), nbytes, None))]


def ll_stream_min_bytes(*, side: str = "receive") -> int | None:
    """:func:`ll_stream_rows`' threshold in force for ``side`` (``"receive"`` or ``"send"``): ``"large"`` streams a
    call's rows from this many bytes on; None where the library is not loaded.

    Raises:
        ValueError: ``side`` is not one of the two.
    """
    code = stream_side_number("ll_stream_min_bytes", side)
    fn = kernels.ll_stream_rows
    if fn is None:
        return None
    out = (ctypes.c_int64 * 1)()  # (an array, which both ways of calling take as a pointer)
    fn(code, -1, -1, out)
    return out[0]


def ll_streams(rows_bytes: int, *, side: str = "receive") -> bool | None:
    """Whether a low-latency call's ``rows_bytes`` bytes of rows on ``side`` (``"receive"``: rows times the bytes of
    one row's ``recv_x`` payload; ``"send"``: the rows a combine copies times their bytes, its own rows too where it
    copies them (a low-latency combine with a hook or ``async_finish``, which cannot sum them where they lie); an int
    in ``[0, 2**63)``) are stored by streaming stores under the side's mode and threshold in force (the decision the
    kernel itself takes); None where the library is not loaded.

    Raises:
        ValueError: ``rows_bytes`` is not such an int, or ``side`` not one of the two.
    """
    code = stream_side_number("ll_streams", side)
    nbytes = _byte_count("ll_streams", "rows_bytes", rows_bytes)
    fn = kernels.ll_streams
    if fn is None:
        return None
    return bool(fn(code, nbytes))


def stream_side_number(op: str, side, name: str = "side", none_ok: bool = False) -> int:
    """``side``'s number in the kernels (its index in :data:`LL_STREAM_SIDES`; -1 for None where ``none_ok``: no
    side, plain stores), for the callers of :func:`ll_stream_rows` and of the kernels that take a side
    (:meth:`IntranodePlan.stage <deepep_ascend.native.IntranodePlan.stage>`).

    Raises:
        ValueError: ``side`` is not one of the sides (nor None with ``none_ok``), naming ``op`` and ``name``.
    """
    if none_ok and side is None:
        return -1
    if side not in LL_STREAM_SIDES:
        raise ValueError(f"deepep_ascend.native.{op}: {name} must be {'None or ' if none_ok else ''}one of "
                         f"{', '.join(LL_STREAM_SIDES)}, got {side!r}")
    return LL_STREAM_SIDES.index(side)


def _byte_count(op: str, name: str, value, none_ok: bool = False) -> int:
    """``value`` as an int in ``[0, 2**63)`` (any integer, numpy's too; not a bool), else ``ValueError`` naming
    ``op`` and ``name``."""
    try:
        n = -1 if isinstance(value, bool) else operator.index(value)
    except TypeError:
        n = -1
    if not 0 <= n < 1 << 63:
        raise ValueError(f"deepep_ascend.native.{op}: {name} must be an int in [0, 2**63)"
                         f"{' or None' if none_ok else ''}, got {value!r}")
    return n


def _stream_from_settings() -> None:
    """Both sides' store modes and thresholds from the settings, once, when this module loads.

    Raises:
        deepep_ascend.settings.SettingError: either variable holds a bad value.
    """
    ll_stream_rows(settings.LL_STREAM_ROWS.get(), settings.LL_STREAM_MIN_BYTES.get())
    ll_stream_rows(settings.LL_STREAM_SENDS.get(), settings.LL_STREAM_SEND_MIN_BYTES.get(), side="send")


def ll_dispatch_recv(sig: torch.Tensor, mask: torch.Tensor | None, index: torch.Tensor, bases: torch.Tensor,
                     send_off: int, stamps: torch.Tensor, want: int, m: int, mb: int, recv_x: torch.Tensor,
                     scales: torch.Tensor | None, src_info: torch.Tensor, recv_count: torch.Tensor,
                     layout_range: torch.Tensor, stale: tuple = (None, None, None)) -> tuple[int, list] | None:
    """A dispatch's receive: the counts into ``recv_count`` / ``layout_range``, every row loaded from its source.

    Source ``s``'s count for local expert ``e`` is ``sig[s, e]`` (a masked source counts 0); its ``i``-th
    message there is token ``t = index[e, s, i]`` of ``s``, whose message ``[16 header bytes | payload |
    scale words]`` lies at byte ``bases[s] + send_off + t·mb``. It lands in row ``q = begin + i`` of expert
    ``e``, ``begin`` the counts of the sources before ``s``: its payload in ``recv_x[e, q]``, ``t`` in
    ``src_info[e, q]``, its scale words in ``scales[e, q, :]``. The rows of the torch path of
    ``LowLatencyEngine._receive_dispatch``, byte for byte. Then the seqlock: the int64 word at address
    ``stamps[s]`` (0: not checked) of every unmasked source must still read ``want`` (a source stamps it
    before rewriting its send region).

    Args:
        sig: ``[R, L]`` contiguous int32. mask: ``[R]`` int32 or None. index: ``[L·R·M]`` contiguous int32.
        bases, stamps: ``[R]`` contiguous int64 addresses. recv_x: ``[L, R·M, xb]`` contiguous uint8 (the
            payload bytes). scales: None, or the channels-first ``[L, R·M, sw]`` scales, stored ``[L, sw, R·M]``
            (4-byte words). src_info: ``[L, R·M]`` contiguous int32. recv_count: ``[L]`` int32. layout_range:
            ``[L, R]`` int64.
        stale: for ``recv_x``, ``scales``, ``src_info`` each None or ``[L]`` contiguous int32: rows ``[0, stale[e])``
            of expert ``e`` hold an earlier call's data; those this call does not write are zeroed, so every row
            past ``recv_count[e]`` reads 0 (a reused output zeroed only where needed).
    Returns:
        None where the kernel is not loaded; else ``(status, bad)``: 0 done; 1 a count outside ``[0, M]``
        (nothing written); 4 a live source with rows but no address or a token index outside ``[0, M)``
        (nothing written; ``bad = [s, e, i]``, ``i = -1`` for the address); 3 a stamp changed: the rows may be
        torn (outputs written; ``bad = [s, stamp read]``).
    Raises:
        ValueError: operands of another dtype, shape or layout; a stale count outside ``[0, R·M]`` (nothing
            written).
    """
    fn = kernels.ll_dispatch_recv
    if fn is None:
        return None
    op = "ll_dispatch_recv"
    require_dense(op, "sig", sig, torch.int32, ndim=2)
    num_ranks, num_local = sig.shape
    rm = num_ranks * m
    require_dense(op, "index", index, torch.int32, num_local * rm)
    require_dense(op, "bases", bases, torch.int64, num_ranks)
    require_dense(op, "stamps", stamps, torch.int64, num_ranks)
    require_dense(op, "recv_x", recv_x, torch.uint8, ndim=3)
    xb = recv_x.size(2)
    if tuple(recv_x.shape[:2]) != (num_local, rm) or mb < 16 + xb:
        raise ValueError(f"deepep_ascend.native.{op}: recv_x must be [{num_local}, {rm}, <= {mb - 16}] uint8, got "
                         f"shape {tuple(recv_x.shape)}")
    sw = 0
    if scales is not None:
        if not (scales.dim() == 3 and scales.element_size() == 4 and tuple(scales.shape[:2]) == (num_local, rm)
                and scales.stride() == (scales.size(2) * rm, 1, rm)):
            raise ValueError(f"deepep_ascend.native.{op}: scales must be a channels-first [{num_local}, {rm}, S] "
                             f"tensor of 4-byte words, got {scales.dtype} of shape {tuple(scales.shape)}, strides "
                             f"{scales.stride()}")
        sw = scales.size(2)
        if mb < 16 + xb + 4 * sw:
            raise ValueError(f"deepep_ascend.native.{op}: {sw} scale words do not fit a {mb}-byte message after "
                             f"{xb} payload bytes")
    require_dense(op, "src_info", src_info, torch.int32, num_local * rm)
    require_dense(op, "recv_count", recv_count, torch.int32, num_local)
    require_dense(op, "layout_range", layout_range, torch.int64, num_local * num_ranks)
    if len(stale) != 3:
        raise ValueError(f"deepep_ascend.native.{op}: stale must hold 3 entries (recv_x, scales, src_info), got "
                         f"{len(stale)}")
    for name, c in zip(("stale[0]", "stale[1]", "stale[2]"), stale):
        if c is not None:
            require_dense(op, name, c, torch.int32, num_local)
    bad = (ctypes.c_int64 * 3)()
    status = fn(num_local, num_ranks, m, sig.data_ptr(), _mask(op, mask, num_ranks), index.data_ptr(),
                bases.data_ptr(), send_off, stamps.data_ptr(), want, mb, xb, sw, recv_x.data_ptr(),
                0 if scales is None else scales.data_ptr(), src_info.data_ptr(), recv_count.data_ptr(),
                layout_range.data_ptr(), (ctypes.c_void_p * 3)(*(None if c is None else c.data_ptr() for c in stale)),
                bad)
    if status == 2:
        raise ValueError(f"deepep_ascend.native.{op}: stale counts must lie in [0, {rm}]")
    if status in (0, 3):
        if scales is None:
            mark_written(recv_x, src_info, recv_count, layout_range)
        else:
            mark_written(recv_x, src_info, recv_count, layout_range, scales)
    return int(status), list(bad)


#: ``ll_combine_send``'s ``keep`` → the kernel's mode (csrc/ll_calls.c).
_KEEP_MODES = {"none": 0, "own": 1, "all": 2}


def ll_combine_send(layout_range: torch.Tensor, src: torch.Tensor, m: int, me: int, bases: torch.Tensor,
                    mask: torch.Tensor | None, recv_off: int, counts_off: int, sent: torch.Tensor,
                    keep: str = "none") -> bool:
    """A combine's rows and counts into every mapped, unmasked destination (DeepEP's combine send).

    For destination ``d`` and local expert ``e`` with ``layout_range[e, d] = b << 32 | c``: rows ``src[e, b:b +
    c]`` into rows ``0..c-1`` of slot ``me·L + e`` at ``bases[d] + recv_off`` (slot ``g`` row ``i`` at byte
    ``(g·M + i)·row_bytes``), then the ``L`` counts (int32) at ``bases[d] + counts_off``. ``keep`` says which
    rows stay in ``src`` (their counts are written all the same): ``"none"``; ``"own"``, this rank's own rows
    (its receive reads them there, :func:`ll_combine_recv`'s ``sources``); ``"all"``, every row (``src`` is
    this rank's send region, where the receivers read their rows: a zero-copy combine).

    Args:
        layout_range: ``[L, R]`` contiguous int64. src: ``[L, R·M, H]`` of any dtype, unit last stride.
        bases: ``[R]`` contiguous int64 addresses (0: not mapped). mask: ``[R]`` int32 or None.
        sent: ``[R]`` contiguous int64, set to the rows per rank: copied there, or with ``keep="all"`` left for
            it to read (``sent[me]`` is 0 unless ``keep="none"``).
    Returns:
        True when done; False (nothing written) where the kernel is not loaded.
    Raises:
        ValueError: operands of another dtype, shape or layout; ``keep`` not one of the three; a count above
            ``M`` or a run outside ``[0, R·M)`` (nothing written).
    """
    fn = kernels.ll_combine_send
    if fn is None:
        return False
    op = "ll_combine_send"
    mode = _KEEP_MODES.get(keep)
    if mode is None:
        raise ValueError(f"deepep_ascend.native.{op}: keep must be one of {sorted(_KEEP_MODES)}, got {keep!r}")
    require_dense(op, "layout_range", layout_range, torch.int64, ndim=2)
    num_local, num_ranks = layout_range.shape
    require_dense(op, "bases", bases, torch.int64, num_ranks)
    require_dense(op, "sent", sent, torch.int64, num_ranks)
    if not _expert_rows_ok(src, num_local, num_ranks * m):
        raise ValueError(f"deepep_ascend.native.{op}: src must be [{num_local}, {num_ranks * m}, H] with unit last "
                         f"stride, got shape {tuple(getattr(src, 'shape', ()))}")
    e = src.element_size()
    if fn(num_local, num_ranks, m, src.size(2) * e, me, layout_range.data_ptr(), src.data_ptr(), src.stride(0) * e,
          src.stride(1) * e, bases.data_ptr(), _mask(op, mask, num_ranks), recv_off, counts_off,
          mode, sent.data_ptr()):
        raise ValueError(f"deepep_ascend.native.{op}: layout_range holds a count above M={m} or a run outside "
                         f"[0, {num_ranks * m})")
    return True


def ll_combine_recv(out: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor,
                    sig: torch.Tensor, expected: torch.Tensor, mask: torch.Tensor | None, m: int,
                    sources: list | None = None) -> tuple | None:
    """A combine's receive: the counts returned against the route's, then DeepEP's weighted sum
    (docs/semantics/deepep-api.md §6.3): ``out[t] = bf16(Σ_j f32(rows[slots[t, j]]) * weights[t, j])`` over the
    slots ``j`` with ``slots[t, j] >= 0`` whose expert ``slots[t, j] // M`` lives on an unmasked rank, in slot
    order from ``+0.0``, each product rounded to float32 before its add, one rounding (the bits of
    :func:`~deepep_ascend.native.weighted_sum_rows`).

    Args:
        out: ``[n, H]`` bfloat16, unit column stride, rows apart. rows: ``[E·M, H]`` bfloat16, unit column stride.
        slots: ``[n, k]`` contiguous int64 (:func:`ll_route`). weights: ``[n, k]`` contiguous float32.
        sig: ``[R, L]`` contiguous int32, rank ``s``'s rows of its local expert ``e`` at ``sig[s, e]``.
        expected: ``[E]`` int32, the rows this rank expects of each expert. mask: ``[R]`` int32 or None.
        sources: None, or one entry per rank: None (that rank's rows are in ``rows``, slots ``[d·L·M,
            (d+1)·L·M)``), or ``(src, begin)``: its rows lie in ``src`` ``[L, R·M, H]`` bfloat16 (unit last
            stride), row ``i`` of local expert ``e`` at ``src[e, begin[e] + i]`` (``begin`` ``[L]`` int64, a
            numpy array or tensor): this rank's own experts' outputs where :func:`ll_combine_send` with
            ``keep="own"`` left them, or a zero-copy source's send region. The same bits as with those rows
            copied into ``rows``.
    Returns:
        None where the kernel is not loaded; ``()`` when done; ``(g, got, want)`` for the first expert ``g`` of
        an unmasked rank whose count differs (nothing written).
    Raises:
        ValueError: operands of another dtype, shape or layout, slots outside ``[-1, E·M)``, or a ``begin``
            whose run leaves its ``src`` or a slot of such a rank at or past its count (nothing written).
    """
    fn = kernels.ll_combine_recv
    if fn is None:
        return None
    op = "ll_combine_recv"
    require_dense(op, "sig", sig, torch.int32, ndim=2)
    num_ranks, num_local = sig.shape
    require_dense(op, "expected", expected, torch.int32, num_ranks * num_local)
    require_dense(op, "slots", slots, torch.int64, ndim=2)
    require_dense(op, "weights", weights, torch.float32, slots.numel())
    n, k = slots.shape
    # (shapes and strides read once each: every size() / stride() call costs a few hundred ns)
    if not (isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and out.dim() == 2
            and isinstance(rows, torch.Tensor) and rows.dtype == torch.bfloat16 and rows.dim() == 2
            and _matrices_ok(n, out.shape, out.stride(), rows.shape, rows.stride())):
        raise ValueError(f"deepep_ascend.native.{op}: out must be [{n}, H] and rows [E·M, H] bfloat16 matrices with "
                         f"unit column stride and rows apart, got {tuple(getattr(out, 'shape', ()))} and "
                         f"{tuple(getattr(rows, 'shape', ()))}")
    addr_p = ld_p = begins_p = 0
    if sources is not None:
        if len(sources) != num_ranks:
            raise ValueError(f"deepep_ascend.native.{op}: sources must have one entry per rank ({num_ranks}), got "
                             f"{len(sources)}")
        # one int64 block [addr R | ld 2R | begins R·L] (one allocation, one ctypes address: each costs a microsecond)
        meta = np.zeros(num_ranks * (3 + num_local), dtype=np.int64)
        addr, ld = meta[:num_ranks], meta[num_ranks:3 * num_ranks]
        begins = meta[3 * num_ranks:].reshape(num_ranks, num_local)
        addr_p = meta.ctypes.data
        ld_p, begins_p = addr_p + 8 * num_ranks, addr_p + 24 * num_ranks
        hidden = out.shape[1]
        for d, entry in enumerate(sources):
            if entry is None:
                continue
            src, begin = entry
            begin = np.asarray(begin)
            if not (_expert_rows_ok(src, num_local, num_ranks * m, hidden) and src.dtype == torch.bfloat16
                    and begin.dtype == np.int64 and begin.shape == (num_local,)):
                raise ValueError(f"deepep_ascend.native.{op}: sources[{d}] must be (src [{num_local}, "
                                 f"{num_ranks * m}, {hidden}] bfloat16 with unit last stride, begin [{num_local}] "
                                 f"int64), got {tuple(getattr(src, 'shape', ()))} and {begin.dtype} "
                                 f"{tuple(begin.shape)}")
            addr[d] = src.data_ptr()
            ld[2 * d:2 * d + 2] = src.stride()[:2]
            begins[d] = begin
    bad = (ctypes.c_int64 * 3)()
    (num_rows, hidden), row_ld = rows.shape, rows.stride(0)
    status = fn(n, k, hidden, m, num_local, num_ranks, sig.data_ptr(), _mask(op, mask, num_ranks),
                expected.data_ptr(), rows.data_ptr(), row_ld, num_rows, slots.data_ptr(),
                weights.data_ptr(), out.data_ptr(), out.stride(0), NAN_BITS, addr_p, ld_p, begins_p, num_ranks * m,
                bad)
    if status == 2:
        return tuple(bad)
    if status:
        raise ValueError(f"deepep_ascend.native.{op}: slots must lie in [-1, {rows.size(0)})"
                         + ("" if sources is None else ", and each source's runs and rows within its src and counts"))
    mark_written(out)
    return ()


def _matrices_ok(n: int, out_shape, out_strides, rows_shape, rows_strides) -> bool:
    """:func:`ll_combine_recv`'s ``out`` ``[n, H]`` and ``rows`` ``[*, H]``: unit column strides, ``out``'s rows
    apart."""
    return (out_shape[0] == n and out_strides[1] == 1 and (n <= 1 or out_strides[0] >= out_shape[1])
            and rows_shape[1] == out_shape[1] and rows_strides[1] == 1)


def _expert_rows_ok(t, num_local: int, rm: int, hidden: int | None = None) -> bool:
    """Whether ``t`` is the experts' rows of a combine, ``[L, R·M, H]`` with unit last stride (``H`` = ``hidden``
    unless None): :func:`ll_combine_send`'s ``src`` and each of :func:`ll_combine_recv`'s ``sources``.
    Shapes and strides read once each (every call costs a few hundred ns)."""
    if not (isinstance(t, torch.Tensor) and t.dim() == 3):
        return False
    shape, strides = t.shape, t.stride()
    return (shape[0] == num_local and shape[1] == rm and (hidden is None or shape[2] == hidden)
            and (strides[2] == 1 or shape[2] <= 1))


def ll_headers_agree(hdr: torch.Tensor, me: int, mask: torch.Tensor | None, seq: int, op_code: int,
                     ignore_flags: int = 0) -> int | None:
    """Whether every unmasked source's call header (``hdr`` ``[R, W]`` contiguous int64, word 0 = ``seq << 16 |
    flags << 8 | op << 4 | status``, word 1 = ``M, E, H``, word 2's high half = the dispatch a combine's handle
    came from, 0 if not known) reads call ``seq`` of ``op_code`` with status 0 and the flags (but the bits of
    ``ignore_flags``, a per-source choice) and word 1 of this rank's (row ``me``), the nonzero dispatch numbers
    all one: 0 when not; else 1, or 3 when an unmasked source's header sets a bit of ``ignore_flags``. None
    where the kernel is not loaded.

    Raises:
        ValueError: ``hdr`` not such a tensor, ``me`` outside its rows.
    """
    fn = kernels.ll_headers_agree
    if fn is None:
        return None
    op = "ll_headers_agree"
    require_dense(op, "hdr", hdr, torch.int64, ndim=2)
    rows, words = hdr.shape  # (one shape read: each size() call costs as much as the kernel)
    if not 0 <= me < rows or words < 2:
        raise ValueError(f"deepep_ascend.native.{op}: rank {me} outside the {rows} headers of {words} words (>= 2 "
                         f"needed)")
    return int(fn(rows, me, hdr.data_ptr(), words, _mask(op, mask, rows), seq, op_code, ignore_flags))


def ll_publish(order: torch.Tensor, hdr: torch.Tensor, hdr_addrs: torch.Tensor, sig_addrs: torch.Tensor,
               value: int) -> bool:
    """Publish a call to the destinations ``order`` by stores (transports' ``signal()`` made of plain stores):
    the header ``hdr`` into each one's header slot ``hdr_addrs[d]``, one full fence, then ``value`` into each
    one's signal word ``sig_addrs[d]`` (the word of this rank, its only writer: ``Transport.signal_address``).

    Args:
        order: ``[n]`` contiguous int64 destination ranks. hdr: a contiguous tensor of ``8·W`` bytes (the
            header's int64 words). hdr_addrs, sig_addrs: ``[R]`` contiguous int64 byte addresses, nonzero
            (mapped) at every rank of ``order``. value: the signals' new value.
    Returns:
        True when done; False (nothing written) where the kernel is not loaded.
    Raises:
        ValueError: operands of another dtype or layout, a destination outside ``[0, R)`` or not mapped
            (nothing written).
    """
    fn = kernels.ll_publish
    if fn is None:
        return False
    op = "ll_publish"
    require_dense(op, "order", order, torch.int64, ndim=1)
    require_dense(op, "hdr_addrs", hdr_addrs, torch.int64, ndim=1)
    num_ranks = hdr_addrs.numel()
    require_dense(op, "sig_addrs", sig_addrs, torch.int64, num_ranks)
    nbytes = hdr.numel() * hdr.element_size() if isinstance(hdr, torch.Tensor) else -1
    if nbytes <= 0 or nbytes % 8 or not hdr.is_contiguous():
        raise ValueError(f"deepep_ascend.native.{op}: hdr must be a contiguous tensor of whole int64 words, got "
                         f"{type(hdr).__name__} of {nbytes} bytes")
    if fn(order.numel(), order.data_ptr(), num_ranks, hdr.data_ptr(), nbytes // 8, hdr_addrs.data_ptr(),
          sig_addrs.data_ptr(), int(value)):
        raise ValueError(f"deepep_ascend.native.{op}: every rank of order {order.tolist()} must lie in "
                         f"[0, {num_ranks}) with a mapped header slot and signal word")
    return True


def ll_await(sig_addr: int, num_ranks: int, mask: torch.Tensor | None, need: int, polls: int, hdr: torch.Tensor,
             me: int, seq: int, op_code: int, ignore_flags: int = 0) -> int | None:
    """The receive's wait while the peers are on time: this rank's signal words ``[R]`` int64 at ``sig_addr``
    (``Transport.signal_words_address``) polled up to ``polls`` rounds until every unmasked source's reads
    ``need``; then (acquire) :func:`ll_headers_agree` of ``hdr``.

    Returns:
        None where the kernel is not loaded; -1 when a source is still short after ``polls`` rounds (the caller
        waits the long way: ``Transport.wait_until``, its deadline, its abort checks); else
        :func:`ll_headers_agree`'s answer.
    Raises:
        ValueError: ``hdr`` not ``[R, W >= 2]`` contiguous int64, ``me`` outside it, a zero ``sig_addr``.
    """
    fn = kernels.ll_await
    if fn is None:
        return None
    op = "ll_await"
    require_dense(op, "hdr", hdr, torch.int64, ndim=2)
    rows, words = hdr.shape
    if rows != num_ranks or not 0 <= me < rows or words < 2 or not sig_addr:
        raise ValueError(f"deepep_ascend.native.{op}: hdr must hold {num_ranks} headers of >= 2 words with rank {me} "
                         f"among them, and the signal words an address; got {tuple(hdr.shape)}, {sig_addr:#x}")
    return int(fn(rows, me, sig_addr, _mask(op, mask, rows), need, max(int(polls), 0), hdr.data_ptr(), words, seq,
                  op_code, ignore_flags))


_stream_from_settings()
