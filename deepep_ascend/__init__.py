"""deepep_ascend: DeepEP's expert-parallel API on CPU ranks over MPI, simulating Ascend 950 channels.

Rooms (docs/design/architecture.md): :mod:`.ep` (communication: ``Buffer``), :mod:`.gemm` (codecs and
GEMMs, DeepGEMM's role), :mod:`.native` (the C kernels), :mod:`.mega_moe` (the fused MoE),
:mod:`.nn` (autograd, the MoE layer, start-up), :mod:`.transports` (the simulated channels), and two
leaves every room reads: :mod:`.settings` (every environment variable) and :mod:`.checks` (shared tensor checks).

The top level mirrors ``deep_ep`` (``EPBuffer``, ``ElasticBuffer``, ``EPHandle``, ``BufferAllocator``,
the legacy ``Buffer`` and ``Config``, ``EventOverlap``, ``EventHandle``, ``topk_idx_t``) and ``deep_gemm``
(codecs, GEMMs, MegaMoE), so that ported code changes only its imports.
"""

from . import ep as ep
from . import gemm as gemm
from . import mega_moe as mega_moe
from . import native as native
from . import nn as nn
from . import transports as transports
from .ep import BucketBuffer as BucketBuffer
from .ep import BucketSession as BucketSession
from .ep import (
    Buffer,
    BufferAllocator,
    BufferBase,
    Config,
    ConsensusError,
    ElasticBuffer,
    EngramBuffer,
    EPBuffer,
    EPHandle,
    EventHandle,
    EventOverlap,
    get_logical_domain_size,
    get_num_allocation_alignment,
    get_num_rdma_alignment,
    get_num_tma_alignment,
    get_physical_domain_size,
    topk_idx_t,
)
from .ep import PPBuffer as PPBuffer
from .gemm import *  # noqa: F403
from .mega_moe import *  # noqa: F403

__version__ = "0.1.0"

__all__ = ["Buffer", "BufferAllocator", "BufferBase", "Config", "ConsensusError", "ElasticBuffer", "EPBuffer",
           "EPHandle", "EventHandle", "EventOverlap", "get_logical_domain_size", "get_num_allocation_alignment",
           "get_num_rdma_alignment", "get_num_tma_alignment", "get_physical_domain_size", "topk_idx_t", "__version__"]
__all__ += ["EngramBuffer"]
__all__ += ["PPBuffer"]
__all__ += ["BucketBuffer", "BucketSession"]
__all__ += gemm.__all__ + mega_moe.__all__
