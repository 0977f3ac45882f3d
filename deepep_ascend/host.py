"""What this host is, as the library's limits and defaults read it: its physical memory.

A leaf (it imports nothing of the library), shared by the rooms whose bounds follow the host: the EP room's
refusal of outputs no host could hold (``Buffer.dispatch``'s ``num_worst_tokens``) and the weight caches' default
budget (a quarter of it).
"""

from __future__ import annotations

import functools
import os

__all__ = ["physical_memory_bytes"]


@functools.cache
def physical_memory_bytes() -> int | None:
    """This host's physical memory in bytes (``sysconf``'s page size times its physical pages), or None where the
    system does not say. Read once (a dispatch with ``num_worst_tokens`` asks on every call)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
