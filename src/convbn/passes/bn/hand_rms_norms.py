"""Hand-written channel RMSNorms recognised by their graph pattern.

Diffusion U-Nets normalise by the root mean square over the channels, written out by hand
(denoising-diffusion-pytorch's ``RMSNorm``, imagen's ``ChanRMSNorm``, x-unet's ``RMSNorm``)::

    F.normalize(x, dim=1) * g * scale                # g stored (1, C, 1, 1); scale = sqrt(C)
    F.normalize(x, dim=1) * scale * g                # g stored (C, 1, 1)
    F.normalize(x, dim=1) * g * (x.shape[1] ** 0.5)  # the scale read off the input's shape
    einsum('b c ..., c -> b c ...', F.normalize(x, dim=1) * scale, g)
    x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + eps) * g   # or x / sqrt(...), x * x, x.square()

:func:`hand_channel_rms_norms` (a canonicalising rewrite of convert's pipeline; fold runs it too)
replaces each such subgraph by one :func:`convbn.functional.norms.channel_rms_norm` node on the
module's own gain, naming the spelling (``form``) so that the node runs the very ops written
(Note: [an RMSNorm spelling is its own form]); :mod:`convbn.passes.bn.norm_sites` then finds it
like any norm of the table.

Note: [an RMSNorm spelling is its own form]
``F.normalize(x, dim=1)`` is ``x / max(||x||_2, eps)`` (eps=1e-12 clamps the norm), times
``sqrt(C)`` that is ``x / sqrt(mean_c(x^2))`` *without* eps where the norm is above it; the
hand-written ``rsqrt(mean_c(x^2) + eps)`` adds eps to the mean square. The two are different
functions, and the orders of the products round differently: each spelling is a ``form`` of the
row (:data:`convbn.functional.norms.RMS_FORMS`) computed by its own ops, so a converted model's
outputs are its own code's bit for bit, and so are its gradients (float32, every spelling of the
tests) but where the mean square is written ``x * x``: the form squares by ``pow(2)``, the same
values forward, and autograd sums that product's two gradients with the numerator's in another
order (float32 differences near 1e-7 of the largest gradient). The einsum spelling is an element-wise
product with the gain broadcast over the channels (the same values as ``* g.view(1, C, 1, ...)``,
``tests/test_rms_norm.py`` checks), its form ``normalize_sg``. Not recognised: a norm over another
dimension, ``p`` other than 2, a scale that is neither a number nor ``x.shape[1] ** 0.5``, a gain
that is no stored per-channel tensor (the channel count is then unknown before run time), a
pattern node something else also reads; those stay as written.
"""
from __future__ import annotations

import operator
from typing import Any, Optional, Tuple

import torch
import torch.fx as fx
import torch.nn.functional as F

from ...functional.norms import channel_rms_norm
from ..graph.layers import node_arg
from .hand_layer_norms import (_DIV, _MEAN, _MUL, _POW, _SQUARE, Replacement, _affine, _binary, _eps_added,
                               _reduction, _replace_each, _root, _unary, known_rank)

__all__ = ["hand_channel_rms_norms"]

#: ``(x, form, eps)`` of a recognised normalisation, before its gain
Normalised = Tuple[fx.Node, str, Optional[float]]


def _normalize_call(node: Any) -> Optional[Normalised]:
    """``(x, "normalize", eps)`` of ``F.normalize(x, p=2, dim=1, eps)``, else ``None``."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or node.target is not F.normalize:
        return None
    if set(node.kwargs) - {"p", "dim", "eps", "out"} or len(node.args) > 4:
        return None
    x, p, dim = node.args[0] if node.args else None, node_arg(node, 1, "p", 2.0), node_arg(node, 2, "dim", 1)
    eps, out = node_arg(node, 3, "eps", 1e-12), node.kwargs.get("out")
    if not isinstance(x, fx.Node) or p != 2 or dim != 1 or out is not None or not _is_number(eps):
        return None
    return x, "normalize", float(eps)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _mean_square_of(node: Any) -> Optional[fx.Node]:
    """``x`` where ``node`` is ``mean(x^2, dim=1, keepdim=True)`` (``pow(2)``, ``x * x``, ``square``)."""
    reduced = _reduction(node, _MEAN)
    if reduced is None or reduced[1] != (1,):
        return None
    sq = reduced[0]
    x = _unary(sq, _SQUARE)
    if x is None:
        pw, mul = _binary(sq, _POW), _binary(sq, _MUL)
        x = pw[0] if pw is not None and pw[1] == 2 else mul[0] if mul is not None and mul[0] is mul[1] else None
    return x if isinstance(x, fx.Node) else None


def _root_mean_square(node: Any) -> Optional[Normalised]:
    """``(x, "rsqrt" | "sqrt", eps)`` of ``x * rsqrt(ms + eps)`` (either order) or
    ``x / sqrt(ms + eps)``, ``ms`` the mean square of the same ``x`` over dim 1, else ``None``."""
    div, mul = _binary(node, _DIV), _binary(node, _MUL)
    pairs = [(div, False)] if div is not None else [(mul, True), ((mul[1], mul[0]), True)] if mul is not None else []
    for (x, scale), inverse in pairs:
        added = _eps_added(_root(scale, inverse))
        if isinstance(x, fx.Node) and added is not None and _mean_square_of(added[0]) is x:
            return x, "rsqrt" if inverse else "sqrt", added[1]
    return None


def _sole_user(node: fx.Node) -> Any:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _times(node: fx.Node) -> Optional[Tuple[fx.Node, Any]]:
    """``(product node, other operand)`` of ``node``'s sole user ``node * other`` (either order)."""
    user = _sole_user(node)
    ops = _binary(user, _MUL) if user is not None else None
    if ops is None or node not in ops:
        return None
    return user, ops[1] if ops[0] is node else ops[0]


def _scale(v: Any, x: fx.Node, channels: Optional[int]) -> Optional[float]:
    """A constant scale: a number, or ``x.shape[1] ** 0.5`` (with ``channels`` known)."""
    if _is_number(v):
        return float(v)
    pw = _binary(v, _POW)
    if pw is None or pw[1] != 0.5 or channels is None:
        return None
    item = pw[0]
    if not (isinstance(item, fx.Node) and item.op == "call_function" and item.target is operator.getitem
            and item.args[1:] == (1,)):
        return None
    shape = item.args[0]
    ok = (isinstance(shape, fx.Node) and shape.op == "call_function" and shape.target is getattr
          and shape.args == (x, "shape")) or (_is_call_method(shape, "size") and shape.args == (x,))
    return float(channels ** 0.5) if ok else None


def _is_call_method(node: Any, name: str) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_method" and node.target == name


_EINSUM_CHANNEL_GAIN = ("b c ..., c -> b c ...", "bc...,c->bc...")


def _einsum_gain(node: fx.Node, gm: fx.GraphModule) -> Optional[Tuple[fx.Node, str, int, Optional[int]]]:
    """``(output, gain target, C, None)`` of ``einsum('b c ..., c -> b c ...', node, g)`` with
    ``g`` a stored ``(C,)`` tensor, ``node`` its sole reader, else ``None``."""
    user = _sole_user(node)
    if not (isinstance(user, fx.Node) and user.op == "call_function" and user.target is torch.einsum
            and not user.kwargs and len(user.args) == 3 and user.args[1] is node):
        return None
    eq = user.args[0]
    gain = user.args[2]
    if not isinstance(eq, str) or eq.replace(" ", "") not in {e.replace(" ", "") for e in _EINSUM_CHANNEL_GAIN}:
        return None
    if not (isinstance(gain, fx.Node) and gain.op == "get_attr" and len(gain.users) == 1):
        return None
    t = _attr(gm, str(gain.target))
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.numel() < 2:
        return None
    return user, str(gain.target), int(t.numel()), None


def _attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj


#: ``(output node, gain target, C, rank the gain implies or None, form, scale)``
Gain = Tuple[fx.Node, str, int, Optional[int], str, float]


def _normalize_gain(node: fx.Node, x: fx.Node, gm: fx.GraphModule) -> Optional[Gain]:
    """The gain and scale after ``F.normalize``: ``* g * s``, ``* s * g``, ``* g`` alone, or
    ``einsum(.., * s, g)``."""
    scaled = _affine(node, gm)  # * g first
    if scaled is not None:
        out, target, channels, rank = scaled
        then = _times(out)
        s = _scale(then[1], x, channels) if then is not None else None
        if s is None:
            return out, target, channels, rank, "normalize_gs", 1.0
        return then[0], target, channels, rank, "normalize_gs", s
    first = _times(node)  # * s first
    if first is None:
        return None
    prod, other = first
    einsum = _einsum_gain(prod, gm)
    s = _scale(other, x, einsum[2] if einsum is not None else None)
    if s is None:
        gained = _affine(prod, gm)
        if gained is None:
            return None
        s = _scale(other, x, gained[2])
        return None if s is None else (gained[0], gained[1], gained[2], gained[3], "normalize_sg", s)
    if einsum is not None:
        return (*einsum, "normalize_sg", s)
    gained = _affine(prod, gm)
    return None if gained is None else (gained[0], gained[1], gained[2], gained[3], "normalize_sg", s)


def _found(node: fx.Node, gm: fx.GraphModule) -> Optional[Tuple[fx.Node, Gain, Optional[float]]]:
    """``(x, gain, eps)`` of a hand-written channel RMSNorm whose normalisation is ``node``."""
    normalised = _normalize_call(node) or _root_mean_square(node)
    if normalised is None:
        return None
    x, form, eps = normalised
    if form == "normalize":
        gain = _normalize_gain(node, x, gm)
    else:
        scaled = _affine(node, gm)
        gain = None if scaled is None else (*scaled, form, 1.0)
    if gain is None:
        return None  # no gain: the channel count is not known before run time
    rank, known = gain[3], known_rank(x, gm)
    if rank is not None and known is not None and rank != known:
        return None  # the gain broadcasts over another dimension than the channels
    return x, gain, eps


def hand_channel_rms_norms(gm: fx.GraphModule) -> int:
    """Replace each hand-written channel RMSNorm of ``gm`` (module docstring) by one
    :func:`~convbn.functional.norms.channel_rms_norm` node computing its spelling's ops (Note:
    [an RMSNorm spelling is its own form]). Returns how many were replaced."""
    return _replace_each(gm, lambda node: _rms_norm_at(node, gm))


def _rms_norm_at(node: fx.Node, gm: fx.GraphModule) -> Optional[Replacement]:
    """The replacement of the hand-written RMSNorm found at ``node``, if any."""
    found = _found(node, gm)
    if found is None:
        return None
    x, (out, target, channels, _, form, scale), eps = found
    return out, lambda graph: graph.call_function(channel_rms_norm,
                                                  (x, (channels,), graph.get_attr(target), eps, form, scale))
