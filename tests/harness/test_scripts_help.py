"""``bash scripts/<script> --help``: the script's usage, before any set-up, pytest or benchmark runs."""

from __future__ import annotations

import os

import pytest

from tests.support import REPO_ROOT
from tests.support.mpi_utils import child_env, run_child_command, world

pytestmark = [pytest.mark.mpi(min_size=1),
              pytest.mark.skipif(world().Get_size() != 1, reason="runs the scripts; in the 1-rank job only")]


@pytest.mark.parametrize("script", ["setup.sh", "bench.sh", "test.sh"])
def test_scripts_print_their_usage_on_help(script):
    """``--help`` prints the script's header comment and exits 0; nothing else runs."""
    path = os.path.join(REPO_ROOT, "scripts", script)
    rc, out = run_child_command(["bash", path, "--help"], REPO_ROOT, child_env(REPO_ROOT), 60)
    with open(path) as f:
        first = f.read().splitlines()[1].lstrip("# ").strip()
    assert rc == 0 and out.splitlines()[0].strip() == first, out[-2000:]
    assert "setup:" not in out and "=== pytest" not in out and "[normal]" not in out, out[-2000:]
