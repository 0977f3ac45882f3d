"""``deepep_ascend.utils`` carries ``deep_ep.utils``' names with DeepEP's semantics: imports as DeepEP code
writes them, the FP8 helper casts against DeepEP's recipe written out here, ``calc_diff`` against its
formula, and the domain sizes of the world."""

from __future__ import annotations

import torch

import deepep_ascend
from deepep_ascend.utils import EventHandle, EventOverlap
from deepep_ascend.utils.envs import get_logical_domain_size, get_physical_domain_size
from deepep_ascend.utils.math import align, calc_diff, ceil_div, per_token_cast_back, per_token_cast_to_fp8
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
