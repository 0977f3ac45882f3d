"""Child job of ``tests/ep/test_internode_tcp.py``: the internode Buffer and EPBuffer over MPI's real network path.

Launched as ``mpiexec -n 4 python -m tests.ep.internode_tcp_job`` with ``MPIR_CVAR_NUM_CLIQUES=2
MPIR_CVAR_CLIQUES_BY_BLOCK=1 UCX_TLS=tcp,self`` (docs/design/transports.md §4.3): MPICH then treats ranks
0-1 and 2-3 as two hosts and carries URMA traffic (RMA puts and accumulates) over TCP sockets,
while each simulated node of 2 ranks keeps its shared-memory UBMEM window. Runs a few cases
against the reference, then two EPBuffer modes (hybrid mode, two nodes); prints ``TCP-JOB OK <rank>``
per rank, raises (non-zero exit) otherwise.
"""

from __future__ import annotations

import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

from deepep_ascend import Buffer, EPBuffer  # noqa: E402
from tests.ep.test_ep_buffer import HIDDEN, MAX_TOKENS, MODES, TOPK, check_mode  # noqa: E402
from tests.support.buffer_helpers import Case, run_case  # noqa: E402

torch.set_num_threads(1)
comm = MPI.COMM_WORLD
R = comm.Get_size()
cases = [Case("tcp_uniform", tokens=40, hidden=256, experts=16, topk=4, cached=True, bias="pair"),
         Case("tcp_fp8_async", tokens=16, hidden=256, x_kind="fp8", use_async=True),
         Case("tcp_zero_rank", tokens=20, experts=16, topk=3, zero_rank=True, cached=True)]
nvl = max(Buffer.get_normal_buffer_size_hint(**c.hint_args(R), ranks_per_node=2) for c in cases)
rdma = max(Buffer.get_normal_rdma_buffer_size_hint(**c.hint_args(R), ranks_per_node=2) for c in cases)
buf = Buffer(None, nvl, rdma, comm=comm, explicitly_destroy=True, ranks_per_node=2)
for i, case in enumerate(cases):
    run_case(buf, comm, case, seed=i).finish(case.name)
traffic = buf.get_traffic(lifetime=True)
assert traffic["URMA"] > 0, f"no URMA traffic counted: {traffic}"
buf.destroy()
ep = EPBuffer(comm, num_max_tokens_per_rank=MAX_TOKENS, hidden=HIDDEN, num_topk=TOPK, explicitly_destroy=True,
              ranks_per_node=2)
for mode in (MODES[0], MODES[1]):
    check_mode(ep, comm, mode, nodes=2)
ep_traffic = ep.get_traffic(lifetime=True)
assert ep_traffic["URMA"] > 0, f"EPBuffer: no URMA traffic counted: {ep_traffic}"
ep.destroy()
print(f"TCP-JOB OK {comm.Get_rank()} {traffic}", flush=True)
