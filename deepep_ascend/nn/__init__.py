"""Training glue: differentiable dispatch/combine (:mod:`.autograd`), a DeepSeek-style MoE layer
(:mod:`.moe`) and distributed start-up from an MPI launch (:mod:`.dist`)."""

from . import autograd, dist, moe
from .moe import MoE

__all__ = ["MoE", "autograd", "dist", "moe"]
