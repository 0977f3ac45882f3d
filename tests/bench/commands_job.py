"""Child job of ``tests/bench/test_commands.py``: several collective bench commands in one MPI job.

Launched as ``mpiexec -n 2 python -m tests.bench.commands_job SPEC`` where ``SPEC`` is a JSON list of
``[label, command, argv]`` triples: runs each with :func:`bench.commands.call` in order, in the same processes
(one interpreter and MPI start for all of them instead of one per run); rank 0 prints ``=== run: <label>``
before each, so the output splits into each run's lines. Leaves through :func:`bench.cli.run_main` with the
first non-zero exit code, or 0.
"""

from __future__ import annotations

import json
import sys

from mpi4py import MPI

from bench import commands
from bench.cli import run_main


def main() -> int:
    for label, name, argv in json.loads(sys.argv[1]):
        if MPI.COMM_WORLD.Get_rank() == 0:
            print(f"=== run: {label}", flush=True)
        rc = commands.call(name, argv)
        if rc:
            print(f"[commands_job] {label}: exit {rc}", flush=True)
            return rc
    return 0


if __name__ == "__main__":
    run_main(main)
