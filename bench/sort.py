"""Stable orders of small integer keys: torch's ``argsort(stable=True)`` against
:func:`deepep_ascend.ordering.stable_argsort`.

    python -m bench sort [--sizes 64,1024,6144,32768,262144] [--num-experts 256] [--iters 25]

One process, one thread. For each size, keys drawn uniformly from ``[-1, num_experts)`` (expert ids
with dropped slots, as the expanded dispatch, the training glue and MegaMoE sort them), the median
time of both orders, interleaved, and whether they give the same permutation; then the ratio.
``--json FILE``: results ``torch/argsort/<n>`` (the baselines) and ``deepep_ascend/stable_argsort/<n>``
(bytes: the int64 keys read).
"""

from __future__ import annotations

import torch

from bench import cli, schema
from bench.timing import interleaved_medians_ms
from deepep_ascend.ordering import stable_argsort


def add_arguments(p) -> None:
    """The command's options: the shared ones (``bench.cli``) and its own."""
    p.add_argument("--sizes", type=cli.int_list(1), default=[64, 1024, 6144, 32768, 262144], metavar="N[,N...]",
                   help="numbers of keys (default 64,1024,6144,32768,262144)")
    cli.add_shared(p, num_experts=256, iters=25, warmup=2, seed=0, json=None)


def run(args) -> int:
    """Time and check both orders at each size (one process); the exit code: 1 if a permutation differs."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(args.seed)
    E = args.num_experts
    print(f"[config] keys uniform in [-1, {E}), 1 thread, median of {args.iters} ({cli.warmup_text(args)}), "
          f"interleaved")
    records, ok = [], True
    for n in args.sizes:
        keys = torch.randint(-1, E, (n,), generator=g)
        same = torch.equal(torch.argsort(keys, stable=True), stable_argsort(keys, -1, E))
        ok &= same
        t_torch, t_ours = interleaved_medians_ms([lambda: torch.argsort(keys, stable=True),
                                                  lambda: stable_argsort(keys, -1, E)], args.iters, args.warmup)
        print(f"[time]   {n:>8} keys: torch argsort {t_torch * 1e3:9.1f} us | stable_argsort {t_ours * 1e3:9.1f} us "
              f"| {t_torch / t_ours:5.2f}x | same permutation: {same}")
        for name, ms in ((f"torch/argsort/{n}", t_torch), (f"deepep_ascend/stable_argsort/{n}", t_ours)):
            records.append(schema.result(name, ms / 1e3, nbytes=8 * n, formula="int64 keys read"))
        schema.add_ratios(records, f"deepep_ascend/stable_argsort/{n}", [f"torch/argsort/{n}"])
    print(f"[check]  same permutations as torch's stable argsort: {ok}")
    if args.json:
        schema.write(args.json, schema.document("sort", argv=args._argv, params=cli.params_of(args, 1),
                                                results=records,
                                                baselines=[f"torch/argsort/{n}" for n in args.sizes],
                                                checks=dict(ok=bool(ok), same_as_torch=bool(ok)), summary={},
                                                mpi=False))
    return 0 if ok else 1


def main(argv=None) -> int:
    """``python -m bench sort`` in-process (tests)."""
    from bench import commands

    return commands.call("sort", argv)


if __name__ == "__main__":
    from bench import commands

    commands.alias("sort")
