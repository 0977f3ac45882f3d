"""The symmetric buffer (``deepep_ascend.mega_moe.symm_buffer``): the constructor's checks on every rank,
the ranks' agreement on its arguments, the capacity's rounding and the choice of backend.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import deepep_ascend as dea
from deepep_ascend import ConsensusError
from tests.support.buffer_helpers import all_ranks_ok, capture, coll
from tests.support.mega_moe import H_BF16, H_FP8

pytestmark = [pytest.mark.mpi(min_size=1), pytest.mark.watchdog(240)]


def test_constructor_checks(comm):
    """docs/semantics/mega-moe.md §1.1 asserts, raised identically on every rank before anything collective."""
    size = comm.Get_size()
    bad = [dict(hidden=100), dict(intermediate_hidden=100), dict(num_topk=33), dict(activation="gelu"),
           dict(mma_type="fp16"), dict(use_fp8_dispatch=False), dict(mma_type="bf16xbf16", intermediate_hidden=12)]
    if size > 1:
        bad.append(dict(num_experts=size + 1))
    for over in bad:
        args = dict(num_experts=4 * size, num_max_tokens_per_rank=8, num_topk=2, hidden=128, intermediate_hidden=128)
        args.update(over)
        with pytest.warns(DeprecationWarning) if "use_fp8_dispatch" in over else contextlib.nullcontext():
            _, exc = capture(lambda args=args: dea.get_symm_buffer_for_mega_moe(comm, **args))
        assert isinstance(exc, AssertionError), (over, exc)
    # DeepGEMM PR #445's parameterized SwiGLU is an activation of the buffer too (the layout is the same)
    args = dict(num_experts=4 * size, num_max_tokens_per_rank=8, num_topk=2, hidden=128, intermediate_hidden=128)
    buf = coll(dea.get_symm_buffer_for_mega_moe, comm, **args, activation="swigluoai", what="swigluoai buffer")
    assert buf.activation == "swigluoai" and buf.x.shape == (384, 128)
    coll(buf.destroy, what="destroy")


@pytest.mark.mpi(min_size=2)
def test_constructor_arguments_must_agree_across_ranks(comm):
    """Ranks passing different arguments all raise ``ConsensusError`` naming the argument and each rank's value
    (found by a helper: a different num_experts built a buffer whose first call failed deep inside, a different
    intermediate_hidden was never noticed, the others failed on a window size); a rank whose own arguments fail
    the checks raises its ``AssertionError`` and the others a ``ConsensusError`` naming it, instead of waiting."""
    rank, size = comm.Get_rank(), comm.Get_size()
    last = size - 1
    base = dict(num_experts=4 * size, num_max_tokens_per_rank=8, num_topk=2, hidden=128, intermediate_hidden=128,
                mma_type="bf16xbf16")
    for name, other in (("num_experts", 8 * size), ("intermediate_hidden", 256), ("hidden", 256), ("num_topk", 3),
                        ("mma_type", "fp8xfp4")):
        args = dict(base, **({name: other} if rank == last else {}))
        _, exc = capture(lambda args=args: dea.get_symm_buffer_for_mega_moe(comm, **args))
        want = f"rank {last}: {other!r}"
        all_ranks_ok(comm, isinstance(exc, ConsensusError) and f"disagree on {name}" in str(exc) and want in str(exc),
                     f"{name} differs on rank {last}: {exc!r}")
    _, exc = capture(lambda: dea.get_symm_buffer_for_mega_moe(comm, **dict(base, hidden=100 if rank == last else 128,
                                                                            mma_type="fp8xfp4")))
    if rank == last:
        ok = isinstance(exc, AssertionError) and "hidden (100)" in str(exc)
    else:
        ok = isinstance(exc, ConsensusError) and f"rejected on rank(s) [{last}]" in str(exc)
    all_ranks_ok(comm, ok, f"bad hidden on rank {last} only: {exc!r}")
    # the same values spelled otherwise are the same arguments: True is 1, capacities 8 and 300 both hold 384 rows
    spelled = dict(base, num_topk=True if rank == last else 1, num_max_tokens_per_rank=300 if rank == last else 8)
    buf = coll(dea.get_symm_buffer_for_mega_moe, comm, **spelled, what="equal values spelled otherwise")
    coll(buf.destroy, what="destroy")
    buf = coll(dea.get_symm_buffer_for_mega_moe, comm, **base, what="the same arguments afterwards")
    coll(buf.destroy, what="destroy")


def test_capacity_rounding(env):
    buf = env.get("bf16", 0)
    assert buf.num_max_tokens_per_rank == 384 and buf.x.shape == (384, H_BF16) and buf.topk_idx.dtype == torch.int64
    assert buf.buffer.dtype == torch.int8
    assert buf.x.untyped_storage().data_ptr() == buf.buffer.untyped_storage().data_ptr()
    fbuf = env.get("fp8", 0)
    assert fbuf.x.dtype == torch.float8_e4m3fn and fbuf.x_sf.shape == (384, H_FP8 // 128)
    assert fbuf.x_sf.dtype == torch.int32 and fbuf.topk_weights.dtype == torch.float32


def test_backend_argument(comm, monkeypatch):
    """``backend``: a name other than 'shm'/'buffer' (keyword or $DEEPEP_ASCEND_MEGA_MOE_BACKEND) fails the
    constructor's checks on every rank; across simulated nodes the default is 'buffer' and 'shm' is refused
    on every rank, naming the nodes."""
    size = comm.Get_size()
    args = (comm, 2 * size, 8, 2, 64, 16)
    _, exc = capture(lambda: dea.get_symm_buffer_for_mega_moe(*args, mma_type="bf16xbf16", backend="p2p"))
    all_ranks_ok(comm, isinstance(exc, AssertionError) and "backend" in str(exc) and "'p2p'" in str(exc),
                 f"bad backend keyword: {exc!r}")
    monkeypatch.setenv("DEEPEP_ASCEND_MEGA_MOE_BACKEND", "SHM")
    _, exc = capture(lambda: dea.get_symm_buffer_for_mega_moe(*args, mma_type="bf16xbf16"))
    all_ranks_ok(comm, isinstance(exc, AssertionError) and "DEEPEP_ASCEND_MEGA_MOE_BACKEND" in str(exc),
                 f"bad backend variable: {exc!r}")
    monkeypatch.setenv("DEEPEP_ASCEND_MEGA_MOE_BACKEND", "buffer")
    buf = coll(dea.get_symm_buffer_for_mega_moe, *args, mma_type="bf16xbf16", what="buffer backend from the variable")
    ok = buf.backend == "buffer"
    coll(buf.destroy, what="destroy")
    monkeypatch.delenv("DEEPEP_ASCEND_MEGA_MOE_BACKEND")
    if size > 1:
        monkeypatch.setenv("DEEPEP_ASCEND_RANKS_PER_NODE", "1")
        buf = coll(dea.get_symm_buffer_for_mega_moe, *args, mma_type="bf16xbf16", what="default across nodes")
        ok = ok and buf.backend == "buffer"
        coll(buf.destroy, what="destroy")
        _, exc = capture(lambda: dea.get_symm_buffer_for_mega_moe(*args, mma_type="bf16xbf16", backend="shm"))
        ok = ok and isinstance(exc, ValueError) and f"span {size} nodes" in str(exc)
    all_ranks_ok(comm, ok, "backend choice")
