"""``PPBuffer``: DeepEP V2.5's pipeline-parallel send / recv between neighbours of a ring, on CPU ranks
(docs/semantics/deepep-api.md §14.2).

Every rank owns one window with ``num_max_inflight_tensors`` receive slots per ring direction (from the
previous rank, from the next). ``send`` waits until the receiver has released the slot it is about to
reuse (at most ``num_max_inflight_tensors`` tensors in flight per direction), writes the tensor's bytes
straight into that slot of the receiver's window (UBMEM store inside a node, URMA put between nodes:
one copy), and signals its arrival. ``recv`` waits for the arrival, copies the slot into the caller's
tensor (the second and last copy) and signals the release back. Counters only grow (no reset), so a
slot is overwritten only after its previous contents were consumed.
"""

from __future__ import annotations

import itertools

import torch

from ..checks import is_int
from ..rounding import align
from ..transports import ChannelKind, SharedMemoryExhausted, create_transport
from .allocator import BufferBase
from .arguments import sl_idx_problem
from .event import EventHandle, EventOverlap, Worker
from .group import check_agreed, mpi_comm_of, resolve_deadline
from .memory import outside_inference_mode

__all__ = ["PPBuffer"]

_SLOT_ALIGNMENT = 128  # bytes: each receive slot starts on a window row (docs/design/transports.md)
_SLOT_ARRIVAL = 0  # signal slot on the receiver: tensors a source has written into our slots
_SLOT_RELEASE = 1  # signal slot on the sender: tensors the receiver has copied out (slots free again)
_HEADER_WORDS = 2  # int64 per receive slot: payload bytes, sequence number (1-based) of the tensor
_IDS = itertools.count()


class PPBuffer(BufferBase):
    """Symmetric storage for pipeline-parallel send / recv between ring neighbours (``deep_ep.PPBuffer``).

    Args:
        group: a torch ProcessGroup (ranks equal to MPI's, as under ``mpiexec``) or an mpi4py communicator.
        num_max_tensor_bytes: the largest tensor one ``send`` / ``recv`` moves, in bytes (> 0).
        num_max_inflight_tensors: tensors that may be sent and not yet received, per ordered pair of
            neighbours (> 0); a further ``send`` waits until the receiver consumes the oldest one.
        sl_idx: DeepEP's RDMA service level; accepted, no meaning on CPU ranks.
        num_gpu_timeout_secs: the deadline in seconds of every wait of ``send`` / ``recv`` (DeepEP's
            kernel-side timeout); ``$DEEPEP_ASCEND_TIMEOUT_S``, if set, wins over it, ``timeout_s`` over both.
        explicitly_destroy: as DeepEP: :meth:`destroy` must then be called on every rank.
        ranks_per_node: simulated node size (default ``$DEEPEP_ASCEND_RANKS_PER_NODE``, else the
            shared-memory domain); neighbours on different nodes are reached over URMA.
        timeout_s: the deadline in seconds (not in DeepEP; see ``num_gpu_timeout_secs``).

    Attributes:
        storage: this rank's receive slots, ``[2 * num_max_inflight_tensors * slot_bytes]`` uint8 (a view
            of the window; ``None`` after :meth:`destroy`). DeepEP's storage also holds staging slots for
            the sender's copy; here ``send`` writes from the caller's tensor directly.
        rank_idx, num_ranks: this rank and the ring's size.

    Constructing is collective over ``group``. ``send`` and ``recv`` are point-to-point: only the two
    neighbours take part, and argument errors are raised on the calling rank, before anything is written.

    Raises:
        ValueError: on every rank: a size that is not a positive int, a bad ``timeout_s``, or ranks
            disagreeing on ``num_max_tensor_bytes``, ``num_max_inflight_tensors``, ``explicitly_destroy`` or
            the deadline (naming the argument and every rank's value), before anything is allocated.
        transports.TransportConfigError: invalid ``ranks_per_node`` (the same error on every rank).
    """

    @outside_inference_mode  # its own tensors are kept across calls: normal tensors in either mode
    def __init__(self, group, num_max_tensor_bytes: int, num_max_inflight_tensors: int, sl_idx: int | None = None,
                 num_gpu_timeout_secs: int = 100, explicitly_destroy: bool = False, *,
                 ranks_per_node: int | None = None, timeout_s: float | None = None):
        super().__init__(explicitly_destroy)
        comm = mpi_comm_of(group, None, "PPBuffer")
        self.group = group
        self.rank_idx, self.num_ranks = comm.Get_rank(), comm.Get_size()
        self.sl_idx = sl_idx
        self.num_gpu_timeout_secs = num_gpu_timeout_secs
        error = None
        for name, value in (("num_max_tensor_bytes", num_max_tensor_bytes),
                            ("num_max_inflight_tensors", num_max_inflight_tensors)):
            if error is None and (not is_int(value) or value <= 0):
                error = ValueError(f"PPBuffer: {name} must be a positive int, got {value!r}")
        error = error or sl_idx_problem("PPBuffer", sl_idx)
        num_max_tensor_bytes, num_max_inflight_tensors = (int(v) if is_int(v) else v for v in (
            num_max_tensor_bytes, num_max_inflight_tensors))
        deadline, deadline_error = resolve_deadline("PPBuffer", timeout_s, num_gpu_timeout_secs)
        error = error or deadline_error
        # agreed before the window exists: ranks asking for windows of different sizes would wait for each other
        check_agreed(comm, "PPBuffer", {
            "num_max_tensor_bytes": num_max_tensor_bytes, "num_max_inflight_tensors": num_max_inflight_tensors,
            "explicitly_destroy": bool(explicitly_destroy), "deadline": deadline}, error,
            None if deadline_error else deadline)
        self.num_max_tensor_bytes = num_max_tensor_bytes
        self.num_max_inflight_tensors = num_max_inflight_tensors
        self.num_slot_bytes = align(num_max_tensor_bytes, _SLOT_ALIGNMENT)
        num_slots = 2 * num_max_inflight_tensors
        self._payload_bytes = num_slots * self.num_slot_bytes
        self._header_bytes = align(num_slots * _HEADER_WORDS * 8, _SLOT_ALIGNMENT)
        self.runtime = create_transport(comm, ranks_per_node=ranks_per_node, timeout_s=deadline)
        try:
            self._win = self.runtime.create_window("pp", self._payload_bytes + self._header_bytes, 2)
        except SharedMemoryExhausted as exc:
            self.runtime.destroy(force=True)
            raise SharedMemoryExhausted(f"PPBuffer: num_max_tensor_bytes={num_max_tensor_bytes} x "
                                        f"num_max_inflight_tensors={num_max_inflight_tensors} x 2 directions of "
                                        f"receive slots per rank: {exc}") from None
        except BaseException:
            self.runtime.destroy(force=True)
            raise
        self.storage = self.runtime.local_view(self._win, 0, self._payload_bytes)
        self._slots = [list(half) for half in self.storage.view(2, num_max_inflight_tensors, self.num_slot_bytes)]
        self._headers = self.runtime.local_view(self._win, self._payload_bytes, num_slots * _HEADER_WORDS * 8,
                                                torch.int64).view(2, num_max_inflight_tensors, _HEADER_WORDS)
        self._header = torch.zeros(_HEADER_WORDS, dtype=torch.int64)  # staged per send; put copies it out
        self._header_words = self._header.numpy()  # numpy item stores cost far less than torch indexing
        self._header_table = self._headers.numpy()
        self._next = (self.rank_idx + 1) % self.num_ranks
        self._prev = (self.rank_idx - 1) % self.num_ranks
        # A neighbour on this node: its receive slots and headers as views, stored into directly (the same
        # one copy as a put, without a put's per-call checks, which dominate a small tensor's send).
        self._peer_slots, self._peer_headers = {}, {}
        for peer in {self._next, self._prev}:
            if self.runtime.channel_kind(self._win, peer) is not ChannelKind.URMA:
                slots = self.runtime.peer_view(self._win, peer, 0, self._payload_bytes).view(
                    2, num_max_inflight_tensors, self.num_slot_bytes)
                self._peer_slots[peer] = [list(half) for half in slots]  # 1-D slot views, indexed once here
                self._peer_headers[peer] = self.runtime.peer_view(
                    self._win, peer, self._payload_bytes, num_slots * _HEADER_WORDS * 8, torch.int64).numpy().reshape(
                    2, num_max_inflight_tensors, _HEADER_WORDS)
        self._num_sent = {self._next: 0, self._prev: 0}  # per peer: tensors sent / received so far
        self._num_received = {self._next: 0, self._prev: 0}
        self._worker = Worker(f"deepep_ascend-pp-{next(_IDS)}")

    # -- layout -------------------------------------------------------------------------------
    def _direction(self, src: int, dst: int) -> int:
        """The half of ``dst``'s slots that ``src`` writes: 0 when ``dst`` is ``src``'s next rank (with two
        ranks or one, every transfer), else 1 (``dst`` is ``src``'s previous rank)."""
        return 0 if dst == (src + 1) % self.num_ranks else 1

    def _offset(self, direction: int, slot: int) -> tuple[int, int]:
        """Byte offsets of a receive slot's payload and header in the window's data region."""
        index = direction * self.num_max_inflight_tensors + slot
        return index * self.num_slot_bytes, self._payload_bytes + index * _HEADER_WORDS * 8

    # -- lifetime -----------------------------------------------------------------------------
    def _memory_usage(self) -> dict[str, int]:
        return {"receive slots": self._payload_bytes, "slot headers": self._header_bytes}

    def _destroy(self) -> None:
        self._worker.drain()
        self.storage = self._slots = self._headers = self._header_table = None  # views of the window: freed with it
        self._peer_slots, self._peer_headers = {}, {}
        self.runtime.destroy()
        self._worker.shutdown()
        self._win = None

    def get_comm_stream(self) -> Worker:
        """The buffer's worker, where ``async_finish=True`` calls run (the CPU analogue of a CUDA stream)."""
        return self._worker

    # -- send / recv ----------------------------------------------------------------------------
    def _check(self, op: str, x, peer, peer_name: str, num_sms) -> torch.Tensor:
        """``x`` as a flat byte view after DeepEP's checks (raised here, before anything is written)."""
        if self.runtime is None:
            raise RuntimeError(f"PPBuffer.{op}: the buffer was destroyed")
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"PPBuffer.{op}: x must be a torch.Tensor, got {type(x).__name__}")
        if x.is_conj() or x.is_neg():
            raise ValueError(f"PPBuffer.{op}: x is a lazily conjugated or negated view ({x.dtype} {tuple(x.shape)}); "
                             f"pass x.resolve_conj().resolve_neg() (its bytes are sent as they lie)")
        if x.layout != torch.strided:
            raise ValueError(f"PPBuffer.{op}: x must be a dense (strided) tensor, got layout {x.layout}")
        if x.device.type != "cpu" or not x.is_contiguous() or x.nbytes == 0:
            raise ValueError(f"PPBuffer.{op}: x must be a non-empty contiguous CPU tensor, got {x.dtype} "
                             f"{tuple(x.shape)} on {x.device} (contiguous={x.is_contiguous()})")
        if x.nbytes > self.num_max_tensor_bytes:
            raise ValueError(f"PPBuffer.{op}: x has {x.nbytes} bytes ({x.dtype} {tuple(x.shape)}), more than "
                             f"num_max_tensor_bytes={self.num_max_tensor_bytes}")
        if not is_int(peer) or int(peer) not in (self._next, self._prev):
            raise ValueError(f"PPBuffer.{op}: {peer_name} must be an adjacent rank in the ring of {self.num_ranks} "
                             f"(rank {self.rank_idx}: {self._prev} or {self._next}), got {peer!r}")
        if num_sms is not None and (not is_int(num_sms) or num_sms <= 0):
            raise ValueError(f"PPBuffer.{op}: num_sms must be None or a positive int, got {num_sms!r}")
        return x.detach().reshape(-1).view(torch.uint8)

    def _run(self, fn, x: torch.Tensor, async_finish: bool):
        if async_finish:
            return EventOverlap(EventHandle(self._worker.submit(fn)), extra_tensors=(x,))
        self._worker.drain()  # program order: queued calls first, then this one on the caller's thread
        fn()
        return None

    def send(self, x: torch.Tensor, dst_rank_idx: int, num_sms: int | None = None, *,
             async_finish: bool = False) -> EventOverlap | None:
        """Send ``x`` to a neighbour in the ring; mirrors ``deep_ep.PPBuffer.send``.

        Tensors between two ranks arrive in the order sent. Waits (deadline: the constructor's) while
        ``num_max_inflight_tensors`` earlier tensors to ``dst_rank_idx`` are still unreceived.

        Args:
            x: a non-empty contiguous CPU tensor of any dtype and shape, at most ``num_max_tensor_bytes``
                (its bytes are sent; DeepEP's 16-byte alignment of TMA copies is not needed here).
            dst_rank_idx: ``(rank - 1) % num_ranks`` or ``(rank + 1) % num_ranks`` (itself with one rank).
            num_sms: accepted as in DeepEP (``None`` or a positive int); no meaning on CPU ranks.
            async_finish: not in DeepEP (whose send is asynchronous on the CUDA stream): queue the send
                on the buffer's worker (:meth:`get_comm_stream`) and return at once, so the caller computes
                while it runs; ``x`` must not be modified before the returned event is waited on.
        Returns:
            ``None`` (``x`` may be reused), or with ``async_finish`` an :class:`EventOverlap`.
        Raises:
            TypeError / ValueError: on this rank, before anything is written: ``x`` not a tensor, not CPU,
                not contiguous, empty or larger than ``num_max_tensor_bytes``; ``dst_rank_idx`` not a
                neighbour; bad ``num_sms``.
            RuntimeError: the buffer was destroyed.
            TimeoutError: the receiver did not free a slot within the deadline (naming it; the buffer
                is then unusable, and the peers waiting for this rank fail at once). With ``async_finish``,
                raised by the event's wait.
            transports.TransportAborted: a peer failed meanwhile (naming it; ``TransportPeerTimeout``, also a
                ``TimeoutError``, where it timed out).
        """
        data = self._check("send", x, dst_rank_idx, "dst_rank_idx", num_sms)
        return self._run(lambda: self._step(lambda: self._send(data, dst_rank_idx)), x, async_finish)

    def recv(self, x: torch.Tensor, src_rank_idx: int, num_sms: int | None = None, *,
             async_finish: bool = False) -> EventOverlap | None:
        """Receive the next tensor from a neighbour into ``x``; mirrors ``deep_ep.PPBuffer.recv``.

        Args:
            x: the output, a non-empty contiguous CPU tensor with exactly as many bytes as the tensor
                sent (any dtype and shape; DeepEP leaves a mismatch undetected, here it raises).
            src_rank_idx: ``(rank - 1) % num_ranks`` or ``(rank + 1) % num_ranks``.
            num_sms: accepted as in DeepEP; no meaning on CPU ranks.
            async_finish: not in DeepEP: queue the receive on the buffer's worker and return an
                :class:`EventOverlap`; ``x`` holds the tensor once it is waited on.
        Returns:
            ``None`` (``x`` holds the tensor), or with ``async_finish`` an :class:`EventOverlap`.
        Raises:
            TypeError / ValueError: as :meth:`send`, for ``x`` and ``src_rank_idx``.
            ValueError: ``x.nbytes`` differs from the bytes sent; the tensor stays in its slot, so a
                ``recv`` with the right size still receives it.
            RuntimeError: the buffer was destroyed.
            TimeoutError: nothing arrived from ``src_rank_idx`` within the deadline (naming it; as :meth:`send`).
            transports.TransportAborted: as :meth:`send`.
        """
        data = self._check("recv", x, src_rank_idx, "src_rank_idx", num_sms)
        return self._run(lambda: self._recv(data, src_rank_idx), x, async_finish)

    def _send(self, data: torch.Tensor, dst: int) -> None:
        tp, win, n = self.runtime, self._win, self._num_sent[dst]
        k = self.num_max_inflight_tensors
        if n >= k:  # the slot about to be reused held tensor n - k: wait until the receiver copied it out
            tp.wait_until(win, _SLOT_RELEASE, [dst], n - k + 1,
                          phase=f"PPBuffer.send: rank {self.rank_idx} waits for rank {dst} to receive tensor "
                                f"{n - k + 1} of {n} sent (its {k} receive slots for rank {self.rank_idx} are full)")
        direction, slot, nbytes = self._direction(self.rank_idx, dst), n % k, data.numel()
        if dst in self._peer_slots:  # stores into the neighbour's window, counted as the two puts they are
            self._peer_slots[dst][direction][slot].narrow(0, 0, nbytes).copy_(data)
            self._peer_headers[dst][direction, slot] = (nbytes, n + 1)
            tp.record_put(dst, _HEADER_WORDS * 8)
            tp.record_put(dst, nbytes)
            tp.signal(win, dst, _SLOT_ARRIVAL)  # ordered: releases both stores
        else:
            payload, header = self._offset(direction, slot)
            self._header_words[0], self._header_words[1] = nbytes, n + 1
            tp.put(win, dst, header, self._header)
            tp.put_with_signal(win, dst, payload, data, _SLOT_ARRIVAL)  # releases the header put too
        self._num_sent[dst] = n + 1

    def _recv(self, data: torch.Tensor, src: int) -> None:
        tp, win, n = self.runtime, self._win, self._num_received[src]
        # (only the wait aborts the peers on failure: a size mismatch below leaves the buffer usable)
        self._step(lambda: tp.wait_until(win, _SLOT_ARRIVAL, [src], n + 1, phase=f"PPBuffer.recv: rank {self.rank_idx} "
                                         f"waits for tensor {n + 1} from rank {src}"))
        direction, slot = self._direction(src, self.rank_idx), n % self.num_max_inflight_tensors
        nbytes, seq = (int(v) for v in self._header_table[direction, slot])
        if seq != n + 1:  # the protocol's own invariant: a violation is a bug, never the caller's data
            raise RuntimeError(f"PPBuffer.recv: rank {self.rank_idx}: slot {slot} from rank {src} holds tensor "
                               f"{seq}, expected {n + 1}")
        if nbytes != data.numel():
            raise ValueError(f"PPBuffer.recv: rank {self.rank_idx}: x has {data.numel()} bytes but tensor {n + 1} "
                             f"from rank {src} has {nbytes}; it stays queued for a recv of the right size")
        data.copy_(self._slots[direction][slot].narrow(0, 0, nbytes))
        tp.signal(win, src, _SLOT_RELEASE)  # ordered: our reads of the slot finish before the sender reuses it
        self._num_received[src] = n + 1
