"""``scripts/test.sh`` splits its 1-rank job into concurrent jobs of alternate test files
(``DEEPEP_ASCEND_TEST_SHARDS``, ``DEEPEP_ASCEND_TEST_SHARD``): every file runs once, in one job, with the
variable gone from its environment; a failing job fails the whole 1-rank job and says which.

The script case runs in the 1-rank job; the selection rules run in-process.
"""

from __future__ import annotations

import os
import re

import pytest

from tests.support import REPO_ROOT
from tests.support.mpi_utils import child_env, run_child_command, world
from tests.support.shards import parse_shard, shard_files

CHILD = """
import os

def test_{name}():
    assert "DEEPEP_ASCEND_TEST_SHARD" not in os.environ  # the jobs a test launches collect every file
    with open(os.path.join(os.environ["SHARDS_RECORD"], "{name}"), "a") as f:
        f.write(str(os.getppid()) + "\\n")
    assert "{name}" != os.environ.get("SHARDS_FAIL")
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


@pytest.mark.mpi(min_size=1)
@pytest.mark.skipif(world().Get_size() != 1, reason="runs scripts/test.sh; in the 1-rank job only")
def test_the_one_rank_job_runs_each_file_once_in_concurrent_jobs_and_a_failure_fails_it(tmp_path):
    for name in FILES:
        (tmp_path / name).write_text(CHILD.format(name=name.removesuffix(".py")))
    record = tmp_path / "record"
    record.mkdir()
    env = child_env(REPO_ROOT, DEEPEP_ASCEND_TEST_RANKS="1", DEEPEP_ASCEND_SKIP_SETUP="1",
                    DEEPEP_ASCEND_TEST_SHARDS="2", SHARDS_RECORD=str(record), SHARDS_FAIL="test_b",
                    PYTHONPATH=REPO_ROOT)
    for var in ("DEEPEP_ASCEND_TEST_LOG_DIR", "DEEPEP_ASCEND_TEST_SHARD", "DEEPEP_ASCEND_SUITE_TIMEOUT_S"):
        env.pop(var, None)
    rc, out = run_child_command(["bash", os.path.join(REPO_ROOT, "scripts", "test.sh"), "-p", "no:cacheprovider",
                                 "--rootdir", str(tmp_path), "--confcutdir", str(tmp_path), "-p", "tests.conftest",
                                 *(str(tmp_path / name) for name in FILES)], REPO_ROOT, env, timeout_s=240)
    assert rc != 0, out[-3000:]
    # test_a and test_c (positions 0 and 2) in one job, test_b in the other, each once
    ran = {name: (record / name).read_text().split() for name in ("test_a", "test_b", "test_c")}
    assert all(len(pids) == 1 for pids in ran.values()), (ran, out[-3000:])
    assert ran["test_a"] == ran["test_c"] != ran["test_b"], (ran, out[-3000:])
    assert "deepep_ascend: 2 of 3 test files run here (DEEPEP_ASCEND_TEST_SHARD=0/2" in out, out[-3000:]
    assert "=== 1 rank(s) (test files 0/2): passed" in out, out[-3000:]
    assert re.search(r"=== 1 rank\(s\) \(test files 1/2\): FAILED \(exit 1;", out), out[-3000:]
    assert re.search(r"=== 1 rank\(s\): FAILED \(exit statuses of its 2 concurrent jobs: 0 1;", out), out[-3000:]
    assert out.index("(test files 0/2) ===") < out.index("(test files 1/2) ===")  # output job by job
