"""``scripts/test.sh`` splits its 1-rank job into concurrent jobs of alternate test files
(``DEEPEP_ASCEND_TEST_SHARDS``, ``DEEPEP_ASCEND_TEST_SHARD``): every file runs once, in one job, with the
variable gone from its environment; a failing job fails the whole 1-rank job and says which; pytest's record of
the last failures keeps every job's, so ``--lf`` runs them all again.

The script case runs in the 1-rank job; the selection rules run in-process.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import pytest

from tests.support import REPO_ROOT
from tests.support.mpi_utils import child_env, run_child_command, world
from tests.support.shards import merge_lastfailed, parse_shard, shard_files

CHILD = """
import os
import time

def test_{name}():
    assert "DEEPEP_ASCEND_TEST_SHARD" not in os.environ  # the jobs a test launches collect every file
    with open(os.path.join(os.environ["SHARDS_RECORD"], "{name}"), "a") as f:
        f.write(str(os.getppid()) + "\\n")
    assert "{name}" not in os.environ["SHARDS_FAIL"].split()
    time.sleep(float(os.environ.get("SHARDS_SLEEP", "0")))
"""

FILES = ("test_a.py", "test_b.py", "test_c.py")


def test_parse_shard():
    assert parse_shard(None) is None
    assert parse_shard("0/2") == (0, 2) and parse_shard(" 1/3 ") == (1, 3)
    for bad in ("2/2", "1", "a/2", "-1/2", "1/0", "1/2/3"):
        with pytest.raises(ValueError, match=rf"DEEPEP_ASCEND_TEST_SHARD: expected i/n .*{re.escape(repr(bad))}"):
            parse_shard(bad)


def test_shard_files_take_alternate_whole_files_and_cover_each_once():
    files = ["a.py", "a.py", "b.py", "c.py", "c.py", "d.py", "e.py", "a.py"]
    assert shard_files(files, 0, 2) == ["a.py", "c.py", "e.py"]
    assert shard_files(files, 1, 2) == ["b.py", "d.py"]
    for n in (1, 2, 3, 7):
        parts = [shard_files(files, i, n) for i in range(n)]
        assert sorted(sum(parts, [])) == sorted(set(files)), n


def test_merge_lastfailed_keeps_the_other_shards_files_and_what_no_shard_runs():
    collected = {"t/a.py", "t/b.py", "t/c.py"}
    mine = {"t/a.py", "t/c.py"}
    on_disk = {"t/a.py::old": True, "t/b.py::x": True, "t/broken.py": True, "t/elsewhere.py::y": True}
    this_run = {"t/a.py::new": True, "t/b.py::stale": True, "t/broken2.py": True, "t/elsewhere.py::y": True}
    # a.py: this run's (old passed, new failed); b.py: the file's (the other shard wrote it); broken.py fixed and
    # broken2.py broken this run (no shard has items of theirs); elsewhere.py: outside this run, kept
    assert merge_lastfailed(on_disk, this_run, mine, collected) == {
        "t/a.py::new": True, "t/b.py::x": True, "t/broken2.py": True, "t/elsewhere.py::y": True}


def _script(tmp_path, fail: str, *args: str, sleep_s: float = 0) -> tuple[list, dict]:
    """The command and environment of ``scripts/test.sh`` on :data:`FILES` in ``tmp_path`` at one rank."""
    for name in FILES:
        (tmp_path / name).write_text(CHILD.format(name=name.removesuffix(".py")))
    (tmp_path / "record").mkdir(exist_ok=True)
    env = child_env(REPO_ROOT, DEEPEP_ASCEND_TEST_RANKS="1", DEEPEP_ASCEND_SKIP_SETUP="1",
                    DEEPEP_ASCEND_TEST_SHARDS="2", SHARDS_RECORD=str(tmp_path / "record"), SHARDS_FAIL=fail,
                    SHARDS_SLEEP=str(sleep_s), PYTHONPATH=REPO_ROOT)
    for var in ("DEEPEP_ASCEND_TEST_LOG_DIR", "DEEPEP_ASCEND_TEST_SHARD", "DEEPEP_ASCEND_SUITE_TIMEOUT_S"):
        env.pop(var, None)
    return ["bash", os.path.join(REPO_ROOT, "scripts", "test.sh"), *args, "--rootdir", str(tmp_path),
            "--confcutdir", str(tmp_path), "-p", "tests.conftest", *(str(tmp_path / name) for name in FILES)], env


def _run_script(tmp_path, fail: str, *args: str) -> tuple[int, str]:
    command, env = _script(tmp_path, fail, *args)
    return run_child_command(command, REPO_ROOT, env, timeout_s=240)


@pytest.mark.mpi(min_size=1)
@pytest.mark.skipif(world().Get_size() != 1, reason="runs scripts/test.sh; in the 1-rank job only")
def test_the_one_rank_job_runs_each_file_once_in_concurrent_jobs_and_keeps_every_jobs_failures(tmp_path):
    record = tmp_path / "record"
    # test_a and test_c (positions 0 and 2) run in one job, test_b in the other; test_b and test_c fail
    rc, out = _run_script(tmp_path, "test_b test_c")
    assert rc != 0, out[-3000:]
    ran = {name: (record / name).read_text().split() for name in ("test_a", "test_b", "test_c")}
    assert all(len(pids) == 1 for pids in ran.values()), (ran, out[-3000:])
    assert ran["test_a"] == ran["test_c"] != ran["test_b"], (ran, out[-3000:])
    assert "deepep_ascend: 2 of 3 test files run here (DEEPEP_ASCEND_TEST_SHARD=0/2" in out, out[-3000:]
    for job in ("0/2", "1/2"):
        assert re.search(rf"=== 1 rank\(s\) \(shard {job}\): FAILED \(exit 1;", out), out[-3000:]
    assert re.search(r"=== 1 rank\(s\): FAILED \(exit statuses of its 2 concurrent jobs: 1 1;", out), out[-3000:]
    assert out.index("(shard 0/2) ===") < out.index("(shard 1/2) ===")  # output job by job
    # pytest's record of the last failures holds both jobs' (each job merges its own into it) ...
    with open(tmp_path / ".pytest_cache" / "v" / "cache" / "lastfailed") as f:
        failed = sorted(k.rsplit("/", 1)[-1] for k in json.load(f))
    assert failed == ["test_b.py::test_test_b", "test_c.py::test_test_c"], failed
    # ... so --lf runs both again and nothing else (in one job: it collects by the cache the jobs would rewrite)
    rc, out = _run_script(tmp_path, "", "--lf")
    assert rc == 0, out[-3000:]
    ran = {name: (record / name).read_text().split() for name in ("test_a", "test_b", "test_c")}
    assert [len(ran[name]) for name in ("test_a", "test_b", "test_c")] == [1, 2, 2], (ran, out[-3000:])
    assert ran["test_b"][1] == ran["test_c"][1], (ran, out[-3000:])
    assert "=== --lf: the 1-rank job runs as one job ===" in out and "=== 1 rank(s): passed (" in out, out[-3000:]


@pytest.mark.mpi(min_size=1)
@pytest.mark.skipif(world().Get_size() != 1, reason="runs scripts/test.sh; in the 1-rank job only")
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_to_the_scripts_process_group_stops_every_job(tmp_path, sig):
    # Ctrl-C, a closed terminal or `timeout N bash scripts/test.sh` signal the script's process group; each
    # job's mpiexec runs in a group of its own (its timeout's), which that signal does not reach
    command, env = _script(tmp_path, "", sleep_s=120)
    proc = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        record, deadline = tmp_path / "record", time.monotonic() + 120
        while len(list(record.iterdir())) < 2 and time.monotonic() < deadline:  # a test running in each job
            time.sleep(0.2)
        assert len(list(record.iterdir())) == 2, proc.communicate(timeout=60)
        pids = {int(pid) for f in record.iterdir() for pid in f.read_text().split()}  # the tests' parents: pytest
        os.killpg(proc.pid, sig)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 128 + sig, out[-3000:]
        deadline = time.monotonic() + 30
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [pid for pid in pids if _alive(pid)], out[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
