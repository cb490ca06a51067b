"""convert's whole-model check with the rewrite's gradients compared as they come (Note: [a check
that holds one side's gradients]): a correct rewrite passes with every ``.grad`` put back, and a
rewrite whose outputs or gradients differ is caught, with what differs named."""
from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import convbn
from convbn.passes.check.step import check_step
from convbn.passes.graph.graph_module import installed


def _net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g * 1.5


def _converted() -> nn.Module:
    """Converted and checked on example inputs (no first-call check pending, as in convert's own check)."""
    torch.manual_seed(0)
    return convbn.convert(_net(), strategy="recompute_bn", example_inputs=torch.randn(4, 3, 8, 8))


def test_a_correct_rewrite_passes_and_the_eager_gradients_are_let_go() -> None:
    fast = _converted()
    x = torch.randn(4, 3, 8, 8)
    grads_before = [p.grad for p in fast.parameters()]
    result = check_step(fast, (x,), {})
    assert result.ok, result.describe()
    assert [p.grad for p in fast.parameters()] == grads_before  # .grad set aside and put back


@pytest.mark.parametrize("where", ["output", "gradient"])
def test_a_rewrite_that_differs_is_caught_and_named(where: str) -> None:
    fast = _converted()
    fwd = installed(fast)
    original = fwd.fn

    def wrong(owner: nn.Module, x: torch.Tensor) -> torch.Tensor:
        y = original(owner, x)
        return y + 0.5 if where == "output" else _ScaleGrad.apply(y)

    fwd.fn = wrong
    result = check_step(fast, (torch.randn(4, 3, 8, 8),), {})
    assert not result.ok
    assert ("outputs differ" if where == "output" else "gradients differ") in result.describe()
