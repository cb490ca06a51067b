"""fold's own pieces: when a BatchNorm module can be folded, the module-level fold of one
(layer, BatchNorm) pair, what a folded norm-act module leaves, and the graph helpers the
graph folder uses (the layers it recognises: :mod:`convbn.passes.graph.layers`)."""
from __future__ import annotations

import copy
from typing import Any, Callable, Dict, Optional, Set, TypeVar, Union

import torch
import torch.fx as fx
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from ...functional.activations import activation_from_module, activation_functions, activation_methods
from ...functional.fold import fold_bn_into_preceding
from ..graph.layers import CONVT_MODULES, LAYER_MODULES

__all__ = ["fold_conv_bn_modules"]


LayerT = TypeVar("LayerT", bound=nn.Module)

UNSET = object()


def check_bn_foldable(bn: nn.Module) -> Optional[str]:
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
    if isinstance(layer, CONVT_MODULES):
        return layer.weight.shape[1] * layer.groups
    return layer.weight.shape[0]


def clone_with(layer: LayerT, weight: Tensor, bias: Tensor) -> LayerT:
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
    if not isinstance(layer, LAYER_MODULES):
        raise TypeError(
            "fold_conv_bn_modules expects an nn.Conv1d/2d/3d, nn.ConvTranspose1d/2d/3d or "
            f"nn.Linear as `layer`, but got {type(layer).__name__}"
        )
    if not isinstance(bn, _BatchNorm):
        raise TypeError(f"fold_conv_bn_modules expects a BatchNorm module as `bn`, but got {type(bn).__name__}")
    why = check_bn_foldable(bn)
    if why is not None:
        raise ValueError(f"cannot fold {type(bn).__name__}: {why}")
    if bn.running_mean.numel() != _layer_out_channels(layer):
        raise ValueError(
            f"{type(bn).__name__} has {bn.running_mean.numel()} channels but "
            f"{type(layer).__name__} produces {_layer_out_channels(layer)}"
        )
    transposed = isinstance(layer, CONVT_MODULES)
    with torch.no_grad():
        w, b = fold_bn_into_preceding(
            layer.weight, layer.bias, bn.running_mean, bn.running_var, bn.eps, bn.weight, bn.bias,
            transposed=transposed, groups=getattr(layer, "groups", 1),
        )
    return clone_with(layer, w, b)


# --------------------------------------------------------------------------------------
# Activations and norm-act tails
# --------------------------------------------------------------------------------------


def describe_activation(node: fx.Node, modules: Dict[str, nn.Module], qual: Callable[[str], str]) -> Optional[str]:
    """A name for ``node`` if it applies an element-wise activation of the table in
    functional/activations.py (module, callable or method; ``qual``: qualified module names),
    else ``None``, for the reason given when one sits between a BN and a layer."""
    if node.op == "call_module":
        mod = modules.get(str(node.target))
        if mod is None or activation_from_module(mod) is None:
            return None
        return f"activation {type(mod).__name__} '{qual(str(node.target))}'"
    if node.op == "call_function" and node.target in activation_functions():
        return f"activation {node.target.__name__}()"  # type: ignore[union-attr]
    if node.op == "call_method" and node.target in activation_methods():
        return f"activation .{node.target}()"
    return None


class NormActTail(nn.Module):
    """What :func:`convbn.fold` leaves of a norm-act BatchNorm module (a ``_BatchNorm``
    subclass whose forward normalises, then applies its dropout / activation children) once
    its batch norm is folded into the layer before: those children, which the folded graph
    calls by their own names. It is never called itself.

    Args:
        source: the norm-act module.
    """

    def __init__(self, source: nn.Module) -> None:
        super().__init__()
        self.source_type = type(source).__name__
        for name, child in source.named_children():
            self.add_module(name, child)

    def extra_repr(self) -> str:
        return f"tail of {self.source_type}, its batch norm folded"


# --------------------------------------------------------------------------------------
# Graph helpers
# --------------------------------------------------------------------------------------


def get_attr_value(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for atom in target.split("."):
        obj = getattr(obj, atom)
    return obj


def const_tensor(gm: fx.GraphModule, arg: Any) -> Union[Tensor, None, object]:
    """The tensor a ``get_attr`` argument refers to; ``None`` for None; UNSET otherwise."""
    if arg is None:
        return None
    if isinstance(arg, fx.Node) and arg.op == "get_attr":
        value = get_attr_value(gm, arg.target)
        if isinstance(value, Tensor):
            return value
    return UNSET


def owner_path(target: str) -> str:
    return target.rsplit(".", 1)[0] if "." in target else ""


def free_name(gm: fx.GraphModule, base: str) -> str:
    name, i = base, 1
    while True:
        try:
            get_attr_value(gm, name)
        except AttributeError:
            return name
        i += 1
        name = f"{base}{i}"


def delete_unused_submodules(gm: fx.GraphModule, owned: nn.Module) -> None:
    """``gm.delete_all_unused_submodules()``, except that no child is ever taken from a module
    of ``owned`` (the user's module that ``gm`` traced).

    A ``GraphModule`` holds the user's module objects themselves wherever its graph reads a
    module whole (``call_module``, and ``get_attr`` of a module passed as a value, e.g. to a
    wrapped function or ``checkpoint``); torch's version counts the children of a module read
    by ``get_attr`` as unused and deletes them from that object, which the model still owns
    and calls. Only the containers ``GraphModule`` made for itself lose unused children here.
    """
    used: Set[str] = set()
    for node in gm.graph.nodes:
        if node.op not in ("call_module", "get_attr") or not isinstance(node.target, str):
            continue
        parts = node.target.split(".")
        used.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
        try:
            sub = gm.get_submodule(node.target)
        except AttributeError:  # a parameter or buffer: its owner's path is used
            continue
        used.update(f"{node.target}.{n}" for n, _ in sub.named_modules() if n)
    mine = {id(m) for m in owned.modules()}
    for name, _ in list(gm.named_modules()):
        if not name or name in used:
            continue
        parent_path, _, leaf = name.rpartition(".")
        try:
            parent = gm.get_submodule(parent_path)
        except AttributeError:  # removed with its parent already
            continue
        if id(parent) not in mine:
            parent._modules.pop(leaf, None)
