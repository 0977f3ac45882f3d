"""``native.zero_rows``: ``dst[rows[i]] = 0`` by streaming stores (rows of 1 KiB and more) or ``memset``, against a
per-row Python loop (the independent reference) and the callers' torch path (``index_fill_``), byte for byte:
short and long rows, rows not starting on a cache line, adjacent rows merged into runs, strided rows, repeats,
every row, empty calls, bad operands."""

from __future__ import annotations

import pytest
import torch

from deepep_ascend import native
from deepep_ascend.native.loader import kernels

pytestmark = pytest.mark.skipif(kernels.zero_rows is None, reason="native kernels not built")


def _reference(dst, rows):
    out = dst.clone()
    for r in (range(dst.size(0)) if rows is None else rows.tolist()):  # one row at a time: the definition
        out[r] = 0
    return out


@pytest.mark.parametrize("row_bytes", [1, 63, 200, 1023, 1024, 1025, 7168, 7168 + 40])
@pytest.mark.parametrize("offset", [0, 1, 24])  # the first row's byte offset from a 64-byte line
@pytest.mark.parametrize("strided", [False, True])
def test_matches_a_row_loop_and_index_fill(row_bytes, offset, strided):
    g = torch.Generator().manual_seed(row_bytes + offset)
    stride = row_bytes + (72 if strided else 0)
    base = torch.randint(1, 255, (64 + 40 * stride + 128,), generator=g, dtype=torch.uint8)
    start = (-base.data_ptr()) % 64 + offset
    dst = base[start:start + 40 * stride].view(40, stride)[:, :row_bytes]
    rows = torch.tensor([3, 4, 5, 6, 9, 0, 39, 17, 18, 4, 30, 31], dtype=torch.int64)  # runs, a repeat, both ends
    want = _reference(dst, rows)
    torch_path = dst.clone().index_fill_(0, rows, 0)
    before = base.clone()
    got = dst  # in place, so that bytes around the rows are checked too
    assert native.zero_rows(got, rows)
    assert torch.equal(got, want) and torch.equal(got, torch_path)
    outside = torch.ones_like(base, dtype=torch.bool)
    view = outside[start:start + 40 * stride].view(40, stride)[:, :row_bytes]
    view[rows] = False  # every byte but the zeroed rows' is untouched (the stride's gaps included)
    assert torch.equal(base[outside], before[outside])


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32])
def test_every_row_of_a_matrix_and_its_version(dtype):
    base = torch.ones(5, 3000, dtype=dtype)
    dst = base[1:4]
    v = base._version
    assert native.zero_rows(dst, None)
    assert bool((base[1:4] == 0).all()) and bool((base[0] == 1).all()) and bool((base[4] == 1).all())
    assert base._version > v
    assert native.zero_rows(dst, torch.zeros(0, dtype=torch.int64))  # nothing to zero
    assert native.zero_rows(torch.ones(0, 8), None)


def test_declines_what_it_does_not_take():
    assert not native.zero_rows(torch.ones(8, 4).t(), None)  # column stride != 1
    assert not native.zero_rows(torch.ones(8), None)  # not a matrix


@pytest.mark.parametrize("rows, needle", [
    (torch.tensor([0, 4]), "rows must be in [0, 4)"),
    (torch.tensor([1, 2, -1]), "rows must be in [0, 4)"),
    (torch.tensor([0, 1], dtype=torch.int32), "contiguous 1-D int64"),
    (torch.tensor([[0, 1]]), "contiguous 1-D int64"),
])
def test_bad_row_numbers_raise_before_writing(rows, needle):
    dst = torch.ones(4, 2048, dtype=torch.uint8)
    with pytest.raises(ValueError, match=needle.replace("[", r"\[").replace(")", r"\)")):
        native.zero_rows(dst, rows)
    assert bool((dst == 1).all())


def test_overlapping_rows_are_refused():
    base = torch.ones(64, dtype=torch.uint8)
    dst = base.as_strided((4, 32), (8, 1))  # rows overlap
    with pytest.raises(ValueError, match="zero_rows"):
        native.zero_rows(dst, None)
    assert bool((base == 1).all())
