"""Single-process checks of ``reduce.accumulate_rows``, the combine's reduction kernel.

It takes shortcuts (one BF16 ``add`` for blocks covered by exactly two sources, a float32 chain
started from a copy instead of ``+0.0``, no sign-of-zero pass after a clean source); each must
give the bits of the plain float32 chain from ``+0.0`` in source order, signed zeros and
infinities included; a NaN stays a NaN (torch's BF16 arithmetic returns the canonical NaN, its
float32-to-BF16 cast keeps the payload, so payloads may differ). The reference below is that
chain, written independently of the kernel.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from deepep_ascend.ep.reduce import (
    _copy_disjoint,
    _sum_by_bags,
    _sum_two_by_runs,
    accumulate_rows,
    two_source_run_limit,
)
from tests.support.buffer_helpers import same_bits_nan
from tests.support.rows import BF16
from tests.support.rows import bits as _bits
from tests.support.rows import random_rows as _rows
from tests.support.rows import reference_sum as _reference


@pytest.mark.parametrize("num_sources,coverage,bias_kind,native", list(itertools.product(
    [0, 1, 2, 3, 4], ["full", "partial", "mixed"], [None, "one", "pair"], [True, False])))
def test_accumulate_rows_bitwise(num_sources, coverage, bias_kind, native):
    g = torch.Generator().manual_seed(1000 * num_sources + len(coverage) * 10 + len(bias_kind or ""))
    m, hidden, block = 23, 40, 4  # several blocks, a short last one
    sources, clean = [], []
    for s in range(num_sources):
        if coverage == "full" or (coverage == "mixed" and s % 2 == 0):
            tokens = torch.arange(m)
        else:
            tokens = torch.nonzero(torch.rand(m, generator=g) < 0.6).squeeze(1)
        rows = _rows(g, tokens.numel(), hidden)
        is_clean = s % 2 == 1
        if is_clean:  # what a staging rank sends: + 0.0 turns -0.0 into +0.0
            rows = torch.add(rows, 0.0)
            assert not (_bits(rows) == -32768).any()
        sources.append((rows, tokens))
        clean.append(is_clean)
    bias = None
    if bias_kind == "one":
        bias = (_rows(g, m + 3, hidden)[3:], None)
    elif bias_kind == "pair":
        bias = (_rows(g, m + 3, hidden)[3:], _rows(g, m + 3, hidden)[3:])
    expected = _reference(m, hidden, sources, bias)
    for flags in (None, clean):
        out = torch.full((m, hidden), 7.0, dtype=BF16)
        acc, tmp = torch.empty(block, hidden), torch.empty(block, hidden)
        accumulate_rows(out, sources, acc, tmp, bias, clean=flags, native=native)
        assert same_bits_nan(out, expected), (
            f"clean={flags}: {int((_bits(out) != _bits(expected)).sum())} of {out.numel()} elements differ")


def test_accumulate_rows_all_negative_zero_gives_positive_zero():
    """Two sources that are -0.0 everywhere: the BF16 add alone would give -0.0, DeepEP's +0.0 start gives +0.0."""
    m, hidden = 6, 16
    neg = torch.full((m, hidden), -0.0, dtype=BF16)
    tokens = torch.arange(m)
    for n in (1, 2, 3):
        out = torch.empty(m, hidden, dtype=BF16)
        accumulate_rows(out, [(neg, tokens)] * n, torch.empty(4, hidden), torch.empty(4, hidden))
        assert (_bits(out) == 0).all(), f"{n} sources of -0.0 must sum to +0.0"


def test_accumulate_rows_three_sources_round_once():
    """1 + 2^-8 + 2^-8: the float32 chain gives 1 + 2^-7; rounding after each BF16 add (ties to
    even) would give 1.0 twice. Three sources must not take the two-source BF16 shortcut."""
    hidden = 8
    tokens = torch.arange(1)
    one = torch.full((1, hidden), 1.0, dtype=BF16)
    half_ulp = torch.full((1, hidden), 2.0 ** -8, dtype=BF16)
    out = torch.empty(1, hidden, dtype=BF16)
    accumulate_rows(out, [(one, tokens), (half_ulp, tokens), (half_ulp, tokens)],
                    torch.empty(4, hidden), torch.empty(4, hidden))
    assert (out.float() == 1.0 + 2.0 ** -7).all()
    assert (torch.add(torch.add(one, half_ulp), half_ulp).float() == 1.0).all()  # what the shortcut would give


@pytest.mark.parametrize("missing0,missing1", [(0, 0), (0, 5), (3, 4), (300, 2), (300, 300)])
def test_two_sources_by_runs(missing0, missing1):
    """The run-wise path (two ranks' common case): long runs of tokens with both sources, a few
    with one or none; bitwise equal to the float32 chain, and it must take the path."""
    g = torch.Generator().manual_seed(missing0 * 1000 + missing1)
    m, hidden = 300, 24
    sources = []
    for missing in (missing0, missing1):
        keep = torch.ones(m, dtype=torch.bool)
        keep[torch.randperm(m, generator=g)[:missing]] = False
        tokens = torch.nonzero(keep).squeeze(1)
        sources.append((_rows(g, tokens.numel(), hidden), tokens))
    expected = _reference(m, hidden, sources, None)
    for flags in ([False, False], [False, True]):
        rows1 = sources[1][0]
        srcs = [sources[0], (torch.add(rows1, 0.0) if flags[1] else rows1, sources[1][1])]
        out = torch.full((m, hidden), 7.0, dtype=BF16)
        assert _sum_two_by_runs(out, srcs, flags, max_runs=m)
        assert same_bits_nan(out, expected)
    if missing0 < m and missing1 < m:  # three or four sources with rows: not this path
        assert not _sum_two_by_runs(out, sources * 2, [False] * 4)


def test_two_source_run_limit_follows_the_work_per_run():
    """The run-wise path is taken while its per-run overhead stays below the float32 chain's cost:
    the limit grows with ``m * hidden``. At 2 ranks on DeepSeek-V3 shapes (4096 tokens, hidden
    7168) a rank whose tokens miss one rank a few dozen times has ~65+ runs; the old limit (m / 64 = 64)
    sent such a rank to the float32 chain."""
    assert two_source_run_limit(4096, 7168) >= 500
    assert two_source_run_limit(300, 24) == 8
    g = torch.Generator().manual_seed(5)
    m, hidden = 512, 2048  # limit 32 runs
    limit = two_source_run_limit(m, hidden)
    for missing, taken in ((6, True), (60, False)):  # at most 4 * 6 + 1 = 25 runs; ~200 runs
        sources = []
        for _ in range(2):
            keep = torch.ones(m, dtype=torch.bool)
            keep[torch.randperm(m, generator=g)[:missing]] = False
            tokens = torch.nonzero(keep).squeeze(1)
            sources.append((_rows(g, tokens.numel(), hidden), tokens))
        out = torch.empty(m, hidden, dtype=BF16)
        assert _sum_two_by_runs(out, sources, [False, False]) is taken, (missing, limit)
        if taken:
            assert same_bits_nan(out, _reference(m, hidden, sources, None))


def test_combine_sum_benchmark_checks_bits(capsys):
    """``python -m bench combine-sum`` (the figures behind ``two_source_run_limit`` and the
    embedding_bag path) times the paths on the same inputs and checks they give the same bits."""
    from bench import combine_sum

    assert combine_sum.main(["--num-tokens", "96", "--hidden", "64", "--missing", "2,30", "--iters", "1",
                             "--sources", "3,5"]) == 0
    out = capsys.readouterr().out
    assert out.count("[case]") == 2 and "same bits True" in out and "[fit]" in out
    assert out.count("[bags]") == 2 and "same bits False" not in out
    assert "all paths give the same bits in every case: True" in out


def test_accumulate_rows_passes_max_runs_to_the_run_wise_path(monkeypatch):
    """``accumulate_rows(max_runs=...)`` reaches ``_sum_two_by_runs``: 0 declines it (with
    ``bags=False``: the float32 chain), ``m`` takes the run-wise path (what ``bench.combine_sum``
    relies on to time both), same bits."""
    from deepep_ascend.ep import reduce

    seen = []
    real = reduce._sum_two_by_runs

    def spy(out, sources, clean, max_runs=None):
        took = real(out, sources, clean, max_runs)
        seen.append((max_runs, took))
        return took

    monkeypatch.setattr(reduce, "_sum_two_by_runs", spy)
    g = torch.Generator().manual_seed(7)
    m, hidden = 64, 16
    sources = []
    for missing in (3, 5):
        keep = torch.ones(m, dtype=torch.bool)
        keep[torch.randperm(m, generator=g)[:missing]] = False
        tokens = torch.nonzero(keep).squeeze(1)
        sources.append((_rows(g, tokens.numel(), hidden), tokens))
    outs = []
    for max_runs in (0, m):
        out = torch.empty(m, hidden, dtype=BF16)
        accumulate_rows(out, sources, torch.empty(8, hidden), torch.empty(8, hidden), max_runs=max_runs, bags=False,
                        native=False)
        outs.append(out)
    assert seen == [(0, False), (m, True)]
    assert same_bits_nan(outs[0], outs[1]) and same_bits_nan(outs[0], _reference(m, hidden, sources, None))


@pytest.mark.parametrize("num_sources,scratch_rows,hidden", [(1, 3, 40), (2, 5, 40), (3, 7, 7), (5, 64, 40),
                                                             (8, 9, 24)])
def test_sum_by_bags_bitwise(num_sources, scratch_rows, hidden):
    """The embedding_bag path on any number of sources and block size (scratch_rows // sources
    tokens per block, a short last block), tokens that no source has, all-specials rows: the
    float32 chain from +0.0 in source order, bit for bit."""
    g = torch.Generator().manual_seed(num_sources * 100 + scratch_rows)
    m = 29
    sources = []
    for _ in range(num_sources):
        keep = torch.rand(m, generator=g) < 0.7
        keep[:3] = False  # tokens 0-2: no source at all (+0.0)
        keep[3] = True  # token 3: every source
        tokens = torch.nonzero(keep).squeeze(1)
        sources.append((_rows(g, tokens.numel(), hidden), tokens))
    out = torch.full((m, hidden), 7.0, dtype=BF16)
    assert _sum_by_bags(out, sources, torch.empty(scratch_rows, hidden), force=True)
    assert same_bits_nan(out, _reference(m, hidden, sources, None))
    assert (_bits(out[:3]) == 0).all()


def test_sum_by_bags_adds_in_source_order():
    """Order matters in float32. 1 + 2^-8 + 2^-24 + 2^-24 loses both 2^-24 (ties to even) and
    rounds to BF16 1.0 (a tie again); 2^-24 + 2^-24 + 2^-8 + 1 keeps them and rounds up to
    1 + 2^-7. Token 0 has its sources in the first order, token 1 in the second."""
    hidden = 4
    tokens = torch.arange(2)
    col = [(1.0, 2.0 ** -24), (2.0 ** -8, 2.0 ** -24), (2.0 ** -24, 2.0 ** -8), (2.0 ** -24, 1.0)]
    sources = [(torch.tensor([[a] * hidden, [b] * hidden], dtype=BF16), tokens) for a, b in col]
    out = torch.empty(2, hidden, dtype=BF16)
    assert _sum_by_bags(out, sources, torch.empty(4, hidden), force=True)
    assert (out[0].float() == 1.0).all() and (out[1].float() == 1.0 + 2.0 ** -7).all()
    assert same_bits_nan(out, _reference(2, hidden, sources, None))


def test_accumulate_rows_takes_bags_for_two_or_more_sources_without_bias(monkeypatch):
    """accumulate_rows sends two or more sources without bias to _sum_by_bags once the run-wise
    path declines (``max_runs=0`` here); same bits as the float32 chain (``bags=False``). With bias
    it does not; one source never reaches it (no token has two rows: _copy_disjoint copies it).
    Only without the native kernel (``native=False``), which takes these cases where it was built."""
    from deepep_ascend.ep import reduce

    taken = []
    real = reduce._sum_by_bags

    def spy(out, sources, scratch, force=False):
        took = real(out, sources, scratch, force)
        taken.append(took)
        return took

    monkeypatch.setattr(reduce, "_sum_by_bags", spy)
    g = torch.Generator().manual_seed(11)
    m, hidden = 50, 16
    sources = []
    for _ in range(4):
        tokens = torch.nonzero(torch.rand(m, generator=g) < 0.8).squeeze(1)
        sources.append((_rows(g, tokens.numel(), hidden), tokens))
    bias = (_rows(g, m, hidden), None)
    scratch = (torch.empty(32, hidden), torch.empty(32, hidden))  # 4 sources: blocks of 8 tokens (_BAG_MIN_TOKENS)
    for srcs, b, expect in ((sources, None, [True]), (sources[:3], None, [True]), (sources, bias, []),
                            (sources[:2], None, [True]), (sources[:1], None, [])):
        taken.clear()
        out = torch.empty(m, hidden, dtype=BF16)
        accumulate_rows(out, srcs, *scratch, b, max_runs=0, native=False)
        chain = torch.empty(m, hidden, dtype=BF16)
        accumulate_rows(chain, srcs, *scratch, b, max_runs=0, bags=False, native=False)
        assert (taken[:1] == expect[:1] and same_bits_nan(out, chain)
                and same_bits_nan(out, _reference(m, hidden, srcs, b)))


def test_sum_by_bags_declines_blocks_too_small_and_the_chain_takes_over():
    """A scratch with fewer rows than sources cannot hold one token's bag: even forced, the bag
    path declines (it used to raise an index error) and accumulate_rows sums with the chain. By
    default it also declines blocks under _BAG_MIN_TOKENS tokens (per-block overhead wins there)."""
    from deepep_ascend.ep.reduce import _BAG_MIN_TOKENS

    g = torch.Generator().manual_seed(12)
    m, hidden = 9, 8
    sources = [(_rows(g, m, hidden), torch.arange(m)) for _ in range(5)]
    out = torch.full((m, hidden), 7.0, dtype=BF16)
    assert not _sum_by_bags(out, sources, torch.empty(4, hidden), force=True)
    assert (out == 7.0).all()  # nothing written
    assert not _sum_by_bags(out, sources, torch.empty(5 * _BAG_MIN_TOKENS - 1, hidden))
    assert _sum_by_bags(out, sources, torch.empty(5 * _BAG_MIN_TOKENS, hidden))
    assert same_bits_nan(out, _reference(m, hidden, sources, None))
    for rows in (2, 4, 5 * _BAG_MIN_TOKENS - 1):
        out = torch.empty(m, hidden, dtype=BF16)
        accumulate_rows(out, sources, torch.empty(rows, hidden), torch.empty(rows, hidden), native=False)
        assert same_bits_nan(out, _reference(m, hidden, sources, None)), rows


@pytest.mark.parametrize("num_sources,uncovered", [(1, True), (2, False), (4, True), (4, False), (7, True)])
def test_disjoint_sources_are_copied_bitwise(num_sources, uncovered, monkeypatch):
    """Sources that never share a token (MegaMoE combines its (token, expert) pairs this way: one
    row each), interleaved token by token so no run-wise shortcut applies: scattered into place,
    tokens without a row +0.0, -0.0 rows turned into +0.0 unless the source is clean; the float32
    chain's bits. Sources sharing one token are declined with nothing written, and
    ``accumulate_rows`` without the native kernel takes this path by default (``disjoint=False`` gives
    the same bits another way, and so does the kernel)."""
    from deepep_ascend.ep import reduce

    g = torch.Generator().manual_seed(num_sources * 10 + uncovered)
    m, hidden = 61, 24
    owner = torch.randint(-1 if uncovered else 0, num_sources, (m,), generator=g)
    owner[:num_sources] = torch.arange(num_sources)  # every source has a row
    sources, clean = [], []
    for j in range(num_sources):
        tokens = torch.nonzero(owner == j).squeeze(1)
        rows = _rows(g, tokens.numel(), hidden)
        if j % 2:
            rows = torch.add(rows, 0.0)  # clean: what a staging rank sends
        sources.append((rows, tokens))
        clean.append(bool(j % 2))
    expected = _reference(m, hidden, sources, None)
    for flags in ([False] * num_sources, clean):
        out = torch.full((m, hidden), 7.0, dtype=BF16)
        assert _copy_disjoint(out, sources, flags)
        assert same_bits_nan(out, expected)
        assert (_bits(out[owner < 0]) == 0).all()
    shared = [sources[0], (sources[0][0][:1], sources[0][1][:1])] + sources[1:]
    out = torch.full((m, hidden), 7.0, dtype=BF16)
    assert not _copy_disjoint(out, shared, [False] * len(shared)) and (out == 7.0).all()
    many = [(sources[0][0][:1], sources[0][1][:1])] * 256  # 256 rows for one token: no counter wraps to 0
    assert not _copy_disjoint(torch.empty(300, hidden, dtype=BF16), many, [False] * 256)
    taken = []
    real = reduce._copy_disjoint
    monkeypatch.setattr(reduce, "_copy_disjoint", lambda *a: taken.append(real(*a)) or taken[-1])
    scratch = (torch.empty(16, hidden), torch.empty(16, hidden))
    out, other, default = (torch.empty(m, hidden, dtype=BF16) for _ in range(3))
    accumulate_rows(out, sources, *scratch, max_runs=0, native=False)
    accumulate_rows(other, sources, *scratch, max_runs=0, disjoint=False, native=False)
    assert taken == [True] and same_bits_nan(out, expected) and same_bits_nan(other, expected)
    accumulate_rows(default, sources, *scratch)  # the native kernel where built (if one source: this path)
    assert same_bits_nan(default, expected)
