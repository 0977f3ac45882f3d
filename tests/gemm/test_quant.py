"""Codecs in deepep_ascend.gemm (fp8, fp4, scales, logfmt, dequant, weight_cache): bit patterns derived by
hand from docs/semantics/mega-moe.md §4 and docs/semantics/deepep-api.md §4.8/§6.4, round trips, the reference.py
oracle, and bad inputs.

Single-process and tiny: every rank of the MPI suite runs them independently (no collectives).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import deepep_ascend as dg
from tests.support import reference

F32 = torch.float32
E4M3 = torch.float8_e4m3fn


def i32(u: int) -> int:
    """An unsigned 32-bit pattern as the signed int32 torch stores."""
    return u - (1 << 32) if u >= 1 << 31 else u


def e4m3_bytes(t: torch.Tensor) -> list:
    return t.view(torch.uint8).tolist()


# ----------------------------------------------------------------------------------------------
# UE8M0


def test_ceil_to_ue8m0_from_the_bits():
    x = torch.tensor([1.0, 1.5, 2.0, 3.0, 0.25, 0.3, -3.0, 0.0, 2.0**-130, 2.0**127 * 1.5])
    want = [1.0, 2.0, 2.0, 4.0, 0.25, 0.5, 4.0, 2.0**-126, 2.0**-126, 2.0**127]
    # 0 -> exponent byte 0 clamped to 1; a subnormal has exponent 0 plus a mantissa bit -> 1;
    # 1.5 * 2^127 would need byte 255 -> clamped to 254.
    assert dg.ceil_to_ue8m0(x).tolist() == want
    with pytest.raises(TypeError, match="x"):
        dg.ceil_to_ue8m0(torch.tensor([1, 2]))


def test_ue8m0_bytes_and_int32_packing():
    sf = torch.tensor([[1.0, 2.0, 0.5, 8.0, 2.0**-7]])
    assert dg.ue8m0_bytes(sf).tolist() == [[127, 128, 126, 130, 120]]
    packed = dg.pack_ue8m0_to_int(sf)
    assert packed.dtype == torch.int32 and packed.shape == (1, 2)
    # little-endian: byte j of word c is group 4c+j; groups 5..7 are padding (127 = 1.0)
    assert packed.tolist() == [[i32(0x827E807F), i32(0x7F7F7F78)]]
    back = dg.unpack_ue8m0_from_int(packed)
    assert back.tolist() == [[1.0, 2.0, 0.5, 8.0, 2.0**-7, 1.0, 1.0, 1.0]]
    # byte 0 is 2^-127 (subnormal), 255 is NaN (docs/semantics/mega-moe.md §4)
    special = dg.unpack_ue8m0_from_int(torch.tensor([[0, 255]], dtype=torch.uint8))
    assert special[0, 0].item() == 2.0**-127 and torch.isnan(special[0, 1])
    with pytest.raises(ValueError, match="powers of two"):
        dg.pack_ue8m0_to_int(torch.tensor([3.0]))
    with pytest.raises(ValueError, match="powers of two"):
        dg.pack_ue8m0_to_int(torch.tensor([0.0]))
    with pytest.raises(TypeError, match="packed_sf"):
        dg.unpack_ue8m0_from_int(torch.tensor([1.0]))


def test_mn_major_tma_aligned_layouts():
    exps = torch.arange(25, dtype=F32).reshape(5, 5) - 12  # exponents -12..12
    sf = torch.pow(2.0, exps)
    packed = dg.get_mn_major_tma_aligned_packed_ue8m0_tensor(sf)
    assert packed.shape == (5, 2) and packed.stride() == (1, 8)  # align(5, 4) = 8
    assert torch.equal(packed, dg.pack_ue8m0_to_int(sf))
    assert (packed[0, 0].item() & 0xFF) == 127 - 12  # group 0 of row 0 in the low byte
    fl = dg.get_mn_major_tma_aligned_tensor(sf)
    assert fl.stride() == (1, 8) and torch.equal(fl, sf)
    assert dg.get_mn_major_tma_aligned_tensor(fl) is fl
    batched = dg.get_mn_major_tma_aligned_packed_ue8m0_tensor(sf.expand(3, 5, 5))
    assert batched.shape == (3, 5, 2) and batched.stride() == (16, 1, 8)
    assert dg.get_tma_aligned_size(5, 4) == 8 and dg.get_tma_aligned_size(5, 2) == 8
    assert dg.get_tma_aligned_size(9, 1) == 16


def test_ascend_pair_packing():
    sf = torch.tensor([[1.0, 2.0, 4.0], [0.5, 0.25, 1.0], [8.0, 1.0, 2.0]])
    pairs = dg.pack_ue8m0_pairs_mn_major(sf)
    assert pairs.dtype == torch.int16 and pairs.shape == (3, 2) and pairs.stride() == (1, 8)
    # row 0: bytes 127,128 | 129,pad 127 -> 0x807F, 0x7F81
    assert pairs[0].tolist() == [0x807F - 0x10000, 0x7F81]
    assert pairs[1].tolist() == [0x7D7E, 0x7F7F]
    assert dg.pack_ue8m0_pairs_mn_major(pairs) is pairs  # already packed: reused as is
    # from DeepGEMM int32 words (4 groups each, padded with 127): the same pairs, plus pad pairs
    from_int = dg.pack_ue8m0_pairs_mn_major(dg.pack_ue8m0_to_int(sf))
    assert torch.equal(from_int, pairs)
    assert dg.unpack_ue8m0_from_int(pairs)[:, :3].tolist() == sf.tolist()
    with pytest.raises(TypeError, match="sf"):
        dg.pack_ue8m0_pairs_mn_major(torch.ones(2, 2, dtype=torch.float64))


# ----------------------------------------------------------------------------------------------
# FP8


def test_e4m3_rounding_and_saturation():
    x = torch.tensor([448.0, 224.0, -1.0, 0.3, 17.0, 19.0, 1000.0, -1000.0, 464.0])
    # 0.3 -> 0.3125 (0 0101 010); 17 ties to even 16 (0 1011 000); 19 ties to even 20
    # (0 1011 010); beyond 448 saturates to 448 (0x7E) / -448 (0xFE).
    assert e4m3_bytes(dg.cast_to_e4m3(x)) == [0x7E, 0x76, 0xB8, 0x2A, 0x58, 0x5A, 0x7E, 0xFE, 0x7E]


def _e4m3_value(code: int) -> float:
    """The e4m3fn value of one byte from its fields (independent of torch's cast)."""
    sign = -1.0 if code & 0x80 else 1.0
    e, m = (code >> 3) & 0xF, code & 0x7
    if e == 0xF and m == 0x7:
        return math.nan
    return sign * (m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "bytes"])
def test_e4m3_to_float_every_code(layout):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    want = torch.tensor([_e4m3_value(c) for c in range(256)], dtype=torch.float64)
    assert want[0x38] == 1.0 and want[0x7E] == 448.0 and want[0x01] == 2.0 ** -9 and want[0x80] == 0.0
    grid = codes.view(16, 16)
    x = {"contiguous": grid.view(torch.float8_e4m3fn), "transposed": grid.t().view(torch.float8_e4m3fn),
         "bytes": grid.view(torch.int8)}[layout]
    got = dg.e4m3_to_float(x)
    expect = (want.view(16, 16).t() if layout == "transposed" else want.view(16, 16)).float()
    assert got.dtype == torch.float32 and got.shape == x.shape
    nan = expect.isnan()
    assert torch.equal(got.isnan(), nan) and int(nan.sum()) == 2
    assert torch.equal(got[~nan].view(torch.int32), expect[~nan].view(torch.int32))  # signed zeros too
    torch_bits = x.view(torch.float8_e4m3fn).float().view(torch.int32)  # NaN payloads: torch's own cast
    assert torch.equal(got.view(torch.int32)[nan], torch_bits[nan])
    out = torch.full(x.shape, 7.0)
    assert dg.e4m3_to_float(x, out=out) is out and torch.equal(out.view(torch.int32), got.view(torch.int32))
    for code in (0x7F, 0xFF, 0x80):  # 0-d: NaN payloads and -0.0 as torch's cast
        one = torch.tensor([code], dtype=torch.int32).to(torch.uint8)[0].view(torch.float8_e4m3fn)
        assert dg.e4m3_to_float(one).shape == () and torch.equal(dg.e4m3_to_float(one).view(torch.int32),
                                                                  one.float().view(torch.int32))
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        dg.e4m3_to_float(torch.zeros(4))
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        dg.e4m3_to_float([1, 2])
    with pytest.raises(ValueError, match="out must be a float32 tensor"):
        dg.e4m3_to_float(x, out=torch.empty(3))
    with pytest.raises(ValueError, match="out must be a float32 tensor"):
        dg.e4m3_to_float(x, out="abc")


def test_per_token_cast_hand_values():
    x = torch.zeros(2, 130)
    x[0, :6] = torch.tensor([448.0, 224.0, -1.0, 0.3, 17.0, 19.0])
    x[0, 128:] = torch.tensor([3.5, -7.0])  # partial last group (2 of 128 channels)
    data, sf = dg.per_token_cast_to_fp8(x)
    assert data.dtype == E4M3 and data.shape == (2, 130) and sf.shape == (2, 2)
    # amax 448 -> scale 1; amax 7 -> 7/448 = 2^-6, data = x * 64; row 1 all zero -> 1e-4 floor
    assert sf[0].tolist() == [1.0, 2.0**-6]
    assert torch.equal(sf[1], torch.tensor([1e-4, 1e-4]) / 448.0)
    assert e4m3_bytes(data[0, :6]) == [0x7E, 0x76, 0xB8, 0x2A, 0x58, 0x5A]
    assert e4m3_bytes(data[0, 128:]) == [0x76, 0xFE]  # 224, -448
    assert e4m3_bytes(data[1]) == [0] * 130
    back = dg.per_token_cast_back(data, sf, dtype=F32)
    assert back[0, :6].tolist() == [448.0, 224.0, -1.0, 0.3125, 16.0, 20.0]
    assert back[0, 128:].tolist() == [3.5, -7.0]


def test_per_token_cast_ue8m0_hand_values():
    x = torch.zeros(1, 256)
    x[0, 0] = 449.0  # 449/448 > 1 -> scale 2 (byte 128); 449/2 = 224.5 -> 224
    x[0, 128] = -7.0  # 7/448 = 2^-6 exactly -> byte 121
    data, sf = dg.per_token_cast_to_fp8(x, use_ue8m0=True)
    assert sf.tolist() == [[2.0, 2.0**-6]]
    assert e4m3_bytes(data[0, [0, 128]]) == [0x76, 0xFE]
    _, packed = dg.per_token_cast_to_fp8(x, True, 128, True)
    assert packed.tolist() == [[i32(0x7F7F7980)]]
    # gran 32 (MX): 8 groups -> 2 words; empty groups: 1e-4/448 = 2^-22.09 -> 2^-22 (byte 105)
    _, packed32 = dg.per_token_cast_to_fp8(x, True, 32, True)
    assert packed32.tolist() == [[i32(0x69696980), i32(0x69696979)]]
    assert torch.equal(
        dg.per_token_cast_back(data, packed), dg.per_token_cast_back(data, sf)
    )


def test_per_token_cast_matches_reference_oracle():
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(4, 300, generator=g) * 3).to(torch.bfloat16)
    data, sf = dg.per_token_cast_to_fp8(x, scale_style="deepep")
    rdata, rsf = reference.per_token_cast_to_fp8(x)
    assert torch.equal(data.view(torch.uint8), rdata.view(torch.uint8))
    assert torch.equal(sf, rsf)
    assert torch.equal(dg.per_token_cast_back(data, sf), reference.per_token_cast_back(rdata, rsf))
    # round trip error: half an e4m3 ulp (2^-4 relative) of the group amax at most
    back = dg.per_token_cast_back(*dg.per_token_cast_to_fp8(x.float()), dtype=F32)
    assert ((back - x.float()).abs() <= x.float().abs() / 16 + 1e-6).all()


def test_deepep_helper_and_low_latency_kernel_casts_are_distinct_recipes():
    # docs/semantics/deepep-api.md §4.8 / §6.4: DeepEP's torch helper multiplies by `448.0 / amax`, a
    # reciprocal then a product; its LL kernel divides once. amax 0.1875, x 0.140625: the kernel's
    # product is 336 exactly (a tie -> 320, 0x7A), the helper's one ulp above (-> 352, 0x7B).
    x = torch.zeros(1, 128, dtype=torch.bfloat16)
    x[0, 0], x[0, 1] = 0.1875, 0.140625
    helper, helper_sf = dg.per_token_cast_to_fp8(x, scale_style="deepep")
    kernel, kernel_sf = dg.low_latency_cast_to_fp8(x)
    amax = torch.tensor([0.1875])
    assert (x.float()[0, 1] * (448.0 / amax)).item() == float.fromhex("0x1.500002p+8")  # torch's own `448.0 / t`
    assert e4m3_bytes(helper[0, :2]) == [0x7E, 0x7B] and e4m3_bytes(kernel[0, :2]) == [0x7E, 0x7A]
    assert helper_sf.item() == (amax / 448.0).item() and kernel_sf.item() == (amax * (1 / torch.tensor(448.0))).item()


def test_low_latency_cast_deepep_rules():
    x = torch.zeros(2, 512)
    x[0, 0] = 3.0
    x[1, 0] = 448.0
    x[1, 128] = 7.0
    data, sf = dg.low_latency_cast_to_fp8(x)
    # 3 * f32(1/448): f32(1/448) = 0x1.24924ap-9; 3 * that = 0x1.b6db6f(p-8) exactly, a tie at
    # fp32 precision -> even 0x1.b6db70p-8, one ulp above 3/448 = 0x1.b6db6ep-8.
    assert sf[0, 0].item() == float.fromhex("0x1.b6db70p-8")
    assert sf[0, 0].item() != torch.tensor(3.0 / 448.0, dtype=F32).item()
    assert e4m3_bytes(data[0, :1]) == [0x7E]  # 3 * (448/3) = 448
    assert sf[1, :2].tolist() == [1.0, 2.0**-6]
    d_r, s_r = dg.low_latency_cast_to_fp8(x, round_scale=True)
    # ceil(log2(0x1.b6db70p-8)) = -7 -> data 3 * 128 = 384 (0 1111 100)
    assert s_r[0, 0].item() == 2.0**-7 and e4m3_bytes(d_r[0, :1]) == [0x7C]
    _, s_u = dg.low_latency_cast_to_fp8(x, round_scale=True, use_ue8m0=True)
    assert s_u.dtype == torch.int32 and s_u.shape == (2, 1)
    # row 1: groups 448 -> 2^0 (127), 7 -> 2^-6 (121), zero groups -> 2^-22 (105)
    assert s_u[1].tolist() == [i32(0x6969797F)]
    with pytest.raises(ValueError, match="round_scale"):
        dg.low_latency_cast_to_fp8(x, use_ue8m0=True)


def _check_ll_cast(d, s, ref_d, ref_s, use_ue8m0, skip=None):
    """``(d, s)`` against the oracle's ``(ref_d, ref_s)`` bit for bit: NaN codes only as NaN (their sign bit is
    unspecified, docs/semantics/deepep-api.md §6.4); ``skip`` ``[n, groups]`` leaves groups out."""
    n, h = d.shape
    keep = torch.ones(n, h // 128, dtype=torch.bool) if skip is None else ~skip
    d8, r8 = d.view(torch.uint8).view(n, -1, 128)[keep], ref_d.view(torch.uint8).view(n, -1, 128)[keep]
    nan = (r8 & 0x7F) == 0x7F  # e4m3fn NaN: S.1111.111
    assert torch.equal((d8 & 0x7F) == 0x7F, nan)
    bad = (d8 != r8) & ~nan
    assert not bool(bad.any()), f"{int(bad.sum())} codes differ, first {d8[bad][:4].tolist()} vs {r8[bad][:4].tolist()}"
    if use_ue8m0:
        s, ref_s = s.contiguous().view(torch.uint8).view(n, -1), ref_s.contiguous().view(torch.uint8).view(n, -1)
    assert torch.equal(s[keep], ref_s[keep])


def _ll_cast_both_paths(x, round_scale, use_ue8m0):
    """The public cast and the in-place core (what ``low_latency_dispatch`` runs, writing into strided message
    rows), each as ``(data, scales)``; checks the core writes nothing outside its field."""
    n, h = x.shape
    public = dg.low_latency_cast_to_fp8(x, round_scale=round_scale, use_ue8m0=use_ue8m0)
    msgs = torch.full((n, 16 + h + 64), 0xAB, dtype=torch.uint8)  # data field at a row stride
    groups = x.float().view(n, h // 128, 128)
    sf = dg.gemm.fp8.low_latency_cast_to_fp8_(groups, msgs[:, 16:16 + h].view(torch.float8_e4m3fn), round_scale)
    assert bool((msgs[:, :16] == 0xAB).all()) and bool((msgs[:, 16 + h:] == 0xAB).all())  # nothing outside
    core = (msgs[:, 16:16 + h].view(torch.float8_e4m3fn), dg.pack_ue8m0_to_int(sf) if use_ue8m0 else sf)
    return public, core


LL_CAST_MODES = [(False, False), (True, False), (True, True)]


@pytest.mark.parametrize("round_scale,use_ue8m0", LL_CAST_MODES)
def test_low_latency_cast_matches_reference_and_in_place_core(round_scale, use_ue8m0):
    # Magnitudes 1e-8..1e8, zeros, -0.0 groups, +-inf and NaN: both paths against the oracle written
    # from DeepEP's kernel, every code and scale (a NaN element is left out of its group's amax).
    # The one exception is documented (docs/semantics/deepep-api.md §6.4): with round_scale a group
    # holding an infinity is outside DeepEP's domain; here its scale clamps to 2^127 and the
    # infinity saturates to +-448.
    g = torch.Generator().manual_seed(7)
    n, h = 24, 1024
    x = (torch.randn(n, h, generator=g) * torch.logspace(-8, 8, n).unsqueeze(1)).to(torch.bfloat16)
    x[1, :128] = 0.0
    x[2, 128:256] = -0.0
    x[3, 7], x[4, 300], x[5, 9] = float("inf"), -float("inf"), float("nan")
    ref_d, ref_s = reference.ref_ll_cast_fp8(x, round_scale, use_ue8m0)
    inf = x.isinf()
    inf_groups = inf.view(n, h // 128, 128).any(-1)
    for d, s in _ll_cast_both_paths(x, round_scale, use_ue8m0):
        _check_ll_cast(d, s, ref_d, ref_s, use_ue8m0, skip=inf_groups if round_scale else None)
        d8 = d.view(torch.uint8)
        assert (int(d8[5, 9]) & 0x7F) == 0x7F and int(((d8[5, :128] & 0x7F) == 0x7F).sum()) == 1  # NaN alone
        if round_scale:
            assert d8[inf].tolist() == [0x7E, 0xFE]
            sw = s.contiguous().view(torch.uint8).view(n, -1) if use_ue8m0 else s
            assert sw[inf_groups].tolist() == ([254, 254] if use_ue8m0 else [2.0**127] * 2)
        else:  # scale 448 / inf = 0: the infinity is NaN, the rest of its group +-0, stored scale inf
            assert bool(((d8[inf] & 0x7F) == 0x7F).all()) and s[inf_groups].tolist() == [math.inf, math.inf]
            assert bool(((d8[3, :128] & 0x7F) == 0).logical_or_(inf[3, :128]).all())
    src = torch.randn(3, 128)
    kept = src.clone()
    dg.low_latency_cast_to_fp8(src)
    assert torch.equal(src, kept)  # a float32 input is not scaled in place


@pytest.mark.parametrize("round_scale,use_ue8m0", LL_CAST_MODES)
def test_low_latency_cast_bit_for_bit_on_a_decode_batch(round_scale, use_ue8m0):
    # DeepEP's shape (N = 256, hidden 7168, bf16): every code and scale as DeepEP's kernel computes
    # them. The plain cast's scale 448 / amax is one float32 division; as a reciprocal times 448 it
    # is one ulp off for about a quarter of the groups, moving about 0.1 % of the codes by one.
    g = torch.Generator().manual_seed(29)
    x = (torch.randn(256, 7168, generator=g) * torch.logspace(-3, 3, 256).unsqueeze(1)).to(torch.bfloat16)
    ref_d, ref_s = reference.ref_ll_cast_fp8(x, round_scale, use_ue8m0)
    for d, s in _ll_cast_both_paths(x, round_scale, use_ue8m0):
        _check_ll_cast(d, s, ref_d, ref_s, use_ue8m0)


def _special_rows() -> torch.Tensor:
    """float32 ``[12, 512]`` rows of special cases for the LL cast (four groups each), every value exact in bf16."""
    x = torch.zeros(12, 512)
    x[1, :128] = -0.0  # all -0.0: codes 0x80
    x[2, :4] = torch.tensor([5e-5, -3e-5, 1e-6, 0.0]).bfloat16().float()  # amax below the floor: the floor's scale
    x[3, 0], x[3, 1] = 0.1875, 0.140625  # 0.140625 * (448 / 0.1875) = 336 exactly: a tie -> 320
    x[4, 0] = 448.0  # scale 1: ties at e4m3 precision go to the even code
    x[4, 1:9] = torch.tensor([1.0625, 1.1875, 2.0**-10, 3 * 2.0**-10, 2.0**-7 + 2.0**-10, 17.0, 19.0, -2.0**-8])
    x[5, 0], x[5, 1:4] = 1.0, torch.tensor([2.0**-12, 2.0**-14, 2.0**-130])  # e4m3 subnormals, 0, a bf16 subnormal
    x[6, 0], x[6, 1] = 3.3895313892515355e38, -(2.0**126)  # bf16's largest: the scale about 2^-119
    x[6, 128], x[6, 129] = -2.0**-133, 2.0**-126  # a group of float32 subnormals: amax floored
    x[7, :128] = torch.linspace(-3, 3, 128).bfloat16().float()  # ordinary values
    x[7, 128:256] = torch.linspace(-448, 460, 128).bfloat16().float()  # around the e4m3 range, scale near 1
    x[8, 0], x[8, 1], x[8, 2] = float("nan"), 2.0, -1.5  # NaN left out of amax: scale 448 / 2
    x[9, :128] = float("nan")  # only NaN: amax is the floor
    x[10, 0], x[10, 1], x[10, 2] = float("inf"), -3.0, 2.0  # plain: scale 448 / inf = 0
    x[11, 128], x[11, 129] = -float("inf"), float("inf")
    x[11, 256:384] = torch.linspace(-1e-3, 1e-3, 128).bfloat16().float()  # small values next to them
    assert torch.allclose(x.bfloat16().float(), x, rtol=0, atol=0, equal_nan=True)
    return x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("round_scale,use_ue8m0", LL_CAST_MODES)
def test_low_latency_cast_special_values(round_scale, use_ue8m0, dtype):
    x = _special_rows().to(dtype)
    ref_d, ref_s = reference.ref_ll_cast_fp8(x, round_scale, use_ue8m0)
    inf_groups = x.isinf().view(x.size(0), 4, 128).any(-1)
    floor_inv = float(np.float32(1e-4) * (np.float32(1) / np.float32(448)))
    for d, s in _ll_cast_both_paths(x, round_scale, use_ue8m0):
        _check_ll_cast(d, s, ref_d, ref_s, use_ue8m0, skip=inf_groups if round_scale else None)
        b = d.view(torch.uint8)
        assert b[0].tolist() == [0] * 512 and b[1, :128].tolist() == [0x80] * 128
        sf = dg.gemm.fp8.ue8m0_byte_to_float(s.contiguous().view(torch.uint8).view(12, -1)) if use_ue8m0 else s
        if not round_scale:
            # By hand: the floor's stored scale; the tie 336 -> 320 (0x7A, 0 1111 010) where a
            # reciprocal-times-448 scale would give 336.00003 -> 352 (0x7B).
            assert sf[0].tolist() == [floor_inv] * 4 and sf[2, 0].item() == floor_inv
            assert b[3, :2].tolist() == [0x7E, 0x7A]
            # NaN left out of amax: 2 * 224 = 448, -1.5 * 224 = -336 (a tie -> -320)
            assert b[8, 1:3].tolist() == [0x7E, 0xFA] and sf[8, 0].item() == float(np.float32(2) / np.float32(448))
            assert sf[9, 0].item() == floor_inv
        # scale 1 (amax 448 is a power of two times 448 either way): the codes of x itself
        # 1.0625 -> 1.0, 1.1875 -> 1.25, 2^-10 (half the smallest subnormal) -> 0, 3 * 2^-10 -> 2^-8,
        # 2^-7 + 2^-10 -> 2^-7 (a tie between subnormal codes 4 and 5), 17 -> 16 (0x58), 19 -> 20 (0x5A),
        # -2^-8 -> 0x82
        assert sf[4, 0].item() == 1.0
        assert b[4, :9].tolist() == [0x7E, 0x38, 0x3A, 0x00, 0x02, 0x04, 0x58, 0x5A, 0x82]


def test_per_block_cast_hand_values():
    x = torch.zeros(130, 129)
    x[0, 0] = 448.0
    x[129, 128] = -7.0  # the corner tile (rows 128-129, column 128)
    x[5, 128] = 0.75  # tile (0, 1): amax 0.75 -> 0.75/448
    x[6, 128] = 0.3  # 0.3 * 448/0.75 = 179.2 -> e4m3 176; 176 * f32(0.75/448) is not a bf16
    data, sf = dg.per_block_cast_to_fp8(x)
    assert sf.shape == (2, 2)
    assert sf[0, 0].item() == 1.0 and sf[1, 1].item() == 2.0**-6
    assert sf[0, 1].item() == torch.tensor(0.75 / 448.0, dtype=F32).item()
    assert e4m3_bytes(data[[0, 129, 5], [0, 128, 128]]) == [0x7E, 0xFE, 0x7E]
    _, sfu = dg.per_block_cast_to_fp8(x, use_ue8m0=True)
    assert sfu[0, 1].item() == 2.0**-9  # 0.75/448 = 2^-9.2 -> 2^-9
    back = dg.per_block_cast_back(data, sf)
    assert back[0, 0].item() == 448.0 and back[129, 128].item() == -7.0
    w = dg.dequantize_weights(data, sf, 128, 128, cache=False)
    assert w.dtype == F32  # legacy float32 scales: not exact in bf16 -> float32
    assert torch.equal(w, back)
    # batched weights [E, N, K]
    _, sf3 = dg.per_block_cast_to_fp8(x.expand(2, 130, 129), use_ue8m0=True)
    assert sf3.shape == (2, 2, 2) and torch.equal(sf3[1], sfu)


def test_per_channel_cast():
    x = torch.zeros(256, 3)
    x[3, 1] = 14.0
    data, sf = dg.per_channel_cast_to_fp8(x, use_ue8m0=True)
    assert sf.shape == (2, 3) and sf[0, 1].item() == 2.0**-5  # 14/448 = 2^-5
    assert e4m3_bytes(data[3, 1:2]) == [0x7E]
    with pytest.raises(ValueError, match="gran_k"):
        dg.per_channel_cast_to_fp8(torch.zeros(100, 3))


# ----------------------------------------------------------------------------------------------
# FP4


def test_e2m1_codes_ties_and_saturation():
    vals = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    assert dg.quantize_e2m1(vals).tolist() == list(range(8))
    assert dg.quantize_e2m1(-vals[1:]).tolist() == list(range(9, 16))
    # ties go to the smaller magnitude; 100 saturates; -0 and tiny negatives have no sign bit
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.01, 100.0, -0.0, -0.2, -0.26])
    assert dg.quantize_e2m1(ties).tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 7, 0, 0, 9]
    assert dg.dequantize_e2m1(torch.arange(16, dtype=torch.uint8)).tolist() == [
        0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
    ]  # fmt: skip
    codes = dg.quantize_e2m1(torch.tensor([1.0, -3.0, 6.0, 0.5]))  # 2, 13, 7, 1
    packed = dg.pack_fp4(codes)
    assert packed.dtype == torch.int8 and packed.view(torch.uint8).tolist() == [0xD2, 0x17]
    assert dg.unpack_fp4(packed).tolist() == [2, 13, 7, 1]
    # torch's float4_e2m1fn_x2 is storage only: accepted as raw bytes
    assert dg.unpack_fp4(packed.view(torch.uint8).view(torch.float4_e2m1fn_x2)).tolist() == [
        2, 13, 7, 1,
    ]  # fmt: skip
    with pytest.raises(ValueError, match="even"):
        dg.pack_fp4(torch.zeros(3, dtype=torch.uint8))


def test_per_token_cast_to_fp4_hand_values():
    x = torch.zeros(1, 64)
    x[0, :8] = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, -4.0, 6.0])  # amax 6 -> scale 1
    x[0, 32] = 7.0  # amax 7: 7/6 -> scale 2 (byte 128); 7/2 = 3.5 ties down to 3 -> code 5
    x[0, 33] = -1.75  # -0.875 -> 1.0 (above 0.75) -> code 10
    packed, sf = dg.per_token_cast_to_fp4(x, use_ue8m0=True, gran_k=32)
    assert sf.tolist() == [[1.0, 2.0]] and packed.shape == (1, 32)
    assert packed.view(torch.uint8)[0, :4].tolist() == [0x10, 0x32, 0x54, 0x7E]
    assert packed.view(torch.uint8)[0, 16].item() == 0xA5
    _, sfp = dg.per_token_cast_to_fp4(x, True, 32, True)
    assert sfp.tolist() == [[i32(0x7F7F807F)]]
    back = dg.cast_back_from_fp4(packed, sfp, 32, use_packed_ue8m0=True)
    assert back[0, :8].tolist() == x[0, :8].tolist()
    assert back[0, 32:34].tolist() == [6.0, -2.0]
    # exactness: dequantized FP4 weights with UE8M0 scales come back as bf16
    w = dg.dequantize_weights(packed.unsqueeze(0), sfp.unsqueeze(0), 1, 32, cache=False)
    assert w.dtype == torch.bfloat16 and torch.equal(w[0].float(), back)
    with pytest.raises(ValueError, match="even"):
        dg.per_token_cast_to_fp4(torch.zeros(1, 3))


# ----------------------------------------------------------------------------------------------
# layouts, cache, errors


def test_transform_sf_into_required_layout():
    sf = torch.pow(2.0, -torch.arange(12, dtype=F32)).reshape(3, 4)  # k = 128 at gran 32
    out = dg.transform_sf_into_required_layout(sf, 3, 128, (1, 32))
    assert out.dtype == torch.int32 and out.shape == (3, 1) and out.stride(-2) == 1
    assert torch.equal(out, dg.pack_ue8m0_to_int(sf))
    assert dg.transform_sf_into_required_layout(out, 3, 128, (1, 32)) is out
    fl = dg.transform_sf_into_required_layout(sf, 3, 128, (1, 1, 32), is_sfa=True,
                                              disable_ue8m0_cast=True)
    assert fl.dtype == F32 and fl.stride() == (1, 4)
    block = torch.rand(2, 3)
    assert dg.transform_sf_into_required_layout(block, 256, 384, (128, 128)) is block
    g3 = dg.transform_sf_into_required_layout(sf.expand(2, 3, 4), 3, 128, (1, 32), num_groups=2)
    assert g3.shape == (2, 3, 1)
    with pytest.raises(ValueError, match="powers of two"):
        dg.transform_sf_into_required_layout(sf * 3, 3, 128, (1, 32))
    with pytest.raises(ValueError, match="sf must be"):
        dg.transform_sf_into_required_layout(sf, 3, 256, (1, 32))


def test_e4m3_ue8m0_round_trip_in_float32_matches_the_codec_bit_for_bit():
    """MegaMoE's activation requantisation rounds in float32 (add and subtract a power of two) instead of
    casting to e4m3 codes and back: every e4m3 value, every midpoint between neighbours (ties to even) and
    the floats either side of it, at scales from 2^-120 to 2^90, both signs, signed zeros and float32
    subnormals give torch's own cast's bits; NaN, inf and |x| >= 2^100 are declined, x untouched."""
    from deepep_ascend.gemm import fp8

    def by_torch(x):  # reference.py's formula: torch's native e4m3 cast
        grp = x.view(x.size(0), -1, 32)
        amax = grp.abs().amax(-1).clamp(min=1e-4).double()
        s = torch.pow(2.0, torch.ceil(torch.log2(amax / 448.0))).float().unsqueeze(-1)
        return ((grp / s).clamp(-448, 448).to(E4M3).float() * s).view_as(x)

    vals = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(E4M3).float()
    vals = torch.sort(vals[torch.isfinite(vals)].unique()).values
    mids = (vals[1:] + vals[:-1]) / 2
    base = torch.cat([vals, mids, torch.nextafter(mids, torch.tensor(1e9)),
                      torch.nextafter(mids, torch.tensor(-1e9))])
    base = torch.cat([base, torch.zeros((-base.numel()) % 31)]).view(-1, 31)
    checked = 0
    for e in (-120, -30, -7, 0, 3, 17, 90):
        for sign in (1.0, -1.0):
            x = torch.cat([torch.full((base.size(0), 1), 448.0), base * sign], 1) * 2.0**e  # amax = 448 * 2^e
            x[0, 5], x[1, 7] = -0.0, 2.0**-140 * sign  # a signed zero, a float32 subnormal
            got = x.clone()
            assert fp8.e4m3_ue8m0_round_trip_(got, 32)
            assert torch.equal(got.view(torch.int32), by_torch(x).view(torch.int32)), (e, sign)
            checked += x.numel()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g) * 2.0 ** torch.randint(-40, 40, (64, 1), generator=g).float()
    got = x.clone()
    assert fp8.e4m3_ue8m0_round_trip_(got, 32) and torch.equal(got.view(torch.int32), by_torch(x).view(torch.int32))
    assert checked > 10000
    for bad in (float("nan"), float("inf"), 2.0**100):
        x = torch.ones(2, 64)
        x[1, 3] = bad
        assert not fp8.e4m3_ue8m0_round_trip_(x, 32) and x[0].eq(1).all()


def test_dequantized_weight_cache_identity_and_version():
    w = torch.ones(2, 4, 128)
    data, sf = dg.per_token_cast_to_fp8(w, True, 128)
    first = dg.dequantize_weights(data, sf, 1, 128)
    assert first.dtype == torch.bfloat16 and bool((first == 1).all())
    assert dg.dequantize_weights(data, sf, 1, 128) is first  # cached
    data.view(torch.uint8)[0, 0, 0] = 0x76  # in-place write bumps the version: 224 * 2^-8
    again = dg.dequantize_weights(data, sf, 1, 128)
    assert again is not first and again[0, 0, 0].item() == 224.0 * sf[0, 0, 0].item()
    dg.clear_dequantized_weight_cache()


def test_weight_cache_keeps_every_live_weight_within_its_byte_budget():
    """The caches are bounded by bytes, not by a count of entries: 80 live weights (more than the 64 entries
    the caches held before) are dequantized once each and then hit. Under a budget of two copies the least
    recently used one is dropped (a RuntimeWarning says so once), a copy larger than the budget is not cached,
    and lowering the budget drops copies at once."""
    import warnings

    from deepep_ascend.gemm import weight_cache as wc

    old_max = dg.dequantized_weight_cache_info().max_bytes
    dg.clear_dequantized_weight_cache()
    g = torch.Generator().manual_seed(7)
    ws = [dg.per_token_cast_to_fp8(torch.randn(2, 8, 128, generator=g), True, 128) for _ in range(80)]
    try:
        firsts = [dg.dequantize_weights(d, s, 1, 128) for d, s in ws]
        again = [dg.dequantize_weights(d, s, 1, 128) for d, s in ws]
        assert all(a is b for a, b in zip(firsts, again))
        one = firsts[0].untyped_storage().nbytes()
        assert one == 2 * 8 * 128 * 2
        info = dg.dequantized_weight_cache_info()
        assert (info.hits, info.misses, info.evictions, info.entries, info.nbytes) == (80, 80, 0, 80, 80 * one)

        dg.set_dequantized_weight_cache(max_bytes=2 * one)  # keeps the two most recently used: ws[78], ws[79]
        assert dg.dequantized_weight_cache_info()[2:5] == (78, 2, 2 * one)
        assert dg.dequantize_weights(*ws[79], 1, 128) is firsts[79]
        wc._cache_warned = False
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rebuilt = dg.dequantize_weights(*ws[0], 1, 128)  # drops ws[78], the least recently used
            dg.dequantize_weights(*ws[1], 1, 128)  # drops ws[79]
        assert rebuilt is not firsts[0] and torch.equal(rebuilt, firsts[0])
        assert len(caught) == 1 and issubclass(caught[0].category, RuntimeWarning)
        assert "max_bytes" in str(caught[0].message) and caught[0].filename == __file__
        info = dg.dequantized_weight_cache_info()
        assert (info.evictions, info.entries, info.nbytes, info.max_bytes) == (80, 2, 2 * one, 2 * one)
        assert dg.dequantize_weights(*ws[0], 1, 128) is rebuilt

        big_d, big_s = dg.per_token_cast_to_fp8(torch.randn(5, 8, 128, generator=g), True, 128)
        wc._cache_warned = False
        with pytest.warns(RuntimeWarning, match="does not fit it"):
            big = dg.dequantize_weights(big_d, big_s, 1, 128)  # 2.5x the budget: built, not cached
        assert dg.dequantize_weights(big_d, big_s, 1, 128) is not big
        assert dg.dequantized_weight_cache_info()[3:5] == (2, 2 * one)

        for bad in (-1, 1.5, True, "8", torch.tensor(True), torch.tensor([5]), np.array([5])):
            with pytest.raises(ValueError, match="max_bytes"):
                dg.set_dequantized_weight_cache(max_bytes=bad)
        for bad in ("False", 0, None.__class__):
            with pytest.raises(ValueError, match="enabled"):
                dg.set_dequantized_weight_cache(bad)
        dg.set_dequantized_weight_cache(max_bytes=np.int64(3 * one))  # any integer type
        assert dg.dequantized_weight_cache_info().max_bytes == 3 * one
        dg.set_dequantized_weight_cache(False)
        dg.set_dequantized_weight_cache(max_bytes=4 * one)  # the budget alone: the caches stay off
        assert dg.dequantize_weights(*ws[5], 1, 128) is not dg.dequantize_weights(*ws[5], 1, 128)
        assert dg.dequantized_weight_cache_info()[3:] == (0, 0, 4 * one)
    finally:
        dg.set_dequantized_weight_cache(True, max_bytes=old_max)
        dg.clear_dequantized_weight_cache()


def test_weight_cache_budget_from_the_environment(monkeypatch):
    """``DEEPEP_ASCEND_WEIGHT_CACHE_BYTES`` sets the initial budget (default: a quarter of physical memory),
    read when the caches are first used: a bad value still lets the package import, and then raises
    ``SettingError`` naming the variable and the value at the first use, unless a budget was set first."""
    import os
    import subprocess
    import sys

    from deepep_ascend.gemm import weight_cache
    from deepep_ascend.settings import SettingError

    name = "DEEPEP_ASCEND_WEIGHT_CACHE_BYTES"

    def budget(value, set_first=None):
        """The budget a process would start with, ``value`` in the environment (None: unset)."""
        monkeypatch.setattr(weight_cache, "_cache_max_bytes", None)  # as in a fresh process: not read yet
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
        if set_first is not None:
            dg.set_dequantized_weight_cache(max_bytes=set_first)
        return dg.dequantized_weight_cache_info().max_bytes

    assert budget(None) == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    assert budget("12345") == 12345 and budget(" 0 ") == 0
    for bad in ("-5", "lots", "4GiB"):
        with pytest.raises(SettingError) as info:
            budget(bad)
        assert str(info.value).startswith(f"${name} must be") and repr(bad) in str(info.value), str(info.value)
    assert budget("lots", set_first=777) == 777
    # In a fresh process: the import does not read it, the first use does.
    env = dict(os.environ, **{name: "lots"})
    r = subprocess.run([sys.executable, "-c", "import deepep_ascend as d; print('imported', flush=True); "
                        "d.dequantized_weight_cache_info()"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and r.stdout.split() == ["imported"], (r.stdout, r.stderr[-2000:])
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"deepep_ascend.settings.SettingError: ${name} must be") and "'lots'" in last, last


def test_bad_inputs_name_the_argument():
    with pytest.raises(TypeError, match="x"):
        dg.per_token_cast_to_fp8(torch.ones(2, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="x"):
        dg.per_token_cast_to_fp8(torch.ones(4))
    with pytest.raises(ValueError, match="use_packed_ue8m0"):
        dg.per_token_cast_to_fp8(torch.ones(2, 4), False, 128, True)
    with pytest.raises(ValueError, match="gran_k"):
        dg.per_token_cast_to_fp8(torch.ones(2, 4), gran_k=0)
    with pytest.raises(TypeError, match="x_fp8"):
        dg.per_token_cast_back(torch.ones(2, 4), torch.ones(2, 1))
    with pytest.raises(ValueError, match="x_scales"):
        dg.per_token_cast_back(torch.zeros(2, 256).to(E4M3), torch.ones(2, 1))
    with pytest.raises(TypeError, match="packed"):
        dg.unpack_fp4(torch.ones(2))
    with pytest.raises(ValueError, match="scales"):
        dg.dequantize_weights(torch.zeros(1, 4, 256).to(E4M3), torch.ones(1, 4, 1), cache=False)


# ----------------------------------------------------------------------------------------------
# LogFMT-10 (docs/semantics/deepep-api.md §6.3)

BF16 = torch.bfloat16


def _logfmt_scalar(group: list) -> tuple:
    """docs/semantics/deepep-api.md §6.3 by hand for one group of floats (bf16 values):
    ``(use, [(code, sign, value)])``, la/lb rounded to float32 as the codec stores them, the code formula in float32
    steps."""
    import math

    import numpy as np

    f32 = np.float32
    mags = [abs(a) for a in group]
    nz = [a for a in mags if a > 0]
    if not nz:
        return False, None
    la = f32(math.log2(max(mags)))
    lb = max(f32(math.log2(min(nz))), f32(la - f32(32)))
    if not (la < 0 and lb < la):
        return False, None
    step = f32(f32(la - lb) / f32(510))
    rho = f32(2 - math.log2((1 + 2.0 ** float(step)) / 2) / float(step))
    out = []
    for a in group:
        q = -math.inf if a == 0 else float(f32(f32(f32(f32(math.log2(abs(a))) - lb) / step) + rho))
        c = min(511, math.floor(max(q, 0)))
        v = 0.0 if c == 0 else 2.0 ** ((c - 1) * float(step) + float(lb))
        out.append((c, int(math.copysign(1, a) < 0), -v if a < 0 else v))
    return True, out


def _logfmt_values(body: torch.Tensor) -> list:
    """The 128 ten-bit values of one group's 160 body bytes: value j's low 8 bits in byte j, its
    top two bits at bits 2(j % 4) of byte 128 + j // 4."""
    b = body.tolist()
    return [b[j] | ((b[128 + j // 4] >> (2 * (j % 4))) & 3) << 8 for j in range(128)]


def test_logfmt10_hand_values_and_bit_layout():
    # amax 0.5 (la = -1), amin 2^-11 (lb = -11): step = 10/510 = 1/51, rho ~ 1.4983.
    g = torch.full((128,), 2.0**-8)  # (-8 + 11) * 51 = 153 (+ rho) -> code 154
    g[:6] = torch.tensor([0.5, -(2.0**-11), 0.0, 2.0**-6, 2.0**-6 * (1 + 2.0**-7), -(2.0**-6) * (1 - 2.0**-8)])
    x = g.to(BF16).view(1, 128)
    body, meta, tail = dg.logfmt10_encode(x)
    assert body.shape == (1, 1, 160) and body.dtype == torch.uint8 and tail.shape == (0, 96)
    assert meta.view(torch.int16).tolist() == [[[0x3F00, 0x3A00]]]  # bf16 bits of 0.5 and 2^-11
    # 0.5 -> 511; -2^-11 -> 1 | sign; 0 -> 0; 2^-6 -> 255 + rho -> 256; 2^-6·(1 + 2^-7):
    # 255 + 51·log2(1.0078) = 255.57, + rho -> 257 (past the linear midpoint of levels 256, 257);
    # -2^-6·(1 - 2^-8): 254.71 + rho -> 256 (nearest level 2^-6).
    assert _logfmt_values(body[0, 0])[:7] == [511, 0x200 | 1, 0, 256, 257, 0x200 | 256, 154]
    # Values 0-3 (0x1FF, 0x201, 0, 0x100): low bytes FF 01 00 00; top bits 1, 2, 0, 1 in byte 128
    # as 1 | 2 << 2 | 0 << 4 | 1 << 6 = 0x49.
    assert body[0, 0, :4].tolist() == [0xFF, 0x01, 0x00, 0x00] and body[0, 0, 128].item() == 0x49
    y = dg.logfmt10_decode(body, meta, tail)
    want = torch.tensor([0.5, -(2.0**-11), 0.0, 2.0**-6, 2.0**-6 * 2 ** (1 / 51), -(2.0**-6), 2.0**-8])
    assert y.dtype == F32 and y.shape == (1, 128)
    assert torch.allclose(y[0, :7], want, rtol=2e-6, atol=0) and torch.equal(y[0, 7:], y[0, 6].expand(121))
    assert dg.logfmt10_wire_bytes(meta).tolist() == [164]  # 1.25·128 + 128/32


def test_logfmt10_bf16_fallback_groups_are_exact():
    rows = torch.full((6, 128), 0.01)
    rows[0, 5] = 1.0  # la = 0: not < 0
    rows[1] = 0.25
    rows[1, ::2] = -0.25  # equal magnitudes: lb == la
    rows[2] = 0.0  # all zero: la = lb = -inf
    rows[3, 7] = float("nan")
    rows[4, 9] = -float("inf")
    rows[5, 0] = 0.5  # LogFMT: lb = log2(0.01) < la = -1
    x = rows.to(BF16)
    body, meta, tail = dg.logfmt10_encode(x)
    assert dg.logfmt10_group_mask(meta).view(-1).tolist() == [False] * 5 + [True]
    raw = x.view(torch.uint8).view(6, 256)
    assert torch.equal(body[:5, 0], raw[:5, :160]) and torch.equal(tail, raw[:5, 160:])
    assert dg.logfmt10_wire_bytes(meta).view(-1).tolist() == [260] * 5 + [164]
    y = dg.logfmt10_decode(body, meta, tail)
    assert torch.equal(y[:5].to(BF16).view(torch.int16), x[:5].view(torch.int16))  # NaN bits too
    assert torch.allclose(y[5], x[5].float(), rtol=0.007, atol=0)


def test_logfmt10_zeros_signs_and_clipped_lb():
    g = torch.linspace(-0.4, 0.4, 128)
    g[::9] = 0.0
    g[1] = -0.0
    x = g.to(BF16).view(1, 1, 128)  # leading dims are kept
    body, meta, tail = dg.logfmt10_encode(x)
    assert body.shape == (1, 1, 1, 160) and meta.shape == (1, 1, 1, 2)
    nz = x.float().abs()[x.float() != 0]
    assert meta.float().view(-1).tolist() == [0.400390625, nz.min().item()]  # amin skips the zeros
    y = dg.logfmt10_decode(body, meta, tail).view(-1)
    assert ((y == 0) == (x.view(-1).float() == 0)).all() and not (y.signbit() & (y == 0)).any()
    assert (y.sign() == x.view(-1).float().sign()).all()
    # lb clipped to la - 32: 2^-40 is below every level and decodes to 0; 2^-33 to 2^lb.
    c = torch.full((128,), 0.3)
    c[0], c[1], c[2] = 0.5, 2.0**-40, 2.0**-33
    body, meta, tail = dg.logfmt10_encode(c.to(BF16).view(1, 128))
    y = dg.logfmt10_decode(body, meta, tail)[0]
    assert y[1].item() == 0.0 and abs(y[2].item() / 2.0**-33 - 1) < 1e-6


def test_logfmt10_matches_the_scalar_formula_and_error_bound():
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(6, 512, generator=gen) * torch.rand(6, 1, generator=gen) * 0.2).to(BF16)
    x[0, :5] = 0
    x[1, 130] = 2.0**-50  # clips lb
    body, meta, tail = dg.logfmt10_encode(x)
    y = dg.logfmt10_decode(body, meta, tail)
    use = dg.logfmt10_group_mask(meta)
    # Every element of a few groups against the spec's formula evaluated one value at a time.
    for r, gi in ((0, 0), (1, 1), (2, 2), (5, 3)):
        ok, want = _logfmt_scalar(x[r, gi * 128:(gi + 1) * 128].float().tolist())
        assert ok == bool(use[r, gi])
        codes = _logfmt_values(body[r, gi])
        assert codes == [c | s << 9 for c, s, _ in want]
        got = y[r, gi * 128:(gi + 1) * 128]
        assert torch.allclose(got, torch.tensor([v for _, _, v in want], dtype=F32), rtol=3e-7, atol=0)
    # Round trip: half a level, (2^step - 1) / (2^step + 1), relative, where |x| >= 2^lb.
    m = meta.double()
    la = m[..., 0].log2()
    lb = torch.maximum(m[..., 1].log2(), la - 32)
    step = ((la - lb) / 510).repeat_interleave(128, dim=1)
    bound = (2**step - 1) / (2**step + 1) * (1 + 1e-5)
    xd = x.double()
    inside = xd.abs() >= (2**lb).repeat_interleave(128, dim=1)
    assert bool(use.all())
    assert ((y.double() - xd).abs() <= bound * xd.abs())[inside].all()
    assert ((y.double() - xd).abs() <= 2**lb.repeat_interleave(128, dim=1))[~inside].all()
    # Encoding rows one at a time gives the same bytes, decoding them the same bits.
    parts = [dg.logfmt10_encode(x[i:i + 1]) for i in range(6)]
    assert torch.equal(torch.cat([p[0] for p in parts]), body)
    assert torch.equal(torch.cat([dg.logfmt10_decode(*p) for p in parts]), y)


def test_logfmt10_bad_inputs():
    with pytest.raises(TypeError, match="x"):
        dg.logfmt10_encode(torch.zeros(2, 128))
    with pytest.raises(ValueError, match="multiple of 128"):
        dg.logfmt10_encode(torch.zeros(2, 100, dtype=BF16))
    body, meta, tail = dg.logfmt10_encode(torch.zeros(0, 256, dtype=BF16))
    assert (body.shape, meta.shape, tail.shape) == ((0, 2, 160), (0, 2, 2), (0, 96))
    assert dg.logfmt10_decode(body, meta, tail).shape == (0, 256)
    body, meta, tail = dg.logfmt10_encode(torch.zeros(2, 256, dtype=BF16))
    assert tail.shape == (4, 96) and dg.logfmt10_decode(body, meta, tail).abs().sum() == 0
    with pytest.raises(ValueError, match="tail"):
        dg.logfmt10_decode(body, meta, tail[:3])
    with pytest.raises(ValueError, match="meta"):
        dg.logfmt10_decode(body, meta[:1], tail)
    with pytest.raises(TypeError, match="body"):
        dg.logfmt10_decode(body.float(), meta, tail)


@pytest.mark.parametrize("shape", [(0, 256), (2, 0, 256)])
def test_casts_of_zero_rows(shape):
    """A rank with no tokens: every cast and its inverse keep the (empty) shapes (an ambiguous
    ``reshape(0, -1)`` once crashed them)."""
    x = torch.zeros(shape)
    data, sf = dg.per_token_cast_to_fp8(x, use_ue8m0=True)
    assert data.shape == shape and sf.shape == (*shape[:-1], 2)
    packed, sf4 = dg.per_token_cast_to_fp4(x, gran_k=32, use_packed_ue8m0=True)
    assert packed.shape == (*shape[:-1], 128) and sf4.shape == (*shape[:-1], 2)
    assert dg.unpack_fp4(packed).shape == shape and dg.pack_fp4(dg.unpack_fp4(packed)).shape == packed.shape
    assert dg.cast_back_from_fp4(packed, sf4, gran_k=32, use_packed_ue8m0=True).shape == shape


def test_fp8_decode_benchmark_checks_bits(capsys):
    """``python -m bench fp8-decode`` (docs/benchmarks.md) compares its two decoders bit for bit."""
    from bench import fp8_decode

    assert fp8_decode.main(["--rows", "4", "--hidden", "96", "--iters", "1"]) == 0
    out = capsys.readouterr().out
    assert "same bits as torch's cast (random codes, and every code incl. NaN): True" in out


def test_cast_back_takes_scales_with_any_strides():
    """MN-major packed scales of one word per row (``[M, 1]`` int32 with strides ``(1, M)``, which
    ``Tensor.contiguous`` leaves as they are) and empty tensors from numpy (strides ``(0, 0)``): the values
    of the row-major copy, through the native kernel and through the torch path."""
    import numpy as np

    from deepep_ascend.native.loader import kernels

    g = torch.Generator().manual_seed(11)
    m, k = 5, 512
    x = torch.randint(0, 0x7E, (m, k), generator=g, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    for dt, per in ((torch.int32, 4), (torch.int16, 2)):
        words = k // 128 // per
        row_major = torch.randint(120, 130, (m, words * per), generator=g, dtype=torch.int32).to(torch.uint8).view(dt)
        mn_major = torch.empty(words, m, dtype=dt).t()
        mn_major.copy_(row_major)
        assert mn_major.stride() == (1, m)
        for kernel in (kernels.dequant_rows_e4m3_bf16, None):
            real, kernels.dequant_rows_e4m3_bf16 = kernels.dequant_rows_e4m3_bf16, kernel
            try:
                exp = dg.per_token_cast_back(x, row_major, 128)
                got = dg.per_token_cast_back(x, mn_major, 128)
            finally:
                kernels.dequant_rows_e4m3_bf16 = real
            assert torch.equal(got.view(torch.int16), exp.view(torch.int16))
        assert torch.equal(dg.unpack_ue8m0_from_int(mn_major), dg.unpack_ue8m0_from_int(row_major))
    x0 = torch.from_numpy(np.zeros((0, 128), np.uint8)).view(torch.float8_e4m3fn)
    for s0 in (torch.from_numpy(np.zeros((0, 4), np.uint8)),
               torch.from_numpy(np.lib.stride_tricks.as_strided(np.zeros(1, np.int32), (0, 1), (0, 0)))):
        assert dg.per_token_cast_back(x0, s0, 32).shape == (0, 128)


def test_pair_packing_of_mn_major_words_and_empty_k():
    """``pack_ue8m0_pairs_mn_major`` takes the MN-major int32 words ``get_mn_major_tma_aligned_packed_ue8m0_tensor``
    returns for at most 4 K-groups (one word per row, a size-1 dim with a wide stride), the same as their row-major
    copy; K = 0 casts with packed UE8M0 scales give empty scales, as unpacked ones do."""
    sf = torch.tensor([[0.125, 1.0, 4.0]] * 5)
    words = dg.get_mn_major_tma_aligned_packed_ue8m0_tensor(sf)
    row_major = torch.empty(tuple(words.shape), dtype=words.dtype).copy_(words)
    assert torch.equal(dg.pack_ue8m0_pairs_mn_major(words), dg.pack_ue8m0_pairs_mn_major(row_major))
    for cast in (lambda: dg.per_token_cast_to_fp8(torch.randn(3, 0), True, 128, True),
                 lambda: dg.per_token_cast_to_fp4(torch.randn(3, 0), True, 32, True)):
        data, scales = cast()
        assert data.shape[0] == 3 and scales.shape == (3, 0)
    assert dg.pack_ue8m0_to_int(torch.ones(3, 0)).shape == (3, 0)
