"""The bandwidth sweep's records and result table (``scripts/sweep_bandwidth.py``).

Every run of the sweep is one benchmark job whose ``--json`` document (schema
``deepep_ascend.bench/1``, :mod:`bench.schema`) is the run's record: the sweep keeps it as
``DIR/records/<config key>.json`` with a ``sweep`` block added (configuration key, status, error,
exit code, wall time, provenance), and turns it into one row of ``results.csv`` /
``results.json`` (``{"columns": [...], "rows": [...]}``, columns :data:`COLUMNS`) with
:func:`measured_fields`, which reads the one schema by result name:

* normal and low-latency rows: ``deepep_ascend/dispatch`` and ``/combine`` (seconds, bytes, GB/s,
  ``logical_gbps``, ``by_kind``), ``deepep_ascend/round_trip`` (seconds, ``by_kind``), the peers'
  ``<peer>/round_trip`` and ``<peer>/<phase>``, ``memcpy_roofline/round_trip``, and
  ``summary.speedup_over_faster_peer``;
* mega_moe rows: ``fused`` (seconds, bytes with self-rank pairs, ``cross_rank_bytes`` /
  ``cross_rank_gbps``, ``tflops``, ``by_kind``), ``serial``, ``unfused``, ``unfused/sum_stages``,
  ``unfused/comm_stages`` and ``summary``'s ratios;
* everywhere: ``fingerprint``, ``checks.ok``, ``link_model`` and ``projection``.

GB/s are the documents' own (bytes over seconds with :func:`bench.formulas.gbps`), per channel
kind the busiest rank's bytes of one round trip (mega_moe: one fused call) over its time.
"""
from __future__ import annotations

import csv
import io
import json
import math
import os
import re
from collections.abc import Iterable

from bench.formulas import gbps
from bench.schema import finite, results_by_name

MODES = ("normal", "low_latency", "mega_moe")
KINDS = ("SELF", "UBMEM", "URMA")
PEERS = ("mpi_alltoallv", "gloo_all_to_all")
PHASES = ("dispatch", "combine")
PROJ_PHASES = PHASES + ("fused",)  # the benchmarks' projection phases (mega_moe: one, "fused")
MMA = {"fp8": "fp8xfp4", "bf16": "bf16xbf16"}  # mega_moe: the dtype axis is the MMA type

# ----------------------------------------------------------------------------------------------
# Row columns (CSV order). Empty cell = not measured / not reported by that benchmark.
# ----------------------------------------------------------------------------------------------

# mega_moe rows: the mega-moe command's times (mean over ranks of the per-rank medians), its per-pair GB/s
# (with self-rank pairs = the main number, cross-rank only), routed TFLOPS and summary ratios.
MEGA_MOE_COLUMNS = ["fused_s", "fused_bytes", "fused_gbps", "fused_cross_rank_bytes", "fused_cross_rank_gbps",
                    "fused_tflops", "fused_over_sum_stages", "grouped_over_plain_mm", "serial_s", "unfused_s",
                    "sum_stages_s", "comm_stages_s"]

CONFIG_FIELDS = ["mode", "ranks", "ranks_per_node", "nodes", "tokens", "hidden", "inter", "num_topk", "num_experts",
                 "dtype",
                 "iters", "warmup", "warmup_s", "seed", "peers", "link_profile", "link_emulation", "link_scale"]
COLUMNS = (
    ["config_key"] + CONFIG_FIELDS
    + ["status", "error", "returncode", "wall_s", "fingerprint", "version", "git_commit", "hostname", "timestamp",
       "gbps_formula", "checks_ok"]
    + [f"{p}_{m}" for p in PHASES for m in ("s", "bytes", "gbps", "logical_gbps")]
    + ["round_trip_s"]
    + [f"{p}_{k}_{m}" for p in PHASES for k in KINDS for m in ("bytes", "gbps")]
    + [f"rt_{k}_{m}" for k in KINDS for m in ("bytes", "gbps")]
    + MEGA_MOE_COLUMNS
    + [f"{peer}_{m}" for peer in PEERS for m in ("round_trip_s", "dispatch_gbps", "combine_gbps")]
    + ["roofline_round_trip_s", "speedup_over_faster_peer"]
    + ["link_label", "proj_profile", "proj_links", "proj_round_trip_s"]
    + [f"proj_{p}_{m}" for p in PROJ_PHASES
       for m in ("s", "gbps", "formula_bytes", "bottleneck_kind", "bottleneck_direction", "bottleneck_rank",
                 "bottleneck_bytes", "bottleneck_link_gbps")]
)




def number(v) -> float | None:
    """A cell as a finite float, else ``None``."""
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def emulated(r: dict) -> bool:
    """Whether the row was measured with emulated links."""
    return r.get("link_emulation") not in (None, "", "none")


def _get(d, *path):
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return None
        d = d[p]
    return d


def _per_kind(prefix: str, rec: dict) -> dict:
    """``<prefix>_<KIND>_bytes`` / ``_gbps`` from a result's ``by_kind`` over its seconds."""
    out: dict = {}
    kinds, t = rec.get("by_kind") or {}, rec.get("seconds")
    for k in KINDS:
        b = kinds.get(k)
        if isinstance(b, (int, float)):
            out[f"{prefix}_{k}_bytes"] = b
            out[f"{prefix}_{k}_gbps"] = gbps(b, t) if t else None
    return out


FORMULAS = {"normal": "V1 bottleneck (busiest rank); logical = V2",
            "low_latency": "DeepEP LL formula (busiest rank); per kind: busiest rank",
            "mega_moe": "MegaMoE per pair: dispatch H*elem + scales + 4 B, combine 2H B (mean over ranks) / fused time "
                        "(mean over ranks); per kind: busiest rank's bytes of one fused call"}


def measured_fields(mode: str, doc: dict) -> dict:
    """Row fields of one ``deepep_ascend.bench/1`` document (module docstring); a result the
    document does not hold leaves its columns empty."""
    res = results_by_name(doc)

    def field(name, key="seconds"):
        return _get(res, name, key)

    r: dict = {"fingerprint": doc.get("fingerprint"), "checks_ok": _get(doc, "checks", "ok"),
               "gbps_formula": FORMULAS[mode]}
    if mode in ("normal", "low_latency"):
        for p in PHASES:
            rec = res.get(f"deepep_ascend/{p}", {})
            r.update({f"{p}_s": rec.get("seconds"), f"{p}_bytes": rec.get("bytes"), f"{p}_gbps": rec.get("gbps"),
                      f"{p}_logical_gbps": rec.get("logical_gbps")})
            r.update(_per_kind(p, rec))
        r["round_trip_s"] = field("deepep_ascend/round_trip")
        r.update(_per_kind("rt", res.get("deepep_ascend/round_trip", {})))
        for peer in PEERS:
            r[f"{peer}_round_trip_s"] = field(f"{peer}/round_trip")
            for p in PHASES:
                r[f"{peer}_{p}_gbps"] = field(f"{peer}/{p}", "gbps")
        r["roofline_round_trip_s"] = field("memcpy_roofline/round_trip")
        r["speedup_over_faster_peer"] = _get(doc, "summary", "speedup_over_faster_peer")
    elif mode == "mega_moe":
        fused = res.get("fused", {})
        r.update(fused_s=fused.get("seconds"), fused_bytes=fused.get("bytes"), fused_gbps=fused.get("gbps"),
                 fused_cross_rank_bytes=fused.get("cross_rank_bytes"),
                 fused_cross_rank_gbps=fused.get("cross_rank_gbps"),
                 fused_tflops=fused.get("tflops"), serial_s=field("serial"), unfused_s=field("unfused"),
                 sum_stages_s=field("unfused/sum_stages"), comm_stages_s=field("unfused/comm_stages"),
                 fused_over_sum_stages=_get(doc, "summary", "fused_over_sum_stages"),
                 grouped_over_plain_mm=_get(doc, "summary", "grouped_over_plain_mm"))
        r.update(_per_kind("rt", fused))
    lm = doc.get("link_model") or {}
    if lm:
        r["link_emulation"] = lm.get("emulation")
        r["link_scale"] = lm.get("scale")
        r["link_label"] = lm.get("label")
    pj = doc.get("projection") or {}
    if pj:
        r["proj_profile"] = pj.get("profile")
        r["proj_links"] = json.dumps(pj["links"], sort_keys=True) if pj.get("links") is not None else None
        r["proj_round_trip_s"] = pj.get("round_trip_s")
        for p in PROJ_PHASES:
            pp = pj.get(p) or {}
            r[f"proj_{p}_s"] = pp.get("time_s")
            r[f"proj_{p}_gbps"] = pp.get("formula_GBps")
            r[f"proj_{p}_bottleneck_link_gbps"] = pp.get("bottleneck_GBps")
            r[f"proj_{p}_formula_bytes"] = pp.get("formula_bytes")
            for f in ("kind", "direction", "rank", "bytes"):
                r[f"proj_{p}_bottleneck_{f}"] = _get(pp, "bottleneck", f)
    return r


# ----------------------------------------------------------------------------------------------
# Results: load, merge, atomic write; per-run records
# ----------------------------------------------------------------------------------------------


def load_results(out_dir: str) -> list:
    """Rows of ``DIR/results.json`` (empty if absent)."""
    path = os.path.join(out_dir, "results.json")
    if not os.path.exists(path):
        return []
    try:
        with open(path) as f:
            return list(json.load(f)["rows"])
    except (ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"sweep_bandwidth: {path} is not a results file of scripts/sweep_bandwidth.py "
                         f"({type(e).__name__}: {e}); move it away or pick another --out") from None


def done_keys(rows: Iterable[dict]) -> set:
    """Config keys whose row is ``ok`` (skipped on resume)."""
    return {r["config_key"] for r in rows if r.get("status") == "ok"}


def merge_row(rows: list, row: dict) -> list:
    """Replace the row with the same key, else append."""
    out = [r for r in rows if r.get("config_key") != row["config_key"]]
    for i, r in enumerate(rows):
        if r.get("config_key") == row["config_key"]:
            out.insert(i, row)
            return out
    return out + [row]


def _atomic_write(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", newline="") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _cell(v):
    return "" if v is None else (repr(v) if isinstance(v, float) else v)


def write_results(out_dir: str, rows: list) -> None:
    """``results.json`` and ``results.csv`` (columns: :data:`COLUMNS`, then any extra keys), each atomically."""
    cols = list(COLUMNS) + sorted({k for r in rows for k in r} - set(COLUMNS))
    norm = [{c: finite(r.get(c)) for c in cols} for r in rows]  # NaN / inf: None (empty cell)
    _atomic_write(os.path.join(out_dir, "results.json"),
                  json.dumps({"columns": cols, "rows": norm}, indent=1, default=str, allow_nan=False) + "\n")
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(cols)
    for r in norm:
        w.writerow([_cell(r[c]) for c in cols])
    _atomic_write(os.path.join(out_dir, "results.csv"), buf.getvalue())


def write_record(out_dir: str, key: str, doc: dict, sweep: dict) -> str:
    """Write one run's document with ``sweep`` (its configuration key, status, ...) added, atomically, as
    ``DIR/records/<key>.json``; returns the path."""
    path = os.path.join(out_dir, "records", re.sub(r"[^A-Za-z0-9._+-]", "_", key) + ".json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    _atomic_write(path, json.dumps(finite(dict(doc, sweep=sweep)), indent=1, default=str, allow_nan=False) + "\n")
    return path
