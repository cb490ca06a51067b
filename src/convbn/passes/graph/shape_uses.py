"""Shape-only uses of a tensor in an FX graph: reads of metadata that fusing and folding keep valid."""
from __future__ import annotations

from typing import List

import torch.fx as fx

__all__ = ["is_shape_use", "is_rank_use", "value_users"]

_SHAPE_ATTRS = ("shape", "ndim")
_SHAPE_METHODS = ("size", "dim", "ndimension")


def is_shape_use(node: fx.Node, of: fx.Node) -> bool:
    """True if ``node`` reads only the shape of ``of`` (``of.shape``, ``of.ndim``, ``of.size()``).

    Args:
        node: a user of ``of`` in an FX graph.
        of: the tensor-valued node it uses.

    Returns:
        Whether ``node`` reads metadata of ``of`` only, never its values.

    Example::

        >>> [u.name for u in conv_node.users if not is_shape_use(u, conv_node)]

    Note: [shape-only uses]
    Norm-act layers and user code check ``x.ndim`` / ``x.shape`` of a conv output before
    normalising it. Such a use reads metadata, not values, and every tensor of a fused
    layer (conv output, BN output, activation output) has the same shape, so the use can
    be re-pointed to the chain's output without changing anything it computes; and a
    conv whose output is folded (it then computes BN(conv)) keeps its shape too.
    """
    if node.op == "call_function" and node.target is getattr:
        return len(node.args) == 2 and node.args[0] is of and node.args[1] in _SHAPE_ATTRS
    if node.op == "call_method" and node.target in _SHAPE_METHODS:
        return len(node.args) >= 1 and node.args[0] is of and all(
            not isinstance(a, fx.Node) for a in list(node.args[1:]) + list(node.kwargs.values()))
    return False


def is_rank_use(node: fx.Node) -> bool:
    """True if ``node`` (a shape use) reads only a tensor's rank (``x.ndim``, ``x.dim()``).

    Every tensor inside a fused chain (each conv output, BN output, activation output) has
    the chain output's rank, so such a read stays exact when re-pointed to the chain's
    output even for a layer in the middle of the chain.
    """
    if node.op == "call_function" and node.target is getattr:
        return len(node.args) == 2 and node.args[1] == "ndim"
    return node.op == "call_method" and node.target in ("dim", "ndimension") and len(node.args) == 1 and not node.kwargs


def value_users(node: fx.Node) -> List[fx.Node]:
    """The users of ``node`` that read its values (every user but :func:`is_shape_use` ones)."""
    return [u for u in node.users if not is_shape_use(u, node)]
