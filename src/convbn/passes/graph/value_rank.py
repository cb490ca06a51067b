"""The rank of a graph value, read off the graph's structure where no trace recorded it.

A trace with real inputs records each value's rank (``node.meta[RANK]``); a symbolic trace
records none. Many ranks are still plain from the graph: a ``permute`` or ``reshape`` states
it (``flatten(s)`` from a dim ``s`` on: ``s + 1``), a convolution module's output has its kernel's dimensions plus two, and a Linear, a
LayerNorm, an activation, a dropout, a transpose and a sum keep their input's. :func:`value_rank` walks back
through those (a bounded walk), and says ``None`` where it cannot tell (a placeholder, a module
of the model's own). Read by the rewrite of a channels-last LayerNorm before a Linear
(``convert/norm_linears.py``), which writes a permute of the map's rank.
"""
from __future__ import annotations

import operator
from typing import Any, Dict, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import Tensor, nn

from ...functional.activations import activation_from_module, activation_functions, activation_methods
from .shape_capture import RANK

__all__ = ["value_rank"]

#: modules whose output has their (first) input's rank
_SAME_RANK_MODULES = (nn.Linear, nn.LayerNorm, nn.Identity, nn.Dropout, nn.PReLU)
_SAME_RANK_FUNCTIONS = frozenset({F.linear, F.layer_norm, F.dropout, torch.dropout, F.prelu, torch.transpose})
_SAME_RANK_METHODS = frozenset({"contiguous", "float", "double", "half", "bfloat16", "to", "type", "clone",
                                "transpose"})
_SUMS = frozenset({operator.add, operator.sub, operator.mul, operator.truediv, torch.add, torch.sub, torch.mul,
                   torch.div})
_SHAPES = frozenset({"reshape", "view"})


def _own(node: fx.Node, gm: fx.GraphModule, seen: Dict[fx.Node, Optional[int]], depth: int) -> Optional[int]:
    """The rank ``node``'s own op states, or that of the input it keeps."""
    if node.op == "get_attr":
        try:
            t = _attr(gm, str(node.target))
        except AttributeError:
            return None
        return t.dim() if isinstance(t, Tensor) else None
    if node.op == "call_method" and node.target == "permute" or node.op == "call_function" and node.target is torch.permute:
        dims = node.args[1:]
        return len(dims[0]) if len(dims) == 1 and isinstance(dims[0], (tuple, list)) else len(dims) or None
    if node.op == "call_method" and node.target in _SHAPES:
        dims = node.args[1:]
        return len(dims[0]) if len(dims) == 1 and isinstance(dims[0], (tuple, list, torch.Size)) else len(dims) or None
    if node.op == "call_method" and node.target == "flatten" or node.op == "call_function" and node.target is torch.flatten:
        start, end = (*node.args[1:], 0, -1)[:2] if not node.kwargs else (None, None)
        return start + 1 if type(start) is int and start >= 0 and end == -1 else None
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        if isinstance(mod, nn.modules.conv._ConvNd):
            return len(mod.kernel_size) + 2
        keeps = isinstance(mod, _SAME_RANK_MODULES) or activation_from_module(mod) is not None
        return _walk(node.args[0], gm, seen, depth) if keeps and node.args else None
    same = (node.op == "call_function" and (node.target in _SAME_RANK_FUNCTIONS or node.target in activation_functions())
            or node.op == "call_method" and (node.target in _SAME_RANK_METHODS or node.target in activation_methods()))
    if same and node.args:
        return _walk(node.args[0], gm, seen, depth)
    if node.op == "call_function" and node.target in _SUMS:
        ranks = [_walk(a, gm, seen, depth) for a in node.args[:2] if isinstance(a, fx.Node)]
        known = [r for r in ranks if r is not None]
        return max(known) if known else None
    return None


def _attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _walk(node: Any, gm: fx.GraphModule, seen: Dict[fx.Node, Optional[int]], depth: int) -> Optional[int]:
    if not isinstance(node, fx.Node) or depth > 64:
        return None
    if node in seen:
        return seen[node]
    seen[node] = None  # a cycle cannot occur in a graph; a value asked again while walked is unknown
    rank = node.meta.get(RANK)
    if not isinstance(rank, int):
        rank = _own(node, gm, seen, depth + 1)
    seen[node] = rank
    return rank


def value_rank(node: Any, gm: fx.GraphModule) -> Optional[int]:
    """The rank of ``node``'s value: the one a trace with real inputs recorded, else the one the
    graph's ops show (module docstring), else ``None``.

    Example:
        >>> class M(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.conv, self.norm = nn.Conv2d(3, 4, 1), nn.LayerNorm(4)
        ...     def forward(self, x):
        ...         return self.norm(self.conv(x).permute(0, 2, 3, 1) + 1)
        >>> gm = fx.symbolic_trace(M())
        >>> value_rank(next(n for n in gm.graph.nodes if n.target == "norm"), gm)
        4
    """
    return _walk(node, gm, {}, 0)
