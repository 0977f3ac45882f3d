"""Random BF16 rows rich in special values and the float32-chain reference of a row sum, shared by the
reduction tests of the EP room and of the native kernels."""

from __future__ import annotations

import torch

BF16 = torch.bfloat16
SPECIALS = [0.0] + [-0.0] * 4 + [float("inf"), float("-inf"), float("nan"), 3.0e38, -3.0e38, 1e-40, -1e-40, 1.0, -1.0]


def random_rows(g, n, hidden, specials=True):
    """Random BF16 rows; a third of the elements are special values, -0.0 the most common."""
    x = torch.randn(n, hidden, generator=g) * 2.0 ** torch.randint(-20, 20, (n, 1), generator=g)
    if specials:
        pick = torch.randint(0, 3 * len(SPECIALS), (n, hidden), generator=g)
        sp = torch.tensor(SPECIALS + [0.0] * (2 * len(SPECIALS)))[pick]
        x = torch.where(pick < len(SPECIALS), sp, x)
    return x.to(BF16)


def reference_sum(m, hidden, sources, bias):
    """The float32 chain from ``+0.0`` (or the biases), one row at a time in source order, rounded once to bf16:
    what combine's reduction must reproduce bit for bit."""
    acc = torch.zeros(m, hidden)
    if bias is not None:
        b0, b1 = bias
        acc = b0.float() + (torch.zeros(m, hidden) if b1 is None else b1.float())
    for rows, tokens in sources:
        for i, t in enumerate(tokens.tolist()):  # one row at a time: the order is the point here
            acc[t] += rows[i].float()
    return acc.to(BF16)


def bits(t):
    """A bf16 tensor's bit patterns (int16), for bitwise comparisons."""
    return t.view(torch.int16)
