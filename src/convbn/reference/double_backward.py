"""Gallery of custom Functions that do (and one that does not) support double backward.

Double backward differentiates the *backward* pass. Autograd records backward's ops
when it runs with ``create_graph=True``, so a custom backward is differentiable as long
as every tensor it reads is connected to the forward graph: the Function's inputs and
outputs are (autograd knows how they depend on the inputs), anything else is a constant.

* :class:`Square` -- saves an *input*: ``x**2``, backward ``2 x g``.
* :class:`Exp` -- saves an *output*: ``exp(x)``, backward ``exp(x) g``.
* :class:`Sinh` -- saves *intermediates* the right way: returns ``exp(x)`` and
  ``exp(-x)`` as extra outputs so autograd tracks them (wrapper :func:`sinh`).
* :class:`SinhWrong` -- the mistake: stashes the intermediates as ``ctx`` attributes.
  First derivatives are right; the second derivative is silently wrong (the stash is a
  constant to autograd), and ``gradgradcheck`` catches it.
* :class:`Cube` -- a backward autograd cannot trace (it goes through NumPy), wrapped in
  its own Function :class:`CubeBackward` with a hand-written backward, so double
  backward still works. :class:`CubeOnceDifferentiable` is the same maths without the
  wrapper: first order only.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

__all__ = [
    "Square",
    "Exp",
    "Sinh",
    "SinhWrong",
    "Cube",
    "CubeBackward",
    "CubeOnceDifferentiable",
    "square",
    "exp",
    "sinh",
    "sinh_wrong",
    "cube",
]


def _check_tensor(input: Any) -> Tensor:
    """Raise a TypeError unless ``input`` is a floating-point Tensor; return it."""
    if not isinstance(input, Tensor):
        raise TypeError(f"expected a Tensor input, but got {type(input).__name__}")
    if not (input.is_floating_point() or input.is_complex()):
        raise TypeError(f"expected a floating-point input, but got dtype={input.dtype}")
    return input


class Square(torch.autograd.Function):
    """``x**2``, saving the input.

    .. math::
        y = x^2, \\qquad \\frac{\\partial L}{\\partial x} = 2 x g

    ``x`` is an input, so when backward runs under ``create_graph=True`` the product
    ``2 * x * g`` is recorded against the real ``x`` and can be differentiated again.

    Example:
        >>> x = torch.tensor([3.0], dtype=torch.float64, requires_grad=True)
        >>> torch.autograd.gradgradcheck(Square.apply, (x,))
        True
    """

    @staticmethod
    def forward(ctx: Any, input: Tensor) -> Tensor:
        ctx.save_for_backward(input)
        return input**2

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> Tensor:
        (input,) = ctx.saved_tensors
        return 2 * input * grad_output


class Exp(torch.autograd.Function):
    """``exp(x)``, saving the output.

    .. math::
        y = e^x, \\qquad \\frac{\\partial L}{\\partial x} = y \\, g

    Saving the output (instead of recomputing ``exp``) is fine for double backward:
    the saved ``y`` is unpacked with its history, so autograd differentiates through it
    back into this Function.

    Example:
        >>> x = torch.tensor([0.5], dtype=torch.float64, requires_grad=True)
        >>> torch.autograd.gradgradcheck(Exp.apply, (x,))
        True
    """

    @staticmethod
    def forward(ctx: Any, input: Tensor) -> Tensor:
        output = input.exp()
        ctx.save_for_backward(output)
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> Tensor:
        (output,) = ctx.saved_tensors
        return output * grad_output


class Sinh(torch.autograd.Function):
    """``sinh(x)`` that saves ``exp(x)`` and ``exp(-x)`` by *returning* them.

    .. math::
        y = \\tfrac{1}{2}(e^{x} - e^{-x}), \\qquad
        \\frac{\\partial L}{\\partial x} =
        \\tfrac{1}{2}(e^{x} + e^{-x})\\, g_y + e^{x} g_{e^x} - e^{-x} g_{e^{-x}}

    Returned tensors are outputs, so autograd knows how they depend on ``x``; saving
    them is then as good as saving an output (see :class:`Exp`). Because they are real
    outputs, gradients may flow into them too (during double backward they do), hence
    the two extra terms in backward. Use :func:`sinh` to get only the first output.

    Example:
        >>> x = torch.tensor([0.5], dtype=torch.float64, requires_grad=True)
        >>> torch.autograd.gradgradcheck(sinh, (x,))
        True
    """

    @staticmethod
    def forward(ctx: Any, input: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        exp_pos = input.exp()
        exp_neg = (-input).exp()
        ctx.save_for_backward(exp_pos, exp_neg)
        return (exp_pos - exp_neg) / 2, exp_pos, exp_neg

    @staticmethod
    def backward(
        ctx: Any, grad_output: Tensor, grad_exp_pos: Tensor, grad_exp_neg: Tensor
    ) -> Tensor:
        exp_pos, exp_neg = ctx.saved_tensors
        grad_input = grad_output * (exp_pos + exp_neg) / 2
        grad_input = grad_input + grad_exp_pos * exp_pos
        grad_input = grad_input - grad_exp_neg * exp_neg
        return grad_input


class SinhWrong(torch.autograd.Function):
    """``sinh(x)`` that stashes its intermediates on ``ctx`` -- the mistake, kept as a warning.

    .. math::
        \\frac{\\partial L}{\\partial x} = \\tfrac{1}{2}(e^{x} + e^{-x})\\, g

    ``forward`` runs with gradient recording off, so ``exp(x)`` computed there has no
    history; stored as ``ctx.exp_pos`` it is a *constant* to autograd. Backward's result
    is right, but under ``create_graph=True`` it depends on ``x`` only through nothing:
    the second derivative comes out as ``0`` instead of ``sinh(x) g``. No error is
    raised; ``gradgradcheck`` compares with finite differences and catches it.

    Example:
        >>> x = torch.tensor([0.5], dtype=torch.float64, requires_grad=True)
        >>> torch.autograd.gradgradcheck(SinhWrong.apply, (x,), raise_exception=False)
        False
    """

    @staticmethod
    def forward(ctx: Any, input: Tensor) -> Tensor:
        exp_pos = input.exp()
        exp_neg = (-input).exp()
        # WRONG: plain attributes bypass save_for_backward, so no history is kept.
        ctx.exp_pos = exp_pos
        ctx.exp_neg = exp_neg
        return (exp_pos - exp_neg) / 2

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> Tensor:
        return grad_output * (ctx.exp_pos + ctx.exp_neg) / 2


def _cube_grad_numpy(grad_output: Tensor, input: Tensor) -> Tensor:
    """``3 x^2 g`` computed in NumPy: correct numbers, invisible to autograd."""
    x = input.detach().cpu().numpy()
    g = grad_output.detach().cpu().numpy()
    result = torch.from_numpy(3 * x**2 * g)
    return result.to(device=input.device, dtype=torch.result_type(input, grad_output))


class CubeBackward(torch.autograd.Function):
    """The backward of :class:`Cube` as a Function of its own: ``(g, x) -> 3 x^2 g``.

    .. math::
        b(g, x) = 3 x^2 g, \\qquad
        \\frac{\\partial L}{\\partial g} = 3 x^2 \\, h, \\qquad
        \\frac{\\partial L}{\\partial x} = 6 x g \\, h

    where ``h`` is the gradient flowing into ``b``. Its forward may use anything (here
    NumPy) because autograd never traces a Function's forward; its backward is written
    by hand with torch ops on saved inputs, so it is differentiable again.

    Example:
        >>> g = torch.tensor([1.0], dtype=torch.float64, requires_grad=True)
        >>> x = torch.tensor([2.0], dtype=torch.float64, requires_grad=True)
        >>> torch.autograd.gradcheck(CubeBackward.apply, (g, x))
        True
    """

    @staticmethod
    def forward(ctx: Any, grad_output: Tensor, input: Tensor) -> Tensor:
        ctx.save_for_backward(grad_output, input)
        return _cube_grad_numpy(grad_output, input)

    @staticmethod
    def backward(ctx: Any, grad_grad: Tensor) -> Tuple[Optional[Tensor], Optional[Tensor]]:
        grad_output, input = ctx.saved_tensors
        needs = ctx.needs_input_grad
        grads: list = [None] * len(needs)
        if needs[0]:
            grads[0] = grad_grad * 3 * input**2
        if needs[1]:
            grads[1] = grad_grad * 6 * input * grad_output
        return tuple(grads)


class Cube(torch.autograd.Function):
    """``x**3`` whose backward is the untraceable :class:`CubeBackward`.

    .. math::
        y = x^3, \\qquad \\frac{\\partial L}{\\partial x} = 3 x^2 g

    Example:
        >>> x = torch.tensor([2.0], dtype=torch.float64, requires_grad=True)
        >>> torch.autograd.gradgradcheck(Cube.apply, (x,))
        True
    """

    @staticmethod
    def forward(ctx: Any, input: Tensor) -> Tensor:
        ctx.save_for_backward(input)
        return input**3

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> Tensor:
        (input,) = ctx.saved_tensors
        return CubeBackward.apply(grad_output, input)


class CubeOnceDifferentiable(torch.autograd.Function):
    """``x**3`` with the NumPy backward used directly; first order only.

    ``once_differentiable`` runs backward without recording and makes its result raise
    if anyone tries to differentiate it, so the missing graph cannot go unnoticed
    (compare with :class:`SinhWrong`, which fails silently).

    Example:
        >>> x = torch.tensor([2.0], dtype=torch.float64, requires_grad=True)
        >>> torch.autograd.gradcheck(CubeOnceDifferentiable.apply, (x,))
        True
    """

    @staticmethod
    def forward(ctx: Any, input: Tensor) -> Tensor:
        ctx.save_for_backward(input)
        return input**3

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_output: Tensor) -> Tensor:
        (input,) = ctx.saved_tensors
        return _cube_grad_numpy(grad_output, input)


def square(input: Tensor) -> Tensor:
    """``input**2`` via :class:`Square`.

    Args:
        input: floating tensor.

    Returns:
        ``input**2``.

    Example:
        >>> square(torch.tensor([3.0]))
        tensor([9.])
    """
    return Square.apply(_check_tensor(input))


def exp(input: Tensor) -> Tensor:
    """``exp(input)`` via :class:`Exp`.

    Args:
        input: floating tensor.

    Returns:
        ``exp(input)``.

    Example:
        >>> exp(torch.tensor([0.0]))
        tensor([1.])
    """
    return Exp.apply(_check_tensor(input))


def sinh(input: Tensor) -> Tensor:
    """``sinh(input)`` via :class:`Sinh`, dropping the two helper outputs.

    Args:
        input: floating tensor.

    Returns:
        ``sinh(input)``; differentiable to any order.

    Example:
        >>> sinh(torch.tensor([0.0]))
        tensor([0.])
    """
    return Sinh.apply(_check_tensor(input))[0]


def sinh_wrong(input: Tensor) -> Tensor:
    """``sinh(input)`` via :class:`SinhWrong` (wrong second derivative; for teaching).

    Args:
        input: floating tensor.

    Returns:
        ``sinh(input)``.

    Example:
        >>> sinh_wrong(torch.tensor([0.0]))
        tensor([0.])
    """
    return SinhWrong.apply(_check_tensor(input))


def cube(input: Tensor) -> Tensor:
    """``input**3`` via :class:`Cube` (NumPy backward, double backward supported).

    Args:
        input: floating tensor (computed through NumPy in backward, so on the CPU).

    Returns:
        ``input**3``.

    Example:
        >>> cube(torch.tensor([2.0]))
        tensor([8.])
    """
    return Cube.apply(_check_tensor(input))
