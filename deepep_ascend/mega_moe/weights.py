"""MegaMoE's expert weights: :func:`transform_weights_for_mega_moe` (upstream's L1 interleave and scale order),
the checks of a call's weights, and the un-transformed copies the expert GEMMs run on, cached by tensor
(docs/semantics/mega-moe.md §1.2, §1.4)."""

from __future__ import annotations

import torch

from ..checks import check_storage
from ..gemm import packing as _packing
from ..gemm import scales as _scales
from ..gemm.dequant import dequantize_operand, dequantize_weights
from ..gemm.packing import pack_fp4_groups, pack_groups, packed_nbytes
from ..gemm.weight_cache import cacheable, cached_by_tensors, optional_copy_fits
from .formats import ACTIVATIONS, BF16, FP8, INTERLEAVE, SF_GRAN


def _l1_perm(i: int) -> torch.Tensor:
    """Row order of upstream's L1 interleave: gate 0-7, up 0-7, gate 8-15, up 8-15, ... (index into rows)."""
    blocks = torch.arange(i // INTERLEAVE).unsqueeze(1) * INTERLEAVE + torch.arange(INTERLEAVE)
    return torch.stack([blocks, blocks + i], 1).reshape(-1)


def _sf_perm(n: int) -> torch.Tensor:
    """Within each 128-row group, row ``32i + j`` moves to ``4j + i`` (new position p holds old row perm[p])."""
    p = torch.arange(n)
    local = p % 128
    return p - local + 32 * (local % 4) + local // 4


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel())
    return inv


def _rows(t: torch.Tensor, perm: torch.Tensor, mn_major: bool) -> torch.Tensor:
    out = t.index_select(-2, perm)
    return _scales.mn_major(out, out.element_size()) if mn_major else out.contiguous()


def check_weights(kind: str, l1, l2, num_local=None, hidden=None, inter=None, where="transform_weights_for_mega_moe"):
    """Validate local-expert weights as :func:`transform_weights_for_mega_moe` takes them (or returns them):
    ``kind`` ``'bf16'`` (bf16 ``l1 [E_l, 2I, H]``, ``l2 [E_l, H, I]``) or ``'fp8'`` (``(int8, int32)`` pairs
    ``[E_l, 2I, H/2]``/``[E_l, 2I, H/128]`` and ``[E_l, H, I/2]``/``[E_l, H, I/128]``); ``num_local``, ``hidden``,
    ``inter``: the buffer's ``E_l``, ``H``, ``I`` to match (None: any); ``where`` starts the messages.
    Returns ``(E_l, H, I)``.

    Raises:
        TypeError: a weight of the wrong type or dtype. ValueError: shapes that do not match each other or
            the buffer, ``I`` not a multiple of 8 (fp8: ``H`` or ``I`` not a multiple of 128), a tensor
            without dense CPU storage.
    """
    if kind == "bf16":
        for name, t in (("l1_weights", l1), ("l2_weights", l2)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{where}: bf16 `{name}` must be a torch.Tensor, got {type(t).__name__} "
                                f"(an (data, sf) pair is the fp8xfp4 format)")
            if t.dtype != BF16:
                raise TypeError(f"{where}: `{name}` must be bfloat16, got {t.dtype}")
            check_storage(f"{where}: `{name}`", t)
            if t.dim() != 3:
                raise ValueError(f"{where}: `{name}` must be 3-D, got shape {tuple(t.shape)}")
        e, two_i, h = l1.shape
        i = two_i // 2
        if two_i % 2 or tuple(l2.shape) != (e, h, i):
            raise ValueError(f"{where}: l1_weights {tuple(l1.shape)} [E_l, 2I, H] and l2_weights {tuple(l2.shape)} "
                             f"[E_l, H, I] do not match")
    else:
        for name, p in (("l1_weights", l1), ("l2_weights", l2)):
            if not (isinstance(p, (tuple, list)) and len(p) == 2):
                raise TypeError(f"{where}: fp8xfp4 `{name}` must be an (int8 data, int32 sf) pair, got "
                                f"{type(p).__name__}")
            data, sf = p
            if not isinstance(data, torch.Tensor) or data.dtype != torch.int8:
                raise TypeError(f"{where}: `{name}[0]` must be int8 (FP4 packed two per byte), got "
                                f"{getattr(data, 'dtype', type(data).__name__)}")
            if not isinstance(sf, torch.Tensor) or sf.dtype != torch.int32:
                raise TypeError(f"{where}: `{name}[1]` must be int32 (packed UE8M0), got "
                                f"{getattr(sf, 'dtype', type(sf).__name__)}")
            check_storage(f"{where}: `{name}[0]`", data)
            check_storage(f"{where}: `{name}[1]`", sf)
            if data.dim() != 3 or sf.dim() != 3:
                raise ValueError(f"{where}: `{name}` data and sf must be 3-D, got {tuple(data.shape)} and "
                                 f"{tuple(sf.shape)}")
        e, two_i, h2 = l1[0].shape
        h, i = 2 * h2, two_i // 2
        if h % 128 or i % 128 or two_i % 2:
            raise ValueError(f"{where}: fp8xfp4 needs H % 128 == 0 and I % 128 == 0, got H={h}, I={i} "
                             f"(l1 data {tuple(l1[0].shape)})")
        want = {"l1 data": (e, 2 * i, h // 2), "l1 sf": (e, 2 * i, h // 128),
                "l2 data": (e, h, i // 2), "l2 sf": (e, h, i // 128)}
        got = {"l1 data": tuple(l1[0].shape), "l1 sf": tuple(l1[1].shape),
               "l2 data": tuple(l2[0].shape), "l2 sf": tuple(l2[1].shape)}
        for k, shape in want.items():
            if shape != got[k]:
                raise ValueError(f"{where}: {k} must be {shape} for E_l={e}, H={h}, I={i}, got {got[k]}")
    if i % INTERLEAVE:
        raise ValueError(f"{where}: I={i} must be a multiple of {INTERLEAVE} (the L1 gate/up interleave)")
    for name, want, got in (("local experts", num_local, e), ("hidden", hidden, h), ("intermediate_hidden", inter, i)):
        if want is not None and want != got:
            raise ValueError(f"{where}: weights have {name}={got}, the buffer has {want}")
    return e, h, i


def transform_weights_for_mega_moe(l1_weights, l2_weights, activation: str = "swiglu") -> tuple:
    """Reorder local-expert weights as upstream does; same shapes, dtypes and container types.

    bf16: ``l1 [E_l, 2I, H]`` (rows ``0..I-1`` gate, ``I..2I-1`` up), ``l2 [E_l, H, I]``.
    fp8xfp4: ``l1 = (int8 [E_l, 2I, H/2], int32 [E_l, 2I, H/128])``,
    ``l2 = (int8 [E_l, H, I/2], int32 [E_l, H, I/128])`` (FP4 packed two per byte; UE8M0 per 32
    along K, four per int; MN-major or row-major scales, returned MN-major).

    Upstream's order, reproduced exactly: (1) L1 rows interleaved in blocks of 8 (gate 0-7, up
    0-7, gate 8-15, ...), L1 scale rows likewise; (2) fp8 path, L1 and L2 scales: in each
    128-row group row ``32i + j`` moves to ``4j + i``; (3) L2 data unchanged (the same tensor).
    Returns ``(l1, l2)``.

    Raises:
        ValueError: ``activation`` other than ``'swiglu'`` / ``'swigluoai'`` (one layout for both);
        TypeError / ValueError: bad weights, as :func:`check_weights` (docs/semantics/mega-moe.md §1.2).
    """
    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        raise ValueError(f"transform_weights_for_mega_moe: activation must be one of {ACTIVATIONS}, got "
                         f"{activation!r}")
    kind = "bf16" if isinstance(l1_weights, torch.Tensor) else "fp8"
    _e, _h, i = check_weights(kind, l1_weights, l2_weights)
    perm = _l1_perm(i)
    if kind == "bf16":
        return l1_weights.index_select(-2, perm).contiguous(), l2_weights
    d1, s1 = l1_weights
    d2, s2 = l2_weights
    s1_t = _rows(s1.index_select(-2, perm), _sf_perm(2 * i), True)
    s2_t = _rows(s2, _sf_perm(s2.size(-2)), True)
    return (type(l1_weights)((d1.index_select(-2, perm).contiguous(), s1_t)),
            type(l2_weights)((d2, s2_t)))


def untransformed(kind: str, l1, l2, engine: str):
    """``(w1 [E_l, 2I, H], w2 [E_l, H, I])`` in the natural order (gate rows, then up rows): exact bf16 values,
    stored bf16 (engine ``bf16``) or float32 (engine ``fp32``); with the ``bf16`` engine where they can be packed
    and the cache holds them, each is instead the tuple of its experts' packed copies
    (:func:`~deepep_ascend.gemm.packing.pack_groups`; one copy of the weights is cached, not two); FP4
    weights, where the AMX kernel runs and their scales qualify, are instead the FP4 copies it decodes itself
    (:func:`~deepep_ascend.gemm.packing.pack_fp4_groups`, a quarter of the bytes, no bf16 copy). Cached by
    identity and version of the transformed tensors (:func:`deepep_ascend.gemm.weight_cache.cached_by_tensors`)."""
    tensors = (l1, l2) if kind == "bf16" else (l1[0], l1[1], l2[0], l2[1])

    def build():
        if kind == "bf16":
            i = l1.size(-2) // 2
            w1 = l1.index_select(-2, _inverse(_l1_perm(i))).contiguous()
            # l2 itself when already contiguous: cache a detached alias, so the entry does not keep the key
            # tensor alive (the entry dies with it)
            w2 = l2.detach().contiguous()
        else:
            (d1, s1), (d2, s2) = l1, l2
            i = d1.size(-2) // 2
            inv = _inverse(_l1_perm(i))
            s1_nat = s1.index_select(-2, _inverse(_sf_perm(2 * i))).index_select(-2, inv)
            s2_nat = s2.index_select(-2, _inverse(_sf_perm(s2.size(-2))))
            d1_nat = d1.index_select(-2, inv)
            if engine == "bf16" and cacheable(tensors):
                # the FP4 copies the AMX kernel decodes itself: a quarter of the bytes, the same results
                packed = pack_fp4_groups(d1_nat, s1_nat, SF_GRAN), pack_fp4_groups(d2, s2_nat, SF_GRAN)
                if None not in packed:
                    return packed
            w1 = dequantize_operand(d1_nat, s1_nat.contiguous(), 1, SF_GRAN, "l1_weights").to(BF16)
            w2 = dequantize_operand(d2, s2_nat.contiguous(), 1, SF_GRAN, "l2_weights").to(BF16)
        if engine != "bf16":
            return w1.float(), w2.float()
        if not cacheable(tensors):
            return w1, w2  # packing on every call would cost more than the matmuls' own reorders
        if _packing.PACKER is not None and not optional_copy_fits(packed_nbytes(w1) + packed_nbytes(w2)):
            return w1, w2
        packed1, packed2 = pack_groups(w1), pack_groups(w2)
        return (w1, w2) if packed1 is None else (packed1, packed2)

    return cached_by_tensors(("mega_moe_untransformed", kind, engine), tensors, build)


def shared_bf16(kind: str, s1, s2, h: int, si: int, where: str):
    """Validate and return bf16 ``(w1 [2·S·I, H], w2 [H, S·I])`` of the shared experts (natural order;
    ``si`` = ``S·I``): ``s1``, ``s2`` as given (``kind`` ``'bf16'``: bf16 tensors of those shapes) or
    dequantized from ``(data, sf)`` pairs (``'fp8'``: int8 packed FP4 ``[.., K/2]`` or e4m3 ``[.., K]`` data,
    int32 packed UE8M0 ``[.., K/128]``; docs/semantics/mega-moe.md §1.4). ``where`` starts the messages.

    Raises:
        TypeError: a weight of the wrong type or dtype. ValueError: a wrong shape, or no dense CPU storage.
    """
    if kind == "bf16":
        for name, t, shape in (("shared_l1_weights", s1, (2 * si, h)), ("shared_l2_weights", s2, (h, si))):
            if not isinstance(t, torch.Tensor) or t.dtype != BF16:
                raise TypeError(f"{where}: `{name}` must be a bfloat16 tensor, got {getattr(t, 'dtype', type(t))}")
            check_storage(f"{where}: `{name}`", t)
            if tuple(t.shape) != shape:
                raise ValueError(f"{where}: `{name}` must be {shape}, got {tuple(t.shape)}")
        return s1, s2
    out = []
    for name, p, (n, k) in (("shared_l1_weights", s1, (2 * si, h)), ("shared_l2_weights", s2, (h, si))):
        if not (isinstance(p, (tuple, list)) and len(p) == 2 and all(isinstance(t, torch.Tensor) for t in p)):
            raise TypeError(f"{where}: `{name}` must be a (data, sf) pair of tensors, got {type(p).__name__}")
        data, sf = p
        check_storage(f"{where}: `{name}[0]`", data)
        check_storage(f"{where}: `{name}[1]`", sf)
        if data.dtype == torch.int8:
            want = (n, k // 2)
        elif data.dtype == FP8:
            want = (n, k)
        else:
            raise TypeError(f"{where}: `{name}[0]` must be int8 (packed FP4) or float8_e4m3fn, got {data.dtype}")
        if sf.dtype != torch.int32:
            raise TypeError(f"{where}: `{name}[1]` must be int32 packed UE8M0, got {sf.dtype}")
        if tuple(data.shape) != want or tuple(sf.shape) != (n, k // 128):
            raise ValueError(f"{where}: `{name}` must be data {want} and sf {(n, k // 128)}, got "
                             f"{tuple(data.shape)} and {tuple(sf.shape)}")
        out.append(dequantize_weights(data, sf, 1, SF_GRAN).to(BF16))
    return tuple(out)
