"""``scripts/test.sh`` (the README's test command) and the harness's watchdog: a job that the
watchdog ended is run once more and the second result counts; a job whose tests fail is not re-run;
the watchdog's report locates every rank.

Runs in the 1-rank job: each case runs the script on a two-rank job of one small test file.
"""

from __future__ import annotations

import os
import re

import pytest

from tests.support import REPO_ROOT
from tests.support.mpi_utils import child_env, run_child_command, world

REPO = REPO_ROOT

CHILD_TEST = """
import os
import time
import pytest
from mpi4py import MPI

MARK = os.environ["SUITE_SCRIPT_MARK"]
MODE = os.environ["SUITE_SCRIPT_MODE"]
# The MPICH shared-memory segments this rank maps: the parent test checks that they are gone.
with open("/proc/self/maps") as maps:
    SEGMENTS = {line.split("/dev/shm/", 1)[1].split()[0] for line in maps if "/dev/shm/mpich_shm_" in line}
with open(os.path.join(os.environ["SUITE_SCRIPT_SEGMENTS"], str(os.getpid())), "w") as f:
    f.write(" ".join(sorted(SEGMENTS)))

@pytest.mark.mpi(min_size=2)
def test_first():
    assert MODE not in ("fail", "fail_then_hang"), "a real failure"

@pytest.mark.mpi(min_size=2)
@pytest.mark.watchdog(4)
def test_second():
    first = not os.path.exists(MARK)
    MPI.COMM_WORLD.Barrier()
    if MPI.COMM_WORLD.Get_rank() == 1:
        if first:
            open(MARK, "w").close()
        if MODE in ("hang_always", "fail_then_hang") or (MODE == "hang_once" and first):
            time.sleep(120)  # rank 0 waits in the barrier below
    MPI.COMM_WORLD.Barrier()
"""


def _mpich_segments() -> set:
    return ({name for name in os.listdir("/dev/shm") if name.startswith("mpich_shm_")}
            if os.path.isdir("/dev/shm") else set())


def _run_script(tmp_path, mode, retries="1"):
    (tmp_path / "test_child.py").write_text(CHILD_TEST)
    (tmp_path / "segments").mkdir(exist_ok=True)
    env = child_env(REPO, DEEPEP_ASCEND_TEST_RANKS="2", DEEPEP_ASCEND_SKIP_SETUP="1",
                    DEEPEP_ASCEND_TEST_HANG_RETRIES=retries, SUITE_SCRIPT_MODE=mode,
                    SUITE_SCRIPT_MARK=str(tmp_path / "ran"), SUITE_SCRIPT_SEGMENTS=str(tmp_path / "segments"),
                    PYTHONPATH=REPO)
    for var in ("DEEPEP_ASCEND_TEST_LOG_DIR", "DEEPEP_ASCEND_SUITE_TIMEOUT_S", "DEEPEP_ASCEND_TEST_WATCHDOG_S"):
        env.pop(var, None)
    return run_child_command(["bash", os.path.join(REPO, "scripts", "test.sh"), "-p", "no:cacheprovider",
                              "--rootdir", str(tmp_path), "--confcutdir", str(tmp_path), "-p", "tests.conftest",
                              str(tmp_path / "test_child.py")], REPO, env, timeout_s=240)


@pytest.fixture(autouse=True)
def _no_segment_left(tmp_path):
    """A job the watchdog ended leaves no MPICH segment in /dev/shm (it skips MPI_Finalize). Only the
    segments the child ranks mapped count (their names, from /proc/self/maps): other MPI jobs on the
    machine may hold segments of their own meanwhile."""
    yield
    names = set()
    for record in (tmp_path / "segments").iterdir() if (tmp_path / "segments").is_dir() else ():
        names |= set(record.read_text().split())
    assert names, "the child ranks recorded no MPICH segment: this check would see nothing"
    assert not names & _mpich_segments(), f"left in /dev/shm: {sorted(names & _mpich_segments())}"


pytestmark = [pytest.mark.mpi(min_size=1),
              pytest.mark.skipif(world().Get_size() != 1, reason="runs scripts/test.sh; in the 1-rank job only")]


def test_a_hung_job_runs_again_and_its_second_result_counts(tmp_path):
    rc, out = _run_script(tmp_path, "hang_once")
    assert rc == 0, out[-3000:]
    assert "[watchdog] rank 1: test" in out and "=== 2 rank(s): HUNG" in out, out[-3000:]
    assert "=== 2 rank(s): passed" in out and "after 1 hung run(s)" in out, out[-3000:]
    assert "=== passed, but 1 job(s) hung first" in out, out[-3000:]
    # The watchdog's report: each rank names the test and describes its peers from /proc, so a rank
    # whose own report is lost (one CI hang had a rank print nothing) is still located.
    for r in (0, 1):
        assert re.search(rf"\[watchdog\] rank {r}: test \S*test_second exceeded 4 s", out), out[-3000:]
    assert re.search(r"\[watchdog\]   rank 1 \(pid \d+\): S \(sleeping\); threads \d+:S/", out), out[-3000:]
    assert re.search(r"\[watchdog\]   rank 0 \(pid \d+\): [RS] ", out), out[-3000:]


def test_a_hang_with_no_retry_left_fails(tmp_path):
    rc, out = _run_script(tmp_path, "hang_always", retries="0")
    assert rc != 0 and "[watchdog] rank 1: test" in out, out[-3000:]
    assert "HUNG" not in out and "=== 2 rank(s): FAILED" in out, out[-3000:]


def test_a_failing_job_is_not_run_again(tmp_path):
    rc, out = _run_script(tmp_path, "fail")
    assert rc != 0 and "a real failure" in out, out[-3000:]
    assert "HUNG" not in out and out.count("=== pytest at 2 rank(s) ===") == 1, out[-3000:]


def test_a_failure_then_a_hang_is_not_run_again(tmp_path):
    # A retry would run the failed test again and could pass it: a hang after a failure fails the job.
    rc, out = _run_script(tmp_path, "fail_then_hang")
    assert rc != 0 and "[watchdog] rank 1: test" in out, out[-3000:]
    assert "HUNG" not in out and out.count("=== pytest at 2 rank(s) ===") == 1, out[-3000:]
    assert "=== 2 rank(s): FAILED" in out, out[-3000:]

