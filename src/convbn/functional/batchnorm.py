"""BatchNorm pieces of a fused layer: statistics, normalisation and its backward.

.. math::
    z = \\gamma \\, \\frac{y - \\mu}{\\sqrt{\\sigma^2 + \\epsilon}} + \\beta

with ``mu``/``sigma^2`` the biased per-channel batch statistics when normalising with
batch statistics (training, or no running stats), or the running statistics otherwise.
Training updates ``running_mean``/``running_var`` (unbiased variance) exactly once, in
forward, through ``native_batch_norm``; every later use of the statistics (recompute,
backward) reads the saved ``mean``/``invstd`` instead.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
from torch import Tensor

__all__ = ["BNSpec", "bn_forward", "bn_apply", "bn_backward", "channel_view"]

aten = torch.ops.aten


@dataclass(frozen=True)
class BNSpec:
    """How a fused layer normalises.

    Attributes:
        eps: added to the variance inside the square root.
        batch_stats: normalise with the batch's statistics (``True`` in training, or
            whenever there are no running stats); otherwise with the running stats.
        momentum: exponential-average factor for the running-stat update (the value
            ``nn.BatchNorm`` computes, ``1/num_batches_tracked`` for ``momentum=None``).
    """

    eps: float = 1e-5
    batch_stats: bool = True
    momentum: float = 0.1


def channel_view(t: Tensor, ndim: int) -> Tensor:
    """``(C,)`` -> ``(1, C, 1, ...)`` broadcastable against an ``ndim``-D activation."""
    return t.reshape(1, -1, *([1] * (ndim - 2)))


def bn_forward(
    y: Tensor,
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    running_mean: Optional[Tensor],
    running_var: Optional[Tensor],
    spec: BNSpec,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Normalise ``y``; returns ``(z, mean, invstd)`` (``mean``/``invstd`` are ``(C,)`` float).

    With batch statistics the running stats (if given) are updated in place, once.
    """
    if spec.batch_stats:
        z, mean, invstd = torch.native_batch_norm(
            y, weight, bias, running_mean, running_var, True, spec.momentum, spec.eps
        )
        return z, mean, invstd
    if running_mean is None or running_var is None:
        raise ValueError("normalising without batch statistics needs running_mean and running_var")
    mean = running_mean.clone()
    invstd = torch.rsqrt(running_var + spec.eps)
    return bn_apply(y, mean, invstd, weight, bias), mean, invstd


def bn_apply(y: Tensor, mean: Tensor, invstd: Tensor, weight: Optional[Tensor], bias: Optional[Tensor]) -> Tensor:
    """Recompute ``z`` from ``y`` and saved statistics: ``z = y * a + (beta - mean * a)``, ``a = gamma * invstd``."""
    scale = invstd if weight is None else invstd * weight
    shift = -mean * scale
    if bias is not None:
        shift = shift + bias
    scale = channel_view(scale.to(y.dtype), y.dim())
    shift = channel_view(shift.to(y.dtype), y.dim())
    return torch.addcmul(shift, y, scale)


def bn_backward(
    grad_z: Tensor,
    y: Tensor,
    weight: Optional[Tensor],
    mean: Tensor,
    invstd: Tensor,
    spec: BNSpec,
    mask: Tuple[bool, bool, bool],
) -> Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """``(grad_y, grad_gamma, grad_beta)`` with ``aten.native_batch_norm_backward``.

    With batch statistics this includes the terms through ``mean`` and ``var``:
    ``grad_y = gamma * invstd * (g - mean(g) - xhat * mean(g * xhat))``; with running
    statistics it is the plain per-channel scale ``gamma * invstd * g``.
    """
    if spec.batch_stats:
        out = aten.native_batch_norm_backward(
            grad_z, y, weight, None, None, mean, invstd, True, spec.eps, list(mask)
        )
    else:
        # Running statistics are constants: BN is the per-channel affine map a*y + c.
        out = _affine_backward(grad_z, y, weight, mean, invstd, mask)
    gy, gw, gb = out
    return (gy if mask[0] else None), (gw if mask[1] else None), (gb if mask[2] else None)


def _affine_backward(
    grad_z: Tensor,
    y: Tensor,
    weight: Optional[Tensor],
    mean: Tensor,
    invstd: Tensor,
    mask: Tuple[bool, bool, bool],
) -> Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """Backward of ``z = gamma * (y - mean) * invstd + beta`` with constant ``mean``/``invstd``."""
    dims: List[int] = [0] + list(range(2, y.dim()))
    acc = torch.promote_types(grad_z.dtype, torch.float32)
    gy = gw = gb = None
    if mask[0]:
        scale = invstd if weight is None else invstd * weight
        gy = grad_z * channel_view(scale.to(grad_z.dtype), y.dim())
    if mask[1]:
        xhat = (y.to(acc) - channel_view(mean.to(acc), y.dim())) * channel_view(invstd.to(acc), y.dim())
        gw = (grad_z.to(acc) * xhat).sum(dims).to(mean.dtype)
    if mask[2]:
        gb = grad_z.sum(dims, dtype=acc).to(mean.dtype)
    return gy, gw, gb
