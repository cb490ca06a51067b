"""Subclasses of Linear / Conv whose ``forward`` is their own (a masked Linear before a real
BatchNorm1d, a convolution of a masked weight) are not folded or fused as their base class:
fold leaves the pair (the weight the forward computes is not a stored one), convert fuses it
with the weight the forward computes where it traces through the forward, and leaves a hooked
one; the result is exact and the report says why."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import convbn
from bn_calls import eager_bn_calls
from capture_helpers import randomise_batchnorms


class MaskedLinear(nn.Linear):
    def __init__(self, i: int, o: int) -> None:
        super().__init__(i, o)
        self.register_buffer("mask", (torch.rand(o, i) > 0.5).to(self.weight.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight * self.mask, self.bias)


class MaskedConv(nn.Conv2d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._conv_forward(x, self.weight.tril(), self.bias)


class Net(nn.Module):
    def __init__(self, hooked: bool) -> None:
        super().__init__()
        self.lin, self.bn1 = MaskedLinear(8, 16), nn.BatchNorm1d(16)
        self.conv, self.bn2 = MaskedConv(1, 4, 3), nn.BatchNorm2d(4)
        if hooked:  # a leaf module call, not traced into
            self.lin.register_forward_hook(lambda *a: None)
            self.conv.register_forward_hook(lambda *a: None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.lin(x)))
        z = self.bn2(self.conv(x.view(-1, 1, 2, 4).repeat(1, 1, 2, 2)))
        return y.sum(1) + z.mean((1, 2, 3))


@pytest.mark.parametrize("hooked", [False, True])
@pytest.mark.parametrize("with_inputs", [False, True])
@pytest.mark.expect_unfused("nothing here may fold or fuse")
def test_own_forward_layers_are_not_their_base_class(hooked: bool, with_inputs: bool) -> None:
    torch.manual_seed(0)
    model = randomise_batchnorms(Net(hooked)).eval()
    x = torch.randn(6, 8, dtype=torch.float64)
    expected = model(x).detach()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no check of fold's may have found a difference
        folded = convbn.fold(model, example_inputs=x if with_inputs else None)
    report = folded.convbn_report
    assert not report.folded, report
    assert all("overrides forward" in o.reason or "computed in forward" in o.reason for o in report.skipped), report
    torch.testing.assert_close(folded(x), expected, rtol=1e-12, atol=1e-12)
    model.train()
    fast = convbn.convert(copy.deepcopy(model), example_inputs=x if with_inputs else None)
    fused = [o.batchnorm for o in fast.convbn_report.outcomes if o.result == "fused"]
    if hooked:  # leaf module calls: their own forward runs, hooks and all
        assert not fused, fast.convbn_report
        assert eager_bn_calls(fast, x) == 2
        return
    # traced through, the masked weights are weights the model computes from its parameters
    # (convbn/nn/computed_weight.py): the layers fuse and compute what the model's forward does
    assert fused == ["bn1", "bn2"], fast.convbn_report
    xe, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_e, out_f = model(xe), fast(xf)
    out_e.sum().backward()
    out_f.sum().backward()
    torch.testing.assert_close(out_f, out_e, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(xf.grad, xe.grad, rtol=1e-12, atol=1e-12)
    for (n, p), q in zip(fast.named_parameters(), model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12, msg=lambda m: f"{n}: {m}")
