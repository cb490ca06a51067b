"""Small, real custom Functions that each show one ``ctx`` tool of ``torch.autograd``.

* :class:`ScaledReLUInplace` -- ``ctx.mark_dirty``: an in-place op that returns the
  tensor it modified.
* :class:`SortWithIndices` -- ``ctx.mark_non_differentiable``: sorted values plus their
  ``int64`` indices, which have no gradient.
* :class:`SinCos` -- ``ctx.set_materialize_grads(False)``: two outputs, and a backward
  that accepts ``None`` for the gradient of an output that was not used.

(``once_differentiable`` is shown by
:class:`convbn.reference.batchnorm2d.BatchNorm2dFunction` and
:class:`convbn.reference.double_backward.CubeOnceDifferentiable`.)
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
from torch import Tensor

__all__ = [
    "ScaledReLUInplace",
    "scaled_relu_",
    "SortWithIndices",
    "sort_with_indices",
    "SinCos",
    "sin_cos",
]


class ScaledReLUInplace(torch.autograd.Function):
    """In-place ``x <- scale * relu(x)``; uses ``ctx.mark_dirty``.

    .. math::
        y = s \\max(x, 0), \\qquad
        \\frac{\\partial L}{\\partial x} = s \\, g \\, [y > 0] \\quad (s > 0)

    The input's memory is overwritten, so the input itself cannot be saved; the output
    is saved instead (with ``s > 0``, ``y > 0`` exactly where ``x > 0``). ``mark_dirty``
    tells autograd that the returned tensor *is* the modified input, so it bumps the
    version counter and rewires the tensor's history to this node; anything else that
    saved the old values then fails loudly instead of using overwritten data.

    Args (of :meth:`apply`):
        input: any floating tensor that is not a leaf requiring grad (autograd forbids
            in-place ops on those).
        scale: positive float.

    Returns:
        ``input`` itself, modified.

    Example:
        >>> x = torch.randn(5, requires_grad=True)
        >>> y = scaled_relu_(x.clone(), 2.0)
        >>> y.backward(torch.ones(5))
    """

    @staticmethod
    def forward(ctx: Any, input: Tensor, scale: float) -> Tensor:
        input.clamp_(min=0).mul_(scale)
        ctx.mark_dirty(input)
        ctx.scale = scale
        ctx.save_for_backward(input)
        return input

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> Tuple[Optional[Tensor], ...]:
        (output,) = ctx.saved_tensors
        grads: list = [None] * len(ctx.needs_input_grad)  # scale gets no gradient
        if ctx.needs_input_grad[0]:
            grads[0] = grad_output * (output > 0).to(grad_output.dtype) * ctx.scale
        return tuple(grads)


def scaled_relu_(input: Tensor, scale: float = 1.0) -> Tensor:
    """Functional entry point of :class:`ScaledReLUInplace` (modifies ``input``).

    Args:
        input: floating tensor; not a leaf that requires grad.
        scale: positive float multiplier.

    Returns:
        ``input``, now holding ``scale * relu(input)``.

    Example:
        >>> scaled_relu_(torch.tensor([-1.0, 2.0]), 3.0)
        tensor([0., 6.])
    """
    if not isinstance(input, Tensor):
        raise TypeError(f"expected a Tensor input, but got {type(input).__name__}")
    if not input.is_floating_point():
        raise TypeError(f"expected a floating-point input, but got dtype={input.dtype}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"scale must be a positive float, but got scale={scale!r}")
    if input.is_leaf and input.requires_grad:
        raise RuntimeError(
            "scaled_relu_ cannot modify a leaf tensor that requires grad in place; "
            "pass input.clone() or apply it to a non-leaf tensor instead"
        )
    return ScaledReLUInplace.apply(input, float(scale))


class SortWithIndices(torch.autograd.Function):
    """Sort along a dim, returning values and ``int64`` indices; uses ``mark_non_differentiable``.

    .. math::
        v = x[\\pi], \\qquad \\frac{\\partial L}{\\partial x}[\\pi] = g

    i.e. the gradient of the values is scattered back to where each value came from.
    The indices are integers and carry no gradient: ``mark_non_differentiable`` says so,
    which makes them ``requires_grad=False`` and lets backward receive no gradient for
    them. They are saved (an output may be saved) to route the values' gradient.

    Args (of :meth:`apply`):
        input: floating tensor.
        dim: dimension to sort along.
        descending: sort order.

    Returns:
        ``(values, indices)``.

    Example:
        >>> values, indices = sort_with_indices(torch.tensor([3.0, 1.0, 2.0]))
        >>> indices
        tensor([1, 2, 0])
    """

    @staticmethod
    def forward(
        ctx: Any, input: Tensor, dim: int = -1, descending: bool = False
    ) -> Tuple[Tensor, Tensor]:
        values, indices = torch.sort(input, dim=dim, descending=descending)
        ctx.mark_non_differentiable(indices)
        ctx.save_for_backward(indices)
        ctx.dim = dim
        return values, indices

    @staticmethod
    def backward(
        ctx: Any, grad_values: Tensor, grad_indices: Optional[Tensor]
    ) -> Tuple[Optional[Tensor], ...]:
        (indices,) = ctx.saved_tensors
        grads: list = [None] * len(ctx.needs_input_grad)  # dim, descending: no gradient
        if ctx.needs_input_grad[0]:
            # `scatter` (not in-place) keeps this differentiable w.r.t. grad_values.
            grads[0] = torch.zeros_like(grad_values).scatter(ctx.dim, indices, grad_values)
        return tuple(grads)


def sort_with_indices(
    input: Tensor, dim: int = -1, descending: bool = False
) -> Tuple[Tensor, Tensor]:
    """Functional entry point of :class:`SortWithIndices`.

    Args:
        input: floating tensor with at least one dim.
        dim: dimension to sort along.
        descending: sort from largest to smallest.

    Returns:
        ``(values, indices)``; only ``values`` is differentiable.

    Example:
        >>> sort_with_indices(torch.tensor([[2.0, 1.0]]), dim=1)[0]
        tensor([[1., 2.]])
    """
    if not isinstance(input, Tensor):
        raise TypeError(f"expected a Tensor input, but got {type(input).__name__}")
    if input.dim() == 0:
        raise ValueError("expected a tensor with at least one dimension, but got a 0-d tensor")
    if not -input.dim() <= dim < input.dim():
        raise ValueError(
            f"dim must be in [{-input.dim()}, {input.dim() - 1}] for a {input.dim()}-D input, "
            f"but got dim={dim!r}"
        )
    return SortWithIndices.apply(input, dim, descending)


class SinCos(torch.autograd.Function):
    """``(sin x, cos x)`` whose backward handles unused outputs; uses ``set_materialize_grads(False)``.

    .. math::
        \\frac{\\partial L}{\\partial x} = g_{\\sin} \\cos x - g_{\\cos} \\sin x

    By default autograd hands backward a tensor of zeros for every output that did not
    reach the loss. With ``ctx.set_materialize_grads(False)`` it passes ``None``
    instead, so backward skips that term and no zero tensor is ever allocated.

    Args (of :meth:`apply`):
        input: floating tensor.

    Returns:
        ``(sin(input), cos(input))``.

    Example:
        >>> x = torch.zeros(3, requires_grad=True)
        >>> s, _ = sin_cos(x)
        >>> s.backward(torch.ones(3))
        >>> x.grad
        tensor([1., 1., 1.])
    """

    @staticmethod
    def forward(ctx: Any, input: Tensor) -> Tuple[Tensor, Tensor]:
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(input)
        return torch.sin(input), torch.cos(input)

    @staticmethod
    def backward(
        ctx: Any, grad_sin: Optional[Tensor], grad_cos: Optional[Tensor]
    ) -> Tuple[Optional[Tensor]]:
        if not ctx.needs_input_grad[0] or (grad_sin is None and grad_cos is None):
            return (None,)
        (input,) = ctx.saved_tensors
        grad_input: Optional[Tensor] = None
        if grad_sin is not None:
            grad_input = grad_sin * torch.cos(input)
        if grad_cos is not None:
            term = grad_cos * torch.sin(input)
            grad_input = -term if grad_input is None else grad_input - term
        return (grad_input,)


def sin_cos(input: Tensor) -> Tuple[Tensor, Tensor]:
    """Functional entry point of :class:`SinCos`.

    Args:
        input: floating tensor.

    Returns:
        ``(sin(input), cos(input))``.

    Example:
        >>> s, c = sin_cos(torch.zeros(2))
        >>> c
        tensor([1., 1.])
    """
    if not isinstance(input, Tensor):
        raise TypeError(f"expected a Tensor input, but got {type(input).__name__}")
    return SinCos.apply(input)
