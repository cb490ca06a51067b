"""The differentiable backward every fused Function takes when autograd asks for one.

# Note: [double backward]
# The first-order backward uses native kernels under no-grad. When autograd asks for
# a differentiable backward (``create_graph=True``, i.e. grad mode is on inside
# backward) the Functions instead rebuild the layer (or chain) from the saved *inputs*
# with the differentiable reference ops and differentiate that, so second derivatives
# flow through the conv, the batch statistics and the activation. Ordinary training
# never takes that branch. Shared by :class:`convbn.autograd.chain.ChainFunction` (which
# also runs the single-layer recompute strategies) and
# :class:`convbn.autograd.layer_functions.FrozenFunction`.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..functional.batchnorm import BNSpec

__all__ = ["differentiable_backward"]


def differentiable_backward(
    ctx: Any, grad_out: Tensor, inputs: Sequence[Optional[Tensor]], rebuild: Callable[..., Tensor],
    needs: Optional[Sequence[bool]] = None,
) -> Tuple[Optional[Tensor], ...]:
    """See Note: [double backward].

    Args:
        ctx: the Function's ctx; ``ctx.specs`` holds its ``BNSpec``s (directly, or as the
            ``bn`` of each chain layer spec).
        grad_out: the incoming gradient.
        inputs: the saved inputs, in the Function's argument order.
        rebuild: ``rebuild(*inputs)`` recomputes the output with differentiable ops.
        needs: one flag per input: the gradients autograd asked for (default
            ``ctx.needs_input_grad``).

    Returns:
        One gradient per entry of ``needs`` (or of ``inputs``, if longer); ``None`` where
        none was asked for.

    Raises:
        RuntimeError: a BatchNorm synchronises its statistics across processes.
    """
    if any(getattr(spec, "process_group", None) is not None for spec in _bn_specs(ctx)):
        raise RuntimeError(
            "double backward (create_graph=True) through cross-process SyncBatchNorm statistics is not "
            "supported by convbn; run it without convert() or with a single process"
        )
    needs = ctx.needs_input_grad if needs is None else needs
    wanted = [i for i, t in enumerate(inputs) if t is not None and needs[i]]
    with torch.enable_grad():
        out = rebuild(*inputs)
        grads = torch.autograd.grad(
            out, [inputs[i] for i in wanted], grad_out, create_graph=True, allow_unused=True
        )
    result: List[Optional[Tensor]] = [None] * max(len(needs), len(inputs))
    for i, g in zip(wanted, grads):
        result[i] = g
    return tuple(result)


def _bn_specs(ctx: Any) -> List[BNSpec]:
    """Every BNSpec of a fused Function's ctx (single layer or chain)."""
    out: List[BNSpec] = []
    for spec in ctx.specs:
        if isinstance(spec, BNSpec):
            out.append(spec)
        elif getattr(spec, "bn", None) is not None:
            out.append(spec.bn)
    return out
