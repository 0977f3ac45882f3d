"""``deep_ep.utils.envs``'s domain sizes of a group (docs/semantics/deepep-api.md §13.1)."""
from __future__ import annotations

from ..ep.group import get_logical_domain_size, get_physical_domain_size

__all__ = ["get_logical_domain_size", "get_physical_domain_size"]
