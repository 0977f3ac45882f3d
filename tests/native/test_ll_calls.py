"""The low-latency calls' native steps (``native.ll_*``, ``csrc/ll_calls.c``) against the torch path of
``deepep_ascend.ep.low_latency`` and per-row Python references, byte for byte: routes with repeats, -1 and
empty inputs; messages and rows written into plain tensors standing for two ranks' windows; masks; special
values in the weighted sum; strided and bad operands refused before anything is written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import types

import numpy as np
import pytest
import torch

from deepep_ascend import native
from deepep_ascend.ep.low_latency import LowLatencyEngine
from tests.support.buffer_helpers import same_bits_nan
from tests.support.rows import BF16
from tests.support.rows import random_rows as _rows

pytestmark = pytest.mark.skipif(not native.ll_available(), reason="native kernels not built")


def _torch_route(topk_idx, num_local, num_experts):
    """The torch path's route (``LowLatencyEngine._route``, no rank masked)."""
    stand_in = types.SimpleNamespace(masked=lambda: [False], mask=torch.zeros(1, dtype=torch.int32))
    return LowLatencyEngine._route(stand_in, topk_idx, num_local, num_experts)


@pytest.mark.parametrize("n, k, E, m", [(7, 4, 16, 8), (1, 8, 256, 1), (0, 8, 16, 4), (12, 1, 6, 12)])
def test_route_matches_the_torch_route(n, k, E, m):
    g = torch.Generator().manual_seed(n * 100 + k)
    idx = torch.randint(-1, E, (n, k), generator=g)
    if n > 2 and k > 1:
        idx[1, 1] = idx[1, 0]  # an expert twice in one row: two pairs
    status, (lo, hi, most, arg), counts, slots = native.ll_route(idx, E, m)
    per_expert = torch.bincount(idx.view(-1) + 1, minlength=E + 1)[1:]
    assert (lo, hi) == ((int(idx.min()), int(idx.max())) if idx.numel() else (0, 0))
    assert most == int(per_expert.max()) and (most == 0 or arg == int(per_expert.argmax()))
    if most > m:
        assert status == 2
        return
    assert status == 0
    route = _torch_route(idx, max(E // 2, 1), E)
    assert torch.equal(counts, route.counts32)
    want = torch.full((n * k,), -1, dtype=torch.int64)
    want[route.flat] = route.experts * m + route.rank
    assert torch.equal(slots.view(-1), want)


def test_route_statuses():
    idx = torch.tensor([[0, 3], [3, 1]])
    status, stats, _, _ = native.ll_route(idx, 3, 4)  # 3 is out of [-1, 3)
    assert status == 1 and stats[:2] == [0, 3]
    status, stats, _, _ = native.ll_route(torch.tensor([[-2, 0]]), 4, 4)
    assert status == 1 and stats[:2] == [-2, 0]
    status, stats, counts, _ = native.ll_route(torch.tensor([[2, 2, 1], [1, 2, 1]]), 4, 2)  # 1 and 2: 3 times each
    assert status == 2 and stats[2:] == [3, 1] and counts.tolist() == [0, 3, 3, 0]
    with pytest.raises(ValueError, match="topk_idx must be a contiguous"):
        native.ll_route(torch.zeros(4, 2, dtype=torch.int64).t(), 4, 2)
    with pytest.raises(ValueError, match="topk_idx must be a contiguous"):
        native.ll_route(torch.zeros(2, 2, dtype=torch.int32), 4, 2)
    with pytest.raises(ValueError, match="m must be a positive int"):
        native.ll_route(torch.zeros(2, 2, dtype=torch.int64), 4, 0)


def _windows(R, nbytes, fill=0xA5):
    """One plain uint8 tensor per rank standing for its window, and their addresses."""
    wins = [torch.full((nbytes,), fill, dtype=torch.uint8) for _ in range(R)]
    return wins, torch.tensor([w.data_ptr() for w in wins], dtype=torch.int64)


def _random_route(seed, n, k, E, m):
    """A random ``topk_idx`` ``[n, k]`` over ``E`` experts (-1 included) and its route: ``(generator, topk_idx,
    counts, slots)`` (:func:`deepep_ascend.native.ll_route`, no expert above ``m`` rows)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(-1, E, (n, k), generator=g)
    status, _, counts, slots = native.ll_route(idx, E, m)
    assert status == 0
    return g, idx, counts, slots


@pytest.mark.parametrize("masked", [False, True])
def test_dispatch_send_writes_each_routed_token_into_its_slot(masked):
    R, L, m, n, k, me = 2, 3, 8, 5, 3, 1
    E = R * L
    g, idx, counts, slots = _random_route(3, n, k, E, m)
    index_off, counts_off = 64, 8
    wins, bases = _windows(R, index_off + L * R * m * 4)
    mask = torch.tensor([1, 0], dtype=torch.int32) if masked else None
    want = [w.clone() for w in wins]
    route = _torch_route(idx, L, E)
    for p in range(len(route.flat)):  # the torch path's slot of each pair, one at a time
        e, r, t = int(route.experts[p]), int(route.rank[p]), int(route.tokens[p])
        d = e // L
        if masked and d == 0:
            continue
        at = index_off + (((e % L) * R + me) * m + r) * 4
        want[d][at:at + 4] = torch.tensor([t], dtype=torch.int32).view(torch.uint8)
    for d in range(R):
        if not (masked and d == 0):
            want[d][counts_off:counts_off + 4 * L] = counts[d * L:(d + 1) * L].view(torch.uint8)
    sent = torch.zeros(R, dtype=torch.int64)
    assert native.ll_dispatch_send(slots, m, L, me, bases, mask, index_off, counts_off, counts, sent)
    for d in range(R):
        assert torch.equal(wins[d], want[d])
    per_rank = [int((route.experts // L == d).sum()) for d in range(R)]
    assert sent.tolist() == [0 if masked and d == 0 else per_rank[d] for d in range(R)]
    bad = slots.clone()
    bad[0, 0] = E * m
    before = [w.clone() for w in wins]
    with pytest.raises(ValueError, match="slots must lie in"):
        native.ll_dispatch_send(bad, m, L, me, bases, mask, index_off, counts_off, counts, sent)
    assert all(torch.equal(a, b) for a, b in zip(wins, before))
    with pytest.raises(ValueError, match="slots must be a contiguous"):
        native.ll_dispatch_send(slots.t(), m, L, me, bases, mask, index_off, counts_off, counts, sent)


def _pull_setup(R, L, m, k, mb, g, repeated=False):
    """R sources' windows ``[counts R·L·4 | index L·R·m·4 | send m·mb]``, each source's route and counts sent
    to every rank by :func:`native.ll_dispatch_send`, its messages (random bytes) in its send region; plus the
    sources' stamp words (reading 7). Returns (wins, bases, stamps, send_off, routes, messages)."""
    E, index_off = R * L, 4 * R * L
    send_off = index_off + L * R * m * 4
    wins, bases = _windows(R, send_off + m * mb)
    stamps = torch.full((R,), 7, dtype=torch.int64)
    routes, messages = [], []
    for s in range(R):
        # each source its own token count, 0 included (repeated: below m, so that no expert passes m slots)
        n = int(torch.randint(0, m + (0 if repeated else 1), (), generator=g))
        idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(n)]) if n else torch.zeros(0, k,
                                                                                                       dtype=torch.int64)
        idx[torch.rand(idx.shape, generator=g) < 0.2] = -1
        if repeated and n:  # a row naming one expert in two slots: two of its rows from one message
            idx[0, 1] = idx[0, 0]
        status, _, counts, slots = native.ll_route(idx, E, m)
        assert status == 0
        assert native.ll_dispatch_send(slots, m, L, s, bases, None, index_off, 4 * s * L, counts,
                                       torch.zeros(R, dtype=torch.int64))
        msgs = torch.randint(0, 256, (n, mb), generator=g, dtype=torch.uint8)
        wins[s][send_off:send_off + n * mb] = msgs.view(-1)
        routes.append(_torch_route(idx, L, E))
        messages.append(msgs)
    addrs = torch.tensor([stamps.data_ptr() + 8 * s for s in range(R)], dtype=torch.int64)
    return wins, bases, stamps, addrs, send_off, routes, messages


@pytest.mark.parametrize("scale_words", [0, 2])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("reused", [False, True])
@pytest.mark.parametrize("repeated", [False, True])
def test_dispatch_recv_loads_the_torch_paths_rows(scale_words, masked, reused, repeated):
    """Every source's route sent by the native send, then the receive loads each row from its source's send
    region: the rows of the torch path (by source, then the source's route order), byte for byte; a token
    routed to several local experts (or to one expert twice) lands in each of its rows."""
    R, L, m, k, xb, me = 3, 2, 4, 3, 16, 1
    mb = 16 + xb + 4 * scale_words
    g = torch.Generator().manual_seed(5 + scale_words + 10 * masked + 100 * reused + 1 * repeated)
    wins, bases, stamp_words, stamps, send_off, routes, messages = _pull_setup(R, L, m, k, mb, g, repeated)
    sig = wins[me][:4 * R * L].view(torch.int32).view(R, L)
    index = wins[me][4 * R * L:send_off].view(torch.int32)
    mask = torch.tensor([0, 0, 1], dtype=torch.int32) if masked else None
    recv_x = torch.zeros(L, R * m, xb, dtype=torch.uint8)
    src_info = torch.zeros(L, R * m, dtype=torch.int32)
    scales = torch.zeros(L, scale_words, R * m, dtype=torch.float32).transpose(1, 2) if scale_words else None
    stale = (None, None, None)
    if reused:  # an earlier call's rows [0, old[e]) left in every output: those not written now must read 0
        old = torch.tensor([R * m, 1], dtype=torch.int32)
        for t in (recv_x, src_info) + ((scales,) if scale_words else ()):
            for e in range(L):
                t[e, :int(old[e])] = 77
        stale = (old, old if scale_words else None, old)
    recv_count, layout_range = torch.zeros(L, dtype=torch.int32), torch.zeros(L, R, dtype=torch.int64)
    args = (sig, mask, index, bases, send_off, stamps, 7, m, mb, recv_x, scales, src_info, recv_count, layout_range)
    assert native.ll_dispatch_recv(*args, stale) == (0, [0, 0, 0])
    for e in range(L):  # the definition: expert e's rows by source, then the source's route order, from row 0
        begin = 0
        for s in range(R):
            r = routes[s]
            tokens = [] if masked and s == 2 else r.tokens[r.experts == me * L + e].tolist()
            assert int(layout_range[e, s]) == (begin << 32) | len(tokens)
            for i, t in enumerate(tokens):
                q, msg = begin + i, messages[s][t]
                assert torch.equal(recv_x[e, q], msg[16:16 + xb]) and int(src_info[e, q]) == t
                if scale_words:
                    assert torch.equal(scales[e, q].contiguous().view(torch.uint8), msg[16 + xb:mb])
            begin += len(tokens)
        assert int(recv_count[e]) == begin
        assert not recv_x[e, begin:].any() and not src_info[e, begin:].any()
        assert not scale_words or not scales[e, begin:].any()
    assert int(recv_count.sum()) > 0  # the seed routes rows here
    # A source restamped (a later call began rewriting its send region): status 3 names it and its stamp.
    stamp_words[0] = 9
    assert native.ll_dispatch_recv(*args) == (3, [0, 9, 0])
    stamp_words[0] = 7
    # Refused before anything is written: a count over M, a token index outside [0, M), an unmapped source.
    before = recv_x.clone()
    over = sig.clone()
    over[0, 1] = m + 1
    assert native.ll_dispatch_recv(over, *args[1:])[0] == 1
    e, s = next((e, s) for s in range(2) for e in range(L) if int(sig[s, e]))
    saved = int(index[(e * R + s) * m])
    index[(e * R + s) * m] = m
    assert native.ll_dispatch_recv(*args) == (4, [s, e, 0])
    index[(e * R + s) * m] = saved
    unmapped = bases.clone()
    unmapped[s] = 0
    assert native.ll_dispatch_recv(sig, mask, index, unmapped, *args[4:]) == (4, [s, e, -1])
    assert torch.equal(recv_x, before)
    with pytest.raises(ValueError, match=r"stale counts must lie in \[0, 12\]"):
        native.ll_dispatch_recv(*args, (None, None, torch.tensor([0, R * m + 1], dtype=torch.int32)))
    assert torch.equal(recv_x, before)
    with pytest.raises(ValueError, match="scales must be a channels-first"):
        native.ll_dispatch_recv(*args[:10], torch.zeros(L, R * m, 2), *args[11:])
    with pytest.raises(ValueError, match="sig must be a contiguous"):
        native.ll_dispatch_recv(sig.t(), *args[1:])
    with pytest.raises(ValueError, match="index must be a contiguous"):
        native.ll_dispatch_recv(sig, mask, index[:-1], *args[3:])


@pytest.fixture
def stream_mode():
    """Restores :func:`native.ll_stream_rows`' modes and thresholds (both sides) after a test that sets them."""
    before = {side: (native.ll_stream_rows(side=side), native.ll_stream_min_bytes(side=side))
              for side in native.LL_STREAM_SIDES}
    yield
    for side, (mode, min_bytes) in before.items():
        native.ll_stream_rows(mode, min_bytes, side=side)


@pytest.mark.parametrize("xb, offset", [(16, 0), (1000, 0), (1000, 3), (4104, 8), (256, 1)])
def test_dispatch_recv_streaming_stores_write_the_same_bytes(xb, offset, stream_mode):
    """The receive with every row stored by streaming stores against the same receive by memcpy, byte for byte:
    row sizes below the streaming threshold (16), with a 16-byte misaligned head and an 8-byte tail (1000: rows
    q·1000 alternate between aligned and not), whole lines plus a tail (4104), and recv_x starting off any
    alignment (offset); stale rows of a reused output zeroed either way. "large" streams when the call's rows take
    at least its threshold: here a few KB, so it is tried with the threshold at their size (streams) and one byte
    above (copies as "never" does)."""
    R, L, m, k, me, sw = 3, 2, 6, 3, 1, 2
    mb = 16 + xb + 4 * sw
    g = torch.Generator().manual_seed(xb + offset)
    wins, bases, stamp_words, stamps, send_off, _, _ = _pull_setup(R, L, m, k, mb, g)  # (the words kept alive)
    sig = wins[me][:4 * R * L].view(torch.int32).view(R, L)
    index = wins[me][4 * R * L:send_off].view(torch.int32)
    assert int(sig.sum()) > 0

    def receive(mode, min_bytes=None):
        assert native.ll_stream_rows(mode, min_bytes) == mode
        recv_x = torch.full((L * R * m * xb + offset,), 77, dtype=torch.uint8)[offset:].view(L, R * m, xb)
        scales = torch.full((L, sw, R * m), 77.0).transpose(1, 2)
        src_info = torch.full((L, R * m), 77, dtype=torch.int32)
        out = (recv_x, scales, src_info, torch.zeros(L, dtype=torch.int32), torch.zeros(L, R, dtype=torch.int64))
        stale = torch.full((L,), R * m, dtype=torch.int32)
        assert native.ll_dispatch_recv(sig, None, index, bases, send_off, stamps, 7, m, mb, *out,
                                       (stale, stale, stale)) == (0, [0, 0, 0])
        return out

    plain = receive("never")
    rows_bytes = int(plain[3].sum()) * xb
    for mode, min_bytes in (("always", None), ("large", rows_bytes), ("large", rows_bytes + 1), ("large", 0)):
        for a, b in zip(receive(mode, min_bytes), plain):
            assert torch.equal(a, b), (mode, min_bytes)
    assert plain[0].any()  # rows were loaded, and the stale ones zeroed
    assert not plain[0][0, int(plain[3][0]):].any()


def test_stream_mode_and_threshold_are_set_read_and_checked(stream_mode):
    """:func:`native.ll_stream_rows` sets the mode and the threshold each alone, :func:`native.ll_stream_min_bytes`
    reads the threshold, :func:`native.ll_streams` gives the receive's decision under them ("large": from the
    threshold on), and bad values are refused with nothing set."""
    assert native.ll_stream_rows("always", 12345) == "always"
    assert native.ll_stream_min_bytes() == 12345
    assert [native.ll_streams(n) for n in (0, 12344, 12345)] == [True, True, True]
    assert native.ll_stream_rows("large") == "large" and native.ll_stream_min_bytes() == 12345
    assert [native.ll_streams(n) for n in (0, 12344, 12345, 1 << 40)] == [False, False, True, True]
    assert native.ll_stream_rows("never") == "never" and native.ll_stream_min_bytes() == 12345
    assert [native.ll_streams(n) for n in (0, 12345, 1 << 40)] == [False, False, False]
    assert native.ll_stream_rows(None, 0) == "never" and native.ll_stream_min_bytes() == 0
    assert native.ll_stream_rows() == "never"
    with pytest.raises(ValueError, match="mode must be one of never, large, always or None, got 'on'"):
        native.ll_stream_rows("on", 7)
    for bad in (-1, 1.5, True, "16", 1 << 63):
        with pytest.raises(ValueError, match=re.escape(f"min_bytes must be an int in [0, 2**63) or None, got {bad!r}")):
            native.ll_stream_rows("large", bad)
    assert native.ll_stream_rows() == "never" and native.ll_stream_min_bytes() == 0
    assert native.ll_stream_rows("never", np.int64(7)) == "never" and native.ll_stream_min_bytes() == 7
    assert native.ll_stream_rows("large", (1 << 63) - 1) == "large" and native.ll_stream_min_bytes() == (1 << 63) - 1
    assert not native.ll_streams(np.int64(1 << 62)) and native.ll_streams((1 << 63) - 1)
    for bad in (-1, 1.5, True, "17", None, 1 << 63):
        with pytest.raises(ValueError, match=re.escape(f"rows_bytes must be an int in [0, 2**63), got {bad!r}")):
            native.ll_streams(bad)
    native.ll_stream_rows("never", 0)
    assert native.ll_stream_rows() == "never" and native.ll_stream_min_bytes() == 0


def test_stream_sides_are_set_apart(stream_mode):
    """The send side (a combine's returned rows) has its own mode and threshold: setting one side leaves the other,
    each side's decision reads its own; a side other than the two is refused with nothing set."""
    assert native.LL_STREAM_SIDES == ("receive", "send")
    assert native.ll_stream_rows("never", 100) == "never"
    assert native.ll_stream_rows("large", 200, side="send") == "large"
    assert (native.ll_stream_rows(), native.ll_stream_min_bytes()) == ("never", 100)
    assert (native.ll_stream_rows(side="send"), native.ll_stream_min_bytes(side="send")) == ("large", 200)
    assert [native.ll_streams(n, side="send") for n in (199, 200)] == [False, True]
    assert [native.ll_streams(n) for n in (199, 200)] == [False, False]
    assert native.ll_stream_rows("always", side="send") == "always" and native.ll_streams(0, side="send")
    assert native.ll_stream_rows() == "never" and native.ll_stream_min_bytes(side="send") == 200
    for fn, args in ((native.ll_stream_rows, ("always", 5)), (native.ll_stream_min_bytes, ()),
                     (native.ll_streams, (5,))):
        with pytest.raises(ValueError, match="side must be one of receive, send, got 'recv'"):
            fn(*args, side="recv")
    assert (native.ll_stream_rows(), native.ll_stream_min_bytes()) == ("never", 100)


@pytest.mark.parametrize("H, recv_off", [(8, 32), (500, 32), (500, 40), (2052, 8), (128, 33)])
def test_combine_send_streaming_stores_write_the_same_bytes(H, recv_off, stream_mode):
    """The combine's sends with every row stored by streaming stores against the same sends by memcpy, byte for
    byte, counts and ``sent`` included: rows below the streaming threshold (16 bytes), rows of 1000 bytes starting
    16-byte aligned and not (slot rows alternate), whole lines plus a tail (4104), and a window offset off any
    alignment (33), with strided source rows, each of ``keep`` ``"none"`` / ``"own"``. "large" streams when the rows
    the call copies take at least the send side's threshold: tried at their size (streams) and one byte above."""
    R, L, m, me = 3, 2, 5, 1
    g = torch.Generator().manual_seed(H + recv_off)
    cnt = torch.randint(0, m + 1, (L, R), generator=g)
    cnt[0, 0] = m  # a full slot
    begin = torch.cumsum(cnt, 1) - cnt
    layout_range = (begin << 32) | cnt
    src = _rows(g, L * R * m, H + 5).view(L, R * m, H + 5)[:, :, 3:3 + H]  # strided rows, 6-byte offset
    nbytes = recv_off + R * L * m * 2 * H
    for keep in ("none", "own"):
        copied = int(cnt.sum()) - (int(cnt[:, me].sum()) if keep == "own" else 0)

        def send(mode, min_bytes=None):
            assert native.ll_stream_rows(mode, min_bytes, side="send") == mode
            wins, bases = _windows(R, nbytes)
            sent = torch.full((R,), -1, dtype=torch.int64)
            assert native.ll_combine_send(layout_range, src, m, me, bases, None, recv_off, 4, sent, keep=keep)
            return wins + [sent]

        plain = send("never")
        assert any(not torch.equal(w, torch.full_like(w, 0xA5)) for w in plain[:R])
        for mode, min_bytes in (("always", None), ("large", copied * 2 * H), ("large", copied * 2 * H + 1)):
            got = send(mode, min_bytes)
            assert all(torch.equal(a, b) for a, b in zip(got, plain)), (keep, mode, min_bytes)
        assert native.ll_streams(copied * 2 * H, side="send") is False  # (the last "large": one byte short)


def test_stream_mode_and_threshold_come_from_the_settings(stream_mode, monkeypatch):
    """The library loads with the mode and threshold of ``DEEPEP_ASCEND_LL_STREAM_ROWS`` and
    ``DEEPEP_ASCEND_LL_STREAM_MIN_BYTES`` ("large" from 16 MiB when unset); a bad value is refused naming the
    variable (at import, as every setting)."""
    from deepep_ascend import settings
    from deepep_ascend.native import ll

    names = ("DEEPEP_ASCEND_LL_STREAM_ROWS", "DEEPEP_ASCEND_LL_STREAM_MIN_BYTES")
    base = {k: v for k, v in os.environ.items() if k not in names}
    code = "from deepep_ascend import native; print(native.ll_stream_rows(), native.ll_stream_min_bytes())"
    env = dict(base, DEEPEP_ASCEND_LL_STREAM_ROWS="always", DEEPEP_ASCEND_LL_STREAM_MIN_BYTES="4096")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.split("\n")[-2] == "always 4096"
    for name in names:
        monkeypatch.delenv(name, raising=False)
    native.ll_stream_rows("never", 1)
    ll._stream_from_settings()
    assert (native.ll_stream_rows(), native.ll_stream_min_bytes()) == ("large", 16 << 20)
    assert not native.ll_streams((16 << 20) - 1) and native.ll_streams(16 << 20)
    monkeypatch.setenv("DEEPEP_ASCEND_LL_STREAM_MIN_BYTES", "-5")
    with pytest.raises(settings.SettingError, match=r"\$DEEPEP_ASCEND_LL_STREAM_MIN_BYTES must be an integer >= 0 and "
                                                    r"below 9223372036854775808, got '-5'"):
        ll._stream_from_settings()
    monkeypatch.setenv("DEEPEP_ASCEND_LL_STREAM_MIN_BYTES", str(1 << 63))
    with pytest.raises(settings.SettingError, match=r"\$DEEPEP_ASCEND_LL_STREAM_MIN_BYTES must be an integer >= 0 and "
                                                    r"below 9223372036854775808, got '9223372036854775808'"):
        ll._stream_from_settings()
    assert (native.ll_stream_rows(), native.ll_stream_min_bytes()) == ("large", 16 << 20)


def test_send_stream_mode_and_threshold_come_from_the_settings(stream_mode, monkeypatch):
    """The send side's mode and threshold from ``DEEPEP_ASCEND_LL_STREAM_SENDS`` and
    ``DEEPEP_ASCEND_LL_STREAM_SEND_MIN_BYTES`` ("large" from 2 MiB when unset), the receive side's left to its own
    variables; a bad value is refused naming the variable."""
    from deepep_ascend import settings
    from deepep_ascend.native import ll

    names = ("DEEPEP_ASCEND_LL_STREAM_ROWS", "DEEPEP_ASCEND_LL_STREAM_MIN_BYTES", "DEEPEP_ASCEND_LL_STREAM_SENDS",
             "DEEPEP_ASCEND_LL_STREAM_SEND_MIN_BYTES")
    base = {k: v for k, v in os.environ.items() if k not in names}
    code = ("from deepep_ascend import native; print(native.ll_stream_rows(side='send'), "
            "native.ll_stream_min_bytes(side='send'), native.ll_stream_rows(), native.ll_stream_min_bytes())")
    env = dict(base, DEEPEP_ASCEND_LL_STREAM_SENDS="never", DEEPEP_ASCEND_LL_STREAM_SEND_MIN_BYTES="512")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.split("\n")[-2] == f"never 512 large {16 << 20}"
    for name in names:
        monkeypatch.delenv(name, raising=False)
    native.ll_stream_rows("always", 1, side="send")
    ll._stream_from_settings()
    assert (native.ll_stream_rows(side="send"), native.ll_stream_min_bytes(side="send")) == ("large", 2 << 20)
    assert not native.ll_streams((2 << 20) - 1, side="send") and native.ll_streams(2 << 20, side="send")
    monkeypatch.setenv("DEEPEP_ASCEND_LL_STREAM_SENDS", "sometimes")
    with pytest.raises(settings.SettingError, match=r"\$DEEPEP_ASCEND_LL_STREAM_SENDS"):
        ll._stream_from_settings()


@pytest.mark.parametrize("masked", [False, True])
def test_combine_send_stores_each_run_in_its_slot(masked):
    R, L, m, H, me = 2, 3, 4, 8, 0
    g = torch.Generator().manual_seed(9)
    cnt = torch.randint(0, m + 1, (L, R), generator=g)
    begin = torch.cumsum(cnt, 1) - cnt
    layout_range = (begin << 32) | cnt
    full = _rows(g, L * R * m, 2 * H).view(L, R * m, 2 * H)
    src = full[:, :, 3:3 + H]  # strided rows
    recv_off, counts_off = 32, 4
    wins, bases = _windows(R, recv_off + R * L * m * 2 * H)
    want = [w.clone() for w in wins]
    mask = torch.tensor([0, 1], dtype=torch.int32) if masked else None
    for d in range(R):
        if masked and d == 1:
            continue
        slots = want[d][recv_off:].view(BF16).view(R * L, m, H)
        for e in range(L):
            c, b = int(cnt[e, d]), int(begin[e, d])
            slots[me * L + e, :c] = src[e, b:b + c]
        want[d][counts_off:counts_off + 4 * L] = cnt[:, d].to(torch.int32).view(torch.uint8)
    sent = torch.zeros(R, dtype=torch.int64)
    assert native.ll_combine_send(layout_range, src, m, me, bases, mask, recv_off, counts_off, sent)
    for d in range(R):
        assert torch.equal(wins[d], want[d])
    assert sent.tolist() == [0 if masked and d == 1 else int(cnt[:, d].sum()) for d in range(R)]
    before = [w.clone() for w in wins]
    bad = layout_range.clone()
    bad[1, 0] = ((R * m - 1) << 32) | 2  # a run past R·M
    with pytest.raises(ValueError, match="a run outside"):
        native.ll_combine_send(bad, src, m, me, bases, mask, recv_off, counts_off, sent)
    assert all(torch.equal(a, b) for a, b in zip(wins, before))
    with pytest.raises(ValueError, match="unit last stride"):
        native.ll_combine_send(layout_range, full.transpose(1, 2)[:, :R * m], m, me, bases, mask, recv_off,
                               counts_off, sent)
    # keep="own": this rank's own rows stay in src; its counts are still written, the other ranks' rows too.
    for w in wins:
        w.fill_(0xAB)
    assert native.ll_combine_send(layout_range, src, m, me, bases, mask, recv_off, counts_off, sent)
    want = [w.clone() for w in wins]
    want[me][recv_off:].view(BF16).view(R * L, m, H)[me * L:(me + 1) * L].view(torch.uint8).fill_(0xAB)
    for w in wins:
        w.fill_(0xAB)
    assert native.ll_combine_send(layout_range, src, m, me, bases, mask, recv_off, counts_off, sent, keep="own")
    assert all(torch.equal(a, b) for a, b in zip(wins, want))
    assert sent[me] == 0
    # keep="all" (a zero-copy combine): every row stays in src, the counts are written, sent[d] = the rows d reads.
    for w in wins:
        w.fill_(0xAB)
    want = [w.clone() for w in wins]
    for d in range(R):
        if not (masked and d == 1):
            want[d][counts_off:counts_off + 4 * L] = cnt[:, d].to(torch.int32).view(torch.uint8)
    assert native.ll_combine_send(layout_range, src, m, me, bases, mask, recv_off, counts_off, sent, keep="all")
    assert all(torch.equal(a, b) for a, b in zip(wins, want))
    assert sent.tolist() == [0 if d == me or (masked and d == 1) else int(cnt[:, d].sum()) for d in range(R)]
    before = [w.clone() for w in wins]
    with pytest.raises(ValueError, match="keep must be one of"):
        native.ll_combine_send(layout_range, src, m, me, bases, mask, recv_off, counts_off, sent, keep=True)
    assert all(torch.equal(a, b) for a, b in zip(wins, before))


@pytest.mark.parametrize("H", [40, 200])  # below and across the AVX2 loop's 64 columns
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.usefixtures("row_sum_loop")
def test_combine_recv_is_the_torch_paths_weighted_sum(masked, H):
    R, L, m, n, k = 2, 4, 6, 6, 4
    E = R * L
    g, idx, counts, slots = _random_route(11, n, k, E, m)
    rows = _rows(g, E * m, H)
    w = torch.randn(n, k, generator=g)
    w[0, 0] = float("inf")
    mask = torch.tensor([0, 1], dtype=torch.int32) if masked else None
    got = torch.full((n, H), 7.0, dtype=BF16)
    sig = counts.view(R, L).clone()
    if masked:
        sig[1] = 99  # a masked source's words are not read
    assert native.ll_combine_recv(got, rows, slots, w, sig, counts, mask, m) == ()
    acc = torch.zeros(n, H)
    for j in range(k):  # the torch path: slots in order, float32 products, one accumulator, one rounding
        for t in range(n):
            s = int(slots[t, j])
            if s >= 0 and not (masked and s // m // L == 1):
                acc[t] += rows[s].float() * w[t, j]
    assert same_bits_nan(got, acc.to(BF16))
    if not masked:
        assert native.weighted_sum_rows(want := torch.empty(n, H, dtype=BF16), rows, slots, w)
        assert same_bits_nan(got, want)
    wrong = sig.clone()
    wrong[0, 2] += 1
    before = got.clone()
    assert native.ll_combine_recv(got, rows, slots, w, wrong, counts, mask, m) == (2, int(wrong[0, 2]),
                                                                                    int(counts[2]))
    assert torch.equal(got.view(torch.int16), before.view(torch.int16))
    with pytest.raises(ValueError, match="weights must be a contiguous"):
        native.ll_combine_recv(got, rows, slots, w.t().contiguous().t(), sig, counts, mask, m)
    far = slots.clone()
    far[n - 1, k - 1] = E * m
    with pytest.raises(ValueError, match="slots must lie in"):
        native.ll_combine_recv(got, rows, far, w, sig, counts, mask, m)
    assert torch.equal(got.view(torch.int16), before.view(torch.int16))

    # sources: some ranks' rows read where they lie (an [L, R·m, H] tensor, strided, rows placed by its begins;
    # a rank's own expert outputs, a zero-copy source's send region) instead of from rows: the same bits.
    live = [d for d in range(R) if not (masked and d == 1)]
    for redirected in [[d] for d in live] + [live]:
        sources, some_rows = [None] * R, rows.clone()
        for d in redirected:
            begin = torch.randint(0, R * m - m + 1, (L,), generator=g)
            src = _rows(g, L * R * m, 2 * H).view(L, R * m, 2 * H)[:, :, 5:5 + H]
            for e in range(L):
                c, b = int(counts[d * L + e]), int(begin[e])
                src[e, b:b + c] = rows[(d * L + e) * m:(d * L + e) * m + c]
                some_rows[(d * L + e) * m:(d * L + e + 1) * m] = float("nan")  # never read
            sources[d] = (src, begin.numpy() if d % 2 else begin)  # a numpy array or a tensor
        mine = torch.empty(n, H, dtype=BF16)
        assert native.ll_combine_recv(mine, some_rows, slots, w, sig, counts, mask, m, sources) == ()
        assert same_bits_nan(mine, got)
        d = redirected[0]
        src, begin = sources[d]
        e0 = next((e for e in range(L) if int(counts[d * L + e])), None)
        if e0 is not None:  # a run past the end of its src
            past = torch.as_tensor(begin).clone()
            past[e0] = R * m - int(counts[d * L + e0]) + 1
            with pytest.raises(ValueError, match="each source's runs"):
                native.ll_combine_recv(mine, some_rows, slots, w, sig, counts, mask, m,
                                       [(src, past) if i == d else x for i, x in enumerate(sources)])
        with pytest.raises(ValueError, match=rf"sources\[{d}\] must be"):
            native.ll_combine_recv(mine, some_rows, slots, w, sig, counts, mask, m,
                                   [(src.float(), begin) if i == d else x for i, x in enumerate(sources)])
        with pytest.raises(ValueError, match="one entry per rank"):
            native.ll_combine_recv(mine, some_rows, slots, w, sig, counts, mask, m, sources + [None])


def test_headers_agree():
    R, words = 3, 32
    hdr = torch.zeros(R, words, dtype=torch.int64)
    seq, op, flags = 5, 2, 4
    hdr[:, 0] = (seq << 16) | (flags << 8) | (op << 4)
    hdr[:, 1] = 12345
    assert native.ll_headers_agree(hdr, 1, None, seq, op)
    assert not native.ll_headers_agree(hdr, 1, None, seq + 1, op)
    assert not native.ll_headers_agree(hdr, 1, None, seq, 1)
    for col, change in ((0, 1), (0, 1 << 8), (1, 1)):  # a status, other flags, another (M, E, H)
        bad = hdr.clone()
        bad[2, col] += change
        assert not native.ll_headers_agree(bad, 1, None, seq, op)
        assert native.ll_headers_agree(bad, 1, torch.tensor([0, 0, 1], dtype=torch.int32), seq, op)  # masked
    handles = hdr.clone()  # word 2's high half: the dispatch of each source's handle (0: not known)
    handles[:, 2] = torch.tensor([7, 0, 7]) << 32 | 3  # low half: the op's call count, not compared
    assert native.ll_headers_agree(handles, 1, None, seq, op)
    handles[2, 2] = 8 << 32 | 3
    assert not native.ll_headers_agree(handles, 1, None, seq, op)
    assert native.ll_headers_agree(handles, 1, torch.tensor([0, 0, 1], dtype=torch.int32), seq, op)  # masked
    pulled = hdr.clone()  # a flag a source chooses alone (a combine's F_PULL) is ignored when asked
    pulled[0, 0] |= 8 << 8
    assert not native.ll_headers_agree(pulled, 1, None, seq, op)
    assert native.ll_headers_agree(pulled, 1, None, seq, op, ignore_flags=8) == 3  # 2: a source set it
    assert native.ll_headers_agree(hdr, 1, None, seq, op, ignore_flags=8) == 1
    assert native.ll_headers_agree(pulled, 1, torch.tensor([1, 0, 0], dtype=torch.int32), seq, op, 8) == 1  # masked
    assert not native.ll_headers_agree(pulled, 1, None, seq, op, ignore_flags=4)
    with pytest.raises(ValueError, match="rank 3 outside"):
        native.ll_headers_agree(hdr, 3, None, seq, op)


def test_publish_stores_each_header_then_each_signal():
    """``ll_publish`` on tensors standing for three ranks' header slots and signal words: the destinations of
    ``order`` get the header and the value, the others nothing; bad operands are refused before any store."""
    R, words = 3, 4
    slots = torch.zeros(R, words, dtype=torch.int64)
    sig = torch.zeros(R, dtype=torch.int64)
    hdr_addrs = torch.tensor([slots[d].data_ptr() for d in range(R)])
    sig_addrs = torch.tensor([sig[d:].data_ptr() for d in range(R)])
    hdr = torch.tensor([11, -2, 1 << 40, 7])
    assert native.ll_publish(torch.tensor([2, 0]), hdr, hdr_addrs, sig_addrs, 9)
    assert slots[0].tolist() == slots[2].tolist() == hdr.tolist() and not slots[1].any()
    assert sig.tolist() == [9, 0, 9]
    assert native.ll_publish(torch.tensor([1]), hdr[:3].view(torch.uint8), hdr_addrs, sig_addrs, 10)  # 3 words, bytes
    assert slots[1].tolist() == hdr[:3].tolist() + [0] and sig.tolist() == [9, 10, 9]
    before = (slots.clone(), sig.clone())
    unmapped = hdr_addrs.clone()
    unmapped[1] = 0
    for args in ((torch.tensor([3]), hdr, hdr_addrs, sig_addrs),                  # a rank outside [0, R)
                 (torch.tensor([1]), hdr, unmapped, sig_addrs),                   # not mapped
                 (torch.tensor([1], dtype=torch.int32), hdr, hdr_addrs, sig_addrs),  # another dtype
                 (torch.tensor([1]), hdr, hdr_addrs, sig_addrs[:2]),             # another length
                 (torch.tensor([1]), hdr.view(torch.uint8)[:12], hdr_addrs, sig_addrs)):  # not whole words
        with pytest.raises(ValueError, match="ll_publish"):
            native.ll_publish(*args, 11)
    assert torch.equal(slots, before[0]) and torch.equal(sig, before[1])


def test_await_polls_the_sources_then_checks_the_headers():
    """``ll_await``: -1 while an unmasked source's word is short (after its polls), else ``ll_headers_agree``'s
    answer on the headers."""
    R, seq, op = 3, 5, 2
    hdr = torch.zeros(R, 32, dtype=torch.int64)
    hdr[:, 0] = (seq << 16) | (op << 4)
    hdr[:, 1] = 99
    sig = np.array([seq + 1, seq, seq + 2], dtype=np.int64)  # source 1 is short of seq + 1
    addr = sig.ctypes.data
    assert native.ll_await(addr, R, None, seq + 1, 50, hdr, 0, seq, op) == -1
    masked = torch.tensor([0, 1, 0], dtype=torch.int32)
    assert native.ll_await(addr, R, masked, seq + 1, 0, hdr, 0, seq, op) == 1  # a masked source is not waited for
    sig[1] = seq + 1
    assert native.ll_await(addr, R, None, seq + 1, 0, hdr, 0, seq, op) == 1
    hdr[2, 1] = 98  # another (M, E, H)
    assert native.ll_await(addr, R, None, seq + 1, 0, hdr, 0, seq, op) == 0
    hdr[2, 1] = 99
    hdr[1, 0] |= 8 << 8  # a flag the source chooses alone, ignored when asked
    assert native.ll_await(addr, R, None, seq + 1, 0, hdr, 0, seq, op, 8) == 3
    with pytest.raises(ValueError, match="ll_await"):
        native.ll_await(addr, R + 1, None, seq + 1, 0, hdr, 0, seq, op)
    with pytest.raises(ValueError, match="ll_await"):
        native.ll_await(0, R, None, seq + 1, 0, hdr, 0, seq, op)


def _write_messages(x, round_scale, use_ue8m0, fill=0xA5):
    """``LowLatencyEngine._write_messages`` of ``x`` (FP8) into a plain tensor standing for the send region: the
    native cast where its kernel is loaded, else the torch path."""
    n, hidden = x.shape
    mb = native.ll_cast_message_bytes(hidden, use_ue8m0)
    win = torch.full((n * mb + 8,), fill, dtype=torch.uint8)
    stand_in = types.SimpleNamespace(tp=types.SimpleNamespace(local_view=lambda w, off, nbytes: w[off:off + nbytes]),
                                     win=win, _scratch=lambda name, shape, dtype: torch.empty(shape, dtype=dtype),
                                     _view=lambda key, make: make())
    lay = types.SimpleNamespace(H=hidden, send_off=0)
    words = hidden // 512 if use_ue8m0 else hidden // 128
    rows = LowLatencyEngine._write_messages(stand_in, x, lay, 0, True, round_scale, use_ue8m0, words)
    assert rows.data_ptr() == win.data_ptr() and bool((win[n * mb:] == fill).all())  # nothing past the messages
    return rows


@pytest.mark.parametrize("round_scale, use_ue8m0", [(False, False), (True, False), (True, True)])
def test_cast_messages_are_the_torch_paths_bytes(round_scale, use_ue8m0, monkeypatch):
    assert native.loader.kernels.ll_cast_messages is not None  # got: the kernel's bytes
    g = torch.Generator().manual_seed(13)
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(BF16).view(128, 512)  # all bf16 bits
    noise = torch.randint(-32768, 32768, (8, 1536), generator=g, dtype=torch.int32).to(torch.int16).view(BF16)
    wide = _rows(g, 6, 1536 + 64)
    wide[0] = 0.0  # amax 0: the floor's scale
    wide[1, :128] = 1e-40  # a subnormal group, below the floor
    wide[2, 128:256] = float("nan")  # a group of NaN only
    wide[3, 256:384] = torch.tensor([448.0, 464.0, -3.0e38, 0.1875, 0.140625, -0.0] * 21 + [1.0, 2.0])
    wide[4, :1536:2] = float("-inf")
    cases = [every, noise, wide[:, 32:32 + 1536], wide[:1, :512]]  # wide: strided rows
    if not use_ue8m0:
        cases += [wide[:, 64:64 + 128], torch.randn(1, 128, generator=g).to(BF16)]
    for x in cases:
        got = _write_messages(x, round_scale, use_ue8m0)
        with monkeypatch.context() as m:
            m.setattr(native.loader.kernels, "ll_cast_messages", None)  # the torch path
            want = _write_messages(x, round_scale, use_ue8m0, fill=0x5A)
        assert torch.equal(got, want), f"{tuple(x.shape)}: {int((got != want).sum())} bytes differ"


def test_cast_messages_refuses_bad_operands():
    x = torch.randn(4, 512).to(BF16)
    mb = native.ll_cast_message_bytes(512, False)
    out = torch.full((4, mb), 7, dtype=torch.uint8)
    bad = [
        ((x.float(), out, False, False), "x must be a 2-D CPU torch.bfloat16 matrix"),
        ((x.t(), out, False, False), "x must be a 2-D CPU torch.bfloat16 matrix"),
        ((x[:, :200], out, False, False), "multiple of 128, got 200"),
        ((torch.randn(4, 640).to(BF16), out, True, True), r"multiple of 512 \(use_ue8m0\), got 640"),
        ((x, out, False, True), "use_ue8m0=True needs round_scale=True"),
        ((x, out[:, :-1], False, False), rf"out must be a \[4, {mb}\] CPU uint8 matrix"),
        ((x, out[:3], False, False), rf"out must be a \[4, {mb}\] CPU uint8 matrix"),
        ((x, out.view(torch.int8), False, False), "out must be"),
        ((x, torch.zeros(4 * mb, dtype=torch.uint8).as_strided((4, mb), (mb - 1, 1)), False, False),
         "out's rows overlap"),
    ]
    with torch.inference_mode():
        frozen = torch.full((4, mb), 7, dtype=torch.uint8)
    bad.append(((x, frozen, False, False), "out is an inference tensor"))
    for args, match in bad:
        with pytest.raises(ValueError, match=match):
            native.ll_cast_messages(*args)
    assert bool((out == 7).all()) and bool((frozen == 7).all())  # nothing written
    version = out._version
    assert native.ll_cast_messages(x, out, False, False) and out._version > version  # torch sees the write
    both = torch.zeros(4 * 2 * 512 + 4 * mb, dtype=torch.uint8)
    with pytest.raises(ValueError, match="out overlaps x"):
        native.ll_cast_messages(both[:4096].view(BF16).view(4, 512), both[1024:1024 + 4 * mb].view(4, mb), False,
                                False)
