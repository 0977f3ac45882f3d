"""The native row sum (``deepep_ascend.native.sum_rows``, ``csrc/sum_rows.c``): the float32 chain from
+0.0 (or the bias) in source order, rounded once, bit for bit -- the same reference as
``test_accumulate.py`` -- and its argument checks.

The kernel is built by the install (``scripts/setup.sh``); a machine that cannot build it sets
``DEEPEP_ASCEND_NATIVE=0``, and then only the fallback is checked.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from buffer_helpers import same_bits_nan
from test_accumulate import BF16, _bits, _reference, _rows

from deepep_ascend import native

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


@needs_native
@pytest.mark.parametrize("num_sources,hidden,bias_kind,repeats", [
    (0, 40, None, False), (1, 40, "one", False), (2, 1, None, True), (3, 1024, "pair", False),
    (5, 2500, None, True), (8, 40, "pair", True), (3, 2049, "one", False)])
def test_sum_rows_bitwise(num_sources, hidden, bias_kind, repeats):
    """Any number of sources, hidden below, at and across the kernel's 1024-float chunks, tokens no
    source has, a token with several rows in one source (``repeats``), rows and output with a row
    stride wider than ``hidden``, specials everywhere (NaN, inf, -0.0, subnormals, near-overflow)."""
    g = torch.Generator().manual_seed(num_sources * 1000 + hidden)
    m = 31
    sources = []
    for j in range(num_sources):
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
    monkeypatch.setattr(native, "_ABI", native._ABI + 1)
    with pytest.warns(RuntimeWarning, match="built from an older source"):
        assert native._load() is None
    monkeypatch.undo()
    bogus = tmp_path / "_native.so"
    bogus.write_bytes(b"not a shared object")
    monkeypatch.setattr(native, "library_path", lambda: str(bogus))
    with pytest.warns(RuntimeWarning, match="cannot be loaded"):
        assert native._load() is None
    monkeypatch.undo()
    assert native._load() is not None
