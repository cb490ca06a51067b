"""``FusedConvGroupNorm{1,2,3}d`` / ``FusedConvInstanceNorm{1,2,3}d``: Conv -> per-sample norm -> activation.

The counterparts of :class:`~convbn.nn.FusedConvBN2d` for the norms of
:data:`convbn.functional.norms.NORMS`: a real ``nn.ConvNd`` child named ``conv`` and a real
``nn.GroupNorm`` / ``nn.InstanceNormNd`` child named ``norm`` (``state_dict`` keys those of
``nn.Sequential(OrderedDict(conv=..., norm=...))``; a plain ``Sequential(conv, norm)``
checkpoint loads too), the maths in :func:`convbn.autograd.norm_chain.norm_chain_apply` (a
one-layer norm chain).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Type, Union

import torch
from torch import Tensor, nn
from torch.nn.modules.conv import _ConvNd
from torch.nn.utils import parametrize

from ..autograd.norm_chain import NormLayerSpec, norm_chain_apply
from ..functional.activations import Activation, get_activation
from ..functional.conv import conv_spec_from_module
from ..functional.conv_bn_call import check_inputs
from .chain_layer import NO_BN
from .fused_conv_bn import module_hooked
from .norm_view import NormView

__all__ = ["FusedConvGroupNorm1d", "FusedConvGroupNorm2d", "FusedConvGroupNorm3d",
           "FusedConvInstanceNorm1d", "FusedConvInstanceNorm2d", "FusedConvInstanceNorm3d"]

#: what each fused layer keeps for backward: the conv output (recompute the norm and
#: activation) or only the conv input (recompute the conv too)
_STRATEGIES = ("recompute_bn", "recompute_conv")


class _FusedConvNormNd(nn.Module):
    _conv_cls: Type[_ConvNd]
    _dims: int
    conv: _ConvNd
    norm: nn.Module

    def _setup(self, conv: _ConvNd, norm: nn.Module, activation: Union[None, str, Activation, nn.Module],
               strategy: str) -> None:
        if strategy not in _STRATEGIES:
            raise ValueError(f"strategy must be one of {_STRATEGIES}, but got strategy={strategy!r}")
        self.activation = get_activation(activation)
        self.strategy = strategy
        self.conv, self.norm = conv, norm

    @classmethod
    def from_modules(cls, conv: _ConvNd, norm: nn.Module, activation: Union[None, str, Activation, nn.Module] = None,
                     strategy: str = "recompute_bn") -> "_FusedConvNormNd":
        """Fuse existing modules, *sharing* their parameters and buffers (no copies).

        Args:
            conv: an ``nn.Conv{N}d`` with torch's forward.
            norm: the norm this class fuses (``nn.GroupNorm`` / ``nn.InstanceNorm{N}d``), its
                channels the conv's ``out_channels``.
            activation: as in the constructor.
            strategy: as in the constructor.

        Returns:
            The fused module; training it trains ``conv`` and ``norm``.

        Example:
            >>> conv, gn = nn.Conv2d(3, 8, 3), nn.GroupNorm(4, 8)
            >>> FusedConvGroupNorm2d.from_modules(conv, gn, "silu").norm is gn
            True
        """
        if not isinstance(conv, cls._conv_cls):
            raise TypeError(f"{cls.__name__}.from_modules expects an {cls._conv_cls.__name__}, but got {type(conv).__name__}")
        if not isinstance(norm, cls._norm_types()):
            raise TypeError(f"{cls.__name__}.from_modules expects {cls._norm_types()[0].__name__}, but got "
                            f"{type(norm).__name__}")
        channels = NormView.of_module(norm).channels
        if channels != conv.out_channels:
            raise ValueError(f"the norm's {channels} channels do not match the conv's out_channels={conv.out_channels}")
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._setup(conv, norm, activation, strategy)
        return self

    @classmethod
    def _norm_types(cls) -> tuple:
        raise NotImplementedError

    def forward(self, input: Tensor) -> Tensor:
        """``activation(norm(conv(input)))``; eager modules where hooks or an empty batch ask for them."""
        if input.numel() == 0 or module_hooked(self.conv, self.norm) or torch.compiler.is_compiling() \
                or (input.device.type in ("cpu", "cuda") and torch.is_autocast_enabled(input.device.type)):
            return self.activation(self.norm(self.conv(input)))
        with parametrize.cached():
            view = NormView.of_module(self.norm)
            spec = conv_spec_from_module(self.conv)
            check_inputs(input, self.conv.weight, spec, NO_BN, (self.conv.bias, view.weight, view.bias))
            layer = NormLayerSpec(spec, view.call(), self.activation, keep_y=self.strategy == "recompute_bn")
            return norm_chain_apply(spec.pad_input(input), [self.conv.weight, self.conv.bias, view.weight, view.bias],
                                    [layer], [view.stats()])

    def extra_repr(self) -> str:
        return f"activation={self.activation}, strategy={self.strategy!r}"

    def _load_from_state_dict(self, state_dict: Dict[str, Any], prefix: str, local_metadata: Dict[str, Any],
                              strict: bool, missing_keys: List[str], unexpected_keys: List[str],
                              error_msgs: List[str]) -> None:
        # Accept checkpoints of a plain nn.Sequential(conv, norm): keys "0.*" / "1.*".
        for old, new in (("0.", "conv."), ("1.", "norm.")):
            for key in [k for k in state_dict if k.startswith(prefix + old)]:
                state_dict[prefix + new + key[len(prefix + old):]] = state_dict.pop(key)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)


class _FusedConvGroupNormNd(_FusedConvNormNd):
    def __init__(self, in_channels: int, out_channels: int, kernel_size: Union[int, Sequence[int]],
                 stride: Union[int, Sequence[int]] = 1, padding: Union[str, int, Sequence[int]] = 0,
                 dilation: Union[int, Sequence[int]] = 1, groups: int = 1, bias: bool = True,
                 padding_mode: str = "zeros", num_groups: int = 32, eps: float = 1e-5, affine: bool = True,
                 activation: Union[None, str, Activation, nn.Module] = None, strategy: str = "recompute_bn",
                 device: Any = None, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        conv = self._conv_cls(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,  # type: ignore[arg-type]
                              padding_mode, **factory)
        self._setup(conv, nn.GroupNorm(num_groups, out_channels, eps, affine, **factory), activation, strategy)

    @classmethod
    def _norm_types(cls) -> tuple:
        return (nn.GroupNorm,)


class _FusedConvInstanceNormNd(_FusedConvNormNd):
    _norm_cls: Type[nn.Module]

    def __init__(self, in_channels: int, out_channels: int, kernel_size: Union[int, Sequence[int]],
                 stride: Union[int, Sequence[int]] = 1, padding: Union[str, int, Sequence[int]] = 0,
                 dilation: Union[int, Sequence[int]] = 1, groups: int = 1, bias: bool = True,
                 padding_mode: str = "zeros", eps: float = 1e-5, momentum: Optional[float] = 0.1,
                 affine: bool = False, track_running_stats: bool = False,
                 activation: Union[None, str, Activation, nn.Module] = None, strategy: str = "recompute_bn",
                 device: Any = None, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        conv = self._conv_cls(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,  # type: ignore[arg-type]
                              padding_mode, **factory)
        norm = self._norm_cls(out_channels, eps, momentum, affine, track_running_stats, **factory)  # type: ignore[call-arg]
        self._setup(conv, norm, activation, strategy)

    @classmethod
    def _norm_types(cls) -> tuple:
        return (cls._norm_cls,)


class FusedConvGroupNorm2d(_FusedConvGroupNormNd):
    """``nn.Conv2d`` -> ``nn.GroupNorm`` -> activation, keeping fewer activations for backward.

    Outputs, gradients and the parameters' gradients are those of the eager modules; only what
    is kept for backward (and so recomputed) changes with ``strategy``.

    Args:
        in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias, padding_mode: as
            ``nn.Conv2d`` (same order and defaults).
        num_groups, eps, affine: as ``nn.GroupNorm`` (over ``out_channels``).
        activation: ``None``, an activation name (``"silu"``, ``"relu"``, ``"leaky_relu"`` ...) or the
            matching ``nn`` module instance.
        strategy: ``"recompute_bn"`` (keep the conv input and output, recompute the norm and
            activation) or ``"recompute_conv"`` (keep the conv input only, recompute the conv).
        device, dtype: factory kwargs.

    Returns:
        A module mapping ``(N, in_channels, H, W)`` to ``(N, out_channels, H', W')``.

    Example:
        >>> m = FusedConvGroupNorm2d(3, 16, 3, padding=1, num_groups=4, activation="silu")
        >>> m(torch.randn(2, 3, 8, 8)).shape
        torch.Size([2, 16, 8, 8])
    """

    _conv_cls = nn.Conv2d
    _dims = 2


class FusedConvGroupNorm1d(_FusedConvGroupNormNd):
    """``nn.Conv1d`` -> ``nn.GroupNorm`` -> activation. Args and Returns: as :class:`FusedConvGroupNorm2d`.

    Example:
        >>> FusedConvGroupNorm1d(3, 8, 3, num_groups=2)(torch.randn(2, 3, 9)).shape
        torch.Size([2, 8, 7])
    """

    _conv_cls = nn.Conv1d
    _dims = 1


class FusedConvGroupNorm3d(_FusedConvGroupNormNd):
    """``nn.Conv3d`` -> ``nn.GroupNorm`` -> activation. Args and Returns: as :class:`FusedConvGroupNorm2d`.

    Example:
        >>> FusedConvGroupNorm3d(1, 8, 3, padding=1, num_groups=2)(torch.randn(1, 1, 4, 4, 4)).shape
        torch.Size([1, 8, 4, 4, 4])
    """

    _conv_cls = nn.Conv3d
    _dims = 3


class FusedConvInstanceNorm2d(_FusedConvInstanceNormNd):
    """``nn.Conv2d`` -> ``nn.InstanceNorm2d`` -> activation, keeping fewer activations for backward.

    Outputs, gradients and running statistics (with ``track_running_stats=True``) are those of
    the eager modules.

    Args:
        in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias, padding_mode: as
            ``nn.Conv2d`` (same order and defaults).
        eps, momentum, affine, track_running_stats: as ``nn.InstanceNorm2d`` (same defaults).
        activation, strategy, device, dtype: as :class:`FusedConvGroupNorm2d`.

    Returns:
        A module mapping ``(N, in_channels, H, W)`` to ``(N, out_channels, H', W')``.

    Example:
        >>> m = FusedConvInstanceNorm2d(3, 16, 3, padding=1, affine=True, activation="leaky_relu")
        >>> m(torch.randn(2, 3, 8, 8)).shape
        torch.Size([2, 16, 8, 8])
    """

    _conv_cls = nn.Conv2d
    _norm_cls = nn.InstanceNorm2d
    _dims = 2


class FusedConvInstanceNorm1d(_FusedConvInstanceNormNd):
    """``nn.Conv1d`` -> ``nn.InstanceNorm1d`` -> activation. Args and Returns: as :class:`FusedConvInstanceNorm2d`.

    Example:
        >>> FusedConvInstanceNorm1d(3, 8, 3)(torch.randn(2, 3, 9)).shape
        torch.Size([2, 8, 7])
    """

    _conv_cls = nn.Conv1d
    _norm_cls = nn.InstanceNorm1d
    _dims = 1


class FusedConvInstanceNorm3d(_FusedConvInstanceNormNd):
    """``nn.Conv3d`` -> ``nn.InstanceNorm3d`` -> activation (nnU-Net's layer). Args and Returns: as
    :class:`FusedConvInstanceNorm2d`.

    Example:
        >>> m = FusedConvInstanceNorm3d(1, 8, 3, padding=1, affine=True, activation=nn.LeakyReLU(0.01))
        >>> m(torch.randn(1, 1, 4, 4, 4)).shape
        torch.Size([1, 8, 4, 4, 4])
    """

    _conv_cls = nn.Conv3d
    _norm_cls = nn.InstanceNorm3d
    _dims = 3
