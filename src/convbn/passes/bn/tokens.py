"""BatchNorm1d over a linear layer's tokens, rewritten to the 2-D form convert fuses.

Token models write a linear layer on ``(B, L, C_in)`` tokens followed by a BatchNorm1d over
its features as ``bn(fc(t).transpose(1, 2))``: the transpose moves the features to BN's
channel dim 1. A fused chain computes Linear -> BatchNorm1d on ``(N, C)`` rows, so
:func:`flatten_token_bns` rewrites the graph before matching (:func:`convbn.passes.convert.match.find_layers`):

    y = fc(t); z = bn(y.transpose(1, 2))
    ->
    y2 = fc(t.flatten(0, -2)); z2 = bn(y2); z = z2.unflatten(0, t.shape[:-1]).transpose(1, 2)

Note: [BatchNorm1d on tokens is BatchNorm1d on rows]
    BatchNorm1d on ``(B, C, L)`` normalises each channel over its ``B * L`` values, with the
    unbiased running variance scaled by ``n / (n - 1)``, ``n = B * L``; on the ``(B * L, C)``
    rows of the same values it computes the same mean, the same variance and the same ``n``.
    The Linear applies row by row, so ``fc(t).flatten(0, -2) == fc(t.flatten(0, -2))``. The
    rewrite changes no value, only the layout BN reads; the chain then fuses the Linear and
    the BN as any Linear -> BatchNorm1d. ``transpose(1, 2)`` (or ``permute(0, 2, 1)``) before a
    BatchNorm1d can only see a 3-D tensor (BatchNorm1d takes 2-D or 3-D inputs and the
    transpose needs a dim 2), so the tokens are 3-D whenever the graph matches.
"""
from __future__ import annotations

import operator
from typing import Any, List, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from ..graph.shape_uses import value_users

__all__ = ["features_to_dim1", "flatten_token_bns"]

_TRANSPOSE_NAMES = ("transpose", "swapaxes", "swapdims")


def features_to_dim1(node: Any) -> Optional[fx.Node]:
    """The input of ``node`` if ``node`` swaps dims 1 and 2 of a 3-D tensor
    (``transpose(1, 2)``, ``transpose(-1, -2)``, ``permute(0, 2, 1)``; method or ``torch.``
    function), else ``None``. (``transpose(-1, -2)`` names dims 1 and 2 only on 3-D tensors:
    callers check the rank.)"""
    if not isinstance(node, fx.Node) or node.kwargs or node.op not in ("call_method", "call_function"):
        return None
    if not node.args or not isinstance(node.args[0], fx.Node):
        return None
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", None)
    if node.op == "call_function" and getattr(torch, str(name), None) is not node.target:
        return None
    rest = node.args[1:]
    if name in _TRANSPOSE_NAMES and len(rest) == 2 and all(isinstance(d, int) and -3 <= d <= 2 for d in rest) \
            and {d % 3 for d in rest} == {1, 2}:
        return node.args[0]
    if name == "permute":
        dims = rest[0] if len(rest) == 1 and isinstance(rest[0], (list, tuple)) else rest
        if len(dims) == 3 and all(isinstance(d, int) for d in dims) and [d % 3 for d in dims] == [0, 2, 1]:
            return node.args[0]
    return None


def _strict_transpose_1_2(node: fx.Node) -> bool:
    """``node`` swaps dims 1 and 2 with non-negative dims, so it fails on a 2-D tensor."""
    rest = node.args[1:]
    if len(rest) == 1 and isinstance(rest[0], (list, tuple)):
        rest = tuple(rest[0])
    return len(rest) == 3 or all(isinstance(d, int) and d >= 0 for d in rest)


def _linear_input(node: fx.Node, gm: fx.GraphModule) -> Optional[fx.Node]:
    """The input of ``node`` if it applies a ``nn.Linear`` (torch's forward) or ``F.linear``."""
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        if type(mod).forward is nn.Linear.forward and len(node.args) == 1 and not node.kwargs:
            return node.args[0] if isinstance(node.args[0], fx.Node) else None
        return None
    if node.op == "call_function" and node.target is F.linear and node.args and isinstance(node.args[0], fx.Node):
        return node.args[0]
    return None


def flatten_token_bns(gm: fx.GraphModule) -> List[str]:
    """Rewrite every ``bn(linear(t).transpose(1, 2))`` of ``gm`` (a ``nn.BatchNorm1d`` module
    call) into the row form of Note: [BatchNorm1d on tokens is BatchNorm1d on rows], in
    place; returns the BatchNorm targets rewritten (the graph is recompiled when any)."""
    done: List[str] = []
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_module" or len(node.args) != 1 or node.kwargs:
            continue
        bn = gm.get_submodule(str(node.target))
        if type(bn) is not nn.BatchNorm1d:
            continue
        tr = node.args[0]
        y = features_to_dim1(tr)
        if y is None or not _strict_transpose_1_2(tr) or value_users(tr) != [node] or len(tr.users) != 1:
            continue
        t = _linear_input(y, gm)
        if t is None or value_users(y) != [tr] or len(y.users) != 1:
            continue
        with graph.inserting_before(y):
            rows = graph.call_method("flatten", (t, 0, -2))
        y.args = (rows, *y.args[1:]) if y.op == "call_module" else (rows, *y.args[1:])
        node.args = (y,)
        with graph.inserting_after(node):
            size = graph.call_method("size", (t,))
        with graph.inserting_after(size):
            lead = graph.call_function(operator.getitem, (size, slice(None, -1)))
        with graph.inserting_after(lead):
            back = graph.call_method("unflatten", (node, 0, lead))
        with graph.inserting_after(back):
            out = graph.call_method("transpose", (back, 1, 2))
        node.replace_all_uses_with(out, delete_user_cb=lambda user: user is not back)
        graph.erase_node(tr)
        done.append(str(node.target))
    if done:
        graph.lint()
        gm.recompile()
    return done
