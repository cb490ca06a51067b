"""Reference linear layer as a custom :class:`torch.autograd.Function`, and its module.

Shows the basic custom-Function pattern: ``save_for_backward`` for what backward reads,
``ctx.needs_input_grad`` so each gradient is computed only when asked for, and an
optional input (the bias) whose gradient slot is ``None`` when it is absent.
:class:`Linear` is a ``torch.nn.Linear`` look-alike built on it.
"""
from __future__ import annotations

import math
from typing import Any, Optional, Tuple, Union

import torch
from torch import Tensor, nn

__all__ = ["Linear", "LinearFunction", "linear_reference"]


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


class Linear(nn.Module):
    """``y = x W^T + b`` through :class:`LinearFunction`.

    Same parameters, names, shapes and initialisation as :class:`torch.nn.Linear`, so
    its ``state_dict`` is interchangeable with one.

    Args:
        in_features: size of each input sample.
        out_features: size of each output sample.
        bias: whether to learn an additive bias (default ``True``).
        device: device of the parameters.
        dtype: dtype of the parameters.

    Example:
        >>> layer = Linear(3, 4)
        >>> layer(torch.randn(2, 3)).shape
        torch.Size([2, 4])
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: Optional[Union[torch.device, str]] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        for name, value in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, but got {name}={value!r}")
        if not isinstance(bias, bool):
            raise TypeError(f"bias must be a bool, but got bias={bias!r}")
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, device=device, dtype=dtype)
        )
        if bias:
            self.bias: Optional[nn.Parameter] = nn.Parameter(
                torch.empty(out_features, device=device, dtype=dtype)
            )
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialise like ``nn.Linear``.

        Weight: kaiming-uniform with ``a=sqrt(5)``, i.e. ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``;
        bias: ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``.

        Returns:
            None; parameters are overwritten in place.

        Example:
            >>> Linear(3, 4).reset_parameters()
        """
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1.0 / math.sqrt(self.in_features) if self.in_features > 0 else 0.0
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, input: Tensor) -> Tensor:
        """Apply the layer.

        Args:
            input: ``(*, in_features)``.

        Returns:
            ``(*, out_features)``.

        Example:
            >>> Linear(3, 4, bias=False)(torch.randn(5, 3)).shape
            torch.Size([5, 4])
        """
        if self.bias is None:
            return LinearFunction.apply(input, self.weight)
        return LinearFunction.apply(input, self.weight, self.bias)

    def extra_repr(self) -> str:
        """Summary shown by ``repr``.

        Returns:
            ``"in_features=3, out_features=4, bias=True"`` style string.

        Example:
            >>> Linear(3, 4)
            Linear(in_features=3, out_features=4, bias=True)
        """
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}"
        )
