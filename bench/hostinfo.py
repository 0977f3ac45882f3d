"""Host information: the CPU, this process's and the machine's memory, and the ``host`` block of a
benchmark document (:mod:`bench.schema`)."""
from __future__ import annotations

import os
import platform
import resource
import threading
import time

import torch


def _meminfo() -> dict:
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                k, v = line.split(":", 1)
                out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``) and torch's vector capability, e.g.
    ``"Intel(R) Xeon(R) Processor (torch AVX512)"``: the development VM's host changes, and with it what is fast."""
    name = ""
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    try:
        cap = torch.backends.cpu.get_cpu_capability()
    except AttributeError:
        cap = "?"
    return f"{name or platform.processor() or 'unknown CPU'} (torch {cap})"


def memory_snapshot() -> dict:
    """This process's memory and the machine's, in bytes: ``rss``, ``peak_rss`` (includes touched
    shared-memory pages), ``shm_used`` (``/dev/shm``), ``mem_total``, ``mem_available``."""
    rss = 0
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    try:
        st = os.statvfs("/dev/shm")
        shm = (st.f_blocks - st.f_bfree) * st.f_frsize
    except OSError:
        shm = 0
    mi = _meminfo()
    return dict(rss=rss, peak_rss=peak, shm_used=shm, mem_total=mi.get("MemTotal", 0),
                mem_available=mi.get("MemAvailable", 0))


class MemorySampler:
    """Background thread (use on one rank) recording the minimum ``MemAvailable`` and maximum
    ``/dev/shm`` use every ``interval`` seconds; ``peak_used`` = ``MemTotal - min MemAvailable``
    (the whole machine, other tenants included)."""

    def __init__(self, interval: float = 0.25):
        self.interval, self._stop = interval, threading.Event()
        s = memory_snapshot()
        self.start_available, self.min_available, self.max_shm = s["mem_available"], s["mem_available"], s["shm_used"]
        self.mem_total = s["mem_total"]
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(self.interval):
            s = memory_snapshot()
            self.min_available = min(self.min_available, s["mem_available"])
            self.max_shm = max(self.max_shm, s["shm_used"])

    def start(self) -> MemorySampler:
        self._t.start()
        return self

    def stop(self) -> dict:
        self._stop.set()
        self._t.join()
        return dict(mem_total=self.mem_total, start_used=self.mem_total - self.start_available,
                    peak_used=self.mem_total - self.min_available, peak_shm=self.max_shm)


def host_doc(mpi: bool = True) -> dict:
    """The ``host`` block of a benchmark document: ``hostname``, ``cpu`` (:func:`cpu_model`), ``cpus``,
    ``python``, ``torch``, ``numpy``, ``mpi`` (the MPI library's first version line, ``None`` for a
    one-process command: ``mpi=False`` imports no MPI), ``version`` (``deepep_ascend``'s) and ``time``
    (local ISO 8601)."""
    import numpy

    import deepep_ascend

    mpi_version = None
    if mpi:
        from mpi4py import MPI

        mpi_version = MPI.Get_library_version().splitlines()[0]
    return dict(hostname=platform.node(), cpu=cpu_model(), cpus=os.cpu_count(), python=platform.python_version(),
                torch=torch.__version__, numpy=numpy.__version__, mpi=mpi_version,
                version=str(getattr(deepep_ascend, "__version__", "")), time=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
