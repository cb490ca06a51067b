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
from capture_helpers import assert_steps_match, perturbed_twins
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


HAND = {"convnext": ConvNeXtLN, "rsqrt-var": RsqrtLN, "view-square-pow": ViewLN}


@pytest.mark.parametrize("strategy", ["recompute_conv", "auto"])
@pytest.mark.parametrize("name", sorted(HAND))
def test_hand_written_channel_layer_norm_fuses_and_matches_its_code(name: str, strategy: str) -> None:
    eager, work = perturbed_twins(lambda: _net(HAND[name]))
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


# --------------------------------------------------------------------------- transposed affine, global statistics

class TransposedLN(nn.Module):
    """asteroid's ``_LayerNorm`` spelling: statistics over dims ``1`` (``ChanLN``, "cLN") or
    ``1 .. rank - 1`` (``GlobLN``, "gLN"), the affine over the last dimension between transposes."""

    def __init__(self, c: int, dims: tuple = (1,), eps: float = 1e-8) -> None:
        super().__init__()
        self.gamma, self.beta = nn.Parameter(torch.ones(c)), nn.Parameter(torch.zeros(c))
        self.dims, self.eps = list(dims), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(dim=self.dims, keepdim=True)
        var = torch.var(x, dim=self.dims, keepdim=True, unbiased=False)
        normed = (x - mean) / (var + self.eps).sqrt()
        return (self.gamma * normed.transpose(1, -1) + self.beta).transpose(1, -1)


def _tasnet_block(norm: Callable[[int], nn.Module]) -> nn.Module:
    """Conv-TasNet's block shape: Conv1d -> PReLU -> norm -> depthwise Conv1d -> PReLU -> norm -> Conv1d."""
    return nn.Sequential(nn.Conv1d(3, 8, 1), nn.PReLU(), norm(8), nn.Conv1d(8, 8, 3, padding=1, groups=8),
                         nn.PReLU(), norm(8), nn.Conv1d(8, 4, 1))


TRANSPOSED = {"channel": lambda c: TransposedLN(c), "global": lambda c: TransposedLN(c, dims=(1, 2))}


@pytest.mark.parametrize("example", [True, False])
@pytest.mark.parametrize("name", sorted(TRANSPOSED))
def test_transposed_affine_and_global_layer_norms_fuse_and_match_their_code(name: str, example: bool) -> None:
    torch.manual_seed(0)
    eager = _tasnet_block(TRANSPOSED[name]).double()
    with torch.no_grad():
        for p in eager.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    x = torch.randn(2, 3, 11, dtype=torch.float64)
    fast = convbn.convert(copy.deepcopy(eager), example_inputs=(x,) if example else None)
    fused = {o.batchnorm for o in fast.convbn_report.outcomes if o.result == "fused"}
    assert fused == {"2", "5"}  # both norms, each the head of the conv that reads it
    assert all(isinstance(c, FusedNormChain) for c in fused_chains(fast))
    assert_steps_match(eager, fast, x, steps=2)


@pytest.mark.parametrize("name", sorted(TRANSPOSED))
def test_the_transposed_pattern_becomes_one_norm_node(name: str) -> None:
    eager = _tasnet_block(TRANSPOSED[name]).double()
    gm = _graph_of(eager)
    assert hand_channel_layer_norms(gm) == 2
    norms = [n.target for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
    assert norms == [channel_layer_norm if name == "channel" else torch.nn.functional.group_norm] * 2
    x = torch.randn(2, 3, 11, dtype=torch.float64)
    torch.testing.assert_close(gm(x), eager(x), rtol=1e-12, atol=1e-12)


class PartialStats(TransposedLN):
    """Statistics over dims 1 and 2 of a 4-D tensor: not every dimension after the batch's."""

    def __init__(self, c: int) -> None:
        super().__init__(c, dims=(1, 2))


class TransposedElsewhere(TransposedLN):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # affine over dim 2 (transpose(1, 2)), not the channels
        mean = x.mean(dim=1, keepdim=True)
        normed = (x - mean) / (torch.var(x, dim=1, keepdim=True, unbiased=False) + self.eps).sqrt()
        return (self.gamma * normed.transpose(2, -1) + self.beta).transpose(2, -1)


@pytest.mark.expect_unfused("look-alikes of a LayerNorm: nothing to fuse")
@pytest.mark.parametrize("cls", [PartialStats, TransposedElsewhere])
def test_transposed_look_alikes_are_left_as_written(cls: type) -> None:
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Conv2d(3, 7, 3, padding=1), cls(7), nn.GELU()).double()
    assert hand_channel_layer_norms(fx.symbolic_trace(eager)) == 0
    fast = convbn.convert(copy.deepcopy(eager))
    x = torch.randn(2, 3, 7, 7, dtype=torch.float64)
    assert not fast.convbn_report.pairs
    assert torch.equal(fast(x), eager(x))
