"""DeepEP-Ascend 1.0's namespace (``import deepep_ascend.ascend as deep_ep``, docs/semantics/deepep-api.md §13.10):
its handle's ``recv_src_metadata``, ``dst_buffer_slot_idx`` and ``dst_gsge_idx`` against references built token
by token from every rank's routing, the metadata checked the way DeepEP-Ascend's own test reads it; the
handle's resolved ``num_sms`` (DeepEP V2.5, V2, DeepEP-Ascend); ``_C``; V2's ``ElasticBuffer.barrier``. Every test is
collective.

Run: ``mpiexec -n N python -m pytest --with-mpi -q tests/ep/test_ascend_flavor.py`` (N = 1, 2, 4).
"""

from __future__ import annotations

import pytest
import torch

import deepep_ascend
import deepep_ascend.ascend as deep_ep
from tests.support.buffer_helpers import all_ranks_ok, bits, coll
from tests.support.ep_reference import ref_dispatch, ref_dst_slots
from tests.support.mpi_utils import gather_all

pytestmark = [pytest.mark.mpi(min_size=1), pytest.mark.watchdog(300)]

MAX_TOKENS, HIDDEN, TOPK = 16, 256, 4
BF16 = torch.bfloat16


def _routing(rank: int, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, topk_idx)`` with -1 slots, a token without experts and an expert listed twice in a row."""
    g = torch.Generator().manual_seed(77 + rank)
    n = MAX_TOKENS - rank
    topk_idx = torch.rand(n, num_experts, generator=g).topk(TOPK, dim=1).indices
    topk_idx[1::3, 0] = -1
    topk_idx[4] = -1
    topk_idx[5, 3] = topk_idx[5, 2]
    return (torch.randn(n, HIDDEN, generator=g) * 2).to(BF16), topk_idx


@pytest.mark.parametrize("do_cpu_sync", [True, False], ids=["cpu_sync", "no_cpu_sync"])
def test_ascend_handle_fields(comm, do_cpu_sync):
    R, rank = comm.Get_size(), comm.Get_rank()
    E = 4 * R
    x, topk_idx = _routing(rank, E)
    w = torch.rand(topk_idx.shape, generator=torch.Generator().manual_seed(rank)).masked_fill(topk_idx < 0, 0)
    ref = ref_dispatch(gather_all(x, comm), None, gather_all(topk_idx, comm), gather_all(w, comm), rank, E, MAX_TOKENS)
    buf = coll(lambda: deep_ep.EPBuffer(comm, num_max_tokens_per_rank=MAX_TOKENS, hidden=HIDDEN, num_topk=TOPK,
                                        explicitly_destroy=True), what="EPBuffer()")
    v25 = coll(lambda: deepep_ascend.EPBuffer(comm, num_max_tokens_per_rank=MAX_TOKENS, hidden=HIDDEN, num_topk=TOPK,
                                              explicitly_destroy=True), what="EPBuffer()")
    try:
        args = dict(topk_idx=topk_idx, topk_weights=w, num_experts=E, expert_alignment=8, do_expand=True,
                    do_zero_padding=True, do_cpu_sync=do_cpu_sync)
        recv_x, _, recv_w, handle, _ = coll(lambda: buf.dispatch(x, **args), what="dispatch")
        v_x, _, v_w, v_handle, _ = coll(lambda: v25.dispatch(x, **args), what="V2.5 dispatch")
        nref = ref.src.numel()
        meta = handle.recv_src_metadata
        ok = isinstance(handle, deep_ep.EPHandle) and not isinstance(v_handle, deep_ep.EPHandle)
        ok &= torch.equal(recv_x, v_x) and torch.equal(recv_w, v_w)  # one data plane, the same rows
        rows = nref if do_cpu_sync else R * MAX_TOKENS
        ok &= meta.shape == (rows, TOPK + 2) and meta.dtype == torch.int32 and bool((meta[nref:] == -1).all())
        valid = meta[:nref]
        slots, src, lane = valid[:, :TOPK].long(), valid[:, TOPK].long(), valid[:, TOPK + 1].long()
        ok &= torch.equal(src, ref.src)  # rows by source token, as the reference delivers them
        ok &= torch.equal(slots >= 0, ref.topk_idx >= 0)
        on_rank = slots >= 0
        ok &= torch.equal(recv_x[slots[on_rank]], ref.x.unsqueeze(1).expand(-1, TOPK, -1)[on_rank])
        ok &= torch.equal(recv_w[slots[on_rank]], ref.weights[on_rank])
        ok &= torch.equal(lane, torch.where(on_rank, torch.arange(TOPK), -1).amax(dim=1) if nref else lane)
        ok &= torch.equal(handle.ascend_recv_src_metadata, meta)
        ok &= torch.equal(v_handle.ascend_recv_src_metadata, meta)
        ref_slots, ref_writes = ref_dst_slots(topk_idx, E, R, rank)
        ok &= torch.equal(handle.dst_buffer_slot_idx, ref_slots) and torch.equal(handle.dst_gsge_idx, ref_writes)
        # a cached dispatch keeps every field; the combine of the handle is the V2.5 buffer's, bit for bit
        saved = [t.clone() for t in (meta, handle.dst_buffer_slot_idx, handle.dst_gsge_idx)]
        c_x, _, _, c_handle, _ = coll(lambda: buf.dispatch(x, handle=handle, num_experts=E, expert_alignment=8,
                                                           do_expand=True, do_zero_padding=True), what="cached")
        ok &= c_handle is handle and torch.equal(c_x, recv_x)
        ok &= all(torch.equal(a, b) for a, b in zip(saved, (handle.recv_src_metadata, handle.dst_buffer_slot_idx,
                                                             handle.dst_gsge_idx)))
        y = (recv_x.float() * 1.5).to(BF16)
        got, got_w, _ = coll(lambda: buf.combine(y, handle, topk_weights=recv_w), what="combine")
        want, want_w, _ = coll(lambda: v25.combine(y, v_handle, topk_weights=v_w), what="V2.5 combine")
        ok &= torch.equal(bits(got), bits(want)) and torch.equal(got_w, want_w)
        handle.recv_src_metadata = meta[:1]  # DeepEP-Ascend's fields are plain attributes
        ok &= handle.recv_src_metadata.size(0) == min(1, rows)
        again, _, _ = coll(lambda: buf.combine(y, handle, topk_weights=recv_w), what="combine after assignment")
        ok &= torch.equal(bits(again), bits(want))
    finally:
        coll(buf.destroy)
        coll(v25.destroy)
    all_ranks_ok(comm, ok, "DeepEP-Ascend handle fields")


def test_handle_num_sms_resolved_as_deepep(comm):
    """0 (automatic) becomes ``get_theoretical_num_sms``; EPBuffer rounds a count up to even, ElasticBuffer keeps
    it; a cached dispatch leaves the handle's count (DeepEP-Ascend's test asserts all three)."""
    R, rank = comm.Get_size(), comm.Get_rank()
    E = 4 * R
    x, topk_idx = _routing(rank, E)
    ok = True
    for cls, odd in ((deepep_ascend.EPBuffer, 4), (deep_ep.EPBuffer, 4), (deepep_ascend.ElasticBuffer, 3)):
        buf = coll(lambda cls=cls: cls(comm, num_max_tokens_per_rank=MAX_TOKENS, hidden=HIDDEN, num_topk=TOPK,
                                       explicitly_destroy=True), what=cls.__name__)
        try:
            got = []
            for num_sms in (0, 3):
                _, _, _, handle, _ = coll(lambda n=num_sms: buf.dispatch(x, topk_idx=topk_idx, num_experts=E,
                                                                         num_sms=n), what="dispatch")
                got.append(handle.num_sms)
            coll(lambda h=handle: buf.dispatch(x, handle=h, num_experts=E, num_sms=7), what="cached dispatch")
            ok &= got == [buf.get_theoretical_num_sms(E, TOPK), odd] and handle.num_sms == odd
        finally:
            coll(buf.destroy)
    all_ranks_ok(comm, ok, "handle.num_sms")


def test_native_module_switches():
    assert deep_ep._C.set_barrier_in_prologue(True) is False
    assert deep_ep._C.set_barrier_in_prologue(False) is True
    with pytest.raises(TypeError, match="must be a bool"):
        deep_ep._C.set_barrier_in_prologue(1)
    assert deep_ep._C.get_num_allocation_alignment() == deepep_ascend.get_num_allocation_alignment()
    assert deep_ep.Buffer is deepep_ascend.Buffer and deep_ep.EPBuffer is not deepep_ascend.EPBuffer
    assert set(deepep_ascend.__all__) < set(deep_ep.__all__)
    # the alignments each upstream reports: DeepEP TMA 32 and RDMA 64 bytes, DeepEP-Ascend 32 and 32
    assert (deepep_ascend.get_num_tma_alignment(), deepep_ascend.get_num_rdma_alignment()) == (32, 64)
    assert (deep_ep.get_num_tma_alignment(), deep_ep.get_num_rdma_alignment()) == (32, 32)
    assert (deep_ep._C.get_num_tma_alignment(), deep_ep._C.get_num_rdma_alignment()) == (32, 32)


def test_elastic_buffer_barrier_takes_v2s_arguments(comm):
    """DeepEP 2.1's ``ElasticBuffer.barrier(use_comm_stream, with_cpu_sync)``, by keyword and by position."""
    buf = coll(lambda: deepep_ascend.ElasticBuffer(comm, num_max_tokens_per_rank=MAX_TOKENS, hidden=HIDDEN,
                                                   num_topk=TOPK, explicitly_destroy=True), what="ElasticBuffer()")
    try:
        coll(lambda: buf.barrier(use_comm_stream=True, with_cpu_sync=True), what="barrier")
        coll(lambda: buf.barrier(False, False), what="barrier")
    finally:
        coll(buf.destroy)


def test_errors_name_the_class_the_user_built(comm):
    """Messages give the name the caller knows: ``EPBuffer`` for DeepEP-Ascend's (whose Python class has another
    name here), ``ElasticBuffer`` for V2's; a combine whose rows are wider than the buffer was built for names that
    class's size hint and ``num_bytes``, not V1's window arguments."""
    from tests.support.buffer_helpers import capture

    R = comm.Get_size()
    for cls, name in ((deep_ep.EPBuffer, "EPBuffer"), (deepep_ascend.ElasticBuffer, "ElasticBuffer")):
        buf = coll(lambda cls=cls: cls(comm, num_max_tokens_per_rank=MAX_TOKENS, hidden=HIDDEN, num_topk=TOPK,
                                       explicitly_destroy=True))
        try:
            x, topk_idx = _routing(comm.Get_rank(), 4 * R)
            recv_x, _, _, handle, _ = coll(lambda buf=buf: buf.dispatch(x, topk_idx=topk_idx, num_experts=4 * R))
            wide = torch.zeros(recv_x.size(0), 64 * HIDDEN, dtype=BF16)
            _, err = capture(lambda buf=buf: buf.combine(wide, handle))
            ok = isinstance(err, ValueError) and f"see {name}.get_buffer_size_hint" in str(err) \
                and "Buffer.get_normal" not in str(err)
            all_ranks_ok(comm, ok, f"{name}: a combine of wider rows raised {err!r}")
        finally:
            coll(buf.destroy)
        _, err = capture(lambda buf=buf: buf.dispatch(x, topk_idx=topk_idx, num_experts=4 * R))
        all_ranks_ok(comm, isinstance(err, RuntimeError) and f"{name}.dispatch: the buffer was destroyed" in str(err),
                     f"{name}.dispatch after destroy: {err!r}")
