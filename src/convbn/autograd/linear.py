"""Reference linear layer as a custom :class:`torch.autograd.Function`.

Shows the basic custom-Function pattern: ``save_for_backward`` for what backward reads,
``ctx.needs_input_grad`` so each gradient is computed only when asked for, and an
optional input (the bias) whose gradient slot is ``None`` when it is absent.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
from torch import Tensor

__all__ = ["LinearFunction", "linear_reference"]


def _check_linear_args(input: Tensor, weight: Tensor, bias: Optional[Tensor]) -> None:
    """Validate shapes and types for :func:`linear_reference`."""
    if not isinstance(input, Tensor) or not isinstance(weight, Tensor):
        raise TypeError(
            "linear expects tensors for input and weight, but got "
            f"{type(input).__name__} and {type(weight).__name__}"
        )
    if bias is not None and not isinstance(bias, Tensor):
        raise TypeError(f"bias must be a Tensor or None, but got {type(bias).__name__}")
    if weight.dim() != 2:
        raise ValueError(
            f"expected a 2-D weight (out_features, in_features), but got shape {tuple(weight.shape)}"
        )
    if input.dim() < 1 or input.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"input's last dim must equal in_features={weight.shape[1]}, but got input "
            f"shape {tuple(input.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(
            f"expected bias of shape ({weight.shape[0]},), but got {tuple(bias.shape)}"
        )


class LinearFunction(torch.autograd.Function):
    """``y = x W^T + b`` with a hand-written backward.

    .. math::
        \\frac{\\partial L}{\\partial x} = G W, \\qquad
        \\frac{\\partial L}{\\partial W} = G^T x, \\qquad
        \\frac{\\partial L}{\\partial b} = \\textstyle\\sum_{\\text{rows}} G

    where the leading dims of ``x`` and ``G`` are flattened into rows. The backward is
    made of differentiable ops on saved inputs, so double backward works.

    Args (of :meth:`apply`):
        input: ``(*, in_features)``.
        weight: ``(out_features, in_features)``.
        bias: ``(out_features,)`` or ``None``.

    Returns:
        ``(*, out_features)``.

    Example:
        >>> x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
        >>> w = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
        >>> torch.autograd.gradcheck(LinearFunction.apply, (x, w))
        True
    """

    @staticmethod
    def forward(
        ctx: Any, input: Tensor, weight: Tensor, bias: Optional[Tensor] = None
    ) -> Tensor:
        _check_linear_args(input, weight, bias)
        # backward needs x (for dW) and W (for dx); the bias gradient needs neither.
        ctx.save_for_backward(input, weight)
        output = input.matmul(weight.t())
        if bias is not None:
            output = output + bias
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> Tuple[Optional[Tensor], ...]:
        input, weight = ctx.saved_tensors
        needs = ctx.needs_input_grad
        grads: list = [None] * len(needs)
        if needs[0]:
            grads[0] = grad_output.matmul(weight)
        if needs[1]:
            rows_out = grad_output.reshape(-1, grad_output.shape[-1])
            rows_in = input.reshape(-1, input.shape[-1])
            grads[1] = rows_out.t().matmul(rows_in)
        if len(needs) > 2 and needs[2]:
            grads[2] = grad_output.reshape(-1, grad_output.shape[-1]).sum(0)
        return tuple(grads)


def linear_reference(input: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """Functional entry point of :class:`LinearFunction`.

    Args:
        input: ``(*, in_features)``.
        weight: ``(out_features, in_features)``.
        bias: ``(out_features,)`` or ``None``.

    Returns:
        ``(*, out_features)``, equal to ``F.linear(input, weight, bias)``.

    Example:
        >>> linear_reference(torch.randn(2, 3), torch.randn(4, 3)).shape
        torch.Size([2, 4])
    """
    _check_linear_args(input, weight, bias)
    if bias is None:
        return LinearFunction.apply(input, weight)
    return LinearFunction.apply(input, weight, bias)
