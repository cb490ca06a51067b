"""The graph folder's stages: in one traced GraphModule, fold each BatchNorm into its neighbouring
layer, in stages that hand values on (see :data:`GRAPH_STAGES`):

* canonicalise: drop the no-op flattens between a linear and its BatchNorm1d, absorb crops
  of a convolution's output into its padding;
* match (:mod:`.match`): every node that applies a BatchNorm, as a
  :class:`~convbn.passes.fold.match.FoldSite` or the ``"left"`` outcome of one that cannot fold;
* fold (:mod:`.directions`): each site into the layer before it, or where exact the layer
  after; every BatchNorm gets a :class:`~convbn.passes.report.outcome.BNOutcome`
  (:mod:`.left_reasons` says why one stays);
* tidy: norm-act modules whose batch norm went become their tails, the graph is linted,
  unused submodules go and the module recompiles.

The recursion into submodules traced on their own is :func:`convbn.passes.fold.api.fold_module`."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, List, Set, Tuple, Union

import torch
import torch.fx as fx
from torch import nn

from ..bn.sites import bn_call
from ..bn.conv_crops import absorb_conv_crops
from ..bn.hand_rms_norms import hand_channel_rms_norms
from ..bn.norm_sites import channel_layer_norms
from ..bn.tokens import drop_noop_flattens
from ..report.outcome import BNOutcome
from .directions import fold_following, fold_preceding
from .folder import FoldContext, GraphFolder
from .layers import NormActTail, delete_unused_submodules
from .left_reasons import left_reason
from .match import FoldSite, match_bn

__all__ = ["GRAPH_STAGES", "fold_graph"]

#: What matching found in one graph, in graph order: a site to fold, or a BatchNorm's outcome.
Matches = List[Union[FoldSite, BNOutcome]]


def canonicalise(folder: GraphFolder, _: None) -> None:
    """Rewrite the graph into the shape matching expects."""
    drop_noop_flattens(folder.gm)  # Note: [a flatten between a Linear and its BatchNorm1d]
    absorb_conv_crops(folder.gm, folder.root)  # Note: [a crop of a convolution's output is less padding]
    # the same ops as one node, so that the report names the norm and why it stays: Note: [a
    # channel LayerNorm is one node] (an nn.LayerNorm / nn.RMSNorm between permutes), Note: [an
    # RMSNorm spelling is its own form]
    channel_layer_norms(folder.gm)
    hand_channel_rms_norms(folder.gm)


def match(folder: GraphFolder, _: None) -> Matches:
    """Every node that applies a BatchNorm, in graph order: a site, or the outcome of one
    that cannot fold whatever its neighbours are."""
    found: Matches = []
    for node in list(folder.gm.graph.nodes):
        if node.op in ("call_module", "call_function"):
            site = match_bn(node, folder.gm, folder.prefix, folder.root)
            if site is not None:
                found.append(site)
    return found


def fold_sites(folder: GraphFolder, matches: Matches) -> Set[str]:
    """Fold each site before or after it and record every BatchNorm's outcome; returns the
    paths of the norm-act modules whose batch norm was matched."""
    for site in matches:
        if isinstance(site, BNOutcome):
            folder.ctx.report.outcomes.append(site)
            continue
        # a fold before this one may have rewired its input (conv -> BN -> BN: the second BN
        # reads the conv once the first is folded), so it is read from the graph as it is now
        call = bn_call(site.node, folder.gm, folder.prefix, folder.root)  # None: a per-sample norm module (its one argument)
        site = dataclasses.replace(site, input=call.input if call is not None else site.node.args[0])
        with torch.no_grad():
            done, why_pre = fold_preceding(folder, site)
            if done:
                continue
            done, why_post = fold_following(folder, site)
        if not done:
            folder.ctx.report.leave(site.name, left_reason(folder, site, why_pre, why_post))
    return {site.inlined for site in matches if isinstance(site, FoldSite) and site.inlined}


def tidy(folder: GraphFolder, norm_act: Set[str]) -> None:
    """Where the graph changed: each norm-act module whose batch norm was folded becomes its
    tail (its children), the graph is linted, unused submodules go, and it recompiles."""
    if not folder.changed:
        return
    gm = folder.gm
    used = {str(n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    for path in norm_act - used:
        parent, _, attr = path.rpartition(".")
        setattr(gm.get_submodule(parent), attr, NormActTail(gm.get_submodule(path)))
    gm.graph.lint()
    delete_unused_submodules(gm, folder.root)  # never a child of the user's own modules
    gm.recompile()


#: The graph folder's stages, in order; each takes the folder and the previous stage's value.
GRAPH_STAGES: Tuple[Callable[[GraphFolder, Any], Any], ...] = (canonicalise, match, fold_sites, tidy)


def fold_graph(gm: fx.GraphModule, root: nn.Module, prefix: str, ctx: FoldContext) -> bool:
    """Fold the BatchNorms of ``gm``, traced from ``root`` (qualified name ``prefix``), by
    running :data:`GRAPH_STAGES` in order; returns whether the graph changed."""
    folder = GraphFolder(gm, root, prefix, ctx)
    value: Any = None
    for stage in GRAPH_STAGES:
        value = stage(folder, value)
    return folder.changed
