"""Per-sample norm sites: where a traced graph computes a norm of :data:`convbn.functional.norms.NORMS`.

The table says how each norm is spelled (module classes with torch's forward, functional
calls); this module finds those spellings in a graph and gives each a site with a
:class:`~convbn.nn.norm_view.NormView`, the same :class:`~convbn.passes.bn.sites.BNSite`
records BatchNorm sites are, so matching (``convert/match.py``) finds the convolution before
and the tail after exactly as for BatchNorm. A norm it recognises but cannot fuse is returned
with the reason (the report lists it). A norm removed from the table is recognised nowhere.

Note: [a channel LayerNorm is one node]
A LayerNorm over the channels is written channels-last: ``x.permute(0, 2, 3, 1)``, an
``nn.LayerNorm(C)`` (or ``F.layer_norm(..., (C,), ...)``, as timm's ``LayerNorm2d`` does in its
forward), then the permute back. :func:`channel_layer_norms` (a canonicalising rewrite of
convert's pipeline) replaces the three nodes by one call of
:func:`convbn.functional.norms.channel_layer_norm`, which runs those very ops (same values
wherever the graph runs); a LayerNorm module with hooks stays a module call. Where the
channels-last result is read as it is (ConvNeXt's block: LayerNorm -> Linear MLP -> permute
back), the permute and LayerNorm become ``channel_layer_norm(x).permute(0, 2, 3, 1)``: the
same values in the same strides (the two permutes compose to none).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from ...functional import norms as norm_table
from ...functional.norms import NormRow, row_of_function, row_of_module
from ...nn.norm_view import NormView
from ..graph.hooks import hook_reason
from ..graph.layers import node_arg, normalize_args
from .hand_layer_norms import known_rank
from .sites import BNSite, BNSites, _owner

__all__ = ["find_norm_sites", "channel_layer_norms", "norm_module_names"]


# --------------------------------------------------------------------------- channel LayerNorm

def _permute_dims(node: Any) -> Optional[Tuple[int, ...]]:
    """The dims of a ``permute`` node (method or ``torch.permute``), or ``None``."""
    if not isinstance(node, fx.Node):
        return None
    if node.op == "call_method" and node.target == "permute":
        dims = node.args[1:] if len(node.args) > 2 else node.args[1:2] or (node.kwargs.get("dims"),)
    elif node.op == "call_function" and node.target is torch.permute:
        dims = (node_arg(node, 1, "dims", None),)
    else:
        return None
    if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
        dims = tuple(dims[0])
    return tuple(dims) if all(isinstance(d, int) for d in dims) else None


def _to_last(n: int) -> Tuple[int, ...]:
    return (0, *range(2, n), 1)


def _to_first(n: int) -> Tuple[int, ...]:
    return (0, n - 1, *range(1, n - 1))


def _transpose_dims(node: Any) -> Optional[Tuple[int, int]]:
    """The two dims of a ``transpose`` node (method or ``torch.transpose``, ints), or ``None``."""
    if not isinstance(node, fx.Node) or node.kwargs or len(node.args) != 3:
        return None
    if not ((node.op == "call_method" and node.target == "transpose")
            or (node.op == "call_function" and node.target is torch.transpose)):
        return None
    a, b = node.args[1:]
    return (a, b) if type(a) is int and type(b) is int else None


Move = Tuple[str, Tuple[int, ...]]


_MOVEDIMS = ("movedim", "moveaxis")


def _movedim_pair(node: Any) -> Optional[Tuple[int, int]]:
    """``(source, destination)`` of a ``movedim`` / ``moveaxis`` node (method or function, two
    ints), or ``None``."""
    if not isinstance(node, fx.Node) or node.kwargs or len(node.args) != 3:
        return None
    if not ((node.op == "call_method" and node.target in _MOVEDIMS)
            or (node.op == "call_function" and node.target in (torch.movedim, torch.moveaxis))):
        return None
    a, b = node.args[1:]
    return (a, b) if type(a) is int and type(b) is int else None


def _channels_to_last(node: Any, gm: fx.GraphModule) -> Optional[Move]:
    """``("permute", dims)`` / ``("transpose", (a, b))`` / ``("movedim", (1, -1))`` of a node that
    moves the channels (dim 1) last, else ``None``: a permute to ``(0, 2, ..., 1)``;
    ``movedim(1, -1)`` (diffusers' channel norms: that permute at any rank, in values and
    strides); ``transpose(1, 2)``, ``(1, -1)`` or ``(-2, -1)`` where the graph shows a 3-D input
    (vocos' ConvNeXt block, transformers' speech feature encoders, after a Conv1d): there it is
    that permute, in values and strides. At other ranks a transpose reorders the positions too
    (strides that :func:`~convbn.functional.norms.channel_layer_norm` does not give back): left
    as written."""
    dims = _permute_dims(node)
    if dims is not None:
        return ("permute", dims) if len(dims) >= 3 and dims == _to_last(len(dims)) else None
    if _movedim_pair(node) == (1, -1):
        return "movedim", (1, -1)
    pair = _transpose_dims(node)
    if pair is not None and _swaps_1_and_2(pair) and known_rank(node.args[0], gm) == 3:
        return "transpose", pair  # type: ignore[return-value]
    return None


def _swaps_1_and_2(pair: Tuple[int, int]) -> bool:
    """Whether a transpose of these two dims of a 3-D tensor swaps dims 1 and 2 (``(1, 2)``,
    ``(1, -1)``, ``(-2, -1)`` as transformers' audio encoders write it, in either order)."""
    return sorted(d % 3 for d in pair) == [1, 2] and all(-3 <= d < 3 for d in pair)


def _moves_back(node: Any, move: Move, src: fx.Node) -> bool:
    """Whether ``node`` undoes ``move`` on ``src``."""
    kind, dims = move
    if not isinstance(node, fx.Node) or node.args[:1] != (src,):
        return False
    if kind == "permute":
        return _permute_dims(node) == _to_first(len(dims))
    if kind == "movedim":
        return _movedim_pair(node) == (-1, 1)
    back = _transpose_dims(node)
    return back is not None and _swaps_1_and_2(back)


def _layer_norm_call(node: fx.Node, gm: fx.GraphModule) -> Optional[Tuple[Any, Any, Any, Any, Optional[str], NormRow]]:
    """``(normalized_shape, weight, bias, eps, module target, row)`` of a norm node over one
    dimension that a row's :attr:`~convbn.functional.norms.NormRow.last_dim` names (a module with
    torch's forward and no hooks, or its functional call: ``nn.LayerNorm`` / ``F.layer_norm``,
    ``nn.RMSNorm`` / ``F.rms_norm``), else ``None``."""
    for row in norm_table.NORMS:  # read at call time: the table is the one place a norm is described
        if row.last_dim is None:
            continue
        cls, fn, signature = row.last_dim.module, row.last_dim.function, row.last_dim.signature
        if node.op == "call_module":
            mod = gm.get_submodule(str(node.target))
            if not isinstance(mod, cls) or type(mod).forward is not cls.forward or hook_reason(mod):
                continue
            if len(mod.normalized_shape) != 1 or len(node.args) != 1 or node.kwargs:
                return None
            return tuple(mod.normalized_shape), mod.weight, getattr(mod, "bias", None), mod.eps, str(node.target), row
        if node.op == "call_function" and node.target is fn:
            args = normalize_args(node, signature)
            if args is None:
                return None
            shape = args["normalized_shape"]
            if isinstance(shape, int):
                shape = (shape,)
            if not isinstance(shape, (tuple, list)) or len(shape) != 1:
                return None
            return tuple(shape), args["weight"], args.get("bias"), args["eps"], None, row
    return None


def channel_layer_norms(gm: fx.GraphModule) -> int:
    """Rewrite each ``permute -> LayerNorm (or RMSNorm) over the last dim -> permute back`` (or a transpose
    that moves the channels last: :func:`_channels_to_last`) into one
    :func:`~convbn.functional.norms.channel_layer_norm` node (Note: [a channel LayerNorm is one
    node]; an RMSNorm: one :func:`~convbn.functional.norms.channel_rms_norm` node of form
    ``"rms_norm"``, which runs ``F.rms_norm`` between the same permutes). Returns how many were
    rewritten."""
    graph, done = gm.graph, 0
    for p1 in list(graph.nodes):
        move = _channels_to_last(p1, gm)
        if move is None or len(p1.users) != 1:
            continue
        ln = next(iter(p1.users))
        found = _layer_norm_call(ln, gm)
        if found is None or node_arg(ln, 0, "input", None) is not p1:
            continue
        p2 = next(iter(ln.users)) if len(ln.users) == 1 else None
        back = p2 is not None and _moves_back(p2, move, ln)
        shape, w, b, eps, target, row = found
        with graph.inserting_before(ln):
            if target is not None:  # a module: its tensors as get_attr nodes
                w = graph.get_attr(f"{target}.weight") if w is not None else None
                b = graph.get_attr(f"{target}.bias") if b is not None else None
            new = graph.call_function(row.functions[0], row.last_dim.channel_args(p1.args[0], shape, w, b, eps))
            if not back:  # the channels-last result others read (ConvNeXt's MLP): the same view of it
                last = graph.call_method(move[0], (new, *move[1]))
        if back:
            p2.replace_all_uses_with(new)
            graph.erase_node(p2)
        else:
            ln.replace_all_uses_with(last)
        for n in (ln, p1):
            graph.erase_node(n)
        done += 1
    if done:
        graph.lint()
        gm.recompile()
    return done


# --------------------------------------------------------------------------- sites

_TENSORS = ("weight", "bias", "running_mean", "running_var")


def _functional_site(node: fx.Node, row: NormRow, root: nn.Module, prefix: str) -> Tuple[str, Any]:
    """``(name, NormView or reason)`` of a functional norm call on one module's tensors."""
    args = normalize_args(node, row.signature)
    name = f"{getattr(node.target, '__name__', node.target)}() call '{node.name}' in {prefix.rstrip('.') or '<root>'}"
    if args is None:
        return name, f"its {row.name} call has arguments this pass does not understand"
    tensors = {k: args.get(k) for k in _TENSORS}
    if any(v is not None and (not isinstance(v, fx.Node) or v.op != "get_attr") for v in tensors.values()):
        return name, "its affine parameters or statistics are computed in forward, not a module's stored tensors"
    owners = {_owner(root, str(v.target))[0] for v in tensors.values() if v is not None}
    if len(owners) > 1:
        return name, "its tensors belong to more than one module"
    for v in tensors.values():
        if v is not None and len(v.users) != 1:
            return name, f"its tensor {v.target} is also used elsewhere in the forward"
    call = row.call_of_args(args)
    if isinstance(call, str):
        return name, call
    if not owners:  # no tensors at all: the norm reads nothing of the model's (owner: the traced module)
        return name, NormView(root, row.name, call, _channels(call, None), None, None)  # type: ignore[arg-type]
    path = owners.pop()
    _, _, module = _owner(root, str(next(v for v in tensors.values() if v is not None).target))
    names = {k: (str(v.target).rpartition(".")[2] if v is not None else None) for k, v in tensors.items()}
    first = getattr(module, next(n for n in names.values() if n is not None))
    view = NormView(module, row.name, call, _channels(call, first), names["weight"], names["bias"],  # type: ignore[arg-type]
                    names["running_mean"], names["running_var"])
    return prefix + path if path else name, view


def _channels(call: Any, tensor: Any) -> int:
    if getattr(call, "normalized", ()):
        return int(call.normalized[0])
    return int(tensor.numel()) if tensor is not None else 0


def _module_site(node: fx.Node, mod: nn.Module, row: NormRow, prefix: str) -> Any:
    """A NormView of a norm module call, or why it cannot be one."""
    if type(mod).forward not in row.standard_forwards:
        return f"{type(mod).__name__} has its own forward"
    if len(node.args) != 1 or node.kwargs:
        return "it is called with other than one tensor argument"
    got = row.call_of_module(mod)
    if isinstance(got, str):
        return got
    if getattr(mod, "weight", None) is not None and mod.weight.is_meta:
        return "its parameters are on the meta device"
    return NormView.of_module(mod)


def find_norm_sites(gm: fx.GraphModule, prefix: str, root: Optional[nn.Module] = None) -> BNSites:
    """The per-sample norm sites of ``gm`` convert may fuse, in graph order, and why each other
    norm it recognises is none (``prefix``: ``gm``'s qualified name + ``"."``).

    A site is a call of a norm module of a :data:`~convbn.functional.norms.NORMS` row with
    torch's forward, or a functional call of a row (``F.group_norm``, ``F.instance_norm``, a
    channel LayerNorm: Note: [a channel LayerNorm is one node]) on one module's stored tensors.
    A norm module that updates running statistics and is called more than once is no site.

    Args:
        gm: the traced graph module.
        prefix: qualified-name prefix of the names given.
        root: the module ``gm`` was traced from (default ``gm``): the owner of the tensors
            functional calls read.

    Returns:
        :class:`~convbn.passes.bn.sites.BNSites` whose sites' ``bn`` is a :class:`NormView`.
    """
    owner_root = gm if root is None else root
    found: List[Tuple[fx.Node, str, Any, Any]] = []
    calls: Dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            mod = gm.get_submodule(str(node.target))
            row = row_of_module(mod)
            if row is None:
                continue
            name = prefix + str(node.target)
            calls[name] = calls.get(name, 0) + 1
            found.append((node, name, _module_site(node, mod, row, prefix), node_arg(node, 0, "input", None)))
        elif node.op == "call_function":
            row = row_of_function(node.target)
            if row is None:
                continue
            name, got = _functional_site(node, row, owner_root, prefix)
            found.append((node, name, got, node_arg(node, 0, "input", None)))
    sites: List[BNSite] = []
    left: Dict[str, str] = {}
    for node, name, got, src in found:
        why = got if isinstance(got, str) else None
        if why is None and calls.get(name, 1) > 1 and got.running_mean is not None and got.call().use_input_stats:
            why = f"the norm module is called {calls[name]} times and updates its running statistics at each call"
        if why is None and not isinstance(src, fx.Node):
            why = "its input is not a traced tensor"
        if why is None:
            sites.append(BNSite(node, src, got, name))
        else:
            left.setdefault(name, why)
    return BNSites(sites, list(left.items()))


def norm_module_names(model: nn.Module) -> List[str]:
    """The qualified names of ``model``'s modules of a :data:`~convbn.functional.norms.NORMS` row."""
    return [n for n, m in model.named_modules() if row_of_module(m) is not None]
