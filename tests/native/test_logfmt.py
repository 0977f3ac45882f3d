"""``native.logfmt_*``: LogFMT-10's element passes in C give the bits of ``deepep_ascend.gemm.logfmt``'s torch path
(its own reference, ``tests/gemm/test_quant.py``, checks those against the scalar formula): encoded body, metadata
and tail, and decoded values, for both the AVX-512 and the portable kernels, on values that exercise every
branch (zeros, signed zeros, subnormals, BF16 groups, inf, NaN, clipped ``lb``), strided and batched inputs,
arbitrary wire bytes; and bad operands refused with nothing written."""

from __future__ import annotations

import pytest
import torch

from deepep_ascend import native
from deepep_ascend.gemm import logfmt as lf
from deepep_ascend.native.loader import kernels

pytestmark = pytest.mark.skipif(kernels.logfmt_encode is None, reason="native kernels not built")
BF16 = torch.bfloat16


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _inputs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    small = (torch.randn(24, 1024, generator=g) * 0.01).to(BF16)  # every group LogFMT
    mixed = (torch.randn(3, 5, 896, generator=g) * torch.logspace(-6, 2, 896)).to(BF16)  # some BF16 groups
    special = (torch.randn(16, 512, generator=g) * 0.1).to(BF16)
    special[0, :128] = 0  # all zero: BF16
    special[1, :128] = 0.25  # all equal: BF16
    special[2, 5:100] = 0  # zeros inside a LogFMT group
    special[2, 7] = -0.0
    special[3, :128] = torch.tensor(2.0 ** -130).to(BF16) * torch.arange(1, 129)  # subnormals
    special[4, 0] = 1e-30  # lb clipped to la - 32
    special[5, 3] = float("inf")
    special[6, 9] = float("nan")
    special[7, 130] = -float("inf")
    special[8, 256:384] = -special[8, 256:384].abs()  # every sign set
    special[9, :] = (torch.randn(512, generator=g) * 1e4).to(BF16)  # |x| >= 1: BF16
    special[10, 3] = 1.0  # exactly 1: BF16
    special[11, 3] = 0.99609375  # the largest bf16 below 1
    wide = (torch.randn(40, 2 * 768, generator=g) * 0.05).to(BF16)[:, ::2]  # strided rows and columns
    tall = (torch.randn(768, 12, generator=g) * 0.05).to(BF16).t()  # a transposed view
    return [small, mixed, special, wide, tall, torch.empty(0, 256, dtype=BF16)]


@pytest.mark.parametrize("case", range(6))
def test_encode_and_decode_give_the_bits_of_the_torch_path(vector_path, case):
    x = _inputs()[case]
    body, meta, tail = lf.logfmt10_encode(x)
    tbody, tmeta, ttail = lf.encode(x, native=False)
    assert body.shape == tbody.shape and meta.shape == tmeta.shape and tail.shape == ttail.shape
    assert torch.equal(_bits(body), _bits(tbody))
    assert torch.equal(_bits(meta), _bits(tmeta))
    assert torch.equal(_bits(tail), _bits(ttail))
    y = lf.logfmt10_decode(body, meta, tail)
    ty = lf.decode(tbody, tmeta, ttail, native=False)
    assert y.dtype == torch.float32 and y.shape == x.shape
    assert torch.equal(_bits(y), _bits(ty))  # NaN and -0.0 included: bytes, not values
    if case == 2:  # the branches the special rows exist for took place
        use = lf.logfmt10_group_mask(meta)
        assert not use[0, 0] and not use[1, 0] and use[2, 0] and not use[9].any() and not use[10, 0]
        assert use[11, 0] and y[2, 7].item() == 0 and y[0, :128].eq(0).all()


def _every_magnitude_between(num_sets: int, seed: int) -> torch.Tensor:
    """Groups holding, for each of ``num_sets`` random ``(amax, amin)``, every bf16 magnitude between the two (with
    random signs) beside that pair: each set's codes for every value the format can meet under its parameters,
    the float32 steps that round near a code boundary among them."""
    g = torch.Generator().manual_seed(seed)
    groups = []
    for _ in range(num_sets):
        hi = int(torch.randint(0x3600, 0x3F7F, (), generator=g))  # amax in [2^-19, 1)
        lo = max(1, hi - int(torch.randint(1, 33 * 128, (), generator=g)))  # up to 33 octaves below (lb clipped)
        mags = torch.arange(lo, hi + 1, dtype=torch.int32)
        mags = torch.cat([mags, mags[-1:].expand((-len(mags)) % 126)])  # whole groups
        body = mags.view(-1, 126)
        pair = torch.tensor([hi, lo], dtype=torch.int32).expand(body.size(0), 2)
        groups.append(torch.cat([pair, body], 1))
    bits = torch.cat(groups)
    sign = torch.randint(0, 2, bits.shape, generator=g, dtype=torch.int32) << 15
    return (bits | sign).to(torch.int16).view(BF16).view(-1, 1024 if bits.numel() % 1024 == 0 else 128)


def test_codes_near_their_boundaries_match(vector_path):
    """A float32 rounding difference anywhere in the code arithmetic (a reciprocal for the division, a fused
    multiply-add, another order) changes the code of a value whose quotient lies within an ulp of an integer;
    every magnitude of several hundred parameter sets meets such values (~1 per 10^5)."""
    x = _every_magnitude_between(300, 5)
    assert x.numel() > 400_000
    body, meta, tail = lf.logfmt10_encode(x)
    tbody, tmeta, ttail = lf.encode(x, native=False)
    assert torch.equal(_bits(meta), _bits(tmeta)) and torch.equal(_bits(tail), _bits(ttail))
    assert torch.equal(body, tbody)
    assert torch.equal(_bits(lf.logfmt10_decode(body, meta, tail)),
                       _bits(lf.decode(tbody, tmeta, ttail, native=False)))


def test_decode_of_arbitrary_wire_bytes(vector_path):
    """Every ten-bit value (codes 0..511, both signs) under random group parameters, not only what the encoder
    writes: the same bits as the torch path."""
    g = torch.Generator().manual_seed(11)
    n = 600
    mags = torch.rand(n, 2, generator=g) * 0.9 + 1e-3
    meta = torch.stack([mags.max(1).values, mags.min(1).values * torch.rand(n, generator=g) ** 8], 1).to(BF16)
    meta[::50, 0] = 2.0  # some BF16 groups among them
    body = torch.randint(0, 256, (n, 160), generator=g, dtype=torch.uint8)
    body[0, :128] = torch.arange(128, dtype=torch.uint8) * 2  # low bytes ...
    body[0, 128:] = 0b11100100  # ... with every pair of top bits
    nfb = int((~lf.logfmt10_group_mask(meta)).sum())
    tail = torch.randint(0, 256, (nfb, 96), generator=g, dtype=torch.uint8)
    y = lf.logfmt10_decode(body.view(2, 300, 160), meta.view(2, 300, 2), tail)
    ty = lf.decode(body.view(2, 300, 160), meta.view(2, 300, 2), tail, native=False)
    assert torch.equal(_bits(y), _bits(ty))


def test_group_parameters_give_the_torch_path_bits():
    """``logfmt_params`` against ``_logfmt_params`` (and the decoder's ``2**step``, ``2**lb``) on every amax with
    random amins, the pairs at every edge (zero, equal, inf, NaN, 1, the 32-octave clip, sign bits), bit for bit."""
    g = torch.Generator().manual_seed(13)
    amax = torch.arange(1 << 15, dtype=torch.int32).repeat(4)
    amin = (torch.rand(amax.shape, generator=g) * (amax + 1)).to(torch.int32)  # at most amax
    amin[::7] = torch.randint(0, 1 << 15, (amin[::7].numel(),), generator=g, dtype=torch.int32)  # any
    amin[::11] = amax[::11]  # all magnitudes equal
    amin[::13] = (amax[::13] - 32 * 128 - torch.randint(-3, 4, (amax[::13].numel(),), generator=g)).clamp(min=0)
    bits = torch.stack([amax, amin], 1).to(torch.int16)
    bits[::17] |= -0x8000  # a sign bit set (arbitrary wire bytes)
    n = bits.size(0)
    use = torch.empty(n, dtype=torch.bool)
    lb, step, rho = (torch.empty(n) for _ in range(3))
    p, two_lb = (torch.empty(n, dtype=torch.float64) for _ in range(2))
    nfb = native.logfmt_params(bits, lf._bf16_log2_table(), use, lb, step, rho, p, two_lb)
    tuse, tlb, tstep, trho, tem1 = lf._logfmt_params(bits[:, 0], bits[:, 1])
    assert 0 < nfb < n and nfb == int((~tuse).sum())
    assert torch.equal(use, tuse)
    for mine, theirs in ((lb, tlb), (step, tstep), (p, 1.0 + tem1), (two_lb, lf._exp2_f64(tlb.double()))):
        assert torch.equal(_bits(mine), _bits(theirs))
    assert torch.equal(_bits(rho), _bits(trho))


def _operands(g=4):
    x = (torch.randn(g, 128) * 0.01).to(BF16).view(torch.int16)
    meta = torch.empty(g, 2, dtype=torch.int16)
    native.logfmt_meta(x, meta)
    use, lb, step, rho, em1 = lf._logfmt_params(meta[:, 0], meta[:, 1])
    return x, use, lb, step, rho, em1


def test_bad_operands_are_refused_and_nothing_is_written():
    x, use, lb, step, rho, em1 = _operands()
    table = lf._bf16_log2_table()
    body = torch.full((4, 160), 7, dtype=torch.uint8)
    tail = torch.empty(0, 96, dtype=torch.uint8)
    cases = [
        (lambda: native.logfmt_meta(x.float(), torch.empty(4, 2, dtype=torch.int16)), "x must be"),
        (lambda: native.logfmt_meta(x[:, :64], torch.empty(4, 2, dtype=torch.int16)), "x must be"),
        (lambda: native.logfmt_meta(x, torch.empty(2, 4, dtype=torch.int16)), "meta must be"),
        (lambda: native.logfmt_meta(x, x[:, :2]), "meta must be a contiguous"),
        (lambda: native.logfmt_encode(x, use, lb, step, rho, table, body, torch.empty(1, 96, dtype=torch.uint8)),
         "tail must be [0, 96]"),
        (lambda: native.logfmt_encode(x, use.to(torch.uint8), lb, step, rho, table, body, tail), "use must be"),
        (lambda: native.logfmt_encode(x, use, lb.double(), step, rho, table, body, tail), "lb must be"),
        (lambda: native.logfmt_encode(x, use, lb, step, rho[:3], table, body, tail), "rho must be"),
        (lambda: native.logfmt_encode(x, use, lb, step, rho, table[:100], body, tail), "log2_of must be"),
        (lambda: native.logfmt_encode(x, use, lb, step, rho, table, body.t(), tail), "body must be a contiguous"),
        (lambda: native.logfmt_encode(x, use, lb, step, rho, table, x.view(torch.uint8)[:, :160].contiguous()[:2],
                                      tail), "body must be [4, 160]"),
        (lambda: native.logfmt_encode(x, use, lb, step, rho, table, x.view(torch.uint8)[:, :160], tail),
         "body must be a contiguous"),
        (lambda: native.logfmt_decode(body, tail, use, 1.0 + em1, em1, torch.empty(4, 128)[:, :64]), "out must be"),
        (lambda: native.logfmt_decode(body, tail, use, (1.0 + em1).float(), em1, torch.empty(4, 128)), "p must be"),
        (lambda: native.logfmt_decode(body[:, :128], tail, use, 1.0 + em1, em1, torch.empty(4, 128)),
         "body must be"),
        (lambda: native.logfmt_decode(body, tail, use, 1.0 + em1, em1, torch.empty(4, 128, requires_grad=True)),
         "requires grad"),
    ]
    for call, words in cases:
        with pytest.raises(ValueError, match="deepep_ascend.native.logfmt_") as err:
            call()
        assert words in str(err.value), (words, str(err.value))
    assert body.eq(7).all()  # nothing written by any refused call
    # an output overlapping an input
    bytes_of_x = x.view(torch.uint8).view(-1)
    with pytest.raises(ValueError, match="meta overlaps x"):
        native.logfmt_meta(x, bytes_of_x[:16].view(torch.int16).view(4, 2))
    out = torch.empty(4, 128)
    with pytest.raises(ValueError, match="out overlaps p"):
        native.logfmt_decode(body, tail, use, out.view(-1)[:8].view(torch.float64), em1, out)


def test_the_combine_format_api_still_refuses_bad_inputs_first():
    """The public functions check before the kernels: their messages, whatever path runs."""
    with pytest.raises(ValueError, match="multiple of 128"):
        lf.logfmt10_encode(torch.zeros(2, 100, dtype=BF16))
    with pytest.raises(TypeError):
        lf.logfmt10_encode(torch.zeros(2, 128))
    body, meta, tail = lf.logfmt10_encode(torch.full((1, 256), 2.0, dtype=BF16))  # two BF16 groups
    with pytest.raises(ValueError, match="tail must be"):
        lf.logfmt10_decode(body, meta, tail[:1])
