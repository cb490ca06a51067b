"""A child whose forward computes its padding from the input's shape (a TF-"SAME" convolution
subclass) hides its convolution from a symbolic trace of the parent; with ``example_inputs``
the parent is traced again with real shapes and its BatchNorm fuses / folds (Note: [opaque
children traced again with real shapes]); a child that does not trace even so keeps the
symbolic trace, and the parent's other layers still fuse."""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.testing import assert_close

import convbn
from capture_helpers import TIGHT as TOL, assert_steps_match, randomise_batchnorms
from fusion_checks import assert_fused


class SameConv2d(nn.Conv2d):
    """TensorFlow "SAME" padding computed from each input's size (as EfficientNet ports write it)."""

    def __init__(self, cin: int, cout: int, k: int, stride: int = 1) -> None:
        super().__init__(cin, cout, k, stride, 0, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        ih, iw = x.size()[-2:]
        kh, kw = self.weight.size()[-2:]
        oh, ow = math.ceil(ih / self.stride[0]), math.ceil(iw / self.stride[1])
        pad_h = max((oh - 1) * self.stride[0] + kh - ih, 0)
        pad_w = max((ow - 1) * self.stride[1] + kw - iw, 0)
        if pad_h > 0 or pad_w > 0:
            x = F.pad(x, [pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2])
        return F.conv2d(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)


class DataGate(nn.Module):
    """A child whose branch depends on values: no trace captures it."""

    def forward(self, x: Tensor) -> Tensor:
        return x * 2 if bool(x.sum() > 0) else x


class SameNet(nn.Module):
    def __init__(self, gate: bool = False) -> None:
        super().__init__()
        self.c1, self.b1 = SameConv2d(3, 6, 3, stride=2), nn.BatchNorm2d(6)
        self.c2, self.b2 = nn.Conv2d(6, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6)
        self.gate = DataGate() if gate else nn.Identity()
        self.c3, self.b3 = SameConv2d(6, 4, 3), nn.BatchNorm2d(4)

    def forward(self, x: Tensor) -> Tensor:
        y = F.relu(self.b1(self.c1(x)))
        y = self.gate(F.relu(self.b2(self.c2(y))))
        return F.relu(self.b3(self.c3(y)))


def test_same_padding_children_fuse_and_fold_with_example_inputs() -> None:
    eager = randomise_batchnorms(SameNet())
    x = torch.randn(2, 3, 11, 10, dtype=torch.float64)
    fast = convbn.convert(copy.deepcopy(eager), strategy="recompute_conv", example_inputs=x)
    report = assert_fused(fast, skipped=0)
    assert sorted((p.conv, p.bn) for p in report.pairs if p.bn) == [("c1", "b1"), ("c2", "b2"), ("c3", "b3")]
    assert_steps_match(eager, fast, x)
    eager.eval()
    folded = convbn.fold(copy.deepcopy(eager), example_inputs=x)
    assert sorted((o.batchnorm, o.result) for o in folded.convbn_report.outcomes) == [
        ("b1", "folded"), ("b2", "folded"), ("b3", "folded")]
    assert_close(folded(x), eager(x), **TOL)


def test_other_shapes_run_correctly_after_a_shaped_capture() -> None:
    eager = randomise_batchnorms(SameNet())
    x = torch.randn(2, 3, 11, 10, dtype=torch.float64)
    fast = convbn.convert(copy.deepcopy(eager), strategy="recompute_conv", example_inputs=x)
    other = torch.randn(3, 3, 8, 13, dtype=torch.float64)
    assert_close(fast(other), eager(other), **TOL)
    assert_close(fast.eval()(other), eager.eval()(other), **TOL)


@pytest.mark.filterwarnings("ignore")
def test_a_child_that_never_traces_keeps_the_symbolic_trace() -> None:
    eager = randomise_batchnorms(SameNet(gate=True))
    x = torch.randn(2, 3, 11, 10, dtype=torch.float64)
    fast = convbn.convert(copy.deepcopy(eager), strategy="recompute_conv", example_inputs=x)
    outcomes = {o.batchnorm: o.result for o in fast.convbn_report.outcomes}
    assert outcomes["b2"] == "fused", fast.convbn_report
    assert_close(fast(x), eager(x), **TOL)


def test_same_padding_children_fuse_on_the_first_call_without_example_inputs() -> None:
    eager = randomise_batchnorms(SameNet())
    x = torch.randn(2, 3, 11, 10, dtype=torch.float64)
    fast = convbn.convert(copy.deepcopy(eager), strategy="recompute_conv")
    first_f, first_e = fast(x.clone()), eager(x.clone())  # captured with real shapes, checked against eager
    assert_close(first_f, first_e, **TOL)
    report = assert_fused(fast, skipped=0)
    assert sorted((p.conv, p.bn) for p in report.pairs if p.bn) == [("c1", "b1"), ("c2", "b2"), ("c3", "b3")]
    assert_steps_match(eager, fast, x)
