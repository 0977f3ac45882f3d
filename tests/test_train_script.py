"""CI keeps the real-text training script working: ``scripts/train_moe.py`` for a few steps (issue 6).

Runs in the 1-rank job only: it launches ``mpiexec -n 4 python scripts/train_moe.py`` on the
standard library's sources with a tiny model, writes its JSON log and a routing trace, and checks
that the job exits cleanly, logs finite losses for every step, and that the trace loads with the
benchmark's loader (``bench.common.load_routing``).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import tempfile

import pytest
from mpi_utils import run_child_job, world

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


@pytest.mark.mpi(min_size=1)
@pytest.mark.skipif(world().Get_size() != 1, reason="launches its own mpiexec; runs in the 1-rank job only")
def test_train_script_runs_a_few_steps_on_stdlib_text():
    out_dir = tempfile.mkdtemp(prefix="train_moe_ci_")
    log, trace = os.path.join(out_dir, "log.json"), os.path.join(out_dir, "trace.npz")
    rc, out = run_child_job(4, [sys.executable, os.path.join(REPO, "scripts", "train_moe.py"), "--steps", "4",
                                "--batch", "2", "--seq", "64", "--d-model", "32", "--layers", "1", "--experts", "8",
                                "--data-mb", "1", "--log-every", "1", "--no-progress", "--log-json", log,
                                "--save-trace", trace], REPO, timeout_s=240.0, DEEPEP_ASCEND_TIMEOUT_S="60")
    try:
        assert rc == 0, f"train_moe.py exited {rc}:\n{out[-4000:]}"
        with open(log) as f:
            doc = json.load(f)
        _check(doc, trace)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


def _check(doc, trace):
    losses = doc["losses"]
    assert len(losses) == 4 and all(math.isfinite(v) for v in losses), f"losses per step: {losses}"
    assert doc["steps"] == 4 and math.isfinite(doc["val_loss"]), doc
    from bench.common import load_routing

    idx, _, meta = load_routing(trace, 0, 4)
    assert idx.dim() == 2 and meta["num_experts"] == 8, meta
