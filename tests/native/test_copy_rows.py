"""``native.copy_rows``: ``dst[dst_rows[i]] = src[src_rows[i]]`` in one pass, against a per-row Python loop
(the independent reference) and the callers' torch path (``index_select`` + ``index_copy_``), byte for
byte: dtypes, strided rows, missing index lists, empty moves, bad operands."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from deepep_ascend import native
from deepep_ascend.native.loader import kernels
from tests.support.buffer_helpers import same_bits_nan

pytestmark = pytest.mark.skipif(kernels.copy_rows is None, reason="native kernels not built")


def _reference(dst, dst_rows, src, src_rows):
    out = dst.clone()
    n = (dst_rows if dst_rows is not None else src_rows).numel()
    for i in range(n):  # one row at a time: the definition
        d = i if dst_rows is None else int(dst_rows[i])
        s = i if src_rows is None else int(src_rows[i])
        out[d] = src[s]
    return out


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32, torch.int64])
@pytest.mark.parametrize("which", ["both", "dst_only", "src_only"])
def test_matches_a_row_loop_and_the_torch_path(dtype, which):
    g = torch.Generator().manual_seed(7)
    src_full = torch.randint(0, 255, (40, 3 * 24), generator=g, dtype=torch.uint8).view(dtype)
    src = src_full[:, 8 // src_full.element_size():]  # a row stride wider than the row: strided rows
    cols = src.size(1)
    dst = torch.randint(0, 255, (50, cols * src.element_size()), generator=g, dtype=torch.uint8).view(dtype)
    n = 17
    dst_rows = torch.randperm(50, generator=g)[:n] if which != "src_only" else None
    src_rows = torch.randint(0, 40, (n,), generator=g) if which != "dst_only" else None  # repeats allowed
    want = _reference(dst, dst_rows, src, src_rows)
    torch_path = dst.clone()
    torch_path.index_copy_(0, dst_rows if dst_rows is not None else torch.arange(n),
                           src.index_select(0, src_rows if src_rows is not None else torch.arange(n)))
    got = dst.clone()
    assert native.copy_rows(got, dst_rows, src, src_rows)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(got.view(torch.uint8), torch_path.view(torch.uint8))


def test_writes_into_a_strided_destination_view_and_bumps_its_version():
    base = torch.zeros(6, 10, dtype=torch.int32)
    dst = base[:, 2:8]  # row stride 10, 6 columns
    src = torch.arange(18, dtype=torch.int32).view(3, 6)
    v = base._version
    assert native.copy_rows(dst, torch.tensor([5, 0, 3]), src, None)
    assert torch.equal(base[[5, 0, 3], 2:8], src) and bool((base[:, :2] == 0).all()) and bool((base[:, 8:] == 0).all())
    assert base._version > v
    empty = torch.zeros(0, dtype=torch.int64)
    assert native.copy_rows(dst, empty, src, empty)  # nothing to move


def test_declines_what_it_does_not_take():
    src = torch.zeros(4, 8)
    assert not native.copy_rows(torch.zeros(4, 8, dtype=torch.float64), None, src, torch.arange(4))  # dtypes differ
    assert not native.copy_rows(torch.zeros(4, 9), None, src, torch.arange(4))  # columns differ
    assert not native.copy_rows(torch.zeros(8, 4).t(), None, src, torch.arange(4))  # column stride != 1


@pytest.mark.parametrize("dst_rows, src_rows, needle", [
    (None, None, "cannot both be None"),
    (torch.tensor([0, 4]), torch.tensor([0, 1]), "dst_rows must be in [0, 4)"),
    (torch.tensor([0, 1]), torch.tensor([-1, 1]), "src_rows must be in [0, 4)"),
    (torch.tensor([0, 1, 2, -5]), torch.tensor([0, 1, 2, 3]), "dst_rows must be in [0, 4)"),  # last row bad
    (torch.tensor([3, 2, 1, 0]), torch.tensor([0, 1, 2, 9]), "src_rows must be in [0, 4)"),
    (torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0, 1]), "contiguous 1-D int64"),
    (torch.tensor([0, 1, 2]), torch.tensor([0, 1]), "dst_rows has 3 entries, src_rows 2"),
    (None, torch.tensor([0, 1, 2, 3, 3]), "5 rows, but dst has 4"),
])
def test_bad_row_numbers_raise_before_writing(dst_rows, src_rows, needle):
    dst, src = torch.zeros(4, 8), torch.ones(4, 8)
    with pytest.raises(ValueError, match=needle.replace("[", r"\[").replace(")", r"\)")):
        native.copy_rows(dst, dst_rows, src, src_rows)
    assert bool((dst == 0).all())


def _weighted_reference(rows, index, weights):
    """Per token, slot by slot: ``acc += f32(row) * w`` in float32 from +0.0, one rounding (the definition)."""
    n, k = index.shape
    out = torch.zeros(n, rows.size(1))
    for t in range(n):
        acc = torch.zeros(rows.size(1))
        for j in range(k):
            if int(index[t, j]) >= 0:
                acc = acc + rows[int(index[t, j])].float() * weights[t, j]
        out[t] = acc
    return out.to(torch.bfloat16)


def _special_rows(g, count, hidden):
    vals = torch.tensor([0.0, -0.0, 1.0, -1.0, 3.0e38, -3.0e38, 1e-40, float("inf"), float("-inf"), float("nan")])
    rows = torch.randn(count, hidden, generator=g)
    mask = torch.rand(count, hidden, generator=g) < 0.2
    rows[mask] = vals[torch.randint(0, vals.numel(), (int(mask.sum()),), generator=g)]
    return rows.to(torch.bfloat16)


@pytest.mark.parametrize("hidden", [7, 1024, 2500])  # below, at and across the kernel's 1024-float chunks
@pytest.mark.usefixtures("row_sum_loop")
def test_weighted_sum_matches_the_definition_and_the_low_latency_torch_path(hidden):
    g = torch.Generator().manual_seed(hidden)
    rows = _special_rows(g, 30, hidden)
    n, k = 12, 5
    index = torch.randint(-1, 30, (n, k), generator=g)
    index[3] = -1  # a token with no slot: +0.0
    weights = torch.randn(n, k, generator=g)
    weights[0, 0] = float("inf")
    out = torch.full((n, hidden), 7.0, dtype=torch.bfloat16)
    assert native.weighted_sum_rows(out, rows, index, weights)
    assert same_bits_nan(out, _weighted_reference(rows, index, weights))
    assert torch.equal(out[3].view(torch.int16), torch.zeros(hidden, dtype=torch.int16))  # +0.0, not -0.0


def test_weighted_sum_bad_operands():
    rows, out = torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(2, 8, dtype=torch.bfloat16)
    w = torch.ones(2, 3)
    assert not native.weighted_sum_rows(out.float(), rows, torch.zeros(2, 3, dtype=torch.int64), w)  # not bf16
    with pytest.raises(ValueError, match=r"index must be in \[-1, 4\)"):
        native.weighted_sum_rows(out, rows, torch.tensor([[0, 4, -1], [0, 0, 0]]), w)
    out.fill_(7.0)
    with pytest.raises(ValueError, match=r"index must be in \[-1, 4\)"):  # the last slot bad: nothing written
        native.weighted_sum_rows(out, rows, torch.tensor([[0, 1, -1], [0, 0, -2]]), w)
    assert bool((out == 7.0).all())
    with pytest.raises(ValueError, match="weights must be a contiguous"):
        native.weighted_sum_rows(out, rows, torch.zeros(2, 3, dtype=torch.int64), w.double())
    with pytest.raises(ValueError, match="index must be a contiguous"):
        native.weighted_sum_rows(out, rows, torch.zeros(3, 2, dtype=torch.int64).t(), w)


@pytest.mark.usefixtures("row_sum_loop")
def test_weighted_sum_with_more_slots_than_the_avx2_loop_takes():
    """A token of more than 64 slots (``ROW_SUM_SLOTS``) takes the portable loop whatever the mode; 64 the AVX2 one
    where it runs: both the definition's bits, the slots of every kind (-1, repeated rows) included."""
    g = torch.Generator().manual_seed(65)
    rows = _special_rows(g, 20, 130)
    for k in (64, 65, 80):
        index = torch.randint(-1, 20, (3, k), generator=g)
        weights = torch.randn(3, k, generator=g)
        out = torch.full((3, 130), 7.0, dtype=torch.bfloat16)
        assert native.weighted_sum_rows(out, rows, index, weights)
        assert same_bits_nan(out, _weighted_reference(rows, index, weights)), k


def _cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux lists them (the first processor's)."""
    with open("/proc/cpuinfo") as f:
        return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())


def test_row_sums_mode_is_set_read_and_checked():
    """``row_sums_avx2``: None reads the loop in force, False / "portable" turn the AVX2 loop off, True / "avx2" on
    where the CPU has AVX2, "auto" back to the default (AVX2 without AVX-512BW); anything else is refused with
    nothing changed."""
    before = native.row_sums_avx2()
    flags = _cpu_flags()
    avx2 = "avx2" in flags
    try:
        assert native.row_sums_avx2(False) is False and native.row_sums_avx2() is False
        assert native.row_sums_avx2("avx2") is avx2 and native.row_sums_avx2() is avx2
        assert native.row_sums_avx2("portable") is False
        assert native.row_sums_avx2(True) is avx2
        for bad in ("on", 1, 2.0, "AVX2"):
            with pytest.raises(ValueError, match=re.escape(f"mode must be None, a bool or one of portable, avx2, auto, "
                                                           f"got {bad!r}")):
                native.row_sums_avx2(bad)
            assert native.row_sums_avx2() is avx2
        auto = native.row_sums_avx2("auto")
        assert auto is (avx2 and "avx512bw" not in flags)
    finally:
        native.row_sums_avx2(before)


def test_row_sums_mode_comes_from_the_setting(monkeypatch):
    """The library loads with ``DEEPEP_ASCEND_ROW_SUMS`` ("auto" when unset); a bad value is refused naming the
    variable."""
    from deepep_ascend import settings
    from deepep_ascend.native import rows as native_rows

    base = {k: v for k, v in os.environ.items() if k != "DEEPEP_ASCEND_ROW_SUMS"}
    code = "from deepep_ascend import native; print(native.row_sums_avx2())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=dict(base, DEEPEP_ASCEND_ROW_SUMS="portable"))
    assert out.stdout.split("\n")[-2] == "False", out.stdout
    before = native.row_sums_avx2()
    try:
        monkeypatch.delenv("DEEPEP_ASCEND_ROW_SUMS", raising=False)
        native.row_sums_avx2(False)
        native_rows._row_sums_from_settings()
        assert native.row_sums_avx2() is native_rows.row_sums_avx2("auto")
        monkeypatch.setenv("DEEPEP_ASCEND_ROW_SUMS", "fast")
        with pytest.raises(settings.SettingError, match=r"\$DEEPEP_ASCEND_ROW_SUMS must be one of 'auto', "
                                                        r"'avx2', 'portable', got 'fast'"):
            native_rows._row_sums_from_settings()
        monkeypatch.setenv("DEEPEP_ASCEND_ROW_SUMS", "portable")
        native_rows._row_sums_from_settings()
        assert native.row_sums_avx2() is False
    finally:
        native.row_sums_avx2(before)
