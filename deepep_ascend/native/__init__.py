"""The data plane's native kernels: combine's row sum in one pass (``csrc/sum_rows.c``), the low-latency
paths' row moves straight into place and weighted row sum (``csrc/ll_rows.c``), and MegaMoE's
elementwise stages, FP8 row decode and SwiGLU with its FP8 round trip (``csrc/moe_act.c``), and the groups
of an m-grouped BF16 GEMM on Intel AMX tiles (``csrc/amx_gemm.c``).

Modules:

* :mod:`.loader`    the library: its path, its ABI check, ``DEEPEP_ASCEND_NATIVE``, :func:`available`,
  :func:`timing` (every native call of a block timed), the signature table and :func:`bindings` (how the calls
  are made);
* :mod:`.bindings`  the C source of the calls' ``METH_FASTCALL`` bindings, generated from that table;
* :mod:`.operands`  which tensors the kernels take and may write (the predicates callers ask first);
* :mod:`.rows`      :func:`sum_rows`, :func:`copy_rows`, :func:`zero_rows`, :func:`weighted_sum_rows`,
  :func:`dequant_rows_e4m3`, :func:`swiglu`; :func:`row_sums_avx2` (which loop the row sums run, its modes
  :data:`ROW_SUMS_MODES`);
* :mod:`.ll`        the low-latency calls' steps, one call each (``csrc/ll_calls.c``): :func:`ll_available`,
  :func:`ll_route`, :func:`ll_dispatch_send`, :func:`ll_dispatch_recv`, :func:`ll_stream_rows` (its modes
  :data:`LL_STREAM_MODES` and sides :data:`LL_STREAM_SIDES`; its thresholds :func:`ll_stream_min_bytes`; its
  decisions :func:`ll_streams`),
  :func:`ll_combine_send`, :func:`ll_combine_recv`, :func:`ll_headers_agree`; its signals by stores
  (:func:`signals_available`, :func:`ll_publish`, :func:`ll_await`);
* :mod:`.ll_cast`   the low-latency dispatch's FP8 messages from the BF16 rows in one pass (``csrc/ll_cast.c``):
  :func:`ll_cast_messages`, :func:`ll_cast_message_bytes`;
* :mod:`.logfmt`    LogFMT-10's passes over the elements (``csrc/logfmt.c``): :func:`logfmt_meta`,
  :func:`logfmt_params`, :func:`logfmt_encode`, :func:`logfmt_decode`, :func:`logfmt_avx512`;
* :mod:`.ll_fused`  a low-latency call on one node in two native calls, issue and finish, from a checked plan of
  its fixed operands (``csrc/ll_fused.c``): :class:`LLPlan`, :func:`fused_available`;
* :mod:`.intranode` the normal-mode engine's fixed work on one node from a checked plan: signals, the chunk-0
  exchange, staging, direct stores, each chunk's receive and a one-round call's rest (``csrc/intranode.c``):
  :class:`IntranodePlan`, :func:`intranode_available`;
* :mod:`.amx`       :class:`AmxWeight`, :class:`AmxFp4Weight`, :func:`gemm_bf16_amx`, :func:`amx_bf16`;
* :mod:`.layout`    the normal path's routing counts (``csrc/layout.c``): :func:`dispatch_layout`,
  :func:`send_layout`, :func:`recv_channel_prefix`, :func:`local_experts`.

Built at install time as the optional extension ``deepep_ascend.native._native`` (``pyproject.toml``; plain C, no
Python headers needed) and loaded with :mod:`ctypes`; its functions are called through the ``METH_FASTCALL``
bindings ``deepep_ascend.native._fastcall`` (a second optional extension, which needs Python's headers; without
it, through ctypes, whose per-argument conversion ``python -m bench overhead --bindings`` times). Either way a
call releases the GIL, so the Buffer's worker sums while the caller computes. Where it was not built (no C compiler) or
``DEEPEP_ASCEND_NATIVE=0`` is set, :func:`available` is False, every function here returns False,
and the callers (:func:`deepep_ascend.ep.reduce.accumulate_rows`, :mod:`deepep_ascend.mega_moe`) use
their torch paths, which give the same bits (NaN payloads aside) -- except the grouped GEMMs, whose
oneDNN path sums in another order than the AMX kernel (same float32 accumulation; results agree to bf16
rounding).

Why C: combine sums each token's BF16 rows in float32 and rounds once (DeepEP's arithmetic).
torch has no gather-and-sum with BF16 inputs and a float32 accumulator (FBGEMM's BF16
``embedding_bag`` rounds half away from zero), so the torch paths convert rows to a float32
scratch first: about three passes over the rows where this kernel makes one
(``python -m bench combine-sum`` times both). The low-latency paths move every (token, expert) row: torch
gathers into a temporary and scatters it (two passes), the kernel copies each row into its final place,
and the low-latency combine's weighted sum reads each returned row once where torch makes about five
passes (gather, widen, multiply, add, round). MegaMoE's SwiGLU with its e4m3 round trip is about twenty
torch passes over float32 temporaries; the kernel makes one, after torch's own ``exp`` (so both paths
compute the same sigmoid). The grouped GEMMs multiply ~128 rows per expert, where oneDNN's kernels
(torch's CPU matmul; torch has no CPU grouped GEMM of its own) reach about half of what they reach on
one tall matrix; the AMX kernel keeps a group's rows in L2 while its weight streams past once and writes
into the caller's output (``python -m bench grouped-gemm`` times both). It also takes MXFP4 weights
(:class:`AmxFp4Weight`), decoding them into bf16 tiles panel by panel. It runs only where the CPU has
AMX-BF16 and Linux grants the process its tile state (:func:`amx_bf16`); elsewhere the grouped GEMMs
use oneDNN.
"""
from __future__ import annotations

from .amx import (
    AMX_FP4_EXPONENTS,
    AmxFp4Weight,
    AmxWeight,
    amx_bf16,
    amx_fp4_packed_nbytes,
    amx_packed_nbytes,
    gemm_bf16_amx,
)
from .intranode import IntranodePlan, intranode_available
from .layout import dispatch_layout, local_experts, recv_channel_prefix, send_layout
from .ll import (
    LL_STREAM_MODES,
    LL_STREAM_SIDES,
    ll_available,
    ll_await,
    ll_combine_recv,
    ll_combine_send,
    ll_dispatch_recv,
    ll_dispatch_send,
    ll_headers_agree,
    ll_publish,
    ll_route,
    ll_stream_min_bytes,
    ll_stream_rows,
    ll_streams,
    signals_available,
)
from .ll_cast import ll_cast_message_bytes, ll_cast_messages
from .ll_fused import LLPlan, fused_available
from .loader import available, library_path, timing
from .logfmt import logfmt_avx512, logfmt_decode, logfmt_encode, logfmt_meta, logfmt_params
from .rows import (
    ROW_SUMS_MODES,
    copy_rows,
    dequant_rows_e4m3,
    row_sums_avx2,
    sum_rows,
    swiglu,
    weighted_sum_rows,
    zero_rows,
)

__all__ = ["AMX_FP4_EXPONENTS", "AmxFp4Weight", "AmxWeight", "IntranodePlan", "LLPlan", "LL_STREAM_MODES",
           "LL_STREAM_SIDES", "amx_bf16", "amx_fp4_packed_nbytes", "amx_packed_nbytes", "available",
           "intranode_available", "copy_rows", "dequant_rows_e4m3", "dispatch_layout", "fused_available",
           "gemm_bf16_amx", "library_path", "ll_available", "ll_await", "ll_cast_message_bytes", "ll_cast_messages",
           "ll_combine_recv", "ll_combine_send", "ll_dispatch_recv", "ll_dispatch_send", "ll_headers_agree",
           "ll_publish", "ll_route", "ll_stream_min_bytes", "ll_stream_rows", "ll_streams", "local_experts",
           "logfmt_avx512", "logfmt_decode", "logfmt_encode", "logfmt_meta", "logfmt_params", "recv_channel_prefix",
           "ROW_SUMS_MODES", "row_sums_avx2", "send_layout", "signals_available", "sum_rows", "swiglu", "timing",
           "weighted_sum_rows", "zero_rows"]
