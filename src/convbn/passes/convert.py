"""``convbn.convert``: one call turns a CNN into a memory-lean training model.

The pass traces the model with ``torch.fx``, finds every Conv -> BatchNorm (-> activation)
in the data flow, groups consecutive ones into chains, and replaces each chain by a
:class:`convbn.nn.chain.FusedChain` call. The model's own modules stay registered
where they were (the chains only reference them), so parameters, buffers and
``state_dict()`` are the very same objects and keys.
"""
from __future__ import annotations

import copy
import math
import operator
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, TypeVar, Union

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.conv import _ConvNd

from ..functional.activations import Activation, activation_from_module
from ..functional.conv import ConvSpec, conv_spec_from_module, make_conv_spec
from ..memory import saved_bytes, timeline
from ..nn.chain import ChainLayer, FusedChain
from ..nn.fused import _FusedConvBNNd
from ..nn.sync import SyncBatchNorm
from .planner import ChainCost, plan_for_peak, plan_layers, step_peak, tutorial_bytes
from .report import ConvertReport, FusedPair, SkippedBN
from .shape_uses import is_shape_use, value_users
from .graph_module import ConvbnGraphModule, preserve_module_state
from .hooks import hook_reason
from .trace import short_reason, trace
from .validate import StateSnapshot, compare_outputs, run_step

__all__ = ["convert", "explain", "CONVERT_STRATEGIES"]

M = TypeVar("M", bound=nn.Module)

#: Strategies :func:`convert` accepts.
CONVERT_STRATEGIES = ("auto", "recompute_bn", "recompute_conv")

_STD_CONV_FORWARDS = {nn.Conv1d.forward, nn.Conv2d.forward, nn.Conv3d.forward}
_FUNCTIONAL_CONVS = {F.conv1d: 1, F.conv2d: 2, F.conv3d: 3, torch.conv1d: 1, torch.conv2d: 2, torch.conv3d: 3}
_BN_DIMS = {nn.BatchNorm1d: (1,), nn.BatchNorm2d: (2,), nn.BatchNorm3d: (3,)}


class _Tracer(fx.Tracer):
    """Keeps convolutions (with the standard forward), BatchNorms and convbn's own
    modules as leaves; traces through everything else, including conv subclasses
    with their own forward (their ``F.convNd`` call is matched instead)."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if isinstance(m, (_BatchNorm, FusedChain, _FusedConvBNNd)):
            return True
        if isinstance(m, _ConvNd):
            return type(m).forward in _STD_CONV_FORWARDS or m.transposed and m.__module__.startswith("torch.nn")
        return super().is_leaf_module(m, qualname)


# --------------------------------------------------------------------------- matching


@dataclass
class _Conv:
    node: fx.Node
    input: fx.Node
    owner: nn.Module
    weight_name: str
    bias_name: Optional[str]
    spec: ConvSpec
    name: str
    absorbed: Tuple[fx.Node, ...] = ()  # zero-padding nodes folded into ``spec``


@dataclass
class _Layer:
    conv: _Conv
    bn_node: fx.Node
    bn: _BatchNorm
    bn_name: str
    act: Activation
    act_node: Optional[fx.Node]
    act_extra: Tuple[fx.Node, ...] = ()  # e.g. the sigmoid of x * sigmoid(x)
    shape_uses: Tuple[fx.Node, ...] = ()  # x.shape / x.ndim / x.size() of the conv or BN output

    @property
    def out(self) -> fx.Node:
        return self.act_node if self.act_node is not None else self.bn_node


def _arg(node: fx.Node, i: int, name: str, default: Any) -> Any:
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


_ZERO_PADS = (nn.ZeroPad1d, nn.ZeroPad2d, nn.ZeroPad3d, nn.ConstantPad1d, nn.ConstantPad2d, nn.ConstantPad3d)


def _zero_pad_of(node: fx.Node, gm: fx.GraphModule) -> Optional[Tuple[int, ...]]:
    """``F.pad``-style amounts if ``node`` only zero-pads its input (``()`` for an Identity)."""
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        if type(mod) is nn.Identity:
            return ()
        if isinstance(mod, _ZERO_PADS) and float(getattr(mod, "value", 0.0)) == 0.0:
            return tuple(int(p) for p in mod.padding)
        return None
    if node.op == "call_function" and node.target is F.pad:
        pad, mode, value = _arg(node, 1, "pad", None), _arg(node, 2, "mode", "constant"), _arg(node, 3, "value", None)
        if mode == "constant" and not value and isinstance(pad, (list, tuple)) and all(isinstance(p, int) for p in pad):
            return tuple(pad)
    return None


def _absorb_zero_pad(conv: _Conv, gm: fx.GraphModule) -> _Conv:
    """Fold a zero-padding op that only feeds this conv into its spec (exact: zeros are zeros)."""
    inp = conv.input
    if conv.spec.pre_pad or len(inp.users) != 1:
        return conv
    pads = _zero_pad_of(inp, gm)
    src = _arg(inp, 0, "input", None)
    if pads is None or not isinstance(src, fx.Node) or len(pads) > 2 * conv.spec.dims or any(p < 0 for p in pads):
        return conv
    pads = tuple(pads) + (0,) * (2 * conv.spec.dims - len(pads))
    padding, pre = [], []
    for i in range(conv.spec.dims):  # natural order; F.pad lists the last dim first
        j = conv.spec.dims - 1 - i
        left, right = conv.spec.padding[i] + pads[2 * j], conv.spec.padding[i] + pads[2 * j + 1]
        padding.append(min(left, right))
    for j in range(conv.spec.dims):
        i = conv.spec.dims - 1 - j
        pre += [conv.spec.padding[i] + pads[2 * j] - padding[i], conv.spec.padding[i] + pads[2 * j + 1] - padding[i]]
    spec = ConvSpec(conv.spec.dims, conv.spec.stride, tuple(padding), conv.spec.dilation, conv.spec.groups,
                    tuple(pre) if any(pre) else (), "constant")
    return _Conv(conv.node, src, conv.owner, conv.weight_name, conv.bias_name, spec, conv.name,
                 conv.absorbed + (inp,))


def _match_conv(node: fx.Node, gm: fx.GraphModule, root: nn.Module) -> Union[_Conv, str, None]:
    """A conv node as :class:`_Conv`, a string reason why it cannot be fused, or ``None``.

    Weight owners are looked up on ``root``, the user's module: the traced GraphModule
    holds stand-in containers for ``get_attr`` targets, which later re-assignments of
    the real modules' parameters (``load_state_dict(assign=True)``) would not reach.
    """
    found = _match_conv_node(node, gm, root)
    if isinstance(found, _Conv) and found.spec.pre_pad_mode == "constant":
        found = _absorb_zero_pad(found, gm)
    return found


def _match_conv_node(node: fx.Node, gm: fx.GraphModule, root: nn.Module) -> Union[_Conv, str, None]:
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        if not isinstance(mod, _ConvNd):
            return None
        if mod.transposed:
            return f"its input is a transposed convolution ({node.target}), not fused for training"
        if type(mod).forward not in _STD_CONV_FORWARDS:
            return f"its input comes from {type(mod).__name__}, a convolution with a custom forward"
        inp = _arg(node, 0, "input", None)
        if not isinstance(inp, fx.Node):
            return "the convolution's input is not a traced tensor"
        return _Conv(node, inp, mod, "weight", "bias" if mod.bias is not None else None,
                     conv_spec_from_module(mod), str(node.target))
    if node.op == "call_function" and node.target in _FUNCTIONAL_CONVS:
        dims = _FUNCTIONAL_CONVS[node.target]  # type: ignore[index]
        inp, w, b = _arg(node, 0, "input", None), _arg(node, 1, "weight", None), _arg(node, 2, "bias", None)
        if not isinstance(w, fx.Node) or w.op != "get_attr":
            return "the functional convolution's weight is not a module parameter"
        if b is not None and (not isinstance(b, fx.Node) or b.op != "get_attr"):
            return "the functional convolution's bias is not a module parameter"
        geo = [_arg(node, i, n, d) for i, n, d in ((3, "stride", 1), (4, "padding", 0), (5, "dilation", 1), (6, "groups", 1))]
        if any(isinstance(a, fx.Node) for a in geo) or not isinstance(inp, fx.Node):
            return "the functional convolution's arguments are not constants"
        wpath, _, wname = str(w.target).rpartition(".")
        owner = root.get_submodule(wpath) if wpath else root
        bname = None
        if b is not None:
            bpath, _, bname = str(b.target).rpartition(".")
            if bpath != wpath:
                return "the functional convolution's weight and bias live in different modules"
        weight = getattr(owner, wname)
        spec = make_conv_spec(dims, weight.shape[2:], *geo)
        return _Conv(node, inp, owner, wname, bname, spec, wpath or str(w.target))
    return None


_ACT_FUNCS: Dict[Any, Callable[[fx.Node], Optional[Activation]]] = {
    torch.relu: lambda n: Activation("relu"),
    torch.relu_: lambda n: Activation("relu"),
    F.relu: lambda n: Activation("relu"),
    F.relu_: lambda n: Activation("relu"),
    F.relu6: lambda n: Activation("relu6"),
    F.leaky_relu: lambda n: Activation("leaky_relu", negative_slope=float(_arg(n, 1, "negative_slope", 0.01))),
    F.silu: lambda n: Activation("silu"),
    F.gelu: lambda n: Activation("gelu", approximate=str(_arg(n, 1, "approximate", "none"))),
    F.hardswish: lambda n: Activation("hardswish"),
    F.hardtanh: lambda n: Activation("relu6") if (_arg(n, 1, "min_val", -1.0), _arg(n, 2, "max_val", 1.0)) == (0.0, 6.0) else None,
    F.hardsigmoid: lambda n: Activation("hardsigmoid"),
    F.elu: lambda n: Activation("elu", alpha=float(_arg(n, 1, "alpha", 1.0))),
    F.celu: lambda n: Activation("celu", alpha=float(_arg(n, 1, "alpha", 1.0))),
    F.selu: lambda n: Activation("selu"),
    F.mish: lambda n: Activation("mish"),
    F.softplus: lambda n: Activation("softplus", beta=float(_arg(n, 1, "beta", 1.0)),
                                     threshold=float(_arg(n, 2, "threshold", 20.0))),
    torch.sigmoid: lambda n: Activation("sigmoid"),
    torch.sigmoid_: lambda n: Activation("sigmoid"),
    F.sigmoid: lambda n: Activation("sigmoid"),
    torch.tanh: lambda n: Activation("tanh"),
    torch.tanh_: lambda n: Activation("tanh"),
    F.tanh: lambda n: Activation("tanh"),
}
_ACT_METHODS = {"relu": "relu", "relu_": "relu", "sigmoid": "sigmoid", "sigmoid_": "sigmoid",
                "tanh": "tanh", "tanh_": "tanh"}


def _match_act(node: fx.Node, src: fx.Node, gm: fx.GraphModule) -> Optional[Activation]:
    if _arg(node, 0, "input", None) is not src:
        return None
    if node.op == "call_module":
        act = activation_from_module(gm.get_submodule(str(node.target)))
        return None if act is None or act.is_identity else act
    if node.op == "call_function" and node.target in _ACT_FUNCS:
        if any(isinstance(a, fx.Node) for a in list(node.args[1:]) + list(node.kwargs.values())):
            return None
        return _ACT_FUNCS[node.target](node)
    if node.op == "call_method" and node.target in _ACT_METHODS:
        return Activation(_ACT_METHODS[str(node.target)])
    return None


_SIGMOIDS = {torch.sigmoid, F.sigmoid}
_MULS = {operator.mul, torch.mul}


def _match_swish(node: fx.Node) -> Optional[Tuple[fx.Node, fx.Node]]:
    """``(mul, sigmoid)`` if ``node``'s two users compute ``node * sigmoid(node)`` (SiLU / Swish)."""
    sig = next((u for u in node.users if (u.op == "call_function" and u.target in _SIGMOIDS)
                or (u.op == "call_method" and u.target == "sigmoid")), None)
    if sig is None or len(sig.users) != 1 or sig.kwargs or _arg(sig, 0, "input", None) is not node:
        return None
    mul = next(iter(sig.users))
    ok = (mul.op == "call_function" and mul.target in _MULS) or (mul.op == "call_method" and mul.target == "mul")
    if not ok or mul.kwargs or len(mul.args) != 2 or set(mul.args) != {node, sig} or mul not in node.users:
        return None
    return mul, sig


def _describe(node: fx.Node) -> str:
    if node.op == "placeholder":
        return f"the model input '{node.name}'"
    if node.op == "call_module":
        return f"module '{node.target}'"
    if node.op == "call_function":
        return f"function {getattr(node.target, '__name__', node.target)}"
    return f"{node.op} {node.target}"


def _find_layers(gm: fx.GraphModule, root: nn.Module, prefix: str, report: ConvertReport) -> List[_Layer]:
    graph = gm.graph
    bn_calls: Dict[str, int] = {}
    for node in graph.nodes:
        if node.op == "call_module" and isinstance(gm.get_submodule(str(node.target)), _BatchNorm):
            bn_calls[str(node.target)] = bn_calls.get(str(node.target), 0) + 1
    layers: List[_Layer] = []
    for node in graph.nodes:
        if node.op != "call_module":
            continue
        bn = gm.get_submodule(str(node.target))
        if not isinstance(bn, _BatchNorm):
            continue
        name = prefix + str(node.target)

        def skip(reason: str, conv: Optional[str] = None) -> None:
            report.skipped.append(SkippedBN(name, reason, conv))

        if type(bn).forward not in (_BatchNorm.forward, SyncBatchNorm.forward):
            skip(f"{type(bn).__name__} has its own forward (e.g. cross-process statistics); left as is")
            continue
        if bn_calls[str(node.target)] > 1:
            if not any(s.bn == name for s in report.skipped):  # one line per module, not per call
                skip(f"the BatchNorm module is called {bn_calls[str(node.target)]} times (shared running statistics)")
            continue
        if bn.running_mean is not None and bn.running_mean.is_meta:
            skip("the BatchNorm's buffers are on the meta device")
            continue
        src = _arg(node, 0, "input", None)
        if not isinstance(src, fx.Node):
            skip("its input is not a traced tensor")
            continue
        conv = _match_conv(src, gm, root)
        if conv is None:
            skip(f"its input is not a convolution output (it follows {_describe(src)})")
            continue
        if isinstance(conv, str):
            skip(conv)
            continue
        conv.name = prefix + conv.name
        if len(value_users(src)) != 1:
            others = ", ".join(_describe(u) for u in value_users(src) if u is not node)
            skip(f"the convolution's output is also used by {others}", conv.name)
            continue
        dims_ok = _BN_DIMS.get(type(bn))
        if dims_ok is not None and conv.spec.dims not in dims_ok:
            skip(f"{type(bn).__name__} after a {conv.spec.dims}-D convolution", conv.name)
            continue
        if bn.num_features != getattr(conv.owner, conv.weight_name).shape[0]:
            skip("BatchNorm num_features does not match the convolution's output channels", conv.name)
            continue
        act, act_node, act_extra = Activation("identity"), None, ()
        shape_uses = tuple(u for u in src.users if u is not node)
        bn_users = value_users(node)
        if len(bn_users) == 1:
            found = _match_act(bn_users[0], node, gm)
            if found is not None:
                act, act_node = found, bn_users[0]
        elif len(bn_users) == 2:
            swish = _match_swish(node)
            if swish is not None:
                act, act_node, act_extra = Activation("silu"), swish[0], (swish[1],)
        if act_node is not None:  # else the BN output stays the layer's output, its users re-pointed as a whole
            shape_uses += tuple(u for u in node.users if is_shape_use(u, node))
        layers.append(_Layer(conv, node, bn, name, act, act_node, act_extra, shape_uses))
    return layers


def _chains(layers: List[_Layer], chain: bool) -> List[List[_Layer]]:
    by_out = {l.out: l for l in layers}
    chains: List[List[_Layer]] = []
    where: Dict[int, List[_Layer]] = {}
    for l in layers:  # graph (topological) order
        prev = by_out.get(l.conv.input)
        # a layer whose inner tensors' shapes are read must end its chain: only the
        # chain's output exists to read them from (see Note: [shape-only uses] in shape_uses.py)
        if (chain and prev is not None and id(prev) in where and len(prev.out.users) == 1
                and not prev.shape_uses and l.conv.spec.pre_pad_mode == "constant"):
            c = where[id(prev)]
        else:
            c = []
            chains.append(c)
        c.append(l)
        where[id(l)] = c
    return chains


# --------------------------------------------------------------------------- rewriting


def _graph_module(root: nn.Module, traced: fx.GraphModule, extra: Sequence[Tuple[str, nn.Module]]) -> fx.GraphModule:
    """A GraphModule running ``traced.graph`` whose module tree is ``root``'s own (same
    objects, same order) plus ``extra``, so ``state_dict()`` keys and parameters are unchanged;
    ``root``'s plain attributes, hooks and ``_version`` come along (see
    :func:`convbn.passes.trace.preserve_module_state`)."""
    gm = ConvbnGraphModule(traced, traced.graph, class_name=type(root).__name__)
    gm._modules = OrderedDict(root._modules)
    for name, mod in extra:
        gm._modules[name] = mod
    # the very same dicts: a root-level parameter re-assigned on either model is the one
    # the chains read (they hold ``root`` as the owner of root-level weights)
    gm._parameters = root._parameters
    gm._buffers = root._buffers
    gm._non_persistent_buffers_set = set(root._non_persistent_buffers_set)
    gm.training = root.training
    preserve_module_state(root, gm)
    return gm


def _rewrite(root: nn.Module, gm: fx.GraphModule, chains: List[List[_Layer]], mode: str,
             report: ConvertReport) -> fx.GraphModule:
    graph = gm.graph
    built: List[Tuple[str, FusedChain]] = []
    base = len({p.chain for p in report.pairs})
    replaced: Dict[fx.Node, fx.Node] = {}
    for ci, chain in enumerate(chains):
        layers = []
        for pos, l in enumerate(chain):
            cl = ChainLayer(l.conv.owner, l.conv.weight_name, l.conv.bias_name, l.conv.spec, l.bn, l.act,
                            "recompute_bn" if mode == "auto" else mode,
                            (l.conv.name, l.bn_name, str(l.act)))
            layers.append(cl)
            report.pairs.append(FusedPair(l.conv.name, l.bn_name, str(l.act), base + ci, pos, cl))
        fused = FusedChain(layers)
        fused.auto_pending = mode == "auto"
        name = f"convbn_chain{ci}"
        while hasattr(root, name) or hasattr(gm, name):
            name += "_"
        built.append((name, fused))
        gm.add_module(name, fused)
        last = chain[-1].out
        # inserted where the chain's first conv ran: its only input is ``x0``, and shape
        # uses between the conv and the chain's output can then read the chain's output
        with graph.inserting_before(chain[0].conv.node):
            x0 = chain[0].conv.input
            new = graph.call_module(name, (replaced.get(x0, x0),))
        last.replace_all_uses_with(new)
        replaced[last] = new
        for l in chain:
            for u in l.shape_uses:
                for old in (l.conv.node, l.bn_node):
                    u.replace_input_with(old, new)
        for l in reversed(chain):
            for n in (l.act_node, *l.act_extra, l.bn_node, l.conv.node, *reversed(l.conv.absorbed)):
                if n is not None:
                    graph.erase_node(n)
    for node in list(graph.nodes):
        if node.op == "get_attr" and not node.users:
            graph.erase_node(node)
    graph.lint()
    return _graph_module(root, gm, built)


def _shallow_clone(module: nn.Module) -> nn.Module:
    """A copy of ``module`` sharing its parameters, buffers and children, with its own child
    list and hook dictionaries (hooks registered on either later stay on that one)."""
    clone = copy.copy(module)
    clone._modules = OrderedDict(module._modules)
    for key, value in vars(module).items():
        if "hook" in key and isinstance(value, dict):
            clone.__dict__[key] = copy.copy(value)
    return clone


def _set_submodule(root: nn.Module, path: str, new: nn.Module, inplace: bool) -> nn.Module:
    """Put ``new`` at ``path`` under ``root``; containers on the way are shallow-copied
    unless ``inplace`` (the user's own modules stay untouched). Returns ``root``."""
    *parents, leaf = path.split(".")
    mod = root
    for name in parents:
        child = mod._modules[name]
        if not inplace:
            child = _shallow_clone(child)
            mod._modules[name] = child
        mod = child
    mod._modules[leaf] = new
    return root


def _hooked_modules(layer: _Layer, gm: fx.GraphModule) -> List[Tuple[str, nn.Module]]:
    """The modules of a matched layer whose own call the fused chain would replace."""
    found: List[Tuple[str, nn.Module]] = []
    if layer.conv.node.op == "call_module":
        found.append((layer.conv.name, layer.conv.owner))
    found.append((layer.bn_name, layer.bn))
    if layer.act_node is not None and layer.act_node.op == "call_module":
        found.append((str(layer.act_node.target), gm.get_submodule(str(layer.act_node.target))))
    return found


def _drop_hooked(layers: List[_Layer], gm: fx.GraphModule, report: ConvertReport) -> List[_Layer]:
    """Leave unfused every layer one of whose modules has hooks (or a hook-based
    parametrization / pruning), with the reason: a fused chain would bypass them."""
    kept = []
    for l in layers:
        hooked = [(n, hook_reason(m)) for n, m in _hooked_modules(l, gm) if hook_reason(m)]
        if hooked:
            name, why = hooked[0]
            report.skipped.append(SkippedBN(l.bn_name, f"'{name}' has hooks ({why}), which a fused chain would "
                                            "bypass; left unfused so they run", l.conv.name))
        else:
            kept.append(l)
    return kept


def _watch_hooks(gm: fx.GraphModule, chains: List[List[_Layer]], before: Sequence[str]) -> None:
    """Tell each new FusedChain which modules' hooks it must honour at call time."""
    new = [m for n, m in gm.named_children() if isinstance(m, FusedChain) and n not in before]
    for fused, chain in zip(new, chains):
        fused.watch([[m for _, m in _hooked_modules(l, gm)] for l in chain])


def _tolerance(dtype: torch.dtype) -> float:
    """Relative tolerance for validating a rewrite: rounding differences pass, a changed computation not."""
    return {torch.float64: 1e-7, torch.float32: 1e-3}.get(dtype, 5e-2)


def _convert(module: nn.Module, prefix: str, mode: str, chain: bool, inplace: bool,
             report: ConvertReport, lazy: bool = False) -> nn.Module:
    """Convert ``module`` (qualified name ``prefix``). Traced with partial tracing: a
    submodule that cannot be traced, would trace misleadingly or has hooks is a leaf of
    ``module``'s trace and is converted on its own; when ``module``'s own forward cannot be
    traced, each child is converted instead. ``lazy``: rewritten GraphModules validate
    themselves against the module they replace on their first call."""
    if isinstance(module, (FusedChain, _FusedConvBNNd)) or not any(
        isinstance(m, _BatchNorm) for m in module.modules()
    ):
        return module
    if isinstance(module, _BatchNorm) and prefix:  # a lone BatchNorm child: nothing to fuse, nothing to trace
        return module
    try:
        traced = trace(module, _Tracer, training=True)  # the graph convert builds is for training
    except Exception as err:  # any tracing failure: convert the children instead
        report.untraced.append((prefix.rstrip("."), short_reason(err, 120)))
        target = module if inplace else _shallow_clone(module)
        for name, child in module.named_children():
            new = _convert(child, f"{prefix}{name}.", mode, chain, inplace, report, lazy)
            if new is not child:
                target._modules[name] = new
        return target
    report.traced.append(prefix.rstrip("."))
    gm = traced.gm
    replaced: List[Tuple[str, nn.Module]] = []
    for name in traced.descend():
        sub = module.get_submodule(name)
        new = _convert(sub, f"{prefix}{name}.", mode, chain, inplace, report, lazy)
        if new is not sub:
            replaced.append((name, new))
    layers = _drop_hooked(_find_layers(gm, module, prefix, report), gm, report)
    if not layers:
        if not replaced:
            return module
        target = module if inplace else _shallow_clone(module)
        for name, new in replaced:
            _set_submodule(target, name, new, inplace)
        return target
    chains = _chains(layers, chain)
    before = [n for n, _ in gm.named_children()]
    out = _rewrite(module, gm, chains, mode, report)
    _watch_hooks(out, chains, before)
    for name, new in replaced:
        _set_submodule(out, name, new, inplace)
    if isinstance(out, ConvbnGraphModule):
        out.watch_inlined(module, _inlined_modules(module, out))
        if traced.mode_dependent:  # traced in one mode; the other runs the original (eager) code
            out.guard_modes(module, traced.modes)
        if lazy:
            out.validate_on_first_call(module, _tolerance)
    return out


def _inlined_modules(module: nn.Module, gm: fx.GraphModule) -> List[nn.Module]:
    """Submodules of ``module`` that ``gm``'s graph never calls: traced through (their code
    inlined) and not watched by a FusedChain (which handles its own modules' hooks)."""
    called = [str(n.target) for n in gm.graph.nodes if n.op == "call_module"]
    watched = {id(m) for c in gm.modules() if isinstance(c, FusedChain) for ms in c.watched for m in ms}
    return [m for name, m in module.named_modules() if name and id(m) not in watched
            and not any(name == t or name.startswith(t + ".") for t in called)]


def _validated_convert(module: nn.Module, prefix: str, args: Tuple[Any, ...], kwargs: Dict[str, Any], mode: str,
                       chain: bool, inplace: bool, report: ConvertReport) -> nn.Module:
    """:func:`_convert`, then run ``module`` and the result on the inputs (forward and a
    backward with a random upstream gradient, state restored) and compare outputs,
    gradients and buffers. On a mismatch, convert finer: each child on its own inputs
    (recorded from an eager run), each validated the same way."""
    mark = (len(report.pairs), len(report.skipped), len(report.untraced), len(report.traced))
    converted = _convert(module, prefix, mode, chain, inplace, report)
    if converted is module:
        return module
    params = list(module.parameters())
    buffers = list(module.buffers())
    runs = []
    for model in (module, converted):
        with StateSnapshot(module), StateSnapshot(converted):
            try:
                out, grads = run_step(_Bound(model, kwargs), args, params, seed=0)
            except Exception as exc:  # noqa: BLE001 - the original must run; the rewrite must not fail
                if model is module:
                    raise
                out, grads = exc, []
            runs.append((out, grads, [b.detach().clone() for b in buffers]))
    if isinstance(runs[1][0], Exception):
        result_note = f"the rewrite fails: {short_reason(runs[1][0])}"
        ok = False
    else:
        result = compare_outputs(runs[0], runs[1], _tolerance, relative=True)
        if not result.ok:  # rounding amplified by the model itself? ask a float64 copy (costly: only now)
            slack = _eager_error(module, args, kwargs, runs[0])
            if slack is not None:
                result = compare_outputs(runs[0], runs[1], _tolerance, slack=slack, relative=True)
        ok, result_note = result.ok, result.describe()
    if ok:
        report.validated.append(prefix.rstrip("."))
        return converted
    del report.pairs[mark[0]:], report.skipped[mark[1]:], report.untraced[mark[2]:], report.traced[mark[3]:]
    report.untraced.append((prefix.rstrip("."), f"the traced rewrite differs from eager ({result_note}); "
                            "converted child by child"))
    inputs = _child_inputs(module, args, kwargs)
    target = module if inplace else _shallow_clone(module)
    for name, child in module.named_children():
        if name not in inputs:
            continue
        new = _validated_convert(child, f"{prefix}{name}.", *inputs[name], mode, chain, inplace, report)
        if new is not child:
            target._modules[name] = new
    return target


# Note: [validation tolerance follows eager's own rounding]
# A rewrite only reorders rounding, but how much rounding matters depends on the model:
# a BatchNorm over two nearly equal values (small images deep in a network) amplifies
# float32 rounding by up to 1/sqrt(eps). So, below float64, the validation also runs a
# float64 copy of the original and allows each compared tensor ``_EAGER_ERROR_FACTOR``
# times eager's own distance to it on top of the relative tolerance (as fold's check does).
_EAGER_ERROR_FACTOR = 4.0


def _eager_error(module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any], eager: Any) -> Optional[List[float]]:
    """Per floating leaf of ``eager`` (outputs, gradients, buffers of one step), 4x its
    distance to the same step of a float64 copy; ``None`` when everything is float64 already
    or the copy cannot be made (e.g. old-style ``weight_norm`` tensors refuse deepcopy)."""
    leaves = [t for t in torch.utils._pytree.tree_leaves(eager) if isinstance(t, Tensor) and t.is_floating_point()]
    if all(t.dtype == torch.float64 for t in leaves):
        return None
    to64 = lambda t: t.double() if isinstance(t, Tensor) and t.is_floating_point() else t  # noqa: E731
    try:
        model64 = copy.deepcopy(module).double()
        args64 = torch.utils._pytree.tree_map(to64, args)
        kwargs64 = torch.utils._pytree.tree_map(to64, kwargs)
        with StateSnapshot(model64):
            out, grads = run_step(_Bound(model64, kwargs64), args64, list(model64.parameters()), seed=0)
            exact = (out, grads, [b.detach().clone() for b in model64.buffers()])
    except Exception:  # noqa: BLE001 - no float64 reference: the relative tolerance alone
        return None
    exact_leaves = [t for t in torch.utils._pytree.tree_leaves(exact) if isinstance(t, Tensor) and t.is_floating_point()]
    if len(exact_leaves) != len(leaves):
        return None
    slack = []
    for a, e in zip(leaves, exact_leaves):
        finite = torch.isfinite(a) & torch.isfinite(e)
        err = (a.detach().double() - e.detach())[finite].abs().max().item() if a.shape == e.shape and finite.any() else 0.0
        slack.append(_EAGER_ERROR_FACTOR * err)
    return slack


class _Bound:
    """``model`` called with fixed keyword arguments (for :func:`run_step`)."""

    def __init__(self, model: nn.Module, kwargs: Dict[str, Any]) -> None:
        self.model, self.kwargs = model, kwargs

    def __call__(self, *args: Any) -> Any:
        return self.model(*args, **self.kwargs)


def _child_inputs(module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]
                  ) -> Dict[str, Tuple[Tuple[Any, ...], Dict[str, Any]]]:
    """Each direct child's inputs at its first call in one eager forward of ``module`` (state restored)."""
    seen: Dict[str, Tuple[Tuple[Any, ...], Dict[str, Any]]] = {}
    clone = lambda t: t.detach().clone() if isinstance(t, Tensor) else t  # noqa: E731

    def record(name: str) -> Callable[..., None]:
        def hook(mod: nn.Module, a: Tuple[Any, ...], k: Dict[str, Any]) -> None:
            if name not in seen:
                seen[name] = (tuple(torch.utils._pytree.tree_map(clone, a)), torch.utils._pytree.tree_map(clone, k))
        return hook

    handles = [c.register_forward_pre_hook(record(n), with_kwargs=True) for n, c in module.named_children()]
    try:
        with StateSnapshot(module), torch.no_grad():
            module(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return seen


# --------------------------------------------------------------------------- measuring and planning


def _as_tuple(example_inputs: Any) -> Tuple[Any, ...]:
    if isinstance(example_inputs, Tensor):
        return (example_inputs,)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs)
    raise TypeError(f"example_inputs must be a Tensor or a tuple of inputs, but got {type(example_inputs).__name__}")


def _measure(model: nn.Module, inputs: Tuple[Any, ...]) -> int:
    """Saved *activation* bytes of one training forward (parameters excluded: eager
    autograd saves weights, convbn holds them by reference; either way they are alive).
    A model already in training mode is measured as it is: BatchNorms the user froze
    (``.eval()`` inside a training model) stay frozen."""
    if not model.training:
        model.train()
    return saved_bytes(model, *inputs).activation_bytes


def _chain_layers(model: nn.Module) -> List[List[ChainLayer]]:
    return [m.layers for m in model.modules() if isinstance(m, FusedChain)]


def _act_kind(act: Activation) -> str:
    return "identity" if act.is_identity else "output" if act.output_derivable else "smooth"


def _chain_costs(converted: nn.Module, inputs: Tuple[Any, ...]) -> Tuple[List[FusedChain], List[ChainCost], int]:
    """The chains in forward order with their :class:`ChainCost`, and the floor's saved
    activation bytes; measured with every layer keeping nothing.

    A chain's ``prefix`` is what is alive besides it when its backward runs: activations
    saved before it, and the gradients of the parameters used after it (saved by later
    layers, or held by later chains; their backward has run by then, and with
    ``zero_grad(set_to_none=True)`` they did not exist at the end of forward). The chain's
    own parameter gradients, made during its backward, are left out.
    """
    converted.train()
    rec = saved_bytes(converted, *inputs, per_module=True)
    names = {id(m): n for n, m in converted.named_modules()}
    chain_params = {names[id(m)]: _chain_param_bytes(m) for m in converted.modules() if isinstance(m, FusedChain)}
    # walk the saves in forward order: a chain's prefix = activations saved before it +
    # gradients of every parameter used after it (saved ones, and later chains' own)
    first: Dict[str, Tuple[int, int]] = {}
    order: Dict[str, int] = {}
    acts_before, params_before = 0, 0
    for (mod, _, _, nbytes), is_param in zip(rec.shapes, rec.is_param):
        if mod not in first:
            first[mod], order[mod] = (acts_before, params_before), len(order)
            params_before += chain_params.get(mod, 0)
        if is_param:
            params_before += nbytes
        else:
            acts_before += nbytes
    total_params = params_before
    prefix = {m: a + total_params - p - chain_params.get(m, 0) for m, (a, p) in first.items()}
    chains = [m for m in converted.modules() if isinstance(m, FusedChain) and names.get(id(m)) in first]
    chains.sort(key=lambda m: order[names[id(m)]])  # forward order
    costs = [
        ChainCost(
            y_bytes=tuple(l.y_bytes() for l in c.layers),
            x_bytes=tuple(_bytes_of_shape(l.x_shape, l) for l in c.layers),
            macs=tuple(l.flops() for l in c.layers),
            acts=tuple(_act_kind(l.act) for l in c.layers),
            prefix=prefix[names[id(c)]],
        )
        for c in chains
    ]
    return chains, costs, rec.activation_bytes


def _chain_param_bytes(chain: FusedChain) -> int:
    """Bytes of the gradients a chain's parameters get (conv weight and bias, BN weight and bias)."""
    ts = [t for l in chain.layers for t in (l.weight, l.bias, l.bn.weight, l.bn.bias)]
    return sum(t.numel() * t.element_size() for t in ts if t is not None and t.requires_grad)


def _bytes_of_shape(shape: Optional[Sequence[int]], layer: ChainLayer) -> int:
    n = 1
    for s in shape or ():
        n *= int(s)
    return n * (layer.y_bytes() // max(1, math.prod(layer.y_shape or (1,))))


def _plan(original: nn.Module, converted: nn.Module, inputs: Tuple[Any, ...], memory_budget: Optional[float],
          report: ConvertReport) -> None:
    chains = _chain_layers(converted)
    layers = [l for c in chains for l in c]
    with StateSnapshot(original), StateSnapshot(converted):
        eager = _measure(original, inputs)
        for l in layers:
            l.mode = "recompute_conv"
        for m in converted.modules():
            if isinstance(m, FusedChain):
                m.auto_pending = False
        floor = _measure(converted, inputs)
        ordered, costs, floor_total = _chain_costs(converted, inputs)
    report.eager_saved_bytes, report.floor_saved_bytes = eager, floor
    if memory_budget is None:
        extra = tutorial_bytes(chains)
    else:
        target = int(round(memory_budget * eager, 6))  # budget == floor / eager must reach the floor
        if target < floor:
            least = math.ceil(floor / eager * 1000) / 1000  # rounded *up*: the suggestion must work
            raise ValueError(
                f"memory_budget={memory_budget} asks for {target} saved bytes, below the lowest reachable with "
                f"per-layer strategies: {floor} bytes = {floor / eager:.3f} of eager ({eager} bytes); "
                f"use memory_budget >= {least:.3f}"
            )
        extra = target - floor
    plan_layers(layers, extra)
    if memory_budget is None:
        # the default plans for the step's peak within the tutorial's memory (planner docstring)
        keeps = plan_for_peak(costs, [[l.mode == "recompute_bn" for l in c.layers] for c in ordered],
                              floor_total, extra)
        for c, kp in zip(ordered, keeps):
            for l, k in zip(c.layers, kp):
                l.mode = "recompute_bn" if k else "recompute_conv"
    keeps = [[l.mode == "recompute_bn" for l in c.layers] for c in ordered]
    peak, where = step_peak(costs, keeps, floor_total)
    report.predicted_peak_bytes = peak
    names = {id(m): n for n, m in converted.named_modules()}
    report.predicted_peak_where = "end of forward" if where < 0 else (
        f"backward, in {names.get(id(ordered[where]), '?')!r} ({ordered[where].layers[0].names[0]} ...)")
    report.target_saved_bytes = floor + extra
    report.saved_bytes = floor + sum(l.y_bytes() for l in layers if l.mode == "recompute_bn")


def _measure_peak(model: nn.Module, inputs: Tuple[Any, ...]) -> Any:
    """Timeline of one training step of ``model`` (loss: mean output); gradients, buffers,
    modes and RNG are put back afterwards."""
    params = list(model.parameters())
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        with StateSnapshot(model):
            model.train()
            return timeline(model, *inputs)
    finally:
        for p, g in zip(params, grads):
            p.grad = g


def _check_args(model: Any, strategy: str, memory_budget: Optional[float], example_inputs: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert expects an nn.Module, but got {type(model).__name__}")
    if strategy not in CONVERT_STRATEGIES:
        raise ValueError(f"strategy must be one of {CONVERT_STRATEGIES}, but got strategy={strategy!r}")
    if memory_budget is not None:
        if strategy != "auto":
            raise ValueError(f"memory_budget is used by strategy='auto' only, but got strategy={strategy!r}")
        if isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, float)) or not 0 < memory_budget <= 1:
            raise ValueError(
                f"memory_budget must be a fraction of eager saved activation bytes in (0, 1], but got {memory_budget!r}"
            )
        if example_inputs is None:
            raise ValueError("memory_budget needs example_inputs: the planner measures eager saved bytes on them")


def convert(
    model: M,
    *,
    strategy: str = "auto",
    memory_budget: Optional[float] = None,
    example_inputs: Any = None,
    inplace: bool = False,
    chain: bool = True,
) -> nn.Module:
    """Fuse every Conv -> BatchNorm (-> activation) of ``model`` for memory-lean training.

    The result computes the same outputs, gradients and running statistics as
    ``model``; its parameters and buffers are ``model``'s own objects (an optimizer
    built before conversion keeps working) and its ``state_dict()`` has the same keys.

    Args:
        model: any ``nn.Module``. Traced with ``torch.fx``; when the whole model cannot be
            traced, each child is converted instead (recursively).
        strategy: ``"auto"`` (plan per layer), ``"recompute_bn"`` (every layer keeps its
            conv output; element-wise recompute only) or ``"recompute_conv"`` (keep no
            layer's conv output; with ``chain=False`` this is the tutorial's method).
        memory_budget: with ``"auto"``, the target *saved* activation bytes (held from
            forward to backward, parameters excluded) as a fraction of the eager model's
            (e.g. ``0.35``): the plan recomputes least within it. ``None`` targets the
            memory of the tutorial's method and also plans for the step's *peak*: where a
            chain's backward transient would push the step above that memory, layers are
            re-planned to the least recompute at the lowest predicted peak (see
            :mod:`convbn.passes.planner`; ``explain`` shows predicted and measured peaks).
            Needs ``example_inputs``. A budget below the reachable floor raises
            ``ValueError`` naming the floor.
        example_inputs: a tensor or tuple of inputs. The result is *validated* on them:
            the original and the rewrite each run one forward and one backward (random
            upstream gradient) and outputs, gradients and running statistics are compared;
            where a part differs (a trace that misleads), that part is converted finer,
            child by child, and the report says so. Also used to measure and plan. Running
            stats, ``num_batches_tracked``, RNG and modes are restored exactly afterwards.
            Without it, each rewritten part validates its outputs against the original on
            its first call (a mismatch warns and runs that part unfused from then on), and
            ``"auto"`` plans each chain on its first training call.
        inplace: modify ``model`` itself where the pass replaces children of modules that
            could not be traced whole; by default those containers are shallow-copied.
        chain: group consecutive fused layers into chains (see :mod:`convbn.autograd.chain`).

    Hooks and parametrizations (see README "What convert preserves"): a conv, BatchNorm or
    activation module with hooks (including old-style ``weight_norm`` / ``spectral_norm`` and
    pruning) is left unfused and reported; hooks registered later are honoured at call time
    (the affected chain, or the affected part of the model, then runs as eager modules).

    Returns:
        The converted model (a ``torch.fx.GraphModule`` where the model traced, with the
        report in ``.convbn_report``), or ``model``'s structure with converted children.

    Example:
        >>> net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU())
        >>> fast = convert(net)
        >>> fast[0].weight is net[0].weight
        True
    """
    _check_args(model, strategy, memory_budget, example_inputs)
    report = ConvertReport(strategy=strategy)
    root = _swap_sync_batchnorm(model, inplace)
    # Conversion changes no state: reading a parametrized weight (spectral_norm's power
    # iteration) or tracing must not move buffers or the RNG.
    with StateSnapshot(root):
        if example_inputs is not None:
            converted = _validated_convert(root, "", _as_tuple(example_inputs), {}, strategy, chain, inplace, report)
        else:
            converted = _convert(root, "", strategy, chain, inplace, report, lazy=True)
    _account_bns(model, report)
    if strategy == "auto" and example_inputs is not None and report.pairs:
        # measure on ``root``: its SyncBatchNorms are convbn's, which run on CPU too
        _plan(root, converted, _as_tuple(example_inputs), memory_budget, report)
    elif example_inputs is not None and report.pairs:
        inputs = _as_tuple(example_inputs)
        with StateSnapshot(root), StateSnapshot(converted):
            report.eager_saved_bytes = _measure(root, inputs)
            report.saved_bytes = _measure(converted, inputs)
    try:
        if converted is model and not inplace:
            converted = _shallow_clone(model)  # nothing fused: carry the report without touching ``model``
        converted.convbn_report = report  # type: ignore[assignment]
    except AttributeError:  # pragma: no cover - modules refusing attributes
        pass
    if not report.pairs:
        why = "; ".join([f"{s.bn}: {s.reason}" for s in report.skipped[:3]]
                        + [f"{m or '<root>'} not traceable: {e}" for m, e in report.untraced[:2]])
        warnings.warn(f"convbn.convert fused nothing in {type(model).__name__} (no Conv -> BatchNorm pair found"
                      f"{': ' + why if why else ''}); it computes exactly as before", stacklevel=2)
    return converted


def _swap_sync_batchnorm(model: nn.Module, inplace: bool) -> nn.Module:
    """Replace every ``nn.SyncBatchNorm`` by :class:`convbn.nn.SyncBatchNorm` sharing its
    parameters and buffers (CPU/gloo support, fusable). Without ``inplace`` the containers
    on the way are shallow-copied, so ``model`` itself is untouched."""
    paths = [n for n, m in model.named_modules() if type(m) is nn.SyncBatchNorm]
    if not paths:
        return model
    root = model if inplace else _shallow_clone(model)
    clones = {id(model): root}
    for path in paths:
        parent, parent_new = model, root
        *parents, leaf = path.split(".")
        for name in parents:
            child = parent._modules[name]
            if id(child) not in clones:
                clones[id(child)] = child if inplace else _shallow_clone(child)
                parent_new._modules[name] = clones[id(child)]
            parent, parent_new = child, clones[id(child)]
        parent_new._modules[leaf] = SyncBatchNorm.from_module(parent._modules[leaf])
    return root


def _account_bns(model: nn.Module, report: ConvertReport) -> None:
    """Every BatchNorm module gets a line: fused, skipped with a reason, or not reached."""
    seen = {p.bn for p in report.pairs} | {s.bn for s in report.skipped}
    outcome = {m: "traced" for m in report.traced} | {m: "untraced" for m, _ in report.untraced}
    for name, m in model.named_modules():
        if not isinstance(m, _BatchNorm) or name in seen:
            continue
        # the deepest enclosing module the pass tried to trace ("" is the root)
        owner = max((o for o in outcome if o == "" or name.startswith(o + ".")), key=len, default="")
        if outcome.get(owner) == "untraced":
            reason = f"it is called from '{owner or '<root>'}', which could not be traced as a whole"
        else:
            reason = f"it is not called in the traced forward pass of '{owner or '<root>'}'"
        report.skipped.append(SkippedBN(name, reason))


def explain(model: nn.Module, example_inputs: Any = None, **kwargs: Any) -> ConvertReport:
    """What :func:`convert` would do to ``model``, without changing it.

    Args:
        model: the model.
        example_inputs: inputs for measuring saved bytes and planning (recommended).
        **kwargs: ``strategy``, ``memory_budget``, ``chain`` as for :func:`convert`.

    Returns:
        The :class:`ConvertReport`: each pair with its strategy, kept bytes and extra
        MACs, and each BatchNorm skipped with its reason. With ``example_inputs`` it also
        has the measured peak of one training step (:func:`convbn.memory.timeline`, loss:
        the output's mean) of the converted and the eager model, and where the converted
        one peaks; with ``strategy="auto"`` the planner's predicted peak too.
    """
    converted = convert(model, example_inputs=example_inputs, inplace=False, **kwargs)
    report: ConvertReport = converted.convbn_report  # type: ignore[assignment]
    if example_inputs is not None and report.pairs:
        inputs = _as_tuple(example_inputs)
        with StateSnapshot(model):
            eager = _measure_peak(model, inputs)
        tl = _measure_peak(converted, inputs)
        report.eager_peak_bytes = eager.peak
        report.measured_peak_bytes, report.measured_peak_where = tl.peak, tl.where()
    return report
