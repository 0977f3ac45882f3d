"""Combine's row sum: the run-wise BF16 path, the float32 chain, ``embedding_bag`` and the native kernel.

    python -m bench.combine_sum [--tokens 4096] [--hidden 7168] [--missing 16,64,256,1024] [--iters 5]
                                [--sources 3,4,8] [--num-topk 8]

One process, one thread. Two sources (what every token of a 2-rank combine has), each missing
``--missing`` random tokens of ``--tokens``; rows are random BF16, the second marked clean (no
``-0.0``) as combine marks the rows a peer staged. For each case it times
``reduce.accumulate_rows`` on the same inputs, alternating: the run-wise path forced on
(``max_runs=tokens``) and forced off (``max_runs=0, bags=False, native=False``, the float32
chain), and :func:`deepep_ascend.native.sum_rows` (where it was built), checks that all give the
same bits, and prints the run count, the medians, the cost per run of the run-wise path, and
what ``accumulate_rows`` picks by default: the native kernel where it was built, else the
run-wise path while :func:`~deepep_ascend.ep.reduce.two_source_run_limit` keeps it (past it the
``embedding_bag`` sum timed below). Its last
line fits the run-wise and chain costs (least squares: run-wise = a + b * runs, chain = c) and
prints the break-even run count against the limit.

Then, for each ``--sources`` count ``S`` (what an origin of an ``S``-rank combine sees), ``S``
sources that each hold a token with the probability that top-``--num-topk`` routing over ``S``
equal ranks reaches a rank, ``1 - (1 - 1/S)^k``: it times the float32 chain, the
:func:`~deepep_ascend.ep.reduce._sum_by_bags` path forced (``max_runs=0, bags=True,
native=False``; the default without the native kernel for three or more sources, and for two
whose runs are too many, while a block holds ``_BAG_MIN_TOKENS`` tokens) and the native kernel
(the default where it was built), alternating, checks all give the same bits, and prints the
medians and the tokens per block.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from bench import common as C
from bench.alloc import _interleaved_medians_ms
from deepep_ascend.ep import reduce as I
from deepep_ascend import native as N


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.combine_sum", description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=C.int_at_least(1), default=4096)
    ap.add_argument("--hidden", type=C.int_at_least(1), default=7168)
    ap.add_argument("--missing", default="16,64,256,1024", help="comma-separated tokens each source misses")
    ap.add_argument("--iters", type=C.int_at_least(1), default=5)
    ap.add_argument("--sources", default="3,4,8", help="comma-separated source counts for the many-source cases")
    ap.add_argument("--num-topk", type=C.int_at_least(1), default=8)
    args = ap.parse_args(argv)
    missing = [C.int_at_least(0)(v) for v in args.missing.split(",")]
    many = [C.int_at_least(1)(v) for v in args.sources.split(",")] if args.sources else []
    torch.set_num_threads(1)
    m, h = args.tokens, args.hidden
    g = torch.Generator().manual_seed(0)
    out_runs = torch.empty(m, h, dtype=torch.bfloat16)
    out_chain = torch.empty_like(out_runs)
    out_native = torch.empty_like(out_runs)
    nat = N.available()

    def timed(fns):
        """Interleaved medians (ms) of ``fns``, plus the native kernel's on ``sources`` last if built."""
        fns = list(fns) + ([lambda: N.sum_rows(out_native, sources)] if nat else [])
        times = list(_interleaved_medians_ms(fns, args.iters))
        return times + ([] if nat else [float("nan")])

    def same_bits(*outs):
        outs = outs + ((out_native,) if nat else ())
        return all(torch.equal(o.view(torch.int16), outs[0].view(torch.int16)) for o in outs[1:])
    acc, tmp = I.CombineScratch().get(h)
    limit = I.two_source_run_limit(m, h)
    print(f"[config] {m} tokens x hidden {h}, two sources, 1 thread, median of {args.iters}; "
          f"two_source_run_limit = {limit} runs; native kernel "
          f"{'built: ' + str(N.library_path()) if nat else 'not available (torch paths only)'}")
    points, same = [], True
    for miss in missing:
        sources = []
        for _ in range(2):
            keep = torch.ones(m, dtype=torch.bool)
            keep[torch.randperm(m, generator=g)[:min(miss, m)]] = False
            tokens = torch.nonzero(keep).squeeze(1)
            sources.append((torch.randn(tokens.numel(), h, generator=g).to(torch.bfloat16), tokens))
        runs = I.source_runs(m, [tokens for _, tokens in sources])[1].numel() + 1
        kw = dict(clean=[False, True])  # as in combine: own rows as given, the peer's staged with + 0.0
        t_runs, t_chain, t_nat = timed(
            [lambda: I.accumulate_rows(out_runs, sources, acc, tmp, max_runs=m, native=False, **kw),
             lambda: I.accumulate_rows(out_chain, sources, acc, tmp, max_runs=0, bags=False, native=False, **kw)])
        ok = same_bits(out_runs, out_chain)
        same &= ok
        points.append((runs, t_runs, t_chain, t_nat))
        # accumulate_rows' default past the limit
        pick = "native" if nat else "run-wise" if runs <= limit else "embedding_bag"
        print(f"[case]   missing {miss:5d}: {runs:5d} runs | run-wise {t_runs:8.2f} ms | float32 chain "
              f"{t_chain:8.2f} ms | native {t_nat:8.2f} ms (run-wise / native {t_runs / t_nat:5.2f}x) | "
              f"{t_runs / runs * 1e3:7.1f} us per run | "
              f"default {pick} | same bits {ok}")
    if len({p[0] for p in points}) >= 2:
        b, a = np.polyfit([p[0] for p in points], [p[1] for p in points], 1)  # run-wise = a + b * runs
        c = float(np.mean([p[2] for p in points]))
        even = (c - a) / b if b > 0 else float("inf")
        saved = (c - a) / (m * h) * 1e6
        print(f"[fit]    run-wise {a:.2f} ms + {b * 1e3:.1f} us/run; float32 chain {c:.2f} ms "
              f"({saved:.2f} ns/element more than the run-wise base); break-even ~{even:.0f} runs "
              f"= m*hidden/{m * h / even:.0f}; limit {limit} = m*hidden/{m * h / limit:.0f}")

    for num in many:
        present = 1.0 - (1.0 - 1.0 / num) ** args.num_topk
        sources = []
        for _ in range(num):
            tokens = torch.nonzero(torch.rand(m, generator=g) < present).squeeze(1)
            sources.append((torch.randn(tokens.numel(), h, generator=g).to(torch.bfloat16), tokens))
        rows = sum(tokens.numel() for _, tokens in sources)
        t_chain, t_bags, t_nat = timed(
            [lambda: I.accumulate_rows(out_chain, sources, acc, tmp, max_runs=0, bags=False, native=False),
             lambda: I.accumulate_rows(out_runs, sources, acc, tmp, max_runs=0, bags=True, native=False)])
        ok = same_bits(out_runs, out_chain)
        same &= ok
        print(f"[bags]   {num} sources, each with a token at p = {present:.2f} ({rows / m:.2f} rows per token, "
              f"{acc.size(0) // num} tokens per block): "
              f"float32 chain {t_chain:8.2f} ms | embedding_bag {t_bags:8.2f} ms | native {t_nat:8.2f} ms | "
              f"chain / bags {t_chain / t_bags:5.2f}x | bags / native {t_bags / t_nat:5.2f}x | same bits {ok}")
    print(f"[check]  all paths give the same bits in every case: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
