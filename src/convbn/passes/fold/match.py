"""What fold matches in a traced graph: the BatchNorm a node applies (:class:`FoldSite`,
found as convert finds them: :func:`~convbn.passes.bn.sites.bn_call`) and the conv /
conv-transpose / linear next to it (:class:`FoldLayer`, found as convert finds them:
:func:`~convbn.passes.graph.layers.layer_call`), each with fold's own conditions; a match
that cannot fold whatever its neighbours are says why in a
:class:`~convbn.passes.report.outcome.BNOutcome` or a reason string."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple, Union

import torch
import torch.fx as fx
from torch import Tensor, nn

from ...functional.norms import NormCall, row_of_function, row_of_module
from ...nn.standard_bn import has_standard_bn_forward
from ..bn.frozen import frozen_bn_eps
from ..bn.sites import BNCall, bn_call
from ..graph.layers import LayerCall, has_standard_forward, layer_call, normalize_args
from ..report.outcome import BNOutcome
from .layers import UNSET, check_bn_foldable, const_tensor, owner_path

__all__ = ["FoldSite", "FoldLayer", "qualified", "match_bn", "match_layer"]


@dataclass
class FoldSite:
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
    inlined: str = ""  # the norm-act module's path, for a batch norm inlined from one


@dataclass
class FoldLayer:
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


def qualified(prefix: str, target: str) -> str:
    """``target``'s name in the whole model, for a graph traced at ``prefix``."""
    return f"{prefix}{target}" if target else prefix.rstrip(".") or "<root>"


def _eps(bn: nn.Module) -> float:
    """A BatchNorm module's eps; a frozen one's may be a constant in its forward (``frozen_bn_eps``)."""
    return float(bn.eps) if isinstance(getattr(bn, "eps", None), (int, float)) else frozen_bn_eps(bn)


def _module_why_not(call: BNCall, node: fx.Node) -> Optional[str]:
    """Why a BatchNorm module called by ``node`` cannot fold whatever its neighbours are, or ``None``."""
    mod = call.module
    why = check_bn_foldable(mod)
    if why is None and not has_standard_bn_forward(mod):
        why = (f"{type(mod).__name__} overrides forward() in a way that could not be traced "
               "into, so it may do more than batch norm")
    if why is None and (mod._forward_hooks or mod._forward_pre_hooks):
        why = "BatchNorm has forward hooks, which folding would drop"
    if why is None and (len(node.args) != 1 or node.kwargs):
        why = "BatchNorm called with extra arguments"
    return why


def match_bn(node: fx.Node, gm: fx.GraphModule, prefix: str, root: nn.Module) -> Union[FoldSite, BNOutcome, None]:
    """The BN applied by ``node``; its ``"left"`` outcome if it is a BN that cannot fold
    whatever its neighbours are; None if ``node`` is no BatchNorm.

    BatchNorms are found as convert finds them (:func:`~convbn.passes.bn.sites.bn_call`);
    the conditions here are fold's: eval mode with running statistics, torch's forward,
    no hooks, constant ``training=False`` statistics for a functional call.
    """
    call = bn_call(node, gm, prefix, root)
    if call is None:
        return _norm_site(node, gm, prefix)
    mod, name = call.module, call.name
    if call.kind == "functional":
        return _functional_site(call, gm)
    if call.kind == "inlined":
        why = None if call.ranks else check_bn_foldable(mod)
        reads = sum(1 for n in gm.graph.nodes if n.op == "get_attr" and n.target == call.target)
        if why is None and reads != 1:
            why = "the BatchNorm module is called more than once"
        if why is not None:
            return BNOutcome(name, "left", reason=why)
        return FoldSite(node, name, call.input, mod.running_mean, mod.running_var, _eps(mod),
                        mod.weight, mod.bias, mod, (node.args[0],), call.ranks, inlined=call.target)
    if call.kind == "module":
        why = _module_why_not(call, node)
        if why is not None:
            return BNOutcome(name, "left", reason=why)
    return FoldSite(node, name, call.input, mod.running_mean, mod.running_var, _eps(mod),
                    mod.weight, mod.bias, mod, (), call.ranks)


def _norm_site(node: fx.Node, gm: fx.GraphModule, prefix: str) -> Union[FoldSite, BNOutcome, None]:
    """A per-sample norm of the norm table (functional/norms.py) applied by ``node``: a site where
    its row says it folds (an InstanceNorm in eval mode normalising by its running statistics:
    the same per-channel affine map as an eval BatchNorm), else its ``"left"`` outcome with the
    row's reason; ``None`` where ``node`` computes none."""
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        row = row_of_module(mod)
        if row is None:
            return None
        name = qualified(prefix, str(node.target))
        got = row.call_of_module(mod)
        stats = getattr(mod, "running_mean", None) is not None
        why = got if isinstance(got, str) else row.fold(got, stats)
        if not why and (type(mod).forward not in row.standard_forwards or mod._forward_hooks or mod._forward_pre_hooks
                        or len(node.args) != 1 or node.kwargs):
            why = f"{type(mod).__name__} has its own forward, hooks or extra arguments, which folding would drop"
        if why:
            return BNOutcome(name, "left", reason=why)
        return FoldSite(node, name, node.args[0], mod.running_mean, mod.running_var, float(mod.eps),
                        mod.weight, mod.bias, mod, ())
    row = row_of_function(node.target) if node.op == "call_function" else None
    if row is None:
        return None
    where = f"{getattr(node.target, '__name__', node.target)}() call '{node.name}' in {qualified(prefix, '')}"
    args = normalize_args(node, row.signature)
    weight = args.get("weight") if args is not None else None
    if isinstance(weight, fx.Node) and weight.op == "get_attr" and "." in str(weight.target):
        # named by the module holding its gain, as convert names it
        where = qualified(prefix, str(weight.target).rpartition(".")[0])
    call = row.call_of_args(args) if args is not None else None
    why = row.fold(call, False) if isinstance(call, NormCall) else ""
    return BNOutcome(where, "left", reason=why or "cannot fold: per-sample statistics (a functional per-sample norm)")


def _functional_site(call: BNCall, gm: fx.GraphModule) -> Union[FoldSite, BNOutcome]:
    """An ``F.batch_norm`` / ``torch.batch_norm`` call, foldable with constant
    ``training=False`` and stored running statistics."""
    args, name = call.args, call.name
    if args is None:
        return BNOutcome(name, "left", reason="batch_norm call with arguments this pass does not understand")
    if args["training"] is not False:
        return BNOutcome(name, "left",
                         reason=f"batch_norm called with training={args['training']!r} (batch statistics)")
    values = {k: const_tensor(gm, args[k]) for k in ("running_mean", "running_var", "weight", "bias")}
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
    return FoldSite(call.node, name, args["input"], values["running_mean"], values["running_var"],
                    float(eps), values["weight"], values["bias"], None, attr_nodes)


def _not_a_layer(node: fx.Node, gm: fx.GraphModule) -> str:
    """Why ``node``, which calls no conv / linear, is no layer to fold into, in words."""
    if node.op == "call_module":
        what = type(gm.get_submodule(str(node.target))).__name__
        return f"'{node.name}' is a {what}, not a conv/linear layer"
    what = node.op if node.op != "call_function" else getattr(node.target, "__name__", str(node.target))
    return f"'{node.name}' ({what}) is not a conv/linear layer"


def match_layer(node: Any, gm: fx.GraphModule, prefix: str) -> Union[FoldLayer, str]:
    """The conv/linear applied by ``node`` (found as convert finds them:
    :func:`~convbn.passes.graph.layers.layer_call`), or a reason string why it is none."""
    if not isinstance(node, fx.Node):
        return "the input is not a graph value"
    call = layer_call(node, gm)
    if isinstance(call, str):
        return call
    if call is None:
        return _not_a_layer(node, gm)
    mod = call.module
    if mod is not None:
        name = qualified(prefix, str(node.target))
        if not has_standard_forward(mod):
            return f"{name} ({type(mod).__name__}) overrides forward()"
        if mod._forward_hooks or mod._forward_pre_hooks:
            return f"{name} has forward hooks"
        if torch.nn.utils.parametrize.is_parametrized(mod):
            return f"{name} is parametrized"
        return FoldLayer(call, name, mod.weight, mod.bias, getattr(mod, "groups", 1))
    weight = const_tensor(gm, call.args["weight"])
    bias = const_tensor(gm, call.args["bias"])
    if not isinstance(weight, Tensor) or bias is UNSET:
        return f"'{node.name}' uses a weight/bias computed in forward, not a stored parameter"
    groups = call.args.get("groups", 1)
    if not isinstance(groups, int):
        return f"'{node.name}' has non-constant groups"
    wt = call.args["weight"].target
    name = qualified(prefix, owner_path(wt)) if owner_path(wt) else qualified(prefix, wt)
    return FoldLayer(call, name, weight, bias, groups)
