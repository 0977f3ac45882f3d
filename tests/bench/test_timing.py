"""The benchmarks' warm-up (``bench.timing.warm_up``): at least ``warmup`` iterations and at least ``min_seconds`` of
them on the slowest rank, every rank running the same number of collective iterations."""

from __future__ import annotations

import time

import pytest

from bench import timing
from tests.support.mpi_utils import world


def _counting_step(comm, pause_s: float):
    """A collective step (one ``Allreduce``) that sleeps ``pause_s`` on this rank first; returns ``(step, calls)``."""
    calls = []

    def step():
        time.sleep(pause_s)
        comm.allreduce(1)
        calls.append(time.perf_counter())

    return step, calls


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("warmup", [0, 3])
def test_the_warm_up_lasts_its_seconds_on_the_slowest_rank_and_every_rank_runs_as_many_steps(warmup):
    comm = world()
    # rank 0 is the slow one: the others must keep stepping with it (a rank stopping early would hang its peers'
    # Allreduce) until rank 0 has spent the time
    step, calls = _counting_step(comm, 0.004 if comm.Get_rank() == 0 else 0.0)
    start = time.perf_counter()
    runs = timing.warm_up(step, comm, warmup, min_seconds=0.06)
    elapsed = time.perf_counter() - start
    assert runs == len(calls) >= max(warmup, 1)
    assert comm.allgather(runs) == [runs] * comm.Get_size()
    assert max(comm.allgather(elapsed)) >= 0.06  # on the rank that started first
    assert runs <= 0.06 / 0.004 + 2 + warmup  # it stops once the time has passed


@pytest.mark.mpi(min_size=1)
def test_no_seconds_means_exactly_the_warmup_iterations():
    comm = world()
    step, calls = _counting_step(comm, 0.0)
    assert timing.warm_up(step, comm, 4, min_seconds=0) == 4 == len(calls)
    assert timing.warm_up(step, comm, 0, min_seconds=0) == 0
    assert len(calls) == 4


@pytest.mark.mpi(min_size=1)
def test_time_phases_times_iters_after_the_warm_up_and_the_default_comes_from_warmup_s(monkeypatch):
    comm = world()
    step, calls = _counting_step(comm, 0.002)
    monkeypatch.setattr(timing, "MIN_WARMUP_S", 0.05)
    progress = []
    before = time.perf_counter()
    t = timing.time_phases([("op", step)], comm, iters=3, warmup=2, progress=progress.append)["op"]
    assert len(t.times) == 3
    warm = len(calls) - 3
    # The warm-up ran for the seconds on the slowest rank (counted in time, not in steps: oversubscribed ranks
    # make a step slower than its pause), so on past its 2 iterations unless those alone took the seconds (a host
    # loaded many times over).
    assert warm >= 2
    assert max(comm.allgather(calls[warm - 1] - before)) >= 0.05 - 0.005
    if max(comm.allgather(calls[1] - before)) < 0.05 - 0.005:
        assert warm > 2
    assert progress == [0, 1, 2, 3, 4]  # the bar's warmup + iters steps, once each
    calls.clear()
    monkeypatch.setattr(timing, "MIN_WARMUP_S", 0.0)
    timing.time_phases([("op", step)], comm, iters=3, warmup=2)
    assert len(calls) == 5


def test_warmup_s_is_parsed_checked_and_put_in_force(monkeypatch):
    from bench import cli, commands

    monkeypatch.setattr(timing, "MIN_WARMUP_S", timing.MIN_WARMUP_S)  # restored after the test
    p = commands.parser("sort")
    assert p.parse_args([]).warmup_s == timing.DEFAULT_WARMUP_S
    args = commands.parse("sort", ["--warmup-s", "0.5"])
    assert args.warmup_s == 0.5 and timing.MIN_WARMUP_S == 0.5
    for bad in ("-1", "nan", "inf", "x"):
        with pytest.raises(Exception, match="float|finite"):
            cli.float_at_least(0.0)(bad)
    with pytest.raises(SystemExit):  # a command that fails to parse leaves the default in force, not 0.5
        commands.parse("sort", ["--warmup-s", "-1"])
    assert timing.MIN_WARMUP_S == timing.DEFAULT_WARMUP_S
