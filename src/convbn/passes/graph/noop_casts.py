"""A cast to the dtype its input already has: the cast dropped (a canonicalising rewrite).

imagen-pytorch's channel LayerNorm ends ``(x - mean) * (var + eps).rsqrt().type(dtype) *
self.g.type(dtype)`` with ``dtype = x.dtype``: in float32 both casts return their input. A trace
with real inputs knows every value's dtype (``node.meta[DTYPE]``, Note: [dtype questions answered
by the capture] in shape_capture.py) and the constant the code casts to, so the casts that change
nothing are visible, and the norm's formula underneath is what matching reads.

:func:`drop_noop_casts` replaces ``x.type(d)``, ``x.to(d)`` and ``x.float()`` / ``x.double()`` /
``x.half()`` / ``x.bfloat16()`` by ``x`` where ``x``'s traced dtype is ``d``: the same values, and
the same tensor (each of these returns ``x`` itself then), so no reader sees a difference. The
graph is guarded on its inputs' dtypes and autocast state, which fix every traced dtype inside
(a symbolic trace has no dtypes: nothing is dropped there).
"""
from __future__ import annotations

from typing import Any, List, Optional

import torch
import torch.fx as fx

from .pass_through import drop_pass_through
from .shape_capture import DTYPE

__all__ = ["drop_noop_casts"]

#: methods casting to a dtype they name
_NAMED = {"float": torch.float32, "double": torch.float64, "half": torch.float16, "bfloat16": torch.bfloat16}


def _cast_to(node: fx.Node) -> Optional[torch.dtype]:
    """The dtype ``node`` casts its input to, where it is a plain cast method call; else ``None``."""
    if node.op != "call_method" or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    name = str(node.target)
    if name in _NAMED and len(node.args) == 1 and not node.kwargs:
        return _NAMED[name]
    target: Any = node.args[1] if len(node.args) == 2 else node.kwargs.get("dtype")
    if name in ("type", "to") and isinstance(target, torch.dtype) and len(node.args) + len(node.kwargs) == 2:
        return target
    return None


def drop_noop_casts(gm: fx.GraphModule) -> List[str]:
    """Drop every cast of ``gm``'s graph to the dtype its input was traced with (in place).

    Returns:
        the names of the cast nodes dropped.
    """
    def passed(node: fx.Node) -> Optional[fx.Node]:
        dtype = _cast_to(node)
        if dtype is None or node.args[0].meta.get(DTYPE) is not dtype:  # type: ignore[union-attr]
            return None
        return node.args[0]  # type: ignore[return-value]

    return drop_pass_through(gm, passed)
