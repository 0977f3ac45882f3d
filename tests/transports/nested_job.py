"""Child job launched by ``test_transports_lifecycle.py`` as ``mpiexec -n 2 python nested_job.py MODE``.

Not a test module (no ``test_`` prefix). Each rank appends ``<rank> <KEY> <value>`` lines to
``$DEEPEP_ASCEND_NESTED_REPORT/rank<r>.txt`` (files, not stdout: mpiexec interleaves the ranks'
output mid-line). It reads that variable (declared in ``deepep_ascend.settings``) straight from the
environment: importing the settings would import the package, and with it the transports, before the
atexit handler below is registered. ``MAPS <tag> <json>`` lists the ``/dev/shm`` files this rank maps, so the
parent can attribute leftovers to this job exactly (other jobs on the machine create and leak
``mpich_shm_*`` files concurrently).

Modes:
  lifetimes   transport A (with a window) is destroyed explicitly; transport B is forgotten, so the
              transports atexit hook must destroy it (``STATE`` comes from an atexit handler
              registered before ``transports`` was imported, i.e. run after that hook); then the
              normal interpreter exit (mpi4py calls MPI_Finalize)
  late        ranks < last call destroy(timeout_s=0.5) and time out (``EARLY ...``); the last rank
              arrives 1.5 s later and must not hang (``LATE-DONE ...``); exits with os._exit
"""

from __future__ import annotations

import atexit
import faulthandler
import json
import os
import sys
import time

MODE = sys.argv[1]
_tp = None
_RANK = int(os.environ.get("PMI_RANK", "0"))


def emit(key: str, value: str) -> None:
    line = f"{_RANK} {key} {value}\n"
    sys.stdout.write(line)
    sys.stdout.flush()
    with open(os.path.join(os.environ["DEEPEP_ASCEND_NESTED_REPORT"], f"rank{_RANK}.txt"), "a") as f:
        f.write(line)


def _report_state_at_exit() -> None:
    if _tp is not None:
        emit("STATE", _tp.state.name)


# Registered before `transports` is imported: atexit runs handlers last-in first-out, so this one
# runs after the transports hook and shows whether that hook destroyed the forgotten transport.
atexit.register(_report_state_at_exit)


def proc_shm_mappings() -> list:
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            if "/dev/shm/" in line:
                out.append(line.split("/dev/shm/", 1)[1].strip())
    return sorted(set(out))


def report(tag: str) -> None:
    emit("MAPS", f"{tag} {json.dumps(proc_shm_mappings())}")


def main() -> None:
    global _tp
    from mpi4py import MPI

    from deepep_ascend.transports import TransportTimeout, create_transport

    comm = MPI.COMM_WORLD
    me, n = comm.Get_rank(), comm.Get_size()
    assert me == _RANK
    report("init")
    import torch

    def build(name):
        tp = create_transport(comm, timeout_s=10)
        win = tp.create_window(name, 1 << 20, 2)
        tp.put(win, (me + 1) % n, 0, torch.full((4096,), me, dtype=torch.uint8))
        tp.barrier()
        report(f"{name}-window")
        return tp

    if MODE == "lifetimes":
        a = build("A")
        a.destroy()
        emit("STATE-A", a.state.name)
        report("A-destroyed")
        _tp = build("B")  # forgotten: left to the atexit hook
        return
    if MODE != "late":
        raise SystemExit(f"unknown mode {MODE!r}")
    _tp = build("L")
    if me < n - 1:
        try:
            _tp.destroy(timeout_s=0.5)
            emit("EARLY", "returned")
        except TransportTimeout:
            emit("EARLY", "timeout")
        # Stay alive (outside MPI) until the late rank is done, or its hang watchdog fired.
        late_report = os.path.join(os.environ["DEEPEP_ASCEND_NESTED_REPORT"], f"rank{n - 1}.txt")
        deadline = time.monotonic() + 15.0
        while time.monotonic() < deadline:
            if os.path.exists(late_report):
                with open(late_report) as f:
                    if "LATE-DONE" in f.read():
                        break
            time.sleep(0.1)
    else:
        time.sleep(1.5)
        faulthandler.dump_traceback_later(6, exit=True)  # a hang becomes exit status 1
        t0 = time.monotonic()
        try:
            _tp.destroy(timeout_s=2.0)
            outcome = "returned"
        except Exception as exc:  # noqa: BLE001
            outcome = type(exc).__name__
        faulthandler.cancel_dump_traceback_later()
        emit("LATE-DONE", f"{outcome} {time.monotonic() - t0:.2f} {_tp.state.name}")
    # No MPI_Finalize after abandoned collectives; drop MPICH's per-node segment ourselves.
    for name in proc_shm_mappings():
        if name.startswith("mpich_shm_") and not name.endswith("(deleted)"):
            try:
                os.unlink("/dev/shm/" + name)
            except FileNotFoundError:
                pass
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
