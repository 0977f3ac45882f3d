"""Integer rounding: how many blocks of a size hold a count, and a count rounded up to a multiple of a size.

A leaf (it imports nothing), shared by every room that sizes windows, regions, segments and padded layouts:
the EP room's buffers and engines, DeepGEMM's scale layouts, MegaMoE's waves and layouts, the training glue,
``deep_ep.utils.math``'s ``align`` / ``ceil_div``. (The transports read no module of the library but its
settings, so they round on their own.)
"""

from __future__ import annotations

__all__ = ["align", "ceil_div"]


def ceil_div(x, y: int):
    """``ceil(x / y)`` for an int ``y >= 1``: DeepEP's and DeepGEMM's ``ceil_div``, ``(x + y - 1) // y``. Exact for
    every Python int ``x`` (negative ones too); on an integer tensor, array or numpy scalar, elementwise, wherever
    ``x + y - 1`` stays inside its dtype (unsigned ones included)."""
    return (x + (y - 1)) // y


def align(x, y: int):
    """The smallest multiple of ``y`` that is ``>= x`` (``ceil_div(x, y) * y``): DeepEP's and DeepGEMM's
    ``align``; ``x`` as for :func:`ceil_div`, ``y`` an int ``>= 1``."""
    return (x + (y - 1)) // y * y
