"""Per-call overhead: round trips of a few tokens per rank against MPI moving the same rows.

Run one process per rank::

    mpiexec -n 2 python -m bench overhead                   # 1 and 8 tokens per rank, hidden 7168, top-8 of 256
    mpiexec -n 4 python -m bench overhead --num-tokens-list 1,8,32 --json out.json

At such sizes a call moves a few hundred KB (the low-latency layout, a row per (token, expert), up to about 2 MB
per rank at 8 tokens), so its time is mostly the fixed cost of the call:
argument checks, control exchanges, signalling, waits and epilogues. For each ``--num-tokens-list`` value T
(tokens per rank), on the same workload (``bench.workload.make_workload``, BF16 both ways,
identity experts):

* ``low_latency``: ``Buffer(low_latency_mode=True)`` with ``num_max_dispatch_tokens_per_rank = T``,
  ``low_latency_dispatch`` + ``low_latency_combine`` (the received rows combined back);
* ``normal``: ``Buffer`` normal mode, ``get_dispatch_layout`` + ``dispatch`` + ``combine``;
* ``ep``: ``EPBuffer.dispatch`` (compact layout, ``do_cpu_sync=True``) + ``combine`` of the received rows
  with the received weights;
* ``ep_decode``: the same with ``do_cpu_sync=False``, a decode step's call (outputs of static shapes,
  sized by ``num_max_tokens_per_rank = T``; the routing still changes every step);
* ``ep_cached``: ``EPBuffer.dispatch(x, handle=..., topk_weights=...)`` through the handle of one
  earlier dispatch (no count exchange; ``do_cpu_sync`` is False there) + ``combine``;
* ``mpi_alltoall``: MPI moving exactly the rows the normal path moves, with the counts already
  known (one ``Alltoallv`` each way on pre-packed rows, no count exchange, no packing): the floor of
  an MPI program with static routing, the figure the per-call target compares against;
* ``mpi_alltoallv``: the full MPI pipeline a user writes (``bench.baselines``: ``Alltoall`` of the
  counts, pack, ``Alltoallv``, unpack, and back), verified like the normal path;
* ``ll_floor`` (beside ``low_latency``): the same Buffer's round trip through the four native calls of its fused
  path alone (``bench.internals.ll_floor_trip``: the call numbers, headers, issue and finish of each call, on
  outputs and a route made once; no argument checks, pooled outputs, handle, stamps or counters), checked bit for
  bit against the public calls' result: the floor of the low-latency calls before their Python;
* ``memcpy_ll`` and ``memcpy_rows``: single-copy memory rooflines (``bench.roofline.memcpy_roofline``, every
  rank at once) of the bytes each layout must move each way: ``memcpy_ll`` the low-latency layout's (DeepEP's
  LL formula, BF16: ``2H + 16`` B per valid selection there, ``2H`` back: a row per (token, expert)),
  ``memcpy_rows`` the normal and ``EPBuffer`` layouts' (``2H`` B per (token, destination rank), the rows
  ``mpi_alltoall`` moves). A one-copy transport cannot beat its layout's roofline, so where that roofline is
  above ``mpi_alltoall`` the per-call target asks for less time than copying the layout's bytes once.

Each time is the max over ranks per iteration, median of ``--iters``. Reported, never asserted:
the issue's target is that the low-latency, normal and ``EPBuffer`` round trips are no slower than
``mpi_alltoall`` at 1 and 8 tokens per rank (``met`` / ``missed`` per line, each with its layout's
roofline over ``mpi_alltoall`` when that roofline is among ``--systems``).
Checks: the low-latency round trip against ``x · Σ w`` (BF16), the normal, ``EPBuffer`` and MPI
pipelines against the plain-torch reference (``bench.roundtrip.verify_round_trip``), ``mpi_alltoall``'s
rows returned bit for bit. A system that fails its check is left out of every ratio and verdict.
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from bench import cli, schema
from bench.baselines import mpi_alltoallv_roundtrip
from bench.formulas import low_latency_bytes
from bench.native_split import gather_split, record_split, split_lines
from bench.roofline import memcpy_roofline
from bench.roundtrip import (
    BufferSystem,
    RoundTripResult,
    normal_buffer_bytes,
    round_trip_phases,
    verification_failure,
    verify_round_trip,
)
from bench.timing import Timing, time_loops, time_phases
from bench.workload import calc_diff, comm_fingerprint, make_workload, reference_layout

SYSTEMS = ("low_latency", "normal", "ep", "ep_decode", "ep_cached", "mpi_alltoall", "mpi_alltoallv", "memcpy_ll",
           "memcpy_rows", "ll_floor")
EP_SYSTEMS = ("ep", "ep_decode", "ep_cached")  # EPBuffer's calls (ep_trip)
LIBRARY = ("low_latency", "normal") + EP_SYSTEMS  # the systems the per-call target is for
TARGET = "mpi_alltoall"  # the per-call target: no slower than MPI moving the same rows with known counts
ROOFLINE_OF = {"low_latency": "memcpy_ll", "normal": "memcpy_rows", "ep": "memcpy_rows", "ep_decode": "memcpy_rows",
               "ep_cached": "memcpy_rows"}  # the bytes each library system's layout moves
BOUNDS = ("memcpy_ll", "memcpy_rows", "ll_floor")  # the floors the target lines set each library system against
LL_BOUND = 1e-5  # BF16 dispatch, identity experts: combined = bf16(x · Σ w) up to the rounding of the sum


def add_arguments(p) -> None:
    """The command's options: the shared ones (``bench.cli``) and its own."""
    cli.add_shared(p, hidden=7168, num_topk=8, num_experts=256, iters=30, warmup=3, seed=0, json=None,
                   native_split=False)
    p.add_argument("--num-tokens-list", type=cli.int_list(1), default=[1, 8], metavar="T[,T...]",
                   help="tokens per rank, one line each (default 1,8)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list out of {','.join(SYSTEMS)} (default: all)")
    p.add_argument("--bindings", action="store_true",
                   help="also time the low_latency and normal round trips (those listed) with the native kernels "
                        "called through ctypes and through their METH_FASTCALL bindings, alternating segment by "
                        "segment ([bindings] lines)")


def check_args(p, a) -> None:
    """The system list and the token counts (``p.error`` on bad values)."""
    a.systems = cli.system_list(p, a.systems, SYSTEMS)
    if "ll_floor" in a.systems and "low_latency" not in a.systems:
        p.error("--systems: ll_floor times the low_latency system's Buffer; list low_latency too")
    if not a.num_tokens_list:
        p.error("--num-tokens-list is empty")


def _split(steps, comm, args, splits: dict | None, label: str) -> None:
    """With ``--native-split``: ``steps`` run again with the native calls timed, into ``splits`` under
    ``label + step`` (:mod:`bench.native_split`; rank 0 keeps the table). Collective."""
    if splits is not None:
        table = gather_split(record_split(steps, comm, args.iters), comm)
        if table is not None:
            splits.update({f"{label}{k}": v for k, v in table.items()})


def low_latency_trip(wl, comm, args, splits: dict | None = None) -> tuple[Timing, float, Timing | None, tuple | None]:
    """``(round-trip timing, calc_diff against x · Σ w, ll_floor's timing, None or ("skip" | "fail", why))`` of a
    low-latency Buffer sized for ``wl`` (``ll_floor`` only when listed in ``--systems``: the same Buffer's fused
    native calls alone, ``bench.internals.ll_floor_trip``, checked bit for bit against the public calls' result);
    ``splits``: :func:`_split`'s table."""
    from mpi4py import MPI

    from bench.internals import ll_floor_trip
    from deepep_ascend import Buffer

    T, E, R = wl.x.size(0), args.num_experts, comm.Get_size()
    buf = Buffer(None, 0, Buffer.get_low_latency_rdma_size_hint(T, args.hidden, R, E), low_latency_mode=True,
                 comm=comm, explicitly_destroy=True)
    st = {}

    def dispatch():
        st["d"] = buf.low_latency_dispatch(wl.x, wl.topk_idx, T, E, use_fp8=False)

    def combine():
        st["c"] = buf.low_latency_combine(st["d"][0], wl.topk_idx, wl.topk_weights, st["d"][2])

    try:
        steps = [("dispatch", dispatch), ("combine", combine)]
        t = time_phases(steps, comm, args.iters, args.warmup)
        diff = calc_diff(st["c"][0].float(), wl.x.float() * wl.topk_weights.sum(1, keepdim=True))
        _split(steps, comm, args, splits, f"low_latency T={T} ")
        floor, why = None, None
        if "ll_floor" in args.systems:
            trip = ll_floor_trip(buf, wl.x, wl.topk_idx, wl.topk_weights, T, E)
            if not comm.allreduce(trip is not None, op=MPI.LAND):  # timed on every rank or on none
                why = ("skip", "the fused low-latency path does not run here (several nodes, a masked rank, "
                               "DEEPEP_ASCEND_LL_FUSED=0 or no native kernels)")
            else:
                same = bool(torch.equal(trip(), st["c"][0]))
                floor = time_phases([("round_trip", trip)], comm, args.iters, args.warmup)["round_trip"]
                why = None if same else ("fail", "its combined_x differs from the public calls'")
    finally:
        buf.destroy()
    return t["dispatch"] + t["combine"], diff, floor, why


def normal_trip(wl, comm, args, splits: dict | None = None):
    """The normal-mode round trip (``bench.roundtrip.RoundTripResult``) of a Buffer that never chunks ``wl``;
    ``splits``: :func:`_split`'s table."""
    from deepep_ascend import Buffer

    nvl, _ = normal_buffer_bytes(Buffer, wl.x.size(0), args.hidden, comm.Get_size(), None, args.num_topk,
                                 args.num_experts, False)
    buf = Buffer(group=None, num_nvl_bytes=nvl, comm=comm, explicitly_destroy=True)
    try:
        steps, finish = round_trip_phases(BufferSystem(buf), wl)
        res = finish(time_phases(steps, comm, args.iters, args.warmup))
        _split(steps, comm, args, splits, f"normal T={wl.x.size(0)} ")
        return res
    finally:
        buf.destroy()


def ep_trip(wl, comm, args, system: str, splits: dict | None = None) -> tuple[Timing, dict]:
    """``(round-trip timing, verify_round_trip's verdict)`` of an ``EPBuffer`` call pair (``system``: one of
    :data:`EP_SYSTEMS`, module doc) sized by ``num_max_tokens_per_rank = T``; the combine returns the received
    rows (identity experts) with the received weights. ``splits``: :func:`_split`'s table."""
    from deepep_ascend import EPBuffer

    T, E = wl.x.size(0), args.num_experts
    buf = EPBuffer(comm, num_max_tokens_per_rank=T, hidden=args.hidden, num_topk=args.num_topk,
                   explicitly_destroy=True)
    kw = dict(topk_weights=wl.topk_weights, num_experts=E)
    st = {}
    if system == "ep_cached":  # the handle the timed dispatches go through
        st["handle"] = buf.dispatch(wl.x, topk_idx=wl.topk_idx, **kw)[3]

    def dispatch():
        if system == "ep_cached":
            st["d"] = buf.dispatch(wl.x, handle=st["handle"], **kw)
        else:
            st["d"] = buf.dispatch(wl.x, topk_idx=wl.topk_idx, do_cpu_sync=system == "ep", **kw)

    def combine():
        recv_x, _, recv_w, handle, _ = st["d"]
        st["c"] = buf.combine(recv_x, handle, topk_weights=recv_w)

    try:
        steps = [("dispatch", dispatch), ("combine", combine)]
        t = time_phases(steps, comm, args.iters, args.warmup)
        res = RoundTripResult(system, {}, 0, {}, st["c"][0], st["c"][1], {}, "")
        verdict = verify_round_trip(res, wl, E, comm)
        _split(steps, comm, args, splits, f"{system} T={T} ")
    finally:
        buf.destroy()
    return t["dispatch"] + t["combine"], verdict


def bindings_trips(wl, comm, args) -> dict[str, dict[str, Timing]] | str:
    """``--bindings``: per library system (``low_latency``, ``normal``, those in ``--systems``), the round trip's
    :class:`Timing` per way of calling the native kernels, ``{"fastcall": ..., "ctypes": ..., "calls": (native
    calls, arguments passed to them) of one round trip on this rank}``
    (``deepep_ascend.native.loader.bindings``), from :func:`bench.timing.time_loops` alternating the two segment by
    segment (5 round trips a segment, ``--iters`` segments each); or why not (the bindings are not loaded on every
    rank). The kernel table is switched once per segment and restored after. Collective."""
    from mpi4py import MPI

    from deepep_ascend import Buffer
    from deepep_ascend.native import loader

    if not comm.allreduce(loader.bindings() == "fastcall", op=MPI.LAND):
        return "the METH_FASTCALL bindings are not loaded on every rank (not built, or no native kernels)"
    tables = {"fastcall": {n: getattr(loader.kernels, n) for n in loader.SIGNATURES},
              "ctypes": {n: getattr(loader.ctypes_kernels(), n) for n in loader.SIGNATURES}}
    current = {"table": tables["fastcall"]}
    T, E, R, H = wl.x.size(0), args.num_experts, comm.Get_size(), args.hidden
    ll = Buffer(None, 0, Buffer.get_low_latency_rdma_size_hint(T, H, R, E), low_latency_mode=True, comm=comm,
                explicitly_destroy=True)
    nvl, _ = normal_buffer_bytes(Buffer, T, H, R, None, args.num_topk, E, False)
    normal = Buffer(None, nvl, comm=comm, explicitly_destroy=True)

    def ll_trip():
        recv_x, _, handle, _, _ = ll.low_latency_dispatch(wl.x, wl.topk_idx, T, E, use_fp8=False)
        ll.low_latency_combine(recv_x, wl.topk_idx, wl.topk_weights, handle)

    def normal_trip():
        ntpr, _, ntpe, itr, _ = normal.get_dispatch_layout(wl.topk_idx, E)
        recv_x, _, recv_w, _, handle, _ = normal.dispatch(wl.x, num_tokens_per_rank=ntpr, is_token_in_rank=itr,
                                                          num_tokens_per_expert=ntpe, topk_idx=wl.topk_idx,
                                                          topk_weights=wl.topk_weights)
        normal.combine(recv_x, handle, topk_weights=recv_w)

    def through(table: dict, trip) -> None:
        if current["table"] is not table:
            for name, fn in table.items():
                setattr(loader.kernels, name, fn)
            current["table"] = table
        trip()

    def counted(trip) -> tuple[int, int]:
        """(native calls, arguments passed to them) of one more round trip, through counting wrappers."""
        seen = [0, 0]

        def wrap(fn):
            def call(*a):
                seen[0], seen[1] = seen[0] + 1, seen[1] + len(a)
                return fn(*a)
            return call

        through({name: wrap(fn) for name, fn in tables["fastcall"].items()}, trip)
        return seen[0], seen[1]

    out = {}
    try:
        for name, trip in (("low_latency", ll_trip), ("normal", normal_trip)):
            if name in args.systems:
                loops = {how: functools.partial(through, table, trip) for how, table in tables.items()}
                out[name] = time_loops(loops, comm, args.iters, 5, args.warmup)
                out[name]["calls"] = counted(trip)
    finally:
        through(tables["fastcall"], lambda: None)
        ll.destroy()
        normal.destroy()
    return out


def mpi_alltoall_trip(wl, comm, args) -> tuple[Timing, bool]:
    """``(round-trip timing, rows back bit for bit)`` of MPI moving the normal path's rows with known counts.

    Each token goes once to every rank holding one of its experts (``is_token_in_rank``), rows packed by
    destination rank before the timed loop; one ``Alltoallv`` there, one back, BF16 rows as bytes.
    """
    from mpi4py import MPI

    R = comm.Get_size()
    in_rank = reference_layout(wl.topk_idx, args.num_experts, R)[3]  # [T, R] bool
    dst, token = in_rank.t().nonzero(as_tuple=True)
    send = wl.x[token].contiguous()  # rows grouped by destination rank (nonzero's row-major order)
    row = args.hidden * wl.x.element_size()
    send_counts = np.bincount(dst.numpy(), minlength=R).astype(np.int64) * row
    recv_counts = np.empty_like(send_counts)
    comm.Alltoall(send_counts, recv_counts)
    send_displs = np.concatenate(([0], np.cumsum(send_counts)[:-1]))
    recv_displs = np.concatenate(([0], np.cumsum(recv_counts)[:-1]))
    recv = torch.empty(int(recv_counts.sum()) // row, args.hidden, dtype=wl.x.dtype)
    back = torch.empty_like(send)
    s8, r8, b8 = (t.view(torch.uint8).numpy().reshape(-1) for t in (send, recv, back))

    def there():
        comm.Alltoallv([s8, (send_counts, send_displs), MPI.BYTE], [r8, (recv_counts, recv_displs), MPI.BYTE])

    def home():
        comm.Alltoallv([r8, (recv_counts, recv_displs), MPI.BYTE], [b8, (send_counts, send_displs), MPI.BYTE])

    t = time_phases([("dispatch", there), ("combine", home)], comm, args.iters, args.warmup)
    return t["dispatch"] + t["combine"], bool(torch.equal(back, send))


def layout_bytes(topk_idx: torch.Tensor, hidden: int, num_experts: int, num_ranks: int) -> dict:
    """This rank's bytes each way of the two layouts (BF16 rows): ``{"memcpy_ll": (dispatch, combine),
    "memcpy_rows": (dispatch, combine)}``, the low-latency one by DeepEP's LL formula
    (:func:`bench.formulas.low_latency_bytes` of the valid selections), the other ``2H`` per (token, rank
    holding one of its experts) each way (``reference_layout``'s ``is_token_in_rank``)."""
    sel = int((topk_idx >= 0).sum())
    pairs = int(reference_layout(topk_idx, num_experts, num_ranks)[3].sum())
    return {"memcpy_ll": tuple(low_latency_bytes(sel, hidden, False, ph) for ph in ("dispatch", "combine")),
            "memcpy_rows": (2 * hidden * pairs, 2 * hidden * pairs)}


def run(args) -> int:
    """Run the benchmark (collective; see the module docstring); the exit code: 1 on a failed check."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, R = comm.Get_rank(), comm.Get_size()
    torch.set_num_threads(1)
    H, K, E = args.hidden, args.num_topk, args.num_experts
    results, failed, lines, rows, skipped, binding_lines = [], {}, [], [], {}, []
    summary = {}
    splits = {} if args.native_split else None
    for T in args.num_tokens_list:
        wl = make_workload(T, H, K, E, rank, R, seed=args.seed, fp8=False)
        trips: dict[str, Timing] = {}
        bad: dict[str, str] = {}
        if "low_latency" in args.systems:
            trips["low_latency"], diff, floor, why = low_latency_trip(wl, comm, args, splits)
            diff = comm.allreduce(diff, op=MPI.MAX)
            if not diff < LL_BOUND:
                bad["low_latency"] = f"combined vs x*sum(w): calc_diff {diff:.2e} is not below {LL_BOUND:g}"
            if floor is not None:
                trips["ll_floor"] = floor
            if why is not None and why[0] == "skip":  # (decided on every rank alike)
                skipped["ll_floor"] = why[1]
            elif "ll_floor" in args.systems and not comm.allreduce(why is None, op=MPI.LAND):
                bad["ll_floor"] = why[1] if why is not None else "wrong on another rank"
        for name, fn in (("normal", normal_trip), ("mpi_alltoallv", mpi_alltoallv_roundtrip)):
            if name in args.systems:
                res = fn(wl, comm, args, splits) if name == "normal" else fn(wl, comm, args.iters, args.warmup)
                trips[name] = res.timings["dispatch"] + res.timings["combine"]
                if (why := verification_failure(verify_round_trip(res, wl, E, comm))) is not None:
                    bad[name] = why
        for name in EP_SYSTEMS:
            if name in args.systems:
                trips[name], verdict = ep_trip(wl, comm, args, name, splits)
                if (why := verification_failure(verdict)) is not None:
                    bad[name] = why
        if args.bindings:
            ab = bindings_trips(wl, comm, args)
            if isinstance(ab, str):
                skipped["bindings"] = ab
            for s, by in ({} if isinstance(ab, str) else ab).items():
                fast, slow = by["fastcall"].median, by["ctypes"].median
                summary[f"{s}_bindings_saving_t{T}"] = slow - fast
                calls, nargs = by["calls"]
                summary[f"{s}_native_calls_t{T}"], summary[f"{s}_native_args_t{T}"] = calls, nargs
                binding_lines.append(f"[bindings] T={T:<4d} {s:<12s} through the METH_FASTCALL bindings "
                                     f"{fast * 1e3:.3f} ms, through ctypes {slow * 1e3:.3f} ms: "
                                     f"{(slow - fast) * 1e6:.1f} us ({(slow - fast) / slow * 100:.1f}%) less a round "
                                     f"trip (median of {args.iters} segments of 5, alternating); {calls} native calls "
                                     f"of {nargs} arguments in all a round trip on rank 0")
        if "mpi_alltoall" in args.systems:
            trips["mpi_alltoall"], same = mpi_alltoall_trip(wl, comm, args)
            if not comm.allreduce(same, op=MPI.LAND):
                bad["mpi_alltoall"] = "the rows sent back differ from the rows sent"
        nbytes = {}
        for name, (d_bytes, c_bytes) in layout_bytes(wl.topk_idx, H, E, R).items():
            if name in args.systems:
                trips[name] = memcpy_roofline(comm, d_bytes, c_bytes, args.iters, args.warmup)["round_trip"]
                nbytes[name] = max(comm.allgather(d_bytes + c_bytes))  # the busiest rank's, as the times
        names = [f"{s}/round_trip_t{T}" for s in trips]
        recs = [schema.result(n, None, timing=trips[n.partition("/")[0]], tokens_per_rank=T,
                              nbytes=nbytes.get(n.partition("/")[0]),
                              formula="bytes copied, both ways, busiest rank" if n.partition("/")[0] in nbytes
                              else None) for n in names]
        for n in names:
            schema.add_ratios(recs, n, names)
        results += recs
        failed.update({f"{s}": why for s, why in bad.items()})
        floor = trips.get(TARGET) if TARGET not in bad else None
        row = [T] + [trips[s].median * 1e3 if s in trips else None for s in SYSTEMS]
        over = {s: trips[s].median / floor.median for s in trips if s not in bad} if floor is not None else {}
        summary.update({f"{s}_over_{TARGET}_t{T}": r for s, r in over.items() if s in LIBRARY + BOUNDS})
        for s in LIBRARY:
            if s in over:
                ratio, roof = over[s], ROOFLINE_OF[s]
                bound = "" if roof not in over else (f"; one copy of its layout's bytes ({roof}) {over[roof]:.2f}x"
                                                     + (": the target is less time than that copy"
                                                        if over[roof] > 1 else ""))
                if s == "low_latency" and "ll_floor" in over:
                    bound += f"; its native calls alone (ll_floor) {over['ll_floor']:.2f}x"
                lines.append(f"[target] T={T:<4d} {s:<12s} {ratio:5.2f}x {TARGET} "
                             f"({'met' if ratio <= 1.0 else 'missed'}: target <= 1x){bound}")
        rows.append(row)
    ok = not failed
    fingerprint = comm_fingerprint(wl, comm)  # collective
    if rank == 0:
        print(f"[overhead] {R} ranks, hidden {H}, top-{K} of {E} experts, BF16 both ways, identity experts; "
              f"round trip per call, max over ranks, median of {args.iters} ({cli.warmup_text(args)}) ms; "
              f"fingerprint of the T={args.num_tokens_list[-1]} workload {fingerprint}")
        print(f"{'tokens':>8s} " + " ".join(f"{s:>14s}" for s in SYSTEMS))
        for row in rows:
            print(f"{row[0]:>8d} " + " ".join(f"{'-' if v is None else f'{v:.3f}':>14s}" for v in row[1:]))
        for line in lines + binding_lines:
            print(line)
        for line in schema.excluded_lines(failed):
            print(line)
        for name, why in skipped.items():
            print(f"[skip]     {name}: not run: {why}")
        if splits is not None:
            print("\n".join(split_lines(splits)))
        if args.json:
            schema.write(args.json, schema.document(
                "overhead", argv=args._argv, params=cli.params_of(args, R), results=results,
                baselines=[r["name"] for r in results if r["system"].startswith("mpi")],
                checks=dict(ok=ok), summary=summary, failed=failed, fingerprint=fingerprint,
                details=dict(tokens=list(args.num_tokens_list), target=f"<= 1x {TARGET} at each token count",
                             skipped=skipped,
                             native_split=splits or None)))
    return 0 if ok else 1


def main(argv=None) -> int:
    """``python -m bench overhead`` in-process, without the MPI exit path (tests)."""
    from bench import commands

    return commands.call("overhead", argv)


if __name__ == "__main__":
    from bench import commands

    commands.alias("overhead")
