"""The per-phase recorder (``deepep_ascend.ep.phases``): off by default, its phases tile each call, every
op and engine names its phases, and recording changes no result bit.

Run: ``mpiexec -n N python -m pytest --with-mpi -q tests/ep/test_phases.py`` (N = 1, 2, 4).
"""

from __future__ import annotations

import time

import pytest
import torch

from deepep_ascend import Buffer, EPBuffer
from deepep_ascend.ep import phases
from tests.support.buffer_helpers import bits, coll
from tests.support.mpi_utils import world

HIDDEN, TOPK, TOKENS = 256, 4, 24


def _inputs(rank: int, num_experts: int, n: int = TOKENS, hidden: int = HIDDEN):
    g = torch.Generator().manual_seed(7 + rank)
    x = torch.randn(n, hidden, generator=g).to(torch.bfloat16)
    topk_idx = torch.topk(torch.rand(n, num_experts, generator=g), TOPK, dim=1).indices.to(torch.int64)
    topk_idx[::5, 0] = -1
    w = torch.rand(n, TOPK, generator=g).masked_fill(topk_idx < 0, 0.0)
    return x, topk_idx, w


def _timed_records(fn):
    """``(result, records, wall_ns)``: ``fn()`` recorded, with the wall time around it."""
    with phases.recording() as records:
        t0 = time.perf_counter_ns()
        out = fn()
        wall = time.perf_counter_ns() - t0
    return out, list(records), wall


def _check_tiles(rec: phases.CallRecord, wall_ns: int) -> None:
    assert sum(rec.phases.values()) == rec.total_ns, rec
    assert 0 < rec.total_ns <= wall_ns, (rec.total_ns, wall_ns)
    assert rec.phases[phases.OTHER] >= 0 and all(v >= 0 for v in rec.phases.values()), rec


# -- the recorder itself (one process) ---------------------------------------------------------------
def test_recorder_is_off_by_default_and_tiles_a_call():
    rec = phases.RECORDER
    assert rec.on is False
    assert rec.switch("pack") is None  # no open call: a no-op
    with phases.recording() as records:
        assert rec.on
        assert rec.begin("op", "intranode")
        assert not rec.begin("nested", "intranode")  # folded into the open call
        time.sleep(0.002)
        assert rec.switch("pack") == phases.OTHER
        time.sleep(0.002)
        prev = rec.switch("wait: peers")
        time.sleep(0.003)
        assert rec.switch(prev) == "wait: peers"
        time.sleep(0.002)
        got = rec.end()
        assert rec.end() is None
    assert rec.on is False and records == [got]
    assert got.op == "op" and got.engine == "intranode"
    assert list(got.phases) == [phases.OTHER, "pack", "wait: peers"]
    assert sum(got.phases.values()) == got.total_ns
    assert got.phases["wait: peers"] >= 3_000_000 and got.phases["pack"] >= 4_000_000  # pack resumed after the wait
    with phases.recording(), pytest.raises(RuntimeError, match="already active"):
        with phases.recording():
            pass


def test_carve_moves_a_timed_step_out_of_the_running_phase():
    rec = phases.RECORDER
    rec.carve("pack", 10**6)  # no open call: a no-op
    with phases.recording():
        rec.begin("op", "low-latency")
        rec.switch("send")
        time.sleep(0.004)
        rec.carve("pack", 1_000_000)  # 1 ms of the 4 ms "send" was a native call's staging
        rec.carve("signal", 0)  # nothing timed: nothing moved
        rec.switch(None)
        got = rec.end()
    assert got.phases["pack"] == 1_000_000 and "signal" not in got.phases
    assert got.phases["send"] >= 3_000_000
    assert sum(got.phases.values()) == got.total_ns  # the phases still tile the call


def test_timed_records_one_call_and_passes_errors_through():
    @phases.timed("outer", "low-latency")
    def outer(fail=False):
        phases.RECORDER.switch("checks")
        inner()
        if fail:
            raise ValueError("bad")
        return 3

    @phases.timed("inner")
    def inner():
        phases.RECORDER.switch("copy")

    assert outer() == 3  # off: nothing recorded, nothing opened
    with phases.recording() as records:
        assert outer() == 3
        with pytest.raises(ValueError, match="bad"):
            outer(fail=True)
        assert phases.timed_call("hook", lambda: 5) == 5
    assert [r.op for r in records] == ["outer", "outer", "hook"]
    assert set(records[0].phases) == {phases.OTHER, "checks", "copy"}
    assert all(sum(r.phases.values()) == r.total_ns for r in records)


# -- the library's calls (collective) ------------------------------------------------------------------
def _normal_round_trip(buf: Buffer, x, topk_idx, w, num_experts):
    ntpr, ntprdma, ntpe, itr, _ = buf.get_dispatch_layout(topk_idx, num_experts)
    recv_x, _, recv_w, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=ntpr, num_tokens_per_rdma_rank=ntprdma,
                                                   is_token_in_rank=itr, num_tokens_per_expert=ntpe,
                                                   topk_idx=topk_idx, topk_weights=w)
    recv_x = recv_x.clone()  # the landing segment is reused by the next dispatch
    combined, combined_w, _ = buf.combine(recv_x, handle, topk_weights=recv_w)
    cached, *_ = buf.dispatch(x, handle=handle)
    return [recv_x, recv_w, combined.clone(), combined_w, cached.clone()]


NORMAL_PHASES = {
    "dispatch": {"checks", "control", "pack", "outputs", "copy", "epilogue", "counters"},
    "combine": {"checks", "control", "pack", "outputs", "reduce", "counters"},
}


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("nodes", [1, 2], ids=["intranode", "internode"])
def test_normal_calls_tile_and_change_no_bit(buffers, comm, nodes):
    R, rank = comm.Get_size(), comm.Get_rank()
    if nodes > R:
        pytest.skip("two simulated nodes need two ranks")
    num_experts = 4 * R
    rpn = R // nodes
    buf = buffers(Buffer.get_normal_buffer_size_hint(TOKENS, HIDDEN, R, TOPK, num_experts, ranks_per_node=rpn),
                  Buffer.get_normal_rdma_buffer_size_hint(TOKENS, HIDDEN, R, rpn, TOPK, num_experts),
                  key=("normal", nodes), ranks_per_node=rpn)
    x, topk_idx, w = _inputs(rank, num_experts)
    assert phases.RECORDER.on is False
    before, count = phases.RECORDER.records, len(phases.RECORDER.records)
    off = _normal_round_trip(buf, x, topk_idx, w, num_experts)
    assert phases.RECORDER.records is before and len(before) == count  # off by default: nothing recorded
    on, records, wall = _timed_records(lambda: _normal_round_trip(buf, x, topk_idx, w, num_experts))
    for a, b in zip(off, on):
        assert torch.equal(bits(a), bits(b))
    engine = "internode" if nodes > 1 else "intranode"
    assert [r.op for r in records] == ["get_dispatch_layout", "dispatch", "combine", "dispatch"]
    assert all(r.engine == engine for r in records)
    for rec in records:
        _check_tiles(rec, wall)
    assert {"checks", "layout"} <= set(records[0].phases)
    records = records[1:]
    for rec, op in zip(records, ("dispatch", "combine")):
        missing = NORMAL_PHASES[op] - set(rec.phases)
        assert not missing, (op, missing, rec.phases)
        if R > 1:
            assert any(p.startswith("wait: ") for p in rec.phases), rec.phases
    assert {"checks", "control", "outputs", "copy"} <= set(records[2].phases)  # the cached dispatch


@pytest.mark.mpi(min_size=2)
def test_a_late_peer_is_booked_as_the_wait_it_causes(buffers, comm, monkeypatch):
    """One node: the last rank sleeps after the count exchange of a dispatch (before it stores into the others'
    ``recv_x``) and before the receive of a combine (the others' ``x`` read in place). Rank 0's fused tails run out
    of polls and wait the long way: those waits are booked as ``wait: x rows`` and ``wait: x read in place``."""
    from deepep_ascend.ep import intranode

    R, rank = comm.Get_size(), comm.Get_rank()
    num_experts, late = 4 * R, 0.2
    buf = buffers(Buffer.get_normal_buffer_size_hint(TOKENS, HIDDEN, R, TOPK, num_experts), key="normal")
    x, topk_idx, w = _inputs(rank, num_experts)
    for name in ("_x_path", "_combine_native"):
        step = getattr(intranode.IntranodeEngine, name)

        def slow(self, *args, _step=step, **kwargs):
            if rank == R - 1:
                time.sleep(late)
            return _step(self, *args, **kwargs)
        monkeypatch.setattr(intranode.IntranodeEngine, name, slow)
    ntpr, _, ntpe, itr, _ = buf.get_dispatch_layout(topk_idx, num_experts)
    comm.Barrier()
    with phases.recording() as records:
        recv_x, _, recv_w, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=itr,
                                                       num_tokens_per_expert=ntpe, topk_idx=topk_idx, topk_weights=w)
        buf.combine(recv_x, handle, topk_weights=recv_w)  # recv_x lies in the landing segment: read in place
    if rank == 0:
        dispatch, combine = records
        assert dispatch.phases.get("wait: x rows", 0) > 0.5 * late * 1e9, dispatch.phases
        assert combine.phases.get("wait: x read in place", 0) > 0.5 * late * 1e9, combine.phases
        assert dispatch.phases.get("copy", 0) < 0.5 * late * 1e9 and combine.phases.get("reduce", 0) < 0.5 * late * 1e9


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("hook", [False, True], ids=["inline", "hook"])
def test_low_latency_calls_tile_and_change_no_bit(buffers, comm, hook):
    R, rank = comm.Get_size(), comm.Get_rank()
    m, num_experts = TOKENS, 4 * R
    buf = buffers.low_latency(m, HIDDEN, num_experts, key=("ll", m))
    x, topk_idx, w = _inputs(rank, num_experts)

    def round_trip():
        recv_x, count, handle, _, h = buf.low_latency_dispatch(x, topk_idx, m, num_experts, use_fp8=True,
                                                               return_recv_hook=hook)
        if hook:
            h()
        data, scales = recv_x[0].clone(), recv_x[1].clone()
        y = data.float().mul(scales.repeat_interleave(128, dim=2)).to(torch.bfloat16)  # cast back, exact enough
        combined, _, h = buf.low_latency_combine(y, topk_idx, w, handle, return_recv_hook=hook)
        if hook:
            h()
        return [data, scales, count.clone(), handle.src_info.clone(), combined.clone()]

    off = round_trip()
    on, records, wall = _timed_records(round_trip)
    for a, b in zip(off, on):
        assert torch.equal(bits(a), bits(b))
    ops = ["low_latency_dispatch", "low_latency_combine"]
    if hook:
        ops = ["low_latency_dispatch", "low_latency_dispatch hook", "low_latency_combine", "low_latency_combine hook"]
    assert [r.op for r in records] == ops and all(r.engine == "low-latency" for r in records)
    for rec in records:
        _check_tiles(rec, wall)
    by = {r.op: set(r.phases) for r in records}
    # The fused path (one node, signals by stores) times its pack, signals and bounded wait inside its native
    # calls and reports them as these phases too; with signals by stores the headers are checked inside the wait's
    # native call (no "control" of its own).
    send = {"checks", "pack", "route", "send", "signal", "outputs"}
    control = set() if buf._ll._store_signals is not None else {"control"}
    receive = {"wait: signals", "copy", "counters"} | control
    if hook:
        assert send <= by["low_latency_dispatch"] and receive <= by["low_latency_dispatch hook"], by
        assert not {"wait: signals", "copy"} & by["low_latency_dispatch"]  # the call returns once the sends are issued
        assert {"send", "signal"} <= by["low_latency_combine"]
        assert {"wait: signals", "reduce"} | control <= by["low_latency_combine hook"], by
    else:
        assert send | receive <= by["low_latency_dispatch"], by
        assert {"checks", "send", "signal", "wait: signals", "reduce"} | control <= by["low_latency_combine"], by


@pytest.mark.mpi(min_size=1)
def test_ep_buffer_calls_tile_and_change_no_bit(comm):
    R, rank = comm.Get_size(), comm.Get_rank()
    num_experts = 4 * R
    buf = coll(lambda: EPBuffer(world(), num_max_tokens_per_rank=TOKENS, hidden=HIDDEN, num_topk=TOPK,
                                explicitly_destroy=True), what="EPBuffer()")
    try:
        x, topk_idx, w = _inputs(rank, num_experts)

        def round_trip():
            recv_x, _, recv_w, handle, _ = buf.dispatch(x, topk_idx=topk_idx, topk_weights=w, num_experts=num_experts,
                                                        expert_alignment=4, do_expand=True, do_zero_padding=True)
            recv_x = recv_x.clone()
            combined, combined_w, _ = buf.combine(recv_x, handle, topk_weights=recv_w)
            return [recv_x, recv_w.clone(), combined.clone(), combined_w]

        off = round_trip()
        on, records, wall = _timed_records(round_trip)
        for a, b in zip(off, on):
            assert torch.equal(bits(a), bits(b))
        assert [r.op for r in records] == ["ep_dispatch", "ep_combine"]
        assert all(r.engine == "intranode" for r in records)
        for rec in records:
            _check_tiles(rec, wall)
        assert {"checks", "layout", "control", "outputs", "copy", "epilogue"} <= set(records[0].phases)
        assert {"checks", "compact", "control", "reduce"} <= set(records[1].phases)
    finally:
        coll(buf.destroy, what="destroy")
