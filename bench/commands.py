"""The command registry of ``python -m bench <command> [options]``.

Each command is a module of ``bench`` with

* ``add_arguments(parser)``: its parser factory (shared options from :mod:`bench.cli`, then its own);
* optionally ``check_args(parser, args)``: checks and derived values after parsing (``parser.error``);
* ``run(args) -> int``: the benchmark, returning the exit code (1: a correctness check failed).

Collective commands run under ``mpiexec`` and leave by the MPI exit path
(:func:`bench.cli.run_main`); the others run in one process (under ``mpiexec`` each rank runs its
own copy) and need no MPI.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class Command:
    """One registry entry: ``module`` (under ``bench``), a one-line ``summary`` and whether it is
    ``collective`` (runs under ``mpiexec``, MPI exit path)."""

    module: str
    summary: str
    collective: bool


COMMANDS = {
    "normal": Command("bench.normal", "normal-mode (DeepEP V1) dispatch + combine against MPI Alltoallv, gloo "
                      "all_to_all_single and the memcpy roofline (the main job)", True),
    "low-latency": Command("bench.low_latency", "low-latency (DeepEP LL) dispatch + combine, hook mode and overlap, "
                           "against the same peers and roofline", True),
    "ep": Command("bench.ep", "EPBuffer (DeepEP V2.5) dispatch + combine at a scaled-down DeepEP-Ascend shape, "
                  "against the V1 Buffer path and the same peers on the same work", True),
    "overhead": Command("bench.overhead", "per-call overhead: low-latency, normal and EPBuffer round trips of 1 "
                        "and 8 tokens per rank against MPI moving the same rows", True),
    "soak": Command("bench.soak", "many round trips of mixed normal / cached / low-latency / EPBuffer calls with "
                    "changing shapes, reporting memory (stability, not speed)", True),
    "mega-moe": Command("bench.mega_moe", "MegaMoE's fused call against the unfused stage sequence and plain "
                        "matmuls (DeepGEMM fp8_fp4_mega_moe / bf16_mega_moe)", True),
    "engram": Command("bench.engram", "EngramBuffer (DeepEP V2.5) fetch of per-layer table entries against the same "
                      "fetch over MPI Alltoallv and gloo all_to_all_single", True),
    "pp": Command("bench.pp", "PPBuffer (DeepEP V2.5) send / recv around the ring, against MPI Isend/Irecv and gloo "
                  "isend/irecv on the same tensors", True),
    "bucket": Command("bench.bucket", "BucketBuffer (DeepEP V2.5) all-gather, reduce-scatter and all-reduce, against "
                      "MPI's and gloo's collectives on the same tensors", True),
    "lb": Command("bench.lb", "EPBuffer (DeepEP V2.5) lb_prefetch_weights / lb_reduce_grads of redundant experts, "
                  "against MPI Isend/Irecv and gloo isend/irecv on the same tensors", True),
    "urma-put": Command("bench.urma_put", "URMA put_with_signal bandwidth between two simulated nodes (2 ranks)", True),
    "grouped-gemm": Command("bench.grouped_gemm", "where a grouped bf16 GEMM's time goes, against one plain matmul "
                            "of the same total shape (1 process)", False),
    "combine-sum": Command("bench.combine_sum", "combine's row sum: run-wise BF16 path, float32 chain, "
                           "embedding_bag and the native kernel (1 process)", False),
    "moe-act": Command("bench.moe_act", "MegaMoE's FP8 decode and SwiGLU: native kernels against their torch paths "
                       "(1 process)", False),
    "fp8-decode": Command("bench.fp8_decode", "e4m3 codes to float32: torch's cast against "
                          "deepep_ascend.e4m3_to_float (1 process)", False),
    "logfmt": Command("bench.logfmt", "LogFMT-10 encode and decode (the low-latency combine's lossy format): "
                      "native kernels against the torch path (1 process)", False),
    "ll-receive": Command("bench.ll_receive", "the low-latency dispatch's receive with and without streaming stores, "
                          "and the experts' first read of its rows, cache warm and cold (1 process)", False),
    "sort": Command("bench.sort", "stable orders of small integer keys: torch's argsort against "
                    "deepep_ascend.ordering.stable_argsort (1 process)", False),
    "alloc": Command("bench.alloc", "cost of writing an output into fresh host memory, with and without huge "
                     "pages (1 process)", False),
}


def _module(name: str):
    return importlib.import_module(COMMANDS[name].module)


def parser(name: str) -> argparse.ArgumentParser:
    """The parser of command ``name`` (``KeyError`` for an unknown name)."""
    mod = _module(name)
    # No abbreviations: a shared flag a command lacks must be refused, not taken as a prefix of one of
    # its own options (--num-tokens for overhead's --num-tokens-list).
    p = argparse.ArgumentParser(prog=f"python -m bench {name}", description=mod.__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    mod.add_arguments(p)
    return p


def parse(name: str, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse ``argv`` (default ``sys.argv[2:]``) for command ``name`` and run its checks, the shared ones
    against the job's ranks (:func:`bench.cli.check_job`) included; ``args._argv`` keeps the arguments and
    ``--warmup-s`` becomes :data:`bench.timing.MIN_WARMUP_S`.
    argparse's usage error (exit 2) on bad values, printed by rank 0 of a collective command only."""
    from bench import timing
    from bench.cli import check_job

    timing.MIN_WARMUP_S = timing.DEFAULT_WARMUP_S  # never the last command's, even when this parse fails
    argv = list(sys.argv[2:] if argv is None else argv)
    p = parser(name)
    num_ranks = None
    if COMMANDS[name].collective:
        from mpi4py import MPI

        num_ranks = MPI.COMM_WORLD.Get_size()
        if MPI.COMM_WORLD.Get_rank():  # every rank parses alike: one usage message, not one per rank
            p.error = lambda message: sys.exit(2)
    args = p.parse_args(argv)
    check = getattr(_module(name), "check_args", None)
    if check is not None:
        check(p, args)
    check_job(p, args, num_ranks)
    timing.MIN_WARMUP_S = getattr(args, "warmup_s", timing.DEFAULT_WARMUP_S)
    args._argv = argv
    return args


def call(name: str, argv: Sequence[str] | None = None) -> int:
    """Parse and run command ``name`` in this process and return its exit code, without the MPI
    exit path (tests; a collective command must be called on every rank)."""
    return _module(name).run(parse(name, argv))


def execute(name: str, argv: Sequence[str] | None = None) -> int:
    """Run command ``name`` as the entry point does: a collective command inside
    :func:`bench.cli.run_main` (which ends the process), any other returning its exit code."""
    if COMMANDS[name].collective:
        from bench.cli import run_main

        run_main(lambda: call(name, argv))
    return call(name, argv)


def alias(name: str) -> None:
    """``python -m bench.<module>``: the same as ``python -m bench <name>`` (ends the process)."""
    raise SystemExit(execute(name, sys.argv[1:]))


def _listing() -> str:
    width = max(map(len, COMMANDS))
    return "commands:\n" + "\n".join(f"  {n:<{width}}  {c.summary}" for n, c in COMMANDS.items())


def _shared_listing() -> str:
    from bench import cli

    every = [cli.SHARED[k][0] for k in cli.EVERY_COMMAND]
    rest = [f for f in cli.shared_flags() if f not in every]
    return (f"shared options (bench/cli.py): every command takes {' '.join(every)}; of the others each command "
            f"takes those that apply to it (python -m bench <command> --help lists them): {' '.join(rest)}")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bench <command> [options]`` (``python -m bench --help``: the commands;
    ``python -m bench <command> --help``: its options)."""
    top = argparse.ArgumentParser(
        prog="python -m bench", usage="%(prog)s <command> [options]",
        description="deepep_ascend benchmarks. Collective commands run one process per rank "
                    "(mpiexec -n N python -m bench <command>); --json FILE writes the "
                    "deepep_ascend.bench/1 document (bench/schema.py).",
        epilog=_listing() + "\n\n" + _shared_listing(),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    top.add_argument("command", choices=list(COMMANDS), metavar="<command>", help="one of the commands below")
    top.add_argument("args", nargs=argparse.REMAINDER, metavar="[options]", help="the command's options")

    def error_once(message: str):  # under mpiexec every rank parses alike: one usage message, not one per rank
        if "MPI" in sys.modules or _launched_by_mpiexec():
            from mpi4py import MPI

            if MPI.COMM_WORLD.Get_rank():
                sys.exit(2)
        argparse.ArgumentParser.error(top, message)

    top.error = error_once
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        top.error("a command is required (python -m bench --help lists them)")
    ns = top.parse_args(argv)
    return execute(ns.command, ns.args)


def _launched_by_mpiexec() -> bool:
    """Whether this process is one rank of an ``mpiexec`` job (MPICH's Hydra or Open MPI set these)."""
    import os

    return any(k in os.environ for k in ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK"))
