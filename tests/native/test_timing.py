"""``native.timing()``: every call made through the kernel table inside the block is counted and timed, none
outside it; the table is restored on exit (also after an error), functions not loaded stay absent, the worker
thread's calls count too, and a second block inside the first is refused."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from deepep_ascend import native
from deepep_ascend.native.loader import Kernels, kernels

pytestmark = pytest.mark.skipif(kernels.zero_rows is None, reason="native kernels not built")


def _table():
    return {name: getattr(kernels, name) for name in Kernels.__slots__}


def test_counts_and_times_the_calls_inside_the_block_only():
    x = torch.ones(64, 256, dtype=torch.bfloat16)
    before = _table()
    native.zero_rows(x, torch.tensor([0]))  # outside: not counted
    with native.timing() as totals:
        t0 = time.perf_counter_ns()
        for rows in (torch.tensor([1, 3]), torch.tensor([5]), None):
            assert native.zero_rows(x, rows)
        wall = time.perf_counter_ns() - t0
        assert totals["zero_rows"][0] == 3
        assert 0 < totals["zero_rows"][1] <= wall  # inside the three calls' span
        assert set(totals) == {"zero_rows"}  # nothing else was called
    native.zero_rows(x, torch.tensor([2]))  # after the block: not counted
    assert totals == {"zero_rows": [3, totals["zero_rows"][1]]}
    assert _table() == before  # the very function objects again
    assert not x.any()


def test_restores_the_table_after_an_error_and_keeps_absent_functions_absent(monkeypatch):
    before = _table()
    monkeypatch.setattr(kernels, "sum_rows_bf16", None)  # as if not loaded
    with pytest.raises(ZeroDivisionError):
        with native.timing():
            assert kernels.sum_rows_bf16 is None
            assert kernels.zero_rows is not before["zero_rows"]  # wrapped
            _ = 1 / 0
    assert kernels.sum_rows_bf16 is None
    assert {n: f for n, f in _table().items() if n != "sum_rows_bf16"} == \
        {n: f for n, f in before.items() if n != "sum_rows_bf16"}


def test_counts_calls_from_other_threads_and_refuses_a_nested_block():
    x = torch.ones(8, 64, dtype=torch.bfloat16)
    with native.timing() as totals:
        with pytest.raises(RuntimeError, match="already active"):
            with native.timing():
                pass
        workers = [threading.Thread(target=lambda: [native.zero_rows(x, None) for _ in range(50)]) for _ in range(4)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        assert totals["zero_rows"][0] == 200
    with native.timing() as again:  # usable again once the first block closed
        native.zero_rows(x, None)
    assert again["zero_rows"][0] == 1
