"""Combine's row sum: the run-wise BF16 path, the float32 chain, ``embedding_bag`` and the native kernel.

    python -m bench combine-sum [--num-tokens 4096] [--hidden 7168] [--missing 16,64,256,1024] [--iters 5]
                                [--sources 3,4,8] [--num-topk 8] [--ll-tokens 128] [--evict-mb 256]

One process, one thread. Two sources (what every token of a 2-rank combine has), each missing
``--missing`` random tokens of ``--num-tokens``; rows are random BF16, the second marked clean (no
``-0.0``: ``accumulate_rows``' ``clean``, which spares the run-wise path its sign-of-zero pass). For each case
it times
combine's ``accumulate_rows`` (``deepep_ascend.ep.reduce``) on the same inputs, alternating: the run-wise path forced on
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
medians and the tokens per block. ``--json FILE``: one result per path and case, named
``<path>/missing <n>`` and ``<path>/<S> sources`` (paths ``run-wise``, ``float32 chain``,
``embedding_bag``, ``native``), with ``ratio_to`` the float32 chain (the baseline).

Last, where the native kernel runs its AVX2 loop (``native.row_sums_avx2``), the kernel's two loops on the same
inputs, alternating: two sources and each ``--sources`` case, each again with a bias pair, and the low-latency
combine's weighted sum (``native.weighted_sum_rows``) of ``--ll-tokens`` tokens of ``--num-topk`` distinct rows
each, warm and cold (``--evict-mb`` MB written before each call, untimed); ``[loops]`` lines, records
``avx2/<case>`` and ``portable/<case>`` (``ratio_to`` the portable loop), their bits checked equal (the rows carry
a few special values: -0.0, infinities, NaN, a near-overflow and a subnormal).
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from bench import cli, schema
from bench import internals as I
from bench.timing import interleaved_medians_ms
from deepep_ascend import native as N


def add_arguments(p) -> None:
    """The command's options: the shared ones (``bench.cli``) and its own."""
    cli.add_shared(p, num_tokens=4096, hidden=7168, num_topk=8, iters=5, warmup=1, seed=0, json=None,
                   helps=dict(num_topk="the many-source cases' routing"))
    p.add_argument("--missing", type=cli.int_list(0), default=[16, 64, 256, 1024],
                   help="comma-separated tokens each source misses (default 16,64,256,1024)")
    p.add_argument("--sources", type=cli.int_list(1), default=[3, 4, 8],
                   help="comma-separated source counts for the many-source cases (default 3,4,8; empty: none)")
    p.add_argument("--ll-tokens", type=cli.int_at_least(0), default=128,
                   help="tokens of the low-latency weighted sum timed with both native loops (default 128, a decode "
                        "step's; 0: none)")
    p.add_argument("--evict-mb", type=cli.int_at_least(1), default=256,
                   help="MB written before each call of the loops' cold regime, untimed (default 256: past this "
                        "host's caches)")


def run(args) -> int:
    """Time and check the paths (one process); the exit code: 1 if their bits differ."""
    missing, many = args.missing, args.sources
    torch.set_num_threads(1)
    m, h = args.num_tokens, args.hidden
    g = torch.Generator().manual_seed(args.seed)
    out_runs = torch.empty(m, h, dtype=torch.bfloat16)
    out_chain = torch.empty_like(out_runs)
    out_native = torch.empty_like(out_runs)
    nat = N.available()

    def timed(fns):
        """Interleaved medians (ms) of ``fns``, plus the native kernel's on ``sources`` last if built."""
        fns = list(fns) + ([lambda: N.sum_rows(out_native, sources)] if nat else [])
        times = list(interleaved_medians_ms(fns, args.iters, args.warmup))
        return times + ([] if nat else [float("nan")])

    def same_bits(*outs):
        outs = outs + ((out_native,) if nat else ())
        return all(torch.equal(o.view(torch.int16), outs[0].view(torch.int16)) for o in outs[1:])
    acc, tmp = I.CombineScratch().get(h)
    limit = I.two_source_run_limit(m, h)
    print(f"[config] {m} tokens x hidden {h}, two sources, 1 thread, median of {args.iters}; "
          f"two_source_run_limit = {limit} runs; native kernel "
          f"{'built: ' + str(N.library_path()) if nat else 'not available (torch paths only)'}")
    points, same, records = [], True, []

    def record(case, **ms):  # one result per path of a case, ratio_to the float32 chain
        names = []
        for path, t in ms.items():
            if t == t:  # NaN: the native kernel is not built
                names.append(f"{path}/{case}")
                records.append(schema.result(names[-1], t / 1e3, phase=case))
        for n in names:
            schema.add_ratios(records, n, [f"float32 chain/{case}"])
    for miss in missing:
        sources = []
        for _ in range(2):
            keep = torch.ones(m, dtype=torch.bool)
            keep[torch.randperm(m, generator=g)[:min(miss, m)]] = False
            tokens = torch.nonzero(keep).squeeze(1)
            sources.append((torch.randn(tokens.numel(), h, generator=g).to(torch.bfloat16), tokens))
        runs = I.source_runs(m, [tokens for _, tokens in sources])[1].numel() + 1
        kw = dict(clean=[False, True])  # the second source known free of -0.0
        t_runs, t_chain, t_nat = timed(
            [lambda: I.accumulate_rows(out_runs, sources, acc, tmp, max_runs=m, native=False, **kw),
             lambda: I.accumulate_rows(out_chain, sources, acc, tmp, max_runs=0, bags=False, native=False, **kw)])
        ok = same_bits(out_runs, out_chain)
        same &= ok
        points.append((runs, t_runs, t_chain, t_nat))
        record(f"missing {miss}", **{"run-wise": t_runs, "float32 chain": t_chain, "native": t_nat})
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
        record(f"{num} sources", **{"float32 chain": t_chain, "embedding_bag": t_bags, "native": t_nat})
        print(f"[bags]   {num} sources, each with a token at p = {present:.2f} ({rows / m:.2f} rows per token, "
              f"{acc.size(0) // num} tokens per block): "
              f"float32 chain {t_chain:8.2f} ms | embedding_bag {t_bags:8.2f} ms | native {t_nat:8.2f} ms | "
              f"chain / bags {t_chain / t_bags:5.2f}x | bags / native {t_bags / t_nat:5.2f}x | same bits {ok}")
    if nat:
        same &= _loops(args, g, records)
    print(f"[check]  all paths give the same bits in every case: {same}")
    if args.json:
        schema.write(args.json, schema.document(
            "combine-sum", argv=args._argv, params=cli.params_of(args, 1), results=records,
            baselines=[r["name"] for r in records if r["system"] in ("float32 chain", "portable")],
            checks=dict(ok=bool(same), same_bits=bool(same)), mpi=False,
            details=dict(two_source_run_limit=limit, native=nat,
                         runs={f"missing {k}": p[0] for k, p in zip(missing, points)})))
    return 0 if same else 1


def _loops(args, g, records: list) -> bool:
    """The native kernel's two loops (``native.row_sums_avx2``: each output row's sum in AVX2 registers, or a float32
    row in memory) on the same inputs, alternating: two sources and every ``--sources`` case, each again with a bias
    pair, and the low-latency combine's weighted sum of
    ``--ll-tokens`` tokens of ``--num-topk`` distinct rows each, warm and cold (``--evict-mb`` MB written before each
    call). Prints one line per case, records ``avx2/<case>`` and ``portable/<case>``; returns whether the loops gave
    the same bits everywhere (True where the AVX2 loop does not run: nothing to compare)."""
    before = N.row_sums_avx2()
    if not N.row_sums_avx2(True):
        print("[loops]  the row sums' AVX2 loop does not run on this CPU: only the portable loop")
        N.row_sums_avx2(before)
        return True
    m, h = args.num_tokens, args.hidden
    evict = torch.zeros(args.evict_mb << 18, dtype=torch.int32)
    specials = torch.tensor([-0.0, float("inf"), float("-inf"), float("nan"), 3.0e38, 1e-40], dtype=torch.bfloat16)

    def rows_of(n: int) -> torch.Tensor:
        """``n`` random BF16 rows with a few special values (the loops' bits are compared on them too)."""
        x = torch.randn(n, h, generator=g).to(torch.bfloat16)
        if x.numel():
            x.view(-1)[torch.randint(0, x.numel(), (len(specials),), generator=g)] = specials
        return x

    cases = []
    for num in sorted({2, *args.sources}):  # two sources: what every token of a 2-rank combine has
        present = 1.0 - (1.0 - 1.0 / num) ** args.num_topk
        sources = [(rows_of(int(t.numel())), t) for t in
                   (torch.nonzero(torch.rand(m, generator=g) < present).squeeze(1) for _ in range(num))]
        bias = (rows_of(m), rows_of(m))
        for label, b in ((f"{num} sources", None), (f"{num} sources + bias pair", bias)):
            cases.append((label, torch.empty(m, h, dtype=torch.bfloat16),
                          lambda out, s=sources, b=b: N.sum_rows(out, s, b), False))
    if args.ll_tokens:
        t, k = args.ll_tokens, args.num_topk
        rows = rows_of(t * k)
        index = torch.randperm(t * k, generator=g).view(t, k)
        weights = torch.rand(t, k, generator=g)
        for regime in ("warm", "cold"):
            cases.append((f"low-latency weighted sum, {t} tokens x top-{k}, {regime}",
                          torch.empty(t, h, dtype=torch.bfloat16),
                          lambda out: N.weighted_sum_rows(out, rows, index, weights), regime == "cold"))
    same = True
    try:
        for label, out, fn, cold in cases:
            outs = {"avx2": out, "portable": torch.empty_like(out)}
            times = {loop: [] for loop in outs}
            for i in range(args.warmup + args.iters):
                for loop, o in outs.items():
                    N.row_sums_avx2(loop)
                    if cold:
                        evict.add_(1)
                    t0 = time.perf_counter()
                    fn(o)
                    if i >= args.warmup:
                        times[loop].append(time.perf_counter() - t0)
            ok = torch.equal(outs["avx2"].view(torch.int16), outs["portable"].view(torch.int16))
            same &= ok
            ms = {loop: statistics.median(ts) * 1e3 for loop, ts in times.items()}
            for loop, t in ms.items():
                records.append(schema.result(f"{loop}/{label}", t / 1e3, phase=label))
            schema.add_ratios(records, f"avx2/{label}", [f"portable/{label}"])
            print(f"[loops]  {label}: avx2 {ms['avx2']:8.3f} ms | portable {ms['portable']:8.3f} ms | "
                  f"portable / avx2 {ms['portable'] / ms['avx2']:5.2f}x | same bits {ok}")
    finally:
        N.row_sums_avx2(before)
    return same


def main(argv=None) -> int:
    """``python -m bench combine-sum`` in-process (tests)."""
    from bench import commands

    return commands.call("combine-sum", argv)


if __name__ == "__main__":
    from bench import commands

    commands.alias("combine-sum")
