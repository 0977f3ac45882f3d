"""``deepep_ascend.nn.autograd``: differentiable dispatch/combine against the pure-torch reference.

Data are small integers (``x``, gradients) and quarter-integers (weights), so every sum is exact
in bf16/float32 and forward and backward are compared **bit for bit** with ``tests/support/reference.py``
(the backward of dispatch is a combine of the gradients, the backward of combine a dispatch of
them: the reference computes both from every rank's gathered tensors). Routing: uniform with
-1 slots, and skewed (every token to one rank's experts, so the other ranks receive nothing);
with more than one rank, the last rank has no tokens at all.

Low-latency pair (end of file): gradients against a dense float64 ``torch.autograd`` model of the
same math built on one process from every rank's gathered inputs (exact with integer-valued
data; ``calc_diff`` / tolerance with normal data).

Both pairs: the adjoint identity ``Σ <op(v), u> == Σ <v, grad_v>`` of each op's backward against
its own forward (no reference involved), exact with integer data.
"""

from __future__ import annotations

import pytest
import torch

from deepep_ascend import Buffer
from deepep_ascend.nn import autograd as ag
from tests.support.buffer_helpers import (
    BF16,
    Checker,
    all_ranks_ok,
    capture,
    coll,
    make_topk_idx,
)
from tests.support.mpi_utils import gather_all, world
from tests.support.reference import (
    calc_diff,
    ref_combine,
    ref_dispatch,
    ref_ll_dispatch,
)

pytestmark = [pytest.mark.mpi(min_size=1), pytest.mark.watchdog(120)]

E, K, H = 16, 3, 32


@pytest.fixture(scope="module")
def buf(buffers):
    return buffers(Buffer.get_normal_buffer_size_hint(24, H, world().Get_size(), K, E))


def _ints(shape, lo, hi, gen, dtype=torch.float32):
    return torch.randint(lo, hi, shape, generator=gen).to(dtype)


def _masked(w, idx):
    return torch.where(idx >= 0, w, torch.zeros_like(w))


@pytest.mark.parametrize("routing", ["uniform", "skewed", "dup"])
def test_dispatch_combine_grads_exact(buf, comm, routing):
    """Forward outputs and the gradients of x and topk_weights, through dispatch → expert (a power-of-two
    scale per rank) → combine with and without weights, equal the reference bit for bit; a rank with no
    tokens (sent or received) gets zero-size / zero gradients, never None."""
    r, R = comm.Get_rank(), comm.Get_size()
    n = 0 if (R > 1 and r == R - 1) else 9 + 2 * r
    gen = torch.Generator().manual_seed(77 + r)
    idx = make_topk_idx(routing, n, E, K, r, R, gen)
    x0 = _ints((n, H), -4, 5, gen, BF16)
    w0 = _ints((n, K), 1, 8, gen) / 4
    scale = 2.0 ** (r % 3 - 1)
    rows_max = 24 * R
    A = _ints((rows_max, H), -3, 4, gen)  # d loss / d recv_x (direct term)
    B = _ints((rows_max, K), -3, 4, gen) / 4  # d loss / d recv_topk_weights (direct term)
    C = _ints((n, H), -3, 4, gen)  # d loss / d combined_x
    D = _ints((n, K), -3, 4, gen) / 4  # d loss / d combined_topk_weights

    def run():
        x = x0.clone().requires_grad_(True)
        w = w0.clone().requires_grad_(True)
        recv_x, recv_idx, recv_w, counts, handle = ag.dispatch(buf, x, idx, w, E)
        m = recv_x.size(0)
        y = (recv_x.float() * scale).to(BF16)
        combined, combined_w = ag.combine(buf, y, handle, topk_weights=recv_w)
        loss = ((recv_x.float() * A[:m]).sum() + (recv_w * B[:m]).sum()
                + (combined.float() * C).sum() + (combined_w * D).sum())
        loss.backward()
        return x, w, recv_x, recv_idx, recv_w, counts, handle, combined, combined_w

    x, w, recv_x, recv_idx, recv_w, counts, handle, combined, combined_w = coll(run, what="autograd round trip")
    chk = Checker(r)
    xs, idxs, ws = gather_all(x0), gather_all(idx), gather_all(w0)
    itrs = gather_all(handle[4])
    refs = [ref_dispatch(xs, idxs, ws, E, s) for s in range(R)]
    ref = refs[r]
    chk.same_bits(recv_x.detach(), ref.recv_x, "recv_x")
    chk.same_bits(recv_idx, ref.recv_topk_idx, "recv_topk_idx")
    chk.same_bits(recv_w.detach(), ref.recv_topk_weights, "recv_topk_weights")
    chk.check(counts == ref.num_recv_tokens_per_expert_list, "num_recv_tokens_per_expert_list")
    scales = [2.0 ** (s % 3 - 1) for s in range(R)]
    outs = [(refs[s].recv_x.float() * scales[s]).to(BF16) for s in range(R)]
    e_comb, e_cw = ref_combine(outs, itrs, r, topk_weights=[refs[s].recv_topk_weights for s in range(R)])
    chk.same_bits(combined.detach(), e_comb, "combined_x")
    chk.same_bits(combined_w.detach(), e_cw, "combined_topk_weights")
    # Backward. Receiver s: d recv_x = A + scale_s * (cached dispatch of bf16(C)); d recv_w = B + dispatch of D.
    Cs, Ds = gather_all(C.to(BF16)), gather_all(D)
    g_rx, g_rw = [], []
    for s in range(R):
        m = refs[s].num_recv_tokens
        A_s, B_s = comm.bcast((A, B) if r == s else None, root=s)  # rank s's direct gradient terms
        disp_c = ref_dispatch(Cs, idxs, None, E, s).recv_x.float()
        disp_d = ref_dispatch(Ds, idxs, None, E, s).recv_x
        g_rx.append(A_s[:m] + (disp_c * scales[s]).to(BF16).float())
        g_rw.append(_masked(B_s[:m] + disp_d, refs[s].recv_topk_idx))
    e_gx, e_gw = ref_combine([g.to(BF16) for g in g_rx], itrs, r, topk_weights=g_rw)
    chk.check(x.grad is not None and w.grad is not None, "a gradient is None")
    chk.same_bits(x.grad, e_gx, "x.grad")
    chk.same_bits(w.grad, e_gw, "topk_weights.grad")
    all_ranks_ok(comm, not chk.errors, f"rank {r}: " + "; ".join(chk.errors[:8]))


def test_cached_dispatch_and_plain_combine(buf, comm):
    """dispatch(handle=...) (cached, no top-k) and combine without weights: exact adjoints of each other."""
    r, R = comm.Get_rank(), comm.Get_size()
    n = 6 + r
    gen = torch.Generator().manual_seed(5 + r)
    idx = make_topk_idx("uniform", n, E, K, r, R, gen)
    x0 = _ints((n, H), -4, 5, gen, BF16)
    g0 = _ints((n, H), -2, 3, gen, BF16)

    def run():
        _, _, _, _, handle = ag.dispatch(buf, x0, idx, torch.ones(n, K), E)
        x = g0.clone().requires_grad_(True)
        recv, ridx, rw, counts, h2 = ag.dispatch(buf, x, None, None, None, handle=handle)
        assert h2 is handle
        out, cw = ag.combine(buf, recv, handle)
        (out.float() * 1.0).sum().backward()
        return handle, x, recv, ridx, rw, counts, h2, cw

    handle, x, recv, ridx, rw, counts, h2, cw = coll(run, what="cached dispatch under autograd")
    chk = Checker(r)
    itrs, idxs = gather_all(handle[4]), gather_all(idx)
    chk.check(ridx is None and rw is None and counts is None and cw is None, "cached outputs must be None")
    chk.same_bits(recv.detach(), ref_dispatch(gather_all(g0), idxs, None, E, r).recv_x, "cached recv_x")
    # d/dx of sum(combine(dispatch(x))) = (ranks reached) per row, via combine then dispatch of ones.
    reached = itrs[r].sum(1, keepdim=True).to(torch.float32)
    chk.same_bits(x.grad, (torch.ones(n, H) * reached).to(BF16), "x.grad = ranks reached")
    all_ranks_ok(comm, not chk.errors, f"rank {r}: " + "; ".join(chk.errors[:8]))


def test_refuses_non_bf16_and_async(buf):
    """float32 / FP8 x and async keywords are refused (on every rank, in the call's first round) before data moves."""
    x = torch.zeros(2, H)
    idx = torch.zeros(2, K, dtype=torch.int64)
    with pytest.raises(TypeError, match="bfloat16"):
        ag.dispatch(buf, x, idx, torch.ones(2, K), E)
    with pytest.raises(TypeError, match="not differentiable"):
        ag.dispatch(buf, (x.to(torch.float8_e4m3fn), torch.ones(2, 1)), idx, torch.ones(2, K), E)
    with pytest.raises(TypeError, match="unsupported keyword"):
        ag.dispatch(buf, x.to(BF16), idx, torch.ones(2, K), E, async_finish=True)
    with pytest.raises(TypeError, match="bfloat16"):
        ag.combine(buf, x, None)
    with pytest.raises(ValueError, match="`topk_idx` has 1 rows, `x` has 2 tokens"):  # not the internal layout
        ag.dispatch(buf, x.to(BF16), idx[:1], torch.ones(1, K), E)


# ----------------------------------------------------------------------------------------------
# low-latency pair

LL_M = 12  # num_max_dispatch_tokens_per_rank


@pytest.fixture(scope="module")
def ll_buf(buffers):
    return buffers.low_latency(LL_M, H, E)


def _ll_dense_reference(xs, idxs, ws, As, Cs, scales, R, L):
    """float64 autograd model: slot (s, t, j) -> expert g = idx_s[t, j] on rank d = g // L, row p of
    local expert e (sources ascending, then tokens); loss = sum(A_d[e, p] * x_s[t]) +
    sum_t C_s[t] * sum_j w_s[t, j] * scale_g * x_s[t]. Returns the gradients of every rank's x and w."""
    X = [x.double().requires_grad_(True) for x in xs]
    W = [w.double().requires_grad_(True) for w in ws]
    rows = [[0] * L for _ in range(R)]  # next row per (d, e)
    loss = torch.zeros((), dtype=torch.float64)
    for g in range(R * L):
        d, e = divmod(g, L)
        for s in range(R):
            for t, j in (idxs[s] == g).nonzero().tolist():
                p = rows[d][e]
                rows[d][e] += 1
                loss = loss + (As[d][e, p].double() * X[s][t]).sum()
                loss = loss + (Cs[s][t].double() * X[s][t]).sum() * W[s][t, j] * scales[g]
    loss.backward()
    return ([v.grad if v.grad is not None else torch.zeros_like(v) for v in X],
            [v.grad if v.grad is not None else torch.zeros_like(v) for v in W])


@pytest.mark.parametrize("routing,wgrad,data", [("uniform", True, "ints"), ("skewed", True, "ints"),
                                                ("uniform", False, "ints"), ("uniform", True, "normal"),
                                                ("dup", True, "ints")])
def test_ll_dispatch_combine_grads(ll_buf, comm, routing, wgrad, data):
    """LL dispatch -> expert (a power-of-two scale per expert) -> LL combine: forward outputs and the
    gradients of x and topk_weights against the dense float64 model, bit for bit with integer data
    (every intermediate exact), within bf16 tolerance with normal data. The last rank (R > 1) has no
    tokens and gets zero-size gradients; without weight gradients the third backward call is skipped."""
    r, R = comm.Get_rank(), comm.Get_size()
    L = E // R
    n = 0 if (R > 1 and r == R - 1) else min(LL_M, 7 + r)
    gen = torch.Generator().manual_seed(311 + r)
    idx = make_topk_idx(routing, n, E, K, r, R, gen)
    if data == "ints":  # magnitudes keep every bf16 value exact (see the module docstring)
        x0 = _ints((n, H), -4, 5, gen, BF16)
        w0 = _ints((n, K), 1, 5, gen) / 4
        A = _ints((L, R * LL_M, H), -2, 3, gen)  # d loss / d recv_x (direct term, padding rows too)
        C = _ints((n, H), -2, 3, gen)  # d loss / d combined_x
    else:
        x0 = torch.randn(n, H, generator=gen).to(BF16)
        w0 = torch.rand(n, K, generator=gen)
        A = torch.randn(L, R * LL_M, H, generator=gen).to(BF16).float()
        C = torch.randn(n, H, generator=gen).to(BF16).float()
    scales = [2.0 ** (g % 3 - 1) for g in range(E)]
    my_scales = torch.tensor(scales[r * L:(r + 1) * L]).view(L, 1, 1)

    def run():
        x = x0.clone().requires_grad_(True)
        w = w0.clone().requires_grad_(wgrad)
        recv_x, count, handle = ag.low_latency_dispatch(ll_buf, x, idx, LL_M, E, use_fp8=False)
        rf = recv_x.float()
        y = (rf * my_scales).to(BF16)
        out = ag.low_latency_combine(ll_buf, y, idx, w, handle)
        ((rf * A).sum() + (out.float() * C).sum()).backward()
        return x, w, recv_x, count, out

    x, w, recv_x, count, out = coll(run, what="LL autograd round trip")
    chk = Checker(r)
    xs, idxs, ws = gather_all(x0), gather_all(idx), gather_all(w0)
    As, Cs = gather_all(A), gather_all(C)
    ref = ref_ll_dispatch(xs, idxs, r, E, LL_M)
    chk.same_bits(recv_x.detach(), ref.recv_x, "recv_x")
    chk.same_bits(count, ref.recv_count, "recv_count")
    gX, gW = _ll_dense_reference(xs, idxs, ws, As, Cs, scales, R, L)
    # Forward combine: float32 sum of f32(y) * w in top-k order, one rounding.
    exp_out = torch.zeros(n, H)
    for t, j in (idx >= 0).nonzero().tolist():
        g = int(idx[t, j])
        exp_out[t] += (x0[t].float() * scales[g]).to(BF16).float() * w0[t, j]
    chk.same_bits(out.detach(), exp_out.to(BF16), "combined_x")
    chk.check(x.grad is not None and x.grad.dtype == BF16 and x.grad.shape == (n, H), "x.grad dtype/shape")
    if data == "ints":
        chk.check(lambda: torch.equal(x.grad.double(), gX[r]), "x.grad != dense reference")
    elif n:
        chk.check(lambda: calc_diff(x.grad, gX[r]) < 1e-4, "x.grad: calc_diff >= 1e-4")
    if wgrad:
        chk.check(w.grad is not None and w.grad.dtype == torch.float32, "w.grad dtype")
        if data == "ints":
            chk.check(lambda: torch.equal(w.grad.double(), gW[r]), "topk_weights.grad != dense reference")
        else:  # f32 dot of the same bf16 rows vs float64: summation rounding only (a lost mid/lo part: 4e-3)
            chk.check(lambda: torch.allclose(w.grad.double(), gW[r], rtol=1e-5, atol=1e-5),
                      "topk_weights.grad: not within 1e-5 of the dense reference")
        chk.check(lambda: bool((w.grad[idx < 0] == 0).all()), "w.grad of -1 slots must be 0")
    else:
        chk.check(w.grad is None, "w.grad must stay None")
    all_ranks_ok(comm, not chk.errors, f"rank {r}: " + "; ".join(chk.errors[:8]))


def _dot(a, b) -> float:
    return float((a.detach().double() * b.detach().double()).sum())


@pytest.mark.parametrize("routing", ["uniform", "dup"])
@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_backward_is_the_adjoint_of_forward(buf, ll_buf, comm, mode, routing):
    """Gradcheck-style, without a reference: each op's backward is the adjoint of its own forward.
    Dispatch and combine are linear, so for a loss ``<op(v), u>`` autograd's ``grad_v`` must satisfy
    ``Σ_ranks <op(v), u> == Σ_ranks <v, grad_v>``; LL combine is bilinear in ``(y, w)``, so
    ``<out, g> == <y, y.grad> == <w, w.grad>``; normal combine carries weights linearly too.
    Integer-valued data: every value and sum is exact, so the identities hold exactly. Uniform
    routing with -1 slots, and the same with an expert listed two or three times in a row
    (docs/semantics/deepep-api.md §0); the last rank (R > 1) has no tokens."""
    r, R = comm.Get_rank(), comm.Get_size()
    ll = mode == "low_latency"
    n = 0 if (R > 1 and r == R - 1) else min(LL_M, 5 + r)
    gen = torch.Generator().manual_seed(41 + r)
    idx = make_topk_idx(routing, n, E, K, r, R, gen)
    x = _ints((n, H), -4, 5, gen, BF16).requires_grad_(True)
    w = (_ints((n, K), 1, 5, gen) / 4).requires_grad_(True)

    def run():
        sums = {}
        if ll:  # dispatch: x -> packed rows
            recv_x, _, handle = ag.low_latency_dispatch(ll_buf, x, idx, LL_M, E, use_fp8=False)
            A = _ints(tuple(recv_x.shape), -3, 4, gen)
            (recv_x.float() * A).sum().backward()
            sums["dispatch"] = (_dot(recv_x, A), _dot(x, x.grad))
            # combine: bilinear in (packed y, w)
            y = _ints(tuple(recv_x.shape), -3, 4, gen, BF16).requires_grad_(True)
            out = ag.low_latency_combine(ll_buf, y, idx, w, handle)
            G = _ints((n, H), -2, 3, gen)
            (out.float() * G).sum().backward()
            sums["combine"] = (_dot(out, G), _dot(y, y.grad))
            sums["combine weights"] = (_dot(out, G), _dot(w, w.grad))
        else:  # dispatch: (x, w) -> (recv_x, recv_w)
            recv_x, _, recv_w, _, handle = ag.dispatch(buf, x, idx, w, E)
            A = _ints(tuple(recv_x.shape), -3, 4, gen)
            B = _ints(tuple(recv_w.shape), -3, 4, gen) / 4
            ((recv_x.float() * A).sum() + (recv_w * B).sum()).backward()
            sums["dispatch"] = (_dot(recv_x, A) + _dot(recv_w, B), _dot(x, x.grad) + _dot(w, w.grad))
            # combine: (y, v) -> (out, combined v), linear
            y = _ints(tuple(recv_x.shape), -3, 4, gen, BF16).requires_grad_(True)
            v = (_ints(tuple(recv_w.shape), -3, 4, gen) / 4).requires_grad_(True)
            out, out_v = ag.combine(buf, y, handle, topk_weights=v)
            G, D = _ints((n, H), -2, 3, gen), _ints((n, K), -2, 3, gen) / 4
            ((out.float() * G).sum() + (out_v * D).sum()).backward()
            sums["combine"] = (_dot(out, G) + _dot(out_v, D), _dot(y, y.grad) + _dot(v, v.grad))
        return sums

    sums = coll(run, what=f"{mode} adjoint round trip")
    totals = {k: (comm.allreduce(a), comm.allreduce(b)) for k, (a, b) in sorted(sums.items())}
    bad = {k: t for k, t in totals.items() if t[0] != t[1]}
    all_ranks_ok(comm, not bad, f"<op(v), u> != <v, grad_v> (sums over ranks): {bad}")


def test_ll_split3_is_exact():
    """The weight gradient's float32 -> three bf16 parts split sums back exactly (local)."""
    gen = torch.Generator().manual_seed(3)
    v = torch.randn(4096, generator=gen) * torch.pow(2.0, torch.randint(-90, 90, (4096,), generator=gen).float())
    v = torch.cat([v, torch.tensor([0.0, -0.0, 1.0, -3.0, 65504.0, 1e30, 1.0000001, 2.0 ** -100])])
    hi, mid, lo = ag._split3(v)
    assert torch.equal((hi.float() + mid.float()) + lo.float(), v)


def test_ll_refusals(ll_buf):
    """FP8 or non-bf16 x requiring grad, async keywords, zero_copy/out: refused on every rank before data moves."""
    x = torch.zeros(2, H, dtype=BF16, requires_grad=True)
    idx = torch.zeros(2, K, dtype=torch.int64)
    with pytest.raises(TypeError, match="use_fp8=False"):
        ag.low_latency_dispatch(ll_buf, x, idx, LL_M, E)
    with pytest.raises(TypeError, match="bfloat16"):
        ag.low_latency_dispatch(ll_buf, torch.zeros(2, H, requires_grad=True), idx, LL_M, E, use_fp8=False)
    with pytest.raises(TypeError, match="unsupported keyword"):
        ag.low_latency_dispatch(ll_buf, x, idx, LL_M, E, use_fp8=False, return_recv_hook=True)
    with pytest.raises(TypeError, match="unsupported keyword"):
        ag.low_latency_combine(ll_buf, x, idx, torch.ones(2, K), None, zero_copy=True)
    with pytest.raises(TypeError, match="bfloat16"):
        ag.low_latency_combine(ll_buf, torch.zeros(2, H), idx, torch.ones(2, K), None)


def test_ll_one_rank_refusal_raises_on_every_rank(ll_buf, comm):
    """use_fp8=True with grad, or float32 x to the combine, on rank 0 only: rank 0 raises its TypeError, every
    other rank a ConsensusError naming it (no wait); the next LL dispatch runs on every rank."""
    from deepep_ascend import ConsensusError

    r = comm.Get_rank()
    bad = r == 0
    x = torch.ones(2, H, dtype=BF16, requires_grad=True)
    idx = torch.full((2, K), -1, dtype=torch.int64)
    idx[:, 0] = 0  # one slot per token, on expert 0 (rank 0)
    recv_x, _, handle = ag.low_latency_dispatch(ll_buf, x, idx, LL_M, E, use_fp8=False)
    cases = [("low_latency_dispatch", lambda: ag.low_latency_dispatch(ll_buf, x, idx, LL_M, E, use_fp8=bad)),
             ("low_latency_combine", lambda: ag.low_latency_combine(
                 ll_buf, recv_x.float() if bad else recv_x, idx, torch.ones(2, K), handle))]
    problems = []
    for name, call in cases:
        try:
            call()
            problems.append(f"{name}: no error")
        except Exception as exc:  # noqa: BLE001 - the type is the assertion
            if not (isinstance(exc, TypeError) if bad else isinstance(exc, ConsensusError) and "rank 0" in str(exc)):
                problems.append(f"{name}: raised {type(exc).__name__}: {exc}")
    recv_x, count, _ = ag.low_latency_dispatch(ll_buf, x, idx, LL_M, E, use_fp8=False)
    if int(count.sum()) != (2 * comm.Get_size() if r == 0 else 0):
        problems.append(f"the next dispatch received {count.tolist()}")
    all_ranks_ok(comm, not problems, f"rank {r}: " + "; ".join(problems))


def test_ll_backward_refuses_ranks_of_different_top_k(ll_buf, comm):
    """The plain low-latency calls take a top-k per rank, and so does the autograd forward; the backward reads every
    source's weight rows by one top-k, so ranks of K=3 and K=4 (silently wrong weights otherwise) raise a
    ConsensusError on every rank saying the top-k differ, with each rank's width of the weight rows (4K: H=12,
    H=16). The buffer stays usable."""
    from deepep_ascend import ConsensusError

    r, R = comm.Get_rank(), comm.Get_size()
    if R == 1:
        pytest.skip("needs two ranks")
    k = 3 if r == 0 else 4
    gen = torch.Generator().manual_seed(67 + r)
    idx = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(4)])
    x = torch.randn(4, H, generator=gen).to(BF16).requires_grad_(True)
    w = torch.rand(4, k, generator=gen, requires_grad=True)
    recv_x, _, handle = coll(lambda: ag.low_latency_dispatch(ll_buf, x, idx, LL_M, E, use_fp8=False))
    out = coll(lambda: ag.low_latency_combine(ll_buf, recv_x, idx, w, handle))
    _, exc = capture(lambda: out.float().sum().backward())
    text = str(exc)
    ok = isinstance(exc, ConsensusError) and "top-k differ" in text and "H=12" in text and "H=16" in text
    _, count, _ = coll(lambda: ag.low_latency_dispatch(ll_buf, x.detach(), idx, LL_M, E, use_fp8=False))
    all_ranks_ok(comm, ok and int(count.sum()) >= 0, f"rank {r}: the backward raised {exc!r}")


def test_ll_backward_on_a_buffer_too_small_for_its_narrow_calls(buffers, comm):
    """A low-latency Buffer sized by its own hint for H=8, and top-8 routing: the forward fits, the backward's
    weight-row dispatch (4K = 32 columns) does not. Every rank raises a ValueError in the backward's first call that
    names the size and MoE.get_low_latency_rdma_size_hint, and the Buffer stays usable: a round trip after it
    returns x · Σw."""
    r = comm.Get_rank()
    h, k, m = 8, 8, 4
    small = buffers.low_latency(m, h, E)
    gen = torch.Generator().manual_seed(71 + r)
    idx = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(3)])
    x = _ints((3, h), -4, 5, gen, BF16).requires_grad_(True)
    w = (_ints((3, k), 1, 5, gen) / 4).requires_grad_(True)
    recv_x, _, handle = coll(lambda: ag.low_latency_dispatch(small, x, idx, m, E, use_fp8=False))
    out = coll(lambda: ag.low_latency_combine(small, recv_x, idx, w, handle))
    _, exc = capture(lambda: out.float().sum().backward())
    text = str(exc)
    problems = []
    if not (type(exc) is ValueError and f"rank {r}:" in text and "H=32" in text
            and "MoE.get_low_latency_rdma_size_hint" in text):
        problems.append(f"the backward raised {exc!r}")
    with torch.no_grad():
        recv_x, _, handle = coll(lambda: ag.low_latency_dispatch(small, x.detach(), idx, m, E, use_fp8=False),
                                 what="LL dispatch after the refused backward")
        combined = coll(lambda: ag.low_latency_combine(small, recv_x, idx, w.detach(), handle))
    want = (x.detach().float() * w.detach().sum(1, keepdim=True)).to(BF16)
    if not torch.equal(combined, want):
        problems.append(f"round trip after the refusal: {calc_diff(combined, want)}")
    all_ranks_ok(comm, not problems, f"rank {r}: " + "; ".join(problems))


def test_ll_plain_sum_loss_with_a_rank_without_tokens(ll_buf, comm):
    """``combined.sum().backward()``: autograd hands the LL combine's backward an expanded
    (stride-0) gradient, which on the rank with no tokens is a zero-row tensor that ``contiguous()``
    leaves at stride 0 (it once crashed the dispatch inside backward). Identity experts, integer
    data: ``x.grad[t] = sum of its valid weights``, ``w.grad[t, j] = sum of x[t]`` (0 for -1 slots)."""
    r, R = comm.Get_rank(), comm.Get_size()
    n = 0 if (R > 1 and r == R - 1) else 5
    gen = torch.Generator().manual_seed(53 + r)
    idx = make_topk_idx("uniform", n, E, K, r, R, gen)
    x0 = _ints((n, H), -4, 5, gen, BF16)
    w0 = _ints((n, K), 1, 5, gen) / 4

    def run():
        x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        recv_x, _, handle = ag.low_latency_dispatch(ll_buf, x, idx, LL_M, E, use_fp8=False)
        ag.low_latency_combine(ll_buf, recv_x, idx, w, handle).sum().backward()
        return x.grad, w.grad

    gx, gw = coll(run, what="LL round trip, sum() loss")
    valid = idx >= 0
    want_gx = (w0 * valid).sum(1, keepdim=True).expand(n, H).to(BF16)
    want_gw = x0.float().sum(1, keepdim=True).expand(n, K) * valid
    ok = gx.shape == (n, H) and torch.equal(gx, want_gx) and torch.equal(gw, want_gw)
    all_ranks_ok(comm, ok, f"rank {r}: x.grad {gx.shape} / w.grad differ from sum(w) / sum(x)")


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_second_order_gradients_raise(buf, ll_buf, comm, mode):
    """``create_graph=True`` first-order gradients equal the plain ones; differentiating them again through the
    dispatch / combine pair raises ``RuntimeError`` on every rank instead of silently dropping that path (here a
    residual ``y = combine(dispatch(x)) + x`` keeps the gradient differentiable)."""
    r, R = comm.Get_rank(), comm.Get_size()
    gen = torch.Generator().manual_seed(61 + r)
    n = 6
    idx = make_topk_idx("uniform", n, E, K, r, R, gen)
    x0 = torch.randn(n, H, generator=gen)
    w0 = torch.rand(n, K, generator=gen)

    def grads(create_graph):
        x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        if mode == "normal":
            recv_x, _, recv_w, _, handle = ag.dispatch(buf, x.to(BF16), idx, w, E)
            out, _ = ag.combine(buf, recv_x, handle)
        else:
            recv_x, _, handle = ag.low_latency_dispatch(ll_buf, x.to(BF16), idx, LL_M, E, use_fp8=False)
            out = ag.low_latency_combine(ll_buf, recv_x, idx, w, handle)
        loss = ((out.float() + x) ** 2).sum()
        return x, torch.autograd.grad(loss, x, create_graph=create_graph)[0]

    _, plain = coll(lambda: grads(False), what="first-order gradient")
    x, g = coll(lambda: grads(True), what="first-order gradient, create_graph=True")
    _, exc = capture(lambda: torch.autograd.grad(g.sum(), x))
    ok = torch.equal(g.detach(), plain) and isinstance(exc, RuntimeError) and "first-order" in str(exc)
    all_ranks_ok(comm, ok, f"rank {r}: equal first-order {torch.equal(g.detach(), plain)}, second order: {exc!r}")


def test_ll_second_order_through_the_saved_inputs_raises(ll_buf, comm):
    """The LL combine's backward depends on its saved rows and weights, so a loss linear in its output still
    has second-order terms there: ``grad(grad(out.sum(), w, create_graph=True).sum(), x)`` raises
    ``RuntimeError`` on every rank instead of returning a gradient without them."""
    r, R = comm.Get_rank(), comm.Get_size()
    gen = torch.Generator().manual_seed(67 + r)
    n = 6
    idx = make_topk_idx("uniform", n, E, K, r, R, gen)
    x = torch.randn(n, H, generator=gen).requires_grad_(True)
    w = torch.rand(n, K, generator=gen).requires_grad_(True)

    def first():
        recv_x, _, handle = ag.low_latency_dispatch(ll_buf, x.to(BF16), idx, LL_M, E, use_fp8=False)
        out = ag.low_latency_combine(ll_buf, recv_x, idx, w, handle)
        return torch.autograd.grad(out.float().sum(), w, create_graph=True)[0]

    gw = coll(first, what="first-order weight gradient, create_graph=True")
    _, exc = capture(lambda: torch.autograd.grad(gw.sum(), x))
    all_ranks_ok(comm, isinstance(exc, RuntimeError) and "first-order" in str(exc), f"rank {r}: {exc!r}")


@pytest.mark.mpi(min_size=2)
def test_a_backward_failing_between_its_calls_fails_the_peers_at_once(comm, monkeypatch):
    """The LL combine's backward makes three collective calls with work of its own between them. If that
    work raises on one rank (here: injected into its slot check after the first call), the peers are already
    in the next call: the rank aborts the Buffer, so they raise ``TransportAborted`` naming it and its reason
    within seconds, not after the 30 s deadline, and every rank can still destroy the Buffer."""
    import time

    from deepep_ascend.transports import TransportAborted

    r, R = comm.Get_rank(), comm.Get_size()
    last = R - 1
    buf = coll(lambda: Buffer(None, 0, Buffer.get_low_latency_rdma_size_hint(LL_M, H, R, E), low_latency_mode=True,
                              comm=world(), explicitly_destroy=True, timeout_s=30.0), what="LL Buffer")
    try:
        gen = torch.Generator().manual_seed(71 + r)
        idx = make_topk_idx("uniform", 4, E, K, r, R, gen)
        x = _ints((4, H), -4, 5, gen, BF16).requires_grad_(True)
        w = (_ints((4, K), 1, 5, gen) / 4).requires_grad_(True)
        recv_x, _, handle = coll(lambda: ag.low_latency_dispatch(buf, x, idx, LL_M, E, use_fp8=False),
                                 what="LL dispatch")
        out = coll(lambda: ag.low_latency_combine(buf, recv_x, idx, w, handle), what="LL combine")
        if r == last:
            def broken(*args, **kwargs):
                raise RuntimeError("injected backward failure")
            monkeypatch.setattr(ag, "_ll_same_slots", broken)
        t0 = time.perf_counter()
        _, exc = capture(lambda: out.sum().backward())
        took = time.perf_counter() - t0
        if r == last:
            ok = isinstance(exc, RuntimeError) and "injected backward failure" in str(exc)
        else:
            ok = (isinstance(exc, TransportAborted) and f"rank {last}" in str(exc)
                  and "injected backward failure" in str(exc) and took < 10.0)
        all_ranks_ok(comm, ok, f"rank {r}: {exc!r} after {took:.1f} s")
    finally:
        coll(buf.destroy, what="destroy after the failure")
