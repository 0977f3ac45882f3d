"""MegaMoE: DeepGEMM's fused dispatch → L1 GEMM → SwiGLU → L2 GEMM → combine on CPU ranks.

Public surface (DeepGEMM 2.6 names, also exported at the package top level; docs/semantics/mega-moe.md §1):
:func:`get_symm_buffer_for_mega_moe` → :class:`SymmBuffer` (views ``x``, ``x_sf``, ``topk_idx``,
``topk_weights`` that callers fill before every call), :func:`transform_weights_for_mega_moe`, and
:func:`bf16_mega_moe` / :func:`fp8_fp4_mega_moe`, writing ``y [num_tokens, hidden]`` bf16.

How a call runs (docs/semantics/mega-moe.md §5 has the design and its reasons):

1. Each rank checks its own arguments, then the ranks meet at the transport's barrier, which carries
   every rank's verdict, token count and per-expert pair counts; if any rank failed or the ranks
   disagree, every rank raises (:mod:`.api`, :mod:`.consensus`).
2. Every valid (token, k) slot is one pair row. Local experts run in waves; per wave the rows are
   sorted stably by expert and multiplied, unpadded, on cached un-transformed weights: L1, SwiGLU ×
   routing weight (+ the FP8 round trip), L2 (:mod:`.weights`, :mod:`.experts`).
3. Rows move on one of two backends (``sym_buffer.backend``; the same ``y`` bit for bit): ``shm`` pulls
   pair rows from the peers' node-shared views and, after one barrier, reads the L2 rows where they lie;
   ``buffer`` dispatches and combines through the normal-mode :class:`~deepep_ascend.Buffer`. The
   caller computes wave ``w`` while the Buffer's worker moves the next (:mod:`.waves`).
4. ``y = bf16(Σ_k o_k [+ shared])`` in float32, ascending ``k``; the call's timeline is left in
   ``sym_buffer.last_trace`` (:class:`~.trace.MegaMoETrace`).

Modules: :mod:`.symm_buffer` (the buffer and its checks), :mod:`.weights`, :mod:`.experts` (GEMM engine,
FP8 decode, activation, shared experts), :mod:`.consensus`, :mod:`.waves`, :mod:`.trace`, :mod:`.api`,
:mod:`.formats` (dtypes and row sizes they share).

:func:`mega_moe_experts` (:mod:`.expanded`) runs the same expert compute on rows an ``EPBuffer`` dispatched
in the expanded layout, reading the handle's psum layout in place (docs/semantics/mega-moe.md §9).
"""

from .api import bf16_mega_moe, fp8_fp4_mega_moe
from .expanded import mega_moe_experts
from .symm_buffer import SymmBuffer, get_symm_buffer_for_mega_moe
from .weights import transform_weights_for_mega_moe

__all__ = [
    "SymmBuffer",
    "bf16_mega_moe",
    "fp8_fp4_mega_moe",
    "get_symm_buffer_for_mega_moe",
    "mega_moe_experts",
    "transform_weights_for_mega_moe",
]
