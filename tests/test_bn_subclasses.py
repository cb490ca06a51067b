"""A user's subclass of a torch BatchNorm is recognised as its base class (``bn/kind.py``).

convert and fold ask one function whether a module is a BatchNorm and of what
dimensionality, by ``isinstance``: a subclass of ``nn.BatchNorm2d`` (or ``BatchNorm1d``)
with torch's forward fuses, folds and is left exactly where and why its base class is; a
direct ``_BatchNorm`` subclass normalises any rank, as ``SyncBatchNorm`` does.
"""
from __future__ import annotations

import copy
from typing import Any, Dict, Type

import pytest
import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

import convbn
from convbn.passes.bn.kind import bn_conv_dims
from fusion_checks import assert_chain_ran, assert_fused
from test_bn_shapes import TokenMLP, _assert_same_step, _bn_calls, _fold, _fused, _step


class MyBatchNorm2d(nn.BatchNorm2d):
    """A user's BatchNorm2d: torch's forward, an attribute of its own."""

    def __init__(self, num_features: int) -> None:
        super().__init__(num_features)
        self.tag = "mine"


class MyBatchNorm1d(nn.BatchNorm1d):
    """A user's BatchNorm1d: torch's forward."""


class MyNorm(_BatchNorm):
    """A direct ``_BatchNorm`` subclass, as ``nn.BatchNorm2d`` itself is written."""

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() != 4:
            raise ValueError(f"expected 4D input (got {input.dim()}D input)")


def _net(bn: Type[nn.Module]) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), bn(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1, bias=False), bn(8), nn.ReLU())


def test_one_answer_by_isinstance() -> None:
    assert bn_conv_dims(nn.BatchNorm2d(4)) == bn_conv_dims(MyBatchNorm2d(4)) == (2,)
    assert bn_conv_dims(MyBatchNorm1d(4)) == (0, 1)
    assert bn_conv_dims(MyNorm(4)) == bn_conv_dims(nn.SyncBatchNorm(4)) == ()
    assert bn_conv_dims(nn.ReLU()) is None


@pytest.mark.parametrize("bn", [nn.BatchNorm2d, MyBatchNorm2d, MyNorm], ids=lambda c: c.__name__)
def test_subclass_fuses_and_trains_as_the_base_class(bn: Type[nn.Module]) -> None:
    torch.manual_seed(0)
    model = _net(bn).double()
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    eager = copy.deepcopy(model)
    fast = convbn.convert(copy.deepcopy(model), example_inputs=x)
    assert_fused(fast, pairs=2, chains=1, skipped=0)
    calls = _bn_calls(fast)
    for _ in range(2):
        ref = _step(eager, x)
        _assert_same_step(ref, _step(fast, x, ref["g"]))
    assert calls == {}, f"the fused path did not run: BatchNorm modules called {calls}"
    assert_chain_ran(fast(x.clone().requires_grad_()))


@pytest.mark.parametrize("bn", [nn.BatchNorm2d, MyBatchNorm2d, MyNorm], ids=lambda c: c.__name__)
def test_subclass_folds_as_the_base_class(bn: Type[nn.Module]) -> None:
    folded = _fold(_net(bn), torch.randn(2, 3, 6, 6))
    assert {o.batchnorm: o.layer for o in folded.convbn_report.folded} == {"1": "0", "4": "3"}
    assert not any(isinstance(m, _BatchNorm) for m in folded.modules())


class _TokenMLPOf(TokenMLP):
    def __init__(self, bn: Type[nn.Module]) -> None:
        super().__init__()
        self.bn = bn(12)


@pytest.mark.parametrize("bn", [nn.BatchNorm1d, MyBatchNorm1d], ids=lambda c: c.__name__)
def test_token_batchnorm1d_subclass_fuses_and_folds_as_the_base_class(bn: Type[nn.Module]) -> None:
    torch.manual_seed(0)
    model = _TokenMLPOf(bn).double()
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64)
    eager = copy.deepcopy(model)
    fast = convbn.convert(copy.deepcopy(model), example_inputs=x)
    assert set(_fused(fast.convbn_report)) == {"bn"} and not fast.convbn_report.skipped
    ref = _step(eager, x)
    _assert_same_step(ref, _step(fast, x, ref["g"]))
    folded = _fold(_TokenMLPOf(bn), torch.randn(2, 3, 4, 4))
    assert {o.batchnorm: o.layer for o in folded.convbn_report.folded} == {"bn": "fc"}


class _Conv1dThen(nn.Module):
    """A BatchNorm2d after a 1-D convolution: eager raises on its 3-D input."""

    def __init__(self, bn: Type[nn.Module]) -> None:
        super().__init__()
        self.conv = nn.Conv1d(3, 8, 3)
        self.bn = bn(8)

    def forward(self, x: Tensor) -> Tensor:
        return self.bn(self.conv(x))


def _left(report: Any) -> Dict[str, str]:
    return {o.batchnorm: o.reason for o in report.outcomes if o.result == "left"}


@pytest.mark.expect_unfused("a BatchNorm2d after a 1-D convolution is left, subclass or not")
def test_subclass_after_the_wrong_convolution_is_left_as_the_base_class() -> None:
    base = _left(convbn.convert(_Conv1dThen(nn.BatchNorm2d)).convbn_report)
    mine = _left(convbn.convert(_Conv1dThen(MyBatchNorm2d)).convbn_report)
    assert set(base) == {"bn"} and base["bn"].startswith("BatchNorm2d after a 1-D convolution")
    assert mine == {"bn": "My" + base["bn"]}
