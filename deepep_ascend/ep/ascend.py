"""DeepEP-Ascend 1.0's ``EPBuffer``: the same buffer and data plane as :mod:`.ep_buffer`, whose handles lay their
fields out as DeepEP-Ascend does (:class:`~.ep_handle.AscendEPHandle`; docs/semantics/deepep-api.md §13.10).
Reached as ``deepep_ascend.ascend.EPBuffer`` (the face :mod:`deepep_ascend.ascend`).

DeepEP V2.5 and DeepEP-Ascend give ``recv_src_metadata`` the same name and shape but different column orders; code
written for either reads it unchanged by choosing the namespace it imports.
"""

from __future__ import annotations

from .ep_buffer import EPBuffer
from .ep_handle import AscendEPHandle

__all__ = ["AscendEPBuffer"]


class AscendEPBuffer(EPBuffer):
    """DeepEP-Ascend 1.0's ``deep_ep.EPBuffer``: :class:`EPBuffer` (same arguments, calls and results) whose
    dispatches return :class:`AscendEPHandle`."""

    API_NAME = "EPBuffer"  # DeepEP-Ascend's name: its users' messages say EPBuffer

    def _make_handle(self, **fields) -> AscendEPHandle:
        return AscendEPHandle(rank=self.rank_idx, num_ranks=self.num_ranks, **fields)
