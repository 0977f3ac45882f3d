"""Leaving an MPI job the way this project does (design.md: a final barrier, then ``os._exit``
without ``MPI_Finalize``) without leaking MPICH's shared memory."""

from __future__ import annotations

import os
import sys


def release_mpich_shm() -> None:
    """Unlink MPICH's per-node ``/dev/shm/mpich_shm_*`` segment(s) this process maps.

    Only ``MPI_Finalize`` unlinks them, so an exit without it leaves ~1-8 MB per job in RAM.
    Safe after a final barrier: every rank of the node has mapped the segment (unlinking keeps
    the mappings) and nothing opens it by name later. Other ranks of the node may be first;
    their unlink wins and ours is a no-op. Never raises.
    """
    try:
        with open("/proc/self/maps", encoding="utf-8") as f:
            paths = {line.split(None, 5)[5].strip() for line in f if "/dev/shm/mpich_shm_" in line}
    except OSError:
        return
    for path in paths:
        if path.endswith("(deleted)"):
            continue
        try:
            os.unlink(path)
        except OSError:
            pass  # another rank of the node unlinked it first


def exit_job(code: int, comm) -> None:
    """Flush, barrier on ``comm``, release MPICH's segment, ``os._exit(code)``; never returns.

    Destroy Buffers and process groups first (``atexit`` handlers do not run).
    """
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except Exception:  # noqa: BLE001, S110 - exiting anyway
        pass
    try:
        comm.Barrier()
        release_mpich_shm()
    finally:
        os._exit(code)


def abort_job(comm, code: int = 1) -> None:
    """A rank's exit after an unrecoverable error: unlink MPICH's segment (``MPI_Abort`` skips
    every exit path; the peers' mappings survive), ``MPI_Abort(comm, code)``, and ``os._exit``
    should Abort return before the launcher's kill arrives. Never returns."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        release_mpich_shm()
        comm.Abort(code)
    finally:
        os._exit(code)


def mpiexec_path() -> str | None:
    """The ``mpiexec`` matching mpi4py's MPI: the ``mpich`` wheel's (what ``scripts/common.sh``
    ``use_wheel_mpiexec`` puts first on PATH), else the one on PATH; ``None`` if there is none."""
    import importlib.metadata
    import shutil

    try:
        dist = importlib.metadata.distribution("mpich")
        for f in dist.files or ():
            if f.name == "mpiexec" and f.parent.name == "bin":
                path = os.path.realpath(dist.locate_file(f))
                if os.path.exists(path):
                    return path
    except importlib.metadata.PackageNotFoundError:
        pass
    return shutil.which("mpiexec")
