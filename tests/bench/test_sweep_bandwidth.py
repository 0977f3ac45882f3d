"""``scripts/sweep_bandwidth.py``: the two-point preset end to end, resume, and its row logic.

The end-to-end test runs in the 1-rank job only: the script launches its own ``mpiexec -n 2``
benchmark jobs. It checks the CSV, the JSON and the PNGs, that the numbers are real and
consistent (GB/s = bytes / time with ``bench.formulas.gbps``), and that a second run with the same
``--out`` skips both configurations (asserted on the script's own count, never on time).
The other tests exercise keys, resume, CSV/JSON writing, the CLI, the low-latency and MegaMoE
row extraction (from JSON recorded from the benchmarks, trimmed, as ``deepep_ascend.bench/1``
documents) and the plots, without MPI.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.support import REPO_ROOT
from tests.support.mpi_utils import child_env, world

REPO = REPO_ROOT
SCRIPT = os.path.join(REPO, "scripts", "sweep_bandwidth.py")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _module():
    spec = importlib.util.spec_from_file_location("sweep_bandwidth", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("sweep_bandwidth", mod)
    spec.loader.exec_module(mod)
    return mod


def _run_sweep(args, timeout_s=240.0):
    """Run the script as a user would (outside our MPI job); SIGTERM then SIGKILL on timeout."""
    proc = subprocess.Popen([sys.executable, SCRIPT, *args], cwd=REPO, env=child_env(REPO), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the script kills its running benchmark job on SIGTERM
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        out += f"\n[test] killed the sweep after {timeout_s} s"
    return proc.returncode, out


@pytest.fixture
def out_tmp():
    """A private temporary directory (not pytest's tmp_path: concurrent ranks race on its cleanup)."""
    d = tempfile.mkdtemp(prefix="sweep_bw_test_")
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


def _f(v) -> float:
    return float(v) if v not in ("", None) else float("nan")


@pytest.mark.mpi(min_size=1)
@pytest.mark.watchdog(420)
@pytest.mark.skipif(world().Get_size() != 1, reason="launches its own mpiexec; runs in the 1-rank job only")
def test_smoke_preset_end_to_end_then_resumes(out_tmp):
    from bench.formulas import gbps

    out_dir = out_tmp / "sweep"
    rc, log = _run_sweep(["--preset", "smoke", "--out", str(out_dir)])
    assert rc == 0, f"sweep exited {rc}:\n{log[-4000:]}"

    with open(out_dir / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2, rows
    assert sorted(int(r["tokens"]) for r in rows) == [64, 128]
    for r in rows:
        assert r["status"] == "ok" and not r["error"], r
        assert r["mode"] == "normal" and r["ranks"] == "2" and r["hidden"] == "256", r
        assert re.fullmatch(r"[0-9a-f]{12}", r["fingerprint"]), r["fingerprint"]
        assert r["version"] and r["hostname"] and r["timestamp"] and r["checks_ok"] == "True", r
        for phase in ("dispatch", "combine"):
            t, nbytes, bw = _f(r[f"{phase}_s"]), _f(r[f"{phase}_bytes"]), _f(r[f"{phase}_gbps"])
            assert t > 0 and nbytes > 0 and bw > 0, (phase, r)
            # V1 bottleneck bytes of this workload: N_recv * 2 * hidden, a whole number of rows
            assert nbytes % (2 * 256) == 0, nbytes
            assert math.isclose(bw, gbps(nbytes, t), rel_tol=1e-9), (phase, bw, nbytes, t)
            for kind in ("SELF", "UBMEM"):
                kb, kg = _f(r[f"{phase}_{kind}_bytes"]), _f(r[f"{phase}_{kind}_gbps"])
                assert kb > 0 and math.isclose(kg, gbps(kb, t), rel_tol=1e-9), (phase, kind, r)
            assert _f(r[f"{phase}_URMA_bytes"]) == 0  # one node: nothing crosses URMA
            if r["proj_profile"]:  # the benchmark's projection: formula bytes over the projected time
                pt, pb = _f(r[f"proj_{phase}_s"]), _f(r[f"proj_{phase}_formula_bytes"])
                assert pt > 0 and pb == nbytes, (phase, r)
                assert math.isclose(_f(r[f"proj_{phase}_gbps"]), gbps(pb, pt), rel_tol=1e-6), (phase, r)
        assert _f(r["round_trip_s"]) > 0
        for peer in ("mpi_alltoallv", "gloo_all_to_all"):
            assert _f(r[f"{peer}_round_trip_s"]) > 0 and _f(r[f"{peer}_dispatch_gbps"]) > 0, (peer, r)

    with open(out_dir / "results.json") as f:
        doc = json.load(f)
    assert [r["config_key"] for r in doc["rows"]] == [r["config_key"] for r in rows]
    assert doc["columns"] == list(rows[0].keys())
    for jr, cr in zip(doc["rows"], rows):
        assert jr["status"] == "ok" and jr["fingerprint"] == cr["fingerprint"]
        assert jr["dispatch_s"] == float(cr["dispatch_s"]) and jr["dispatch_bytes"] == int(cr["dispatch_bytes"])

    for name in ("gbps_vs_size.png", "peers.png", "projected_vs_measured.png"):
        data = (out_dir / name).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 10_000, (name, len(data))
    assert len(os.listdir(out_dir / "logs")) == 2

    rc, log2 = _run_sweep(["--preset", "smoke", "--out", str(out_dir)])
    assert rc == 0, f"resumed sweep exited {rc}:\n{log2[-4000:]}"
    assert "ran 0 (ok 0, failed 0), skipped 2 already ok" in log2, log2[-2000:]
    with open(out_dir / "results.json") as f:
        assert json.load(f)["rows"] == doc["rows"]  # nothing re-measured


# ------------------------------------------------------------------------------------------------
# Without MPI: keys, resume, CSV/JSON, CLI
# ------------------------------------------------------------------------------------------------


def _fake_normal_doc(t_d=0.002, t_c=0.004, n_bytes=51200):
    """A normal-mode document as the command builds it (``bench.normal.result_records``) from per-system
    reports: two ranks, the busiest one first."""
    from types import SimpleNamespace

    from bench.normal import result_records
    from bench.timing import Timing

    phase = lambda t: dict(  # noqa: E731
        median_s=t, bottleneck_bytes_per_rank=[n_bytes, n_bytes // 2], bottleneck_rank=0,
        bottleneck_gbps=n_bytes / 1e9 / t, logical_gbps=1.0,
        sent_by_kind={"SELF": dict(bytes_per_rank=[100, 50], max_bytes=100, max_gbps=100 / 1e9 / t),
                      "UBMEM": dict(bytes_per_rank=[300, 400], max_bytes=400, max_gbps=400 / 1e9 / t),
                      "URMA": dict(bytes_per_rank=[0, 0], max_bytes=0, max_gbps=0.0)})

    def system(t_dispatch, t_combine):
        d, c = Timing([t_dispatch]), Timing([t_combine])
        return SimpleNamespace(timings=dict(layout=Timing([1e-4]), dispatch=d, combine=c, round_trip=d + c))

    results = dict(deepep_ascend=system(t_d, t_c), mpi_alltoallv=system(0.005, 0.005))
    reports = dict(deepep_ascend=dict(phases=dict(dispatch=phase(t_d), combine=phase(t_c))),
                   mpi_alltoallv=dict(phases=dict(dispatch=phase(0.005), combine=phase(0.005))))
    records, baselines = result_records(results, reports, None, None, None)
    return dict(schema="deepep_ascend.bench/1", command="normal", fingerprint="0123456789ab", results=records,
                baselines=baselines, checks=dict(ok=True), summary=dict(speedup_over_faster_peer=1.5),
                link_model=None, projection=None)


def test_keys_resume_and_result_files(out_tmp):
    tmp_path = out_tmp
    sw = _module()
    a, _ = sw.parse_args(["--preset", "smoke", "--out", str(tmp_path)])
    assert len(a.configs) == 2 and len({c.key for c in a.configs}) == 2
    again, _ = sw.parse_args(["--preset", "smoke", "--out", str(tmp_path)])
    assert [c.key for c in again.configs] == [c.key for c in a.configs]  # stable across invocations
    c0, c1 = a.configs
    assert c0.key == "normal-R2-1node-T64-H256-K2-E8-bf16-it3w1ws0.25-s0-proj_ascend950"
    prov = dict(version="0.1.0", git_commit="abc", hostname="h")

    ok = sw.make_row(c0, _fake_normal_doc(), 0, "", 1.0, prov)
    assert ok["status"] == "ok" and ok["dispatch_bytes"] == 51200 and ok["fingerprint"] == "0123456789ab"
    # per-kind round-trip rate: busiest rank's dispatch + combine bytes over the round trip
    assert math.isclose(ok["rt_UBMEM_gbps"], 800 / 1e9 / 0.006) and math.isclose(ok["rt_SELF_gbps"], 200 / 1e9 / 0.006)
    assert ok["proj_profile"] is None  # no projection block: empty columns, not an error
    bad = sw.make_row(c1, None, None, "timeout after 5 s (process group killed)", 5.0, prov)
    assert bad["status"] == "failed" and "timeout" in bad["error"]
    nan_row = dict(ok, config_key="x", dispatch_gbps=float("nan"))

    rows = sw.merge_row(sw.merge_row(sw.merge_row([], ok), bad), nan_row)
    sw.write_results(str(tmp_path), rows)
    assert sw.load_results(str(tmp_path)) == [dict(r, dispatch_gbps=None) if r is nan_row else r for r in rows]
    assert sw.done_keys(sw.load_results(str(tmp_path))) == {c0.key, "x"}  # the failed row reruns
    with open(tmp_path / "results.csv", newline="") as f:
        got = list(csv.reader(f))
    assert got[0] == list(sw.COLUMNS) and len(got) == 4
    assert got[3][got[0].index("dispatch_gbps")] == ""  # NaN → empty cell

    # a rerun's row replaces the old one in place
    fixed = dict(bad, status="ok", error=None)
    merged = sw.merge_row(rows, fixed)
    assert [r["config_key"] for r in merged] == [r["config_key"] for r in rows] and merged[1]["status"] == "ok"

    # emulation without --link-scale runs at the benchmarks' default scale, and is keyed by its value:
    # an explicit --link-scale of that value is the same configuration (resume skips it)
    from bench.cli import add_link_args

    q = argparse.ArgumentParser()
    add_link_args(q)
    assert sw.DEFAULT_LINK_SCALE == q.get_default("link_scale") == 1e-3
    emu = ["--preset", "smoke", "--out", str(tmp_path), "--link-emulation", "delay"]
    by_default = [c.key for c in sw.parse_args(emu)[0].configs]
    assert by_default == [c.key for c in sw.parse_args(emu + ["--link-scale", "1e-3"])[0].configs]
    assert by_default == [k + "-emu_delayx0.001" for k in (c0.key, c1.key)]
    assert by_default != [c.key for c in sw.parse_args(emu + ["--link-scale", "2e-3"])[0].configs]


def test_cli_axes_override_and_errors(capsys):
    sw = _module()
    a, _ = sw.parse_args(["--preset", "small", "--out", "d", "--mode", "low_latency", "--num-tokens", "64,1024",
                          "--ranks", "2,4", "--ranks-per-node", "none,2,4", "--fp8", "--hidden", "512"])
    keys = {c.key for c in a.configs}
    # tokens 1024 > 511 is not a low-latency size; rpn 4 does not fit 2 ranks and is one node at 4
    assert all(c.mode == "low_latency" and c.tokens == 64 and c.dtype == "fp8" for c in a.configs)
    assert len(keys) == 3 and {(c.ranks, c.ranks_per_node) for c in a.configs} == {(2, None), (4, None), (4, 2)}
    assert a.overridden == ["--num-tokens", "--hidden", "--ranks", "--ranks-per-node", "--dtype", "--mode"]  # (--fp8)
    settings = sw.parse_args(["--preset", "small", "--dry-run", "--iters", "3", "--warmup", "0", "--seed", "5",
                              "--no-peers", "--warmup-s", "0.5"])[0]
    assert settings.overridden == ["--iters", "--warmup", "--warmup-s", "--seed", "--no-peers"]
    assert sw.parse_args(["--preset", "small", "--out", "d"])[0].overridden == []
    ll = next(c for c in a.configs if c.ranks_per_node == 2)
    argv = ll.bench_args("f.json", {"--no-progress", "--link-profile"})
    assert "--bf16" not in argv and argv[argv.index("--ranks-per-node") + 1] == "2"
    assert argv[argv.index("--link-profile") + 1] == "ascend950"
    normal = sw.Config("normal", 2, None, 64, 256, 2, 8, "fp8", 1, 0, link_profile=None)
    assert "--fp8" in normal.bench_args("f", set()) and "--link-profile" not in normal.bench_args("f", set())
    assert normal.bench_args("f", {"--link-profile"})[-2:] == ["--link-profile", "none"]

    for argv, needle in ((["--num-tokens", "64,x"], "--num-tokens"), (["--ranks", "0"], "--ranks"),
                         (["--inter", "128"], "--inter"), (["--mode", "decode"], "--mode"),
                         (["--num-experts", "6", "--ranks", "4"], "no valid configuration"),
                         (["--iters", "0"], "--iters"), (["--dtype", "fp4"], "--dtype"),
                         # link profiles are checked here, as the benchmarks check them, not per failed job
                         (["--link-profile", "garbage"], "--link-profile: link profile 'garbage'"),
                         (["--link-profile", "UBMEM=abc"], "--link-profile: link profile 'UBMEM=abc'"),
                         (["--link-emulation", "delay", "--link-scale", "0"], "--link-scale"),
                         (["--link-emulation", "delay", "--link-scale", "inf"], "--link-scale")):
        with pytest.raises(SystemExit) as e:
            sw.parse_args(["--preset", "smoke", "--out", "d", *argv])
        assert e.value.code == 2
        assert needle in capsys.readouterr().err, argv
    with pytest.raises(SystemExit):
        sw.parse_args(["--preset", "smoke"])  # --out is required unless --dry-run
    assert "--out" in capsys.readouterr().err
    with tempfile.NamedTemporaryFile() as f:  # --out an existing file (or under one): an error, not a traceback
        for out, needle in ((f.name, "exists and is not a directory"), (os.path.join(f.name, "sub"),
                                                                         f"{f.name} is not a directory")):
            with pytest.raises(SystemExit) as e:
                sw.parse_args(["--preset", "smoke", "--out", out, "--dry-run"])
            assert e.value.code == 2 and needle in capsys.readouterr().err, out


def test_main_console_lines_and_exit_status(out_tmp, monkeypatch, capsys):
    """``main`` with the benchmark job faked (no MPI): emulated ``[ok]`` lines say EMULATED; a run
    whose configurations all failed exits non-zero."""
    sw = _module()
    monkeypatch.setattr(sw, "bench_options", lambda module, env: {"--json", "--no-progress", "--link-profile",
                                                                  "--link-emulation", "--link-scale"})
    monkeypatch.setattr(sw, "find_mpiexec", lambda: "mpiexec")
    monkeypatch.setattr(sw, "make_plots", lambda out_dir, rows: [])
    monkeypatch.setattr(sw.signal, "signal", lambda *a: None)  # leave the test process's SIGTERM alone
    emulated = dict(_fake_normal_doc(), link_model=dict(emulation="delay", profile="ascend950", scale=1e-3,
                                                        label="SIMULATION: ..."))
    monkeypatch.setattr(sw, "run_config", lambda cfg, *a: (emulated, 0, "", 1.0))
    assert sw.main(["--preset", "smoke", "--out", str(out_tmp / "emu"), "--link-emulation", "delay"]) == 0
    ok = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("[ok]")]
    assert len(ok) == 2 and all(": EMULATED links (ascend950 x 0.001) | dispatch" in ln for ln in ok), ok
    monkeypatch.setattr(sw, "run_config", lambda cfg, *a: (None, 2, "exit 2, no JSON result", 1.0))
    assert sw.main(["--preset", "smoke", "--out", str(out_tmp / "failed")]) == 1
    out = capsys.readouterr().out
    assert "ran 2 (ok 0, failed 2)" in out and "[sweep] preset smoke: 2 configurations" in out
    assert sw.main(["--preset", "smoke", "--out", str(out_tmp / "given"), "--num-tokens", "64"]) == 1
    assert "[sweep] preset smoke with --num-tokens given: 1 configurations" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------
# Row extraction from recorded benchmark JSON (trimmed; no MPI)
# ------------------------------------------------------------------------------------------------

# Both recorded without emulation, projected on ascend950 (its links; their sources trimmed).
LINK_MODEL = {"emulation": "none", "profile": "ascend950", "scale": None,
              "label": "measured on this host, links not emulated"}
ASCEND950_LINKS = {"SELF": {"GBps": 4000.0, "latency_us": 0.0}, "UBMEM": {"GBps": 400.0, "latency_us": 1.0},
                   "URMA": {"GBps": 400.0, "latency_us": 2.0}}


def _proj_phase(time_s, bottleneck, bottleneck_gbps, formula_bytes, formula_gbps):
    """One phase of a benchmark's ``projection`` (``bottleneck``: rank, kind, direction, bytes; no ports)."""
    return {"time_s": time_s, "bottleneck": dict(zip(("rank", "kind", "direction", "bytes"), bottleneck)),
            "bottleneck_GBps": bottleneck_gbps, "formula_bytes": formula_bytes, "formula_GBps": formula_gbps}


# `mpiexec -n 2 python -m bench mega-moe --preset tiny --iters 2 --warmup 1 --json F`, trimmed
# (no per-rank timings, lines, ports or link sources; of the results the ones the sweep reads).
_MM_TIMES = {"fused": 0.3037249730014082, "serial": 0.2610372107501462, "unfused": 0.15859239174915274,
             "sum_stages": 0.11654729424935795, "comm_stages": 0.0648562744991068}
_MM_BW = {"bytes_with_self": 399360.0, "bytes_cross_rank": 197730.0, "fused_with_self": 0.001314873769033633,
          "fused_cross_rank": 0.0006510166024414569, "unfused_comm_stages": 0.006157615482608394}
_MM_TFLOPS = {"fused_routed": 0.0003314291051053391, "grouped_stages": 0.003935062569785125,
              "plain_mm": 0.009270953414415093}
_MM_TRAFFIC = [{"SELF": 208820, "UBMEM": 198224, "URMA": 0}, {"SELF": 198576, "UBMEM": 201292, "URMA": 0}]


def _result(name, seconds, **kw):
    head, _, tail = name.partition("/")
    return dict(dict(name=name, system=head, phase=tail or None, seconds=seconds, bytes=None, formula=None, gbps=None),
                **kw)


MEGA_MOE_DOC = {
    "schema": "deepep_ascend.bench/1", "command": "mega-moe",
    "fingerprint": "2ef8f5bcf8a5",
    "checks": {"fused_equals_serial": True, "calc_diff_vs_unfused": 3.66e-06, "bound": 0.001, "ok": True},
    "results": [
        _result("fused", _MM_TIMES["fused"], bytes=_MM_BW["bytes_with_self"], gbps=_MM_BW["fused_with_self"],
                formula="MegaMoE per pair, with self-rank pairs (mean over ranks)",
                cross_rank_bytes=_MM_BW["bytes_cross_rank"], cross_rank_gbps=_MM_BW["fused_cross_rank"],
                tflops=_MM_TFLOPS["fused_routed"],
                by_kind={k: max(r[k] for r in _MM_TRAFFIC) for k in ("SELF", "UBMEM", "URMA")}),
        _result("serial", _MM_TIMES["serial"]), _result("unfused", _MM_TIMES["unfused"]),
        _result("unfused/sum_stages", _MM_TIMES["sum_stages"]),
        _result("unfused/comm_stages", _MM_TIMES["comm_stages"])],
    "baselines": ["unfused", "unfused/sum_stages", "unfused/comm_stages"],
    "summary": {"fused_over_sum_stages": 2.6060233740954604, "grouped_over_plain_mm": 0.4244506895770427},
    "details": {"times_s": _MM_TIMES, "bandwidth_GBps": _MM_BW, "tflops": _MM_TFLOPS, "traffic_by_kind": _MM_TRAFFIC},
    "link_model": LINK_MODEL,
    "projection": {"profile": "ascend950", "links": ASCEND950_LINKS,
                   "fused": _proj_phase(1.850323e-05, (0, "UBMEM", "sent", 201292), 10.878749277828788, 409500,
                                        22.131271134823486),
                   "round_trip_s": 1.850323e-05},
}

# `mpiexec -n 2 python -m bench low-latency --num-tokens 32 --hidden 512 --num-experts 16 --num-topk 4
#  --iters 2 --no-baselines --json F` (warm-up 3: `calls` 5), trimmed to what the command builds its
# results from (``bench.low_latency.result_records``; the hook, overlap and roofline times were not
# kept: placeholders).
LOW_LATENCY_RAW = {
    "config": {"fingerprint": "e385fdb45416"},
    "check": {"calc_diff": 0.00031407832797358815, "bound": 0.0009, "ok": True},
    "bytes": {"dispatch_per_rank": [69632, 69632], "combine_per_rank": [131072, 131072], "calls": 5,
              "moved_by_kind_per_rank": [{"SELF": 533600, "UBMEM": 496480, "URMA": 0},
                                         {"SELF": 494400, "UBMEM": 484480, "URMA": 0}]},
    "ll": {"dispatch": {"median_s": 0.030541479000021354}, "combine": {"median_s": 0.039934811500643264},
           "round_trip": {"median_s": 0.07047629050066462}},
    "bandwidth_GBps": {"dispatch": 0.002279915782727854, "combine": 0.0032821489591327788,
                       "per_kind": {"SELF": 0.0015142681211207276, "UBMEM": 0.0014089277300862425, "URMA": 0.0}},
    "roofline": {"dispatch_bytes": 69632, "combine_bytes": 131072},
}


def _low_latency_doc(raw):
    """The low-latency document the command writes for ``raw`` (its results from ``result_records``)."""
    from bench.low_latency import result_records
    from bench.timing import Timing

    ll = {k: Timing([v["median_s"]]) for k, v in raw["ll"].items()}
    placeholder = Timing([1e-3])
    hook = dict.fromkeys(("d_send", "d_recv", "c_send", "c_recv"), placeholder)
    records = result_records(raw, ll, hook, dict(dispatch=placeholder, combine=placeholder), placeholder, {},
                             Timing([1e-5]))
    return {"schema": "deepep_ascend.bench/1", "command": "low-latency", "fingerprint": raw["config"]["fingerprint"],
            "results": records, "baselines": ["memcpy_roofline/round_trip"], "checks": raw["check"], "summary": {},
            "details": raw, "link_model": LINK_MODEL,
            "projection": {"profile": "ascend950", "links": ASCEND950_LINKS,
                           "dispatch": _proj_phase(4.08852e-06, (0, "UBMEM", "received", 35408), 8.660346531263148,
                                                   69632, 17.03110171895943),
                           "combine": _proj_phase(4.1665199999999995e-06, (0, "UBMEM", "sent", 66608),
                                                  15.986482724191893, 131072, 31.458387335234207),
                           "round_trip_s": 8.255039999999999e-06}}


LOW_LATENCY_DOC = _low_latency_doc(LOW_LATENCY_RAW)

PROV = dict(version="0.1.0", git_commit="abc", hostname="h")
KINDS = ("SELF", "UBMEM", "URMA")


def _mega_moe_config(sw, tokens=128):
    return sw.Config("mega_moe", 2, None, tokens, 256, 4, 16, "fp8", 2, 1, peers=False, inter=128)


def test_mega_moe_row_from_recorded_json():
    from bench.formulas import gbps

    sw = _module()
    doc = MEGA_MOE_DOC
    cfg = _mega_moe_config(sw)
    assert cfg.key == "mega_moe-R2-1node-T128-H256-I128-K4-E16-fp8xfp4-it2w1ws0.25-s0-proj_ascend950"
    row = sw.make_row(cfg, doc, 0, "", 1.0, PROV)
    assert row["status"] == "ok" and row["error"] is None, row
    assert row["mode"] == "mega_moe" and row["inter"] == 128 and row["dtype"] == "fp8" and row["peers"] is False
    assert row["fingerprint"] == doc["fingerprint"] and row["checks_ok"] is True
    failed = sw.make_row(cfg, dict(doc, checks=dict(doc["checks"], ok=False)), 0, "", 1.0, PROV)
    assert failed["checks_ok"] is False and failed["status"] == "failed", failed
    times, bw = doc["details"]["times_s"], doc["details"]["bandwidth_GBps"]
    for col, key in (("fused_s", "fused"), ("serial_s", "serial"), ("unfused_s", "unfused"),
                     ("sum_stages_s", "sum_stages"), ("comm_stages_s", "comm_stages")):
        assert row[col] == times[key], col
    # GB/s: with self-rank pairs is the main number, cross-rank another column; both bytes / fused time
    assert row["fused_bytes"] == bw["bytes_with_self"] and row["fused_gbps"] == bw["fused_with_self"]
    assert row["fused_cross_rank_bytes"] == bw["bytes_cross_rank"]
    assert row["fused_cross_rank_gbps"] == bw["fused_cross_rank"]
    assert math.isclose(row["fused_gbps"], gbps(row["fused_bytes"], row["fused_s"]), rel_tol=1e-12)
    assert math.isclose(row["fused_cross_rank_gbps"], gbps(row["fused_cross_rank_bytes"], row["fused_s"]),
                        rel_tol=1e-12)
    assert row["fused_tflops"] == doc["details"]["tflops"]["fused_routed"]
    assert row["fused_over_sum_stages"] == doc["summary"]["fused_over_sum_stages"]
    assert row["grouped_over_plain_mm"] == doc["summary"]["grouped_over_plain_mm"]
    # per kind: the busiest rank's bytes of one fused call (SELF: rank 0, UBMEM: rank 1 here) over its time
    assert (row["rt_SELF_bytes"], row["rt_UBMEM_bytes"], row["rt_URMA_bytes"]) == (208820, 201292, 0)
    for k in KINDS:
        assert row[f"rt_{k}_bytes"] == max(r[k] for r in doc["details"]["traffic_by_kind"])
        assert row[f"rt_{k}_gbps"] == gbps(row[f"rt_{k}_bytes"], row["fused_s"]), k
    # projection: phase "fused"
    pf = doc["projection"]["fused"]
    assert row["proj_profile"] == "ascend950" and row["proj_round_trip_s"] == doc["projection"]["round_trip_s"]
    assert row["proj_fused_s"] == pf["time_s"] and row["proj_fused_gbps"] == pf["formula_GBps"]
    assert row["proj_fused_formula_bytes"] == pf["formula_bytes"]
    assert row["proj_fused_bottleneck_link_gbps"] == pf["bottleneck_GBps"]
    assert [row[f"proj_fused_bottleneck_{f}"] for f in ("kind", "direction", "rank", "bytes")] == [
        "UBMEM", "sent", 0, 201292]
    assert math.isclose(row["proj_fused_gbps"], gbps(pf["formula_bytes"], pf["time_s"]), rel_tol=1e-9)
    # the normal / low-latency columns stay empty
    assert all(row[c] is None for c in ("dispatch_s", "combine_s", "round_trip_s", "dispatch_gbps", "proj_dispatch_s",
                                        "mpi_alltoallv_round_trip_s"))
    assert "fused 303.725 ms" in sw.ok_summary(row) and "projected fused 22.1 GB/s" in sw.ok_summary(row)

    no_time = sw.make_row(cfg, dict(doc, results=[r for r in doc["results"] if r["name"] != "fused"]), 0, "", 1.0, PROV)
    assert no_time["status"] == "failed" and "no fused-call time" in no_time["error"]


def test_low_latency_row_uses_the_byte_fields():
    from bench.formulas import gbps

    sw = _module()
    doc = LOW_LATENCY_DOC
    cfg = sw.Config("low_latency", 2, None, 32, 512, 4, 16, "fp8", 2, 3, peers=False)
    row = sw.make_row(cfg, doc, 0, "", 1.0, PROV)
    assert row["status"] == "ok" and row["checks_ok"] is True and row["fingerprint"] == "e385fdb45416"
    raw = doc["details"]
    b = raw["bytes"]
    for p in ("dispatch", "combine"):
        assert row[f"{p}_s"] == raw["ll"][p]["median_s"]
        assert row[f"{p}_bytes"] == max(b[f"{p}_per_rank"])  # the busiest rank, like normal rows
        assert row[f"{p}_gbps"] == gbps(row[f"{p}_bytes"], row[f"{p}_s"])
        assert math.isclose(row[f"{p}_gbps"], raw["bandwidth_GBps"][p], rel_tol=1e-12)  # equal bytes on every rank
        assert row[f"proj_{p}_formula_bytes"] == row[f"{p}_bytes"]
    assert row["round_trip_s"] == raw["ll"]["round_trip"]["median_s"]
    # per kind: the busiest rank's bytes per round trip (moved over `calls` round trips) / the round trip
    assert (row["rt_SELF_bytes"], row["rt_UBMEM_bytes"], row["rt_URMA_bytes"]) == (106720, 99296, 0)
    for k in KINDS:
        assert row[f"rt_{k}_bytes"] == max(r[k] for r in b["moved_by_kind_per_rank"]) / b["calls"]
        assert row[f"rt_{k}_gbps"] == gbps(row[f"rt_{k}_bytes"], row["round_trip_s"])
        assert math.isclose(row[f"rt_{k}_gbps"], raw["bandwidth_GBps"]["per_kind"][k], rel_tol=1e-12)  # rank 0
    # one round trip's bytes = the projection's counted dispatch + combine bytes of the busiest UBMEM sender
    assert row["rt_UBMEM_bytes"] == 32688 + 66608

    # busiest rank, not rank 0: with the ranks swapped and rank 1 heavier, the columns follow the max
    swapped = json.loads(json.dumps(LOW_LATENCY_RAW))
    sb = swapped["bytes"]
    sb["moved_by_kind_per_rank"].reverse()
    sb["dispatch_per_rank"] = [69632, 69632 + 536]
    row2 = sw.make_row(cfg, _low_latency_doc(swapped), 0, "", 1.0, PROV)
    assert row2["dispatch_bytes"] == 69632 + 536
    assert all(row2[f"rt_{k}_bytes"] == row[f"rt_{k}_bytes"] for k in KINDS)


def test_cli_mega_moe_mode():
    sw = _module()
    a, _ = sw.parse_args(["--preset", "small", "--out", "d", "--mode", "mega_moe"])
    assert [c.tokens for c in a.configs] == [64, 128, 256] and not a.invalid
    for c in a.configs:
        assert (c.mode, c.ranks, c.ranks_per_node, c.hidden, c.inter, c.dtype, c.peers) == (
            "mega_moe", 4, None, 256, 128, "fp8", False)
    argv = a.configs[0].bench_args("f.json", {"--no-progress", "--link-profile"})
    opt = {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--")}
    assert (opt["--inter"] == "128" and opt["--mma"] == "fp8" and opt["--num-experts"] == "16"
            and opt["--num-topk"] == "4")
    assert opt["--num-tokens"] == "64" and opt["--link-profile"] == "ascend950" and "--no-progress" in argv
    assert not {"--ranks-per-node", "--bf16", "--fp8", "--no-baselines"} & set(argv)

    # the dtype axis is the MMA type; ranks-per-node and impossible sizes are listed, not run
    a, _ = sw.parse_args(["--preset", "small", "--out", "d", "--mode", "mega_moe,normal", "--num-tokens", "64",
                          "--ranks-per-node", "none,2", "--inter", "128,192", "--dtype", "fp8,bf16"])
    mm = [c for c in a.configs if c.mode == "mega_moe"]
    assert {(c.inter, c.dtype) for c in mm} == {(128, "fp8"), (128, "bf16"), (192, "bf16")}
    assert {c.key.split("-")[8] for c in mm} == {"fp8xfp4", "bf16xbf16"}
    assert all(c.ranks_per_node is None for c in mm) and all(c.inter is None for c in a.configs if c.mode == "normal")
    for c in mm:
        argv = c.bench_args("f", set())
        assert argv[argv.index("--mma") + 1] == c.dtype and argv[argv.index("--inter") + 1] == str(c.inter)
    why = {c.key: w for c, w in a.invalid}
    assert sum("one node only" in w for w in why.values()) == 4  # 2 inter x 2 dtypes at 2x2
    assert any("inter % 128" in w for w in why.values())
    assert len([c for c in a.configs if c.mode == "normal"]) == 4  # 2 dtypes x 2 topologies: unchanged

    # smoke stays two normal points (CI); its mega_moe grid runs only when asked for
    assert [c.mode for c in sw.parse_args(["--preset", "smoke", "--out", "d"])[0].configs] == ["normal", "normal"]
    a, _ = sw.parse_args(["--preset", "smoke", "--out", "d", "--mode", "mega_moe"])
    assert [(c.tokens, c.inter) for c in a.configs] == [(64, 128), (128, 128)]
    for name in sw.PRESETS:  # every preset has a runnable mega_moe grid, nothing in it impossible
        a, _ = sw.parse_args(["--preset", name, "--dry-run", "--mode", "mega_moe"])
        assert a.configs and not a.invalid and all(c.inter for c in a.configs), name


def test_plot_series_split_by_how_rows_were_measured():
    """Rows of one workload measured with another warm-up, iteration count, seed or emulated link scale are
    separate lines, each labelled by the settings that differ; rows measured alike stay one line."""
    from bench.sweep_plots import _series, varying_settings

    sw = _module()

    def row(tokens, t_d, **how):
        cfg = dataclasses.replace(sw.Config("normal", 2, None, tokens, 256, 2, 8, "bf16", 3, 1), **how)
        return sw.make_row(cfg, _fake_normal_doc(t_d=t_d), 0, "", 1.0, PROV)

    alike = [row(64, 0.002), row(128, 0.003)]
    assert varying_settings(alike) == ()
    assert list(_series(alike, "dispatch_s", ()).values()) == [([64, 128], [0.002, 0.003])]
    for how in ({"warmup_s": 0.0}, {"iters": 7}, {"warmup": 0}, {"seed": 5}):
        rows = alike + [row(64, 0.005, **how), row(128, 0.007, **how)]
        (field, value), = how.items()
        assert varying_settings(rows) == (field,)
        series = _series(rows, "dispatch_s", varying_settings(rows))
        assert len(series) == 2, series
        assert series[f"R2 1 node, H256, top-2/8, BF16, {field} {value}"] == ([64, 128], [0.005, 0.007])
    # the link scale slows emulated rows only: it splits those, not the rows measured on real links
    emu = [dict(r, link_emulation="delay", link_scale=scale) for r, scale in zip(alike, (1e-3, 1e-2))]
    assert varying_settings(alike + [dict(r, link_scale=9.0) for r in alike]) == ()
    assert varying_settings(alike + emu) == ("link_scale",)
    labels = sorted(_series(alike + emu, "dispatch_s", ("link_scale",)))
    assert labels == ["R2 1 node, H256, top-2/8, BF16", "R2 1 node, H256, top-2/8, BF16, link_scale 0.001 EMULATED",
                      "R2 1 node, H256, top-2/8, BF16, link_scale 0.01 EMULATED"], labels


@pytest.mark.skipif(world().Get_size() != 1, reason="plotting costs ~10 s; the 1-rank job covers it")
def test_plots_with_mega_moe_rows(out_tmp, monkeypatch):
    pytest.importorskip("matplotlib")
    sw = _module()
    rows = [sw.make_row(_mega_moe_config(sw, t), MEGA_MOE_DOC, 0, "", 1.0, PROV) for t in (64, 128)]
    out = out_tmp / "mm_only"
    out.mkdir()
    names = [os.path.basename(p) for p in sw.make_plots(str(out), rows)]  # mega_moe only: no peers panel to draw
    assert names == ["gbps_vs_size.png", "peers.png", "projected_vs_measured.png"]
    ll = sw.make_row(sw.Config("low_latency", 2, None, 32, 512, 4, 16, "fp8", 2, 3), LOW_LATENCY_DOC, 0, "", 1.0, PROV)
    normal = sw.make_row(sw.Config("normal", 2, None, 64, 256, 2, 8, "bf16", 3, 1), _fake_normal_doc(), 0, "", 1.0,
                         PROV)
    emulated = dict(normal, link_emulation="delay", link_scale=1e-3)
    legends = {}

    from bench import sweep_plots

    save = sweep_plots._save

    def record_and_save(fig, out_dir, name, plt):  # the legends, then the PNG as the script writes it
        legends[name] = [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]
        return save(fig, out_dir, name, plt)

    monkeypatch.setattr(sweep_plots, "_save", record_and_save)
    for p in sw.make_plots(str(out_tmp), rows + [ll, normal, emulated]):
        data = Path(p).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 10_000, p
    # peers.png: only deepep_ascend's links are emulated; the MPI / gloo peers are never labelled EMULATED
    peers = legends["peers.png"]
    assert any(t.startswith("deepep_ascend: ") and t.endswith("BF16 EMULATED") for t in peers), peers
    assert any(t.startswith("mpi_alltoallv: ") for t in peers), peers
    assert not [t for t in peers if "EMULATED" in t and not t.startswith("deepep_ascend: ")], peers
