"""Single-process checks of the oracle in reference.py on hand-computed cases."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.support.reference import (
    _e4m3_codes_satfinite,
    align_up,
    calc_diff,
    per_token_cast_back,
    per_token_cast_to_fp8,
    ref_combine,
    ref_dispatch,
    ref_dispatch_layout,
    ref_ll_cast_fp8,
    ref_rank_prefix_matrix,
    ref_recv_rows,
)

BF16 = torch.bfloat16

# Two ranks, E = 4 experts (L = 2: experts 0,1 on rank 0; 2,3 on rank 1), K = 2.
#   rank 0: t0 -> {0, 3} (both ranks)   t1 -> {1, -}  (rank 0)   t2 -> {2, 2} (rank 1, duplicate)
#   rank 1: t0 -> {-, -} (nowhere)      t1 -> {3, 0}  (both ranks)
E = 4
IDX = [
    torch.tensor([[0, 3], [1, -1], [2, 2]], dtype=torch.int64),
    torch.tensor([[-1, -1], [3, 0]], dtype=torch.int64),
]
W = [
    torch.tensor([[0.25, 0.75], [1.0, 0.5], [0.125, 0.375]], dtype=torch.float32),
    torch.tensor([[0.9, 0.8], [0.625, 0.0625]], dtype=torch.float32),
]
# rows carry (rank, token) so every received row is identifiable
X = [
    torch.tensor([[0.0, 0.0], [0.0, 1.0], [0.0, 2.0]], dtype=BF16),
    torch.tensor([[1.0, 0.0], [1.0, 1.0]], dtype=BF16),
]


def test_layout_hand_case():
    ntpr, ntprdma, ntpe, in_rank = ref_dispatch_layout(IDX[0], E, 2)
    assert (
        ntpr.dtype == torch.int32
        and ntpe.dtype == torch.int32
        and in_rank.dtype == torch.bool
    )
    assert ntpr.tolist() == [2, 2]
    assert ntprdma is None
    assert ntpe.tolist() == [1, 1, 2, 1]  # expert 2 listed twice by t2: counted twice
    assert in_rank.tolist() == [[True, True], [True, False], [False, True]]

    ntpr, _, ntpe, in_rank = ref_dispatch_layout(IDX[1], E, 2)
    assert ntpr.tolist() == [1, 1]
    assert ntpe.tolist() == [1, 0, 0, 1]
    assert in_rank.tolist() == [[False, False], [True, True]]


def test_layout_nodes_and_errors():
    # 16 ranks (DeepEP: nodes of 8) -> per-node counts; E = 16, one expert per rank.
    idx = torch.tensor([[0, 9], [1, 2], [15, -1], [-1, -1]])
    ntpr, ntprdma, ntpe, _ = ref_dispatch_layout(idx, 16, 16)
    assert ntprdma.tolist() == [2, 2]
    assert ntpr.sum().item() == 5 and ntpe.sum().item() == 5
    # simulated nodes of 2 ranks on 4 ranks
    _, ntprdma, _, _ = ref_dispatch_layout(
        torch.tensor([[0, 1], [3, -1]]), 4, 4, ranks_per_node=2
    )
    assert ntprdma.tolist() == [1, 1]
    with pytest.raises(ValueError):
        ref_dispatch_layout(torch.tensor([[4, 0]]), 4, 2)
    with pytest.raises(ValueError):
        ref_dispatch_layout(torch.tensor([[-2, 0]]), 4, 2)
    # empty rank
    ntpr, _, ntpe, in_rank = ref_dispatch_layout(
        torch.empty(0, 3, dtype=torch.int64), 4, 2
    )
    assert (
        ntpr.tolist() == [0, 0] and ntpe.tolist() == [0] * 4 and in_rank.shape == (0, 2)
    )


def test_dispatch_hand_case_rank0():
    r = ref_dispatch(X, IDX, W, E, rank=0)
    # from rank 0: t0, t1; from rank 1: t1
    assert r.recv_src_idx.tolist() == [0, 1, 1] and r.recv_src_idx.dtype == torch.int32
    assert r.recv_src_rank.tolist() == [0, 0, 1]
    assert r.recv_x.tolist() == [[0.0, 0.0], [0.0, 1.0], [1.0, 1.0]]
    assert r.recv_topk_idx.tolist() == [[0, -1], [1, -1], [-1, 0]]
    assert r.recv_topk_idx.dtype == torch.int64
    assert r.recv_topk_weights.tolist() == [[0.25, 0.0], [1.0, 0.0], [0.0, 0.0625]]
    assert r.num_recv_tokens_per_expert_list == [2, 1]
    assert r.rank_prefix_matrix.tolist() == [[2, 2], [3, 3]]
    assert r.rank_prefix_matrix.dtype == torch.int32
    assert r.is_token_in_rank.tolist() == [[True, True], [True, False], [False, True]]


def test_dispatch_hand_case_rank1_alignment():
    r = ref_dispatch(X, IDX, W, E, rank=1, expert_alignment=4)
    # from rank 0: t0, t2; from rank 1: t1
    assert r.recv_src_idx.tolist() == [0, 2, 1]
    assert r.recv_x.tolist() == [[0.0, 0.0], [0.0, 2.0], [1.0, 1.0]]
    assert r.recv_topk_idx.tolist() == [[-1, 1], [0, 0], [1, -1]]
    assert r.recv_topk_weights.tolist() == [[0.0, 0.75], [0.125, 0.375], [0.625, 0.0]]
    assert r.num_recv_tokens_per_expert_list == [
        4,
        4,
    ]  # real counts 2, 2 aligned up to 4
    # invariant (docs/semantics/deepep-api.md §9.4): count of local id i == unaligned list entry i
    unaligned = ref_dispatch(X, IDX, W, E, rank=1).num_recv_tokens_per_expert_list
    for i in range(2):
        assert int((r.recv_topk_idx == i).sum()) == unaligned[i]


def test_dispatch_without_topk_and_worst_case():
    r = ref_dispatch(X, IDX, None, E, rank=0)
    assert r.recv_topk_idx is None and r.recv_topk_weights is None
    assert r.num_recv_tokens_per_expert_list == [2, 1]

    w = ref_dispatch(X, IDX, W, E, rank=0, num_worst_tokens=5)
    assert w.recv_x.shape == (5, 2) and w.num_recv_tokens == 3
    assert torch.equal(w.recv_x[:3], ref_dispatch(X, IDX, W, E, rank=0).recv_x)
    assert w.recv_x[3:].eq(0).all()
    assert w.recv_topk_idx[3:].eq(-1).all() and w.recv_topk_weights[3:].eq(0).all()
    assert w.num_recv_tokens_per_expert_list == []
    with pytest.raises(ValueError):
        ref_dispatch(X, IDX, W, E, rank=0, num_worst_tokens=2)


def test_dispatch_fp8_strided_scales_and_bytes():
    torch.manual_seed(0)
    xs = []
    for n in (3, 2):
        data, scales = per_token_cast_to_fp8(torch.randn(n, 256))
        col_major = scales.t().contiguous().t()  # same values, column-major strides
        assert not col_major.is_contiguous()
        xs.append((data, col_major))
    r = ref_dispatch(xs, IDX, W, E, rank=1)
    data, scales = r.recv_x
    assert data.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
    assert scales.is_contiguous() and scales.shape == (3, 2)
    rows = [(0, 0), (0, 2), (1, 1)]
    for row, (s, t) in enumerate(rows):
        assert torch.equal(data[row].view(torch.uint8), xs[s][0][t].view(torch.uint8))
        assert torch.equal(scales[row], xs[s][1][t])


def test_rank_prefix_and_rows():
    masks = [ref_dispatch_layout(i, E, 2)[3] for i in IDX]
    assert ref_rank_prefix_matrix(masks).tolist() == [[2, 2], [3, 3]]
    assert ref_recv_rows(masks, 1) == [(0, 0), (0, 2), (1, 1)]


def test_combine_round_trip_hand_case():
    masks = [ref_dispatch_layout(i, E, 2)[3] for i in IDX]
    disp = [ref_dispatch(X, IDX, W, E, rank=r) for r in range(2)]
    out, w = ref_combine(
        [d.recv_x for d in disp],
        masks,
        rank=0,
        topk_weights=[d.recv_topk_weights for d in disp],
    )
    # rank 0's t0 went to both ranks (x doubled), t1 to rank 0 only, t2 to rank 1 only
    assert out.dtype == BF16 and out.tolist() == [[0.0, 0.0], [0.0, 1.0], [0.0, 2.0]]
    # weights come back whole at valid slots, 0 at -1 slots (t1's second slot)
    assert w.tolist() == [[0.25, 0.75], [1.0, 0.0], [0.125, 0.375]]
    out1, w1 = ref_combine(
        [d.recv_x for d in disp],
        masks,
        rank=1,
        topk_weights=[d.recv_topk_weights for d in disp],
    )
    # rank 1's t0 was sent nowhere: zeros; t1 went to both ranks: doubled
    assert out1.tolist() == [[0.0, 0.0], [2.0, 2.0]]
    assert w1.tolist() == [[0.0, 0.0], [0.625, 0.0625]]


def test_combine_sum_order_and_bias():
    # one token of rank 0 sent to both ranks; the order of float32 adds is visible:
    #   bias0 = 2^24, bias1 = 1: acc = 2^24 (the 1 is lost in f32); + row from rank 0 (-2^24)
    #   -> 0; + row from rank 1 (1) -> 1.  Rows first would give 2; descending ranks 0.
    masks = [torch.tensor([[True, True]]), torch.zeros(0, 2, dtype=torch.bool)]
    rows = [torch.tensor([[-(2.0**24)]], dtype=BF16), torch.tensor([[1.0]], dtype=BF16)]
    b0 = torch.tensor([[2.0**24]], dtype=BF16)
    b1 = torch.tensor([[1.0]], dtype=BF16)
    out, w = ref_combine(rows, masks, rank=0, bias=(b0, b1))
    assert out.item() == 1.0 and w is None
    # single-tensor bias, second tuple entry None: same as bias0 only
    out, _ = ref_combine(rows, masks, rank=0, bias=b0)
    assert out.item() == 1.0  # 2^24 - 2^24 + 1
    out_t, _ = ref_combine(rows, masks, rank=0, bias=(b0, None))
    assert torch.equal(out, out_t)
    # float32 accumulation with a single rounding at the end:
    #   1 + 2^-8 + 2^-8 + 2^-9 = 1 + 2^-7 + 2^-9 -> bf16 1 + 2^-7 (bf16 steps would stay at 1)
    rows = [
        torch.tensor([[2.0**-8]], dtype=BF16),
        torch.tensor([[2.0**-9]], dtype=BF16),
    ]
    b = (torch.tensor([[1.0]], dtype=BF16), torch.tensor([[2.0**-8]], dtype=BF16))
    out, _ = ref_combine(rows, masks, rank=0, bias=b)
    assert out.item() == 1.0 + 2.0**-7


def test_combine_ignores_extra_rows_and_uses_source_blocks():
    # rank 1 receives rank 0's tokens after nothing, then its own; worst-case padding rows at end
    masks = [
        torch.tensor([[False, True], [False, True]]),
        torch.tensor([[False, True]]),
    ]
    x1 = torch.tensor(
        [[1.0], [2.0], [3.0], [99.0], [99.0]], dtype=BF16
    )  # 3 real rows + padding
    x0 = torch.zeros(0, 1, dtype=BF16)
    out0, _ = ref_combine([x0, x1], masks, rank=0)
    out1, _ = ref_combine([x0, x1], masks, rank=1)
    assert out0.flatten().tolist() == [1.0, 2.0] and out1.flatten().tolist() == [3.0]


def test_calc_diff():
    a = torch.randn(64, 32)
    assert calc_diff(a, a) == 0.0
    assert calc_diff(a, a + 1e-3) < 1e-5
    assert calc_diff(a, -a) > 0.1
    # hand value: x = 0, y = 1 -> 1 - 2*1*2/(1+4) = 0.2
    assert abs(calc_diff(torch.zeros(1), torch.ones(1)) - 0.2) < 1e-12


def test_fp8_cast_known_values():
    x = torch.zeros(3, 200, dtype=BF16)  # H not divisible by 128: S = 2, zero padding
    x[0] = 1.0
    x[1, :128] = -2.0
    x[1, 128:] = 0.5
    data, scales = per_token_cast_to_fp8(x)
    assert (
        data.shape == (3, 200)
        and data.dtype == torch.float8_e4m3fn
        and data.is_contiguous()
    )
    assert scales.shape == (3, 2) and scales.dtype == torch.float32
    assert data[0].float().eq(448.0).all()
    assert torch.equal(scales[0], torch.full((2,), 1.0) / 448.0)  # float32 division
    assert (
        data[1, :128].float().eq(-448.0).all() and data[1, 128:].float().eq(448.0).all()
    )
    assert torch.equal(scales[1], torch.tensor([2.0, 0.5]) / 448.0)
    assert data[2].float().eq(0).all()
    assert torch.equal(
        scales[2], torch.full((2,), 1e-4) / 448.0
    )  # amax clamped to 1e-4
    back = per_token_cast_back(data, scales)
    assert back.dtype == BF16 and torch.equal(back, x)


def test_fp8_round_trip_random_and_ue8m0():
    torch.manual_seed(1)
    x = torch.randn(16, 384, dtype=BF16)
    data, scales = per_token_cast_to_fp8(x)
    assert calc_diff(per_token_cast_back(data, scales), x) < 1e-3
    # column-major scales give the same result
    assert torch.equal(
        per_token_cast_back(data, scales.t().contiguous().t()),
        per_token_cast_back(data, scales),
    )
    # UE8M0: bytes (k + 127) packed little-endian 4 per int32 (docs/semantics/deepep-api.md §6.4)
    exps = torch.tensor([[127, 128, 126, 130]], dtype=torch.uint8)  # 1, 2, 0.5, 8
    packed = exps.view(torch.int32)  # [1, 1]
    ones = torch.ones(1, 512).to(torch.float8_e4m3fn)
    back = per_token_cast_back(ones, packed, dtype=torch.float32)
    assert back[0, ::128].tolist() == [1.0, 2.0, 0.5, 8.0]


def test_e4m3_encoder_hand_codes_and_torch_agreement():
    # By hand: ties to the even code (1.0625 -> 1.0, 1.1875 -> 1.25, 336 -> 320, 2^-10 -> 0,
    # 3 * 2^-10 -> 2^-8), saturation (464 and inf -> 448), NaN -> 0x7F, the sign bit of -0.0.
    v = np.array([1.0625, 1.1875, 336.0, 2.0**-10, 3 * 2.0**-10, 464.0, np.inf, -np.inf, np.nan, -0.0, 0.875, 240.0],
                 dtype=np.float32)
    assert _e4m3_codes_satfinite(v).tolist() == [0x38, 0x3A, 0x7A, 0x00, 0x02, 0x7E, 0x7E, 0xFE, 0x7F, 0x80, 0x36, 0x77]
    # Finite values within range: the same codes as torch's round-to-nearest-even cast.
    g = torch.Generator().manual_seed(3)
    x = torch.randn(200_000, generator=g) * torch.logspace(-12, 2.5, 200_000)
    want = x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    assert np.array_equal(_e4m3_codes_satfinite(x.numpy()), want)


def test_ll_cast_kernel_order_hand_values():
    # docs/semantics/deepep-api.md §6.4: 448 / 0.1875 is one float32 division; times 0.140625 it is 336
    # exactly, which rounds to 320. NaN is left out of amax; an all-zero group takes the 1e-4 floor.
    x = torch.zeros(3, 512)
    x[0, 0], x[0, 1] = 0.1875, 0.140625
    x[1, 0], x[1, 1] = float("nan"), 2.0
    data, sf = ref_ll_cast_fp8(x)
    inv448 = np.float32(1) / np.float32(448)
    assert data.view(torch.uint8)[0, :2].tolist() == [0x7E, 0x7A]
    assert data.view(torch.uint8)[1, :2].tolist() == [0x7F, 0x7E] and sf[1, 0].item() == float(2 * inv448)
    assert sf[2].tolist() == [float(np.float32(1e-4) * inv448)] * 4
    _, sf_r = ref_ll_cast_fp8(x, round_scale=True)
    _, packed = ref_ll_cast_fp8(x, round_scale=True, use_ue8m0=True)
    # 0.1875/448 = 2^-11.2 -> 2^-11; 2/448 = 2^-7.8 -> 2^-7; 1e-4/448 = 2^-22.1 -> 2^-22
    assert sf_r[:, 0].tolist() == [2.0**-11, 2.0**-7, 2.0**-22]
    assert packed.shape == (3, 1) and packed.view(torch.uint8).view(3, 4)[:, 0].tolist() == [116, 120, 105]


def test_align_up():
    assert [align_up(v, 4) for v in (0, 1, 4, 5)] == [0, 4, 4, 8]
    assert align_up(7, 1) == 7
