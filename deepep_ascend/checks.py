"""The checks every room makes on its inputs: whether a tensor is memory the CPU code can read, and whether a value
is an integer as DeepEP's bindings take one.

A leaf (it imports only numpy and torch), so that the EP room, the kernel rooms and MegaMoE accept and reject the same
arguments with the same words.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["as_int", "check_storage", "is_int", "storage_problem"]


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


def is_int(v) -> bool:
    """Whether ``v`` is an integer as DeepEP's bindings take one (a Python or numpy integer, not a bool)."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def as_int(v):
    """``v`` as a Python int when it is an integer as DeepEP's bindings take one (:func:`is_int`: a numpy integer
    too), else ``v`` unchanged, for the checks to refuse. Public integer arguments pass through it first: a numpy
    integer then is the int it holds, in every check, header word and size."""
    return int(v) if type(v) is not int and is_int(v) else v
