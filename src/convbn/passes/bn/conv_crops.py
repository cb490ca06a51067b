"""A crop of a convolution's output before its BatchNorm, rewritten into the convolution's padding.

Causal (temporal) convolutions are written as a convolution padded on both sides followed by
a crop of the extra outputs, ``bn(conv(x)[..., :-p])`` (or ``conv(x)[:, :, :-p].contiguous()``,
a "chomp" module): the BatchNorm reads the crop, not the convolution, so neither pass finds
a Conv -> BN pair. :func:`absorb_conv_crops` rewrites the graph before matching (convert's
``find_layers`` and fold's graph): the crop becomes the convolution's own (asymmetric) padding,
a functional convolution on the same weight and bias, after a zero ``F.pad`` that both passes
already fold into the convolution's geometry.

Note: [a crop of a convolution's output is less padding]
    Per spatial dim, a convolution with stride ``s`` and zero paddings ``l`` / ``r`` reads, for
    output ``o``, the padded input from ``o * s - l``; its output length is
    ``floor((L + l + r - d * (k - 1) - 1) / s) + 1``. Dropping ``a`` outputs on the left and
    ``b`` on the right (``out[..., a:-b]``) therefore equals the same convolution with paddings
    ``l - a * s`` and ``r - b * s`` wherever those are not negative: output ``o'`` of the
    smaller padding reads from ``(o' + a) * s - l`` (the old output ``o' + a``) and the length
    drops by exactly ``a + b``. Every kept output is the same dot product of the same values;
    only the outputs the crop discarded are no longer computed. ``.contiguous()`` after the crop
    changes no value and is dropped with it. Crops that need the output length (a positive
    stop), steps, integer indices or crops deeper than the padding are left as they are.
"""
from __future__ import annotations

import operator
from typing import Any, List, Optional, Sequence, Tuple

import torch.fx as fx
import torch.nn.functional as F
from torch.nn.utils import parametrize

from ..graph.hooks import hook_reason
from ..graph.layers import layer_call, layer_spec
from .sites import bn_call

__all__ = ["absorb_conv_crops"]

_CONV_FN = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def _crop_amounts(index: Any, dims: int) -> Optional[List[Tuple[int, int]]]:
    """``[(a, b), ...]`` per spatial dim if ``index`` only drops ``a`` leading and ``b`` trailing
    outputs of spatial dims of a ``dims``-D convolution output (rank ``dims + 2``), else ``None``."""
    items = list(index) if isinstance(index, tuple) else [index]
    if items.count(Ellipsis) > 1 or any(not isinstance(i, slice) and i is not Ellipsis for i in items):
        return None
    rank = dims + 2
    if Ellipsis in items:
        at = items.index(Ellipsis)
        fill = rank - (len(items) - 1)
        if fill < 0:
            return None
        items = items[:at] + [slice(None)] * fill + items[at + 1:]
    if len(items) > rank:
        return None
    items += [slice(None)] * (rank - len(items))
    if any(s != slice(None) for s in items[:2]):
        return None  # batch or channel dim indexed
    crops = []
    for s in items[2:]:
        start, stop, step = s.start, s.stop, s.step
        if step not in (None, 1) or not isinstance(start, (int, type(None))) or not isinstance(stop, (int, type(None))):
            return None
        if (start is not None and start < 0) or (stop is not None and stop >= 0):
            return None  # needs the output length
        crops.append((start or 0, -stop if stop is not None else 0))
    return crops


def _single_reader(node: fx.Node) -> Optional[fx.Node]:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _crop_site(conv: fx.Node, gm: fx.GraphModule, root: Any) -> Optional[Tuple[fx.Node, List[Tuple[int, int]]]]:
    """``(last node of the crop, crops)`` if ``conv``'s output is only cropped and then read by a
    batch norm alone, else ``None``."""
    crop = _single_reader(conv)
    if crop is None or crop.op != "call_function" or crop.target is not operator.getitem or crop.args[0] is not conv:
        return None
    call = layer_call(conv, gm)
    if call is None or isinstance(call, str) or call.kind != "conv":
        return None
    last = crop
    after = _single_reader(crop)
    if after is not None and after.op == "call_method" and after.target == "contiguous" and len(after.args) == 1 \
            and not after.kwargs:
        last = after
    reader = _single_reader(last)
    if reader is None or bn_call(reader, gm, "", root) is None:
        return None
    if call.module is not None:
        dims = call.module.weight.dim() - 2
    else:
        w = call.args["weight"]
        if not isinstance(w, fx.Node) or w.op != "get_attr":
            return None
        dims = {F.conv1d: 1, F.conv2d: 2, F.conv3d: 3}[conv.target]
    crops = _crop_amounts(crop.args[1], dims)
    return (last, crops) if crops is not None and any(a or b for a, b in crops) else None


def _new_geometry(padding: Sequence[int], stride: Sequence[int], crops: List[Tuple[int, int]]
                  ) -> Optional[Tuple[List[int], List[int]]]:
    """``(symmetric padding, F.pad amounts, last dim first)`` of Note: [a crop of a convolution's
    output is less padding], or ``None`` where a crop reaches past the padding."""
    left = [p - a * s for p, s, (a, _) in zip(padding, stride, crops)]
    right = [p - b * s for p, s, (_, b) in zip(padding, stride, crops)]
    if any(v < 0 for v in left + right):
        return None
    sym = [min(l, r) for l, r in zip(left, right)]
    pads: List[int] = []
    for i in reversed(range(len(sym))):
        pads += [left[i] - sym[i], right[i] - sym[i]]
    return sym, pads


def _rewrite(conv: fx.Node, last: fx.Node, crops: List[Tuple[int, int]], gm: fx.GraphModule) -> bool:
    """Replace ``conv`` and its crop (ending at ``last``) by the padded functional convolution."""
    call = layer_call(conv, gm)
    assert call is not None and not isinstance(call, str)  # _crop_site checked it
    mod = call.module
    graph = gm.graph
    if mod is not None:
        if mod.padding_mode != "zeros" or hook_reason(mod) or parametrize.is_parametrized(mod):
            return False
        spec = layer_spec(call, mod.weight.shape)
        with graph.inserting_before(conv):
            weight = graph.get_attr(f"{conv.target}.weight")
            bias = graph.get_attr(f"{conv.target}.bias") if mod.bias is not None else None
    else:
        weight, bias = call.args["weight"], call.args["bias"]
        spec = layer_spec(call, gm.get_parameter(str(weight.target)).shape)
    if spec.pre_pad or spec.transposed:
        return False
    geometry = _new_geometry(spec.padding, spec.stride, crops)
    if geometry is None:
        return False
    sym, pads = geometry
    with graph.inserting_before(conv):
        x = call.input
        if any(pads):
            x = graph.call_function(F.pad, (x, tuple(pads)))
        new = graph.call_function(_CONV_FN[spec.dims], (x, weight, bias, tuple(spec.stride), tuple(sym),
                                                        tuple(spec.dilation), spec.groups))
    last.replace_all_uses_with(new)
    for node in reversed([conv, *_between(conv, last)]):
        graph.erase_node(node)
    return True


def _between(conv: fx.Node, last: fx.Node) -> List[fx.Node]:
    """The crop nodes after ``conv`` up to ``last`` (one reader each), in order."""
    found, node = [], conv
    while node is not last:
        node = next(iter(node.users))
        found.append(node)
    return found


def absorb_conv_crops(gm: fx.GraphModule, root: Any = None) -> List[str]:
    """Rewrite every ``bn(conv(x)[crop])`` of ``gm`` into ``bn(conv'(x))`` with the crop in the
    convolution's padding (Note: [a crop of a convolution's output is less padding]), in place.

    Args:
        gm: the traced graph module (rewritten in place, recompiled when anything changed).
        root: the module ``gm`` was traced from (default ``gm``), for functional batch norms.

    Returns:
        The names of the convolution nodes rewritten.

    Example:
        >>> import torch.fx as fx
        >>> from torch import nn
        >>> class Causal(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.conv, self.bn = nn.Conv1d(2, 4, 3, padding=2), nn.BatchNorm1d(4)
        ...     def forward(self, x):
        ...         return self.bn(self.conv(x)[:, :, :-2])
        >>> gm = fx.symbolic_trace(Causal())
        >>> absorb_conv_crops(gm)
        ['conv']
    """
    done: List[str] = []
    for node in list(gm.graph.nodes):
        if node.op not in ("call_module", "call_function"):
            continue
        site = _crop_site(node, gm, gm if root is None else root)
        if site is not None:
            name = node.name
            if _rewrite(node, site[0], site[1], gm):
                done.append(name)
    if done:
        gm.graph.lint()
        gm.recompile()
    return done
