"""Coverage of BatchNorms written in more ways than ``Conv -> nn.BatchNorm`` (issue 10).

Each test asserts the report's fused pairs (so a shape that silently stops fusing fails)
and training equality with eager in float64 for every strategy.
"""
from __future__ import annotations

from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from convbn import fold
from convbn.functional.activations import Activation, activation_from_module
from convbn.passes.fold.api import FoldReport
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
    report = folded.convbn_report
    assert isinstance(report, FoldReport)
    assert sorted(a.batchnorm for a in report.folded) == ["bn1", "bn2"], report
    with torch.no_grad():
        torch.testing.assert_close(folded(x), model(x), rtol=1e-10, atol=1e-10)


NEW_ACTS = {
    "sigmoid": (nn.Sigmoid(), torch.sigmoid), "tanh": (nn.Tanh(), torch.tanh),
    "elu(0.5)": (nn.ELU(0.5), lambda t: F.elu(t, 0.5)), "celu(0.7)": (nn.CELU(0.7), lambda t: F.celu(t, 0.7)),
    "selu": (nn.SELU(), F.selu), "mish": (nn.Mish(), F.mish), "hardsigmoid": (nn.Hardsigmoid(), F.hardsigmoid),
    "softplus(2.0, 1.0)": (nn.Softplus(2.0, 1.0), lambda t: F.softplus(t, 2.0, 1.0)),
    "gelu(tanh)": (nn.GELU("tanh"), lambda t: F.gelu(t, approximate="tanh")),
}


class ConvBNAct(nn.Module):
    def __init__(self, act: Callable[[Tensor], Tensor]) -> None:
        super().__init__()
        self.conv1, self.bn1, self.act = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), act
        self.conv2, self.bn2 = nn.Conv2d(4, 5, 3, padding=1), nn.BatchNorm2d(5)

    def forward(self, x: Tensor) -> Tensor:
        return self.bn2(self.conv2(self.act(self.bn1(self.conv1(x)))))


@pytest.mark.parametrize("form", ["module", "functional"])
@pytest.mark.parametrize("name", list(NEW_ACTS))
@pytest.mark.parametrize("strategy", STRATS)
def test_more_activations_fused(name: str, form: str, strategy: str) -> None:
    act = NEW_ACTS[name][0 if form == "module" else 1]
    eager, fast = convert_pair(lambda: ConvBNAct(act), strategy=strategy)
    assert fused(fast.convbn_report) == [("conv1", "bn1", name), ("conv2", "bn2", "identity")]
    assert fast.convbn_report.num_chains == 1
    assert_same_training(eager, fast, inp(2, 3, 6, 5))


def test_unknown_activation_name_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"one of \('identity', 'relu'.*'softplus'\).*'swishy'"):
        Activation("swishy")


class MyReLU(nn.ReLU):
    """A renamed ReLU (same forward): the ReLU record applies."""


class ShiftedReLU(nn.ReLU):
    """A ReLU subclass computing something else: no record applies."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.relu(x - 0.1)


def test_activation_subclasses() -> None:
    assert activation_from_module(MyReLU()) == Activation("relu")
    assert activation_from_module(ShiftedReLU()) is None
    assert activation_from_module(nn.Hardtanh(0.0, 6.0)) == Activation("relu6")
    assert activation_from_module(nn.Hardtanh(-1.0, 1.0)) is None
