"""Assertions every test that converts a model makes: what was fused, and that the fused path
ran (issue 23). Shared by the test files; the fusion watch (``fusion_watch.py``) checks the
minimum for every test, these say more.

* :func:`assert_fused`: the report's counts and strategies, and the model's ``FusedChain``
  modules (found by walking ``named_modules()``, whatever the converted model's class);
* :func:`chain_nodes` / :func:`assert_chain_ran`: the ``ChainFunctionBackward`` nodes in an
  output's autograd graph -- the fused Function ran, not eager modules.
"""
from __future__ import annotations

from typing import Any, Collection, Dict, List, Optional

from torch import Tensor, nn

import convbn
from convbn.nn.chain import FusedChain
from convbn.passes.graph.graph_module import fused_modules as graph_fused_modules
from fusion_watch import CHAIN_BACKWARD, FUSED_BACKWARDS

__all__ = ["assert_fused", "chain_nodes", "assert_chain_ran", "fused_chains"]


def fused_chains(model: nn.Module) -> List[FusedChain]:
    """The ``FusedChain`` modules of ``model``: registered ones (``named_modules()``) and those
    an in-place rewrite added (running fused or not: ``convbn.fused_modules`` lists the running
    ones), each once, in that order."""
    found: Dict[int, FusedChain] = {}
    for _, m in (*model.named_modules(), *graph_fused_modules(model)):
        if isinstance(m, FusedChain):
            found.setdefault(id(m), m)
    return list(found.values())


def assert_fused(model: nn.Module, *, pairs: Optional[int] = None, chains: Optional[int] = None,
                 strategies: Optional[Collection[str]] = None, skipped: Optional[int] = None) -> Any:
    """Assert what ``convbn.convert`` fused in ``model`` and return its report.

    Args:
        model: a model ``convbn.convert`` returned (its ``convbn_report``).
        pairs: the number of fused layers expected (at least one whatever is given).
        chains: the number of chains expected; the model must hold that many ``FusedChain``s.
        strategies: the set of strategies of the ordinary fused layers (heads and ends excluded).
        skipped: the number of BatchNorms expected left unfused.
    """
    report = model.convbn_report
    assert report.pairs, f"convert fused nothing:\n{report}"
    if pairs is not None:
        assert len(report.pairs) == pairs, f"expected {pairs} fused layers, got {len(report.pairs)}:\n{report}"
    found = fused_chains(model)
    assert found, f"the converted model holds no FusedChain:\n{report}"
    if chains is not None:
        assert report.num_chains == chains, f"expected {chains} chains, got {report.num_chains}:\n{report}"
        assert len(found) == chains, f"expected {chains} FusedChain modules in the model, got {len(found)}"
    if strategies is not None:
        got = {p.strategy for p in report.pairs if p.kind == "layer"}
        assert got == set(strategies), f"expected strategies {set(strategies)}, got {got}:\n{report}"
    if skipped is not None:
        assert len(report.skipped) == skipped, f"expected {skipped} BatchNorms left, got {len(report.skipped)}:\n{report}"
    return report


def chain_nodes(out: Tensor) -> List[Any]:
    """Every ``ChainFunctionBackward`` node in ``out``'s autograd graph (each fused chain call
    that produced it, directly or through later ops)."""
    # visited nodes are kept (not their ids): the Python object of a C++ autograd node can be
    # freed once read and its id reused by the next one read, which would end the walk early
    found, seen = [], {}
    stack = [out.grad_fn] if out.grad_fn is not None else []
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        if type(node).__name__ in FUSED_BACKWARDS:
            found.append(node)
        stack.extend(n for n, _ in node.next_functions)
    return found


def assert_chain_ran(out: Tensor, calls: Optional[int] = None) -> List[Any]:
    """Assert ``out`` was computed through the fused chain Function (``calls``: how many chain
    calls exactly; at least one whatever is given); returns the nodes."""
    nodes = chain_nodes(out)
    assert nodes, (f"no {CHAIN_BACKWARD} in the output's autograd graph (grad_fn {type(out.grad_fn).__name__}): "
                   "the chain ran as eager modules")
    if calls is not None:
        assert len(nodes) == calls, f"expected {calls} fused chain calls in the graph, found {len(nodes)}"
    return nodes
