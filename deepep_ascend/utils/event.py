"""``deep_ep.utils.event``: :class:`EventHandle` and :class:`EventOverlap` (docs/semantics/deepep-api.md §3.3)."""
from __future__ import annotations

from ..ep.event import EventHandle, EventOverlap

__all__ = ["EventHandle", "EventOverlap"]
