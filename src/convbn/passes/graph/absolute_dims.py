"""Reduction dims counted from the end made absolute where the trace knows the rank (a
canonicalising rewrite).

imagen-pytorch's ``ChanLayerNorm`` is its ``LayerNorm`` with ``dim = -3``: ``torch.var(x, dim=-3,
...)`` and ``torch.mean(x, dim=-3, ...)`` on a 4-D convolution output are statistics over the
channels, dim 1, but matching reads dims as written. A trace with real inputs records each tensor
value's rank (``node.meta[RANK]``, Note: [dtype questions answered by the capture] in
shape_capture.py) and is guarded on its inputs' shapes, so ``-3`` *is* ``1`` in that graph.

:func:`absolute_reduction_dims` rewrites the ``dim`` of ``mean`` / ``var`` / ``std`` / ``sum``
(``torch.`` functions and tensor methods) to ``d % rank`` where the input's rank is known: the same
reduction. A symbolic trace has no ranks: nothing changes there.
"""
from __future__ import annotations

from typing import Any, List, Optional

import torch
import torch.fx as fx

from .shape_capture import RANK

__all__ = ["absolute_reduction_dims"]

_FUNCTIONS = {torch.mean, torch.var, torch.std, torch.sum}
_METHODS = {"mean", "var", "std", "sum"}


def _absolute(dim: Any, rank: int) -> Optional[Any]:
    """``dim`` with negative entries made absolute for a tensor of ``rank``; ``None`` where nothing
    changes or ``dim`` is not an int / a list or tuple of ints in range."""
    dims = [dim] if type(dim) is int else list(dim) if isinstance(dim, (list, tuple)) else None
    if not dims or not all(type(d) is int and -rank <= d < rank for d in dims) or all(d >= 0 for d in dims):
        return None
    fixed = [d % rank for d in dims]
    return fixed[0] if type(dim) is int else type(dim)(fixed)


def absolute_reduction_dims(gm: fx.GraphModule) -> List[str]:
    """Make the negative reduction dims of ``gm``'s graph absolute where the input's rank was
    traced (in place). Returns the names of the nodes changed."""
    changed: List[str] = []
    for node in gm.graph.nodes:
        if not ((node.op == "call_function" and node.target in _FUNCTIONS)
                or (node.op == "call_method" and node.target in _METHODS)):
            continue
        x = node.args[0] if node.args else None
        rank = x.meta.get(RANK) if isinstance(x, fx.Node) else None
        if rank is None:
            continue
        if len(node.args) > 1:
            fixed = _absolute(node.args[1], rank)
            if fixed is not None:
                node.args = (x, fixed, *node.args[2:])
                changed.append(node.name)
        elif "dim" in node.kwargs:
            fixed = _absolute(node.kwargs["dim"], rank)
            if fixed is not None:
                node.kwargs = {**node.kwargs, "dim": fixed}
                changed.append(node.name)
    if changed:
        gm.recompile()
    return changed
