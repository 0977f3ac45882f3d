"""Helpers for the multi-rank Buffer tests (``tests/ep``, ``tests/nn``): inputs, checks, one full case, and the
Buffers of a test module (:class:`ModuleBuffers`).

Everything here is collective-safe in the sense the harness needs: library calls that
communicate go through :func:`coll` (``mpi_utils.run_collectively``), so a failure on one rank
raises on every rank *at that call* and ranks never drift into mismatched collectives; local
comparisons are accumulated in a :class:`Checker` and raised only at the end of a test.

Expected handle entries 1, 2 and 5 (``channel_prefix_matrix``, ``recv_channel_prefix_matrix``,
``send_head``, docs/semantics/deepep-api.md §4.3) are computed here from the routing masks with plain cumulative sums,
independently of ``deepep_ascend.ep.layout``. Channel ``c`` of a rank with ``N`` tokens owns tokens
``[c*q, min((c+1)*q, N))``, ``q = ceil(N/C)`` (docs/semantics/deepep-api.md §0, DeepEP's ``get_channel_task_range``).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch

from deepep_ascend import Buffer
from tests.support.mpi_utils import (
    allgather_object,
    gather_all,
    run_collectively,
    world,
)
from tests.support.reference import (
    per_token_cast_back,
    per_token_cast_to_fp8,
    ref_combine,
    ref_dispatch,
    ref_dispatch_layout,
)

BF16 = torch.bfloat16


# ----------------------------------------------------------------------------------------------
# collective plumbing


def coll(fn, *args, what=None, **kwargs):
    """Run a communicating library call on every rank; if it fails on any rank, raise on all."""
    __tracebackhide__ = True
    return run_collectively(fn, *args, what=what or getattr(fn, "__name__", "call"), **kwargs)


class ModuleBuffers:
    """The Buffers of one test module (the ``buffers`` fixture of ``tests/conftest.py``).

    ``buffers(num_nvl_bytes, num_rdma_bytes=0, key=None, **kwargs)`` builds a Buffer collectively on the
    world communicator (``explicitly_destroy=True``); with a ``key`` it is built once and the same Buffer
    comes back for that key. :meth:`low_latency` sizes one for low-latency calls of ``(M, H, E)``. Every
    Buffer is destroyed collectively when the module ends.
    """

    def __init__(self):
        self._built: list[Buffer] = []
        self._keyed: dict = {}

    def __call__(self, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, key=None, **kwargs) -> Buffer:
        if key is not None and key in self._keyed:
            return self._keyed[key]
        comm = world()
        buf = coll(lambda: Buffer(None, num_nvl_bytes, num_rdma_bytes, comm=comm, explicitly_destroy=True,
                                  **kwargs), what="Buffer()")
        self._built.append(buf)
        if key is not None:
            self._keyed[key] = buf
        return buf

    def low_latency(self, m: int, hidden: int, num_experts: int, **kwargs) -> Buffer:
        """A low-latency Buffer sized by ``get_low_latency_rdma_size_hint(m, hidden, R, num_experts)``."""
        hint = Buffer.get_low_latency_rdma_size_hint(m, hidden, world().Get_size(), num_experts)
        return self(0, hint, low_latency_mode=True, **kwargs)

    def destroy_all(self) -> None:
        for buf in self._built:
            coll(buf.destroy, what="destroy Buffer")
        self._built.clear()
        self._keyed.clear()


def all_ranks_ok(comm, ok: bool, what: str) -> None:
    """Raise AssertionError on every rank unless ``ok`` holds on every rank (names the bad ranks)."""
    __tracebackhide__ = True
    oks = allgather_object(bool(ok), comm)
    bad = [r for r, o in enumerate(oks) if not o]
    assert not bad, f"{what}: failed on rank(s) {bad}"


def capture(fn):
    """``(result, exception)`` of ``fn()``; never raises (for expected-error tests)."""
    try:
        return fn(), None
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - the test inspects whatever was raised
        return None, exc


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes of a tensor (any dtype, including float8 and bool), flattened."""
    # A fresh copy with standard strides: .contiguous() keeps odd strides of size-1 dims, which
    # torch calls contiguous but refuses to view as another element size.
    t = torch.empty(t.shape, dtype=t.dtype).copy_(t)
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def same_bits_nan(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """Same NaN positions and every other element bit for bit (combine leaves NaN payloads unspecified)."""
    nan = expected.isnan()
    return torch.equal(got.isnan(), nan) and torch.equal(bits(got[~nan]), bits(expected[~nan]))


class Checker:
    """Accumulates local mismatches; :meth:`finish` raises them all at once (after all collectives)."""

    def __init__(self, rank: int):
        self.rank = rank
        self.errors: list[str] = []

    def check(self, cond, what: str) -> bool:
        try:
            ok = bool(cond() if callable(cond) else cond)
        except Exception as exc:  # noqa: BLE001 - a comparison that raises is a mismatch
            ok, what = False, f"{what} ({type(exc).__name__}: {exc})"
        if not ok:
            self.errors.append(what)
        return ok

    def same_bits(self, got, exp, what: str) -> bool:
        """Same dtype, shape and bytes (bitwise equality)."""
        if got is None or exp is None:
            return self.check(got is None and exp is None, f"{what}: got {type(got).__name__}, "
                              f"expected {type(exp).__name__}")
        if not self.check(isinstance(got, torch.Tensor), f"{what}: not a tensor ({type(got).__name__})"):
            return False
        if not self.check(got.dtype == exp.dtype and tuple(got.shape) == tuple(exp.shape),
                          f"{what}: got {got.dtype} {tuple(got.shape)}, expected {exp.dtype} {tuple(exp.shape)}"):
            return False
        ok = torch.equal(bits(got), bits(exp))
        if not ok:
            diff = (bits(got) != bits(exp)).nonzero()
            first = int(diff[0]) // max(1, got.element_size()) if diff.numel() else -1
            self.check(False, f"{what}: values differ ({diff.numel()} bytes; first flat element {first}: "
                              f"got {got.reshape(-1)[first].item() if first >= 0 else '?'}, "
                              f"expected {exp.reshape(-1)[first].item() if first >= 0 else '?'})")
        return ok

    def finish(self, what: str = "checks") -> None:
        __tracebackhide__ = True
        if self.errors:
            raise AssertionError(f"rank {self.rank}: {len(self.errors)} mismatch(es) in {what}:\n  "
                                 + "\n  ".join(self.errors[:20]))


# ----------------------------------------------------------------------------------------------
# inputs


def make_topk_idx(kind: str, n: int, num_experts: int, k: int, rank: int, num_ranks: int,
                  gen: torch.Generator) -> torch.Tensor:
    """``[n, k]`` int64 routing.

    * ``uniform``: top-k of random scores (distinct experts, balanced in expectation), ~10% of
      slots set to -1;
    * ``skewed``: every token of every rank goes to experts of one rank (``num_ranks // 2``) only;
      slots beyond that rank's ``L`` experts are -1;
    * ``allneg``: as uniform, but every third row is all -1 and the last rank's rows are all -1;
    * ``ring``: token ``t`` to expert ``t % L`` of this rank and ``(t+1) % L`` of the next rank;
    * ``dup``: as uniform, then slot 1 repeats slot 0 and every third row has slot 0's expert in slot 2
      too (an expert listed two or three times in a row, docs/semantics/deepep-api.md §0).
    """
    L = num_experts // num_ranks
    if kind in ("uniform", "allneg", "dup"):
        scores = torch.rand(n, num_experts, generator=gen)
        idx = scores.topk(k, dim=1).indices if n else torch.empty(0, k, dtype=torch.int64)
        drop = torch.rand(n, k, generator=gen) < 0.1
        idx = idx.masked_fill(drop, -1)
        if kind == "allneg":
            idx[::3] = -1
            if rank == num_ranks - 1:
                idx[:] = -1
        if kind == "dup" and k >= 3:
            idx[:, 1] = idx[:, 0]
            idx[::3, 2] = idx[::3, 0]
    elif kind == "skewed":
        target = num_ranks // 2
        idx = torch.full((n, k), -1, dtype=torch.int64)
        for t in range(n):
            perm = torch.randperm(L, generator=gen)[:k]
            idx[t, :perm.numel()] = target * L + perm
    elif kind == "ring":
        t = torch.arange(n)
        idx = torch.stack([rank * L + t % L, ((rank + 1) % num_ranks) * L + (t + 1) % L], dim=1)
        if k > 2:
            idx = torch.cat([idx, torch.full((n, k - 2), -1, dtype=torch.int64)], dim=1)
        idx = idx[:, :k]
    else:
        raise ValueError(kind)
    return idx.to(torch.int64).contiguous()


def make_x(kind: str, n: int, hidden: int, gen: torch.Generator):
    """``(x as passed to dispatch, x as bf16 for later combine)``.

    kinds: ``bf16``; ``f32`` (byte-copied dtype); ``fp8`` (DeepEP cast, scales column-major);
    ``fp8_ue8m0`` (int32 packed UE8M0 scales ``[n, ceil(H/512)]``, column-major).
    """
    base = (torch.randn(n, hidden, generator=gen) * 2).to(BF16)
    if kind == "bf16":
        return base, base
    if kind == "f32":
        return base.float() + 0.25, base
    if kind == "fp8":
        data, scales = per_token_cast_to_fp8(base)
        col = scales.t().contiguous().t()  # column-major strides, same values
        return (data, col), per_token_cast_back(data, scales)
    if kind == "fp8_ue8m0":
        data, _ = per_token_cast_to_fp8(base)
        exps = torch.randint(120, 134, (n, 4 * math.ceil(hidden / 512)), generator=gen).to(torch.uint8)
        packed = exps.view(torch.int32)  # [n, ceil(H/512)]: 4 exponent bytes per int32
        packed = packed.t().contiguous().t()
        return (data, packed), base
    raise ValueError(kind)


def gather_x(x, num_ranks: int):
    """Every rank's ``x`` (a tensor, or a ``(data, scales)`` pair), as a list by rank."""
    if isinstance(x, tuple):
        parts = [gather_all(p) for p in x]
        return [(parts[0][s], parts[1][s]) for s in range(num_ranks)]
    return gather_all(x)


def expected_send_layout(itr: torch.Tensor, num_channels: int):
    """``(channel_prefix_matrix [R, C], send_head [N, R])`` of one sender's routing mask
    (docs/semantics/deepep-api.md §4.3)."""
    n, r = itr.shape
    q = max(1, -(-n // num_channels))
    csum = torch.cat([torch.zeros(1, r, dtype=torch.int64), itr.to(torch.int64).cumsum(0)])  # [N+1, R]
    cpm = torch.stack([csum[min((c + 1) * q, n)] for c in range(num_channels)], dim=1).to(torch.int32)
    send_head = torch.full((n, r), -1, dtype=torch.int32)
    for t in range(n):
        start = (t // q) * q
        for j in range(r):
            if itr[t, j]:
                send_head[t, j] = int(csum[t, j] - csum[start, j])
    return cpm, send_head


def expected_recv_channel_prefix(itrs, rank: int, num_channels: int) -> torch.Tensor:
    """``[R, C]``: start of channel ``c`` inside source ``s``'s block of ``rank``'s rows, block-relative."""
    out = torch.zeros(len(itrs), num_channels, dtype=torch.int32)
    for s, itr in enumerate(itrs):
        n = itr.size(0)
        q = max(1, -(-n // num_channels))
        col = itr[:, rank].tolist()
        for c in range(num_channels):
            out[s, c] = sum(col[:min(c * q, n)])
    return out


INTERNODE_HANDLE = ("is_token_in_rank", "rdma_channel_prefix_matrix", "gbl_channel_prefix_matrix",
                    "recv_rdma_channel_prefix_matrix", "recv_rdma_rank_prefix_sum", "recv_gbl_channel_prefix_matrix",
                    "recv_gbl_rank_prefix_sum", "recv_src_meta", "send_rdma_head", "send_nvl_head")


def expected_internode_handle(itrs, rank: int, rpn: int, num_channels: int, ref) -> dict:
    """The internode handle of ``rank`` (docs/semantics/deepep-api.md §5, entries as documented in
    ``deepep_ascend.ep.handles.InternodeHandle``), computed with plain loops from every rank's routing mask ``itrs`` and
    the reference dispatch ``ref``."""
    R = len(itrs)
    G, node, local = R // rpn, rank // rpn, rank % rpn
    itr = itrs[rank]
    n = itr.size(0)
    in_node = itr.view(n, G, rpn).any(2)
    out = {"is_token_in_rank": itr}
    out["rdma_channel_prefix_matrix"] = expected_send_layout(in_node, num_channels)[0]
    out["gbl_channel_prefix_matrix"] = expected_send_layout(itr, num_channels)[0]
    head = torch.full((n, G), -1, dtype=torch.int32)
    for c in range(G):
        pos = 0
        for t in range(n):
            if bool(in_node[t, c]):
                head[t, c] = pos
                pos += 1
    out["send_rdma_head"] = head
    gbl = ref.rank_prefix_matrix[:, rank].clone()
    out["recv_gbl_rank_prefix_sum"] = gbl
    starts = [0] + gbl.tolist()
    rel = expected_recv_channel_prefix(itrs, rank, num_channels)
    out["recv_gbl_channel_prefix_matrix"] = rel + torch.tensor(starts[:R], dtype=torch.int32).unsqueeze(1)
    rows = ref.recv_src_idx.numel()
    meta = torch.zeros(rows, 2, dtype=torch.int32)
    meta[:, 0] = ref.recv_src_idx
    num_recv = starts[-1]
    for s in range(R):
        meta[starts[s]:starts[s + 1], 1] = s // rpn
    meta[num_recv:] = 0
    out["recv_src_meta"] = meta.view(torch.uint8).view(rows, 8)
    fwd_counts, nvl_rows, rdma_cpm = [], [], torch.zeros(G, num_channels, dtype=torch.int32)
    for a in range(G):  # tokens of rail source (a, local) this rank forwards
        src_itr = itrs[a * rpn + local]
        ns = src_itr.size(0)
        q = max(1, -(-ns // num_channels))
        mine = src_itr[:, node * rpn:(node + 1) * rpn]
        seen = [0] * rpn
        count = 0
        for t in range(ns):
            if bool(mine[t].any()):
                count += 1
                rdma_cpm[a, t // q:] += 1
                row = []
                for j in range(rpn):
                    if bool(mine[t, j]):
                        row.append(seen[j])
                        seen[j] += 1
                    else:
                        row.append(-1)
                nvl_rows.append(row)
        fwd_counts.append(count)
    out["recv_rdma_rank_prefix_sum"] = torch.tensor(fwd_counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    out["recv_rdma_channel_prefix_matrix"] = rdma_cpm
    out["send_nvl_head"] = torch.tensor(nvl_rows, dtype=torch.int32).view(-1, rpn)
    return out


# ----------------------------------------------------------------------------------------------
# one full case: layout, dispatch, cached dispatch, combine, all against the reference


@dataclass
class Case:
    name: str
    tokens: int = 32  # per rank (see zero_rank)
    hidden: int = 128
    experts: int = 16
    topk: int = 4
    routing: str = "uniform"
    x_kind: str = "bf16"
    with_topk: bool = True
    align: int = 1
    worst: bool = False  # num_worst_tokens = tokens * R (docs/semantics/deepep-api.md §9.6)
    bias: str = "none"  # none | one | pair | pair_first_none
    cached: bool = False
    use_async: bool = False
    num_sms: int | None = None  # None: the Buffer's default configs
    zero_rank: bool = False  # the last rank has no tokens
    extra: dict = field(default_factory=dict)

    def num_tokens(self, rank: int, num_ranks: int) -> int:
        if self.zero_rank and rank == num_ranks - 1:
            return 0
        return self.tokens + (rank % 3)  # ranks differ a little

    def hint_args(self, num_ranks: int):
        """Arguments of Buffer.get_normal_buffer_size_hint covering this case."""
        s = 0
        itemsize = {"bf16": 2, "f32": 4, "fp8": 1, "fp8_ue8m0": 1}[self.x_kind]
        if self.x_kind == "fp8":
            s = self.hidden // 128
        elif self.x_kind == "fp8_ue8m0":
            s = -(-self.hidden // 512)
        return dict(num_max_tokens_per_rank=self.tokens + 2, hidden=self.hidden, num_ranks=num_ranks,
                    num_topk=self.topk, num_experts=self.experts, x_itemsize=itemsize, num_scale_cols=s)

    def __str__(self):
        return self.name


def _wait(ev):
    if ev is not None and ev.event is not None:
        ev.current_stream_wait()


def run_case(buf, comm, case: Case, seed: int, chk: Checker | None = None):
    """Run ``case`` on ``buf`` and compare everything with the reference; returns the Checker.

    Bitwise comparisons: layout, every dispatch output, handle entries, cached dispatch, and the
    combine (the reference sums ``f32(bias0)+f32(bias1)`` then receivers in ascending rank, the
    order the library documents, so equality is exact, not within a tolerance).
    """
    from deepep_ascend import Buffer, Config

    r, R = comm.Get_rank(), comm.Get_size()
    chk = chk or Checker(r)
    gen = torch.Generator().manual_seed(seed * 7919 + r)
    n, H, E, K = case.num_tokens(r, R), case.hidden, case.experts, case.topk
    L = E // R
    idx = make_topk_idx(case.routing, n, E, K, r, R, gen)
    w = (torch.rand(n, K, generator=gen) + 0.01).float()
    x, _ = make_x(case.x_kind, n, H, gen)
    cfg = ccfg = None
    if case.num_sms is not None:
        cfg = Config(case.num_sms, 6, 256, 6, 128)
        ccfg = Config(case.num_sms, 4, 256, 6, 128)
    num_channels = (case.num_sms if case.num_sms is not None else Buffer.num_sms) // 2

    # -- layout (pure, but async runs on the worker)
    if case.use_async:
        lay = buf.get_dispatch_layout(idx, E, previous_event=Buffer.capture(), async_finish=True,
                                      allocate_on_comm_stream=True)
        chk.check(lay[4].event is not None, "async get_dispatch_layout returned an empty event")
        _wait(lay[4])
    else:
        lay = buf.get_dispatch_layout(idx, E)
        chk.check(lay[4].event is None, "sync get_dispatch_layout returned an event")
    ntpr, ntprdma, ntpe, itr, _ = lay
    internode = buf.num_nodes > 1
    rpn = buf.ranks_per_node
    e_ntpr, e_ntprdma, e_ntpe, e_itr = ref_dispatch_layout(idx, E, R, ranks_per_node=rpn)
    chk.same_bits(ntpr, e_ntpr, "layout num_tokens_per_rank")
    if internode:
        chk.same_bits(ntprdma, e_ntprdma, "layout num_tokens_per_rdma_rank")
    else:
        chk.check(ntprdma is None, "layout num_tokens_per_rdma_rank must be None on one node")
    chk.same_bits(ntpe, e_ntpe, "layout num_tokens_per_expert")
    chk.same_bits(itr, e_itr, "layout is_token_in_rank")

    # -- dispatch
    kwargs = dict(num_tokens_per_rank=ntpr, num_tokens_per_rdma_rank=ntprdma, is_token_in_rank=itr,
                  num_tokens_per_expert=ntpe, expert_alignment=case.align, config=cfg)
    if case.with_topk:
        kwargs.update(topk_idx=idx, topk_weights=w)
    worst = 0
    if case.worst:
        worst = max(1, case.tokens + 2) * R
        kwargs["num_worst_tokens"] = worst
    if case.use_async:
        kwargs.update(previous_event=Buffer.capture(), async_finish=True, allocate_on_comm_stream=True)

    def do_dispatch():
        out = buf.dispatch(x, **kwargs)
        _wait(out[5])
        return out

    out = coll(do_dispatch, what=f"{case.name}: dispatch")
    recv_x, recv_idx, recv_w, recv_list, handle, ev = out
    chk.check(len(out) == 6, "dispatch must return a 6-tuple")
    chk.check((ev.event is not None) == case.use_async, "dispatch event presence vs async_finish")

    xs = gather_x(x, R)
    idxs = gather_all(idx)
    ws = gather_all(w)
    itrs = gather_all(itr)
    ref = ref_dispatch(xs, idxs, ws if case.with_topk else None, E, r, expert_alignment=case.align,
                       num_worst_tokens=worst)
    if isinstance(x, tuple):
        chk.check(isinstance(recv_x, tuple) and len(recv_x) == 2, "FP8 recv_x must be a (data, scales) pair")
        chk.same_bits(recv_x[0], ref.recv_x[0], "recv_x data (FP8)")
        chk.same_bits(recv_x[1], ref.recv_x[1], "recv_x scales")
        chk.check(recv_x[1].is_contiguous(), "received scales must be contiguous row-major")
    else:
        chk.same_bits(recv_x, ref.recv_x, "recv_x")
    chk.same_bits(recv_idx, ref.recv_topk_idx, "recv_topk_idx")
    chk.same_bits(recv_w, ref.recv_topk_weights, "recv_topk_weights")
    chk.check(recv_list == ref.num_recv_tokens_per_expert_list and isinstance(recv_list, list)
              and all(type(v) is int for v in recv_list),
              f"num_recv_tokens_per_expert_list {recv_list} != {ref.num_recv_tokens_per_expert_list}")
    if not case.worst and case.with_topk:
        # docs/semantics/deepep-api.md §9.4: count of local id i == unaligned list entry i
        unaligned = ref_dispatch(xs, idxs, ws, E, r).num_recv_tokens_per_expert_list
        counts = [int((recv_idx == i).sum()) for i in range(L)]
        chk.check(counts == unaligned, f"local expert id counts {counts} != unaligned list {unaligned}")

    if internode:  # docs/semantics/deepep-api.md §5: the 10-entry handle
        chk.check(isinstance(handle, tuple) and len(handle) == 10, "internode handle must be a 10-tuple")
        for name, got in expected_internode_handle(itrs, r, rpn, num_channels, ref).items():
            chk.same_bits(handle[INTERNODE_HANDLE.index(name)], got, f"handle.{name}")
    else:  # docs/semantics/deepep-api.md §4.3
        chk.check(isinstance(handle, tuple) and len(handle) == 6, "handle must be a 6-tuple")
        prefix, cpm, rcpm, src_idx, h_itr, send_head = handle
        chk.same_bits(prefix, ref.rank_prefix_matrix, "handle.rank_prefix_matrix (whole matrix)")
        chk.same_bits(src_idx, ref.recv_src_idx, "handle.recv_src_idx")
        chk.same_bits(h_itr, ref.is_token_in_rank, "handle.is_token_in_rank")
        e_cpm, e_send_head = expected_send_layout(itr, num_channels)
        chk.same_bits(cpm, e_cpm, "handle.channel_prefix_matrix")
        chk.same_bits(send_head, e_send_head, "handle.send_head")
        chk.same_bits(rcpm, expected_recv_channel_prefix(itrs, r, num_channels), "handle.recv_channel_prefix_matrix")

    # -- cached dispatch with new data (docs/semantics/deepep-api.md §4.5)
    if case.cached:
        x2, _ = make_x(case.x_kind, n, H, gen)
        ckw = dict(handle=handle, config=cfg)
        if case.use_async:
            ckw.update(previous_event=Buffer.capture(), async_finish=True, allocate_on_comm_stream=True)

        def do_cached():
            o = buf.dispatch(x2, **ckw)
            _wait(o[5])
            return o

        cout = coll(do_cached, what=f"{case.name}: cached dispatch")
        chk.check(len(cout) == 6 and all(v is None for v in cout[1:5]),
                  "cached dispatch must return (recv_x, None, None, None, None, event)")
        xs2 = gather_x(x2, R)
        ref2 = ref_dispatch(xs2, idxs, None, E, r, num_worst_tokens=worst)
        if isinstance(x2, tuple):
            chk.same_bits(cout[0][0], ref2.recv_x[0], "cached recv_x data")
            chk.same_bits(cout[0][1], ref2.recv_x[1], "cached recv_x scales")
        else:
            chk.same_bits(cout[0], ref2.recv_x, "cached recv_x")

    # -- combine (docs/semantics/deepep-api.md §4.6): a receiver-specific bf16 payload, bias, weights
    rows = recv_x[0].size(0) if isinstance(recv_x, tuple) else recv_x.size(0)
    if isinstance(recv_x, tuple):
        if case.x_kind == "fp8":
            base = per_token_cast_back(recv_x[0], recv_x[1])
        else:
            base = recv_x[0].to(BF16)
    else:
        base = recv_x.to(BF16)
    y = (base.float() * (1 + r / 8) + torch.randn(rows, H, generator=gen) * 0.01).to(BF16)
    bias = None
    if case.bias != "none":
        b0 = (torch.randn(n, H, generator=gen)).to(BF16)
        b1 = (torch.randn(n, H, generator=gen) * 0.5).to(BF16)
        bias = {"one": b0, "pair": (b0, b1), "pair_first_none": (None, b1)}[case.bias]
    ckw = dict(topk_weights=recv_w, bias=bias, config=ccfg)
    if case.use_async:
        ckw.update(previous_event=Buffer.capture(), async_finish=True, allocate_on_comm_stream=True)

    def do_combine():
        o = buf.combine(y, handle, **ckw)
        _wait(o[2])
        return o

    combined, combined_w, _ = coll(do_combine, what=f"{case.name}: combine")
    ys = gather_all(y)
    rws = gather_all(recv_w) if recv_w is not None else None
    e_comb, e_w = ref_combine(ys, itrs, r, bias=bias, topk_weights=rws, ranks_per_node=rpn if internode else None)
    chk.same_bits(combined, e_comb, "combined_x (bitwise: same float32 order as the reference)")
    chk.same_bits(combined_w, e_w, "combined_topk_weights")
    if case.with_topk:
        # docs/semantics/deepep-api.md §4.6: combining the received weights gives the originals at valid slots, 0 at -1
        expect = torch.where(idx >= 0, w, torch.zeros_like(w))
        chk.same_bits(combined_w, expect, "combined_topk_weights vs original weights")
    return chk

def many_round_trips(buf, comm, iters: int = 200) -> Checker:
    """``iters`` consecutive dispatch/combine round trips, varying N and routing, nothing cleaned.

    Every iteration is checked locally (combine of the received rows == bf16(count · x),
    combined weights == originals); iterations 0, 50, 100, 150 and 199 also against the
    reference. Every 10th iteration uses async calls; every 4th adds a cached dispatch.
    All iterations run inside one collective guard; the gathers for the reference come after.
    Works on both paths (internode: the handle's entries 6 and 7, the two-rounding reference).
    Returns the Checker (the caller finishes it).
    """
    from deepep_ascend import Buffer

    r, R = comm.Get_rank(), comm.Get_size()
    internode = buf.num_nodes > 1
    chk = Checker(r)
    E, K, H = 16, 2, 128
    inputs = []
    for it in range(iters):
        gen = torch.Generator().manual_seed(10_000 + it * 17 + r)
        n = (it * 5 + r * 3) % 13  # 0..12 tokens, differing by rank and iteration
        idx = make_topk_idx("uniform" if it % 4 else "allneg", n, E, K, r, R, gen)
        inputs.append((idx, torch.rand(n, K, generator=gen), torch.randn(n, H, generator=gen).to(BF16)))

    def loop():
        results = []
        for it, (idx, w, x) in enumerate(inputs):
            use_async = it % 10 == 9
            ntpr, ntprdma, ntpe, itr, _ = buf.get_dispatch_layout(idx, E)
            kw = dict(async_finish=True, previous_event=Buffer.capture(), allocate_on_comm_stream=True) \
                if use_async else {}
            out = buf.dispatch(x, num_tokens_per_rank=ntpr, num_tokens_per_rdma_rank=ntprdma, is_token_in_rank=itr,
                               num_tokens_per_expert=ntpe,
                               topk_idx=idx, topk_weights=w, **kw)
            if use_async:
                out[5].current_stream_wait()
            cached = None
            if it % 4 == 1:
                cached = buf.dispatch(x * 2, handle=out[4], **kw)
                if use_async:
                    cached[5].current_stream_wait()
            comb = buf.combine(out[0], out[4], topk_weights=out[2], **kw)
            if use_async:
                comb[2].current_stream_wait()
            results.append((itr, out, cached, comb))
        return results

    results = coll(loop, what="200 round trips")
    for it, ((idx, w, x), (itr, out, cached, comb)) in enumerate(zip(inputs, results)):
        expect = (x.float() * itr.sum(1, keepdim=True).float() + 0.0).to(BF16)  # + 0.0: no -0.0
        chk.check(torch.equal(bits(comb[0]), bits(expect)), f"iteration {it}: combined != bf16(count * x)")
        chk.check(torch.equal(comb[1], torch.where(idx >= 0, w, torch.zeros_like(w))),
                  f"iteration {it}: combined weights != originals")
        if cached is not None:
            chk.check(torch.equal(bits(cached[0]), bits(out[0] * 2)), f"iteration {it}: cached dispatch of 2x")
        if it % 50 == 0 or it == iters - 1:
            xs, idxs, ws = gather_all(x), gather_all(idx), gather_all(w)
            ref = ref_dispatch(xs, idxs, ws, E, r)
            chk.same_bits(out[0], ref.recv_x, f"iteration {it}: recv_x")
            chk.same_bits(out[1], ref.recv_topk_idx, f"iteration {it}: recv_topk_idx")
            chk.same_bits(out[2], ref.recv_topk_weights, f"iteration {it}: recv_topk_weights")
            if internode:
                chk.same_bits(out[4][6], ref.rank_prefix_matrix[:, r], f"iteration {it}: recv_gbl_rank_prefix_sum")
                chk.same_bits(out[4][7].view(torch.int32)[:, 0], ref.recv_src_idx, f"iteration {it}: recv_src_meta")
            else:
                chk.same_bits(out[4][0], ref.rank_prefix_matrix, f"iteration {it}: rank_prefix_matrix")
                chk.same_bits(out[4][3], ref.recv_src_idx, f"iteration {it}: recv_src_idx")
            ys, itrs, rws = gather_all(out[0]), gather_all(itr), gather_all(out[2])
            e_comb, e_w = ref_combine(ys, itrs, r, topk_weights=rws,
                                      ranks_per_node=buf.ranks_per_node if internode else None)
            chk.same_bits(comb[0], e_comb, f"iteration {it}: combined_x")
            chk.same_bits(comb[1], e_w, f"iteration {it}: combined weights")
    return chk


def roundtrip_ok(buf, comm, seed: int = 0, n: int = 12, hidden: int = 128, num_experts: int = 16, k: int = 2):
    """A small good dispatch + combine, checked locally: combine(dispatch(x)) == bf16(count · x).

    The float32 sum of ``count`` equal bf16 values is exact, so the comparison is bitwise.
    Collective (uses :func:`coll`). Returns a list of local error strings (empty = fine).
    """
    r, R = comm.Get_rank(), comm.Get_size()
    gen = torch.Generator().manual_seed(1000 + seed * 31 + r)
    idx = make_topk_idx("uniform", n, num_experts, k, r, R, gen)
    w = torch.rand(n, k, generator=gen)
    x = torch.randn(n, hidden, generator=gen).to(BF16)

    def go():
        ntpr, ntprdma, ntpe, itr, _ = buf.get_dispatch_layout(idx, num_experts)
        recv_x, _, recv_w, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=ntpr, num_tokens_per_rdma_rank=ntprdma,
                                                       is_token_in_rank=itr, num_tokens_per_expert=ntpe,
                                                       topk_idx=idx, topk_weights=w)
        combined, cw, _ = buf.combine(recv_x, handle, topk_weights=recv_w)
        return itr, combined, cw

    itr, combined, cw = coll(go, what="good round trip after the error")
    errors = []
    expect = (x.float() * itr.sum(1, keepdim=True).float() + 0.0).to(BF16)  # + 0.0: no -0.0
    if not torch.equal(bits(combined), bits(expect)):
        errors.append("round trip: combined != bf16(count * x)")
    if not torch.equal(cw, torch.where(idx >= 0, w, torch.zeros_like(w))):
        errors.append("round trip: combined weights != originals")
    return errors


def buffer_on_nodes(build, nodes: int):
    """A module fixture's body: yield ``build(nodes)``, the buffer over the world split into ``nodes`` simulated
    nodes (None where the ranks do not split so), and destroy it collectively after the module."""
    if world().Get_size() % nodes:
        yield None
        return
    buf = build(nodes)
    yield buf
    coll(buf.destroy, what="destroy")


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """A block run with torch's default dtype ``dtype`` (DeepEP's test harness sets bfloat16), restored after."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)
