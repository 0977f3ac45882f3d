"""``PPBuffer`` (DeepEP V2.5's pipeline-parallel send / recv, docs/semantics/deepep-api.md §14.2) against
independent references: every tensor received equals, bit for bit, what its sender sent (gathered from
all ranks with mpi4py, or regenerated from the seed every rank shares, as DeepEP's tests/pp/test_pp.py
does), on one node and across two simulated nodes; DeepEP's stress schedule (random neighbours, random
times, at most ``num_max_inflight_tensors`` in flight per pair); the in-flight bound; deadlines naming
the peer; bad input raising before anything is written.

Run: ``mpiexec -n N python -m pytest --with-mpi -q tests/ep/test_pp_buffer.py`` (N = 1, 2, 4, 8).
"""

from __future__ import annotations

import random
import time

import numpy as np
import pytest
import torch

from deepep_ascend import PPBuffer
from tests.support.buffer_helpers import all_ranks_ok, bits, buffer_on_nodes, capture, coll
from tests.support.mpi_utils import gather_all, world

pytestmark = [pytest.mark.mpi(min_size=1), pytest.mark.watchdog(300)]

MAX_BYTES, INFLIGHT = 4096 + 40, 3  # not a multiple of the slot alignment: the last bytes of a slot are used


def _build(nodes: int, **kwargs) -> PPBuffer:
    R = world().Get_size()
    kwargs.setdefault("num_max_tensor_bytes", MAX_BYTES)
    kwargs.setdefault("num_max_inflight_tensors", INFLIGHT)
    return coll(lambda: PPBuffer(world(), explicitly_destroy=True, ranks_per_node=R // nodes, **kwargs),
                what="PPBuffer()")


@pytest.fixture(scope="module")
def pp():
    yield from buffer_on_nodes(_build, 1)


@pytest.fixture(scope="module")
def pp_two_nodes():
    """Two simulated nodes (1+1 ranks at 2, 2+2 at 4, 4+4 at 8): the ring crosses URMA twice."""
    yield from buffer_on_nodes(_build, 2)


@pytest.fixture(params=[1, 2], ids=["one_node", "two_nodes"])
def ring(request, pp, pp_two_nodes):
    if request.param == 2 and pp_two_nodes is None:
        pytest.skip("two simulated nodes need an even number of ranks")
    return pp if request.param == 1 else pp_two_nodes


def _neighbours(comm):
    r, R = comm.Get_rank(), comm.Get_size()
    return (r - 1) % R, (r + 1) % R


def _tensor(kind: str, g: torch.Generator) -> torch.Tensor:
    """One payload per kind: dtypes and sizes DeepEP's callers send (activations of a pipeline stage),
    plus odd sizes and the largest tensor the buffer takes."""
    if kind == "bf16":
        return torch.randn(12, 128, generator=g).to(torch.bfloat16)
    if kind == "fp8":
        return (torch.randn(9, 128, generator=g) * 8).to(torch.float8_e4m3fn)
    if kind == "fp32_nan":
        t = torch.randn(5, 33, generator=g)
        t[0, 0], t[1, 1] = float("nan"), float("-inf")
        return t
    if kind == "odd_bytes":
        return torch.randint(0, 256, (7,), generator=g, dtype=torch.uint8)
    if kind == "int64_3d":
        return torch.randint(-2 ** 62, 2 ** 62, (2, 3, 5), generator=g, dtype=torch.int64)
    if kind == "bool":
        return torch.rand(3, 11, generator=g) > 0.5
    if kind == "max_bytes":
        return torch.randint(0, 256, (MAX_BYTES,), generator=g, dtype=torch.uint8)
    raise AssertionError(kind)


KINDS = ["bf16", "fp8", "fp32_nan", "odd_bytes", "int64_3d", "bool", "max_bytes"]


@pytest.mark.parametrize("how", ["sync", "async"])
@pytest.mark.parametrize("kind", KINDS)
def test_ring_exchange(ring, comm, kind, how):
    """Every rank sends one tensor to each neighbour and receives one from each: the received tensors
    equal, bit for bit, what the neighbours sent (all ranks' inputs gathered with mpi4py)."""
    r = comm.Get_rank()
    prev, nxt = _neighbours(comm)
    g = torch.Generator().manual_seed(1000 * KINDS.index(kind) + r)
    to_next, to_prev = _tensor(kind, g), _tensor(kind, g)
    sent_next, sent_prev = gather_all(to_next, comm), gather_all(to_prev, comm)
    from_prev, from_next = torch.empty_like(to_next), torch.empty_like(to_prev)
    if how == "sync":
        coll(lambda: (ring.send(to_next, nxt), ring.send(to_prev, prev), ring.recv(from_prev, prev),
                      ring.recv(from_next, nxt)), what="send/recv")
    else:  # everything queued on the worker in program order; compute meanwhile; one wait per call
        def run():
            events = [ring.send(to_next, nxt, async_finish=True), ring.send(to_prev, prev, async_finish=True),
                      ring.recv(from_prev, prev, async_finish=True), ring.recv(from_next, nxt, async_finish=True)]
            torch.randn(64, 64) @ torch.randn(64, 64)  # the caller's compute, overlapping the transfers
            for e in events:
                e.current_stream_wait()
        coll(run, what="async send/recv")
    ok = (torch.equal(bits(from_prev), bits(sent_next[prev])) and torch.equal(bits(from_next), bits(sent_prev[nxt]))
          and from_prev.dtype == to_next.dtype)
    all_ranks_ok(comm, ok, f"{kind} {how}: received tensors differ from the sent ones")


def _stress_ops(seed: int, rank: int, num_ranks: int, num_sends: int, inflight: int):
    """DeepEP's stress schedule (tests/pp/test_pp.py): ``num_sends`` transfers between random ring
    neighbours at random times, each pair's n-th send after its (n - inflight)-th receive, each receive
    after its send; returns this rank's ops ``(kind, time, peer, n, tensor)`` in time order. Every rank
    draws the same schedule and tensors (sizes vary), so a receiver knows what it must get."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    times: dict = {}
    for _ in range(num_sends):
        src = rng.randrange(num_ranks)
        dst = (src + rng.choice((1, -1))) % num_ranks
        t = rng.randrange(10 ** 8)
        times.setdefault((src, dst), []).append((t, t + rng.randrange(1, 3 * 10 ** 6)))
    ops = []
    for (src, dst), pairs in sorted(times.items()):
        send_t, recv_t = sorted(p[0] for p in pairs), sorted(p[1] for p in pairs)
        for n in range(len(pairs)):
            if n >= inflight:  # the pair's slots are full until the receive of tensor n - inflight
                send_t[n] = max(send_t[n], recv_t[n - inflight] + 1)
            recv_t[n] = max(recv_t[n], send_t[n] + 1)
            rows = int(torch.randint(1, MAX_BYTES // 256 + 1, (1,), generator=g))
            tensor = torch.randn(rows, 128, generator=g).to(torch.bfloat16)
            if src == rank:
                ops.append(("send", send_t[n], dst, n, tensor))
            if dst == rank:
                ops.append(("recv", recv_t[n], src, n, tensor))
    ops.sort(key=lambda op: (op[1], op[3]))
    return ops


@pytest.mark.parametrize("how", ["sync", "async_send"])
def test_stress(ring, comm, how):
    """DeepEP's stress test: random neighbours and times, the in-flight bound honoured by the schedule;
    every received tensor equals the one sent (``async_send``: sends queued on the worker, receives on
    the caller, kept in program order)."""
    r, R = comm.Get_rank(), comm.Get_size()
    bad = []
    for seed in range(2):
        ops = _stress_ops(42 + seed, r, R, num_sends=12 * R, inflight=INFLIGHT)
        events = []

        def run():
            for j, (kind, _, peer, n, tensor) in enumerate(ops):
                if kind == "send":
                    if how == "sync":
                        ring.send(tensor, peer)
                    else:
                        events.append(ring.send(tensor, peer, async_finish=True))
                else:
                    out = torch.empty_like(tensor)
                    ring.recv(out, peer)
                    if not torch.equal(bits(out), bits(tensor)):
                        bad.append((seed, j, peer, n))
            for e in events:
                e.current_stream_wait()
        coll(run, what=f"stress seed {seed}")
    all_ranks_ok(comm, not bad, f"stress: mismatches (seed, op, peer, n) {bad[:5]}")


@pytest.mark.mpi(min_size=2)
def test_inflight_bound(ring, comm):
    """Rank 0 sends ``INFLIGHT + 1`` tensors to rank 1 on the worker: the first ``INFLIGHT`` complete with
    nothing received (the slots hold them), the last waits until rank 1 receives one; then rank 1 gets
    all of them, in order."""
    r = comm.Get_rank()
    g = torch.Generator().manual_seed(7)
    tensors = [torch.randn(16, 64, generator=g) for _ in range(INFLIGHT + 1)]
    ok = True
    if r == 0:
        events = [ring.send(t, 1, async_finish=True) for t in tensors]
        for e in events[:INFLIGHT]:
            e.current_stream_wait()
        time.sleep(0.2)
        ok = not events[-1].event.is_done()  # nothing was received: no slot is free
    comm.Barrier()
    if r == 1:
        out = [torch.empty(16, 64) for _ in tensors]
        for o in out:
            ring.recv(o, 0)
        ok = all(torch.equal(o, t) for o, t in zip(out, tensors))
    if r == 0:
        events[-1].current_stream_wait()
    all_ranks_ok(comm, ok, "in-flight bound: the extra send completed early, or rank 1 received other tensors")


def test_size_mismatch_keeps_the_tensor(ring, comm):
    """A ``recv`` whose ``x`` has other bytes than the tensor sent raises (DeepEP would copy the wrong
    bytes silently) and leaves the tensor queued: a ``recv`` of the right size then receives it."""
    prev, nxt = _neighbours(comm)
    x = torch.arange(32, dtype=torch.int16) + 100 * comm.Get_rank()
    coll(ring.send, x, nxt, what="send")
    _, err = capture(lambda: ring.recv(torch.empty(16, dtype=torch.int16), prev))
    all_ranks_ok(comm, isinstance(err, ValueError) and "has 32 bytes" in str(err) and "has 64" in str(err),
                 f"size mismatch: expected ValueError naming both sizes, got {err!r}")
    out = torch.empty(4, 8, dtype=torch.int16)  # same bytes, another shape: bytes are what is received
    coll(ring.recv, out, prev, what="recv")
    all_ranks_ok(comm, torch.equal(out.reshape(-1), torch.arange(32, dtype=torch.int16) + 100 * prev),
                 "size mismatch: the tensor received after the error differs")


def test_bad_arguments_raise_before_anything_moves(pp, comm):
    """Each bad argument raises on the calling rank (here every rank passes it) before anything is
    written or counted: a normal exchange afterwards still pairs the right tensors."""
    r, R = comm.Get_rank(), comm.Get_size()
    prev, nxt = _neighbours(comm)
    good = torch.zeros(8)
    cases = [
        ("send", lambda: pp.send([1.0, 2.0], nxt), TypeError, "torch.Tensor"),
        ("send", lambda: pp.send(torch.empty(0), nxt), ValueError, "non-empty"),
        ("send", lambda: pp.send(torch.zeros(8, 4).t(), nxt), ValueError, "contiguous"),
        ("send", lambda: pp.send(torch.empty(8, device="meta"), nxt), ValueError, "CPU"),
        ("send", lambda: pp.send(torch.zeros(MAX_BYTES + 1, dtype=torch.uint8), nxt), ValueError,
         "num_max_tensor_bytes"),
        ("send", lambda: pp.send(good, R), ValueError, "adjacent"),
        ("send", lambda: pp.send(good, -1), ValueError, "adjacent"),
        ("send", lambda: pp.send(good, str(nxt)), ValueError, "adjacent"),
        ("send", lambda: pp.send(good, nxt, num_sms=0), ValueError, "num_sms"),
        ("recv", lambda: pp.recv(torch.zeros(MAX_BYTES + 8, dtype=torch.uint8), prev), ValueError,
         "num_max_tensor_bytes"),
        ("recv", lambda: pp.recv(good, R + 3), ValueError, "src_rank_idx"),
        ("recv", lambda: pp.recv(torch.zeros(4, 4).t(), prev, async_finish=True), ValueError, "contiguous"),
        ("send", lambda: pp.send(torch.zeros(2, dtype=torch.complex64).conj(), nxt), ValueError, "conjugated"),
        ("send", lambda: pp.send(torch.zeros(4).to_sparse(), nxt), ValueError, "layout torch.sparse_coo"),
    ]
    if R >= 4:  # a rank of the ring that is no neighbour
        cases.append(("send", lambda: pp.send(good, (r + 2) % R), ValueError, "dst_rank_idx"))
        cases.append(("recv", lambda: pp.recv(good, (r + 2) % R), ValueError, "src_rank_idx"))
    problems = []
    for i, (op, fn, kind, needle) in enumerate(cases):
        _, err = capture(fn)
        if not isinstance(err, kind) or needle not in str(err) or f"PPBuffer.{op}" not in str(err):
            problems.append((i, repr(err)))
    all_ranks_ok(comm, not problems, f"bad arguments: wrong or missing errors {problems}")
    x = torch.full((8,), float(r))
    out = torch.empty(8)
    coll(lambda: (pp.send(x, np.int64(nxt)), pp.recv(out, np.int32(prev))), what="send/recv after the errors "
         "(ranks as numpy integers, as DeepEP's bindings take them)")
    all_ranks_ok(comm, torch.equal(out, torch.full((8,), float(prev))), "an exchange after bad arguments differs")


def test_constructor_errors_on_every_rank(comm):
    """Bad or disagreeing sizes, flags and deadlines raise on every rank, before any window exists."""
    r, R = comm.Get_rank(), comm.Get_size()
    cases = [
        (dict(num_max_tensor_bytes=0 if r == 0 else 64, num_max_inflight_tensors=2), "num_max_tensor_bytes"),
        (dict(num_max_tensor_bytes=64, num_max_inflight_tensors=-1), "num_max_inflight_tensors"),
        (dict(num_max_tensor_bytes=64.0, num_max_inflight_tensors=2), "num_max_tensor_bytes"),
        (dict(num_max_tensor_bytes=64, num_max_inflight_tensors=True), "num_max_inflight_tensors"),
        (dict(num_max_tensor_bytes=64, num_max_inflight_tensors=2, timeout_s=-1.0), "timeout_s"),
        (dict(num_max_tensor_bytes=64, num_max_inflight_tensors=2, sl_idx="x" if r == 0 else None), "sl_idx"),
    ]
    if R > 1:
        cases.append((dict(num_max_tensor_bytes=64, num_max_inflight_tensors=2 + (r == R - 1)),
                      "num_max_inflight_tensors"))
        cases.append((dict(num_max_tensor_bytes=64, num_max_inflight_tensors=2, explicitly_destroy=r == 0),
                      "explicitly_destroy"))
    problems = []
    for i, (kwargs, needle) in enumerate(cases):
        _, err = capture(lambda: PPBuffer(comm, **kwargs))
        if not isinstance(err, (TypeError if r == 0 and "sl_idx" in kwargs else ValueError)) or needle not in str(err):
            problems.append((i, repr(err)))
    # more slots than the host's shared memory: refused before mapping anything, naming the sizes that ask for it
    from deepep_ascend.transports import SharedMemoryExhausted
    _, err = capture(lambda: PPBuffer(comm, 1 << 40, 2))
    if not isinstance(err, SharedMemoryExhausted) or "num_max_tensor_bytes=1099511627776 x " \
            "num_max_inflight_tensors=2" not in str(err):
        problems.append(("1 TiB slots", repr(err)))
    all_ranks_ok(comm, not problems, f"constructor: wrong or missing errors {problems}")


def test_storage_and_lifetime(comm, capsys):
    """``storage`` holds the receive slots; ``destroy`` needs ``explicitly_destroy`` (as DeepEP's
    ``BufferBase``), frees the window and leaves later calls refused."""
    buf = coll(lambda: PPBuffer(comm, 100, 2, explicitly_destroy=True), what="PPBuffer()")
    ok = buf.storage.dtype == torch.uint8 and buf.storage.numel() == 2 * 2 * 128 and buf.num_ranks == comm.Get_size()
    buf.print_memory_usage()
    ok &= f"PPBuffer rank {comm.Get_rank()}/{comm.Get_size()}: receive slots 512 B" in capsys.readouterr().out
    coll(buf.destroy, what="destroy")
    _, err = capture(lambda: buf.send(torch.zeros(4), (comm.Get_rank() + 1) % comm.Get_size()))
    ok &= isinstance(err, RuntimeError) and "destroyed" in str(err) and buf.storage is None
    coll(buf.destroy, what="second destroy")  # idempotent
    implicit = coll(lambda: PPBuffer(comm, 64, 1), what="PPBuffer()")
    _, err = capture(implicit.destroy)
    ok &= isinstance(err, RuntimeError) and "explicitly_destroy" in str(err)
    all_ranks_ok(comm, ok, "storage / destroy")


@pytest.mark.parametrize("op", ["recv", "send"])
def test_deadline_names_the_peer(comm, op):
    """``recv`` with nothing sent, and a ``send`` past the in-flight bound with nothing received, give up
    at the deadline with a TimeoutError naming the rank waited for (DeepEP's kernel prints rank and peer)."""
    prev, nxt = _neighbours(comm)
    buf = coll(lambda: PPBuffer(comm, 64, 1, explicitly_destroy=True, timeout_s=1.0), what="PPBuffer()")
    x = torch.zeros(16)
    start = time.monotonic()
    if op == "recv":
        _, err = capture(lambda: buf.recv(x, prev))
        needle = f"from rank {prev}"
    else:
        buf.send(x, nxt)  # fills the one slot
        _, err = capture(lambda: buf.send(x, nxt))
        needle = f"waits for rank {nxt} to receive"
    elapsed = time.monotonic() - start
    comm.Barrier()
    ok = isinstance(err, TimeoutError) and elapsed < 30
    own = ok and needle in str(err)  # a rank told of a peer's timeout first names that peer's wait
    coll(buf.destroy, what="destroy after a timeout")
    all_ranks_ok(comm, ok, f"{op}: expected a TimeoutError within the deadline, got {err!r} after {elapsed:.1f} s")
    assert any(world().allgather(own)), f"no rank's timeout named the peer it waited for: {err!r}"


def test_a_timeout_fails_the_ranks_waiting_for_it_at_once(comm):
    """docs/semantics/deepep-api.md §14.2 item 5: rank 0's ``recv`` times out; every other rank, waiting in the
    ring since a second later (its own deadline a second after rank 0's), fails at once with the
    ``TransportPeerTimeout`` rank 0's abort sends (a ``TimeoutError`` naming rank 0), not with a timeout of its
    own. Then ``destroy()`` works on every rank."""
    from deepep_ascend.transports import TransportPeerTimeout, TransportTimeout

    r, R = comm.Get_rank(), comm.Get_size()
    if R == 1:
        pytest.skip("needs a peer waiting for the rank that times out")
    buf = coll(lambda: PPBuffer(comm, 64, 1, explicitly_destroy=True, timeout_s=2.0), what="PPBuffer()")
    if r:
        time.sleep(1.0)
    _, err = capture(lambda: buf.recv(torch.zeros(16), (r - 1) % R))
    if r == 0:
        ok = isinstance(err, TransportTimeout) and f"from rank {R - 1}" in str(err)
    else:
        ok = isinstance(err, TransportPeerTimeout) and err.peer == 0 and err.pending_peers == [R - 1]
    what, err = repr(err), None
    _, err = capture(buf.destroy)
    ok &= err is None and buf.runtime is None and buf.storage is None
    all_ranks_ok(comm, ok, f"rank {r}: the timeout gave {what}, then destroy() {err!r}")


def test_process_groups_against_gloo(comm):
    """``PPBuffer`` on torch ProcessGroups, as DeepEP builds it: the world and (at 4+ ranks) the even ranks'
    subgroup, whose ring is numbered by group rank (DeepEP's ``dst_rank_idx``). What each rank receives from
    its previous group rank equals what gloo's ``isend`` / ``recv`` deliver of the same tensor."""
    import torch.distributed as tdist

    from deepep_ascend.nn import dist as ep_dist

    coll(ep_dist.init_distributed, what="init_distributed")
    r, R = comm.Get_rank(), comm.Get_size()
    groups = [("world", tdist.group.WORLD)]
    if R >= 4:
        evens = list(range(0, R, 2))
        sub = coll(tdist.new_group, evens, what="new_group")  # collective over the world
        groups.append(("even ranks", sub if r in evens else None))
    for name, grp in groups:
        ok, detail = True, ""
        if grp is not None:  # only the group's members build its buffer
            ranks = tdist.get_process_group_ranks(grp)
            gr, gR = grp.rank(), grp.size()
            buf = PPBuffer(grp, 1024, 2, explicitly_destroy=True)
            x = torch.randn(4, 64, generator=torch.Generator().manual_seed(r)).to(torch.bfloat16)
            out = torch.empty_like(x)
            buf.send(x, (gr + 1) % gR)
            buf.recv(out, (gr - 1) % gR)
            if gR > 1:  # gloo cannot send to its own rank
                ref = torch.empty_like(x)
                work = tdist.isend(x, ranks[(gr + 1) % gR], group=grp)
                tdist.recv(ref, ranks[(gr - 1) % gR], group=grp)
                work.wait()
                ok = torch.equal(bits(out), bits(ref))
            else:
                ok = torch.equal(bits(out), bits(x))
            ok = ok and buf.rank_idx == gr and buf.num_ranks == gR
            detail = f"group rank {gr}/{gR}"
            buf.destroy()
        all_ranks_ok(comm, ok, f"{name}: PPBuffer and gloo delivered different tensors ({detail})")
