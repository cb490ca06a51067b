"""A BatchNorm ``autograd.Function`` on convbn's BN pieces (local or cross-process statistics).

Used by :class:`convbn.nn.SyncBatchNorm` for BatchNorms that stand alone (not after a
convolution), so that cross-process statistics work on CPU (gloo) as well as GPU.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
from torch import Tensor
from torch.autograd import Function

from ..functional.batchnorm import BNSpec, bn_backward, bn_forward
from .saving import load_tensors, save_tensors

__all__ = ["BatchNormFunction"]


class BatchNormFunction(Function):
    """``z = BN(y)``; keeps ``y`` and the per-channel statistics; running stats updated once.

    First-order only: cross-process statistics have no differentiable reference here,
    and a differentiable backward (``create_graph=True``) raises a clear error.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        y: Tensor,
        weight: Optional[Tensor],
        bias: Optional[Tensor],
        running_mean: Optional[Tensor],
        running_var: Optional[Tensor],
        spec: BNSpec,
    ) -> Tensor:
        z, mean, invstd = bn_forward(y, weight, bias, running_mean, running_var, spec)
        save_tensors(ctx, (y, weight, mean, invstd))
        ctx.spec = spec
        return z

    @staticmethod
    def backward(ctx: Any, grad_z: Tensor) -> Tuple[Optional[Tensor], ...]:  # type: ignore[override]
        if torch.is_grad_enabled():
            raise RuntimeError(
                "double backward (create_graph=True) through cross-process SyncBatchNorm statistics is not "
                "supported by convbn; compute the penalty on a single process or without SyncBatchNorm"
            )
        y, weight, mean, invstd = load_tensors(ctx)
        n = ctx.needs_input_grad
        gy, gw, gb = bn_backward(grad_z, y, weight, mean, invstd, ctx.spec, (n[0], n[1], n[2]))
        return (gy, gw, gb) + (None,) * (len(n) - 3)
