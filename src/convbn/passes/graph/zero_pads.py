"""A pad of width zero read only by concatenations: the pad dropped (a canonicalising rewrite).

MONAI's ``UpCat`` pads its upsampled map before concatenating it with the skip,
``F.pad(x_0, sp, "replicate")``, with ``sp`` all zeros where the shapes already agree (every even
input size). The pad computes a copy of its input, and a replication pad's backward keeps that
input for backward: a map saved for nothing (13.5 MiB at 48³, batch 2, in BasicUNet 3-D), and a
concatenation of the copy rather than of the upsampled map itself.

:func:`drop_zero_pads` rewrites ``cat([..., pad(x, [0, ..., 0], mode), ...])`` into
``cat([..., x, ...])``: the same values (a pad of width zero is its input, whatever the mode or the
value), the same gradient (the concatenation's slice of it reaches ``x`` directly, where the pad's
backward passed it on unchanged). Only where every reader of the pad is a concatenation: those
copy their pieces, so no reader can write into ``x`` through what was the pad's fresh copy.
"""
from __future__ import annotations

from typing import List, Optional

import torch.fx as fx
import torch.nn.functional as F

from .concat_heads import cat_parts
from .pass_through import drop_pass_through

__all__ = ["drop_zero_pads"]


def _zero_width(node: fx.Node) -> bool:
    """``node`` is ``F.pad(x, widths, ...)`` with every width the constant 0 (and no ``out``)."""
    if node.op != "call_function" or node.target is not F.pad or not node.args:
        return False
    widths = node.args[1] if len(node.args) > 1 else node.kwargs.get("pad")
    return (isinstance(node.args[0], fx.Node) and isinstance(widths, (list, tuple)) and len(widths) > 0
            and all(type(w) is int and w == 0 for w in widths))


def drop_zero_pads(gm: fx.GraphModule) -> List[str]:
    """Drop every zero-width pad of ``gm``'s graph whose readers are all concatenations (in place).

    Returns:
        the names of the pad nodes dropped.

    Example:
        >>> import torch
        >>> class M(torch.nn.Module):
        ...     def forward(self, a, b):
        ...         return torch.cat([a, F.pad(b, [0, 0, 0, 0], "replicate")], 1)
        >>> gm = fx.symbolic_trace(M())
        >>> drop_zero_pads(gm), [n.op for n in gm.graph.nodes]
        (['pad'], ['placeholder', 'placeholder', 'call_function', 'output'])
    """
    def passed(node: fx.Node) -> Optional[fx.Node]:
        if not _zero_width(node) or not node.users or not all(cat_parts(u) is not None for u in node.users):
            return None
        return node.args[0]  # type: ignore[return-value]

    return drop_pass_through(gm, passed)
