"""MegaMoE (``deepep_ascend.mega_moe``, mega-moe.md) against the single-process reference.

Every rank generates *all* experts' weights from one seed (untransformed, so the reference sees
them as mega-moe.md §2 states them), keeps its local slice, transforms it and calls the op; the
inputs (``x``, ``x_sf``, ``topk_idx``, ``topk_weights``) are all-gathered and
``reference.ref_mega_moe`` computes every rank's ``y`` in plain torch. Tolerances (§2):
``calc_diff < 1e-6`` (bf16) and ``< 1e-5`` (fp8×fp4). Token counts differ per rank and the last
rank of a multi-rank job has none; 20 % of slots are masked; routing is skewed (the last
``E/4`` experts receive nothing, a token may list an expert twice).

Overlap is checked by structure, never by time: the trace of a multi-wave call must show the
next wave's dispatch issued between this wave's L1 and L2 and each combine issued before the next
wave's L1 (so the worker has that communication in flight while the caller computes).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import deepep_ascend as dea
from deepep_ascend import ConsensusError
from tests.support.buffer_helpers import all_ranks_ok, capture, coll
from tests.support.mpi_utils import allgather_object, gather_all, world
from tests.support.reference import (
    mega_calc_diff,
    mega_dequant_fp4_weights,
    ref_mega_moe,
)

pytestmark = [pytest.mark.mpi(min_size=1), pytest.mark.watchdog(240)]

E_PER_RANK, K, TMAX = 4, 3, 40
H_BF16, I_BF16 = 64, 32
H_FP8, I_FP8 = 128, 128
BF16 = torch.bfloat16


def _num_tokens(rank, size):
    if size > 1 and rank == size - 1:
        return 0
    return 17 + 7 * rank


def _routing(gen, t, num_experts):
    """Skewed: the last quarter of experts gets nothing; 20 % masked; duplicates allowed."""
    hot = max(1, num_experts - num_experts // 4)
    idx = torch.randint(0, hot, (t, K), generator=gen)
    idx[torch.rand(t, K, generator=gen) < 0.2] = -1
    w = torch.rand(t, K, generator=gen) + 0.25
    w[idx < 0] = 1e6  # ignored where idx = -1
    return idx, w


def _weights(kind, num_experts, hidden, inter, seed, width=None):
    """All experts' weights: (op weights of all experts, float32 untransformed for the reference)."""
    g = torch.Generator().manual_seed(seed)
    n1 = 2 * (width or inter)
    if kind == "bf16":
        w1 = (torch.randn(num_experts, n1, hidden, generator=g) / hidden ** 0.5).to(BF16)
        w2 = (torch.randn(num_experts, hidden, n1 // 2, generator=g) / inter ** 0.5).to(BF16)
        return (w1, w2), (w1.float(), w2.float())
    out, ref = [], []
    for n, k in ((n1, hidden), (hidden, n1 // 2)):
        data = torch.randint(-128, 128, (num_experts, n, k // 2), generator=g, dtype=torch.int8)
        sf_bytes = torch.randint(121, 125, (num_experts, n, k // 32), generator=g, dtype=torch.uint8)
        sf = sf_bytes.view(torch.int32)  # [E, n, k/128], four little-endian bytes per int
        out.append((data, sf))
        ref.append(mega_dequant_fp4_weights(data, sf))
    return tuple(out), tuple(ref)


def _local(kind, w, rank, el):
    sl = slice(rank * el, (rank + 1) * el)
    if kind == "bf16":
        return w[0][sl].contiguous(), w[1][sl].contiguous()
    mn = [dea.transform_sf_into_required_layout(s[sl].contiguous(), s.shape[1], 2 * d.shape[2],
                                                (1, 32), num_groups=el)
          for d, s in w]
    return (w[0][0][sl].contiguous(), mn[0]), (w[1][0][sl].contiguous(), mn[1])


def _shared(kind, hidden, inter, s, seed):
    (w1, w2), (r1, r2) = _weights(kind, 1, hidden, inter, seed, width=s * inter)
    if kind == "bf16":
        return (w1[0], w2[0]), (r1[0], r2[0])
    return ((w1[0][0], w1[1][0]), (w2[0][0], w2[1][0])), (r1[0], r2[0])


class _Env:
    """A symmetric buffer per (kind, shared), built once per module."""

    def __init__(self):
        self.bufs = {}

    def get(self, kind, shared, backend=None):
        key = (kind, shared, backend)
        if key not in self.bufs:
            comm = world()
            h, i = (H_BF16, I_BF16) if kind == "bf16" else (H_FP8, I_FP8)
            self.bufs[key] = coll(dea.get_symm_buffer_for_mega_moe, comm, E_PER_RANK * comm.Get_size(), TMAX, K, h,
                                  i, mma_type="bf16xbf16" if kind == "bf16" else "fp8xfp4",
                                  num_shared_experts=shared, backend=backend, what="get_symm_buffer_for_mega_moe")
        return self.bufs[key]


@pytest.fixture(scope="module")
def env():
    e = _Env()
    yield e
    for b in e.bufs.values():
        coll(b.destroy, what="destroy")


def _fill(kind, buf, seed, rank, size):
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    t = _num_tokens(rank, size)
    h = buf.hidden
    if kind == "bf16":
        buf.x[:t] = torch.randn(t, h, generator=g).to(BF16)
        x_sf = None
    else:
        buf.x[:t] = (torch.randn(t, h, generator=g) * 3).clamp(-448, 448).to(torch.float8_e4m3fn)
        x_sf = torch.randint(124, 130, (t, h // 32), generator=g, dtype=torch.uint8).view(torch.int32)
        buf.x_sf[:t] = x_sf
    idx, w = _routing(g, t, buf.num_experts)
    buf.topk_idx[:t] = idx
    buf.topk_weights[:t] = w
    return t


def _gathered_inputs(buf, t, fp8):
    xs = gather_all(buf.x[:t])
    sfs = gather_all(buf.x_sf[:t]) if fp8 else [None] * len(xs)
    return xs, sfs, gather_all(buf.topk_idx[:t]), gather_all(buf.topk_weights[:t])


def _call(kind, y, l1, l2, buf, stats=None, **kw):
    fn = dea.bf16_mega_moe if kind == "bf16" else dea.fp8_fp4_mega_moe
    return fn(y, l1, l2, buf, stats, **kw)


CASES = [  # (kind, clamp, shared experts, experts per wave: None = the library's default)
    ("bf16", None, 0, 1),
    ("bf16", 0.75, 1, None),
    ("fp8", None, 1, 3),
    ("fp8", 10.0, 0, 1),
]


@pytest.mark.parametrize("backend", ["shm", "buffer"])
@pytest.mark.parametrize("kind,clamp,shared,epw", CASES, ids=[f"{k}-clamp{c}-shared{s}-epw{e}" for k, c, s, e in CASES])
def test_matches_reference(env, comm, kind, clamp, shared, epw, backend):
    rank, size = comm.Get_rank(), comm.Get_size()
    buf = env.get(kind, shared, backend)
    assert buf.backend == backend
    el, h, i = buf.num_local_experts, buf.hidden, buf.intermediate_hidden
    w, wref = _weights(kind, buf.num_experts, h, i, seed=7)
    l1, l2 = dea.transform_weights_for_mega_moe(*_local(kind, w, rank, el))
    kw = {}
    sref = None
    if shared:
        (s1, s2), sref = _shared(kind, h, i, shared, seed=11)
        kw = dict(shared_l1_weights=s1, shared_l2_weights=s2)
    t = _fill(kind, buf, seed=3, rank=rank, size=size)
    stats0 = torch.randint(0, 100, (el,), dtype=torch.int32)
    stats = stats0.clone()
    y = torch.full((t, h), float("nan"), dtype=BF16)
    coll(_call, kind, y, l1, l2, buf, stats, activation_clamp=clamp, num_experts_per_wave=epw, **kw,
         what=f"{kind}_mega_moe")
    xs, sfs, idxs, wts = _gathered_inputs(buf, t, kind == "fp8")
    exp = ref_mega_moe(xs, sfs, idxs, wts, *wref, clamp=clamp, shared=sref, ranks=[rank])[rank]
    diff = mega_calc_diff(y.float(), exp.float())
    tol = 1e-6 if kind == "bf16" else 1e-5
    all_idx = torch.cat(idxs).reshape(-1)
    exp_stats = stats0 + torch.bincount(all_idx[all_idx >= 0], minlength=buf.num_experts)[
        rank * el:(rank + 1) * el].to(torch.int32)
    masked_rows = (buf.topk_idx[:t] < 0).all(1) if not shared else torch.zeros(t, dtype=torch.bool)
    ok = (not torch.isnan(y.float()).any() and diff < tol and torch.equal(stats, exp_stats)
          and bool((y[masked_rows] == 0).all()))
    all_ranks_ok(comm, ok, f"{kind} clamp={clamp} shared={shared}: calc_diff {diff:.3g} (tol {tol}), "
                           f"stats {stats.tolist()} vs {exp_stats.tolist()}")
    if clamp is not None:  # the clamp must matter for these inputs
        y2 = torch.empty_like(y)
        coll(_call, kind, y2, l1, l2, buf, None, activation_clamp=None, **kw, what="unclamped")
        exp2 = ref_mega_moe(xs, sfs, idxs, wts, *wref, clamp=None, shared=sref, ranks=[rank])[rank]
        changed = comm.allreduce(int(not torch.equal(exp2, exp)))
        all_ranks_ok(comm, mega_calc_diff(y2.float(), exp2.float()) < tol and changed > 0,
                     "unclamped call / clamp has an effect somewhere")


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_fused_equals_unfused_and_repeatable(env, comm, kind):
    """Same waves with synchronous communication (overlap=False) give the same y bit for bit; so does a rerun,
    and so does the other backend (same rows in the same order per expert GEMM, same final sum)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    ys = []
    for backend, overlap in (("shm", True), ("shm", False), ("shm", True), ("buffer", True), ("buffer", False)):
        buf = env.get(kind, 0, backend)
        w, _ = _weights(kind, buf.num_experts, buf.hidden, buf.intermediate_hidden, seed=5)
        l1, l2 = dea.transform_weights_for_mega_moe(*_local(kind, w, rank, buf.num_local_experts))
        t = _fill(kind, buf, seed=9, rank=rank, size=size)
        y = torch.empty(t, buf.hidden, dtype=BF16)
        coll(_call, kind, y, l1, l2, buf, None, overlap=overlap, num_experts_per_wave=1, what="mega_moe")
        assert buf.last_trace.backend == backend
        ys.append(y)
    all_ranks_ok(comm, all(torch.equal(ys[0].view(torch.int16), y.view(torch.int16)) for y in ys[1:]),
                 "fused == unfused == rerun, on both backends")


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_weights_written_in_place_are_seen_by_the_next_call(env, comm, kind):
    """The op caches un-transformed (and oneDNN-packed) weights by tensor identity and version: negating
    the L1 weights in place between two calls must change y to the reference of the negated weights."""
    rank, size = comm.Get_rank(), comm.Get_size()
    buf = env.get(kind, 0)
    w, (r1, r2) = _weights(kind, buf.num_experts, buf.hidden, buf.intermediate_hidden, seed=13)
    l1, l2 = dea.transform_weights_for_mega_moe(*_local(kind, w, rank, buf.num_local_experts))
    t = _fill(kind, buf, seed=4, rank=rank, size=size)
    xs, sfs, idxs, wts = _gathered_inputs(buf, t, kind == "fp8")
    tol = 1e-6 if kind == "bf16" else 1e-5
    ys = []
    for w1_ref in (r1, -r1):
        y = torch.empty(t, buf.hidden, dtype=BF16)
        coll(_call, kind, y, l1, l2, buf, None, what="mega_moe")
        exp = ref_mega_moe(xs, sfs, idxs, wts, w1_ref, r2, ranks=[rank])[rank]
        all_ranks_ok(comm, mega_calc_diff(y.float(), exp.float()) < tol, f"{kind}: y vs the reference")
        ys.append(y)
        if kind == "bf16":
            l1.neg_()
        else:
            l1[0].bitwise_xor_(-0x78)  # 0x88: the sign bit of both FP4 nibbles of every byte
    all_ranks_ok(comm, t == 0 or not torch.equal(ys[0], ys[1]), f"{kind}: the second call used the new weights")


@pytest.mark.parametrize("backend", ["shm", "buffer"])
def test_overlap_structure(env, comm, backend):
    """Trace order of a 4-wave call: the worker has wave w+1's dispatch in flight during wave w's SwiGLU/L2
    (issued after L1(w), before SwiGLU(w)); Buffer backend: combine(w) queued before L1(w+1) starts; shm
    backend: one combine (the barrier before the final sum) after the last L2; every worker marker fired."""
    rank, size = comm.Get_rank(), comm.Get_size()
    buf = env.get("bf16", 0, backend)
    w, _ = _weights("bf16", buf.num_experts, buf.hidden, buf.intermediate_hidden, seed=5)
    l1, l2 = dea.transform_weights_for_mega_moe(*_local("bf16", w, rank, buf.num_local_experts))
    t = _fill("bf16", buf, seed=2, rank=rank, size=size)
    y = torch.empty(t, buf.hidden, dtype=BF16)
    coll(dea.bf16_mega_moe, y, l1, l2, buf, num_experts_per_wave=1, what="bf16_mega_moe")
    tr = buf.last_trace
    comp = {(s, wv): (a, b) for s, wv, a, b in tr.compute}
    disp = {wv: c for c in tr.comm if c[0] == "dispatch" for wv in [c[1]]}
    comb = {wv: c for c in tr.comm if c[0] == "combine" for wv in [c[1]]}
    n = tr.num_waves
    ok = n == buf.num_local_experts == 4 and sorted(disp) == list(range(n)) and tr.backend == backend
    if backend == "shm":
        ok = ok and sorted(comb) == [-1] and comp[("l2", n - 1)][1] <= comb[-1][2]
    else:
        ok = ok and sorted(comb) == list(range(n))
    for wv in range(n - 1):
        ok = ok and comp[("l1", wv)][1] <= disp[wv + 1][2] and disp[wv + 1][3] <= comp[("act", wv)][0]
        if backend == "shm":  # the pull's own end mark comes before its result (the Buffer's marker may not)
            ok = ok and disp[wv + 1][5] <= comp[("l1", wv + 1)][0]
        else:
            ok = ok and comb[wv][3] <= comp[("l1", wv + 1)][0]
    ok = ok and all(c[5] == c[5] and c[5] >= c[4] >= c[3] for c in tr.comm)  # markers fired (not NaN), in order
    ov = tr.overlap()
    ok = ok and 0.0 <= ov["fraction"] <= 1.0 and ov["hidden"] <= ov["worker_busy"] + 1e-9
    all_ranks_ok(comm, ok, f"pipeline structure (trace {tr})")


def test_transform_order():
    """Upstream's order, shapes, dtypes and containers; MN-major scales."""
    e, h, i = 2, 128, 128
    l1 = torch.arange(e * 2 * i, dtype=torch.float32).view(e, 2 * i, 1).expand(e, 2 * i, 8).to(BF16).contiguous()
    l2 = torch.zeros(e, 8, i, dtype=BF16)
    t1, t2 = dea.transform_weights_for_mega_moe(l1, l2)
    assert t1.shape == l1.shape and t1.dtype == BF16 and t2 is l2
    rows = t1[0, :, 0].float().long().tolist()
    assert rows[:32] == list(range(8)) + list(range(i, i + 8)) + list(range(8, 16)) + list(range(i + 8, i + 16))
    d1 = torch.arange(e * 2 * i, dtype=torch.int64).remainder(128).to(torch.int8).view(e, 2 * i, 1).expand(
        e, 2 * i, h // 2).contiguous()
    s1 = torch.arange(e * 2 * i, dtype=torch.int32).view(e, 2 * i, 1).expand(e, 2 * i, h // 128).contiguous()
    d2 = torch.zeros(e, h, i // 2, dtype=torch.int8)
    s2 = torch.arange(e * h, dtype=torch.int32).view(e, h, 1).contiguous()
    (td1, ts1), (td2, ts2) = dea.transform_weights_for_mega_moe((d1, s1), (d2, s2))
    assert td1.shape == d1.shape and td1.dtype == torch.int8 and td2 is d2
    assert ts1.shape == s1.shape and ts1.dtype == torch.int32 and ts1.stride(-2) == 1
    assert ts2.shape == s2.shape and ts2.stride(-2) == 1
    inter = [r for b in range(i // 8) for r in (list(range(8 * b, 8 * b + 8)) + list(range(i + 8 * b, i + 8 * b + 8)))]
    assert td1[0, :, 0].tolist() == [r % 128 for r in inter]
    for p in range(2 * i):  # new row 4j+i of each 128-group holds old (interleaved) row 32i+j
        g, loc = divmod(p, 128)
        assert int(ts1[0, p, 0]) == inter[128 * g + 32 * (loc % 4) + loc // 4]
    assert [int(v) for v in ts2[1, :8, 0]] == [h + 32 * (q % 4) + q // 4 for q in range(8)]


def test_constructor_checks(comm):
    """mega-moe.md §1.1 asserts, raised identically on every rank before anything collective."""
    size = comm.Get_size()
    bad = [dict(hidden=100), dict(intermediate_hidden=100), dict(num_topk=33), dict(activation="gelu"),
           dict(mma_type="fp16"), dict(use_fp8_dispatch=False), dict(mma_type="bf16xbf16", intermediate_hidden=12)]
    if size > 1:
        bad.append(dict(num_experts=size + 1))
    for over in bad:
        args = dict(num_experts=4 * size, num_max_tokens_per_rank=8, num_topk=2, hidden=128, intermediate_hidden=128)
        args.update(over)
        with pytest.warns(DeprecationWarning) if "use_fp8_dispatch" in over else _nullctx():
            _, exc = capture(lambda args=args: dea.get_symm_buffer_for_mega_moe(comm, **args))
        assert isinstance(exc, AssertionError), (over, exc)


@pytest.mark.mpi(min_size=2)
def test_constructor_arguments_must_agree_across_ranks(comm):
    """Ranks passing different arguments all raise ``ConsensusError`` naming the argument and each rank's value
    (found by a helper: a different num_experts built a buffer whose first call failed deep inside, a different
    intermediate_hidden was never noticed, the others failed on a window size); a rank whose own arguments fail
    the checks raises its ``AssertionError`` and the others a ``ConsensusError`` naming it, instead of waiting."""
    rank, size = comm.Get_rank(), comm.Get_size()
    last = size - 1
    base = dict(num_experts=4 * size, num_max_tokens_per_rank=8, num_topk=2, hidden=128, intermediate_hidden=128,
                mma_type="bf16xbf16")
    for name, other in (("num_experts", 8 * size), ("intermediate_hidden", 256), ("hidden", 256), ("num_topk", 3),
                        ("mma_type", "fp8xfp4")):
        args = dict(base, **({name: other} if rank == last else {}))
        _, exc = capture(lambda args=args: dea.get_symm_buffer_for_mega_moe(comm, **args))
        want = f"rank {last}: {other!r}"
        all_ranks_ok(comm, isinstance(exc, ConsensusError) and f"disagree on {name}" in str(exc) and want in str(exc),
                     f"{name} differs on rank {last}: {exc!r}")
    _, exc = capture(lambda: dea.get_symm_buffer_for_mega_moe(comm, **dict(base, hidden=100 if rank == last else 128,
                                                                            mma_type="fp8xfp4")))
    if rank == last:
        ok = isinstance(exc, AssertionError) and "hidden (100)" in str(exc)
    else:
        ok = isinstance(exc, ConsensusError) and f"rejected on rank(s) [{last}]" in str(exc)
    all_ranks_ok(comm, ok, f"bad hidden on rank {last} only: {exc!r}")
    # the same values spelled otherwise are the same arguments: True is 1, capacities 8 and 300 both hold 384 rows
    spelled = dict(base, num_topk=True if rank == last else 1, num_max_tokens_per_rank=300 if rank == last else 8)
    buf = coll(dea.get_symm_buffer_for_mega_moe, comm, **spelled, what="equal values spelled otherwise")
    coll(buf.destroy, what="destroy")
    buf = coll(dea.get_symm_buffer_for_mega_moe, comm, **base, what="the same arguments afterwards")
    coll(buf.destroy, what="destroy")


class _nullctx:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def test_capacity_rounding(env):
    buf = env.get("bf16", 0)
    assert buf.num_max_tokens_per_rank == 384 and buf.x.shape == (384, H_BF16) and buf.topk_idx.dtype == torch.int64
    assert buf.buffer.dtype == torch.int8 and buf.x.untyped_storage().data_ptr() == buf.buffer.untyped_storage().data_ptr()
    fbuf = env.get("fp8", 0)
    assert fbuf.x.dtype == torch.float8_e4m3fn and fbuf.x_sf.shape == (384, H_FP8 // 128)
    assert fbuf.x_sf.dtype == torch.int32 and fbuf.topk_weights.dtype == torch.float32


def _expect_everywhere(comm, fn, bad_rank, exc_type, what):
    """``fn`` must raise on every rank: ``exc_type`` on ``bad_rank`` (all ranks if None), ConsensusError elsewhere."""
    _, exc = capture(fn)
    me = comm.Get_rank()
    if bad_rank is None or bad_rank == me:
        ok = isinstance(exc, exc_type)
    else:
        ok = isinstance(exc, ConsensusError) and f"rank(s) [{bad_rank}]" in str(exc)
    all_ranks_ok(comm, ok, f"{what}: got {type(exc).__name__}: {exc}")


@pytest.mark.parametrize("backend", ["shm", "buffer"])
def test_errors_on_every_rank(env, comm, backend):
    rank, size = comm.Get_rank(), comm.Get_size()
    last = size - 1
    buf = env.get("bf16", 0, backend)
    el, h, i = buf.num_local_experts, buf.hidden, buf.intermediate_hidden
    w, wref = _weights("bf16", buf.num_experts, h, i, seed=7)
    l1, l2 = dea.transform_weights_for_mega_moe(*_local("bf16", w, rank, el))
    t = _fill("bf16", buf, seed=4, rank=rank, size=size)
    y = torch.empty(t, h, dtype=BF16)
    call = dea.bf16_mega_moe
    # mismatched weight shapes (every rank)
    _expect_everywhere(comm, lambda: call(y, l1[:, :, :h - 8].contiguous(), l2, buf), None, ValueError,
                       "l1 hidden mismatch")
    _expect_everywhere(comm, lambda: call(y, l1[:el - 1].contiguous(), l2[:el - 1].contiguous(), buf), None,
                       ValueError, "local expert count")
    # wrong dtype on the last rank only
    bad_l2 = l2.float() if rank == last else l2
    _expect_everywhere(comm, lambda: call(y, l1, bad_l2, buf), last, TypeError, "l2 dtype on the last rank")
    # tokens beyond num_max_tokens_per_rank on rank 0 only
    big = torch.empty(buf.num_max_tokens_per_rank + 1, h, dtype=BF16) if rank == 0 else y
    _expect_everywhere(comm, lambda: call(big, l1, l2, buf), 0, ValueError, "too many tokens on rank 0")
    # weights with the right dtype and shape but no CPU data: a meta tensor, a sparse one (found by a helper:
    # they passed the checks, so the bad rank failed after the others had agreed and they waited out the deadline)
    _expect_everywhere(comm, lambda: call(y, l1.to("meta") if rank == last else l1, l2, buf), last, ValueError,
                       "meta l1 on the last rank")
    _expect_everywhere(comm, lambda: call(y, l1, l2.to_sparse() if rank == last else l2, buf), last, ValueError,
                       "sparse l2 on the last rank")
    # wrong y dtype, bad expert ids on the last rank
    _expect_everywhere(comm, lambda: call(y.float() if rank == last else y, l1, l2, buf), last, TypeError, "y dtype")
    saved = buf.topk_idx[0].clone()
    if rank == last:
        buf.topk_idx[0, 0] = buf.num_experts
    yy = torch.empty(max(t, 1) if rank == last else t, h, dtype=BF16)
    _expect_everywhere(comm, lambda: call(yy, l1, l2, buf), last, ValueError, "expert id out of range")
    buf.topk_idx[0] = saved
    # the fp8 op on a bf16 buffer, a wrong recipe, bf16 weights to the fp8 op, stats of the wrong shape
    _expect_everywhere(comm, lambda: dea.fp8_fp4_mega_moe(y, l1, l2, buf), None, ValueError, "fp8 op, bf16 buffer")
    fbuf = env.get("fp8", 0, backend)
    fw, _ = _weights("fp8", fbuf.num_experts, H_FP8, I_FP8, seed=1)
    f1, f2 = dea.transform_weights_for_mega_moe(*_local("fp8", fw, rank, el))
    fy = torch.empty(0, H_FP8, dtype=BF16)
    _expect_everywhere(comm, lambda: dea.fp8_fp4_mega_moe(fy, f1, f2, fbuf, recipe=(1, 128, 128)), None, ValueError,
                       "recipe")
    _expect_everywhere(comm, lambda: dea.fp8_fp4_mega_moe(fy, (f1[0].view(torch.uint8), f1[1]), f2, fbuf), None,
                       TypeError, "fp4 data dtype")
    _expect_everywhere(comm, lambda: dea.fp8_fp4_mega_moe(fy, (f1[0].to("meta"), f1[1]) if rank == last else f1, f2,
                                                          fbuf), last, ValueError, "meta fp4 data on the last rank")
    _expect_everywhere(comm, lambda: call(y, l1, l2, buf, torch.zeros(el + 1, dtype=torch.int32)), None, ValueError,
                       "stats shape")
    _expect_everywhere(comm, lambda: call(y, l1, l2, buf, shared_l1_weights=l1[0]), None, ValueError,
                       "shared weights without shared experts")
    # wave sizes: a bad one on the last rank, then ranks asking for different ones (every rank: ValueError)
    _expect_everywhere(comm, lambda: call(y, l1, l2, buf, num_experts_per_wave=0 if rank == last else 1), last,
                       ValueError, "num_experts_per_wave 0 on the last rank")
    if size > 1:
        _, exc = capture(lambda: call(y, l1, l2, buf, num_experts_per_wave=1 if rank == 0 else 2))
        all_ranks_ok(comm, isinstance(exc, ValueError) and "disagree on num_experts_per_wave" in str(exc)
                     and "rank 0: 1" in str(exc) and "rank 1: 2" in str(exc), f"mismatched wave sizes: {exc!r}")
        # the clamp and fast_math act on every rank's tokens: ranks must agree (found by a helper: rank 0's
        # output silently took rank 1's clamp)
        _, exc = capture(lambda: call(y, l1, l2, buf, activation_clamp=10.0 if rank == 0 else None))
        all_ranks_ok(comm, isinstance(exc, ValueError) and "disagree on activation_clamp" in str(exc)
                     and "rank 0: 10.0" in str(exc) and "rank 1: None" in str(exc), f"mismatched clamps: {exc!r}")
        _, exc = capture(lambda: call(y, l1, l2, buf, fast_math=rank != 0))
        all_ranks_ok(comm, isinstance(exc, ValueError) and "disagree on fast_math" in str(exc),
                     f"mismatched fast_math: {exc!r}")
        # values and messages the shm consensus must carry as they are (found by a helper: a wave size past
        # float64's range, or an error text with a lone surrogate, raised before its barrier and left the
        # ranks a call apart, which later calls took for agreement, silently mixing calls)
        _, exc = capture(lambda: call(y, l1, l2, buf, num_experts_per_wave=10 ** 400 if rank == 0 else 1))
        all_ranks_ok(comm, isinstance(exc, ValueError) and "disagree on num_experts_per_wave" in str(exc)
                     and f"rank 0: {10 ** 400}" in str(exc), f"a wave size past float64: {exc!r}")

        class Odd:
            def __repr__(self):
                return "caf\udce9" + "x" * 5000  # a lone surrogate, and longer than the shm record's 2000 chars

        _, exc = capture(lambda: call(y, l1, l2, buf, activation_clamp=Odd() if rank == 0 else None))
        ok = isinstance(exc, ValueError) and ("activation_clamp" in str(exc) if rank == 0 else
                                             isinstance(exc, ConsensusError) and "rank(s) [0]" in str(exc))
        all_ranks_ok(comm, ok, f"an error text with a surrogate: {type(exc).__name__}")
        # numbers of other types that mean the same are the same (numpy scalars, 1 for True)
        np_kw = dict(activation_clamp=np.float32(10.0), num_experts_per_wave=np.int64(1), fast_math=1) if rank == 0 \
            else dict(activation_clamp=10, num_experts_per_wave=1, fast_math=True)
        coll(call, y, l1, l2, buf, **np_kw, what="equal settings spelled otherwise")
    # transform rejects sizes its layout cannot take
    _, exc = capture(lambda: dea.transform_weights_for_mega_moe(torch.zeros(1, 12, 8, dtype=BF16),
                                                                torch.zeros(1, 8, 6, dtype=BF16)))
    assert isinstance(exc, ValueError), exc
    # the buffer still works after all that
    stats = torch.zeros(el, dtype=torch.int32)
    coll(call, y, l1, l2, buf, stats, what="after errors")
    xs, sfs, idxs, wts = _gathered_inputs(buf, t, False)
    exp = ref_mega_moe(xs, sfs, idxs, wts, *wref, ranks=[rank])[rank]
    all_ranks_ok(comm, mega_calc_diff(y.float(), exp.float()) < 1e-6, "call after rejected calls")


def test_process_group(comm):
    """``group`` may be a torch ProcessGroup (gloo, initialised from the MPI launch)."""
    import torch.distributed as tdist

    from deepep_ascend.nn import dist as ep_dist

    if not tdist.is_initialized():
        coll(ep_dist.init_distributed, what="init_distributed")
    rank, size = comm.Get_rank(), comm.Get_size()
    group = tdist.new_group(list(range(size)))
    buf = coll(dea.get_symm_buffer_for_mega_moe, group, 2 * size, 8, 2, 64, 16, mma_type="bf16xbf16",
               what="symm buffer on a ProcessGroup")
    try:
        w, wref = _weights("bf16", 2 * size, 64, 16, seed=3)
        l1, l2 = dea.transform_weights_for_mega_moe(w[0][2 * rank:2 * rank + 2], w[1][2 * rank:2 * rank + 2])
        g = torch.Generator().manual_seed(rank)
        t = 5
        buf.x[:t] = torch.randn(t, 64, generator=g).to(BF16)
        buf.topk_idx[:t] = torch.randint(0, 2 * size, (t, 2), generator=g)
        buf.topk_weights[:t] = torch.rand(t, 2, generator=g)
        y = torch.empty(t, 64, dtype=BF16)
        coll(dea.bf16_mega_moe, y, l1, l2, buf, what="bf16_mega_moe on a ProcessGroup")
        xs, sfs, idxs, wts = _gathered_inputs(buf, t, False)
        exp = ref_mega_moe(xs, sfs, idxs, wts, *wref, ranks=[rank])[rank]
        all_ranks_ok(comm, mega_calc_diff(y.float(), exp.float()) < 1e-6, "ProcessGroup result")
    finally:
        coll(buf.destroy, what="destroy")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("backend", ["shm", "buffer"])
def test_a_rank_that_skips_a_call_is_named_not_waited_for(comm, backend):
    """The call's consensus has the buffer's deadline: the ranks that called raise ``TimeoutError`` naming the
    rank that did not, and that rank's late call fails at once (the Buffer was aborted), instead of a hang."""
    rank, size = comm.Get_rank(), comm.Get_size()
    last = size - 1
    buf = coll(dea.get_symm_buffer_for_mega_moe, comm, 2 * size, 8, 2, 64, 16, mma_type="bf16xbf16", timeout_s=2.0,
               backend=backend, what="symm buffer with a 2 s deadline")
    try:
        w, _ = _weights("bf16", 2 * size, 64, 16, seed=3)
        l1, l2 = dea.transform_weights_for_mega_moe(w[0][2 * rank:2 * rank + 2], w[1][2 * rank:2 * rank + 2])
        buf.topk_idx[:4] = torch.randint(0, 2 * size, (4, 2), generator=torch.Generator().manual_seed(rank))
        buf.topk_weights[:4] = 0.5
        y = torch.empty(4, 64, dtype=BF16)
        if rank != last:
            _, exc = capture(lambda: dea.bf16_mega_moe(y, l1, l2, buf))
            ok = isinstance(exc, TimeoutError) and "consensus" in str(exc) and f"[{last}]" in str(exc)
        else:
            ok = True
        all_ranks_ok(comm, ok, f"a rank skipped the call: {exc if rank != last else ''!r}")
        _, exc = capture(lambda: dea.bf16_mega_moe(y, l1, l2, buf))
        if rank == last:  # told why by a peer that timed out, not by one that was refused later
            ok = isinstance(exc, TimeoutError) and f"waiting for rank(s) [{last}]" in str(exc)
        else:
            ok = isinstance(exc, RuntimeError) and "consensus" in str(exc) and f"{last};" not in str(exc)
        all_ranks_ok(comm, ok, f"a call on the aborted buffer fails at once: {exc!r}")
    finally:
        coll(buf.destroy, what="destroy after the timeout")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("backend", ["shm", "buffer"])
@pytest.mark.parametrize("where,epw", [("activation", None), ("l2", 1)])
def test_a_failure_after_the_ranks_agreed_fails_the_peers_at_once(comm, monkeypatch, where, epw, backend):
    """A rank whose expert compute raises after the call's consensus aborts the Buffer: it raises its own error,
    and the others raise ``TransportAborted`` naming it and its reason instead of waiting out the deadline (30 s
    here, far past when they would otherwise time out in the combine) for rows it will never send. With two
    waves and the failure in wave 0's L2 the peers' worker meets the abort first and their next call on the
    caller is refused: the call still raises the worker's ``TransportAborted`` (found by a helper: it raised the
    refusal, a ``TransportPoisoned``)."""
    from deepep_ascend.mega_moe import experts
    from deepep_ascend.transports import TransportAborted

    rank, size = comm.Get_rank(), comm.Get_size()
    last = size - 1
    el = 4
    buf = coll(dea.get_symm_buffer_for_mega_moe, comm, el * size, 8, 2, 64, 16, mma_type="bf16xbf16",
               timeout_s=30.0, backend=backend, what="symm buffer")
    try:
        w, _ = _weights("bf16", el * size, 64, 16, seed=3)
        l1, l2 = dea.transform_weights_for_mega_moe(w[0][el * rank:el * (rank + 1)], w[1][el * rank:el * (rank + 1)])
        buf.topk_idx[:6] = torch.arange(12).view(6, 2) % (el * size)  # rows for every rank
        buf.topk_weights[:6] = 0.5
        y = torch.empty(6, 64, dtype=BF16)
        coll(dea.bf16_mega_moe, y, l1, l2, buf, num_experts_per_wave=epw, what="a call before the failure")
        if rank == last:
            if where == "l2":
                real, calls = experts.expert_gemm, []

                def broken(*args, **kwargs):  # calls per wave: L1, then L2
                    calls.append(1)
                    if len(calls) == 2:
                        raise RuntimeError("injected activation failure")
                    return real(*args, **kwargs)
                monkeypatch.setattr(experts, "expert_gemm", broken)
            else:
                def broken(*args, **kwargs):
                    raise RuntimeError("injected activation failure")
                monkeypatch.setattr(experts, "activation", broken)
        _, exc = capture(lambda: dea.bf16_mega_moe(y, l1, l2, buf, num_experts_per_wave=epw))
        if rank == last:
            ok = isinstance(exc, RuntimeError) and "injected activation failure" in str(exc)
        else:
            ok = (isinstance(exc, TransportAborted) and f"rank {last}" in str(exc)
                  and "injected activation failure" in str(exc))
        all_ranks_ok(comm, ok, f"a failure after the consensus: {exc!r}")
    finally:
        coll(buf.destroy, what="destroy after the failure")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("backend", ["shm", "buffer"])
def test_a_peer_timing_out_as_the_others_arrive_strands_no_rank(comm, monkeypatch, backend):
    """Rank 0 times out in the consensus barrier just before the last rank arrives and is slow to tell the
    others (its abort delayed 0.3 s, as if descheduled); the last rank passes the barrier meanwhile. It must then
    fail in the all-gather as soon as the abort lands, not wait there forever, and every rank can still
    destroy the buffer."""
    import time

    from deepep_ascend.transports import ubmem

    rank, size = comm.Get_rank(), comm.Get_size()
    last = size - 1
    if rank == 0:
        real_abort = ubmem.Transport.abort

        def slow_abort(self, *args, **kwargs):
            time.sleep(0.3)
            return real_abort(self, *args, **kwargs)
        monkeypatch.setattr(ubmem.Transport, "abort", slow_abort)
    buf = coll(dea.get_symm_buffer_for_mega_moe, comm, 2 * size, 8, 2, 64, 16, mma_type="bf16xbf16", timeout_s=1.0,
               backend=backend, what="symm buffer with a 1 s deadline")
    try:
        w, _ = _weights("bf16", 2 * size, 64, 16, seed=3)
        l1, l2 = dea.transform_weights_for_mega_moe(w[0][2 * rank:2 * rank + 2], w[1][2 * rank:2 * rank + 2])
        buf.topk_idx[:4] = 0
        buf.topk_weights[:4] = 0.5
        y = torch.empty(4, 64, dtype=BF16)
        all_ranks_ok(comm, True, "start together")
        if rank == last:
            time.sleep(1.05)
        _, exc = capture(lambda: dea.bf16_mega_moe(y, l1, l2, buf))
        outcomes = allgather_object(None if exc is None else type(exc).__name__, comm)
        # all in time (a slow host may let the last rank in before rank 0's deadline), or all failed
        ok = len(set(o is None for o in outcomes)) == 1 and (exc is None or isinstance(exc, TimeoutError))
        all_ranks_ok(comm, ok, f"outcomes {outcomes}; here {exc!r}")
    finally:
        coll(buf.destroy, what="destroy after the timeout")


def test_debug_mode_zeroes_buffer(env, comm, monkeypatch):
    """``DG_COMM_KERNEL_DEBUG=1`` zeroes the whole symmetric buffer after the call (callers refill inputs)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    buf = env.get("bf16", 0)
    w, _ = _weights("bf16", buf.num_experts, buf.hidden, buf.intermediate_hidden, seed=5)
    l1, l2 = dea.transform_weights_for_mega_moe(*_local("bf16", w, rank, buf.num_local_experts))
    t = _fill("bf16", buf, seed=6, rank=rank, size=size)
    y = torch.empty(t, buf.hidden, dtype=BF16)
    monkeypatch.setenv("DG_COMM_KERNEL_DEBUG", "1")
    coll(dea.bf16_mega_moe, y, l1, l2, buf, what="bf16_mega_moe (debug)")
    all_ranks_ok(comm, not bool(buf.buffer.any()) and (t == 0 or bool(y.float().abs().sum() > 0)),
                 "buffer zeroed, y written")


def test_trace_overlap_arithmetic():
    """``MegaMoETrace.overlap``: worker intervals intersected with compute intervals (hand-computed)."""
    from deepep_ascend.mega_moe.trace import MegaMoETrace

    tr = MegaMoETrace(True, 2, 1, start=0.0, end=10.0)
    tr.compute = [("l1", 0, 1.0, 3.0), ("l2", 0, 4.0, 6.0), ("l1", 1, 5.0, 7.0)]  # union [1,3] + [4,7]
    tr.comm = [["dispatch", 1, 0.5, 0.6, 0.6, 2.0], ["combine", 0, 6.0, 6.1, 6.1, 9.0]]  # busy 1.4 + 2.9
    ov = tr.overlap()
    assert abs(ov["worker_busy"] - 4.3) < 1e-9 and abs(ov["hidden"] - (1.0 + 0.9)) < 1e-9
    assert abs(ov["fraction"] - 1.9 / 4.3) < 1e-9 and abs(ov["compute"] - 5.0) < 1e-9
    assert tr.stage_times()["dispatch"] == pytest.approx(0.1 + 1.4)


def test_default_wave_count_follows_bytes_moved(monkeypatch):
    """Default waves = round(bytes a rank moves / 24 MiB), clamped to [1, min(4, E_l)]; a keyword or the
    environment variable overrides it (checked, naming which). Pure function of the all-gathered counts."""
    from types import SimpleNamespace

    from deepep_ascend.mega_moe import waves

    monkeypatch.delenv("DEEPEP_ASCEND_MEGA_MOE_EXPERTS_PER_WAVE", raising=False)

    def epw(pairs_per_rank, hidden, fp8, ranks=4, el=24, override=None):
        sb = SimpleNamespace(num_local_experts=el, num_ranks=ranks, hidden=hidden, is_fp8=fp8)
        counts = torch.zeros(ranks, el * ranks, dtype=torch.int64)
        counts[:, 0] = pairs_per_rank  # only the total matters
        return waves.experts_per_wave(sb, counts, override)

    # fp8, H 1024: (1024 + 32 + 2048) B per pair; 3072 pairs = 9.5 MB -> one wave of all 24 experts
    assert epw(3072, 1024, True) == 24
    # bf16, H 2048: 8192 B per pair; 6144 pairs = 50 MB -> 2.0 -> 2 waves of 12
    assert epw(6144, 2048, False) == 12
    # 11264 pairs = 92 MB -> 3.67 -> 4 waves of 6; 10x more stays at 4
    assert epw(11264, 2048, False) == 6 and epw(112640, 2048, False) == 6
    assert epw(112640, 2048, False, el=2) == 1  # never more waves than local experts
    assert epw(0, 1024, True) == 24
    assert epw(3072, 1024, True, override=5) == 5 and epw(3072, 1024, True, override=99) == 24
    assert waves.wave_override(None, "op") is None and waves.wave_override(4, "op") == 4
    monkeypatch.setenv("DEEPEP_ASCEND_MEGA_MOE_EXPERTS_PER_WAVE", "3")
    assert waves.wave_override(None, "op") == 3 and waves.wave_override(5, "op") == 5  # the keyword wins
    for bad in (0, -1, 2.0, True, "3"):
        with pytest.raises(ValueError, match="num_experts_per_wave must be a positive int"):
            waves.wave_override(bad, "op")
    for env in ("0", "abc", "-2"):
        monkeypatch.setenv("DEEPEP_ASCEND_MEGA_MOE_EXPERTS_PER_WAVE", env)
        with pytest.raises(ValueError, match=r"op: \$DEEPEP_ASCEND_MEGA_MOE_EXPERTS_PER_WAVE must be an integer >= 1"):
            waves.wave_override(None, "op")


def test_benchmark_reports_fused_serial_and_unfused_stages(comm, tmp_path):
    """``python -m bench mega-moe`` (the README's MegaMoE figures) on the ``tiny`` preset: the fused call
    equals the serial one and matches the unfused sequence (exit code 0), and the JSON holds the unfused
    stages and the serial call's own stage times from its trace, each positive, adding up to no more
    than the serial call took."""
    import json

    from bench import mega_moe as bench

    path = comm.bcast(str(tmp_path / "mega_moe.json"), root=0)
    rc = coll(bench.main, ["--preset", "tiny", "--iters", "1", "--warmup", "1", "--threads", "1", "--json", path],
              what="bench mega-moe")
    ok = rc == 0
    if comm.rank == 0:
        t = json.load(open(path))["details"]["times_s"]
        stages, own = t["stages"], t["serial_call_stages"]
        ok = ok and set(stages) == {"dispatch", "l1", "act", "l2", "combine", "shared"}
        ok = ok and {"dispatch", "l1", "act", "l2", "combine", "shared", "reduce"} <= set(own)
        ok = ok and all(v > 0 for v in list(stages.values()) + list(own.values()))
        ok = ok and sum(own.values()) <= t["serial"] * 1.05 + 1e-3
        ok = ok and json.load(open(path))["details"]["gc"]["full_collection_ms"] > 0
    all_ranks_ok(comm, ok, "bench mega-moe ran, checked its outputs and reported both stage lists")


def test_benchmark_pauses_the_collector_and_restores_it():
    """``bench.timing.gc_paused`` (around the timed iterations of ``bench mega-moe`` and ``time_phases``):
    the collector is off inside, collects nothing there, and comes back as it was, after an exception too."""
    import gc

    from bench import timing as C

    assert gc.isenabled()
    with pytest.raises(RuntimeError, match="inside"):
        with C.gc_paused():
            assert not gc.isenabled()
            before = gc.get_count()[0]
            cycles = []
            for _ in range(5 * gc.get_threshold()[0]):  # would trigger collections with the collector on
                a = []
                a.append(a)
                cycles.append(a)
            assert gc.get_count()[0] > before  # nothing reset the generation-0 count
            raise RuntimeError("inside")
    assert gc.isenabled()
    gc.disable()
    try:
        with C.gc_paused():
            pass
        assert not gc.isenabled()  # left off as found
    finally:
        gc.enable()


def _one_wave_case(env, comm, kind, seed):
    """A call's operands on this rank (seeds ``seed``, ``+4``, ``+6``): ``(rank, buf, l1, l2, shared weights,
    reference weights, reference shared weights, tokens)``."""
    rank, size = comm.Get_rank(), comm.Get_size()
    buf = env.get(kind, 1)
    el, h, i = buf.num_local_experts, buf.hidden, buf.intermediate_hidden
    w, wref = _weights(kind, buf.num_experts, h, i, seed=seed)
    l1, l2 = dea.transform_weights_for_mega_moe(*_local(kind, w, rank, el))
    shared, sref = _shared(kind, h, i, 1, seed=seed + 4)
    t = _fill(kind, buf, seed=seed + 6, rank=rank, size=size)
    return rank, buf, l1, l2, shared, wref, sref, t


def test_final_sum_in_small_token_blocks_is_the_same(env, comm, monkeypatch):
    """Without the native kernel the final sum over k (and the shared expert) runs on combine's torch
    paths in blocks of tokens; with blocks of 3 tokens (several per rank and a short last one: the
    float32 chain; the tests' shapes otherwise fit one block: ``embedding_bag``) ``y`` is bit for bit
    the one-block result and the native kernel's, and within tolerance of the reference."""
    from deepep_ascend import native
    from deepep_ascend.ep.reduce import CombineScratch

    kind = "fp8"
    rank, buf, l1, l2, (s1, s2), wref, sref, t = _one_wave_case(env, comm, kind, seed=13)
    h = buf.hidden
    ys = []
    for block_rows, use_native in ((None, False), (3, False), (None, True)):
        monkeypatch.setattr(buf, "_reduce_scratch", CombineScratch(block_rows))
        monkeypatch.setattr(native, "sum_rows", native.sum_rows if use_native else lambda *a, **kw: False)
        y = torch.full((t, h), float("nan"), dtype=BF16)
        coll(_call, kind, y, l1, l2, buf, None, num_experts_per_wave=1, shared_l1_weights=s1,
             shared_l2_weights=s2, what="fp8_fp4_mega_moe")
        ys.append(y)
    xs, sfs, idxs, wts = _gathered_inputs(buf, t, True)
    exp = ref_mega_moe(xs, sfs, idxs, wts, *wref, clamp=None, shared=sref, ranks=[rank])[rank]
    all_ranks_ok(comm, all(torch.equal(ys[0].view(torch.int16), other.view(torch.int16)) for other in ys[1:])
                 and mega_calc_diff(ys[1].float(), exp.float()) < 1e-5,
                 "blocks of 3 tokens == one block == native kernel")


@pytest.mark.parametrize("kind,clamp,engine", [("fp8", 10.0, None), ("fp8", None, None), ("bf16", 10.0, None),
                                               ("fp8", 10.0, "fp32")])
def test_native_kernels_give_the_torch_paths_bits(env, comm, monkeypatch, kind, clamp, engine):
    """The native kernels (FP8 row decode, SwiGLU with its FP8 round trip, the final sum) against the
    torch paths with all three switched off: ``y`` bit for bit, several waves and the shared expert,
    and within tolerance of the reference; with the default GEMM engine and the fp32 one (float32
    operands: the kernels' rows widened)."""
    from deepep_ascend import native

    if engine is not None:
        monkeypatch.setenv("DEEPEP_ASCEND_MEGA_MOE_GEMM", engine)
    rank, buf, l1, l2, (s1, s2), wref, sref, t = _one_wave_case(env, comm, kind, seed=23)
    h = buf.hidden
    ys, used = [], []
    reals = {name: getattr(native, name) for name in ("sum_rows", "dequant_rows_e4m3", "swiglu")}
    for use_native in (False, True):
        for name, real in reals.items():
            def spy(*a, real=real, name=name, use_native=use_native, **kw):
                ok = use_native and real(*a, **kw)
                used.append((use_native, name, ok))
                return ok
            monkeypatch.setattr(native, name, spy)
        y = torch.full((t, h), float("nan"), dtype=BF16)
        coll(_call, kind, y, l1, l2, buf, None, num_experts_per_wave=1, shared_l1_weights=s1, shared_l2_weights=s2,
             activation_clamp=clamp, what=f"{kind} mega_moe")
        ys.append(y)
    xs, sfs, idxs, wts = _gathered_inputs(buf, t, kind == "fp8")
    exp = ref_mega_moe(xs, sfs, idxs, wts, *wref, clamp=clamp, shared=sref, ranks=[rank])[rank]
    ran = {name for on, name, ok in used if on and ok}
    want = {"swiglu"} | ({"sum_rows"} if t else set()) | ({"dequant_rows_e4m3"} if kind == "fp8" else set())
    all_ranks_ok(comm, torch.equal(ys[0].view(torch.int16), ys[1].view(torch.int16))
                 and mega_calc_diff(ys[1].float(), exp.float()) < 1e-5 and (ran == want or not native.available()),
                 f"native kernels {sorted(ran)} == torch paths, bitwise")


def test_cached_unpacked_weights_do_not_keep_the_callers_tensors_alive(monkeypatch):
    """Where weights cannot be packed, MegaMoE caches its un-transformed bf16 weights; an ``l2`` already in
    the natural layout is cached as a detached alias, so the entry dies with the caller's tensor instead of
    keeping it alive (a found bug: the entry held ``l2`` itself, counted as 0 bytes, until ``l1`` died)."""
    import gc
    import weakref

    from deepep_ascend.gemm import packing
    from deepep_ascend.mega_moe.weights import untransformed

    monkeypatch.setattr(packing, "PACKER", None)
    dea.clear_dequantized_weight_cache()
    g = torch.Generator().manual_seed(3)
    l1 = torch.randn(2, 2 * 128, 256, generator=g).to(torch.bfloat16)
    l2 = torch.randn(2, 256, 128, generator=g).to(torch.bfloat16)
    w1, w2 = untransformed("bf16", l1, l2, "bf16")
    assert torch.equal(w2, l2) and w2.data_ptr() == l2.data_ptr()
    assert untransformed("bf16", l1, l2, "bf16")[1] is w2  # cached
    info = dea.dequantized_weight_cache_info()
    assert (info.entries, info.nbytes) == (1, w1.untyped_storage().nbytes())  # l2's storage is the caller's
    ref = weakref.ref(l2)
    del l2, w1, w2
    gc.collect()
    assert ref() is None and dea.dequantized_weight_cache_info()[3:5] == (0, 0)
    dea.clear_dequantized_weight_cache()


def test_shm_backend_takes_the_buffer_path_when_its_output_area_is_short(comm, monkeypatch):
    """The shm backend keeps every received row's L2 output in its segment; with the area capped below what a
    rank receives (here 4 rows), the call takes the Buffer's path, alike on every rank, and gives the
    reference's y and the uncapped call's bits."""
    from deepep_ascend.mega_moe import symm_buffer

    rank, size = comm.Get_rank(), comm.Get_size()
    h, i = H_BF16, I_BF16
    w, wref = _weights("bf16", E_PER_RANK * size, h, i, seed=21)
    l1, l2 = dea.transform_weights_for_mega_moe(*_local("bf16", w, rank, E_PER_RANK))
    ys = []
    for cap in (None, 4 * 2 * h):
        if cap is not None:
            monkeypatch.setattr(symm_buffer, "_MAX_OUT_BYTES", cap)
        buf = coll(dea.get_symm_buffer_for_mega_moe, comm, E_PER_RANK * size, TMAX, K, h, i, mma_type="bf16xbf16",
                   backend="shm", what="shm symm buffer")
        try:
            t = _fill("bf16", buf, seed=8, rank=rank, size=size)
            y = torch.empty(t, h, dtype=BF16)
            coll(dea.bf16_mega_moe, y, l1, l2, buf, what="bf16_mega_moe")
            xs, sfs, idxs, wts = _gathered_inputs(buf, t, False)
            exp = ref_mega_moe(xs, sfs, idxs, wts, *wref, ranks=[rank])[rank]
            ok = buf._out_rows == (4 if cap else size * buf.num_max_tokens_per_rank * K)
            ok = ok and buf.last_trace.backend == ("buffer" if cap else "shm")
            ok = ok and mega_calc_diff(y.float(), exp.float()) < 1e-6
            all_ranks_ok(comm, ok, f"cap {cap}: rows {buf._out_rows}, path {buf.last_trace.backend}")
            ys.append(y)
        finally:
            coll(buf.destroy, what="destroy")
    all_ranks_ok(comm, torch.equal(ys[0].view(torch.int16), ys[1].view(torch.int16)), "capped == uncapped, bitwise")


def test_backend_argument(comm, monkeypatch):
    """``backend``: a name other than 'shm'/'buffer' (keyword or $DEEPEP_ASCEND_MEGA_MOE_BACKEND) fails the
    constructor's checks on every rank; across simulated nodes the default is 'buffer' and 'shm' is refused
    on every rank, naming the nodes."""
    size = comm.Get_size()
    args = (comm, 2 * size, 8, 2, 64, 16)
    _, exc = capture(lambda: dea.get_symm_buffer_for_mega_moe(*args, mma_type="bf16xbf16", backend="p2p"))
    all_ranks_ok(comm, isinstance(exc, AssertionError) and "backend" in str(exc) and "'p2p'" in str(exc),
                 f"bad backend keyword: {exc!r}")
    monkeypatch.setenv("DEEPEP_ASCEND_MEGA_MOE_BACKEND", "SHM")
    _, exc = capture(lambda: dea.get_symm_buffer_for_mega_moe(*args, mma_type="bf16xbf16"))
    all_ranks_ok(comm, isinstance(exc, AssertionError) and "DEEPEP_ASCEND_MEGA_MOE_BACKEND" in str(exc),
                 f"bad backend variable: {exc!r}")
    monkeypatch.setenv("DEEPEP_ASCEND_MEGA_MOE_BACKEND", "buffer")
    buf = coll(dea.get_symm_buffer_for_mega_moe, *args, mma_type="bf16xbf16", what="buffer backend from the variable")
    ok = buf.backend == "buffer"
    coll(buf.destroy, what="destroy")
    monkeypatch.delenv("DEEPEP_ASCEND_MEGA_MOE_BACKEND")
    if size > 1:
        monkeypatch.setenv("DEEPEP_ASCEND_RANKS_PER_NODE", "1")
        buf = coll(dea.get_symm_buffer_for_mega_moe, *args, mma_type="bf16xbf16", what="default across nodes")
        ok = ok and buf.backend == "buffer"
        coll(buf.destroy, what="destroy")
        _, exc = capture(lambda: dea.get_symm_buffer_for_mega_moe(*args, mma_type="bf16xbf16", backend="shm"))
        ok = ok and isinstance(exc, ValueError) and f"span {size} nodes" in str(exc)
    all_ranks_ok(comm, ok, "backend choice")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_across_simulated_nodes_matches_reference(comm, monkeypatch, kind):
    """Ranks split into two simulated nodes: the default backend is 'buffer', whose Buffer takes the internode
    path (both windows); y (two waves, a shared expert) matches the reference and stats count every pair."""
    rank, size = comm.Get_rank(), comm.Get_size()
    if size % 2:
        pytest.skip("two equal nodes need an even rank count")
    monkeypatch.setenv("DEEPEP_ASCEND_RANKS_PER_NODE", str(size // 2))
    h, i = (H_BF16, I_BF16) if kind == "bf16" else (H_FP8, I_FP8)
    buf = coll(dea.get_symm_buffer_for_mega_moe, comm, E_PER_RANK * size, TMAX, K, h, i,
               mma_type="bf16xbf16" if kind == "bf16" else "fp8xfp4", num_shared_experts=1,
               what="symm buffer over two nodes")
    try:
        w, wref = _weights(kind, buf.num_experts, h, i, seed=17)
        l1, l2 = dea.transform_weights_for_mega_moe(*_local(kind, w, rank, E_PER_RANK))
        (s1, s2), sref = _shared(kind, h, i, 1, seed=19)
        t = _fill(kind, buf, seed=23, rank=rank, size=size)
        y = torch.empty(t, h, dtype=BF16)
        stats = torch.zeros(E_PER_RANK, dtype=torch.int32)
        coll(_call, kind, y, l1, l2, buf, stats, activation_clamp=10.0, num_experts_per_wave=2,
             shared_l1_weights=s1, shared_l2_weights=s2, what="mega_moe over two nodes")
        xs, sfs, idxs, wts = _gathered_inputs(buf, t, kind == "fp8")
        exp = ref_mega_moe(xs, sfs, idxs, wts, *wref, clamp=10.0, shared=sref, ranks=[rank])[rank]
        all_idx = torch.cat(idxs).reshape(-1)
        exp_stats = torch.bincount(all_idx[all_idx >= 0], minlength=buf.num_experts)[
            rank * E_PER_RANK:(rank + 1) * E_PER_RANK].to(torch.int32)
        diff = mega_calc_diff(y.float(), exp.float())
        ok = (buf.backend == "buffer" and buf.ep_buffer.num_nodes == 2 and buf.last_trace.num_waves == 2
              and diff < (1e-6 if kind == "bf16" else 1e-5) and torch.equal(stats, exp_stats))
        all_ranks_ok(comm, ok, f"{kind} over two nodes: backend {buf.backend}, calc_diff {diff:.3g}")
    finally:
        coll(buf.destroy, what="destroy")
