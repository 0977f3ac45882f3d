"""The transport (every pair kind) and its UBMEM backend: load/store into peers' MPI-3
shared-memory windows (docs/design/transports.md §3); pairs on different nodes go through
:mod:`transports.urma` (one-sided MPI RMA, docs/design/transports.md §4).

Inside one node every window is an ``MPI_Win_allocate_shared`` segment per rank, mapped by
all ranks of the node; peers read and write it through zero-copy torch / numpy views. With more
than one node the same segment is also exposed world-wide as an RMA window for URMA peers.

Memory ordering (docs/design/transports.md §3.2): a release is "copy data → ``Win.Sync()`` → store the
signal", an acquire is "observe the signal → ``Win.Sync()`` → read". ``Win.Sync`` is a full
memory barrier in MPICH, which also orders the weakly ordered streaming stores that large
``memcpy`` calls use.

Signals (docs/design/transports.md §3.3) are int64 words in per-source slots: ``slot[s][src]`` on a target is written
only by ``src``, with one aligned 8-byte store of a value that only grows, so receivers wait
for "≥ expected" and nothing is ever cleaned.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import itertools
import os
import reprlib
import sys
import threading
import time
import warnings
import weakref

import numpy as np
import torch

from ..settings import LINK_EMULATION, URMA_EXPOSURE
from .base import State, Team, WaitPolicy, allgather_object, quiet_barrier, resolve_timeout
from .errors import (
    SharedMemoryExhausted,
    TransportAborted,
    TransportArgumentError,
    TransportBusy,
    TransportCallMismatch,
    TransportClosed,
    TransportPeerTimeout,
    TransportPoisoned,
    TransportRuntimeError,
    TransportTimeout,
    TransportUnsupported,
)
from .link_model import LinkEmulator, LinkStats, emulator_from_env
from .segment import SHM_DIR, SharedSegment, is_integer
from .topology import ChannelKind, Topology
from .urma import Progress, RmaWindow, allocate_node_shared, gather_types

_CONTROL_ALIGN = 4096
_REASON_BYTES = 256
#: ``get_rows`` moves node peers' rows shorter than this with a load gather and a scatter instead of one
#: indexed MPI read: measured on 2 ranks, 12,288 rows of 8 B take 2.4 ms that way against 13.5 ms, the two
#: are even near 64 B, and at 512 B the MPI read takes half the time (python -m bench engram's shapes).
SMALL_ROW_BYTES = 128
#: Seconds of waiting between two reads of the call tags of the ranks waited for (Transport.set_call_tag): also how
#: soon a wait finds ranks in different calls.
CALL_CHECK_S = 0.01
_ABORT_TIMEOUT = 2  # abort-word value of a rank that gave up waiting (its reason lists the ranks)
#: destroy()'s collective frees run only if every rank arrived at least this long (or half the deadline, if shorter)
#: before the earliest rank's deadline; otherwise every rank abandons the windows (see destroy()).
_LATE_MARGIN_S = 1.0
# Teardown words (destroy(departed=...)): a rank's word on every peer, raised only, never cleared.
_LEAVE_ARRIVED, _LEAVE_ABANDON = 1, 2
_LIVE = weakref.WeakSet()
_SERIALS = itertools.count()
#: How a multi-node window is exposed for URMA: ``"allocate"`` (default: one ``MPI_Win_allocate``
#: window whose same-host segments are mapped with ``MPI_Win_shared_query``) or ``"create"``
#: (node-shared ``MPI_Win_allocate_shared`` segments exposed again with ``MPI_Win_create``, the
#: fallback for MPIs that cannot share ``MPI_Win_allocate`` memory). Read at window creation.


#: How long a node peer must go on waiting for a rank whose program has ended before that rank's exit aborts it: a peer
#: that is only late to see the rank's last signals (descheduled on a busy host) stops waiting within this time.
_EXIT_GRACE_S = 1.0


def _still_waiting_for_this_rank(transports) -> list:
    """``[(transport, peer)]``: the ``transports`` on which a node peer waits for this rank now and still after
    :data:`_EXIT_GRACE_S` (at once ``[]`` if none waits now)."""
    if not any(tp._node_peer_waiting_for_this_rank() is not None for tp in transports):
        return []
    time.sleep(_EXIT_GRACE_S)
    return [(tp, p) for tp in transports if (p := tp._node_peer_waiting_for_this_rank()) is not None]


def _exit_reason(waiting: int) -> str:
    return (f"its program ended (no uncaught exception: the end of the script, or sys.exit) while rank {waiting} "
            f"waited for it in a call")


@atexit.register
def _destroy_forgotten_transports():
    # atexit runs before mpi4py finalizes MPI, so collective frees are still legal here. Newest
    # first, in creation order, which is the same on every rank (creation is collective): a
    # WeakSet's iteration order differs between processes, and mismatched collective frees of two
    # transports hung the job at exit.
    forgotten = sorted(_LIVE, key=lambda t: t._serial, reverse=True)
    # A node peer still waiting for this rank in a call will never see it again: each transport it waits on (whose
    # owner does not mask lost ranks) aborts now, before the teardowns, each of which would first wait for it.
    for tp, waiting in _still_waiting_for_this_rank(
            [tp for tp in forgotten if tp.state is State.OPEN and tp.exit_departed is None]):
        tp.abort(_exit_reason(waiting))
    for tp in forgotten:
        try:
            tp.destroy_at_exit()
        except Exception:
            pass


def _abort_at_uncaught_exception(exc_type, exc, tb) -> None:
    """``sys.excepthook`` in front of the one it replaced (:func:`_install_excepthook`): a program ending with an
    uncaught exception aborts its healthy transports at once, naming the exception, so that peers waiting in a call
    raise ``TransportAborted`` now instead of at the exit teardown's deadline. Not in an interactive session (the
    hook runs there for every failed statement, and the program goes on), and not for a transport whose owner masks
    lost ranks (``exit_departed``: its exit teardown lets the rank leave without aborting anyone)."""
    if not (hasattr(sys, "ps1") or sys.flags.interactive):
        try:
            text = f"{exc_type.__name__}: {exc}"
        except Exception:  # noqa: BLE001 - an exception whose __str__ fails: its class still names it
            text = f"{exc_type.__name__} (its message could not be formatted)"
        for tp in sorted(_LIVE, key=lambda t: t._serial):
            if tp.state is State.OPEN and tp.exit_departed is None:
                tp.abort(f"rank {tp.topology.rank}: the program ended with an uncaught {text}")
    _excepthook["previous"](exc_type, exc, tb)


# the hook _abort_at_uncaught_exception hands the exception on to, and whether it was installed
_excepthook = {"previous": sys.__excepthook__, "installed": False}


def _install_excepthook() -> None:
    """Put :func:`_abort_at_uncaught_exception` in front of the current ``sys.excepthook``, once per process (at the
    first transport's creation): a hook the program set before is kept and still runs, and one it sets later
    that calls the hook it replaced (the usual chaining) still reaches this one, which a second installation would
    make call itself."""
    if not _excepthook["installed"]:
        _excepthook["previous"], _excepthook["installed"] = sys.excepthook, True
        sys.excepthook = _abort_at_uncaught_exception


class SymmetricWindow:
    """A window of the same size on every rank: ``[control | data]`` per rank.

    Control region (int64 words): abort flags ``[world]``, abort reasons ``[world, 256 B]``,
    barrier slots ``[len(Team), world]``, waiting-for flags ``[world]`` (the ranks this rank is
    blocked on, published for its node peers' timeout diagnostics), teardown words ``[world]``
    (``destroy(departed=...)``: 1 = that rank is in destroy, 2 = it abandons the windows), signal
    slots ``[num_slots, world]``, padded to 4 KiB.
    API offsets are offsets into the data region. Create with :meth:`Transport.create_window`.

    Each rank's segment is node-shared (UBMEM peers map it); with more than one node it is also
    an RMA window over the world (``_rma``, a :class:`~transports.urma.RmaWindow`) whose byte
    displacements are offsets into the segment: control word ``w`` at ``8 * w``, data byte ``o``
    at ``control_bytes + o``. That window is one ``MPI_Win_allocate`` over the world whose node
    peers' segments are mapped with ``MPI_Win_shared_query`` (same-host RMA is then a direct
    copy, see :func:`~transports.urma.allocate_node_shared`); ``$DEEPEP_ASCEND_URMA_EXPOSURE=create``
    (or an MPI that cannot share that memory) uses node-shared segments exposed with ``MPI_Win_create``.

    Attributes:
        name: label used in error messages.
        nbytes: size of the data region in bytes (same on every rank).
        num_slots: number of signal slots.
        force_urma: node peers too are reached over URMA (no load/store views of them), like
            DeepEP's low-latency mode without NVLink; the RMA exposure then exists on one node too.
    """

    def __init__(self, tp: Transport, name: str, nbytes: int, num_slots: int, force_urma: bool = False):

        self.name, self.nbytes, self.num_slots = name, int(nbytes), int(num_slots)
        self.force_urma = bool(force_urma)
        world = tp.topology.world_size
        self._world = world
        (self._abort_off, self._reason_off, self._barrier_off, self._waitfor_off, self._leave_off, self._call_off,
         self._slot_off, ctl_words) = self._control_layout(world, self.num_slots)
        self.control_bytes = self._padded_control(ctl_words)
        topo = tp.topology
        total = self.mapped_bytes = self.control_bytes + self.nbytes
        self._rma = None
        self._rma_is_win = False  # the RMA window is self._win itself (MPI_Win_allocate exposure)
        # World rank -> mpi4py buffer of its whole segment (node peers only).
        self._bufs = {}
        allocated = None
        rma = topo.num_nodes > 1 or self.force_urma
        if rma and URMA_EXPOSURE.get() == "allocate":
            allocated = allocate_node_shared(total, tp.comm, list(topo.node_ranks()), topo.rank, name)
        if allocated is not None:  # one MPI_Win_allocate window serves both UBMEM views and URMA
            self._win, self._bufs = allocated
            self._locked = True
            self._rma = RmaWindow(None, tp.comm, topo.rank, name, win=self._win)
            self._rma_is_win = True
        else:
            self._create_shared(tp, name, total)
        if rma and self._rma is None:
            own, _ = self._win.Shared_query(topo.local_rank)
            # Zero our control words before any peer can reach them over RMA.
            np.frombuffer(own, dtype=np.int64, count=self.control_bytes // 8)[:] = 0
            try:
                self._rma = RmaWindow(own, tp.comm, topo.rank, name)
            except BaseException:
                del own
                self._win.Unlock_all()
                self._win.Free()
                raise
            del own
        if not self._bufs:
            for p in topo.node_ranks():
                self._bufs[p], _ = self._win.Shared_query(topo.local_rank_of(p))
        # Control words are read through numpy/memoryview slices that error tracebacks may keep
        # alive; they belong to the baseline, so only data views count as "live" at destroy.
        self._ctl = {p: np.frombuffer(b, dtype=np.int64, count=ctl_words) for p, b in self._bufs.items()}
        self._ctl[topo.rank][:] = 0
        self._ctl_mv = memoryview(self._ctl[topo.rank]).cast("B").cast("q")
        self._baseline_refs = self._buffer_refs()
        self._make_data_views()
        self.sync()

    @staticmethod
    def _control_layout(world: int, num_slots: int) -> tuple:
        """Word offsets of the control region's parts (abort flags, reasons, barrier slots, waiting-for flags
        (1 = this rank waits for it), teardown words (see Transport.destroy), this rank's call tag (see
        Transport.set_call_tag), signal slots) and its words."""
        reason = world
        barrier = reason + world * (_REASON_BYTES // 8)
        waitfor = barrier + len(Team) * world
        leave = waitfor + world
        call = leave + world
        slot = call + 1
        return 0, reason, barrier, waitfor, leave, call, slot, slot + num_slots * world

    @staticmethod
    def total_bytes(nbytes: int, num_slots: int, world: int) -> int:
        """Bytes of one rank's segment of a window of ``nbytes`` data bytes and ``num_slots`` slots over ``world``
        ranks: its control region, padded, then the data."""
        return SymmetricWindow._padded_control(SymmetricWindow._control_layout(world, num_slots)[-1]) + int(nbytes)

    @staticmethod
    def _padded_control(words: int) -> int:
        """Bytes of a control region of ``words`` int64 words, padded to :data:`_CONTROL_ALIGN` (the transports read
        no module of the library but its settings, deepep_ascend.rounding included)."""
        return -(-words * 8 // _CONTROL_ALIGN) * _CONTROL_ALIGN

    def _create_shared(self, tp, name: str, total: int) -> None:
        """The node-shared segment of every rank: ``MPI_Win_allocate_shared`` over the node."""
        from mpi4py import MPI

        info = MPI.Info.Create()
        info.Set("alloc_shared_noncontig", "true")
        try:
            self._win = MPI.Win.Allocate_shared(total, 1, info=info, comm=tp.node_comm)
        except MPI.Exception as exc:
            raise TransportRuntimeError(
                f"rank {tp.topology.rank}: Allocate_shared of window '{name}' ({total} B) failed: "
                f"{exc.Get_error_string()}") from None
        finally:
            info.Free()
        self._win.Lock_all(MPI.MODE_NOCHECK)
        self._locked = True

    def _make_data_views(self) -> None:
        self._data = {p: torch.frombuffer(b, dtype=torch.uint8, count=self.nbytes, offset=self.control_bytes)
                      if self.nbytes else torch.empty(0, dtype=torch.uint8) for p, b in self._bufs.items()}
        self._typed = {}  # (peer, dtype) -> its whole data region viewed as dtype (whole elements), see typed()

    def typed(self, peer: int, dtype: torch.dtype) -> torch.Tensor:
        """``peer``'s data region as ``dtype`` (its whole elements), made once: a view of it is then one slice.

        Made with ``torch.inference_mode`` off, even under it: a view made in that mode (and every view of it)
        may not be written in place outside it, and this one serves every later call."""
        t = self._typed.get((peer, dtype))
        if t is None:
            with torch.inference_mode(False):
                d = self._data[peer]
                t = self._typed[(peer, dtype)] = d[:d.numel() - d.numel() % dtype.itemsize].view(dtype)
        return t

    # -- views ---------------------------------------------------------------
    def sync(self) -> None:
        """``MPI_Win_sync``: a full memory barrier for this window's shared memory."""
        self._win.Sync()

    def signals(self, slot: int) -> np.ndarray:
        """This rank's signal words of ``slot``, ``[world]`` int64 (entry ``src`` written only by ``src``)."""
        base = self._slot_off + slot * self._world
        return self._ctl[self._rank_self][base:base + self._world].copy()

    def slot_disp(self, slot: int, src: int) -> int:
        """RMA byte displacement of signal word ``slot[slot][src]``."""
        return 8 * (self._slot_off + slot * self._world + src)

    def acquire(self) -> None:
        """Acquire fence after observing a signal: ``Win.Sync`` on the shared and the RMA window."""
        if self._rma is not None:
            self._rma.sync()
        self._win.Sync()

    def _release_views(self) -> None:
        self._data.clear()
        self._typed.clear()

    def _live_view_count(self) -> int:
        """Storages still referencing the segments (data views held outside this object)."""
        return sum(now - base for now, base in zip(self._buffer_refs(), self._baseline_refs))

    def _buffer_refs(self) -> list:
        # Each torch/numpy view holds one reference to the buffer it was made from; compared with
        # the count taken by this same code before any view existed, the excess is the live views.
        return [sys.getrefcount(b) for b in self._bufs.values()]


_MAX_BYTE = 2 ** 62  # byte offsets and counts stay below it: their sums fit an int64


def _shared_memory_state() -> tuple:
    """``(host, free bytes of /dev/shm or None, bytes of every window this process has mapped)``: what a rank tells
    its peers before shared memory is added (``Transport._refuse_past_free``). Hosts are told apart by
    ``MPI_Get_processor_name`` (the simulated nodes of a host share it); one without ``/dev/shm`` is not checked."""
    from mpi4py import MPI

    try:
        st = os.statvfs(SHM_DIR)
        free = st.f_bavail * st.f_frsize
    except OSError:
        free = None
    return MPI.Get_processor_name(), free, sum(w.mapped_bytes for tp in list(_LIVE) for w in tp._windows)


def _amount(nbytes: int) -> str:
    """``nbytes`` exactly and in the unit that reads best: ``"29,825,152 B (29.8 MB)"``."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes:,} B ({nbytes / scale:.1f} {unit})"
    return f"{nbytes:,} B"


def _byte_counts(where: str, name: str, values) -> np.ndarray:
    """``values`` (a sequence, numpy array or CPU tensor of ints) as a 1-D int64 array, checked in one pass:
    integers in ``[0, 2**62)``. Raises ``TransportArgumentError`` naming ``name`` otherwise (floats, bools,
    strings, other shapes)."""
    if isinstance(values, torch.Tensor):
        values = values.numpy() if values.device.type == "cpu" else values
    try:
        a = np.asarray(values)
    except (TypeError, ValueError, OverflowError):
        a = None
    if a is not None and a.size == 0 and a.ndim == 1:
        return np.zeros(0, dtype=np.int64)
    if a is None or a.ndim != 1 or a.dtype.kind not in "iu":
        raise TransportArgumentError(f"{where}: {name} must be a 1-D sequence of ints, got {reprlib.repr(values)}")
    out_of_range = (a < 0) | (a >= _MAX_BYTE)
    if out_of_range.any():
        raise TransportArgumentError(f"{where}: {name} must hold ints in [0, 2**62), got "
                                     f"{int(a[np.flatnonzero(out_of_range)[0]])}")
    return a.astype(np.int64, copy=False)


def _copy_blocks(region: torch.Tensor, data: torch.Tensor, src_off, dst_off, n) -> None:
    """``region[dst_off[i]:+n[i]] = data[src_off[i]:+n[i]]`` (uint8 1-D tensors, checked blocks). Blocks of one
    size at offsets that are multiples of it (the engines' rows) move as one row gather-scatter over the widest
    integer type dividing them (torch's index copies go element by element); others one copy each."""
    size = int(n[0])
    if (n == size).all() and not (src_off % size).any() and not (dst_off % size).any():
        w = next(w for w in (8, 4, 2, 1) if size % w == 0 and region.data_ptr() % w == 0 and data.data_ptr() % w == 0)
        dtype = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[w]
        dst_rows = region[:region.numel() // size * size].view(dtype).view(-1, size // w)
        src_rows = data[:data.numel() // size * size].view(dtype).view(-1, size // w)
        picked = src_rows.index_select(0, torch.from_numpy(src_off // size))
        dst_rows.index_copy_(0, torch.from_numpy(dst_off // size), picked)
        return
    for a, b, c in zip(src_off.tolist(), dst_off.tolist(), n.tolist()):
        region[b:b + c].copy_(data[a:a + c])


class Transport:
    """Transport for every pair kind: SELF, UBMEM (same node, load/store) and URMA (other node, RMA).

    Implements the contract of docs/design/transports.md §2.2: ``put``, ``get``, ``signal``,
    ``put_with_signal``, ``wait_until``, ``fence``, ``flush``, ``barrier``, ``progress``,
    ``abort`` and ``destroy``, for any pair; plus zero-copy ``peer_view`` for load/store data
    paths inside a node (a URMA peer raises :class:`~transports.errors.TransportUnsupported`).
    ``UbmemTransport`` is the same class (its name before the URMA backend existed).

    Args:
        comm: mpi4py intracommunicator (all ranks call collectively).
        ranks_per_node: simulated node size (see :meth:`Topology.from_comm`).
        timeout_s: default deadline of blocking ops (argument, ``$DEEPEP_ASCEND_TIMEOUT_S``, 100 s).
    Raises:
        TransportConfigError: on every rank, when the topology is invalid (or, with more than one
            node, MPI's RMA windows lack the unified memory model).
    """

    def __init__(self, comm, ranks_per_node: int | None = None, timeout_s: float | None = None):
        self.timeout_s = resolve_timeout(timeout_s)
        self._at_exit = False  # destroy_at_exit sets it: a timeout's abort then says the program ended
        emulator = emulator_from_env()  # None unless $DEEPEP_ASCEND_LINK_EMULATION asks (checked before any MPI call)
        # ranks arrive unevenly; the blocking collectives below would spin meanwhile
        quiet_barrier(comm, timeout_s=self.timeout_s, phase="creating a transport (every rank of the group)")
        self.comm = comm.Dup()
        try:
            self.topology = Topology.from_comm(self.comm, ranks_per_node)
        except BaseException:
            self.comm.Free()
            raise
        topo = self.topology
        self.node_comm = self.comm.Split(color=topo.node, key=topo.rank)
        self._progress = Progress(self.comm)
        # allgather_object's own communicator: a call that timed out leaves its request pending, and on
        # self.comm destroy()'s Iallreduce would then be matched against it
        self._gather_comm = self.comm.Dup()
        self.stats = LinkStats(topo.world_size)
        self.stats.emulator = emulator
        if emulator is not None and topo.rank == 0:  # results of this run are not plain measurements: say so once
            warnings.warn(f"${LINK_EMULATION.name}: {emulator.label}", RuntimeWarning, stacklevel=3)
        from mpi4py import MPI
        shared = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=topo.rank)
        self.wait_policy = WaitPolicy(local_ranks=shared.Get_size())
        shared.Free()
        self.state = State.OPEN
        self._windows = []
        self._shadow = {}  # (window id, slot, dst) -> last value stored
        self._barrier_gen = [0] * len(Team)
        self._poison_reason = ""
        self._aborted = False
        self._forced_urma = False  # some window reaches node peers over URMA (waits drive progress)
        self._internal = None
        self.abandoned = False  # destroy() left the windows to the process's exit instead of freeing them
        # None, or a callable giving the departed ranks (a list) for the teardown at process exit of a
        # transport nobody destroyed (see destroy(departed=...)); set by owners that mask lost ranks.
        self.exit_departed = None
        self._leave_sent = {}  # peer -> teardown word last written there
        self.call_names = {}  # (kind, op) -> name, for the message of a TransportCallMismatch (set_call_tag)
        self._thread_tag = threading.local()  # .word: the call tag this thread's waits belong to (adopt_call_tag)
        self._tag_reads = {}  # other node's rank -> (Rget request, int64[1]): its call tag being read
        self._tag_lock = threading.Lock()  # _tag_reads: the caller's and a worker's waits may both read
        try:
            self._internal = self.create_window("barrier", 0, 0)
        except BaseException:  # e.g. no unified memory model: free what was built, on every rank
            self._progress.free()
            self._gather_comm.Free()
            self.node_comm.Free()
            self.comm.Free()
            self.state = State.CLOSED
            raise
        self._urma_peers = [p for p in range(topo.world_size) if topo.kind(topo.rank, p) is ChannelKind.URMA]
        self._serial = next(_SERIALS)
        _LIVE.add(self)
        _install_excepthook()

    # -- lifetime --------------------------------------------------------------
    def _check_open(self, op: str) -> None:
        if self.state is State.OPEN:
            return
        if self.state is State.CLOSED:
            raise TransportClosed(f"rank {self.topology.rank}: {op} called after destroy()")
        raise TransportPoisoned(f"rank {self.topology.rank}: {op} refused: the transport failed earlier "
                                f"({self._poison_reason}); destroy it and build a new one")

    def _poison(self, reason: str) -> None:
        if self.state is State.OPEN:
            self.state = State.POISONED
            self._poison_reason = reason

    def create_window(self, name: str, nbytes: int, num_slots: int, force_urma: bool = False) -> SymmetricWindow:
        """Collectively allocate a window with ``nbytes`` of data and ``num_slots`` signal slots.

        ``force_urma``: puts, gets and signals to node peers on this window go over URMA too (and
        are counted so); load/store views of node peers are refused (docs/design/transports.md §2.1).
        Raises:
            TransportArgumentError: sizes negative or different between ranks (on every rank).
        """
        self._check_open("create_window")
        ok = all(is_integer(v) and v >= 0 for v in (nbytes, num_slots))
        mine = (int(nbytes), int(num_slots), bool(force_urma)) if ok else None
        # decided together, in one collective: a bad value on one rank fails all, and so does a host without room
        gathered = self.comm.allgather((mine, _shared_memory_state()))
        everyone = [args for args, _ in gathered]
        if any(v is None for v in everyone) or len(set(everyone)) != 1:
            raise TransportArgumentError(
                f"rank {self.topology.rank}: create_window('{name}'): (nbytes, num_slots, force_urma) must be the same "
                f"non-negative ints on every rank; got (rank i at index i) "
                f"{[v if v is not None else 'invalid' for v in everyone]}")
        total = SymmetricWindow.total_bytes(nbytes, num_slots, self.topology.world_size)
        self._refuse_past_free(f"create_window('{name}')", [(total, state) for _, state in gathered])
        win = SymmetricWindow(self, name, nbytes, num_slots, force_urma=force_urma)
        if win.force_urma:
            self._forced_urma = True  # waits drive MPI progress from now on
        win._rank_self = self.topology.rank
        self._windows.append(win)
        # Every control region is zeroed before anyone signals; URMA peers signal from other nodes.
        (self.comm if win._rma is not None else self.node_comm).Barrier()
        return win

    def _refuse_past_free(self, what: str, gathered: list, reserved: bool = False) -> None:
        """Raise :class:`SharedMemoryExhausted` (every rank of the collective that gathered ``gathered``, before
        anything is allocated) when, summed over the ranks of a host, the new memory and the windows mapped there
        already exceed the free space of its ``/dev/shm``. ``gathered``: per rank, ``(new bytes,
        _shared_memory_state())``; ``what`` names the call.

        MPI maps window segments from files there without reserving their pages: the allocation succeeds and the
        first store past the free space kills the process with SIGBUS. Shared segments reserve theirs, so a
        segment that takes the space a window's pages still need is that same SIGBUS later. Every mapped window
        counts whole, touched or not (docs/design/transports.md §3.5). ``reserved``: the new memory reserves its
        pages (a segment), so when it alone exceeds the free space its own reservation fails, with its own
        message, and only the windows' share is checked here."""
        hosts: dict = {}
        for new, (host, free, mapped) in gathered:
            ranks, least, news, olds = hosts.get(host, (0, None, 0, 0))
            if free is not None:
                least = free if least is None else min(least, free)
            hosts[host] = (ranks + 1, least, news + new, olds + mapped)
        for host, (ranks, least, news, olds) in hosts.items():
            if least is not None and news + olds > least and not (reserved and news > least):
                raise SharedMemoryExhausted(
                    f"rank {self.topology.rank}: {what}: its {ranks} ranks on host {host} would map {_amount(news)} "
                    f"of shared memory beside the {_amount(olds)} of windows mapped there already, more than the "
                    f"{_amount(least)} free in {SHM_DIR} (a store past it would kill the process with SIGBUS); ask "
                    f"for fewer bytes (the buffer's size arguments), use fewer ranks per host, or enlarge {SHM_DIR}")

    def create_segment(self, name: str, nbytes: int) -> SharedSegment:
        """Collectively (over the node) map a :class:`~transports.segment.SharedSegment` of ``nbytes``
        on this rank (0: none; sizes may differ between ranks) and every node peer's.

        Unlike a window it is not freed by :meth:`destroy`: tensors made from it stay valid until
        they are dropped. No signal slots; pair it with a window for ordering (a signal's release
        fence orders stores to any memory).
        Raises:
            TransportArgumentError: ``nbytes`` is not a non-negative int on some rank of the node, and
                every failing rank failed so (on every rank).
            TransportRuntimeError: some rank of the node could not create or map its segment (on every
                rank; also when other ranks had a bad ``nbytes``). No file is left unless a process dies
                between creating and unlinking it.
        """
        self._check_open("create_segment")
        new = int(nbytes) if is_integer(nbytes) and nbytes > 0 else 0  # (a bad nbytes: SharedSegment refuses it)
        self._refuse_past_free(f"create_segment('{name}')", self.node_comm.allgather((new, _shared_memory_state())),
                               reserved=True)
        return SharedSegment(self, name, nbytes)

    def destroy_at_exit(self) -> None:
        """The teardown the process's exit gives a transport nobody destroyed: :meth:`destroy` with
        ``force`` and a 5 s deadline; with :attr:`exit_departed` set (an owner that masks lost ranks),
        the tolerant teardown with its departed ranks, so a rank that leaves without ``destroy()``
        never aborts the ranks that masked it.

        Raises:
            as :meth:`destroy`.
        """
        departed = self.exit_departed() if self.exit_departed is not None else None
        self._at_exit = True
        self.destroy(force=True, timeout_s=5.0, departed=departed)

    def destroy(self, force: bool = False, timeout_s: float | None = None, departed=None) -> None:
        """Collectively free every window and communicator; idempotent.

        Args:
            force: skip the live-view check (views then dangle; use only at exit).
            timeout_s: deadline of the closing barrier; if a peer never arrives, collective
                frees are skipped (the mappings die with the process) and the timeout is raised. If the last
                rank arrives within 1 s (or half the deadline) of the earliest rank's deadline, every rank skips
                them too (``abandoned``; nothing raised): a rank may have given up meanwhile
                (docs/design/transports.md §2.4).
            departed: ``None``: the teardown above. A sequence of ranks (possibly empty): the
                teardown that tolerates lost ranks (docs/design/transports.md §2.4). The windows are
                freed only if every rank reaches destroy, none lists a departed rank, and all meet
                within the deadline; otherwise every rank abandons them (``abandoned`` is set: no
                collective free, the memory stays mapped until the process exits) without waiting for
                the listed ranks, raising, or aborting any peer.
        Raises:
            TransportBusy: some rank still holds tensor views of window memory (on every rank;
                the transport stays usable).
            TransportTimeout: a peer did not reach destroy (not with ``departed``).
        """
        if self.state is State.CLOSED:
            return
        from mpi4py import MPI
        poisoned = self.state is State.POISONED
        if not poisoned:
            try:  # our URMA puts complete before peers free their windows (a poisoned peer may be gone)
                self._flush_rma(None)
            except TransportRuntimeError as exc:
                self._poison(str(exc))
                poisoned = True
        if not poisoned and not self._finish_tag_reads(self.timeout_s if timeout_s is None else timeout_s):
            self._poison("a read of a peer's call tag did not complete before destroy()")
            poisoned = True
        for win in self._windows:
            win._release_views()
        tolerant = departed is not None
        if tolerant and not self._meet_for_teardown(departed, poisoned, timeout_s):
            return
        busy = 0
        if not force:
            busy = sum(w._live_view_count() for w in self._windows)
            if busy:  # reference cycles may hold views that are already unreachable
                gc.collect()
                busy = sum(w._live_view_count() for w in self._windows)
        # One collective decision: refuse if any rank has live views; skip collective frees if any rank is poisoned
        # (a peer may be gone, and a partial Free would hang the others), or if the last rank to arrive came within
        # _LATE_MARGIN_S of another's deadline: that rank may have given up meanwhile, and a rank that gave up leaves
        # its contribution behind, which a late peer's reduction still completes with. Every rank that completes
        # decides from the same reduced words (the ranks' wall-clock arrival times and deadlines, microseconds).
        limit = resolve_timeout(timeout_s) if timeout_s is not None else self.timeout_s
        arrived = time.time()
        flags = np.array([busy, int(poisoned), int(arrived * 1e6), -int((arrived + limit) * 1e6)], dtype=np.int64)
        total = np.zeros(4, dtype=np.int64)
        deadline = time.monotonic() + limit
        req = self.comm.Iallreduce(flags, total, op=MPI.MAX)
        pauses = self.wait_policy.pauses()
        next_look, waited_since = 0.0, None
        while not req.Test():  # Test drives MPI progress, so peers' URMA traffic keeps landing
            if self._at_exit and not tolerant and time.monotonic() >= next_look:
                next_look = time.monotonic() + CALL_CHECK_S
                waiting = self._node_peer_waiting_for_this_rank()
                waited_since = None if waiting is None else waited_since or time.monotonic()
                if waiting is not None and time.monotonic() - waited_since >= _EXIT_GRACE_S:
                    # that peer is in a call this rank will never make (not merely late to see its last signals)
                    self.abort(_exit_reason(waiting))
                    self._abandon()
                    return
            if time.monotonic() > deadline and not req.Test():
                if tolerant:  # every rank met in _meet_for_teardown: one stalled since; leave it be
                    warnings.warn(f"rank {self.topology.rank}: destroy(): a peer stalled after every rank had "
                                  f"arrived; the windows are abandoned", RuntimeWarning, stacklevel=2)
                    self._mark_leave(_LEAVE_ABANDON)
                    self._abandon()
                    return
                # A peer that comes later must not free collectively against our abandoned request.
                at_exit = self._at_exit
                self.abort("its program ended without destroying this transport, and the peers did not reach the "
                           "teardown at exit (a rank raised or exited while others were in a call?)" if at_exit else
                           "gave up waiting for the peers in destroy()")
                self.state = State.CLOSED
                _LIVE.discard(self)
                others = [p for p in range(self.topology.world_size) if p != self.topology.rank]
                raise TransportTimeout("destroy", self.topology.rank, others,
                                       time.monotonic() - deadline
                                       + (self.timeout_s if timeout_s is None else timeout_s),
                                       phase="one of these ranks never called destroy() (an MPI collective does not "
                                             "say which)" + (", at exit" if at_exit else ""))
            time.sleep(next(pauses))
        if total[0] > 0:
            self._restore_views()
            raise TransportBusy(
                f"rank {self.topology.rank}: destroy refused: tensor views of window memory are still alive "
                f"({busy} on this rank; windows {[w.name for w in self._windows]}); drop them (e.g. results of "
                f"get_local_buffer_tensor) and call destroy() again, or pass force=True at exit")
        late = total[2] > -total[3] - 1e6 * min(_LATE_MARGIN_S, limit / 2)
        if total[1] or late or self._internal._ctl[self.topology.rank][:self.topology.world_size].any():
            # Some rank is poisoned, gave up or may have: a collective free could wait for a peer that is gone.
            self._abandon()
            return
        for win in reversed(self._windows):
            if win._rma is not None and not win._rma_is_win:  # the world exposure first: it maps the segment
                win._rma.free()
            win._rma = None
            if win._locked:
                win._win.Unlock_all()
            win._ctl_mv.release()
            win._ctl.clear()
            win._bufs.clear()
            win._win.Free()
        self._windows.clear()
        self._progress.free()
        self._gather_comm.Free()
        self.node_comm.Free()
        self.comm.Free()
        self.state = State.CLOSED
        _LIVE.discard(self)

    def _node_peer_waiting_for_this_rank(self) -> int | None:
        """A rank of this node whose published waiting-for flags (:meth:`_publish_waitfor`) include this rank: it
        waits for this rank in a call, or did when it timed out; None if none does. (Ranks of other nodes are not
        read: an RMA read of a rank that may be gone could block.)"""
        internal, me = self._internal, self.topology.rank
        off = internal._waitfor_off + me
        return next((p for p, ctl in sorted(internal._ctl.items()) if p != me and ctl[off]), None)

    def _abandon(self) -> None:
        """Close without collective frees: windows and communicators stay allocated (peers' views of
        this rank's memory stay valid) until the process exits."""
        self.state = State.CLOSED
        self.abandoned = True
        _LIVE.discard(self)

    def _mark_leave(self, value: int, skip=()) -> None:
        """Raise this rank's teardown word on every peer to ``value``: a store for node peers, an
        ``Accumulate`` for the others except ``skip`` (ranks that may be gone: an RMA call to them
        could wait for an acknowledgement that never comes). Never raises."""
        win, me = self._internal, self.topology.rank
        remote = []
        for p in range(self.topology.world_size):
            if p == me or self._leave_sent.get(p, 0) >= value:
                continue
            ctl = win._ctl.get(p)
            if ctl is not None:
                ctl[win._leave_off + me] = value
                self._leave_sent[p] = value
            elif p not in skip:
                remote.append(p)
        win.sync()
        for p in remote:  # one by one: the word on each may hold a different value
            try:
                win._rma.accumulate_many([p], [8 * (win._leave_off + me)], [value - self._leave_sent.get(p, 0)],
                                         ordered=False)
                self._leave_sent[p] = value
            except Exception:  # noqa: BLE001 - never raises: that peer abandons at its own deadline
                pass

    def _meet_for_teardown(self, departed, poisoned: bool, timeout_s) -> bool:
        """The first step of ``destroy(departed=...)``: True if every rank reached destroy and none
        abandons (then the collective frees follow), False if this rank abandoned the windows.

        A rank that lists a departed peer, is poisoned, or was told of an abort abandons at once and
        says so on every peer; otherwise it says it arrived and waits (deadline) until every peer
        arrived or one abandons. A rank that sees every peer arrive goes on to the collective step,
        which cannot complete on a rank unless every rank entered it: a rank that abandoned after
        another saw all arrive never enters it, and that rank then abandons at the step's deadline."""
        me, world = self.topology.rank, self.topology.world_size
        win = self._internal
        gone = sorted({int(p) for p in departed} - {me})
        if poisoned or gone or win._ctl[me][:world].any():
            self._mark_leave(_LEAVE_ABANDON, skip=gone)
            self._abandon()
            return False
        self._mark_leave(_LEAVE_ARRIVED)
        words = win._ctl[me][win._leave_off:win._leave_off + world]
        others = np.asarray([p for p in range(world) if p != me], dtype=np.int64)
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else resolve_timeout(timeout_s))
        poke = self._progress.poke if (self._urma_peers or self._forced_urma) else None
        for pause in self.wait_policy.pauses():
            last = time.monotonic() > deadline  # one more look after the deadline
            if (words == _LEAVE_ABANDON).any():
                break
            if bool(np.all(words[others] >= _LEAVE_ARRIVED)):
                win.acquire()
                return True
            if last:
                break
            if poke is not None:
                poke()
            if pause > 0:
                time.sleep(pause)
        self._mark_leave(_LEAVE_ABANDON)
        self._abandon()
        return False

    def _restore_views(self) -> None:
        for win in self._windows:
            win._make_data_views()

    # -- argument checks ----------------------------------------------------------
    def channel_kind(self, win: SymmetricWindow, peer: int) -> ChannelKind:
        """The channel this rank's operations on ``win`` use to reach ``peer``: the topology's
        (SELF / UBMEM / URMA), except that a ``force_urma`` window reaches node peers over URMA."""
        kind = self.topology.kind(self.topology.rank, int(peer))
        return ChannelKind.URMA if kind is ChannelKind.UBMEM and win.force_urma else kind

    def _peer(self, op: str, win: SymmetricWindow, peer: int, views: bool = False) -> ChannelKind:
        """Validate ``peer``; its channel kind. ``views``: load/store access needed (no URMA)."""
        if (not isinstance(peer, (int, np.integer)) or isinstance(peer, bool)
                or not 0 <= peer < self.topology.world_size):
            raise TransportArgumentError(
                f"rank {self.topology.rank}: {op}(win='{win.name}'): peer rank {peer!r} outside "
                f"[0, {self.topology.world_size}) or not an int")
        kind = self.channel_kind(win, int(peer))
        if views and kind is ChannelKind.URMA:
            where = "is reached over URMA only (force_urma window)" if win.force_urma else "is on another node (URMA)"
            raise TransportUnsupported(
                f"rank {self.topology.rank}: {op}(win='{win.name}'): rank {peer} {where}; "
                f"load/store views reach only ranks of node {self.topology.node}: use put/get")
        return kind

    def _range(self, op: str, win: SymmetricWindow, peer: int, offset: int, nbytes: int) -> None:
        if (not isinstance(offset, (int, np.integer)) or isinstance(offset, bool) or offset < 0 or nbytes < 0
                or offset + nbytes > win.nbytes):
            raise TransportArgumentError(
                f"rank {self.topology.rank}: {op}(win='{win.name}', peer {peer}): byte range "
                f"[{offset}, {offset}+{nbytes}) outside the data region of {win.nbytes} B")

    def _slot(self, op: str, win: SymmetricWindow, slot: int) -> None:
        if not isinstance(slot, (int, np.integer)) or isinstance(slot, bool) or not 0 <= slot < win.num_slots:
            raise TransportArgumentError(
                f"rank {self.topology.rank}: {op}(win='{win.name}'): signal slot {slot!r} outside "
                f"[0, {win.num_slots}) or not an int")

    def _add(self, op: str, win: SymmetricWindow, add) -> None:
        if not isinstance(add, (int, np.integer)) or isinstance(add, bool) or add < 0 or add >= 2 ** 62:
            raise TransportArgumentError(f"rank {self.topology.rank}: {op}(win='{win.name}'): add={add!r} must "
                                         f"be a non-negative int below 2**62 (signals only grow)")

    def _grown(self, op: str, win: SymmetricWindow, slot: int, dst: int, add: int) -> int:
        """The value this rank's word of ``slot`` at ``dst`` reads after adding ``add`` (checked by :meth:`_add`),
        refused past int64 before anything moves (a word that wrapped would read smaller: signals only grow)."""
        value = self._shadow.get((id(win), slot, int(dst)), 0) + int(add)
        if value >= 2 ** 63:
            raise TransportArgumentError(f"rank {self.topology.rank}: {op}(win='{win.name}'): rank {int(dst)}'s word "
                                         f"of slot {slot} would pass int64 ({value}): signals only grow")
        return value

    def _distinct(self, op: str, win: SymmetricWindow, dsts: list) -> None:
        if len(set(dsts)) != len(dsts):
            raise TransportArgumentError(f"rank {self.topology.rank}: {op}(win='{win.name}'): a rank may appear once "
                                         f"in dsts (its adds summed into one), got {sorted(dsts)}")

    def _apart(self, op: str, win: SymmetricWindow, dst: int, data: torch.Tensor, offsets, nbytes) -> None:
        """Refuse a load/store copy whose source bytes overlap a destination range ``[offsets, offsets + nbytes)``
        of ``dst``'s data region (torch refuses such a copy with its own error, or copies garbage)."""
        base = win._data[int(dst)].data_ptr()
        lo, hi = data.data_ptr(), data.data_ptr() + data.numel()
        if len(offsets) == 1:  # put: plain ints
            overlap = base + offsets[0] < hi and base + offsets[0] + nbytes[0] > lo
        else:
            starts = np.asarray(offsets, dtype=np.int64) + base
            overlap = bool(((starts < hi) & (starts + np.asarray(nbytes, dtype=np.int64) > lo)).any())
        if overlap:
            raise TransportArgumentError(f"rank {self.topology.rank}: {op}(win='{win.name}', peer {dst}): src "
                                         f"overlaps the bytes it is copied to")

    @staticmethod
    def _as_bytes(op: str, rank: int, t: torch.Tensor, what: str) -> torch.Tensor:
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or not t.is_contiguous():
            raise TransportArgumentError(
                f"rank {rank}: {op}: {what} must be a contiguous CPU torch.Tensor, got "
                f"{type(t).__name__}"
                f"{'' if not isinstance(t, torch.Tensor) else f' (device {t.device}, contiguous={t.is_contiguous()})'}")
        # contiguous: the elements lie in order one apart (a size-1 dimension may carry any stride, which
        # reshape keeps and the byte view refuses), so the flat view has stride 1
        return t.as_strided((t.numel(),), (1,)).view(torch.uint8)

    # -- data ----------------------------------------------------------------
    def peer_view(self, win: SymmetricWindow, peer: int, offset: int, nbytes: int,
                  dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """Zero-copy 1-D view of ``nbytes`` of ``peer``'s data region from byte ``offset``.

        Loads and stores through it are not counted; use :meth:`record_fetch` / :meth:`record_put`. Made with
        ``torch.inference_mode`` off (see :meth:`SymmetricWindow.typed`), so a caller may keep it across calls.
        Raises:
            TransportUnsupported: ``peer`` is on another node.
            TransportArgumentError: bad peer, range, or ``nbytes`` not a multiple of the dtype size.
        """
        self._check_open("peer_view")
        self._peer("peer_view", win, peer, views=True)
        self._range("peer_view", win, peer, offset, nbytes)
        itemsize = dtype.itemsize
        if nbytes % itemsize or offset % itemsize:
            raise TransportArgumentError(
                f"rank {self.topology.rank}: peer_view(win='{win.name}', peer {peer}): offset {offset} and "
                f"nbytes {nbytes} must be multiples of {dtype}'s size {itemsize}")
        with torch.inference_mode(False) if torch.is_inference_mode_enabled() else contextlib.nullcontext():
            return win.typed(int(peer), dtype)[offset // itemsize:(offset + nbytes) // itemsize]

    def local_view(self, win: SymmetricWindow, offset: int, nbytes: int,
                   dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """Zero-copy view of this rank's own data region (see :meth:`peer_view`)."""
        return self.peer_view(win, self.topology.rank, offset, nbytes, dtype)

    def _stats_peer(self, op: str, peer) -> int:
        """``peer`` as a rank of the world, for the traffic counters (:meth:`record_put` and its kin)."""
        if not isinstance(peer, (int, np.integer)) or isinstance(peer, bool) \
                or not 0 <= peer < self.topology.world_size:
            raise TransportArgumentError(f"rank {self.topology.rank}: {op}: peer rank {peer!r} outside "
                                         f"[0, {self.topology.world_size})")
        return int(peer)

    def record_put(self, peer: int, nbytes: int) -> None:
        """Count ``nbytes`` stored through a view into ``peer``'s window.

        Raises:
            TransportArgumentError: ``peer`` not a rank of the world.
        """
        peer = self._stats_peer("record_put", peer)
        self.stats.record_put(self.topology.kind(self.topology.rank, peer), peer, nbytes)

    def set_link_emulator(self, emulator: LinkEmulator | None) -> None:
        """Emulate slower links from now on (see :class:`~transports.link_model.LinkEmulator`), or stop (``None``).

        Local: each rank sets its own; give every rank the same profile and scale.
        """
        if emulator is not None and not isinstance(emulator, LinkEmulator):
            raise TypeError(f"set_link_emulator: expected a LinkEmulator or None, got {type(emulator).__name__}")
        self.stats.emulator = emulator

    def record_fetch(self, peer: int, nbytes: int) -> None:
        """Count ``nbytes`` loaded through a view from ``peer``'s window (data moved peer → us).

        Raises:
            TransportArgumentError: ``peer`` not a rank of the world.
        """
        peer = self._stats_peer("record_fetch", peer)
        self.stats.record_fetch(self.topology.kind(self.topology.rank, peer), peer, nbytes)

    def _urma(self, fn, *args):
        """Run an RMA step; an MPI failure poisons the transport (TransportRuntimeError propagates)."""
        try:
            return fn(*args)
        except TransportRuntimeError as exc:
            self._poison(str(exc))
            raise

    def put(self, win: SymmetricWindow, dst: int, offset: int, src: torch.Tensor, *,
            local_completion: bool = True) -> None:
        """Copy the contiguous tensor ``src`` (any dtype/shape; its bytes)
        into ``dst``'s data region at byte ``offset``.

        Returns when ``src`` may be reused; visible to ``dst`` after :meth:`flush` or a later
        ordered signal. Zero-byte puts are counted no-ops. SELF/UBMEM: a copy into the peer's
        segment; URMA: ``MPI_Put`` + ``Flush_local``. ``local_completion=False`` (URMA): no ``Flush_local``:
        the put may still read ``src`` until this rank's next :meth:`flush` to ``dst`` (or to all) or ordered
        signal to it, so the caller leaves ``src`` unchanged until then (the transport keeps it alive); a call
        that puts to several ranks then waits once, in that flush, instead of once per put.
        Raises:
            TransportArgumentError: before any byte is written, for a bad peer, range or source (SELF/UBMEM:
                also a source overlapping the destination range).
            TransportRuntimeError: the MPI call failed (the transport is poisoned).
        """
        self._check_open("put")
        kind = self._peer("put", win, dst)
        data = self._as_bytes("put", self.topology.rank, src, "src")
        self._range("put", win, dst, offset, data.numel())
        if data.numel():
            if kind is ChannelKind.URMA:
                self._urma(win._rma.put, int(dst), win.control_bytes + offset, data.detach().numpy(), None, 0,
                           local_completion)
            else:
                self._apart("put", win, dst, data, (offset,), (data.numel(),))
                win._data[int(dst)][offset:offset + data.numel()].copy_(data)
        self.stats.record_put(kind, int(dst), data.numel())

    def put_blocks(self, win: SymmetricWindow, dst: int, src: torch.Tensor, src_offsets, offsets, nbytes, *,
                   local_completion: bool = True) -> None:
        """Copy byte blocks of the contiguous tensor ``src`` into ``dst``'s data region: block ``i``, the
        ``nbytes[i]`` bytes at byte ``src_offsets[i]`` of ``src``, to byte ``offsets[i]``.

        What one :meth:`put` per block does (completion, visibility, the traffic counters: one put of the
        blocks' total), as one operation: URMA one ``MPI_Put`` whose origin and target are hindexed byte
        types (one rendezvous, where a put per block pays one each); SELF/UBMEM one row gather-scatter when
        the blocks are rows of one size, else one copy per block. ``local_completion``: as for :meth:`put`.
        Args:
            src_offsets, offsets, nbytes: 1-D sequences, numpy arrays or CPU tensors of ints (bytes), of one length;
                destination blocks must not overlap.
        Raises:
            TransportArgumentError: before any byte is written, for a bad peer, source or block list, a
                block outside ``src`` or the window, or (SELF/UBMEM) ``src`` overlapping a destination block.
        """
        op = "put_blocks"
        self._check_open(op)
        kind = self._peer(op, win, dst)
        data = self._as_bytes(op, self.topology.rank, src, "src")
        where = f"rank {self.topology.rank}: {op}(win='{win.name}', peer {dst})"
        src_off, dst_off, n = (_byte_counts(where, name, values) for name, values in
                               (("src_offsets", src_offsets), ("offsets", offsets), ("nbytes", nbytes)))
        if not src_off.size == dst_off.size == n.size:
            raise TransportArgumentError(f"{where}: src_offsets, offsets and nbytes must be of one length, got "
                                         f"{src_off.size}, {dst_off.size}, {n.size}")
        if n.size and int((src_off + n).max()) > data.numel():
            raise TransportArgumentError(f"{where}: a block ends at byte {int((src_off + n).max())} of src, which has "
                                         f"{data.numel()}")
        if n.size and int((dst_off + n).max()) > win.nbytes:
            raise TransportArgumentError(f"{where}: a block ends at byte {int((dst_off + n).max())}, outside the data "
                                         f"region of {win.nbytes} B")
        live = n > 0
        src_off, dst_off, n = src_off[live], dst_off[live], n[live]
        order = np.argsort(dst_off, kind="stable")
        if n.size > 1 and (dst_off[order][:-1] + n[order][:-1] > dst_off[order][1:]).any():
            raise TransportArgumentError(f"{where}: destination blocks overlap")
        if n.size:
            if kind is ChannelKind.URMA:
                self._urma(win._rma.put_blocks, int(dst), data.detach().numpy(), src_off.tolist(),
                           (dst_off + win.control_bytes).tolist(), n.tolist(), local_completion)
            else:
                self._apart(op, win, dst, data, dst_off, n)
                _copy_blocks(win._data[int(dst)], data, src_off, dst_off, n)
        self.stats.record_put(kind, int(dst), int(n.sum()))

    def get(self, win: SymmetricWindow, src: int, offset: int, out: torch.Tensor) -> None:
        """Copy ``out.nbytes`` bytes from ``src``'s data region at ``offset`` into ``out``.

        Sees what ``src`` released before the call.
        Raises:
            TransportArgumentError: bad peer, range, or ``out`` not a contiguous CPU tensor.
        """
        self._check_open("get")
        kind = self._peer("get", win, src)
        dest = self._as_bytes("get", self.topology.rank, out, "out")
        self._range("get", win, src, offset, dest.numel())
        if kind is ChannelKind.URMA:
            if dest.numel():
                self._urma(win._rma.get, int(src), win.control_bytes + offset, dest.detach().numpy())
        else:
            win.sync()
            if dest.numel():
                dest.copy_(win._data[int(src)][offset:offset + dest.numel()])
        self.stats.record_fetch(kind, int(src), dest.numel())

    def get_rows(self, win: SymmetricWindow, src: int, offset: int, row_bytes: int, rows: torch.Tensor,
                 out: torch.Tensor, out_rows: torch.Tensor, timeout_s: float | None = None, phase: str = "") -> None:
        """Gather rows of ``src``'s data region into rows of ``out``: ``out[out_rows[i]] = row rows[i]``, where
        row ``j`` is the ``row_bytes`` bytes at ``offset + j * row_bytes``. One copy, no staging: one
        ``MPI_Rget`` whose target and origin datatypes list the rows (UBMEM: MPICH copies straight out of
        the node-shared segment; URMA: one-sided RMA), completed by a polled wait with the deadline.
        Node peers' rows shorter than :data:`SMALL_ROW_BYTES` are loaded with a gather and a scatter
        instead (per-row datatype work would cost more than the bytes).

        Args:
            rows, out_rows: 1-D int64 tensors of one length (may be empty).
            out: CPU tensor ``[..., C]`` of any strides (rows must not overlap), ``C * itemsize ==
                row_bytes``; ``out_rows`` number its rows in row-major order of the leading dims
                (``M`` of them): a column-major scale block is filled in place.
            timeout_s, phase: the deadline (default: the transport's) and the label of a timeout.
        Raises:
            TransportArgumentError: bad peer, ``rows`` outside the data region, ``out_rows`` outside
                ``[0, M)``, lengths or row sizes that differ (before anything is read).
            TransportTimeout: the read did not complete in time (poisons the transport).
            TransportRuntimeError: the MPI call failed (poisons the transport).
        """
        from mpi4py import MPI

        self._check_open("get_rows")
        kind = self._peer("get_rows", win, src)
        me = self.topology.rank
        ok = (isinstance(out, torch.Tensor) and out.device.type == "cpu" and out.dim() >= 2
              and isinstance(rows, torch.Tensor) and isinstance(out_rows, torch.Tensor)
              and rows.dim() == 1 and out_rows.shape == rows.shape
              and rows.dtype == torch.int64 and out_rows.dtype == torch.int64)
        if not ok or out.size(-1) * out.element_size() != row_bytes or row_bytes <= 0:
            raise TransportArgumentError(
                f"rank {me}: get_rows(win='{win.name}', peer {src}): expected a CPU out [..., C] of {row_bytes} B rows "
                f"and two 1-D int64 row lists of one length, got out "
                f"{tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__}, rows "
                f"{tuple(rows.shape) if isinstance(rows, torch.Tensor) else type(rows).__name__}, out_rows "
                f"{tuple(out_rows.shape) if isinstance(out_rows, torch.Tensor) else type(out_rows).__name__}")
        n = rows.numel()
        if n == 0:
            return
        lo, hi = torch.aminmax(rows)
        olo, ohi = torch.aminmax(out_rows)
        num_out = out[..., 0].numel()
        if int(lo) < 0 or olo < 0 or ohi >= num_out:
            raise TransportArgumentError(
                f"rank {me}: get_rows(win='{win.name}', peer {src}): rows must be >= 0 and out_rows in "
                f"[0, {num_out}), got rows in [{int(lo)}, {int(hi)}], out_rows in [{int(olo)}, {int(ohi)}]")
        self._range("get_rows", win, src, offset, (int(hi) + 1) * row_bytes)
        if int(hi) >= 2 ** 31:
            raise TransportArgumentError(f"rank {me}: get_rows(win='{win.name}'): row {int(hi)} past 2**31 rows")
        size = out.element_size()
        src = int(src)
        if kind is not ChannelKind.URMA and row_bytes < SMALL_ROW_BYTES and offset % size == 0:
            # small rows (scales): MPI's per-row datatype work costs more than moving the bytes twice
            win.sync()
            table = win._data[src][offset:offset + (int(hi) + 1) * row_bytes].view(out.dtype).view(-1, out.size(-1))
            place, rest = [], out_rows
            for dim in reversed(out.shape[:-1]):
                place.append(rest % dim)
                rest = rest // dim
            out.index_put_(tuple(reversed(place)), table.index_select(0, rows))
            self.stats.record_fetch(kind, src, n * row_bytes)
            return
        # the origin buffer: every byte from out's first element to its last one
        span = sum((n - 1) * st for n, st in zip(out.shape, out.stride())) + 1
        base = out.as_strided((span,), (1,)).view(torch.uint8)
        # byte offset of each destination row: unravel out_rows over the leading dims (a loop over dims)
        disps, rest = torch.zeros_like(out_rows), out_rows
        for dim, st in zip(reversed(out.shape[:-1]), reversed(out.stride()[:-1])):
            disps += (rest % dim) * (st * size)
            rest = rest // dim
        target_t, origin_t, keep = gather_types(MPI, row_bytes, rows.to(torch.int32).numpy(), size, out.size(-1),
                                                out.stride(-1) * size, disps.numpy())
        if kind is ChannelKind.URMA:
            mpi_win, peer = win._rma.win, src
        elif win._rma_is_win:
            mpi_win, peer = win._win, src
        else:
            mpi_win, peer = win._win, self.topology.local_rank_of(src)
        self.stats.record_fetch(kind, src, n * row_bytes)
        try:
            try:
                req = mpi_win.Rget([base.numpy(), 1, origin_t], peer,
                                   target=[win.control_bytes + offset, 1, target_t])
            except MPI.Exception as exc:
                err = TransportRuntimeError(f"rank {me}: get_rows(win='{win.name}', peer {src}) failed: "
                                            f"{exc.Get_error_string()}")
                self._poison(str(err))
                raise err from None
            self._wait(req.Test, "get_rows", win, phase, timeout_s, "raise", lambda: [(src, 1, 0)])
        finally:
            for t in (target_t, origin_t, *keep):
                t.Free()

    # -- signals -----------------------------------------------------------------
    def signal(self, win: SymmetricWindow, dst: int, slot: int, add: int = 1, ordered: bool = True) -> int:
        """Add ``add`` to ``slot[slot][me]`` on ``dst``; returns the new value.

        ``ordered``: release with respect to earlier puts to ``dst`` (UBMEM: a memory barrier
        first; URMA: ``Flush(dst)`` of this window's unflushed puts). UBMEM stores the writer's
        running value (single writer per word); URMA is ``MPI_Accumulate(SUM, INT64_T)`` +
        ``Flush(dst)``, so the increment is applied at ``dst`` when this returns.
        Raises:
            TransportArgumentError: bad peer or slot, or ``add`` not a non-negative int64.
            TransportRuntimeError: the MPI call failed (the transport is poisoned).
        """
        self._check_open("signal")
        kind = self._peer("signal", win, dst)
        self._slot("signal", win, slot)
        self._add("signal", win, add)
        key = (id(win), slot, int(dst))
        value = self._grown("signal", win, slot, dst, add)
        if kind is ChannelKind.URMA:
            self._urma(win._rma.signal, int(dst), win.slot_disp(slot, self.topology.rank), int(add), ordered)
        else:
            if ordered:
                win.sync()
            win._ctl[int(dst)][win._slot_off + slot * win._world + self.topology.rank] = value
        self._shadow[key] = value
        self.stats.record_signal(kind, int(dst))
        return value

    def signal_many(self, win: SymmetricWindow, dsts, slot: int, adds, ordered: bool = True) -> list[int]:
        """:meth:`signal` to each rank of ``dsts`` (adding ``adds[i]`` to its word of ``slot``); returns the new
        values. The ranks reached over URMA together take at most three MPI steps whatever their number (a
        ``Flush_all`` of this window's unflushed puts when ``ordered``, an ``Accumulate`` to each, a
        ``Flush_all``) where one call each takes two or three apiece; the others are signalled one by one.
        Raises: as :meth:`signal`, for any of them, before anything is signalled.
        """
        self._check_open("signal")
        dsts, adds = list(dsts), list(adds)
        if len(dsts) != len(adds):
            raise TransportArgumentError(f"rank {self.topology.rank}: signal_many(win='{win.name}'): dsts and adds "
                                         f"must be of one length, got {len(dsts)} and {len(adds)}")
        self._slot("signal", win, slot)
        remote, local = [], []
        for dst, add in zip(dsts, adds):
            kind = self._peer("signal", win, dst)
            self._add("signal", win, add)
            self._grown("signal", win, slot, dst, add)
            (remote if kind is ChannelKind.URMA else local).append((int(dst), int(add)))
        self._distinct("signal_many", win, [d for d, _ in local + remote])
        values = {}
        for dst, add in local:
            values[dst] = self.signal(win, dst, slot, add, ordered)
        if remote:
            me = self.topology.rank
            self._urma(win._rma.accumulate_many, [d for d, _ in remote], [win.slot_disp(slot, me)] * len(remote),
                       [a for _, a in remote], ordered)
            for dst, add in remote:
                key = (id(win), slot, dst)
                values[dst] = self._shadow[key] = self._shadow.get(key, 0) + add
                self.stats.record_signal(ChannelKind.URMA, dst)
        return [values[int(d)] for d in dsts]

    def signal_address(self, win: SymmetricWindow, dst: int, slot: int) -> int:
        """Byte address of this rank's word of ``slot`` in load/store peer ``dst``'s window (SELF or UBMEM).

        For a caller that publishes signals by its own stores (native code: a release fence, then the new
        value in one 8-byte store, as :meth:`signal` does). That caller is then the word's only writer: it
        never also signals the word with :meth:`signal` or :meth:`put_with_signal` (their running value
        would not know its stores), and counts each store with :meth:`record_signal`. Valid until the window
        is freed.
        Raises:
            TransportUnsupported: ``dst`` reached over URMA. TransportArgumentError: bad peer or slot.
        """
        self._check_open("signal_address")
        self._peer("signal_address", win, dst, views=True)
        self._slot("signal_address", win, slot)
        return win._ctl[int(dst)].ctypes.data + win.slot_disp(slot, self.topology.rank)

    def signal_words_address(self, win: SymmetricWindow, slot: int) -> int:
        """Byte address of this rank's own signal words of ``slot``, ``[world]`` int64 (word ``src`` written by
        ``src`` alone), for a caller polling them with loads. URMA signals land there only while this rank
        drives MPI progress, and a peer's abort is not seen there: a caller that finds a word short waits with
        :meth:`wait_until`, and one that does not calls :meth:`check_abort` first.
        Raises:
            TransportArgumentError: bad slot.
        """
        self._check_open("signal_words_address")
        self._slot("signal_words_address", win, slot)
        return win._ctl[self.topology.rank].ctypes.data + win.slot_disp(slot, 0)

    def traffic_counter_addresses(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The byte addresses of this rank's int64 traffic counters of each peer, ``(bytes put, puts, signals)``,
        each ``[world_size]`` int64: for native code that stores into peers' windows and counts its stores itself
        (what :meth:`record_put` and :meth:`record_signal` add, without the call per peer). Valid while the
        transport lives (the counters are never reallocated). A caller must not count this way while a link
        emulator is set (``stats.emulator``): the emulator charges only what the ``record_*`` calls count.

        Raises:
            TransportClosed: the transport was destroyed.
        """
        self._check_open("traffic_counter_addresses")
        me, n = self.topology.rank, self.topology.world_size
        cells = np.array([int(self.topology.kind(me, p)) * n + p for p in range(n)], dtype=np.int64)
        return tuple(field.ctypes.data + 8 * cells for field in (self.stats.bytes_put, self.stats.puts,
                                                                 self.stats.signals))

    def record_signal(self, peer: int) -> None:
        """Count one signal stored at :meth:`signal_address` of ``peer``.

        Raises:
            TransportClosed: the transport was destroyed. TransportArgumentError: ``peer`` not a rank of the world.
        """
        self._check_open("record_signal")
        peer = self._stats_peer("record_signal", peer)
        self.stats.record_signal(self.topology.kind(self.topology.rank, peer), peer)

    def put_with_signal(self, win: SymmetricWindow, dst: int, offset: int, src: torch.Tensor,
                        slot: int, add: int = 1) -> int:
        """:meth:`put` then an ordered :meth:`signal`: an observer of the increment sees the data.

        Returns the new signal value. URMA: ``Put`` → ``Flush`` → ``Accumulate`` → ``Flush``.
        Raises: as :meth:`put` and :meth:`signal`, before anything is written.
        """
        kind = self._peer("put_with_signal", win, dst)
        self._slot("put_with_signal", win, slot)
        self._add("put_with_signal", win, add)
        self._grown("put_with_signal", win, slot, dst, add)
        if kind is not ChannelKind.URMA:
            self.put(win, dst, offset, src)
            return self.signal(win, dst, slot, add, ordered=True)
        self._check_open("put")
        data = self._as_bytes("put", self.topology.rank, src, "src")
        self._range("put", win, dst, offset, data.numel())
        dst = int(dst)
        key = (id(win), slot, dst)
        value = self._grown("put_with_signal", win, slot, dst, add)
        # Counted (and, under link emulation, delayed) before the signal lands, as a slow link would.
        self.stats.record_put(kind, dst, data.numel())
        self.stats.record_signal(kind, dst)
        self._urma(win._rma.put, dst, win.control_bytes + offset, data.detach().numpy(),
                   win.slot_disp(slot, self.topology.rank), int(add))
        self._shadow[key] = value
        return value

    def put_with_signal_many(self, win: SymmetricWindow, dsts, offsets, src: torch.Tensor, slot: int,
                             adds) -> list[int]:
        """:meth:`put_with_signal` of ``src`` to each rank of ``dsts`` (at byte ``offsets[i]`` of ``dsts[i]``'s data
        region, adding ``adds[i]`` to its word of ``slot``); returns the new signal values. The ranks reached over
        URMA together take four MPI steps whatever their number (``Put`` to each → ``Flush_all`` →
        ``Accumulate`` to each → ``Flush_all``) where one call each takes four apiece: a :meth:`put` to each
        without local completion, then :meth:`signal_many`. Like :meth:`put_with_signal`, this orders only
        this window's earlier puts before the signals: :meth:`flush` first to order another window's.
        Raises: as :meth:`put_with_signal`, for any of them, before anything is written.
        """
        self._check_open("put")
        dsts, offsets, adds = list(dsts), list(offsets), list(adds)
        if not len(dsts) == len(offsets) == len(adds):
            raise TransportArgumentError(f"rank {self.topology.rank}: put_with_signal_many(win='{win.name}'): dsts, "
                                         f"offsets and adds must be of one length, got {len(dsts)}, {len(offsets)}, "
                                         f"{len(adds)}")
        data = self._as_bytes("put", self.topology.rank, src, "src")
        self._slot("put_with_signal", win, slot)
        for dst, offset, add in zip(dsts, offsets, adds):  # every argument checked before the first put
            kind = self._peer("put_with_signal", win, dst)
            self._add("put_with_signal", win, add)
            self._grown("put_with_signal", win, slot, dst, add)
            self._range("put", win, dst, offset, data.numel())
            if kind is not ChannelKind.URMA:
                self._apart("put", win, dst, data, (offset,), (data.numel(),))
        self._distinct("put_with_signal_many", win, [int(d) for d in dsts])
        for dst, offset in zip(dsts, offsets):
            self.put(win, dst, offset, src, local_completion=False)
        return self.signal_many(win, dsts, slot, adds, ordered=True)

    def read_signal(self, win: SymmetricWindow, slot: int, src: int) -> int:
        """Current value of ``slot[slot][src]`` in this rank's window (no waiting; int)."""
        self._check_open("read_signal")
        self._slot("read_signal", win, slot)
        self._peer("read_signal", win, src)
        self.progress()
        return int(win.signals(slot)[src])

    def wait_until(self, win: SymmetricWindow, slot: int, srcs, values, timeout_s: float | None = None,
                   phase: str = "", on_timeout: str = "raise") -> list[int]:
        """Wait until ``slot[slot][src] >= value`` for every ``src`` (acquire).

        Sources may be on any node; the loop drives MPI progress so URMA signals land, and ends
        with ``Win.Sync`` on the shared and the RMA window: data released by the observed
        signals may then be read with loads (and re-published to node peers with UBMEM signals).

        Args:
            srcs: ranks to wait for (sequence of ints).
            values: one expected value per src, or a scalar for all.
            timeout_s: deadline (default: the transport's).
            phase: label for the error message.
            on_timeout: ``"raise"`` or ``"return"`` (return the list of pending ranks instead).
        Returns:
            ``[]`` when every signal arrived, else (``on_timeout="return"``) the pending ranks.
        Raises:
            TransportTimeout: a signal did not arrive in time (poisons the transport).
            TransportAborted: a peer aborted (poisons the transport).
        """
        self._check_open("wait_until")
        self._slot("wait_until", win, slot)
        if on_timeout not in ("raise", "return"):
            raise TransportArgumentError(f"rank {self.topology.rank}: wait_until: on_timeout must be 'raise' or "
                                         f"'return', got {on_timeout!r}")
        if not all(is_integer(s) for s in srcs):
            raise TransportArgumentError(f"rank {self.topology.rank}: wait_until(win='{win.name}'): source ranks "
                                         f"must be ints, got {list(srcs)!r}")
        srcs = [int(s) for s in srcs]
        need = [int(v) for v in values] if isinstance(values, (list, tuple, np.ndarray)) else [int(values)] * len(srcs)
        if len(need) != len(srcs):
            raise TransportArgumentError(f"rank {self.topology.rank}: wait_until(win='{win.name}'): {len(srcs)} "
                                         f"sources but {len(need)} values")
        for s in srcs:
            if not 0 <= s < self.topology.world_size:
                raise TransportArgumentError(f"rank {self.topology.rank}: wait_until(win='{win.name}'): source rank "
                                             f"{s} outside [0, {self.topology.world_size})")
        # memoryview items read as Python ints in ~0.3 us, far cheaper than numpy fancy indexing.
        base = win._slot_off + slot * win._world
        words = win._ctl_mv[base:base + win._world]
        pairs = list(zip(srcs, need))

        def done():
            return all(words[s] >= n for s, n in pairs)

        pending = self._wait(done, "wait_until", win, phase, timeout_s, on_timeout,
                             lambda: [(s, n, int(words[s])) for s, n in pairs if words[s] < n], slot)
        win.acquire()
        return pending

    def _wait(self, done, op, win, phase, timeout_s, on_timeout, pending_fn, slot=None):
        # win: the window whose signals are waited on (named in a timeout), or None (an MPI request)
        # Abort first: a late rank must not take a signal from a call its peers abandoned.
        self._check_abort(op, phase)
        if done():
            return []
        timeout = self.timeout_s if timeout_s is None else resolve_timeout(timeout_s)
        start = time.monotonic()
        self._publish_waitfor([p for p, _, _ in pending_fn()])
        # Cleared only when the wait ends normally: after a timeout or an abort the words keep
        # showing what this rank was blocked on, for the peers that time out after it.
        pending = self._wait_loop(done, op, win, phase, timeout, start, on_timeout, pending_fn, slot)
        self._publish_waitfor([])
        return pending

    def set_call_tag(self, seq: int, kind: int, op: int) -> None:
        """Tag the collective call this rank is in: its number ``seq`` (1, 2, ... in the caller's one sequence of
        calls, every kind counted), its ``kind`` and ``op`` (the caller's codes, 1 to 255). The other ranks read
        the tag while they wait: a wait that has lasted :data:`CALL_CHECK_S` (or finds that a peer aborted) and finds a
        rank at the ``seq`` of the call it belongs to (:meth:`call_tag`) in a call of another ``kind`` raises
        :class:`~transports.errors.TransportCallMismatch` and poisons the transport, instead of waiting out the
        deadline: the ranks made different calls, and neither wait could end (docs/design/transports.md §2.3).
        Ranks of other nodes are read by ``MPI_Rget``, one in flight per rank. The message names the calls by
        :attr:`call_names` (``{(kind, op): name}``, the caller's to fill).

        Raises:
            TransportArgumentError: ``seq`` outside ``[1, 2**47)`` or ``kind`` / ``op`` outside ``[1, 255]``.
        """
        self._check_open("set_call_tag")
        if not ((type(seq) is int or is_integer(seq)) and (type(kind) is int or is_integer(kind))
                and (type(op) is int or is_integer(op)) and 0 < seq < 2 ** 47 and 0 < kind < 256 and 0 < op < 256):
            raise TransportArgumentError(f"rank {self.topology.rank}: set_call_tag: expected seq in [1, 2**47) and "
                                         f"kind, op in [1, 255], got seq={seq!r}, kind={kind!r}, op={op!r}")
        word = (int(seq) << 16) | (int(kind) << 8) | int(op)
        self._internal._ctl_mv[self._internal._call_off] = word
        self._thread_tag.word = word

    @contextlib.contextmanager
    def adopt_call_tag(self, word: int):
        """Inside the block, the waits of the calling thread belong to the call tagged ``word`` (a value
        :meth:`call_tag` returned when that call was tagged): a worker or a receive hook finishing an earlier call
        while the caller went on. The peers still see this rank's latest tag."""
        before = getattr(self._thread_tag, "word", None)
        self._thread_tag.word = int(word)
        try:
            yield
        finally:
            self._thread_tag.word = before

    def call_tag(self) -> int:
        """The tag the calling thread's waits belong to (:meth:`adopt_call_tag`), else the latest :meth:`set_call_tag`
        of this rank (0: none)."""
        word = getattr(self._thread_tag, "word", None)
        return int(self._internal._ctl_mv[self._internal._call_off]) if word is None else word

    def check_call_tags(self, phase: str = "") -> None:
        """What a wait does every :data:`CALL_CHECK_S` (:meth:`set_call_tag`), for callers that wait in short slices
        of ``wait_until(..., on_timeout="return")``, each too short to reach it: raise
        :class:`~transports.errors.TransportCallMismatch` (and poison) if a rank is tagged with the number of the
        call this thread waits in and another kind (``phase``: named in the message)."""
        self._check_open("check_call_tags")
        self._check_call_tags(f"check_call_tags({phase})" if phase else "check_call_tags")

    def _check_call_tags(self, where: str) -> None:
        """Raise :class:`~transports.errors.TransportCallMismatch` (and poison) if a peer is tagged with the number of
        the call this thread waits in (:meth:`call_tag`) and another kind (:meth:`set_call_tag`): node peers by loads
        (the lowest such rank is named), other nodes by an ``Rget`` per peer at a time, compared once it completed
        (a later check), so that the wait never blocks on one."""
        internal, me = self._internal, self.topology.rank
        mine = self.call_tag()
        if not mine:
            return
        off = internal._call_off
        for p, ctl in sorted(internal._ctl.items()):
            if p != me:
                self._compare_call_tags(where, mine, p, int(ctl[off]))
        rma = internal._rma
        if rma is None:
            return
        done = []
        with self._tag_lock:
            for p in self._urma_peers:
                read = self._tag_reads.pop(p, None)
                if read is None:
                    out = np.zeros(1, dtype=np.int64)
                    self._tag_reads[p] = (self._urma(rma.rget, p, 8 * off, out), out)
                elif not read[0].Test():
                    self._tag_reads[p] = read
                else:
                    done.append((p, int(read[1][0])))
        for p, theirs in done:
            self._compare_call_tags(where, mine, p, theirs)

    def _compare_call_tags(self, where: str, mine: int, p: int, theirs: int) -> None:
        if theirs >> 16 == mine >> 16 and (theirs >> 8) & 0xFF != (mine >> 8) & 0xFF:
            exc = TransportCallMismatch(self.topology.rank, p, mine >> 16, ((mine >> 8) & 0xFF, mine & 0xFF),
                                        ((theirs >> 8) & 0xFF, theirs & 0xFF), op=where, names=self.call_names)
            self._poison(str(exc))
            raise exc

    def _finish_tag_reads(self, timeout_s: float) -> bool:
        """Complete the call-tag reads still in flight (before the windows are freed); False if one did not complete
        in ``timeout_s`` (its peer is gone or stuck: the windows must then be abandoned, not freed)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._tag_lock:
                for p, (req, _) in list(self._tag_reads.items()):
                    if req.Test():
                        del self._tag_reads[p]
                if not self._tag_reads:
                    return True
            if time.monotonic() > deadline:
                return False
            self._progress.poke(force=True)
            time.sleep(1e-4)

    def _publish_waitfor(self, ranks) -> None:
        """Show node peers which ranks this rank is blocked on (all zero: not waiting)."""
        words = self._internal._ctl[self.topology.rank]
        off = self._internal._waitfor_off
        words[off:off + self.topology.world_size] = 0
        if ranks:
            words[np.asarray(ranks, dtype=np.int64) + off] = 1

    def _waitfor_of(self, q: int):
        """Rank ``q``'s published waiting-for flags ``[world]``: a load for node peers, an ``Rget``
        (at most 0.5 s) for other nodes; ``None`` if unreadable."""
        internal, world = self._internal, self.topology.world_size
        off = internal._waitfor_off
        if q in internal._ctl:
            return internal._ctl[q][off:off + world].copy()
        if internal._rma is None:
            return None
        out = np.zeros(world, dtype=np.int64)
        return out if internal._rma.try_get(q, 8 * off, out.view(np.uint8), 0.5) else None

    def _blocked_on(self, ranks) -> dict:
        """``{waited-for rank: ranks at the end of its chain}`` for the ``ranks`` this rank timed out on.

        Follows the waiting-for flags each rank publishes (loads inside the node, ``Rget`` across);
        a rank that waits for nobody (or cannot be read) ends a chain. Chains that loop back to
        this rank or between themselves (a mutual wait) are cut; ranks not blocked are left out.
        """
        me = self.topology.rank
        out = {}
        for p in ranks:
            if p == me:
                continue
            seen, frontier, leaves = {me, p}, [p], []
            while frontier:
                q = frontier.pop()
                flags = self._waitfor_of(q)
                nxt = [] if flags is None else [int(r) for r in np.flatnonzero(flags)]
                if not nxt:
                    if q != p:
                        leaves.append(q)
                    continue
                for r in nxt:
                    if r not in seen:
                        seen.add(r)
                        frontier.append(r)
            if leaves:
                out[p] = sorted(leaves)
        return out

    def _wait_loop(self, done, op, win, phase, timeout, start, on_timeout, pending_fn, slot):
        polls = 0
        # URMA traffic to this rank lands only while it is inside MPI (active messages over TCP).
        poke = self._progress.poke if (self._urma_peers or self._forced_urma) else None
        next_tag_check = CALL_CHECK_S
        for pause in self.wait_policy.pauses():
            if done():
                return []
            polls += 1
            if polls % 8 == 0 or pause > 0:
                if poke is not None:
                    poke()
                    if done():
                        return []
                elapsed = time.monotonic() - start
                if elapsed >= next_tag_check and win is not None:  # ranks in different calls: fail now
                    next_tag_check = elapsed + CALL_CHECK_S
                    self._check_call_tags(f"{op}({phase})" if phase else op)
                    # the ranks still waited for, as their signals come (a peer's exit reads them)
                    self._publish_waitfor([p for p, _, _ in pending_fn()])
                self._check_abort(op, phase)
                elapsed = time.monotonic() - start
                if elapsed > timeout:
                    pending = pending_fn()
                    if on_timeout == "return":
                        return [p for p, _, _ in pending]
                    waited = [p for p, _, _ in pending]
                    exc = TransportTimeout(op, self.topology.rank, waited, elapsed, phase=phase,
                                           window=None if win is None else win.name,
                                           slot=slot, expected=[n for _, n, _ in pending],
                                           observed=[o for _, _, o in pending], blocked_on=self._blocked_on(waited))
                    self._poison(str(exc))
                    raise exc
            if pause > 0:
                time.sleep(pause)

    def _check_abort(self, op: str, phase: str = "") -> None:
        ctl = self._internal._ctl[self.topology.rank]
        flags = ctl[:self.topology.world_size]
        if np.count_nonzero(flags):  # (every wait asks: ndarray.any() costs ~4x on a few words)
            # a peer that timed out names the missing ranks: its report first
            timed_out = np.flatnonzero(flags == _ABORT_TIMEOUT)
            peer = int(timed_out[0] if timed_out.size else np.flatnonzero(flags)[0])
            off = self._internal._reason_off + peer * (_REASON_BYTES // 8)
            reason = ctl[off:off + _REASON_BYTES // 8].tobytes().rstrip(b"\0").decode("utf-8", "replace")
            where = f"{op}({phase})" if phase else op
            self._check_call_tags(where)  # (a peer that aborted on finding the ranks in different calls)
            if flags[peer] == _ABORT_TIMEOUT:
                pending, _, reason = reason.partition(";")
                exc = TransportPeerTimeout(self.topology.rank, peer, reason,
                                           [int(p) for p in pending.split(",") if p], op=where)
            else:
                exc = TransportAborted(self.topology.rank, peer, reason, op=where)
            self._poison(f"peer rank {peer} aborted: {reason}")
            raise exc

    def check_abort(self, phase: str = "") -> None:
        """Raise :class:`TransportAborted` if any peer has aborted (``phase``: named in its message, as a
        wait's phase is)."""
        self._check_open("check_abort")
        self._check_abort("check_abort", phase)

    def abort(self, reason: str, pending_peers=None) -> None:
        """Tell every reachable peer that this rank failed, then poison this transport.

        Peers blocked in (or later entering) a wait raise ``TransportAborted(peer=this rank)``;
        with ``pending_peers`` (this rank timed out waiting for them) they raise
        :class:`TransportPeerTimeout`, a ``TimeoutError`` naming those ranks. Never raises.
        """
        if self.state is State.CLOSED or self._aborted:
            return  # peers keep the first reason
        self._aborted = True
        me = self.topology.rank
        flag = 1
        if pending_peers is not None:
            flag = _ABORT_TIMEOUT
            reason = ",".join(str(int(p)) for p in pending_peers) + ";" + f"{reason}"
        text = f"{reason}".encode()[:_REASON_BYTES - 1].ljust(_REASON_BYTES, b"\0")
        words = np.frombuffer(text, dtype=np.int64)
        win = self._internal
        off = win._reason_off + me * (_REASON_BYTES // 8)
        self._poison(f"this rank aborted: {reason}")
        for p in self.topology.node_ranks():
            if p == me:
                continue
            ctl = win._ctl.get(p)
            if ctl is None:
                continue
            ctl[off:off + len(words)] = words
            win.sync()
            ctl[win._abort_off + me] = flag
        win.sync()
        # Other nodes: reason, Flush, then the flag (one accumulate on a word only we write).
        # Blocks until each peer's MPI acknowledges; a peer MPI reports as failed is skipped.
        raw = np.frombuffer(text, dtype=np.uint8)
        for p in self._urma_peers:
            try:
                win._rma.put(p, 8 * off, raw, signal_disp=8 * (win._abort_off + me), add=flag)
            except Exception:  # noqa: BLE001 - never raises: the other peers must still hear of it
                pass

    # -- ordering and synchronisation ----------------------------------------------
    def fence(self) -> None:
        """Local full memory barrier (``MPI_Win_sync``)."""
        if self.state is State.CLOSED:
            raise TransportClosed(f"rank {self.topology.rank}: fence called after destroy()")
        self._internal.sync()

    def flush(self, dst: int | None = None) -> None:
        """Complete this rank's puts to ``dst`` (or to all) at the target and fence.

        UBMEM: a memory barrier; URMA: ``MPI_Win_flush(dst)`` / ``flush_all`` on every window
        with unflushed puts.
        Raises:
            TransportArgumentError: ``dst`` outside ``[0, world)``.
            TransportRuntimeError: the MPI call failed (the transport is poisoned).
        """
        self._check_open("flush")
        if dst is not None:
            self._peer("flush", self._internal, dst)
            dst = int(dst)
        self._flush_rma(dst)
        self.fence()

    def _flush_rma(self, dst: int | None) -> None:
        # every window with unflushed puts to dst: a force_urma window reaches node peers over URMA too
        for win in self._windows:
            if win._rma is not None and win._rma.dirty:
                self._urma(win._rma.flush, dst)

    def progress(self) -> None:
        """Advance MPI once so incoming URMA puts and signals land (``Iprobe`` on a private communicator).

        Every wait of the transport already calls it; call it from loops that poll window memory
        by other means. A no-op after :meth:`destroy`.
        """
        if self.state is not State.CLOSED:
            self._progress.poke(force=True)

    def team_ranks(self, team: Team) -> list:
        """World ranks of ``team`` (every rank, this rank's node, or its rail), ascending."""
        topo = self.topology
        if team is Team.WORLD:
            return list(range(topo.world_size))
        if team is Team.NODE:
            return list(topo.node_ranks())
        return [topo.rail_peer(topo.rank, n) for n in range(topo.num_nodes)]

    def barrier(self, team: Team = Team.WORLD, timeout_s: float | None = None, phase: str = "barrier") -> None:
        """Wait until every member of ``team`` arrived; earlier stores and puts are then visible to all.

        Uses growing generation counters in the transport's own slots: a store for node members,
        ``Accumulate(+1)`` for members on other nodes (after flushing this rank's URMA puts); no
        collective MPI call.
        Raises:
            TransportArgumentError: ``team`` is not a :class:`Team`.
            TransportTimeout: naming the members that did not arrive.
            TransportRuntimeError: an MPI call failed (the transport is poisoned).
        """
        self._check_open("barrier")
        try:
            team = Team(team)
        except ValueError:
            raise TransportArgumentError(f"rank {self.topology.rank}: barrier: team {team!r} is not one of "
                                         f"{[t.name for t in Team]}") from None
        members = self.team_ranks(team)
        self._barrier_gen[team] += 1
        gen = self._barrier_gen[team]
        win = self._internal
        self._flush_rma(None)
        win.sync()
        me = self.topology.rank
        row = win._barrier_off + team * win._world
        remote = []
        for p in members:
            ctl = win._ctl.get(p)
            if ctl is None:
                remote.append(p)
            else:
                ctl[row + me] = gen
        if remote:  # +1 per generation: the word then equals gen, as the stores above
            self._urma(win._rma.accumulate_many, remote, [8 * (row + me)] * len(remote), [1] * len(remote), False)
        words = win._ctl[me][row:row + win._world]
        idx = np.asarray(members, dtype=np.int64)

        def pending():
            return [(int(p), gen, int(words[p])) for p in idx if words[p] < gen]

        self._wait(lambda: bool(np.all(words[idx] >= gen)), "barrier", win, f"{phase}, team {team.name}",
                   timeout_s, "raise", pending)
        win.acquire()

    def allgather_object(self, obj, phase: str = "allgather_object", timeout_s: float | None = None) -> list:
        """Every rank's picklable ``obj``, in rank order (:func:`transports.base.allgather_object`), on a
        communicator of the transport's own (used for nothing else), its requests polled as every wait of the
        transport is: sleeping between polls when ranks outnumber cores, with the deadline, failing fast when a
        peer aborted. A blocking ``MPI_Allgather`` has neither a deadline nor an abort check: a rank that
        passed the same barrier as a peer which then timed out would wait in it forever. Collective over the
        world; call it from one thread.
        Args:
            obj: any picklable object (sizes may differ between ranks); phase: named in a timeout's message;
            timeout_s: deadline in seconds (default: the transport's).
        Returns:
            a list of ``world_size`` objects, rank ``r``'s at index ``r``.
        Raises:
            TransportTimeout: not every rank entered it in time (an MPI collective does not say which one
                is missing); the transport is poisoned.
            TransportAborted / TransportPeerTimeout: a peer aborted meanwhile.
        """
        self._check_open("allgather_object")

        def wait(req):  # on no window; which ranks are missing is unknown (no pending list)
            self._wait(req.Test, "allgather_object", None, phase, timeout_s, "raise", list)
        return allgather_object(self._gather_comm, obj, wait)


#: The class's name from before it handled URMA pairs; kept so existing callers keep working.
UbmemTransport = Transport
