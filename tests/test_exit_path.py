"""The project's exit path (``transports.process.exit_job``: barrier, then ``os._exit`` without
``MPI_Finalize``, design.md) leaves none of MPICH's ``/dev/shm/mpich_shm_*`` segments behind, which
only ``MPI_Finalize`` would unlink (every benchmark run and sweep point once leaked ~2-8 MB of RAM).

Runs in the 1-rank job: a 2-rank child job prints the segments it maps, then exits; they must be gone.
"""

from __future__ import annotations

import os
import re
import sys

import pytest
from mpi_utils import run_child_job, world

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD = """
import sys
from mpi4py import MPI
from transports.process import exit_job
comm = MPI.COMM_WORLD
comm.Barrier()
paths = sorted({l.split(None, 5)[5].strip() for l in open("/proc/self/maps") if "/dev/shm/mpich_shm_" in l})
every = comm.gather([p for p in paths if not p.endswith("(deleted)")], root=0)
if comm.Get_rank() == 0:  # one writer: ranks printing at once interleave on the shared stdout
    print("MAPPED", len(every), " ".join(sorted({p for ps in every for p in ps})), flush=True)
exit_job(0, comm)
"""


@pytest.mark.mpi(min_size=1)
@pytest.mark.skipif(world().Get_size() != 1, reason="launches its own mpiexec; runs in the 1-rank job only")
def test_exit_job_leaves_no_mpich_segment():
    rc, out = run_child_job(2, [sys.executable, "-c", CHILD], REPO, timeout_s=120)
    assert rc == 0, out[-3000:]
    found = re.findall(r"^MAPPED (\d+) ?(.*)$", out, re.M)
    assert len(found) == 1 and found[0][0] == "2", out[-3000:]
    mapped = set(found[0][1].split())
    if not mapped:
        pytest.skip("this MPI maps no /dev/shm/mpich_shm_* segment")
    assert not [p for p in mapped if os.path.exists(p)], f"left behind: {mapped}"
