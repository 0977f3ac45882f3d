"""The native row sum (``deepep_ascend.native.sum_rows``, ``csrc/sum_rows.c``): the float32 chain from
+0.0 (or the bias) in source order, rounded once, bit for bit -- the same reference as
``test_accumulate.py`` -- and its argument checks.

The kernel is built by the install (``scripts/setup.sh``); a machine that cannot build it sets
``DEEPEP_ASCEND_NATIVE=0``, and then only the fallback is checked.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from deepep_ascend import native
from deepep_ascend.native import loader
from deepep_ascend.native.loader import kernels
from tests.support.buffer_helpers import same_bits_nan
from tests.support.rows import BF16
from tests.support.rows import bits as _bits
from tests.support.rows import random_rows as _rows
from tests.support.rows import reference_sum as _reference

DISABLED = os.environ.get("DEEPEP_ASCEND_NATIVE", "1").strip().lower() in ("0", "false", "no", "off")
needs_native = pytest.mark.skipif(DISABLED, reason="DEEPEP_ASCEND_NATIVE=0: the native kernel is disabled")


def test_native_kernel_is_built_unless_disabled():
    """The install builds the kernel: a build that failed quietly (it is optional) shows here."""
    assert native.available() is not DISABLED, (
        f"native kernel available={native.available()} at {native.library_path()} with "
        f"DEEPEP_ASCEND_NATIVE={os.environ.get('DEEPEP_ASCEND_NATIVE')!r}")


def test_environment_variable_disables_the_kernel():
    code = "from deepep_ascend import native; print(native.available())"
    env = dict(os.environ, DEEPEP_ASCEND_NATIVE="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_bad_environment_value_fails_the_import_naming_the_variable():
    """``DEEPEP_ASCEND_NATIVE`` is read once, when the library loads (at import): a value that is not a
    boolean stops the import with a ``SettingError`` naming the variable and the value, as every setting does."""
    env = dict(os.environ, DEEPEP_ASCEND_NATIVE="maybe")
    out = subprocess.run([sys.executable, "-c", "import deepep_ascend"], env=env, capture_output=True, text=True,
                         timeout=120)
    last = out.stderr.strip().splitlines()[-1] if out.stderr.strip() else ""
    want = "deepep_ascend.settings.SettingError: $DEEPEP_ASCEND_NATIVE must be"
    assert out.returncode != 0 and last.startswith(want), (out.returncode, out.stderr[-2000:])
    assert "'maybe'" in last, last


@needs_native
@pytest.mark.parametrize("num_sources,hidden,bias_kind,repeats", [
    (0, 40, None, False), (1, 40, "one", False), (2, 1, None, True), (2, 200, None, False), (3, 1024, "pair", False),
    (5, 2500, None, True), (8, 40, "pair", True), (3, 2049, "one", False)])
@pytest.mark.usefixtures("row_sum_loop")
def test_sum_rows_bitwise(num_sources, hidden, bias_kind, repeats):
    """Any number of sources, hidden below, at and across the kernel's 1024-float chunks, tokens no
    source has, a token with several rows in one source (``repeats``), rows and output with a row
    stride wider than ``hidden``, specials everywhere (NaN, inf, -0.0, subnormals, near-overflow)."""
    g = torch.Generator().manual_seed(num_sources * 1000 + hidden)
    m = 31
    sources = []
    for _ in range(num_sources):
        tokens = torch.nonzero(torch.rand(m, generator=g) < 0.7).squeeze(1)
        if repeats and tokens.numel():
            tokens = torch.sort(torch.cat([tokens, tokens[::3]])).values
        wide = _rows(g, tokens.numel(), hidden + 5)
        sources.append((wide[:, 2:2 + hidden], tokens))  # row stride hidden + 5
    bias = None
    if bias_kind == "one":
        bias = (_rows(g, m + 4, hidden), None)
    elif bias_kind == "pair":
        bias = (_rows(g, m + 4, hidden), _rows(g, m + 4, hidden + 3)[:, :hidden])
    expected = _reference(m, hidden, sources, None if bias is None else
                          (bias[0][4:], None if bias[1] is None else bias[1][4:]))
    frame = torch.full((m, hidden + 7), 7.0, dtype=BF16)
    out = frame[:, 3:3 + hidden]
    assert native.sum_rows(out, sources, bias, bias_offset=4)
    assert same_bits_nan(out, expected), f"{int((_bits(out) != _bits(expected)).sum())} elements differ"
    assert (frame[:, :3] == 7.0).all() and (frame[:, 3 + hidden:] == 7.0).all()  # nothing outside out


@needs_native
@pytest.mark.parametrize("num_sources,hidden", [(1, 40), (4, 1100), (9, 24)])
@pytest.mark.usefixtures("row_sum_loop")
def test_sum_rows_gathers_rows_by_index(num_sources, hidden):
    """A source given as ``(rows, tokens, index)`` adds ``rows[index[i]]`` for ``tokens[i]``: the same
    bits as the gathered rows passed as a plain source (MegaMoE reads each wave's slot-j rows this way)."""
    g = torch.Generator().manual_seed(num_sources * 7 + hidden)
    m = 23
    indexed, gathered = [], []
    for _ in range(num_sources):
        pool = _rows(g, 40, hidden)
        tokens = torch.nonzero(torch.rand(m, generator=g) < 0.6).squeeze(1)
        index = torch.randperm(40, generator=g)[:tokens.numel()]
        indexed.append((pool, tokens, index))
        gathered.append((pool.index_select(0, index), tokens))
    got, want = torch.empty(m, hidden, dtype=BF16), torch.empty(m, hidden, dtype=BF16)
    assert native.sum_rows(got, indexed) and native.sum_rows(want, gathered)
    assert torch.equal(_bits(got), _bits(want))
    assert same_bits_nan(got, _reference(m, hidden, gathered, None))


@needs_native
@pytest.mark.usefixtures("row_sum_loop")
def test_sum_rows_takes_any_iterable_of_sources_and_a_second_bias_alone():
    """Sources may be a generator (it is read once); bias ``(None, b1)`` starts from ``f32(b1)``,
    as ``(b1, None)`` does (``0.0 + x == x + 0.0``)."""
    m, hidden = 3, 5
    rows, tokens = torch.ones(m, hidden, dtype=BF16), torch.arange(m)
    out = torch.empty(m, hidden, dtype=BF16)
    assert native.sum_rows(out, ((rows, tokens) for _ in range(2)))
    assert (out.float() == 2.0).all()
    b1 = torch.full((m, hidden), 5.0, dtype=BF16)
    assert native.sum_rows(out, [(rows, tokens)], (None, b1))
    assert (out.float() == 6.0).all()


@needs_native
@pytest.mark.usefixtures("row_sum_loop")
def test_sum_rows_adds_in_source_order_and_rounds_once():
    """1 + 2^-8 + 2^-24 + 2^-24 in float32 loses both 2^-24 and rounds to BF16 1.0 (a tie, to
    even); 2^-24 + 2^-24 + 2^-8 + 1 keeps them and rounds up to 1 + 2^-7. Token 0 has its sources
    in the first order, token 1 in the second; all -0.0 sums to +0.0 (the +0.0 start)."""
    hidden = 37
    tokens = torch.arange(3)
    col = [(1.0, 2.0 ** -24, -0.0), (2.0 ** -8, 2.0 ** -24, -0.0), (2.0 ** -24, 2.0 ** -8, -0.0),
           (2.0 ** -24, 1.0, -0.0)]
    sources = [(torch.tensor([[a] * hidden, [b] * hidden, [c] * hidden], dtype=BF16), tokens) for a, b, c in col]
    out = torch.empty(3, hidden, dtype=BF16)
    assert native.sum_rows(out, sources)
    assert (out[0].float() == 1.0).all() and (out[1].float() == 1.0 + 2.0 ** -7).all()
    assert (_bits(out[2]) == 0).all()


@needs_native
def test_sum_rows_rejects_bad_operands():
    """Rows fewer than tokens, an index of another length or out of range, or bias too short:
    ValueError, nothing written. Tokens out of order or
    outside [0, m): ValueError naming the source (the kernel checks, it never reads past a row list).
    Operands it does not take (not bf16, a column stride): False, nothing written."""
    m, hidden = 6, 8
    rows = torch.ones(4, hidden, dtype=BF16)
    out = torch.full((m, hidden), 7.0, dtype=BF16)
    with pytest.raises(ValueError, match="out's rows overlap"):
        native.sum_rows(torch.ones(1, hidden, dtype=BF16).expand(m, hidden), [(rows, torch.arange(4))])
    with pytest.raises(ValueError, match="out must be"):
        native.sum_rows(torch.ones(m * hidden, dtype=BF16), [(rows, torch.arange(4))])
    with pytest.raises(ValueError, match="must be >= 0"):
        native.sum_rows(out, [(rows, torch.arange(4))], (torch.ones(m + 5, hidden, dtype=BF16), None), bias_offset=-5)
    for tokens in (torch.tensor([0.0, 1.0, 2.0, 3.0]), torch.arange(4).view(2, 2), torch.ones(4, dtype=torch.bool)):
        with pytest.raises(ValueError, match="source 0's tokens must be a 1-D int64 or int32 tensor"):
            native.sum_rows(out, [(rows, tokens)])
    with pytest.raises(ValueError, match="source 0 has 3 rows for 4 tokens"):
        native.sum_rows(out, [(rows[:3], torch.arange(4))])
    with pytest.raises(ValueError, match="bias rows"):
        native.sum_rows(out, [(rows, torch.arange(4))], (torch.ones(m, hidden, dtype=BF16), None), bias_offset=1)
    assert (out == 7.0).all()
    for bad in (torch.tensor([0, 2, 1, 3]), torch.tensor([0, 1, 2, m]), torch.tensor([-1, 0, 1, 2])):
        with pytest.raises(ValueError, match="source 1's tokens are not ascending"):
            native.sum_rows(out, [(rows, torch.arange(4)), (rows, bad)])
    out.fill_(7.0)  # the unordered tokens above left partial sums
    for index in (torch.tensor([0, 1, 2]), torch.tensor([0, 1, 2, 4]), torch.tensor([-1, 0, 1, 2])):
        with pytest.raises(ValueError, match="source 0's index must be 4 row numbers in \\[0, 4\\)"):
            native.sum_rows(out, [(rows, torch.arange(4), index)])
    assert (out == 7.0).all()
    assert not native.sum_rows(out.float(), [(rows, torch.arange(4))])
    assert not native.sum_rows(out, [(rows.float(), torch.arange(4))])
    assert not native.sum_rows(out, [(torch.ones(hidden, 4, dtype=BF16).t(), torch.arange(4))])
    column_major = torch.full((hidden, m), 7.0, dtype=BF16).t()
    assert not native.sum_rows(column_major, [(rows, torch.arange(4))]) and (column_major == 7.0).all()


@needs_native
def test_a_stale_or_broken_library_is_refused_with_a_warning(tmp_path, monkeypatch):
    """A library built from an older source (its ``deepep_native_abi()`` differs) or one that does not
    load is never called: a RuntimeWarning says so and the torch paths take over."""
    monkeypatch.setattr(loader, "ABI", loader.ABI + 1)
    with pytest.warns(RuntimeWarning, match="built from an older source"):
        assert loader.load() is None
    monkeypatch.undo()
    bogus = tmp_path / "_native.so"
    bogus.write_bytes(b"not a shared object")
    monkeypatch.setattr(loader, "library_path", lambda: str(bogus))
    with pytest.warns(RuntimeWarning, match="cannot be loaded"):
        assert loader.load() is None
    monkeypatch.undo()
    assert loader.load() is not None


# ----------------------------------------------------------------------------------------------
# MegaMoE's elementwise kernels (csrc/moe_act.c)


def _e4m3_spec(code: int) -> float:
    """e4m3fn from the format (docs/semantics/mega-moe.md §4): bias 7, subnormals m/8 * 2^-6, 0x7F/0xFF NaN."""
    s, e, m = code >> 7, (code >> 3) & 15, code & 7
    if e == 15 and m == 7:
        return float("nan")
    mag = (m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -mag if s else mag


def _to_bf16_exact(x: np.ndarray) -> torch.Tensor:
    """float64 values rounded once to bf16 (nearest, ties to even; subnormal step 2^-133), independent
    of torch's casts."""
    ax = np.abs(x)
    with np.errstate(divide="ignore", invalid="ignore"):
        e = np.floor(np.log2(np.where(ax > 0, ax, 1.0)))
    ulp = np.exp2(np.maximum(e, -126) - 7)
    r = np.where(np.isfinite(x), np.round(x / ulp) * ulp, x)  # np.round: ties to even
    r = np.where(np.abs(r) >= 2.0**128, np.copysign(np.inf, x), r)  # past the largest bf16: inf
    return torch.from_numpy(r).float().to(BF16)  # exact: r is on the bf16 grid


@needs_native
def test_dequant_rows_every_code_and_scale_byte():
    """Every e4m3 code times every UE8M0 byte (2^-127 .. 2^127, 255 = NaN) gathered by an index: the
    value the format defines, rounded once to bf16 (inf past bf16's range, bf16 subnormals below its
    normals), and bit for bit ``per_token_cast_back``'s torch path; NaN wherever code or scale is NaN."""
    gran = 8
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(256, 1)  # row b: all codes
    scales = torch.arange(256, dtype=torch.int32).to(torch.uint8).unsqueeze(1).repeat(1, 256 // gran)
    index = torch.randperm(256, generator=torch.Generator().manual_seed(3))
    out = torch.full((256, 256), 7.0, dtype=BF16)
    assert native.dequant_rows_e4m3(out, codes.view(torch.float8_e4m3fn), scales, index, gran)
    vals = np.array([_e4m3_spec(c) for c in range(256)])
    scale = np.where(np.arange(256) == 255, np.nan, np.exp2(np.arange(256) - 127.0))
    exp = _to_bf16_exact(scale[index.numpy()][:, None] * vals[None, :])
    assert same_bits_nan(out, exp)
    torch_path = torch.empty_like(out)
    monkey = kernels.dequant_rows_e4m3_bf16
    try:
        kernels.dequant_rows_e4m3_bf16 = None  # per_token_cast_back's torch path
        from deepep_ascend.gemm import fp8
        torch_path = fp8.per_token_cast_back(codes[index].view(torch.float8_e4m3fn), scales[index], gran)
    finally:
        kernels.dequant_rows_e4m3_bf16 = monkey
    assert same_bits_nan(out, torch_path)


@needs_native
def test_per_token_cast_back_uses_the_kernel_with_every_scale_packing():
    """The public cast back with UE8M0 bytes, int16 pairs or int32 quads (row- and MN-major) gives the
    torch path's bits through the kernel; float32 scales, other dtypes and 3-D inputs keep the torch path."""
    from deepep_ascend.gemm import fp8, scales

    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, 256, (37, 256), generator=g, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    b = torch.randint(100, 140, (37, 8), generator=g, dtype=torch.int32).to(torch.uint8)
    calls = []
    real = kernels.dequant_rows_e4m3_bf16
    for sf in (b, b.view(torch.int16), b.view(torch.int32), b.view(torch.int32).t().contiguous().t()):
        kernels.dequant_rows_e4m3_bf16 = None
        exp = fp8.per_token_cast_back(x, sf, 32)
        kernels.dequant_rows_e4m3_bf16 = lambda *a, real=real: (calls.append(1), real(*a))[1]
        try:
            got = fp8.per_token_cast_back(x, sf, 32)
        finally:
            kernels.dequant_rows_e4m3_bf16 = real
        assert same_bits_nan(got, exp)
    assert len(calls) == 4
    kernels.dequant_rows_e4m3_bf16 = lambda *a: calls.append(2)
    try:
        fp8.per_token_cast_back(x, scales.unpack_ue8m0_from_int(b), 32)
        fp8.per_token_cast_back(x, b, 32, torch.float32)
        fp8.per_token_cast_back(x.unsqueeze(0), b.unsqueeze(0), 32)
    finally:
        kernels.dequant_rows_e4m3_bf16 = real
    assert calls == [1] * 4


def _swiglu_inputs(n, inter, seed, specials=False):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(n, 2 * inter, generator=g) * 4).to(BF16)
    w = torch.rand(n, generator=g)
    if specials:
        flat = h.view(-1)
        pick = torch.randperm(flat.numel(), generator=g)
        flat[pick[:40]] = 0.0
        flat[pick[40:80]] = -0.0
        flat[pick[80:90]] = 30.0  # beyond the clamp
        flat[pick[90:100]] = -30.0
        h[: n // 4] *= 2.0**-60  # groups far below FP8's normals: UE8M0 floor, e4m3 subnormals
        w[1::7] = 0.0
    return h, w


@needs_native
@pytest.mark.parametrize("kind", ["fp8", "bf16"])
@pytest.mark.parametrize("clamp", [None, 10.0])
@pytest.mark.parametrize("fast_math", [True, False])
@pytest.mark.parametrize("oai", [None, (1.702, 1.0), (0.5, -0.25), (1.0, 0.0)], ids=str)
def test_swiglu_matches_the_torch_path_bitwise(kind, clamp, fast_math, oai):
    """``mega_moe.experts.activation`` with and without the kernel: the same bits, on rows spanning several
    of the kernel's blocks, with zeros of both signs, values past the clamp, groups at the UE8M0
    floor and e4m3 subnormals, zero weights; strided ``h`` (a column window of a wider tensor); plain
    SwiGLU and ``'swigluoai'`` (``oai``: its alpha and up_bias, DeepGEMM PR #445)."""
    from deepep_ascend.mega_moe import experts as mm

    inter = 1024  # 128 rows per block of 2^17 floats: 300 rows are three blocks, the last short
    wide, w = _swiglu_inputs(300, inter + 16, seed=7, specials=True)
    h = wide[:, 16:16 + 2 * inter]
    assert h.stride(0) != 2 * inter
    calls = []
    real = kernels.swiglu_bf16
    kernels.swiglu_bf16 = lambda *a: (calls.append(a[0]), real(*a))[1]
    if oai is not None:
        oai = mm.swiglu_params("swigluoai", *oai, "test")
    try:
        got = mm.activation(kind, h, inter, w, clamp, fast_math, oai=oai)
    finally:
        kernels.swiglu_bf16 = real
    exp = mm.activation(kind, h, inter, w, clamp, fast_math, native=False, oai=oai)
    assert calls == [128, 128, 44]
    assert torch.equal(got.view(torch.int16), exp.view(torch.int16))
    assert (got != 0).any() and got.isfinite().all()


@needs_native
def test_swiglu_hands_non_finite_groups_to_the_codecs():
    """A NaN, an infinity or a value of 2^100 and more in an FP8 group: the kernel returns False and
    ``activation`` takes the codec path (NaN positions and every other bit the torch path's); without
    the FP8 round trip the kernel rounds them itself."""
    from deepep_ascend.mega_moe import experts as mm

    h, w = _swiglu_inputs(16, 64, seed=9)
    h[2, 5] = float("nan")
    h[3, 64 + 7] = float("inf")  # u = inf: a = inf
    h[4, 70] = 2.0**120  # u huge, g ~ N(0, 16): |a| >= 2^100 unless g is tiny
    h[4, 6] = 8.0
    out = torch.empty(16, 64, dtype=BF16)
    assert not native.swiglu(out, h, w, None, True, 32)
    for (gran, clamp), oai in itertools.product(((32, None), (0, None), (32, 10.0)), (None, (1.702, 1.0))):
        kind = "fp8" if gran else "bf16"
        got = mm.activation(kind, h, 64, w, clamp, True, oai=oai)
        exp = mm.activation(kind, h, 64, w, clamp, True, native=False, oai=oai)
        assert same_bits_nan(got, exp)
        assert got[2, 5].isnan()  # a NaN gate stays NaN (torch.clamp keeps NaN)
        assert bool(got[3].isfinite().all()) is (clamp is not None)  # the clamp removes the inf
    assert native.swiglu(out, h, w, None, True, 0)


@needs_native
def test_fp32_engine_layouts_and_clamps_outside_the_kernels():
    """The fp32 GEMM engine's float32 operands (the kernels' bf16 rows, widened: the same values as the
    torch paths' float32 results); operands the kernels do not take (a column-major ``h``, empty
    tensors from numpy with zero strides) and clamps they refuse (negative, NaN) take the torch paths.
    Always the torch paths' bits."""
    import numpy as np

    from deepep_ascend.mega_moe import experts as mm

    h, w = _swiglu_inputs(200, 256, seed=13, specials=True)
    calls = []
    real = kernels.swiglu_bf16
    kernels.swiglu_bf16 = lambda *a: (calls.append(a[0]), real(*a))[1]
    try:
        for kind in ("fp8", "bf16"):
            for clamp in (None, 10.0, -1.0, float("nan")):
                got = mm.activation(kind, h, 256, w, clamp, True, torch.float32)
                exp = mm.activation(kind, h, 256, w, clamp, True, torch.float32, native=False)
                assert got.dtype == torch.float32 and same_bits_nan(got, exp)
        assert len(calls) == 4  # clamps None and 10, twice; -1 and NaN are the torch path's
        with pytest.raises(ValueError, match="clamp must be None or a number >= 0"):
            native.swiglu(torch.empty(200, 256, dtype=BF16), h, w, -1.0)
        for kw in (dict(alpha=float("nan")), dict(alpha=float("inf")), dict(up_bias=-float("inf"))):
            with pytest.raises(ValueError, match=f"{next(iter(kw))} must be a finite number"):
                native.swiglu(torch.empty(200, 256, dtype=BF16), h, w, 7.0, **kw)
        column_major = h.t().contiguous().t()
        empty = torch.from_numpy(np.zeros((0, 512), np.float32)).to(BF16)
        assert empty.stride() == (0, 0) or empty.numel() == 0
        for hh in (column_major, empty):
            ww = w[:hh.size(0)]
            got = mm.activation("fp8", hh, 256, ww, 10.0, True)
            assert torch.equal(got.view(torch.int16), mm.activation("fp8", hh, 256, ww, 10.0, True,
                                                                     native=False).view(torch.int16))
        assert len(calls) == 4 + (1 if empty.stride(1) == 1 else 0)
    finally:
        kernels.swiglu_bf16 = real
    g = torch.Generator().manual_seed(17)
    codes = torch.randint(0, 256, (300, 96), generator=g, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(0, 256, (300, 3), generator=g, dtype=torch.int32).to(torch.uint8)
    index = torch.randint(0, 300, (250,), generator=g)
    fp8 = codes.view(torch.float8_e4m3fn)
    for dtype in (BF16, torch.float32):
        got = mm.dequant_x("fp8", fp8, scales, dtype, index=index)
        exp = mm.dequant_x("fp8", fp8, scales, dtype, index=index, native=False)
        assert got.dtype == dtype and same_bits_nan(got, exp)
    col = codes.t().contiguous().t().view(torch.float8_e4m3fn)
    assert same_bits_nan(mm.dequant_x("fp8", col, scales), mm.dequant_x("fp8", col, scales, native=False))


@needs_native
def test_moe_act_kernels_reject_bad_operands():
    """Wrong dtypes, shapes, layouts, index values or granularity: ValueError naming the argument,
    nothing written."""
    h = torch.ones(4, 64, dtype=BF16)
    out = torch.full((4, 32), 7.0, dtype=BF16)
    w = torch.ones(4)
    for bad, match in (((out.float(), h), "out must be a CPU torch.bfloat16 matrix"),
                       ((out, h.float()), "h must be a CPU torch.bfloat16 matrix of 64 columns"),
                       ((out, h[:, :32]), "h must be"),
                       ((out, h[:3]), "h has 3 rows, out 4"),
                       ((torch.ones(1, 32, dtype=BF16).expand(4, 32), h), "out's rows overlap"),
                       ((torch.ones(32, 4, dtype=BF16).t(), h), "unit column stride")):
        with pytest.raises(ValueError, match=match):
            native.swiglu(*bad, w)
    for kw, match in ((dict(weights=torch.ones(3)), "weights must be None or \\[4\\] float32"),
                      (dict(weights=torch.ones(4, dtype=torch.float64)), "weights must be"),
                      (dict(gran=24), "gran must be 0 or an int in \\[1, 256\\] dividing I = 32"),
                      (dict(gran=512), "gran must be"), (dict(gran=-1), "gran must be")):
        with pytest.raises(ValueError, match=match):
            native.swiglu(out, h, **kw)
    codes = torch.zeros(4, 64, dtype=torch.uint8)
    scales = torch.zeros(4, 2, dtype=torch.uint8)
    dq = torch.full((4, 64), 7.0, dtype=BF16)
    for args, kw, match in (((dq, codes.float(), scales), {}, "codes must be a CPU torch.uint8 matrix of 64"),
                            ((dq, codes, scales[:, :1]), {}, "scales must be a CPU torch.uint8 matrix of 2"),
                            ((dq, codes[:3], scales[:3]), {}, "have 3/3 rows for 4 output rows"),
                            ((dq, codes, scales), dict(index=torch.tensor([0, 1, 2, 4])), "index values must lie in"),
                            ((dq, codes, scales), dict(index=torch.tensor([0, 1, 2, -1])), "index values must lie in"),
                            ((dq, codes, scales), dict(index=torch.tensor([0, 1, 2])), "index must be \\[4\\] int64"),
                            ((dq, codes, scales), dict(gran=48), "gran must be a positive int dividing")):
        with pytest.raises(ValueError, match=match):
            native.dequant_rows_e4m3(*args, **kw)
    assert (out == 7.0).all() and (dq == 7.0).all()
