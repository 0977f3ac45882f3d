"""MegaMoE benchmark: the fused call against the unfused sequence, in the same run (docs/semantics/mega-moe.md §5).

Run one process per rank::

    mpiexec -n 4 python -m bench mega-moe                          # preset cpu-pro-mini, fp8xfp4
    mpiexec -n 2 python -m bench mega-moe --preset cpu-comm-heavy --mma bf16
    mpiexec -n 2 python -m bench mega-moe --num-tokens 256 --hidden 512 --inter 256 --num-experts 16 --json out.json

Presets (docs/semantics/mega-moe.md §6, scaled from DeepGEMM's EP8 V4-Pro test: top-6, one shared expert):
``cpu-pro-mini`` E 96, K 6, H 1024, I 512, T 512 per rank (PR #316's batch 512: at 4 ranks, 128 rows
per local expert); ``cpu-pro-batch`` the same shape at T 4096 (the test's default batch, 8192 tokens
per rank at EP8 over 384 experts, is 1024 rows per expert; at 4 ranks over 96 experts so is T 4096);
``cpu-comm-heavy`` E 96, K 6, H 2048, I 128, T 1024; ``tiny`` E 16, K 4, H 256, I 128, T 128 (smoke). ``--shared 0``
drops the shared expert; ``--activation swigluoai`` (with ``--activation-alpha``, ``--activation-up-bias``,
gpt-oss's 1.702 and 1.0 by default) times DeepGEMM PR #445's parameterized SwiGLU instead. Inputs:
``x = randn`` (fp8: per-token e4m3 with UE8M0 scales per 32 channels), routing = top-k of random scores,
weights ``rand``; expert weights random (fp8: random FP4 nibbles, UE8M0 scales around 2^-5), from ``--seed``.

Systems, interleaved in every iteration on the same inputs:

* ``fused``: :func:`deepep_ascend.fp8_fp4_mega_moe` / ``bf16_mega_moe`` (expert waves; backend
  ``--backend``, default the library's: ``shm`` on one node, where the worker pulls wave w+1's rows from
  the peers' segments while the caller computes wave w and the final sum reads every L2 row where it
  lies, or ``buffer``, where the Buffer's worker moves wave w+1 and combines wave w-1);
* ``serial``: the same call with ``overlap=False`` (same waves, synchronous communication); its own
  stage times (``buf.last_trace.stage_times()``: l1, act, l2, shared, reduce, dispatch, combine) are
  printed next to the unfused stages, to show where the fused call spends less;
* ``unfused``: the sequence a user writes from the public ops, one stage after the other —
  ``Buffer.dispatch`` of tokens (DeepEP style, a token once per rank), expansion to the
  m-grouped contiguous psum layout, ``m_grouped_bf16_gemm_nt_contiguous`` (L1), SwiGLU × weight
  (+ FP8 requantisation), grouped L2, per-token fp32 sum of the local slots, ``Buffer.combine``,
  shared expert. Timed end to end (``t_baseline``) and per stage with a barrier before each
  (``Σt_stage``; stages dispatch, l1, act, l2, combine, shared). The act stage is torch ops (no
  public SwiGLU op exists); the fused call's own activation (the native kernel where it was built)
  is timed on the same rows too, and the ratio with it in place of the act stage is printed next to
  the target's.
* ``torch matmul``: one plain ``[N_pairs, H] @ [H, 2I]`` and ``[N_pairs, I] @ [I, H]`` (the same
  total GEMM shape; bf16, or float32 with the float32 GEMM engine) against the grouped GEMM calls
  alone (L1 and L2 of the unfused stages' layouts, operands in the engine's dtype): the
  grouped-GEMM throughput ratio of the target. The grouped stages (with layout and dequantisation)
  over the plain matmul are printed too, and so is one copy of all local experts' weights (one read
  and one write of what the grouped calls stream per call; the plain matmul reads one matrix).
  Also timed: the fused call's own per-expert GEMMs on its cached weights (fp8: the FP4 copies the AMX
  kernel decodes itself, where it runs) and the same rows sorted by expert, against the plain matmul.

Timing: barrier, ``time.perf_counter``; untimed rounds (``--warmup`` of them, default 2, and on for ``--warmup-s``
seconds) then ``--iters`` (default 5), in :func:`bench.timing.each_step`, with Python's
garbage collector paused (:func:`bench.timing.gc_paused`; the ``[gc]`` line times one full collection,
which a loop with the collector on pays inside some call); per rank
the median and min over iterations; printed as mean over ranks and max over ranks (upstream
convention). Derived: speedup ``Σt_stage / t_fused`` and ``t_baseline / t_fused``, hidden time
``Σt_stage − t_fused``, overlap efficiency ``hidden / min(t_comm, t_compute)`` (from the stage
times), and from the fused call's own trace the **overlap fraction** = worker (communication)
time spent while the caller computed / total worker time. TFLOPS ``= 2·N_pairs·3·H·I / t`` (routed
pairs received, shared FLOPs separate). GB/s = cross-rank bytes / ``t_fused`` with dispatch
``H·elem (+ H/32 + 4 fp8 / + 4 bf16)`` and combine ``2H`` bytes per pair (upstream's per-pair
convention), printed with and without self-rank pairs. Correctness first: ``fused`` vs
``serial`` (and vs the ``--compare-waves`` runs) bit for bit and ``fused`` vs ``unfused`` by calc_diff (the unfused path
rounds each rank's partial sum to bf16 once more, so it is not bitwise; bound 1e-3); a failed check prints
``MISMATCH``, is ``check.ok = false`` in the JSON and makes the exit code 1. Targets (reported, not asserted):
fused ≤ 0.85× the separate stages at 4 ranks; grouped GEMM ≥ 70 % of the plain matmul.
"""
from __future__ import annotations

import os
import statistics
import time

import numpy as np
import torch

import deepep_ascend as dea
from bench import cli, schema
from bench import internals as M
from bench.formulas import fmt_bytes, gbps, mega_moe_pair_bytes
from bench.linkmodel import link_model_doc, link_setup, project_phases, projection_lines, use_link_emulator
from bench.moe_stages import Unfused
from bench.timing import each_step, full_gc_seconds
from bench.workload import calc_diff, fingerprint, tensor_digest
from deepep_ascend import native

CHECK_BOUND = 1e-3  # fused vs unfused calc_diff: one extra bf16 rounding is ~1e-5; a wrong row gives ~1

PRESETS = {
    "cpu-pro-mini": dict(num_experts=96, num_topk=6, hidden=1024, inter=512, num_tokens=512),
    "cpu-pro-batch": dict(num_experts=96, num_topk=6, hidden=1024, inter=512, num_tokens=4096),
    "cpu-comm-heavy": dict(num_experts=96, num_topk=6, hidden=2048, inter=128, num_tokens=1024),
    "tiny": dict(num_experts=16, num_topk=4, hidden=256, inter=128, num_tokens=128),
}
BF16 = torch.bfloat16


def add_arguments(p) -> None:
    """The command's options: the shared ones (``bench.cli``; the shape's default is the preset's) and its own."""
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu-pro-mini")
    p.add_argument("--mma", choices=("fp8", "bf16"), default="fp8", help="fp8xfp4 (default) or bf16xbf16")
    p.add_argument("--inter", type=cli.int_at_least(1), default=None, help="intermediate size (default: the preset's)")
    p.add_argument("--shared", type=int, default=1, help="shared experts (default 1)")
    p.add_argument("--clamp", type=float, default=10.0, help="activation_clamp (default 10; <0 = None)")
    p.add_argument("--activation", choices=("swiglu", "swigluoai"), default="swiglu",
                   help="swiglu (default) or swigluoai: gpt-oss's g*sigmoid(alpha*g)*(u + up_bias), DeepGEMM PR #445")
    p.add_argument("--activation-alpha", type=float, default=None,
                   help="swigluoai's activation_alpha (default 1.702, gpt-oss's)")
    p.add_argument("--activation-up-bias", type=float, default=None,
                   help="swigluoai's activation_up_bias (default 1.0, gpt-oss's)")
    p.add_argument("--experts-per-wave", type=int, default=None, help="fused wave size (default: library's)")
    p.add_argument("--backend", choices=("shm", "buffer"), default=None,
                   help="how the fused call moves rows (SymmBuffer.backend; default: the library's, shm on one node)")
    p.add_argument("--compare-waves", type=cli.int_list(1), default=[], metavar="N,N,...",
                   help="also time the fused call cut into these numbers of waves, interleaved with the rest")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default max(1, cores // ranks))")
    preset = "default: the preset's"
    cli.add_shared(p, num_tokens=None, hidden=None, num_topk=None, num_experts=None, iters=5, warmup=2, seed=0,
                   json=None,
                   helps=dict(num_tokens=preset, hidden=preset, num_topk=preset,
                              num_experts=preset + "; rounded up to a multiple of the ranks"))
    cli.add_link_args(p)


def check_args(p, args) -> None:
    """The link profile and emulator (``p.error`` on bad values); the preset's shape where not given; the
    activation's parameters (gpt-oss's for ``swigluoai`` where not given; none with ``swiglu``)."""
    args.profile, args.emulator = link_setup(p, args)
    if args.activation == "swiglu":
        if args.activation_alpha is not None or args.activation_up_bias is not None:
            p.error("--activation-alpha / --activation-up-bias need --activation swigluoai")
        args.activation_alpha, args.activation_up_bias = 1.0, 0.0
    else:
        args.activation_alpha = 1.702 if args.activation_alpha is None else args.activation_alpha
        args.activation_up_bias = 1.0 if args.activation_up_bias is None else args.activation_up_bias
    for k, v in PRESETS[args.preset].items():
        if getattr(args, k) is None:
            setattr(args, k, v)


def make_weights(args, rank, el):
    g = torch.Generator().manual_seed(args.seed * 7919 + 1000 + rank)
    h, i = args.hidden, args.inter

    def fp4(e, n, k):
        data = torch.randint(-128, 128, (e, n, k // 2), generator=g, dtype=torch.int8)
        sf = torch.randint(120, 124, (e, n, k // 32), generator=g, dtype=torch.uint8).view(torch.int32)
        return data, sf

    if args.mma == "bf16":
        l1 = (torch.randn(el, 2 * i, h, generator=g) / h ** 0.5).to(BF16)
        l2 = (torch.randn(el, h, i, generator=g) / i ** 0.5).to(BF16)
        shared = None
        if args.shared:
            si = args.shared * i
            shared = ((torch.randn(2 * si, h, generator=g) / h ** 0.5).to(BF16),
                      (torch.randn(h, si, generator=g) / si ** 0.5).to(BF16))
        return (l1, l2), dea.transform_weights_for_mega_moe(l1, l2), shared
    raw1, raw2 = fp4(el, 2 * i, h), fp4(el, h, i)
    l1 = (raw1[0], dea.transform_sf_into_required_layout(raw1[1], 2 * i, h, (1, 32), num_groups=el))
    l2 = (raw2[0], dea.transform_sf_into_required_layout(raw2[1], h, i, (1, 32), num_groups=el))
    shared = None
    if args.shared:
        si = args.shared * i
        s1, s2 = fp4(1, 2 * si, h), fp4(1, h, si)
        shared = ((s1[0][0], s1[1][0]), (s2[0][0], s2[1][0]))
    return (l1, l2), dea.transform_weights_for_mega_moe(l1, l2), shared


def fill_inputs(args, buf, rank):
    g = torch.Generator().manual_seed(args.seed * 7919 + rank)
    t, h = args.num_tokens, args.hidden
    x = torch.randn(t, h, generator=g)
    if args.mma == "bf16":
        buf.x[:t] = x.to(BF16)
    else:
        data, sf = dea.per_token_cast_to_fp8(x, use_ue8m0=True, gran_k=32, use_packed_ue8m0=True)
        buf.x[:t] = data
        buf.x_sf[:t] = sf
    scores = torch.rand(t, args.num_experts, generator=g)
    buf.topk_idx[:t] = scores.topk(args.num_topk, dim=1).indices
    buf.topk_weights[:t] = torch.rand(t, args.num_topk, generator=g)


def run(args) -> int:
    """Run the benchmark (collective; see the module docstring); the exit code: 1 on a failed check."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, R = comm.Get_rank(), comm.Get_size()
    cores = os.cpu_count() or 1
    threads = args.threads or max(1, cores // R)
    torch.set_num_threads(threads)
    if args.num_experts % R:
        args.num_experts = -(-args.num_experts // R) * R
    buf = dea.get_symm_buffer_for_mega_moe(comm, args.num_experts, args.num_tokens, args.num_topk, args.hidden,
                                           args.inter, mma_type="bf16xbf16" if args.mma == "bf16" else "fp8xfp4",
                                           num_shared_experts=args.shared, backend=args.backend)
    emulator = use_link_emulator(buf.ep_buffer.runtime, args.emulator)
    el = buf.num_local_experts
    w_nat, (l1, l2), shared = make_weights(args, rank, el)
    fill_inputs(args, buf, rank)
    t = args.num_tokens
    digest = "|".join(tensor_digest(v[:t]) for v in (buf.x, buf.topk_idx, buf.topk_weights)
                      + ((buf.x_sf,) if args.mma == "fp8" else ()))
    # the hash's inputs under the names they always had, so that fingerprints stay comparable across runs
    act = {} if args.activation == "swiglu" else dict(activation=args.activation, alpha=args.activation_alpha,
                                                      up_bias=args.activation_up_bias)
    fp = fingerprint(dict(benchmark="bench.mega_moe", experts=args.num_experts, topk=args.num_topk, hidden=args.hidden,
                            inter=args.inter, tokens=t, mma=args.mma, shared=args.shared, seed=args.seed, ranks=R,
                            **act), comm.allgather(digest))
    clamp = None if args.clamp < 0 else args.clamp
    op = dea.bf16_mega_moe if args.mma == "bf16" else dea.fp8_fp4_mega_moe
    kw = dict(activation=args.activation, activation_alpha=args.activation_alpha,
              activation_up_bias=args.activation_up_bias, activation_clamp=clamp,
              num_experts_per_wave=args.experts_per_wave)
    if shared is not None:
        kw.update(shared_l1_weights=shared[0], shared_l2_weights=shared[1])
    y_fused = torch.empty(t, args.hidden, dtype=BF16)
    y_serial = torch.empty_like(y_fused)
    y_waves = torch.empty_like(y_fused)
    unf = Unfused(args, buf, w_nat, shared)

    # counts: pairs received (all-gathered topk_idx), self-rank pairs
    idx = buf.topk_idx[:t]
    cnt = torch.bincount(idx[idx >= 0], minlength=args.num_experts).numpy().astype(np.int64)
    allc = np.array(comm.allgather(cnt))  # [R, E]
    per_rank_dst = allc.reshape(R, R, el).sum(2)  # [src, dst] pairs
    n_pairs_recv = int(per_rank_dst[:, rank].sum())
    n_pairs_self = int(per_rank_dst[rank, rank])
    n_pairs_sent = int(per_rank_dst[rank].sum())

    wave_runs = {}  # label -> experts per wave, for --compare-waves
    for nw in args.compare_waves:
        epw = -(-el // min(nw, el))
        wave_runs[f"fused, {-(-el // epw)} wave(s)"] = epw
    times = {k: [] for k in ("fused", "serial", "unfused") + Unfused.stages + ("act_library",)
             + ("gemm_l1", "gemm_l2", "fused_gemm_l1", "fused_gemm_l2", "mm_l1", "mm_l2", "weights_copy")
             + tuple(wave_runs)}
    fractions, hidden_s, busy_s, waves, path = [], [], [], None, None
    serial_stages = []  # per iteration: the serial call's own stage times (its trace), seconds
    engine = M.gemm_engine()
    cached = M.untransformed("bf16" if args.mma == "bf16" else "fp8xfp4", l1, l2, engine)  # what the fused call uses
    mm_dtype = BF16 if engine == "bf16" else torch.float32  # the plain matmul the engine stands for
    mm_a1 = torch.randn(n_pairs_recv, args.hidden).to(mm_dtype)
    mm_b1 = torch.randn(2 * args.inter, args.hidden).to(mm_dtype).t()
    mm_a2 = torch.randn(n_pairs_recv, args.inter).to(mm_dtype)
    mm_b2 = torch.randn(args.hidden, args.inter).to(mm_dtype).t()

    # The grouped GEMM reads every local expert's weights once per call, the plain matmul one matrix: a copy of
    # those weights (one read, one write) in the same run shows what streaming them costs on this host.
    w_dst = (torch.empty_like(unf.w1), torch.empty_like(unf.w2))
    weight_bytes = sum(w.numel() * w.element_size() for w in (unf.w1, unf.w2))
    plain_weight_bytes = (mm_b1.numel() + mm_b2.numel()) * mm_b1.element_size()

    def timed(fn) -> float:
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    state = {"waves_bitwise": True}  # every --compare-waves run gives the fused call's y bit for bit
    gc_full_s, gc_objects = full_gc_seconds()

    def one_round() -> tuple[dict, dict, dict]:
        """Every system once: ``(seconds per system, the fused call's overlap, the serial call's stage times)``."""
        rec = {}
        rec["fused"] = timed(lambda: op(y_fused, l1, l2, buf, **kw))
        tr = buf.last_trace
        ov = tr.overlap()
        state["waves"], state["path"] = (tr.num_waves, tr.experts_per_wave), tr.backend
        rec["serial"] = timed(lambda: op(y_serial, l1, l2, buf, overlap=False, **kw))
        serial_trace = buf.last_trace.stage_times()
        for label, epw in wave_runs.items():
            rec[label] = timed(
                lambda epw=epw: op(y_waves, l1, l2, buf, **dict(kw, num_experts_per_wave=epw)))
            state["waves_bitwise"] = state["waves_bitwise"] and bool(torch.equal(y_waves.view(torch.int16),
                                                                                 y_fused.view(torch.int16)))
        rec["unfused"] = timed(unf.run)
        for name, fn in unf.stage_fns().items():
            rec[name] = timed(fn)
        rec["act_library"] = timed(unf.act_library)
        for name, fn in {**unf.gemm_fns(), **unf.fused_gemm_fns(cached)}.items():
            rec[name] = timed(fn)
        rec["mm_l1"] = timed(lambda: mm_a1 @ mm_b1)
        rec["mm_l2"] = timed(lambda: mm_a2 @ mm_b2)
        rec["weights_copy"] = timed(lambda: (w_dst[0].copy_(unf.w1), w_dst[1].copy_(unf.w2)))
        return rec, ov, serial_trace

    # the garbage collector paused, --warmup rounds and --warmup-s seconds first (bench.timing.each_step)
    for row in each_step([("round", one_round)], comm, args.iters, args.warmup, lambda fn: fn()):
        rec, ov, serial_trace = row["round"]
        for k, v in rec.items():
            times[k].append(v)
        fractions.append(ov["fraction"])
        serial_stages.append(serial_trace)
        hidden_s.append(ov["hidden"])
        busy_s.append(ov["worker_busy"])
    waves_bitwise, waves, path = state["waves_bitwise"], state.get("waves"), state.get("path")

    # correctness
    bitwise = bool(torch.equal(y_fused.view(torch.int16), y_serial.view(torch.int16)))
    diff = calc_diff(y_fused.float(), unf.st["y"].float()) if t else 0.0
    checks = comm.gather((bitwise and waves_bitwise, diff), root=0)

    # Link counters of one more fused call (untimed): per channel kind, and projected on --link-profile.
    from deepep_ascend.transports import LinkStats

    disp_b, comb_b = mega_moe_pair_bytes(args.hidden, args.mma)
    pair_b = disp_b + comb_b  # one (token, expert) pair: dispatch + combine bytes
    stats = buf.ep_buffer.runtime.stats
    before = stats.snapshot()
    op(y_fused, l1, l2, buf, **kw)
    moved = LinkStats.diff(stats.snapshot(), before)
    by_kind = comm.gather(LinkStats.bytes_by_kind(moved), root=0)
    projection = project_phases({"fused": moved}, comm, args.profile,
                                  {"fused": n_pairs_recv * pair_b})
    buf_backend = buf.backend
    buf.destroy()
    path_text = {"shm": "pulled from the peers' segments, outputs read where they lie",
                 "buffer": "through the Buffer's normal-mode dispatch and combine"}[path]

    med = {k: statistics.median(v) for k, v in times.items()}
    mins = {k: min(v) for k, v in times.items()}
    stage_names = sorted({k for st in serial_stages for k in st})
    serial_med = {k: statistics.median(st.get(k, 0.0) for st in serial_stages) for k in stage_names}
    loc = dict(med=med, min=mins, fraction=statistics.median(fractions), hidden=statistics.median(hidden_s),
               serial_stages=serial_med, gc_full_s=gc_full_s, gc_objects=gc_objects,
               busy=statistics.median(busy_s), pairs_recv=n_pairs_recv, pairs_self=n_pairs_self,
               pairs_sent=n_pairs_sent)
    allr = comm.gather(loc, root=0)
    if rank != 0:
        return 0

    def agg(key, field="med"):
        vals = [r[field][key] for r in allr]
        return sum(vals) / len(vals), max(vals)

    def line(name, key):
        (mean, mx), (mmin, _) = agg(key), agg(key, "min")
        return (f"  {name:<22} median {mean * 1e3:9.3f} ms (mean over ranks), {mx * 1e3:9.3f} ms (max); "
                f"min {mmin * 1e3:.3f} ms")

    h, i = args.hidden, args.inter
    load = os.getloadavg()
    pairs_recv = sum(r["pairs_recv"] for r in allr) / R
    pairs_cross = sum(r["pairs_recv"] - r["pairs_self"] for r in allr) / R
    flops = 2 * pairs_recv * 3 * h * i
    shared_flops = 2 * args.num_tokens * 3 * h * i * args.shared
    t_fused = agg("fused")[0]
    sum_stage = sum(agg(s)[0] for s in Unfused.stages)
    t_comm = agg("dispatch")[0] + agg("combine")[0]
    t_comp = sum_stage - t_comm
    hidden = sum_stage - t_fused
    out = []
    if emulator is not None:
        out.append(f"[link] {emulator.label} -- the fused/serial/unfused times are EMULATED")
    out.append(f"[config] fingerprint {fp} | ranks {R}, cores {os.cpu_count()}, torch threads {threads}, "
               f"load avg {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, mma {args.mma}, preset {args.preset}: "
               f"E {args.num_experts} (local {el}), K {args.num_topk}, H {h}, I {i}, T {t}/rank, "
               f"shared {args.shared}, activation {args.activation}"
               + (f" (alpha {args.activation_alpha}, up_bias {args.activation_up_bias})"
                  if args.activation != "swiglu" else "")
               + f", clamp {clamp}, waves {waves[0]} x {waves[1]} experts, "
               f"GEMM engine {M.gemm_engine()}, backend {buf_backend} (the fused call's rows: {path_text}), "
               f"iters {args.iters} ({cli.warmup_text(args)})")
    gc_ms = sum(r["gc_full_s"] for r in allr) / R * 1e3
    out.append(f"[gc] the collector is paused during the iterations (as in the normal command); one full collection "
               f"took {gc_ms:.1f} ms here (mean over ranks; {allr[0]['gc_objects']} tracked objects on rank 0): "
               f"with the collector on, one lands in a call every so often and stalls every rank "
               f"(gc.freeze() after setup keeps these objects out of it)")
    check = dict(fused_equals_serial=all(c[0] for c in checks), calc_diff_vs_unfused=max(c[1] for c in checks),
                 bound=CHECK_BOUND)
    check["ok"] = check["fused_equals_serial"] and check["calc_diff_vs_unfused"] < CHECK_BOUND
    same = "fused == serial (overlap=False)" + (" == the other wave counts" if wave_runs else "")
    out.append(f"[check] {same} bitwise: {check['fused_equals_serial']}; fused vs unfused "
               f"calc_diff max {check['calc_diff_vs_unfused']:.2e} (bound {CHECK_BOUND:g}; unfused rounds each rank's "
               f"partial once more) -> {'ok' if check['ok'] else 'MISMATCH'}")
    out.append("[time]")
    out.append(line("fused", "fused"))
    for label in wave_runs:
        out.append(line(label, label))
    out.append(line("serial (overlap=False)", "serial"))
    out.append(line("unfused end to end", "unfused"))
    for s in Unfused.stages:
        out.append(line(f"  stage {s}", s))
    out.append(f"  {'Σ stages':<22} {sum_stage * 1e3:9.3f} ms (comm {t_comm * 1e3:.3f}, compute {t_comp * 1e3:.3f})")
    names = [s for s in Unfused.stages if s in allr[0]["serial_stages"]]
    names += [s for s in allr[0]["serial_stages"] if s not in names]  # the fused call's own: reduce
    serial_stage_ms = {k: sum(r["serial_stages"].get(k, 0.0) for r in allr) / R for k in names}
    out.append("  serial call's own stages (its trace; median, mean over ranks): " + ", ".join(
        f"{k} {v * 1e3:.3f} ms" for k, v in serial_stage_ms.items()))
    mmn = "bf16" if M.gemm_engine() == "bf16" else "fp32"
    out.append(line(f"torch {mmn} mm L1 shape", "mm_l1"))
    out.append(line(f"torch {mmn} mm L2 shape", "mm_l2"))
    ratio = t_fused / sum_stage if sum_stage else float("nan")
    tgt = " (target <= 0.85 at 4 ranks: " + ("met" if ratio <= 0.85 else "MISSED") + ")" if R == 4 else ""
    out.append(f"[summary] fused / Σ stages {ratio:.3f}{tgt}; fused / unfused end to end "
               f"{t_fused / agg('unfused')[0]:.3f}; fused / serial {t_fused / agg('serial')[0]:.3f}")
    sum_lib = sum_stage - agg("act")[0] + agg("act_library")[0]
    out.append(f"[summary] with the act stage as the fused call computes it ({agg('act_library')[0] * 1e3:.3f} ms, "
               f"{'native kernel' if native.available() else 'torch path'}) instead of the unfused torch ops "
               f"({agg('act')[0] * 1e3:.3f} ms): fused / Σ stages {t_fused / sum_lib:.3f}")
    eff = hidden / min(t_comm, t_comp) if min(t_comm, t_comp) > 0 else float("nan")
    out.append(f"[summary] hidden time Σ stages − fused {hidden * 1e3:.3f} ms; overlap efficiency "
               f"hidden / min(comm, compute) {eff:.2f}")
    fr = [r["fraction"] for r in allr]
    out.append(f"[overlap] fused trace: worker (communication) time under caller compute / worker time: mean "
               f"{sum(fr) / R:.2f} (per rank {', '.join(f'{f:.2f}' for f in fr)}); worker busy "
               f"{sum(r['busy'] for r in allr) / R * 1e3:.3f} ms, "
               f"hidden {sum(r['hidden'] for r in allr) / R * 1e3:.3f} ms")
    gemm = agg("l1")[0] + agg("l2")[0]
    gemm_only = agg("gemm_l1")[0] + agg("gemm_l2")[0]
    mm = agg("mm_l1")[0] + agg("mm_l2")[0]
    gtgt = "met" if gemm_only and mm / gemm_only >= 0.7 else "MISSED"
    out.append(f"[gemm] routed {flops / 1e9:.2f} GFLOP/rank (+ shared {shared_flops / 1e9:.2f}); fused "
               f"{flops / t_fused / 1e12:.3f} TFLOPS (routed only); grouped GEMM calls alone (L1+L2 on the stage "
               f"layouts) {flops / gemm_only / 1e12:.3f} TFLOPS; grouped stages l1+l2 {flops / gemm / 1e12:.3f} "
               f"TFLOPS (incl. layout/dequant); plain torch mm {flops / mm / 1e12:.3f} TFLOPS")
    out.append(f"[gemm] grouped GEMM / plain matmul throughput {mm / gemm_only:.2f} (target >= 0.70: {gtgt}); "
               f"grouped stages incl. layout/dequant / plain {mm / gemm:.2f}")
    fused_gemm = agg("fused_gemm_l1")[0] + agg("fused_gemm_l2")[0]
    kinds = sorted({type(w).__name__ for w in (cached[0] if isinstance(cached[0], tuple) else cached[:1])})
    out.append(f"[gemm] MegaMoE's own expert GEMMs on its cached weights ({', '.join(kinds)}; rows sorted by expert, "
               f"no padding) {flops / fused_gemm / 1e12:.3f} TFLOPS; / plain matmul throughput {mm / fused_gemm:.2f}")
    t_wcopy = agg("weights_copy")[0]
    out.append(f"[gemm] the grouped calls read {el} experts' weights, {weight_bytes / 1e6:.1f} MB per call (the plain "
               f"matmul {plain_weight_bytes / 1e6:.1f} MB); one copy of them (read + write) "
               f"took {t_wcopy * 1e3:.3f} ms in this run ({gbps(2 * weight_bytes, t_wcopy):.2f} GB/s), "
               f"{t_wcopy / gemm_only if gemm_only else float('nan'):.2f}x the grouped GEMM calls' time")
    bytes_all = pairs_recv * pair_b
    bytes_cross = pairs_cross * pair_b
    bytes_busiest = max(r["pairs_recv"] for r in allr) * pair_b
    t_c = agg("dispatch")[0] + agg("combine")[0]
    out.append(f"[comm] per pair: dispatch {disp_b} B + combine {2 * h} B (per-pair convention), "
               f"{bytes_cross / 1e6:.2f} MB cross-rank per rank per call ({bytes_all / 1e6:.2f} MB with self-rank "
               f"pairs): over t_fused {gbps(bytes_cross, t_fused):.4f} GB/s cross-rank, "
               f"{gbps(bytes_all, t_fused):.4f} GB/s with self; upstream convention N_recv*3H "
               f"{gbps(pairs_recv * 3 * h, t_fused):.4f} GB/s; unfused dispatch+combine stages alone "
               f"{gbps(bytes_all, t_c) if t_c else float('nan'):.3f} GB/s (token-deduplicated bytes are fewer)")
    out.append("[comm] one fused call, moved per channel kind (max over ranks): " + ", ".join(
        f"{k} {fmt_bytes(max(b[k] for b in by_kind))}" for k in by_kind[0]))
    out += projection_lines(projection, {"fused": (t_fused, gbps(bytes_busiest, t_fused))},
                              "per-pair bytes", emulator)
    print("\n".join(out), flush=True)
    if args.json:
        def rec(name, key, **kw):  # one result: the mean over ranks of the per-rank medians (and minima)
            (mean, mx), (mmin, _) = agg(key), agg(key, "min")
            return schema.result(name, mean, min_s=mmin, rank_max_s=mx, **kw)

        records = [rec("fused", "fused", nbytes=bytes_all,
                       formula="MegaMoE per pair, with self-rank pairs (mean over ranks)",
                       by_kind={k: max(b[k] for b in by_kind) for k in by_kind[0]}, cross_rank_bytes=bytes_cross,
                       cross_rank_gbps=gbps(bytes_cross, t_fused), busiest_rank_bytes=bytes_busiest,
                       tflops=flops / t_fused / 1e12)]
        records += [rec(f"fused/{label.split(', ', 1)[1]}", label) for label in wave_runs]
        records.append(rec("serial", "serial"))
        records += [schema.result(f"serial/{k}", v) for k, v in serial_stage_ms.items()]
        records.append(rec("unfused", "unfused"))
        records += [rec(f"unfused/{s}", s) for s in Unfused.stages]
        records += [schema.result("unfused/sum_stages", sum_stage), schema.result("unfused/comm_stages", t_comm),
                    rec("unfused/act_library", "act_library")]
        for name, keys in (("grouped_gemm", ("gemm_l1", "gemm_l2")),
                           ("fused_expert_gemm", ("fused_gemm_l1", "fused_gemm_l2")),
                           ("torch_mm", ("mm_l1", "mm_l2"))):
            total = sum(agg(k)[0] for k in keys)
            records.append(schema.result(name, total, tflops=flops / total / 1e12 if total else None))
            records += [rec(f"{name}/{k.rsplit('_', 1)[1]}", k) for k in keys]
        records.append(rec("weights_copy", "weights_copy", nbytes=2 * weight_bytes,
                           formula="one read and one write of the local experts' weights"))
        for name, others in (("fused", ("serial", "unfused", "unfused/sum_stages")), ("grouped_gemm", ("torch_mm",)),
                             ("fused_expert_gemm", ("torch_mm",))):
            schema.add_ratios(records, name, others)
        baselines = [r["name"] for r in records if r["system"] in ("unfused", "torch_mm", "weights_copy")]
        schema.write(args.json, schema.document(
            "mega-moe", argv=args._argv, params=cli.params_of(args, R), fingerprint=fp, results=records,
            baselines=baselines, checks=check, link_model=link_model_doc(args.profile, emulator), projection=projection,
            summary=dict(fused_over_sum_stages=ratio, fused_over_sum_stages_library_act=t_fused / sum_lib,
                         grouped_over_plain_mm=mm / gemm_only if gemm_only else None,
                         fused_expert_gemm_over_plain_mm=mm / fused_gemm if fused_gemm else None,
                         grouped_stages_over_plain_mm=mm / gemm if gemm else None,
                         weight_bytes_per_call=weight_bytes, plain_mm_weight_bytes=plain_weight_bytes),
            details=dict(
                times="mean over ranks of each rank's median (upstream convention); rank_max_s: the max over ranks",
                ranks=allr, lines=out, traffic_by_kind=by_kind,
                times_s=dict(fused=t_fused, serial=agg("serial")[0], unfused=agg("unfused")[0],
                             grouped_gemm=gemm_only, fused_expert_gemm=fused_gemm, plain_mm=mm, weights_copy=t_wcopy,
                             fused_by_waves={label: agg(label)[0] for label in wave_runs},
                             sum_stages=sum_stage, comm_stages=t_comm,
                             stages={s: agg(s)[0] for s in Unfused.stages}, act_library=agg("act_library")[0],
                             serial_call_stages=serial_stage_ms),
                gc=dict(paused_while_timing=True, full_collection_ms=gc_ms),
                bandwidth_GBps=dict(
                    formula="per pair: dispatch H*elem + scales + 4 B, combine 2H B; over t_fused (mean over ranks)",
                    bytes_with_self=bytes_all, bytes_cross_rank=bytes_cross, bytes_with_self_busiest_rank=bytes_busiest,
                    fused_with_self=gbps(bytes_all, t_fused), fused_cross_rank=gbps(bytes_cross, t_fused),
                    unfused_comm_stages=gbps(bytes_all, t_c) if t_c else None),
                tflops=dict(fused_routed=flops / t_fused / 1e12, grouped_stages=flops / gemm / 1e12 if gemm else None,
                            grouped_gemm=flops / gemm_only / 1e12 if gemm_only else None,
                            plain_mm=flops / mm / 1e12 if mm else None))))
    return 0 if check["ok"] else 1


def main(argv=None) -> int:
    """``python -m bench mega-moe`` in-process, without the MPI exit path (tests)."""
    from bench import commands

    return commands.call("mega-moe", argv)


if __name__ == "__main__":
    from bench import commands

    commands.alias("mega-moe")
