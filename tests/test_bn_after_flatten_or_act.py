"""A BatchNorm1d after ``flatten(1)`` of a Linear output, and a BatchNorm after an activation
(conv -> act -> BN): convert fuses and fold folds where the maths is exact (Note: [a flatten
between a Linear and its BatchNorm1d]; a BN after an activation folds into the next conv),
and every other such BatchNorm is reported with a reason that names the pattern."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.testing import assert_close

import convbn
from capture_helpers import TIGHT as TOL, assert_steps_match, randomise_batchnorms
from fusion_checks import assert_fused


class PooledHead(nn.Module):
    """conv -> pool -> flatten -> Linear -> flatten -> BatchNorm1d: the Linear's output is 2-D."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.conv = nn.Conv2d(3, 6, 3)
        self.fc = nn.Linear(24, 12)
        self.drop = nn.Dropout(0.0)
        self.bn = nn.BatchNorm1d(12)

    def forward(self, x: Tensor) -> Tensor:
        y = F.adaptive_avg_pool2d(self.conv(x), 2)
        y = y.flatten(1) if self.how == "flatten" else y.view(y.size(0), -1)
        y = self.fc(self.drop(y))
        return self.bn(torch.flatten(y, 1) if self.how == "flatten" else y.flatten(start_dim=1))


class OpenHead(nn.Module):
    """Linear -> flatten -> BatchNorm1d on the model's input: its rank is not in the graph."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.bn = nn.BatchNorm1d(features)

    def forward(self, x: Tensor) -> Tensor:
        return self.bn(self.fc(x).flatten(1))


class ActThenBN(nn.Module):
    """conv -> relu -> BN -> conv (folds into the next conv) and conv -> silu -> BN -> pool (no conv after)."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.b1, self.c2 = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Conv2d(4, 5, 1)
        self.c3, self.b3 = nn.Conv2d(3, 5, 3, padding=1), nn.BatchNorm2d(5)

    def forward(self, x: Tensor) -> Tensor:
        return self.c2(self.b1(F.relu(self.c1(x)))) + F.adaptive_avg_pool2d(self.b3(F.silu(self.c3(x))), 1)


@pytest.mark.parametrize("how", ["flatten", "view"])
def test_linear_flatten_batchnorm1d_fuses_and_folds(how: str) -> None:
    torch.manual_seed(0)
    eager = randomise_batchnorms(PooledHead(how))
    x = torch.randn(4, 3, 8, 8, dtype=torch.float64)
    fast = convbn.convert(copy.deepcopy(eager), strategy="recompute_conv", example_inputs=x)
    report = assert_fused(fast, skipped=0)
    assert [(p.conv, p.bn) for p in report.pairs if p.bn] == [("fc", "bn")], report
    assert_steps_match(eager, fast, x)
    eager.eval()
    folded = convbn.fold(eager, example_inputs=x)
    assert [(o.batchnorm, o.result, o.layer) for o in folded.convbn_report.outcomes] == [("bn", "folded", "fc")]
    assert_close(folded(x), eager(x), **TOL)


@pytest.mark.expect_unfused("a BatchNorm1d over a flattened Linear output of unknown rank is left")
@pytest.mark.parametrize("shape,features", [((5, 4), 3), ((5, 2, 4), 6)])
def test_linear_flatten_batchnorm1d_of_unknown_rank_is_left_with_the_reason(shape, features) -> None:
    eager = randomise_batchnorms(OpenHead(features))
    x = torch.randn(*shape, dtype=torch.float64)
    fast = convbn.convert(copy.deepcopy(eager), example_inputs=x)
    (left,) = fast.convbn_report.outcomes
    assert left.result == "left" and left.reason.startswith("BatchNorm1d over a flattened Linear output"), left
    assert_close(fast(x), eager(x), **TOL)
    eager.eval()
    folded = convbn.fold(eager, example_inputs=x)
    (left,) = folded.convbn_report.outcomes
    assert left.result == "left" and left.reason.startswith("BatchNorm1d over a flattened Linear output"), left
    assert_close(folded(x), eager(x), **TOL)


def test_batchnorm_after_an_activation_folds_into_the_next_conv_or_says_why() -> None:
    eager = randomise_batchnorms(ActThenBN())
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    fast = convbn.convert(copy.deepcopy(eager), strategy="recompute_conv", example_inputs=x)
    assert_fused(fast)
    outcomes = {o.batchnorm: o for o in fast.convbn_report.outcomes}
    assert (outcomes["b1"].result, outcomes["b1"].layer, outcomes["b1"].direction) == ("fused", "c2", "following")
    assert outcomes["b3"].result == "left"
    assert outcomes["b3"].reason.startswith("BatchNorm after an activation: it follows silu of convolution c3"), outcomes
    assert_steps_match(eager, fast, x)
    eager.eval()
    folded = convbn.fold(eager, example_inputs=x)
    outcomes = {o.batchnorm: o for o in folded.convbn_report.outcomes}
    assert (outcomes["b1"].result, outcomes["b1"].layer, outcomes["b1"].direction) == ("folded", "c2", "following")
    assert outcomes["b3"].result == "left"
    assert outcomes["b3"].reason.startswith("BatchNorm after an activation: it follows 'silu' of c3"), outcomes
    assert_close(folded(x), eager(x), **TOL)
