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
        "--warmup", "1", "--warmup-s", "0", "--no-progress"]


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


def _excluded_everywhere(doc: dict, bad: str, why: str) -> None:
    """``bad`` (and only it) failed its verification for ``why`` and takes part in no ratio of ``doc``."""
    from bench import schema

    schema.validate(doc)
    assert doc["checks"]["ok"] is False
    assert list(doc["summary"]["excluded"]) == [bad] and why in doc["summary"]["excluded"][bad]
    for r in doc["results"]:
        if r["system"] == bad:
            assert r["verified"] is False and "ratio_to" not in r, r
        else:
            assert "verified" not in r and not [o for o in r.get("ratio_to", {}) if o.startswith(bad + "/")], r


def _check_excluded(doc: dict, bad: str, reported: list) -> None:
    """``bad`` is excluded everywhere in ``doc``; ``reported``: the systems that stay."""
    _excluded_everywhere(doc, bad, "combined_x differs")
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


class _Zeroed:
    """An engram peer pipeline whose fetched rows come back as zeros."""

    def __init__(self, pipe):
        self.pipe, self.name, self.close = pipe, pipe.name, pipe.close

    def __call__(self, indices, entries):
        self.pipe(indices, entries)
        self.out = [(d.zero_(), s) for d, s in self.pipe.out]


def _break_pp(monkeypatch, pp):
    """The MPI ring step receiving zeros (at 1 rank gloo, which cannot send to itself, is not run)."""
    real = pp._mpi_step

    def step(*args):
        s = real(*args)
        recv = s.recv
        s.recv = lambda outs: (recv(outs), [o.zero_() for o in outs])
        return s

    monkeypatch.setattr(pp, "_mpi_step", step)
    return "mpi_isend", "received tensor(s) differ", {}


def _break_bucket(monkeypatch, bucket):
    """gloo's all_reduce leaving zeros; MPI stays the verified peer."""
    import torch.distributed as dist

    monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: t.zero_())
    return "gloo", "all_reduce on 1 rank(s)", {f"speedup_over_faster_peer_{op}": (f"mpi/{op.removesuffix('_bf16')}",
                                                                                   f"bucket/{op}")
                                               for op in ("all_gather", "reduce_scatter", "reduce_scatter_bf16",
                                                          "all_reduce")}


def _break_engram(monkeypatch, engram):
    """The gloo pipeline fetching zeros; MPI stays the verified peer."""
    real = engram._gloo_pipeline
    monkeypatch.setattr(engram, "_gloo_pipeline", lambda *a: _Zeroed(real(*a)))
    return "gloo_all_to_all", "fetched data or scales differ", {
        "speedup_over_faster_peer": ("mpi_alltoallv/fetch", "engram/fetch")}


@pytest.mark.mpi(min_size=1)
@pytest.mark.watchdog(300)
@ONE_RANK
@pytest.mark.parametrize("command, argv, breaker", [
    ("pp", ["--num-tokens", "8", "--hidden", "64", "--num-max-inflight-tensors", "2"], _break_pp),
    ("bucket", ["--num-bytes", "4096"], _break_bucket),
    ("engram", ["--num-entries-per-layer", "64,65", "--num-tokens", "8", "--num-entries-per-token", "4", "--hidden",
                "128", "--use-fp8"], _break_engram),
])
def test_peer_returning_zeros_is_left_out(command, argv, breaker, out_dir, monkeypatch, capsys):
    """pp, bucket and engram verify their peers too: one returning zeros fails the run, is named EXCLUDED and
    takes part in no ratio; the summary's speed-ups are over the verified peer only."""
    import importlib

    import bench.timing

    module = importlib.import_module(f"bench.{command}")
    bad, why, ratios = breaker(monkeypatch, module)
    # the full collection before each timed block (0.2 s in a pytest process) is beside the point here
    monkeypatch.setattr(bench.timing.gc, "collect", lambda *a, **k: 0)
    path = os.path.join(out_dir, f"{command}.json")
    rc = module.main(argv + ["--iters", "1", "--warmup", "0", "--warmup-s", "0", "--json", path])
    out = capsys.readouterr().out
    assert rc == 1, out
    with open(path) as f:
        doc = json.load(f)
    _excluded_everywhere(doc, bad, why)
    assert f"{bad} EXCLUDED from every ratio and verdict" in out, out
    by = {r["name"]: r for r in doc["results"]}
    speedups = {k: v for k, v in doc["summary"].items() if k != "excluded"}
    assert set(speedups) == set(ratios), speedups  # pp: its only peer at 1 rank failed, so no speed-up at all
    for key, (peer, subject) in ratios.items():
        assert speedups[key] == pytest.approx(by[peer]["seconds"] / by[subject]["seconds"], rel=1e-12)


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
