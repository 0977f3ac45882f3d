"""MegaMoE's results do not depend on torch's default dtype: DeepGEMM's own tests set
``torch.set_default_dtype(torch.bfloat16)``, so the calls below run under a float32 and a bfloat16 default,
with the native kernels and without (every kernel unset: the torch paths), and must give the same bits and
dtypes, with the same native compute kernels run as often. A float tensor the library makes without a dtype
would be bfloat16 under the second default: its sums would round differently, or a kernel would refuse it
and leave the work to the torch path (the shared experts' unit weights once did that to the SwiGLU kernel).

Run: ``mpiexec -n N python -m pytest --with-mpi -q tests/mega_moe/test_default_dtype.py`` (N = 1, 2, 4).
"""

from __future__ import annotations

import pytest
import torch

import deepep_ascend as dea
from deepep_ascend import native
from deepep_ascend.native.loader import Kernels, kernels
from tests.support.buffer_helpers import all_ranks_ok, bits, coll, default_dtype
from tests.support.mega_moe import (
    BF16,
    E_PER_RANK,
    H_BF16,
    H_FP8,
    I_BF16,
    I_FP8,
    TMAX,
    K,
    expert_weights,
    fill,
    local_weights,
    shared_weights,
)

pytestmark = [pytest.mark.mpi(min_size=1), pytest.mark.watchdog(120)]

# the compute kernels a call runs a fixed number of times (the communication ones poll)
COUNTED = ("swiglu_bf16", "swiglu_gate_bf16", "dequant_rows_e4m3_bf16", "sum_rows_bf16")


def _weights(kind, comm, shared):
    """This rank's untransformed expert weights and the shared experts' (made under one default dtype for both
    runs: the helpers' random draws follow it)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    h, i = (H_BF16, I_BF16) if kind == "bf16" else (H_FP8, I_FP8)
    w, _ = expert_weights(kind, E_PER_RANK * size, h, i, seed=7)
    sw = shared_weights(kind, h, i, shared, seed=11)[0] if shared else (None, None)
    return local_weights(kind, w, rank, E_PER_RANK), sw


def _fused(kind, comm, weights, activation):
    """The fused op with one shared expert, on a symmetric buffer built under the current default."""
    (l1, l2), (s1, s2) = weights
    h, i = (H_BF16, I_BF16) if kind == "bf16" else (H_FP8, I_FP8)
    buf = coll(dea.get_symm_buffer_for_mega_moe, comm, E_PER_RANK * comm.Get_size(), TMAX, K, h, i,
               mma_type="bf16xbf16" if kind == "bf16" else "fp8xfp4", num_shared_experts=1,
               what="get_symm_buffer_for_mega_moe")
    try:
        l1, l2 = dea.transform_weights_for_mega_moe(l1, l2, activation=activation)
        with default_dtype(torch.float32):
            t = fill(kind, buf, seed=3, rank=comm.Get_rank(), size=comm.Get_size())
        y = torch.full((t, h), float("nan"), dtype=BF16)
        stats = torch.zeros(E_PER_RANK, dtype=torch.int32)
        fn = dea.bf16_mega_moe if kind == "bf16" else dea.fp8_fp4_mega_moe
        kw = dict(activation_alpha=1.702, activation_up_bias=1.0) if activation == "swigluoai" else {}
        coll(fn, y, l1, l2, buf, stats, activation=activation, activation_clamp=7.0, shared_l1_weights=s1,
             shared_l2_weights=s2, num_experts_per_wave=1, **kw, what=fn.__name__)
        return [y, stats]
    finally:
        coll(buf.destroy, what="destroy")


def _expanded(comm, weights):
    """``mega_moe_experts`` (FP8 rows, FP4 weights) between an EPBuffer's expanded dispatch and its combine."""
    (l1, l2), _ = weights
    rank, E = comm.Get_rank(), E_PER_RANK * comm.Get_size()
    with default_dtype(torch.float32):
        gen = torch.Generator().manual_seed(43 + rank)
        t = 0 if comm.Get_size() > 1 and rank == comm.Get_size() - 1 else 19
        idx = torch.rand(t, E, generator=gen, dtype=torch.float32).topk(K, dim=1).indices
        w = torch.rand(t, K, generator=gen, dtype=torch.float32) + 0.25
        data = (torch.randn(t, H_FP8, generator=gen, dtype=torch.float32) * 3).to(torch.float8_e4m3fn)
        sf = torch.randint(124, 130, (t, H_FP8 // 32), generator=gen, dtype=torch.uint8).view(torch.int32)
    ep = coll(dea.EPBuffer, comm, num_max_tokens_per_rank=TMAX, hidden=H_FP8, num_topk=K,
              allow_multiple_reduction=False, explicitly_destroy=True, what="EPBuffer()")
    try:
        l1, l2 = dea.transform_weights_for_mega_moe(l1, l2)
        recv_x, _, recv_w, handle, _ = coll(ep.dispatch, (data, sf), topk_idx=idx, topk_weights=w, num_experts=E,
                                            expert_alignment=1, do_expand=True, what="dispatch")
        out = dea.mega_moe_experts(ep, recv_x, recv_w, handle, l1, l2, activation_clamp=7.0)
        return [out, coll(ep.combine, out, handle, what="combine")[0]]
    finally:
        coll(ep.destroy, what="destroy")


def _counting(name, kernel, calls):
    """``kernel``, counting its calls in ``calls[name]``."""
    def run(*args):
        calls[name] = calls.get(name, 0) + 1
        return kernel(*args)
    return run


CALLS = {
    "bf16_swigluoai_shared": (lambda comm, w: _fused("bf16", comm, w, "swigluoai"), "bf16"),
    "fp8_swiglu_shared": (lambda comm, w: _fused("fp8", comm, w, "swiglu"), "fp8"),
    "fp8_expanded": (_expanded, "fp8"),
}


@pytest.mark.parametrize("kernels_on", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("call", list(CALLS))
def test_results_do_not_depend_on_the_default_dtype(comm, call, kernels_on, monkeypatch):
    """Each call's outputs under a bfloat16 default dtype equal, bit for bit and dtype for dtype, its outputs
    under float32 (and are not empty: the call ran); with the kernels, the compute kernels ran as often."""
    calls = {}
    if not kernels_on:
        for name in Kernels.__slots__:
            monkeypatch.setattr(kernels, name, None)
    elif not native.available():
        pytest.skip("the native kernels are not built")
    else:
        for name in COUNTED:
            monkeypatch.setattr(kernels, name, _counting(name, getattr(kernels, name), calls))
    run, kind = CALLS[call]
    with default_dtype(torch.float32):
        weights = _weights(kind, comm, shared=1)
    dea.clear_dequantized_weight_cache()  # each run dequantizes the weights again, under its default
    with default_dtype(torch.float32):
        want = run(comm, weights)
    want_calls = dict(calls)
    calls.clear()
    dea.clear_dequantized_weight_cache()
    with default_dtype(torch.bfloat16):
        got = run(comm, weights)
    problems = [] if want else ["no outputs"]
    for i, (a, b) in enumerate(zip(want, got)):
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(bits(a), bits(b)):
            problems.append(f"output {i}: {a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)} under bf16 default")
    if len(want) != len(got):
        problems.append(f"{len(want)} outputs vs {len(got)}")
    if calls != want_calls:
        problems.append(f"native kernel calls {want_calls} under float32, {calls} under bf16 default")
    all_ranks_ok(comm, not problems, f"rank {comm.Get_rank()}: {call}: {problems}")
