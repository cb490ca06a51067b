"""A LayerNorm over the channels of a channels-last map read by a Linear: a norm chain's head.

Note: [a channels-last LayerNorm before a Linear]
MaxViT's and CoAtNet's ``PartitionAttentionCl``, MambaOut's ``GatedCNNBlock``, GCViT's and
EdgeNeXt's blocks keep their maps channels-last, ``(N, H, W, C)`` (a transformer its tokens,
``(B, T, C)``), and apply ``nn.LayerNorm(C)`` over the last dimension -- a norm over the channels
-- whose output (after an activation, or not) only an ``nn.Linear`` reads. Seen through
``x.permute(0, 3, 1, 2)`` that is ``channel_layer_norm -> act -> 1x1 convolution``: the
pre-activation ``norm -> act -> conv`` a per-sample norm chain fuses (a head normalising the
chain input, then a layer with a convolution). :func:`norm_linears`, a canonicalising rewrite
(chains only), writes it so:

    ln(x) -> act -> linear(., W, b)
    ==>  channel_layer_norm(x.permute(0, 3, 1, 2)) -> act -> channel_linear(., W, b) -> .permute(0, 2, 3, 1)

and, where the norm's output is moved channels-first for a convolution (MambaOut's downsampling:
``norm(x).permute(0, 3, 1, 2) -> conv``), ``channel_layer_norm(x.permute(0, 3, 1, 2)) -> conv``;
where it is partitioned into windows for an attention's Linear, the norm moves after the partition
first (Note: [a norm after the window partition]).

Every op runs on the tensor eager's would (``channel_layer_norm`` permutes back to ``x`` itself
and runs ``F.layer_norm`` on it; the activation keeps its input's strides; ``channel_linear``
moves the channels last again and runs ``F.linear``): the same values wherever the graph runs,
fused or not. Matching then finds the norm as a site, the activation as its tail and
``channel_linear`` as the convolution after it (``match_conv.py``), and the chain's Function keeps
``x`` and the norm's statistics where eager keeps ``x``, the norm's output and the activation's.

Only activations without parameters may stand between them (a PReLU's weight or a dropout's
mask would be laid out over the other dimensions), every value between is read once, the map's
rank is known (recorded by a trace with real inputs, or stated by the graph's ops:
``graph/value_rank.py``) and is 3 or more, the Linear is a module with
torch's forward and no hooks, or ``F.linear`` on a module's stored weight. A LayerNorm over the
channels of a 4-D or larger map that stays is reported with why (:func:`channels_last_norms_left`).
"""
from __future__ import annotations

import operator
import warnings
from typing import Any, List, Optional, Tuple, Union

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from ...functional.activations import Activation, activation_from_module
from ...functional import norms as norm_table
from ...functional.conv import channel_linear
from ..bn.norm_sites import _layer_norm_call, _permute_dims, _to_first, _to_last
from ..graph.hooks import hook_reason
from ..graph.layers import has_standard_forward, node_arg
from ..graph.shape_capture import RANK
from ..graph.shape_uses import value_users
from ..graph.value_rank import value_rank
from .match_tail import describe_node, match_tail, TailOpMatch

__all__ = ["norm_linears", "channels_last_norms_left"]

#: what the rewrite found for one norm: (rank, tail ops, its reader -- the Linear, or a permute to channels-first --,
#: the Linear's weight and bias)
Found = Tuple[int, List[TailOpMatch], fx.Node, Any, Any]


def _plain_activation(op: TailOpMatch) -> bool:
    """An activation with no parameters (its values do not depend on which dim is the channel)."""
    e = op.element
    if isinstance(e, Activation):
        return True
    return isinstance(e, nn.Module) and not isinstance(e, nn.PReLU) and activation_from_module(e) is not None


def _linear_of(node: fx.Node, src: fx.Node, gm: fx.GraphModule) -> Union[Tuple[Any, Any, Optional[str]], str]:
    """``(weight, bias, module target)`` of a Linear reading ``src`` as its input, or why not."""
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        if not isinstance(mod, nn.Linear):
            return f"{describe_node(node)} reads it, not a Linear"
        if not has_standard_forward(mod):
            return f"{describe_node(node)} is a Linear with its own forward"
        hooks = hook_reason(mod)
        if hooks:
            return f"the Linear {describe_node(node)} runs as a module call ({hooks})"
        if len(node.args) != 1 or node.kwargs or node.args[0] is not src:
            return f"{describe_node(node)} is called with other arguments"
        return mod.weight, mod.bias, str(node.target)
    if node.op == "call_function" and node.target is F.linear:
        w, b = node_arg(node, 1, "weight", None), node_arg(node, 2, "bias", None)
        if node_arg(node, 0, "input", None) is not src or len(node.args) + len(node.kwargs) > 3:
            return f"{describe_node(node)} does not read it as its input"
        if not all(t is None or (isinstance(t, fx.Node) and t.op == "get_attr") for t in (w, b)) or w is None:
            return "the F.linear reading it takes a weight or bias computed in forward, not a module's stored tensor"
        return w, b, None
    return f"{describe_node(node)} reads it, not a Linear"


def _find(ln: fx.Node, gm: fx.GraphModule, root: nn.Module, prefix: str) -> Union[Found, str, None]:
    """What :func:`norm_linears` rewrites at ``ln``, why it does not (a LayerNorm over the last dim
    of a map of rank 3 or more), or ``None`` (no such LayerNorm: a token norm of unknown rank)."""
    found = _layer_norm_call(ln, gm)
    if found is None or found[5].last_dim is None:
        return None
    x = node_arg(ln, 0, "input", None)
    rank = value_rank(x, gm)
    if rank is None or rank < 3:
        return None
    tail = match_tail(ln, root, prefix)
    ops = []
    for op in tail.ops:
        if not _plain_activation(op):
            break
        ops.append(op)
    out = ops[-1].node if ops else ln
    inner = [ln, *(n for op in ops for n in (op.node, *op.extra))]
    if any(len(n.users) != 1 for n in inner if n is not out) or tail.shape_uses:
        return "a value between the norm and the next op is read by more than one op"
    users = list(out.users)
    if len(users) != 1:
        values = value_users(out)
        shapes = " (and its shape is read)" if len(values) < len(users) else ""
        return "its output is read by " + ", ".join(describe_node(u) for u in values) + shapes
    if _permute_dims(users[0]) == _to_first(rank) and node_arg(users[0], 0, "input", None) is out:
        return rank, ops, users[0], None, None  # moved back channels-first: a channel LayerNorm (-> conv)
    got = _linear_of(users[0], out, gm)
    if isinstance(got, str):
        return got
    return rank, ops, users[0], got[0], got[1]


def _drop_identities(ln: fx.Node, gm: fx.GraphModule) -> None:
    """Bypass the ``nn.Identity`` calls (no hooks) on the single-reader path after a last-dim norm
    (timm's ``act_layer=None`` / ``drop_path`` of 0): no-ops, the module stays registered."""
    node = ln
    for _ in range(8):
        if len(node.users) != 1:
            return
        user = next(iter(node.users))
        if user.op == "call_module" and type(gm.get_submodule(str(user.target))) is nn.Identity \
                and not hook_reason(gm.get_submodule(str(user.target))) and user.args == (node,) and not user.kwargs:
            user.replace_all_uses_with(node)
            gm.graph.erase_node(user)
            continue
        node = user


def _rewrite_reader(gm: fx.GraphModule, out: fx.Node, reader: fx.Node, w: Any, b: Any, rank: int) -> None:
    """The reader of the norm's (tail's) output ``out``, now channels-first: a Linear becomes
    ``channel_linear`` and a permute back to channels-last; a permute to channels-first goes."""
    graph = gm.graph
    if reader.op == "call_method" and reader.target == "permute" or reader.target is torch.permute:
        reader.replace_all_uses_with(out)
        graph.erase_node(reader)
        return
    with graph.inserting_before(reader), warnings.catch_warnings():
        # a parametrized weight (torch.nn.utils.parametrize) is a property, no registered tensor:
        # fx warns, and the generated code reads it as the module's forward would (getattr)
        warnings.filterwarnings("ignore", message="Attempted to insert a get_attr Node with no underlying reference")
        if reader.op == "call_module":
            w = graph.get_attr(f"{reader.target}.weight")
            b = graph.get_attr(f"{reader.target}.bias") if b is not None else None
        cl = graph.call_function(channel_linear, (out, w, b))
        back = graph.call_method("permute", (cl, *_to_last(rank)))
    cl.meta[RANK] = rank
    reader.replace_all_uses_with(back)
    graph.erase_node(reader)


def _channels(v: Any, c: int, gm: fx.GraphModule) -> bool:
    """Whether a size argument ``v`` is the channel count ``c``: the int, or the last entry of a
    ``.shape`` read (``B, H, W, C = x.shape``)."""
    if type(v) is int:
        return v == c
    if not (isinstance(v, fx.Node) and v.op == "call_function" and v.target is operator.getitem):
        return False
    shape, idx = v.args
    if not (isinstance(shape, fx.Node) and shape.op == "call_function" and shape.target is getattr
            and shape.args[1] == "shape" and type(idx) is int):
        return False
    rank = value_rank(shape.args[0], gm)
    return idx == -1 or (rank is not None and idx == rank - 1)


def _moves_rows(node: fx.Node, src: fx.Node, c: int, gm: fx.GraphModule) -> bool:
    """Whether ``node`` only rearranges the rows of ``src``, each position's ``c`` channels kept
    whole and last (a window partition's ``view`` / ``permute`` / ``contiguous`` / ``reshape``)."""
    if node_arg(node, 0, "input", None) is not src or node.kwargs:
        return False
    if node.op == "call_method" and node.target == "contiguous":
        return len(node.args) == 1
    dims = _permute_dims(node)
    if dims is not None:
        return dims[-1] in (len(dims) - 1, -1)
    if node.op == "call_method" and node.target in ("view", "reshape") and len(node.args) > 1:
        sizes = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (tuple, list)) else node.args[1:]
        return len(sizes) >= 2 and _channels(sizes[-1], c, gm)
    return False


def _norm_after_partition(ln: fx.Node, gm: fx.GraphModule) -> bool:
    """Note: [a norm after the window partition]
    A LayerNorm's output partitioned into windows (``view -> permute -> contiguous -> view``,
    channels kept last) for an attention whose ``qkv`` Linear reads it: each position is normalised
    alone, so partitioning the norm's input and normalising the windows is the same values in the
    same layout (the Linear gets the very tensor), and the norm then stands right before its
    Linear. Its shape reads are read off its input (the same shape). The norm's affine gradients sum
    the positions in the windows' order: equal up to rounding. Returns whether it moved."""
    found = _layer_norm_call(ln, gm)
    x = node_arg(ln, 0, "input", None)
    if found is None or not isinstance(x, fx.Node) or (ln.op == "call_module" and (len(ln.args) != 1 or ln.kwargs)):
        return False
    c, path, cur = int(found[0][0]), [], ln
    for _ in range(6):
        users = value_users(cur)
        if len(users) != 1 or not _moves_rows(users[0], cur, c, gm):
            break
        path.append(users[0])
        cur = users[0]
    users = value_users(cur)
    if not path or len(users) != 1 or isinstance(_linear_of(users[0], cur, gm), str):
        return False
    graph = gm.graph
    with graph.inserting_after(cur):
        moved = graph.create_node(ln.op, ln.target, tuple(cur if a is x else a for a in ln.args),
                                  {k: (cur if v is x else v) for k, v in ln.kwargs.items()})
    users[0].replace_input_with(cur, moved)
    for u in list(ln.users):  # the shape reads, and the first rearrangement: of the input now
        u.replace_input_with(ln, x)
    graph.erase_node(ln)
    return True


def norm_linears(gm: fx.GraphModule, root: nn.Module, prefix: str) -> int:
    """Rewrite each LayerNorm (RMSNorm) over the channels of a channels-last map that a Linear
    reads as ``channel_layer_norm -> act -> channel_linear`` between permutes (Note: [a
    channels-last LayerNorm before a Linear]). Returns how many were rewritten."""
    graph, done = gm.graph, 0
    for ln in list(graph.nodes):
        if _layer_norm_call(ln, gm) is not None and (value_rank(node_arg(ln, 0, "input", None), gm) or 0) >= 3:
            _norm_after_partition(ln, gm)  # Note: [a norm after the window partition]
    for ln in list(graph.nodes):
        if _layer_norm_call(ln, gm) is not None:
            _drop_identities(ln, gm)
        found = _find(ln, gm, root, prefix)
        if found is None or isinstance(found, str):
            continue
        rank, ops, lin, w, b = found
        shape, nw, nb, eps, target, row = _layer_norm_call(ln, gm)  # type: ignore[misc]
        with graph.inserting_before(ln):
            xp = graph.call_method("permute", (node_arg(ln, 0, "input", None), *_to_first(rank)))
            if target is not None:  # a module: its tensors as get_attr nodes
                nw = graph.get_attr(f"{target}.weight") if nw is not None else None
                nb = graph.get_attr(f"{target}.bias") if nb is not None else None
            new = graph.call_function(row.functions[0], row.last_dim.channel_args(xp, shape, nw, nb, eps))
        _rewrite_reader(gm, ops[-1].node if ops else new, lin, w, b, rank)
        ln.replace_all_uses_with(new)
        graph.erase_node(ln)
        done += 1
    if done:
        graph.lint()
        gm.recompile()
    return done


def _norm_name(ln: fx.Node, gm: fx.GraphModule, prefix: str) -> str:
    """The report's name of a norm node: its module, the module holding its weight (a subclass
    with its own forward calling ``F.layer_norm``, as timm's ``LayerNorm``), else the call."""
    _, w, b, _, target, _ = _layer_norm_call(ln, gm)  # type: ignore[misc]
    if target is not None:
        return prefix + target
    held = next((t for t in (w, b) if isinstance(t, fx.Node) and t.op == "get_attr"), None)
    if held is not None:
        return prefix + str(held.target).rpartition(".")[0]
    return f"{getattr(ln.target, '__name__', ln.target)}() call '{ln.name}' in {prefix.rstrip('.') or '<root>'}"


def _hooked_last_dim_norm(node: fx.Node, gm: fx.GraphModule) -> Optional[str]:
    """The hooks of a last-dim norm module (``nn.LayerNorm`` / ``nn.RMSNorm``) called by ``node``, or ``None``."""
    if node.op != "call_module":
        return None
    mod = gm.get_submodule(str(node.target))
    if not any(r.last_dim is not None and isinstance(mod, r.last_dim.module) for r in norm_table.NORMS):
        return None
    return hook_reason(mod)


def channels_last_norms_left(gm: fx.GraphModule, root: nn.Module, prefix: str, chain: bool) -> List[Tuple[str, str]]:
    """``(name, reason)`` of each LayerNorm (RMSNorm) over the last dim of a map of rank 4 or more
    left in ``gm`` after :func:`norm_linears`: a norm over the channels of a channels-last map the
    report names (a token norm on ``(B, T, C)`` is not a channel norm, and stays unlisted)."""
    left: List[Tuple[str, str]] = []
    for ln in gm.graph.nodes:
        hooked = _hooked_last_dim_norm(ln, gm)
        if hooked and (value_rank(node_arg(ln, 0, "input", None), gm) or 0) >= 4:
            left.append((prefix + str(ln.target), f"it runs as a module call ({hooked}): a LayerNorm over the last dim "
                         "fuses with a Linear after it only without hooks"))
            continue
        found = _find(ln, gm, root, prefix)
        if found is None or value_rank(node_arg(ln, 0, "input", None), gm) < 4:  # type: ignore[operator]
            continue
        if not isinstance(found, str) and chain:  # rewritten by norm_linears: a site of its own
            continue
        name = _norm_name(ln, gm, prefix)
        if isinstance(found, str):
            why = (f"{found} (a LayerNorm over the last dim, a channels-last map's channels, fuses with a Linear "
                   "that alone reads it, after a parameter-free activation or not)")
        else:
            why = "it would start a pre-activation chain (LayerNorm -> Linear), which is fused only in chains; " \
                  "pass chain=True"
        left.append((name, why))
    return left
