"""MegaMoE's weights (``deepep_ascend.mega_moe.weights``): upstream's transform order, weights changed in place
between calls, and the cache of un-transformed weights.
"""

from __future__ import annotations

import pytest
import torch

import deepep_ascend as dea
from tests.support.buffer_helpers import all_ranks_ok, coll
from tests.support.mega_moe import BF16, call_op, expert_weights, fill, gathered_inputs, local_weights
from tests.support.reference import mega_calc_diff, ref_mega_moe

pytestmark = [pytest.mark.mpi(min_size=1), pytest.mark.watchdog(240)]


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


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_weights_written_in_place_are_seen_by_the_next_call(env, comm, kind):
    """The op caches un-transformed (and oneDNN-packed) weights by tensor identity and version: negating
    the L1 weights in place between two calls must change y to the reference of the negated weights."""
    rank, size = comm.Get_rank(), comm.Get_size()
    buf = env.get(kind, 0)
    w, (r1, r2) = expert_weights(kind, buf.num_experts, buf.hidden, buf.intermediate_hidden, seed=13)
    l1, l2 = dea.transform_weights_for_mega_moe(*local_weights(kind, w, rank, buf.num_local_experts))
    t = fill(kind, buf, seed=4, rank=rank, size=size)
    xs, sfs, idxs, wts = gathered_inputs(buf, t, kind == "fp8")
    tol = 1e-6 if kind == "bf16" else 1e-5
    ys = []
    for w1_ref in (r1, -r1):
        y = torch.empty(t, buf.hidden, dtype=BF16)
        coll(call_op, kind, y, l1, l2, buf, None, what="mega_moe")
        exp = ref_mega_moe(xs, sfs, idxs, wts, w1_ref, r2, ranks=[rank])[rank]
        all_ranks_ok(comm, mega_calc_diff(y.float(), exp.float()) < tol, f"{kind}: y vs the reference")
        ys.append(y)
        if kind == "bf16":
            l1.neg_()
        else:
            l1[0].bitwise_xor_(-0x78)  # 0x88: the sign bit of both FP4 nibbles of every byte
    all_ranks_ok(comm, t == 0 or not torch.equal(ys[0], ys[1]), f"{kind}: the second call used the new weights")


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
