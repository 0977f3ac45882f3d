"""Planned symmetric allocations and the common buffer lifetime: DeepEP V2.5's ``BufferAllocator`` and
``BufferBase`` (docs/semantics/deepep-api.md §13.8).

A :class:`BufferAllocator` first plans tensors (``allocate`` returns placeholders on the ``meta``
device, each at an offset aligned to :func:`get_num_allocation_alignment`), then ``materialize``
swaps every placeholder for a view of one byte storage, so that all ranks that planned the same
shapes in the same order hold the same offsets: a tensor's place in a peer's storage is known
without asking.
"""

from __future__ import annotations

import torch

from ..rounding import align
from .failure import run_step

__all__ = ["BufferAllocator", "BufferBase", "SharedOnCopy", "get_num_allocation_alignment", "get_num_rdma_alignment",
           "get_num_tma_alignment"]

_ALLOCATION_ALIGNMENT = 128  # bytes: the windows' row alignment (docs/design/transports.md)


# DeepEP's kNumTMAAlignmentBytes / kNumRDMAAlignmentBytes: sizes its callers keep aligned (bytes per expert of
# lb_prefetch_weights, row bytes); every size a CPU rank copies works, so these are only reported
_TMA_ALIGNMENT = 32
_RDMA_ALIGNMENT = 64


def get_num_allocation_alignment() -> int:
    """Bytes every buffer size and planned offset is a multiple of (``deep_ep.get_num_allocation_alignment``)."""
    return _ALLOCATION_ALIGNMENT


def get_num_tma_alignment() -> int:
    """DeepEP's TMA alignment in bytes, 32 (``deep_ep.get_num_tma_alignment``): code written for DeepEP keeps its
    sizes (an expert's bytes in ``lb_prefetch_weights``) multiples of it; here any size works
    (docs/semantics/deepep-api.md §13.8)."""
    return _TMA_ALIGNMENT


def get_num_rdma_alignment() -> int:
    """DeepEP's RDMA alignment in bytes, 64 (``deep_ep.get_num_rdma_alignment``); reported as
    :func:`get_num_tma_alignment` is (docs/semantics/deepep-api.md §13.8)."""
    return _RDMA_ALIGNMENT


class BufferAllocator:
    """Plan aligned tensors, then place them all in one storage; mirrors ``deep_ep.BufferAllocator``.

    Attributes:
        alignment: bytes (:func:`get_num_allocation_alignment`).
        allocations: ``[(tensor, offset)]`` in planning order.
        num_bytes: the storage size the plan needs (a multiple of ``alignment``).
        materialized: whether :meth:`materialize` ran.
    """

    def __init__(self):
        self.alignment = get_num_allocation_alignment()
        self.allocations: list[tuple[torch.Tensor, int]] = []
        self.num_bytes = 0
        self.materialized = False

    def allocate(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """Plan a tensor of ``shape`` and ``dtype``; returns its placeholder (``meta`` device) that
        :meth:`materialize` turns into the real tensor in place.

        Raises:
            RuntimeError: the plan was already materialized.
        """
        if self.materialized:
            raise RuntimeError("BufferAllocator.allocate: a materialized allocation plan cannot be changed")
        tensor = torch.empty(shape, dtype=dtype, device="meta")
        offset = align(self.num_bytes, self.alignment)
        self.allocations.append((tensor, offset))
        self.num_bytes = align(offset + tensor.nbytes, self.alignment)
        return tensor

    def materialize(self, storage: torch.Tensor) -> None:
        """Swap every planned placeholder for its view of ``storage`` (``[num_bytes]`` contiguous uint8, CPU).

        Raises:
            RuntimeError: materialized twice.
            ValueError: ``storage`` is not a contiguous CPU uint8 vector of exactly ``num_bytes``.
        """
        if self.materialized:
            raise RuntimeError("BufferAllocator.materialize: an allocation plan can only be materialized once")
        ok = (isinstance(storage, torch.Tensor) and storage.device.type == "cpu" and storage.dtype == torch.uint8
              and storage.dim() == 1 and storage.is_contiguous() and storage.numel() == self.num_bytes)
        if not ok:
            got = (f"{storage.dtype} {tuple(storage.shape)} on {storage.device}"
                   if isinstance(storage, torch.Tensor) else type(storage).__name__)
            raise ValueError(f"BufferAllocator.materialize: storage must be a contiguous CPU uint8 tensor of "
                             f"[{self.num_bytes}] bytes, got {got}")
        for tensor, offset in self.allocations:
            view = storage.narrow(0, offset, tensor.nbytes).view(tensor.dtype).view(tensor.shape)
            torch.utils.swap_tensors(tensor, view)
        self.materialized = True


class SharedOnCopy:
    """A buffer is this rank's handle to collective communication windows, not data: ``copy.deepcopy`` of an object
    holding one (a model made expert-parallel, an EMA copy of it) shares the buffer instead of failing on its
    MPI communicator."""

    def __deepcopy__(self, memo):
        return self


class BufferBase(SharedOnCopy):
    """The lifetime common to DeepEP V2.5's buffers (``deep_ep.BufferBase``): ``destroy`` needs
    ``explicitly_destroy=True``; :meth:`print_memory_usage` prints what this rank holds.

    Subclasses set ``runtime`` (their transport) and implement :meth:`_memory_usage` and :meth:`_destroy`.
    """

    #: The class name this buffer's messages give, where it differs from the Python class's (a subclass that is
    #: another library's class of the same name, such as DeepEP-Ascend's ``EPBuffer``).
    API_NAME: str | None = None

    def __init__(self, explicitly_destroy: bool = False):
        self.explicitly_destroy = explicitly_destroy
        self.runtime = None

    @property
    def api_name(self) -> str:
        """The class name the user knows this buffer by (``EPBuffer``, ``ElasticBuffer``, ...), as messages give it."""
        return self.API_NAME or type(self).__name__

    def _step(self, fn):
        """``fn()``, a step that waits for peers or moves their bytes, as every buffer runs one
        (:func:`~deepep_ascend.ep.failure.run_step`): if it fails here (a deadline passed, a transfer failed), the
        peers are aborted, so that those waiting for this rank fail at once, naming it, instead of at their own
        deadline."""
        return run_step(self.runtime, self.rank_idx, fn)

    def _memory_usage(self) -> dict[str, int]:  # pragma: no cover - abstract
        raise NotImplementedError

    def _destroy(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def print_memory_usage(self) -> None:
        """Print this rank's buffer sizes in bytes (and MiB): communication windows, LB storage, ...

        Raises:
            RuntimeError: the buffer was destroyed.
        """
        if self.runtime is None:
            raise RuntimeError(f"{self.api_name}.print_memory_usage: the buffer was destroyed")
        parts = ", ".join(f"{name} {nbytes} B ({nbytes / 2 ** 20:.2f} MiB)"
                          for name, nbytes in self._memory_usage().items())
        print(f"{self.api_name} rank {self.rank_idx}/{self.num_ranks}: {parts}", flush=True)

    def destroy(self) -> None:
        """Collectively free the buffer (every rank calls it). Requires ``explicitly_destroy=True``.

        Raises:
            RuntimeError: built without ``explicitly_destroy=True``.
        """
        if not self.explicitly_destroy:
            raise RuntimeError(f"{self.api_name}.destroy: construct with explicitly_destroy=True to destroy "
                               f"explicitly (otherwise the buffer is freed when collected)")
        if self.runtime is not None:
            self._destroy()
            self.runtime = None
