"""Recognising *frozen* BatchNorms: modules holding BatchNorm tensors as buffers only.

A frozen BatchNorm (torchvision's and timm's ``FrozenBatchNorm2d``, or a user's own) is any
module that is not a ``_BatchNorm``, has no parameters, holds 1-D floating buffers
``weight``, ``bias``, ``running_mean``, ``running_var`` of one size and an eps -- a numeric
``eps`` attribute, or a constant written in its forward (``(rv + 1e-5).rsqrt()``) -- and computes eval-mode ``F.batch_norm`` with them, written in any way (``x * scale +
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

Note: [recovering a frozen BatchNorm's eps]
A frozen BatchNorm without an ``eps`` attribute keeps it as a constant in its forward. It is
read off the module's own output: a float64 copy with ``weight = 1``, ``bias = 0``,
``running_mean = 0``, ``running_var = 0`` maps an input of ones to ``1 / sqrt(eps)`` if it is
a batch norm, so ``eps = out ** -2`` (rounded to 12 significant digits). The recovered eps is
then only a candidate: the module is recognised when the affine map ``F.batch_norm`` with it
reproduces the module's output on the random probes above, as with an ``eps`` attribute;
otherwise it is left, and :func:`frozen_bn_reason` says why. For a frozen norm-act module
(children after the batch norm) the same is read off the part of its forward before its first
child (:func:`recognise_frozen_norm_act`).
"""
from __future__ import annotations

import copy
from typing import Callable, Optional, Tuple

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from .recognise import NormActBody, ancestors, body_signature, node_deps, trace_body
from ..graph.hooks import hook_reason
from ..graph.shape_uses import is_shape_use

__all__ = ["frozen_bn_ranks", "frozen_bn_eps", "frozen_bn_reason", "recognise_frozen_norm_act",
           "holds_frozen_bn_tensors"]

_TENSORS = ("weight", "bias", "running_mean", "running_var")
_PROBE_RANKS = (2, 3, 4, 5)


def _eps_attribute(module: nn.Module) -> Optional[float]:
    eps = getattr(module, "eps", None)
    return float(eps) if not isinstance(eps, bool) and isinstance(eps, (int, float)) else None


def _holds_buffers(module: nn.Module) -> bool:
    """Not a ``_BatchNorm``, no parameters, no hooks, the four 1-D floating buffers of one size."""
    if isinstance(module, _BatchNorm) or any(True for _ in module.parameters()) or hook_reason(module) is not None:
        return False
    tensors = [module._buffers.get(n) for n in _TENSORS]
    if any(not isinstance(t, Tensor) or t.dim() != 1 or not t.is_floating_point() or t.is_meta for t in tensors):
        return False
    return len({t.numel() for t in tensors}) == 1  # type: ignore[union-attr]


def holds_frozen_bn_tensors(module: nn.Module) -> bool:
    """The structural part of the test: not a ``_BatchNorm``, no parameters, no hooks, the four
    1-D floating buffers of one size, and a numeric ``eps`` attribute or none (an eps kept as
    a constant in the forward, Note: [recovering a frozen BatchNorm's eps])."""
    return _holds_buffers(module) and (_eps_attribute(module) is not None or not hasattr(module, "eps"))


def _probe_copy(module: nn.Module) -> Optional[nn.Module]:
    try:
        return copy.deepcopy(module).double()
    except Exception:  # noqa: BLE001 - cannot copy: not recognised
        return None


def _recover_eps(module: nn.Module, run: Callable[[nn.Module, Tensor], Tensor] = lambda m, x: m(x)
                 ) -> Tuple[Optional[float], str]:
    """The eps a frozen BatchNorm without an ``eps`` attribute computes with (``run(copy, x)``:
    what it computes on ``x``; with children, its part before them), or ``None`` and why
    (Note: [recovering a frozen BatchNorm's eps])."""
    probe = _probe_copy(module)
    if probe is None:
        return None, "it cannot be copied to probe what it computes"
    with torch.no_grad():
        for name, value in zip(_TENSORS, (1.0, 0.0, 0.0, 0.0)):
            getattr(probe, name).fill_(value)
    probe.eval()
    channels = module.running_mean.numel()  # type: ignore[union-attr]
    for rank in _PROBE_RANKS:
        x = torch.ones((2, channels, 3, 5, 7)[:rank], dtype=torch.float64)
        try:
            with torch.no_grad():
                got = run(probe, x)
        except Exception:  # noqa: BLE001 - the module refuses this rank: try the next
            continue
        if not (isinstance(got, Tensor) and got.shape == x.shape and got.dtype == torch.float64):
            continue  # not an element-wise map on this rank (a reshape for another rank broadcasts)
        first = got.flatten()[0]
        if not (bool(torch.isfinite(first)) and float(first) > 0 and bool((got == first).all())):
            return None, ("with unit weight, zero bias, zero mean and zero variance it does not map an input of "
                          "ones to one positive constant, so no eps can be read from it")
        eps = float(f"{float(first) ** -2:.12g}")
        return eps, ""
    return None, "on no input rank from 2 to 5 does it return a float64 tensor of its float64 input's shape"


def frozen_bn_eps(module: nn.Module) -> float:
    """The eps of a frozen BatchNorm: its ``eps`` attribute, or the constant its forward adds
    (Note: [recovering a frozen BatchNorm's eps]).

    Args:
        module: a module :func:`frozen_bn_ranks` recognises.

    Returns:
        The eps, as a float.

    Example:
        >>> frozen_bn_eps(torchvision.ops.FrozenBatchNorm2d(8, eps=1e-3))
        0.001
    """
    eps = _eps_attribute(module)
    if eps is None:
        if any(True for _ in module.children()):  # a frozen norm-act: read off the part before its children
            body = recognise_frozen_norm_act(module)
            eps, why = (body.eps, "") if body.reason is None else (None, body.reason)
        else:
            eps, why = _recover_eps(module)
        if eps is None:
            raise ValueError(f"{type(module).__name__} is not a frozen BatchNorm whose eps can be read: {why}")
    return eps


def _probe_ranks(module: nn.Module, run: Callable[[nn.Module, Tensor], Tensor], eps: float) -> Tuple[int, ...]:
    """Ranks on which ``run(copy, x)`` equals eval-mode ``F.batch_norm`` with the copy's buffers
    and ``eps`` (a float64 copy with random buffers, in both modes); ``()`` if a buffer changes."""
    probe = _probe_copy(module)
    if probe is None:
        return ()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name in _TENSORS:
            t = getattr(probe, name)
            t.copy_(torch.rand(t.shape, generator=gen, dtype=torch.float64) + 0.5 if name == "running_var"
                    else torch.randn(t.shape, generator=gen, dtype=torch.float64))
    before = [getattr(probe, n).clone() for n in _TENSORS]
    channels = before[0].numel()
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
    eps = _eps_attribute(module)
    if eps is None:
        if any(True for _ in module.children()):
            return ()  # not a batch norm as a whole (before its children: recognise_frozen_norm_act)
        eps = _recover_eps(module)[0]
        if eps is None:
            return ()
    return _probe_ranks(module, lambda m, x: m(x), eps)


def frozen_bn_reason(module: nn.Module) -> Optional[str]:
    """Why a module holding a frozen BatchNorm's four buffers (and no children) is not one;
    ``None`` when it is one, or holds no such buffers.

    Args:
        module: any module.

    Returns:
        The reason, for reports, or ``None``.

    Example:
        >>> frozen_bn_reason(torchvision.ops.FrozenBatchNorm2d(8)) is None
        True
    """
    if not _holds_buffers(module) or any(True for _ in module.children()):
        return None
    name = type(module).__name__
    if not holds_frozen_bn_tensors(module):
        return f"{name} holds BatchNorm buffers but its eps attribute is not a number; left as is"
    if frozen_bn_ranks(module):
        return None
    eps = _eps_attribute(module)
    how = "with its eps attribute"
    if eps is None:
        eps, why = _recover_eps(module)
        if eps is None:
            return f"{name} holds BatchNorm buffers but is not recognised as a frozen BatchNorm: {why}; left as is"
        how = f"with the eps {eps:g} read from its output"
    return (f"{name} holds BatchNorm buffers but what it computes is not eval-mode batch_norm {how} on any "
            "input rank from 2 to 5; left as is")


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

    eps = _eps_attribute(module)
    if eps is None:
        eps, why = _recover_eps(module, run)
        if eps is None:
            return NormActBody(reason=f"{name}: no eps attribute, and none can be read from what it computes before "
                                      f"its first child: {why}")
    ranks = _probe_ranks(module, run, eps)
    if not ranks:
        return NormActBody(reason=f"{name}: what it computes before its first child is not a frozen batch norm")
    return NormActBody(graph, bn, skip, bn_input=x, ranks=ranks, eps=eps)


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
