"""Decoding e4m3 codes to float32: torch's cast against :func:`deepep_ascend.e4m3_to_float`.

    python -m bench fp8-decode [--rows 3072] [--hidden 1024] [--iters 9]

One process, one thread. Prints the median time of ``x.float()`` (torch's CPU cast from
``float8_e4m3fn``) and of ``e4m3_to_float(x)`` on the same ``[rows, hidden]`` codes (random
activations cast with ``cast_to_e4m3``, which saturates, so no NaN code), checks that both give
the same bits there and on a copy holding every code once (NaN included; timed too), and prints
the ratio. The default shape is the received rows of one rank of
``mega-moe``'s ``cpu-pro-mini`` preset. ``--json FILE``: results ``torch/float`` (the baseline),
``deepep_ascend/e4m3_to_float`` and ``deepep_ascend/e4m3_to_float_nan`` (bytes: the codes read).
"""

from __future__ import annotations

import torch

import deepep_ascend as dea
from bench import cli, schema
from bench.timing import interleaved_medians_ms


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))  # NaN payloads and signed zeros included


def _median_ms(fn, iters: int, warmup: int) -> float:
    return interleaved_medians_ms([fn], iters, warmup)[0]


def add_arguments(p) -> None:
    """The command's options: the shared ones (``bench.cli``) and its own."""
    p.add_argument("--rows", type=cli.int_at_least(1), default=3072, help="rows of codes (default 3072)")
    cli.add_shared(p, hidden=1024, iters=9, warmup=1, seed=0, json=None)


def run(args) -> int:
    """Time and check the two decoders (one process); the exit code: 1 if their bits differ."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(args.seed)
    x = dea.cast_to_e4m3(torch.randn(args.rows, args.hidden, generator=g) * 64)  # saturating: no NaN code
    with_nan = x.clone()
    flat = with_nan.view(torch.uint8).view(-1)
    n = min(256, flat.numel())
    flat[:n] = torch.arange(256, dtype=torch.int32).to(torch.uint8)[:n]  # every code once, NaN included
    same = all(_same_bits(v.float(), dea.e4m3_to_float(v)) for v in (x, with_nan))
    t_torch = _median_ms(lambda: x.float(), args.iters, args.warmup)
    t_ours = _median_ms(lambda: dea.e4m3_to_float(x), args.iters, args.warmup)
    t_nan = _median_ms(lambda: dea.e4m3_to_float(with_nan), args.iters, args.warmup)
    print(f"[config] {args.rows} x {args.hidden} e4m3 codes, 1 thread, median of {args.iters}")
    print(f"[time]   torch x.float()      {t_torch:8.3f} ms")
    print(f"[time]   e4m3_to_float(x)     {t_ours:8.3f} ms ({t_nan:.3f} ms when NaN codes are present: one more "
          f"masked pass)")
    print(f"[check]  same bits as torch's cast (random codes, and every code incl. NaN): {same}")
    ratio = t_torch / t_ours
    how = f"{ratio:.1f}x faster than" if ratio >= 1 else f"{1 / ratio:.1f}x slower than"
    print(f"[summary] e4m3_to_float is {how} torch's cast")
    if args.json:
        nbytes = x.numel()  # one byte per code read
        records = [schema.result(name, ms / 1e3, nbytes=nbytes, formula="e4m3 codes read")
                   for name, ms in (("torch/float", t_torch), ("deepep_ascend/e4m3_to_float", t_ours),
                                    ("deepep_ascend/e4m3_to_float_nan", t_nan))]
        for r in records[1:]:
            schema.add_ratios(records, r["name"], ["torch/float"])
        schema.write(args.json, schema.document("fp8-decode", argv=args._argv, params=cli.params_of(args, 1),
                                                results=records, baselines=["torch/float"],
                                                checks=dict(ok=bool(same), same_bits_as_torch=bool(same)),
                                                summary=dict(torch_over_e4m3_to_float=ratio), mpi=False))
    return 0 if same else 1


def main(argv=None) -> int:
    """``python -m bench fp8-decode`` in-process (tests)."""
    from bench import commands

    return commands.call("fp8-decode", argv)


if __name__ == "__main__":
    from bench import commands

    commands.alias("fp8-decode")
