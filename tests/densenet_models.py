"""Pre-activation DenseNet-BC replicas for the concatenation tests and benchmarks.

Written for the tests from the paper's description (Huang et al., "Densely Connected
Convolutional Networks", 2017: bottleneck BN-ReLU-Conv1x1 (``bn_size * growth_rate``
channels) then BN-ReLU-Conv3x3 (``growth_rate`` channels), compression transitions
BN-ReLU-Conv1x1-AvgPool), in the two ways real code writes the concatenation:

* ``style="list"`` (torchvision's way): a dense block keeps a Python list of every
  feature map and each layer concatenates that list, ``torch.cat(features, 1)``;
  ``memory_efficient=True`` runs concatenation + BN + ReLU + 1x1 conv of each layer under
  :func:`torch.utils.checkpoint.checkpoint`, as torchvision's ``memory_efficient`` does
  (which updates BN running statistics twice per step);
* ``style="nested"`` (MONAI's way): each layer returns ``torch.cat([x, new], 1)``, so the
  next layer's input is a concatenation of the previous concatenation.

Both build the same parameters in the same order from the same seed, so their outputs
are equal; ``spatial_dims`` 1, 2 or 3.
"""
from __future__ import annotations

from typing import List, Sequence

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

__all__ = ["DenseNetBC", "make_densenet_bc"]

_CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
_BN = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}
_AVG = {1: nn.AvgPool1d, 2: nn.AvgPool2d, 3: nn.AvgPool3d}
_ADAPTIVE = {1: nn.AdaptiveAvgPool1d, 2: nn.AdaptiveAvgPool2d, 3: nn.AdaptiveAvgPool3d}


class _Bottleneck(nn.Module):
    """BN -> ReLU -> 1x1 conv -> BN -> ReLU -> 3x3 conv (the children of one dense layer)."""

    def __init__(self, dims: int, in_ch: int, growth_rate: int, bn_size: int) -> None:
        super().__init__()
        self.norm1 = _BN[dims](in_ch)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv1 = _CONV[dims](in_ch, bn_size * growth_rate, 1, bias=False)
        self.norm2 = _BN[dims](bn_size * growth_rate)
        self.relu2 = nn.ReLU(inplace=True)
        self.conv2 = _CONV[dims](bn_size * growth_rate, growth_rate, 3, padding=1, bias=False)

    def head(self, x: Tensor) -> Tensor:
        return self.conv1(self.relu1(self.norm1(x)))

    def tail(self, y: Tensor) -> Tensor:
        return self.conv2(self.relu2(self.norm2(y)))


class _ListLayer(_Bottleneck):
    """torchvision-style layer: takes the list of earlier features, returns the new one."""

    def __init__(self, dims: int, in_ch: int, growth_rate: int, bn_size: int, memory_efficient: bool) -> None:
        super().__init__(dims, in_ch, growth_rate, bn_size)
        self.memory_efficient = memory_efficient

    def _concat_head(self, *features: Tensor) -> Tensor:
        return self.head(torch.cat(features, 1))

    def forward(self, features: List[Tensor]) -> Tensor:
        if self.memory_efficient and torch.is_grad_enabled():
            y = checkpoint(self._concat_head, *features, use_reentrant=False)
        else:
            y = self._concat_head(*features)
        return self.tail(y)


class _ListBlock(nn.ModuleList):
    def forward(self, x: Tensor) -> Tensor:
        features = [x]
        for layer in self:
            features.append(layer(features))
        return torch.cat(features, 1)


class _NestedLayer(_Bottleneck):
    """MONAI-style layer: returns the concatenation of its input and its new features."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([x, self.tail(self.head(x))], 1)


class _Transition(nn.Sequential):
    def __init__(self, dims: int, in_ch: int, out_ch: int) -> None:
        super().__init__()
        self.add_module("norm", _BN[dims](in_ch))
        self.add_module("relu", nn.ReLU(inplace=True))
        self.add_module("conv", _CONV[dims](in_ch, out_ch, 1, bias=False))
        self.add_module("pool", _AVG[dims](2))


class DenseNetBC(nn.Module):
    """A pre-activation DenseNet-BC.

    Args:
        growth_rate: channels each dense layer adds (``k``).
        block_config: layers per dense block.
        num_init_features: channels of the stem convolution.
        bn_size: bottleneck width as a multiple of ``growth_rate``.
        compression: transition output channels / input channels.
        num_classes: classifier outputs.
        in_channels: input channels.
        spatial_dims: 1, 2 or 3.
        style: ``"list"`` (torchvision's list of features) or ``"nested"`` (MONAI's ``cat([x, new])``).
        memory_efficient: ``style="list"`` only: checkpoint concatenation + BN + ReLU + 1x1 conv per layer.

    Example:
        >>> model = DenseNetBC(growth_rate=4, block_config=(2, 2))
        >>> model(torch.randn(2, 3, 16, 16)).shape
        torch.Size([2, 10])
    """

    def __init__(self, growth_rate: int = 4, block_config: Sequence[int] = (2, 2), num_init_features: int = 8,
                 bn_size: int = 2, compression: float = 0.5, num_classes: int = 10, in_channels: int = 3,
                 spatial_dims: int = 2, style: str = "list", memory_efficient: bool = False) -> None:
        super().__init__()
        if style not in ("list", "nested"):
            raise ValueError(f"style must be 'list' or 'nested', but got style={style!r}")
        if memory_efficient and style != "list":
            raise ValueError("memory_efficient=True needs style='list' (it checkpoints the list concatenation)")
        dims = spatial_dims
        self.features = nn.Sequential()
        self.features.add_module("conv0", _CONV[dims](in_channels, num_init_features, 3, padding=1, bias=False))
        ch = num_init_features
        for b, n_layers in enumerate(block_config):
            if style == "list":
                block: nn.Module = _ListBlock(
                    [_ListLayer(dims, ch + i * growth_rate, growth_rate, bn_size, memory_efficient) for i in range(n_layers)])
            else:
                block = nn.Sequential(*[_NestedLayer(dims, ch + i * growth_rate, growth_rate, bn_size)
                                        for i in range(n_layers)])
            self.features.add_module(f"denseblock{b + 1}", block)
            ch += n_layers * growth_rate
            if b != len(block_config) - 1:
                out = int(ch * compression)
                self.features.add_module(f"transition{b + 1}", _Transition(dims, ch, out))
                ch = out
        self.features.add_module("norm5", _BN[dims](ch))
        self.relu = nn.ReLU()
        self.pool = _ADAPTIVE[dims](1)
        self.classifier = nn.Linear(ch, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.pool(self.relu(self.features(x)))
        return self.classifier(torch.flatten(x, 1))


def make_densenet_bc(seed: int = 0, **kwargs: object) -> DenseNetBC:
    """A :class:`DenseNetBC` with weights drawn from ``seed`` and non-trivial BN affine parameters."""
    torch.manual_seed(seed)
    model = DenseNetBC(**kwargs)  # type: ignore[arg-type]
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
    return model
