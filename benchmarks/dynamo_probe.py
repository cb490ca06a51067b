"""What a Dynamo-based capture would see: a ``torch.compile`` backend that only looks.

:class:`Probe` is a Dynamo backend (``torch.compile(model, backend=Probe())``) that runs
every captured graph as Dynamo hands it over (``gm.forward``: no inductor, no AOTAutograd,
the same ops as eager) and records, per graph, what a fusion backend built on Dynamo would
have to match: the batch norms in it and how they are written, the convolutions feeding
them, whether their parameters and buffers arrive as graph inputs (lifted) or as module
calls, and which of the user's modules each came from (``nn_module_stack``). It is the
prototype of a Dynamo front end for ``convbn``; it rewrites nothing. Used by
``bm_capture_vs_dynamo.py``.

Example::

    probe = Probe()
    out = torch.compile(model, backend=probe)(x)
    print(probe.summary())   # graphs, batch norms seen, conv -> BN pairs a backend could fuse
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List

import torch
import torch.nn.functional as F
from torch import fx, nn

__all__ = ["Probe", "graph_summary", "dynamo_counters", "reset"]

_BN_FUNCTIONS = {F.batch_norm, torch.batch_norm, torch.native_batch_norm}
_CONV_FUNCTIONS = {torch.conv1d, torch.conv2d, torch.conv3d, F.conv1d, F.conv2d, F.conv3d,
                   torch.conv_transpose1d, torch.conv_transpose2d, torch.conv_transpose3d,
                   F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d, F.linear, torch.addmm}


def _owner(node: fx.Node) -> str:
    """The innermost user module a node was traced in, as ``path (Class)``; ``""`` if unknown."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path, cls = list(stack.values())[-1]
    name = getattr(cls, "__name__", str(cls).rsplit(".", 1)[-1].strip("'>"))
    return f"{path} ({name})"


def _is_bn(gm: fx.GraphModule, node: fx.Node) -> str:
    """``"function"`` (an inlined ``F.batch_norm``), ``"module"`` (a BatchNorm module call) or ``""``."""
    if node.op == "call_function" and node.target in _BN_FUNCTIONS:
        return "function"
    if node.op == "call_module" and isinstance(gm.get_submodule(str(node.target)), nn.modules.batchnorm._BatchNorm):
        return "module"
    return ""


def _is_conv(gm: fx.GraphModule, node: fx.Node) -> bool:
    if node.op == "call_function":
        return node.target in _CONV_FUNCTIONS
    if node.op == "call_module":
        return isinstance(gm.get_submodule(str(node.target)), (nn.modules.conv._ConvNd, nn.Linear))
    return False


def graph_summary(gm: fx.GraphModule) -> Dict[str, Any]:
    """What one Dynamo graph holds for a Conv -> BN fusion.

    Args:
        gm: the ``GraphModule`` Dynamo passes to a backend.

    Returns:
        ``nodes``; ``bn_function`` / ``bn_module``: batch norms as inlined functions / module
        calls; ``bn_lifted``: of those, the ones whose weight is a graph input (a parameter
        lifted out of its module); ``pairs``: batch norms whose input is a convolution (or
        linear) used only by it, the pattern a fusion backend matches; ``bn_owners``: the
        user's module each batch norm came from (path and class).

    Example:
        >>> gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Conv2d(1, 1, 1), torch.nn.BatchNorm2d(1)))
        >>> graph_summary(gm)["pairs"]
        1
    """
    out: Dict[str, Any] = {"nodes": 0, "bn_function": 0, "bn_module": 0, "bn_lifted": 0, "pairs": 0,
                           "bn_owners": []}
    for node in gm.graph.nodes:
        out["nodes"] += 1
        kind = _is_bn(gm, node)
        if not kind:
            continue
        out[f"bn_{kind}"] += 1
        weight = node.args[3] if kind == "function" and len(node.args) > 3 else node.kwargs.get("weight")
        if isinstance(weight, fx.Node) and weight.op == "placeholder":
            out["bn_lifted"] += 1
        src = node.args[0] if node.args else None
        if isinstance(src, fx.Node) and _is_conv(gm, src) and len(src.users) == 1:
            out["pairs"] += 1
        out["bn_owners"].append(_owner(node) or str(node.target))
    return out


class Probe:
    """A Dynamo backend that records :func:`graph_summary` of every graph and runs it as is.

    Example:
        >>> probe = Probe()
        >>> _ = torch.compile(torch.nn.BatchNorm1d(2), backend=probe)(torch.randn(4, 2))
        >>> probe.summary()["graphs"]
        1
    """

    def __init__(self) -> None:
        self.graphs: List[Dict[str, Any]] = []

    def __call__(self, gm: fx.GraphModule, example_inputs: List[Any]) -> Callable[..., Any]:
        self.graphs.append(graph_summary(gm))
        return gm.forward

    def summary(self) -> Dict[str, Any]:
        """Graphs compiled so far, and the per-graph counts summed."""
        total: Dict[str, Any] = {"graphs": len(self.graphs)}
        for key in ("nodes", "bn_function", "bn_module", "bn_lifted", "pairs"):
            total[key] = sum(g[key] for g in self.graphs)
        total["bn_owner_classes"] = sorted({o.rsplit("(", 1)[-1].rstrip(")") for g in self.graphs
                                            for o in g["bn_owners"] if "(" in o})
        return total


def dynamo_counters() -> Dict[str, Any]:
    """Dynamo's own counts since the last :func:`reset`: graph breaks (with their reasons) and
    unique graphs (recompiles show as graphs a :class:`Probe` receives after the first call)."""
    from torch._dynamo.utils import counters

    breaks = dict(counters["graph_break"])
    return {"graph_breaks": sum(breaks.values()), "break_reasons": {k[:160]: v for k, v in breaks.items()},
            "unique_graphs": counters["stats"].get("unique_graphs", 0)}


def reset() -> None:
    """Forget every compiled frame and every count (a fresh start for the next case)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
