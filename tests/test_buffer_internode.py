"""Buffer normal internode mode (two hops, simulated nodes) vs the pure-torch reference (issue 3).

Run: ``mpiexec -n N python -m pytest --with-mpi -q tests/test_buffer_internode.py`` (N = 2, 4, 8).
Every ``ranks_per_node`` that splits the world into at least two nodes is tested: 2 ranks as
2 × 1, 4 as 2 × 2 and 4 × 1, 8 as 2 × 4, 4 × 2 and 8 × 1. Comparisons are bitwise, combine
included: the reference (``ref_combine(..., ranks_per_node=)``) rounds each node's partial sum to
bf16 before the origin's sum, as spec §5 says DeepEP does.
"""

from __future__ import annotations

import pytest
import torch
from buffer_helpers import BF16, Case, Checker, coll, make_topk_idx, make_x, run_case
from mpi_utils import world
from reference import ref_combine

from deepep_ascend import Buffer

pytestmark = [pytest.mark.mpi(min_size=2), pytest.mark.watchdog(240)]

CASES = [
    Case("uniform_h128_e16_k4", cached=True, bias="pair"),
    Case("skewed_every_token_to_one_rank", tokens=24, hidden=256, experts=32, topk=4, routing="skewed"),
    Case("rank_with_zero_tokens", tokens=20, experts=16, topk=3, zero_rank=True, cached=True, bias="one"),
    Case("rows_all_minus1", tokens=30, experts=64, topk=6, routing="allneg", cached=True),
    Case("h200_not_div_128_e8_k8_align4", tokens=20, hidden=200, experts=8, topk=8, align=4),
    Case("num_worst_tokens_async", tokens=10, experts=32, topk=2, worst=True, cached=True, use_async=True,
         bias="pair_first_none"),
    Case("fp8_column_major_scales", tokens=24, hidden=256, x_kind="fp8", cached=True),
    Case("fp8_ue8m0_async", tokens=12, hidden=1024, experts=32, topk=4, x_kind="fp8_ue8m0", use_async=True),
    Case("no_topk", tokens=24, with_topk=False, cached=True),
    Case("config_num_sms_8_align128", tokens=40, num_sms=8, align=128, cached=True),
]


def _node_sizes(num_ranks):
    return [rpn for rpn in range(1, num_ranks) if num_ranks % rpn == 0]


def _hints(num_ranks, rpn, cases):
    nvl = max(Buffer.get_normal_buffer_size_hint(**c.hint_args(num_ranks), ranks_per_node=rpn) for c in cases)
    rdma = max(Buffer.get_normal_rdma_buffer_size_hint(**c.hint_args(num_ranks), ranks_per_node=rpn) for c in cases)
    return nvl, rdma


_BUFFERS = {}


@pytest.fixture(scope="module")
def buffers():
    yield _BUFFERS
    for b in _BUFFERS.values():
        coll(b.destroy, what="destroy internode buffer")
    _BUFFERS.clear()


def _buffer(buffers, rpn):
    if rpn not in buffers:
        comm = world()
        nvl, rdma = _hints(comm.Get_size(), rpn, CASES)
        buffers[rpn] = Buffer(None, nvl, rdma, comm=comm, explicitly_destroy=True, ranks_per_node=rpn)
    return buffers[rpn]


def _rpn_params():
    R = world().Get_size()
    return [pytest.param(rpn, id=f"{R // rpn}x{rpn}") for rpn in _node_sizes(R)] or [pytest.param(1, id="n/a")]


@pytest.mark.parametrize("rpn", _rpn_params())
@pytest.mark.parametrize("case", CASES, ids=str)
def test_internode_dispatch_combine_vs_reference(buffers, comm, rpn, case):
    if comm.Get_size() % rpn or rpn >= comm.Get_size():
        pytest.skip("needs at least two nodes")
    buf = _buffer(buffers, rpn)
    assert buf.num_nodes == comm.Get_size() // rpn
    chk = run_case(buf, comm, case, seed=CASES.index(case) + 100 * rpn)
    chk.finish(f"{case.name} at {buf.num_nodes}x{rpn}")
