"""``async_finish`` calls crossed with another collective (DeepEP #496): even ranks run a gloo
``all_gather`` and then the call, odd ranks the call and then the ``all_gather``, and only then wait on the
call's event. A call that progresses on the Buffer's worker without the caller lets both orders finish
(docs/semantics/deepep-api.md §3.4); its outputs must equal, bit for bit, those of the same call made
synchronously with the ranks in step. A dispatch whose output shapes depend on the counts exchanges them
before it returns, so crossed it is the caller's deadlock: a timeout naming the call and the peer.
"""

from __future__ import annotations

import pytest
import torch

from deepep_ascend import Buffer, EPBuffer
from tests.support.buffer_helpers import all_ranks_ok, bits, capture, coll, make_topk_idx
from tests.support.mpi_utils import only_sizes, world

# the crossing pairs even and odd ranks: 2 and 4 ranks cover it (suite time at 8)
pytestmark = [pytest.mark.mpi(min_size=2), pytest.mark.watchdog(300),
              only_sizes(2, 4, reason="the crossed order is covered at 2 and 4 ranks")]

HIDDEN, K = 128, 2
TIMEOUT_S = 20.0  # a call that blocks its caller in the crossed order fails after this, not a hang
SHORT_TIMEOUT_S = 3.0


def _experts(R: int) -> int:
    return 4 * R


def _inputs(r: int, R: int, seed: int = 0):
    """``(x [n, H] bf16, topk_idx [n, K] int64, topk_weights [n, K] float32)``; ``n`` differs per rank."""
    gen = torch.Generator().manual_seed(4242 + 97 * seed + r)
    n = 10 + 3 * r
    idx = make_topk_idx("uniform", n, _experts(R), K, r, R, gen)
    return torch.randn(n, HIDDEN, generator=gen).to(torch.bfloat16), idx, torch.rand(n, K, generator=gen)


def _process_group():
    import torch.distributed as tdist

    from deepep_ascend.nn import dist as ep_dist

    coll(ep_dist.init_distributed, what="init_distributed")
    return tdist


def _crossed(comm, call):
    """``call()`` (an async call; returns ``(outputs, event)``) crossed with a gloo ``all_gather``: even ranks
    gather first, odd ranks call first. Returns ``(outputs, event, error)`` (the call's error, if it raised)
    after checking that the ``all_gather`` delivered every rank's value; the event is not waited on."""
    tdist = _process_group()
    r, R = comm.Get_rank(), comm.Get_size()
    mine = torch.tensor([1000 + r], dtype=torch.int64)
    got = [torch.zeros(1, dtype=torch.int64) for _ in range(R)]
    result, error = (None, None), None
    if r % 2 == 0:
        tdist.all_gather(got, mine)
        result, error = capture(call)
    else:
        try:
            result, error = capture(call)
        finally:  # even ranks wait in the all_gather: join it whatever the call did
            tdist.all_gather(got, mine)
    assert [int(t) for t in got] == [1000 + p for p in range(R)], f"all_gather delivered {got}"
    outputs, event = result if result is not None else (None, None)
    return outputs, event, error


def _wait(event):
    event.current_stream_wait()


def _tensors(obj):
    """Every tensor of ``obj`` (nested tuples / lists / named tuples), in order; other leaves as themselves."""
    if isinstance(obj, (tuple, list)):
        return [leaf for o in obj for leaf in _tensors(o)]
    return [obj]


def _same(a, b) -> bool:
    """``a`` and ``b`` (nested) are equal: tensors bit for bit with the same dtype and shape, other leaves by ==."""
    la, lb = _tensors(a), _tensors(b)
    if len(la) != len(lb):
        return False
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor):
            if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(bits(x), bits(y)):
                return False
        elif x != y:
            return False
    return True


@pytest.fixture(scope="module", params=[1, 2], ids=["one_node", "two_nodes"])
def normal(request, buffers):
    """A normal-mode Buffer over the world as one node or two simulated nodes (the internode engine)."""
    R = world().Get_size()
    nodes = request.param
    if R % nodes:
        pytest.skip(f"{R} ranks do not split into {nodes} nodes")
    rpn = R // nodes
    args = dict(num_max_tokens_per_rank=10 + 3 * (R - 1), hidden=HIDDEN, num_ranks=R, num_topk=K,
                num_experts=_experts(R))
    nvl = Buffer.get_normal_buffer_size_hint(**args, ranks_per_node=rpn)
    rdma = Buffer.get_normal_rdma_buffer_size_hint(**args, ranks_per_node=rpn) if nodes > 1 else 0
    return buffers(nvl, rdma, key=("normal", nodes), ranks_per_node=rpn, timeout_s=TIMEOUT_S)


def _layout(buf, idx, E):
    ntpr, ntprdma, ntpe, itr, _ = buf.get_dispatch_layout(idx, E)
    return dict(num_tokens_per_rank=ntpr, num_tokens_per_rdma_rank=ntprdma, is_token_in_rank=itr,
                num_tokens_per_expert=ntpe)


def test_worst_token_dispatch_cached_dispatch_and_combine(normal, comm):
    """Worst-token dispatch (static shapes), then a cached dispatch and a combine, each with ``async_finish``
    crossed with the all_gather: every rank finishes, and the outputs (rows, top-k, weights, every handle
    tensor, the padding) equal the synchronous calls' bit for bit."""
    r, R = comm.Get_rank(), comm.Get_size()
    E = _experts(R)
    x, idx, w = _inputs(r, R)
    worst = sum(10 + 3 * p for p in range(R)) + 3  # more than any rank receives: padding rows too
    layout = _layout(normal, idx, E)
    args = dict(**layout, topk_idx=idx, topk_weights=w, num_worst_tokens=worst)

    def sync_calls():
        recv_x, recv_idx, recv_w, recv_list, handle, _ = normal.dispatch(x, **args)
        cached, *_ = normal.dispatch(x, handle=handle)
        combined, combined_w, _ = normal.combine(recv_x, handle, topk_weights=recv_w)
        return (recv_x, recv_idx, recv_w, recv_list, handle), cached, (combined, combined_w)

    ref_dispatch, ref_cached, ref_combine = coll(sync_calls, what="synchronous calls")

    def dispatch():
        *outputs, event = normal.dispatch(x, **args, async_finish=True)
        return outputs, event

    outputs, event, error = _crossed(comm, dispatch)
    all_ranks_ok(comm, error is None, f"crossed worst-token dispatch raised {error!r}")
    coll(lambda: _wait(event), what="wait of the crossed dispatch")
    all_ranks_ok(comm, _same(outputs, list(ref_dispatch)),
                 "crossed async worst-token dispatch differs from the synchronous one")
    handle = outputs[4]

    def cached():
        *outputs, event = normal.dispatch(x, handle=handle, async_finish=True)
        return outputs, event

    outputs, event, error = _crossed(comm, cached)
    all_ranks_ok(comm, error is None, f"crossed cached dispatch raised {error!r}")
    coll(lambda: _wait(event), what="wait of the crossed cached dispatch")
    all_ranks_ok(comm, _same(outputs[0], ref_cached), "crossed async cached dispatch differs from the synchronous one")

    def combine():
        *outputs, event = normal.combine(ref_dispatch[0], handle, topk_weights=ref_dispatch[2], async_finish=True)
        return outputs, event

    outputs, event, error = _crossed(comm, combine)
    all_ranks_ok(comm, error is None, f"crossed combine raised {error!r}")
    coll(lambda: _wait(event), what="wait of the crossed combine")
    all_ranks_ok(comm, _same(outputs, list(ref_combine)), "crossed async combine differs from the synchronous one")


def test_handle_passed_on_before_the_event(normal, comm):
    """The handle of an async worst-token dispatch is filled by the worker: a cached dispatch and a combine
    given it before the dispatch's event completed still equal the synchronous calls bit for bit."""
    r, R = comm.Get_rank(), comm.Get_size()
    E = _experts(R)
    x, idx, w = _inputs(r, R, seed=5)
    layout = _layout(normal, idx, E)
    args = dict(**layout, topk_idx=idx, topk_weights=w, num_worst_tokens=sum(10 + 3 * p for p in range(R)))

    def calls(async_finish):
        recv_x, _, recv_w, _, handle, e1 = normal.dispatch(x, **args, async_finish=async_finish)
        cached, *_, e2 = normal.dispatch(x, handle=handle, async_finish=async_finish)
        combined, combined_w, e3 = normal.combine(recv_x, handle, topk_weights=recv_w, async_finish=async_finish)
        for event in (e3, e2, e1):
            if async_finish:
                event.current_stream_wait()
        return recv_x, handle, cached, combined, combined_w

    ref = coll(lambda: calls(False), what="synchronous calls")
    got = coll(lambda: calls(True), what="async calls, the handle passed on before the event")
    all_ranks_ok(comm, _same(got, ref), "async calls given the handle before its event differ from the synchronous")


def test_worst_tokens_below_the_count_raise_at_the_wait(normal, comm):
    """An async worst-token dispatch returns before the counts; ``num_worst_tokens`` below this rank's count
    raises ``RuntimeError`` naming it at the event's wait (this rank only: the peers complete, the Buffer stays
    usable for the next call)."""
    r, R = comm.Get_rank(), comm.Get_size()
    E = _experts(R)
    x, idx, w = _inputs(r, R, seed=1)
    layout = _layout(normal, idx, E)
    mine = coll(lambda: sum(world().allgather(layout["num_tokens_per_rank"].tolist()), []), what="counts")
    received = sum(mine[p * R + r] for p in range(R))
    worst = max(1, received - 1) if r == 0 else received + 1  # only rank 0 receives more than its worst

    def go():
        *outputs, event = normal.dispatch(x, **layout, topk_idx=idx, topk_weights=w, num_worst_tokens=worst,
                                          async_finish=True)
        return outputs, event

    outputs, event = coll(go, what="async dispatch")
    _, error = capture(lambda: event.current_stream_wait())
    if r == 0 and received > 1:
        ok = isinstance(error, RuntimeError) and f"num_worst_tokens={worst} is below the {received}" in str(error)
    else:
        ok = error is None and outputs[0].shape[0] == worst
    all_ranks_ok(comm, ok, f"rank {r}: expected the error at the wait only on rank 0, got {error!r}")
    # the Buffer is usable: a synchronous call with room for every row
    recv_x, *_ = coll(lambda: normal.dispatch(x, **layout, topk_idx=idx, topk_weights=w, num_worst_tokens=received + 1),
                      what="dispatch after the error")
    all_ranks_ok(comm, recv_x.shape[0] == received + 1, "dispatch after the error")


def test_low_latency_dispatch(buffers, comm):
    """``low_latency_dispatch(async_finish=True)`` crossed with the all_gather equals the synchronous call."""
    r, R = comm.Get_rank(), comm.Get_size()
    E, m = _experts(R), 10 + 3 * R  # more than any rank's tokens
    buf = buffers.low_latency(m, HIDDEN, E, timeout_s=TIMEOUT_S)
    x, idx, _ = _inputs(r, R, seed=2)

    def sync_call():
        recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(x, idx, m, E)
        return recv_x, recv_count, handle

    ref = coll(sync_call, what="synchronous LL dispatch")

    def call():
        recv_x, recv_count, handle, event, _ = buf.low_latency_dispatch(x, idx, m, E, async_finish=True)
        return (recv_x, recv_count, handle), event

    outputs, event, error = _crossed(comm, call)
    all_ranks_ok(comm, error is None, f"crossed LL dispatch raised {error!r}")
    coll(lambda: _wait(event), what="wait of the crossed LL dispatch")
    all_ranks_ok(comm, _same(outputs, ref), "crossed async LL dispatch differs from the synchronous one")


def test_ep_buffer_dispatch_without_cpu_sync(comm):
    """``EPBuffer.dispatch(do_cpu_sync=False, async_with_compute_stream=True)`` (static shapes) crossed with the
    all_gather: the outputs and the handle equal the synchronous call's, and a combine through either handle
    gives the same rows."""
    r, R = comm.Get_rank(), comm.Get_size()
    E = _experts(R)
    max_tokens = 10 + 3 * (R - 1)
    ep = coll(lambda: EPBuffer(world(), num_max_tokens_per_rank=max_tokens, hidden=HIDDEN, num_topk=K,
                               explicitly_destroy=True, num_cpu_timeout_secs=int(TIMEOUT_S)), what="EPBuffer()")
    try:
        x, idx, w = _inputs(r, R, seed=3)
        args = dict(topk_idx=idx, topk_weights=w, num_experts=E, do_cpu_sync=False)
        ref_x, ref_idx, ref_w, ref_handle, _ = coll(lambda: ep.dispatch(x, **args), what="synchronous dispatch")

        def call():
            *outputs, event = ep.dispatch(x, **args, async_with_compute_stream=True)
            return outputs, event

        outputs, event, error = _crossed(comm, call)
        all_ranks_ok(comm, error is None, f"crossed EPBuffer dispatch raised {error!r}")
        coll(lambda: _wait(event), what="wait of the crossed EPBuffer dispatch")
        got_x, got_idx, got_w, handle = outputs
        ok = _same((got_x, got_idx, got_w), (ref_x, ref_idx, ref_w))
        for name in ("num_recv_tokens", "num_expanded_tokens", "num_recv_tokens_per_expert_list",
                     "psum_num_recv_tokens_per_scaleup_rank", "psum_num_recv_tokens_per_rank",
                     "psum_num_recv_tokens_per_expert", "num_unaligned_recv_tokens_per_expert",
                     "recv_src_metadata", "dst_buffer_slot_idx"):
            ok = ok and _same(getattr(handle, name), getattr(ref_handle, name))
        all_ranks_ok(comm, ok, "crossed async EPBuffer dispatch differs from the synchronous one")
        y = (ref_x.float() * 0.5).to(torch.bfloat16)
        ref_c, *_ = coll(lambda: ep.combine(y, ref_handle), what="combine through the synchronous handle")
        got_c, *_ = coll(lambda: ep.combine(y, handle), what="combine through the async handle")
        all_ranks_ok(comm, _same(got_c, ref_c), "combine through the async handle differs")
    finally:
        coll(ep.destroy, what="destroy")


def test_count_dependent_dispatch_crossed_times_out_naming_the_call(comm):
    """Without ``num_worst_tokens`` the outputs' shapes depend on the counts, so even with ``async_finish`` the
    dispatch exchanges them before it returns (as DeepEP's CPU sync does): crossed with the all_gather, the
    odd ranks wait for the even ones, which wait in the all_gather. The odd ranks raise a ``TimeoutError``
    within the deadline naming the dispatch call and the ranks they waited for; the even ranks, told of it,
    raise a ``TimeoutError`` too."""
    r, R = comm.Get_rank(), comm.Get_size()
    E = _experts(R)
    buf = coll(lambda: Buffer(None, Buffer.get_normal_buffer_size_hint(10 + 3 * (R - 1), HIDDEN, R, K, E),
                              comm=world(), explicitly_destroy=True, timeout_s=SHORT_TIMEOUT_S), what="Buffer()")
    x, idx, w = _inputs(r, R, seed=4)
    layout = _layout(buf, idx, E)

    def call():
        *outputs, event = buf.dispatch(x, **layout, topk_idx=idx, topk_weights=w, async_finish=True)
        return outputs, event

    _, _, error = _crossed(comm, call)
    evens = [p for p in range(R) if p % 2 == 0]
    if r % 2:
        ok = (isinstance(error, TimeoutError) and "dispatch call #" in str(error)
              and f"waiting for rank(s) {evens}" in str(error))
    else:
        ok = isinstance(error, TimeoutError)
    coll(buf.destroy, what="destroy after the timeout")
    all_ranks_ok(comm, ok, f"rank {r}: expected a TimeoutError naming the dispatch call and ranks {evens}, "
                           f"got {error!r}")
