"""The MegaMoE entry points (``deepep_ascend.mega_moe.api``: ``bf16_mega_moe`` / ``fp8_fp4_mega_moe``)
against the single-process reference (``tests/support/mega_moe.py`` describes the cases), on both backends,
with and without overlap, a ProcessGroup, simulated nodes, and the native kernels against the torch paths.

Overlap is checked by structure, never by time: the trace of a multi-wave call must show the
next wave's dispatch issued between this wave's L1 and L2 and each combine issued before the next
wave's L1 (so the worker has that communication in flight while the caller computes), on a buffer's first
call (its worker thread starts inside the first submit) and on a used one.
"""

from __future__ import annotations

import pytest
import torch

import deepep_ascend as dea
from tests.support.buffer_helpers import all_ranks_ok, coll
from tests.support.mega_moe import (
    BF16,
    E_PER_RANK,
    H_BF16,
    H_FP8,
    I_BF16,
    I_FP8,
    TMAX,
    K,
    SymmBuffers,
    call_op,
    expert_weights,
    fill,
    gathered_inputs,
    local_weights,
    shared_weights,
)
from tests.support.mpi_utils import up_to_four_ranks
from tests.support.reference import mega_calc_diff, ref_mega_moe

pytestmark = [pytest.mark.mpi(min_size=1), pytest.mark.watchdog(240)]


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
    w, wref = expert_weights(kind, buf.num_experts, h, i, seed=7)
    l1, l2 = dea.transform_weights_for_mega_moe(*local_weights(kind, w, rank, el))
    kw = {}
    sref = None
    if shared:
        (s1, s2), sref = shared_weights(kind, h, i, shared, seed=11)
        kw = dict(shared_l1_weights=s1, shared_l2_weights=s2)
    t = fill(kind, buf, seed=3, rank=rank, size=size)
    stats0 = torch.randint(0, 100, (el,), dtype=torch.int32)
    stats = stats0.clone()
    y = torch.full((t, h), float("nan"), dtype=BF16)
    coll(call_op, kind, y, l1, l2, buf, stats, activation_clamp=clamp, num_experts_per_wave=epw, **kw,
         what=f"{kind}_mega_moe")
    xs, sfs, idxs, wts = gathered_inputs(buf, t, kind == "fp8")
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
        coll(call_op, kind, y2, l1, l2, buf, None, activation_clamp=None, **kw, what="unclamped")
        exp2 = ref_mega_moe(xs, sfs, idxs, wts, *wref, clamp=None, shared=sref, ranks=[rank])[rank]
        changed = comm.allreduce(int(not torch.equal(exp2, exp)))
        all_ranks_ok(comm, mega_calc_diff(y2.float(), exp2.float()) < tol and changed > 0,
                     "unclamped call / clamp has an effect somewhere")


OAI_CASES = [  # (kind, shared experts, clamp, alpha, up_bias, experts per wave); bf16's L1 outputs are ~N(0, 1)
    ("bf16", 1, 1.5, 1.702, 1.0, None),
    ("bf16", 0, None, 0.5, -0.25, 1),
    ("fp8", 1, 7.0, 1.702, 1.0, 3),  # gpt-oss / MiniMax-M3
    ("fp8", 0, 10.0, 3.0, 0.5, None),
]


@pytest.mark.parametrize("backend", ["shm", "buffer"])
@pytest.mark.parametrize("kind,shared,clamp,alpha,up_bias,epw", OAI_CASES,
                         ids=[f"{k}-shared{s}-clamp{c}-alpha{a}-bias{b}" for k, s, c, a, b, _ in OAI_CASES])
@up_to_four_ranks()
def test_swigluoai_matches_reference(env, comm, kind, shared, clamp, alpha, up_bias, epw, backend):
    """``activation='swigluoai'`` (DeepGEMM PR #445: ``g·sigmoid(alpha·g)·(u + up_bias)`` after the clamp) on
    the routed and the shared experts, against the reference written from that formula; the result is not
    plain SwiGLU's, and the clamp matters for these inputs (L1 outputs past it on both sides)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    buf = env.get(kind, shared, backend)
    el, h, i = buf.num_local_experts, buf.hidden, buf.intermediate_hidden
    w, wref = expert_weights(kind, buf.num_experts, h, i, seed=29)
    l1, l2 = dea.transform_weights_for_mega_moe(*local_weights(kind, w, rank, el), activation="swigluoai")
    kw, sref = {}, None
    if shared:
        (s1, s2), sref = shared_weights(kind, h, i, shared, seed=31)
        kw = dict(shared_l1_weights=s1, shared_l2_weights=s2)
    t = fill(kind, buf, seed=37, rank=rank, size=size)
    stats = torch.zeros(el, dtype=torch.int32)
    y = torch.full((t, h), float("nan"), dtype=BF16)
    coll(call_op, kind, y, l1, l2, buf, stats, activation="swigluoai", activation_alpha=alpha,
         activation_up_bias=up_bias, activation_clamp=clamp, num_experts_per_wave=epw, **kw, what="swigluoai")
    xs, sfs, idxs, wts = gathered_inputs(buf, t, kind == "fp8")
    ref = ref_mega_moe(xs, sfs, idxs, wts, *wref, clamp=clamp, shared=sref, activation="swigluoai", alpha=alpha,
                       up_bias=up_bias)
    exp = ref[rank]
    plain = ref_mega_moe(xs, sfs, idxs, wts, *wref, clamp=clamp, shared=sref, ranks=[rank])[rank]
    unclamped = ref_mega_moe(xs, sfs, idxs, wts, *wref, clamp=None, shared=sref, activation="swigluoai",
                             alpha=alpha, up_bias=up_bias, ranks=[rank])[rank]
    all_idx = torch.cat(idxs).reshape(-1)
    exp_stats = torch.bincount(all_idx[all_idx >= 0], minlength=buf.num_experts)[rank * el:(rank + 1) * el]
    diff = mega_calc_diff(y.float(), exp.float())
    tol = 1e-6 if kind == "bf16" else 1e-5
    ok = (not torch.isnan(y.float()).any() and diff < tol and torch.equal(stats, exp_stats.to(torch.int32)))
    all_ranks_ok(comm, ok, f"{kind} swigluoai alpha={alpha} bias={up_bias} clamp={clamp}: calc_diff {diff:.3g} "
                           f"(tol {tol})")
    changed = comm.allreduce(int(not torch.equal(plain, exp)))
    clamp_matters = comm.allreduce(int(clamp is None or not torch.equal(unclamped, exp)))
    all_ranks_ok(comm, changed > 0 and clamp_matters > 0, "swigluoai differs from swiglu / the clamp has an effect")
    # the same call twice gives the same bits; the identity parameters give plain SwiGLU's values
    y2 = torch.empty_like(y)
    coll(call_op, kind, y2, l1, l2, buf, None, activation="swigluoai", activation_alpha=alpha,
         activation_up_bias=up_bias, activation_clamp=clamp, num_experts_per_wave=epw, **kw, what="again")
    y3, y4 = torch.empty_like(y), torch.empty_like(y)
    coll(call_op, kind, y3, l1, l2, buf, None, activation="swigluoai", activation_clamp=clamp, **kw, what="ident")
    coll(call_op, kind, y4, l1, l2, buf, None, activation_clamp=clamp, **kw, what="swiglu")
    all_ranks_ok(comm, torch.equal(y.view(torch.int16), y2.view(torch.int16)) and torch.equal(y3.float(), y4.float()),
                 "repeatable; swigluoai(alpha=1, up_bias=0) == swiglu")


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_fused_equals_unfused_and_repeatable(env, comm, kind):
    """Same waves with synchronous communication (overlap=False) give the same y bit for bit; so does a rerun,
    and so does the other backend (same rows in the same order per expert GEMM, same final sum)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    ys = []
    for backend, overlap in (("shm", True), ("shm", False), ("shm", True), ("buffer", True), ("buffer", False)):
        buf = env.get(kind, 0, backend)
        w, _ = expert_weights(kind, buf.num_experts, buf.hidden, buf.intermediate_hidden, seed=5)
        l1, l2 = dea.transform_weights_for_mega_moe(*local_weights(kind, w, rank, buf.num_local_experts))
        t = fill(kind, buf, seed=9, rank=rank, size=size)
        y = torch.empty(t, buf.hidden, dtype=BF16)
        coll(call_op, kind, y, l1, l2, buf, None, overlap=overlap, num_experts_per_wave=1, what="mega_moe")
        assert buf.last_trace.backend == backend
        ys.append(y)
    all_ranks_ok(comm, all(torch.equal(ys[0].view(torch.int16), y.view(torch.int16)) for y in ys[1:]),
                 "fused == unfused == rerun, on both backends")


@pytest.mark.parametrize("first_call", [True, False], ids=["first_call", "used"])
@pytest.mark.parametrize("backend", ["shm", "buffer"])
def test_overlap_structure(env, comm, backend, first_call):
    """Trace order of a 4-wave call: the worker has wave w+1's dispatch in flight during wave w's SwiGLU/L2
    (issued after L1(w), before SwiGLU(w)); Buffer backend: combine(w) queued before L1(w+1) starts; shm
    backend: one combine (the barrier before the final sum) after the last L2; every worker marker fired,
    after the issue it belongs to."""
    own = SymmBuffers() if first_call else None
    try:
        _check_overlap_structure((own or env).get("bf16", 0, backend), comm, backend)
    finally:
        for b in (own.bufs.values() if own else ()):
            coll(b.destroy, what="destroy")


def _check_overlap_structure(buf, comm, backend):
    rank, size = comm.Get_rank(), comm.Get_size()
    w, _ = expert_weights("bf16", buf.num_experts, buf.hidden, buf.intermediate_hidden, seed=5)
    l1, l2 = dea.transform_weights_for_mega_moe(*local_weights("bf16", w, rank, buf.num_local_experts))
    t = fill("bf16", buf, seed=2, rank=rank, size=size)
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


def test_debug_mode_zeroes_buffer(env, comm, monkeypatch):
    """``DG_COMM_KERNEL_DEBUG=1`` zeroes the whole symmetric buffer after the call (callers refill inputs)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    buf = env.get("bf16", 0)
    w, _ = expert_weights("bf16", buf.num_experts, buf.hidden, buf.intermediate_hidden, seed=5)
    l1, l2 = dea.transform_weights_for_mega_moe(*local_weights("bf16", w, rank, buf.num_local_experts))
    t = fill("bf16", buf, seed=6, rank=rank, size=size)
    y = torch.empty(t, buf.hidden, dtype=BF16)
    monkeypatch.setenv("DG_COMM_KERNEL_DEBUG", "1")
    coll(dea.bf16_mega_moe, y, l1, l2, buf, what="bf16_mega_moe (debug)")
    all_ranks_ok(comm, not bool(buf.buffer.any()) and (t == 0 or bool(y.float().abs().sum() > 0)),
                 "buffer zeroed, y written")


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
        w, wref = expert_weights("bf16", 2 * size, 64, 16, seed=3)
        l1, l2 = dea.transform_weights_for_mega_moe(w[0][2 * rank:2 * rank + 2], w[1][2 * rank:2 * rank + 2])
        g = torch.Generator().manual_seed(rank)
        t = 5
        buf.x[:t] = torch.randn(t, 64, generator=g).to(BF16)
        buf.topk_idx[:t] = torch.randint(0, 2 * size, (t, 2), generator=g)
        buf.topk_weights[:t] = torch.rand(t, 2, generator=g)
        y = torch.empty(t, 64, dtype=BF16)
        coll(dea.bf16_mega_moe, y, l1, l2, buf, what="bf16_mega_moe on a ProcessGroup")
        xs, sfs, idxs, wts = gathered_inputs(buf, t, False)
        exp = ref_mega_moe(xs, sfs, idxs, wts, *wref, ranks=[rank])[rank]
        all_ranks_ok(comm, mega_calc_diff(y.float(), exp.float()) < 1e-6, "ProcessGroup result")
    finally:
        coll(buf.destroy, what="destroy")


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
        w, wref = expert_weights(kind, buf.num_experts, h, i, seed=17)
        l1, l2 = dea.transform_weights_for_mega_moe(*local_weights(kind, w, rank, E_PER_RANK))
        (s1, s2), sref = shared_weights(kind, h, i, 1, seed=19)
        t = fill(kind, buf, seed=23, rank=rank, size=size)
        y = torch.empty(t, h, dtype=BF16)
        stats = torch.zeros(E_PER_RANK, dtype=torch.int32)
        coll(call_op, kind, y, l1, l2, buf, stats, activation_clamp=10.0, num_experts_per_wave=2,
             shared_l1_weights=s1, shared_l2_weights=s2, what="mega_moe over two nodes")
        xs, sfs, idxs, wts = gathered_inputs(buf, t, kind == "fp8")
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


def _one_wave_case(env, comm, kind, seed):
    """A call's operands on this rank (seeds ``seed``, ``+4``, ``+6``): ``(rank, buf, l1, l2, shared weights,
    reference weights, reference shared weights, tokens)``."""
    rank, size = comm.Get_rank(), comm.Get_size()
    buf = env.get(kind, 1)
    el, h, i = buf.num_local_experts, buf.hidden, buf.intermediate_hidden
    w, wref = expert_weights(kind, buf.num_experts, h, i, seed=seed)
    l1, l2 = dea.transform_weights_for_mega_moe(*local_weights(kind, w, rank, el))
    shared, sref = shared_weights(kind, h, i, 1, seed=seed + 4)
    t = fill(kind, buf, seed=seed + 6, rank=rank, size=size)
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
        coll(call_op, kind, y, l1, l2, buf, None, num_experts_per_wave=1, shared_l1_weights=s1,
             shared_l2_weights=s2, what="fp8_fp4_mega_moe")
        ys.append(y)
    xs, sfs, idxs, wts = gathered_inputs(buf, t, True)
    exp = ref_mega_moe(xs, sfs, idxs, wts, *wref, clamp=None, shared=sref, ranks=[rank])[rank]
    all_ranks_ok(comm, all(torch.equal(ys[0].view(torch.int16), other.view(torch.int16)) for other in ys[1:])
                 and mega_calc_diff(ys[1].float(), exp.float()) < 1e-5,
                 "blocks of 3 tokens == one block == native kernel")


@pytest.mark.parametrize("kind,clamp,engine,oai", [("fp8", 10.0, None, None), ("fp8", None, None, None),
                                                   ("bf16", 10.0, None, None), ("fp8", 10.0, "fp32", None),
                                                   ("fp8", 7.0, None, (1.702, 1.0)), ("bf16", 1.5, None, (0.5, -1.0))])
@up_to_four_ranks()
def test_native_kernels_give_the_torch_paths_bits(env, comm, monkeypatch, kind, clamp, engine, oai):
    """The native kernels (FP8 row decode, SwiGLU with its FP8 round trip, the final sum) against the
    torch paths with all three switched off: ``y`` bit for bit, several waves and the shared expert,
    and within tolerance of the reference; with the default GEMM engine and the fp32 one (float32
    operands: the kernels' rows widened); plain SwiGLU and ``'swigluoai'`` (``oai``: alpha, up_bias)."""
    from deepep_ascend import native

    if engine is not None:
        monkeypatch.setenv("DEEPEP_ASCEND_MEGA_MOE_GEMM", engine)
    rank, buf, l1, l2, (s1, s2), wref, sref, t = _one_wave_case(env, comm, kind, seed=23)
    h = buf.hidden
    act = {} if oai is None else dict(activation="swigluoai", activation_alpha=oai[0], activation_up_bias=oai[1])
    ref_act = {} if oai is None else dict(activation="swigluoai", alpha=oai[0], up_bias=oai[1])
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
        coll(call_op, kind, y, l1, l2, buf, None, num_experts_per_wave=1, shared_l1_weights=s1, shared_l2_weights=s2,
             activation_clamp=clamp, **act, what=f"{kind} mega_moe")
        ys.append(y)
    xs, sfs, idxs, wts = gathered_inputs(buf, t, kind == "fp8")
    exp = ref_mega_moe(xs, sfs, idxs, wts, *wref, clamp=clamp, shared=sref, ranks=[rank], **ref_act)[rank]
    ran = {name for on, name, ok in used if on and ok}
    want = {"swiglu"} | ({"sum_rows"} if t else set()) | ({"dequant_rows_e4m3"} if kind == "fp8" else set())
    all_ranks_ok(comm, torch.equal(ys[0].view(torch.int16), ys[1].view(torch.int16))
                 and mega_calc_diff(ys[1].float(), exp.float()) < 1e-5 and (ran == want or not native.available()),
                 f"native kernels {sorted(ran)} == torch paths, bitwise")
