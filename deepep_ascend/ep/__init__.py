"""Expert-parallel communication: DeepEP's ``Buffer`` on CPU ranks over the simulated Ascend channels.

Walking down this room (docs/design/architecture.md):

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
"""

from .buffer import Buffer
from .config import Config
from .event import EventHandle, EventOverlap
from .group import mpi_comm_of
from .handles import InternodeHandle, IntranodeHandle, LowLatencyHandle
from .layout import topk_idx_t
from .protocol import ConsensusError

__all__ = ["Buffer", "Config", "ConsensusError", "EventHandle", "EventOverlap", "InternodeHandle", "IntranodeHandle",
           "LowLatencyHandle", "mpi_comm_of", "topk_idx_t"]
