"""Tracing shared by :func:`convbn.convert` and :func:`convbn.fold`.

One place decides how a user's model becomes an ``fx.Graph`` and how a rewritten graph
goes back into a module without changing what the user built:

* **Leaf policy** (:func:`trace`): the caller's tracer class decides which modules are
  leaves (convolutions, BatchNorms ...); on top of it, a module with hooks is always a
  leaf (its hooks then run at call time, as in eager; tracing through it would run them
  once on proxies and never again).
* **Partial tracing**: a submodule whose forward cannot be traced, or whose trace would
  mislead (see below), is rolled back and becomes a *leaf of its parent's trace*, so the
  rest of the parent is still traced whole; the caller then works inside it on its own.
* **Trace hazards**: ``torch.fx`` proxies answer ``isinstance(x, torch.Tensor)`` and
  ``torch.jit.isinstance(x, torch.Tensor)`` with ``False``, so code branching on them
  silently records the *other* branch (MONAI's ``UpCat`` drops its skip connection).
  While tracing, both checks on a traced value raise :class:`TraceHazard` inside the
  module that made them, which partial tracing turns into a leaf. Python control flow on
  shapes already fails under ``torch.fx`` and is handled the same way.
* **What a module carries** (:func:`preserve_module_state`): a GraphModule that replaces
  a user's module keeps its plain attributes (``self.window = 4``), its hooks and its
  ``_version`` (``state_dict()._metadata``), across ``copy.deepcopy`` and ``torch.save``.
* **Validation** (:func:`compare_outputs`, :class:`StateSnapshot`, :func:`run_step`):
  run the original and the rewrite on the same inputs with the model state restored
  exactly afterwards, and compare outputs (and gradients).
"""
from __future__ import annotations

import contextlib
import copy
import math
import os
import sys
import typing
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple, Type

import torch
import torch.fx as fx
from torch import Tensor, nn
from torch.fx.graph_module import _deserialize_graph_module, _format_import_block, _forward_from_src
from torch.utils import _pytree as pytree

__all__ = [
    "TraceHazard",
    "Traced",
    "trace",
    "hook_reason",
    "resolve_string_annotations",
    "preserve_module_state",
    "ConvbnGraphModule",
    "StateSnapshot",
    "Comparison",
    "compare_outputs",
    "run_step",
    "short_reason",
    "as_args",
]


class TraceHazard(RuntimeError):
    """Raised while tracing where ``torch.fx`` would record a different computation than eager runs."""


def short_reason(exc: BaseException, limit: int = 160) -> str:
    """``"TypeName: first line of the message"``, shortened to ``limit`` characters."""
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    if len(first) > limit:
        first = first[: limit - 3] + "..."
    return f"{type(exc).__name__}: {first}"


def as_args(example_inputs: Any) -> Tuple[Any, ...]:
    """``example_inputs`` as positional arguments: a tuple/list is spread, anything else is one argument."""
    if isinstance(example_inputs, tuple):
        return example_inputs
    if isinstance(example_inputs, list):
        return tuple(example_inputs)
    return (example_inputs,)


# --------------------------------------------------------------------------- hooks


_OLD_STYLE_PARAMETRIZATIONS = {
    "WeightNorm": "torch.nn.utils.weight_norm (hook-based)",
    "SpectralNorm": "torch.nn.utils.spectral_norm (hook-based)",
}


def _hook_name(hook: Any) -> str:
    cls = type(hook).__name__
    if cls in _OLD_STYLE_PARAMETRIZATIONS:
        return _OLD_STYLE_PARAMETRIZATIONS[cls]
    if any(k.__name__ == "BasePruningMethod" for k in type(hook).__mro__):
        return "torch.nn.utils.prune"
    return getattr(hook, "__qualname__", None) or cls


def hook_reason(m: nn.Module) -> Optional[str]:
    """Why ``m``'s forward must run as a module call: the hooks it has, or ``None``.

    Forward pre-hooks, forward hooks and backward hooks all see (or change) what the
    module computes; hook-based parametrizations (old-style ``weight_norm`` /
    ``spectral_norm``) and pruning are forward pre-hooks that recompute ``weight``.
    State-dict hooks are not listed: the module stays registered, so they keep running.
    """
    found = []
    for attr, what in (("_forward_pre_hooks", "forward pre-hook"), ("_forward_hooks", "forward hook"),
                       ("_backward_pre_hooks", "backward pre-hook"), ("_backward_hooks", "backward hook")):
        hooks = getattr(m, attr, None)
        if hooks:
            found += [f"{what} {_hook_name(h)}" for h in hooks.values()]
    return ", ".join(found) if found else None


def global_hooks() -> bool:
    """Whether global module hooks (``nn.modules.module.register_module_*_hook``) are registered."""
    from torch.nn.modules import module as _m

    return bool(_m._global_forward_pre_hooks or _m._global_forward_hooks or _m._global_backward_hooks
                or getattr(_m, "_global_backward_pre_hooks", None))


# --------------------------------------------------------------------------- tracing

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# torch's own code inspects proxies on purpose (FX itself, pytree, dispatch, Parameter's
# metaclass); ``torch.is_tensor`` (torch/__init__.py) is the model's question, not torch's.
_IS_TENSOR_FILE = _TORCH_DIR + "__init__.py"


def _trusted(filename: str) -> bool:
    return (filename.startswith(_TORCH_DIR) and filename != _IS_TENSOR_FILE) or filename.startswith(_OWN_DIR)


class _WatchedProxy(fx.Proxy):
    """A proxy that notices ``isinstance`` checks made on it by the model's own code.

    ``isinstance(p, C)`` for a class ``C`` that ``type(p)`` is not a subclass of reads
    ``p.__class__``; eager code would have seen a Tensor there. The check is a hazard
    unless it comes from FX or torch internals.
    """

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # noqa: D401
        frame = sys._getframe(1)
        filename = frame.f_code.co_filename
        if not _trusted(filename):
            raise TraceHazard(
                f"isinstance() on a traced value at {os.path.basename(filename)}:{frame.f_lineno} "
                "(torch.fx would record the non-tensor branch)"
            )
        return type(self)


def _patched_jit_isinstance(original: Callable[[Any, Any], bool]) -> Callable[[Any, Any], bool]:
    def jit_isinstance(obj: Any, target_type: Any) -> bool:
        if type(obj) is _WatchedProxy or isinstance(obj, fx.Proxy):
            frame = sys._getframe(1)
            raise TraceHazard(
                f"torch.jit.isinstance() on a traced value at {os.path.basename(frame.f_code.co_filename)}:"
                f"{frame.f_lineno} (torch.fx would record the non-tensor branch)"
            )
        return original(obj, target_type)

    return jit_isinstance


class _PartialTracing:
    """Mixed in front of a tracer class: leaves for hooked / forced / failing modules, rollback.

    Attributes:
        opaque: qualified name -> reason, for submodules whose trace failed or misled
            (rolled back and called as leaves).
        hooked: qualified name -> hooks, for submodules kept as leaves for their hooks.
    """

    def __init__(self, *args: Any, leaves: Sequence[str] = (), wrapped: Sequence[Callable[..., Any]] = (),
                 **kwargs: Any) -> None:
        if wrapped:
            kwargs["autowrap_functions"] = tuple(wrapped)
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        self.opaque: Dict[str, str] = {name: "asked to be a leaf" for name in leaves}
        self.hooked: Dict[str, str] = {}
        self._param_cache: Optional[Dict[str, Any]] = None

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _WatchedProxy(node, self)  # type: ignore[arg-type]

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self.opaque:
            return True
        why = hook_reason(m)
        if why is not None and m is not getattr(self, "root", None):
            self.hooked[module_qualified_name] = why
            return True
        return super().is_leaf_module(m, module_qualified_name)  # type: ignore[misc]

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: Dict[str, Any]) -> Any:
        self._param_cache = parameter_proxy_cache  # kept so a rollback can drop stale proxies
        return super().getattr(attr, attr_val, parameter_proxy_cache)  # type: ignore[misc]

    def call_module(self, m: nn.Module, forward: Callable[..., Any], args: Tuple[Any, ...],
                    kwargs: Dict[str, Any]) -> Any:
        name = self.path_of_module(m)  # type: ignore[attr-defined]
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
        original = torch.jit.isinstance
        torch.jit.isinstance = _patched_jit_isinstance(original)  # type: ignore[assignment]
        try:
            return super().trace(root, concrete_args)  # type: ignore[misc]
        finally:
            torch.jit.isinstance = original  # type: ignore[assignment]


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
    frames = [f for f, _ in __import__("traceback").walk_tb(exc.__traceback__)]
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


_PARTIAL_CLASSES: Dict[type, type] = {}


def _partial_class(tracer_cls: Type[fx.Tracer]) -> type:
    if tracer_cls not in _PARTIAL_CLASSES:
        _PARTIAL_CLASSES[tracer_cls] = type(f"Partial{tracer_cls.__name__}", (_PartialTracing, tracer_cls), {})
    return _PARTIAL_CLASSES[tracer_cls]


@dataclass
class Traced:
    """Result of :func:`trace`.

    Attributes:
        gm: a GraphModule of the trace (holding only what the graph uses).
        graph: its graph.
        opaque: submodules rolled back to leaves, with the reason (failed or misleading trace).
        hooked: submodules kept as leaves because they have hooks, with the hooks.
        wrapped: helper functions recorded as single calls (their trace failed inside).
        mode_dependent: the graph differs when traced with ``training`` flipped.
        modes: every module's ``training`` flag when traced.
    """

    gm: fx.GraphModule
    graph: fx.Graph
    opaque: Dict[str, str] = field(default_factory=dict)
    hooked: Dict[str, str] = field(default_factory=dict)
    wrapped: List[str] = field(default_factory=list)
    mode_dependent: bool = False
    modes: List[Tuple[nn.Module, bool]] = field(default_factory=list, repr=False)

    def descend(self) -> Dict[str, str]:
        """Leaves the caller should work inside on their own (opaque and hooked), outermost first."""
        both = {**self.hooked, **self.opaque}
        names = sorted(both, key=lambda n: n.count("."))
        kept: Dict[str, str] = {}
        for n in names:  # a leaf inside another leaf is reached through the outer one
            if n and not any(n.startswith(k + ".") for k in kept if k):
                kept[n] = both[n]
        return kept


def trace(module: nn.Module, tracer_cls: Type[fx.Tracer] = fx.Tracer, *, leaves: Sequence[str] = ()) -> Traced:
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
    wrapped: List[Callable[..., Any]] = []
    for _ in range(16):
        tracer = _partial_class(tracer_cls)(leaves=leaves, wrapped=wrapped)
        try:
            graph = tracer.trace(module)
            break
        except _Retrace as again:
            wrapped.append(again.fn)
    else:  # pragma: no cover - 16 nested helpers failing one after the other
        raise RuntimeError(f"tracing {type(module).__name__} kept failing in helper functions {wrapped}")
    graph._tracer_cls = tracer_cls  # picklable (torch.save re-traces the generated code with it)
    graph.lint()
    resolve_string_annotations(graph, module)
    gm = ConvbnGraphModule(tracer.root, graph, type(module).__name__)
    opaque = {k: v for k, v in tracer.opaque.items() if k not in leaves or v != "asked to be a leaf"}
    opaque.update({k: "asked to be a leaf" for k in leaves})
    traced = Traced(gm, graph, opaque, dict(tracer.hooked), [getattr(f, "__qualname__", repr(f)) for f in wrapped])
    traced.modes = [(m, m.training) for m in module.modules()]
    traced.mode_dependent = _mode_dependent(module, tracer_cls, leaves, wrapped, gm.code)
    return traced


def _mode_dependent(module: nn.Module, tracer_cls: Type[fx.Tracer], leaves: Sequence[str],
                    wrapped: Sequence[Callable[..., Any]], code: str) -> bool:
    modes = [(m, m.training) for m in module.modules()]
    try:
        for m, t in modes:
            m.training = not t
        tracer = _partial_class(tracer_cls)(leaves=leaves, wrapped=wrapped)
        graph = tracer.trace(module)
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


# --------------------------------------------------------------------------- what a module carries

_MODULE_DEFAULTS = frozenset(vars(nn.Module()))
_TREE = frozenset({"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "training"})
_PRESERVED_KEY = "_convbn_preserved"


def preserve_module_state(src: nn.Module, dst: nn.Module) -> None:
    """Give ``dst`` (a module replacing ``src``) ``src``'s plain attributes, hooks and ``_version``.

    Plain attributes are those in ``src.__dict__`` that are not parameters, buffers or
    submodules and that ``dst`` does not define itself. Hook dictionaries are copied (the
    same hooks, new containers). ``_version`` (written to ``state_dict()._metadata``, read
    by ``_load_from_state_dict`` overrides) is copied when it differs.
    """
    keep: Dict[str, Any] = {}
    for key, value in vars(src).items():
        if key in _TREE or key == _PRESERVED_KEY:
            continue
        if key in _MODULE_DEFAULTS:  # hooks and other per-instance nn.Module state
            keep[key] = copy.copy(value) if isinstance(value, (dict, set, list)) else value
        elif key not in vars(dst) and not hasattr(type(dst), key):
            keep[key] = value
    version = getattr(src, "_version", 1)
    if version != getattr(dst, "_version", 1):
        keep["_version"] = version
    for key, value in keep.items():
        object.__setattr__(dst, key, value)
    dst.__dict__[_PRESERVED_KEY] = tuple(keep)


def _restore_preserved(dst: nn.Module, body: Dict[str, Any], memo: Optional[Dict[int, Any]]) -> None:
    for key in body.get(_PRESERVED_KEY, ()):
        if key in body:
            value = body[key] if memo is None else copy.deepcopy(body[key], memo)
            object.__setattr__(dst, key, value)
    dst.__dict__[_PRESERVED_KEY] = tuple(body.get(_PRESERVED_KEY, ()))


def _rebuild(body: Dict[str, Any], import_block: str) -> nn.Module:
    fn_src = body.get("_code") or body["code"]
    forward = _forward_from_src(import_block + fn_src, {})
    gm = _deserialize_graph_module(forward, dict(body), graph_module_cls=ConvbnGraphModule)
    _restore_preserved(gm, body, None)
    return gm


class ConvbnGraphModule(fx.GraphModule):
    """A GraphModule that keeps what :func:`preserve_module_state` gave it through
    ``copy.deepcopy`` and ``torch.save`` (plain ``fx.GraphModule`` drops attributes the
    graph does not use, hooks and ``_version``), and can validate itself on its first call.

    ``validate_on_first_call(original)``: the first call also runs ``original`` (the module
    this one replaced, sharing its parameters and buffers) with the model state restored
    exactly, and compares outputs. On a mismatch it warns and from then on runs
    ``original`` (eager) instead: the result is never a silently different model.
    """

    def __deepcopy__(self, memo: Dict[int, Any]) -> "ConvbnGraphModule":
        res = super().__deepcopy__(memo)
        _restore_preserved(res, self.__dict__, memo)
        for key in ("_convbn_fallback", "_convbn_pending", "_convbn_mode_guard"):
            if self.__dict__.get(key) is not None:
                res.__dict__[key] = copy.deepcopy(self.__dict__[key], memo)
        return res

    def __reduce__(self) -> Tuple[Any, ...]:
        body = self.__dict__.copy()
        python_code = self.recompile()
        import_block = _format_import_block(python_code.globals, _importer())
        del body["_graph"]
        return (_rebuild, (body, import_block))

    def validate_on_first_call(self, original: nn.Module, tolerance: Callable[[torch.dtype], float]) -> None:
        self.__dict__["_convbn_pending"] = _Pending(original, tolerance)

    def guard_modes(self, original: nn.Module, modes: Sequence[Tuple[nn.Module, bool]]) -> None:
        """Run ``original`` instead whenever a module's ``training`` flag differs from ``modes``
        (for a graph traced in one mode that would differ in the other)."""
        self.__dict__["_convbn_mode_guard"] = _ModeGuard(original, list(modes))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fallback = self.__dict__.get("_convbn_fallback")
        if fallback is not None:
            return fallback.module(*args, **kwargs)
        guard = self.__dict__.get("_convbn_mode_guard")
        if guard is not None and any(m.training != t for m, t in guard.modes):
            return guard.module(*args, **kwargs)
        pending = self.__dict__.get("_convbn_pending")
        if pending is not None and not torch.compiler.is_compiling():
            self.__dict__["_convbn_pending"] = None
            if global_hooks() or any(hook_reason(m) for m in pending.module.modules()):
                # hooks may have side effects (collected features, counters): never call them
                # more often than eager would; such models are validated with example_inputs only
                return super().__call__(*args, **kwargs)
            with torch.no_grad():
                with StateSnapshot(pending.module), StateSnapshot(self), _seeded(0):
                    ref = pending.module(*_clone(args), **_clone(kwargs))
                with StateSnapshot(pending.module), StateSnapshot(self), _seeded(0):
                    out = super().__call__(*_clone(args), **_clone(kwargs))
            result = compare_outputs(ref, out, pending.tolerance)
            if not result.ok:
                self.__dict__["_convbn_fallback"] = pending
                warnings.warn(
                    f"convbn: the rewritten {type(pending.module).__name__} differs from the original on its "
                    f"first call ({result.describe()}); running the original (unfused) module from now on. "
                    "Pass example_inputs=... to convert/fold to validate (and convert finer) up front.",
                    RuntimeWarning,
                    stacklevel=2,
                )
                return pending.module(*args, **kwargs)
        return super().__call__(*args, **kwargs)


def _importer() -> Any:
    from torch.package import sys_importer

    return sys_importer


@dataclass
class _Pending:
    module: nn.Module
    tolerance: Callable[[torch.dtype], float]

    def __deepcopy__(self, memo: Dict[int, Any]) -> "_Pending":
        return _Pending(copy.deepcopy(self.module, memo), self.tolerance)


@dataclass
class _ModeGuard:
    module: nn.Module
    modes: List[Tuple[nn.Module, bool]]


def _clone(tree: Any) -> Any:
    return pytree.tree_map(lambda t: t.clone() if isinstance(t, Tensor) else t, tree)


# --------------------------------------------------------------------------- validation


class StateSnapshot:
    """Snapshot buffers, ``training`` flags and RNG states of ``model``; put them back on exit.

    Example:
        >>> with StateSnapshot(model):
        ...     model(x)   # running statistics, num_batches_tracked, RNG: unchanged afterwards
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __enter__(self) -> "StateSnapshot":
        self.buffers = [(b, b.detach().clone()) for b in self.model.buffers()]
        self.modes = [(m, m.training) for m in self.model.modules()]
        self.rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        return self

    def __exit__(self, *exc: Any) -> None:
        with torch.no_grad():
            for b, v in self.buffers:
                if not b.is_inference():
                    b.copy_(v)
        for m, t in self.modes:
            m.training = t
        torch.set_rng_state(self.rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


@dataclass
class Comparison:
    """Result of :func:`compare_outputs`: ``ok``, the worst difference and its allowance, and why not."""

    ok: bool
    max_abs_diff: float = 0.0
    allowed: float = 0.0
    note: str = ""

    def describe(self) -> str:
        if self.note:
            return self.note
        return f"max |difference| {self.max_abs_diff:.3g} > allowed {self.allowed:.3g}"


def compare_outputs(reference: Any, candidate: Any, tolerance: Callable[[torch.dtype], float],
                    slack: Optional[Sequence[float]] = None, relative: bool = False) -> Comparison:
    """Compare two pytrees of outputs leaf by leaf.

    A floating tensor passes when ``max|candidate - reference| <= tol * scale + slack[i]``
    (``tol = tolerance(dtype)``, ``slack`` per floating leaf, default 0), with the same
    non-finite values. ``scale`` is ``max(1, max|reference|)``, or with ``relative`` the
    leaf's own ``max|reference|`` but at least 1e-3 of the largest leaf's (gradients are
    often far below 1). Other tensors must be equal, other values equal.
    """
    ref_leaves, ref_spec = pytree.tree_flatten(reference)
    floor = 0.0
    if relative:
        mags = [t.detach().abs().nan_to_num(posinf=0.0, neginf=0.0).max().item() for t in ref_leaves
                if isinstance(t, Tensor) and t.is_floating_point() and t.numel()]
        floor = 1e-3 * max(mags, default=0.0)
    new_leaves, new_spec = pytree.tree_flatten(candidate)
    if ref_spec != new_spec:
        return Comparison(False, math.inf, 0.0, f"output structure changed: {ref_spec} vs {new_spec}")
    worst = Comparison(True)
    worst_ratio = -1.0
    k = 0
    for a, b in zip(ref_leaves, new_leaves):
        if not isinstance(a, Tensor):
            if isinstance(b, Tensor) or (a != b and not (a is b)):
                return Comparison(False, math.inf, 0.0, "a non-tensor output changed")
            continue
        if not isinstance(b, Tensor) or a.shape != b.shape:
            return Comparison(False, math.inf, 0.0, f"an output tensor changed shape: {tuple(a.shape)} vs "
                              f"{tuple(b.shape) if isinstance(b, Tensor) else type(b).__name__}")
        if not a.is_floating_point() and not a.is_complex():
            if not torch.equal(a, b):
                return Comparison(False, math.inf, 0.0, "a non-floating output changed")
            continue
        extra = slack[k] if slack is not None and k < len(slack) else 0.0
        k += 1
        finite = torch.isfinite(a)
        if not torch.equal(finite, torch.isfinite(b)) or not torch.equal(a[~finite].nan_to_num(), b[~finite].nan_to_num()):
            return Comparison(False, math.inf, 0.0, "non-finite values appeared, disappeared or changed")
        if not finite.any():
            continue
        a64, b64 = a[finite].detach().double(), b[finite].detach().double()
        scale = max(floor, a64.abs().max().item()) if relative else max(1.0, a64.abs().max().item())
        diff = (a64 - b64).abs().max().item()
        allowed = tolerance(a.dtype) * scale + extra
        ratio = diff / allowed if allowed > 0 else (0.0 if diff == 0 else math.inf)
        if ratio > worst_ratio:
            worst_ratio = ratio
            worst = Comparison(ratio <= 1.0, diff, allowed)
    return worst


def run_step(model: nn.Module, args: Tuple[Any, ...], params: Sequence[Tensor], seed: int,
             backward: bool = True) -> Tuple[Any, List[Optional[Tensor]]]:
    """One forward (RNG seeded with ``seed``) and, where possible, one backward with a random
    upstream gradient (also from ``seed``), returning outputs and the gradients of ``params``
    and of the floating tensor inputs. ``.grad`` fields are left alone (``torch.autograd.grad``);
    the caller restores state (:class:`StateSnapshot`)."""
    inputs = [a.detach().clone().requires_grad_(a.is_floating_point()) if isinstance(a, Tensor) else a
              for a in pytree.tree_leaves(args)]
    leaves, spec = pytree.tree_flatten(args)
    it = iter(inputs)
    call_args = pytree.tree_unflatten([next(it) for _ in leaves], spec)
    with _seeded(seed):
        out = model(*call_args)
    outs = [o for o in pytree.tree_leaves(out) if isinstance(o, Tensor) and o.requires_grad]
    wrt = [p for p in params if p.requires_grad] + [t for t in inputs if isinstance(t, Tensor) and t.requires_grad]
    if not backward or not outs or not wrt or not torch.is_grad_enabled():
        return pytree.tree_map(lambda t: t.detach() if isinstance(t, Tensor) else t, out), []
    gen = torch.Generator().manual_seed(seed + 1)
    ups = [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o) for o in outs]
    grads = torch.autograd.grad(outs, wrt, ups, allow_unused=True)
    return pytree.tree_map(lambda t: t.detach() if isinstance(t, Tensor) else t, out), list(grads)
