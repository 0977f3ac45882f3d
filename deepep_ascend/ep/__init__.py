"""Expert-parallel communication: DeepEP's ``EPBuffer`` and ``Buffer`` on CPU ranks over the simulated Ascend channels.

Walking down this room (docs/design/architecture.md):

* :mod:`.ep_buffer`   ``EPBuffer`` / ``ElasticBuffer`` (DeepEP V2.5's API): the handle, layouts and epilogues
  over the normal-mode engines that ``Buffer`` runs (:mod:`.ep_handle`: ``EPHandle`` and DeepEP-Ascend's
  ``AscendEPHandle``; :mod:`.ascend`: the same buffer returning the latter);
* :mod:`.allocator`   ``BufferAllocator`` (planned symmetric tensors) and ``BufferBase`` (the common lifetime);
* :mod:`.buffer`      ``Buffer`` (DeepEP V1's API): the choice of engine, its windows, worker and consensus round;
* :mod:`.handles`     the handles dispatch returns (named tuples of DeepEP's entries) and who made them;
* :mod:`.arguments`   the argument checks of the normal-mode calls (:mod:`.low_latency_arguments`: of the LL calls);
* :mod:`.layout`      routing -> counts, masks and prefix matrices (pure torch, no communication);
* :mod:`.intranode`   normal dispatch/combine inside one node (UBMEM);
* :mod:`.internode`   normal dispatch/combine across nodes (URMA between nodes, UBMEM inside);
* :mod:`.low_latency` fixed-slot dispatch/combine with signals and receive hooks;
* :mod:`.protocol`    the header every rank stages and the consensus reached from it;
* :mod:`.reduce`      combine's float32 reduction, shared with MegaMoE;
* :mod:`.event`       ``EventOverlap`` and the worker thread (the CPU's communication stream);
* :mod:`.failure`     what a failing step does: abort the peers so that they fail fast;
* :mod:`.config`      ``Config`` and DeepEP's tuned tables;
* :mod:`.group`       a torch ProcessGroup or an mpi4py communicator -> the MPI communicator used;
* :mod:`.memory`      host tensors on huge pages and the pools that reuse output storage.
* :mod:`.rows`        byte-row matrices: their widest integer view, and chosen rows zeroed.
"""

from .allocator import (
    BufferAllocator,
    BufferBase,
    get_num_allocation_alignment,
    get_num_rdma_alignment,
    get_num_tma_alignment,
)
from .bucket_buffer import BucketBuffer, BucketSession
from .buffer import Buffer
from .config import Config
from .engram_buffer import EngramBuffer
from .ep_buffer import ElasticBuffer, EPBuffer
from .ep_handle import EPHandle
from .event import EventHandle, EventOverlap
from .group import get_logical_domain_size, get_physical_domain_size, mpi_comm_of
from .handles import InternodeHandle, IntranodeHandle, LowLatencyHandle
from .layout import topk_idx_t
from .pp_buffer import PPBuffer
from .protocol import ConsensusError

__all__ = ["Buffer", "BufferAllocator", "BufferBase", "Config", "ConsensusError", "ElasticBuffer", "EPBuffer",
           "EPHandle", "EventHandle", "EventOverlap", "InternodeHandle", "IntranodeHandle", "LowLatencyHandle",
           "get_logical_domain_size", "get_num_allocation_alignment", "get_num_rdma_alignment",
           "get_num_tma_alignment", "get_physical_domain_size", "mpi_comm_of", "topk_idx_t"]
__all__ += ["EngramBuffer"]
__all__ += ["PPBuffer"]
__all__ += ["BucketBuffer", "BucketSession"]
