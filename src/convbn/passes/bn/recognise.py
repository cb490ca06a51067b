"""Recognising the batch-norm computation in BatchNorm-like modules written any way.

Model zoos normalise in more ways than ``nn.BatchNorm2d`` leaves. This file decides, for
one module, whether it computes a standard batch norm (and what else), so that
:func:`convbn.convert` and :func:`convbn.fold` can treat it as one:

* :func:`recognise_norm_act` -- a ``_BatchNorm`` subclass with its own ``forward`` (norm-act
  layers: shape checks, ``num_batches_tracked`` / momentum bookkeeping, ``F.batch_norm``
  on its own tensors, then ``self.drop(x)``, ``self.act(x)``; or ``super().forward(x)``
  followed by a tail). Returns a :class:`NormActBody`: the tail to replay after the
  standard batch norm, or a reason it cannot be treated as one.
* Frozen BatchNorms (modules holding only buffers): :mod:`convbn.passes.bn.frozen`.

Note: [recognising a norm-act forward]
The subclass's ``forward`` is traced on its own, once per mode (``torch.fx`` bakes
``self.training`` into the graph), with every child a leaf and its buffers as graph
values, so its bookkeeping is recorded instead of run. ``super().forward(x)`` (a torch
BatchNorm forward, which cannot be traced: it branches on the input's rank) is recorded
as one standard batch norm. A direct ``F.batch_norm`` call must read the module's own
running statistics, weight, bias and eps, and pass the training flag and momentum that
``_BatchNorm.forward`` passes in that mode; in training with running statistics, the
graph must advance ``num_batches_tracked`` by ``add_(1)`` exactly once, and with
``momentum=None`` the momentum must be ``1 / float(num_batches_tracked)`` read after the
increment: ``float()`` of the traced counter returns a sentinel value ``S``, so only that
computation passes the exact value ``1 / S``. The input may be read otherwise only for its
shape (``x.ndim`` and ``torch._assert`` on it). What follows the batch norm (the *tail*)
must be the same graph in both modes; it is replayed after the standard computation, so
children such as a Dropout keep reading their own mode at call time.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple, Union

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from ...functional.norms import row_of_last_dim_module, row_of_module

from ...nn.standard_bn import has_standard_bn_forward
from ..graph.layers import normalize_args
from ..graph.thread_patch import fx_patches_scoped, scoped_attr, static_attr
from ..graph.hooks import hook_reason
from ..graph.shape_uses import is_shape_use

__all__ = ["may_normalise", "NormActBody", "recognise_norm_act", "BN_FUNCTIONS", "bn_call_args", "trace_body",
           "node_deps", "ancestors", "body_signature"]

#: ``F.batch_norm`` / ``torch.batch_norm`` argument names in positional order, with defaults.
BN_FUNCTIONS: Dict[Callable[..., Any], Tuple[Tuple[str, Any], ...]] = {
    F.batch_norm: (("input", None), ("running_mean", None), ("running_var", None), ("weight", None),
                   ("bias", None), ("training", False), ("momentum", 0.1), ("eps", 1e-5)),
    torch.batch_norm: (("input", None), ("weight", None), ("bias", None), ("running_mean", None),
                       ("running_var", None), ("training", None), ("momentum", None), ("eps", None),
                       ("cudnn_enabled", None)),
}

_TENSORS = ("weight", "bias", "running_mean", "running_var")
_SENTINEL = float(2 ** 43 + 12345)  # what float(num_batches_tracked) returns while tracing a body


def may_normalise(module: nn.Module) -> bool:
    """Whether ``module`` or a submodule may compute a batch norm or a per-sample norm: a
    ``_BatchNorm``, a module holding a ``running_mean`` / ``running_var`` tensor (frozen
    BatchNorms, ``F.batch_norm`` on a module's own tensors), a module of a
    :data:`~convbn.functional.norms.NORMS` row, an ``nn.LayerNorm`` / ``nn.RMSNorm`` (a row's
    ``last_dim``: a channel norm between permutes), or a module with its own forward holding
    its own parameters (``F.group_norm`` / ``F.layer_norm`` on them). A cheap test: modules with
    none of these need no tracing."""
    return any(isinstance(m, _BatchNorm) or isinstance(m._buffers.get("running_mean"), Tensor)
               or isinstance(m._buffers.get("running_var"), Tensor) or row_of_module(m) is not None
               or row_of_last_dim_module(m) is not None
               or (bool(m._parameters) and type(m).forward is not nn.Module.forward
                   and type(m).__module__.split(".")[0] != "torch")
               for m in module.modules())


def bn_call_args(node: fx.Node) -> Optional[Dict[str, Any]]:
    """The arguments of an ``F.batch_norm`` / ``torch.batch_norm`` node by name, or ``None``."""
    sig = BN_FUNCTIONS.get(node.target) if node.op == "call_function" else None  # type: ignore[arg-type]
    return None if sig is None else normalize_args(node, sig)


def _self_batch_norm(input: Tensor) -> Tensor:  # pragma: no cover - only ever a graph target
    """Graph marker: the traced module's own standard batch norm of ``input``."""
    raise RuntimeError("_self_batch_norm is a tracing marker and never runs")


@dataclass
class NormActBody:
    """What a norm-act module computes, as recognised.

    Attributes:
        graph: its forward traced in eval mode; ``bn_node`` marks the batch norm.
        bn_node: the node of the standard batch norm (replaced by the caller's own).
        skip: nodes the caller must not replay (the batch norm's tensor reads).
        bn_input: the node the batch norm normalises when ``bn_node`` is not a call on it
            (a frozen BatchNorm's last affine op); ``None``: ``bn_node.args[0]``.
        ranks: input ranks the batch norm holds on (frozen BatchNorms); ``()``: any.
        eps: a frozen BatchNorm's eps, as recognised (its attribute, or read off what it
            computes); ``None`` otherwise.
        reason: why the module is not a standard batch norm plus a tail (``graph`` unusable).
    """

    graph: Optional[fx.Graph] = None
    bn_node: Optional[fx.Node] = None
    skip: Tuple[fx.Node, ...] = ()
    reason: Optional[str] = None
    bn_input: Optional[fx.Node] = None
    ranks: Tuple[int, ...] = ()
    eps: Optional[float] = None

    def replay(self, module: nn.Module, x: Any, batch_norm: Callable[[Any], Any]) -> Any:
        """Run the body on ``x`` with ``batch_norm(input)`` in place of the batch norm and
        ``module``'s own children and attributes (called, so an enclosing tracer records them)."""
        assert self.graph is not None and self.bn_node is not None
        env: Dict[fx.Node, Any] = {}
        load = lambda a: fx.node.map_arg(a, lambda n: env[n])  # noqa: E731
        for n in self.graph.nodes:
            if n in self.skip:
                continue
            if n.op == "placeholder":
                env[n] = x
            elif n is self.bn_node:
                env[n] = batch_norm(load(n.args[0] if self.bn_input is None else self.bn_input))
            elif n.op == "get_attr":
                obj: Any = module
                for atom in str(n.target).split("."):
                    obj = getattr(obj, atom)
                env[n] = obj
            elif n.op == "call_module" and _is_plain_identity(module.get_submodule(str(n.target))):
                env[n] = load(n.args[0])  # a hook-free nn.Identity computes nothing
            elif n.op == "call_module":
                env[n] = module.get_submodule(str(n.target))(*load(n.args), **load(n.kwargs))
            elif n.op == "call_function":
                env[n] = n.target(*load(n.args), **load(n.kwargs))  # type: ignore[operator]
            elif n.op == "call_method":
                self_obj, *rest = load(n.args)
                env[n] = getattr(self_obj, str(n.target))(*rest, **load(n.kwargs))
            elif n.op == "output":
                return load(n.args[0])
        raise RuntimeError("traced body has no output")  # pragma: no cover


def _is_plain_identity(m: nn.Module) -> bool:
    return type(m) is nn.Identity and hook_reason(m) is None


class _BodyProxy(fx.Proxy):
    """A proxy whose ``float()`` is allowed on the traced ``num_batches_tracked`` only."""

    def __float__(self) -> float:
        tracer = self.tracer
        assert isinstance(tracer, _BodyTracer)
        if not (self.node.op == "get_attr" and self.node.target == "num_batches_tracked") and not (
                self.node.op == "call_method" and self.node.target == "add_"
                and getattr(self.node.args[0], "target", None) == "num_batches_tracked"):
            raise TypeError("float() of a traced value other than num_batches_tracked")
        tracer.floats.append(len(tracer.graph.nodes))
        return _SENTINEL


class _BodyTracer(fx.Tracer):
    """Traces one BatchNorm module's forward: children are leaves, buffers graph values."""

    proxy_buffer_attributes = True

    def __init__(self) -> None:
        super().__init__()
        self.floats: List[int] = []  # number of graph nodes when float(num_batches_tracked) was taken

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _BodyProxy(node, self)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return True


def trace_body(module: nn.Module, training: bool) -> Tuple[Optional[fx.Graph], List[int], str]:
    flags = [(m, m.training) for m in module.modules()]
    tracer = _BodyTracer()
    originals = {cls: static_attr(cls, "forward") for cls in (_BatchNorm, nn.SyncBatchNorm)}

    def marker(original: Callable[..., Any]) -> Callable[..., Any]:
        def forward(self: nn.Module, input: Any) -> Any:
            if self is module:  # super().forward(x): the standard computation, as one node
                return tracer.create_proxy("call_function", _self_batch_norm, (input,), {})
            return original(self, input)
        return forward

    try:
        module.train(training)
        # Note: [tracing patches are the tracing thread's]
        with fx_patches_scoped(), contextlib.ExitStack() as patches:
            for cls, fn in originals.items():
                patches.enter_context(scoped_attr(cls, "forward", marker(fn)))
            graph = tracer.trace(module)
    except Exception as exc:  # noqa: BLE001 - an untraceable forward is a reason, not an error
        text = str(exc).strip().splitlines()
        return None, [], f"{type(exc).__name__}: {text[0] if text else ''}"[:160]
    finally:
        for m, t in flags:
            m.training = t
    return graph, tracer.floats, ""


def node_deps(graph: fx.Graph, start: fx.Node) -> Set[fx.Node]:
    """Nodes depending on ``start``'s *values* (shape-only reads excluded)."""
    dep = {start}
    for n in graph.nodes:
        if n in dep:
            continue
        for a in n.all_input_nodes:
            if a in dep and not is_shape_use(n, a):
                dep.add(n)
                break
    return dep


def _expected_momentum(module: _BatchNorm, training: bool) -> Optional[float]:
    """The momentum ``_BatchNorm.forward`` passes when it matters (batch statistics with running
    ones to update), ``1 / S`` standing for the cumulative average; ``None``: does not matter."""
    if not (training and module.track_running_stats and module.running_mean is not None):
        return None
    if module.momentum is None:
        return 1.0 / _SENTINEL if module.num_batches_tracked is not None else 0.0
    return float(module.momentum)


def _check_mode(module: _BatchNorm, training: bool) -> Union[Tuple[fx.Graph, fx.Node, Tuple[fx.Node, ...]], str]:
    """The body's graph, batch-norm node and skipped nodes in one mode, or why it is not standard."""
    mode = "training" if training else "eval"
    graph, floats, error = trace_body(module, training)
    if graph is None:
        return f"its forward could not be traced in {mode} mode ({error})"
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) != 1:
        return f"its forward takes {len(placeholders)} inputs"
    x = placeholders[0]
    bns = [n for n in graph.nodes if n.op == "call_function" and (n.target is _self_batch_norm or n.target in BN_FUNCTIONS)]
    if len(bns) != 1:
        return f"its forward in {mode} mode makes {len(bns)} batch_norm calls (expected one)"
    bn = bns[0]
    attrs = {str(n.target): n for n in graph.nodes if n.op == "get_attr"}
    if bn.target in BN_FUNCTIONS:
        skip = _check_bn_function(module, training, graph, bn, x, attrs, floats)
        if isinstance(skip, str):
            return skip
    else:
        if bn.args[0] is not x or len(bn.args) != 1:
            return "its standard BatchNorm forward is not applied to the module's input"
        for name in _TENSORS + ("num_batches_tracked",):
            if name in attrs:
                return f"its forward reads self.{name} besides the standard BatchNorm forward"
        skip = []
    why = _check_input_uses(graph, x, bn)
    return why if why is not None else (graph, bn, tuple(skip))


def _check_bn_function(module: _BatchNorm, training: bool, graph: fx.Graph, bn: fx.Node, x: fx.Node,
                       attrs: Dict[str, fx.Node], floats: List[int]) -> Union[List[fx.Node], str]:
    """A direct ``F.batch_norm`` call in one mode: the nodes to skip when replaying, or why it
    does not compute what ``_BatchNorm.forward`` would (Note: [recognising a norm-act forward])."""
    mode = "training" if training else "eval"
    args = bn_call_args(bn)
    if args is None:
        return "its batch_norm call has arguments this pass does not understand"
    if args["input"] is not x:
        return "its batch_norm does not normalise the module's input directly"
    why = _check_bn_arguments(module, training, args)
    if why is not None:
        return why
    counts = training and module.track_running_stats and module.num_batches_tracked is not None
    nbt = attrs.get("num_batches_tracked")
    incs = [u for u in (nbt.users if nbt is not None else ()) if u.op == "call_method" and u.target == "add_"
            and list(u.args[1:]) == [1] and not u.kwargs and not u.users]
    if nbt is not None and len(incs) != len(nbt.users):
        return "its forward uses num_batches_tracked other than by num_batches_tracked.add_(1)"
    if len(incs) != (1 if counts else 0):
        return (f"its forward in {mode} mode advances num_batches_tracked {len(incs)} times; "
                f"nn.BatchNorm advances it {1 if counts else 0} times")
    if module.momentum is None and counts:
        order = list(graph.nodes)
        if not floats or order.index(incs[0]) >= floats[-1]:
            return "its cumulative-average momentum is not read after num_batches_tracked is advanced"
    skip: List[fx.Node] = incs + ([nbt] if nbt is not None else [])
    for name in _TENSORS:
        node = attrs.get(name)
        if node is not None:
            if set(node.users) - {bn}:
                return f"its forward uses self.{name} other than in the batch_norm call"
            skip.append(node)
    return skip


def _check_bn_arguments(module: _BatchNorm, training: bool, args: Dict[str, Any]) -> Optional[str]:
    """Why a traced ``F.batch_norm`` call's tensors, training flag, eps or momentum are not what
    ``_BatchNorm.forward`` passes in that mode, or ``None``."""
    mode = "training" if training else "eval"
    passes_stats = not training or module.track_running_stats
    for name in _TENSORS:
        own = getattr(module, name)
        expect = own is not None and (passes_stats or name in ("weight", "bias"))
        got = args[name]
        ok = (got is None) if not expect else (isinstance(got, fx.Node) and got.op == "get_attr" and got.target == name)
        if not ok:
            return (f"its batch_norm call in {mode} mode does not pass the module's own {name} "
                    "the way nn.BatchNorm does")
    bn_training = training or (module.running_mean is None and module.running_var is None)
    if args["training"] is not bn_training:
        return (f"its batch_norm call in {mode} mode passes training={args['training']!r}, "
                f"nn.BatchNorm would pass {bn_training}")
    if not isinstance(args["eps"], float) or args["eps"] != float(module.eps):
        return f"its batch_norm call passes eps={args['eps']!r}, not the module's eps={module.eps}"
    want = _expected_momentum(module, training)
    if want is not None and (not isinstance(args["momentum"], (int, float)) or float(args["momentum"]) != want):
        what = "1 / num_batches_tracked (cumulative average)" if module.momentum is None else module.momentum
        return f"its batch_norm call in {mode} mode passes momentum={args['momentum']!r}, not {what}"
    return None


def _check_input_uses(graph: fx.Graph, x: fx.Node, bn: fx.Node) -> Optional[str]:
    """Why the body uses its input other than through the batch norm, or its output does not
    depend on the batch norm; ``None``: neither."""
    deps = node_deps(graph, x)
    pre = [n for n in deps if n is not x and n is not bn and bn not in ancestors(n)]
    if pre:
        return f"its forward uses its input other than through the batch norm (at '{pre[0].name}')"
    for n in graph.nodes:  # mutating the input in place (x.add_(...)) would be a pre-use too
        if n.op == "call_method" and str(n.target).endswith("_") and n.args and n.args[0] is x:
            return f"its forward modifies its input in place ({n.target})"
    out = next(n for n in graph.nodes if n.op == "output")
    if out.args[0] is not bn and bn not in ancestors(out):
        return "its output does not depend on the batch norm"
    return None


def ancestors(node: fx.Node) -> Set[fx.Node]:
    seen: Set[fx.Node] = set()
    todo = list(node.all_input_nodes)
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo += n.all_input_nodes
    return seen


def body_signature(graph: fx.Graph, bn: fx.Node, skip: Sequence[fx.Node]) -> List[Tuple[Any, ...]]:
    """The body without its batch norm and bookkeeping, with node references as positions."""
    kept = [n for n in graph.nodes if n not in skip]
    index = {n: i for i, n in enumerate(kept)}
    ref = lambda a: fx.node.map_arg(a, lambda n: ("node", index.get(n, -1)))  # noqa: E731
    return [(n.op, "bn" if n is bn else n.target, () if n is bn else ref(n.args), () if n is bn else ref(n.kwargs))
            for n in kept]


def recognise_norm_act(module: nn.Module) -> NormActBody:
    """Whether ``module``, a ``_BatchNorm`` with its own ``forward``, computes the standard
    batch norm followed by a mode-independent tail; see Note: [recognising a norm-act forward].

    Args:
        module: a ``_BatchNorm`` subclass instance whose class overrides ``forward``.

    Returns:
        A :class:`NormActBody` with the eval-mode graph to replay, or with ``reason`` set.

    Example:
        >>> body = recognise_norm_act(timm_like_bn_act)
        >>> body.reason is None
        True
    """
    if not isinstance(module, _BatchNorm):
        return NormActBody(reason=f"{type(module).__name__} is not a BatchNorm")
    if has_standard_bn_forward(module):
        return NormActBody(reason=f"{type(module).__name__} has the standard forward")
    why = hook_reason(module)
    if why is not None:
        return NormActBody(reason=f"it has hooks ({why})")
    if isinstance(module.running_mean, nn.parameter.UninitializedTensorMixin) or (
            module.running_mean is not None and module.running_mean.is_meta):
        return NormActBody(reason="its buffers are not initialised (lazy or on the meta device)")
    found = {}
    for training in (True, False):
        got = _check_mode(module, training)
        if isinstance(got, str):
            return NormActBody(reason=f"{type(module).__name__}: {got}")
        found[training] = got
    sigs = [body_signature(*found[t]) for t in (True, False)]
    if sigs[0] != sigs[1]:
        return NormActBody(reason=(f"{type(module).__name__}: what its forward computes besides the batch norm "
                                   "differs between training and eval mode"))
    graph, bn, skip = found[False]
    return NormActBody(graph, bn, skip)
