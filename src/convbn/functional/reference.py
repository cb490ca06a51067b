"""The slow, obviously-right Conv -> BatchNorm -> activation, built from differentiable ops.

It is the oracle the fast ``autograd.Function``s are tested against, and the path
their backward takes when a differentiable backward is asked for
(``create_graph=True``: gradient penalties, MAML, Hessian-vector products): autograd
then differentiates through the convolution, the batch statistics and the activation.
"""
from __future__ import annotations

from typing import Optional

import torch.nn.functional as F
from torch import Tensor

from .activations import Activation
from .batchnorm import BNSpec
from .conv import ConvSpec, conv_forward

__all__ = ["conv_bn_act_reference"]


def conv_bn_act_reference(
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
    """``act(BN(conv(x)))`` with plain differentiable PyTorch ops.

    Args:
        x: input, already pre-padded by ``conv.pad_input`` (this function does not pad).
        weight, bias: convolution parameters.
        bn_weight, bn_bias: BatchNorm affine parameters (or ``None``).
        running_mean, running_var: used when ``bn.batch_stats`` is ``False``; when it is
            ``True`` and they are given they are updated in place with ``bn.momentum``.
        conv, bn, act: the layer's specs.

    Returns:
        The activation output.
    """
    y = conv_forward(x, weight, bias, conv)
    if bn.batch_stats:
        z = F.batch_norm(y, running_mean, running_var, bn_weight, bn_bias, True, bn.momentum, bn.eps)
    else:
        z = F.batch_norm(y, running_mean, running_var, bn_weight, bn_bias, False, 0.0, bn.eps)
    return act(z)
