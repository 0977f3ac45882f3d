"""The fused low-latency calls (``native.LLPlan``, ``csrc/ll_fused.c``) against the step-by-step native calls
(``native.ll_*``) they fuse, byte for byte: R simulated ranks whose windows, control words, signal words and
traffic counters are plain tensors in this process; every rank issues, then every rank finishes. Both paths
start from the same bytes and must leave the same bytes everywhere (windows, headers, signals, outputs,
counters); plus each status the engine explains: a late source, disagreeing headers, a moved stamp, a bad
route (nothing written)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from deepep_ascend import native
from deepep_ascend.ep.low_latency import HDR_BYTES, Layout
from tests.support.rows import random_rows

pytestmark = pytest.mark.skipif(not native.fused_available(), reason="native kernels not built")

W = HDR_BYTES // 8  # int64 words per header slot
OP_DISPATCH, OP_COMBINE, F_PULL = 1, 2, 8


class Ranks:
    """R ranks' memory as plain tensors: windows (two halves of ``lay``), control windows (headers and stamps),
    signal words ``[2, R]`` and traffic counters ``[3, R]`` per rank."""

    def __init__(self, R, lay: Layout, seed):
        g = torch.Generator().manual_seed(seed)
        self.R, self.lay, self.half = R, lay, -(-lay.end // 64) * 64
        self.win = [torch.randint(0, 256, (2 * self.half,), generator=g, dtype=torch.uint8) for _ in range(R)]
        self.ctl = [torch.zeros(2 * R * W, dtype=torch.int64) for _ in range(R)]
        self.sig = [torch.zeros(2, R, dtype=torch.int64) for _ in range(R)]
        self.cnt = [torch.zeros(3, R, dtype=torch.int64) for _ in range(R)]

    def clone(self):
        other = copy.copy(self)
        for name in ("win", "ctl", "sig", "cnt"):
            setattr(other, name, [t.clone() for t in getattr(self, name)])
        return other

    def bases(self):
        return torch.tensor([w.data_ptr() for w in self.win], dtype=torch.int64)

    def stamps(self, h):
        return torch.tensor([c.data_ptr() + 8 * ((h * self.R + s) * W + 3) for s, c in enumerate(self.ctl)],
                            dtype=torch.int64)

    def stamp(self, h, value):
        for s in range(self.R):
            self.ctl[s][(h * self.R + s) * W + 3] = value

    def hdr_out(self, me, h):
        return torch.tensor([c.data_ptr() + 8 * (h * self.R + me) * W for c in self.ctl], dtype=torch.int64)

    def sig_out(self, me, h):
        return torch.tensor([s[h].data_ptr() + 8 * me for s in self.sig], dtype=torch.int64)

    def hdr_in(self, me, h):
        return self.ctl[me][h * self.R * W:(h + 1) * self.R * W].view(self.R, W)

    def order(self, me):
        return [(me + i) % self.R for i in range(1, self.R + 1)]

    def plan(self, me):
        lay = self.lay
        return native.LLPlan(
            num_ranks=self.R, num_local=lay.L, m=lay.M, hidden=lay.H, me=me, bases=self.bases().tolist(),
            order=self.order(me), recv_off=lay.recv_off, send_off=lay.send_off, pull_off=lay.pull_off, hdr_words=W,
            counters=[[self.cnt[me][f].data_ptr() + 8 * d for d in range(self.R)] for f in range(3)],
            halves=[(h * self.half, self.stamps(h).tolist(), self.hdr_out(me, h).tolist(),
                     self.sig_out(me, h).tolist(), self.sig[me][h].data_ptr(), self.hdr_in(me, h).data_ptr())
                    for h in (0, 1)])

    def count(self, me, sent, row_bytes, hdr_bytes):
        """What the step-by-step path records: per destination, the rows, the counts, the header, a signal."""
        for d in self.order(me):
            s = int(sent[d])
            self.cnt[me][0, d] += s * row_bytes + 4 * self.lay.L + hdr_bytes
            self.cnt[me][1, d] += (s > 0) + 2
            self.cnt[me][2, d] += 1


def header(seq, op, flags=0, word1=12345):
    return torch.tensor([seq << 16 | flags << 8 | op << 4, word1, 0], dtype=torch.int64)


def same(a: Ranks, b: Ranks):
    for name in ("win", "ctl", "sig", "cnt"):
        for r, (x, y) in enumerate(zip(getattr(a, name), getattr(b, name))):
            assert torch.equal(x, y), f"{name} of rank {r} differs"


def inputs(R, lay, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    xs, routes = [], []
    for _ in range(R):
        xs.append(random_rows(g, n, lay.H, specials=False))
        idx = torch.stack([torch.randperm(lay.E, generator=g)[:k] for _ in range(n)])
        idx[torch.rand(idx.shape, generator=g) < 0.2] = -1
        status, _, counts, slots = native.ll_route(idx, lay.E, lay.M)
        assert status == 0
        routes.append((counts, slots))
    return xs, routes


def outputs(lay, R, sw):
    L, rm = lay.L, R * lay.M
    return [torch.zeros(L, rm, 2 * lay.H if not sw else lay.H, dtype=torch.uint8),
            torch.zeros(L, sw, rm, dtype=torch.float32).transpose(1, 2) if sw else None,
            torch.zeros(L, rm, dtype=torch.int32), torch.zeros(L, dtype=torch.int32),
            torch.zeros(L, R, dtype=torch.int64)]


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("R, h, strided", [(2, 0, False), (3, 1, True)])
def test_dispatch_issue_and_finish_are_the_steps(fp8, R, h, strided):
    lay = Layout(8, 256, 4 * R, R)
    n, k, seq = 6, 3, 4 + h
    sw = lay.S if fp8 else 0
    mb = 16 + (lay.H + 4 * sw if fp8 else 2 * lay.H)
    xs, routes = inputs(R, lay, n, k, 10 * R + h + fp8)
    if strided:  # rows further apart than H
        xs = [torch.cat([x, x[:, :64]], 1)[:, :lay.H] for x in xs]
    fused, steps = Ranks(R, lay, 3), None
    fused.stamp(h, seq + 1)
    steps = fused.clone()
    hdr = header(seq, OP_DISPATCH, F_PULL)
    base = h * fused.half
    for me in range(R):  # issue, fused (timed on one rank: the same bytes)
        sent = torch.zeros(R, dtype=torch.int64)
        counts, slots = routes[me]
        plan = fused.plan(me)
        assert plan.dispatch_issue(h, slots, counts, sent, 2 if fp8 else 1, xs[me], False, False, mb,
                                   hdr.view(torch.uint8), seq + 1, timed=me == 0) == 0
        if me == 0:
            assert all(0 < t < 10**9 for t in plan.ns), plan.ns
    for me in range(R):  # issue, step by step (the engine's calls before the fused path)
        counts, slots = routes[me]
        send = steps.win[me][base + lay.send_off:base + lay.send_off + n * mb].view(n, mb)
        if fp8:
            assert native.ll_cast_messages(xs[me], send, False, False)
        else:
            send[:, 16:].copy_(xs[me].view(torch.uint8))
        sent = torch.zeros(R, dtype=torch.int64)
        assert native.ll_dispatch_send(slots, lay.M, lay.L, me, steps.bases(), None, base + lay.recv_off,
                                       base + me * lay.L * 4, counts, sent)
        assert native.ll_publish(torch.tensor(steps.order(me)), hdr, steps.hdr_out(me, h), steps.sig_out(me, h),
                                 seq + 1)
        steps.count(me, sent, mb + 4, 8 * hdr.numel())
    same(fused, steps)
    for me in range(R):  # finish, both ways
        out_f, out_s = outputs(lay, R, sw), outputs(lay, R, sw)
        plan = fused.plan(me)
        assert plan.dispatch_finish(h, seq, 10, mb, *out_f, (None, None, None), timed=True) == 0
        assert 0 < plan.ns[0] < 10**9, plan.ns
        assert native.ll_await(steps.sig[me][h].data_ptr(), R, None, seq + 1, 10, steps.hdr_in(me, h), me, seq,
                               OP_DISPATCH) == 1
        own = steps.win[me][base:]
        assert native.ll_dispatch_recv(own[:4 * R * lay.L].view(torch.int32).view(R, lay.L), None,
                                       own[lay.recv_off:lay.recv_off + 4 * lay.L * R * lay.M].view(torch.int32),
                                       steps.bases(), base + lay.send_off, steps.stamps(h), seq + 1, lay.M, mb,
                                       *out_s) == (0, [0, 0, 0])
        for a, b in zip(out_f, out_s):
            assert (a is None and b is None) or torch.equal(a, b)
        assert int(out_f[3].sum()) > 0
    same(fused, steps)


def test_dispatch_statuses():
    R, h, seq = 2, 1, 6
    lay = Layout(4, 128, 4, R)
    xs, routes = inputs(R, lay, 3, 2, 7)
    ranks = Ranks(R, lay, 1)
    ranks.stamp(h, seq + 1)
    mb = 16 + 2 * lay.H
    plans = [ranks.plan(me) for me in range(R)]
    counts, slots = routes[0]
    bad = slots.clone()
    bad[0, 0] = lay.E * lay.M
    before = ranks.clone()
    sent = torch.zeros(R, dtype=torch.int64)
    # a slot out of range: nothing written, not even the staging
    assert plans[0].dispatch_issue(h, bad, counts, sent, 1, xs[0], False, False, mb,
                                   header(seq, OP_DISPATCH).view(torch.uint8), seq + 1) == 1
    same(ranks, before)
    assert plans[0].dispatch_issue(h, slots, counts, sent, 1, xs[0], False, False, mb,
                                   header(seq, OP_DISPATCH).view(torch.uint8), seq + 1) == 0
    out = outputs(lay, R, 0)
    assert plans[1].dispatch_finish(h, seq, 50, mb, *out, (None, None, None)) == -1  # rank 1 has not issued
    assert not out[3].any()
    counts1, slots1 = routes[1]
    assert plans[1].dispatch_issue(h, slots1, counts1, sent, 1, xs[1], False, False, mb,
                                   header(seq, OP_DISPATCH, word1=999).view(torch.uint8), seq + 1) == 0
    assert plans[0].dispatch_finish(h, seq, 50, mb, *out, (None, None, None)) == -2  # the headers disagree
    assert not out[3].any()
    ranks.ctl[1][(h * R + 1) * W + 1] = 12345  # rank 1's header at rank 1 now agrees; so must rank 0's copy
    ranks.ctl[0][(h * R + 1) * W + 1] = 12345
    ranks.ctl[0][(h * R + 0) * W + 3] = 99  # rank 0's stamp (in its own ctl) moved: a third call in flight
    assert plans[1].dispatch_finish(h, seq, 50, mb, *out, (None, None, None)) == 3
    assert plans[1].bad[:2] == [0, 99]
    ranks.ctl[0][(h * R + 0) * W + 3] = seq + 1
    assert plans[1].dispatch_finish(h, seq, 0, mb, *out, (None, None, None)) == 0


@pytest.mark.parametrize("mode", ["none", "own", "pull"])
@pytest.mark.parametrize("R", [2, 3])
@pytest.mark.usefixtures("row_sum_loop")
def test_combine_issue_and_finish_are_the_steps(mode, R):
    lay = Layout(8, 256, 4 * R, R)
    L, M, H, h, seq, k = lay.L, lay.M, lay.H, 0, 8, 3
    g = torch.Generator().manual_seed(R + 10 * len(mode))
    # each rank's layout_range for every destination: random counts per (expert, destination), begins packed
    ranges = []
    for _ in range(R):
        c = torch.randint(0, M + 1, (L, R), generator=g)
        b = torch.cumsum(c, 1) - c
        ranges.append((b << 32) | c)
    fused = Ranks(R, lay, 5)
    fused.stamp(h, seq + 1)
    base = h * fused.half
    srcs = []
    for me in range(R):
        if mode == "pull":  # the experts wrote their rows into the send region (a zero-copy combine)
            rows = fused.win[me][base + lay.send_off:base + lay.send_off + L * R * M * 2 * H]
            rows.view(torch.bfloat16).copy_(random_rows(g, L * R * M, H, specials=False).view(-1))
            srcs.append(rows.view(torch.bfloat16).view(L, R * M, H))
        else:
            srcs.append(random_rows(g, L * R * M, H).view(L, R * M, H))
    steps = fused.clone()
    steps_srcs = [s if mode != "pull" else
                  steps.win[me][base + lay.send_off:base + lay.send_off + L * R * M * 2 * H]
                  .view(torch.bfloat16).view(L, R * M, H) for me, s in enumerate(srcs)]
    keep = {"none": 0, "own": 1, "pull": 2}[mode]
    hdr = header(seq, OP_COMBINE, F_PULL if mode == "pull" else 0)
    for me in range(R):
        sent = torch.zeros(R, dtype=torch.int64)
        assert fused.plan(me).combine_issue(h, ranges[me], srcs[me], keep, mode == "pull", sent,
                                            hdr.view(torch.uint8), seq + 1) == 0
    for me in range(R):
        if mode == "pull":
            steps.win[me][base + lay.pull_off:base + lay.pull_off + 8 * L * R] = ranges[me].view(-1).view(torch.uint8)
        sent = torch.zeros(R, dtype=torch.int64)
        assert native.ll_combine_send(ranges[me], steps_srcs[me], M, me, steps.bases(), None, base + lay.recv_off,
                                      base + me * L * 4, sent, keep=("none", "own", "all")[keep])
        assert native.ll_publish(torch.tensor(steps.order(me)), hdr, steps.hdr_out(me, h), steps.sig_out(me, h),
                                 seq + 1)
        steps.count(me, sent, 2 * H, 8 * hdr.numel())
    same(fused, steps)
    for me in range(R):
        # this rank's tokens select every row its peers return, in order (k slots a token, the last ones -1)
        expected = torch.stack([ranges[d][:, me] & 0xFFFFFFFF for d in range(R)]).view(-1).to(torch.int32)
        flat = [e * M + i for e in range(lay.E) for i in range(int(expected[e]))]
        n = -(-len(flat) // k)
        slots = torch.full((n * k,), -1, dtype=torch.int64)
        slots[:len(flat)] = torch.tensor(flat, dtype=torch.int64)
        slots = slots.view(n, k)
        w = torch.rand(n, k, generator=g)
        own, own_lr = (None, None) if mode == "none" else (srcs[me], ranges[me])
        begin = ranges[me].numpy()[:, me] >> 32  # the step-by-step kernel takes the begins themselves
        own_s = None if mode == "none" else steps_srcs[me]
        out_f, out_s = torch.zeros(n, H, dtype=torch.bfloat16), torch.zeros(n, H, dtype=torch.bfloat16)
        assert fused.plan(me).combine_finish(h, seq, 10, slots, w, expected, out_f, own, own_lr) == 0
        sources = None
        if mode != "none":
            sources = [None] * R
            sources[me] = (own_s, begin)
            if mode == "pull":
                for d in range(R):
                    if d != me:
                        sources[d] = (steps_srcs[d], ranges[d].numpy()[:, me] >> 32)
        rows = steps.win[me][base + lay.recv_off:base + lay.recv_off + lay.E * M * 2 * H].view(torch.bfloat16)
        sig = steps.win[me][base:base + 4 * R * L].view(torch.int32).view(R, L)
        assert native.ll_combine_recv(out_s, rows.view(lay.E * M, H), slots, w, sig, expected, None, M, sources) == ()
        assert torch.equal(out_f.view(torch.int16), out_s.view(torch.int16))
    same(fused, steps)


def test_combine_statuses():
    R, h, seq = 2, 0, 2
    lay = Layout(4, 128, 4, R)
    L, M, H = lay.L, lay.M, lay.H
    ranks = Ranks(R, lay, 2)
    ranks.stamp(h, seq + 1)
    plans = [ranks.plan(me) for me in range(R)]
    base = h * ranks.half
    lr = torch.tensor([[(0 << 32) | 1, (1 << 32) | 1]] * L, dtype=torch.int64)  # one row per expert per rank
    bad = lr.clone()
    bad[0, 0] = M + 1
    srcs = [ranks.win[me][base + lay.send_off:base + lay.send_off + L * R * M * 2 * H].view(torch.bfloat16)
            .view(L, R * M, H) for me in range(R)]
    for me, src in enumerate(srcs):  # the experts' rows, written in place (a zero-copy combine)
        src.copy_(random_rows(torch.Generator().manual_seed(me), L * R * M, H, specials=False).view(L, R * M, H))
    before = ranks.clone()
    sent = torch.zeros(R, dtype=torch.int64)
    hdr = header(seq, OP_COMBINE, F_PULL).view(torch.uint8)
    assert plans[0].combine_issue(h, bad, srcs[0], 2, True, sent, hdr, seq + 1) == 1  # a count above M
    same(ranks, before)
    for me in range(R):
        assert plans[me].combine_issue(h, lr, srcs[me], 2, True, sent, hdr, seq + 1) == 0
    slots = torch.tensor([[g * M for g in range(lay.E)]], dtype=torch.int64)  # one token, every expert's row 0
    w = torch.ones(1, lay.E)
    expected = torch.ones(lay.E, dtype=torch.int32)
    out = torch.zeros(1, H, dtype=torch.bfloat16)
    wrong = expected.clone()
    wrong[3] = 2
    assert plans[0].combine_finish(h, seq, 10, slots, w, wrong, out, srcs[0], lr) == 2
    assert plans[0].bad == [3, 1, 2] and not out.view(torch.int16).any()
    ranks.ctl[1][(h * R + 1) * W + 3] = 77  # rank 1's stamp moved while rank 0 read its rows
    assert plans[0].combine_finish(h, seq, 10, slots, w, expected, out, srcs[0], lr) == 3
    assert plans[0].bad[:2] == [1, 77]
    ranks.ctl[1][(h * R + 1) * W + 3] = seq + 1
    out.zero_()
    assert plans[0].combine_finish(h, seq, 10, slots, w, expected, out, srcs[0], lr) == 0
    want = sum(srcs[g // L][g % L, int(lr[g % L, 0] >> 32)].float() for g in range(lay.E)).to(torch.bfloat16)
    assert torch.equal(out[0], want)
    ranks.sig[1][h][0] = 0  # rank 0's signal at rank 1 not there yet: late
    assert plans[1].combine_finish(h, seq, 10, slots, w, expected, out, srcs[1], lr) == -1


def test_plan_refuses_bad_words():
    lay = Layout(4, 128, 4, 2)
    ranks = Ranks(2, lay, 0)
    good = dict(num_ranks=2, num_local=lay.L, m=4, hidden=128, me=0, bases=ranks.bases().tolist(), order=[1, 0],
                recv_off=lay.recv_off, send_off=lay.send_off, pull_off=lay.pull_off, hdr_words=W,
                counters=[[1, 2]] * 3, halves=[(0, [1, 2], [1, 2], [1, 2], 1, 1)] * 2)
    native.LLPlan(**good)
    for key, value, match in [("bases", [ranks.win[0].data_ptr(), 0], "bases must hold 2 nonzero"),
                              ("order", [1, 1], "order must list"), ("me", 2, "out of range"),
                              ("halves", [(0, [1, 2], [1, 2], [1, 2], 1, 1)], "2 halves"),
                              ("counters", [[1, 2], [0, 1], [1, 2]], "counters\\[1\\]"),
                              ("halves", [(0, [1, 2], [1, 2], [1, 2], 0, 1)] * 2, "own signal words")]:
        with pytest.raises(ValueError, match=match):
            native.LLPlan(**{**good, key: value})
    np.testing.assert_array_equal(native.LLPlan(**good).words[:5], [2, lay.L, 4, 128, 0])
