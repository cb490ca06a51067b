"""BatchNorm sites: where a traced graph normalises with a BatchNorm that convert may fuse.

A :class:`BNSite` is one BatchNorm computation in the graph: the node whose value is the
normalised tensor, the node it normalises, and the module that holds the parameters,
running statistics and mode the computation reads (read again at every call of the fused
chain). :func:`find_bn_sites` lists them in graph order; a BatchNorm that cannot be a
site gets a :class:`~convbn.passes.report.SkippedBN` with the reason. The matcher
(:mod:`convbn.passes.match`) then looks for the convolution before and the tail after.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List

import torch.fx as fx
from torch.nn.modules.batchnorm import _BatchNorm

from ..nn.sync import SyncBatchNorm
from .report import ConvertReport, SkippedBN

__all__ = ["BNSite", "find_bn_sites"]

_STD_BN_FORWARDS = (_BatchNorm.forward, SyncBatchNorm.forward)


@dataclass
class BNSite:
    """One BatchNorm computation in a traced graph.

    Attributes:
        node: the node whose value is the BatchNorm's output.
        input: the node it normalises.
        bn: the module holding weight, bias, running statistics, momentum and mode.
        name: the BatchNorm's qualified name, for reports.
    """

    node: fx.Node
    input: fx.Node
    bn: _BatchNorm
    name: str


def _input_of(node: fx.Node) -> object:
    return node.args[0] if node.args else node.kwargs.get("input")


def find_bn_sites(gm: fx.GraphModule, prefix: str, report: ConvertReport) -> List[BNSite]:
    """The BatchNorm sites of ``gm`` in graph order (``prefix``: ``gm``'s qualified name + ".").

    Args:
        gm: the traced graph module (BatchNorm modules are leaves).
        prefix: qualified-name prefix for report lines.
        report: receives a :class:`SkippedBN` for each BatchNorm that cannot be a site.

    Returns:
        The sites, in graph order.
    """
    graph = gm.graph
    bn_calls: Dict[str, int] = {}
    for node in graph.nodes:
        if node.op == "call_module" and isinstance(gm.get_submodule(str(node.target)), _BatchNorm):
            bn_calls[str(node.target)] = bn_calls.get(str(node.target), 0) + 1
    sites: List[BNSite] = []
    for node in graph.nodes:
        if node.op != "call_module":
            continue
        bn = gm.get_submodule(str(node.target))
        if not isinstance(bn, _BatchNorm):
            continue
        name = prefix + str(node.target)

        def skip(reason: str) -> None:
            report.skipped.append(SkippedBN(name, reason, None))

        if type(bn).forward not in _STD_BN_FORWARDS:
            skip(f"{type(bn).__name__} has its own forward (e.g. cross-process statistics); left as is")
            continue
        if bn_calls[str(node.target)] > 1:
            if not any(s.bn == name for s in report.skipped):  # one line per module, not per call
                skip(f"the BatchNorm module is called {bn_calls[str(node.target)]} times (shared running statistics)")
            continue
        if bn.running_mean is not None and bn.running_mean.is_meta:
            skip("the BatchNorm's buffers are on the meta device")
            continue
        src = _input_of(node)
        if not isinstance(src, fx.Node):
            skip("its input is not a traced tensor")
            continue
        sites.append(BNSite(node, src, bn, name))
    return sites
