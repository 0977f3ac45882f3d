"""CI keeps the real-text training script working: ``scripts/train_moe.py`` for a few steps.

Runs in the 1-rank job only: it launches ``mpiexec -n 4 python scripts/train_moe.py`` on the
standard library's sources with a tiny model, writes its JSON log and a routing trace, and checks
that the job exits cleanly, logs finite losses for every step, and that the trace loads with the
benchmark's loader (``bench.routing.load_routing``). The ``--resume`` refusals' checks are unit tests
(no MPI): finding the checkpoint, and the reasons a loaded checkpoint is refused.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import sys
import tempfile

import pytest

from tests.support import REPO_ROOT
from tests.support.mpi_utils import run_child_job, world

REPO = REPO_ROOT


@pytest.mark.mpi(min_size=1)
@pytest.mark.skipif(world().Get_size() != 1, reason="launches its own mpiexec; runs in the 1-rank job only")
@pytest.mark.parametrize("moe_mode,ranks_per_node", [("normal", 4), ("normal", 2), ("expanded", 4)],
                         ids=["normal", "normal_two_nodes", "expanded"])
def test_train_script_runs_a_few_steps_on_stdlib_text(moe_mode, ranks_per_node):
    """A few steps on real text, over a V1 ``Buffer`` (normal mode; on one node and on two simulated nodes,
    whose internode path needs the URMA window too) and over an ``EPBuffer`` (expanded layout)."""
    out_dir = tempfile.mkdtemp(prefix="train_moe_ci_")
    log, trace = os.path.join(out_dir, "log.json"), os.path.join(out_dir, "trace.npz")
    rc, out = run_child_job(4, [sys.executable, os.path.join(REPO, "scripts", "train_moe.py"), "--steps", "4",
                                "--batch", "2", "--seq", "64", "--d-model", "32", "--layers", "1", "--experts", "8",
                                "--data-mb", "1", "--log-every", "1", "--no-progress", "--log-json", log,
                                "--save-trace", trace, "--moe-mode", moe_mode], REPO, timeout_s=240.0,
                            DEEPEP_ASCEND_TIMEOUT_S="60", DEEPEP_ASCEND_RANKS_PER_NODE=str(ranks_per_node))
    try:
        assert rc == 0, f"train_moe.py exited {rc}:\n{out[-4000:]}"
        assert "mean of first 2 " in out and ", last 2 " in out, out[-2000:]  # 4 steps: two windows apart
        with open(log) as f:
            doc = json.load(f)
        _check(doc, trace)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


def _check(doc, trace):
    losses = doc["losses"]
    assert len(losses) == 4 and all(math.isfinite(v) for v in losses), f"losses per step: {losses}"
    assert doc["steps"] == 4 and math.isfinite(doc["val_loss"]), doc
    from bench.routing import load_routing

    idx, _, meta = load_routing(trace, 0, 4)
    assert idx.dim() == 2 and meta["num_experts"] == 8, meta


def _train_module():
    spec = importlib.util.spec_from_file_location("train_moe", os.path.join(REPO, "scripts", "train_moe.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_resume_refusals(capsys):
    tm = _train_module()
    root = tempfile.mkdtemp(prefix="train_moe_resume_")
    try:
        missing = os.path.join(root, "nonexistent")
        for path, needle in ((missing, f"--resume {missing}: no such file or directory"),
                             (root, f"--resume {root}: no checkpoint there")):
            with pytest.raises(SystemExit) as e:  # in parse_args: every rank exits 2 before any communication
                tm.parse_args(["--resume", path])
            assert e.value.code == 2 and needle in capsys.readouterr().err, path
        step = os.path.join(root, "step000020")
        os.makedirs(step)
        open(os.path.join(step, "dense.pt"), "wb").close()
        with open(os.path.join(root, "latest"), "w") as f:
            f.write("step000020\n")
        assert tm.checkpoint_dir(root) == step and tm.checkpoint_dir(step) == step
    finally:
        shutil.rmtree(root, ignore_errors=True)

    args = dict(d_model=32, topk=2)
    dense = dict(step=20, steps=20, model_args=args)
    ok = tm.checkpoint_mismatch("ck", dense, dict(step=20, ep_size=4), "experts_ep1.pt", args, 4)
    assert ok is None
    why = tm.checkpoint_mismatch("ck", dense, dict(step=20, ep_size=4), "experts_ep1.pt", args, 2)
    assert "saved at step 20 of a 20-step run with EP size 4; this run has EP size 2" in why, why
    why = tm.checkpoint_mismatch("ck", dict(dense, step=30), dict(step=20, ep_size=4), "experts_ep1.pt", args, 4)
    assert "dense.pt was saved at step 30 but experts_ep1.pt at step 20" in why, why
    why = tm.checkpoint_mismatch("ck", dense, dict(step=20, ep_size=4), "experts_ep1.pt", dict(args, topk=3), 4)
    assert "model arguments differ" in why and "'topk': (2, 3)" in why, why
