"""A floating tensor plus the constant 0: the addition dropped (a canonicalising rewrite).

med-seg-diff-pytorch's channel LayerNorm ends ``... * self.g + default(self.b, 0)``: without a bias
the graph adds the number 0 after the norm, and that addition stands between the norm and the
convolution reading it (a pre-activation chain ``norm -> conv`` is then not seen). For a floating
tensor ``x + 0`` has ``x``'s values (``-0.0 + 0`` is ``0.0``, equal) and passes the gradient on
unchanged.

:func:`drop_zero_adds` replaces ``x + 0`` / ``0 + x`` (``operator.add`` or ``torch.add``, the
number ``0`` or ``0.0``) by ``x`` where a trace with real inputs recorded the sum's dtype as ``x``'s,
floating (an integer or bool ``x`` plus 0 may change dtype; a symbolic trace has no dtypes: nothing
changes there), ``x`` is computed in the graph and read by nothing else (the addition's fresh tensor and
``x`` were the same values no one else sees), and no reader of the sum writes into it in place.
"""
from __future__ import annotations

import operator
from typing import Any, List, Optional

import torch
import torch.fx as fx

from .pass_through import drop_pass_through
from .shape_capture import DTYPE

__all__ = ["drop_zero_adds"]


def _zero(v: Any) -> bool:
    return type(v) in (int, float) and v == 0


def _added_to(node: fx.Node) -> Optional[fx.Node]:
    """``x`` of ``node`` = ``x + 0`` / ``0 + x`` where the sum has ``x``'s floating dtype, else ``None``:
    the sum's dtype was traced floating and either ``x``'s was traced the same or the zero is the
    int ``0`` (an integer or bool tensor plus an int stays integer; a norm node a rewrite made has
    no traced dtype of its own)."""
    if node.op != "call_function" or node.target not in (operator.add, torch.add) or node.kwargs or len(node.args) != 2:
        return None
    a, b = node.args
    x, zero = (a, b) if _zero(b) else (b, a) if _zero(a) else (None, None)
    out = node.meta.get(DTYPE)
    if not isinstance(x, fx.Node) or not isinstance(out, torch.dtype) or not out.is_floating_point:
        return None
    return x if x.meta.get(DTYPE) is out or type(zero) is int else None


def _writes_in_place(reader: fx.Node, gm: fx.GraphModule) -> bool:
    if reader.op in ("call_method", "call_function"):
        name = str(reader.target) if reader.op == "call_method" else getattr(reader.target, "__name__", "")
        return name.endswith("_") or reader.kwargs.get("inplace") is True
    if reader.op == "call_module":
        return getattr(gm.get_submodule(str(reader.target)), "inplace", False) is True
    return False


def drop_zero_adds(gm: fx.GraphModule) -> List[str]:
    """Drop every ``x + 0`` of ``gm``'s graph that the module docstring allows (in place).

    Returns:
        the names of the addition nodes dropped.
    """
    def passed(node: fx.Node) -> Optional[fx.Node]:
        x = _added_to(node)
        if (x is None or x.op in ("placeholder", "get_attr") or len(x.users) != 1
                or any(_writes_in_place(r, gm) for r in node.users)):
            return None
        return x

    return drop_pass_through(gm, passed)
