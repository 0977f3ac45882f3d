"""The internode Buffer over MPI's real network path: simulated nodes as MPICH cliques over TCP.

``MPIR_CVAR_NUM_CLIQUES=2 MPIR_CVAR_CLIQUES_BY_BLOCK=1 UCX_TLS=tcp,self`` (docs/design/transports.md §4.3) make
MPICH treat ranks 0-1 and 2-3 as two hosts, so URMA puts and accumulates cross TCP sockets while
each node keeps its shared-memory window. Runs in the 1-rank job only (it launches ``mpiexec -n 4``).
"""

from __future__ import annotations

import re
import sys

import pytest

from tests.support import REPO_ROOT
from tests.support.mpi_utils import run_child_job, world


@pytest.mark.mpi(min_size=1)
@pytest.mark.skipif(world().Get_size() != 1, reason="launches its own mpiexec; runs in the 1-rank job only")
def test_internode_over_tcp_cliques():
    """4 ranks as 2 nodes × 2, MPICH cliques over TCP (docs/design/transports.md §4.3): URMA is real sockets."""
    rc, out = run_child_job(4, [sys.executable, "-m", "tests.ep.internode_tcp_job"],
                            REPO_ROOT, timeout_s=240.0, MPIR_CVAR_NUM_CLIQUES="2",
                            MPIR_CVAR_CLIQUES_BY_BLOCK="1", UCX_TLS="tcp,self", DEEPEP_ASCEND_TIMEOUT_S="60")
    oks = set(re.findall(r"TCP-JOB OK (\d+)", out))  # ranks' lines may interleave mid-line
    assert rc == 0 and oks == {"0", "1", "2", "3"}, \
        f"child job exit {rc}, ranks OK {sorted(oks)}; output:\n{out[-4000:]}"
