"""URMA backend: one-sided MPI RMA between nodes (docs/design/transports.md §4.1, option A).

Each :class:`~transports.ubmem.SymmetricWindow` of a job with more than one node exposes its
rank's node-shared segment (``[control | data]``) a second time, world-wide, with
``MPI_Win_create``; peers on other nodes reach it only through this RMA window, peers on the
same node keep load/store access (UBMEM). The two access paths never write the same word: a
signal word ``slot[s][src]`` is written only by ``src``, with stores if ``src`` shares the node
and with RMA accumulates otherwise.

Operations (all on a passive-target epoch opened by ``Lock_all(MODE_NOCHECK)`` for the window's
life; displacements are byte offsets into the segment, ``disp_unit`` 1):

- put = ``Put`` → ``Flush_local`` (source reusable; remote completion at the next flush), or, deferred,
  ``Put`` alone (the source held until the next flush to that rank: each ``Flush_local`` waits on its own);
- put with signal = ``Put`` → ``Flush`` → ``Accumulate(SUM)`` → ``Flush``: MPI orders
  accumulates among themselves but not a put against an accumulate, hence the middle flush;
- signal = [``Flush`` if the window has unflushed puts to ``dst``] → ``Accumulate`` → ``Flush``;
- signals to several ranks (:meth:`RmaWindow.accumulate_many`) = [``Flush_all`` if ordered and there are unflushed
  puts] → ``Accumulate`` to each → ``Flush_all``; after deferred puts to each, a put with signal to several ranks;
- get = ``Get`` → ``Flush``.

Signals use ``MPI_INT64_T`` on both sides (MPICH rejects numpy's default ``MPI_LONG`` against an
``INT64_T`` target) and only ``MPI_SUM``, matching the ``accumulate_ops=same_op_no_op`` hint.

Targets read their control words with plain loads, which the ``MPI_WIN_UNIFIED`` memory model
allows (a window reporting the separate model is refused). Over active-message transports
(UCX/TCP) an RMA operation lands only while the target is inside MPI, so every wait loop of the
transport calls :meth:`Progress.poke` (``Iprobe`` on a private communicator).
"""

from __future__ import annotations

import time

import numpy as np

from .errors import TransportConfigError, TransportRuntimeError

#: ``progress()`` calls closer together than this are skipped (docs/design/transports.md §3.4: ~100 µs).
PROGRESS_INTERVAL_S = 100e-6


def _memory_model(win) -> int:
    """The window's ``MPI_WIN_MODEL`` attribute (a function so tests can pretend otherwise)."""
    return win.model


class Progress:
    """Drives MPI progress for incoming RMA traffic: ``Iprobe`` on a private duplicate of ``comm``.

    Nothing is ever sent on the duplicate, so the probe matches nothing; its only effect is
    one pass of MPICH's progress engine, which applies pending active-message puts and
    accumulates targeting this rank.
    """

    def __init__(self, comm):
        self.comm = comm.Dup()
        self._last = 0.0

    def poke(self, force: bool = False) -> None:
        """One progress pass, unless the previous one is younger than ~100 µs (``force`` ignores that)."""
        now = time.monotonic()
        if force or now - self._last >= PROGRESS_INTERVAL_S:
            self._last = now
            self.comm.Iprobe()

    def free(self) -> None:
        self.comm.Free()


def allocate_node_shared(nbytes: int, comm, node_ranks, rank: int, name: str):
    """``MPI_Win_allocate`` over ``comm`` whose segments node peers can also map, or ``None``.

    Preferred exposure of a window of a multi-node job: MPICH places ``MPI_Win_allocate``
    memory of ranks on the same host in shared memory, so RMA between them is a direct copy by
    the origin (no target progress needed: a 4 MiB ``Put`` + ``Flush`` took 0.3 ms with the target
    asleep, against 580 ms through ``MPI_Win_create``'d memory, which MPICH serves with active
    messages applied only while the target is inside MPI), and ``MPI_Win_shared_query``
    (allowed on any window by MPI 4.0) gives the node peers' segments for UBMEM views. Returns
    ``(win, {world rank: buffer of its segment})`` for the ranks of ``node_ranks``, locked
    (``Lock_all(MODE_NOCHECK)``), or ``None`` on every rank if any rank cannot map a node peer's
    segment (another MPI): the caller then uses node-shared windows plus :class:`RmaWindow`.
    """
    from mpi4py import MPI

    info = MPI.Info.Create()
    info.Set("alloc_shared_noncontig", "true")
    info.Set("accumulate_ops", "same_op_no_op")
    try:
        win = MPI.Win.Allocate(nbytes, 1, info=info, comm=comm)
    except MPI.Exception as exc:
        raise TransportRuntimeError(f"rank {rank}: MPI_Win_allocate of window '{name}' ({nbytes} B) failed: "
                                    f"{exc.Get_error_string()}") from None
    finally:
        info.Free()
    bufs = {}
    try:
        for p in node_ranks:
            buf, _ = win.Shared_query(p)
            if buf.nbytes < nbytes:
                break
            bufs[p] = buf
    except MPI.Exception:
        pass
    ok = len(bufs) == len(node_ranks) and _memory_model(win) == MPI.WIN_UNIFIED
    if comm.allreduce(int(ok), op=MPI.MIN) == 0:
        bufs.clear()
        win.Free()
        return None
    win.Lock_all(MPI.MODE_NOCHECK)
    return win, bufs


class RmaWindow:
    """The world-wide RMA exposure of one rank's segment of a symmetric window.

    Args:
        segment: this rank's segment (buffer protocol object, e.g. from ``Shared_query``), exposed
            as is with ``MPI_Win_create``: displacements are byte offsets into it. Ignored with ``win``.
        comm: the world communicator (collective call).
        rank: this rank (for messages). name: the window's label (for messages).
        win: an ``MPI_Win_allocate`` window already locked (from :func:`allocate_node_shared`) to
            drive instead of creating one; :meth:`free` then frees it.
    Raises:
        TransportConfigError: on every rank, when any rank's window is not ``MPI_WIN_UNIFIED``
            (the RMA window is freed first).
        TransportRuntimeError: ``MPI_Win_create`` failed.
    """

    def __init__(self, segment, comm, rank: int, name: str, win=None):
        from mpi4py import MPI

        self.name, self.rank = name, rank
        self.dirty = set()  # ranks with puts not yet flushed to remote completion
        self._held = {}  # rank -> sources of its deferred puts, alive until a flush completes them
        self._one = np.zeros(1, dtype=np.int64)  # origin buffer of accumulates (flushed before reuse)
        self._MPI = MPI
        if win is not None:
            self.win = win
            return
        info = MPI.Info.Create()
        info.Set("accumulate_ops", "same_op_no_op")
        try:
            self.win = MPI.Win.Create(segment, 1, info=info, comm=comm)
        except MPI.Exception as exc:
            raise TransportRuntimeError(
                f"rank {rank}: MPI_Win_create of window '{name}' for URMA failed: {exc.Get_error_string()}") from None
        finally:
            info.Free()
        unified = int(_memory_model(self.win) == MPI.WIN_UNIFIED)
        if comm.allreduce(unified, op=MPI.MIN) == 0:
            self.win.Free()
            raise TransportConfigError(
                f"rank {rank}: window '{name}': MPI reports the separate memory model (MPI_WIN_SEPARATE) on "
                f"some rank; the URMA backend needs MPI_WIN_UNIFIED because targets read their signal words "
                f"with plain loads (on this rank: {'unified' if unified else 'separate'})")
        self.win.Lock_all(MPI.MODE_NOCHECK)

    def _fail(self, op: str, peer, exc) -> TransportRuntimeError:
        return TransportRuntimeError(f"rank {self.rank}: {op}(win='{self.name}', peer {peer}) over URMA failed: "
                                     f"{exc.Get_error_string()}")

    def _deferred(self, dst: int, src) -> None:
        """``dst`` dirty, ``src`` (the origin buffer of a put not completed locally) held until it is flushed."""
        self.dirty.add(dst)
        self._held.setdefault(dst, []).append(src)

    def _flushed(self, dst: int | None) -> None:
        """Puts to ``dst`` (None: to every rank) completed remotely: not dirty, their sources let go."""
        if dst is None:
            self.dirty.clear()
            self._held.clear()
        else:
            self.dirty.discard(dst)
            self._held.pop(dst, None)

    def put(self, dst: int, disp: int, src: np.ndarray, signal_disp: int | None = None, add: int = 0,
            local: bool = True) -> None:
        """``Put`` the uint8 array ``src`` at byte ``disp`` of ``dst``; with ``signal_disp``, add ``add`` there after.

        Without a signal: ``Flush_local`` (``src`` reusable, ``dst`` marked dirty), or with ``local=False`` none:
        ``src`` is held (and must stay unchanged) until the next flush to ``dst``. With one:
        ``Flush(dst)`` → ``Accumulate`` → ``Flush(dst)`` (remote completion of both).
        """
        MPI = self._MPI
        try:
            if src.size:
                self.win.Put([src, MPI.BYTE], dst, target=[disp, src.size, MPI.BYTE])
            if signal_disp is None:
                if src.size:
                    if local:
                        self.win.Flush_local(dst)
                        self.dirty.add(dst)
                    else:
                        self._deferred(dst, src)
                return
            self.win.Flush(dst)
            self._flushed(dst)
            self._accumulate(dst, signal_disp, add)
        except MPI.Exception as exc:
            raise self._fail("put_with_signal" if signal_disp is not None else "put", dst, exc) from None

    def put_blocks(self, dst: int, src: np.ndarray, src_disps, disps, lengths, local: bool = True) -> None:
        """One ``Put`` of several byte blocks: block ``i``, the ``lengths[i]`` bytes at byte ``src_disps[i]`` of the
        uint8 array ``src``, to byte ``disps[i]`` of ``dst``; then ``Flush_local`` (``src`` reusable, ``dst`` dirty),
        or with ``local=False`` none (``src`` held, unchanged, until the next flush to ``dst``).

        Both sides are ``MPI_Type_create_hindexed`` types of bytes, so MPI moves every block in one operation
        (one rendezvous where a put of each block would pay one apiece); freeing them at once is allowed while
        the put is pending."""
        MPI = self._MPI
        origin = target = None
        try:
            origin = MPI.BYTE.Create_hindexed(list(lengths), list(src_disps)).Commit()
            target = MPI.BYTE.Create_hindexed(list(lengths), list(disps)).Commit()
            self.win.Put([src, 1, origin], dst, target=[0, 1, target])
            if local:
                self.win.Flush_local(dst)
                self.dirty.add(dst)
            else:
                self._deferred(dst, src)
        except MPI.Exception as exc:
            raise self._fail("put_blocks", dst, exc) from None
        finally:
            for t in (origin, target):
                if t is not None:
                    t.Free()

    def signal(self, dst: int, disp: int, add: int, ordered: bool) -> None:
        """Atomically add ``add`` to the int64 word at byte ``disp`` of ``dst``; remote complete on return.

        ``ordered``: earlier puts to ``dst`` on this window complete remotely first (release).
        """
        MPI = self._MPI
        try:
            if ordered and dst in self.dirty:
                self.win.Flush(dst)
                self._flushed(dst)
            self._accumulate(dst, disp, add)
        except MPI.Exception as exc:
            raise self._fail("signal", dst, exc) from None

    def accumulate_many(self, dsts, disps, adds, ordered: bool) -> None:
        """Add ``adds[i]`` to the int64 word at byte ``disps[i]`` of ``dsts[i]``, each remotely complete on return,
        in at most three MPI steps whatever their number: [``Flush_all`` if ``ordered`` and this window has
        unflushed puts] → ``Accumulate`` to each → ``Flush_all``. Unordered, earlier puts are not waited for
        first (the barrier flushes them itself)."""
        MPI = self._MPI
        try:
            if ordered and self.dirty:
                self.win.Flush_all()
                self._flushed(None)
            add = np.asarray(adds, dtype=np.int64)  # each accumulate's origin word, read until the flush
            for i, (dst, disp) in enumerate(zip(dsts, disps)):
                self.win.Accumulate([add[i:i + 1], MPI.INT64_T], dst, target=[disp, 1, MPI.INT64_T], op=MPI.SUM)
            self.win.Flush_all()
            self._flushed(None)  # every earlier put of the window completed too
        except MPI.Exception as exc:
            raise self._fail("signal", list(dsts), exc) from None

    def _accumulate(self, dst: int, disp: int, add: int) -> None:
        MPI = self._MPI
        self._one[0] = add
        self.win.Accumulate([self._one, MPI.INT64_T], dst, target=[disp, 1, MPI.INT64_T], op=MPI.SUM)
        self.win.Flush(dst)

    def get(self, src: int, disp: int, out: np.ndarray) -> None:
        """Read ``out.size`` bytes at byte ``disp`` of ``src`` into the uint8 array ``out`` (``Get`` → ``Flush``)."""
        MPI = self._MPI
        try:
            self.win.Get([out, MPI.BYTE], src, target=[disp, out.size, MPI.BYTE])
            self.win.Flush(src)
        except MPI.Exception as exc:
            raise self._fail("get", src, exc) from None

    def rget(self, src: int, disp: int, out: np.ndarray):
        """Start an ``Rget`` of ``out.nbytes`` bytes at byte ``disp`` of ``src`` into ``out``; returns its request (test
        it; it must complete before the window is freed)."""
        MPI = self._MPI
        try:
            return self.win.Rget([out.view(np.uint8), MPI.BYTE], src, target=[disp, out.nbytes, MPI.BYTE])
        except MPI.Exception as exc:
            raise self._fail("rget", src, exc) from None

    def try_get(self, src: int, disp: int, out: np.ndarray, timeout_s: float) -> bool:
        """``Rget`` of ``out.size`` bytes, polled until ``timeout_s``; False if it did not complete.

        For diagnostics after a failure (the peer may be gone): never blocks past the deadline; an
        unfinished request is abandoned (the transport is poisoned by then and skips the frees).
        """
        MPI = self._MPI
        try:
            req = self.win.Rget([out, MPI.BYTE], src, target=[disp, out.size, MPI.BYTE])
            deadline = time.monotonic() + timeout_s
            while not req.Test():
                if time.monotonic() > deadline:
                    return False
                time.sleep(1e-4)
            return True
        except MPI.Exception:
            return False

    def flush(self, dst: int | None = None) -> None:
        """Remote completion of this rank's puts to ``dst`` (``None``: to every rank)."""
        MPI = self._MPI
        try:
            if dst is None:
                if self.dirty:
                    self.win.Flush_all()
                    self._flushed(None)
            elif dst in self.dirty:
                self.win.Flush(dst)
                self._flushed(dst)
        except MPI.Exception as exc:
            raise self._fail("flush", "all" if dst is None else dst, exc) from None

    def sync(self) -> None:
        """``MPI_Win_sync`` on the RMA window (acquire side, together with the shared window's)."""
        self.win.Sync()

    def free(self) -> None:
        """Collective: end the epoch and free the RMA window (before the segment's shared window)."""
        self.win.Unlock_all()
        self._flushed(None)
        self.win.Free()


def gather_types(MPI, row_bytes: int, rows: np.ndarray, out_itemsize: int, out_cols: int, out_col_stride: int,
                 out_row_disps: np.ndarray):
    """The two datatypes of one gathering ``Get``: ``(target, origin, keep)`` (commit both; free every one in ``keep``).

    Target: ``rows`` (int32 row numbers) of ``row_bytes`` each. Origin: for each of them a row of ``out_cols``
    elements of ``out_itemsize`` bytes, ``out_col_stride`` bytes apart, starting at byte ``out_row_disps[i]``
    (int64) of the origin buffer: a strided destination (a column-major scale block) is filled directly.
    """
    row = MPI.BYTE.Create_contiguous(row_bytes)
    target = row.Create_indexed_block(1, rows)
    if out_col_stride == out_itemsize:
        orow = MPI.BYTE.Create_contiguous(out_cols * out_itemsize)
    else:
        elem = MPI.BYTE.Create_contiguous(out_itemsize)
        orow = elem.Create_hvector(out_cols, 1, out_col_stride)
        elem.Free()
    origin = orow.Create_hindexed_block(1, out_row_disps)
    return target.Commit(), origin.Commit(), (row, orow)
