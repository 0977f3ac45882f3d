"""MegaMoE's expert waves: the wave size, and one call's pipeline of waves on each backend (``shm``: pulls
from the peers' segments and one barrier; ``buffer``: dispatch and combine through the normal-mode
:class:`~deepep_ascend.Buffer`). The caller computes each wave (:class:`~.experts.Experts`) while the
Buffer's worker moves the next one (docs/semantics/mega-moe.md §5, "Waves" and "Pipeline")."""

from __future__ import annotations

import numbers
import time

import torch

from ..ordering import stable_argsort
from ..rounding import ceil_div
from ..settings import MEGA_MOE_EXPERTS_PER_WAVE, SettingError
from ..transports import TransportPoisoned
from .experts import shared_terms
from .formats import FP8, dispatch_row_bytes

_WAVE_BYTES = 24 << 20  # rows a rank moves (dispatch + combine) per wave by default; see experts_per_wave
_MAX_WAVES = 4


def wave_override(num_experts_per_wave, op: str):
    """The wave size asked for on this rank: the keyword, else ``$DEEPEP_ASCEND_MEGA_MOE_EXPERTS_PER_WAVE``,
    else ``None`` (the default rule). Raises ``ValueError`` naming the keyword or the variable."""
    if num_experts_per_wave is not None:
        if (isinstance(num_experts_per_wave, bool) or not isinstance(num_experts_per_wave, numbers.Integral)
                or num_experts_per_wave < 1):
            raise ValueError(f"{op}: num_experts_per_wave must be a positive int, got {num_experts_per_wave!r}")
        return int(num_experts_per_wave)
    try:
        return MEGA_MOE_EXPERTS_PER_WAVE.get()
    except SettingError as exc:
        raise SettingError(f"{op}: {exc}") from None


def experts_per_wave(sb, counts, override):
    """Wave size in local experts, the same on every rank: ``override`` (from :func:`wave_override`, equal on
    every rank) capped at ``E_l``, else the default rule from the all-gathered counts ``[R, E]``: one wave per
    24 MiB a rank moves (dispatch and combine bytes of the pairs it receives, on average), rounded, between 1
    and ``min(4, E_l)``."""
    el = sb.num_local_experts
    if override is not None:
        return min(override, el)
    rows = int(counts.sum()) / sb.num_ranks  # rows each rank receives, on average
    row_bytes = dispatch_row_bytes(sb.hidden, sb.is_fp8) + 2 * sb.hidden  # + the bf16 row combined back
    waves = max(1, min(_MAX_WAVES, el, round(rows * row_bytes / _WAVE_BYTES)))
    return ceil_div(el, waves)


# ----------------------------------------------------------------------------------------------
# shm backend


def _pull(sb, cmat, tokens, per_expert, lo, hi):
    """The rows of every pair that the ranks route to this rank's experts ``[lo, hi)``, gathered from each
    source rank (ascending) straight out of its views: ``(data [n, H] as x, sf [n, H/32] uint8 UE8M0 bytes or
    None, local expert ids [n] int64 (0 = expert lo), routing weights [n] float32)``. Raises RuntimeError when
    a rank's ``topk_idx`` no longer routes the pairs its counts announced."""
    me, nr, k, peers, tp = sb.rank, sb.num_ranks, sb.num_topk, sb._peer_views, sb.ep_buffer.runtime
    n = int(per_expert[lo:hi].sum())
    data = torch.empty(n, sb.hidden, dtype=sb.x.dtype)
    sf = torch.empty(n, sb.hidden // 128, dtype=torch.int32) if sb.is_fp8 else None
    ws = torch.empty(n, dtype=torch.float32)
    local = torch.empty(n, dtype=torch.int64)
    c = 0
    for s in range(nr):
        v = peers[s]
        ids = v["topk_idx"][:tokens[s]].reshape(-1)
        sel = torch.nonzero((ids >= lo) & (ids < hi)).squeeze(1)
        m = sel.numel()
        want = int(cmat[s, lo:hi].sum())
        if m != want:
            raise RuntimeError(f"rank {me}: MegaMoE dispatch: rank {s}'s topk_idx routes {m} pairs to experts "
                               f"[{lo}, {hi}), the counts it sent for this call say {want} (was it changed "
                               f"during the call?)")
        if not m:
            continue
        tok = torch.div(sel, k, rounding_mode="floor")
        torch.index_select(v["x"][:tokens[s]], 0, tok, out=data[c:c + m])
        if sf is not None:
            torch.index_select(v["x_sf"][:tokens[s]], 0, tok, out=sf[c:c + m])
        torch.index_select(v["topk_weights"][:tokens[s]].reshape(-1), 0, sel, out=ws[c:c + m])
        torch.sub(ids.index_select(0, sel), lo, out=local[c:c + m])
        tp.record_fetch(s, m * (dispatch_row_bytes(sb.hidden, sb.is_fp8) + 4))
        c += m
    return data, None if sf is None else sf.view(torch.uint8), local, ws


def _issue_pull(trace, worker, w, on_caller, pull):
    """Start wave ``w``'s ``pull()``: on the caller when ``on_caller``, else on the ``worker``; traced as a
    ``dispatch``. Returns a callable that gives the pull's result (waiting for the worker)."""
    s0 = time.perf_counter()
    rec = ["dispatch", w, s0, s0, s0, s0]
    trace.comm.append(rec)
    if on_caller:
        out = pull()
        rec[3] = rec[4] = rec[5] = time.perf_counter()
        return lambda: out

    def task():
        rec[4] = time.perf_counter()
        try:
            return pull()
        finally:
            rec[5] = time.perf_counter()
    rec[5] = float("nan")
    rec[3] = time.perf_counter()  # before the submit: the worker may start the task before submit returns
    return worker.submit(task).result


def _shm_terms(sb, cmat, start, idx, pair):
    """The final sum's terms of this rank's pairs, read where their L2 rows lie in their owners' output areas:
    ``(area, tokens, rows)`` groups in ascending ``k``, then owner rank. Expert ``e``'s rows in its owner's
    area start at ``start[e]``, then come the rows of lower source ranks, then this rank's pairs to ``e`` in
    (token, k) order."""
    me, nr, el, k, peers = sb.rank, sb.num_ranks, sb.num_local_experts, sb.num_topk, sb._peer_views
    tp = sb.ep_buffer.runtime
    e_of = idx.index_select(0, pair)
    n = e_of.numel()
    by_expert = stable_argsort(e_of, 0, el * nr)
    mine = cmat[me]
    within = torch.arange(n) - (mine.cumsum(0) - mine).index_select(0, e_of.index_select(0, by_expert))
    rank_in = torch.empty_like(within)
    rank_in[by_expert] = within
    pos = start.index_select(0, e_of) + cmat[:me].sum(0).index_select(0, e_of) + rank_in
    owner = torch.div(e_of, el, rounding_mode="floor")
    key = torch.remainder(pair, k) * nr + owner  # terms in ascending k, then owner rank
    by_key = stable_argsort(key, 0, k * nr)
    counts = torch.bincount(key, minlength=k * nr).tolist()
    tok = torch.div(pair, k, rounding_mode="floor").index_select(0, by_key)
    pos = pos.index_select(0, by_key)
    terms, c = [], 0
    for key_, m in enumerate(counts):
        if m:
            r = key_ % nr
            terms.append((peers[r]["out"], tok[c:c + m], pos[c:c + m]))
            tp.record_fetch(r, m * 2 * sb.hidden)
        c += m
    return terms


def waves_shm(ex, sb, t, cmat, tokens, idx, pair, shared, overlap):
    """The shm backend (one UBMEM domain; docs/semantics/mega-moe.md §5 "shm pulls from peer windows"): every rank's
    inputs lie in its segment, final once the ranks agreed, so wave ``w``'s dispatch is a pull: from
    each source rank (ascending) the rows of its pairs bound for the wave's experts, gathered straight
    from that rank's ``x``/``x_sf``/``topk_weights`` (one copy, no synchronisation; the worker pulls wave
    ``w+1`` while the caller computes wave ``w``). L2 writes each wave's rows into this rank's output
    area (experts ascending, then source rank, token, k); after one barrier every rank sums its pairs'
    rows where they lie in their owners' areas (their positions follow from the all-gathered counts), so
    combine moves each row once, inside the final sum. Returns the sum's terms."""
    me, nr, el, trace = sb.rank, sb.num_ranks, sb.num_local_experts, ex.trace
    buf = sb.ep_buffer
    tp, worker = buf.runtime, buf.get_comm_stream()
    epw, num_waves = ex.epw, trace.num_waves
    per_expert = cmat.sum(0)  # [E] rows every expert receives
    blocks = per_expert.view(nr, el)
    start = (blocks.cumsum(1) - blocks).reshape(-1)  # [E] first row of expert e in its owner's area

    def issue(w):
        lo = me * el + w * epw
        hi = min((me + 1) * el, lo + epw)
        # the caller waits for wave 0 at once: a worker would only add a hand-off
        return _issue_pull(trace, worker, w, not overlap or w == 0,
                           lambda: _pull(sb, cmat, tokens, per_expert, lo, hi))

    out_area = sb._peer_views[me]["out"]
    base = 0
    try:
        cur = issue(0)
        for w in range(num_waves):
            data, sf, local, ws = cur()
            st = ex.timed("l1", w, ex.l1, w, data, sf, local, ws)
            if w + 1 < num_waves:
                cur = issue(w + 1)
            ex.timed("act", w, ex.act, st)
            ex.timed("l2", w, ex.l2, st, out=out_area[base:base + st["n"]])
            base += st["n"]
        shared_part = shared_terms(ex, sb, t, shared)
    finally:
        worker.drain()  # no pull outlives the call
    # Every rank's L2 rows are in place, and every pull from this rank's inputs is done (the caller may
    # refill them once this returns): the call's one synchronisation after the consensus.
    s0 = time.perf_counter()
    tp.barrier(phase="MegaMoE combine: expert outputs written")
    e0 = time.perf_counter()
    trace.comm.append(["combine", -1, s0, e0, e0, e0])
    return _shm_terms(sb, cmat, start, idx, pair) + shared_part


# ----------------------------------------------------------------------------------------------
# Buffer backend


def _buffer_waves(kind, sb, t, idx, pair, epw, num_waves):
    """Each wave's pairs for the Buffer: ``(rows, waves)`` with ``rows`` one row per token (bf16 ``x``, or
    e4m3 bytes then the H/32 UE8M0 bytes) and per wave ``(pairs [m] int64 in (token, k) order, their expert
    ids [m, 1] int64, their weights [m, 1] float32)``; wave ``w`` holds the pairs whose local expert id
    ``e % E_l`` lies in it."""
    wts = sb.topk_weights[:t].reshape(-1)
    e_of = idx.index_select(0, pair)
    wave_of = torch.remainder(e_of, sb.num_local_experts) // epw
    if kind == "bf16":
        rows = sb.x[:t]
    else:  # one row of bytes per token: e4m3 data, then its H/32 UE8M0 bytes
        rows = torch.cat([sb.x[:t].view(torch.uint8), sb.x_sf[:t].contiguous().view(torch.uint8)], 1)
    waves = []
    for w in range(num_waves):
        sel = pair[wave_of == w]
        waves.append((sel, idx.index_select(0, sel).unsqueeze(1).contiguous(),
                      wts.index_select(0, sel).unsqueeze(1).contiguous()))
    return rows, waves


def _mark(trace, worker, overlap, op_name, w, s0):
    """Trace a Buffer call issued at ``s0`` (now returned). With ``overlap``, a marker queued on the worker
    (which runs FIFO) records when this op's data movement ended."""
    e0 = time.perf_counter()
    rec = [op_name, w, s0, e0, e0, e0]
    trace.comm.append(rec)
    if overlap:
        rec[5] = float("nan")

        def done(rec=rec):
            rec[5] = time.perf_counter()
        worker.submit(done)
    return rec


def _l1_received(ex, w, recv_x, recv_idx, recv_w):
    """L1 of wave ``w``'s received rows (bf16, or e4m3 bytes then UE8M0 bytes per row)."""
    h = ex.sb.hidden
    local = recv_idx[:, 0] - w * ex.epw
    if ex.kind == "bf16":
        return ex.l1(w, recv_x, None, local, recv_w[:, 0])
    return ex.l1(w, recv_x[:, :h].view(FP8), recv_x[:, h:], local, recv_w[:, 0])


def _l2_in_handle_order(ex, st):
    """L2 of the wave, back in the received (handle's) order by a gather with the inverse permutation: torch's
    CPU row gather is faster than the scatter (index_copy_) it replaces."""
    o = ex.l2(st)
    order = st["order"]
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    return o.index_select(0, inverse)


def _buffer_terms(waves, pending, k):
    """The final sum's terms: slot ``j`` of each wave's combined rows, read where they lie (no ``[t*k, H]``
    scatter), in ascending ``j``, then wave."""
    terms = []
    for j in range(k):
        for w, combined, _ev in pending:
            sel = waves[w][0]
            q = torch.nonzero(torch.remainder(sel, k) == j).squeeze(1)
            terms.append((combined, torch.div(sel.index_select(0, q), k, rounding_mode="floor"), q))
    return terms


def waves_buffer(ex, sb, t, cmat, tokens, idx, pair, shared, overlap):
    """The Buffer backend: each wave's pairs go through the normal-mode :class:`~deepep_ascend.Buffer`
    (dispatch of pair rows, combine back with the dispatch's handle), asynchronously on its worker when
    ``overlap``. Returns the final sum's terms (slot j of each wave's combined rows, read where they lie)."""
    k, trace, epw = sb.num_topk, ex.trace, ex.epw
    num_waves = trace.num_waves
    buf = sb.ep_buffer
    worker = buf.get_comm_stream()
    xrows, waves = _buffer_waves(ex.kind, sb, t, idx, pair, epw, num_waves)
    pending = []  # (wave, combined, event)
    issued = []  # every dispatch's and combine's EventOverlap, in the worker's order

    def dispatch(w):
        sel, tidx, tw = waves[w]
        rows = xrows.index_select(0, torch.div(sel, k, rounding_mode="floor"))
        ntpr, ntprr, ntpe, itr, _ = buf.get_dispatch_layout(tidx, sb.num_experts)
        s0 = time.perf_counter()
        out = buf.dispatch(rows, num_tokens_per_rank=ntpr, num_tokens_per_rdma_rank=ntprr, is_token_in_rank=itr,
                           num_tokens_per_expert=ntpe, topk_idx=tidx, topk_weights=tw, async_finish=overlap)
        issued.append(out[5])
        return out, _mark(trace, worker, overlap, "dispatch", w, s0)

    def combine(w, o, handle):
        s0 = time.perf_counter()
        combined, _cw, ev = buf.combine(o, handle, async_finish=overlap)
        issued.append(ev)
        _mark(trace, worker, overlap, "combine", w, s0)
        pending.append((w, combined, ev))

    try:
        cur = dispatch(0)
        for w in range(num_waves):
            (recv_x, recv_idx, recv_w, _lst, handle, ev), _rec = cur
            if ev.event is not None:
                ev.current_stream_wait()
            st = ex.timed("l1", w, _l1_received, ex, w, recv_x, recv_idx, recv_w)
            if w + 1 < num_waves:
                cur = dispatch(w + 1)
            ex.timed("act", w, ex.act, st)
            o = ex.timed("l2", w, _l2_in_handle_order, ex, st)
            combine(w, o, handle)
        shared_part = shared_terms(ex, sb, t, shared)
        for _w, _combined, ev in pending:
            if ev.event is not None:
                ev.current_stream_wait()
    except BaseException as exc:
        buf.get_comm_stream().drain()
        if isinstance(exc, TransportPoisoned):  # refused because an op on the worker failed first: report that
            first = next((e for e in (ev.event.exception() for ev in issued if ev.event is not None)
                          if e is not None), None)
            if first is not None:
                raise first from exc
        raise
    worker.drain()
    return _buffer_terms(waves, pending, k) + shared_part
