"""Reference 2-D convolution as a custom :class:`torch.autograd.Function`.

This is the plain, obviously-right oracle that convbn's fused layers are checked
against: the forward is :func:`torch.nn.functional.conv2d` and the backward is written
out with two more convolutions instead of being left to autograd.

Limits (by design, this is a reference, not the product's general conv):
``groups=1`` and ``dilation=1``; ``stride`` and ``padding`` may be an int or a pair of
ints; no bias (a bias is a separate per-channel add and is not what this file shows).
Unsupported options raise :class:`ValueError`.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "conv2d_grads",
    "Conv2dFunction",
    "conv2d_reference",
    "conv2d_input_grad",
    "conv2d_weight_grad",
]

IntOrPair = Union[int, Sequence[int]]


def _pair(value: IntOrPair, name: str, *, minimum: int) -> Tuple[int, int]:
    """Normalise ``value`` (an int or a pair of ints) to a pair, validating its range."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int or a pair of ints, but got {name}={value!r}")
    if isinstance(value, int):
        pair = (value, value)
    elif isinstance(value, (tuple, list)) and len(value) == 2 and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        pair = (int(value[0]), int(value[1]))
    else:
        raise TypeError(f"{name} must be an int or a pair of ints, but got {name}={value!r}")
    if min(pair) < minimum:
        raise ValueError(f"{name} must be >= {minimum}, but got {name}={value!r}")
    return pair


def _check_conv_args(
    input: Tensor,
    weight: Tensor,
    stride: IntOrPair,
    padding: IntOrPair,
    dilation: IntOrPair,
    groups: int,
) -> Tuple[Tuple[int, int], Tuple[int, int]]:
    """Validate the arguments of the reference conv; return ``(stride, padding)`` pairs."""
    if not isinstance(input, Tensor) or not isinstance(weight, Tensor):
        raise TypeError(
            "conv2d_reference expects tensors for input and weight, but got "
            f"{type(input).__name__} and {type(weight).__name__}"
        )
    if input.dim() != 4:
        raise ValueError(f"expected a 4-D input (N, C, H, W), but got shape {tuple(input.shape)}")
    if weight.dim() != 4:
        raise ValueError(
            f"expected a 4-D weight (C_out, C_in, kH, kW), but got shape {tuple(weight.shape)}"
        )
    if input.shape[1] != weight.shape[1]:
        raise ValueError(
            f"input has {input.shape[1]} channels but weight expects {weight.shape[1]} "
            f"(weight shape {tuple(weight.shape)})"
        )
    if groups != 1:
        raise ValueError(f"the reference Conv2dFunction supports only groups=1, but got groups={groups!r}")
    if _pair(dilation, "dilation", minimum=1) != (1, 1):
        raise ValueError(
            f"the reference Conv2dFunction supports only dilation=1, but got dilation={dilation!r}"
        )
    stride_pair = _pair(stride, "stride", minimum=1)
    padding_pair = _pair(padding, "padding", minimum=0)
    for dim, (size, k, p) in enumerate(zip(input.shape[2:], weight.shape[2:], padding_pair)):
        if size + 2 * p < k:
            raise ValueError(
                f"padded input size {size + 2 * p} along spatial dim {dim} is smaller than "
                f"the kernel size {k}"
            )
    return stride_pair, padding_pair


def conv2d_weight_grad(
    input: Tensor,
    grad_output: Tensor,
    kernel_size: Tuple[int, int],
    stride: Tuple[int, int] = (1, 1),
    padding: Tuple[int, int] = (0, 0),
) -> Tensor:
    """Gradient of ``conv2d(input, W)`` w.r.t. ``W``, as one more convolution.

    .. math::
        \\frac{\\partial L}{\\partial W} =
        \\mathrm{conv2d}(X^{T}, G^{T})^{T}

    where :math:`^{T}` swaps the batch and channel dims: the ``C_in`` channels of ``X``
    become a batch, the ``N`` samples become the channels that are summed over, and
    ``grad_output`` (``G``) plays the weight, one filter per output channel.

    Args:
        input: the conv input ``X``, shape ``(N, C_in, H, W)``.
        grad_output: ``G``, shape ``(N, C_out, H_out, W_out)``.
        kernel_size: ``(kH, kW)`` of the weight.
        stride: the forward conv's stride pair.
        padding: the forward conv's padding pair.

    Returns:
        ``(C_out, C_in, kH, kW)`` tensor. Built from differentiable ops.

    Example:
        >>> x, w = torch.randn(2, 3, 5, 5), torch.randn(4, 3, 3, 3)
        >>> g = torch.randn(2, 4, 3, 3)
        >>> conv2d_weight_grad(x, g, (3, 3)).shape
        torch.Size([4, 3, 3, 3])
    """
    # A forward stride s spaces the kernel taps of the weight-gradient "conv" s apart,
    # i.e. it becomes a dilation. The result can be a little larger than the kernel
    # (rows that the forward stride never reached); those rows are cropped away.
    grad_weight_t = F.conv2d(
        input.transpose(0, 1),
        grad_output.transpose(0, 1),
        padding=padding,
        dilation=stride,
    )
    return grad_weight_t[:, :, : kernel_size[0], : kernel_size[1]].transpose(0, 1)


def conv2d_input_grad(
    grad_output: Tensor,
    weight: Tensor,
    input_size: Sequence[int],
    stride: Tuple[int, int] = (1, 1),
    padding: Tuple[int, int] = (0, 0),
) -> Tensor:
    """Gradient of ``conv2d(X, weight)`` w.r.t. ``X``: a transposed convolution.

    .. math::
        \\frac{\\partial L}{\\partial X} = \\mathrm{conv\\_transpose2d}(G, W)

    Args:
        grad_output: ``G``, shape ``(N, C_out, H_out, W_out)``.
        weight: ``(C_out, C_in, kH, kW)``.
        input_size: the forward input's shape ``(N, C_in, H, W)`` (or just ``(H, W)``).
        stride: the forward conv's stride pair.
        padding: the forward conv's padding pair.

    Returns:
        ``(N, C_in, H, W)`` tensor. Built from differentiable ops.

    Example:
        >>> w, g = torch.randn(4, 3, 3, 3), torch.randn(2, 4, 3, 3)
        >>> conv2d_input_grad(g, w, (2, 3, 5, 5)).shape
        torch.Size([2, 3, 5, 5])
    """
    height, width = int(input_size[-2]), int(input_size[-1])
    # With stride > 1 several input sizes give the same output size; output_padding
    # picks the one the forward actually had.
    output_padding = tuple(
        size - ((out - 1) * s - 2 * p + k)
        for size, out, s, p, k in zip(
            (height, width), grad_output.shape[2:], stride, padding, weight.shape[2:]
        )
    )
    return F.conv_transpose2d(
        grad_output, weight, stride=stride, padding=padding, output_padding=output_padding
    )


class Conv2dFunction(torch.autograd.Function):
    """``conv2d(X, W)`` with a hand-written backward.

    .. math::
        Y = X \\star W, \\qquad
        \\frac{\\partial L}{\\partial W} = \\mathrm{conv2d}(X^{T}, G^{T})^{T}, \\qquad
        \\frac{\\partial L}{\\partial X} = \\mathrm{conv\\_transpose2d}(G, W)

    The backward is made only of differentiable convolutions of saved *inputs*, so it is
    itself differentiable: double backward works and ``gradgradcheck`` passes (no
    ``once_differentiable``).

    Args (of :meth:`apply`):
        input: ``(N, C_in, H, W)``.
        weight: ``(C_out, C_in, kH, kW)``.
        stride: int or pair (default 1).
        padding: int or pair (default 0).

    Returns:
        ``(N, C_out, H_out, W_out)``.

    Example:
        >>> x = torch.randn(2, 3, 6, 6, dtype=torch.float64, requires_grad=True)
        >>> w = torch.randn(4, 3, 3, 3, dtype=torch.float64, requires_grad=True)
        >>> torch.autograd.gradcheck(Conv2dFunction.apply, (x, w))
        True
    """

    @staticmethod
    def forward(
        ctx: Any,
        input: Tensor,
        weight: Tensor,
        stride: IntOrPair = 1,
        padding: IntOrPair = 0,
    ) -> Tensor:
        stride_pair, padding_pair = _check_conv_args(input, weight, stride, padding, 1, 1)
        ctx.stride = stride_pair
        ctx.padding = padding_pair
        # Only the two inputs are kept; the output is never needed for backward.
        ctx.save_for_backward(input, weight)
        return F.conv2d(input, weight, stride=stride_pair, padding=padding_pair)

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> Tuple[Optional[Tensor], ...]:
        input, weight = ctx.saved_tensors
        return conv2d_grads(ctx, grad_output, input, weight)


def conv2d_grads(ctx: Any, grad_output: Tensor, input: Tensor, weight: Tensor) -> Tuple[Optional[Tensor], ...]:
    """``(grad_input, grad_weight, None, ...)`` -- one entry per forward argument -- for a
    Function whose ``ctx`` holds ``stride``/``padding``; only what ``needs_input_grad`` asks."""
    grad_input = grad_weight = None
    if ctx.needs_input_grad[0]:
        grad_input = conv2d_input_grad(grad_output, weight, input.shape, ctx.stride, ctx.padding)
    if ctx.needs_input_grad[1]:
        grad_weight = conv2d_weight_grad(input, grad_output, tuple(weight.shape[2:]), ctx.stride, ctx.padding)
    grads = [grad_input, grad_weight]
    grads += [None] * (len(ctx.needs_input_grad) - len(grads))  # stride, padding, ... are not tensors
    return tuple(grads)


def conv2d_reference(
    input: Tensor,
    weight: Tensor,
    stride: IntOrPair = 1,
    padding: IntOrPair = 0,
) -> Tensor:
    """Functional entry point of :class:`Conv2dFunction`.

    Args:
        input: ``(N, C_in, H, W)``.
        weight: ``(C_out, C_in, kH, kW)``.
        stride: int or pair of ints, each ``>= 1``.
        padding: int or pair of ints, each ``>= 0``.

    Returns:
        ``(N, C_out, H_out, W_out)``, equal to ``F.conv2d(input, weight, stride=stride,
        padding=padding)``.

    Example:
        >>> y = conv2d_reference(torch.randn(1, 2, 5, 5), torch.randn(3, 2, 3, 3), padding=1)
        >>> y.shape
        torch.Size([1, 3, 5, 5])
    """
    _check_conv_args(input, weight, stride, padding, 1, 1)
    return Conv2dFunction.apply(input, weight, stride, padding)
