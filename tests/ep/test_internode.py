"""Buffer normal internode mode (two hops, simulated nodes) vs the pure-torch reference
(docs/semantics/deepep-api.md §5).

Run: ``mpiexec -n N python -m pytest --with-mpi -q tests/ep/test_internode.py`` (N = 2, 4, 8).
Every ``ranks_per_node`` that splits the world into at least two nodes is tested: 2 ranks as
2 × 1, 4 as 2 × 2 and 4 × 1, 8 as 2 × 4, 4 × 2 and 8 × 1. Comparisons are bitwise, combine
included: the reference (``ref_combine(..., ranks_per_node=)``) rounds each node's partial sum to
bf16 before the origin's sum, as docs/semantics/deepep-api.md §5 says DeepEP does.
"""

from __future__ import annotations

import pytest
import torch

from deepep_ascend import Buffer
from deepep_ascend.ep.internode import HDR
from tests.support.buffer_helpers import (
    BF16,
    Case,
    Checker,
    all_ranks_ok,
    coll,
    make_topk_idx,
    many_round_trips,
    run_case,
    same_bits_nan,
)
from tests.support.mpi_utils import gather_all, up_to_four_ranks, world
from tests.support.reference import ref_combine

pytestmark = [pytest.mark.mpi(min_size=2), pytest.mark.watchdog(240)]

CASES = [
    Case("uniform_h128_e16_k4", cached=True, bias="pair"),
    Case("skewed_every_token_to_one_rank", tokens=24, hidden=256, experts=32, topk=4, routing="skewed"),
    Case("rank_with_zero_tokens", tokens=20, experts=16, topk=3, zero_rank=True, cached=True, bias="one"),
    Case("rows_all_minus1", tokens=30, experts=64, topk=6, routing="allneg", cached=True),
    Case("duplicate_experts_in_a_row", tokens=20, experts=16, topk=4, routing="dup", cached=True, bias="one"),
    Case("h200_not_div_128_e8_k8_align4", tokens=20, hidden=200, experts=8, topk=8, align=4),
    Case("num_worst_tokens_async", tokens=10, experts=32, topk=2, worst=True, cached=True, use_async=True,
         bias="pair_first_none"),
    Case("fp8_column_major_scales", tokens=24, hidden=256, x_kind="fp8", cached=True),
    Case("fp8_ue8m0_async", tokens=12, hidden=1024, experts=32, topk=4, x_kind="fp8_ue8m0", use_async=True),
    Case("no_topk", tokens=24, with_topk=False, cached=True),
    Case("config_num_sms_8_align128", tokens=40, num_sms=8, align=128, cached=True),
]


def _node_sizes(num_ranks):
    return [rpn for rpn in range(1, num_ranks) if num_ranks % rpn == 0]


def _hints(num_ranks, rpn, cases):
    nvl = max(Buffer.get_normal_buffer_size_hint(**c.hint_args(num_ranks), ranks_per_node=rpn) for c in cases)
    rdma = max(Buffer.get_normal_rdma_buffer_size_hint(**c.hint_args(num_ranks), ranks_per_node=rpn) for c in cases)
    return nvl, rdma


def _buffer(buffers, rpn):
    """The module's internode Buffer of ``rpn`` ranks per node."""
    nvl, rdma = _hints(world().Get_size(), rpn, CASES)
    return buffers(nvl, rdma, key=rpn, ranks_per_node=rpn)


def _rpn_params():
    R = world().Get_size()
    return [pytest.param(rpn, id=f"{R // rpn}x{rpn}") for rpn in _node_sizes(R)] or [pytest.param(1, id="n/a")]


@pytest.mark.parametrize("rpn", _rpn_params())
@pytest.mark.parametrize("case", CASES, ids=str)
def test_internode_dispatch_combine_vs_reference(buffers, comm, rpn, case):
    if comm.Get_size() % rpn or rpn >= comm.Get_size():
        pytest.skip("needs at least two nodes")
    buf = _buffer(buffers, rpn)
    assert buf.num_nodes == comm.Get_size() // rpn
    chk = run_case(buf, comm, case, seed=CASES.index(case) + 100 * rpn)
    chk.finish(f"{case.name} at {buf.num_nodes}x{rpn}")


@pytest.mark.parametrize("bias", ["none", "one", "pair"])
def test_combine_signed_zeros_nans_and_infinities_bit_exact(buffers, comm, bias):
    """Combine's node partials, read where they lie with one rank per node or summed at the forwarder with
    more, give the reference's bits where the returned rows hold -0.0, NaN and infinities, the weights -0.0 and
    the biases -0.0: two -0.0 biases start the origin's sum at -0.0, where an unrounded -0.0 row would keep the
    sign (docs/design/data-path.md, "Normal mode across nodes"). NaN compared by position."""
    R, r = comm.Get_size(), comm.Get_rank()
    for rpn in _node_sizes(R):
        buf = _buffer(buffers, rpn)
        gen = torch.Generator().manual_seed(31 + r)
        n, H, E, K = 16 - r % 3, 128, 4 * R, 3
        idx = make_topk_idx("uniform", n, E, K, r, R, gen)
        x = torch.randn(n, H, generator=gen).to(BF16)
        w = torch.rand(n, K, generator=gen)
        ntpr, ntprdma, ntpe, itr, _ = coll(lambda: buf.get_dispatch_layout(idx, E))
        recv_x, _, recv_w, _, handle, _ = coll(lambda: buf.dispatch(
            x, num_tokens_per_rank=ntpr, num_tokens_per_rdma_rank=ntprdma, is_token_in_rank=itr,
            num_tokens_per_expert=ntpe, topk_idx=idx, topk_weights=w))
        y = (recv_x.float() * (1 + r)).to(BF16)
        y[:, 0] = -0.0  # every row: -0.0 sums, started from -0.0 by two -0.0 biases
        y[:, 1] = -0.0
        y[::2, 2] = float("nan")
        y[::3, 3] = float("inf")
        y[1::3, 3] = float("-inf")  # inf + -inf where a token meets both
        y[:, 4] = float("inf") if r % 2 else 1.0
        weights = recv_w.clone()
        weights[:, 0] = -0.0
        biases = None
        if bias != "none":
            b0 = torch.randn(n, H, generator=gen).to(BF16)
            b0[:, :2] = -0.0
            biases = b0 if bias == "one" else (b0, b0.clone())
        combined, combined_w, _ = coll(lambda: buf.combine(y, handle, topk_weights=weights, bias=biases))
        want_x, want_w = ref_combine(gather_all(y), gather_all(itr), r, bias=biases,
                                     topk_weights=gather_all(weights), ranks_per_node=rpn)
        ok = same_bits_nan(combined, want_x) and same_bits_nan(combined_w, want_w)
        all_ranks_ok(comm, ok, f"rank {r}: combine at {R // rpn}x{rpn}, bias {bias}: bits differ from the reference")


def _two_nodes(comm):
    """ranks_per_node giving two nodes (None on one rank)."""
    R = comm.Get_size()
    return R // 2 if R >= 2 and R % 2 == 0 else None


@up_to_four_ranks()
def test_internode_many_round_trips_without_cleaning(buffers, comm):
    """200 round trips through the two-node split, nothing cleaned (``many_round_trips``)."""
    rpn = _two_nodes(comm)
    many_round_trips(_buffer(buffers, rpn), comm).finish("200 internode round trips")


# ----------------------------------------------------------------------------------------------
# payloads larger than the windows: many rounds


@up_to_four_ranks()
def test_small_windows_stream_in_rounds_with_identical_results(comm):
    """Windows a few rows big (far below the hints) give the reference results bit for bit, while
    taking many rounds (the signal count shows it); at every node split."""
    R = comm.Get_size()
    chk = Checker(comm.Get_rank())
    cases = [Case("stream_bf16", tokens=24, hidden=256, experts=16, topk=4, cached=True, bias="pair"),
             Case("stream_fp8_worst_async", tokens=8, hidden=256, experts=16, topk=4, x_kind="fp8", cached=True,
                  worst=True, use_async=True)]
    for rpn in _node_sizes(R):
        G = R // rpn
        signals = {}
        hint_nvl, hint_rdma = _hints(R, rpn, cases)
        # Dispatch boxes of 3 rows, combine staging of ~2 rows per origin (see internode.py's layout).
        row = 8 * 4 + 4 * 4 + 8 + 4 + 2 * 256 + rpn
        box = -(-(HDR + 8 * ((4 * (R + 16 + G) + 7) // 8) + 3 * row + 768) // 128) * 128
        small_rdma = 2 * G * box
        # (the staging holds the rows of the R - G origins of another local index: none with one rank per node)
        small_nvl = 2 * (-(-(1024 + 8 * R + 2 * (R - G) * (2 * 256 + 16)) // 128) * 128)
        assert 3 * small_rdma < hint_rdma and (R == G or 3 * small_nvl < hint_nvl), "test setup: windows too big"
        for name, (nvl, rdma) in (("hint", (hint_nvl, hint_rdma)), ("small", (small_nvl, small_rdma))):
            b = Buffer(None, nvl, rdma, comm=comm, explicitly_destroy=True, ranks_per_node=rpn)
            try:
                s0 = int(b.runtime.stats.signals.sum())
                for i, case in enumerate(cases):
                    run_case(b, comm, case, seed=700 + i, chk=chk)
                signals[name] = int(b.runtime.stats.signals.sum()) - s0
            finally:
                coll(b.destroy, what=f"destroy {name} buffer")
        chk.check(signals["small"] > 3 * signals["hint"], f"{G}x{rpn}: signals hint/small {signals}: the small "
                  f"windows did not stream in rounds")
    chk.finish("small windows")


# ----------------------------------------------------------------------------------------------
# traffic accounting vs hand-computed bytes


def test_traffic_matches_hand_computed_bytes_and_two_hop_dedup(buffers, comm):
    """Known routing at two nodes: every token of rank ``s = (a, l)`` goes to the two ranks ``(a+1, l)``
    and ``(a+1, l+1)`` of the other node (one rank if a node has one rank).

    Per transports' rule each transfer is counted once, by the rank that issues it:

    * dispatch, hop 1: one URMA put per round to the rail peer on the other node, holding an ``HDR``-byte
      header, the round-0 count vector ``4·(R + E + G)`` B (rounded up to 8) and one row per
      token **once** although it targets two ranks there: ``H·2 + 12·K + 4 + rpn`` B (x, top-k
      ids and weights, source index, target bitmask). The block for the own node (header and
      vector, no token) is a SELF put. Hop 2: the receiver ``(a+1, l)`` gathers its rows from
      itself (SELF), ``(a+1, l+1)`` from its node peer ``(a+1, l)`` (UBMEM), one row each.
    * cached dispatch: the same without the vector; rows of ``H·2 + rpn`` B.
    * combine: forwarder ``(a+1, l)`` reads both ranks' rows of the token (``2H + 4K`` B each,
      SELF and UBMEM), puts one partial row per token (``2H + 4K`` B) + header to the origin
      (URMA), and a header-only block to its own node (SELF).
    """
    rpn = _two_nodes(comm)
    buf = _buffer(buffers, rpn)
    r, R = comm.Get_rank(), comm.Get_size()
    G, E, K, H = 2, 2 * R, 2, 256
    chk = Checker(r)
    node, local = divmod(r, rpn)

    def targets(s):
        a, l_s = divmod(s, rpn)
        b = (a + 1) % G
        return b * rpn + l_s, b * rpn + (l_s + 1) % rpn

    def n_of(s):
        return 10 + s

    n = n_of(r)
    d0, d1 = targets(r)
    idx = torch.tensor([[2 * d0, 2 * d1 + 1]] * n, dtype=torch.int64)
    w = torch.rand(n, K)
    x = torch.randn(n, H).to(BF16)
    vec = 8 * -(-(4 * (R + E + G)) // 8)
    row = 2 * H + 12 * K + 4 + rpn
    crow = 2 * H + rpn
    prow = 2 * H + 4 * K
    # Who sends to me: s with targets(s)[0] == r (I forward and keep: SELF) or targets(s)[1] == r (UBMEM).
    src_self = [s for s in range(R) if targets(s)[0] == r]
    src_peer = [s for s in range(R) if targets(s)[1] == r and targets(s)[0] != r]
    rows_self = sum(n_of(s) for s in src_self)
    rows_peer = sum(n_of(s) for s in src_peer)
    e_disp = {"SELF": HDR + vec + rows_self * row, "UBMEM": rows_peer * row, "URMA": HDR + vec + n * row}
    e_cached = {"SELF": HDR + rows_self * crow, "UBMEM": rows_peer * crow, "URMA": HDR + n * crow}
    # Combine at forwarder r: it forwards tokens of its rail source s = (node-1, local) only.
    fwd_src = (r - rpn) % R
    fwd = n_of(fwd_src)
    own_rows = fwd  # r = targets(fwd_src)[0] always receives every forwarded token
    peer_rows = fwd if rpn > 1 else 0  # and (node, local+1) too, read over UBMEM
    e_comb = {"SELF": HDR + own_rows * prow, "UBMEM": peer_rows * prow, "URMA": HDR + fwd * prow}
    if rpn == 1:  # both experts on the one rank of the other node: same row counts, no UBMEM
        e_disp["UBMEM"] = e_cached["UBMEM"] = 0

    def go():
        ntpr, ntprdma, ntpe, itr, _ = buf.get_dispatch_layout(idx, E)
        out = buf.dispatch(x, num_tokens_per_rank=ntpr, num_tokens_per_rdma_rank=ntprdma, is_token_in_rank=itr,
                           num_tokens_per_expert=ntpe, topk_idx=idx, topk_weights=w)
        t_disp = buf.get_traffic()
        buf.dispatch(x, handle=out[4])
        t_cached = buf.get_traffic()
        buf.combine(out[0], out[4], topk_weights=out[2])
        return t_disp, t_cached, buf.get_traffic()

    t_disp, t_cached, t_comb = coll(go, what="traffic")
    chk.check(t_disp == e_disp, f"dispatch traffic {t_disp} != expected {e_disp}")
    chk.check(t_cached == e_cached, f"cached dispatch traffic {t_cached} != expected {e_cached}")
    chk.check(t_comb == e_comb, f"combine traffic {t_comb} != expected {e_comb}")
    # Two-hop dedup: URMA payload is once per (token, node); direct routing would send it once per rank.
    direct = n * len({d0, d1}) * row
    chk.check(t_disp["URMA"] - HDR - vec == direct // len({d0, d1}),
              f"URMA payload {t_disp['URMA'] - 128 - vec} B is not once per destination node")
    chk.finish("traffic")


# ----------------------------------------------------------------------------------------------
# errors


def test_bad_input_on_one_rank_raises_everywhere_and_buffer_stays_usable(buffers, comm):
    """Rank 1 passes float64 topk_weights: it raises its TypeError, every other rank (on any node) a
    ConsensusError naming rank 1, for dispatch and for combine; round trips work afterwards."""
    from deepep_ascend import ConsensusError
    from tests.support.buffer_helpers import capture, roundtrip_ok

    rpn = _two_nodes(comm)
    buf = _buffer(buffers, rpn)
    r, R = comm.Get_rank(), comm.Get_size()
    gen = torch.Generator().manual_seed(40 + r)
    idx = make_topk_idx("uniform", 8, 16, 2, r, R, gen)
    w = torch.rand(8, 2, generator=gen)
    x = torch.randn(8, 128, generator=gen).to(BF16)
    ntpr, ntprdma, ntpe, itr, _ = buf.get_dispatch_layout(idx, 16)
    kw = dict(num_tokens_per_rank=ntpr, num_tokens_per_rdma_rank=ntprdma, is_token_in_rank=itr,
              num_tokens_per_expert=ntpe, topk_idx=idx)
    _, exc = capture(lambda: buf.dispatch(x, topk_weights=w.double() if r == 1 else w, **kw))
    errors = []
    want = TypeError if r == 1 else ConsensusError
    if not isinstance(exc, want) or (r != 1 and "rank 1" not in str(exc)):
        errors.append(f"dispatch: expected {want.__name__}, got {exc!r}")
    out, exc = capture(lambda: buf.dispatch(x, topk_weights=w, **kw))
    if exc is None:
        y = out[0]
        _, exc2 = capture(lambda: buf.combine(y.float() if r == 1 else y, out[4]))
        if not isinstance(exc2, want) or (r != 1 and "rank 1" not in str(exc2)):
            errors.append(f"combine: expected {want.__name__}, got {exc2!r}")
    else:
        errors.append(f"good dispatch failed: {exc!r}")
    errors += roundtrip_ok(buf, comm, seed=r)
    assert not errors, f"rank {r}: " + "; ".join(errors)


def test_nodes_disagreeing_in_combine_refused_everywhere(buffers, comm):
    """Each node agrees within itself, the nodes not with each other: the first node combines dispatch A's
    handle while the second combines B's (same row counts), then hidden sizes, then weights given or not.
    Every rank raises a ``ConsensusError`` before any row moves, and round trips work afterwards."""
    from deepep_ascend import ConsensusError
    from tests.support.buffer_helpers import capture, roundtrip_ok

    rpn = _two_nodes(comm)
    buf = _buffer(buffers, rpn)
    r, R = comm.Get_rank(), comm.Get_size()
    first = r < rpn
    E, n, hidden = 2 * R, 4, 128
    x = (torch.arange(n, dtype=torch.float32).view(n, 1) + 10 * r + 1).expand(n, hidden).to(BF16).contiguous()
    w = torch.full((n, 1), 0.5)

    def dispatch(shift):  # token t -> rank (t + shift) % R: the same counts for every shift
        idx = torch.tensor([[((t + shift) % R) * (E // R)] for t in range(n)])
        lay = buf.get_dispatch_layout(idx, E)
        return buf.dispatch(x, num_tokens_per_rank=lay[0], num_tokens_per_rdma_rank=lay[1], is_token_in_rank=lay[3],
                            num_tokens_per_expert=lay[2], topk_idx=idx, topk_weights=w)

    a, b = coll(lambda: dispatch(0), what="dispatch A"), coll(lambda: dispatch(1), what="dispatch B")
    cases = {
        "handles": lambda: buf.combine(*((a[0], a[4]) if first else (b[0], b[4]))),
        "hidden": lambda: buf.combine(torch.cat([a[0], a[0]], 1) if first else a[0], a[4]),
        "weights given or not": lambda: buf.combine(a[0], a[4], topk_weights=a[2] if first else None),
    }
    errors = []
    for what, call in cases.items():
        _, exc = capture(call)
        if not isinstance(exc, ConsensusError) or "disagree" not in str(exc):
            errors.append(f"{what}: expected a ConsensusError, got {exc!r}")
    errors += roundtrip_ok(buf, comm, seed=r)
    all_ranks_ok(comm, not errors, f"rank {r}: " + "; ".join(errors))


@pytest.mark.parametrize("op", ["dispatch", "combine"])
@up_to_four_ranks()
def test_rank_on_another_node_missing_times_out_naming_it(comm, op):
    """The last rank (last node) skips the call: every other rank raises a TimeoutError whose
    ``pending_peers`` is exactly ``[it]`` — on its node, across the URMA link, and on ranks that
    only waited for a node peer blocked on it (the transport follows such chains through the
    peers' published waiting-for words) — within timeout_s=2; then all destroy cleanly."""
    from tests.support.buffer_helpers import all_ranks_ok, capture

    rpn = _two_nodes(comm)
    r, R = comm.Get_rank(), comm.Get_size()
    missing = R - 1
    b = Buffer(None, 1 << 18, 1 << 18, comm=comm, explicitly_destroy=True, timeout_s=2, ranks_per_node=rpn)
    gen = torch.Generator().manual_seed(99 + r)
    idx = make_topk_idx("uniform", 8, 16, 2, r, R, gen)
    w, x = torch.rand(8, 2, generator=gen), torch.randn(8, 128, generator=gen).to(BF16)
    ntpr, ntprdma, ntpe, itr, _ = b.get_dispatch_layout(idx, 16)

    def dispatch():
        return b.dispatch(x, num_tokens_per_rank=ntpr, num_tokens_per_rdma_rank=ntprdma, is_token_in_rank=itr,
                          num_tokens_per_expert=ntpe, topk_idx=idx, topk_weights=w)

    if op == "combine":
        comm.Barrier()
        recv_x, _, _, _, handle, _ = coll(dispatch, what="good dispatch before the missing combine")
        call = lambda: b.combine(recv_x, handle)  # noqa: E731
    else:
        call = dispatch
    ok, detail = True, ""
    if r != missing:
        _, exc = capture(call)
        ok = isinstance(exc, TimeoutError) and getattr(exc, "pending_peers", None) == [missing]
        detail = f"rank {r} got {type(exc).__name__}: {exc}"
        exc = None
    comm.Barrier()
    _, dexc = capture(b.destroy)
    all_ranks_ok(comm, ok and dexc is None, f"{op} with rank {missing} missing: {detail}; destroy: {dexc!r}")


def test_windows_too_small_for_headers_raise_clearly_everywhere(comm):
    """A URMA window whose node boxes cannot hold a header and an error message: every rank raises
    a ValueError naming both size hints before anything moves (it once raised an out-of-range put
    from the rejection path itself); the Buffer still destroys cleanly."""
    from tests.support.buffer_helpers import all_ranks_ok, capture

    rpn = _two_nodes(comm)
    r, R = comm.Get_rank(), comm.Get_size()
    b = Buffer(None, 8192, 1024, comm=comm, explicitly_destroy=True, ranks_per_node=rpn)
    gen = torch.Generator().manual_seed(11 + r)
    idx = make_topk_idx("uniform", 4, 16, 2, r, R, gen)
    ntpr, ntprdma, ntpe, itr, _ = b.get_dispatch_layout(idx, 16)
    _, exc = capture(lambda: b.dispatch(torch.randn(4, 64).to(BF16), num_tokens_per_rank=ntpr,
                                        num_tokens_per_rdma_rank=ntprdma, is_token_in_rank=itr,
                                        num_tokens_per_expert=ntpe, topk_idx=idx, topk_weights=torch.rand(4, 2)))
    ok = isinstance(exc, ValueError) and "get_normal_rdma_buffer_size_hint" in str(exc)
    _, dexc = capture(b.destroy)
    all_ranks_ok(comm, ok and dexc is None, f"tiny windows: expected ValueError naming the hints, got {exc!r}; "
                                            f"destroy: {dexc!r}")


def test_one_low_latency_buffer_serves_both_modes_across_nodes(comm):
    """DeepEP's ``test_internode.py`` builds one ``Buffer(group, nvl, rdma, low_latency_mode=True)`` and runs the
    internode normal calls, then ``clean_low_latency_buffer`` and the low-latency calls on it: both modes
    give the reference's results, in either order."""
    rpn = _two_nodes(comm)
    if rpn is None:
        pytest.skip("needs an even number of ranks, at least two")
    r, R = comm.Get_rank(), comm.Get_size()
    M, H, E = 8, 128, 2 * R
    cases = [CASES[0], CASES[2]]
    nvl, rdma = _hints(R, rpn, cases)
    rdma = max(rdma, Buffer.get_low_latency_rdma_size_hint(M, H, R, E))
    b = coll(lambda: Buffer(None, nvl, rdma, low_latency_mode=True, comm=comm, explicitly_destroy=True,
                            ranks_per_node=rpn), what="Buffer()")
    try:
        assert b.num_nodes == 2
        run_case(b, comm, cases[0], seed=11).finish("normal calls on a low-latency Buffer across nodes")

        def low_latency_round_trip(seed):
            g = torch.Generator().manual_seed(seed * 7919 + r)
            x = torch.randint(-8, 9, (M, H), generator=g).to(BF16)
            idx = make_topk_idx("uniform", M, E, 2, r, R, g)
            w = torch.ones(M, 2)
            recv, _, handle, _, _ = b.low_latency_dispatch(x, idx, M, E, use_fp8=False)
            combined, _, _ = b.low_latency_combine(recv, idx, w, handle)
            # every live slot returns the token's row once, weight 1: small integers, so exact
            return torch.equal(combined.float(), x.float() * (idx >= 0).sum(1, keepdim=True))

        b.clean_low_latency_buffer(M, H, E)
        ok = all(low_latency_round_trip(seed) for seed in range(3))
        all_ranks_ok(comm, ok, "low-latency calls after normal calls on one Buffer across nodes")
        run_case(b, comm, cases[1], seed=12).finish("normal calls after low-latency calls on the same Buffer")
    finally:
        coll(b.destroy, what="destroy")


def test_internode_dispatch_and_combine_entry_points(buffers, comm):
    """DeepEP 2.1.0's ``internode_dispatch`` / ``internode_combine`` give what ``dispatch`` / ``combine`` give."""
    rpn = _two_nodes(comm)
    if rpn is None:
        pytest.skip("needs an even number of ranks, at least two")
    buf = _buffer(buffers, rpn)
    r, R = comm.Get_rank(), comm.Get_size()
    g = torch.Generator().manual_seed(r)
    idx = torch.randint(-1, 4 * R, (12, 3), generator=g)
    x = torch.randn(12, 128, generator=g).to(BF16)
    w = torch.rand(12, 3, generator=g)

    def run(dispatch, combine):
        ntpr, ntprdma, ntpe, itr, _ = buf.get_dispatch_layout(idx, 4 * R)
        recv_x, _, _, _, handle, _ = dispatch(x, num_tokens_per_rank=ntpr, num_tokens_per_rdma_rank=ntprdma,
                                              is_token_in_rank=itr, num_tokens_per_expert=ntpe, topk_idx=idx,
                                              topk_weights=w)
        return recv_x, combine(recv_x, handle)[0]

    want = coll(lambda: run(buf.dispatch, buf.combine))
    got = coll(lambda: run(buf.internode_dispatch, buf.internode_combine))
    all_ranks_ok(comm, torch.equal(want[0], got[0]) and torch.equal(want[1], got[1]),
                 "internode_dispatch / internode_combine against dispatch / combine")
