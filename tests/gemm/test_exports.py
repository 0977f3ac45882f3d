"""DeepGEMM's names at the top level: every codec, scale helper, weight-cache control and GEMM the gemm room
exports resolves as ``deepep_ascend.<name>`` (ported code changes only its imports), from the module that
holds it: the gemm room's, or for the integer rounding every room shares, the ``rounding`` leaf."""

from __future__ import annotations

import pytest

import deepep_ascend
from deepep_ascend import gemm

DEEP_GEMM_NAMES = [
    "FP4_E2M1_MAX", "FP8_E4M3_MAX", "align", "cast_back_from_fp4", "cast_to_e4m3", "ceil_div", "ceil_to_ue8m0",
    "clear_dequantized_weight_cache", "dequantize_e2m1", "dequantize_weights", "dequantized_weight_cache_info",
    "e4m3_to_float", "get_mn_major_tma_aligned_packed_ue8m0_tensor", "get_mn_major_tma_aligned_tensor",
    "get_tma_aligned_size", "LOGFMT_BODY_BYTES", "LOGFMT_GROUP", "LOGFMT_META_BYTES", "LOGFMT_TAIL_BYTES",
    "logfmt10_decode", "logfmt10_encode", "logfmt10_group_mask", "logfmt10_wire_bytes", "low_latency_cast_to_fp8",
    "pack_fp4", "pack_ue8m0_pairs_mn_major", "pack_ue8m0_to_int", "per_block_cast_back", "per_block_cast_to_fp8",
    "per_channel_cast_to_fp8", "per_token_cast_back", "per_token_cast_to_fp4", "per_token_cast_to_fp8",
    "quantize_e2m1", "set_dequantized_weight_cache", "transform_sf_into_required_layout", "ue8m0_bytes",
    "unpack_fp4", "unpack_ue8m0_from_int", "WeightCacheInfo", "bf16_gemm_nn", "bf16_gemm_nt", "bf16_gemm_tn",
    "bf16_gemm_tt", "bf16_m_grouped_gemm_nt_masked", "fp8_fp4_gemm_nn", "fp8_fp4_gemm_nt", "fp8_fp4_gemm_tn",
    "fp8_fp4_gemm_tt", "fp8_gemm_nn", "fp8_gemm_nt", "fp8_gemm_tn", "fp8_gemm_tt", "fp8_m_grouped_gemm_nt_masked",
    "get_k_alignment_for_contiguous_layout", "get_m_alignment_for_contiguous_layout",
    "get_mk_alignment_for_contiguous_layout", "get_theoretical_mk_alignment_for_contiguous_layout",
    "k_grouped_bf16_gemm_tn_contiguous", "k_grouped_fp8_gemm_nt_contiguous", "k_grouped_fp8_gemm_tn_contiguous",
    "m_grouped_bf16_gemm_nn_contiguous", "m_grouped_bf16_gemm_nt_contiguous", "m_grouped_bf16_gemm_nt_masked",
    "m_grouped_fp8_fp4_gemm_nn_contiguous", "m_grouped_fp8_fp4_gemm_nt_contiguous",
    "m_grouped_fp8_fp4_gemm_nt_masked", "m_grouped_fp8_gemm_nn_contiguous", "m_grouped_fp8_gemm_nt_contiguous",
    "m_grouped_fp8_gemm_nt_masked", "set_mk_alignment_for_contiguous_layout",
]


# names the gemm room re-exports from a leaf module (tests/test_layering.py's LEAVES)
FROM_LEAVES = {"align": "deepep_ascend.rounding", "ceil_div": "deepep_ascend.rounding"}


def test_gemm_exports_exactly_deep_gemms_names():
    assert sorted(gemm.__all__) == sorted(DEEP_GEMM_NAMES)


@pytest.mark.parametrize("name", DEEP_GEMM_NAMES)
def test_each_name_resolves_at_the_top_level(name):
    obj = getattr(deepep_ascend, name)
    assert name in deepep_ascend.__all__ and obj is getattr(gemm, name)
    home = getattr(obj, "__module__", None)
    assert home is None or home == FROM_LEAVES.get(name) or home.startswith("deepep_ascend.gemm."), (name, home)
    assert name not in FROM_LEAVES or home == FROM_LEAVES[name], (name, home)
