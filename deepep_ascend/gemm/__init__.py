"""Kernels in DeepGEMM's role on CPU torch (with the native AMX kernel where the CPU has it): the FP8, FP4
and LogFMT codecs and their scale layouts, the dequantized-weight cache, and the grouped and dense GEMMs.

Modules:

* :mod:`.fp8`           e4m3 casts: per token, block and channel, their cast-backs, DeepEP's low-latency cast;
* :mod:`.fp4`           e2m1 (MXFP4) codes, two per byte, the per-token cast and its cast back;
* :mod:`.scales`        UE8M0 scale factors: rounding, packing, the MN-major TMA-aligned layouts;
* :mod:`.logfmt`        LogFMT-10, DeepEP's low-latency combine transport;
* :mod:`.dequant`       FP8/FP4 operands back to float; ``dequantize_weights`` (cached);
* :mod:`.weight_cache`  the caches of dequantized and packed weights and their controls;
* :mod:`.operands`      how the GEMMs read their operands (arithmetic, scale granularities);
* :mod:`.packing`       weights packed once for the AMX kernel or oneDNN, and the products on them;
* :mod:`.grouped`       m-grouped (contiguous, masked) and k-grouped GEMMs;
* :mod:`.dense`         dense GEMMs;
* :mod:`.arguments`     the argument checks they share.

GEMM names follow DeepGEMM: the first letter is A's storage (``n`` = ``[M, K]``, ``t`` = ``[K, M]``), the
second B's (``t`` = ``[N, K]``, ``n`` = ``[K, N]``); every variant computes ``D[M, N] (+)= op(A) @ op(B)``,
so ``_nt`` is ``A @ B.T``. Results are written into ``d`` in place (any strides); the functions return
``None`` like DeepGEMM.

This room never imports the EP communication code (docs/design/architecture.md).
"""

from .dense import (
    bf16_gemm_nn,
    bf16_gemm_nt,
    bf16_gemm_tn,
    bf16_gemm_tt,
    fp8_fp4_gemm_nn,
    fp8_fp4_gemm_nt,
    fp8_fp4_gemm_tn,
    fp8_fp4_gemm_tt,
    fp8_gemm_nn,
    fp8_gemm_nt,
    fp8_gemm_tn,
    fp8_gemm_tt,
)
from .dequant import dequantize_weights
from .fp4 import (
    FP4_E2M1_MAX,
    cast_back_from_fp4,
    dequantize_e2m1,
    pack_fp4,
    per_token_cast_to_fp4,
    quantize_e2m1,
    unpack_fp4,
)
from .fp8 import (
    FP8_E4M3_MAX,
    cast_to_e4m3,
    e4m3_to_float,
    low_latency_cast_to_fp8,
    per_block_cast_back,
    per_block_cast_to_fp8,
    per_channel_cast_to_fp8,
    per_token_cast_back,
    per_token_cast_to_fp8,
)
from .grouped import (
    bf16_m_grouped_gemm_nt_masked,
    fp8_m_grouped_gemm_nt_masked,
    get_k_alignment_for_contiguous_layout,
    get_m_alignment_for_contiguous_layout,
    get_mk_alignment_for_contiguous_layout,
    get_theoretical_mk_alignment_for_contiguous_layout,
    k_grouped_bf16_gemm_tn_contiguous,
    k_grouped_fp8_gemm_nt_contiguous,
    k_grouped_fp8_gemm_tn_contiguous,
    m_grouped_bf16_gemm_nn_contiguous,
    m_grouped_bf16_gemm_nt_contiguous,
    m_grouped_bf16_gemm_nt_masked,
    m_grouped_fp8_fp4_gemm_nn_contiguous,
    m_grouped_fp8_fp4_gemm_nt_contiguous,
    m_grouped_fp8_fp4_gemm_nt_masked,
    m_grouped_fp8_gemm_nn_contiguous,
    m_grouped_fp8_gemm_nt_contiguous,
    m_grouped_fp8_gemm_nt_masked,
    set_mk_alignment_for_contiguous_layout,
)
from .logfmt import (
    LOGFMT_BODY_BYTES,
    LOGFMT_GROUP,
    LOGFMT_META_BYTES,
    LOGFMT_TAIL_BYTES,
    logfmt10_decode,
    logfmt10_encode,
    logfmt10_group_mask,
    logfmt10_wire_bytes,
)
from .scales import (
    align,
    ceil_div,
    ceil_to_ue8m0,
    get_mn_major_tma_aligned_packed_ue8m0_tensor,
    get_mn_major_tma_aligned_tensor,
    get_tma_aligned_size,
    pack_ue8m0_pairs_mn_major,
    pack_ue8m0_to_int,
    transform_sf_into_required_layout,
    ue8m0_bytes,
    unpack_ue8m0_from_int,
)
from .weight_cache import (
    WeightCacheInfo,
    clear_dequantized_weight_cache,
    dequantized_weight_cache_info,
    set_dequantized_weight_cache,
)

# Codecs, scale layouts and the weight cache, then the GEMMs: what ``deepep_ascend`` exports at top level.
__all__ = [
    "FP4_E2M1_MAX",
    "FP8_E4M3_MAX",
    "align",
    "cast_back_from_fp4",
    "cast_to_e4m3",
    "ceil_div",
    "ceil_to_ue8m0",
    "clear_dequantized_weight_cache",
    "dequantize_e2m1",
    "dequantize_weights",
    "dequantized_weight_cache_info",
    "e4m3_to_float",
    "get_mn_major_tma_aligned_packed_ue8m0_tensor",
    "get_mn_major_tma_aligned_tensor",
    "get_tma_aligned_size",
    "LOGFMT_BODY_BYTES",
    "LOGFMT_GROUP",
    "LOGFMT_META_BYTES",
    "LOGFMT_TAIL_BYTES",
    "logfmt10_decode",
    "logfmt10_encode",
    "logfmt10_group_mask",
    "logfmt10_wire_bytes",
    "low_latency_cast_to_fp8",
    "pack_fp4",
    "pack_ue8m0_pairs_mn_major",
    "pack_ue8m0_to_int",
    "per_block_cast_back",
    "per_block_cast_to_fp8",
    "per_channel_cast_to_fp8",
    "per_token_cast_back",
    "per_token_cast_to_fp4",
    "per_token_cast_to_fp8",
    "quantize_e2m1",
    "set_dequantized_weight_cache",
    "transform_sf_into_required_layout",
    "ue8m0_bytes",
    "unpack_fp4",
    "unpack_ue8m0_from_int",
    "WeightCacheInfo",
    "bf16_gemm_nn",
    "bf16_gemm_nt",
    "bf16_gemm_tn",
    "bf16_gemm_tt",
    "bf16_m_grouped_gemm_nt_masked",
    "fp8_fp4_gemm_nn",
    "fp8_fp4_gemm_nt",
    "fp8_fp4_gemm_tn",
    "fp8_fp4_gemm_tt",
    "fp8_gemm_nn",
    "fp8_gemm_nt",
    "fp8_gemm_tn",
    "fp8_gemm_tt",
    "fp8_m_grouped_gemm_nt_masked",
    "get_k_alignment_for_contiguous_layout",
    "get_m_alignment_for_contiguous_layout",
    "get_mk_alignment_for_contiguous_layout",
    "get_theoretical_mk_alignment_for_contiguous_layout",
    "k_grouped_bf16_gemm_tn_contiguous",
    "k_grouped_fp8_gemm_nt_contiguous",
    "k_grouped_fp8_gemm_tn_contiguous",
    "m_grouped_bf16_gemm_nn_contiguous",
    "m_grouped_bf16_gemm_nt_contiguous",
    "m_grouped_bf16_gemm_nt_masked",
    "m_grouped_fp8_fp4_gemm_nn_contiguous",
    "m_grouped_fp8_fp4_gemm_nt_contiguous",
    "m_grouped_fp8_fp4_gemm_nt_masked",
    "m_grouped_fp8_gemm_nn_contiguous",
    "m_grouped_fp8_gemm_nt_contiguous",
    "m_grouped_fp8_gemm_nt_masked",
    "set_mk_alignment_for_contiguous_layout",
]
