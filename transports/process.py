"""Leaving an MPI job without a spurious "bad termination" and without leaking MPICH's shared memory.

Why not ``os._exit`` after the last barrier (docs/testing.md, the exit path):
MPICH (>= 4.1, ``src/util/mpir_pmi.c``) sends PMI's ``finalize`` from a C exit hook, after
``MPI_Finalize``. A process that leaves by ``_exit`` never sends it, so hydra's proxy sees its PMI
socket close as a crash and SIGKILLs every rank still alive: any rank a few milliseconds late
after the barrier (8 ranks on 2 cores) is reported as "EXIT CODE: 9". ``MPI_Finalize`` followed by
``os._exit`` fails the same way. Leaving through the C library's
``exit()`` after ``MPI_Finalize`` is what a C MPI program returning from ``main`` does: the hook
runs, and Python's own teardown (module GC, thread joins) is still skipped.
"""

from __future__ import annotations

import os
import sys

from .base import quiet_barrier


def release_mpich_shm() -> None:
    """Unlink MPICH's per-node ``/dev/shm/mpich_shm_*`` segment(s) this process maps.

    Only ``MPI_Finalize`` unlinks them, so an exit without it leaves ~1-8 MB per job in RAM.
    Safe after a final barrier: every rank of the node has mapped the segment (unlinking keeps
    the mappings) and nothing opens it by name later. Other ranks of the node may be first;
    their unlink wins and ours is a no-op. Never raises.
    """
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="surrogateescape") as f:
            paths = {line.split(None, 5)[5].strip() for line in f if "/dev/shm/mpich_shm_" in line}
    except (OSError, ValueError, IndexError):
        return
    for path in paths:
        if path.endswith("(deleted)"):
            continue
        try:
            os.unlink(path)
        except OSError:
            pass  # another rank of the node unlinked it first


def exit_job(code: int, comm) -> None:
    """Flush, barrier on ``comm``, ``MPI_Finalize``, then the C library's ``exit(code)``; never
    returns. The barrier is :func:`~transports.base.quiet_barrier`: ranks that arrive early sleep
    rather than spin in MPICH's blocking barrier, which starved the ranks still tearing down when
    ranks outnumber cores. ``MPI_Finalize`` unlinks MPICH's segment; the C exit hook tells the launcher this
    rank finished (module doc).

    Destroy Buffers and process groups first (Python ``atexit`` handlers do not run).
    Falls back to ``os._exit(code)`` if anything on the way raises.
    """
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except Exception:  # noqa: BLE001, S110 - exiting anyway
        pass
    try:
        from mpi4py import MPI

        quiet_barrier(comm)

        if not MPI.Is_finalized():
            MPI.Finalize()
        _libc_exit(code)
    finally:
        os._exit(code)


def _libc_exit(code: int) -> None:
    """``exit(3)`` of the C library: C ``atexit`` hooks (MPICH's PMI finalize) and stdio flush."""
    import ctypes

    ctypes.CDLL(None).exit(int(code) & 0xFF)


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
