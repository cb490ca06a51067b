"""A crop of a convolution's output before its BatchNorm (causal convolutions: pad both sides,
drop the extra outputs): convert fuses and fold folds it as the convolution with less padding
(Note: [a crop of a convolution's output is less padding]); crops the padding cannot absorb
stay as they are and the BatchNorm is left with a reason."""
from __future__ import annotations

import copy
from typing import Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.testing import assert_close

import convbn
from capture_helpers import TIGHT as TOL, assert_steps_match, randomise_batchnorms
from fusion_checks import assert_fused


class CausalConv1d(nn.Conv1d):
    """A causal convolution written as EEG / audio libraries do: padded both sides, cropped."""

    def __init__(self, cin: int, cout: int, k: int, dilation: int = 1) -> None:
        super().__init__(cin, cout, k, padding=(k - 1) * dilation, dilation=dilation)

    def forward(self, x: Tensor) -> Tensor:
        out = F.conv1d(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)
        return out[..., : -self.padding[0]]


class Chomp(nn.Module):
    """Drops the last ``size`` time steps (a module after an ``nn.Conv1d``)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size

    def forward(self, x: Tensor) -> Tensor:
        return x[:, :, : -self.size].contiguous()


class TemporalBlock(nn.Module):
    """causal conv -> BN -> relu -> conv -> chomp -> BN -> relu, plus the residual."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.b1 = CausalConv1d(3, 6, 3, dilation=2), nn.BatchNorm1d(6)
        self.c2, self.chomp, self.b2 = nn.Conv1d(6, 6, 3, padding=2, bias=False), Chomp(2), nn.BatchNorm1d(6)

    def forward(self, x: Tensor) -> Tensor:
        y = F.relu(self.b1(self.c1(x)))
        return F.relu(self.b2(self.chomp(self.c2(y)))) + x.mean(1, keepdim=True)


class Cropped2d(nn.Module):
    """A strided 2-D convolution whose output is cropped on both sides of both spatial dims."""

    def __init__(self, crop: Tuple[slice, slice]) -> None:
        super().__init__()
        self.crop = crop
        self.conv, self.bn = nn.Conv2d(3, 4, 3, stride=2, padding=2), nn.BatchNorm2d(4)

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(self.bn(self.conv(x)[(slice(None), slice(None), *self.crop)]))


@pytest.mark.parametrize("with_inputs", [True, False])
def test_causal_conv_crops_fuse_and_fold(with_inputs: bool) -> None:
    eager = randomise_batchnorms(TemporalBlock())
    x = torch.randn(4, 3, 16, dtype=torch.float64)
    fast = convbn.convert(copy.deepcopy(eager), example_inputs=x if with_inputs else None)
    if not with_inputs:  # the first call checks the rewrite against the eager modules (on both sides)
        fast(x.clone()), eager(x.clone())
    report = assert_fused(fast, skipped=0)
    assert sorted((p.conv, p.bn) for p in report.pairs if p.bn) == [("c1", "b1"), ("c2", "b2")], report
    assert_steps_match(eager, fast, x)
    eager.eval()
    folded = convbn.fold(copy.deepcopy(eager), example_inputs=x)
    assert sorted((o.batchnorm, o.result, o.layer) for o in folded.convbn_report.outcomes) == [
        ("b1", "folded", "c1"), ("b2", "folded", "c2")]
    assert_close(folded(x), eager(x), **TOL)


@pytest.mark.parametrize("crop", [(slice(1, -1), slice(1, None)), (slice(None, -1), slice(1, -1))])
def test_strided_2d_crops_fuse_and_fold(crop: Tuple[slice, slice]) -> None:
    eager = randomise_batchnorms(Cropped2d(crop))
    x = torch.randn(2, 3, 9, 8, dtype=torch.float64)
    fast = convbn.convert(copy.deepcopy(eager), strategy="recompute_conv", example_inputs=x)
    assert_fused(fast, pairs=1, skipped=0)
    assert_steps_match(eager, fast, x)
    eager.eval()
    folded = convbn.fold(copy.deepcopy(eager), example_inputs=x)
    assert [o.result for o in folded.convbn_report.outcomes] == ["folded"]
    assert_close(folded(x), eager(x), **TOL)


@pytest.mark.expect_unfused("crops the padding cannot absorb stay crops; the BatchNorm is left")
@pytest.mark.parametrize("crop", [
    (slice(2, None), slice(None)),  # 2 outputs * stride 2 = 4 > padding 2: reaches into the input
    (slice(None, 3), slice(None)),  # a positive stop needs the output's length
    (slice(None, None, 2), slice(None)),  # a step
])
def test_crops_the_padding_cannot_absorb_are_left(crop: Tuple[slice, slice]) -> None:
    eager = randomise_batchnorms(Cropped2d(crop))
    x = torch.randn(2, 3, 9, 8, dtype=torch.float64)
    fast = convbn.convert(copy.deepcopy(eager), example_inputs=x)
    (left,) = fast.convbn_report.outcomes
    assert left.result == "left" and "getitem" in left.reason, left
    assert_steps_match(eager, fast, x, fused=False)
    eager.eval()
    folded = convbn.fold(copy.deepcopy(eager), example_inputs=x)
    assert [o.result for o in folded.convbn_report.outcomes] == ["left"]
    assert_close(folded(x), eager(x), **TOL)


def test_a_hooked_conv_keeps_its_module_call() -> None:
    eager = randomise_batchnorms(TemporalBlock())
    seen = []
    eager.c2.register_forward_hook(lambda m, a, out: seen.append(out.shape))
    x = torch.randn(4, 3, 16, dtype=torch.float64)
    fast = convbn.convert(copy.deepcopy(eager), example_inputs=x)
    seen.clear()
    assert_close(fast(x), eager(x), **TOL)
    assert len(seen) == 2, "the hooked convolution must still be called as a module"
    assert {o.batchnorm: o.result for o in fast.convbn_report.outcomes}["b1"] == "fused"
