"""Hand-written channel LayerNorms (``passes/bn/hand_layer_norms.py``) are recognised by their
graph pattern, fused with the convolution before them, and match the model's own code.

"Exact" here: the hand-written formula and ``F.layer_norm`` differ in rounding (Note: [a
hand-written LayerNorm computes as F.layer_norm after convert]), so every comparison runs in
float64 at the suite's tight tolerance (1e-10), never bit for bit.
"""
from __future__ import annotations

import copy
from typing import Callable

import pytest
import torch
import torch.fx as fx
from torch import nn

import convbn
from capture_helpers import assert_steps_match
from fusion_checks import assert_fused, fused_chains
from convbn.functional.norms import channel_layer_norm
from convbn.nn.norm_chain import FusedNormChain
from convbn.passes.bn.hand_layer_norms import hand_channel_layer_norms


class ConvNeXtLN(nn.Module):
    """ConvNeXt's original ``LayerNorm(data_format="channels_first")``."""

    def __init__(self, c: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight, self.bias, self.eps = nn.Parameter(torch.ones(c)), nn.Parameter(torch.zeros(c)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = x.mean(1, keepdim=True)
        s = (x - u).pow(2).mean(1, keepdim=True)
        x = (x - u) / torch.sqrt(s + self.eps)
        return self.weight[:, None, None] * x + self.bias[:, None, None]


class RsqrtLN(nn.Module):
    """lucidrains' ``LayerNorm``: ``var(unbiased=False)``, ``rsqrt``, a gain stored as (1, C, 1, 1)."""

    def __init__(self, c: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.g, self.eps = nn.Parameter(torch.ones(1, c, 1, 1)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = torch.var(x, dim=1, unbiased=False, keepdim=True)
        mean = torch.mean(x, dim=1, keepdim=True)
        return (x - mean) * (var + self.eps).rsqrt() * self.g


class ViewLN(nn.Module):
    """Other spellings: ``square``, ``** -0.5``, ``view`` / ``reshape`` of 1-D affine tensors, operands swapped."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.w, self.b = nn.Parameter(torch.ones(c)), nn.Parameter(torch.zeros(c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x - x.mean(dim=1, keepdim=True)
        v = torch.square(d).mean(dim=1, keepdim=True)
        return self.b.reshape(1, -1, 1, 1) + self.w.view(-1, 1, 1) * (d * (1e-5 + v) ** -0.5)


def _net(norm: Callable[[int], nn.Module]) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), norm(8), nn.GELU(), nn.Conv2d(8, 4, 1))


def _twins(norm: Callable[[int], nn.Module]) -> tuple:
    torch.manual_seed(0)
    eager = _net(norm).double()
    with torch.no_grad():
        for p in eager.parameters():  # affine parameters away from 1 / 0
            p.add_(torch.randn_like(p) * 0.1)
    return eager, copy.deepcopy(eager)


HAND = {"convnext": ConvNeXtLN, "rsqrt-var": RsqrtLN, "view-square-pow": ViewLN}


@pytest.mark.parametrize("strategy", ["recompute_conv", "auto"])
@pytest.mark.parametrize("name", sorted(HAND))
def test_hand_written_channel_layer_norm_fuses_and_matches_its_code(name: str, strategy: str) -> None:
    eager, work = _twins(HAND[name])
    state = {k: v.clone() for k, v in eager.state_dict().items()}
    fast = convbn.convert(work, strategy=strategy)
    report = assert_fused(fast, pairs=2, chains=1)  # the second conv ends the chain
    assert [(o.batchnorm, o.result, o.layer) for o in report.outcomes] == [("1", "fused", "0")]
    assert all(isinstance(c, FusedNormChain) for c in fused_chains(fast))
    assert list(fast.state_dict()) == list(state)
    assert_steps_match(eager, fast, torch.randn(2, 3, 7, 7, dtype=torch.float64), steps=2)


def _graph_of(model: nn.Module) -> fx.GraphModule:
    return fx.symbolic_trace(model)


@pytest.mark.parametrize("name", sorted(HAND))
def test_the_pattern_becomes_one_channel_layer_norm_on_the_module_tensors(name: str) -> None:
    norm = HAND[name](8).double()
    gm = _graph_of(norm)
    assert hand_channel_layer_norms(gm) == 1
    calls = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
    assert [n.target for n in calls] == [channel_layer_norm]  # nothing of the formula is left
    x = torch.randn(2, 8, 5, 5, dtype=torch.float64)
    torch.testing.assert_close(gm(x), norm(x), rtol=1e-12, atol=1e-12)


class Unbiased(RsqrtLN):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # Bessel-corrected variance: not a LayerNorm
        return (x - x.mean(1, keepdim=True)) * (x.var(1, keepdim=True) + self.eps).rsqrt() * self.g


class OverRows(ConvNeXtLN):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # statistics over dim 2: not the channels
        u = x.mean(2, keepdim=True)
        return self.weight[:, None, None] * ((x - u) / torch.sqrt((x - u).pow(2).mean(2, keepdim=True) + self.eps))


class NoEps(ConvNeXtLN):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # eps inside the mean's difference, not the variance
        u = x.mean(1, keepdim=True)
        return self.weight[:, None, None] * ((x - u) / torch.sqrt((x - u).pow(2).mean(1, keepdim=True)))


class SpatialGain(ConvNeXtLN):
    def __init__(self, c: int) -> None:
        super().__init__(c)
        self.weight = nn.Parameter(torch.ones(7, 1))  # broadcast over the width, not the channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = x.mean(1, keepdim=True)
        return (x - u) / torch.sqrt((x - u).pow(2).mean(1, keepdim=True) + self.eps) * self.weight


@pytest.mark.expect_unfused("look-alikes of a channel LayerNorm: nothing to fuse")
@pytest.mark.parametrize("cls", [Unbiased, OverRows, NoEps, SpatialGain])
def test_look_alikes_are_left_as_written(cls: type) -> None:
    torch.manual_seed(0)
    norm = cls(8).double()
    eager = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), norm, nn.GELU()).double()
    fast = convbn.convert(copy.deepcopy(eager))
    x = torch.randn(2, 3, 7, 7, dtype=torch.float64)
    assert not fast.convbn_report.pairs
    assert hand_channel_layer_norms(fx.symbolic_trace(eager)) == 0  # the conv before it gives the input's rank
    assert torch.equal(fast(x), eager(x))  # the model's own code runs, bit for bit
