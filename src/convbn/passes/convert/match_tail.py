"""Tails: the element-wise ops after a BatchNorm that a fused layer recomputes in backward.

Starting at a BatchNorm's output node, :func:`match_tail` follows the data flow through
every op that is element-wise and whose output is read by that op alone: activations (every
record of :mod:`convbn.functional.activations`, written as ``nn`` module, ``F.*``,
``torch.*`` or tensor method, in place or not, and ``x * sigmoid(x)``), ``nn.PReLU``, and
dropout (the ``nn.Dropout*`` modules and ``F.dropout*`` / ``torch.dropout`` calls), in any
order: BN -> act, BN -> Dropout -> act, BN -> act -> Dropout, BN -> PReLU -> Dropout ...

Each matched op becomes one element of the layer's tail
(:class:`convbn.nn.chain.ChainLayer`): the model's own module where the graph *calls a
module* (its ``training`` flag, ``p``, ``inplace`` and PReLU weight are read at every call
of the chain, its hooks honoured), an :class:`~convbn.functional.activations.Activation`
for a functional activation, and a dropout module built here for a functional dropout
(Note: [functional dropout in a tail]).

Where the walk stops, :func:`match_tail` says why (:attr:`TailMatch.stop`): reports name
the op that stood there.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from ...functional.activations import (Activation, activation_from_call, activation_from_method, activation_from_module,
                                       activation_functions, activation_methods)
from ...functional.tail import DROPOUT_FUNCTIONS, is_tail_module
from ...nn.chain import TailElement
from ..graph.layers import node_arg
from ..graph.shape_uses import is_shape_use, value_users

__all__ = ["TailOpMatch", "TailMatch", "match_tail", "describe_node", "node_arg", "tail_label", "element_label"]


def describe_node(node: fx.Node) -> str:
    """A short human description of a graph node, for reports."""
    if node.op == "placeholder":
        return f"the model input '{node.name}'"
    if node.op == "call_module":
        return f"module '{node.target}'"
    if node.op == "call_function":
        return f"function {getattr(node.target, '__name__', node.target)}"
    if node.op == "call_method":
        return f"method .{node.target}()"
    if node.op == "output":
        return "the graph's output"
    return f"{node.op} {node.target}"


#: functional dropouts -> (the ``nn`` module class running the same op, the keyword and
#: default of the training flag, in place)
_DROPOUT_FUNCS: Dict[Any, Tuple[type, str, bool, bool]] = {
    F.dropout: (nn.Dropout, "training", True, False),
    F.dropout1d: (nn.Dropout1d, "training", True, False),
    F.dropout2d: (nn.Dropout2d, "training", True, False),
    F.dropout3d: (nn.Dropout3d, "training", True, False),
    F.alpha_dropout: (nn.AlphaDropout, "training", False, False),
    F.feature_alpha_dropout: (nn.FeatureAlphaDropout, "training", False, False),
    torch.dropout: (nn.Dropout, "train", True, False),
    torch.dropout_: (nn.Dropout, "train", True, True),
    torch.alpha_dropout: (nn.AlphaDropout, "train", True, False),
    torch.alpha_dropout_: (nn.AlphaDropout, "train", True, True),
    torch.feature_alpha_dropout: (nn.FeatureAlphaDropout, "train", True, False),
    torch.feature_alpha_dropout_: (nn.FeatureAlphaDropout, "train", True, True),
}

#: element-wise ops a tail does not take, with the reason a user can act on
_UNSUPPORTED: Dict[Any, str] = {
    **{f: "a functional PReLU: only nn.PReLU modules are fused (their weight is read at each call); "
          "use nn.PReLU" for f in (F.prelu, torch.prelu)},
    **{f: "RReLU draws a random slope per element in training, which the chain does not replay; use "
          "nn.LeakyReLU" for f in (F.rrelu, F.rrelu_, torch.rrelu, torch.rrelu_)},
    **{f: "a threshold other than ReLU's has no recompute rule in convbn.ACTIVATIONS"
       for f in (F.threshold, F.threshold_, torch.threshold, torch.threshold_)},
    **{f: "clamp's gradient at the bounds differs from hardtanh's (ReLU6), so it is not recomputed as one; "
          "use F.relu6 / nn.ReLU6" for f in (torch.clamp, torch.clamp_, torch.clip)},
}
_MULS = {operator.mul, torch.mul}


@dataclass
class TailOpMatch:
    """One element-wise op of a tail, as matched in the graph.

    Attributes:
        element: what the chain runs: an :class:`Activation`, or a module (the model's own
            for a ``call_module``; one built here for a functional dropout).
        node: the op's output node.
        extra: further nodes the op spans (the ``sigmoid`` of ``x * sigmoid(x)``).
        module_name: the module's qualified name when the graph called the model's module
            (its hooks are then honoured), else ``None``.
    """

    element: TailElement
    node: fx.Node
    extra: Tuple[fx.Node, ...] = ()
    module_name: Optional[str] = None

    def __str__(self) -> str:
        return element_label(self.element)


@dataclass
class TailMatch:
    """The tail after one node: its ops in order, the shape-only reads of its inner
    tensors, and why the walk stopped there.

    Attributes:
        ops: the matched ops, in graph order.
        shape_uses: ``x.shape``-style reads of every tensor before the tail's output.
        stop: why the next op is not part of the tail (``""`` when nothing follows).
        blocked: set when an element-wise op stood next that cannot be matched (a dropout
            whose ``p`` is computed, a PReLU subclass with its own forward ...): which and why.
    """

    ops: List[TailOpMatch] = field(default_factory=list)
    shape_uses: List[fx.Node] = field(default_factory=list)
    stop: str = ""
    blocked: str = ""

    def out(self, start: fx.Node) -> fx.Node:
        """The tail's output (``start`` when the tail is empty)."""
        return self.ops[-1].node if self.ops else start


def element_label(e: TailElement) -> str:
    """``relu``, ``prelu``, ``dropout(0.1)`` ... for reports."""
    if isinstance(e, Activation):
        return str(e)
    act = activation_from_module(e)
    if act is not None:
        return str(act)
    if isinstance(e, nn.PReLU):
        return "prelu" if e.num_parameters == 1 else f"prelu({e.num_parameters})"
    for cls, fn in DROPOUT_FUNCTIONS.items():
        if isinstance(e, cls):
            return f"{fn}({e.p})" + ("" if e.training else "[eval]")
    return type(e).__name__


def tail_label(ops: List[TailOpMatch]) -> str:
    """The tail as ``"dropout(0.1) -> prelu"`` (``"identity"`` when empty)."""
    return " -> ".join(str(o) for o in ops) or "identity"


def _consts(node: fx.Node, skip: int = 1) -> bool:
    """No argument after the first ``skip`` ones is a graph value."""
    return not any(isinstance(a, fx.Node) for a in list(node.args[skip:]) + list(node.kwargs.values()))


def _functional_dropout(node: fx.Node) -> Union[TailElement, str, None]:
    """Note: [functional dropout in a tail]
    ``F.dropout(x, self.p, self.training)`` is recorded with ``p`` and ``training`` as the
    constants they were while tracing (``convert`` traces in training mode). The constant
    stays true for every call of the rewritten graph: where the recorded ``training`` came
    from a module's flag, tracing with the flags flipped records a different graph, so the
    rewrite is *mode dependent* and runs the original code whenever any module's
    ``training`` differs from the trace (``ConvbnGraphModule.guard_modes``); where it did
    not, the value is a constant of the user's code. The chain therefore runs the op as a
    dropout module built here with that ``p`` and that fixed mode (unregistered: it holds
    no state; ``model.eval()`` never needs to reach it). Values computed at run time (a
    ``p`` or ``training`` that is a graph value) are not matched.
    """
    if node.op != "call_function" or node.target not in _DROPOUT_FUNCS:
        return None
    cls, keyword, training_default, inplace = _DROPOUT_FUNCS[node.target]
    if not _consts(node):
        return f"{describe_node(node)} takes p or training computed at run time"
    p = node_arg(node, 1, "p", 0.5)
    training = node_arg(node, 2, keyword, training_default)
    inplace = bool(node_arg(node, 3, "inplace", inplace))
    if not isinstance(p, (int, float)) or not isinstance(training, bool):
        return f"{describe_node(node)} has p={p!r}, training={training!r}: not constants"
    mod = cls(float(p), inplace=inplace)
    mod.train(training)
    return mod


def _match_op(node: fx.Node, src: fx.Node, root: nn.Module, prefix: str) -> Union[TailOpMatch, str, None]:
    """``node`` as a tail op reading ``src``; a reason when it is element-wise but cannot be
    matched; ``None`` when it is not a tail op at all."""
    if node_arg(node, 0, "input", None) is not src:
        return None
    if node.op == "call_module":
        mod = root.get_submodule(str(node.target))
        if is_tail_module(mod):
            return TailOpMatch(mod, node, (), prefix + str(node.target))
        if isinstance(mod, (nn.PReLU, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
                            nn.FeatureAlphaDropout)):
            return f"module '{node.target}' ({type(mod).__name__}) has its own forward"
        return None
    if node.op == "call_function" and node.target in activation_functions():
        if not _consts(node):
            return f"{describe_node(node)} takes arguments computed at run time"
        act = activation_from_call(node.target, lambda i, keyword, default: node_arg(node, i, keyword, default))
        if act is None:
            return f"{describe_node(node)} with these bounds is not an activation convbn knows"
        return TailOpMatch(act, node)
    if node.op == "call_function" and node.target in _UNSUPPORTED:
        return f"{describe_node(node)} ({_UNSUPPORTED[node.target]})"
    method_act = activation_from_method(str(node.target)) if node.op == "call_method" else None
    if method_act is not None and len(node.args) == 1 and not node.kwargs:
        return TailOpMatch(method_act, node)
    found = _functional_dropout(node)
    if isinstance(found, nn.Module):
        return TailOpMatch(found, node)
    return found


def _match_swish(node: fx.Node) -> Optional[TailOpMatch]:
    """SiLU written ``node * sigmoid(node)`` (the two users of ``node``)."""
    sigmoids, methods = activation_functions("sigmoid", inplace=False), activation_methods("sigmoid", inplace=False)
    sig = next((u for u in node.users if (u.op == "call_function" and u.target in sigmoids)
                or (u.op == "call_method" and u.target in methods)), None)
    if sig is None or len(sig.users) != 1 or sig.kwargs or node_arg(sig, 0, "input", None) is not node:
        return None
    mul = next(iter(sig.users))
    ok = (mul.op == "call_function" and mul.target in _MULS) or (mul.op == "call_method" and mul.target == "mul")
    if not ok or mul.kwargs or len(mul.args) != 2 or set(mul.args) != {node, sig} or mul not in node.users:
        return None
    return TailOpMatch(Activation("silu"), mul, (sig,))


def match_tail(start: fx.Node, root: nn.Module, prefix: str = "") -> TailMatch:
    """The element-wise ops after ``start`` (a BatchNorm's output), each read only by the next.

    Args:
        start: the node whose value the tail transforms.
        root: the traced module (modules of ``call_module`` nodes are looked up on it).
        prefix: ``root``'s qualified name + ``"."``, for the names of tail modules.

    Returns:
        A :class:`TailMatch`: the ops, the shape-only reads of ``start`` and of every op
        output but the last (they are re-pointed to the chain's output, which has the same
        shape), and why the walk stopped.

    Example:
        >>> import torch.fx as fx
        >>> net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Dropout(0.1), nn.PReLU(), nn.Conv2d(4, 4, 1))
        >>> gm = fx.symbolic_trace(net)
        >>> bn = next(n for n in gm.graph.nodes if n.target == "1")
        >>> tail = match_tail(bn, net)
        >>> tail_label(tail.ops), tail.stop
        ('dropout(0.1) -> prelu', "module '4' stands there, which is not an element-wise op convbn recomputes")
    """
    found = TailMatch()
    cur = start
    marks: List[int] = []  # len(found.shape_uses) before each op
    while True:
        users = value_users(cur)
        step: Union[TailOpMatch, str, None] = None
        if len(users) == 1:
            step = _match_op(users[0], cur, root, prefix)
            if step is None:
                found.stop = f"{describe_node(users[0])} stands there, which is not an element-wise op convbn recomputes"
        elif len(users) == 2:
            step = _match_swish(cur)
            if step is None:
                found.stop = "the value is read by " + " and ".join(describe_node(u) for u in users)
        elif users:
            found.stop = "the value is read by " + ", ".join(describe_node(u) for u in users)
        if isinstance(step, str):
            found.stop = found.blocked = step
        if not isinstance(step, TailOpMatch):
            break
        marks.append(len(found.shape_uses))
        found.shape_uses += [u for u in cur.users if is_shape_use(u, cur)]
        found.ops.append(step)
        cur = step.node
    # A trailing nn.Identity stays in the graph: it computes nothing, a conv after it absorbs it
    # (as it absorbs zero padding), and a model whose BatchNorm-act module ends in an identity
    # keeps the usual chain links.
    while found.ops and _is_identity_module(found.ops[-1].element):
        found.ops.pop()
        del found.shape_uses[marks.pop():]
    return found


def _is_identity_module(e: TailElement) -> bool:
    act = None if isinstance(e, Activation) else activation_from_module(e)
    return act is not None and act.is_identity
