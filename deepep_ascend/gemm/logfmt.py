"""LogFMT-10, DeepEP's lossy 10-bit transport of low-latency combine rows (``docs/semantics/deepep-api.md`` §6.3):
per 128 channels a sign and a 9-bit code on a log scale between the group's smallest and largest magnitude,
plus 4 bytes of metadata; groups the format cannot take travel as BF16, exactly.

:func:`logfmt10_encode` and :func:`logfmt10_decode` give the wire format (body, metadata, tail);
:func:`logfmt10_group_mask` and :func:`logfmt10_wire_bytes` read what a row's metadata implies. Where
the native library is loaded the coder runs in C (:mod:`deepep_ascend.native.logfmt`: one pass per step where torch
makes about twenty), else as vectorized torch; both give the same bits.
"""

from __future__ import annotations

import torch

from .. import native as _native
from .arguments import check_tensor

__all__ = [
    "LOGFMT_BODY_BYTES",
    "LOGFMT_GROUP",
    "LOGFMT_META_BYTES",
    "LOGFMT_TAIL_BYTES",
    "logfmt10_decode",
    "logfmt10_encode",
    "logfmt10_group_mask",
    "logfmt10_wire_bytes",
]

#: Channels per LogFMT group.
LOGFMT_GROUP = 128
#: Bytes of one group's body: 128 ten-bit values (a BF16 group's first 160 bytes).
LOGFMT_BODY_BYTES = 160
#: Bytes of a BF16 group past its body (256 - 160), sent in the row's tail.
LOGFMT_TAIL_BYTES = 96
#: Metadata bytes per group: ``(amax, amin)`` as two bf16.
LOGFMT_META_BYTES = 4
_LOGFMT_LEVELS = 510  # step = (la - lb) / 510: codes 1..511 cover [lb, la]
_LOGFMT_CLIP = 32.0  # lb >= la - 32
_LN2 = 0.6931471805599453
_bf16_log2 = None


def _bf16_log2_table() -> torch.Tensor:
    """float32 ``[32768]``: ``log2`` of the bf16 magnitude with bits ``b`` (computed in float64,
    rounded once); ``b = 0`` gives ``-inf``, exponent 255 (inf, NaN) ``+inf``."""
    global _bf16_log2
    if _bf16_log2 is None:
        mags = torch.arange(1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
        t = torch.log2(mags.double()).float()
        t[0x7F80:] = float("inf")
        _bf16_log2 = t
    return _bf16_log2


def _expm1_f64(r: torch.Tensor, degree: int) -> torch.Tensor:
    """``e**r - 1`` for float64 ``r >= 0`` by Horner's rule on the Taylor series to ``degree``.

    Multiplies, divides and adds only: torch's ``exp``/``log`` kernels take different vector
    and scalar paths depending on where an element falls in the tensor, these do not, so a
    group's parameters have the same bits whatever batch it is encoded or decoded in.
    """
    p = torch.ones_like(r)
    for k in range(degree, 1, -1):
        p = 1.0 + p * r / k
    return p * r


def _exp2_f64(v: torch.Tensor) -> torch.Tensor:
    """``2**v`` for float64 ``-1022 <= v < 1024``, relative error below 1e-13."""
    n = torch.floor(v)
    scale = ((n.to(torch.int64) + 1023) << 52).view(torch.float64)  # 2**n from the bits
    return (1.0 + _expm1_f64((v - n) * _LN2, 14)) * scale


_logfmt_lut = None


def _logfmt_luts():
    """Decode lookup tables: ``spread`` int32 ``[256, 4]`` (a top-bits byte -> its four values'
    bits 8-9, in place), and for each 10-bit value ``v = c | sign << 9`` the int64 indices
    ``hi_of[v]`` / ``lo_of[v]`` into the per-group tables of :func:`logfmt10_decode`: with
    ``c' = c + 31``, ``hi = c' >> 5`` (+17 for the sign; 0 only for ``c = 0``), ``lo = c' & 31``."""
    global _logfmt_lut
    if _logfmt_lut is None:
        b = torch.arange(256, dtype=torch.int32).unsqueeze(1)
        spread = ((b >> torch.tensor([0, 2, 4, 6], dtype=torch.int32)) & 3) << 8
        v = torch.arange(1024, dtype=torch.int64)
        c = (v & 0x1FF) + 31
        _logfmt_lut = (spread.contiguous(), (c >> 5) + (v >> 9) * 17, c & 31)
    return _logfmt_lut


def _logfmt_use(amax_bits: torch.Tensor, amin_bits: torch.Tensor):
    """Per group: ``(use, la, lb)`` of :func:`_logfmt_params`, without the parameters only a coder needs."""
    table = _bf16_log2_table()
    la = table[amax_bits.long()]
    lb = torch.maximum(table[amin_bits.long()], la - _LOGFMT_CLIP)
    return (la < 0) & (lb < la), la, lb


def _logfmt_params(amax_bits: torch.Tensor, amin_bits: torch.Tensor):
    """Per group, from the metadata's bf16 magnitude bits (int16): ``(use, lb, step, rho, em1)``.

    ``la = log2 amax``, ``lb = max(log2 amin, la - 32)``, ``use = la < 0 and lb < la``,
    ``step = (la - lb) / 510`` (float32) and ``rho = 2 - log2((1 + 2**step) / 2) / step``
    (float64 series, rounded to float32); ``em1 = 2**step - 1`` (float64). Groups that go as
    BF16 get ``lb = 0, step = 1`` (unused). Encoder and decoder both call this on the same
    bits, so they agree on every parameter bit for bit.
    """
    use, la, lb = _logfmt_use(amax_bits, amin_bits)
    step = torch.where(use, (la - lb) / _LOGFMT_LEVELS, 1.0)
    lb = torch.where(use, lb, 0.0)
    s = step.double()
    em1 = _expm1_f64(s * _LN2, 10)  # step <= 32/510: s·ln2 < 0.044, ten terms reach float64 rounding
    u = em1 / 2  # (1 + 2**s) / 2 - 1
    z = u / (2.0 + u)
    z2 = z * z  # log(1 + u) = 2 atanh(z), z < 0.012: four terms reach float64 rounding
    atanh = z * (1.0 + z2 * (1.0 / 3 + z2 * (1.0 / 5 + z2 * (1.0 / 7 + z2 / 9))))
    rho = (2.0 - (2.0 * atanh / _LN2) / s).float()
    return use, lb, step, rho, em1


def _native_params(bits: torch.Tensor):
    """:func:`_logfmt_params` of contiguous int16 ``[G, 2]`` metadata bits in one native call, with the decoder's
    ``2**step`` and ``2**lb`` (float64) and the count of BF16 groups: ``(use, lb, step, rho, p, two_lb, nfb)``;
    None where the kernel is not loaded."""
    g = bits.size(0)
    use = torch.empty(g, dtype=torch.bool)
    lb, step, rho = (torch.empty(g, dtype=torch.float32) for _ in range(3))
    p, two_lb = (torch.empty(g, dtype=torch.float64) for _ in range(2))
    nfb = _native.logfmt_params(bits, _bf16_log2_table(), use, lb, step, rho, p, two_lb)
    return None if nfb is None else (use, lb, step, rho, p, two_lb, nfb)


def _logfmt_rows(name: str, x: torch.Tensor) -> int:
    if x.dim() < 1 or x.size(-1) % LOGFMT_GROUP:
        raise ValueError(
            f"{name} must have a last dim that is a multiple of {LOGFMT_GROUP} (LogFMT groups), "
            f"got shape {tuple(x.shape)}"
        )
    return x.numel() // LOGFMT_GROUP


def logfmt10_group_mask(meta: torch.Tensor) -> torch.Tensor:
    """bool ``[..., S]``: which groups of :func:`logfmt10_encode`'s ``meta`` travel as LogFMT
    (``la < 0`` and ``lb < la``); the others travel as BF16. Raises ``TypeError``/``ValueError``
    unless ``meta`` is bf16 ``[..., S, 2]``."""
    check_tensor("meta", meta, (torch.bfloat16,))
    if meta.dim() < 2 or meta.size(-1) != 2:
        raise ValueError(f"meta must be [..., S, 2], got shape {tuple(meta.shape)}")
    bits = meta.contiguous().view(torch.int16)
    return _logfmt_use(bits[..., 0], bits[..., 1])[0]


def logfmt10_wire_bytes(meta: torch.Tensor) -> torch.Tensor:
    """int64 ``[...]``: bytes each row takes on the wire, ``4S + 160·(LogFMT groups) + 256·(BF16
    groups)``: ``1.25H + H/32`` when every group is LogFMT (docs/semantics/deepep-api.md §11), at most ``2H + H/32``.
    ``meta`` as :func:`logfmt10_encode` returns it (bf16 ``[..., S, 2]``); raises as
    :func:`logfmt10_group_mask`."""
    use = logfmt10_group_mask(meta)
    s = use.size(-1)
    return (LOGFMT_META_BYTES + LOGFMT_BODY_BYTES) * s + LOGFMT_TAIL_BYTES * (~use).sum(-1)


def logfmt10_encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Encode bf16 rows to LogFMT-10 (DeepEP's low-latency combine format, docs/semantics/deepep-api.md §6.3).

    Per group of 128 channels (``S = H / 128`` groups per row), with magnitudes ``|x|``:

    * ``amax = max|x|`` and ``amin`` = the smallest **nonzero** ``|x|`` (0 if the group is all
      zero), both exact bf16 values, are the group's metadata. ``la = log2 amax``,
      ``lb = max(log2 amin, la - 32)`` (``log2`` of the bf16 value rounded to float32). The
      group is LogFMT only if ``la < 0`` and ``lb < la``, else it travels as BF16, exactly
      (any ``|x| >= 1``, all magnitudes equal, all zero, inf or NaN). DeepEP's kernel takes
      ``amin`` over all elements, so there one zero sends a group to ``lb = la - 32``; skipping
      zeros gives the same or a finer step, and a zero still decodes to zero.
    * Code ``c = floor(max((log2|x| - lb) / step + rho, 0))`` (float32, at most 511) with
      ``step = (la - lb) / 510``, ``rho = 2 - log2((1 + 2**step) / 2) / step``: the level
      ``2**(lb + (c - 1)·step)`` nearest to ``|x|`` in linear terms. A zero, and a magnitude
      below about ``2**lb`` (possible only when ``lb`` was clipped to ``la - 32``), get
      ``c = 0``. The 10-bit value is ``c | sign << 9``.

    Wire format (little-endian), per row of ``S`` groups:

    * ``meta`` bf16 ``[..., S, 2]``: ``(amax, amin)`` per group, 4 bytes, ``H/32`` per row.
      The metadata is exact and both ends derive ``la, lb, step, rho`` from it with the same
      arithmetic, so it costs no precision beyond the 9-bit codes.
    * ``body`` uint8 ``[..., S, 160]``: a LogFMT group's 128 values at 10 bits each, in two
      planes: byte ``j`` holds value ``j``'s low 8 bits, and byte ``128 + j // 4`` its top two
      (code bit 8, sign) at bits ``2·(j % 4)`` and ``2·(j % 4) + 1``; a BF16 group's first 160
      bytes.
    * ``tail`` uint8 ``[F, 96]``: the last 96 bytes of each of the ``F`` BF16 groups, in
      row-major order (rows, then groups).

    A row takes ``1.25H + H/32`` bytes when all its groups are LogFMT (docs/semantics/deepep-api.md §11), plus 96 per
    BF16 group, ``2H + H/32`` at most (:func:`logfmt10_wire_bytes`).

    Args:
        x: bfloat16 ``[..., H]``, ``H % 128 == 0``; any strides.
    Returns:
        ``(body, meta, tail)`` as above (``body`` and ``meta`` with ``x``'s leading dims).
    Raises:
        TypeError: ``x`` is not a bfloat16 tensor. ValueError: ``H % 128 != 0``.
    """
    return encode(x, native=True)


def encode(x: torch.Tensor, native: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`logfmt10_encode`, through the native kernels where ``native`` and they are loaded, else the torch
    path (``python -m bench logfmt`` times both)."""
    check_tensor("x", x, (torch.bfloat16,))
    g = _logfmt_rows("x", x)
    lead, s = x.shape[:-1], x.size(-1) // LOGFMT_GROUP
    xb = x.reshape(g, LOGFMT_GROUP).view(torch.int16).contiguous()  # (a strided x's groups may be views)
    bits = torch.empty(g, 2, dtype=torch.int16)
    if g and native and _native.logfmt_meta(xb, bits):
        use, lb, step, rho, _, _, nfb = _native_params(bits)
        body = torch.empty(g, LOGFMT_BODY_BYTES, dtype=torch.uint8)
        tail = torch.empty(nfb, LOGFMT_TAIL_BYTES, dtype=torch.uint8)
        _native.logfmt_encode(xb, use, lb, step, rho, _bf16_log2_table(), body, tail)  # loaded: meta was written
        return body.view(*lead, s, LOGFMT_BODY_BYTES), bits.view(torch.bfloat16).view(*lead, s, 2), tail
    mag = xb & 0x7FFF  # bf16 magnitudes order like their bits (NaN above inf)
    if g:
        amax = mag.amax(1)
        amin = torch.where(amax == 0, 0, ((mag - 1) & 0x7FFF).amin(1) + 1)  # 0 -> 0x7FFF: skips zeros
    else:
        amax = amin = mag.new_zeros(0)
    meta = torch.stack([amax, amin], 1).view(torch.bfloat16)
    use, lb, step, rho, _ = _logfmt_params(amax, amin)
    raw = xb.view(torch.uint8)  # [g, 256]: the BF16 bytes
    sel = torch.nonzero(use).squeeze(1)
    every = g > 0 and sel.numel() == g
    body = None if every else raw[:, :LOGFMT_BODY_BYTES].clone()
    if sel.numel():
        m, xs = (mag, xb) if every else (mag.index_select(0, sel), xb.index_select(0, sel))
        if not every:
            lb, step, rho = lb[sel], step[sel], rho[sel]
        q = _bf16_log2_table().index_select(0, m.view(-1).to(torch.int32)).view(-1, LOGFMT_GROUP)
        q.sub_(lb[:, None]).div_(step[:, None]).add_(rho[:, None]).clamp_(0, 511)
        v = q.to(torch.int32)  # truncation = floor for q >= 0; -inf (a zero) was clamped to 0
        v.bitwise_or_(((xs >> 15) & 0x200).view(v.shape))  # sign bit (arithmetic shift of int16)
        packed = torch.empty(v.size(0), LOGFMT_BODY_BYTES, dtype=torch.uint8)
        packed[:, :LOGFMT_GROUP] = v  # low 8 bits (the cast wraps)
        top = (v >> 8).view(-1, 32, 4)  # code bit 8, sign
        packed[:, LOGFMT_GROUP:] = top[..., 0] | (top[..., 1] << 2) | (top[..., 2] << 4) | (top[..., 3] << 6)
        if every:
            body = packed
        else:
            body.index_copy_(0, sel, packed)
    tail = raw[:, LOGFMT_BODY_BYTES:].index_select(0, torch.nonzero(~use).squeeze(1))  # one copy, contiguous
    return body.view(*lead, s, LOGFMT_BODY_BYTES), meta.view(*lead, s, 2), tail


def logfmt10_decode(body: torch.Tensor, meta: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
    """Decode :func:`logfmt10_encode`'s ``(body, meta, tail)`` to float32 ``[..., H]``.

    LogFMT groups: code ``c > 0`` gives ``sign · 2**((c - 1)·step + lb)``, ``c = 0`` gives
    ``0`` (positive). The power is the product of two per-group float32 tables,
    ``2**(lb + 32·k·step)`` and ``2**(l·step)`` with ``c - 1 = 32k + l`` (each from float64,
    rounded once), so it is within 1.5 float32 ulp of the exact power, and an element's value
    depends only on its group's bytes (the same bits whatever batch it is decoded in). BF16 groups decode
    exactly. Relative error of a LogFMT element with ``|x| >= 2**lb``: at most
    ``(2**step - 1) / (2**step + 1)`` (half a level, in linear terms) plus float32 rounding;
    below ``2**lb`` (a clipped ``lb``) the error is at most ``2**lb``.

    Raises ``TypeError`` for wrong dtypes (``body``/``tail`` uint8, ``meta`` bf16) and
    ``ValueError`` for mismatched shapes or a ``tail`` whose row count is not the number of
    BF16 groups.
    """
    return decode(body, meta, tail, native=True)


def decode(body: torch.Tensor, meta: torch.Tensor, tail: torch.Tensor, native: bool) -> torch.Tensor:
    """:func:`logfmt10_decode`, through the native kernel where ``native`` and it is loaded, else the torch path."""
    check_tensor("body", body, (torch.uint8,))
    check_tensor("meta", meta, (torch.bfloat16,))
    check_tensor("tail", tail, (torch.uint8,))
    if body.dim() < 2 or body.size(-1) != LOGFMT_BODY_BYTES or meta.shape != (*body.shape[:-1], 2):
        raise ValueError(
            f"body [..., S, 160] and meta [..., S, 2] must match, got {tuple(body.shape)} and "
            f"{tuple(meta.shape)}"
        )
    lead = body.shape[:-2]
    g = body.numel() // LOGFMT_BODY_BYTES
    bits = meta.reshape(g, 2).view(torch.int16)
    prm = _native_params(bits.contiguous()) if g and native and _native.available() else None
    if prm is not None:
        use, _, _, _, p, two_lb, nfb = prm
    else:
        use, lb, step, _, em1 = _logfmt_params(bits[:, 0], bits[:, 1])
        nfb = int((~use).sum())
    if tail.dim() != 2 or tail.shape != (nfb, LOGFMT_TAIL_BYTES):
        raise ValueError(
            f"tail must be [{nfb}, {LOGFMT_TAIL_BYTES}] (one row per BF16 group), got "
            f"{tuple(tail.shape)}"
        )
    flat = body.reshape(g, LOGFMT_BODY_BYTES)
    if prm is not None:
        out = torch.empty(g, LOGFMT_GROUP, dtype=torch.float32)
        _native.logfmt_decode(flat.contiguous(), tail.contiguous(), use, p, two_lb, out)  # loaded: prm says so
        return out.view(*lead, body.size(-2) * LOGFMT_GROUP)
    fb = ~use
    sel = torch.nonzero(use).squeeze(1)
    every = g > 0 and sel.numel() == g
    out = None if every else torch.empty(g, LOGFMT_GROUP, dtype=torch.float32)
    if sel.numel():
        if not every:
            flat, lb, em1 = flat.index_select(0, sel), lb[sel], em1[sel]
        n = flat.size(0)
        spread, hi_of, lo_of = _logfmt_luts()
        v = spread.index_select(0, flat[:, LOGFMT_GROUP:].reshape(-1).to(torch.int32)).view(n, LOGFMT_GROUP)
        v |= flat[:, :LOGFMT_GROUP]  # the 10-bit values
        v = v.view(-1)
        hi = hi_of.index_select(0, v).view(n, LOGFMT_GROUP)
        lo = lo_of.index_select(0, v).view(n, LOGFMT_GROUP)
        # value(c) = 2**(lb + (c-1)·step) = coarse[hi] · fine[lo] with coarse[h] =
        # 2**(lb + 32·(h-1)·step) (h = 1..16), coarse[0] = 0, the negatives at 17 + h, and
        # fine[l] = 2**(l·step): two lookups and a multiply per value.
        p = 1.0 + em1.unsqueeze(1)  # 2**step
        ones = torch.ones(n, 1, dtype=torch.float64)
        fine = torch.cat([ones, p.expand(n, 31)], 1).cumprod(1)
        coarse = torch.cat([ones, (fine[:, 31:] * p).expand(n, 15)], 1).cumprod(1)  # 2**(32·step·k)
        coarse = coarse * _exp2_f64(lb.double()).unsqueeze(1)
        zero = torch.zeros(n, 1, dtype=torch.float64)
        coarse = torch.cat([zero, coarse, zero, -coarse], 1).float()
        dec = coarse.gather(1, hi).mul_(fine.float().gather(1, lo))
        if every:
            out = dec
        else:
            out.index_copy_(0, sel, dec)
    if nfb:
        fbi = torch.nonzero(fb).squeeze(1)
        raw = torch.cat([body.reshape(g, LOGFMT_BODY_BYTES).index_select(0, fbi), tail], 1)
        out.index_copy_(0, fbi, raw.view(torch.bfloat16).float())
    return out.view(*lead, body.size(-2) * LOGFMT_GROUP)
