"""A module that iterates ``torch.split(x, c // r, 1)``, ``c`` read off ``x.shape`` (ResNeSt's split
attention): symbolic tracing cannot say how many pieces there are, so the module stayed opaque and
its Conv -> BN -> ReLU and its 1x1 Conv -> BN -> ReLU unfused. A trace with real shapes (with
``example_inputs``, or the first call's capture without) knows the pieces; both BatchNorms fuse
and the converted model trains as eager does, float64, over two steps."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import convbn
from capture_helpers import assert_steps_match, twins
from fusion_checks import assert_fused


class SplitAttention(nn.Module):
    """Conv -> BN -> ReLU, split into ``radix`` pieces by a size read off the shape, their sum pooled
    into Conv 1x1 -> BN -> ReLU -> Conv 1x1, a softmax over the pieces weighting each."""

    def __init__(self, channels: int = 4, radix: int = 2) -> None:
        super().__init__()
        self.radix = radix
        self.conv = nn.Conv2d(channels, channels * radix, 3, padding=1, groups=radix)
        self.bn0 = nn.BatchNorm2d(channels * radix)
        self.fc1 = nn.Conv2d(channels, 8, 1)
        self.bn1 = nn.BatchNorm2d(8)
        self.fc2 = nn.Conv2d(8, channels * radix, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn0(self.conv(x)))
        batch, rchannel = x.shape[:2]
        pieces = torch.split(x, rchannel // self.radix, dim=1)
        gap = F.adaptive_avg_pool2d(sum(pieces), 1)
        gap = F.relu(self.bn1(self.fc1(gap)))
        atten = self.fc2(gap).view(batch, self.radix, -1).softmax(1).reshape(batch, -1, 1, 1)
        weights = torch.split(atten, rchannel // self.radix, dim=1)
        return sum([w * p for w, p in zip(weights, pieces)])


def _x() -> torch.Tensor:
    return torch.randn(3, 4, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def test_split_by_a_shape_read_fuses_with_example_inputs() -> None:
    eager, fast = twins(SplitAttention)
    x = _x()
    fast = convbn.convert(fast, example_inputs=x)
    assert_fused(fast, chains=2, skipped=0)
    assert_steps_match(eager, fast, x)


def test_split_by_a_shape_read_fuses_on_the_first_call() -> None:
    eager, fast = twins(SplitAttention)
    x = _x()
    fast = convbn.convert(fast)
    assert_steps_match(eager, fast, x, fused=False)  # the first call captures (and checks) it
    assert_fused(fast, chains=2, skipped=0)
    assert_steps_match(eager, fast, x)


class Listed(nn.Module):
    """Conv -> BN -> ReLU split into sizes the code lists: iterable in a plain symbolic trace."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 8, 3, padding=1)
        self.bn0 = nn.BatchNorm2d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn0(self.conv(x)))
        return sum(torch.split(x, [4, 4], dim=1))


def test_split_into_listed_sizes_still_fuses_at_convert() -> None:
    """The other way the tracer knows a split's length (sizes listed in the code) is untouched:
    fused by convert itself, without inputs."""
    eager, fast = twins(Listed)
    fast = convbn.convert(fast)
    assert_fused(fast, chains=1, skipped=0)
    assert_steps_match(eager, fast, _x())
