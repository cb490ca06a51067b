"""Chains that start at a concatenation: a DenseNet layer's ``cat -> BN -> act -> conv``.

Two steps, used by :func:`convbn.convert`:

1. :func:`flatten_cats` rewrites nested concatenations into one ``cat`` of their leaves
   (before matching);
2. :func:`chain_call_inputs` gives a pre-activation head chain (matched by
   :mod:`convbn.passes.convert.match`) whose input is a channel concatenation the *pieces* as its
   call arguments: the chain keeps the pieces (earlier outputs, alive anyway) and never
   the concatenation (Note: [a head over a concatenation] in autograd/chain.py).

DenseNet-style code concatenates every earlier feature map and runs BN -> act -> conv on
the result. Real code writes the concatenation two ways:

* a Python list of features, ``torch.cat(features, 1)`` (torchvision): one ``cat`` node
  whose pieces are the individual feature maps;
* nested, each layer returning ``torch.cat([x, new], 1)`` (MONAI): the next layer's input
  is a concatenation of the previous concatenation, a tree of ``cat`` nodes.

A chain that keeps only the pieces (not the concatenation) needs the *leaves* of such a
tree: :func:`flatten_cats` rewrites every ``cat`` whose pieces are themselves ``cat`` nodes
along the same dimension into one ``cat`` of their leaves (the value is unchanged:
concatenation is associative), then erases the inner ``cat`` nodes nobody uses any more.
An inner concatenation that still has another user (one that needs its value, not a
``cat`` that was flattened) stays in the graph for that user.

Note: [flattening a nested DenseNet]
    MONAI's layer i returns ``c_i = cat([c_{i-1}, new_i])``; ``c_i`` is read by layer i+1's
    BN (its head) and by ``c_{i+1} = cat([c_i, new_{i+1}])``. After flattening,
    ``c_{i+1} = cat([x, new_1, ..., new_{i+1}])`` no longer reads ``c_i``, so ``c_i``'s only
    user is the BN: a head whose input is ``cat(x, new_1, ..., new_i)`` and which can keep
    the pieces ``new_j`` (alive anyway as pieces of later heads) instead of ``c_i``.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx

__all__ = ["CAT_FUNCTIONS", "cat_parts", "channel_cat_pieces", "flatten_cats", "shared_pieces", "chain_call_inputs",
           "erase_unused_cat"]

#: Functions recorded for a concatenation (``torch.concat`` / ``concatenate`` are aliases of ``cat``).
CAT_FUNCTIONS = tuple(f for f in (torch.cat, getattr(torch, "concat", None), getattr(torch, "concatenate", None))
                      if f is not None)


def cat_parts(node: fx.Node) -> Optional[Tuple[List[fx.Node], int]]:
    """``(pieces, dim)`` of a ``torch.cat`` node whose pieces are all graph values, else ``None``.

    ``dim`` is as written (possibly negative); ``None`` also for an ``out=`` concatenation
    or pieces that are constants.
    """
    if node.op != "call_function" or node.target not in CAT_FUNCTIONS:
        return None
    if set(node.kwargs) - {"tensors", "dim", "axis"}:
        return None  # out=: writes into a tensor the caller holds
    tensors = node.args[0] if node.args else node.kwargs.get("tensors")
    if len(node.args) > 1:
        dim = node.args[1]
    else:
        dim = node.kwargs.get("dim", node.kwargs.get("axis", 0))
    if not isinstance(tensors, (list, tuple)) or not tensors or not isinstance(dim, int) or isinstance(dim, bool):
        return None
    if not all(isinstance(t, fx.Node) for t in tensors):
        return None
    return list(tensors), dim  # type: ignore[arg-type]


def channel_cat_pieces(node: fx.Node, ndim: int) -> Optional[List[fx.Node]]:
    """The pieces of ``node`` if it concatenates ``ndim``-dimensional tensors along dim 1
    (written ``1`` or ``1 - ndim``), else ``None``."""
    parts = cat_parts(node)
    if parts is None:
        return None
    pieces, dim = parts
    return pieces if dim in (1, 1 - ndim) and ndim >= 2 else None


def _same_dim(a: int, b: int) -> bool:
    # Nested cats concatenate tensors of one rank, so equal literals name the same dim;
    # a negative and a non-negative literal could too, but only the rank could tell.
    return a == b


def flatten_cats(graph: fx.Graph) -> Dict[fx.Node, List[fx.Node]]:
    """Rewrite every nested concatenation of ``graph`` into one ``cat`` of its leaves, in place.

    Inner ``cat`` nodes that end up with no user are erased; the caller lints / recompiles.

    Returns:
        ``{cat node: its leaves}`` for every ``cat`` node that is left (flattened or not).

    Example:
        >>> class M(torch.nn.Module):
        ...     def forward(self, a, b, c):
        ...         return torch.cat([torch.cat([a, b], 1), c], 1)
        >>> gm = fx.symbolic_trace(M())
        >>> leaves = flatten_cats(gm.graph)
        >>> [[p.name for p in ps] for ps in leaves.values()]
        [['a', 'b', 'c']]
    """
    leaves: Dict[fx.Node, List[fx.Node]] = {}
    for node in list(graph.nodes):  # topological order: inner cats are flattened first
        parts = cat_parts(node)
        if parts is None:
            continue
        pieces, dim = parts
        flat: List[fx.Node] = []
        changed = False
        for p in pieces:
            inner = cat_parts(p) if p in leaves else None
            if inner is not None and _same_dim(inner[1], dim):
                flat.extend(leaves[p])
                changed = True
            else:
                flat.append(p)
        if changed:
            args = list(node.args)
            if args:
                args[0] = flat
                node.args = tuple(args)
            else:
                node.kwargs = {**node.kwargs, "tensors": flat}
        leaves[node] = flat
    for node in reversed(list(leaves)):
        if not node.users:
            graph.erase_node(node)
            del leaves[node]
    return leaves


def shared_pieces(heads: Sequence[Sequence[fx.Node]]) -> Dict[fx.Node, int]:
    """How many of ``heads`` (each a list of pieces) keep each piece; only pieces kept by two or more."""
    count: Dict[fx.Node, int] = {}
    for pieces in heads:
        for p in dict.fromkeys(pieces):
            count[p] = count.get(p, 0) + 1
    return {p: n for p, n in count.items() if n > 1}


# --------------------------------------------------------------------------- a chain's call


def chain_call_inputs(x0: fx.Node, head_users: Sequence[fx.Node], ndim: int) -> List[fx.Node]:
    """What a head chain is called with: the pieces of ``x0`` when it is a channel
    concatenation read only by the head (``head_users``), else ``[x0]``.

    Note: [a head chain's call]
        A head's chain input is the tensor its BatchNorm normalises
        (:func:`convbn.passes.convert.match.head_input`). When that is ``torch.cat(pieces, 1)`` (after
        :func:`flatten_cats`: the leaves) and nothing else reads it, the chain is called with
        the pieces and keeps them; the ``cat`` node is then unused and erased by the rewrite
        (:func:`erase_unused_cat`), so the concatenation is never materialised outside the
        chain. A concatenation something else reads too stays one input.
    """
    pieces = channel_cat_pieces(x0, ndim)
    if pieces is None or any(u not in head_users for u in x0.users):
        return [x0]
    return pieces


def erase_unused_cat(node: fx.Node) -> None:
    """Erase ``node`` if it is a concatenation nothing reads any more."""
    if cat_parts(node) is not None and not node.users:
        node.graph.erase_node(node)
