"""Tracing shared by :func:`convbn.convert` and :func:`convbn.fold`.

One place decides how a user's model becomes an ``fx.Graph`` and how a rewritten graph
goes back into a module without changing what the user built:

* **Leaf policy** (:class:`LayerTracer`, both passes): BatchNorms, the conv / linear
  layers of :mod:`convbn.passes.graph.layers` that keep torch's ``forward`` and convbn's fused
  modules are leaves (a layer subclass with its own ``forward`` is traced into: its
  functional call is matched instead). On top of it, a module with hooks is always a
  leaf (its hooks then run at call time, as in eager; tracing through it would run them
  once on proxies and never again).
* **Partial tracing**: a submodule whose forward cannot be traced, or whose trace would
  mislead (see below), is rolled back and becomes a *leaf of its parent's trace*, so the
  rest of the parent is still traced whole; the caller then works inside it on its own.
* **Trace hazards**: ``torch.fx`` proxies answer ``isinstance(x, torch.Tensor)`` and
  ``torch.jit.isinstance(x, torch.Tensor)`` with ``False``, so code branching on them
  silently records the *other* branch (MONAI's ``UpCat`` drops its skip connection).
  While tracing, both are answered as eager answers them where the value surely is a tensor
  (``torch.jit.isinstance`` from the types alone, Note: [torch.jit.isinstance answered from
  types] in :mod:`.hazards`); elsewhere they raise :class:`TraceHazard` inside the module
  that made them, which partial tracing turns into a leaf. Python control flow on shapes
  already fails under ``torch.fx`` and is handled the same way.
* **BatchNorm written any way**: a ``_BatchNorm`` subclass with its own ``forward`` that
  :func:`~convbn.passes.bn.recognise.recognise_norm_act` recognises is *inlined*: the graph
  gets ``standard_batch_norm(<the module>, x)`` (reading its mode and statistics at call
  time) followed by the rest of its forward (its ``drop`` / ``act`` children called by
  their own names), so matchers see an ordinary BatchNorm and its tail; one not recognised
  stays a leaf and :attr:`Traced.norm_act` says why. A frozen BatchNorm
  (:func:`~convbn.passes.bn.recognise.frozen_bn_ranks`) is always a leaf.
* **Mode dependence**: the trace is repeated with ``training`` flipped; a graph that
  differs runs the original code in the other mode (:mod:`convbn.passes.graph.graph_module`).

Where each part lives: the leaf policy :mod:`.leaves` (:class:`LayerTracer`); the hazard checks
made while tracing :mod:`.hazards` (:class:`TraceHazard`, the watched proxy, ``torch.jit.isinstance``
patched); the result :mod:`.traced` (:class:`Traced`); this module the partial tracer, the
:func:`trace` entry and the mode-dependence probe, and re-exports the names it always exported.
What a replaced module keeps is :mod:`convbn.passes.graph.graph_module`; running and comparing
the original and a rewrite is :mod:`convbn.passes.check.validate`; hooks: :mod:`convbn.passes.graph.hooks`.
"""
from __future__ import annotations

import traceback
import typing
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple, Type

import torch
import torch.fx as fx
from torch import nn

from torch.nn.modules.batchnorm import _BatchNorm

from ...nn.standard_bn import frozen_batch_norm, has_standard_bn_forward, standard_batch_norm
from ..bn.frozen import frozen_bn_ranks, holds_frozen_bn_tensors, recognise_frozen_norm_act
from ..bn.recognise import NormActBody, recognise_norm_act
from ..graph.checkpoint_calls import checkpointed_modules, keep_checkpoint_calls
from ..graph.grad_regions import recording_grad_modes
from ..graph.hooks import hook_reason
from ..graph.state_tensors import state_tensor_ids
from ..graph.shape_capture import VALUE, ShapeGuard, ShapeTracing
from ..graph.specialize import Defaults, EmptyVarargs, constant_defaults, empty_varargs, none_used_as_value
from .mode_answers import mode_dependent_once
from ..graph.thread_patch import fx_patches_scoped, original_item, scoped_item
from ..graph.trace_hazards import FunctionCall, opaque_functions
from .hazards import TraceHazard, _patched_jit_isinstance, _trusted, _WatchedProxy
from .leaves import LayerTracer
from .traced import Traced

__all__ = ["TraceHazard", "LayerTracer", "Traced", "trace", "resolve_string_annotations", "short_reason", "FunctionCall"]


def short_reason(exc: BaseException, limit: int = 160) -> str:
    """``"TypeName: first line of the message"``, shortened to ``limit`` characters."""
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    if len(first) > limit:
        first = first[: limit - 3] + "..."
    return f"{type(exc).__name__}: {first}"


_SPLITS = (torch.split, torch.Tensor.split, torch.tensor_split, torch.Tensor.tensor_split)  # torch.split is torch.functional.split


def _static_length(node: fx.Node) -> Optional[int]:
    """How many tensors ``node`` returns, where its arguments fix it: ``split`` into a list of
    sizes (that many), ``tensor_split`` at a list of indices (one more); in a trace with real
    shapes, any value that trace computed as a tuple or list (``torch.split(x, c // r, 1)`` with
    ``c`` read off ``x.shape``: ResNeSt's split attention); else ``None``."""
    value = node.meta.get(VALUE)
    if isinstance(value, (list, tuple)):
        return len(value)
    if node.op == "call_function" and node.target in _SPLITS:
        args, name = node.args[1:], getattr(node.target, "__name__", "")
    elif node.op == "call_method" and node.target in ("split", "tensor_split"):
        args, name = node.args[1:], str(node.target)
    else:
        return None
    sizes = args[0] if args else node.kwargs.get("split_size_or_sections", node.kwargs.get(
        "split_size", node.kwargs.get("indices", node.kwargs.get("sections"))))
    if not isinstance(sizes, (list, tuple)):
        return None
    return len(sizes) + (1 if name == "tensor_split" else 0)


class _PartialTracing:
    """Mixed in front of a tracer class: leaves for hooked / forced / failing modules, rollback.

    Attributes:
        opaque: qualified name -> reason, for submodules whose trace failed or misled
            (rolled back and called as leaves).
        hooked: qualified name -> hooks, for submodules kept as leaves for their hooks.
    """

    def __init__(self, *args: Any, leaves: Sequence[str] = (), wrapped: Sequence[Callable[..., Any]] = (),
                 no_varargs: Optional[EmptyVarargs] = None, **kwargs: Any) -> None:
        if wrapped:
            kwargs["autowrap_functions"] = tuple(wrapped)
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        keep_checkpoint_calls(self)  # torch.utils.checkpoint stays a call (graph/checkpoint_calls.py)
        self.opaque: Dict[str, str] = {name: "asked to be a leaf" for name in leaves}
        self.hooked: Dict[str, str] = {}
        self._param_cache: Optional[Dict[str, Any]] = None
        #: qualified name -> why a BatchNorm subclass with its own forward was not inlined
        self.norm_act: Dict[str, str] = {}
        self._frozen: Dict[int, bool] = {}
        self._bodies: Dict[int, NormActBody] = {}
        self._state: Set[int] = set()
        self._no_varargs = no_varargs  # Note: [``*args`` traced as the call passes them]

    def create_args_for_root(self, root_fn: Callable[..., Any], is_module: bool,
                             concrete_args: Any = None) -> Tuple[Callable[..., Any], List[Any]]:
        fn, args = super().create_args_for_root(root_fn, is_module, concrete_args)  # type: ignore[misc]
        if self._no_varargs is not None:  # the root's *args / **kwargs as the call passes them
            for i, a in enumerate(args):
                target = str(a.node.target) if isinstance(a, fx.Proxy) and a.node.op == "placeholder" else ""
                if target.startswith("*"):
                    self.graph.erase_node(a.node)  # type: ignore[attr-defined]
                    args[i] = {} if target.startswith("**") else tuple(
                        self.create_proxy("placeholder", f"{target[1:]}_{k}", (), {})  # type: ignore[attr-defined]
                        for k in range(self._no_varargs.extra))
        return fn, args

    def create_arg(self, a: Any) -> Any:
        # Note: [a tensor read from the model's state is not a constant]
        if isinstance(a, torch.Tensor) and id(a) in self._state and a not in self.tensor_attrs:  # type: ignore[attr-defined]
            raise TraceHazard("a tensor read from the model's own state (a container attribute, e.g. what a forward "
                              "hook stored) would be recorded as a constant")
        return super().create_arg(a)  # type: ignore[misc]

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _WatchedProxy(node, self)  # type: ignore[arg-type]

    def iter(self, obj: fx.Proxy) -> Any:
        """Iterating a traced value whose length the code fixes (``torch.split`` into listed
        sizes) or a trace with real shapes computed (``torch.split(x, c // r, 1)``): its items. fx itself iterates only where the code unpacks a fixed number
        (``a, b = ...``); ``zip(convs, torch.split(x, sizes, 1))`` (mixed-kernel convolutions)
        made the whole module opaque."""
        n = _static_length(obj.node)
        if n is not None:
            return iter([obj[i] for i in range(n)])
        return super().iter(obj)  # type: ignore[misc]

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self.opaque:
            return True
        why = hook_reason(m)
        if why is not None and m is not getattr(self, "root", None):
            self.hooked[module_qualified_name] = why
            return True
        if self._frozen.get(id(m), False):
            return True
        return super().is_leaf_module(m, module_qualified_name)  # type: ignore[misc]

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: Dict[str, Any]) -> Any:
        self._param_cache = parameter_proxy_cache  # kept so a rollback can drop stale proxies
        return super().getattr(attr, attr_val, parameter_proxy_cache)  # type: ignore[misc]

    def call_module(self, m: nn.Module, forward: Callable[..., Any], args: Tuple[Any, ...],
                    kwargs: Dict[str, Any]) -> Any:
        name = self.path_of_module(m)  # type: ignore[attr-defined]
        if (isinstance(m, _BatchNorm) and not has_standard_bn_forward(m) and m is not self.root
                and name not in self.opaque and hook_reason(m) is None):
            body = self._bodies.get(id(m)) or NormActBody(reason="it was not found among the traced module's submodules")
            x = args[0] if len(args) == 1 and not kwargs else None
            if body.reason is None and isinstance(x, fx.Proxy):
                return self._inline_norm_act(m, name, body, x)
            self.norm_act[name] = body.reason or "it is called with other than one tensor argument"
        elif id(m) in self._bodies and m is not self.root and name not in self.opaque and hook_reason(m) is None:
            body = self._bodies[id(m)]
            x = args[0] if len(args) == 1 and not kwargs else None
            if body.reason is None and isinstance(x, fx.Proxy):
                return self._inline_norm_act(m, name, body, x)
        if self.is_leaf_module(m, name) or m is self.root:  # type: ignore[attr-defined]
            return super().call_module(m, forward, args, kwargs)  # type: ignore[misc]
        graph: fx.Graph = self.graph  # type: ignore[attr-defined]
        last_node = graph._root._prev  # everything after it belongs to this call
        stack = list(self.module_stack.items())  # type: ignore[attr-defined]
        num_calls = dict(self.num_calls)  # type: ignore[attr-defined]
        try:
            return super().call_module(m, forward, args, kwargs)  # type: ignore[misc]
        except _Retrace:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure or hazard makes the module a leaf
            fn = _plain_function_of(exc)
            if fn is not None and id(fn) not in self._autowrap_function_ids:  # type: ignore[attr-defined]
                raise _Retrace(fn) from exc
            self._rollback(last_node)
            self.module_stack.clear()  # type: ignore[attr-defined]
            self.module_stack.update(stack)  # type: ignore[attr-defined]
            self.num_calls = num_calls
            self.opaque[name] = short_reason(exc)
            return super().call_module(m, forward, args, kwargs)  # type: ignore[misc]

    def _inline_norm_act(self, m: nn.Module, name: str, body: NormActBody, x: fx.Proxy) -> Any:
        """The standard batch norm of ``m`` on ``x`` as one node, then ``m``'s tail replayed."""
        create = self.create_proxy  # type: ignore[attr-defined]
        module = create("get_attr", name, (), {})
        if body.ranks:  # a frozen BatchNorm: eval-mode batch norm with its buffers
            return body.replay(m, x, lambda inp: create("call_function", frozen_batch_norm, (module, inp, body.ranks), {}))
        return body.replay(m, x, lambda inp: create("call_function", standard_batch_norm, (module, inp), {}))

    def _rollback(self, last_node: fx.Node) -> None:
        graph: fx.Graph = self.graph  # type: ignore[attr-defined]
        created: List[fx.Node] = []
        node = last_node._next
        while node is not graph._root:
            created.append(node)
            node = node._next
        erased = set(created)
        for node in reversed(created):
            graph.erase_node(node)
        if self._param_cache:
            for key in [k for k, p in self._param_cache.items() if p.node in erased]:
                del self._param_cache[key]

    def trace(self, root: Any, concrete_args: Optional[Dict[str, Any]] = None) -> fx.Graph:
        # recognised before tracing: the recogniser traces on its own, which must not record
        # into this trace
        self._bodies = {id(m): recognise_norm_act(m) for m in root.modules()
                        if isinstance(m, _BatchNorm) and not has_standard_bn_forward(m) and m is not root}
        self._frozen = {id(m): bool(frozen_bn_ranks(m)) for m in root.modules() if m is not root}
        self._state = state_tensor_ids(root)
        for m in root.modules():  # frozen BatchNorms with a tail of children: inlined like norm-act
            if m is not root and not self._frozen[id(m)] and holds_frozen_bn_tensors(m) and any(m.children()):
                self._bodies[id(m)] = recognise_frozen_norm_act(m)
        # Note: [tracing patches are the tracing thread's]
        with fx_patches_scoped(), scoped_item(torch.jit.__dict__, "isinstance",
                                              _patched_jit_isinstance(original_item(torch.jit.__dict__, "isinstance"))), opaque_functions(), \
                recording_grad_modes(self):  # type: ignore[arg-type]
            return super().trace(root, concrete_args)  # type: ignore[misc]


class _Retrace(Exception):
    """Restart the trace with ``fn`` recorded as one call instead of traced through."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__(getattr(fn, "__qualname__", repr(fn)))
        self.fn = fn


def _plain_function_of(exc: BaseException) -> Optional[Callable[..., Any]]:
    """The module-level Python function (called from a module's ``forward``) in which tracing
    failed, if the failure happened inside one: e.g. a helper calling ``len(x.shape)``.

    Such a function can run as one opaque ``call_function`` node (FX's ``autowrap``): at
    call time it then runs for real, exactly as in eager.
    """
    frames = [f for f, _ in traceback.walk_tb(exc.__traceback__)]
    user = [f for f in frames if not _trusted(f.f_code.co_filename)]
    if not user or isinstance(exc, TraceHazard):
        return None
    found = None
    for frame in reversed(user):  # innermost first
        fn = frame.f_globals.get(frame.f_code.co_name)
        if getattr(fn, "__code__", None) is not frame.f_code or "self" in frame.f_code.co_varnames[:1]:
            break  # a method (a module's forward): stop at the first non-plain frame
        found = fn
    return found


_PARTIAL_CLASSES: Dict[Any, type] = {}


def _partial_class(tracer_cls: Type[fx.Tracer]) -> type:
    if tracer_cls not in _PARTIAL_CLASSES:
        _PARTIAL_CLASSES[tracer_cls] = type(f"Partial{tracer_cls.__name__}", (_PartialTracing, tracer_cls), {})
    return _PARTIAL_CLASSES[tracer_cls]


def trace(module: nn.Module, tracer_cls: Type[fx.Tracer] = fx.Tracer, *, leaves: Sequence[str] = (),
          training: Optional[bool] = None, example: Optional[Tuple[Tuple[Any, ...], Dict[str, Any]]] = None,
          defaults: Optional[Defaults] = None) -> Traced:
    """Trace ``module`` with ``tracer_cls``'s leaf policy plus partial tracing and hazard checks.

    A failure inside a module-level helper function (not a module) restarts the trace with
    that function recorded as one call (it then runs for real at call time); a failure or
    hazard inside a submodule makes that submodule a leaf. The trace is repeated with every
    module's ``training`` flag flipped: where the two graphs differ (code that branches on
    ``self.training``, or passes it to a recorded call) the result is *mode dependent*.

    Args:
        module: the module to trace.
        tracer_cls: the caller's ``fx.Tracer`` subclass (its ``is_leaf_module`` decides
            the ordinary leaves).
        leaves: qualified names of submodules to keep as leaves regardless.
        training: trace as if ``module.train(training)`` had been called (flags restored
            afterwards); ``None`` traces the modes as they are.
        example: ``(args, kwargs)`` ``module`` runs on: trace with their real shapes
            (:mod:`.shape_capture`), the result guarded on them (:attr:`Traced.shapes`).
        defaults: the optional arguments' values to trace with (:meth:`Defaults.for_call`);
            ``None``: their defaults (symbolic where the code uses one as a value).

    Returns:
        A :class:`Traced`.

    Raises:
        Exception: whatever tracing raised when ``module``'s *own* code cannot be traced
        (including :class:`TraceHazard`); submodules never make the whole trace fail.

    Example:
        >>> t = trace(nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8)))
        >>> [n.op for n in t.graph.nodes]
        ['placeholder', 'call_module', 'call_module', 'output']
    """
    flags = [(m, m.training) for m in module.modules()]
    if training is not None and module.training != training:
        module.train(training)
    try:
        if defaults is None:
            return _trace(module, tracer_cls, leaves, example)
        return _with_varargs_retry(module, example,
                                   lambda varargs: _trace_with(module, tracer_cls, leaves, example, defaults, varargs))
    finally:
        for m, t in flags:
            m.training = t


def _tracer(tracer_cls: Type[fx.Tracer], leaves: Sequence[str], wrapped: Sequence[Callable[..., Any]],
            example: Optional[Tuple[Tuple[Any, ...], Dict[str, Any]]], no_varargs: Optional[EmptyVarargs] = None) -> Any:
    if example is None:
        return _partial_class(tracer_cls)(leaves=leaves, wrapped=wrapped, no_varargs=no_varargs)
    key = (ShapeTracing, tracer_cls)
    if key not in _PARTIAL_CLASSES:
        _PARTIAL_CLASSES[key] = type(f"Shaped{tracer_cls.__name__}", (ShapeTracing, _partial_class(tracer_cls)), {})
    return _PARTIAL_CLASSES[key](leaves=leaves, wrapped=wrapped, example=example, no_varargs=no_varargs)


def _trace(module: nn.Module, tracer_cls: Type[fx.Tracer], leaves: Sequence[str],
           example: Optional[Tuple[Tuple[Any, ...], Dict[str, Any]]] = None) -> Traced:
    return _with_varargs_retry(module, example,
                               lambda varargs: _trace_defaults(module, tracer_cls, leaves, example, varargs))


def _with_varargs_retry(module: nn.Module, example: Optional[Tuple[Tuple[Any, ...], Dict[str, Any]]],
                        attempt: Callable[[Optional[EmptyVarargs]], Traced]) -> Traced:
    """``attempt(None)``; where it fails, ``attempt`` again with the forward's ``*args`` /
    ``**kwargs`` as the call passes them (Note: [``*args`` traced as the call passes them]), or
    the first failure where that does not apply."""
    try:
        return attempt(None)
    except Exception:
        varargs = empty_varargs(module, example)
        if varargs is None:
            raise
        return attempt(varargs)


def _trace_defaults(module: nn.Module, tracer_cls: Type[fx.Tracer], leaves: Sequence[str],
                    example: Optional[Tuple[Tuple[Any, ...], Dict[str, Any]]], varargs: Optional[EmptyVarargs]) -> Traced:
    defaults = constant_defaults(module)
    if defaults.names:
        try:
            traced = _trace_with(module, tracer_cls, leaves, example, defaults, varargs)
            if not none_used_as_value(traced.graph):
                return traced
        except Exception:  # noqa: BLE001 - the code needs them as values (x + residual): symbolic, as before
            pass
    return _trace_with(module, tracer_cls, leaves, example, Defaults((), (), ()), varargs)


def _trace_with(module: nn.Module, tracer_cls: Type[fx.Tracer], leaves: Sequence[str],
                example: Optional[Tuple[Tuple[Any, ...], Dict[str, Any]]], defaults: Defaults,
                varargs: Optional[EmptyVarargs] = None) -> Traced:
    wrapped: List[Callable[..., Any]] = []
    for _ in range(16):
        tracer = _tracer(tracer_cls, leaves, wrapped, example, varargs)
        try:
            graph = tracer.trace(module, defaults.concrete_args())
            break
        except _Retrace as again:
            wrapped.append(again.fn)
    else:  # pragma: no cover - 16 nested helpers failing one after the other
        raise RuntimeError(f"tracing {type(module).__name__} kept failing in helper functions {wrapped}")
    graph._tracer_cls = tracer_cls  # picklable (torch.save re-traces the generated code with it)
    defaults.strip_asserts(graph)
    checkpointed = checkpointed_modules(graph, module)  # before any code is generated from the graph
    graph.lint()
    resolve_string_annotations(graph, module)
    gm = fx.GraphModule(tracer.root, graph, type(module).__name__)
    opaque = {k: v for k, v in tracer.opaque.items() if k not in leaves or v != "asked to be a leaf"}
    opaque.update({k: "asked to be a leaf" for k in leaves})
    for name, why in checkpointed.items():  # worked on inside the checkpoint
        opaque.setdefault(name, why)
    traced = Traced(gm, graph, opaque, dict(tracer.hooked), dict(tracer.norm_act), [getattr(f, "__qualname__", repr(f)) for f in wrapped])
    traced.modes = [(m, m.training) for m in module.modules()]
    traced.defaults = defaults
    traced.shapes = ShapeGuard(*example) if example is not None else None
    traced.varargs = varargs
    traced.mode_dependent = mode_dependent_once(  # Note: [a mode dependence answered once]
        module, gm.code, lambda: _mode_dependent(module, tracer_cls, leaves, wrapped, gm.code, defaults, example, varargs))
    return traced


def _mode_dependent(module: nn.Module, tracer_cls: Type[fx.Tracer], leaves: Sequence[str],
                    wrapped: Sequence[Callable[..., Any]], code: str, defaults: Defaults,
                    example: Optional[Tuple[Tuple[Any, ...], Dict[str, Any]]] = None,
                    no_varargs: Optional[EmptyVarargs] = None) -> bool:
    modes = [(m, m.training) for m in module.modules()]
    try:
        for m, t in modes:
            m.training = not t
        tracer = _tracer(tracer_cls, leaves, wrapped, example, no_varargs)
        graph = tracer.trace(module, defaults.concrete_args())
        defaults.strip_asserts(graph)
        checkpointed_modules(graph, module)
        resolve_string_annotations(graph, module)
        other = fx.GraphModule(tracer.root, graph).code
    except Exception:  # noqa: BLE001 - the other mode does not even trace: surely dependent
        return True
    finally:
        for m, t in modes:
            m.training = t
    return other != code


def resolve_string_annotations(graph: fx.Graph, module: nn.Module) -> None:
    """Replace string annotations (``from __future__ import annotations``) on the graph's
    inputs/output by the types they name, or drop them: FX writes them into the generated
    code under names TorchScript and ``torch.save`` cannot resolve."""
    try:
        hints = typing.get_type_hints(type(module).forward)
    except Exception:  # noqa: BLE001 - unresolvable names: just drop them
        hints = {}
    for node in graph.nodes:
        if node.op == "placeholder" and isinstance(node.type, str):
            node.type = hints.get(node.target.lstrip("*"))
        elif node.op == "output" and isinstance(node.type, str):
            node.type = hints.get("return")
