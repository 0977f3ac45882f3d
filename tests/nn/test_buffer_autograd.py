"""A torch.distributed ProcessGroup as ``group``, and DeepEP's README training helpers on CPU.

The gloo group is initialised from the MPI launch (rank/size from MPI, MASTER_ADDR=127.0.0.1, a
free port picked on rank 0 and broadcast over MPI). The helpers ``get_buffer``,
``dispatch_forward``, ``dispatch_backward``, ``combine_forward`` and ``combine_backward`` below are
written as DeepEP's README ("Example use in model training or inference prefilling", DeepEP
V1, MIT licence) writes them, with ``deepep_ascend`` in place of ``deep_ep``; they are then
wrapped in ``torch.autograd.Function``s and differentiated. All comparisons are bitwise against
``tests/support/reference.py``.
"""

# ruff: noqa: UP006, UP007, UP035, UP045, PLW0602  (the README helpers are kept as DeepEP writes them)
from __future__ import annotations

import datetime
import os
import socket
from typing import List, Optional, Tuple, Union

import pytest
import torch
import torch.distributed as dist

from deepep_ascend import Buffer, EPBuffer, EventOverlap
from tests.support.buffer_helpers import (
    BF16,
    Case,
    Checker,
    all_ranks_ok,
    coll,
    make_topk_idx,
    run_case,
)
from tests.support.mpi_utils import gather_all, world
from tests.support.reference import ref_combine, ref_dispatch

pytestmark = [pytest.mark.mpi(min_size=1), pytest.mark.watchdog(180)]


@pytest.fixture(scope="module")
def group():
    """gloo WORLD group over the MPI ranks (reused if torch.distributed is already initialised)."""
    comm = world()
    created = False
    if not dist.is_initialized():
        port = None
        if comm.Get_rank() == 0:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        port = comm.bcast(port, root=0)
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group("gloo", rank=comm.Get_rank(), world_size=comm.Get_size(),
                                timeout=datetime.timedelta(seconds=60))
        created = True
    yield dist.group.WORLD
    if created:
        dist.destroy_process_group()


def test_process_group_as_group(group, comm):
    """Buffer(ProcessGroup, ...) takes rank/size from the group, keeps it as `group`, and works."""
    r, R = comm.Get_rank(), comm.Get_size()
    case = Case("process_group", tokens=20, hidden=128, experts=16, topk=4, cached=True, bias="pair")
    b = Buffer(group, Buffer.get_normal_buffer_size_hint(**case.hint_args(R)), explicitly_destroy=True)
    chk = Checker(r)
    try:
        chk.check(b.group is group, "Buffer.group is not the ProcessGroup passed in")
        chk.check(b.rank == group.rank() == r and b.group_size == group.size() == R,
                  f"rank/size {b.rank}/{b.group_size} != group's {group.rank()}/{group.size()}")
        run_case(b, comm, case, seed=4242, chk=chk)
    finally:
        coll(b.destroy, what="destroy")
    chk.finish("ProcessGroup Buffer")


def test_process_group_as_epbuffer_group(group, comm):
    """EPBuffer(ProcessGroup, ...), as DeepEP V2.5 code passes it: the group's ranks, a dispatch/combine
    round trip of unmodified rows returns each token times the ranks it reached."""
    r, R = comm.Get_rank(), comm.Get_size()
    buf = coll(lambda: EPBuffer(group, num_max_tokens_per_rank=16, hidden=64, num_topk=2, explicitly_destroy=True))
    try:
        assert buf.group is group and (buf.rank_idx, buf.num_ranks) == (group.rank(), group.size()) == (r, R)
        # distinct experts per row, as EPBuffer requires (docs/semantics/deepep-api.md §0)
        topk_idx = torch.rand(16, 2 * R, generator=torch.Generator().manual_seed(r)).topk(2, dim=1).indices
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(100 + r)).to(torch.bfloat16)
        recv_x, _, _, handle, _ = coll(lambda: buf.dispatch(x, topk_idx=topk_idx, num_experts=2 * R))
        y, _, _ = coll(lambda: buf.combine(recv_x, handle))
        reached = torch.stack([(topk_idx // 2 == j).any(1) for j in range(R)]).sum(0)
        all_ranks_ok(comm, torch.equal(y, (x.float() * reached[:, None]).to(torch.bfloat16)),
                     "EPBuffer over a ProcessGroup")
    finally:
        coll(buf.destroy, what="destroy")


# ----------------------------------------------------------------------------------------------
# DeepEP README (V1) helpers, as the README writes them (deep_ep -> deepep_ascend)

# Communication buffer (will allocate at runtime)
_buffer: Optional[Buffer] = None

# Set the number of SMs to use
# NOTES: this is a static variable
# (README: ``Buffer.set_num_sms(24)`` at import; done in the ``readme_sms`` fixture here and
# restored afterwards, so that other test modules keep the default.)


# You may call this function at the framework initialization
def get_buffer(group: dist.ProcessGroup, hidden_bytes: int) -> Buffer:
    global _buffer

    # NOTES: you may also replace `get_*_config` with your auto-tuned results via all the tests
    num_nvl_bytes, num_rdma_bytes = 0, 0
    for config in (Buffer.get_dispatch_config(group.size()), Buffer.get_combine_config(group.size())):
        num_nvl_bytes = max(config.get_nvl_buffer_size_hint(hidden_bytes, group.size()), num_nvl_bytes)
        num_rdma_bytes = max(config.get_rdma_buffer_size_hint(hidden_bytes, group.size()), num_rdma_bytes)

    # Allocate a buffer if not existed or not enough buffer size
    if (_buffer is None or _buffer.group != group or _buffer.num_nvl_bytes < num_nvl_bytes
            or _buffer.num_rdma_bytes < num_rdma_bytes):
        _buffer = Buffer(group, num_nvl_bytes, num_rdma_bytes)
    return _buffer


def get_hidden_bytes(x: torch.Tensor) -> int:
    t = x[0] if isinstance(x, tuple) else x
    return t.size(1) * max(t.element_size(), 2)


def dispatch_forward(x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
                     topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                     num_experts: int, previous_event: Optional[EventOverlap] = None) -> \
        Tuple[Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]], torch.Tensor, torch.Tensor, List, Tuple,
              EventOverlap]:
    # NOTES: an optional `previous_event` means a CUDA event captured that you want to make it as a dependency
    # of the dispatch kernel, it may be useful with communication-computation overlap. For more information, please
    # refer to the docs of `Buffer.dispatch`
    global _buffer

    # Calculate layout before actual dispatch
    num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, previous_event = \
        _buffer.get_dispatch_layout(topk_idx, num_experts,
                                    previous_event=previous_event, async_finish=True,
                                    allocate_on_comm_stream=previous_event is not None)
    # Do MoE dispatch
    # NOTES: the CPU will wait for GPU's signal to arrive, so this is not compatible with CUDA graph
    # Unless you specify `num_worst_tokens`, but this flag is for intranode only
    # For more advanced usages, please refer to the docs of the `dispatch` function
    recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event = \
        _buffer.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights,
                         num_tokens_per_rank=num_tokens_per_rank, num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
                         is_token_in_rank=is_token_in_rank, num_tokens_per_expert=num_tokens_per_expert,
                         previous_event=previous_event, async_finish=True,
                         allocate_on_comm_stream=True)
    # For event management, please refer to the docs of the `EventOverlap` class
    return recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event


def dispatch_backward(grad_recv_x: torch.Tensor, grad_recv_topk_weights: torch.Tensor, handle: Tuple) -> \
        Tuple[torch.Tensor, torch.Tensor, EventOverlap]:
    global _buffer

    # The backward process of MoE dispatch is actually a combine
    # For more advanced usages, please refer to the docs of the `combine` function
    combined_grad_x, combined_grad_recv_topk_weights, event = \
        _buffer.combine(grad_recv_x, handle, topk_weights=grad_recv_topk_weights, async_finish=True)

    # For event management, please refer to the docs of the `EventOverlap` class
    return combined_grad_x, combined_grad_recv_topk_weights, event


def combine_forward(x: torch.Tensor, handle: Tuple, previous_event: Optional[EventOverlap] = None) -> \
        Tuple[torch.Tensor, EventOverlap]:
    global _buffer

    # Do MoE combine
    # For more advanced usages, please refer to the docs of the `combine` function
    combined_x, _, event = _buffer.combine(x, handle, async_finish=True, previous_event=previous_event,
                                           allocate_on_comm_stream=previous_event is not None)

    # For event management, please refer to the docs of the `EventOverlap` class
    return combined_x, event


def combine_backward(grad_combined_x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
                     handle: Tuple, previous_event: Optional[EventOverlap] = None) -> \
        Tuple[Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]], EventOverlap]:
    global _buffer

    # The backward process of MoE combine is actually a dispatch
    # For more advanced usages, please refer to the docs of the `dispatch` function
    grad_x, _, _, _, _, event = _buffer.dispatch(grad_combined_x, handle=handle, async_finish=True,
                                                 previous_event=previous_event,
                                                 allocate_on_comm_stream=previous_event is not None)

    # For event management, please refer to the docs of the `EventOverlap` class
    return grad_x, event


# ----------------------------------------------------------------------------------------------
# autograd wrappers around the helpers (each one's backward is the other, docs/semantics/deepep-api.md §4.7)


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_weights, topk_idx, num_experts, state):
        recv_x, recv_topk_idx, recv_topk_weights, num_list, handle, event = \
            dispatch_forward(x, topk_idx, topk_weights, num_experts, previous_event=Buffer.capture())
        event.current_stream_wait()
        ctx.handle = handle
        state.update(handle=handle, recv_topk_idx=recv_topk_idx, num_list=num_list)
        return recv_x, recv_topk_weights

    @staticmethod
    def backward(ctx, grad_recv_x, grad_recv_topk_weights):
        grad_x, grad_w, event = dispatch_backward(grad_recv_x.contiguous(), grad_recv_topk_weights.contiguous(),
                                                  ctx.handle)
        event.current_stream_wait()
        return grad_x, grad_w, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, state):
        combined_x, event = combine_forward(x, state["handle"], previous_event=Buffer.capture())
        event.current_stream_wait()
        ctx.handle = state["handle"]
        return combined_x

    @staticmethod
    def backward(ctx, grad_combined_x):
        grad_x, event = combine_backward(grad_combined_x.contiguous(), ctx.handle)
        event.current_stream_wait()
        return grad_x, None


@pytest.fixture
def readme_sms():
    """The README's ``Buffer.set_num_sms(24)``, undone afterwards."""
    old = Buffer.num_sms
    Buffer.set_num_sms(24)
    yield 24
    Buffer.num_sms = old


@pytest.mark.mpi(min_size=2)  # the README's get_buffer uses DeepEP's config table: 2, 4, 8, ... ranks
def test_readme_helpers_forward_and_backward(group, comm, readme_sms):
    """dispatch_forward → expert (scale by 2^(r%3)) → combine_forward, then loss.backward() through
    combine_backward (cached dispatch) and dispatch_backward (combine with weights); also the helpers
    called directly with and without ``previous_event``. Every tensor is checked bitwise."""
    r, R = comm.Get_rank(), comm.Get_size()
    E, K, H, n = 16, 4, 128, 14 + r
    chk = Checker(r)
    gen = torch.Generator().manual_seed(2024 + r)
    idx = make_topk_idx("uniform", n, E, K, r, R, gen)
    w0 = torch.rand(n, K, generator=gen)
    x0 = torch.randn(n, H, generator=gen).to(BF16)
    g = torch.randn(n, H, generator=gen)  # d loss / d combined (float32; bf16 once it reaches combined)
    c = torch.randn(32 * R + 64, K, generator=gen)  # d loss / d recv_topk_weights (rows cut below)
    scale = 2.0 ** (r % 3)  # a power of two: the expert's forward and backward stay exact in bf16

    def run():
        b = get_buffer(group, get_hidden_bytes(x0))
        chk.check(b.group is group and b.num_nvl_bytes > 0, "README get_buffer")
        x = x0.clone().requires_grad_(True)
        w = w0.clone().requires_grad_(True)
        state = {}
        recv_x, recv_w = _Dispatch.apply(x, w, idx, E, state)
        expert_out = recv_x * scale
        combined = _Combine.apply(expert_out, state)
        loss = (combined.float() * g).sum() + (recv_w * c[:recv_w.size(0)]).sum()
        loss.backward()
        return x, w, recv_x, recv_w, combined, state

    x, w, recv_x, recv_w, combined, state = coll(run, what="README helpers under autograd")
    xs, idxs, ws, itrs = gather_all(x0), gather_all(idx), gather_all(w0), gather_all(state["handle"][4])
    scales = [2.0 ** (s % 3) for s in range(R)]
    ref = ref_dispatch(xs, idxs, ws, E, r)
    chk.same_bits(recv_x.detach(), ref.recv_x, "forward: recv_x")
    chk.same_bits(state["recv_topk_idx"], ref.recv_topk_idx, "forward: recv_topk_idx")
    chk.same_bits(recv_w.detach(), ref.recv_topk_weights, "forward: recv_topk_weights")
    chk.check(state["num_list"] == ref.num_recv_tokens_per_expert_list, "forward: per-expert list")
    # every rank's expert output, from the reference dispatch of every receiver
    outs = [ref_dispatch(xs, idxs, ws, E, s).recv_x * scales[s] for s in range(R)]
    e_comb, _ = ref_combine(outs, itrs, r)
    chk.same_bits(combined.detach(), e_comb, "forward: combined")
    # backward: d combined = bf16(g); each receiver s gets its rows (cached dispatch), times its scale
    gs = gather_all(g.to(BF16))
    recv_counts = [ref_dispatch(xs, idxs, ws, E, s).num_recv_tokens for s in range(R)]
    grad_recv = [ref_dispatch(gs, idxs, None, E, s).recv_x * scales[s] for s in range(R)]
    cs = gather_all(c)
    e_gx, e_gw = ref_combine(grad_recv, itrs, r, topk_weights=[cs[s][:recv_counts[s]] for s in range(R)])
    chk.same_bits(x.grad, e_gx, "backward: x.grad")
    chk.same_bits(w.grad, e_gw, "backward: topk_weights.grad")

    # the helpers called directly: no previous_event, then with one
    def direct():
        out = []
        for prev in (None, Buffer.capture()):
            rx, _, rw, _, handle, ev = dispatch_forward(x0, idx, w0, E, previous_event=prev)
            ev.current_stream_wait()
            cx, ev2 = combine_forward(rx, handle, previous_event=ev)
            ev2.current_stream_wait()
            gx, ev3 = combine_backward(g.to(BF16), handle, previous_event=prev)
            ev3.current_stream_wait()
            dgx, dgw, ev4 = dispatch_backward(gx, rw, handle)
            ev4.current_stream_wait()
            out.append((rx, cx, gx, dgx, dgw))
        return out

    for i, (rx, cx, gx, dgx, dgw) in enumerate(coll(direct, what="README helpers called directly")):
        tag = f"direct call {i}"
        chk.same_bits(rx, ref.recv_x, f"{tag}: dispatch_forward recv_x")
        e_cx = (x0.float() * itrs[r].sum(1, keepdim=True).float() + 0.0).to(BF16)
        chk.same_bits(cx, e_cx, f"{tag}: combine_forward == bf16(count * x)")
        chk.same_bits(gx, ref_dispatch(gs, idxs, None, E, r).recv_x, f"{tag}: combine_backward (cached dispatch)")
        e_dgx = (g.to(BF16).float() * itrs[r].sum(1, keepdim=True).float() + 0.0).to(BF16)
        chk.same_bits(dgx, e_dgx, f"{tag}: dispatch_backward x")
        chk.same_bits(dgw, torch.where(idx >= 0, w0, torch.zeros_like(w0)), f"{tag}: dispatch_backward weights")
    all_ranks_ok(comm, not chk.errors, f"rank {r}: " + "; ".join(chk.errors[:10]))
