"""put / get / put_with_signal: every byte lands where it should, and only there
(docs/design/transports.md §2.2, §3, §8).

All pairs (src, dst) including SELF are covered with ring rounds: in round ``k`` rank ``r``
writes to ``(r + k) % n`` and receives from ``(r - k) % n``, so a window needs room for one
incoming payload only.
"""

from __future__ import annotations

import pytest
import torch

from deepep_ascend.transports import ChannelKind
from tests.support.mpi_utils import up_to_four_ranks
from tests.transports.helpers import MIB, pattern, ramp

SIZES = [0, 1, 7, 4096, MIB, 8 * MIB]
GUARD = 64
SENTINEL = 0xA5


def _assert_bytes(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.numel() == want.numel(), f"{what}: {got.numel()} bytes, expected {want.numel()}"
    if not torch.equal(got, want):
        bad = (got != want).nonzero()
        i = int(bad[0])
        raise AssertionError(f"{what}: {bad.numel()} of {want.numel()} bytes differ; first at byte {i}: "
                             f"got {int(got[i])}, expected {int(want[i])}")


def _offset(src: int, k: int, si: int) -> int:
    """Unaligned offset (GUARD .. GUARD+60) used by ``src`` in round ``k`` for size index ``si``."""
    return GUARD + (src * 7 + k * 3 + si * 5) % 61


def _seed(src: int, k: int, si: int) -> int:
    return src * 1009 + k * 31 + si * 7 + 1


@pytest.mark.mpi(min_size=1)
def test_put_all_pairs_sizes_offsets(shared_tp):
    tp = shared_tp
    me, n = tp.topology.rank, tp.topology.world_size
    win = tp.create_window("put", 2 * GUARD + 64 + 8 * MIB, 1)
    for k in range(n):
        dst, src = (me + k) % n, (me - k) % n
        for si, size in enumerate(SIZES):
            off_in = _offset(src, k, si)
            region = tp.local_view(win, off_in - GUARD, size + 2 * GUARD)
            region.fill_(SENTINEL)
            del region
            tp.barrier()
            payload = pattern(size, _seed(me, k, si))
            tp.put(win, dst, _offset(me, k, si), payload)
            payload.fill_(0x5A)  # the source is reusable once put returns: nothing delivered changes
            tp.flush(dst)
            tp.barrier()
            got = tp.local_view(win, off_in - GUARD, size + 2 * GUARD)
            what = f"round {k}: {size} B from rank {src} at offset {off_in}"
            _assert_bytes(got[GUARD:GUARD + size], pattern(size, _seed(src, k, si)), what)
            assert bool((got[:GUARD] == SENTINEL).all()), f"{what}: bytes before the range were touched"
            assert bool((got[GUARD + size:] == SENTINEL).all()), f"{what}: bytes after the range were touched"
            del got


def _typed_sources(r: int):
    """Contiguous CPU tensors of several dtypes/shapes, deterministic in ``r``."""
    g = torch.Generator().manual_seed(1000 + r)
    big = torch.randint(0, 1 << 30, (64,), generator=g, dtype=torch.int64)
    return [
        torch.randn(3, 5, generator=g),                                   # 2-D float32
        torch.tensor(123456789 * (r + 1), dtype=torch.int64),              # 0-dim
        torch.randn(17, generator=g).to(torch.bfloat16),
        big[3:10],                                                         # contiguous, storage offset
        torch.rand(13, generator=g) > 0.5,                                  # bool
        torch.randn(6, generator=g).requires_grad_(),                       # leaf requiring grad
        torch.randint(-128, 127, (2, 3, 4), generator=g, dtype=torch.int8),
        torch.arange(4, dtype=torch.int32).add(r).view(1, 4)[:, 2],         # size 1, stride 4: contiguous
    ]


@pytest.mark.mpi(min_size=1)
def test_put_typed_sources(shared_tp):
    tp = shared_tp
    me, n = tp.topology.rank, tp.topology.world_size
    win = tp.create_window("typed", 4096, 1)
    dst, src = (me + 1) % n, (me - 1) % n
    off = 0
    for t in _typed_sources(me):
        tp.put(win, dst, off, t)
        off += 256
    tp.barrier()
    off = 0
    for i, t in enumerate(_typed_sources(src)):
        raw = torch.empty(t.shape, dtype=t.dtype).copy_(t.detach()).reshape(-1).view(torch.uint8)  # plain strides
        _assert_bytes(tp.local_view(win, off, raw.numel()), raw, f"typed source {i} ({t.dtype}) from rank {src}")
        off += 256


@pytest.mark.mpi(min_size=1)
def test_put_to_self_copies(shared_tp):
    tp = shared_tp
    me = tp.topology.rank
    win = tp.create_window("self", 8192, 1)
    src = pattern(4096, 77 + me)
    before = tp.stats.snapshot()
    tp.put(win, me, 100, src)
    view = tp.local_view(win, 100, 4096)
    assert view.data_ptr() != src.data_ptr()
    _assert_bytes(view, pattern(4096, 77 + me), "put to self")
    src.fill_(0)  # a copy, not an alias
    _assert_bytes(view, pattern(4096, 77 + me), "put to self after the source changed")
    after = tp.stats.snapshot()
    assert after["bytes_put"][ChannelKind.SELF, me] - before["bytes_put"][ChannelKind.SELF, me] == 4096
    assert after["bytes_put"][ChannelKind.UBMEM].sum() == before["bytes_put"][ChannelKind.UBMEM].sum()


@pytest.mark.mpi(min_size=1)
def test_get_sees_peer_data(shared_tp):
    tp = shared_tp
    me, n = tp.topology.rank, tp.topology.world_size
    span = MIB + 4096
    win = tp.create_window("get", span, 1)
    own = tp.local_view(win, 0, span)
    own.copy_(pattern(span, me * 13 + 1))
    del own
    tp.barrier()
    for p in range(n):
        full = pattern(span, p * 13 + 1)
        for size, off in [(0, 0), (1, 5), (7, span - 7), (4096, 123), (MIB, 4096)]:
            out = torch.full((size,), 0xEE, dtype=torch.uint8)
            tp.get(win, p, off, out)
            _assert_bytes(out, full[off:off + size], f"get {size} B at {off} from rank {p}")
        typed = torch.empty(4, 8, dtype=torch.int16)  # 64 bytes, 2-D out
        tp.get(win, p, 64, typed)
        _assert_bytes(typed.reshape(-1).view(torch.uint8), full[64:128], f"typed get from rank {p}")
    tp.barrier()
    # Released by an ordered signal instead of a barrier.
    own = tp.local_view(win, 0, 4096)
    own.copy_(pattern(4096, me * 13 + 2))
    del own
    for p in range(n):
        tp.signal(win, p, 0)
    tp.wait_until(win, 0, list(range(n)), 1)
    for p in range(n):
        out = torch.empty(4096, dtype=torch.uint8)
        tp.get(win, p, 0, out)
        _assert_bytes(out, pattern(4096, p * 13 + 2), f"get after signal from rank {p}")
    tp.barrier()


ROUNDS = 200
PAYLOAD = 4 * MIB + 3  # large enough for streaming (non-temporal) stores in the copy
HEADER = 7


@pytest.mark.mpi(min_size=1)
@up_to_four_ranks()
def test_put_with_signal_rounds(shared_tp):
    """Ring, 200 rounds, double-buffered with a 'consumed' ack: the receiver checks every payload byte.

    The payload of round ``i`` from rank ``s`` is the ramp shifted by ``(s * 7919 + i) % 251``, so a
    stale buffer (round ``i - 2``) or a torn copy does not match. Each round also puts a small
    header first: an observer of the signal must see it too (earlier puts to the same dst are
    released). Every 4th round uses put + ordered signal instead of put_with_signal.
    """
    tp = shared_tp
    me, n = tp.topology.rank, tp.topology.world_size
    dst, src = (me + 1) % n, (me - 1) % n
    stride = PAYLOAD + 61
    hdr_base = 2 * stride
    win = tp.create_window("pws", hdr_base + 2 * 64, 2)
    DATA, ACK = 0, 1
    for i in range(1, ROUNDS + 1):
        b = i % 2
        # -- send round i to dst into buffer b, once dst consumed round i-2 (same buffer)
        if i > 2:
            tp.wait_until(win, ACK, [dst], i - 2, phase=f"ack {i - 2}")
        tp.put(win, dst, hdr_base + b * 64, pattern(HEADER, me * 7919 + i + 5))
        payload = ramp(PAYLOAD, me * 7919 + i)
        if i % 4 == 3:
            tp.put(win, dst, b * stride, payload)
            value = tp.signal(win, dst, DATA)
        else:
            value = tp.put_with_signal(win, dst, b * stride, payload, DATA)
        assert value == i
        # -- receive round i from src
        tp.wait_until(win, DATA, [src], i, phase=f"data {i}")
        _assert_bytes(tp.local_view(win, hdr_base + b * 64, HEADER), pattern(HEADER, src * 7919 + i + 5),
                      f"round {i}: header from rank {src}")
        _assert_bytes(tp.local_view(win, b * stride, PAYLOAD), ramp(PAYLOAD, src * 7919 + i),
                      f"round {i}: payload from rank {src}")
        tp.signal(win, src, ACK)
    assert tp.read_signal(win, DATA, src) == ROUNDS
    tp.barrier()
