"""The tutorial's fused Conv2d + BatchNorm2d Function and module: keep the conv input, recompute the conv.

Built from the reference pieces in :mod:`convbn.reference.conv2d` and
:mod:`convbn.reference.batchnorm2d`, with the tutorial's BatchNorm maths (eps outside the
square root, unbiased variance, ``affine=False``, no running statistics). This is the
``recompute_conv`` strategy in its plainest form, and the reference the library's
general fused layers are checked against.

:class:`TutorialFusedConvBN2d` is the module: it holds only a convolution weight and
applies :class:`TutorialFusedConvBN2dFunction`, so with the tutorial's maths (no bias,
no affine, no running statistics) it behaves the same in ``train()`` and ``eval()`` mode.
"""
from __future__ import annotations

import math
from typing import Any, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from .batchnorm2d import (
    _check_bn_args,
    _per_channel,
    batch_norm2d_backward,
    batch_norm2d_formula,
    batch_norm2d_stats,
)
from .conv2d import IntOrPair, _check_conv_args, _pair, conv2d_grads

__all__ = ["TutorialFusedConvBN2d", "TutorialFusedConvBN2dFunction", "tutorial_fused_conv_bn2d", "tutorial_conv_bn2d_formula"]


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


def _positive_int(value: int, name: str) -> int:
    """Check that ``value`` is a positive int and return it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, but got {name}={value!r}")
    return value


class TutorialFusedConvBN2d(nn.Module):
    """``BatchNorm2d(Conv2d(x))`` computed by one memory-lean Function.

    .. math::
        y = \\frac{z - \\mu_z}{\\sqrt{v_z} + \\epsilon}, \\qquad z = x \\star W

    Args:
        in_channels: channels of the input.
        out_channels: channels of the output (conv filters).
        kernel_size: int or ``(kH, kW)``.
        exp_avg_factor: accepted for fidelity with the tutorial's signature, which takes
            it but tracks no running statistics; stored as an attribute and unused.
        eps: added outside the square root (default ``1e-3``).
        device: device of the weight.
        dtype: dtype of the weight.
        stride: keyword-only, int or pair (default 1, the tutorial's value).
        padding: keyword-only, int or pair (default 0, the tutorial's value).

    Example:
        >>> layer = TutorialFusedConvBN2d(3, 8, 3)
        >>> layer(torch.randn(2, 3, 10, 10)).shape
        torch.Size([2, 8, 8, 8])
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: Union[int, Sequence[int]],
        exp_avg_factor: float = 0.1,
        eps: float = 1e-3,
        device: Optional[Union[torch.device, str]] = None,
        dtype: Optional[torch.dtype] = None,
        *,
        stride: Union[int, Sequence[int]] = 1,
        padding: Union[int, Sequence[int]] = 0,
    ) -> None:
        super().__init__()
        self.in_channels = _positive_int(in_channels, "in_channels")
        self.out_channels = _positive_int(out_channels, "out_channels")
        self.kernel_size: Tuple[int, int] = _pair(kernel_size, "kernel_size", minimum=1)
        self.stride: Tuple[int, int] = _pair(stride, "stride", minimum=1)
        self.padding: Tuple[int, int] = _pair(padding, "padding", minimum=0)
        if isinstance(exp_avg_factor, bool) or not isinstance(exp_avg_factor, (int, float)) or not (
            0.0 <= exp_avg_factor <= 1.0
        ):
            raise ValueError(
                f"exp_avg_factor must be a float in [0, 1], but got exp_avg_factor={exp_avg_factor!r}"
            )
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps < 0:
            raise ValueError(f"eps must be a non-negative float, but got eps={eps!r}")
        self.exp_avg_factor = float(exp_avg_factor)
        self.eps = float(eps)
        self.weight = nn.Parameter(
            torch.empty(
                out_channels, in_channels, *self.kernel_size, device=device, dtype=dtype
            )
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Kaiming-uniform init with ``a=sqrt(5)``, as ``nn.Conv2d`` and the tutorial do.

        Returns:
            None; the weight is overwritten in place.

        Example:
            >>> TutorialFusedConvBN2d(3, 8, 3).reset_parameters()
        """
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(self, input: Tensor) -> Tensor:
        """Apply the fused conv + BatchNorm.

        Args:
            input: ``(N, in_channels, H, W)``.

        Returns:
            ``(N, out_channels, H_out, W_out)``.

        Example:
            >>> TutorialFusedConvBN2d(1, 2, 3)(torch.randn(2, 1, 5, 5)).shape
            torch.Size([2, 2, 3, 3])
        """
        return TutorialFusedConvBN2dFunction.apply(
            input, self.weight, self.eps, self.stride, self.padding
        )

    def extra_repr(self) -> str:
        """Summary shown by ``repr``.

        Returns:
            A string such as ``"3, 8, kernel_size=(3, 3), eps=0.001"``.

        Example:
            >>> TutorialFusedConvBN2d(3, 8, 3)
            TutorialFusedConvBN2d(3, 8, kernel_size=(3, 3), eps=0.001)
        """
        text = f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}"
        if self.stride != (1, 1):
            text += f", stride={self.stride}"
        if self.padding != (0, 0):
            text += f", padding={self.padding}"
        return text + f", eps={self.eps}"
