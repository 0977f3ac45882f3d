"""``mega_moe_experts`` (``deepep_ascend.mega_moe.expanded``): ``EPBuffer.dispatch(do_expand=True)`` → the
experts on the handle's psum layout → ``EPBuffer.combine``, against the fused ``bf16_mega_moe`` /
``fp8_fp4_mega_moe`` on the same tokens, routing and weights (docs/semantics/mega-moe.md §9).

Bitwise on an EPBuffer built with ``allow_multiple_reduction=False`` (the combine then adds each pair's
row at the origin in slot order from +0.0 and rounds once: MegaMoE's final sum); on a default EPBuffer the
combine rounds each rank's partial sum first, so ``y`` agrees within ``calc_diff < 1e-5`` (bitwise at one
rank, where there is one partial). Alignment gaps and capacity rows are filled with NaN before the call,
so a read of one would show; the last rank of a multi-rank job has no tokens and the last quarter of the
experts receives none.
"""

from __future__ import annotations

import pytest
import torch

import deepep_ascend as dea
from tests.support.buffer_helpers import all_ranks_ok, capture, coll
from tests.support.mega_moe import BF16, TMAX, K, expert_weights, local_weights
from tests.support.mpi_utils import world
from tests.support.reference import mega_calc_diff

# 1, 2 and 4 ranks (the suite's budget; the layout and the sums are the same at 8)
pytestmark = [pytest.mark.mpi(min_size=1), pytest.mark.watchdog(240),
              pytest.mark.skipif(world().Get_size() > 4, reason="run at 1, 2 and 4 ranks")]

FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def ep_buffers():
    """``{allow_multiple_reduction: EPBuffer}``, sized for the widest row of both kinds (H = 128 bf16)."""
    comm = world()
    bufs = {amr: coll(lambda amr=amr: dea.EPBuffer(comm, num_max_tokens_per_rank=TMAX, hidden=128, num_topk=K,
                                                   allow_multiple_reduction=amr, explicitly_destroy=True),
                      what="EPBuffer()")
            for amr in (False, True)}
    yield bufs
    for b in bufs.values():
        coll(b.destroy, what="destroy")


def _inputs(kind, sb, rank, size, seed):
    """This rank's tokens in ``sb``'s views and as the dispatch takes them: ``(t, x, topk_idx, topk_weights)``.
    Distinct experts per token (EPBuffer's rule), 20 % masked, the last quarter of experts cold."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    t = 0 if size > 1 and rank == size - 1 else 19 + 5 * (rank % 4)  # <= TMAX
    e, h = sb.num_experts, sb.hidden
    scores = torch.rand(t, e, generator=g)
    scores[:, e - e // 4:] = -1
    idx = scores.topk(K, dim=1).indices
    idx[torch.rand(t, K, generator=g) < 0.2] = -1
    w = torch.rand(t, K, generator=g) + 0.25
    if kind == "bf16":
        x = torch.randn(t, h, generator=g).to(BF16)
        sb.x[:t] = x
    else:
        data = (torch.randn(t, h, generator=g) * 3).to(FP8)
        sf = torch.randint(124, 130, (t, h // 32), generator=g, dtype=torch.uint8).view(torch.int32)
        sb.x[:t], sb.x_sf[:t] = data, sf
        x = (data, sf)
    sb.topk_idx[:t], sb.topk_weights[:t] = idx, w
    return t, x, idx, w


def _slot_rows(handle, n):
    """bool ``[n]``: rows holding a (token, expert) pair, from the handle's psum layout."""
    mask = torch.zeros(n, dtype=torch.bool)
    prev = 0
    for end in handle.psum_num_recv_tokens_per_expert.tolist():
        start = -(-prev // handle.expert_alignment) * handle.expert_alignment
        mask[start:end] = True
        prev = end
    return mask


def _poison(recv_x, recv_w, slot):
    """NaN (bf16 / e4m3 0x7F with scale byte 255) in every row that holds no pair."""
    gap = ~slot
    recv_w[gap] = float("nan")
    if isinstance(recv_x, tuple):
        recv_x[0].view(torch.uint8)[gap] = 0x7F
        recv_x[1][gap] = -1  # every scale byte 255
    else:
        recv_x[gap] = float("nan")


CASES = [  # (kind, activation keywords)
    ("bf16", dict(activation_clamp=0.75)),
    ("fp8", dict(activation="swigluoai", activation_clamp=7.0, activation_alpha=1.702, activation_up_bias=1.0)),
]


@pytest.mark.parametrize("kind,kw", CASES, ids=[c[0] for c in CASES])
def test_expanded_equals_fused(env, ep_buffers, comm, kind, kw):
    """Alignment 1 (one GEMM run over back-to-back experts, CPU-synced rows) and 128 (a run per expert,
    capacity rows without CPU sync, column-major FP8 scales); both EPBuffer reductions."""
    rank, size = comm.Get_rank(), comm.Get_size()
    sb = env.get(kind, 0)
    el, h, i = sb.num_local_experts, sb.hidden, sb.intermediate_hidden
    w, _ = expert_weights(kind, sb.num_experts, h, i, seed=41)
    l1, l2 = dea.transform_weights_for_mega_moe(*local_weights(kind, w, rank, el), activation=kw.get("activation",
                                                                                                     "swiglu"))
    t, x, idx, wts = _inputs(kind, sb, rank, size, seed=43)
    y = torch.empty(t, h, dtype=BF16)
    fused = dea.bf16_mega_moe if kind == "bf16" else dea.fp8_fp4_mega_moe
    coll(fused, y, l1, l2, sb, **kw, what="fused")
    for align, cpu_sync in ((1, True), (128, False)):
        for amr, ep in ep_buffers.items():
            recv_x, _, recv_w, handle, _ = coll(ep.dispatch, x, topk_idx=idx, topk_weights=wts,
                                                num_experts=sb.num_experts, expert_alignment=align, do_expand=True,
                                                do_cpu_sync=cpu_sync,
                                                use_tma_aligned_col_major_sf=not cpu_sync, what="dispatch")
            n = handle.num_expanded_tokens
            slot = _slot_rows(handle, n)
            _poison(recv_x, recv_w, slot)
            out = torch.full((n, h), float("nan"), dtype=BF16)
            res = dea.mega_moe_experts(ep, recv_x, recv_w, handle, l1, l2, **kw, out=out)
            y2, _, _ = coll(ep.combine, out, handle, what="combine")
            what = f"{kind} alignment {align} allow_multiple_reduction={amr}"
            ok = res is out and bool((out[~slot] == 0).all()) and not out[slot].isnan().any()
            all_ranks_ok(comm, ok, f"{what}: out returned, non-slot rows 0, slot rows finite")
            if not amr or size == 1:
                all_ranks_ok(comm, torch.equal(y2, y), f"{what}: y bitwise the fused op's "
                             f"(max diff {(y2.float() - y.float()).abs().max().item() if t else 0})")
            else:
                diff = mega_calc_diff(y2.float(), y.float())
                all_ranks_ok(comm, diff < 1e-5, f"{what}: calc_diff {diff:.3g} >= 1e-5")
    # every expert with rows on some rank, the cold ones with none: the layout had empty experts
    all_idx = torch.cat([torch.from_numpy(a) for a in comm.allgather(idx.numpy())]).reshape(-1)
    counts = torch.bincount(all_idx[all_idx >= 0], minlength=sb.num_experts)
    assert int((counts == 0).sum()) >= sb.num_experts // 4


def test_bad_input_raises(env, ep_buffers, comm):
    """A compact-layout handle, a handle of another buffer, weights of the wrong shape or dtype, FP8 weights
    with bf16 rows, and mismatched weights / out: each a clear error on the calling rank."""
    rank, size = comm.Get_rank(), comm.Get_size()
    sb = env.get("bf16", 0)
    el, h, i = sb.num_local_experts, sb.hidden, sb.intermediate_hidden
    w, _ = expert_weights("bf16", sb.num_experts, h, i, seed=5)
    l1, l2 = dea.transform_weights_for_mega_moe(*local_weights("bf16", w, rank, el))
    t, x, idx, wts = _inputs("bf16", sb, rank, size, seed=47)
    a, b = ep_buffers[False], ep_buffers[True]
    kw = dict(topk_idx=idx, topk_weights=wts, num_experts=sb.num_experts)
    cx, _, cw, compact, _ = coll(a.dispatch, x, **kw, what="compact dispatch")
    rx, _, rw, handle, _ = coll(a.dispatch, x, **kw, do_expand=True, what="expanded dispatch")
    wf, _ = expert_weights("fp8", sb.num_experts, 128, 128, seed=5)
    f1, f2 = dea.transform_weights_for_mega_moe(*local_weights("fp8", wf, rank, el))
    n = handle.num_expanded_tokens
    cases = [
        ("compact", lambda: dea.mega_moe_experts(a, cx, cw[:, 0].contiguous(), compact, l1, l2), ValueError,
         "compact layout"),
        ("other buffer", lambda: dea.mega_moe_experts(b, rx, rw, handle, l1, l2), ValueError, "another buffer"),
        ("not a buffer", lambda: dea.mega_moe_experts(sb, rx, rw, handle, l1, l2), TypeError, "EPBuffer"),
        ("E_l", lambda: dea.mega_moe_experts(a, rx, rw, handle, l1[:-1], l2[:-1]), ValueError, "local experts"),
        ("l2 shape", lambda: dea.mega_moe_experts(a, rx, rw, handle, l1, l2[:, :-1]), ValueError, "do not match"),
        ("dtype", lambda: dea.mega_moe_experts(a, rx, rw, handle, l1.float(), l2), TypeError, "bfloat16"),
        ("fp8 weights, bf16 rows", lambda: dea.mega_moe_experts(a, rx, rw, handle, f1, f2), TypeError, "FP8 pair"),
        ("weights dtype", lambda: dea.mega_moe_experts(a, rx, rw.double(), handle, l1, l2), TypeError,
         "recv_topk_weights"),
        ("weights shape", lambda: dea.mega_moe_experts(a, rx, torch.zeros(n + 1), handle, l1, l2), ValueError,
         f"`recv_topk_weights` must be [{n}]"),
        ("out", lambda: dea.mega_moe_experts(a, rx, rw, handle, l1, l2, out=torch.empty(n + 1, h, dtype=BF16)),
         ValueError, "`out`"),
        ("out strides", lambda: dea.mega_moe_experts(a, rx, rw, handle, l1, l2,
                                                     out=torch.empty(max(n, 1), 2 * h, dtype=BF16)[:, ::2]),
         ValueError, "(not contiguous)" if n else "`out`"),
        ("clamp", lambda: dea.mega_moe_experts(a, rx, rw, handle, l1, l2, activation_clamp=-1.0), ValueError,
         "activation_clamp"),
    ]
    bad = []
    for name, fn, exc_type, text in cases:
        _, exc = capture(fn)
        if not isinstance(exc, exc_type) or text not in str(exc) or "mega_moe_experts" not in str(exc):
            bad.append(f"{name}: {type(exc).__name__}: {exc}")
    all_ranks_ok(comm, not bad, "; ".join(bad))
    # nothing moved: the buffer serves the combine of the good call
    out = dea.mega_moe_experts(a, rx, rw, handle, l1, l2)
    coll(a.combine, out, handle, what="combine")
