"""Which implementation runs one call of a chain: the one place the execution paths are chosen.

A chain's call, once its inputs are checked and its plan is read into layer specs
(:meth:`convbn.autograd.chain_plan.ChainPlan.specs`), runs on one of four paths:

=========================================  ==================================================
nothing needs a gradient                   the no-grad kernel (:func:`chain_forward_no_grad`)
compiling, a plain chain, inductor chosen  ops in a selective checkpoint (``chain_compiled``)
compiling, otherwise                       the custom op (``chain_op``)
not compiling                              :class:`~convbn.autograd.chain.ChainFunction`
=========================================  ==================================================

A chain with a process group (``SyncBatchNorm``) runs the Function under ``torch.compile``
too (its collective cannot sit inside an opaque op). The eager-module fallback (hooks,
autocast on a head, a drawing dropout under compile) is :class:`convbn.nn.FusedChain`'s own,
decided before the call gets here.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

from .chain import ChainFunction, chain_forward_no_grad
from .chain_compiled import chain_inductor_apply, compile_chains_mode, fusible_by_inductor
from .chain_spec import ChainLayerSpec

__all__ = ["run_chain"]


def run_chain(key: str, xs: Sequence[Tensor], params: Sequence[Optional[Tensor]],
              specs: Sequence[ChainLayerSpec], stats: Sequence[Tuple[Optional[Tensor], Optional[Tensor]]]) -> Tensor:
    """Run one call of a chain on the path its inputs and the compile state call for.

    Args:
        key: the chain's structure key (:func:`convbn.autograd.chain_op.register_chain`),
            which the custom op looks its structure up by.
        xs: the chain input, or a head chain's pieces (concatenated along dim 1).
        params: the flat parameter list (``None`` where absent).
        specs: the layer specs of this call, the plan included.
        stats: per layer ``(running_mean, running_var)``, updated in place.

    Returns:
        The chain's output.
    """
    xs = list(xs)
    if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (*xs, *params))):
        return chain_forward_no_grad(xs[0] if len(xs) == 1 else torch.cat(xs, 1), params, specs, stats)
    if torch.compiler.is_compiling() and not any(s.bn is not None and s.bn.process_group is not None for s in specs):
        if len(xs) == 1 and compile_chains_mode() == "inductor" and fusible_by_inductor(specs):
            return chain_inductor_apply(xs[0], params, specs, stats)  # Note: [a chain inductor can see into]
        from .chain_op import chain_op_apply  # Note: [why a custom op under torch.compile]

        return chain_op_apply(key, xs if len(xs) > 1 else xs[0], params, specs, stats)
    if len(xs) > 1:
        return ChainFunction.apply(*xs, *params, tuple(specs), tuple(stats), len(xs))
    return ChainFunction.apply(xs[0], *params, tuple(specs), tuple(stats))
