"""MegaMoE's expert compute: the GEMM engine, the per-expert GEMMs on rows sorted by expert, the FP8 decode of
received rows, the SwiGLU activation (with the FP8 round trip), one call's :class:`Experts` and the shared
experts (docs/semantics/mega-moe.md §2, §5 and §7)."""

from __future__ import annotations

import math
import numbers
import time

import torch

from .. import native as _native
from ..gemm import scales as _scales
from ..gemm.fp8 import FP8_E4M3_MAX, cast_to_e4m3, e4m3_to_float, e4m3_ue8m0_round_trip_, per_token_cast_back_torch
from ..gemm.packing import amx_runs, mm_group, native_bf16
from ..native.operands import matrix_ok
from ..ordering import stable_argsort
from ..settings import MEGA_MOE_GEMM
from .formats import ACTIVATIONS, BF16, SF_GRAN

# e4m3 × 2**(b-127) is a multiple of 2**(b-136); bf16 holds multiples of 2**-133 exactly (so b >= 3)
_MIN_EXACT_SF_BYTE = 3


def gemm_engine() -> str:
    """``'bf16'`` (the library's m-grouped bf16 GEMMs) or ``'fp32'`` (float32 matmuls of the same bf16 values).

    ``$DEEPEP_ASCEND_MEGA_MOE_GEMM`` forces one; by default ``'bf16'`` where the CPU multiplies
    bf16 natively (AMX tiles or AVX512-BF16), else ``'fp32'``. Both compute exact products of
    bf16 operands with float32 accumulation and one bf16 rounding (only the summation order may
    differ); without native bf16, torch's bf16 matmul is 10-100x slower than its float32 one.

    Raises:
        SettingError: (a ValueError) the variable is set to anything else.
    """
    return MEGA_MOE_GEMM.get() or ("bf16" if native_bf16() else "fp32")


def operand_dtype(engine: str) -> torch.dtype:
    """dtype of GEMM operands: bf16, or float32 holding bf16 values for the ``fp32`` engine (no round trip)."""
    return BF16 if engine == "bf16" else torch.float32


def expert_gemm(engine: str, a: torch.Tensor, w, bounds: list, out: torch.Tensor | None = None) -> torch.Tensor:
    """``d [n, N]`` bf16: rows ``bounds[g]:bounds[g+1]`` of ``a [n, K]`` (sorted by expert, no padding rows)
    times ``w[g].T``, float32 accumulation, one bf16 rounding. ``w``: ``[G, N, K]``, or (``bf16`` engine) a
    tuple of ``G`` packed ``[N, K]`` weights, AMX or oneDNN (:func:`~deepep_ascend.gemm.packing.pack_groups`).
    ``bf16`` engine: bf16 operands; ``fp32``: one float32 matmul per group on the same bf16 values (``a``
    bf16 or float32 holding bf16 values, ``w`` float32). ``out``: a contiguous ``[n, N]`` bf16 tensor to
    write ``d`` into (returned), else a new one."""
    n = a.size(0)
    if engine == "bf16":
        packed = w if isinstance(w, tuple) else None
        d = out if out is not None else torch.empty(n, w[0].size(0) if packed else w.size(1), dtype=BF16)
        runs = [(g, bounds[g], bounds[g + 1]) for g in range(len(bounds) - 1) if bounds[g + 1] > bounds[g]]
        if not amx_runs(packed, d, lambda: a, runs):
            for g, s, e in runs:
                d[s:e] = mm_group(a[s:e], None if packed else w[g].t(), packed, g)
        return d
    af = a.float()
    df = torch.empty(n, w.size(1), dtype=torch.float32)
    for g in range(len(bounds) - 1):
        s, e = bounds[g], bounds[g + 1]
        if e > s:
            torch.matmul(af[s:e], w[g].t(), out=df[s:e])
    return df.to(BF16) if out is None else out.copy_(df)


def dense_nt(engine, a, w):
    """bf16 ``a @ w.T`` with float32 accumulation (engine as :func:`gemm_engine`; ``a`` as :func:`operand_dtype`)."""
    if engine == "bf16":
        return torch.matmul(a, w.t())
    return torch.matmul(a.float(), w.float().t()).to(BF16)


def dequant_x(kind, data, sf_bytes, dtype=BF16, index=None, native=True):
    """Received activations ``[n, H]`` as ``dtype``: bf16, or float32 holding the same bf16 values
    (what the fp32 engine multiplies), from rows ``index`` (int64 ``[n]``; all rows if None) of ``data``
    and ``sf_bytes``. bf16 rows as they are; fp8: e4m3 × UE8M0 bytes ``[., H/32]``
    (:func:`deepep_ascend.per_token_cast_back`; the native kernel gathers and decodes in one pass, same
    bits; ``native=False`` skips it), exact in bf16 unless a scale byte is below ``_MIN_EXACT_SF_BYTE`` (then
    rounded through bf16, as the kernel always does: so its bf16 rows widened are the float32 result too)."""
    if kind == "bf16":
        data = data if index is None else data.index_select(0, index)
        return data if dtype == BF16 else data.float()
    if native and matrix_ok(data) and matrix_ok(sf_bytes):
        out = torch.empty(data.size(0) if index is None else index.numel(), data.size(1), dtype=BF16)
        if _native.dequant_rows_e4m3(out, data, sf_bytes, index, SF_GRAN):
            return out if dtype == BF16 else out.float()
    if index is not None:
        data, sf_bytes = data.index_select(0, index), sf_bytes.index_select(0, index)
    sf = _scales.unpack_ue8m0_from_int(sf_bytes)
    if dtype == BF16 or (sf_bytes.numel() and int(sf_bytes.min()) < _MIN_EXACT_SF_BYTE):
        return per_token_cast_back_torch(data, sf, SF_GRAN, BF16).to(dtype)
    return per_token_cast_back_torch(data, sf, SF_GRAN, torch.float32)


def _float32(v) -> float:
    """``v`` rounded to float32 (what the GPU kernels' float parameters hold), as a Python float."""
    return float(torch.tensor(float(v), dtype=torch.float32))


def swiglu_params(activation, alpha, up_bias, op: str):
    """The activation a MegaMoE call asks for (docs/semantics/mega-moe.md §1.3): None for ``'swiglu'``, or
    ``(alpha, up_bias)`` rounded to float32 for ``'swigluoai'`` (``g·sigmoid(alpha·g)·(u + up_bias)``).

    Raises:
        ValueError: ``activation`` not one of :data:`ACTIVATIONS`; ``activation_alpha`` or
            ``activation_up_bias`` not a finite real number (bool excluded; finite in float32 too);
            ``'swiglu'`` with ``activation_alpha != 1`` or ``activation_up_bias != 0`` (DeepGEMM's rule:
            the parameters belong to ``'swigluoai'``). ``op`` names the call in the message.
    """
    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        raise ValueError(f"{op}: activation must be one of {ACTIVATIONS}, got {activation!r}")
    vals = []
    for name, v in (("activation_alpha", alpha), ("activation_up_bias", up_bias)):
        try:  # float32 overflow rounds to inf; a huge int does not even make a float
            f = _float32(v) if isinstance(v, numbers.Real) and not isinstance(v, bool) else math.nan
        except OverflowError:
            f = math.inf
        if not math.isfinite(f):
            raise ValueError(f"{op}: {name} must be a finite number (in float32), got {v!r}")
        vals.append(f)
    if activation == "swiglu":
        if vals != [1.0, 0.0]:
            raise ValueError(f"{op}: activation='swiglu' needs activation_alpha=1.0 and activation_up_bias=0.0, "
                             f"got {alpha!r} and {up_bias!r}; use activation='swigluoai' for the parameterized "
                             f"SwiGLU")
        return None
    return vals[0], vals[1]


def check_clamp(clamp, op: str) -> None:
    """``activation_clamp`` must be None or a real number ``>= 0`` (bool excluded); raises ``ValueError``
    naming it (``op`` names the call)."""
    if clamp is not None and (isinstance(clamp, bool) or not isinstance(clamp, numbers.Real) or not clamp >= 0):
        raise ValueError(f"{op}: activation_clamp must be None or a number >= 0, got {clamp!r}")


def activation(kind, h, i, weights, clamp, fast_math, dtype=BF16, native=True, oai=None):
    """SwiGLU of L1 outputs ``h [N, 2I]`` bf16 times ``weights [N]`` fp32 → L2 input ``[N, I]`` as ``dtype``
    (bf16, or float32 holding the same bf16 values). ``oai``: None (``activation='swiglu'``,
    ``silu(g)·u``) or ``(alpha, up_bias)`` of ``activation='swigluoai'`` as float32 values
    (:func:`swiglu_params`): ``g·sigmoid(alpha·g)·(u + up_bias)`` (docs/semantics/mega-moe.md §2). In-place
    float32 steps in the reference's order; the fp8 path's cast to e4m3 with UE8M0 per 32 and back is done
    in one float32 rounding pass (:func:`deepep_ascend.gemm.fp8.e4m3_ue8m0_round_trip_`, bit for bit the
    codec's result). The native kernel (:func:`deepep_ascend.native.swiglu`; ``native=False`` skips it)
    computes the same bits in one pass after torch's exp (its bf16 rows widened are the float32 result: the
    round trip's values are bf16 values)."""
    c = None if clamp is None else float(torch.tensor(float(clamp), dtype=BF16))  # the bf16 value of the clamp
    alpha, up_bias = (1.0, None) if oai is None else oai
    if (native and matrix_ok(h, BF16) and (c is None or c >= 0)  # NaN or < 0: torch's clamp rules
            and weights.dtype == torch.float32 and weights.dim() == 1):
        out = torch.empty(h.size(0), i, dtype=BF16)
        if _native.swiglu(out, h, weights, c, fast_math, 0 if kind == "bf16" else SF_GRAN, alpha=alpha,
                          up_bias=up_bias):
            return out if dtype == BF16 else out.float()
    g, u = h[:, :i], h[:, i:]
    if clamp is not None:
        g = g.clamp(max=c)
        u = u.clamp(-c, c)
    gf = g.float()
    # exp(-(alpha·g)): float32 product, then an exact negation; plain SwiGLU skips the product (alpha = 1)
    denom = (torch.neg(gf) if oai is None else gf.mul(alpha).neg_()).exp_().add_(1.0)
    a = denom.reciprocal_().mul_(gf) if fast_math else torch.div(gf, denom, out=denom)
    # plain SwiGLU adds no bias: u + 0 would turn a -0 into +0
    a.mul_(u if oai is None else u.float().add_(up_bias))
    a.mul_(weights.unsqueeze(1))
    if kind == "bf16":
        a = a.to(BF16)
        return a if dtype == BF16 else a.float()
    if not e4m3_ue8m0_round_trip_(a, SF_GRAN):  # NaN, inf or huge values: through the codes
        n = a.size(0)
        grp = a.view(n, i // SF_GRAN, SF_GRAN)
        s = _scales.ceil_to_ue8m0(grp.abs().amax(-1).clamp(min=1e-4) / FP8_E4M3_MAX).unsqueeze(-1)
        e4m3_to_float(cast_to_e4m3(grp.div_(s)), out=grp).mul_(s)  # e4m3 × UE8M0: exact in bf16
    return a.to(BF16) if dtype == BF16 else a


class Experts:
    """One call's expert compute on the caller's thread, shared by both backends: per wave, rows sorted
    (stably) by local expert, unpadded (a fused op needs no aligned layout in memory), L1, SwiGLU × w
    (+ fp8 requantisation), L2; each stage timed into the trace (a :class:`~.trace.MegaMoETrace`). ``w1``,
    ``w2``: the call's cached weights (:func:`~.weights.untransformed`); ``epw``: local experts per wave;
    ``clamp``, ``fast_math``: the call's ``activation_clamp`` and ``fast_math``; ``oai``: None (plain SwiGLU)
    or swigluoai's ``(alpha, up_bias)`` (:func:`swiglu_params`)."""

    def __init__(self, kind, sb, w1, w2, engine, epw, clamp, fast_math, trace, oai=None):
        self.kind, self.sb, self.w1, self.w2, self.engine, self.epw = kind, sb, w1, w2, engine, epw
        self.clamp, self.fast_math, self.trace, self.oai = clamp, fast_math, trace, oai
        self.op_dtype = operand_dtype(engine)

    def timed(self, stage, w, fn, *args, **kw):
        """``fn(*args, **kw)``, its interval recorded as ``(stage, w, start, end)`` in the trace's ``compute``."""
        s0 = time.perf_counter()
        r = fn(*args, **kw)
        self.trace.compute.append((stage, w, s0, time.perf_counter()))
        return r

    def l1(self, w, data, sf_bytes, local, ws):
        """Wave ``w``'s rows: ``data [n, H]`` (bf16, or e4m3 with UE8M0 bytes ``sf_bytes [n, H/32]``), local
        expert ids ``local [n]`` (0 = the wave's first expert), routing weights ``ws [n]`` float32; any order
        (the sort is stable, so rows of one expert keep theirs)."""
        el, epw = self.sb.num_local_experts, self.epw
        n = local.numel()
        e0 = w * epw
        ne = min(epw, el - e0)
        order = stable_argsort(local, 0, ne)
        bounds = [0] + (torch.bincount(local, minlength=ne).cumsum(0).tolist() if n else [0] * ne)
        if self.kind == "bf16":
            xs = data.index_select(0, order).to(self.op_dtype)
        else:
            xs = dequant_x(self.kind, data, sf_bytes, self.op_dtype, index=order)
        hh = expert_gemm(self.engine, xs, self.w1[e0:e0 + ne], bounds)
        return dict(n=n, order=order, bounds=bounds, e0=e0, ne=ne, h=hh, ws=ws.index_select(0, order))

    def act(self, st):
        """SwiGLU × routing weight (+ the FP8 round trip) of the wave's L1 output, into ``st["act"]``
        ``[n, I]`` (:attr:`op_dtype`)."""
        st["act"] = activation(self.kind, st["h"], self.sb.intermediate_hidden, st["ws"], self.clamp,
                               self.fast_math, self.op_dtype, oai=self.oai)

    def l2(self, st, out=None):
        """L2 of the wave in the sorted order (into ``out`` ``[n, H]`` bf16 if given)."""
        e0, ne = st["e0"], st["ne"]
        return expert_gemm(self.engine, st["act"], self.w2[e0:e0 + ne], st["bounds"], out=out)


def _shared_expert(kind, sb, t, shared, clamp, fast_math, engine, oai):
    """Shared experts on all ``t`` local tokens: bf16 ``[t, H]`` (weight 1, same activation)."""
    w1s, w2s = shared
    si = w2s.size(1)
    if kind == "bf16":
        x = sb.x[:t]
    else:
        x = dequant_x(kind, sb.x[:t], sb.x_sf[:t].contiguous().view(torch.uint8), operand_dtype(engine))
    h = dense_nt(engine, x, w1s)
    # float32 weights, whatever torch's default dtype: the native SwiGLU takes only those
    a = activation(kind, h, si, torch.ones(t, dtype=torch.float32), clamp, fast_math, operand_dtype(engine), oai=oai)
    return dense_nt(engine, a, w2s)


def shared_terms(ex, sb, t, shared):
    """The final sum's term of the shared experts (none when ``shared`` is None): ``[(rows [t, H] bf16,
    tokens arange(t))]``, computed on the caller and timed as stage ``shared`` in ``ex``'s trace."""
    if shared is None:
        return []
    out = ex.timed("shared", -1, _shared_expert, ex.kind, sb, t, shared, ex.clamp, ex.fast_math, ex.engine,
                   ex.oai)
    return [(out, torch.arange(t))]
