"""Hand-written channel LayerNorms (and global ones: GroupNorm with one group) recognised by
their graph pattern.

Many ConvNeXt-style nets write their LayerNorm over the channels out by hand instead of calling
``F.layer_norm`` between permutes (ConvNeXt's original ``LayerNorm(data_format="channels_first")``,
the ``LayerNorm`` of lucidrains' U-Nets)::

    u = x.mean(1, keepdim=True)                      # or torch.mean(x, dim=1, keepdim=True)
    s = (x - u).pow(2).mean(1, keepdim=True)         # or torch.var(x, dim=1, unbiased=False, keepdim=True)
    x = (x - u) / torch.sqrt(s + eps)                # or (x - u) * (s + eps).rsqrt()
    x = w[:, None, None] * x + b[:, None, None]      # or * g with g of shape (1, C, 1, 1); bias optional

or with 1-D affine tensors applied over the last dimension between two transposes (asteroid's
``_LayerNorm``)::

    x = (w * x.transpose(1, -1) + b).transpose(1, -1)

A *global* LayerNorm takes the same statistics over every dimension after the batch's
(``x.mean(dim=[1, 2], keepdim=True)`` on a 3-D input: asteroid's ``GlobLN``, "gLN" of
Conv-TasNet), which with a per-channel affine is ``F.group_norm(x, 1, w, b, eps)``.

:func:`hand_channel_layer_norms` (a canonicalising rewrite of convert's pipeline) replaces each
such subgraph by one :func:`convbn.functional.norms.channel_layer_norm` node (a global one: one
``F.group_norm`` node) on the module's own affine tensors, which
:mod:`convbn.passes.bn.norm_sites` then finds like any channel LayerNorm (GroupNorm).

Note: [a hand-written LayerNorm computes as F.layer_norm after convert]
The formula above and ``F.layer_norm`` compute the same function, not the same bits: the mean,
variance and reciprocal square root are rounded differently (float32 differences of a few ulps;
float64 differences near 1e-15). After convert the pattern runs as ``F.layer_norm`` (a global one
as ``F.group_norm``) whether or not it is fused; tests compare against the model's own code in
float64 with the library's float64 tolerance. Recognised are: mean and biased variance over dim 1 (``mean`` of the squared
difference, or ``var`` with ``unbiased=False`` / ``correction=0``; a global one: the same over
dims ``1, 2, ..., rank - 1``, the rank known from the graph or the affine's broadcast),
``eps`` a number added to it,
``sqrt`` divided or ``rsqrt`` (or ``** 0.5`` / ``** -0.5``) multiplied, then optionally ``* weight``
and ``+ bias`` (either operand order) where each is a parameter or buffer with one dimension of
size C, broadcast over the channel dimension (indexing with ``None``, ``view`` / ``reshape`` /
``unsqueeze``, or stored as ``(1, C, 1, 1)``): the rank this implies must be the input's where
the graph shows it (a convolution's output); elsewhere the first-call check compares. Without a weight the channel count is unknown
before run time and the pattern is left as written. Nodes of the pattern that something else
also reads stay (their values are unchanged).
"""
from __future__ import annotations

import operator
from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from ...functional.norms import channel_layer_norm
from ..graph.layers import node_arg

__all__ = ["hand_channel_layer_norms", "known_rank"]

#: where a hand-written norm ends, and how to build the one node computing it there
Replacement = Tuple[fx.Node, Callable[[fx.Graph], fx.Node]]

_SUB = ({operator.sub, torch.sub}, {"sub"})
_ADD = ({operator.add, torch.add}, {"add"})
_MUL = ({operator.mul, torch.mul}, {"mul"})
_DIV = ({operator.truediv, torch.div}, {"div"})
_POW = ({operator.pow, torch.pow}, {"pow"})
_SQRT = ({torch.sqrt}, {"sqrt"})
_RSQRT = ({torch.rsqrt}, {"rsqrt"})
_SQUARE = ({torch.square}, {"square"})
_MEAN = ({torch.mean}, {"mean"})
_VAR = ({torch.var}, {"var"})
_VIEWS = ({operator.getitem, torch.reshape, torch.unsqueeze}, {"view", "reshape", "unsqueeze"})


def _is(node: Any, kind: Tuple[set, set]) -> bool:
    if not isinstance(node, fx.Node):
        return False
    return (node.op == "call_function" and node.target in kind[0]) or (node.op == "call_method" and node.target in kind[1])


def _binary(node: Any, kind: Tuple[set, set]) -> Optional[Tuple[Any, Any]]:
    """The two operands of an element-wise binary op of ``kind`` with no other argument."""
    if not _is(node, kind) or len(node.args) != 2 or node.kwargs:
        return None
    return node.args[0], node.args[1]


def _unary(node: Any, kind: Tuple[set, set]) -> Any:
    return node.args[0] if _is(node, kind) and len(node.args) == 1 and not node.kwargs else None


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _reduced_dims(dim: Any) -> Optional[Tuple[int, ...]]:
    """The dims of a reduction as a sorted tuple: ``1``, ``(1,)`` or ``[1, 2, ...]`` of
    consecutive dims from 1 (non-negative ints), else ``None``."""
    dims = (dim,) if isinstance(dim, int) and not isinstance(dim, bool) else dim
    if not isinstance(dims, (tuple, list)) or not dims or not all(type(d) is int for d in dims):
        return None
    return tuple(dims) if list(dims) == list(range(1, len(dims) + 1)) else None


def _reduction(node: Any, kind: Tuple[set, set]) -> Optional[Tuple[Any, Tuple[int, ...]]]:
    """``(input, dims)`` of a ``mean`` / biased ``var`` with ``keepdim=True`` over dim 1, or over
    dims 1, 2, ... (:func:`_reduced_dims`), else ``None``."""
    if not _is(node, kind):
        return None
    dims = _reduced_dims(node_arg(node, 1, "dim", None))
    if dims is None:
        return None
    if kind is _MEAN:
        ok = node_arg(node, 2, "keepdim", False) is True and len(node.args) <= 3 and set(node.kwargs) <= {"dim", "keepdim"}
    else:  # var(x, dim, unbiased, keepdim) or var(x, dim, *, correction=0, keepdim)
        biased = node_arg(node, 2, "unbiased", True) is False or node.kwargs.get("correction", 1) == 0
        ok = biased and node_arg(node, 3, "keepdim", False) is True and set(node.kwargs) <= {"dim", "unbiased",
                                                                                               "correction", "keepdim"}
    return (node.args[0], dims) if ok else None


def _centred(node: Any) -> Optional[Tuple[Any, Tuple[int, ...]]]:
    """``(x, dims)`` of ``x - x.mean(dims, keepdim=True)``, else ``None``."""
    ops = _binary(node, _SUB)
    if ops is None:
        return None
    x, mean = ops
    reduced = _reduction(mean, _MEAN)
    return (x, reduced[1]) if isinstance(x, fx.Node) and reduced is not None and reduced[0] is x else None


def _variance_of(node: Any) -> Optional[Tuple[Any, Tuple[int, ...]]]:
    """``(x, dims)`` where ``node`` computes the biased variance of ``x`` over ``dims``, else ``None``."""
    reduced = _reduction(node, _VAR)
    if reduced is not None:
        return reduced
    sq = _reduction(node, _MEAN)
    if sq is None:
        return None
    d = _unary(sq[0], _SQUARE)
    if d is None:
        pw, mul = _binary(sq[0], _POW), _binary(sq[0], _MUL)
        d = pw[0] if pw is not None and pw[1] == 2 else mul[0] if mul is not None and mul[0] is mul[1] else None
    centred = _centred(d)
    return centred if centred is not None and centred[1] == sq[1] else None


def _eps_added(node: Any) -> Optional[Tuple[Any, float]]:
    """``(variance node, eps)`` of ``var + eps`` (either order), else ``None``."""
    ops = _binary(node, _ADD)
    if ops is None:
        return None
    a, b = ops
    return (a, float(b)) if _number(b) else (b, float(a)) if _number(a) else None


def _root(node: Any, inverse: bool) -> Any:
    """The ``var + eps`` node under ``sqrt`` (``inverse``: ``rsqrt``) or the matching power."""
    arg = _unary(node, _RSQRT if inverse else _SQRT)
    if arg is not None:
        return arg
    pw = _binary(node, _POW)
    return pw[0] if pw is not None and pw[1] == (-0.5 if inverse else 0.5) else None


def _normalised(node: Any) -> Optional[Tuple[fx.Node, float, Tuple[int, ...]]]:
    """``(x, eps, dims)`` where ``node`` is ``(x - mean) / sqrt(var + eps)`` (or ``* rsqrt``), the
    statistics over ``dims``, else ``None``."""
    div, mul = _binary(node, _DIV), _binary(node, _MUL)
    pairs = [(div, False)] if div is not None else [(mul, True), ((mul[1], mul[0]), True)] if mul is not None else []
    for (diff, scale), inverse in pairs:
        centred = _centred(diff)
        added = _eps_added(_root(scale, inverse))
        if centred is not None and added is not None and _variance_of(added[0]) == centred:
            return centred[0], added[1], centred[1]
    return None


def _channel_vector(node: Any, gm: fx.GraphModule) -> Optional[Tuple[str, int, int]]:
    """``(attribute target, C, rank of the input it broadcasts over as channels)`` of a stored
    tensor with one dimension of size C, possibly indexed / viewed, else ``None``."""
    ops: List[fx.Node] = []
    while _is(node, _VIEWS) and len(ops) < 4:
        ops.append(node)
        node = node.args[0]
    if not isinstance(node, fx.Node) or node.op != "get_attr":
        return None
    try:
        t = _attr(gm, str(node.target))
    except AttributeError:
        return None
    if not isinstance(t, torch.Tensor) or t.dim() == 0 or sorted(t.shape)[:-1] != [1] * (t.dim() - 1) or t.numel() < 2:
        return None
    shape = _viewed_shape(tuple(t.shape), reversed(ops))
    if shape is None or [s for s in shape if s != 1] != [t.numel()]:
        return None
    pos = list(shape).index(t.numel())
    if pos > 1:
        return None
    return str(node.target), t.numel(), len(shape) + 1 - pos


def _attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _viewed_shape(shape: Tuple[int, ...], ops: Any) -> Optional[Tuple[int, ...]]:
    """The shape after the indexing / view ops (constant arguments only), on a meta tensor."""
    t = torch.empty(shape, device="meta")
    for op in ops:
        rest = list(op.args[1:])
        if any(isinstance(a, fx.Node) for a in rest) or op.kwargs:
            return None
        try:
            t = _apply(t, op, rest)
        except (RuntimeError, IndexError, TypeError, ValueError):
            return None
    return tuple(t.shape)


def _apply(t: torch.Tensor, op: fx.Node, rest: List[Any]) -> torch.Tensor:
    if op.target is operator.getitem:
        return t[rest[0]]
    if op.op == "call_function":
        return op.target(t, *rest)
    return getattr(t, str(op.target))(*rest)


def _by_vector(node: fx.Node, gm: fx.GraphModule, kinds: Any) -> Optional[Tuple[fx.Node, Any]]:
    """``(the sole user, its channel vector)`` where ``node``'s only user is a binary op of
    ``kinds`` (either operand order) with a channel vector as the other operand, else ``None``."""
    if len(node.users) != 1:
        return None
    user = next(iter(node.users))
    ops = _binary(user, kinds)
    if ops is None or node not in ops:
        return None
    vec = _channel_vector(ops[1] if ops[0] is node else ops[0], gm)
    return None if vec is None else (user, vec)


def _affine(node: fx.Node, gm: fx.GraphModule) -> Optional[Tuple[fx.Node, Optional[str], int, int]]:
    """``(output node, target, C, rank)`` of ``node * vector`` (either order), else ``None``."""
    found = _by_vector(node, gm, _MUL)
    return None if found is None else (found[0], *found[1])


def _bias(node: fx.Node, gm: fx.GraphModule, channels: int, rank: int) -> Optional[Tuple[fx.Node, str]]:
    """``(output node, target)`` of ``node + vector`` (either order) of the same channels, else ``None``."""
    found = _by_vector(node, gm, _ADD)
    return (found[0], found[1][0]) if found is not None and found[1][1:] == (channels, rank) else None


_TRANSPOSE = ({torch.transpose}, {"transpose"})


def _swaps_first_and_last(node: Any) -> bool:
    """Whether ``node`` is ``t.transpose(1, -1)`` (or ``(-1, 1)``, method or function)."""
    return (_is(node, _TRANSPOSE) and len(node.args) == 3 and not node.kwargs
            and tuple(node.args[1:]) in ((1, -1), (-1, 1)))


def _sole_user(node: fx.Node) -> Any:
    return next(iter(node.users)) if len(node.users) == 1 else None


Affine = Tuple[fx.Node, str, Optional[str], int, Optional[int]]


def _broadcast_affine(node: fx.Node, gm: fx.GraphModule) -> Optional[Affine]:
    """``(output, weight, bias, C, rank)`` of ``node * w (+ b)``, ``w`` / ``b`` broadcast over dim 1
    of a tensor of that rank, else ``None``."""
    scaled = _affine(node, gm)
    if scaled is None:
        return None
    out, w_target, channels, rank = scaled
    shifted = _bias(out, gm, channels, rank)
    out, b_target = shifted if shifted is not None else (out, None)
    return out, w_target, b_target, channels, rank


def _transposed_affine(node: fx.Node, gm: fx.GraphModule) -> Optional[Affine]:
    """``(output, weight, bias, C, None)`` of ``(w * node.transpose(1, -1) + b).transpose(1, -1)``
    with ``w`` / ``b`` vectors over the last dimension (asteroid's ``_LayerNorm``): the same
    per-channel affine for a tensor of any rank; else ``None``."""
    swapped = _sole_user(node)
    if not _swaps_first_and_last(swapped):
        return None
    scaled = _affine(swapped, gm)
    if scaled is None or scaled[3] != 2:  # a vector the last dimension broadcasts over
        return None
    out, w_target, channels, _ = scaled
    shifted = _bias(out, gm, channels, 2)
    out, b_target = shifted if shifted is not None else (out, None)
    back = _sole_user(out)
    return (back, w_target, b_target, channels, None) if _swaps_first_and_last(back) else None


def _replacement(dims: Tuple[int, ...], rank: Optional[int], input_rank: Optional[int]) -> Any:
    """The norm the pattern computes: a channel LayerNorm (statistics over dim 1), a GroupNorm
    with one group (statistics over dims 1 .. rank - 1 of an input whose rank the graph or the
    broadcast affine tensors show), or ``None`` (the affine tensors broadcast over another
    dimension than the channels; statistics over only some of the dimensions)."""
    if rank is not None and input_rank not in (None, rank):
        return None
    if dims == (1,):
        return channel_layer_norm
    known = input_rank if input_rank is not None else rank
    return F.group_norm if known == len(dims) + 1 else None


_CONV_RANK = {F.conv1d: 3, F.conv2d: 4, F.conv3d: 5}
_SAME_RANK_MODULES = (nn.Identity, nn.Dropout, nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.SiLU, nn.GELU, nn.Hardswish,
                      nn.Mish, nn.PReLU, nn.ELU, nn.Tanh, nn.Sigmoid)


def known_rank(node: Any, gm: fx.GraphModule) -> Optional[int]:
    """The rank of ``node``'s value where the graph shows it (a convolution's output, through
    activations and sums), else ``None``."""
    for _ in range(8):
        if not isinstance(node, fx.Node):
            return None
        if node.op == "call_module":
            mod = gm.get_submodule(str(node.target))
            if isinstance(mod, nn.modules.conv._ConvNd):
                return len(mod.kernel_size) + 2
            if not isinstance(mod, _SAME_RANK_MODULES) or len(node.args) != 1:
                return None
        elif node.op == "call_function" and node.target in _CONV_RANK:
            return _CONV_RANK[node.target]
        elif not (_is(node, _ADD) or _is(node, _SUB) or _is(node, _MUL)):
            return None
        node = node.args[0]
    return None


def _erase_unused(graph: fx.Graph, start: fx.Node) -> None:
    """Erase ``start`` and, transitively, the nodes feeding it that nothing else reads."""
    todo, erased = [start], set()
    while todo:
        n = todo.pop()
        if n in erased or n.users or n.op in ("placeholder", "output"):
            continue
        inputs = list(n.all_input_nodes)
        graph.erase_node(n)
        erased.add(n)
        todo.extend(inputs)


def _replace_each(gm: fx.GraphModule, replacement: Callable[[fx.Node], Optional[Replacement]]) -> int:
    """Each hand-written norm ``replacement`` finds at a call node of ``gm``'s graph (in graph order;
    nodes an earlier replacement erased are skipped), ``(out, build)``: ``build(graph)`` inserted
    before ``out``, ``out``'s readers reading it, and the pattern's nodes nothing else reads erased.
    Returns how many were replaced (the graph linted and recompiled where any)."""
    graph, done = gm.graph, 0
    for node in list(graph.nodes):
        if node.graph is not graph or node.op not in ("call_function", "call_method"):
            continue  # erased by an earlier replacement
        found = replacement(node)
        if found is None:
            continue
        out, build = found
        with graph.inserting_before(out):
            new = build(graph)
        out.replace_all_uses_with(new)
        _erase_unused(graph, out)
        done += 1
    if done:
        graph.lint()
        gm.recompile()
    return done


def hand_channel_layer_norms(gm: fx.GraphModule) -> int:
    """Replace each hand-written channel LayerNorm of ``gm`` (module docstring) by one
    :func:`~convbn.functional.norms.channel_layer_norm` node, and each hand-written global one
    (statistics over every dimension after the batch's) by one ``F.group_norm(x, 1, ...)`` node.
    Returns how many were replaced.

    Note: [a hand-written LayerNorm computes as F.layer_norm after convert]
    """
    return _replace_each(gm, lambda node: _layer_norm_at(node, gm))


def _layer_norm_at(node: fx.Node, gm: fx.GraphModule) -> Optional[Replacement]:
    """The replacement of the hand-written LayerNorm whose normalisation ends at ``node``, if any."""
    found = _normalised(node)
    if found is None:
        return None
    x, eps, dims = found
    affine = _broadcast_affine(node, gm) or _transposed_affine(node, gm)
    if affine is None:
        return None  # no weight: the channel count is not known before run time
    out, w_target, b_target, channels, rank = affine
    norm = _replacement(dims, rank, known_rank(x, gm))
    if norm is None:
        return None

    def build(graph: fx.Graph) -> fx.Node:
        w = graph.get_attr(w_target)
        b = graph.get_attr(b_target) if b_target is not None else None
        args = (x, (channels,), w, b, eps) if norm is channel_layer_norm else (x, 1, w, b, eps)
        return graph.call_function(norm, args)

    return out, build
