"""Optional arguments left at their default, traced as the constants they are, and guarded.

``forward(self, h, attention_mask=None)`` traced with every argument a ``torch.fx`` proxy
records the branch ``attention_mask is not None`` (a proxy is not ``None``): a graph that
multiplies by ``None`` when called as the model is called, ``model(h)``. So an argument
after the first whose default is ``None``, a ``bool`` or a ``str`` (values code branches
on) is traced as that value (``torch.fx``'s ``concrete_args``) and the trace records a
*guard*: :meth:`Defaults.hold` tells, at call time, whether every such argument still has
its traced value. Where one does not, the rewritten forward does not apply and the module's
own forward runs (:class:`~convbn.passes.graph.graph_module.GraphForward`).

The argument stays in the generated forward's signature under its own name (so keyword
calls work); the assertions ``torch.fx`` adds for a concrete argument are dropped from the
graph, the guard being checked before the graph runs.

Note: [numbers a parent passes]
A parent may pass such an argument a Python number (EfficientNet's ``block(x,
drop_connect_rate=rate * i / n)``; the code then branches on it, ``if self.training and
rate``). Traced symbolically the branch raises and the block stays unfused, so an ``int`` /
``float`` a call passes is traced as its constant too (:meth:`Defaults.for_call`) and guarded
the same way: a call with another number (or type) fails :meth:`Defaults.hold` and runs a
variant captured for it (``passes/convert/variants.py``), never the graph of the first.
Defaults that are numbers stay symbolic until a call passes one.
"""
from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch
import torch.fx as fx
from torch import nn

from ..._compat import fx_assert, fx_assert_is_none

__all__ = ["Defaults", "GIVEN", "EmptyVarargs", "constant_defaults", "empty_varargs", "none_used_as_value"]

#: default values traced as constants: what code branches on (``is None``, ``if flag``, ``mode == "x"``)
SPECIALIZED_TYPES = (type(None), bool, str)

#: values a call passes that are traced as constants too (Note: [numbers a parent passes]):
#: the default types plus Python numbers
CALL_SPECIALIZED_TYPES = SPECIALIZED_TYPES + (int, float)


class _Given:
    """The traced value of an argument a call passed as a value (a tensor, a number): traced
    symbolically; a call holds it where it passes such a value too."""

    def __repr__(self) -> str:
        return "<given>"

    def __reduce__(self) -> str:
        return "GIVEN"


#: :attr:`Defaults.values` entry of an argument traced as the call's value (not a constant)
GIVEN = _Given()


@dataclass(frozen=True)
class Defaults:
    """The arguments a trace took at their default value.

    Attributes:
        names: the arguments' names.
        positions: each one's position among the positional arguments (``self`` excluded),
            or ``-1`` for a keyword-only one.
        values: the values traced.
    """

    names: Tuple[str, ...]
    positions: Tuple[int, ...]
    values: Tuple[Any, ...]

    def concrete_args(self) -> Optional[Dict[str, Any]]:
        """``torch.fx``'s ``concrete_args`` for the trace, or ``None`` where there are none."""
        return {n: v for n, v in zip(self.names, self.values) if v is not GIVEN} or None

    def for_call(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> "Defaults":
        """The same arguments specialised to what a call passes: a ``None`` / ``bool`` / ``str``
        or a Python ``int`` / ``float`` given becomes the traced constant, any other value (a
        tensor) :data:`GIVEN` (symbolic)."""
        values = []
        for name, pos, value in zip(self.names, self.positions, self.values):
            given = args[pos] if 0 <= pos < len(args) else kwargs.get(name, value)
            values.append(given if type(given) in CALL_SPECIALIZED_TYPES else GIVEN)
        return Defaults(self.names, self.positions, tuple(values))

    def describe(self) -> str:
        """``name=value`` of every argument, ``<given>`` for a value passed (for the report)."""
        return ", ".join(f"{n}={v!r}" for n, v in zip(self.names, self.values))

    def hold(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> bool:
        """Whether a call with ``args`` / ``kwargs`` passes every argument at its traced value
        (left out, or given the same value)."""
        for name, pos, value in zip(self.names, self.positions, self.values):
            if 0 <= pos < len(args):
                given = args[pos]
            elif name in kwargs:
                given = kwargs[name]
            elif value is GIVEN:
                return False
            else:
                continue
            if value is GIVEN:
                if type(given) in CALL_SPECIALIZED_TYPES:
                    return False
                continue
            if given is not value and not (type(given) is type(value) and given == value):
                return False
        return True

    def differing(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> str:
        """The first argument not at its traced value, as ``name=value`` text (for a message)."""
        for name, pos, value in zip(self.names, self.positions, self.values):
            if not Defaults((name,), (pos,), (value,)).hold(args, kwargs):
                return f"{name} (traced as {value!r})"
        return ""

    def strip_asserts(self, graph: fx.Graph) -> None:
        """Give the placeholders of the specialised arguments their own names as targets (the
        generated signature then reads ``attention_mask=None``, not ``attention_mask_1=None``)
        and drop the assertions ``torch.fx`` adds for them (:meth:`hold` guards instead)."""
        renamed = {f"{name}_1": name for name, v in zip(self.names, self.values) if v is not GIVEN}
        for node in graph.nodes:
            if node.op == "placeholder" and node.target in renamed:
                node.target = renamed[node.target]
        for node in reversed(list(graph.nodes)):
            if node.op != "call_function":
                continue
            if node.target is fx_assert_is_none and node.args[0].op == "placeholder":
                graph.erase_node(node)
            elif node.target is fx_assert and isinstance(node.args[0], fx.Node):
                cond = node.args[0]
                if (cond.op == "call_function" and cond.target is operator.eq
                        and isinstance(cond.args[0], fx.Node) and cond.args[0].op == "placeholder"
                        and cond.args[0].target in self.names):
                    graph.erase_node(node)
                    if not cond.users:
                        graph.erase_node(cond)


def none_used_as_value(graph: fx.Graph) -> bool:
    """Whether ``graph`` applies an arithmetic operator to ``None`` (``h + residual`` traced with
    ``residual=None``): the argument is a value, not a branch, and tracing it as ``None``
    records a graph that fails when run."""
    return any(n.op == "call_function" and getattr(n.target, "__module__", None) in ("_operator", "operator")
               and n.target is not operator.getitem and any(a is None for a in n.args)
               for n in graph.nodes)


def constant_defaults(module: nn.Module) -> Defaults:
    """The arguments of ``module``'s forward (its class's, the one ``torch.fx`` traces) that a
    trace takes at their default: every named argument after the first whose default is
    ``None``, a ``bool`` or a ``str``.

    Example:
        >>> class M(nn.Module):
        ...     def forward(self, h, mask=None, scale=2.0): ...
        >>> constant_defaults(M()).names
        ('mask',)
    """
    try:
        params = list(inspect.signature(type(module).forward).parameters.values())[1:]
    except (TypeError, ValueError):  # no signature to read: nothing specialised
        return Defaults((), (), ())
    names, positions, values = [], [], []
    position = 0
    for i, p in enumerate(params):
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            break  # fx passes what follows *args its own way: leave the rest symbolic
        if (i > 0 and p.default is not p.empty and type(p.default) in SPECIALIZED_TYPES
                and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)):
            names.append(p.name)
            positions.append(position if p.kind == p.POSITIONAL_OR_KEYWORD else -1)
            values.append(p.default)
        position += 1
    return Defaults(tuple(names), tuple(positions), tuple(values))


@dataclass(frozen=True)
class EmptyVarargs:
    """A forward with ``*args`` / ``**kwargs`` traced as the call passes them: ``**kwargs``
    empty, ``*args`` empty or (a trace with the real inputs) that many tensors.

    Note: [``*args`` traced as the call passes them]
    ``torch.fx`` gives a root's ``*args`` one proxy, so ``len(args)`` or ``kwargs.get("scale")``
    (diffusers' ``ResnetBlock2D``, its down / up blocks) fails and the whole module stays
    unfused, though every call passes none. Where the symbolic trace fails and the call passes
    nothing to ``**kwargs``, the trace takes ``kwargs = {}`` and ``args`` as a tuple of ``extra``
    inputs of their own (``args_0``, ...; none without the real call: a wrapper's
    ``forward(sample, *args)`` called as ``(x, t)`` gets one), and :meth:`hold` guards every
    call: one passing another number of positional arguments there, or a keyword that only
    ``**kwargs`` takes, runs the module's own forward.

    Attributes:
        positional: how many positional arguments the named parameters take (``self`` excluded).
        named: the names of every named parameter.
    """

    positional: int
    named: Tuple[str, ...]
    extra: int = 0

    def _count_holds(self, n: int) -> bool:
        return n == self.positional + self.extra if self.extra else n <= self.positional

    def hold(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> bool:
        return self._count_holds(len(args)) and all(k in self.named for k in kwargs)

    def differing(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> str:
        extra = [k for k in kwargs if k not in self.named]
        return (f"{len(args)} positional arguments, traced with {self.positional} named and {self.extra} in *args"
                if not self._count_holds(len(args)) else f"keyword {extra[0]!r} the traced **kwargs (none) did not take")


def empty_varargs(module: nn.Module, example: Optional[Tuple[Tuple[Any, ...], Dict[str, Any]]]) -> Optional[EmptyVarargs]:
    """The :class:`EmptyVarargs` of ``module``'s forward where it has ``*args`` or ``**kwargs``
    and the ``example`` call (``None``: unknown, taken as none) passes nothing to them; else ``None``."""
    try:
        params = list(inspect.signature(type(module).forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return None
    if not any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        return None
    positional = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)
    guard = EmptyVarargs(positional, tuple(p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)))
    if example is None or guard.hold(*example):
        return guard
    args, kwargs = example
    has_star = any(p.kind == p.VAR_POSITIONAL for p in params)
    if has_star and len(args) > positional and all(isinstance(a, torch.Tensor) for a in args[positional:]):
        guard = EmptyVarargs(positional, guard.named, len(args) - positional)
        return guard if guard.hold(args, kwargs) else None
    return None
