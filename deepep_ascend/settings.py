"""Every environment variable that deepep_ascend, its tests and its scripts read, declared once.

Each :class:`Setting` has a name, a type, a default and a meaning. Values are read when they are used,
not at import (a launcher or a test may set one between two calls), and parsed one way: surrounding
blanks are ignored, an empty value counts as unset, and a value that does not parse raises
:class:`SettingError` (a ``ValueError``) naming the variable, what it accepts and what it got.

The table in ``docs/configuration.md`` is this module's :func:`markdown_table` (a test keeps the two
equal); ``python -m deepep_ascend settings`` prints it, and ``python -m deepep_ascend settings check``
validates every declared variable set in the environment. The module also runs as a script
(``python deepep_ascend/settings.py check``), without importing the package: ``scripts/test.sh`` checks
that way first, so that every bad value is named even when one of them (``DEEPEP_ASCEND_NATIVE``, read when
the package loads) would stop the import.

This module imports nothing of the library: every room, the transports included, may read it.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["SETTINGS", "Setting", "SettingError", "check", "main", "markdown_table"]

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class SettingError(ValueError):
    """An environment variable holds a value its setting does not accept."""


@dataclass(frozen=True)
class Setting:
    """One environment variable.

    ``kind`` is how its value parses: ``"float"`` and ``"int"`` (at least ``minimum``, or above it when
    ``exclusive``; below ``limit``, when given), ``"bool"`` (``1/true/yes/on`` or ``0/false/no/off``, any case),
    ``"choice"`` (one of ``choices``, spelled exactly, as the keyword arguments they stand for) or ``"text"`` (as
    given). ``default`` is what :meth:`get` returns when the variable is unset; ``None`` means the caller derives it
    (``default_text`` says how).
    ``scope`` says who reads it: ``library``, ``tests`` or ``scripts``.
    """

    name: str
    kind: str
    default: Any
    meaning: str
    scope: str = "library"
    choices: tuple[str, ...] = ()
    minimum: float | None = None
    exclusive: bool = False
    limit: int | None = None
    default_text: str | None = None

    def raw(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The variable's value with blanks stripped, or ``None`` when unset or empty."""
        value = (os.environ if environ is None else environ).get(self.name)
        if value is None or not value.strip():
            return None
        return value.strip()

    def is_set(self, environ: Mapping[str, str] | None = None) -> bool:
        return self.raw(environ) is not None

    def get(self, environ: Mapping[str, str] | None = None) -> Any:
        """The parsed value, or :attr:`default` when unset.

        Raises:
            SettingError: the value does not parse or is out of range.
        """
        raw = self.raw(environ)
        return self.default if raw is None else self.parse(raw)

    def parse(self, raw: str) -> Any:
        """Parse ``raw`` as this setting's kind (see the class docstring).

        Raises:
            SettingError: naming the variable, what it accepts and ``raw``.
        """
        text = raw.strip()
        if self.kind == "text":
            return text
        if self.kind == "bool":
            low = text.lower()
            if low in _TRUE or low in _FALSE:
                return low in _TRUE
            raise self._error(raw)
        if self.kind == "choice":
            if text in self.choices:
                return text
            raise self._error(raw)
        try:
            value = int(text) if self.kind == "int" else float(text)
        except ValueError:
            raise self._error(raw) from None
        if self.kind == "float" and not math.isfinite(value):  # NaN passes no range check, inf every minimum
            raise self._error(raw)
        if self.minimum is not None and (value <= self.minimum if self.exclusive else value < self.minimum):
            raise self._error(raw)
        if self.limit is not None and value >= self.limit:
            raise self._error(raw)
        return value

    def accepts(self) -> str:
        """What the variable accepts, in words."""
        if self.kind == "bool":
            return "a boolean (1/true/yes/on or 0/false/no/off)"
        if self.kind == "choice":
            return "one of " + ", ".join(repr(c) for c in self.choices)
        if self.kind == "text":
            return "text"
        what = "an integer" if self.kind == "int" else "a finite number"
        if self.minimum is not None:
            what += f" {'>' if self.exclusive else '>='} {self.minimum:g}"
        if self.limit is not None:
            what += f"{' and' if self.minimum is not None else ''} below {self.limit}"
        return what

    def _error(self, raw: str) -> SettingError:
        return SettingError(f"${self.name} must be {self.accepts()}, got {raw!r}")


def _declare(*settings: Setting) -> dict[str, Setting]:
    return {s.name: s for s in settings}


TIMEOUT_S = Setting(
    "DEEPEP_ASCEND_TIMEOUT_S", "float", 100.0,
    "Deadline in seconds of every wait of the library (signals, barriers, a peer's window, the ranks meeting in "
    "a constructor); a timeout names "
    "the phase and the ranks waited for. An explicit `timeout_s=` argument wins; `EPBuffer` takes "
    "`num_cpu_timeout_secs`, else this variable, else DeepEP's 300.",
    minimum=0, exclusive=True)
RANKS_PER_NODE = Setting(
    "DEEPEP_ASCEND_RANKS_PER_NODE", "int", None,
    "Split each host into simulated nodes of this many ranks, row-major (rank = node * n + local_rank); "
    "the `ranks_per_node=` argument wins. Must divide the ranks of every host.",
    minimum=1, default_text="the ranks of one MPI shared-memory domain")
URMA_EXPOSURE = Setting(
    "DEEPEP_ASCEND_URMA_EXPOSURE", "choice", "allocate",
    "How a window that spans nodes is exposed to MPI RMA: one `MPI_Win_allocate` serving UBMEM and URMA "
    "(`allocate`), or shared windows plus `MPI_Win_create` over them (`create`).",
    choices=("allocate", "create"))
LINK_EMULATION = Setting(
    "DEEPEP_ASCEND_LINK_EMULATION", "choice", "none",
    "`delay` makes every put and signal wait as long as the link profile says it would take (scaled by "
    "DEEPEP_ASCEND_LINK_SCALE); `none` moves bytes as fast as the host can.",
    choices=("none", "delay"))
LINK_PROFILE = Setting(
    "DEEPEP_ASCEND_LINK_PROFILE", "text", "ascend950",
    "Link profile of the emulation and of projections: a name from `transports.PROFILES` or explicit "
    "numbers (docs/design/transports.md section 5).")
LINK_SCALE = Setting(
    "DEEPEP_ASCEND_LINK_SCALE", "float", 1e-3,
    "Time scale of the link emulation: emulated seconds per modelled second.",
    minimum=0, exclusive=True)
LANDING_BYTES = Setting(
    "DEEPEP_ASCEND_LANDING_BYTES", "int", None,
    "Bytes per rank of the node-shared segment where normal-mode dispatch lands `recv_x` directly; 0 turns "
    "the direct path off (every dispatch stages through the window).",
    minimum=0, default_text="the Buffer's num_nvl_bytes")
NATIVE = Setting(
    "DEEPEP_ASCEND_NATIVE", "bool", True,
    "Use the native C kernels where they were built; off, every path uses its torch fallback (same bits, "
    "the grouped GEMMs to bf16 rounding). Read once, when deepep_ascend is imported.")
LL_FUSED = Setting(
    "DEEPEP_ASCEND_LL_FUSED", "bool", True,
    "Low-latency calls on one node take the fused path (two native calls per call from a plan of their fixed "
    "operands); off, the step-by-step path (the same bits and counters; for comparing the two). Read when a "
    "Buffer is built.")
LL_STREAM_ROWS = Setting(
    "DEEPEP_ASCEND_LL_STREAM_ROWS", "choice", "large",
    "When a low-latency dispatch's receive stores its rows into `recv_x` by streaming (non-temporal) stores: "
    "`large` when the call's rows take at least DEEPEP_ASCEND_LL_STREAM_MIN_BYTES, `never` or `always` (the same "
    "bytes; native.ll_stream_rows). Read once, when deepep_ascend is imported.",
    choices=("never", "large", "always"))
LL_STREAM_MIN_BYTES = Setting(
    "DEEPEP_ASCEND_LL_STREAM_MIN_BYTES", "int", 16 << 20,
    "The size in bytes of a low-latency dispatch's received rows from which `large` streams them "
    "(docs/design/data-path.md measures the trade-off). Read once, when deepep_ascend is imported.",
    minimum=0, limit=1 << 63)
LL_STREAM_SENDS = Setting(
    "DEEPEP_ASCEND_LL_STREAM_SENDS", "choice", "large",
    "When a combine stores the rows it returns by streaming (non-temporal) stores, a low-latency one into the "
    "other ranks' windows, a normal-mode one on one node into its own staging: `large` when the rows it copies take "
    "at least DEEPEP_ASCEND_LL_STREAM_SEND_MIN_BYTES, `never` or `always` (the same bytes; "
    "native.ll_stream_rows(side='send')). Read once, when deepep_ascend is imported.",
    choices=("never", "large", "always"))
LL_STREAM_SEND_MIN_BYTES = Setting(
    "DEEPEP_ASCEND_LL_STREAM_SEND_MIN_BYTES", "int", 2 << 20,
    "The size in bytes of the rows a combine copies for other ranks from which `large` streams them "
    "(docs/design/data-path.md measures the trade-off). Read once, when deepep_ascend is imported.",
    minimum=0, limit=1 << 63)
ROW_SUMS = Setting(
    "DEEPEP_ASCEND_ROW_SUMS", "choice", "auto",
    "Which loop the native combines' row sums run: `avx2` (each output row's float32 sum in AVX2 registers, 64 "
    "columns at a time), `portable` (a float32 row in memory, vectorised by the compiler) or `auto` (`avx2` where "
    "the CPU has AVX2 but not AVX-512BW). The same bits (native.row_sums_avx2). Read once, when deepep_ascend is "
    "imported.",
    choices=("auto", "avx2", "portable"))
NORMAL_NATIVE = Setting(
    "DEEPEP_ASCEND_NORMAL_NATIVE", "bool", True,
    "Normal-mode calls on one node run their fixed work from a native plan of the engine's operands "
    "(native.IntranodePlan): signals, waits and the chunk-0 exchange by loads and stores, staging, direct stores, "
    "and each chunk's receive in one C call each, the rest of a one-round call in one; off, the transport's "
    "signal() / wait_until() and the torch steps (the same bits and counters; for comparing the two). Read when "
    "a Buffer is built.")
WEIGHT_CACHE_BYTES = Setting(
    "DEEPEP_ASCEND_WEIGHT_CACHE_BYTES", "int", None,
    "Initial budget in bytes of the caches of dequantized and packed weights (the grouped GEMMs' and "
    "MegaMoE's), read when the caches are first used; 0 disables caching. "
    "`set_dequantized_weight_cache(max_bytes=)` changes it at run time.",
    minimum=0, default_text="a quarter of physical memory")
MEGA_MOE_BACKEND = Setting(
    "DEEPEP_ASCEND_MEGA_MOE_BACKEND", "choice", None,
    "MegaMoE's data path: `shm` (node-shared segment, one node only) or `buffer` (the normal-mode "
    "Buffer); the `backend=` argument wins.",
    choices=("shm", "buffer"), default_text="shm on one node, buffer across nodes")
MEGA_MOE_EXPERTS_PER_WAVE = Setting(
    "DEEPEP_ASCEND_MEGA_MOE_EXPERTS_PER_WAVE", "int", None,
    "Local experts per MegaMoE wave (the same on every rank); the `num_experts_per_wave=` argument wins.",
    minimum=1, default_text="one wave per 24 MiB a rank moves, 1 to 4 waves")
MEGA_MOE_GEMM = Setting(
    "DEEPEP_ASCEND_MEGA_MOE_GEMM", "choice", None,
    "Operand type of MegaMoE's expert GEMMs: `bf16` (native bf16 matmul) or `fp32` (float32 matmul of "
    "the bf16 values, bitwise the reference's).",
    choices=("bf16", "fp32"), default_text="bf16 where the CPU multiplies bf16 natively, else fp32")
DG_COMM_KERNEL_DEBUG = Setting(
    "DG_COMM_KERNEL_DEBUG", "int", 0,
    "DeepGEMM's debug switch, read as DeepGEMM reads it (an integer, nonzero is on): MegaMoE then zeroes "
    "its symmetric buffer after every call.",
    minimum=0)

TEST_WATCHDOG_S = Setting(
    "DEEPEP_ASCEND_TEST_WATCHDOG_S", "float", 300.0,
    "Per-test deadline of the test harness; past it every rank prints where it is and the job ends. "
    "`@pytest.mark.watchdog(s)` overrides it for one test.",
    scope="tests", minimum=0, exclusive=True)
TEST_LOG_DIR = Setting(
    "DEEPEP_ASCEND_TEST_LOG_DIR", "text", None,
    "Directory of the ranks' pytest logs (ranks other than 0 write there).",
    scope="tests", default_text="<tmp>/deepep_ascend_tests/<job>")
TEST_LOCAL_EVERY_RANK = Setting(
    "DEEPEP_ASCEND_TEST_LOCAL_EVERY_RANK", "bool", False,
    "Run the tests that use no communicator on every rank of a multi-rank job, not only in the 1-rank job.",
    scope="tests")
TEST_EXIT_MODE = Setting(
    "DEEPEP_ASCEND_TEST_EXIT_MODE", "choice", "barrier",
    "How a test rank leaves: `barrier` (barrier, MPI_Finalize, the C library's exit) or `finalize` (the plain "
    "interpreter exit).",
    scope="tests", choices=("barrier", "finalize"))
TEST_HANG_DIR = Setting(
    "DEEPEP_ASCEND_TEST_HANG_DIR", "text", None,
    "Set by scripts/test.sh: where a rank whose watchdog fired writes whether a test had failed before.",
    scope="tests", default_text="unset: no marker is written")
NESTED_REPORT = Setting(
    "DEEPEP_ASCEND_NESTED_REPORT", "text", None,
    "Set by the tests that launch a child MPI job: the directory where its ranks write their reports.",
    scope="tests", default_text="unset outside those child jobs")
TEST_SHARD = Setting(
    "DEEPEP_ASCEND_TEST_SHARD", "text", None,
    "Set by scripts/test.sh as `i/n` on each process of the 1-rank job it splits: run only the test files at "
    "positions i, i + n, i + 2n, ... of the collection (counted from 0).",
    scope="tests", default_text="unset: every file")
TEST_RANKS = Setting(
    "DEEPEP_ASCEND_TEST_RANKS", "text", "1 2 4 8",
    "Rank counts scripts/test.sh runs the suite at, in order.",
    scope="scripts")
TEST_HANG_RETRIES = Setting(
    "DEEPEP_ASCEND_TEST_HANG_RETRIES", "int", 1,
    "How many times scripts/test.sh runs a rank count again after its watchdog ended a job in which no "
    "test had failed.",
    scope="scripts", minimum=0)
TEST_SHARDS = Setting(
    "DEEPEP_ASCEND_TEST_SHARDS", "int", 2,
    "How many concurrent jobs scripts/test.sh splits its 1-rank job into (each runs every n-th test file); "
    "`1` runs it as one job.",
    scope="scripts", minimum=1, limit=9)
SUITE_TIMEOUT_S = Setting(
    "DEEPEP_ASCEND_SUITE_TIMEOUT_S", "int", 1200,
    "Wall-clock limit in seconds of one mpiexec run of scripts/test.sh.",
    scope="scripts", minimum=1)
SKIP_SETUP = Setting(
    "DEEPEP_ASCEND_SKIP_SETUP", "choice", "0",
    "`1`: scripts/test.sh and scripts/bench.sh skip scripts/setup.sh (everything is installed already).",
    scope="scripts", choices=("0", "1"))
TORCH_VERSION = Setting(
    "DEEPEP_ASCEND_TORCH_VERSION", "text", "2.13.0",
    "torch version scripts/setup.sh installs when torch is missing.",
    scope="scripts")
TORCH_INDEX = Setting(
    "DEEPEP_ASCEND_TORCH_INDEX", "text", None,
    "Package index scripts/setup.sh installs torch from, e.g. https://download.pytorch.org/whl/cpu for "
    "the CPU build.",
    scope="scripts", default_text="pip's default index")

SETTINGS: dict[str, Setting] = _declare(
    TIMEOUT_S, RANKS_PER_NODE, URMA_EXPOSURE, LINK_EMULATION, LINK_PROFILE, LINK_SCALE, LANDING_BYTES, NATIVE,
    LL_FUSED, LL_STREAM_ROWS, LL_STREAM_MIN_BYTES, LL_STREAM_SENDS, LL_STREAM_SEND_MIN_BYTES, ROW_SUMS, NORMAL_NATIVE,
    WEIGHT_CACHE_BYTES, MEGA_MOE_BACKEND, MEGA_MOE_EXPERTS_PER_WAVE, MEGA_MOE_GEMM, DG_COMM_KERNEL_DEBUG,
    TEST_WATCHDOG_S, TEST_LOG_DIR, TEST_LOCAL_EVERY_RANK, TEST_EXIT_MODE, TEST_HANG_DIR, NESTED_REPORT, TEST_SHARD,
    TEST_RANKS, TEST_HANG_RETRIES, TEST_SHARDS, SUITE_TIMEOUT_S, SKIP_SETUP, TORCH_VERSION, TORCH_INDEX)


def _default(s: Setting) -> str:
    if s.default is None:
        return s.default_text or "unset"
    if s.kind == "bool":
        return "1" if s.default else "0"
    return f"{s.default:g}" if isinstance(s.default, float) else str(s.default)


def markdown_table() -> str:
    """The table of every setting, as ``docs/configuration.md`` shows it."""
    rows = ["| variable | read by | accepts | default | meaning |", "|---|---|---|---|---|"]
    for s in SETTINGS.values():
        rows.append(f"| `{s.name}` | {s.scope} | {s.accepts()} | {_default(s)} | {s.meaning} |")
    return "\n".join(rows) + "\n"


def check(environ: Mapping[str, str] | None = None) -> list[str]:
    """The problem of every declared variable set in ``environ`` to a value it does not accept."""
    problems = []
    for s in SETTINGS.values():
        try:
            s.get(environ)
        except SettingError as exc:
            problems.append(str(exc))
    return problems


def main(argv: list[str] | None = None, prog: str = "python -m deepep_ascend settings") -> int:
    """The settings command: print :func:`markdown_table` (``table``, the default), ``check`` the environment and
    exit 1 naming every declared variable set to a value it does not accept, or ``get NAME``: print that variable's
    value as parsed (its default when unset, ``1`` / ``0`` for a boolean, nothing for an unset one without a
    default), exit 1 naming it when set to a value it does not accept. Returns the exit status; argparse exits 2 on
    a usage error (an undeclared name, a name without ``get``)."""
    parser = argparse.ArgumentParser(prog=prog, description="The environment variables of deepep_ascend.")
    parser.add_argument("action", nargs="?", choices=["table", "check", "get"], default="table",
                        help="table (default): print docs/configuration.md's table; check: exit 1 naming every "
                             "declared variable set to a value it does not accept; get NAME: print the variable's "
                             "value as parsed (its default when unset; 1/0 for a boolean), or exit 1 naming it")
    parser.add_argument("name", nargs="?", help="with get: the variable")
    args = parser.parse_args(argv)
    if (args.action == "get") != (args.name is not None):
        parser.error("a variable's name goes with get, and only with it")
    if args.action == "get":
        if args.name not in SETTINGS:
            parser.error(f"{args.name!r} is not a declared variable ({prog} table lists them)")
        try:
            value = SETTINGS[args.name].get()
        except SettingError as exc:
            print(f"deepep_ascend: {exc}", file=sys.stderr)
            return 1
        print("" if value is None else int(value) if isinstance(value, bool) else value)
        return 0
    if args.action == "check":
        problems = check()
        for problem in problems:
            print(f"deepep_ascend: {problem}", file=sys.stderr)
        return 1 if problems else 0
    sys.stdout.write(markdown_table())
    return 0


if __name__ == "__main__":  # as a script, by path: no package import
    sys.exit(main(prog="python deepep_ascend/settings.py"))
