"""LogFMT-10, the low-latency combine's lossy format: the native kernels against the torch path.

    python -m bench logfmt [--rows-list 8,128,1024] [--hidden 7168] [--scale 0.015625] [--iters 10]

One process, one thread. For each row count, rows of ``randn · scale`` BF16 (the default scale, 2^-6, is what
``python -m bench low-latency --logfmt`` applies to its rows, so that groups fall below 1 and travel as LogFMT;
``--scale 1`` sends most groups as BF16), :func:`deepep_ascend.logfmt10_encode` and
:func:`deepep_ascend.logfmt10_decode` timed interleaved on both paths (``bench.internals.logfmt_encode`` /
``logfmt_decode`` with ``native`` True and False), median over iterations, with the GB/s of the BF16 rows, the
ratio, and whether both paths give the same bits (exit code 1 if not). ``--json FILE``: results
``torch/{encode,decode}/<rows>`` (the baselines) and ``native/{encode,decode}/<rows>``.
"""

from __future__ import annotations

import torch

from bench import cli, schema
from bench import internals as M
from bench.timing import interleaved_medians_ms
from deepep_ascend import native as N

BF16 = torch.bfloat16


def add_arguments(p) -> None:
    """The command's options: the shared ones (``bench.cli``) and its own."""
    p.add_argument("--rows-list", type=cli.int_list(1), default=[8, 128, 1024], metavar="N[,N...]",
                   help="rows per call (default 8,128,1024: one decode step's (token, expert) rows at 1, 16 and "
                        "128 tokens of top-8)")
    p.add_argument("--scale", type=cli.float_at_least(0.0), default=2.0 ** -6,
                   help="the rows are randn times this (default 2^-6, as bench low-latency --logfmt)")
    cli.add_shared(p, hidden=7168, iters=10, warmup=1, seed=0, json=None)


def check_args(p, args) -> None:
    """``p.error`` unless ``--hidden`` is a multiple of the LogFMT group (128)."""
    if args.hidden % 128:
        p.error(f"--hidden must be a multiple of 128 (the LogFMT group), got {args.hidden}")
    if not args.rows_list:
        p.error("--rows-list needs at least one row count")


def run(args) -> int:
    """Time and check both paths at each row count (one process); the exit code: 1 if bits differ."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(args.seed)
    nat = N.available()
    print(f"[config] rows of randn x {args.scale:g}, hidden {args.hidden}, 1 thread, median of {args.iters} "
          f"({cli.warmup_text(args)}), interleaved; native kernels "
          f"{'built' if nat else 'not available (torch path only: nothing to compare)'}")
    same, records = True, []
    for n in args.rows_list:
        x = (torch.randn(n, args.hidden, generator=g) * args.scale).to(BF16)
        enc_t, enc_n = M.logfmt_encode(x, native=False), M.logfmt_encode(x, native=True)
        dec_t, dec_n = M.logfmt_decode(*enc_t, native=False), M.logfmt_decode(*enc_n, native=True)
        ok = (all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(enc_t, enc_n))
              and torch.equal(dec_t.view(torch.int32), dec_n.view(torch.int32)))
        same &= ok
        fallback = float((~M.logfmt_group_mask(enc_n[1])).float().mean())
        nbytes = 2 * x.numel()
        cases = {"encode": (lambda: M.logfmt_encode(x, native=False), lambda: M.logfmt_encode(x, native=True)),
                 "decode": (lambda: M.logfmt_decode(*enc_t, native=False),
                            lambda: M.logfmt_decode(*enc_n, native=True))}
        for what, (torch_fn, native_fn) in cases.items():
            fns = [torch_fn, native_fn] if nat else [torch_fn]
            ms = interleaved_medians_ms(fns, args.iters, args.warmup)
            line = f"[time]   {what} {n:>6} rows: torch {ms[0] * 1e3:10.1f} us ({nbytes / ms[0] / 1e6:6.2f} GB/s)"
            records.append(schema.result(f"torch/{what}/{n}", ms[0] / 1e3, nbytes=nbytes, formula="BF16 rows"))
            if nat:
                line += (f" | native {ms[1] * 1e3:10.1f} us ({nbytes / ms[1] / 1e6:6.2f} GB/s) | {ms[0] / ms[1]:6.2f}x")
                records.append(schema.result(f"native/{what}/{n}", ms[1] / 1e3, nbytes=nbytes, formula="BF16 rows"))
                schema.add_ratios(records, f"native/{what}/{n}", [f"torch/{what}/{n}"])
            print(line + (f" | BF16 groups {100 * fallback:.1f}% | same bits: {ok if nat else 'not compared'}"
                          if what == "encode" else ""))
    print(f"[check]  native and torch paths give the same bits: {same}" if nat else
          "[check]  native kernels not available: nothing compared")
    if args.json:
        schema.write(args.json, schema.document(
            "logfmt", argv=args._argv, params=cli.params_of(args, 1), results=records,
            baselines=[f"torch/{w}/{n}" for n in args.rows_list for w in ("encode", "decode")],
            checks=dict(ok=bool(same), same_bits=bool(same) if nat else None), summary={}, mpi=False))
    return 0 if same else 1


def main(argv=None) -> int:
    """``python -m bench logfmt`` in-process (tests)."""
    from bench import commands

    return commands.call("logfmt", argv)


if __name__ == "__main__":
    from bench import commands

    commands.alias("logfmt")
