"""``deepep_ascend.rounding``: ``ceil_div`` and ``align`` against exact rational arithmetic, on ints (negative
ones too) and elementwise on signed and unsigned integer tensors and arrays; the names DeepEP's and DeepGEMM's APIs
export are these."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import torch

from deepep_ascend.rounding import align, ceil_div


def test_ceil_div_and_align_are_exact_for_every_int():
    for y in (1, 2, 3, 7, 64, 128, 4096):
        for x in [*range(-300, 301), 2**62 + 1, -(2**62) - 1, 10**30 + 7]:
            q = math.ceil(Fraction(x, y))
            assert ceil_div(x, y) == q, (x, y)
            assert align(x, y) == q * y and align(x, y) >= x > align(x, y) - y, (x, y)


def test_elementwise_on_integer_tensors_and_arrays():
    x = torch.arange(-1000, 1000, dtype=torch.int64)
    for y in (1, 5, 128):
        want = torch.tensor([math.ceil(Fraction(int(v), y)) for v in x])
        assert torch.equal(ceil_div(x, y), want) and torch.equal(align(x, y), want * y)
        assert np.array_equal(align(x.numpy(), y), (want * y).numpy())


def test_unsigned_dtypes_where_x_plus_y_minus_1_fits():
    for y in (1, 8, 64):
        values = [v for v in range(256) if v + y - 1 < 256]
        want = [math.ceil(Fraction(v, y)) for v in values]
        got = ceil_div(torch.tensor(values, dtype=torch.uint8), y)
        assert got.dtype == torch.uint8 and got.tolist() == want
        for dt in (np.uint8, np.uint32, np.uint64):
            arr = np.array(values, dtype=dt)
            assert ceil_div(arr, dt(y)).tolist() == want and align(arr, dt(y)).tolist() == [w * y for w in want]


def test_numpy_scalars_at_the_top_of_their_dtype_do_not_overflow():
    with np.errstate(over="raise"):
        assert ceil_div(np.uint8(255), 1) == 255 and ceil_div(np.uint8(250), 6) == 42
        assert align(np.uint8(250), 5) == 250


def test_the_exported_helpers_are_these():
    from deepep_ascend.gemm import scales
    from deepep_ascend.utils import math as ep_math

    assert scales.ceil_div is ep_math.ceil_div is ceil_div
    assert scales.align is ep_math.align is align
