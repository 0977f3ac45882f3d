"""Buffer low-latency mode (docs/semantics/deepep-api.md §6) vs the pure-torch reference
(``tests/support/reference.py``).

Run: ``mpiexec -n N python -m pytest --with-mpi -q tests/ep/test_low_latency.py`` (N = 1, 2, 4, 8).
Each case runs on three Buffers: one node with UBMEM stores (default), one node with
``allow_nvlink_for_low_latency_mode=False`` (the ``put`` path), and two simulated nodes
(``ranks_per_node = R/2``: peers on the other node over URMA). Dispatch outputs are compared bit
for bit (FP8 data and scales included), combine bit for bit with the reference's float32
accumulation and with docs/semantics/deepep-api.md §9's ``calc_diff`` bounds (invariants 10-14); a LogFMT-10 combine bit
for bit with the reference applied to the codec's round trip of each expert row, and within the
codec's error bound of the BF16 combine.
"""

from __future__ import annotations

import collections
import time
import warnings
from dataclasses import dataclass

import pytest
import torch

from deepep_ascend import (
    Buffer,
    ConsensusError,
    logfmt10_decode,
    logfmt10_encode,
    logfmt10_wire_bytes,
    native,
)
from deepep_ascend.ep.low_latency import Layout
from tests.support.buffer_helpers import (
    BF16,
    Checker,
    all_ranks_ok,
    bits,
    capture,
    coll,
)
from tests.support.mpi_utils import gather_all, up_to_four_ranks, world
from tests.support.reference import (
    calc_diff,
    per_token_cast_back,
    ref_ll_combine,
    ref_ll_dispatch,
)

pytestmark = [pytest.mark.mpi(min_size=1), pytest.mark.watchdog(240)]

MAX_M, MAX_H, MAX_EPR = 32, 512, 4  # window sizing: largest M, hidden, experts per rank of the cases


def _hint(R):
    return Buffer.get_low_latency_rdma_size_hint(MAX_M, MAX_H, R, MAX_EPR * R)


def _configs():
    R = world().Get_size()
    out = [pytest.param("ubmem", id="1node"), pytest.param("put", id="1node_put")]
    if R >= 2:
        out.append(pytest.param("nodes", id=f"2x{R // 2}"))
    return out


def _buf(buffers, cfg):
    """The module's low-latency Buffer of configuration ``cfg`` (``ubmem``, ``put`` or ``nodes``)."""
    R = world().Get_size()
    kw = dict(low_latency_mode=True)
    if cfg == "put":
        kw["allow_nvlink_for_low_latency_mode"] = False
    if cfg == "nodes":
        kw["ranks_per_node"] = R // 2
    return buffers(0, _hint(R), key=cfg, **kw)


# ----------------------------------------------------------------------------------------------
# inputs


def make_inputs(seed, rank, R, n, hidden, num_experts, k, routing="uniform", pattern=False, logfmt=False):
    """``(x [n, H] bf16, topk_idx [n, K] int64)`` of rank ``rank``, reproducible on any rank.

    ``uniform``: top-k of random scores, then 10 random slots set to -1 (docs/semantics/deepep-api.md §9); ``allneg``:
    also every third row all -1; ``one``: every token to global expert 0 only; ``dup``: ``uniform``, then
    slot 1 repeats slot 0 and every third row lists slot 0's expert a third time, in slot 2
    (docs/semantics/deepep-api.md §0). ``pattern``:
    docs/semantics/deepep-api.md §9's ``x``: ``rank - 128`` with the last 128 columns = token index. ``logfmt``: values
    for a LogFMT-10 combine: ``|x| < 1`` (groups go LogFMT) except the first group of even tokens
    (times 16: ``|x| >= 1``, BF16) and the last group of every third token (zero, BF16).
    """
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    if pattern:
        x = torch.full((n, hidden), float(rank - 128))
        x[:, -128:] = torch.arange(n, dtype=torch.float32).unsqueeze(1)
        x = x.to(BF16)
    elif logfmt:
        x = torch.randn(n, hidden, generator=gen) * 0.1
        x[::2, :128] *= 16
        x[1::3, -128:] = 0
        x = x.to(BF16)
    else:
        x = (torch.randn(n, hidden, generator=gen) * 2).to(BF16)
    if routing == "one":
        idx = torch.full((n, k), -1, dtype=torch.int64)
        idx[:, 0] = 0
        return x, idx
    scores = torch.rand(n, num_experts, generator=gen)
    kk = min(k, num_experts)  # few experts (one rank): the remaining slots are -1
    idx = scores.topk(kk, dim=1).indices if n else torch.empty(0, kk, dtype=torch.int64)
    idx = torch.cat([idx, torch.full((n, k - kk), -1, dtype=torch.int64)], dim=1)
    if idx.numel():
        drop = torch.randperm(idx.numel(), generator=gen)[:10]
        idx.view(-1)[drop] = -1
    if routing == "allneg":
        idx[::3] = -1
    if routing == "dup" and k >= 3:
        idx[:, 1] = idx[:, 0]
        idx[::3, 2] = idx[::3, 0]
    return x, idx.contiguous()


#: LogFMT-10's largest relative error, for any group: half a level at the largest step, 32/510.
LOGFMT_MAX_REL = (2 ** (32 / 510) - 1) / (2 ** (32 / 510) + 1)


def logfmt_round_trip(row):
    """float32 ``[H]``: the bf16 row through LogFMT-10 (what the receiver sums)."""
    return logfmt10_decode(*logfmt10_encode(row.view(1, -1)))[0]


def _scale_of(g):
    return 1.0 + (g % 3) * 0.5


def expert_outputs(recv_x, rank, L, fp8):
    """Expert ``g``'s output for a received row: ``bf16(f32(row) * (1 + g % 3 / 2))`` (FP8 rows dequantised)."""
    if fp8:
        data, scales = recv_x
        dense = torch.empty(scales.shape, dtype=scales.dtype).copy_(scales)  # (size-1 dims keep odd strides)
        rows = torch.stack([per_token_cast_back(data[e], dense[e]) for e in range(L)])
    else:
        rows = recv_x
    s = torch.tensor([_scale_of(rank * L + e) for e in range(L)]).view(L, 1, 1)
    return (rows.float() * s).to(BF16).contiguous()


def ref_expert_row(x_src_row, g, fp8, round_scale, use_ue8m0):
    from tests.support.reference import ref_ll_cast_fp8
    if fp8:
        d, s = ref_ll_cast_fp8(x_src_row.view(1, -1), round_scale, use_ue8m0)
        row = per_token_cast_back(d, s)[0]
    else:
        row = x_src_row
    return (row.float() * _scale_of(g)).to(BF16)


@dataclass
class Case:
    name: str
    tokens: int = 12
    m: int = 16
    hidden: int = 256
    epr: int = 2
    topk: int = 3
    routing: str = "uniform"
    fp8: bool = False
    round_scale: bool = False
    ue8m0: bool = False
    zero_rank: bool = False
    mode: str = "sync"  # sync | async | hook
    pattern: bool = False
    logfmt: bool = False  # LogFMT-10 combine (and make_inputs' logfmt values)

    def __str__(self):
        return self.name


CASES = [
    Case("bf16_pattern_invariants", pattern=True, hidden=384, tokens=16, m=16),
    Case("fp8_f32_scales_async", fp8=True, mode="async", hidden=512),
    Case("fp8_round_scale_hook", fp8=True, round_scale=True, mode="hook", epr=4, topk=4),
    Case("fp8_ue8m0_packed", fp8=True, round_scale=True, ue8m0=True, hidden=512, tokens=9, m=9),
    Case("bf16_h200_rows_all_minus1_zero_rank", hidden=200, routing="allneg", zero_rank=True),
    Case("every_token_to_one_expert_n_eq_m", routing="one", tokens=32, m=32, topk=2),
    Case("bf16_logfmt_combine_hook", logfmt=True, mode="hook", hidden=384),
    Case("fp8_logfmt_combine_async_zero_rank", fp8=True, logfmt=True, mode="async", zero_rank=True, epr=4, topk=4),
    # An expert listed two or three times in a row: one row per slot (up to 3 * 8 = 24 = M per expert).
    Case("bf16_duplicate_experts_in_a_row", routing="dup", tokens=8, m=24, topk=4),
    Case("fp8_ue8m0_duplicate_experts_hook", routing="dup", fp8=True, round_scale=True, ue8m0=True, hidden=512,
         tokens=8, m=24, topk=3, mode="hook"),
    # One expert per rank: each destination's count vector is one word, a column of the [R, L] counts
    Case("bf16_one_expert_per_rank", epr=1, topk=2),
]


def _finish(ev, hook, mode):
    if mode == "async":
        assert ev.event is not None and hook is None
        ev.current_stream_wait()
    elif mode == "hook":
        assert hook is not None and ev.event is None
        hook()
    else:
        assert hook is None and ev.event is None


def run_ll_case(buf, comm, case: Case, seed: int, chk: Checker, masked=()):
    r, R = comm.Get_rank(), comm.Get_size()
    E, L, M, H, K = case.epr * R, case.epr, case.m, case.hidden, case.topk
    ns = [0 if (case.zero_rank and s == R - 1) else case.tokens for s in range(R)]
    inputs = [make_inputs(seed, s, R, ns[s], H, E, K, case.routing, case.pattern, case.logfmt) for s in range(R)]
    x, idx = inputs[r]
    cum = torch.zeros(L, dtype=torch.int32)
    wait = torch.zeros(R, dtype=torch.int64)

    def dispatch():
        out = buf.low_latency_dispatch(x, idx, M, E, cumulative_local_expert_recv_stats=cum,
                                       dispatch_wait_recv_cost_stats=wait, use_fp8=case.fp8,
                                       round_scale=case.round_scale, use_ue8m0=case.ue8m0,
                                       async_finish=case.mode == "async", return_recv_hook=case.mode == "hook")
        if case.mode == "hook":
            torch.randn(64, 64) @ torch.randn(64, 64)  # compute between the sends and the receive
        _finish(out[3], out[4], case.mode)
        return out

    recv_x, recv_count, handle, _, _ = coll(dispatch, what=f"{case.name}: dispatch")
    ref = ref_ll_dispatch([i[0] for i in inputs], [i[1] for i in inputs], r, E, M, case.fp8, case.round_scale,
                          case.ue8m0, masked=masked)
    src_info, layout_range = handle[0], handle[1]
    chk.check(handle[2:] == (M, H, E), f"{case.name}: handle (M, H, E) = {handle[2:]}")
    chk.same_bits(recv_count, ref.recv_count, f"{case.name}: recv_count")
    chk.same_bits(layout_range, ref.layout_range, f"{case.name}: layout_range")
    chk.same_bits(src_info, ref.src_info, f"{case.name}: src_info (rows past the counts 0)")
    if case.fp8:
        data, scales = recv_x
        chk.same_bits(data, ref.recv_x, f"{case.name}: FP8 data")
        chk.check(tuple(scales.shape) == tuple(ref.recv_scales.shape) and scales.transpose(1, 2).is_contiguous(),
                  f"{case.name}: scales {tuple(scales.shape)} strides {scales.stride()} are not column-major "
                  f"{tuple(ref.recv_scales.shape)}")
        dense = torch.empty(scales.shape, dtype=scales.dtype).copy_(scales)  # (size-1 dims keep odd strides)
        chk.same_bits(dense, ref.recv_scales, f"{case.name}: scales")
        if case.ue8m0:
            b = dense.view(torch.uint8)
            chk.check(bool(((b == 0) | (b >= 100)).all()), f"{case.name}: UE8M0 bytes are not 2^k exponents")
        elif case.round_scale:
            nz = dense[dense != 0]
            chk.check(torch.equal(torch.exp2(torch.log2(nz).round()), nz), f"{case.name}: round_scale scales not 2^k")
    else:
        chk.same_bits(recv_x, ref.recv_x, f"{case.name}: recv_x")
    # Invariant 10: cumulative == recv_count == sum of layout counts == global selections.
    sel = torch.zeros(L, dtype=torch.int32)
    for s in range(R):
        if s in masked:
            continue
        for e in range(L):
            sel[e] += int((inputs[s][1] == r * L + e).sum())
    chk.check(torch.equal(cum, recv_count) and torch.equal((layout_range & 0xFFFFFFFF).sum(1).int(), recv_count)
              and torch.equal(recv_count, sel), f"{case.name}: invariant 10 ({cum.tolist()}, {recv_count.tolist()}, "
              f"{sel.tolist()})")
    chk.check(bool((wait >= 0).all()), f"{case.name}: negative wait cost {wait.tolist()}")
    if case.pattern:  # invariant 11
        for e in range(L):
            for s in range(R):
                b, c = int(layout_range[e, s] >> 32), int(layout_range[e, s] & 0xFFFFFFFF)
                rows = recv_x[e, b:b + c].float()
                chk.check(bool((rows[:, :-128] == s - 128).all()), f"invariant 11: rows of source {s} not constant")
                chk.check(torch.equal(rows[:, -128:], src_info[e, b:b + c].float().unsqueeze(1).expand(c, 128)),
                          "invariant 11: last 128 columns != src_info")

    y = expert_outputs(recv_x, r, L, case.fp8)
    w = torch.rand(idx.shape, generator=torch.Generator().manual_seed(seed + 7 * r))

    def combine():
        out = buf.low_latency_combine(y, idx, w, handle, use_logfmt=case.logfmt, async_finish=case.mode == "async",
                                      return_recv_hook=case.mode == "hook")
        _finish(out[1], out[2], case.mode)
        return out[0]

    combined = coll(combine, what=f"{case.name}: combine")

    def expert_row(t, g):
        return ref_expert_row(x[t], g, case.fp8, case.round_scale, case.ue8m0)

    exp = ref_ll_combine((lambda t, g: logfmt_round_trip(expert_row(t, g))) if case.logfmt else expert_row, idx, w,
                         E, R, H, masked=masked)
    chk.same_bits(combined, exp, f"{case.name}: combined_x")
    if case.logfmt and combined.numel():  # against the BF16 combine (the reference without the codec)
        plain = ref_ll_combine(expert_row, idx, w, E, R, H, masked=masked).float()
        mass = ref_ll_combine(lambda t, g: expert_row(t, g).abs(), idx, w.abs(), E, R, H, masked=masked).float()
        err = (combined.float() - plain).abs()
        bound = mass * LOGFMT_MAX_REL + (combined.float().abs() + plain.abs()) * 2.0**-8  # + both bf16 roundings
        diff = calc_diff(combined.float(), plain)
        chk.check(bool((err <= bound).all()) and diff < 1e-5 and bool((err > 0).any()),
                  f"{case.name}: LogFMT vs BF16 combine: max error/bound "
                  f"{float((err / bound.clamp(min=1e-30)).max())}, calc_diff {diff}")
    if case.pattern:  # invariant 12 with identity-like experts: combined ≈ x · Σ_valid w · scale
        scale = torch.tensor([[_scale_of(int(g)) if g >= 0 else 0.0 for g in row] for row in idx])
        approx = x.float() * (w * scale).sum(1, keepdim=True)
        chk.check(calc_diff(combined.float(), approx) < 1e-5 and not combined.isnan().any(),
                  f"invariant 12: calc_diff {calc_diff(combined.float(), approx)}")
    return recv_count


@pytest.mark.parametrize("cfg", _configs())
@pytest.mark.parametrize("case", CASES, ids=str)
def test_low_latency_dispatch_combine_vs_reference(buffers, comm, cfg, case):
    buf = _buf(buffers, cfg)
    chk = Checker(comm.Get_rank())
    run_ll_case(buf, comm, case, seed=CASES.index(case) + 31, chk=chk)
    chk.finish(f"{case.name} on {cfg}")


@pytest.mark.skipif(not native.ll_available(), reason="native kernels not built")
@pytest.mark.parametrize("case", [c for c in CASES if c.name in ("bf16_pattern_invariants", "fp8_f32_scales_async",
                                                                  "fp8_ue8m0_duplicate_experts_hook")], ids=str)
def test_rows_by_streaming_stores_vs_reference(buffers, comm, case):
    """Reference cases with the dispatch's receive and the combine's sends storing their rows by streaming stores
    on every rank (``native.ll_stream_rows("always")`` on both sides; rows of 256 bytes or more stream): the
    reference's bits."""
    mode = "always"
    before = {side: (native.ll_stream_rows(side=side), native.ll_stream_min_bytes(side=side))
              for side in native.LL_STREAM_SIDES}
    for side in native.LL_STREAM_SIDES:
        native.ll_stream_rows(mode, side=side)
    try:
        chk = Checker(comm.Get_rank())
        run_ll_case(_buf(buffers, "ubmem"), comm, case, seed=CASES.index(case) + 31, chk=chk)
        chk.finish(f"{case.name} with ll_stream_rows({mode!r}) on both sides")
    finally:
        for side, (m, b) in before.items():
            native.ll_stream_rows(m, b, side=side)


@pytest.mark.parametrize("m,tokens", [(1024, 600), (2304, 2304)])
def test_batches_past_deepeps_queue_pair_cap(comm, m, tokens):
    """``num_max_dispatch_tokens_per_rank`` above DeepEP's 511 (its NVSHMEM queue-pair cap, meaningless over MPI
    windows; users ask for 1024-2304): a buffer sized by the hint for ``M`` moves full batches bit for bit."""
    R = comm.Get_size()
    if R > 4 and m > 1024:
        pytest.skip("2304 at 1, 2 and 4 ranks (suite time)")
    case = Case(f"m{m}", tokens=tokens, m=m, hidden=128, epr=2, topk=2, mode="async")
    hint = Buffer.get_low_latency_rdma_size_hint(m, 128, R, 2 * R)
    buf = coll(lambda: Buffer(None, 0, hint, comm=comm, low_latency_mode=True, explicitly_destroy=True))
    try:
        chk = Checker(comm.Get_rank())
        run_ll_case(buf, comm, case, seed=m, chk=chk)
        chk.finish(case.name)
    finally:
        coll(buf.destroy, what="destroy")


# ----------------------------------------------------------------------------------------------
# many calls, both halves, nothing cleaned


def test_many_calls_changing_shapes_without_cleaning(buffers, comm):
    """300 consecutive LL calls (150 dispatch + combine pairs; 80 calls at 4-8 ranks, for the time
    budget) alternating the two halves, with
    hidden, token count, top-k and BF16/FP8 changing every call, on the two-node Buffer (one node
    at R=1); invariant 13: per-expert sums of the received rows match the senders' (order-free)."""
    buf = _buf(buffers, "nodes" if comm.Get_size() >= 2 else "ubmem")
    r, R = comm.Get_rank(), comm.Get_size()
    chk = Checker(r)
    shapes = [(128, 5, 2, True), (256, 16, 3, False), (200, 1, 1, False), (512, 32, 4, True), (384, 0, 2, False)]
    L = 2
    E = L * R
    iters = 150 if R <= 2 else 40
    for it in range(iters):
        H, n, k, fp8 = shapes[it % len(shapes)]
        fp8 = fp8 and H % 128 == 0
        n = (n + it) % (MAX_M + 1) if it % 7 == 3 else n
        xs = [make_inputs(5000 + it, s, R, n, H, E, k) for s in range(R)]
        x, idx = xs[r]
        recv_x, cnt, handle, _, _ = buf.low_latency_dispatch(x, idx, MAX_M, E, use_fp8=fp8)
        data = recv_x[0] if fp8 else recv_x
        exp_cnt = torch.tensor([sum(int((xs[s][1] == r * L + e).sum()) for s in range(R)) for e in range(L)],
                               dtype=torch.int32)
        chk.check(torch.equal(cnt, exp_cnt), f"iter {it}: counts {cnt.tolist()} != {exp_cnt.tolist()}")
        if not fp8:  # invariant 13: order-insensitive per-expert sums equal the senders'
            for e in range(L):
                got = data[e, :int(cnt[e])].double().sum(0)
                want = sum((xs[s][0][(xs[s][1] == r * L + e).any(1)].double().sum(0) for s in range(R)),
                           torch.zeros(H, dtype=torch.float64))
                chk.check(torch.allclose(got, want), f"iter {it}: expert {e} sum differs")
        y = (torch.stack([per_token_cast_back(recv_x[0][e], recv_x[1][e]) for e in range(L)]) if fp8 else data)
        w = torch.rand(idx.shape)
        combined, _, _ = buf.low_latency_combine(y.contiguous(), idx, w, handle)
        if not fp8:
            acc = torch.zeros(n, H)
            for j in range(k):
                acc += x.float() * torch.where(idx[:, j:j + 1] >= 0, w[:, j:j + 1], 0.0)
            chk.same_bits(combined, acc.to(BF16), f"iter {it}: combined")
        if len(chk.errors) > 5:
            break
    chk.finish(f"{iters} LL round trips")


# ----------------------------------------------------------------------------------------------
# hooks, async, zero-copy, out=, stats


@pytest.mark.mpi(min_size=2)
def test_hook_returns_before_peers_send_and_overlaps_compute(buffers, comm):
    """Rank 0 issues a hooked dispatch and only then lets the others start theirs (an MPI message):
    had the call waited for its receive, this would deadlock. Rank 0 computes, then the hook
    completes the receive; results equal the reference. Then the double-buffer rule: a second LL
    call while a hook is pending and a second hook call are refused clearly."""
    buf = _buf(buffers, "nodes")
    r, R = comm.Get_rank(), comm.Get_size()
    E, M, H, K = 2 * R, 16, 256, 2
    xs = [make_inputs(77, s, R, 12, H, E, K) for s in range(R)]
    x, idx = xs[r]
    errors = []
    if r != 0:
        comm.recv(source=0, tag=41)
    recv_x, cnt, handle, ev, hook = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False, return_recv_hook=True)
    if r == 0:
        for p in range(1, R):
            comm.send(b"go", dest=p, tag=41)
    a = torch.randn(96, 96)
    for _ in range(5):  # the overlapped compute
        a = torch.tanh(a @ a)
    _, exc = capture(lambda: buf.low_latency_dispatch(x, idx, M, E, use_fp8=False))
    if not (isinstance(exc, RuntimeError) and "hook" in str(exc)):
        errors.append(f"LL call with a pending hook: {exc!r}")
    _, exc = capture(hook)
    if exc is not None:
        errors.append(f"hook: {exc!r}")
    _, exc = capture(hook)
    if not (isinstance(exc, RuntimeError) and "already" in str(exc)):
        errors.append(f"second hook call: {exc!r}")
    ref = ref_ll_dispatch([i[0] for i in xs], [i[1] for i in xs], r, E, M)
    if not torch.equal(bits(recv_x), bits(ref.recv_x)) or not torch.equal(cnt, ref.recv_count):
        errors.append("hooked dispatch differs from the reference")
    w = torch.rand(idx.shape)
    combined, _, hook = buf.low_latency_combine(recv_x, idx, w, handle, return_recv_hook=True)
    a = torch.tanh(a @ a)
    hook()
    exp = ref_ll_combine(lambda t, g: x[t], idx, w, E, R, H)
    if not torch.equal(bits(combined), bits(exp)):
        errors.append("hooked combine differs from the reference")
    all_ranks_ok(comm, not errors, f"hooks: {errors}")


@pytest.mark.mpi(min_size=2)
def test_a_peer_late_past_the_short_wait_is_waited_for_the_long_way(buffers, comm):
    """With signals by stores, the receive first polls a short while (``native.ll_await``); a peer later than that
    (rank 1 sleeps 50 ms before each call) is waited for through ``wait_until`` and the results are the
    reference's, in both a dispatch and a combine."""
    buf = _buf(buffers, "ubmem")
    eng = buf._ll
    if eng._store_signals is None:
        pytest.skip("needs signals by stores (native kernels, one node)")
    r, R = comm.Get_rank(), comm.Get_size()
    E, M, H, K = 2 * R, 16, 256, 2
    xs = [make_inputs(83, s, R, 12, H, E, K) for s in range(R)]
    x, idx = xs[r]
    w = torch.rand(idx.shape, generator=torch.Generator().manual_seed(r))
    long_waits = []
    real = eng._wait_sources
    eng._wait_sources = lambda *a, **k: (long_waits.append(a[2]), real(*a, **k))[1]
    try:
        if r == 1:
            time.sleep(0.05)
        recv_x, cnt, handle, _, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
        if r == 1:
            time.sleep(0.05)
        combined, _, _ = buf.low_latency_combine(recv_x, idx, w, handle)
    finally:
        eng.__dict__.pop("_wait_sources", None)
    ref = ref_ll_dispatch([i[0] for i in xs], [i[1] for i in xs], r, E, M)
    exp = ref_ll_combine(lambda t, g: x[t], idx, w, E, R, H)
    ok = (torch.equal(bits(recv_x), bits(ref.recv_x)) and torch.equal(cnt, ref.recv_count)
          and torch.equal(bits(combined), bits(exp)))
    # the ranks that waited for rank 1 took the long way twice (rank 1 itself may not have waited at all)
    waited = r == 1 or len(long_waits) == 2
    all_ranks_ok(comm, ok and waited, f"rank {r}: results ok {ok}; long waits {long_waits}")


@pytest.mark.mpi(min_size=2)
def test_rows_torn_by_a_third_call_in_flight_are_refused(comm):
    """On one node a receiver loads its rows from the sources' send regions. Rank 0 breaks the two-calls rule
    (white-box: it drops its pending-hook guard) and issues calls #2 and #3 while the others load call #1's rows
    from it; #3 rewrites the half #1 used. The others' hooks then refuse the rows (the seqlock), naming rank 0
    and both calls, instead of returning torn rows; rank 0's own receive of #1, done before, is exact."""
    r, R = comm.Get_rank(), comm.Get_size()
    E, M, H = 2 * R, 8, 128
    buf = Buffer(None, 0, Buffer.get_low_latency_rdma_size_hint(M, H, R, E), low_latency_mode=True, comm=comm,
                 explicitly_destroy=True)
    x, idx = make_inputs(61, r, R, 6, H, E, 2)
    ref = ref_ll_dispatch(gather_all(x), gather_all(idx), r, E, M)
    eng = buf._ll
    eng._fusable = False  # the step-by-step path, whose wait and loads are two steps (the fused ones: test_ll_fused)
    native_path = eng.native_path()
    if r != 0 and native_path:  # load only once rank 0 restamped (after this rank's header check)
        await_dispatch = eng._await_dispatch

        def await_then_let_rank0_run(*args):
            out = await_dispatch(*args)
            comm.Barrier()
            comm.Barrier()
            return out
        eng._await_dispatch = await_then_let_rank0_run
    recv_x, _, _, _, hook = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False, return_recv_hook=True)
    _, exc = capture(hook)
    if r == 0:
        ok, what = exc is None and torch.equal(bits(recv_x), bits(ref.recv_x)), f"rank 0's own receive: {exc!r}"
        if native_path:
            comm.Barrier()
            for _ in range(2):
                buf.low_latency_dispatch(x, idx, M, E, use_fp8=False, return_recv_hook=True)
                eng.pending_hook = None  # the violation under test
            comm.Barrier()
    else:
        ok = not native_path or (isinstance(exc, RuntimeError) and "source rank 0 began rewriting its send region for "
                                 "LL call #3 while this rank loaded call #1" in str(exc))
        what = f"receive of call #1: {exc!r}"
    eng.pending_hook = None
    _, dexc = capture(buf.destroy)
    all_ranks_ok(comm, ok and dexc is None, f"{what}; destroy {dexc!r}")


@pytest.mark.mpi(min_size=2)
def test_zero_copy_buffer_before_the_hook_waits_for_the_peers_loads(buffers, comm):
    """The zero-copy buffer handed out while call #k's hook is pending is the half call #k-1 used, from which
    peers may still load rows: on one node it is returned only once every peer issued call #k (done loading).
    Rank 1 issues #k 0.1 s late; rank 0's buffer must not come back before that."""
    buf = _buf(buffers, "ubmem")
    r, R = comm.Get_rank(), comm.Get_size()
    E, M, H = 2 * R, 8, 128
    x, idx = make_inputs(62, r, R, 4, H, E, 2)
    coll(lambda: buf.low_latency_dispatch(x, idx, M, E, use_fp8=False), what="dispatch #k-1")
    if r == 1:
        time.sleep(0.1)
    issued = time.monotonic()
    _, _, handle, _, hook = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False, return_recv_hook=True)
    buf.get_next_low_latency_combine_buffer(handle)
    returned = time.monotonic()
    late = comm.bcast(issued, root=1)
    hook()
    ok = r != 0 or not buf._ll.native_path() or returned >= late
    all_ranks_ok(comm, ok, f"rank 0's buffer came back at {returned:.4f}, before rank 1 issued the call at {late:.4f}")


@pytest.mark.mpi(min_size=2)
def test_zero_copy_buffer_during_an_async_receive_waits_for_the_peers_reads(comm):
    """As with a pending hook: rank 0, whose call #k+1 is still receiving on the worker (``async_finish``), asks
    for call #k+2's zero-copy buffer (the half of call #k, a zero-copy combine) and fills it, while the other
    ranks call call #k's hook late (reading rank 0's rows in place). The buffer comes back only once they
    issued #k+1, so their sums have the reference's bits and no stamp moves under them."""
    r, R = comm.Get_rank(), comm.Get_size()
    E, M, H, K, n = 2 * R, 16, 256, 3, 12
    buf = Buffer(None, 0, Buffer.get_low_latency_rdma_size_hint(M, H, R, E), low_latency_mode=True, comm=comm,
                 explicitly_destroy=True)
    x, idx = make_inputs(130, r, R, n, H, E, K)
    w = torch.rand(idx.shape, generator=torch.Generator().manual_seed(r))
    exp = ref_ll_combine(lambda t, g: ref_expert_row(x[t], g, False, False, False), idx, w, E, R, H)
    chk = Checker(r)
    recv_x, _, handle, _, _ = coll(lambda: buf.low_latency_dispatch(x, idx, M, E, use_fp8=False), what="dispatch")
    buf.get_next_low_latency_combine_buffer(handle).copy_(expert_outputs(recv_x, r, E // R, False))

    def run():
        combined, _, hook = buf.low_latency_combine(recv_x, idx, w, handle, zero_copy=True, return_recv_hook=r != 0)
        if r == 0:
            _, _, _, event, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False, async_finish=True)
            buf.get_next_low_latency_combine_buffer(handle).fill_(7.0)  # call #k+2's expert outputs
            event.current_stream_wait()
        else:
            time.sleep(0.2)
            hook()
            buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
        return combined

    combined, exc = capture(run)
    if chk.check(exc is None, f"rank {r}: {exc!r}"):
        chk.same_bits(combined, exp, "zero-copy combine read while a peer's async receive was pending")
    _, dexc = capture(buf.destroy)
    chk.check(dexc is None, f"destroy: {dexc!r}")
    chk.finish("zero-copy buffer during an async receive")


def test_zero_copy_combine_mixed_with_pushes_and_hooks(buffers, comm):
    """A zero-copy combine's rows stay in each source's send region, where the receivers read them (native path):
    ranks choosing ``zero_copy`` differently in one call, and in hook mode, give the reference's bits."""
    buf = _buf(buffers, "ubmem")
    r, R = comm.Get_rank(), comm.Get_size()
    E, M, H, K, n = 2 * R, 16, 256, 3, 12
    chk = Checker(r)
    for rnd, (zero_copy, hook) in enumerate([(r % 2 == 0, False), (r % 2 == 1, False), (True, True)]):
        xs = [make_inputs(70 + rnd, s, R, n, H, E, K) for s in range(R)]
        x, idx = xs[r]
        recv_x, _, handle, _, _ = coll(lambda: buf.low_latency_dispatch(x, idx, M, E, use_fp8=False), what="dispatch")
        y = expert_outputs(recv_x, r, E // R, False)
        if zero_copy:
            buf.get_next_low_latency_combine_buffer(handle).copy_(y)
        w = torch.rand(idx.shape, generator=torch.Generator().manual_seed(rnd * 100 + r))
        if hook:
            combined, _, wait = coll(lambda: buf.low_latency_combine(y, idx, w, handle, zero_copy=zero_copy,
                                                                     return_recv_hook=True), what="combine send")
            coll(wait, what="combine hook")
        else:
            combined, _, _ = coll(lambda: buf.low_latency_combine(y, idx, w, handle, zero_copy=zero_copy),
                                  what="combine")
        exp = ref_ll_combine(lambda t, g: ref_expert_row(x[t], g, False, False, False), idx, w, E, R, H)
        chk.same_bits(combined, exp, f"round {rnd}: zero_copy={zero_copy} hook={hook}")
    chk.finish("zero-copy combine read in place")


@pytest.mark.parametrize("m, hidden, min_experts", [(1, 129, 2), (2, 127, 1), (2, 128, 1), (1, 128, 2), (1, 256, 1)])
def test_zero_copy_combine_at_the_smallest_send_regions(comm, m, hidden, min_experts):
    """Zero-copy combines whose send region barely holds the published layout_range after the rows (``M·S = 2``:
    8E bytes, its int64 words at an 8-byte boundary, which odd ``E·M·H`` pushes past the region: (1, 129, E=2)
    and (2, 127, E=1), so those push) or cannot (``M·S < 2``): mixed with pushes and hooks, in both halves, the
    reference's bits."""
    r, R = comm.Get_rank(), comm.Get_size()
    E = -(-min_experts // R) * R
    epr, K, n = E // R, min(2, E), m
    lay = Layout(m, hidden, E, R)
    chk = Checker(r)
    chk.check(not lay.can_pull or (lay.pull_off % 8 == 0 and lay.pull_off + 8 * E <= lay.recv_off),
              f"layout_range at {lay.pull_off} (+{8 * E}) past the send region ending at {lay.recv_off}")
    buf = coll(lambda: Buffer(None, 0, Buffer.get_low_latency_rdma_size_hint(m, hidden, R, E), low_latency_mode=True,
                              comm=comm, explicitly_destroy=True), what="Buffer()")
    try:
        for rnd, (zero_copy, hook) in enumerate([(True, False), (r % 2 == 0, True), (True, True), (r % 2 == 1, False)]):
            x, idx = make_inputs(120 + rnd, r, R, n, hidden, E, K)
            recv_x, _, handle, _, _ = coll(lambda: buf.low_latency_dispatch(x, idx, m, E, use_fp8=False),
                                           what="dispatch")
            y = expert_outputs(recv_x, r, epr, False)
            if zero_copy:
                buf.get_next_low_latency_combine_buffer(handle).copy_(y)
            w = torch.rand(idx.shape, generator=torch.Generator().manual_seed(rnd * 100 + r))
            combined, _, wait = coll(lambda: buf.low_latency_combine(y, idx, w, handle, zero_copy=zero_copy,
                                                                     return_recv_hook=hook), what="combine")
            if hook:
                coll(wait, what="combine hook")
            exp = ref_ll_combine(lambda t, g: ref_expert_row(x[t], g, False, False, False), idx, w, E, R, hidden)
            chk.same_bits(combined, exp, f"M={m} H={hidden} E={E} round {rnd}: zero_copy={zero_copy} hook={hook}")
    finally:
        coll(buf.destroy, what="destroy")
    chk.finish("zero-copy combine, smallest send regions")


@pytest.mark.parametrize("m, hidden, experts_per_rank", [(2, 1, 1), (1, 131, 1), (3, 2, 1), (2, 128, 2)])
def test_odd_sizes_whose_recv_region_is_unaligned_take_the_torch_path(comm, m, hidden, experts_per_rank):
    """Sizes whose recv region starts off a 4-byte boundary (``M·d`` above ``E·M·c``: tiny or odd hidden, few
    experts; the native kernels view it as int32) run on the torch path, dispatch and combine, zero-copy too:
    the reference's bits (before, the native dispatch aborted the job). An odd start, where no BF16 row can
    lie, is refused on every rank before anything moves."""
    r, R = comm.Get_rank(), comm.Get_size()
    E = experts_per_rank * R
    K, n = min(2, E), m
    lay = Layout(m, hidden, E, R)
    if R == 1:
        odd = Layout(3, 3, 1, 1)
        big = Buffer.get_low_latency_rdma_size_hint(3, 3, 1, 1)
        b = Buffer(None, 0, big, low_latency_mode=True, comm=comm, explicitly_destroy=True)
        _, exc = capture(lambda: b.low_latency_dispatch(torch.zeros(3, 3, dtype=BF16),
                                                        torch.zeros(3, 1, dtype=torch.int64), 3, 1, use_fp8=False))
        b.destroy()
        assert odd.recv_off % 2 and isinstance(exc, ValueError) and "odd byte" in str(exc), repr(exc)
    buf = coll(lambda: Buffer(None, 0, Buffer.get_low_latency_rdma_size_hint(m, hidden, R, E), low_latency_mode=True,
                              comm=comm, explicitly_destroy=True), what="Buffer()")
    chk = Checker(r)
    try:
        for rnd, zero_copy in enumerate((False, True)):
            x, _ = make_inputs(140 + rnd, r, R, n, hidden, E, K)
            # every slot routed (make_inputs drops 10 slots to -1: at these sizes, all of them), distinct per row
            idx = (torch.arange(n).unsqueeze(1) + torch.arange(K) + rnd + r) % E
            chk.check(int((idx >= 0).sum()) == n * K, "inputs")
            recv_x, _, handle, _, _ = coll(lambda: buf.low_latency_dispatch(x, idx, m, E, use_fp8=False),
                                           what="dispatch")
            ref = ref_ll_dispatch(gather_all(x), gather_all(idx), r, E, m)
            chk.same_bits(recv_x, ref.recv_x, f"M={m} H={hidden} E={E} (recv at {lay.recv_off}): dispatch")
            y = expert_outputs(recv_x, r, experts_per_rank, False)
            if zero_copy:
                buf.get_next_low_latency_combine_buffer(handle).copy_(y)
            w = torch.rand(idx.shape, generator=torch.Generator().manual_seed(rnd * 100 + r))
            combined, _, _ = coll(lambda: buf.low_latency_combine(y, idx, w, handle, zero_copy=zero_copy),
                                  what="combine")
            exp = ref_ll_combine(lambda t, g: ref_expert_row(x[t], g, False, False, False), idx, w, E, R, hidden)
            chk.same_bits(combined, exp, f"M={m} H={hidden} E={E}: combine zero_copy={zero_copy}")
    finally:
        coll(buf.destroy, what="destroy")
    chk.finish("odd sizes")


def test_zero_copy_combines_changing_shapes_in_one_half(comm):
    """Zero-copy combines of changing ``(M, H)`` (same ``E``), each in the same half: the published layout_range
    moves with the rows' end (``E·M·2H``), and neither its writer nor its readers may use the previous call's
    place (which may now lie inside the rows); mixed with a hook, the reference's bits every time."""
    r, R = comm.Get_rank(), comm.Get_size()
    E, K = 2 * R, 3
    buf = coll(lambda: Buffer(None, 0, Buffer.get_low_latency_rdma_size_hint(32, 512, R, E), low_latency_mode=True,
                              comm=comm, explicitly_destroy=True), what="Buffer()")
    chk = Checker(r)
    try:
        for rnd, (M, H) in enumerate([(8, 256), (16, 256), (8, 512), (32, 128), (8, 256), (16, 384)]):
            x, idx = make_inputs(140 + rnd, r, R, 8, H, E, K)
            recv_x, _, handle, _, _ = coll(lambda: buf.low_latency_dispatch(x, idx, M, E, use_fp8=False),
                                           what="dispatch")
            buf.get_next_low_latency_combine_buffer(handle).copy_(expert_outputs(recv_x, r, E // R, False))
            w = torch.rand(idx.shape, generator=torch.Generator().manual_seed(rnd))
            hook = rnd % 2 == 1 and r == 0
            combined, _, wait = coll(lambda: buf.low_latency_combine(recv_x, idx, w, handle, zero_copy=True,
                                                                     return_recv_hook=hook), what="combine")
            if hook:
                wait()
            exp = ref_ll_combine(lambda t, g: ref_expert_row(x[t], g, False, False, False), idx, w, E, R, H)
            chk.same_bits(combined, exp, f"round {rnd}: M={M} H={H}")
    finally:
        coll(buf.destroy, what="destroy")
    chk.finish("zero-copy combines of changing shapes")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("torn_layout", [False, True])
def test_zero_copy_combine_refuses_a_rewritten_source(comm, torn_layout):
    """A receiver that finds a zero-copy source's stamp moved after reading its rows (the source began rewriting its
    send region: a third LL call in flight) raises instead of returning the sum, naming the source and both calls,
    also when the rewrite already reached the published layout_range (whose begins then fail the kernel's checks).
    White-box: rank 1 restamps its half (and with ``torn_layout`` overwrites its layout_range) just before it
    signals, as such a source would."""
    r, R = comm.Get_rank(), comm.Get_size()
    E, M, H, K, n = 2 * R, 16, 256, 3, 12
    buf = Buffer(None, 0, Buffer.get_low_latency_rdma_size_hint(M, H, R, E), low_latency_mode=True, comm=comm,
                 explicitly_destroy=True)
    eng = buf._ll
    eng._fusable = False  # the step-by-step path, which signals in _publish (the fused one: test_ll_fused)
    native_path = eng.native_path()
    x, idx = make_inputs(81, r, R, n, H, E, K)
    recv_x, _, handle, _, _ = coll(lambda: buf.low_latency_dispatch(x, idx, M, E, use_fp8=False), what="dispatch")
    buf.get_next_low_latency_combine_buffer(handle).copy_(expert_outputs(recv_x, r, E // R, False))
    if r == 1:
        real = eng._publish
        lay = Layout(M, H, E, R)

        def rewrite(h, seq):
            eng._stamp(h, seq + 7)
            if torn_layout:  # call #8's bytes: begins far past the rows
                eng.tp.local_view(eng.win, h * eng.half + lay.pull_off, 8 * E, torch.int64).fill_(1 << 40)

        eng._publish = lambda h, hdr, seq, dsts: (rewrite(h, seq), real(h, hdr, seq, dsts))
    _, exc = capture(lambda: buf.low_latency_combine(recv_x, idx, torch.ones(idx.shape), handle, zero_copy=True))
    eng.__dict__.pop("_publish", None)
    ok = r == 1 or not native_path or (isinstance(exc, RuntimeError) and "source rank 1 began rewriting its send "
                                       "region for LL call #8 while this rank read call #2's rows" in str(exc))
    _, dexc = capture(buf.destroy)
    all_ranks_ok(comm, ok and dexc is None, f"rank {r}: {exc!r}; destroy {dexc!r}")


@pytest.mark.mpi(min_size=2)
def test_zero_copy_sources_refused_by_a_torch_path_receiver(buffers, comm):
    """A rank receiving on the torch path (here: told its native path is off) cannot read rows left in place: it
    refuses the zero-copy sources by name, while the others (reading rank 1's pushed rows) get the reference's
    bits; the buffer stays usable."""
    buf = _buf(buffers, "ubmem")
    r, R = comm.Get_rank(), comm.Get_size()
    eng = buf._ll
    if not eng.native_path():
        pytest.skip("needs the native path")
    E, M, H, K, n = 2 * R, 16, 256, 3, 12
    x, idx = make_inputs(82, r, R, n, H, E, K)
    w = torch.rand(idx.shape, generator=torch.Generator().manual_seed(r))
    chk = Checker(r)
    recv_x, _, handle, _, _ = coll(lambda: buf.low_latency_dispatch(x, idx, M, E, use_fp8=False), what="dispatch")
    buf.get_next_low_latency_combine_buffer(handle).copy_(expert_outputs(recv_x, r, E // R, False))
    if r == 1:
        eng.native_path = lambda: False
    got, exc = capture(lambda: buf.low_latency_combine(recv_x, idx, w, handle, zero_copy=True))
    eng.__dict__.pop("native_path", None)
    if r == 1:
        chk.check(exc is not None and "torch path" in str(exc) and "zero-copy" in str(exc), f"rank 1: {exc!r}")
    else:
        chk.check(exc is None, f"rank {r}: {exc!r}")
        if exc is None:
            exp = ref_ll_combine(lambda t, g: ref_expert_row(x[t], g, False, False, False), idx, w, E, R, H)
            chk.same_bits(got[0], exp, "rank 1 pushed, the others left their rows in place")
    recv_x, _, handle, _, _ = coll(lambda: buf.low_latency_dispatch(x, idx, M, E, use_fp8=False), what="dispatch")
    y = expert_outputs(recv_x, r, E // R, False)
    combined, _, _ = coll(lambda: buf.low_latency_combine(y, idx, w, handle), what="combine after the refusal")
    exp = ref_ll_combine(lambda t, g: ref_expert_row(x[t], g, False, False, False), idx, w, E, R, H)
    chk.same_bits(combined, exp, "combine after the refusal")
    chk.finish("torch-path receiver")


def test_zero_copy_and_out_in_both_halves(buffers, comm):
    """``get_next_low_latency_combine_buffer`` + ``zero_copy`` and ``out=``, with the combine landing
    once in each half; a buffer handed out before another LL call is refused."""
    buf = _buf(buffers, "ubmem")
    r, R = comm.Get_rank(), comm.Get_size()
    E, M, H, K = 2 * R, 16, 256, 3
    chk = Checker(r)
    for rnd in range(2):
        xs = [make_inputs(90 + rnd, s, R, 10, H, E, K) for s in range(R)]
        x, idx = xs[r]
        if rnd == 1:  # shift the parity: the next combine uses the other half
            coll(lambda: buf.low_latency_dispatch(x, idx, M, E, use_fp8=False), what="parity shift")
        recv_x, _, handle, _, _ = coll(lambda: buf.low_latency_dispatch(x, idx, M, E, use_fp8=False), what="dispatch")
        zc = buf.get_next_low_latency_combine_buffer(handle)
        chk.check(tuple(zc.shape) == (E // R, R * M, H) and zc.dtype == BF16, f"zero-copy view {zc.shape} {zc.dtype}")
        zc.copy_(expert_outputs(recv_x, r, E // R, False))
        del zc
        w = torch.rand(idx.shape)
        out = torch.empty(10, H, dtype=BF16)
        dummy = torch.zeros(E // R, R * M, H, dtype=BF16)
        combined, _, _ = coll(lambda: buf.low_latency_combine(dummy, idx, w, handle, zero_copy=True, out=out),
                              what="zero-copy combine")
        chk.check(combined.data_ptr() == out.data_ptr(), "out= was not returned")
        exp = ref_ll_combine(lambda t, g: ref_expert_row(x[t], g, False, False, False), idx, w, E, R, H)
        chk.same_bits(out, exp, f"round {rnd}: zero-copy combine into out=")
    # A stale buffer: handed out, then another LL call, then the zero-copy combine -> refused on every rank.
    recv_x, _, handle, _, _ = coll(lambda: buf.low_latency_dispatch(x, idx, M, E, use_fp8=False), what="dispatch")
    zc = buf.get_next_low_latency_combine_buffer(handle)
    del zc
    coll(lambda: buf.low_latency_dispatch(x, idx, M, E, use_fp8=False), what="intervening dispatch")
    _, exc = capture(lambda: buf.low_latency_combine(recv_x, idx, torch.rand(idx.shape), handle, zero_copy=True))
    chk.check(isinstance(exc, RuntimeError) and "get_next_low_latency_combine_buffer" in str(exc),
              f"stale zero-copy buffer: {exc!r}")
    combined, _, _ = coll(lambda: buf.low_latency_combine(recv_x, idx, torch.ones(idx.shape), handle),
                          what="combine after the refusal")
    # No buffer handed out for this call at all: refused too, on every rank (only rank 0 asks for zero_copy).
    recv_x, _, handle, _, _ = coll(lambda: buf.low_latency_dispatch(x, idx, M, E, use_fp8=False), what="dispatch")
    _, exc = capture(lambda: buf.low_latency_combine(recv_x, idx, torch.rand(idx.shape), handle, zero_copy=r == 0))
    want = RuntimeError if r == 0 else ConsensusError
    chk.check(isinstance(exc, want) and (r != 0 or "no buffer was handed out" in str(exc)),
              f"zero-copy without a buffer: {exc!r}")
    combined, _, _ = coll(lambda: buf.low_latency_combine(recv_x, idx, torch.ones(idx.shape), handle),
                          what="combine after the refusal")
    # A buffer laid out for another handle's (M, H, E): its rows lie elsewhere; refused on every rank.
    recv_a, _, handle_a, _, _ = coll(lambda: buf.low_latency_dispatch(x, idx, M, E, use_fp8=False), what="dispatch")
    recv_b, _, handle_b, _, _ = coll(lambda: buf.low_latency_dispatch(x, idx, 2 * M, E, use_fp8=False),
                                     what="dispatch of another M")
    buf.get_next_low_latency_combine_buffer(handle_a).copy_(expert_outputs(recv_a, r, E // R, False))
    _, exc = capture(lambda: buf.low_latency_combine(recv_b, idx, torch.rand(idx.shape), handle_b, zero_copy=True))
    chk.check(isinstance(exc, RuntimeError) and f"(M, H, E) = {(M, H, E)}" in str(exc)
              and f"{(2 * M, H, E)}" in str(exc), f"zero-copy buffer of another shape: {exc!r}")
    combined, _, _ = coll(lambda: buf.low_latency_combine(recv_b, idx, torch.ones(idx.shape), handle_b),
                          what="combine after the refusal")
    chk.finish("zero-copy / out=")


@pytest.mark.parametrize("cfg", _configs())
def test_combine_with_another_topk_idx_refused_everywhere(buffers, comm, cfg):
    """A combine whose ``topk_idx`` is not its dispatch's (rank 0 passes its first tokens only, as DeepEP forbids:
    num_combined_tokens equals the dispatched count; or its rows in another order) is refused before any row
    moves, on every rank: rank 0 raises ``ValueError``, the others ``ConsensusError``; the Buffer stays usable.
    A copy of the dispatch's own ``topk_idx`` (not the same tensor, so checked again) combines as the reference,
    also through a handle two dispatches old."""
    buf = _buf(buffers, cfg)
    r, R = comm.Get_rank(), comm.Get_size()
    E, M, H, K = 2 * R, 16, 256, 3
    chk = Checker(r)
    x, idx = make_inputs(95, r, R, 10, H, E, K)
    w = torch.rand(idx.shape, generator=torch.Generator().manual_seed(r))
    recv_x, _, handle, _, _ = coll(lambda: buf.low_latency_dispatch(x, idx, M, E, use_fp8=False), what="dispatch")
    n = 4 if r == 0 else 10
    _, exc = capture(lambda: buf.low_latency_combine(recv_x, idx[:n], w[:n], handle))
    want = ValueError if r == 0 else ConsensusError
    chk.check(isinstance(exc, want) and "dispatch that made `handle`" in str(exc), f"shorter topk_idx: {exc!r}")
    # The same selections per expert, other tokens: rows in another order on rank 0 (refused too).
    perm = idx[torch.arange(10).roll(1)].contiguous() if r == 0 else idx.clone()
    _, exc = capture(lambda: buf.low_latency_combine(recv_x, perm, w, handle))
    chk.check(isinstance(exc, want) and "dispatch that made `handle`" in str(exc), f"permuted topk_idx: {exc!r}")
    x2, idx2 = make_inputs(96, r, R, 10, H, E, K)
    recv_x2, _, handle2, _, _ = coll(lambda: buf.low_latency_dispatch(x2, idx2, M, E, use_fp8=False),
                                     what="second dispatch")
    exp = ref_ll_combine(lambda t, g: ref_expert_row(x[t], g, False, False, False), idx, w, E, R, H)
    got, _, _ = coll(lambda: buf.low_latency_combine(expert_outputs(recv_x, r, E // R, False), idx.clone(), w, handle),
                     what="combine of the older handle with a copy of its topk_idx")
    chk.same_bits(got, exp, "combine through the older handle")
    del recv_x2, handle2
    # Each rank consistent with itself, the ranks not with each other: rank 0 combines dispatch C's handle, the
    # others D's (D is C with every rank's tokens rotated: the same rows per source and expert). Refused on
    # every rank by the combine's header, which names the dispatch of each rank's handle.
    rot = torch.arange(10).roll(1)
    xc, idxc, wc = x, idx, w
    xd, idxd, wd = x[rot].contiguous(), idx[rot].contiguous(), w[rot].contiguous()
    rc, _, hc, _, _ = coll(lambda: buf.low_latency_dispatch(xc, idxc, M, E, use_fp8=False), what="dispatch C")
    rd, _, hd, _, _ = coll(lambda: buf.low_latency_dispatch(xd, idxd, M, E, use_fp8=False), what="dispatch D")
    mine = (rc, idxc, wc, hc) if r == 0 else (rd, idxd, wd, hd)
    _, exc = capture(lambda: buf.low_latency_combine(*mine))
    chk.check(R == 1 or (isinstance(exc, ConsensusError) and "handles of different dispatches" in str(exc)),
              f"handles of different dispatches: {exc!r}")
    got, _, _ = coll(lambda: buf.low_latency_combine(expert_outputs(rd, r, E // R, False), idxd, wd, hd),
                     what="combine after the refusal")
    chk.same_bits(got, ref_ll_combine(lambda t, g: ref_expert_row(xd[t], g, False, False, False), idxd, wd, E, R, H),
                  "combine after the refusal")
    chk.finish("another topk_idx")


def test_a_remembered_dispatch_whose_key_comes_back_is_the_newest(buffers):
    """The engine remembers its last dispatches by the ``id`` of their handle's ``src_info``; an id can come back
    (its tensor freed, a new one at the same address) while the old entry is still listed. The entry must then
    count as the newest: kept in the old one's place it would be evicted first, and a combine of that live
    handle would go unchecked (neither its ``topk_idx`` nor the ranks' agreement on its dispatch)."""
    from types import SimpleNamespace

    engine = _buf(buffers, "ubmem")._ll
    saved = engine._dispatched_idx.copy()  # the module's Buffer: its real entries back afterwards
    engine._dispatched_idx.clear()
    idx = torch.zeros(1, 1, dtype=torch.int64)

    def remember(src_info):
        engine._remember(SimpleNamespace(outputs=(None, None, SimpleNamespace(src_info=src_info))), idx)

    try:
        first = torch.zeros(1)
        others = [torch.zeros(1) for _ in range(engine._KEPT)]
        remember(first)
        for t in others[:-1]:
            remember(t)
        remember(first)  # its key again, as an id reused by a later dispatch
        remember(others[-1])  # one entry too many: the oldest goes
        assert engine.dispatched_topk_idx((first,)) is not None
        assert engine.dispatched_topk_idx((others[0],)) is None
        assert len(engine._dispatched_idx) == engine._KEPT
    finally:
        engine._dispatched_idx.clear()
        engine._dispatched_idx.update(saved)


def test_stats_accumulate(buffers, comm):
    """cumulative_local_expert_recv_stats adds recv_count per call; the wait-cost stats (ns) are
    non-negative and grow only for live sources."""
    buf = _buf(buffers, "ubmem")
    r, R = comm.Get_rank(), comm.Get_size()
    E, M, H = 2 * R, 16, 128
    x, idx = make_inputs(3, r, R, 8, H, E, 2)
    cum = torch.zeros(2, dtype=torch.int32)
    dw = torch.zeros(R, dtype=torch.int64)
    cw = torch.zeros(R, dtype=torch.int64)
    cnts = []
    for _ in range(2):
        recv_x, cnt, handle, _, _ = coll(lambda: buf.low_latency_dispatch(
            x, idx, M, E, cumulative_local_expert_recv_stats=cum, dispatch_wait_recv_cost_stats=dw, use_fp8=False),
            what="dispatch")
        cnts.append(cnt)
        coll(lambda: buf.low_latency_combine(recv_x, idx, torch.ones(idx.shape), handle,
                                             combine_wait_recv_cost_stats=cw), what="combine")
    ok = torch.equal(cum, cnts[0] + cnts[1]) and bool((dw >= 0).all()) and bool((cw >= 0).all()) \
        and int(dw.sum()) > 0 and int(cw.sum()) > 0
    all_ranks_ok(comm, ok, f"stats: cum {cum.tolist()} vs {[c.tolist() for c in cnts]}, wait ns {dw.tolist()} "
                           f"{cw.tolist()}")


@pytest.mark.parametrize("cfg", ["ubmem", "put"])
def test_channel_kind_follows_allow_nvlink(buffers, comm, cfg):
    """On one node, ``allow_nvlink_for_low_latency_mode=True`` moves peers' rows as UBMEM stores;
    ``False`` sends them over URMA (the windows are ``force_urma``), as DeepEP's LL mode without
    NVLink uses RDMA inside a node. Rows a rank keeps for itself are SELF either way. The
    last-call counters (``get_traffic()``) equal the lifetime delta, the hook's part included."""
    buf = _buf(buffers, cfg)
    r, R = comm.Get_rank(), comm.Get_size()
    E, M, H = 2 * R, 16, 128
    x, idx = make_inputs(5, r, R, 8, H, E, 2)

    def delta(before):
        after = buf.get_traffic(lifetime=True)
        return {k: after[k] - before[k] for k in after}

    def go():
        t0 = buf.get_traffic(lifetime=True)
        recv_x, _, handle, _, hook = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False, return_recv_hook=True)
        hook()
        t_disp, last_disp = delta(t0), buf.get_traffic()
        t1 = buf.get_traffic(lifetime=True)
        buf.low_latency_combine(recv_x, idx, torch.ones(idx.shape), handle)
        return t_disp, delta(t1), last_disp, buf.get_traffic()

    t_disp, t_comb, last_disp, last_comb = coll(go, what=f"{cfg} round trip")
    peer_kind, other = ("UBMEM", "URMA") if cfg == "ubmem" else ("URMA", "UBMEM")
    to_peers = bool(((idx >= 0) & (idx // 2 != r)).any())
    ok = all(t[other] == 0 for t in (t_disp, t_comb)) and (R == 1 or not to_peers or t_disp[peer_kind] > 0)
    # get_traffic() of an LL call (hook mode included) is what the call moved, send to receive.
    ok = ok and last_disp == t_disp and last_comb == t_comb
    all_ranks_ok(comm, ok, f"{cfg}: dispatch traffic {t_disp}, combine traffic {t_comb}: peers' rows must be "
                           f"{peer_kind}, none {other}")


@pytest.mark.parametrize("cfg", _configs())
def test_logfmt_combine_traffic_is_the_spec_formula(buffers, comm, cfg):
    """docs/semantics/deepep-api.md §11: a combine returns ``2H`` bytes per valid selection as BF16 and ``1.25H + H/32``
    with LogFMT when every group is LogFMT (``|x| < 1``, distinct magnitudes); a group that
    falls back to BF16 adds 96 bytes (``logfmt10_wire_bytes``). Both calls also put ``4L``
    count bytes and a 24-byte header to every peer (self included). Counted by
    ``get_traffic()`` over every channel kind, the rank's own rows included: the combines use the
    receive hook, whose send copies them too (a synchronous combine on one node sums them in place,
    docs/semantics/deepep-api.md §6.3)."""
    buf = _buf(buffers, cfg)
    r, R = comm.Get_rank(), comm.Get_size()
    E, L, M, H, K = 2 * R, 2, 16, 512, 3
    ins = [make_inputs(8, s, R, 10, H, E, K, logfmt=True) for s in range(R)]
    x, idx = ins[r]
    rows = sum(int((i[1] // L == r).sum()) for i in ins)  # selections of this rank's experts: the rows it returns
    tiny = (make_inputs(8, r, R, 10, H, E, K)[0].float() / 64).to(BF16)  # 0 < |x| < 1: every group LogFMT

    def go():
        out = []
        for data in (tiny, x):
            recv_x, cnt, handle, _, _ = buf.low_latency_dispatch(data, idx, M, E, use_fp8=False)
            for logfmt in ((False, True) if data is tiny else (True,)):
                _, _, hook = buf.low_latency_combine(recv_x, idx, torch.ones(idx.shape), handle, use_logfmt=logfmt,
                                                     return_recv_hook=True)
                hook()
                out.append(sum(buf.get_traffic().values()))
            sent = torch.cat([recv_x[e, :int(cnt[e])] for e in range(L)])
        return out, int(logfmt10_wire_bytes(logfmt10_encode(sent)[1]).sum())

    (bf16, lf, lf_mixed), mixed_bytes = coll(go, what=f"{cfg} LogFMT traffic")
    fixed = R * (4 * L + 24)  # the header: call and operation, the shape, the sender's count of that operation
    want = (rows * 2 * H + fixed, rows * (H * 5 // 4 + H // 32) + fixed, mixed_bytes + fixed)
    all_ranks_ok(comm, (bf16, lf, lf_mixed) == want and mixed_bytes > rows * (H * 5 // 4 + H // 32),
                 f"{cfg}: combine bytes (BF16, LogFMT, LogFMT with BF16 groups) {(bf16, lf, lf_mixed)} != {want} "
                 f"for {rows} rows of H={H}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("cfg", [c for c in _configs() if c.values[0] != "ubmem"])
@pytest.mark.parametrize("use_fp8", [False, True], ids=["bf16", "fp8"])
def test_pushed_dispatch_sends_each_token_once_per_rank(buffers, comm, cfg, use_fp8):
    """Where rows are pushed (peers over URMA: several ranks, without ``allow_nvlink`` or on several nodes; one
    rank alone loads its rows, the native path), a dispatch writes each token once per destination
    rank however many of its experts live there, plus one int32 index per (token, expert) pair, ``4L`` count
    bytes and the 24-byte header (docs/design/data-path.md, "Low-latency mode"). ``dup`` routing lists an expert
    twice in some tokens: two pairs, one message. The outputs are checked against the reference elsewhere; here
    the bytes of ``get_traffic()``."""
    buf = _buf(buffers, cfg)
    r, R = comm.Get_rank(), comm.Get_size()
    E, L, M, H, K = 4 * R, 4, 16, 256, 4
    x, idx = make_inputs(9, r, R, 12, H, E, K, routing="dup")
    mb = 16 + (H + 4 * (H // 128) if use_fp8 else 2 * H)
    dst = torch.where(idx >= 0, idx // L, -1)
    messages = sum(int((dst == d).any(1).sum()) for d in range(R))
    pairs = int((idx >= 0).sum())
    want = messages * mb + 4 * pairs + R * (4 * L + 24)

    def go():
        _, _, _, _, hook = buf.low_latency_dispatch(x, idx, M, E, use_fp8=use_fp8, return_recv_hook=True)
        hook()
        return sum(buf.get_traffic().values())

    got = coll(go, what=f"{cfg} dispatch traffic")
    all_ranks_ok(comm, got == want and (R == 1 or messages < pairs),
                 f"{cfg}: dispatch bytes {got} != {want} ({messages} messages of {mb} B, {pairs} pairs)")


class _FlushSpy:
    """An MPI window counting its completion calls (``Flush``, ``Flush_all``, ``Flush_local``) into ``counts``."""

    def __init__(self, real, counts):
        self._real, self._counts = real, counts

    def __getattr__(self, name):
        value = getattr(self._real, name)
        if not name.startswith("Flush"):
            return value

        def call(*args):
            self._counts[name] += 1
            return value(*args)
        return call


@pytest.mark.mpi(min_size=2)
def test_pushed_calls_wait_on_mpi_three_times_whatever_the_destinations(comm):
    """docs/design/data-path.md, "Ordering": over URMA (one rank per simulated node) a dispatch and a combine each
    complete their puts and signals with three ``Flush_all`` (the flush, then the two of
    ``put_with_signal_many``) and no per-destination ``Flush`` or ``Flush_local``, at any number of ranks."""
    r, R = comm.Get_rank(), comm.Get_size()
    E, M, H, K = 4 * R, 16, 256, 4
    b = Buffer(None, 0, Buffer.get_low_latency_rdma_size_hint(M, H, R, E), low_latency_mode=True, comm=comm,
               explicitly_destroy=True, ranks_per_node=1)
    counts = collections.Counter()
    rmas = [w._rma for w in b.runtime._windows if w._rma is not None]
    for rma in rmas:
        rma.win = _FlushSpy(rma.win, counts)
    x, idx = make_inputs(7, r, R, 12, H, E, K)
    seen = []
    try:
        for _ in range(2):
            counts.clear()
            recv_x, _, handle, _, _ = coll(lambda: b.low_latency_dispatch(x, idx, M, E, use_fp8=False),
                                           what="dispatch")
            seen.append(dict(counts))
            counts.clear()
            coll(lambda: b.low_latency_combine(recv_x, idx, torch.ones(idx.shape), handle), what="combine")
            seen.append(dict(counts))
    finally:
        for rma in rmas:
            rma.win = rma.win._real
        coll(b.destroy, what="destroy")
    all_ranks_ok(comm, all(c == {"Flush_all": 3} for c in seen), f"MPI completion calls per call: {seen}")


@pytest.mark.mpi(min_size=2)
def test_pushed_dispatches_of_one_message_size_in_other_layouts(comm):
    """A BF16 dispatch of hidden 4224 and an FP8 one of hidden 8192 have messages of one size (8464 bytes) but
    their *recv* regions start at other offsets: each matches the reference when it follows the other in the
    same window half (calls alternate halves; the receive's views of the pushed regions follow the layout, not
    only the message size). Peers over URMA (``allow_nvlink_for_low_latency_mode=False``): the pushed path."""
    r, R = comm.Get_rank(), comm.Get_size()
    M, E, K = 16, 2 * R, 2  # 16 tokens x 2 slots: make_inputs drops 10 of the 32 selections
    shapes = [(4224, False), (8192, True)]
    assert 16 + 2 * 4224 == 16 + 8192 + 4 * (8192 // 128)
    nbytes = max(Buffer.get_low_latency_rdma_size_hint(M, h, R, E) for h, _ in shapes)
    b = Buffer(None, 0, nbytes, low_latency_mode=True, comm=comm, explicitly_destroy=True,
               allow_nvlink_for_low_latency_mode=False)
    problems = []
    try:
        for i, (H, fp8) in enumerate([shapes[0], shapes[0], shapes[1], shapes[1], shapes[0]]):
            ins = [make_inputs(40 + i, s, R, M, H, E, K) for s in range(R)]
            ref = ref_ll_dispatch([x for x, _ in ins], [t for _, t in ins], r, E, M, use_fp8=fp8)
            out = coll(lambda: b.low_latency_dispatch(ins[r][0], ins[r][1], M, E, use_fp8=fp8), what=f"call {i}")
            got = out[0][0] if fp8 else out[0]
            if not (int(ref.recv_count.sum()) > 0 and torch.equal(got.view(torch.uint8), ref.recv_x.view(torch.uint8))
                    and torch.equal(out[1], ref.recv_count) and torch.equal(out[2][0], ref.src_info)):
                problems.append(f"call {i} (hidden {H}, fp8={fp8})")
    finally:
        coll(b.destroy, what="destroy")
    all_ranks_ok(comm, not problems, f"dispatches unlike the reference: {problems}")


def test_odd_hidden_with_one_row_per_expert(comm):
    """hidden 129 (messages not a multiple of 4 bytes) and one row per expert: the received row,
    its source info and the combine are exact (a [1, n] byte slice of odd stride once could not
    be viewed as int32)."""
    r, R = comm.Get_rank(), comm.Get_size()
    H, M, E = 129, 8, 2 * R
    b = Buffer(None, 0, Buffer.get_low_latency_rdma_size_hint(M, H, R, E), low_latency_mode=True, comm=comm,
               explicitly_destroy=True)
    x = (torch.arange(H, dtype=torch.float32) + r).unsqueeze(0).to(torch.bfloat16)
    idx = torch.tensor([[(2 * r + 2) % E, -1]])
    try:
        recv_x, cnt, handle, _, _ = coll(lambda: b.low_latency_dispatch(x, idx, M, E, use_fp8=False), what="dispatch")
        src = (r - 1) % R  # the rank whose token lands on our first local expert
        ok = cnt.tolist() == [1, 0] and torch.equal(recv_x[0, 0], (torch.arange(H, dtype=torch.float32) + src)
                                                    .to(torch.bfloat16))
        y, _, _ = coll(lambda: b.low_latency_combine(recv_x, idx, torch.ones(1, 2), handle), what="combine")
        ok = ok and torch.equal(y, x)
    finally:
        coll(b.destroy, what="destroy")
    all_ranks_ok(comm, ok, f"odd hidden: counts {cnt.tolist()}")


# ----------------------------------------------------------------------------------------------
# sizes and bad input


def test_size_hint_formula_and_refusals(comm):
    """The hint is docs/semantics/deepep-api.md §6.8's formula; a Buffer of exactly the hint runs the call; one byte
    less is refused at construction (not a multiple of 128) and 128 bytes less by the call, on every rank.
    At exactly the hint, every slot full (each of M tokens to every expert) and every LogFMT group
    falling back to BF16 (the most a LogFMT combine writes) still fits."""
    R = comm.Get_size()
    M, H, E = 128, 7168, 288
    S, d, c = H // 128, 16 + max(2 * H, H + 4 * (H // 128)), 4 * (H // 128) + 2 * H
    total = 2 * (max(M * d, E * M * c) + E * M * max(d, c) + -(-4 * E // 128) * 128)
    assert Buffer.get_low_latency_rdma_size_hint(M, H, R, E) == (total // 128 + 1) * 128
    assert S == 56
    m, h, e = 8, 256, 2 * R
    hint = Buffer.get_low_latency_rdma_size_hint(m, h, R, e)
    _, exc = capture(lambda: Buffer(None, 0, hint - 1, low_latency_mode=True, comm=comm))
    assert isinstance(exc, RuntimeError) and "multiple of 128" in str(exc), repr(exc)
    errors = []
    x, idx = make_inputs(1, comm.Get_rank(), R, m, h, e, 2)
    for nbytes, ok in ((hint, True), (hint - 128, False)):
        b = Buffer(None, 0, nbytes, low_latency_mode=True, comm=comm, explicitly_destroy=True)
        for fp8 in (False, True):
            _, exc = capture(lambda: b.low_latency_dispatch(x, idx, m, e, use_fp8=fp8))
            good = exc is None if ok else (isinstance(exc, ValueError) and "get_low_latency_rdma_size_hint" in str(exc))
            if not good:
                errors.append(f"{nbytes} B, fp8={fp8}: {exc!r}")
        if ok:
            g = torch.Generator().manual_seed(comm.Get_rank())
            big = ((1 + torch.rand(m, h, generator=g)) * (torch.randint(0, 2, (m, h), generator=g) * 2 - 1)).to(BF16)
            every = torch.arange(e).expand(m, e).contiguous()
            recv_x, _, handle, _, _ = b.low_latency_dispatch(big, every, m, e, use_fp8=False)
            y, _, _ = b.low_latency_combine(recv_x, every, torch.ones(m, e), handle, use_logfmt=True)
            if not torch.equal(y, (big.float() * e).to(BF16)):
                errors.append("full slots, LogFMT all BF16 groups: combine differs")
        coll(b.destroy, what="destroy")
    all_ranks_ok(comm, not errors, f"size refusals: {errors}")


def _roundtrip_ok(buf, comm, seed=0):
    r, R = comm.Get_rank(), comm.Get_size()
    x, idx = make_inputs(seed, r, R, 6, 128, 2 * R, 2)
    xs = [make_inputs(seed, s, R, 6, 128, 2 * R, 2)[1] for s in range(R)]
    recv_x, cnt, handle, _, _ = buf.low_latency_dispatch(x, idx, 8, 2 * R, use_fp8=False)
    want = torch.tensor([sum(int((i == r * 2 + e).sum()) for i in xs) for e in range(2)], dtype=torch.int32)
    combined, _, _ = buf.low_latency_combine(recv_x, idx, torch.ones(idx.shape), handle)
    exp = (x.float() * (idx >= 0).sum(1, keepdim=True)).to(BF16)
    return torch.equal(cnt, want) and torch.equal(combined, exp)


def test_bad_inputs_raise_on_every_rank_and_buffer_stays_usable(buffers, comm):
    buf = _buf(buffers, "nodes" if comm.Get_size() >= 2 else "ubmem")
    r, R = comm.Get_rank(), comm.Get_size()
    E, M, H = 2 * R, 8, 256
    x, idx = make_inputs(2, r, R, 6, H, E, 2)
    big_x, big_idx = make_inputs(2, r, R, M + 1, H, E, 2)
    cases = [
        ("N > M", lambda: buf.low_latency_dispatch(big_x, big_idx, M, E), ValueError),
        ("x float32", lambda: buf.low_latency_dispatch(x.float(), idx, M, E), TypeError),
        ("topk_idx int32", lambda: buf.low_latency_dispatch(x, idx.int(), M, E), TypeError),
        ("FP8 hidden 200", lambda: buf.low_latency_dispatch(x[:, :200], idx, M, E), ValueError),
        ("UE8M0 without round_scale", lambda: buf.low_latency_dispatch(x, idx, M, E, use_ue8m0=True), RuntimeError),
        ("UE8M0 hidden 384", lambda: buf.low_latency_dispatch(
            torch.zeros(6, 384, dtype=BF16), idx, M, E, round_scale=True, use_ue8m0=True), ValueError),
        ("M past the header's 16 bits", lambda: buf.low_latency_dispatch(x, idx, 65536, E), ValueError),
        ("E not a multiple of R", lambda: buf.low_latency_dispatch(x, idx, M, 2 * R + (R > 1)),
         ValueError if R > 1 else type(None)),
        ("async + hook", lambda: buf.low_latency_dispatch(x, idx, M, E, async_finish=True, return_recv_hook=True),
         RuntimeError),
        ("expert 0 in every slot: 12 rows for one expert, M = 8", lambda: buf.low_latency_dispatch(
            x, torch.zeros_like(idx), M, E), ValueError),
    ]
    errors = []
    for name, call, want in cases:
        _, exc = capture(call)
        if type(exc) is not want:
            errors.append(f"{name}: expected {want.__name__}, got {exc!r}")
    # One rank wrong, the others right: the wrong rank raises its error, the others a ConsensusError naming it.
    if R >= 2:
        _, exc = capture(lambda: buf.low_latency_dispatch(x.float() if r == 1 else x, idx, M, E, use_fp8=False))
        want = TypeError if r == 1 else ConsensusError
        if not isinstance(exc, want) or (r != 1 and "rank 1" not in str(exc)):
            errors.append(f"one bad rank: expected {want.__name__}, got {exc!r}")
        # Ranks disagreeing on hidden: every rank raises.
        _, exc = capture(lambda: buf.low_latency_dispatch(x[:, :128] if r == 0 else x, idx, M, E, use_fp8=False))
        if not (isinstance(exc, ConsensusError) and "disagree" in str(exc)):
            errors.append(f"disagreeing hidden: {exc!r}")
        for what, m_, e_ in (("M", M + (r == 0), E), ("num_experts", M, E + R * (r == 0))):
            _, exc = capture(lambda: buf.low_latency_dispatch(x, idx, m_, e_, use_fp8=False))  # noqa: B023
            if not (isinstance(exc, ConsensusError) and "disagree" in str(exc)):
                errors.append(f"disagreeing {what}: {exc!r}")
    # Combine refusals.
    recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
    w = torch.ones(idx.shape)
    for name, call, want in [
        ("combine x float32", lambda: buf.low_latency_combine(recv_x.float(), idx, w, handle), TypeError),
        ("combine weights float64", lambda: buf.low_latency_combine(recv_x, idx, w.double(), handle), TypeError),
        ("zero_copy + logfmt", lambda: buf.low_latency_combine(recv_x, idx, w, handle, zero_copy=True,
                                                                 use_logfmt=True), RuntimeError),
        ("bad handle", lambda: buf.low_latency_combine(recv_x, idx, w, handle[:3]), ValueError),
        ("logfmt hidden 200", lambda: buf.low_latency_combine(recv_x[:, :, :200], idx, w,
                                                              (*handle[:3], 200, E), use_logfmt=True), ValueError),
    ]:
        _, exc = capture(call)
        if type(exc) is not want:
            errors.append(f"{name}: expected {want.__name__}, got {exc!r}")
    # The dispatch's own tensors written in place since: checked again (the combine below then routes again).
    for name, t, bad in (("topk_idx written since the dispatch", idx, E),
                         ("layout_range written since the dispatch", handle[1], ((R * M) << 32) | 1)):
        old = int(t[0, 0])
        t[0, 0] = bad
        _, exc = capture(lambda: buf.low_latency_combine(recv_x, idx, w, handle))  # noqa: B023
        t[0, 0] = old
        if type(exc) is not ValueError:
            errors.append(f"{name}: expected ValueError, got {exc!r}")
    combined, _, _ = buf.low_latency_combine(recv_x, idx, w, handle, use_logfmt=True)
    if not torch.equal(combined, (x.float() * (idx >= 0).sum(1, keepdim=True)).to(BF16)):  # |x| >= 1: BF16 groups
        errors.append("use_logfmt combine differs")
    if R >= 2:  # ranks disagreeing on use_logfmt: every rank raises, the Buffer stays usable
        _, exc = capture(lambda: buf.low_latency_combine(recv_x, idx, w, handle, use_logfmt=r == 0))
        if not (isinstance(exc, ConsensusError) and "use_logfmt" in str(exc)):
            errors.append(f"disagreeing use_logfmt: {exc!r}")
    if not _roundtrip_ok(buf, comm, seed=11):
        errors.append("round trip after the refusals failed")
    normal = Buffer(None, 1 << 16, 0, comm=comm, explicitly_destroy=True)
    _, exc = capture(lambda: normal.low_latency_dispatch(x, idx, M, E))
    if not (isinstance(exc, RuntimeError) and "low-latency mode" in str(exc)):
        errors.append(f"normal-mode Buffer: {exc!r}")
    _, exc = capture(lambda: buf.low_latency_update_mask_buffer(0, True))
    if not (isinstance(exc, RuntimeError) and "enable_shrink" in str(exc)):
        errors.append(f"mask without shrink: {exc!r}")
    coll(normal.destroy, what="destroy normal buffer")
    coll(buf.clean_low_latency_buffer, M, H, E, what="clean (harmless)")
    if not _roundtrip_ok(buf, comm, seed=12):
        errors.append("round trip after clean failed")
    all_ranks_ok(comm, not errors, f"bad inputs: {errors}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("cfg", ["ubmem", "nodes"])
def test_call_while_a_hook_is_pending_on_one_rank_is_refused_on_every_rank(buffers, comm, cfg):
    """Every rank makes a hooked dispatch; the last rank forgets its hook and goes on to the combine: it raises
    RuntimeError, every other rank ``LowLatencyRefused`` naming it, at once (in the call's first round). That rank
    received the pending dispatch first, so the peers may go on at once: its hook returns at once with the
    reference's rows, and the combine after it gives x · Σw on every rank."""
    from deepep_ascend.ep.low_latency import LowLatencyRefused

    buf = _buf(buffers, cfg)
    r, R = comm.Get_rank(), comm.Get_size()
    E, M, H, K = 2 * R, 16, 256, 2
    xs = [make_inputs(91, s, R, 12, H, E, K) for s in range(R)]
    x, idx = xs[r]
    w = torch.rand(idx.shape, generator=torch.Generator().manual_seed(r))
    errors = []
    recv_x, cnt, handle, _, hook = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False, return_recv_hook=True)
    if r != R - 1:
        hook()
    t0 = time.monotonic()
    _, exc = capture(lambda: buf.low_latency_combine(recv_x, idx, w, handle))
    elapsed = time.monotonic() - t0
    if r == R - 1:
        if not (type(exc) is RuntimeError and "receive hook" in str(exc) and "received now" in str(exc)):
            errors.append(f"the rank with the hook pending: {exc!r}")
        time.sleep(0.2)  # the peers are in their next call by now, rewriting the half of the pending call's rows
        hook()
    elif not (isinstance(exc, LowLatencyRefused) and f"rank {R - 1}" in str(exc)):
        errors.append(f"a peer: {exc!r}")
    if elapsed > 10:
        errors.append(f"the refusal took {elapsed:.1f} s")
    ref = ref_ll_dispatch([i[0] for i in xs], [i[1] for i in xs], r, E, M)
    if not torch.equal(bits(recv_x), bits(ref.recv_x)) or not torch.equal(cnt, ref.recv_count):
        errors.append("the hooked dispatch differs from the reference")
    combined, _, _ = buf.low_latency_combine(recv_x, idx, w, handle)
    if not torch.equal(bits(combined), bits(ref_ll_combine(lambda t, g: x[t], idx, w, E, R, H))):
        errors.append("the combine after the refusal differs from the reference")
    all_ranks_ok(comm, not errors, f"rank {r}: {errors}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("cfg", ["ubmem", "nodes"])
def test_clean_refused_on_one_rank_leaves_no_peer_waiting(comm, cfg):
    """``clean_low_latency_buffer`` with ``hidden=0`` on rank 0, then (rank 0 only) while a receive hook is
    pending: rank 0 raises (ValueError, RuntimeError) after taking part in the barrier, the others return at once
    (a 10 s deadline, far from reached), and the round trips after each run on every rank, rank 0's hook too."""
    r, R = comm.Get_rank(), comm.Get_size()
    E, M, H = 2 * R, 8, 128
    kw = dict(ranks_per_node=R // 2) if cfg == "nodes" else {}
    buf = Buffer(None, 0, _hint(R), low_latency_mode=True, comm=comm, explicitly_destroy=True, timeout_s=10, **kw)
    errors = []
    try:
        t0 = time.monotonic()
        _, exc = capture(lambda: buf.clean_low_latency_buffer(M, 0 if r == 0 else H, E))
        want = ValueError if r == 0 else type(None)
        if type(exc) is not want or (r == 0 and "hidden" not in str(exc)):
            errors.append(f"bad hidden on rank 0: {exc!r}")
        if not _roundtrip_ok(buf, comm, seed=21):
            errors.append("round trip after the refused clean")
        x, idx = make_inputs(22, r, R, 6, H, E, 2)
        recv_x, _, handle, _, hook = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False, return_recv_hook=True)
        if r:
            hook()
        _, exc = capture(lambda: buf.clean_low_latency_buffer(M, H, E))
        want = RuntimeError if r == 0 else type(None)
        if type(exc) is not want or (r == 0 and "receive hook" not in str(exc)):
            errors.append(f"clean with a pending hook on rank 0: {exc!r}")
        if r == 0:
            hook()
        combined, _, _ = buf.low_latency_combine(recv_x, idx, torch.ones(idx.shape), handle)
        if not torch.equal(combined, (x.float() * (idx >= 0).sum(1, keepdim=True)).to(BF16)):
            errors.append("the hooked round trip around the refused clean")
        if time.monotonic() - t0 > 8:
            errors.append(f"took {time.monotonic() - t0:.1f} s: a rank waited for a deadline")
    finally:
        coll(buf.destroy, what="destroy")
    all_ranks_ok(comm, not errors, f"rank {r}: {errors}")


# ----------------------------------------------------------------------------------------------
# shrink mode and missing ranks

SHRINK_TIMEOUT_S = 1.5 if world().Get_size() <= 4 else 2.0  # deadline of the missing-rank tests


@pytest.mark.mpi(min_size=2)
@up_to_four_ranks()
def test_shrink_masks_ranks_dead_at_dispatch_combine_and_clean(comm):
    """As DeepEP's shrink test: one rank stops at its first dispatch, one at its first combine, one at
    clean (2 ranks: only the first), and goes straight to ``destroy()`` (the first one leaves as its
    process's exit would, without ``destroy()``: ``Transport.destroy_at_exit``). Survivors mask each
    after the deadline, complete every call, get the reference results with the dead ranks' experts
    dropped, query exactly the dead set, and then destroy too: no rank's teardown raises or aborts
    another's calls, and every transport ends closed with its windows abandoned (a rank was lost)."""
    r, R = comm.Get_rank(), comm.Get_size()
    dies = {R - 1: 0}  # rank -> the round it stops at (0: first dispatch, 1: first combine, 2: clean)
    if R >= 4:
        dies.update({R - 2: 1, 1: 2})
    buf = Buffer(None, 0, _hint(R), low_latency_mode=True, comm=comm, explicitly_destroy=True, enable_shrink=True,
                 timeout_s=SHRINK_TIMEOUT_S, ranks_per_node=R // 2)
    tp = buf.runtime
    chk = Checker(r)
    mask = torch.zeros(R, dtype=torch.int32)
    E, L, M, H, K = 2 * R, 2, 16, 256, 3
    dead = []
    exc = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for rnd, phase in enumerate(["dispatch", "combine", "clean", "dispatch", "combine"]):
            dead = sorted(p for p, d in dies.items() if d <= rnd)
            if r in dead:
                break  # a dead rank takes no further part: straight to destroy()
            ins = [make_inputs(600 + rnd, s, R, 10, H, E, K) for s in range(R)]
            _, exc = capture(lambda: _shrink_round(buf, ins, r, R, rnd, phase, dead, chk, E, L, M, H))
            if exc is not None:
                chk.check(False, f"round {rnd} ({phase}): {exc!r}")
                break
            buf.low_latency_query_mask_buffer(mask)
            want = torch.zeros(R, dtype=torch.int32)
            want[dead] = 1
            chk.check(torch.equal(mask, want), f"round {rnd} ({phase}): mask {mask.tolist()} != dead {dead}")
        if r not in dead and exc is None:
            buf.low_latency_clean_mask_buffer()
            buf.low_latency_query_mask_buffer(mask)
            chk.check(int(mask.sum()) == 0, "clean_mask_buffer left masks")
            buf.low_latency_update_mask_buffer((r + 1) % R, True)
            buf.low_latency_query_mask_buffer(mask)
            chk.check(int(mask.sum()) == 1 and int(mask[(r + 1) % R]) == 1, "update_mask_buffer")
        if r == R - 1:  # its script ends here: the exit's teardown, not destroy()
            _, exc = capture(tp.destroy_at_exit)
            chk.check(exc is None, f"destroy_at_exit raised {exc!r}")
        _, exc = capture(buf.destroy)
    chk.check(exc is None, f"destroy raised {exc!r}")
    abandoned = getattr(tp, "abandoned", None)
    chk.check(tp.state.name == "CLOSED" and abandoned is True, f"after destroy: {tp.state}, abandoned={abandoned}")
    all_ranks_ok(comm, not chk.errors, f"shrink: {chk.errors[:5]}")


def _shrink_round(buf, ins, r, R, rnd, phase, dead, chk, E, L, M, H):
    """One call of the shrink test, checked against the reference with the ``dead`` ranks dropped."""
    global _shrink_state
    if phase == "dispatch":
        d_x, d_idx = ins[r]
        recv_x, cnt, handle, _, _ = buf.low_latency_dispatch(d_x, d_idx, M, E, use_fp8=False)
        ref = ref_ll_dispatch([i[0] for i in ins], [i[1] for i in ins], r, E, M, masked=dead)
        chk.same_bits(cnt, ref.recv_count, f"round {rnd}: recv_count with {dead} dead")
        chk.same_bits(recv_x, ref.recv_x, f"round {rnd}: recv_x with {dead} dead")
        _shrink_state = (recv_x, handle, d_x, d_idx)
    elif phase == "combine":
        recv_x, handle, d_x, d_idx = _shrink_state
        y = expert_outputs(recv_x, r, L, False)
        w = torch.rand(d_idx.shape, generator=torch.Generator().manual_seed(rnd))
        combined, _, _ = buf.low_latency_combine(y, d_idx, w, handle)
        exp = ref_ll_combine(lambda t, g: ref_expert_row(d_x[t], g, False, False, False), d_idx, w, E, R, H,
                             masked=dead)
        chk.same_bits(combined, exp, f"round {rnd}: combined with {dead} dead")
    else:
        buf.clean_low_latency_buffer(M, H, E)


_shrink_state = None


@pytest.mark.mpi(min_size=2)
def test_shrink_rank_masked_then_unmasked_counts_again(comm):
    """Every rank masks the last one and it masks every other (one dispatch, combine and clean apart,
    nobody waiting for a deadline); after ``low_latency_clean_mask_buffer`` the next dispatch,
    combine and clean count every token of every rank again (the reference with nobody masked),
    with no rank masked by a timeout. The healthy teardown then frees the windows."""
    r, R = comm.Get_rank(), comm.Get_size()
    out = R - 1
    buf = Buffer(None, 0, _hint(R), low_latency_mode=True, comm=comm, explicitly_destroy=True, enable_shrink=True,
                 timeout_s=SHRINK_TIMEOUT_S, ranks_per_node=R // 2)
    tp = buf.runtime
    chk = Checker(r)
    E, L, M, H, K = 2 * R, 2, 16, 256, 3
    mask = torch.zeros(R, dtype=torch.int32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a timeout's masking would be a failure here
        for rnd, apart in enumerate([True, True, False, False]):
            buf.low_latency_clean_mask_buffer()
            if apart:
                for p in range(R):
                    if p != r and out in (p, r):
                        buf.low_latency_update_mask_buffer(p, True)
            dead = ([out] if r != out else [p for p in range(R) if p != out]) if apart else []
            ins = [make_inputs(700 + rnd, s, R, 10, H, E, K) for s in range(R)]
            for phase in ("dispatch", "combine", "clean"):
                _, exc = capture(lambda: _shrink_round(buf, ins, r, R, rnd, phase, dead, chk, E, L, M, H))
                chk.check(exc is None, f"round {rnd} ({phase}, apart={apart}): {exc!r}")
                buf.low_latency_query_mask_buffer(mask)
                chk.check(sorted(torch.nonzero(mask).view(-1).tolist()) == dead,
                          f"round {rnd} ({phase}): mask {mask.tolist()}, expected {dead} masked")
    buf.low_latency_clean_mask_buffer()
    _, exc = capture(buf.destroy)
    chk.check(exc is None and tp.state.name == "CLOSED" and getattr(tp, "abandoned", None) is False,
              f"healthy destroy: {exc!r}, {tp.state}, abandoned={getattr(tp, 'abandoned', None)}")
    all_ranks_ok(comm, not chk.errors, f"unmasked: {chk.errors[:5]}")


@pytest.mark.mpi(min_size=2)
def test_shrink_peers_rejoining_early_leave_the_masking_rank_intact(comm):
    """The last rank masks every other and they mask it for one dispatch and combine; it holds its dispatch's
    receive hook for a while, so the others unmask it and issue the next dispatch into the half that hook still
    reads. Its own rows come back exactly (the reference with the others dropped), and once it unmasks them too
    the joined dispatch and combine count every token of every rank."""
    r, R = comm.Get_rank(), comm.Get_size()
    out = R - 1
    buf = Buffer(None, 0, _hint(R), low_latency_mode=True, comm=comm, explicitly_destroy=True, enable_shrink=True,
                 timeout_s=SHRINK_TIMEOUT_S, ranks_per_node=R // 2)
    chk = Checker(r)
    E, L, M, H, K = 2 * R, 2, 16, 256, 3
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a timeout's masking would be a failure here
        for p in range(R):
            if p != r and out in (p, r):
                buf.low_latency_update_mask_buffer(p, True)
        dead = [out] if r != out else [p for p in range(R) if p != out]
        ins = [make_inputs(760, s, R, 10, H, E, K) for s in range(R)]
        d_x, d_idx = ins[r]

        def apart():
            recv_x, cnt, handle, _, hook = buf.low_latency_dispatch(d_x, d_idx, M, E, use_fp8=False,
                                                                     return_recv_hook=True)
            if r == out:
                time.sleep(0.2)  # the others' next dispatch lands meanwhile
            hook()
            ref = ref_ll_dispatch([i[0] for i in ins], [i[1] for i in ins], r, E, M, masked=dead)
            chk.same_bits(cnt, ref.recv_count, "apart: recv_count")
            chk.same_bits(recv_x, ref.recv_x, "apart: recv_x")
            global _shrink_state
            _shrink_state = (recv_x, handle, d_x, d_idx)
            _shrink_round(buf, ins, r, R, 0, "combine", dead, chk, E, L, M, H)

        _, exc = capture(apart)
        chk.check(exc is None, f"apart: {exc!r}")
        buf.low_latency_clean_mask_buffer()
        for phase in ("dispatch", "combine"):
            _, exc = capture(lambda: _shrink_round(buf, ins, r, R, 1, phase, [], chk, E, L, M, H))
            chk.check(exc is None, f"joined {phase}: {exc!r}")
    _, exc = capture(buf.destroy)
    chk.check(exc is None, f"destroy: {exc!r}")
    all_ranks_ok(comm, not chk.errors, f"rejoining early: {chk.errors[:5]}")


@pytest.mark.mpi(min_size=2)
def test_missing_rank_without_shrink_times_out_naming_it(comm):
    """Without shrink mode the last rank (on the other node) skipping a dispatch makes every other
    rank raise a TimeoutError naming it; then all destroy."""
    r, R = comm.Get_rank(), comm.Get_size()
    missing = R - 1
    buf = Buffer(None, 0, _hint(R), low_latency_mode=True, comm=comm, explicitly_destroy=True,
                 timeout_s=SHRINK_TIMEOUT_S, ranks_per_node=R // 2)
    x, idx = make_inputs(4, r, R, 6, 128, 2 * R, 2)
    ok, detail = True, ""
    if r != missing:
        _, exc = capture(lambda: buf.low_latency_dispatch(x, idx, 8, 2 * R, use_fp8=False))
        ok = isinstance(exc, TimeoutError) and missing in (getattr(exc, "pending_peers", None) or [])
        detail = f"rank {r}: {exc!r}"
        exc = None
    comm.Barrier()
    _, dexc = capture(buf.destroy)
    all_ranks_ok(comm, ok and dexc is None, f"missing rank {missing}: {detail}; destroy {dexc!r}")


def _pool_test_buffer(comm, nodes: bool, M: int, H: int, E: int) -> Buffer:
    """A low-latency Buffer of its own (destroyed by the test) on one node, or (``nodes``) on two simulated
    nodes, whose receives take the torch path; skips with fewer than 2 ranks for two nodes."""
    R = comm.Get_size()
    if nodes and R < 2:
        pytest.skip("two simulated nodes need 2 ranks")
    return Buffer(None, 0, Buffer.get_low_latency_rdma_size_hint(M, H, R, E), low_latency_mode=True, comm=comm,
                  explicitly_destroy=True, **({"ranks_per_node": R // 2} if nodes else {}))


@pytest.mark.parametrize("nodes", [False, True], ids=["1node", "nodes"])
def test_outputs_recycled_only_once_dropped(comm, nodes):
    """Dispatch outputs (``[L, R·M, H]``, the FP8 scales and ``src_info``) come from a pool: a result the
    caller keeps is never written by later calls, a dropped one is reused (same storage; large outputs
    once never were) and its rows beyond ``recv_count`` read as zero again after a call that
    wrote more rows. FP8 recv_x is 512 KiB x R: a torch tensor at 1 rank, a zero mapping above. On one
    node the native receive zeroes those rows, across nodes (``nodes``) the torch path's."""
    r, R = comm.Get_rank(), comm.Get_size()
    E, M, H = 2 * R, 64, 4096
    buf = _pool_test_buffer(comm, nodes, M, H, E)
    x_big, idx_big = make_inputs(71, r, R, M, H, E, 2)
    x_small, idx_small = make_inputs(72, r, R, 3, H, E, 2)

    def call(x, idx):
        return buf.low_latency_dispatch(x, idx, M, E, use_fp8=True)

    kept = coll(call, x_big, idx_big, what="dispatch kept")
    kept_x, kept_s = kept[0][0].clone(), kept[0][1].clone()
    first = coll(call, x_big, idx_big, what="dispatch dropped")
    ptr = first[0][0].data_ptr()
    del first
    again = coll(call, x_small, idx_small, what="dispatch after a drop")
    (data, scales), count = again[0], again[1]
    chk = Checker(r)
    chk.check(torch.equal(kept[0][0].view(torch.uint8), kept_x.view(torch.uint8))
              and torch.equal(kept[0][1], kept_s), "a kept result was overwritten by a later call")
    # White-box: an equal address alone could be a fresh mapping at the freed one's place.
    pooled = {ent[0].data_ptr() for ents in buf._ll.pool._entries.values() for ent in ents}
    chk.check(data.data_ptr() == ptr and ptr in pooled, "the dropped result's storage was not reused")
    pad = torch.arange(R * M).unsqueeze(0) >= count.unsqueeze(1)  # [L, R*M] rows past recv_count
    chk.check(not data.view(torch.uint8)[pad].any() and not scales[pad].any() and not again[2][0][pad].any(),
              "recycled output: rows past recv_count are not zero")
    ref = ref_ll_dispatch(gather_all(x_small), gather_all(idx_small), r, E, M, True)
    chk.check(torch.equal(count, ref.recv_count), "recv_count")
    del kept, again, data, scales
    coll(buf.destroy, what="destroy")
    chk.finish("output pool")


@pytest.mark.parametrize("hold", ["tensor", "view", "alias", "scales", "handle", "src_info", "tuple"])
def test_an_output_held_any_way_is_not_handed_out_again(comm, hold):
    """Dispatch outputs come from a pool: whatever of a dispatch's outputs the caller still holds (the tensor
    itself, only a view of it, another tensor on its storage, the scales, the handle or its ``src_info`` alone,
    the whole result) keeps its bytes through later dispatches of the same shape, while the outputs it dropped
    are reused."""
    r, R = comm.Get_rank(), comm.Get_size()
    E, M, H = 2 * R, 16, 512
    buf = _pool_test_buffer(comm, False, M, H, E)
    chk = Checker(r)

    def call(seed):
        x, idx = make_inputs(seed, r, R, M, H, E, 2)
        return coll(lambda: buf.low_latency_dispatch(x, idx, M, E, use_fp8=True), what=f"dispatch {seed}")

    out = call(101)
    picks = {"tensor": lambda o: o[0][0], "view": lambda o: o[0][0][:, 1:],
             "alias": lambda o: torch.empty(0, dtype=torch.uint8).set_(o[0][0].untyped_storage()),
             "scales": lambda o: o[0][1],
             "handle": lambda o: o[2], "src_info": lambda o: o[2][0], "tuple": lambda o: o}
    held = picks[hold](out)
    as_bytes = {"tensor": lambda t: [t.view(torch.uint8)], "view": lambda t: [t.view(torch.uint8)],
                "alias": lambda t: [t],
                "scales": lambda t: [t], "handle": lambda t: [t[0], t[1]], "src_info": lambda t: [t],
                "tuple": lambda t: [t[0][0].view(torch.uint8), t[0][1], t[1], t[2][0], t[2][1]]}[hold]
    before = [t.clone() for t in as_bytes(held)]
    ptrs = {t.data_ptr() for t in (out[0][0], out[0][1], out[2][0])}
    del out
    reused = set()
    for seed in (102, 103, 104):  # other routing, so that any reuse of the held storage would show
        again = call(seed)
        reused |= {t.data_ptr() for t in (again[0][0], again[0][1], again[2][0])} & ptrs
        del again
    chk.check(all(torch.equal(a, b) for a, b in zip(as_bytes(held), before)),
              f"an output held as {hold!r} was overwritten by a later dispatch")
    if hold != "tuple":  # the outputs not held are the pool's again
        chk.check(bool(reused), f"holding only {hold!r}, none of the dropped outputs was reused")
    del held
    coll(buf.destroy, what="destroy")
    chk.finish(f"pool, held as {hold}")


@pytest.mark.parametrize("what", ["requires_grad", "grad", "attribute", "data_same_shape", "data_other_shape"])
def test_what_a_caller_sets_on_a_dropped_output_never_reaches_a_later_one(comm, what):
    """Each dispatch returns tensor objects of its own: ``requires_grad``, ``.grad``, an attribute or a ``.data``
    swap set on a dropped ``recv_x`` / ``src_info`` does not show on the next dispatch's outputs, which equal the
    reference (zeros past ``recv_count`` included) and take in-place writes."""
    r, R = comm.Get_rank(), comm.Get_size()
    E, M, H = 2 * R, 16, 256
    buf = _pool_test_buffer(comm, False, M, H, E)
    chk = Checker(r)
    set_state = {
        "requires_grad": lambda t: t.requires_grad_(True),
        "grad": lambda t: setattr(t, "grad", torch.ones_like(t)),
        "attribute": lambda t: setattr(t, "tag", "an earlier call's"),
        "data_same_shape": lambda t: setattr(t, "data", torch.full_like(t, 3)),
        "data_other_shape": lambda t: setattr(t, "data", torch.zeros(1, dtype=t.dtype)),
    }[what]
    x, idx = make_inputs(111, r, R, M, H, E, 2)
    for round_ in range(3):  # the entries of the first round are the ones the later rounds reuse
        recv_x, count, handle, _, _ = coll(lambda: buf.low_latency_dispatch(x, idx, M, E, use_fp8=False),
                                           what=f"dispatch {round_}")
        if round_:
            ref = ref_ll_dispatch(gather_all(x), gather_all(idx), r, E, M, False)
            for t, name in ((recv_x, "recv_x"), (handle[0], "src_info")):
                chk.check(not t.requires_grad and t.grad is None and not hasattr(t, "tag"),
                          f"round {round_}: {name} carries state an earlier caller set ({what})")
            chk.check(torch.equal(recv_x.view(torch.int16), ref.recv_x.view(torch.int16))
                      and torch.equal(handle[0], ref.src_info) and torch.equal(count, ref.recv_count),
                      f"round {round_}: outputs differ from the reference after {what}")
            recv_x.add_(0)  # the caller's to write in place
        set_state(recv_x)
        if what not in ("requires_grad", "grad"):  # (an int32 tensor takes neither)
            set_state(handle[0])
        del recv_x, count, handle
    coll(buf.destroy, what="destroy")
    chk.finish(f"state on dropped outputs: {what}")


@pytest.mark.parametrize("nodes", [False, True], ids=["1node", "nodes"])
def test_outputs_the_caller_wrote_into_are_not_handed_out_again(comm, nodes):
    """A caller may overwrite a dispatch's outputs in place (DeepEP's are its own tensors) and drop them: a later
    dispatch must still return exactly the reference, zeros past ``recv_count`` included (the pool knows only the
    rows its own receive wrote, so a written output is left out of it)."""
    r, R = comm.Get_rank(), comm.Get_size()
    E, M, H = 2 * R, 32, 256
    buf = _pool_test_buffer(comm, nodes, M, H, E)
    chk = Checker(r)
    for fp8 in (False, True):
        x_big, idx_big = make_inputs(81, r, R, M, H, E, 2)
        x_small, idx_small = make_inputs(82, r, R, 5, H, E, 2)
        out = coll(lambda: buf.low_latency_dispatch(x_big, idx_big, M, E, use_fp8=fp8), what="dispatch to overwrite")
        data, scales = out[0] if fp8 else (out[0], None)
        data.view(torch.uint8).fill_(0x3C)  # every row, padding included, through views of the outputs
        out[2][0].fill_(99)  # the handle's src_info
        if scales is not None:
            scales.fill_(5.0)
        del out, data, scales
        again = coll(lambda: buf.low_latency_dispatch(x_small, idx_small, M, E, use_fp8=fp8), what="dispatch after")
        ref = ref_ll_dispatch(gather_all(x_small), gather_all(idx_small), r, E, M, fp8)
        got_x = again[0][0] if fp8 else again[0]
        chk.check(torch.equal(got_x.view(torch.uint8), ref.recv_x.view(torch.uint8)), f"fp8={fp8}: recv_x")
        chk.check(torch.equal(again[2][0], ref.src_info), f"fp8={fp8}: src_info")
        if fp8:
            chk.check(torch.equal(again[0][1], ref.recv_scales), f"fp8={fp8}: scales")
        del again, got_x
    coll(buf.destroy, what="destroy")
    chk.finish("outputs written by the caller")


@pytest.mark.mpi(min_size=1)
def test_fused_path_gives_the_step_by_step_bits_and_traffic(comm, monkeypatch):
    """On one node with the kernels loaded a call takes the fused path (two native calls, ``native.LLPlan``) unless
    it records wait times; the same calls on a Buffer built with ``DEEPEP_ASCEND_LL_FUSED=0`` (the step-by-step
    path) give the same bits, the same per-peer traffic counters and the same handles: BF16 and FP8 dispatch, a
    synchronous combine (own rows summed in place), a hook combine (own rows copied) and a zero-copy one (rows
    pulled)."""
    r, R = comm.Get_rank(), comm.Get_size()
    E, M, H, K, n = 4 * R, 16, 256, 3, 12

    def make():
        return Buffer(None, 0, Buffer.get_low_latency_rdma_size_hint(M, H, R, E), low_latency_mode=True, comm=comm,
                      explicitly_destroy=True)
    buf = make()
    if not buf._ll._fusable:
        buf.destroy()
        pytest.skip("no fused path here (kernels not built, or ranks not all mapped)")
    x, idx = make_inputs(91, r, R, n, H, E, K)
    w = torch.rand(idx.shape, generator=torch.Generator().manual_seed(r))

    def run(buf):
        got = []
        for fp8 in (False, True):
            recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=fp8)
            got += [t.clone() for t in (recv_x if fp8 else (recv_x,))] + [count.clone(), handle.src_info.clone(),
                                                                          handle.layout_range.clone()]
            got.append(buf.get_link_stats()["bytes_put"].copy())
        y = expert_outputs(recv_x, r, E // R, True)
        got.append(buf.low_latency_combine(y, idx, w, handle)[0].clone())
        got.append(buf.get_link_stats()["puts"].copy())
        combined, _, hook = buf.low_latency_combine(y, idx, w, handle, return_recv_hook=True)
        hook()
        got += [combined.clone(), buf.get_link_stats()["bytes_put"].copy()]
        buf.get_next_low_latency_combine_buffer(handle).copy_(y)
        got.append(buf.low_latency_combine(y, idx, w, handle, zero_copy=True)[0].clone())
        got.append(buf.get_link_stats()["signals"].copy())
        return got

    fused = coll(lambda: run(buf), what="fused path")
    _, dexc = capture(buf.destroy)
    monkeypatch.setenv("DEEPEP_ASCEND_LL_FUSED", "0")
    buf = coll(make, what="Buffer() with DEEPEP_ASCEND_LL_FUSED=0")
    off = not buf._ll._fusable
    steps = coll(lambda: run(buf), what="step-by-step path")
    same = [torch.equal(bits(a), bits(b)) if isinstance(a, torch.Tensor) else bool((a == b).all())
            for a, b in zip(fused, steps)]
    _, dexc2 = capture(buf.destroy)
    all_ranks_ok(comm, off and all(same) and len(fused) == len(steps) and dexc is None and dexc2 is None,
                 f"rank {r}: setting off {off}; differing outputs {[i for i, s in enumerate(same) if not s]}; "
                 f"destroy {dexc!r} {dexc2!r}")


_NO_TOKEN_CHILD = """
import sys, torch
from mpi4py import MPI
from deepep_ascend import Buffer, native
from tests.support.mpi_utils import gather_all
from tests.support.reference import ref_ll_dispatch
assert not native.available()  # DEEPEP_ASCEND_NATIVE=0: every step on its torch path
comm = MPI.COMM_WORLD
r, R, ue8m0 = comm.Get_rank(), comm.Get_size(), sys.argv[1] == "1"
E, M, H = 2 * R, 4, 512 if ue8m0 else 128  # (one float scale a token: its empty tensor has stride 0)
buf = Buffer(None, 0, Buffer.get_low_latency_rdma_size_hint(M, H, R, E), low_latency_mode=True, comm=comm,
             explicitly_destroy=True)
n = 0 if r == 0 else 3
x = (torch.randn(n, H, generator=torch.Generator().manual_seed(r)) * 4).to(torch.bfloat16)
idx = (torch.arange(n).unsqueeze(1) + torch.arange(2) + r) % E
(data, scales), count, _, _, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=True, round_scale=ue8m0,
                                                          use_ue8m0=ue8m0)
ref = ref_ll_dispatch(gather_all(x), gather_all(idx), r, E, M, use_fp8=True, round_scale=ue8m0, use_ue8m0=ue8m0)
ok = (torch.equal(data.view(torch.uint8), ref.recv_x.view(torch.uint8)) and torch.equal(count, ref.recv_count)
      and torch.equal(scales, ref.recv_scales))  # (finite scales: equal values are equal bits)
buf.destroy()
print(f"RANK {r} {'OK' if ok else 'DIFFERS'} {count.tolist()}", flush=True)
"""


@pytest.mark.mpi(min_size=1)
@pytest.mark.skipif(world().Get_size() != 1, reason="launches its own mpiexec; runs in the 1-rank job only")
@pytest.mark.parametrize("ue8m0", [False, True])
def test_fp8_dispatch_of_no_token_on_the_torch_paths(ue8m0):
    """An FP8 dispatch where rank 0 has no token, with ``DEEPEP_ASCEND_NATIVE=0`` (every step on its torch path, as
    without a C compiler): the reference's bits on both ranks, rank 0 included (a 2-rank child job)."""
    import sys

    from tests.support import REPO_ROOT
    from tests.support.mpi_utils import run_child_job

    rc, out = run_child_job(2, [sys.executable, "-c", _NO_TOKEN_CHILD, str(int(ue8m0))], REPO_ROOT, timeout_s=120,
                            DEEPEP_ASCEND_NATIVE="0", UCX_LOG_LEVEL="error")
    assert rc == 0 and out.count(" OK ") == 2, out[-3000:]
