"""A norm chain whose last layer is a convolution with a PReLU and no norm (``norm -> conv ->
PReLU``: a pre-activation head, then the end layer): its PReLU weight's gradient goes to its own
slot among the chain's parameters (an end layer has no norm slots). Found by the sweep on
asteroid's Conv-TasNet, whose blocks are Conv1d -> PReLU -> norm -> depthwise Conv1d -> PReLU."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import convbn
from capture_helpers import assert_steps_match
from fusion_checks import fused_chains
from convbn.nn.norm_chain import FusedNormChain


def _net() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.GroupNorm(2, 8), nn.Conv1d(8, 16, 3, padding=1), nn.PReLU(16)).double()
    with torch.no_grad():
        net[2].weight.uniform_(0.1, 0.5)  # a slope per channel, each one's gradient its own
    return net


@pytest.mark.parametrize("strategy", ["recompute_conv", "recompute_bn"])  # auto may keep it eager: not lower
@pytest.mark.parametrize("example", [True, False])
def test_an_end_layer_with_a_prelu_trains_as_eager(example: bool, strategy: str) -> None:
    eager = _net()
    x = torch.randn(2, 8, 256, dtype=torch.float64)
    fast = convbn.convert(copy.deepcopy(eager), strategy=strategy, example_inputs=(x,) if example else None)
    assert [(o.batchnorm, o.result) for o in fast.convbn_report.outcomes] == [("0", "fused")]
    (chain,) = fused_chains(fast)
    assert isinstance(chain, FusedNormChain)
    end = chain.layers[-1]
    assert end.conv is not None and end.bn is None and end.tail_params()  # the end layer: conv -> PReLU
    assert_steps_match(eager, fast, x, steps=2)  # outputs, input and every parameter's gradient (the PReLU's too)
