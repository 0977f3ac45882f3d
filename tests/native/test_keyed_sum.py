"""Combine's reduction with sort keys (``accumulate_rows(..., keys=...)``, the native kernel and the torch
path): each token's rows are added in ascending key, ties in source order, from ``+0.0`` or the bias,
rounded once -- checked bit for bit against a per-token float32 chain, on rows rich in special values."""

from __future__ import annotations

import pytest
import torch

from deepep_ascend import native
from deepep_ascend.ep.reduce import CombineScratch, accumulate_rows
from deepep_ascend.native.loader import kernels
from tests.support.buffer_helpers import same_bits_nan
from tests.support.rows import BF16
from tests.support.rows import random_rows as _rows


def _keyed_reference(m, hidden, sources, keys, bias):
    """Per token: gather its (key, source, row), sort by (key, source), add one at a time in float32."""
    acc = torch.zeros(m, hidden)
    if bias is not None:
        b0, b1 = bias
        acc = b0.float() + (torch.zeros(m, hidden) if b1 is None else b1.float())
    terms = [[] for _ in range(m)]
    for j, ((rows, tokens), key) in enumerate(zip(sources, keys)):
        for i, (t, k) in enumerate(zip(tokens.tolist(), key.tolist())):
            terms[t].append((k, j, rows[i]))
    for t in range(m):
        for _, _, row in sorted(terms[t], key=lambda term: term[:2]):
            acc[t] += row.float()
    return acc.to(BF16)


def _case(seed, m, hidden, num_sources, bias_kind):
    g = torch.Generator().manual_seed(seed)
    sources, keys = [], []
    for _ in range(num_sources):
        tokens = torch.nonzero(torch.rand(m, generator=g) < 0.7).squeeze(1)
        sources.append((_rows(g, tokens.numel(), hidden), tokens))
        keys.append(torch.randint(0, 8, (tokens.numel(),), generator=g))
    bias = None
    if bias_kind == "one":
        bias = (_rows(g, m, hidden), None)
    elif bias_kind == "pair":
        bias = (_rows(g, m, hidden), _rows(g, m, hidden))
    return sources, keys, bias


@pytest.mark.parametrize("use_native", [True, False])
@pytest.mark.parametrize("num_sources,m,hidden,bias_kind", [
    (1, 5, 8, None), (3, 40, 64, None), (4, 33, 1030, "one"), (8, 17, 16, "pair"), (2, 0, 8, "one")])
def test_keyed_sum_is_the_per_token_chain_in_key_order(use_native, num_sources, m, hidden, bias_kind, monkeypatch):
    if use_native and not native.available():
        pytest.skip("native kernel not built")
    if not use_native:
        monkeypatch.setattr(kernels, "sum_rows_bf16", None)
    sources, keys, bias = _case(num_sources * 1000 + m, m, hidden, num_sources, bias_kind)
    out = torch.empty(m, hidden, dtype=BF16)
    acc, tmp = CombineScratch(rows=7).get(hidden)  # small blocks: the torch path crosses block edges
    accumulate_rows(out, sources, acc, tmp, bias, keys=keys)
    assert same_bits_nan(out, _keyed_reference(m, hidden, sources, keys, bias))


def test_keys_reorder_the_sum():
    """The order is real: a sum that rounds differently in the two orders follows the keys."""
    big, small = torch.tensor([[2.0 ** 24]], dtype=BF16), torch.tensor([[1.0]], dtype=BF16)
    neg = torch.tensor([[-(2.0 ** 24)]], dtype=BF16)
    tok = torch.zeros(1, dtype=torch.int64)
    sources = [(big, tok), (small, tok), (neg, tok)]
    acc, tmp = CombineScratch().get(1)
    results = {}
    for use_native in ([True, False] if native.available() else [False]):
        for order in ((0, 1, 2), (0, 2, 1)):
            out = torch.empty(1, 1, dtype=BF16)
            keys = [torch.tensor([k]) for k in order]
            accumulate_rows(out, sources, acc, tmp, keys=keys, native=use_native)
            results[use_native, order] = float(out)
    for (use_native, order), value in results.items():
        # 2^24 + 1 rounds to 2^24 in float32 (then - 2^24 = 0); 2^24 - 2^24 + 1 = 1
        assert value == (0.0 if order == (0, 1, 2) else 1.0), (use_native, order, value)


@pytest.mark.skipif(not native.available(), reason="native kernel not built")
def test_native_keys_must_match_the_tokens():
    rows = torch.zeros(3, 4, dtype=BF16)
    with pytest.raises(ValueError, match="keys must have the shape of its tokens"):
        native.sum_rows(torch.empty(3, 4, dtype=BF16), [(rows, torch.arange(3))], keys=[torch.zeros(2)])
    with pytest.raises(ValueError, match="1 key tensors for 2 sources"):
        native.sum_rows(torch.empty(3, 4, dtype=BF16), [(rows, torch.arange(3))] * 2, keys=[None])
