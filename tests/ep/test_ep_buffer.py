"""``EPBuffer`` (DeepEP V2.5's API) against the independent reference of ``tests/support/ep_reference.py``,
bit for bit: received rows, scales, local expert ids, weights, the handle's counts, prefix sums and
metadata, the expanded layout and its padding, cached dispatches, and the combine's arithmetic
(docs/semantics/deepep-api.md §13). Every test is collective.

Run: ``mpiexec -n N python -m pytest --with-mpi -q tests/ep/test_ep_buffer.py`` (N = 1, 2, 4, 8).
"""

from __future__ import annotations

import time

import pytest
import torch

from deepep_ascend import (
    ConsensusError,
    ElasticBuffer,
    EPBuffer,
    EPHandle,
    get_logical_domain_size,
    get_physical_domain_size,
)
from deepep_ascend.ep.allocator import BufferAllocator, get_num_allocation_alignment
from tests.support.buffer_helpers import all_ranks_ok, bits, buffer_on_nodes, capture, coll, same_bits_nan
from tests.support.ep_reference import pre_combine_data, ref_combine, ref_dispatch, ref_dst_slots
from tests.support.mpi_utils import gather_all, world

pytestmark = [pytest.mark.mpi(min_size=1), pytest.mark.watchdog(300)]

MAX_TOKENS, HIDDEN, TOPK = 24, 256, 4
BF16 = torch.bfloat16


def _build(nodes: int) -> EPBuffer:
    """An EPBuffer over the world, as one node or as ``nodes`` simulated nodes (hybrid mode)."""
    R = world().Get_size()
    return coll(lambda: EPBuffer(world(), num_max_tokens_per_rank=MAX_TOKENS, hidden=HIDDEN, num_topk=TOPK,
                                 explicitly_destroy=True, ranks_per_node=R // nodes), what="EPBuffer()")


@pytest.fixture(scope="module")
def ep():
    yield from buffer_on_nodes(_build, 1)


@pytest.fixture(scope="module")
def ep_two_nodes():
    """Two simulated nodes (2x1 at 2 ranks, 2x2 at 4, 2x4 at 8): DeepEP's two hops over URMA and UBMEM."""
    yield from buffer_on_nodes(_build, 2)


def _align(n, a):
    return -(-n // a) * a


def _inputs(rank, R, seed, num_experts, fp8, routing="random", with_weights=True):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    n = MAX_TOKENS - 3 * rank if routing != "zero_rank" or rank != R - 1 else 0
    n = max(n, 0)
    scores = torch.rand(n, num_experts, generator=g)
    if routing == "skewed":  # most tokens choose the experts of rank 0
        scores[: n // 2, : num_experts // R] += 2.0
    topk_idx = torch.topk(scores, TOPK, dim=1).indices.to(torch.int64)
    if n:
        topk_idx[::5] = -1  # rows with no expert at all
        topk_idx[1::3, 0] = -1  # a -1 slot before the real ones
        if routing == "repeated":  # an expert listed twice in a row (sampling with replacement), one row all one expert
            topk_idx[2::4, TOPK - 1] = topk_idx[2::4, TOPK - 2]
            if n > 3:  # the last rank of 8 has 3 rows
                topk_idx[3] = topk_idx[3, 1]
    x = (torch.randn(n, HIDDEN, generator=g) * 3).to(BF16)
    sf = None
    if fp8:
        sf = torch.rand(n, HIDDEN // 128, generator=g) + 0.5
        x = x.float().clamp(-448, 448).to(torch.float8_e4m3fn)
    w = torch.rand(n, TOPK, generator=g).masked_fill(topk_idx < 0, 0.0) if with_weights else None
    return x, sf, topk_idx, w


def _gather_inputs(comm, x, sf, topk_idx, w):
    xs = gather_all(x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x, comm)
    sfs = gather_all(sf, comm) if sf is not None else None
    ids = gather_all(topk_idx, comm)
    ws = gather_all(w, comm) if w is not None else None
    return xs, sfs, ids, ws


def _run(ep, fn, how):
    """A dispatch/combine: ``"sync"``, ``"async"`` (``async_with_compute_stream`` after a ``previous_event``,
    then a wait on the returned event) or ``"defer"`` (also ``defer_epilogue``: the wait returns the outputs)."""
    if how == "sync":
        return fn()
    if how == "async":  # as DeepEP's tests: an event captured before the call to wait for
        result = fn(async_with_compute_stream=True, previous_event=ep.capture(), allocate_on_comm_stream=True)
        result[-1].current_stream_wait()
        return result
    event = fn(async_with_compute_stream=True, defer_epilogue=True)
    return (*event.current_stream_wait(), event)


MODES = [  # (fp8, expert_alignment, num_bias, sync | async | defer, do_cpu_sync, with_weights, routing)
    (False, 1, 0, "sync", True, True, "random"),
    (True, 128, 1, "defer", True, True, "skewed"),
    (False, 128, 2, "async", False, True, "zero_rank"),
    (True, 1, 2, "async", False, True, "repeated"),
    (False, 4, 1, "defer", True, False, "skewed"),
    (True, 4, 0, "sync", False, False, "zero_rank"),
]


@pytest.mark.parametrize("nodes", [1, 2], ids=["one_node", "two_nodes"])
@pytest.mark.parametrize("mode", MODES, ids=lambda m: "fp8={} align={} bias={} {} cpu_sync={} w={} {}".format(*m))
def test_dispatch_combine_modes(ep, ep_two_nodes, comm, mode, nodes):
    if nodes == 2 and ep_two_nodes is None:
        pytest.skip("two nodes need two ranks")
    if comm.Get_size() >= 8 and MODES.index(mode) % 2 != nodes - 1:
        pytest.skip("at 8 ranks every other mode per topology (all of them run at 2 and 4 ranks): suite time")
    check_mode(ep if nodes == 1 else ep_two_nodes, comm, mode, nodes)


@pytest.mark.parametrize("mode", [MODES[0], MODES[1]], ids=["align1_mostly_rows", "align128_mostly_padding"])
def test_expanded_rows_by_torch(ep, comm, mode, monkeypatch):
    """The expanded layout with the native row copy unavailable: torch places the rows (a gather into place
    when they are most of the layout, gathered blocks per expert otherwise), the same bits as the reference."""
    from deepep_ascend import native

    monkeypatch.setattr(native, "copy_rows", lambda *args: False)
    check_mode(ep, comm, mode, 1)


def check_mode(ep, comm, mode, nodes):
    """One mode of :data:`MODES` on ``ep`` (built over ``nodes`` nodes) against the reference; raises
    ``AssertionError`` on every rank if any rank differs (also run by ``tests/ep/internode_tcp_job.py``)."""
    fp8, alignment, num_bias, defer, cpu_sync, with_weights, routing = mode
    R, rank = comm.Get_size(), comm.Get_rank()
    E = 8 * R
    L = E // R
    x, sf, topk_idx, w = _inputs(rank, R, 7, E, fp8, routing, with_weights)
    xin = (x, sf) if fp8 else x
    xs, sfs, ids, ws = _gather_inputs(comm, x, sf, topk_idx, w)
    ref = ref_dispatch(xs, sfs, ids, ws, rank, E, MAX_TOKENS)
    nref = ref.src.numel()
    stats = torch.full((L,), 5, dtype=torch.int32)
    args = dict(topk_idx=topk_idx, topk_weights=w, num_experts=E, expert_alignment=alignment, do_cpu_sync=cpu_sync)

    recv_x, recv_ids, recv_w, handle, _ = coll(lambda: _run(ep, lambda **kw: ep.dispatch(
        xin, cumulative_local_expert_recv_stats=stats, **args, **kw), defer), what="dispatch")
    exp_x, exp_ids, exp_w, exp_handle, _ = coll(lambda: _run(ep, lambda **kw: ep.dispatch(
        xin, do_expand=True, use_tma_aligned_col_major_sf=True, **args, **kw), defer), what="expanded dispatch")
    c_x, c_ids, c_w, c_handle, _ = coll(lambda: _run(ep, lambda **kw: ep.dispatch(
        xin, handle=handle, topk_weights=w, **kw), defer), what="cached dispatch")
    ce_x, _, ce_w, _, _ = coll(lambda: _run(ep, lambda **kw: ep.dispatch(
        xin, handle=exp_handle, topk_weights=w, do_expand=True, do_zero_padding=True, **kw), defer),
        what="cached expanded dispatch")

    ok = True
    rows = nref if cpu_sync else R * MAX_TOKENS
    data = recv_x[0] if fp8 else recv_x
    ok &= tuple(data.shape) == (rows, HIDDEN) and handle.num_recv_tokens == rows
    valid = slice(0, nref)
    got_x = data[valid].view(torch.uint8) if fp8 else data[valid]
    ok &= torch.equal(got_x, ref.x) and torch.equal(recv_ids[valid], ref.topk_idx)
    ok &= bool((recv_ids[nref:] == -1).all())
    if fp8:
        ok &= torch.equal(recv_x[1][valid], ref.sf)
    if with_weights:
        ok &= torch.equal(recv_w[valid], ref.weights)
    else:
        ok &= recv_w is None and exp_w is None
    meta = handle.recv_src_metadata
    ok &= torch.equal(meta[valid, 0].long(), ref.src)
    # the compact layout: no expanded rows (columns 2+), padding rows -1 throughout
    ok &= meta.shape == (data.size(0), 2 + TOPK) and bool((meta[:, 2:] == -1).all()) and bool((meta[nref:] == -1).all())
    last = torch.where(ref.topk_idx >= 0, torch.arange(TOPK), -1).amax(dim=1) if nref else torch.zeros(0)
    ok &= torch.equal(meta[valid, 1].long(), (ref.src // MAX_TOKENS) * TOPK + last)
    per_scaleup = torch.tensor(ref.per_rank).view(-1, ep.num_scaleup_ranks).sum(0)
    ok &= torch.equal(handle.psum_num_recv_tokens_per_scaleup_rank, per_scaleup.cumsum(0).int())
    ok &= ep.get_physical_domain_size() == (nodes, R // nodes)
    ok &= torch.equal(handle.psum_num_recv_tokens_per_rank, torch.tensor(ref.per_rank).cumsum(0).int())
    aligned = [_align(c, alignment) for c in ref.counts]
    ok &= handle.num_recv_tokens_per_expert_list == (aligned if cpu_sync else [])
    ok &= torch.equal(handle.psum_num_recv_tokens_per_expert, torch.tensor(aligned).cumsum(0).int())
    ok &= torch.equal(handle.num_unaligned_recv_tokens_per_expert, torch.tensor(ref.counts, dtype=torch.int32))
    ok &= torch.equal(stats, 5 + torch.tensor(ref.counts, dtype=torch.int32))
    ok &= torch.equal(handle.dst_buffer_slot_idx, ref_dst_slots(topk_idx, E, R, rank)[0])
    ok &= handle.topk_idx is topk_idx and c_handle is handle
    # Cached: the same rows, ids and weights.
    c_data = c_x[0] if fp8 else c_x
    ok &= torch.equal(c_data.view(torch.uint8), data.view(torch.uint8)) and torch.equal(c_ids, recv_ids)
    ok &= c_w is None if w is None else torch.equal(c_w[valid], ref.weights)
    # Expanded: every (row, slot) on this rank at its slot, experts in order, aligned, padded with zeros.
    starts, s = [], 0
    for c in ref.counts:
        starts.append(s)
        s += _align(c, alignment)
    eh = exp_handle
    ok &= exp_ids is None and eh.do_expand
    ok &= torch.equal(eh.psum_num_recv_tokens_per_expert, torch.tensor([st + c for st, c in zip(starts, ref.counts)],
                                                                        dtype=torch.int32))
    # DeepEP's worst case without CPU sync; the compact handle carries the same count (DeepEP sets it in both)
    exp_rows = s if cpu_sync else _align(R * MAX_TOKENS * min(TOPK, L) + L * (alignment - 1), alignment)
    exp_data = exp_x[0] if fp8 else exp_x
    ok &= exp_data.size(0) == exp_rows and eh.num_expanded_tokens == exp_rows
    ok &= handle.num_expanded_tokens == exp_rows
    # capacity rows past the last expert's aligned end are zeros (do_cpu_sync=False)
    ok &= bool((exp_data[s:].view(torch.uint8) == 0).all())
    if with_weights:
        ok &= bool((exp_w[s:] == 0).all())
    slots = eh.recv_src_metadata[valid, 2:]
    ok &= torch.equal(slots >= 0, ref.topk_idx >= 0)
    for e in range(L):
        mine = ref.topk_idx == e
        got_slots = slots[mine].long()
        ok &= torch.equal(torch.sort(got_slots).values, torch.arange(starts[e], starts[e] + ref.counts[e]))
        src_rows = torch.nonzero(mine)[:, 0]
        ok &= torch.equal(exp_data[got_slots].view(torch.uint8), ref.x[src_rows].view(torch.uint8))
        ok &= torch.equal(ce_x[0][got_slots] if fp8 else ce_x[got_slots], exp_data[got_slots])
        if fp8:
            ok &= torch.equal(exp_x[1][got_slots], ref.sf[src_rows]) and exp_x[1].stride() == (1, exp_rows)
        if with_weights:
            ok &= torch.equal(exp_w[got_slots], ref.weights[mine]) and torch.equal(ce_w[got_slots], exp_w[got_slots])
        pad = slice(starts[e] + ref.counts[e], _align(starts[e] + ref.counts[e], alignment))
        ce_data = ce_x[0] if fp8 else ce_x
        ok &= bool((ce_data[pad].view(torch.uint8) == 0).all())
        if fp8:
            ok &= bool((ce_x[1][pad] == 0).all())
        if with_weights:
            ok &= bool((ce_w[pad] == 0).all())
    all_ranks_ok(comm, ok, "dispatch outputs vs the reference")

    # Combine: expert outputs made from the source token's global index; compact rows are each rank's
    # slot sums, expanded rows one per slot.
    y_recv = pre_combine_data(ref.src, TOPK, HIDDEN, 3)
    y_recv[ref.topk_idx < 0] = 0
    compact = torch.zeros(rows, HIDDEN, dtype=BF16)
    acc = torch.zeros(nref, HIDDEN)
    for j in range(TOPK):
        acc += y_recv[:, j].float()
    compact[:nref] = acc.to(BF16)
    expanded = torch.zeros(eh.num_expanded_tokens, HIDDEN, dtype=BF16)
    valid_slots = slots >= 0
    expanded[slots[valid_slots].long()] = y_recv[valid_slots]
    gen = torch.Generator().manual_seed(rank)
    n = topk_idx.size(0)
    bias = [None, torch.randn(n, HIDDEN, generator=gen).to(BF16),
            (torch.randn(n, HIDDEN, generator=gen).to(BF16), torch.randn(n, HIDDEN, generator=gen).to(BF16))][num_bias]
    y_mine = pre_combine_data(rank * MAX_TOKENS + torch.arange(n), TOPK, HIDDEN, 3)
    y_mine[topk_idx < 0] = 0
    # DeepEP's recipes: node partials only in hybrid mode with multiple reductions; the expanded layout
    # without multiple reductions sums every slot at the origin
    amr, hybrid = ep.allow_multiple_reduction, ep.get_logical_domain_size()[0] > 1
    want = ref_combine(y_mine, topk_idx, E, R, bias, num_nodes=nodes if hybrid and amr else 1)
    want_expanded = want if amr else ref_combine(y_mine, topk_idx, E, R, bias, reduce_in_rank=False)
    comb, comb_w, _ = coll(lambda: _run(ep, lambda **kw: ep.combine(compact, handle, topk_weights=recv_w, bias=bias,
                                                                    **kw), defer), what="combine")
    ecomb, ecomb_w, _ = coll(lambda: _run(ep, lambda **kw: ep.combine(expanded, exp_handle, topk_weights=exp_w,
                                                                      bias=bias, **kw), defer), what="expanded combine")
    ok = same_bits_nan(comb, want) and same_bits_nan(ecomb, want_expanded)
    if with_weights:
        ok &= torch.equal(comb_w, w) and torch.equal(ecomb_w, w)
    else:
        ok &= comb_w is None and ecomb_w is None
    all_ranks_ok(comm, ok, "combine vs the reference (bitwise)")


@pytest.mark.parametrize("flavour", ["no_multiple_reduction", "no_multiple_reduction_torch_rows", "direct_two_nodes",
                                     "no_multiple_reduction_two_nodes"])
def test_one_rounding_modes(comm, flavour, monkeypatch):
    """DeepEP's arithmetic with one rounding at the origin: ``allow_multiple_reduction=False`` (the
    expanded layout sends every slot's row; across nodes no node partials; ``torch_rows``: the rows of each
    slot's combine placed by torch, the native row copy unavailable) and direct mode across nodes
    (``allow_hybrid_mode=False``: every rank's row, logical domain ``(1, R)``)."""
    if "torch_rows" in flavour:
        from deepep_ascend import native

        monkeypatch.setattr(native, "copy_rows", lambda *args: False)
    R = comm.Get_size()
    nodes = 2 if "two_nodes" in flavour else 1
    if R < nodes:
        pytest.skip("two nodes need two ranks")
    buf = coll(lambda: EPBuffer(world(), num_max_tokens_per_rank=MAX_TOKENS, hidden=HIDDEN, num_topk=TOPK,
                                explicitly_destroy=True, ranks_per_node=R // nodes,
                                allow_multiple_reduction="no_multiple" not in flavour,
                                allow_hybrid_mode="direct" not in flavour), what="EPBuffer()")
    try:
        hybrid = "direct" not in flavour
        logical = (nodes, R // nodes) if hybrid else (1, R)
        assert buf.get_logical_domain_size() == logical and buf.get_physical_domain_size() == (nodes, R // nodes)
        # the module-level helpers (DeepEP's deep_ep.get_*_domain_size) agree before any buffer exists
        assert get_physical_domain_size(world(), ranks_per_node=R // nodes) == (nodes, R // nodes)
        assert get_logical_domain_size(world(), hybrid, ranks_per_node=R // nodes) == logical
        for mode in (MODES[1], MODES[2]) if R < 8 else (MODES[1],):  # suite time at 8 ranks
            check_mode(buf, comm, mode, nodes)
        if not hybrid:  # rows go straight to their ranks: nothing is relayed inside a node
            rank = comm.Get_rank()
            x = torch.ones(MAX_TOKENS, HIDDEN).to(BF16)
            to_next = torch.full((MAX_TOKENS, 1), ((rank + 1) % R) * 4, dtype=torch.int64)  # E = 4R: next rank's
            coll(lambda: buf.dispatch(x, topk_idx=to_next, num_experts=4 * R))
            moved = buf.get_traffic()
            all_ranks_ok(comm, moved["UBMEM"] == 0 and moved["URMA"] >= MAX_TOKENS * HIDDEN * 2,
                         f"direct mode traffic {moved}")
    finally:
        coll(buf.destroy, what="destroy")


def test_deterministic_twice_and_200_calls_changing_shapes(comm):
    """Identical bits run after run; 200 consecutive calls with changing token counts and hidden sizes (60 at
    8 ranks)."""
    R, rank = comm.Get_size(), comm.Get_rank()
    buf = coll(lambda: EPBuffer(comm, num_max_tokens_per_rank=16, hidden=128, num_topk=2, deterministic=True,
                                explicitly_destroy=True))
    try:
        E = 4 * R
        ok = True
        for i in range(200 if R <= 4 else 60):  # 200 at 1, 2 and 4 ranks; fewer at 8 (suite time)
            g = torch.Generator().manual_seed(i * 131 + rank)
            n = int(torch.randint(0, 17, (1,), generator=g))
            hidden = [32, 64, 128][i % 3]
            # distinct experts per row (docs/semantics/deepep-api.md §0); -1 as often as randint(-1, E) gives it
            topk_idx = torch.rand(n, E, generator=g).topk(2, dim=1).indices
            topk_idx[torch.rand(n, 2, generator=g) < 1 / (E + 1)] = -1
            x = torch.randn(n, hidden, generator=g).to(BF16)
            out = coll(lambda: buf.dispatch(x, topk_idx=topk_idx, num_experts=E, num_max_tokens_per_rank=16))
            if i % 50 == 0:
                again = coll(lambda: buf.dispatch(x, topk_idx=topk_idx, num_experts=E, num_max_tokens_per_rank=16))
                ok &= torch.equal(out[0], again[0])
                ok &= torch.equal(out[3].recv_src_metadata, again[3].recv_src_metadata)
            combined, _, _ = coll(lambda: buf.combine(out[0], out[3]))
            # every row comes back once per rank that received it: a sum of copies of x
            ranks_per_token = torch.stack([((topk_idx >= r * 4) & (topk_idx < r * 4 + 4)).any(1) for r in range(R)]
                                          ).sum(0) if n else torch.zeros(0)
            # c copies of a bf16 value sum exactly in float32 (c <= 8): one rounding of c * x
            want = (x.float() * ranks_per_token[:, None]).to(BF16) if n else x
            ok &= torch.equal(combined, want)
        all_ranks_ok(comm, ok, "deterministic dispatches and 200 calls")
    finally:
        coll(buf.destroy)


@pytest.mark.parametrize("nodes, hybrid", [(1, True), (2, True), (2, False)], ids=["one_node", "two_nodes",
                                                                                 "two_nodes_direct"])
def test_size_hint_is_exact(comm, nodes, hybrid, capsys):
    """The hint's bytes take a full-shape call; one alignment unit less is refused by that call on every
    rank, one byte less by the constructor (on one node, split over two nodes' windows, and in direct mode,
    whose rows go straight to their ranks)."""
    R = comm.Get_size()
    if R < nodes:
        pytest.skip("two nodes need two ranks")
    unit = get_num_allocation_alignment()
    hint = coll(lambda: EPBuffer.get_buffer_size_hint(comm, 16, 256, 4, use_fp8_dispatch=True,
                                                      allow_hybrid_mode=hybrid, ranks_per_node=R // nodes))
    assert hint % unit == 0
    x = torch.zeros(16, 256).to(torch.float8_e4m3fn)
    sf = torch.ones(16, 2)
    topk_idx = torch.arange(4).repeat(16, 1) % (4 * R)
    for nbytes, fits in ((hint, True), (hint - unit, False)):
        buf = coll(lambda nbytes=nbytes: EPBuffer(comm, num_bytes=nbytes, num_max_tokens_per_rank=16,
                                                  allow_hybrid_mode=hybrid, explicitly_destroy=True,
                                                  ranks_per_node=R // nodes))
        try:
            _, err = capture(lambda buf=buf: buf.dispatch((x, sf), topk_idx=topk_idx, num_experts=4 * R))
            ok = err is None if fits else (isinstance(err, ValueError) and "get_buffer_size_hint" in str(err))
            all_ranks_ok(comm, ok, f"num_bytes={nbytes} (hint {hint}): {err!r}")
            if fits:
                capsys.readouterr()
                buf.print_memory_usage()
                printed = capsys.readouterr().out
                assert "UBMEM window" in printed and "URMA window" in printed, printed
        finally:
            coll(buf.destroy, what="destroy")
    _, err = capture(lambda: EPBuffer(comm, num_bytes=hint - 1, explicitly_destroy=True))
    assert isinstance(err, ValueError) and "multiple of" in str(err)


@pytest.mark.parametrize("hybrid", [True, False], ids=["hybrid", "direct"])
def test_more_experts_than_the_hint_across_nodes_name_the_bytes_they_need(comm, hybrid):
    """The hint leaves room for 1,024 experts' counts; across nodes every count must fit a node box, so a call of
    4,096 experts on a hint-sized buffer is refused on every rank, naming num_experts and the bytes it needs; a
    buffer of those bytes takes it (each token's rows, x on every rank, combined back to x times its ranks)."""
    import re

    R, rank = comm.Get_size(), comm.Get_rank()
    if R < 2 or R % 2:
        pytest.skip("two simulated nodes need an even number of ranks")
    E, M, H = 4096, 16, 256
    x = torch.randint(-8, 8, (M, H), generator=torch.Generator().manual_seed(rank)).to(BF16)
    topk_idx = torch.rand(M, E, generator=torch.Generator().manual_seed(rank)).topk(4, dim=1).indices
    kwargs = dict(num_max_tokens_per_rank=M, hidden=H, num_topk=4, allow_hybrid_mode=hybrid, explicitly_destroy=True,
                  ranks_per_node=R // 2)
    buf = coll(lambda: EPBuffer(comm, **kwargs))
    try:
        _, err = capture(lambda: buf.dispatch(x, topk_idx=topk_idx, num_experts=E))
        need = re.search(r"below the (\d+) bytes", str(err))
        all_ranks_ok(comm, isinstance(err, ValueError) and need is not None and f"num_experts={E}" in str(err),
                     f"{E} experts on a hint-sized buffer: {err!r}")
    finally:
        coll(buf.destroy)
    buf = coll(lambda: EPBuffer(comm, num_bytes=int(need.group(1)), **kwargs))
    try:
        recv_x, _, _, handle, _ = coll(lambda: buf.dispatch(x, topk_idx=topk_idx, num_experts=E))
        combined, _, _ = coll(lambda: buf.combine(recv_x, handle))
        ranks_per_token = (topk_idx // (E // R)).sort(dim=1).values.diff(dim=1).ne(0).sum(1) + 1
        all_ranks_ok(comm, torch.equal(combined, (x.float() * ranks_per_token[:, None]).to(BF16)),
                     f"{E} experts on a buffer of the bytes named")
    finally:
        coll(buf.destroy)


def test_constructor_arguments_agreed_on_every_rank(comm):
    """Ranks passing different collective arguments, or one rank a bad one, raise on every rank before
    anything is allocated (never a hang), naming the argument and each rank's value."""
    R, rank = comm.Get_size(), comm.Get_rank()
    unit = get_num_allocation_alignment()
    _, err = capture(lambda: EPBuffer(comm, num_bytes=unit * (64 + rank), explicitly_destroy=True))
    if R > 1:
        all_ranks_ok(comm, isinstance(err, ValueError) and "num_bytes: rank 0: " in str(err), f"{err!r}")
    _, err = capture(lambda: EPBuffer(comm, num_bytes=unit * 64 + (rank == R - 1), explicitly_destroy=True))
    all_ranks_ok(comm, isinstance(err, ValueError) and ("multiple of" in str(err) or f"rank {R - 1} refused" in
                                                        str(err)), f"{err!r}")
    _, err = capture(lambda: EPBuffer(comm, num_max_tokens_per_rank=0 if rank == 0 else 8, hidden=64,
                                      explicitly_destroy=True))
    all_ranks_ok(comm, isinstance(err, ValueError), f"{err!r}")
    # the MoE shape's types: a float, a bool or a negative count is named, not built on (or failed at dispatch)
    for name, bad in (("num_max_tokens_per_rank", 24.0), ("hidden", -64), ("num_topk", True), ("num_topk", -1)):
        kw = dict(num_max_tokens_per_rank=24, hidden=64, num_topk=2)
        kw[name] = bad if rank == R - 1 else kw[name]
        buf, err = capture(lambda: EPBuffer(comm, explicitly_destroy=True, **kw))
        if buf is not None:
            coll(buf.destroy)
        ok = (type(err) is ValueError and f"{name} must be an int >= 0, got {bad!r}" in str(err)) if rank == R - 1 \
            else (isinstance(err, ValueError) and f"rank {R - 1} refused" in str(err))
        all_ranks_ok(comm, ok, f"rank {rank}: {name}={bad!r} on rank {R - 1}: {err!r}")


@pytest.mark.parametrize("nodes", [1, 2])
def test_scale_rows_of_any_width(comm, nodes):
    """FP8 scales of any dtype and width (DeepEP-Ascend's int16 packs, odd byte counts) travel with their rows,
    on one node and across two: the engines' 4-byte fields are padded and unpadded around them."""
    R, rank = comm.Get_size(), comm.Get_rank()
    if R < nodes:
        pytest.skip("two nodes need two ranks")
    buf = coll(lambda: EPBuffer(world(), num_max_tokens_per_rank=24, hidden=128, num_topk=2, explicitly_destroy=True,
                                ranks_per_node=R // nodes))
    try:
        E = 4 * R
        for dtype, cols in ((torch.int16, 3), (torch.uint8, 5), (torch.int16, 1)):
            g = torch.Generator().manual_seed(rank * 7 + cols)
            n = 17 + rank
            x = torch.randint(0, 255, (n, 128), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
            sf = torch.randint(0, 100, (n, cols), generator=g).to(dtype)
            # distinct experts per row (docs/semantics/deepep-api.md §0); -1 as often as randint(-1, E) gives it
            topk_idx = torch.rand(n, E, generator=g).topk(2, dim=1).indices
            topk_idx[torch.rand(n, 2, generator=g) < 1 / (E + 1)] = -1
            xs, sfs, ids, _ = _gather_inputs(comm, x, sf, topk_idx, None)
            ref = ref_dispatch(xs, sfs, ids, None, rank, E, 24)
            (rx, rsf), _, _, handle, _ = coll(lambda: buf.dispatch((x, sf), topk_idx=topk_idx, num_experts=E,
                                                                   num_max_tokens_per_rank=24))
            (cx, csf), _, _, _, _ = coll(lambda: buf.dispatch((x, sf), handle=handle))
            ok = torch.equal(rx.view(torch.uint8), ref.x) and torch.equal(rsf, ref.sf) and torch.equal(csf, ref.sf)
            all_ranks_ok(comm, ok and torch.equal(cx.view(torch.uint8), ref.x), f"{dtype} x {cols} scales")
    finally:
        coll(buf.destroy, what="destroy")


def test_ranks_disagreeing_on_weights_raise_everywhere(ep, comm):
    R, rank = comm.Get_size(), comm.Get_rank()
    if R < 2:
        pytest.skip("needs two ranks")
    topk_idx = torch.zeros(4, 1, dtype=torch.int64)
    x = torch.zeros(4, HIDDEN).to(BF16)
    w = torch.ones(4, 1) if rank == 0 else None
    _, err = capture(lambda: ep.dispatch(x, topk_idx=topk_idx, topk_weights=w, num_experts=8 * R))
    all_ranks_ok(comm, isinstance(err, ConsensusError) and "topk_weights given" in str(err), f"{err!r}")


def test_timeout_argument_wins_over_the_environment(comm, monkeypatch):
    """``num_cpu_timeout_secs`` given is every wait's deadline; left None, ``$DEEPEP_ASCEND_TIMEOUT_S`` is;
    ``num_allocated_qps`` gets DeepEP's automatic count and caps ``get_theoretical_num_qps``."""
    monkeypatch.setenv("DEEPEP_ASCEND_TIMEOUT_S", "20")
    for given, want in ((7, 7.0), (None, 20.0)):
        buf = coll(lambda given=given: EPBuffer(comm, num_max_tokens_per_rank=4, hidden=64, explicitly_destroy=True,
                                                num_cpu_timeout_secs=given))
        try:
            assert buf.runtime.timeout_s == want
            assert buf.num_allocated_qps == 65 and buf.get_theoretical_num_qps(20) == 65
        finally:
            coll(buf.destroy, what="destroy")


def test_handle_topk_idx_must_not_change(ep, comm):
    """DeepEP V2.5's version check: a ``topk_idx`` changed in place after the dispatch is caught when the
    handle reads it (a cached dispatch raises ``AssertionError`` on the rank that changed it)."""
    R = comm.Get_size()
    topk_idx = torch.zeros(4, 1, dtype=torch.int64)
    x = torch.zeros(4, HIDDEN).to(BF16)
    _, _, _, handle, _ = coll(lambda: ep.dispatch(x, topk_idx=topk_idx, num_experts=8 * R))
    topk_idx.add_(0)  # an in-place change, even of no value
    with pytest.raises(AssertionError, match="must not be modified"):
        _ = handle.topk_idx


@pytest.mark.parametrize("multiple_reduction", [True, False], ids=["multiple_reduction", "one_rounding"])
def test_combine_of_a_handle_whose_topk_idx_changed_is_refused_on_every_rank(comm, multiple_reduction):
    """The expanded layout, ``topk_idx`` changed in place on the last rank between dispatch and combine: that rank's
    combine raises ``AssertionError``, every other rank's a ``ConsensusError`` naming it, in the same call, with
    ``allow_multiple_reduction`` on and off (off, the combine runs one pass per top-k slot, which must refuse in its
    first round like any combine); the next round trip gives ``3 x`` (three slots, each a row of ``x``)."""
    R, rank = comm.Get_size(), comm.Get_rank()
    E = 4 * R
    buf = coll(lambda: EPBuffer(comm, num_max_tokens_per_rank=8, hidden=HIDDEN, num_topk=3, explicitly_destroy=True,
                                allow_multiple_reduction=multiple_reduction, num_cpu_timeout_secs=30))
    try:
        gen = torch.Generator().manual_seed(rank)
        x = torch.randint(-4, 5, (8, HIDDEN), generator=gen).to(BF16)
        topk_idx = torch.rand(8, E, generator=gen).topk(3, dim=1).indices
        w = torch.randint(1, 5, (8, 3), generator=gen).float() / 4
        recv_x, _, recv_w, handle, _ = coll(lambda: buf.dispatch(x, topk_idx=topk_idx, topk_weights=w, num_experts=E,
                                                                 do_expand=True))
        if rank == R - 1:
            topk_idx.add_(0)
        t0 = time.monotonic()
        _, err = capture(lambda: buf.combine(recv_x, handle, topk_weights=recv_w))
        ok = (isinstance(err, AssertionError) and "must not be modified" in str(err) if rank == R - 1
              else isinstance(err, ConsensusError) and f"rank {R - 1}" in str(err))
        ok &= time.monotonic() - t0 < 10
        topk_idx = topk_idx.clone()
        recv_x, _, recv_w, handle, _ = coll(lambda: buf.dispatch(x, topk_idx=topk_idx, topk_weights=w, num_experts=E,
                                                                 do_expand=True))
        combined, _, _ = coll(lambda: buf.combine(recv_x, handle, topk_weights=recv_w))
        ok &= torch.equal(combined, (x.float() * 3).to(BF16))  # a row per (token, slot), summed unweighted
        all_ranks_ok(comm, ok, f"rank {rank}: the refused combine raised {err!r}")
    finally:
        coll(buf.destroy, what="destroy")


def test_numpy_integers_are_the_ints_they_hold(comm):
    """``num_max_tokens_per_rank`` a ``numpy.int64`` in the constructor (its size hint then a numpy value inside),
    and ``expert_alignment`` / ``num_max_tokens_per_rank`` of a dispatch as ``numpy.int64`` on the last rank and
    ``int`` on the others (DeepEP's bindings take either): the same values, so the same call, and the same bits as
    with ints everywhere."""
    import numpy as np

    R, rank = comm.Get_size(), comm.Get_rank()
    E = 4 * R
    buf = coll(lambda: EPBuffer(comm, num_max_tokens_per_rank=np.int64(8), hidden=HIDDEN, num_topk=2,
                                explicitly_destroy=True))
    try:
        gen = torch.Generator().manual_seed(rank)
        x = torch.randn(8, HIDDEN, generator=gen).to(BF16)
        topk_idx = torch.rand(8, E, generator=gen).topk(2, dim=1).indices
        num = np.int64 if rank == R - 1 else int
        got = coll(lambda: buf.dispatch(x, topk_idx=topk_idx, num_experts=E, do_expand=True, do_zero_padding=True,
                                        expert_alignment=num(4), num_max_tokens_per_rank=num(8))[0].clone())
        want = coll(lambda: buf.dispatch(x, topk_idx=topk_idx, num_experts=E, do_expand=True, do_zero_padding=True,
                                         expert_alignment=4, num_max_tokens_per_rank=8)[0])
        all_ranks_ok(comm, torch.equal(bits(got), bits(want)), f"rank {rank}: numpy integers changed the rows")
    finally:
        coll(buf.destroy, what="destroy")


def test_handle_fields_assignable_and_barrier_as_deepep(ep, comm):
    """DeepEP's tests reassign handle fields (``handle.recv_src_metadata = handle.recv_src_metadata[:n]``): the
    field reads what was assigned and a combine of the handle is unchanged. ``barrier`` takes DeepEP's arguments;
    a bad ``context_idx`` raises after taking part, so the next barriers stay paired."""
    R, rank = comm.Get_size(), comm.Get_rank()
    x = torch.randn(6, HIDDEN, generator=torch.Generator().manual_seed(rank)).to(BF16)
    topk_idx = torch.rand(6, 4 * R, generator=torch.Generator().manual_seed(rank + 9)).topk(2, dim=1).indices
    recv_x, _, _, handle, _ = coll(lambda: ep.dispatch(x, topk_idx=topk_idx, num_experts=4 * R, do_expand=True))
    want, _, _ = coll(lambda: ep.combine(recv_x, handle))
    full = handle.recv_src_metadata
    handle.recv_src_metadata = full[:1]
    handle.psum_num_recv_tokens_per_rank = None
    got, _, _ = coll(lambda: ep.combine(recv_x, handle))
    ok = handle.recv_src_metadata.size(0) == min(1, full.size(0)) and handle.psum_num_recv_tokens_per_rank is None
    ok &= torch.equal(bits(got), bits(want))
    coll(lambda: ep.barrier(wait_comm_stream=False, with_cpu_sync=True, sequential=False, context_idx=0))
    _, exc = capture(lambda: ep.barrier(context_idx=1 if rank == 0 else None))
    ok &= (isinstance(exc, ValueError) and "context_idx" in str(exc)) if rank == 0 else exc is None
    coll(ep.barrier)  # still paired
    all_ranks_ok(comm, ok, "handle fields assigned, barrier arguments")


@pytest.mark.parametrize("nodes", [1, 2], ids=["one_node", "two_nodes"])
def test_dropped_outputs_and_handle_freed_without_garbage_collection(ep, ep_two_nodes, comm, nodes):
    """A dispatch's outputs and handle, dropped after a combine, are freed at once by reference counting, whether
    the handle's lazily computed fields were read or not: no reference cycle keeps them (and the tensors they hold)
    alive until Python's cycle collector runs, which would also cost every call a share of its collections.
    Checked with the collector off, in both layouts, synchronous and deferred."""
    import gc
    import weakref

    if nodes == 2 and ep_two_nodes is None:
        pytest.skip("two nodes need two ranks")
    buf = ep if nodes == 1 else ep_two_nodes
    R, rank = comm.Get_size(), comm.Get_rank()
    x, _, topk_idx, w = _inputs(rank, R, 11, 8 * R, False)
    refs = []

    def one_round(read_fields: bool, **kw):
        if kw.get("defer_epilogue"):
            event = coll(lambda: buf.dispatch(x, topk_idx=topk_idx, topk_weights=w, num_experts=8 * R,
                                              async_with_compute_stream=True, **kw))
            recv_x, _, recv_w, handle = event.current_stream_wait()
        else:
            recv_x, _, recv_w, handle, _ = coll(lambda: buf.dispatch(x, topk_idx=topk_idx, topk_weights=w,
                                                                     num_experts=8 * R, **kw))
        fields = ("psum_num_recv_tokens_per_scaleup_rank", "psum_num_recv_tokens_per_rank",
                  "psum_num_recv_tokens_per_expert", "num_unaligned_recv_tokens_per_expert",
                  "num_recv_tokens_per_expert_list", "recv_src_metadata", "dst_buffer_slot_idx")
        for field in fields if read_fields else ():
            getattr(handle, field)
        combined, _, _ = coll(lambda: buf.combine(recv_x, handle, topk_weights=recv_w))
        refs.extend(weakref.ref(t) for t in (handle, recv_x, recv_w, combined, handle._combine_order))

    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        for read_fields in (False, True):
            one_round(read_fields)
            one_round(read_fields, do_expand=True, expert_alignment=4)
            one_round(read_fields, defer_epilogue=True)
        alive = [i for i, r in enumerate(refs) if r() is not None]
    finally:
        if was_enabled:
            gc.enable()
    all_ranks_ok(comm, not alive, f"rank {rank}: objects {alive} (handle, recv_x, recv_topk_weights, combined_x, "
                                  f"combine order of each round) outlive their last reference")


def test_combine_weights_masked_unless_the_dispatchs_own(ep, comm):
    """The compact combine masks the weights of slots that are not on this rank, except for the dispatch's own
    ``recv_topk_weights`` handed back unchanged (0 there already): the same bits either way, and a write since the
    dispatch, to the weights or to ``recv_topk_idx``, brings the mask back."""
    R, rank = comm.Get_size(), comm.Get_rank()
    x, _, topk_idx, w = _inputs(rank, R, 7, 8 * R, False)
    recv_x, recv_ids, recv_w, handle, _ = coll(lambda: ep.dispatch(x, topk_idx=topk_idx, topk_weights=w,
                                                                   num_experts=8 * R))
    y = recv_x.clone()
    ok = True

    def both(weights):  # the weights as given, and a copy of them (never the dispatch's own: always masked)
        a = coll(lambda: ep.combine(y, handle, topk_weights=weights))
        b = coll(lambda: ep.combine(y, handle, topk_weights=weights.clone()))
        return torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])

    ok &= both(recv_w)  # unchanged: the mask is skipped
    foreign = recv_ids < 0
    recv_w.masked_fill_(foreign, 5.0)  # a write: nonzero weights where the slot is not here
    ok &= both(recv_w)
    recv_w.masked_fill_(foreign, 0.0)
    if bool((recv_ids >= 0).any()):
        recv_ids[recv_ids >= 0] = -1  # the ids changed in place: every slot now masked
        combined, combined_w, _ = coll(lambda: ep.combine(y, handle, topk_weights=recv_w))
        ok &= bool((combined_w == 0).all()) and both(recv_w)
    all_ranks_ok(comm, ok, f"rank {rank}: the combine's weights differ between the masked and the skipped path")


def test_bad_inputs_raise_on_every_rank(ep, comm):
    R, rank = comm.Get_size(), comm.Get_rank()
    E = 8 * R
    x, _, topk_idx, w = _inputs(rank, R, 3, E, False)
    bad_rank = R - 1
    cases = {
        "topk_idx int32": dict(topk_idx=topk_idx.int() if rank == bad_rank else topk_idx),
        "expert id out of range": dict(topk_idx=topk_idx.clone().fill_(E) if rank == bad_rank else topk_idx),
        "too many tokens": dict(topk_idx=topk_idx, num_max_tokens_per_rank=1 if rank == bad_rank else MAX_TOKENS),
        "ranks disagree on expert_alignment": dict(topk_idx=topk_idx, expert_alignment=1 + (rank == bad_rank)),
        "x a 3-tuple": dict(topk_idx=topk_idx, x=(x, x, x) if rank == bad_rank else x),
        "topk_idx a list": dict(topk_idx=topk_idx.tolist() if rank == bad_rank else topk_idx),
        "expert_alignment a bool": dict(topk_idx=topk_idx, expert_alignment=True if rank == bad_rank else 1),
        # past a 32-bit int (DeepEP's kernels' type): refused, not an overflow or a huge allocation on one rank
        "expert_alignment 2**31": dict(topk_idx=topk_idx, expert_alignment=2**31 if rank == bad_rank else 1,
                                       do_expand=True),
        "expert_alignment 2**64": dict(topk_idx=topk_idx, expert_alignment=2**64 if rank == bad_rank else 1),
        # hidden 0; more experts' counts than the window holds, or than any host (refused before the layout)
        "x of hidden 0": dict(topk_idx=topk_idx, x=x[:, :0] if rank == bad_rank else x),
        "num_experts past the window": dict(topk_idx=topk_idx, num_experts=4096 * R if rank == bad_rank else E),
        "num_experts 2**40": dict(topk_idx=topk_idx, num_experts=2**40 * R if rank == bad_rank else E),
        # K = 9 > L = 8 slots of one token on one rank: more than the capacity without CPU sync has room for
        "an expert repeated past the capacity": dict(
            topk_idx=torch.zeros(topk_idx.size(0), 9, dtype=torch.int64) if rank == bad_rank
            else torch.cat([topk_idx, torch.full((topk_idx.size(0), 9 - topk_idx.size(1)), -1)], dim=1),
            do_expand=True, do_cpu_sync=False),
    }
    needles = {"x a 3-tuple": "(x, sf) pair", "topk_idx a list": "`topk_idx` must be a torch.Tensor",
               "expert_alignment a bool": "expert_alignment", "expert_alignment 2**31": "[1, 2147483647]",
               "expert_alignment 2**64": "[1, 2147483647]",
               "an expert repeated past the capacity": "do_cpu_sync=True", "x of hidden 0": "hidden >= 1",
               "num_experts past the window": "num_experts=", "num_experts 2**40": "num_experts="}
    if R == 1:
        del cases["ranks disagree on expert_alignment"]
    for what, kw in cases.items():
        kw = dict(dict(num_experts=E), **kw)
        xin = kw.pop("x", x)
        _, err = capture(lambda kw=kw, xin=xin: ep.dispatch(xin, **kw))
        ok = isinstance(err, (TypeError, ValueError))
        if rank == bad_rank and what in needles:
            ok &= needles[what] in str(err) and not isinstance(err, ConsensusError)
        all_ranks_ok(comm, ok, f"{what}: {err!r}")
        # the buffer stays usable
        coll(lambda: ep.dispatch(x, topk_idx=topk_idx, num_experts=E))
    _, _, _, handle, _ = coll(lambda: ep.dispatch(x, topk_idx=topk_idx, num_experts=E))
    # a handle that is not an EPHandle on one rank: TypeError there, the peers refused (no wait to the deadline)
    _, err = capture(lambda: ep.dispatch(x, handle=handle if rank != bad_rank else ("not", "a handle")))
    ok = isinstance(err, TypeError) and "EPHandle" in str(err) if rank == bad_rank else isinstance(err, ConsensusError)
    all_ranks_ok(comm, ok, f"handle not an EPHandle: {err!r}")
    _, err = capture(lambda: ep.dispatch(x, handle=handle, do_cpu_sync=True))
    assert isinstance(err, AssertionError)
    other = coll(lambda: EPBuffer(comm, num_max_tokens_per_rank=MAX_TOKENS, hidden=HIDDEN, explicitly_destroy=True))
    try:
        _, err = capture(lambda: other.dispatch(x, handle=handle))
        all_ranks_ok(comm, isinstance(err, ValueError) and "another buffer" in str(err), f"foreign handle: {err!r}")
    finally:
        coll(other.destroy)
    _, err = capture(lambda: ep.dispatch(x, handle=handle, do_expand=True))
    all_ranks_ok(comm, isinstance(err, ValueError) and "do_expand" in str(err), f"layout mismatch: {err!r}")
    _, err = capture(lambda: ep.dispatch(x, topk_idx=topk_idx, num_experts=E, do_handle_copy=True))
    assert isinstance(err, AssertionError)


def test_flag_assertions_on_one_rank_raise_on_every_rank(ep, comm):
    """DeepEP's flag assertions (``do_handle_copy``, ``do_cpu_sync`` with a cached handle, ``defer_epilogue``
    without ``async_with_compute_stream``, ``num_qps`` past ``num_allocated_qps``; ``previous_event`` without
    ``allocate_on_comm_stream``, a ``RuntimeError``) passed by one rank only: that rank raises its error, the
    others ``ConsensusError`` naming it, in the same call (no rank left waiting), and the buffer stays usable;
    ``ElasticBuffer``'s ``num_cpu_bytes`` refused on one rank is refused at construction on every rank."""
    R, rank = comm.Get_size(), comm.Get_rank()
    E = 8 * R
    x, _, topk_idx, w = _inputs(rank, R, 3, E, False)
    bad = rank == R - 1
    _, _, _, handle, _ = coll(lambda: ep.dispatch(x, topk_idx=topk_idx, num_experts=E))
    y, _, _, _, _ = coll(lambda: ep.dispatch(x, handle=handle))
    qps = ep.num_allocated_qps + 1 if bad else ep.num_allocated_qps  # the allocated count itself fits
    event = ep.capture() if bad else None
    cases = {
        "do_handle_copy": lambda: ep.dispatch(x, topk_idx=topk_idx, num_experts=E, do_handle_copy=bad),
        "do_cpu_sync with a handle": lambda: ep.dispatch(x, handle=handle, do_cpu_sync=True if bad else None),
        "dispatch defer_epilogue": lambda: ep.dispatch(x, topk_idx=topk_idx, num_experts=E, defer_epilogue=bad,
                                                       async_with_compute_stream=False),
        "combine defer_epilogue": lambda: ep.combine(y, handle, defer_epilogue=bad),
        "dispatch num_qps": lambda: ep.dispatch(x, topk_idx=topk_idx, num_experts=E, num_qps=qps),
        "cached dispatch num_qps": lambda: ep.dispatch(x, handle=handle, num_qps=qps),
        "combine num_qps": lambda: ep.combine(y, handle, num_qps=qps),
        "dispatch previous_event": lambda: ep.dispatch(x, topk_idx=topk_idx, num_experts=E, previous_event=event),
        "combine previous_event": lambda: ep.combine(y, handle, previous_event=event),
        # not an event at all, with the flag set: refused in the first round too (no local wait on it)
        "dispatch previous_event not an event": lambda: ep.dispatch(
            x, topk_idx=topk_idx, num_experts=E, previous_event=5 if bad else None, allocate_on_comm_stream=bad),
        "combine previous_event not an event": lambda: ep.combine(y, handle, previous_event=5 if bad else None,
                                                                  allocate_on_comm_stream=bad),
        "dispatch num_qps negative": lambda: ep.dispatch(x, topk_idx=topk_idx, num_experts=E,
                                                         num_qps=-1 if bad else 0),
        "combine num_qps not an int": lambda: ep.combine(y, handle, num_qps="2" if bad else 0),
    }
    for what, call in cases.items():
        _, err = capture(call)
        want = ((TypeError if "not an event" in what else RuntimeError if "previous_event" in what
                 else ValueError if "negative" in what or "not an int" in what else AssertionError)
                if bad else ConsensusError)
        all_ranks_ok(comm, isinstance(err, want) and (bad or f"rank {R - 1}" in str(err)), f"{what}: {err!r}")
        coll(lambda: ep.dispatch(x, topk_idx=topk_idx, num_experts=E))  # still usable
    _, err = capture(lambda: ElasticBuffer(comm, num_cpu_bytes=-1 if bad else 0, num_max_tokens_per_rank=MAX_TOKENS,
                                           hidden=HIDDEN, explicitly_destroy=True))
    all_ranks_ok(comm, isinstance(err, ValueError) and "num_cpu_bytes" in str(err), f"num_cpu_bytes: {err!r}")


def test_event_overlap_hooks_and_allocator(comm):
    """``EventOverlap.current_stream_wait`` returns the hook's result once; ``wait`` is its alias;
    ``BufferAllocator`` places planned tensors at aligned offsets of one storage; ``ElasticBuffer``
    has V2's signatures: ``num_cpu_bytes`` third, ``do_handle_copy=True`` by default (the handle keeps
    a copy of ``topk_idx``, so the caller may change its own), ``previous_event_before_epilogue``."""
    from deepep_ascend import EventHandle, EventOverlap
    ev = EventOverlap(EventHandle())
    ev.register_hook_after_wait(lambda: 42)
    assert ev.current_stream_wait() == 42 and ev.wait() is None
    plan = BufferAllocator()
    a = plan.allocate((3, 5), torch.float32)
    b = plan.allocate((7,), torch.int64)
    assert plan.num_bytes == 2 * get_num_allocation_alignment() and a.device.type == "meta"
    storage = torch.zeros(plan.num_bytes, dtype=torch.uint8)
    plan.materialize(storage)
    a.fill_(1.5)
    b.fill_(-1)
    assert storage[:4].view(torch.float32).item() == 1.5
    assert storage[get_num_allocation_alignment():][:8].view(torch.int64).item() == -1
    with pytest.raises(RuntimeError):
        plan.allocate((1,), torch.int8)
    R, rank = comm.Get_size(), comm.Get_rank()
    buf = coll(lambda: ElasticBuffer(comm, num_max_tokens_per_rank=8, hidden=64, explicitly_destroy=True))
    try:
        x = torch.randn(8, 64).to(BF16)
        # distinct experts per row (docs/semantics/deepep-api.md §0)
        topk_idx = torch.rand(8, 2 * R, generator=torch.Generator().manual_seed(rank)).topk(2, dim=1).indices
        out = coll(lambda: buf.dispatch(x, topk_idx=topk_idx, num_experts=2 * R))
        handle = out[3]
        ok = isinstance(handle, EPHandle) and handle.topk_idx is not topk_idx
        ok &= torch.equal(handle.topk_idx, topk_idx)
        topk_idx.fill_(-1)  # the caller's own tensor: the handle is unaffected
        again = coll(lambda: buf.dispatch(x, handle=handle, previous_event_before_epilogue=buf.capture()))
        y, _, _ = coll(lambda: buf.combine(again[0], handle, previous_event_before_epilogue=buf.capture()))
        ok &= again[3] is handle and torch.equal(again[0], out[0]) and buf.num_cpu_bytes == 0
        all_ranks_ok(comm, ok, "ElasticBuffer's V2 signatures")
    finally:
        coll(buf.destroy)
    _, err = capture(lambda: buf.dispatch(x, topk_idx=topk_idx, num_experts=2 * R))  # errors say which class
    all_ranks_ok(comm, isinstance(err, RuntimeError) and "ElasticBuffer.dispatch: the buffer was destroyed" in str(err),
                 f"ElasticBuffer.dispatch after destroy: {err!r}")


def test_consensus_error_names_ranks(ep, comm):
    R = comm.Get_size()
    if R < 2:
        pytest.skip("needs two ranks")
    rank = comm.Get_rank()
    x = torch.zeros(2, HIDDEN).to(BF16)
    topk_idx = torch.zeros(2, 1, dtype=torch.int64)
    _, err = capture(lambda: ep.dispatch(x, topk_idx=topk_idx, num_experts=8 * R, do_expand=rank == 0))
    all_ranks_ok(comm, isinstance(err, ConsensusError) and "layout flags" in str(err), f"{err!r}")
