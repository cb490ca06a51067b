"""Coverage of BatchNorms written in more ways than ``Conv -> nn.BatchNorm`` (issue 10).

Each test asserts the report's fused pairs (so a shape that silently stops fusing fails)
and training equality with eager in float64 for every strategy.
"""
from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from convbn import fold
from convbn.passes.fold import FoldReport
from test_convert import STRATS, assert_every_bn_once, assert_same_training, convert_pair, fused, inp


class ShapeChecks(nn.Module):
    """Shape-only reads of conv and BN outputs (as norm-act layers do) between two fused pairs."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.conv2, self.bn2 = nn.Conv2d(4, 5, 3, padding=1), nn.BatchNorm2d(5)

    def forward(self, x: Tensor) -> Tensor:
        y = self.conv1(x)
        torch._assert(y.ndim == 4, "expected a 4-D input")
        n, c = y.shape[0], y.size(1)
        z = self.bn1(y)
        torch._assert(z.dim() == 4, "expected 4-D")
        z = torch.relu(z)
        out = self.bn2(self.conv2(z))
        return out * (c / n)  # the read shapes feed the output, so a wrong re-pointing shows


@pytest.mark.parametrize("strategy", STRATS)
def test_shape_only_uses_do_not_block_fusing(strategy: str) -> None:
    eager, fast = convert_pair(ShapeChecks, strategy=strategy)
    report = fast.convbn_report
    assert fused(report) == [("conv1", "bn1", "relu"), ("conv2", "bn2", "identity")]
    assert not report.skipped
    assert_every_bn_once(eager, report)
    assert_same_training(eager, fast, inp(2, 3, 6, 5))


class ShapeOfBNWithoutAct(nn.Module):
    """The BN output (no activation) is both read for its shape and consumed by a chained conv."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.conv2, self.bn2 = nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4)

    def forward(self, x: Tensor) -> Tensor:
        z = self.bn1(self.conv1(x))
        h = z.shape[-1]
        return self.bn2(self.conv2(z)) + h


@pytest.mark.parametrize("strategy", STRATS)
def test_shape_use_of_a_chain_output(strategy: str) -> None:
    eager, fast = convert_pair(ShapeOfBNWithoutAct, strategy=strategy)
    assert fused(fast.convbn_report) == [("conv1", "bn1", "identity"), ("conv2", "bn2", "identity")]
    assert_same_training(eager, fast, inp(2, 3, 6, 5))


def test_shape_only_uses_do_not_block_folding() -> None:
    torch.manual_seed(0)
    model = ShapeChecks().double()
    with torch.no_grad():
        for bn in (model.bn1, model.bn2):
            bn.running_mean.uniform_(-0.2, 0.2)
            bn.running_var.uniform_(0.5, 2.0)
            bn.weight.uniform_(0.5, 1.5)
    model.eval()
    x = inp(2, 3, 6, 5)
    folded = fold(model)
    report = folded.fold_report
    assert isinstance(report, FoldReport)
    assert sorted(a.batchnorm for a in report.folded) == ["bn1", "bn2"], report
    with torch.no_grad():
        torch.testing.assert_close(folded(x), model(x), rtol=1e-10, atol=1e-10)
