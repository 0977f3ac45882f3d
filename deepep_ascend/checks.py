"""Whether a tensor is memory the CPU code can read: the one check every room makes on its inputs.

A leaf (it imports only torch), so that the EP room, the kernel rooms and MegaMoE reject the same tensors
with the same words.
"""

from __future__ import annotations

import torch

__all__ = ["check_storage", "storage_problem"]


def storage_problem(t: torch.Tensor) -> str | None:
    """Why ``t`` is not a dense CPU tensor, as ``"must be ..., got ..."``, or None when it is one.

    A ``meta`` tensor has no data, and a sparse, mkldnn, nested or other device's tensor is not memory the
    CPU paths can read. ``t`` must be a ``torch.Tensor`` (callers check the type first).
    """
    if not t.is_cpu:
        return f"must be a CPU tensor, got device {t.device}"
    if t.layout != torch.strided or t.is_nested:
        return f"must be a dense (strided) tensor, got {'a nested tensor' if t.is_nested else f'layout {t.layout}'}"
    return None


def check_storage(name: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` itself if it is a dense CPU tensor.

    Raises:
        ValueError: ``"<name> must be ..., got ..."`` (:func:`storage_problem`).
    """
    problem = storage_problem(t)
    if problem is not None:
        raise ValueError(f"{name} {problem}")
    return t
