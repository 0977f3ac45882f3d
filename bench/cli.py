"""The benchmarks' argument vocabulary, declared once, and their exit path under ``mpiexec``.

Shared options (:data:`SHARED`; DeepEP's names where they exist) mean the same in every command;
a command takes the ones it needs with its own defaults (:func:`add_shared`) and adds only its own
options. Every command takes :data:`EVERY_COMMAND` (``--json``, ``--no-progress``), whether it names
them or not, so that a script can pass them to any command. The link-model options are
:func:`add_link_args`. :func:`shared_flags` lists the whole vocabulary (``python -m bench --help``).

=====================  ==========================================================================
``--num-tokens N``     tokens per rank (DeepEP's ``num_tokens``)
``--hidden H``         hidden size, channels per token
``--num-topk K``       experts per token
``--num-experts E``    experts in total, over all ranks
``--iters N``          timed iterations
``--warmup N``         untimed iterations first
``--warmup-s SECONDS`` and untimed for at least this long (taken with ``--warmup``; :data:`bench.timing.MIN_WARMUP_S`)
``--seed S``           input seed (per rank: ``seed * 65536 + rank`` where inputs differ per rank)
``--json FILE``        write the results as a ``deepep_ascend.bench/1`` document (:mod:`bench.schema`)
``--ranks-per-node N`` simulated node size (fewer than the ranks: URMA between simulated nodes)
``--no-progress``      no tqdm progress bar on rank 0 (a no-op in a command without one)
``--phases``           after the timed loop, each call's per-phase breakdown (:mod:`bench.phases`)
``--native-split``     after the timed loop, each call's time in the native kernels and outside them
                       (:mod:`bench.native_split`)
``--link-*``           link model: ``--link-profile``, ``--link-emulation``, ``--link-scale``
=====================  ==========================================================================
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable


def _at_least(kind: type, lo):
    """argparse ``type=``: a finite ``kind`` (int or float) >= ``lo``, else argparse's usage error (exit 2) on
    every rank."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r}") from None
        if not lo <= value < float("inf"):  # (a NaN fails the first comparison)
            finite = " and finite" if kind is float else ""
            raise argparse.ArgumentTypeError(f"must be >= {lo}{finite}, got {text}")
        return value

    parse.__name__ = f"{kind.__name__} >= {lo}"
    return parse


def int_at_least(lo: int):
    """argparse ``type=``: an int >= ``lo``, else argparse's usage error (exit 2) on every rank."""
    return _at_least(int, lo)


def float_at_least(lo: float):
    """argparse ``type=``: a finite float >= ``lo``, else argparse's usage error (exit 2) on every rank."""
    return _at_least(float, lo)


def int_list(lo: int):
    """argparse ``type=``: comma-separated ints, each >= ``lo`` (an empty text is the empty list)."""
    one = int_at_least(lo)

    def parse(text: str) -> list:
        return [one(v) for v in text.split(",")] if text.strip() else []

    parse.__name__ = f"comma-separated ints >= {lo}"
    return parse


def system_list(p: argparse.ArgumentParser, text: str, choices: tuple) -> list:
    """A ``--systems`` value: comma-separated names out of ``choices``, in the order given (blanks
    dropped); ``p.error`` (argparse's usage error, exit 2) for an unknown name or an empty list."""
    systems = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in systems if s not in choices]
    if bad:
        p.error(f"unknown system(s) {bad}; choose from {choices}")
    if not systems:
        p.error(f"--systems is empty; choose from {choices}")
    return systems


#: The shared options: key → (flag, argparse keywords, help). ``type`` of the integer options is
#: filled in by :func:`add_shared` (each command's minimum).
SHARED = {
    "num_tokens": ("--num-tokens", dict(metavar="N"), "tokens per rank"),
    "hidden": ("--hidden", dict(metavar="H"), "hidden size (channels per token)"),
    "num_topk": ("--num-topk", dict(metavar="K"), "experts per token (top-k)"),
    "num_experts": ("--num-experts", dict(metavar="E"), "experts in total, over all ranks"),
    "iters": ("--iters", dict(metavar="N"), "timed iterations"),
    "warmup": ("--warmup", dict(metavar="N"), "untimed iterations first"),
    "warmup_s": ("--warmup-s", dict(type=float_at_least(0.0), metavar="SECONDS"),
                 "and untimed for at least this long (each system; docs/benchmarks.md, \"How timing works\")"),
    "seed": ("--seed", dict(type=int, metavar="S"), "input seed"),
    "json": ("--json", dict(metavar="FILE"), "write the results as JSON (schema deepep_ascend.bench/1, "
                                             "bench/schema.py; rank 0)"),
    "ranks_per_node": ("--ranks-per-node", dict(metavar="N"),
                       "simulated node size (default: the host); fewer than the ranks takes the internode "
                       "paths (URMA between simulated nodes, UBMEM inside)"),
    "no_progress": ("--no-progress", dict(action="store_true"), "no tqdm progress bar on rank 0"),
    "phases": ("--phases", dict(action="store_true"),
               "after the timed loop, run it again with deepep_ascend.ep.phases recording and print each call's "
               "per-phase breakdown (details.phases in --json; docs/benchmarks.md)"),
    "native_split": ("--native-split", dict(action="store_true"),
                     "after the timed loop, run it again with every native call timed and print each call's time "
                     "in the native kernels and outside them (details.native_split in --json; docs/benchmarks.md)"),
}
#: Shared options every command takes (:func:`add_shared` adds those a command does not name), with
#: their defaults: a sweep or a script passes them to any command.
EVERY_COMMAND = {"json": None, "no_progress": False}
#: The link-model flags (:func:`add_link_args`).
LINK_FLAGS = ("--link-profile", "--link-emulation", "--link-scale")
_MINIMUM = {"num_tokens": 1, "hidden": 1, "num_topk": 1, "num_experts": 1, "iters": 1, "warmup": 0, "ranks_per_node": 1}


def add_shared(p: argparse.ArgumentParser, *, minimum: dict | None = None, helps: dict | None = None,
               **defaults) -> None:
    """Add the shared options named by ``defaults``' keys (keys of :data:`SHARED`) with those defaults,
    and those of :data:`EVERY_COMMAND` not named (``--no-progress`` then says the command shows no bar).

    ``minimum``: a command's lower bound of an integer option where it is stricter than the
    vocabulary's; ``helps``: text appended to an option's help (e.g. where its default comes from).
    ``KeyError`` for a name outside the vocabulary (a command's own option belongs in the command).
    """
    minimum, helps = minimum or {}, helps or {}
    unknown = set(defaults) - set(SHARED)
    if unknown:
        raise KeyError(f"not shared options: {sorted(unknown)}")
    if "no_progress" not in defaults:
        helps = {**helps, "no_progress": "this command shows no bar (accepted by every command)"}
    defaults = {**EVERY_COMMAND, **defaults}
    if "warmup" in defaults and "warmup_s" not in defaults:  # the two say together how long a system warms up
        from bench.timing import DEFAULT_WARMUP_S

        defaults["warmup_s"] = DEFAULT_WARMUP_S
    group = p.add_argument_group("shared options (python -m bench --help)")
    for key in SHARED:
        if key not in defaults:
            continue
        flag, kw, text = SHARED[key]
        kw = dict(kw)
        if key in _MINIMUM:
            kw["type"] = int_at_least(minimum.get(key, _MINIMUM[key]))
        default = defaults[key]
        if kw.get("action") != "store_true":
            kw["default"] = default
            if default is not None:
                text += f" (default {default})"
        if key in helps:
            text += f"; {helps[key]}"
        group.add_argument(flag, help=text, **kw)


def check_job(p: argparse.ArgumentParser, a: argparse.Namespace, num_ranks: int | None) -> None:
    """The shared options against each other and against the job of ``num_ranks`` ranks (None: one process),
    before anything runs: ``p.error`` (usage, exit 2) on a value the library would refuse only once the
    benchmark runs, and on a ``--json`` file that could not be written at its end."""
    e, k = getattr(a, "num_experts", None), getattr(a, "num_topk", None)
    if e is not None and k is not None and k > e:
        p.error(f"--num-topk {k} must be at most --num-experts {e}")
    if num_ranks and e is not None and e % num_ranks:
        p.error(f"--num-experts {e} must be a multiple of the number of ranks ({num_ranks})")
    rpn = getattr(a, "ranks_per_node", None)
    if num_ranks and rpn is not None and num_ranks % rpn:
        p.error(f"--ranks-per-node {rpn} must divide the number of ranks ({num_ranks})")
    for flag, path in (("--json", getattr(a, "json", None)), ("--save-routing", getattr(a, "save_routing", None))):
        if path is not None and (not path.strip() or os.path.isdir(path)):
            p.error(f"{flag} {path!r}: needs a file name" + (" (that is a directory)" if path.strip() else ""))
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if folder and (not os.path.isdir(folder) or not os.access(folder, os.W_OK)):
            p.error(f"{flag} {path}: directory {folder} does not exist or is not writable")


def warmup_text(args: argparse.Namespace) -> str:
    """How a command's systems warmed up, for its ``[config]`` line: ``"+N warmup, >= S s"``."""
    return f"+{args.warmup} warmup, >= {args.warmup_s:g} s"


def shared_flags() -> list[str]:
    """Every shared flag, in :data:`SHARED`'s order, then the link-model flags."""
    return [flag for flag, _, _ in SHARED.values()] + list(LINK_FLAGS)


def add_link_args(p: argparse.ArgumentParser) -> None:
    """``--link-profile``, ``--link-emulation``, ``--link-scale`` (checked by :func:`bench.linkmodel.link_setup`)."""
    g = p.add_argument_group("link model (deepep_ascend.transports link profiles; docs/design/transports.md §5)")
    g.add_argument("--link-profile", default="ascend950", metavar="NAME|SPEC",
                   help="profile of the projection and of the emulation: ascend950 (default), ascend950_scaleout, "
                        "none (no projection), or explicit 'UBMEM=GBPS:US,URMA=GBPS:US[,SELF=GBPS:US]'")
    g.add_argument("--link-emulation", choices=("none", "delay"), default="none",
                   help="delay: slow deepep_ascend's UBMEM/URMA transfers to the profile x --link-scale "
                        "(SIMULATION, labelled in every output; the MPI/gloo peers are not slowed)")
    g.add_argument("--link-scale", type=float, default=1e-3,
                   help="time scale of --link-emulation delay (default 1e-3: bandwidths x 1e-3, latencies x 1e3); "
                        "unused without it")


_DERIVED = ("profile", "emulator")  # set by bench.linkmodel.link_setup: objects, the options say them


def params_of(args: argparse.Namespace, num_ranks: int, drop: tuple = ()) -> dict:
    """The ``params`` block of a document: every option of ``args`` (JSON-able values; objects made
    by a command's checks, such as a link profile, left out), ``drop`` left out, plus ``num_ranks``."""
    out = {}
    for k, v in vars(args).items():
        if k in drop or k in _DERIVED or k.startswith("_") or callable(v):
            continue
        if v is None or isinstance(v, (bool, int, float, str)) or (
                isinstance(v, (list, tuple)) and all(isinstance(x, (bool, int, float, str)) for x in v)):
            out[k] = list(v) if isinstance(v, tuple) else v
    out["num_ranks"] = int(num_ranks)
    return out


def finish(comm, code: int = 0) -> None:
    """The benchmark exit path (``deepep_ascend.transports.process.exit_job``): flush, final barrier,
    ``MPI_Finalize``, the C library's ``exit(code)``. Not ``os._exit``, which skips MPICH's PMI
    finalize hook and lets mpiexec kill late ranks (see ``transports.process``).
    Destroy Buffers and process groups before calling this (Python atexit handlers do not run).
    """
    from bench.internals import exit_job

    exit_job(code, comm)


def run_main(main: Callable[[], int]) -> None:
    """Run a collective command under ``mpiexec``: ``main()``, then leave by :func:`finish`.

    A ``SystemExit`` becomes the exit code; any other exception prints its traceback (a
    ``deepep_ascend.settings.SettingError``, a bad environment variable: its message alone) and aborts
    the job (``MPI_Abort``), so a rank that dies never leaves its peers hanging in a collective.
    """
    from mpi4py import MPI

    try:
        code = main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (print(e.code, file=sys.stderr) or 2)
    except BaseException as e:
        import traceback

        from deepep_ascend.settings import SettingError
        # One write (the first peer's Abort may kill this rank mid-print), the error line first; a bad environment
        # variable's message says all there is (no traceback).
        trace = "" if isinstance(e, SettingError) else traceback.format_exc()
        sys.stderr.write(f"[rank {MPI.COMM_WORLD.Get_rank()}] {type(e).__name__}: {e}\n{trace}")
        from bench.internals import abort_job

        abort_job(MPI.COMM_WORLD, 1)  # never falls through to finish()
    finish(MPI.COMM_WORLD, code)
