"""Low-latency (DeepEP LL) dispatch + combine benchmark, with the same-run peer pipelines.

Run one process per rank::

    mpiexec -n 4 python -m bench low-latency                    # decode shape, FP8 dispatch, BF16 combine
    mpiexec -n 4 python -m bench low-latency --ranks-per-node 2 # two simulated nodes (URMA between them)
    mpiexec -n 2 python -m bench low-latency --bf16 --num-tokens 64 --no-ubmem --json out.json
    mpiexec -n 4 python -m bench low-latency --logfmt            # LogFMT-10 combine (rows scaled by 2^-6)
    mpiexec -n 2 python -m bench low-latency --zero-copy         # experts write into the zero-copy buffer
    mpiexec -n 2 python -m bench low-latency --stream-rows always # the receive stores recv_x by streaming stores
    mpiexec -n 4 python -m bench low-latency --stream-sends never # the combine returns its rows by plain stores

Workload: DeepEP's LL decode shape (docs/semantics/deepep-api.md §11: 128 tokens per rank, hidden 7168, top-8 of 256
experts; FP8 dispatch, BF16 combine), ``bench.workload.make_workload`` (``x = randn``, routing =
top-k of ``randn.abs() + 1``, weights ``randn.abs()``), ``M = tokens``. The "experts" are the
identity (FP8 rows cast back to BF16).

Measured, each as the max over ranks per iteration, median and p99 over ``--iters``:

* ``dispatch`` / ``combine`` / round trip of ``low_latency_dispatch`` / ``low_latency_combine``;
* hook mode: ``send`` (the call returns after issuing its sends) and ``recv`` (the hook);
* overlap: send, then a matmul calibrated to last as long as the round trip, then the hook,
  for dispatch and combine; reported against ``max(communication, compute)``;
* the single-copy memory roofline: each rank copies its LL-formula dispatch bytes once and its
  combine bytes once, all ranks at once (``bench.roofline.memcpy_roofline``); a transport that
  moves each byte with one copy cannot beat it; and the same copies after the benchmark's experts step
  (FP8: the received rows cast back, untimed), the combine bytes read from new pages written just before:
  the caches as the systems find them;
* the peer pipelines a user would write instead, on the same workload (``bench.baselines``:
  MPI ``Alltoallv`` and torch gloo ``all_to_all_single``, per destination *rank* with an
  unweighted combine — DeepEP-V1 normal semantics, which is what those pipelines implement), each
  verified against a plain-torch reference (:func:`bench.roundtrip.verify_round_trip`); one that fails it
  (or the LL check failing) is left out of the speed-up and named as excluded (``summary.excluded``).

Bandwidth (GB = 1e9 B): DeepEP's LL formula (docs/semantics/deepep-api.md §11) per valid selection — dispatch
``H + H/32 + 16`` B (FP8) or ``2H + 16`` B (BF16), combine ``2H`` B — over the call time; and
per channel kind (SELF / UBMEM / URMA) the bytes this rank's calls moved
(``Buffer.runtime.stats``) over the time. ``[project]`` lines: the time one call's counted
traffic would take on ``--link-profile``'s links (a model; docs/design/transports.md §5), with the LL
formula's GB/s at that time next to the measured one; ``--link-emulation delay`` slows the LL
calls' links (SIMULATION, labelled; the peers are not slowed). Performance targets are reported, never asserted:
round trip <= 2x the roofline; no slower than the faster peer pipeline at 2 ranks and >= 2x faster at 4
(``ROOFLINE_TARGET``, ``PEER_TARGETS``); overlapped total <= 1.3x the longer of communication and compute.

``--json FILE`` (``bench.schema``): results ``deepep_ascend/dispatch`` and ``/combine`` (the
busiest rank's LL-formula bytes), ``/round_trip`` (``by_kind``: the busiest rank's bytes moved
per channel kind in one round trip), the hook halves (``/dispatch_send``, ``/dispatch_recv``,
``/combine_send``, ``/combine_recv``), ``/overlapped_round_trip`` and ``compute/call``, each
with ``p99_s``; the baselines ``mpi_alltoallv/round_trip``, ``gloo_all_to_all/round_trip`` and
``memcpy_roofline/round_trip``.
"""
from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from bench import cli, schema, send_modes
from bench.baselines import gloo_all_to_all_roundtrip, mpi_alltoallv_roundtrip, start_gloo
from bench.formulas import fmt_bytes, gbps, low_latency_bytes
from bench.linkmodel import link_model_doc, link_setup, project_phases, projection_lines, use_link_emulator
from bench.native_split import gather_split, record_split, split_lines
from bench.phases import breakdown_lines, gather_breakdown, record_steps
from bench.roofline import memcpy_roofline, roofline_after_experts
from bench.roundtrip import fmt_verification, verification_failure, verify_round_trip
from bench.timing import Timing, time_phases
from bench.workload import calc_diff, comm_fingerprint, make_workload, per_token_cast_back

LOGFMT_SCALE = 2.0 ** -6  # --logfmt: expert rows scaled below 1 (exact in bf16), so groups go as LogFMT
LOGFMT_CALC_DIFF = 1e-4  # LogFMT-10's relative error is <= 2.2 % per value (quant.logfmt10_encode)
KINDS = ("SELF", "UBMEM", "URMA")


#: Issue 28's decode targets (reported, never asserted): the round trip within ROOFLINE_TARGET times the one-copy
#: roofline, and PEER_TARGETS[ranks] times faster than the faster peer pipeline (1: no slower).
ROOFLINE_TARGET = 2.0
PEER_TARGETS = {2: 1.0, 4: 2.0}


def send_stream_problem(args, buf, stream_sends) -> str | None:
    """Why no combine of this run can store its rows by streaming stores (a sentence), or None: they go through
    the native sends on one node only (``native.ll_stream_rows(side="send")``)."""
    if stream_sends is None:
        return "the native kernels are not loaded (the torch path stores plainly)"
    if args.zero_copy:
        return "with --zero-copy the combine copies no row (the receivers read them where they lie)"
    if args.logfmt:
        return "LogFMT rows take the torch path"
    if args.no_ubmem or buf.num_nodes > 1:
        return "rows to other nodes, or without UBMEM, go by put (the torch path)"
    return None


def add_arguments(p) -> None:
    """The command's options: the shared ones (``bench.cli``) and its own."""
    cli.add_shared(p, num_tokens=128, hidden=7168, num_topk=8, num_experts=256, iters=30, warmup=3, seed=0,
                   json=None, ranks_per_node=None, phases=False, native_split=False,
                   helps=dict(num_tokens="= num_max_dispatch_tokens_per_rank"))
    p.add_argument("--bf16", action="store_true", help="BF16 dispatch (default FP8)")
    p.add_argument("--no-ubmem", action="store_true",
                   help="allow_nvlink_for_low_latency_mode=False: same-node peers through put, not stores")
    p.add_argument("--logfmt", action="store_true",
                   help="combine with use_logfmt=True (LogFMT-10); the identity experts scale their rows by 2^-6 "
                        "(exact) so that groups stay below 1 and travel as LogFMT")
    p.add_argument("--zero-copy", action="store_true",
                   help="the experts write into get_next_low_latency_combine_buffer and the combine runs with "
                        "zero_copy=True (on one node the receivers then read the rows where the experts left them)")
    p.add_argument("--stream-rows", choices=("never", "large", "always"), default=None,
                   help="deepep_ascend.native.ll_stream_rows on every rank (default: the library's, "
                        "DEEPEP_ASCEND_LL_STREAM_ROWS, 'large' unless set): when the dispatch's receive stores "
                        "recv_x by streaming stores; the experts step after it, untimed here, then reads the rows "
                        "from memory (python -m bench ll-receive times both)")
    p.add_argument("--stream-sends", choices=("never", "large", "always"), default=None,
                   help="deepep_ascend.native.ll_stream_rows(side='send') on every rank (default: the library's, "
                        "DEEPEP_ASCEND_LL_STREAM_SENDS, 'large' unless set): when the combine stores the rows it "
                        "returns into the other ranks' windows by streaming stores")
    p.add_argument("--compare-sends", action="store_true",
                   help="after the timed loop, time dispatch + combine again with the combine's returned rows "
                        "stored by plain and by streaming stores in turn, both in every iteration (the same run, "
                        "rows and routing): a [sends] line with both combines' medians")
    p.add_argument("--no-baselines", action="store_true", help="skip the MPI / gloo pipelines")
    cli.add_link_args(p)


def check_args(p, a) -> None:
    """The link profile and emulator, ``--zero-copy`` without ``--logfmt`` (``p.error`` on bad values)."""
    a.profile, a.emulator = link_setup(p, a)
    if a.zero_copy and a.logfmt:
        p.error("--zero-copy does not go with --logfmt (DeepEP's low_latency_combine refuses the pair)")
    if a.num_tokens >= 65536:
        p.error(f"--num-tokens {a.num_tokens} must be below 65536 (num_max_dispatch_tokens_per_rank, the "
                f"low-latency header's 16 bits)")
    if not a.bf16 and a.hidden % 128:
        p.error(f"FP8 dispatch (the default; --bf16 for BF16) needs --hidden a multiple of 128, got {a.hidden}")
    if a.logfmt and a.hidden % 128:
        p.error(f"--logfmt needs --hidden a multiple of 128, got {a.hidden}")


def p99(t: Timing) -> float:
    return float(np.percentile(t.times, 99)) if t.times else float("nan")


def us(t: Timing) -> str:
    return f"median {t.median * 1e6:9.1f} us  p99 {p99(t) * 1e6:9.1f} us"


def result_records(out: dict, t: dict, th: dict, to: dict, tc: Timing, base: dict, roof: Timing) -> list:
    """The document's ``results`` (``bench.schema``): ``deepep_ascend/dispatch`` and ``/combine`` with the
    busiest rank's LL-formula bytes, ``/round_trip`` with ``by_kind`` (the busiest rank's bytes moved per
    channel kind in one round trip), the hook halves, the overlapped round trip and the compute it hid,
    then the baselines; every record with its ``p99_s``; ``ratio_to`` between the round trips."""
    b = out["bytes"]
    per_trip = {}
    for k in KINDS:
        vals = [d.get(k) for d in b["moved_by_kind_per_rank"]]
        if all(isinstance(v, (int, float)) for v in vals):
            v = max(vals) / b["calls"]  # moved over `calls` round trips
            per_trip[k] = int(v) if float(v).is_integer() else v
    recs = [schema.result(f"deepep_ascend/{ph}", None, timing=t[ph], nbytes=max(b[f"{ph}_per_rank"]),
                          formula="DeepEP LL (busiest rank)", p99_s=p99(t[ph])) for ph in ("dispatch", "combine")]
    recs.append(schema.result("deepep_ascend/round_trip", None, timing=t["round_trip"], by_kind=per_trip or None,
                              p99_s=p99(t["round_trip"])))
    for key, name in (("d_send", "dispatch_send"), ("d_recv", "dispatch_recv"), ("c_send", "combine_send"),
                      ("c_recv", "combine_recv")):
        recs.append(schema.result(f"deepep_ascend/{name}", None, timing=th[key], p99_s=p99(th[key])))
    overlapped = to["dispatch"] + to["combine"]
    recs.append(schema.result("deepep_ascend/overlapped_round_trip", None, timing=overlapped, p99_s=p99(overlapped)))
    recs.append(schema.result("compute/call", None, timing=tc, p99_s=p99(tc)))
    for k, v in base.items():
        recs.append(schema.result(f"{k}/round_trip", None, timing=v, p99_s=p99(v)))
    recs.append(schema.result("memcpy_roofline/round_trip", None, timing=roof, p99_s=p99(roof),
                              nbytes=out["roofline"]["dispatch_bytes"] + out["roofline"]["combine_bytes"],
                              formula="DeepEP LL (this rank)"))
    trips = [r["name"] for r in recs if r["phase"] == "round_trip"]
    for name in trips:
        schema.add_ratios(recs, name, trips)
    return recs


def run(args) -> int:
    """Run the benchmark (collective; see the module docstring); the exit code: 1 on a failed check."""
    from mpi4py import MPI

    from bench.internals import ll_zeros
    from deepep_ascend import Buffer, native
    from deepep_ascend.transports import LinkStats

    comm = MPI.COMM_WORLD
    rank, R = comm.Get_rank(), comm.Get_size()
    torch.set_num_threads(1)
    N, H, K, E = args.num_tokens, args.hidden, args.num_topk, args.num_experts
    fp8 = not args.bf16
    wl = make_workload(N, H, K, E, rank, R, seed=args.seed, fp8=False)
    nbytes = Buffer.get_low_latency_rdma_size_hint(N, H, R, E)
    buf = Buffer(None, 0, nbytes, low_latency_mode=True, comm=comm, explicitly_destroy=True,
                 ranks_per_node=args.ranks_per_node, allow_nvlink_for_low_latency_mode=not args.no_ubmem)
    emulator = use_link_emulator(buf.runtime, args.emulator)
    # restored at the end (the tests run commands in one process)
    stream_before = native.ll_stream_rows(), native.ll_stream_rows(side="send")
    stream_rows = native.ll_stream_rows(args.stream_rows)  # None without the kernels (the torch path streams nothing)
    stream_min = native.ll_stream_min_bytes()
    stream_sends = native.ll_stream_rows(args.stream_sends, side="send")
    stream_send_min = native.ll_stream_min_bytes(side="send")
    args.stream_rows, args.stream_sends = stream_rows, stream_sends  # the modes in force, in the document's params
    out = {"config": dict(ranks=R, tokens=N, hidden=H, topk=K, experts=E, fp8_dispatch=fp8, logfmt_combine=args.logfmt,
                          zero_copy=args.zero_copy, stream_rows=stream_rows, stream_min_bytes=stream_min,
                          stream_sends=stream_sends, stream_send_min_bytes=stream_send_min,
                          ranks_per_node=buf.ranks_per_node, nodes=buf.num_nodes, ubmem=not args.no_ubmem,
                          num_rdma_bytes=nbytes, iters=args.iters, warmup=args.warmup,
                          fingerprint=comm_fingerprint(wl, comm))}
    st = {"dispatches": 0}

    def experts(recv_x, recv_count, handle):
        """Identity experts; FP8 rows cast back to BF16 (only the valid rows: the rest is padding). With
        ``--zero-copy`` they write into the buffer's zero-copy combine buffer, else into new memory."""
        if not fp8 and not args.zero_copy:
            return recv_x.mul_(LOGFMT_SCALE) if args.logfmt else recv_x
        data, scales = recv_x if fp8 else (recv_x, None)
        y = (buf.get_next_low_latency_combine_buffer(handle) if args.zero_copy
             else ll_zeros(data.shape, torch.bfloat16))
        for e, c in enumerate(recv_count.tolist()):
            if c:
                y[e, :c] = per_token_cast_back(data[e, :c], scales[e, :c].contiguous()) if fp8 else data[e, :c]
                if args.logfmt:
                    y[e, :c].mul_(LOGFMT_SCALE)
        return y

    def dispatch():
        st["d"] = buf.low_latency_dispatch(wl.x, wl.topk_idx, N, E, use_fp8=fp8)
        st["dispatches"] += 1

    def make_y():
        st["y"] = experts(st["d"][0], st["d"][1], st["d"][2])

    def combine():
        st["c"] = buf.low_latency_combine(st["y"], wl.topk_idx, wl.topk_weights, st["d"][2], use_logfmt=args.logfmt,
                                          zero_copy=args.zero_copy)

    # Correctness once: identity experts, so combined ≈ x · Σ w (docs/semantics/deepep-api.md §9 invariant 12).
    dispatch(), make_y(), combine()
    # What the receive streamed: every call of the run receives these rows (the routing does not change).
    rows_bytes = int(st["d"][1].sum()) * H * (1 if fp8 else 2)
    # (the native receive runs on one node with UBMEM only: elsewhere the torch path stores plainly)
    recv_native = stream_rows is not None and buf.num_nodes == 1 and not args.no_ubmem
    got = comm.allgather((rows_bytes, bool(native.ll_streams(rows_bytes)) if recv_native else False))
    out["config"].update(recv_rows_bytes_max=max(b for b, _ in got), streamed_ranks=sum(f for _, f in got))
    # What the combine streams: the rows it returns to other ranks (its own stay where they lie; none move with
    # --zero-copy), per source the count of the handle's layout_range; only the native sends on one node stream
    # (LogFMT rows, puts between nodes or without UBMEM take the torch path)
    counts = st["d"][2].layout_range & 0xFFFFFFFF
    send_bytes = 0 if args.zero_copy else (int(counts.sum()) - int(counts[:, rank].sum())) * 2 * H
    no_streaming = send_stream_problem(args, buf, stream_sends)
    got = comm.allgather((send_bytes, bool(native.ll_streams(send_bytes, side="send"))
                          if no_streaming is None else False))
    out["config"].update(send_rows_bytes_max=max(b for b, _ in got), streamed_send_ranks=sum(f for _, f in got),
                         sends_plain_because=no_streaming)
    approx = wl.x.float() * wl.topk_weights.sum(1, keepdim=True) * (LOGFMT_SCALE if args.logfmt else 1.0)
    diff = comm.allreduce(calc_diff(st["c"][0].float(), approx), op=MPI.MAX)
    bound = (9e-4 if fp8 else 1e-5) + (LOGFMT_CALC_DIFF if args.logfmt else 0.0)
    out["check"] = dict(calc_diff=diff, bound=bound, ok=diff < bound)

    before, st["dispatches"] = buf.runtime.stats.snapshot(), 0  # the calls the traffic below comes from
    t = time_phases([("dispatch", dispatch), (None, make_y), ("combine", combine)], comm, args.iters, args.warmup)
    moved = LinkStats.bytes_by_kind(LinkStats.diff(buf.runtime.stats.snapshot(), before))
    calls = st["dispatches"]  # round trips counted, the warm-up's included (it runs for --warmup-s too)
    t["round_trip"] = t["dispatch"] + t["combine"]

    if args.compare_sends and no_streaming is not None:
        out["compare_sends"] = {"not_compared": no_streaming}
    elif args.compare_sends:
        out["compare_sends"] = send_modes.compare([("dispatch", dispatch), (None, make_y), ("combine", combine)],
                                                  comm, args.iters, args.warmup)

    # Hook mode: the send / receive split.
    def d_send():
        st["d"] = buf.low_latency_dispatch(wl.x, wl.topk_idx, N, E, use_fp8=fp8, return_recv_hook=True)

    def d_recv():
        st["d"][4]()

    def c_send():
        st["c"] = buf.low_latency_combine(st["y"], wl.topk_idx, wl.topk_weights, st["d"][2], return_recv_hook=True,
                                          use_logfmt=args.logfmt, zero_copy=args.zero_copy)

    def c_recv():
        st["c"][2]()

    th = time_phases([("d_send", d_send), ("d_recv", d_recv), (None, make_y), ("c_send", c_send),
                        ("c_recv", c_recv)], comm, args.iters, args.warmup)
    recorded = [("dispatch", dispatch), (None, make_y), ("combine", combine), ("dispatch send", d_send),
                ("dispatch hook", d_recv), (None, make_y), ("combine send", c_send), ("combine hook", c_recv)]
    if args.phases:  # after the timed loops: the headline numbers are measured with the recorder off
        out["phases"] = gather_breakdown(record_steps(recorded, comm, args.iters), comm)
    if args.native_split:  # the same, with the native calls timed
        out["native_split"] = gather_split(record_split(recorded, comm, args.iters), comm)

    # Overlap: a compute as long as one call's communication between its send and its hook.
    # Calibrated on warm matmuls, every rank at once (as they will run): the first matmuls pay one-time
    # start-up costs, and a calibration that counted them made the compute ~40x too short.
    comm_s = t["round_trip"].median / 2
    a = torch.randn(256, 256)
    for _ in range(3):
        a @ a
    comm.Barrier()
    reps = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ a
        el = time.perf_counter() - t0
        if el >= comm_s or reps > 1 << 16:
            break
        reps *= 2
    reps = max(1, round(statistics.median(comm.allgather(reps * comm_s / max(el, 1e-9)))))

    def compute():
        for _ in range(reps):
            a @ a

    tc = time_phases([("compute", compute)], comm, args.iters, args.warmup)["compute"]

    def overlapped_dispatch():
        d_send(), compute(), d_recv()

    def overlapped_combine():
        c_send(), compute(), c_recv()

    to = time_phases([("dispatch", overlapped_dispatch), (None, make_y), ("combine", overlapped_combine)], comm,
                       args.iters, args.warmup)
    overlap_total = (to["dispatch"] + to["combine"]).median
    longer = max(t["round_trip"].median, 2 * tc.median)

    # DeepEP's LL byte formula (docs/semantics/deepep-api.md §11), this rank's valid selections.
    sel = int((wl.topk_idx >= 0).sum())
    d_bytes, c_bytes = (low_latency_bytes(sel, H, fp8, ph, logfmt=args.logfmt) for ph in ("dispatch", "combine"))

    # Projection: one more (untimed) round trip, counters per call, on --link-profile's links.
    dispatch()
    s_d = buf.get_link_stats()
    make_y(), combine()
    s_c = buf.get_link_stats()
    out["bytes"] = dict(formula="DeepEP LL (bench.formulas.low_latency_bytes)",
                        dispatch_per_rank=comm.allgather(d_bytes),
                        combine_per_rank=comm.allgather(c_bytes), calls=calls,
                        moved_by_kind_per_rank=comm.allgather({k: int(v) for k, v in moved.items()}))
    out["bytes"]["one_call_by_kind_rank0"] = {ph: LinkStats.bytes_by_kind(sn) for ph, sn in (("dispatch", s_d),
                                                                                           ("combine", s_c))}
    out["link_model"] = link_model_doc(args.profile, emulator)
    out["projection"] = project_phases({"dispatch": s_d, "combine": s_c}, comm, args.profile,
                                         {"dispatch": d_bytes, "combine": c_bytes})
    out["ll"] = {k: v.as_dict() | {"p99_s": p99(v)} for k, v in {**t, **th}.items()}
    out["bandwidth_GBps"] = dict(dispatch=gbps(d_bytes, t["dispatch"].median),
                                 combine=gbps(c_bytes, t["combine"].median),
                                 per_kind={k: gbps(v / calls, t["round_trip"].median) for k, v in moved.items()})
    out["overlap"] = dict(compute_per_call_s=tc.median, comm_per_call_s=comm_s, total_s=overlap_total, longer_s=longer,
                          ratio=overlap_total / longer, target=1.3)

    # Same-run baselines on the same workload.
    base = {}
    failed = {} if out["check"]["ok"] else {"deepep_ascend": f"combined vs x*sum(w): calc_diff {diff:.2e} is not "
                                                              f"below {out['check']['bound']:g}"}
    if not args.no_baselines:
        wl_b = make_workload(N, H, K, E, rank, R, seed=args.seed, fp8=fp8)
        runs = {"mpi_alltoallv": mpi_alltoallv_roundtrip(wl_b, comm, args.iters, args.warmup)}
        start_gloo(comm)
        runs["gloo_all_to_all"] = gloo_all_to_all_roundtrip(wl_b, comm, args.iters, args.warmup)
        base = {k: v.timings["round_trip"] for k, v in runs.items()}
        out["baseline_checks"] = {k: verify_round_trip(v, wl_b, E, comm) for k, v in runs.items()}
        failed.update({k: why for k, c in out["baseline_checks"].items()
                       if (why := verification_failure(c)) is not None})
    ok = out["check"]["ok"] and not failed  # a baseline that fails its verification fails the run too
    out["baselines"] = {k: v.as_dict() | {"p99_s": p99(v)} for k, v in base.items()}
    roof = memcpy_roofline(comm, d_bytes, c_bytes, args.iters, args.warmup)["round_trip"]
    out["roofline"] = roof.as_dict() | {"dispatch_bytes": d_bytes, "combine_bytes": c_bytes}
    # the caches as the systems find them, after the experts' step on this rank's received rows
    after = roofline_after_experts(comm, d_bytes, c_bytes, args.iters, args.warmup, int(st["d"][1].sum()), H, fp8)
    roof_new, experts_step = after["round_trip"], after.get("experts")
    out["roofline_after_experts"] = roof_new.as_dict()
    peers = schema.trusted(base, failed)  # the systems that failed their verification take part in no ratio
    if peers and "deepep_ascend" not in failed:
        faster = min(v.median for v in peers.values())
        out["summary"] = dict(speedup_over_faster_peer=faster / t["round_trip"].median,
                              target=PEER_TARGETS.get(R) if emulator is None else None)

    records = result_records(out, t, th, to, tc, base, roof)
    if rank == 0:
        c = out["config"]
        if emulator is not None:
            print(f"[link]   {emulator.label} -- the [ll]/[hook]/[overlap] lines are EMULATED, the peers are not")
        print(f"[config] {R} ranks ({c['nodes']} node(s) x {c['ranks_per_node']}), tokens {N}, hidden {H}, top-{K}, "
              f"{E} experts, {'FP8' if fp8 else 'BF16'} dispatch, {'LogFMT-10' if args.logfmt else 'BF16'} combine"
              f"{' (zero-copy)' if args.zero_copy else ''}, "
              + {None: "", "never": "recv_x by plain stores, ", "always": "recv_x by streaming stores, ",
                 "large": f"recv_x by streaming stores from {fmt_bytes(stream_min or 0)} of rows (this run: "
                          f"up to {fmt_bytes(c['recv_rows_bytes_max'])} per receive, {c['streamed_ranks']} of {R} "
                          f"ranks streamed), "}[stream_rows]
              + (f"returned rows by plain stores ({c['sends_plain_because']}), "
                 if c["sends_plain_because"] and stream_sends is not None else
                 {None: "", "never": "returned rows by plain stores, ", "always": "returned rows by streaming stores, ",
                  "large": f"returned rows by streaming stores from {fmt_bytes(stream_send_min or 0)} (this run: up "
                           f"to {fmt_bytes(c['send_rows_bytes_max'])} per combine, {c['streamed_send_ranks']} of {R} "
                           f"ranks streamed), "}[stream_sends])
              + (f"same-node peers by {'UBMEM stores' if c['ubmem'] else 'put'}, " if c['ranks_per_node'] > 1
                 else "no same-node peers (one rank per node), ")
              + f"num_rdma_bytes {fmt_bytes(nbytes)}, "
              f"fingerprint {c['fingerprint']}")
        print(f"[check]  combined vs x*sum(w): calc_diff {diff:.2e} (bound {out['check']['bound']:g}) "
              f"{'ok' if out['check']['ok'] else 'MISMATCH'}")
        bw = out["bandwidth_GBps"]
        emu = " [EMULATED links]" if emulator is not None else ""  # on every line an emulated run affects
        lines = [f"[ll]     dispatch   {us(t['dispatch'])}  {bw['dispatch']:7.2f} GB/s (LL formula){emu}",
                 f"[ll]     combine    {us(t['combine'])}  {bw['combine']:7.2f} GB/s (LL formula){emu}",
                 f"[ll]     round trip {us(t['round_trip'])}{emu}",
                 "[ll]     per channel kind: " + ", ".join(
                     f"{k} {v:.2f} GB/s" for k, v in bw["per_kind"].items()) + emu,
                 "[ll]     bytes of one call on rank 0: " + " | ".join(
                     f"{ph} " + ", ".join(f"{k} {v:,}" for k, v in kinds.items())
                     for ph, kinds in out["bytes"]["one_call_by_kind_rank0"].items())]
        lines += projection_lines(out["projection"], {"dispatch": (t["dispatch"].median, bw["dispatch"]),
                                                        "combine": (t["combine"].median, bw["combine"])},
                                    "LL formula", emulator)
        if "compare_sends" in out:
            lines.append(send_modes.line("[sends]  ", f"the combine's returned rows (up to "
                                         f"{fmt_bytes(c['send_rows_bytes_max'])} per rank)", out["compare_sends"],
                                         emu))
        o = out["overlap"]
        lines += [f"[hook]   dispatch send {us(th['d_send'])} | recv {us(th['d_recv'])}{emu}",
                  f"[hook]   combine  send {us(th['c_send'])} | recv {us(th['c_recv'])}{emu}",
                  f"[overlap] compute {o['compute_per_call_s'] * 1e6:.1f} us per call (communication "
                  f"{o['comm_per_call_s'] * 1e6:.1f} us per call); per round trip (2 calls): send+compute+hook "
                  f"{o['total_s'] * 1e6:.1f} us vs longer of (comm, compute) {o['longer_s'] * 1e6:.1f} us: "
                  f"{o['ratio']:.2f}x" + ((" (target <= 1.3x: " + ("met" if o["ratio"] <= 1.3 else "MISSED") + ")")
                                          if emulator is None else emu)]
        peer_note = " (LL on EMULATED links; peers not slowed)" if emulator is not None else ""
        for k, v in base.items():
            ratio = ("EXCLUDED: failed its verification" if k in failed or "deepep_ascend" in failed
                     else f"{v.median / t['round_trip'].median:.2f}x the LL round trip{peer_note}")
            lines.append(f"[base]   {k:16s} round trip {us(v)}  ({ratio})")
        for k, c in out.get("baseline_checks", {}).items():
            lines.append(fmt_verification(k, c).replace("[check]    ", "[check]  "))
        goal = out.get("summary", {}).get("target")
        need = (f"; the peer target's time ({faster / goal * 1e3:.2f} ms) is {faster / goal / roof.median:.2f}x the "
                f"roofline" if goal else "")
        ratio = t["round_trip"].median / roof.median
        verdict = (f" (target <= {ROOFLINE_TARGET:g}x: {'met' if ratio <= ROOFLINE_TARGET else 'MISSED'})"
                   if emulator is None else emu)
        lines.append(f"[roofline] memcpy of this rank's LL-formula bytes, one copy each way, all ranks at once: "
                     f"round trip {us(roof)}; LL round trip / roofline {ratio:.1f}x{verdict}{need}")
        step = f" (FP8 rows cast back, {experts_step.median * 1e3:.1f} ms)" if experts_step is not None else ""
        lines.append(f"[roofline] the same after the benchmark's experts step{step}, "
                     f"the combine bytes copied from the new pages it leaves: round trip {us(roof_new)}; LL round "
                     f"trip / that "
                     f"{t['round_trip'].median / roof_new.median:.1f}x")
        if "summary" in out:
            sp = out["summary"]["speedup_over_faster_peer"]
            tgt = (f" (target: {'no slower' if goal == 1 else f'>= {goal:g}x faster'} at {R} ranks: "
                   f"{'met' if sp >= goal else 'MISSED'})" if goal else "")
            how = f"{sp:.2f}x faster than" if sp >= 1 else f"{1 / sp:.2f}x slower than"
            lines.append(f"[summary] LL round trip is {how} the faster peer pipeline{tgt}{peer_note}")
        lines += schema.excluded_lines(failed, "[summary] ")
        if out.get("phases"):
            lines += breakdown_lines(out["phases"])
        if args.native_split:
            lines += split_lines(out.get("native_split") or {})
        print("\n".join(lines), flush=True)
        if args.json:
            schema.write(args.json, schema.document(
                "low-latency", argv=args._argv, params=cli.params_of(args, R), fingerprint=out["config"]["fingerprint"],
                results=records,
                baselines=[n for n in (f"{k}/round_trip" for k in base)] + ["memcpy_roofline/round_trip"],
                checks=dict(out["check"], ok=ok, baselines=out.get("baseline_checks", {})),
                summary=out.get("summary", {}), link_model=out["link_model"], failed=failed,
                projection=out["projection"],
                details={k: v for k, v in out.items() if k not in ("check", "summary", "link_model", "projection")}))
    st.clear()
    wl = None
    buf.destroy()
    if stream_before[0] is not None:
        native.ll_stream_rows(stream_before[0])
        native.ll_stream_rows(stream_before[1], side="send")
    if base:
        import torch.distributed as dist
        dist.destroy_process_group()
    return 0 if ok else 1


def main(argv=None) -> int:
    """``python -m bench low-latency`` in-process, without the MPI exit path (tests)."""
    from bench import commands

    return commands.call("low-latency", argv)


if __name__ == "__main__":
    from bench import commands

    commands.alias("low-latency")
