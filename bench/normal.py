"""Normal-mode (DeepEP V1) dispatch + combine benchmark, with the baselines a user would pick instead.

Run one process per rank::

    mpiexec -n 4 python -m bench normal                       # DeepSeek-V3-like default, BF16
    mpiexec -n 4 python -m bench normal --fp8 --json out.json # FP8 dispatch, BF16 combine
    mpiexec -n 2 python -m bench normal --num-tokens 512 --hidden 2048 --baselines-only

Workload (default shaped like DeepSeek-V3, as DeepEP's published V1 numbers): 4096 tokens per
rank, hidden 7168, 256 experts, top-8; ``x = randn`` (BF16), routing = top-k of
``randn(N, E).abs() + 1`` and weights ``randn(N, K).abs()``, from a generator seeded
``seed * 65536 + rank`` (``--seed``, default 0); ``torch.set_num_threads(1)`` on every rank.
``--routing FILE`` replays a saved ``topk_idx`` trace instead (format: ``bench/routing.py``
docstring — ``.npz``/``.pt`` with ``topk_idx`` ``[T, K]`` or ``[S, T, K]``, ``T`` = global tokens
split evenly over the ranks, ids in ``[-1, E)``, optional ``num_experts`` and ``topk_weights``;
``--routing-step`` picks ``S``; the tokens per rank and top-k come from the file).
``--save-routing FILE`` writes the routing a run used in that format.

Systems, each doing the same round trip on the same data (dispatch → identity "experts" →
combine with the received weights), one after another. Identity experts hand ``recv_x`` itself to
combine, as DeepEP's own tests do; deepep_ascend's combine then reads those rows in place (they lie
in its landing segment). ``--expert-fn copy`` hands a new tensor instead (a copy made untimed, as a
real expert's output), which combine stages first:

* ``deepep_ascend``: ``Buffer.get_dispatch_layout`` / ``dispatch`` / ``combine``;
* ``mpi_alltoallv``: order tokens by destination, ``Alltoall`` counts, ``Alltoallv`` rows
  (payload, then packed top-k ids / weights / FP8 scales), back with ``Alltoallv``, float32
  ``index_add_`` by ascending source rank, one BF16 cast;
* ``gloo_all_to_all``: the same over ``torch.distributed`` gloo ``all_to_all_single``;
* ``memcpy roofline``: one ``copy_`` of each rank's dispatch bytes and one of its combine bytes.

Every system's round trip is verified against a plain-torch reference
(:func:`bench.roundtrip.verify_round_trip`: ``combined_x`` = each token's row once per distinct rank it
reached, ``combined_topk_weights`` = the routing's weights); a system that fails it is left out of every
ratio and verdict (``[summary] ... EXCLUDED``, ``summary.excluded`` and ``"verified": false`` in the JSON).
All systems' outputs are also compared bit for bit against the MPI pipeline (or the first verified
system; layout, ``recv_x`` [and scales], ``recv_topk_idx``, ``recv_topk_weights``, per-expert counts,
``combined_x``, ``combined_topk_weights``); ``calc_diff`` is printed too. A mismatch is reported
(``[check] ... MISMATCH``) and makes the exit code 1; performance targets are reported, never asserted.

Timing: barrier before each timed op, ``time.perf_counter`` around it, the max over ranks per
iteration, median (min, max) over ``--iters`` after ``--warmup``. Round trip = dispatch + combine
per iteration (layout timed apart, as DeepEP does).

Bandwidths (GB = 1e9 B, ``bench.formulas``): **logical** = rank-mean of
``N_recv * (hidden bytes + top-k bytes)`` / time (V2 formula, own tokens included);
**bottleneck** = max over ranks of ``N_recv * hidden bytes`` / time (V1 formula: a token once per
destination rank; FP8 bytes = BF16 x (1 + 4/128) / 2). ``moved`` = bytes per channel kind moved
by each rank's own operations, max over ranks (deepep_ascend: ``Buffer.get_traffic()``, counted
by the rank that issues the load or store — inside a node the receiver, which gathers from the
sender's window; baselines: the bytes each rank sends, from their counts). JSON key:
``sent_by_kind``.

Link model (``transports.link_model``, docs/design/transports.md §5): ``[project]`` lines give, per phase,
the time deepep_ascend's *counted* traffic would take on ``--link-profile``'s links (default
``ascend950``; ``none`` = no projection) with the bottleneck port, and the V1 bottleneck GB/s
at that time next to the measured one — a model, never a measurement. ``--link-emulation delay``
(``--link-scale``, default 1e-3) slows deepep_ascend's UBMEM/URMA transfers to the profile
(SIMULATION: a ``[link]`` line says so and its lines are marked ``[EMULATED links]``; the peers
run unslowed).

Output (rank 0): one ``[config]`` line with the workload fingerprint (equal fingerprint = same
inputs bit for bit), one line per system and phase, ``[check]`` lines, ``[summary]`` ratios
(round-trip speedup over the faster peer pipeline; round trip / roofline) with the targets
(2 ranks: >= 5x and <= 2.5x; 4 and 8 ranks: >= 3x), and ``[memory]``. ``--json FILE`` writes
all of it, including per-iteration times (``bench.schema``): results ``<system>/<phase>`` for the
systems (``deepep_ascend``, ``mpi_alltoallv``, ``gloo_all_to_all``; phases ``layout``,
``dispatch``, ``combine``, ``round_trip``; bytes = the busiest rank's V1 bottleneck bytes, with
``logical_gbps`` and ``by_kind``, the busiest rank's bytes moved per channel kind) and for the
rooflines (``memcpy_roofline``, ``clone_roofline``: V2 logical bytes); the peers and rooflines
are the baselines; ``summary`` holds the ratios, ``details`` the per-rank numbers.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import torch

from bench import cli, schema
from bench.baselines import gloo_all_to_all_roundtrip, mpi_alltoallv_roundtrip, start_gloo
from bench.formulas import bottleneck_bytes, fmt_bytes, gbps, logical_bytes
from bench.hostinfo import MemorySampler, cpu_model, memory_snapshot
from bench.linkmodel import link_model_doc, link_setup, project_phases, projection_lines, use_link_emulator
from bench.native_split import gather_split, record_split, split_lines
from bench.phases import breakdown_lines, gather_breakdown, record_steps
from bench.roofline import memcpy_roofline
from bench.roundtrip import (
    EXPERTS,
    BufferSystem,
    RoundTripResult,
    check_ok,
    compare_outputs,
    destroy_buffer,
    fmt_check,
    fmt_verification,
    normal_buffer_bytes,
    print_system,
    round_trip_phases,
    run_round_trip,
    system_report,
    verification_failure,
    verify_round_trip,
)
from bench.routing import load_routing, save_routing
from bench.timing import progress_bar
from bench.workload import comm_fingerprint, make_workload, num_recv_tokens_of, reference_layout

SYSTEMS = ("deepep_ascend", "mpi", "gloo", "roofline")
SYSTEM_NAMES = {"deepep_ascend": "deepep_ascend", "mpi": "mpi_alltoallv", "gloo": "gloo_all_to_all"}
# the project's targets by rank count (8 ranks also as 2 nodes x 4): the main job's, and the medium call's
# (MEDIUM_CALL: tokens per rank, hidden, top-k, experts), which asks 5x at every rank count
TARGETS = {2: dict(speedup=5.0, roofline=2.5), 4: dict(speedup=3.0), 8: dict(speedup=3.0)}
MEDIUM_CALL = (1024, 2048, 8, 64)
MEDIUM_CALL_TARGETS = {2: dict(speedup=5.0, roofline=2.5), 4: dict(speedup=5.0), 8: dict(speedup=5.0)}


def targets_for(R: int, shape: tuple | None) -> dict:
    """The targets of a run of ``R`` ranks on a workload of ``shape`` ``(tokens per rank, hidden, top-k, experts)``:
    the medium call's (:data:`MEDIUM_CALL_TARGETS`) at :data:`MEDIUM_CALL`, else the main job's (:data:`TARGETS`);
    ``{}`` when none applies."""
    return (MEDIUM_CALL_TARGETS if shape == MEDIUM_CALL else TARGETS).get(R, {})
KINDS = ("SELF", "UBMEM", "URMA")


def add_arguments(p) -> None:
    """The command's options: the shared ones (``bench.cli``) and its own."""
    cli.add_shared(p, num_tokens=None, hidden=7168, num_topk=None, num_experts=None, iters=10, warmup=2, seed=0,
                   json=None, ranks_per_node=None, no_progress=False, phases=False, native_split=False,
                   helps=dict(num_tokens="default 4096, or from --routing", num_topk="default 8, or from --routing",
                              num_experts="default 256, or from --routing", seed="per rank: seed*65536+rank"))
    p.add_argument("--routing", metavar="FILE", help="replay a topk_idx trace (.npz/.pt, see bench/routing.py)")
    p.add_argument("--routing-step", type=int, default=0,
                   help="row S of a [S, T, K] trace (default 0); train_moe traces store step-major rows, "
                        "one per (step, layer)")
    p.add_argument("--save-routing", metavar="FILE", help="write the routing used (.npz/.pt)")
    p.add_argument("--fp8", action="store_true",
                   help="dispatch the FP8 tuple (e4m3 + float32 scales); combine stays BF16")
    p.add_argument("--expert-fn", choices=sorted(EXPERTS), default="identity",
                   help="combine input: identity = the received rows themselves, as DeepEP's tests pass recv_x "
                        "(deepep_ascend reads them in place); copy = a new tensor per call, as real expert "
                        "outputs (staged); made untimed, for every system (default identity)")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"comma list out of {','.join(SYSTEMS)} (default: all)")
    p.add_argument("--baselines-only", action="store_true",
                   help="skip deepep_ascend (same as --systems mpi,gloo,roofline)")
    p.add_argument("--nvl-bytes", type=int, default=None,
                   help="Buffer num_nvl_bytes (default: Buffer.get_normal_buffer_size_hint, no chunking)")
    p.add_argument("--rdma-bytes", type=int, default=None,
                   help="Buffer num_rdma_bytes, internode only (default: Buffer.get_normal_rdma_buffer_size_hint)")
    cli.add_link_args(p)


def check_args(p, a) -> None:
    """Checks and derived values after parsing (``p.error`` on bad values): the link profile and
    emulator, the system list."""
    a.profile, a.emulator = link_setup(p, a)
    if a.fp8 and a.hidden % 128:
        p.error(f"--fp8 needs --hidden a multiple of 128 (one scale per 128 channels), got {a.hidden}")
    for flag, value in (("--nvl-bytes", a.nvl_bytes), ("--rdma-bytes", a.rdma_bytes)):
        if value is not None and (value < 0 or value % 128):
            p.error(f"{flag} must be a non-negative multiple of 128, got {value}")
    if a.routing and not os.access(a.routing, os.R_OK):
        p.error(f"--routing {a.routing}: no such readable file")
    if a.routing_step and not a.routing:
        p.error("--routing-step needs --routing (the trace it picks a step of)")
    a.trace = None  # (topk_idx, topk_weights, meta) of this rank, loaded here: a trace that cannot serve this job
    if a.routing:  # is a usage error, before anything runs
        from mpi4py import MPI

        world = MPI.COMM_WORLD
        try:
            a.trace = load_routing(a.routing, world.Get_rank(), world.Get_size(), a.routing_step, a.num_experts)
        except (ValueError, OSError) as e:
            p.error(f"--routing: {e}")
        meta = a.trace[2]
        for flag, given, traced in (("--num-tokens", a.num_tokens, meta["tokens_per_rank"]),
                                    ("--num-topk", a.num_topk, meta["num_topk"])):
            if given is not None and given != traced:
                p.error(f"{flag} {given} disagrees with the trace ({traced})")
    systems = cli.system_list(p, a.systems, SYSTEMS)
    if a.baselines_only:
        systems = [s for s in systems if s != "deepep_ascend"]
        if not systems:
            p.error("--baselines-only leaves no system of --systems to run")
    a.systems = systems


def choose_buffer_bytes(Buffer, args, num_ranks: int) -> tuple[int, int, str]:
    """``(num_nvl_bytes, num_rdma_bytes, source)``: the options, else the sizes for which the workload never chunks
    (:func:`bench.roundtrip.normal_buffer_bytes`)."""
    nvl, rdma = normal_buffer_bytes(Buffer, args.num_tokens, args.hidden, num_ranks, args.ranks_per_node,
                                    args.num_topk, args.num_experts, args.fp8)
    nvl = args.nvl_bytes if args.nvl_bytes is not None else nvl
    internode = args.ranks_per_node is not None and args.ranks_per_node < num_ranks
    if internode and args.rdma_bytes is not None:
        rdma = args.rdma_bytes
    given = [n for n, v in (("--nvl-bytes", args.nvl_bytes), ("--rdma-bytes", args.rdma_bytes)) if v is not None]
    return nvl, rdma, " and ".join(given) if given else "Buffer size hints (no chunking)"


def two_hop_report(wl, args, comm, traffic) -> dict | None:
    """Collective: URMA bytes of the two-hop dispatch vs the theoretical once-per-node volume and vs direct routing.

    Per rank, from the layout: ``remote_nodes`` = Σ tokens × other nodes they need, ``remote_ranks``
    = Σ tokens × other-node ranks they need (what a direct, one-hop dispatch would send). Wire
    row of hop one (``deepep_ascend.ep.internode``): x + scales + 12·K (ids, weights) + 4 (source
    index) + ranks_per_node (target bitmask); plus per round one 128 B header to each other node
    and, in round 0, the count vector ``4·(R + E + nodes)`` rounded up to 8.
    """
    R, rpn = comm.Get_size(), args.ranks_per_node
    if rpn is None or rpn >= R or traffic is None:
        return None
    G, node = R // rpn, comm.Get_rank() // rpn
    itir = reference_layout(wl.topk_idx, args.num_experts, R)[3]
    n = itir.size(0)
    in_node = itir.view(n, G, rpn).any(2)
    other = torch.ones(G, dtype=torch.bool)
    other[node] = False
    remote_nodes = int(in_node[:, other].sum())
    remote_ranks = int(itir.view(n, G, rpn)[:, other].sum())
    row = (args.hidden * (1 if args.fp8 else 2) + (4 * (args.hidden // 128) if args.fp8 else 0)
           + 12 * args.num_topk + 4 + rpn)
    headers = (G - 1) * (128 + 8 * -(-(4 * (R + args.num_experts + G)) // 8))
    mine = dict(remote_nodes=remote_nodes, remote_ranks=remote_ranks, theoretical=remote_nodes * row + headers,
                payload=remote_nodes * row, measured=int(traffic["dispatch"].get("URMA", 0)))
    all_ranks = comm.allgather(mine)
    tot = {k: sum(d[k] for d in all_ranks) for k in mine}
    return dict(per_rank=all_ranks, totals=tot, row_bytes=row, header_bytes_per_call=headers,
                dedup_ratio=tot["remote_ranks"] / max(1, tot["remote_nodes"]),
                urma_bytes_per_token=tot["measured"] / max(1, R * args.num_tokens),
                theoretical_urma_bytes_per_token=tot["theoretical"] / max(1, R * args.num_tokens))


def build_workload(args, comm):
    rank, R = comm.Get_rank(), comm.Get_size()
    routing = weights = None
    source, label = "random", f"random (seed {args.seed})"
    if args.trace is not None:  # loaded and checked against the options by check_args
        routing, weights, meta = args.trace
        args.num_tokens, args.num_topk = meta["tokens_per_rank"], meta["num_topk"]
        args.num_experts = meta["num_experts"]
        source = f"trace:{meta['digest']}"  # content, not file name, enters the fingerprint
        label = f"trace {os.path.basename(args.routing)} step {meta['step']}/{meta['num_steps']} [{meta['digest']}]"
    args.num_tokens = 4096 if args.num_tokens is None else args.num_tokens
    args.num_topk = 8 if args.num_topk is None else args.num_topk
    args.num_experts = 256 if args.num_experts is None else args.num_experts
    wl = make_workload(args.num_tokens, args.hidden, args.num_topk, args.num_experts, rank, R, seed=args.seed,
                         fp8=args.fp8, routing=routing, routing_weights=weights, routing_source=source)
    return wl, label


def run(args) -> int:
    """Run the benchmark (collective; see the module docstring); the exit code: 1 on a failed check."""
    torch.set_num_threads(1)
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rank, R = comm.Get_rank(), comm.Get_size()
    root = rank == 0
    sampler = MemorySampler().start() if root else None

    Buffer = None
    if "deepep_ascend" in args.systems:
        try:
            from deepep_ascend import Buffer
        except Exception as e:  # noqa: BLE001 — report any import failure the same way
            if root:
                print(f"[bench normal] cannot import deepep_ascend ({type(e).__name__}: {e}); "
                      f"use --baselines-only to run the baselines alone", file=sys.stderr)
            return 2

    wl, routing_label = build_workload(args, comm)
    fp = comm_fingerprint(wl, comm)
    if args.save_routing:
        idx = comm.gather(wl.topk_idx.numpy(), root=0)
        w = comm.gather(wl.topk_weights.numpy(), root=0)
        if root:
            save_routing(args.save_routing, np.concatenate(idx), args.num_experts, np.concatenate(w))

    if root:
        nodes = "" if args.ranks_per_node is None else f" as {R // args.ranks_per_node} nodes x {args.ranks_per_node}"
        print(f"[config]   ranks {R}{nodes} | tokens/rank {args.num_tokens} | hidden {args.hidden} | "
              f"top-k {args.num_topk} | experts {args.num_experts} | "
              f"dispatch {'FP8' if args.fp8 else 'BF16'}, combine BF16 | "
              f"iters {args.iters} ({cli.warmup_text(args)}) | routing {routing_label} | experts {args.expert_fn} | "
              f"fingerprint {fp} | cpu {cpu_model()}", flush=True)

    n_sys = sum(s in args.systems for s in ("deepep_ascend", "mpi", "gloo"))
    bar = progress_bar(root and not args.no_progress, n_sys * (args.iters + args.warmup), "bench normal")
    progress = bar.callback

    results: dict[str, RoundTripResult] = {}
    experts = EXPERTS[args.expert_fn]
    extra: dict = {"expert_fn": args.expert_fn}
    emulator = None
    if "deepep_ascend" in args.systems:
        nvl_bytes, rdma_bytes, why = choose_buffer_bytes(Buffer, args, R)
        extra["num_nvl_bytes"], extra["num_rdma_bytes"], extra["num_nvl_bytes_source"] = nvl_bytes, rdma_bytes, why
        buf = Buffer(group=None, num_nvl_bytes=nvl_bytes, num_rdma_bytes=rdma_bytes, comm=comm,
                     explicitly_destroy=True, ranks_per_node=args.ranks_per_node)
        emulator = use_link_emulator(buf.runtime, args.emulator)
        if root and emulator is not None:
            print(f"[link]     {emulator.label} -- deepep_ascend lines below are EMULATED, the peers are not",
                  flush=True)
        results["deepep_ascend"] = run_round_trip(BufferSystem(buf), wl, comm, args.iters, args.warmup,
                                                    experts=experts, progress=progress)
        if args.phases or args.native_split:  # after the timed loop: the headline numbers are measured without them
            steps, _ = round_trip_phases(BufferSystem(buf), wl, experts, prefix="deepep_ascend.")
            if args.phases:
                extra["phases"] = gather_breakdown(record_steps(steps, comm, args.iters), comm)
            if args.native_split:
                extra["native_split"] = gather_split(record_split(steps, comm, args.iters), comm)
        extra["two_hop"] = two_hop_report(wl, args, comm, results["deepep_ascend"].traffic)
        extra["buffer_memory"] = comm.gather(memory_snapshot(), root=0)
        destroy_buffer(buf, root)  # free its windows before the baselines run: peak memory = max, not sum
        buf = None
    if "mpi" in args.systems:
        results["mpi_alltoallv"] = mpi_alltoallv_roundtrip(wl, comm, args.iters, args.warmup, experts=experts,
                                                             progress=progress)
    group = None
    if "gloo" in args.systems:
        group = start_gloo(comm)
        results["gloo_all_to_all"] = gloo_all_to_all_roundtrip(wl, comm, args.iters, args.warmup, group=group,
                                                                 experts=experts, progress=progress)
    bar.close()

    reports = {name: system_report(res, comm, args.hidden, args.num_topk, args.fp8)
               for name, res in results.items()}
    if emulator is not None:
        reports["deepep_ascend"]["name"] += " [EMULATED links]"
    projection = None
    if "deepep_ascend" in results:
        n_recv = results["deepep_ascend"].num_recv_tokens
        projection = project_phases(results["deepep_ascend"].link_stats, comm, args.profile, {
            ph: bottleneck_bytes(n_recv, args.hidden, args.fp8 and ph == "dispatch") for ph in ("dispatch", "combine")})
    roof = roof_fresh = None
    if "roofline" in args.systems:
        n_recv = n_recv_for(results, wl, args, comm)
        d_bytes = logical_bytes(n_recv, args.hidden, args.num_topk, args.fp8, "dispatch")
        c_bytes = logical_bytes(n_recv, args.hidden, args.num_topk, False, "combine")
        roof = memcpy_roofline(comm, d_bytes, c_bytes, args.iters, args.warmup)
        roof_fresh = memcpy_roofline(comm, d_bytes, c_bytes, args.iters, args.warmup, fresh_dst=True)
        extra["roofline_bytes"] = comm.gather(dict(dispatch=d_bytes, combine=c_bytes), root=0)

    # correctness: every system against the reference of its arithmetic (a system that fails it takes part
    # in no ratio or verdict), then each against the MPI pipeline (or the first verified system) bit for bit
    internode = args.ranks_per_node is not None and args.ranks_per_node < R
    verified = {name: verify_round_trip(res, wl, args.num_experts, comm,
                                        args.ranks_per_node if name == "deepep_ascend" else None)
                for name, res in results.items()}
    failed = {n: why for n, c in verified.items() if (why := verification_failure(c)) is not None}
    good = [n for n in results if n not in failed]
    ref_name = "mpi_alltoallv" if "mpi_alltoallv" in good else next(iter(good), None)
    checks = {}
    for name, res in results.items():
        if ref_name is not None and name != ref_name:
            checks[name] = compare_outputs(results[ref_name], res, comm,
                                             two_roundings=name == "deepep_ascend" and internode)
    ok = not failed and all(check_ok(c) for c in checks.values())

    mem = comm.gather(memory_snapshot(), root=0)
    if group is not None:
        import torch.distributed as dist
        dist.destroy_process_group()

    if root:
        machine = sampler.stop()
        for name, res in results.items():
            print_system(reports[name], res)
        if roof is not None:
            rb = extra["roofline_bytes"]
            print(f"[roofline] {'memcpy':<16}: dispatch {roof['dispatch'].fmt()} "
                  f"({gbps(max(b['dispatch'] for b in rb), roof['dispatch'].median):.2f} GB/s) | "
                  f"combine {roof['combine'].fmt()} "
                  f"({gbps(max(b['combine'] for b in rb), roof['combine'].median):.2f} GB/s)")
            print(f"[roundtrip]{'memcpy roofline':<16}: {roof['round_trip'].fmt()}")
            print(f"[roofline] {'clone (fresh)':<16}: dispatch {roof_fresh['dispatch'].fmt()} | combine "
                  f"{roof_fresh['combine'].fmt()} | round trip {roof_fresh['round_trip'].fmt()} "
                  f"(same bytes into newly allocated tensors: page-fault cost)")
        th = extra.get("two_hop")
        if th is not None:
            t = th["totals"]
            print(f"[two-hop]  URMA dispatch bytes (all ranks): measured {fmt_bytes(t['measured'])} | theoretical "
                  f"once per (token, other node) {fmt_bytes(t['theoretical'])} (rows {fmt_bytes(t['payload'])} "
                  f"+ headers) -> {'equal' if t['measured'] == t['theoretical'] else 'DIFFERENT'} | "
                  f"{th['urma_bytes_per_token']:.1f} B/token | direct routing would send "
                  f"{t['remote_ranks']} rows for {t['remote_nodes']}: dedup {th['dedup_ratio']:.2f}x")
        if projection is not None:
            ph = reports["deepep_ascend"]["phases"]
            for line in projection_lines(projection, {k: (ph[k]["median_s"], ph[k]["bottleneck_gbps"]) for k in ph},
                                           "V1 bottleneck", emulator):
                print(line)
        for name, chk in verified.items():
            print(fmt_verification(name, chk))
        for name, chk in checks.items():
            print(fmt_check(ref_name, name, chk))
        if extra.get("phases"):
            print("\n".join(breakdown_lines(extra["phases"])))
        if args.native_split:
            print("\n".join(split_lines(extra.get("native_split") or {})))
        summary = summarize(results, roof, R, roof_fresh, emulated=emulator is not None, failed=failed,
                            shape=(args.num_tokens, args.hidden, args.num_topk, args.num_experts))
        for line in summary["lines"]:
            print(line)
        peak_rss = [m["peak_rss"] for m in mem]
        print(f"[memory]   peak RSS/rank max {fmt_bytes(max(peak_rss))} (sum {fmt_bytes(sum(peak_rss))}, "
              f"incl. touched shared windows) | /dev/shm peak {fmt_bytes(machine['peak_shm'])} | machine used "
              f"peak {fmt_bytes(machine['peak_used'])} of {fmt_bytes(machine['mem_total'])} "
              f"(at start {fmt_bytes(machine['start_used'])})", flush=True)
        if args.json:
            records, baselines = result_records(results, reports, roof, roof_fresh, extra.get("roofline_bytes"))
            schema.write(args.json, schema.document(
                "normal", argv=args._argv, params=cli.params_of(args, R), results=records, baselines=baselines,
                fingerprint=fp, checks=dict(ok=ok, reference=ref_name, results=checks, verified=verified),
                summary={k: v for k, v in summary.items() if k != "lines"}, failed=failed,
                link_model=link_model_doc(args.profile, emulator), projection=projection,
                details=dict(workload=dict(wl.params, routing_label=routing_label, expert_fn=args.expert_fn),
                             systems=reports, roofline_bytes_per_rank=extra.get("roofline_bytes"),
                             memory=dict(per_rank_end=mem, machine=machine, after_buffer=extra.get("buffer_memory")),
                             buffer=dict(num_nvl_bytes=extra.get("num_nvl_bytes"),
                                         num_rdma_bytes=extra.get("num_rdma_bytes"),
                                         ranks_per_node=args.ranks_per_node, source=extra.get("num_nvl_bytes_source")),
                             two_hop=extra.get("two_hop"), phases=extra.get("phases"),
                             native_split=extra.get("native_split"))))
    return 0 if ok else 1


def result_records(results: dict, reports: dict, roof, roof_fresh, roof_bytes) -> tuple[list, list]:
    """``(results, baselines)`` of the document (``bench.schema``): per system ``layout``, ``dispatch``,
    ``combine`` (the busiest rank's V1 bottleneck bytes, ``logical_gbps``, ``by_kind``: the busiest
    rank's bytes moved per channel kind) and ``round_trip`` (``by_kind``: the busiest rank's dispatch +
    combine bytes per kind; ``ratio_to`` every other round trip), then the rooflines (V2 logical bytes,
    busiest rank). The peers and the rooflines are the baselines."""
    recs = []
    for name, res in results.items():
        phases = reports[name]["phases"]
        recs.append(schema.result(f"{name}/layout", None, timing=res.timings["layout"]))
        for phase in ("dispatch", "combine"):
            ph = phases[phase]
            recs.append(schema.result(
                f"{name}/{phase}", None, timing=res.timings[phase],
                nbytes=ph["bottleneck_bytes_per_rank"][ph["bottleneck_rank"]], formula="V1 bottleneck (busiest rank)",
                by_kind={k: v["max_bytes"] for k, v in ph["sent_by_kind"].items()} or None,
                logical_gbps=ph["logical_gbps"], bottleneck_rank=ph["bottleneck_rank"]))
        sent = [phases[p]["sent_by_kind"] for p in ("dispatch", "combine")]
        rt_kinds = {k: max(a + b for a, b in zip(sent[0][k]["bytes_per_rank"], sent[1][k]["bytes_per_rank"]))
                    for k in KINDS if k in sent[0] and k in sent[1]}
        recs.append(schema.result(f"{name}/round_trip", None, timing=res.timings["round_trip"],
                                  by_kind=rt_kinds or None))
    if roof is not None:
        for system, t in (("memcpy_roofline", roof), ("clone_roofline", roof_fresh)):
            for phase in ("dispatch", "combine", "round_trip"):
                nbytes = max(b["dispatch"] + b["combine"] if phase == "round_trip" else b[phase] for b in roof_bytes)
                recs.append(schema.result(f"{system}/{phase}", None, timing=t[phase], nbytes=nbytes,
                                          formula="V2 logical (busiest rank)"))
    trips = [r["name"] for r in recs if r["phase"] == "round_trip"]
    for name in trips:
        schema.add_ratios(recs, name, trips)
    baselines = [r["name"] for r in recs if r["system"] != "deepep_ascend"]
    return recs, baselines


def n_recv_for(results, wl, args, comm) -> int:
    """This rank's N_recv for the roofline: from any system's result, else from the layout."""
    for res in results.values():
        return res.num_recv_tokens
    return num_recv_tokens_of(wl.topk_idx, args.num_experts, comm)


def summarize(results: dict, roof, R: int, roof_fresh=None, emulated: bool = False, failed: dict | None = None,
              shape: tuple | None = None) -> dict:
    """Ratios on the median round trip (dispatch + combine), with the targets for this R and workload ``shape``
    (:func:`targets_for`).

    ``emulated``: deepep_ascend ran on emulated links; every line says so and no target verdict
    is given (the peers are not slowed, so the ratios measure the emulation). ``failed``: ``{system: why}``
    of the systems that failed their verification: left out of every ratio and verdict, and said so."""
    failed = failed or {}
    every = {n: r.timings["round_trip"].median for n, r in results.items()}
    rt = schema.trusted(every, failed)  # what ratios are taken from
    out = {"round_trip_median_s": dict(every), "lines": []}
    if roof is not None:
        out["round_trip_median_s"]["memcpy_roofline"] = roof["round_trip"].median
    if roof_fresh is not None:
        out["round_trip_median_s"]["clone_roofline_fresh_dst"] = roof_fresh["round_trip"].median
    out["lines"].append("[summary]  round trip (dispatch + combine, median): " + " | ".join(
        f"{n} {v * 1e3:.3f} ms" + (" (EXCLUDED)" if n in failed else "")
        for n, v in out["round_trip_median_s"].items()))
    peers = {n: v for n, v in rt.items() if n != "deepep_ascend"}
    target = {} if emulated else targets_for(R, shape)
    if peers:
        fastest = min(peers, key=peers.get)
        out["faster_peer"] = fastest
        if "deepep_ascend" in rt:
            sp = peers[fastest] / rt["deepep_ascend"]
            out["speedup_over_faster_peer"] = sp
            tgt = target.get("speedup")
            if tgt is not None:
                out["speedup_target"], out["speedup_target_met"] = tgt, bool(sp >= tgt)
            verdict = "" if tgt is None else f" (target >= {tgt:g}x at {R} ranks: {'met' if sp >= tgt else 'MISSED'})"
            out["lines"].append(f"[summary]  deepep_ascend speedup over the faster peer ({fastest}): "
                                f"{sp:.2f}x{verdict}")
        out["lines"].append("[summary]  peers: " + " | ".join(
            f"{n} / faster peer {v / peers[fastest]:.2f}x" for n, v in peers.items()))
    if roof is not None and roof["round_trip"].median > 0:
        rr = {n: v / roof["round_trip"].median for n, v in rt.items()}
        out["round_trip_over_roofline"] = rr
        tgt = target.get("roofline")
        parts = []
        for n, v in rr.items():
            verdict = ""
            if n == "deepep_ascend" and tgt is not None:
                out["roofline_target"], out["roofline_target_met"] = tgt, bool(v <= tgt)
                verdict = f" (target <= {tgt:g}x: {'met' if v <= tgt else 'MISSED'})"
            parts.append(f"{n} {v:.2f}x{verdict}")
        out["lines"].append("[summary]  round trip / memcpy roofline: " + " | ".join(parts))
    if emulated:
        out["lines"] = [ln + " [deepep_ascend on EMULATED links; peers not slowed]" for ln in out["lines"]]
    out["lines"] += schema.excluded_lines(failed)
    return out


def main(argv=None) -> int:
    """``python -m bench normal`` in-process, without the MPI exit path (tests)."""
    from bench import commands

    return commands.call("normal", argv)


if __name__ == "__main__":
    from bench import commands

    commands.alias("normal")
