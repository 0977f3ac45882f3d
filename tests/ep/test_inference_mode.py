"""Calls under ``torch.inference_mode()`` (the serving context) give the bits of the same calls outside it, on a
Buffer or EPBuffer built in either mode, and leave it usable outside that mode (docs/semantics/deepep-api.md §3.3).
"""

from __future__ import annotations

import pytest
import torch

from deepep_ascend import Buffer, EPBuffer
from tests.support.buffer_helpers import all_ranks_ok, capture
from tests.support.mpi_utils import up_to_four_ranks, world

pytestmark = [pytest.mark.mpi(min_size=1), pytest.mark.watchdog(120)]

N, H, K = 8, 128, 2


def _inputs(rank, num_experts):
    gen = torch.Generator().manual_seed(31 + rank)
    x = torch.randn(N, H, generator=gen).bfloat16()
    weights, idx = torch.randn(N, num_experts, generator=gen).softmax(-1).topk(K, dim=-1)
    return x, idx, weights


def _buffer_calls(buf, x, idx, weights, num_experts, num_local):
    """Every kind of call, each result as one tensor (compared across modes)."""
    out = {}
    nt, nr, nte, itr, _ = buf.get_dispatch_layout(idx, num_experts)
    rx, _, rw, counts, handle, _ = buf.dispatch(x, None, nt, nr, itr, nte, idx, weights)
    out["normal"] = buf.combine(rx, handle, rw)[0]
    out["normal cached"] = buf.dispatch(x, handle=handle)[0]
    rx, _, rw, _, handle, event = buf.dispatch(x, None, nt, nr, itr, nte, idx, weights, async_finish=True)
    event.current_stream_wait()  # the worker writes outputs made in the caller's mode
    combined, _, event = buf.combine(rx, handle, rw, async_finish=True)
    event.current_stream_wait()
    out["normal async"] = combined
    recv_x, recv_count, ll_handle, _, _ = buf.low_latency_dispatch(x, idx, N, num_experts, use_fp8=False)
    out["ll"] = buf.low_latency_combine(recv_x, idx, weights, ll_handle)[0]
    stats = torch.zeros(num_local, dtype=torch.int32)
    (fp8, scales), _, _, _, hook = buf.low_latency_dispatch(x, idx, N, num_experts, use_fp8=True,
                                                            cumulative_local_expert_recv_stats=stats,
                                                            return_recv_hook=True)
    hook()
    out["ll fp8"], out["ll fp8 scales"], out["ll stats"] = fp8.view(torch.uint8), scales, stats
    stats = torch.zeros(num_local, dtype=torch.int32)
    recv_x, _, ll_handle, event, _ = buf.low_latency_dispatch(x, idx, N, num_experts, use_fp8=False,
                                                              cumulative_local_expert_recv_stats=stats,
                                                              async_finish=True)
    event.current_stream_wait()
    out["ll async stats"] = stats
    zc = buf.get_next_low_latency_combine_buffer(ll_handle)
    zc.copy_(recv_x)
    del zc
    out["ll zero-copy"] = buf.low_latency_combine(recv_x, idx, weights, ll_handle, zero_copy=True)[0]
    return out


def _ep_calls(buf, x, idx, weights, num_experts):
    out = {}
    recv_x, _, recv_w, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=weights, num_experts=num_experts)
    out["ep"] = buf.combine(recv_x, handle, topk_weights=recv_w)[0]
    recv_x, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=weights, num_experts=num_experts,
                                           do_expand=True, expert_alignment=4, do_cpu_sync=False)
    out["ep expanded"] = buf.combine(recv_x, handle)[0]
    recv_x, _, _, handle, event = buf.dispatch(x, topk_idx=idx, topk_weights=weights, num_experts=num_experts,
                                               do_cpu_sync=False, async_with_compute_stream=True)
    event.current_stream_wait()
    combined, _, event = buf.combine(recv_x, handle, async_with_compute_stream=True)
    event.current_stream_wait()
    out["ep async"] = combined
    return out


def _check(comm, build, calls, inputs):
    """``calls(buffer, *inputs)`` on a Buffer built outside inference mode: outside, inside (on inputs made
    there: inference tensors), outside again; then on one built inside it: inside, then outside."""
    errors = []
    with torch.no_grad():
        outer = build()
        want = calls(outer, *inputs)
        with torch.inference_mode():
            inference_inputs = [t.clone() for t in inputs]
            got_in = capture(lambda: calls(outer, *inference_inputs))
            inner = capture(build)
        got_after = capture(lambda: calls(outer, *inputs))
        got_inner = (None, RuntimeError("not built")) if inner[1] else None
        if inner[1] is None:
            with torch.inference_mode():
                got_inner = capture(lambda: calls(inner[0], *inference_inputs))
            got_inner_after = capture(lambda: calls(inner[0], *inputs))
        for what, (got, exc) in (("inside inference_mode", got_in), ("outside it again", got_after),
                                 ("built inside it, called inside", got_inner),
                                 ("built inside it, called outside", got_inner_after if inner[1] is None
                                  else (None, inner[1]))):
            if exc is not None:
                errors.append(f"{what}: {exc!r}")
                continue
            errors += [f"{what}: {k} differs" for k in want if not torch.equal(got[k], want[k])]
        outer.destroy()
        if inner[1] is None:
            inner[0].destroy()
    all_ranks_ok(comm, not errors, "; ".join(errors[:6]))


def _nodes():
    R = world().Get_size()
    return [pytest.param(None, id="1node")] + ([pytest.param(R // 2, id="2nodes")] if R >= 2 and R % 2 == 0 else [])


@pytest.mark.parametrize("rpn", _nodes())
@pytest.mark.parametrize("kind", ["Buffer", "EPBuffer"])
@up_to_four_ranks()
def test_calls_under_inference_mode(comm, kind, rpn):
    """Every kind of call of a ``Buffer`` (normal and low-latency) or an ``EPBuffer``, on one node and on two."""
    r, R = comm.Get_rank(), comm.Get_size()
    num_experts = 4 * R
    x, idx, weights = _inputs(r, num_experts)

    def build():
        if kind == "EPBuffer":
            return EPBuffer(comm, num_max_tokens_per_rank=N, hidden=H, num_topk=K, explicitly_destroy=True,
                            ranks_per_node=rpn)
        rdma = max(Buffer.get_low_latency_rdma_size_hint(N, H, R, num_experts),
                   Buffer.get_normal_rdma_buffer_size_hint(N, H, R, rpn, K, num_experts) if rpn else 0)
        return Buffer(None, Buffer.get_normal_buffer_size_hint(N, H, R, K, num_experts, ranks_per_node=rpn), rdma,
                      low_latency_mode=True, comm=comm, explicitly_destroy=True, ranks_per_node=rpn)

    def calls(buf, *inputs):
        if kind == "EPBuffer":
            return _ep_calls(buf, *inputs, num_experts)
        return _buffer_calls(buf, *inputs, num_experts, num_experts // R)

    _check(comm, build, calls, (x, idx, weights))


def test_inference_tensors_written_outside_inference_mode_refused(comm):
    """A stats tensor made under ``torch.inference_mode()`` and passed in outside it (torch would refuse the
    in-place update once the rows had moved): refused on every rank before anything moves (``RuntimeError``
    on rank 0, ``ConsensusError`` on the others), and the Buffer stays usable."""
    from deepep_ascend import ConsensusError

    r, R = comm.Get_rank(), comm.Get_size()
    num_experts = 4 * R
    x, idx, _ = _inputs(r, num_experts)
    buf = Buffer(None, 0, Buffer.get_low_latency_rdma_size_hint(N, H, R, num_experts), low_latency_mode=True,
                 comm=comm, explicitly_destroy=True)
    with torch.inference_mode():
        frozen = torch.zeros(num_experts // R, dtype=torch.int32)
    stats = frozen if r == 0 else torch.zeros(num_experts // R, dtype=torch.int32)
    _, exc = capture(lambda: buf.low_latency_dispatch(x, idx, N, num_experts, use_fp8=False,
                                                      cumulative_local_expert_recv_stats=stats))
    want = RuntimeError if r == 0 else ConsensusError
    errors = [] if isinstance(exc, want) else [f"inference stats outside inference mode: {exc!r}"]
    _, exc = capture(lambda: buf.low_latency_dispatch(x, idx, N, num_experts, use_fp8=False))
    if exc is not None:
        errors.append(f"the next dispatch: {exc!r}")
    buf.destroy()
    all_ranks_ok(comm, not errors, "; ".join(errors))


def test_engram_writes_inside_then_outside_inference_mode(comm):
    """``EngramBuffer.write`` first under ``torch.inference_mode()``, then outside it: both land (the storage
    views it keeps across calls are made outside that mode), and the fetch after them equals the one on a
    buffer that saw the same writes outside it."""
    from deepep_ascend import EngramBuffer

    r = comm.Get_rank()
    entries, hidden, T, P = [100, 150], 128, 8, 4
    storage_bytes = EngramBuffer.get_storage_size_hint(comm, entries, hidden, T, P)
    config = EngramBuffer.get_theoretical_config(comm, len(entries), T, P)
    ind = torch.arange(len(entries) * T * P, dtype=torch.int32).view(len(entries), T, P) % min(entries)

    def shards(v):
        return [torch.full((n, hidden), float(v + r), dtype=torch.bfloat16) for n in entries]

    def run(first_in_inference_mode):
        en = EngramBuffer(comm, *storage_bytes, True, *config, explicitly_destroy=True)
        en.set_config(entries, hidden, T, P)
        if first_in_inference_mode:
            with torch.inference_mode():
                _, exc_in = capture(lambda: en.write(shards(1.0)))
        else:
            _, exc_in = capture(lambda: en.write(shards(1.0)))
        _, exc_out = capture(lambda: en.write(shards(5.0)))
        got, exc = capture(lambda: en.fetch(ind)[0]().clone())
        en.destroy()
        return got, [f"{what}: {e!r}" for what, e in (("first write", exc_in), ("second write", exc_out),
                                                       ("fetch", exc)) if e is not None]

    want, errors = run(False)
    got, errors_in = run(True)
    errors += errors_in
    if not errors and not torch.equal(got, want):
        errors.append("the fetch after the writes differs from the one without inference mode")
    all_ranks_ok(comm, not errors, "; ".join(errors))
