"""The two directions a BatchNorm folds in a traced graph: into the layer before it
(:func:`fold_preceding`: a conv / conv-transpose / linear, every conv of a channel
concatenation, or a linear whose tokens it normalises through a transpose) or, where exact,
into the conv / linear after it (:func:`fold_following`). Each returns ``(done, why not)``;
a fold gives the layer its folded weights (maths in :mod:`convbn.functional.fold`), drops the
BatchNorm and records a ``"folded"`` outcome."""
from __future__ import annotations

from typing import Optional, Set, Tuple

import torch.fx as fx
from torch import Tensor, nn
from ..._compat import pytree

from ...functional.fold import fold_bn_into_following, fold_bn_into_preceding
from ..bn.tokens import features_to_dim1
from ..graph.concat_heads import cat_parts, channel_cat_pieces
from ..graph.hooks import hook_reason
from ..graph.layers import layer_spec
from ..graph.shape_uses import value_users
from ..report.outcome import BNOutcome
from .left_reasons import activation_before_layer
from .folder import GraphFolder
from .match import FoldLayer, FoldSite

__all__ = ["fold_preceding", "fold_following"]


def _pads_with_zeros(layer: FoldLayer) -> bool:
    """Whether conv ``layer`` reads zeros beyond its input's border (see Note: [folding into
    the following conv]); ``True`` where its geometry is computed in forward. Module and
    functional convs alike, from their :class:`~convbn.functional.conv.ConvSpec`."""
    try:
        spec = layer_spec(layer.call, layer.weight.shape)
    except (TypeError, ValueError):  # non-constant geometry: cannot tell, so do not fold
        return True
    return any(spec.padding) or (bool(spec.pre_pad) and spec.pre_pad_mode == "constant")


def _rank_ok(folder: GraphFolder, site: FoldSite, layer: FoldLayer) -> Optional[str]:
    """None if the BN surely normalises the layer's channel dimension, else why not."""
    want = layer.weight.dim()  # batched rank of the layer's output (= its input for conv)
    if site.ranks and (layer.kind == "linear" or want not in site.ranks):
        return f"{site.name} computes a batch norm only on {list(site.ranks)}-D inputs"
    ranks: Optional[Set[int]] = None
    if site.module is not None:
        ranks = folder.ctx.bn_input_ranks.get(id(site.module))
    elif layer.kind == "linear" and layer.module is not None:
        ranks = folder.ctx.linear_out_ranks.get(id(layer.module))
    if ranks:
        if ranks != {want}:
            return (f"BatchNorm sees {sorted(ranks)}-D inputs but {layer.name} works on "
                    f"{want}-D batches, so BN's channel dim is not the layer's")
        return None
    if layer.kind == "linear":
        return ("cannot tell whether the BatchNorm normalises the Linear's features (2-D input) "
                "or dim 1 of a 3-D input; pass example_inputs to fold() so it can see the shapes")
    return None


def _mismatch(folder: GraphFolder, site: FoldSite, layer: FoldLayer, channels: int, side: str) -> Optional[str]:
    """Why the BN cannot normalise ``layer``'s ``side`` (``"input"`` / ``"output"``) with
    ``channels`` channels, or ``None``."""
    if channels != site.running_mean.numel():
        return f"{layer.name} has {channels} {side} channels, BN {site.running_mean.numel()}"
    return _rank_ok(folder, site, layer)


def _fold(folder: GraphFolder, site: FoldSite, layer: FoldLayer, weight: Tensor, bias: Tensor, replacement: fx.Node,
          direction: str) -> Tuple[bool, str]:
    """Give ``layer`` the folded ``weight`` / ``bias``, drop the BN (its users read
    ``replacement``) and record the outcome."""
    note = folder.installer.install(layer, weight, bias)
    folder.installer.remove_bn(site, replacement)
    folder.ctx.report.outcomes.append(BNOutcome(site.name, "folded", layer.name, direction, note))
    return True, ""


def fold_preceding(folder: GraphFolder, site: FoldSite) -> Tuple[bool, str]:
    """Fold ``site`` into the layer (or the concatenated layers, or the linear over tokens)
    whose output it normalises; ``(False, why)`` where it cannot."""
    layer = folder.layer(site.input)
    if isinstance(layer, str):
        if isinstance(site.input, fx.Node) and cat_parts(site.input) is not None:
            return fold_preceding_cat(folder, site, site.input)
        src = features_to_dim1(site.input)
        if src is not None:
            return fold_preceding_tokens(folder, site, src)
        return False, f"before it: {layer}"
    if len(value_users(layer.node)) != 1:  # x.shape / x.ndim reads stay valid after folding
        others = ", ".join(f"'{u.name}'" for u in value_users(layer.node) if u is not site.node)
        return False, (f"before it: output of {layer.name} is also used by {others} "
                       "(folding would change it for them)")
    why = _mismatch(folder, site, layer, layer.out_channels, "output")
    if why:
        return False, f"before it: {why}"
    w, b = fold_bn_into_preceding(layer.weight, layer.bias, site.running_mean, site.running_var,
                                  site.eps, site.weight, site.bias,
                                  transposed=layer.kind == "convt", groups=layer.groups)
    return _fold(folder, site, layer, w, b, layer.node, "preceding")


# Note: [folding into the layers of a concatenation]
# BN is per channel, so BN(cat([y_1, ..., y_k], 1)) == cat([BN_1(y_1), ..., BN_k(y_k)], 1)
# where BN_i is BN restricted to the channels y_i occupies (its slice of running_mean,
# running_var, weight, bias; the same eps). Where every y_i is a conv / linear output read
# only by the concatenation (a mixed-kernel conv: split -> convs of several kernel sizes
# -> cat), each BN_i folds into its layer as a preceding BN does, and the BN goes.
def fold_preceding_cat(folder: GraphFolder, site: FoldSite, cat: fx.Node) -> Tuple[bool, str]:
    """Fold ``site`` into every layer whose output its input concatenates (along channels)."""
    layers = []
    for piece in cat.args[0] if cat.args else cat.kwargs["tensors"]:
        layer = folder.layer(piece)
        if isinstance(layer, str):
            return False, (f"before it: a channel concatenation whose piece {layer}; a BN after a concatenation "
                           "folds only when every piece is a conv/linear output")
        layers.append(layer)
    ranks = {layer.weight.dim() for layer in layers}
    if len(ranks) != 1 or channel_cat_pieces(cat, ranks.pop()) is None or any(l.kind == "linear" for l in layers):
        return False, "before it: a concatenation, but not along the channels of conv outputs of one rank"
    if len({id(l.node) for l in layers}) != len(layers) or len(value_users(cat)) != 1:
        return False, "before it: the concatenation (or a layer output in it) is also used elsewhere"
    for layer in layers:
        if len(value_users(layer.node)) != 1:
            return False, (f"before it: output of {layer.name} is also used outside the concatenation "
                           "(folding would change it there)")
        why = _rank_ok(folder, site, layer)
        if why:
            return False, f"before it: {why}"
    if sum(l.out_channels for l in layers) != site.running_mean.numel():
        return False, (f"before it: the concatenated layers have {sum(l.out_channels for l in layers)} channels, "
                       f"BN {site.running_mean.numel()}")
    start, notes = 0, []
    for layer in layers:
        part = slice(start, start + layer.out_channels)
        start += layer.out_channels
        w, b = fold_bn_into_preceding(layer.weight, layer.bias, site.running_mean[part], site.running_var[part],
                                      site.eps, None if site.weight is None else site.weight[part],
                                      None if site.bias is None else site.bias[part],
                                      transposed=layer.kind == "convt", groups=layer.groups)
        note = folder.installer.install(layer, w, b)
        if note:
            notes.append(note)
    folder.installer.remove_bn(site, cat)
    names = ", ".join(l.name for l in layers)
    folder.ctx.report.outcomes.append(BNOutcome(site.name, "folded", names, "preceding", "; ".join(notes)))
    return True, ""


# Note: [folding into a linear layer over tokens]
# A Linear on tokens (B, L, C_in) -> (B, L, C) with BatchNorm1d over its features is
# written y.transpose(1, 2) -> BN1d -> (B, C, L): the transpose moves the Linear's feature
# dim to BN's channel dim 1, so BN(y^T) == (s * y + t)^T folds into the Linear as a
# preceding BN does (W' = s W per output feature), and the BN's users read the transpose.
# The ranks seen on the sample input must say so: the BN's input 3-D, the Linear's output 3-D.
def fold_preceding_tokens(folder: GraphFolder, site: FoldSite, src: fx.Node) -> Tuple[bool, str]:
    """Fold ``site`` into the linear layer whose 3-D output ``site.input`` transposes."""
    layer = folder.layer(src)
    if isinstance(layer, str):
        return False, f"before it: a transpose of features to dim 1, but {layer}"
    if layer.kind != "linear":
        return False, f"before it: a transpose of {layer.name}'s output, not of a linear layer's tokens"
    if len(value_users(src)) != 1 or len(value_users(site.input)) != 1:
        return False, f"before it: the output of {layer.name} (or its transpose) is also used elsewhere"
    bn_ranks = folder.ctx.bn_input_ranks.get(id(site.module)) if site.module is not None else None
    lin_ranks = folder.ctx.linear_out_ranks.get(id(layer.module)) if layer.module is not None else None
    if bn_ranks != {3} or (layer.module is not None and lin_ranks != {3}):
        return False, (f"before it: a transpose of {layer.name}'s output; it folds only where the sample input "
                       "shows 3-D tokens (pass example_inputs to fold())")
    if layer.out_channels != site.running_mean.numel():
        return False, f"before it: {layer.name} has {layer.out_channels} output features, BN {site.running_mean.numel()}"
    w, b = fold_bn_into_preceding(layer.weight, layer.bias, site.running_mean, site.running_var,
                                  site.eps, site.weight, site.bias)
    note = folder.installer.install(layer, w, b)
    folder.installer.remove_bn(site, site.input)
    folder.ctx.report.outcomes.append(BNOutcome(site.name, "folded", layer.name, "preceding", note))
    return True, ""


def _past_identities(folder: GraphFolder, node: fx.Node) -> Optional[fx.Node]:
    """The one reader of ``node``'s value past a run of hook-free ``nn.Identity`` calls, each the
    only reader of the one before (timm's norm-act ``drop`` / ``act`` and a block's ``down``), or
    ``None`` where no identity follows ``node``: they compute nothing, so what folds into that
    reader folds exactly through them (they stay in the graph, reading the BN's input)."""
    cur, found = node, False
    while True:
        users = value_users(cur)
        if len(users) != 1 or users[0].op != "call_module":
            return users[0] if found and len(users) == 1 else None
        mod = folder.gm.get_submodule(str(users[0].target))
        if type(mod) is not nn.Identity or hook_reason(mod) is not None:
            return users[0] if found else None
        cur, found = users[0], True


# Note: [folding into the following conv]
# conv(BN(x)) == conv'(x) with W' = W * s (per input channel) and b' = b + sum(W * t)
# holds wherever the kernel only reads real input pixels. Zero padding breaks it: the
# border reads 0, which would have to become BN(0)-equivalent t. With padding 0 /
# 'valid' there is no border; with padding_mode 'reflect'/'replicate'/'circular' the
# border is copied from real pixels of the same channel, and BN is per channel and
# element-wise, so pad(BN(x)) == BN(pad(x)): also exact. Transposed convs insert zeros
# (stride and padding), so they are never folded this way.
def fold_following(folder: GraphFolder, site: FoldSite) -> Tuple[bool, str]:
    """Fold ``site`` into the conv / linear that alone reads its output, where exact;
    ``(False, why)`` where it cannot."""
    users = value_users(site.node)
    if len(users) != 1:
        return False, f"after it: BN output has {len(users)} users"
    reader = _past_identities(folder, site.node)
    layer = folder.layer(users[0] if reader is None else reader)
    if isinstance(layer, str):
        between = activation_before_layer(folder, users[0])
        if between is not None:
            return False, (f"after it: {between[0]} sits between it and {between[1]} (pre-activation), "
                           "and act(BN(x)) is not a per-channel affine map, so it cannot be folded exactly")
        return False, f"after it: {layer}"
    if layer.kind == "convt":
        return False, f"after it: {layer.name} is a transposed conv (inserts zeros), not exact"
    fed = site.node if reader is None else reader.args[0]  # the value the layer reads: BN's, or the last identity's
    if layer.call.input is not fed or sum(a is fed for a in pytree.tree_leaves((layer.node.args, layer.node.kwargs))) != 1:
        return False, f"after it: BN output is not (only) the input of {layer.name}"
    if layer.kind == "conv" and _pads_with_zeros(layer):
        return False, (f"after it: {layer.name} zero-pads its input, so folding the BN into it "
                       "would be inexact at the border")
    why = _mismatch(folder, site, layer, layer.in_channels, "input")
    if why:
        return False, f"after it: {why}"
    w, b = fold_bn_into_following(layer.weight, layer.bias, site.running_mean, site.running_var,
                                  site.eps, site.weight, site.bias, groups=layer.groups)
    return _fold(folder, site, layer, w, b, site.input, "following")
