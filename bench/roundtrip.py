"""The normal-mode round trip (dispatch → experts → combine), run the same way for every system.

:func:`run_round_trip` times layout, dispatch and combine of any system with DeepEP V1's call
shape: :class:`BufferSystem` (a DeepEP-V1-like ``Buffer``) or a peer pipeline of
:mod:`bench.baselines`. :func:`compare_outputs` checks two systems' results agree bit for bit
(:func:`check_ok`, :func:`fmt_check`: its verdict and line). The "experts" between dispatch and
combine are :data:`EXPERTS` (identity, or a copy). What the commands that run V1 round trips share:
:func:`system_report` / :func:`print_system` (bytes and GB/s per phase), :func:`normal_buffer_bytes`
(a Buffer that never chunks), :func:`destroy_buffer`.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from collections.abc import Callable

import numpy as np
import torch

from bench.formulas import bottleneck_bytes, fmt_bytes, gbps, logical_bytes
from bench.timing import time_phases
from bench.workload import Workload, calc_diff, per_token_cast_back, tensor_digest


def split_x(x):
    """dispatch input or output → (payload [N, H] tensor, fp8 scales or None)."""
    if isinstance(x, tuple):
        return x[0], x[1]
    return x, None


class BufferSystem:
    """A DeepEP-V1-like ``Buffer`` (normal mode) as a round-trip system.

    Calls exactly the public API: ``get_dispatch_layout``, ``dispatch`` (non-cached, with top-k),
    ``combine`` (with the received weights); ``traffic()`` is ``buf.get_traffic(lifetime=False)``
    when the buffer has it (bytes sent by this rank during the last call, by channel kind).
    """

    def __init__(self, buf, name: str = "deepep_ascend"):
        self.buf, self.name = buf, name

    def layout(self, topk_idx, num_experts):
        return self.buf.get_dispatch_layout(topk_idx, num_experts)[:4]

    def dispatch(self, x, layout, topk_idx, topk_weights):
        ntpr, ntprr, ntpe, itir = layout
        kw = {} if ntprr is None else {"num_tokens_per_rdma_rank": ntprr}
        out = self.buf.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=itir,
                                num_tokens_per_expert=ntpe, topk_idx=topk_idx,
                                topk_weights=topk_weights, **kw)
        return out[:5]

    def combine(self, y, handle, topk_weights):
        combined_x, combined_w, _ = self.buf.combine(y, handle, topk_weights=topk_weights)
        return combined_x, combined_w

    def traffic(self) -> dict | None:
        get = getattr(self.buf, "get_traffic", None)
        return dict(get(lifetime=False)) if get is not None else None

    def link_stats(self) -> dict | None:
        """``Buffer.get_link_stats()`` (per peer and channel kind, bytes and messages of the last
        call), or ``None`` for a Buffer without link counters."""
        get = getattr(self.buf, "get_link_stats", None)
        return get() if get is not None else None


def identity_experts(recv_x):
    """The "experts" of the benchmark: identity, as a BF16 combine input ``[N_recv, H]``
    (an FP8 tuple is cast back with :func:`per_token_cast_back`)."""
    if isinstance(recv_x, tuple):
        return per_token_cast_back(*recv_x)
    return recv_x


def copy_experts(recv_x):
    """Experts whose output is a new tensor (a copy of the received rows, as BF16): what a real expert
    hands to combine, which then stages it (:func:`identity_experts` hands ``recv_x`` itself back,
    which a Buffer's combine reads in place where it lies in the landing segment)."""
    return identity_experts(recv_x).clone()


EXPERTS = {"identity": identity_experts, "copy": copy_experts}


@dataclasses.dataclass
class RoundTripResult:
    """One system's timings and the last iteration's outputs on this rank."""

    name: str
    timings: dict  # 'layout', 'dispatch', 'combine', 'round_trip' → Timing (max over ranks)
    num_recv_tokens: int
    dispatch_digests: dict  # component → tensor_digest
    combined_x: torch.Tensor
    combined_topk_weights: torch.Tensor | None
    traffic: dict  # 'dispatch' / 'combine' → {kind: bytes sent by this rank} or None
    layout_digest: str
    link_stats: dict | None = None  # 'dispatch' / 'combine' → Buffer.get_link_stats() of the last call


def dispatch_digests(out) -> dict:
    """Digests of a dispatch's user-visible results (``recv_x`` [+ scales], top-k, counts list)."""
    recv_x, ridx, rw, counts = out[:4]
    data, scales = split_x(recv_x)
    return {"recv_x": tensor_digest(data), "recv_scales": tensor_digest(scales),
            "recv_topk_idx": tensor_digest(ridx), "recv_topk_weights": tensor_digest(rw),
            "num_recv_tokens_per_expert_list": hashlib.blake2b(
                json.dumps([int(c) for c in counts]).encode(), digest_size=16).hexdigest()}


def layout_digest(layout) -> str:
    """Digest of ``(num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank)``; the per-node
    count (``layout[1]``, internode only) is left out so that one-node pipelines compare."""
    h = hashlib.blake2b(digest_size=16)
    for t in (layout[0], layout[2], layout[3]):
        tensor_digest(t if t is None else t.to(torch.int64 if t.dtype != torch.bool else torch.bool), h)
    return h.hexdigest()


def round_trip_phases(system, wl: Workload, experts: Callable = identity_experts, prefix: str = ""):
    """The phases of one round trip of ``system`` on ``wl``, for :func:`bench.timing.time_phases`, and
    what turns their timings into a :class:`RoundTripResult`.

    Per iteration: drop the previous outputs (untimed), ``layout`` (timed), ``dispatch`` (timed),
    read traffic and run ``experts`` on the received rows (untimed), ``combine`` with the received
    weights (timed), read traffic (untimed). The timed phases are named ``prefix + 'layout'`` etc., so
    that several systems' phases can run interleaved in one loop.

    Returns ``(phases, finish)``; ``finish(timings)`` takes ``time_phases``' result and returns the
    :class:`RoundTripResult` (``round_trip`` = dispatch + combine per iteration, layout excluded, as
    DeepEP times it apart; outputs of the last iteration).
    """
    st: dict = {}
    x, ne = wl.dispatch_x, wl.params["num_experts"]

    def reset():
        st.clear()

    def layout():
        st["layout"] = system.layout(wl.topk_idx, ne)

    def dispatch():
        st["d"] = system.dispatch(x, st["layout"], wl.topk_idx, wl.topk_weights)

    link_stats = getattr(system, "link_stats", lambda: None)

    def after_dispatch():
        st["t_d"], st["s_d"] = system.traffic(), link_stats()
        st["y"] = experts(st["d"][0])

    def combine():
        st["c"] = system.combine(st["y"], st["d"][4], st["d"][2])

    def after_combine():
        st["t_c"], st["s_c"] = system.traffic(), link_stats()

    phases = [(None, reset), (prefix + "layout", layout), (prefix + "dispatch", dispatch), (None, after_dispatch),
              (prefix + "combine", combine), (None, after_combine)]

    def finish(timings: dict) -> RoundTripResult:
        t = {k: timings[prefix + k] for k in ("layout", "dispatch", "combine")}
        t["round_trip"] = t["dispatch"] + t["combine"]
        d = st["d"]
        res = RoundTripResult(
            name=system.name, timings=t, num_recv_tokens=split_x(d[0])[0].size(0),
            dispatch_digests=dispatch_digests(d), combined_x=st["c"][0].clone(),  # may alias a buffer
            combined_topk_weights=None if st["c"][1] is None else st["c"][1].clone(),
            traffic={"dispatch": st["t_d"], "combine": st["t_c"]},
            layout_digest=layout_digest(st["layout"]),
            link_stats=None if st["s_d"] is None else {"dispatch": st["s_d"], "combine": st["s_c"]})
        st.clear()
        return res

    return phases, finish


def run_round_trip(system, wl: Workload, comm, iters: int, warmup: int,
                   experts: Callable = identity_experts,
                   progress: Callable[[int], None] | None = None) -> RoundTripResult:
    """Time layout, dispatch and combine of ``system`` on ``wl`` (collective): :func:`round_trip_phases`
    run by :func:`bench.timing.time_phases` (``warmup`` untimed iterations, then ``iters`` timed ones)."""
    phases, finish = round_trip_phases(system, wl, experts)
    return finish(time_phases(phases, comm, iters, warmup, progress))


def compare_outputs(ref: RoundTripResult, other: RoundTripResult, comm, two_roundings: bool = False) -> dict:
    """Check ``other`` against ``ref`` on every rank (collective; same answer on all ranks).

    Returns ``{layout, dispatch: {component: bool}, combined_x_bitwise, combined_x_equal_values,
    combined_topk_weights_bitwise, combined_x_calc_diff, combined_topk_weights_calc_diff}``;
    booleans are ANDed over ranks, ``calc_diff`` values are the maximum over ranks (0 = equal).
    ``two_roundings``: ``other`` is DeepEP's internode combine, which rounds each node's partial
    sum to BF16 before the final sum (docs/semantics/deepep-api.md §5) while ``ref`` rounds once, so ``combined_x`` may
    differ in the last bits by design: it is then accepted when ``calc_diff < 1e-4``
    (``combined_x_two_roundings``) — the test suite checks that path bit for bit against a
    two-rounding reference.
    """
    from mpi4py import MPI

    flags = {"layout": ref.layout_digest == other.layout_digest}
    for k, v in ref.dispatch_digests.items():
        flags["dispatch." + k] = v == other.dispatch_digests.get(k)
    a, b = ref.combined_x, other.combined_x
    same_shape = a.shape == b.shape and a.dtype == b.dtype
    flags["combined_x_bitwise"] = same_shape and torch.equal(a.view(torch.int16), b.view(torch.int16))
    flags["combined_x_equal_values"] = same_shape and torch.equal(a, b)
    wa, wb = ref.combined_topk_weights, other.combined_topk_weights
    w_same = wa is not None and wb is not None and wa.shape == wb.shape
    flags["combined_topk_weights_bitwise"] = w_same and torch.equal(wa.view(torch.int32), wb.view(torch.int32))
    diffs = {"combined_x_calc_diff": calc_diff(a.float(), b.float()) if same_shape else float("inf"),
             "combined_topk_weights_calc_diff": calc_diff(wa, wb) if w_same else float("inf")}
    names = sorted(flags)
    ok = np.array([1 if flags[n] else 0 for n in names], dtype=np.int32)
    ok_all = np.empty_like(ok)
    comm.Allreduce(ok, ok_all, op=MPI.MIN)
    dv = np.array([diffs[n] for n in sorted(diffs)], dtype=np.float64)
    dv_all = np.empty_like(dv)
    comm.Allreduce(dv, dv_all, op=MPI.MAX)
    out = {n: bool(v) for n, v in zip(names, ok_all)}
    out.update({n: float(v) for n, v in zip(sorted(diffs), dv_all)})
    if two_roundings:
        out["combined_x_two_roundings"] = out["combined_x_calc_diff"] < 1e-4
        out["combined_x_bitwise"] = out["combined_x_equal_values"] = None  # not expected: reported apart
    return out


def reference_combined(x_in: torch.Tensor, topk_idx: torch.Tensor, num_experts: int, num_ranks: int,
                       ranks_per_node: int, expand: bool, multiple_reduction: bool = True) -> torch.Tensor:
    """What combine of the unmodified received rows returns, in plain torch: ``[N, hidden]`` BF16.

    ``x_in [N, hidden]`` BF16 is each token's row as the experts saw it. Per token and rank that holds
    ``m >= 1`` of its slots, the rank's row is ``x`` (compact) or ``bf16(m·x)`` (expanded: the rank's slots
    summed, one rounding); the rows of a node are summed in float32 and, across nodes, rounded to BF16 per
    node; the node partials summed in float32; one rounding to BF16. Every float32 sum here is exact (a few
    values within a few binades, 8-bit significands), so the order of the additions does not matter and the
    library must give these values exactly. ``multiple_reduction=False`` (``EPBuffer``'s
    ``allow_multiple_reduction=False``): every row the origin gets (one per slot, expanded) summed in float32
    with one rounding, on one node or many. Loops over ranks, not tokens."""
    n, h = x_in.shape
    per_rank = num_experts // num_ranks
    dst = torch.where(topk_idx >= 0, torch.div(topk_idx, per_rank, rounding_mode="floor"), num_ranks)
    slots = torch.zeros(n, num_ranks + 1, dtype=torch.float32)
    slots.scatter_add_(1, dst, torch.ones(dst.shape, dtype=torch.float32))
    coef = slots[:, :num_ranks] if expand else (slots[:, :num_ranks] > 0).to(torch.float32)
    xf = x_in.float()
    if not multiple_reduction:
        return (xf * coef.sum(1, keepdim=True)).to(torch.bfloat16)
    nodes = num_ranks // ranks_per_node
    total = torch.zeros(n, h, dtype=torch.float32)
    for g in range(nodes):
        acc = torch.zeros(n, h, dtype=torch.float32)
        for r in range(g * ranks_per_node, (g + 1) * ranks_per_node):
            row = xf * coef[:, r:r + 1]
            acc += row.to(torch.bfloat16).float() if expand else row
        total += acc.to(torch.bfloat16).float() if nodes > 1 else acc
    return total.to(torch.bfloat16)


def verify_round_trip(res: RoundTripResult, wl: Workload, num_experts: int, comm,
                      ranks_per_node: int | None = None) -> dict:
    """Check one system's round trip against :func:`reference_combined` (collective, same answer on every
    rank): ``{combined_x_equal, combined_x_calc_diff, combined_topk_weights_equal}`` (ANDed, max over ranks).

    ``combined_x`` of the identity experts must equal the reference with the system's rounding (``ranks_per_node``
    below the ranks: each node's partial rounded to BF16 first, as DeepEP's internode combine does; else one
    rounding), and ``combined_topk_weights`` the routing's weights (0 for -1 slots). A system that fails
    this (a pipeline returning zeros, say) is left out of every ratio (:func:`bench.schema.exclude_unverified`).
    """
    from mpi4py import MPI

    R = comm.Get_size()
    ref = reference_combined(identity_experts(wl.dispatch_x), wl.topk_idx, num_experts, R, ranks_per_node or R,
                             expand=False)
    got, w = res.combined_x, res.combined_topk_weights
    want_w = wl.topk_weights.masked_fill(wl.topk_idx < 0, 0.0)
    same_shape = got.shape == ref.shape and got.dtype == ref.dtype
    flags = np.array([same_shape and torch.equal(got, ref),
                      w is not None and w.shape == want_w.shape and torch.equal(w, want_w)], dtype=np.int32)
    diff = np.array([calc_diff(got.float(), ref.float()) if same_shape else float("inf")])
    comm.Allreduce(MPI.IN_PLACE, flags, op=MPI.MIN)
    comm.Allreduce(MPI.IN_PLACE, diff, op=MPI.MAX)
    return {"combined_x_equal": bool(flags[0]), "combined_x_calc_diff": float(diff[0]),
            "combined_topk_weights_equal": bool(flags[1])}


def verification_failure(chk: dict) -> str | None:
    """Why a :func:`verify_round_trip` verdict fails (None: it passes), as the summaries print it."""
    bad = []
    if not chk["combined_x_equal"]:
        bad.append(f"combined_x differs from the reference (calc_diff {chk['combined_x_calc_diff']:.3g})")
    if not chk["combined_topk_weights_equal"]:
        bad.append("combined_topk_weights differ from the routing's weights")
    return "; ".join(bad) or None


def fmt_verification(name: str, chk: dict) -> str:
    """The ``[check]`` line of :func:`verify_round_trip` for system ``name``."""
    why = verification_failure(chk)
    return f"[check]    {name} vs reference (x once per distinct rank): " + ("ok" if why is None else
                                                                               f"MISMATCH: {why}")


def system_report(res: RoundTripResult, comm, hidden: int, num_topk: int, fp8: bool) -> dict:
    """Collective: byte counts of every rank → bandwidths for one system (same dict on all ranks).

    Per phase: ``logical_bytes_per_rank`` (V2 formula) and ``bottleneck_bytes_per_rank`` (V1 formula) of
    ``bench.formulas``, their GB/s at the phase's median time (logical: the rank mean; bottleneck: the
    busiest rank), and ``sent_by_kind``: the bytes each rank's own operations moved per channel kind in
    the last call (``{kind: {bytes_per_rank, max_bytes, max_gbps}}``, empty when a system has no counters).
    """
    H, K = hidden, num_topk
    n_recv = comm.allgather(res.num_recv_tokens)
    traffic = comm.allgather(res.traffic)
    out = {"name": res.name, "num_recv_tokens_per_rank": n_recv,
           "timings": {k: v.as_dict() for k, v in res.timings.items()}, "phases": {}}
    for phase in ("dispatch", "combine"):
        t = res.timings[phase].median
        logical = [logical_bytes(n, H, K, fp8, phase) for n in n_recv]
        bottle = [bottleneck_bytes(n, H, fp8 and phase == "dispatch") for n in n_recv]
        kinds = {}
        per_rank = [tr[phase] for tr in traffic]
        if all(x is not None for x in per_rank):
            for kind in sorted({k for x in per_rank for k in x}):
                vals = [int(x.get(kind, 0)) for x in per_rank]
                kinds[kind] = dict(bytes_per_rank=vals, max_bytes=max(vals),
                                   max_gbps=gbps(max(vals), t))
        brank = int(np.argmax(bottle))
        out["phases"][phase] = dict(
            median_s=t, logical_bytes_per_rank=logical, bottleneck_bytes_per_rank=bottle,
            logical_gbps=gbps(sum(logical) / len(logical), t),
            bottleneck_gbps=gbps(bottle[brank], t), bottleneck_rank=brank, sent_by_kind=kinds)
    return out


def fmt_kinds(kinds: dict) -> str:
    """``sent_by_kind`` of :func:`system_report` as one line (the busiest rank's bytes per kind, GB/s)."""
    if not kinds:
        return "moved: n/a"
    return "moved/rank max: " + ", ".join(
        f"{k} {fmt_bytes(v['max_bytes'])}" + (f" ({v['max_gbps']:.2f} GB/s)" if v["max_bytes"] else "")
        for k, v in kinds.items())


def print_system(rep: dict, res: RoundTripResult, round_trip=None, note: str = "") -> None:
    """Print one system's ``[layout]``, ``[dispatch]``, ``[combine]`` and ``[roundtrip]`` lines from
    :func:`system_report` (rank 0). The round trip is dispatch + combine unless ``round_trip`` (a
    :class:`bench.timing.Timing`) is given, printed with ``note`` after it."""
    name = rep["name"]
    print(f"[layout]   {name:<16}: {res.timings['layout'].fmt()}")
    for phase in ("dispatch", "combine"):
        ph = rep["phases"][phase]
        print(f"[{phase}]{' ' * (9 - len(phase))}{name:<16}: {res.timings[phase].fmt()} | "
              f"logical {ph['logical_gbps']:7.2f} GB/s | bottleneck {ph['bottleneck_gbps']:7.2f} GB/s "
              f"(rank {ph['bottleneck_rank']}) | {fmt_kinds(ph['sent_by_kind'])}")
    trip = res.timings["round_trip"] if round_trip is None else round_trip
    print(f"[roundtrip]{name:<16}: {trip.fmt()}{' ' + note if note else ''}")


def fmt_check(ref: str, name: str, chk: dict) -> str:
    """One ``[check]`` line of :func:`compare_outputs`' verdict on ``name`` against ``ref``."""
    disp = [k for k in chk if k.startswith("dispatch.")]
    bad_disp = [k.split(".", 1)[1] for k in disp if not chk[k]]
    parts = [f"layout {'ok' if chk['layout'] else 'MISMATCH'}",
             "dispatch outputs bitwise " + ("ok" if not bad_disp else "MISMATCH in " + ",".join(bad_disp))]
    if chk.get("combined_x_two_roundings") is not None:
        parts.append(f"combined_x {'ok' if chk['combined_x_two_roundings'] else 'MISMATCH'} (calc_diff "
                     f"{chk['combined_x_calc_diff']:.3g}; internode rounds per node first, "
                     "docs/semantics/deepep-api.md §5)")
    elif chk["combined_x_bitwise"]:
        parts.append("combined_x bitwise ok")
    elif chk["combined_x_equal_values"]:
        parts.append("combined_x equal values but not bits (signed zeros)")
    else:
        parts.append(f"combined_x MISMATCH (calc_diff {chk['combined_x_calc_diff']:.3g})")
    parts.append("combined_topk_weights bitwise " + (
        "ok" if chk["combined_topk_weights_bitwise"]
        else f"MISMATCH (calc_diff {chk['combined_topk_weights_calc_diff']:.3g})"))
    return f"[check]    {name} vs {ref}: " + "; ".join(parts)


def check_ok(chk: dict) -> bool:
    """Whether :func:`compare_outputs`' verdict passes (equal values without equal bits, signed zeros, pass)."""
    return all(v for k, v in chk.items() if isinstance(v, bool) and k != "combined_x_equal_values")


def destroy_buffer(buf, root: bool, command: str = "normal") -> None:
    """``buf.destroy()`` (collective); a failure is reported on rank 0 (``root``) as ``[bench <command>] ...``,
    not raised."""
    try:
        buf.destroy()
    except Exception as e:  # noqa: BLE001
        if root:
            print(f"[bench {command}] {type(buf).__name__}.destroy() raised {type(e).__name__}: {e}", file=sys.stderr)


def normal_buffer_bytes(Buffer, num_tokens: int, hidden: int, num_ranks: int, ranks_per_node: int | None,
                        num_topk: int, num_experts: int, fp8: bool) -> tuple[int, int]:
    """``(num_nvl_bytes, num_rdma_bytes)`` of a normal-mode ``Buffer`` in which a dispatch of ``num_tokens``
    tokens per rank of ``hidden`` channels (BF16, or FP8 with float32 scales per 128 channels) never
    chunks: ``Buffer.get_normal_buffer_size_hint`` and, across simulated nodes (``ranks_per_node`` below
    ``num_ranks``), ``get_normal_rdma_buffer_size_hint``; ``num_rdma_bytes`` is 0 on one node."""
    hint = dict(num_topk=num_topk, num_experts=num_experts, x_itemsize=1 if fp8 else 2,
                num_scale_cols=hidden // 128 if fp8 else 0)
    nvl = Buffer.get_normal_buffer_size_hint(num_tokens, hidden, num_ranks, ranks_per_node=ranks_per_node, **hint)
    rdma = 0
    if ranks_per_node is not None and ranks_per_node < num_ranks:
        rdma = Buffer.get_normal_rdma_buffer_size_hint(num_tokens, hidden, num_ranks, ranks_per_node, **hint)
    return nvl, rdma
