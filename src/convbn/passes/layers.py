"""The layers both passes work with: conv / conv-transpose / linear modules and calls.

:func:`convbn.convert` fuses a BatchNorm with the convolution before it (or after it, a
pre-activation head), :func:`convbn.fold` folds one into either neighbour; both recognise
the same layers -- ``nn.Conv{1,2,3}d``, ``nn.ConvTranspose{1,2,3}d``, ``nn.Linear``
(subclasses that keep torch's ``forward`` too) and their functional calls on a module's
parameters -- and both trace with these modules as leaves
(:class:`~convbn.passes.trace.LayerTracer`).
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple

import torch.fx as fx
import torch.nn.functional as F
from torch import nn

__all__ = ["CONV_MODULES", "CONVT_MODULES", "LAYER_MODULES", "CONV_FNS", "CONVT_FNS", "LINEAR_FNS", "CONV_SIG",
           "CONVT_SIG", "LINEAR_SIG", "has_standard_forward", "normalize_args"]

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
