"""Helpers shared by the transport-layer tests (imported by plain name: ``from tp_helpers import ...``)."""

from __future__ import annotations

import gc
import os

import torch

from deepep_ascend.transports import TransportBusy, create_transport

#: Library default deadline for the tests (``DEEPEP_ASCEND_TIMEOUT_S``, 10 s in the test plan).
TIMEOUT_S = float(os.environ.get("DEEPEP_ASCEND_TIMEOUT_S", "10"))

MIB = 1 << 20

_BASE = None


def world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def make_transport(**kwargs):
    kwargs.setdefault("timeout_s", TIMEOUT_S)
    return create_transport(world(), **kwargs)


def destroy_quietly(tp) -> None:
    """Collective teardown tolerant of leftovers of a failed test.

    ``TransportBusy`` is raised on every rank alike, so every rank takes the same branch: a
    failing test's traceback may still hold window views; collect garbage and retry, then force
    (the views are never touched again).
    """
    try:
        tp.destroy()
    except TransportBusy:
        gc.collect()
        try:
            tp.destroy()
        except TransportBusy:
            tp.destroy(force=True)


def pattern(nbytes: int, seed: int) -> torch.Tensor:
    """Deterministic uint8 payload of ``nbytes`` bytes, different for every ``seed``.

    A period-251 ramp shifted and offset by the seed, so a misplaced, truncated or stale copy
    (another seed, another offset) does not compare equal.
    """
    global _BASE
    need = nbytes + 256
    if _BASE is None or _BASE.numel() < need:
        n = max(need, 8 * MIB + 1024)
        _BASE = (torch.arange(n, dtype=torch.int32) % 251).to(torch.uint8)
    shift = seed % 251
    return _BASE[shift:shift + nbytes] + ((seed * 37 + 11) % 256)


def ramp(nbytes: int, seed: int) -> torch.Tensor:
    """Cheaper :func:`pattern`: a read-only *view* of the shared ramp shifted by ``seed % 251``.

    No allocation or arithmetic, so it suits many large rounds; seeds that differ modulo 251
    give different bytes. Do not write into the result.
    """
    pattern(0, 0)  # make sure the base ramp exists
    if _BASE.numel() < nbytes + 256:
        pattern(nbytes, 0)
    shift = seed % 251
    return _BASE[shift:shift + nbytes]


def proc_shm_mappings() -> list[str]:
    """Entries of ``/proc/self/maps`` backed by ``/dev/shm`` (name, with ' (deleted)' if unlinked)."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            if "/dev/shm/" in line:
                out.append(line.split("/dev/shm/", 1)[1].strip())
    return out
