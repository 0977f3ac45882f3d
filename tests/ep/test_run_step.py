"""``deepep_ascend.ep.failure.run_step``: a protocol step runs without autograd, and the caller's grad mode is back
after it, whether the step returns or raises (docs/semantics/deepep-api.md §8)."""

from __future__ import annotations

import pytest
import torch

from deepep_ascend.ep.failure import run_step


def _seen() -> bool:
    return torch.is_grad_enabled()


def _raises():
    assert not torch.is_grad_enabled()
    raise KeyError("step failed")


@pytest.mark.parametrize("outer", ["enabled", "no_grad", "inference_mode"])
def test_step_runs_without_autograd_and_grad_mode_comes_back(outer):
    ctx = {"enabled": torch.enable_grad, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}[outer]
    with ctx():
        before = torch.is_grad_enabled()
        assert run_step(None, 0, _seen) is False
        assert torch.is_grad_enabled() == before
        with pytest.raises(KeyError, match="step failed"):
            run_step(None, 0, _raises)
        assert torch.is_grad_enabled() == before
    x = torch.ones(2, requires_grad=True)
    assert not run_step(None, 0, lambda: x * 2).requires_grad  # no graph recorded inside a step
