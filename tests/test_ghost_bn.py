"""A ghost BatchNorm (one BatchNorm called on each piece of a tensor in a Python loop) is left by
both passes, and both reports say so in those words rather than only that its module could
not be traced; the model computes what eager computes."""
from __future__ import annotations

import copy

import torch
from torch import Tensor, nn
from torch.testing import assert_close

import convbn


class GhostComprehension(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x: Tensor) -> Tensor:
        x = self.conv(x)
        return torch.cat([self.bn(c) for c in x.chunk(2)])


class GhostLoop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm2d(4)

    def forward(me, x: Tensor) -> Tensor:  # noqa: N805 - ``self`` by another name
        out = []
        for piece in torch.split(x, 1):
            out.append(me.norm(piece))
        return torch.cat(out)


class LoopWithoutBN(nn.Module):
    """A loop over chunks that calls a conv; its BatchNorm runs once, after the loop."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x: Tensor) -> Tensor:
        return self.bn(torch.cat([self.conv(c) for c in x.chunk(2)]))


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(GhostComprehension(), GhostLoop(), LoopWithoutBN(), nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4))


def _reasons(outcomes) -> dict:
    return {o.batchnorm: (o.result, o.reason) for o in outcomes}


def test_both_reports_name_a_ghost_batchnorm_loop() -> None:
    eager, x = _net(), torch.randn(4, 3, 8, 8)
    fast = convbn.convert(copy.deepcopy(eager), example_inputs=x)
    got = _reasons(fast.convbn_report.outcomes)
    assert got["4"][0] == "fused"
    assert got["0.bn"] == ("left", got["0.bn"][1])
    assert got["0.bn"][1].startswith("ghost BatchNorm: GhostComprehension.forward calls self.bn on each piece "
                                     "of a tensor's chunk()"), got
    assert got["1.norm"][1].startswith("ghost BatchNorm: GhostLoop.forward calls self.norm on each piece of a "
                                       "tensor's split()"), got
    # not a ghost loop: traced with the example's shapes, its BatchNorm reads a concatenation of one conv's calls
    assert got["2.bn"][0] == "left" and not got["2.bn"][1].startswith("ghost"), got
    assert_close(fast(x), eager(x))
    folded = convbn.fold(eager.eval(), example_inputs=x)
    got = _reasons(folded.convbn_report.outcomes)
    assert got["4"][0] == "folded"
    # fold traces with the example's shapes, which unrolls the loops: in eval the pieces' BatchNorm has
    # no conv beside it (a piece of the input before it, a concatenation after it)
    assert got["0.bn"] == ("left", "before it: 'getitem_1' (getitem) is not a conv/linear layer; "
                                   "after it: 'cat' (cat) is not a conv/linear layer"), got
    assert got["1.norm"][0] == "left" and "after it: 'cat' (cat) is not a conv/linear layer" in got["1.norm"][1], got
    assert not got["2.bn"][1].startswith("ghost"), got
    assert_close(folded(x), eager(x))
