"""A BatchNorm over a channel concatenation of convolutions: one BatchNorm slice per convolution.

``BN(cat([conv_1(a), ..., conv_k(b)], 1))`` followed by an element-wise activation is how
mixed-kernel convolutions (MixNet's MixConv) and Inception-style branches end. Its input is
a concatenation, not a convolution output, so no conv -> BN layer matches it.
:func:`split_cat_norms` rewrites the graph before matching into
``cat([act(BN_1(conv_1(a))), ..., act(BN_k(conv_k(b)))], 1)``, ``BN_i`` a
:class:`~convbn.nn.bn_slice.BatchNormSlice` of the BatchNorm's channels (the same values:
Note: [a BatchNorm over a concatenation of convolutions] in nn/bn_slice.py); every
``conv_i -> BN_i -> act`` is then an ordinary layer that
:func:`~convbn.passes.convert.match.find_layers` matches and fuses.

The rewrite is made only where it is exact and every slice can fuse: each piece is a
conv / conv-transpose / linear module call (its channel count known) read by the
concatenation alone; the concatenation is along channels, read by the BatchNorm alone; the
BatchNorm is called once, computes with torch's own ``_BatchNorm.forward`` (not a
SyncBatchNorm, whose slices would each reduce across processes) and has no hooks; the tail
copied onto each slice is element-wise, deterministic (no dropout: k copies would draw k
masks) and per-element (no per-channel PReLU), with no hooks and no shape reads. The slice
whose convolution runs first advances ``num_batches_tracked``.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch.fx as fx
from torch import nn

from ...functional.activations import Activation, activation_from_module
from ...nn.bn_slice import BatchNormSlice
from ..graph.hooks import global_hooks, hook_reason
from ..graph.layers import layer_call
from ..graph.shape_uses import value_users
from ..graph.concat_heads import cat_parts
from .match_tail import TailMatch, match_tail
from ..bn.sites import splittable_bn_calls
from .shared_heads import free_target

__all__ = ["split_cat_norms"]


def _per_element(element: object) -> bool:
    """An activation that maps each element alone, the same in every channel."""
    if isinstance(element, Activation):
        return True
    return isinstance(element, nn.Module) and not isinstance(element, nn.PReLU) and \
        activation_from_module(element) is not None


def _pieces(src: fx.Node, gm: fx.GraphModule) -> Optional[Tuple[List[Tuple[fx.Node, int]], int]]:
    """``([(piece, channels)], dim)`` of a channel concatenation of layer outputs, each read
    by it alone, or ``None``."""
    parts = cat_parts(src)
    if parts is None:
        return None
    pieces, dim = parts
    if len(pieces) < 2 or len(set(pieces)) != len(pieces):
        return None
    out: List[Tuple[fx.Node, int]] = []
    for p in pieces:
        call = layer_call(p, gm)
        if call is None or isinstance(call, str) or call.module is None or value_users(p) != [src] \
                or len(p.users) != 1 or hook_reason(call.module):
            return None
        mod = call.module
        rank = 2 if isinstance(mod, nn.Linear) else len(mod.kernel_size) + 2  # type: ignore[arg-type]
        if dim not in (1, 1 - rank):
            return None
        out.append((p, int(mod.out_features if isinstance(mod, nn.Linear) else mod.out_channels)))  # type: ignore[arg-type]
    return out, dim


def _tail_copyable(tail: TailMatch, gm: fx.GraphModule) -> bool:
    if tail.shape_uses or not all(_per_element(op.element) for op in tail.ops):
        return False
    return not any(hook_reason(gm.get_submodule(str(op.node.target))) for op in tail.ops if op.node.op == "call_module")


def split_cat_norms(gm: fx.GraphModule, root: nn.Module, prefix: str) -> List[str]:
    """Normalise each convolution of a channel concatenation with its own slice of the
    BatchNorm after it, in ``gm``'s graph (see module docstring).

    Args:
        gm: the traced graph module (BatchNorms and convs are leaves).
        root: the module it was traced from (tail modules are looked up on it).
        prefix: its qualified name + ``"."``, for names.

    Returns:
        The BatchNorm targets that were split (the graph is recompiled when any).
    """
    done: List[str] = []
    graph = gm.graph
    if global_hooks():
        return done
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node, bn in splittable_bn_calls(gm):
        src = node.args[0]
        found = _pieces(src, gm) if value_users(src) == [node] and len(src.users) == 1 else None
        if found is None or sum(c for _, c in found[0]) != bn.num_features:
            continue
        pieces, dim = found
        tail = match_tail(node, root, prefix)
        if not _tail_copyable(tail, gm):
            tail = TailMatch()  # the tail stays after the concatenation
        inner = [node] + [n for op in tail.ops for n in (*op.extra, op.node)]
        inner = sorted(inner, key=lambda n: order.get(n, len(order)))
        first = min(pieces, key=lambda pc: order[pc[0]])[0]
        outs: List[fx.Node] = []
        start = 0
        for piece, channels in pieces:
            target = free_target(gm, f"{node.target}_slice{start}")
            gm.add_submodule(target, BatchNormSlice(bn, start, start + channels, counts=piece is first,
                                                    source_name=prefix + str(node.target)))
            start += channels
            copies: Dict[fx.Node, fx.Node] = {}
            with graph.inserting_after(piece):  # right after its conv: the slices run in the convs' order
                last = copies[node] = graph.call_module(target, (piece,))
            for n in inner[1:]:  # the tail, each copy after the one before
                with graph.inserting_after(last):
                    last = copies[n] = graph.node_copy(n, lambda a: copies.get(a, a))
            outs.append(last)
        src.args, src.kwargs = (outs, dim), {}
        inner[-1].replace_all_uses_with(src)
        for n in reversed(inner):
            graph.erase_node(n)
        done.append(str(node.target))
    if done:
        graph.lint()
        gm.recompile()
    return done
