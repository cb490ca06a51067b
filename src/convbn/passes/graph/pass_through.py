"""Dropping nodes that pass a value through unchanged: each is replaced by that value.

The canonicalising rewrites that remove a no-op (a zero-width pad read by concatenations, a cast
to the dtype a value already has, ``x + 0``) differ only in how they recognise one; this is the
one place that replaces and erases them.
"""
from __future__ import annotations

from typing import Callable, List, Optional

import torch.fx as fx

__all__ = ["drop_pass_through"]


def drop_pass_through(gm: fx.GraphModule, passed: Callable[[fx.Node], Optional[fx.Node]]) -> List[str]:
    """Replace every node of ``gm``'s graph for which ``passed(node)`` names the value it passes
    through by that value, and erase it (in place; recompiled where anything was dropped).

    Args:
        gm: the graph module to rewrite.
        passed: the value ``node`` passes through unchanged, or ``None`` where it is not a no-op.

    Returns:
        the names of the nodes dropped, in graph order.

    Example:
        >>> import torch
        >>> gm = fx.symbolic_trace(torch.nn.Identity())
        >>> drop_pass_through(gm, lambda n: None)
        []
    """
    dropped: List[str] = []
    for node in list(gm.graph.nodes):
        value = passed(node)
        if value is None:
            continue
        node.replace_all_uses_with(value)
        dropped.append(node.name)
        gm.graph.erase_node(node)
    if dropped:
        gm.recompile()
    return dropped
