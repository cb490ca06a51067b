"""``FusedConvBN1d/2d/3d``: Conv -> BatchNorm -> activation as one memory-lean layer.

The module is thin: it owns a real ``nn.ConvNd`` child named ``conv`` and a real
``nn.BatchNormNd`` child named ``bn`` (so ``state_dict()`` keys are those of
``nn.Sequential(OrderedDict(conv=..., bn=...))`` and checkpoints load both ways), does
BatchNorm's bookkeeping (``num_batches_tracked``, momentum), and hands the maths to
:func:`convbn.autograd.dispatch.conv_bn_act_spec`.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Type, TypeVar, Union

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.conv import _ConvNd
from torch.nn.utils import parametrize

from ..functional.activations import Activation, get_activation
from ..functional.batchnorm import BNSpec
from ..functional.conv import ConvSpec, conv_spec_from_module
from ..autograd.dispatch import conv_bn_act_spec
from ..functional.conv_bn_call import ConvBNTensors, check_inputs
from ..functional.strategies import Strategy, check_strategy
from .sync import bn_running_stats, bn_spec_from_module, sync_group

__all__ = ["FusedConvBN1d", "FusedConvBN2d", "FusedConvBN3d", "bn_spec_from_module", "bn_running_stats", "sync_group",
           "module_hooked", "hooks_of", "OBSERVER_ATTR"]

T = TypeVar("T", bound="_FusedConvBNNd")


#: Hooks carrying this attribute (set to ``True``) only observe which module runs --
#: convbn's own measuring tools -- and do not make a fused module run its layers eagerly.
OBSERVER_ATTR = "convbn_observer"


def hooks_of(m: nn.Module) -> List[Any]:
    """The forward (pre-)hooks and backward (pre-)hooks of ``m`` that are not observers."""
    found = []
    for d in (m._forward_pre_hooks, m._forward_hooks, m._backward_hooks, m._backward_pre_hooks):
        if d:
            found += [h for h in d.values() if not getattr(h, OBSERVER_ATTR, False)]
    return found


def module_hooked(*modules: nn.Module) -> bool:
    """Whether any of ``modules`` has (non-observer) hooks.

    Global module hooks (``register_module_forward_hook``) do not count: they are what
    tracking tools use (``torch.distributed._tools.MemTracker``, ``ModTracker``), and they
    still see every module the converted model calls -- the fused module itself.
    """
    return any(hooks_of(m) for m in modules)


class _FusedConvBNNd(nn.Module):
    _conv_cls: Type[_ConvNd]
    _bn_cls: Type[_BatchNorm]
    _dims: int

    conv: _ConvNd
    bn: _BatchNorm

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: Union[int, Sequence[int]],
        stride: Union[int, Sequence[int]] = 1,
        padding: Union[str, int, Sequence[int]] = 0,
        dilation: Union[int, Sequence[int]] = 1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        eps: float = 1e-5,
        momentum: Optional[float] = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        activation: Union[None, str, Activation, nn.Module] = None,
        strategy: Strategy = "recompute_bn",
        device: Any = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.activation = get_activation(activation)
        self.strategy = check_strategy(strategy)
        self.conv = self._conv_cls(
            in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias, padding_mode, **factory  # type: ignore[arg-type]
        )
        self.bn = self._bn_cls(out_channels, eps, momentum, affine, track_running_stats, **factory)

    @classmethod
    def from_modules(
        cls: Type[T],
        conv: _ConvNd,
        bn: _BatchNorm,
        activation: Union[None, str, Activation, nn.Module] = None,
        strategy: Strategy = "recompute_bn",
    ) -> T:
        """Fuse existing modules, *sharing* their parameters and buffers (no copies).

        Args:
            conv: an ``nn.Conv{N}d`` or ``nn.ConvTranspose{N}d`` (any subclass with the
                standard forward), or, for ``FusedConvBN1d``, an ``nn.Linear`` (inputs ``(N, C)``).
            bn: an ``nn.BatchNorm{N}d`` or another ``_BatchNorm`` subclass with
                ``num_features == conv.out_channels``.
            activation: as in the constructor.
            strategy: as in the constructor.

        Returns:
            The fused module; training it trains ``conv`` and ``bn``.

        Example:
            >>> conv, bn = nn.Conv2d(3, 8, 3, bias=False), nn.BatchNorm2d(8)
            >>> fused = FusedConvBN2d.from_modules(conv, bn, "relu")
            >>> fused.conv.weight is conv.weight
            True
        """
        linear = isinstance(conv, nn.Linear) and cls._dims == 1
        if not linear and (not isinstance(conv, _ConvNd) or len(conv.kernel_size) != cls._dims):
            kinds = f"nn.Conv{cls._dims}d, nn.ConvTranspose{cls._dims}d or nn.Linear" if cls._dims == 1 else \
                f"nn.Conv{cls._dims}d or nn.ConvTranspose{cls._dims}d"
            raise TypeError(f"{cls.__name__}.from_modules expects an {kinds}, but got {type(conv).__name__}")
        out_channels = conv.out_features if linear else conv.out_channels
        if not isinstance(bn, _BatchNorm):
            raise TypeError(f"{cls.__name__}.from_modules expects a BatchNorm module, but got {type(bn).__name__}")
        if bn.num_features != out_channels:
            raise ValueError(
                f"BatchNorm num_features={bn.num_features} does not match the conv's out_channels={out_channels}"
            )
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.activation = get_activation(activation)
        self.strategy = check_strategy(strategy)
        self.conv = conv
        self.bn = bn
        return self

    def conv_spec(self) -> ConvSpec:
        return conv_spec_from_module(self.conv)

    def forward(self, input: Tensor) -> Tensor:
        if input.numel() == 0 or module_hooked(self.conv, self.bn):
            return self._forward_eager(input)
        with parametrize.cached():  # a parametrized weight is computed once per call, as in eager
            return self._forward_fused(input)

    def _forward_eager(self, input: Tensor) -> Tensor:
        """Conv and BatchNorm *called* as modules (their hooks run, eager's checks apply).

        Used for empty batches and whenever ``conv`` / ``bn`` (or global module hooks) have
        hooks, which the fused computation would bypass (see Note: [hooks on fused modules]).
        ``frozen`` runs the BatchNorm in eval mode for the call, which is what it computes.
        """
        y = self.conv(input)
        if self.strategy != "frozen" or not self.bn.training:
            return self.activation(self.bn(y))
        self.bn.training = False
        try:
            z = self.bn(y)
        finally:
            self.bn.training = True
        return self.activation(z)

    def _forward_fused(self, input: Tensor) -> Tensor:
        conv, bn = self.conv, self.bn
        cspec = conv_spec_from_module(conv)
        rm, rv = bn_running_stats(bn)
        frozen = self.strategy == "frozen"
        bspec = bn_spec_from_module(bn) if not frozen else BNSpec(float(bn.eps), False, 0.0)
        tensors = ConvBNTensors(conv.weight, conv.bias, bn.weight, bn.bias, rm, rv)
        check_inputs(input, conv.weight, cspec, bspec, tensors.others())
        if not frozen:
            bspec = bn_spec_from_module(bn, advance=True)
        return conv_bn_act_spec(input, tensors, cspec, bspec, self.activation, self.strategy, inputs_checked=True)

    def extra_repr(self) -> str:
        return f"activation={self.activation}, strategy={self.strategy!r}"

    def _load_from_state_dict(
        self,
        state_dict: Dict[str, Any],
        prefix: str,
        local_metadata: Dict[str, Any],
        strict: bool,
        missing_keys: List[str],
        unexpected_keys: List[str],
        error_msgs: List[str],
    ) -> None:
        # Accept checkpoints of a plain nn.Sequential(conv, bn): keys "0.*" / "1.*".
        for old, new in (("0.", "conv."), ("1.", "bn.")):
            for key in [k for k in state_dict if k.startswith(prefix + old)]:
                state_dict[prefix + new + key[len(prefix + old):]] = state_dict.pop(key)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )


class FusedConvBN1d(_FusedConvBNNd):
    """``nn.Conv1d`` -> ``nn.BatchNorm1d`` -> activation, keeping fewer activations for backward.

    Args: as :class:`FusedConvBN2d`.
    """

    _conv_cls = nn.Conv1d
    _bn_cls = nn.BatchNorm1d
    _dims = 1


class FusedConvBN2d(_FusedConvBNNd):
    """``nn.Conv2d`` -> ``nn.BatchNorm2d`` -> activation, keeping fewer activations for backward.

    Outputs, gradients and running statistics are those of the eager modules; only what
    is kept for backward (and so what is recomputed) changes with ``strategy``.

    Args:
        in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias, padding_mode: as
            ``nn.Conv2d`` (same order and defaults).
        eps, momentum, affine, track_running_stats: as ``nn.BatchNorm2d``.
        activation: ``None``, ``"relu"``, ``"relu6"``, ``"leaky_relu"``, ``"silu"``,
            ``"gelu"``, ``"hardswish"`` or the matching ``nn`` module instance.
        strategy: ``"recompute_bn"`` (keep conv input and output, recompute BN + act),
            ``"recompute_conv"`` (keep the conv input only, recompute the conv) or
            ``"frozen"`` (normalise with running statistics even in training; BN is
            folded into the conv on the fly).
        device, dtype: factory kwargs.

    Example:
        >>> m = FusedConvBN2d(3, 16, 3, padding=1, bias=False, activation="relu")
        >>> m(torch.randn(8, 3, 32, 32)).shape
        torch.Size([8, 16, 32, 32])
    """

    _conv_cls = nn.Conv2d
    _bn_cls = nn.BatchNorm2d
    _dims = 2


class FusedConvBN3d(_FusedConvBNNd):
    """``nn.Conv3d`` -> ``nn.BatchNorm3d`` -> activation, keeping fewer activations for backward.

    Args: as :class:`FusedConvBN2d`.
    """

    _conv_cls = nn.Conv3d
    _bn_cls = nn.BatchNorm3d
    _dims = 3
