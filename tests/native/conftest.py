"""Fixtures of the native kernels' tests: a test run once on each of a kernel's loops, the vector one and the
portable one (the same bits)."""

from __future__ import annotations

import pytest

from deepep_ascend import native


def _each_loop(request, switch, why: str):
    """Yield ``request.param`` with ``switch`` (a ``native`` function: None reads, False turns the vector loop off,
    True on where the CPU has it) set for it: the portable loop for ``"portable"``, else the vector loop, skipped
    (``why``) where it does not run. The state before is restored."""
    before = switch()
    if request.param != "portable" and not switch(True):
        pytest.skip(why)
    if request.param == "portable":
        switch(False)
    yield request.param
    switch(before)


@pytest.fixture(params=["avx2", "portable"])
def row_sum_loop(request):
    """The row sums' AVX2 loop, then the portable one (``native.row_sums_avx2``)."""
    yield from _each_loop(request, native.row_sums_avx2, "the row sums' AVX2 loop does not run here (no AVX2, or no "
                                                         "native library)")


@pytest.fixture(params=["avx512", "portable"])
def vector_path(request):
    """LogFMT's AVX-512 paths, then the portable ones (``native.logfmt_avx512``)."""
    yield from _each_loop(request, native.logfmt_avx512, "no AVX-512F on this CPU")
