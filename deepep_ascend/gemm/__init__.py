"""Kernels in DeepGEMM's role: FP8/FP4/LogFMT codecs and scale layouts, the dequantized-weight cache, and
the grouped and dense GEMMs, on CPU torch (with the native AMX kernel where the CPU has it).

This room never imports the EP communication code (docs/design/architecture.md).
"""

from . import grouped_gemm, quant
from .grouped_gemm import *  # noqa: F403
from .quant import *  # noqa: F403

__all__ = quant.__all__ + grouped_gemm.__all__
