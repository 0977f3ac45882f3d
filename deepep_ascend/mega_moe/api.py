"""MegaMoE's entry points, :func:`bf16_mega_moe` and :func:`fp8_fp4_mega_moe` (DeepGEMM's): a call's checks,
the consensus, the expert waves on the buffer's backend and the final sum into ``y``
(docs/semantics/mega-moe.md §1.3 and §5)."""

from __future__ import annotations

import math
import time

import numpy as np
import torch

from .. import native as _native
from ..checks import check_storage, is_int
from ..ep.failure import abort_peers
from ..ep.reduce import accumulate_rows
from ..native.operands import write_refusal
from ..rounding import ceil_div
from ..settings import DG_COMM_KERNEL_DEBUG, MEGA_MOE_EXPERTS_PER_WAVE
from .consensus import check_agreement, consensus
from .experts import Experts, check_clamp, gemm_engine, swiglu_params
from .formats import BF16
from .symm_buffer import SymmBuffer
from .trace import MegaMoETrace
from .waves import experts_per_wave, wave_override, waves_buffer, waves_shm
from .weights import check_weights, shared_bf16, untransformed


def _as_triple(recipe) -> tuple | None:
    """``recipe`` as a tuple of three ints (any sequence of integers: tuple, list, numpy array, torch.Size), or None."""
    try:
        values = tuple(recipe)
    except TypeError:
        return None
    return tuple(int(v) for v in values) if len(values) == 3 and all(is_int(v) for v in values) else None


def _validate(kind, y, l1, l2, sb, stats, activation, alpha, up_bias, clamp, fast_math, shared_l1, shared_l2,
              recipe, op):
    """This rank's checks of a call, before anything moves: returns ``(T, shared, oai)`` with ``T = y.size(0)``,
    ``shared`` the shared experts' bf16 ``(w1, w2)`` (:func:`~.weights.shared_bf16`) or None and ``oai`` the
    activation's parameters (:func:`~.experts.swiglu_params`). Raises TypeError / ValueError naming the
    argument (RuntimeError: a destroyed buffer)."""
    if not isinstance(sb, SymmBuffer):
        raise TypeError(f"{op}: `sym_buffer` must come from get_symm_buffer_for_mega_moe, got {type(sb).__name__}")
    if sb._destroyed:
        raise RuntimeError(f"{op}: the symmetric buffer was destroyed")
    want_mma = "bf16xbf16" if kind == "bf16" else "fp8xfp4"
    if sb.mma_type != want_mma:
        raise ValueError(f"{op} needs a buffer built with mma_type={want_mma!r}, this one has {sb.mma_type!r}")
    oai = swiglu_params(activation, alpha, up_bias, op)
    if kind != "bf16" and _as_triple(recipe) != (1, 1, 32):
        raise ValueError(f"{op}: recipe must be (1, 1, 32), got {recipe!r}")
    # what DeepGEMM's binding converts to a bool (a number's truth, None as False); a string is refused there too
    if not (fast_math is None or isinstance(fast_math, (bool, int, float, np.bool_, np.number))):
        raise TypeError(f"{op}: fast_math must be a bool, got {type(fast_math).__name__}")
    check_clamp(clamp, op)
    if not isinstance(y, torch.Tensor):
        raise TypeError(f"{op}: `y` must be a torch.Tensor, got {type(y).__name__}")
    if y.dtype != BF16:
        raise TypeError(f"{op}: `y` must be bfloat16, got {y.dtype}")
    check_storage(f"{op}: `y`", y)
    if y.dim() != 2 or y.size(1) != sb.hidden:
        raise ValueError(f"{op}: `y` must be [num_tokens, {sb.hidden}], got {tuple(y.shape)}")
    if not y.is_contiguous():
        raise ValueError(f"{op}: `y` must be contiguous")
    why = write_refusal("`y`", y)  # what torch would refuse to write in place, found only after the data moved
    if why:
        raise RuntimeError(f"{op}: {why}")
    t = y.size(0)
    if t > sb.num_max_tokens_per_rank:
        raise ValueError(f"{op}: num_tokens = y.size(0) = {t} exceeds num_max_tokens_per_rank "
                         f"({sb.num_max_tokens_per_rank}, aligned to 384)")
    check_weights(kind, l1, l2, sb.num_local_experts, sb.hidden, sb.intermediate_hidden, op)
    if stats is not None:
        if not isinstance(stats, torch.Tensor) or stats.dtype != torch.int32:
            raise TypeError(f"{op}: cumulative_local_expert_recv_stats must be an int32 tensor, got "
                            f"{getattr(stats, 'dtype', type(stats).__name__)}")
        check_storage(f"{op}: cumulative_local_expert_recv_stats", stats)
        if tuple(stats.shape) != (sb.num_local_experts,) or not stats.is_contiguous():
            raise ValueError(f"{op}: cumulative_local_expert_recv_stats must be a contiguous [{sb.num_local_experts}] "
                             f"tensor (DeepGEMM's check), got {tuple(stats.shape)} with strides {stats.stride()}")
        if stats.is_inference() and not torch.is_inference_mode_enabled():
            raise RuntimeError(f"{op}: cumulative_local_expert_recv_stats is an inference tensor (made under "
                               f"torch.inference_mode()): outside that mode the call cannot write it in place")
    s = sb.num_shared_experts
    if s == 0 and (shared_l1 is not None or shared_l2 is not None):
        raise ValueError(f"{op}: shared expert weights given but the buffer has num_shared_experts=0")
    shared = None
    if s:
        if shared_l1 is None or shared_l2 is None:
            raise ValueError(f"{op}: the buffer has num_shared_experts={s}: pass shared_l1_weights and "
                             f"shared_l2_weights")
        shared = shared_bf16(kind, shared_l1, shared_l2, sb.hidden, s * sb.intermediate_hidden, op)
    idx = sb.topk_idx[:t]
    if t:
        lo, hi = int(idx.min()), int(idx.max())
        if lo < -1 or hi >= sb.num_experts:
            raise ValueError(f"{op}: topk_idx[:{t}] values must lie in [-1, {sb.num_experts}), got min {lo}, "
                             f"max {hi}")
    return t, shared, oai


def _run(kind, y, l1_weights, l2_weights, sym_buffer, stats, activation, activation_alpha, activation_up_bias,
         activation_clamp, fast_math, recipe, shared_l1, shared_l2, overlap, num_experts_per_wave, op):
    """One call of either op (``kind`` ``'bf16'`` or ``'fp8'``; ``op`` names it in errors): this rank's checks,
    the consensus (every rank raises if any rank's checks failed or the ranks disagree), then :func:`_fused`;
    a failure after the consensus aborts the buffer so that the peers fail at once."""
    sb = sym_buffer
    me = getattr(sb, "rank", 0)
    err, counts, t, shared, override, settings, oai = None, None, 0, None, None, None, None
    try:
        t, shared, oai = _validate(kind, y, l1_weights, l2_weights, sb, stats, activation, activation_alpha,
                                   activation_up_bias, activation_clamp, fast_math, shared_l1, shared_l2, recipe, op)
        idx = sb.topk_idx[:t]
        valid = idx >= 0
        counts = torch.bincount(idx[valid], minlength=sb.num_experts).to(torch.int64)
        override = wave_override(num_experts_per_wave, op)
        # what every rank must pass alike (each rank's experts serve every rank's tokens), as plain values
        wave_key = f"num_experts_per_wave (keyword, else ${MEGA_MOE_EXPERTS_PER_WAVE.name}; None = default)"
        settings = {wave_key: override, "activation": activation,
                    "activation_alpha": 1.0 if oai is None else oai[0],
                    "activation_up_bias": 0.0 if oai is None else oai[1],
                    "activation_clamp": None if activation_clamp is None else float(activation_clamp),
                    "fast_math": bool(fast_math)}
    except Exception as exc:  # noqa: BLE001 - reported to every rank, re-raised here
        err = exc
    if not isinstance(sb, SymmBuffer) or sb._destroyed:
        raise err
    gathered = consensus(sb, (None if err is None else f"{type(err).__name__}: {err}",
                              None if counts is None else counts.numpy(), settings, t), op)
    if err is not None:
        raise err
    check_agreement(me, op, [(m, o) for m, _c, o, _t in gathered])
    # [R, E] pairs each rank sends per expert
    cmat = torch.stack([torch.from_numpy(c) for _m, c, _o, _t in gathered])
    tokens = [int(n) for _m, _c, _o, n in gathered]

    try:
        _fused(kind, y, l1_weights, l2_weights, sb, stats, activation_clamp, fast_math, shared, overlap, t, cmat,
               tokens, override, oai)
    except BaseException as exc:  # a failure after the ranks agreed: the peers must not wait for this rank
        abort_peers(sb.ep_buffer.runtime, sb.ep_buffer.rank, exc)
        raise


def _fused(kind, y, l1_weights, l2_weights, sb, stats, activation_clamp, fast_math, shared, overlap, t, cmat,
           tokens, override, oai):
    """The call once every rank accepted it: waves of dispatch, L1, activation, L2 and combine, then the sum
    over k into ``y`` (docs/semantics/mega-moe.md §5). ``cmat [R, E]``: pairs each rank routes to each expert;
    ``tokens``: each rank's token count; ``oai``: the activation's parameters (:class:`~.experts.Experts`)."""
    el = sb.num_local_experts
    epw = experts_per_wave(sb, cmat, override)
    num_waves = ceil_div(el, epw)
    trace = MegaMoETrace(overlap, num_waves, epw, start=time.perf_counter())
    engine = gemm_engine()
    w1, w2 = untransformed(kind, l1_weights, l2_weights, engine)
    ex = Experts(kind, sb, w1, w2, engine, epw, activation_clamp, fast_math, trace, oai)
    # This rank's pairs, in (token, k) order.
    idx = sb.topk_idx[:t].reshape(-1)
    pair = torch.nonzero(idx >= 0).squeeze(1)
    # The shm backend keeps every received row's L2 output in its segment until the ranks meet; a call
    # that would overfill some rank's (only with a capped segment) takes the Buffer's path, alike on every
    # rank since all see the same counts.
    rows = cmat.sum(0).view(sb.num_ranks, el).sum(1)
    trace.backend = "shm" if sb.backend == "shm" and int(rows.max()) <= sb._out_rows else "buffer"
    run = waves_shm if trace.backend == "shm" else waves_buffer
    terms = run(ex, sb, t, cmat, tokens, idx, pair, shared, overlap)

    s0 = time.perf_counter()
    # y = bf16(+0.0 + Σ_k o_k + shared) in float32, ascending k. A masked pair adds nothing: the sum
    # from +0.0 never holds -0.0, so adding its +0.0 row would change no bit. ``terms``: (rows, tokens,
    # positions of those rows) in the order to add them (ascending k), then the shared expert's.
    if t and not _native.sum_rows(y[:t], terms):
        # combine's torch paths (accumulate_rows: the same additions in the same order)
        sources = [(rows.index_select(0, at[0]) if at else rows, tok) for rows, tok, *at in terms]
        accumulate_rows(y[:t], sources, *sb._reduce_scratch.get(sb.hidden), native=False)
    trace.compute.append(("reduce", -1, s0, time.perf_counter()))
    if stats is not None:
        stats += cmat[:, sb.rank * el:(sb.rank + 1) * el].sum(0).to(torch.int32)
    if DG_COMM_KERNEL_DEBUG.get():
        sb.buffer.zero_()
    prev_end = -math.inf
    for rec in trace.comm:  # Buffer's worker-side start: when issued, or when the op before it left the worker
        if overlap and trace.backend == "buffer":  # (shm: each pull records its own)
            rec[4] = max(rec[3], prev_end)
            prev_end = rec[5]
    trace.end = time.perf_counter()
    sb.last_trace = trace


def bf16_mega_moe(y, l1_weights, l2_weights, sym_buffer, cumulative_local_expert_recv_stats=None,
                  activation: str = "swiglu", activation_clamp=None, fast_math: bool = True, *,
                  activation_alpha: float = 1.0, activation_up_bias: float = 0.0,
                  shared_l1_weights=None, shared_l2_weights=None, overlap: bool = True,
                  num_experts_per_wave: int | None = None) -> None:
    """Fused BF16 MoE over the EP group (mirrors ``deep_gemm.bf16_mega_moe``); collective, synchronous.

    Reads ``sym_buffer.x[:T]``, ``topk_idx[:T]``, ``topk_weights[:T]`` with ``T = y.size(0)``
    (may differ per rank, 0 allowed) and writes ``y [T, H]`` bf16 in place.

    Args:
        y: bf16 ``[T, H]``, contiguous, output only; ``T <= sym_buffer.num_max_tokens_per_rank``.
        l1_weights, l2_weights: this rank's experts after :func:`transform_weights_for_mega_moe`:
            bf16 ``[E_l, 2I, H]`` and ``[E_l, H, I]``.
        sym_buffer: from :func:`get_symm_buffer_for_mega_moe` with ``mma_type='bf16xbf16'``.
        cumulative_local_expert_recv_stats: optional int32 ``[E_l]``; each call adds the (token, k)
            pairs received per local expert from all ranks (masked slots not counted).
        activation: ``'swiglu'`` (``silu(g)·u``) or ``'swigluoai'`` (gpt-oss's parameterized SwiGLU,
            ``g·sigmoid(alpha·g)·(u + up_bias)``, DeepGEMM PR #445); activation_clamp: ``None`` or ``c >= 0``,
            the gate clamped from above, the up projection on both sides (docs/semantics/mega-moe.md §1.3);
        fast_math: reciprocal form of the sigmoid.
        activation_alpha, activation_up_bias: finite numbers (used as float32), ``'swigluoai'``'s sigmoid
            scale and the bias added to the (clamped) up projection; ``'swiglu'`` needs the defaults 1.0 and
            0.0. Keyword-only: PR #445 puts them between ``activation`` and ``activation_clamp`` of its SM90
            ``fp8_mega_moe``; here upstream's positional order stays. gpt-oss: ``activation='swigluoai',
            activation_alpha=1.702, activation_up_bias=1.0, activation_clamp=7.0``.
        shared_l1_weights, shared_l2_weights: keyword-only; bf16 ``[2·S·I, H]`` / ``[H, S·I]``
            when the buffer has ``num_shared_experts = S > 0`` (not transformed).
        overlap: keyword-only; ``False`` runs the same waves with synchronous communication.
        num_experts_per_wave: keyword-only wave size (default: docs/semantics/mega-moe.md §5); every rank must ask for
            the same one (keyword, else ``$DEEPEP_ASCEND_MEGA_MOE_EXPERTS_PER_WAVE``).
    Raises:
        TypeError / ValueError: bad arguments on any rank (every rank raises; peers a
            :class:`~deepep_ascend.ConsensusError` naming the rank), before anything moves: among them
            an ``activation`` other than ``'swiglu'`` / ``'swigluoai'``, a negative or NaN
            ``activation_clamp``, a non-finite ``activation_alpha`` / ``activation_up_bias``, and
            ``'swiglu'`` with non-default ones (``ValueError``); ranks passing different
            ``num_experts_per_wave``, ``activation``, ``activation_alpha``, ``activation_up_bias``,
            ``activation_clamp`` or ``fast_math`` (each rank's experts serve every rank's tokens):
            ``ConsensusError`` on every rank. Tensors must be dense CPU tensors (a ``meta`` or sparse one:
            ``ValueError``).
        TimeoutError / transports errors: as :meth:`deepep_ascend.Buffer.dispatch`; also when a rank does
            not enter the call within the buffer's timeout (``TimeoutError`` naming it, on the ranks that
            waited; the symmetric buffer is then unusable: destroy it and build a new one). A rank that
            fails after the ranks agreed (an unexpected error in its expert compute) raises its error and
            aborts the buffer: the others raise ``TransportAborted`` naming it at once.
        RuntimeError: (``shm`` backend) a peer's ``topk_idx`` no longer routes the pairs its counts announced
            (its inputs were changed during the call); the buffer is aborted as above.
    """
    _run("bf16", y, l1_weights, l2_weights, sym_buffer, cumulative_local_expert_recv_stats, activation,
         activation_alpha, activation_up_bias, activation_clamp, fast_math, None, shared_l1_weights,
         shared_l2_weights, overlap, num_experts_per_wave, "bf16_mega_moe")


def fp8_fp4_mega_moe(y, l1_weights, l2_weights, sym_buffer, cumulative_local_expert_recv_stats=None,
                     recipe=(1, 1, 32), activation: str = "swiglu", activation_clamp=None, fast_math: bool = True, *,
                     activation_alpha: float = 1.0, activation_up_bias: float = 0.0, shared_l1_weights=None,
                     shared_l2_weights=None, overlap: bool = True, num_experts_per_wave: int | None = None) -> None:
    """Fused FP8×FP4 MoE over the EP group (mirrors ``deep_gemm.fp8_fp4_mega_moe``); collective, synchronous.

    Reads ``sym_buffer.x[:T]`` (e4m3), ``x_sf[:T]`` (int32, four UE8M0 bytes per int, one per 32
    channels), ``topk_idx[:T]``, ``topk_weights[:T]``; writes ``y [T, H]`` bf16 in place.

    Args:
        l1_weights, l2_weights: transformed ``(int8 [E_l, 2I, H/2], int32 [E_l, 2I, H/128])`` and
            ``(int8 [E_l, H, I/2], int32 [E_l, H, I/128])`` (FP4 e2m1 + UE8M0 per 32 along K).
        recipe: must be ``(1, 1, 32)``.
        shared_l1_weights, shared_l2_weights: keyword-only ``(data, sf)`` pairs (docs/semantics/mega-moe.md §1.4).
        Others as :func:`bf16_mega_moe`.
    Raises:
        as :func:`bf16_mega_moe`.
    """
    _run("fp8", y, l1_weights, l2_weights, sym_buffer, cumulative_local_expert_recv_stats, activation,
         activation_alpha, activation_up_bias, activation_clamp, fast_math, recipe, shared_l1_weights,
         shared_l2_weights, overlap, num_experts_per_wave, "fp8_fp4_mega_moe")
