"""Rewriting a user's module *in place*: the module object stays, its forward is replaced.

``convert`` and ``fold`` never replace a module of the user's model by another object.
A module whose forward traced is given :class:`GraphForward`, the rewritten graph's
generated code, as the instance attribute ``forward``: ``nn.Module.__call__`` runs it (with
the module's hooks around it, as before), while the module keeps its class, properties,
methods, container behaviour (iteration, indexing, ``_modules``) and identity.

Note: [where the fused modules live]
The modules a rewrite adds (``FusedChain``\\ s) are *unregistered* attributes of the module
whose graph calls them (plain ``__dict__`` entries, read by the generated code as
``self.convbn_chain0``): registering them would add them to ``_modules``, which an
``nn.Sequential`` (its own forward, run in the other train/eval mode or after a fallback),
a parent iterating the container, or a ``children()`` walk would then call. They hold no
tensors of their own (they reference the model's conv and BatchNorm modules), so
``state_dict()``, ``.to()`` and ``.train()`` are unaffected. :func:`fused_modules` lists
them; ``copy.deepcopy`` and ``pickle`` carry them with the module's ``__dict__``.

Note: [one Dynamo frame per rewritten forward]
``torch.compile`` of a converted model starts tracing at the first frame outside torch:
``GraphForward.__call__``. Were that one code object shared by every rewritten forward,
each model compiled in a process would add its own cache entries to it (guarded on its
generated code), and past Dynamo's recompile limit (8) every further converted model would
run uncompiled: the fifth of a sweep, two entries each. So each :class:`GraphForward` is an
instance of a subclass of its own whose ``__call__`` is a copy of the code object; compiled
eager models of one class share one graph, and so do copies of one converted model.

A :class:`GraphForward` falls back to the module's own forward (its class's, or one the user
had set on the instance) where its trace does not hold: the other train/eval mode for a
mode-dependent trace, hooks registered later on a module the graph inlined, or a first-call
check that failed (without ``example_inputs``).

What the first call and the first backward compare before the graph is trusted (without
``example_inputs``) is not this file's: the pass attaches it (``pending``, ``backward_check``:
:mod:`convbn.passes.check.first_call`), and this file only calls it and falls back.
"""
from __future__ import annotations

import contextlib
import copy
import inspect
import os
import sys
import types
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx
from torch import nn
from ..._compat import forward_from_src, pytree

from ...nn.fused_conv_bn import hooks_of

__all__ = ["GraphForward", "install", "uninstall", "installed", "eager", "fused_modules", "forget_undo"]

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_TORCHSCRIPT_DIRS = (_TORCH_DIR + "jit" + os.sep, _TORCH_DIR + "_sources.py")


class _ModuleRef:
    """A Python module in the generated code's globals, pickled by name."""

    def __init__(self, name: str) -> None:
        self.name = name


def _picklable_globals(glob: Dict[str, Any]) -> Dict[str, Any]:
    return {k: _ModuleRef(v.__name__) if isinstance(v, types.ModuleType) else v
            for k, v in glob.items() if k != "__builtins__"}


def _live_globals(glob: Dict[str, Any]) -> Dict[str, Any]:
    import importlib

    return {k: importlib.import_module(v.name) if isinstance(v, _ModuleRef) else v for k, v in glob.items()}


class GraphForward:
    """The generated forward of a module rewritten in place (see module docstring).

    Attributes:
        owner: the module it runs on (the generated code's ``self``).
        graph: the rewritten ``fx.Graph`` (``None`` after unpickling: the code is kept).
        code: the generated Python source.
        previous: a forward the user had set on the instance before, or ``None`` (the class's).
        added: attribute paths the rewrite added to ``owner`` (fused modules, new weights).
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> "GraphForward":
        # Note: [one Dynamo frame per rewritten forward]
        if cls is GraphForward:
            call = GraphForward.__call__
            own = types.FunctionType(call.__code__.replace(), call.__globals__, call.__name__, call.__defaults__,
                                     call.__closure__)
            cls = type("GraphForward", (GraphForward,), {"__call__": own, "__module__": __name__})
        return object.__new__(cls)

    def __init__(self, owner: nn.Module, graph: fx.Graph, added: Sequence[str] = ()) -> None:
        self.owner = owner
        self.graph = graph
        python_code = graph.python_code(root_module="self")
        self.code: str = python_code.src
        self._globals = dict(python_code.globals)
        self.fn: Callable[..., Any] = forward_from_src(self.code, self._globals)
        prev = owner.__dict__.get("forward")
        self.previous = prev if not isinstance(prev, GraphForward) else prev.previous
        self.added = list(added)
        self.fallback = False
        self.fallback_reason = ""  # why ``fallback`` was set (the report says it)
        #: ``pending(self, args, kwargs) -> output``: run once, in place of the graph, on the
        #: next call (the first-call check a pass attaches: check/first_call.py)
        self.pending: Optional[Callable[["GraphForward", Tuple[Any, ...], Dict[str, Any]], Any]] = None
        #: ``backward_check(self, out, args, kwargs)``: called after each call until it clears
        #: itself (Note: [gradients checked on the first backward] in check/first_call.py)
        self.backward_check: Optional[Callable[["GraphForward", Any, Tuple[Any, ...], Dict[str, Any]], None]] = None
        self.modes: Optional[List[Tuple[nn.Module, bool]]] = None
        self.inlined: List[nn.Module] = []
        self.guards: Any = None  # what the trace assumed (check/guards.py), set by convert
        self.on_change: Optional[Callable[["GraphForward", str], bool]] = None
        self.undo: Optional[List[Tuple[nn.Module, str, str, Any]]] = None

    guards: Any = None  # (for instances pickled before these existed)
    on_change: Optional[Callable[["GraphForward", str], bool]] = None
    #: what the trace assumed of a call (arguments at their default: ``specialize.Defaults``; input
    #: shapes: ``shape_capture.ShapeGuard``), ``hold(args, kwargs)``: other calls run :meth:`original`
    defaults: Any = None
    #: whether the one-time message about a call off the traced defaults was given
    warned_defaults = False
    #: the output's container types where the graph cannot build them (Note: [outputs keep their
    #: container types]); ``None``: the graph's output is the module's
    out_spec: Any = None
    #: the last call's difference from the captured calls where it ran the original forward
    #: (the live report says so), else ``""``
    off_call = ""
    #: why the forward did not run although its parent's did (its parent calls its children, not it:
    #: Note: [a container its parent does not call]), else ``""``; cleared by its next call
    bypassed = ""
    #: the variants captured for calls off ``defaults`` (``lookup(self, args, kwargs)`` -> a
    #: forward or ``None``; convert's ``variants.Variants``), or ``None``: such calls run :meth:`original`
    variants: Any = None
    #: with ``variants``: what ran since the live report last read it (Note: [a report says what
    #: ran, call by call] in report/calls_seen.py): this forward, a variant's forward or ``None``
    #: (the module's own forward) -> number of calls
    ran: Optional[Dict[Any, int]] = None
    #: a variant's outcomes as its capture recorded them (``BNOutcome``s), for the live report
    variant_outcomes: Any = None

    # TorchScript (``torch.jit.script`` of a folded model) compiles a module's ``forward``
    # from its source: it reads these off the generated function (the guards above are
    # Python-only; a scripted module runs the graph).
    __name__ = "forward"

    @property
    def __wrapped__(self) -> Callable[..., Any]:
        return self.fn

    @property
    def __globals__(self) -> Dict[str, Any]:
        return self.fn.__globals__  # type: ignore[attr-defined]

    @property
    def __code__(self) -> Any:
        return self.fn.__code__  # type: ignore[attr-defined]

    @property
    def __closure__(self) -> Any:
        return self.fn.__closure__  # type: ignore[attr-defined]

    @property
    def __signature__(self) -> inspect.Signature:  # the bound method's: ``self`` left out
        sig = inspect.signature(self.fn)
        return sig.replace(parameters=list(sig.parameters.values())[1:])

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # noqa: D401
        # ``inspect.getfile`` accepts functions only; TorchScript reads the source through it
        frame = sys._getframe(1)
        if frame.f_code.co_filename == inspect.__file__:
            outer = frame.f_back
            while outer is not None:
                if outer.f_code.co_filename.startswith(_TORCHSCRIPT_DIRS):
                    return types.FunctionType
                outer = outer.f_back
        return GraphForward

    # -- what runs ------------------------------------------------------------------
    def original(self, *args: Any, **kwargs: Any) -> Any:
        """The module's own forward (the class's, or the instance forward it had before), on
        the modules and weights it had before (where the rewrite replaced some: fold)."""
        replaced = [u for u in self.undo or () if u[2]]
        if not replaced:
            return self._own_forward(*args, **kwargs)
        now = [(parent, name, *_slot(parent, name)) for parent, name, _, _ in replaced]
        for parent, name, kind, old in replaced:
            _put(parent, name, kind, old)
        try:
            return self._own_forward(*args, **kwargs)
        finally:
            for parent, name, kind, new in now:
                _put(parent, name, kind, new)

    def _own_forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.previous is not None:
            return self.previous(*args, **kwargs)
        return type(self.owner).forward(self.owner, *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.bypassed:
            self.bypassed = ""  # called after all: what runs is decided below as for any call
        if self.fallback:
            return self.original(*args, **kwargs)
        if self.guards is not None and not torch.compiler.is_compiling():
            what = self.guards.changed()
            if what is not None:
                return self._changed(what, args, kwargs)
        if self.defaults is not None and not self.defaults.hold(args, kwargs):
            return self._off_defaults(args, kwargs)
        self.off_call = ""
        if self.variants is not None:
            self.count_call(self)
        if self.modes is not None and any(m.training != t for m, t in self.modes):
            return self.original(*args, **kwargs)
        if self.inlined and any(hooks_of(m) for m in self.inlined):
            return self.original(*args, **kwargs)
        if self.pending is not None and not torch.compiler.is_compiling():
            check, self.pending = self.pending, None
            out = check(self, args, kwargs)  # the first-call check the pass attached
        else:
            out = self.run(*args, **kwargs)
        if self.backward_check is not None and not self.fallback:
            self.backward_check(self, out, args, kwargs)
        return out

    def _changed(self, what: str, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        """The model changed since the trace (Note: [what a rewrite assumes] in check/guards.py):
        ``on_change`` captures ``owner`` again (and says so); without it, or where it cannot,
        the module's own forward runs from now on."""
        self.guards = None
        if self.on_change is not None and self.on_change(self, what):
            return self.owner.forward(*args, **kwargs)  # the new capture (hooks ran already)
        if self.on_change is None:
            warnings.warn(f"convbn: {what} after the rewrite; running the original (unfused) "
                          f"{type(self.owner).__name__} forward from now on.", RuntimeWarning, stacklevel=3)
        self.fallback = True
        return self.original(*args, **kwargs)

    def _off_defaults(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        """A call unlike the traced one (an argument off its default, other input shapes): the
        module's own forward (the graph holds only the traced branch), with a one-time message;
        or, with ``variants``, the module captured for calls like this one."""
        if self.variants is not None and not torch.compiler.is_compiling():
            variant = self.variants.lookup(self, args, kwargs)
            if variant is not None:
                self.off_call = ""
                self.count_call(variant)
                return variant(*args, **kwargs)
            self.count_call(None)
        # what the live report says of this module while such calls run its original
        self.off_call = self.defaults.differing(args, kwargs)
        if self.variants is not None and self.variants.full:
            return self.original(*args, **kwargs)  # the limit's own message was given
        if not self.warned_defaults and not torch.compiler.is_compiling():
            self.warned_defaults = True
            warnings.warn(
                f"convbn: the rewritten {type(self.owner).__name__} applies to calls like the one it was traced "
                f"for; this call changes {self.off_call}, and such calls run its original "
                "(unfused) forward.",
                RuntimeWarning,
                stacklevel=4,
            )
        return self.original(*args, **kwargs)

    def count_call(self, route: Optional["GraphForward"]) -> None:
        """Count a call that ran ``route`` (this forward, a variant's, or ``None``: the module's own)
        for the live report (Note: [a report says what ran, call by call] in report/calls_seen.py)."""
        if torch.compiler.is_compiling():
            return
        ran = self.__dict__.get("ran")
        if ran is None:
            ran = self.__dict__["ran"] = {}
        ran[route] = ran.get(route, 0) + 1

    def run(self, *args: Any, **kwargs: Any) -> Any:
        """The graph on ``owner``, its output in the module's own container types."""
        out = self.fn(self.owner, *args, **kwargs)
        return out if self.out_spec is None else retype(out, self.out_spec)

    # -- copies -----------------------------------------------------------------------
    def __deepcopy__(self, memo: Dict[int, Any]) -> "GraphForward":
        new = object.__new__(type(self))  # a copy: the same generated code, so the same frame
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            if key in ("graph", "code", "_globals", "fn"):
                new.__dict__[key] = value  # immutable once installed: shared
            elif key == "undo" and self.pending is None:
                new.__dict__[key] = None
            else:
                new.__dict__[key] = copy.deepcopy(value, memo)
        return new

    def __reduce_ex__(self, protocol: Any) -> Tuple[Any, ...]:
        return (_new_graph_forward, (), self.__getstate__())

    def __getstate__(self) -> Dict[str, Any]:
        state = {k: v for k, v in self.__dict__.items() if k not in ("graph", "fn")}
        if self.pending is None:
            state["undo"] = None
        state["_globals"] = _picklable_globals(self._globals)
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._globals = _live_globals(state["_globals"])
        self.graph = None
        self.fn = forward_from_src(self.code, self._globals)

    def __repr__(self) -> str:
        return f"GraphForward({type(self.owner).__name__}, fallback={self.fallback})"


# Note: [outputs keep their container types]
# torch.fx writes a graph's output with ``create_arg``, which turns a ``dict`` subclass (a
# Hugging Face ``ModelOutput``, an ``OrderedDict``) into a plain ``dict``: the rewrite would
# return ``{'last_hidden_state': ...}`` where the module returns an object with attributes,
# the first-call check would see another output structure, and the module would never run
# fused. Where the two outputs differ only so (the same leaves, the same keys in the same
# order, mapping for mapping), the module's own output structure is learnt from that check's
# reference run and the graph's output is rebuilt in it on every call (``pytree`` unflatten:
# the types are registered pytree nodes).


def _shape_of(spec: Any) -> Any:
    """A tree spec with every mapping node's type forgotten (keys and children kept)."""
    kind = "mapping" if isinstance(spec.type, type) and issubclass(spec.type, dict) else spec.type
    return (kind, tuple(spec.context) if kind == "mapping" and spec.context is not None else spec.context,
            tuple(_shape_of(c) for c in (spec.children() if callable(getattr(spec, "children", None))
                                         else spec.children_specs)))


def retypable(candidate: Any, reference: Any) -> bool:
    """Whether ``candidate`` is ``reference``'s structure but for the types of its mappings."""
    a, b = pytree.tree_structure(candidate), pytree.tree_structure(reference)
    if a == b or a.num_leaves != b.num_leaves:
        return False
    try:
        return _shape_of(a) == _shape_of(b)
    except Exception:  # noqa: BLE001 - a spec this comparison does not know: not retyped
        return False


def retype(out: Any, spec: Any) -> Any:
    """``out``'s leaves in the structure ``spec``."""
    return pytree.tree_unflatten(pytree.tree_leaves(out), spec)


def _new_graph_forward() -> GraphForward:
    return GraphForward.__new__(GraphForward)


# -- installing ------------------------------------------------------------------------


def _resolve(root: Any, path: str) -> Any:
    obj = root
    for part in path.split(".") if path else ():
        obj = getattr(obj, part)
    return obj


def _slot(parent: nn.Module, name: str) -> Tuple[str, Any]:
    for kind in ("_modules", "_parameters", "_buffers"):
        d = parent.__dict__.get(kind, {})
        if name in d:
            return kind, d[name]
    if name in parent.__dict__:
        return "__dict__", parent.__dict__[name]
    return "", None


def _put(parent: nn.Module, name: str, kind: str, value: Any) -> None:
    if kind in ("_modules", "_parameters", "_buffers") and name in parent.__dict__[kind]:
        parent.__dict__[kind][name] = value  # in its place: a container's order stays
        return
    for k in ("_modules", "_parameters", "_buffers"):
        parent.__dict__[k].pop(name, None)
    parent.__dict__.pop(name, None)
    if kind:
        (parent.__dict__ if kind == "__dict__" else parent.__dict__[kind])[name] = value


def install(owner: nn.Module, gm: fx.GraphModule, register_new: bool = False) -> GraphForward:
    """Run ``gm``'s graph as ``owner``'s forward, in place.

    What the graph reads (``call_module`` / ``get_attr`` targets) and ``owner`` does not hold
    at that path (new fused modules, a folded conv copy, new weights) is put there first:
    a replacement takes the old one's slot (a registered child stays registered, in its
    place); a new module is an unregistered attribute (Note: [where the fused modules
    live]) unless ``register_new`` and its parent is not a container; new parameters and
    buffers are registered. ``GraphForward.undo`` remembers the old state for :func:`uninstall`.

    Args:
        owner: the user's module (its tree holds everything else the graph reads).
        gm: the rewritten trace of ``owner``.
        register_new: register new modules (``fold``'s layer copies hold weights that ``.to()`` must move).

    Returns:
        The installed :class:`GraphForward` (``owner.forward``).
    """
    undo: List[Tuple[nn.Module, str, str, Any]] = []
    added: List[str] = []
    seen = set()
    for node in gm.graph.nodes:
        if node.op not in ("call_module", "get_attr") or str(node.target) in seen:
            continue
        target = str(node.target)
        seen.add(target)
        value = _resolve(gm, target)
        parent_path, _, name = target.rpartition(".")
        parent = _resolve(owner, parent_path)
        gm_parent = _resolve(gm, parent_path)
        kind, current = _slot(parent, name)
        if kind and current is value:
            continue
        if isinstance(value, nn.Module):
            new_kind = "_modules" if kind == "_modules" or (
                not kind and register_new and not isinstance(parent, _CONTAINERS)) else "__dict__"
        elif name in gm_parent.__dict__.get("_parameters", {}) or isinstance(value, nn.Parameter):
            new_kind = "_parameters"
        elif name in gm_parent.__dict__.get("_buffers", {}):
            new_kind = "_buffers"
        else:
            new_kind = "__dict__"
        undo.append((parent, name, kind, current))
        _put(parent, name, new_kind, value)
        if not kind:
            added.append(target)
    fwd = GraphForward(owner, gm.graph, added)
    fwd.undo = undo
    owner.__dict__["forward"] = fwd
    return fwd


def installed(module: nn.Module) -> Optional[GraphForward]:
    """``module``'s :class:`GraphForward`, if it was rewritten: the instance ``forward`` or inside
    wrappers set later that keep it as ``__wrapped__`` (``functools.wraps``; accelerate's
    mixed-precision forward), which still call it; a wrapper copied from another module is not this one's."""
    fwd = module.__dict__.get("forward")
    for _ in range(16):  # wrappers of wrappers, up to a bound
        if fwd is None or isinstance(fwd, GraphForward):
            break
        fwd = getattr(fwd, "__wrapped__", None)  # a bound method reads its function's
    return fwd if isinstance(fwd, GraphForward) and fwd.owner is module else None


def uninstall(root: nn.Module) -> None:
    """Undo :func:`install` on ``root`` and every module under it (while ``undo`` is known).

    A wrapper around the installed forward (see :func:`installed`) goes with it."""
    for m in list(root.modules()):
        fwd = installed(m)
        if fwd is None:
            continue
        for parent, name, kind, old in reversed(fwd.undo or []):
            _put(parent, name, kind, old)
        if fwd.previous is not None:
            m.__dict__["forward"] = fwd.previous
        else:
            del m.__dict__["forward"]


def forget_undo(root: nn.Module) -> None:
    """Drop what :func:`uninstall` would need (it references replaced weights), except where a
    first-call check is pending: its fallback runs the module as it was."""
    for m in root.modules():
        fwd = installed(m)
        if fwd is not None:
            fwd.undo = None if fwd.pending is None else [u for u in fwd.undo or () if u[2]]


@contextlib.contextmanager
def eager(root: nn.Module) -> Iterator[None]:
    """Run ``root`` as it was before rewriting: every installed forward set aside.

    (``convert``'s rewrite only adds forwards and unregistered modules, so this *is* the
    original model, on the very same parameters and buffers.)
    """
    saved = []
    swapped: List[Tuple[nn.Module, str, str, Any]] = []
    for m in list(root.modules()):
        fwd = installed(m)
        if fwd is not None:
            saved.append((m, m.__dict__["forward"]))  # the GraphForward, or a wrapper set around it later
            if fwd.previous is not None:
                m.__dict__["forward"] = fwd.previous
            else:
                del m.__dict__["forward"]
            for parent, name, kind, old in fwd.undo or ():
                if kind:  # a module or weight the rewrite replaced (fold): the old one, meanwhile
                    swapped.append((parent, name, *_slot(parent, name)))
                    _put(parent, name, kind, old)
    try:
        yield
    finally:
        for parent, name, kind, new in reversed(swapped):
            _put(parent, name, kind, new)
        for m, entry in saved:
            m.__dict__["forward"] = entry


def fused_modules(model: nn.Module) -> Iterator[Tuple[str, nn.Module]]:
    """``(qualified name, module)`` of every module a rewrite added, in ``named_modules()``
    order of their owners. They are unregistered attributes of the module whose forward
    calls them, so ``named_modules()``, ``children()`` and ``state_dict()`` list only the
    model's own modules; this is how to find the fused chains.

    Example:
        >>> fast = convbn.convert(net)                      # doctest: +SKIP
        >>> [n for n, _ in fused_modules(fast)]             # doctest: +SKIP
        ['convbn_chain0']
    """
    for prefix, m in model.named_modules():
        fwd = installed(m)
        if fwd is None:
            continue
        for target in fwd.added:
            value = _resolve(m, target)
            if isinstance(value, nn.Module):
                yield (f"{prefix}.{target}" if prefix else target), value
