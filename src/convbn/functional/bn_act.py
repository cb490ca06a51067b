"""One chain layer's element-wise work as pure functions: BN statistics + normalise + activation
forward, and the rebuild + activation backward + BN backward in backward.

These are written for a compiler (inductor) to fuse into few passes over memory; run eagerly
they are the same maths as the ATen path (``native_batch_norm`` + activation; ``bn_apply`` +
activation backward + ``native_batch_norm_backward``), in float64 equal to it up to rounding.

# Note: [one layer's element-wise passes]
# With x̂ = (y - μ)·σ⁻¹, z = γ·x̂ + β, out = f(z), g = ∂L/∂out, n = N·H·W:
#   forward:  μ, σ² = mean/var of y per channel           (1 read of y)
#             out = f(y·a + c), a = γσ⁻¹, c = β - μa       (1 read, 1 write)
#   backward: g_z = g·f'(y·a + c)                            (rebuilt, never stored)
#             Σg_z, Σg_z·x̂ per channel                      (1 read of g and y)
#             ∂L/∂y = a·(g_z - Σg_z/n - x̂·Σg_z x̂/n)           (1 read of g and y, 1 write)
# The ATen path stores z (or out) and g_z between kernels: forward reads y twice and writes
# and rereads z for the activation; backward rebuilds z (1 read, 1 write), runs the
# activation backward (2 reads, 1 write), then batch-norm backward (2 reads, then 2 reads
# and 1 write): 10 tensor-sized transfers against the fused 5.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from .activations import Activation

__all__ = ["bn_act_forward", "bn_act_backward", "element_passes"]


def _cv(t: Tensor, ndim: int) -> Tensor:
    return t.reshape((1, -1) + (1,) * (ndim - 2))


def _dims(y: Tensor) -> List[int]:
    return [0] + list(range(2, y.dim()))


def bn_act_forward(y: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float,
                   act: Activation) -> Tuple[Tensor, Tensor, Tensor]:
    """Training-mode BN with batch statistics, then ``act``: ``(out, mean, invstd)``.

    Args:
        y: the conv output ``(N, C, *)``.
        weight, bias: BN's affine parameters (``None`` for an absent one).
        eps: BN's epsilon.
        act: the activation.

    Returns:
        ``out`` in ``y``'s dtype and ``mean``/``invstd`` ``(C,)`` in float32 (float64 for a
        float64 ``y``), as ``native_batch_norm`` returns them.

    Example:
        >>> y = torch.randn(2, 3, 4, 4)
        >>> out, mean, invstd = bn_act_forward(y, None, None, 1e-5, Activation("relu"))
        >>> out.shape, mean.shape
        (torch.Size([2, 3, 4, 4]), torch.Size([3]))
    """
    acc = torch.float64 if y.dtype == torch.float64 else torch.float32
    yf = y.to(acc)
    var, mean = torch.var_mean(yf, _dims(y), correction=0)
    invstd = torch.rsqrt(var + eps)
    scale = invstd if weight is None else invstd * weight.to(acc)
    shift = -mean * scale if bias is None else bias.to(acc) - mean * scale
    z = yf * _cv(scale, y.dim()) + _cv(shift, y.dim())
    return act(z).to(y.dtype), mean, invstd


def bn_act_backward(grad_out: Tensor, y: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                    mean: Tensor, invstd: Tensor, act: Activation) -> Tuple[Tensor, Tensor, Tensor]:
    """Backward of :func:`bn_act_forward` from ``y`` and the saved statistics: the activation's
    input is rebuilt inside (Note: [one layer's element-wise passes]).

    Args:
        grad_out: the gradient of the layer's output.
        y: the conv output (kept or recomputed).
        weight, bias: BN's affine parameters.
        mean, invstd: the batch statistics forward used.
        act: the activation.

    Returns:
        ``(grad_y, grad_weight, grad_bias)``; the parameter gradients in ``mean``'s dtype.

    Example:
        >>> y, g = torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4)
        >>> _, mean, invstd = bn_act_forward(y, None, None, 1e-5, Activation("relu"))
        >>> bn_act_backward(g, y, None, None, mean, invstd, Activation("relu"))[0].shape
        torch.Size([2, 3, 4, 4])
    """
    acc = mean.dtype
    nd = y.dim()
    n = y.numel() // y.shape[1]
    scale = invstd if weight is None else invstd * weight.to(acc)
    shift = -mean * scale if bias is None else bias.to(acc) - mean * scale
    yf = y.to(acc)
    z = yf * _cv(scale, nd) + _cv(shift, nd)
    gz = act.backward(grad_out.to(acc), z)
    xhat = (yf - _cv(mean, nd)) * _cv(invstd, nd)
    sum_g = gz.sum(_dims(y))
    sum_gx = (gz * xhat).sum(_dims(y))
    grad_y = _cv(scale, nd) * (gz - _cv(sum_g / n, nd) - xhat * _cv(sum_gx / n, nd))
    return grad_y.to(y.dtype), sum_gx, sum_g


def element_passes(fused: bool) -> Tuple[int, int]:
    """Tensor-sized transfers ``(forward, backward)`` of one layer's element-wise work
    (Note: [one layer's element-wise passes]): the fused kernels' or the ATen path's."""
    return (3, 5) if fused else (5, 10)
