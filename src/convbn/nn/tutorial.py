"""The tutorial's fused Conv2d + BatchNorm2d module (reference, not the product layer).

:class:`TutorialFusedConvBN2d` holds only a convolution weight and applies
:class:`~convbn.autograd.tutorial_fused.TutorialFusedConvBN2dFunction`. It keeps the
tutorial's maths (no bias, eps outside the square root, unbiased variance, no affine
and no running statistics), so it behaves the same in ``train()`` and ``eval()`` mode.
The product's drop-in layers live elsewhere and are checked against this one.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from convbn.autograd.conv2d import _pair
from convbn.autograd.tutorial_fused import TutorialFusedConvBN2dFunction

__all__ = ["TutorialFusedConvBN2d"]


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
