"""The multi-rank harness itself: collective pass/fail, gather_all, size helpers."""

from __future__ import annotations

import textwrap

import pytest
import torch

from tests.support.mpi_utils import (
    CollectiveFailure,
    gather_all,
    run_collectively,
    skip_unless_size,
    sync_outcome,
    up_to_four_ranks,
)


@pytest.mark.mpi(min_size=2)
def test_failure_on_one_rank_fails_every_rank(comm):
    def body():
        if comm.rank == 1:
            raise ValueError("boom on rank 1")
        return comm.rank

    with pytest.raises((CollectiveFailure, ValueError)) as info:
        run_collectively(body, what="body")
    if comm.rank == 1:
        # the failing rank keeps its own exception (full traceback in its report)
        assert info.type is ValueError and "boom on rank 1" in str(info.value)
    else:
        err = info.value
        assert isinstance(err, CollectiveFailure)
        assert err.failed_ranks == [1] and err.nranks == comm.size
        assert "rank 1: ValueError: boom on rank 1" in str(err)
        assert "test_harness.py" in str(err)  # where it failed

    # success everywhere: the result comes back, nothing raised
    assert run_collectively(lambda: comm.rank * 10) == comm.rank * 10


@pytest.mark.mpi(min_size=2)
def test_sync_outcome_lists_every_failing_rank(comm):
    exc = RuntimeError(f"rank {comm.rank} odd") if comm.rank % 2 else None
    failures = sync_outcome(exc, "step")
    assert [f.rank for f in failures] == list(range(1, comm.size, 2))
    assert all(f"rank {f.rank} odd" in f.error for f in failures)
    # skips are not failures
    assert (
        sync_outcome(pytest.skip.Exception("not here") if comm.rank == 0 else None)
        == []
    )


@pytest.mark.mpi(min_size=2)
@up_to_four_ranks()
def test_collective_hooks_end_to_end(comm, pytester):
    """Through pytest's own reporting: an inner session, run in-process on every rank with the
    harness's CollectiveOutcomePlugin (as conftest.py registers it), fails a test that fails on
    rank 1 only — on every rank, and the others' reports name rank 1 and its error."""
    pytester.makeconftest(
        "from tests.support import mpi_utils\n"
        "def pytest_configure(config):\n"
        "    config.pluginmanager.register(mpi_utils.CollectiveOutcomePlugin())\n"
    )
    pytester.makepyfile(
        test_inner=textwrap.dedent(
            """
            import pytest
            from mpi4py import MPI

            @pytest.mark.mpi(min_size=2)
            def test_rank1_fails():
                assert MPI.COMM_WORLD.rank != 1, "inner failure on rank 1"

            @pytest.mark.mpi(min_size=2)
            def test_all_pass():
                assert MPI.COMM_WORLD.allreduce(1) == MPI.COMM_WORLD.size
            """
        )
    )
    # pytest-mpi named: scripts/test.sh disables plugin autoloading
    result = pytester.runpytest_inprocess("-p", "pytest_mpi", "--with-mpi", "-p", "no:cacheprovider", "-q")
    result.assert_outcomes(failed=1, passed=1)
    out = result.stdout.str()
    if comm.rank != 1:
        assert "rank 1: AssertionError: inner failure on rank 1" in out, out


@pytest.mark.mpi(min_size=2)
def test_gather_all_mixed_sizes_and_dtypes(comm):
    r, n = comm.rank, comm.size
    cases = {
        torch.bfloat16: torch.full((r + 1, 3), r + 0.5, dtype=torch.bfloat16),
        torch.float8_e4m3fn: torch.full((r, 4), float(r)).to(torch.float8_e4m3fn),
        torch.bool: torch.tensor([[bool(r % 2)]] * (r + 2)),
        torch.int64: torch.arange(r * 5, dtype=torch.int64).reshape(r, 5),
        torch.float32: torch.arange(6, dtype=torch.float32).reshape(3, 2).t()
        + r,  # strided
    }
    for dtype, local in cases.items():
        got = gather_all(local)
        assert len(got) == n
        for t in got:
            assert t.dtype == dtype and t.is_contiguous()
        assert got[r].shape == local.shape
        assert torch.equal(
            got[r].reshape(-1).view(torch.uint8),
            local.contiguous().reshape(-1).view(torch.uint8),
        )
    bf = gather_all(cases[torch.bfloat16])
    assert [t.shape[0] for t in bf] == [s + 1 for s in range(n)]
    assert all(t.eq(s + 0.5).all() for s, t in enumerate(bf))
    f8 = gather_all(cases[torch.float8_e4m3fn])
    assert all(t.shape == (s, 4) and t.float().eq(s).all() for s, t in enumerate(f8))
    i64 = gather_all(cases[torch.int64])
    assert all(
        torch.equal(t, torch.arange(s * 5).reshape(s, 5)) for s, t in enumerate(i64)
    )
    scalar = gather_all(torch.tensor(r, dtype=torch.int32))
    assert [int(t) for t in scalar] == list(range(n))


@pytest.mark.mpi
def test_skip_unless_size(comm):
    if comm.size == 1:
        with pytest.raises(pytest.skip.Exception):
            skip_unless_size(2, 4, 8)
    skip_unless_size(comm.size)  # never skips
