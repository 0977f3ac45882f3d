"""deepep_ascend: DeepEP's expert-parallel Buffer on CPU ranks over MPI, simulating Ascend 950 channels.

Public surface mirrors ``deep_ep``: :class:`Buffer`, :class:`Config`, :class:`EventOverlap`,
:class:`EventHandle`, ``topk_idx_t``.
"""

from .buffer import Buffer
from .config import Config
from .event import EventHandle, EventOverlap
from .intranode import ConsensusError
from .layout import topk_idx_t
from . import grouped_gemm, quant  # DeepGEMM-aligned codecs and grouped GEMMs
from .grouped_gemm import *  # noqa: F401,F403
from .quant import *  # noqa: F401,F403
from . import mega_moe  # DeepGEMM's MegaMoE over the normal-mode Buffer
from .mega_moe import *  # noqa: F401,F403
from . import autograd, dist, moe  # noqa: F401,E402  training: deepep_ascend.autograd.dispatch/combine, dist, moe.MoE

__version__ = "0.1.0"

__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap", "ConsensusError", "topk_idx_t", "__version__"]
__all__ += quant.__all__ + grouped_gemm.__all__ + mega_moe.__all__
