"""``EPBuffer`` (DeepEP V2.5) dispatch + combine, with the V1 ``Buffer`` path and the peer pipelines on the
same work in the same run.

Run one process per rank::

    mpiexec -n 2 python -m bench ep                        # scaled-down DeepEP-Ascend shape, FP8 dispatch
    mpiexec -n 4 python -m bench ep --num-tokens 2048 --json ep.json
    mpiexec -n 2 python -m bench ep --bf16 --expand --expert-alignment 64
    mpiexec -n 2 python -m bench ep --expand --zero-padding        # as nn.MoE's expanded mode dispatches

Workload (DeepEP-Ascend's shape, fewer tokens): 512 tokens per rank (``--num-tokens``), hidden 7168
(``--hidden``), top-6 (``--num-topk``) of 256 experts (``--num-experts``); ``x = randn`` in BF16, routing =
top-k of ``randn(N, E).abs() + 1``, weights ``randn(N, K).abs()`` (:func:`bench.workload.make_workload`,
seeded ``seed * 65536 + rank``, ``--seed``). Dispatch sends FP8 made by the library's codec,
``deepep_ascend.per_token_cast_to_fp8(x, scale_style="deepep")`` (e4m3 rows and one float32 scale per 128
channels, DeepEP's ``per_token_cast_to_fp8``); ``--bf16`` sends the BF16 rows. Combine is BF16.

Systems, on the same inputs, each doing the round trip dispatch → identity experts (the received rows,
FP8 cast back to BF16; untimed) → combine with the received weights. EPBuffer and V1 run interleaved, both
buffers alive: every iteration times EPBuffer's round trip, then V1's, so that the host's drift (a shared
machine) hits both alike; the peers and the roofline run after them, one after another:

* ``epbuffer``: ``EPBuffer.dispatch`` (compact layout; ``--expand``: DeepEP's expanded layout, one row per
  (token, local expert), each expert's rows starting at a multiple of ``--expert-alignment``, default 128)
  and ``EPBuffer.combine``, in a buffer of ``EPBuffer.get_buffer_size_hint`` for the workload's shape;
* ``buffer_v1``: ``Buffer.get_dispatch_layout`` + ``dispatch`` + ``combine``
  (:class:`bench.roundtrip.BufferSystem`) in a Buffer that never chunks;
* ``mpi_alltoallv`` and ``gloo_all_to_all``: the peer pipelines of :mod:`bench.baselines`, moving the same rows;
* ``memcpy_roofline``: one copy of each rank's V2 dispatch bytes, one of its combine bytes
  (:func:`bench.roofline.memcpy_roofline`); ``memcpy_roofline_after_experts``: the same copies with the
  benchmark's experts step between them (untimed, on rows of the received shape), the combine's from new
  pages: the caches as the systems find them.

EPBuffer's dispatch computes its routing layout inside the call, so its round trip is dispatch + combine
while V1's and the peers' round trips are layout + dispatch + combine: the same work. ``--expand`` gives
EPBuffer more work than the others (the expansion and each rank's local sum of a token's slots).

Timing (:func:`bench.timing.time_phases`): a barrier before each timed call, ``time.perf_counter`` around it,
the max over ranks per iteration, the median (min, max) over ``--iters`` after ``--warmup``; Python's garbage
collector paused. ``--loop N`` also times EPBuffer's and V1's round trips back to back, collector on
(:func:`bench.timing.time_loops`, :func:`loop_steps`).

Bytes (DeepEP V2's ``tests/ep/test_ep.py``; 1 GB = 1e9 B): per dispatch token ``count_bytes(recv_x,
recv_topk_idx, recv_topk_weights) / rows`` (:func:`bench.formulas.count_bytes`; with ``--expand`` the compact
layout's count, which that test also uses for its expanded dispatch); **scale-up** bytes = that × the
tokens a rank receives (own tokens included); **scale-out** bytes = that × the tokens a rank sends to other
(simulated, ``--ranks-per-node``) nodes, a token once per other node it reaches, 0 on one node (DeepEP's
test counts the own node too unless ``--ignore-local-traffic``; ``details`` keeps that count as well).
Combine: per token ``count_bytes(recv_x as BF16, recv_topk_weights) / rows`` (``2·hidden + 4·K``) times the
same tokens (DeepEP's accounting with ``allow_multiple_reduction``). GB/s = bytes / the median time, printed
for the busiest rank and as the mean over ranks. ``moved`` = the bytes each rank's own operations moved per
channel kind in one call (EPBuffer: its runtime's link counters), the busiest rank's.

Checks (a mismatch prints ``MISMATCH`` and makes the exit code 1): EPBuffer's combine of the unmodified
received rows equals a plain-torch reference, each token's row (as the experts saw it) added once per
distinct rank it reached (``--expand``: each rank's slots of the token summed and rounded to BF16 first;
across nodes each node's partial rounded to BF16), sums that are exact in float32, one rounding to BF16;
``combined_topk_weights`` equals ``topk_weights``; the last timed round trip gives the checked bits again.
Compact layout: EPBuffer's dispatch outputs (``recv_x`` [and scales], ``recv_topk_idx``,
``recv_topk_weights``, per-expert counts) and ``combined_x`` equal V1's bit for bit. V1 and the peers are
verified against the reference and checked against the MPI pipeline as ``bench normal`` does; a system that
fails its verification is left out of every ratio and verdict (``summary.excluded``).

Output (rank 0): ``[config]``, ``[bytes]`` (the V2 accounting), ``[ep]`` lines (dispatch, combine, round
trip), the other systems' lines as ``bench normal`` prints them plus their round trip with the layout,
``[check]``, ``[summary]``: EPBuffer's round trip over V1's (target <= 1x: no slower than the V1 path on the
same work), the speedup over the faster peer pipeline (target >= 5x at 2 and 4 ranks) and the round trip
over the roofline after the experts' step, with the target's time in those rooflines; targets are
reported (``met`` / ``MISSED``), never asserted. ``--json FILE`` writes the ``deepep_ascend.bench/1`` document
(:mod:`bench.schema`): results ``epbuffer/dispatch`` and ``/combine`` (bytes: the busiest rank's scale-up
bytes; ``scaleout_bytes``, ``mean_gbps``, ``by_kind``) and ``/round_trip``; ``<system>/layout``, ``/dispatch``,
``/combine`` (bytes: V2 logical, busiest rank) and ``/round_trip`` (layout + dispatch + combine) for V1 and the
peers; ``memcpy_roofline/round_trip`` and ``memcpy_roofline_after_experts/round_trip``. Every system but
``epbuffer`` is a baseline; ``ratio_to`` relates the round trips; ``summary`` holds the ratios and targets,
``details`` the per-rank tokens and bytes, the buffers' sizes and the memory.
"""
from __future__ import annotations

import dataclasses
import sys

import numpy as np
import torch

from bench import cli, schema, send_modes
from bench.baselines import gloo_all_to_all_roundtrip, mpi_alltoallv_roundtrip, start_gloo
from bench.formulas import count_bytes, fmt_bytes, gbps, logical_bytes
from bench.hostinfo import cpu_model, memory_snapshot
from bench.native_split import gather_split, record_split, split_lines
from bench.phases import breakdown_lines, gather_breakdown, record_steps
from bench.roofline import memcpy_roofline, roofline_after_experts
from bench.roundtrip import (
    BufferSystem,
    check_ok,
    compare_outputs,
    destroy_buffer,
    dispatch_digests,
    fmt_check,
    fmt_kinds,
    fmt_verification,
    identity_experts,
    normal_buffer_bytes,
    print_system,
    reference_combined,
    round_trip_phases,
    system_report,
    verification_failure,
    verify_round_trip,
)
from bench.timing import Timing, progress_bar, time_loops, time_phases
from bench.workload import Workload, calc_diff, comm_fingerprint, make_workload, num_recv_tokens_of, tensor_digest

SYSTEMS = ("ep", "v1", "mpi", "gloo", "roofline")
#: The targets, reported: EPBuffer's round trip over V1's on the same work (at most), and the speedup over
#: the faster peer pipeline (at least) at these rank counts.
TARGET_OVER_V1 = 1.0
TARGET_SPEEDUP = {2: 5.0, 4: 5.0}
IDX_BYTES, WEIGHT_BYTES = 8, 4  #: int64 top-k ids, float32 weights: what the compact layout returns per slot


def add_arguments(p) -> None:
    """The command's options: the shared ones (``bench.cli``) and its own."""
    cli.add_shared(p, num_tokens=512, hidden=7168, num_topk=6, num_experts=256, iters=10, warmup=2, seed=0,
                   json=None, ranks_per_node=None, no_progress=False, phases=False, native_split=False,
                   helps=dict(seed="per rank: seed*65536+rank",
                              ranks_per_node="EPBuffer then runs DeepEP's two hops (hybrid mode)"))
    p.add_argument("--bf16", action="store_true",
                   help="dispatch BF16 rows (default: FP8, e4m3 + a float32 scale per 128 channels); combine is BF16")
    p.add_argument("--expand", action="store_true",
                   help="EPBuffer's expanded layout: one row per (token, local expert), grouped by expert")
    p.add_argument("--zero-padding", action="store_true",
                   help="with --expand: do_zero_padding=True, the rows between an expert's last row and the next "
                        "aligned start zeroed (as nn.MoE's expanded mode asks)")
    p.add_argument("--no-multiple-reduction", action="store_true",
                   help="EPBuffer(allow_multiple_reduction=False): DeepEP's one-rounding combine (expanded layout: "
                        "one combine pass per top-k slot; across nodes: no node partials)")
    p.add_argument("--expert-alignment", type=cli.int_at_least(1), default=128, metavar="A",
                   help="EPBuffer's expert_alignment: each expert's rows start at a multiple of A in the expanded "
                        "layout; the compact layout's per-expert counts are rounded up to it (default 128)")
    p.add_argument("--loop", type=cli.int_at_least(1), default=None, metavar="N",
                   help="also time EPBuffer's and V1's round trips back to back, as a training loop runs them: "
                        "5 segments of N round trips each, the two alternating, no barrier between the calls, "
                        "Python's garbage collector on (the barrier-timed loop pauses it); identity experts "
                        "computed once")
    p.add_argument("--compare-sends", action="store_true",
                   help="after the timed loop, time EPBuffer's dispatch + combine again with the combine's staged "
                        "rows stored by plain and by streaming stores in turn, both in every iteration (the same "
                        "run and rows; deepep_ascend.native.ll_stream_rows(side='send')): a [sends] line")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"comma list out of {','.join(SYSTEMS)} (default: all); ep = EPBuffer, v1 = Buffer, "
                        "mpi / gloo = the peer pipelines, roofline = the memcpy roofline")


def check_args(p, a) -> None:
    """Checks after parsing (``p.error``, argparse's usage error): the system list and what the workload
    needs of the shape. What depends on the rank count is checked in :func:`run` (:func:`shape_problem`)."""
    a.systems = cli.system_list(p, a.systems, SYSTEMS)
    if not a.bf16 and a.hidden % 128:
        p.error(f"FP8 dispatch needs --hidden a multiple of 128 (one scale per 128 channels), got {a.hidden}; "
                f"or pass --bf16")
    if a.num_topk > a.num_experts:
        p.error(f"--num-topk {a.num_topk} exceeds --num-experts {a.num_experts}")
    if a.zero_padding and not a.expand:
        p.error("--zero-padding needs --expand (the padding rows are the expanded layout's)")
    if a.compare_sends and "ep" not in a.systems:
        p.error("--compare-sends times EPBuffer: --systems must include ep")


def shape_problem(args, num_ranks: int) -> str | None:
    """What makes the workload impossible at ``num_ranks`` ranks (a sentence), or ``None``."""
    if args.num_experts % num_ranks:
        return f"--num-experts {args.num_experts} must be a multiple of the {num_ranks} ranks"
    rpn = args.ranks_per_node
    if rpn is not None and (rpn > num_ranks or num_ranks % rpn):
        return f"--ranks-per-node {rpn} must divide the {num_ranks} ranks"
    return None


def build_workload(args, rank: int, num_ranks: int) -> Workload:
    """This rank's inputs; FP8 from the library's codec (``deepep_ascend.per_token_cast_to_fp8``, DeepEP's
    scale recipe: ``scale_style="deepep"``) unless ``--bf16``."""
    wl = make_workload(args.num_tokens, args.hidden, args.num_topk, args.num_experts, rank, num_ranks,
                       seed=args.seed, fp8=False)
    if args.bf16:
        return wl
    from deepep_ascend import per_token_cast_to_fp8

    return dataclasses.replace(wl, x_fp8=per_token_cast_to_fp8(wl.x, scale_style="deepep"),
                               params=dict(wl.params, fp8=True, fp8_codec="deepep_ascend.per_token_cast_to_fp8"))


# -- DeepEP V2's byte accounting -------------------------------------------------------------------------
def dispatch_token_bytes(recv_x, recv_topk_idx: torch.Tensor | None, recv_topk_weights: torch.Tensor | None,
                         num_topk: int) -> float:
    """Bytes per dispatch token, DeepEP V2's ``count_bytes(recv_x, recv_topk_idx, recv_topk_weights) / rows``.

    The expanded layout (``recv_topk_idx`` is ``None``) counts what the compact layout returns per row: the
    row of ``recv_x`` (and its scales) plus ``num_topk`` int64 ids and float32 weights. 0 for no rows."""
    if recv_topk_idx is not None:
        rows = recv_topk_idx.size(0)
        return count_bytes(recv_x, recv_topk_idx, recv_topk_weights) / rows if rows else 0.0
    parts = recv_x if isinstance(recv_x, tuple) else (recv_x,)
    return float(sum(t.size(1) * t.element_size() for t in parts) + num_topk * (IDX_BYTES + WEIGHT_BYTES))


def combine_token_bytes(y: torch.Tensor, recv_topk_weights: torch.Tensor | None, num_topk: int,
                        compact: bool) -> float:
    """Bytes per combine token, DeepEP V2's ``count_bytes(recv_x_bf16, recv_topk_weights) / rows``; the
    expanded layout counts the compact layout's ``2·hidden + 4·num_topk``. 0 for no rows."""
    if compact:
        rows = y.size(0)
        return count_bytes(y, recv_topk_weights) / rows if rows else 0.0
    return float(y.size(1) * y.element_size() + num_topk * WEIGHT_BYTES)


def tokens_to_nodes(topk_idx: torch.Tensor, num_experts: int, num_nodes: int, node: int) -> tuple[int, int]:
    """``(to other nodes, to every node)``: this rank's tokens counted once per node they reach (the other
    nodes only, and DeepEP's default count, own node included); ``(0, 0)`` on one node."""
    if num_nodes <= 1:
        return 0, 0
    dst = torch.where(topk_idx >= 0, torch.div(topk_idx, num_experts // num_nodes, rounding_mode="floor"), num_nodes)
    hit = torch.zeros(topk_idx.size(0), num_nodes + 1, dtype=torch.bool).scatter_(1, dst, True)[:, :num_nodes]
    every = int(hit.sum())
    return every - int(hit[:, node].sum()), every


# -- EPBuffer's round trip ---------------------------------------------------------------------------------
@dataclasses.dataclass
class EPResult:
    """EPBuffer's timings (``dispatch``, ``combine``, ``round_trip``: :class:`Timing`, max over ranks) and,
    from one untimed round trip before them, this rank's numbers: ``bytes`` (the V2 accounting), ``moved``
    (``{'dispatch'|'combine': {kind: bytes}}``), ``check`` (against the reference), ``digests``
    (:func:`bench.roundtrip.dispatch_digests` of the compact outputs, or ``None``), ``combined_x``."""

    timings: dict
    bytes: dict
    moved: dict
    check: dict
    digests: dict | None
    combined_x: torch.Tensor


def ep_dispatch_kwargs(wl: Workload, args) -> dict:
    """``EPBuffer.dispatch``'s keyword arguments for the workload and the command's layout options."""
    return dict(topk_idx=wl.topk_idx, topk_weights=wl.topk_weights, num_experts=args.num_experts,
                expert_alignment=args.expert_alignment, do_expand=args.expand, do_zero_padding=args.zero_padding)


def epbuffer_phases(buf, wl: Workload, args, comm, num_nodes: int, prefix: str = "epbuffer."):
    """EPBuffer's round trip (collective): one checked round trip now (untimed: link counters, the V2
    bytes, the reference check), then ``(phases, finish)`` for :func:`bench.timing.time_phases`, timed
    phases named ``prefix + 'dispatch'`` and ``prefix + 'combine'`` (so that they can run interleaved
    with V1's, :func:`bench.roundtrip.round_trip_phases`); ``finish(timings)`` returns the
    :class:`EPResult`. The received tensors may lie in the buffer's windows, which the next call reuses:
    every number is taken from them before the next call."""
    from deepep_ascend.transports import LinkStats

    rank, R = comm.Get_rank(), comm.Get_size()
    rpn = R // num_nodes
    kw = ep_dispatch_kwargs(wl, args)
    x = wl.dispatch_x
    stats = buf.runtime.stats
    s0 = stats.snapshot()
    recv_x, recv_idx, recv_w, handle, _ = buf.dispatch(x, **kw)
    s1 = stats.snapshot()
    y = identity_experts(recv_x)
    combined, combined_w, _ = buf.combine(y, handle, topk_weights=recv_w)
    s2 = stats.snapshot()
    moved = {"dispatch": LinkStats.bytes_by_kind(LinkStats.diff(s1, s0)),
             "combine": LinkStats.bytes_by_kind(LinkStats.diff(s2, s1))}

    num_recv = int(handle.psum_num_recv_tokens_per_scaleup_rank[-1])
    d_tok = dispatch_token_bytes(recv_x, recv_idx, recv_w, args.num_topk)
    c_tok = combine_token_bytes(y, recv_w, args.num_topk, compact=not args.expand)
    so_tokens, every_node = tokens_to_nodes(wl.topk_idx, args.num_experts, num_nodes, rank // rpn)
    nbytes = dict(num_recv_tokens=num_recv, rows=int((recv_x[0] if isinstance(recv_x, tuple) else recv_x).size(0)),
                  dispatch_token_bytes=d_tok, combine_token_bytes=c_tok,
                  scaleup_bytes=d_tok * num_recv, scaleout_tokens=so_tokens, scaleout_bytes=d_tok * so_tokens,
                  scaleout_tokens_all_nodes=every_node,
                  combine_scaleup_bytes=c_tok * num_recv, combine_scaleout_bytes=c_tok * so_tokens)

    ref = reference_combined(identity_experts(x), wl.topk_idx, args.num_experts, R, rpn, args.expand,
                             multiple_reduction=not args.no_multiple_reduction)
    want_w = wl.topk_weights.masked_fill(wl.topk_idx < 0, 0.0)
    check = dict(combined_x_equal=bool(combined.shape == ref.shape and torch.equal(combined, ref)),
                 combined_x_calc_diff=calc_diff(combined.float(), ref.float()) if combined.shape == ref.shape
                 else float("inf"),
                 combined_topk_weights_equal=bool(combined_w is not None and torch.equal(combined_w, want_w)))
    digests = None
    if not args.expand:
        counts = handle.num_unaligned_recv_tokens_per_expert.tolist()
        digests = dispatch_digests((recv_x, recv_idx, recv_w, counts))
    combined = combined.clone()  # may alias a buffer
    first_digest = tensor_digest(combined)
    del recv_x, recv_idx, recv_w, handle, y, combined_w

    st: dict = {}

    def reset():
        st.clear()

    def dispatch():
        st["d"] = buf.dispatch(x, **kw)

    def experts():
        st["y"] = identity_experts(st["d"][0])

    def combine():
        st["c"] = buf.combine(st["y"], st["d"][3], topk_weights=st["d"][2])

    phases = [(None, reset), (prefix + "dispatch", dispatch), (None, experts), (prefix + "combine", combine)]

    def finish(timings: dict) -> EPResult:
        t = {k: timings[prefix + k] for k in ("dispatch", "combine")}
        t["round_trip"] = t["dispatch"] + t["combine"]
        check["repeatable"] = tensor_digest(st["c"][0]) == first_digest
        st.clear()
        return EPResult(t, nbytes, moved, check, digests, combined)

    return phases, finish


def compare_sends(ep_phases, comm, args, num_nodes: int) -> dict:
    """``--compare-sends``: :func:`bench.send_modes.compare` of EPBuffer's round trip (``ep_phases``,
    :func:`epbuffer_phases`), or ``{"not_compared": why}`` where no combine stages its rows through the native
    one-node path (no kernels, or more than one node). Collective."""
    from deepep_ascend import native

    if native.ll_stream_rows(side="send") is None:
        return {"not_compared": "the native kernels are not loaded (the torch path stores plainly)"}
    if num_nodes > 1:
        return {"not_compared": "across nodes the combine stages no rows on the native one-node path"}
    return send_modes.compare(ep_phases, comm, args.iters, args.warmup)


LOOP_SEGMENTS = 5  # --loop: segments per system


def loop_steps(buf, v1, wl: Workload, args) -> dict:
    """``--loop``'s steps: one round trip each of EPBuffer (``epbuffer``) and V1 (``buffer_v1``: layout, dispatch,
    combine), whichever exists, on the workload's inputs; the combine returns the same BF16 rows every time
    (the identity experts of a first dispatch, made here), so that only the library runs in the loop."""
    kw = ep_dispatch_kwargs(wl, args)
    x, steps = wl.dispatch_x, {}
    if buf is not None:
        d = buf.dispatch(x, **kw)
        y_ep = identity_experts(d[0])
        del d

        def ep_step():
            recv_x, _, recv_w, handle, _ = buf.dispatch(x, **kw)
            buf.combine(y_ep, handle, topk_weights=recv_w)

        steps["epbuffer"] = ep_step
    if v1 is not None:
        system = BufferSystem(v1, "buffer_v1")
        d = system.dispatch(x, system.layout(wl.topk_idx, args.num_experts), wl.topk_idx, wl.topk_weights)
        y_v1 = identity_experts(d[0])
        del d

        def v1_step():
            out = system.dispatch(x, system.layout(wl.topk_idx, args.num_experts), wl.topk_idx, wl.topk_weights)
            system.combine(y_v1, out[4], out[2])

        steps["buffer_v1"] = v1_step
    return steps


def agree(flags: dict, comm) -> dict:
    """``flags`` (booleans and floats) combined over ranks: booleans ANDed, floats the maximum (collective)."""
    from mpi4py import MPI

    names = sorted(flags)
    vals = np.array([float(flags[k]) if not isinstance(flags[k], bool) else (1.0 if flags[k] else 0.0)
                     for k in names], dtype=np.float64)
    lo, hi = np.empty_like(vals), np.empty_like(vals)
    comm.Allreduce(vals, lo, op=MPI.MIN)
    comm.Allreduce(vals, hi, op=MPI.MAX)
    return {k: bool(lo[i]) if isinstance(flags[k], bool) else float(hi[i]) for i, k in enumerate(names)}


def compare_with_v1(ep: EPResult, v1, comm) -> dict:
    """Compact layout: EPBuffer's dispatch outputs and ``combined_x`` against V1's, bit for bit (collective)."""
    flags = {"dispatch." + k: v == v1.dispatch_digests.get(k) for k, v in ep.digests.items()}
    a, b = ep.combined_x, v1.combined_x
    same = a.shape == b.shape and a.dtype == b.dtype
    flags["combined_x_bitwise"] = bool(same and torch.equal(a.view(torch.int16), b.view(torch.int16)))
    flags["combined_x_equal_values"] = bool(same and torch.equal(a, b))
    return agree(flags, comm)


def fmt_ep_check(chk: dict, name: str) -> str:
    """The ``[check]`` line of EPBuffer against the reference."""
    parts = [f"combined_x {'equal' if chk['combined_x_equal'] else 'MISMATCH'} (calc_diff "
             f"{chk['combined_x_calc_diff']:.3g})",
             f"combined_topk_weights {'equal' if chk['combined_topk_weights_equal'] else 'MISMATCH'}",
             f"last timed round trip {'same bits' if chk['repeatable'] else 'MISMATCH'}"]
    return f"[check]    {name} vs reference (x once per distinct rank, {chk['rule']}): " + "; ".join(parts)


def fmt_v1_check(chk: dict) -> str:
    """The ``[check]`` line of EPBuffer against V1 (:func:`compare_with_v1`)."""
    bad = [k.split(".", 1)[1] for k in chk if k.startswith("dispatch.") and not chk[k]]
    comb = ("bitwise ok" if chk["combined_x_bitwise"] else "equal values (signed zeros)"
            if chk["combined_x_equal_values"] else "MISMATCH")
    return ("[check]    epbuffer vs buffer_v1: dispatch outputs bitwise " + ("ok" if not bad else "MISMATCH in "
            + ",".join(bad)) + f"; combined_x {comb}")


def spread(vals: list) -> str:
    """Per-rank values as text: one value when every rank has it, ``a, b, ...`` for a few ranks,
    ``min..max`` for many."""
    vals = [int(v) if float(v).is_integer() else v for v in vals]
    if len(set(vals)) == 1:
        return f"{vals[0]:,}"
    return ", ".join(f"{v:,}" for v in vals) if len(vals) <= 8 else f"{min(vals):,}..{max(vals):,}"


def ep_report(res: EPResult, comm) -> dict:
    """Collective: every rank's bytes and tokens, GB/s per phase (busiest rank and mean), moved per kind."""
    per = comm.allgather(res.bytes)
    moved = comm.allgather(res.moved)
    out = {"per_rank": {k: [p[k] for p in per] for k in per[0]}, "phases": {},
           "timings": {k: v.as_dict() for k, v in res.timings.items()}}
    for phase, su, so in (("dispatch", "scaleup_bytes", "scaleout_bytes"),
                          ("combine", "combine_scaleup_bytes", "combine_scaleout_bytes")):
        t = res.timings[phase].median
        su_r, so_r = [p[su] for p in per], [p[so] for p in per]
        kinds = {}
        for kind in sorted({k for m in moved for k in m[phase]}):
            vals = [int(m[phase].get(kind, 0)) for m in moved]
            kinds[kind] = dict(bytes_per_rank=vals, max_bytes=max(vals), max_gbps=gbps(max(vals), t))
        out["phases"][phase] = dict(
            median_s=t, scaleup_bytes_per_rank=su_r, scaleout_bytes_per_rank=so_r,
            scaleup_gbps=gbps(max(su_r), t), scaleup_gbps_mean=gbps(sum(su_r) / len(su_r), t),
            scaleout_gbps=gbps(max(so_r), t), scaleout_gbps_mean=gbps(sum(so_r) / len(so_r), t),
            busiest_rank=int(np.argmax(su_r)), sent_by_kind=kinds)
    return out


def print_ep(rep: dict, res: EPResult, num_nodes: int) -> None:
    """Print the ``[bytes]`` line (bytes per token, tokens, scale-up / scale-out bytes per rank) and the
    ``[ep]`` lines (median ms, GB/s, bytes moved per channel kind) of :func:`ep_report` (rank 0)."""
    pr = rep["per_rank"]
    one = num_nodes == 1
    print(f"[bytes]    V2 accounting: {spread(pr['dispatch_token_bytes'])} B per dispatch token "
          f"(count_bytes(recv_x, recv_topk_idx, recv_topk_weights) / rows), {spread(pr['combine_token_bytes'])} B "
          f"per combine token | tokens received/rank {spread(pr['num_recv_tokens'])} -> scale-up bytes/rank max "
          f"{fmt_bytes(max(pr['scaleup_bytes']))} | tokens to other nodes/rank {spread(pr['scaleout_tokens'])} -> "
          f"scale-out bytes/rank max {fmt_bytes(max(pr['scaleout_bytes']))}" + (" (one node)" if one else ""))
    for phase in ("dispatch", "combine"):
        ph = rep["phases"][phase]
        so = "" if one else (f" | scale-out {ph['scaleout_gbps']:7.2f} GB/s (mean {ph['scaleout_gbps_mean']:.2f})")
        print(f"[ep]       {phase:<10} epbuffer: {res.timings[phase].fmt()} | scale-up {ph['scaleup_gbps']:7.2f} GB/s "
              f"(busiest rank {ph['busiest_rank']}; mean {ph['scaleup_gbps_mean']:.2f}){so} | "
              f"{fmt_kinds(ph['sent_by_kind'])}")
    print(f"[ep]       round trip epbuffer: {res.timings['round_trip'].fmt()}")


def summarize(trips: dict, R: int, failed: dict | None = None, expand: bool = False) -> dict:
    """Ratios of the median round trips (EPBuffer: dispatch + combine; the others with their layout) and the
    targets' verdicts; ``lines``: what rank 0 prints. ``failed``: ``{system: why}`` of the systems that failed
    their verification, left out of every ratio and verdict (and said so). ``expand``: EPBuffer ran the
    expanded layout, more work than V1's compact one: their ratio gets no verdict."""
    failed = failed or {}
    every = {n: t.median for n, t in trips.items()}
    med = schema.trusted(every, failed)  # what ratios are taken from
    out = {"round_trip_median_s": every, "lines": [], "targets": {"epbuffer_over_buffer_v1_at_most": TARGET_OVER_V1}}
    out["lines"].append("[summary]  round trip, median (epbuffer: dispatch + combine; the others: layout + "
                        "dispatch + combine): " + " | ".join(f"{n} {v * 1e3:.3f} ms" + (" (EXCLUDED)" if n in failed
                                                                                         else "")
                                                             for n, v in every.items()))
    ep = med.get("epbuffer")
    if ep is not None and "buffer_v1" in med:
        r = ep / med["buffer_v1"]
        out["epbuffer_over_buffer_v1"] = r
        if expand:
            out["lines"].append(f"[summary]  epbuffer (expanded layout) / buffer_v1 (compact) round trip: {r:.2f}x "
                                f"(not the same work: the expansion and each rank's sum of a token's slots; no "
                                f"verdict)")
        else:
            out["epbuffer_over_buffer_v1_met"] = r <= TARGET_OVER_V1
            out["lines"].append(f"[summary]  epbuffer / buffer_v1 round trip (same work): {r:.2f}x "
                                f"(target <= {TARGET_OVER_V1:g}x: {'met' if r <= TARGET_OVER_V1 else 'MISSED'})")
    peers = {n: med[n] for n in ("mpi_alltoallv", "gloo_all_to_all") if n in med}
    if ep is not None and peers:
        fastest = min(peers, key=peers.get)
        sp = peers[fastest] / ep
        tgt = TARGET_SPEEDUP.get(R)
        out.update(faster_peer=fastest, speedup_over_faster_peer=sp)
        verdict = ""
        if tgt is not None:
            out["targets"]["speedup_over_faster_peer_at_least"] = tgt
            out["speedup_over_faster_peer_met"] = sp >= tgt
            verdict = f" (target >= {tgt:g}x at {R} ranks: {'met' if sp >= tgt else 'MISSED'})"
        out["lines"].append(f"[summary]  epbuffer speedup over the faster peer ({fastest}): {sp:.2f}x{verdict}")
    cold = med.get("memcpy_roofline_after_experts")
    if ep is not None and cold:
        out["epbuffer_over_roofline_after_experts"] = ep / cold
        line = f"[summary]  epbuffer round trip / the roofline after the experts' step: {ep / cold:.2f}x"
        if peers and TARGET_SPEEDUP.get(R):
            need = min(peers.values()) / TARGET_SPEEDUP[R]  # the round trip the speed-up target asks for
            out["target_time_over_roofline_after_experts"] = need / cold
            line += f"; the speed-up target's time ({need * 1e3:.2f} ms) is {need / cold:.2f}x that roofline"
        out["lines"].append(line)
    if ep is not None and "memcpy_roofline" in med and med["memcpy_roofline"] > 0:
        out["epbuffer_over_roofline"] = ep / med["memcpy_roofline"]
        out["lines"].append(f"[summary]  epbuffer round trip / memcpy roofline of its V2 bytes: "
                            f"{out['epbuffer_over_roofline']:.2f}x")
    out["lines"] += schema.excluded_lines(failed)
    return out


def loop_lines(loop: dict, per_segment: int, summary: dict, expand: bool = False) -> list:
    """``--loop``'s lines (and ``summary["loop_epbuffer_over_buffer_v1"]``): the time per round trip of each
    system run back to back."""
    line = (f"[loop]     back to back, GC on, per round trip (median of {LOOP_SEGMENTS} segments of {per_segment}): "
            + " | ".join(f"{n} {t.median * 1e3:.3f} ms" for n, t in loop.items()))
    if "epbuffer" in loop and "buffer_v1" in loop:
        r = loop["epbuffer"].median / loop["buffer_v1"].median
        summary["loop_epbuffer_over_buffer_v1"] = r
        line += f" | epbuffer / buffer_v1 {r:.2f}x" + (" (expanded against compact: not the same work)"
                                                       if expand else "")
    return [line]


def result_records(ep: EPResult | None, ep_rep: dict | None, others: dict, reports: dict, trips: dict,
                   roof: dict | None, roof_bytes: list | None) -> tuple[list, list]:
    """``(results, baselines)`` of the document (module docstring). ``others``: V1 and the peers'
    :class:`bench.roundtrip.RoundTripResult` by name, ``reports`` their :func:`system_report`, ``trips``
    every round trip :class:`Timing` by system."""
    recs = []
    if ep is not None:
        for phase in ("dispatch", "combine"):
            ph = ep_rep["phases"][phase]
            b = ph["busiest_rank"]
            recs.append(schema.result(
                f"epbuffer/{phase}", None, timing=ep.timings[phase], nbytes=ph["scaleup_bytes_per_rank"][b],
                formula="V2 scale-up: count_bytes per token x tokens received (busiest rank)",
                by_kind={k: v["max_bytes"] for k, v in ph["sent_by_kind"].items()} or None,
                scaleout_bytes=max(ph["scaleout_bytes_per_rank"]), scaleout_gbps=ph["scaleout_gbps"],
                mean_gbps=ph["scaleup_gbps_mean"], busiest_rank=b))
        recs.append(schema.result("epbuffer/round_trip", None, timing=trips["epbuffer"]))
    for name, res in others.items():
        phases = reports[name]["phases"]
        recs.append(schema.result(f"{name}/layout", None, timing=res.timings["layout"]))
        for phase in ("dispatch", "combine"):
            ph = phases[phase]
            recs.append(schema.result(
                f"{name}/{phase}", None, timing=res.timings[phase], nbytes=max(ph["logical_bytes_per_rank"]),
                formula="V2 logical (busiest rank)",
                by_kind={k: v["max_bytes"] for k, v in ph["sent_by_kind"].items()} or None))
        recs.append(schema.result(f"{name}/round_trip", None, timing=trips[name], includes_layout=True))
    if roof is not None:
        for name in ("memcpy_roofline", "memcpy_roofline_after_experts"):
            recs.append(schema.result(f"{name}/round_trip", None, timing=trips[name],
                                      nbytes=max(b["dispatch"] + b["combine"] for b in roof_bytes),
                                      formula="V2 scale-up, dispatch + combine (busiest rank)"))
    names = [r["name"] for r in recs if r["phase"] == "round_trip"]
    for n in names:
        schema.add_ratios(recs, n, names)
    return recs, [r["name"] for r in recs if r["system"] != "epbuffer"]


def run(args) -> int:
    """Run the benchmark (collective; see the module docstring); the exit code: 1 on a failed check,
    2 for a shape the rank count cannot take."""
    torch.set_num_threads(1)
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, R = comm.Get_rank(), comm.Get_size()
    root = rank == 0
    problem = shape_problem(args, R)
    if problem:
        if root:
            print(f"python -m bench ep: error: {problem}", file=sys.stderr)
        return 2
    from deepep_ascend import Buffer, EPBuffer

    rpn = args.ranks_per_node or R
    nodes = R // rpn
    fp8 = not args.bf16
    wl = build_workload(args, rank, R)
    fp = comm_fingerprint(wl, comm)
    extra: dict = {}
    if "ep" in args.systems:
        extra["ep_num_bytes"] = EPBuffer.get_buffer_size_hint(
            comm, args.num_tokens, args.hidden, args.num_topk, fp8,
            allow_multiple_reduction=not args.no_multiple_reduction, ranks_per_node=args.ranks_per_node)
    if root:
        where = f"{nodes} node(s) x {rpn}"
        layout = (f"expanded, expert_alignment {args.expert_alignment}"
                  f"{', zero padding' if args.zero_padding else ''}" if args.expand
                  else f"compact (expert_alignment {args.expert_alignment})")
        if args.no_multiple_reduction:
            layout += ", allow_multiple_reduction=False"
        size = f" | EPBuffer num_bytes {fmt_bytes(extra['ep_num_bytes'])}" if "ep_num_bytes" in extra else ""
        print(f"[config]   ranks {R} ({where}) | tokens/rank {args.num_tokens} | hidden {args.hidden} | "
              f"top-{args.num_topk} of {args.num_experts} experts | dispatch "
              f"{'FP8 (e4m3 + float32 scale per 128 channels)' if fp8 else 'BF16'}, combine BF16 | layout {layout}"
              f"{size} | iters {args.iters} ({cli.warmup_text(args)}) | fingerprint {fp} | cpu {cpu_model()}",
              flush=True)

    loops = int("ep" in args.systems or "v1" in args.systems) + sum(s in args.systems for s in ("mpi", "gloo"))
    bar = progress_bar(root and not args.no_progress, loops * (args.iters + args.warmup), "bench ep")
    ep = buf = v1 = None
    others = {}
    phases, finish_v1 = [], None
    if "ep" in args.systems:
        buf = EPBuffer(comm, extra["ep_num_bytes"], num_max_tokens_per_rank=args.num_tokens, hidden=args.hidden,
                       num_topk=args.num_topk, use_fp8_dispatch=fp8, explicitly_destroy=True,
                       ranks_per_node=args.ranks_per_node, allow_multiple_reduction=not args.no_multiple_reduction)
        ep_phases, finish_ep = epbuffer_phases(buf, wl, args, comm, nodes)
        phases += ep_phases
    if "v1" in args.systems:
        nvl, rdma = normal_buffer_bytes(Buffer, args.num_tokens, args.hidden, R, args.ranks_per_node,
                                        args.num_topk, args.num_experts, fp8)
        extra["v1_num_nvl_bytes"], extra["v1_num_rdma_bytes"] = nvl, rdma
        v1 = Buffer(group=None, num_nvl_bytes=nvl, num_rdma_bytes=rdma, comm=comm, explicitly_destroy=True,
                    ranks_per_node=args.ranks_per_node)
        v1_phases, finish_v1 = round_trip_phases(BufferSystem(v1, "buffer_v1"), wl, prefix="buffer_v1.")
        phases += v1_phases
    if phases:  # EPBuffer's round trip, then V1's, in every iteration: the host's drift hits both alike
        t = time_phases(phases, comm, args.iters, args.warmup, bar.callback)
        if buf is not None:
            ep = finish_ep(t)
        if v1 is not None:
            others["buffer_v1"] = finish_v1(t)
        if args.phases:  # after the timed loop: the headline numbers are measured with the recorder off
            extra["phases"] = gather_breakdown(record_steps(phases, comm, args.iters), comm)
        if args.native_split:  # the same, with the native calls timed
            extra["native_split"] = gather_split(record_split(phases, comm, args.iters), comm)
        if args.compare_sends and buf is not None:
            extra["compare_sends"] = compare_sends(ep_phases, comm, args, nodes)
        if args.loop:
            loops = loop_steps(buf, v1, wl, args)
            extra["loop"] = time_loops(loops, comm, LOOP_SEGMENTS, args.loop, args.warmup)
        extra["memory_after_buffers"] = comm.gather(memory_snapshot(), root=0)
    for b in (buf, v1):  # windows freed before the peers run
        if b is not None:
            destroy_buffer(b, root, "ep")
    buf = v1 = None
    if "mpi" in args.systems:
        others["mpi_alltoallv"] = mpi_alltoallv_roundtrip(wl, comm, args.iters, args.warmup, progress=bar.callback)
    group = None
    if "gloo" in args.systems:
        group = start_gloo(comm)
        others["gloo_all_to_all"] = gloo_all_to_all_roundtrip(wl, comm, args.iters, args.warmup, group=group,
                                                              progress=bar.callback)
    bar.close()

    ep_rep = ep_report(ep, comm) if ep is not None else None
    reports = {n: system_report(r, comm, args.hidden, args.num_topk, fp8) for n, r in others.items()}
    trips: dict[str, Timing] = {}
    if ep is not None:
        trips["epbuffer"] = ep.timings["round_trip"]
    for n, r in others.items():
        trips[n] = r.timings["layout"] + r.timings["dispatch"] + r.timings["combine"]
    roof = roof_cold = roof_bytes = None
    if "roofline" in args.systems:
        if ep is not None:
            d_b, c_b = ep.bytes["scaleup_bytes"], ep.bytes["combine_scaleup_bytes"]
            rows = ep.bytes["rows"]
        else:  # the same V2 bytes (they are the logical formula's) from the routing
            rows = n_recv = num_recv_tokens_of(wl.topk_idx, args.num_experts, comm)
            d_b, c_b = (logical_bytes(n_recv, args.hidden, args.num_topk, fp8, ph) for ph in ("dispatch", "combine"))
        roof = memcpy_roofline(comm, int(d_b), int(c_b), args.iters, args.warmup)
        # the caches as the systems find them, after the experts' step
        roof_cold = roofline_after_experts(comm, int(d_b), int(c_b), args.iters, args.warmup, rows, args.hidden, fp8)
        roof_bytes = comm.allgather(dict(dispatch=int(d_b), combine=int(c_b)))
        trips["memcpy_roofline"] = roof["round_trip"]
        trips["memcpy_roofline_after_experts"] = roof_cold["round_trip"]

    checks: dict = {}
    if ep is not None:
        chk = agree(ep.check, comm)
        if args.no_multiple_reduction:
            chk["rule"] = f"every {'slot' if args.expand else 'rank'}'s row summed, one rounding"
        else:
            chk["rule"] = ("each rank's slots summed and rounded to BF16 first" if args.expand else "compact rows")
            if nodes > 1:
                chk["rule"] += "; each node's partial rounded to BF16"
        checks["epbuffer_vs_reference"] = chk
        if ep.digests is not None and "buffer_v1" in others:
            checks["epbuffer_vs_buffer_v1"] = compare_with_v1(ep, others["buffer_v1"], comm)
    # V1 and the peers against the reference of their arithmetic: a system failing it takes part in no ratio
    verified = {name: verify_round_trip(res, wl, args.num_experts, comm, rpn if name == "buffer_v1" else None)
                for name, res in others.items()}
    failed = {n: why for n, c in verified.items() if (why := verification_failure(c)) is not None}
    if ep is not None:
        c = checks["epbuffer_vs_reference"]
        if not (c["combined_x_equal"] and c["combined_topk_weights_equal"] and c["repeatable"]):
            failed["epbuffer"] = "its round trip differs from the reference (see its [check] line)"
    ref_name = "mpi_alltoallv" if "mpi_alltoallv" in others and "mpi_alltoallv" not in failed else None
    for name, res in others.items():
        if ref_name is not None and name != ref_name:
            checks[f"{name}_vs_{ref_name}"] = compare_outputs(others[ref_name], res, comm,
                                                              two_roundings=name == "buffer_v1" and nodes > 1)
    ok = not failed
    if "epbuffer_vs_buffer_v1" in checks:
        c = checks["epbuffer_vs_buffer_v1"]
        ok = ok and c["combined_x_equal_values"] and all(v for k, v in c.items() if k.startswith("dispatch."))
    ok = ok and all(check_ok(c) for k, c in checks.items() if not k.startswith("epbuffer_"))
    mem = comm.gather(memory_snapshot(), root=0)
    if group is not None:
        import torch.distributed as dist

        dist.destroy_process_group()

    if root:
        if ep is not None:
            print_ep(ep_rep, ep, nodes)
        for name, res in others.items():
            print_system(reports[name], res, trips[name], "(layout + dispatch + combine)")
        if roof is not None:
            print(f"[roofline] {'memcpy':<16}: dispatch {roof['dispatch'].fmt()} | combine {roof['combine'].fmt()} "
                  f"| round trip {roof['round_trip'].fmt()} (one copy of each rank's V2 bytes)")
            print(f"[roofline] {'after experts':<16}: dispatch {roof_cold['dispatch'].fmt()} | combine "
                  f"{roof_cold['combine'].fmt()} | round trip {roof_cold['round_trip'].fmt()} (the same copies, "
                  f"after the benchmark's experts step"
                  + (f" of {roof_cold['experts'].median * 1e3:.1f} ms" if "experts" in roof_cold else "")
                  + ", the combine's from the new pages it leaves: the caches as the systems find them)")
        if "epbuffer_vs_reference" in checks:
            print(fmt_ep_check(checks["epbuffer_vs_reference"], "epbuffer"))
        if "epbuffer_vs_buffer_v1" in checks:
            print(fmt_v1_check(checks["epbuffer_vs_buffer_v1"]))
        for name, chk in verified.items():
            print(fmt_verification(name, chk))
        for key, chk in checks.items():
            if not key.startswith("epbuffer_"):
                print(fmt_check(ref_name, key.split("_vs_")[0], chk))
        if extra.get("phases"):
            print("\n".join(breakdown_lines(extra["phases"])))
        if args.native_split:
            print("\n".join(split_lines(extra.get("native_split") or {})))
        summary = summarize(trips, R, failed, args.expand)
        if "loop" in extra:
            summary["lines"] += loop_lines(extra["loop"], args.loop, summary, args.expand)
        for line in summary["lines"]:
            print(line)
        if extra.get("compare_sends"):
            print(send_modes.line("[sends]    ", "epbuffer with the combine's staged rows", extra["compare_sends"],
                                  "; rows the combine reads in place are not staged (--bf16's identity experts hand "
                                  "recv_x back): then both modes time the same code"))
        peak = [m["peak_rss"] for m in mem]
        print(f"[memory]   peak RSS/rank max {fmt_bytes(max(peak))} (incl. touched shared windows)", flush=True)
        if args.json:
            records, baselines = result_records(ep, ep_rep, others, reports, trips, roof, roof_bytes)
            schema.write(args.json, schema.document(
                "ep", argv=args._argv, params=cli.params_of(args, R), results=records, baselines=baselines,
                fingerprint=fp, checks=dict(ok=ok, results=checks, reference=ref_name, verified=verified),
                summary={k: v for k, v in summary.items() if k != "lines"}, failed=failed,
                details=dict(workload=dict(wl.params, expand=args.expand, zero_padding=args.zero_padding,
                                           multiple_reduction=not args.no_multiple_reduction,
                                           expert_alignment=args.expert_alignment),
                             epbuffer=ep_rep, systems=reports, roofline_bytes_per_rank=roof_bytes,
                             nodes=nodes, ranks_per_node=rpn,
                             buffers={k: v for k, v in extra.items()
                                      if not k.startswith("memory")
                                      and k not in ("phases", "loop", "native_split", "compare_sends")},
                             phases=extra.get("phases"), native_split=extra.get("native_split"),
                             loop={n: t.as_dict() for n, t in extra.get("loop", {}).items()} or None,
                             compare_sends=extra.get("compare_sends"),
                             memory=dict(per_rank_end=mem, **{k: v for k, v in extra.items()
                                                             if k.startswith("memory")}))))
    return 0 if ok else 1


def main(argv=None) -> int:
    """``python -m bench ep`` in-process, without the MPI exit path (tests)."""
    from bench import commands

    return commands.call("ep", argv)


if __name__ == "__main__":
    from bench import commands

    commands.alias("ep")
