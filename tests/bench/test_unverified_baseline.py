"""A baseline that fails its verification takes part in no ratio or verdict (``bench.schema``).

The benchmarks time peer pipelines beside the library and report ratios against them. A peer that returns
wrong results (here: zeros, and faster than everything) must be left out of every ratio, summary speed-up
and target verdict, and both the printed output and the JSON document must say so.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile

import pytest

from bench.timing import Timing
from tests.support.mpi_utils import world

ONE_RANK = pytest.mark.skipif(world().Get_size() != 1, reason="runs the benchmark in this process, at 1 rank")
ARGV = ["--num-tokens", "32", "--hidden", "256", "--num-experts", "8", "--num-topk", "2", "--iters", "2",
        "--warmup", "1", "--no-progress"]


def _broken(run):
    """``run`` (a peer pipeline's round trip) returning zeros, 100 times faster than it measured."""

    def wrapped(*args, **kwargs):
        res = run(*args, **kwargs)
        fast = {k: Timing([t / 100 for t in v.times]) for k, v in res.timings.items()}
        return dataclasses.replace(res, timings=fast, combined_x=res.combined_x.zero_())

    return wrapped


@pytest.fixture
def out_dir():
    d = tempfile.mkdtemp(prefix="bench_unverified_test_")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _check_excluded(doc: dict, bad: str, reported: list) -> None:
    """``bad`` is excluded everywhere in ``doc``; ``reported``: the systems that stay."""
    from bench import schema

    schema.validate(doc)
    assert doc["checks"]["ok"] is False
    assert bad in doc["summary"]["excluded"] and "combined_x differs" in doc["summary"]["excluded"][bad]
    for r in doc["results"]:
        if r["system"] == bad:
            assert r["verified"] is False and "ratio_to" not in r, r
        else:
            assert "verified" not in r and not [o for o in r.get("ratio_to", {}) if o.startswith(bad + "/")], r
    assert doc["summary"].get("faster_peer") != bad
    assert not [k for k in doc["summary"].get("round_trip_over_roofline", {}) if k == bad]
    assert all(f"{s}/round_trip" in {r["name"] for r in doc["results"]} for s in reported)


def _run_with_broken_mpi(module, argv, out_dir, monkeypatch, capsys) -> tuple[dict, str]:
    """Run the benchmark ``module`` with its MPI pipeline returning zeros (fast); its exit code must be 1.
    Returns the JSON document and the printed output."""
    monkeypatch.setattr(module, "mpi_alltoallv_roundtrip", _broken(module.mpi_alltoallv_roundtrip))
    path = os.path.join(out_dir, f"{module.__name__}.json")
    rc = module.main(ARGV + argv + ["--json", path])
    out = capsys.readouterr().out
    assert rc == 1, out
    with open(path) as f:
        return json.load(f), out


@pytest.mark.mpi(min_size=1)
@pytest.mark.watchdog(300)
@ONE_RANK
def test_normal_leaves_out_a_baseline_returning_zeros(out_dir, monkeypatch, capsys):
    import bench.normal as normal

    doc, out = _run_with_broken_mpi(normal, ["--systems", "deepep_ascend,mpi,roofline"], out_dir, monkeypatch, capsys)
    _check_excluded(doc, "mpi_alltoallv", ["deepep_ascend"])
    s = doc["summary"]
    assert "speedup_over_faster_peer" not in s and "faster_peer" not in s  # the only peer is excluded
    assert set(s["round_trip_over_roofline"]) == {"deepep_ascend"}
    assert "mpi_alltoallv EXCLUDED from every ratio and verdict" in out and "speedup over" not in out
    assert "mpi_alltoallv vs reference (x once per distinct rank): MISMATCH" in out


@pytest.mark.mpi(min_size=1)
@pytest.mark.watchdog(300)
@ONE_RANK
def test_ep_leaves_out_a_baseline_returning_zeros(out_dir, monkeypatch, capsys):
    import bench.ep as ep

    doc, out = _run_with_broken_mpi(ep, ["--systems", "ep,v1,mpi"], out_dir, monkeypatch, capsys)
    _check_excluded(doc, "mpi_alltoallv", ["epbuffer", "buffer_v1"])
    s = doc["summary"]
    assert "speedup_over_faster_peer" not in s and "epbuffer_over_buffer_v1" in s
    assert "mpi_alltoallv EXCLUDED from every ratio and verdict" in out and "speedup over" not in out


def test_schema_refuses_a_ratio_to_an_unverified_system():
    """The schema itself refuses a document relating a system that failed its verification."""
    from bench import schema

    recs = [schema.result("a/round_trip", 1.0), schema.result("b/round_trip", 0.5)]
    schema.add_ratios(recs, "a/round_trip", ["b/round_trip"])
    doc = schema.document("normal", argv=[], params={"num_ranks": 1}, results=recs, checks={"ok": False},
                          baselines=["b/round_trip"], mpi=False, failed={"b": "returned zeros"})
    schema.validate(doc)
    assert doc["summary"]["excluded"] == {"b": "returned zeros"}
    assert "ratio_to" not in doc["results"][0] and doc["results"][1]["verified"] is False
    bad = dict(doc, results=[dict(doc["results"][0], ratio_to={"b/round_trip": 2.0}), doc["results"][1]])
    with pytest.raises(ValueError, match="failed its verification"):
        schema.validate(bad)
    assert schema.trusted({"a": 1, "b": 2, "b/round_trip": 3}, {"b": "x"}) == {"a": 1}
