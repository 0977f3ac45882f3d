"""The one JSON document every benchmark command writes (``--json FILE``) and the sweep reads.

Schema ``deepep_ascend.bench/1`` (:data:`SCHEMA`, checked by :func:`validate`)::

    {
      "schema": "deepep_ascend.bench/1",
      "command": "normal",                 # the registry's name (python -m bench <command>)
      "argv": ["--num-tokens", "512"],     # the command's own arguments
      "params": {...},                     # every effective option after defaults, plus "num_ranks"
      "host": {...},                       # bench.hostinfo.host_doc: hostname, cpu, cpus, python, torch,
                                           #   numpy, mpi (null for one-process commands), version, time
      "fingerprint": "0123456789ab",       # hash of the inputs (bench.workload.fingerprint) or null
      "results": [                         # one record per timed thing, names unique (empty when the
                                           #   host has none of a command's subjects, e.g. no native kernel)
        {"name": "deepep_ascend/dispatch", # "<system>/<phase>" (or one word for a single op)
         "system": "deepep_ascend",        # who ran it
         "phase": "dispatch",              # what part of the work, or null
         "seconds": 0.0123,                # median over the timed iterations (see below)
         "min_s": ..., "max_s": ..., "times_s": [...],   # optional: the spread, per iteration
         "bytes": 123456,                  # bytes by "formula" (busiest rank unless the formula says
         "formula": "V1 bottleneck",       #   otherwise), or null when nothing is counted
         "gbps": 10.0,                     # bytes / seconds, GB = 1e9 B (bench.formulas.gbps), or null
         "by_kind": {"SELF": .., "UBMEM": .., "URMA": ..},  # optional: bytes moved per channel kind
                                           #   in one call (busiest rank per kind)
         "ratio_to": {"mpi_alltoallv/round_trip": 0.31},   # optional: seconds / that result's seconds
                                           #   (between verified systems only)
         "verified": false,                # only on a system that failed its verification: it is left
         "excluded": "why",                #   out of every ratio_to, summary ratio and verdict
         ...}                              # command-specific fields may follow (e.g. "logical_gbps")
      ],
      "baselines": ["mpi_alltoallv/round_trip", ...],  # the results that are baselines measured in the
                                                       #   same run (a subset of the result names)
      "checks": {"ok": true, ...},         # correctness: "ok" is the verdict (exit code 1 when false),
                                           #   the rest what was compared
      "summary": {...},                    # the headline ratios the command prints (may be empty), over
                                           #   verified systems only; "excluded": {system: why} names the
                                           #   systems left out for failing their verification
      "link_model": {...} | null,          # bench.linkmodel.link_model_doc: emulated or not, profile
      "projection": {...} | null,          # bench.linkmodel.project_phases: the link-model projection
      "details": {...},                    # command-specific: per-rank numbers, memory, ...
      "sweep": {...}                       # only in the sweep's per-run records (scripts/sweep_bandwidth.py)
    }

Times: collective commands time each iteration as the max over ranks (barrier first) and report
the median over iterations; ``mega-moe`` reports the mean over ranks of each rank's median (its
upstream's convention, as its ``details`` say); one-process commands report the median of calls
timed in alternation. Non-finite numbers are written as ``null`` (strict JSON).
"""
from __future__ import annotations

import json
import math
from collections.abc import Iterable

from bench.formulas import gbps

SCHEMA_ID = "deepep_ascend.bench/1"

_NUM = {"type": "number"}
_NUM_OR_NULL = {"type": ["number", "null"]}
_KINDS = {"type": "object", "additionalProperties": _NUM_OR_NULL}

#: JSON Schema (draft 2020-12) of a benchmark document.
SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": SCHEMA_ID,
    "type": "object",
    "required": ["schema", "command", "argv", "params", "host", "fingerprint", "results", "baselines", "checks",
                 "summary", "link_model", "projection", "details"],
    "properties": {
        "schema": {"const": SCHEMA_ID},
        "command": {"type": "string", "pattern": "^[a-z][a-z0-9-]*$"},
        "argv": {"type": "array", "items": {"type": "string"}},
        "params": {"type": "object", "required": ["num_ranks"],
                   "properties": {"num_ranks": {"type": "integer", "minimum": 1}}},
        "host": {"type": "object",
                 "required": ["hostname", "cpu", "cpus", "python", "torch", "mpi", "version", "time"],
                 "properties": {"mpi": {"type": ["string", "null"]}, "cpus": {"type": ["integer", "null"]}}},
        "fingerprint": {"type": ["string", "null"]},
        "results": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name", "system", "phase", "seconds", "bytes", "formula", "gbps"],
                "properties": {
                    "name": {"type": "string", "minLength": 1},
                    "system": {"type": "string", "minLength": 1},
                    "phase": {"type": ["string", "null"]},
                    "seconds": {"type": "number", "minimum": 0},
                    "min_s": _NUM_OR_NULL, "max_s": _NUM_OR_NULL,
                    "times_s": {"type": "array", "items": _NUM},
                    "bytes": _NUM_OR_NULL,
                    "formula": {"type": ["string", "null"]},
                    "gbps": _NUM_OR_NULL,
                    "by_kind": _KINDS,
                    "ratio_to": {"type": "object", "additionalProperties": _NUM_OR_NULL},
                    "verified": {"const": False},
                    "excluded": {"type": "string"},
                },
            },
        },
        "baselines": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
        "checks": {"type": "object", "required": ["ok"], "properties": {"ok": {"type": "boolean"}}},
        "summary": {"type": "object"},
        "link_model": {"type": ["object", "null"]},
        "projection": {"type": ["object", "null"]},
        "details": {"type": "object"},
        "sweep": {"type": "object"},
    },
}


def result(name: str, seconds: float, *, system: str | None = None, phase: str | None = None, timing=None,
           nbytes: float | None = None, formula: str | None = None, by_kind: dict | None = None,
           **extra) -> dict:
    """One ``results`` record. ``name`` is ``"<system>/<phase>"`` or one word; ``system`` and ``phase``
    default to its two halves (``phase`` ``None`` for one word). ``timing`` (a :class:`bench.timing.Timing`)
    adds ``min_s``, ``max_s`` and ``times_s``; ``seconds`` is then its median unless given.
    ``nbytes`` under ``formula`` gives ``gbps`` = ``nbytes / seconds`` (GB = 1e9 B). ``extra``:
    command-specific fields."""
    head, _, tail = name.partition("/")
    if seconds is None and timing is not None:
        seconds = timing.median
    rec = dict(name=name, system=system or head, phase=phase if phase is not None else (tail or None),
               seconds=seconds, bytes=nbytes, formula=formula,
               gbps=None if nbytes is None else gbps(nbytes, seconds))
    if timing is not None:
        rec.update(min_s=timing.min, max_s=timing.max, times_s=list(timing.times))
    if by_kind is not None:
        rec["by_kind"] = dict(by_kind)
    rec.update(extra)
    return rec


def add_ratios(results: list, name: str, others: Iterable[str]) -> None:
    """Set ``ratio_to[o] = seconds / seconds of o`` on result ``name`` for each ``o`` of ``others``
    present in ``results`` (``None`` where ``o`` took no time)."""
    by = {r["name"]: r for r in results}
    rec = by[name]
    for o in others:
        if o in by and o != name:
            t = by[o]["seconds"]
            rec.setdefault("ratio_to", {})[o] = rec["seconds"] / t if t else None


def trusted(values: dict, failed: dict) -> dict:
    """``values`` (by system name, or by result name ``"<system>/<phase>"``) without the systems of
    ``failed`` (:func:`excluded_lines`): what ratios and verdicts may be computed from."""
    return {k: v for k, v in values.items() if k.partition("/")[0] not in failed}


def excluded_lines(failed: dict, prefix: str = "[summary]  ") -> list[str]:
    """The lines a command prints for ``failed`` (``{system: why its verification failed}``): each system is
    left out of every ratio and verdict."""
    return [f"{prefix}{name} EXCLUDED from every ratio and verdict: it failed its verification ({why})"
            for name, why in failed.items()]


def exclude_unverified(results: list, failed: dict) -> list:
    """``results`` with every record of a system in ``failed`` marked ``verified: false`` and ``excluded``
    (the reason), and every ``ratio_to`` from or to such a record removed (new dicts; ``results`` is kept)."""
    out = []
    for rec in results:
        rec = dict(rec)
        if rec["system"] in failed:
            rec.update(verified=False, excluded=failed[rec["system"]])
            rec.pop("ratio_to", None)
        elif "ratio_to" in rec:
            kept = {o: v for o, v in rec["ratio_to"].items() if o.partition("/")[0] not in failed}
            if kept:
                rec["ratio_to"] = kept
            else:
                del rec["ratio_to"]
        out.append(rec)
    return out


def document(command: str, *, argv: Iterable[str], params: dict, results: list, checks: dict,
             fingerprint: str | None = None, baselines: Iterable[str] = (), summary: dict | None = None,
             link_model: dict | None = None, projection: dict | None = None, details: dict | None = None,
             mpi: bool = True, failed: dict | None = None) -> dict:
    """A benchmark document (module docstring), ``host`` filled in here (``mpi=False``: a one-process
    command, no MPI imported). ``params`` must hold ``num_ranks``; ``checks`` must hold ``ok``. ``failed``:
    ``{system: why}`` of the systems that failed their verification, left out of every ratio
    (:func:`exclude_unverified`) and named in ``summary["excluded"]``."""
    from bench.hostinfo import host_doc

    failed = dict(failed or {})
    summary = dict(summary or {})
    if failed:
        summary["excluded"] = failed
    return {"schema": SCHEMA_ID, "command": command, "argv": [str(a) for a in argv], "params": dict(params),
            "host": host_doc(mpi), "fingerprint": fingerprint, "results": exclude_unverified(results, failed),
            "baselines": list(baselines), "checks": dict(checks), "summary": summary, "link_model": link_model,
            "projection": projection, "details": dict(details or {})}


def finite(obj):
    """``obj`` with every non-finite float replaced by ``None`` (recursively, dicts/lists/tuples),
    tuples as lists: what strict JSON can hold."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def validate(doc: dict) -> dict:
    """Check ``doc`` against :data:`SCHEMA` and the rules a JSON Schema cannot state (result names
    unique, every baseline a result); returns ``doc``.

    Raises:
        ValueError: naming the first violation (its path in the document).
    """
    import jsonschema

    try:
        jsonschema.validate(doc, SCHEMA)
    except jsonschema.ValidationError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "(document)"
        raise ValueError(f"not a {SCHEMA_ID} document: {where}: {e.message}") from None
    names = [r["name"] for r in doc["results"]]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"not a {SCHEMA_ID} document: results: duplicate names {dup}")
    missing = [b for b in doc["baselines"] if b not in names]
    if missing:
        raise ValueError(f"not a {SCHEMA_ID} document: baselines {missing} are not results")
    unverified = {r["name"] for r in doc["results"] if r.get("verified") is False}
    for r in doc["results"]:
        bad = [o for o in r.get("ratio_to", {}) if o in unverified or r["name"] in unverified]
        if bad:
            raise ValueError(f"not a {SCHEMA_ID} document: results: {r['name']} has ratio_to {bad}, but a system "
                             f"that failed its verification takes part in no ratio")
    return doc


def write(path: str, doc: dict) -> dict:
    """Validate ``doc`` (non-finite numbers as ``null``), write it to ``path`` and say so (``[json] wrote PATH``);
    returns what was written."""
    doc = validate(json.loads(json.dumps(finite(doc), default=str)))
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, allow_nan=False)
        f.write("\n")
    print(f"[json]     wrote {path}")
    return doc


def read(path: str) -> dict:
    """Load and :func:`validate` a document. Raises ``OSError`` / ``ValueError`` (not JSON, or not this schema)."""
    with open(path) as f:
        return validate(json.load(f))


def results_by_name(doc: dict) -> dict:
    """``{name: result}`` of a document."""
    return {r["name"]: r for r in doc["results"]}


def print_results(results: list, skipped: dict, summary: dict, ok: bool, mismatches, width: int = 22,
                  failed: dict | None = None) -> None:
    """Print a collective command's result lines (rank 0): each result's median time, GB/s and formula, the
    systems not run and why, the summary's ratios, and the checks. ``failed`` (``{system: why}``): their
    results are marked ``(EXCLUDED)`` and :func:`excluded_lines` close the output."""
    failed = failed or {}
    for x in results:
        mark = "  (EXCLUDED)" if x["system"] in failed else ""
        print(f"  {x['name']:<{width}} {x['seconds'] * 1e6:10.1f} us  {x['gbps']:8.2f} GB/s  ({x['formula']}){mark}",
              flush=True)
    for name, why in skipped.items():
        print(f"  {name}: not run ({why})", flush=True)
    for key, v in summary.items():
        print(f"  {key}: {v:.2f}", flush=True)
    print(f"  checks: {'ok' if ok else f'MISMATCHES {mismatches}'}", flush=True)
    for line in excluded_lines(failed, "  "):
        print(line, flush=True)
