"""A layer's weight computed in the graph from module tensors only, as a :class:`ComputedWeight`.

``F.conv2d(x, standardise(self.weight), self.bias)`` traces to a conv node whose weight is a
small graph over ``get_attr`` nodes (timm's ``StdConv2d``: ``reshape -> F.batch_norm ->
reshape_as``; ``(w - w.mean(...)) / (w.std(...) + eps)``; a gain times that). When every
node of that graph reads only the model's parameters and buffers (never an activation or
a placeholder), is a function or method call (no module call: its hooks would be skipped),
and is neither random nor in place, :func:`computed_weight` copies it into a program that
a fused layer runs to read its weight (:mod:`convbn.nn.computed_weight`); otherwise it
gives the reason. :func:`erase_unused` removes the graph's copy once the layer is fused.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple, Union

import torch
import torch.fx as fx
from torch import Tensor, nn

from ...nn.computed_weight import ComputedWeight

__all__ = ["computed_weight", "weight_nodes", "erase_unused"]

#: name parts of calls whose result is random: a weight drawn anew per call (DropConnect) is
#: not a function of the parameters, and computing it outside the call would move the RNG
_RANDOM = frozenset({"dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout",
                     "rrelu", "rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "randperm",
                     "bernoulli", "normal", "multinomial", "poisson"})
#: calls that move running statistics when given them
_STATS = frozenset({"batch_norm", "instance_norm"})


def _call_name(node: fx.Node) -> str:
    t = node.target
    return t if isinstance(t, str) else getattr(t, "__name__", str(t))


def weight_nodes(w: fx.Node) -> Union[List[fx.Node], str]:
    """The nodes computing ``w`` in graph order, or why ``w`` is not computed from module tensors."""
    seen: Dict[fx.Node, None] = {}
    todo = [w]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen[n] = None
        if n.op == "placeholder":
            return "it is computed from the module's inputs"
        if n.op == "call_module":
            return f"it is computed by a module call ({n.target})"
        if n.op not in ("get_attr", "call_function", "call_method"):
            return f"it is computed by a '{n.op}' node"
        name = _call_name(n).lower()
        if n.op != "get_attr" and (name in _RANDOM or (name.endswith("_") and not name.endswith("__"))):
            return f"it is computed by '{_call_name(n)}', which is random or in place"
        if name in _STATS and any(isinstance(a, fx.Node) for a in (*n.args[1:3], n.kwargs.get("running_mean"),
                                                                     n.kwargs.get("running_var"))):
            return f"it is computed by '{_call_name(n)}' with running statistics, which it updates"
        todo.extend(n.all_input_nodes)
    order = {n: i for i, n in enumerate(w.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def _source(node: fx.Node, root: nn.Module) -> Union[Tuple[nn.Module, str], str]:
    """``(owner, attribute)`` of a ``get_attr`` node's parameter or buffer, looked up on ``root``
    (the user's module, not the traced stand-ins), or why it is none."""
    path, _, attr = str(node.target).rpartition(".")
    try:
        owner = root.get_submodule(path) if path else root
    except AttributeError:
        return f"it reads '{node.target}', which is not a tensor of the model's modules"
    if not isinstance(getattr(owner, attr, None), Tensor):
        return f"it reads '{node.target}', which is not a tensor of the model's modules"
    return owner, attr


def computed_weight(w: fx.Node, root: nn.Module) -> Union[ComputedWeight, str]:
    """The computation of weight node ``w`` as a :class:`ComputedWeight`, or the reason it cannot be one.

    Args:
        w: a layer's weight argument (not itself a ``get_attr``).
        root: the user's module the graph was traced from (parameters are looked up there).
    """
    nodes = weight_nodes(w)
    if isinstance(nodes, str):
        return nodes
    graph = fx.Graph()
    env: Dict[fx.Node, fx.Node] = {}
    sources: List[Tuple[nn.Module, str]] = []
    for n in nodes:
        if n.op == "get_attr":
            found = _source(n, root)
            if isinstance(found, str):
                return found
            sources.append(found)
            env[n] = graph.placeholder(f"source{len(sources) - 1}")
    for n in nodes:
        if n.op != "get_attr":
            env[n] = graph.node_copy(n, env.__getitem__)
    if not sources:
        return "it reads no parameter or buffer"
    graph.output(env[w])
    program = fx.GraphModule(nn.Module(), graph, class_name="ComputedWeightProgram")
    cw = ComputedWeight(program, sources, w.name)
    with torch.no_grad():
        try:
            value = cw.compute()
        except Exception as e:  # noqa: BLE001 - the reason is reported, the layer left unfused
            return f"computing it apart from the model failed ({type(e).__name__}: {e})"
    if value.dim() < 2:
        return f"it computes a tensor of shape {tuple(value.shape)}, not a weight"
    return cw


def erase_unused(graph: fx.Graph, nodes: List[fx.Node]) -> None:
    """Erase, last first, the nodes of ``nodes`` (in ``graph``) no node reads any more: fused layers'
    weight computations, now run by the layers; what other nodes still read stays."""
    alive = set(graph.nodes)
    for n in reversed([n for n in graph.nodes if n in set(nodes)]):
        if n in alive and not n.users and n.op != "output":
            graph.erase_node(n)
