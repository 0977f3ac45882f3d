"""Grouped and dense GEMMs in deepep_ascend.gemm (grouped, dense; docs/semantics/mega-moe.md §3): hand-computed cases,
layouts (contiguous with -1 padding, psum, masked, k-grouped), BF16/FP8/FP4 against a per-group float64
reference, and bad inputs.

Single-process and tiny: every rank of the MPI suite runs them independently (no collectives).
Tolerance: outputs are bf16 rounded once from float32 accumulation, so each element is within
2^-8 relative (half a bf16 ulp is 2^-9, plus float32 accumulation noise) of the float64 result.
"""

from __future__ import annotations

import pytest
import torch

import deepep_ascend as dg

BF16 = torch.bfloat16
F32 = torch.float32
E4M3 = torch.float8_e4m3fn
SENTINEL = 7.0


@pytest.fixture
def alignment():
    """Small row alignment for hand-sized layouts; restored afterwards."""
    old = dg.get_mk_alignment_for_contiguous_layout()
    dg.set_mk_alignment_for_contiguous_layout(4)
    yield 4
    dg.set_mk_alignment_for_contiguous_layout(old)


def close_to(d: torch.Tensor, ref64: torch.Tensor, rtol: float = 2.0**-8) -> bool:
    scale = ref64.abs().max().item() if ref64.numel() else 1.0
    return bool(((d.double() - ref64).abs() <= rtol * ref64.abs() + 1e-6 * scale).all())


def layout_from_counts(counts, alignment):
    rows = []
    for g, c in enumerate(counts):
        rows += [g] * c + [-1] * (dg.align(c, alignment) - c)
    return torch.tensor(rows, dtype=torch.int32)


def test_alignment_helpers():
    assert dg.get_mk_alignment_for_contiguous_layout() == 128
    assert dg.get_m_alignment_for_contiguous_layout() == 128
    assert dg.get_k_alignment_for_contiguous_layout() == 128
    assert dg.get_theoretical_mk_alignment_for_contiguous_layout(64) == 128
    with pytest.raises(ValueError, match="new_value"):
        dg.set_mk_alignment_for_contiguous_layout(0)


def test_contiguous_bf16_hand_case(alignment):
    a = torch.tensor([[1, 2], [3, 4], [9, 9], [9, 9], [1, -1], [9, 9], [9, 9], [9, 9]], dtype=BF16)
    b = torch.tensor([[[1, 0], [0, 1], [1, 1]], [[2, 0], [0, 2], [1, -1]]], dtype=BF16)  # [2,3,2]
    layout = torch.tensor([0, 0, -1, -1, 1, -1, -1, -1], dtype=torch.int32)
    d = torch.full((8, 3), SENTINEL, dtype=BF16)
    dg.m_grouped_bf16_gemm_nt_contiguous(a, b, d, layout)
    want = [[1, 2, 3], [3, 4, 7], [0, 0, 0], [0, 0, 0], [2, -2, 2]] + [[0, 0, 0]] * 3
    assert d.tolist() == want  # padding rows (-1) come out as zeros
    d2 = torch.full((8, 3), SENTINEL, dtype=BF16)
    dg.m_grouped_bf16_gemm_nn_contiguous(a, b.transpose(1, 2).contiguous(), d2, layout)
    assert d2.tolist() == want


def test_contiguous_psum_layout_and_zero_padding(alignment):
    a = torch.ones(10, 2, dtype=BF16)
    b = torch.tensor([[[1, 1]], [[2, 3]]], dtype=BF16)  # N = 1: group 0 -> 2, group 1 -> 5
    ends = torch.tensor([3, 6], dtype=torch.int32)  # group 0: rows [0,3), group 1: [4,6)
    d = torch.full((10, 1), SENTINEL, dtype=BF16)
    dg.m_grouped_bf16_gemm_nt_contiguous(a, b, d, ends, use_psum_layout=True)
    assert d.flatten().tolist() == [2, 2, 2, 0, 5, 5, 0, 0, SENTINEL, SENTINEL]
    d = torch.full((10, 1), SENTINEL, dtype=BF16)
    dg.m_grouped_bf16_gemm_nt_contiguous(
        a, b, d, ends, use_psum_layout=True, ensure_zero_padding=False
    )
    assert d.flatten().tolist() == [2, 2, 2, SENTINEL, 5, 5] + [SENTINEL] * 4
    # an empty group may repeat the previous end (unaligned) or its aligned start
    d = torch.full((10, 1), SENTINEL, dtype=BF16)
    b3 = torch.cat([b, b[:1]])
    dg.m_grouped_bf16_gemm_nt_contiguous(
        a, b3, d, torch.tensor([3, 3, 6], dtype=torch.int32), use_psum_layout=True
    )
    assert d.flatten().tolist()[:6] == [2, 2, 2, 0, 2, 2]


def test_contiguous_bf16_against_float64(alignment):
    g = torch.Generator().manual_seed(0)
    counts = [5, 0, 9, 1]
    layout = layout_from_counts(counts, alignment)
    m, n, k = layout.numel(), 24, 64
    a = torch.randn(m, k, generator=g).to(BF16)
    b = torch.randn(len(counts), n, k, generator=g).to(BF16)
    d = torch.full((m, n), SENTINEL, dtype=BF16)
    dg.m_grouped_bf16_gemm_nt_contiguous(a, b, d, layout)
    ref = torch.zeros(m, n, dtype=torch.float64)
    for i, grp in enumerate(layout.tolist()):
        if grp >= 0:
            ref[i] = b[grp].double() @ a[i].double()
    assert close_to(d, ref)


def test_empty_n_or_k_with_the_weight_caches_on(alignment):
    """K = 0 gives zeros and N = 0 an empty ``d``, contiguous and masked, as torch.matmul does: nothing is
    packed for such weights (oneDNN's reorder refused them with an opaque error; found by a helper)."""
    layout = layout_from_counts([3, 2], alignment)
    m = layout.numel()
    d = torch.full((m, 5), SENTINEL, dtype=BF16)
    dg.m_grouped_bf16_gemm_nt_contiguous(torch.empty(m, 0, dtype=BF16), torch.empty(2, 5, 0, dtype=BF16), d, layout)
    assert bool((d == 0).all())
    d = torch.empty(m, 0, dtype=BF16)
    dg.m_grouped_bf16_gemm_nt_contiguous(torch.randn(m, 8).to(BF16), torch.empty(2, 0, 8, dtype=BF16), d, layout)
    d = torch.full((2, 4, 5), SENTINEL, dtype=BF16)
    dg.m_grouped_bf16_gemm_nt_masked(torch.empty(2, 4, 0, dtype=BF16), torch.empty(2, 5, 0, dtype=BF16), d,
                                     torch.tensor([4, 1], dtype=torch.int32), 4)
    assert bool((d[0] == 0).all()) and bool((d[1, :1] == 0).all()) and bool((d[1, 1:] == SENTINEL).all())


def test_masked_bf16_leaves_rows_past_masked_m():
    g = torch.Generator().manual_seed(1)
    G, mmax, n, k = 3, 6, 8, 32
    a = torch.randn(G, mmax, k, generator=g).to(BF16)
    b = torch.randn(G, n, k, generator=g).to(BF16)
    masked_m = torch.tensor([2, 0, 6], dtype=torch.int32)
    d = torch.full((G, mmax, n), SENTINEL, dtype=BF16)
    dg.m_grouped_bf16_gemm_nt_masked(a, b, d, masked_m, expected_m=3)
    for grp, c in enumerate(masked_m.tolist()):
        assert close_to(d[grp, :c], a[grp, :c].double() @ b[grp].double().T)
        assert bool((d[grp, c:] == SENTINEL).all())
    assert dg.bf16_m_grouped_gemm_nt_masked is dg.m_grouped_bf16_gemm_nt_masked


def test_prepacked_weights_follow_in_place_writes_and_survive_cache_clears():
    """The bf16 GEMMs multiply on oneDNN-packed weights cached by identity and version (where the CPU has
    native bf16): an in-place write to ``b`` is seen by the next call, nn/nt and masked/contiguous agree
    with the float64 reference, and clearing the cache while a packed entry is keyed on a cached
    dequantized weight returns (it once deadlocked: the dropped key's finalizer re-took the lock)."""
    from deepep_ascend.gemm import packing
    from deepep_ascend.gemm import weight_cache as wc

    g = torch.Generator().manual_seed(3)
    G, m, n, k = 3, 5, 24, 64
    a = torch.randn(G * m, k, generator=g).to(BF16)
    b = torch.randn(G, n, k, generator=g).to(BF16)
    ends = torch.tensor([m, 2 * m, 3 * m], dtype=torch.int32)
    old = dg.get_mk_alignment_for_contiguous_layout()
    dg.set_mk_alignment_for_contiguous_layout(1)
    try:
        for step in range(2):
            d = torch.full((G * m, n), SENTINEL, dtype=BF16)
            dg.m_grouped_bf16_gemm_nt_contiguous(a, b, d, ends, use_psum_layout=True)
            d_nn = torch.full((G * m, n), SENTINEL, dtype=BF16)
            b_kn = b.transpose(1, 2).contiguous()
            dg.m_grouped_bf16_gemm_nn_contiguous(a, b_kn, d_nn, ends, use_psum_layout=True)
            d_mask = torch.full((G, m, n), SENTINEL, dtype=BF16)
            dg.m_grouped_bf16_gemm_nt_masked(a.view(G, m, k), b, d_mask, torch.full((G,), m, dtype=torch.int32), m)
            for grp in range(G):
                ref = a[grp * m:(grp + 1) * m].double() @ b[grp].double().T
                assert close_to(d[grp * m:(grp + 1) * m], ref), (step, grp)
                assert close_to(d_nn[grp * m:(grp + 1) * m], ref), (step, grp)
                assert close_to(d_mask[grp], ref), (step, grp)
            if packing._PACKING:
                assert any(key[0] == "packed_weights" for key in wc._cache), "no packed weights cached"
            b[1].neg_()  # in place: the next round must multiply by the new values
    finally:
        dg.set_mk_alignment_for_contiguous_layout(old)
    # fp8 weights: the packed entry is keyed on the cached dequantized copy; clearing drops both
    w = torch.randn(2, n, 128, generator=g)
    bq = dg.per_block_cast_to_fp8(w, True)
    aq = dg.per_token_cast_to_fp8(torch.randn(2, 4, 128, generator=g), True, 128, True)
    d1 = torch.zeros(2, 4, n, dtype=BF16)
    dg.m_grouped_fp8_gemm_nt_masked(aq, bq, d1, torch.tensor([4, 4], dtype=torch.int32), 4)
    dg.clear_dequantized_weight_cache()
    assert len(wc._cache) == 0
    d2 = torch.zeros(2, 4, n, dtype=BF16)
    dg.m_grouped_fp8_gemm_nt_masked(aq, bq, d2, torch.tensor([4, 4], dtype=torch.int32), 4)
    assert torch.equal(d1, d2)
    dg.clear_dequantized_weight_cache()


def test_weight_cache_edge_cases_inference_grad_views_and_finalizers():
    """Review findings on the packed-weight cache: weights made under ``torch.inference_mode()`` (no version
    counter) work inside and outside it; weights that require grad take ``torch.matmul`` (gradients flow, and
    nothing cached keeps a dropped Parameter alive); a fresh view of the same weights per call (``w[layer]``)
    hits one entry; repeated in-place updates register one finalizer per weight, not one per rebuild."""
    import gc
    import weakref

    from deepep_ascend.gemm import packing
    from deepep_ascend.gemm import weight_cache as wc

    dg.clear_dequantized_weight_cache()
    g = torch.Generator().manual_seed(4)
    G, m, n, k = 2, 3, 16, 32
    a = torch.randn(G, m, k, generator=g).to(BF16)
    masked_m = torch.full((G,), m, dtype=torch.int32)

    def ref(b):
        return torch.stack([a[i].double() @ b[i].double().T for i in range(G)])

    with torch.inference_mode():
        b_inf = torch.randn(G, n, k).to(BF16)
        d = torch.zeros(G, m, n, dtype=BF16)
        dg.m_grouped_bf16_gemm_nt_masked(a, b_inf, d, masked_m, m)
    assert close_to(d, ref(b_inf))
    d2 = torch.zeros(G, m, n, dtype=BF16)
    dg.m_grouped_bf16_gemm_nt_masked(a, b_inf, d2, masked_m, m)
    assert close_to(d2, ref(b_inf))

    p = torch.nn.Parameter(torch.randn(G, n, k, generator=g).to(BF16))
    x = a.clone().requires_grad_(True)
    d = torch.zeros(G, m, n, dtype=BF16)
    dg.m_grouped_bf16_gemm_nt_masked(x, p, d, masked_m, m)
    d.float().sum().backward()
    assert p.grad is not None and x.grad is not None
    want = torch.ones(G, m, n, dtype=torch.float64)
    assert torch.allclose(x.grad.double(), want @ p.detach().double(), rtol=2**-7, atol=1e-2)
    b_fixed = torch.randn(G, n, k, generator=g).to(BF16)  # no grad: packed where possible, but x needs its grad
    x2 = a.clone().requires_grad_(True)
    d = torch.zeros(G, m, n, dtype=BF16)
    dg.m_grouped_bf16_gemm_nt_masked(x2, b_fixed, d, masked_m, m)
    d.float().sum().backward()
    assert x2.grad is not None and torch.allclose(x2.grad.double(), want @ b_fixed.double(), rtol=2**-7, atol=1e-2)
    ref_p = weakref.ref(p)
    del p, x, d
    gc.collect()
    assert ref_p() is None, "a dropped Parameter is kept alive by the cache"

    dg.clear_dequantized_weight_cache()  # count only the entries of the views below
    w = torch.randn(4, G, n, k, generator=g).to(BF16)
    for _ in range(3):
        for layer in range(4):
            dg.m_grouped_bf16_gemm_nt_masked(a, w[layer], torch.zeros(G, m, n, dtype=BF16), masked_m, m)
    packed_keys = [key for key in wc._cache if key[0] == "packed_weights"]
    assert len(packed_keys) == (4 if packing._PACKING else 0), packed_keys

    b = torch.randn(G, n, k, generator=g).to(BF16)
    watched = len(wc._watched)
    for _ in range(20):
        b.add_(1.0)
        d = torch.zeros(G, m, n, dtype=BF16)
        dg.m_grouped_bf16_gemm_nt_masked(a, b, d, masked_m, m)
    assert close_to(d, ref(b))
    assert len(wc._watched) <= watched + 1
    dg.clear_dequantized_weight_cache()


def test_fp8_hand_case():
    # A: ones with scale 2^-3 (UE8M0 byte 124); B: ones with scale 2^1 -> 128 * 2^-3 * 2 = 32
    a_data = torch.ones(1, 128).to(E4M3)
    a_sf = torch.tensor([[0x7F7F7F7C]], dtype=torch.int32)
    b_data = torch.ones(1, 2, 128).to(E4M3)
    b_data.view(torch.uint8)[0, 1, :64] = 0xB8  # -1 in half of row 1 -> 0
    b_sf = torch.tensor([[[0x7F7F7F80], [0x7F7F7F80]]], dtype=torch.int32)
    d = torch.zeros(1, 1, 2, dtype=BF16)
    dg.m_grouped_fp8_gemm_nt_masked(
        (a_data.unsqueeze(0), a_sf.unsqueeze(0)), (b_data, b_sf), d,
        torch.tensor([1], dtype=torch.int32), 1, recipe=(1, 1, 128),
    )  # fmt: skip
    assert d.flatten().tolist() == [32.0, 0.0]


def _deq_rows(data, sf_float, gran):
    """Independent dequantization: e4m3 -> float64 times the per-(row, gran) float scale."""
    k = data.size(-1)
    return data.double() * sf_float.double().repeat_interleave(gran, dim=-1)[..., :k]


@pytest.mark.parametrize("ue8m0", [True, False])
def test_fp8_contiguous_against_float64(ue8m0):
    g = torch.Generator().manual_seed(2)
    counts = [3, 130 - 128]  # alignment 128: rows [0,3) group 0, [128,130) group 1
    layout = layout_from_counts(counts, 128)
    m, n, k, G = layout.numel(), 16, 256, 2
    x = torch.randn(m, k, generator=g)
    w = torch.randn(G, n, k, generator=g)
    a = dg.per_token_cast_to_fp8(x, ue8m0, 128, ue8m0)  # packed int32 when ue8m0
    b = dg.per_block_cast_to_fp8(w, ue8m0)
    d = torch.full((m, n), SENTINEL, dtype=BF16)
    dg.m_grouped_fp8_gemm_nt_contiguous(a, b, d, layout)
    a_sf = dg.unpack_ue8m0_from_int(a[1])[:, :2] if ue8m0 else a[1]
    a64 = _deq_rows(a[0], a_sf, 128)
    b64 = b[0].double() * b[1].double().repeat_interleave(128, 1).repeat_interleave(128, 2)[:, :n, :k]
    ref = torch.zeros(m, n, dtype=torch.float64)
    for i, grp in enumerate(layout.tolist()):
        if grp >= 0:
            ref[i] = b64[grp] @ a64[i]
    assert close_to(d, ref)
    # the same through the psum layout and through the nn variant
    d2 = torch.full((m, n), SENTINEL, dtype=BF16)
    dg.m_grouped_fp8_fp4_gemm_nt_contiguous(
        a, b, d2, torch.tensor([3, 130], dtype=torch.int32), use_psum_layout=True
    )
    assert torch.equal(d2, d)
    d3 = torch.full((m, n), SENTINEL, dtype=BF16)
    dg.m_grouped_fp8_gemm_nn_contiguous(a, (b[0].transpose(1, 2).contiguous(), b[1]), d3, layout)
    assert torch.equal(d3, d)


def test_the_same_fp8_weights_at_two_granularities_are_two_weights():
    """Packed UE8M0 scales of one int32 word per row read as one exponent per 128 K values or as four
    per 32: the same ``(data, sf)`` tensors are two different weights. Each call matches its own
    recipe's reference, in either order, with the weight caches on (the packed copies were once keyed
    without the granularity, so the second call reused the first one's weights)."""
    g = torch.Generator().manual_seed(11)
    G, n, k, rows = 2, 16, 128, 8
    layout = layout_from_counts([rows, rows], 128)
    a = (torch.randn(layout.numel(), k, generator=g).to(E4M3),
         torch.full((layout.numel(), 1), 0x7F7F7F7F, dtype=torch.int32))  # scale 1 at either granularity
    b_data = (torch.randn(G, n, k, generator=g) * 8).to(E4M3)
    b_bytes = torch.tensor([127, 128, 129, 130], dtype=torch.uint8).repeat(G, n, 1)  # 1, 2, 4, 8
    b = (b_data, b_bytes.view(torch.int32))

    def reference(gran):
        scale = 2.0 ** (b_bytes.double() - 127)
        scale = scale.repeat_interleave(32, -1) if gran == 32 else scale[..., :1].expand(G, n, k)
        w64 = b_data.double() * scale
        ref = torch.zeros(layout.numel(), n, dtype=torch.float64)
        for i, grp in enumerate(layout.tolist()):
            if grp >= 0:
                ref[i] = w64[grp] @ a[0][i].double()
        return ref

    for grans in ((32, 128), (128, 32)):
        dg.clear_dequantized_weight_cache()
        for gran in grans:
            d = torch.empty(layout.numel(), n, dtype=BF16)
            dg.m_grouped_fp8_fp4_gemm_nt_contiguous(a, b, d, layout, recipe_a=(1, 128), recipe_b=(1, gran))
            assert close_to(d, reference(gran)), f"recipe_b (1, {gran}) after (1, {grans[0]})"


def test_fp8_x_fp4_masked_mx_recipe():
    g = torch.Generator().manual_seed(3)
    G, mmax, n, k = 2, 4, 8, 64
    x = torch.randn(G, mmax, k, generator=g)
    w = torch.randn(G, n, k, generator=g)
    a = dg.per_token_cast_to_fp8(x, True, 32, True)
    b = dg.per_token_cast_to_fp4(w, True, 32, True)
    assert b[0].dtype == torch.int8 and b[0].shape == (G, n, k // 2)
    d = torch.full((G, mmax, n), SENTINEL, dtype=BF16)
    dg.m_grouped_fp8_fp4_gemm_nt_masked(a, b, d, torch.tensor([4, 1], dtype=torch.int32), 2,
                                        recipe=(1, 1, 32))
    a64 = _deq_rows(a[0], dg.unpack_ue8m0_from_int(a[1])[..., :2], 32)
    b64 = dg.cast_back_from_fp4(b[0], b[1], 32).double()
    assert close_to(d[0], a64[0] @ b64[0].T)
    assert close_to(d[1, :1], a64[1, :1] @ b64[1].T)
    assert bool((d[1, 1:] == SENTINEL).all())


def test_k_grouped_bf16_against_float64():
    g = torch.Generator().manual_seed(4)
    ks = [128, 0, 256]
    m, n = 3, 5
    a = torch.randn(sum(ks), m, generator=g).to(BF16)
    b = torch.randn(sum(ks), n, generator=g).to(BF16)
    c = torch.randn(3, m, n, generator=g)
    d = c.clone()  # c aliases d
    dg.k_grouped_bf16_gemm_tn_contiguous(a, b, d, ks, torch.tensor(ks, dtype=torch.int32), c=d)
    offs = [0, 128, 128, 384]
    for grp in range(3):
        s, e = offs[grp], offs[grp + 1]
        ref = c[grp].double() + a[s:e].double().T @ b[s:e].double()
        assert torch.allclose(d[grp].double(), ref, rtol=1e-5, atol=1e-4)
    assert torch.equal(d[1], c[1])  # K = 0: just c
    d2 = torch.zeros(3, m, n)
    dg.k_grouped_bf16_gemm_tn_contiguous(
        a, b, d2, None, torch.tensor([128, 128, 384], dtype=torch.int32), use_psum_layout=True
    )
    assert torch.allclose(d2, d - c, rtol=1e-5, atol=1e-4)


def test_k_grouped_fp8_tn_and_nt():
    g = torch.Generator().manual_seed(5)
    ks = [128, 256]
    m, n = 4, 3
    x = torch.randn(sum(ks), m, generator=g)
    y = torch.randn(sum(ks), n, generator=g)
    a = dg.per_channel_cast_to_fp8(x, True)
    b = dg.per_channel_cast_to_fp8(y, True)
    d = torch.zeros(2, m, n)
    dg.k_grouped_fp8_gemm_tn_contiguous(a, b, d, ks, torch.tensor(ks, dtype=torch.int32))
    a64 = a[0].double() * a[1].double().repeat_interleave(128, 0)
    b64 = b[0].double() * b[1].double().repeat_interleave(128, 0)
    assert torch.allclose(d[0].double(), a64[:128].T @ b64[:128], rtol=1e-5, atol=1e-4)
    assert torch.allclose(d[1].double(), a64[128:].T @ b64[128:], rtol=1e-5, atol=1e-4)
    d_nt = torch.zeros(2, m, n)
    a_nt = (a[0].t().contiguous(), a[1].t().contiguous())
    b_nt = (b[0].t().contiguous(), b[1].t().contiguous())
    dg.k_grouped_fp8_gemm_nt_contiguous(a_nt, b_nt, d_nt, ks, torch.tensor(ks, dtype=torch.int32))
    assert torch.equal(d_nt, d)


def test_dense_variants():
    g = torch.Generator().manual_seed(6)
    a = torch.randn(4, 64, generator=g).to(BF16)
    b = torch.randn(6, 64, generator=g).to(BF16)
    c = torch.randn(4, 6, generator=g)
    d = torch.empty(4, 6)
    dg.bf16_gemm_nt(a, b, d, c=c)
    assert torch.allclose(d.double(), c.double() + a.double() @ b.double().T, rtol=1e-5, atol=1e-4)
    d2 = torch.empty(4, 6, dtype=BF16)
    dg.bf16_gemm_tt(a.t().contiguous(), b, d2)
    assert close_to(d2, a.double() @ b.double().T)
    # legacy float32 scales (1x128 A, 128x128 B): computed in float32
    af = dg.per_token_cast_to_fp8(a.float())
    bf = dg.per_block_cast_to_fp8(b.float())
    d3 = torch.empty(4, 6, dtype=BF16)
    dg.fp8_gemm_nt(af, bf, d3)
    ref = _deq_rows(af[0], af[1], 128) @ (bf[0].double() * bf[1].double().item()).T
    assert close_to(d3, ref)


def test_bad_inputs_raise_clear_errors(alignment):
    a = torch.ones(8, 2, dtype=BF16)
    b = torch.ones(2, 3, 2, dtype=BF16)
    d = torch.zeros(8, 3, dtype=BF16)
    ok = torch.tensor([0, 0, -1, -1, 1, 1, 1, -1], dtype=torch.int32)
    with pytest.raises(TypeError, match="a must have dtype"):
        dg.m_grouped_bf16_gemm_nt_contiguous(a.float(), b, d, ok)
    with pytest.raises(TypeError, match="d must have dtype"):
        dg.m_grouped_bf16_gemm_nt_contiguous(a, b, d.float(), ok)
    with pytest.raises(ValueError, match="b must be a CPU tensor, got device meta"):
        dg.m_grouped_bf16_gemm_nt_contiguous(a, b.to("meta"), d, ok)
    with pytest.raises(ValueError, match=r"b must be a dense \(strided\) tensor"):
        dg.m_grouped_bf16_gemm_nt_contiguous(a, b.to_sparse(), d, ok)
    with pytest.raises(ValueError, match=r"b\[0\] \(data\) must be a CPU tensor"):
        dg.m_grouped_fp8_fp4_gemm_nt_masked((torch.zeros(1, 4, 128).to(E4M3), torch.ones(1, 4, 1)),
                                            (torch.zeros(1, 2, 128).to(E4M3).to("meta"), torch.ones(1, 2, 1)),
                                            torch.zeros(1, 4, 2, dtype=BF16), torch.tensor([4], dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="d must have shape"):
        dg.m_grouped_bf16_gemm_nt_contiguous(a, b, d[:7], ok)
    with pytest.raises(ValueError, match="K mismatch"):
        dg.m_grouped_bf16_gemm_nt_contiguous(a, torch.ones(2, 3, 4, dtype=BF16), d, ok)
    with pytest.raises(ValueError, match="one contiguous run"):
        dg.m_grouped_bf16_gemm_nt_contiguous(
            a, b, d, torch.tensor([0, 0, -1, -1, 1, 1, 0, -1], dtype=torch.int32))
    with pytest.raises(ValueError, match="alignment"):
        dg.m_grouped_bf16_gemm_nt_contiguous(
            a, b, d, torch.tensor([0, 0, -1, 1, 1, -1, -1, -1], dtype=torch.int32))
    with pytest.raises(ValueError, match="-1 or in"):
        dg.m_grouped_bf16_gemm_nt_contiguous(
            a, b, d, torch.tensor([0, 0, -1, -1, 2, -1, -1, -1], dtype=torch.int32))
    with pytest.raises(ValueError, match="grouped_layout must have"):
        dg.m_grouped_bf16_gemm_nt_contiguous(a, b, d, ok[:5])
    with pytest.raises(ValueError, match="non-decreasing"):
        dg.m_grouped_bf16_gemm_nt_contiguous(
            a, b, d, torch.tensor([4, 3], dtype=torch.int32), use_psum_layout=True)
    with pytest.raises(ValueError, match="masked_m"):
        dg.m_grouped_bf16_gemm_nt_masked(
            a.view(2, 4, 2), b, torch.zeros(2, 4, 3, dtype=BF16),
            torch.tensor([5, 0], dtype=torch.int32), 1)
    with pytest.raises(TypeError, match="pair"):
        dg.m_grouped_fp8_gemm_nt_contiguous(a, b, d, ok)
    x8 = torch.zeros(8, 128).to(E4M3)
    with pytest.raises(ValueError, match="scales shape"):
        dg.m_grouped_fp8_gemm_nt_contiguous(
            (x8, torch.ones(8, 2)), (torch.zeros(2, 3, 128).to(E4M3), torch.ones(2, 1, 1)),
            d, ok)
    with pytest.raises(ValueError, match="gran_k"):
        dg.k_grouped_fp8_gemm_tn_contiguous(
            dg.per_channel_cast_to_fp8(torch.ones(256, 2)),
            dg.per_channel_cast_to_fp8(torch.ones(256, 2)),
            torch.zeros(2, 2, 2), [64, 192], torch.tensor([64, 192], dtype=torch.int32))
    with pytest.raises(ValueError, match="disagrees"):
        dg.k_grouped_bf16_gemm_tn_contiguous(
            a, a, torch.zeros(1, 2, 2), [8], torch.tensor([4], dtype=torch.int32))


def test_grouped_gemm_benchmark_checks_products(capsys):
    """``python -m bench grouped-gemm`` (docs/benchmarks.md) checks its variants'
    products against a float64 reference."""
    from bench import grouped_gemm

    assert grouped_gemm.main(["--groups", "3", "--rows", "40", "--k", "64", "--n", "32", "--iters", "3"]) == 0
    out = capsys.readouterr().out
    assert "[check]" in out and "ok" in out.split("[check]")[1]
    from deepep_ascend import native

    if native.amx_bf16():  # the kernel on the plain matmul's own operands is checked too
        assert "one group, AMX" in out.split("[check]")[1]


def test_k_grouped_fp8_refusal_writes_nothing():
    """A later group's K segment off the gran_k grid is refused before any d[g] is written."""
    torch.manual_seed(3)
    m, n = 16, 24
    a = dg.per_channel_cast_to_fp8(torch.randn(256, m))
    b = dg.per_channel_cast_to_fp8(torch.randn(256, n))
    d = torch.full((2, m, n), 7.0)
    with pytest.raises(ValueError, match="gran_k"):
        dg.k_grouped_fp8_gemm_tn_contiguous(a, b, d, [128, 64], torch.tensor([128, 64], dtype=torch.int32))
    assert bool((d == 7).all())


def test_d_over_part_of_an_input_is_refused_and_apart_is_taken():
    """``d`` over part of ``a`` (rows a later group still reads) or with elements sharing memory: ValueError
    naming d. Column halves of one buffer (disjoint rows of bytes whose extents overlap) and ``d`` being ``a``
    itself: the bits of the same call on operands apart (whatever kernel this CPU runs: AMX, oneDNN or
    torch.matmul, whose float32 sums may round differently), and the float32 product within bf16 rounding."""
    torch.manual_seed(4)
    k = n = 64
    b = torch.randn(2, n, k).to(BF16)
    layout = torch.tensor([0] * 128 + [1] * 128, dtype=torch.int32)

    def ref(a0):
        apart = torch.empty(a0.size(0), n, dtype=BF16)
        dg.m_grouped_bf16_gemm_nt_contiguous(a0.clone(), b, apart, layout)
        exact = torch.cat([a0[:128].float() @ b[0].float().T, a0[128:].float() @ b[1].float().T])
        assert torch.allclose(apart.float(), exact, rtol=2**-7, atol=1e-3)
        return apart

    buf = torch.randn(384, k).to(BF16)
    with pytest.raises(ValueError, match="d overlaps a"):
        dg.m_grouped_bf16_gemm_nt_contiguous(buf[:256], b, buf[128:], layout)
    buf = torch.randn(3, 8, k).to(BF16)
    with pytest.raises(ValueError, match="d overlaps a"):
        dg.m_grouped_bf16_gemm_nt_masked(buf[:2], b, buf[1:], torch.tensor([8, 8], dtype=torch.int32), 8)
    with pytest.raises(ValueError, match="sharing memory"):
        dg.bf16_gemm_nt(torch.randn(4, k).to(BF16), b[0], torch.zeros(1, n, dtype=BF16).expand(4, n))
    wide = torch.randn(256, 2 * k).to(BF16)
    a, d = wide[:, :k], wide[:, k:]
    a0 = a.clone()
    dg.m_grouped_bf16_gemm_nt_contiguous(a, b, d, layout)
    assert torch.equal(d, ref(a0))
    a = torch.randn(256, k).to(BF16)
    a0 = a.clone()
    dg.m_grouped_bf16_gemm_nt_contiguous(a, b, a, layout)
    assert torch.equal(a, ref(a0))
