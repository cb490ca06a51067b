"""The pure parts of a fused Conv -> BatchNorm -> activation call.

The record of a layer's tensors (:class:`ConvBNTensors`), input checks (so a bad call
fails before any running statistic changes), autocast casting, and the no-grad forward
(nothing kept, eval BatchNorm folded into the conv). The entry point that dispatches to
the ``autograd.Function``s, :func:`convbn.autograd.dispatch.conv_bn_act`, is built from
these.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .activations import Activation
from .batchnorm import BNSpec, bn_forward
from .conv import ConvSpec, conv_forward, conv_in_channels, conv_output_shape
from .fold import fold_bn_into_preceding

__all__ = ["ConvBNTensors", "check_inputs", "autocast_dtype", "autocast_inputs", "conv_bn_act_no_grad"]


class ConvBNTensors(NamedTuple):
    """A fused Conv -> BatchNorm layer's tensors besides its input, in the order
    ``F.convNd`` and ``F.batch_norm`` take them (``None`` where absent).

    Example:
        >>> t = ConvBNTensors(torch.randn(8, 3, 3, 3), None, None, None, None, None)
        >>> t.weight.shape, t.others()
        (torch.Size([8, 3, 3, 3]), (None, None, None, None, None))
    """

    weight: Tensor
    bias: Optional[Tensor]
    bn_weight: Optional[Tensor]
    bn_bias: Optional[Tensor]
    running_mean: Optional[Tensor]
    running_var: Optional[Tensor]

    def others(self) -> Tuple[Optional[Tensor], ...]:
        """Every tensor but the conv weight (what :func:`check_inputs` checks beside it)."""
        return tuple(self)[1:]


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
    if x.dim() != conv.dims + 2:
        raise _rank_error(x, conv)
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


def _rank_error(x: Tensor, conv: ConvSpec) -> Exception:
    """The exception eager ``nn.ConvNd`` -> ``nn.BatchNormNd`` raises for an input of the wrong rank.

    # Note: [eager's exception type for a wrong rank]
    # The type is eager's, so code that catches it keeps working: the conv (or linear) itself
    # rejects most ranks with a ``RuntimeError``; an unbatched input, which the conv accepts,
    # reaches the BatchNorm, whose rank check raises ``ValueError`` (BatchNorm2d / 3d, and
    # BatchNorm1d after a linear layer on 1-D or 4-D+ input); BatchNorm1d reads an unbatched
    # Conv1d output ``(C, L)`` as ``(N, C)`` and a linear layer's 3-D output ``(N, L, C)`` as
    # ``(N, C, L)``, and rejects them by their channel count, a ``RuntimeError``.
    """
    want = conv.dims + 2
    layer = ("Linear+BatchNorm1d" if conv.is_linear
             else f"Conv{'Transpose' if conv.transposed else ''}{conv.dims}d+BatchNorm{conv.dims}d")
    axes = "".join(", " + a for a in "DHW"[3 - conv.dims:])
    msg = f"expected {want}D input (N, C{axes}) for a fused {layer}, but got {x.dim()}D input of shape {tuple(x.shape)}"
    if conv.is_linear:
        return RuntimeError(msg) if x.dim() in (0, 3) else ValueError(msg)
    if x.dim() == want - 1 and conv.dims > 1:
        return ValueError(msg + f" (the unbatched conv output is {want - 1}D; BatchNorm{conv.dims}d needs {want}D)")
    return RuntimeError(msg)


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


def conv_bn_act_no_grad(x: Tensor, t: ConvBNTensors, conv: ConvSpec, bn: BNSpec, act: Activation) -> Tensor:
    """Inference / no-grad forward: nothing is kept; eval BN is folded into the conv.

    Call under :func:`torch.no_grad` on checked, autocast-cast and pre-padded inputs
    (the activation runs in place on the BatchNorm output).

    Args:
        x: padded ``(N, C_in, *spatial)`` input.
        t: the layer's parameters and running statistics.
        conv, bn, act: the resolved layer specs.

    Returns:
        The activation output.
    """
    if bn.batch_stats:
        y = conv_forward(x, t.weight, t.bias, conv)
        z = bn_forward(y, t.bn_weight, t.bn_bias, t.running_mean, t.running_var, bn)[0]
    else:
        w_f, b_f = fold_bn_into_preceding(t.weight, t.bias, t.running_mean, t.running_var, bn.eps,  # type: ignore[arg-type]
                                          t.bn_weight, t.bn_bias, transposed=conv.transposed, groups=conv.groups)
        z = conv_forward(x, w_f, b_f, conv)
    return act(z, inplace=True)
