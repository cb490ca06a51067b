"""The functional entry point of a fused Conv -> BatchNorm -> activation layer.

``conv_bn_act`` checks its inputs (so a bad call fails before any running statistic
changes), applies autocast and pre-padding the way ``nn.ConvNd`` would, and dispatches
to the ``autograd.Function`` of the chosen strategy, or to the plain no-grad path
(:func:`convbn.functional.conv_bn_call.conv_bn_act_no_grad`) when nothing needs gradients. It
is an API layer over the Functions (as inplace_abn's functional entry points are), so it
lives here and not among the pure maths of ``functional/``.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from ..functional.activations import Activation, get_activation
from ..functional.batchnorm import BNSpec
from ..functional.conv import ConvSpec, make_conv_spec
from ..functional.conv_bn_call import ConvBNTensors, autocast_inputs, check_inputs, conv_bn_act_no_grad
from ..functional.strategies import Strategy, check_strategy
from .layer_functions import FrozenFunction, RecomputeBNFunction, RecomputeConvFunction

__all__ = ["conv_bn_act", "conv_bn_act_spec"]


def conv_bn_act_spec(
    x: Tensor,
    t: ConvBNTensors,
    conv: ConvSpec,
    bn: BNSpec,
    act: Activation,
    strategy: Strategy,
    *,
    inputs_checked: bool = False,
) -> Tensor:
    """:func:`conv_bn_act` on resolved specs: checks the call, then dispatches.

    Args:
        x: as :func:`conv_bn_act`.
        t: the conv weight and bias, BatchNorm affine parameters and running statistics,
            as :func:`conv_bn_act` takes them.
        conv, bn, act: the resolved layer specs.
        strategy: a :data:`~convbn.functional.strategies.Strategy`.
        inputs_checked: the caller has run :func:`~convbn.functional.conv_bn_call.check_inputs`
            on exactly these arguments (the fused modules do, before advancing
            ``num_batches_tracked``, so a failing call changes no state); skips it here.

    Returns:
        The activation output.
    """
    check_strategy(strategy)
    if not inputs_checked:
        check_inputs(x, t.weight, conv, bn, t.others())
    frozen = strategy == "frozen" or not bn.batch_stats
    if frozen:
        if t.running_mean is None or t.running_var is None:
            raise ValueError(
                "strategy='frozen' normalises with running statistics, but the BatchNorm has none "
                "(track_running_stats=False); use 'recompute_bn' or 'recompute_conv'"
            )
        bn = BNSpec(bn.eps, False, 0.0)
    x, weight, bias = autocast_inputs(x, t.weight, t.bias)
    t = t._replace(weight=weight, bias=bias)
    dev = x.device.type
    with torch.autocast(dev, enabled=False) if dev in ("cpu", "cuda") else nullcontext():
        x = conv.pad_input(x)
        needs_grad = torch.is_grad_enabled() and any(
            p is not None and p.requires_grad for p in (x, t.weight, t.bias, t.bn_weight, t.bn_bias)
        )
        if not needs_grad:
            with torch.no_grad():
                return conv_bn_act_no_grad(x, t, conv, bn, act)
        fn = FrozenFunction if frozen else (RecomputeConvFunction if strategy == "recompute_conv" else RecomputeBNFunction)
        return fn.apply(x, *t, conv, bn, act)


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
    strategy: Strategy = "recompute_bn",
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
        activation: ``None`` or a name in :data:`convbn.ACTIVATIONS`.
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
    tensors = ConvBNTensors(weight, bias, bn_weight, bn_bias, running_mean, running_var)
    return conv_bn_act_spec(x, tensors, conv, bn, get_activation(activation), strategy)
