#!/usr/bin/env python
"""Bandwidth sweeps: run the ``normal`` / ``low-latency`` / ``mega-moe`` benchmarks over a grid of configurations.

Usage (from anywhere; the benchmarks run from the repository root)::

    python scripts/sweep_bandwidth.py --preset smoke --out /tmp/sweep      # 2 tiny points (CI)
    python scripts/sweep_bandwidth.py --preset small --out sweeps/small    # a few minutes here
    python scripts/sweep_bandwidth.py --preset default --out sweeps/dsv3 --ranks 4,8
    python scripts/sweep_bandwidth.py --preset small --out d --num-tokens 256,512 --mode normal --dry-run
    python scripts/sweep_bandwidth.py --preset small --out mm --mode mega_moe --inter 128,256

Every configuration (mode × ranks × ranks per node × tokens × hidden × [inter] × top-k × experts ×
dtype) is one ``mpiexec -n R python -m bench <command> --json FILE ...`` job (:data:`COMMANDS`), launched with the
``mpiexec`` of the ``mpich`` wheel (the one mpi4py's libmpi belongs to; else ``mpiexec`` on PATH), from the
repository root, ``PYTHONPATH`` = the root, ``OMP_NUM_THREADS=1``, in its own process group and
with a per-run ``--timeout`` (the group is killed, the row recorded as failed, the sweep goes on).
The child's output goes to ``DIR/logs/<config>.log``.

Presets (explicit axes override the preset's values; ``--mode`` picks which modes run; every
preset has a ``mega_moe`` grid, run by default except in ``smoke``):

* ``smoke``: normal mode, 2 ranks, one node, tokens 64 and 128, hidden 256, top-2 of 8 experts,
  BF16, 3 iterations: two points, seconds. (``--mode mega_moe``: the same sizes, inter 128, FP8.)
* ``small``: 4 ranks as 1 node and as 2 nodes x 2; normal mode at 128-1024 tokens, low-latency
  at 64-256 tokens; hidden 1024, top-4 of 16 experts, BF16; MegaMoE (one node) at 64-256 tokens,
  the mega-moe command's tiny shape (hidden 256, inter 128, top-4 of 16, FP8xFP4); 5 iterations:
  17 points, a few minutes on a 2-core machine.
* ``default``: DeepSeek-V3 shape (hidden 7168, top-8 of 256 experts), 4 ranks as 1 and 2
  nodes; normal at 512-4096 tokens, low-latency at 16-128 tokens (its window grows with
  tokens x hidden x experts); MegaMoE at the mega-moe command's cpu-pro-mini shape (hidden 1024,
  inter 512, top-6 of 96: DeepSeek-V3's own expert weights do not fit in CPU memory per rank),
  128-512 tokens: longer (estimated, not measured: half an hour to an hour on 2 cores).
* ``full``: 2, 4 and 8 ranks, nodes of 2 and 4, hidden 2048 and 7168, BF16 and FP8; MegaMoE at
  hidden 1024/2048 x inter 128/512, top-6 of 96, FP8xFP4 and BF16: hours.

MegaMoE rows run on one node only (``mega-moe`` has no ``--ranks-per-node``: a
``ranks_per_node`` is listed as an impossible combination), without peer pipelines; ``--inter``
is their intermediate size and the dtype axis their ``--mma`` (``fp8`` = FP8xFP4, ``bf16`` =
BF16xBF16); one shared expert (the benchmark's default).

Outputs in ``--out DIR`` (rewritten atomically after every configuration, so a killed sweep
keeps what it measured; rerunning with the same ``DIR`` skips configurations already ``ok``,
``--no-resume`` measures them again):

* ``records/<config>.json``: each run's benchmark document (schema ``deepep_ascend.bench/1``,
  ``bench/schema.py``, the one every command writes) with a ``sweep`` block (configuration key,
  status, error, exit code, wall time, provenance);
* ``results.csv`` / ``results.json`` (``{"columns": [...], "rows": [...]}``): one row per
  configuration, read from its record (``bench/sweep_records.py``); columns in :data:`COLUMNS`
  (see docs/benchmarks.md).
* ``gbps_vs_size.png``: GB/s vs tokens per rank, per mode, for the formula bandwidths (MegaMoE:
  the fused call's per-pair bytes, with and without self-rank pairs) and per channel kind
  (SELF / UBMEM / URMA bytes moved per second);
* ``peers.png``: deepep_ascend vs the MPI ``Alltoallv`` and gloo ``all_to_all_single``
  pipelines on the same axes;
* ``projected_vs_measured.png``: the benchmarks' projection onto a link profile (a model,
  labelled as such) next to the measured GB/s; emulated runs are labelled ``EMULATED``.

GB = 1e9 B. The GB/s come from the benchmarks' documents, computed there with ``bench.formulas``
(V1 bottleneck, V2 logical; DeepEP's LL formula in low-latency mode; MegaMoE's per-pair bytes;
the busiest rank's bytes), the per-kind rates as the busiest rank's bytes over the time with
``bench.formulas.gbps``.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import itertools
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench import cli, schema  # noqa: E402
from bench.formulas import FP8_BLOCK  # noqa: E402
from bench.internals import mpiexec_path  # noqa: E402  (the wheel's mpiexec, as scripts/common.sh)
from bench.sweep_plots import EMULATED_TAG, make_plots  # noqa: E402,F401  (EMULATED_TAG: the plots' label)
from bench.sweep_records import (  # noqa: E402,F401  (the record I/O, used here and by the tests through this module)
    COLUMNS,
    CONFIG_FIELDS,
    MMA,
    MODES,
    done_keys,
    emulated,
    load_results,
    measured_fields,
    merge_row,
    number,
    write_record,
    write_results,
)
from bench.timing import DEFAULT_WARMUP_S  # noqa: E402

# mode -> python -m bench <command>
COMMANDS = {"normal": "normal", "low_latency": "low-latency", "mega_moe": "mega-moe"}
LL_MAX_TOKENS = 511  # DeepEP's num_max_dispatch_tokens_per_rank limit, enforced by the library
DEFAULT_LINK_PROFILE = "ascend950"


def _bench_default_link_scale() -> float:
    """The benchmarks' ``--link-scale`` default (all three take it from ``bench.cli.add_link_args``)."""
    q = argparse.ArgumentParser(add_help=False)
    cli.add_link_args(q)
    return float(q.get_default("link_scale"))


# An emulated configuration without --link-scale runs at this scale: its key and row say the value,
# so that the default and an explicit --link-scale of the same value are one configuration.
DEFAULT_LINK_SCALE = _bench_default_link_scale()

# ----------------------------------------------------------------------------------------------
# Presets: per mode, the axes (lists) of its grid; the modes run by default (``default_modes``,
# else all of them); iterations and the per-run timeout.
# ----------------------------------------------------------------------------------------------

PRESETS = {
    "smoke": dict(
        about="2 points: normal mode, 2 ranks, tokens 64/128, hidden 256, top-2 of 8 experts (seconds)",
        iters=3, warmup=1, timeout=120.0, default_modes=["normal"],
        modes={"normal": dict(ranks=[2], ranks_per_node=[None], tokens=[64, 128], hidden=[256], num_topk=[2],
                              num_experts=[8], dtype=["bf16"]),
               # only with --mode mega_moe (CI runs the two normal points)
               "mega_moe": dict(ranks=[2], ranks_per_node=[None], tokens=[64, 128], hidden=[256], inter=[128],
                                num_topk=[2], num_experts=[8], dtype=["fp8"])}),
    "small": dict(
        about="17 points: 4 ranks as 1 node and 2x2; normal 128-1024 tokens, low-latency 64-256; "
              "MegaMoE tiny shape 64-256 (a few minutes)",
        iters=5, warmup=1, timeout=300.0,
        modes={"normal": dict(ranks=[4], ranks_per_node=[None, 2], tokens=[128, 256, 512, 1024], hidden=[1024],
                              num_topk=[4], num_experts=[16], dtype=["bf16"]),
               "low_latency": dict(ranks=[4], ranks_per_node=[None, 2], tokens=[64, 128, 256], hidden=[1024],
                                   num_topk=[4], num_experts=[16], dtype=["bf16"]),
               # bench.mega_moe's "tiny" preset shape (about 10 s a point here)
               "mega_moe": dict(ranks=[4], ranks_per_node=[None], tokens=[64, 128, 256], hidden=[256], inter=[128],
                                num_topk=[4], num_experts=[16], dtype=["fp8"])}),
    "default": dict(
        about="DeepSeek-V3 shape, 4 ranks as 1 and 2 nodes; normal 512-4096 tokens, LL 16-128; MegaMoE "
              "cpu-pro-mini shape 128-512 (estimated 0.5-1 h)",
        iters=10, warmup=2, timeout=1800.0,
        modes={"normal": dict(ranks=[4], ranks_per_node=[None, 2], tokens=[512, 1024, 2048, 4096], hidden=[7168],
                              num_topk=[8], num_experts=[256], dtype=["bf16"]),
               "low_latency": dict(ranks=[4], ranks_per_node=[None, 2], tokens=[16, 32, 64, 128], hidden=[7168],
                                   num_topk=[8], num_experts=[256], dtype=["bf16"]),
               # bench.mega_moe's "cpu-pro-mini" shape: DeepSeek-V3's experts (H 7168, I 2048) would not fit
               "mega_moe": dict(ranks=[4], ranks_per_node=[None], tokens=[128, 256, 512], hidden=[1024], inter=[512],
                                num_topk=[6], num_experts=[96], dtype=["fp8"])}),
    "full": dict(
        about="2/4/8 ranks, nodes of 2 and 4, hidden 2048/7168, BF16 and FP8; MegaMoE H 1024/2048 x I 128/512 (hours)",
        iters=10, warmup=2, timeout=3600.0,
        modes={"normal": dict(ranks=[2, 4, 8], ranks_per_node=[None, 2, 4], tokens=[256, 512, 1024, 2048],
                              hidden=[2048, 7168], num_topk=[8], num_experts=[256], dtype=["bf16", "fp8"]),
               "low_latency": dict(ranks=[2, 4, 8], ranks_per_node=[None, 2, 4], tokens=[16, 32, 64, 128],
                                   hidden=[2048, 7168], num_topk=[8], num_experts=[256], dtype=["bf16", "fp8"]),
               "mega_moe": dict(ranks=[2, 4, 8], ranks_per_node=[None], tokens=[128, 256, 512, 1024],
                                hidden=[1024, 2048], inter=[128, 512], num_topk=[6], num_experts=[96],
                                dtype=["fp8", "bf16"])}),
}
AXES = ("ranks", "ranks_per_node", "tokens", "hidden", "inter", "num_topk", "num_experts", "dtype")

@dataclasses.dataclass(frozen=True)
class Config:
    """One benchmark run. ``ranks_per_node=None``: one node (all ranks). ``inter``: MegaMoE's
    intermediate size (``None`` in the other modes); in mega_moe mode ``dtype`` is the MMA type
    (:data:`MMA`) and ``peers`` is False (the benchmark has none)."""

    mode: str
    ranks: int
    ranks_per_node: int | None
    tokens: int
    hidden: int
    num_topk: int
    num_experts: int
    dtype: str
    iters: int
    warmup: int
    seed: int = 0
    warmup_s: float = DEFAULT_WARMUP_S
    peers: bool = True
    link_profile: str | None = DEFAULT_LINK_PROFILE
    link_emulation: str | None = None
    link_scale: float | None = None
    inter: int | None = None

    @property
    def nodes(self) -> int:
        return self.ranks // self.ranks_per_node if self.ranks_per_node else 1

    @property
    def key(self) -> str:
        """Stable, readable identity of the configuration (the resume key)."""
        topo = f"{self.nodes}x{self.ranks_per_node}" if self.ranks_per_node else "1node"
        mm = self.mode == "mega_moe"
        k = (f"{self.mode}-R{self.ranks}-{topo}-T{self.tokens}-H{self.hidden}" + (f"-I{self.inter}" if mm else "")
             + f"-K{self.num_topk}-E{self.num_experts}-{MMA.get(self.dtype, self.dtype) if mm else self.dtype}"
             f"-it{self.iters}w{self.warmup}ws{self.warmup_s!r}-s{self.seed}")
        if not self.peers and not mm:  # mega_moe has no peers to skip
            k += "-nopeers"
        k += f"-proj_{self.link_profile or 'none'}"
        if self.link_emulation and self.link_emulation != "none":
            k += f"-emu_{self.link_emulation}x{self.effective_link_scale:g}"
        return k

    @property
    def effective_link_scale(self) -> float:
        """The emulation scale the benchmark runs at (its default when ``link_scale`` is None)."""
        return DEFAULT_LINK_SCALE if self.link_scale is None else self.link_scale

    def fields(self) -> dict:
        """The configuration's :data:`CONFIG_FIELDS` columns of a row (``nodes`` derived)."""
        d = dataclasses.asdict(self)
        d["nodes"] = self.nodes
        return {f: d[f] for f in CONFIG_FIELDS}

    def invalid(self) -> str | None:
        """Why this combination cannot run, or None."""
        if self.num_experts % self.ranks:
            return f"num_experts {self.num_experts} is not a multiple of ranks {self.ranks}"
        if self.num_topk > self.num_experts:
            return f"num_topk {self.num_topk} > num_experts {self.num_experts}"
        if self.ranks_per_node and self.ranks % self.ranks_per_node:
            return f"ranks_per_node {self.ranks_per_node} does not divide ranks {self.ranks}"
        if self.dtype == "fp8" and self.hidden % FP8_BLOCK:
            return f"fp8 needs hidden % {FP8_BLOCK} == 0 (hidden {self.hidden})"
        if self.mode == "low_latency" and self.tokens > LL_MAX_TOKENS:
            return f"low_latency needs tokens <= {LL_MAX_TOKENS} (tokens {self.tokens})"
        if self.mode == "mega_moe":  # get_symm_buffer_for_mega_moe's checks; one node only
            if self.ranks_per_node:
                return "mega_moe runs on one node only (the mega-moe command has no --ranks-per-node)"
            if self.num_topk > 32:
                return f"mega_moe needs num_topk <= 32 (num_topk {self.num_topk})"
            if self.dtype == "fp8" and self.inter % 128:
                return f"mega_moe fp8xfp4 needs inter % 128 == 0 (inter {self.inter})"
            if self.dtype == "bf16" and self.inter % 8:
                return f"mega_moe bf16xbf16 needs inter % 8 == 0 (inter {self.inter})"
        return None

    def bench_args(self, json_path: str, supported: set) -> list:
        """The benchmark's command-line options (``supported``: the options its ``--help`` lists), in the
        benchmarks' one vocabulary (``bench.cli``)."""
        a = ["--json", json_path, "--num-tokens", self.tokens, "--hidden", self.hidden, "--num-topk", self.num_topk,
             "--num-experts", self.num_experts, "--iters", self.iters, "--warmup", self.warmup, "--warmup-s",
             self.warmup_s, "--seed", self.seed]
        if self.mode == "mega_moe":
            a += ["--inter", self.inter, "--mma", self.dtype]
        if self.ranks_per_node:
            a += ["--ranks-per-node", self.ranks_per_node]
        if self.mode == "normal":
            a += ["--fp8"] if self.dtype == "fp8" else []
            if not self.peers:
                a += ["--systems", "deepep_ascend,roofline"]
        elif self.mode == "low_latency":
            a += ["--bf16"] if self.dtype == "bf16" else []
            if not self.peers:
                a += ["--no-baselines"]
        if "--no-progress" in supported:
            a += ["--no-progress"]
        if "--link-profile" in supported:  # the benchmarks' default is ascend950: 'none' must be said
            a += ["--link-profile", self.link_profile or "none"]
        if self.link_emulation and self.link_emulation != "none":
            a += ["--link-emulation", self.link_emulation]
            if self.link_scale is not None:
                a += ["--link-scale", self.link_scale]
        return [str(x) for x in a]


# ----------------------------------------------------------------------------------------------
# Environment: mpiexec, child env, provenance
# ----------------------------------------------------------------------------------------------


def find_mpiexec() -> str:
    """The wheel's ``mpiexec`` (what ``use_wheel_mpiexec`` puts first on PATH), else ``mpiexec`` on PATH."""
    found = mpiexec_path()
    if not found:
        raise SystemExit("sweep_bandwidth: no mpiexec: install the mpich wheel (pip install mpich) or put one on PATH")
    return found


_LAUNCHER_PREFIXES = ("PMI_", "HYDRA_", "MPI_LOCALNRANKS", "MPI_LOCALRANKID", "OMPI_", "PMIX_")
# Set by the configuration, never inherited: topology and link emulation/profile.
_CONFIG_ENV = ("DEEPEP_ASCEND_RANKS_PER_NODE", "DEEPEP_ASCEND_LINK_PROFILE", "DEEPEP_ASCEND_LINK_EMULATION",
               "DEEPEP_ASCEND_LINK_SCALE")


def child_env() -> dict:
    """Environment of a benchmark job: ours minus an enclosing MPI launch's variables (a child job must
    not join it) and the library variables a configuration sets (:data:`_CONFIG_ENV`), plus
    ``PYTHONPATH`` = repository root first and ``OMP_NUM_THREADS=1``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_PREFIXES) and k not in _CONFIG_ENV}
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["OMP_NUM_THREADS"] = "1"
    return env


def library_version() -> str:
    """``deepep_ascend``'s installed version, else its ``__version__``; "" if neither is found."""
    try:
        return importlib.metadata.version("deepep_ascend")
    except importlib.metadata.PackageNotFoundError:
        try:
            import deepep_ascend
            return str(deepep_ascend.__version__)
        except Exception:  # noqa: BLE001
            return ""


def git_commit() -> str:
    """``HEAD`` of the checkout (12 hex digits), ``+dirty`` if tracked files differ; "" without git."""
    try:
        head = subprocess.run(["git", "-C", REPO, "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        if head.returncode:
            return ""
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return ""


def bench_options(command: str, env: dict) -> set:
    """The ``--options`` a benchmark command's ``--help`` lists (checked once per command).

    In-process (the registry's parser, ``bench.commands.parser``: the commands import no MPI at
    module level), else ``python -m bench <command> --help`` in a subprocess.
    """
    text = ""
    try:
        from bench import commands

        text = commands.parser(command).format_help()
    except Exception:  # noqa: BLE001 - fall back to asking a fresh interpreter
        text = ""
    if "--json" not in text:
        try:
            text = subprocess.run([sys.executable, "-m", "bench", command, "--help"], cwd=REPO, env=env,
                                  capture_output=True, text=True, timeout=120).stdout
        except (OSError, subprocess.SubprocessError):
            return set()
    return set(re.findall(r"--[a-z][a-z0-9-]*", text))


# ----------------------------------------------------------------------------------------------
# Running one configuration
# ----------------------------------------------------------------------------------------------


def run_config(cfg: Config, mpiexec: str, env: dict, supported: set, timeout: float, log_dir: str) -> tuple:
    """Run one benchmark job. Returns ``(doc or None, returncode or None, error text, wall seconds)``."""
    fd, json_path = tempfile.mkstemp(prefix="sweep_", suffix=".json")
    os.close(fd)
    os.unlink(json_path)  # the benchmark creates it: its absence means no result
    cmd = [mpiexec, "-n", str(cfg.ranks), sys.executable, "-m", "bench", COMMANDS[cfg.mode]] + cfg.bench_args(
        json_path, supported)
    log_path = os.path.join(log_dir, re.sub(r"[^A-Za-z0-9._+-]", "_", cfg.key) + ".log")
    t0 = time.perf_counter()
    err, rc = "", None
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            err = f"timeout after {timeout:g} s (process group killed)"
        except BaseException:  # KeyboardInterrupt: no orphaned ranks
            kill_group(proc)
            raise
    wall = time.perf_counter() - t0
    doc = None
    try:
        doc = schema.read(json_path)  # the one document every command writes (bench/schema.py)
    except (OSError, json.JSONDecodeError) as e:
        if not err:
            err = f"exit {rc}, no JSON result ({type(e).__name__})"
    except ValueError as e:  # JSON, but not a deepep_ascend.bench/1 document
        if not err:
            err = f"exit {rc}, {e}"
    finally:
        if os.path.exists(json_path):
            os.unlink(json_path)
    if not err and rc != 0:
        err = f"exit {rc}"
    if err:
        err += ": " + log_tail(log_path)
    return doc, rc, err, wall


def kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the job's process group, SIGKILL it if still alive after 5 s."""
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 30.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def log_tail(path: str, n: int = 400) -> str:
    """The last ``n`` characters of a job's log, on one line (for the ``error`` column)."""
    try:
        with open(path, errors="replace") as f:
            text = f.read()
    except OSError:
        return ""
    noise = ("$ ", "=", "YOUR APPLICATION TERMINATED", "This typically refers", "Please see the FAQ")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith(noise)]
    return " | ".join(lines)[-n:] + f" (log: {path})"


def make_row(cfg: Config, doc, rc, err: str, wall: float, prov: dict) -> dict:
    """One results row (every :data:`COLUMNS` key) from :func:`run_config`'s ``(doc, rc, err, wall)``
    and the provenance ``prov``. ``status`` is ``failed`` (with ``error``) if the job failed, its
    JSON reports a failed correctness check, or it has no positive time (round trip; mega_moe:
    fused call); else ``ok``."""
    row = dict.fromkeys(COLUMNS)
    row.update(config_key=cfg.key, **cfg.fields(), **prov)
    row.update(returncode=rc, wall_s=wall, timestamp=datetime.datetime.now().astimezone().isoformat(timespec="seconds"))
    if doc is not None:
        row.update(measured_fields(cfg.mode, doc))
    if not err and doc is not None and row.get("checks_ok") is False:
        err = "benchmark reported a correctness check failure"
    t_col = "fused_s" if cfg.mode == "mega_moe" else "round_trip_s"
    if not err and not (isinstance(row.get(t_col), (int, float)) and row[t_col] > 0):
        err = "benchmark JSON has no " + ("fused-call time" if cfg.mode == "mega_moe" else "round-trip time")
    row["status"] = "failed" if err else "ok"
    row["error"] = err or None
    return row


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------


def _list(p, name: str, text: str, conv) -> list:
    vals = []
    for tok in text.split(","):
        tok = tok.strip()
        if not tok:
            continue
        try:
            vals.append(conv(tok))
        except ValueError as e:
            p.error(f"{name}: bad value {tok!r} ({e})")
    if not vals:
        p.error(f"{name}: empty list")
    return list(dict.fromkeys(vals))  # order kept, duplicates dropped


def _pos_int(tok: str) -> int:
    v = int(tok)
    if v <= 0:
        raise ValueError("must be a positive integer")
    return v


def _rpn(tok: str) -> int | None:
    if tok.lower() in ("0", "none", "1node"):
        return None
    return _pos_int(tok)


def _mode(tok: str) -> str:
    if tok not in MODES:
        raise ValueError(f"choose from {', '.join(MODES)}")
    return tok


def _dtype(tok: str) -> str:
    tok = tok.lower()
    if tok not in ("bf16", "fp8"):
        raise ValueError("choose from bf16, fp8")
    return tok


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python scripts/sweep_bandwidth.py", description=__doc__.split("\n")[0],
                                epilog="Presets:\n" + "\n".join(f"  {k:8s} {v['about']}" for k, v in PRESETS.items()),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="small", help="the grid to start from (default small)")
    p.add_argument("--out", metavar="DIR", help="output directory (results.csv, results.json, PNGs, logs/)")
    p.add_argument("--mode", help="comma list out of normal,low_latency,mega_moe (default: the preset's modes)")
    p.add_argument("--num-tokens", dest="tokens", help="tokens per rank, comma list (e.g. 512,1024)")
    p.add_argument("--hidden", help="hidden sizes, comma list")
    p.add_argument("--inter", help="MegaMoE intermediate sizes, comma list (mega_moe rows only)")
    p.add_argument("--num-topk", help="top-k values, comma list")
    p.add_argument("--num-experts", help="expert counts, comma list")
    p.add_argument("--ranks", help="mpiexec -n values, comma list")
    p.add_argument("--ranks-per-node", help="simulated node sizes, comma list; 0 or none = one node")
    p.add_argument("--dtype", help="dispatch dtypes, comma list out of bf16,fp8 (combine is BF16); "
                                   "mega_moe: the MMA type, fp8 = fp8xfp4, bf16 = bf16xbf16")
    p.add_argument("--fp8", dest="dtype", action="store_const", const="fp8", help="same as --dtype fp8")
    p.add_argument("--bf16", dest="dtype", action="store_const", const="bf16", help="same as --dtype bf16")
    p.add_argument("--iters", type=int, help="timed iterations per run (default: the preset's)")
    p.add_argument("--warmup", type=int, help="untimed iterations first (default: the preset's)")
    p.add_argument("--warmup-s", type=cli.float_at_least(0.0), default=DEFAULT_WARMUP_S,
                   help=f"and untimed for at least this many seconds (default {DEFAULT_WARMUP_S}; the benchmarks' "
                        f"--warmup-s)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    p.add_argument("--no-peers", action="store_true",
                   help="skip the MPI / gloo peer pipelines (faster; mega_moe has none)")
    p.add_argument("--link-profile", default=DEFAULT_LINK_PROFILE,
                   help=f"projection profile passed to the benchmarks (default {DEFAULT_LINK_PROFILE}; 'none' = "
                        f"no projection); passed only to benchmarks whose --help lists --link-profile")
    p.add_argument("--link-emulation", choices=("none", "delay"), default="none",
                   help="emulate the profile's links in the benchmark (rows and plots say EMULATED)")
    p.add_argument("--link-scale", type=float, help="emulation scale passed as --link-scale")
    p.add_argument("--timeout", type=float, help="seconds per run before its process group is killed "
                                                 "(default: the preset's)")
    p.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True,
                   help="skip configurations already ok in DIR/results.json (default: --resume)")
    p.add_argument("--dry-run", action="store_true", help="print the configurations and commands, run nothing")
    return p


def _check_out_dir(p, out: str) -> None:
    """``p.error`` unless ``out`` is a directory or can be created as one."""
    path = os.path.abspath(out)
    if os.path.exists(path) and not os.path.isdir(path):
        p.error(f"--out {out}: exists and is not a directory")
    parent = os.path.dirname(path)
    while not os.path.exists(parent) and os.path.dirname(parent) != parent:
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        p.error(f"--out {out}: {parent} is not a directory")


def parse_args(argv=None):
    """``(args, parser)``: the options, checked (``parser.error`` on bad values), with
    ``args.configs`` (the valid :class:`Config` list, in grid order, duplicates dropped) and
    ``args.invalid`` (``(Config, reason)`` of the impossible combinations)."""
    p = build_parser()
    a = p.parse_args(argv)
    preset = PRESETS[a.preset]
    # what the command line set beside the grid's axes (named on the [sweep] line with them)
    given = [f"--{d.replace('_', '-')}" for d in ("mode", "iters", "warmup", "warmup_s", "seed", "no_peers",
                                                 "link_profile", "link_emulation", "link_scale")
             if getattr(a, d) != p.get_default(d)]
    if not a.out and not a.dry_run:
        p.error("--out DIR is required (unless --dry-run)")
    a.iters = preset["iters"] if a.iters is None else a.iters
    a.warmup = preset["warmup"] if a.warmup is None else a.warmup
    if a.iters < 1:
        p.error(f"--iters must be >= 1, got {a.iters}")
    if a.warmup < 0:
        p.error(f"--warmup must be >= 0, got {a.warmup}")
    a.timeout = preset["timeout"] if a.timeout is None else a.timeout
    if not a.timeout > 0:
        p.error(f"--timeout must be positive, got {a.timeout}")
    if a.link_scale is not None and not (math.isfinite(a.link_scale) and a.link_scale > 0):
        p.error(f"--link-scale must be a finite number > 0, got {a.link_scale}")
    if a.link_scale is not None and a.link_emulation == "none":
        p.error("--link-scale needs --link-emulation delay")
    a.link_profile = None if str(a.link_profile).lower() in ("", "none") else a.link_profile
    if a.link_emulation != "none" and a.link_profile is None:
        p.error("--link-emulation needs a --link-profile to emulate")
    if a.link_profile is not None:  # checked here as the benchmarks check it, not once per failed job
        from deepep_ascend.transports import get_profile

        try:
            profile = get_profile(a.link_profile)
        except ValueError as e:
            p.error(f"--link-profile: {e}")
        if a.link_emulation != "none" and not profile.links:
            p.error(f"--link-emulation: profile {a.link_profile!r} has no links to emulate")
    if a.link_emulation != "none" and a.link_scale is None:
        a.link_scale = DEFAULT_LINK_SCALE  # the benchmarks' default, said explicitly (config key, row, command)
    if a.out:
        _check_out_dir(p, a.out)
    modes = _list(p, "--mode", a.mode, _mode) if a.mode else list(preset.get("default_modes", preset["modes"]))
    if a.inter is not None and "mega_moe" not in modes:
        p.error("--inter applies to mega_moe rows only: add --mode mega_moe")
    override = {}
    for axis, conv in (("tokens", _pos_int), ("hidden", _pos_int), ("inter", _pos_int), ("num_topk", _pos_int),
                       ("num_experts", _pos_int), ("ranks", _pos_int), ("ranks_per_node", _rpn), ("dtype", _dtype)):
        text = getattr(a, axis)
        if text is not None:
            override[axis] = _list(p, "--num-tokens" if axis == "tokens" else "--" + axis.replace("_", "-"), text, conv)
    configs, skipped = [], []
    first = next(iter(preset["modes"].values()))
    for m in modes:
        axes = dict(preset["modes"].get(m, first), **override)
        if m != "mega_moe":
            axes["inter"] = [None]
        for vals in itertools.product(*(axes[k] for k in AXES)):
            d = dict(zip(AXES, vals))
            if d["ranks_per_node"] is not None and d["ranks_per_node"] == d["ranks"]:
                d["ranks_per_node"] = None  # a node of all ranks is the one-node case
            cfg = Config(mode=m, iters=a.iters, warmup=a.warmup, warmup_s=a.warmup_s, seed=a.seed,
                         peers=not a.no_peers and m != "mega_moe",
                         link_profile=a.link_profile,
                         link_emulation=None if a.link_emulation == "none" else a.link_emulation,
                         link_scale=a.link_scale, **d)
            why = cfg.invalid()
            if why:
                skipped.append((cfg, why))
            elif cfg not in configs:
                configs.append(cfg)
    if not configs:
        p.error("no valid configuration: " + "; ".join(sorted({w for _, w in skipped}))
                + " (check --num-tokens/--hidden/--inter/--num-topk/--num-experts/--ranks/--ranks-per-node/"
                  "--dtype/--mode)")
    a.configs, a.invalid = configs, skipped
    a.overridden = ["--num-tokens" if k == "tokens" else "--" + k.replace("_", "-") for k in override] + given
    return a, p


def ok_summary(row: dict) -> str:
    """One line of an ``ok`` row's main numbers (empty columns shown as ``-``), starting with
    ``EMULATED links (profile x scale)`` when the benchmark ran with emulated links."""
    def f(col, scale=1.0, fmt=".3f"):
        v = number(row.get(col))
        return "-" if v is None else format(v * scale, fmt)

    emu = ""
    if emulated(row):
        scale = number(row.get("link_scale"))
        emu = (f"EMULATED links ({row.get('link_profile') or '?'}" + (f" x {scale:g}" if scale is not None else "")
               + ") | ")
    if row["mode"] == "mega_moe":
        text = (f"fused {f('fused_s', 1e3)} ms, {f('fused_gbps', fmt='.4f')} GB/s with self-rank pairs "
                f"({f('fused_cross_rank_gbps', fmt='.4f')} cross-rank), {f('fused_tflops', fmt='.4f')} TFLOPS, "
                f"fused / sum of stages {f('fused_over_sum_stages', fmt='.2f')}")
        proj = number(row.get("proj_fused_gbps"))
        return emu + text + (f" | projected fused {proj:.1f} GB/s (model)" if proj is not None else "")
    text = (f"dispatch {f('dispatch_s', 1e3)} ms {f('dispatch_gbps')} GB/s | "
            f"combine {f('combine_s', 1e3)} ms {f('combine_gbps')} GB/s")
    proj = number(row.get("proj_dispatch_gbps"))
    return emu + text + (f" | projected dispatch {proj:.1f} GB/s (model)" if proj is not None else "")


def _terminate(signum, frame):
    """SIGTERM → SystemExit, so the running job's process group is killed on the way out."""
    raise SystemExit(128 + signum)


def main(argv=None) -> int:
    args, parser = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    env = child_env()
    supported = {}
    for m in sorted({c.mode for c in args.configs}):
        supported[m] = bench_options(COMMANDS[m], env)
        if not supported[m]:
            print(f"[sweep] warning: could not read `python -m bench {COMMANDS[m]} --help`", file=sys.stderr)
        if args.link_emulation != "none" and "--link-emulation" not in supported[m]:
            parser.error(f"--link-emulation: the {COMMANDS[m]} command does not accept --link-emulation (yet)")
        if args.link_profile and "--link-profile" not in supported[m]:
            print(f"[sweep] note: the {COMMANDS[m]} command has no --link-profile yet: "
                  f"no projection columns for {m} rows")
    # A benchmark without --link-profile makes no projection: the effective configuration says so
    # (its key too, so that a rerun after the benchmark gains it measures the projection).
    args.configs = [c if c.link_profile is None or "--link-profile" in supported[c.mode]
                    else dataclasses.replace(c, link_profile=None) for c in args.configs]
    for cfg, why in args.invalid:
        print(f"[sweep] skipping invalid combination {cfg.key}: {why}")

    prev = load_results(args.out) if args.out else []
    done = done_keys(prev) if args.resume else set()
    todo = [c for c in args.configs if c.key not in done]
    n_skip = len(args.configs) - len(todo)
    given = f" with {', '.join(args.overridden)} given" if args.overridden else ""
    print(f"[sweep] preset {args.preset}{given}: {len(args.configs)} configurations; {n_skip} already ok in "
          f"{os.path.join(args.out, 'results.json') if args.out else '-'} (skipped), {len(todo)} to run; "
          f"timeout {args.timeout:g} s per run", flush=True)

    mpiexec = find_mpiexec() if not args.dry_run else (mpiexec_path() or "mpiexec")
    if args.dry_run:
        for c in args.configs:
            state = "skip (ok)" if c.key in done else "run"
            cmd = [mpiexec, "-n", str(c.ranks), sys.executable, "-m", "bench", COMMANDS[c.mode]] + c.bench_args(
                "<tmp.json>", supported.get(c.mode, set()))
            print(f"{state:10s} {c.key}\n           {' '.join(cmd)}")
        return 0

    out_dir = os.path.abspath(args.out)
    log_dir = os.path.join(out_dir, "logs")
    os.makedirs(log_dir, exist_ok=True)
    prov = dict(version=library_version(), git_commit=git_commit(), hostname=socket.gethostname())
    rows = prev
    try:
        from tqdm import tqdm
    except ImportError:  # bench extra missing: plain loop
        tqdm = None
    bar = tqdm(total=len(todo), desc="sweep", unit="run", disable=None, file=sys.stderr) if tqdm else None
    say = bar.write if bar is not None else print
    n_ok = n_fail = 0
    t_start = time.perf_counter()
    try:
        for cfg in todo:
            if bar is not None:
                bar.set_postfix_str(cfg.key, refresh=True)
            doc, rc, err, wall = run_config(cfg, mpiexec, env, supported.get(cfg.mode, set()), args.timeout, log_dir)
            row = make_row(cfg, doc, rc, err, wall, prov)
            if doc is not None:
                write_record(out_dir, cfg.key, doc, {k: row[k] for k in ("config_key", "status", "error", "returncode",
                                                                         "wall_s", "timestamp", *prov)})
            rows = merge_row(rows, row)
            write_results(out_dir, rows)
            if row["status"] == "ok":
                n_ok += 1
                say(f"[ok]     {cfg.key}: {ok_summary(row)} | {wall:.1f} s")
            else:
                n_fail += 1
                say(f"[failed] {cfg.key}: {row['error']}")
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    plots = []
    try:
        plots = make_plots(out_dir, rows)
    except ImportError as e:
        print(f"[sweep] no plots: {e} (pip install matplotlib, or the package's bench extra)", file=sys.stderr)
    print(f"[sweep] done in {time.perf_counter() - t_start:.1f} s: ran {len(todo)} (ok {n_ok}, failed {n_fail}), "
          f"skipped {n_skip} already ok; results {os.path.join(out_dir, 'results.csv')} and results.json"
          + (f"; plots {', '.join(os.path.basename(x) for x in plots)}" if plots else ""), flush=True)
    return 1 if n_fail else 0


if __name__ == "__main__":
    sys.exit(main())
