"""Results do not depend on torch's default dtype: DeepEP's own tests set ``torch.set_default_dtype(torch.bfloat16)``
(their ``init_dist``), so the calls below (normal mode, low-latency mode and ``EPBuffer``, on one node and on two
simulated nodes) run under a float32 and a bfloat16 default, with the native kernels and without (every kernel
unset: the torch paths), and must give the same bits and dtypes. A float tensor the
library makes without a dtype would be bfloat16 under the second default: its sums would round differently, and
a native kernel writing float32 into it would write past its end.

Run: ``mpiexec -n N python -m pytest --with-mpi -q tests/ep/test_default_dtype.py`` (N = 1, 2, 4).
"""

from __future__ import annotations

import pytest
import torch

from deepep_ascend import Buffer, EPBuffer, native
from deepep_ascend.native.loader import Kernels, kernels
from tests.support.buffer_helpers import BF16, all_ranks_ok, bits, coll, default_dtype, make_topk_idx

pytestmark = [pytest.mark.mpi(min_size=1), pytest.mark.watchdog(120)]

N, H, K, E_PER_RANK, M = 12, 256, 4, 4, 16


def _inputs(comm):
    """``(x [N, H] bf16, topk_idx [N, K], topk_weights [N, K] float32)`` of this rank (made under one default dtype
    for both runs: the routing helper's scores follow it)."""
    r, R = comm.Get_rank(), comm.Get_size()
    gen = torch.Generator().manual_seed(5 + r)
    idx = make_topk_idx("uniform", N, E_PER_RANK * R, K, r, R, gen)
    x = torch.randn(N, H, generator=gen, dtype=torch.float32).to(BF16)
    return x, idx, torch.rand(N, K, generator=gen, dtype=torch.float32)


def _experts(recv_x):
    return (recv_x.float() * 1.375).to(BF16)


def _nodes(comm, nodes: int) -> dict:
    """``ranks_per_node`` keywords of ``nodes`` simulated nodes (none for one)."""
    return {} if nodes == 1 else {"ranks_per_node": comm.Get_size() // nodes}


def _normal(comm, inputs, nodes=1):
    x, idx, w = inputs
    R, E = comm.Get_size(), E_PER_RANK * comm.Get_size()
    kw = _nodes(comm, nodes)
    rdma = 0 if nodes == 1 else Buffer.get_normal_rdma_buffer_size_hint(N, H, R, R // nodes, num_topk=K,
                                                                           num_experts=E)
    buf = Buffer(None, Buffer.get_normal_buffer_size_hint(N, H, R, K, E, **kw), rdma, comm=comm,
                 explicitly_destroy=True, **kw)
    try:
        ntpr, ntprr, ntpe, itr, _ = buf.get_dispatch_layout(idx, E)
        recv_x, recv_idx, recv_w, _, handle, _ = buf.dispatch(
            x, num_tokens_per_rank=ntpr, num_tokens_per_rdma_rank=ntprr, is_token_in_rank=itr,
            num_tokens_per_expert=ntpe, topk_idx=idx, topk_weights=w)
        gen = torch.Generator().manual_seed(11 + comm.Get_rank())
        bias = tuple(torch.randn(N, H, generator=gen, dtype=torch.float32).to(BF16) for _ in range(2))
        combined, combined_w, _ = buf.combine(_experts(recv_x), handle, topk_weights=recv_w, bias=bias)
        return [t.clone() for t in (recv_x, recv_idx, recv_w, combined, combined_w)]
    finally:
        coll(buf.destroy, what="destroy")


def _low_latency(comm, inputs, nodes=1):
    x, idx, w = inputs
    R, E = comm.Get_size(), E_PER_RANK * comm.Get_size()
    buf = Buffer(None, 0, Buffer.get_low_latency_rdma_size_hint(M, H, R, E), low_latency_mode=True, comm=comm,
                 num_qps_per_rank=E_PER_RANK, explicitly_destroy=True, **_nodes(comm, nodes))
    try:
        (fp8, scales), count, _, _, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=True)
        out = [fp8.clone(), scales.clone(), count.clone()]
        recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
        y = _experts(recv_x)
        out.append(buf.low_latency_combine(y, idx, w, handle)[0])
        out.append(buf.low_latency_combine(y, idx, w, handle, use_logfmt=True)[0])
        return out
    finally:
        coll(buf.destroy, what="destroy")


def _ep(comm, inputs, nodes=1):
    x, idx, w = inputs
    E = E_PER_RANK * comm.Get_size()
    buf = EPBuffer(comm, num_max_tokens_per_rank=N, hidden=H, num_topk=K, explicitly_destroy=True,
                   **_nodes(comm, nodes))
    try:
        out = []
        for do_expand in (False, True):
            recv_x, _, recv_w, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E,
                                                        expert_alignment=4 if do_expand else 1, do_expand=do_expand,
                                                        do_zero_padding=do_expand)
            combined, combined_w, _ = buf.combine(_experts(recv_x), handle, topk_weights=recv_w)
            out += [recv_x.clone(), recv_w.clone(), combined, combined_w]
            if not do_expand:  # a cached dispatch with weights (they travel as bytes), and one without weights
                recv_x, _, recv_w, _, _ = buf.dispatch(x, handle=handle, topk_weights=w)
                out += [recv_x.clone(), recv_w.clone()]
                recv_x, _, recv_w, handle, _ = buf.dispatch(x, topk_idx=idx, num_experts=E)
                out += [recv_x.clone(), buf.combine(_experts(recv_x), handle)[0]]
        return out
    finally:
        coll(buf.destroy, what="destroy")


def _swiglu(comm, inputs):
    gen = torch.Generator().manual_seed(9 + comm.Get_rank())
    h = (torch.randn(N, 2 * H, generator=gen, dtype=torch.float32) * 3).to(BF16)
    weights = torch.rand(N, generator=gen, dtype=torch.float32)
    out = torch.empty(N, H, dtype=BF16)
    ran = native.swiglu(out, h, weights)
    return [out] if ran else []


CALLS = {"normal": _normal, "low_latency": _low_latency, "ep_buffer": _ep, "swiglu": _swiglu,
         "normal_2_nodes": lambda comm, inputs: _normal(comm, inputs, 2),
         "low_latency_2_nodes": lambda comm, inputs: _low_latency(comm, inputs, 2),
         "ep_buffer_2_nodes": lambda comm, inputs: _ep(comm, inputs, 2)}


@pytest.mark.parametrize("kernels_on", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("call", list(CALLS))
def test_results_do_not_depend_on_the_default_dtype(comm, call, kernels_on, monkeypatch):
    """Each call's outputs under a bfloat16 default dtype equal, bit for bit and dtype for dtype, its outputs
    under float32 (and are not empty: the call ran)."""
    if not kernels_on:
        for name in Kernels.__slots__:
            monkeypatch.setattr(kernels, name, None)
    elif not native.available():
        pytest.skip("the native kernels are not built")
    if call.endswith("2_nodes") and comm.Get_size() % 2:
        pytest.skip("two simulated nodes need an even number of ranks")
    run = CALLS[call]
    with default_dtype(torch.float32):
        inputs = _inputs(comm)
        want = run(comm, inputs)
    with default_dtype(torch.bfloat16):
        got = run(comm, inputs)
    problems = []
    if call != "swiglu" or kernels_on:
        if not want:
            problems.append("no outputs")
    for i, (a, b) in enumerate(zip(want, got)):
        if a is None or b is None:
            if (a is None) != (b is None):
                problems.append(f"output {i}: {a is None=} but {b is None=}")
        elif a.dtype != b.dtype or a.shape != b.shape or not torch.equal(bits(a), bits(b)):
            problems.append(f"output {i}: {a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)} under bf16 default")
    if len(want) != len(got):
        problems.append(f"{len(want)} outputs vs {len(got)}")
    all_ranks_ok(comm, not problems, f"rank {comm.Get_rank()}: {call}: {problems}")
