"""What a module carries: a GraphModule that replaces a user's module keeps its plain
attributes (``self.window = 4``), hooks and ``_version`` (``state_dict()._metadata``),
across ``copy.deepcopy`` and ``torch.save``, and can validate itself on its first call
or run the original where its trace does not hold (the other train/eval mode)."""
from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx
from torch import Tensor, nn
from torch.fx.graph_module import _deserialize_graph_module, _format_import_block, _forward_from_src
from torch.utils import _pytree as pytree

from ..nn.fused import hooks_of
from .hooks import global_hooks, hook_reason
from .validate import StateSnapshot, compare_outputs, float64_slack, seeded

__all__ = ["preserve_module_state", "ConvbnGraphModule"]


_MODULE_DEFAULTS = frozenset(vars(nn.Module()))
_TREE = frozenset({"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "training"})
# what makes a module *run* something: never carried over (the replacement runs its graph)
_CALLS = frozenset({"forward", "_compiled_call_impl", "__call__"})
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
        if key in _TREE or key in _CALLS or key == _PRESERVED_KEY:
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


class _SavedCodeTracer(fx.Tracer):
    """Re-traces a saved graph's code: convbn's own functions in it stay single calls.

    Note: [loading a graph that calls convbn functions]
    ``torch.load`` rebuilds a GraphModule by tracing its saved Python code again. The
    rewrite put calls of convbn functions in the graph (``pool_module_call``, the lean
    pooling; inlined batch norms), which take control flow on tensor properties: traced
    into, they fail (``TraceError``), or in the converting process they happened not to be
    reached. Tracing keeps them as one ``call_function`` each, as the rewrite made them
    (FX's autowrap), so the loaded graph is the saved one, in any process.
    """

    def trace(self, root: Any, concrete_args: Optional[Dict[str, Any]] = None) -> fx.Graph:
        fn = getattr(type(root), "forward", None)
        for value in getattr(fn, "__globals__", {}).values():
            if callable(value) and type(value).__name__ == "function" and \
                    str(getattr(value, "__module__", "")).startswith("convbn."):
                self._autowrap_function_ids.add(id(value))
        return super().trace(root, concrete_args)


def _rebuild(body: Dict[str, Any], import_block: str) -> nn.Module:
    fn_src = body.get("_code") or body["code"]
    forward = _forward_from_src(import_block + fn_src, {})
    tracer_cls = body.get("_tracer_cls")
    gm = _deserialize_graph_module(forward, dict(body, _tracer_cls=_SavedCodeTracer), graph_module_cls=ConvbnGraphModule)
    gm._tracer_cls = tracer_cls  # as saved (the loading tracer is not part of the model)
    gm.graph._tracer_cls = tracer_cls
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
        for key in ("_convbn_fallback", "_convbn_pending", "_convbn_mode_guard", "_convbn_inlined"):
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

    def watch_inlined(self, original: nn.Module, modules: Sequence[nn.Module]) -> None:
        """Run ``original`` instead whenever one of ``modules`` -- modules whose forward was
        traced *through*, so the graph never calls them -- has hooks: hooks registered after
        conversion are then called as in eager. (Global module hooks see the modules the
        converted model calls; see :func:`convbn.nn.fused.module_hooked`.)"""
        self.__dict__["_convbn_inlined"] = _ModeGuard(original, [(m, m.training) for m in modules])

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fallback = self.__dict__.get("_convbn_fallback")
        if fallback is not None:
            return fallback.module(*args, **kwargs)
        guard = self.__dict__.get("_convbn_mode_guard")
        if guard is not None and any(m.training != t for m, t in guard.modes):
            return guard.module(*args, **kwargs)
        inlined = self.__dict__.get("_convbn_inlined")
        if inlined is not None and any(_has_hooks(m) for m, _ in inlined.modes):
            return inlined.module(*args, **kwargs)
        pending = self.__dict__.get("_convbn_pending")
        if pending is not None and not torch.compiler.is_compiling():
            self.__dict__["_convbn_pending"] = None
            if global_hooks() or any(hook_reason(m) for m in pending.module.modules()):
                # hooks may have side effects (collected features, counters): never call them
                # more often than eager would; such models are validated with example_inputs only
                return super().__call__(*args, **kwargs)
            with torch.no_grad():
                with StateSnapshot(pending.module), StateSnapshot(self), seeded(0):
                    ref = pending.module(*_clone(args), **_clone(kwargs))
                with StateSnapshot(pending.module), StateSnapshot(self), seeded(0):
                    out = super().__call__(*_clone(args), **_clone(kwargs))
            to64 = lambda t: t.double() if isinstance(t, Tensor) and t.is_floating_point() else t  # noqa: E731

            def exact_run(model64: nn.Module) -> Any:
                with torch.no_grad(), seeded(0):
                    return model64(*pytree.tree_map(to64, args), **pytree.tree_map(to64, kwargs))

            result = compare_outputs(ref, out, pending.tolerance)
            if not result.ok:  # rounding amplified by the model itself? ask a float64 copy (only now)
                slack = float64_slack(pending.module, exact_run, ref)
                if slack is not None:
                    result = compare_outputs(ref, out, pending.tolerance, slack=slack)
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


def _has_hooks(m: nn.Module) -> bool:
    return bool(hooks_of(m))


@dataclass
class _ModeGuard:
    module: nn.Module
    modes: List[Tuple[nn.Module, bool]]


def _clone(tree: Any) -> Any:
    return pytree.tree_map(lambda t: t.clone() if isinstance(t, Tensor) else t, tree)
