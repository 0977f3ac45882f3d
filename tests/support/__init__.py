"""Helpers shared by the tests: the MPI harness (:mod:`.mpi_utils`), the single-process DeepEP reference
(:mod:`.reference`) and the Buffer case runner (:mod:`.buffer_helpers`)."""

import os

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
