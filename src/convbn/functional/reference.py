"""The slow, obviously-right Conv -> BatchNorm -> activation, built from differentiable ops.

It is the oracle the fast ``autograd.Function``s are tested against, and the path
their backward takes when a differentiable backward is asked for
(``create_graph=True``: gradient penalties, MAML, Hessian-vector products): autograd
then differentiates through the convolution, the batch statistics and the activation.
"""
from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from .activations import Activation
from .batchnorm import BNSpec
from .conv import ConvSpec, conv_forward
from .conv_bn_call import ConvBNTensors

__all__ = ["conv_bn_act_reference"]


def conv_bn_act_reference(x: Tensor, t: ConvBNTensors, conv: ConvSpec, bn: BNSpec, act: Activation) -> Tensor:
    """``act(BN(conv(x)))`` with plain differentiable PyTorch ops.

    Args:
        x: input, already pre-padded by ``conv.pad_input`` (this function does not pad).
        t: the layer's parameters and running statistics; the running statistics are
            used when ``bn.batch_stats`` is ``False``; when it is ``True`` and they are
            given they are updated in place with ``bn.momentum``.
        conv, bn, act: the layer's specs.

    Returns:
        The activation output.
    """
    y = conv_forward(x, t.weight, t.bias, conv)
    if bn.batch_stats:
        z = F.batch_norm(y, t.running_mean, t.running_var, t.bn_weight, t.bn_bias, True, bn.momentum, bn.eps)
    else:
        z = F.batch_norm(y, t.running_mean, t.running_var, t.bn_weight, t.bn_bias, False, 0.0, bn.eps)
    return act(z)
