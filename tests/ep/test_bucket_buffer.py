"""``BucketBuffer`` (DeepEP V2.5's bucket collectives, docs/semantics/deepep-api.md §14.3) against independent
references: ``torch.distributed`` gloo on the same data (bit for bit where the reduction order cannot matter:
all-gather, exact small-integer data, two ranks; within 1e-5 otherwise) and a plain torch computation of the
documented reduction order from every rank's inputs gathered with mpi4py (bit for bit), on one node and
across two simulated nodes; batched and packed calls, ``scale`` and ``comm_precision``, plans from a
``BufferAllocator``, sessions with tensors outside the storage (DeepEP's tests/bucket/test_session.py), and
bad input raising on every rank.

Run: ``mpiexec -n N python -m pytest --with-mpi -q tests/ep/test_bucket_buffer.py`` (N = 1, 2, 4, 8).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepep_ascend import BucketBuffer, BufferAllocator
from tests.support.buffer_helpers import all_ranks_ok, bits, buffer_on_nodes, capture, coll
from tests.support.mpi_utils import gather_all, world

pytestmark = [pytest.mark.mpi(min_size=1), pytest.mark.watchdog(300)]

NUM_BYTES = 1 << 20
SCALES = (1.0, 0.25, -0.5, 0.0, 2.0)  # DeepEP's test_mixed: identity, zero, signed powers of two


def _build(nodes: int) -> BucketBuffer:
    R = world().Get_size()
    return coll(lambda: BucketBuffer(world(), NUM_BYTES, explicitly_destroy=True, ranks_per_node=R // nodes),
                what="BucketBuffer()")


@pytest.fixture(scope="module")
def one_node():
    yield from buffer_on_nodes(_build, 1)


@pytest.fixture(scope="module")
def two_nodes():
    """Two simulated nodes (1+1 ranks at 2, 2+2 at 4, 4+4 at 8): half the peers are read over URMA."""
    yield from buffer_on_nodes(_build, 2)


@pytest.fixture(params=[1, 2], ids=["one_node", "two_nodes"])
def buf(request, one_node, two_nodes):
    if request.param == 2 and two_nodes is None:
        pytest.skip("two simulated nodes need an even number of ranks")
    return one_node if request.param == 1 else two_nodes


@pytest.fixture(scope="module")
def gloo():
    import torch.distributed as tdist

    from deepep_ascend.nn import dist as ep_dist

    coll(ep_dist.init_distributed, what="init_distributed")
    return tdist


def _carve(buf: BucketBuffer, numels, dtype=torch.float32, start: int = 0) -> list[torch.Tensor]:
    """Tensors of the storage at the same offsets on every rank (128-byte aligned, from ``start``)."""
    out, off = [], start
    for n in numels:
        nbytes = n * dtype.itemsize
        out.append(buf.storage.narrow(0, off, nbytes).view(dtype))
        off += -(-nbytes // 128) * 128
    return out


def _data(kind: str, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "exact":  # small integers: every summation order gives the same float
        return torch.randint(-2, 3, (n,), generator=g).float()
    return torch.randn(n, generator=g)


def _ordered_sum(parts: list[torch.Tensor], owner: int) -> torch.Tensor:
    """The documented order: the owner's contribution, then ``owner - 1``, ``owner - 2``, ... (mod R), FP32."""
    R = len(parts)
    acc = parts[owner].clone()
    for i in range(1, R):
        acc += parts[(owner - i) % R]
    return acc


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32, torch.uint8])
def test_all_gather_in_place_matches_gloo(buf, gloo, dtype):
    """Two buckets of different, odd shard sizes in one call, gathered in place; bit for bit as gloo's
    ``all_gather``; the results are views of the gathered tensors (DeepEP's test_all_gather)."""
    comm = world()
    r, R = comm.Get_rank(), comm.Get_size()
    shards = (4096 + 8, 3 * 1024 + 1)
    gathered = _carve(buf, [R * s for s in shards], dtype)
    srcs, refs = [], []
    for i, (g, s) in enumerate(zip(gathered, shards)):
        src = g[r * s:(r + 1) * s]
        src.copy_((torch.randn(s, generator=torch.Generator().manual_seed(100 * r + i)) * 50).to(dtype))
        ref = [torch.empty(s, dtype=dtype) for _ in range(R)]
        gloo.all_gather(ref, src.clone())
        srcs.append(src)
        refs.append(torch.cat(ref))
    out = coll(lambda: buf.all_gather(srcs).wait(), what="all_gather")
    ok = all(o.data_ptr() == g.data_ptr() and o.dtype == dtype and torch.equal(bits(o), bits(ref))
             for o, g, ref in zip(out, gathered, refs))
    all_ranks_ok(comm, ok, f"all_gather {dtype} differs from gloo")


def test_all_gather_packed_and_dsts(buf, gloo):
    """One tensor in, one tensor out; with ``dsts`` the source may live outside the storage."""
    comm = world()
    r, R = comm.Get_rank(), comm.Get_size()
    (dst,) = _carve(buf, [R * 300])
    src = torch.arange(300, dtype=torch.float32) + 1000 * r
    ref = [torch.empty(300) for _ in range(R)]
    gloo.all_gather(ref, src)
    handle = coll(lambda: buf.all_gather(src, dsts=dst), what="all_gather dsts")
    out = handle.wait()
    ok = isinstance(out, torch.Tensor) and out.data_ptr() == dst.data_ptr() and torch.equal(out, torch.cat(ref))
    all_ranks_ok(comm, ok and handle.num_sms == 0, "all_gather with dsts")


@pytest.mark.parametrize("kind", ["exact", "normal"])
def test_reduce_scatter_matches_order_and_gloo(buf, gloo, kind):
    """Every scale (two for random data), two buckets per call: each rank's shard equals, bit for bit, the
    documented order's sum of all ranks' inputs times scale, lives at ``src + rank * shard bytes``, and
    equals gloo's all-reduce of the same data (bit for bit for exact data or two ranks, else within 1e-5)."""
    comm = world()
    r, R = comm.Get_rank(), comm.Get_size()
    numels = (R * 4096, R * (3 * 1024 + 8))
    ok, detail = True, ""
    for k, scale in enumerate(SCALES if kind == "exact" else SCALES[:3:2]):
        srcs = _carve(buf, numels)
        inputs = [_data(kind, n, 1000 * r + 10 * k + i) for i, n in enumerate(numels)]
        for s, x in zip(srcs, inputs):
            s.copy_(x)
        handle = coll(lambda: buf.reduce_scatter(srcs, scale=scale), what="reduce_scatter")
        outs = handle.wait()
        for s, x, o in zip(srcs, inputs, outs):
            m = x.numel() // R
            parts = [p[r * m:(r + 1) * m] for p in gather_all(x, comm)]
            expected = _ordered_sum(parts, r) * scale
            g = x.clone()
            gloo.all_reduce(g)
            g = g[r * m:(r + 1) * m] * scale
            exact = kind == "exact" or R <= 2
            good = (o.data_ptr() == s.data_ptr() + r * o.nbytes and o.shape == (m,)
                    and torch.equal(bits(o), bits(expected))
                    and (torch.equal(o, g) if exact else torch.allclose(o, g, rtol=1e-5, atol=1e-5)))
            if not good and ok:
                ok, detail = False, f"scale {scale}: max |diff| vs order {(o - expected).abs().max():.3g}"
        ok = ok and handle.num_sms == buf.get_theoretical_num_sms("reduce_scatter") == 1
    all_ranks_ok(comm, ok, f"reduce_scatter ({kind}): {detail}")


def test_reduce_scatter_bf16(buf, gloo):
    """``comm_precision='bf16'``: every contribution rounded to bfloat16 (nearest even), summed in FP32 in the
    documented order: bit for bit; exact small integers also equal gloo's FP32 sum."""
    comm = world()
    r, R = comm.Get_rank(), comm.Get_size()
    ok = True
    for kind in ("normal", "exact"):
        (src,) = _carve(buf, [R * 1000])
        x = _data(kind, R * 1000, 7 * r + 1) * 3
        src.copy_(x)
        out = coll(lambda: buf.reduce_scatter(src, comm_precision="bf16", scale=0.5).wait(), what="rs bf16")
        parts = [p[r * 1000:(r + 1) * 1000].to(torch.bfloat16).float() for p in gather_all(x, comm)]
        ok = ok and isinstance(out, torch.Tensor) and torch.equal(bits(out), bits(_ordered_sum(parts, r) * 0.5))
        if kind == "exact":
            g = x.clone()
            gloo.all_reduce(g)
            ok = ok and torch.equal(out, g[r * 1000:(r + 1) * 1000] * 0.5)
    all_ranks_ok(comm, ok, "reduce_scatter bf16")


@pytest.mark.parametrize("kind", ["exact", "normal"])
def test_all_reduce_matches_order_and_gloo(buf, gloo, kind):
    """In place, batched, every scale (two for random data), element counts not divisible by the ranks (and
    smaller than them): bit for bit the documented chunk order, identical on every rank, and gloo's
    all-reduce (bit for bit for exact data or two ranks, else within 1e-5); DeepEP's test_all_reduce."""
    comm = world()
    r, R = comm.Get_rank(), comm.Get_size()
    numels = (R * 4096, R * (3 * 1024 + 8) + 3, 1)
    ok, detail = True, ""
    for k, scale in enumerate(SCALES if kind == "exact" else SCALES[:3:2]):
        srcs = _carve(buf, numels)
        inputs = [_data(kind, n, 1000 * r + 10 * k + i) for i, n in enumerate(numels)]
        for s, x in zip(srcs, inputs):
            s.copy_(x)
        outs = coll(lambda: buf.all_reduce(srcs, scale=scale).wait(), what="all_reduce")
        for s, x, o in zip(srcs, inputs, outs):
            N = x.numel()
            everyone = gather_all(x, comm)
            expected = torch.cat([_ordered_sum([p[c * N // R:(c + 1) * N // R] for p in everyone], c)
                                  for c in range(R)]) * scale
            g = x.clone()
            gloo.all_reduce(g)
            g *= scale
            exact = kind == "exact" or R <= 2
            good = (o.data_ptr() == s.data_ptr() and torch.equal(bits(o), bits(expected))
                    and (torch.equal(o, g) if exact else torch.allclose(o, g, rtol=1e-5, atol=1e-5)))
            if not good and ok:
                ok, detail = False, f"scale {scale}, numel {N}"
        same = gather_all(torch.cat([bits(o) for o in outs]), comm)
        ok = ok and all(torch.equal(same[0], t) for t in same)
    all_ranks_ok(comm, ok, f"all_reduce ({kind}): {detail}")


def test_allocation_plan(gloo):
    """A ``BufferAllocator`` plan becomes views of the storage (DeepEP's tests build their buckets so), and the
    reduce-scatter shard then all-gathered back (DeepEP's ``rs_ag``) equals gloo's all-reduce."""
    comm = world()
    r, R = comm.Get_rank(), comm.Get_size()
    plan = BufferAllocator()
    a = plan.allocate((R * 64, 4), torch.float32)
    b = plan.allocate((R * 33,), torch.float32)
    buf = coll(lambda: BucketBuffer(world(), plan, explicitly_destroy=True), what="BucketBuffer(plan)")
    got = shards = gathered = None
    try:
        ok = buf.num_bytes == plan.num_bytes and a.device.type == "cpu" and buf._offset_of(a) == 0
        xa, xb = _data("exact", a.numel(), r).view(a.shape), _data("exact", b.numel(), r + 50)
        a.copy_(xa)
        b.copy_(xb)
        shards = coll(lambda: buf.reduce_scatter([a, b]).wait(), what="reduce_scatter")
        gathered = coll(lambda: buf.all_gather(shards).wait(), what="all_gather")
        for x, got in zip((xa, xb), gathered):
            g = x.clone().reshape(-1)
            gloo.all_reduce(g)
            ok = ok and torch.equal(got, g)
        ok = ok and gathered[0].data_ptr() == a.data_ptr()
    finally:
        a = b = plan = shards = gathered = got = None  # views of the storage: destroy refuses while they live
        coll(buf.destroy, what="destroy")
    all_ranks_ok(comm, ok, "allocation plan + rs_ag")


def test_session(buf, gloo):
    """DeepEP's test_session: tensors outside the storage staged in a session, then the in-place variants on
    the session's ``allocate``; results as gloo's."""
    comm = world()
    r, R = comm.Get_rank(), comm.Get_size()
    numel = R * 256
    g = torch.Generator().manual_seed(r)
    ag_src = torch.randn(numel // R, generator=g).view(-1, 4)
    rs_src = torch.randint(-3, 4, (numel,), generator=g).float().view(-1, 4)
    ar_src = torch.randint(-3, 4, (numel,), generator=g).float()
    ag_ref = [torch.empty_like(ag_src) for _ in range(R)]
    gloo.all_gather(ag_ref, ag_src)
    ag_ref = torch.stack(ag_ref)
    rs_ref = rs_src.clone().view(-1)
    gloo.all_reduce(rs_ref)
    rs_ref = rs_ref[r * (numel // R):(r + 1) * (numel // R)]
    ar_ref = ar_src.clone()
    gloo.all_reduce(ar_ref)
    ok = True

    def external():
        ag_dst = torch.empty(R, *ag_src.shape)
        with buf.session():
            got_ag = buf.all_gather(ag_src, dsts=ag_dst).wait()
            got_rs = buf.reduce_scatter(rs_src).wait()
            got_ar = buf.all_reduce(ar_src.clone()).wait()
        return got_ag is ag_dst, got_ag, got_rs, got_ar

    same, got_ag, got_rs, got_ar = coll(external, what="session (external tensors)")
    ok = same and torch.equal(got_ag, ag_ref) and torch.equal(got_rs, rs_ref) and torch.equal(got_ar, ar_ref)
    ok = ok and "all_gather" not in buf.__dict__  # the session's bindings are gone

    def in_place():
        with buf.session() as session:
            ag = session.allocate((R, *ag_src.shape))
            ag[r].copy_(ag_src)
            got_ag = buf.all_gather(ag[r]).wait()
            rs, ar = session.allocate([rs_src.shape, ar_src.shape])
            rs.copy_(rs_src)
            ar.copy_(ar_src)
            got_rs = buf.reduce_scatter(rs).wait()
            got_ar = buf.all_reduce(ar).wait()
            return got_ag, got_rs, got_ar, ar

    got_ag, got_rs, got_ar, ar = coll(in_place, what="session (in place)")
    ok = ok and torch.equal(got_ag, ag_ref.view(-1)) and torch.equal(got_rs, rs_ref) and torch.equal(got_ar, ar_ref)
    ok = ok and got_ar.data_ptr() == ar.data_ptr()
    with buf.session() as session:  # () is one 0-d shape; shapes of no element or not of ints are refused
        scalar = session.allocate(())
        ok = ok and scalar.shape == () and scalar.dtype == torch.float32
        for bad, kind, needle in (((0, 4), ValueError, "positive size"), ((-1, 4), ValueError, "(-1, 4)"),
                                  (("a",), ValueError, "('a',)"), ("a", TypeError, "got str")):
            _, err = capture(lambda: session.allocate(bad))
            ok = ok and isinstance(err, kind) and needle in str(err)
        scalar = None
    all_ranks_ok(comm, ok, "session")


def _expect_everywhere(fn, exc_type, needle: str, what: str) -> None:
    """``fn`` raises ``exc_type`` mentioning ``needle`` on every rank (the bad rank's own error, or the
    collective one naming it), within the deadline."""
    comm = world()
    _, err = capture(fn)
    ok = isinstance(err, exc_type) and needle in str(err)
    all_ranks_ok(comm, ok, f"{what}: expected {exc_type.__name__} with {needle!r}, got {err!r}")


def test_bad_input_raises_on_every_rank(buf):
    """Shapes, dtypes, storage, options, sessions misused, ranks disagreeing: raised on every rank before any
    byte moves; the buffer keeps working afterwards."""
    comm = world()
    r, R = comm.Get_rank(), comm.Get_size()
    (x,) = _carve(buf, [R * 64])
    outside = torch.zeros(R * 64)
    _expect_everywhere(lambda: buf.reduce_scatter(outside), ValueError, "inside this buffer's storage",
                       "src outside the storage")
    _expect_everywhere(lambda: buf.all_reduce(x.view(torch.int32)), ValueError, "torch.float32", "int32 all_reduce")
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        _expect_everywhere(lambda: getattr(buf, op)(x[:0]), ValueError, "is empty", f"zero-size {op}")
    if R > 1:
        _expect_everywhere(lambda: buf.reduce_scatter(x[:R * 64 - 1]), ValueError, "not a multiple",
                           "indivisible reduce_scatter")
    _expect_everywhere(lambda: buf.reduce_scatter(x, comm_precision="fp8"), ValueError, "comm_precision",
                       "bad comm_precision")
    _expect_everywhere(lambda: buf.all_gather(x[:64], num_sms=4), ValueError, "num_sms", "all_gather num_sms")
    _expect_everywhere(lambda: buf.get_theoretical_num_sms("all_to_all"), ValueError, "op must be", "bad op")
    # one rank refuses (its tensor is outside the storage); the others' good calls raise too
    bad = outside if r == R - 1 else x
    _expect_everywhere(lambda: buf.all_reduce(bad), ValueError, "refused" if r != R - 1 else "inside",
                       "one rank's bad src")
    if R > 1:  # ranks disagreeing on the offset or the scale
        y = _carve(buf, [R * 64], start=128 * ((R * 64 * 4 + 127) // 128) * (r == 0))[0]
        _expect_everywhere(lambda: buf.all_reduce(y), ValueError, "disagree", "offsets disagreeing")
        _expect_everywhere(lambda: buf.reduce_scatter(x, scale=1.0 + r), ValueError, "disagree", "scales disagreeing")
    with buf.session():
        _expect_everywhere(lambda: buf.session().__enter__(), RuntimeError, "nest", "nested session")
        _expect_everywhere(lambda: buf.all_gather(torch.zeros(4), dsts=torch.zeros(4 * R + 1)), ValueError,
                           "dst must", "session dst size")
    # srcs neither a tensor nor a sequence on one rank: a clear error there, every other rank refused too
    for op, call in (("all_reduce", lambda v: buf.all_reduce(v)), ("reduce_scatter", lambda v: buf.reduce_scatter(v)),
                     ("all_gather", lambda v: buf.all_gather(torch.zeros(64), dsts=v))):
        _expect_everywhere(lambda: call(5 if r == 0 else x), TypeError if r == 0 else ValueError,
                           "must be a tensor or a list" if r == 0 else "rank 0 refused", f"{op} of an int")
    # tensors of one batched call sharing bytes: refused (each would read the other's partial sums)
    _expect_everywhere(lambda: buf.all_reduce([x, x]), ValueError, "srcs[0] and srcs[1] share bytes", "aliased srcs")
    _expect_everywhere(lambda: buf.reduce_scatter([x[:R * 32], x[R * 16:R * 48]]), ValueError, "share bytes",
                       "overlapping srcs")
    _expect_everywhere(lambda: buf.all_gather([torch.zeros(4), torch.zeros(4)], dsts=[x[:4 * R], x[2:2 + 4 * R]]),
                       ValueError, "dsts[0] and dsts[1] share bytes", "overlapping dsts")
    _expect_everywhere(lambda: buf.all_gather(torch.zeros(4, dtype=torch.float16),
                                              dsts=x[:2 * R].view(torch.bfloat16)), ValueError, "dtype",
                       "all_gather dsts of another dtype")
    # a src inside another src's dst (it would be overwritten before it is read), or over part of its own dst
    d0, d1 = x[:2 * R], x[2 * R:4 * R]
    _expect_everywhere(lambda: buf.all_gather([torch.zeros(2), d0[2 * r:2 * r + 2]], dsts=[d0, d1]), ValueError,
                       "srcs[1] shares bytes of the storage with dsts[0]", "a src inside another src's dst")
    if R > 1:
        _expect_everywhere(lambda: buf.all_gather(d0[1:3] if r == 0 else torch.zeros(2), dsts=d0),
                           ValueError, "shares bytes" if r == 0 else "refused", "a src over part of its own dst")
    own = d0[2 * r:2 * r + 2]  # a src that is its own shard of its dst: accepted, gathered in place
    own.fill_(float(r))
    got = coll(lambda: buf.all_gather(own, dsts=d0).wait(), what="all_gather of a src that is its own shard")
    all_ranks_ok(comm, torch.equal(got, torch.arange(R).float().repeat_interleave(2)), "own shard in place")
    coll(lambda: buf.all_reduce(x, scale=np.float32(0.5), num_sms=np.int64(0)).wait(), what="numpy scale, num_sms")
    with buf.session() as session:
        _expect_everywhere(lambda: session.allocate((0,)), ValueError, "positive size", "session allocate of 0")
        if R > 1:
            _expect_everywhere(lambda: buf.reduce_scatter(torch.ones(2 * R + 1)), ValueError, "not a multiple",
                               "session reduce_scatter indivisible")
    x.copy_(torch.full((R * 64,), float(r)))
    out = coll(lambda: buf.all_reduce(x).wait(), what="all_reduce after the errors")
    all_ranks_ok(comm, torch.equal(out, torch.full((R * 64,), float(R * (R - 1) // 2))), "buffer after errors")


def test_non_finite_scale(buf):
    """NaN and infinite scales, the same on every rank, are agreed on and applied as IEEE arithmetic does
    (DeepEP passes them to its kernels); NaN on one rank and inf on another, or -0.0 against 0.0, disagree."""
    comm = world()
    r, R = comm.Get_rank(), comm.Get_size()
    (x,) = _carve(buf, [R * 8])
    parts = [torch.arange(R * 8, dtype=torch.float32) - 3 * q for q in range(R)]
    total = _ordered_sum(parts, 0)
    problems = []
    for scale in (float("nan"), float("inf"), -float("inf")):
        for op in ("all_reduce", "reduce_scatter"):
            x.copy_(parts[r])
            out, err = capture(lambda: getattr(buf, op)(x, scale=scale).wait())
            want = total * scale if op == "all_reduce" else (total * scale).view(R, -1)[r]
            if not isinstance(out, torch.Tensor) or not torch.equal(out.isnan(), want.isnan()) or \
                    not torch.equal(out.nan_to_num(), want.nan_to_num()):
                problems.append(f"{op}(scale={scale}): got {out!r}, {err!r}")
    all_ranks_ok(comm, not problems, "; ".join(problems))
    if R > 1:
        _expect_everywhere(lambda: buf.all_reduce(x, scale=float("nan") if r == 0 else float("inf")), ValueError,
                           "disagree", "nan against inf")
        _expect_everywhere(lambda: buf.all_reduce(x, scale=-0.0 if r == 0 else 0.0), ValueError, "disagree",
                           "-0.0 against 0.0")


def test_constructor_errors():
    """A bad byte count, a materialized plan, several groups, ranks disagreeing on the size: every rank."""
    comm = world()
    r = comm.Get_rank()
    _expect_everywhere(lambda: BucketBuffer(world(), 0), ValueError, "positive int", "num_bytes 0")
    plan = BufferAllocator()
    plan.allocate((8,), torch.float32)
    plan.materialize(torch.empty(plan.num_bytes, dtype=torch.uint8))
    _expect_everywhere(lambda: BucketBuffer(world(), plan), ValueError, "materialized", "materialized plan")
    lone = world().Split(r, 0)  # this rank alone: inside the world, but not a group to register first
    if comm.Get_size() > 1:
        _expect_everywhere(lambda: BucketBuffer([lone, world()], 1024), ValueError, "inside the first",
                           "a group outside the first")
    lone.Free()
    if comm.Get_size() > 1:
        _expect_everywhere(lambda: BucketBuffer(world(), 1024 * (1 + (r == 0))), ValueError, "num_bytes",
                           "sizes disagreeing")


def test_destroyed():
    buf = coll(lambda: BucketBuffer(world(), 4096, explicitly_destroy=True), what="BucketBuffer()")
    coll(buf.destroy, what="destroy")
    _, err = capture(lambda: buf.all_gather(torch.zeros(4)))
    _, err2 = capture(buf.session)
    all_ranks_ok(world(), all(isinstance(e, RuntimeError) and "destroyed" in str(e) for e in (err, err2)),
                 f"after destroy: {err!r}, session(): {err2!r}")


def test_deadline_names_the_call():
    """A rank that never joins: the others give up at the deadline with a TimeoutError naming the call."""
    import time

    comm = world()
    r, R = comm.Get_rank(), comm.Get_size()
    if R == 1:
        pytest.skip("needs a peer that stays away")
    buf = coll(lambda: BucketBuffer(world(), 4096, explicitly_destroy=True, timeout_s=1.0), what="BucketBuffer()")
    start = time.monotonic()
    err = None
    if r != R - 1:
        _, err = capture(lambda: buf.all_reduce(buf.storage[:64].view(torch.float32)))
    elapsed = time.monotonic() - start
    comm.Barrier()
    ok = r == R - 1 or (isinstance(err, TimeoutError) and "BucketBuffer.all_reduce" in str(err) and elapsed < 30)
    what, err = repr(err), None  # its traceback holds the call's views of the storage
    buf.runtime.timeout_s = 60.0  # the 1 s deadline is the all_reduce's; a loaded host may take longer to tear down
    coll(buf.destroy, what="destroy after a timeout")
    all_ranks_ok(comm, ok, f"expected a TimeoutError naming the call within the deadline, got {what}")


def test_process_group(gloo):
    """Built on a torch ProcessGroup (gloo) and called with ``group=`` that group, as DeepEP's tests do."""
    comm = world()
    r, R = comm.Get_rank(), comm.Get_size()
    group = gloo.group.WORLD
    buf = coll(lambda: BucketBuffer(group, 1 << 16, explicitly_destroy=True), what="BucketBuffer(ProcessGroup)")
    x = buf.storage[:R * 64 * 4].view(torch.float32)
    x.copy_(torch.arange(R * 64, dtype=torch.float32) * (r + 1))
    ref = x.clone()
    gloo.all_reduce(ref, group=group)
    out = coll(lambda: buf.all_reduce(x, group=group, scale=0.5).wait(), what="all_reduce(group=)")
    ok = torch.equal(out, ref * 0.5) and buf.get_context_idx(group) == 0
    _, err = capture(lambda: buf.get_context_idx(object()))
    ok = ok and isinstance(err, ValueError)
    x = out = None  # views of the storage: destroy refuses while they live
    coll(buf.destroy, what="destroy")
    all_ranks_ok(comm, ok, "ProcessGroup")


def test_several_groups(gloo):
    """DeepEP's test_mixed groups on one storage: the world, this rank's half and its rail (ranks ``r % (R/2)``);
    a schedule of all three ops and barriers over them, the same on every rank, interleaving the groups. Each
    result equals, bit for bit, the documented order over the group's ranks' inputs (gathered with mpi4py over
    the group); calls without ``group=`` raise on every rank; a session on a subgroup."""
    import random

    comm = world()
    r, R = comm.Get_rank(), comm.Get_size()
    half = max(R // 2, 1)
    subs = [comm.Split(r // half, r), comm.Split(r % half, r)]
    groups = [comm, *subs]
    buf = coll(lambda: BucketBuffer(groups, 1 << 18, explicitly_destroy=True, ranks_per_node=half),
               what="BucketBuffer(groups)")
    rng = random.Random(5)  # the same schedule on every rank
    ok, detail = True, ""
    for step in range(12):
        gi = rng.randrange(3)
        op = rng.choice(("all_gather", "reduce_scatter", "all_reduce", "barrier"))
        g = groups[gi]
        gr, gR = g.Get_rank(), g.Get_size()
        if op == "barrier":
            coll(lambda: buf.barrier(group=g), what="barrier")
            continue
        x = _data("normal", gR * 40, 97 * step + r)
        (t,) = _carve(buf, [gR * 40], start=128 * (step % 3) * 8)
        everyone = gather_all(x, g)
        if op == "all_gather":
            t[gr * 40:(gr + 1) * 40].copy_(x[:40])
            out = coll(lambda: buf.all_gather(t[gr * 40:(gr + 1) * 40], group=g).wait(), what=op)
            expected = torch.cat([p[:40] for p in everyone])
        elif op == "reduce_scatter":
            t.copy_(x)
            out = coll(lambda: buf.reduce_scatter(t, group=g, scale=-0.5).wait(), what=op)
            expected = _ordered_sum([p[gr * 40:(gr + 1) * 40] for p in everyone], gr) * -0.5
        else:
            t.copy_(x)
            out = coll(lambda: buf.all_reduce(t, group=g).wait(), what=op)
            N = t.numel()
            expected = torch.cat([_ordered_sum([p[c * N // gR:(c + 1) * N // gR] for p in everyone], c)
                                  for c in range(gR)])
        if not torch.equal(bits(out), bits(expected)) and ok:
            ok, detail = False, f"step {step}: {op} on group {gi} ({gR} ranks)"
    if R > 1:
        (t,) = _carve(buf, [64])
        _expect_everywhere(lambda: buf.all_reduce(t), ValueError, "required", "no group= with several groups")

    def session():
        with buf.session():
            y = torch.full((subs[1].Get_size() * 8,), float(r))
            return buf.all_reduce(y, group=subs[1]).wait()

    total = coll(session, what="session on a subgroup")
    rail = subs[1].allgather(r)
    ok = ok and torch.equal(total, torch.full_like(total, float(sum(rail))))
    out = t = total = None  # views of the storage: destroy refuses while they live
    coll(buf.destroy, what="destroy")
    for sub in subs:
        sub.Free()
    all_ranks_ok(comm, ok, f"several groups: {detail}")


def test_guards_untouched(buf):
    """DeepEP's test_mixed guards: the bytes around each tensor keep their value through every op, batched,
    on every rank (a collective writes only inside its tensors)."""
    comm = world()
    r, R = comm.Get_rank(), comm.Get_size()
    guard, sizes = 12345.0, (R * 40, R * 8, R * 96)
    region = buf.storage[:64 * 1024].view(torch.float32)
    ok = True
    for op in ("all_gather", "reduce_scatter", "reduce_scatter_bf16", "all_reduce"):
        region.fill_(guard)
        tensors = _carve(buf, [n + 32 for n in sizes])  # 8 guard elements before, 24 after each tensor
        inner = [t[8:-24] for t in tensors]
        for i, t in enumerate(inner):
            t.copy_(_data("exact", t.numel(), 31 * r + i))
        if op == "all_gather":
            m = [t.numel() // R for t in inner]
            out = coll(lambda: buf.all_gather([t[r * k:(r + 1) * k] for t, k in zip(inner, m)]).wait(), what=op)
        elif op.startswith("reduce_scatter"):
            prec = "bf16" if op.endswith("bf16") else "fp32"
            out = coll(lambda: buf.reduce_scatter(inner, comm_precision=prec, scale=2.0).wait(), what=op)
        else:
            out = coll(lambda: buf.all_reduce(inner, scale=0.25).wait(), what=op)
        used = sum(-(-(n + 32) * 4 // 128) * 128 for n in sizes) // 4
        ok = ok and all(torch.all(t[:8] == guard) and torch.all(t[-24:] == guard) for t in tensors)
        ok = ok and bool(torch.all(region[used:] == guard)) and len(out) == len(inner)
    out = tensors = inner = region = None  # views of the storage
    all_ranks_ok(comm, ok, "guard bytes around the tensors changed")


def test_refused_destroy_leaves_the_buffer_usable():
    """A tensor of the storage alive on rank 0 only: destroy() raises TransportBusy on every rank, the storage
    still all-reduces (the sum of the ranks' values), and once the tensor is dropped destroy() succeeds."""
    from deepep_ascend.transports import TransportBusy

    comm = world()
    r, R = comm.Get_rank(), comm.Get_size()
    buf = coll(lambda: BucketBuffer(world(), 4096, explicitly_destroy=True), what="BucketBuffer()")
    held = buf.storage[:16] if r == 0 else None
    _, err = capture(buf.destroy)
    errors = [] if isinstance(err, TransportBusy) else [f"destroy() with a live tensor on rank 0: {err!r}"]
    src = buf.storage[:256].view(torch.float32)
    src.fill_(r + 1.0)
    out, err = capture(lambda: buf.all_reduce(src).wait())
    if err is not None or not torch.equal(out, torch.full((64,), R * (R + 1) / 2)):
        errors.append(f"all_reduce after the refused destroy: {err!r}")
    del held
    src = out = None
    _, err = capture(buf.destroy)
    if err is not None:
        errors.append(f"destroy() after dropping the tensor: {err!r}")
    all_ranks_ok(comm, not errors, f"rank {r}: " + "; ".join(errors))


def test_a_timeout_aborts_the_peers_and_a_refused_destroy_says_why():
    """Rank 0 all-reduces alone and times out, aborting the others: their next collective fails at once with the
    ``TransportPeerTimeout`` naming rank 0. With a tensor of the storage alive on every rank, ``destroy()`` raises
    ``TransportBusy`` on every rank, and leaves ``storage`` None (every rank's transport failed: the buffer is
    unusable); once the tensors are dropped it succeeds everywhere."""
    import time

    from deepep_ascend.transports import TransportBusy, TransportPeerTimeout, TransportTimeout

    comm = world()
    r, R = comm.Get_rank(), comm.Get_size()
    if R == 1:
        pytest.skip("needs a peer that stays away")
    buf = coll(lambda: BucketBuffer(world(), 4096, explicitly_destroy=True, timeout_s=1.0), what="BucketBuffer()")
    held = buf.storage[:256].view(torch.float32)
    errors = []
    if r == 0:
        _, err = capture(lambda: buf.all_reduce(held))
        if not isinstance(err, TransportTimeout) or "BucketBuffer.all_reduce" not in str(err):
            errors.append(f"the lone all_reduce raised {err!r}")
    comm.Barrier()
    if r:
        start = time.monotonic()
        _, err = capture(lambda: buf.all_reduce(held))
        if not isinstance(err, TransportPeerTimeout) or err.peer != 0:  # (its own timeout: a TransportTimeout)
            errors.append(f"an all_reduce after rank 0's timeout raised {err!r} after {time.monotonic() - start:.1f} s")
    err = None  # its traceback holds the call's views of the storage
    _, err = capture(buf.destroy)
    if not isinstance(err, TransportBusy) or buf.runtime is None or buf.storage is not None:
        errors.append(f"destroy() with a live tensor: {err!r}, storage {'None' if buf.storage is None else 'kept'}")
    held = err = None
    _, err = capture(buf.destroy)
    if err is not None or buf.runtime is not None:
        errors.append(f"destroy() once the tensors are dropped: {err!r}")
    all_ranks_ok(comm, not errors, f"rank {r}: " + "; ".join(errors))
