"""Tracing with the shapes of real inputs, guarded on them.

``torch.fx`` proxies have no shapes: ``if in_h % stride == 0`` (TF-"SAME" padding), ``for s, t
in zip(skip.shape[2:], x.shape[2:])`` (odd-size padding) or ``torch.rand(x.shape[0], 1, 1, 1)``
(inline drop-path) make ``bool(proxy)`` raise, and the module stays unfused. Where the
inputs a module runs on are known (``convert(example_inputs=...)``: each module's inputs in
one eager run), its trace can instead carry, for every traced value, a *fake* tensor of
the real one (``FakeTensorMode``: shapes and dtypes, no data, no computation), computed op
by op as the trace proceeds. ``x.shape``, ``x.size()``, ``x.dim()``, ``x.ndim``, ``x.dtype``
and ``len(x)`` then answer with the real (static) sizes and dtypes, so Python code on shapes takes the branch
eager takes and the sizes it computes are constants of the graph. A data-dependent branch
(``if x.sum() > 0``) still fails as before.

What such a graph assumed is *guarded*: :class:`ShapeGuard` holds the shapes, dtypes and
devices of the module's tensor inputs and the autocast state (which decides the dtypes inside); a call with others runs the module's own forward
(:class:`~convbn.passes.graph.graph_module.GraphForward`).
"""
from __future__ import annotations

import contextlib
import inspect
import threading
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.fx.node import has_side_effect
from ..._compat import FakeTensorMode, orig_module_call, orig_module_getattr, pytree

from .quiet_fake import fake_errors_quiet
from .thread_patch import original_item, scoped_item

__all__ = ["ShapeGuard", "Guards", "ShapeTracing", "VALUE", "DTYPE", "RANK", "assert_traced_shape"]

#: ``node.meta`` key of the fake value a shape trace computed for a node (while it traces)
VALUE = "convbn_fake"
#: ``node.meta`` key of the dtype a shape trace computed for a tensor node (kept in the graph)
DTYPE = "convbn_dtype"
#: ``node.meta`` key of the rank a shape trace computed for a tensor node (kept in the graph)
RANK = "convbn_rank"


def _signature(args: Any, kwargs: Any) -> Tuple[Any, ...]:
    leaves = pytree.tree_leaves((args, kwargs))
    # autocast decides the dtypes inside (``if x.dtype == torch.float16`` is answered by the trace)
    autocast = tuple((d, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d))
    return tuple((tuple(t.shape), t.dtype, str(t.device)) if isinstance(t, Tensor) else type(t)
                 for t in leaves) + autocast


@has_side_effect
def assert_traced_shape(x: Tensor, shape: List[int]) -> None:
    """Raise where ``x`` has not the shape a graph was traced for: the graph of a trace with
    real shapes, run without its Python guard (a TorchScript copy), refuses other shapes
    instead of computing with the traced ones."""
    if list(x.shape) != shape:
        raise RuntimeError(f"this graph was traced for inputs of shape {shape}, but got {list(x.shape)}; "
                           "run the module's own forward for other shapes")


class ShapeGuard:
    """The shapes, dtypes and devices of a call's tensor inputs (and the other inputs' types)
    that a trace with real shapes assumed."""

    def __init__(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        self.spec = _signature(args, kwargs)

    def hold(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> bool:
        """Whether ``args`` / ``kwargs`` have the traced shapes, dtypes and devices."""
        return _signature(args, kwargs) == self.spec

    def describe(self) -> str:
        """The inputs' shapes, dtypes and devices and the autocast state as text (for the report):
        ``input shapes [[2, 3, 8, 8]] float32 on cpu``, ``..., under cpu autocast to bfloat16``."""
        return _describe(self.spec)

    def differing(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> str:
        return f"its {_describe(self.spec)} (traced with real sizes; this call: {_describe(_signature(args, kwargs))})"


def _describe(spec: Tuple[Any, ...]) -> str:
    tensors = [s for s in spec if isinstance(s, tuple) and len(s) == 3]
    kinds = sorted({f"{str(s[1]).replace('torch.', '')} on {s[2]}" for s in tensors})
    autocast = [f"{s[0]} autocast to {str(s[1]).replace('torch.', '')}" for s in spec if isinstance(s, tuple) and len(s) == 2]
    return (f"input shapes {[list(s[0]) for s in tensors]} {', '.join(kinds)}"
            + (f", under {' and '.join(autocast)}" if autocast else ""))


class Guards:
    """Several guards, all of which must hold (each has ``hold`` and ``differing``)."""

    def __init__(self, guards: Sequence[Any]) -> None:
        self.guards = list(guards)

    def hold(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> bool:
        return all(g.hold(args, kwargs) for g in self.guards)

    def differing(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> str:
        return next((g.differing(args, kwargs) for g in self.guards if not g.hold(args, kwargs)), "")


class _Unknown(Exception):
    pass


def _value(node: Any) -> Any:
    if isinstance(node, fx.Node):
        if VALUE not in node.meta:
            raise _Unknown(node.name)
        return node.meta[VALUE]
    return node


#: how deep this thread is in :func:`_untraced` (random factories called there run for real)
_REAL = threading.local()

# Note: [random numbers drawn from real shapes]
# ``torch.rand(x.shape[0], 1, 1, 1, dtype=x.dtype)`` (inline drop-path, EfficientNet's drop
# connect) gets only Python ints and a real dtype once shapes answer: ``torch.fx`` does not see
# the call, so it would run once at trace time and its numbers be baked into the graph as a
# constant (the same mask on every step). While a shape trace runs, these factories record
# a node instead (its value computed as fake like every other), so the graph draws afresh.
_RANDOM_FACTORIES = ("rand", "randn", "randint", "randperm")


@contextlib.contextmanager
def _untraced() -> Iterator[None]:
    """Run code for real while a trace is under way: ``nn.Module`` calls and attribute reads
    as outside tracing (``torch.fx`` patches them), grad-mode regions not recorded."""
    from .grad_regions import _recording

    patched = {k: nn.Module.__dict__[k] for k in ("__call__", "__getattr__")}
    tracer, _recording.tracer = _recording.tracer, None
    nn.Module.__call__ = orig_module_call  # type: ignore[method-assign]
    nn.Module.__getattr__ = orig_module_getattr  # type: ignore[method-assign]
    _REAL.depth = getattr(_REAL, "depth", 0) + 1
    try:
        yield
    finally:
        _REAL.depth -= 1
        for k, v in patched.items():
            setattr(nn.Module, k, v)
        _recording.tracer = tracer


@contextlib.contextmanager
def _recorded_factories(tracer: Any) -> Iterator[None]:
    """While ``tracer`` traces, ``torch.rand`` and the other random factories record a node
    (Note: [random numbers drawn from real shapes]); outside :func:`_untraced` only, and in the
    tracing thread only (Note: [tracing patches are the tracing thread's]): another thread's
    ``torch.rand`` meanwhile draws as always."""
    namespace = vars(torch)

    def recorder(fn: Any) -> Any:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            if getattr(_REAL, "depth", 0) or "generator" in kwargs:
                return fn(*args, **kwargs)
            return tracer.create_proxy("call_function", fn, args, kwargs)
        return recorded

    with contextlib.ExitStack() as patches:
        for name in _RANDOM_FACTORIES:
            patches.enter_context(scoped_item(namespace, name, recorder(original_item(namespace, name))))
        yield


class ShapeTracing:
    """Mixed in front of a tracer class: every traced value carries a fake tensor of the real one
    (see module docstring); ``example``: the ``(args, kwargs)`` the traced module runs on."""

    def __init__(self, *args: Any, example: Tuple[Tuple[Any, ...], Dict[str, Any]] = ((), {}), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        self._fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        self._example = example
        self._bound: Optional[Dict[str, Any]] = None

    def trace(self, root: Any, concrete_args: Optional[Dict[str, Any]] = None) -> fx.Graph:
        self._bound = None
        try:
            with _recorded_factories(self):
                graph = super().trace(root, concrete_args)  # type: ignore[misc]
        finally:
            # Note: [fake casts left in autocast's cache]
            # Inside an autocast region, autocast caches each parameter's cast (a bf16 copy of a
            # float32 weight) until the region ends. The fake run of a traced operator casts the
            # real parameter under the fake mode, and the cache keeps that fake copy: every real
            # call later in the region then reads it, and a convolution of a real input returned
            # a FakeTensor (a variant captured for an autocast call, on its first call). The
            # cache is emptied once the trace is done: the real calls cast again.
            torch.clear_autocast_cache()
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        for node in placeholders:  # code run without the Python guard (TorchScript) checks the shapes itself
            value = node.meta.get(VALUE)
            if isinstance(value, Tensor):
                with graph.inserting_after(placeholders[-1]):
                    graph.call_function(assert_traced_shape, (node, list(value.shape)))
        for node in graph.nodes:  # the fake values served the trace only; dtypes and ranks stay (bn/norm_casts.py,
            value = node.meta.pop(VALUE, None)  # graph/noop_casts.py, graph/absolute_dims.py)
            if isinstance(value, Tensor):
                node.meta[DTYPE] = value.dtype
                node.meta[RANK] = value.dim()
        return graph

    def proxy(self, node: fx.Node) -> fx.Proxy:
        base = super().proxy(node)  # type: ignore[misc]
        return _shaped_class(type(base))(node, self)

    def _fake(self, value: Any) -> Any:
        return pytree.tree_map(lambda t: self._fake_mode.from_tensor(t) if isinstance(t, Tensor) else t, value)

    def _placeholder(self, target: str) -> Any:
        if self._bound is None:
            args, kwargs = self._example
            sig = inspect.signature(type(self.root).forward)  # type: ignore[attr-defined]
            bound = sig.bind(self.root, *args, **kwargs)  # type: ignore[attr-defined]
            bound.apply_defaults()
            self._bound = dict(bound.arguments)
        name = target.lstrip("*")
        base, _, k = name.rpartition("_")
        if name not in self._bound and isinstance(self._bound.get(base), tuple) and k.isdigit() and self._star(base):
            return self._fake(self._bound[base][int(k)])  # an item of *args traced as its own input
        if name not in self._bound and base in self._bound:  # a concrete argument: name_1
            name = base
        if name not in self._bound:
            raise _Unknown(target)
        return self._fake(self._bound[name])

    def _star(self, name: str) -> bool:
        """Whether ``name`` is the traced module's ``*args``."""
        param = inspect.signature(type(self.root).forward).parameters.get(name)  # type: ignore[attr-defined]
        return param is not None and param.kind == param.VAR_POSITIONAL

    def _attr(self, node: fx.Node) -> Any:
        obj: Any = self.root  # type: ignore[attr-defined]
        with _untraced():  # torch.fx's module attribute patch would record a proxy per read
            for part in str(node.target).split("."):
                obj = getattr(obj, part)
        return self._fake(obj)

    def _value(self, node: Any) -> Any:
        """The fake value of an argument: a constant ``torch.fx`` made an attribute of the root (a
        tensor created in ``forward``: a ``get_attr`` node not made through :meth:`create_proxy`)
        read now."""
        if isinstance(node, fx.Node) and VALUE not in node.meta and node.op == "get_attr":
            node.meta[VALUE] = self._attr(node)
        return _value(node)

    def _run(self, node: fx.Node) -> Any:
        if node.op == "placeholder":
            return self._placeholder(str(node.target))
        if node.op == "get_attr":
            return self._attr(node)
        args = fx.node.map_aggregate(node.args, self._value)
        kwargs = fx.node.map_aggregate(node.kwargs, self._value)
        with _untraced(), torch.no_grad(), fake_errors_quiet(), self._fake_mode:
            if node.op == "call_function":
                return node.target(*args, **kwargs)  # type: ignore[operator]
            if node.op == "call_method":
                return getattr(args[0], str(node.target))(*args[1:], **kwargs)
            if node.op == "call_module":
                module = self.root.get_submodule(str(node.target))  # type: ignore[attr-defined]
                if isinstance(module, _BatchNorm) and len(args) == 1 and not kwargs:
                    return args[0]  # same shape; its update of num_batches_tracked not run twice
                from .graph_module import installed

                rewritten = installed(module)  # converted already (a leaf converted on its own): its own code
                return (rewritten.original if rewritten is not None else module.forward)(*args, **kwargs)
        raise _Unknown(node.op)

    def create_proxy(self, kind: str, target: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], *rest: Any,
                     **more: Any) -> fx.Proxy:
        proxy = super().create_proxy(kind, target, args, kwargs, *rest, **more)  # type: ignore[misc]
        try:
            proxy.node.meta[VALUE] = self._run(proxy.node)
        except Exception:  # noqa: BLE001 - no value known: shape questions on it fail as in torch.fx
            pass
        return proxy


_SHAPED: Dict[type, type] = {}

# Note: [dtype questions answered by the capture]
# Hand-written norms pick their eps by the input's dtype (``eps = 1e-5 if x.dtype == torch.float32
# else 1e-3``: dalle2, imagen, med-seg-diff, x-unet); code asks ``x.device``, ``x.is_floating_point()``
# too. A symbolic trace cannot answer (control flow on a traced value) and keeps such a module
# opaque; a trace with real inputs answers from the fake value of the traced tensor, which has the
# dtype eager computes there (autocast included: a convolution's output under bf16 autocast is
# bf16), so the branch eager takes is the graph's and its eps a constant of it. The answer holds
# for calls whose inputs have the traced dtypes and devices under the same autocast state: exactly
# what :class:`ShapeGuard` checks (the full device, ``cuda:1`` is not ``cuda:0``); another call
# (a float64 input, a bf16 autocast region) runs a variant captured for it, which answers again
# (``convert/variants.py``), and the report names that variant's dtypes and autocast
# (:meth:`ShapeGuard.describe`). Parameters' dtypes are not in the guard: a model cast with
# ``.double()`` after convert whose forward casts float32 inputs to its weights' dtype itself keeps
# the float32 answer (not handled; a model fed inputs of its own dtype fails the guard as it should).
# ``requires_grad`` is never answered: the fake values are computed without autograd.

#: what a traced value answers from its fake value (Note: [dtype questions answered by the capture])
_ANSWERED = ("shape", "ndim", "size", "dim", "dtype", "device", "is_floating_point", "is_complex", "is_cuda")


def _shaped_class(base: type) -> type:
    if base not in _SHAPED:
        def __getattr__(self: fx.Proxy, k: str) -> Any:
            value = self.node.meta.get(VALUE)
            if isinstance(value, Tensor) and k in _ANSWERED:
                return getattr(value, k)
            return base.__getattr__(self, k)  # type: ignore[attr-defined]

        def __len__(self: fx.Proxy) -> int:
            value = self.node.meta.get(VALUE)
            if isinstance(value, Tensor) and value.dim():
                return len(value)
            return base.__len__(self)  # type: ignore[attr-defined]

        _SHAPED[base] = type(f"Shaped{base.__name__}", (base,), {"__getattr__": __getattr__, "__len__": __len__})
    return _SHAPED[base]
