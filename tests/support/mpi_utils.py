"""Multi-rank test helpers: communicator access, tensor all-gather, collective pass/fail.

Tests run as one pytest process per MPI rank (``mpiexec -n N python -m pytest --with-mpi``).
A test marked ``@pytest.mark.mpi(min_size=N)`` runs on every rank; ``tests/conftest.py`` makes
its pass/fail collective with :func:`sync_outcome`, so a failure on any rank fails the test on
every rank (rank 0's output names each failing rank and its error) and ranks stay in step.

Import from the ``tests`` package::

    from tests.support.mpi_utils import gather_all, run_collectively, skip_unless_size

Fixtures (registered by ``tests/conftest.py``): ``comm`` (``MPI.COMM_WORLD``), ``rank``,
``world_size``.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch

__all__ = [
    "CollectiveFailure",
    "CollectiveOutcomePlugin",
    "RankFailure",
    "allgather_object",
    "comm",
    "describe_exception",
    "format_failures",
    "gather_all",
    "is_failure",
    "only_sizes",
    "raise_collective",
    "rank",
    "run_collectively",
    "skip_unless_size",
    "sync_outcome",
    "wait",
    "world",
    "world_nranks",
    "world_rank",
    "world_size",
]

_MAX_ERROR_CHARS = 2000
_HIDDEN_FRAME_PARTS = (
    os.sep + "_pytest" + os.sep,
    os.sep + "pluggy" + os.sep,
    "mpi_utils.py",
)


def world():
    """``mpi4py.MPI.COMM_WORLD`` (imports mpi4py, which initialises MPI on first use)."""
    from mpi4py import MPI

    return MPI.COMM_WORLD


def world_rank() -> int:
    return world().Get_rank()


def world_nranks() -> int:
    return world().Get_size()


# ----------------------------------------------------------------------------------------------
# fixtures (imported into conftest.py so pytest sees them)


@pytest.fixture
def comm():
    """``MPI.COMM_WORLD``."""
    return world()


@pytest.fixture
def rank(comm) -> int:
    """This process's rank in ``MPI.COMM_WORLD``."""
    return comm.Get_rank()


@pytest.fixture
def world_size(comm) -> int:
    """Number of ranks in ``MPI.COMM_WORLD``."""
    return comm.Get_size()


# ----------------------------------------------------------------------------------------------
# rank-count conditions (identical on every rank, so skips never desynchronise ranks)


def skip_unless_size(*sizes: int, reason: str | None = None) -> None:
    """Inside a test: ``pytest.skip`` unless the world size is one of ``sizes``.

    E.g. ``skip_unless_size(2, 4, 8)`` for intranode normal mode (docs/semantics/deepep-api.md §8).
    """
    n = world_nranks()
    if n not in sizes:
        pytest.skip(reason or f"needs world size in {sorted(sizes)}, have {n}")


def only_sizes(*sizes: int, reason: str | None = None):
    """Marker form of :func:`skip_unless_size`: ``@only_sizes(2, 4, 8)``.

    Evaluated at import time (MPI is initialised then); combine with
    ``@pytest.mark.mpi(min_size=...)`` so the test is collective.
    """
    n = world_nranks()
    return pytest.mark.skipif(
        n not in sizes,
        reason=reason or f"needs world size in {sorted(sizes)}, have {n}",
    )


#: Why an :func:`up_to_four_ranks` test is not in the 8-rank job.
SCALE_FREE = ("what it checks does not change past 4 ranks (the 2- and 4-rank jobs run it); the 8-rank job, four "
              "processes per core, keeps the suite's time for the tests of scale")


def up_to_four_ranks():
    """Marker: run at 1, 2 and 4 ranks, not in the 8-rank job (:data:`SCALE_FREE`): for tests whose checks (bad
    input, deadlines, lifecycles, variants of one path) do not depend on the rank count past 4. The data paths'
    reference tests run at 8 ranks too (docs/testing.md)."""
    return only_sizes(1, 2, 4, reason=SCALE_FREE)


# ----------------------------------------------------------------------------------------------
# gathering


def wait(req) -> None:
    """Complete the MPI request ``req`` without spinning the CPU away from the other ranks.

    MPICH's blocking calls poll and ``sched_yield`` until they complete. When ranks outnumber
    cores that starves the rank everyone waits for: in 4-rank suite runs on 2 cores the waiting
    ranks took most of the CPU (``perf``: mostly inside ``sched_yield``) and single tests ran
    100-170x slower than in quiet runs (the MoE layer's low-latency test 170 s against 1 s). So
    the harness waits as the library's own waits do (``transports.base.WaitPolicy``): poll, then
    sleep, when oversubscribed.
    """
    from deepep_ascend.transports.base import quiet_wait

    quiet_wait([req], int(os.environ.get("MPI_LOCALNRANKS", world_nranks())))


def _allgatherv_bytes(data, counts: list, comm) -> list:
    """Every rank's ``uint8`` array ``data`` (``counts[r]`` bytes on rank ``r``, known everywhere),
    as views of one receive buffer, in rank order. Waits with :func:`wait`."""
    from deepep_ascend.transports.base import allgatherv_bytes

    return allgatherv_bytes(comm, data, counts, wait)


def allgather_object(obj: Any, comm=None) -> list:
    """All-gather of a picklable Python object; list indexed by rank. Waits with :func:`wait`."""
    from deepep_ascend.transports.base import allgather_object as gather

    return gather(comm or world(), obj, wait)


def gather_all(tensor: torch.Tensor, comm=None) -> list[torch.Tensor]:
    """All-gather a CPU tensor from every rank; returns ``[tensor_of_rank_0, ..., rank_R-1]``.

    Shapes (including the first dimension) and dtypes may differ between ranks; each result has
    its owner's shape and dtype and is contiguous. Bytes are moved verbatim (via a ``uint8``
    view), so every dtype works: bool, int*, float*, bfloat16, float8_e4m3fn, ... . Non-contiguous
    inputs are made contiguous first. The local rank's entry is a copy, not ``tensor`` itself.
    Collective: every rank must call it in the same order.
    """
    comm = comm or world()
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(
            f"gather_all expects a torch.Tensor, got {type(tensor).__name__}"
        )
    if tensor.device.type != "cpu":
        raise ValueError(f"gather_all expects a CPU tensor, got device {tensor.device}")
    t = tensor.detach().contiguous()
    raw = (
        t.reshape(-1).view(torch.uint8)
        if t.numel()
        else torch.empty(0, dtype=torch.uint8)
    )
    meta = allgather_object(
        (tuple(t.shape), str(t.dtype).removeprefix("torch."), raw.numel()), comm
    )
    parts = _allgatherv_bytes(raw.numpy(), [m[2] for m in meta], comm)
    out = []
    for (shape, dtype_name, nbytes), part in zip(meta, parts):
        dtype = getattr(torch, dtype_name)
        out.append(
            torch.from_numpy(part).clone().view(dtype).reshape(shape)
            if nbytes
            else torch.empty(shape, dtype=dtype)
        )
    return out


# ----------------------------------------------------------------------------------------------
# collective pass/fail


@dataclass(frozen=True)
class RankFailure:
    """One rank's failure: its rank and a short description (type, message, where)."""

    rank: int
    error: str

    def __str__(self) -> str:
        return f"rank {self.rank}: {self.error}"


class CollectiveFailure(AssertionError):
    """Raised on every rank when the guarded code failed on at least one rank.

    ``failures`` lists ``RankFailure``s in rank order; ``failed_ranks`` their ranks.
    """

    def __init__(self, what: str, failures: Sequence[RankFailure], nranks: int):
        self.what = what
        self.failures = list(failures)
        self.failed_ranks = [f.rank for f in self.failures]
        self.nranks = nranks
        super().__init__(format_failures(what, self.failures, nranks))


def format_failures(what: str, failures: Sequence[RankFailure], nranks: int) -> str:
    lines = [
        f"{what} failed on {len(failures)} of {nranks} rank(s) {[f.rank for f in failures]}:"
    ]
    for f in failures:
        body = f.error.rstrip().replace("\n", "\n    ")
        lines.append(f"  rank {f.rank}: {body}")
    return "\n".join(lines)


def describe_exception(exc: BaseException, max_chars: int = _MAX_ERROR_CHARS) -> str:
    """``Type: message`` plus the innermost few frames, truncated to ``max_chars``."""
    head = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    shown = [
        (tb.tb_frame, tb.tb_lineno)
        for tb in _walk_tb(exc.__traceback__)
        if not any(
            part in tb.tb_frame.f_code.co_filename for part in _HIDDEN_FRAME_PARTS
        )
        and not tb.tb_frame.f_locals.get("__tracebackhide__", False)
    ][-3:]
    frames = traceback.StackSummary.extract(shown, lookup_lines=False)
    where = "".join(
        f"\n  at {os.path.relpath(fr.filename) if fr.filename.startswith(os.getcwd()) else fr.filename}"
        f":{fr.lineno} in {fr.name}"
        for fr in frames
    )
    text = head + where
    if len(text) > max_chars:
        text = text[: max_chars - 15] + " ...[truncated]"
    return text


def _walk_tb(tb):
    while tb is not None:
        yield tb
        tb = tb.tb_next


def _is_skip(exc: BaseException | None) -> bool:
    return exc is not None and isinstance(exc, pytest.skip.Exception)


def is_failure(exc: BaseException | None) -> bool:
    """True for exceptions that make a test fail (not skip / xfail / None)."""
    if exc is None or _is_skip(exc):
        return False
    return not isinstance(exc, pytest.xfail.Exception)


def sync_outcome(
    exc: BaseException | None, what: str = "test", comm=None
) -> list[RankFailure]:
    """All-gather each rank's outcome; return every rank's failure (empty if all ranks are fine).

    ``exc`` is this rank's exception (``None`` on success; skips/xfails do not count as
    failures). Collective: every rank must call it once per guarded step.
    """
    comm = comm or world()
    mine = describe_exception(exc) if is_failure(exc) else None
    gathered = allgather_object(mine, comm)
    return [RankFailure(r, e) for r, e in enumerate(gathered) if e is not None]


def raise_collective(
    exc: BaseException | None, failures: Sequence[RankFailure], what: str, nranks: int
) -> None:
    """Re-raise so that every rank fails if any rank failed.

    A rank that failed itself re-raises its own exception (its full traceback stays in its
    report) with a note naming the other failing ranks; a rank that succeeded raises
    :class:`CollectiveFailure`. If nobody failed, ``exc`` (a skip, xfail or None) is re-raised
    as is.
    """
    __tracebackhide__ = True
    if not failures:
        if exc is not None:
            raise exc
        return
    if is_failure(exc):
        others = [f for f in failures if f.rank != world_rank()]
        if others and hasattr(exc, "add_note"):
            exc.add_note(format_failures(what, failures, nranks))
        raise exc
    err = CollectiveFailure(what, failures, nranks)
    if exc is not None:
        raise err from exc
    raise err


def run_collectively(
    fn: Callable[..., Any], *args, what: str | None = None, comm=None, **kwargs
):
    """Run ``fn(*args, **kwargs)`` on every rank; if it raised on any rank, raise on every rank.

    Returns ``fn``'s result when it succeeded everywhere. Ranks that failed re-raise their own
    exception (annotated with the others'); ranks that succeeded raise
    :class:`CollectiveFailure` listing each failing rank and its error. ``fn`` must fail fast
    (library timeouts) so that the final all-gather is reached on every rank.
    """
    __tracebackhide__ = True
    comm = comm or world()
    what = what or getattr(fn, "__qualname__", "function")
    exc: BaseException | None = None
    result = None
    try:
        result = fn(*args, **kwargs)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - includes pytest's Failed/Skipped outcomes
        exc = e
    failures = sync_outcome(exc, what, comm)
    raise_collective(exc, failures, what, comm.Get_size())
    return result


class CollectiveOutcomePlugin:
    """pytest plugin: collective pass/fail for tests marked ``@pytest.mark.mpi``.

    Wraps each phase (setup, call, teardown) of such a test: after the phase every rank
    all-gathers its outcome (:func:`sync_outcome`); if any rank failed, the phase fails on every
    rank — a rank that failed keeps its own exception (annotated with the others' errors), a
    rank that was fine fails with a message listing each failing rank and its error. Not
    wrapped: unmarked tests, runs without ``--with-mpi``/``--only-mpi``, and tests whose
    ``min_size`` exceeds the world size (skipped identically on every rank, no communication).
    Registered by ``tests/conftest.py``.
    """

    def __init__(self, comm=None):
        self.comm = comm or world()
        self.size = self.comm.Get_size()

    def is_collective(self, item) -> bool:
        m = item.get_closest_marker("mpi")
        if m is None:
            return False
        cfg = item.config
        if not (
            cfg.getoption("--with-mpi", False) or cfg.getoption("--only-mpi", False)
        ):
            return False
        min_size = m.kwargs.get("min_size")
        return min_size is None or self.size >= min_size

    def _phase(self, item, phase: str):
        __tracebackhide__ = True
        exc: BaseException | None = None
        result = None
        try:
            result = yield
        except (KeyboardInterrupt, SystemExit):
            raise
        except pytest.exit.Exception:
            raise
        except BaseException as e:  # noqa: BLE001 - pytest outcomes included
            exc = e
        what = f"{item.nodeid} [{phase}]"
        failures = sync_outcome(exc, what, self.comm)
        if failures and not is_failure(exc):
            # This rank was fine: a clean report naming the failing ranks and their errors.
            pytest.fail(format_failures(what, failures, self.size), pytrace=False)
        raise_collective(exc, failures, what, self.size)
        return result

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_setup(self, item):
        if not self.is_collective(item):
            return (yield)
        return (yield from self._phase(item, "setup"))

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item):
        if not self.is_collective(item):
            return (yield)
        return (yield from self._phase(item, "call"))

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(self, item, nextitem):
        if not self.is_collective(item):
            return (yield)
        return (yield from self._phase(item, "teardown"))


# ----------------------------------------------------------------------------------------------
# child jobs: a test (in the 1-rank run) launching its own ``mpiexec``


def mpiexec_path() -> str:
    """The ``mpiexec`` of the MPI mpi4py runs on (``transports.process.mpiexec_path``)."""
    from deepep_ascend.transports.process import mpiexec_path as find

    return find() or "mpiexec"


def child_env(repo: str, **extra) -> dict:
    """This process's environment without the launcher's variables (a child job must not join ours)
    and without MPICH/UCX tuning (``MPIR_CVAR_*``, ``UCX_*``): a child gets those only from ``extra``."""
    drop = ("PMI_", "HYDRA_", "MPI_LOCALNRANKS", "MPI_LOCALRANKID", "PYTEST_", "OMPI_", "PMIX_", "MPIR_CVAR_", "UCX_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env["PYTHONPATH"] = repo + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra)
    return env


def run_child_command(args: Sequence[str], repo: str, env: dict, timeout_s: float = 120.0) -> tuple[int, str]:
    """Run ``args`` in ``repo`` with exactly ``env``, in its own session; kill the whole group
    (launcher and ranks) on timeout. Returns ``(exit status, combined stdout and stderr)``."""
    import signal
    import subprocess

    proc = subprocess.Popen(list(args), cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        out += f"\n[parent] killed the child after {timeout_s} s"
    return proc.returncode, out


def run_child_job(n: int, args: Sequence[str], repo: str, timeout_s: float = 120.0, **extra_env) -> tuple[int, str]:
    """Run ``mpiexec -n n <args>`` (:func:`run_child_command`, environment from :func:`child_env`)."""
    return run_child_command([mpiexec_path(), "-n", str(n), *args], repo, child_env(repo, **extra_env), timeout_s)
