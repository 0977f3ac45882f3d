"""Buffer normal intranode mode vs the pure-torch reference, at any rank count (docs/semantics/deepep-api.md §4).

Run: ``mpiexec -n N python -m pytest --with-mpi -q tests/ep/test_intranode.py`` (N = 1, 2, 4, 8).

Comparison rules (see ``buffer_helpers.run_case``):

* data movement (``recv_x``, FP8 data and scales, ``recv_topk_idx``/``weights``, cached
  dispatch, handle entries, layout) is compared **bit for bit** with ``tests/support/reference.py``;
* combine is also compared **bitwise**: the reference sums ``f32(bias0) + f32(bias1)``, then each
  receiving rank's row in ascending rank order, in float32, rounding once to bf16 — the order the
  library implements — so no tolerance is needed anywhere in this file;
* handle entries 1, 2, 5 are computed independently in ``buffer_helpers`` from the masks.

Every test is collective (same calls in the same order on every rank).
"""

from __future__ import annotations

import pytest
import torch

from deepep_ascend import Buffer
from tests.support.buffer_helpers import (
    BF16,
    Case,
    Checker,
    coll,
    make_topk_idx,
    make_x,
    many_round_trips,
    run_case,
)
from tests.support.mpi_utils import gather_all, up_to_four_ranks, world
from tests.support.reference import ref_combine, ref_dispatch

pytestmark = [pytest.mark.mpi(min_size=1), pytest.mark.watchdog(180)]

CASES = [
    Case("uniform_h128_e16_k4"),
    Case("skewed_every_token_to_one_rank", tokens=24, hidden=256, experts=32, topk=4, routing="skewed"),
    Case("skewed_e8_k8", tokens=16, experts=8, topk=8, routing="skewed", bias="one"),
    Case("rank_with_zero_tokens", tokens=20, experts=16, topk=3, zero_rank=True, cached=True, bias="pair"),
    Case("rows_all_minus1", tokens=30, experts=64, topk=6, routing="allneg", bias="one", cached=True),
    Case("duplicate_experts_in_a_row", tokens=20, experts=16, topk=4, routing="dup", cached=True, use_async=True),
    Case("h2048_e64_k8_align128", tokens=12, hidden=2048, experts=64, topk=8, align=128),
    Case("h7168_e256_k8_few_tokens", tokens=3, hidden=7168, experts=256, topk=8, bias="pair"),
    Case("h200_not_div_128_bf16_k1_e8", tokens=20, hidden=200, experts=8, topk=1, cached=True),
    Case("e128_k2_align4", tokens=24, experts=128, topk=2, align=4),
    Case("k5_align128", tokens=20, experts=32, topk=5, align=128),
    Case("num_worst_tokens", tokens=16, experts=16, topk=4, worst=True, bias="one"),
    Case("num_worst_tokens_cached_async", tokens=10, experts=32, topk=2, worst=True, cached=True, use_async=True),
    Case("cached_new_data_bias_pair", tokens=28, cached=True, bias="pair"),
    Case("async_previous_event", tokens=24, use_async=True, cached=True, bias="pair_first_none"),
    Case("fp8_column_major_scales", tokens=24, hidden=256, x_kind="fp8", cached=True),
    Case("fp8_async_h512", tokens=12, hidden=512, x_kind="fp8", use_async=True, bias="one"),
    Case("fp8_rank_with_zero_tokens", tokens=10, hidden=256, experts=16, topk=4, x_kind="fp8", zero_rank=True,
         cached=True),
    Case("fp8_ue8m0_int32_scales", tokens=12, hidden=1024, experts=32, topk=4, x_kind="fp8_ue8m0"),
    Case("bias_one_tensor", tokens=16, bias="one"),
    Case("bias_pair", tokens=16, bias="pair"),
    Case("no_topk", tokens=24, with_topk=False, cached=True),
    Case("x_float32_bytes", tokens=16, hidden=64, x_kind="f32", cached=True),
    Case("config_num_sms_8", tokens=40, num_sms=8, cached=True),
    Case("config_num_sms_2_one_channel", tokens=9, num_sms=2, zero_rank=True),
]


def _hint(num_ranks, cases):
    return max(Buffer.get_normal_buffer_size_hint(**c.hint_args(num_ranks)) for c in cases)


@pytest.fixture(scope="module")
def buf(buffers):
    return buffers(_hint(world().Get_size(), CASES))


@pytest.mark.parametrize("case", CASES, ids=str)
def test_dispatch_combine_vs_reference(buf, comm, case):
    chk = run_case(buf, comm, case, seed=CASES.index(case))
    chk.finish(case.name)


@pytest.mark.parametrize("case", [c for c in CASES if c.name in (
    "uniform_h128_e16_k4", "rank_with_zero_tokens", "h7168_e256_k8_few_tokens", "async_previous_event",
    "fp8_column_major_scales")], ids=str)
def test_dispatch_combine_without_the_native_kernel(buf, comm, case, monkeypatch):
    """Where the native row sum is not built (or ``DEEPEP_ASCEND_NATIVE=0``), combine sums with its
    torch paths (at 2 ranks staged rows cleaned with ``+ 0.0`` for the run-wise sum): same results."""
    from deepep_ascend import native
    from deepep_ascend.native.loader import kernels

    monkeypatch.setattr(kernels, "sum_rows_bf16", None)
    assert not native.available()
    chk = run_case(buf, comm, case, seed=CASES.index(case))
    chk.finish(case.name + " (torch paths)")


@pytest.mark.parametrize("case", [c for c in CASES if c.name in (
    "uniform_h128_e16_k4", "h7168_e256_k8_few_tokens", "bias_pair", "async_previous_event")], ids=str)
def test_combine_staging_by_streaming_stores_vs_reference(buf, comm, case):
    """The combine staging its returned rows by streaming stores on every rank (``native.ll_stream_rows("always",
    side="send")``; rows of 256 bytes or more stream): the reference's bits."""
    from deepep_ascend import native

    before = native.ll_stream_rows(side="send"), native.ll_stream_min_bytes(side="send")
    native.ll_stream_rows("always", side="send")
    try:
        chk = run_case(buf, comm, case, seed=CASES.index(case))
        chk.finish(case.name + " (combine staged by streaming stores)")
    finally:
        native.ll_stream_rows(*before, side="send")


def test_a_link_emulator_takes_the_steps_one_by_one(buf, comm, monkeypatch):
    """The fused tails (``IntranodePlan.dispatch_tail``, ``IntranodePlan.combine(..., tail=)``) raise ``XDATA`` and
    ``CONSUMED`` inside C, before Python charges a link emulator the emulated time of the rows received; with an
    emulator set the engine takes the steps one by one, each receive charged before the signal that releases the
    peers. The same results either way (the reference checks)."""
    from deepep_ascend import native
    from deepep_ascend.transports import LinkEmulator

    if buf._engine._plan is None:
        pytest.skip("no native plan here (kernels not built, or ranks not all mapped)")
    fused = []
    tail, combine = native.IntranodePlan.dispatch_tail, native.IntranodePlan.combine

    def spy_tail(self, *args, **kwargs):
        fused.append("dispatch")
        return tail(self, *args, **kwargs)

    def spy_combine(self, *args, **kwargs):
        if kwargs.get("tail", args[13] if len(args) > 13 else None) is not None:
            fused.append("combine")
        return combine(self, *args, **kwargs)

    monkeypatch.setattr(native.IntranodePlan, "dispatch_tail", spy_tail)
    monkeypatch.setattr(native.IntranodePlan, "combine", spy_combine)
    case = CASES[0]
    run_case(buf, comm, case, seed=90).finish(case.name)
    assert sorted(set(fused)) == ["combine", "dispatch"]
    fused.clear()
    buf.runtime.set_link_emulator(LinkEmulator("UBMEM=1000:0"))
    try:
        run_case(buf, comm, case, seed=91).finish(case.name + " (link emulator)")
    finally:
        buf.runtime.set_link_emulator(None)
    assert fused == []


def test_get_dispatch_layout_outputs(buf, comm):
    """Layout alone: exact values, int32/bool dtypes, None for the RDMA count, sync and async."""
    from tests.support.reference import ref_dispatch_layout

    r, R = comm.Get_rank(), comm.Get_size()
    chk = Checker(r)
    gen = torch.Generator().manual_seed(77 + r)
    for kind, n, e, k in (("uniform", 40, 16, 4), ("allneg", 9, 8, 8), ("skewed", 5, 256, 3), ("uniform", 0, 32, 2)):
        idx = make_topk_idx(kind, n, e, k, r, R, gen)
        e_ntpr, _, e_ntpe, e_itr = ref_dispatch_layout(idx, e, R)
        for async_finish in (False, True):
            ntpr, rdma, ntpe, itr, ev = buf.get_dispatch_layout(idx, e, async_finish=async_finish)
            if async_finish:
                chk.check(ev.event is not None, "async layout: no event")
                ev.current_stream_wait()
            tag = f"{kind} n={n} E={e} K={k} async={async_finish}"
            chk.check(rdma is None, f"{tag}: num_tokens_per_rdma_rank must be None")
            chk.same_bits(ntpr, e_ntpr, f"{tag}: num_tokens_per_rank")
            chk.same_bits(ntpe, e_ntpe, f"{tag}: num_tokens_per_expert")
            chk.same_bits(itr, e_itr, f"{tag}: is_token_in_rank")
    chk.finish("layout")


@up_to_four_ranks()
def test_many_round_trips_without_cleaning(buf, comm):
    """200 consecutive round trips, nothing cleaned (see ``buffer_helpers.many_round_trips``)."""
    many_round_trips(buf, comm).finish("200 round trips")


def _ring_inputs(r, R, n, E, K, H, gen):
    idx = make_topk_idx("ring", n, E, K, r, R, gen)
    return idx, torch.rand(n, K, generator=gen)


def test_link_stats_per_peer_and_projection(buf, comm):
    """Same ring routing, one BF16 dispatch: ``get_link_stats`` has the bytes per (kind, peer) —
    rank r loads ``N_prev`` rows from ``r - 1`` over UBMEM and keeps its ``N_r`` own rows (SELF) —
    and ``transports.project`` of every rank's counters gives the hand-computed time: with zero
    latency the busiest UBMEM port moves ``max_s N_s = 9 + R`` rows, received by rank 0 (its
    first maximum; rank R-1 sends as many)."""
    from deepep_ascend.transports import ChannelKind, gather_link_stats, project

    r, R = comm.Get_rank(), comm.Get_size()
    E, K, H = 16, 2, 256
    n, n_prev, prev = 10 + r, 10 + (r - 1) % R, (r - 1) % R
    gen = torch.Generator().manual_seed(11 + r)
    idx, w = _ring_inputs(r, R, n, E, K, H, gen)
    x = torch.randn(n, H, generator=gen).to(BF16)
    row = 2 * H + 12 * K

    def go():
        ntpr, _, ntpe, itr, _ = buf.get_dispatch_layout(idx, E)
        buf.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=itr, num_tokens_per_expert=ntpe,
                     topk_idx=idx, topk_weights=w)
        return buf.get_link_stats()

    stats = coll(go, what="dispatch")
    want_fetched = torch.zeros(len(ChannelKind), R, dtype=torch.int64)
    want_fetched[ChannelKind.SELF, r] = n * row
    if R > 1:
        want_fetched[ChannelKind.UBMEM, prev] = n_prev * row
    chk = Checker(r)
    chk.check(torch.equal(torch.from_numpy(stats["bytes_fetched"]), want_fetched),
              f"bytes_fetched {stats['bytes_fetched'].tolist()} != {want_fetched.tolist()}")
    chk.check(not stats["bytes_put"][ChannelKind.URMA].any() and not stats["bytes_fetched"][ChannelKind.URMA].any(),
              "URMA bytes on one node")
    proj = project(gather_link_stats(stats, comm), "SELF=1000:0,UBMEM=1:0")
    if R > 1:
        want = dict(rank=0, kind="UBMEM", direction="received", bytes=(9 + R) * row)
        chk.check(proj["bottleneck"] == want, f"bottleneck {proj['bottleneck']} != {want}")
        chk.check(abs(proj["time_s"] - (9 + R) * row / 1e9) <= 1e-15, f"time {proj['time_s']}")
    else:
        chk.check(proj["bottleneck"] == dict(rank=0, kind="SELF", direction="sent", bytes=n * row),
                  f"bottleneck {proj['bottleneck']}")
        chk.check(abs(proj["time_s"] - n * row / 1000e9) <= 1e-15, f"time {proj['time_s']}")
    chk.finish("link stats")


def test_get_traffic_matches_hand_computed_bytes(buf, comm):
    """Known routing: token t of rank s goes to ranks s and s+1 (mod R), K = 2, N_s = 10 + s.

    Bytes are counted by the receiver of each transfer (``get_traffic`` docstring): per received
    row, dispatch ``H·itemsize + scale bytes + 12·K``, cached dispatch ``H·itemsize + scale
    bytes``, combine (at the origin) ``2H + 4·K'``. Rows a rank routes to itself are SELF, the
    rest UBMEM; nothing is URMA on one node.
    """
    r, R = comm.Get_rank(), comm.Get_size()
    chk = Checker(r)
    E, K, H = 16, 2, 256
    n = 10 + r
    prev = (r - 1) % R
    n_prev = 10 + prev
    gen = torch.Generator().manual_seed(5 + r)
    idx, w = _ring_inputs(r, R, n, E, K, H, gen)

    def expect(row_self, row_other, own_rows, other_rows):
        return {"SELF": own_rows * row_self, "UBMEM": other_rows * row_other if R > 1 else 0, "URMA": 0}

    lifetime0 = buf.get_traffic(lifetime=True)
    total = {"SELF": 0, "UBMEM": 0, "URMA": 0}
    for kind in ("bf16", "fp8"):
        x, _ = make_x(kind, n, H, gen)
        itemsize, sb = (2, 0) if kind == "bf16" else (1, 4 * (H // 128))

        def go(x=x, kind=kind):
            ntpr, _, ntpe, itr, _ = buf.get_dispatch_layout(idx, E)
            out = buf.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=itr, num_tokens_per_expert=ntpe,
                               topk_idx=idx, topk_weights=w)
            t_disp = buf.get_traffic()
            cached = buf.dispatch(x, handle=out[4])
            t_cached = buf.get_traffic()
            recv_bf16 = out[0] if kind == "bf16" else out[0][0].to(BF16)
            buf.combine(recv_bf16, out[4], topk_weights=out[2])
            t_comb = buf.get_traffic()
            del cached
            return t_disp, t_cached, t_comb

        t_disp, t_cached, t_comb = coll(go, what=f"traffic {kind}")
        other_rows = n_prev if R > 1 else 0
        e_disp = expect(H * itemsize + sb + 12 * K, H * itemsize + sb + 12 * K, n, other_rows)
        e_cached = expect(H * itemsize + sb, H * itemsize + sb, n, other_rows)
        e_comb = expect(2 * H + 4 * K, 2 * H + 4 * K, n, n if R > 1 else 0)
        chk.check(t_disp == e_disp, f"{kind} dispatch traffic {t_disp} != expected {e_disp}")
        chk.check(t_cached == e_cached, f"{kind} cached dispatch traffic {t_cached} != expected {e_cached}")
        chk.check(t_comb == e_comb, f"{kind} combine traffic {t_comb} != expected {e_comb}")
        for t in (e_disp, e_cached, e_comb):
            for k2 in total:
                total[k2] += t[k2]
    lifetime1 = buf.get_traffic(lifetime=True)
    delta = {k2: lifetime1[k2] - lifetime0[k2] for k2 in lifetime1}
    chk.check(delta == total, f"lifetime traffic grew by {delta}, expected the sum of the calls {total}")
    chk.finish("traffic")


# ----------------------------------------------------------------------------------------------
# buffer sizing: the hint, a much smaller buffer streaming in rounds, a buffer too small


def _align(x):
    return -(-x // 128) * 128


def _just_above_minimum(R, E, H, K, itemsize=2, scale_bytes=0):
    """A window a couple of rows above the smallest that works (window layout of intranode.py).

    Half-window = 1024 B header + 128-aligned int32 vector + one 128-aligned array per row
    field; dispatch needs >= 1 row (fields x, scales, topk idx, weights, mask), combine >= R rows.
    """
    disp = 1024 + _align(4 * (R + E)) + 128 * 5 + 2 * (H * itemsize + scale_bytes + 12 * K + R)
    comb = 1024 + _align(4 * R) + 128 * 2 + (R + 1) * (2 * H + 4 * K)
    return 2 * _align(max(disp, comb))


STREAM_CASES = [
    Case("stream_bf16", tokens=24, hidden=256, experts=16, topk=4, cached=True, bias="pair"),
    Case("stream_fp8_worst_async", tokens=8, hidden=256, experts=16, topk=4, x_kind="fp8", cached=True,
         worst=True, use_async=True),
]


def test_size_hint_buffer_and_much_smaller_streaming_buffer(comm):
    """A Buffer of exactly ``get_normal_buffer_size_hint`` works in one round; one just above the
    minimum gives bit-identical results (both equal the reference) while streaming in many rounds."""
    R = comm.Get_size()
    hint = _hint(R, STREAM_CASES)
    small = _just_above_minimum(R, 16, 256, 4)
    assert small * 4 <= hint, f"test setup: small={small} B is not much smaller than the hint {hint} B"
    payload = STREAM_CASES[0].tokens * (256 * 2 + 12 * 4)  # one rank's dispatch rows, bytes
    assert payload > small, f"test setup: payload {payload} B fits the small buffer ({small} B)"
    chk = Checker(comm.Get_rank())
    signals = {}
    for name, nbytes in (("hint", hint), ("small", small)):
        b = Buffer(None, nbytes, comm=comm, explicitly_destroy=True)
        try:
            s0 = int(b.runtime.stats.signals.sum())
            for i, case in enumerate(STREAM_CASES):
                run_case(b, comm, case, seed=900 + i, chk=chk)
            signals[name] = int(b.runtime.stats.signals.sum()) - s0
        finally:
            coll(b.destroy, what=f"destroy {name} buffer")
    if R > 1:  # more rounds, more READY/CONSUMED signals: the small buffer really streamed
        chk.check(signals["small"] > 3 * signals["hint"], f"signals hint/small: {signals}: the small buffer "
                  f"did not stream in rounds")
    chk.finish("hint and small buffers")


@pytest.mark.parametrize("streaming", [False, True], ids=["one_round", "streaming"])
@up_to_four_ranks()
def test_native_plan_gives_the_step_by_step_bits_and_traffic(comm, streaming, monkeypatch):
    """On one node with the kernels loaded the engine runs its fixed work from a native plan
    (``native.IntranodePlan``: signals, waits, chunk-0 exchange, staging, stores, receives); a Buffer built with
    ``DEEPEP_ASCEND_NORMAL_NATIVE=0`` takes the transport's ``signal()`` / ``wait_until()`` and the torch steps.
    The same calls (every kind of dispatch and combine, and with ``streaming`` a buffer just above the minimum,
    so that calls run in many rounds) pass the reference on both, and count the same bytes, puts and signals
    per peer."""
    from tests.support.buffer_helpers import all_ranks_ok, capture

    R = comm.Get_size()
    nbytes = _just_above_minimum(R, 16, 256, 4) if streaming else _hint(R, STREAM_CASES + CASES[:6])
    cases = STREAM_CASES + ([] if streaming else CASES[:6])

    def run(what):
        b = coll(lambda: Buffer(None, nbytes, comm=comm, explicitly_destroy=True), what=f"Buffer() {what}")
        stats = b.runtime.stats
        before = [stats.bytes_put.copy(), stats.puts.copy(), stats.signals.copy()]
        chk = Checker(comm.Get_rank())
        for i, case in enumerate(cases):
            run_case(b, comm, case, seed=700 + i, chk=chk)
        chk.finish(what)
        counted = [now - then for now, then in zip((stats.bytes_put, stats.puts, stats.signals), before)]
        native_plan = b._engine._plan is not None
        _, exc = capture(b.destroy)
        return native_plan, counted, exc

    on, by_plan, exc = run("native plan")
    if not on:
        pytest.skip("no native plan here (kernels not built, or ranks not all mapped)")
    monkeypatch.setenv("DEEPEP_ASCEND_NORMAL_NATIVE", "0")
    off, by_steps, exc2 = run("step by step")
    same = [bool((a == b).all()) for a, b in zip(by_plan, by_steps)]
    all_ranks_ok(comm, not off and all(same) and exc is None and exc2 is None and (R == 1 or by_plan[2].any()),
                 f"setting off: still native {off}; bytes/puts/signals equal {same}; destroy {exc!r} {exc2!r}")


@pytest.mark.parametrize("nbytes", [2048, 128], ids=["header_only_2048B", "below_header_128B"])
def test_buffer_too_small_raises_everywhere(comm, nbytes):
    """A window with room for the header but no row, or not even the header: ValueError on every
    rank naming the size hint; the Buffer still destroys cleanly."""
    from tests.support.buffer_helpers import all_ranks_ok, capture

    r, R = comm.Get_rank(), comm.Get_size()
    b = Buffer(None, nbytes, comm=comm, explicitly_destroy=True)
    gen = torch.Generator().manual_seed(3 + r)
    idx = make_topk_idx("uniform", 8, 16, 2, r, R, gen)
    w = torch.rand(8, 2, generator=gen)
    x = torch.randn(8, 128, generator=gen).to(BF16)
    ntpr, _, ntpe, itr, _ = b.get_dispatch_layout(idx, 16)
    _, exc = capture(lambda: b.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=itr,
                                        num_tokens_per_expert=ntpe, topk_idx=idx, topk_weights=w))
    ok = isinstance(exc, ValueError) and "too small" in str(exc) and "get_normal_buffer_size_hint" in str(exc)
    _, dexc = capture(b.destroy)
    all_ranks_ok(comm, ok and dexc is None,
                 f"dispatch on a {nbytes} B buffer: expected ValueError naming the hint, got {exc!r}; "
                 f"destroy: {dexc!r}")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("bias_kind", ["none", "one", "pair"])
@pytest.mark.parametrize("use_native", [True, False], ids=["native", "torch_paths"])
def test_combine_signed_zeros_match_the_sum_from_zero(buf, comm, bias_kind, use_native, monkeypatch):
    """Combine sums from +0.0 (or the biases) in float32: -0.0 rows give +0.0, as in DeepEP and the
    reference, with the native kernel and on the torch paths (whole-block and indexed accumulation), but
    two -0.0 biases start the sum at -0.0, and -0.0 rows then keep it (no path may clean the rows' zeros)."""
    from deepep_ascend.native.loader import kernels

    if not use_native:
        monkeypatch.setattr(kernels, "sum_rows_bf16", None)
    r, R = comm.Get_rank(), comm.Get_size()
    E, n, H = 4 * R, 64, 256
    gen = torch.Generator().manual_seed(r)
    idx = torch.randperm(E, generator=gen)[:2].repeat(n, 1)  # same two experts for every token
    idx[n // 2:, 1] = -1  # the second half reaches fewer ranks: indexed path
    every = torch.arange(R).repeat_interleave(E // R)  # expert -> rank
    idx[::3, 0] = (torch.nonzero(every == r)[0] if R > 1 else 0)  # some tokens stay home
    w = torch.rand(n, 2, generator=gen)
    x = torch.full((n, H), -0.0, dtype=torch.bfloat16)
    x[::5] = torch.randn(len(range(0, n, 5)), H, generator=gen).bfloat16()
    bias = None if bias_kind == "none" else torch.full((n, H), -0.0, dtype=torch.bfloat16)
    bias = (bias, bias.clone()) if bias_kind == "pair" else bias
    ntpr, _, ntpe, itr, _ = buf.get_dispatch_layout(idx, E)
    recv_x, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=itr,
                                             num_tokens_per_expert=ntpe, topk_idx=idx, topk_weights=w)
    expected = ref_combine(gather_all(recv_x), gather_all(itr), r, bias, None)[0]
    for y in (recv_x, recv_x.clone()):  # read where the dispatch left it, and staged (another tensor)
        combined, _, _ = buf.combine(y, handle, bias=bias)
        assert torch.equal(combined.view(torch.int16), expected.view(torch.int16))  # bitwise, signed zeros too


@pytest.mark.mpi(min_size=1)
def test_fp8_single_scale_column_and_chained_async_handle(buf, comm):
    """hidden 128: the FP8 scales have one column; allocated [1, N] and transposed (DeepGEMM's
    column-major layout) they must be accepted. An async dispatch whose event is only consumed as
    combine's previous_event must still leave a complete handle (entry 2 included)."""
    from tests.support.reference import per_token_cast_to_fp8

    r, R = comm.Get_rank(), comm.Get_size()
    E, n, H = 4 * R, 40, 128
    gen = torch.Generator().manual_seed(7 + r)
    idx = torch.randn(n, E, generator=gen).topk(2, dim=1).indices
    w = torch.rand(n, 2, generator=gen)
    x = torch.randn(n, H, generator=gen).bfloat16()
    data, scales = per_token_cast_to_fp8(x)
    col_major = scales.t().contiguous().t()  # [n, 1] with strides (1, n)
    layout = buf.get_dispatch_layout(idx, E)
    kw = dict(num_tokens_per_rank=layout[0], is_token_in_rank=layout[3], num_tokens_per_expert=layout[2],
              topk_idx=idx, topk_weights=w)
    (rx, rs), *_, sync_handle, _ = buf.dispatch((data, col_major), **kw)
    (rx2, rs2), *_, handle, ev = buf.dispatch((data, scales), async_finish=True, **kw)
    y, _, _ = buf.combine(torch.zeros(rx2.shape, dtype=torch.bfloat16), handle, previous_event=ev)  # sync
    ok = torch.equal(rx.view(torch.uint8), rx2.view(torch.uint8)) and torch.equal(rs, rs2)
    ok = ok and all(torch.equal(a, b) for a, b in zip(sync_handle, handle))
    assert ok and bool((y == 0).all())


@pytest.mark.mpi(min_size=1)
def test_duplicate_experts_in_a_row_follow_deepep(buf, comm):
    """The documented rule for a token listing the same expert twice: counted per (token, slot),
    delivered as two recv_topk_idx entries, its row sent once per rank; combined weights return
    both weights. Compared with the reference on every output."""
    r, R = comm.Get_rank(), comm.Get_size()
    E, n, H, K = 4 * R, 30, 64, 4
    gen = torch.Generator().manual_seed(31 + r)
    idx = torch.randint(0, E, (n, K), generator=gen)
    idx[:, 1] = idx[:, 0]  # every row repeats its first expert
    idx[::4, 2:] = -1
    w = torch.rand(n, K, generator=gen)
    x = torch.randn(n, H, generator=gen).bfloat16()
    ntpr, _, ntpe, itr, _ = buf.get_dispatch_layout(idx, E)
    recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
        x, num_tokens_per_rank=ntpr, is_token_in_rank=itr, num_tokens_per_expert=ntpe, topk_idx=idx, topk_weights=w)
    ref = ref_dispatch(gather_all(x), gather_all(idx), gather_all(w), E, r)
    assert torch.equal(ntpe, torch.bincount(idx[idx >= 0], minlength=E).int())
    assert torch.equal(recv_x, ref.recv_x) and torch.equal(recv_idx, ref.recv_topk_idx)
    assert torch.equal(recv_w, ref.recv_topk_weights) and counts == ref.num_recv_tokens_per_expert_list
    combined, combined_w, _ = buf.combine(recv_x, handle, topk_weights=recv_w)
    exp_x, exp_w = ref_combine(gather_all(recv_x), gather_all(itr), r, None, gather_all(recv_w))
    assert torch.equal(combined, exp_x) and torch.equal(combined_w, exp_w)
    assert torch.equal(combined_w, torch.where(idx >= 0, w, torch.zeros_like(w)))
