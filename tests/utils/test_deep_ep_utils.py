"""``deepep_ascend.utils`` carries ``deep_ep.utils``' names with DeepEP's semantics: imports as DeepEP code
writes them, the FP8 helper casts against DeepEP's recipe written out here, ``calc_diff`` against its
formula, and the domain sizes of the world."""

from __future__ import annotations

import pytest
import torch

import deepep_ascend
from deepep_ascend.utils import EventHandle, EventOverlap
from deepep_ascend.utils.envs import get_logical_domain_size, get_physical_domain_size
from deepep_ascend.utils.math import (
    align,
    calc_diff,
    ceil_div,
    count_bytes,
    create_grouped_scores,
    hash_tensor,
    hash_tensors,
    inplace_unique,
    per_token_cast_back,
    per_token_cast_to_fp8,
    safe_div,
)
from tests.support.mpi_utils import world


def test_names_are_the_library_objects():
    assert EventHandle is deepep_ascend.EventHandle and EventOverlap is deepep_ascend.EventOverlap
    assert (ceil_div(7, 4), align(7, 4), align(8, 4), ceil_div(0, 3)) == (2, 8, 8, 0)


def test_fp8_helper_casts_follow_deepep_recipe():
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(9, 300, generator=g) * torch.logspace(-3, 3, 9)[:, None]).to(torch.bfloat16)
    x[2] = 0  # amax at the 1e-4 floor
    data, sf = per_token_cast_to_fp8(x)
    # DeepEP's helper: pad to 128, amax per group clamped at 1e-4, x * (448.0 / amax) in float32, e4m3
    pad = torch.nn.functional.pad(x.float(), (0, 84)).view(9, -1, 128)
    amax = pad.abs().amax(dim=2).clamp(1e-4)
    want = (pad * (448.0 / amax.unsqueeze(2))).to(torch.float8_e4m3fn).view(9, -1)[:, :300]
    assert torch.equal(data.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(sf, amax / 448.0)
    back = per_token_cast_back(data, sf)
    want_back = (torch.nn.functional.pad(want.float(), (0, 84)).view(9, -1, 128) * sf.view(9, -1, 1)
                 ).view(9, -1)[:, :300].to(torch.bfloat16)
    assert back.dtype == torch.bfloat16 and torch.equal(back, want_back)
    assert calc_diff(back, x) < 1e-3


def test_calc_diff_is_deepeps_formula():
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(5, 7, generator=g), torch.randn(5, 7, generator=g)
    xd, yd = x.double() + 1, y.double() + 1
    assert calc_diff(x, y) == float(1 - 2 * (xd * yd).sum() / (xd * xd + yd * yd).sum())
    assert calc_diff(x, x) == 0.0


def test_domain_sizes_of_the_world():
    comm = world()
    R = comm.Get_size()
    nodes, per_node = get_physical_domain_size(comm)
    assert nodes * per_node == R
    assert get_logical_domain_size(comm, allow_hybrid_mode=False) == (1, R)


def test_deepeps_test_helpers():
    """The helpers DeepEP's tests import from ``deep_ep.utils.math``, against their definitions written out here."""
    assert (safe_div(0, 0), safe_div(3, 2), safe_div(0.0, 4)) == (0, 1.5, 0.0)
    with pytest.raises(ZeroDivisionError):
        safe_div(1, 0)
    t = [torch.zeros(3, 4), (torch.zeros(5, dtype=torch.int8), None)]
    assert count_bytes(*t) == 3 * 4 * 4 + 5 and count_bytes() == 0
    f = torch.tensor([1.0, -2.0])  # 4-byte elements: their int32 words summed
    assert hash_tensor(f) == int(f.view(torch.int32).sum())
    i8 = torch.tensor([[1, -1], [2, 3]], dtype=torch.int8).t()  # not contiguous, 1-byte: its bytes summed
    assert hash_tensor(i8) == 1 + 255 + 2 + 3
    assert hash_tensors(f, [i8, None], "x") == hash_tensor(f) ^ hash_tensor(i8)
    x = torch.tensor([[3, 1, 3, -1], [-1, -1, -1, -1], [0, 5, 2, 5], [4, 4, 4, 4]])
    inplace_unique(x, 6)  # each row's distinct ids in [0, 6), descending, then -1
    assert x.tolist() == [[3, 1, -1, -1], [-1, -1, -1, -1], [5, 2, 0, -1], [4, -1, -1, -1]]
    y = torch.tensor([[0, 1, 0, 1, -1]])
    inplace_unique(y, 2)  # at most num_slots columns keep values
    assert y.tolist() == [[1, 0, -1, -1, -1]]
    scores = torch.arange(1.0, 9.0).view(1, 8)
    assert create_grouped_scores(scores, torch.tensor([[1, 3]]), 4).tolist() == [[0, 0, 3, 4, 0, 0, 7, 8]]


def test_cast_back_takes_the_scales_by_element_count():
    """DeepEP's ``per_token_cast_back`` reshapes the scales by element count: a low-latency receive's UE8M0 words
    viewed ``[-1, hidden // 128]`` (DeepEP's legacy test) decode as the same ``[M, hidden // 128]`` bytes."""
    g = torch.Generator().manual_seed(5)
    m, hidden = 8, 1024
    data = (torch.randn(m, hidden, generator=g) * 4).to(torch.float8_e4m3fn)
    exps = torch.randint(120, 130, (m, hidden // 128), generator=g, dtype=torch.uint8)
    packed = exps.view(torch.int32)  # [m, hidden / 512]: four exponent bytes per word
    want = per_token_cast_back(data, exps.view(m, -1).float().sub(127).exp2())
    assert torch.equal(per_token_cast_back(data, packed.reshape(-1, hidden // 128)), want)
    assert torch.equal(per_token_cast_back(data, packed), want)
    with pytest.raises(ValueError, match="rows"):
        per_token_cast_back(data, torch.ones(m * 8 + 1))
