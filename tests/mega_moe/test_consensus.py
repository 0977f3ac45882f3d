"""Errors on every rank (``deepep_ascend.mega_moe.consensus``): a call that one rank rejects, or on which the
ranks disagree, raises on every rank before anything moves; a rank that skips a call, fails after the
ranks agreed, or times out as the others arrive is named, not waited for.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import deepep_ascend as dea
from deepep_ascend import ConsensusError
from tests.support.buffer_helpers import all_ranks_ok, capture, coll
from tests.support.mega_moe import BF16, H_FP8, I_FP8, expert_weights, fill, gathered_inputs, local_weights
from tests.support.mpi_utils import allgather_object, up_to_four_ranks
from tests.support.reference import mega_calc_diff, ref_mega_moe

pytestmark = [pytest.mark.mpi(min_size=1), pytest.mark.watchdog(240)]


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
@up_to_four_ranks()
def test_errors_on_every_rank(env, comm, backend):
    rank, size = comm.Get_rank(), comm.Get_size()
    last = size - 1
    buf = env.get("bf16", 0, backend)
    el, h, i = buf.num_local_experts, buf.hidden, buf.intermediate_hidden
    w, wref = expert_weights("bf16", buf.num_experts, h, i, seed=7)
    l1, l2 = dea.transform_weights_for_mega_moe(*local_weights("bf16", w, rank, el))
    t = fill("bf16", buf, seed=4, rank=rank, size=size)
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
    fw, _ = expert_weights("fp8", fbuf.num_experts, H_FP8, I_FP8, seed=1)
    f1, f2 = dea.transform_weights_for_mega_moe(*local_weights("fp8", fw, rank, el))
    fy = torch.empty(0, H_FP8, dtype=BF16)
    _expect_everywhere(comm, lambda: dea.fp8_fp4_mega_moe(fy, f1, f2, fbuf, recipe=(1, 128, 128)), None, ValueError,
                       "recipe")
    _expect_everywhere(comm, lambda: dea.fp8_fp4_mega_moe(fy, (f1[0].view(torch.uint8), f1[1]), f2, fbuf), None,
                       TypeError, "fp4 data dtype")
    _expect_everywhere(comm, lambda: dea.fp8_fp4_mega_moe(fy, (f1[0].to("meta"), f1[1]) if rank == last else f1, f2,
                                                          fbuf), last, ValueError, "meta fp4 data on the last rank")
    _expect_everywhere(comm, lambda: call(y, l1, l2, buf, torch.zeros(el + 1, dtype=torch.int32)), None, ValueError,
                       "stats shape")
    # tensors the call would write but torch would refuse to after the data moved: refused before the ranks agree
    # (a rank failing after that would leave the buffer aborted), on the last rank only
    _expect_everywhere(comm, lambda: call(y, l1, l2, buf, torch.zeros(1, dtype=torch.int32).expand(el)
                                          if rank == last and el > 1 else torch.zeros(el, dtype=torch.int64)
                                          if rank == last else None), last, (ValueError, TypeError),
                       "expanded (or int64) stats on the last rank")
    grad_y = torch.empty(t, h, dtype=BF16, requires_grad=True) if rank == last else y
    _expect_everywhere(comm, lambda: call(grad_y, l1, l2, buf), last, RuntimeError, "y requiring grad on the last rank")
    with torch.inference_mode():
        inf_y = torch.empty(t, h, dtype=BF16)
    _expect_everywhere(comm, lambda: call(inf_y if rank == last else y, l1, l2, buf), last, RuntimeError,
                       "an inference-mode y on the last rank")
    _expect_everywhere(comm, lambda: call(y, l1, l2, buf, fast_math="no" if rank == last else True), last, TypeError,
                       "a string fast_math on the last rank")
    _expect_everywhere(comm, lambda: dea.fp8_fp4_mega_moe(fy, f1, f2, fbuf, recipe=32), None, ValueError,
                       "an int recipe")
    _, exc = capture(lambda: setattr(buf, "topk_idx", buf.topk_idx.clone()))
    all_ranks_ok(comm, isinstance(exc, AttributeError) and "fill it in place" in str(exc),
                 f"rebinding a view: {exc!r}")
    _, exc = capture(lambda: delattr(buf, "x"))
    all_ranks_ok(comm, isinstance(exc, AttributeError) and "cannot be deleted" in str(exc), f"deleting a view: {exc!r}")
    saved_w = buf.topk_weights.clone()
    buf.topk_weights *= 0.5  # in place: the same view stored back
    all_ranks_ok(comm, torch.equal(buf.topk_weights, saved_w * 0.5), "augmented assignment of a view")
    buf.topk_weights.copy_(saved_w)
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
    # the activation's arguments (docs/semantics/mega-moe.md §1.3), bad on every rank, then on the last one only
    for bad, match in ((dict(activation="gelu"), "activation must be one of"),
                       (dict(activation="swigluoai", activation_clamp=-7.0), "activation_clamp must be None or"),
                       (dict(activation="swigluoai", activation_alpha=float("nan")), "activation_alpha must be"),
                       (dict(activation="swigluoai", activation_up_bias=float("inf")), "activation_up_bias must be"),
                       (dict(activation_alpha=1.702, activation_up_bias=1.0), "activation='swiglu' needs")):
        _, exc = capture(lambda bad=bad: call(y, l1, l2, buf, **bad))
        all_ranks_ok(comm, isinstance(exc, ValueError) and match in str(exc), f"{bad}: {exc!r}")
        _expect_everywhere(comm, lambda bad=bad: call(y, l1, l2, buf, **(bad if rank == last else {})), last,
                           ValueError, f"{bad} on the last rank")
    if size > 1:  # each rank's experts serve every rank's tokens: one activation for all
        for name, mine, other in (("activation", "swiglu", "swigluoai"), ("activation_alpha", 1.702, 1.5),
                                  ("activation_up_bias", 1.0, 0.0)):
            kw = dict(activation="swigluoai", activation_alpha=1.702, activation_up_bias=1.0)
            kw[name] = other if rank == last else mine
            if kw["activation"] == "swiglu":
                kw.update(activation_alpha=1.0, activation_up_bias=0.0)
            _, exc = capture(lambda kw=kw: call(y, l1, l2, buf, **kw))
            all_ranks_ok(comm, isinstance(exc, ConsensusError) and f"disagree on {name}" in str(exc)
                         and f"rank {last}: {other!r}" in str(exc), f"{name} differs on the last rank: {exc!r}")
    # transform and the buffer take both activations and refuse others
    _, exc = capture(lambda: dea.transform_weights_for_mega_moe(l1, l2, activation="gelu"))
    assert isinstance(exc, ValueError) and "activation must be one of ('swiglu', 'swigluoai')" in str(exc), exc
    # transform rejects sizes its layout cannot take
    _, exc = capture(lambda: dea.transform_weights_for_mega_moe(torch.zeros(1, 12, 8, dtype=BF16),
                                                                torch.zeros(1, 8, 6, dtype=BF16)))
    assert isinstance(exc, ValueError), exc
    # the buffer still works after all that
    stats = torch.zeros(el, dtype=torch.int32)
    coll(call, y, l1, l2, buf, stats, what="after errors")
    xs, sfs, idxs, wts = gathered_inputs(buf, t, False)
    exp = ref_mega_moe(xs, sfs, idxs, wts, *wref, ranks=[rank])[rank]
    all_ranks_ok(comm, mega_calc_diff(y.float(), exp.float()) < 1e-6, "call after rejected calls")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("backend", ["shm", "buffer"])
@up_to_four_ranks()
def test_a_rank_that_skips_a_call_is_named_not_waited_for(comm, backend):
    """The call's consensus has the buffer's deadline: the ranks that called raise ``TimeoutError`` naming the
    rank that did not, and that rank's late call fails at once (the Buffer was aborted), instead of a hang."""
    rank, size = comm.Get_rank(), comm.Get_size()
    last = size - 1
    buf = coll(dea.get_symm_buffer_for_mega_moe, comm, 2 * size, 8, 2, 64, 16, mma_type="bf16xbf16", timeout_s=2.0,
               backend=backend, what="symm buffer with a 2 s deadline")
    try:
        w, _ = expert_weights("bf16", 2 * size, 64, 16, seed=3)
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
        w, _ = expert_weights("bf16", el * size, 64, 16, seed=3)
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
@up_to_four_ranks()
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
        w, _ = expert_weights("bf16", 2 * size, 64, 16, seed=3)
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
