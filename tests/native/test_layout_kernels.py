"""The normal path's routing counts in C (``native.dispatch_layout`` with ``EPBuffer``'s last slot per rank,
``send_layout``, ``recv_channel_prefix``)
against per-token Python loops (the definitions, docs/semantics/deepep-api.md §4.1, §4.3) and the numpy paths
of ``deepep_ascend.ep.layout`` that run where the library is not built: same values, dtypes and shapes;
empty routings; ids out of range and operands the kernels do not take."""

from __future__ import annotations

import pytest
import torch

from deepep_ascend import native
from deepep_ascend.ep import layout
from deepep_ascend.native.loader import kernels

pytestmark = pytest.mark.skipif(kernels.dispatch_layout is None, reason="native kernels not built")


def _loop_dispatch_layout(topk, num_experts, num_ranks):
    local = num_experts // num_ranks
    per_rank = torch.zeros(num_ranks, dtype=torch.int32)
    per_expert = torch.zeros(num_experts, dtype=torch.int32)
    in_rank = torch.zeros(topk.size(0), num_ranks, dtype=torch.bool)
    for t, row in enumerate(topk.tolist()):
        for e in row:
            if e >= 0:
                per_expert[e] += 1
                in_rank[t, e // local] = True
    per_rank += in_rank.sum(0, dtype=torch.int32)
    return per_rank, per_expert, in_rank


def _loop_last_slot(topk, num_experts, num_ranks):
    local = num_experts // num_ranks
    last = torch.full((topk.size(0), num_ranks), -1, dtype=torch.int64)
    for t, row in enumerate(topk.tolist()):
        for j, e in enumerate(row):
            if e >= 0:
                last[t, e // local] = max(int(last[t, e // local]), j)
    return last


def _loop_send_layout(in_rank, num_channels):
    n, r = in_rank.shape
    q = max(1, -(-n // num_channels))
    prefix = torch.zeros(r, num_channels, dtype=torch.int32)
    head = torch.full((n, r), -1, dtype=torch.int32)
    for j in range(r):
        seen = [0] * num_channels
        for t in range(n):
            if in_rank[t, j]:
                head[t, j] = seen[t // q]
                seen[t // q] += 1
        run = 0
        for c in range(num_channels):
            run += seen[c]
            prefix[j, c] = run
    return prefix, head


def _loop_recv_channel_prefix(src, starts, ntok, num_channels):
    out = torch.zeros(len(ntok), num_channels, dtype=torch.int32)
    for s in range(len(ntok)):
        q = max(1, -(-ntok[s] // num_channels))
        rows = [0] * num_channels
        for v in src[starts[s]:starts[s + 1]].tolist():
            if v // q < num_channels:
                rows[v // q] += 1
        run = 0
        for c in range(num_channels):
            out[s, c] = run
            run += rows[c]
    return out


def _numpy_path(fn, *args, monkeypatch):
    with monkeypatch.context() as m:
        for name in ("dispatch_layout", "send_layout", "recv_channel_prefix"):
            m.setattr(kernels, name, None)
        return fn(*args)


def _same(got, *wants):
    got = got if isinstance(got, tuple) else (got,)
    for want in wants:
        want = want if isinstance(want, tuple) else (want,)
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (a, b)


@pytest.mark.parametrize("num_ranks,local,num_tokens,k,num_channels", [
    (1, 3, 5, 2, 4), (2, 4, 0, 3, 2), (4, 2, 17, 4, 3), (8, 1, 33, 3, 20), (3, 5, 9, 0, 1), (2, 8, 64, 8, 12),
    (4, 300, 33, 4, 3)])  # (the last: more experts than the kernel's rank table on the stack)
def test_matches_the_loops_and_the_numpy_paths(num_ranks, local, num_tokens, k, num_channels, monkeypatch):
    g = torch.Generator().manual_seed(num_ranks * 100 + num_tokens)
    num_experts = num_ranks * local
    topk = torch.randint(-1, num_experts, (num_tokens, k), generator=g)
    if num_tokens > 2 and k > 1:
        topk[1, 1] = topk[1, 0]  # an expert twice in a row counts per slot
        topk[2] = -1  # a token with no expert
    got = native.dispatch_layout(topk, num_experts, num_ranks)
    _same(got, _loop_dispatch_layout(topk, num_experts, num_ranks),
          _numpy_path(layout.dispatch_layout, topk, num_experts, num_ranks, monkeypatch=monkeypatch))
    with_last = native.dispatch_layout(topk, num_experts, num_ranks, last_slot=True)  # EPBuffer's combine keys too
    _same(with_last, (*got, _loop_last_slot(topk, num_experts, num_ranks)))
    _same(with_last[3], layout.last_slot_per_rank(topk, num_experts, num_ranks))
    in_rank = got[2]
    _same(native.send_layout(in_rank, num_channels), _loop_send_layout(in_rank, num_channels),
          _numpy_path(layout.send_layout, in_rank, num_channels, monkeypatch=monkeypatch))
    # every source's received rows: ascending token indices of a random subset, then spare rows past the end
    ntok = torch.randint(0, 40, (num_ranks,), generator=g).tolist()
    blocks = [torch.sort(torch.randperm(t, generator=g)[:int(torch.randint(0, t + 1, (1,), generator=g))]).values
              for t in ntok]
    src = torch.cat(blocks + [torch.zeros(3, dtype=torch.int64)]).to(torch.int32)
    starts = [0]
    for b in blocks:
        starts.append(starts[-1] + b.numel())
    _same(native.recv_channel_prefix(src, starts, ntok, num_channels),
          _loop_recv_channel_prefix(src, starts, ntok, num_channels),
          _numpy_path(layout.recv_channel_prefix, src, starts, ntok, num_channels, monkeypatch=monkeypatch))
    shuffled = torch.cat([b[torch.randperm(b.numel(), generator=g)] for b in blocks]).to(torch.int32)
    _same(native.recv_channel_prefix(shuffled, starts, ntok, num_channels),  # tokens in any order: the same counts
          _loop_recv_channel_prefix(shuffled, starts, ntok, num_channels))


def test_random_routings_match_the_loops():
    """200 random routings and receives: 1-64 ranks, up to 19,200 experts (past the kernel's rank table on the
    stack), received blocks ascending or shuffled (the channel walk's fallback), channels more than tokens."""
    g = torch.Generator().manual_seed(23)

    def pick(options):
        return options[int(torch.randint(0, len(options), (1,), generator=g))]

    for _ in range(200):
        num_ranks, local = pick([1, 2, 3, 4, 8, 16, 64]), pick([1, 2, 5, 16, 100, 300])
        num_experts, n, k = num_ranks * local, pick([0, 1, 3, 17, 200]), pick([0, 1, 2, 6, 8])
        topk = torch.randint(-1, num_experts, (n, k), generator=g)
        _same(native.dispatch_layout(topk, num_experts, num_ranks, last_slot=True),
              (*_loop_dispatch_layout(topk, num_experts, num_ranks), _loop_last_slot(topk, num_experts, num_ranks)))
        num_channels = pick([1, 2, 3, 10, 24, 100])
        ntok = [pick([0, 1, 5, 64, 300]) for _ in range(num_ranks)]
        blocks = []
        for t in ntok:
            b = torch.sort(torch.randperm(t, generator=g)[:int(torch.randint(0, t + 1, (1,), generator=g))]).values
            blocks.append(b[torch.randperm(b.numel(), generator=g)] if float(torch.rand(1, generator=g)) < 0.3 else b)
        src = torch.cat(blocks + [torch.zeros(2, dtype=torch.int64)]).to(torch.int32)
        starts = [0]
        for b in blocks:
            starts.append(starts[-1] + b.numel())
        _same(native.recv_channel_prefix(src, starts, ntok, num_channels),
              _loop_recv_channel_prefix(src, starts, ntok, num_channels))


@pytest.mark.parametrize("rank,local", [(0, 3), (2, 4), (1, 1)])
def test_local_experts_matches_the_torch_path(rank, local):
    g = torch.Generator().manual_seed(rank * 10 + local)
    idx = torch.randint(-1, 4 * local, (23, 5), generator=g)
    w = torch.randn(23, 5, generator=g)
    w[0, 0] = float("nan")  # a foreign slot's NaN weight becomes +0.0 too
    idx[0, 0] = -1
    want_idx, want_w = idx.clone(), w.clone()
    first = rank * local
    for t in range(23):  # the definition, slot by slot
        for j in range(5):
            e = int(idx[t, j]) - first
            want_idx[t, j] = e if 0 <= e < local else -1
            if not 0 <= e < local:
                want_w[t, j] = 0.0
    got_idx, got_w = idx.clone(), w.clone()
    version = got_w._version
    assert native.local_experts(got_idx, got_w, rank, local)
    assert torch.equal(got_idx, want_idx)
    assert torch.equal(got_w.view(torch.int32), want_w.view(torch.int32))  # +0.0 bits, the rest unchanged
    assert got_w._version > version  # written as an in-place op would
    assert not native.local_experts(idx[:, ::2], w[:, ::2], rank, local)  # strided: the caller's torch path


def test_refuses_what_it_does_not_take():
    assert native.dispatch_layout(torch.tensor([[0, 4]]), 4, 2) is None  # id past the experts
    assert native.dispatch_layout(torch.tensor([[0, 4]]), 4, 2, last_slot=True) is None
    assert native.dispatch_layout(torch.tensor([[-2, 1]]), 4, 2) is None  # below -1
    assert native.dispatch_layout(torch.tensor([[0, 1]], dtype=torch.int32), 4, 2) is None  # not int64
    assert native.dispatch_layout(torch.zeros(4, 3, dtype=torch.int64)[:, ::2], 4, 2) is None  # strided
    assert native.send_layout(torch.zeros(3, 2, dtype=torch.bool), 0) is None  # no channel
    assert native.send_layout(torch.zeros(3, 2, dtype=torch.int32), 2) is None  # not bool
    assert native.recv_channel_prefix(torch.tensor([-1], dtype=torch.int32), [0, 1], [3], 2) is None  # negative
    assert native.recv_channel_prefix(torch.tensor([0, 1], dtype=torch.int32), [0, 3], [3], 2) is None  # past end
    assert native.recv_channel_prefix(torch.tensor([0, 1], dtype=torch.int32), [0, 2, 1], [3, 3], 2) is None
