"""Element-wise activations that a fused layer can apply and recompute.

An activation here is a value object with a forward (optionally in place) and a
backward written against the *pre-activation* ``z`` with PyTorch's own native
derivative kernels (``threshold_backward``, ``silu_backward`` ...), so a fused layer
that recomputes ``z`` in backward never needs the activation's output.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["Activation", "ACTIVATIONS", "get_activation", "activation_from_module"]

aten = torch.ops.aten

#: Names accepted wherever an activation is asked for.
ACTIVATIONS = ("identity", "relu", "relu6", "leaky_relu", "silu", "gelu", "hardswish")


@dataclass(frozen=True)
class Activation:
    """An element-wise activation ``out = f(z)`` with its derivative.

    Attributes:
        name: one of :data:`ACTIVATIONS`.
        negative_slope: slope of ``leaky_relu`` for ``z < 0``.
        approximate: ``gelu``'s approximation (``"none"`` or ``"tanh"``).
    """

    name: str = "identity"
    negative_slope: float = 0.01
    approximate: str = "none"

    def __post_init__(self) -> None:
        if self.name not in ACTIVATIONS:
            raise ValueError(
                f"activation must be one of {ACTIVATIONS} (or None), but got activation={self.name!r}"
            )
        if self.approximate not in ("none", "tanh"):
            raise ValueError(f"gelu approximate must be 'none' or 'tanh', but got {self.approximate!r}")

    @property
    def is_identity(self) -> bool:
        return self.name == "identity"

    def __call__(self, z: Tensor, inplace: bool = False) -> Tensor:
        """Apply the activation (differentiable unless ``inplace``)."""
        n = self.name
        if n == "identity":
            return z
        if n == "relu":
            return torch.relu_(z) if inplace else torch.relu(z)
        if n == "relu6":
            return F.hardtanh(z, 0.0, 6.0, inplace=inplace)
        if n == "leaky_relu":
            return F.leaky_relu(z, self.negative_slope, inplace=inplace)
        if n == "silu":
            return F.silu(z, inplace=inplace)
        if n == "gelu":
            return F.gelu(z, approximate=self.approximate)
        return F.hardswish(z, inplace=inplace)

    def backward(self, grad_out: Tensor, z: Tensor) -> Tensor:
        """``grad_z = grad_out * f'(z)`` with native derivative kernels (first order only)."""
        n = self.name
        if n == "identity":
            return grad_out
        if n == "relu":
            return aten.threshold_backward(grad_out, z, 0)
        if n == "relu6":
            return aten.hardtanh_backward(grad_out, z, 0.0, 6.0)
        if n == "leaky_relu":
            return aten.leaky_relu_backward(grad_out, z, self.negative_slope, False)
        if n == "silu":
            return aten.silu_backward(grad_out, z)
        if n == "gelu":
            return aten.gelu_backward(grad_out, z, approximate=self.approximate)
        return aten.hardswish_backward(grad_out, z)

    @property
    def output_derivable(self) -> bool:
        """``f'(z)`` is a function of the output ``f(z)`` (ReLU family): backward needs no ``z``."""
        return self.name in ("identity", "relu", "relu6") or (self.name == "leaky_relu" and self.negative_slope > 0)

    def backward_(self, grad_out: Tensor, z: Tensor) -> Tensor:
        """:meth:`backward` written into ``z``'s buffer (``z`` is consumed): one fewer
        activation-sized allocation in the fused layers' backward."""
        n = self.name
        if n == "identity":
            return grad_out
        if n == "relu":
            return aten.threshold_backward.grad_input(grad_out, z, 0, grad_input=z)
        if n == "relu6":
            return aten.hardtanh_backward.grad_input(grad_out, z, 0.0, 6.0, grad_input=z)
        if n == "leaky_relu":
            return aten.leaky_relu_backward.grad_input(grad_out, z, self.negative_slope, False, grad_input=z)
        if n == "silu":
            return aten.silu_backward.grad_input(grad_out, z, grad_input=z)
        if n == "gelu":
            return aten.gelu_backward.grad_input(grad_out, z, approximate=self.approximate, grad_input=z)
        return aten.hardswish_backward.out(grad_out, z, out=z)

    def backward_from_output_(self, grad_out: Tensor, out: Tensor) -> Tensor:
        """``grad_z`` from the activation's *output*, written into ``out`` (see :attr:`output_derivable`)."""
        n = self.name
        if n == "identity":
            return grad_out
        if n == "relu":
            return aten.threshold_backward.grad_input(grad_out, out, 0, grad_input=out)
        if n == "relu6":
            return aten.hardtanh_backward.grad_input(grad_out, out, 0.0, 6.0, grad_input=out)
        if n == "leaky_relu" and self.negative_slope > 0:
            return aten.leaky_relu_backward.grad_input(grad_out, out, self.negative_slope, True, grad_input=out)
        raise ValueError(f"the derivative of {self} is not a function of its output")

    def module(self) -> nn.Module:
        """An equivalent ``nn`` module (for eager baselines and unfused fallbacks)."""
        n = self.name
        if n == "identity":
            return nn.Identity()
        if n == "relu":
            return nn.ReLU()
        if n == "relu6":
            return nn.ReLU6()
        if n == "leaky_relu":
            return nn.LeakyReLU(self.negative_slope)
        if n == "silu":
            return nn.SiLU()
        if n == "gelu":
            return nn.GELU(approximate=self.approximate)
        return nn.Hardswish()

    def __str__(self) -> str:
        if self.name == "leaky_relu":
            return f"leaky_relu({self.negative_slope})"
        if self.name == "gelu" and self.approximate != "none":
            return f"gelu({self.approximate})"
        return self.name


_MODULE_TYPES: Dict[type, Callable[[Any], Activation]] = {
    nn.Identity: lambda m: Activation("identity"),
    nn.ReLU: lambda m: Activation("relu"),
    nn.ReLU6: lambda m: Activation("relu6"),
    nn.LeakyReLU: lambda m: Activation("leaky_relu", negative_slope=float(m.negative_slope)),
    nn.SiLU: lambda m: Activation("silu"),
    nn.GELU: lambda m: Activation("gelu", approximate=m.approximate),
    nn.Hardswish: lambda m: Activation("hardswish"),
}


def activation_from_module(module: nn.Module) -> Optional[Activation]:
    """The :class:`Activation` equivalent to ``module``, or ``None`` if it has none.

    ``nn.Hardtanh(0, 6)`` is recognised as ``relu6``. Subclasses match their base.
    """
    for cls, make in _MODULE_TYPES.items():
        if type(module) is cls:
            return make(module)
    if type(module) is nn.Hardtanh and module.min_val == 0.0 and module.max_val == 6.0:
        return Activation("relu6")
    return None


def get_activation(activation: Union[None, str, Activation, nn.Module]) -> Activation:
    """Normalise ``None`` / a name / an ``nn`` module / an :class:`Activation`.

    Args:
        activation: ``None`` (identity), a name from :data:`ACTIVATIONS`, an
            :class:`Activation`, or an ``nn.ReLU``/``nn.ReLU6``/``nn.LeakyReLU``/
            ``nn.SiLU``/``nn.GELU``/``nn.Hardswish``/``nn.Identity`` instance.

    Returns:
        The :class:`Activation`.

    Raises:
        ValueError: unknown name (the message lists the allowed ones).
        TypeError: an unsupported type or module.

    Example:
        >>> get_activation("relu").name
        'relu'
    """
    if activation is None:
        return Activation("identity")
    if isinstance(activation, Activation):
        return activation
    if isinstance(activation, str):
        return Activation(activation.lower())
    if isinstance(activation, nn.Module):
        act = activation_from_module(activation)
        if act is None:
            raise TypeError(
                f"activation module {type(activation).__name__} is not supported; "
                f"use one of {ACTIVATIONS} or the matching nn module"
            )
        return act
    raise TypeError(
        f"activation must be None, a str in {ACTIVATIONS}, an nn activation module or an "
        f"Activation, but got {type(activation).__name__}"
    )
