"""``deepep_ascend.Buffer``: DeepEP's ``deep_ep.Buffer`` on CPU ranks over MPI (docs/semantics/deepep-api.md §2-§4, §8).

This module is the API: the constructor, the calls, and what ties them to one Buffer (its transport,
windows and worker, the consensus round a rejected call still takes part in, and its traffic
counters). Argument checks live in :mod:`.checks` and :mod:`.low_latency_arguments`, data movement in the
engines (:mod:`.intranode`, :mod:`.internode`, :mod:`.low_latency`), the handles in :mod:`.handles`.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
import warnings
import weakref
from collections.abc import Callable, Generator, Iterator

import numpy as np
import torch

from .. import settings
from ..checks import as_int
from ..rounding import align
from ..settings import SettingError
from ..transports import (
    ChannelKind,
    LinkStats,
    SharedMemoryExhausted,
    State,
    TransportArgumentError,
    TransportCallMismatch,
    TransportRuntimeError,
    create_transport,
    timeout_problem,
)
from . import low_latency as ll_mod
from .allocator import SharedOnCopy
from .arguments import (
    Rejected,
    check,
    check_combine_args,
    check_config,
    check_dispatch_layout_args,
    check_dispatch_options,
    check_handle_rows,
    check_internode_handle,
    check_intranode_handle,
    check_stream_args,
    check_topk_idx,
    check_worst_tokens_fit,
    check_x,
    checked_dispatch_layout,
)
from .config import Config, combine_config, dispatch_config
from .event import EventHandle, EventOverlap, Worker
from .failure import raise_if_a_peer_aborted, refused_on_every_rank, run_step
from .group import check_agreed, mpi_comm_of
from .handles import (
    HandleOrigin,
    InternodeHandle,
    IntranodeHandle,
    LowLatencyHandle,
    NormalHandle,
    origin_of,
    record_origin,
)
from .input_guard import InputGuard
from .internode import NUM_URMA_SLOTS, InternodeEngine
from .intranode import NUM_SLOTS, IntranodeEngine
from .layout import dispatch_layout, tokens_per_node
from .low_latency_arguments import (
    check_low_latency_combine_args,
    check_low_latency_dispatch_args,
    check_low_latency_handle,
    low_latency_layout,
)
from .memory import outside_inference_mode
from .phases import RECORDER as _PH
from .phases import engine_of, timed, timed_call
from .protocol import (
    CALL_BARRIER,
    CALL_CLEAN,
    CALL_DESTROY,
    CALL_LOAD_BALANCE,
    CALL_LOW_LATENCY,
    CALL_NORMAL,
    HEADER_BYTES,
    OP_CACHED_DISPATCH,
    OP_COMBINE,
    OP_DISPATCH,
    OP_NAMES,
    CallMismatch,
    ConsensusError,
    dtype_code,
    ordinal,
)
from .rows import dense
from .stamps import stamp, stamp_matches, written_since

#: A dispatch's ``x`` or ``recv_x``: one ``[N, H]`` tensor, or the FP8 pair ``(data, scales)``.
Rows = torch.Tensor | tuple[torch.Tensor, torch.Tensor]

_BUFFER_IDS = itertools.count(1)
#: The record name of a low-latency receive hook (deepep_ascend.ep.phases).
_HOOK_OPS = {ll_mod.OP_DISPATCH: "low_latency_dispatch hook", ll_mod.OP_COMBINE: "low_latency_combine hook"}
_UNDESTROYED = weakref.WeakSet()


@atexit.register
def _warn_undestroyed():
    for buf in list(_UNDESTROYED):
        if buf.runtime is not None and buf.runtime.state is not State.CLOSED:  # (a destroy() that timed out ran)
            warnings.warn(f"deepep_ascend.{buf.api_name}(rank {buf.rank}) was built with explicitly_destroy=True but "
                          f"never destroyed; call buffer.destroy() on every rank before exit", RuntimeWarning,
                          stacklevel=2)


def _masked_ranks(ref: weakref.ref) -> list[int]:
    """The ranks a shrink-mode Buffer masked (its teardown's departed ranks); [] once it is gone."""
    buf = ref()
    ll = None if buf is None else buf._ll
    return [] if ll is None else torch.nonzero(ll.mask).view(-1).tolist()


def _issue_and_receive(issue: Callable[..., ll_mod.Pending], args: tuple) -> ll_mod.Pending:
    """A synchronous low-latency call's sends, then its receive: :meth:`Buffer._ll_run`'s one guarded step."""
    pending = issue(*args)
    if _PH.on:
        _PH.switch(None)
    pending.receive()
    return pending


class Buffer(SharedOnCopy):
    """Expert-parallel communication buffer; mirrors ``deep_ep.Buffer`` (DeepEP 2.1.0, V1 API).

    Normal (high-throughput) mode: ``get_dispatch_layout``, ``dispatch`` (BF16 or FP8, with/without
    top-k, cached through a handle, ``expert_alignment``, ``num_worst_tokens``, async) and
    ``combine`` (bias, combined top-k weights, async), inside one node through the UBMEM window
    (:mod:`deepep_ascend.ep.intranode`) or, with more than one node, by DeepEP's two hops through the
    URMA and UBMEM windows (:mod:`deepep_ascend.ep.internode`). Windows are allocated once; payloads
    larger than them stream through in rounds. Low-latency mode: the ``low_latency_*`` methods.

    Args:
        group: a ``torch.distributed`` ProcessGroup (torch ranks must equal MPI ranks, as under
            ``mpiexec`` when torch.distributed is initialised with the MPI rank and size), an mpi4py
            communicator, or ``None`` with ``comm``.
        num_nvl_bytes: bytes of the UBMEM (intranode) window per rank, a multiple of 128
            (alias ``num_ubmem_bytes``). See :meth:`get_normal_buffer_size_hint`.
        num_rdma_bytes: bytes of the URMA window (alias ``num_urma_bytes``): the internode
            boxes, and with ``low_latency_mode`` the LL window (see
            :meth:`get_low_latency_rdma_size_hint`); across nodes a low-latency Buffer serves both
            paths, as DeepEP's does (docs/semantics/deepep-api.md §6.1).
        low_latency_mode: build the low-latency window from ``num_rdma_bytes`` (any number of
            nodes); the ``low_latency_*`` methods then work (see :mod:`deepep_ascend.ep.low_latency`).
        num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl, enable_shrink: accepted
            for DeepEP compatibility (checked as DeepEP does; no effect in normal mode). In
            low-latency mode ``allow_nvlink_for_low_latency_mode`` (alias
            ``allow_ubmem_for_low_latency_mode``) lets same-node peers be written with stores
            instead of ``put``, and ``enable_shrink`` masks peers that miss the deadline.
        explicitly_destroy: if True, :meth:`destroy` must be called (collectively) to free the window.
        use_fabric: DeepEP before 2.1.0's switch for fabric memory handles; accepted, no meaning here
            (windows are MPI shared memory and RMA).
        comm: mpi4py communicator used when ``group`` is None.
        ranks_per_node: simulated node size (default: ``$DEEPEP_ASCEND_RANKS_PER_NODE``, else the
            shared-memory domain); fewer than the ranks takes the internode path, which needs
            ``num_rdma_bytes`` too (see :meth:`get_normal_rdma_buffer_size_hint`).
        timeout_s: deadline of every wait in seconds; default ``$DEEPEP_ASCEND_TIMEOUT_S``, else 100.

    On one node, each rank also maps a **landing segment** of ``$DEEPEP_ASCEND_LANDING_BYTES``
    bytes (default ``num_nvl_bytes``; 0: none; reserved in ``/dev/shm`` at construction). Normal
    dispatch places ``recv_x`` there when it fits, so senders store their rows straight into it
    (:mod:`deepep_ascend.ep.intranode`). ``recv_x`` is still an ordinary tensor to the caller: its
    range is reused only after the caller drops every tensor viewing it (a bare ``untyped_storage()``
    object does not count), and it stays valid after
    :meth:`destroy`.

    Like a CUDA stream, a Buffer is used by one thread at a time, and every rank makes the same
    sequence of collective calls (``dispatch``, ``combine``, ``destroy``). A timeout or a peer's
    abort leaves the Buffer failed: later calls raise ``transports.TransportPoisoned`` at once;
    build a new Buffer (destroying the old one needs ``explicitly_destroy=True``).

    Raises:
        ValueError: no usable group/comm, conflicting aliases, bad ``timeout_s``; ranks disagreeing on
            a collective argument (window sizes, modes, ``explicitly_destroy``) or one rank refusing
            its own: raised on every rank, naming the argument and each rank's value.
        RuntimeError: DeepEP's constructor checks (128-byte multiples, sizes, unsupported modes).
        transports.TransportConfigError: invalid ``ranks_per_node`` (same error on every rank).
    """

    num_sms: int = 20
    api_name: str = "Buffer"  # the class the user built, named in the exit warning (EPBuffer builds a Buffer)

    @outside_inference_mode  # its own tensors are kept across calls: normal tensors in either mode
    def __init__(self, group=None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False, explicitly_destroy: bool = False, enable_shrink: bool = False,
                 comm=None, *, use_fabric: bool = False, num_ubmem_bytes: int | None = None,
                 num_urma_bytes: int | None = None,
                 ranks_per_node: int | None = None, timeout_s: float | None = None,
                 allow_ubmem_for_low_latency_mode: bool | None = None):
        if num_ubmem_bytes is not None:
            if num_nvl_bytes not in (0, num_ubmem_bytes):
                raise ValueError(f"Buffer: num_nvl_bytes={num_nvl_bytes} and its alias num_ubmem_bytes="
                                 f"{num_ubmem_bytes} disagree")
            num_nvl_bytes = num_ubmem_bytes
        if num_urma_bytes is not None:
            if num_rdma_bytes not in (0, num_urma_bytes):
                raise ValueError(f"Buffer: num_rdma_bytes={num_rdma_bytes} and its alias num_urma_bytes="
                                 f"{num_urma_bytes} disagree")
            num_rdma_bytes = num_urma_bytes
        if allow_ubmem_for_low_latency_mode is not None:  # Ascend alias of allow_nvlink_for_low_latency_mode
            allow_nvlink_for_low_latency_mode = bool(allow_ubmem_for_low_latency_mode)
        mpi_comm = mpi_comm_of(group, comm)
        num_nvl_bytes, num_rdma_bytes, num_qps_per_rank = map(as_int, (num_nvl_bytes, num_rdma_bytes, num_qps_per_rank))
        error = None
        for name, value in (("num_nvl_bytes", num_nvl_bytes), ("num_rdma_bytes", num_rdma_bytes)):
            if error is None and (not isinstance(value, int) or value < 0 or value % 128):
                error = RuntimeError(f"Buffer: {name} must be a non-negative multiple of 128 bytes, got {value!r}")
        if error is None and (low_latency_mode or num_rdma_bytes > 0) and not (
                isinstance(num_qps_per_rank, int) and num_qps_per_rank > 0):  # (DeepEP's assertion, where QPs exist)
            error = AssertionError(f"Buffer: num_qps_per_rank must be a positive int with low_latency_mode or "
                                   f"num_rdma_bytes, got {num_qps_per_rank!r}")
        bad_timeout = None if timeout_s is None else timeout_problem("timeout_s", timeout_s)
        error = error or (ValueError(f"Buffer: {bad_timeout}") if bad_timeout else None)
        # agreed before the transport and its windows exist: a rank that refused, or ranks asking for
        # windows of different sizes, would otherwise leave the others waiting in the collectives
        check_agreed(mpi_comm, self.api_name, {
            "num_nvl_bytes": num_nvl_bytes, "num_rdma_bytes": num_rdma_bytes,
            "low_latency_mode": bool(low_latency_mode), "explicitly_destroy": bool(explicitly_destroy),
            "allow_nvlink_for_low_latency_mode": bool(allow_nvlink_for_low_latency_mode),
            "enable_shrink": bool(enable_shrink)}, error, None if bad_timeout else timeout_s)
        self.rank = mpi_comm.Get_rank()
        self.group_size = mpi_comm.Get_size()
        self.group = group if group is not None else mpi_comm
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.num_qps_per_rank = num_qps_per_rank
        self.allow_nvlink_for_low_latency_mode = allow_nvlink_for_low_latency_mode
        self.allow_mnnvl = allow_mnnvl
        self.explicitly_destroy = explicitly_destroy
        self.enable_shrink = enable_shrink
        self._uid = next(_BUFFER_IDS)
        self._calls = 0
        self._tagged = 0  # collective calls of every kind so far: the transport's call tag (_tag_call)
        self._default_configs = {}  # Buffer.get_dispatch_config / get_combine_config -> its Config, see _config
        self._filling = None  # the worker's task of the last dispatch that yields its handle before the counts
        self._hook_receive = None  # the receive of the LL call whose hook is pending, and its hook's state (_ll_run)
        self._layout_stamp = ()  # what the last get_dispatch_layout returned, see stamps.stamp
        self._last_traffic = None
        self.runtime = create_transport(mpi_comm, ranks_per_node=ranks_per_node, timeout_s=timeout_s)
        self.runtime.call_names = self._CALL_NAMES
        topo = self.runtime.topology
        self.num_nodes, self.ranks_per_node = topo.num_nodes, topo.ranks_per_node
        self._internode = self.num_nodes > 1
        if num_rdma_bytes and not self._internode and not low_latency_mode:
            self.runtime.destroy(force=True)
            raise RuntimeError(f"Buffer: num_rdma_bytes > 0 needs more than one node (here one node of "
                               f"{self.ranks_per_node} ranks) unless low_latency_mode=True; pass num_rdma_bytes=0")
        try:
            # the landing segments reserve their pages: made first, the windows' check counts them as taken
            self._landing = self._landing_build() if num_nvl_bytes and not self._internode else None
            self._win = self.runtime.create_window("ubmem", num_nvl_bytes, NUM_SLOTS) if num_nvl_bytes else None
            # across nodes the normal path has its own window of num_rdma_bytes beside the LL one: DeepEP
            # shares one region between modes used at different times; two regions need no such care
            # and cost only the pages each mode touches
            self._urma_win = (self.runtime.create_window("urma", num_rdma_bytes, NUM_URMA_SLOTS)
                              if num_rdma_bytes and self._internode else None)
            self._ll = self._ll_build(num_rdma_bytes, allow_nvlink_for_low_latency_mode) if low_latency_mode else None
        except SharedMemoryExhausted as exc:
            self.runtime.destroy(force=True)
            if getattr(self, "_landing", None) is None:
                raise
            raise SharedMemoryExhausted(f"{exc}; the recv_x landing segments already reserve "
                                        f"{self._landing.sizes.get(topo.rank, 0):,} B per rank of that space "
                                        f"(${settings.LANDING_BYTES.name}=0 makes none)") from None
        except Exception:
            self.runtime.destroy(force=True)
            raise
        if self._internode:
            self._engine = (InternodeEngine(self.runtime, self._win, self._urma_win)
                            if self._win is not None and self._urma_win is not None else None)
        else:
            self._engine = IntranodeEngine(self.runtime, self._win, self._landing) if self._win is not None else None
        self._worker = Worker(f"deepep_ascend-{self._uid}")
        if explicitly_destroy:
            _UNDESTROYED.add(self)
        if enable_shrink:  # a rank that exits without destroy() leaves as destroy() would (never aborting peers)
            self.runtime.exit_departed = functools.partial(_masked_ranks, weakref.ref(self))

    def _landing_build(self):
        """The node's recv_x landing segments (collective), sized by ``$DEEPEP_ASCEND_LANDING_BYTES``.

        A value that does not parse is still handed to ``create_segment``, which refuses it on every
        rank of the node: no rank is left waiting in the collective for the one that gave up.
        """
        setting = settings.LANDING_BYTES
        refused = None
        try:
            nbytes = setting.get()
        except SettingError as exc:
            refused, nbytes = exc, setting.raw()
        if nbytes is None:
            nbytes = self.num_nvl_bytes
        try:
            return self.runtime.create_segment("recv_x", nbytes)
        except TransportArgumentError as exc:
            reason = refused or f"${setting.name} must be {setting.accepts()} on every rank of the node"
            raise ValueError(f"Buffer: {reason} ({exc})") from None
        except TransportRuntimeError as exc:
            raise RuntimeError(f"Buffer: the recv_x landing segments (${setting.name}, default num_nvl_bytes) "
                               f"could not be created: {exc}; set ${setting.name} lower, or 0 for none") from None

    # -- lifetime ----------------------------------------------------------------
    def destroy(self) -> None:
        """Collectively free the window, the transport and the worker (needs ``explicitly_destroy=True``).

        With ``enable_shrink`` a rank that left (went to ``destroy()`` while its peers still call) never
        holds up or aborts the ranks that masked it: the windows are freed only if every rank arrives
        and none has masked another; otherwise every rank abandons them to the process's exit, without
        waiting for masked ranks (docs/api/low-latency.md, "Shrink mode").

        Raises:
            AssertionError: the Buffer was built without ``explicitly_destroy``.
            transports.TransportBusy: views of window memory are still alive on some rank (tensors from
                :meth:`get_local_buffer_tensor` or :meth:`get_next_low_latency_combine_buffer`): refused on every
                rank, and the Buffer stays as it was (drop them, then call ``destroy()`` again).
            transports.TransportTimeout: a peer never reached destroy (not with ``enable_shrink``).
        """
        assert self.explicitly_destroy, "`explicitly_destroy` flag must be set"
        if self.runtime is None:
            return
        self._hook_receive = None  # (a hook never called: its receive's tensors are the caller's to keep, not ours)
        self._worker.drain()
        if not self.enable_shrink and self.runtime.state is State.OPEN:
            # peers still in a call find this rank in destroy at once (a rank leaving is shrink mode's masking)
            self._tag_call(CALL_DESTROY, 1)
        departed = _masked_ranks(weakref.ref(self)) if self.enable_shrink else None
        for engine in (self._ll, self._engine):  # their cached window views, remade on use if destroy is refused
            if engine is not None:
                engine.release()
        self.runtime.destroy(departed=departed)
        self._engine = self._ll = None
        if self._landing is not None:
            self._landing.release()  # recv_x tensors the caller still holds keep their memory
            self._landing = None
        self._worker.shutdown()
        self._win = self._urma_win = None
        self.runtime = None
        _UNDESTROYED.discard(self)

    def _check_usable(self, op: str) -> None:
        if self.runtime is None:
            raise RuntimeError(f"Buffer.{op}: the Buffer was destroyed")
        if self._internode and self._engine is None:
            raise RuntimeError(
                f"Buffer.{op}: {self.num_nodes} nodes of {self.ranks_per_node} ranks take the internode path, which "
                f"needs both windows: num_nvl_bytes={self.num_nvl_bytes} and num_rdma_bytes={self.num_rdma_bytes} "
                f"(size them with Buffer.get_normal_buffer_size_hint and get_normal_rdma_buffer_size_hint)")
        if self._engine is None:
            raise RuntimeError(f"Buffer.{op}: this Buffer has no UBMEM window (num_nvl_bytes=0); build it with "
                               f"num_nvl_bytes >= Buffer.get_normal_buffer_size_hint(...) or a DeepEP config hint")
        if self._internode and not self._engine.windows_hold_headers():
            raise ValueError(
                f"Buffer.{op}: num_nvl_bytes={self.num_nvl_bytes} / num_rdma_bytes={self.num_rdma_bytes} are too small "
                f"for the internode path's headers alone ({self._engine.min_window_bytes()}); see "
                f"Buffer.get_normal_buffer_size_hint and get_normal_rdma_buffer_size_hint")
        if not self._internode and self._engine.half_bytes < HEADER_BYTES + 128:
            raise ValueError(f"Buffer.{op}: num_nvl_bytes={self.num_nvl_bytes} is too small for any call (each "
                             f"half-window needs {HEADER_BYTES} B of header plus rows); see "
                             f"Buffer.get_normal_buffer_size_hint")

    # -- static helpers ------------------------------------------------------------
    @staticmethod
    def is_sm90_compiled() -> bool:
        """FP8 paths are available (always True on CPU; mirrors ``deep_ep.Buffer.is_sm90_compiled``)."""
        return True

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Set the class-wide ``num_sms``; channels per rank are ``num_sms // 2`` (see :class:`Config`).

        Raises:
            AssertionError: ``new_num_sms`` is odd.
        """
        assert new_num_sms % 2 == 0, "The SM count must be even"
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An event recorded now on the caller's thread (complete: CPU work before it has run)."""
        return EventOverlap(EventHandle())

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """DeepEP's recommended dispatch config (``AssertionError`` for rank counts outside its table)."""
        return dispatch_config(Buffer.num_sms, num_ranks)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """DeepEP's recommended combine config (``AssertionError`` for rank counts outside its table)."""
        return combine_config(Buffer.num_sms, num_ranks)

    @staticmethod
    def get_normal_buffer_size_hint(num_max_tokens_per_rank: int, hidden: int, num_ranks: int, num_topk: int = 0,
                                    num_experts: int = 0, x_itemsize: int = 2, num_scale_cols: int = 0,
                                    ranks_per_node: int | None = None) -> int:
        """``num_nvl_bytes`` for which normal-mode calls of up to ``num_max_tokens_per_rank`` tokens never chunk.

        Worst case: every rank sends all its tokens to one rank. Any smaller window of at least
        a few rows also works: payloads then stream through it in rounds. FP8 dispatch: pass
        ``x_itemsize=1`` and ``num_scale_cols = hidden // 128``. ``ranks_per_node`` below
        ``num_ranks`` sizes the internode path (then also see
        :meth:`get_normal_rdma_buffer_size_hint`). Returns bytes, a multiple of 128.
        """
        (num_max_tokens_per_rank, hidden, num_ranks, num_topk, num_experts, x_itemsize, num_scale_cols,
         ranks_per_node) = map(as_int, (num_max_tokens_per_rank, hidden, num_ranks, num_topk, num_experts, x_itemsize,
                                        num_scale_cols, ranks_per_node))  # (numpy values would overflow below)
        if ranks_per_node is not None and ranks_per_node < num_ranks:
            return InternodeEngine.size_hints(num_max_tokens_per_rank, hidden * x_itemsize, 4 * num_scale_cols,
                                              num_topk, num_experts, num_ranks, num_ranks // ranks_per_node,
                                              2 * hidden, num_topk)[0]
        size = IntranodeEngine.size_hint(num_max_tokens_per_rank, hidden * x_itemsize, 4 * num_scale_cols,
                                         num_topk, num_experts, num_ranks, 2 * hidden, num_topk)
        return align(size, 128)

    @staticmethod
    def get_normal_rdma_buffer_size_hint(num_max_tokens_per_rank: int, hidden: int, num_ranks: int,
                                         ranks_per_node: int, num_topk: int = 0, num_experts: int = 0,
                                         x_itemsize: int = 2, num_scale_cols: int = 0) -> int:
        """``num_rdma_bytes`` (URMA window) for which internode calls of that many tokens never chunk.

        The URMA window holds, per half, one box per node for what the rail peer there sends
        (dispatch: each token once per node; combine: one partial row per token). Returns 0 for
        one node. Bytes, a multiple of 128; arguments as :meth:`get_normal_buffer_size_hint`.
        Plays the part of DeepEP's ``Config.get_rdma_buffer_size_hint`` (whose layout differs).
        """
        (num_max_tokens_per_rank, hidden, num_ranks, ranks_per_node, num_topk, num_experts, x_itemsize,
         num_scale_cols) = map(as_int, (num_max_tokens_per_rank, hidden, num_ranks, ranks_per_node, num_topk,
                                        num_experts, x_itemsize, num_scale_cols))
        if ranks_per_node >= num_ranks:
            return 0
        return InternodeEngine.size_hints(num_max_tokens_per_rank, hidden * x_itemsize, 4 * num_scale_cols,
                                          num_topk, num_experts, num_ranks, num_ranks // ranks_per_node,
                                          2 * hidden, num_topk)[1]

    def get_comm_stream(self) -> Worker:
        """The Buffer's worker, the CPU analogue of DeepEP's communication stream, with ``torch.Stream``'s
        methods (``query``, ``synchronize``, ``wait_event``, ``wait_stream``, ``record_event``)."""
        return self._worker

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: torch.Size | None = None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> torch.Tensor:
        """A zero-copy view of this rank's UBMEM window from byte ``offset``.

        Returns 1-D of ``(num_nvl_bytes - offset) // itemsize`` elements, or the first
        ``size.numel()`` of them reshaped to ``size``. Drop the view before :meth:`destroy`.
        Raises:
            RuntimeError: no window, ``use_rdma_buffer`` (no URMA window yet), or out of range.
        """
        if use_rdma_buffer:
            raise RuntimeError("Buffer.get_local_buffer_tensor: this Buffer has no RDMA (URMA) buffer")
        self._check_usable("get_local_buffer_tensor")
        itemsize = torch.empty(0, dtype=dtype).element_size()
        count = (self.num_nvl_bytes - offset) // itemsize
        if size is not None:
            count = torch.Size(size).numel()
        if offset < 0 or count < 0 or offset + count * itemsize > self.num_nvl_bytes or offset % itemsize:
            raise RuntimeError(f"Buffer.get_local_buffer_tensor: offset {offset} B and {count} x {dtype} do not fit "
                               f"the {self.num_nvl_bytes} B buffer (offset must be a multiple of {itemsize})")
        view = self.runtime.local_view(self._win, offset, count * itemsize, dtype)
        return view if size is None else view.view(size)

    def get_traffic(self, lifetime: bool = False) -> dict[str, int]:
        """Bytes moved by this rank's operations, per channel kind: ``{'SELF': n, 'UBMEM': n, 'URMA': n}``.

        Each transfer is counted once, by the rank whose load or store moved it (here, receivers
        gathering from the sender's window); SELF is data a rank routes to itself. ``lifetime``:
        since construction; else the last completed dispatch/combine/low-latency call.
        Per peer and per message: :meth:`get_link_stats`.
        """
        if lifetime:
            return LinkStats.bytes_by_kind(self.runtime.stats.snapshot())
        last = self._last_call_traffic()
        if last is None:
            return {k.name: 0 for k in ChannelKind}
        return LinkStats.bytes_by_kind(last)

    def get_link_stats(self, lifetime: bool = False) -> dict[str, np.ndarray]:
        """This rank's link counters per (channel kind, peer), for the link model and projections.

        Returns ``{field: np.ndarray int64 [len(ChannelKind), num_ranks]}`` (a copy) with fields
        ``bytes_put`` (stored into the peer), ``bytes_fetched`` (loaded from the peer), ``puts``,
        ``gets``, ``signals``; rows indexed by ``transports.ChannelKind`` (SELF,
        UBMEM, URMA). ``lifetime``: since construction; else the last completed dispatch /
        combine / low-latency call (zeros before the first). Gather every rank's with
        ``transports.gather_link_stats`` and pass the result to ``transports.project``.
        No DeepEP counterpart (DeepEP exposes no per-link counters).
        """
        if lifetime:
            return self.runtime.stats.snapshot()
        last = self._last_call_traffic()
        if last is None:
            return {k: np.zeros_like(v) for k, v in self.runtime.stats.snapshot().items()}
        return {k: v.copy() for k, v in last.items()}

    def _keep_traffic(self, before: np.ndarray) -> None:
        """Keep a finished call's counters: ``before`` (``copy_counters()`` before it) and a copy taken now,
        differenced when first read (:meth:`_last_call_traffic`)."""
        if _PH.on:
            _PH.switch("counters")
        self._last_traffic = (self.runtime.stats.copy_counters(), before)
        if _PH.on:
            _PH.switch(None)

    def _last_call_traffic(self) -> dict | None:
        """The last call's counters: a normal-mode call keeps ``(after, before)`` snapshots, differenced here
        when first read (most calls' never are)."""
        if isinstance(self._last_traffic, tuple):
            self._last_traffic = LinkStats.diff_counters(*self._last_traffic)
        return self._last_traffic

    # -- layout ----------------------------------------------------------------------
    @timed("get_dispatch_layout", engine_of)
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, previous_event: EventOverlap | None = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False
                            ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, EventOverlap]:
        """Routing counts of ``topk_idx``; mirrors ``deep_ep.Buffer.get_dispatch_layout``
        (docs/semantics/deepep-api.md §4.1).

        Args:
            topk_idx: ``[N, K]`` ``topk_idx_t`` (int64), values in ``[-1, num_experts)``, -1 = none.
            num_experts: ``E``, a positive multiple of the number of ranks.
        Returns:
            ``(num_tokens_per_rank [R] int32, num_tokens_per_rdma_rank [num_nodes] int32 (tokens with
            an expert on each node; ``None`` on one node), num_tokens_per_expert [E] int32,
            is_token_in_rank [N, R] bool, event)``.
        Raises:
            TypeError / ValueError: bad dtype, shape or values. This call does not communicate, so
                only this rank raises; its peers then wait in their next ``dispatch`` until the
                deadline and raise ``TimeoutError`` naming this rank (pass the bad ``topk_idx`` to
                ``dispatch`` itself and every rank raises at once).
            RuntimeError: ``allocate_on_comm_stream`` without ``previous_event`` and ``async_finish``;
                the Buffer was destroyed.
        """
        num_experts = as_int(num_experts)
        if self.runtime is None:
            raise RuntimeError("Buffer.get_dispatch_layout: the Buffer was destroyed")
        if _PH.on:
            _PH.switch("checks")
        try:
            check_stream_args(previous_event, async_finish, allocate_on_comm_stream)
            # the ids' range: checked by the native layout's own pass where it runs (synchronous calls)
            check_topk_idx(topk_idx, num_experts, self.group_size, values=async_finish)
        except Rejected as rej:
            raise rej.exc from None
        if _PH.on:
            _PH.switch("layout")
        if not async_finish:
            if previous_event is not None and previous_event.event is not None:
                previous_event.event.current_stream_wait()
            try:
                ntpr, ntpe, itr = checked_dispatch_layout(topk_idx, num_experts, self.group_size)
            except Rejected as rej:
                raise rej.exc from None
            ntpn = self._tokens_per_node(itr)
            self._layout_stamp = stamp(topk_idx, ntpr, ntpn, ntpe, itr)
            return ntpr, ntpn, ntpe, itr, EventOverlap()
        n = topk_idx.size(0)
        ntpr = torch.empty(self.group_size, dtype=torch.int32)
        ntpe = torch.empty(num_experts, dtype=torch.int32)
        itr = torch.empty(n, self.group_size, dtype=torch.bool)
        ntpn = torch.empty(self.num_nodes, dtype=torch.int32) if self._internode else None

        def work():
            if previous_event is not None and previous_event.event is not None:
                previous_event.event.current_stream_wait()
            for out, value in zip((ntpr, ntpe, itr), dispatch_layout(topk_idx, num_experts, self.group_size)):
                out.copy_(value)
            if ntpn is not None:
                ntpn.copy_(self._tokens_per_node(itr))
            self._layout_stamp = stamp(topk_idx, ntpr, ntpn, ntpe, itr)

        fut = self._worker.submit(work)
        return ntpr, ntpn, ntpe, itr, EventOverlap(EventHandle(fut), (topk_idx, ntpr, ntpe, itr))

    def _tokens_per_node(self, is_token_in_rank: torch.Tensor) -> torch.Tensor | None:
        """``num_tokens_per_rdma_rank [num_nodes]`` int32: tokens with an expert on each node (None: one node)."""
        if not self._internode:
            return None
        return tokens_per_node(is_token_in_rank, self.num_nodes, self.ranks_per_node)

    # -- what the checks need of this Buffer ------------------------------------------------
    def _config(self, config, which: Callable[[int], Config]) -> Config:
        """``config`` checked, or DeepEP's recommended one for this rank count (``which``), else DeepEP's defaults
        (made once per Buffer: the engines only read it)."""
        if config is None and which in self._default_configs:
            return self._default_configs[which]

        def default() -> Config:
            try:
                made = which(self.group_size)
            except AssertionError:  # rank counts outside DeepEP's table
                made = Config(Buffer.num_sms)
            self._default_configs[which] = made
            return made
        return check_config(config, default)

    def _check_handle(self, handle, config: Config, op: str) -> tuple[NormalHandle, int]:
        """``(handle converted to its named type, id of the dispatch that made it)``; raises ``Rejected``.

        A handle this Buffer's synchronous dispatch returned, its entries the very tensors it made and none
        written since through torch (its origin's seal), with the config's channels, keeps its dtypes and
        shapes: of the full check only the rows it promises are read again (:func:`check_handle_rows`, which a
        write through ``.numpy()`` could have changed unseen)."""
        origin = self._made_here(handle, config)
        if origin is not None and origin.sealed:
            if stamp_matches(origin.sealed, *handle):
                check_handle_rows(handle, self.rank)
                return handle, origin.dispatch_id
            # An entry edited in place still passes the full check when its counts are kept (two entries of
            # is_token_in_rank swapped), and this rank would then sum other rows than the dispatch routed.
            k = written_since(origin.sealed, *handle)
            check(k < 0, ValueError, lambda: (
                f"`handle.{handle._fields[k]}` was written in place after the dispatch that made the handle (call "
                f"#{origin.dispatch_id}); a handle is read-only: pass it as the dispatch returned it"))
        if self._internode:
            return check_internode_handle(handle, config, op, num_ranks=self.group_size, num_nodes=self.num_nodes,
                                          buffer_id=self._uid)
        return check_intranode_handle(handle, config, op, rank=self.rank, num_ranks=self.group_size,
                                      buffer_id=self._uid)

    def _own_handle(self, handle, config: Config, op: str) -> tuple[NormalHandle, int]:
        """:meth:`_check_handle` for the engine handle an ``EPHandle`` of this Buffer holds: made by this
        Buffer's dispatch (its origin says so) and never handed to the caller, it was valid when made, so
        only its origin is read (validated once). Any other handle gets the full check."""
        origin = self._made_here(handle, config)
        if origin is not None:
            return handle, origin.dispatch_id
        return self._check_handle(handle, config, op)

    def _made_here(self, handle, config: Config) -> HandleOrigin | None:
        """The origin of ``handle`` when this Buffer's dispatch made it, with ``config``'s channels and this
        Buffer's kind of handle; else None."""
        origin = origin_of(handle) if isinstance(handle, (IntranodeHandle, InternodeHandle)) else None
        if (origin is not None and origin.buffer_id == self._uid and origin.num_channels == config.num_channels
                and isinstance(handle, InternodeHandle) == self._internode):
            return origin
        return None

    def _combine_input(self, rows: int, hidden: int) -> torch.Tensor:
        """An uninitialised ``[rows, hidden]`` bf16 tensor for a combine's ``x`` that ``EPBuffer`` computes
        itself: in the landing segment on one node (the peers then read it in place, no staging copy), else
        private memory."""
        shared = None if self._internode else self._engine.shared_empty(rows, hidden)
        return shared if shared is not None else torch.empty((rows, hidden), dtype=torch.bfloat16)

    def _check_dispatch_room(self, xb: int, sb: int, k: int, num_experts: int, cached: bool) -> None:
        """The windows hold one token of ``xb`` + ``sb`` bytes with ``k`` top-k slots per round; raises ``Rejected``."""
        if self._internode:
            check(self._engine.dispatch_capacity(xb, sb, k, num_experts, cached=cached) >= 1, ValueError,
                  lambda: f"num_rdma_bytes={self.num_rdma_bytes} is too small for one token per node box; "
                  + self._size_advice("get_normal_rdma_buffer_size_hint"))
            return
        regions = self._engine.dispatch_regions(xb, sb, k, num_experts, cached=cached)
        check(regions.capacity >= 1, ValueError,
              lambda: f"num_nvl_bytes={self.num_nvl_bytes} is too small for one token of {regions.row_bytes} B per "
              f"half-window; " + self._size_advice("get_normal_buffer_size_hint"))

    def _check_combine_room(self, hidden: int, wcols: int) -> None:
        """The windows hold a combine round of ``hidden`` bf16 columns and ``wcols`` weights; raises ``Rejected``."""
        if self._internode:
            check(self._engine.combine_capacity(hidden, wcols) >= 1, ValueError,
                  lambda: f"num_nvl_bytes={self.num_nvl_bytes} / num_rdma_bytes={self.num_rdma_bytes} are too small: "
                  f"combine needs room for {self.group_size - self.num_nodes} staged rows of "
                  f"{2 * hidden + 4 * max(wcols, 0)} B per UBMEM half-window and one partial row per node box; "
                  + self._size_advice("get_normal_buffer_size_hint"))
            return
        regions = self._engine.combine_regions(2 * hidden, wcols)
        check(regions.capacity >= self.group_size, ValueError,
              lambda: f"num_nvl_bytes={self.num_nvl_bytes} is too small: combine needs room for {self.group_size} "
              f"rows of {regions.row_bytes} B per half-window; " + self._size_advice("get_normal_buffer_size_hint"))

    def _size_advice(self, v1_hint: str) -> str:
        """Where a room error sends the user: V1's hint, or, for the windows an ``EPBuffer`` split its
        ``num_bytes`` into (sized for the constructor's shape), that class's hint."""
        if self.api_name == "Buffer":
            return f"see Buffer.{v1_hint}"
        return (f"these are the windows {self.api_name}'s num_bytes was split into (sized for the constructor's "
                f"num_max_tokens_per_rank, hidden and num_topk): pass a larger num_bytes, see "
                f"{self.api_name}.get_buffer_size_hint")

    # -- execution -----------------------------------------------------------------------
    def _protocol(self, op: int, build: Callable[[int], Generator], async_finish: bool, previous_event,
                  allocate_on_comm_stream: bool, extra: tuple, comm_before_outputs: bool,
                  inputs: dict | None = None, after: Callable[[tuple], None] | None = None
                  ) -> tuple[tuple, EventOverlap]:
        """Validate with ``build`` (returns a generator or raises ``Rejected``), then run it.

        ``comm_before_outputs``: the generator's first ``next()`` communicates (the count exchange of a
        dispatch whose shapes depend on the counts), so it runs on the caller's thread after the worker
        drained; else only the rest does, which with ``async_finish`` runs on the worker and so makes
        progress without the caller (docs/semantics/deepep-api.md §3.4). ``after(outputs)``: runs once the
        data movement completed (inline, or on the worker: then its error is raised at the event's
        wait); its error concerns this rank only, so the peers are not aborted.

        A rejection still takes part in the call's first round, so every rank raises. ``inputs``: the
        caller's tensors the worker reads after an ``async_finish`` call returns, by argument name; one
        written in place before the event completes fails the call (:class:`InputGuard`), checked when the
        worker is done with them and again at the wait, and aborts the peers (their rows may be wrong). The
        wait of an ``async_finish`` call also raises if a peer aborted meanwhile (:meth:`_at_wait`).
        """
        self._calls += 1
        call_id = self._calls
        tag = self._tag_call(CALL_NORMAL, op)
        if op != OP_DISPATCH and self._filling is not None:
            # this call's checks read a handle by value: one from an async worst-token dispatch is complete only
            # once that dispatch's worker task is (docs/semantics/deepep-api.md §3.4)
            if not self._filling.done():
                self._worker.drain()
            self._filling = None
        if isinstance(previous_event, EventOverlap) and previous_event.event is not None:
            # Arguments are validated by value, so they must be complete: wait for their producer.
            previous_event.event.current_stream_wait()
        if _PH.on:
            _PH.switch("checks")
        try:
            check_stream_args(previous_event, async_finish, allocate_on_comm_stream)
            gen = build(call_id)
        except Exception as err:  # nothing shared was touched: reject in the first round, then raise
            exc = err.exc if isinstance(err, Rejected) else err
            self._worker.drain()
            try:
                self._guard(lambda: self._engine.reject(op, call_id, f"rank {self.rank}: {type(exc).__name__}: {exc}"))
            except CallMismatch:
                raise  # the peers are in another kind of call: that, not this rank's refusal, is what failed
            except ConsensusError:  # the round's end on every rank: each raises, this rank its own error
                raise refused_on_every_rank(exc) from None
            raise exc from None
        if _PH.on:
            _PH.switch(None)
        if comm_before_outputs or not async_finish:
            self._worker.drain()
        if _PH.on:
            _PH.switch("counters")
        before = self.runtime.stats.copy_counters()
        if _PH.on:
            _PH.switch(None)
        outputs = self._guard(lambda: next(gen))
        guard = InputGuard(f"rank {self.rank}: {OP_NAMES[op]} call #{call_id}", inputs or {}) if async_finish \
            else None
        if _PH.on:
            _PH.switch(None)

        # (the generator and the outputs are arguments, not closure cells: a failed task's traceback, which its
        # future keeps, then holds them in frames the worker clears, not in this function's closure)
        def finish(gen, outputs, before=before):
            if not comm_before_outputs:
                before = self.runtime.stats.copy_counters()
            with self._waits_of(tag):
                self._guard(lambda: [None for _ in gen])
            if guard:
                self._guard(guard.check)
            self._keep_traffic(before)
            if after is not None:
                after(outputs)

        if async_finish:
            fut = self._worker.submit(finish, gen, outputs)
            if op == OP_DISPATCH and not comm_before_outputs:
                self._filling = fut
            on_wait = functools.partial(self._at_wait, guard, f"{OP_NAMES[op]} call #{call_id}: the event's wait")
            return outputs, EventOverlap(EventHandle(fut, on_wait), extra + tuple(t for t in _flatten(outputs)))
        finish(gen, outputs)
        return outputs, EventOverlap()

    def _guard(self, fn):
        """Run a protocol step with :func:`~deepep_ascend.ep.failure.run_step` (abort the peers on failure).

        Raises:
            CallMismatch: a peer is in a call of another kind at this one's place in the sequence of calls (the
                transport's ``TransportCallMismatch``, :meth:`_tag_call`); the Buffer is failed then.
        """
        return self._named_mismatch(lambda: run_step(self.runtime, self.rank, fn))

    def _named_mismatch(self, fn):
        """``fn()``, its ``TransportCallMismatch`` raised as a :class:`CallMismatch` naming both calls."""
        try:
            return fn()
        except TransportCallMismatch as exc:
            raise CallMismatch(self._call_mismatch(exc)) from None

    #: ``(kind, op)`` of a tagged call (:meth:`_tag_call`) -> its name in messages
    _CALL_NAMES = {**{(CALL_NORMAL, op): f"{name} (normal mode)" for op, name in OP_NAMES.items()},
                   **{(CALL_LOW_LATENCY, op): f"{name} (low-latency mode)" for op, name in ll_mod.OP_NAMES.items()},
                   (CALL_BARRIER, 1): "barrier", (CALL_CLEAN, 1): "clean_low_latency_buffer",
                   (CALL_LOAD_BALANCE, 1): "lb_prefetch_weights", (CALL_LOAD_BALANCE, 2): "lb_reduce_grads",
                   (CALL_DESTROY, 1): "destroy"}

    def _tag_call(self, kind: int, op: int) -> int:
        """Count a collective call of ``kind`` (``protocol.CALL_*``: where the call waits) and its ``op`` code, and
        tag the transport with it (``Transport.set_call_tag``): a wait that finds a rank at the same call number in
        a call of another kind raises at once instead of at the deadline. Every rank counts the same calls in the
        same order, so two kinds never meet at one number unless the ranks' calls differ
        (docs/semantics/deepep-api.md §8). Returns the tag, for a worker or hook finishing the call later to adopt
        (``Transport.adopt_call_tag``)."""
        if self.runtime.state is State.CLOSED:  # (a destroy() that raised: the transport is gone all the same)
            raise RuntimeError(f"{self.api_name}.{self._CALL_NAMES.get((kind, op), 'call')}: the {self.api_name} "
                               f"was destroyed")
        self._tagged += 1
        self.runtime.set_call_tag(self._tagged, kind, op)
        return self.runtime.call_tag()

    def _waits_of(self, tag: int):
        """A block whose waits belong to the call tagged ``tag`` (``Transport.adopt_call_tag``; on the worker or in a
        hook, finishing a call the caller has gone on from), not to this rank's latest call."""
        return contextlib.nullcontext() if self.runtime is None else self.runtime.adopt_call_tag(tag)

    def _call_mismatch(self, exc: TransportCallMismatch) -> str:
        """The message of the ``ConsensusError`` raised for ``exc``: both calls by name (``_CALL_NAMES``)."""
        names = self._CALL_NAMES
        return (f"rank {self.rank}: ranks made different calls: this rank is in {names[exc.mine]}, rank {exc.peer} in "
                f"{names[exc.theirs]}, both the {ordinal(exc.seq)} collective call on this {self.api_name} (calls of "
                f"every kind counted); every rank must make the same calls in the same order "
                f"(docs/semantics/deepep-api.md §8). The {self.api_name} is failed: destroy it and build a new one")

    def _at_wait(self, guard: InputGuard | None, phase: str) -> None:
        """What the wait of an asynchronous call checks once its data movement completed: this rank's inputs
        (written in place: raise here, abort the peers), then whether a peer aborted meanwhile (a peer that
        wrote its inputs: raise here too), docs/semantics/deepep-api.md §3.3."""
        if guard:
            self._guard(guard.check)
        raise_if_a_peer_aborted(self.runtime, phase)

    # -- refusing a call ------------------------------------------------------------------
    _REFUSABLE = {"dispatch": OP_DISPATCH, "cached_dispatch": OP_CACHED_DISPATCH, "combine": OP_COMBINE,
                  "low_latency_dispatch": ll_mod.OP_DISPATCH, "low_latency_combine": ll_mod.OP_COMBINE}

    def refuse_call(self, op: str, error: Exception) -> None:
        """Take this rank's part in the collective call ``op`` as a rejection of its arguments, then raise ``error``.

        For wrappers with checks of their own (``deepep_ascend.nn.autograd``): a wrapper that raised before
        calling the Buffer would leave the peers waiting in the call (or matched with this rank's next
        one). Instead it calls this in place of the call: the peers' matching call raises a
        ``ConsensusError`` naming this rank and ``error`` (the same first round as a refusal by the
        Buffer's own checks, docs/semantics/deepep-api.md §8), and the Buffer stays usable. Not in DeepEP.

        Args:
            op: the call refused: ``"dispatch"``, ``"cached_dispatch"`` (``dispatch(handle=...)``),
                ``"combine"``, ``"low_latency_dispatch"`` or ``"low_latency_combine"``.
            error: the exception this rank raises.
        Raises:
            ``error`` (always); ``ValueError`` for an unknown ``op``; ``RuntimeError`` when the Buffer was
            destroyed (no round then).
        """
        if op not in self._REFUSABLE:
            raise ValueError(f"Buffer.refuse_call: `op` must be one of {sorted(self._REFUSABLE)}, got {op!r}")
        code = self._REFUSABLE[op]
        if op.startswith("low_latency"):
            ll = self._ll_usable(op)
            if ll.pending_hook is None:  # (else the engine refuses the call here, before any round)
                self._tag_call(CALL_LOW_LATENCY, code)
            self._worker.drain()

            def refuse():
                self._guard(lambda: ll.reject(code, f"{type(error).__name__}: {error}"))
        else:
            if self.runtime is None:
                raise RuntimeError(f"Buffer.{op}: the Buffer was destroyed")
            self._calls += 1
            self._tag_call(CALL_NORMAL, code)
            self._worker.drain()
            self._filling = None

            def refuse():
                self._guard(lambda: self._engine.reject(code, self._calls,
                                                        f"rank {self.rank}: {type(error).__name__}: {error}"))
        try:
            refuse()
        except CallMismatch:
            raise  # the peers are in another kind of call: that, not this refusal, is what failed
        except ConsensusError:
            pass  # a normal engine's refusal ends in the error every rank raises; this rank raises its own
        except Exception as exc:  # the round itself failed (a peer missing): this rank's error, and why
            raise error from exc
        raise refused_on_every_rank(error)

    def _receive_for_hook(self, state: dict, op: int, receive: Callable[[], None]) -> None:
        """The receive of the low-latency call whose hook is pending (``self._hook_receive``), run by the hook or by
        this rank's next low-latency call (which is refused; the hook then returns at once, or raises this
        receive's error, which is raised here too). ``state["received"]`` records which."""
        self._hook_receive = None
        self._ll.pending_hook = None
        try:
            timed_call(_HOOK_OPS[op], receive)
        except BaseException as exc:
            state["received"] = exc
            raise
        state["received"] = True

    # -- dispatch ------------------------------------------------------------------------
    @timed("dispatch", engine_of)
    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Config | None = None,
                 previous_event: EventOverlap | None = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False
                 ) -> tuple[Rows, torch.Tensor | None, torch.Tensor | None, list[int] | None, NormalHandle | None,
                            EventOverlap]:
        """Send each token to every rank owning one of its experts; mirrors ``deep_ep.Buffer.dispatch``
        (docs/semantics/deepep-api.md §4.2-4.5).

        Args:
            x: ``[N, H]`` tensor (BF16, or any dtype, moved as bytes) or the FP8 pair
                ``(data [N, H] float8_e4m3fn, scales [N, H/128] float32 | [N, ceil(H/512)] int32)``,
                scales of any strides; FP8 needs ``H % 128 == 0``.
            handle: a previous dispatch's handle for a cached dispatch (then no layout or top-k args);
                any tuple of its entries in DeepEP's order is accepted.
            num_tokens_per_rank: ``[R]`` int32, from :meth:`get_dispatch_layout`.
            num_tokens_per_rdma_rank: ``[num_nodes]`` int32 from :meth:`get_dispatch_layout` when the
                ranks span several nodes (the internode path), else ``None``.
            is_token_in_rank: ``[N, R]`` bool.
            num_tokens_per_expert: ``[E]`` int32.
            topk_idx: ``[N, K]`` int64 with -1 for none (an expert may repeat in a row: each slot counts,
                docs/semantics/deepep-api.md §0); with ``topk_weights`` ``[N, K]`` float32, or neither.
            expert_alignment: each count of ``num_recv_tokens_per_expert_list`` is rounded up to it (an int in
                ``[1, 2**31 - 1]``, DeepEP's 32-bit type).
            num_worst_tokens: if > 0 (needs top-k), outputs have exactly this many rows
                (zero rows, expert id -1 after the real ones) and the list is ``[]``.
            config: a :class:`Config` (default :meth:`get_dispatch_config`); ``num_sms // 2`` channels.
            previous_event, async_finish, allocate_on_comm_stream: as in DeepEP; with
                ``async_finish`` the data movement runs on the Buffer's worker and the returned
                event must be waited on before using the outputs. Until then the worker reads ``x``,
                ``topk_idx``, ``topk_weights`` and ``is_token_in_rank``: leave them untouched (DeepEP's
                rule); one written in place makes the wait raise ``RuntimeError`` naming it and the
                peers fail too (docs/semantics/deepep-api.md §3.3). With ``num_worst_tokens > 0`` the call
                returns before any communication and the worker exchanges the counts too, so the call
                completes while the caller does something else, another collective included; without it
                the counts fix the outputs' shapes and the call exchanges them before returning
                (docs/semantics/deepep-api.md §3.4).
        Returns:
            ``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event)``:
            ``recv_x`` ``[N_recv, H]`` like ``x`` (FP8: pair, scales contiguous); ``recv_topk_idx``
            ``[N_recv, K]`` int64 local expert ids or -1; ``recv_topk_weights`` ``[N_recv, K]``
            float32 (0 where -1); a list of ``L`` ints; the handle (docs/semantics/deepep-api.md §4.3), DeepEP's 6-tuple
            as an :class:`~deepep_ascend.ep.handles.IntranodeHandle` (across nodes its 10-tuple, an
            :class:`~deepep_ascend.ep.handles.InternodeHandle`). Rows are grouped by source rank, then
            source token order. Cached: ``(recv_x, None, None, None, None, event)``.
        Raises:
            TypeError / ValueError: bad arguments on any rank: every rank raises (the rank at
                fault its own error, the others a ``ValueError`` naming it).
            RuntimeError: no UBMEM window, ``num_worst_tokens`` below the received count (raised by this rank
                only, once the call completed: with ``async_finish``, at the event's wait), DeepEP's
                stream-argument checks; at the wait of an ``async_finish`` call, an input written in place
                before it.
            TimeoutError: a peer did not take part in time (``transports.TransportTimeout``, or
                ``transports.TransportPeerTimeout`` when a peer gave up first; both name the ranks).
            transports.TransportAborted: a peer failed inside the call (at the wait of an ``async_finish``
                call: also a peer that aborted after this rank's share completed, e.g. one that wrote its
                inputs in place); ``TransportPoisoned``: this Buffer failed earlier.
        """
        expert_alignment, num_worst_tokens = as_int(expert_alignment), as_int(num_worst_tokens)
        self._check_usable("dispatch")
        if handle is not None:
            return self._cached_dispatch(x, handle, topk_idx, topk_weights, config, previous_event, async_finish,
                                         allocate_on_comm_stream, num_tokens_per_rank, is_token_in_rank,
                                         num_tokens_per_expert)
        ctx = {}
        # Worst-token mode: every output shape is static, so the engine yields before the count exchange
        # and an async call moves on the worker without the caller (docs/semantics/deepep-api.md §3.4).
        static = isinstance(num_worst_tokens, int) and num_worst_tokens > 0

        def build(call_id):
            cfg = self._config(config, Buffer.get_dispatch_config)
            data, scales = check_x(x)
            num_experts = check_dispatch_layout_args(
                data.size(0), num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank, num_tokens_per_expert,
                topk_idx, topk_weights, num_ranks=self.group_size, num_nodes=self.num_nodes,
                ranks_per_node=self.ranks_per_node,
                from_layout=stamp_matches(self._layout_stamp, topk_idx, num_tokens_per_rank, num_tokens_per_rdma_rank,
                                           num_tokens_per_expert, is_token_in_rank))
            check_dispatch_options(expert_alignment, num_worst_tokens, topk_idx is not None)
            k = topk_idx.size(1) if topk_idx is not None else 0
            xb, sb = _row_bytes(data, scales)
            self._check_dispatch_room(xb, sb, k, num_experts, cached=False)
            if static:  # (rows, scales, top-k ids and weights, source index)
                check_worst_tokens_fit(num_worst_tokens, xb + sb + 12 * k + 4)
            ctx.update(cfg=cfg, data=data, scales=scales, call_id=call_id)
            path_args = {"num_tokens_per_rdma_rank": num_tokens_per_rdma_rank} if self._internode else {}
            return self._engine.dispatch(
                call_id=call_id, x=_as_rows_of_bytes(data),
                scales=None if scales is None else _as_rows_of_bytes(scales),
                topk_idx=topk_idx, topk_weights=topk_weights, is_token_in_rank=is_token_in_rank,
                num_tokens_per_rank=num_tokens_per_rank, num_tokens_per_expert=num_tokens_per_expert,
                num_experts=num_experts, expert_alignment=expert_alignment, num_worst_tokens=num_worst_tokens,
                num_channels=cfg.num_channels, handle_id=-1, xdtype=dtype_code(data.dtype),
                sdtype=dtype_code(scales.dtype) if scales is not None else 0, **path_args)

        def check_worst(outputs):
            num_recv = int(outputs[6])
            if static and num_recv > num_worst_tokens:
                raise RuntimeError(f"rank {self.rank}: num_worst_tokens={num_worst_tokens} is below the {num_recv} "
                                   f"tokens this rank received")

        outputs, event = self._protocol(OP_DISPATCH, build, async_finish, previous_event, allocate_on_comm_stream,
                                        (x, topk_idx, topk_weights), comm_before_outputs=not static,
                                        inputs={"x": x, "topk_idx": topk_idx, "topk_weights": topk_weights,
                                                "is_token_in_rank": is_token_in_rank}, after=check_worst)
        recv_x, recv_scales, recv_topk, recv_w, recv_list, handle = outputs[:6]
        # sealed once complete (synchronous): an async dispatch still fills the handle on the worker
        record_origin(handle, HandleOrigin(self._uid, ctx["call_id"], ctx["cfg"].num_channels,
                                           stamp(*handle) if event.event is None else ()))
        return _typed_rows(recv_x, recv_scales, ctx["data"], ctx["scales"]), recv_topk, recv_w, recv_list, handle, event

    def _cached_dispatch(self, x, handle, topk_idx, topk_weights, config, previous_event, async_finish,
                         allocate_on_comm_stream, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert
                         ) -> tuple[Rows, None, None, None, None, EventOverlap]:
        ctx = {}

        def build(call_id):
            check(topk_idx is None and topk_weights is None, AssertionError,
                  "cached dispatch (handle=...) takes no topk_idx / topk_weights")
            check(num_tokens_per_rank is None and is_token_in_rank is None and num_tokens_per_expert is None,
                  ValueError, "cached dispatch (handle=...) takes no layout tensors")
            cfg = self._config(config, Buffer.get_dispatch_config)
            checked, handle_id = self._check_handle(handle, cfg, "dispatch")
            data, scales = check_x(x)
            n, made_for = data.size(0), checked.is_token_in_rank.size(0)
            check(n == made_for, ValueError, lambda: f"`x` has {n} tokens but the handle was made for {made_for}")
            self._check_dispatch_room(*_row_bytes(data, scales), 0, 0, cached=True)
            ctx.update(data=data, scales=scales)
            return self._engine.cached_dispatch(
                call_id=call_id, x=_as_rows_of_bytes(data),
                scales=None if scales is None else _as_rows_of_bytes(scales), handle=checked,
                num_channels=cfg.num_channels, handle_id=handle_id, xdtype=dtype_code(data.dtype),
                sdtype=dtype_code(scales.dtype) if scales is not None else 0)

        (recv_x, recv_scales), event = self._protocol(OP_CACHED_DISPATCH, build, async_finish, previous_event,
                                                      allocate_on_comm_stream, (x,), comm_before_outputs=False,
                                                      inputs={"x": x})
        return _typed_rows(recv_x, recv_scales, ctx["data"], ctx["scales"]), None, None, None, None, event

    # -- combine ---------------------------------------------------------------------------
    @timed("combine", engine_of)
    def combine(self, x: torch.Tensor, handle, topk_weights: torch.Tensor | None = None, bias=None,
                config: Config | None = None, previous_event: EventOverlap | None = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, EventOverlap]:
        """Return every received row to its origin and sum; mirrors ``deep_ep.Buffer.combine``
        (docs/semantics/deepep-api.md §4.6).

        Per original token: ``acc = f32(bias0) + f32(bias1)`` (missing = 0), then ``acc += f32(row)``
        for each rank that received it, in ascending rank order; output ``bf16(acc)``. No
        weights are applied to ``x``.

        Args:
            x: ``[len(handle.recv_src_idx), H]`` bfloat16, rows in dispatch order (rows past the
                real received count, from ``num_worst_tokens``, are ignored). Never modified. On one
                node, a contiguous ``x`` that lies in this Buffer's landing segment (``recv_x`` itself,
                or expert outputs written into it) is read by the peers in place, without a staging
                copy; the call then completes (with ``async_finish``: its event) only once every peer
                has read it, and if it fails first, the peers that read it raise too.
            handle: the dispatch's handle (:class:`~deepep_ascend.ep.handles.IntranodeHandle` or
                :class:`~deepep_ascend.ep.handles.InternodeHandle`, or a tuple of the same entries).
            topk_weights: optional ``[rows, K']`` float32, summed the same way (unrounded).
            bias: ``None``, a tensor, or a pair of tensors (each may be None), each ``[N, H]`` bfloat16.
            config: default :meth:`get_combine_config`; must have the handle's channel count.
            previous_event, async_finish, allocate_on_comm_stream: as in :meth:`dispatch`; with
                ``async_finish``, ``x``, ``topk_weights`` and ``bias`` are read until the event completes.
        Returns:
            ``(combined_x [N, H] bf16, combined_topk_weights [N, K'] float32 | None, event)``.
        Raises:
            TypeError / ValueError: bad arguments or a handle from another Buffer/config, on any
                rank (every rank raises).
            RuntimeError: the handles passed on different ranks come from different dispatches; at the
                wait of an ``async_finish`` call, an input written in place before it (see :meth:`dispatch`).
            TimeoutError: a peer did not take part in time (see :meth:`dispatch`).
            transports.TransportAborted / TransportPoisoned: as in :meth:`dispatch`.
        """
        self._check_usable("combine")

        def build(call_id):
            cfg = self._config(config, Buffer.get_combine_config)
            checked, handle_id = self._check_handle(handle, cfg, "combine")
            if self._internode:
                rows, rows_name = checked.recv_src_meta.size(0), "len(handle.recv_src_meta)"
            else:
                rows, rows_name = checked.recv_src_idx.numel(), "len(handle.recv_src_idx)"
            biases, wcols = check_combine_args(x, topk_weights, bias, rows=rows, rows_name=rows_name,
                                               num_tokens=checked.is_token_in_rank.size(0))
            self._check_combine_room(x.size(1), wcols)
            return self._engine.combine(
                call_id=call_id, x=x.contiguous(),
                topk_weights=None if topk_weights is None else topk_weights.contiguous(),
                bias=biases, handle=checked, num_channels=cfg.num_channels, handle_id=handle_id)

        (combined, combined_w), event = self._protocol(OP_COMBINE, build, async_finish, previous_event,
                                                        allocate_on_comm_stream, (x, topk_weights, bias),
                                                        comm_before_outputs=False,
                                                        inputs={"x": x, "topk_weights": topk_weights, "bias": bias})
        return combined, combined_w, event

    # -- DeepEP's per-path entry points ------------------------------------------------------------------
    def _path(self, op: str, internode: bool) -> None:
        if self._internode != internode:
            where = f"{self.num_nodes} nodes" if self._internode else "one node"
            raise RuntimeError(f"Buffer.{op}: this Buffer spans {where}; call {op.split('_', 1)[1]}, which "
                               f"picks the path")

    def internode_dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                           is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                           expert_alignment: int = 1, config: Config | None = None, previous_event=None,
                           async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """``deep_ep.Buffer.internode_dispatch``: :meth:`dispatch` across nodes (``RuntimeError`` on one node)."""
        self._path("internode_dispatch", True)
        return self.dispatch(x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                             num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, 0, config,
                             previous_event, async_finish, allocate_on_comm_stream)

    def internode_combine(self, x: torch.Tensor, handle, topk_weights: torch.Tensor | None = None, bias=None,
                          config: Config | None = None, previous_event=None, async_finish: bool = False,
                          allocate_on_comm_stream: bool = False):
        """``deep_ep.Buffer.internode_combine``: :meth:`combine` across nodes (``RuntimeError`` on one node)."""
        self._path("internode_combine", True)
        return self.combine(x, handle, topk_weights, bias, config, previous_event, async_finish,
                            allocate_on_comm_stream)

    # -- the entry points of EPBuffer (deepep_ascend.ep.ep_buffer), on the same engines ----------------
    def _run_dispatch(self, *, precheck: Callable[[], tuple], num_worst_tokens: int, previous_event,
                      async_finish: bool, extra_words: dict,
                      inputs: dict | None = None) -> tuple[tuple, EventOverlap]:
        """A non-cached normal dispatch whose arguments ``precheck()`` validates inside the call's first
        round (a rejection raises on every rank, as :meth:`dispatch`'s checks do).

        ``precheck()`` returns ``(data [N, xb] uint8, scales [N, sb] uint8 | None, xdtype, topk_idx,
        topk_weights, num_experts, layout)``: ``layout`` the routing counts ``(num_tokens_per_rank,
        num_tokens_per_expert, is_token_in_rank)`` (:func:`~.arguments.checked_dispatch_layout`). Returns the
        engine's outputs ``(recv_x, recv_scales, recv_topk_idx, recv_topk_weights, recv_list, handle, num_recv,
        recv_counts)`` (``num_recv`` a 0-dim int64 tensor; ``recv_counts`` ``[E / R]`` int64: the (token, slot)
        pairs received per local expert; with ``num_worst_tokens > 0`` and ``async_finish`` both, these, the
        handle's prefix sums and the padding are filled by the worker, before the event completes), and the event
        (data movement on the worker with ``async_finish``). ``inputs``:
        the caller's tensors by name, guarded as in :meth:`_protocol`.
        """
        self._check_usable("dispatch")
        ctx = {}

        def build(call_id):
            data, scales, xdtype, topk_idx, topk_weights, num_experts, layout = precheck()
            cfg = Config(Buffer.num_sms)
            k = topk_idx.size(1)
            self._check_dispatch_room(data.size(1), 0 if scales is None else scales.size(1), k, num_experts,
                                      cached=False)
            ntpr, ntpe, itr = layout
            ctx.update(call_id=call_id, cfg=cfg)
            path_args = {"num_tokens_per_rdma_rank": self._tokens_per_node(itr)} if self._internode else {}
            return self._engine.dispatch(**path_args,
                call_id=call_id, x=data, scales=scales, topk_idx=topk_idx, topk_weights=topk_weights,
                is_token_in_rank=itr, num_tokens_per_rank=ntpr, num_tokens_per_expert=ntpe, num_experts=num_experts,
                expert_alignment=1, num_worst_tokens=num_worst_tokens, num_channels=cfg.num_channels,
                handle_id=-1, xdtype=xdtype, sdtype=dtype_code(torch.uint8) if scales is not None else 0,
                extra_words=extra_words)

        outputs, event = self._protocol(OP_DISPATCH, build, async_finish, previous_event, False, (),
                                        comm_before_outputs=not num_worst_tokens, inputs=inputs)
        record_origin(outputs[5], HandleOrigin(self._uid, ctx["call_id"], ctx["cfg"].num_channels))
        return outputs, event

    def _run_cached_dispatch(self, *, precheck: Callable[[], tuple], previous_event, async_finish: bool,
                             extra_words: dict, inputs: dict | None = None) -> tuple[tuple, EventOverlap]:
        """A cached dispatch validated by ``precheck()`` inside the first round; it returns ``(data, scales,
        xdtype, handle)`` (bytes rows as in :meth:`_run_dispatch`, ``handle`` a V1 handle of this Buffer).
        Returns ``((recv_x, recv_scales), event)``."""
        self._check_usable("dispatch")

        def build(call_id):
            data, scales, xdtype, handle = precheck()
            cfg = Config(Buffer.num_sms)
            checked, handle_id = self._own_handle(handle, cfg, "dispatch")
            self._check_dispatch_room(data.size(1), 0 if scales is None else scales.size(1), 0, 0, cached=True)
            return self._engine.cached_dispatch(
                call_id=call_id, x=data, scales=scales, handle=checked, num_channels=cfg.num_channels,
                handle_id=handle_id, xdtype=xdtype, sdtype=dtype_code(torch.uint8) if scales is not None else 0,
                extra_words=extra_words)

        return self._protocol(OP_CACHED_DISPATCH, build, async_finish, previous_event, False, (),
                              comm_before_outputs=False, inputs=inputs)

    def _run_combine(self, *, precheck: Callable[[], tuple], previous_event, async_finish: bool,
                     extra_words: dict, inputs: dict | None = None) -> tuple[tuple, EventOverlap]:
        """A combine validated by ``precheck()`` inside the first round; it returns ``(x [rows, H] bf16,
        topk_weights [rows, K] float32 | None, biases, handle, order [N, R] int64 | None)``. Returns
        ``((combined_x, combined_topk_weights), event)``."""
        self._check_usable("combine")

        def build(call_id):
            x, topk_weights, biases, handle, order = precheck()
            cfg = Config(Buffer.num_sms)
            checked, handle_id = self._own_handle(handle, cfg, "combine")
            self._check_combine_room(x.size(1), -1 if topk_weights is None else topk_weights.size(1))
            return self._engine.combine(call_id=call_id, x=x, topk_weights=topk_weights, bias=biases, handle=checked,
                                        num_channels=cfg.num_channels, handle_id=handle_id, order=order,
                                        extra_words=extra_words)

        return self._protocol(OP_COMBINE, build, async_finish, previous_event, False, (), comm_before_outputs=False,
                              inputs=inputs)

    # ==================================================================================
    # Low-latency mode (docs/semantics/deepep-api.md §6, §7): checks in low_latency_arguments.py, data movement in
    # low_latency.py
    # ==================================================================================
    def _ll_build(self, num_rdma_bytes: int, allow_ubmem: bool) -> ll_mod.LowLatencyEngine:
        """Constructor branch of ``low_latency_mode=True``: the LL windows from ``num_rdma_bytes``."""
        self.nvshmem_qp_depth = ll_mod.QP_DEPTH
        return ll_mod.LowLatencyEngine(self.runtime, num_rdma_bytes, allow_ubmem, self.enable_shrink)

    def _ll_usable(self, op: str) -> ll_mod.LowLatencyEngine:
        if self.runtime is None:
            raise RuntimeError(f"Buffer.{op}: the Buffer was destroyed")
        if getattr(self, "_ll", None) is None:
            raise RuntimeError(f"Buffer.{op}: this Buffer was not built in low-latency mode; build it with "
                               f"low_latency_mode=True and num_rdma_bytes >= "
                               f"Buffer.get_low_latency_rdma_size_hint(...)")
        return self._ll

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """``num_rdma_bytes`` an LL Buffer needs for calls of ``(M, H, E)`` — exactly what they use
        (docs/semantics/deepep-api.md §6.8).

        Both halves of ``[signals align(4E, 128) | send max(M·d, E·M·c) | recv E·M·max(d, c)]``
        with ``S = ceil(H/128)``, ``d = 16 + max(2H, H + 4S)``, ``c = 4S + 2H``, plus 1-128 bytes
        (DeepEP's rounding). A Buffer with fewer bytes refuses such calls (``ValueError``).
        """
        return ll_mod.size_hint(*map(as_int, (num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)))

    def _ll_run(self, op: int, validate: Callable[[], tuple], issue: Callable[..., ll_mod.Pending], async_finish: bool,
                return_recv_hook: bool, keep: tuple,
                inputs: dict | None = None) -> tuple[tuple, EventOverlap, Callable[[], None] | None]:
        """Validate (every rank learns of a rejection), issue the sends, then receive now, on the
        worker (``async_finish``) or in the returned hook. Returns ``(outputs, event, hook)``. ``inputs``:
        the caller's tensors the receive reads, guarded as in :meth:`_protocol`."""
        ll = self._ll
        # A call while a hook is pending is refused on every rank, in its first round; but first this rank receives
        # the pending call, as its hook would (which then returns at once): a peer reuses that call's half only once
        # every rank signalled the next call, which must mean every rank received this one.
        unheard = None if ll.pending_hook is None else ll.pending_hook + 1
        if unheard is not None:
            self._receive_for_hook(*self._hook_receive)
        tag = self._tag_call(CALL_LOW_LATENCY, op)
        self._worker.drain()
        if _PH.on:
            _PH.switch("checks")
        try:
            check(unheard is None, RuntimeError, lambda: (
                f"rank {self.rank}: LL call #{unheard} was still awaiting its receive hook (received now: the hook "
                f"returns at once); call the hook before issuing another low-latency call (two LL buffers: receive k, "
                f"then issue k+1, docs/semantics/deepep-api.md §6.6)"))
            check(not (async_finish and return_recv_hook), RuntimeError,
                  "async_finish and return_recv_hook cannot both be set (docs/semantics/deepep-api.md §6.5)")
            args = validate()
        except Rejected as rej:
            exc = rej.exc
            try:  # tell the peers, who then raise too (the Buffer stays usable)
                self._guard(lambda: ll.reject(op, f"{type(exc).__name__}: {exc}"))
            except CallMismatch:
                raise  # the peers are in another kind of call: that, not this rank's refusal, is what failed
            except Exception:  # noqa: BLE001, S110 - the peers' failure is reported by their own calls
                pass
            else:
                refused_on_every_rank(exc)
            raise exc from None
        if _PH.on:
            _PH.switch("counters")
        before = self.runtime.stats.copy_counters()
        if _PH.on:
            _PH.switch(None)
        if not (async_finish or return_recv_hook):  # issue and receive now: one guarded step
            pending = self._guard(lambda: _issue_and_receive(issue, args))
            self._keep_traffic(before)
            return pending.outputs, EventOverlap(), None
        pending = self._guard(lambda: issue(*args))
        seq = ll.calls - 1
        guard = InputGuard(f"rank {self.rank}: {ll_mod.call_name(op, seq)}", inputs or {})

        def receive():
            if _PH.on:
                _PH.switch(None)
            with self._waits_of(tag):
                self._guard(pending.receive)
            if return_recv_hook:  # the hook is this call's wait
                self._at_wait(guard, f"{ll_mod.call_name(op, seq)}: its receive hook")
            else:
                self._guard(guard.check)
            self._keep_traffic(before)

        if return_recv_hook:
            ll.pending_hook = ll.calls - 1
            state = {"called": False, "received": None}  # received: True, or the error, once _receive_for_hook ran
            self._hook_receive = (state, op, receive)

            def hook():
                if state["called"]:
                    raise RuntimeError(f"rank {self.rank}: this low-latency receive hook was already called "
                                       f"(call it exactly once, docs/semantics/deepep-api.md §6.5)")
                state["called"] = True
                if state["received"] is None:
                    self._receive_for_hook(state, op, receive)
                elif state["received"] is not True:  # the receive this rank's next call ran failed
                    raise state["received"]

            return pending.outputs, EventOverlap(), hook
        fut = self._worker.submit(receive)  # async_finish
        on_wait = functools.partial(self._at_wait, guard, f"{ll_mod.call_name(op, seq)}: the event's wait")
        event = EventOverlap(EventHandle(fut, on_wait), keep + tuple(_flatten(pending.outputs)))
        return pending.outputs, event, None

    @timed("low_latency_dispatch")
    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: torch.Tensor | None = None,
                             dispatch_wait_recv_cost_stats: torch.Tensor | None = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False
                             ) -> tuple[Rows, torch.Tensor, LowLatencyHandle, EventOverlap, Callable[[], None] | None]:
        """Send each (token, top-k slot) to its expert's fixed slot; mirrors ``deep_ep.Buffer.low_latency_dispatch``
        (docs/semantics/deepep-api.md §6.2).

        No collective and no count exchange: each rank writes its rows into the receivers'
        windows and signals once per receiver; a receiver waits for every (live) source.

        Args:
            x: ``[N, H]`` bfloat16, ``N <= M`` (any ``H``; FP8 needs ``H % 128 == 0``).
            topk_idx: ``[N, K]`` int64, ``-1`` = none; an expert listed twice in a row is two rows, one per
                slot, and no expert may be selected more than ``M`` times (docs/semantics/deepep-api.md §0).
            num_max_dispatch_tokens_per_rank: ``M``, the same on every rank (``< 65536``).
            num_experts: ``E``, a multiple of the number of ranks ``R``; ``L = E / R``.
            cumulative_local_expert_recv_stats: optional ``[L]`` int32, ``+= recv_count``.
            dispatch_wait_recv_cost_stats: optional ``[R]`` int64; entry ``s`` += **nanoseconds**
                from the start of the receive until source ``s``'s signal was seen (polling
                granularity <= 1 ms; DeepEP counts GPU cycles).
            use_fp8, round_scale, use_ue8m0: the cast of docs/semantics/deepep-api.md §6.4 (``use_ue8m0`` needs
                ``round_scale`` and ``H % 512 == 0``).
            async_finish: the receive runs on the Buffer's worker; wait on the event.
            return_recv_hook: only the sends run now; call the returned hook once to receive. Until
                then no other LL call may be issued (two halves: receive ``k``, then issue ``k+1``).
                ``x`` and ``topk_idx`` are read before the call returns (the sends), so DeepEP's rule of
                inputs untouched until the event or hook holds here without a guard.
        Returns:
            ``(recv_x, recv_count [L] int32, handle, event, hook)``: ``recv_x`` bf16 ``[L, R·M, H]``
            or ``(e4m3 [L, R·M, H], scales)`` with scales float32 ``[L, R·M, H/128]`` or int32
            ``[L, R·M, H/512]`` (UE8M0), column-major in the last two dims; rows of expert ``e``
            from source ``s`` ascending, then tokens/slots ascending; rows past ``recv_count`` are 0.
            ``handle`` a :class:`~deepep_ascend.ep.handles.LowLatencyHandle` ``(src_info [L, R·M] int32,
            layout_range [L, R] int64 (begin << 32 | count), M, H, E)``.
        Raises:
            TypeError / ValueError / AssertionError / RuntimeError: bad arguments (DeepEP's classes);
                the rank at fault raises its error, every other rank a ``ConsensusError``
                (``LowLatencyRefused``) naming it, also when ranks disagree on ``M``/``H``/``E``.
            RuntimeError: no LL window, a pending hook, or (the Buffer stays usable) all of the above.
            TimeoutError: a source missed the deadline (without ``enable_shrink``; names the rank).
        """
        num_max_dispatch_tokens_per_rank, num_experts = as_int(num_max_dispatch_tokens_per_rank), as_int(num_experts)
        ll = self._ll_usable("low_latency_dispatch")

        def validate():
            return check_low_latency_dispatch_args(
                x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, cumulative_local_expert_recv_stats,
                dispatch_wait_recv_cost_stats, use_fp8, round_scale, use_ue8m0, num_ranks=self.group_size,
                num_rdma_bytes=self.num_rdma_bytes, qp_depth=self.nvshmem_qp_depth)

        def issue(lay, route):
            return ll.dispatch(dense(x), dense(topk_idx), lay, bool(use_fp8), bool(round_scale),
                               bool(use_ue8m0), cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats,
                               route)

        (recv_x, recv_count, handle), event, hook = self._ll_run(ll_mod.OP_DISPATCH, validate, issue, async_finish,
                                                                 return_recv_hook, (x, topk_idx))
        return recv_x, recv_count, handle, event, hook

    @timed("low_latency_combine")
    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle,
                            use_logfmt: bool = False, zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: torch.Tensor | None = None,
                            combine_wait_recv_cost_stats: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, EventOverlap, Callable[[], None] | None]:
        """Return expert outputs to their tokens and reduce; mirrors ``deep_ep.Buffer.low_latency_combine``
        (docs/semantics/deepep-api.md §6.3).

        Per token: ``acc = 0`` (float32); for slots ``j = 0..K-1`` skipping -1 and masked owners,
        ``acc += f32(y_j) * w[t][j]``, ``y_j`` the row returned for slot ``j`` (an expert listed twice
        contributes both weighted rows, docs/semantics/deepep-api.md §0); output ``bf16(acc)``.

        Args:
            x: ``[L, R·M, H]`` bfloat16 in the dispatch's layout (with ``zero_copy`` only its shape
                is checked: the rows come from :meth:`get_next_low_latency_combine_buffer`).
            topk_idx, topk_weights: the dispatch's own ``[N, K]`` routing (int64) and float32 weights.
            handle: the dispatch's handle (or a tuple of the same entries).
            use_logfmt: rows travel LogFMT-10 encoded (docs/semantics/deepep-api.md §6.3; needs ``H % 128 == 0``): per
                128-channel group 10 bits per value plus 4 bytes of metadata, ``1.25H + H/32``
                bytes per row instead of ``2H`` (docs/semantics/deepep-api.md §11); a group with ``max|x| >= 1``, equal
                magnitudes or no nonzero value travels as BF16 (96 more bytes, exact). Lossy
                otherwise: a value within ``(2**step - 1) / (2**step + 1)`` (< 2.2%) of itself,
                ``step = (log2 amax - log2 amin) / 510`` of its group with ``amin`` the smallest
                nonzero magnitude, clipped to ``amax·2**-32`` (below that a value may become 0);
                decoded to float32 before the weighted sum. All ranks must pass the same value.
                See :func:`deepep_ascend.gemm.logfmt.logfmt10_encode` for the wire format.
            zero_copy: see above (not with ``use_logfmt``).
            out: optional ``[N, H]`` bf16 written and returned.
            combine_wait_recv_cost_stats: optional ``[R]`` int64, nanoseconds as in dispatch.
            async_finish, return_recv_hook: as in :meth:`low_latency_dispatch`. The receive (on the
                worker, or in the hook) reads ``topk_idx`` and ``topk_weights``: leave them untouched until
                the event completes or the hook returns (DeepEP's rule); one written in place before makes
                the wait or the hook raise ``RuntimeError`` naming it (docs/semantics/deepep-api.md §3.3).
        Returns:
            ``(combined_x [N, H] bf16, event, hook)``.
        Raises:
            as :meth:`low_latency_dispatch`, among them a ``topk_idx`` that selects some expert another number of
            times than the dispatch that made ``handle`` (``ValueError`` here, ``LowLatencyRefused`` on the
            peers; docs/semantics/deepep-api.md §6.3); ``ConsensusError`` (``LowLatencyRefused``) when the rows
            returned do not match this rank's ``topk_idx`` otherwise (the handle of an older dispatch).
        """
        ll = self._ll_usable("low_latency_combine")

        def validate():
            stale = ll.stale_zero_copy(handle) if zero_copy else None
            # This Buffer's last dispatch's own topk_idx and handle: checked then, routed then.
            route = ll.dispatched_route(topk_idx, handle)
            checked, lay, routed = check_low_latency_combine_args(
                x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, out, combine_wait_recv_cost_stats, stale,
                num_ranks=self.group_size, num_rdma_bytes=self.num_rdma_bytes, qp_depth=self.nvshmem_qp_depth,
                trusted=route is not None,
                dispatched_topk_idx=None if route is not None else ll.dispatched_topk_idx(handle))
            return checked, lay, route if route is not None else routed

        def issue(checked, lay, route):
            # A synchronous call sums this rank's own rows where they lie (x cannot change before it returns).
            return ll.combine(None if zero_copy else dense(x), dense(topk_idx),
                              dense(topk_weights), checked, lay, bool(zero_copy), out,
                              combine_wait_recv_cost_stats, bool(use_logfmt), route,
                              keep_own=not (async_finish or return_recv_hook))

        (combined,), event, hook = self._ll_run(ll_mod.OP_COMBINE, validate, issue, async_finish, return_recv_hook,
                                                (x, topk_idx, topk_weights),
                                                inputs={"topk_idx": topk_idx, "topk_weights": topk_weights})
        return combined, event, hook

    def get_next_low_latency_combine_buffer(self, handle) -> torch.Tensor:
        """bf16 ``[L, R·M, H]`` view of the send buffer the **next** LL call uses (docs/semantics/deepep-api.md §6.6b).

        Fill it, then call ``low_latency_combine(..., zero_copy=True)`` as the very next LL call
        (another LL call in between is refused: its data would sit in the other half; so is a zero-copy
        combine with no buffer handed out for it). The view
        is window memory: drop it before :meth:`destroy`. On one node, while the last LL call's hook or
        ``async_finish`` receive is pending, it returns once every peer has issued that call (peers may
        still read the call before it from this half until then).

        Raises:
            transports.TransportTimeout: (not with ``enable_shrink``) a peer did not issue that call by the
                deadline.
        """
        ll = self._ll_usable("get_next_low_latency_combine_buffer")
        try:
            # the handle's shape words say which layout; its layout_range values are not read here (the combine
            # that follows checks them, or trusts its own dispatch's), so only their type and shape are checked
            checked = check_low_latency_handle(handle, num_ranks=self.group_size, trusted=True)
            lay = low_latency_layout(checked.num_max_dispatch_tokens_per_rank, checked.hidden, checked.num_experts,
                                     num_ranks=self.group_size, num_rdma_bytes=self.num_rdma_bytes,
                                     op="get_next_low_latency_combine_buffer")
        except Rejected as rej:
            raise rej.exc from None
        if ll.native_path():  # an async_finish receive ends once every peer issued its call, as a hook's wait below
            self._worker.drain()
        return ll.combine_buffer(lay)

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Barrier of the live ranks; nothing to zero (signals are monotonic epochs, docs/semantics/deepep-api.md §6.1).

        Accepted for DeepEP compatibility and harmless anywhere between LL calls. With
        ``enable_shrink`` a rank missing the deadline is masked.

        Raises:
            ValueError: ``M``, ``H`` or ``E`` is not a positive int; RuntimeError: a receive hook of this rank is
                pending. Either after this rank took part in the barrier (which is all the call does), so that
                the peers' calls complete rather than wait for it; they do not raise.
        """
        num_max_dispatch_tokens_per_rank, hidden, num_experts = map(as_int, (num_max_dispatch_tokens_per_rank, hidden,
                                                                             num_experts))
        ll = self._ll_usable("clean_low_latency_buffer")
        problem = None
        for name, v in (("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank), ("hidden", hidden),
                        ("num_experts", num_experts)):
            if problem is None and (not isinstance(v, int) or v < 1):
                problem = ValueError(f"rank {self.rank}: clean_low_latency_buffer: {name} must be a positive int, "
                                     f"got {v!r} (this rank took part in the barrier)")
        if problem is None and ll.pending_hook is not None:
            problem = RuntimeError(f"rank {self.rank}: clean_low_latency_buffer: LL call #{ll.pending_hook + 1} still "
                                   f"awaits its receive hook (this rank took part in the barrier)")
        self._tag_call(CALL_CLEAN, 1)
        self._worker.drain()
        self._guard(ll.clean)
        if problem is not None:
            raise problem

    def _ll_shrink(self, op: str) -> ll_mod.LowLatencyEngine:
        ll = self._ll_usable(op)
        if not self.enable_shrink:
            raise RuntimeError(f"Buffer.{op}: needs enable_shrink=True")
        return ll

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Mask (``mask=True``) or unmask peer ``rank_to_mask`` in this rank's view
        (docs/semantics/deepep-api.md §7)."""
        rank_to_mask = as_int(rank_to_mask)
        ll = self._ll_shrink("low_latency_update_mask_buffer")
        if not isinstance(rank_to_mask, int) or not 0 <= rank_to_mask < self.group_size or rank_to_mask == self.rank:
            raise ValueError(f"low_latency_update_mask_buffer: rank_to_mask must be a peer rank in "
                             f"[0, {self.group_size}) other than this rank ({self.rank}), got {rank_to_mask!r}")
        ll.mask[rank_to_mask] = int(bool(mask))

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Copy this rank's mask (1 = masked) into ``mask_status``, an int32 tensor of ``R`` elements."""
        ll = self._ll_shrink("low_latency_query_mask_buffer")
        if not isinstance(mask_status, torch.Tensor) or mask_status.dtype != torch.int32 \
                or mask_status.numel() != self.group_size:
            raise ValueError(f"low_latency_query_mask_buffer: mask_status must be an int32 tensor of "
                             f"{self.group_size} elements")
        mask_status.view(-1).copy_(ll.mask)

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmask every peer (docs/semantics/deepep-api.md §7)."""
        self._ll_shrink("low_latency_clean_mask_buffer").mask.zero_()


def _as_rows_of_bytes(t: torch.Tensor) -> torch.Tensor:
    """``[n, m]`` tensor of any strides -> contiguous ``[n, m * itemsize]`` uint8 (a view when possible).

    Goes through 1-D so that size-1 dims with odd strides (e.g. a transposed ``[1, n]`` scale
    tensor, which torch calls contiguous) do not block the byte view.
    """
    n, m = t.shape
    if m and t.stride(1) == 1 and t.stride(0) == m:  # the usual case: one dtype view (one torch call, not four)
        return t.view(torch.uint8)
    return t.contiguous().reshape(-1).view(torch.uint8).view(n, m * t.element_size())


def _row_bytes(data: torch.Tensor, scales: torch.Tensor | None) -> tuple[int, int]:
    """Bytes per token of a dispatch's ``x`` rows and of its FP8 scales (0: none)."""
    return data.size(1) * data.element_size(), 4 * scales.size(1) if scales is not None else 0


def _typed_rows(recv_x: torch.Tensor, recv_scales: torch.Tensor | None, data: torch.Tensor,
                scales: torch.Tensor | None) -> Rows:
    """The received byte rows viewed as ``x``'s dtype, paired with the scales for FP8 ``x`` (no copy)."""
    rows = recv_x.view(data.dtype)
    return rows if scales is None else (rows, recv_scales.view(scales.dtype))


def _flatten(outputs) -> Iterator[torch.Tensor]:
    """Every tensor in ``outputs``, nested tuples and lists included."""
    for o in outputs:
        if isinstance(o, torch.Tensor):
            yield o
        elif isinstance(o, (tuple, list)):
            yield from _flatten(o)
