"""Dispatch storing ``x`` straight into the receivers' ``recv_x`` (landing segments) and its fallbacks;
combine reading an ``x`` that lies in a landing segment in place.

Each rank's ``recv_x`` lives in its landing segment when it fits; senders then gather their rows
straight into it ("direct"). Otherwise ``x`` is staged in the senders' windows and gathered by the
receivers ("staged"), or, when the ranks predicted direct stores that did not fit, staged after
the headers ("late"). Every path must give the reference's bytes, outputs the caller keeps must
never be overwritten, and they must stay valid after ``destroy()``.
"""

from __future__ import annotations

import gc
import os
import time

import pytest
import torch

from deepep_ascend import Buffer
from deepep_ascend.ep import intranode as intranode_mod
from deepep_ascend.settings import LANDING_BYTES
from tests.support.buffer_helpers import (
    BF16,
    all_ranks_ok,
    capture,
    coll,
    make_topk_idx,
    same_bits_nan,
)
from tests.support.mpi_utils import allgather_object, gather_all, up_to_four_ranks
from tests.support.reference import ref_combine

pytestmark = [pytest.mark.mpi(min_size=1), pytest.mark.watchdog(180)]

N, H, K = 48, 256, 4


def _inputs(comm, seed):
    r, R = comm.Get_rank(), comm.Get_size()
    gen = torch.Generator().manual_seed(seed * 101 + r)
    E = 8 * R
    idx = make_topk_idx("uniform", N, E, K, r, R, gen)
    return torch.randn(N, H, generator=gen).to(BF16), idx, torch.rand(N, K, generator=gen), E


def _expected(x, itr, comm):
    """Rows this rank receives: every source rank in order, its tokens routed here in order."""
    r = comm.Get_rank()
    return torch.cat([xs[m[:, r]] for xs, m in zip(gather_all(x, comm), gather_all(itr, comm))])


def _dispatch(buf, x, idx, w, E):
    ntpr, _, ntpe, itr, _ = buf.get_dispatch_layout(idx, E)
    out = coll(lambda: buf.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=itr, num_tokens_per_expert=ntpe,
                                    topk_idx=idx, topk_weights=w), what="dispatch")
    return out[0], out[4], itr


def _check_same_paths(comm, paths, what):
    everyone = allgather_object(paths, comm)
    all_ranks_ok(comm, all(p == everyone[0] for p in everyone), f"{what}: ranks took different paths: {everyone}")


def _hint(R):
    return Buffer.get_normal_buffer_size_hint(N, H, R, K, 8 * R)


def _same(got, expected) -> bool:
    return torch.equal(got.view(torch.int16), expected.view(torch.int16))


def _dispatches(buf, comm, seeds, cached=False):
    """Dispatch each seed's inputs (with ``cached``, then once more through the handle with new
    ``x``); the paths taken, and whether every ``recv_x`` matched the reference."""
    paths, ok = [], True
    for seed in seeds:
        x, idx, w, E = _inputs(comm, seed)
        recv_x, handle, itr = _dispatch(buf, x, idx, w, E)
        ok = _same(recv_x, _expected(x, itr, comm)) and ok  # _expected is collective: always run it
        paths.append(buf._engine.last_x_path)
        if cached:
            x2 = _inputs(comm, seed + 100)[0]
            got = coll(lambda: buf.dispatch(x2, handle=handle)[0], what="cached dispatch")
            ok = _same(got, _expected(x2, itr, comm)) and ok
            paths.append(buf._engine.last_x_path)
    return paths, ok


def test_kept_outputs_are_never_overwritten_and_paths_follow_the_landing_room(comm):
    """Keep every recv_x: direct stores while the landing segment has room, then a late call (the
    ranks predicted room that was gone), then staged calls; drop them all: staged once (the
    prediction catches up), then direct again. Every kept output keeps its bytes throughout."""
    buf = Buffer(None, _hint(comm.Get_size()), comm=comm, explicitly_destroy=True)
    try:
        kept, paths = [], []
        for i in range(12):
            x, idx, w, E = _inputs(comm, i)
            recv_x, handle, itr = _dispatch(buf, x, idx, w, E)
            kept.append((recv_x, _expected(x, itr, comm), handle))
            paths.append(buf._engine.last_x_path)
        bad = [i for i, (got, exp, _) in enumerate(kept) if not _same(got, exp)]
        first_late = paths.index("late") if "late" in paths else len(paths)
        ok = (not bad and paths[0] == "direct" and set(paths[:first_late]) == {"direct"} and first_late < len(paths)
              and set(paths[first_late + 1:]) == {"staged"})
        all_ranks_ok(comm, ok, f"kept outputs: paths {paths}, outputs overwritten or wrong at calls {bad}")
        _check_same_paths(comm, paths, "kept outputs")

        # a cached dispatch on the full segment is staged too; after dropping the outputs it lands again
        handle = kept[0][2]
        x = _inputs(comm, 99)[0]
        got = coll(lambda: buf.dispatch(x, handle=handle)[0], what="cached dispatch, segment full")
        all_ranks_ok(comm, _same(got, _expected(x, handle[4], comm))
                     and buf._engine.last_x_path == "staged", f"cached dispatch on a full segment: "
                     f"{buf._engine.last_x_path}")
        del kept, got
        gc.collect()
        after = []
        for i in range(3):
            x, _, _, _ = _inputs(comm, 200 + i)
            got = coll(lambda: buf.dispatch(x, handle=handle)[0], what="cached dispatch after dropping")
            ok = _same(got, _expected(x, handle[4], comm))
            after.append((buf._engine.last_x_path, ok))
        all_ranks_ok(comm, after == [("staged", True), ("direct", True), ("direct", True)],
                     f"cached dispatches after dropping the outputs: {after}")
    finally:
        coll(buf.destroy, what="destroy")


def test_recv_x_outlives_destroy_and_no_segment_file_is_left(comm):
    buf = Buffer(None, _hint(comm.Get_size()), comm=comm, explicitly_destroy=True)
    x, idx, w, E = _inputs(comm, 7)
    recv_x, _, itr = _dispatch(buf, x, idx, w, E)
    path = buf._engine.last_x_path
    expected = _expected(x, itr, comm)
    coll(buf.destroy, what="destroy with recv_x alive")
    gc.collect()
    recv_x.add_(0)  # still mapped and writable
    leftovers = [f for f in os.listdir("/dev/shm") if f.startswith(f"deepep_ascend.{os.getpid()}.")]
    all_ranks_ok(comm, path == "direct" and _same(recv_x, expected)
                 and not leftovers, f"recv_x after destroy: path {path}, files left {leftovers}")


@pytest.mark.parametrize("landing, first", [("0", "staged"), ("4096", "late")], ids=["no_landing", "landing_too_small"])
def test_without_room_dispatch_stages_and_matches_the_reference(comm, monkeypatch, landing, first):
    """No landing segment (every call staged), or one too small for any recv_x (the first call is
    late: the ranks start out predicting direct stores, since every rank has a segment; later ones
    staged); non-cached and cached alike give the reference."""
    monkeypatch.setenv(LANDING_BYTES.name, landing)
    buf = Buffer(None, _hint(comm.Get_size()), comm=comm, explicitly_destroy=True)
    try:
        paths, ok = _dispatches(buf, comm, range(300, 303), cached=True)
        all_ranks_ok(comm, ok and paths == [first] + ["staged"] * 5, f"{LANDING_BYTES.name}={landing}: paths {paths}")
    finally:
        coll(buf.destroy, what="destroy")


def test_streaming_window_takes_the_late_then_staged_path(comm):
    """A window far smaller than the payload streams in rounds; direct stores need one round."""
    R = comm.Get_size()
    small = 2 * (1024 + 128 * 6 + 4 * (2 * H + 12 * K + R))  # room for about 4 rows per half
    buf = Buffer(None, -(-small // 128) * 128, comm=comm, explicitly_destroy=True)
    try:
        paths, ok = _dispatches(buf, comm, range(500, 502))
        all_ranks_ok(comm, ok and paths == ["late", "staged"], f"streaming window: paths {paths}")
    finally:
        coll(buf.destroy, what="destroy")


def test_async_cached_dispatches_agree_on_the_path_when_one_rank_lags(comm):
    """Two async cached dispatches in a row, one that streams (no direct stores), then one that
    fits, and the last rank busy in between: its first call may still run on its worker when the
    second begins. Every rank must take the same paths (the prediction is read on the worker, in
    call order) and both outputs must be right."""
    r, R = comm.Get_rank(), comm.Get_size()
    buf = Buffer(None, _hint(R), comm=comm, explicitly_destroy=True)
    try:
        x, idx, w, E = _inputs(comm, 600)
        _, handle, itr = _dispatch(buf, x, idx, w, E)
        gen = torch.Generator().manual_seed(601 + r)
        big = torch.randn(N, 1024, dtype=torch.float64, generator=gen)  # 8 KiB rows: streams in rounds
        small = torch.randn(N, H, generator=gen).to(BF16)
        expected = [_expected(big, itr, comm), _expected(small, itr, comm)]
        comm.Barrier()
        first, _, _, _, _, ev1 = buf.dispatch(big, handle=handle, async_finish=True)
        if r == R - 1:
            time.sleep(0.3)
        second, _, _, _, _, ev2 = buf.dispatch(small, handle=handle, async_finish=True)
        _, exc = capture(lambda: (ev1.current_stream_wait(), ev2.current_stream_wait()))
        path = buf._engine.last_x_path
        ok = exc is None and _same(first.view(torch.int16), expected[0]) and _same(second, expected[1])
        all_ranks_ok(comm, ok and path == "staged", f"async cached dispatches: path {path}, error {exc!r}")
        _check_same_paths(comm, [path], "async cached dispatches")
    finally:
        coll(buf.destroy, what="destroy")


@pytest.mark.mpi(min_size=2)
def test_handles_that_differ_between_ranks_are_refused_on_every_rank(comm):
    """Unregistered handle copies (ids -1 everywhere) from two different dispatches, one on rank 0
    and the other elsewhere: cached dispatch and combine raise ConsensusError on every rank (their
    rank prefix matrices differ), so no rank waits for another's rows; the Buffer stays usable and
    its next dispatch lands directly."""
    from deepep_ascend import ConsensusError

    r, R = comm.Get_rank(), comm.Get_size()
    buf = Buffer(None, _hint(R), comm=comm, explicitly_destroy=True)
    try:
        handles = []
        for seed in (700, 701):
            x, idx, w, E = _inputs(comm, seed)
            if seed == 701:
                idx = idx.roll(1, dims=0)  # another routing: other counts, another prefix matrix
            handles.append(tuple(t.clone() if isinstance(t, torch.Tensor) else t
                                 for t in _dispatch(buf, x, idx, w, E)[1]))
        mine = handles[0] if r == 0 else handles[1]
        x = _inputs(comm, 702)[0]
        _, exc = capture(lambda: buf.dispatch(x, handle=mine))
        rows = int(mine[0][-1, r])
        _, cexc = capture(lambda: buf.combine(torch.zeros(mine[3].numel(), H, dtype=BF16)[:max(rows, 0)], mine))
        ok = all(isinstance(e, ConsensusError) and "rank prefix matrix" in str(e) for e in (exc, cexc))
        what = f"mismatched handles: cached dispatch raised {exc!r}, combine {cexc!r}"
        del exc, cexc  # their tracebacks hold the refused call's frames, whose recv_x holds landing room
        all_ranks_ok(comm, ok, what)
        paths, ok = _dispatches(buf, comm, [703, 704])
        all_ranks_ok(comm, ok and paths == ["direct", "direct"], f"after the refused calls: paths {paths}")
    finally:
        coll(buf.destroy, what="destroy")


def test_bad_landing_size_is_a_clear_error_on_every_rank(comm, monkeypatch):
    monkeypatch.setenv(LANDING_BYTES.name, "lots")
    _, exc = capture(lambda: Buffer(None, _hint(comm.Get_size()), comm=comm, explicitly_destroy=True))
    all_ranks_ok(comm, isinstance(exc, ValueError) and LANDING_BYTES.name in str(exc) and "'lots'" in str(exc),
                 f"bad ${LANDING_BYTES.name}: got {exc!r}")


def test_landing_segments_count_against_the_windows_shared_memory(comm, monkeypatch):
    """The landing segments reserve their pages and the ubmem window maps its own sparsely: with shared memory for
    the segments but not for the window's pages beside them, the Buffer is refused on every rank before anything is
    used, naming the segments and $DEEPEP_ASCEND_LANDING_BYTES (not built, to die of SIGBUS at a later store); with
    that variable at 0 the same Buffer builds and runs. /dev/shm's free space is shown shifted down to a budget
    (what the segments' reservation takes still counts, for real)."""
    import os as os_mod

    from mpi4py import MPI

    from deepep_ascend.transports import SharedMemoryExhausted

    nvl = _hint(comm.Get_size())
    n = comm.Get_size()  # one host
    real = os_mod.statvfs

    def shifted(budget):
        start = real("/dev/shm")
        offset = comm.allreduce(start.f_bavail * start.f_frsize, op=MPI.MIN) - budget

        def statvfs(path, *a):
            st = real(path, *a)
            if str(path) != "/dev/shm":
                return st
            free = max(0, st.f_bavail * st.f_frsize - offset) // st.f_frsize
            return os_mod.statvfs_result((st.f_bsize, st.f_frsize, st.f_blocks, free, free, st.f_files, st.f_ffree,
                                          st.f_favail, st.f_flag, st.f_namemax))
        return statvfs

    monkeypatch.setattr(os_mod, "statvfs", shifted(n * nvl + n * nvl // 2))  # the segments, half the window
    _, exc = capture(lambda: Buffer(None, nvl, comm=comm, explicitly_destroy=True))
    all_ranks_ok(comm, isinstance(exc, SharedMemoryExhausted) and "create_window('ubmem')" in str(exc)
                 and f"recv_x landing segments already reserve {nvl:,} B per rank" in str(exc)
                 and LANDING_BYTES.name in str(exc), f"refused Buffer: got {exc!r}")
    monkeypatch.setattr(os_mod, "statvfs", shifted(n * nvl + n * nvl // 2))  # (the refused segments are gone)
    monkeypatch.setenv(LANDING_BYTES.name, "0")
    buf = Buffer(None, nvl, comm=comm, explicitly_destroy=True)
    try:
        paths, ok = _dispatches(buf, comm, [705])
        all_ranks_ok(comm, ok and paths == ["staged"], f"without landing segments: paths {paths}")
    finally:
        coll(buf.destroy, what="destroy")


def _combine(buf, x, handle, recv_w, use_async=False):
    """``buf.combine`` on every rank; ``(combined_x, combined_topk_weights, read in place?)``."""
    def call():
        kw = dict(previous_event=Buffer.capture(), async_finish=True) if use_async else {}
        out = buf.combine(x, handle, topk_weights=recv_w, **kw)
        if use_async:
            out[2].current_stream_wait()
        return out
    out = coll(call, what="combine")
    return out[0], out[1], buf._engine.last_combine_in_place


@pytest.mark.parametrize("zeros", ["none", "signed", "nan"])
@pytest.mark.parametrize("window", ["one_round", "streaming"])
@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
@up_to_four_ranks()
def test_combine_reads_x_in_place_from_the_landing_segment(comm, monkeypatch, zeros, window, use_async):
    """``combine(recv_x)`` (DeepEP's benchmark pattern, or expert outputs written into ``recv_x``):
    peers read the rows where they lie instead of a staged copy. The result is the reference's, bit
    for bit (with ``-0.0`` rows everywhere or nowhere: the two-rank run-wise sum must still give
    ``+0.0``), equal to the staged path's (``x`` a private copy) and to a mix of both; ``x`` is left
    untouched (``nan``: NaN payloads are left unspecified, as everywhere in combine: same NaN
    positions, every other element bit for bit). ``streaming``: a window of a few rows per half, so
    combine runs in many rounds."""
    r, R = comm.Get_rank(), comm.Get_size()
    if window == "streaming":
        monkeypatch.setenv(LANDING_BYTES.name, str(64 << 20))  # recv_x still lands
        nbytes = -(-2 * (1024 + 128 * 6 + (R + 4) * (2 * H + 12 * K + R)) // 128) * 128  # combine: >= R rows
    else:
        nbytes = _hint(R)
    buf = Buffer(None, nbytes, comm=comm, explicitly_destroy=True)
    try:
        x, idx, w, E = _inputs(comm, 40)
        if zeros == "signed":
            x[::3] = -0.0
        elif zeros == "nan":  # NaN payloads other than the canonical one (fill_, signalling), -0.0, inf
            x.view(torch.int16)[::4, ::3] = 0x7F81
            x[1::4, ::2] = float("nan")
            x[2::4] = -0.0
            x[3::8, 1::4] = float("-inf")
        ntpr, _, ntpe, itr, _ = buf.get_dispatch_layout(idx, E)
        recv_x, _, recv_w, _, handle, _ = coll(lambda: buf.dispatch(
            x, num_tokens_per_rank=ntpr, is_token_in_rank=itr, num_tokens_per_expert=ntpe, topk_idx=idx,
            topk_weights=w), what="dispatch")
        landed = buf._engine.segment.offset_of(r, recv_x) is not None
        recv_x.mul_(1 + r / 8)  # an "expert" writing its output in place
        before = recv_x.clone()
        e_x, e_w = ref_combine(gather_all(before), gather_all(itr), r, topk_weights=gather_all(recv_w))
        got_in, w_in, path_in = _combine(buf, recv_x, handle, recv_w, use_async)
        got_st, w_st, path_st = _combine(buf, before.clone(), handle, recv_w, use_async)
        mixed = recv_x if r % 2 else before.clone()
        got_mx, _, path_mx = _combine(buf, mixed, handle, recv_w, use_async)
        ok = (landed and path_in and not path_st and path_mx == bool(r % 2) and same_bits_nan(got_in, e_x)
              and same_bits_nan(got_st, e_x) and same_bits_nan(got_mx, e_x) and torch.equal(w_in, e_w)
              and torch.equal(w_st, e_w) and _same(recv_x, before))
        all_ranks_ok(comm, ok, f"combine of recv_x in place ({zeros}, {window}): landed {landed}, in place "
                               f"{path_in}/{path_st}/{path_mx}, in place / staged / mixed equal to the reference: "
                               f"{same_bits_nan(got_in, e_x)}/{same_bits_nan(got_st, e_x)}/"
                               f"{same_bits_nan(got_mx, e_x)}, x kept {_same(recv_x, before)}")
    finally:
        coll(buf.destroy, what="destroy")


def _delayed(fn, seconds):
    def delayed(*args, **kwargs):
        time.sleep(seconds)
        return fn(*args, **kwargs)
    return delayed


@pytest.mark.mpi(min_size=2)
def test_x_read_in_place_is_the_callers_again_once_combine_returns(comm, monkeypatch):
    """A rank's combine returns only after every peer has read its rows of ``x``: here the last rank
    starts summing 0.3 s late, and every rank overwrites its ``x`` the moment combine returns. The
    last rank must still get the sum of the rows as they were."""
    r, R = comm.Get_rank(), comm.Get_size()
    if r == R - 1:  # on the torch glue or the native receive, whichever runs
        for owner, name in ((intranode_mod, "accumulate_rows"), (intranode_mod.IntranodeEngine, "_combine_native")):
            monkeypatch.setattr(owner, name, _delayed(getattr(owner, name), 0.3))
    buf = Buffer(None, _hint(R), comm=comm, explicitly_destroy=True)
    try:
        x, idx, w, E = _inputs(comm, 41)
        recv_x, handle, itr = _dispatch(buf, x, idx, w, E)
        e_x = ref_combine(gather_all(recv_x), gather_all(itr), r)[0]

        def combine_then_overwrite():
            out = buf.combine(recv_x, handle)
            recv_x.fill_(float("nan"))  # before any collective of the harness can hold this rank back
            return out[0]
        got = coll(combine_then_overwrite, what="combine")
        in_place = buf._engine.last_combine_in_place
        all_ranks_ok(comm, in_place and _same(got, e_x), f"x overwritten after combine: in place {in_place}, "
                                                         f"combined_x equal to the reference {_same(got, e_x)}")
    finally:
        coll(buf.destroy, what="destroy")


@pytest.mark.mpi(min_size=2)
@up_to_four_ranks()
def test_a_reader_of_x_in_place_raises_when_its_owner_fails(comm, monkeypatch):
    """Rank 0's ``x`` is read in place, every other rank's is private; the last rank sums 3.5 s late, so
    rank 0 times out (timeout_s=2) waiting for it and overwrites its ``x`` the moment combine raises.
    The late rank must raise too, never return rows read from the overwritten ``x``; any other rank
    raises or returns the reference. Then the Buffer is destroyed."""
    r, R = comm.Get_rank(), comm.Get_size()
    late = R - 1
    if r == late:  # the sum is late, on the torch glue or the native receive, whichever runs
        for owner, name in ((intranode_mod, "accumulate_rows"), (intranode_mod.IntranodeEngine, "_combine_native")):
            monkeypatch.setattr(owner, name, _delayed(getattr(owner, name), 3.5))
    buf = Buffer(None, _hint(R), comm=comm, explicitly_destroy=True, timeout_s=2)
    x, idx, w, E = _inputs(comm, 42)
    recv_x, handle, itr = _dispatch(buf, x, idx, w, E)
    e_x = ref_combine(gather_all(recv_x), gather_all(itr), r)[0]
    mine = recv_x if r == 0 else recv_x.clone()

    def combine_then_overwrite():
        try:
            return buf.combine(mine, handle)[0]
        finally:
            mine.fill_(float("nan"))
    got, exc = capture(combine_then_overwrite)
    in_place = buf._engine.last_combine_in_place
    if r == 0:
        ok = in_place and isinstance(exc, TimeoutError) and getattr(exc, "pending_peers", None) == [late]
    elif r == late:
        ok = exc is not None and not in_place
    else:
        ok = exc is not None or _same(got, e_x)
    detail = f"rank {r}: in place {in_place}, raised {type(exc).__name__}: {exc}" if exc else f"rank {r}: returned"
    comm.Barrier()  # everyone reaches destroy together
    _, dexc = capture(buf.destroy)
    all_ranks_ok(comm, ok and dexc is None, f"{detail}; destroy: {dexc!r}")


def test_a_failed_async_worst_token_dispatch_frees_its_landing_range_once_dropped(comm):
    """An async dispatch whose ``num_worst_tokens`` is below what a rank receives raises at that rank's wait. Once the
    caller drops the outputs and the event, their landing range is free again at once (nothing else keeps them: not
    the error's traceback, nor the Buffer's record of the call), without Python's cycle collector, so later
    dispatches find the room they had."""
    from tests.support.buffer_helpers import capture

    r, R = comm.Get_rank(), comm.Get_size()
    buf = Buffer(None, _hint(R), comm=comm, explicitly_destroy=True)
    try:
        landing = buf._engine.landing
        x, idx, w, E = _inputs(comm, 43)
        ntpr, _, ntpe, itr, _ = buf.get_dispatch_layout(idx, E)
        free_before = landing.largest_free() if landing is not None else None
        gc.disable()
        try:
            out = buf.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=itr, num_tokens_per_expert=ntpe,
                               topk_idx=idx, topk_weights=w, num_worst_tokens=1, async_finish=True)
            held = out[0].numel() > 0 and landing is not None and landing.largest_free() != free_before
            _, exc = capture(out[-1].current_stream_wait)
            raised, said = isinstance(exc, RuntimeError) and "num_worst_tokens" in str(exc), repr(exc)
            del out, exc  # (the error's traceback holds the wait's frames, the event among them)
            free_after = landing.largest_free() if landing is not None else None
        finally:
            gc.enable()
        all_ranks_ok(comm, raised and (landing is None or (held and free_after == free_before)),
                     f"rank {r}: wait raised {said}; landing free before {free_before}, after {free_after}")
    finally:
        coll(buf.destroy, what="destroy")
