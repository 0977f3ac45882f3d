"""deepep_ascend.ordering.stable_argsort against torch's stable argsort, on every route it takes."""

import pytest
import torch

from deepep_ascend.ordering import stable_argsort


@pytest.mark.parametrize("lo, hi", [(-1, 8), (-1, 256), (-(1 << 15), (1 << 15)), (-1, 40000), (1000, 1000 + (1 << 16)),
                                    (-1, 1 << 20), (-(1 << 40), 1 << 40)])
@pytest.mark.parametrize("n", [0, 1, 255, 256, 5000])
def test_stable_argsort_is_torchs_stable_argsort(lo, hi, n):
    """Keys at both bounds and in between, many ties: the permutation torch's stable sort gives
    (16-bit keys by numpy's radix sort, a shifted 16-bit range, wider ranges and few keys by torch)."""
    g = torch.Generator().manual_seed(n + hi)
    span = hi - lo
    keys = lo + torch.randint(0, min(span, 1 << 62), (n,), generator=g) % span
    if n >= 2:
        keys[0], keys[-1] = lo, hi - 1  # both ends of the range
    if n >= 8:
        keys[n // 2: n // 2 + 4] = keys[1]  # ties, which a stable sort keeps in order
    got = stable_argsort(keys, lo, hi)
    assert got.dtype == torch.int64 and got.shape == (n,)
    assert torch.equal(got, torch.argsort(keys, stable=True))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.uint8, torch.bool])
def test_stable_argsort_takes_other_integer_dtypes_and_strides(dtype):
    """A strided view of narrower keys: the same permutation as torch's."""
    g = torch.Generator().manual_seed(3)
    hi = 2 if dtype == torch.bool else 200
    base = torch.randint(0, hi, (2, 3000), generator=g).to(dtype)
    keys = base[:, ::2].reshape(-1) if dtype == torch.bool else base[1, ::3]
    assert torch.equal(stable_argsort(keys, 0, hi), torch.argsort(keys, stable=True))


def test_stable_argsort_bounds_wider_than_the_keys_dtype():
    """Bounds outside the keys' own dtype (int16 keys, ``lo = -32769``): no overflow, the same permutation."""
    keys = torch.full((300,), -32768, dtype=torch.int16)
    keys[::3] = 32766
    assert torch.equal(stable_argsort(keys, -32769, 32767), torch.argsort(keys, stable=True))
