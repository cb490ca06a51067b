"""What a rewritten forward assumed about the model, checked on every call.

Note: [what a rewrite assumes]
``convert`` traces a module once and runs the rewritten graph from then on. The graph, and
the fused chains it calls, are only right for the model as it was traced: the same module
objects in the same places (a chain holds the conv and BatchNorm it fuses; code the trace
inlined read its submodules at trace time), the same classes (a wrapper that swaps
``module.__class__`` changes what ``forward`` means), and the same plain Python attributes
(``self.p``, ``self.drop_rate``, a flag: the trace baked their values into the graph).
:class:`Guards` records those facts when the graph is installed and :meth:`Guards.changed`
compares them on each call (what ``torch.compile``'s guards do for its captured frames).

What is recorded, for each module of the traced part (the module itself and every submodule
its graph does not call as a module of its own):

* its class and its registered children, by identity (``block.conv = nn.Conv2d(...)``,
  a BatchNorm replaced by ``nn.Identity`` or by ``nn.SyncBatchNorm``);
* which of its parameters and buffers are ``None`` (a bias added later);
* its plain attributes (numbers, strings, ``None``, tuples / lists of them, dtypes, devices,
  enums, functions and classes), except ``training`` (a mode-dependent trace checks the
  modes itself) and ``nn.Module``'s own bookkeeping. A module a fused chain calls as one of
  its tail elements (a dropout, PReLU, activation module) is read by the chain at every call,
  so only its identity counts.

A submodule the graph calls as a module (a leaf of the trace) is looked up at call time and
runs its own forward: its identity is checked through its parent, its attributes are not.
"""
from __future__ import annotations

import enum
import functools
import operator
import types
from typing import Any, Callable, Iterable, List, Optional, Tuple

import torch
from torch import nn

__all__ = ["Guards", "plain_attributes"]

#: nn.Module's own bookkeeping (hooks, registries, ``training``) and the installed forward
_MODULE_KEYS = frozenset(nn.Module().__dict__) | {"forward", "_compiled_call_impl"}
_PLAIN = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, torch.layout,
          torch.memory_format, enum.Enum, type, types.FunctionType, types.BuiltinFunctionType, functools.partial)


def _is_plain(value: Any) -> bool:
    if isinstance(value, _PLAIN):
        return True
    if type(value) in (tuple, list, frozenset):
        return all(_is_plain(v) for v in value)
    return False


def plain_attributes(module: nn.Module) -> Tuple[str, ...]:
    """The names of ``module``'s plain Python attributes a traced forward may have read (see
    Note: [what a rewrite assumes]), in ``__dict__`` order.

    Example:
        >>> plain_attributes(nn.Dropout(0.1))
        ('p', 'inplace')
    """
    return tuple(k for k, v in module.__dict__.items()
                 if k not in _MODULE_KEYS and not k.startswith("convbn_") and _is_plain(v))


class _Entry:
    """One guarded module: what it was when the graph was installed."""

    __slots__ = ("module", "name", "full", "cls", "keys", "values", "children", "none_params", "none_buffers",
                 "params_get", "buffers_get", "get")

    def __init__(self, module: nn.Module, name: str, with_attributes: bool) -> None:
        d = module.__dict__
        self.module = module
        self.name = name
        self.full = with_attributes
        self.cls = type(module)
        self.keys = plain_attributes(module) if with_attributes else ()
        self.values: Any = _kept(tuple(d[k] for k in self.keys))  # lists copied: mutation in place counts
        self.children = dict(module._modules)
        # parameters and buffers that are None stay None (a bias the trace left out); one C
        # call reads them, and one reads every guarded attribute (a tuple, or the value for one key)
        self.none_params = tuple(k for k, v in module._parameters.items() if v is None)
        self.none_buffers = tuple(k for k, v in module._buffers.items() if v is None)
        self.params_get = _getter(self.none_params)
        self.buffers_get = _getter(self.none_buffers)
        self.get = _getter(self.keys)
        if len(self.keys) == 1:
            self.values = self.values[0]

    def holds(self) -> bool:
        m = self.module
        d = m.__dict__  # one attribute read; the rest are dictionary look-ups
        if type(m) is not self.cls or d["_modules"] != self.children:
            return False
        try:
            return ((self.params_get is None or _all_none(self.params_get(d["_parameters"])))
                    and (self.buffers_get is None or _all_none(self.buffers_get(d["_buffers"])))
                    and (self.get is None or bool(self.get(d) == self.values)))
        except KeyError:
            return False

    def describe(self) -> str:
        """What changed, in words (for the one-time message and the report)."""
        m = self.module
        where = f"{self.name} ({self.cls.__name__})" if self.name else self.cls.__name__
        if type(m) is not self.cls:
            return f"the class of {where} changed to {type(m).__name__}"
        old, now = self.children, dict(m._modules)
        for key in {**old, **now}:
            if old.get(key) is not now.get(key):
                before = type(old[key]).__name__ if old.get(key) is not None else "nothing"
                after = type(now[key]).__name__ if now.get(key) is not None else "nothing"
                return f"{where}.{key} was replaced ({before} -> {after})"
        for key in self.none_params + self.none_buffers:
            if m._parameters.get(key) is not None or m._buffers.get(key) is not None:
                return f"{where}.{key} was None and is set now"
        values = self.values if len(self.keys) != 1 else (self.values,)
        for key, value in zip(self.keys, values):
            if key not in m.__dict__:
                return f"{where}.{key} was deleted"
            if not (m.__dict__[key] == value):
                return f"{where}.{key} changed from {value!r} to {m.__dict__[key]!r}"
        return f"{where} changed"


def _kept(value: Any) -> Any:
    """``value`` as a guard keeps it to compare with ``==`` later: lists (and the lists in tuples)
    copied, so that a mutation in place counts; every other plain value is immutable or compared
    by identity, so kept as it is. Not ``copy.deepcopy``: a deep copy of a ``functools.partial``
    (pytorch3dunet's ``Decoder.joining``) is a new object, never ``==`` to the original, and the
    guard failed on every call (Note: [what a rewrite assumes])."""
    if type(value) is list:
        return [_kept(v) for v in value]
    if type(value) is tuple:
        return tuple(_kept(v) for v in value)
    return value


def _getter(keys: Tuple[str, ...]) -> Optional[Callable[[Any], Any]]:
    return operator.itemgetter(*keys) if keys else None


def _all_none(got: Any) -> bool:
    return got is None or (type(got) is tuple and all(v is None for v in got))


class Guards:
    """The assumptions of one installed graph (Note: [what a rewrite assumes]).

    Args:
        owner: the module whose forward the graph replaces.
        prefix: ``owner``'s qualified name in the converted model (``""`` for the root, else
            ending in ``"."``), for messages.
        called: qualified names (relative to ``owner``) of the submodules the graph calls as
            modules: their own forwards run, looked up at call time.
        read_at_call: modules a fused chain reads at every call (its tail modules): identity only.

    Example:
        >>> block = nn.Sequential(nn.Conv2d(3, 4, 1), nn.Dropout(0.1))
        >>> g = Guards(block, "", called=(), read_at_call=())
        >>> g.changed() is None
        True
        >>> block[1].p = 0.2
        >>> g.changed()
        '1 (Dropout).p changed from 0.1 to 0.2'
    """

    def __init__(self, owner: nn.Module, prefix: str, called: Iterable[str],
                 read_at_call: Iterable[nn.Module]) -> None:
        called = [c for c in called if c]
        at_call = {id(m) for m in read_at_call}
        entries = []
        for name, m in owner.named_modules():
            if any(name == c or name.startswith(c + ".") for c in called):
                continue
            entries.append(_Entry(m, prefix + name if name else prefix.rstrip("."), id(m) not in at_call))
        self.entries: List[_Entry] = entries

    def changed(self) -> Optional[str]:
        """``None`` while every assumption holds, else what changed first, in words."""
        for e in self.entries:
            if not e.holds():
                return e.describe()
        return None

    def refresh(self) -> None:
        """Take the model as it is now as what was assumed: after a check that ran the module's
        own forward, whose Python side effects (a call counter) are not a change of the model."""
        self.entries = [_Entry(e.module, e.name, e.full) for e in self.entries]

    def __len__(self) -> int:
        return len(self.entries)

