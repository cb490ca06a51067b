"""Tests of gradcheck_module: passes on real layers, fails on wrong backwards, leaves the module alone."""
from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.autograd.gradcheck import GradcheckError

from convbn.reference.double_backward import SinhWrong
from convbn.gradcheck import GradcheckReport, gradcheck_module
from convbn.reference.linear import Linear
from convbn.reference.tutorial_fused import TutorialFusedConvBN2d



class _WrongBackward(torch.autograd.Function):
    """``y = 2 x`` whose backward (deliberately) forgets the factor 2."""

    @staticmethod
    def forward(ctx: Any, input: Tensor) -> Tensor:
        return input * 2

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> Tensor:
        return grad_output


class _Wrong(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3))

    def forward(self, x: Tensor) -> Tensor:
        return _WrongBackward.apply(x * self.weight)


class _WrongSecondOrder(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return SinhWrong.apply(x)


def _conv_bn(bias: bool = True) -> nn.Sequential:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1, bias=bias), nn.BatchNorm2d(3), nn.ReLU())
    with torch.no_grad():  # non-trivial affine and running stats
        net[1].weight.uniform_(0.5, 1.5)
        net[1].bias.uniform_(-0.5, 0.5)
        net[1].running_mean.uniform_(-1, 1)
    return net.train()


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(2, 2, 3, 3), (3, 2, 2, 4)])
def test_conv_bn_train_mode_passes_both_orders(bias: bool, shape) -> None:
    net = _conv_bn(bias)
    report = gradcheck_module(net, torch.randn(*shape))
    assert report.first_order and report.second_order, str(report)
    assert report.passed and report.errors == {}
    expected = ("input[0]", "0.weight") + (("0.bias",) if bias else ()) + ("1.weight", "1.bias")
    assert report.variables == expected


def test_users_module_and_inputs_are_untouched() -> None:
    net = _conv_bn()
    before = copy.deepcopy(net.state_dict())
    x = torch.randn(2, 2, 3, 3)
    x_before = x.clone()
    rng_before = torch.get_rng_state()
    gradcheck_module(net, x, check_grad_grad=False)
    assert net.training
    for key, value in net.state_dict().items():
        assert value.dtype == before[key].dtype
        assert torch.equal(value, before[key]), key  # incl. running stats, num_batches_tracked
    assert all(p.grad is None for p in net.parameters())
    assert x.dtype == torch.float32 and torch.equal(x, x_before)
    assert torch.equal(torch.get_rng_state(), rng_before)


def test_wrong_backward_is_reported() -> None:
    report = gradcheck_module(_Wrong(), torch.randn(3))
    assert report.first_order is False
    assert "first_order" in report.errors and "Jacobian mismatch" in report.errors["first_order"]
    assert not report.passed
    text = str(report)
    assert "FAILED" in text and "first_order error" in text


def test_wrong_second_order_is_reported() -> None:
    report = gradcheck_module(_WrongSecondOrder(), torch.randn(4))
    assert report.first_order is True
    assert report.second_order is False
    assert set(report.errors) == {"second_order"}


def test_raise_exception_raises() -> None:
    with pytest.raises(GradcheckError):
        gradcheck_module(_Wrong(), torch.randn(3), raise_exception=True)
    with pytest.raises(RuntimeError):
        gradcheck_module(_WrongSecondOrder(), torch.randn(3), raise_exception=True)


def test_check_grad_grad_false_leaves_second_order_none() -> None:
    report = gradcheck_module(nn.Linear(3, 2), torch.randn(2, 3), check_grad_grad=False)
    assert report.first_order and report.second_order is None and report.passed
    assert "not run" in str(report)


def test_reference_layers() -> None:
    # The custom Linear is differentiable twice; the tutorial's fused layer is
    # once_differentiable, which gradgradcheck reports as a second-order failure.
    assert gradcheck_module(Linear(3, 2), torch.randn(4, 3)).passed
    fused = gradcheck_module(TutorialFusedConvBN2d(2, 2, 3), torch.randn(2, 2, 4, 4))
    assert fused.first_order and fused.second_order is False


def test_dropout_is_repeatable() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Tanh()).train()
    assert gradcheck_module(net, torch.randn(3, 4)).passed


def test_frozen_parameters_and_integer_inputs_are_constants() -> None:
    net = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 2))
    net[1].bias.requires_grad_(False)
    report = gradcheck_module(net, torch.tensor([[0, 4], [2, 2]]))
    assert report.passed
    assert report.variables == ("0.weight", "1.weight")


def test_multiple_outputs_and_inputs() -> None:
    class TwoHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(3, 2)

        def forward(self, x: Tensor, y: Tensor) -> dict:
            return {"sum": self.a(x) + y, "prod": (self.a(x) * y, torch.argmax(y, dim=-1))}

    report = gradcheck_module(TwoHeads(), torch.randn(2, 3), torch.randn(2, 2))
    assert report.passed
    assert report.variables[:2] == ("input[0]", "input[1]")


def test_bad_arguments() -> None:
    with pytest.raises(TypeError, match="expects an nn.Module"):
        gradcheck_module(lambda t: t, torch.randn(2))
    with pytest.raises(TypeError, match="input\\[1\\] is list"):
        gradcheck_module(nn.Linear(2, 2), torch.randn(2), [1.0])
    with pytest.raises(ValueError, match="nothing to differentiate"):
        gradcheck_module(nn.Identity(), torch.ones(2, dtype=torch.int64))


def test_report_str_is_readable() -> None:
    report = GradcheckReport(
        first_order=True, second_order=False, errors={"second_order": "boom\n" * 20},
        module_name="Net", variables=("input[0]",),
    )
    text = str(report)
    assert text.splitlines()[0].startswith("gradcheck report for Net")
    assert "passed" in text and "FAILED" in text and "more lines" in text
