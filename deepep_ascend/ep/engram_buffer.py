"""``EngramBuffer``: DeepEP V2.5's Engram fetch buffer (``deep_ep.EngramBuffer``) on CPU ranks
(docs/semantics/deepep-api.md §14.1).

Every rank holds a shard of per-layer embedding tables (the *storage*); any rank fetches any entries of
every layer with one call and waits for each layer separately. On CPU ranks the storage is host memory,
which is where DeepEP-Ascend asks for it (``use_cpu_rdma_storage``): a symmetric window, loaded from
directly by the ranks of its node (UBMEM) and read one-sidedly from other nodes (URMA). FP8 storage comes
with a scaling-factor table replicated on every node and sharded between its ranks, as in DeepEP.
"""

from __future__ import annotations

import functools
import hashlib

import numpy as np
import torch

from .. import settings
from ..checks import is_int
from ..ordering import stable_argsort
from ..rounding import align, ceil_div
from ..transports import ChannelKind, Team, Topology, TransportBusy, create_transport, timeout_problem
from .allocator import BufferBase, get_num_allocation_alignment
from .arguments import context_idx_problem, sl_idx_problem
from .event import Worker
from .group import check_agreed, mpi_comm_of
from .memory import outside_inference_mode

__all__ = ["EngramBuffer"]

#: DeepEP's ``kDefaultQPDepth`` and the deepest queue ``get_theoretical_config`` asks for.
DEFAULT_QP_DEPTH, MAX_QP_DEPTH = 1024, 32768
#: ``kNumAlignedSFPacks``: column-major scale blocks pad the token count to a multiple of it (16 B of packs).
NUM_ALIGNED_SF_PACKS = 4
#: Read rate (million requests per second) DeepEP assumes of a NIC without fast RDMA atomics, and the read
#: round trip: the inputs of ``get_theoretical_config``'s queue-pair count.
NIC_READ_MPPS, READ_RTT_S = 45.0, 10e-6
_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)


def _digest(tables) -> str | None:
    """128-bit BLAKE2b hex digest of the bytes of ``tables`` (contiguous CPU tensors), None for None: what ranks
    compare to agree on replicated scale tables without moving them."""
    if tables is None:
        return None
    h = hashlib.blake2b(digest_size=16)
    for t in tables:
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def _config_problem(op: str, num_entries_per_layer, hidden, num_max_tokens, num_entries_per_token, dtype,
                    num_sf_packs) -> Exception | None:
    """What is wrong with a configuration's values (``set_config``'s, ``get_storage_size_hint``'s), or None."""
    entries = list(num_entries_per_layer) if isinstance(num_entries_per_layer, (list, tuple)) else None
    if not entries or not all(is_int(n) and n > 0 for n in entries):
        return ValueError(f"EngramBuffer.{op}: num_entries_per_layer must be a non-empty list of positive ints, got "
                          f"{num_entries_per_layer!r}")
    if not all(is_int(v) and v > 0 for v in (hidden, num_max_tokens, num_entries_per_token)):
        return ValueError(f"EngramBuffer.{op}: hidden, num_max_tokens and num_entries_per_token must be positive "
                          f"ints, got {hidden!r}, {num_max_tokens!r}, {num_entries_per_token!r}")
    if dtype not in _DTYPES:
        return TypeError(f"EngramBuffer.{op}: dtype must be torch.bfloat16 or torch.float8_e4m3fn, got {dtype!r}")
    if not is_int(num_sf_packs) or num_sf_packs < 0:
        return ValueError(f"EngramBuffer.{op}: num_sf_packs must be a non-negative int, got {num_sf_packs!r}")
    return None


def _deadline(num_gpu_timeout_secs) -> float | None:
    """The waits' deadline: DeepEP's default (100) yields to the library-wide setting; an explicit value wins."""
    return None if num_gpu_timeout_secs == 100 and settings.TIMEOUT_S.is_set() else float(num_gpu_timeout_secs)


def _accept_legacy_storage_size(init):
    """DeepEP's keyword alias ``num_rdma_storage_size`` of ``num_rdma_storage_bytes``."""

    @functools.wraps(init)
    def wrapper(self, *args, **kwargs):
        if "num_rdma_storage_size" in kwargs:
            if "num_rdma_storage_bytes" in kwargs:
                raise TypeError("Specify only one of num_rdma_storage_bytes and num_rdma_storage_size")
            kwargs["num_rdma_storage_bytes"] = kwargs.pop("num_rdma_storage_size")
        return init(self, *args, **kwargs)

    return wrapper


def _layout_bytes(num_entries_per_layer, hidden: int, itemsize: int, num_max_tokens: int,
                  num_entries_per_token: int, num_sf_packs: int, num_nodes: int) -> tuple[int, int, int]:
    """``(receive area, scale shard, storage)`` bytes of a configuration (none aligned)."""
    total = sum(num_entries_per_layer)
    row = hidden * itemsize
    recv = len(num_entries_per_layer) * num_max_tokens * num_entries_per_token * row
    sf = total * num_nodes * num_sf_packs * 4
    return recv, sf, total * row


class _Config:
    """What :meth:`EngramBuffer.set_config` fixed: the per-layer tables and the receive area's layout."""

    def __init__(self, num_entries_per_layer, hidden, num_max_tokens, num_entries_per_token, dtype, num_sf_packs,
                 num_nodes, num_gpu_bytes):
        self.num_entries_per_layer = list(num_entries_per_layer)
        self.hidden, self.num_max_tokens, self.num_entries_per_token = hidden, num_max_tokens, num_entries_per_token
        self.dtype, self.num_sf_packs = dtype, num_sf_packs
        self.row_bytes = hidden * dtype.itemsize
        # storage row of each layer's first entry (layers back to back, DeepEP's EngramLayout)
        self.prefix = np.concatenate(([0], np.cumsum(self.num_entries_per_layer))).tolist()
        recv, sf, _ = _layout_bytes(self.num_entries_per_layer, hidden, dtype.itemsize, num_max_tokens,
                                    num_entries_per_token, num_sf_packs, num_nodes)
        self.num_recv_bytes = recv
        self.num_sf_shard_bytes = align(sf, get_num_allocation_alignment()) if num_sf_packs else 0
        self.sf_offset = num_gpu_bytes - self.num_sf_shard_bytes  # the shard sits at the buffer's tail


class EngramBuffer(BufferBase):
    """DeepEP V2.5's Engram fetch buffer (``deep_ep.EngramBuffer``): per-layer tables sharded over the
    ranks, fetched by entry index (docs/semantics/deepep-api.md §14.1).

    Args:
        group: a torch ProcessGroup (ranks equal to MPI's) or an mpi4py communicator.
        num_gpu_bytes: bytes of the fetch buffer per rank: the receive area of every layer plus this rank's
            shard of the FP8 scaling-factor table (:meth:`get_storage_size_hint`'s first value).
        num_rdma_storage_bytes: bytes of this rank's storage shard (the hint's second value). DeepEP's
            keyword alias ``num_rdma_storage_size`` is accepted.
        use_cpu_rdma_storage: accepted and recorded; storage is host memory on CPU ranks either way.
        num_allocated_qps, qp_depth, restrict_rd_atomic: from :meth:`get_theoretical_config`; both counts
            must be positive (as DeepEP asserts), no queue pairs exist here.
        allow_hybrid_mode: True: node peers' storage is loaded directly (UBMEM), other nodes' read over
            URMA; False: every peer's storage is read over URMA (DeepEP without node-shared storage).
        sl_idx: accepted, no meaning on CPU ranks.
        num_gpu_timeout_secs: deadline in seconds of every wait (fetches, barriers); left at DeepEP's
            default 100, ``$DEEPEP_ASCEND_TIMEOUT_S`` applies when set.
        explicitly_destroy: as DeepEP: :meth:`destroy` must then be called on every rank.
        ranks_per_node: simulated node size (default ``$DEEPEP_ASCEND_RANKS_PER_NODE``, else the
            shared-memory domain). Pass the same value to :meth:`get_storage_size_hint` and
            :meth:`get_theoretical_config`, which size for a node count (or set the variable instead).

    Raises:
        AssertionError: ``num_allocated_qps`` or ``qp_depth`` not positive (DeepEP's assertion).
        ValueError: a byte count not a non-negative int, or ranks disagreeing on a collective argument:
            raised on every rank, naming the argument and each rank's value, before anything is allocated.
    """

    @_accept_legacy_storage_size
    @outside_inference_mode  # its own tensors are kept across calls: normal tensors in either mode
    def __init__(self, group, num_gpu_bytes: int, num_rdma_storage_bytes: int, use_cpu_rdma_storage: bool,
                 num_allocated_qps: int, qp_depth: int, restrict_rd_atomic: bool = False,
                 allow_hybrid_mode: bool = True, sl_idx: int | None = None, num_gpu_timeout_secs: int = 100,
                 explicitly_destroy: bool = False, *, ranks_per_node: int | None = None):
        super().__init__(explicitly_destroy)
        comm = mpi_comm_of(group, None, "EngramBuffer")
        self.group = group
        self.rank_idx, self.num_ranks = comm.Get_rank(), comm.Get_size()
        self.num_gpu_bytes, self.num_rdma_storage_bytes = num_gpu_bytes, num_rdma_storage_bytes
        self.use_cpu_rdma_storage = bool(use_cpu_rdma_storage)
        self.allow_hybrid_mode = bool(allow_hybrid_mode)
        self.restrict_rd_atomic, self.sl_idx, self.qp_depth = bool(restrict_rd_atomic), sl_idx, qp_depth
        self.num_allocated_qps = num_allocated_qps
        error = sl_idx_problem("EngramBuffer", sl_idx)
        for name, value in (("num_gpu_bytes", num_gpu_bytes), ("num_rdma_storage_bytes", num_rdma_storage_bytes)):
            if error is None and (not is_int(value) or value < 0):
                error = ValueError(f"EngramBuffer: {name} must be a non-negative int (bytes), got {value!r}")
        if error is None and not (is_int(num_allocated_qps) and num_allocated_qps > 0 and is_int(qp_depth)
                                  and qp_depth > 0):
            error = AssertionError("pass `num_allocated_qps` and `qp_depth` from `get_theoretical_config` "
                                   f"(got {num_allocated_qps!r}, {qp_depth!r})")
        bad_timeout = timeout_problem("num_gpu_timeout_secs", num_gpu_timeout_secs)
        if error is None and bad_timeout:
            error = ValueError(f"EngramBuffer: {bad_timeout}")
        check_agreed(comm, "EngramBuffer", {
            "num_gpu_bytes": num_gpu_bytes, "num_rdma_storage_bytes": num_rdma_storage_bytes,
            "allow_hybrid_mode": self.allow_hybrid_mode, "explicitly_destroy": bool(explicitly_destroy),
            "num_gpu_timeout_secs": num_gpu_timeout_secs}, error, None if error else _deadline(num_gpu_timeout_secs))
        timeout = _deadline(num_gpu_timeout_secs)
        self.runtime = create_transport(comm, ranks_per_node=ranks_per_node, timeout_s=timeout)
        tp = self.runtime
        try:
            # the storage: node peers load from it, other nodes (all peers without hybrid mode) read over URMA
            self._storage = tp.create_window("engram_storage", num_rdma_storage_bytes, 0,
                                             force_urma=not self.allow_hybrid_mode)
            # the fetch buffer: the scale shard at its tail, read by node peers (the receive area is local)
            self._buffer = tp.create_window("engram_buffer", num_gpu_bytes, 0)
        except BaseException:
            tp.destroy(force=True)
            raise
        topo: Topology = tp.topology
        self._topo = topo
        # DeepEP's receive area is the front of the GPU buffer; here it is local memory (untouched pages cost
        # nothing), so fetched tensors stay valid after destroy() like any tensor
        self._recv = torch.empty(num_gpu_bytes, dtype=torch.uint8)
        self._config: _Config | None = None
        self._written = False
        self._sf_dtype: torch.dtype | None = None
        self._worker = Worker(f"deepep_ascend-engram-{self.rank_idx}")
        self.num_rdma_ranks, self.num_nvlink_ranks = topo.num_nodes, topo.ranks_per_node
        self.num_scaleout_ranks, self.num_scaleup_ranks = self.get_logical_domain_size()
        self.scaleout_rank_idx = self.rank_idx // self.num_scaleup_ranks
        self.scaleup_rank_idx = self.rank_idx % self.num_scaleup_ranks
        tp.barrier(Team.WORLD, phase="EngramBuffer()")

    # -- DeepEP's common functions -------------------------------------------------------
    def get_physical_domain_size(self) -> tuple[int, int]:
        """``(num_rdma_ranks, num_nvlink_ranks)``: nodes and ranks per node (URMA and UBMEM domains)."""
        return self._topo.num_nodes, self._topo.ranks_per_node

    def get_logical_domain_size(self) -> tuple[int, int]:
        """``(num_scaleout_ranks, num_scaleup_ranks)``: ``(nodes, ranks per node)`` in hybrid mode,
        ``(1, num_ranks)`` without it."""
        nodes, per_node = self.get_physical_domain_size()
        return (nodes, per_node) if self.allow_hybrid_mode else (1, nodes * per_node)

    def barrier(self, wait_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True,
                context_idx: int | None = None) -> None:
        """Collective: returns once every rank called it and every fetch this rank issued finished; mirrors
        ``deep_ep.EngramBuffer.barrier`` (DeepEP's ``comm.barrier``). ``wait_comm_stream``, ``with_cpu_sync`` and
        ``sequential`` are accepted (the barrier always waits for the fetches, on the CPU); ``context_idx`` is
        None or 0 (the buffer's one group).

        Raises:
            RuntimeError: the buffer was destroyed. ValueError: another ``context_idx`` (after this rank took part
                in the barrier, so that later barriers stay paired). TimeoutError: a rank did not arrive in time.
        """
        self._usable("barrier")
        bad = context_idx_problem("EngramBuffer", context_idx)
        self._worker.drain()
        self._step(lambda: self.runtime.barrier(Team.WORLD, phase="EngramBuffer.barrier"))
        if bad:  # raised after taking part, so that the ranks' barriers stay paired
            raise bad

    def get_comm_stream(self) -> Worker:
        """The worker fetches run on (the CPU analogue of DeepEP's communication stream)."""
        return self._worker

    def _usable(self, op: str) -> None:
        """Raise unless the buffer can run ``op``: ``RuntimeError`` once destroyed; the transport's
        ``TransportPoisoned`` after a failure of this rank, ``TransportAborted`` after a peer's (a fetch then
        would read windows their owners may have left)."""
        if self.runtime is None:
            raise RuntimeError(f"EngramBuffer.{op}: the buffer was destroyed")
        self.runtime.check_abort(f"EngramBuffer.{op}")

    def _memory_usage(self) -> dict[str, int]:
        return {"storage window": self.num_rdma_storage_bytes, "buffer window": self.num_gpu_bytes,
                "receive area": self.num_gpu_bytes}

    def _destroy(self) -> None:
        self._worker.drain()
        windows = self._storage, self._buffer
        self._storage = self._buffer = None
        try:  # every rank meets there before any frees (a peer may still read this rank's storage until then)
            self.runtime.destroy()
        except TransportBusy:  # refused on every rank: the buffer stays as it was
            self._storage, self._buffer = windows
            raise
        self._worker.shutdown()

    def destroy(self) -> None:
        """Collectively free the windows and the worker. Requires ``explicitly_destroy=True``; tensors
        returned by fetches stay valid.

        Also after a failure (a timeout here, a peer's abort): the windows are then left to the process's exit
        (docs/design/transports.md §2.4) and the buffer is destroyed all the same.

        Raises:
            RuntimeError: built without ``explicitly_destroy=True``.
            transports.TransportTimeout: a rank did not call ``destroy()`` within the deadline.
        """
        super().destroy()

    def _agree(self, op: str, error: Exception | None, arguments: dict | None = None) -> None:
        """Collective (with the deadline): raise on every rank if any rank refused its arguments (``error``)
        or the ranks disagree on ``arguments``; this rank's own error is raised as itself."""
        items = tuple((arguments or {}).items())
        values = self._step(lambda: self.runtime.allgather_object(
            (None if error is None else f"{type(error).__name__}: {error}", items), phase=f"EngramBuffer.{op}"))
        if error is not None:
            raise error
        refused = [f"rank {r} refused its arguments ({v[0]})" for r, v in enumerate(values) if v[0] is not None]
        if refused:
            raise ValueError(f"EngramBuffer.{op}: " + "; ".join(refused))
        problems = []
        for i, (name, _) in enumerate(items):
            seen = [v[1][i][1] for v in values]
            if any(x != seen[0] for x in seen):
                problems.append(f"{name}: " + ", ".join(f"rank {r}: {x!r}" for r, x in enumerate(seen)))
        if problems:
            raise ValueError(f"EngramBuffer.{op}: the ranks disagree on collective arguments (every rank must pass "
                             f"the same): " + "; ".join(problems))

    # -- sizes and configuration ------------------------------------------------------------
    @staticmethod
    def get_storage_size_hint(group, num_entries_per_layer: list[int], hidden: int, num_max_tokens: int,
                              num_entries_per_token: int, dtype: torch.dtype = torch.bfloat16,
                              num_sf_packs: int = 0, *, ranks_per_node: int | None = None) -> tuple[int, int]:
        """``(num_gpu_bytes, num_rdma_storage_bytes)`` for a configuration (``deep_ep.EngramBuffer.
        get_storage_size_hint``): the receive area of every layer (``L * num_max_tokens *
        num_entries_per_token * hidden * itemsize``, aligned) plus this rank's shard of the FP8 scale
        table (``sum(entries) * nodes * num_sf_packs * 4``, aligned; 0 with ``num_sf_packs=0``), and the
        storage shard (``sum(entries) * hidden * itemsize``, aligned). Aligned to
        :func:`get_num_allocation_alignment`. Collective (reads the group's topology).

        Args:
            group, num_entries_per_layer, hidden, num_max_tokens, num_entries_per_token, dtype, num_sf_packs:
                as DeepEP (see :meth:`set_config`).
            ranks_per_node: keyword, not in DeepEP (whose topology is the group's hardware): the simulated
                node size the sizes are for. Pass the value given to the constructor: the scale shard grows
                with the node count, so a hint for other nodes may leave ``num_gpu_bytes`` too small for
                :meth:`set_config`. Default as the constructor's (``$DEEPEP_ASCEND_RANKS_PER_NODE``, else the
                shared-memory domain).
        """
        error = _config_problem("get_storage_size_hint", num_entries_per_layer, hidden, num_max_tokens,
                                num_entries_per_token, dtype, num_sf_packs)
        if error is not None:
            raise error
        comm = mpi_comm_of(group, None)
        nodes = Topology.from_comm(comm, ranks_per_node).num_nodes
        # (Python ints: numpy integers would overflow in the products below)
        recv, sf, storage = _layout_bytes([int(e) for e in num_entries_per_layer], int(hidden), dtype.itemsize,
                                          int(num_max_tokens), int(num_entries_per_token), int(num_sf_packs), nodes)
        a = get_num_allocation_alignment()
        return align(recv, a) + (align(sf, a) if num_sf_packs else 0), align(storage, a)

    @staticmethod
    def get_theoretical_config(group, num_layers: int, num_max_tokens: int, num_entries_per_token: int,
                               num_max_read_requests_per_qp: int = 16, *,
                               ranks_per_node: int | None = None) -> tuple[int, int, bool]:
        """DeepEP's recommended ``(num_qps, qp_depth, restrict_rd_atomic)`` (``deep_ep.EngramBuffer.
        get_theoretical_config``), with DeepEP's formula: a NIC without fast RDMA atomics (45 M reads/s),
        a 10 us read round trip, one RDMA peer per node. No queue pairs exist on CPU ranks; the values
        feed the constructor as in DeepEP. Collective (reads the group's topology).

        ``ranks_per_node``: keyword, not in DeepEP: the simulated node size, as given to the constructor
        (the counts are per node: another node count gives other values). Default as the constructor's.

        Raises:
            AssertionError: a count not positive (as DeepEP).
        """
        counts = {"num_layers": num_layers, "num_max_tokens": num_max_tokens,
                  "num_entries_per_token": num_entries_per_token,
                  "num_max_read_requests_per_qp": num_max_read_requests_per_qp}
        bad = {k: v for k, v in counts.items() if not (is_int(v) and v > 0)}
        assert not bad, "EngramBuffer.get_theoretical_config: the counts must be positive ints, got " + ", ".join(
            f"{k}={v!r}" for k, v in bad.items())
        peers = Topology.from_comm(mpi_comm_of(group, None), ranks_per_node).num_nodes
        f32 = np.float32
        rate = f32(NIC_READ_MPPS) * f32(1e6) * f32(READ_RTT_S) / f32(num_max_read_requests_per_qp) / f32(peers)
        num_qps = max(int(np.ceil(rate)), 1)
        num_requests = num_layers * num_max_tokens * num_entries_per_token
        slots = ceil_div(num_requests, num_qps * peers)
        if slots > MAX_QP_DEPTH:
            return int(ceil_div(num_requests, MAX_QP_DEPTH * peers) * 1.05), MAX_QP_DEPTH, True
        depth = DEFAULT_QP_DEPTH
        while depth < slots and depth < MAX_QP_DEPTH:
            depth *= 2
        return num_qps, depth, False

    def set_config(self, num_entries_per_layer: list[int], hidden: int, num_max_tokens: int,
                   num_entries_per_token: int, dtype: torch.dtype = torch.bfloat16, num_sf_packs: int = 0) -> None:
        """Collectively fix the tables and the receive area (``deep_ep.EngramBuffer.set_config``).

        Args:
            num_entries_per_layer: entries each rank stores per layer (``n_l > 0``); layer ``l``'s global
                table has ``num_ranks * n_l`` entries, entry ``g`` on rank ``g // n_l``.
            hidden: elements per entry. num_max_tokens, num_entries_per_token: the most a fetch asks for.
            dtype: ``torch.bfloat16`` or ``torch.float8_e4m3fn``.
            num_sf_packs: 4-byte scale packs per entry (FP8: e.g. ``ceil(hidden / 128)``), 0 for none.
        Raises:
            ValueError / TypeError: bad values, a storage or buffer too small for them, or ranks
                disagreeing: raised on every rank; the previous configuration stays.
        """
        self._usable("set_config")
        self._worker.drain()
        entries = list(num_entries_per_layer) if isinstance(num_entries_per_layer, (list, tuple)) else None
        error = _config_problem("set_config", num_entries_per_layer, hidden, num_max_tokens, num_entries_per_token,
                                dtype, num_sf_packs)
        if error is None:
            recv, sf, storage = _layout_bytes(entries, hidden, dtype.itemsize, num_max_tokens, num_entries_per_token,
                                              num_sf_packs, self._topo.num_nodes)
            sf = align(sf, get_num_allocation_alignment()) if num_sf_packs else 0
            if storage > self.num_rdma_storage_bytes:
                error = ValueError(f"EngramBuffer.set_config: the tables need {storage} B of storage per rank, the "
                                   f"buffer has num_rdma_storage_bytes={self.num_rdma_storage_bytes} (see "
                                   f"get_storage_size_hint)")
            elif recv + sf > self.num_gpu_bytes:
                nodes = self._topo.num_nodes
                error = ValueError(f"EngramBuffer.set_config: the receive area ({recv} B) and the scale shard ({sf} B, "
                                   f"{nodes} node{'s' if nodes > 1 else ''}) need {recv + sf} B, the buffer has "
                                   f"num_gpu_bytes={self.num_gpu_bytes} (see get_storage_size_hint, with the "
                                   f"constructor's ranks_per_node={self._topo.ranks_per_node})")
        self._agree("set_config", error, {
            "num_entries_per_layer": entries, "hidden": hidden, "num_max_tokens": num_max_tokens,
            "num_entries_per_token": num_entries_per_token, "dtype": str(dtype), "num_sf_packs": num_sf_packs})
        self._config = _Config(entries, hidden, num_max_tokens, num_entries_per_token, dtype, num_sf_packs,
                               self._topo.num_nodes, self.num_gpu_bytes)
        self._written, self._sf_dtype = False, None

    # -- write -------------------------------------------------------------------------------
    def _check_write(self, storages, sfs) -> Exception | None:
        cfg = self._config
        if cfg is None:
            return RuntimeError("EngramBuffer.write: call set_config first")
        L = len(cfg.num_entries_per_layer)
        if not isinstance(storages, (list, tuple)) or len(storages) != L:
            return ValueError(f"EngramBuffer.write: storages must be a list of {L} tensors (one per layer), got "
                              f"{type(storages).__name__}"
                              f"{f' of {len(storages)}' if isinstance(storages, (list, tuple)) else ''}")
        for layer, (s, n) in enumerate(zip(storages, cfg.num_entries_per_layer)):
            if not isinstance(s, torch.Tensor) or s.device.type != "cpu" or not s.is_contiguous() \
                    or tuple(s.shape) != (n, cfg.hidden) or s.dtype != cfg.dtype:
                got = f"{s.dtype} {tuple(s.shape)} on {s.device}, contiguous={s.is_contiguous()}" \
                    if isinstance(s, torch.Tensor) else type(s).__name__
                return ValueError(f"EngramBuffer.write: storages[{layer}] must be a contiguous CPU {cfg.dtype} tensor "
                                  f"[{n}, {cfg.hidden}], got {got}")
        if sfs is None:
            return None
        if cfg.num_sf_packs == 0:
            return ValueError("EngramBuffer.write: sfs given, but set_config had num_sf_packs=0")
        if not isinstance(sfs, (list, tuple)) or len(sfs) != L:
            return ValueError(f"EngramBuffer.write: sfs must be None or a list of {L} tensors, got "
                              f"{type(sfs).__name__}")
        for layer, (sf, n) in enumerate(zip(sfs, cfg.num_entries_per_layer)):
            shape = (self.num_ranks * n, cfg.num_sf_packs)
            if not isinstance(sf, torch.Tensor) or sf.device.type != "cpu" or not sf.is_contiguous() \
                    or tuple(sf.shape) != shape or sf.element_size() != 4 or sf.dtype != sfs[0].dtype:
                got = f"{sf.dtype} {tuple(sf.shape)} on {sf.device}, contiguous={sf.is_contiguous()}" \
                    if isinstance(sf, torch.Tensor) else type(sf).__name__
                return ValueError(f"EngramBuffer.write: sfs[{layer}] must be the whole replicated table: a contiguous "
                                  f"CPU tensor {list(shape)} of 4-byte packs (the dtype of sfs[0]), got {got}")
        return None

    def write(self, storages: list[torch.Tensor], sfs: list[torch.Tensor] | None = None) -> None:
        """Collectively store this rank's shard of every layer (``deep_ep.EngramBuffer.write``).

        Args:
            storages: per layer ``[n_l, hidden]`` contiguous CPU tensors of the configured dtype: this rank's
                entries ``rank * n_l ... rank * n_l + n_l - 1`` of the layer's table.
            sfs: FP8 only: per layer the whole scale table ``[num_ranks * n_l, num_sf_packs]`` of 4-byte packs
                (float32 or packed UE8M0 int32), the same on every rank (each rank keeps its node-local shard,
                as DeepEP). None keeps the scales already written.
        Raises:
            RuntimeError / ValueError: no configuration, or a tensor of the wrong shape, dtype or device on any
                rank, or ranks disagreeing on whether scales are given or on the scales themselves: raised on
                every rank before anything is stored. The scales are compared by a 128-bit BLAKE2b digest of
                their bytes, one pass over each rank's whole table (about 1 ms per MB) and 16 bytes more in
                the agreement's allgather.
        """
        self._usable("write")
        self._worker.drain()  # this rank's fetches read peers' storage: done before anyone overwrites it
        error = self._check_write(storages, sfs)
        self._agree("write", error, {"sfs given": sfs is not None,
                                     "sfs (BLAKE2b digest)": _digest(sfs) if error is None else None})
        cfg, tp = self._config, self.runtime
        offset = 0
        for s in storages:
            nbytes = s.numel() * s.element_size()
            tp.local_view(self._storage, offset, nbytes).copy_(s.reshape(-1).view(torch.uint8))
            offset += nbytes
        if sfs is not None:
            topo = self._topo
            offset = cfg.sf_offset
            for sf, n in zip(sfs, cfg.num_entries_per_layer):
                rows = topo.num_nodes * n  # rows of the table this rank's shard holds
                first = topo.local_rank * rows
                nbytes = rows * cfg.num_sf_packs * 4
                tp.local_view(self._buffer, offset, nbytes).copy_(sf[first:first + rows].reshape(-1).view(torch.uint8))
                offset += nbytes
            self._sf_dtype = sfs[0].dtype
        self._step(lambda: tp.barrier(Team.WORLD, phase="EngramBuffer.write"))  # the stores are visible to every reader
        self._written = True

    # -- fetch -------------------------------------------------------------------------------
    def _check_fetch(self, indices, num_qps) -> None:
        cfg = self._config
        if cfg is None or not self._written:
            raise RuntimeError("EngramBuffer.fetch: call set_config and write first")
        if cfg.num_sf_packs and self._sf_dtype is None:
            raise RuntimeError("EngramBuffer.fetch: num_sf_packs > 0 but no scales were written (write(storages, sfs))")
        if not is_int(num_qps) or num_qps < 0:
            raise ValueError(f"EngramBuffer.fetch: num_qps must be a non-negative int (0: all allocated), got "
                             f"{num_qps!r}")
        num_qps = self.num_allocated_qps if num_qps == 0 else num_qps
        assert num_qps <= self.num_allocated_qps, "Allocated QPs are not enough"
        L = len(cfg.num_entries_per_layer)
        if not isinstance(indices, torch.Tensor) or indices.dtype != torch.int32 or indices.dim() != 3 \
                or indices.device.type != "cpu" or not indices.is_contiguous():
            got = f"{indices.dtype} {tuple(indices.shape)} on {indices.device}, contiguous={indices.is_contiguous()}" \
                if isinstance(indices, torch.Tensor) else type(indices).__name__
            raise ValueError(f"EngramBuffer.fetch: indices must be a contiguous CPU int32 tensor [num_layers, "
                             f"num_tokens, num_entries_per_token], got {got}")
        num_layers, num_tokens, per_token = indices.shape
        if num_layers != L or num_tokens > cfg.num_max_tokens or per_token > cfg.num_entries_per_token:
            raise ValueError(f"EngramBuffer.fetch: indices {list(indices.shape)} must have {L} layers, at most "
                             f"num_max_tokens={cfg.num_max_tokens} tokens and at most num_entries_per_token="
                             f"{cfg.num_entries_per_token} entries per token (set_config)")
        if indices.numel():
            lo = indices.amin(dim=(1, 2))
            hi = indices.amax(dim=(1, 2))
            limit = torch.tensor(cfg.num_entries_per_layer, dtype=torch.int64) * self.num_ranks
            bad = (lo < 0) | (hi.long() >= limit)
            if bool(bad.any()):
                layer = int(bad.nonzero()[0])
                raise ValueError(f"EngramBuffer.fetch: indices of layer {layer} must lie in [0, num_ranks * "
                                 f"num_entries_per_layer[{layer}]) = [0, {int(limit[layer])}), got values in "
                                 f"[{int(lo[layer])}, {int(hi[layer])}]")

    def fetch(self, indices: torch.Tensor, num_qps: int = 0, use_tma_aligned_col_major_sf: bool = True) -> list:
        """Read the entries of every layer and return one wait hook per layer (``deep_ep.EngramBuffer.fetch``).

        One-sided: only this rank takes part (peers need not call anything). The reads run on the
        buffer's worker in layer order while the caller goes on; ``hooks[l]()`` waits for layer ``l`` (in
        any order, any number of times) and returns ``data`` ``[num_tokens, hidden * num_entries_per_token]``
        of the configured dtype, ``data[t, e * hidden:(e + 1) * hidden] = table_l[indices[l, t, e]]``, or
        with ``num_sf_packs > 0`` the pair ``(data, sf)``, ``sf [num_tokens, num_entries_per_token *
        num_sf_packs]`` of the scales' dtype, ``sf[t, e * P:(e + 1) * P] = scales_l[indices[l, t, e]]``.
        ``data`` views the receive area (valid until the next fetch, as in DeepEP); ``sf`` is fresh, strides
        ``(1, align(num_tokens, 4))`` column-major (``use_tma_aligned_col_major_sf``) or row-major.

        Args:
            indices: ``[num_layers, num_tokens, num_entries_per_token]`` contiguous CPU int32, layer ``l``'s
                values in ``[0, num_ranks * n_l)``; at most the configured tokens and entries per token.
            num_qps: accepted (0: all allocated); must not exceed ``num_allocated_qps``.
        Raises:
            RuntimeError: no configuration or nothing written. AssertionError: ``num_qps`` too large.
            ValueError: bad ``indices`` (naming the layer and the values for a range error), on this rank.
            TimeoutError: from a hook, a read that did not complete in time (transports.TransportTimeout).
        """
        self._usable("fetch")
        self._check_fetch(indices, num_qps)
        cfg = self._config
        num_layers, num_tokens, per_token = indices.shape
        fp8 = cfg.num_sf_packs > 0
        layer_bytes = cfg.num_max_tokens * per_token * cfg.row_bytes  # DeepEP's get_recv_byte_offset
        fetched = [self._recv[i * layer_bytes:i * layer_bytes + num_tokens * per_token * cfg.row_bytes]
                   .view(cfg.dtype).view(num_tokens, per_token * cfg.hidden) for i in range(num_layers)]
        fetched_sf = []
        if fp8:
            P = cfg.num_sf_packs
            if use_tma_aligned_col_major_sf:
                token_stride, col_stride = 1, align(num_tokens, NUM_ALIGNED_SF_PACKS)
                layer_stride = per_token * P * col_stride
            else:
                token_stride, col_stride = per_token * P, 1
                layer_stride = per_token * P * num_tokens
            backing = torch.empty(num_layers, layer_stride, dtype=self._sf_dtype)
            fetched_sf = [backing[i].as_strided((num_tokens, per_token * P), (token_stride, col_stride))
                          for i in range(num_layers)]
        idx = indices.reshape(num_layers, -1).long()  # read here: the caller may reuse `indices` at once
        futures = [self._worker.submit(self._step, functools.partial(
            self._fetch_layer, layer, idx[layer], fetched[layer], fetched_sf[layer] if fp8 else None, per_token))
            for layer in range(num_layers)]

        def hook(layer):
            def wait():
                futures[layer].result()
                return (fetched[layer], fetched_sf[layer]) if fp8 else fetched[layer]
            return wait

        return [hook(layer) for layer in range(num_layers)]

    def _fetch_layer(self, layer: int, idx: torch.Tensor, out: torch.Tensor, out_sf: torch.Tensor | None,
                     per_token: int) -> None:
        """Layer ``layer``'s reads: one gathering read per owning rank (storage), and per node peer holding
        scale rows (shards); each lands straight in its place in ``out`` / ``out_sf``."""
        cfg, topo = self._config, self._topo
        if idx.numel() == 0:
            return
        n = cfg.num_entries_per_layer[layer]
        rows = out.view(torch.uint8).view(-1, cfg.row_bytes)
        owner = torch.div(idx, n, rounding_mode="floor")
        self._gather(self._storage, owner, idx - owner * n + cfg.prefix[layer], rows, cfg.row_bytes, 0,
                     self.num_ranks, lambda p: p, f"fetch layer {layer}")
        if out_sf is None:
            return
        # scale rows: global entry g sits in shard g // (nodes * n) (a rank of this node), at row g % (nodes * n)
        # after the shard's earlier layers (DeepEP's EngramLayout::get_sf_row_idx)
        shard_rows = topo.num_nodes * n
        shard = torch.div(idx, shard_rows, rounding_mode="floor")
        tokens = out_sf.size(0)
        sf3 = out_sf.as_strided((tokens, per_token, cfg.num_sf_packs),
                                (out_sf.stride(0), cfg.num_sf_packs * out_sf.stride(1), out_sf.stride(1)))
        first = topo.node * topo.ranks_per_node
        self._gather(self._buffer, shard, idx - shard * shard_rows + topo.num_nodes * cfg.prefix[layer], sf3,
                     cfg.num_sf_packs * 4, cfg.sf_offset, topo.ranks_per_node, lambda s: first + s,
                     f"fetch layer {layer} scales")

    def _gather(self, win, owner, rows, out, row_bytes, offset, num_owners, rank_of, phase) -> None:
        """For each owner ``o`` with entries: read its ``rows`` (in ``win`` from byte ``offset``) into the rows of
        ``out`` (flattened leading dims) at those entries' positions. One read per owner, never per entry."""
        counts = torch.bincount(owner, minlength=num_owners).tolist()
        order = stable_argsort(owner, 0, num_owners)
        start = 0
        for o, count in enumerate(counts):
            if count:
                pos = order[start:start + count]
                self.runtime.get_rows(win, rank_of(o), offset, row_bytes, rows[pos], out, pos, phase=phase)
                start += count

    def get_traffic(self) -> dict[str, int]:
        """Bytes this rank's fetches read per channel kind (``SELF``, ``UBMEM``, ``URMA``) since construction
        (not in DeepEP; the benchmark reports it).

        Raises:
            RuntimeError: the buffer was destroyed.
        """
        if self.runtime is None:
            raise RuntimeError("EngramBuffer.get_traffic: the buffer was destroyed")
        fetched = self.runtime.stats.bytes_fetched
        return {kind.name: int(fetched[int(kind)].sum()) for kind in ChannelKind}
