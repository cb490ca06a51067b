"""Pooling that keeps its indices, not its input, for backward.

Eager max and average pooling save their whole input for backward, which reads only its
shape (:mod:`convbn.functional.pool`). After a fused chain -- a ResNet's stem before its
max-pool, the tutorial network's last layer, a DenseNet transition before its average
pool -- nothing else keeps that input, so it would live from forward to backward for its
shape alone: on the tutorial's MNIST network at batch 2048, 288 MiB. :class:`LeanPoolFunction`
keeps the max-pool indices (average pooling: nothing) and hands the backward a stand-in.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
from torch import Tensor
from torch.autograd import Function

from ..functional.pool import PoolSpec, compact_indices, pool_backward, pool_forward, shape_stand_in, stand_in_fits
from .release import free_storage, keeping_graph

__all__ = ["LeanPoolFunction", "lean_pool"]


class LeanPoolFunction(Function):
    """``apply(x, spec)``: ATen's pooling of ``x``; saves the indices (max; ``int32`` where they
    fit) and ``x``'s shape.

    A non-contiguous ``x`` (channels-last) is saved itself, as eager saves it: its gradient
    takes its layout (Note: [a stand-in for the pooling input]).
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, spec: PoolSpec) -> Tensor:  # type: ignore[override]
        out, indices = pool_forward(x, spec)
        keep = not stand_in_fits(x)
        ctx.spec, ctx.keep, ctx.has_indices = spec, keep, indices is not None
        ctx.shape, ctx.dtype, ctx.device = tuple(x.shape), x.dtype, x.device
        if indices is not None:  # Note: [max-pool indices in half the bytes] in functional/pool.py
            indices = compact_indices(indices, spec, x.shape)
        ctx.save_for_backward(*((x,) if keep else ()), *((indices,) if indices is not None else ()))
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Optional[Tensor], None]:  # type: ignore[override]
        saved = ctx.saved_tensors
        like = saved[0] if ctx.keep else shape_stand_in(ctx.shape, ctx.dtype, ctx.device)
        indices = saved[-1] if ctx.has_indices else None
        if indices is not None and indices.dtype != torch.int64:
            # Note: [max-pool indices in half the bytes] in functional/pool.py: widened for ATen's
            # kernel, the int32 copy let go first unless the graph is kept, so the kernel runs
            # beside what eager's holds (its int64 indices), never beside both
            wide = indices.to(torch.int64)
            if not keeping_graph():
                free_storage(indices)
            indices = wide
        return pool_backward(grad, like, ctx.spec, indices), None


def lean_pool(x: Tensor, spec: PoolSpec) -> Tensor:
    """Pool ``x`` as eager does, keeping the indices instead of the input when autograd
    records it (otherwise, and under ``torch.compile``, which plans memory itself, the plain
    ATen call).

    Example:
        >>> x = torch.randn(2, 3, 8, 8, requires_grad=True)
        >>> lean_pool(x, PoolSpec.make("max", 2, 2)).shape
        torch.Size([2, 3, 4, 4])
    """
    if torch.compiler.is_compiling() or not (torch.is_grad_enabled() and x.requires_grad):
        return pool_forward(x, spec, indices=False)[0]
    return LeanPoolFunction.apply(x, spec)
