"""Recognising *frozen* BatchNorms: modules holding BatchNorm tensors as buffers only.

A frozen BatchNorm (torchvision's and timm's ``FrozenBatchNorm2d``, or a user's own) is any
module that is not a ``_BatchNorm``, has no parameters, holds 1-D floating buffers
``weight``, ``bias``, ``running_mean``, ``running_var`` of one size and a numeric ``eps``,
and computes eval-mode ``F.batch_norm`` with them, written in any way (``x * scale +
shift`` with reshapes, ``torch.addcmul`` ...). Some also apply children after it (a
frozen norm-act layer: ``self.act(self.drop(x * scale + shift))``).

Note: [recognising a frozen BatchNorm numerically]
There is no call to match, so the check is numerical: a float64 copy of the module with
random buffer values runs, in training and in eval mode, on random float64 probes of rank
2 to 5, and its output (or, with children, the value its first child receives) must equal
``F.batch_norm(x, running_mean, running_var, weight, bias, training=False, eps=eps)`` at
1e-10 without changing its buffers. Random buffers and inputs make an accidental match
impossible in practice; the ranks it holds on are kept (a ``reshape(1, -1, 1, 1)`` is a
batch norm on 4-D inputs only), and the fused or folded model uses it only there. With
children, the forward is traced on its own (children are leaves) and split where the first
child is called: what comes before must read the input and the buffers only, and what
comes after (the *tail*, replayed in the graph like a norm-act layer's) must not read
them and must be the same in both modes.
"""
from __future__ import annotations

import copy
from typing import Callable, Tuple

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from .recognise import NormActBody, ancestors, body_signature, node_deps, trace_body
from ..graph.hooks import hook_reason
from ..graph.shape_uses import is_shape_use

__all__ = ["frozen_bn_ranks", "recognise_frozen_norm_act", "holds_frozen_bn_tensors"]

_TENSORS = ("weight", "bias", "running_mean", "running_var")
_PROBE_RANKS = (2, 3, 4, 5)


def holds_frozen_bn_tensors(module: nn.Module) -> bool:
    """The structural part of the test: not a ``_BatchNorm``, no parameters, no hooks, the four
    1-D floating buffers of one size and a numeric ``eps``."""
    if isinstance(module, _BatchNorm) or any(True for _ in module.parameters()) or hook_reason(module) is not None:
        return False
    bufs = module._buffers
    tensors = [bufs.get(n) for n in _TENSORS]
    eps = getattr(module, "eps", None)
    if any(not isinstance(t, Tensor) or t.dim() != 1 or not t.is_floating_point() or t.is_meta for t in tensors):
        return False
    return not isinstance(eps, bool) and isinstance(eps, (int, float)) and len({t.numel() for t in tensors}) == 1


def _probe_ranks(module: nn.Module, run: Callable[[nn.Module, Tensor], Tensor]) -> Tuple[int, ...]:
    """Ranks on which ``run(copy, x)`` equals eval-mode ``F.batch_norm`` with the copy's buffers
    (a float64 copy with random buffers, in both modes); ``()`` if a buffer changes."""
    try:
        probe = copy.deepcopy(module).double()
    except Exception:  # noqa: BLE001 - cannot copy: not recognised
        return ()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name in _TENSORS:
            t = getattr(probe, name)
            t.copy_(torch.rand(t.shape, generator=gen, dtype=torch.float64) + 0.5 if name == "running_var"
                    else torch.randn(t.shape, generator=gen, dtype=torch.float64))
    before = [getattr(probe, n).clone() for n in _TENSORS]
    channels, eps = before[0].numel(), float(probe.eps)
    ranks = []
    for rank in _PROBE_RANKS:
        x = torch.randn((2, channels, 3, 5, 7)[:rank], generator=gen, dtype=torch.float64)
        want = F.batch_norm(x, before[2], before[3], before[0], before[1], training=False, eps=eps)
        ok = True
        for training in (True, False):
            probe.train(training)
            try:
                with torch.no_grad():
                    got = run(probe, x)
            except Exception:  # noqa: BLE001 - the module refuses this rank: not that rank
                ok = False
                break
            if not (isinstance(got, Tensor) and got.shape == want.shape and got.dtype == torch.float64
                    and torch.allclose(got, want, rtol=1e-10, atol=1e-12)):
                ok = False
                break
        if ok:
            ranks.append(rank)
    if any(not torch.equal(b, getattr(probe, n)) for b, n in zip(before, _TENSORS)):
        return ()
    return tuple(ranks)


def frozen_bn_ranks(module: nn.Module) -> Tuple[int, ...]:
    """The input ranks on which ``module``'s whole output is a frozen batch norm, ``()`` if none.

    See Note: [recognising a frozen BatchNorm numerically].

    Args:
        module: any module.

    Returns:
        The ranks (among 2-5) where its output equals eval-mode ``F.batch_norm`` with its
        buffers; ``()`` when it is no frozen BatchNorm.

    Example:
        >>> frozen_bn_ranks(torchvision.ops.FrozenBatchNorm2d(8))
        (4,)
    """
    if not holds_frozen_bn_tensors(module):
        return ()
    return _probe_ranks(module, lambda m, x: m(x))


def recognise_frozen_norm_act(module: nn.Module) -> NormActBody:
    """Whether ``module`` is a frozen BatchNorm followed by a tail of its children.

    Args:
        module: a module for which :func:`holds_frozen_bn_tensors` holds and which has children.

    Returns:
        A :class:`~convbn.passes.bn.recognise.NormActBody` whose ``bn_node`` is the value the
        first child receives (``bn_input``: the module's input, ``ranks``: where it holds),
        or with ``reason`` set.
    """
    name = type(module).__name__
    if not holds_frozen_bn_tensors(module) or not any(True for _ in module.children()):
        return NormActBody(reason=f"{name} is not a frozen BatchNorm with children")
    found = {}
    for training in (True, False):
        graph, _, error = trace_body(module, training)
        if graph is None:
            return NormActBody(reason=f"{name}: its forward could not be traced ({error})")
        got = _split(graph)
        if isinstance(got, str):
            return NormActBody(reason=f"{name}: {got}")
        found[training] = (graph, *got)
    sigs = [body_signature(g, bn, skip) for g, bn, skip, _ in found.values()]
    if sigs[0] != sigs[1]:
        return NormActBody(reason=f"{name}: what follows its batch norm differs between training and eval mode")
    graph, bn, skip, prefix = found[False]
    x = next(n for n in graph.nodes if n.op == "placeholder")

    def run(copy_module: nn.Module, inp: Tensor) -> Tensor:
        # an Interpreter, not GraphModule.__call__, which prints a traceback for ranks it refuses
        return fx.Interpreter(fx.GraphModule(copy_module, prefix)).run(inp)

    ranks = _probe_ranks(module, run)
    if not ranks:
        return NormActBody(reason=f"{name}: what it computes before its first child is not a frozen batch norm")
    return NormActBody(graph, bn, skip, bn_input=x, ranks=ranks)


def _split(graph: fx.Graph) -> "Tuple[fx.Node, Tuple[fx.Node, ...], fx.Graph] | str":
    """``(bn, skipped prefix nodes, prefix graph)``: the value the first child receives, the
    nodes computing it (not replayed), and a graph of them; or why the body does not split."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) != 1:
        return f"its forward takes {len(placeholders)} inputs"
    x = placeholders[0]
    deps = node_deps(graph, x)
    first = next((n for n in graph.nodes if n.op == "call_module" and n in deps), None)
    if first is None:
        return "its forward calls no child on its input"
    bn = first.args[0] if first.args else None
    if not isinstance(bn, fx.Node) or bn not in deps or bn is x:
        return "its first child does not receive a value computed from its input"
    before = ancestors(bn)
    if any(n.op in ("call_module", "placeholder") and n is not x for n in before):
        return "a child module is called before its batch norm"
    prefix_nodes = [n for n in graph.nodes if n in before or n is bn]
    later = [n for n in graph.nodes if n not in before and n is not bn and n.op != "output"]
    for n in later:  # the tail: no buffer reads, the input only for its shape
        for a in n.all_input_nodes:
            if a is x and not is_shape_use(n, x):
                return "what follows its batch norm uses its input again"
            if a in before and a is not x:
                return f"what follows its batch norm reuses '{a.name}', computed before it"
    skip = tuple(n for n in prefix_nodes if n is not x and n is not bn)
    prefix = fx.Graph()
    env: dict = {}
    for n in prefix_nodes:
        env[n] = prefix.node_copy(n, lambda a: env[a])
    prefix.output(env[bn])
    return bn, skip, prefix
