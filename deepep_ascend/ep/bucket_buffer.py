"""``BucketBuffer``: DeepEP V2.5's bucket collectives (``deep_ep.BucketBuffer``) on CPU ranks
(docs/semantics/deepep-api.md §14.3).

One contiguous storage per rank, a symmetric window: tensors planned with a :class:`BufferAllocator` (or
carved by a :class:`BucketSession`) sit at the same offset on every rank, so a peer's copy of a tensor is
found without asking. Every collective *pulls*: a rank announces that its sources are ready, reads its peers'
windows (loads inside a node, one-sided URMA gets between nodes: one copy per hop, or none when a node
peer's bytes are added straight from its window) and writes only its own storage; it returns once every peer
has finished reading its window, so the storage may be reused as soon as a call returns.
"""

from __future__ import annotations

import inspect
import math
import time

import numpy as np
import torch

from ..checks import is_int
from ..rounding import align
from ..transports import ChannelKind, State, TransportBusy, WaitPolicy, create_transport
from ..transports.base import allgather_object
from .allocator import BufferAllocator, BufferBase, get_num_allocation_alignment
from .arguments import sl_idx_problem
from .event import EventHandle, EventOverlap
from .group import check_agreed, mpi_comm_of, resolve_deadline
from .memory import outside_inference_mode

__all__ = ["BucketBuffer", "BucketSession"]

_SLOT_READY = 0  # a rank's sources are in its window (and, for bf16, encoded): peers may read them
_SLOT_REDUCED = 1  # all_reduce: a rank's own chunk is reduced; peers may gather it
_SLOT_DONE = 2  # a rank finished reading its peers' windows for this call
_SLOT_BARRIER = 3  # barrier() of a group other than the first
_SLOTS_PER_GROUP = 4  # each group counts its own signals: calls on different groups never share a counter
_PRECISIONS = ("fp32", "bf16")


def _pack_tensors(op: str, names: tuple, *items):
    """DeepEP's batching: a tensor or a sequence of tensors (``None``: an empty list). Returns ``(is_packed,
    *lists, error)``, ``is_packed`` when the first item is a single tensor (the result is then one tensor too);
    ``error`` a ``TypeError`` naming an item (by ``names``) that is neither a tensor, a list or tuple nor None
    (its list then empty), for the call's checks to refuse on every rank, else None."""
    is_packed, lists, error = isinstance(items[0], torch.Tensor), [], None
    for name, item in zip(names, items):
        if item is None or isinstance(item, torch.Tensor):
            lists.append([] if item is None else [item])
        elif isinstance(item, (list, tuple)):
            lists.append(list(item))
        else:
            lists.append([])
            error = error or TypeError(f"BucketBuffer.{op}: {name} must be a tensor or a list or tuple of tensors, "
                                       f"got {type(item).__name__}")
    return is_packed, *lists, error


def _check_apart(op: str, what: str, spans) -> None:
    """Refuse byte ranges ``(i, begin, end)`` of the storage that overlap: a batched call whose tensors share
    bytes would read what it already wrote (DeepEP does not check; the sums would be silently wrong)."""
    spans = sorted((b, e, i) for i, b, e in spans if e > b)
    for (b0, e0, i0), (b1, _, i1) in zip(spans, spans[1:]):
        if b1 < e0:
            first, second = sorted((i0, i1))
            raise ValueError(f"BucketBuffer.{op}: {what}[{first}] and {what}[{second}] share bytes of the storage "
                             f"([{b0}, {e0}) and [{b1}, ...)); each tensor of a batched call needs its own bytes")


class BucketSession:
    """A scope in which the collectives of a :class:`BucketBuffer` accept tensors outside its storage;
    mirrors ``deep_ep.buffers.bucket.BucketSession`` (opened by :meth:`BucketBuffer.session`).

    Entering binds staging versions of ``all_gather``, ``reduce_scatter`` and ``all_reduce`` on the buffer:
    a source outside the storage is copied into storage carved from offset 0 (aligned to
    :func:`get_num_allocation_alignment`), the collective runs there, and the handle's ``wait`` copies the
    results into the caller's ``dsts`` (or returns the staged views). The caller guarantees, as in DeepEP,
    that the storage's bytes are free for reuse while the session is open. :meth:`allocate` hands out
    storage tensors for in-place calls. One group per session; sessions do not nest.
    """

    _METHODS = ("all_gather", "reduce_scatter", "all_reduce")

    def __init__(self, buffer: BucketBuffer):
        self.buffer = buffer
        self.alignment = get_num_allocation_alignment()
        self.num_allocated_bytes = 0
        self.context_idx: int | None = None

    def __enter__(self) -> BucketSession:
        self.buffer._check_alive("session")
        if any(name in self.buffer.__dict__ for name in self._METHODS):
            raise RuntimeError("BucketBuffer.session: sessions do not nest (a session is already open on this buffer)")
        self.num_allocated_bytes = 0
        self.context_idx = None
        for name in self._METHODS:
            setattr(self.buffer, name, self._bind(name))
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        for name in self._METHODS:
            self.buffer.__dict__.pop(name, None)

    def _bind(self, name: str):
        def method(*args, **kwargs):
            return self._collective(name, *args, **kwargs)
        method.__name__ = name
        method.__doc__ = getattr(BucketBuffer, name).__doc__
        return method

    def _allocate(self, num_bytes: int, dtype: torch.dtype) -> torch.Tensor:
        self.buffer._check_alive("session allocate")
        if num_bytes <= 0:
            raise ValueError(f"BucketBuffer session: allocate needs a positive size, got {num_bytes} bytes")
        offset = self.num_allocated_bytes
        end = offset + align(num_bytes, self.alignment)
        if end > self.buffer.num_bytes:
            raise RuntimeError(f"BucketBuffer session: out of storage: {num_bytes} more bytes requested at offset "
                               f"{offset}, the storage has {self.buffer.num_bytes}")
        self.num_allocated_bytes = end
        return self.buffer.storage.narrow(0, offset, num_bytes).view(dtype)

    def _check_group(self, group) -> int:
        idx = self.buffer.get_context_idx(group)
        if self.context_idx not in (None, idx):
            raise ValueError("BucketBuffer session: every collective of a session must use the same group")
        self.context_idx = idx
        return idx

    def allocate(self, shapes, dtype: torch.dtype = torch.float32, group=None):
        """Carve tensors out of the storage for in-place collectives; mirrors ``BucketSession.allocate``.

        Args:
            shapes: one shape, or a sequence of shapes (then a tuple of tensors is returned).
            dtype: the tensors' dtype. group: the session's group (``None`` with one group).
        Returns:
            the tensor(s), views of the storage (uninitialised).
        Raises:
            RuntimeError: the storage is exhausted, or the buffer was destroyed. ValueError: another group than
                the session's, a shape with no elements or not a tuple of non-negative ints (``()`` is a 0-d
                shape: one element). TypeError: ``shapes`` neither a shape nor a sequence of shapes.
        """
        self._check_group(group)
        if not isinstance(shapes, (tuple, list, torch.Size)):
            raise TypeError(f"BucketSession.allocate: shapes must be a shape (a tuple of ints) or a sequence of them, "
                            f"got {type(shapes).__name__}")
        batched = bool(shapes) and isinstance(shapes[0], (tuple, list, torch.Size))  # () is one 0-d shape
        shapes = shapes if batched else (shapes,)
        for shape in shapes:
            if not isinstance(shape, (tuple, list, torch.Size)) or not all(is_int(d) and d >= 0 for d in shape):
                raise ValueError(f"BucketSession.allocate: a shape must be a tuple of non-negative ints, got {shape!r}")
        tensors = [self._allocate(math.prod(shape) * dtype.itemsize, dtype).view(shape) for shape in shapes]
        return tuple(tensors) if batched else tensors[0]

    def _collective(self, name: str, *args, **kwargs) -> EventOverlap:
        buffer = self.buffer
        original = getattr(BucketBuffer, name)
        try:
            bound = inspect.signature(original).bind(buffer, *args, **kwargs).arguments
            bound.pop("self")
            ctx = self._check_group(bound.get("group"))
            n, r = len(buffer._contexts[ctx]), buffer._contexts[ctx].index(buffer.rank_idx)
            shards = {"all_gather": (n, 1), "reduce_scatter": (1, n), "all_reduce": (1, 1)}[name]
            is_packed, srcs, dsts, error = _pack_tensors(name, ("srcs", "dsts"), bound.pop("srcs"),
                                                         bound.pop("dsts", None))
            if error is not None:
                raise error
            has_dsts = bool(dsts)
            if not has_dsts:
                dsts = srcs
            if len(dsts) != len(srcs):
                raise ValueError(f"BucketBuffer.{name}: {len(srcs)} srcs but {len(dsts)} dsts")
            staged_srcs, staged_dsts, copies = [], [], []
            for src, dst in zip(srcs, dsts):
                if not isinstance(src, torch.Tensor) or not isinstance(dst, torch.Tensor):
                    raise TypeError(f"BucketBuffer.{name}: srcs and dsts must be tensors")
                if has_dsts and (src.dtype != dst.dtype or not dst.is_contiguous()
                                 or dst.nbytes * shards[1] != src.nbytes * shards[0]):
                    raise ValueError(f"BucketBuffer.{name}: dst must be contiguous, of src's dtype and hold "
                                     f"{shards[0]}x src's bytes, got src {src.dtype} {tuple(src.shape)}, dst "
                                     f"{dst.dtype} {tuple(dst.shape)} (contiguous={dst.is_contiguous()})")
                if src.numel() % shards[1]:
                    raise ValueError(f"BucketBuffer.{name}: src has {src.numel()} elements, not a multiple of the "
                                     f"group's {shards[1]} ranks")
                src_off = buffer._offset_of(src)
                dst_off = buffer._offset_of(dst) if has_dsts else None
                nbytes = src.nbytes * shards[0]
                if src_off is not None and src.is_contiguous():
                    region = buffer.storage.narrow(0, src_off - (r % shards[0]) * src.nbytes, nbytes).view(src.dtype)
                elif dst_off is not None:
                    region = buffer.storage.narrow(0, dst_off - (r % shards[1]) * dst.nbytes, nbytes).view(dst.dtype)
                else:
                    region = self._allocate(nbytes, src.dtype)
                src_stage = region.view(shards[0], -1)[r % shards[0]].view(src.shape)
                dst_stage = region.view(shards[1], -1)[r % shards[1]]
                if src_stage.data_ptr() != src.data_ptr():
                    copies.append((src_stage, src))
                staged_srcs.append(src_stage)
                staged_dsts.append(dst_stage.view(dst.shape) if has_dsts else dst_stage)
        except Exception as exc:
            if buffer.runtime is None:
                raise
            ctx = buffer._context_or_zero(kwargs.get("group"))
            buffer._agree(name, ctx, exc, None)
            raise
        for stage, src in copies:
            stage.copy_(src)
        if name == "all_gather":
            handle = original(buffer, staged_srcs, dsts=[d.view(-1) for d in staged_dsts], **bound)
        else:
            handle = original(buffer, staged_srcs, **bound)
        outputs = list(dsts) if has_dsts else staged_dsts
        inner = handle.hook_after_wait
        handle.hook_after_wait = None

        def hook():
            results = inner()
            results = [results] if isinstance(results, torch.Tensor) else results
            for out, res in zip(outputs, results):
                if out.data_ptr() != res.data_ptr():
                    out.view(-1).copy_(res.view(out.dtype))
            return outputs[0] if is_packed else outputs
        handle.register_hook_after_wait(hook)
        return handle


def _scale_key(scale) -> str:
    """``scale`` as the ranks compare it: ``repr`` of the float, which tells distinct values apart (-0.0 from 0.0)
    and makes NaN equal to NaN (DeepEP passes any float scale to its kernels, non-finite ones too)."""
    return f"scale={float(scale)!r}"


class BucketBuffer(BufferBase):
    """Contiguous symmetric storage for batched all-gather, reduce-scatter and all-reduce
    (``deep_ep.BucketBuffer``).

    Args:
        group: a torch ProcessGroup (ranks equal to MPI's, as under ``mpiexec``) or an mpi4py communicator,
            or a sequence of them, all registered with the one storage: every rank of ``group[0]`` constructs
            the buffer, and every further group must lie inside ``group[0]`` (each rank passes the groups
            it belongs to, in the same roles, as DeepEP's tests do: the world, its half, its rail). A call's
            ``group=`` picks one (required with several).
        allocation_plan_or_num_bytes: a :class:`BufferAllocator` not yet materialized (the storage is its
            ``num_bytes``; its tensors become views of the storage), or a byte count (> 0).
        sl_idx: DeepEP's RDMA service level; accepted, no meaning on CPU ranks.
        num_gpu_timeout_secs: the deadline in seconds of every wait (DeepEP's kernel-side timeout);
            ``$DEEPEP_ASCEND_TIMEOUT_S``, if set, wins over it, ``timeout_s`` over both.
        explicitly_destroy: as DeepEP: :meth:`destroy` must then be called on every rank.
        ranks_per_node: simulated node size (default ``$DEEPEP_ASCEND_RANKS_PER_NODE``, else the
            shared-memory domain); peers on other nodes are read over URMA.
        timeout_s: the deadline in seconds (not in DeepEP; see ``num_gpu_timeout_secs``).

    Attributes:
        storage: this rank's ``[num_bytes]`` uint8 storage, a view of the window (``None`` after destroy).
        num_bytes: its size in bytes. groups: the groups, as given (a list).
        rank_idx, num_ranks: this rank and the size of ``group[0]``.

    Constructing is collective over the group.

    Raises:
        ValueError: on every rank: a byte count that is not a positive int, a materialized plan, a bad
            ``timeout_s``, or ranks disagreeing on the storage size, ``explicitly_destroy`` or the deadline,
            before anything is allocated.
        ValueError: also when a further group has ranks outside ``group[0]`` (on every rank of ``group[0]``).
        transports.TransportConfigError: invalid ``ranks_per_node`` (the same error on every rank).
    """

    @outside_inference_mode  # its own tensors are kept across calls: normal tensors in either mode
    def __init__(self, group, allocation_plan_or_num_bytes, sl_idx: int | None = None,
                 num_gpu_timeout_secs: int = 100, explicitly_destroy: bool = False, *,
                 ranks_per_node: int | None = None, timeout_s: float | None = None):
        super().__init__(explicitly_destroy)
        groups = list(group) if isinstance(group, (list, tuple)) else [group]
        if not groups:
            raise ValueError("BucketBuffer: group must be a group or a non-empty sequence of groups, got []")
        comm = mpi_comm_of(groups[0], None, "BucketBuffer")
        self.groups = groups
        self.rank_idx, self.num_ranks = comm.Get_rank(), comm.Get_size()
        self.sl_idx = sl_idx
        self.num_gpu_timeout_secs = num_gpu_timeout_secs
        plan = allocation_plan_or_num_bytes if isinstance(allocation_plan_or_num_bytes, BufferAllocator) else None
        num_bytes = plan.num_bytes if plan is not None else allocation_plan_or_num_bytes
        error = sl_idx_problem("BucketBuffer", sl_idx)
        if error is not None:
            pass
        elif plan is not None and plan.materialized:
            error = ValueError("BucketBuffer: allocation_plan_or_num_bytes is a BufferAllocator already materialized")
        elif isinstance(num_bytes, bool) or not isinstance(num_bytes, int) or num_bytes <= 0:
            error = ValueError(f"BucketBuffer: allocation_plan_or_num_bytes must be a BufferAllocator or a positive "
                               f"int of bytes, got {num_bytes!r}")
        deadline, deadline_error = resolve_deadline("BucketBuffer", timeout_s, num_gpu_timeout_secs)
        error = error or deadline_error
        # agreed before the window exists: ranks asking for windows of different sizes would wait for each other
        check_agreed(comm, "BucketBuffer", {
            "num_groups": len(groups), "num_bytes": num_bytes, "explicitly_destroy": bool(explicitly_destroy),
            "deadline": deadline}, error, None if deadline_error else deadline)
        # every further group: its members as ranks of the first group's (each must be one of them)
        self._contexts, self._comms, error = [list(range(self.num_ranks))], [None], None
        try:
            from mpi4py import MPI

            for i, g in enumerate(groups[1:], 1):
                sub = mpi_comm_of(g, None)
                members = MPI.Group.Translate_ranks(sub.Get_group(), list(range(sub.Get_size())), comm.Get_group())
                if any(m == MPI.UNDEFINED for m in members):
                    raise ValueError(f"BucketBuffer: every group must lie inside the first (groups[0]); groups[{i}] "
                                     f"has ranks outside it")
                self._contexts.append([int(m) for m in members])
                self._comms.append(sub)
        except Exception as exc:  # raised on every rank of the first group
            error = exc
        check_agreed(comm, "BucketBuffer", {}, error)
        self._comms = [None] + [sub.Dup() for sub in self._comms[1:]]  # agreement of calls on the group
        self.num_bytes = num_bytes
        self.runtime = create_transport(comm, ranks_per_node=ranks_per_node, timeout_s=deadline)
        num_slots = _SLOTS_PER_GROUP * len(groups)
        try:
            self._win = self.runtime.create_window("bucket", num_bytes, num_slots)
        except BaseException:
            self.runtime.destroy(force=True)
            raise
        self.storage = self.runtime.local_view(self._win, 0, num_bytes)
        self._ptr = self.storage.data_ptr()
        self._expected = [[0] * self.num_ranks for _ in range(num_slots)]  # signals awaited so far, per peer
        if plan is not None:
            plan.materialize(self.storage)

    # -- lifetime -------------------------------------------------------------------------------
    def _memory_usage(self) -> dict[str, int]:
        return {"storage": self.num_bytes}

    def _destroy(self) -> None:
        self.storage = None  # a view of the window: freed with it
        try:
            self.runtime.destroy()
        except TransportBusy:  # refused on every rank: the buffer stays as it was (failed: its storage stays None)
            if self.runtime.state is State.OPEN:
                self.storage = self.runtime.local_view(self._win, 0, self.num_bytes)
            raise
        self._win = None
        for sub in self._comms[1:]:
            sub.Free()
        self._comms = [None]

    def destroy(self) -> None:
        """Collectively free the storage (every rank calls it). Requires ``explicitly_destroy=True``.

        Raises:
            RuntimeError: built without ``explicitly_destroy=True``.
            transports.TransportBusy: tensors of the storage are still alive on some rank (a plan's tensors,
                which the ``BufferAllocator`` also holds, session allocations, results): refused on every rank,
                and the buffer stays usable; drop them, then call ``destroy()`` again.
        """
        super().destroy()

    # -- groups, sizes ----------------------------------------------------------------------------
    def get_context_idx(self, group) -> int:
        """Index of ``group`` in :attr:`groups` (``None``: the only group); mirrors DeepEP.

        Raises:
            ValueError: ``group`` is not one of the buffer's groups.
        """
        if group is None:
            if len(self.groups) > 1:
                raise ValueError("BucketBuffer: `group` is required when the buffer has several groups")
            return 0
        for i, g in enumerate(self.groups):
            if g is group:
                return i
        for i, g in enumerate(self.groups):
            if g == group:
                return i
        raise ValueError(f"BucketBuffer: group {group!r} is not one of the buffer's {len(self.groups)} group(s)")

    def _context_or_zero(self, group) -> int:
        try:
            return self.get_context_idx(group)
        except ValueError:
            return 0

    def get_theoretical_num_sms(self, op: str, group=None) -> int:
        """DeepEP's automatic SM count of ``op``: ``0`` for ``'all_gather'`` (copy-engine driven in DeepEP),
        ``1`` for ``'reduce_scatter'`` and ``'all_reduce'`` (each rank reduces on its own thread here).

        Raises:
            ValueError: another ``op`` (DeepEP raises NotImplementedError) or an unknown group.
        """
        self.get_context_idx(group)
        if op == "all_gather":
            return 0
        if op in ("reduce_scatter", "all_reduce"):
            return 1
        raise ValueError(f"BucketBuffer.get_theoretical_num_sms: op must be 'all_gather', 'reduce_scatter' or "
                         f"'all_reduce', got {op!r}")

    def session(self) -> BucketSession:
        """A :class:`BucketSession`, in which the collectives accept tensors outside the storage.

        Raises:
            RuntimeError: the buffer was destroyed (also when a session made before is entered after).
        """
        self._check_alive("session")
        return BucketSession(self)

    def barrier(self, wait_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True,
                group=None) -> None:
        """Wait until every rank of the group arrived (deadline: the constructor's); mirrors DeepEP's barrier.
        ``wait_comm_stream``, ``with_cpu_sync`` and ``sequential`` are accepted; calls are synchronous here.

        Raises:
            RuntimeError: the buffer was destroyed. transports.TransportTimeout: a rank did not arrive.
        """
        self._check_alive("barrier")
        ctx = self.get_context_idx(group)
        if ctx == 0:
            self._step(lambda: self.runtime.barrier(phase="BucketBuffer.barrier"))
            return
        peers = [p for p in self._contexts[ctx] if p != self.rank_idx]
        self._announce(ctx, _SLOT_BARRIER, peers)
        self._await(ctx, _SLOT_BARRIER, peers, f"BucketBuffer.barrier (group {ctx})")

    # -- validation -------------------------------------------------------------------------------
    def _check_alive(self, op: str) -> None:
        if self.runtime is None:
            raise RuntimeError(f"BucketBuffer.{op}: the buffer was destroyed")

    def _offset_of(self, t: torch.Tensor) -> int | None:
        """``t``'s byte offset in the storage, or ``None`` when its bytes are not all inside it."""
        if self.storage is None or t.device.type != "cpu":
            return None
        off = t.data_ptr() - self._ptr
        return off if 0 <= off and off + t.nbytes <= self.num_bytes else None

    def _registered(self, op: str, what: str, t, i: int) -> int:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"BucketBuffer.{op}: {what}[{i}] must be a torch.Tensor, got {type(t).__name__}")
        if t.numel() == 0:  # a zero-size view has no bytes of the storage, so it cannot be located in it
            raise ValueError(f"BucketBuffer.{op}: {what}[{i}] ({t.dtype} {tuple(t.shape)}) is empty: the collectives "
                             f"need at least one element (skip the call for an empty bucket)")
        off = self._offset_of(t)
        if off is None or not t.is_contiguous():
            raise ValueError(f"BucketBuffer.{op}: {what}[{i}] ({t.dtype} {tuple(t.shape)} on {t.device}) must be a "
                             f"contiguous tensor inside this buffer's storage (a BufferAllocator plan or a session's "
                             f"allocate), got one {'not contiguous' if off is not None else 'outside it'}")
        return off

    def _agree(self, op: str, ctx: int, error: Exception | None, signature) -> None:
        """Collective with the deadline: raise on every rank when a rank refused its arguments or the ranks'
        ``signature`` (offsets, sizes, dtypes, options) differ; this rank's own error is raised as itself."""
        values = self._allgather(ctx, (None if error is None else f"{type(error).__name__}: {error}", signature),
                                 f"BucketBuffer.{op}")
        if error is not None:
            raise error
        refused = [f"rank {r} refused its arguments ({v[0]})" for r, v in enumerate(values) if v[0] is not None]
        if refused:
            raise ValueError(f"BucketBuffer.{op}: " + "; ".join(refused))
        if any(v[1] != values[0][1] for v in values):
            raise ValueError(f"BucketBuffer.{op}: the ranks disagree on collective arguments (tensor offsets in the "
                             f"storage, sizes, dtypes and options must match): "
                             + "; ".join(f"rank {r}: {v[1]!r}" for r, v in enumerate(values)))

    def _allgather(self, ctx: int, obj, phase: str) -> list:
        """Every rank's ``obj`` in group ``ctx``'s rank order, with the deadline (the first group: the transport's
        own gather; another: the group's duplicated communicator, polled)."""
        if ctx == 0:
            return self._step(lambda: self.runtime.allgather_object(obj, phase=phase))
        deadline = time.monotonic() + self.runtime.timeout_s
        pauses = WaitPolicy(local_ranks=self.runtime.topology.ranks_per_node).pauses()

        def wait(req):
            while not req.Test():
                self.runtime.check_abort(phase)  # a member that failed aborted its peers: fail now, naming it
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank {self.rank_idx}: {phase}: not every rank of group {ctx} (ranks "
                                       f"{self._contexts[ctx]}) entered the call within {self.runtime.timeout_s} s")
                time.sleep(next(pauses))
        return self._step(lambda: allgather_object(self._comms[ctx], obj, wait))

    def _validate(self, op: str, group, num_sms, fn, unpacked: Exception | None = None):
        """Run the local checks ``fn(ctx) -> (plan, signature)`` on this rank, then agree with the group;
        ``unpacked``: the batching's error (:func:`_pack_tensors`), refused first."""
        error, plan, signature, ctx = None, None, None, 0
        try:
            self._check_alive(op)
            ctx = self.get_context_idx(group)
            if unpacked is not None:
                raise unpacked
            if num_sms is not None and (not is_int(num_sms) or num_sms < 0):
                raise ValueError(f"BucketBuffer.{op}: num_sms must be None or a non-negative int, got {num_sms!r}")
            if op == "all_gather" and num_sms not in (None, 0):
                raise ValueError(f"BucketBuffer.all_gather: num_sms must be 0 or None (copy-engine driven), "
                                 f"got {num_sms!r}")
            plan, signature = fn(ctx)
        except Exception as exc:  # raised on every rank by _agree
            error = exc
        if self.runtime is None:
            raise error
        self._agree(op, ctx, error, signature)
        return ctx, plan

    # -- signals ----------------------------------------------------------------------------------
    def _announce(self, ctx: int, kind: int, peers: list[int]) -> None:
        tp, win, slot = self.runtime, self._win, ctx * _SLOTS_PER_GROUP + kind
        for p in peers:
            tp.signal(win, p, slot)

    def _await(self, ctx: int, kind: int, peers: list[int], phase: str) -> None:
        if not peers:
            return
        slot = ctx * _SLOTS_PER_GROUP + kind
        need = self._expected[slot]
        for p in peers:
            need[p] += 1
        self._step(lambda: self.runtime.wait_until(self._win, slot, peers, [need[p] for p in peers],
                                                   phase=f"{phase}: rank {self.rank_idx} waits for ranks {peers}"))

    def _finish(self, ctx: int, op: str, peers: list[int]) -> None:
        """Tell the peers this rank read their windows, then wait until they all read ours."""
        self._announce(ctx, _SLOT_DONE, peers)
        self._await(ctx, _SLOT_DONE, peers, f"BucketBuffer.{op} (peers finishing their reads of this rank's storage)")

    def _get(self, peer: int, offset: int, out: torch.Tensor) -> None:
        """``out`` from ``peer``'s storage at byte ``offset`` (one copy; a remote node's by a one-sided read)."""
        self._step(lambda: self.runtime.get(self._win, peer, offset, out))

    def _add_from(self, acc: torch.Tensor, peer: int, offset: int, dtype: torch.dtype) -> None:
        """``acc += peer's elements at byte offset`` (``acc.numel()`` of them, stored as ``dtype``): a node
        peer's bytes are added straight from its window, a remote one's are fetched once."""
        tp, win = self.runtime, self._win
        nbytes = acc.numel() * dtype.itemsize
        if tp.channel_kind(win, peer) is ChannelKind.URMA:
            part = torch.empty(acc.numel(), dtype=dtype)
            self._get(peer, offset, part)
        else:
            part = tp.peer_view(win, peer, offset, nbytes, dtype)
            tp.record_fetch(peer, nbytes)
        acc.add_(part)

    # -- collectives --------------------------------------------------------------------------------
    def all_gather(self, srcs, dsts=None, group=None, num_sms: int | None = None) -> EventOverlap:
        """Batched all-gather; mirrors ``deep_ep.BucketBuffer.all_gather``.

        Args:
            srcs: a tensor or a sequence of tensors (any dtype, ``S`` bytes each, may differ per tensor).
                Without ``dsts`` each must lie in the storage as the ``rank``-th of ``num_ranks`` consecutive
                ``S``-byte shards (the gathered tensor), gathered in place. With ``dsts`` any contiguous CPU
                tensors (copied into their shard of the dst first; DeepEP allows this on NVLink only).
            dsts: ``None``, or one tensor per src, contiguous, inside the storage, ``num_ranks * S`` bytes.
            group: the buffer's group (``None``: the only one).
            num_sms: ``0`` or ``None``.
        Returns:
            an :class:`EventOverlap` (already complete) whose ``wait()`` returns the gathered tensor(s), 1-D
            views of the storage with the dtype of ``srcs`` (one tensor when ``srcs`` was one); ``num_sms``
            attribute as DeepEP's handle.
        Raises:
            TypeError / ValueError: on every rank of the group, before any byte moves: a tensor
                outside the storage or not contiguous, a shard that does not fit, ``dsts`` of the wrong size
                or count, ranks disagreeing on offsets, sizes or dtypes, a bad ``num_sms`` or group.
            transports.TransportTimeout: a peer did not take part within the deadline (naming it).
        """
        is_packed, srcs, dsts, unpacked = _pack_tensors("all_gather", ("srcs", "dsts"), srcs, dsts)

        def check(ctx):
            members = self._contexts[ctx]
            n, r = len(members), members.index(self.rank_idx)
            if not srcs or (dsts and len(dsts) != len(srcs)):
                raise ValueError(f"BucketBuffer.all_gather: need at least one src and as many dsts as srcs "
                                 f"(or none), got {len(srcs)} srcs and {len(dsts)} dsts")
            plan, signature = [], []
            for i, src in enumerate(srcs):
                if dsts:
                    if not isinstance(src, torch.Tensor) or src.device.type != "cpu" or not src.is_contiguous():
                        raise ValueError(f"BucketBuffer.all_gather: srcs[{i}] must be a contiguous CPU tensor")
                    base = self._registered("all_gather", "dsts", dsts[i], i)
                    if dsts[i].nbytes != n * src.nbytes:
                        raise ValueError(f"BucketBuffer.all_gather: dsts[{i}] must hold num_ranks ({n}) x srcs[{i}]'s "
                                         f"{src.nbytes} bytes, got {dsts[i].nbytes}")
                else:
                    base = self._registered("all_gather", "srcs", src, i) - r * src.nbytes
                    if base < 0 or base + n * src.nbytes > self.num_bytes:
                        raise ValueError(f"BucketBuffer.all_gather: srcs[{i}] at byte {base + r * src.nbytes} of the "
                                         f"storage cannot be shard {r} of {n} (the gathered tensor would span bytes "
                                         f"[{base}, {base + n * src.nbytes}) of {self.num_bytes})")
                if src.dtype.itemsize and base % src.dtype.itemsize:
                    raise ValueError(f"BucketBuffer.all_gather: the gathered tensor's offset {base} is not a "
                                     f"multiple of {src.dtype}'s size")
                if dsts and dsts[i].dtype != src.dtype:
                    raise ValueError(f"BucketBuffer.all_gather: dsts[{i}] must have srcs[{i}]'s dtype {src.dtype}, got "
                                     f"{dsts[i].dtype}")
                plan.append((src, base, src.nbytes))
                signature.append((base, src.nbytes, str(src.dtype)))
            _check_apart("all_gather", "dsts" if dsts else "srcs",
                         [(i, base, base + n * nbytes) for i, (_, base, nbytes) in enumerate(plan)])
            if dsts:  # a src is its own shard of its dst, or apart from every dst (else a copy overwrites it first)
                for i, (src, _, nbytes) in enumerate(plan):
                    lo = src.data_ptr() - self._ptr
                    own = plan[i][1] + r * nbytes
                    for j, (_, base, size) in enumerate(plan):
                        if lo == own and j == i or not (lo < base + n * size and base < lo + nbytes):
                            continue
                        raise ValueError(f"BucketBuffer.all_gather: srcs[{i}] shares bytes of the storage with "
                                         f"dsts[{j}] without being its own shard {r} there; a src is that shard, or "
                                         f"apart from every dst")
            return plan, (bool(dsts), tuple(signature))

        ctx, plan = self._validate("all_gather", group, num_sms, check, unpacked)
        members = self._contexts[ctx]
        n, r = len(members), members.index(self.rank_idx)
        peers = [p for p in members if p != self.rank_idx]
        outputs = []
        for src, base, nbytes in plan:
            own = self.storage.narrow(0, base + r * nbytes, nbytes)
            if own.data_ptr() != src.data_ptr() and nbytes:
                own.copy_(src.reshape(-1).view(torch.uint8))
            outputs.append(self.storage.narrow(0, base, n * nbytes).view(src.dtype))
        self._announce(ctx, _SLOT_READY, peers)
        self._await(ctx, _SLOT_READY, peers, "BucketBuffer.all_gather (peers' shards ready)")
        for _, base, nbytes in plan:
            for q in range(1, n):  # shards in ring order from the next rank: spreads the reads over peers
                p = (r + q) % n
                if nbytes:
                    self._get(members[p], base + p * nbytes, self.storage.narrow(0, base + p * nbytes, nbytes))
        self._finish(ctx, "all_gather", peers)
        return self._handle(outputs, is_packed, 0 if num_sms is None else num_sms)

    def _reduce_checks(self, op: str, srcs, scale, ctx: int, shard: bool):
        members = self._contexts[ctx]
        n = len(members)
        if not srcs:
            raise ValueError(f"BucketBuffer.{op}: need at least one src")
        if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.integer, np.floating)):
            raise TypeError(f"BucketBuffer.{op}: scale must be a float, got {type(scale).__name__}")
        plan, signature = [], []
        for i, src in enumerate(srcs):
            off = self._registered(op, "srcs", src, i)
            if src.dtype != torch.float32:
                raise ValueError(f"BucketBuffer.{op}: srcs[{i}] must be torch.float32 (DeepEP reduces FP32 buckets), "
                                 f"got {src.dtype}")
            if shard and src.numel() % n:
                raise ValueError(f"BucketBuffer.{op}: srcs[{i}] has {src.numel()} elements, not a multiple of the "
                                 f"group's {n} ranks")
            plan.append((src, off))
            signature.append((off, src.numel()))
        _check_apart(op, "srcs", [(i, off, off + src.nbytes) for i, (src, off) in enumerate(plan)])
        return plan, tuple(signature)

    def reduce_scatter(self, srcs, comm_precision: str = "fp32", scale: float = 1.0, group=None,
                       num_sms: int | None = None) -> EventOverlap:
        """Batched in-place reduce-scatter; mirrors ``deep_ep.BucketBuffer.reduce_scatter``.

        Rank ``r``'s result is shard ``r`` of the element-wise sum of every rank's src, times ``scale``, written
        over shard ``r`` of its own src. The sum runs in FP32 in the order ``r, r-1, ..., r+1`` (mod the group's
        size, DeepEP's RDMA order); ``scale`` multiplies the sum once (docs/semantics/deepep-api.md §14.3).

        Args:
            srcs: a tensor or a sequence of tensors, float32, contiguous, inside the storage, ``numel`` a
                multiple of the group's size. Their other shards are unspecified afterwards.
            comm_precision: ``'fp32'``, or ``'bf16'``: every contribution (this rank's too) is rounded to
                bfloat16 (to nearest even) before the FP32 sum, and peers read half the bytes. DeepEP rounds
                stochastically and offers bf16 on its pure-RDMA path only.
            scale: multiplies the sum (a float; ``1.0`` leaves it as is; NaN and infinities are applied as
                IEEE arithmetic does, as in DeepEP). The same on every rank, compared by value with NaN equal
                to NaN and -0.0 unequal to 0.0.
            group: the buffer's group. num_sms: ``None`` or a non-negative int (no meaning on CPU ranks).
        Returns:
            an :class:`EventOverlap` whose ``wait()`` returns the 1-D shard view(s), at ``src.data_ptr() +
            r * dst.nbytes``; its ``num_sms`` is ``get_theoretical_num_sms`` when ``num_sms`` is ``None``.
        Raises:
            TypeError / ValueError: on every rank of the group, before any byte moves: a src outside
                the storage, not float32, not divisible, a bad ``comm_precision``, ``scale`` or ``num_sms``,
                ranks disagreeing on any of them.
            transports.TransportTimeout: a peer did not take part within the deadline (naming it).
        """
        is_packed, srcs, unpacked = _pack_tensors("reduce_scatter", ("srcs",), srcs)

        def check(ctx):
            if comm_precision not in _PRECISIONS:
                raise ValueError(f"BucketBuffer.reduce_scatter: comm_precision must be one of {_PRECISIONS}, "
                                 f"got {comm_precision!r}")
            plan, signature = self._reduce_checks("reduce_scatter", srcs, scale, ctx, shard=True)
            return plan, (comm_precision, _scale_key(scale), signature)

        ctx, plan = self._validate("reduce_scatter", group, num_sms, check, unpacked)
        members = self._contexts[ctx]
        n, r = len(members), members.index(self.rank_idx)
        peers = [p for p in members if p != self.rank_idx]
        bf16 = comm_precision == "bf16"
        outputs = []
        for src, _ in plan:
            rows = src.view(n, -1)
            if bf16:  # encode every shard to bf16 in the first half of its bytes: what peers read
                encoded = rows.to(torch.bfloat16)
                rows.view(torch.uint8)[:, :encoded.shape[1] * 2].copy_(encoded.view(torch.uint8))
                rows[r].copy_(encoded[r])
            outputs.append(rows[r])
        self._announce(ctx, _SLOT_READY, peers)
        self._await(ctx, _SLOT_READY, peers, "BucketBuffer.reduce_scatter (peers' sources ready)")
        dtype = torch.bfloat16 if bf16 else torch.float32
        for (_, off), out in zip(plan, outputs):
            shard_bytes = out.numel() * 4
            for i in range(1, n):
                p = (r - i) % n
                self._add_from(out, members[p], off + r * shard_bytes, dtype)
            if scale != 1.0:
                out.mul_(float(scale))
        self._finish(ctx, "reduce_scatter", peers)
        return self._handle(outputs, is_packed, self.get_theoretical_num_sms("reduce_scatter", self.groups[ctx])
                            if num_sms is None else num_sms)

    def all_reduce(self, srcs, scale: float = 1.0, group=None, num_sms: int | None = None) -> EventOverlap:
        """Batched in-place all-reduce; mirrors ``deep_ep.BucketBuffer.all_reduce``.

        Every src is split into ``n`` chunks (chunk ``c`` = elements ``[c*N//n, (c+1)*N//n)``); rank ``c``
        sums chunk ``c`` over the ranks in the order ``c, c-1, ..., c+1`` (mod ``n``) in FP32, multiplies by
        ``scale``, and every rank then copies the reduced chunks: all ranks end with identical bytes
        (docs/semantics/deepep-api.md §14.3).

        Args:
            srcs: a tensor or a sequence of tensors, float32, contiguous, inside the storage; overwritten.
            scale: multiplies the sum. group: the buffer's group. num_sms: ``None`` or a non-negative int.
        Returns:
            an :class:`EventOverlap` whose ``wait()`` returns ``srcs`` (reduced).
        Raises:
            as :meth:`reduce_scatter` (any element count is accepted).
        """
        is_packed, srcs, unpacked = _pack_tensors("all_reduce", ("srcs",), srcs)

        def check(ctx):
            plan, signature = self._reduce_checks("all_reduce", srcs, scale, ctx, shard=False)
            return plan, (_scale_key(scale), signature)

        ctx, plan = self._validate("all_reduce", group, num_sms, check, unpacked)
        members = self._contexts[ctx]
        n, r = len(members), members.index(self.rank_idx)
        peers = [p for p in members if p != self.rank_idx]
        self._announce(ctx, _SLOT_READY, peers)
        self._await(ctx, _SLOT_READY, peers, "BucketBuffer.all_reduce (peers' sources ready)")
        for src, off in plan:
            lo, hi = r * src.numel() // n, (r + 1) * src.numel() // n
            out = src.view(-1)[lo:hi]
            for i in range(1, n):
                if hi > lo:
                    self._add_from(out, members[(r - i) % n], off + lo * 4, torch.float32)
            if scale != 1.0:
                out.mul_(float(scale))
        self._announce(ctx, _SLOT_REDUCED, peers)
        self._await(ctx, _SLOT_REDUCED, peers, "BucketBuffer.all_reduce (peers' chunks reduced)")
        for src, off in plan:
            flat = src.view(-1)
            for q in range(1, n):
                p = (r + q) % n
                lo, hi = p * src.numel() // n, (p + 1) * src.numel() // n
                if hi > lo:
                    self._get(members[p], off + lo * 4, flat[lo:hi])
        self._finish(ctx, "all_reduce", peers)
        return self._handle(list(srcs), is_packed, self.get_theoretical_num_sms("all_reduce", self.groups[ctx])
                            if num_sms is None else num_sms)

    @staticmethod
    def _handle(outputs: list, is_packed: bool, num_sms: int) -> EventOverlap:
        handle = EventOverlap(EventHandle())
        handle.register_hook_after_wait(lambda: outputs[0] if is_packed else outputs)
        handle.num_sms = num_sms
        return handle

