"""Child pytest module run by ``test_transports_lifecycle.py`` through the project's real harness:

    mpiexec -n 2 python -m pytest --with-mpi -q -p no:cacheprovider tests/transports/nested_harness_case.py

Not collected by the normal suite (no ``test_`` file prefix). The test builds a transport with a
window and forgets it (the transports atexit hook destroys it), then writes the ``/dev/shm``
files this rank maps to ``$DEEPEP_ASCEND_NESTED_REPORT/rank<r>.json``; the parent checks which
of them survive the job, i.e. what the harness's exit path (``transports.process.exit_job``)
leaves behind.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from mpi4py import MPI

from deepep_ascend import settings
from deepep_ascend.transports import create_transport
from tests.transports.helpers import proc_shm_mappings

_KEEP = []


@pytest.mark.mpi(min_size=1)
def test_forgotten_transport():
    comm = MPI.COMM_WORLD
    me, n = comm.Get_rank(), comm.Get_size()
    tp = create_transport(comm, timeout_s=10)
    win = tp.create_window("nested_harness", 1 << 20, 2)
    tp.put(win, (me + 1) % n, 0, torch.full((4096,), me, dtype=torch.uint8))
    tp.barrier()
    _KEEP.append(tp)  # never destroyed here: left to the atexit hook
    out = settings.NESTED_REPORT.get()
    with open(os.path.join(out, f"rank{me}.json"), "w") as f:
        json.dump(sorted(set(proc_shm_mappings())), f)
