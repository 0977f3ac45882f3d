"""DeepEP-Ascend 1.0's namespace: ``import deepep_ascend.ascend as deep_ep`` ports code written for DeepEP-Ascend.

Every name of :mod:`deepep_ascend`'s top level, with ``EPBuffer`` and ``EPHandle`` as DeepEP-Ascend lays out the
handle (``recv_src_metadata`` in its column order, ``dst_gsge_idx``;
:class:`~deepep_ascend.ep.ep_handle.AscendEPHandle`), its ``get_num_rdma_alignment``, and ``_C``, the switches of
DeepEP-Ascend's native module that its tests call (docs/semantics/deepep-api.md §13.10). Code written for DeepEP
V2.5 imports :mod:`deepep_ascend` instead: the two upstreams give ``recv_src_metadata`` the same name and shape in
different column orders.
"""

from __future__ import annotations

import deepep_ascend as _top
from deepep_ascend import *  # noqa: F403

from .ep.allocator import get_num_allocation_alignment as _alignment
from .ep.ascend import AscendEPBuffer as EPBuffer  # noqa: F401 - exported: __all__ names the top level's
from .ep.ep_handle import AscendEPHandle as EPHandle  # noqa: F401

__all__ = [*_top.__all__, "_C"]


def get_num_rdma_alignment() -> int:
    """DeepEP-Ascend's RDMA alignment in bytes, 32 (DeepEP's is 64); reported only, as
    :func:`deepep_ascend.get_num_rdma_alignment` is (docs/semantics/deepep-api.md §13.10)."""
    return 32


class _C:
    """What DeepEP-Ascend's tests call on ``deep_ep._C`` (its native module), with the meaning it has on CPU ranks."""

    _barrier_in_prologue = False

    @staticmethod
    def set_barrier_in_prologue(enabled: bool) -> bool:
        """DeepEP-Ascend's profiling switch (a barrier in the kernels' prologue, else in their epilogue, so that a
        profiler times one part alone). Returns the previous setting. No effect here: a CPU call has no kernels to
        time apart; its phases are timed by ``python -m bench ep --phases``.

        Raises:
            TypeError: ``enabled`` is not a bool.
        """
        if not isinstance(enabled, bool):
            raise TypeError(f"set_barrier_in_prologue: `enabled` must be a bool, got {type(enabled).__name__}")
        previous, _C._barrier_in_prologue = _C._barrier_in_prologue, enabled
        return previous

    @staticmethod
    def get_num_allocation_alignment() -> int:
        """:func:`deepep_ascend.get_num_allocation_alignment` (``num_bytes`` must be a multiple of it)."""
        return _alignment()

    @staticmethod
    def get_num_tma_alignment() -> int:
        """:func:`get_num_tma_alignment` (DeepEP-Ascend exports it from ``_C`` too)."""
        return _top.get_num_tma_alignment()

    @staticmethod
    def get_num_rdma_alignment() -> int:
        """:func:`get_num_rdma_alignment`, DeepEP-Ascend's 32 (DeepEP-Ascend exports it from ``_C`` too)."""
        return get_num_rdma_alignment()
