"""Rewrite a traced graph's max and average pooling to keep indices, not inputs.

Eager pooling keeps its whole input for a backward that reads only its shape
(:mod:`convbn.functional.pool`). Where a fused chain feeds the pooling, nothing else keeps
that input, so this is memory the fused model would hold for nothing: ``convert`` points
every pooling call of a graph it rewrites at :mod:`convbn.nn.pool`, which computes the same
values and gradients bit for bit. A pooling module keeps its place in the model (its
settings are read, and its hooks honoured, at call time); one with hooks at conversion is
left as it is, as fused layers are.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List

import torch
import torch.fx as fx
import torch.nn.functional as F

from ...nn.fused_conv_bn import module_hooked
from ...nn.pool import (lean_avg_pool2d, lean_avg_pool3d, lean_max_pool2d, lean_max_pool3d, pool_module_call,
                       pool_module_spec)

__all__ = ["lean_pools", "LEAN_FUNCTIONS"]

#: Pooling functions a traced graph may call, and the lean call with the same signature.
LEAN_FUNCTIONS: Dict[Any, Callable[..., Any]] = {
    F.max_pool2d: lean_max_pool2d, torch.max_pool2d: lean_max_pool2d,
    F.max_pool3d: lean_max_pool3d, torch.max_pool3d: lean_max_pool3d,
    F.avg_pool2d: lean_avg_pool2d, F.avg_pool3d: lean_avg_pool3d,
}


def lean_pools(gm: fx.GraphModule, prefix: str = "") -> List[str]:
    """Point ``gm``'s max/average pooling calls at their lean versions, in place.

    Args:
        gm: a traced graph module (``convert`` passes each one it rewrites).
        prefix: ``gm``'s qualified name in the model, with a trailing dot (``""``: the root).

    Returns:
        The pooling calls rewritten: module names, or graph node names for functional calls.

    Example:
        >>> gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.ReLU(), torch.nn.MaxPool2d(2)))
        >>> lean_pools(gm)
        ['1']
    """
    graph = gm.graph
    done: List[str] = []
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in LEAN_FUNCTIONS:
            node.target = LEAN_FUNCTIONS[node.target]
            done.append(prefix + node.name)
        elif node.op == "call_module":
            module = gm.get_submodule(str(node.target))
            if pool_module_spec(module) is None or module_hooked(module) or node.kwargs or len(node.args) != 1:
                continue
            with graph.inserting_before(node):
                owner = graph.get_attr(str(node.target))
                new = graph.call_function(pool_module_call, (owner, node.args[0]))
            new.meta = dict(node.meta)
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            done.append(prefix + str(node.target))
    if done:
        graph.lint()
        gm.recompile()
    return done
