"""A ``torch.nn.Linear`` look-alike built on the reference :class:`LinearFunction`."""
from __future__ import annotations

import math
from typing import Optional, Union

import torch
from torch import Tensor, nn

from convbn.autograd.linear import LinearFunction

__all__ = ["Linear"]


class Linear(nn.Module):
    """``y = x W^T + b`` through :class:`~convbn.autograd.linear.LinearFunction`.

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
