"""MegaMoE's elementwise stages: the native kernels against their torch paths, on one rank's rows.

    python -m bench moe-act [--rows 3072] [--hidden 1024] [--inter 512] [--iters 15]

One process, one thread. The rows of one rank of ``mega-moe``'s ``cpu-pro-mini`` preset at 4
ranks by default (512 tokens x top-6 x 4 ranks / 24 local experts x 24). Timed interleaved, median
over iterations, on the same inputs:

* ``decode``: received FP8 rows (e4m3 codes, then one UE8M0 byte per 32 channels) gathered in
  expert order and decoded to BF16, MegaMoE's decode (``bench.internals.dequant_x``) with and without
  :func:`deepep_ascend.native.dequant_rows_e4m3` (the torch path: a row gather, then
  :func:`deepep_ascend.per_token_cast_back`'s torch path);
* ``swiglu``: MegaMoE's activation (``bench.internals.activation``) on ``[rows, 2 inter]`` BF16 L1 outputs
  (clamp 10, fast math, routing weights, e4m3 round trip with UE8M0 per 32: the fp8xfp4 path),
  with and without :func:`deepep_ascend.native.swiglu`; then the same without the FP8 round trip
  (the bf16xbf16 path), and with ``activation='swigluoai'`` (clamp 7, alpha 1.702, up_bias 1: gpt-oss's,
  DeepGEMM PR #445) and the round trip.

Prints each median, ``torch / native``, and whether both give the same bits (exit code 1 if not).
``--json FILE``: results ``torch/<case>`` (the baselines) and ``native/<case>`` with ``ratio_to``
the torch path (none where the native kernels are not built).
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
    p.add_argument("--rows", type=cli.int_at_least(1), default=3072, help="received rows (default 3072)")
    p.add_argument("--inter", type=cli.int_at_least(32), default=512, help="intermediate size (default 512)")
    cli.add_shared(p, hidden=1024, iters=15, warmup=1, seed=0, json=None, minimum=dict(hidden=32, iters=3))


def check_args(p, args) -> None:
    """``p.error`` unless ``--hidden`` and ``--inter`` are multiples of the UE8M0 group (32)."""
    if args.hidden % 32 or args.inter % 32:
        p.error("--hidden and --inter must be multiples of 32 (the UE8M0 group)")


def run(args) -> int:
    """Time and check the kernels against their torch paths (one process); the exit code: 1 if bits differ."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(args.seed)
    n, h, i = args.rows, args.hidden, args.inter
    # received rows as the Buffer delivers them: codes of random values, then their scale bytes
    x = torch.randn(n, h, generator=g) * 3
    codes = x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    sf = torch.randint(118, 128, (n, h // 32), generator=g, dtype=torch.int32).to(torch.uint8)
    recv = torch.cat([codes, sf], 1)
    order = torch.randperm(n, generator=g)
    hh = (torch.randn(n, 2 * i, generator=g) * 4).to(BF16)
    weights = torch.rand(n, generator=g)
    fp8 = recv[:, :h].view(torch.float8_e4m3fn)

    def decode(native):
        return lambda: M.dequant_x("fp8", fp8, recv[:, h:], BF16, index=order, native=native)

    def act(kind, native, oai=None, clamp=10.0):
        return lambda: M.activation(kind, hh, i, weights, clamp, True, BF16, native=native, oai=oai)

    oai = M.swiglu_params("swigluoai", 1.702, 1.0, "moe-act")
    cases = {"decode": (decode(False), decode(True)),
             "swiglu + e4m3 round trip": (act("fp8", False), act("fp8", True)),
             "swiglu": (act("bf16", False), act("bf16", True)),
             "swigluoai + e4m3 round trip": (act("fp8", False, oai, 7.0), act("fp8", True, oai, 7.0))}
    nat = N.available()
    print(f"[config] {n} rows, hidden {h}, inter {i}, 1 thread, median of {args.iters} interleaved; native kernels "
          f"{'built: ' + str(N.library_path()) if nat else 'not available (torch paths only: nothing to compare)'}")
    same, records = True, []
    if not nat:
        cases = {}
    for name, (torch_fn, native_fn) in cases.items():
        t_torch, t_native = interleaved_medians_ms([torch_fn, native_fn], args.iters, args.warmup)
        a, b = torch_fn(), native_fn()
        ok = torch.equal(a.view(torch.int16), b.view(torch.int16))
        same &= ok
        records += [schema.result(f"torch/{name}", t_torch / 1e3), schema.result(f"native/{name}", t_native / 1e3)]
        schema.add_ratios(records, f"native/{name}", [f"torch/{name}"])
        print(f"[time] {name:<28} torch {t_torch:8.3f} ms | native {t_native:8.3f} ms | torch / native "
              f"{t_torch / t_native:5.2f}x | same bits {ok}")
    if nat:
        print(f"[check] the native kernels give the torch paths' bits: {same}")
    if args.json:
        schema.write(args.json, schema.document(
            "moe-act", argv=args._argv, params=cli.params_of(args, 1), results=records,
            baselines=[r["name"] for r in records if r["system"] == "torch"],
            checks=dict(ok=bool(same), same_bits=bool(same) if nat else None, native=nat), mpi=False))
    return 0 if same else 1


def main(argv=None) -> int:
    """``python -m bench moe-act`` in-process (tests)."""
    from bench import commands

    return commands.call("moe-act", argv)


if __name__ == "__main__":
    from bench import commands

    commands.alias("moe-act")
