"""The tutorial's fused Conv2d + BatchNorm2d Function: keep the conv input, recompute the conv.

Built from the reference pieces in :mod:`convbn.autograd.conv2d` and
:mod:`convbn.autograd.batchnorm2d`, with the tutorial's BatchNorm maths (eps outside the
square root, unbiased variance, ``affine=False``, no running statistics). This is the
``recompute_conv`` strategy in its plainest form, and the reference the library's
general fused layers are checked against.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from convbn.autograd.batchnorm2d import (
    _check_bn_args,
    _per_channel,
    batch_norm2d_backward,
    batch_norm2d_formula,
    batch_norm2d_stats,
)
from convbn.autograd.conv2d import IntOrPair, _check_conv_args, conv2d_grads

__all__ = ["TutorialFusedConvBN2dFunction", "tutorial_fused_conv_bn2d", "tutorial_conv_bn2d_formula"]


class TutorialFusedConvBN2dFunction(torch.autograd.Function):
    """``BN(conv2d(X, W))`` that saves only ``X`` and ``W`` for backward.

    .. math::
        Z = X \\star W, \\qquad Y = \\frac{Z - \\mu_Z}{\\sqrt{v_Z} + \\epsilon}

    Backward chains the two hand-written backwards: BatchNorm's gives
    :math:`\\partial L / \\partial Z`, then the conv's gives the gradients of ``X``
    and ``W``.

    Args (of :meth:`apply`):
        input: ``(N, C_in, H, W)``.
        weight: ``(C_out, C_in, kH, kW)``.
        eps: default ``1e-3``, added outside the square root.
        stride: int or pair (default 1, the tutorial's value).
        padding: int or pair (default 0, the tutorial's value).

    Returns:
        ``(N, C_out, H_out, W_out)``.

    Example:
        >>> x = torch.randn(2, 3, 6, 6, dtype=torch.float64, requires_grad=True)
        >>> w = torch.randn(4, 3, 3, 3, dtype=torch.float64, requires_grad=True)
        >>> torch.autograd.gradcheck(TutorialFusedConvBN2dFunction.apply, (x, w))
        True
    """

    @staticmethod
    def forward(
        ctx: Any,
        input: Tensor,
        weight: Tensor,
        eps: float = 1e-3,
        stride: IntOrPair = 1,
        padding: IntOrPair = 0,
    ) -> Tensor:
        stride_pair, padding_pair = _check_conv_args(input, weight, stride, padding, 1, 1)
        conv_out = F.conv2d(input, weight, stride=stride_pair, padding=padding_pair)
        _check_bn_args(conv_out, eps)
        mean, sqrt_var = batch_norm2d_stats(conv_out)
        # Note: [what is kept]
        # The conv output (N x C_out x H_out x W_out, usually the largest tensor here)
        # is normalised in place and returned; nothing full-size is saved except the
        # conv *input*. Backward pays for this with one extra convolution.
        output = conv_out.sub_(_per_channel(mean)).div_(_per_channel(sqrt_var + eps))
        ctx.save_for_backward(input, weight)
        ctx.eps = eps
        ctx.stride = stride_pair
        ctx.padding = padding_pair
        return output

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_output: Tensor) -> Tuple[Optional[Tensor], ...]:
        input, weight = ctx.saved_tensors
        # See Note: [what is kept] -- recompute the conv and its statistics.
        conv_out = F.conv2d(input, weight, stride=ctx.stride, padding=ctx.padding)
        mean, sqrt_var = batch_norm2d_stats(conv_out)
        grad_conv = batch_norm2d_backward(grad_output, conv_out, mean, sqrt_var, ctx.eps)
        del conv_out  # free the recomputed activation before the conv backward
        return conv2d_grads(ctx, grad_conv, input, weight)


def tutorial_fused_conv_bn2d(
    input: Tensor,
    weight: Tensor,
    eps: float = 1e-3,
    stride: IntOrPair = 1,
    padding: IntOrPair = 0,
) -> Tensor:
    """Functional entry point of :class:`TutorialFusedConvBN2dFunction`.

    Args:
        input: ``(N, C_in, H, W)``.
        weight: ``(C_out, C_in, kH, kW)``.
        eps: added outside the square root (default ``1e-3``).
        stride: int or pair of ints.
        padding: int or pair of ints.

    Returns:
        ``batch_norm2d_formula(F.conv2d(input, weight, stride=stride, padding=padding), eps)``.

    Example:
        >>> y = tutorial_fused_conv_bn2d(torch.randn(2, 3, 6, 6), torch.randn(4, 3, 3, 3))
        >>> y.shape
        torch.Size([2, 4, 4, 4])
    """
    _check_conv_args(input, weight, stride, padding, 1, 1)
    return TutorialFusedConvBN2dFunction.apply(input, weight, eps, stride, padding)


def tutorial_conv_bn2d_formula(
    input: Tensor,
    weight: Tensor,
    eps: float = 1e-3,
    stride: IntOrPair = 1,
    padding: IntOrPair = 0,
) -> Tensor:
    """The same maths as the fused Function, in plain differentiable eager ops.

    Args:
        input: ``(N, C_in, H, W)``.
        weight: ``(C_out, C_in, kH, kW)``.
        eps: added outside the square root.
        stride: int or pair of ints.
        padding: int or pair of ints.

    Returns:
        The unfused result; autograd keeps the conv output alive for backward.

    Example:
        >>> x, w = torch.randn(2, 3, 6, 6), torch.randn(4, 3, 3, 3)
        >>> torch.testing.assert_close(tutorial_conv_bn2d_formula(x, w),
        ...                            tutorial_fused_conv_bn2d(x, w))
    """
    stride_pair, padding_pair = _check_conv_args(input, weight, stride, padding, 1, 1)
    return batch_norm2d_formula(
        F.conv2d(input, weight, stride=stride_pair, padding=padding_pair), eps
    )
