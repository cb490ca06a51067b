"""Frozen BatchNorms that keep eps as a constant in their forward, not as an ``eps`` attribute
(Note: [recovering a frozen BatchNorm's eps]): recognised by what they compute, fused by
convert and folded by fold like any frozen BatchNorm; a module with the same buffers that
computes something else is not, and both reports list it with the reason."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn
from torch.testing import assert_close

import convbn
from convbn.passes.bn.frozen import frozen_bn_eps, frozen_bn_ranks, frozen_bn_reason
from fusion_checks import assert_chain_ran, assert_fused

TOL = dict(rtol=1e-10, atol=1e-10)


class _Buffers(nn.Module):
    """The four buffers of a frozen BatchNorm and no eps attribute."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.register_buffer("weight", torch.ones(n))
        self.register_buffer("bias", torch.zeros(n))
        self.register_buffer("running_mean", torch.zeros(n))
        self.register_buffer("running_var", torch.ones(n))

    def _shaped(self):
        return [t.reshape(1, -1, 1, 1) for t in (self.weight, self.bias, self.running_mean, self.running_var)]


class ConstEpsFrozenBN2d(_Buffers):
    """The detector-style frozen BatchNorm: eps written into the forward."""

    def forward(self, x: Tensor) -> Tensor:
        w, b, rm, rv = self._shaped()
        scale = w * (rv + 1e-5).rsqrt()
        bias = b - rm * scale
        return x * scale + bias


class ConstEpsFrozenBN2dWide(_Buffers):
    """Another constant, written another way."""

    def forward(self, x: Tensor) -> Tensor:
        w, b, rm, rv = self._shaped()
        return torch.addcmul(b, x - rm, w / torch.sqrt(rv + 1e-3))


class ConstEpsFrozenNormAct2d(_Buffers):
    """A frozen norm-act layer: eps a constant, then children of its own."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.drop = nn.Identity()
        self.act = nn.Hardswish()

    def forward(self, x: Tensor) -> Tensor:
        w, b, rm, rv = self._shaped()
        scale = w * (rv + 1e-4).rsqrt()
        return self.act(self.drop(x * scale + (b - rm * scale)))


class NotABatchNorm(_Buffers):
    """The same buffers, but the mean is added, not subtracted: no batch norm."""

    def forward(self, x: Tensor) -> Tensor:
        w, b, rm, rv = self._shaped()
        return (x + rm) * w * (rv + 1e-5).rsqrt() + b


def _randomise(model: nn.Module) -> nn.Module:
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, _Buffers):
                m.weight.copy_(torch.rand(m.weight.shape, generator=g) + 0.5)
                m.bias.copy_(torch.randn(m.bias.shape, generator=g))
                m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=g))
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) * 0.01 + 1e-4)  # eps matters
    return model


def _net(frozen=ConstEpsFrozenBN2d, second=ConstEpsFrozenBN2dWide) -> nn.Module:
    torch.manual_seed(0)
    return _randomise(nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), frozen(4), nn.ReLU(),
                                    nn.Conv2d(4, 5, 3), second(5))).double()


def _x() -> Tensor:
    return torch.randn(2, 3, 6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def test_eps_is_read_from_what_the_module_computes() -> None:
    assert frozen_bn_ranks(ConstEpsFrozenBN2d(3)) == (4,)
    assert frozen_bn_ranks(ConstEpsFrozenNormAct2d(3)) == ()  # not a batch norm as a whole ...
    assert frozen_bn_eps(ConstEpsFrozenNormAct2d(3)) == 1e-4  # ... but before its children
    assert frozen_bn_eps(ConstEpsFrozenBN2d(3)) == 1e-5
    assert frozen_bn_eps(ConstEpsFrozenBN2dWide(3)) == 1e-3
    assert frozen_bn_reason(ConstEpsFrozenBN2d(3)) is None


def test_same_buffers_computing_something_else_is_not_recognised() -> None:
    assert frozen_bn_ranks(NotABatchNorm(3)) == ()
    reason = frozen_bn_reason(NotABatchNorm(3))
    assert reason is not None and "not eval-mode batch_norm" in reason and "1e-05" in reason, reason
    with pytest.raises(ValueError, match="_Buffers is not a frozen BatchNorm"):
        frozen_bn_eps(_Buffers(3))  # no forward at all: nothing to read


def test_convert_fuses_them_and_matches_eager() -> None:
    eager, x = _net(), _x()
    fast = convbn.convert(copy.deepcopy(eager), strategy="recompute_conv", example_inputs=x)
    report = assert_fused(fast, pairs=2, skipped=0)
    assert [(p.conv, p.bn, p.activation) for p in report.pairs] == [("0", "1", "relu"), ("3", "4", "identity")]
    assert {o.batchnorm: o.result for o in report.outcomes} == {"1": "fused", "4": "fused"}
    for step in range(2):
        xe, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
        g = torch.randn(2, 5, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
        out_e, out_f = eager(xe), fast(xf)
        assert_chain_ran(out_f)
        out_e.backward(g)
        out_f.backward(g)
        assert_close(out_f, out_e, **TOL)
        assert_close(xf.grad, xe.grad, **TOL)
        for (n, p), pe in zip(fast.named_parameters(), eager.parameters()):
            assert_close(p.grad, pe.grad, **TOL, msg=n)
            p.grad, pe.grad = None, None
        for (n, b), be in zip(fast.named_buffers(), eager.buffers()):
            assert torch.equal(b, be), n  # frozen: nothing updated


def test_a_frozen_norm_act_with_a_constant_eps_fuses_and_folds_keeping_its_tail() -> None:
    eager, x = _net(frozen=ConstEpsFrozenNormAct2d), _x()
    fast = convbn.convert(copy.deepcopy(eager), strategy="recompute_bn", example_inputs=x)
    report = assert_fused(fast, pairs=2, skipped=0)
    assert [(p.conv, p.bn) for p in report.pairs] == [("0", "1"), ("3", "4")], report
    xe, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_e, out_f = eager(xe), fast(xf)
    assert_chain_ran(out_f)
    out_e.sum().backward()
    out_f.sum().backward()
    assert_close(out_f, out_e, **TOL)
    assert_close(xf.grad, xe.grad, **TOL)
    for (n, p), pe in zip(fast.named_parameters(), eager.parameters()):
        assert_close(p.grad, pe.grad, **TOL, msg=n)
    folded = convbn.fold(eager.eval(), example_inputs=x)
    assert [(a.batchnorm, a.folded) for a in folded.convbn_report.outcomes] == [("1", True), ("4", True)]
    assert isinstance(dict(folded.named_modules())["1"].act, nn.Hardswish)  # the tail kept
    assert_close(folded(x), eager(x), **TOL)


def test_fold_folds_them_and_matches_eager() -> None:
    eager, x = _net().eval(), _x()
    folded = convbn.fold(eager, example_inputs=x)
    report = folded.convbn_report
    assert [(a.batchnorm, a.folded, a.layer) for a in report.outcomes] == [("1", True, "0"), ("4", True, "3")], report
    assert report.check.ran and report.check.passed
    assert not any(isinstance(m, _Buffers) for m in folded.modules())
    assert_close(folded(x), eager(x), **TOL)


def test_both_reports_list_a_lookalike_with_its_reason() -> None:
    eager, x = _net(second=NotABatchNorm), _x()
    fast = convbn.convert(copy.deepcopy(eager), strategy="recompute_conv", example_inputs=x)
    assert_fused(fast, pairs=2)  # conv 3 still fused, as a chain end without BatchNorm
    outcomes = {o.batchnorm: o for o in fast.convbn_report.outcomes}
    assert outcomes["1"].result == "fused"
    assert outcomes["4"].result == "left" and "NotABatchNorm" in outcomes["4"].reason, outcomes
    assert_close(fast(x), eager(x), **TOL)
    folded = convbn.fold(eager.eval(), example_inputs=x)
    outcomes = {o.batchnorm: o for o in folded.convbn_report.outcomes}
    assert outcomes["1"].result == "folded"
    assert outcomes["4"].result == "left" and "not eval-mode batch_norm" in outcomes["4"].reason, outcomes
    assert isinstance(folded[4], NotABatchNorm)
    assert_close(folded(x), eager(x), **TOL)
