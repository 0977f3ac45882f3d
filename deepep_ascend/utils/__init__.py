"""DeepEP's ``deep_ep.utils`` names, so that code importing them ports by changing its imports only.

* ``deepep_ascend.utils.EventHandle`` / ``EventOverlap`` (``from deep_ep.utils import EventHandle, EventOverlap``);
* :mod:`.event`: the same two;
* :mod:`.math`: ``ceil_div``, ``align``, ``calc_diff``, ``per_token_cast_to_fp8`` (DeepEP's helper recipe,
  docs/semantics/deepep-api.md §4.8), ``per_token_cast_back``;
* :mod:`.envs`: ``get_physical_domain_size``, ``get_logical_domain_size``.

Not provided: ``init_dist`` and the rest of DeepEP's launcher and test helpers (the launcher is what a port
changes: ``mpiexec`` and an mpi4py communicator or a ProcessGroup, docs/porting.md).
"""
from __future__ import annotations

from ..ep.event import EventHandle, EventOverlap
from . import envs as envs
from . import event as event
from . import math as math

__all__ = ["EventHandle", "EventOverlap", "envs", "event", "math"]
