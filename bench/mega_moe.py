"""MegaMoE benchmark: the fused call against the unfused sequence, in the same run (mega-moe.md §5).

Run one process per rank::

    mpiexec -n 4 python -m bench.mega_moe                          # preset cpu-pro-mini, fp8xfp4
    mpiexec -n 2 python -m bench.mega_moe --preset cpu-comm-heavy --mma bf16
    mpiexec -n 2 python -m bench.mega_moe --tokens 256 --hidden 512 --inter 256 --experts 16 --json out.json

Presets (mega-moe.md §6, scaled from DeepGEMM's EP8 V4-Pro test: top-6, one shared expert):
``cpu-pro-mini`` E 96, K 6, H 1024, I 512, T 512 per rank (PR #316's batch 512: at 4 ranks, 128 rows
per local expert); ``cpu-pro-batch`` the same shape at T 4096 (the test's default batch, 8192 tokens
per rank at EP8 over 384 experts, is 1024 rows per expert; at 4 ranks over 96 experts so is T 4096);
``cpu-comm-heavy`` E 96, K 6, H 2048, I 128, T 1024; ``tiny`` E 16, K 4, H 256, I 128, T 128 (smoke). ``--shared 0`` drops the shared
expert. Inputs: ``x = randn`` (fp8: per-token e4m3 with UE8M0 scales per 32 channels), routing =
top-k of random scores, weights ``rand``; expert weights random (fp8: random FP4 nibbles, UE8M0
scales around 2^-5), from ``--seed``.

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

Timing: barrier, ``time.perf_counter``; ``--warmup`` (>= 2) then ``--iters`` (>= 5), with Python's
garbage collector paused (:func:`bench.common.gc_paused`; the ``[gc]`` line times one full collection,
which a loop with the collector on pays inside some call); per rank
the median and min over iterations; printed as mean over ranks and max over ranks (upstream
convention). Derived: speedup ``Σt_stage / t_fused`` and ``t_baseline / t_fused``, hidden time
``Σt_stage − t_fused``, overlap efficiency ``hidden / min(t_comm, t_compute)`` (from the stage
times), and from the fused call's own trace the **overlap fraction** = worker (communication)
time spent while the caller computed / total worker time. TFLOPS ``= 2·N_pairs·3·H·I / t`` (routed
pairs received, shared FLOPs separate). GB/s = cross-rank bytes / ``t_fused`` with dispatch
``H·elem (+ H/32 + 4 fp8 / + 4 bf16)`` and combine ``2H`` bytes per pair (upstream's per-pair
convention), printed with and without self-rank pairs. Correctness first: ``fused`` vs
``serial`` (and vs the ``--compare-waves`` runs) bit for bit and ``fused`` vs ``unfused`` by calc_diff (the unfused path rounds each
rank's partial sum to bf16 once more, so it is not bitwise; bound 1e-3); a failed check prints
``MISMATCH``, is ``check.ok = false`` in the JSON and makes the exit code 1. Targets (reported, not asserted):
fused ≤ 0.85× the separate stages at 4 ranks; grouped GEMM ≥ 70 % of the plain matmul.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch

import deepep_ascend as dea
from bench import common as C
from deepep_ascend.mega_moe import core as M

CHECK_BOUND = 1e-3  # fused vs unfused calc_diff: one extra bf16 rounding is ~1e-5; a wrong row gives ~1

PRESETS = {
    "cpu-pro-mini": dict(experts=96, topk=6, hidden=1024, inter=512, tokens=512),
    "cpu-pro-batch": dict(experts=96, topk=6, hidden=1024, inter=512, tokens=4096),
    "cpu-comm-heavy": dict(experts=96, topk=6, hidden=2048, inter=128, tokens=1024),
    "tiny": dict(experts=16, topk=4, hidden=256, inter=128, tokens=128),
}
BF16 = torch.bfloat16


def _wave_list(text: str) -> list:
    """argparse ``type=``: comma-separated wave counts, each an int >= 1 (``bench.common.int_at_least``)."""
    positive = C.int_at_least(1)
    return [positive(v) for v in text.split(",")]


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.mega_moe", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu-pro-mini")
    p.add_argument("--mma", choices=("fp8", "bf16"), default="fp8", help="fp8xfp4 (default) or bf16xbf16")
    for name in ("tokens", "hidden", "inter", "experts", "topk"):
        p.add_argument(f"--{name}", type=int, default=None, help=f"override the preset's {name}")
    p.add_argument("--shared", type=int, default=1, help="shared experts (default 1)")
    p.add_argument("--clamp", type=float, default=10.0, help="activation_clamp (default 10; <0 = None)")
    p.add_argument("--experts-per-wave", type=int, default=None, help="fused wave size (default: library's)")
    p.add_argument("--backend", choices=("shm", "buffer"), default=None,
                   help="how the fused call moves rows (SymmBuffer.backend; default: the library's, shm on one node)")
    p.add_argument("--compare-waves", type=_wave_list, default=[], metavar="N,N,...",
                   help="also time the fused call cut into these numbers of waves, interleaved with the rest")
    p.add_argument("--iters", type=C.int_at_least(1), default=5)
    p.add_argument("--warmup", type=C.int_at_least(0), default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default max(1, cores // ranks))")
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--no-progress", action="store_true", help="accepted for symmetry with bench.normal (no bar here)")
    C.add_link_args(p)
    args = p.parse_args(argv)
    args.profile, args.emulator = C.link_setup(p, args)
    for k, v in PRESETS[args.preset].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.iters, args.warmup = max(1, args.iters), max(0, args.warmup)
    return args


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
    t, h = args.tokens, args.hidden
    x = torch.randn(t, h, generator=g)
    if args.mma == "bf16":
        buf.x[:t] = x.to(BF16)
    else:
        data, sf = dea.per_token_cast_to_fp8(x, use_ue8m0=True, gran_k=32, use_packed_ue8m0=True)
        buf.x[:t] = data
        buf.x_sf[:t] = sf
    scores = torch.rand(t, args.experts, generator=g)
    buf.topk_idx[:t] = scores.topk(args.topk, dim=1).indices
    buf.topk_weights[:t] = torch.rand(t, args.topk, generator=g)


def _layout_alignment(engine: str) -> int:
    """Row alignment of each expert's group: the grouped GEMM's (``bf16``) or 1 (``fp32``: no padding rows)."""
    return dea.get_mk_alignment_for_contiguous_layout() if engine == "bf16" else 1


def psum_layout(counts, align: int):
    """The m-grouped contiguous psum layout of groups of ``counts`` rows, each starting at a multiple of
    ``align``: ``(ends, end, pos)`` with ``ends[g]`` the end of group g's rows (what the grouped GEMM
    takes), ``end`` the layout's row count, ``pos`` int64 ``[sum(counts)]`` the layout row of each row
    taken group after group."""
    ends, spans, end = [], [], 0
    for c in counts:
        start = dea.align(end, align)
        end = start + c
        ends.append(end)
        spans.append(torch.arange(start, end))
    return ends, end, torch.cat(spans) if spans else torch.empty(0, dtype=torch.int64)


def _grouped_nt(engine: str, a: torch.Tensor, w: torch.Tensor, ends: list, ends_t: torch.Tensor) -> torch.Tensor:
    """``d [M, N]`` bf16 of the m-grouped contiguous psum layout (group g: rows from
    ``align(end[g-1], _layout_alignment(engine))`` to ``end[g]``) times ``w[g].T``: the public
    :func:`deepep_ascend.m_grouped_bf16_gemm_nt_contiguous` (``bf16`` engine), or one float32 matmul
    per group (``fp32``: alignment 1, no padding rows). Padding rows are unspecified."""
    if engine == "bf16":
        d = torch.empty(a.size(0), w.size(1), dtype=BF16)
        dea.m_grouped_bf16_gemm_nt_contiguous(a, w, d, ends_t, use_psum_layout=True, ensure_zero_padding=False)
        return d
    return M._expert_gemm(engine, a, w, [0] + list(ends))


class Unfused:
    """The stage-by-stage sequence from public ops (see module docstring); ``stages`` in order."""

    def __init__(self, args, buf, w_nat, shared):
        self.args, self.buf, self.ep = args, buf, buf.ep_buffer
        self.kind = args.mma
        h, i = args.hidden, args.inter
        if self.kind == "bf16":
            self.w1, self.w2 = w_nat
        else:
            (d1, s1), (d2, s2) = w_nat
            self.w1 = dea.dequantize_weights(d1, s1, 1, 32).to(BF16)
            self.w2 = dea.dequantize_weights(d2, s2, 1, 32).to(BF16)
        self.shared = None
        if shared is not None:
            if self.kind == "bf16":
                self.shared = shared
            else:
                self.shared = tuple(dea.dequantize_weights(d, s, 1, 32).to(BF16) for d, s in shared)
        self.engine = M.gemm_engine()
        if self.engine == "fp32":
            self.w1, self.w2 = self.w1.float(), self.w2.float()
        self.h, self.i = h, i
        self.clamp = None if args.clamp < 0 else args.clamp
        self.st = {}

    def _act(self, hh, w):
        i = hh.size(1) // 2
        g, u = hh[:, :i], hh[:, i:]
        if self.clamp is not None:
            c = torch.tensor(self.clamp, dtype=BF16)
            g, u = torch.minimum(g, c), torch.maximum(torch.minimum(u, c), -c)
        a = torch.nn.functional.silu(g.float()) * u.float() * w.unsqueeze(1)
        if self.kind == "bf16":
            return a.to(BF16)
        n = a.size(0)
        grp = a.view(n, i // 32, 32)
        s = dea.ceil_to_ue8m0(grp.abs().amax(-1).clamp(min=1e-4) / 448.0).unsqueeze(-1)
        return (dea.e4m3_to_float(dea.cast_to_e4m3(grp / s)) * s).view(n, i).to(BF16)

    def dispatch(self):
        b, t = self.buf, self.args.tokens
        idx, wts = b.topk_idx[:t], b.topk_weights[:t]
        if self.kind == "bf16":
            x = b.x[:t]
        else:
            x = torch.cat([b.x[:t].view(torch.uint8), b.x_sf[:t].view(torch.uint8)], 1)
        ntpr, ntprr, ntpe, itr, _ = self.ep.get_dispatch_layout(idx, b.num_experts)
        rx, ridx, rw, _lst, handle, _ev = self.ep.dispatch(x, num_tokens_per_rank=ntpr, num_tokens_per_rdma_rank=ntprr,
                                                           is_token_in_rank=itr, num_tokens_per_expert=ntpe,
                                                           topk_idx=idx, topk_weights=wts)
        self.st.update(rx=rx, ridx=ridx, rw=rw, handle=handle)

    def l1(self):
        st, h = self.st, self.h
        ridx = st["ridx"]
        flat = ridx.reshape(-1)
        k = ridx.size(1)
        el = self.buf.num_local_experts
        cnt = torch.bincount(flat[flat >= 0], minlength=el).tolist()
        order = torch.argsort(flat, stable=True)[flat.numel() - sum(cnt):]
        rows = torch.div(order, k, rounding_mode="floor")
        # the grouped GEMM's alignment, or 1 for the fp32 engine
        ends, end, pos = psum_layout(cnt, _layout_alignment(self.engine))
        rx = st["rx"].index_select(0, rows)
        if self.kind != "bf16":  # e4m3 data, then one UE8M0 byte per 32 channels
            rx = dea.per_token_cast_back(rx[:, :h].view(torch.float8_e4m3fn), rx[:, h:], gran_k=32)
        padded = end != rx.size(0)
        if padded:
            a = torch.zeros(end, h, dtype=BF16)
            a.index_copy_(0, pos, rx)
        else:
            a = rx
        ends_t = torch.tensor(ends, dtype=torch.int32)
        hh = _grouped_nt(self.engine, a, self.w1, ends, ends_t)
        st.update(order=order, rows=rows, pos=pos, end=end, ends=ends, ends_t=ends_t, padded=padded, a1=a, cnt=cnt,
                  hh=hh.index_select(0, pos) if padded else hh,
                  w=st["rw"].reshape(-1).index_select(0, order))

    def act(self):
        self.st["a"] = self._act(self.st["hh"], self.st["w"])

    def act_library(self):
        """The SwiGLU stage as the fused call computes it (``mega_moe._activation``: the native kernel where
        it was built), on the same rows: timed as an alternative ``act``, not part of ``Σ stages``."""
        M._activation(self.kind, self.st["hh"], self.i, self.st["w"], self.clamp, True, M._operand_dtype(self.engine))

    def l2(self):
        st = self.st
        if st["padded"]:
            a2 = torch.zeros(st["end"], self.i, dtype=BF16)
            a2.index_copy_(0, st["pos"], st["a"])
        else:
            a2 = st["a"]
        st["a2"] = a2
        o = _grouped_nt(self.engine, a2, self.w2, st["ends"], st["ends_t"])
        o = o.index_select(0, st["pos"]) if st["padded"] else o
        part = torch.zeros(st["rx"].size(0), self.h).index_add_(0, st["rows"], o.float())
        st["part"] = part.to(BF16)

    def combine(self):
        self.st["y"], _w, _ev = self.ep.combine(self.st["part"], self.st["handle"])

    def shared_expert(self):
        if self.shared is None:
            return
        b, t = self.buf, self.args.tokens
        if self.kind == "bf16":
            x = b.x[:t]
        else:
            x = dea.per_token_cast_back(b.x[:t], b.x_sf[:t], gran_k=32)
        w1s, w2s = self.shared
        a = self._act(M._dense_nt(self.engine, x, w1s), torch.ones(t))
        self.st["y"] = (self.st["y"].float() + M._dense_nt(self.engine, a, w2s).float()).to(BF16)

    stages = ("dispatch", "l1", "act", "l2", "combine", "shared")

    def gemm_fns(self):
        """The grouped GEMM calls alone, on the layouts of the last run (operands in the engine's dtype)."""
        st, dt = self.st, M._operand_dtype(self.engine)
        a1, a2 = st["a1"].to(dt), st["a2"].to(dt)
        return {"gemm_l1": lambda: _grouped_nt(self.engine, a1, self.w1, st["ends"], st["ends_t"]),
                "gemm_l2": lambda: _grouped_nt(self.engine, a2, self.w2, st["ends"], st["ends_t"])}

    def fused_gemm_fns(self, cached):
        """MegaMoE's own per-expert GEMMs (:func:`deepep_ascend.mega_moe.core._expert_gemm`) on its cached weights
        ``cached`` (``_untransformed``: fp8, the FP4 copies the AMX kernel decodes) and the last run's rows,
        sorted by expert without padding (the fused call's layout)."""
        st, dt = self.st, M._operand_dtype(self.engine)
        bounds = [0] + torch.tensor(st["cnt"]).cumsum(0).tolist()
        a1 = (st["a1"].index_select(0, st["pos"]) if st["padded"] else st["a1"]).to(dt)
        a2 = (st["a2"].index_select(0, st["pos"]) if st["padded"] else st["a2"]).to(dt)
        return {"fused_gemm_l1": lambda: M._expert_gemm(self.engine, a1, cached[0], bounds),
                "fused_gemm_l2": lambda: M._expert_gemm(self.engine, a2, cached[1], bounds)}

    def stage_fns(self):
        return {"dispatch": self.dispatch, "l1": self.l1, "act": self.act, "l2": self.l2, "combine": self.combine,
                "shared": self.shared_expert}

    def run(self):
        for fn in self.stage_fns().values():
            fn()
        return self.st["y"]


def main(argv=None) -> int:
    from mpi4py import MPI

    args = parse_args(argv)
    comm = MPI.COMM_WORLD
    rank, R = comm.Get_rank(), comm.Get_size()
    cores = os.cpu_count() or 1
    threads = args.threads or max(1, cores // R)
    torch.set_num_threads(threads)
    if args.experts % R:
        args.experts = -(-args.experts // R) * R
    buf = dea.get_symm_buffer_for_mega_moe(comm, args.experts, args.tokens, args.topk, args.hidden, args.inter,
                                           mma_type="bf16xbf16" if args.mma == "bf16" else "fp8xfp4",
                                           num_shared_experts=args.shared, backend=args.backend)
    emulator = C.use_link_emulator(buf.ep_buffer.runtime, args.emulator)
    el = buf.num_local_experts
    w_nat, (l1, l2), shared = make_weights(args, rank, el)
    fill_inputs(args, buf, rank)
    t = args.tokens
    digest = "|".join(C.tensor_digest(v[:t]) for v in (buf.x, buf.topk_idx, buf.topk_weights)
                      + ((buf.x_sf,) if args.mma == "fp8" else ()))
    fp = C.fingerprint(dict(benchmark="bench.mega_moe", experts=args.experts, topk=args.topk, hidden=args.hidden,
                            inter=args.inter, tokens=t, mma=args.mma, shared=args.shared, seed=args.seed, ranks=R),
                       comm.allgather(digest))
    clamp = None if args.clamp < 0 else args.clamp
    op = dea.bf16_mega_moe if args.mma == "bf16" else dea.fp8_fp4_mega_moe
    kw = dict(activation_clamp=clamp, num_experts_per_wave=args.experts_per_wave)
    if shared is not None:
        kw.update(shared_l1_weights=shared[0], shared_l2_weights=shared[1])
    y_fused = torch.empty(t, args.hidden, dtype=BF16)
    y_serial = torch.empty_like(y_fused)
    y_waves = torch.empty_like(y_fused)
    unf = Unfused(args, buf, w_nat, shared)

    # counts: pairs received (all-gathered topk_idx), self-rank pairs
    idx = buf.topk_idx[:t]
    cnt = torch.bincount(idx[idx >= 0], minlength=args.experts).numpy().astype(np.int64)
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
    cached = M._untransformed("bf16" if args.mma == "bf16" else "fp8xfp4", l1, l2, engine)  # what the fused call uses
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

    def timed(name, fn):
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        return dt

    waves_bitwise = True  # every --compare-waves run gives the fused call's y bit for bit
    gc_full_s, gc_objects = C.full_gc_seconds()
    with C.gc_paused():  # as bench.common.time_phases: no collection inside a timed call
        for it in range(args.warmup + args.iters):
            rec = {}
            rec["fused"] = timed("fused", lambda: op(y_fused, l1, l2, buf, **kw))
            tr = buf.last_trace
            ov = tr.overlap()
            waves = (tr.num_waves, tr.experts_per_wave)
            path = tr.backend
            rec["serial"] = timed("serial", lambda: op(y_serial, l1, l2, buf, overlap=False, **kw))
            serial_trace = buf.last_trace.stage_times()
            for label, epw in wave_runs.items():
                rec[label] = timed(label, lambda epw=epw: op(y_waves, l1, l2, buf, **dict(kw, num_experts_per_wave=epw)))
                waves_bitwise = waves_bitwise and bool(torch.equal(y_waves.view(torch.int16), y_fused.view(torch.int16)))
            rec["unfused"] = timed("unfused", unf.run)
            for name, fn in unf.stage_fns().items():
                rec[name] = timed(name, fn)
            rec["act_library"] = timed("act_library", unf.act_library)
            for name, fn in {**unf.gemm_fns(), **unf.fused_gemm_fns(cached)}.items():
                rec[name] = timed(name, fn)
            rec["mm_l1"] = timed("mm_l1", lambda: mm_a1 @ mm_b1)
            rec["mm_l2"] = timed("mm_l2", lambda: mm_a2 @ mm_b2)
            rec["weights_copy"] = timed("weights_copy", lambda: (w_dst[0].copy_(unf.w1), w_dst[1].copy_(unf.w2)))
            if it >= args.warmup:
                for k, v in rec.items():
                    times[k].append(v)
                fractions.append(ov["fraction"])
                serial_stages.append(serial_trace)
                hidden_s.append(ov["hidden"])
                busy_s.append(ov["worker_busy"])

    # correctness
    bitwise = bool(torch.equal(y_fused.view(torch.int16), y_serial.view(torch.int16)))
    diff = C.calc_diff(y_fused.float(), unf.st["y"].float()) if t else 0.0
    checks = comm.gather((bitwise and waves_bitwise, diff), root=0)

    # Link counters of one more fused call (untimed): per channel kind, and projected on --link-profile.
    from deepep_ascend.transports import LinkStats

    elem = 1 if args.mma == "fp8" else 2
    disp_b = args.hidden * elem + (args.hidden // 32 if args.mma == "fp8" else 0) + 4
    pair_b = disp_b + 2 * args.hidden  # one (token, expert) pair: dispatch + combine bytes
    stats = buf.ep_buffer.runtime.stats
    before = stats.snapshot()
    op(y_fused, l1, l2, buf, **kw)
    moved = LinkStats.diff(stats.snapshot(), before)
    by_kind = comm.gather(LinkStats.bytes_by_kind(moved), root=0)
    projection = C.project_phases({"fused": moved}, comm, args.profile,
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
        return f"  {name:<22} median {mean * 1e3:9.3f} ms (mean over ranks), {mx * 1e3:9.3f} ms (max); min {mmin * 1e3:.3f} ms"

    h, i = args.hidden, args.inter
    load = os.getloadavg()
    pairs_recv = sum(r["pairs_recv"] for r in allr) / R
    pairs_cross = sum(r["pairs_recv"] - r["pairs_self"] for r in allr) / R
    flops = 2 * pairs_recv * 3 * h * i
    shared_flops = 2 * args.tokens * 3 * h * i * args.shared
    t_fused = agg("fused")[0]
    sum_stage = sum(agg(s)[0] for s in Unfused.stages)
    t_comm = agg("dispatch")[0] + agg("combine")[0]
    t_comp = sum_stage - t_comm
    hidden = sum_stage - t_fused
    out = []
    if emulator is not None:
        out.append(f"[link] {emulator.label} -- the fused/serial/unfused times are EMULATED")
    out.append(f"[config] fingerprint {fp} | ranks {R}, cores {os.cpu_count()}, torch threads {threads}, load avg {load[0]:.2f} "
               f"{load[1]:.2f} {load[2]:.2f}, mma {args.mma}, preset {args.preset}: E {args.experts} "
               f"(local {el}), K {args.topk}, H {h}, I {i}, T {t}/rank, shared {args.shared}, clamp {clamp}, "
               f"waves {waves[0]} x {waves[1]} experts, GEMM engine {M.gemm_engine()}, backend {buf_backend} (the fused call's rows: {path_text}), "
               f"iters {args.iters} (+{args.warmup} warm-up)")
    gc_ms = sum(r["gc_full_s"] for r in allr) / R * 1e3
    out.append(f"[gc] the collector is paused during the iterations (as in bench.normal); one full collection "
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
               f"{'native kernel' if M._native.available() else 'torch path'}) instead of the unfused torch ops "
               f"({agg('act')[0] * 1e3:.3f} ms): fused / Σ stages {t_fused / sum_lib:.3f}")
    eff = hidden / min(t_comm, t_comp) if min(t_comm, t_comp) > 0 else float("nan")
    out.append(f"[summary] hidden time Σ stages − fused {hidden * 1e3:.3f} ms; overlap efficiency "
               f"hidden / min(comm, compute) {eff:.2f}")
    fr = [r["fraction"] for r in allr]
    out.append(f"[overlap] fused trace: worker (communication) time under caller compute / worker time: mean "
               f"{sum(fr) / R:.2f} (per rank {', '.join(f'{f:.2f}' for f in fr)}); worker busy "
               f"{sum(r['busy'] for r in allr) / R * 1e3:.3f} ms, hidden {sum(r['hidden'] for r in allr) / R * 1e3:.3f} ms")
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
               f"matmul {plain_weight_bytes / 1e6:.1f} MB); one copy of them (read + write) took {t_wcopy * 1e3:.3f} ms "
               f"in this run ({C.gbps(2 * weight_bytes, t_wcopy):.2f} GB/s), "
               f"{t_wcopy / gemm_only if gemm_only else float('nan'):.2f}x the grouped GEMM calls' time")
    bytes_all = pairs_recv * pair_b
    bytes_cross = pairs_cross * pair_b
    bytes_busiest = max(r["pairs_recv"] for r in allr) * pair_b
    t_c = agg("dispatch")[0] + agg("combine")[0]
    out.append(f"[comm] per pair: dispatch {disp_b} B + combine {2 * h} B (per-pair convention), "
               f"{bytes_cross / 1e6:.2f} MB cross-rank per rank per call ({bytes_all / 1e6:.2f} MB with self-rank "
               f"pairs): over t_fused {C.gbps(bytes_cross, t_fused):.4f} GB/s cross-rank, "
               f"{C.gbps(bytes_all, t_fused):.4f} GB/s with self; upstream convention N_recv*3H "
               f"{C.gbps(pairs_recv * 3 * h, t_fused):.4f} GB/s; unfused dispatch+combine stages alone "
               f"{C.gbps(bytes_all, t_c) if t_c else float('nan'):.3f} GB/s (token-deduplicated bytes are fewer)")
    out.append("[comm] one fused call, moved per channel kind (max over ranks): " + ", ".join(
        f"{k} {C.fmt_bytes(max(b[k] for b in by_kind))}" for k in by_kind[0]))
    out += C.projection_lines(projection, {"fused": (t_fused, C.gbps(bytes_busiest, t_fused))},
                              "per-pair bytes", emulator)
    print("\n".join(out), flush=True)
    if args.json:
        doc = dict(benchmark="bench.mega_moe", fingerprint=fp,
                   args={k: v for k, v in vars(args).items() if k not in ("profile", "emulator")}, ranks=allr,
                   lines=out, traffic_by_kind=by_kind, link_model=C.link_model_doc(args.profile, emulator),
                   projection=projection,
                   times_s=dict(fused=t_fused, serial=agg("serial")[0], unfused=agg("unfused")[0],
                                grouped_gemm=gemm_only, fused_expert_gemm=fused_gemm, plain_mm=mm, weights_copy=t_wcopy,
                                fused_by_waves={label: agg(label)[0] for label in wave_runs},
                                sum_stages=sum_stage, comm_stages=t_comm,
                                stages={s: agg(s)[0] for s in Unfused.stages}, act_library=agg("act_library")[0],
                                serial_call_stages=serial_stage_ms),
                   check=check, gc=dict(paused_while_timing=True, full_collection_ms=gc_ms),
                   bandwidth_GBps=dict(
                       formula="per pair: dispatch H*elem + scales + 4 B, combine 2H B; over t_fused (mean over ranks)",
                       bytes_with_self=bytes_all, bytes_cross_rank=bytes_cross,
                       bytes_with_self_busiest_rank=bytes_busiest,
                       fused_with_self=C.gbps(bytes_all, t_fused), fused_cross_rank=C.gbps(bytes_cross, t_fused),
                       unfused_comm_stages=C.gbps(bytes_all, t_c) if t_c else None),
                   tflops=dict(fused_routed=flops / t_fused / 1e12, grouped_stages=flops / gemm / 1e12 if gemm else None,
                               grouped_gemm=flops / gemm_only / 1e12 if gemm_only else None,
                               plain_mm=flops / mm / 1e12 if mm else None),
                   summary=dict(fused_over_sum_stages=ratio, fused_over_sum_stages_library_act=t_fused / sum_lib,
                                grouped_over_plain_mm=mm / gemm_only if gemm_only else None,
                                fused_expert_gemm_over_plain_mm=mm / fused_gemm if fused_gemm else None,
                                grouped_stages_over_plain_mm=mm / gemm if gemm else None,
                                weight_bytes_per_call=weight_bytes, plain_mm_weight_bytes=plain_weight_bytes))
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1, default=str)
    return 0 if check["ok"] else 1


if __name__ == "__main__":
    C.run_main(main)
