"""The layers both passes work with: conv / conv-transpose / linear modules and calls.

:func:`convbn.convert` fuses a BatchNorm with the convolution before it (or after it, a
pre-activation head), :func:`convbn.fold` folds one into either neighbour; both recognise
the same layers -- ``nn.Conv{1,2,3}d``, ``nn.ConvTranspose{1,2,3}d``, ``nn.Linear``
(subclasses that keep torch's ``forward`` too) and their functional calls on a module's
parameters -- and both trace with these modules as leaves
(:class:`~convbn.passes.tracing.trace.LayerTracer`). :func:`layer_call` recognises a layer call in
a graph for both passes, :func:`layer_spec` gives its geometry; each pass then checks what
it needs (convert: the weight's owner module; fold: the weight's value, hooks, sharing).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple, Union

import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from ...functional.conv import ConvSpec, conv_spec_from_module, make_conv_spec, make_linear_spec

__all__ = ["CONV_MODULES", "CONVT_MODULES", "LAYER_MODULES", "CONV_FNS", "CONVT_FNS", "LINEAR_FNS", "CONV_SIG",
           "CONVT_SIG", "LINEAR_SIG", "LAYER_KINDS", "has_standard_forward", "node_arg", "normalize_args",
           "LayerCall", "layer_call", "layer_spec"]

CONV_MODULES: Tuple[type, ...] = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
CONVT_MODULES: Tuple[type, ...] = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
LAYER_MODULES: Tuple[type, ...] = CONV_MODULES + CONVT_MODULES + (nn.Linear,)

# The functional layers (``torch.conv2d`` is ``F.conv2d``), their argument names in
# positional order and the defaults the functions use.
CONV_FNS = {F.conv1d, F.conv2d, F.conv3d}
CONVT_FNS = {F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d}
LINEAR_FNS = {F.linear}
CONV_SIG = (("input", None), ("weight", None), ("bias", None), ("stride", 1), ("padding", 0),
            ("dilation", 1), ("groups", 1))
CONVT_SIG = (("input", None), ("weight", None), ("bias", None), ("stride", 1), ("padding", 0),
             ("output_padding", 0), ("groups", 1), ("dilation", 1))
LINEAR_SIG = (("input", None), ("weight", None), ("bias", None))


def _defining_module(cls: type, attr: str) -> str:
    for klass in cls.__mro__:
        if attr in vars(klass):
            return klass.__module__
    return ""


def has_standard_forward(m: nn.Module) -> bool:
    """``m``'s forward is one of torch.nn's own (not overridden by a user subclass).

    Example:
        >>> class Mine(nn.Conv2d):
        ...     pass
        >>> has_standard_forward(Mine(1, 1, 1))
        True
    """
    return _defining_module(type(m), "forward").startswith("torch.nn.")


def node_arg(node: fx.Node, i: int, name: str, default: Any) -> Any:
    """Argument ``i`` (keyword ``name``) of a call node, or ``default``."""
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


def normalize_args(node: fx.Node, sig: Sequence[Tuple[str, Any]]) -> Optional[Dict[str, Any]]:
    """Arguments of a call_function node by name (defaults filled in), or None if odd.

    Args:
        node: a ``call_function`` node.
        sig: ``(name, default)`` pairs in positional order (e.g. :data:`CONV_SIG`).

    Returns:
        ``{name: value}`` for every name of ``sig``; ``None`` for more positional arguments
        than ``sig`` has or an unknown keyword.
    """
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


#: the kinds of layer: a convolution, a transposed convolution, a linear layer
LAYER_KINDS = ("conv", "convt", "linear")
_SIGS = {"conv": CONV_SIG, "convt": CONVT_SIG, "linear": LINEAR_SIG}


@dataclass
class LayerCall:
    """One conv / conv-transpose / linear applied in a traced graph, module or functional.

    Attributes:
        node: the node applying it.
        kind: one of :data:`LAYER_KINDS`.
        module: the module called (``None``: a functional call).
        args: the call's arguments by name: for a functional call every name of its
            signature (:data:`CONV_SIG` ...), defaults filled in; for a module call
            ``input`` and, for a transposed convolution, ``output_size``.
    """

    node: fx.Node
    kind: str
    module: Optional[nn.Module]
    args: Dict[str, Any]

    @property
    def input(self) -> Any:
        return self.args["input"]

    @property
    def sig(self) -> Tuple[Tuple[str, Any], ...]:
        """The functional signature of this kind of layer."""
        return _SIGS[self.kind]


def layer_call(node: Any, gm: fx.GraphModule) -> Union[LayerCall, str, None]:
    """The layer ``node`` applies; a reason string for a functional layer call whose arguments
    are not understood; ``None`` for anything else.

    Args:
        node: a graph value (anything but an ``fx.Node`` is no layer).
        gm: the traced graph module holding ``node``.

    Returns:
        A :class:`LayerCall`, a reason, or ``None``.
    """
    if not isinstance(node, fx.Node):
        return None
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        if not isinstance(mod, LAYER_MODULES):
            return None
        kind = "convt" if isinstance(mod, CONVT_MODULES) else "linear" if isinstance(mod, nn.Linear) else "conv"
        args = {"input": node_arg(node, 0, "input", None)}
        if kind == "convt":
            args["output_size"] = node_arg(node, 1, "output_size", None)
        return LayerCall(node, kind, mod, args)
    if node.op != "call_function":
        return None
    kind = "conv" if node.target in CONV_FNS else "convt" if node.target in CONVT_FNS else \
        "linear" if node.target in LINEAR_FNS else None
    if kind is None:
        return None
    args = normalize_args(node, _SIGS[kind])
    if args is None:
        return f"'{node.name}' has arguments this pass does not understand"
    return LayerCall(node, kind, None, args)


def layer_spec(call: LayerCall, weight_shape: Sequence[int]) -> ConvSpec:
    """The geometry of ``call`` (weight of shape ``weight_shape``) as a :class:`ConvSpec`.

    Raises:
        TypeError, ValueError: a functional call whose geometry is not constant ints / padding
            strings, or options a module would refuse.
    """
    if call.module is not None:
        return conv_spec_from_module(call.module)  # type: ignore[arg-type]
    if call.kind == "linear":
        return make_linear_spec()
    a = call.args
    dims = len(weight_shape) - 2
    spec = make_conv_spec(dims, weight_shape[2:], a["stride"], a["padding"], a["dilation"], a["groups"])
    if call.kind == "conv":
        return spec
    op = a["output_padding"]
    op = tuple(int(p) for p in op) if isinstance(op, (list, tuple)) else (int(op),) * dims
    return dataclasses.replace(spec, transposed=True, output_padding=op if any(op) else ())
