"""Folding BatchNorm statistics into a neighbouring linear layer (tensors in, tensors out).

Used by :func:`convbn.fold` (the FX inference pass) and by the ``frozen`` training
strategy alike. Nothing here touches modules or graphs.

A BatchNorm in eval mode is the per-channel affine map

.. math::
    \\mathrm{BN}(y) = \\gamma \\frac{y - \\mu}{\\sqrt{\\sigma^2 + \\epsilon}} + \\beta
                  = s \\, y + (\\beta - s \\mu), \\qquad s = \\frac{\\gamma}{\\sqrt{\\sigma^2 + \\epsilon}}

so after a layer ``y = W x + b`` it folds into ``W' = s W`` (scaling each *output*
channel) and ``b' = s (b - \\mu) + \\beta``; before a layer it folds into the *input*
channels instead (see :func:`fold_bn_into_following`).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

__all__ = ["bn_scale_shift", "fold_bn_into_preceding", "fold_bn_into_following"]


def bn_scale_shift(
    running_mean: Tensor,
    running_var: Tensor,
    eps: float,
    weight: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """Per-channel ``(scale, shift)`` with ``BN(y) = scale * y + shift`` in eval mode.

    Args:
        running_mean: ``(C,)`` running mean.
        running_var: ``(C,)`` running variance.
        eps: the BatchNorm's eps (inside the square root).
        weight: ``(C,)`` affine gamma, or ``None`` for ``affine=False``.
        bias: ``(C,)`` affine beta, or ``None`` for ``affine=False``.

    Returns:
        ``(scale, shift)``, each ``(C,)``; differentiable w.r.t. ``weight`` and ``bias``.
    """
    scale = torch.rsqrt(running_var + eps)
    if weight is not None:
        scale = scale * weight
    shift = -running_mean * scale
    if bias is not None:
        shift = shift + bias
    return scale, shift


def fold_bn_into_preceding(
    weight: Tensor,
    bias: Optional[Tensor],
    running_mean: Tensor,
    running_var: Tensor,
    eps: float,
    bn_weight: Optional[Tensor] = None,
    bn_bias: Optional[Tensor] = None,
    *,
    transposed: bool = False,
    groups: int = 1,
) -> Tuple[Tensor, Tensor]:
    """Fold an eval-mode BatchNorm into the conv/linear layer *before* it.

    ``BN(conv(x, W, b)) == conv(x, W', b')`` with ``W' = s W`` per output channel and
    ``b' = s (b - mu) + beta``.

    Args:
        weight: layer weight. Conv/Linear: ``(C_out, C_in/groups, *k)``;
            ConvTranspose: ``(C_in, C_out/groups, *k)``.
        bias: layer bias ``(C_out,)`` or ``None``.
        running_mean, running_var, eps, bn_weight, bn_bias: the BatchNorm's state.
        transposed: ``True`` for ConvTranspose weights (output channels on dim 1, per group).
        groups: the ConvTranspose's groups (ignored otherwise).

    Returns:
        ``(folded_weight, folded_bias)``; new tensors, the inputs are not modified.

    Example:
        >>> conv, bn = torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8).eval()
        >>> w, b = fold_bn_into_preceding(conv.weight, conv.bias, bn.running_mean,
        ...                               bn.running_var, bn.eps, bn.weight, bn.bias)
    """
    scale, shift = bn_scale_shift(running_mean, running_var, eps, bn_weight, bn_bias)
    # Fold in the layer's own precision, like torch.nn.utils.fusion does.
    scale = scale.to(weight.dtype)
    shift = shift.to(weight.dtype)
    if transposed:
        # (C_in, C_out/g, *k): output channel o = g_idx * (C_out/g) + j sits at dim 1 of group g_idx.
        c_in, c_out_per_group = weight.shape[0], weight.shape[1]
        w = weight.reshape(groups, c_in // groups, c_out_per_group, *weight.shape[2:])
        s = scale.reshape(groups, 1, c_out_per_group, *([1] * (weight.dim() - 2)))
        folded_weight = (w * s).reshape(weight.shape)
    else:
        folded_weight = weight * scale.reshape(-1, *([1] * (weight.dim() - 1)))
    folded_bias = shift if bias is None else bias * scale + shift
    return folded_weight, folded_bias


def fold_bn_into_following(
    weight: Tensor,
    bias: Optional[Tensor],
    running_mean: Tensor,
    running_var: Tensor,
    eps: float,
    bn_weight: Optional[Tensor] = None,
    bn_bias: Optional[Tensor] = None,
    *,
    groups: int = 1,
) -> Tuple[Tensor, Tensor]:
    """Fold an eval-mode BatchNorm into the conv/linear layer *after* it.

    ``conv(BN(x), W, b) == conv(x, W', b')`` with ``W'[o, i] = W[o, i] s[i]`` and
    ``b'[o] = b[o] + sum_{i,k} W[o, i, k] shift[i]``. Exact only when the layer sees no
    zero padding (a padded border would be ``0`` before folding but ``shift`` after);
    callers must check that.

    Args:
        weight: ``(C_out, C_in/groups, *k)`` conv or ``(C_out, C_in)`` linear weight.
        bias: ``(C_out,)`` or ``None``.
        running_mean, running_var, eps, bn_weight, bn_bias: the BatchNorm's state.
        groups: the conv's groups.

    Returns:
        ``(folded_weight, folded_bias)``; new tensors.
    """
    scale, shift = bn_scale_shift(running_mean, running_var, eps, bn_weight, bn_bias)
    scale = scale.to(weight.dtype)
    shift = shift.to(weight.dtype)
    c_out, c_in_per_group = weight.shape[0], weight.shape[1]
    extra = [1] * (weight.dim() - 2)
    # input channel of weight[o, j] is (o // (C_out/g)) * (C_in/g) + j
    s = scale.reshape(groups, 1, c_in_per_group, *extra)
    t = shift.reshape(groups, 1, c_in_per_group, *extra)
    w = weight.reshape(groups, c_out // groups, c_in_per_group, *weight.shape[2:])
    folded_weight = (w * s).reshape(weight.shape)
    added = (w * t).flatten(2).sum(-1).reshape(c_out)
    folded_bias = added if bias is None else bias + added
    return folded_weight, folded_bias
