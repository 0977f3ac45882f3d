"""``EngramBuffer`` (DeepEP V2.5's Engram fetch) against an independent reference: every rank's shards
all-gathered with mpi4py and indexed with plain torch, bit for bit (data and scales), on one node and
on two simulated nodes, with and without hybrid mode; the size hints and DeepEP's theoretical config by
hand; the edge cases of DeepEP's tests/engram/test_engram.py (both waiting orders, FP8 with replicated
scales) and bad input raising on every rank (docs/semantics/deepep-api.md §14.1). Every test is collective.

Run: ``mpiexec -n N python -m pytest --with-mpi -q tests/ep/test_engram_buffer.py`` (N = 1, 2, 4, 8).
"""

from __future__ import annotations

import pytest
import torch

from deepep_ascend import EngramBuffer
from tests.support.buffer_helpers import all_ranks_ok, buffer_on_nodes, capture, coll
from tests.support.mpi_utils import allgather_object, gather_all, world
from tests.support.reference import per_token_cast_to_fp8

pytestmark = [pytest.mark.mpi(min_size=1), pytest.mark.watchdog(300)]

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
ENTRIES = [37, 53, 16]  # per rank and layer: odd counts, so owners and shards do not line up with tokens
HIDDEN, MAX_TOKENS, PER_TOKEN = 256, 24, 6
PACKS = HIDDEN // 128


def _sizes(nodes: int) -> tuple[int, int]:
    """Bytes that fit both the BF16 and the FP8 configuration (the larger of the two hints)."""
    R = world().Get_size()
    hints = [EngramBuffer.get_storage_size_hint(world(), ENTRIES, HIDDEN, MAX_TOKENS, PER_TOKEN, dtype, packs,
                                                ranks_per_node=R // nodes)
             for dtype, packs in ((BF16, 0), (FP8, PACKS))]
    return max(h[0] for h in hints), max(h[1] for h in hints)


def _build(nodes: int = 1, hybrid: bool = True, **kwargs) -> EngramBuffer:
    R = world().Get_size()
    gpu, storage = _sizes(nodes)
    qps, depth, restrict = EngramBuffer.get_theoretical_config(world(), len(ENTRIES), MAX_TOKENS, PER_TOKEN,
                                                               ranks_per_node=R // nodes)
    return coll(lambda: EngramBuffer(world(), gpu, storage, True, qps, depth, restrict, allow_hybrid_mode=hybrid,
                                     explicitly_destroy=True, ranks_per_node=R // nodes, **kwargs),
                what="EngramBuffer()")


@pytest.fixture(scope="module")
def one_node():
    yield from buffer_on_nodes(_build, 1)


@pytest.fixture(scope="module")
def two_nodes():
    """Two simulated nodes (2x1 at 2 ranks, 2x2 at 4, 2x4 at 8): URMA across, UBMEM inside."""
    yield from buffer_on_nodes(_build, 2)


def _tables(fp8: bool, seed: int, ue8m0: bool = False):
    """This rank's shards, the scale tables every rank passes, and the reference global tables (all ranks' shards
    in rank order, gathered with mpi4py)."""
    rank = world().Get_rank()
    g = torch.Generator().manual_seed(1000 * seed + rank)
    shards, sfs, tables = [], [] if fp8 else None, []
    for n in ENTRIES:
        x = (torch.randn(n, HIDDEN, generator=g) * 2.0 ** torch.randint(-8, 8, (n, 1), generator=g)).to(BF16)
        if fp8:
            shard, sf = per_token_cast_to_fp8(x)
            if ue8m0:  # packed UE8M0 scales travel as int32 packs: any 4-byte pattern must arrive unchanged
                sf = torch.randint(-2 ** 31, 2 ** 31 - 1, sf.shape, generator=g, dtype=torch.int32)
            sfs.append(torch.cat(gather_all(sf)))  # DeepEP's test replicates the scales with all_gather
        else:
            shard = x
        shards.append(shard)
        tables.append(torch.cat(gather_all(shard.view(torch.uint8))))
    return shards, sfs, tables


def _indices(seed: int, tokens: int, per_token: int, pattern: str = "random") -> torch.Tensor:
    """``[L, tokens, per_token]`` int32 entry ids; DeepEP's test draws entry ``e`` from its own slice of the table."""
    R, rank = world().Get_size(), world().Get_rank()
    g = torch.Generator().manual_seed(7919 * seed + rank)
    layers = []
    for n in ENTRIES:
        size = R * n
        if pattern == "random":
            ids = torch.randint(0, size, (tokens, per_token), generator=g)
        elif pattern == "slices":  # tests/engram/test_engram.py's gen_indices
            table = size // per_token
            ids = torch.arange(per_token) * table + torch.randint(0, table, (tokens, per_token), generator=g)
        elif pattern == "edges":  # the first and last entry of every rank's shard, repeated
            edges = torch.stack([torch.arange(R) * n, torch.arange(R) * n + n - 1], 1).reshape(-1)
            ids = edges[torch.randint(0, edges.numel(), (tokens, per_token), generator=g)]
        elif pattern == "one_rank":  # every entry on the last rank (one owner, one scale shard)
            ids = (R - 1) * n + torch.randint(0, n, (tokens, per_token), generator=g)
        else:
            raise ValueError(pattern)
        layers.append(ids)
    return torch.stack(layers).to(torch.int32)


def _expected(tables, sfs, indices, fp8):
    data, scales = [], []
    for layer, table in enumerate(tables):
        ids = indices[layer].reshape(-1).long()
        tokens = indices.shape[1]
        data.append(table.view(-1, HIDDEN * (1 if fp8 else 2))[ids].reshape(tokens, -1))
        if fp8:
            scales.append(sfs[layer][ids].reshape(tokens, -1))
    return data, scales


def _check(buf, tables, sfs, indices, fp8, order, col_major=True, reuse=None):
    """Fetch, wait in ``order``, compare with the reference; True when every byte matches. ``reuse``: indices
    written into ``indices`` right after fetch returns (the caller may reuse its tensor at once)."""
    asked = indices.clone()
    hooks = buf.fetch(indices, use_tma_aligned_col_major_sf=col_major)
    if reuse is not None:
        indices.copy_(reuse)
    data, scales = _expected(tables, sfs, asked, fp8)
    ok = len(hooks) == len(ENTRIES)
    tokens = indices.shape[1]
    for layer in order:
        got = hooks[layer]()
        d, s = got if fp8 else (got, None)
        ok &= d.dtype == (FP8 if fp8 else BF16) and tuple(d.shape) == (tokens, indices.shape[2] * HIDDEN)
        ok &= torch.equal(d.reshape(tokens, -1).view(torch.uint8), data[layer].view(tokens, -1))
        if fp8:
            ok &= tuple(s.shape) == tuple(scales[layer].shape) and s.dtype == scales[layer].dtype
            ok &= torch.equal(s, scales[layer])
            if col_major:
                ok &= s.stride() == (1, -(-tokens // 4) * 4)
            else:
                ok &= s.is_contiguous()
        again = hooks[layer]()  # a hook may be called again
        ok &= (again[0] if fp8 else again) is d
    return ok


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("nodes", [1, 2], ids=["one_node", "two_nodes"])
def test_fetch_matches_reference(one_node, two_nodes, nodes, fp8):
    buf = one_node if nodes == 1 else two_nodes
    if buf is None:
        pytest.skip("two simulated nodes need an even number of ranks")
    dtype, packs = (FP8, PACKS) if fp8 else (BF16, 0)
    coll(buf.set_config, ENTRIES, HIDDEN, MAX_TOKENS, PER_TOKEN, dtype, packs, what="set_config")
    shards, sfs, tables = _tables(fp8, seed=nodes)
    coll(buf.write, shards, sfs=sfs, what="write")
    ok = True
    # DeepEP's test: layers waited in forward and in reverse order, indices drawn per slice
    for seed, order in enumerate((range(len(ENTRIES)), reversed(range(len(ENTRIES))))):
        ok &= _check(buf, tables, sfs, _indices(seed, MAX_TOKENS, PER_TOKEN, "slices"), fp8, list(order))
    # every entry is read once, scales included: the bytes counted per channel kind add up to the request
    before = sum(buf.get_traffic().values())
    ok &= _check(buf, tables, sfs, _indices(9, MAX_TOKENS, PER_TOKEN), fp8, [0, 1, 2])
    row_bytes = HIDDEN * (1 if fp8 else 2) + (4 * PACKS if fp8 else 0)
    ok &= sum(buf.get_traffic().values()) - before == len(ENTRIES) * MAX_TOKENS * PER_TOKEN * row_bytes
    for seed, pattern in enumerate(("random", "edges", "one_rank")):
        ok &= _check(buf, tables, sfs, _indices(10 + seed, MAX_TOKENS, PER_TOKEN, pattern), fp8, [2, 0, 1])
    # fewer tokens and entries per token than configured; row-major scales
    ok &= _check(buf, tables, sfs, _indices(20, 5, 3), fp8, [0, 1, 2], col_major=False)
    ok &= _check(buf, tables, sfs, _indices(21, 1, PER_TOKEN), fp8, [1, 2, 0])
    all_ranks_ok(world(), ok, f"fetch vs reference ({nodes} node(s), {'fp8' if fp8 else 'bf16'})")
    traffic = buf.get_traffic()
    if nodes == 2:
        all_ranks_ok(world(), traffic["URMA"] > 0, "two nodes: some entries were read over URMA")


def test_fetch_without_hybrid_mode_reads_over_urma():
    """allow_hybrid_mode=False: node peers' storage is read over URMA too (scale shards stay node-local, as in
    DeepEP); the results do not change."""
    buf = _build(1, hybrid=False)
    R = world().Get_size()
    try:
        coll(buf.set_config, ENTRIES, HIDDEN, MAX_TOKENS, PER_TOKEN, what="set_config")
        shards, _, tables = _tables(False, seed=4)
        coll(buf.write, shards, what="write")
        ok = _check(buf, tables, None, _indices(29, MAX_TOKENS, PER_TOKEN), False, [1, 0, 2])
        traffic = buf.get_traffic()
        all_ranks_ok(world(), traffic["UBMEM"] == 0 and (traffic["URMA"] > 0 or R == 1),
                     f"storage reads go over URMA without hybrid mode: {traffic}")
        coll(buf.set_config, ENTRIES, HIDDEN, MAX_TOKENS, PER_TOKEN, FP8, PACKS, what="set_config")
        shards, sfs, tables = _tables(True, seed=5)
        coll(buf.write, shards, sfs, what="write")
        ok &= _check(buf, tables, sfs, _indices(30, MAX_TOKENS, PER_TOKEN), True, [0, 1, 2])
        all_ranks_ok(world(), ok, "fetch without hybrid mode")
        all_ranks_ok(world(), buf.get_logical_domain_size() == (1, R), "logical domain (1, R)")
    finally:
        coll(buf.destroy, what="destroy")


def test_edge_cases(one_node):
    """Zero tokens, UE8M0 int32 scale packs, a second write replacing the tables, indices reused at once,
    fetched data overwritten by the next fetch (DeepEP's receive area) while scales are fresh."""
    buf = one_node
    coll(buf.set_config, ENTRIES, HIDDEN, MAX_TOKENS, PER_TOKEN, FP8, PACKS, what="set_config")
    shards, sfs, tables = _tables(True, seed=40, ue8m0=True)
    coll(buf.write, shards, sfs, what="write")
    ok = True
    hooks = buf.fetch(torch.zeros(len(ENTRIES), 0, PER_TOKEN, dtype=torch.int32))
    data, sf = hooks[1]()
    ok &= tuple(data.shape) == (0, PER_TOKEN * HIDDEN) and tuple(sf.shape) == (0, PER_TOKEN * PACKS)
    ok &= _check(buf, tables, sfs, _indices(41, MAX_TOKENS, PER_TOKEN), True, [0, 1, 2])
    ok &= _check(buf, tables, sfs, _indices(42, MAX_TOKENS, PER_TOKEN), True, [2, 1, 0],
                 reuse=_indices(43, MAX_TOKENS, PER_TOKEN))
    # the next fetch overwrites the data views of the previous one, not its scales
    first = buf.fetch(_indices(44, MAX_TOKENS, PER_TOKEN))
    d0, s0 = first[0]()
    s0_copy = s0.clone()
    second = buf.fetch(_indices(45, MAX_TOKENS, PER_TOKEN))
    d1, s1 = second[0]()
    ok &= d0.data_ptr() == d1.data_ptr() and torch.equal(s0, s0_copy) and s0.data_ptr() != s1.data_ptr()
    # write again (BF16 now): the same buffer serves the new tables
    coll(buf.set_config, ENTRIES, HIDDEN, MAX_TOKENS, PER_TOKEN, BF16, 0, what="set_config bf16")
    shards, _, tables = _tables(False, seed=46)
    coll(buf.write, shards, what="write bf16")
    ok &= _check(buf, tables, None, _indices(47, MAX_TOKENS, PER_TOKEN), False, [1, 0, 2])
    all_ranks_ok(world(), ok, "edge cases")


def test_size_hints_and_config_by_hand():
    R = world().Get_size()
    a = 128
    for nodes in sorted({1, 2} if R % 2 == 0 else {1}):
        rows = sum(ENTRIES)
        gpu, storage = EngramBuffer.get_storage_size_hint(world(), ENTRIES, HIDDEN, MAX_TOKENS, PER_TOKEN,
                                                          ranks_per_node=R // nodes)
        recv = -(-len(ENTRIES) * MAX_TOKENS * PER_TOKEN * HIDDEN * 2 // a) * a
        ok = (gpu, storage) == (recv, -(-rows * HIDDEN * 2 // a) * a)
        gpu, storage = EngramBuffer.get_storage_size_hint(world(), ENTRIES, HIDDEN, MAX_TOKENS, PER_TOKEN, FP8,
                                                          PACKS, ranks_per_node=R // nodes)
        recv = -(-len(ENTRIES) * MAX_TOKENS * PER_TOKEN * HIDDEN // a) * a
        sf = -(-rows * nodes * PACKS * 4 // a) * a
        ok &= (gpu, storage) == (recv + sf, -(-rows * HIDDEN // a) * a)
        # DeepEP's formula: ceil(45e6 reads/s * 10 us / 16 per QP / nodes) QPs; depth doubles from 1024
        qps = {1: 29, 2: 15}[nodes]
        ok &= EngramBuffer.get_theoretical_config(world(), 2, 512, 24, ranks_per_node=R // nodes) == (qps, 1024, False)
        slots = -(-(4 * 4096 * 24) // (qps * nodes))
        depth = 1024
        while depth < slots:
            depth *= 2
        ok &= EngramBuffer.get_theoretical_config(world(), 4, 4096, 24, ranks_per_node=R // nodes) == \
            (qps, depth, False)
        big = 2 * 524288 * 24
        ok &= EngramBuffer.get_theoretical_config(world(), 2, 524288, 24, ranks_per_node=R // nodes) == \
            (int(-(-big // (32768 * nodes)) * 1.05), 32768, True)
        all_ranks_ok(world(), ok, f"size hints and theoretical config ({nodes} node(s))")
    for args, kind in (((ENTRIES, -1, MAX_TOKENS, PER_TOKEN), ValueError),
                       ((ENTRIES, HIDDEN, MAX_TOKENS, PER_TOKEN, "bf16"), TypeError),
                       (([], HIDDEN, MAX_TOKENS, PER_TOKEN), ValueError)):
        _, exc = capture(lambda: EngramBuffer.get_storage_size_hint(world(), *args))
        all_ranks_ok(world(), isinstance(exc, kind) and "get_storage_size_hint" in str(exc), f"hint {args}: {exc!r}")
    _, exc = capture(lambda: EngramBuffer.get_theoretical_config(world(), 0, MAX_TOKENS, 2.5))  # DeepEP's assertion
    all_ranks_ok(world(), isinstance(exc, AssertionError) and "num_layers=0, num_entries_per_token=2.5" in str(exc),
                 f"theoretical config of no layers: {exc!r}")


def test_size_hint_for_another_node_count_is_refused(two_nodes):
    """A hint made for one node leaves a two-node buffer's ``num_gpu_bytes`` short of the FP8 scale shard:
    ``set_config`` raises on every rank naming ``ranks_per_node``; the hint for the buffer's node size fits."""
    R = world().Get_size()
    if R % 2:
        pytest.skip("two simulated nodes need an even number of ranks")
    buf, packs = two_nodes, 200  # scale shard: sum(ENTRIES) * nodes * packs * 4 B
    one = EngramBuffer.get_storage_size_hint(world(), ENTRIES, HIDDEN, MAX_TOKENS, PER_TOKEN, FP8, packs,
                                             ranks_per_node=R)
    two = EngramBuffer.get_storage_size_hint(world(), ENTRIES, HIDDEN, MAX_TOKENS, PER_TOKEN, FP8, packs,
                                             ranks_per_node=R // 2)
    a = 128
    recv = -(-len(ENTRIES) * MAX_TOKENS * PER_TOKEN * HIDDEN // a) * a
    assert one[0] == recv + -(-sum(ENTRIES) * packs * 4 // a) * a
    assert two[0] == recv + -(-sum(ENTRIES) * 2 * packs * 4 // a) * a
    assert one[0] <= buf.num_gpu_bytes < two[0]  # the sizes this test relies on
    _raises_everywhere(lambda: buf.set_config(ENTRIES, HIDDEN, MAX_TOKENS, PER_TOKEN, FP8, packs), ValueError,
                       f"ranks_per_node={R // 2}", "set_config with a one-node hint on two nodes")


def _raises_everywhere(fn, kinds, text, what):
    """``fn`` raised one of ``kinds`` on every rank, the message containing ``text`` on at least one."""
    _, exc = capture(fn)
    all_ranks_ok(world(), isinstance(exc, kinds), f"{what}: raised {type(exc).__name__}: {exc}")
    all_ranks_ok(world(), any(text in m for m in allgather_object(str(exc), world())), f"{what}: message names {text}")


def test_bad_input_raises_on_every_rank(one_node):
    buf, R, rank = one_node, world().Get_size(), world().Get_rank()
    coll(buf.set_config, ENTRIES, HIDDEN, MAX_TOKENS, PER_TOKEN, BF16, 0, what="set_config")
    shards, _, tables = _tables(False, seed=60)
    coll(buf.write, shards, what="write")
    last = rank == R - 1
    # collective calls: one rank's bad argument, or ranks disagreeing, fails every rank before anything changes
    if R > 1:
        _raises_everywhere(lambda: buf.set_config(ENTRIES, HIDDEN - (128 if last else 0), MAX_TOKENS, PER_TOKEN),
                           ValueError, "hidden", "set_config with ranks disagreeing")
    _raises_everywhere(lambda: buf.set_config(ENTRIES, HIDDEN, MAX_TOKENS, PER_TOKEN, torch.float32),
                       (TypeError, ValueError), "dtype", "set_config with a float32 dtype")
    _raises_everywhere(lambda: buf.set_config([n * 100 for n in ENTRIES], HIDDEN, MAX_TOKENS, PER_TOKEN),
                       ValueError, "num_rdma_storage_bytes", "set_config past the storage")
    _raises_everywhere(lambda: buf.set_config(ENTRIES, HIDDEN, MAX_TOKENS * 2, PER_TOKEN),
                       ValueError, "num_gpu_bytes", "set_config past the fetch buffer")
    bad = [s[:-1] if last else s for s in shards]
    _raises_everywhere(lambda: buf.write(bad), ValueError, "storages[0]", "write with a short shard on one rank")
    _raises_everywhere(lambda: buf.write([s.float() for s in shards]), ValueError, "bfloat16", "write float32")
    _raises_everywhere(lambda: buf.write(shards[:2]), ValueError, "3 tensors", "write with a layer missing")
    _raises_everywhere(lambda: buf.write(shards, [torch.zeros(R * n, PACKS) for n in ENTRIES]), ValueError,
                       "num_sf_packs=0", "write scales into a BF16 configuration")
    # FP8: scales missing on one rank, or a table of the wrong height
    coll(buf.set_config, ENTRIES, HIDDEN, MAX_TOKENS, PER_TOKEN, FP8, PACKS, what="set_config fp8")
    shards8, sfs8, _ = _tables(True, seed=64)
    if R > 1:
        _raises_everywhere(lambda: buf.write(shards8, None if last else sfs8), ValueError, "sfs given",
                           "write with scales on some ranks only")
        differ = [sf.clone() for sf in sfs8]
        differ[-1].view(-1)[-1] += 1 if last else 0  # one pack of the last layer differs on one rank
        _raises_everywhere(lambda: buf.write(shards8, differ), ValueError, "sfs (BLAKE2b digest)",
                           "write with scale tables that differ between ranks")
    short = [sf[:-1] if last else sf for sf in sfs8]
    _raises_everywhere(lambda: buf.write(shards8, short), ValueError, "sfs[0]", "write with a short scale table")
    _, exc = capture(lambda: buf.fetch(_indices(65, MAX_TOKENS, PER_TOKEN)))  # nothing written in this config
    all_ranks_ok(world(), isinstance(exc, RuntimeError) and "write" in str(exc), f"fetch before write: {exc!r}")
    coll(buf.set_config, ENTRIES, HIDDEN, MAX_TOKENS, PER_TOKEN, what="set_config bf16")
    coll(buf.write, shards, what="write again")
    # the tables are as written, nothing else got in
    ok = _check(buf, tables, None, _indices(61, MAX_TOKENS, PER_TOKEN), False, [0, 1, 2])
    all_ranks_ok(world(), ok, "tables intact after refused calls")
    # fetch is one-sided: the rank passing bad indices raises, naming what is wrong
    good = _indices(62, MAX_TOKENS, PER_TOKEN)
    out_of_range = good.clone()
    out_of_range[1, 3, 2] = R * ENTRIES[1]
    for bad_idx, kind, text in ((good.long(), ValueError, "int32"), (good[:2], ValueError, "3 layers"),
                                (good[:, :, :1].expand(-1, -1, 2), ValueError, "contiguous"),
                                (torch.cat([good, good], 1), ValueError, "num_max_tokens"),
                                (out_of_range, ValueError, "layer 1"), (-good - 1, ValueError, "layer 0")):
        _, exc = capture(lambda: buf.fetch(bad_idx))
        all_ranks_ok(world(), isinstance(exc, kind) and text in str(exc), f"fetch({text}): {exc!r}")
    _, exc = capture(lambda: buf.fetch(good, num_qps=buf.num_allocated_qps + 1))
    all_ranks_ok(world(), isinstance(exc, AssertionError), "num_qps above the allocated ones")
    ok = _check(buf, tables, None, _indices(63, MAX_TOKENS, PER_TOKEN), False, [2, 1, 0])
    all_ranks_ok(world(), ok, "usable after refused fetches")


def test_constructor_and_lifetime():
    R, rank = world().Get_size(), world().Get_rank()
    gpu, storage = _sizes(1)
    last = rank == R - 1
    _raises_everywhere(lambda: EngramBuffer(world(), gpu, storage, True, 0 if last else 4, 1024),
                       (AssertionError, ValueError), "get_theoretical_config", "num_allocated_qps=0 on one rank")
    if R > 1:
        _raises_everywhere(lambda: EngramBuffer(world(), gpu + (128 if last else 0), storage, True, 4, 1024),
                           ValueError, "num_gpu_bytes", "ranks disagreeing on num_gpu_bytes")
    _raises_everywhere(lambda: EngramBuffer(world(), -1, storage, True, 4, 1024), ValueError, "num_gpu_bytes",
                       "negative num_gpu_bytes")
    _raises_everywhere(lambda: EngramBuffer(world(), gpu, storage, True, 4, 1024, sl_idx="x" if last else None),
                       (TypeError, ValueError), "sl_idx", "a string sl_idx on one rank")
    # DeepEP's legacy keyword for the storage size
    buf = coll(lambda: EngramBuffer(world(), gpu, num_rdma_storage_size=storage, use_cpu_rdma_storage=True,
                                    num_allocated_qps=4, qp_depth=1024, explicitly_destroy=True), what="alias")
    ok = buf.num_rdma_storage_bytes == storage and buf.get_physical_domain_size()[0] * \
        buf.get_physical_domain_size()[1] == R
    buf.print_memory_usage()
    _, exc = capture(lambda: buf.fetch(_indices(70, 2, 2)))
    ok &= isinstance(exc, RuntimeError) and "write" in str(exc)  # nothing configured or written yet
    coll(buf.set_config, ENTRIES, HIDDEN, MAX_TOKENS, PER_TOKEN, what="set_config")
    shards, _, tables = _tables(False, seed=71)
    coll(buf.write, shards, what="write")
    indices = _indices(72, MAX_TOKENS, PER_TOKEN)
    for num_qps in ("2", -1):
        _, exc = capture(lambda: buf.fetch(indices, num_qps=num_qps))
        ok &= isinstance(exc, ValueError) and "num_qps" in str(exc)
    _, exc = capture(lambda: buf.barrier(context_idx=1))
    ok &= isinstance(exc, ValueError) and "context_idx" in str(exc)
    hooks = buf.fetch(indices)
    # DeepEP's barrier arguments (comm.barrier): accepted; it waits for this rank's fetches too
    coll(lambda: buf.barrier(wait_comm_stream=True, with_cpu_sync=True, sequential=False, context_idx=0),
         what="barrier")
    coll(buf.destroy, what="destroy")
    _, exc = capture(buf.get_traffic)
    ok &= isinstance(exc, RuntimeError) and "destroyed" in str(exc)
    data, _ = _expected(tables, None, indices, False)
    got = hooks[0]()  # fetched tensors outlive the buffer
    ok &= torch.equal(got.view(torch.uint8), data[0].view(MAX_TOKENS, -1))
    _, exc = capture(lambda: buf.fetch(indices))
    ok &= isinstance(exc, RuntimeError) and "destroyed" in str(exc)
    implicit = coll(lambda: EngramBuffer(world(), gpu, storage, True, 4, 1024), what="implicit")
    _, exc = capture(implicit.destroy)
    ok &= isinstance(exc, RuntimeError) and "explicitly_destroy" in str(exc)
    all_ranks_ok(world(), ok, "constructor alias, lifetime")
    coll(implicit.runtime.destroy, what="free the implicit buffer's transport")


def test_a_timeout_aborts_the_peers_and_destroy_still_works():
    """A barrier rank 0 enters alone times out (naming the others) and aborts them: their next call fails at once
    with the ``TransportPeerTimeout`` naming rank 0; rank 0's own fetch is refused (``TransportPoisoned``) instead
    of reading windows whose owners may have left; then ``destroy()`` works on every rank, twice."""
    import time

    from deepep_ascend.transports import TransportPeerTimeout, TransportPoisoned, TransportTimeout

    R, rank = world().Get_size(), world().Get_rank()
    if R == 1:
        pytest.skip("needs a peer that stays away")
    buf = _build(num_gpu_timeout_secs=1)
    coll(buf.set_config, ENTRIES, HIDDEN, MAX_TOKENS, PER_TOKEN, what="set_config")
    coll(buf.write, _tables(False, seed=81)[0], what="write")
    errors = []
    if rank == 0:
        _, exc = capture(buf.barrier)
        if not isinstance(exc, TransportTimeout) or "EngramBuffer.barrier" not in str(exc):
            errors.append(f"the lone barrier raised {exc!r}")
    world().Barrier()
    start = time.monotonic()
    if rank == 0:
        _, exc = capture(lambda: buf.fetch(_indices(82, 2, 2)))
        if not isinstance(exc, TransportPoisoned):
            errors.append(f"a fetch after the timeout raised {exc!r}")
    else:
        _, exc = capture(buf.barrier)
        if not isinstance(exc, TransportPeerTimeout) or exc.peer != 0:  # (its own timeout: a TransportTimeout)
            errors.append(f"a barrier after rank 0's timeout raised {exc!r} after {time.monotonic() - start:.1f} s")
    exc = None
    for attempt in range(2):
        _, exc = capture(buf.destroy)
        if exc is not None or buf.runtime is not None:
            errors.append(f"destroy() #{attempt + 1}: {exc!r}")
    all_ranks_ok(world(), not errors, f"rank {rank}: " + "; ".join(errors))
