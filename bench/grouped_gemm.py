"""Where a grouped bf16 GEMM's time goes, against one plain matmul of the same total shape.

    python -m bench grouped-gemm [--groups 24] [--rows 3072] [--k 1024] [--n 1024] [--iters 15]

One process, one thread. ``rows`` rows are spread over ``groups`` groups by random routing (the
received pairs of one rank of ``mega-moe``'s ``cpu-pro-mini`` preset at 4 ranks, L1 shape by
default). Timed interleaved in every iteration, median over iterations:

* ``plain``: ``[rows, k] @ [k, n]``, one weight matrix (the target's reference);
* ``grouped, public``: :func:`deepep_ascend.m_grouped_bf16_gemm_nt_contiguous` on the psum layout
  aligned to 128 rows per group (what the unfused MegaMoE sequence calls; it runs on the AMX kernel
  where that runs, else on oneDNN's packed weights);
* ``per group, matmul``: one ``torch.matmul`` per group on rows sorted by group (no padding): each
  call re-packs its weight for oneDNN;
* ``per group, oneDNN packed``: the same on weights packed once for oneDNN's inner product (the
  library's path without AMX);
* ``per group, AMX``: the same on the library's AMX kernel (:func:`deepep_ascend.native.gemm_bf16_amx`,
  what MegaMoE runs where AMX is available), writing into one output;
* ``per group, AMX, FP4 weights``: the same on the weights cast to MXFP4 (e2m1, UE8M0 scale per 32),
  packed as :class:`deepep_ascend.native.AmxFp4Weight` (a quarter of the bytes): the kernel decodes each
  panel into bf16 tiles while the previous one multiplies (what MXFP4 weights run on in the FP8 x FP4
  grouped GEMMs and MegaMoE);
* ``per group, AMX, one weight``: the same calls, every group on the first group's packed weight,
  which stays in cache: the difference to ``AMX`` is the cost of streaming ``groups`` weights;
* ``one group, AMX``: the AMX kernel on the plain matmul's own operands (all rows, one weight): the kernel
  against oneDNN on one tall matrix, without the grouping;
* ``copy of the weights``: one read and one write of all ``groups`` weights;
* ``pack, oneDNN`` / ``pack, AMX``: packing all ``groups`` weights for either kernel (what a call pays
  when its weights are not in the cache: first use, an in-place update, or more weights in use than the
  cache holds).

Prints each time and ``plain / time`` (the target: grouped >= 0.70 of plain), and checks that
the grouped variants' products lie within bf16 rounding of a float64 reference (the FP4 row: of its own
weights' values; exit code 1 if not). ``--json FILE``: one result per row above, named as printed,
with ``ratio_to`` the plain matmul (the baseline) for the GEMM rows.
"""

from __future__ import annotations

import torch

import deepep_ascend as dea
from bench import cli, schema
from bench import internals as mm
from bench.moe_stages import psum_layout
from bench.timing import interleaved_medians_ms
from deepep_ascend import native

BF16 = torch.bfloat16
GEMM_ROWS = ("grouped", "per group", "one group")  # the rows compared with the plain matmul


def add_arguments(p) -> None:
    """The command's options: the shared ones (``bench.cli``) and its own."""
    p.add_argument("--groups", type=cli.int_at_least(1), default=24, help="groups (experts; default 24)")
    p.add_argument("--rows", type=cli.int_at_least(1), default=3072, help="rows over all groups (default 3072)")
    p.add_argument("--k", type=cli.int_at_least(1), default=1024, help="reduction size (default 1024)")
    p.add_argument("--n", type=cli.int_at_least(1), default=1024, help="output columns (default 1024)")
    cli.add_shared(p, iters=15, warmup=1, seed=0, json=None, minimum=dict(iters=3))


def run(args) -> int:
    """Time and check the variants (one process); the exit code: 1 if a product is off."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(args.seed)
    G, M, K, N = args.groups, args.rows, args.k, args.n
    counts = torch.bincount(torch.randint(0, G, (M,), generator=g), minlength=G)
    bounds = [0] + counts.cumsum(0).tolist()
    ends, end, pos = psum_layout(counts.tolist(), dea.get_mk_alignment_for_contiguous_layout())
    x = torch.randn(M, K, generator=g).to(BF16)
    w = torch.randn(G, N, K, generator=g).to(BF16)
    w_plain = torch.randn(N, K, generator=g).to(BF16)
    a_padded = torch.zeros(end, K, dtype=BF16).index_copy_(0, pos, x)
    d_padded = torch.empty(end, N, dtype=BF16)
    ends_t = torch.tensor(ends, dtype=torch.int32)
    onednn = mm.pack_groups(w, "onednn") if mm.onednn_available() else None
    amx = mm.pack_groups(w, "amx") if native.amx_bf16() else None
    w_fp4 = dea.per_token_cast_to_fp4(w.float(), use_ue8m0=True, gran_k=32, use_packed_ue8m0=True)
    amx_fp4 = mm.pack_fp4_groups(*w_fp4, 32) if amx is not None else None
    w_copy = torch.empty_like(w)

    systems = {
        "plain": lambda: torch.matmul(x, w_plain.t()),
        "grouped, public": lambda: dea.m_grouped_bf16_gemm_nt_contiguous(a_padded, w, d_padded, ends_t,
                                                                         use_psum_layout=True),
        "per group, matmul": lambda: mm.expert_gemm("bf16", x, w, bounds),
    }
    if onednn is not None:
        systems["per group, oneDNN packed"] = lambda: mm.expert_gemm("bf16", x, onednn, bounds)
    if amx is not None:
        one = (amx[0],) * G
        systems["per group, AMX"] = lambda: mm.expert_gemm("bf16", x, amx, bounds)
        if amx_fp4 is not None:
            systems["per group, AMX, FP4 weights"] = lambda: mm.expert_gemm("bf16", x, amx_fp4, bounds)
        systems["per group, AMX, one weight"] = lambda: mm.expert_gemm("bf16", x, one, bounds)
        amx_plain = native.AmxWeight(w_plain)
        d_plain = torch.empty(M, N, dtype=BF16)
        systems["one group, AMX"] = lambda: native.gemm_bf16_amx(d_plain, x, amx_plain)
    systems["copy of the weights"] = lambda: w_copy.copy_(w)
    if onednn is not None:
        systems["pack, oneDNN"] = lambda: mm.pack_groups(w, "onednn")
    if amx is not None:
        systems["pack, AMX"] = lambda: mm.pack_groups(w, "amx")
    # one warm-up call each (it packs the public call's weights), then interleaved
    med = dict(zip(systems, interleaved_medians_ms(list(systems.values()), args.iters, args.warmup)))
    # every grouped variant gives the same products (float32 accumulation, bf16 rounding; oneDNN's order may
    # differ from torch.matmul's, so within a bf16 ulp of a float64 reference rather than bitwise)
    ref = torch.cat([x[s:e].double() @ w[i].double().t() for i, (s, e) in enumerate(zip(bounds, bounds[1:]))])
    outs = {"grouped, public": d_padded.index_select(0, pos), "per group, matmul": systems["per group, matmul"]()}
    for name in ("per group, oneDNN packed", "per group, AMX"):
        if name in systems:
            outs[name] = systems[name]()
    def close(o, r):
        scale = r.abs().max().item() if r.numel() else 1.0
        return bool(((o.double() - r).abs() <= 2.0**-8 * r.abs() + 1e-6 * scale).all())

    ok = all(close(o, ref) for o in outs.values())
    if "per group, AMX, FP4 weights" in systems:
        w_deq = dea.dequantize_weights(*w_fp4, 1, 32).double()
        ref_fp4 = torch.cat([x[s:e].double() @ w_deq[i].t() for i, (s, e) in enumerate(zip(bounds, bounds[1:]))])
        outs["per group, AMX, FP4 weights"] = systems["per group, AMX, FP4 weights"]()
        ok = ok and close(outs["per group, AMX, FP4 weights"], ref_fp4)
    if "one group, AMX" in systems:
        systems["one group, AMX"]()
        ok = ok and close(d_plain, x.double() @ w_plain.double().t())
        outs["one group, AMX"] = d_plain
    fp4_note = f"(FP4 copy {sum(p.nbytes for p in amx_fp4) / 1e6:.1f} MB) " if amx_fp4 else ""
    print(f"[config] {G} groups, {M} rows ({min(counts.tolist())}-{max(counts.tolist())} per group), K {K}, N {N}, "
          f"bf16, 1 thread, median of {args.iters} interleaved; weights {w.numel() * 2 / 1e6:.1f} MB {fp4_note}"
          f"(plain: {w_plain.numel() * 2 / 1e6:.1f} MB); oneDNN packing "
          f"{'available' if onednn is not None else 'unavailable'}"
          f", AMX kernel {'available' if amx is not None else 'unavailable'} (rows of unavailable ones skipped); the "
          f"library's grouped GEMMs run on {mm.grouped_gemm_packer() or 'torch.matmul'}")
    for name, t in med.items():
        ratio = f"   plain / this {med['plain'] / t:.2f}" if name.startswith(GEMM_ROWS) else ""
        print(f"[time] {name:<31} {t:9.3f} ms{ratio}")
    print(f"[check] {', '.join(outs)} within bf16 rounding of a float64 reference: {'ok' if ok else 'MISMATCH'}")
    if args.json:
        flops = 2 * M * K * N
        records = [schema.result(name, t / 1e3, system="torch" if name in ("plain", "per group, matmul",
                                                                            "copy of the weights") else "deepep_ascend",
                                 phase=None, tflops=flops / (t / 1e3) / 1e12 if name.startswith(GEMM_ROWS + ("plain",))
                                 else None) for name, t in med.items()]
        for r in records:
            if r["name"].startswith(GEMM_ROWS):
                schema.add_ratios(records, r["name"], ["plain"])
        schema.write(args.json, schema.document(
            "grouped-gemm", argv=args._argv, params=cli.params_of(args, 1), results=records, baselines=["plain"],
            checks=dict(ok=bool(ok), compared=list(outs)), mpi=False,
            details=dict(group_rows=counts.tolist(), packer=mm.grouped_gemm_packer(),
                         onednn=onednn is not None, amx=amx is not None)))
    return 0 if ok else 1


def main(argv=None) -> int:
    """``python -m bench grouped-gemm`` in-process (tests)."""
    from bench import commands

    return commands.call("grouped-gemm", argv)


if __name__ == "__main__":
    from bench import commands

    commands.alias("grouped-gemm")
