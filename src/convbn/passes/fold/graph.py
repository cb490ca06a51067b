"""The graph folder: in one traced GraphModule, take each BatchNorm (found as convert finds
them: :func:`~convbn.passes.bn.sites.bn_call`) and its neighbouring layer
(:func:`~convbn.passes.graph.layers.layer_call`), check fold's conditions and fold it into the
layer before, or where exact the layer after; every BatchNorm gets a
:class:`~convbn.passes.report.outcome.BNOutcome`. The recursion into submodules traced on their
own is :func:`convbn.passes.fold.api.fold_module`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Set, Tuple, Union

import torch
import torch.fx as fx
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from ...functional.fold import fold_bn_into_following, fold_bn_into_preceding
from ...nn.bn_call import has_standard_bn_forward
from ..bn.sites import BNCall, bn_call
from ..graph.concat_heads import cat_parts, channel_cat_pieces
from .layers import (UNSET, NormActTail, check_bn_foldable, clone_with, const_tensor, delete_unused_submodules,
                     describe_activation, free_name, get_attr_value, owner_path)
from ..report.fold_report import FoldReport
from ..graph.layers import LayerCall, has_standard_forward, layer_call, layer_spec
from ..report.outcome import BNOutcome
from ..graph.shape_uses import value_users
from ..bn.conv_crops import absorb_conv_crops
from ..bn.tokens import drop_noop_flattens, features_to_dim1, flattened_linear_reason
from ...functional.activations import ACTIVATIONS, activation_from_module
from ..bn.frozen import frozen_bn_eps

__all__ = ["FoldContext", "GraphFolder"]


# --------------------------------------------------------------------------------------
# The pass
# --------------------------------------------------------------------------------------


@dataclass
class FoldContext:
    report: FoldReport
    inplace: bool
    bn_input_ranks: Dict[int, Set[int]]   # id(BN module) -> ranks of its inputs (sample run)
    linear_out_ranks: Dict[int, Set[int]]  # id(Linear module) -> ranks of its outputs
    #: id(module) -> (args, kwargs) of its first call in a sample run (shape capture), when known
    called: Optional[Dict[int, Tuple[Tuple[Any, ...], Dict[str, Any]]]] = None


@dataclass
class _BNSite:
    """One BatchNorm application in a graph, module or functional."""

    node: fx.Node
    name: str
    input: Any
    running_mean: Tensor
    running_var: Tensor
    eps: float
    weight: Optional[Tensor]
    bias: Optional[Tensor]
    module: Optional[nn.Module]
    attr_nodes: Tuple[fx.Node, ...]  # get_attr nodes only this site may use
    ranks: Tuple[int, ...] = ()  # input ranks it is a batch norm on (frozen BatchNorms); () any


@dataclass
class _Layer:
    """A conv / conv-transpose / linear fold may fold into: its call, name and the tensors
    it computes with."""

    call: LayerCall
    name: str
    weight: Tensor
    bias: Optional[Tensor]
    groups: int

    @property
    def node(self) -> fx.Node:
        return self.call.node

    @property
    def kind(self) -> str:
        return self.call.kind

    @property
    def module(self) -> Optional[nn.Module]:
        return self.call.module

    @property
    def args(self) -> Dict[str, Any]:
        return self.call.args

    @property
    def out_channels(self) -> int:
        return self.weight.shape[1] * self.groups if self.kind == "convt" else self.weight.shape[0]

    @property
    def in_channels(self) -> int:
        return self.weight.shape[0] if self.kind == "convt" else self.weight.shape[1] * self.groups


def _eps(bn: nn.Module) -> float:
    """A BatchNorm module's eps; a frozen one's may be a constant in its forward (``frozen_bn_eps``)."""
    return float(bn.eps) if isinstance(getattr(bn, "eps", None), (int, float)) else frozen_bn_eps(bn)


def _pads_with_zeros(layer: _Layer) -> bool:
    """Whether conv ``layer`` reads zeros beyond its input's border (see Note: [folding into
    the following conv]); ``True`` where its geometry is computed in forward. Module and
    functional convs alike, from their :class:`~convbn.functional.conv.ConvSpec`."""
    try:
        spec = layer_spec(layer.call, layer.weight.shape)
    except (TypeError, ValueError):  # non-constant geometry: cannot tell, so do not fold
        return True
    return any(spec.padding) or (bool(spec.pre_pad) and spec.pre_pad_mode == "constant")


class GraphFolder:
    """Folds the BatchNorms of one traced GraphModule (``prefix``: its qualified name)."""

    def __init__(self, gm: fx.GraphModule, root: nn.Module, prefix: str, ctx: FoldContext) -> None:
        self.gm = gm
        self.root = root  # the traced module (gm only holds the parts the graph uses)
        self.prefix = prefix
        self.ctx = ctx
        self.modules = dict(gm.named_modules())
        self.changed = False
        self.norm_act: Set[str] = set()  # inlined norm-act modules whose batch norm is a site

    # -- naming -------------------------------------------------------------------
    def qual(self, target: str) -> str:
        return f"{self.prefix}{target}" if target else self.prefix.rstrip(".") or "<root>"

    # -- matching -----------------------------------------------------------------
    def bn_site(self, node: fx.Node) -> Union[_BNSite, BNOutcome, None]:
        """The BN applied by ``node``; its ``"left"`` outcome if it is a BN that cannot fold
        whatever its neighbours are; None if ``node`` is no BatchNorm.

        BatchNorms are found as convert finds them (:func:`~convbn.passes.bn.sites.bn_call`);
        the conditions here are fold's: eval mode with running statistics, torch's forward,
        no hooks, constant ``training=False`` statistics for a functional call.
        """
        call = bn_call(node, self.gm, self.prefix, self.root)
        if call is None:
            return None
        mod, name = call.module, call.name
        if call.kind == "functional":
            return self._functional_site(call)
        if call.kind == "inlined":
            why = None if call.ranks else check_bn_foldable(mod)
            reads = sum(1 for n in self.gm.graph.nodes if n.op == "get_attr" and n.target == call.target)
            if why is None and reads != 1:
                why = "the BatchNorm module is called more than once"
            if why is not None:
                return BNOutcome(name, "left", reason=why)
            self.norm_act.add(call.target)
            return _BNSite(node, name, call.input, mod.running_mean, mod.running_var, _eps(mod),
                           mod.weight, mod.bias, mod, (node.args[0],), call.ranks)
        if call.kind == "module":
            why = check_bn_foldable(mod)
            if why is None and not has_standard_bn_forward(mod):
                why = (f"{type(mod).__name__} overrides forward() in a way that could not be traced "
                       "into, so it may do more than batch norm")
            if why is None and (mod._forward_hooks or mod._forward_pre_hooks):
                why = "BatchNorm has forward hooks, which folding would drop"
            if why is None and (len(node.args) != 1 or node.kwargs):
                why = "BatchNorm called with extra arguments"
            if why is not None:
                return BNOutcome(name, "left", reason=why)
        return _BNSite(node, name, call.input, mod.running_mean, mod.running_var, _eps(mod),
                       mod.weight, mod.bias, mod, (), call.ranks)

    def _functional_site(self, call: BNCall) -> Union[_BNSite, BNOutcome]:
        """An ``F.batch_norm`` / ``torch.batch_norm`` call, foldable with constant
        ``training=False`` and stored running statistics."""
        args, name = call.args, call.name
        if args is None:
            return BNOutcome(name, "left", reason="batch_norm call with arguments this pass does not understand")
        if args["training"] is not False:
            return BNOutcome(name, "left",
                             reason=f"batch_norm called with training={args['training']!r} (batch statistics)")
        values = {k: const_tensor(self.gm, args[k]) for k in ("running_mean", "running_var", "weight", "bias")}
        if values["running_mean"] is None or values["running_var"] is None:
            return BNOutcome(name, "left", reason="batch_norm called without running statistics")
        if any(v is UNSET for v in values.values()):
            return BNOutcome(name, "left", reason="batch_norm statistics/affine parameters are computed in forward, "
                                                  "not stored attributes")
        eps = args["eps"]
        if not isinstance(eps, (int, float)):
            return BNOutcome(name, "left", reason="batch_norm eps is not a constant")
        attr_nodes = tuple(args[k] for k in ("running_mean", "running_var", "weight", "bias")
                           if isinstance(args[k], fx.Node))
        return _BNSite(call.node, name, args["input"], values["running_mean"], values["running_var"],
                       float(eps), values["weight"], values["bias"], None, attr_nodes)

    def layer(self, node: Any) -> Union[_Layer, str]:
        """The conv/linear applied by ``node`` (found as convert finds them:
        :func:`~convbn.passes.graph.layers.layer_call`), or a reason string why it is none."""
        if not isinstance(node, fx.Node):
            return "the input is not a graph value"
        call = layer_call(node, self.gm)
        if isinstance(call, str):
            return call
        if call is None:
            if node.op == "call_module":
                what = type(self.gm.get_submodule(str(node.target))).__name__
                return f"'{node.name}' is a {what}, not a conv/linear layer"
            what = node.op if node.op != "call_function" else getattr(node.target, "__name__", str(node.target))
            return f"'{node.name}' ({what}) is not a conv/linear layer"
        mod = call.module
        if mod is not None:
            name = self.qual(str(node.target))
            if not has_standard_forward(mod):
                return f"{name} ({type(mod).__name__}) overrides forward()"
            if mod._forward_hooks or mod._forward_pre_hooks:
                return f"{name} has forward hooks"
            if torch.nn.utils.parametrize.is_parametrized(mod):
                return f"{name} is parametrized"
            return _Layer(call, name, mod.weight, mod.bias, getattr(mod, "groups", 1))
        weight = const_tensor(self.gm, call.args["weight"])
        bias = const_tensor(self.gm, call.args["bias"])
        if not isinstance(weight, Tensor) or bias is UNSET:
            return f"'{node.name}' uses a weight/bias computed in forward, not a stored parameter"
        groups = call.args.get("groups", 1)
        if not isinstance(groups, int):
            return f"'{node.name}' has non-constant groups"
        wt = call.args["weight"].target
        name = self.qual(owner_path(wt)) if owner_path(wt) else self.qual(wt)
        return _Layer(call, name, weight, bias, groups)

    # -- sharing ------------------------------------------------------------------
    def _module_exclusive(self, target: str) -> bool:
        """Module ``target`` is used by exactly one graph node and reachable by one name."""
        calls = 0
        for n in self.gm.graph.nodes:
            if n.op == "call_module":
                if n.target == target:
                    calls += 1
                elif target.startswith(n.target + "."):
                    return False  # used inside an opaque module too
            elif n.op == "get_attr" and n.target.startswith(target + "."):
                return False
        if calls != 1:
            return False
        mod = self.modules[target]
        return sum(1 for _, m in self.gm.named_modules(remove_duplicate=False) if m is mod) == 1

    def _attr_exclusive(self, attr_node: fx.Node, user: fx.Node) -> bool:
        target = attr_node.target
        if set(attr_node.users) != {user}:
            return False
        owner = owner_path(target)
        for n in self.gm.graph.nodes:
            if n is attr_node:
                continue
            if n.op == "get_attr" and n.target == target:
                return False
            if n.op == "call_module" and (owner == n.target or owner.startswith(n.target + ".")):
                return False
        value = get_attr_value(self.gm, target)
        return sum(1 for _, p in self.gm.named_parameters(remove_duplicate=False) if p is value) <= 1

    @staticmethod
    def _tied(module: nn.Module, root: nn.Module) -> bool:
        ids = {id(p) for p in module.parameters(recurse=False)}
        count = sum(1 for _, p in root.named_parameters(remove_duplicate=False) if id(p) in ids)
        return count != len(ids)

    # -- rewriting ----------------------------------------------------------------
    def install(self, layer: _Layer, weight: Tensor, bias: Tensor) -> str:
        """Make ``layer.node`` compute with ``weight``/``bias``; returns a note."""
        requires_grad = layer.weight.requires_grad
        if layer.module is not None:
            target = layer.node.target
            if self._module_exclusive(target):
                if self.ctx.inplace and not self._tied(layer.module, self.gm):
                    # inplace=True: overwrite the existing parameters (saves memory).
                    layer.module.weight.data = weight.detach().to(layer.module.weight.dtype)
                    if layer.module.bias is None:
                        layer.module.bias = nn.Parameter(bias.detach(), requires_grad=requires_grad)
                    else:
                        layer.module.bias.data = bias.detach().to(layer.module.bias.dtype)
                    return ""
                new = clone_with(layer.module, weight, bias)
                parent, _, attr = target.rpartition(".")
                setattr(self.gm.get_submodule(parent), attr, new)
                self.modules[target] = new
                return ""
            new_target = free_name(self.gm, target + "_bnfold")
            new = clone_with(layer.module, weight, bias)
            self.gm.add_submodule(new_target, new)
            self.modules[new_target] = new
            layer.node.target = new_target
            return f"fresh copy '{self.qual(new_target)}': the layer is also used elsewhere"
        # Functional layer: point the call at new parameters.
        args = dict(layer.args)
        w_node, b_node = args["weight"], args["bias"]
        notes = []
        w_excl = self._attr_exclusive(w_node, layer.node)
        if w_excl:
            self._replace_attr(w_node.target, weight, requires_grad)
            new_w = w_node
        else:
            new_w = self._new_param_node(w_node.target, weight, requires_grad, layer.node)
            notes.append(f"new weight '{self.qual(new_w.target)}' (the original is shared)")
        owner = owner_path(w_node.target)
        if b_node is not None and self._attr_exclusive(b_node, layer.node):
            self._replace_attr(b_node.target, bias, requires_grad)
            new_b = b_node
        elif b_node is None and w_excl and not hasattr(self.gm.get_submodule(owner), "bias"):
            self.gm.get_submodule(owner).register_parameter(
                "bias", nn.Parameter(bias.detach().clone(), requires_grad=requires_grad))
            with self.gm.graph.inserting_before(layer.node):
                new_b = self.gm.graph.get_attr(f"{owner}.bias" if owner else "bias")
        else:
            base = b_node.target if b_node is not None else (f"{owner}.bias" if owner else "bias")
            new_b = self._new_param_node(base, bias, requires_grad, layer.node)
        args["weight"], args["bias"] = new_w, new_b
        layer.node.args = tuple(args[n] for n, _ in layer.call.sig)
        layer.node.kwargs = {}
        for old in (w_node, b_node):
            if isinstance(old, fx.Node) and not old.users and not old._erased:
                self.gm.graph.erase_node(old)
        return "; ".join(notes)

    def _replace_attr(self, target: str, value: Tensor, requires_grad: bool) -> None:
        current = get_attr_value(self.gm, target)
        if self.ctx.inplace and isinstance(current, nn.Parameter):
            current.data = value.detach().to(current.dtype)  # inplace=True: overwrite
            return
        owner, _, attr = target.rpartition(".")
        setattr(self.gm.get_submodule(owner), attr, nn.Parameter(value.detach().clone(), requires_grad=requires_grad))

    def _new_param_node(self, base: str, value: Tensor, requires_grad: bool, before: fx.Node) -> fx.Node:
        name = free_name(self.gm, base.replace(".", "_") + "_bnfold")
        self.gm.register_parameter(name, nn.Parameter(value.detach().clone(), requires_grad=requires_grad))
        with self.gm.graph.inserting_before(before):
            return self.gm.graph.get_attr(name)

    def remove_bn(self, site: _BNSite, replacement: fx.Node) -> None:
        site.node.replace_all_uses_with(replacement)
        self.gm.graph.erase_node(site.node)
        for n in site.attr_nodes:
            if not n.users and not n._erased:
                self.gm.graph.erase_node(n)
        self.changed = True

    # -- the two directions -------------------------------------------------------
    def _rank_ok(self, site: _BNSite, layer: _Layer) -> Optional[str]:
        """None if the BN surely normalises the layer's channel dimension, else why not."""
        want = layer.weight.dim()  # batched rank of the layer's output (= its input for conv)
        if site.ranks and (layer.kind == "linear" or want not in site.ranks):
            return f"{site.name} computes a batch norm only on {list(site.ranks)}-D inputs"
        ranks: Optional[Set[int]] = None
        if site.module is not None:
            ranks = self.ctx.bn_input_ranks.get(id(site.module))
        elif layer.kind == "linear" and layer.module is not None:
            ranks = self.ctx.linear_out_ranks.get(id(layer.module))
        if ranks:
            if ranks != {want}:
                return (f"BatchNorm sees {sorted(ranks)}-D inputs but {layer.name} works on "
                        f"{want}-D batches, so BN's channel dim is not the layer's")
            return None
        if layer.kind == "linear":
            return ("cannot tell whether the BatchNorm normalises the Linear's features (2-D input) "
                    "or dim 1 of a 3-D input; pass example_inputs to fold() so it can see the shapes")
        return None

    def _mismatch(self, site: _BNSite, layer: _Layer, channels: int, side: str) -> Optional[str]:
        """Why the BN cannot normalise ``layer``'s ``side`` (``"input"`` / ``"output"``) with
        ``channels`` channels, or ``None``."""
        if channels != site.running_mean.numel():
            return f"{layer.name} has {channels} {side} channels, BN {site.running_mean.numel()}"
        return self._rank_ok(site, layer)

    def _fold(self, site: _BNSite, layer: _Layer, weight: Tensor, bias: Tensor, replacement: fx.Node,
              direction: str) -> Tuple[bool, str]:
        """Give ``layer`` the folded ``weight`` / ``bias``, drop the BN (its users read
        ``replacement``) and record the outcome."""
        note = self.install(layer, weight, bias)
        self.remove_bn(site, replacement)
        self.ctx.report.outcomes.append(BNOutcome(site.name, "folded", layer.name, direction, note))
        return True, ""

    def fold_preceding(self, site: _BNSite) -> Tuple[bool, str]:
        layer = self.layer(site.input)
        if isinstance(layer, str):
            if isinstance(site.input, fx.Node) and cat_parts(site.input) is not None:
                return self.fold_preceding_cat(site, site.input)
            src = features_to_dim1(site.input)
            if src is not None:
                return self.fold_preceding_tokens(site, src)
            return False, f"before it: {layer}"
        if len(value_users(layer.node)) != 1:  # x.shape / x.ndim reads stay valid after folding
            others = ", ".join(f"'{u.name}'" for u in value_users(layer.node) if u is not site.node)
            return False, (f"before it: output of {layer.name} is also used by {others} "
                           "(folding would change it for them)")
        why = self._mismatch(site, layer, layer.out_channels, "output")
        if why:
            return False, f"before it: {why}"
        w, b = fold_bn_into_preceding(layer.weight, layer.bias, site.running_mean, site.running_var,
                                      site.eps, site.weight, site.bias,
                                      transposed=layer.kind == "convt", groups=layer.groups)
        return self._fold(site, layer, w, b, layer.node, "preceding")

    # Note: [folding into the layers of a concatenation]
    # BN is per channel, so BN(cat([y_1, ..., y_k], 1)) == cat([BN_1(y_1), ..., BN_k(y_k)], 1)
    # where BN_i is BN restricted to the channels y_i occupies (its slice of running_mean,
    # running_var, weight, bias; the same eps). Where every y_i is a conv / linear output read
    # only by the concatenation (a mixed-kernel conv: split -> convs of several kernel sizes
    # -> cat), each BN_i folds into its layer as a preceding BN does, and the BN goes.
    def fold_preceding_cat(self, site: _BNSite, cat: fx.Node) -> Tuple[bool, str]:
        """Fold ``site`` into every layer whose output its input concatenates (along channels)."""
        layers = []
        for piece in cat.args[0] if cat.args else cat.kwargs["tensors"]:
            layer = self.layer(piece)
            if isinstance(layer, str):
                return False, (f"before it: a channel concatenation whose piece {layer}; a BN after a concatenation "
                               "folds only when every piece is a conv/linear output")
            layers.append(layer)
        ranks = {layer.weight.dim() for layer in layers}
        if len(ranks) != 1 or channel_cat_pieces(cat, ranks.pop()) is None or any(l.kind == "linear" for l in layers):
            return False, "before it: a concatenation, but not along the channels of conv outputs of one rank"
        if len({id(l.node) for l in layers}) != len(layers) or len(value_users(cat)) != 1:
            return False, "before it: the concatenation (or a layer output in it) is also used elsewhere"
        for layer in layers:
            if len(value_users(layer.node)) != 1:
                return False, (f"before it: output of {layer.name} is also used outside the concatenation "
                               "(folding would change it there)")
            why = self._rank_ok(site, layer)
            if why:
                return False, f"before it: {why}"
        if sum(l.out_channels for l in layers) != site.running_mean.numel():
            return False, (f"before it: the concatenated layers have {sum(l.out_channels for l in layers)} channels, "
                           f"BN {site.running_mean.numel()}")
        start, notes = 0, []
        for layer in layers:
            part = slice(start, start + layer.out_channels)
            start += layer.out_channels
            w, b = fold_bn_into_preceding(layer.weight, layer.bias, site.running_mean[part], site.running_var[part],
                                          site.eps, None if site.weight is None else site.weight[part],
                                          None if site.bias is None else site.bias[part],
                                          transposed=layer.kind == "convt", groups=layer.groups)
            note = self.install(layer, w, b)
            if note:
                notes.append(note)
        self.remove_bn(site, cat)
        names = ", ".join(l.name for l in layers)
        self.ctx.report.outcomes.append(BNOutcome(site.name, "folded", names, "preceding", "; ".join(notes)))
        return True, ""

    # Note: [folding into a linear layer over tokens]
    # A Linear on tokens (B, L, C_in) -> (B, L, C) with BatchNorm1d over its features is
    # written y.transpose(1, 2) -> BN1d -> (B, C, L): the transpose moves the Linear's feature
    # dim to BN's channel dim 1, so BN(y^T) == (s * y + t)^T folds into the Linear as a
    # preceding BN does (W' = s W per output feature), and the BN's users read the transpose.
    # The ranks seen on the sample input must say so: the BN's input 3-D, the Linear's output 3-D.
    def fold_preceding_tokens(self, site: _BNSite, src: fx.Node) -> Tuple[bool, str]:
        """Fold ``site`` into the linear layer whose 3-D output ``site.input`` transposes."""
        layer = self.layer(src)
        if isinstance(layer, str):
            return False, f"before it: a transpose of features to dim 1, but {layer}"
        if layer.kind != "linear":
            return False, f"before it: a transpose of {layer.name}'s output, not of a linear layer's tokens"
        if len(value_users(src)) != 1 or len(value_users(site.input)) != 1:
            return False, f"before it: the output of {layer.name} (or its transpose) is also used elsewhere"
        bn_ranks = self.ctx.bn_input_ranks.get(id(site.module)) if site.module is not None else None
        lin_ranks = self.ctx.linear_out_ranks.get(id(layer.module)) if layer.module is not None else None
        if bn_ranks != {3} or (layer.module is not None and lin_ranks != {3}):
            return False, (f"before it: a transpose of {layer.name}'s output; it folds only where the sample input "
                           "shows 3-D tokens (pass example_inputs to fold())")
        if layer.out_channels != site.running_mean.numel():
            return False, f"before it: {layer.name} has {layer.out_channels} output features, BN {site.running_mean.numel()}"
        w, b = fold_bn_into_preceding(layer.weight, layer.bias, site.running_mean, site.running_var,
                                      site.eps, site.weight, site.bias)
        note = self.install(layer, w, b)
        self.remove_bn(site, site.input)
        self.ctx.report.outcomes.append(BNOutcome(site.name, "folded", layer.name, "preceding", note))
        return True, ""

    # Note: [folding into the following conv]
    # conv(BN(x)) == conv'(x) with W' = W * s (per input channel) and b' = b + sum(W * t)
    # holds wherever the kernel only reads real input pixels. Zero padding breaks it: the
    # border reads 0, which would have to become BN(0)-equivalent t. With padding 0 /
    # 'valid' there is no border; with padding_mode 'reflect'/'replicate'/'circular' the
    # border is copied from real pixels of the same channel, and BN is per channel and
    # element-wise, so pad(BN(x)) == BN(pad(x)): also exact. Transposed convs insert zeros
    # (stride and padding), so they are never folded this way.
    def fold_following(self, site: _BNSite) -> Tuple[bool, str]:
        users = value_users(site.node)
        if len(users) != 1:
            return False, f"after it: BN output has {len(users)} users"
        layer = self.layer(users[0])
        if isinstance(layer, str):
            between = self._activation_before_layer(users[0])
            if between is not None:
                return False, (f"after it: {between[0]} sits between it and {between[1]} (pre-activation), "
                               "and act(BN(x)) is not a per-channel affine map, so it cannot be folded exactly")
            return False, f"after it: {layer}"
        if layer.kind == "convt":
            return False, f"after it: {layer.name} is a transposed conv (inserts zeros), not exact"
        if layer.call.input is not site.node or sum(a is site.node for a in pytree.tree_leaves((layer.node.args, layer.node.kwargs))) != 1:
            return False, f"after it: BN output is not (only) the input of {layer.name}"
        if layer.kind == "conv" and _pads_with_zeros(layer):
            return False, (f"after it: {layer.name} zero-pads its input, so folding the BN into it "
                           "would be inexact at the border")
        why = self._mismatch(site, layer, layer.in_channels, "input")
        if why:
            return False, f"after it: {why}"
        w, b = fold_bn_into_following(layer.weight, layer.bias, site.running_mean, site.running_var,
                                      site.eps, site.weight, site.bias, groups=layer.groups)
        return self._fold(site, layer, w, b, site.input, "following")

    def _activation_before_layer(self, node: fx.Node) -> Optional[Tuple[str, str]]:
        """``(activation, layer)`` names if ``node`` is an element-wise activation whose only
        value user is a conv / linear layer."""
        what = describe_activation(node, self.modules, self.qual)
        users = value_users(node)
        if what is None or len(users) != 1:
            return None
        layer = self.layer(users[0])
        return None if isinstance(layer, str) else (what, layer.name)

    def _norm_act_tails(self) -> None:
        """Replace each norm-act module whose batch norm was folded by its tail (its children)."""
        used = {str(n.target) for n in self.gm.graph.nodes if n.op == "get_attr"}
        for path in self.norm_act - used:
            mod = self.gm.get_submodule(path)
            parent, _, attr = path.rpartition(".")
            setattr(self.gm.get_submodule(parent), attr, NormActTail(mod))

    def _after_activation(self, site: _BNSite) -> Optional[str]:
        """Why a BN reading an activation of a conv/linear output (conv -> act -> BN) folds into
        neither neighbour, in words; ``None`` for any other BN."""
        act = site.input
        if not isinstance(act, fx.Node) or not act.args or not isinstance(act.args[0], fx.Node):
            return None
        if act.op == "call_module":
            is_act = activation_from_module(self.gm.get_submodule(str(act.target))) is not None
        else:
            name = act.target if act.op == "call_method" else getattr(act.target, "__name__", "")
            is_act = act.op in ("call_method", "call_function") and str(name).rstrip("_") in ACTIVATIONS
        layer = self.layer(act.args[0]) if is_act else None
        if not isinstance(layer, _Layer):
            return None
        return (f"BatchNorm after an activation: it follows '{act.name}' of {layer.name} (conv -> activation -> BN "
                "order), so it cannot fold into that layer, and it folds into the next conv/linear layer only where "
                "one reads it alone (zero padding aside)")

    def _left_reason(self, site: _BNSite, why_pre: str, why_post: str) -> str:
        first = (flattened_linear_reason(site.node, self.gm) if site.node.op == "call_module" else None) \
            or self._after_activation(site)
        return f"{first}; {why_pre}; {why_post}" if first else f"{why_pre}; {why_post}"

    def run(self) -> None:
        drop_noop_flattens(self.gm)  # Note: [a flatten between a Linear and its BatchNorm1d]
        absorb_conv_crops(self.gm, self.root)  # Note: [a crop of a convolution's output is less padding]
        for node in list(self.gm.graph.nodes):
            if node._erased or node.op not in ("call_module", "call_function"):
                continue
            site = self.bn_site(node)
            if site is None:
                continue
            if isinstance(site, BNOutcome):
                self.ctx.report.outcomes.append(site)
                continue
            with torch.no_grad():
                done, why_pre = self.fold_preceding(site)
                if done:
                    continue
                done, why_post = self.fold_following(site)
            if not done:
                self.ctx.report.leave(site.name, self._left_reason(site, why_pre, why_post))
        if self.changed:
            self._norm_act_tails()
            self.gm.graph.lint()
            delete_unused_submodules(self.gm, self.root)  # never a child of the user's own modules
            self.gm.recompile()
