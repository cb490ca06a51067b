"""Why a BatchNorm folds into neither neighbour, in the words a reader needs: it reads a
flatten into a linear, it follows an activation of a layer (conv -> act -> BN), or an
activation sits between it and the layer after it (pre-activation)."""
from __future__ import annotations

from typing import Optional, Tuple

import torch.fx as fx

from ...functional.activations import ACTIVATIONS, activation_from_module
from ..bn.tokens import flattened_linear_reason
from ..graph.shape_uses import value_users
from .layers import describe_activation
from .folder import GraphFolder
from .match import FoldLayer, FoldSite

__all__ = ["activation_before_layer", "left_reason"]


def activation_before_layer(folder: GraphFolder, node: fx.Node) -> Optional[Tuple[str, str]]:
    """``(activation, layer)`` names if ``node`` is an element-wise activation whose only
    value user is a conv / linear layer."""
    what = describe_activation(node, folder.installer.modules, folder.qual)
    users = value_users(node)
    if what is None or len(users) != 1:
        return None
    layer = folder.layer(users[0])
    return None if isinstance(layer, str) else (what, layer.name)


def _after_activation(folder: GraphFolder, site: FoldSite) -> Optional[str]:
    """Why a BN reading an activation of a conv/linear output (conv -> act -> BN) folds into
    neither neighbour, in words; ``None`` for any other BN."""
    act = site.input
    if not isinstance(act, fx.Node) or not act.args or not isinstance(act.args[0], fx.Node):
        return None
    if act.op == "call_module":
        is_act = activation_from_module(folder.gm.get_submodule(str(act.target))) is not None
    else:
        name = act.target if act.op == "call_method" else getattr(act.target, "__name__", "")
        is_act = act.op in ("call_method", "call_function") and str(name).rstrip("_") in ACTIVATIONS
    layer = folder.layer(act.args[0]) if is_act else None
    if not isinstance(layer, FoldLayer):
        return None
    return (f"BatchNorm after an activation: it follows '{act.name}' of {layer.name} (conv -> activation -> BN "
            "order), so it cannot fold into that layer, and it folds into the next conv/linear layer only where "
            "one reads it alone (zero padding aside)")


def left_reason(folder: GraphFolder, site: FoldSite, why_pre: str, why_post: str) -> str:
    """Why ``site`` stays: a reason that explains both sides first, then each side's own."""
    first = (flattened_linear_reason(site.node, folder.gm) if site.node.op == "call_module" else None) \
        or _after_activation(folder, site)
    return f"{first}; {why_pre}; {why_post}" if first else f"{why_pre}; {why_post}"
