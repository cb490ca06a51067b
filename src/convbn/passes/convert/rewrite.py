"""Rewriting: replace each matched chain by one :class:`~convbn.nn.chain.FusedChain` call.

The rewritten graph runs as the user's module's own forward, in place
(:func:`convbn.passes.graph.graph_module.install`): the module tree stays (same objects, same
order) and the new chain modules are unregistered attributes, so ``state_dict()`` keys
and parameters are unchanged. Layers whose
modules carry hooks are left unfused here (a fused chain would bypass them), and each new
chain learns which modules' hooks it must honour when they are registered later.
"""
from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Dict, List, Sequence, Tuple

import torch.fx as fx
from torch import nn

from ...nn.standard_bn import has_standard_bn_forward
from ...nn.sync import SyncBatchNorm
from ...nn.chain import ChainLayer, FusedChain
from ...nn.norm_chain import FusedNormChain, is_norm_layer
from ...nn.norm_view import NormView
from ..graph.hooks import hook_reason
from ..graph.computed_weight import erase_unused
from ..graph.concat_heads import chain_call_inputs, erase_unused_cat, shared_pieces
from .match import MatchedLayer
from ..plan.first_call_peak import peak_above_eager
from ..plan.chain_plans import lazy_plan
from ..report.outcome import BNOutcome
from ..report.convert_report import ConvertReport, FusedPair

__all__ = ["rewrite_chains", "swap_sync_batchnorm", "chain_layer", "shallow_clone", "set_submodule", "drop_hooked", "watch_hooks"]


def rewrite_chains(root: nn.Module, gm: fx.GraphModule, chains: List[List[MatchedLayer]], mode: str,
             report: ConvertReport, lazy: bool = True) -> fx.GraphModule:
    graph = gm.graph
    built: List[Tuple[str, FusedChain]] = []
    base = len({p.chain for p in report.pairs})
    replaced: Dict[fx.Node, fx.Node] = {}
    pieces_of: List[List[fx.Node]] = []
    for ci, chain in enumerate(chains):
        layers = []
        for pos, l in enumerate(chain):
            cl = chain_layer(l, "recompute_bn" if mode == "auto" else mode)
            layers.append(cl)
            report.pairs.append(FusedPair(l.conv.name if l.conv is not None else "", l.bn_name, l.activation,
                                          base + ci, pos, cl))
            if not l.is_end:  # a head's BatchNorm is fused with the conv after it (the next layer's)
                conv, direction = (chain[pos + 1].conv, "following") if l.is_head else (l.conv, "preceding")
                report.recorded.append(BNOutcome(l.bn_name, "fused", conv.name if conv else None, direction))
        fused = (FusedNormChain if any(is_norm_layer(l) for l in layers) else FusedChain)(layers)
        if mode == "auto":  # planned lazily unless convert plans it with example_inputs; with
            # them, convert measures the whole step itself (no guard on the first call)
            fused.apply_plan(lazy_plan(fused, peak_above_eager if lazy else None))
        name = f"convbn_chain{ci}"
        while hasattr(root, name) or hasattr(gm, name):
            name += "_"
        built.append((name, fused))
        gm.add_module(name, fused)
        last = chain[-1].out
        # inserted where the chain's first node ran: its only input is ``x0``, and shape
        # uses between the conv and the chain's output can then read the chain's output
        x0 = chain[0].input
        inputs = [x0]
        if chain[0].is_head and chain[1].conv is not None:  # Note: [a head chain's call] in concat_heads.py
            inputs = chain_call_inputs(x0, [chain[0].bn_node], chain[1].conv.spec.dims + 2)  # type: ignore[list-item]
            if len(inputs) > 1:
                pieces_of.append(inputs)
        with graph.inserting_before(chain[0].first):
            new = graph.call_module(name, tuple(replaced.get(x, x) for x in inputs))
        last.replace_all_uses_with(new)
        replaced[last] = new
        for l in chain:
            inner = [n for n in l.nodes() if n is not last]
            for u in l.shape_uses:
                for old in inner:
                    u.replace_input_with(old, new)
        for l in reversed(chain):
            for n in l.nodes():
                graph.erase_node(n)
        erase_unused_cat(x0)
    # the fused layers compute their weights themselves now (Note: [a computed weight is read once per call])
    erase_unused(graph, [n for chain in chains for l in chain if l.conv is not None for n in l.conv.weight_nodes])
    for node in list(graph.nodes):
        if node.op == "get_attr" and not node.users:
            graph.erase_node(node)
    prefix = _root_prefix(chains)
    for piece, k in shared_pieces([[replaced.get(x, x) for x in p] for p in pieces_of]).items():
        report.shared_pieces[prefix + piece.name] = k
    graph.lint()
    gm.recompile()
    return gm


def _root_prefix(chains: Sequence[Sequence[MatchedLayer]]) -> str:
    """The qualified-name prefix of the traced module (``"a.b."``), read off a matched BatchNorm."""
    for chain in chains:
        for l in chain:
            if l.bn_node is not None and l.bn_name.endswith(str(l.bn_node.target)):
                return l.bn_name[: len(l.bn_name) - len(str(l.bn_node.target))]
    return ""


def chain_layer(l: MatchedLayer, mode: str) -> ChainLayer:
    """The :class:`ChainLayer` running matched layer ``l`` (head, ordinary or end)."""
    names = (l.conv.name if l.conv is not None else "", l.bn_name, *(op.module_name or str(op) for op in l.tail))
    tail = tuple(op.element for op in l.tail)
    if l.conv is None:
        return ChainLayer(bn=l.bn, mode=mode, names=names, tail=tail)
    return ChainLayer(l.conv.owner, l.conv.weight_name, l.conv.bias_name, l.conv.spec, l.bn, mode=mode,
                      names=names, tail=tail, computed=l.conv.computed)


def shallow_clone(module: nn.Module) -> nn.Module:
    """A copy of ``module`` sharing its parameters, buffers and children, with its own child
    list and hook dictionaries (hooks registered on either later stay on that one)."""
    clone = copy.copy(module)
    clone._modules = OrderedDict(module._modules)
    for key, value in vars(module).items():
        if "hook" in key and isinstance(value, dict):
            clone.__dict__[key] = copy.copy(value)
    return clone


def set_submodule(root: nn.Module, path: str, new: nn.Module, inplace: bool) -> nn.Module:
    """Put ``new`` at ``path`` under ``root``; containers on the way are shallow-copied
    unless ``inplace`` (the user's own modules stay untouched). Returns ``root``."""
    *parents, leaf = path.split(".")
    mod = root
    for name in parents:
        child = mod._modules[name]
        if not inplace:
            child = shallow_clone(child)
            mod._modules[name] = child
        mod = child
    mod._modules[leaf] = new
    return root


def _hooked_modules(layer: MatchedLayer, gm: fx.GraphModule) -> List[Tuple[str, nn.Module]]:
    """The modules of a matched layer whose own call the fused chain would replace: its
    conv module, its BatchNorm, and each module its tail calls (not modules built for
    functional ops)."""
    found: List[Tuple[str, nn.Module]] = []
    if layer.conv is not None and layer.conv.node.op == "call_module":
        found.append((layer.conv.name, layer.conv.owner))
    if isinstance(layer.bn, NormView):  # a per-sample norm: its module where the graph called it
        if layer.bn.module_call:
            found.append((layer.bn_name, layer.bn.owner))
    elif layer.bn is not None and has_standard_bn_forward(layer.bn):  # a norm-act module's hooks need its
        found.append((layer.bn_name, layer.bn))  # own forward: the graph falls back to the original (watch_inlined)
    for op in layer.tail:
        if op.module_name is not None:
            found.append((op.module_name, op.element))  # type: ignore[arg-type]
    return found


def drop_hooked(layers: List[MatchedLayer], gm: fx.GraphModule, report: ConvertReport) -> List[MatchedLayer]:
    """Leave unfused every layer one of whose modules has hooks (or a hook-based
    parametrization / pruning), with the reason: a fused chain would bypass them."""
    kept = []
    for l in layers:
        hooked = [(n, hook_reason(m)) for n, m in _hooked_modules(l, gm) if hook_reason(m)]
        if hooked and l.is_end:  # a bare conv: no BatchNorm to report, the chain just ends before it
            continue
        if hooked:
            name, why = hooked[0]
            report.leave(l.bn_name, f"'{name}' has hooks ({why}), which a fused chain would bypass; left unfused "
                         "so they run", l.conv.name if l.conv else None)
        else:
            kept.append(l)
    return kept


def watch_hooks(gm: fx.GraphModule, chains: List[List[MatchedLayer]], before: Sequence[str]) -> None:
    """Tell each new FusedChain which modules' hooks it must honour at call time."""
    new = [m for n, m in gm.named_children() if isinstance(m, FusedChain) and n not in before]
    for fused, chain in zip(new, chains):
        fused.watch([[m for _, m in _hooked_modules(l, gm)] for l in chain])


def swap_sync_batchnorm(model: nn.Module, inplace: bool) -> nn.Module:
    """Replace every ``nn.SyncBatchNorm`` by :class:`convbn.nn.SyncBatchNorm` sharing its
    parameters and buffers (CPU/gloo support, fusable). Without ``inplace`` the containers
    on the way are shallow-copied, so ``model`` itself is untouched."""
    paths = [n for n, m in model.named_modules() if type(m) is nn.SyncBatchNorm]
    if not paths:
        return model
    root = model if inplace else shallow_clone(model)
    clones = {id(model): root}
    for path in paths:
        parent, parent_new = model, root
        *parents, leaf = path.split(".")
        for name in parents:
            child = parent._modules[name]
            if id(child) not in clones:
                clones[id(child)] = child if inplace else shallow_clone(child)
                parent_new._modules[name] = clones[id(child)]
            parent, parent_new = child, clones[id(child)]
        parent_new._modules[leaf] = SyncBatchNorm.from_module(parent._modules[leaf])
    return root
