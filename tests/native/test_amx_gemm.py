"""The AMX grouped-GEMM kernel (``deepep_ascend.native.gemm_bf16_amx``, ``csrc/amx_gemm.c``) and the grouped
GEMMs that run on it.

The reference is the float64 product of the same bf16 values; the kernel may differ from it by what a
float32 accumulation of ``K`` products and one bf16 rounding can give (``_bound``), which any layout
mistake (a swapped K pair, a wrong tile, a lost tail row or column) exceeds by orders of magnitude.
Where the CPU has no AMX-BF16 (or the native kernels are disabled) the kernel tests skip and the grouped
GEMMs' oneDNN path is what ``test_grouped_gemm.py`` checks.
"""

from __future__ import annotations

import re

import pytest
import torch

import deepep_ascend as dg
from deepep_ascend import native
from deepep_ascend.gemm import packing
from deepep_ascend.gemm.operands import GroupedOperands
from deepep_ascend.mega_moe.experts import expert_gemm
from deepep_ascend.mega_moe.weights import untransformed

BF16 = torch.bfloat16
SENTINEL = -7.0
needs_amx = pytest.mark.skipif(not native.amx_bf16(), reason="no AMX-BF16 here (or DEEPEP_ASCEND_NATIVE=0): the "
                               "grouped GEMMs run on oneDNN")


def _within_bound(d: torch.Tensor, a: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``d`` is ``a @ w.T`` up to a float32 accumulation of ``K`` products (``K · 2^-24 · Σ|a·w|``)
    and one bf16 rounding (``2^-8`` relative), NaN and infinities where the float64 product has them."""
    ref = a.double() @ w.double().T
    acc = a.size(1) * 2.0**-24 * (a.double().abs() @ w.double().abs().T)
    d = d.double()
    same_special = torch.equal(torch.isnan(d), torch.isnan(ref)) and torch.equal(torch.isinf(d), torch.isinf(ref))
    fin = torch.isfinite(ref)
    return same_special and bool(((d - ref).abs()[fin] <= (2.0**-8 * ref.abs() + (1 + 2.0**-8) * acc)[fin]).all())


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(BF16)


@needs_amx
@pytest.mark.parametrize("m,n,k", [
    (1, 1, 1), (15, 17, 31), (16, 32, 32), (17, 48, 33), (33, 1000, 100), (130, 96, 1024),
    (200, 40, 4096),  # more rows than one L2 chunk of packed A holds at this K (96): three chunks
])
def test_gemm_matches_float64_within_the_accumulation_bound(m, n, k):
    a, w = _rand(m, k, seed=1), _rand(n, k, seed=2)
    out = torch.full((m, n), SENTINEL, dtype=BF16)
    assert native.gemm_bf16_amx(out, a, native.AmxWeight(w))
    assert _within_bound(out, a, w)
    assert out.dtype == BF16 and native.AmxWeight(w).shape == (n, k) and native.AmxWeight(w).size(1) == k


@needs_amx
@pytest.mark.parametrize("n,k,ldw", [(48, 96, 96), (48, 96, 101), (33, 70, 80), (16, 32, 32)])
def test_packed_weight_is_the_tile_layout(n, k, ldw):
    """``AmxWeight``'s bytes against the layout written out element by element: per 16-column block and
    32-deep K block, row ``r`` holds the pairs (2r, 2r + 1) of the 16 columns, zeros past N and K (full tiles
    are packed by gathers, the rest one element at a time: both kinds are here, with odd row strides)."""
    w = _rand(n, ldw, seed=80)[:, :k]
    got = native.AmxWeight(w).data.view(torch.int16)
    kb_n = (k + 31) // 32
    want = torch.zeros((n + 31) // 32 * 2 * kb_n * 512, dtype=torch.int16)
    bits = w.view(torch.int16)
    for nb in range(want.numel() // (kb_n * 512)):
        for kb in range(kb_n):
            for c in range(16):
                col = nb * 16 + c
                for e in range(min(32, k - kb * 32) if col < n else 0):
                    want[(nb * kb_n + kb) * 512 + (e >> 1) * 32 + 2 * c + (e & 1)] = bits[col, kb * 32 + e]
    assert torch.equal(got, want)


@needs_amx
def test_runs_write_their_rows_only_on_strided_operands():
    """Groups with gaps between them, one weight used twice, an empty run; ``a`` and ``out`` are column
    windows of wider tensors (row strides past their widths), and ``w`` is a transposed (column-major)
    view that the packing copies."""
    k, n, m = 96, 40, 70
    a_wide, out_wide = _rand(m, k + 24, seed=3), torch.full((m, n + 9), SENTINEL, dtype=BF16)
    a, out = a_wide[:, 8:8 + k], out_wide[:, 5:5 + n]
    ws = [_rand(n, k, seed=10 + g) for g in range(3)]
    packed = [native.AmxWeight(w) for w in ws[:2]] + [native.AmxWeight(ws[2].T.contiguous().T)]
    runs = [(2, 0, 17), (0, 20, 21), (1, 21, 21), (2, 32, 64), (0, 64, 70)]
    assert native.gemm_bf16_amx(out, a, packed, runs)
    written = torch.zeros(m, dtype=torch.bool)
    for g, s, e in runs:
        assert _within_bound(out[s:e], a[s:e], ws[g]), (g, s, e)
        written[s:e] = True
    assert bool((out[~written] == SENTINEL).all()), "rows outside the runs were written"
    assert bool((out_wide[:, :5] == SENTINEL).all()) and bool((out_wide[:, 5 + n:] == SENTINEL).all())


@needs_amx
def test_values_past_k_and_n_in_wider_tensors_are_never_read():
    """``a`` and ``w`` are windows of NaN-filled tensors with K and N off the tile sizes: a kernel that read a
    row past K (an unmasked tail) or a column past N would turn outputs into NaN."""
    m, n, k = 21, 37, 45
    a_wide = torch.full((m, k + 40), float("nan"), dtype=BF16)
    w_wide = torch.full((n + 30, k + 40), float("nan"), dtype=BF16)
    a, w = a_wide[:, 3:3 + k], w_wide[5:5 + n, 7:7 + k]
    a.copy_(_rand(m, k, seed=20))
    w.copy_(_rand(n, k, seed=21))
    out = torch.full((m, n), SENTINEL, dtype=BF16)
    assert native.gemm_bf16_amx(out, a, native.AmxWeight(w))
    assert not bool(torch.isnan(out).any()) and _within_bound(out, a, w)


@needs_amx
def test_threads_multiply_concurrently():
    """Tile configuration and the packed-row scratch are per thread: threads (which the GIL-free ctypes
    call lets overlap) each get their own product."""
    import threading

    k, n, m = 256, 64, 150
    ws = [_rand(n, k, seed=30 + i) for i in range(4)]
    a = [_rand(m + 7 * i, k, seed=40 + i) for i in range(4)]
    outs = [torch.empty(m + 7 * i, n, dtype=BF16) for i in range(4)]
    errors = []

    def work(i):
        try:
            w = native.AmxWeight(ws[i])
            for _ in range(10):
                native.gemm_bf16_amx(outs[i], a[i], w)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert all(_within_bound(outs[i], a[i], ws[i]) for i in range(4))


@needs_amx
def test_non_finite_values_propagate_as_in_float64():
    k, n = 64, 48
    a, w = _rand(20, k, seed=4), _rand(n, k, seed=5)
    a[3, 7] = float("nan")
    a[5, 0] = float("inf")  # +inf times weights of both signs: inf - inf = NaN in most columns
    a[9, 1:] = 0
    a[9, 0] = float("-inf")
    w[11, 2] = float("inf")
    out = torch.empty(20, n, dtype=BF16)
    assert native.gemm_bf16_amx(out, a, native.AmxWeight(w))
    assert _within_bound(out, a, w)
    assert bool(torch.isnan(out[3]).all()) and bool(torch.isinf(out[9, :11]).all())


@needs_amx
def test_bad_operands_raise_naming_them():
    a, w = _rand(8, 64), _rand(16, 64)
    pw = native.AmxWeight(w)
    out = torch.empty(8, 16, dtype=BF16)
    cases = [
        (lambda: native.AmxWeight(w.float()), "w must be a 2-D CPU bfloat16"),
        (lambda: native.AmxWeight(w[None]), "w must be a 2-D CPU bfloat16"),
        (lambda: native.gemm_bf16_amx(out, a, w), "must be an AmxWeight"),
        (lambda: native.gemm_bf16_amx(out, a.float(), pw), "a must be a CPU torch.bfloat16"),
        (lambda: native.gemm_bf16_amx(out, a[:, :32], pw), "a must be a CPU torch.bfloat16 matrix of 64"),
        (lambda: native.gemm_bf16_amx(out.t(), a, pw), "out must be"),
        (lambda: native.gemm_bf16_amx(out[:4], a, pw), "out has 4 rows, a 8"),
        (lambda: native.gemm_bf16_amx(out, a, [pw, native.AmxWeight(_rand(8, 64))], [(0, 0, 8)]),
         "every weight must be [16, 64]"),
        (lambda: native.gemm_bf16_amx(out, a, [pw], [(1, 0, 8)]), "runs must be a sequence of (g, s, e)"),
        (lambda: native.gemm_bf16_amx(out, a, [pw], [(0, 5, 4)]), "runs must be a sequence of (g, s, e)"),
        (lambda: native.gemm_bf16_amx(out, a, [pw], [(0, 0, 9)]), "runs must be a sequence of (g, s, e)"),
        (lambda: native.gemm_bf16_amx(out, a, [pw], [(0, True, 4)]), "runs must be a sequence of (g, s, e)"),
        (lambda: native.gemm_bf16_amx(out, a, []), "non-empty sequence"),
        (lambda: native.gemm_bf16_amx(out, a, pw, [(0, 0, 8)]), "non-empty sequence"),
        (lambda: native.gemm_bf16_amx(out, a, [pw], 5), "runs must be a sequence"),
        (lambda: native.gemm_bf16_amx(out, a, [pw], [(0, 0, 5), (0, 4, 8)]), "overlap"),
        (lambda: native.gemm_bf16_amx(out, a, [pw], [(0, 2.0, 4)]), "runs must be a sequence"),
        (lambda: native.gemm_bf16_amx(out, a, [pw], [(0, torch.tensor(False), torch.tensor(True))]),
         "runs must be a sequence"),
        (lambda: native.gemm_bf16_amx(torch.zeros(8, 16, dtype=BF16, requires_grad=True), a, pw), "requires grad"),
    ]
    with torch.inference_mode():
        inf_out = torch.empty(8, 16, dtype=BF16)
    cases.append((lambda: native.gemm_bf16_amx(inf_out, a, pw), "inference tensor"))
    same = torch.empty(8, 64, dtype=BF16)
    cases.append((lambda: native.gemm_bf16_amx(same[:, :16], same, native.AmxWeight(_rand(16, 64))),
                  "out overlaps a"))
    for call, words in cases:
        with pytest.raises(ValueError, match=re.escape(words)):
            call()


@pytest.fixture(params=["amx", "onednn"])
def packer(request, monkeypatch):
    """The kernel the grouped GEMMs pack their weights for, forced for one test (skipped where it does not run
    here), with the weight caches empty before and after."""
    if request.param == "amx" and not native.amx_bf16():
        pytest.skip("no AMX kernel here")
    if request.param == "onednn" and not packing.ONEDNN:
        pytest.skip("oneDNN packing unavailable")
    monkeypatch.setattr(packing, "PACKER", request.param)
    dg.clear_dequantized_weight_cache()
    yield request.param
    dg.clear_dequantized_weight_cache()


@pytest.fixture
def packs(monkeypatch):
    """A list that gets one item per weight group the grouped GEMMs pack (``packing._pack_one``)."""
    calls = []
    real_pack = packing._pack_one
    monkeypatch.setattr(packing, "_pack_one", lambda w, p: calls.append(1) or real_pack(w, p))
    return calls


def test_grouped_gemms_run_every_group_in_one_kernel_call(monkeypatch, packer):
    """The public m-grouped calls (contiguous nt/nn, masked, FP8) and MegaMoE's per-expert GEMM call the AMX
    kernel once for all their groups; with oneDNN packing (no AMX) they never call it. Both within the
    bound of the float64 reference, padding rows as the layout says."""
    calls = []
    real = native.gemm_bf16_amx

    def spy(out, a, w, runs=None):
        calls.append(1 if runs is None else len(runs))
        return real(out, a, w, runs)

    monkeypatch.setattr(native, "gemm_bf16_amx", spy)
    n, k, counts = 40, 128, (5, 0, 37, 19)
    g = len(counts)
    b = _rand(g, n, k, seed=6)
    a = _rand(sum(counts), k, seed=7)  # rows sorted by group, unpadded (MegaMoE's layout)
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + c)
    align = dg.get_mk_alignment_for_contiguous_layout()
    starts = [0]  # the psum layout: group i's rows start at an aligned row
    for c in counts[:-1]:
        starts.append(dg.align(starts[-1] + c, align))
    rows = dg.align(starts[-1] + counts[-1], align)
    a_pad = torch.zeros(rows, k, dtype=BF16)
    for i, (s, c) in enumerate(zip(starts, counts)):
        a_pad[s:s + c] = a[bounds[i]:bounds[i + 1]]
    ends_t = torch.tensor([s + c for s, c in zip(starts, counts)], dtype=torch.int32)
    for layout in ("nt", "nn"):
        d = torch.full((rows, n), SENTINEL, dtype=BF16)
        calls.clear()
        if layout == "nt":
            dg.m_grouped_bf16_gemm_nt_contiguous(a_pad, b, d, ends_t, use_psum_layout=True)
        else:
            dg.m_grouped_bf16_gemm_nn_contiguous(a_pad, b.transpose(1, 2).contiguous(), d, ends_t,
                                                 use_psum_layout=True)
        assert calls == ([3] if packer == "amx" else []), (layout, calls)
        for i, (s, c) in enumerate(zip(starts, counts)):
            assert _within_bound(d[s:s + c], a_pad[s:s + c], b[i]), (layout, i)
    # masked: one call over [G·Mmax] rows; rows past masked_m untouched
    mmax = max(counts)
    a_m = _rand(g, mmax, k, seed=8)
    d_m = torch.full((g, mmax, n), SENTINEL, dtype=BF16)
    calls.clear()
    dg.m_grouped_bf16_gemm_nt_masked(a_m, b, d_m, torch.tensor(counts, dtype=torch.int32), mmax)
    assert calls == ([3] if packer == "amx" else []), calls
    for i, c in enumerate(counts):
        assert _within_bound(d_m[i, :c], a_m[i, :c], b[i]) and bool((d_m[i, c:] == SENTINEL).all()), i
    # FP8 activations and weights: the weights dequantized once, the activations' rows up to masked_m
    # only (a decode batch fills few of the layout's rows), then one call
    bq = dg.per_block_cast_to_fp8(b.float(), True)
    aq = dg.per_token_cast_to_fp8(a_m.float(), True, 128, True)
    d_f = torch.full((g, mmax, n), SENTINEL, dtype=BF16)
    calls.clear()
    decoded = []
    real_rows = GroupedOperands.rows
    monkeypatch.setattr(GroupedOperands, "rows", lambda self, x, sf=None: decoded.append(x.size(0))
                        or real_rows(self, x, sf))
    dg.m_grouped_fp8_gemm_nt_masked(aq, bq, d_f, torch.tensor(counts, dtype=torch.int32), mmax)
    monkeypatch.setattr(GroupedOperands, "rows", real_rows)
    assert calls == ([3] if packer == "amx" else []), calls
    assert sum(decoded) == sum(counts), decoded
    a_deq = dg.per_token_cast_back(aq[0].view(-1, k), aq[1].view(-1, aq[1].size(-1)), 128, torch.bfloat16)
    w_deq = GroupedOperands(aq, bq, "fp8", "nt").weight_t(0)  # dequantized group 0, [K, N]
    assert _within_bound(d_f[0, :counts[0]], a_deq[:counts[0]], w_deq.T)
    # d without unit column stride: group by group (a fresh output each), still right
    d_t = torch.full((n, rows), SENTINEL, dtype=BF16).t()
    calls.clear()
    dg.m_grouped_bf16_gemm_nt_contiguous(a_pad, b, d_t, ends_t, use_psum_layout=True)
    assert calls == ([1, 1, 1] if packer == "amx" else []), calls
    assert _within_bound(d_t[starts[2]:starts[2] + counts[2]], a_pad[starts[2]:starts[2] + counts[2]], b[2])
    # MegaMoE's per-expert GEMM on rows sorted by expert
    calls.clear()
    out = expert_gemm("bf16", a, packing.pack_groups(b), bounds)
    assert calls == ([3] if packer == "amx" else []), calls
    for i in range(g):
        assert _within_bound(out[bounds[i]:bounds[i + 1]], a[bounds[i]:bounds[i + 1]], b[i]), i


@needs_amx
def test_runs_of_one_group_share_its_weight():
    """``packing.amx_runs`` passes each group's weight once, whatever order or repetition the runs have."""
    n, k = 24, 64
    b = _rand(3, n, k, seed=50)
    a = _rand(30, k, seed=51)
    packed = packing.pack_groups(b, "amx")
    runs = [(2, 0, 4), (2, 4, 9), (0, 9, 20), (1, 20, 22), (0, 22, 30)]
    d = torch.full((30, n), SENTINEL, dtype=BF16)
    assert packing.amx_runs(packed, d, lambda: a, runs)
    for g, s, e in runs:
        assert _within_bound(d[s:e], a[s:e], b[g]), (g, s, e)


@needs_amx
def test_runs_take_any_integers_in_any_order():
    import numpy as np

    n, k = 16, 32
    b = [native.AmxWeight(_rand(n, k, seed=60 + g)) for g in range(2)]
    a = _rand(10, k, seed=62)
    out = torch.full((10, n), SENTINEL, dtype=BF16)
    runs = [(np.int64(1), torch.tensor(6), 10), (0, np.int32(0), 6)]
    assert native.gemm_bf16_amx(out, a, b, runs)
    ref0 = torch.empty(6, n, dtype=BF16)
    native.gemm_bf16_amx(ref0, a[:6], b[0])
    assert torch.equal(out[:6], ref0)


def test_writes_into_d_are_in_place_writes_to_torch(packer):
    """A grouped GEMM's write into ``d`` is an in-place write as far as torch can tell, whichever kernel makes
    it: ``d``'s version counter moves (a weight cache keyed on it sees the new values; autograd refuses a
    tensor it saved), a leaf that requires grad and an inference tensor outside inference mode are refused
    as torch refuses them, and a ``d`` that requires grad gets its gradient through the write."""
    k = 64
    src, eye = _rand(k, k, seed=70), torch.eye(k).to(BF16)[None]
    x, y = _rand(128, k, seed=71), torch.empty(128, k, dtype=BF16)
    l64, l128 = torch.zeros(k, dtype=torch.int32), torch.zeros(128, dtype=torch.int32)
    w = torch.zeros(1, k, k, dtype=BF16)
    dg.m_grouped_bf16_gemm_nt_contiguous(x, w, y, l128)  # packs (and caches) w
    version = w._version
    dg.m_grouped_bf16_gemm_nt_contiguous(src, eye, w[0], l64)  # w[0] = src @ I
    assert w._version > version
    dg.m_grouped_bf16_gemm_nt_contiguous(x, w, y, l128)
    assert _within_bound(y, x, w[0]), "the packed copy of the old w was used"

    p = torch.ones(k, requires_grad=True)
    d = torch.zeros(k, k, dtype=BF16)
    loss = (d * p.to(BF16)).float().sum()
    dg.m_grouped_bf16_gemm_nt_contiguous(src, eye, d, l64)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        dg.m_grouped_bf16_gemm_nt_contiguous(src, eye, torch.zeros(k, k, dtype=BF16, requires_grad=True), l64)
    with torch.inference_mode():
        inf = torch.zeros(k, k, dtype=BF16)
    with pytest.raises(RuntimeError, match="[Ii]nference"):
        dg.m_grouped_bf16_gemm_nt_contiguous(src, eye, inf, l64)
    base = torch.zeros(k, k, dtype=BF16, requires_grad=True)
    d2 = base * 1  # not a leaf: the write is recorded, rows it replaced get no gradient from base
    dg.m_grouped_bf16_gemm_nt_contiguous(src, eye, d2, l64)
    d2.float().sum().backward()
    assert base.grad is not None and float(base.grad.abs().sum()) == 0.0


def test_more_packed_weights_than_64_stay_packed_and_are_counted_in_bytes(packer):
    """A model with more weight tensors than the 64 entries the caches used to hold (58 MoE layers of two
    weights each in DeepSeek-V3) packs each weight once: a second pass over 70 weights only hits. The caches
    count each entry by the bytes its packed copy holds (AMX tiles: N and K padded to 32; oneDNN: N x K bf16)."""
    g = torch.Generator().manual_seed(11)
    G, m, n, k = 2, 4, 40, 96
    a = torch.randn(G, m, k, generator=g).to(BF16)
    masked_m = torch.full((G,), m, dtype=torch.int32)
    ws = [torch.randn(G, n, k, generator=g).to(BF16) for _ in range(70)]
    for _round in range(2):
        for w in ws:
            d = torch.zeros(G, m, n, dtype=BF16)
            dg.m_grouped_bf16_gemm_nt_masked(a, w, d, masked_m, m)
        assert all(_within_bound(d[i], a[i], w[i]) for i in range(G))
    info = dg.dequantized_weight_cache_info()
    per = (-(-n // 32) * 32) * (-(-k // 32) * 32) * 2 if packer == "amx" else n * k * 2
    assert (info.hits, info.misses, info.evictions, info.entries) == (70, 70, 0, 70), info
    assert info.nbytes == 70 * G * per, (info.nbytes, per)


def test_weights_past_the_cache_budget(packs, packer):
    """Under a small budget: a bf16 weight whose packed copy would not fit multiplies with ``torch.matmul``
    (as with the caches off) instead of being packed again on every call; an FP8 weight's packed copy, keyed
    on its dequantized copy, goes with it when that is evicted, and both count as evictions; the budget's
    warning points at the caller's line, whichever call dequantizes or packs."""
    import warnings

    from deepep_ascend.gemm import weight_cache as wc

    g = torch.Generator().manual_seed(12)
    G, m, n, k = 2, 4, 64, 128
    a = torch.randn(G, m, k, generator=g).to(BF16)
    masked_m = torch.full((G,), m, dtype=torch.int32)
    b = torch.randn(G, n, k, generator=g).to(BF16)
    packed = packing.packed_nbytes(b)
    old_max = dg.dequantized_weight_cache_info().max_bytes
    try:
        dg.set_dequantized_weight_cache(max_bytes=packed - 1)
        wc._cache_warned = False
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                d = torch.zeros(G, m, n, dtype=BF16)
                dg.m_grouped_bf16_gemm_nt_masked(a, b, d, masked_m, m)
                assert all(_within_bound(d[i], a[i], b[i]) for i in range(G))
        assert packs == [] and dg.dequantized_weight_cache_info()[:5] == (0, 2, 0, 0, 0)  # two misses, no copy
        assert len(caught) == 1 and caught[0].filename == __file__ and "does not fit it" in str(caught[0].message)

        # FP8: dequantized copy (bf16 [G, n, k]) + its packed copy, then two bf16 weights: a packed copy (optional)
        # pushes out nothing, so b2's, which does not fit beside the other three, is not made
        dq = G * n * k * 2
        dg.set_dequantized_weight_cache(max_bytes=dq + 2 * packed)
        w8 = dg.per_block_cast_to_fp8(torch.randn(G, n, k, generator=g), True)
        a8 = dg.per_token_cast_to_fp8(a.float(), True, 128, True)
        dg.m_grouped_fp8_gemm_nt_masked(a8, w8, torch.zeros(G, m, n, dtype=BF16), masked_m, m)
        assert dg.dequantized_weight_cache_info()[3:5] == (2, dq + packed)
        b1, b2 = (torch.randn(G, n, k, generator=g).to(BF16) for _ in range(2))
        dg.m_grouped_bf16_gemm_nt_masked(a, b1, torch.zeros(G, m, n, dtype=BF16), masked_m, m)
        dg.m_grouped_bf16_gemm_nt_masked(a, b2, torch.zeros(G, m, n, dtype=BF16), masked_m, m)
        info = dg.dequantized_weight_cache_info()
        assert (info.evictions, info.entries, info.nbytes) == (0, 3, dq + 2 * packed), info
        assert [key[0] for key in wc._cache] == ["dequantize", "packed_weights", "packed_weights"]

        # room for one dequantized copy and nothing else: a second FP8 weight's dequantized copy (required)
        # pushes out w8's; neither is packed; the warning points at this file
        dg.clear_dequantized_weight_cache()
        dg.set_dequantized_weight_cache(max_bytes=2 * dq - 1)
        dg.m_grouped_fp8_gemm_nt_masked(a8, w8, torch.zeros(G, m, n, dtype=BF16), masked_m, m)
        w8b = dg.per_block_cast_to_fp8(torch.randn(G, n, k, generator=g), True)
        wc._cache_warned = False
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dg.m_grouped_fp8_gemm_nt_masked(a8, w8b, torch.zeros(G, m, n, dtype=BF16), masked_m, m)
        info = dg.dequantized_weight_cache_info()
        assert (info.evictions, info.entries, info.nbytes) == (1, 1, dq), info
        assert len(caught) == 1 and caught[0].filename == __file__, [(w.filename, str(w.message)) for w in caught]
        assert "dropped to make room" in str(caught[0].message)

        # room for the dequantized copy but not for it and its packed copy: the dequantized copy stays cached
        # (hits from the second call) and the products take torch.matmul, not a packing per call
        dg.clear_dequantized_weight_cache()
        dg.set_dequantized_weight_cache(max_bytes=dq + packed - 1)
        packs.clear()
        for _ in range(3):
            d = torch.zeros(G, m, n, dtype=BF16)
            dg.m_grouped_fp8_gemm_nt_masked(a8, w8, d, masked_m, m)
        info = dg.dequantized_weight_cache_info()
        assert packs == [] and (info.hits, info.evictions, info.entries, info.nbytes) == (2, 0, 1, dq), info

        dg.set_dequantized_weight_cache(max_bytes=dq - 1)  # the dequantized copy itself does not fit
        wc._cache_warned = False
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            d = torch.zeros(G, m, n, dtype=BF16)
            dg.m_grouped_fp8_gemm_nt_masked(a8, w8, d, masked_m, m)
        assert len(caught) == 1 and caught[0].filename == __file__ and "does not fit it" in str(caught[0].message)
        ref = dg.dequantize_weights(w8[0], w8[1], 128, 128, cache=False)
        assert all(_within_bound(d[i], dg.per_token_cast_back(a8[0][i], a8[1][i]).to(BF16), ref[i])
                   for i in range(G))
    finally:
        dg.set_dequantized_weight_cache(True, max_bytes=old_max)


def test_weight_cache_survives_finalizers_run_by_garbage_collection(packer):
    """Key tensors that die in a garbage-collection cycle run their finalizers on whatever thread collects,
    possibly inside the caches' own critical sections (found by a helper: "OrderedDict mutated during
    iteration" from a GEMM call): they are queued and handled when the section ends. The bytes stay the sum
    of the entries, and an FP8 weight's packed copy that goes with its evicted dequantized copy counts as an
    eviction even when that copy dies later, in a cycle."""
    import gc

    from deepep_ascend.gemm import weight_cache as wc

    G, n, k, m = 2, 32, 64, 4
    g = torch.Generator().manual_seed(13)
    a = torch.randn(G, m, k, generator=g).to(BF16)
    masked_m = torch.full((G,), m, dtype=torch.int32)

    def gemm(b):
        dg.m_grouped_bf16_gemm_nt_masked(a, b, torch.zeros(G, m, n, dtype=BF16), masked_m, m)

    class Box:
        pass

    keep = [torch.randn(G, n, k, generator=g).to(BF16) for _ in range(4)]
    old_max = dg.dequantized_weight_cache_info().max_bytes
    try:
        for threshold in range(1, 120):
            dg.clear_dequantized_weight_cache()
            for b in keep:
                gemm(b)
            bx = torch.randn(G, n, k, generator=g).to(BF16)
            gemm(bx)
            new = torch.randn(G, n, k, generator=g).to(BF16)
            gc.disable()
            gc.collect(0)
            box = Box()
            box.self, box.t = box, bx
            del bx, box
            gc.set_threshold(threshold)
            gc.enable()
            try:
                gemm(new)
            finally:
                gc.set_threshold(700)
            info = dg.dequantized_weight_cache_info()
            assert info.nbytes == sum(e.nbytes for e in wc._cache.values()), (threshold, info)

        dg.clear_dequantized_weight_cache()
        n, k = 64, 128
        a = torch.randn(G, m, k, generator=g).to(BF16)
        a8 = dg.per_token_cast_to_fp8(a.float(), True, 128, True)
        w8 = dg.per_block_cast_to_fp8(torch.randn(G, n, k, generator=g), True)
        dq = G * n * k * 2
        dg.set_dequantized_weight_cache(max_bytes=2 * dq - 1)
        held = dg.dequantize_weights(w8[0], w8[1], 128, 128)  # the caller holds the dequantized copy
        dg.m_grouped_fp8_gemm_nt_masked(a8, w8, torch.zeros(G, m, n, dtype=BF16), masked_m, m)  # no room to pack
        w8b = dg.per_block_cast_to_fp8(torch.randn(G, n, k, generator=g), True)
        wc._cache_warned = False
        with pytest.warns(RuntimeWarning, match="dropped to make room"):
            dg.dequantize_weights(w8b[0], w8b[1], 128, 128)  # pushes out w8's dequantized copy (still held)
        assert dg.dequantized_weight_cache_info()[2:5] == (1, 1, dq)
        cycle = {"held": held}
        cycle["self"] = cycle
        del held, cycle
        gc.collect()  # w8's evicted dequantized copy dies in a cycle: nothing else goes, nothing is miscounted
        info = dg.dequantized_weight_cache_info()
        assert (info.evictions, info.entries, info.nbytes) == (1, 1, dq), info
    finally:
        gc.enable()
        dg.set_dequantized_weight_cache(True, max_bytes=old_max)


def test_fp8_weights_made_in_inference_mode_are_not_packed_per_call(packs, packer):
    """FP8 weights made under ``torch.inference_mode()`` have no version counter, so their dequantized copy is
    not cached; a packed copy keyed on it would be rebuilt and thrown away on every call, pushing out other
    weights' packed copies on the way (found by a helper): such weights multiply with ``torch.matmul``."""
    g = torch.Generator().manual_seed(14)
    G, m, n, k = 2, 4, 64, 128
    a = torch.randn(G, m, k, generator=g)
    masked_m = torch.full((G,), m, dtype=torch.int32)
    b1 = torch.randn(G, n, k, generator=g).to(BF16)
    dg.m_grouped_bf16_gemm_nt_masked(a.to(BF16), b1, torch.zeros(G, m, n, dtype=BF16), masked_m, m)
    before = dg.dequantized_weight_cache_info()
    with torch.inference_mode():
        w8 = dg.per_block_cast_to_fp8(torch.randn(G, n, k, generator=g), True)
    a8 = dg.per_token_cast_to_fp8(a, True, 128, True)
    packs.clear()
    for _ in range(2):
        d = torch.zeros(G, m, n, dtype=BF16)
        dg.m_grouped_fp8_gemm_nt_masked(a8, w8, d, masked_m, m)
    ref = dg.dequantize_weights(w8[0], w8[1], 128, 128, cache=False)
    assert all(_within_bound(d[i], dg.per_token_cast_back(a8[0][i], a8[1][i]).to(BF16), ref[i]) for i in range(G))
    after = dg.dequantized_weight_cache_info()
    assert packs == [] and after[2:5] == before[2:5], (before, after)  # b1's packed copy still cached


def test_weights_taking_turns_under_a_small_budget_are_not_repacked_every_call(packs, packer):
    """Weights used in turn under a budget that cannot hold all their copies (found by a helper): two FP8
    weights whose dequantized copies fit but not their packed copies keep the dequantized copies (hits, no
    packing), and two bf16 weights whose packed copies do not both fit pack once, not on every call (a packed
    copy pushes nothing out). A first call under ``torch.inference_mode()`` does not leave an inference
    tensor in the cache for later calls outside it."""
    from deepep_ascend.gemm import weight_cache as wc

    g = torch.Generator().manual_seed(15)
    G, m, n, k = 2, 4, 64, 128
    a = torch.randn(G, m, k, generator=g)
    a8 = dg.per_token_cast_to_fp8(a, True, 128, True)
    masked_m = torch.full((G,), m, dtype=torch.int32)
    dq = G * n * k * 2
    packed = packing.packed_nbytes(torch.empty(G, n, k, dtype=BF16))
    old_max = dg.dequantized_weight_cache_info().max_bytes
    try:
        w8 = [dg.per_block_cast_to_fp8(torch.randn(G, n, k, generator=g), True) for _ in range(2)]
        dg.set_dequantized_weight_cache(max_bytes=2 * dq + packed - 1)
        for i in range(6):
            dg.m_grouped_fp8_gemm_nt_masked(a8, w8[i % 2], torch.zeros(G, m, n, dtype=BF16), masked_m, m)
        info = dg.dequantized_weight_cache_info()
        # w8[0]'s packed copy, made before w8[1] came, is pushed out by w8[1]'s dequantized copy
        assert (info.evictions, info.entries, info.nbytes) == (1, 2, 2 * dq), info
        assert info.hits == 4 and len(packs) == G, (info, packs)

        dg.clear_dequantized_weight_cache()
        packs.clear()
        b = [torch.randn(G, n, k, generator=g).to(BF16) for _ in range(2)]
        dg.set_dequantized_weight_cache(max_bytes=packed * 3 // 2)
        for i in range(6):
            d = torch.zeros(G, m, n, dtype=BF16)
            dg.m_grouped_bf16_gemm_nt_masked(a.to(BF16), b[i % 2], d, masked_m, m)
            assert all(_within_bound(d[j], a[j].to(BF16), b[i % 2][j]) for j in range(G))
        info = dg.dequantized_weight_cache_info()
        assert len(packs) == G and (info.hits, info.evictions, info.entries) == (2, 0, 1), (info, packs)

        dg.clear_dequantized_weight_cache()
        dg.set_dequantized_weight_cache(max_bytes=old_max)
        with torch.inference_mode():
            dg.dequantize_weights(w8[0][0], w8[0][1], 128, 128)
            dg.m_grouped_bf16_gemm_nt_masked(a.to(BF16), b[0], torch.zeros(G, m, n, dtype=BF16), masked_m, m)
        (lazy,) = [e.value for key, e in wc._cache.items() if key[0] == "packed_weights"]
        assert not any((p if isinstance(p, torch.Tensor) else p.data).is_inference() for p in lazy.groups)
        deq = dg.dequantize_weights(w8[0][0], w8[0][1], 128, 128)
        assert not deq.is_inference()
        x = torch.randn(3, k, dtype=BF16, requires_grad=True)
        (x @ deq[0].t()).float().sum().backward()
        assert x.grad is not None
    finally:
        dg.set_dequantized_weight_cache(True, max_bytes=old_max)
        dg.clear_dequantized_weight_cache()


# ----------------------------------------------------------------------------------------------
# MXFP4 weights decoded inside the kernel (native.AmxFp4Weight)

_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # docs/semantics/mega-moe.md: codes 0..7, bit 3 the sign


def _fp4_values(data: torch.Tensor, exps: torch.Tensor, k: int) -> torch.Tensor:
    """bf16 ``[..., N, K]`` of packed e2m1 codes ``data [..., N, K/2]`` (element 2i in the low nibble) times
    ``2**(exps - 127)`` per 32 K values, from the table above in float64 ("-0" as +0, as the dequantization)."""
    table = torch.tensor(_E2M1 + (0.0,) + tuple(-v for v in _E2M1[1:]), dtype=torch.float64)
    b = data.view(torch.uint8).long()
    codes = torch.stack([b & 15, b >> 4], -1).flatten(-2)
    return (table[codes] * torch.pow(2.0, exps.double() - 127).repeat_interleave(32, -1)[..., :k]).to(BF16)


def _fp4_operands(n, k, seed, lo=118, hi=136, groups=None):
    gen = torch.Generator().manual_seed(seed)
    shape = (n,) if groups is None else (groups, n)
    data = torch.randint(-128, 128, shape + (k // 2,), generator=gen, dtype=torch.int8)
    exps = torch.randint(lo, hi, shape + ((k + 31) // 32,), generator=gen, dtype=torch.uint8)
    return data, exps


def _same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    return x.shape == y.shape and torch.equal(x.view(torch.int16), y.view(torch.int16))


@needs_amx
@pytest.mark.parametrize("m,n,k", [(1, 16, 32), (17, 33, 62), (40, 48, 96), (33, 1000, 160), (130, 96, 1024),
                                   (200, 40, 4096)])  # the last: three L2 chunks of packed rows
def test_fp4_weights_multiply_as_their_bf16_values_bit_for_bit(m, n, k):
    """An ``AmxFp4Weight`` gives the bits :class:`AmxWeight` gives on the weight's bf16 values (the decoder
    writes the same tiles), within the float64 bound; N and K tails (33, 62, 1000) are padded with zeros."""
    data, exps = _fp4_operands(n, k, seed=90)
    w = _fp4_values(data, exps, k)
    a = _rand(m, k, seed=91)
    got, want = (torch.full((m, n), SENTINEL, dtype=BF16) for _ in range(2))
    fp4 = native.AmxFp4Weight(data, exps)
    assert native.gemm_bf16_amx(got, a, fp4) and native.gemm_bf16_amx(want, a, native.AmxWeight(w))
    assert _same_bits(got, want) and _within_bound(got, a, w)
    assert fp4.shape == (n, k) and fp4.nbytes == native.amx_fp4_packed_nbytes(n, k) < native.amx_packed_nbytes(n, k) / 3


@needs_amx
def test_fp4_decode_is_exact_over_every_code_and_the_exponent_range():
    """Multiplying by the identity gives the decoded weight itself: every byte value (both nibbles: all 16
    codes, "-0" included) at the ends of the exponent range (2: the smallest normal 2**-126 from 0.5; 252:
    6 * 2**125) and around 127, row-strided operands."""
    n, k = 32, 256
    gen = torch.Generator().manual_seed(92)
    data = torch.arange(256, dtype=torch.int32).repeat(n * k // 2 // 256)[torch.randperm(n * k // 2, generator=gen)]
    data = data.to(torch.uint8).view(n, k // 2)
    exps = torch.tensor([2, 3, 126, 127, 128, 251, 252], dtype=torch.uint8)[
        torch.randint(0, 7, (n, k // 32), generator=gen)]
    wide = torch.zeros(n, k // 2 + 5, dtype=torch.uint8)
    wide[:, :k // 2] = data
    out = torch.full((k, n), SENTINEL, dtype=BF16)
    assert native.gemm_bf16_amx(out, torch.eye(k, dtype=BF16), native.AmxFp4Weight(wide[:, :k // 2], exps))
    assert _same_bits(out.t().contiguous(), _fp4_values(data, exps, k))


@needs_amx
def test_fp4_weight_bad_operands_raise_naming_them():
    data, exps = _fp4_operands(16, 64, seed=93)
    for bad in (1, 253):
        e = exps.clone()
        e[3, 1] = bad
        with pytest.raises(ValueError, match=r"exponent must be in \[2, 252\]"):
            native.AmxFp4Weight(data, e)
    with pytest.raises(ValueError, match="data must be a 2-D CPU int8/uint8"):
        native.AmxFp4Weight(data.float(), exps)
    with pytest.raises(ValueError, match=r"exponents must be a CPU uint8 \[16, 2\]"):
        native.AmxFp4Weight(data, exps[:, :1])
    out = torch.empty(4, 16, dtype=BF16)
    mixed = [native.AmxFp4Weight(data, exps), native.AmxWeight(_fp4_values(data, exps, 64))]
    with pytest.raises(ValueError, match="all of one kind"):
        native.gemm_bf16_amx(out, _rand(4, 64), mixed, [(0, 0, 2), (1, 2, 4)])


def _fp4_grouped_case(g=3, n=48, k=256, counts=(5, 0, 37)):
    """FP8 rows ``a`` and MXFP4 weights ``b`` of DeepGEMM's contiguous layout (psum ends), with the bf16
    values both stand for."""
    b_bf = torch.randn(g, n, k, generator=torch.Generator().manual_seed(94))
    data, sf = dg.per_token_cast_to_fp4(b_bf, use_ue8m0=True, gran_k=32, use_packed_ue8m0=True)
    w = _fp4_values(data, sf.view(torch.uint8), k)  # packed UE8M0: byte j of word c is group 4c + j
    align = dg.get_mk_alignment_for_contiguous_layout()
    starts = [0]
    for c in counts[:-1]:
        starts.append(dg.align(starts[-1] + c, align))
    rows = dg.align(starts[-1] + counts[-1], align)
    a = dg.per_token_cast_to_fp8(_rand(rows, k, seed=95).float(), True, 32, True)
    a_bf = dg.per_token_cast_back(a[0], a[1], 32, BF16)
    ends = torch.tensor([s + c for s, c in zip(starts, counts)], dtype=torch.int32)
    return a, (data, sf), a_bf, w, ends


@needs_amx
def test_grouped_fp8_fp4_gemm_keeps_fp4_weights_as_fp4(monkeypatch, packer):
    """``m_grouped_fp8_fp4_gemm_nt_contiguous`` with MXFP4 weights caches their FP4 copy (a quarter of the
    packed bf16 copy's bytes; no dequantized weight is made) and multiplies on it, giving the bits of the bf16
    GEMM on the weights' values. A scale the decoder cannot take (exponent 1: values below bf16's normal range)
    sends the weights the bf16 way (dequantized, packed), with that GEMM's bits; the refusal is remembered, so
    the next call hits the cache without scanning the scales again."""
    if packer != "amx":
        pytest.skip("the FP4 copy is for the AMX kernel")
    kinds = []
    real = native.gemm_bf16_amx
    monkeypatch.setattr(native, "gemm_bf16_amx",
                        lambda out, a, w, runs=None: kinds.append(type(w[0]).__name__) or real(out, a, w, runs))
    scans = []
    real_exps = packing._fp4_exponents
    monkeypatch.setattr(packing, "_fp4_exponents", lambda *args: scans.append(1) or real_exps(*args))
    a, b, a_bf, w, ends = _fp4_grouped_case()
    g, n, k = w.shape
    data, sf = b[0], b[1].clone()
    sf.view(torch.uint8)[1, 2, 0] = 1  # group 1, column 2, K 0..31: scale 2**-126
    fp4_bytes, bf16_bytes = g * native.amx_fp4_packed_nbytes(n, k), g * native.amx_packed_nbytes(n, k)
    assert 3 * fp4_bytes < bf16_bytes
    for weights, kind, cached in ((b, "AmxFp4Weight", fp4_bytes),
                                  ((data, sf), "AmxWeight", g * n * k * 2 + bf16_bytes)):
        want = torch.zeros(a_bf.size(0), n, dtype=BF16)
        dg.m_grouped_bf16_gemm_nt_contiguous(a_bf, _fp4_values(weights[0], weights[1].view(torch.uint8), k), want,
                                             ends, use_psum_layout=True)
        dg.clear_dequantized_weight_cache()
        kinds.clear()
        scans.clear()
        for _ in range(2):
            got = torch.full_like(want, SENTINEL)
            dg.m_grouped_fp8_fp4_gemm_nt_contiguous(a, weights, got, ends, use_psum_layout=True)
            assert _same_bits(got, want), kind
        info = dg.dequantized_weight_cache_info()
        assert kinds == [kind] * 2 and scans == [1] and info.nbytes == cached and info.evictions == 0, (kinds, info)


@needs_amx
def test_fp4_weights_past_the_budget_stay_on_the_kernel(monkeypatch, packer):
    """An FP4 copy that does not fit the caches' budget serves its call only (the budget's warning says so):
    the multiply stays on the AMX kernel with the FP4 weights, nothing is cached or evicted, and no weight is
    dequantized (which, done again each call, costs far more than packing the FP4 bytes)."""
    if packer != "amx":
        pytest.skip("the FP4 copy is for the AMX kernel")
    from deepep_ascend.gemm import weight_cache as wc

    kinds, dequantized = [], []
    real = native.gemm_bf16_amx
    monkeypatch.setattr(native, "gemm_bf16_amx",
                        lambda out, a, w, runs=None: kinds.append(type(w[0]).__name__) or real(out, a, w, runs))
    real_deq = GroupedOperands._dequantized
    monkeypatch.setattr(GroupedOperands, "_dequantized", lambda self: dequantized.append(1) or real_deq(self))
    a, b, a_bf, w, ends = _fp4_grouped_case()
    g, n, k = w.shape
    want = torch.zeros(a_bf.size(0), n, dtype=BF16)
    dg.m_grouped_bf16_gemm_nt_contiguous(a_bf, w, want, ends, use_psum_layout=True)
    old = dg.dequantized_weight_cache_info().max_bytes
    try:
        dg.set_dequantized_weight_cache(max_bytes=g * native.amx_fp4_packed_nbytes(n, k) - 1)
        dg.clear_dequantized_weight_cache()
        kinds.clear()
        wc._cache_warned = False
        with pytest.warns(RuntimeWarning, match="does not fit"):
            for _ in range(2):
                got = torch.full_like(want, SENTINEL)
                dg.m_grouped_fp8_fp4_gemm_nt_contiguous(a, b, got, ends, use_psum_layout=True)
                assert _same_bits(got, want)
        info = dg.dequantized_weight_cache_info()
        assert kinds == ["AmxFp4Weight"] * 2 and not dequantized and (info.entries, info.evictions) == (0, 0), info
    finally:
        dg.set_dequantized_weight_cache(max_bytes=old)
        dg.clear_dequantized_weight_cache()


@needs_amx
def test_mega_moe_keeps_fp4_experts_as_fp4(packer):
    """MegaMoE's cached weights for ``fp8xfp4`` are the experts' FP4 copies (natural gate/up order; no bf16
    copy), and its per-expert GEMM on them gives the bits it gives on the bf16 values of the untransformed
    weights."""
    if packer != "amx":
        pytest.skip("the FP4 copy is for the AMX kernel")
    from deepep_ascend.gemm import weight_cache as wc

    e, h, i = 3, 256, 128
    gen = torch.Generator().manual_seed(96)
    raw = []
    for n, k in ((2 * i, h), (h, i)):
        data, sf = dg.per_token_cast_to_fp4(torch.randn(e, n, k, generator=gen), use_ue8m0=True, gran_k=32,
                                            use_packed_ue8m0=True)
        raw.append((data, sf, _fp4_values(data, sf.view(torch.uint8), k)))
    l1 = (raw[0][0], dg.transform_sf_into_required_layout(raw[0][1], 2 * i, h, (1, 32), num_groups=e))
    l2 = (raw[1][0], dg.transform_sf_into_required_layout(raw[1][1], h, i, (1, 32), num_groups=e))
    t1, t2 = dg.transform_weights_for_mega_moe(l1, l2)
    w1, w2 = untransformed("fp8xfp4", t1, t2, "bf16")
    assert all(isinstance(x, native.AmxFp4Weight) for x in w1 + w2) and len(w1) == len(w2) == e
    assert dg.dequantized_weight_cache_info().nbytes == e * (native.amx_fp4_packed_nbytes(2 * i, h)
                                                             + native.amx_fp4_packed_nbytes(h, i))
    bounds = [0, 7, 7, 30]
    for w, ref, k in ((w1, raw[0][2], h), (w2, raw[1][2], i)):
        a = _rand(bounds[-1], k, seed=97)
        assert _same_bits(expert_gemm("bf16", a, w, bounds),
                          expert_gemm("bf16", a, packing.pack_groups(ref), bounds))
    # Past the budget the FP4 copies serve the call uncached; they are not traded for dequantized bf16 weights
    # (four times the bytes, rebuilt every call).
    old = dg.dequantized_weight_cache_info().max_bytes
    try:
        dg.set_dequantized_weight_cache(max_bytes=e * native.amx_fp4_packed_nbytes(2 * i, h) - 1)
        dg.clear_dequantized_weight_cache()
        wc._cache_warned = False
        with pytest.warns(RuntimeWarning, match="does not fit"):
            v1, v2 = untransformed("fp8xfp4", t1, t2, "bf16")
        assert all(isinstance(x, native.AmxFp4Weight) for x in v1 + v2)
        assert dg.dequantized_weight_cache_info().entries == 0
        a = _rand(bounds[-1], h, seed=98)
        assert _same_bits(expert_gemm("bf16", a, v1, bounds), expert_gemm("bf16", a, w1, bounds))
    finally:
        dg.set_dequantized_weight_cache(max_bytes=old)
        dg.clear_dequantized_weight_cache()
