"""MegaMoE: DeepGEMM's fused dispatch -> L1 GEMM -> SwiGLU -> L2 GEMM -> combine on CPU ranks."""

from . import core
from .core import *  # noqa: F403

__all__ = list(core.__all__)
