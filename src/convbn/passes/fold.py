"""``convbn.fold``: fold eval-mode BatchNorm into neighbouring conv / linear layers (FX pass).

For inference a BatchNorm with running statistics is a per-channel affine map, so it can
be absorbed by the linear layer next to it (the maths lives in
:mod:`convbn.functional.fold`; this file only finds the patterns and does the graph
surgery):

* ``Conv{1,2,3}d -> BN``, ``ConvTranspose{1,2,3}d -> BN`` (any ``groups``) and
  ``Linear -> BatchNorm1d`` fold into the *preceding* layer (always exact);
* ``BN -> Conv`` / ``BN -> Linear`` fold into the *following* layer where that is exact
  (see Note: [folding into the following conv]).

Layers may be modules (``nn.Conv2d``...) or functional calls (``F.conv2d(x, self.weight)``
as in ``efficientnet_pytorch``), BatchNorms may be any ``_BatchNorm`` subclass
(``BatchNorm1d/2d/3d``, ``SyncBatchNorm``, user subclasses) or ``F.batch_norm`` /
``torch.batch_norm`` calls with constant running statistics and ``training=False``.

Public API::

    folded = convbn.fold(model)          # model must be in eval mode
    print(folded.fold_report)            # FoldReport: every BatchNorm, folded or why not

The report is attached to the returned module as the attribute ``fold_report`` (it is
not part of ``state_dict``). See :func:`fold` for the full contract.
"""
from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Set, Tuple, TypeVar, Union

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils import _pytree as pytree

from ..functional.fold import fold_bn_into_following, fold_bn_into_preceding
from .graph_module import preserve_module_state
from .shape_uses import value_users
from .trace import short_reason, trace
from .validate import as_args, compare_outputs

__all__ = ["fold", "fold_conv_bn_modules", "FoldReport", "FoldAction", "FoldCheck"]

LayerT = TypeVar("LayerT", bound=nn.Module)

# Note: [what "exact" means for the check]
# Folding changes the order of floating point operations, nothing else, so folded and
# unfolded outputs agree to rounding. The check in ``fold(check=True)`` allows, per
# floating output tensor, ``max|folded - reference| <= tol * max(1, max|reference|)`` with
# ``tol`` from this table (other dtypes: 1e-2).
CHECK_TOLERANCE: Dict[torch.dtype, float] = {
    torch.float64: 1e-10,
    torch.float32: 1e-4,
}
_DEFAULT_TOLERANCE = 1e-2

_CONV_MODULES: Tuple[type, ...] = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_CONVT_MODULES: Tuple[type, ...] = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
_LAYER_MODULES: Tuple[type, ...] = _CONV_MODULES + _CONVT_MODULES + (nn.Linear,)

# Argument names of the functional layers / batch norms we understand, in positional order,
# with the defaults the functions use.
_CONV_FNS = {F.conv1d, F.conv2d, F.conv3d}
_CONVT_FNS = {F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d}
_LINEAR_FNS = {F.linear}
_CONV_SIG = (("input", None), ("weight", None), ("bias", None), ("stride", 1), ("padding", 0),
             ("dilation", 1), ("groups", 1))
_CONVT_SIG = (("input", None), ("weight", None), ("bias", None), ("stride", 1), ("padding", 0),
              ("output_padding", 0), ("groups", 1), ("dilation", 1))
_LINEAR_SIG = (("input", None), ("weight", None), ("bias", None))
_F_BN_SIG = (("input", None), ("running_mean", None), ("running_var", None), ("weight", None),
             ("bias", None), ("training", False), ("momentum", 0.1), ("eps", 1e-5))
_TORCH_BN_SIG = (("input", None), ("weight", None), ("bias", None), ("running_mean", None),
                 ("running_var", None), ("training", None), ("momentum", None), ("eps", None),
                 ("cudnn_enabled", None))
_BN_FNS = {F.batch_norm: _F_BN_SIG, torch.batch_norm: _TORCH_BN_SIG}

_UNSET = object()


# --------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FoldAction:
    """What happened to one BatchNorm (module call or functional call).

    Attributes:
        batchnorm: qualified name of the BatchNorm module in the input model, or a
            description of a functional ``batch_norm`` call.
        folded: whether it was folded away.
        layer: qualified name of the conv/linear it was folded into (``None`` if skipped).
        direction: ``"preceding"`` (BN after the layer) or ``"following"`` (BN before it).
        reason: why it was skipped, or a note about the fold (e.g. a fresh copy was made).
    """

    batchnorm: str
    folded: bool
    layer: Optional[str] = None
    direction: Optional[str] = None
    reason: str = ""


@dataclass
class FoldCheck:
    """Result of the numerical check run by ``fold(check=True)``."""

    ran: bool
    note: str = ""
    input_shapes: Tuple[Tuple[int, ...], ...] = ()
    max_abs_diff: float = 0.0
    tolerance: float = 0.0
    passed: bool = True


@dataclass
class FoldReport:
    """Everything :func:`fold` did: one :class:`FoldAction` per BatchNorm call found, one
    per BatchNorm module never reached by tracing, the parts that could not be traced and
    the result of the numerical check. ``str(report)`` is a readable table.
    """

    actions: List[FoldAction] = field(default_factory=list)
    untraceable: List[Tuple[str, str]] = field(default_factory=list)
    check: Optional[FoldCheck] = None

    @property
    def folded(self) -> List[FoldAction]:
        return [a for a in self.actions if a.folded]

    @property
    def skipped(self) -> List[FoldAction]:
        return [a for a in self.actions if not a.folded]

    def __str__(self) -> str:
        rows = [("BatchNorm", "result", "layer", "reason / note")]
        for a in self.actions:
            result = f"folded ({a.direction})" if a.folded else "skipped"
            rows.append((a.batchnorm, result, a.layer or "-", a.reason or ""))
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = [
            f"FoldReport: {len(self.folded)} folded, {len(self.skipped)} skipped "
            f"({len(self.actions)} BatchNorm calls/modules)"
        ]
        for i, r in enumerate(rows):
            lines.append("  " + "  ".join(r[j].ljust(widths[j]) for j in range(3)) + "  " + r[3])
            if i == 0:
                lines.append("  " + "  ".join("-" * w for w in widths) + "  " + "-" * 13)
        for name, why in self.untraceable:
            lines.append(f"  untraceable: {name or '<root>'}: {why}")
        c = self.check
        if c is None:
            lines.append("  check: not requested")
        elif not c.ran:
            lines.append(f"  check: not run: {c.note}")
        else:
            verdict = "passed" if c.passed else "FAILED"
            lines.append(
                f"  check: {verdict}: max |folded - reference| = {c.max_abs_diff:.3g} "
                f"(allowed {c.tolerance:.3g}) on inputs {list(c.input_shapes)}"
                + (f"; {c.note}" if c.note else "")
            )
        return "\n".join(lines)


# --------------------------------------------------------------------------------------
# Module-level helper
# --------------------------------------------------------------------------------------


def _check_bn_foldable(bn: nn.Module) -> Optional[str]:
    """Why ``bn`` (a ``_BatchNorm``) cannot be folded, or ``None``."""
    if bn.training:
        return "BatchNorm is in training mode (it normalises with batch statistics); call .eval() on it to fold"
    if bn.running_mean is None or bn.running_var is None:
        return ("BatchNorm has no running statistics (track_running_stats=False): it normalises "
                "with batch statistics even in eval mode")
    if isinstance(bn.running_mean, nn.parameter.UninitializedTensorMixin):
        return "lazy BatchNorm is not initialised yet; run one forward pass first"
    return None


def _layer_out_channels(layer: nn.Module) -> int:
    if isinstance(layer, _CONVT_MODULES):
        return layer.weight.shape[1] * layer.groups
    return layer.weight.shape[0]


def _clone_with(layer: LayerT, weight: Tensor, bias: Tensor) -> LayerT:
    """A deep copy of ``layer`` with NEW ``weight`` / ``bias`` parameters.

    The old parameters are not copied (they are replaced straight away)."""
    memo: Dict[int, Any] = {id(layer.weight): None}
    if layer.bias is not None:
        memo[id(layer.bias)] = None
    new = copy.deepcopy(layer, memo)
    requires_grad = layer.weight.requires_grad
    new.weight = nn.Parameter(weight.detach(), requires_grad=requires_grad)
    new.bias = nn.Parameter(bias.detach(), requires_grad=requires_grad)
    return new


def fold_conv_bn_modules(layer: LayerT, bn: nn.Module) -> LayerT:
    """A fresh copy of ``layer`` with the eval-mode BatchNorm ``bn`` (applied after it)
    folded into its weight and bias: ``result(x) == bn(layer(x))``.

    Args:
        layer: ``nn.Conv{1,2,3}d``, ``nn.ConvTranspose{1,2,3}d`` or ``nn.Linear``
            (subclasses too); not modified.
        bn: a ``_BatchNorm`` (``BatchNorm1d/2d/3d``, ``SyncBatchNorm``...) in eval mode
            with running statistics; not modified.

    Returns:
        A new module of ``layer``'s type with new parameters (``bias`` always present).

    Raises:
        TypeError: unsupported module types.
        ValueError: ``bn`` in training mode / without running stats, or channel mismatch.
    """
    if not isinstance(layer, _LAYER_MODULES):
        raise TypeError(
            "fold_conv_bn_modules expects an nn.Conv1d/2d/3d, nn.ConvTranspose1d/2d/3d or "
            f"nn.Linear as `layer`, but got {type(layer).__name__}"
        )
    if not isinstance(bn, _BatchNorm):
        raise TypeError(f"fold_conv_bn_modules expects a BatchNorm module as `bn`, but got {type(bn).__name__}")
    why = _check_bn_foldable(bn)
    if why is not None:
        raise ValueError(f"cannot fold {type(bn).__name__}: {why}")
    if bn.running_mean.numel() != _layer_out_channels(layer):
        raise ValueError(
            f"{type(bn).__name__} has {bn.running_mean.numel()} channels but "
            f"{type(layer).__name__} produces {_layer_out_channels(layer)}"
        )
    transposed = isinstance(layer, _CONVT_MODULES)
    with torch.no_grad():
        w, b = fold_bn_into_preceding(
            layer.weight, layer.bias, bn.running_mean, bn.running_var, bn.eps, bn.weight, bn.bias,
            transposed=transposed, groups=getattr(layer, "groups", 1),
        )
    return _clone_with(layer, w, b)


# --------------------------------------------------------------------------------------
# Tracing: a tracer that turns submodules it cannot trace into opaque leaves
# --------------------------------------------------------------------------------------


def _defining_module(cls: type, attr: str) -> str:
    for klass in cls.__mro__:
        if attr in vars(klass):
            return klass.__module__
    return ""


def _has_standard_forward(m: nn.Module) -> bool:
    """``m``'s forward is one of torch.nn's own (not overridden by a user subclass)."""
    return _defining_module(type(m), "forward").startswith("torch.nn.")


class _FoldTracer(fx.Tracer):
    """fold's leaf policy: conv/linear/BatchNorm modules (subclasses too) that keep torch's
    ``forward`` are leaves (the default tracer traces into user subclasses, and
    ``_BatchNorm`` cannot be traced into: ``_check_input_dim`` branches on the input's
    rank). Partial tracing, hooks and hazards: :func:`convbn.passes.trace.trace`."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if isinstance(m, (_BatchNorm,) + _LAYER_MODULES) and _has_standard_forward(m):
            return True
        return super().is_leaf_module(m, module_qualified_name)


# --------------------------------------------------------------------------------------
# Graph helpers
# --------------------------------------------------------------------------------------


def _normalize(node: fx.Node, sig: Sequence[Tuple[str, Any]]) -> Optional[Dict[str, Any]]:
    """Arguments of a call_function node by name (defaults filled in), or None if odd."""
    if len(node.args) > len(sig):
        return None
    names = [n for n, _ in sig]
    out = dict(sig)
    for name, value in zip(names, node.args):
        out[name] = value
    for key, value in node.kwargs.items():
        if key not in out:
            return None
        out[key] = value
    return out


def _get_attr_value(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for atom in target.split("."):
        obj = getattr(obj, atom)
    return obj


def _const_tensor(gm: fx.GraphModule, arg: Any) -> Union[Tensor, None, object]:
    """The tensor a ``get_attr`` argument refers to; ``None`` for None; _UNSET otherwise."""
    if arg is None:
        return None
    if isinstance(arg, fx.Node) and arg.op == "get_attr":
        value = _get_attr_value(gm, arg.target)
        if isinstance(value, Tensor):
            return value
    return _UNSET


def _owner_path(target: str) -> str:
    return target.rsplit(".", 1)[0] if "." in target else ""


def _is_zero_padding(padding: Any) -> bool:
    if isinstance(padding, str):
        return padding == "valid"
    if isinstance(padding, int):
        return padding == 0
    if isinstance(padding, (tuple, list)):
        return all(isinstance(p, int) and p == 0 for p in padding)
    return False


def _free_name(gm: fx.GraphModule, base: str) -> str:
    name, i = base, 1
    while True:
        try:
            _get_attr_value(gm, name)
        except AttributeError:
            return name
        i += 1
        name = f"{base}{i}"


# --------------------------------------------------------------------------------------
# The pass
# --------------------------------------------------------------------------------------


@dataclass
class _Ctx:
    report: FoldReport
    inplace: bool
    bn_input_ranks: Dict[int, Set[int]]   # id(BN module) -> ranks of its inputs (sample run)
    linear_out_ranks: Dict[int, Set[int]]  # id(Linear module) -> ranks of its outputs


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


@dataclass
class _BNSkip:
    """A BatchNorm application that cannot be folded whatever its neighbours are."""

    name: str
    reason: str


@dataclass
class _Layer:
    """A conv / conv-transpose / linear application in a graph, module or functional."""

    node: fx.Node
    name: str
    kind: str  # "conv", "convt", "linear"
    weight: Tensor
    bias: Optional[Tensor]
    groups: int
    module: Optional[nn.Module]
    args: Optional[Dict[str, Any]]  # normalised args for functional layers

    @property
    def out_channels(self) -> int:
        return self.weight.shape[1] * self.groups if self.kind == "convt" else self.weight.shape[0]

    @property
    def in_channels(self) -> int:
        return self.weight.shape[0] if self.kind == "convt" else self.weight.shape[1] * self.groups


class _GraphFolder:
    """Folds the BatchNorms of one traced GraphModule (``prefix``: its qualified name)."""

    def __init__(self, gm: fx.GraphModule, root: nn.Module, prefix: str, ctx: _Ctx) -> None:
        self.gm = gm
        self.root = root  # the traced module (gm only holds the parts the graph uses)
        self.prefix = prefix
        self.ctx = ctx
        self.modules = dict(gm.named_modules())
        self.changed = False

    # -- naming -------------------------------------------------------------------
    def qual(self, target: str) -> str:
        return f"{self.prefix}{target}" if target else self.prefix.rstrip(".") or "<root>"

    # -- matching -----------------------------------------------------------------
    def bn_site(self, node: fx.Node) -> Union[_BNSite, _BNSkip, None]:
        """The BN applied by ``node``; a :class:`_BNSkip` if it is a BN that cannot fold;
        None if ``node`` is no BatchNorm."""
        if node.op == "call_module":
            mod = self.modules.get(node.target)
            if not isinstance(mod, _BatchNorm):
                return None
            name = self.qual(node.target)
            why = _check_bn_foldable(mod)
            if why is None and not _has_standard_forward(mod):
                why = (f"{type(mod).__name__} overrides forward() in a way that could not be traced "
                       "into, so it may do more than batch norm")
            if why is None and (mod._forward_hooks or mod._forward_pre_hooks):
                why = "BatchNorm has forward hooks, which folding would drop"
            if why is None and (len(node.args) != 1 or node.kwargs):
                why = "BatchNorm called with extra arguments"
            if why is not None:
                return _BNSkip(name, why)
            return _BNSite(node, name, node.args[0], mod.running_mean, mod.running_var, mod.eps,
                           mod.weight, mod.bias, mod, ())
        if node.op == "call_function" and node.target in _BN_FNS:
            args = _normalize(node, _BN_FNS[node.target])
            rm_node = args.get("running_mean") if args else None
            name = self._functional_bn_name(node, rm_node)
            if args is None:
                return _BNSkip(name, "batch_norm call with arguments this pass does not understand")
            if args["training"] is not False:
                return _BNSkip(name, f"batch_norm called with training={args['training']!r} (batch statistics)")
            values = {k: _const_tensor(self.gm, args[k]) for k in ("running_mean", "running_var", "weight", "bias")}
            if values["running_mean"] is None or values["running_var"] is None:
                return _BNSkip(name, "batch_norm called without running statistics")
            if any(v is _UNSET for v in values.values()):
                return _BNSkip(name, "batch_norm statistics/affine parameters are computed in forward, not stored attributes")
            eps = args["eps"]
            if not isinstance(eps, (int, float)):
                return _BNSkip(name, "batch_norm eps is not a constant")
            attr_nodes = tuple(args[k] for k in ("running_mean", "running_var", "weight", "bias")
                               if isinstance(args[k], fx.Node))
            return _BNSite(node, name, args["input"], values["running_mean"], values["running_var"],
                           float(eps), values["weight"], values["bias"], None, attr_nodes)
        return None

    def _functional_bn_name(self, node: fx.Node, rm_node: Any) -> str:
        if isinstance(rm_node, fx.Node) and rm_node.op == "get_attr":
            owner = _owner_path(rm_node.target)
            try:
                owner_module = self.root.get_submodule(owner)
            except AttributeError:
                owner_module = None
            if owner and isinstance(owner_module, _BatchNorm):
                return self.qual(owner)  # a BatchNorm subclass whose forward was traced into
        where = self.prefix.rstrip(".") or "<root>"
        return f"{node.target.__name__}() call '{node.name}' in {where}"

    def layer(self, node: Any) -> Union[_Layer, str]:
        """The conv/linear applied by ``node``, or a reason string why it is none."""
        if not isinstance(node, fx.Node):
            return "the input is not a graph value"
        if node.op == "call_module":
            mod = self.modules.get(node.target)
            if not isinstance(mod, _LAYER_MODULES):
                return f"'{node.name}' is a {type(mod).__name__}, not a conv/linear layer"
            name = self.qual(node.target)
            if not _has_standard_forward(mod):
                return f"{name} ({type(mod).__name__}) overrides forward()"
            if mod._forward_hooks or mod._forward_pre_hooks:
                return f"{name} has forward hooks"
            if torch.nn.utils.parametrize.is_parametrized(mod):
                return f"{name} is parametrized"
            kind = "convt" if isinstance(mod, _CONVT_MODULES) else "linear" if isinstance(mod, nn.Linear) else "conv"
            return _Layer(node, name, kind, mod.weight, mod.bias, getattr(mod, "groups", 1), mod, None)
        if node.op == "call_function" and node.target in (_CONV_FNS | _CONVT_FNS | _LINEAR_FNS):
            if node.target in _CONV_FNS:
                kind, sig = "conv", _CONV_SIG
            elif node.target in _CONVT_FNS:
                kind, sig = "convt", _CONVT_SIG
            else:
                kind, sig = "linear", _LINEAR_SIG
            args = _normalize(node, sig)
            if args is None:
                return f"'{node.name}' has arguments this pass does not understand"
            weight = _const_tensor(self.gm, args["weight"])
            bias = _const_tensor(self.gm, args["bias"])
            if not isinstance(weight, Tensor) or bias is _UNSET:
                return f"'{node.name}' uses a weight/bias computed in forward, not a stored parameter"
            groups = args.get("groups", 1)
            if not isinstance(groups, int):
                return f"'{node.name}' has non-constant groups"
            wt = args["weight"].target
            name = self.qual(_owner_path(wt)) if _owner_path(wt) else self.qual(wt)
            return _Layer(node, name, kind, weight, bias, groups, None, args)
        what = node.op if node.op != "call_function" else getattr(node.target, "__name__", str(node.target))
        return f"'{node.name}' ({what}) is not a conv/linear layer"

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
        owner = _owner_path(target)
        for n in self.gm.graph.nodes:
            if n is attr_node:
                continue
            if n.op == "get_attr" and n.target == target:
                return False
            if n.op == "call_module" and (owner == n.target or owner.startswith(n.target + ".")):
                return False
        value = _get_attr_value(self.gm, target)
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
                new = _clone_with(layer.module, weight, bias)
                parent, _, attr = target.rpartition(".")
                setattr(self.gm.get_submodule(parent), attr, new)
                self.modules[target] = new
                return ""
            new_target = _free_name(self.gm, target + "_bnfold")
            new = _clone_with(layer.module, weight, bias)
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
        owner = _owner_path(w_node.target)
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
        sig = _CONV_SIG if layer.kind == "conv" else _CONVT_SIG if layer.kind == "convt" else _LINEAR_SIG
        layer.node.args = tuple(args[n] for n, _ in sig)
        layer.node.kwargs = {}
        for old in (w_node, b_node):
            if isinstance(old, fx.Node) and not old.users and not old._erased:
                self.gm.graph.erase_node(old)
        return "; ".join(notes)

    def _replace_attr(self, target: str, value: Tensor, requires_grad: bool) -> None:
        current = _get_attr_value(self.gm, target)
        if self.ctx.inplace and isinstance(current, nn.Parameter):
            current.data = value.detach().to(current.dtype)  # inplace=True: overwrite
            return
        owner, _, attr = target.rpartition(".")
        setattr(self.gm.get_submodule(owner), attr, nn.Parameter(value.detach().clone(), requires_grad=requires_grad))

    def _new_param_node(self, base: str, value: Tensor, requires_grad: bool, before: fx.Node) -> fx.Node:
        name = _free_name(self.gm, base.replace(".", "_") + "_bnfold")
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

    def fold_preceding(self, site: _BNSite) -> Tuple[bool, str]:
        layer = self.layer(site.input)
        if isinstance(layer, str):
            return False, f"before it: {layer}"
        if len(value_users(layer.node)) != 1:  # x.shape / x.ndim reads stay valid after folding
            others = ", ".join(f"'{u.name}'" for u in value_users(layer.node) if u is not site.node)
            return False, (f"before it: output of {layer.name} is also used by {others} "
                           "(folding would change it for them)")
        if layer.out_channels != site.running_mean.numel():
            return False, f"before it: {layer.name} has {layer.out_channels} output channels, BN {site.running_mean.numel()}"
        why = self._rank_ok(site, layer)
        if why:
            return False, f"before it: {why}"
        w, b = fold_bn_into_preceding(layer.weight, layer.bias, site.running_mean, site.running_var,
                                      site.eps, site.weight, site.bias,
                                      transposed=layer.kind == "convt", groups=layer.groups)
        note = self.install(layer, w, b)
        self.remove_bn(site, layer.node)
        self.ctx.report.actions.append(FoldAction(site.name, True, layer.name, "preceding", note))
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
            return False, f"after it: {layer}"
        if layer.kind == "convt":
            return False, f"after it: {layer.name} is a transposed conv (inserts zeros), not exact"
        first = layer.node.args[0] if layer.node.args else layer.node.kwargs.get("input")
        if first is not site.node or sum(a is site.node for a in pytree.tree_leaves((layer.node.args, layer.node.kwargs))) != 1:
            return False, f"after it: BN output is not (only) the input of {layer.name}"
        if layer.kind == "conv":
            if layer.module is not None:
                m = layer.module
                zero_pad = m.padding_mode == "zeros" and not _is_zero_padding(m.padding)
                if m.padding == "same":
                    zero_pad = m.padding_mode == "zeros" and any(d * (k - 1) for d, k in zip(m.dilation, m.kernel_size))
            else:
                pad = layer.args["padding"]
                zero_pad = not _is_zero_padding(pad)
                if pad == "same":
                    dil = layer.args["dilation"]
                    ks = layer.weight.shape[2:]
                    dil = [dil] * len(ks) if isinstance(dil, int) else dil
                    zero_pad = any(d * (k - 1) for d, k in zip(dil, ks))
            if zero_pad:
                return False, (f"after it: {layer.name} zero-pads its input, so folding the BN into it "
                               "would be inexact at the border")
        if layer.in_channels != site.running_mean.numel():
            return False, f"after it: {layer.name} has {layer.in_channels} input channels, BN {site.running_mean.numel()}"
        why = self._rank_ok(site, layer)
        if why:
            return False, f"after it: {why}"
        w, b = fold_bn_into_following(layer.weight, layer.bias, site.running_mean, site.running_var,
                                      site.eps, site.weight, site.bias, groups=layer.groups)
        note = self.install(layer, w, b)
        self.remove_bn(site, site.input)
        self.ctx.report.actions.append(FoldAction(site.name, True, layer.name, "following", note))
        return True, ""

    def run(self) -> None:
        for node in list(self.gm.graph.nodes):
            if node._erased or node.op not in ("call_module", "call_function"):
                continue
            site = self.bn_site(node)
            if site is None:
                continue
            if isinstance(site, _BNSkip):
                self.ctx.report.actions.append(FoldAction(site.name, False, reason=site.reason))
                continue
            with torch.no_grad():
                done, why_pre = self.fold_preceding(site)
                if done:
                    continue
                done, why_post = self.fold_following(site)
            if not done:
                self.ctx.report.actions.append(FoldAction(site.name, False, reason=f"{why_pre}; {why_post}"))
        if self.changed:
            self.gm.graph.lint()
            self.gm.delete_all_unused_submodules()
            self.gm.recompile()


def _is_container_only(m: nn.Module) -> bool:
    return isinstance(m, (nn.ModuleList, nn.ModuleDict))


def _fold_module(module: nn.Module, prefix: str, ctx: _Ctx) -> nn.Module:
    """Fold inside ``module`` (qualified name ``prefix``); returns its replacement."""
    if _is_container_only(module):
        _fold_children(module, prefix, ctx)
        return module
    try:
        traced = trace(module, _FoldTracer)
    except Exception as exc:  # noqa: BLE001 - untraceable: fold its children one by one
        ctx.report.untraceable.append((prefix.rstrip("."), f"{short_reason(exc)} (folded part by part)"))
        _fold_children(module, prefix, ctx)
        return module
    gm = traced.gm
    preserve_module_state(module, gm)
    folder = _GraphFolder(gm, module, prefix, ctx)
    folder.run()
    changed = folder.changed
    for target, why in traced.descend().items():
        if target not in dict(gm.named_modules()):
            continue
        if target in traced.opaque:
            ctx.report.untraceable.append((prefix + target, f"{why} (kept as an opaque module)"))
        sub = gm.get_submodule(target)
        new = _fold_module(sub, f"{prefix}{target}.", ctx)
        if new is not sub:
            parent, _, attr = target.rpartition(".")
            setattr(gm.get_submodule(parent), attr, new)
            changed = True
    return gm if changed else module


def _fold_children(module: nn.Module, prefix: str, ctx: _Ctx) -> None:
    for name, child in list(module.named_children()):
        if isinstance(child, (_BatchNorm,) + _LAYER_MODULES):
            continue  # a lone layer: nothing to fold inside
        if type(child).__module__.startswith("torch.nn.") and not isinstance(
                child, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):
            continue  # a torch leaf (activation, pooling...): nothing to fold inside
        new = _fold_module(child, f"{prefix}{name}.", ctx)
        if new is not child:
            setattr(module, name, new)


# --------------------------------------------------------------------------------------
# Sample inputs and the check
# --------------------------------------------------------------------------------------


def _candidate_inputs(model: nn.Module) -> Iterator[Tuple[Tensor, ...]]:
    first = next((m for m in model.modules() if isinstance(m, _LAYER_MODULES)), None)
    if first is None:
        return
    w = first.weight
    if isinstance(first, nn.Linear):
        yield (torch.randn(2, first.in_features, dtype=w.dtype, device=w.device),)
        return
    dims = w.dim() - 2
    sizes = {1: (64, 128, 32), 2: (32, 64, 28, 224), 3: (32, 16, 64)}[dims]
    for s in sizes:
        yield (torch.randn(2, first.in_channels, *([s] * dims), dtype=w.dtype, device=w.device),)


def _run(model: nn.Module, args: Tuple[Any, ...]) -> Any:
    """``model(*args)`` without grad, with a fixed RNG seed (so dropout left in training
    mode draws the same masks twice), on copies of the inputs (the model may modify them
    in place) and without changing the buffers of modules in training mode."""
    args = pytree.tree_map(lambda t: t.clone() if isinstance(t, Tensor) else t, args)
    cuda = sorted({t.device.index or 0 for t in pytree.tree_leaves(args) if isinstance(t, Tensor) and t.is_cuda})
    saved = [(b, b.clone()) for m in model.modules() if m.training for b in m.buffers(recurse=False)]
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=cuda):
            torch.manual_seed(0)
            return model(*args)
    finally:
        with torch.no_grad():
            for b, value in saved:
                b.copy_(value)


def _reference_run(model: nn.Module, example_inputs: Any, ctx: _Ctx) -> Tuple[Optional[Tuple[Any, ...]], Any, str]:
    """Run ``model`` once on a sample input, recording BN input / Linear output ranks.

    Returns ``(args, output, note)``; ``args`` is None when no input could be found."""
    handles = []

    def record(store: Dict[int, Set[int]], use_output: bool):
        def hook(mod: nn.Module, inputs: Tuple[Any, ...], output: Any) -> None:
            t = output if use_output else (inputs[0] if inputs else None)
            if isinstance(t, Tensor):
                store.setdefault(id(mod), set()).add(t.dim())
        return hook

    for m in model.modules():
        if isinstance(m, _BatchNorm):
            handles.append(m.register_forward_hook(record(ctx.bn_input_ranks, False)))
        elif isinstance(m, nn.Linear):
            handles.append(m.register_forward_hook(record(ctx.linear_out_ranks, True)))
    try:
        if example_inputs is not None:
            args = as_args(example_inputs)
            out = _run(model, args)
            return args, out, ""
        tried = []
        for args in _candidate_inputs(model):
            try:
                out = _run(model, args)
            except Exception as exc:  # noqa: BLE001 - wrong guess, try the next one
                tried.append(f"{tuple(args[0].shape)} ({short_reason(exc)[:60]})")
                ctx.bn_input_ranks.clear()
                ctx.linear_out_ranks.clear()
                continue
            return args, out, f"inferred input {tuple(args[0].shape)}"
        note = "could not infer a sample input"
        if tried:
            note += " (tried " + ", ".join(tried) + ")"
        return None, None, note + "; pass example_inputs=... to fold() to check the result"
    finally:
        for h in handles:
            h.remove()


def _float64_errors(model: nn.Module, args: Tuple[Any, ...], reference: Any) -> Optional[List[float]]:
    """Per floating output of ``reference`` (the model's own run), ``max|reference - exact|``
    where ``exact`` is a float64 run of a copy of ``model`` on the same inputs: what eager
    itself gets wrong in its dtype. ``None`` if the model does not run in float64."""
    leaves = [t for t in pytree.tree_leaves(reference) if isinstance(t, Tensor) and t.is_floating_point()]
    if all(t.dtype == torch.float64 for t in leaves):
        return [0.0] * len(leaves)
    try:
        model64 = copy.deepcopy(model).double()
        args64 = pytree.tree_map(lambda t: t.double() if isinstance(t, Tensor) and t.is_floating_point() else t, args)
        exact = [t for t in pytree.tree_leaves(_run(model64, args64)) if isinstance(t, Tensor) and t.is_floating_point()]
    except Exception:  # noqa: BLE001 - e.g. a kernel without float64: fall back to the fixed tolerance
        return None
    if len(exact) != len(leaves):
        return None
    errs = []
    for a, e in zip(leaves, exact):
        finite = torch.isfinite(a) & torch.isfinite(e)
        errs.append((a.double() - e)[finite].abs().max().item() if finite.any() else 0.0)
    return errs


# Note: [fold's tolerance follows eager's own rounding]
# A fixed relative tolerance is tighter than float32 itself on deep nets: folding only
# reorders rounding, but eager's float32 result is already off the exact one by an amount
# that grows with depth and with the BN scales. So the check runs the *original* once more
# in float64 and allows, per output, ``tol * max(1, max|ref|)`` plus ``EAGER_ERROR_FACTOR``
# times eager's own distance to that float64 result: a fold as accurate as eager differs
# from eager by at most twice it; a wrong fold differs by far more.
EAGER_ERROR_FACTOR = 4.0


def _compare(reference: Any, folded: Any, eager_errors: Optional[List[float]] = None) -> Tuple[float, float, bool, str]:
    slack = None if eager_errors is None else [EAGER_ERROR_FACTOR * e for e in eager_errors]
    result = compare_outputs(reference, folded, lambda dt: CHECK_TOLERANCE.get(dt, _DEFAULT_TOLERANCE), slack)
    return result.max_abs_diff, result.allowed, result.ok, result.note


# --------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------


def _fold_finer(model: nn.Module, args: Tuple[Any, ...], reference: Any, eager_errors: Optional[List[float]],
                why: str) -> Optional[nn.Module]:
    """Where the whole-model fold differs from eager (a trace that misleads in a way no
    hazard check saw), fold each child of a fresh copy on its own -- each validated on the
    inputs it received in an eager run, recursively finer where it differs too -- and keep
    the model's own forward. ``None`` if that is not closer to eager either."""
    work = copy.deepcopy(model)
    inputs: Dict[str, Tuple[Any, ...]] = {}
    handles = []
    for name, child in work.named_children():
        def record(mod: nn.Module, a: Tuple[Any, ...], k: Dict[str, Any], name: str = name) -> None:
            if name not in inputs and not k:
                inputs[name] = pytree.tree_map(lambda t: t.detach().clone() if isinstance(t, Tensor) else t, a)
        handles.append(child.register_forward_pre_hook(record, with_kwargs=True))
    try:
        _run(work, args)
    finally:
        for h in handles:
            h.remove()
    report = FoldReport()
    report.untraceable.append(("", f"folding the whole model changed its outputs ({why}); folded child by child"))
    for name, child in list(work.named_children()):
        if name not in inputs or not any(isinstance(m, _BatchNorm) for m in child.modules()):
            continue
        try:
            new = fold(child, example_inputs=inputs[name])
        except RuntimeError as exc:  # this child cannot be folded faithfully: keep it as it is
            report.untraceable.append((name, f"left unfolded: {short_reason(exc)}"))
            continue
        sub = new.fold_report
        report.actions += [FoldAction(f"{name}.{a.batchnorm}", a.folded, a.layer and f"{name}.{a.layer}", a.direction,
                                      a.reason) for a in sub.actions]
        report.untraceable += [(f"{name}.{n}" if n else name, w) for n, w in sub.untraceable]
        work._modules[name] = new
    seen = {a.batchnorm for a in report.actions}
    for bn_name, m in work.named_modules():
        if isinstance(m, _BatchNorm) and bn_name not in seen:
            report.actions.append(FoldAction(bn_name, False, reason="called by the model's own forward, which is kept"))
    out = _run(work, args)
    diff, tol, ok, note = _compare(reference, out, eager_errors)
    shapes = tuple(tuple(a.shape) for a in args if isinstance(a, Tensor))
    report.check = FoldCheck(True, note, shapes, diff, tol, ok)
    if not ok or not report.folded:  # nothing gained: report the whole-model failure instead
        return None
    warnings.warn(f"fold(): folding the whole model changed its outputs ({why}); folded it child by child "
                  "instead (see fold_report)", RuntimeWarning, stacklevel=3)
    work.fold_report = report
    return work


def _bn_modules(model: nn.Module) -> Dict[int, Tuple[nn.Module, List[str]]]:
    found: Dict[int, Tuple[nn.Module, List[str]]] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        if isinstance(m, _BatchNorm):
            found.setdefault(id(m), (m, []))[1].append(name)
    return found


def fold(
    model: nn.Module,
    *,
    inplace: bool = False,
    example_inputs: Any = None,
    check: bool = True,
) -> nn.Module:
    """Fold every foldable eval-mode BatchNorm of ``model`` into a neighbouring layer.

    ``model`` is traced with ``torch.fx`` (nested ``Sequential``\\ s and wrapper modules are
    flattened). Each BatchNorm is folded into the conv / conv-transpose / linear layer
    before it (``W' = s W``, ``b' = s (b - mu) + beta`` with ``s = gamma / sqrt(var + eps)``)
    or, where exact, into the conv / linear after it; otherwise it stays and the report
    says why. Never folded: BatchNorms in training mode or without running statistics, a
    layer whose output is also used elsewhere, a following conv with zero padding. A layer
    that is called more than once is folded into a fresh copy for the BN's call only.
    Submodules that cannot be traced are kept as they are and folded inside on their own
    (the whole model too, child by child, if its own ``forward`` cannot be traced).

    Args:
        model: the network, in eval mode (``model.eval()``).
        inplace: ``False`` (default) works on a deep copy: ``model`` keeps its parameters
            and outputs. ``True`` reuses ``model``'s submodules and overwrites the weights
            of layers it folds into (less memory); afterwards use only the returned
            module, ``model`` itself no longer computes the same function.
        example_inputs: a tensor or a tuple of positional arguments for ``model``; used
            for the check and to see tensor ranks (needed to fold Linear <-> BatchNorm1d).
            If ``None`` a small input is inferred from the first conv/linear layer when
            possible (the report says when it is not).
        check: run the sample input through the model before and after folding (eval,
            no grad, same RNG seed) and raise if the outputs differ by more than
            ``tol * max(1, max|reference|)`` (``tol`` = 1e-4 for float32, 1e-10 for
            float64, see ``CHECK_TOLERANCE``) plus 4x what the original itself gets wrong
            in its dtype, measured against a float64 run of a copy (see Note: [fold's
            tolerance follows eager's own rounding]).

    Returns:
        The folded model (a ``torch.fx.GraphModule`` when ``model`` traced whole and
        something was folded, else the (copied) model with folded children). Its
        attribute ``fold_report`` is a :class:`FoldReport` listing every BatchNorm.

    Raises:
        TypeError: ``model`` is not an ``nn.Module`` (or is a TorchScript module).
        ValueError: ``model`` is in training mode.
        RuntimeError: ``check=True`` and the folded model's outputs differ.

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8)).eval()
        >>> folded = fold(net, example_inputs=torch.randn(1, 3, 16, 16))
        >>> print(folded.fold_report)  # doctest: +SKIP
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"fold() expects a torch.nn.Module, but got {type(model).__name__}")
    if isinstance(model, torch.jit.ScriptModule):
        raise TypeError(
            "fold() needs the eager nn.Module, but got a TorchScript module; fold first, then "
            "torch.jit.script the folded model"
        )
    if model.training:
        raise ValueError(
            "fold() folds BatchNorm running statistics, which only define the model's output in "
            "eval mode, but the model is in training mode. Call model.eval() first (a BatchNorm "
            "you deliberately left in training mode inside an eval model is skipped and reported)."
        )
    work = model if inplace else copy.deepcopy(model)
    report = FoldReport()
    ctx = _Ctx(report, inplace, {}, {})
    bns = _bn_modules(work)

    args, reference, note = (None, None, "")
    if check or example_inputs is not None:
        args, reference, note = _reference_run(work, example_inputs, ctx)
    # A float64 copy of the original is run only if the fixed tolerance fails (see Note:
    # [fold's tolerance follows eager's own rounding]); with inplace, copied before folding.
    original = (copy.deepcopy(work) if inplace else model) if check and args is not None else None

    folded = _fold_module(work, "", ctx)

    # Account for every BatchNorm module, including ones tracing never reached.
    seen = {a.batchnorm for a in report.actions}
    untraced = [name for name, _ in report.untraceable]
    for mod, names in bns.values():
        if seen.intersection(names):
            continue
        name = names[0]
        inside = [u for u in untraced if u == "" or name.startswith(u + ".")]
        if inside:
            why = f"inside '{max(inside, key=len) or '<root>'}', which could not be traced; left as is"
        else:
            why = "not called in the traced forward (unused, or only reached in a way tracing cannot see); left as is"
        report.actions.append(FoldAction(name, False, reason=why))

    if check:
        if args is None:
            report.check = FoldCheck(ran=False, note=note)
        else:
            try:
                out = _run(folded, args)
            except Exception as exc:
                report.check = FoldCheck(ran=True, note=f"folded model failed: {short_reason(exc)}", passed=False)
                finer = None if inplace else _fold_finer(model, args, reference, None, short_reason(exc))
                if finer is not None:
                    return finer
                raise RuntimeError(f"fold(): the folded model fails on the sample input.\n{report}") from exc
            diff, tol, ok, why = _compare(reference, out)
            eager_errors = None
            if not ok and original is not None:
                eager_errors = _float64_errors(original, args, reference)
                if eager_errors is not None:
                    diff, tol, ok, why = _compare(reference, out, eager_errors)
            if not ok and not inplace:
                finer = _fold_finer(model, args, reference, eager_errors, f"max abs diff {diff:.3g} > {tol:.3g}")
                if finer is not None:
                    return finer
            if eager_errors is not None and any(eager_errors):
                note = "; ".join(x for x in (note, f"allowed includes {EAGER_ERROR_FACTOR:g}x eager's own error vs a "
                                             f"float64 run (max {max(eager_errors):.3g})") if x)
            shapes = tuple(tuple(a.shape) for a in args if isinstance(a, Tensor))
            report.check = FoldCheck(True, "; ".join(x for x in (note, why) if x), shapes, diff, tol, ok)
            if not ok:
                raise RuntimeError(
                    "fold(): the folded model's outputs differ from the original's beyond the "
                    f"tolerance (max abs diff {diff:.3g} > {tol:.3g}); this is a bug in convbn, "
                    f"please report it with the model. Use check=False to get the model anyway.\n{report}"
                )
    folded.fold_report = report
    return folded
