"""Fixtures of the native kernels' tests."""

from __future__ import annotations

import pytest

from deepep_ascend import native


@pytest.fixture(params=["avx2", "portable"])
def row_sum_loop(request):
    """Run the test with the row sums' AVX2 loop, then with the portable one (``native.row_sums_avx2``); the AVX2
    run is skipped where the CPU has no AVX2 or the library is not loaded. The loop in force before is restored."""
    before = native.row_sums_avx2()
    if request.param == "avx2" and not native.row_sums_avx2(True):
        pytest.skip("the row sums' AVX2 loop does not run here (no AVX2, or no native library)")
    if request.param == "portable":
        native.row_sums_avx2(False)
    yield request.param
    native.row_sums_avx2(before)
