"""The pooling calls a converted graph makes in place of eager max and average pooling.

Each computes exactly what the call it replaces computes and keeps, for backward, the
max-pool indices instead of the input (:mod:`convbn.autograd.pool`). ``pool_module_call``
stands for a pooling *module*: it reads the module's settings at call time and calls the
module itself whenever that would differ (hooks registered after conversion, indices
asked for), so the module's hooks run as in eager.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple, Type

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..autograd.pool import lean_pool
from ..functional.pool import IntOrSeq, PoolSpec
from .fused_conv_bn import module_hooked

__all__ = ["POOL_MODULES", "pool_module_call", "lean_max_pool2d", "lean_max_pool3d", "lean_avg_pool2d",
           "lean_avg_pool3d", "pool_module_spec"]

#: Pooling module classes with their kind and spatial dimensions.
POOL_MODULES: Dict[Type[nn.Module], Tuple[str, int]] = {
    nn.MaxPool2d: ("max", 2), nn.MaxPool3d: ("max", 3), nn.AvgPool2d: ("avg", 2), nn.AvgPool3d: ("avg", 3),
}


def pool_module_spec(module: nn.Module) -> Optional[PoolSpec]:
    """The :class:`PoolSpec` of a pooling module that runs its class's own forward and
    returns no indices; ``None`` for anything else."""
    base: Optional[Type[nn.Module]] = None
    for c in type(module).__mro__:  # a loop, not next(genexpr): Dynamo of torch 2.8 traces this
        if c in POOL_MODULES:
            base = c
            break
    if base is None or type(module).forward is not base.forward:  # type: ignore[attr-defined]
        return None
    kind, dims = POOL_MODULES[base]
    m: Any = module
    if kind == "max":
        if m.return_indices:
            return None
        return PoolSpec.make(kind, dims, m.kernel_size, m.stride, m.padding, m.dilation, m.ceil_mode)
    return PoolSpec.make(kind, dims, m.kernel_size, m.stride, m.padding, ceil_mode=m.ceil_mode,
                         count_include_pad=m.count_include_pad, divisor_override=m.divisor_override)


def pool_module_call(module: nn.Module, input: Tensor) -> Tensor:
    """``module(input)`` for a max or average pooling module, keeping indices, not the input.

    Example:
        >>> pool = nn.MaxPool2d(2)
        >>> x = torch.randn(1, 2, 4, 4, requires_grad=True)
        >>> torch.equal(pool_module_call(pool, x), pool(x))
        True
    """
    spec = None if module_hooked(module) else pool_module_spec(module)
    if spec is None:
        return module(input)
    return lean_pool(input, spec)


def lean_max_pool2d(input: Tensor, kernel_size: IntOrSeq, stride: Optional[IntOrSeq] = None, padding: IntOrSeq = 0,
                    dilation: IntOrSeq = 1, ceil_mode: bool = False, return_indices: bool = False) -> Any:
    """``F.max_pool2d`` (and ``torch.max_pool2d``), keeping indices, not the input."""
    if return_indices:
        return F.max_pool2d(input, kernel_size, stride, padding, dilation, ceil_mode, return_indices=True)
    return lean_pool(input, PoolSpec.make("max", 2, kernel_size, stride, padding, dilation, ceil_mode))


def lean_max_pool3d(input: Tensor, kernel_size: IntOrSeq, stride: Optional[IntOrSeq] = None, padding: IntOrSeq = 0,
                    dilation: IntOrSeq = 1, ceil_mode: bool = False, return_indices: bool = False) -> Any:
    """``F.max_pool3d`` (and ``torch.max_pool3d``), keeping indices, not the input."""
    if return_indices:
        return F.max_pool3d(input, kernel_size, stride, padding, dilation, ceil_mode, return_indices=True)
    return lean_pool(input, PoolSpec.make("max", 3, kernel_size, stride, padding, dilation, ceil_mode))


def lean_avg_pool2d(input: Tensor, kernel_size: IntOrSeq, stride: Optional[IntOrSeq] = None, padding: IntOrSeq = 0,
                    ceil_mode: bool = False, count_include_pad: bool = True,
                    divisor_override: Optional[int] = None) -> Tensor:
    """``F.avg_pool2d``, keeping nothing of the input but its shape."""
    return lean_pool(input, PoolSpec.make("avg", 2, kernel_size, stride, padding, 1, ceil_mode, count_include_pad,
                                          divisor_override))


def lean_avg_pool3d(input: Tensor, kernel_size: IntOrSeq, stride: Optional[IntOrSeq] = None, padding: IntOrSeq = 0,
                    ceil_mode: bool = False, count_include_pad: bool = True,
                    divisor_override: Optional[int] = None) -> Tensor:
    """``F.avg_pool3d``, keeping nothing of the input but its shape."""
    return lean_pool(input, PoolSpec.make("avg", 3, kernel_size, stride, padding, 1, ceil_mode, count_include_pad,
                                          divisor_override))
