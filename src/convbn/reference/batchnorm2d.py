"""Reference training-mode BatchNorm2d as a custom :class:`torch.autograd.Function`.

This reproduces the BatchNorm of the PyTorch tutorial "Fusing Convolution and Batch
Norm using Custom Function", which differs from :class:`torch.nn.BatchNorm2d` on
purpose, so it must not be compared with it directly:

* eps is added *outside* the square root, ``(X - mean) / (sqrt(var) + eps)``;
* the variance used for normalising is the *unbiased* one (divide by ``M - 1``);
* ``eps=1e-3`` by default, ``affine=False``, no running statistics, training mode only.

:func:`batch_norm2d_formula` writes the same maths with plain differentiable ops and is
what :class:`BatchNorm2dFunction` is tested against.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

__all__ = [
    "BatchNorm2dFunction",
    "batch_norm2d_reference",
    "batch_norm2d_formula",
    "batch_norm2d_stats",
    "batch_norm2d_backward",
]

_REDUCE_DIMS = (0, 2, 3)


def _per_channel(t: Tensor) -> Tensor:
    """View a ``(C,)`` tensor as ``(1, C, 1, 1)`` so it broadcasts over ``(N, C, H, W)``."""
    return t.view(1, -1, 1, 1)


def _check_bn_args(input: Tensor, eps: float) -> int:
    """Validate input and eps; return ``M``, the number of values per channel."""
    if not isinstance(input, Tensor):
        raise TypeError(f"expected a Tensor input, but got {type(input).__name__}")
    if input.dim() != 4:
        raise ValueError(
            f"expected a 4-D input (N, C, H, W), but got shape {tuple(input.shape)}"
        )
    if not input.is_floating_point():
        raise TypeError(f"expected a floating-point input, but got dtype={input.dtype}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps < 0:
        raise ValueError(f"eps must be a non-negative float, but got eps={eps!r}")
    per_channel = input.numel() // max(input.shape[1], 1)
    if per_channel < 2:
        raise ValueError(
            "expected more than 1 value per channel for the unbiased variance, but the "
            f"input of shape {tuple(input.shape)} has {per_channel}"
        )
    return per_channel


def batch_norm2d_stats(input: Tensor) -> Tuple[Tensor, Tensor]:
    """Per-channel mean and square root of the *unbiased* variance.

    .. math::
        \\mu_c = \\frac{1}{M} \\sum_i x_{ci}, \\qquad
        \\sqrt{v_c} = \\sqrt{\\frac{1}{M - 1} \\sum_i (x_{ci} - \\mu_c)^2}

    Args:
        input: ``(N, C, H, W)``; ``M = N * H * W`` values per channel.

    Returns:
        ``(mean, sqrt_var)``, each ``(C,)``.

    Example:
        >>> mean, sqrt_var = batch_norm2d_stats(torch.randn(4, 3, 5, 5))
        >>> mean.shape, sqrt_var.shape
        (torch.Size([3]), torch.Size([3]))
    """
    per_channel = _check_bn_args(input, 0.0)
    mean = input.sum(dim=_REDUCE_DIMS) / per_channel
    centred = input - _per_channel(mean)
    var = centred.square().sum(dim=_REDUCE_DIMS) / (per_channel - 1)
    return mean, var.sqrt()


def batch_norm2d_formula(input: Tensor, eps: float = 1e-3) -> Tensor:
    """The tutorial's BatchNorm written with plain differentiable ops (eager oracle).

    .. math::
        y = \\frac{x - \\mu}{\\sqrt{v} + \\epsilon}, \\qquad v \\text{ unbiased}

    Args:
        input: ``(N, C, H, W)``.
        eps: added outside the square root.

    Returns:
        Normalised tensor, same shape; autograd differentiates it to any order.

    Example:
        >>> y = batch_norm2d_formula(torch.randn(4, 3, 5, 5))
        >>> y.shape
        torch.Size([4, 3, 5, 5])
    """
    _check_bn_args(input, eps)
    mean = input.mean(dim=_REDUCE_DIMS, keepdim=True)
    sqrt_var = input.var(dim=_REDUCE_DIMS, unbiased=True, keepdim=True).sqrt()
    return (input - mean) / (sqrt_var + eps)


def batch_norm2d_backward(  # over 60 lines for the tutorial's derivation in its docstring; the body is ~30
    grad_output: Tensor,
    input: Tensor,
    mean: Tensor,
    sqrt_var: Tensor,
    eps: float,
) -> Tensor:
    """Input gradient of the tutorial BatchNorm, into a single new ``(N, C, H, W)`` buffer.

    Per channel, with :math:`M` values, :math:`r = 1 / (\\sqrt{v} + \\epsilon)` and
    :math:`y_i = (x_i - \\mu) r`, the input reaches :math:`y_i` three ways: directly,
    through :math:`\\mu` and through :math:`r`. Since
    :math:`\\partial \\mu / \\partial x_i = 1/M`,
    :math:`\\partial r / \\partial \\sqrt{v} = -r^2`,
    :math:`\\partial \\sqrt{v} / \\partial v = 1 / (2\\sqrt{v})` and
    :math:`\\partial v / \\partial x_i = 2 (x_i - \\mu) / (M - 1)` (the path of
    :math:`v` through :math:`\\mu` vanishes because :math:`\\sum_j (x_j - \\mu) = 0`):

    .. math::
        \\frac{\\partial L}{\\partial x_i}
        = r \\, (g_i - \\bar g) - k \\, (x_i - \\mu), \\qquad
        k = \\frac{r^2}{(M - 1) \\sqrt{v}} \\sum_j g_j (x_j - \\mu),
        \\qquad \\bar g = \\frac{1}{M} \\sum_j g_j

    Args:
        grad_output: ``g``, ``(N, C, H, W)``.
        input: the BatchNorm input ``x``, ``(N, C, H, W)``.
        mean: ``(C,)`` per-channel mean of ``input``.
        sqrt_var: ``(C,)`` square root of the unbiased variance of ``input``.
        eps: the eps of the forward (outside the square root).

    Returns:
        ``grad_input``, ``(N, C, H, W)``. Computed with in-place ops: not differentiable.

    Example:
        >>> x, g = torch.randn(4, 3, 5, 5), torch.randn(4, 3, 5, 5)
        >>> mean, sqrt_var = batch_norm2d_stats(x)
        >>> batch_norm2d_backward(g, x, mean, sqrt_var, 1e-3).shape
        torch.Size([4, 3, 5, 5])
    """
    per_channel = input.numel() // input.shape[1]
    inv_denom = 1.0 / (sqrt_var + eps)  # r, (C,)
    grad_mean = grad_output.sum(dim=_REDUCE_DIMS) / per_channel  # g-bar, (C,)

    # Note: [one N×C×H×W buffer]
    # Every full-size quantity below is built inside `grad_input`, the tensor we return;
    # the only other allocations are per-channel (C,) vectors.
    #   1. grad_input <- x - mu                    (the one allocation)
    #   2. grad_input *= g; reduce -> sum_j g_j (x_j - mu)          (C,)
    #   3. grad_input <- x - mu again (written with out=, no new memory), * (-k)
    #   4. grad_input += r * g   (addcmul_ broadcasts r, no temporary)
    #   5. grad_input -= r * g-bar
    # Step 3 recomputes x - mu instead of keeping a second buffer for it, and
    # reduces g * (x - mu) rather than g * x - mu * sum(g), which would cancel badly
    # in low precision when |mu| is large.
    grad_input = input - _per_channel(mean)
    grad_input.mul_(grad_output)
    centred_dot = grad_input.sum(dim=_REDUCE_DIMS)
    coeff = inv_denom.square() * centred_dot / ((per_channel - 1) * sqrt_var)  # k, (C,)
    torch.sub(input, _per_channel(mean), out=grad_input)
    grad_input.mul_(_per_channel(-coeff))
    grad_input.addcmul_(grad_output, _per_channel(inv_denom))
    grad_input.sub_(_per_channel(inv_denom * grad_mean))
    return grad_input


class BatchNorm2dFunction(torch.autograd.Function):
    """Training-mode BatchNorm2d of the tutorial, with a memory-lean backward.

    .. math::
        y = \\frac{x - \\mu}{\\sqrt{v} + \\epsilon}

    with per-channel :math:`\\mu` and unbiased :math:`v` (see
    :func:`batch_norm2d_backward` for the derivation of the gradient).

    Saved for backward: the input and two ``(C,)`` vectors (mean and ``sqrt(var)``);
    the output is not kept. The backward accumulates in place into one buffer, so it
    is marked ``once_differentiable``: a second differentiation raises a clear error
    instead of silently giving a wrong answer.

    A channel with zero variance has an undefined gradient (``sqrt`` has infinite slope
    at 0); like autograd through the eager formula, backward then returns NaN for it.

    Args (of :meth:`apply`):
        input: ``(N, C, H, W)`` floating tensor with ``N * H * W > 1``.
        eps: float, default ``1e-3``, added outside the square root.

    Returns:
        Normalised tensor of the input's shape.

    Example:
        >>> x = torch.randn(3, 2, 4, 4, dtype=torch.float64, requires_grad=True)
        >>> torch.autograd.gradcheck(BatchNorm2dFunction.apply, (x,))
        True
    """

    @staticmethod
    def forward(ctx: Any, input: Tensor, eps: float = 1e-3) -> Tensor:
        per_channel = _check_bn_args(input, eps)
        x_sum = input.sum(dim=_REDUCE_DIMS)
        mean = x_sum / per_channel
        # `output` starts as x - mu; it is squared into a temporary for the variance and
        # then divided in place, so forward allocates one full-size result buffer.
        output = input - _per_channel(mean)
        var = output.square().sum(dim=_REDUCE_DIMS) / (per_channel - 1)
        sqrt_var = var.sqrt()
        output.div_(_per_channel(sqrt_var + eps))
        ctx.eps = eps
        ctx.save_for_backward(input, mean, sqrt_var)
        return output

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_output: Tensor) -> Tuple[Optional[Tensor], ...]:
        input, mean, sqrt_var = ctx.saved_tensors
        grad_input = None
        if ctx.needs_input_grad[0]:
            grad_input = batch_norm2d_backward(grad_output, input, mean, sqrt_var, ctx.eps)
        grads = [grad_input] + [None] * (len(ctx.needs_input_grad) - 1)
        return tuple(grads)


def batch_norm2d_reference(input: Tensor, eps: float = 1e-3) -> Tensor:
    """Functional entry point of :class:`BatchNorm2dFunction`.

    Args:
        input: ``(N, C, H, W)`` floating tensor with more than one value per channel.
        eps: added outside the square root (default ``1e-3``, as in the tutorial).

    Returns:
        ``(input - mean) / (sqrt(unbiased_var) + eps)`` per channel.

    Example:
        >>> x = torch.randn(4, 3, 5, 5)
        >>> torch.testing.assert_close(batch_norm2d_reference(x), batch_norm2d_formula(x))
    """
    _check_bn_args(input, eps)
    return BatchNorm2dFunction.apply(input, eps)
