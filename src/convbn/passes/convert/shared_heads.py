"""Pre-activation heads read by several convolutions: one head per convolution.

A pre-activation block that downsamples computes ``z = act(BN(x))`` once and reads it with
two convolutions (the body and the projection shortcut). A head chain (Note: [matched layers
and chains] in match.py) has one convolution after its tail, so :func:`split_shared_heads`
rewrites the graph before matching: the first convolution keeps the BatchNorm call and its
tail; each further one reads a copy of the tail over a :class:`~convbn.nn.bn_shared.SharedBatchStats`
of the BatchNorm (the same batch norm, no second running-statistics update; Note: [a
pre-activation head shared by several convs] in nn/bn_shared.py). Every copy is then an
ordinary head that :func:`~convbn.passes.convert.match.find_layers` matches and fuses.

The rewrite is made only where every reader is a convolution a chain can start with and the
tail is element-wise and deterministic (no dropout: two copies would draw two masks), with
no hooks on the BatchNorm, the tail's modules or the convs, and the BatchNorm computes with
torch's own ``_BatchNorm.forward`` (not a SyncBatchNorm, whose copy would reduce its batch
statistics over one process alone); otherwise the graph is left as it was.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch.fx as fx
from torch import nn

from ...functional.activations import Activation, activation_from_module
from ...nn.bn_shared import SharedBatchStats
from ..bn.norm_sites import find_norm_sites
from ..bn.sites import splittable_bn_calls
from ..graph.hooks import global_hooks, hook_reason
from ..graph.layers import layer_call
from .match_tail import match_tail
from ..graph.shape_uses import value_users

__all__ = ["split_shared_heads", "split_shared_norm_heads", "free_target"]


def _deterministic(element: object) -> bool:
    return isinstance(element, (Activation, nn.PReLU)) or (
        isinstance(element, nn.Module) and activation_from_module(element) is not None)


def _conv_readers(out: fx.Node, bn: nn.Module, gm: fx.GraphModule, joins: Callable[[fx.Node, fx.Node, nn.Module], bool]
                  ) -> Optional[List[fx.Node]]:
    """The readers of ``out`` if there are several and each is a conv / linear call reading it
    as its (only) input that a head chain can start with, else ``None``."""
    readers = value_users(out)
    if len(readers) < 2 or len(readers) != len(out.users):
        return None
    for r in readers:
        call = layer_call(r, gm)
        if call is None or isinstance(call, str) or call.input is not out or not joins(r, out, bn):
            return None
        if sum(a is out for a in (*r.args, *r.kwargs.values())) != 1:
            return None
        if call.module is not None and hook_reason(call.module):
            return None
    return readers


def free_target(gm: fx.GraphModule, base: str) -> str:
    """``base`` with dots as underscores, made unique among ``gm``'s attributes."""
    name = base.replace(".", "_")
    while hasattr(gm, name):
        name += "_"
    return name


def _split_tail(node: fx.Node, norm: Any, gm: fx.GraphModule, root: nn.Module, prefix: str,
                joins: Callable[[fx.Node, fx.Node, nn.Module], bool]) -> Optional[Tuple[Any, fx.Node, List[fx.Node]]]:
    """The tail after a head's norm ``node``, the tail's output and the convolutions reading it, or
    ``None`` where the head cannot be split: no tail, one that reads shapes, a random or hooked
    element in it, or readers that are not all convolutions a chain could start from."""
    tail = match_tail(node, root, prefix)
    if not tail.ops or tail.shape_uses or not all(_deterministic(op.element) for op in tail.ops):
        return None
    if any(op.module_name and hook_reason(gm.get_submodule(str(op.node.target))) for op in tail.ops
           if op.node.op == "call_module"):
        return None
    out = tail.out(node)
    readers = _conv_readers(out, norm, gm, joins)
    return None if readers is None else (tail, out, readers)


def split_shared_heads(gm: fx.GraphModule, root: nn.Module, prefix: str,
                       joins: Callable[[fx.Node, fx.Node, nn.Module], bool]) -> List[str]:
    """Give each conv that reads a pre-activation ``act(BN(x))`` its own head, in ``gm``'s graph.

    The copies call a module only ``gm`` holds, so every head made here must be fused: the
    split is made only where ``joins`` accepts every reader.

    Args:
        gm: the traced graph module (BatchNorms and convs are leaves).
        root: the module it was traced from.
        prefix: its qualified name + ``"."``, for names.
        joins: ``joins(conv_node, head_out, bn)``: whether the conv reading ``head_out`` would
            be matched as a head's conv and join its chain (:func:`convbn.passes.convert.match.find_layers`).

    Returns:
        The BatchNorm targets whose head was split (the graph is recompiled when any).
    """
    done: List[str] = []
    graph = gm.graph
    if global_hooks():
        return done
    for node, bn in splittable_bn_calls(gm):  # a SyncBatchNorm's second head would reduce its statistics alone
        src = node.args[0]
        src_call = layer_call(src, gm)
        if src_call is not None and not isinstance(src_call, str) and value_users(src) == [node]:
            continue  # conv -> BN: an ordinary layer, whose output any number of chains may read
        found = _split_tail(node, bn, gm, root, prefix, joins)
        if found is None:
            continue
        tail, out, readers = found
        inner = [node] + [n for op in tail.ops for n in (*op.extra, op.node)]
        for reader in readers[1:]:
            target = free_target(gm, f"{node.target}_shared")
            gm.add_submodule(target, SharedBatchStats(bn, prefix + str(node.target)))
            copies: Dict[fx.Node, fx.Node] = {}
            with graph.inserting_before(reader):
                copies[node] = graph.call_module(target, node.args)
                for n in [n for n in graph.nodes if n in inner[1:]]:  # graph order
                    copies[n] = graph.node_copy(n, lambda a: copies.get(a, a))
            reader.replace_input_with(out, copies[out])
        done.append(str(node.target))
    if done:
        graph.lint()
        gm.recompile()
    return done


def split_shared_norm_heads(gm: fx.GraphModule, root: nn.Module, prefix: str,
                            joins: Callable[[fx.Node, fx.Node, nn.Module], bool]) -> List[str]:
    """:func:`split_shared_heads` for per-sample norms without running statistics (GroupNorm,
    LayerNorm, InstanceNorm without ``track_running_stats``: a pre-activation ResNetV2 block's
    ``norm1``, read by its projection shortcut and ``conv1``): each further reader gets a copy of
    the norm call and its tail. A per-sample norm computes the same values however often it runs
    and moves no state, so the copy needs no :class:`SharedBatchStats`; a norm module with hooks
    or one called as a module is left as it is (a second call would run its hooks twice).

    Returns:
        The names of the norms whose head was split (the graph is recompiled when any).
    """
    done: List[str] = []
    graph = gm.graph
    if global_hooks():
        return done
    for site in find_norm_sites(gm, prefix, root).sites:
        node, view = site.node, site.bn
        if view.stats() != (None, None) or (view.module_call and hook_reason(view.owner)):  # type: ignore[attr-defined]
            continue
        src_call = layer_call(site.input, gm)
        if src_call is not None and not isinstance(src_call, str) and value_users(site.input) == [node]:
            continue  # conv -> norm: an ordinary layer
        found = _split_tail(node, view, gm, root, prefix, joins)  # type: ignore[arg-type]
        if found is None:
            continue
        tail, out, readers = found
        attrs = [a for a in node.all_input_nodes if a.op == "get_attr"]
        inner = [node] + [n for op in tail.ops for n in (*op.extra, op.node)]
        for reader in readers[1:]:
            copies: Dict[fx.Node, fx.Node] = {}
            with graph.inserting_before(reader):
                for a in attrs:  # a get_attr of its own: a norm site's tensors have one reader each
                    copies[a] = graph.get_attr(str(a.target))
                for n in [n for n in graph.nodes if n in inner]:  # graph order
                    copies[n] = graph.node_copy(n, lambda a: copies.get(a, a))
            reader.replace_input_with(out, copies[out])
        done.append(site.name)
    if done:
        graph.lint()
        gm.recompile()
    return done
