"""The normal-mode engine's native plan (``native.IntranodePlan``, ``csrc/intranode.c``): R simulated ranks whose
windows and signal words are plain arrays in this process, each with its own plan. What a rank's calls store and
read is checked against numpy doing the same by hand: signal values and counters, the polls' answers, the
exchange's vector, header and zeroed tail in the right half, the headers it gathers and its verdict on the shared
words, the staged pieces, the direct stores, the gathered rows and the combine's sums; and every refusal
(nothing written)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepep_ascend import native

pytestmark = pytest.mark.skipif(not native.intranode_available(), reason="native kernels not built")

HALF, HW, VEC_OFF, OUT_WORDS = 2048, 32, 256, 8
SLOTS = (0, 1, 2)  # READY, CONSUMED, XDATA as the engine numbers them
COLS = (0, 1, 2, 5)


class Ranks:
    """R ranks: a window of two halves (random bytes), signal words ``[slot, src]`` and signal counters per rank,
    and one plan each."""

    def __init__(self, R, seed=0):
        g = np.random.default_rng(seed)
        self.R = R
        self.win = [g.integers(0, 256, 2 * HALF, dtype=np.uint8) for _ in range(R)]
        self.sig = [np.zeros((len(SLOTS), R), dtype=np.int64) for _ in range(R)]
        self.cnt = [np.zeros(R, dtype=np.int64) for _ in range(R)]
        self.cnt_addr = [np.array([c.ctypes.data + 8 * d for d in range(R)], dtype=np.int64) for c in self.cnt]
        self.plans = [self.plan(me) for me in range(R)]

    def plan(self, me, **over):  # (me may name a rank outside R: the plan must refuse it)
        R = self.R
        slots = {slot: ([self.sig[d].ctypes.data + 8 * (slot * R + me % R) if d != me else 0 for d in range(R)],
                        self.sig[me % R].ctypes.data + 8 * slot * R) for slot in SLOTS}
        kw = dict(num_ranks=R, me=me, bases=[w.ctypes.data for w in self.win], half_bytes=HALF, header_words=HW,
                  vec_offset=VEC_OFF, slots=slots, ready=0, out_words=OUT_WORDS, cols=COLS)
        kw.update(over)
        return native.IntranodePlan(**kw)

    def half(self, p, staged):
        lo = (staged & 1) * HALF
        return self.win[p][lo:lo + HALF]

    def header(self, p, staged):
        return self.half(p, staged)[:8 * HW].view(np.int64)


def test_signal_stores_running_values_and_counts():
    R = 4
    ranks = Ranks(R)
    p1 = ranks.plans[1]
    p1.signal(1, None, ranks.cnt_addr[1].ctypes.data)  # every peer
    p1.signal(1, np.array([3, 0], dtype=np.int64), 0)  # two of them, not counted
    p1.signal(2, np.array([2], dtype=np.int64), ranks.cnt_addr[1].ctypes.data)
    expect = {(1, 0): 2, (1, 2): 1, (1, 3): 2, (2, 2): 1}
    got = {(slot, d): int(ranks.sig[d][slot, 1]) for slot in SLOTS for d in range(R) if ranks.sig[d][slot, 1]}
    assert got == expect
    assert ranks.cnt[1].tolist() == [1, 0, 2, 1]
    assert p1.sent[1].tolist() == [2, 0, 1, 2] and p1.sent[2].tolist() == [0, 0, 1, 0]
    before = [s.copy() for s in ranks.sig]
    for bad in ([1], [0, 4], [-1]):  # itself (no word there), out of range: nothing stored, not even to rank 0
        with pytest.raises(ValueError, match="destinations"):
            p1.signal(1, np.array(bad, dtype=np.int64), 0)
    assert all(np.array_equal(a, b) for a, b in zip(before, ranks.sig)) and p1.sent[1].tolist() == [2, 0, 1, 2]


def test_poll_answers_as_the_words_say():
    R = 3
    ranks = Ranks(R)
    p0 = ranks.plans[0]
    assert p0.poll(1, None, 0, 0)  # nothing needed
    assert not p0.poll(1, None, 1, 50)
    ranks.plans[2].signal(1, np.array([0], dtype=np.int64))
    assert p0.poll(1, np.array([2], dtype=np.int64), 1, 0) and not p0.poll(1, None, 1, 10)
    ranks.plans[1].signal(1, np.array([0], dtype=np.int64))
    assert p0.poll(1, None, 1, 0) and not p0.poll(1, None, 2, 10)
    p0.staged[:] = [5, 0, 1]  # need staged[s] + add: 1 from rank 1, 2 from rank 2
    assert not p0.poll(1, None, 1, 10, need_staged=True)
    ranks.plans[2].signal(1, np.array([0], dtype=np.int64))
    assert p0.poll(1, None, 1, 0, need_staged=True)


def _words(rng, call):
    w = rng.integers(-1000, 1000, HW).astype(np.int64)
    w[list(COLS)] = (7, call, 3, 11)
    return w


@pytest.mark.parametrize("R", [1, 2, 3])
def test_exchange_stores_publishes_gathers_and_agrees(R):
    rng = np.random.default_rng(R)
    ranks = Ranks(R, seed=R)
    staged = [int(s) for s in rng.integers(0, 5, R)]
    for p, plan in enumerate(ranks.plans):  # as after staged[p] chunks: each rank's READY words read them
        plan.staged[:] = staged
        plan.sent[0][:] = staged[p]
        for d in range(R):
            ranks.sig[d][0, p] = staged[p]
    vecs = [torch.randint(-9, 9, (3 + p,), dtype=torch.int32) for p in range(R)]
    headers = [_words(rng, 4) for _ in range(R)]
    headers[-1][3] = 99  # a word outside the shared columns: still agreeing
    results = []
    for p in range(R):
        plan = ranks.plans[p]
        plan.header[:] = headers[p]
        nwords = HW if p % 2 else 20  # with a message, or the first words only (zeros after)
        results.append(plan.exchange(nwords, vecs[p], ranks.cnt_addr[p].ctypes.data, 0))
        if nwords < HW:
            headers[p][nwords:] = 0
    # every rank but the last published before the last did: they ran out of polls; the last saw everyone
    assert [status for status, _ in results] == [-1] * (R - 1) + [0]
    for p in range(R):
        assert np.array_equal(ranks.header(p, staged[p]), headers[p])
        got_vec = ranks.half(p, staged[p])[VEC_OFF:VEC_OFF + 4 * vecs[p].numel()].view(np.int32)
        assert np.array_equal(got_vec, vecs[p].numpy())
        assert [int(ranks.sig[d][0, p]) for d in range(R) if d != p] == [staged[p] + 1] * (R - 1)
        assert ranks.cnt[p].tolist() == [int(d != p) for d in range(R)]
    expect = np.stack([h[:OUT_WORDS] for h in headers])
    assert np.array_equal(results[-1][1], expect)
    # the late ranks now find every READY: their exchange state is the poll's (staged + 1)
    assert all(ranks.plans[p].poll(0, None, 1, 0, need_staged=True) for p in range(R))


def test_exchange_says_when_a_shared_word_differs():
    R = 2
    ranks = Ranks(R, seed=5)
    rng = np.random.default_rng(5)
    h0, h1 = _words(rng, 9), _words(rng, 9)
    h1[5] += 1  # a shared column
    ranks.plans[1].header[:] = h1
    assert ranks.plans[1].exchange(HW, None, 0, 0)[0] == -1
    ranks.plans[0].header[:] = h0
    status, got = ranks.plans[0].exchange(HW, None, 0, 0)
    assert status == 1 and np.array_equal(got, np.stack([h0[:OUT_WORDS], h1[:OUT_WORDS]]))
    assert ranks.cnt[0].tolist() == [0, 0]  # no counters given


def test_exchange_refuses_what_does_not_fit_and_writes_nothing():
    ranks = Ranks(2)
    plan = ranks.plans[0]
    before = [w.copy() for w in ranks.win]
    for nwords, vec in ((0, None), (HW + 1, None), (4, torch.zeros((HALF - VEC_OFF) // 4 + 1, dtype=torch.int32)),
                        (4, torch.zeros(4, 2, dtype=torch.int32).t())):
        with pytest.raises(ValueError, match="do not fit"):
            plan.exchange(nwords, vec, 0, 0)
    assert all(np.array_equal(a, b) for a, b in zip(before, ranks.win)) and not ranks.sig[1].any()


@pytest.mark.parametrize("over", [dict(bases=[0, 1]), dict(me=2), dict(header_words=HALF // 8 + 1),
                                  dict(vec_offset=8 * HW - 8), dict(vec_offset=HALF + 8), dict(cols=(0, OUT_WORDS)),
                                  dict(out_words=HW + 1), dict(ready=5)])
def test_plan_refuses_bad_operands(over):
    ranks = Ranks(2)
    with pytest.raises(ValueError, match="IntranodePlan"):
        ranks.plan(**{"me": 0, **over})


def test_plan_refuses_a_slot_without_a_word_at_a_peer():
    ranks = Ranks(3)
    slots = {0: ([0, 0, 8], 8)}  # nothing at rank 1
    with pytest.raises(ValueError, match="slot 0"):
        native.IntranodePlan(num_ranks=3, me=0, bases=[w.ctypes.data for w in ranks.win], half_bytes=HALF,
                           header_words=HW, vec_offset=VEC_OFF, slots=slots, ready=0, out_words=OUT_WORDS, cols=COLS)


def _stage_chunks(ranks, rng, rows, xb, sb, k, offs):
    """Random staged chunks in each rank's current half (half 0): rows, scales, ids, weights and a random mask."""
    R = ranks.R
    chunks = []
    for p in range(R):
        half = ranks.half(p, 0)
        c = dict(x=rng.integers(0, 256, (rows[p], xb), dtype=np.uint8),
                 s=rng.integers(0, 256, (rows[p], sb), dtype=np.uint8),
                 idx=rng.integers(-1, 50, (rows[p], k)).astype(np.int64),
                 w=rng.standard_normal((rows[p], k)).astype(np.float32),
                 mask=rng.random((rows[p], R)) < 0.6)
        for f, o in zip(("x", "s", "idx", "w", "mask"), offs):
            b = c[f].astype(np.uint8) if f == "mask" else c[f]
            half[o:o + b.nbytes] = b.reshape(-1).view(np.uint8)
        chunks.append(c)
    return chunks


@pytest.mark.parametrize("with_x,k,sb,local", [(True, 3, 5, 0), (False, 3, 0, 0), (True, 0, 0, 0), (True, 4, 0, 16)])
def test_gather_lands_every_sources_rows_as_numpy_selects_them(with_x, k, sb, local):
    R, xb = 3, 24
    rng = np.random.default_rng(11 + k + sb)
    ranks = Ranks(R, seed=3)
    offs = [VEC_OFF + 64, VEC_OFF + 64 + 16 * 24, VEC_OFF + 800, VEC_OFF + 1100, VEC_OFF + 1300]
    rows, first = [6, 0, 9], 4
    chunks = _stage_chunks(ranks, rng, rows, xb, sb, k, offs)
    me = 1
    picked = [np.flatnonzero(c["mask"][:, me]) for c in chunks]
    total = sum(p.size for p in picked)
    n = total + 2
    at = [2, 2 + picked[0].size, 2 + picked[0].size]  # row 0, 1 left as they were
    x = torch.full((n, xb), 7, dtype=torch.uint8)
    s = torch.full((n, sb), 7, dtype=torch.uint8) if sb else None
    idx = torch.full((n, k), 7, dtype=torch.int64) if k else None
    w = torch.full((n, k), 7.0) if k else None
    src = torch.full((n,), 7, dtype=torch.int32)
    got = ranks.plans[me].gather(offs, rows, first, at, x if with_x else None, s, idx, w, src, (20, local))
    assert got == [p.size for p in picked]
    order = [(q, t) for q in range(R) for t in picked[q]]
    want_x = np.concatenate([np.full((2, xb), 7, np.uint8)] + [chunks[q]["x"][t][None] for q, t in order])
    assert np.array_equal(x.numpy(), want_x if with_x else np.full((n, xb), 7, np.uint8))
    if sb:
        assert np.array_equal(s.numpy()[2:], np.stack([chunks[q]["s"][t] for q, t in order]))
    if k:
        want_idx = np.stack([chunks[q]["idx"][t] for q, t in order])
        want_w = np.stack([chunks[q]["w"][t] for q, t in order])
        if local:  # ids [20, 36) become local ones, the others -1 with weight 0
            foreign = (want_idx < 20) | (want_idx >= 20 + local)
            want_idx = np.where(foreign, -1, want_idx - 20)
            want_w = np.where(foreign, np.float32(0), want_w)
            assert foreign.any() and not foreign.all()
        assert np.array_equal(idx.numpy()[2:], want_idx)
        assert np.array_equal(w.numpy()[2:].view(np.int32), want_w.view(np.int32))
    assert src.tolist() == [7, 7] + [first + int(t) for q, t in order]


def test_gather_refuses_rows_past_the_outputs_and_writes_nothing():
    R, xb = 2, 8
    rng = np.random.default_rng(4)
    ranks = Ranks(R, seed=4)
    offs = [VEC_OFF + 64, VEC_OFF + 400, VEC_OFF + 500, VEC_OFF + 700, VEC_OFF + 900]
    chunks = _stage_chunks(ranks, rng, [10, 10], xb, 0, 0, offs)
    routed = sum(int(c["mask"][:, 0].sum()) for c in chunks)
    x, src = torch.zeros(routed, xb, dtype=torch.uint8), torch.zeros(routed, dtype=torch.int32)
    for at in ([1, routed - int(chunks[1]["mask"][:, 0].sum()) + 1], [-1, 0]):
        with pytest.raises(ValueError, match="do not fit"):
            ranks.plans[0].gather(offs, [10, 10], 0, at, x, None, None, None, src)
    assert not x.any() and not src.any()
    with pytest.raises(ValueError, match="contiguous tensors"):  # a bf16 x, ids without weights
        ranks.plans[0].gather(offs, [10, 10], 0, [0, 0], x.view(torch.bfloat16), None, None, None, src)
    with pytest.raises(ValueError, match="contiguous tensors"):
        ranks.plans[0].gather(offs, [10, 10], 0, [0, 0], x, None, torch.zeros(routed, 2, dtype=torch.int64),
                              None, src)


def _bf16(g, shape):
    t = torch.randn(*shape, generator=g).bfloat16()
    t.view(-1)[::7] = -0.0  # signed zeros: the sum starts from +0.0, as DeepEP's
    return t


@pytest.mark.parametrize("bias_kind,wcols,ordered", [("none", 3, False), ("one", 0, False), ("pair", 2, False),
                                                     ("none", 2, True), ("pair", 0, True)])
def test_combine_sums_every_sources_rows_as_float32_in_rank_order(bias_kind, wcols, ordered):
    """Rank order, or with ``order`` each token's rows in ascending key (ties in rank order)."""
    R, me, H, N, lo, m = 3, 1, 16, 10, 3, 6
    g = torch.Generator().manual_seed(len(bias_kind) + wcols)
    ranks = Ranks(R, seed=9)
    offs = [VEC_OFF + 64, VEC_OFF + 1024]
    mask = torch.rand(N, R, generator=g) < 0.6
    tokens = [[t for t in range(m) if mask[lo + t, j]] for j in range(R)]
    rows = [_bf16(g, (len(tokens[j]), H)) for j in range(R)]
    if ordered:  # values whose float32 sum depends on the order: 2^25 + 1 - 2^25 is 0 one way, 1 the other
        values = torch.tensor([2.0 ** 25, -2.0 ** 25, 1.0, 3.0])
        rows = [values[torch.randint(0, 4, r.shape, generator=g)].bfloat16() for r in rows]
    weights = [torch.randn(len(tokens[j]), max(wcols, 1), generator=g)[:, :wcols] for j in range(R)]
    rows_at, ld, cap, w_at, w_ld = [0] * R, [0] * R, [0] * R, [0] * R, [0] * R
    own_x = torch.cat([_bf16(g, (2, H)), rows[me]])  # own rows after two others: given by address
    own_w = torch.cat([torch.randn(2, wcols, generator=g), weights[me]])
    rows_at[me], ld[me], cap[me] = own_x.data_ptr() + 2 * 2 * H, H, len(tokens[me])
    w_at[me], w_ld[me] = own_w.data_ptr() + 2 * 4 * wcols, wcols
    in_place = rows[2].clone()  # source 2's rows read in place; source 0's staged
    rows_at[2], ld[2], cap[2] = in_place.data_ptr(), H, len(tokens[2])
    for j in range(R):  # count vectors; the staged layout: the rows for the other origins, ascending, ours among them
        sizes = [len(tokens[j]) if s == me else (0 if s == j else 2 + s) for s in range(R)]
        half = ranks.half(j, 0)
        half[VEC_OFF:VEC_OFF + 4 * R] = np.array(sizes, dtype=np.int32).view(np.uint8)
        if j == me:
            continue
        staged = torch.cat([rows[j] if s == me else _bf16(g, (sizes[s], H)) for s in range(R) if s != j])
        w_staged = torch.cat([weights[j] if s == me else torch.randn(sizes[s], wcols, generator=g)
                              for s in range(R) if s != j])
        half[offs[0]:offs[0] + staged.numel() * 2] = staged.view(torch.uint8).reshape(-1).numpy()
        half[offs[1]:offs[1] + w_staged.numel() * 4] = w_staged.view(torch.uint8).reshape(-1).numpy()
    biases = [_bf16(g, (N, H)) for _ in range(2)]
    b0, b1 = {"none": (None, None), "one": (None, biases[1]), "pair": tuple(biases)}[bias_kind]
    out = torch.full((N, H), 3.0, dtype=torch.bfloat16)
    w_out = torch.full((N, wcols), 3.0) if wcols else None
    order = torch.rand(N, R, generator=g).argsort(1).contiguous() if ordered else None
    if ordered:
        order[lo, :2] = 0  # a tie: rank order between those two
    status, got, want = ranks.plans[me].combine(
        offs, lo, mask, rows_at, ld, cap, w_at, w_ld, None if b0 is None else b0[lo:lo + m],
        None if b1 is None else b1[lo:lo + m], out[lo:lo + m], None if w_out is None else w_out[lo:lo + m], order)
    assert (status, got, want) == (0, [len(t) for t in tokens], [len(t) for t in tokens])
    expect, expect_w = out.clone(), None if w_out is None else w_out.clone()
    for t in range(m):
        given = [b[lo + t].float() for b in (b0, b1) if b is not None]  # f32(b0) + f32(b1), a missing one +0.0
        acc = given[0] + given[1] if len(given) == 2 else (given[0] + 0.0 if given else torch.zeros(H))
        wacc = torch.zeros(wcols)
        sources = [j for j in range(R) if t in tokens[j]]
        for j in sorted(sources, key=lambda j: (int(order[lo + t, j]), j)) if ordered else sources:
            acc = acc + rows[j][tokens[j].index(t)].float()
        for j in sources:
            wacc = wacc + weights[j][tokens[j].index(t)]
        expect[lo + t] = acc.bfloat16()
        if w_out is not None:
            expect_w[lo + t] = wacc
    assert torch.equal(out.view(torch.int16), expect.view(torch.int16))
    assert w_out is None or torch.equal(w_out.view(torch.int32), expect_w.view(torch.int32))
    if ordered:  # the order mattered for some token: the rank-order sum differs
        plain = torch.full((N, H), 3.0, dtype=torch.bfloat16)
        ranks.plans[me].combine(offs, lo, mask, rows_at, ld, cap, w_at, w_ld, None if b0 is None else b0[lo:lo + m],
                                None if b1 is None else b1[lo:lo + m], plain[lo:lo + m], None)
        assert not torch.equal(plain.view(torch.int16), out.view(torch.int16))


def test_combine_refuses_counts_the_mask_does_not_route_and_writes_nothing():
    R, me, H, N = 2, 0, 8, 4
    ranks = Ranks(R, seed=2)
    mask = torch.tensor([[1, 1], [0, 1], [1, 0], [0, 1]], dtype=torch.bool)
    for j, count in ((0, 2), (1, 2)):  # rank 1 says 2 rows for this origin; its mask column routes 3
        ranks.half(j, 0)[VEC_OFF:VEC_OFF + 4 * R] = np.array([count, 0], dtype=np.int32).view(np.uint8)
    own = torch.ones(2, H, dtype=torch.bfloat16)
    out = torch.full((N, H), 5.0, dtype=torch.bfloat16)
    status, got, want = ranks.plans[me].combine([VEC_OFF + 64, VEC_OFF + 512], 0, mask, [own.data_ptr(), 0],
                                                [H, 0], [2, 0], [0, 0], [0, 0], None, None, out, None)
    assert (status, got[1], want[1]) == (2, 3, 2) and bool((out == 5.0).all())
    # counts that agree, but rank 1 claims more rows for lower origins than its half holds: refused
    R3, me3 = 3, 2
    ranks3 = Ranks(R3, seed=3)
    mask3 = torch.tensor([[1, 1, 0], [0, 1, 1]], dtype=torch.bool)
    own3 = torch.ones(1, H, dtype=torch.bfloat16)
    for j, sizes in ((0, [0, 0, 1]), (1, [HALF, 0, 2]), (2, [0, 0, 1])):
        ranks3.half(j, 0)[VEC_OFF:VEC_OFF + 4 * R3] = np.array(sizes, dtype=np.int32).view(np.uint8)
    out3 = torch.full((2, H), 5.0, dtype=torch.bfloat16)
    status, _, _ = ranks3.plans[me3].combine([VEC_OFF + 64, VEC_OFF + 512], 0, mask3, [0, 0, own3.data_ptr()],
                                             [0, 0, H], [0, 0, 1], [0, 0, 0], [0, 0, 0], None, None, out3, None)
    assert status == -2 - 1 and bool((out3 == 5.0).all())
    # rank 0's rows read in place, with fewer rows readable there than it returned: refused
    ranks3.half(1, 0)[VEC_OFF:VEC_OFF + 4 * R3] = np.array([0, 0, 2], dtype=np.int32).view(np.uint8)
    theirs = torch.ones(1, H, dtype=torch.bfloat16)
    status, _, _ = ranks3.plans[me3].combine([VEC_OFF + 64, VEC_OFF + 512], 0, mask3,
                                             [theirs.data_ptr(), 0, own3.data_ptr()], [H, 0, H], [0, 0, 1],
                                             [0, 0, 0], [0, 0, 0], None, None, out3, None)
    assert status == -2 - 0 and bool((out3 == 5.0).all())
    with pytest.raises(ValueError, match="IntranodePlan.combine"):  # a mask of another rank count
        ranks.plans[me].combine([0, 0], 0, mask[:, :1].contiguous(), [0, 0], [0, 0], [0, 0], [0, 0], [0, 0], None,
                                None, out, None)


def test_stage_copies_each_fields_rows_into_the_current_half():
    R, me = 2, 1
    ranks = Ranks(R, seed=6)
    plan = ranks.plans[me]
    plan.staged[me] = 3  # half 1
    g = torch.Generator().manual_seed(6)
    x = torch.randint(0, 256, (9, 40), generator=g, dtype=torch.uint8)[:, :24]  # rows 40 bytes apart
    idx = torch.randint(-1, 9, (9, 3), generator=g)
    mask = torch.rand(9, R, generator=g) < 0.5
    before0 = ranks.half(me, 0).copy()
    vec = np.array([7, -1], dtype=np.int32)
    plan.stage([(x, VEC_OFF + 64), (idx, VEC_OFF + 264), (mask, VEC_OFF + 464)], [(2, 4), (4, 4), (6, 9)], vec)
    rows = [2, 3, 6, 7, 8]  # the pieces' rows, one after the other (an empty piece adds none)
    half = ranks.half(me, 1)
    assert np.array_equal(half[VEC_OFF:VEC_OFF + 8].view(np.int32), vec)
    assert np.array_equal(half[VEC_OFF + 64:VEC_OFF + 64 + 5 * 24], x[rows].contiguous().numpy().reshape(-1))
    assert np.array_equal(half[VEC_OFF + 264:VEC_OFF + 264 + 5 * 24].view(np.int64), idx[rows].numpy().reshape(-1))
    assert np.array_equal(half[VEC_OFF + 464:VEC_OFF + 474].view(np.bool_), mask[rows].numpy().reshape(-1))
    assert np.array_equal(ranks.half(me, 0), before0)  # the other half untouched
    snapshot = half.copy()
    for fields, pieces in (([(x, VEC_OFF), (idx, HALF - 8)], [(0, 2)]),  # the second field passes the half
                           ([(x, VEC_OFF)], [(3, 2)])):  # a reversed piece
        with pytest.raises(ValueError, match="pass the half"):
            plan.stage(fields, pieces, vec)
    with pytest.raises(ValueError, match="int32"):
        plan.stage([(x, VEC_OFF)], [(0, 1)], vec.astype(np.int64))
    assert np.array_equal(ranks.half(me, 1), snapshot)


@pytest.mark.parametrize("offset", [64, 67])  # the staged rows 16-byte aligned or not
def test_stage_by_streaming_stores_writes_the_same_bytes(offset):
    """A combine's staging (``stream_side="send"``) with its rows stored by streaming stores against the same staging
    by memcpy, byte for byte: rows of 300 bytes (strided source, past the 256 bytes from which rows stream) and a
    field of 8-byte rows, with "always", and "large" at the rows' bytes (streams) and one byte above (plain); with
    ``stream_side=None`` the rows go plainly whatever the mode. A side that is not one is refused."""
    before = native.ll_stream_rows(side="send"), native.ll_stream_min_bytes(side="send")
    g = torch.Generator().manual_seed(offset)
    x = torch.randint(0, 256, (6, 312), generator=g, dtype=torch.uint8)[:, 5:305]
    w = torch.randint(0, 256, (6, 8), generator=g, dtype=torch.uint8)
    pieces = [(0, 2), (3, 6)]
    nbytes = 5 * (300 + 8)
    fields = [(x, VEC_OFF + offset), (w, VEC_OFF + offset + 5 * 300 + 1)]

    def stage(mode, min_bytes=None, side="send"):
        ranks = Ranks(2, seed=9)
        native.ll_stream_rows(mode, min_bytes, side="send")
        ranks.plans[1].stage(fields, pieces, np.array([5, 0], dtype=np.int32), stream_side=side)
        return ranks.win[1].copy()

    try:
        plain = stage("never")
        rows = [0, 1, 3, 4, 5]
        half = plain[:HALF]
        assert np.array_equal(half[VEC_OFF + offset:VEC_OFF + offset + 1500], x[rows].contiguous().numpy().reshape(-1))
        for mode, min_bytes, side in (("always", None, "send"), ("large", nbytes, "send"),
                                      ("large", nbytes + 1, "send"), ("always", None, None)):
            assert np.array_equal(stage(mode, min_bytes, side), plain), (mode, min_bytes, side)
        with pytest.raises(ValueError, match="stream_side must be None or one of receive, send, got 'sends'"):
            stage("always", side="sends")
    finally:
        native.ll_stream_rows(*before, side="send")


def test_store_puts_each_receivers_rows_at_its_address_in_order():
    R, n, xb = 3, 7, 16
    ranks = Ranks(R, seed=8)
    g = torch.Generator().manual_seed(8)
    x = torch.randint(0, 256, (n, xb), generator=g, dtype=torch.uint8)
    mask = torch.rand(n, R, generator=g) < 0.5
    mask[0, 2] = True  # rank 2 gets at least one row; rank 1 none
    mask[:, 1] = False
    want = mask.sum(0).tolist()
    outs = [torch.zeros(max(w, 1) + 1, xb, dtype=torch.uint8) for w in want]
    dst = [o.data_ptr() if w else 0 for o, w in zip(outs, want)]
    status, got = ranks.plans[0].store(x, mask, [1, 2, 0], dst, want)
    assert (status, got) == (0, want)
    for j in range(R):
        assert torch.equal(outs[j][:want[j]], x[mask[:, j]]) and not outs[j][want[j]:].any()
    fresh = [torch.zeros_like(o) for o in outs]
    wrong = [want[0], want[1], want[2] + 1]
    status, got = ranks.plans[0].store(x, mask, [1, 2, 0], [o.data_ptr() for o in fresh], wrong)
    assert (status, got[2]) == (3, want[2]) and not any(o.any() for o in fresh)
    with pytest.raises(ValueError, match="IntranodePlan.store"):
        ranks.plans[0].store(x.view(torch.int16), mask, [1, 2, 0], dst, want)
    for order in ([2, 2, 0], [1, 2], [0, 1, 3]):  # each rank once, or a rank would get its rows twice
        with pytest.raises(ValueError, match="each of the 3 ranks once"):
            ranks.plans[0].store(x, mask, order, [o.data_ptr() for o in fresh], want)
    assert not any(o.any() for o in fresh)


def test_store_kernel_stores_a_rank_listed_twice_once():
    """The C kernel itself (below the wrappers' permutation check): a rank repeated in ``order``, or one outside
    ``[0, R)``, is skipped, so a receiver's range gets its rows once and nothing past it."""
    from deepep_ascend.native.loader import kernels

    R, n, xb = 3, 5, 8
    g = torch.Generator().manual_seed(10)
    x = torch.randint(0, 256, (n, xb), generator=g, dtype=torch.uint8)
    mask = torch.ones(n, R, dtype=torch.bool)
    mask[1, 2] = False
    want = mask.sum(0).tolist()
    outs = [torch.zeros(w + n + 1, xb, dtype=torch.uint8) for w in want]  # room for rows stored twice: seen here
    ints = [np.array(v, dtype=np.int64) for v in ([0, 0, 7], [o.data_ptr() for o in outs], want, [0] * R)]
    assert kernels.in_store(n, R, x.data_ptr(), xb, xb, mask.data_ptr(), *(a.ctypes.data for a in ints)) == 0
    assert ints[3].tolist() == want
    assert torch.equal(outs[0][:want[0]], x[mask[:, 0]]) and not outs[0][want[0]:].any()
    assert not outs[1].any() and not outs[2].any()  # not listed: nothing stored


@pytest.mark.parametrize("R", [4, 70])  # 70: a node larger than any benchmark's
def test_store_reads_rows_of_a_strided_x_and_sends_each_to_all_its_receivers(R):
    n, xb = 33, 24
    ranks = Ranks(R, seed=9)
    g = torch.Generator().manual_seed(9)
    wide = torch.randint(0, 256, (n, xb + 8), generator=g, dtype=torch.uint8)
    x = wide[:, 3:3 + xb]  # row stride xb + 8
    mask = torch.rand(n, R, generator=g) < 0.6
    mask[5] = True  # a token for every rank
    want = mask.sum(0).tolist()
    outs = [torch.zeros(w + 1, xb, dtype=torch.uint8) for w in want]
    order = [(2 + 1 + i) % R for i in range(R)]
    status, got = ranks.plans[2].store(x, mask, order, [o.data_ptr() for o in outs], want)
    assert (status, got) == (0, want)
    for j in range(R):
        assert torch.equal(outs[j][:want[j]], x[mask[:, j]]) and not outs[j][want[j]:].any()


def test_vectors_gathers_every_ranks_count_vector_from_its_current_half():
    R = 3
    ranks = Ranks(R, seed=12)
    staged = [0, 1, 3]
    ranks.plans[0].staged[:] = staged
    want = np.arange(R * 5, dtype=np.int32).reshape(R, 5) - 4
    for p in range(R):
        ranks.half(p, staged[p])[VEC_OFF:VEC_OFF + 20] = want[p].view(np.uint8)
    assert np.array_equal(ranks.plans[0].vectors(5), want)
    with pytest.raises(ValueError, match="pass the half"):
        ranks.plans[0].vectors((HALF - VEC_OFF) // 4 + 1)


def _tail_operands(seed, R=3, me=1, n=8, xb=16, k=3, sb=4):
    """Ranks with staged chunks (half 0) and this rank's x and mask, the operands of a dispatch tail."""
    rng = np.random.default_rng(seed)
    ranks = Ranks(R, seed=seed)
    offs = [VEC_OFF + 64, VEC_OFF + 200, VEC_OFF + 300, VEC_OFF + 600, VEC_OFF + 900]
    ntok = [5, 0, 7][:R] + [3] * max(0, R - 3)
    chunks = _stage_chunks(ranks, rng, ntok, xb, sb, k, offs)
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (n, xb), generator=g, dtype=torch.uint8)
    mask = torch.rand(n, R, generator=g) < 0.5
    want = mask.sum(0).tolist()
    picked = [int(c["mask"][:, me].sum()) for c in chunks]
    rows = sum(picked) + 1  # one row left past the received ones
    at = [1 + sum(picked[:s]) for s in range(R)]  # row 0 left as it was
    return ranks, offs, ntok, x, mask, want, rows, at, picked


def _tail_outputs(rows, xb, k, sb, R, C, want):
    return dict(dst=[torch.zeros(max(w, 1), xb, dtype=torch.uint8) for w in want],
                s=torch.full((rows, sb), 7, dtype=torch.uint8), idx=torch.full((rows, k), 7, dtype=torch.int64),
                w=torch.full((rows, k), 7.0), src=torch.full((rows,), 7, dtype=torch.int32),
                rcp=torch.full((R, C), 7, dtype=torch.int32))


@pytest.mark.parametrize("ready", [True, False])
def test_dispatch_tail_is_the_steps_in_order(ready):
    """``dispatch_tail`` = store, XDATA, gather, CONSUMED, staged + 1, the channel prefix, the XDATA poll: the same
    bytes, signals, counters and staged counts as those steps one by one; -1 when a peer's XDATA is short."""
    R, me, xb, k, sb, C = 3, 1, 16, 3, 4, 2
    XD, CS = 2, 1
    results = []
    for fused in (False, True):
        ranks, offs, ntok, x, mask, want, rows, at, picked = _tail_operands(21)
        plan = ranks.plans[me]
        o = _tail_outputs(rows, xb, k, sb, R, C, want)
        dst = [o["dst"][j].data_ptr() if want[j] else 0 for j in range(R)]
        order = [(me + 1 + i) % R for i in range(R)]
        for p in range(R):  # every peer raised its XDATA for this call (or one is late)
            if p != me and (ready or p != 2):
                ranks.plans[p].signal(XD, np.array([me], dtype=np.int64))
        starts = at + [at[-1] + picked[-1]]
        cnt = ranks.cnt_addr[me].ctypes.data
        if fused:
            status, got, routed = plan.dispatch_tail(x, mask, order, dst, want, offs, ntok, list(at), o["s"], o["idx"],
                                                     o["w"], o["src"], (20, 16), starts, o["rcp"], XD, CS, 1, cnt, 0)
        else:
            status, routed = plan.store(x, mask, order, dst, want)
            plan.signal(XD, None, cnt)
            got = plan.gather(offs, ntok, 0, list(at), None, o["s"], o["idx"], o["w"], o["src"], (20, 16))
            plan.signal(CS, None, cnt)
            plan.staged += 1
            o["rcp"].copy_(native.recv_channel_prefix(o["src"], starts, ntok, C))
            status = 0 if plan.poll(XD, None, 1, 0) else -1
        assert (status, got, routed) == (0 if ready else -1, picked, want)
        results.append((o, [s.copy() for s in ranks.sig], ranks.cnt[me].copy(), plan.staged.copy()))
    (a, sig_a, cnt_a, staged_a), (b, sig_b, cnt_b, staged_b) = results
    for key in ("s", "idx", "w", "src", "rcp"):
        assert torch.equal(a[key], b[key]), key
    assert all(torch.equal(u, v) for u, v in zip(a["dst"], b["dst"]))
    assert all(np.array_equal(u, v) for u, v in zip(sig_a, sig_b)) and np.array_equal(cnt_a, cnt_b)
    assert staged_a.tolist() == staged_b.tolist() == [1] * R
    assert bool((b["src"][1:-1] >= 0).all()) and b["rcp"].ne(7).all()  # written, not left as they were


def test_dispatch_tail_refuses_before_anything_moves():
    R, me, xb, k, sb, C = 3, 1, 16, 3, 4, 2
    ranks, offs, ntok, x, mask, want, rows, at, picked = _tail_operands(22)
    plan = ranks.plans[me]
    o = _tail_outputs(rows, xb, k, sb, R, C, want)
    dst = [d.data_ptr() for d in o["dst"]]
    starts = at + [at[-1] + picked[-1]]
    sig = [s.copy() for s in ranks.sig]
    wrong = [want[0], want[1] + 1, want[2]]  # the mask routes another count to rank 1: nothing stored or raised
    status, _, routed = plan.dispatch_tail(x, mask, [2, 0, 1], dst, wrong, offs, ntok, list(at), o["s"], o["idx"],
                                           o["w"], o["src"], (0, 0), starts, o["rcp"], 2, 1, 1, 0, 0)
    assert (status, routed[1]) == (2, want[1])
    assert all(np.array_equal(u, v) for u, v in zip(sig, ranks.sig)) and not any(d.any() for d in o["dst"])
    assert bool((o["src"] == 7).all()) and plan.staged.tolist() == [0] * R
    short = [a - 1 if a > 1 else a for a in at]  # the last source's rows would pass the outputs: the gather refuses
    short[-1] = rows - picked[-1] + 1
    status, _, _ = plan.dispatch_tail(x, mask, [2, 0, 1], dst, want, offs, ntok, short, o["s"], o["idx"], o["w"],
                                      o["src"], (0, 0), starts, o["rcp"], 2, 1, 1, 0, 0)
    assert status == R + 1 and bool((o["src"] == 7).all()) and plan.staged.tolist() == [0] * R
    assert int(ranks.sig[0][2, me]) == 1 and int(ranks.sig[0][1, me]) == 0  # XDATA raised, CONSUMED not
    with pytest.raises(ValueError, match="dispatch_tail"):  # an rcp of another rank count
        plan.dispatch_tail(x, mask, [2, 0, 1], dst, want, offs, ntok, list(at), o["s"], o["idx"], o["w"], o["src"],
                           (0, 0), starts, o["rcp"][:2], 2, 1, 1, 0, 0)
    with pytest.raises(ValueError, match="dispatch_tail"):  # ids without weights
        plan.dispatch_tail(x, mask, [2, 0, 1], dst, want, offs, ntok, list(at), o["s"], o["idx"], None, o["src"],
                           (0, 0), starts, o["rcp"], 2, 1, 1, 0, 0)


@pytest.mark.parametrize("need", [0, 1, 2])
def test_combine_tail_sums_then_consumes_then_polls(need):
    """``combine(..., tail=)`` = the combine, CONSUMED at every peer, staged + 1, then (``need > 0``) the peers'
    CONSUMED polled: R + 1 when short (one peer raised it once here)."""
    R, me, H, N = 2, 0, 8, 3
    ranks = Ranks(R, seed=5)
    mask = torch.tensor([[1, 1], [0, 1], [1, 0]], dtype=torch.bool)
    theirs = torch.randn(2, H).bfloat16()
    ranks.half(1, 0)[VEC_OFF:VEC_OFF + 4 * R] = np.array([2, 0], dtype=np.int32).view(np.uint8)
    ranks.half(1, 0)[VEC_OFF + 64:VEC_OFF + 64 + theirs.numel() * 2] = theirs.view(torch.uint8).reshape(-1).numpy()
    ranks.half(0, 0)[VEC_OFF:VEC_OFF + 4 * R] = np.array([2, 0], dtype=np.int32).view(np.uint8)
    own = torch.randn(2, H).bfloat16()
    ranks.plans[1].signal(1, np.array([0], dtype=np.int64))  # the peer consumed once
    args = ([VEC_OFF + 64, VEC_OFF + 1024], 0, mask, [own.data_ptr(), 0], [H, 0], [2, 0], [0, 0], [0, 0], None, None)
    plain = torch.zeros(N, H, dtype=torch.bfloat16)
    assert ranks.plans[me].combine(*args, plain, None)[0] == 0
    out = torch.zeros(N, H, dtype=torch.bfloat16)
    status, got, _ = ranks.plans[me].combine(*args, out, None, None, (1, need, ranks.cnt_addr[me].ctypes.data, 0),
                                             timed=True)
    assert (status, got) == (R + 1 if need > 1 else 0, [2, 2]) and torch.equal(out, plain)
    assert int(ranks.sig[1][1, me]) == 1 and ranks.cnt[me].tolist() == [0, 1]  # CONSUMED raised at the peer, counted
    assert ranks.plans[me].staged.tolist() == [1, 1] and min(ranks.plans[me].ns[:3]) >= 0
    refused = torch.zeros(N, H, dtype=torch.bfloat16)  # counts the mask does not route: nothing signalled
    ranks.half(1, 0)[VEC_OFF:VEC_OFF + 4 * R] = np.array([1, 0], dtype=np.int32).view(np.uint8)
    ranks.plans[me].staged[:] = 0
    status, _, _ = ranks.plans[me].combine(*args, refused, None, None, (1, need, 0, 0))
    assert status == 2 and int(ranks.sig[1][1, me]) == 1 and ranks.plans[me].staged.tolist() == [0, 0]
