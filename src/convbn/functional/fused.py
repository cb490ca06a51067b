"""Functional entry point of a fused Conv -> BatchNorm -> activation layer.

``conv_bn_act`` checks its inputs (so a bad call fails before any running statistic
changes), applies autocast and pre-padding the way ``nn.ConvNd`` would, and dispatches
to the ``autograd.Function`` of the chosen strategy, or to a plain no-grad path when
nothing needs gradients.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from .activations import Activation, get_activation
from .batchnorm import BNSpec, bn_forward
from .conv import ConvSpec, conv_forward, conv_in_channels, conv_output_shape, make_conv_spec
from .fold import fold_bn_into_preceding

__all__ = ["STRATEGIES", "check_strategy", "check_inputs", "autocast_dtype", "autocast_inputs", "conv_bn_act", "conv_bn_act_spec"]

#: Strategies a single fused layer accepts (``convert`` adds ``"auto"``).
STRATEGIES = ("recompute_conv", "recompute_bn", "frozen")


def check_strategy(strategy: str, allowed: Sequence[str] = STRATEGIES) -> str:
    """Return ``strategy`` or raise ``ValueError`` listing the allowed names."""
    if not isinstance(strategy, str) or strategy not in allowed:
        raise ValueError(f"strategy must be one of {tuple(allowed)}, but got strategy={strategy!r}")
    return strategy


def check_inputs(
    x: Tensor,
    weight: Tensor,
    conv: ConvSpec,
    bn: BNSpec,
    tensors: Sequence[Optional[Tensor]] = (),
) -> Tuple[int, ...]:
    """Validate a fused layer's call; return the conv output shape.

    Raises the errors eager ``nn.ConvNd`` -> ``nn.BatchNormNd`` would (wrong rank,
    channel mismatch, one value per channel in training, dtype/device mismatch), with
    messages that name the value and what was expected.
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"input must be a Tensor, but got {type(x).__name__}")
    want = conv.dims + 2
    if x.dim() != want:
        layer = ("Linear+BatchNorm1d" if conv.is_linear
                 else f"Conv{'Transpose' if conv.transposed else ''}{conv.dims}d+BatchNorm{conv.dims}d")
        axes = "".join(", " + a for a in "DHW"[3 - conv.dims:])
        raise ValueError(
            f"expected {want}D input (N, C{axes}) for a fused {layer}, but got {x.dim()}D input of shape {tuple(x.shape)}"
        )
    c_in = conv_in_channels(weight.shape, conv)
    if x.shape[1] != c_in:
        raise RuntimeError(
            f"expected input of shape {tuple(x.shape)} to have {c_in} channels, but got {x.shape[1]} channels instead"
        )
    autocast = torch.is_autocast_enabled(x.device.type) if x.device.type in ("cpu", "cuda") else False
    for t in (weight, *tensors):
        if t is None:
            continue
        if t.device != x.device:
            raise RuntimeError(
                f"input is on {x.device} but a weight/buffer is on {t.device}; move the module with "
                f".to({x.device}) or the input with .to({t.device})"
            )
    if not autocast and x.dtype != weight.dtype:
        raise RuntimeError(
            f"input dtype ({x.dtype}) and weight dtype ({weight.dtype}) should be the same; "
            f"convert one of them or run under torch.autocast"
        )
    out_shape = conv_output_shape(x.shape, weight.shape, conv)
    if any(s <= 0 for s in out_shape[2:]):
        raise RuntimeError(
            f"input of spatial size {tuple(x.shape[2:])} is too small for the convolution: "
            f"its output would have size {tuple(out_shape[2:])}"
        )
    if bn.batch_stats and bn.process_group is None:  # synced stats are checked across processes
        per_channel = out_shape[0]
        for s in out_shape[2:]:
            per_channel *= s
        if per_channel <= 1:
            raise ValueError(
                f"Expected more than 1 value per channel when training, got input size "
                f"{torch.Size(out_shape)} after the convolution"
            )
    return out_shape


def autocast_dtype(x: Tensor) -> Optional[torch.dtype]:
    """The dtype autocast runs convolutions in for ``x``'s device, or ``None`` when it is off."""
    dev = x.device.type
    if dev in ("cpu", "cuda") and torch.is_autocast_enabled(dev) and x.is_floating_point():
        return torch.get_autocast_dtype(dev)
    return None


def autocast_inputs(
    x: Tensor, weight: Tensor, bias: Optional[Tensor]
) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """Cast the conv operands the way autocast casts ``conv`` (differentiably, outside
    the Function, so gradients reach the float32 parameters through the cast)."""
    dt = autocast_dtype(x)
    if dt is not None:
        x, weight = x.to(dt), weight.to(dt)
        bias = None if bias is None else bias.to(dt)
    return x, weight, bias


def conv_bn_act_spec(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    bn_weight: Optional[Tensor],
    bn_bias: Optional[Tensor],
    running_mean: Optional[Tensor],
    running_var: Optional[Tensor],
    conv: ConvSpec,
    bn: BNSpec,
    act: Activation,
    strategy: str,
) -> Tensor:
    """:func:`conv_bn_act` on resolved specs (what the modules call)."""
    from ..autograd.fused import FrozenFunction, RecomputeBNFunction, RecomputeConvFunction

    check_strategy(strategy)
    check_inputs(x, weight, conv, bn, (bias, bn_weight, bn_bias, running_mean, running_var))
    frozen = strategy == "frozen" or not bn.batch_stats
    if frozen:
        if running_mean is None or running_var is None:
            raise ValueError(
                "strategy='frozen' normalises with running statistics, but the BatchNorm has none "
                "(track_running_stats=False); use 'recompute_bn' or 'recompute_conv'"
            )
        bn = BNSpec(bn.eps, False, 0.0)
    x, weight, bias = autocast_inputs(x, weight, bias)
    dev = x.device.type
    with torch.autocast(dev, enabled=False) if dev in ("cpu", "cuda") else nullcontext():
        x = conv.pad_input(x)
        needs_grad = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (x, weight, bias, bn_weight, bn_bias)
        )
        if not needs_grad:
            with torch.no_grad():
                return _forward_no_grad(x, weight, bias, bn_weight, bn_bias, running_mean, running_var, conv, bn, act)
        fn = FrozenFunction if frozen else (RecomputeConvFunction if strategy == "recompute_conv" else RecomputeBNFunction)
        return fn.apply(x, weight, bias, bn_weight, bn_bias, running_mean, running_var, conv, bn, act)


def _forward_no_grad(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    bn_weight: Optional[Tensor],
    bn_bias: Optional[Tensor],
    running_mean: Optional[Tensor],
    running_var: Optional[Tensor],
    conv: ConvSpec,
    bn: BNSpec,
    act: Activation,
) -> Tensor:
    """Inference / no-grad forward: nothing is kept; eval BN is folded into the conv."""
    if bn.batch_stats:
        y = conv_forward(x, weight, bias, conv)
        z = bn_forward(y, bn_weight, bn_bias, running_mean, running_var, bn)[0]
    else:
        w_f, b_f = fold_bn_into_preceding(weight, bias, running_mean, running_var, bn.eps, bn_weight, bn_bias,  # type: ignore[arg-type]
                                          transposed=conv.transposed, groups=conv.groups)
        z = conv_forward(x, w_f, b_f, conv)
    return act(z, inplace=True)


def conv_bn_act(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    bn_weight: Optional[Tensor],
    bn_bias: Optional[Tensor],
    running_mean: Optional[Tensor],
    running_var: Optional[Tensor],
    *,
    stride: Union[int, Sequence[int]] = 1,
    padding: Union[str, int, Sequence[int]] = 0,
    dilation: Union[int, Sequence[int]] = 1,
    groups: int = 1,
    padding_mode: str = "zeros",
    training: bool = True,
    momentum: float = 0.1,
    eps: float = 1e-5,
    activation: Union[None, str, Activation, torch.nn.Module] = None,
    strategy: str = "recompute_bn",
) -> Tensor:
    """Fused ``act(batch_norm(conv(x)))``, numerically ``F.convNd`` -> ``F.batch_norm`` -> act.

    The convolution's dimensionality follows ``weight`` (3-D weight: Conv1d, 4-D:
    Conv2d, 5-D: Conv3d). ``training``/``momentum`` follow :func:`torch.nn.functional.batch_norm`:
    with ``training=True`` (or no running stats) the batch statistics normalise and the
    running stats, if given, are updated in place once with factor ``momentum``.

    Args:
        x: ``(N, C_in, *spatial)`` input.
        weight, bias: convolution parameters.
        bn_weight, bn_bias: BatchNorm affine parameters or ``None``.
        running_mean, running_var: BatchNorm running statistics or ``None``.
        stride, padding, dilation, groups, padding_mode: as ``nn.ConvNd``.
        training, momentum, eps: as :func:`torch.nn.functional.batch_norm`.
        activation: ``None`` or a name in :data:`convbn.functional.activations.ACTIVATIONS`.
        strategy: ``"recompute_bn"``, ``"recompute_conv"`` or ``"frozen"``.

    Returns:
        The activation output, ``(N, C_out, *spatial_out)``.

    Example:
        >>> x, w = torch.randn(4, 3, 8, 8), torch.randn(8, 3, 3, 3)
        >>> out = conv_bn_act(x, w, None, None, None, None, None, padding=1, activation="relu")
        >>> out.shape
        torch.Size([4, 8, 8, 8])
    """
    if not isinstance(weight, Tensor) or weight.dim() not in (3, 4, 5):
        raise ValueError(
            f"weight must be a 3-D, 4-D or 5-D conv weight tensor, but got "
            f"{tuple(weight.shape) if isinstance(weight, Tensor) else type(weight).__name__}"
        )
    dims = weight.dim() - 2
    conv = make_conv_spec(dims, weight.shape[2:], stride, padding, dilation, groups, padding_mode)
    batch_stats = training or running_mean is None or running_var is None
    bn = BNSpec(float(eps), batch_stats, float(momentum) if momentum is not None else 0.0)
    return conv_bn_act_spec(
        x, weight, bias, bn_weight, bn_bias, running_mean, running_var, conv, bn, get_activation(activation), strategy
    )
