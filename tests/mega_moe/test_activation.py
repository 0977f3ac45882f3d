"""MegaMoE's activations on one rank's rows (``deepep_ascend.mega_moe.experts.activation``), against the
reference written from DeepGEMM's epilogue (``tests/support/reference.py``: ``mega_swiglu``): plain SwiGLU and
``'swigluoai'`` (DeepGEMM PR #445, gpt-oss: ``g·sigmoid(alpha·g)·(u + up_bias)`` after the clamp), on values
past the clamp on both sides, signed zeros and several alphas and biases, with and without the native kernel;
and the checks of the activation's arguments (docs/semantics/mega-moe.md §1.3, §2).
"""

from __future__ import annotations

import math

import pytest
import torch

from deepep_ascend.mega_moe import experts as mm
from tests.support.reference import mega_swiglu

BF16 = torch.bfloat16
I = 64  # noqa: E741 - the intermediate size: two UE8M0 groups per row

# Gate and up values: past the clamp on both sides, at it, zeros of both signs, u = -1 (u + 1 = 0).
_SPECIAL = [0.0, -0.0, 1.0, -1.0, 6.96875, 7.0, 7.03125, -7.0, -8.0, 30.0, -30.0, 1e4, -1e4, 0.5, -0.5, 2.5]

# (clamp, alpha, up_bias): gpt-oss, gpt-oss without a clamp, identity parameters, others; a zero clamp,
# negative and zero alphas
PARAMS = [(7.0, 1.702, 1.0), (None, 1.702, 1.0), (7.0, 1.0, 0.0), (10.0, 0.5, -0.25), (0.0, 2.0, 1.0),
          (7.0, -1.0, 1.0), (7.0, 0.0, 1.0), (0.1, 1.702, 1.0)]


def _rows(seed, n=48):
    """``h [n, 2I]`` bf16: every (gate, up) pair of special values, then random rows (some far past the
    clamp); ``w [n]`` float32 with zeros."""
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(n, 2 * I, generator=g) * 6).to(BF16)
    sp = torch.tensor(_SPECIAL)
    pairs = torch.cartesian_prod(sp, sp)  # [256, 2]: every gate with every up
    flat_g, flat_u = h[:, :I].reshape(-1), h[:, I:].reshape(-1)
    flat_g[:pairs.size(0)] = pairs[:, 0].to(BF16)
    flat_u[:pairs.size(0)] = pairs[:, 1].to(BF16)
    h[:, :I] = flat_g.view(n, I)
    h[:, I:] = flat_u.view(n, I)
    h[-4:] *= 50.0  # rows far past any clamp
    w = torch.rand(n, generator=g) + 0.5
    w[3::11] = 0.0
    return h, w


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("fast_math", [True, False])
@pytest.mark.parametrize("kind", ["bf16", "fp8"])
@pytest.mark.parametrize("clamp,alpha,up_bias", PARAMS)
def test_swigluoai_is_the_formula_bit_for_bit(kind, fast_math, native, clamp, alpha, up_bias):
    h, w = _rows(seed=1)
    oai = mm.swiglu_params("swigluoai", alpha, up_bias, "test")
    got = mm.activation(kind, h, I, w, clamp, fast_math, native=native, oai=oai)
    exp = mega_swiglu(h.float(), I, w, clamp, kind == "fp8", "swigluoai", alpha, up_bias, fast_math)
    assert got.dtype == BF16 and not got.isnan().any()
    assert torch.equal(got.float().view(torch.int32), exp.view(torch.int32)), \
        f"{int((got.float() != exp).sum())} elements differ"
    f32 = mm.activation(kind, h, I, w, clamp, fast_math, torch.float32, native=native, oai=oai)
    assert torch.equal(f32.view(torch.int32), exp.view(torch.int32))  # the fp32 engine's operands


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_plain_swiglu_is_the_formula_bit_for_bit(kind, native):
    h, w = _rows(seed=2)
    for clamp in (None, 7.0):
        got = mm.activation(kind, h, I, w, clamp, False, native=native)
        exp = mega_swiglu(h.float(), I, w, clamp, kind == "fp8")
        assert torch.equal(got.float().view(torch.int32), exp.view(torch.int32))


def _one(gate, up, clamp, alpha, up_bias, w=1.0):
    """The bf16 activation of one (gate, up) pair (bf16 path, fast_math off)."""
    h = torch.tensor([[gate] * 8 + [up] * 8]).to(BF16)
    oai = mm.swiglu_params("swigluoai", alpha, up_bias, "test")
    return float(mm.activation("bf16", h, 8, torch.tensor([w]), clamp, False, oai=oai)[0, 0])


def _f64(gate, up, clamp, alpha, up_bias, w=1.0):
    """The same pair in float64 from the gpt-oss formula, written out (clamp first)."""
    if clamp is not None:
        gate, up = min(gate, clamp), min(max(up, -clamp), clamp)
    return gate / (1.0 + math.exp(-alpha * gate)) * (up + up_bias) * w


@pytest.mark.parametrize("alpha", [1.702, 1.0, 0.25, 3.0])
def test_clamp_bounds_the_gate_from_above_and_the_up_projection_on_both_sides(alpha):
    """Past the limit (7) the gate is 7 and the up projection ±7: only the gate's negative side is left as it
    is (its sigmoid goes to 0). Each value within one bf16 rounding of the float64 formula."""
    c, b = 7.0, 1.0
    cases = [(100.0, 100.0), (100.0, -100.0), (7.0, 7.0), (-8.0, 3.0), (-7.0, 3.0), (2.0, -1.0), (3.0, 12.0),
             (-100.0, 5.0), (0.5, -0.5)]
    vals = {}
    for g, u in cases:
        got, exp = _one(g, u, c, alpha, b), _f64(g, u, c, alpha, b)
        assert got == pytest.approx(exp, rel=2 ** -8, abs=1e-30), (g, u, got, exp)
        vals[g, u] = got
    assert vals[100.0, 100.0] == vals[7.0, 7.0]  # gate and up clamped from above
    assert vals[100.0, -100.0] == _one(7.0, -7.0, c, alpha, b)  # up clamped from below: (-7 + 1) = -6
    assert vals[-8.0, 3.0] != vals[-7.0, 3.0]  # the gate is not clamped from below
    assert vals[2.0, -1.0] == 0.0  # u + up_bias = 0
    assert _one(3.0, 12.0, None, alpha, b) != vals[3.0, 12.0]  # without a clamp, 12 stays 12


def test_alpha_scales_only_the_sigmoid_and_the_bias_only_the_up_projection():
    """alpha 1 and bias 0 give SwiGLU's values; alpha changes the sigmoid's slope (a larger alpha brings
    g·sigmoid(alpha·g) closer to relu(g)); the bias moves the up projection after its clamp."""
    h, w = _rows(seed=3)
    plain = mm.activation("bf16", h, I, w, 7.0, True)
    ident = mm.activation("bf16", h, I, w, 7.0, True, oai=(1.0, 0.0))
    assert torch.equal(plain.float(), ident.float())  # equal values (a -0 of u may come out +0)
    assert _one(-2.0, 1.0, None, 4.0, 0.0) > _one(-2.0, 1.0, None, 1.0, 0.0)  # closer to relu(-2) = 0
    assert _one(2.0, 1.0, None, 4.0, 0.0) > _one(2.0, 1.0, None, 1.0, 0.0)  # closer to 2
    assert _one(1.0, 7.0, 7.0, 1.0, 1.0) == pytest.approx(8.0 / (1.0 + math.exp(-1.0)), rel=2 ** -8)


def test_parameters_are_checked_and_rounded_to_float32():
    op = "fp8_fp4_mega_moe"
    assert mm.swiglu_params("swiglu", 1.0, 0.0, op) is None
    assert mm.swiglu_params("swiglu", 1, 0, op) is None
    alpha, bias = mm.swiglu_params("swigluoai", 1.702, 1.0, op)
    assert alpha == float(torch.tensor(1.702, dtype=torch.float32)) and bias == 1.0
    for act in ("gelu", "SwiGLU", "swiglu_oai", None, 1):
        with pytest.raises(ValueError, match=r"fp8_fp4_mega_moe: activation must be one of \('swiglu', "
                                             r"'swigluoai'\), got " + repr(act).replace("(", r"\(")):
            mm.swiglu_params(act, 1.0, 0.0, op)
    for bad in (float("nan"), float("inf"), -float("inf"), 1e39, 10 ** 400, True, "1.7", None):
        for name, args in (("activation_alpha", (bad, 1.0)), ("activation_up_bias", (1.702, bad))):
            with pytest.raises(ValueError, match=f"{op}: {name} must be a finite number"):
                mm.swiglu_params("swigluoai", *args, op)
    with pytest.raises(ValueError, match="activation='swiglu' needs activation_alpha=1.0 and activation_up_bias=0.0"
                                         ".*use activation='swigluoai'"):
        mm.swiglu_params("swiglu", 1.702, 1.0, op)
    with pytest.raises(ValueError, match="activation='swiglu' needs"):
        mm.swiglu_params("swiglu", 1.0, 1.0, op)
