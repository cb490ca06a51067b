"""Small adversarial models shared by the convert and fold tests.

Each is one pattern both passes must handle, and handle the same way where the pattern
means the same thing: a conv output with a second user, a BatchNorm module called twice,
a convolution written as ``F.conv2d`` on module parameters, a BatchNorm subclass doing
more than BatchNorm, and a model whose root cannot be traced. The tests that use them
(``test_convert.py``, ``test_fold.py``) assert what each pass does with them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["BNDoingMore", "ConvOutputUsedTwice", "DataDependent", "FunctionalConv", "SharedBN", "conv_bn_relu"]


def conv_bn_relu(cin: int, cout: int) -> nn.Sequential:
    """``Conv2d(3x3, padding 1) -> BatchNorm2d -> ReLU`` (children ``0``, ``1``, ``2``)."""
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU())


class ConvOutputUsedTwice(nn.Module):
    """The conv output feeds the BatchNorm and, directly, the residual sum: not fusable or foldable."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x: Tensor) -> Tensor:
        y = self.conv(x)
        return F.relu(self.bn(y)) + y


class SharedBN(nn.Module):
    """One BatchNorm module called after two different convs."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 3, 3, padding=1)
        self.c2 = nn.Conv2d(3, 3, 3, padding=1)
        self.bn = nn.BatchNorm2d(3)

    def forward(self, x: Tensor) -> Tensor:
        return self.bn(self.c2(F.relu(self.bn(self.c1(x)))))


class FunctionalConv(nn.Module):
    """efficientnet_pytorch style: convs are ``F.conv2d`` / ``torch.conv2d`` on module parameters
    (one with a bias and stride 2, one grouped, on a nested module's weight, with asymmetric padding)."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(4, 3, 3, 3) * 0.3)
        self.b1 = nn.Parameter(torch.randn(4))
        self.bn1 = nn.BatchNorm2d(4)
        self.inner = nn.Module()
        self.inner.w = nn.Parameter(torch.randn(6, 2, 1, 3) * 0.3)
        self.bn2 = nn.BatchNorm2d(6)

    def forward(self, x: Tensor) -> Tensor:
        y = F.relu(self.bn1(F.conv2d(x, self.w1, self.b1, 2, 1)))
        return self.bn2(torch.conv2d(y, self.inner.w, None, 1, (0, 1), 1, 2))


class BNDoingMore(nn.BatchNorm2d):
    """A BatchNorm subclass whose own forward does more than BatchNorm (through ``super().forward``)."""

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x) * 2.0 + 1.0


class DataDependent(nn.Module):
    """Untraceable root (Python control flow on a tensor value) with traceable children
    ``a`` (two conv-BN-ReLU), ``b`` (one, nested) and a lone BatchNorm ``bn`` the root calls."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(conv_bn_relu(3, 4), conv_bn_relu(4, 4))
        self.b = nn.Sequential(conv_bn_relu(4, 4))
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x: Tensor) -> Tensor:
        y = self.a(x)
        if x.sum() > 0:
            y = self.b(y)
        return self.bn(y)


class TransposedOutputSizeThenBN(nn.Module):
    """A transposed conv called with ``output_size=``: its output_padding depends on the input."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(3, 4, 3, stride=2, padding=1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(self.bn(self.up(x, output_size=[2 * x.shape[2], 2 * x.shape[3]])))
