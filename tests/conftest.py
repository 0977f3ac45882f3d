"""Multi-rank pytest harness for deepep_ascend.

Run as ``mpiexec -n N python -m pytest --with-mpi -q tests`` (``scripts/test.sh`` does N = 1, 2,
4, 8). One pytest process per rank; every rank collects and runs the same tests in the same order.

What this file adds to pytest + pytest-mpi:

* ``torch.set_num_threads(1)`` (ranks share a few cores).
* **Local tests run in the 1-rank job only**: with more than one rank, tests not marked
  ``@pytest.mark.mpi(...)`` are deselected (they use no communicator, so every rank would repeat
  the same work; at 8 ranks on 2 cores the copies took most of that job's time).
  ``DEEPEP_ASCEND_TEST_LOCAL_EVERY_RANK=1`` runs them on every rank anyway.
* **Shards**: ``DEEPEP_ASCEND_TEST_SHARD=i/n`` keeps the test files at positions i, i + n, ... of the
  collection (whole files, so a module's fixtures are made once); ``scripts/test.sh`` splits its 1-rank
  job into concurrent jobs this way (``DEEPEP_ASCEND_TEST_SHARDS``). The variable is removed from the
  environment at start, so the jobs the tests launch collect every file.
* **Collective pass/fail** for tests marked ``@pytest.mark.mpi(...)``: after each phase (setup,
  call, teardown) every rank all-gathers its outcome; if any rank failed, the phase fails on every
  rank and the message lists each failing rank and its error. Rank 0's output therefore shows
  failures of any rank, and ranks never drift apart. Tests whose ``min_size`` exceeds the world
  size are skipped locally on every rank without communication.
* **Watchdog**: each test (setup + call + teardown) must finish within
  ``DEEPEP_ASCEND_TEST_WATCHDOG_S`` seconds (default 300; ``@pytest.mark.watchdog(s)`` overrides).
  Past the deadline the rank prints the test id, what the kernel says each other rank on its host
  is doing (``/proc``: state, wait channel and system call per thread, so a rank that prints
  nothing itself is still located) and all Python thread tracebacks to its real stderr, then, a
  second later (after every rank's dump, before any rank exits), one short line per thread saying
  where it is in the repository's code (so a log cut to its head and tail still shows it), and exits
  with status 3 (mpiexec then ends the job): a hang is a failure, not a stuck CI.
* **Rank-0 output**: with more than one rank, ranks != 0 write pytest's terminal output to
  ``$DEEPEP_ASCEND_TEST_LOG_DIR`` (default ``<tmp>/deepep_ascend_tests/<job>/rank<r>.log``).
  At session end every rank's failures are gathered and rank 0 prints those it did not see
  itself (e.g. a non-collective test that failed on rank 3 only) with the log paths; all ranks
  exit with the same status.
* **Exit path**: after pytest has finished (terminal summary printed, cleanups done), each rank leaves
  through ``transports.process.exit_job``: flush, a barrier on ``MPI.COMM_WORLD`` that sleeps rather
  than spins (``transports.base.quiet_barrier``), ``MPI_Finalize``, then the C library's
  ``exit(status)`` (Python's teardown is skipped). Not ``os._exit``: MPICH sends PMI's finalize from a C
  exit hook, and a rank that skips it makes hydra SIGKILL every rank still alive; CI's 8-rank run once
  passed every test and still failed with "EXIT CODE: 9" that way (``tests/harness/test_exit_path.py``
  reproduces it). The plain interpreter exit (``DEEPEP_ASCEND_TEST_EXIT_MODE=finalize``, kept for
  re-measuring) is also clean. The status is the same on every rank (gathered at session end, without
  spinning either). Runs from ``atexit``, so that cleanup handlers registered after this module's import
  still run before it.

Fixtures: ``comm``, ``rank``, ``world_size`` (see ``tests.support.mpi_utils``) and ``buffers``, the test module's
Buffers (``tests.support.buffer_helpers.ModuleBuffers``).
"""

from __future__ import annotations

import atexit
import collections
import faulthandler
import os
import signal
import sys
import tempfile
import threading
import time

import pytest
import torch

from deepep_ascend import settings
from tests.support import REPO_ROOT as _REPO
from tests.support import mpi_utils
from tests.support.mpi_utils import comm, rank, world_size  # noqa: F401  (fixtures for all tests)
from tests.support.shards import file_of, merge_lastfailed, parse_shard, shard_files

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def buffers():
    """The module's Buffers, built on demand and destroyed at module end (:class:`ModuleBuffers`)."""
    from tests.support.buffer_helpers import ModuleBuffers

    made = ModuleBuffers()
    yield made
    made.destroy_all()

pytest_plugins = ("pytester",)

_EXIT_WATCHDOG_S = (
    120.0  # backstop for hangs after the last test (exit barrier, thread joins)
)


def _mpi():
    from mpi4py import MPI

    return MPI


# ----------------------------------------------------------------------------------------------
# watchdog


class _Watchdog:
    """Per-test deadline. ``arm(s, what)`` sets it, ``cancel()`` clears it.

    At the deadline, three independent mechanisms fire, so a rank stuck anywhere (even in C code
    holding the GIL) still reports and dies:

    1. faulthandler's C thread dumps every Python thread's traceback to the real stderr
       (no GIL needed) — all ranks with the same deadline dump, whoever exits first;
    2. a Python daemon thread prints which test timed out, waits ``GRACE_S`` so the other ranks
       can dump too before mpiexec tears the job down, then ``os._exit(3)``;
    3. backstop: ``SIGALRM`` with its default action (terminate) ``BACKSTOP_S`` later, in case
       the Python thread never gets the GIL.
    """

    GRACE_S = 3.0
    WHERE_S = 1.0  # when, after the deadline, each rank prints where its threads are (_where_threads_are)
    BACKSTOP_S = 10.0

    def __init__(self, fd: int, my_rank: int):
        self._fd = fd
        self._rank = my_rank
        self.peers: list[tuple[int, str, int]] = []  # (rank, host, pid) of every rank, set after MPI is up
        self.release_shm = None  # transports.process.release_mpich_shm, imported before any test runs
        self._cv = threading.Condition()
        self._deadline: float | None = None
        self._what = ""
        self._seconds = 0.0
        self._use_alarm = (
            threading.current_thread() is threading.main_thread()
            and hasattr(signal, "alarm")
        )
        self._thread = threading.Thread(
            target=self._run, name="test-watchdog", daemon=True
        )
        self._thread.start()

    def arm(self, seconds: float, what: str) -> None:
        with self._cv:
            self._deadline = time.monotonic() + seconds
            self._what = what
            self._seconds = seconds
            self._cv.notify()
        faulthandler.dump_traceback_later(seconds + 0.05, exit=False, file=self._fd)
        if self._use_alarm and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.alarm(int(seconds + self.GRACE_S + self.BACKSTOP_S) + 1)

    def cancel(self) -> None:
        if self._use_alarm and threading.current_thread() is threading.main_thread():
            signal.alarm(0)
        faulthandler.cancel_dump_traceback_later()
        with self._cv:
            self._deadline = None
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while self._deadline is None or time.monotonic() < self._deadline:
                    timeout = (
                        None
                        if self._deadline is None
                        else self._deadline - time.monotonic()
                    )
                    self._cv.wait(timeout)
                what, seconds = self._what, self._seconds
            msg = (
                f"\n[watchdog] rank {self._rank}: {what} exceeded {seconds:g} s "
                f"(DEEPEP_ASCEND_TEST_WATCHDOG_S or @pytest.mark.watchdog); "
                f"thread tracebacks follow; exiting with status 3\n"
            )
            try:
                _mark_hang(self._rank)
                os.write(self._fd, msg.encode())
                os.write(self._fd, _peer_states(self.peers, self._rank).encode())
            finally:
                try:
                    # After faulthandler's dump (at the deadline + 0.05 s) and well before the first rank
                    # exits (the deadline + GRACE_S, when mpiexec ends the others): short lines, after the
                    # long dumps, so that a log cut to its head and tail (CI's) still shows them.
                    time.sleep(self.WHERE_S)
                    os.write(self._fd, _where_threads_are(self._rank).encode())
                    time.sleep(self.GRACE_S - self.WHERE_S)
                    # os._exit skips MPI_Finalize, the only thing that unlinks MPICH's /dev/shm segment
                    if self.release_shm is not None:
                        self.release_shm()
                finally:
                    os._exit(3)


def _mark_hang(my_rank: int) -> None:
    """For ``scripts/test.sh``: write ``$DEEPEP_ASCEND_TEST_HANG_DIR/rank<r>`` saying whether any
    test had failed on this rank before the hang ("clean" / "failed"); the script re-runs a hung
    job only if every marker says "clean", so a real failure is never re-run away."""
    where = settings.TEST_HANG_DIR.get()
    if not where:
        return
    try:
        with open(os.path.join(where, f"rank{my_rank}"), "w") as f:
            f.write("failed\n" if _S.failures else "clean\n")
    except OSError:
        pass


def _peer_states(peers, me: int) -> str:
    """What the kernel says each other rank on this host is doing (``/proc``): scheduler state,
    where it sleeps, and the system call its threads are in. A rank that prints nothing when its
    watchdog fires (blocked writing its output, stopped, or in uninterruptible sleep) is still
    described by its peers. The main thread and running threads are listed by thread id (the ids
    of :func:`_where_threads_are`); the others are counted by state (torch and gloo keep dozens)."""
    host = os.uname().nodename
    lines = []
    for r, h, pid in peers:
        if r == me or h != host:
            continue
        try:
            state = _proc_field(f"/proc/{pid}/status", "State:")
            named, counted = [], collections.Counter()
            for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
                base = f"/proc/{pid}/task/{tid}"
                wchan = _read_small(f"{base}/wchan") or "-"
                syscall = (_read_small(f"{base}/syscall") or "?").split()
                call = syscall[0] + (f"(fd {int(syscall[1], 16)})" if syscall[0] in ("0", "1") and len(syscall) > 1
                                     else "")
                what = f"{_thread_state(base)}/{wchan}/syscall {call}"
                if int(tid) == pid or not what.startswith("S"):
                    named.append(f"{tid}:{what}")
                else:
                    counted[what] += 1
            rest = ", ".join(f"{n}x {what}" for what, n in counted.most_common())
            lines.append(f"[watchdog]   rank {r} (pid {pid}): {state}; threads " + ", ".join(named)
                         + (f"; others {rest}" if rest else ""))
        except OSError as exc:
            lines.append(f"[watchdog]   rank {r} (pid {pid}): /proc unreadable ({exc.strerror})")
    return (f"[watchdog] rank {me} sees its peers (syscall 0/1 = read/write):\n" + "\n".join(lines) + "\n"
            if lines else "")


def _where_threads_are(me: int, max_frames: int = 12) -> str:
    """One line per Python thread of this rank: its name, thread id, and the innermost frame then
    the repository's frames (innermost first), e.g. ``MainThread (tid 123): threading.py:331 wait
    <- deepep_ascend/ep/buffer.py:880 _wait <- tests/ep/test_x.py:41 test_y``."""
    frames = sys._current_frames()
    lines = []
    for t in threading.enumerate():
        frame = frames.get(t.ident)
        if frame is None or t is threading.current_thread():
            continue
        where = []
        f = frame
        while f is not None and len(where) < max_frames:
            path = f.f_code.co_filename
            inside = path.startswith(_REPO + os.sep)
            if inside or f is frame:
                shown = os.path.relpath(path, _REPO) if inside else os.path.basename(path)
                where.append(f"{shown}:{f.f_lineno} {f.f_code.co_name}")
            f = f.f_back
        lines.append(f"[watchdog] rank {me}: {t.name} (tid {t.native_id}): " + " <- ".join(where))
    return "\n".join(lines) + "\n"


def _thread_state(task_dir: str) -> str:
    """One-letter scheduler state of a thread (``R``, ``S``, ``D``, ...), ``?`` if it is gone."""
    after = _read_small(f"{task_dir}/stat").rsplit(")", 1)  # the command name may hold spaces
    return after[1].split()[0] if len(after) == 2 and after[1].split() else "?"


def _read_small(path: str, size: int = 256) -> str:
    """The first ``size`` characters of a /proc file, stripped; "" if it cannot be read."""
    try:
        with open(path) as f:
            return f.read(size).strip()
    except OSError:
        return ""


def _proc_field(path: str, key: str) -> str:
    """The value of line ``key`` of a /proc status file; "?" if absent or unreadable."""
    for line in _read_small(path, 4096).splitlines():
        if line.startswith(key):
            return line[len(key):].strip()
    return "?"


# ----------------------------------------------------------------------------------------------
# session state


class _State:
    def __init__(self):
        self.failures: list[
            tuple[str, str, str]
        ] = []  # (nodeid, when, text) on this rank

    mpi_active = False  # MPI initialised by us/anyone and world size known
    rank = 0
    size = 1
    err_fd: int | None = None
    watchdog: _Watchdog | None = None
    log_path: str | None = None
    local_deselected = 0  # tests not marked mpi, deselected at more than one rank
    shard: tuple[int, int] | None = None  # (i, n) of DEEPEP_ASCEND_TEST_SHARD
    shard_file_set: set[str] = set()  # the test files this shard runs
    shard_collected: set[str] = set()  # the test files with items in the collection, every shard's
    exit_status: int | None = (
        None  # set in pytest_unconfigure; used by the atexit exit path
    )
    configured = False


_S = _State()


def _watchdog_seconds(item) -> float:
    m = item.get_closest_marker("watchdog")
    if m is not None and m.args:
        return float(m.args[0])
    return settings.TEST_WATCHDOG_S.get()


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    if (
        _S.configured
    ):  # nested in-process runs (pytester) do not load this conftest, but be safe
        return
    _S.configured = True
    _S.shard = _shard_setting()
    if _S.shard is not None and getattr(config, "cache", None) is not None:
        _merge_lastfailed(config.cache)
    MPI = _mpi()
    _S.rank = MPI.COMM_WORLD.Get_rank()
    _S.size = MPI.COMM_WORLD.Get_size()
    _S.mpi_active = True
    _S.err_fd = os.dup(2)  # capture is suspended here, so fd 2 is the real stderr
    _S.watchdog = _Watchdog(_S.err_fd, _S.rank)
    from deepep_ascend.transports.process import release_mpich_shm

    _S.watchdog.release_shm = release_mpich_shm
    _S.watchdog.peers = [(r, h, pid) for r, (h, pid) in
                         enumerate(MPI.COMM_WORLD.allgather((os.uname().nodename, os.getpid())))]
    config.pluginmanager.register(
        mpi_utils.CollectiveOutcomePlugin(MPI.COMM_WORLD),
        "deepep-ascend-collective-outcome",
    )

    if _S.size > 1:
        _redirect_nonzero_rank_output(config, MPI.COMM_WORLD)


def _prune_old_logs(root: str, max_age_s: float) -> None:
    import shutil

    now = time.time()
    for name in os.listdir(root):
        path = os.path.join(root, name)
        try:
            if os.path.isdir(path) and now - os.path.getmtime(path) > max_age_s:
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass


def _redirect_nonzero_rank_output(config, world_comm) -> None:
    base = settings.TEST_LOG_DIR.get()
    if _S.rank == 0:
        if base:
            os.makedirs(base, exist_ok=True)
            logdir = tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-"), dir=base)
        else:
            root = os.path.join(tempfile.gettempdir(), "deepep_ascend_tests")
            os.makedirs(root, exist_ok=True)
            _prune_old_logs(root, max_age_s=24 * 3600)
            logdir = tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-"), dir=root)
    else:
        logdir = None
    logdir = world_comm.bcast(logdir, root=0)
    if _S.rank == 0:
        return
    _S.log_path = os.path.join(logdir, f"rank{_S.rank}.log")
    logfile = open(_S.log_path, "w", buffering=1, encoding="utf-8")  # noqa: SIM115
    old = config.pluginmanager.get_plugin("terminalreporter")
    if old is not None:
        config.pluginmanager.unregister(old)
        config.pluginmanager.register(
            pytest.TerminalReporter(config, logfile), "terminalreporter"
        )
    if config.getoption("capture", "fd") == "no":
        # No capture manager restores fds behind our back: redirect raw output too.
        os.dup2(logfile.fileno(), 1)
        os.dup2(logfile.fileno(), 2)
    # Only rank 0 writes pytest's cache (concurrent writers would race on the same files).
    cache = getattr(config, "cache", None)
    if cache is not None:
        cache.set = lambda key, value: None


#: Run last in every job (their modules keep their order): the 4-rank job's stalls follow them
#: (docs/testing.md, "Stalls of the 4-rank job").
LAST = ("tests/nn/",)


def _shard_setting() -> tuple[int, int] | None:
    """``(i, n)`` from ``DEEPEP_ASCEND_TEST_SHARD``, removed from the environment so that the jobs the tests
    launch collect every file of their own."""
    raw = settings.TEST_SHARD.raw()
    os.environ.pop(settings.TEST_SHARD.name, None)
    try:
        return parse_shard(raw)
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None


def _merge_lastfailed(cache) -> None:
    """Make this shard's write of pytest's ``cache/lastfailed`` (what ``--lf`` re-runs) a merge with the record as
    it is now, under a lock (:func:`~tests.support.shards.merge_lastfailed`): without it the last shard to finish
    would drop the others' failures."""
    import fcntl

    plain_set = cache.set

    def merging_set(key, value):
        if key != "cache/lastfailed":
            return plain_set(key, value)
        with open(cache.mkdir("deepep_ascend") / "lastfailed.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            plain_set(key, merge_lastfailed(cache.get(key, {}), value, _S.shard_file_set, _S.shard_collected))

    cache.set = merging_set


def pytest_collection_modifyitems(config, items):
    items[:] = ([item for item in items if not item.nodeid.startswith(LAST)]
                + [item for item in items if item.nodeid.startswith(LAST)])
    if _S.size > 1 and not settings.TEST_LOCAL_EVERY_RANK.get():
        local = [item for item in items if item.get_closest_marker("mpi") is None]
        if local:
            items[:] = [item for item in items if item.get_closest_marker("mpi") is not None]
            config.hook.pytest_deselected(items=local)
            _S.local_deselected = len(local)
    if _S.shard is not None:
        files = [file_of(item.nodeid) for item in items]
        mine = _S.shard_file_set = set(shard_files(files, *_S.shard))
        _S.shard_collected = set(files)
        other = [item for item in items if file_of(item.nodeid) not in mine]
        if other:
            items[:] = [item for item in items if file_of(item.nodeid) in mine]
            config.hook.pytest_deselected(items=other)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    wd = _S.watchdog
    if wd is not None:
        wd.arm(_watchdog_seconds(item), f"test {item.nodeid}")
    try:
        return (yield)
    finally:
        if wd is not None:
            wd.cancel()


def pytest_runtest_logreport(report):
    if report.failed:
        text = report.longreprtext or ""
        lines = text.strip().splitlines()
        short = "\n".join(lines[-12:]) if lines else "(no details)"
        _S.failures.append((report.nodeid, report.when, short))


def pytest_collectreport(report):
    if report.failed:
        lines = (report.longreprtext or "").strip().splitlines()
        _S.failures.append(
            (report.nodeid, "collect", "\n".join(lines[-12:]) or "(no details)")
        )


def _combine_status(statuses: list[int]) -> int:
    # A rank that drifted into another collective hands back a non-status object: count it as a failure.
    statuses = [s if isinstance(s, int) else 1 for s in statuses]
    bad = [s for s in statuses if s not in (0, 5)]
    if bad:
        return max(bad)
    if 0 in statuses:
        return 0
    return 5


_GATHERED_KEY = pytest.StashKey[list]()


def pytest_sessionfinish(session, exitstatus):
    """Gather every rank's failures and status (runs before the terminal summary is printed), waiting
    without spinning (:func:`tests.support.mpi_utils.wait`)."""
    if not _S.mpi_active or _S.size == 1:
        return
    from tests.support.mpi_utils import allgather_object

    gathered = allgather_object((int(exitstatus), _S.failures, _S.log_path), _mpi().COMM_WORLD)
    status = _combine_status([g[0] for g in gathered])
    session.exitstatus = status
    session.config.stash[_GATHERED_KEY] = gathered


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _S.local_deselected and _S.rank == 0:
        terminalreporter.write_line(
            f"deepep_ascend: {_S.local_deselected} test(s) not marked @pytest.mark.mpi deselected at {_S.size} ranks: "
            f"they run in the 1-rank job (DEEPEP_ASCEND_TEST_LOCAL_EVERY_RANK=1 runs them on every rank)")
    if _S.shard is not None and _S.rank == 0:
        terminalreporter.write_line(
            f"deepep_ascend: {len(_S.shard_file_set)} of {len(_S.shard_collected)} test files run here "
            f"({settings.TEST_SHARD.name}={_S.shard[0]}/{_S.shard[1]}: the files at positions {_S.shard[0]}, "
            f"{_S.shard[0]} + {_S.shard[1]}, ... of the collection)")
    gathered = config.stash.get(_GATHERED_KEY, None)
    if not gathered or _S.rank != 0:
        return
    seen = {(nodeid, when) for nodeid, when, _ in _S.failures}
    extra = []
    for r, (status, failures, log_path) in enumerate(gathered):
        if r == 0:
            continue
        mine = [(n, w, t) for n, w, t in failures if (n, w) not in seen]
        if mine or status not in (0, 5, int(exitstatus)):
            extra.append((r, status, mine, log_path))
    if not extra:
        return
    terminalreporter.section("failures on other ranks", sep="=", red=True, bold=True)
    for r, status, failures, log_path in extra:
        terminalreporter.write_line(
            f"rank {r}: pytest status {status}; full log: {log_path}"
        )
        for nodeid, when, text in failures:
            terminalreporter.write_line(f"  FAILED {nodeid} [{when}] on rank {r}:")
            for line in text.splitlines():
                terminalreporter.write_line(f"    {line}")


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    if not _S.configured:
        return
    wd = _S.watchdog
    if wd is not None:
        wd.cancel()
    session = config.stash.get(_SESSION_KEY, None)
    status = getattr(session, "exitstatus", None)
    _S.exit_status = int(status) if status is not None else None
    if _S.mpi_active and _S.err_fd is not None:
        # Backstop: a hang between here and the process exit (exit barrier, MPI_Finalize) kills the rank.
        _S.watchdog.arm(_EXIT_WATCHDOG_S, "exit after the test session")


_SESSION_KEY = pytest.StashKey[pytest.Session]()


def pytest_sessionstart(session):
    session.config.stash[_SESSION_KEY] = session


def _exit_job_at_exit() -> None:
    """atexit: flush, barrier, ``MPI_Finalize``, C ``exit(status)`` (see module doc)."""
    status = _S.exit_status
    if status is None or not _S.mpi_active:
        return  # pytest did not finish normally here (or MPI unused): default exit path
    if settings.TEST_EXIT_MODE.get() == "finalize":
        return  # for measurements: the interpreter's normal exit, mpi4py calls MPI_Finalize
    try:
        MPI = _mpi()
        if MPI.Is_initialized() and not MPI.Is_finalized():
            from deepep_ascend.transports.process import exit_job

            exit_job(status, MPI.COMM_WORLD)  # flush, barrier, MPI_Finalize, C exit
    finally:
        os._exit(status)


# atexit runs handlers last-in first-out: those registered after this line (by what the tests import)
# run before it; the library's own hooks, registered when this module imported deepep_ascend above,
# never run, as the process ends here. MPI_Finalize releases what a forgotten transport still holds.
atexit.register(_exit_job_at_exit)
