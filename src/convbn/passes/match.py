"""Matching: find Conv -> BatchNorm (-> activation) layers in a traced graph, and group them into chains.

Input: a ``torch.fx`` graph traced with :class:`MatchTracer` (convolutions with the standard
forward, BatchNorms and convbn's own modules are leaves). Output: :class:`MatchedLayer`
records (conv node and geometry, BatchNorm node and module, the activation and the nodes it
spans) and, for every BatchNorm that is not matched, a :class:`~convbn.passes.report.SkippedBN`
with the reason. :func:`group_chains` groups consecutive matched layers into chains; the
rewrite (:mod:`convbn.passes.rewrite`) replaces each chain by one fused module.
"""
from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.conv import _ConvNd

from ..functional.activations import Activation, activation_from_module
from ..functional.conv import ConvSpec, conv_out_channels, conv_spec_from_module, make_conv_spec, make_linear_spec
from ..nn.chain import FusedChain
from ..nn.fused import _FusedConvBNNd
from .bn_sites import find_bn_sites
from .report import ConvertReport, SkippedBN
from .shape_uses import is_rank_use, is_shape_use, value_users

__all__ = ["MatchTracer", "MatchedConv", "MatchedLayer", "find_layers", "group_chains", "node_arg", "describe_node"]

_STD_CONV_FORWARDS = {nn.Conv1d.forward, nn.Conv2d.forward, nn.Conv3d.forward,
                      nn.ConvTranspose1d.forward, nn.ConvTranspose2d.forward, nn.ConvTranspose3d.forward}
_FUNCTIONAL_CONVS = {F.conv1d: 1, F.conv2d: 2, F.conv3d: 3, torch.conv1d: 1, torch.conv2d: 2, torch.conv3d: 3}
_FUNCTIONAL_CONVTS = {F.conv_transpose1d: 1, F.conv_transpose2d: 2, F.conv_transpose3d: 3,
                      torch.conv_transpose1d: 1, torch.conv_transpose2d: 2, torch.conv_transpose3d: 3}
_FUNCTIONAL_LINEARS = {F.linear}
# a linear layer is a 0-D convolution (Note: [three kinds of convolution] in functional/conv.py)
_BN_DIMS = {nn.BatchNorm1d: (0, 1), nn.BatchNorm2d: (2,), nn.BatchNorm3d: (3,)}


class MatchTracer(fx.Tracer):
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
class MatchedConv:
    node: fx.Node
    input: fx.Node
    owner: nn.Module
    weight_name: str
    bias_name: Optional[str]
    spec: ConvSpec
    name: str
    absorbed: Tuple[fx.Node, ...] = ()  # zero-padding nodes folded into ``spec``


@dataclass
class MatchedLayer:
    conv: MatchedConv
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


def node_arg(node: fx.Node, i: int, name: str, default: Any) -> Any:
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
        pad, mode, value = node_arg(node, 1, "pad", None), node_arg(node, 2, "mode", "constant"), node_arg(node, 3, "value", None)
        if mode == "constant" and not value and isinstance(pad, (list, tuple)) and all(isinstance(p, int) for p in pad):
            return tuple(pad)
    return None


def _absorb_zero_pad(conv: MatchedConv, gm: fx.GraphModule) -> MatchedConv:
    """Fold a zero-padding op that only feeds this conv into its spec (exact: zeros are zeros)."""
    inp = conv.input
    if conv.spec.pre_pad or len(inp.users) != 1:
        return conv
    pads = _zero_pad_of(inp, gm)
    src = node_arg(inp, 0, "input", None)
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
    return MatchedConv(conv.node, src, conv.owner, conv.weight_name, conv.bias_name, spec, conv.name,
                 conv.absorbed + (inp,))


def _match_conv(node: fx.Node, gm: fx.GraphModule, root: nn.Module) -> Union[MatchedConv, str, None]:
    """A conv node as :class:`MatchedConv`, a string reason why it cannot be fused, or ``None``.

    Weight owners are looked up on ``root``, the user's module: the traced GraphModule
    holds stand-in containers for ``get_attr`` targets, which later re-assignments of
    the real modules' parameters (``load_state_dict(assign=True)``) would not reach.
    """
    found = _match_conv_node(node, gm, root)
    # zero padding before a transposed conv is not its ``padding`` (which crops the output)
    if (isinstance(found, MatchedConv) and found.spec.pre_pad_mode == "constant" and found.spec.dims > 0
            and not found.spec.transposed):
        found = _absorb_zero_pad(found, gm)
    return found


def _match_conv_node(node: fx.Node, gm: fx.GraphModule, root: nn.Module) -> Union[MatchedConv, str, None]:
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        if isinstance(mod, nn.Linear) and type(mod).forward is nn.Linear.forward:
            inp = node_arg(node, 0, "input", None)
            if not isinstance(inp, fx.Node):
                return "the linear layer's input is not a traced tensor"
            return MatchedConv(node, inp, mod, "weight", "bias" if mod.bias is not None else None,
                               make_linear_spec(), str(node.target))
        if not isinstance(mod, _ConvNd):
            return None
        if mod.transposed and node_arg(node, 1, "output_size", None) is not None:
            # its output_padding then follows the input's size at run time: not a fixed geometry
            return (f"its input is a transposed convolution ({node.target}) called with output_size=, which "
                    "sets its output_padding from each input's shape; left unfused (give the module "
                    "output_padding instead to fuse it)")
        if type(mod).forward not in _STD_CONV_FORWARDS:
            return f"its input comes from {type(mod).__name__}, a convolution with a custom forward"
        inp = node_arg(node, 0, "input", None)
        if not isinstance(inp, fx.Node):
            return "the convolution's input is not a traced tensor"
        return MatchedConv(node, inp, mod, "weight", "bias" if mod.bias is not None else None,
                     conv_spec_from_module(mod), str(node.target))
    if node.op == "call_function" and node.target in _FUNCTIONAL_CONVS:
        dims = _FUNCTIONAL_CONVS[node.target]  # type: ignore[index]
        inp, w, b = node_arg(node, 0, "input", None), node_arg(node, 1, "weight", None), node_arg(node, 2, "bias", None)
        if not isinstance(w, fx.Node) or w.op != "get_attr":
            return "the functional convolution's weight is not a module parameter"
        if b is not None and (not isinstance(b, fx.Node) or b.op != "get_attr"):
            return "the functional convolution's bias is not a module parameter"
        geo = [node_arg(node, i, n, d) for i, n, d in ((3, "stride", 1), (4, "padding", 0), (5, "dilation", 1), (6, "groups", 1))]
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
        return MatchedConv(node, inp, owner, wname, bname, spec, wpath or str(w.target))
    if node.op == "call_function" and (node.target in _FUNCTIONAL_CONVTS or node.target in _FUNCTIONAL_LINEARS):
        return _match_functional_convt_or_linear(node, root)
    return None


def _match_functional_convt_or_linear(node: fx.Node, root: nn.Module) -> Union[MatchedConv, str]:
    """``F.conv_transposeNd(x, W, b, stride, padding, output_padding, groups, dilation)`` or
    ``F.linear(x, W, b)`` on module parameters."""
    linear = node.target in _FUNCTIONAL_LINEARS
    what = "linear" if linear else "transposed convolution"
    inp, w, b = node_arg(node, 0, "input", None), node_arg(node, 1, "weight", None), node_arg(node, 2, "bias", None)
    if not isinstance(w, fx.Node) or w.op != "get_attr":
        return f"the functional {what}'s weight is not a module parameter"
    if b is not None and (not isinstance(b, fx.Node) or b.op != "get_attr"):
        return f"the functional {what}'s bias is not a module parameter"
    names = () if linear else ((3, "stride", 1), (4, "padding", 0), (5, "output_padding", 0), (6, "groups", 1),
                               (7, "dilation", 1))
    geo = [node_arg(node, i, n, d) for i, n, d in names]
    if any(isinstance(a, fx.Node) for a in geo) or not isinstance(inp, fx.Node):
        return f"the functional {what}'s arguments are not constants"
    wpath, _, wname = str(w.target).rpartition(".")
    owner = root.get_submodule(wpath) if wpath else root
    bname = None
    if b is not None:
        bpath, _, bname = str(b.target).rpartition(".")
        if bpath != wpath:
            return f"the functional {what}'s weight and bias live in different modules"
    if linear:
        return MatchedConv(node, inp, owner, wname, bname, make_linear_spec(), wpath or str(w.target))
    dims = _FUNCTIONAL_CONVTS[node.target]  # type: ignore[index]
    stride, padding, output_padding, groups, dilation = geo
    spec = make_conv_spec(dims, getattr(owner, wname).shape[2:], stride, padding, dilation, groups)
    op = tuple(output_padding) if isinstance(output_padding, (list, tuple)) else (int(output_padding),) * dims
    spec = dataclasses.replace(spec, transposed=True, output_padding=op if any(op) else ())
    return MatchedConv(node, inp, owner, wname, bname, spec, wpath or str(w.target))


_ACT_FUNCS: Dict[Any, Callable[[fx.Node], Optional[Activation]]] = {
    torch.relu: lambda n: Activation("relu"),
    torch.relu_: lambda n: Activation("relu"),
    F.relu: lambda n: Activation("relu"),
    F.relu_: lambda n: Activation("relu"),
    F.relu6: lambda n: Activation("relu6"),
    F.leaky_relu: lambda n: Activation("leaky_relu", negative_slope=float(node_arg(n, 1, "negative_slope", 0.01))),
    F.silu: lambda n: Activation("silu"),
    F.gelu: lambda n: Activation("gelu", approximate=str(node_arg(n, 1, "approximate", "none"))),
    F.hardswish: lambda n: Activation("hardswish"),
    F.hardtanh: lambda n: Activation("relu6") if (node_arg(n, 1, "min_val", -1.0), node_arg(n, 2, "max_val", 1.0)) == (0.0, 6.0) else None,
    F.hardsigmoid: lambda n: Activation("hardsigmoid"),
    F.elu: lambda n: Activation("elu", alpha=float(node_arg(n, 1, "alpha", 1.0))),
    F.celu: lambda n: Activation("celu", alpha=float(node_arg(n, 1, "alpha", 1.0))),
    F.selu: lambda n: Activation("selu"),
    F.mish: lambda n: Activation("mish"),
    F.softplus: lambda n: Activation("softplus", beta=float(node_arg(n, 1, "beta", 1.0)),
                                     threshold=float(node_arg(n, 2, "threshold", 20.0))),
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
    if node_arg(node, 0, "input", None) is not src:
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
    if sig is None or len(sig.users) != 1 or sig.kwargs or node_arg(sig, 0, "input", None) is not node:
        return None
    mul = next(iter(sig.users))
    ok = (mul.op == "call_function" and mul.target in _MULS) or (mul.op == "call_method" and mul.target == "mul")
    if not ok or mul.kwargs or len(mul.args) != 2 or set(mul.args) != {node, sig} or mul not in node.users:
        return None
    return mul, sig


def describe_node(node: fx.Node) -> str:
    if node.op == "placeholder":
        return f"the model input '{node.name}'"
    if node.op == "call_module":
        return f"module '{node.target}'"
    if node.op == "call_function":
        return f"function {getattr(node.target, '__name__', node.target)}"
    return f"{node.op} {node.target}"


def find_layers(gm: fx.GraphModule, root: nn.Module, prefix: str, report: ConvertReport) -> List[MatchedLayer]:
    """Every fusable layer of ``gm`` in graph order; each BatchNorm not matched gets a
    :class:`SkippedBN` in ``report`` saying why."""
    layers: List[MatchedLayer] = []
    for site in find_bn_sites(gm, prefix, report, root):
        node, bn, name, src = site.node, site.bn, site.name, site.input

        def skip(reason: str, conv: Optional[str] = None) -> None:
            report.skipped.append(SkippedBN(name, reason, conv))

        conv = _match_conv(src, gm, root)
        if conv is None:
            skip(f"its input is not a convolution output (it follows {describe_node(src)})")
            continue
        if isinstance(conv, str):
            skip(conv)
            continue
        conv.name = prefix + conv.name
        if len(value_users(src)) != 1:
            others = ", ".join(describe_node(u) for u in value_users(src) if u is not node)
            skip(f"the convolution's output is also used by {others}", conv.name)
            continue
        dims_ok = _BN_DIMS.get(type(bn))
        if dims_ok is not None and conv.spec.dims not in dims_ok:
            what = "a linear layer" if conv.spec.is_linear else f"a {conv.spec.dims}-D convolution"
            skip(f"{type(bn).__name__} after {what}", conv.name)
            continue
        if site.ranks and conv.spec.dims + 2 not in site.ranks:
            skip(f"{site.name} computes a batch norm only on {site.ranks}-D inputs, not on this "
                 f"layer's {conv.spec.dims + 2}-D output", conv.name)
            continue
        if bn.num_features != conv_out_channels(getattr(conv.owner, conv.weight_name).shape, conv.spec):
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
        layers.append(MatchedLayer(conv, node, bn, name, act, act_node, act_extra, shape_uses))
    return layers


def group_chains(layers: List[MatchedLayer], chain: bool) -> List[List[MatchedLayer]]:
    by_out = {l.out: l for l in layers}
    chains: List[List[MatchedLayer]] = []
    where: Dict[int, List[MatchedLayer]] = {}
    for l in layers:  # graph (topological) order
        prev = by_out.get(l.conv.input)
        # a layer whose inner tensors' shapes are read must end its chain: only the
        # chain's output exists to read them from (see Note: [shape-only uses] in shape_uses.py);
        # rank reads (x.ndim, as norm-act layers check) are the same on every tensor of a chain
        if (chain and prev is not None and id(prev) in where and len(prev.out.users) == 1
                and all(is_rank_use(u) for u in prev.shape_uses) and l.conv.spec.pre_pad_mode == "constant"):
            c = where[id(prev)]
        else:
            c = []
            chains.append(c)
        c.append(l)
        where[id(l)] = c
    return chains
