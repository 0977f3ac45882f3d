"""The handles as named tuples: DeepEP's entries in DeepEP's order, still tuples, and a plain tuple of
the same entries works wherever a handle does (normal, internode and low-latency mode, autograd).

Run: ``mpiexec -n N python -m pytest --with-mpi -q tests/ep/test_handles.py`` (N = 1, 2, 4; the
internode case needs N >= 2).
"""

from __future__ import annotations

import pytest
import torch

from deepep_ascend import Buffer
from deepep_ascend.ep import InternodeHandle, IntranodeHandle, LowLatencyHandle
from deepep_ascend.nn import autograd as ag
from tests.support.buffer_helpers import (
    BF16,
    all_ranks_ok,
    bits,
    capture,
    coll,
    make_topk_idx,
)

N, H, K = 16, 128, 2
E_PER_RANK = 4
M = 32  # low-latency num_max_dispatch_tokens_per_rank


def test_fields_are_deepeps_entries_in_deepeps_order():
    """The field names are DeepEP V1's (``deep_ep/buffer.py``), so ``handle[i]`` means what it means there."""
    assert IntranodeHandle._fields == ("rank_prefix_matrix", "channel_prefix_matrix", "recv_channel_prefix_matrix",
                                       "recv_src_idx", "is_token_in_rank", "send_head")
    assert InternodeHandle._fields == ("is_token_in_rank", "rdma_channel_prefix_matrix", "gbl_channel_prefix_matrix",
                                       "recv_rdma_channel_prefix_matrix", "recv_rdma_rank_prefix_sum",
                                       "recv_gbl_channel_prefix_matrix", "recv_gbl_rank_prefix_sum", "recv_src_meta",
                                       "send_rdma_head", "send_nvl_head")
    assert LowLatencyHandle._fields == ("src_info", "layout_range", "num_max_dispatch_tokens_per_rank", "hidden",
                                        "num_experts")
    t = torch.zeros(1)
    h = LowLatencyHandle(t, t, 3, 128, 8)
    assert isinstance(h, tuple) and h == (t, t, 3, 128, 8) and h[2:] == (3, 128, 8) and h.hidden == 128


def _inputs(comm, seed):
    r, R = comm.Get_rank(), comm.Get_size()
    gen = torch.Generator().manual_seed(seed * 7 + r)
    idx = make_topk_idx("uniform", N, E_PER_RANK * R, K, r, R, gen)
    return torch.randn(N, H, generator=gen).to(BF16), idx, torch.rand(N, K, generator=gen)


def _round_trip(buf, comm, kind):
    """A dispatch, then with its handle, with ``tuple(handle)`` and with ``list(handle)``: a cached dispatch and
    a combine each. Returns ``(handle, [(cached recv_x, combined_x, combined weights) per form])``."""
    x, idx, w = _inputs(comm, 3)
    E = E_PER_RANK * comm.Get_size()

    def go():
        ntpr, ntprr, ntpe, itr, _ = buf.get_dispatch_layout(idx, E)
        recv_x, _, recv_w, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=ntpr, num_tokens_per_rdma_rank=ntprr,
                                                       is_token_in_rank=itr, num_tokens_per_expert=ntpe,
                                                       topk_idx=idx, topk_weights=w)
        outs = []
        for form in (handle, tuple(handle), list(handle)):
            cached = buf.dispatch(x, handle=form)[0]
            combined, combined_w, _ = buf.combine(recv_x, form, topk_weights=recv_w)
            outs.append((cached, combined, combined_w))
        return handle, outs

    return coll(go, what=f"{kind} dispatch / cached dispatch / combine with each form of the handle")


def _same_outputs(outs):
    first = outs[0]
    return all(all(torch.equal(bits(a), bits(b)) for a, b in zip(first, o)) for o in outs[1:])


@pytest.mark.mpi(min_size=1)
def test_intranode_handle_is_named_and_plain_tuples_work(comm):
    R = comm.Get_size()
    buf = Buffer(None, Buffer.get_normal_buffer_size_hint(N, H, R, K, E_PER_RANK * R), comm=comm,
                 explicitly_destroy=True)
    try:
        handle, outs = _round_trip(buf, comm, "intranode")
        named = isinstance(handle, IntranodeHandle) and handle.recv_src_idx is handle[3] \
            and handle.is_token_in_rank is handle[4] and handle.rank_prefix_matrix.shape == (R, R)
        all_ranks_ok(comm, named, f"dispatch returned a {type(handle).__name__}, not an IntranodeHandle")
        all_ranks_ok(comm, _same_outputs(outs), "tuple(handle) / list(handle) gave other results than the handle")
    finally:
        coll(buf.destroy, what="destroy")


@pytest.mark.mpi(min_size=2)
def test_internode_handle_is_named_and_plain_tuples_work(comm):
    R = comm.Get_size()
    rpn = R // 2
    kw = {"num_topk": K, "num_experts": E_PER_RANK * R}
    buf = Buffer(None, Buffer.get_normal_buffer_size_hint(N, H, R, ranks_per_node=rpn, **kw),
                 Buffer.get_normal_rdma_buffer_size_hint(N, H, R, rpn, **kw), comm=comm, explicitly_destroy=True,
                 ranks_per_node=rpn)
    try:
        handle, outs = _round_trip(buf, comm, "internode")
        named = isinstance(handle, InternodeHandle) and handle.recv_src_meta is handle[7] \
            and handle.recv_gbl_rank_prefix_sum.shape == (R,) and handle.send_rdma_head.shape == (N, 2)
        all_ranks_ok(comm, named, f"dispatch returned a {type(handle).__name__}, not an InternodeHandle")
        all_ranks_ok(comm, _same_outputs(outs), "tuple(handle) / list(handle) gave other results than the handle")
    finally:
        coll(buf.destroy, what="destroy")


@pytest.mark.mpi(min_size=1)
def test_a_plain_tuple_of_another_buffers_handle_is_still_refused(comm):
    """The Buffer knows which dispatch made a handle by the identity of its tensors, which a plain tuple keeps."""
    R = comm.Get_size()
    size = Buffer.get_normal_buffer_size_hint(N, H, R, K, E_PER_RANK * R)
    bufs = [Buffer(None, size, comm=comm, explicitly_destroy=True) for _ in range(2)]
    try:
        x, idx, w = _inputs(comm, 5)

        def dispatch_on_first():
            ntpr, _, ntpe, itr, _ = bufs[0].get_dispatch_layout(idx, E_PER_RANK * R)
            return bufs[0].dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=itr, num_tokens_per_expert=ntpe,
                                    topk_idx=idx, topk_weights=w)

        recv_x, _, _, _, handle, _ = coll(dispatch_on_first, what="dispatch on the first Buffer")
        _, exc = capture(lambda: bufs[1].combine(recv_x, tuple(handle)))
        all_ranks_ok(comm, isinstance(exc, ValueError) and "another Buffer" in str(exc),
                     f"combine on the second Buffer with tuple(handle) of the first: {exc!r}")
    finally:
        for b in bufs:
            coll(b.destroy, what="destroy")


def _still_gives(buf, comm, dispatch, reference, what: str) -> None:
    """On every rank: a dispatch (``dispatch()``) and the combine of its rows give ``reference`` (combined_x and
    weights) bit for bit; ``what`` says when, in the messages."""
    recv_x, _, recv_w, _, handle, _ = coll(dispatch, what=f"dispatch {what}")
    again = coll(lambda: buf.combine(recv_x, handle, topk_weights=recv_w)[:2], what=f"combine {what}")
    all_ranks_ok(comm, all(torch.equal(bits(a), bits(b)) for a, b in zip(again, reference)),
                 f"the Buffer {what} gave other results")


@pytest.mark.mpi(min_size=1)
def test_a_handle_written_since_its_dispatch_is_checked_in_full_again(comm, monkeypatch):
    """A synchronous dispatch seals its handle: handed back unchanged it skips the full check (the engine's
    own tensors, valid as made). A handle rebuilt with another tensor, or one from an ``async_finish`` dispatch
    (filled on the worker), gets the full check, which refuses bad values on every rank. A write into one of its
    tensors through torch is refused naming the entry. A write through ``.numpy()`` leaves no version mark: the
    rows the handle promises are read again all the same, so such a handle is refused too and the Buffer stays
    usable."""
    import deepep_ascend.ep.buffer as buffer_mod

    R, r = comm.Get_size(), comm.Get_rank()
    E = E_PER_RANK * R
    buf = Buffer(None, Buffer.get_normal_buffer_size_hint(N, H, R, K, E), comm=comm, explicitly_destroy=True)
    full_checks = []
    real = buffer_mod.check_intranode_handle
    monkeypatch.setattr(buffer_mod, "check_intranode_handle",
                        lambda *a, **kw: (full_checks.append(1), real(*a, **kw))[1])
    try:
        x, idx, w = _inputs(comm, 11)
        ntpr, _, ntpe, itr, _ = buf.get_dispatch_layout(idx, E)

        def dispatch(**kw):
            return buf.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=itr, num_tokens_per_expert=ntpe,
                                topk_idx=idx, topk_weights=w, **kw)

        recv_x, _, recv_w, _, handle, _ = coll(dispatch, what="dispatch")
        reference = coll(lambda: buf.combine(recv_x, handle, topk_weights=recv_w)[:2], what="combine")
        cached = coll(lambda: buf.dispatch(x, handle=handle)[0], what="cached dispatch")
        all_ranks_ok(comm, not full_checks and torch.equal(bits(cached), bits(recv_x)),
                     f"an unchanged sealed handle: {len(full_checks)} full checks")

        # rebuilt with a copy of one tensor: the copy is not the dispatch's, so everything is checked (and passes)
        rebuilt = handle._replace(send_head=handle.send_head.clone())
        again = coll(lambda: buf.combine(recv_x, rebuilt, topk_weights=recv_w)[:2], what="combine, rebuilt handle")
        all_ranks_ok(comm, len(full_checks) == 1 and all(torch.equal(bits(a), bits(b))
                                                         for a, b in zip(again, reference)),
                     f"a rebuilt handle: {len(full_checks)} full checks, or other results")

        # an async dispatch's handle is never sealed
        recv_a, _, recv_wa, _, handle_a, event = coll(lambda: dispatch(async_finish=True), what="async dispatch")
        event.current_stream_wait()
        coll(lambda: buf.combine(recv_a, handle_a, topk_weights=recv_wa), what="combine, async dispatch's handle")
        all_ranks_ok(comm, len(full_checks) == 2, f"an async dispatch's handle: {len(full_checks)} full checks")

        # written in place, promising more rows than recv_src_idx holds: refused again, on every rank; the same
        # written through numpy, which bumps no version counter (the seal still matches)
        for write, says in ((lambda h: h.rank_prefix_matrix.__setitem__(-1, h.rank_prefix_matrix[-1] + 10 ** 6),
                             "`handle.rank_prefix_matrix` was written in place"),
                            (lambda h: h.rank_prefix_matrix.numpy().__setitem__(-1, h.rank_prefix_matrix.numpy()[-1]
                                                                               + 1), "promises more rows")):
            recv_x, _, recv_w, _, handle, _ = coll(dispatch, what="dispatch")
            write(handle)
            checks_before = len(full_checks)
            _, exc = capture(lambda: buf.combine(recv_x, handle, topk_weights=recv_w))
            all_ranks_ok(comm, isinstance(exc, ValueError) and says in str(exc),
                         f"rank {r}: combine with a handle written in place: {exc!r}")
            _, exc = capture(lambda: buf.dispatch(x, handle=handle))
            all_ranks_ok(comm, isinstance(exc, ValueError) and says in str(exc),
                         f"rank {r}: cached dispatch with a handle written in place: {exc!r}")
            full_checks[checks_before:] = []
        _still_gives(buf, comm, dispatch, reference, "after refusing written handles")
    finally:
        coll(buf.destroy, what="destroy")


@pytest.mark.mpi(min_size=1)
def test_a_handle_edited_in_place_with_its_counts_kept_is_refused_on_every_rank(comm):
    """Two entries of one rank's ``is_token_in_rank`` column swapped after the dispatch keep every count the full
    check compares, yet the combine would sum other rows than the dispatch routed (DeepEP's combine never reads
    that entry). The rank that edited its handle raises ``ValueError`` naming the entry, the others
    ``ConsensusError`` naming that rank, for the combine and the cached dispatch; the Buffer stays usable."""
    from deepep_ascend import ConsensusError

    R, r = comm.Get_size(), comm.Get_rank()
    E, bad = E_PER_RANK * R, R - 1
    buf = Buffer(None, Buffer.get_normal_buffer_size_hint(N, H, R, K, E), comm=comm, explicitly_destroy=True)
    try:
        x, idx, w = _inputs(comm, 13)
        ntpr, _, ntpe, itr, _ = buf.get_dispatch_layout(idx, E)
        recv_x, _, recv_w, _, handle, _ = coll(lambda: buf.dispatch(
            x, num_tokens_per_rank=ntpr, is_token_in_rank=itr, num_tokens_per_expert=ntpe, topk_idx=idx,
            topk_weights=w), what="dispatch")
        reference = coll(lambda: buf.combine(recv_x, handle, topk_weights=recv_w)[:2], what="combine")
        column = handle.is_token_in_rank[:, (r + 1) % R]
        ones, zeros = torch.nonzero(column).view(-1), torch.nonzero(~column).view(-1)
        if r == bad:
            if len(ones) and len(zeros):  # the counts stay as they were
                column[ones[0]], column[zeros[0]] = False, True
            else:  # (one rank: every token goes to it) a write that changes no value is a write all the same
                handle.send_head.add_(0)
        for what, call in (("combine", lambda: buf.combine(recv_x, handle, topk_weights=recv_w)),
                           ("cached dispatch", lambda: buf.dispatch(x, handle=handle))):
            _, exc = capture(call)
            if r == bad:
                ok = isinstance(exc, ValueError) and "was written in place" in str(exc) and (
                    "`handle.is_token_in_rank`" in str(exc) or "`handle.send_head`" in str(exc))
            else:
                ok = isinstance(exc, ConsensusError) and f"rank {bad}" in str(exc)
            all_ranks_ok(comm, ok, f"rank {r}: {what} with a handle edited on rank {bad}: {exc!r}")
        ntpr, _, ntpe, itr, _ = buf.get_dispatch_layout(idx, E)  # (the handle holds the layout's own mask)
        _still_gives(buf, comm, lambda: buf.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=itr,
                                                     num_tokens_per_expert=ntpe, topk_idx=idx, topk_weights=w),
                     reference, "after refusing an edited handle")
    finally:
        coll(buf.destroy, what="destroy")


@pytest.mark.mpi(min_size=1)
def test_a_handle_whose_mask_is_half_of_a_double_buffer_survives_writes_to_the_other_half(comm):
    """``is_token_in_rank`` passed to ``dispatch`` as one half of a ``[2, N, R]`` double buffer (a view, whose version
    counter is its base's): filling the other half for the next micro-batch is no write to the handle, and its
    combine gives the same bits as with a mask of its own."""
    R, r = comm.Get_size(), comm.Get_rank()
    E = E_PER_RANK * R
    buf = Buffer(None, Buffer.get_normal_buffer_size_hint(N, H, R, K, E), comm=comm, explicitly_destroy=True)
    try:
        x, idx, w = _inputs(comm, 17)
        ntpr, _, ntpe, itr, _ = buf.get_dispatch_layout(idx, E)
        store = torch.zeros(2, *itr.shape, dtype=torch.bool)
        store[0].copy_(itr)

        def round_trip(mask, between=None):
            recv_x, _, recv_w, _, handle, _ = coll(lambda: buf.dispatch(
                x, num_tokens_per_rank=ntpr, is_token_in_rank=mask, num_tokens_per_expert=ntpe, topk_idx=idx,
                topk_weights=w), what="dispatch")
            if between is not None:
                between()
            return coll(lambda: buf.combine(recv_x, handle, topk_weights=recv_w)[:2], what="combine")

        want = round_trip(itr)
        got = round_trip(store[0], between=lambda: store[1].copy_(itr))  # the next micro-batch's mask
        all_ranks_ok(comm, all(torch.equal(bits(a), bits(b)) for a, b in zip(got, want)),
                     f"rank {r}: the double-buffered mask's combine differs")
    finally:
        coll(buf.destroy, what="destroy")


@pytest.mark.mpi(min_size=1)
def test_low_latency_handle_is_named_and_plain_tuples_work(comm):
    """``low_latency_combine`` (and its autograd form, forward and backward) take ``tuple(handle)`` as the handle."""
    r, R = comm.Get_rank(), comm.Get_size()
    E = E_PER_RANK * R
    buf = coll(lambda: Buffer(comm, 0, Buffer.get_low_latency_rdma_size_hint(M, H, R, E), low_latency_mode=True,
                              explicitly_destroy=True), what="LL Buffer()")
    try:
        x, idx, w = _inputs(comm, 9)

        def go():
            recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
            y = (recv_x.float() * 0.5).to(BF16)
            by_name = buf.low_latency_combine(y, idx, w, handle)[0]
            by_tuple = buf.low_latency_combine(y, idx, w, tuple(handle))[0]
            yg = y.clone().requires_grad_(True)
            wg = w.clone().requires_grad_(True)
            out = ag.low_latency_combine(buf, yg, idx, wg, tuple(handle))
            out.float().sum().backward()
            return handle, by_name, by_tuple, out.detach(), yg.grad, wg.grad

        handle, by_name, by_tuple, out, grad_y, grad_w = coll(go, what="LL dispatch, combines with both handle forms")
        named = isinstance(handle, LowLatencyHandle) and handle.num_max_dispatch_tokens_per_rank == M \
            and handle.hidden == H and handle.num_experts == E and handle.src_info.shape == (E // R, R * M)
        all_ranks_ok(comm, named, f"low_latency_dispatch returned {type(handle).__name__} {handle[2:]!r}")
        same = torch.equal(bits(by_name), bits(by_tuple)) and torch.equal(bits(out), bits(by_name))
        all_ranks_ok(comm, same, "low_latency_combine with tuple(handle) differs from the handle's")
        all_ranks_ok(comm, grad_y is not None and grad_w is not None and bool(torch.isfinite(grad_w).all()),
                     f"rank {r}: the autograd combine's backward with tuple(handle) gave no gradients")
    finally:
        coll(buf.destroy, what="destroy")
