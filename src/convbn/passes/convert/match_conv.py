"""Matching a convolution: the conv / linear node a BatchNorm reads, as a :class:`MatchedConv`
(its node, input, the module owning its weight and its geometry), or the reason it cannot be
fused; a zero padding that only feeds it is folded into its geometry. Used by
:mod:`convbn.passes.convert.match`, which re-exports :class:`MatchedConv`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from ...functional.conv import ConvSpec, channel_linear, make_channel_linear_spec
from ...nn.computed_weight import ComputedWeight
from ..graph.computed_weight import computed_weight, weight_nodes
from ..graph.layers import LayerCall, has_standard_forward, layer_call, layer_spec
from ..graph.shape_capture import RANK
from .match_tail import node_arg

__all__ = ["MatchedConv"]


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
    #: a weight the graph computes from module tensors (``None``: ``owner.weight_name``)
    computed: Optional[ComputedWeight] = None
    #: the graph's nodes computing it (erased once the layer is fused, where nothing else reads them)
    weight_nodes: Tuple[fx.Node, ...] = ()

    @property
    def weight_shape(self) -> Tuple[int, ...]:
        """The weight's shape (a computed one's as computed at matching)."""
        if self.computed is None:
            return tuple(getattr(self.owner, self.weight_name).shape)
        with torch.no_grad():
            return tuple(self.computed.compute().shape)


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
    """Fold a zero-padding op (or an ``nn.Identity``) that only feeds this conv into its spec
    (exact: zeros are zeros); ``conv`` itself where there is none to fold."""
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
                       (inp,) + conv.absorbed, conv.computed, conv.weight_nodes)  # graph order


def _match_conv(node: fx.Node, gm: fx.GraphModule, root: nn.Module) -> Union[MatchedConv, str, None]:
    """A conv node as :class:`MatchedConv`, a string reason why it cannot be fused, or ``None``.

    Weight owners are looked up on ``root``, the user's module: the traced GraphModule
    holds stand-in containers for ``get_attr`` targets, which later re-assignments of
    the real modules' parameters (``load_state_dict(assign=True)``) would not reach.
    """
    if isinstance(node, fx.Node) and node.op == "call_function" and node.target is channel_linear:
        return _channel_linear(node, root)
    found = _match_conv_node(node, gm, root)
    # zero padding before a transposed conv is not its ``padding`` (which crops the output)
    if (isinstance(found, MatchedConv) and found.spec.pre_pad_mode == "constant" and found.spec.dims > 0
            and not found.spec.transposed):
        absorbed = _absorb_zero_pad(found, gm)
        while absorbed is not found:  # a run of them: timm's LayerNormAct2d drop and act, then a block's down
            found, absorbed = absorbed, _absorb_zero_pad(absorbed, gm)
    return found


def _channel_linear(node: fx.Node, root: nn.Module) -> Union[MatchedConv, str]:
    """A :func:`~convbn.functional.conv.channel_linear` node (Note: [a channels-last LayerNorm
    before a Linear] in norm_linears.py): a 1x1 convolution on its map of known rank."""
    inp, w, b = (*node.args, None)[:3] if len(node.args) >= 2 else (None, None, None)
    rank = node.meta.get(RANK)
    if not isinstance(inp, fx.Node) or not isinstance(w, fx.Node) or w.op != "get_attr" or not isinstance(rank, int):
        return "a linear layer on the channels whose input, weight or rank the graph does not show"
    found = _param_owner(w, b, root, "linear")
    if isinstance(found, str):
        return found
    owner, wpath, wname, bname = found
    return MatchedConv(node, inp, owner, wname, bname, make_channel_linear_spec(rank - 2), wpath or str(w.target))


def _match_conv_node(node: fx.Node, gm: fx.GraphModule, root: nn.Module) -> Union[MatchedConv, str, None]:
    call = layer_call(node, gm)
    if call is None or isinstance(call, str):
        return call
    inp = call.input
    if call.module is not None:
        mod = call.module
        what = "linear layer" if call.kind == "linear" else "convolution"
        if call.kind == "convt" and call.args["output_size"] is not None:
            # its output_padding then follows the input's size at run time: not a fixed geometry
            return (f"its input is a transposed convolution ({node.target}) called with output_size=, which "
                    "sets its output_padding from each input's shape; left unfused (give the module "
                    "output_padding instead to fuse it)")
        if not has_standard_forward(mod):
            return f"its input comes from {type(mod).__name__}, a {what} with a custom forward"
        if not isinstance(inp, fx.Node):
            return f"the {what}'s input is not a traced tensor"
        return MatchedConv(node, inp, mod, "weight", "bias" if mod.bias is not None else None,
                           layer_spec(call, mod.weight.shape), str(node.target))
    what = {"conv": "convolution", "convt": "transposed convolution", "linear": "linear"}[call.kind]
    w, b = call.args["weight"], call.args["bias"]
    if not isinstance(w, fx.Node):
        return f"the functional {what}'s weight is not a module parameter"
    if b is not None and (not isinstance(b, fx.Node) or b.op != "get_attr"):
        return f"the functional {what}'s bias is not a module parameter"
    geometry = [call.args[n] for n, _ in call.sig[3:]]
    if any(isinstance(g, fx.Node) for g in geometry) or not isinstance(inp, fx.Node):
        return f"the functional {what}'s arguments are not constants"
    if w.op != "get_attr":
        return _computed_conv(call, w, b, root, what)
    found = _param_owner(w, b, root, what)
    if isinstance(found, str):
        return found
    owner, wpath, wname, bname = found
    spec = layer_spec(call, getattr(owner, wname).shape)
    return MatchedConv(node, inp, owner, wname, bname, spec, wpath or str(w.target))


def _computed_conv(call: LayerCall, w: fx.Node, b: Optional[fx.Node], root: nn.Module, what: str
                   ) -> Union[MatchedConv, str]:
    """A functional layer whose weight the graph computes from module tensors (weight
    standardisation, a gain: :mod:`convbn.passes.graph.computed_weight`), or why it is left.
    The layer is named after the module holding its bias, else its weight's first tensor."""
    cw = computed_weight(w, root)
    if isinstance(cw, str):
        return f"the functional {what}'s weight is not a module parameter ({cw})"
    nodes = weight_nodes(w)
    assert not isinstance(nodes, str)  # computed_weight accepted them
    first = next(n for n in nodes if n.op == "get_attr")
    path = str((b if b is not None else first).target).rpartition(".")[0]
    owner = root.get_submodule(path) if path else root
    bname = None if b is None else str(b.target).rpartition(".")[2]
    with torch.no_grad():
        shape = cw.compute().shape
    spec = layer_spec(call, shape)
    return MatchedConv(call.node, call.input, owner, cw.sources[0][1], bname, spec, path or call.node.name, computed=cw,
                       weight_nodes=tuple(nodes))


def _param_owner(w: fx.Node, b: Optional[fx.Node], root: nn.Module, what: str
                 ) -> Union[Tuple[nn.Module, str, str, Optional[str]], str]:
    """``(owner, owner path, weight name, bias name)`` of a functional layer's ``get_attr``
    weight and bias, looked up on ``root``; a reason where they live in different modules."""
    wpath, _, wname = str(w.target).rpartition(".")
    owner = root.get_submodule(wpath) if wpath else root
    bname = None
    if b is not None:
        bpath, _, bname = str(b.target).rpartition(".")
        if bpath != wpath:
            return f"the functional {what}'s weight and bias live in different modules"
    return owner, wpath, wname, bname
