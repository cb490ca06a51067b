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

Note: [a transpose that also runs on rows]
    ``transpose(-1, 1)`` / ``transpose(2, 1)``-style calls with a negative dim (speechbrain's
    ``x.transpose(-1, 1)``) swap dims 1 and 2 of a 3-D tensor but run on a 2-D one too, where
    they change nothing (``-1`` is dim 1): ``bn(fc(t).transpose(-1, 1))`` is then BatchNorm1d
    on ``(N, C)`` rows. The graph has no ranks, so the rewrite is made right for both: it
    transposes back with the user's own call (the identity on rows; on 3-D tokens the same
    swap as ``transpose(1, 2)``), and :func:`check_token_rank` raises where the Linear's input
    has another rank, as BatchNorm1d would on the original (on 4-D tokens the rows would
    otherwise normalise what eager refuses).

Note: [a flatten between a Linear and its BatchNorm1d]
    ``bn(fc(x).flatten(1))`` (or ``torch.flatten(fc(x), 1)``, ``fc(x).view(n, -1)``) normalises
    the Linear's output features when that output is 2-D: the flatten then changes nothing
    and :func:`drop_noop_flattens` removes it, so convert fuses and fold folds the
    Linear -> BatchNorm1d. On a 3-D or higher output it is another computation (one
    BatchNorm feature per position and output feature, while the Linear shares its weights
    across positions) that neither pass can fuse. The graph has no shapes, so the output is
    known 2-D only when the Linear's input is: a ``flatten(t, 1)``, a ``view``/``reshape``
    to two sizes, or the output of such a Linear, BatchNorm1d or dropout/activation module
    on one. Elsewhere :func:`flattened_linear_reason` says why the BatchNorm is left.
"""
from __future__ import annotations

import operator
from typing import Any, List, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import Tensor, nn
from torch.fx.node import has_side_effect

from ...functional.activations import activation_from_module
from ...nn.standard_bn import has_standard_bn_forward
from ..graph.shape_uses import value_users
from .kind import bn_conv_dims

__all__ = ["check_token_rank", "features_to_dim1", "flatten_token_bns", "drop_noop_flattens", "flattened_linear_reason"]

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


@has_side_effect
def check_token_rank(t: Tensor) -> None:
    """Raise as ``nn.BatchNorm1d`` does where the Linear's input ``t`` is not 2-D or 3-D (Note:
    [a transpose that also runs on rows]).

    Args:
        t: the tokens the Linear reads.

    Example:
        >>> check_token_rank(torch.zeros(2, 3, 4))
    """
    if t.dim() not in (2, 3):
        raise ValueError(f"expected 2D or 3D input (got {t.dim()}D input)")


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
        if bn_conv_dims(bn) != (0, 1) or not has_standard_bn_forward(bn):  # a BatchNorm1d (subclasses too)
            continue
        tr = node.args[0]
        y = features_to_dim1(tr)
        if y is None or value_users(tr) != [node] or len(tr.users) != 1:
            continue
        t = _linear_input(y, gm)
        if t is None or value_users(y) != [tr] or len(y.users) != 1:
            continue
        strict = _strict_transpose_1_2(tr)
        with graph.inserting_before(y):
            if not strict:  # Note: [a transpose that also runs on rows]
                graph.call_function(check_token_rank, (t,))
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
            out = graph.call_method("transpose", (back, 1, 2)) if strict else \
                graph.create_node(tr.op, tr.target, (back, *tr.args[1:]))
        node.replace_all_uses_with(out, delete_user_cb=lambda user: user is not back)
        graph.erase_node(tr)
        done.append(str(node.target))
    if done:
        graph.lint()
        gm.recompile()
    return done


#: rank-keeping modules besides the activation table's (element-wise, so the rank is kept)
_RANK_KEEPING = (nn.Dropout, nn.PReLU, nn.Identity, nn.BatchNorm1d)


def _keeps_rank(module: nn.Module) -> bool:
    """Whether calling ``module`` on a tensor gives a tensor of the same rank (an activation of
    the one table, dropout, PReLU, identity, a BatchNorm1d)."""
    return isinstance(module, _RANK_KEEPING) or activation_from_module(module) is not None


def _flatten_input(node: Any) -> Optional[fx.Node]:
    """The input of ``node`` if it is ``flatten(t, 1)`` (method or ``torch.flatten``, to the last dim)."""
    if not isinstance(node, fx.Node) or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    is_flatten = (node.op == "call_method" and node.target == "flatten") or \
        (node.op == "call_function" and node.target is torch.flatten)
    if not is_flatten:
        return None
    if set(node.kwargs) - {"start_dim", "end_dim"} or len(node.args) > 3:
        return None
    start = node.args[1] if len(node.args) > 1 else node.kwargs.get("start_dim", 0)
    end = node.args[2] if len(node.args) > 2 else node.kwargs.get("end_dim", -1)
    return node.args[0] if start == 1 and end == -1 else None


def _two_sizes(node: fx.Node) -> bool:
    """``t.view(a, b)`` / ``t.reshape(a, b)`` / ``torch.reshape(t, (a, b))``: a 2-D result."""
    if node.kwargs or len(node.args) < 2:
        return False
    if node.op == "call_method" and node.target in ("view", "reshape"):
        sizes = node.args[1:] if len(node.args) > 2 else node.args[1]
    elif node.op == "call_function" and node.target is torch.reshape and len(node.args) == 2:
        sizes = node.args[1]
    else:
        return False
    return isinstance(sizes, (list, tuple)) and len(sizes) == 2


def _is_2d(node: Any, gm: fx.GraphModule, depth: int = 0) -> bool:
    """Whether the graph shows ``node``'s value is 2-D (Note: [a flatten between a Linear and its BatchNorm1d])."""
    if not isinstance(node, fx.Node) or depth > 16:
        return False
    if _flatten_input(node) is not None or _two_sizes(node):
        return True
    t = _linear_input(node, gm)
    if t is not None:
        return _is_2d(t, gm, depth + 1)
    if node.op == "call_module" and len(node.args) == 1 and not node.kwargs \
            and _keeps_rank(gm.get_submodule(str(node.target))):
        return _is_2d(node.args[0], gm, depth + 1)
    return False


def _flattened_linear(bn_node: fx.Node, gm: fx.GraphModule) -> Optional[fx.Node]:
    """The ``flatten(fc(x), 1)`` node a BatchNorm1d module call reads, read by it alone; else ``None``."""
    if bn_node.op != "call_module" or len(bn_node.args) != 1 or bn_node.kwargs:
        return None
    if not isinstance(gm.get_submodule(str(bn_node.target)), nn.BatchNorm1d):
        return None
    flat = bn_node.args[0]
    y = _flatten_input(flat)
    if y is None or _linear_input(y, gm) is None or value_users(flat) != [bn_node] or len(flat.users) != 1:  # type: ignore[arg-type]
        return None
    return flat  # type: ignore[return-value]


def drop_noop_flattens(gm: fx.GraphModule) -> List[str]:
    """Remove the ``flatten(1)`` between a Linear whose output the graph shows is 2-D and the
    ``nn.BatchNorm1d`` reading it alone (Note: [a flatten between a Linear and its
    BatchNorm1d]), in place; returns the BatchNorm targets (the graph is recompiled when any)."""
    done: List[str] = []
    for node in list(gm.graph.nodes):
        flat = _flattened_linear(node, gm) if node.op == "call_module" else None
        if flat is None or not _is_2d(_linear_input(flat.args[0], gm), gm):  # type: ignore[arg-type]
            continue
        node.args = (flat.args[0],)
        gm.graph.erase_node(flat)
        done.append(str(node.target))
    if done:
        gm.graph.lint()
        gm.recompile()
    return done


def flattened_linear_reason(bn_node: fx.Node, gm: fx.GraphModule) -> Optional[str]:
    """Why a BatchNorm1d reading ``flatten(fc(x), 1)`` is left (the flatten stayed: the graph
    does not show the Linear's output is 2-D), or ``None`` for any other BatchNorm."""
    if _flattened_linear(bn_node, gm) is None:
        return None
    return ("BatchNorm1d over a flattened Linear output: it equals Linear -> BatchNorm1d only where the Linear's output "
            "is already 2-D (the flatten then changes nothing), and the graph does not show that (the Linear's input "
            "is not a flatten(x, 1), a view to two sizes or such a layer's output); on a 3-D output each position "
            "would be a feature of its own, which no Linear weight can absorb")
