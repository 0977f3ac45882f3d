"""Decoding e4m3 codes to float32: torch's cast against :func:`deepep_ascend.e4m3_to_float`.

    python -m bench.fp8_decode [--rows 3072] [--hidden 1024] [--iters 9]

One process, one thread. Prints the median time of ``x.float()`` (torch's CPU cast from
``float8_e4m3fn``) and of ``e4m3_to_float(x)`` on the same ``[rows, hidden]`` codes (random
activations cast with ``cast_to_e4m3``, which saturates, so no NaN code), checks that both give
the same bits there and on a copy holding every code once (NaN included; timed too), and prints
the ratio. The default shape is the received rows of one rank of
``bench.mega_moe``'s ``cpu-pro-mini`` preset.
"""

from __future__ import annotations

import argparse

import torch

import deepep_ascend as dea
from bench import common as C
from bench.alloc import _median_ms


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))  # NaN payloads and signed zeros included


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.fp8_decode", description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=C.int_at_least(1), default=3072)
    ap.add_argument("--hidden", type=C.int_at_least(1), default=1024)
    ap.add_argument("--iters", type=C.int_at_least(1), default=9)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x = dea.cast_to_e4m3(torch.randn(args.rows, args.hidden, generator=g) * 64)  # saturating: no NaN code
    with_nan = x.clone()
    flat = with_nan.view(torch.uint8).view(-1)
    n = min(256, flat.numel())
    flat[:n] = torch.arange(256, dtype=torch.int32).to(torch.uint8)[:n]  # every code once, NaN included
    same = all(_same_bits(v.float(), dea.e4m3_to_float(v)) for v in (x, with_nan))
    t_torch = _median_ms(lambda: x.float(), args.iters)
    t_ours = _median_ms(lambda: dea.e4m3_to_float(x), args.iters)
    t_nan = _median_ms(lambda: dea.e4m3_to_float(with_nan), args.iters)
    print(f"[config] {args.rows} x {args.hidden} e4m3 codes, 1 thread, median of {args.iters}")
    print(f"[time]   torch x.float()      {t_torch:8.3f} ms")
    print(f"[time]   e4m3_to_float(x)     {t_ours:8.3f} ms ({t_nan:.3f} ms when NaN codes are present: one more "
          f"masked pass)")
    print(f"[check]  same bits as torch's cast (random codes, and every code incl. NaN): {same}")
    ratio = t_torch / t_ours
    how = f"{ratio:.1f}x faster than" if ratio >= 1 else f"{1 / ratio:.1f}x slower than"
    print(f"[summary] e4m3_to_float is {how} torch's cast")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
